#!/usr/bin/env bash
# kv-test-labels: net
# A node the hub cannot dial joins through the hub's relay, on loopback: a
# hub with --relay-port, one ordinary node, and one node whose announced
# address refuses connections (--advertise to a port nothing listens on).
# The hub's reachability check (the prover's dial) fails, it marks the node
# relayed, the node connects out to the relay, and the hub proves it through
# a circuit before it lists its replicas. `kvasir run --hub` then gives the
# tokens and logits of the local run with experts computed by the relayed
# node (its served count rises), and so does a gateway over the hub (its
# chat text is the local run's); /v1/placement, /v1/nodes say relayed;
# /metrics carries the relay's lines; swarm status --json says the node is
# relayed, with its served count and its worker's own. Then, with a third node holding every
# shard as a replica, the relayed node is killed while a decode runs: the
# decode still equals the local run byte for byte.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
dir=$(mktemp -d -t kvasir-relayswarm.XXXXXX)
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

"$KV" gen-model --preset tiny --out "$dir/m.gguf" >/dev/null 2>&1
"$KV" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab 2 >/dev/null 2>&1
n_slabs=$(jq '.slabs | length' "$dir/sl/manifest.json")
slab=$(stat -c %s "$dir/sl/experts/blk.0.0000-0001.gguf")
[ "$n_slabs" = 8 ] || fail "want 8 slabs, got $n_slabs"
half=$((4 * slab + slab / 2)) # four slabs fit, five do not
PROMPT="A node behind a router serves through the relay"
RUN=(-p "$PROMPT" -n 8 --temp 0 --json --threads 1)
LONG=(-p "$PROMPT" -n 400 --temp 0 --json --threads 1)
"$KV" run -m "$dir/m.gguf" "${RUN[@]}" --logits-out "$dir/local.bin" >"$dir/local.json"
"$KV" run -m "$dir/m.gguf" "${LONG[@]}" --logits-out "$dir/local_long.bin" >"$dir/local_long.json"

mkdir -p "$dir/coord"
CPK=$("$KV" key --key "$dir/coord/coordinator.key")
"$KV" hub --model "$dir/sl/manifest.json" --db "$dir/hub.db" --listen 127.0.0.1:0 --tls --relay-port 0 --deadline-ms 1500 \
  --wanted 1 --relay-max-circuits-per-node 32 --relay-rate-per-node $((64 << 20)) --vouch-key "$CPK" \
  >"$dir/hub.out" 2>"$dir/hub.err" &
HUBP=$!
pids+=($!)
base_url=
for _ in $(seq 300); do
  base_url=$(sed -n 's/^listening on \(.*\)$/https:\/\/\1/p' "$dir/hub.out" 2>/dev/null | head -1 || true)
  [ -n "$base_url" ] && break
  sleep 0.05
done
[ -n "$base_url" ] || fail "hub did not start"
fp=$(sed -n 's/^tls sha256:\([0-9a-f]\{64\}\)$/\1/p' "$dir/hub.out")
[ -n "$fp" ] || fail "no tls sha256 line"
hub="$base_url#sha256=$fp" # what nodes and coordinators are given
url=$base_url              # what curl reads, pinned to the same key below
pin="sha256//$(python3 -c 'import sys,base64; print(base64.b64encode(bytes.fromhex(sys.argv[1])).decode())' "$fp")"
curl() { command curl --cacert /dev/null -k --pinnedpubkey "$pin" "$@"; }
rport=$(sed -n 's/^relay on port \([0-9]*\)$/\1/p' "$dir/hub.out")
[ -n "$rport" ] && [ "$rport" != 0 ] || fail "no relay port printed: $(cat "$dir/hub.out")"
[ "$(curl -sf "$url/v1/status" | jq .relay.port)" = "$rport" ] || fail "/v1/status names no relay"
# the relay serves the hub's certificate: OpenSSL's own client reads the
# same public-key fingerprint on the relay port as the hub printed
rfp=$(openssl s_client -connect "127.0.0.1:$rport" -tls1_3 </dev/null 2>/dev/null | openssl x509 -pubkey -noout |
  openssl pkey -pubin -outform der | sha256sum | cut -c1-64)
[ "$rfp" = "$fp" ] || fail "the relay's certificate fingerprint $rfp is not the hub's $fp"
echo "ok: the relay on port $rport serves the hub's certificate (sha256 $fp)"

