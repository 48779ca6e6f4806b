#!/usr/bin/env bash
# `make bench-wan-sites`: issue 31's targets (docs/BENCHMARKS.md "WAN: sites
# and speculation") on a two-site bed: two network namespaces, site A and
# site B, WS_RTT ms round trip apart (kv-netdelay or netem, tests/netns_wan.sh).
# A qwen3moe model with the real 48 MoE layers and small widths (so compute
# does not hide the network), sliced; site A's expert worker holds the
# experts of layers 0-23, site B's those of 24-47. One sequence decodes
# WS_GEN tokens, greedy, in each mode, all in one run:
#
#   experts  plain per-layer dispatch (what `gateway --placement experts`
#            does): a coordinator in site A (`kvasir run -m manifest --worker
#            A --worker B`), one expert round trip per MoE layer per token,
#            half of them to site B;
#   sites    the ring of sites: a ring node in each site running its window
#            on its own site's worker (`kvasir ring --layers 0-23 --worker A`,
#            `--layers 24-47 --worker B`), the client in site A: one crossing
#            each way per token;
#   spec P   the same ring with speculative decoding, the test draft source
#            at acceptance P (a recording of the plain run's tokens) and
#            k = WS_K: k + 1 positions per crossing.
#
# Every mode's tokens must equal `kvasir run -m F.gguf` (one process, no
# network) or the script fails. It prints decode tokens/s, tokens per
# crossing (tokens / passes), and the ratios sites/experts (target >= 10x)
# and spec 0.7/sites (target >= 1.8x). Whatever the figures are, they are
# printed; WS_ASSERT_TARGETS=1 also fails when a target is missed.
#
# Env: WS_RTT (40), WS_LAYERS (48), WS_SHAPE (gen-model widths), WS_GEN (32),
#      WS_EXPERTS_GEN (decode tokens of the slow per-layer mode, 16),
#      WS_ACCS ("0 0.5 0.7 0.9 1"), WS_K (3), WS_JSON (a file: one JSON row
#      per mode). WS_QUICK=1: the short functional version of make test
#      (tests/test_wan_sites_bench.sh): 8 layers, few tokens, identity only.
# Needs root (network namespaces).
set -euo pipefail
build=${1:-build}
KV=$(cd "$build" && pwd)/kvasir
KV_BUILD=$(dirname "$KV")
SRC=$(cd "$(dirname "$0")/.." && pwd)
dir=$(mktemp -d "${TMPDIR:-/tmp}/kv_bench_wansites.XXXXXX")
chmod 755 "$dir"
. "$SRC/tests/netns_wan.sh"
. "$SRC/tests/ring_support.sh"
trap 'wan_cleanup; kill $(jobs -p) 2>/dev/null || true; rm -rf "$dir"' EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in "$dir"/*.err; do [ -s "$f" ] && { echo "--- $f" >&2; tail -5 "$f" >&2; }; done
  exit 1
}
wan_available || fail "needs root and network namespaces"

QUICK=${WS_QUICK:-0}
RTT=${WS_RTT:-40}
LAYERS=${WS_LAYERS:-48}
SHAPE=${WS_SHAPE:---embd 256 --ff-exp 64 --experts 16 --experts-used 4 --heads 4 --kv-heads 2 --head-dim 64 --vocab 1000}
GEN=${WS_GEN:-32}
EGEN=${WS_EXPERTS_GEN:-16}
ACCS=${WS_ACCS:-0 0.5 0.7 0.9 1}
K=${WS_K:-3}
if [ "$QUICK" = 1 ]; then
  LAYERS=${WS_LAYERS:-8}
  GEN=${WS_GEN:-12}
  EGEN=${WS_EXPERTS_GEN:-6}
  ACCS=${WS_ACCS:-0.7}
fi
JSON_OUT=${WS_JSON:-$dir/rows.jsonl}
: >"$JSON_OUT"
HALF=$((LAYERS / 2))
P="Two sites, one crossing each per token, and several tokens per crossing"

echo "CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -n1), $(nproc) threads; load average $(cut -d' ' -f1-3 /proc/loadavg)"
"$KV" gen-model --arch qwen3moe --out "$dir/m.gguf" --layers "$LAYERS" $SHAPE --type q8_0 --seed 31 >/dev/null 2>&1 ||
  fail "gen-model"
"$KV" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab 16 >/dev/null 2>&1 || fail "slice"
echo "model: qwen3moe, $LAYERS MoE layers, $SHAPE, q8_0; sliced, one slab per layer"

# the references: one process, no network (the plain path the tokens must equal)
"$KV" run -m "$dir/m.gguf" -p "$P" -n "$GEN" --temp 0 --json --threads 1 >"$dir/ref.json" || fail "local run"
jq -c .tokens "$dir/ref.json" >"$dir/ref.rec"
"$KV" run -m "$dir/m.gguf" -p "$P" -n "$EGEN" --temp 0 --json --threads 1 >"$dir/eref.json" || fail "local run"

wan_setup 2 "$(awk -v r="$RTT" 'BEGIN { print r / 2 }')"
A=${WAN_IP[0]} B=${WAN_IP[1]}
echo "bed: site A $A, site B $B, $RTT ms round trip ($WAN_MECH)"

# keys: the ring nodes (k0, k1) and the client / coordinator; the workers admit all three
ring_keys
PKS=()
for k in k0 k1 client; do PKS+=(--allow-key "$("$KV" key --key "$dir/$k.key")"); done
slabs() { # FIRST LAST: the slabs of those layers, comma separated
  local l out=()
  for ((l = $1; l <= $2; l++)); do out+=("$(ls "$dir/sl/experts/blk.$l."*.gguf)"); done
  local IFS=,
  echo "${out[*]}"
}
worker() { # NS ADDR FIRST LAST NAME
  wan_exec "$1" "$KV" worker --slabs "$(slabs "$3" "$4")" --listen "$2" --threads 1 --quiet "${PKS[@]}" \
    >"$dir/$5.out" 2>"$dir/$5.err" &
  RING_ALL+=($!)
  for _ in $(seq 300); do
    grep -q '^listening on' "$dir/$5.out" 2>/dev/null && return 0
    sleep 0.05
  done
  fail "worker $5 did not start"
}
worker 0 "$A:7300" 0 $((HALF - 1)) wa
worker 1 "$B:7300" "$HALF" $((LAYERS - 1)) wb

row() { # MODE JSON_FILE REF_FILE: checks the tokens, prints and records the row
  local mode=$1 f=$2 ref=$3
  [ "$(jq -c .tokens "$f")" = "$(jq -c .tokens "$ref")" ] ||
    fail "$mode: tokens differ from kvasir run on the GGUF: $(jq -c .tokens "$f") vs $(jq -c .tokens "$ref")"
  local tps n passes
  tps=$(jq .timings.decode_tok_s "$f")
  n=$(jq '.tokens | length' "$f")
  passes=$(jq '.spec.passes // (.tokens | length)' "$f")
  local tpc
  tpc=$(awk -v n="$n" -v p="$passes" 'BEGIN { printf "%.2f", p ? n / p : 0 }')
  printf '%-12s %8.3f tok/s  %5.2f tokens/crossing  (%d tokens, identical)\n' "$mode" "$tps" "$tpc" "$n"
  jq -nc --arg mode "$mode" --argjson tps "$tps" --argjson n "$n" --argjson passes "$passes" \
    '{mode: $mode, decode_tok_s: $tps, tokens: $n, passes: $passes}' >>"$JSON_OUT"
  eval "TPS_$(echo "$mode" | tr -c 'a-z0-9\n' '_')=$tps"
}

# ---- experts: per-layer dispatch from a coordinator in site A
wan_exec 0 "$KV" run -m "$dir/sl/manifest.json" --worker "$A:7300" --worker "$B:7300" --key "$dir/client.key" \
  -p "$P" -n "$EGEN" --temp 0 --json --threads 1 >"$dir/experts.json" 2>"$dir/experts.err" || fail "per-layer dispatch"
row experts "$dir/experts.json" "$dir/eref.json"

# ---- sites: the ring of sites, each window on its own site's worker
for i in 0 1; do
  ip=${WAN_IP[$i]}
  first=$((i * HALF)) last=$((i * HALF + HALF - 1))
  wan_exec "$i" "$KV" ring -m "$dir/sl/manifest.json" --layers "$first-$last" --listen "$ip:7700" \
    --next "${WAN_IP[$(((i + 1) % 2))]}:7700" --worker "$ip:7300" --threads 1 --key "$dir/k$i.key" \
    --allow-key "$dir/allow" >"$dir/ring$i.out" 2>"$dir/ring$i.err" &
  RING_PID[$i]=$!
  RING_ALL+=($!)
done
ring_wait_whole
ring() { # OUT EXTRA...
  local out=$1
  shift
  wan_exec 0 "$KV" run --ring "$A:7700" --key "$dir/client.key" -p "$P" -n "$GEN" --temp 0 --json "$@" >"$out" \
    2>"${out%.json}.err" || fail "ring request $*: $(cat "${out%.json}.err")"
}
ring "$dir/sites.json"
row sites "$dir/sites.json" "$dir/ref.json"
for acc in $ACCS; do
  ring "$dir/spec$acc.json" --draft "test:$dir/ref.rec:$acc" --draft-max "$K"
  row "spec$acc" "$dir/spec$acc.json" "$dir/ref.json"
done

r1=$(awk -v a="$TPS_sites" -v b="$TPS_experts" 'BEGIN { printf "%.1f", (b > 0 ? a / b : 0) }')
echo "sites / experts: ${r1}x (target >= 10x)"
r2=""
if [ -n "${TPS_spec0_7:-}" ]; then
  r2=$(awk -v a="$TPS_spec0_7" -v b="$TPS_sites" 'BEGIN { printf "%.2f", (b > 0 ? a / b : 0) }')
  echo "spec 0.7, k = $K / sites: ${r2}x (target >= 1.8x)"
fi
if [ "${WS_ASSERT_TARGETS:-0}" = 1 ]; then
  awk -v r="$r1" 'BEGIN { exit !(r >= 10) }' || fail "sites / experts ${r1}x is under 10x"
  [ -z "$r2" ] || awk -v r="$r2" 'BEGIN { exit !(r >= 1.8) }' || fail "spec 0.7 / sites ${r2}x is under 1.8x"
fi
echo "PASS: every mode's tokens equal kvasir run on the GGUF"
