#!/usr/bin/env bash
# kv-test-labels: net
# `kvasir gateway --hub` on loopback: the gateway starts before any node,
# takes its manifest and backbone from the hub, and /health is 503 naming
# every shard missing (as many as the manifest has), and a prompt a 503 at
# once. A node that joins later
# is used without a restart: /health turns 200 and a chat completion equals
# `kvasir run -m FULL.gguf --chat` (the independent single-process run).
# Then, while a long streamed completion runs, its only node is killed with
# SIGKILL: /health goes 503, the steps fail and are retried, a replacement
# node joins, and the same stream finishes with text equal to the local run
# (nothing partial, nothing repeated). /metrics carries the coverage gauges.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
dir=$(mktemp -d -t kvasir-gwhub.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 40); do
    alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.05
  done
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in "$dir"/*.err; do echo "--- $f" >&2; tail -8 "$f" >&2; done
  exit 1
}
# wait_until SECONDS CMD...: polls CMD every 0.1 s (a bound, not a timing assertion)
wait_until() {
  local t=$1
  shift
  for _ in $(seq $((t * 10))); do
    if "$@"; then return 0; fi
    sleep 0.1
  done
  return 1
}
addr_of() { sed -n 's/^listening on \(.*\)$/\1/p' "$1" 2>/dev/null | head -1; }
listening() { [ -n "$(addr_of "$1")" ]; }

"$KV" gen-model --preset tiny --out "$dir/m.gguf" >/dev/null 2>&1
"$KV" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab 4 >/dev/null 2>&1
n_slabs=$(jq '.slabs | length' "$dir/sl/manifest.json")
all=$(du -b "$dir/sl/experts" | cut -f1)
budget=$((all * 2)) # every slab

"$KV" hub --vouch-open --model "$dir/sl/manifest.json" --db "$dir/hub.db" --listen 127.0.0.1:0 --deadline-ms 1500 \
  --wanted 1 --quiet >"$dir/hub.out" 2>"$dir/hub.err" &
pids+=($!)
wait_until 30 listening "$dir/hub.out" || fail "hub did not start"
hub="http://$(addr_of "$dir/hub.out")"

"$KV" gateway --hub "$hub" --data "$dir/gw" --listen 127.0.0.1:0 --threads 1 --hub-refresh-ms 200 \
  --worker-timeout-ms 2000 >"$dir/gw.out" 2>"$dir/gw.err" &
GWP=$!
pids+=($GWP)
wait_until 60 listening "$dir/gw.out" || fail "gateway did not start"
gw="http://$(addr_of "$dir/gw.out")"
grep -q "waiting for nodes" "$dir/gw.err" || fail "the gateway did not say it waits for nodes"

health() { curl -s -o "$dir/health.json" -w '%{http_code}' "$gw/health"; }
[ "$(health)" = 503 ] || fail "health without nodes: $(cat "$dir/health.json")"
jq -e --argjson n "$n_slabs" '.status == "unavailable" and .shards_total == $n and .shards_covered == 0 and
  (.missing | length) == ([$n, 16] | min) and .workers_up == 0' "$dir/health.json" >/dev/null ||
  fail "health JSON without nodes: $(cat "$dir/health.json")"
echo "ok: no node: /health 503 with $(jq -c '{shards_covered, shards_total}' "$dir/health.json")"
# a prompt meanwhile is a 503 at once with the same reason (not queued behind a swarm that cannot compute it)
st=$(curl -s -m 10 -o "$dir/p503.json" -w '%{http_code}' "$gw/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}')
[ "$st" = 503 ] && jq -e '.error.message | test("shards covered")' "$dir/p503.json" >/dev/null ||
  fail "a prompt without nodes: $st $(cat "$dir/p503.json")"
echo "ok: no node: a prompt is a 503 at once"

start_node() { # NAME
  "$KV" node --hub "$hub" --budget "$budget" --data "$dir/$1" --interval-ms 300 --threads 1 \
    >"$dir/$1.out" 2>"$dir/$1.err" &
  pids+=($!)
  eval "NODE_$1=$!"
}
start_node a
healthy() { [ "$(health)" = 200 ]; }
wait_until 60 healthy || fail "health never 200 after node a joined: $(cat "$dir/health.json")"
jq -e --argjson n "$n_slabs" '.status == "ok" and .shards_covered == $n and .shards_total == $n and
  (.missing | length) == 0' "$dir/health.json" >/dev/null || fail "health JSON: $(cat "$dir/health.json")"
echo "ok: node a joined the running gateway: /health 200"

PROMPT="The swarm answers through the gateway"
ref() { # N_TOKENS -> text of the single-process run
  "$KV" run -m "$dir/m.gguf" --chat --json --threads 1 -p "$PROMPT" -n "$1" --temp 0 --seed 1 | jq -r .text
}
chat_body() { # N_TOKENS STREAM
  jq -nc --arg p "$PROMPT" --argjson n "$1" --argjson s "$2" \
    '{model: "kvasir", messages: [{role: "user", content: $p}], max_tokens: $n, temperature: 0, seed: 1, stream: $s}'
}
curl -sf "$gw/v1/chat/completions" -H 'Content-Type: application/json' -d "$(chat_body 12 false)" >"$dir/c1.json" ||
  fail "chat through the hub's node failed"
[ "$(jq -r '.choices[0].message.content' "$dir/c1.json")" = "$(ref 12)" ] || fail "chat text differs from the local run"
echo "ok: chat completion equals kvasir run -m FULL.gguf"

metric() { curl -sf "$gw/metrics" | awk -v m="$1" '$1 == m {print $2}'; }
[ "$(metric kvasir_gateway_shards_total)" = "$n_slabs" ] || fail "shards_total gauge"
[ "$(metric kvasir_gateway_shards_covered)" = "$n_slabs" ] || fail "shards_covered gauge"
[ "$(metric kvasir_gateway_workers_added_total)" -ge 1 ] || fail "workers_added gauge"

# a long stream; kill its only node once tokens flow
N=400
curl -sN "$gw/v1/chat/completions" -H 'Content-Type: application/json' -d "$(chat_body $N true)" \
  >"$dir/stream.txt" 2>/dev/null &
CURLP=$!
pids+=($CURLP)
wait_until 60 grep -qs '"content"' "$dir/stream.txt" || fail "the stream did not start"
kill -9 "$NODE_a"
sleep 0.3
grep -q '\[DONE\]' "$dir/stream.txt" && fail "the stream ended before the node was killed (make N larger)"
unhealthy() { [ "$(health)" = 503 ]; }
wait_until 30 unhealthy || fail "health still 200 after the only node died"
echo "ok: node a killed mid-stream: /health 503 ($(jq -r .reason "$dir/health.json"))"
start_node b
wait_until 60 healthy || fail "health never 200 after the replacement joined: $(cat "$dir/health.json")"
wait "$CURLP" || true
grep -q '^data: \[DONE\]' "$dir/stream.txt" || fail "the stream did not finish: $(tail -c 300 "$dir/stream.txt")"
grep -q '"error"' "$dir/stream.txt" && fail "the stream carried an error: $(grep error "$dir/stream.txt" | head -2)"
text=$(sed -n 's/^data: //p' "$dir/stream.txt" | grep -v '^\[DONE\]' | jq -rj '.choices[0].delta.content // empty')
[ "$text" = "$(ref $N)" ] || fail "the stream across the replacement differs from the local run"
[ "$(metric kvasir_gateway_steps_retried_total)" -ge 1 ] || fail "no step was retried"
[ "$(metric kvasir_gateway_workers_added_total)" -ge 2 ] || fail "the replacement was not added"
echo "ok: the stream finished on the replacement node, equal to the local run" \
  "($(metric kvasir_gateway_steps_retried_total) steps retried)"
