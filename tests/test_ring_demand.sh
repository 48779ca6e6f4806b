#!/usr/bin/env bash
# kv-test-labels: net attack
# Ring windows report their demand per shard to the hub's market (docs/HUB.md
# "Demand", rule 5): a hub trading two layer windows (--ring-windows
# 0-1,2-3, --vouch-open), two `kvasir ring --hub` nodes that take them, a
# request of N tokens through the ring; window 0-1 computes its experts from
# its own slabs, window 2-3 on an expert worker (--worker). Then:
#   - GET /v1/market shows demand on every shard of both windows, and each
#     layer's demand, turned back into computations (rate x half-life / ln 2,
#     the hub's own formula), equals what the forward pass needed, taken from
#     an independent local run of the same model: (prompt + N - 1) tokens x
#     experts used in every layer, and in the last layer only the N sampled
#     positions (within the market's 3 decimals and the decay since the
#     report);
#   - each window's own account, logged when it stops, is exact: the
#     computations it reported equal that count for its layers;
#   - a lying ring window (its own node key, an independent Ed25519 client in
#     Python) that claims 10^6 computations on each shard of its window and
#     on a shard of the other window, for 10 tokens, is counted 10 tokens x 2
#     experts used for its one layer it claimed and nothing for the other
#     window's shard; the same lie from a key that is not a ring window is
#     counted for both layers (the ring rule is what caps it).
# (The ring node serves no HTTP, so no /metrics: its count is in its log.)
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
dir=$(mktemp -d -t kvasir-ringdemand.XXXXXX)
. "$SRC/tests/ring_support.sh"
trap ring_cleanup EXIT
ring_keys

USED=2
HL=600000 # the market's half-life: slow, so that the rate keeps the reports' sum
m="$dir/m.gguf"
"$KV" gen-model --arch qwen3moe --out "$m" --layers 4 --embd 64 --ff-exp 64 --experts 8 --experts-used $USED \
  --heads 4 --kv-heads 2 --head-dim 16 --vocab 600 --type q8_0 --seed 13 >/dev/null 2>&1
"$KV" slice "$m" --out "$dir/sl" --experts-per-slab 4 >/dev/null 2>&1
P="A ring window tells the market what its layers needed"
N=48
"$KV" run -m "$m" -p "$P" -n $N --temp 0 --json --threads 1 >"$dir/local.json"
# the forward pass's own count: tokens through every layer, sampled positions in the last one
fwd=$(jq '.engine.prefill_tokens + .engine.decode_tokens' "$dir/local.json")
[ "$(jq '.tokens | length' "$dir/local.json")" = $N ] || fail "the local run did not decode $N tokens"
want_layer() { if [ "$1" = 3 ]; then echo $((USED * N)); else echo $((USED * fwd)); fi; }

ring_hub "$dir/sl/manifest.json" --deadline-ms 3000 --ring-windows 0-1,2-3 --vouch-open --demand-half-life-ms $HL

hub_node 0
grep -q "took layers 0-1 from the market" "$dir/ring0.err" || fail "node 0: $(cat "$dir/ring0.err")"
# window 2-3 computes its experts on an expert worker (admitting the ring's keys)
"$KV" worker --slabs "$(ls "$dir"/sl/experts/blk.[23].*.gguf | paste -sd,)" --listen 127.0.0.1:0 --threads 1 --quiet \
  --allow-key "$dir/allow" >"$dir/w.out" 2>"$dir/w.err" &
RING_ALL+=($!)
waddr=
for _ in $(seq 200); do
  waddr=$(sed -n 's/^listening on \(.*\)$/\1/p' "$dir/w.out" 2>/dev/null | head -1 || true)
  [ -n "$waddr" ] && break
  sleep 0.05
done
[ -n "$waddr" ] || fail "the worker did not start: $(cat "$dir/w.err")"
hub_node 1 --worker "$waddr"
grep -q "kvasir remote: worker $waddr up" "$dir/ring1.err" || fail "node 1 has no worker: $(cat "$dir/ring1.err")"
grep -q "took layers 2-3 from the market" "$dir/ring1.err" || fail "node 1: $(cat "$dir/ring1.err")"
ring_wait_whole

"$KV" run --ring "${RING_ADDR[0]}" "${RK[@]}" -p "$P" -n $N --temp 0 --json >"$dir/r.json" 2>"$dir/r.err" ||
  fail "the request through the ring failed: $(cat "$dir/r.err")"
[ "$(jq -c .tokens "$dir/r.json")" = "$(jq -c .tokens "$dir/local.json")" ] || fail "the ring's tokens differ"

# every shard of both windows shows demand within two report intervals
shown() {
  curl -sf "$url/v1/market" >"$dir/market.json" &&
    jq -e '[.shards[] | select(.demand > 0)] | length == 8' "$dir/market.json" >/dev/null
}
for _ in $(seq 150); do shown && break; sleep 0.1; done
shown || fail "the market does not show demand on every shard: $(jq -c '[.shards[] | {layer, first, demand}]' \
  "$dir/market.json")"
