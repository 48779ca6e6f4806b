#!/usr/bin/env bash
# `make bench-hedge`: decode step time over two replicas of every expert when
# both are healthy and when one stalls, with hedged requests (docs/PROTOCOL.md,
# "Replica choice and hedging"; figures in docs/BENCHMARKS.md).
#
#   bench/hedge.sh [path/to/kvasir]
#
# A sliced synthetic qwen3moe model (8 layers, embd 256, 16 experts top-4,
# q8_0) on three loopback workers that hold every expert and answer each
# request KV_HEDGE_DELAY_MS late (5: a stand-in for a LAN round trip); the
# third also stalls KV_HEDGE_STALL_MS (2000) on every KV_HEDGE_EVERY-th (3)
# request it takes (`kvasir worker --test-stall-ms/--test-stall-every`, test
# only). `kvasir bench --json` decodes KV_HEDGE_N (400) tokens over the two
# healthy workers, then over a healthy one and the staller, and prints the
# decode step time p50, p99 and max of each, the hedges sent and won, and
# the ratio the target is about: the stalled p99 over the healthy p50
# (target: at most 2).
set -euo pipefail
KV=${1:-build/kvasir}
DELAY=${KV_HEDGE_DELAY_MS:-5}
STALL=${KV_HEDGE_STALL_MS:-2000}
EVERY=${KV_HEDGE_EVERY:-3}
N=${KV_HEDGE_N:-400}
D=$(mktemp -d "${TMPDIR:-/tmp}/kv_bench_hedge.XXXXXX")
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$D"
}
trap cleanup EXIT
"$KV" gen-model --arch qwen3moe --out "$D/m.gguf" --layers 8 --embd 256 --ff-exp 128 --experts 16 --experts-used 4 \
  --heads 4 --kv-heads 2 --head-dim 64 --vocab 1000 --type q8_0 --seed 7 >/dev/null 2>&1
"$KV" slice "$D/m.gguf" --out "$D/sl" --experts-per-slab 8 >/dev/null 2>&1
mkdir -p "$D/coord"
cp "$D/sl/backbone.gguf" "$D/sl/manifest.json" "$D/coord/"
PK=$("$KV" key --key "$D/coord.key")
start_worker() { # NAME [FLAGS...]: sets $addr
  local name=$1
  shift
  "$KV" worker --slabs "$D/sl/experts" --listen 127.0.0.1:0 --threads 1 --quiet --allow-key "$PK" \
    --test-delay="$DELAY" "$@" >"$D/$name.out" 2>"$D/$name.err" &
  PIDS+=("$!")
  addr=""
  for _ in $(seq 1 200); do
    addr=$(sed -n 's/^listening on \(.*\)$/\1/p' "$D/$name.out" 2>/dev/null | head -1 || true)
    [ -n "$addr" ] && return 0
    sleep 0.05
  done
  echo "worker $name did not start: $(cat "$D/$name.err")" >&2
  exit 1
}
start_worker a
A=$addr
start_worker b
B=$addr
start_worker s --test-stall-ms="$STALL" --test-stall-every="$EVERY"
S=$addr
BENCH=(bench -m "$D/coord/manifest.json" -p 16 -n "$N" --reps 1 --threads 1 --key "$D/coord.key" --json)
"$KV" "${BENCH[@]}" --worker "$A" --worker "$B" >"$D/healthy.json"
s0=$(grep -c stalls "$D/s.err" || true)
"$KV" "${BENCH[@]}" --worker "$A" --worker "$S" >"$D/stall.json"
stalls=$(($(grep -c stalls "$D/s.err" || true) - s0))
echo "decode of $N tokens, workers answering ${DELAY} ms late; the staller stalls ${STALL} ms on every ${EVERY}th request"
printf '%-22s %10s %10s %10s %8s %8s %10s\n' case "p50 ms" "p99 ms" "max ms" hedges won "tok/s"
for k in healthy stall; do
  jq -r --arg k "$k" '[$k, .decode_step_p50_ms, .decode_step_p99_ms, .decode_step_max_ms, .hedges, .hedges_won,
    .decode_tok_s] | @tsv' "$D/$k.json" | awk -F'\t' '{ printf "%-22s %10.2f %10.2f %10.2f %8d %8d %10.2f\n", $1, $2, $3, $4, $5, $6, $7 }'
done
echo "stalls taken by the staller during its run: $stalls"
jq -rn --slurpfile h "$D/healthy.json" --slurpfile s "$D/stall.json" \
  '"stalled p99 / healthy p50: \(($s[0].decode_step_p99_ms / $h[0].decode_step_p50_ms * 100 | round) / 100) (target <= 2)"'
