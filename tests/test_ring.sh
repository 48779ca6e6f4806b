#!/usr/bin/env bash
# kv-test-labels: net
# The ring on loopback: `kvasir ring` nodes holding consecutive layer windows
# must give the tokens and logits of `kvasir run -m F.gguf` byte for byte,
# for rings of 2, 3 and 4 nodes, qwen3moe and qwen35moe (delta net, shared
# expert), with the request submitted to a different node each time and with
# three requests in flight at once (each node computes whichever sequence
# arrives). Then a ring over a sliced model (backbone + slabs), and each
# node's resident share of the model file: only its window is touched.
# Faults (test_ring_faults.sh) and the codec (test_ring_proto.c) are apart.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
dir=$(mktemp -d -t kvasir-ring.XXXXXX)
. "$SRC/tests/ring_support.sh"
trap ring_cleanup EXIT
ring_keys

PROMPTS=("The ring passes each token's hidden state to its neighbour" "No node holds the model and no node is master"
         "The last node samples and hands the token back to the first")
RUN=(-n 10 --temp 0 --json)

# check_ring ARCH MODEL WINDOWS...: a ring of the windows; one request per
# node in turn, then all prompts at once; every answer equals the local run's.
check_ring() {
  local arch=$1 model=$2
  shift 2
  ring_start "$model" "$@"
  local k=0 i
  for i in "${!RING_ADDR[@]}"; do
    local p=${PROMPTS[$((i % ${#PROMPTS[@]}))]}
    "$KV" run --ring "${RING_ADDR[$i]}" "${RK[@]}" -p "$p" "${RUN[@]}" --logits-out "$dir/r.bin" >"$dir/r.json" ||
      fail "$arch ${#RING_ADDR[@]} nodes: request to node $i failed"
    same "$dir/r.json" "$dir/r.bin" "$dir/$arch.local$((i % ${#PROMPTS[@]}))" "$arch, ${#RING_ADDR[@]} nodes, via node $i"
    k=$((k + 1))
  done
  # three in flight at once, each to another node
  local pids=()
  for i in 0 1 2; do
    "$KV" run --ring "${RING_ADDR[$((i % ${#RING_ADDR[@]}))]}" "${RK[@]}" -p "${PROMPTS[$i]}" "${RUN[@]}" \
      --logits-out "$dir/c$i.bin" >"$dir/c$i.json" &
    pids+=($!)
  done
  for i in 0 1 2; do wait "${pids[$i]}" || fail "$arch: concurrent request $i failed"; done
  for i in 0 1 2; do same "$dir/c$i.json" "$dir/c$i.bin" "$dir/$arch.local$i" "$arch, ${#RING_ADDR[@]} nodes, concurrent $i"; done
  echo "ok: $arch: ring of ${#RING_ADDR[@]} ($*): $k requests and 3 concurrent ones, tokens and logits identical"
  ring_stop
}

# same JSON BIN LOCAL_PREFIX WHAT
same() {
  [ "$(jq -c .tokens "$1")" = "$(jq -c .tokens "$3.json")" ] || fail "$4: tokens differ: $(jq -c .tokens "$1") vs $(jq -c .tokens "$3.json")"
  [ "$(jq -c .prompt_tokens "$1")" = "$(jq -c .prompt_tokens "$3.json")" ] || fail "$4: prompt tokens differ"
  [ -s "$2" ] || fail "$4: no logits came back"
  cmp -s "$2" "$3.bin" || fail "$4: logits differ"
}

for arch in qwen3moe qwen35moe; do
  m="$dir/$arch.gguf"
  if [ $arch = qwen3moe ]; then
    "$KV" gen-model --arch qwen3moe --out "$m" --layers 4 --embd 64 --ff-exp 64 --experts 8 --experts-used 2 \
      --heads 4 --kv-heads 2 --head-dim 16 --vocab 600 --type q8_0 --seed 7 >/dev/null 2>&1
  else
    "$KV" gen-model --arch qwen35moe --out "$m" --layers 4 --nextn 1 --embd 128 --ff-exp 64 --experts 8 \
      --experts-used 2 --heads 4 --kv-heads 2 --head-dim 32 --vocab 600 --type q8_0 --seed 7 >/dev/null 2>&1
  fi
  for i in "${!PROMPTS[@]}"; do
    "$KV" run -m "$m" -p "${PROMPTS[$i]}" "${RUN[@]}" --threads 1 --logits-out "$dir/$arch.local$i.bin" \
      >"$dir/$arch.local$i.json"
  done
  check_ring $arch "$m" 0-1 2-3
  check_ring $arch "$m" 0-0 1-2 3-3
  check_ring $arch "$m" 0-0 1-1 2-2 3-3
done

# ---- a sliced model: each node reads its window of the backbone, its experts from the slabs
"$KV" slice "$dir/qwen3moe.gguf" --out "$dir/sl" --experts-per-slab 4 >/dev/null 2>&1
check_ring qwen3moe "$dir/sl/manifest.json" 0-1 2-3

# ---- memory: a node's resident share of the model file is its window
big="$dir/big.gguf"
"$KV" gen-model --arch qwen3moe --out "$big" --layers 4 --embd 256 --ff-exp 512 --experts 8 --experts-used 4 \
  --heads 4 --kv-heads 2 --head-dim 64 --vocab 600 --type q8_0 --seed 9 >/dev/null 2>&1
fsize=$(stat -c %s "$big")
ring_start "$big" 0-0 1-1 2-2 3-3
"$KV" run --ring "${RING_ADDR[0]}" "${RK[@]}" -p "${PROMPTS[0]}" -n 24 --temp 0 --json >/dev/null || fail "big model: request failed"
for i in "${!RING_ADDR[@]}"; do
  w=$(sed -n 's/.*window of \([0-9]*\) bytes.*/\1/p' "$dir/ring$i.err" | head -1)
  r=$(mapped_rss "${RING_PID[$i]}" "$big")
  [ -n "$w" ] && [ -n "$r" ] || fail "node $i: no window size or resident size"
  # the window's tensors plus page rounding and the kernel's fault-around, never the whole file
  [ "$r" -le $((w + w / 4 + 1048576)) ] || fail "node $i: $r bytes of the model resident, window is $w"
  [ "$r" -lt $((fsize / 2)) ] || fail "node $i: $r bytes of a $fsize-byte model resident"
  echo "ok: node $i (layer $i of 4): $((r / 1024)) KiB of the model file resident, window $((w / 1024)) KiB, file $((fsize / 1024)) KiB"
done
ring_stop
echo "PASS: ring exact with 2, 3 and 4 nodes (qwen3moe, qwen35moe, sliced), each node holds its window"
