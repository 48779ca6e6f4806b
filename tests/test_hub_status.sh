#!/usr/bin/env bash
# kv-test-labels: net
# The hub's status page (GET /) in headless Chromium (Debian's chromium and
# chromium-driver; tools/install-deps.sh installs them). A swarm on
# loopback: a hub (2 replicas wanted, 1.5 s heartbeat deadline) and two
# nodes, one holding every slab and one five of the eight, so five shards
# are covered and three scarce; the second announces a port that refuses
# connections, so the hub (relay on its API port) reaches it through the
# relay; a `kvasir run --hub` computes some experts on them.
# tests/oracle/hub_status.mjs reports demand on one shard (signed with
# Node's own Ed25519), loads the page and checks the map and the market
# table (wanted, demand per shard) against /v1/market, the nodes (and which is reached through the relay, and the
# relay's traffic line) against /v1/nodes, the served counts
# against the coordinator's, then kills the full node with SIGKILL and
# waits for the page to show it gone and the new map (three shards missing).
# A missing browser is a FAILURE, not a skip.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
fail() {
  echo "FAIL: $*" >&2
  for f in "$dir"/*.err; do [ -s "$f" ] && { echo "--- $f" >&2; tail -5 "$f" >&2; }; done
  exit 1
}
dir=$(mktemp -d -t kvasir-hubpage.XXXXXX)
for t in chromium chromedriver node; do command -v "$t" >/dev/null || fail "$t not found (tools/install-deps.sh)"; done
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  sleep 0.2
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
wait_until() {
  local t=$1
  shift
  for _ in $(seq $((t * 10))); do
    if "$@"; then return 0; fi
    sleep 0.1
  done
  return 1
}
listening() { grep -q '^listening on ' "$1" 2>/dev/null; }

"$KV" gen-model --preset tiny --out "$dir/m.gguf" >/dev/null 2>&1
"$KV" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab 2 >/dev/null 2>&1
[ "$(jq '.slabs | length' "$dir/sl/manifest.json")" = 8 ] || fail "want 8 slabs"
slab=$(stat -c %s "$dir/sl/experts/blk.0.0000-0001.gguf")
DEADLINE=1500
"$KV" hub --vouch-open --model "$dir/sl/manifest.json" --db "$dir/hub.db" --listen 127.0.0.1:0 --deadline-ms $DEADLINE \
  --relay-port same --quiet >"$dir/hub.out" 2>"$dir/hub.err" &
pids+=($!)
wait_until 30 listening "$dir/hub.out" || fail "hub did not start"
hub="http://$(sed -n 's/^listening on //p' "$dir/hub.out")"

"$KV" node --hub "$hub" --budget $((9 * slab)) --data "$dir/na" --interval-ms 300 --threads 1 \
  >"$dir/na.out" 2>"$dir/na.err" &
NA=$!
pids+=($NA)
# the second node announces a port that refuses connections: the hub
# reaches it through its relay, and the page says so
refused=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$KV" node --hub "$hub" --budget $((5 * slab + slab / 2)) --data "$dir/nb" --interval-ms 300 --threads 1 \
  --advertise "127.0.0.1:$refused" >"$dir/nb.out" 2>"$dir/nb.err" &
pids+=($!)
filled() { [ "$(curl -sf "$hub/v1/market" | jq '[.shards[] | [.live, .wanted] | min] | add')" = 13 ]; }
wait_until 60 filled || fail "the swarm did not settle: $(curl -s "$hub/v1/market")"
relayed() { [ "$(curl -sf "$hub/v1/nodes" | jq '[.nodes[] | select(.relayed == true)] | length')" = 1 ]; }
wait_until 30 relayed || fail "the second node is not relayed: $(curl -s "$hub/v1/nodes")"

"$KV" run --hub "$hub" --data "$dir/coord" -p "The page shows the swarm" -n 8 --temp 0 --json --threads 1 \
  >"$dir/run.json" 2>"$dir/run.err" || fail "run --hub failed"
# a hedged request is computed by both replicas: the nodes served its pairs twice
pairs=$(jq '.dispatch.pairs_remote + .dispatch.pairs_hedged' "$dir/run.json")
[ "$pairs" -gt 0 ] || fail "the run computed no expert remotely"

# the page and its JSON come from the hub itself, with no other origin named
curl -sf "$hub/" -o "$dir/page.html" || fail "GET / failed"
grep -q '<title>Kvasir hub</title>' "$dir/page.html" || fail "GET / is not the status page"
! grep -Eq '(src|href)="(https?:)?//' "$dir/page.html" || fail "the page loads an external asset"
curl -sfI "$hub/" | grep -qi '^content-type: text/html' || fail "GET / is not text/html"

KV_HUB_URL="$hub" KV_VICTIM_PID=$NA KV_EXPECT_PAIRS=$pairs KV_DEADLINE_MS=$DEADLINE \
  node "$SRC/tests/oracle/hub_status.mjs" || fail "the status page checks failed"
