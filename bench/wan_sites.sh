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
# WS_MODEL=122b (`make bench-wan-122b`): the Qwen3.5-122B-A10B shape on the
# same bed: qwen35moe with the real 48 blocks (+1 MTP block), 32/2 attention
# heads, 16/64 delta-net heads, full attention every 4th block, 256 experts
# (top-8) and a shared expert, at bench widths (embd 256, experts of 32,
# head dims 32, vocab 1000: the real widths' 76 GB skeleton is all holes,
# whose page faults hide the network; WS_MODEL=122b-real runs it). Modes experts and sites (no
# speculation unless WS_ACCS names acceptances), each measured against the
# cost model of docs/WAN.md: t_token = t_0 + crossings x (rtt - rtt_0), with
# t_0 the same mode's time per token on the same bed with the line at 0 ms
# (compute, every call's software cost and the line's own cost per crossing,
# measured in the same run), rtt and rtt_0 ping's mean round trip between the
# sites at WS_RTT and at 0 ms, and crossings the WAN round trips per token:
# per-layer dispatch from site A, one per MoE layer held in site B (24); the
# ring of sites, one (a hop each way). Both modes run once at 0 ms to warm
# up before the calibration runs. WS_PREDICT=1 adds the same prediction to
# the default model's rows.
#
# WS_MODEL=122b-real (`make bench-wan-122b-real`): the same two modes and
# prediction on the real widths: the skeleton `gen-model --preset
# qwen35-122b-a10b --skeleton` (76 GB logical, all holes but its small
# tensors: no disk to speak of), sliced one slab per layer, run with
# --allow-sparse everywhere (workers, ring nodes, coordinator; the
# reference is `kvasir run -m DIR --allow-sparse`). Few tokens (WS_GEN 4):
# each token maps about 3.5 GB of holes (zero-page faults, about a second a
# token here) so t_0 is seconds and the ring's one crossing is within its
# noise. The files are deleted with the scratch folder at exit.
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
ARCH=qwen3moe
SHAPE=${WS_SHAPE:---embd 256 --ff-exp 64 --experts 16 --experts-used 4 --heads 4 --kv-heads 2 --head-dim 64 --vocab 1000}
SLAB=16
GEN=${WS_GEN:-32}
EGEN=${WS_EXPERTS_GEN:-16}
ACCS=${WS_ACCS-0 0.5 0.7 0.9 1}
K=${WS_K:-3}
PREDICT=${WS_PREDICT:-0}
SPARSE=0    # a sliced skeleton: every process runs with --allow-sparse
WAIT_S=15   # a worker's or ring node's start (the real widths' take longer)
case ${WS_MODEL:-} in
"") ;;
122b)
  ARCH=qwen35moe SLAB=256 PREDICT=1
  SHAPE=${WS_SHAPE:---embd 256 --ff-exp 32 --ff-shexp 32 --experts 256 --experts-used 8 --heads 32 --kv-heads 2 --head-dim 32 --attn-interval 4 --ssm-groups 16 --ssm-heads 64 --ssm-state 32 --nextn 1 --vocab 1000}
  GEN=${WS_GEN:-32}
  EGEN=${WS_EXPERTS_GEN:-8}
  ACCS=${WS_ACCS-}
  ;;
122b-real)
  ARCH=qwen35moe SLAB=256 PREDICT=1 SPARSE=1 LAYERS=48 WAIT_S=${WS_WAIT_S:-600}
  GEN=${WS_GEN:-4}
  EGEN=${WS_EXPERTS_GEN:-$GEN}
  ACCS=${WS_ACCS-}
  ;;
*) fail "WS_MODEL: '$WS_MODEL' is not 122b, 122b-real (or empty)" ;;
esac
if [ "$QUICK" = 1 ]; then
  LAYERS=${WS_LAYERS:-8}
  GEN=${WS_GEN:-12}
  EGEN=${WS_EXPERTS_GEN:-6}
  ACCS=${WS_ACCS-0.7}
fi
[ "$LAYERS" -ge 2 ] && [ "$LAYERS" -le 512 ] || fail "WS_LAYERS: $LAYERS is not 2..512"
JSON_OUT=${WS_JSON:-$dir/rows.jsonl}
: >"$JSON_OUT"
HALF=$((LAYERS / 2))
P="Two sites, one crossing each per token, and several tokens per crossing"

