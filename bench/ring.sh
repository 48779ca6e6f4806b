#!/usr/bin/env bash
# `make bench-ring`: the ring's aggregate decode speed with S = 1, 2, 4, 8
# sequences in flight, against one process decoding the same S sequences in
# shared steps (`kvasir bench --parallel S`), on one synthetic qwen3moe model.
# A ring of RING_NODES nodes (each one thread, a window of consecutive
# layers) on loopback; then the same across a real delayed link: one network
# namespace per node, every pair of them RING_DELAY_MS apart one way
# (tests/netns_wan.sh: `tc netem` where the kernel has it, else kv-netdelay,
# a userspace delay line on TUN devices), each client in the namespace of the
# node it asks. Only where namespaces cannot be made (not root) does it fall
# back to the nodes' own emulated latency (`kvasir ring --link-delay-ms`),
# and says so. The output names the mechanism used. Not part of `make test`.
# Figures: docs/BENCHMARKS.md.
#
# Env: RING_NODES (4), RING_LAYERS (8), RING_GEN (32 tokens per sequence),
#      RING_SHAPE (gen-model shape flags), RING_DELAY_MS (20), RING_SEQS ("1 2 4 8"),
#      RING_REPS (3: best of, one process and ring rounds alternating),
#      NETNS_WAN_MODE (auto: netem if the kernel has it, else netdelay).
set -euo pipefail
build=${1:-build}
KV=$build/kvasir
dir=$(mktemp -d "${TMPDIR:-/tmp}/kv_bench_ring.XXXXXX")
SRC=$(cd "$(dirname "$0")/.." && pwd)
KV_BUILD=$build
. "$SRC/tests/ring_support.sh"
. "$SRC/tests/netns_wan.sh"
CLIENT_WRAP=() # per node: how its clients run (in its namespace on the delayed ring)
bench_cleanup() {
  wan_cleanup
  ring_cleanup
}
trap bench_cleanup EXIT
ring_keys
NODES=${RING_NODES:-4}
LAYERS=${RING_LAYERS:-8}
GEN=${RING_GEN:-32}
DELAY=${RING_DELAY_MS:-20}
SEQS=${RING_SEQS:-1 2 4 8}
REPS=${RING_REPS:-3}
SHAPE=${RING_SHAPE:---embd 512 --ff-exp 512 --experts 16 --experts-used 4 --heads 8 --kv-heads 4 --head-dim 64 --vocab 2000}
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -n1), $(nproc) threads; load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "(the machine may be shared: compare the columns of one run, not runs of different days)"
m="$dir/m.gguf"
"$KV" gen-model --arch qwen3moe --out "$m" --layers "$LAYERS" $SHAPE --type q8_0 --seed 1 >/dev/null 2>&1
echo "model: qwen3moe, $LAYERS layers, $SHAPE, q8_0, $(($(stat -c %s "$m") / 1048576)) MiB; $GEN tokens per sequence"

# windows: LAYERS split in NODES consecutive parts
wins=()
for ((i = 0; i < NODES; i++)); do wins+=("$((i * LAYERS / NODES))-$(((i + 1) * LAYERS / NODES - 1))"); done

PROMPTS=("The ring passes each token" "No node holds the model" "The last node samples" "and hands the token back"
         "Every node works at once" "when sequences are in flight" "whichever hidden state arrives" "is computed next")

