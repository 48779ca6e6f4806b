#!/usr/bin/env bash
# kv-test-labels: oracle net
# The official client libraries against `kvasir gateway`: the `openai` and
# `@anthropic-ai/sdk` npm packages (test-only, pinned in tests/oracle),
# whole and streaming, with an API key; each answer must equal `kvasir run
# --chat --json` with the same parameters. The work is done by
# tests/oracle/gateway_clients.mjs. A missing package is a FAILURE, not a
# skip (tools/install-oracle.sh installs them).
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_gateway_clients: FAIL: $*" >&2; exit 1; }
command -v node >/dev/null 2>&1 || fail "node not found"
for p in openai @anthropic-ai/sdk; do
  [ -f "$SRC/tests/oracle/node_modules/$p/package.json" ] || fail "client missing: $p (run tools/install-oracle.sh)"
done
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
DIR=$(mktemp -d "${TMPDIR:-/tmp}/kv_gwc.XXXXXX")
GW=
cleanup() { [ -n "$GW" ] && kill "$GW" 2>/dev/null; wait 2>/dev/null; rm -rf "$DIR"; }
trap cleanup EXIT
"$BIN" gen-model --preset tiny --out "$DIR/tiny.gguf" >/dev/null 2>&1 || fail "gen-model"
"$BIN" gateway -m "$DIR/tiny.gguf" --listen 127.0.0.1:0 --api-key sk-test-key --threads 2 >"$DIR/gw.out" 2>"$DIR/gw.err" &
GW=$!
for _ in $(seq 1 600); do
  grep -q "^listening on " "$DIR/gw.out" 2>/dev/null && break
  kill -0 "$GW" 2>/dev/null || fail "gateway exited: $(cat "$DIR/gw.err")"
  sleep 0.1
done
ADDR=$(sed -n 's/^listening on //p' "$DIR/gw.out")
[ -n "$ADDR" ] || fail "gateway did not print its address"
KV_GW_URL="http://$ADDR" KV_GW_KEY=sk-test-key KV_GW_MODEL=tiny KV_GW_FILE="$DIR/tiny.gguf" KV_BIN="$BIN" \
  node "$SRC/tests/oracle/gateway_clients.mjs"
