#!/usr/bin/env python3
"""Load generator of bench/autoscale.sh: a concurrency schedule against one
gateway, sampled every second into a CSV.

  autoscale_load.py URL SCHEDULE OUT.csv [--max-tokens N] [--prompt P] [--hub HUB_URL]

SCHEDULE is "C:S,C:S,...": C clients for S seconds, in order. Each client
sends /v1/completions (temperature 0, max_tokens N) back to back while its
index is under the current concurrency. Every second a row is written:
  t_s, clients, tokens_s (completion tokens the gateway generated in the
  second, from /metrics), p50_ms, p99_ms (latency of the requests that ended
  in the last 5 s), local_share, level_decisions (widen/tighten totals),
  hot_rate, cold_rate (expert computations/s of the hottest and the coldest
  shard, from the gateway's demand metering), pairs_held_s, pairs_remote_s,
  and with --hub the market's replicas wanted and live of its hottest and its
  coldest shard by reported demand (hot_wanted, hot_live, cold_wanted,
  cold_live; GET HUB/v1/market).
Standard library only (threads and urllib)."""
import json
import re
import sys
import threading
import time
import urllib.request


def metrics(url):
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out, shards = {}, {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^(\S+?)(\{[^}]*\})? (\S+)$", line)
        if not m:
            continue
        name, labels, v = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "kvasir_gateway_shard_computations_total":
            shards[labels] = v
        else:
            out[name + labels] = v
    return out, shards


def market(hub):
    """hot_wanted,hot_live,cold_wanted,cold_live of the hub's market, or empty fields."""
    if not hub:
        return ",,,"
    try:
        with urllib.request.urlopen(hub + "/v1/market", timeout=5) as r:
            sh = json.loads(r.read())["shards"]
    except Exception:
        return ",,,"
    if not sh:
        return ",,,"
    hot = max(sh, key=lambda s: s["demand"])
    cold = min(sh, key=lambda s: s["demand"])
    return "%d,%d,%d,%d" % (hot["wanted"], hot["live"], cold["wanted"], cold["live"])


def pct(xs, q):
    if not xs:
        return ""
    xs = sorted(xs)
    return "%.1f" % xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def main():
    url, sched, out = sys.argv[1], sys.argv[2], sys.argv[3]
    max_tokens, prompt, hub = 64, "Once upon a time", None
    a = sys.argv[4:]
    for i in range(0, len(a), 2):
        if a[i] == "--max-tokens":
            max_tokens = int(a[i + 1])
        elif a[i] == "--prompt":
            prompt = a[i + 1]
        elif a[i] == "--hub":
            hub = a[i + 1]
        else:
            sys.exit("autoscale_load: unknown option " + a[i])
    phases = [(int(c), float(s)) for c, s in (p.split(":") for p in sched.split(","))]
    if not phases or any(c < 0 or c > 64 or s <= 0 for c, s in phases):
        sys.exit("autoscale_load: SCHEDULE is C:S,... with 0 <= C <= 64 (0: idle), S > 0")
    want = [0]
    stop = threading.Event()
    lock = threading.Lock()
    done = []  # (t_end, latency_s, tokens)
    errors = [0]
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()

    def client(i):
        while not stop.is_set():
            if i >= want[0]:
                time.sleep(0.05)
                continue
            t0 = time.monotonic()
            try:
                req = urllib.request.Request(url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=300) as r:
                    n = json.loads(r.read())["usage"]["completion_tokens"]
                t1 = time.monotonic()
                with lock:
                    done.append((t1, t1 - t0, n))
            except Exception as e:  # counted and reported, the run goes on
                with lock:
                    errors[0] += 1
                print("autoscale_load: request failed: %s" % e, file=sys.stderr)
                time.sleep(0.2)

    cmax = max(1, max(c for c, _ in phases))
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(cmax)]
    for t in threads:
        t.start()
    f = open(out, "w")
    f.write("t_s,clients,tokens_s,p50_ms,p99_ms,local_share,widen,tighten,hot_rate,cold_rate,pairs_held_s,pairs_remote_s,"
            "hot_wanted,hot_live,cold_wanted,cold_live\n")
    start = time.monotonic()
    prev, prev_sh = metrics(url)
    prev_t = start
    ends = []
    acc = 0.0
    for c, s in phases:
        acc += s
        ends.append((acc, c))
    while True:
        now = time.monotonic() - start
        cur = next((c for e, c in ends if now < e), None)
        if cur is None:
            break
        want[0] = cur
        time.sleep(1.0)
        m, sh = metrics(url)
        t = time.monotonic()
        dt = t - prev_t
        g = lambda k: (m.get(k, 0.0) - prev.get(k, 0.0)) / dt
        rates = [(sh[k] - prev_sh.get(k, 0.0)) / dt for k in sh]
        with lock:
            lat = [l * 1e3 for (te, l, n) in done if te > t - 5.0]
        f.write("%.1f,%d,%.1f,%s,%s,%s,%d,%d,%.1f,%.1f,%.1f,%.1f," % (
            t - start, cur, g("kvasir_gateway_generated_tokens_total"), pct(lat, 0.5), pct(lat, 0.99),
            "%.2f" % m["kvasir_gateway_local_share"] if "kvasir_gateway_local_share" in m else "",
            m.get('kvasir_gateway_local_decisions_total{decision="widen"}', 0),
            m.get('kvasir_gateway_local_decisions_total{decision="tighten"}', 0),
            max(rates) if rates else 0.0, min(rates) if rates else 0.0,
            g('kvasir_gateway_expert_pairs_total{where="held"}'), g('kvasir_gateway_expert_pairs_total{where="remote"}')))
        f.write(market(hub) + "\n")
        f.flush()
        prev, prev_sh, prev_t = m, sh, t
    stop.set()
    f.close()
    with lock:
        n = len(done)
    print("autoscale_load: %d requests, %d errors" % (n, errors[0]), file=sys.stderr)
    sys.exit(1 if errors[0] else 0)


if __name__ == "__main__":
    main()
