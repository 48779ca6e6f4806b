#!/usr/bin/env bash
# kv-test-labels: net
# Hub vouchers for ring clients (docs/HUB.md "Vouching", docs/PROTOCOL.md
# "Ring protocol", Authentication). Ring nodes admit each other by
# --allow-key and, with --hub-key K, any client whose AUTH carries a voucher
# of the hub with key K for this model that has not expired by the node's
# clock.
#  1. `kvasir run --ring A --hub URL --key C` with C listed by the hub's
#     --vouch-key: the hub vouches, the node admits C (not in its
#     --allow-key), and the tokens equal `kvasir run -m F` in one process.
#  2. The same key without the hub's voucher: refused (EAUTH, one line).
#  3. A key the hub does not vouch for: the hub refuses the voucher.
#  4. Hand-made vouchers (an independent client in Python, the hub's key read
#     from its store, Ed25519 by the `cryptography` package): valid -> the
#     node answers STATUS; expired, for another model, another key, or by
#     another hub -> ERROR EAUTH naming why, before anything is served.
#  5. `kvasir gateway --ring A --hub URL` shows the voucher and serves the
#     one-process text; the same gateway without --hub gets 502 or 503 (and /health 503).
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
dir=$(mktemp -d -t kvasir-ringv.XXXXXX)
. "$SRC/tests/ring_support.sh"
trap ring_cleanup EXIT
python3 -c 'import cryptography.hazmat.primitives.asymmetric.ed25519' 2>/dev/null ||
  fail "python3 cryptography missing (tools/install-deps.sh installs python3-cryptography)"

m="$dir/m.gguf"
"$KV" gen-model --arch qwen3moe --out "$m" --layers 4 --embd 64 --ff-exp 64 --experts 8 --experts-used 2 \
  --heads 4 --kv-heads 2 --head-dim 16 --vocab 600 --type q8_0 --seed 17 >/dev/null 2>&1
"$KV" slice "$m" --out "$dir/sl" --experts-per-slab 4 >/dev/null 2>&1
# node keys admit each other only; the client is known to the hub alone
: >"$dir/allow"
for i in 0 1; do "$KV" key --key "$dir/k$i.key" >>"$dir/allow"; done
client=$("$KV" key --key "$dir/client.key")
"$KV" key --key "$dir/stranger.key" >/dev/null
P="A vouched client is admitted"
"$KV" run -m "$m" -p "$P" -n 12 --temp 0 --json --threads 1 >"$dir/local.json"

"$KV" hub --model "$dir/sl/manifest.json" --db "$dir/hub.db" --listen 127.0.0.1:0 --vouch-key "$client" \
  >"$dir/hub.out" 2>"$dir/hub.err" &
RING_ALL+=($!)
url=
for _ in $(seq 200); do
  url=$(sed -n 's/^listening on \(.*\)$/http:\/\/\1/p' "$dir/hub.out" 2>/dev/null | head -1 || true)
  [ -n "$url" ] && break
  sleep 0.05