# bad input: one line naming the flag, a non-zero exit; a relay port in use
one_line_err() { # NEEDLE CMD...: fails with exactly one stderr line containing NEEDLE
  local needle=$1 rc=0
  shift
  "$@" >/dev/null 2>"$dir/bad.txt" || rc=$?
  [ "$rc" != 0 ] && [ "$rc" -lt 128 ] || fail "$*: exit $rc"
  [ "$(wc -l <"$dir/bad.txt")" = 1 ] && grep -q -- "$needle" "$dir/bad.txt" || fail "$*: $(cat "$dir/bad.txt")"
}
HUBARGS=(--model "$dir/sl/manifest.json" --db "$dir/hub2.db" --listen 127.0.0.1:0 --quiet)
one_line_err "--relay-port" "$KV" hub "${HUBARGS[@]}" --relay-port 70000
one_line_err "need --relay-port" "$KV" hub "${HUBARGS[@]}" --relay-rate-per-node 65536
one_line_err "--relay-rate" "$KV" hub "${HUBARGS[@]}" --relay-port 0 --relay-rate 12
one_line_err "relay on 127.0.0.1:$rport" "$KV" hub "${HUBARGS[@]}" --relay-port "$rport"
one_line_err "--relay: 'sometimes'" "$KV" node --hub "$hub" --budget 1M --data "$dir/nX" --relay sometimes
echo "ok: bad relay flags and a relay port in use: one line each"

# a port that refuses connections: bound, never listened on, held open
refused=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$KV" node --hub "$hub" --budget "$half" --data "$dir/nA" --interval-ms 300 --threads 1 \
  >"$dir/nA.out" 2>"$dir/nA.err" &
NA=$!
pids+=($!)
"$KV" node --hub "$hub" --budget "$half" --data "$dir/nR" --interval-ms 300 --threads 1 \
  --advertise "127.0.0.1:$refused" >"$dir/nR.out" 2>"$dir/nR.err" &
NR=$!
pids+=($!)
wait_until 20 test -s "$dir/nR/node.key" || fail "the relayed node made no key"
RKEY=$(head -c 64 "$dir/nR/node.key")

nodes() { curl -sf "$url/v1/nodes"; }
rnode() { nodes | jq --arg a "127.0.0.1:$refused" '.nodes[] | select(.addr == $a)'; }
covered() { [ "$(curl -sf "$url/v1/market" | jq .covered)" = true ]; }
r_listed() {
  [ "$(rnode | jq .relayed)" = true ] && [ "$(rnode | jq .proven_shards)" -gt 0 ] &&
    curl -sf "$url/v1/placement" | jq -e --arg a "127.0.0.1:$refused" \
      '[.shards[].nodes[] | select(.addr == $a and .relayed == true)] | length > 0' >/dev/null
}
wait_until 60 covered || fail "no coverage: $(curl -sf "$url/v1/market") $(nodes)"
wait_until 30 r_listed || fail "the relayed node is not listed as relayed: $(nodes)"
[ "$(nodes | jq '[.nodes[] | select(.relayed == false)] | length')" = 1 ] || fail "the ordinary node: $(nodes)"
grep -q "cannot be dialed.*relayed" "$dir/hub.err" || fail "the hub logged no failed reachability check"
grep -q "serving through the hub's relay" "$dir/nR.err" || fail "the relayed node did not connect out"
echo "ok: the hub marked the unreachable node relayed and proved it through the relay: $(rnode | jq -c '{relayed, proven_shards, challenges_passed}')"

same_as() { # NAME REF: the run's tokens and logits equal the local run's
  [ "$(jq -c .tokens "$dir/$2.json")" = "$(jq -c .tokens "$dir/$1.json")" ] || fail "$1: tokens differ"
  cmp -s "$dir/$2.bin" "$dir/$1.bin" || fail "$1: logits differ"
  [ "$(jq .dispatch.pairs_local "$dir/$1.json")" = 0 ] || fail "$1: experts computed locally"
}
"$KV" run --hub "$hub" --data "$dir/coord" "${RUN[@]}" --logits-out "$dir/hub1.bin" >"$dir/hub1.json" 2>"$dir/hub1.err" ||
  fail "run --hub failed"
