#!/usr/bin/env bash
# kv-test-labels: oracle net
# The sampling and response fields of `kvasir gateway` (docs/GATEWAY.md
# "Sampling fields") through the official `openai` npm client and fetch:
# logprobs/top_logprobs (chat), logprobs: N (completions) and n_probs
# (/completion) against the f64 log-softmax of the raw logits `kvasir run
# --logits-out` dumps; logit_bias (+100 forces, -100 bans, the biased
# distribution reported); repetition, presence and frequency penalties
# against the documented formula applied to run's logits; n choices equal to
# single requests with seed + i; echo; every refused field a 400 naming it.
# The work is done by tests/oracle/gateway_sampling.mjs. A missing package is
# a FAILURE, not a skip (tools/install-oracle.sh installs it).
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_gateway_sampling: FAIL: $*" >&2; exit 1; }
command -v node >/dev/null 2>&1 || fail "node not found"
[ -f "$SRC/tests/oracle/node_modules/openai/package.json" ] || fail "client missing: openai (run tools/install-oracle.sh)"
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
DIR=$(mktemp -d "${TMPDIR:-/tmp}/kv_gws.XXXXXX")
GW=
cleanup() { [ -n "$GW" ] && kill "$GW" 2>/dev/null; wait 2>/dev/null; rm -rf "$DIR"; }
trap cleanup EXIT
"$BIN" gen-model --preset tiny --out "$DIR/tiny.gguf" >/dev/null 2>&1 || fail "gen-model"
"$BIN" gateway -m "$DIR/tiny.gguf" --listen 127.0.0.1:0 --threads 2 --quiet >"$DIR/gw.out" 2>"$DIR/gw.err" &
GW=$!
for _ in $(seq 1 600); do
  grep -q "^listening on " "$DIR/gw.out" 2>/dev/null && break
  kill -0 "$GW" 2>/dev/null || fail "gateway exited: $(cat "$DIR/gw.err")"
  sleep 0.1
done
ADDR=$(sed -n 's/^listening on //p' "$DIR/gw.out")
[ -n "$ADDR" ] || fail "gateway did not print its address"
KV_GW_URL="http://$ADDR" KV_GW_MODEL=tiny KV_GW_FILE="$DIR/tiny.gguf" KV_BIN="$BIN" \
  node "$SRC/tests/oracle/gateway_sampling.mjs" || fail "see above"
echo "test_gateway_sampling: ok"
