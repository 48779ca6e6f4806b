#!/usr/bin/env bash
# kv-test-labels: net attack
# Verified compute on gpt-oss (issue 34): MXFP4 experts with biases and the
# clamped SwiGLU, over three `kvasir worker` processes, the coordinator
# holding the slabs (the projections' source) and run with --verify and a
# sampled full recompute:
#   - honest workers (one on the OpenCL backend when this machine has a
#     device: it returns its pre-activations too): every answer verified,
#     none unverified, nobody caught, tokens and logits byte-identical to
#     `kvasir run -m F.gguf`;
#   - one worker that lies (--test-lie=swap: another held expert's answer,
#     test-only): caught, its answers redone, the logits still identical.
# Before verification computed gpt-oss experts, --verify refused them at the
# first answer. docs/VERIFY.md, "Biases and the clamped SwiGLU".
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
dir=$(mktemp -d -t kvasir-gptossv.XXXXXX)
# pids, fail, the EXIT trap, the coordinator key $KEY / $PK and start_worker
. "$SRC/tests/dispatch_support.sh"
group() { # the slabs of expert group $1 (experts 3g..3g+2) of every layer
  local out="" l
  for l in 0 1 2; do out+="${out:+,}$m/sl/experts/$(printf 'blk.%d.%04d-%04d.gguf' "$l" $((3 * $1)) $((3 * $1 + 2)))"; done
  echo "$out"
}

m="$dir/gptoss"
mkdir -p "$m"
"$KV" gen-model --arch gpt-oss --out "$m/model.gguf" --layers 3 --embd 256 --ff-exp 128 --experts 9 \
  --experts-used 3 --heads 4 --kv-heads 2 --head-dim 64 --swa 6 --vocab 600 --type mxfp4 --seed 7 >/dev/null 2>&1 ||
  fail "gen-model"
"$KV" slice "$m/model.gguf" --out "$m/sl" --experts-per-slab 3 >/dev/null 2>&1 || fail "slice"
"$KV" inspect "$m/sl/experts/blk.1.0003-0005.gguf" 2>/dev/null | grep -qi 'mxfp4' || fail "the slab's experts are not MXFP4"

PROMPT="The swarm computes every expert where it lives, and the tokens come out the same"
RUN=(-p "$PROMPT" -n 12 --temp 0 --json --batch 5 --threads 2 --key "$KEY")
"$KV" run -m "$m/model.gguf" "${RUN[@]}" --logits-out "$m/local.bin" >"$m/local.json"
[ "$(jq '.tokens | length' "$m/local.json")" = 12 ] || fail "the local run did not generate 12 tokens"

cl=()
if command -v clinfo >/dev/null 2>&1 && clinfo -l 2>/dev/null | grep -q Device; then cl=(--backend opencl); fi
addrs=()
for g in 0 1 2; do
  if [ $g = 2 ]; then start_worker "w$g" "$(group $g)" "${cl[@]}"; else start_worker "w$g" "$(group $g)"; fi
  addrs+=(--worker "$addr")
done
"$KV" run -m "$m/sl/manifest.json" "${addrs[@]}" "${RUN[@]}" --verify --verify-recompute 0.2 \
  --logits-out "$m/honest.bin" >"$m/honest.json" 2>"$m/honest.err" || fail "verified run: $(cat "$m/honest.err")"
cmp -s "$m/local.bin" "$m/honest.bin" || fail "verified run: logits differ from the local run"
[ "$(jq .dispatch.caught "$m/honest.json")" = 0 ] || fail "an honest worker was caught: $(cat "$m/honest.err")"
[ "$(jq .dispatch.unverified "$m/honest.json")" = 0 ] || fail "unverified answers"
[ "$(jq .dispatch.pairs_local "$m/honest.json")" = 0 ] || fail "pairs computed locally"
nv=$(jq .dispatch.verified "$m/honest.json")
[ "$nv" -gt 0 ] || fail "nothing verified"
if [ ${#cl[@]} -gt 0 ]; then
  [ "$(jq '[.dispatch.workers[] | select(.backend == "opencl" and .verified > 0)] | length' "$m/honest.json")" = 1 ] ||
    fail "the OpenCL worker's answers were not verified: $(jq -c .dispatch.workers "$m/honest.json")"
fi
echo "ok: gpt-oss mxfp4, 3 honest workers${cl:+ (one on OpenCL)}: $nv answers verified, $(jq .dispatch.recomputed "$m/honest.json")" \
  "recomputed in full, none caught, logits identical to the local run"

# group 0's only worker lies: answers with another expert's output
start_worker liar "$(group 0)" --test-lie=swap
"$KV" run -m "$m/sl/manifest.json" --worker "$addr" "${addrs[@]:2}" "${RUN[@]}" --verify --verify-recompute 0.2 \
  --logits-out "$m/liar.bin" >"$m/liar.json" 2>"$m/liar.err" || fail "run with a liar: $(cat "$m/liar.err")"
cmp -s "$m/local.bin" "$m/liar.bin" || fail "run with a liar: logits differ from the local run"
[ "$(jq .dispatch.caught "$m/liar.json")" = 1 ] || fail "the liar was not caught: $(cat "$m/liar.err")"
[ "$(jq .dispatch.workers[0].caught "$m/liar.json")" = true ] || fail "the wrong worker was caught"
grep -q "caught lying" "$m/liar.err" || fail "no line about the caught worker"
echo "ok: gpt-oss: a lying worker caught ($(jq .dispatch.verified "$m/liar.json") answers verified), logits identical"
echo "test_gptoss_verify: all ok"
