#!/usr/bin/env bash
# kv-test-labels: net
# The gateway's chat page (GET /) in headless Chromium (Debian's chromium
# and chromium-driver, driven over WebDriver by Node's built-in fetch, as
# tests/test_hub_status.sh does; no npm package). A gateway over a tiny
# gen-model model, with an API key and the test-only
# KVASIR_GATEWAY_TEST_SCRIPT: the page is served with its CSP (the hashes
# equal the SHA-256 of its inline code, computed here), types a message and
# sends it; the streamed answer (reasoning folded in a closed <details>, a
# tool call, and text holding `<img src=x onerror=...>` that must stay
# text) equals what curl gets from /v1/chat/completions for the same body;
# Stop aborts a long stream and /metrics counts the cancellation; a wrong
# API key's error message is shown as the gateway's error JSON says it.
# Then a plain gateway (no script: the random model's own text at
# temperature 0) and one started with --no-web-ui (404 at /). The checks
# are in tests/oracle/gateway_webui.mjs (KV_WEBUI_SHOT=F.png also saves a
# picture of the page after the first answer). A missing browser is a FAILURE,
# not a skip.
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_gateway_webui: FAIL: $*" >&2; exit 1; }
for t in chromium chromedriver node curl; do
  command -v "$t" >/dev/null || fail "$t not found (tools/install-deps.sh)"
done
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
DIR=$(mktemp -d "${TMPDIR:-/tmp}/kv_gwwebui.XXXXXX")
trap 'rm -rf "$DIR"' EXIT
"$BIN" gen-model --preset tiny --ctx 8192 --out "$DIR/m.gguf" >/dev/null 2>&1 || fail "gen-model"
KV_DIR="$DIR" KV_BIN="$BIN" node "$SRC/tests/oracle/gateway_webui.mjs" || fail "the chat page checks failed"
