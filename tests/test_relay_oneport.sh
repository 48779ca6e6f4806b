#!/usr/bin/env bash
# kv-test-labels: net
# The relay on the hub's API port (`kvasir hub --relay-port same`), on
# loopback: one port serves both the HTTPS API and the relay, told apart by
# the ALPN of each TLS ClientHello. curl (https), OpenSSL's s_client with
# and without ALPN "kvasir-relay", plain bytes that are not TLS, and a
# truncated hello all reach the right side (and leave the hub serving); a
# node the hub cannot dial joins through the relay, and every connection it
# holds to the hub goes to that one port (ss -tnp of its pid); `kvasir run
# --hub` then gives the local run's tokens and logits byte for byte, with
# experts computed by the relayed node. A plain-HTTP hub on loopback with
# --relay-port same serves plain HTTP on the shared port too.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
dir=$(mktemp -d -t kvasir-oneport.XXXXXX)
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
wait_until() { # SECONDS CMD...: a bounded wait, not a timing assertion
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
slab=$(stat -c %s "$dir/sl/experts/blk.0.0000-0001.gguf")
PROMPT="One port of the hub and nothing else"
RUN=(-p "$PROMPT" -n 8 --temp 0 --json --threads 1)
"$KV" run -m "$dir/m.gguf" "${RUN[@]}" --logits-out "$dir/local.bin" >"$dir/local.json"

mkdir -p "$dir/coord"
CPK=$("$KV" key --key "$dir/coord/coordinator.key")
"$KV" hub --model "$dir/sl/manifest.json" --db "$dir/hub.db" --listen 127.0.0.1:0 --tls --relay-port same \
  --deadline-ms 1500 --wanted 1 --vouch-key "$CPK" >"$dir/hub.out" 2>"$dir/hub.err" &
HUBP=$!
pids+=($HUBP)
addr=
for _ in $(seq 300); do
  addr=$(sed -n 's/^listening on \(.*\)$/\1/p' "$dir/hub.out" 2>/dev/null | head -1 || true)
  [ -n "$addr" ] && break
  sleep 0.05
done
[ -n "$addr" ] || fail "hub did not start"
port=${addr##*:}
fp=$(sed -n 's/^tls sha256:\([0-9a-f]\{64\}\)$/\1/p' "$dir/hub.out")
[ -n "$fp" ] || fail "no tls sha256 line"
hub="https://$addr#sha256=$fp"
url="https://$addr"
pin="sha256//$(python3 -c 'import sys,base64; print(base64.b64encode(bytes.fromhex(sys.argv[1])).decode())' "$fp")"
curl() { command curl --cacert /dev/null -k --pinnedpubkey "$pin" "$@"; }
[ "$(sed -n 's/^relay on port \([0-9]*\)$/\1/p' "$dir/hub.out")" = "$port" ] || fail "relay not on the API port: $(cat "$dir/hub.out")"
[ "$(curl -sf "$url/v1/status" | jq .relay.port)" = "$port" ] || fail "/v1/status: relay port is not $port"
echo "ok: https API and relay on one port $port"

# which side answers: ALPN kvasir-relay is the relay (OpenSSL, which
# negotiates it); no ALPN, or h2/http/1.1, is libmicrohttpd, which answers HTTP
alpn_of() { echo | timeout 5 openssl s_client -connect "127.0.0.1:$port" -tls1_3 "$@" 2>/dev/null | sed -n 's/^ALPN protocol: //p'; }
http_over() { printf 'GET /v1/status HTTP/1.0\r\n\r\n' | timeout 5 openssl s_client -connect "127.0.0.1:$port" -tls1_3 -quiet -ign_eof "$@" 2>/dev/null | grep -c '"model_id"' || true; }
[ "$(alpn_of -alpn kvasir-relay)" = kvasir-relay ] || fail "a relay hello did not reach the relay"
[ "$(alpn_of -alpn h2,http/1.1)" != kvasir-relay ] || fail "an h2 hello reached the relay"
[ "$(http_over)" = 1 ] || fail "a hello without ALPN got no HTTP answer"
[ "$(http_over -alpn http/1.1)" = 1 ] || fail "a hello with ALPN http/1.1 got no HTTP answer"
[ "$(http_over -alpn kvasir-relay)" = 0 ] || fail "a relay hello got an HTTP answer"
[ "$(curl -sf --http1.1 "$url/v1/status" | jq -r .relay.sha256)" = "$fp" ] || fail "curl over https"
# not TLS at all, and a TLS record that stops halfway: the HTTP side gets them, the hub serves on
python3 - "$port" <<'PY' || fail "plain HTTP on the shared port got no answer"
import socket, sys, time
port = int(sys.argv[1])
s = socket.create_connection(("127.0.0.1", port), timeout=5)
s.sendall(b"GET /v1/status HTTP/1.0\r\n\r\n")
got = b""
while True:
    try:
        b = s.recv(65536)
    except ConnectionResetError:
        break
    if not b: break
    got += b
# the https side: a plain request gets no JSON (GnuTLS ends it), but it is answered, not held
assert b'"model_id"' not in got, got[:200]
t = socket.create_connection(("127.0.0.1", port), timeout=5)
t.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01")  # a hello that stops after 8 of 517 bytes
time.sleep(0.3)
t.close()
PY
# (the server may reset these connections mid-send: that is its right)
for _ in 1 2 3; do python3 -c 'import os,socket; s=socket.create_connection(("127.0.0.1",'"$port"')); s.sendall(os.urandom(3000)); s.close()' 2>/dev/null || true; done
curl -sf "$url/v1/status" >/dev/null || fail "the hub stopped serving after plain, truncated and random bytes"
kill -0 "$HUBP" || fail "the hub died"
echo "ok: relay ALPN reaches the relay; curl, other ALPN, plain bytes, a truncated hello reach the API"

refused=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$KV" node --hub "$hub" --budget $((9 * slab)) --data "$dir/nR" --interval-ms 300 --threads 1 \
  --advertise "127.0.0.1:$refused" >"$dir/nR.out" 2>"$dir/nR.err" &
NR=$!
pids+=($NR)
nodes() { curl -sf "$url/v1/nodes"; }
rnode() { nodes | jq --arg a "127.0.0.1:$refused" '.nodes[] | select(.addr == $a)'; }
covered() { [ "$(curl -sf "$url/v1/market" | jq .covered)" = true ]; }
r_listed() { [ "$(rnode | jq .relayed)" = true ] && [ "$(rnode | jq .proven_shards)" -gt 0 ]; }
wait_until 60 covered || fail "no coverage: $(curl -sf "$url/v1/market") $(nodes)"
wait_until 30 r_listed || fail "the node is not listed as relayed: $(nodes)"
grep -q "serving through the hub's relay" "$dir/nR.err" || fail "the node did not connect out to the relay"

"$KV" run --hub "$hub" --data "$dir/coord" "${RUN[@]}" --logits-out "$dir/hub1.bin" >"$dir/hub1.json" 2>"$dir/hub1.err" ||
  fail "run --hub failed"
[ "$(jq -c .tokens "$dir/local.json")" = "$(jq -c .tokens "$dir/hub1.json")" ] || fail "tokens differ"
cmp -s "$dir/local.bin" "$dir/hub1.bin" || fail "logits differ"
[ "$(jq .dispatch.pairs_local "$dir/hub1.json")" = 0 ] || fail "experts computed locally"
rpairs=$(jq --arg a "127.0.0.1:$refused" '[.dispatch.workers[] | select(.addr == $a) | .pairs] | add // 0' "$dir/hub1.json")
[ "$rpairs" -gt 0 ] || fail "the relayed node computed nothing: $(jq -c .dispatch.workers "$dir/hub1.json")"
echo "ok: run --hub equals the local run; the relayed node computed $rpairs experts through the relay"

# every established connection of the node's process (it accepts none: the
# hub dials only the refused address it announced) goes to the hub's one
# port, sampled over a few heartbeats (its HTTP calls to the hub are short)
: >"$dir/ss.txt"
for _ in $(seq 15); do
  ss -tnpH state established >>"$dir/ss.txt"
  sleep 0.1
done
grep "pid=$NR," "$dir/ss.txt" | awk '{print $3, $4}' | sort -u >"$dir/node_conns.txt" || true
out=$(awk '{print $2}' "$dir/node_conns.txt" | sed 's/.*://' | sort -u)
[ -n "$out" ] || fail "ss shows no connection of the node to the hub: $(cat "$dir/ss.txt")"
[ "$out" = "$port" ] || fail "the node reaches ports $(echo $out) (want only $port): $(cat "$dir/node_conns.txt")"
echo "ok: the relayed node's $(wc -l <"$dir/node_conns.txt") connections go to port $port only"

# plain HTTP on loopback shares the port too
"$KV" hub --model "$dir/sl/manifest.json" --db "$dir/hub2.db" --listen 127.0.0.1:0 --relay-port same --quiet \
  >"$dir/hub2.out" 2>"$dir/hub2.err" &
pids+=($!)
wait_until 15 grep -q '^listening on' "$dir/hub2.out" || fail "plain hub did not start"
a2=$(sed -n 's/^listening on \(.*\)$/\1/p' "$dir/hub2.out")
[ "$(command curl -sf "http://$a2/v1/status" | jq .relay.port)" = "${a2##*:}" ] || fail "plain http on the shared port"
echo "ok: a plain-HTTP loopback hub serves http and the relay on port ${a2##*:}"
