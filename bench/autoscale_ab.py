#!/usr/bin/env python3
"""1-client comparison of bench/autoscale.sh: two gateways, requests
alternated (A, B, A, B, ...; one at a time), so that both see the same
machine: a shared machine's load moves by tens of percent within seconds,
and two 15-s windows minutes apart compare that load, not the gateways.

  autoscale_ab.py URL_A URL_B PAIRS OUT.csv [--max-tokens N] [--prompt P]

Writes one row per pair (pair, a_ms, b_ms) and prints the p50 of each and
their ratio (B over A). Both texts must be equal (temperature 0): exits 1
if they differ. Standard library only."""
import json
import statistics
import sys
import time
import urllib.request


def main():
    a_url, b_url, pairs, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    max_tokens, prompt = 128, "Once upon a time"
    rest = sys.argv[5:]
    for i in range(0, len(rest), 2):
        if rest[i] == "--max-tokens":
            max_tokens = int(rest[i + 1])
        elif rest[i] == "--prompt":
            prompt = rest[i + 1]
        else:
            sys.exit("autoscale_ab: unknown option " + rest[i])
    if not 1 <= pairs <= 10000:
        sys.exit("autoscale_ab: PAIRS must be 1 to 10000")
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()

    def one(url):
        t0 = time.monotonic()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            text = json.loads(r.read())["choices"][0]["text"]
        return (time.monotonic() - t0) * 1e3, text

    for u in (a_url, b_url):  # warm both
        one(u)
    la, lb = [], []
    with open(out, "w") as f:
        f.write("pair,a_ms,b_ms\n")
        for i in range(pairs):
            a, ta = one(a_url)
            b, tb = one(b_url)
            if ta != tb:
                sys.exit("autoscale_ab: the two gateways' texts differ at pair %d" % i)
            la.append(a)
            lb.append(b)
            f.write("%d,%.1f,%.1f\n" % (i, a, b))
    pa, pb = statistics.median(la), statistics.median(lb)
    print("%.1f %.1f %.3f" % (pa, pb, pb / pa))


if __name__ == "__main__":
    main()