same_as hub1 local
rpairs=$(jq --arg a "127.0.0.1:$refused" '[.dispatch.workers[] | select(.addr == $a) | .pairs] | add // 0' "$dir/hub1.json")
[ "$rpairs" -gt 0 ] || fail "the relayed node computed nothing: $(jq -c .dispatch.workers "$dir/hub1.json")"
served() { [ "$(rnode | jq .served_pairs)" -ge "$rpairs" ]; }
wait_until 10 served || fail "the hub's served count of the relayed node: $(rnode | jq -c .)"
echo "ok: run --hub equals the local run; the relayed node computed $rpairs experts through the relay"

# a gateway over the hub reaches the relayed node too: its chat text is the local run's
"$KV" gateway --hub "$hub" --data "$dir/coord" --listen 127.0.0.1:0 --threads 1 --hub-refresh-ms 200 \
  --worker-timeout-ms 2000 >"$dir/gw.out" 2>"$dir/gw.err" &
GWP=$!
pids+=($GWP)
gwaddr() { sed -n 's/^listening on \(.*\)$/\1/p' "$dir/gw.out" 2>/dev/null | head -1; }
wait_until 60 eval '[ -n "$(gwaddr)" ]' || fail "gateway did not start"
gw="http://$(gwaddr)"
healthy() { [ "$(command curl -s -o "$dir/health.json" -w '%{http_code}' "$gw/health")" = 200 ]; }
wait_until 60 healthy || fail "gateway not healthy: $(cat "$dir/health.json")"
ref=$("$KV" run -m "$dir/m.gguf" --chat --json --threads 1 -p "$PROMPT" -n 12 --temp 0 --seed 1 | jq -r .text)
before=$(rnode | jq .served_pairs)
body=$(jq -nc --arg p "$PROMPT" '{model: "kvasir", messages: [{role: "user", content: $p}], max_tokens: 12,
  temperature: 0, seed: 1}')
command curl -s "$gw/v1/chat/completions" -H 'Content-Type: application/json' -d "$body" >"$dir/c1.json" &&
  jq -e .choices "$dir/c1.json" >/dev/null ||
  fail "gateway chat failed: $(cat "$dir/c1.json")"
[ "$(jq -r '.choices[0].message.content' "$dir/c1.json")" = "$ref" ] || fail "gateway text differs from the local run"
gserved() { [ "$(rnode | jq .served_pairs)" -gt "$before" ]; }
wait_until 10 gserved || fail "the relayed node served nothing for the gateway: $(rnode | jq -c .)"
kill -TERM "$GWP"
wait "$GWP" 2>/dev/null || true
echo "ok: a gateway over the hub gives the local run's text; the relayed node served $(($(rnode | jq .served_pairs) - before)) more"

curl -sf "$url/metrics" >"$dir/metrics.txt" || fail "no /metrics"
grep -q '^kvasir_hub_relayed_nodes 1$' "$dir/metrics.txt" || fail "metrics: $(grep relayed "$dir/metrics.txt")"
grep -q '^kvasir_relay_nodes 1$' "$dir/metrics.txt" || fail "metrics: no relay node line"
circ=$(sed -n 's/^kvasir_relay_circuits_total \([0-9]*\)$/\1/p' "$dir/metrics.txt")
tocoord=$(sed -n 's/^kvasir_relay_bytes_to_coord \([0-9]*\)$/\1/p' "$dir/metrics.txt")
[ "${circ:-0}" -ge 2 ] && [ "${tocoord:-0}" -gt 0 ] || fail "metrics: circuits $circ, bytes to coordinators $tocoord"

# kvasir swarm status --json over these processes (a swarm.json naming them,
# as swarm up writes it; the swarm's coordinator key is the vouched one): the
# relayed node is said relayed, with the hub's served count and the
# expert computations its worker counts, read through the hub's relay
start_of() { python3 -c 'import sys; print(open("/proc/%s/stat" % sys.argv[1]).read().rsplit(")", 1)[1].split()[19])' "$1"; }
mkdir -p "$dir/sw"
cp "$dir/coord/coordinator.key" "$dir/sw/coordinator.key"
jq -n --arg dir "$dir/sw" --arg man "$dir/sl/manifest.json" --arg hub "$hub" --arg d "$dir" \
  --argjson hp "$HUBP" --argjson hs "$(start_of "$HUBP")" --argjson ap "$NA" --argjson ast "$(start_of "$NA")" \
  --argjson rp "$NR" --argjson rs "$(start_of "$NR")" \
  '{version: 1, dir: $dir, manifest: $man, beacon_port: 0,
    hub: {name: "hub", pid: $hp, start: $hs, log: ($d + "/hub.err"), url: $hub},
    nodes: [{name: "node1", pid: $ap, start: $ast, log: ($d + "/nA.err"), data: ($d + "/nA")},
            {name: "node2", pid: $rp, start: $rs, log: ($d + "/nR.err"), data: ($d + "/nR")}]}' >"$dir/sw/swarm.json"