sleep 6 # one more report interval: a decode that straddled two reports is all in now
curl -sf "$url/v1/market" >"$dir/market.json" || fail "GET /v1/market"
for L in 0 1 2 3; do
  got=$(jq --argjson L $L --argjson hl $HL '[.shards[] | select(.layer == $L) | .demand] | add * $hl / 1000 / 0.6931471805599453' \
    "$dir/market.json")
  want=$(want_layer $L)
  # the rate decays (0.1% a second at this half-life); 3 decimals per shard
  awk -v g="$got" -v w="$want" 'BEGIN { exit !(g <= w * 1.0 + 2 && g >= w * 0.95 - 2) }' ||
    fail "layer $L: the market's demand is $got computations, the forward pass needed $want"
  echo "ok: layer $L: the market's demand is $got computations; the forward pass needed $want"
done

# a lying ring window: node 1's own key, signed outside Kvasir's C client
lie() { # KEYFILE -> the hub's answer to the lie
  python3 - "$url" "$1" <<'EOF'
import hashlib, json, sys, time, urllib.error, urllib.request
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives import serialization
url, keyfile = sys.argv[1], sys.argv[2]
key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(open(keyfile).read().strip()))
pk = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
big = 10**6
body = json.dumps({"tokens": 10, "shards": [
    {"layer": 2, "first": 0, "last": 3, "computations": big, "wait_us": big},
    {"layer": 2, "first": 4, "last": 7, "computations": big, "wait_us": big},
    {"layer": 0, "first": 0, "last": 3, "computations": big, "wait_us": big}]}, separators=(",", ":")).encode()
ctr = str(time.time_ns() // 1000)
dg = hashlib.sha256(b"kvasir-hub-v1\nPOST\n/v1/demand\n" + ctr.encode() + b"\n" +
                    hashlib.sha256(body).hexdigest().encode() + b"\n").digest()
req = urllib.request.Request(url + "/v1/demand", data=body, method="POST", headers={
    "Content-Type": "application/json", "X-Kvasir-Key": pk, "X-Kvasir-Counter": ctr,
    "X-Kvasir-Signature": key.sign(dg).hex()})
try:
    with urllib.request.urlopen(req, timeout=10) as r:
        print(json.dumps({"status": r.status, **json.load(r)}))
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "body": e.read().decode()}))
EOF
}
[ -s "$dir/d1/node.key" ] || fail "node 1 has no node key in its data folder"
lie "$dir/d1/node.key" >"$dir/lie.json"
# 10 tokens x 2 experts used for layer 2 (its two shards together); layer 0 is not its window: nothing
jq -e '.status == 200 and .tokens == 10 and .computations == 20' "$dir/lie.json" >/dev/null ||
  fail "the lying ring window was not capped to its window: $(cat "$dir/lie.json")"
printf '%064x\n' 7 >"$dir/stranger.key"
lie "$dir/stranger.key" >"$dir/lie2.json"
jq -e '.status == 200 and .tokens == 10 and .computations == 40' "$dir/lie2.json" >/dev/null ||
  fail "the same lie from a key that is no ring window: $(cat "$dir/lie2.json")"
echo "ok: a lying ring window was counted $(jq .computations "$dir/lie.json") computations of 3x10^6 claimed" \
  "(its own layer only); the same lie from another key $(jq .computations "$dir/lie2.json")"

# each window's own account, as it stops: exact
for i in 0 1; do
  kill -TERM "${RING_PID[$i]}"
  wait "${RING_PID[$i]}" 2>/dev/null || true
  line=$(grep "demand: [0-9]* reports accepted" "$dir/ring$i.err" || true)
  [ -n "$line" ] || fail "node $i logged no demand account: $(tail -5 "$dir/ring$i.err")"
  comps=$(sed -n 's/.*(\([0-9]*\) expert computations reported, \([0-9]*\) tokens counted), \([0-9]*\) refused.*/\1/p' <<<"$line")
  toks=$(sed -n 's/.*(\([0-9]*\) expert computations reported, \([0-9]*\) tokens counted), \([0-9]*\) refused.*/\2/p' <<<"$line")
  if [ $i = 0 ]; then want=$(($(want_layer 0) + $(want_layer 1))); else want=$(($(want_layer 2) + $(want_layer 3))); fi
  [ "$comps" = "$want" ] || fail "node $i reported $comps computations, its layers needed $want ($line)"
  [ "$toks" = "$fwd" ] || fail "node $i: the hub counted $toks tokens, $fwd ran through the window ($line)"
  echo "ok: node $i reported $comps computations over $toks tokens: exactly what its layers needed"
done
echo "PASS: ring windows report their demand per shard; a lying one is capped to its own window"
