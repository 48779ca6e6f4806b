#!/usr/bin/env bash
# kv-test-labels: oracle net
# `kvasir gateway --ring`: the gateway as a ring client, on loopback. A ring
# of two `kvasir ring` nodes holds the tiny model (one layer each); the
# gateway, given both as entry nodes, serves the OpenAI and Anthropic APIs.
#  1. /health says the ring is whole (each entry node's window).
#  2. The official `openai` and `@anthropic-ai/sdk` clients
#     (tests/oracle/gateway_ring.mjs) get, whole and streamed, greedy and with
#     temperature 0.8 / 1.2, the text, completion and prompt counts of
#     `kvasir run -m F` in one process; two requests at once both equal theirs.
#  3. A stop string ends the request in the ring too (the home frees the
#     sequence round the ring: "the client left").
#  4. A node dies mid-request (--die-after-frames): the whole answer is a 503
#     naming the ring, /health turns 503; a replacement takes the window and
#     the gateway serves again; the replacement dies under a stream: the
#     stream ends in an error event, the text before it a true prefix.
#  5. --ring with --ledger, or with -m, is refused with one clear line.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
command -v node >/dev/null 2>&1 || { echo "FAIL: node not found" >&2; exit 1; }
for p in openai @anthropic-ai/sdk; do
  [ -f "$SRC/tests/oracle/node_modules/$p/package.json" ] || { echo "FAIL: client missing: $p (run tools/install-oracle.sh)" >&2; exit 1; }
done
dir=$(mktemp -d -t kvasir-gwring.XXXXXX)
. "$SRC/tests/ring_support.sh"
GW=
trap '[ -n "$GW" ] && kill "$GW" 2>/dev/null; ring_cleanup' EXIT
ring_keys

m="$dir/tiny.gguf"
"$KV" gen-model --preset tiny --out "$m" >/dev/null 2>&1 || fail "gen-model"
RING_EXTRA="--replay-timeout-ms 1500"
ring_start "$m" 0-0 1-1

"$KV" gateway --ring "${RING_ADDR[0]}" --ring "${RING_ADDR[1]}" --key "$dir/client.key" --listen 127.0.0.1:0 \
  --api-key sk-ring --parallel 4 --name tiny >"$dir/gw.out" 2>"$dir/gw.err" &
GW=$!
RING_ALL+=($GW)
for _ in $(seq 1 300); do
  grep -q "^listening on " "$dir/gw.out" 2>/dev/null && break
  kill -0 "$GW" 2>/dev/null || fail "gateway exited: $(cat "$dir/gw.err")"
  sleep 0.05
done
ADDR=$(sed -n 's/^listening on //p' "$dir/gw.out")
[ -n "$ADDR" ] || fail "gateway did not print its address"

