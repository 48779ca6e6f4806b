#!/usr/bin/env bash
# kv-test-labels: net attack
# The market capture of a stranger with free keys, on loopback: a hub and
# four budget-limited `kvasir node` processes (5 of 8 slabs each, 2 replicas
# wanted) reach full coverage and settle; then a stranger
# (tests/attack_register.py, its own Ed25519 client) registers fake keys
# claiming every shard: two at honest nodes' own addresses and at addresses
# of its own, and 100 more over many hosts (KV_ATTACK_FULL=1: 1,000). The
# hub lists none of them (no worker at their addresses proves their keys),
# so for the whole watch (8 s; full: 20 s) every shard stays covered with
# its 16 replicas, no honest node changes what it holds, the placement map
# is what it was, and `kvasir run --hub` gives the local run's tokens and
# logits. Without proof of service the fakes made those shards look
# over-covered: the honest nodes moved away and coverage fell to 4 of 8.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
dir=$(mktemp -d -t kvasir-capture.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  sleep 0.2
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
full=${KV_ATTACK_FULL:-0}
n_fake=100 watch=8
[ "$full" = 1 ] && n_fake=1000 watch=20

"$KV" gen-model --preset tiny --out "$dir/m.gguf" >/dev/null 2>&1
"$KV" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab 2 >/dev/null 2>&1
[ "$(jq '.slabs | length' "$dir/sl/manifest.json")" = 8 ] || fail "want 8 slabs"
slab=$(stat -c %s "$dir/sl/experts/blk.0.0000-0001.gguf")
budget=$((5 * slab + slab / 2)) # five slabs fit, six do not
RUN=(-p "Strangers cannot take the market" -n 6 --temp 0 --json --threads 1)
"$KV" run -m "$dir/m.gguf" "${RUN[@]}" --logits-out "$dir/local.bin" >"$dir/local.json"
mkdir -p "$dir/coord"
CPK=$("$KV" key --key "$dir/coord/coordinator.key")
"$KV" hub --model "$dir/sl/manifest.json" --db "$dir/hub.db" --listen 127.0.0.1:0 --deadline-ms 3000 \
  --prove-every-ms 1000 --max-per-host 64 --vouch-key "$CPK" --quiet >"$dir/hub.out" 2>"$dir/hub.err" &
pids+=($!)
url=
for _ in $(seq 300); do
  url=$(sed -n 's/^listening on \(.*\)$/http:\/\/\1/p' "$dir/hub.out" 2>/dev/null | head -1 || true)
  [ -n "$url" ] && break
  sleep 0.05
done
[ -n "$url" ] || fail "hub did not start"
for i in 1 2 3 4; do
  "$KV" node --hub "$url" --budget "$budget" --data "$dir/n$i" --interval-ms 300 --threads 1 \
    >"$dir/n$i.out" 2>"$dir/n$i.err" &
  pids+=($!)
done
market() { curl -sf "$url/v1/market"; }
filled() { market | jq '[.shards[] | [.live, .wanted] | min] | add'; }
full16() { [ "$(market | jq .covered)" = true ] && [ "$(filled)" = 16 ]; }
# (judged on the look that ended the wait: the nodes may still be moving
# replicas until the swarm settles below, and a second look could catch one
# in between; the settled swarm is checked full again before the attack)
covered=0
for _ in $(seq 300); do
  if full16; then covered=1; break; fi
  sleep 0.2
done
[ "$covered" = 1 ] || fail "no full coverage before the attack: $(market)"
# what honest nodes hold, and what coordinators read (without heartbeat times)
holdings() { curl -sf "$url/v1/nodes" | jq -c '[.nodes[] | select(.proven_shards > 0) | {key, shards}] | sort_by(.key)'; }
mapnodes() { curl -sf "$url/v1/placement" | jq -c '[.shards[] | [.nodes[] | {key, addr}] | sort_by(.key)]'; }
# a settled swarm: the same holdings and map two seconds apart (bounded)
H0=$(holdings) M0=$(mapnodes)
for _ in $(seq 15); do
  sleep 2
  H=$(holdings) M=$(mapnodes)
  [ "$H" = "$H0" ] && [ "$M" = "$M0" ] && break
  H0=$H M0=$M
done
[ "$H" = "$H0" ] && [ "$M" = "$M0" ] || fail "the honest swarm did not settle in 30 s"
[ "$(echo "$H0" | jq length)" = 4 ] || fail "want 4 listed nodes, got $H0"
full16 || fail "no full coverage once the swarm settled: $(market)"
echo "ok: four honest nodes cover the 16 replicas wanted and settled"

a1=$(curl -sf "$url/v1/nodes" | jq -r '.nodes[0].addr')
a2=$(curl -sf "$url/v1/nodes" | jq -r '.nodes[1].addr')
python3 "$SRC/tests/attack_register.py" "$url" 1 "$a1" all 1 >"$dir/att1.json" || fail "attacker: $(cat "$dir/att1.json")"
python3 "$SRC/tests/attack_register.py" "$url" 1 "$a2" all 2 >"$dir/att2.json" || fail "attacker"
python3 "$SRC/tests/attack_register.py" "$url" "$n_fake" spread all 3 >"$dir/att3.json" || fail "attacker"
jq -e '.status["200"] == 1' "$dir/att1.json" "$dir/att2.json" >/dev/null || fail "fake keys at honest addresses were refused at registration: $(cat "$dir"/att*.json)"
echo "ok: the stranger registered $((n_fake + 2)) keys: $(jq -c .status "$dir/att3.json")"
end=$((SECONDS + watch))
while [ $SECONDS -lt $end ]; do
  full16 || fail "coverage fell under attack: $(market)"
  sleep 0.5
done
H1=$(holdings) M1=$(mapnodes)
[ "$H1" = "$H0" ] || fail "the listed nodes or their holdings changed: ${H0:0:1500} -> ${H1:0:1500}"
[ "$M1" = "$M0" ] || fail "the placement map changed: ${M0:0:1500} -> ${M1:0:1500}"
curl -sf "$url/v1/nodes" | jq -e --arg a "$a1" '[.nodes[] | select(.addr == $a and .proven_shards == 0)] | length == 1' >/dev/null ||
  fail "the fake key at $a1 is not shown unproven"
echo "ok: for $watch s every shard stayed covered 16 of 16, no honest node moved, the map is unchanged"

"$KV" run --hub "$url" --data "$dir/coord" "${RUN[@]}" --logits-out "$dir/swarm.bin" >"$dir/swarm.json" 2>"$dir/run.err" ||
  fail "run --hub: $(cat "$dir/run.err")"
[ "$(jq -c .tokens "$dir/swarm.json")" = "$(jq -c .tokens "$dir/local.json")" ] || fail "tokens differ from the local run"
cmp -s "$dir/local.bin" "$dir/swarm.bin" || fail "logits differ from the local run"
echo "ok: run --hub under attack equals the local run, logits byte for byte"
