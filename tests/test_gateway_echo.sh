#!/usr/bin/env bash
# kv-test-labels: oracle net
# The prompt's log-probabilities (/v1/completions with echo and logprobs)
# with the official `openai` client, whole and streamed, on a gen-model
# model: the answer lists the prompt's tokens (their texts joined are the
# prompt, text_offset counting from it) then the completion's, the first
# prompt token's logprob null; every prompt position's logprob and
# top_logprobs equal those an independent plain run gives: /completion over
# that position's prefix (token ids) generating one token, with n_probs.
# Checks in tests/oracle/gateway_echo.mjs.
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_gateway_echo: FAIL: $*" >&2; exit 1; }
command -v node >/dev/null 2>&1 || fail "node not found"
[ -f "$SRC/tests/oracle/node_modules/openai/package.json" ] || fail "package missing: openai (run tools/install-oracle.sh)"
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
DIR=$(mktemp -d "${TMPDIR:-/tmp}/kv_gwecho.XXXXXX")
trap 'rm -rf "$DIR"' EXIT
"$BIN" gen-model --preset tiny --out "$DIR/m.gguf" >/dev/null 2>&1 || fail "gen-model"
KV_DIR="$DIR" KV_BIN="$BIN" node "$SRC/tests/oracle/gateway_echo.mjs"
