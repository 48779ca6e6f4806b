#!/usr/bin/env bash
# kv-test-labels: oracle net
# The reasoning budget (Anthropic's thinking.budget_tokens below max_tokens,
# llama-server's thinking_budget_tokens): a gateway over a gen-model model
# with random weights and the real Qwen3.5 chat template (its generation
# prompt opens <think>), greedy. After the budget the end of reasoning is
# forced into the output and the model continues: the first tokens equal
# those of a run without a budget, the forced ones are the family's
# "\n</think>\n\n" (logprob null), and what follows equals a plain greedy
# run of /completion over the prompt, those tokens and the forced ones
# (token ids). The `@anthropic-ai/sdk` client gets the same thinking and
# text, whole and streamed. Checks in tests/oracle/gateway_reasoning.mjs.
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_gateway_reasoning: FAIL: $*" >&2; exit 1; }
command -v node >/dev/null 2>&1 || fail "node not found"
for p in openai @anthropic-ai/sdk node-llama-cpp; do
  [ -f "$SRC/tests/oracle/node_modules/$p/package.json" ] || fail "package missing: $p (run tools/install-oracle.sh)"
done
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
DIR=$(mktemp -d "${TMPDIR:-/tmp}/kv_gwreason.XXXXXX")
trap 'rm -rf "$DIR"' EXIT
"$BIN" gen-model --preset tiny --ctx 4096 --out "$DIR/big.gguf" >/dev/null 2>&1 || fail "gen-model"
git clone -q --no-checkout "$SRC/tests/oracle/node_modules/node-llama-cpp/llama/gitRelease.bundle" "$DIR/llama" \
  >/dev/null 2>&1 || fail "cannot clone the llama.cpp bundle of node-llama-cpp"
git -C "$DIR/llama" show "HEAD:models/templates/Qwen3.5-4B.jinja" >"$DIR/qwen35.jinja" || fail "no Qwen3.5 template"
KV_DIR="$DIR" KV_BIN="$BIN" node "$SRC/tests/oracle/gateway_reasoning.mjs"
