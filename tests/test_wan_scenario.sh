#!/usr/bin/env bash
# kv-test-labels: net
# The scenario of the design (issue 30, point 4) end to end in the WAN test
# bed (tests/netns_topo.sh, docs/NETDELAY.md "The scenario"): a hub with its
# relay on the public side (hub, site A), two public nodes (a1 in site A, b1
# in site B, 40 ms away, 0.5% loss), one node behind the home router's NAT
# (nat), and a paying gateway (a2, its HTTP API on a2's own loopback; its
# links to the hub and the nodes are TLS). The NATed node takes shards from
# the market by itself (a budget that forces it to hold some alone), the hub
# cannot dial it back and marks it relayed, it serves through the relay, and:
#  - `kvasir run --hub` from a2: tokens and logits byte-identical to the
#    one-process `kvasir run`, with experts computed by the NATed node;
#  - a paid chat completion through the gateway: the local run's text, the
#    NATed node's served count rises, the ledger pays its node account for
#    exactly the products its worker counted, `ledger check` and `ledger
#    summary` hold;
#  - with b1 holding a replica of everything, the NATed node is frozen and
#    killed mid-decode (a `run --hub` and a gateway completion in flight):
#    both finish and equal the local runs byte for byte;
#  - tcpdump on kvw0 of every public host (the NAT traffic is seen after the
#    router, on the hub and the other ends) from before the first process to
#    the end: every TCP stream's bytes, each direction reassembled, are well
#    formed TLS records from a handshake on (tests/wan_tls_only.py).
# Short by default (~60 s); KV_WAN_FULL=1 (make wan-test) decodes longer.
# Needs root (network namespaces), nft and tcpdump: without, it fails.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
KV=$(cd "$(dirname "$KV")" && pwd)/$(basename "$KV")
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
KV_BUILD=${KV_BUILD:-$(dirname "$KV")}
FULL=${KV_WAN_FULL:-0}
dir=$(mktemp -d -t kvasir-wanscen.XXXXXX)
chmod 755 "$dir"
fail() {
  echo "FAIL: $*" >&2
  for f in "$dir"/*.err; do [ -s "$f" ] && { echo "--- $f" >&2; tail -6 "$f" >&2; }; done
  exit 1
}
. "$SRC/tests/netns_wan.sh"
. "$SRC/tests/netns_topo.sh"
trap 'topo_cleanup; rm -rf "$dir"' EXIT
command -v tcpdump >/dev/null || fail "needs tcpdump"
wan_available || fail "needs root and network namespaces (ip netns add failed)"
wait_until() { # SECONDS CMD...: polls CMD every 0.2 s; a bounded wait, not a timing assertion
  local t=$1
  shift
  for _ in $(seq $((t * 5))); do
    if "$@"; then return 0; fi
    sleep 0.2
  done
  return 1
}

# ---- the model, the local references (no network involved)
"$KV" gen-model --preset tiny --out "$dir/m.gguf" >/dev/null 2>&1
"$KV" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab 2 >/dev/null 2>&1
n_slabs=$(jq '.slabs | length' "$dir/sl/manifest.json")
slab=$(stat -c %s "$dir/sl/experts/blk.0.0000-0001.gguf")
[ "$n_slabs" = 8 ] || fail "want 8 slabs, got $n_slabs"
half=$((4 * slab + slab / 2)) # four slabs fit, five do not
n_long=240 # long enough that the kill lands mid-decode under load (48 ended first once at load 8, 120 once beside replica choice)
[ "$FULL" = 1 ] && n_long=480
PROMPT="A workstation in another city joins with one outbound connection"
RUN=(-p "$PROMPT" -n 8 --temp 0 --json --threads 1)
LONG=(-p "$PROMPT" -n "$n_long" --temp 0 --json --threads 1)
"$KV" run -m "$dir/m.gguf" "${RUN[@]}" --logits-out "$dir/local.bin" >"$dir/local.json"
"$KV" run -m "$dir/m.gguf" "${LONG[@]}" --logits-out "$dir/local_long.bin" >"$dir/local_long.json"
ref=$("$KV" run -m "$dir/m.gguf" --chat --json --threads 1 -p "$PROMPT" -n 12 --temp 0 --seed 1 | jq -r .text)
ref_long=$("$KV" run -m "$dir/m.gguf" --chat --json --threads 1 -p "$PROMPT" -n "$n_long" --temp 0 --seed 1 | jq -r .text)

# ---- the ledger: an operator, a consumer with a balance
for k in op c1 gw; do "$KV" wallet new --out "$dir/$k.key" >/dev/null; done
"$KV" ledger init --db "$dir/l.db" --key "$dir/op.key" --fee-bps 250 >/dev/null
C1=$("$KV" wallet show --key "$dir/c1.key" --json | jq -r .account)
"$KV" ledger issue --db "$dir/l.db" --key "$dir/op.key" --to "$C1" --amount 10000000 >/dev/null
mkdir -p "$dir/coord"
CPK=$("$KV" key --key "$dir/coord/coordinator.key")

topo_setup
IP_HUB=${TOPO_IP[hub]}
echo "bed: hub $IP_HUB, a1 ${TOPO_IP[a1]}, gateway on a2 ${TOPO_IP[a2]} (site A); b1 ${TOPO_IP[b1]} (site B," \
  "${TOPO_LONG_MS} ms one way, ${TOPO_LONG_LOSS}% loss); nat ${TOPO_IP[nat]} behind ${TOPO_IP[router]}"

# ---- the capture: kvw0 of every public host, from before the first process
CAPP=()
for h in hub a1 a2 b1 router; do
  topo_bg "$h" "$dir/cap_$h.txt" tcpdump -i kvw0 -n -s 0 -U -B 8192 -w "$dir/cap_$h.pcap" tcp
  CAPP+=("$TOPO_BG_PID")
done
for h in hub a1 a2 b1 router; do
  wait_until 10 grep -q "listening on" "$dir/cap_$h.txt.err" || fail "tcpdump on $h did not start"
done

# ---- the hub with its relay (https: a non-loopback address)
topo_bg hub "$dir/hub.out" "$KV" hub --model "$dir/sl/manifest.json" --db "$dir/hub.db" --listen "$IP_HUB:7700" \
  --relay-port 7443 --deadline-ms 1500 --wanted 1 --relay-max-circuits-per-node 32 --relay-rate-per-node $((64 << 20)) \
  --vouch-key "$CPK"
wait_until 20 grep -q '^tls sha256:' "$dir/hub.out" || fail "the hub did not start"
fp=$(sed -n 's/^tls sha256:\([0-9a-f]\{64\}\)$/\1/p' "$dir/hub.out")
grep -q '^relay on port 7443$' "$dir/hub.out" || fail "no relay: $(cat "$dir/hub.out")"
hub="https://$IP_HUB:7700#sha256=$fp"
pin="sha256//$(python3 -c 'import sys,base64; print(base64.b64encode(bytes.fromhex(sys.argv[1])).decode())' "$fp")"
hcurl() { topo_exec a2 curl --cacert /dev/null -k --pinnedpubkey "$pin" -sf "https://$IP_HUB:7700$1"; }

# ---- the nodes: a1 (site A) and nat (behind the router) take half each
topo_bg a1 "$dir/na1.out" "$KV" node --hub "$hub" --budget "$half" --data "$dir/na1" --listen "${TOPO_IP[a1]}:7300" \
  --interval-ms 300 --threads 1
topo_bg nat "$dir/nnat.out" "$KV" node --hub "$hub" --budget "$half" --data "$dir/nnat" \
  --listen "${TOPO_IP[nat]}:7300" --interval-ms 300 --threads 1
NATP=$TOPO_BG_PID
NADDR="${TOPO_IP[nat]}:7300"
nodes() { hcurl /v1/nodes; }
nnode() { nodes | jq --arg a "$NADDR" '.nodes[] | select(.addr == $a)'; }
covered() { [ "$(hcurl /v1/market | jq .covered)" = true ]; }
alone() { # shards whose only holder is the NATed node
  hcurl /v1/placement | jq --arg a "$NADDR" '[.shards[] | select([.nodes[].addr] == [$a])] | length'
}
n_listed() {
  [ "$(nnode | jq .relayed)" = true ] && [ "$(nnode | jq .proven_shards)" -gt 0 ] &&
    hcurl /v1/placement | jq -e --arg a "$NADDR" \
      '[.shards[].nodes[] | select(.addr == $a and .relayed == true)] | length > 0' >/dev/null
}
wait_until 90 covered || fail "no coverage: $(hcurl /v1/market) $(nodes)"
wait_until 45 n_listed || fail "the NATed node is not listed as relayed: $(nodes)"
grep -q "cannot be dialed.*relayed" "$dir/hub.out.err" || fail "the hub logged no failed reachability check"
grep -q "serving through the hub's relay" "$dir/nnat.out.err" || fail "the NATed node did not connect out"
# the market settles: the same placement (who holds what) on 4 reads 0.5 s apart
placed() { hcurl /v1/placement | jq -c '[.shards[] | [.nodes[].addr] | sort]'; }
stable() {
  local p q
  p=$(placed)
  for _ in 1 2 3; do
    sleep 0.5
    q=$(placed)
    [ "$p" = "$q" ] || return 1
  done
}
wait_until 60 stable || fail "the placement does not settle: $(hcurl /v1/placement)"
n_listed || fail "the NATed node left the map"
na=$(alone)
[ "$na" -gt 0 ] || fail "the NATed node holds no shard alone: $(hcurl /v1/placement)"
echo "ok: the NATed node took shards from the market ($na held by it alone), the hub could not dial it and marked it" \
  "relayed: $(nnode | jq -c '{relayed, proven_shards, challenges_passed}')"

# ---- run --hub from a2: tokens and logits equal the one-process run
same_as() { # NAME REF: the run's tokens and logits equal the local run's
  [ "$(jq -c .tokens "$dir/$2.json")" = "$(jq -c .tokens "$dir/$1.json")" ] || fail "$1: tokens differ"
  cmp -s "$dir/$2.bin" "$dir/$1.bin" || fail "$1: logits differ"
  [ "$(jq .dispatch.pairs_local "$dir/$1.json")" = 0 ] || fail "$1: experts computed locally"
}
npairs() { jq --arg a "$NADDR" '[.dispatch.workers[] | select(.addr == $a) | .pairs] | add // 0' "$dir/$1.json"; }
topo_exec a2 "$KV" run --hub "$hub" --data "$dir/coord" "${RUN[@]}" --logits-out "$dir/hub1.bin" \
  >"$dir/hub1.json" 2>"$dir/hub1.err" || fail "run --hub failed"
same_as hub1 local
p1=$(npairs hub1)
[ "$p1" -gt 0 ] || fail "the NATed node computed nothing: $(jq -c .dispatch.workers "$dir/hub1.json")"
echo "ok: run --hub across the WAN equals the local run (tokens, logits); the NATed node computed $p1 experts"

# ---- a paid chat completion through the gateway on a2
topo_bg a2 "$dir/gw.out" "$KV" gateway --hub "$hub" --data "$dir/coord" --listen 127.0.0.1:0 --threads 1 \
  --hub-refresh-ms 200 --worker-timeout-ms 3000 --ledger "$dir/l.db" --gateway-key "$dir/gw.key" --gateway-id gwW \
  --prices 5,11
gwaddr() { sed -n 's/^listening on \(.*\)$/\1/p' "$dir/gw.out" 2>/dev/null | head -1; }
wait_until 60 eval '[ -n "$(gwaddr)" ]' || fail "gateway did not start"
gw="http://$(gwaddr)"
healthy() { [ "$(topo_exec a2 curl -s -o "$dir/health.json" -w '%{http_code}' "$gw/health")" = 200 ]; }
wait_until 60 healthy || fail "gateway not healthy: $(cat "$dir/health.json")"
chat() { # MAX_TOKENS: a request body
  jq -nc --arg p "$PROMPT" --argjson n "$1" '{model: "kvasir", messages: [{role: "user", content: $p}],
    max_tokens: $n, temperature: 0, seed: 1}'
}
paid() { # OUT MAX_TOKENS: a paid chat completion from inside a2
  topo_exec a2 curl -s "$gw/v1/chat/completions" -H 'Content-Type: application/json' \
    -H "X-KVR-Payment: $("$KV" wallet pay --key "$dir/c1.key" --gateway gwW --max 5000000)" -d "$(chat "$2")" >"$1"
}
NKEY=$("$KV" wallet show --key "$dir/nnat/node.key")
served() { nnode | jq .served_pairs; }
before=$(served)
# a 503 (a shard no worker that is up covers: the gateway's circuit to the
# NATed node dropped and is being redialed) is retried as a client would,
# after /health is 200 again; at most 5 times, counted in the output
retries=0
for _ in 1 2 3 4 5 6; do
  wait_until 30 healthy || fail "gateway not healthy: $(cat "$dir/health.json")"
  paid "$dir/c1.json" 12 || fail "gateway chat failed"
  [ "$(jq -r '.error.code // empty' "$dir/c1.json")" = server_overloaded ] || break
  retries=$((retries + 1))
done
[ "$(jq -r '.choices[0].message.content' "$dir/c1.json")" = "$ref" ] ||
  fail "gateway text differs from the local run: $(cat "$dir/c1.json")"
products() { "$KV" ledger summary --db "$dir/l.db" --json | jq --arg n "node:$NKEY" '[.nodes[] | select(.account == $n) | .products] | add // 0'; }
paid_n=$(products)
[ "$paid_n" -gt 0 ] || fail "the ledger paid the NATed node nothing: $("$KV" ledger summary --db "$dir/l.db" --json)"
settled() { [ "$(served)" = $((before + paid_n)) ]; }
wait_until 10 settled || fail "the NATed node's worker counted $(($(served) - before)) products, the ledger paid $paid_n"
"$KV" ledger check --db "$dir/l.db" >/dev/null || fail "ledger check: $("$KV" ledger check --db "$dir/l.db" 2>&1)"
"$KV" ledger summary --db "$dir/l.db" >/dev/null || fail "ledger summary: the books do not balance"
echo "ok: a paid completion through the gateway gives the local run's text; the NATed node's worker counted" \
  "$paid_n products and the ledger paid node:${NKEY:0:12}... for exactly $paid_n; ledger check holds ($retries 503s retried)"

# ---- a replica of everything on b1 (site B), then the NATed node killed mid-decode
topo_bg b1 "$dir/nb1.out" "$KV" node --hub "$hub" --budget $((9 * slab)) --data "$dir/nb1" \
  --listen "${TOPO_IP[b1]}:7300" --interval-ms 300 --threads 1
bfull() {
  hcurl /v1/placement | jq -e --arg a "$NADDR" \
    '[.shards[] | select([.nodes[] | select(.addr != $a)] | length == 0)] | length == 0' >/dev/null
}
wait_until 90 bfull || fail "b1 does not cover every shard: $(hcurl /v1/placement)"
wait_until 60 stable || fail "the placement does not settle: $(hcurl /v1/placement)"
n_listed || fail "the NATed node left the map"
sleep 0.6 # the gateway's view of the placement refreshes every 200 ms
# the decode is under way through the relay once the NATed node's own count
# (its heartbeats to the hub) rises; then the completion joins it, and the
# NATed node is frozen (its answers stop mid-decode) and killed (its one
# outbound connection drops, and with it every circuit it carried)
s0=$(served)
topo_exec a2 "$KV" run --hub "$hub" --data "$dir/coord" "${LONG[@]}" --worker-timeout-ms 3000 \
  --logits-out "$dir/hub2.bin" >"$dir/hub2.json" 2>"$dir/hub2.err" &
RUNP=$!
rose() { [ "$(served)" -gt "$1" ] || ! kill -0 "$RUNP" 2>/dev/null; }
wait_until 30 rose "$s0" || fail "the NATed node served nothing of the decode: $(nnode)"
s1=$(served)
paid "$dir/c2.json" "$n_long" &
CHATP=$!
wait_until 5 rose "$s1" || true
kill -0 "$RUNP" 2>/dev/null || fail "the decode ended before the NATed node was killed: make it longer"
kill -STOP "$NATP"
sleep 0.3
kill -9 "$NATP"
wait "$NATP" 2>/dev/null || true
wait "$RUNP" || fail "run --hub with the NATed node killed failed"
wait "$CHATP" || fail "the gateway completion with the NATed node killed failed"
same_as hub2 local_long
kp=$(npairs hub2)
[ "$kp" -gt 0 ] || fail "the NATed node computed nothing in the decode it was killed in: $(jq -c .dispatch.workers "$dir/hub2.json")"
# seen: dropped, or (replica choice and hedging) its stalled requests hedged to a
# replica, after which replica choice may send it nothing more to find it gone
jq -e --arg a "$NADDR" '[.dispatch.workers[] | select(.addr == $a) | (.up == false or .drops > 0 or .hedged > 0)] | all' \
  "$dir/hub2.json" >/dev/null || fail "the coordinator did not see the relayed path drop: $(jq -c .dispatch.workers "$dir/hub2.json")"
[ "$(jq -r '.choices[0].message.content' "$dir/c2.json")" = "$ref_long" ] ||
  fail "the gateway completion in flight differs from the local run: $(cat "$dir/c2.json")"
"$KV" ledger check --db "$dir/l.db" >/dev/null || fail "ledger check after the kill: $("$KV" ledger check --db "$dir/l.db" 2>&1)"
echo "ok: the NATed node killed mid-decode (after $kp experts through the relay): run --hub (tokens, logits) and the" \
  "gateway completion in flight equal the local runs; ledger check holds"

# ---- the capture: only TLS on every connection between hosts
for p in "${CAPP[@]}"; do kill -INT "$p" 2>/dev/null || true; done
for p in "${CAPP[@]}"; do wait "$p" 2>/dev/null || true; done
# the links that must be there: the gateway (a2) to the hub's API and relay,
# the NATed node (as the router) to both, the hub's prover to a1, the
# coordinators on a2 to a1 and b1 directly
WANT=()
for c in "a2,$IP_HUB:7700" "a2,$IP_HUB:7443" "${TOPO_IP[router]},$IP_HUB:7700" "${TOPO_IP[router]},$IP_HUB:7443" \
  "$IP_HUB,${TOPO_IP[a1]}:7300" "a2,${TOPO_IP[a1]}:7300" "a2,${TOPO_IP[b1]}:7300"; do
  WANT+=(--want-conn "${c/#a2,/${TOPO_IP[a2]},}")
done
python3 "$SRC/tests/wan_tls_only.py" "${WANT[@]}" "$dir"/cap_*.pcap \
  >"$dir/tls.json" || fail "a non-TLS byte on the wire: $(cat "$dir/tls.json")"
echo "ok: the capture on the public side: $(jq -c '{streams, records, bytes, record_types}' "$dir/tls.json"), every" \
  "TCP stream only TLS records"
# and the checker does see plaintext: an HTTP exchange a2 -> a1 in a capture of its own
topo_bg a1 "$dir/neg_cap.txt" tcpdump -i kvw0 -n -s 0 -U -w "$dir/neg.pcap" tcp port 7999
NEGCAP=$TOPO_BG_PID
wait_until 10 grep -q "listening on" "$dir/neg_cap.txt.err" || fail "tcpdump on a1 did not start"
topo_bg a1 "$dir/plain.out" python3 -c 'import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 7999)); s.listen(1)
print("up", flush=True); c, _ = s.accept(); c.recv(4096); c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nhi"); c.close()'
wait_until 10 grep -q up "$dir/plain.out" || fail "the plaintext server did not start"
topo_exec a2 curl -s --retry 3 --retry-connrefused "http://${TOPO_IP[a1]}:7999/" >"$dir/plain.body" || true
[ "$(cat "$dir/plain.body")" = hi ] || fail "the plaintext exchange did not happen"
big() { [ "$(stat -c %s "$dir/neg.pcap" 2>/dev/null || echo 0)" -gt 200 ]; }
wait_until 5 big || true
kill -INT "$NEGCAP" 2>/dev/null || true
wait "$NEGCAP" 2>/dev/null || true
if python3 "$SRC/tests/wan_tls_only.py" "$dir/neg.pcap" >"$dir/neg.json"; then
  fail "the TLS checker passed a plaintext HTTP exchange: $(cat "$dir/neg.json")"
fi
jq -e '.errors | map(test("not a TLS record")) | any' "$dir/neg.json" >/dev/null || fail "the checker on plaintext: $(cat "$dir/neg.json")"
echo "ok: the same checker fails a plaintext HTTP exchange in the bed: $(jq -c '.errors[0]' "$dir/neg.json")"
