#!/usr/bin/env bash
# kv-test-labels: oracle net
# Tool calling and reasoning end to end with the official clients: a
# gateway over a gen-model model with the real Qwen3 chat template (from the
# llama.cpp source bundled in node-llama-cpp), answering from the test-only
# KVASIR_GATEWAY_TEST_SCRIPT (the model's weights are random: the texts it
# "writes" are scripted, in Qwen3's format, and go through the real
# tokenizer, scheduler, parser and API shapes). The `openai` and
# `@anthropic-ai/sdk` clients run a two-step tool loop whole and streamed
# and read reasoning_content / thinking; Ollama's /api/chat with curl; the
# second step's prompt must equal @huggingface/jinja's rendering. Then the
# other families from their real templates (Qwen3.5: XML calls after a
# prompt-opened <think>; DeepSeek V3.1; gpt-oss harmony), whole and
# streamed. The checks
# are in tests/oracle/gateway_tools.mjs. A missing package is a FAILURE,
# not a skip (tools/install-oracle.sh installs them).
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_gateway_tools: FAIL: $*" >&2; exit 1; }
command -v node >/dev/null 2>&1 || fail "node not found"
command -v curl >/dev/null 2>&1 || fail "curl not found"
for p in openai @anthropic-ai/sdk @huggingface/jinja node-llama-cpp; do
  [ -f "$SRC/tests/oracle/node_modules/$p/package.json" ] || fail "package missing: $p (run tools/install-oracle.sh)"
done
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
DIR=$(mktemp -d "${TMPDIR:-/tmp}/kv_gwtools.XXXXXX")
trap 'rm -rf "$DIR"' EXIT
# the tiny preset with room for a tool-laden prompt
"$BIN" gen-model --preset tiny --ctx 4096 --out "$DIR/big.gguf" >/dev/null 2>&1 || fail "gen-model"
git clone -q --no-checkout "$SRC/tests/oracle/node_modules/node-llama-cpp/llama/gitRelease.bundle" "$DIR/llama" \
  >/dev/null 2>&1 || fail "cannot clone the llama.cpp bundle of node-llama-cpp"
for t in Qwen-Qwen3-0.6B Qwen3.5-4B deepseek-ai-DeepSeek-V3.1 openai-gpt-oss-120b; do
  git -C "$DIR/llama" show "HEAD:models/templates/$t.jinja" >"$DIR/$t.jinja" || fail "no template $t in the bundle"
done
KV_DIR="$DIR" KV_BIN="$BIN" node "$SRC/tests/oracle/gateway_tools.mjs"