done
[ -n "$url" ] || fail "the hub did not start: $(cat "$dir/hub.err")"
hk=$(curl -sf "$url/v1/status" | jq -r .hub_key)
[ ${#hk} = 64 ] || fail "no hub key in /v1/status"

RING_EXTRA="--hub-key $hk --replay-timeout-ms 2000" ring_start "$m" 0-1 2-3
A0=${RING_ADDR[0]} A1=${RING_ADDR[1]}

# ---- 1. vouched by the hub: admitted, the one-process tokens
"$KV" run --ring "$A1" --hub "$url" --key "$dir/client.key" -p "$P" -n 12 --temp 0 --json >"$dir/r.json" 2>"$dir/r.err" ||
  fail "a vouched client was refused: $(cat "$dir/r.err")"
[ "$(jq -c .tokens "$dir/r.json")" = "$(jq -c .tokens "$dir/local.json")" ] || fail "vouched: tokens differ from the local run"
echo "ok: a client the hub vouches for (not in the nodes' --allow-key) is admitted; tokens equal the local run"

# ---- 2. the same key, no voucher
set +e
"$KV" run --ring "$A1" --key "$dir/client.key" -p "$P" -n 4 --temp 0 >/dev/null 2>"$dir/n.err"
rc=$?
# ---- 3. a key the hub does not vouch for
"$KV" run --ring "$A1" --hub "$url" --key "$dir/stranger.key" -p "$P" -n 4 --temp 0 >/dev/null 2>"$dir/s.err"
rc3=$?
set -e
[ $rc = 2 ] && [ "$(wc -l <"$dir/n.err")" = 1 ] && grep -q "is not allowed on this node (--allow-key, or a voucher of the hub)" "$dir/n.err" ||
  fail "no voucher: exit $rc, $(cat "$dir/n.err")"
[ $rc3 != 0 ] && grep -q "voucher refused (403)" "$dir/s.err" || fail "an unvouched key: exit $rc3, $(cat "$dir/s.err")"
echo "ok: without a voucher: $(cat "$dir/n.err"); a key the hub does not vouch for: $(cut -c1-100 "$dir/s.err")"

# ---- 4. hand-made vouchers against the node's checks
seed=$(python3 -c 'import sqlite3,sys; print(sqlite3.connect(sys.argv[1]).execute("select value from meta where key=?", ("hub_key_seed",)).fetchone()[0])' "$dir/hub.db")
python3 - "$A0" "$seed" <<'PY'
import hashlib, os, socket, struct, sys, time
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives import serialization
addr, seed_hex = sys.argv[1], sys.argv[2]
raw = lambda k: k.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
hub = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(seed_hex))
other_hub = Ed25519PrivateKey.generate()
def voucher(signer, model, key, exp):
    return signer.sign(hashlib.sha256(b"kvasir-voucher-v1\n" + model + key + struct.pack("<Q", exp)).digest())
def frame(t, body): return struct.pack("<IHHI", 0x4752564b, 5, t, len(body)) + body  # ring v5, plaintext (loopback): no binding
def attempt(exp, make, client):
    """make(model_id) -> the voucher's signature; the model is the one the node announces"""
    h, p = addr.rsplit(":", 1)
    s = socket.create_connection((h, int(p)), timeout=5)
    def read_frame():
        hd = b""
        while len(hd) < 12: hd += s.recv(12 - len(hd))
        _, _, t, n = struct.unpack("<IHHI", hd)
        body = b""
        while len(body) < n: body += s.recv(n - len(body))
        return t, body
    s.sendall(frame(1, struct.pack("<6I", 2, 0, 0, 0, 0, 0) + b"\0" * 64))
    t, ack = read_frame(); assert t == 2, t
    t, ch = read_frame(); assert t == 11, t
    node_key, challenge = ch[:32], ch[32:64]
    nonce = os.urandom(32)
    dg = hashlib.sha256(b"kvasir-ring-auth-v1\n" + b"C" + ack[24:88] + node_key + challenge + raw(client) + nonce).digest()
    s.sendall(frame(12, raw(client) + nonce + client.sign(dg) + struct.pack("<Q", exp) + make(ack[24:88])))
    t, body = read_frame()
    if t == 13:  # AUTH_OK: then STATUS is served
        s.sendall(frame(15, b""))
        t, body = read_frame()
        assert t == 16, t
        return "admitted"
    assert t == 8, t
    code, = struct.unpack("<i", body[8:12])
    assert code == -13, (code, body[20:])  # EAUTH
    return body[20:].decode()
now = int(time.time() * 1000)
c = Ed25519PrivateKey.generate()
T = now + 60000
r = attempt(T, lambda mid: voucher(hub, mid, raw(c), T), c)
assert r == "admitted", r
why = attempt(now - 1000, lambda mid: voucher(hub, mid, raw(c), now - 1000), c)
assert "voucher expired" in why, why
why = attempt(T, lambda mid: voucher(hub, b"0" * 64, raw(c), T), c)  # another model
assert "not the trusted hub's" in why, why
why = attempt(T, lambda mid: voucher(hub, mid, raw(Ed25519PrivateKey.generate()), T), c)  # another key
assert "not the trusted hub's" in why, why
why = attempt(T, lambda mid: voucher(other_hub, mid, raw(c), T), c)  # another hub
assert "not the trusted hub's" in why, why
why = attempt(T + 1, lambda mid: voucher(hub, mid, raw(c), T), c)  # an expiry moved later
assert "not the trusted hub's" in why, why
print("ok: hand-made vouchers: a valid one admitted; expired, another model, another key, another hub refused (EAUTH)")
PY
# ---- 5. the gateway as a vouched client: --ring with --hub; without the voucher it is refused (502)
start_gw() { # start_gw NAME ARGS...: a gateway, its address in GWA
  local nm=$1
  shift
  "$KV" gateway --ring "$A0" --key "$dir/client.key" --listen 127.0.0.1:0 --name m "$@" >"$dir/$nm.out" 2>"$dir/$nm.err" &
  RING_ALL+=($!)
  GWA=
  for _ in $(seq 600); do # bounded: a gateway of the sanitizer build on a loaded machine starts slowly
    GWA=$(sed -n 's/^listening on //p' "$dir/$nm.out" 2>/dev/null)
    [ -n "$GWA" ] && return 0
    sleep 0.05
  done
  fail "gateway $nm did not start: $(cat "$dir/$nm.err")"
}
# health_is CODE: /health answers CODE within 15 s (the gateway asks the
# entry node for STATUS every second, each ask bounded by 2 s: under load
# the ask at start can time out, and the next one tells)
health_is() {
  for _ in $(seq 150); do
    [ "$(curl -s -o "$dir/health.json" -w '%{http_code}' "http://$GWA/health")" = "$1" ] && return 0
    sleep 0.1
  done
  return 1
}
start_gw gwv --hub "$url"
health_is 200 || fail "vouched gateway: /health: $(cat "$dir/health.json")"
t=$(curl -s "http://$GWA/v1/completions" -d "{\"prompt\":\"$P\",\"max_tokens\":12,\"temperature\":0}" | jq -r '.choices[0].text')
[ "$t" = "$(jq -r .text "$dir/local.json")" ] || fail "vouched gateway: text '$t'"
start_gw gwn
code=$(curl -s -o "$dir/gwn.json" -w '%{http_code}' "http://$GWA/v1/completions" -d "{\"prompt\":\"$P\",\"max_tokens\":4}")
# 502 when the request reaches the ring before the gateway's health poll
# has seen the refusal, 503 at once after it (a gateway that cannot run)
{ [ "$code" = 502 ] || [ "$code" = 503 ]; } && grep -q "not allowed on this node" "$dir/gwn.json" || fail "unvouched gateway: $code $(cat "$dir/gwn.json")"
health_is 503 || fail "unvouched gateway: /health is not 503: $(cat "$dir/health.json")"
jq -e '.reason | test("not allowed on this node")' "$dir/health.json" >/dev/null ||
  fail "unvouched gateway: /health does not say why: $(cat "$dir/health.json")"
echo "ok: gateway --ring --hub shows the voucher and serves the local text; without it: $code $(jq -c .error.message "$dir/gwn.json" | cut -c1-90)"
# the ring serves on
"$KV" run --ring "$A0" --hub "$url" --key "$dir/client.key" -p "$P" -n 12 --temp 0 --json >"$dir/r2.json" ||
  fail "the ring stopped serving"
[ "$(jq -c .tokens "$dir/r2.json")" = "$(jq -c .tokens "$dir/local.json")" ] || fail "after the refusals: tokens differ"
ring_stop
echo "PASS: ring: a hub-vouched client is admitted, unvouched, expired and misdirected vouchers refused"
