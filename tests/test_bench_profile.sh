#!/usr/bin/env bash
# kv-test-labels: unit
# kvasir bench --profile: the per-stage timers of the forward pass. For a
# qwen3moe and a qwen35moe model: the stages of each phase add up to no more
# than the phase's wall time measured around them and to most of it (the rest
# is scheduling and sampling); the forward calls and tokens are the ones the
# bench ran (-p tokens in one call per rep, one call per decoded token); each
# architecture's own stages are timed and the other's are zero (no delta-net
# in qwen3moe; its shared expert and delta rule in qwen35moe); the text form
# prints the same stages.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
dir=$(mktemp -d -t kvasir-prof.XXXXXX)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
command -v jq >/dev/null || fail "jq not installed"
"$KV" gen-model --arch qwen3moe --preset tiny --layers 2 --out "$dir/q3.gguf" >/dev/null 2>&1
"$KV" gen-model --arch qwen35moe --preset tiny --layers 4 --out "$dir/q35.gguf" >/dev/null 2>&1
P=24 N=6 R=2
for m in q3 q35; do
  "$KV" bench -m "$dir/$m.gguf" -p $P -n $N --reps $R --threads 2 --profile --json >"$dir/$m.json" 2>"$dir/$m.err" ||
    fail "$m: bench --profile: $(cat "$dir/$m.err")"
  j="$dir/$m.json"
  for ph in prefill decode; do
    jq -e --arg ph $ph '.profile[$ph] | ([.stages_ms[]] | add) as $s | $s <= .wall_ms * 1.001 + 0.01 and $s >= 0.5 * .wall_ms' "$j" >/dev/null ||
      fail "$m $ph: stages do not add up to the wall time: $(jq -c --arg ph $ph '.profile[$ph]' "$j")"
  done
  jq -e --argjson p $P --argjson n $N --argjson r $R \
    '.profile.prefill.tokens == $p * $r and .profile.prefill.forward_calls == $r and
     .profile.decode.tokens == $n * $r and .profile.decode.forward_calls == $n * $r' "$j" >/dev/null ||
    fail "$m: calls/tokens: $(jq -c '.profile | map_values({forward_calls, tokens})' "$j")"
  jq -e '[.profile.prefill.stages_ms | .embed, .norm, .attn_proj, .attention, .router, .experts, .head] | all(. > 0)' "$j" >/dev/null ||
    fail "$m: a common stage was not timed: $(jq -c '.profile.prefill.stages_ms' "$j")"
done
jq -e '.profile.prefill.stages_ms | .delta_proj == 0 and .delta_rule == 0 and .shared_expert == 0' "$dir/q3.json" >/dev/null ||
  fail "qwen3moe has delta-net or shared-expert time: $(jq -c '.profile.prefill.stages_ms' "$dir/q3.json")"
jq -e '.profile.prefill.stages_ms | .delta_proj > 0 and .delta_rule > 0 and .shared_expert > 0' "$dir/q35.json" >/dev/null ||
  fail "qwen35moe delta-net/shared expert not timed: $(jq -c '.profile.prefill.stages_ms' "$dir/q35.json")"
"$KV" bench -m "$dir/q35.gguf" -p 8 -n 2 --reps 1 --threads 1 --profile >"$dir/text.out" 2>/dev/null
for st in embed attention delta_rule experts shared_expert head; do
  grep -q "^  $st " "$dir/text.out" || fail "text profile lacks $st: $(cat "$dir/text.out")"
done
grep -q "prefill: stages" "$dir/text.out" || fail "text profile lacks the totals"
# --all-rows: a second prefill per rep with every row through the last block,
# reported beside the first, outside the profile (its tokens are the -p of each rep)
"$KV" bench -m "$dir/q3.gguf" -p $P -n 2 --reps $R --threads 1 --all-rows --profile --json >"$dir/ar.json" 2>"$dir/ar.err" ||
  fail "bench --all-rows: $(cat "$dir/ar.err")"
jq -e --argjson p $P --argjson r $R '.prefill_all_rows_tok_s > 0 and .prefill_all_rows_tok_s_best >= .prefill_all_rows_tok_s and
  .profile.prefill.tokens == $p * $r' "$dir/ar.json" >/dev/null || fail "bench --all-rows: $(cat "$dir/ar.json")"
echo "ok: bench --profile (qwen3moe, qwen35moe), --all-rows"
