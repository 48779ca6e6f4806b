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
kill "$GW"; wait "$GW" 2>/dev/null || true
# n choices are n requests against the queue's bound
"$BIN" gateway -m "$DIR/tiny.gguf" --listen 127.0.0.1:0 --threads 2 --quiet --queue 2 --parallel 1 >"$DIR/gw2.out" 2>"$DIR/gw2.err" &
GW=$!
for _ in $(seq 1 600); do
  grep -q "^listening on " "$DIR/gw2.out" 2>/dev/null && break
  kill -0 "$GW" 2>/dev/null || fail "gateway exited: $(cat "$DIR/gw2.err")"
  sleep 0.1
done
ADDR=$(sed -n 's/^listening on //p' "$DIR/gw2.out")
st=$(curl -s -o "$DIR/b" -w '%{http_code}' "http://$ADDR/v1/completions" -d '{"prompt":"hi","max_tokens":2,"n":3}')
[ "$st" = 400 ] && grep -q "'n' is 3" "$DIR/b" || fail "n=3 over a queue of 2: $st $(cat "$DIR/b")"
st=$(curl -s -o "$DIR/b" -w '%{http_code}' "http://$ADDR/v1/completions" -d '{"prompt":"hi","max_tokens":2,"n":2}')
[ "$st" = 200 ] && [ "$(jq '.choices | length' "$DIR/b")" = 2 ] || fail "n=2 over a queue of 2: $st $(cat "$DIR/b")"
# one request runs (--parallel 1) and two wait: n=2 finds at most one place
# of two (a waiting one may start meanwhile, not both): 503
CS=()
for _ in 1 2 3; do
  curl -s -o /dev/null "http://$ADDR/v1/completions" -d '{"prompt":"hi","max_tokens":3000,"ignore_eos":true}' &
  CS+=($!)
done
for _ in $(seq 1 200); do
  [ "$(curl -s "http://$ADDR/v1/slots" | jq '.queued')" = 2 ] && break
  sleep 0.02
done
st=$(curl -s -o "$DIR/b" -w '%{http_code}' "http://$ADDR/v1/completions" -d '{"prompt":"hi","max_tokens":2,"n":2}')
kill "${CS[@]}" 2>/dev/null; wait "${CS[@]}" 2>/dev/null || true
[ "$st" = 503 ] && grep -q "queue is full" "$DIR/b" || fail "n=2 with one place left: $st $(cat "$DIR/b")"
echo "ok: n choices count as n requests against --queue"
kill "$GW"; wait "$GW" 2>/dev/null || true

# reasoning_effort reaches gpt-oss's own template (from the llama.cpp bundle)
git clone -q --no-checkout "$SRC/tests/oracle/node_modules/node-llama-cpp/llama/gitRelease.bundle" "$DIR/llama" \
  >/dev/null 2>&1 || fail "cannot clone the llama.cpp bundle of node-llama-cpp"
git -C "$DIR/llama" show "HEAD:models/templates/openai-gpt-oss-120b.jinja" >"$DIR/oss.jinja" || fail "no gpt-oss template"
"$BIN" gateway -m "$DIR/tiny.gguf" --listen 127.0.0.1:0 --threads 1 --quiet --chat-template "$DIR/oss.jinja" \
  >"$DIR/gw3.out" 2>"$DIR/gw3.err" &
GW=$!
for _ in $(seq 1 600); do
  grep -q "^listening on " "$DIR/gw3.out" 2>/dev/null && break
  kill -0 "$GW" 2>/dev/null || fail "gateway exited: $(cat "$DIR/gw3.err")"
  sleep 0.1
done
ADDR=$(sed -n 's/^listening on //p' "$DIR/gw3.out")
msgs='"messages":[{"role":"user","content":"hi"}]'
curl -s "http://$ADDR/apply-template" -d "{$msgs,\"reasoning_effort\":\"high\"}" | grep -q 'Reasoning: high' ||
  fail "reasoning_effort high did not reach the template"
curl -s "http://$ADDR/apply-template" -d "{$msgs}" | grep -q 'Reasoning: medium' || fail "the template's default effort"
curl -s "http://$ADDR/apply-template" -d "{$msgs,\"reasoning_effort\":\"low\",\"chat_template_kwargs\":{\"reasoning_effort\":\"high\"}}" |
  grep -q 'Reasoning: high' || fail "chat_template_kwargs' reasoning_effort wins"
st=$(curl -s -o "$DIR/b" -w '%{http_code}' "http://$ADDR/v1/chat/completions" -d "{$msgs,\"reasoning_effort\":\"max\"}")
[ "$st" = 400 ] && grep -q reasoning_effort "$DIR/b" || fail "reasoning_effort max: $st $(cat "$DIR/b")"
echo "ok: reasoning_effort reaches the template's variable"
echo "test_gateway_sampling: ok"
