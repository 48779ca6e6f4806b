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
# the same model sliced, its experts on a worker: a second gateway over it
"$BIN" slice "$DIR/m.gguf" --out "$DIR/sl" >/dev/null 2>&1 || fail "slice"
"$BIN" key --key "$DIR/coord.key" >/dev/null
"$BIN" worker --slabs "$DIR/sl/experts" --listen 127.0.0.1:0 --threads 1 --quiet \
  --allow-key "$("$BIN" key --key "$DIR/coord.key")" >"$DIR/w.out" 2>"$DIR/w.err" &
WK=$!
trap 'kill "$WK" 2>/dev/null || true; rm -rf "$DIR"' EXIT
for _ in $(seq 1 100); do grep -q 'listening on' "$DIR/w.out" 2>/dev/null && break; sleep 0.1; done
WADDR=$(grep -o 'listening on [^ ]*' "$DIR/w.out" | cut -d' ' -f3)
[ -n "$WADDR" ] || fail "worker: $(cat "$DIR/w.err")"
KV_DIR="$DIR" KV_BIN="$BIN" KV_WORKER="$WADDR" node "$SRC/tests/oracle/gateway_echo.mjs"
