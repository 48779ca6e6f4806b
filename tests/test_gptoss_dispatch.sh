#!/usr/bin/env bash
# kv-test-labels: net
# gpt-oss sliced and over workers, as test_ds2_dispatch does for deepseek2:
# a Q8_0 gpt-oss model (biases on attention, router and experts, sinks, a
# sliding window shorter than the prompt, the clamped SwiGLU) gives the
# tokens and logits (prefill chunks of 5 and every decode step) of
# `kvasir run -m F.gguf` byte for byte from its slices (backbone + slabs,
# whose slabs carry their experts' bias rows), from them through a small
# expert cache (the bias rows read into the cache's slots), and from three
# `kvasir worker` processes holding a third of the experts each (the
# coordinator folder holds only backbone.gguf and manifest.json).
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
dir=$(mktemp -d -t kvasir-gptoss.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
KEY="$dir/coord.key"
PK=$("$KV" key --key "$KEY")

start_worker() {
  "$KV" worker --slabs "$2" --listen 127.0.0.1:0 --threads 1 --quiet --allow-key "$PK" >"$dir/$1.out" 2>"$dir/$1.err" &
  pid=$!
  pids+=("$pid")
  addr=
  for _ in $(seq 200); do
    addr=$(sed -n 's/^listening on \(.*\)$/\1/p' "$dir/$1.out" 2>/dev/null | head -1 || true)
    [ -n "$addr" ] && return 0
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.02
  done
  cat "$dir/$1.err" >&2
  fail "worker $1 did not start"
}

m="$dir/gptoss"
mkdir -p "$m/coord"
"$KV" gen-model --arch gpt-oss --out "$m/model.gguf" --layers 3 --embd 256 --ff-exp 128 --experts 9 \
  --experts-used 3 --heads 4 --kv-heads 2 --head-dim 64 --swa 6 --vocab 600 --type q8_0 --seed 5 >/dev/null 2>&1
"$KV" slice "$m/model.gguf" --out "$m/sl" --experts-per-slab 3 >/dev/null 2>&1
for l in 0 1 2; do [ -e "$m/sl/experts/blk.$l.0006-0008.gguf" ] || fail "layer $l's slabs missing"; done
"$KV" inspect "$m/sl/experts/blk.1.0003-0005.gguf" 2>/dev/null | grep -q 'header [0-9.]* kB, 6 tensors' ||
  fail "a slab lacks its experts' bias rows"
cp "$m/sl/backbone.gguf" "$m/sl/manifest.json" "$m/coord/"

PROMPT="The swarm computes every expert where it lives, and the tokens come out the same"
RUN=(-p "$PROMPT" -n 12 --temp 0 --json --batch 5 --threads 2 --key "$KEY")
"$KV" run -m "$m/model.gguf" "${RUN[@]}" --logits-out "$m/local.bin" >"$m/local.json"
n=$(jq '.tokens | length' "$m/local.json")
[ "$n" = 12 ] || fail "local run generated $n tokens"

"$KV" run -m "$m/sl" "${RUN[@]}" --logits-out "$m/slices.bin" >"$m/slices.json"
[ "$(jq -c .tokens "$m/local.json")" = "$(jq -c .tokens "$m/slices.json")" ] || fail "slices: tokens differ"
cmp -s "$m/local.bin" "$m/slices.bin" || fail "slices: logits differ"
echo "ok: gpt-oss q8_0 from slices: tokens and logits identical"

"$KV" run -m "$m/sl" "${RUN[@]}" --expert-cache-mb 1 --logits-out "$m/cache.bin" >/dev/null
cmp -s "$m/local.bin" "$m/cache.bin" || fail "slices through the expert cache: logits differ"
echo "ok: gpt-oss from slices through a 1 MiB expert cache: logits identical"

addrs=()
for g in 0 1 2; do
  slabs=""
  for l in 0 1 2; do slabs+="${slabs:+,}$m/sl/experts/$(printf 'blk.%d.%04d-%04d.gguf' "$l" $((3 * g)) $((3 * g + 2)))"; done
  start_worker "w$g" "$slabs"
  addrs+=(--worker "$addr")
done
"$KV" run -m "$m/coord/manifest.json" "${addrs[@]}" "${RUN[@]}" --logits-out "$m/remote.bin" >"$m/remote.json"
[ "$(jq -c .tokens "$m/local.json")" = "$(jq -c .tokens "$m/remote.json")" ] || fail "workers: tokens differ"
cmp -s "$m/local.bin" "$m/remote.bin" || fail "workers: logits differ"
[ "$(jq '[.dispatch.workers[] | select(.pairs > 0)] | length' "$m/remote.json")" = 3 ] || fail "a worker idle"
[ "$(jq '.dispatch.pairs_local' "$m/remote.json")" = 0 ] || fail "local computations with no slabs"
echo "ok: gpt-oss q8_0: 3 workers, $(jq -c '[.dispatch.workers[].pairs]' "$m/remote.json") expert computations, logits identical"

echo "test_gptoss_dispatch: all ok"
