#!/usr/bin/env bash
# kv-test-labels: oracle net
# A compulsory tool call (tool_choice required / named, sampled under its
# grammar) streams its arguments as the model writes them: OpenAI deltas
# with function.arguments fragments, Anthropic input_json_delta
# partial_json. Over gen-model random weights with the real templates of
# Qwen3.5, DeepSeek V3.1 and R1, and gpt-oss (llama.cpp's bundle in
# node-llama-cpp), the official clients' streaming helpers accumulate
# exactly the calls of the same request answered whole (same seed), from
# more than one fragment. Checks in tests/oracle/gateway_toolstream.mjs.
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_gateway_toolstream: FAIL: $*" >&2; exit 1; }
command -v node >/dev/null 2>&1 || fail "node not found"
for p in openai @anthropic-ai/sdk node-llama-cpp; do
  [ -f "$SRC/tests/oracle/node_modules/$p/package.json" ] || fail "package missing: $p (run tools/install-oracle.sh)"
done
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
DIR=$(mktemp -d "${TMPDIR:-/tmp}/kv_gwtstream.XXXXXX")
trap 'rm -rf "$DIR"' EXIT
"$BIN" gen-model --preset tiny --ctx 4096 --out "$DIR/big.gguf" >/dev/null 2>&1 || fail "gen-model"
git clone -q --no-checkout "$SRC/tests/oracle/node_modules/node-llama-cpp/llama/gitRelease.bundle" "$DIR/llama" \
  >/dev/null 2>&1 || fail "cannot clone the llama.cpp bundle of node-llama-cpp"
for t in Qwen3.5-4B deepseek-ai-DeepSeek-V3.1 deepseek-ai-DeepSeek-R1-Distill-Qwen-32B openai-gpt-oss-120b; do
  git -C "$DIR/llama" show "HEAD:models/templates/$t.jinja" >"$DIR/$t.jinja" || fail "no template $t in the bundle"
done
KV_DIR="$DIR" KV_BIN="$BIN" node "$SRC/tests/oracle/gateway_toolstream.mjs"