SP=()
[ "$SPARSE" = 1 ] && SP=(--allow-sparse)
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -n1), $(nproc) threads; load average $(cut -d' ' -f1-3 /proc/loadavg)"
if [ "$SPARSE" = 1 ]; then
  echo "disk before: $(df -h "$dir" | awk 'NR == 2 { print $4 " free of " $2 }')"
  t=$(date +%s.%N)
  "$KV" gen-model --preset qwen35-122b-a10b --skeleton --out "$dir/m.gguf" >/dev/null 2>"$dir/gen.err" ||
    fail "gen-model --skeleton"
  "$KV" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab "$SLAB" >/dev/null 2>"$dir/slice.err" || fail "slice"
  rm -f "$dir/m.gguf" # the sliced folder is what every process runs
  echo "model: the Qwen3.5-122B-A10B skeleton (gen-model --preset qwen35-122b-a10b --skeleton), sliced one slab per" \
    "layer: $(du -sh --apparent-size "$dir/sl" | cut -f1) logical, $(du -sh "$dir/sl" | cut -f1) on disk;" \
    "$(awk -v t="$t" -v n="$(date +%s.%N)" 'BEGIN { printf "%.0f", n - t }') s to write and slice"
  REF_M=$dir/sl
else
  "$KV" gen-model --arch "$ARCH" --out "$dir/m.gguf" --layers "$LAYERS" $SHAPE --type q8_0 --seed 31 >/dev/null 2>"$dir/gen.err" ||
    fail "gen-model"
  "$KV" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab "$SLAB" >/dev/null 2>"$dir/slice.err" || fail "slice"
  echo "model: $ARCH, $LAYERS MoE layers, $SHAPE, q8_0 ($(du -m "$dir/m.gguf" | cut -f1) MB); sliced, one slab per layer"
  REF_M=$dir/m.gguf
fi

# the references: one process, no network (the plain path the tokens must equal)
"$KV" run -m "$REF_M" "${SP[@]}" -p "$P" -n "$GEN" --temp 0 --json --threads 1 >"$dir/ref.json" || fail "local run"
jq -c .tokens "$dir/ref.json" >"$dir/ref.rec"
if [ "$EGEN" = "$GEN" ]; then
  cp "$dir/ref.json" "$dir/eref.json"
else
  "$KV" run -m "$REF_M" "${SP[@]}" -p "$P" -n "$EGEN" --temp 0 --json --threads 1 >"$dir/eref.json" || fail "local run"
fi

if [ "$PREDICT" = 1 ]; then
  wan_setup 2 0 # the calibration first, at 0 ms; the line is set to RTT after it
else
  wan_setup 2 "$(awk -v r="$RTT" 'BEGIN { print r / 2 }')"
fi
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
  wan_exec "$1" "$KV" worker --slabs "$(slabs "$3" "$4")" --listen "$2" --threads 1 --quiet "${PKS[@]}" "${SP[@]}" \
    >"$dir/$5.out" 2>"$dir/$5.err" &
  RING_ALL+=($!)
  for _ in $(seq $((WAIT_S * 20))); do
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

ping_ms() { # the sites' mean round trip as ping measures it (20 small pings)
  wan_exec 0 ping -n -q -c 20 -i 0.02 -W 2 "$B" 2>/dev/null | sed -n 's|^rtt min/avg/max/mdev = [0-9.]*/\([0-9.]*\)/.*|\1|p'
}
experts() { # OUT: per-layer dispatch from a coordinator in site A
  wan_exec 0 "$KV" run -m "$dir/sl/manifest.json" --worker "$A:7300" --worker "$B:7300" --key "$dir/client.key" \
    "${SP[@]}" -p "$P" -n "$EGEN" --temp 0 --json --threads 1 >"$1" 2>"$dir/experts.err" || fail "per-layer dispatch"
}

# ---- sites: the ring of sites, each window on its own site's worker
for i in 0 1; do
  ip=${WAN_IP[$i]}
  first=$((i * HALF)) last=$((i * HALF + HALF - 1))
  wan_exec "$i" "$KV" ring -m "$dir/sl/manifest.json" --layers "$first-$last" --listen "$ip:7700" \
    --next "${WAN_IP[$(((i + 1) % 2))]}:7700" --worker "$ip:7300" --threads 1 --key "$dir/k$i.key" \
    --allow-key "$dir/allow" "${SP[@]}" >"$dir/ring$i.out" 2>"$dir/ring$i.err" &
  RING_PID[$i]=$!
  RING_ALL+=($!)