# ring_rate S ADDR...: aggregate decode tok/s of S concurrent clients, each to
# node i % NODES: tokens after each one's first, over the span from the first
# first-token to the last last-token (prefill and process start excluded).
ring_rate() {
  local S=$1
  shift
  local addrs=("$@") pids=() i
  for ((i = 0; i < S; i++)); do
    ${CLIENT_WRAP[$((i % ${#addrs[@]}))]:-} "$KV" run --ring "${addrs[$((i % ${#addrs[@]}))]}" "${RK[@]}" -p "${PROMPTS[$((i % 8))]}" -n "$GEN" --temp 0 \
      --json >"$dir/c$i.json" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || fail "a ring request failed"; done
  for ((i = 0; i < S; i++)); do jq -c '[(.tokens | length), .timings.t_first, .timings.t_last]' "$dir/c$i.json"; done |
    jq -s -r '(map(.[0] - 1) | add) / ((map(.[2]) | max) - (map(.[1]) | min)) | . * 10 | round / 10'
}

declare -A LOCAL RING DELAYED
best() { awk -v a="$1" -v b="$2" 'BEGIN { print (a == "" || b + 0 > a + 0) ? b : a }'; }
# rounds alternate one process and the ring (best of REPS each), so both see the same load
ring_start "$m" "${wins[@]}"
for S in $SEQS; do
  for ((r = 0; r < REPS; r++)); do
    LOCAL[$S]=$(best "${LOCAL[$S]:-}" "$("$KV" bench -m "$m" -p 8 -n "$GEN" --parallel "$S" --threads 1 --reps 1 --json \
      2>/dev/null | jq .decode_tok_s)")
    RING[$S]=$(best "${RING[$S]:-}" "$(ring_rate "$S" "${RING_ADDR[@]}")")
  done
done
echo "memory per node after the runs (model file $(($(stat -c %s "$m") / 1024)) KiB):"
printf "%6s  %8s  %16s  %20s  %12s\n" node layers "window KiB" "model resident KiB" "VmRSS KiB"
for i in "${!RING_PID[@]}"; do
  w=$(sed -n 's/.*window of \([0-9]*\) bytes.*/\1/p' "$dir/ring$i.err" | head -1)
  printf "%6s  %8s  %16s  %20s  %12s\n" "$i" "${wins[$i]}" "$((w / 1024))" "$(($(mapped_rss "${RING_PID[$i]}" "$m") / 1024))" \
    "$(awk '/^VmRSS:/ { print $2 }' "/proc/${RING_PID[$i]}/status")"
done
ring_stop

REAL=0
if wan_available; then
  REAL=1
  wan_setup "$NODES" "$DELAY"
  mode="$WAN_MECH; one network namespace per node, each hop between nodes crosses the line, clients in their node's namespace"
  wan_ring_start "$m" "${wins[@]}"
  for ((i = 0; i < NODES; i++)); do CLIENT_WRAP[$i]="ip netns exec ${WAN_NS[$i]}"; done
else
  mode="EMULATED: no network namespaces here (not root), so each node holds every frame to its next ${DELAY} ms itself (--link-delay-ms)"
  RING_EXTRA="--link-delay-ms $DELAY" ring_start "$m" "${wins[@]}"
fi
for S in $SEQS; do
  for ((r = 0; r < REPS; r++)); do DELAYED[$S]=$(best "${DELAYED[$S]:-}" "$(ring_rate "$S" "${RING_ADDR[@]}")"); done
done
ring_stop
wan_cleanup
# the same in this run with the nodes' own emulated latency, for comparison
declare -A EMUL
if [ "$REAL" = 1 ]; then
  RING_EXTRA="--link-delay-ms $DELAY" ring_start "$m" "${wins[@]}"
  CLIENT_WRAP=()
  for S in $SEQS; do
    for ((r = 0; r < REPS; r++)); do EMUL[$S]=$(best "${EMUL[$S]:-}" "$(ring_rate "$S" "${RING_ADDR[@]}")"); done
  done
  ring_stop
fi

echo
echo "aggregate decode tokens/s ($NODES-node ring, one thread per node; one process, one thread):"
printf "%4s  %12s  %12s  %8s  %14s  %18s\n" S "one process" "ring" "ratio" "ring +${DELAY}ms" "(emulated +${DELAY}ms)"
for S in $SEQS; do
  printf "%4s  %12s  %12s  %8s  %14s  %18s\n" "$S" "${LOCAL[$S]}" "${RING[$S]}" \
    "$(awk -v a="${RING[$S]}" -v b="${LOCAL[$S]}" 'BEGIN { printf "%.2f", a / b }')" "${DELAYED[$S]}" "${EMUL[$S]:--}"
done
echo "delay: $mode"
[ "$REAL" = 1 ] && echo "emulated: the same ring with --link-delay-ms $DELAY on loopback (each node holds every frame to its next), for comparison"
echo "decode only: the ring from each sequence's first token to its last (all S together), one process from kvasir bench --parallel S"
