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
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
dir=$(mktemp -d -t kvasir-gptoss.XXXXXX)
. "$SRC/tests/dispatch_support.sh"

m="$dir/gptoss"
mkdir -p "$m/coord"
"$KV" gen-model --arch gpt-oss --out "$m/model.gguf" --layers 3 --embd 256 --ff-exp 128 --experts 9 \
  --experts-used 3 --heads 4 --kv-heads 2 --head-dim 64 --swa 6 --vocab 600 --type q8_0 --seed 5 >/dev/null 2>&1
"$KV" slice "$m/model.gguf" --out "$m/sl" --experts-per-slab 3 >/dev/null 2>&1
for l in 0 1 2; do [ -e "$m/sl/experts/blk.$l.0006-0008.gguf" ] || fail "layer $l's slabs missing"; done
"$KV" inspect "$m/sl/experts/blk.1.0003-0005.gguf" 2>/dev/null | grep -q 'header [0-9.]* kB, 6 tensors' ||
  fail "a slab lacks its experts' bias rows"
cp "$m/sl/backbone.gguf" "$m/sl/manifest.json" "$m/coord/"

run_local "$m"
"$KV" run -m "$m/sl" "${RUN[@]}" --logits-out "$m/slices.bin" >"$m/slices.json"
same_as_local "$m" slices slices
echo "ok: gpt-oss q8_0 from slices: tokens and logits identical"

"$KV" run -m "$m/sl" "${RUN[@]}" --expert-cache-mb 1 --logits-out "$m/cache.bin" >/dev/null
cmp -s "$m/local.bin" "$m/cache.bin" || fail "slices through the expert cache: logits differ"
echo "ok: gpt-oss from slices through a 1 MiB expert cache: logits identical"

run_workers "$m" 3
echo "ok: gpt-oss q8_0: 3 workers, $(jq -c '[.dispatch.workers[].pairs]' "$m/remote.json") expert computations, logits identical"

echo "test_gptoss_dispatch: all ok"