done
for i in 0 1; do # each node's window loaded (ring_wait_whole then gives the links its own 20 s)
  for _ in $(seq $((WAIT_S * 20))); do
    grep -q '^listening on' "$dir/ring$i.out" 2>/dev/null && break
    kill -0 "${RING_PID[$i]}" 2>/dev/null || fail "ring node $i died: $(cat "$dir/ring$i.err")"
    sleep 0.05
  done
done
ring_wait_whole
ring() { # OUT EXTRA...
  local out=$1
  shift
  wan_exec 0 "$KV" run --ring "$A:7700" --key "$dir/client.key" -p "$P" -n "$GEN" --temp 0 --json "$@" >"$out" \
    2>"${out%.json}.err" || fail "ring request $*: $(cat "${out%.json}.err")"
}

# ---- the calibration (WS_PREDICT): both modes on the same bed at 0 ms
if [ "$PREDICT" = 1 ]; then
  experts "$dir/warm0e.json" # warm: the workers' and ring nodes' pages, the ring's connections
  ring "$dir/warm0s.json"
  experts "$dir/experts0.json"
  ring "$dir/sites0.json"
  for m in experts sites; do
    [ "$(jq -c .tokens "$dir/${m}0.json")" = "$(jq -c .tokens "$dir/$([ $m = experts ] && echo eref || echo ref).json")" ] ||
      fail "$m at 0 ms: tokens differ from kvasir run on the GGUF"
  done
  T0_experts=$(jq '1 / .timings.decode_tok_s' "$dir/experts0.json")
  T0_sites=$(jq '1 / .timings.decode_tok_s' "$dir/sites0.json")
  PING0=$(ping_ms)
  wan_line "$(awk -v r="$RTT" 'BEGIN { print r / 2 }')"
  ring "$dir/warm.json" # the ring's connections through the new line
  PING=$(ping_ms)
  [ -n "$PING0" ] && [ -n "$PING" ] || fail "no ping between the sites"
  echo "calibration at 0 ms (ping $PING0 ms): per-layer dispatch $(awk -v t="$T0_experts" 'BEGIN { printf "%.1f", t * 1000 }') ms" \
    "per token, ring of sites $(awk -v t="$T0_sites" 'BEGIN { printf "%.1f", t * 1000 }') ms; at $RTT ms ping $PING ms"
fi

experts "$dir/experts.json"
row experts "$dir/experts.json" "$dir/eref.json"
ring "$dir/sites.json"
row sites "$dir/sites.json" "$dir/ref.json"
for acc in $ACCS; do
  ring "$dir/spec$acc.json" --draft "test:$dir/ref.rec:$acc" --draft-max "$K"
  row "spec$acc" "$dir/spec$acc.json" "$dir/ref.json"
done

if [ "$PREDICT" = 1 ]; then
  echo
  echo "measured vs the cost model (docs/WAN.md: t_0 + crossings x (rtt - rtt_0))"
  printf "%-10s %10s %12s %14s %14s %8s\n" mode crossings "t_0 ms" "measured ms" "predicted ms" error
  for m in experts sites; do
    if [ $m = experts ]; then x=$((LAYERS - HALF)) t0=$T0_experts tps=$TPS_experts; else x=1 t0=$T0_sites tps=$TPS_sites; fi
    read -r meas pred err < <(awk -v t0="$t0" -v x="$x" -v r="$PING" -v r0="$PING0" -v tps="$tps" 'BEGIN {
      m = 1000 / tps; p = t0 * 1000 + x * (r - r0); printf "%.1f %.1f %.1f\n", m, p, 100 * (p - m) / m }')
    printf "%-10s %10s %12.1f %14s %14s %7s%%\n" "$m" "$x" "$(awk -v t="$t0" 'BEGIN { print t * 1000 }')" "$meas" "$pred" "$err"
    jq -nc --arg mode "$m" --argjson x "$x" --argjson t0 "$t0" --argjson rtt "$PING" --argjson rtt0 "$PING0" \
      --argjson meas "$meas" --argjson pred "$pred" \
      '{kind: "predict", mode: $mode, crossings: $x, t0_s: $t0, rtt_ms: $rtt, rtt0_ms: $rtt0, measured_ms: $meas, predicted_ms: $pred}' \
      >>"$JSON_OUT"
  done
fi

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