# health_is CODE [ADDR]: /health of the gateway at ADDR (the first one by
# default) answers CODE within 5 s (the watcher asks every second)
health_is() {
  for _ in $(seq 1 100); do
    [ "$(curl -s -o "$dir/health.json" -w '%{http_code}' "http://${2:-$ADDR}/health")" = "$1" ] && return 0
    sleep 0.05
  done
  fail "/health of ${2:-$ADDR} is not $1: $(cat "$dir/health.json")"
}

# whole_count: how many times node 0 has logged "ring whole"
whole_count() { grep -c "ring whole" "$dir/ring0.err" || true; }

# ring_rewhole N0: after node 1 was replaced, both nodes say the ring is
# whole again: the new node 1 once, node 0 once more than the N0 times it
# had before the break (bounded). A gateway's 200 alone does not say so: its
# watcher asks once a second, so a 200 seen just after the kill can be from
# before it, and a request sent then is refused by the watcher ("the ring
# is not whole") or fails its replay deadline before node 1 sees a frame.
ring_rewhole() {
  for _ in $(seq 1 400); do
    grep -q "ring whole" "$dir/ring1.err" 2>/dev/null && [ "$(whole_count)" -gt "$1" ] && return 0
    sleep 0.05
  done
  fail "the ring did not re-form with the new node 1: $(tail -n 3 "$dir/ring0.err"); $(tail -n 3 "$dir/ring1.err")"
}

# ---- 1. health
health_is 200
[ "$(jq -c '[.ring[] | [.reachable, .whole, .first, .last]]' "$dir/health.json")" = '[[true,true,0,0],[true,true,1,1]]' ] ||
  fail "/health does not list both entry nodes whole: $(cat "$dir/health.json")"
echo "ok: /health: $(cat "$dir/health.json")"

# ---- 2. the official clients against the one-process run
KV_GW_URL="http://$ADDR" KV_GW_KEY=sk-ring KV_GW_MODEL=tiny KV_GW_FILE="$m" KV_BIN="$KV" KV_GW_PHASE=exact \
  node "$SRC/tests/oracle/gateway_ring.mjs" || fail "the clients' answers differ from kvasir run -m"
echo "ok: openai and anthropic clients through the ring equal kvasir run -m (greedy, temp 0.8 and 1.2, concurrent)"

# ---- 3. a stop string frees the sequence in the ring
body='{"model":"tiny","prompt":"Once upon a time","max_tokens":400,"temperature":0,"stop":["e"]}'
curl -s -H "Authorization: Bearer sk-ring" "http://$ADDR/v1/completions" -d "$body" >"$dir/stop.json"
[ "$(jq -r '.choices[0].finish_reason' "$dir/stop.json")" = stop ] || fail "stop string: $(cat "$dir/stop.json")"
ref=$("$KV" run -m "$m" -p "Once upon a time" -n 400 --temp 0 --json --threads 1 | jq -r .text)
txt=$(jq -r '.choices[0].text' "$dir/stop.json")
[ "${ref%%e*}" = "$txt" ] || fail "stop string: text '$txt', the reference up to its first 'e' is '${ref%%e*}'"
for _ in $(seq 1 40); do grep -q "the client left" "$dir/ring0.err" "$dir/ring1.err" && break; sleep 0.05; done
grep -q "failed: ring: the client left" "$dir/ring0.err" "$dir/ring1.err" || fail "the ring kept the stopped sequence"
echo "ok: a stop string ends the completion ('$txt') and the home frees its sequence round the ring"

# ---- 4. a node dies mid-request
# a chat template given to a ring gateway: rendered there and sent as the
# prompt. gen-model's own template (ChatML) must give what the home's ChatML
# gives: the same prompt tokens and text
cat >"$dir/chatml.jinja" <<'T'
{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
T
"$KV" gateway --ring "${RING_ADDR[0]}" --key "$dir/client.key" --listen 127.0.0.1:0 --api-key sk-ring --name tiny \
  --chat-template "$dir/chatml.jinja" >"$dir/gwt.out" 2>"$dir/gwt.err" &
GWT=$!
RING_ALL+=($GWT)
for _ in $(seq 1 300); do
  grep -q "^listening on " "$dir/gwt.out" 2>/dev/null && break
  kill -0 "$GWT" 2>/dev/null || fail "gateway with --chat-template exited: $(cat "$dir/gwt.err")"
  sleep 0.05
done
ADDRT=$(sed -n 's/^listening on //p' "$dir/gwt.out")
body='{"model":"tiny","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hello there, how are you?"}],"max_tokens":12,"temperature":0.7,"seed":9}'
curl -s -H "Authorization: Bearer sk-ring" "http://$ADDR/v1/chat/completions" -d "$body" >"$dir/tm_a.json"
curl -s -H "Authorization: Bearer sk-ring" "http://$ADDRT/v1/chat/completions" -d "$body" >"$dir/tm_b.json"
[ "$(jq -c '[.choices[0].message.content, .usage]' "$dir/tm_a.json")" = "$(jq -c '[.choices[0].message.content, .usage]' "$dir/tm_b.json")" ] ||
  fail "a template rendered at the gateway differs from the home's ChatML: $(cat "$dir/tm_a.json") vs $(cat "$dir/tm_b.json")"
[ "$(jq -r '.usage.completion_tokens' "$dir/tm_b.json")" -gt 0 ] || fail "no tokens: $(cat "$dir/tm_b.json")"
kill "$GWT" 2>/dev/null || true
wait "$GWT" 2>/dev/null || true
echo "ok: a ring gateway with --chat-template sends the rendering: the same tokens and text as the home's ChatML"

n0=$(whole_count)
kill "${RING_PID[1]}"
wait "${RING_PID[1]}" 2>/dev/null || true
mv "$dir/ring1.err" "$dir/ring1.a.err"
ring_node 1 "$m" 1-1 "${RING_ADDR[1]}" "${RING_ADDR[0]}" --replay-timeout-ms 1500 --die-after-frames 12
ring_wait_listen 1
ring_rewhole "$n0"
health_is 200
# through a second gateway whose only entry is node 0: the home outlives the dead
# node, holds the request for its replay deadline (1.5 s), then fails it (ETIMEOUT)
"$KV" gateway --ring "${RING_ADDR[0]}" --key "$dir/client.key" --listen 127.0.0.1:0 --api-key sk-ring --name tiny \
  >"$dir/gw2.out" 2>"$dir/gw2.err" &
GW2=$!
RING_ALL+=($GW2)
for _ in $(seq 1 300); do grep -q "^listening on " "$dir/gw2.out" 2>/dev/null && break; sleep 0.05; done
ADDR2=$(sed -n 's/^listening on //p' "$dir/gw2.out")
[ -n "$ADDR2" ] || fail "gateway 2 did not start: $(cat "$dir/gw2.err")"
health_is 200 "$ADDR2" # its first look at the ring was whole: the request goes in and reaches node 1
KV_GW_URL="http://$ADDR2" KV_GW_KEY=sk-ring KV_GW_MODEL=tiny KV_GW_FILE="$m" KV_BIN="$KV" KV_GW_PHASE=fault \
  node "$SRC/tests/oracle/gateway_ring.mjs" | tee "$dir/fault.log" || fail "a dead node: the client was not given a 503"
# the request finds the ring broken (and waits for it to re-form), or, when the
# gateway's watcher saw the break first (node 1 died, then a status poll ran
# before the home's replay deadline), is refused with what broke
grep -qE "ring broken: .*did not re-form within 1500 ms|the ring is not whole: .*layers [0-9-]+ are gone" "$dir/fault.log" ||
  fail "the 503 does not say the ring broke"
kill "$GW2" 2>/dev/null || true
grep -q "dying after 12 frames" "$dir/ring1.err" || fail "node 1 did not die as planned: $(cat "$dir/ring1.err")"
health_is 503
jq -e '.status == "unavailable" and (.reason | test("ring"))' "$dir/health.json" >/dev/null ||
  fail "/health after the death: $(cat "$dir/health.json")"
echo "ok: a node died mid-request: 503 naming the ring; /health: $(jq -c .reason "$dir/health.json")"
# a replacement: the gateway serves again; it too dies, under a stream
n0=$(whole_count)
mv "$dir/ring1.err" "$dir/ring1.b.err"
ring_node 1 "$m" 1-1 "${RING_ADDR[1]}" "${RING_ADDR[0]}" --replay-timeout-ms 1500 --die-after-frames 20
ring_wait_listen 1
ring_rewhole "$n0"
health_is 200
r=$(curl -s -H "Authorization: Bearer sk-ring" "http://$ADDR/v1/completions" \
  -d '{"model":"tiny","prompt":"Once upon a time","max_tokens":8,"temperature":0}' | jq -r '.choices[0].text')
[ "$r" = "$("$KV" run -m "$m" -p "Once upon a time" -n 8 --temp 0 --json --threads 1 | jq -r .text)" ] ||
  fail "after the replacement: '$r'"
KV_GW_URL="http://$ADDR" KV_GW_KEY=sk-ring KV_GW_MODEL=tiny KV_GW_FILE="$m" KV_BIN="$KV" KV_GW_PHASE=fault-stream \
  node "$SRC/tests/oracle/gateway_ring.mjs" || fail "a dead node under a stream: no error event, or wrong text"
grep -q "dying after 20 frames" "$dir/ring1.err" || fail "the replacement did not die as planned: $(cat "$dir/ring1.err")"
echo "ok: a replacement served the same text; it died under a stream: an error event after a true prefix"
kill "$GW" 2>/dev/null || true
wait "$GW" 2>/dev/null || true
GW=

# ---- 5. combinations refused
set +e
"$KV" gateway --ring "${RING_ADDR[0]}" --ledger "$dir/l.db" --listen 127.0.0.1:0 >"$dir/x.out" 2>"$dir/x.err"
rc1=$?
"$KV" gateway --ring "${RING_ADDR[0]}" -m "$m" --listen 127.0.0.1:0 >"$dir/y.out" 2>"$dir/y.err"
rc2=$?
set -e
[ $rc1 != 0 ] && [ "$(wc -l <"$dir/x.err")" = 1 ] && grep -q "ledger.*ring.*not supported" "$dir/x.err" ||
  fail "--ring --ledger: exit $rc1, $(cat "$dir/x.err")"
[ $rc2 != 0 ] && grep -q "ring replaces -m" "$dir/y.err" || fail "--ring -m: exit $rc2, $(cat "$dir/y.err")"
echo "ok: --ring with --ledger or -m refused: $(cat "$dir/x.err")"
echo "PASS: gateway --ring: the clients get the one-process text; a dead node is a clear 503, never wrong text"
