#!/usr/bin/env bash
# kv-test-labels: net
# The swarm scenario on two hubs sharing one PostgreSQL store (a throw-away
# server from tests/pg_env.sh): hub A and hub B serve one model from one
# database; nodes 1 and 2 register and heartbeat at A, nodes 3 and 4 at B.
# Their budgets hold the model 2.5 times, and each reads the market of its
# own hub, so they reach full coverage only if each hub sees the other's
# nodes. Both hubs publish the same market; `kvasir run --hub B` (and --hub
# A) gives the tokens and logits of `kvasir run -m FULL.gguf` byte for byte;
# both hubs have one hub key (in the store), so the voucher a coordinator
# gets from B is honoured by the nodes that joined A.
# Then node 1 (registered at A) is killed with SIGKILL: a decode through B
# right after still equals the local run; within a bounded wait B drops it
# from the placement map, the others take its shards, and a decode through
# B after the change equals the local run again. Then PostgreSQL is stopped:
# the hubs answer 503 rather than publish a stale market; started again, the
# hubs reconnect and a decode equals the local run. Fails, never skips, when
# PostgreSQL or libpq support is missing.
set -euo pipefail
src=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
KV=${KV_BIN:-$src/build/kvasir}
# shellcheck source=pg_env.sh
source "$src/tests/pg_env.sh"
dir=$(mktemp -d -t kvasir-pgswarm.XXXXXX)
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
  kv_pg_stop
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in "$dir"/*.err; do echo "--- $f" >&2; tail -5 "$f" >&2; done
  exit 1
}
kv_pg_start || fail "no PostgreSQL server (tools/install-deps.sh installs postgresql)"
store=$(kv_pg_createdb kvswarm) || fail "createdb"

"$KV" gen-model --preset tiny --out "$dir/m.gguf" >/dev/null 2>&1
"$KV" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab 2 >/dev/null 2>&1
n_slabs=$(jq '.slabs | length' "$dir/sl/manifest.json")
slab=$(stat -c %s "$dir/sl/experts/blk.0.0000-0001.gguf")
[ "$n_slabs" = 8 ] || fail "want 8 slabs, got $n_slabs"
budget=$((5 * slab + slab / 2)) # five slabs fit, six do not
PROMPT="Two hubs, one state"
RUN=(-p "$PROMPT" -n 8 --temp 0 --json --threads 1)
"$KV" run -m "$dir/m.gguf" "${RUN[@]}" --logits-out "$dir/local.bin" >"$dir/local.json"

# both hubs vouch for the two coordinators' keys; they share one hub key
# (kept in the store), so a voucher from B is good at a node that joined A
mkdir -p "$dir/coord" "$dir/coordA"
CPK=$("$KV" key --key "$dir/coord/coordinator.key")
CPKA=$("$KV" key --key "$dir/coordA/coordinator.key")
start_hub() { # NAME: starts a hub on the shared store, sets url_NAME
  "$KV" hub --model "$dir/sl/manifest.json" --db "$store" --listen 127.0.0.1:0 --deadline-ms 1500 \
    --challenge-every 3 --refresh-ms 100 --vouch-key "$CPK" --vouch-key "$CPKA" --quiet \
    >"$dir/hub$1.out" 2>"$dir/hub$1.err" &
  pids+=($!)
  local u=
  for _ in $(seq 300); do
    u=$(sed -n 's/^listening on \(.*\)$/http:\/\/\1/p' "$dir/hub$1.out" 2>/dev/null | head -1 || true)
    [ -n "$u" ] && break
    sleep 0.05
  done
  [ -n "$u" ] || fail "hub $1 did not start"
  eval "url_$1=\$u"
}
start_hub A
start_hub B
[ "$(curl -sf "$url_B/v1/status" | jq -r .store)" = postgresql ] || fail "hub B: not on PostgreSQL"
[ "$(curl -sf "$url_A/v1/status" | jq -r .hub_key)" = "$(curl -sf "$url_B/v1/status" | jq -r .hub_key)" ] ||
  fail "the hubs have two keys"

declare -a NP
for i in 1 2 3 4; do
  u=$url_A
  [ "$i" -gt 2 ] && u=$url_B
  "$KV" node --hub "$u" --budget "$budget" --data "$dir/n$i" --interval-ms 300 --threads 1 \
    >"$dir/n$i.out" 2>"$dir/n$i.err" &
  NP[$i]=$!
  pids+=($!)
done

market() { curl -sf "$1/v1/market"; }
filled() { market "$1" | jq '[.shards[] | [.live, .wanted] | min] | add'; }
wait_until() { # SECONDS CMD...: a bounded wait, not a timing assertion
  local t=$1
  shift
  for _ in $(seq $((t * 5))); do
    if "$@"; then return 0; fi
    sleep 0.2
  done
  return 1
}
# full URL N: covered, and N replicas count, both in one reading of URL's market
full() {
  local m
  m=$(market "$1") || return 1
  [ "$(jq .covered <<<"$m")" = true ] && [ "$(jq '[.shards[] | [.live, .wanted] | min] | add' <<<"$m")" = "$2" ]
}
same_market() { [ "$(market "$url_A" | jq -c '[.shards[] | [.layer, .first, .live]]')" = \
  "$(market "$url_B" | jq -c '[.shards[] | [.layer, .first, .live]]')" ]; }
wait_until 40 full "$url_B" 16 || fail "no full coverage at B: $(market "$url_B")"
# A proves every node itself (proofs are per hub) and nodes that trade
# serve on new addresses, unproven until each hub challenges them: under
# make asan -j2 A lagged B by more than 10 s (3 of 4 nodes live there,
# [1,1,2,2,2,2,2,3]); bounded like B's wait
wait_until 40 full "$url_A" 16 || fail "no full coverage at A: $(market "$url_A")"
wait_until 30 same_market || fail "the hubs disagree: $(market "$url_A") vs $(market "$url_B")"
echo "ok: four nodes at two hubs reached full coverage, one market: $(market "$url_B" | jq -c '[.shards[].live]')"
for i in 1 2 3 4; do
  for f in "$dir/n$i/pieces/experts/"*.gguf; do
    cmp -s "$f" "$dir/sl/experts/$(basename "$f")" || fail "node $i: $(basename "$f") differs"
  done
done

same_as_local() { # NAME: the run's tokens and logits equal the local run's
  [ "$(jq -c .tokens "$dir/local.json")" = "$(jq -c .tokens "$dir/$1.json")" ] || fail "$1: tokens differ"
  cmp -s "$dir/local.bin" "$dir/$1.bin" || fail "$1: logits differ"
  [ "$(jq .dispatch.pairs_local "$dir/$1.json")" = 0 ] || fail "$1: experts computed locally"
}
"$KV" run --hub "$url_B" --data "$dir/coord" "${RUN[@]}" --logits-out "$dir/hubB1.bin" >"$dir/hubB1.json" \
  2>"$dir/hubB1.err" || fail "run --hub B failed"
same_as_local hubB1
"$KV" run --hub "$url_A" --data "$dir/coordA" "${RUN[@]}" --logits-out "$dir/hubA1.bin" >"$dir/hubA1.json" \
  2>"$dir/hubA1.err" || fail "run --hub A failed"
same_as_local hubA1
[ "$(jq '.dispatch.workers | length' "$dir/hubB1.json")" -ge 2 ] || fail "B placed fewer than two workers"
echo "ok: run --hub B and run --hub A equal the local run ($(jq '.dispatch.workers | length' "$dir/hubB1.json") workers)"

# kill node 1, registered at A; watch through B
victim=$(sed -n 's/^node: serving .* on \(.*\)$/\1/p' "$dir/n1.err" | tail -1)
[ -n "$victim" ] || fail "node 1 serves nothing"
kill -9 "${NP[1]}"
wait "${NP[1]}" 2>/dev/null || true
"$KV" run --hub "$url_B" --data "$dir/coord" "${RUN[@]}" --worker-timeout-ms 2000 --logits-out "$dir/hubB2.bin" \
  >"$dir/hubB2.json" 2>"$dir/hubB2.err" || fail "run --hub B during the change failed"
same_as_local hubB2
echo "ok: a decode through B right after the kill equals the local run"
gone() { ! curl -sf "$url_B/v1/placement" | jq -e --arg a "$victim" '[.shards[].nodes[].addr] | index($a)' >/dev/null; }
wait_until 30 gone || fail "B still places the killed node"
wait_until 40 full "$url_B" 15 || fail "the killed node's shards were not taken: $(market "$url_B")"
wait_until 10 same_market || fail "the hubs disagree after the kill"
echo "ok: after the kill the others took its shards, seen at B: $(market "$url_B" | jq -c '[.shards[].live]')"
"$KV" run --hub "$url_B" --data "$dir/coord" "${RUN[@]}" --logits-out "$dir/hubB3.bin" >"$dir/hubB3.json" \
  2>"$dir/hubB3.err" || fail "run --hub B after the change failed"
same_as_local hubB3
echo "ok: a decode through B after the change equals the local run"
grep -q "challenge answered" "$dir"/n*.err || fail "no storage challenge was answered"
! grep -q "dropped our holdings" "$dir"/n[234].err || fail "an honest node was dropped"
echo "ok: storage challenges answered at both hubs, no honest node dropped"

# an outage of the store: the hubs stop publishing (503) instead of serving a
# stale market; when it is back they reconnect, and the swarm is whole again
code() { curl -s -o /dev/null -w '%{http_code}' "$url_B/v1/market"; }
kv_pg_pause || fail "cannot stop PostgreSQL"
wait_until 15 eval '[ "$(code)" = 503 ]' || fail "B still answers $(code) with its store down"
curl -s "$url_B/v1/market" | jq -e '.code == "EIO"' >/dev/null || fail "503 without an EIO error body"
kv_pg_resume || fail "cannot restart PostgreSQL"
wait_until 20 eval '[ "$(code)" = 200 ]' || fail "B did not recover after the outage: $(code)"
wait_until 30 full "$url_B" 15 || fail "not whole after the outage: $(market "$url_B")"
wait_until 30 full "$url_A" 15 || fail "A not whole after the outage: $(market "$url_A")"
"$KV" run --hub "$url_B" --data "$dir/coord" "${RUN[@]}" --logits-out "$dir/hubB4.bin" >"$dir/hubB4.json" \
  2>"$dir/hubB4.err" || fail "run --hub B after the outage failed"
same_as_local hubB4
echo "ok: a store outage is a 503 at the hub, and after it the swarm and decodes are whole again"
