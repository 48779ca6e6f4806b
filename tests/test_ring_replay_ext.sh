#!/usr/bin/env bash
# kv-test-labels: oracle net
# A request that uses the ring's sampling extension survives a break with
# the bits of an unbroken one: a gateway over a ring of three nodes sends a
# seeded completion (temperature 0.9) under a GBNF grammar, with presence
# and frequency penalties, a logit bias and logprobs; the middle node ends
# itself after 20 frames (--die-after-frames), a replacement takes its
# window, and the home replays the request from its prompt and the tokens
# already streamed (START's n_gen: the tail feeds them to its sampler and
# grammar as sampled tokens). The answer (text, every token's
# log-probability and alternatives, finish reason) must equal a gateway
# over the file's, byte for byte, and the home must have replayed it with
# tokens streamed.
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
KV=${KV_BIN:-$SRC/build/kvasir}
command -v jq >/dev/null 2>&1 || { echo "FAIL: jq not found" >&2; exit 1; }
dir=$(mktemp -d -t kvasir-ringrx.XXXXXX)
. "$SRC/tests/ring_support.sh"
trap 'ring_cleanup' EXIT
ring_keys

m="$dir/m.gguf"
"$KV" gen-model --arch qwen3moe --out "$m" --layers 4 --embd 64 --ff-exp 64 --experts 8 --experts-used 2 \
  --heads 4 --kv-heads 2 --head-dim 16 --vocab 600 --type q8_0 --seed 11 --ctx 512 >/dev/null 2>&1 || fail "gen-model"

# gw NAME ARGS...: starts a gateway; its address in $dir/NAME.addr
gw() {
  local name=$1
  shift
  "$KV" gateway "$@" --listen 127.0.0.1:0 --name m --ring-timeout-ms 20000 >"$dir/$name.out" 2>"$dir/$name.err" &
  RING_ALL+=($!)
  for _ in $(seq 1 400); do
    grep -q "^listening on " "$dir/$name.out" 2>/dev/null && break
    sleep 0.05
  done
  sed -n 's/^listening on //p' "$dir/$name.out" >"$dir/$name.addr"
  [ -s "$dir/$name.addr" ] || fail "gateway $name did not start: $(cat "$dir/$name.err")"
}

RING_NODE_EXTRA=("--replay-timeout-ms 20000" "--die-after-frames 20" "--replay-timeout-ms 20000")
ring_start "$m" 0-1 2-2 3-3
RING_NODE_EXTRA=()
A1=${RING_ADDR[1]} A2=${RING_ADDR[2]}
gw local -m "$m" --threads 1
gw ring --ring "$A2" --key "$dir/client.key"
LOCAL=$(cat "$dir/local.addr")
RING=$(cat "$dir/ring.addr")
for _ in $(seq 1 200); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://$RING/health")" = 200 ] && break
  sleep 0.05
done

body='{"model":"m","prompt":"The ring breaks and","max_tokens":40,"temperature":0.9,"seed":77,"ignore_eos":true,
       "grammar":"root ::= [a-z ]+","presence_penalty":1.2,"frequency_penalty":0.4,"logit_bias":{"7":5,"9":-100},
       "logprobs":3}'
curl -s "http://$LOCAL/v1/completions" -d "$body" >"$dir/local.json"
jq -e '.choices[0].text | length > 0' "$dir/local.json" >/dev/null || fail "local: $(cat "$dir/local.json")"
curl -s "http://$RING/v1/completions" -d "$body" >"$dir/ring.json" &
c=$!
for _ in $(seq 200); do kill -0 "${RING_PID[1]}" 2>/dev/null || break; sleep 0.05; done
kill -0 "${RING_PID[1]}" 2>/dev/null && fail "the middle node did not die"
wait "${RING_PID[1]}" 2>/dev/null || true
grep -q "dying after 20 frames" "$dir/ring1.err" || fail "the middle node died for another reason: $(cat "$dir/ring1.err")"
sleep 0.3 # the request waits, held by its home
kill -0 $c 2>/dev/null || fail "the request ended before a replacement came: $(cat "$dir/ring.json")"
mv "$dir/ring1.err" "$dir/ring1.dead.err"
ring_node 1 "$m" 2-2 "$A1" "$A2"
wait $c || fail "curl failed"
grep -q "replaying request .* from its [0-9]* + [1-9][0-9]* tokens" "$dir/ring2.err" ||
  fail "the home did not replay the request with streamed tokens: $(cat "$dir/ring2.err")"
pick='[.choices[0].text, .choices[0].finish_reason, .choices[0].logprobs, .usage.prompt_tokens, .usage.completion_tokens]'
[ "$(jq -c "$pick" "$dir/ring.json")" = "$(jq -c "$pick" "$dir/local.json")" ] ||
  fail "after the replay the ring's answer differs: $(jq -c "$pick" "$dir/ring.json") vs $(jq -c "$pick" "$dir/local.json")"
jq -e '.choices[0].text | test("^[a-z ]+$")' "$dir/ring.json" >/dev/null || fail "the grammar was not kept: $(cat "$dir/ring.json")"
jq -e '.choices[0].logprobs.tokens | length == 40' "$dir/ring.json" >/dev/null || fail "logprobs: $(jq -c .choices[0].logprobs "$dir/ring.json")"
echo "ok: grammar, penalties, logit bias and logprobs across a break: the replayed answer ($(sed -n 's/.*from its \([0-9]* + [0-9]*\) tokens.*/\1/p' "$dir/ring2.err" | head -1) tokens) equals the local gateway's"
echo "test_ring_replay_ext: ok"