"$KV" swarm status --dir "$dir/sw" --json >"$dir/status.json" 2>"$dir/status.err" ||
  fail "swarm status: $(cat "$dir/status.err")"
jq -e '.nodes[] | select(.name == "node2") | .relayed == true and .served_pairs > 0 and .experts_computed > 0' \
  "$dir/status.json" >/dev/null || fail "swarm status --json on the relayed node: $(jq -c .nodes "$dir/status.json")"
jq -e '[.nodes[] | select(.relayed == false)] | length == 1' "$dir/status.json" >/dev/null ||
  fail "swarm status --json on the ordinary node: $(jq -c .nodes "$dir/status.json")"
echo "ok: swarm status --json: $(jq -c '.nodes[] | select(.name == "node2") | {relayed, served_pairs, experts_computed}' "$dir/status.json")"
echo "ok: /metrics: one relayed node, $circ circuits, $tocoord bytes to coordinators"

# a replica of every shard on a third, ordinary node; then the relayed node
# is killed while a decode runs through it. The third node answers 5 ms late
# (test only), so that replica choice, which prefers the replica expected to
# answer first, sends the relayed node its share of the decode until it dies
"$KV" node --hub "$hub" --budget $((9 * slab)) --data "$dir/nC" --interval-ms 300 --threads 1 --test-delay=5 \
  >"$dir/nC.out" 2>"$dir/nC.err" &
pids+=($!)
cfull() {
  curl -sf "$url/v1/placement" | jq -e --arg a "127.0.0.1:$refused" \
    '[.shards[] | select([.nodes[] | select(.addr != $a)] | length == 0)] | length == 0' >/dev/null
}
wait_until 60 cfull || fail "the third node does not cover every shard: $(curl -sf "$url/v1/placement")"
r_listed || fail "the relayed node left the map"
"$KV" run --hub "$hub" --data "$dir/coord" "${LONG[@]}" --worker-timeout-ms 2000 --logits-out "$dir/hub2.bin" \
  >"$dir/hub2.json" 2>"$dir/hub2.err" &
RUNP=$!
# the decode is under way once the relay forwards this run's bytes: then the
# relayed node is frozen (its answers stop mid-decode) and killed (its
# outbound connection drops, and with it every circuit it carried)
tocoord() { curl -sf "$url/metrics" | sed -n 's/^kvasir_relay_bytes_to_coord \([0-9]*\)$/\1/p'; }
base=$(tocoord)
busy() { [ "$(tocoord)" -gt $((base + 20000)) ] || ! kill -0 "$RUNP" 2>/dev/null; }
for _ in $(seq 1000); do busy && break; sleep 0.01; done
kill -0 "$RUNP" 2>/dev/null || fail "the decode ended before the relayed node was killed: make it longer"
kill -STOP "$NR"
sleep 0.3
kill -9 "$NR"
wait "$NR" 2>/dev/null || true
wait "$RUNP" || fail "run --hub with the relayed node killed failed"
same_as hub2 local_long
kpairs=$(jq --arg a "127.0.0.1:$refused" '[.dispatch.workers[] | select(.addr == $a) | .pairs] | add // 0' "$dir/hub2.json")
[ "$kpairs" -gt 0 ] || fail "the relayed node computed nothing in the decode it was killed in"
# seen: dropped, or (replica choice and hedging) its stalled requests hedged to a replica
jq -e --arg a "127.0.0.1:$refused" '[.dispatch.workers[] | select(.addr == $a) | (.up == false or .drops > 0 or .hedged > 0)] | all' \
  "$dir/hub2.json" >/dev/null || fail "the coordinator did not see the relayed path drop: $(jq -c .dispatch.workers "$dir/hub2.json")"
echo "ok: the relayed node killed during a decode (after $kpairs experts through the relay): the decode equals the local run"
