#!/usr/bin/env bash
# kv-test-labels: net
# deepseek2 (issue 34) sliced and over workers, as test_dispatch does for the
# other families: a Q8_0 model with a leading dense block (no experts, no
# slab), expert groups, a selection bias, shared experts and YaRN gives the
# tokens and logits (prefill chunks of 5 and every decode step) of
# `kvasir run -m F.gguf` byte for byte from its slices (backbone + slabs),
# from three `kvasir worker` processes holding a third of the experts each
# (the coordinator folder holds only backbone.gguf and manifest.json), and
# with 1 or 2 threads and prefill chunks of 1 token.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
dir=$(mktemp -d -t kvasir-ds2.XXXXXX)
. "$SRC/tests/dispatch_support.sh"

m="$dir/ds2"
mkdir -p "$m/coord"
"$KV" gen-model --arch deepseek2 --out "$m/model.gguf" --layers 3 --dense-layers 1 --embd 256 --ff-exp 128 \
  --experts 9 --experts-used 3 --expert-groups 3 --groups-used 2 --shared-experts 2 --heads 4 --head-dim 48 \
  --rope-dim 16 --kv-lora 64 --q-lora 96 --yarn-factor 4 --vocab 600 --type q8_0 --seed 5 >/dev/null 2>&1
"$KV" slice "$m/model.gguf" --out "$m/sl" --experts-per-slab 3 >/dev/null 2>&1
[ ! -e "$m/sl/experts/blk.0.0000-0002.gguf" ] || fail "the dense block 0 has slabs"
for l in 1 2; do [ -e "$m/sl/experts/blk.$l.0006-0008.gguf" ] || fail "layer $l's slabs missing"; done
cp "$m/sl/backbone.gguf" "$m/sl/manifest.json" "$m/coord/"

run_local "$m"
"$KV" run -m "$m/sl" "${RUN[@]}" --logits-out "$m/slices.bin" >"$m/slices.json"
same_as_local "$m" slices slices
echo "ok: deepseek2 q8_0 from slices: tokens and $(($(stat -c %s "$m/local.bin") / 2400)) logit rows identical"

"$KV" run -m "$m/model.gguf" -p "$PROMPT" -n 12 --temp 0 --json --batch 1 --threads 1 --logits-out "$m/t1.bin" >/dev/null
cmp -s "$m/local.bin" "$m/t1.bin" || fail "1 thread, 1-token chunks: logits differ"
echo "ok: deepseek2: 1 thread and 1-token prefill chunks give the same bytes as 2 threads and chunks of 5"

run_workers "$m" 3 1 # block 0 is dense: no slabs
echo "ok: deepseek2 q8_0: 3 workers, $(jq -c '[.dispatch.workers[].pairs]' "$m/remote.json") expert computations, logits identical"
echo "test_ds2_dispatch: all ok"
