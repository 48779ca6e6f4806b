#!/usr/bin/python3
"""Plots bench/autoscale.sh's CSV (bench/autoscale_load.py's columns) to a
PNG: clients, tokens/s, p50 and p99 latency, the local share, and the demand
rate of the hottest and coldest shards, over time.

  autoscale_plot.py RAMP.csv OUT.png [LOCAL16_TOK_S LOCAL1_P50_MS]

The two optional figures (the local-only gateway's) are drawn as reference
lines. Needs matplotlib (Debian: python3-matplotlib)."""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def col(rows, k):
    return [float(r[k]) if r[k] != "" else float("nan") for r in rows]


def main():
    rows = list(csv.DictReader(open(sys.argv[1])))
    ref_tok = float(sys.argv[3]) if len(sys.argv) > 3 else None
    ref_p50 = float(sys.argv[4]) if len(sys.argv) > 4 else None
    t = col(rows, "t_s")
    fig, ax = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    ax[0].step(t, col(rows, "clients"), where="post", color="black")
    ax[0].set_ylabel("clients")
    a0 = ax[0].twinx()
    a0.plot(t, col(rows, "local_share"), color="tab:orange")
    a0.set_ylabel("local share", color="tab:orange")
    a0.set_ylim(-0.05, 1.05)
    ax[1].plot(t, col(rows, "tokens_s"), label="autoscaling gateway")
    if ref_tok:
        ax[1].axhline(ref_tok, ls="--", color="gray", label="local-only gateway, 16 clients")
    ax[1].set_ylabel("tokens/s")
    ax[1].legend(loc="upper left")
    ax[2].plot(t, col(rows, "p50_ms"), label="p50")
    ax[2].plot(t, col(rows, "p99_ms"), label="p99")
    if ref_p50:
        ax[2].axhline(ref_p50, ls="--", color="gray", label="local-only p50, 1 client")
    ax[2].set_ylabel("request latency (ms)")
    ax[2].set_yscale("log")
    ax[2].legend(loc="upper left")
    ax[3].plot(t, col(rows, "hot_rate"), label="hottest shard")
    ax[3].plot(t, col(rows, "cold_rate"), label="coldest shard")
    ax[3].plot(t, col(rows, "pairs_remote_s"), label="all pairs sent to workers", ls=":")
    ax[3].set_ylabel("expert computations/s")
    if any(r.get("hot_wanted") for r in rows):
        a3 = ax[3].twinx()
        a3.step(t, col(rows, "hot_wanted"), where="post", color="tab:red", label="hottest: wanted")
        a3.step(t, col(rows, "hot_live"), where="post", color="tab:red", ls="--", label="hottest: live")
        a3.step(t, col(rows, "cold_wanted"), where="post", color="tab:purple", label="coldest: wanted")
        a3.step(t, col(rows, "cold_live"), where="post", color="tab:purple", ls="--", label="coldest: live")
        a3.set_ylabel("replicas (hub market)")
        a3.set_ylim(0, 4)
        a3.legend(loc="upper right")
    ax[3].set_xlabel("seconds")
    ax[3].legend(loc="upper left")
    fig.suptitle("bench/autoscale.sh: concurrency 1 -> 16 -> 1, gateway with --local-experts, two workers")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=80)


if __name__ == "__main__":
    main()
