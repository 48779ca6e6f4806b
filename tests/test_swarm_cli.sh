#!/usr/bin/env bash
# kv-test-labels: net
# `kvasir swarm up/status/down`, the LAN beacon and `kvasir plan` on a tiny
# generated model, all on loopback:
#   - swarm up starts a hub, three nodes and a gateway and returns once the
#     market is covered and /health is 200; status (table and --json) shows
#     every process up, every shard live;
#   - a chat completion through the gateway (curl) equals `kvasir run --chat`
#     in one process, greedy and sampled; the nodes' worker counters (STATS)
#     add up to exactly the expert computations those requests need
#     (((prompt + completion - 1) tokens x MoE layers - the prompt's tokens
#     but its last, which skip the last block's experts) x top-k);
#   - plan's round trips equal bench --hub's request rounds per step, and
#     its bytes per token bound (and, when the bound is tight, equal) the
#     bytes bench measures on the wire;
#   - a node started without --hub joins through the hub's beacon; one
#     with no beacon to hear fails within its bounded wait, naming --hub;
#   - a second swarm up in the same folder is refused; an up that cannot
#     reach coverage stops what it started and points to the logs;
#   - swarm down stops everything (no process of the swarm is left) and
#     status then says there is no swarm.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
dir=$(mktemp -d -t kvasir-swarmcli.XXXXXX)
BP=$((20000 + ($$ * 13) % 30000)) # beacon port of this run
extra= onenode= onehub= twoA= twoB= twohub=
cleanup() {
  # every process this script started by hand, then the swarms it brought up
  for p in $extra $onenode $onehub $twoA $twoB $twohub; do kill -9 "$p" 2>/dev/null; done
  for d in "$dir/sw" "$dir/bad"; do
    [ -f "$d/swarm.json" ] && "$KV" swarm down --dir "$d" --grace-ms 2000 >/dev/null 2>&1
  done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in "$dir"/sw/logs/*.log; do [ -f "$f" ] && { echo "--- $f" >&2; tail -5 "$f" >&2; }; done
  exit 1
}
SW="$dir/sw"

# usage errors: exit 1 and one line naming the problem
usage() { # WANT_TEXT ARGS...
  local want=$1
  shift
  set +e
  "$KV" "$@" >/dev/null 2>"$dir/usage.err"
  local rc=$?
  set -e
  [ "$rc" = 1 ] && [ "$(wc -l <"$dir/usage.err")" = 1 ] && grep -q -- "$want" "$dir/usage.err" ||
    fail "kvasir $*: rc $rc: $(cat "$dir/usage.err")"
}
set +e
"$KV" swarm >/dev/null 2>"$dir/usage.err"
rc=$?
set -e
[ "$rc" = 1 ] && grep -q "^usage: kvasir swarm up|status|down" "$dir/usage.err" || fail "bare swarm: rc $rc: $(cat "$dir/usage.err")"
usage "unknown subcommand 'frob'" swarm frob
usage "--nodes" swarm up --nodes 0 --dir "$dir/never"
usage "not both" swarm up -m x.gguf --preset tiny --dir "$dir/never"
usage "--budget" swarm up --budget 12Q --dir "$dir/never"
usage "unknown option '--bogus'" swarm up --bogus 1 --dir "$dir/never"
usage "needs --hub" plan
usage "--wire" plan --hub http://127.0.0.1:1 --wire f64
usage "--model-id" node --budget 1M --data "$dir/never" --model-id zz
usage "--beacon" hub --model x --db y --beacon 0
echo "ok: usage errors: exit 1, one line each; plan without a hub: exit 2, one line"
[ ! -e "$dir/never" ] || fail "a usage error created files"
set +e
"$KV" plan --hub http://127.0.0.1:1 --timeout-ms 2000 >/dev/null 2>"$dir/plan0.err"
rc=$?
set -e
[ "$rc" = 2 ] && [ "$(wc -l <"$dir/plan0.err")" = 1 ] || fail "plan without a hub: rc $rc: $(cat "$dir/plan0.err")"

# no swarm yet
set +e
"$KV" swarm status --dir "$SW" >/dev/null 2>"$dir/st0.err"
rc=$?
set -e
[ "$rc" = 2 ] && grep -q "no swarm in" "$dir/st0.err" || fail "status without a swarm: rc $rc: $(cat "$dir/st0.err")"

"$KV" swarm up --dir "$SW" --nodes 3 --listen 127.0.0.1:0 --hub-listen 127.0.0.1:0 --beacon-port "$BP" \
  --threads 1 --timeout-ms 60000 >"$dir/up.out" 2>"$dir/up.err" || fail "swarm up: $(cat "$dir/up.err")"
grep -q "^swarm up: 3 nodes, 8 of 8 shards live" "$dir/up.out" || fail "up: $(cat "$dir/up.out")"
GW=$(jq -r .gateway.url "$SW/swarm.json")
HUB=$(jq -r .hub.url "$SW/swarm.json")
grep -q "^gateway  $GW " "$dir/up.out" && grep -q "^hub      $HUB .*status page $HUB/" "$dir/up.out" ||
  fail "endpoints not printed: $(cat "$dir/up.out")"
[ "$(jq '.nodes | length' "$SW/swarm.json")" = 3 ] || fail "swarm.json: $(cat "$SW/swarm.json")"
echo "ok: swarm up: hub $HUB, gateway $GW"

"$KV" swarm status --dir "$SW" --json >"$dir/st1.json" || fail "status --json"
jq -e '.hub.alive and .coverage.covered and .coverage.shards == 8 and .coverage.shards_live == 8 and
       .gateway.alive and .gateway.health == 200 and (.nodes | length) == 3 and
       all(.nodes[]; .alive and (.shards | length) > 0 and (.key | length) == 64)' "$dir/st1.json" >/dev/null ||
  fail "status: $(cat "$dir/st1.json")"
# the market read directly agrees with status
[ "$(curl -sf "$HUB/v1/market" | jq '[.shards[] | select(.live > 0)] | length')" = 8 ] || fail "market"
"$KV" swarm status --dir "$SW" >"$dir/st1.txt" || fail "status"
[ "$(grep -c '^node[123] .* up ' "$dir/st1.txt")" = 3 ] && grep -q "8 of 8 live (covered)" "$dir/st1.txt" ||
  fail "status table: $(cat "$dir/st1.txt")"
echo "ok: swarm status: every process up, every shard live"

# chat completions through the gateway equal the single-process run
MODEL=$(curl -sf "$GW/v1/models" | jq -r '.data[0].id')
grep -q "^model    $MODEL  (curl $GW/v1/chat/completions .*\"model\":\"$MODEL\"" "$dir/up.out" ||
  fail "swarm up did not print the model id $MODEL: $(cat "$dir/up.out")"
pairs=0
chat() { # PROMPT N TEMP TOPK TOPP MINP SEED
  local body
  body=$(jq -nc --arg m "$MODEL" --arg p "$1" --argjson n "$2" --argjson t "$3" --argjson k "$4" --argjson tp "$5" \
    --argjson mp "$6" --argjson s "$7" \
    '{model:$m, messages:[{role:"user", content:$p}], max_tokens:$n, temperature:$t, top_k:$k, top_p:$tp, min_p:$mp, seed:$s}')
  curl -sf "$GW/v1/chat/completions" -H 'Content-Type: application/json' -d "$body" >"$dir/chat.json" ||
    fail "chat completion failed"
  "$KV" run -m "$SW/model.gguf" --chat --json --threads 1 -p "$1" -n "$2" --temp "$3" --top-k "$4" --top-p "$5" \
    --min-p "$6" --seed "$7" >"$dir/ref.json" 2>/dev/null || fail "run --chat"
  local a b
  a=$(jq -r '.choices[0].message.content' "$dir/chat.json")
  b=$(jq -r .text "$dir/ref.json")
  [ -n "$b" ] && [ "$a" = "$b" ] || fail "gateway '$a' != run --chat '$b'"
  [ "$(jq .usage.completion_tokens "$dir/chat.json")" = "$(jq '.tokens | length' "$dir/ref.json")" ] || fail "usage"
  pairs=$((pairs + ($(jq '(.usage.prompt_tokens + .usage.completion_tokens - 1) * 2 - (.usage.prompt_tokens - 1)' "$dir/chat.json")) * 2))
}
chat "Hello there" 16 0 40 0.95 0.05 1
chat "Why is the sky blue?" 12 0.9 20 0.9 0.0 77
echo "ok: two chat completions through the gateway equal kvasir run --chat"
"$KV" swarm status --dir "$SW" --json >"$dir/st2.json"
got=$(jq '[.nodes[].experts_computed] | add' "$dir/st2.json")
[ "$got" = "$pairs" ] || fail "workers computed $got experts, the requests need $pairs: $(jq -c '[.nodes[].experts_computed]' "$dir/st2.json")"
echo "ok: the nodes computed $pairs experts ($(jq -c '[.nodes[].experts_computed]' "$dir/st2.json")), what the requests need"
# the hub's node metrics (served totals in heartbeats) catch up within a few heartbeats
hub_served() { "$KV" swarm status --dir "$SW" --json | jq '[.nodes[].served_pairs] | add'; }
for _ in $(seq 50); do [ "$(hub_served)" = "$pairs" ] && break; sleep 0.2; done
[ "$(hub_served)" = "$pairs" ] || fail "the hub says the nodes served $(hub_served), not $pairs"

# plan against a measured decode
"$KV" plan --hub "$HUB" --json >"$dir/plan.json" || fail "plan"
"$KV" plan --hub "$HUB" >"$dir/plan.txt" || fail "plan (table)"
[ "$(grep -c '^  127\.0\.0\.1:' "$dir/plan.txt")" = 3 ] || fail "plan table: $(cat "$dir/plan.txt")"
jq -e '.covered and .n_moe_layers == 2 and .n_expert_used == 2 and (.nodes | length) == 3 and
       ([.nodes[].experts] | add) >= 16 and .per_token.expert_pairs == 4 and .per_token.exact' "$dir/plan.json" >/dev/null ||
  fail "plan: $(cat "$dir/plan.json")"
"$KV" bench --hub "$HUB" --key "$SW/coordinator.key" --data "$dir/coord" -p 8 -n 16 --reps 1 --threads 1 --json >"$dir/bench.json" 2>"$dir/bench.err" ||
  fail "bench --hub: $(cat "$dir/bench.err")"
rt=$(jq .per_token.round_trips "$dir/plan.json")
jq -e --argjson rt "$rt" '.rounds_per_step == $rt and .retried_pairs == 0' "$dir/bench.json" >/dev/null ||
  fail "rounds per step $(jq .rounds_per_step "$dir/bench.json") != plan's round trips $rt"
bmin=$(jq .per_token.bytes_min "$dir/plan.json")
bmax=$(jq .per_token.bytes_max "$dir/plan.json")
bytes=$(jq .bytes_per_step "$dir/bench.json")
jq -ne --argjson b "$bytes" --argjson lo "$bmin" --argjson hi "$bmax" '$b >= $lo and $b <= $hi' >/dev/null ||
  fail "bench measured $bytes bytes per token, plan says $bmin..$bmax"
[ "$bmin" != "$bmax" ] || [ "$bytes" = "$bmin" ] || fail "plan's exact $bmin bytes per token != measured $bytes"
echo "ok: plan: $rt round trips and $bmin..$bmax bytes per token; bench --hub measured $(jq .rounds_per_step "$dir/bench.json") and $bytes"

# a single holder of every expert: one message per MoE layer, the bytes exact
"$KV" hub --model "$SW/model/manifest.json" --db "$dir/one.db" --listen 127.0.0.1:0 --vouch-open --quiet >"$dir/one.out" 2>&1 &
onehub=$!
for _ in $(seq 200); do grep -q "^listening on" "$dir/one.out" && break; sleep 0.05; done
URL1="http://$(sed -n 's/^listening on //p' "$dir/one.out")"
"$KV" node --hub "$URL1" --budget 64M --data "$dir/one" --interval-ms 300 --threads 1 --quiet &
onenode=$!
for _ in $(seq 150); do [ "$(curl -sf "$URL1/v1/market" | jq .covered)" = true ] && break; sleep 0.2; done
"$KV" plan --hub "$URL1" --json >"$dir/plan1.json" || fail "plan (one node)"
"$KV" bench --hub "$URL1" --data "$dir/coord1" -p 8 -n 16 --reps 1 --threads 1 --json >"$dir/bench1.json" 2>/dev/null ||
  fail "bench --hub (one node)"
kill "$onenode" "$onehub"
wait "$onenode" "$onehub" 2>/dev/null || true
onenode= onehub=
jq -e '.per_token.messages_min == 2 and .per_token.messages_max == 2' "$dir/plan1.json" >/dev/null ||
  fail "one node: $(jq -c .per_token "$dir/plan1.json")"
[ "$(jq .per_token.bytes_min "$dir/plan1.json")" = "$(jq .bytes_per_step "$dir/bench1.json")" ] ||
  fail "one node: plan $(jq .per_token.bytes_min "$dir/plan1.json") != bench $(jq .bytes_per_step "$dir/bench1.json") bytes per token"
echo "ok: plan with one holder: $(jq .per_token.bytes_min "$dir/plan1.json") bytes per token, as measured"

# two nodes holding disjoint halves (one replica wanted): a token's experts
# meet one or two workers per layer; the measured bytes lie in plan's range
slab=$(stat -c %s "$SW/model/experts/blk.0.0000-0001.gguf")
"$KV" hub --model "$SW/model/manifest.json" --db "$dir/two.db" --listen 127.0.0.1:0 --wanted 1 --vouch-open >"$dir/two.out" 2>&1 &
twohub=$!
for _ in $(seq 200); do grep -q "^listening on" "$dir/two.out" && break; sleep 0.05; done
URL2="http://$(sed -n 's/^listening on //p' "$dir/two.out")"
"$KV" node --hub "$URL2" --budget $((4 * slab)) --data "$dir/twoA" --interval-ms 300 --threads 1 2>"$dir/twoA.err" &
twoA=$!
"$KV" node --hub "$URL2" --budget $((4 * slab)) --data "$dir/twoB" --interval-ms 300 --threads 1 2>"$dir/twoB.err" &
twoB=$!
for _ in $(seq 300); do
  [ "$(curl -sf -m 5 "$URL2/v1/market" | jq '.covered and ([.shards[].live] | max) == 1')" = true ] && break
  sleep 0.2
done
[ "$(curl -sf -m 5 "$URL2/v1/market" | jq '.covered')" = true ] ||
  fail "two nodes: no full coverage in 60 s: $(curl -sf -m 5 "$URL2/v1/market" | jq -c '[.shards[].live]')
$(curl -sf -m 5 "$URL2/v1/nodes" | jq -c '[.nodes[] | [.addr, .shards, .proven_shards, .prove_error]]')
$(tail -5 "$dir/twoA.err") $(tail -5 "$dir/twoB.err") $(tail -20 "$dir/two.out")"
# plan exits 2 while the placement lacks a shard: a node the hub challenges
# again and finds late (a loaded machine) is unlisted until it proves its
# slabs again, a second or two; plan reads the map once, so it is asked
# again (bounded) until the map is whole
plan2() { "$KV" plan --hub "$URL2" --json >"$dir/plan2.json" 2>"$dir/plan2.err"; }
wait_until_s() { # SECONDS CMD...: polls CMD every 0.2 s, bounded
  local t=$1
  shift
  for _ in $(seq $((t * 5))); do
    if "$@"; then return 0; fi
    sleep 0.2
  done
  return 1
}
wait_until_s 30 plan2 ||
  fail "plan (two nodes): $(cat "$dir/plan2.err") $(jq -c '[.covered, .experts_missing]' "$dir/plan2.json")
$(curl -sf -m 5 "$URL2/v1/nodes" | jq -c '[.nodes[] | [.addr, .shards, .proven_shards, .prove_error]]')
$(tail -20 "$dir/two.out")"
"$KV" bench --hub "$URL2" --data "$dir/coord2" -p 8 -n 32 --reps 1 --threads 1 --json >"$dir/bench2.json" 2>/dev/null ||
  fail "bench --hub (two nodes)"
kill "$twoA" "$twoB" "$twohub"
wait "$twoA" "$twoB" "$twohub" 2>/dev/null || true
twoA= twoB= twohub=
jq -e '.covered and (.nodes | length) == 2 and .per_token.messages_min == 2 and .per_token.messages_max == 4' \
  "$dir/plan2.json" >/dev/null || fail "two nodes: $(jq -c '[.nodes[].ranges, .per_token]' "$dir/plan2.json")"
jq -e --slurpfile p "$dir/plan2.json" '.rounds_per_step == $p[0].per_token.round_trips and
    .bytes_per_step >= $p[0].per_token.bytes_min and .bytes_per_step <= $p[0].per_token.bytes_max' "$dir/bench2.json" \
  >/dev/null || fail "two nodes: bench $(jq -c '[.rounds_per_step, .bytes_per_step]' "$dir/bench2.json") vs plan $(jq -c .per_token "$dir/plan2.json")"
echo "ok: plan with two disjoint holders: $(jq -c '[.per_token.bytes_min, .per_token.bytes_max]' "$dir/plan2.json") bytes per token, measured $(jq .bytes_per_step "$dir/bench2.json")"

# a node without --hub joins by the beacon
"$KV" node --budget 2M --data "$dir/extra" --beacon-port "$BP" --beacon-wait-ms 15000 --interval-ms 300 --threads 1 \
  >"$dir/extra.log" 2>&1 &
extra=$!
for _ in $(seq 150); do [ "$(curl -sf "$HUB/v1/status" | jq .live_nodes)" = 4 ] && break; sleep 0.2; done
[ "$(curl -sf "$HUB/v1/status" | jq .live_nodes)" = 4 ] || fail "the beacon node did not join: $(cat "$dir/extra.log")"
grep -q "joining the hub $HUB (heard by its beacon)" "$dir/extra.log" || fail "beacon log: $(cat "$dir/extra.log")"
kill "$extra"
wait "$extra" 2>/dev/null || true
extra=
echo "ok: a node without --hub joined $HUB by its beacon"
set +e
t0=$(date +%s%N)
"$KV" node --budget 2M --data "$dir/lost" --beacon-port $((BP + 1)) --beacon-wait-ms 500 >/dev/null 2>"$dir/lost.err"
rc=$?
t1=$(date +%s%N)
set -e
[ "$rc" = 2 ] && grep -q "no hub beacon heard on UDP port $((BP + 1)) within 500 ms.*--hub" "$dir/lost.err" ||
  fail "no beacon: rc $rc: $(cat "$dir/lost.err")"
[ $(((t1 - t0) / 1000000)) -lt 5000 ] || fail "the beacon wait was not bounded"
echo "ok: no beacon: a clear error after the bounded wait"

# one swarm per folder
set +e
"$KV" swarm up --dir "$SW" --listen 127.0.0.1:0 --hub-listen 127.0.0.1:0 >/dev/null 2>"$dir/again.err"
rc=$?
set -e
[ "$rc" = 2 ] && grep -q "already up" "$dir/again.err" || fail "second up: rc $rc: $(cat "$dir/again.err")"

# down: everything stops, nothing is left
pids=$(jq -r '.hub.pid, .gateway.pid, .nodes[].pid' "$SW/swarm.json")
"$KV" swarm down --dir "$SW" >"$dir/down.out" || fail "swarm down"
grep -q "^swarm down: 5 processes stopped (5 by SIGTERM, 0 by SIGKILL), 0 were not running" "$dir/down.out" ||
  fail "down: $(cat "$dir/down.out")"
for p in $pids; do
  st=$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null || true)
  [ -z "$st" ] || [ "$st" = Z ] || fail "process $p still running after swarm down"
done
! ps -eo stat=,args= | grep -v '^Z' | grep -F -- "$SW" | grep -v grep >/dev/null || fail "a swarm process is left: $(ps -eo pid,stat,args | grep -F -- "$SW")"
set +e
"$KV" swarm status --dir "$SW" >/dev/null 2>"$dir/st3.err"
rc=$?
set -e
[ "$rc" = 2 ] && grep -q "no swarm in" "$dir/st3.err" || fail "status after down: rc $rc"
echo "ok: swarm down stopped all 5 processes; none is left"

# an up that cannot reach coverage (budgets below one slab) stops what it
# started and names the logs (on a loaded machine the hub itself may be what
# the timeout catches: either error names the logs)
set +e
"$KV" swarm up --dir "$dir/bad" --nodes 2 --budget 1K --listen 127.0.0.1:0 --hub-listen 127.0.0.1:0 --no-beacon \
  --threads 1 --timeout-ms 4000 >"$dir/bad.out" 2>"$dir/bad.err"
rc=$?
set -e
[ "$rc" = 2 ] && grep -Eq "no full coverage within 4000 ms.*see the logs in $dir/bad/logs|hub did not print its address within .*see $dir/bad/logs/hub.log" "$dir/bad.err" ||
  fail "bad up: rc $rc: $(cat "$dir/bad.err")"
grep -Eq "stopped the [0-9]+ processes it had started; logs in $dir/bad/logs" "$dir/bad.err" || fail "bad up: $(cat "$dir/bad.err")"
! ps -eo stat=,args= | grep -v '^Z' | grep -F -- "$dir/bad" | grep -v grep >/dev/null || fail "the failed up left a process"
[ -f "$dir/bad/logs/hub.log" ] && [ ! -f "$dir/bad/swarm.json" ] || fail "logs not kept, or state left"
echo "ok: an up without coverage fails in bounded time, names the logs and leaves nothing running"
