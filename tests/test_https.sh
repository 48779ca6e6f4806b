#!/usr/bin/env bash
# kv-test-labels: net oracle
# The hub's and the gateway's HTTP APIs over https (docs/HUB.md "HTTPS").
# - `kvasir hub --tls` on loopback prints `tls sha256:<hex>`, and that is the
#   fingerprint an independent client computes (openssl s_client, the
#   certificate's public key in DER, sha256sum); a restart on the same store
#   serves the same key; TLS 1.2 and plaintext HTTP to its port are refused.
# - `kvasir market`, `plan`, `node`, `run` and `gateway` take
#   --hub https://HOST:PORT#sha256=FP: a node joins and serves, `run --hub`
#   gives the text of the local run, and a gateway
#   that pins the hub answers the official `openai` npm client over https
#   (its own --tls-cert, trusted by the client through NODE_EXTRA_CA_CERTS
#   only) with the text of `kvasir run --chat`; curl with the same pin
#   (--pinnedpubkey) reads the hub's node list.
# - A wrong fingerprint, an https URL without one (the hub's certificate is
#   self-signed), a malformed fragment and http:// to the TLS port each fail
#   with an error that says what is wrong; a node with a wrong pin never
#   reaches the hub (its node list is unchanged).
# - Plain HTTP off loopback: a gateway on 0.0.0.0 without --tls-cert or
#   --insecure-plaintext refuses to start; with --insecure-plaintext it warns.
#   A hub on 0.0.0.0 serves https by default, plain HTTP (with a warning)
#   only with --insecure-plaintext; its --beacon carries the pinned URL, by
#   which a node started without --hub joins.
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
KV=${KV_BIN:-$SRC/build/kvasir}
dir=$(mktemp -d -t kvasir-https.XXXXXX)
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
  for f in "$dir"/*.err; do [ -f "$f" ] && { echo "--- $f" >&2; tail -8 "$f" >&2; }; done
  exit 1
}
command -v openssl >/dev/null || fail "openssl not found"
command -v node >/dev/null || fail "node not found"
[ -f "$SRC/tests/oracle/node_modules/openai/package.json" ] || fail "client missing: openai (run tools/install-oracle.sh)"
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
fp_of() { sed -n 's/^tls sha256:\(.*\)$/\1/p' "$1" 2>/dev/null | head -1; }
listening() { [ -n "$(addr_of "$1")" ]; }
# the independent fingerprint: SHA-256 of the served certificate's public key, DER
ref_fp() {
  openssl s_client -connect "$1" </dev/null 2>/dev/null | openssl x509 -pubkey -noout |
    openssl pkey -pubin -outform der | sha256sum | cut -d' ' -f1
}
start_hub() { # NAME DB ARGS...: a hub on the store DB; waits for "listening on"
  local name=$1 db=$2
  shift 2
  "$KV" hub --vouch-open --model "$dir/sl/manifest.json" --db "$dir/$db" --deadline-ms 1500 --wanted 1 \
    "$@" >"$dir/$name.out" 2>"$dir/$name.err" &
  pids+=($!)
  wait_until 30 listening "$dir/$name.out" || fail "hub $name did not start"
}
# expect_fail NAME PATTERN CMD...: CMD fails and its stderr matches PATTERN
expect_fail() {
  local name=$1 pat=$2
  shift 2
  if "$@" >"$dir/$name.o" 2>"$dir/$name.e"; then fail "$name: succeeded"; fi
  grep -qE -e "$pat" "$dir/$name.e" || fail "$name: error does not say '$pat': $(cat "$dir/$name.e")"
  echo "ok: $name: $(head -c 240 "$dir/$name.e")"
}

"$KV" gen-model --preset tiny --out "$dir/m.gguf" >/dev/null 2>&1
"$KV" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab 4 >/dev/null 2>&1
all=$(du -b "$dir/sl/experts" | cut -f1)

# ---- the hub on loopback with TLS -------------------------------------------
start_hub hub0 hub.db --listen 127.0.0.1:0 --tls
addr=$(addr_of "$dir/hub0.out")
fp=$(fp_of "$dir/hub0.out")
[[ "$fp" =~ ^[0-9a-f]{64}$ ]] || fail "the hub printed no 'tls sha256:<64 hex>' line: $(cat "$dir/hub0.out")"
[ "$(ref_fp "$addr")" = "$fp" ] || fail "printed fingerprint $fp, openssl says $(ref_fp "$addr")"
echo "ok: hub --tls prints tls sha256:$fp, equal to openssl's SHA-256 of the served public key"
kill -TERM "${pids[-1]}"
wait "${pids[-1]}" 2>/dev/null || true
start_hub hub hub.db --listen 127.0.0.1:0 --tls
addr=$(addr_of "$dir/hub.out")
[ "$(fp_of "$dir/hub.out")" = "$fp" ] || fail "a restart on the same store changed the fingerprint"
[ "$(ref_fp "$addr")" = "$fp" ] || fail "the restarted hub serves another key"
echo "ok: a restart on the same store serves the same key"
hub="https://$addr#sha256=$fp"
if openssl s_client -tls1_2 -connect "$addr" </dev/null >"$dir/tls12.o" 2>&1 &&
  grep -q "^ *Protocol *: TLSv1.2" "$dir/tls12.o"; then
  fail "the hub accepted TLS 1.2"
fi
echo "ok: TLS 1.2 refused"

# contradictory or incomplete flags
expect_fail hub-cert-alone "--tls-cert and --tls-key go together" "$KV" hub --model "$dir/sl/manifest.json" \
  --db "$dir/x.db" --tls-cert "$dir/none.pem"
expect_fail hub-tls-insecure "--insecure-plaintext contradicts --tls" "$KV" hub --model "$dir/sl/manifest.json" \
  --db "$dir/x.db" --tls --insecure-plaintext
expect_fail gw-key-alone "--tls-cert and --tls-key go together" "$KV" gateway -m "$dir/m.gguf" --tls-key "$dir/none.pem"
expect_fail gw-missing-cert "cannot open" "$KV" gateway -m "$dir/m.gguf" --tls-cert "$dir/none.pem" \
  --tls-key "$dir/none.pem"

# ---- clients pin the hub --------------------------------------------------------
"$KV" market --hub "$hub" >"$dir/market.o" 2>"$dir/market.e" || fail "market over https: $(cat "$dir/market.e")"
grep -q "shards:" "$dir/market.o" || fail "market output: $(cat "$dir/market.o")"
"$KV" plan --hub "$hub" --json >"$dir/plan.o" 2>"$dir/plan.e" || true # exit 2: not covered yet
jq -e '.n_layer == 2 and .covered == false' "$dir/plan.o" >/dev/null || fail "plan over https: $(cat "$dir/plan.e")"
echo "ok: kvasir market and plan --hub https://...#sha256=FP"
bad_fp=$(printf '%s' "$fp" | tr '0-9a-f' '1-9a-f0')
expect_fail wrong-pin "does not match the #sha256= fingerprint" "$KV" market --hub "https://$addr#sha256=$bad_fp"
expect_fail no-pin "#sha256=" "$KV" market --hub "https://$addr"
grep -q "not signed by an authority" "$dir/no-pin.e" || fail "no-pin: the error does not say why"
expect_fail short-pin "64 hex digits" "$KV" market --hub "https://$addr#sha256=${fp:0:60}"
expect_fail other-fragment "only fragment understood" "$KV" market --hub "https://$addr#sha1=${fp:0:40}"
expect_fail pin-on-http "needs an https:// URL" "$KV" market --hub "http://$addr#sha256=$fp"
expect_fail plaintext "does the server speak https" "$KV" market --hub "http://$addr"
n_nodes() { curl -sf --cacert /dev/null -k --pinnedpubkey "sha256//$(printf '%s' "$fp" | xxd -r -p | base64)" \
  "https://$addr/v1/nodes" | jq '.nodes | length'; }
[ "$(n_nodes)" = 0 ] || fail "curl with the pin: node list $(n_nodes)"
expect_fail node-wrong-pin "does not match" timeout 5 "$KV" node --hub "https://$addr#sha256=$bad_fp" \
  --budget "$all" --data "$dir/nw" --threads 1
[ "$(n_nodes)" = 0 ] || fail "a node with a wrong pin reached the hub"
echo "ok: the hub's node list (read by curl --pinnedpubkey) is still empty"

# ---- a node and a gateway on the pinned hub; the openai client over https -------
"$KV" node --hub "$hub" --budget $((all * 2)) --data "$dir/na" --interval-ms 300 --threads 1 \
  >"$dir/na.out" 2>"$dir/na.err" &
pids+=($!)
node_listed() { [ "$(n_nodes)" = 1 ]; }
wait_until 60 node_listed || fail "the node never joined over https"
echo "ok: kvasir node --hub https://...#sha256=FP joined"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$dir/gw.key" -out "$dir/gw.crt" \
  -days 2 -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1 >/dev/null 2>&1
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$dir/other.key" -out "$dir/other.crt" \
  -days 2 -subj /CN=other >/dev/null 2>&1
expect_fail gw-key-mismatch "is not the key of the certificate" "$KV" gateway --hub "$hub" --data "$dir/gwx" \
  --listen 127.0.0.1:0 --tls-cert "$dir/gw.crt" --tls-key "$dir/other.key"
"$KV" gateway --hub "$hub" --data "$dir/gw" --listen 127.0.0.1:0 --threads 1 --hub-refresh-ms 200 \
  --tls-cert "$dir/gw.crt" --tls-key "$dir/gw.key" >"$dir/gw.out" 2>"$dir/gw.err" &
pids+=($!)
wait_until 60 listening "$dir/gw.out" || fail "gateway did not start"
gaddr=$(addr_of "$dir/gw.out")
[ "$(fp_of "$dir/gw.out")" = "$(ref_fp "$gaddr")" ] || fail "gateway: printed fingerprint differs from openssl's"
healthy() { [ "$(curl -s --cacert "$dir/gw.crt" -o /dev/null -w '%{http_code}' "https://$gaddr/health")" = 200 ]; }
wait_until 60 healthy || fail "gateway never healthy"
expect_fail gw-plaintext "Empty reply|reset|nothing" curl -sS --max-time 10 "http://$gaddr/health"
PROMPT="The swarm answers over https"
N=16
ref=$("$KV" run -m "$dir/m.gguf" --chat --json --threads 1 -p "$PROMPT" -n $N --temp 0 --seed 1 | jq -r .text)
[ -n "$ref" ] || fail "the reference run gave no text"
"$KV" run --hub "$hub" --data "$dir/run" --chat --json --threads 1 -p "$PROMPT" -n $N --temp 0 --seed 1 \
  >"$dir/run.o" 2>"$dir/run.err" || fail "run --hub over https"
[ "$(jq -r .text "$dir/run.o")" = "$ref" ] || fail "run --hub over https: text differs from the local run"
echo "ok: kvasir run --hub https://...#sha256=FP equals the local run"
KV_GW_URL="https://$gaddr" KV_GW_PROMPT="$PROMPT" KV_GW_N=$N KV_GW_REF="$ref" KV_GW_EXPECT=refused \
  node "$SRC/tests/oracle/gateway_https.mjs" || fail "the openai client without the certificate"
NODE_EXTRA_CA_CERTS="$dir/gw.crt" KV_GW_URL="https://$gaddr" KV_GW_PROMPT="$PROMPT" KV_GW_N=$N KV_GW_REF="$ref" \
  node "$SRC/tests/oracle/gateway_https.mjs" || fail "the openai client over https"

# ---- plain HTTP off loopback -------------------------------------------------
expect_fail gw-public-plain "refusing to serve plain HTTP on 0.0.0.0" "$KV" gateway -m "$dir/m.gguf" \
  --listen 0.0.0.0:0 --threads 1
"$KV" gateway -m "$dir/m.gguf" --listen 0.0.0.0:0 --threads 1 --insecure-plaintext >"$dir/gwp.out" 2>"$dir/gwp.err" &
pids+=($!)
wait_until 60 listening "$dir/gwp.out" || fail "gateway --insecure-plaintext did not start"
grep -q "WARNING: --insecure-plaintext" "$dir/gwp.err" || fail "gateway --insecure-plaintext did not warn"
curl -sf "http://127.0.0.1:$(addr_of "$dir/gwp.out" | sed 's/.*://')/health" >/dev/null ||
  fail "gateway --insecure-plaintext does not answer plain HTTP"
echo "ok: gateway on 0.0.0.0: refused without TLS; --insecure-plaintext warns and serves"
bport=$((20000 + ($$ * 7 + 3) % 30000))
start_hub hubp p.db --listen 0.0.0.0:0 --beacon "$bport" --beacon-to 127.255.255.255 --beacon-interval-ms 100
pfp=$(fp_of "$dir/hubp.out")
pport=$(addr_of "$dir/hubp.out" | sed 's/.*://')
[[ "$pfp" =~ ^[0-9a-f]{64}$ ]] || fail "a hub on 0.0.0.0 does not serve https by default"
[ "$(ref_fp "127.0.0.1:$pport")" = "$pfp" ] || fail "the 0.0.0.0 hub's printed fingerprint differs from openssl's"
"$KV" market --hub "https://127.0.0.1:$pport#sha256=$pfp" >/dev/null ||
  fail "market against the 0.0.0.0 hub"
# a node without --hub hears the TLS hub's beacon, pin included, and joins it
"$KV" node --beacon-port "$bport" --beacon-wait-ms 20000 --budget $((all * 2)) --data "$dir/nb" --interval-ms 300 \
  --threads 1 >"$dir/nb.out" 2>"$dir/nb.err" &
pids+=($!)
p_nodes() { curl -sf -k --pinnedpubkey "sha256//$(printf '%s' "$pfp" | xxd -r -p | base64)" \
  "https://127.0.0.1:$pport/v1/nodes" | jq '.nodes | length'; }
p_joined() { [ "$(p_nodes)" = 1 ]; }
wait_until 60 p_joined || fail "the node that heard the beacon did not join"
grep -q "joining the hub https://127.0.0.1:$pport#sha256=$pfp" "$dir/nb.err" || fail "the beacon did not carry the pin"
echo "ok: a TLS hub's beacon carries its pinned URL; a node without --hub joined by it"
start_hub hubq q.db --listen 0.0.0.0:0 --insecure-plaintext
[ -z "$(fp_of "$dir/hubq.out")" ] || fail "hub --insecure-plaintext printed a tls line"
grep -q "WARNING: --insecure-plaintext" "$dir/hubq.err" || fail "hub --insecure-plaintext did not warn"
"$KV" market --hub "http://127.0.0.1:$(addr_of "$dir/hubq.out" | sed 's/.*://')" >/dev/null ||
  fail "market against the plaintext hub"
echo "ok: hub on 0.0.0.0: https by default; plain HTTP only with --insecure-plaintext, which warns"
echo "test_https: all ok"
