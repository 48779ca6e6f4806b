#!/usr/bin/env bash
# kv-test-labels: net
# The short version of `make bench-wan-sites` (bench/wan_sites.sh, WS_QUICK=1):
# on the two-site bed (two namespaces 40 ms apart), an 8-layer qwen3moe
# model decodes by per-layer dispatch from site A, by the ring of sites
# (each window on its own site's worker) and by that ring with speculative
# decoding (test source at acceptance 0.7, k = 3); every mode's tokens must
# equal `kvasir run` on the GGUF (the script fails otherwise). Function, not
# timings: the figures it prints are not asserted here.
# Needs root (network namespaces): without, it fails.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
out=$(WS_QUICK=1 bash "$SRC/bench/wan_sites.sh" "$(dirname "$KV")" 2>&1) || { echo "$out" >&2; exit 1; }
echo "$out"
grep -q '^experts .*identical' <<<"$out" || { echo "FAIL: no per-layer dispatch row" >&2; exit 1; }
grep -q '^sites .*identical' <<<"$out" || { echo "FAIL: no ring of sites row" >&2; exit 1; }
grep -q '^spec0.7 .*identical' <<<"$out" || { echo "FAIL: no speculative row" >&2; exit 1; }
# a verify pass carries several tokens per crossing at acceptance 0.7
tpc=$(sed -n 's/^spec0.7 .* \([0-9.]*\) tokens\/crossing.*/\1/p' <<<"$out")
awk -v t="$tpc" 'BEGIN { exit !(t > 1.2) }' || { echo "FAIL: $tpc tokens per crossing at acceptance 0.7" >&2; exit 1; }
echo "PASS: per-layer dispatch, the ring of sites and speculation over it give kvasir run's tokens on the WAN bed"
