#!/usr/bin/env bash
# kv-test-labels: net
# deepseek2 as the published quants are (issue 34): llama-quantize's Q4_K_M
# recipe (`gen-model --mix q4_k_m`) writes rows that do not fit Q4_K's 256
# as llama.cpp does (attn_q_b, attn_k_b, attn_v_b, attn_output: Q5_0), the
# "more bits" blocks' routed and shared down Q6_K, output Q6_K, the rest
# Q4_K, with a leading dense block, expert groups, shared experts and YaRN.
# Its tokens and logits (prefill chunks of 5 and every decode step) are
# byte-identical between `kvasir run -m F.gguf`, its slices, and three
# `kvasir worker` processes holding a third of the experts each (one of
# them on the OpenCL backend when this machine has a device: same bits).
# Against llama.cpp: tests/oracle/conformance.mjs, model ds2-mix-q4_k_m
# (docs/CONFORMANCE.md, deepseek2).
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
dir=$(mktemp -d -t kvasir-ds2mix.XXXXXX)
# pids, fail, the EXIT trap, the coordinator key $KEY / $PK and start_worker
. "$SRC/tests/dispatch_support.sh"

m="$dir/ds2"
mkdir -p "$m/coord"
"$KV" gen-model --arch deepseek2 --out "$m/model.gguf" --layers 3 --dense-layers 1 --embd 256 --ff-exp 256 \
  --experts 9 --experts-used 3 --expert-groups 3 --groups-used 2 --shared-experts 2 --heads 4 --head-dim 48 \
  --rope-dim 16 --kv-lora 64 --q-lora 96 --yarn-factor 4 --vocab 600 --mix q4_k_m --seed 5 >/dev/null 2>&1 ||
  fail "gen-model"
"$KV" inspect "$m/model.gguf" >"$m/inspect.txt" 2>&1 || fail "inspect"
for want in 'attn_k_b.weight  *q5_0' 'attn_v_b.weight  *q5_0' 'ffn_down_exps.weight  *q4_K (blk 1), q6_K (blk 2)' \
            'output.weight  *q6_K' 'MOSTLY_Q4_K_M'; do
  grep -q "$want" "$m/inspect.txt" || fail "the file is not Q4_K_M as llama-quantize writes it ($want): $(cat "$m/inspect.txt")"
done
types=$(sed -n '/^types/,/^$/p' "$m/inspect.txt" | awk 'NR > 1 && NF {print $1}' | paste -sd, -)
[ "$(echo "$types" | tr , '\n' | wc -l)" -ge 4 ] || fail "fewer than 4 types in the file: $types"
echo "ok: deepseek2 Q4_K_M: types $types; attn_k_b/attn_v_b Q5_0, routed down Q4_K then Q6_K"
"$KV" slice "$m/model.gguf" --out "$m/sl" --experts-per-slab 3 >/dev/null 2>&1 || fail "slice"
[ ! -e "$m/sl/experts/blk.0.0000-0002.gguf" ] || fail "the dense block 0 has slabs"
cp "$m/sl/backbone.gguf" "$m/sl/manifest.json" "$m/coord/"

PROMPT="The swarm computes every expert where it lives, and the tokens come out the same"
RUN=(-p "$PROMPT" -n 12 --temp 0 --json --batch 5 --threads 2 --key "$KEY")
"$KV" run -m "$m/model.gguf" "${RUN[@]}" --logits-out "$m/local.bin" >"$m/local.json"
[ "$(jq '.tokens | length' "$m/local.json")" = 12 ] || fail "the local run did not generate 12 tokens"

"$KV" run -m "$m/sl" "${RUN[@]}" --logits-out "$m/slices.bin" >"$m/slices.json"
[ "$(jq -c .tokens "$m/local.json")" = "$(jq -c .tokens "$m/slices.json")" ] || fail "slices: tokens differ"
cmp -s "$m/local.bin" "$m/slices.bin" || fail "slices: logits differ"
echo "ok: deepseek2 Q4_K_M from slices: tokens and logits identical"

cl=()
if command -v clinfo >/dev/null 2>&1 && clinfo -l 2>/dev/null | grep -q Device; then cl=(--backend opencl); fi
addrs=()
for g in 0 1 2; do
  slabs=""
  for l in 1 2; do slabs+="${slabs:+,}$m/sl/experts/$(printf 'blk.%d.%04d-%04d.gguf' "$l" $((3 * g)) $((3 * g + 2)))"; done
  if [ $g = 2 ]; then start_worker "w$g" "$slabs" "${cl[@]}"; else start_worker "w$g" "$slabs"; fi
  addrs+=(--worker "$addr")
done
"$KV" run -m "$m/coord/manifest.json" "${addrs[@]}" "${RUN[@]}" --logits-out "$m/remote.bin" >"$m/remote.json"
[ "$(jq -c .tokens "$m/local.json")" = "$(jq -c .tokens "$m/remote.json")" ] || fail "workers: tokens differ"
cmp -s "$m/local.bin" "$m/remote.bin" || fail "workers: logits differ"
[ "$(jq '[.dispatch.workers[] | select(.pairs > 0)] | length' "$m/remote.json")" = 3 ] || fail "a worker idle"
[ "$(jq '.dispatch.pairs_local' "$m/remote.json")" = 0 ] || fail "local computations with no slabs"
echo "ok: deepseek2 Q4_K_M: 3 workers${cl:+ (one on OpenCL)}, $(jq -c '[.dispatch.workers[].pairs]' "$m/remote.json")" \
  "expert computations, logits identical"
echo "test_ds2_mix: all ok"
