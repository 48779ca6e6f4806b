#!/usr/bin/env bash
# kv-test-labels: net
# A coordinator that finds no holder for an expert reads the placement map
# again instead of giving up (nodes trading shards are normal life in a
# market). A hub whose map lacks shards: node 1's budget holds 5 of the 8
# slabs. `kvasir run --hub` starts, finds layers it cannot serve and waits,
# reading the map again; node 2 then takes the missing shards, and the run
# gives the tokens and logits of `kvasir run -m FULL.gguf` byte for byte.
# `bench --hub` does the same. Before, both exited at once with "layer L
# expert E is served by no worker".
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
dir=$(mktemp -d -t kvasir-late.XXXXXX)
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
# wait_until SECONDS CMD...: polls CMD every 0.1 s; a bounded wait, not a timing assertion
wait_until() {
  local t=$1
  shift
  for _ in $(seq $((t * 10))); do
    if "$@"; then return 0; fi
    sleep 0.1
  done
  return 1
}

"$KV" gen-model --preset tiny --out "$dir/m.gguf" >/dev/null 2>&1
"$KV" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab 2 >/dev/null 2>&1
[ "$(jq '.slabs | length' "$dir/sl/manifest.json")" = 8 ] || fail "want 8 slabs"
slab=$(stat -c %s "$dir/sl/experts/blk.0.0000-0001.gguf")
budget=$((5 * slab + slab / 2)) # five slabs fit, six do not
RUN=(-p "The map gains a shard" -n 6 --temp 0 --json --threads 1)
"$KV" run -m "$dir/m.gguf" "${RUN[@]}" --logits-out "$dir/local.bin" >"$dir/local.json"

mkdir -p "$dir/coord"
CPK=$("$KV" key --key "$dir/coord/coordinator.key")
"$KV" hub --model "$dir/sl/manifest.json" --db "$dir/hub.db" --listen 127.0.0.1:0 --deadline-ms 3000 \
  --vouch-key "$CPK" --quiet >"$dir/hub.out" 2>"$dir/hub.err" &
pids+=($!)
url=
for _ in $(seq 300); do
  url=$(sed -n 's/^listening on \(.*\)$/http:\/\/\1/p' "$dir/hub.out" 2>/dev/null | head -1 || true)
  [ -n "$url" ] && break
  sleep 0.05
done
[ -n "$url" ] || fail "hub did not start"
market() { curl -sf "$url/v1/market"; }
live_slabs() { market | jq '[.shards[] | select(.live > 0)] | length'; }
live_is() { [ "$(live_slabs)" = "$1" ]; }
live_below() { [ "$(live_slabs)" -lt "$1" ]; }
node() { # node N: a node with a budget of five slabs
  "$KV" node --hub "$url" --budget "$budget" --data "$dir/n$1" --interval-ms 300 --threads 1 \
    >"$dir/n$1.out" 2>"$dir/n$1.err" &
  last_node=$!
  pids+=($!)
}
node 1
wait_until 30 live_is 5 || fail "node 1 did not serve 5 slabs: $(market)"

for what in run bench; do
  rm -f "$dir/$what.err"
  if [ "$what" = run ]; then
    "$KV" run --hub "$url" --data "$dir/coord" "${RUN[@]}" --logits-out "$dir/hub.bin" >"$dir/hub.json" 2>"$dir/run.err" &
  else
    "$KV" bench --hub "$url" --data "$dir/coord" -p 8 -n 4 --reps 1 --threads 1 --json >"$dir/bench.json" 2>"$dir/bench.err" &
  fi
  cpid=$!
  pids+=($cpid)
  # the coordinator sees shards nobody serves and reads the map again
  wait_until 30 grep -q "reading the placement map again" "$dir/$what.err" || fail "$what: $(cat "$dir/$what.err")"
  kill -0 "$cpid" 2>/dev/null || fail "$what gave up: $(cat "$dir/$what.err")"
  if [ "$what" = run ]; then
    node 2 # takes the missing shards
    wait_until 30 live_is 8 || fail "node 2 did not cover the rest: $(market)"
  fi
  wait "$cpid" || fail "$what --hub failed after the map gained its shards: $(cat "$dir/$what.err")"
  echo "ok: $what --hub waited for the missing shards ($(grep -c "reading the placement map again" "$dir/$what.err") re-reads)"
  if [ "$what" = run ]; then
    [ "$(jq -c .tokens "$dir/local.json")" = "$(jq -c .tokens "$dir/hub.json")" ] || fail "tokens differ"
    cmp -s "$dir/local.bin" "$dir/hub.bin" || fail "logits differ"
    echo "ok: the tokens and logits equal the local run's"
    # bench next: node 2 is stopped, so the map lacks shards again until it is back
    kill -TERM "$last_node"
    wait "$last_node" 2>/dev/null || true
    wait_until 30 live_below 8 || fail "node 2's shards still live: $(market)"
    # exec: the node takes the subshell's pid, so the cleanup stops it
    # (before, it stopped the subshell and the node lived on after the test)
    (sleep 2; exec "$KV" node --hub "$url" --budget "$budget" --data "$dir/n2" --interval-ms 300 --threads 1 \
      >"$dir/n2b.out" 2>"$dir/n2b.err") &
    pids+=($!)
  fi
done
jq -e '.decode_tok_s > 0' "$dir/bench.json" >/dev/null || fail "bench: $(cat "$dir/bench.json")"
echo "ok: a coordinator reads the placement map again until every shard is served"
