#!/usr/bin/env bash
# kv-test-labels: oracle net
# The gateway over a ring serves what it serves over a local engine. Two
# `kvasir ring` nodes hold a gen-model model (one layer each); a gateway over
# them (--ring) and one over the file (-m) run with the real Qwen3.5 chat
# template (llama.cpp's, bundled in node-llama-cpp). The ring gateway renders
# and tokenizes the prompt with the tokenizer its entry node sends (ring
# v3 VOCAB) and submits token ids; grammars, logit bias, penalties and
# logprobs travel to the ring's tail. tests/oracle/ring_gateway_clients.mjs
# drives both with the official `openai` and `@anthropic-ai/sdk` clients:
# tool loops, structured output (ajv), reasoning, logprobs, the sampling
# fields and n, whole and streamed, the ring's answers byte-identical to the
# local ones. Then: Ollama's format (curl) gives the local answer and validates;
# a prompt of token ids outside the vocabulary is a 400
# naming the token, as locally; --prompt-cache with --ring is refused naming
# the flag. A missing package is a FAILURE, not a skip.
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
KV=${KV_BIN:-$SRC/build/kvasir}
command -v node >/dev/null 2>&1 || { echo "FAIL: node not found" >&2; exit 1; }
for p in openai @anthropic-ai/sdk ajv node-llama-cpp; do
  [ -f "$SRC/tests/oracle/node_modules/$p/package.json" ] || { echo "FAIL: package missing: $p" >&2; exit 1; }
done
dir=$(mktemp -d -t kvasir-ringgwc.XXXXXX)
. "$SRC/tests/ring_support.sh"
trap 'ring_cleanup' EXIT
ring_keys

m="$dir/tiny.gguf"
"$KV" gen-model --preset tiny --ctx 4096 --out "$m" >/dev/null 2>&1 || fail "gen-model"
git clone -q --no-checkout "$SRC/tests/oracle/node_modules/node-llama-cpp/llama/gitRelease.bundle" "$dir/llama" \
  >/dev/null 2>&1 || fail "cannot clone the llama.cpp bundle of node-llama-cpp"
T="$dir/qwen35.jinja"
git -C "$dir/llama" show "HEAD:models/templates/Qwen3.5-4B.jinja" >"$T" || fail "no Qwen3.5 template in the bundle"
ring_start "$m" 0-0 1-1

# gw NAME ARGS...: starts a gateway; its address in $dir/NAME.addr
gw() {
  local name=$1
  shift
  "$KV" gateway "$@" --chat-template "$T" --listen 127.0.0.1:0 --api-key sk-rc --name tiny --parallel 4 \
    >"$dir/$name.out" 2>"$dir/$name.err" &
  RING_ALL+=($!)
  for _ in $(seq 1 400); do
    grep -q "^listening on " "$dir/$name.out" 2>/dev/null && break
    sleep 0.05
  done
  sed -n 's/^listening on //p' "$dir/$name.out" >"$dir/$name.addr"
  [ -s "$dir/$name.addr" ] || fail "gateway $name did not start: $(cat "$dir/$name.err")"
}
gw local -m "$m" --threads 1
gw ring --ring "${RING_ADDR[0]}" --ring "${RING_ADDR[1]}" --key "$dir/client.key"
LOCAL=$(cat "$dir/local.addr")
RING=$(cat "$dir/ring.addr")
for _ in $(seq 1 200); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://$RING/health")" = 200 ] && break
  sleep 0.05
done
grep -q "the ring's tokenizer (2048 tokens) from" "$dir/ring.err" || fail "the ring gateway did not load the ring's tokenizer: $(cat "$dir/ring.err")"

KV_LOCAL_URL="http://$LOCAL" KV_RING_URL="http://$RING" KV_GW_KEY=sk-rc node "$SRC/tests/oracle/ring_gateway_clients.mjs" ||
  fail "the ring gateway's answers differ from the local one's (or are wrong)"
echo "ok: openai and anthropic clients over the ring equal a local gateway (tools, structured output, reasoning, logprobs, sampling fields, n)"

# Ollama's format (a schema) over both: the same message, and it validates
body='{"model":"tiny","stream":false,"messages":[{"role":"user","content":"JSON"}],"think":false,
       "format":{"type":"object","properties":{"n":{"type":"integer","minimum":0,"maximum":9}},"required":["n"]},
       "options":{"seed":3,"temperature":0.7,"num_predict":60}}'
a=$(curl -s -H "Authorization: Bearer sk-rc" "http://$LOCAL/api/chat" -d "$body" | jq -c '[.message.content, .done_reason]')
b=$(curl -s -H "Authorization: Bearer sk-rc" "http://$RING/api/chat" -d "$body" | jq -c '[.message.content, .done_reason]')
[ "$a" = "$b" ] || fail "Ollama format: ring $b, local $a"
echo "$b" | jq -e '.[0] | fromjson | .n | type == "number"' >/dev/null || fail "Ollama format: not the schema's JSON: $b"
echo "ok: Ollama's format over the ring: the local answer ($b)"

# the same prompt of token ids over both: the same tokens; one outside the vocabulary a 400 naming it
# (llama-server's /completion takes them)
body='{"prompt":[1,2,3,40],"n_predict":6,"temperature":0}'
a=$(curl -s -H "Authorization: Bearer sk-rc" "http://$LOCAL/completion" -d "$body" | jq -c '[.content, .tokens_predicted]')
b=$(curl -s -H "Authorization: Bearer sk-rc" "http://$RING/completion" -d "$body" | jq -c '[.content, .tokens_predicted]')
case "$a" in '["'*',6]') ;; *) fail "a prompt of token ids, locally: $a" ;; esac
[ "$a" = "$b" ] || fail "a prompt of token ids: ring $b, local $a"
code=$(curl -s -o "$dir/bad.json" -w '%{http_code}' -H "Authorization: Bearer sk-rc" "http://$RING/completion" \
  -d '{"prompt":[1,5000],"n_predict":2}')
[ "$code" = 400 ] && grep -q "5000" "$dir/bad.json" || fail "token 5000: $code $(cat "$dir/bad.json")"
echo "ok: token-id prompts over the ring: the local tokens; one outside the vocabulary a 400 naming it"

# what the ring still cannot do is refused by name
if "$KV" gateway --ring "${RING_ADDR[0]}" --prompt-cache 64M --listen 127.0.0.1:0 >/dev/null 2>"$dir/pc.err"; then
  fail "--prompt-cache with --ring was accepted"
fi
grep -q -- "--prompt-cache" "$dir/pc.err" || fail "--prompt-cache refusal does not name it: $(cat "$dir/pc.err")"
echo "ok: --prompt-cache with --ring is refused by name"
echo "test_ring_gateway_clients: ok"
