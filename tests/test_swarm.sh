#!/usr/bin/env bash
# kv-test-labels: net
# A swarm on loopback: a hub and four `kvasir node` processes whose budgets
# together hold the model 2.5 times (5 of 8 slabs each, 2 replicas wanted)
# reach full coverage on their own, every piece they hold equal to the
# slicer's bytes; `kvasir run --hub` gives the tokens and logits of
# `kvasir run -m FULL.gguf` byte for byte. Then one node is killed with
# SIGKILL: a decode started at once still equals the local run; within a
# bounded wait the hub drops it from the placement map, its shards are taken
# by the others (every shard live, replicas back to the 15 slots the three
# budgets hold), and a decode after the change equals the local run again.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
dir=$(mktemp -d -t kvasir-swarm.XXXXXX)
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
  for f in "$dir"/*.err; do echo "--- $f" >&2; tail -5 "$f" >&2; done
  exit 1
}

"$KV" gen-model --preset tiny --out "$dir/m.gguf" >/dev/null 2>&1
"$KV" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab 2 >/dev/null 2>&1
n_slabs=$(jq '.slabs | length' "$dir/sl/manifest.json")
slab=$(stat -c %s "$dir/sl/experts/blk.0.0000-0001.gguf")
[ "$n_slabs" = 8 ] || fail "want 8 slabs, got $n_slabs"
budget=$((5 * slab + slab / 2)) # five slabs fit, six do not
PROMPT="The swarm holds every expert twice"
RUN=(-p "$PROMPT" -n 8 --temp 0 --json --threads 1)
"$KV" run -m "$dir/m.gguf" "${RUN[@]}" --logits-out "$dir/local.bin" >"$dir/local.json"

# the hub vouches for the coordinator key of $dir/coord (operator-approved)
mkdir -p "$dir/coord"
CPK=$("$KV" key --key "$dir/coord/coordinator.key")
"$KV" hub --model "$dir/sl/manifest.json" --db "$dir/hub.db" --listen 127.0.0.1:0 --deadline-ms 1500 \
  --challenge-every 3 --vouch-key "$CPK" --quiet >"$dir/hub.out" 2>"$dir/hub.err" &
pids+=($!)
url=
for _ in $(seq 300); do
  url=$(sed -n 's/^listening on \(.*\)$/http:\/\/\1/p' "$dir/hub.out" 2>/dev/null | head -1 || true)
  [ -n "$url" ] && break
  sleep 0.05
done
[ -n "$url" ] || fail "hub did not start"

# downloads, before any node: a resumed backbone (the first half already
# there), one resumed from wrong bytes (the hash catches it: deleted, one
# line), a whole file with one byte changed (deleted and fetched again)
bb="$dir/sl/backbone.gguf"
half=$(($(stat -c %s "$bb") / 2))
mkdir -p "$dir/cA/pieces" "$dir/cB/pieces" "$dir/cC/pieces"
head -c "$half" "$bb" >"$dir/cA/pieces/backbone.gguf.part"
head -c "$half" /dev/zero >"$dir/cB/pieces/backbone.gguf.part"
cp "$bb" "$dir/cC/pieces/backbone.gguf"
printf '\x55' | dd of="$dir/cC/pieces/backbone.gguf" bs=1 seek=$((half + 7)) conv=notrunc 2>/dev/null
for c in cA cB cC; do
  set +e
  "$KV" run --hub "$url" --data "$dir/$c" "${RUN[@]}" >"$dir/$c.json" 2>"$dir/$c.txt"
  rc=$?
  set -e
  [ "$rc" = 2 ] || fail "$c: exit $rc with no node up, want 2"
  [ "$(wc -l <"$dir/$c.txt")" = 1 ] || fail "$c: want one line, got: $(cat "$dir/$c.txt")"
done
grep -q "lists no live node" "$dir/cA.txt" || fail "cA: $(cat "$dir/cA.txt")"
cmp -s "$bb" "$dir/cA/pieces/backbone.gguf" || fail "resumed backbone differs"
[ ! -e "$dir/cA/pieces/backbone.gguf.part" ] || fail "resumed: .part left"
grep -q "does not match the manifest's SHA-256" "$dir/cB.txt" || fail "cB: $(cat "$dir/cB.txt")"
[ ! -e "$dir/cB/pieces/backbone.gguf" ] && [ ! -e "$dir/cB/pieces/backbone.gguf.part" ] || fail "wrong bytes kept"
grep -q "lists no live node" "$dir/cC.txt" || fail "cC: $(cat "$dir/cC.txt")"
cmp -s "$bb" "$dir/cC/pieces/backbone.gguf" || fail "a changed backbone was not fetched again"
echo "ok: downloads resume, wrong bytes are deleted, a changed file is fetched again"

# node 4 starts with every slab on disk, each with one byte changed: all are
# deleted (the check below finds only the slicer's bytes on every node)
mkdir -p "$dir/n4/pieces/experts"
for f in "$dir/sl/experts/"*.gguf; do
  cp "$f" "$dir/n4/pieces/experts/"
  printf '\x55' | dd of="$dir/n4/pieces/experts/$(basename "$f")" bs=1 seek=100000 conv=notrunc 2>/dev/null
done

declare -a NP
for i in 1 2 3 4; do
  "$KV" node --hub "$url" --budget "$budget" --data "$dir/n$i" --interval-ms 300 --threads 1 \
    >"$dir/n$i.out" 2>"$dir/n$i.err" &
  NP[$i]=$!
  pids+=($!)
done

market() { curl -sf "$url/v1/market"; }
# replicas that count: sum over shards of min(live, wanted)
filled() { market | jq '[.shards[] | [.live, .wanted] | min] | add'; }
# wait_until SECONDS CMD...: polls CMD every 0.2 s; a bounded wait, not a timing assertion
wait_until() {
  local t=$1
  shift
  for _ in $(seq $((t * 5))); do
    if "$@"; then return 0; fi
    sleep 0.2
  done
  return 1
}
# full N: covered, and N replicas count, both in one reading of the market
# (kept in $dir/market.json: nodes trade meanwhile, and two readings can
# see two markets)
full() {
  market >"$dir/market.json" || return 1
  [ "$(jq .covered "$dir/market.json")" = true ] &&
    [ "$(jq '[.shards[] | [.live, .wanted] | min] | add' "$dir/market.json")" = "$1" ]
}
wait_until 30 full 16 || fail "no full coverage: $(market)"
echo "ok: four nodes reached full coverage: $(jq -c '[.shards[].live]' "$dir/market.json")"

# every piece a node holds is the slicer's bytes
for i in 1 2 3 4; do
  for f in "$dir/n$i/pieces/experts/"*.gguf; do
    cmp -s "$f" "$dir/sl/experts/$(basename "$f")" || fail "node $i: $(basename "$f") differs"
  done
  [ -s "$dir/n$i/node.key" ] || fail "node $i has no key"
done
[ "$(grep -c "not the manifest's bytes, deleted" "$dir/n4.err")" = 8 ] || fail "node 4 kept damaged slabs"

same_as_local() { # NAME: the run's tokens and logits equal the local run's
  [ "$(jq -c .tokens "$dir/local.json")" = "$(jq -c .tokens "$dir/$1.json")" ] || fail "$1: tokens differ"
  cmp -s "$dir/local.bin" "$dir/$1.bin" || fail "$1: logits differ"
  [ "$(jq .dispatch.pairs_local "$dir/$1.json")" = 0 ] || fail "$1: experts computed locally"
}
"$KV" run --hub "$url" --data "$dir/coord" "${RUN[@]}" --logits-out "$dir/hub1.bin" >"$dir/hub1.json" 2>"$dir/hub1.err" ||
  fail "run --hub failed"
same_as_local hub1
[ ! -e "$dir/coord/pieces/experts" ] || fail "the coordinator downloaded slabs"
echo "ok: run --hub equals the local run ($(jq '.dispatch.workers | length' "$dir/hub1.json") workers)"
# a coordinator key the hub does not vouch for: a warning, and no node serves it
set +e
# (--hub-wait-ms 0: no node will serve it however often the map is read)
"$KV" run --hub "$url" --data "$dir/coord" --key "$dir/stranger.key" --hub-wait-ms 0 "${RUN[@]}" >"$dir/stranger.json" 2>"$dir/stranger.err"
rc=$?
set -e
[ "$rc" = 2 ] || fail "unvouched coordinator: exit $rc, want 2"
grep -q "does not vouch for coordinator key" "$dir/stranger.err" || fail "no voucher warning: $(cat "$dir/stranger.err")"
[ ! -s "$dir/stranger.json" ] || fail "unvouched coordinator got output"
echo "ok: a coordinator the hub does not vouch for is refused by every node"
"$KV" bench --hub "$url" --data "$dir/coord" -p 8 -n 4 --reps 1 --threads 1 --json >"$dir/bench.json" 2>"$dir/bench.err" ||
  fail "bench --hub failed"
jq -e '.decode_tok_s > 0' "$dir/bench.json" >/dev/null || fail "bench --hub: $(cat "$dir/bench.json")"
# not a terminal: one plain line per downloaded piece, no progress bar
grep -q "^node: fetched experts/blk\.[0-9]*\.[0-9-]*\.gguf ($slab bytes)$" "$dir/n2.err" || fail "no download log line"
! grep -q $'\r' "$dir/n2.err" || fail "a progress bar on a non-terminal"

# kill node 1; its current worker address is the last one it served on
victim=$(sed -n 's/^node: serving .* on \(.*\)$/\1/p' "$dir/n1.err" | tail -1)
[ -n "$victim" ] || fail "node 1 serves nothing"
kill -9 "${NP[1]}"
wait "${NP[1]}" 2>/dev/null || true
"$KV" run --hub "$url" --data "$dir/coord" "${RUN[@]}" --worker-timeout-ms 2000 --logits-out "$dir/hub2.bin" \
  >"$dir/hub2.json" 2>"$dir/hub2.err" || fail "run --hub during the change failed"
same_as_local hub2
if [ "$(jq --arg a "$victim" '[.dispatch.workers[] | select(.addr == $a and .pairs == 0)] | length' "$dir/hub2.json")" = 1 ]; then
  echo "ok: a decode right after the kill (the dead node still placed, unreachable) equals the local run"
else
  echo "ok: a decode right after the kill equals the local run (the hub had already dropped the node)"
fi

gone() { ! curl -sf "$url/v1/placement" | jq -e --arg a "$victim" '[.shards[].nodes[].addr] | index($a)' >/dev/null; }
wait_until 30 gone || fail "the killed node is still placed"
# three budgets hold 15 of the 16 wanted replicas: one shard stays scarce
wait_until 30 full 15 || fail "the killed node's shards were not taken: $(market)"
# the market that showed 15: its one shard short is the one scarce shard
[ "$(jq '[.shards[] | select(.scarcity > 0)] | length' "$dir/market.json")" = 1 ] &&
  [ "$(jq -c '[.shards[] | select(.scarcity > 0) | .live < .wanted]' "$dir/market.json")" = '[true]' ] ||
  fail "scarcity: $(cat "$dir/market.json")"
echo "ok: after the kill the others took its shards: $(jq -c '[.shards[].live]' "$dir/market.json")"

"$KV" run --hub "$url" --data "$dir/coord" "${RUN[@]}" --logits-out "$dir/hub3.bin" >"$dir/hub3.json" 2>"$dir/hub3.err" ||
  fail "run --hub after the change failed"
same_as_local hub3
echo "ok: a decode after the change equals the local run"

grep -q "challenge answered" "$dir"/n*.err || fail "no storage challenge was answered"
! grep -q "dropped our holdings" "$dir"/n[234].err || fail "an honest node was dropped"
echo "ok: storage challenges answered, no honest node dropped"
