#!/usr/bin/env bash
# kv-test-labels: net
# The ring of sites in the WAN test bed (tests/netns_topo.sh): two sites
# 40 ms apart (round trip), the hub in site A. Site A's workers (a1, two
# nodes) take layer 0's shards, site B's (b1, two nodes) layer 1's (kvasir
# node --site NAME --layers A-B); the hub measures its round trips to them
# and publishes the site placement (GET /v1/sites): site A runs layer 0,
# site B layer 1. A ring node in each site (kvasir ring --hub --site) runs
# its site's window on its site's workers, and a gateway on a2 serves the
# ring by itself (--placement sites):
#  - /v1/sites, /v1/nodes, /v1/placement and the market carry the sites; the
#    hub's measured round trip to site B is at least the bed's 40 ms;
#  - `kvasir plan` shows both sites, the round trip between them and the
#    predicted time per token for the ring of sites and for per-layer dispatch;
#  - a chat completion through the gateway equals `kvasir run --chat` on the
#    same GGUF, byte for byte, and so does one through a gateway forced to
#    per-layer dispatch (--placement experts);
#  - one of site B's workers killed mid-decode: the completion in flight
#    finishes with the local run's text (its replica in site B takes over).
# Short by default (~40 s); KV_WAN_FULL=1 decodes longer.
# Needs root (network namespaces) and nft: without, it fails.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
KV=$(cd "$(dirname "$KV")" && pwd)/$(basename "$KV")
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
KV_BUILD=${KV_BUILD:-$(dirname "$KV")}
FULL=${KV_WAN_FULL:-0}
TOPO_LONG_MS=20 # one way: 40 ms round trip between the sites
TOPO_LONG_LOSS=0
dir=$(mktemp -d -t kvasir-wansites.XXXXXX)
chmod 755 "$dir"
fail() {
  echo "FAIL: $*" >&2
  for f in "$dir"/*.err; do [ -s "$f" ] && { echo "--- $f" >&2; tail -6 "$f" >&2; }; done
  exit 1
}
. "$SRC/tests/netns_wan.sh"
. "$SRC/tests/netns_topo.sh"
trap 'topo_cleanup; rm -rf "$dir"' EXIT
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

# ---- the model and the local references (no network involved)
"$KV" gen-model --preset tiny --out "$dir/m.gguf" >/dev/null 2>&1
"$KV" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab 2 >/dev/null 2>&1
[ "$(jq '.hparams.n_layer' "$dir/sl/manifest.json")" = 2 ] || fail "want a model of 2 layers"
slab=$(stat -c %s "$dir/sl/experts/blk.0.0000-0001.gguf")
layer=$((4 * slab + slab / 2)) # one layer's four slabs fit, a fifth does not
n_long=96
[ "$FULL" = 1 ] && n_long=240
PROMPT="Two sites, one crossing each per token"
ref=$("$KV" run -m "$dir/m.gguf" --chat --json --threads 1 -p "$PROMPT" -n 12 --temp 0 --seed 1 | jq -r .text)
ref_long=$("$KV" run -m "$dir/m.gguf" --chat --json --threads 1 -p "$PROMPT" -n "$n_long" --temp 0 --seed 1 | jq -r .text)
# the ring nodes' keys: the workers and the other ring node admit them
for k in ra rb; do "$KV" key --key "$dir/$k.key" >/dev/null; done
{ "$KV" key --key "$dir/ra.key"; "$KV" key --key "$dir/rb.key"; } >"$dir/allow"

topo_setup
IP_HUB=${TOPO_IP[hub]}
echo "bed: hub $IP_HUB, a1 ${TOPO_IP[a1]}, a2 ${TOPO_IP[a2]} (site A); b1 ${TOPO_IP[b1]} (site B, $(topo_rtt_ms a1 b1) ms round trip)"

# ---- the hub (https: a non-loopback address), vouching for the gateway
topo_bg hub "$dir/hub.out" "$KV" hub --model "$dir/sl/manifest.json" --db "$dir/hub.db" --listen "$IP_HUB:7700" \
  --deadline-ms 3000 --wanted 2 --vouch-open
wait_until 20 grep -q '^tls sha256:' "$dir/hub.out" || fail "the hub did not start"
fp=$(sed -n 's/^tls sha256:\([0-9a-f]\{64\}\)$/\1/p' "$dir/hub.out")
hub="https://$IP_HUB:7700#sha256=$fp"
pin="sha256//$(python3 -c 'import sys,base64; print(base64.b64encode(bytes.fromhex(sys.argv[1])).decode())' "$fp")"
hcurl() { topo_exec a2 curl --cacert /dev/null -k --pinnedpubkey "$pin" -sf "https://$IP_HUB:7700$1"; }

# ---- the workers: two in each site, site A on layer 0, site B on layer 1
node() { # HOST PORT SITE LAYERS NAME
  topo_bg "$1" "$dir/$5.out" "$KV" node --hub "$hub" --budget "$layer" --data "$dir/$5" \
    --listen "${TOPO_IP[$1]}:$2" --site "$3" --layers "$4" --interval-ms 300 --threads 1 --allow-key "$dir/allow"
}
node a1 7300 site-a 0-0 na1
node a1 7301 site-a 0-0 na2
node b1 7300 site-b 1-1 nb1
NB1=$TOPO_BG_PID
node b1 7301 site-b 1-1 nb2
two_each() { # every shard proven at two workers of its layer's site
  hcurl /v1/placement | jq -e '[.shards[] | (.layer == 0 and ([.nodes[] | select(.site == "site-a")] | length) == 2)
    or (.layer == 1 and ([.nodes[] | select(.site == "site-b")] | length) == 2)] | all' >/dev/null
}
wait_until 120 two_each || fail "the sites' workers did not cover their layers: $(hcurl /v1/placement)"
placed() { [ "$(hcurl /v1/sites | jq -r .placement.kind)" = sites ]; }
stable() { # the site placement on 4 reads 0.5 s apart (the market has settled)
  for _ in 1 2 3 4; do
    placed || return 1
    sleep 0.5
  done
}
wait_until 60 stable || fail "no stable site placement: $(hcurl /v1/sites)"
hcurl /v1/sites >"$dir/sites.json"
jq -e '[.placement.windows[] | [.site, .first, .last]] == [["site-a", 0, 0], ["site-b", 1, 1]]' "$dir/sites.json" \
  >/dev/null || fail "the placement is not site-a 0, site-b 1: $(jq -c .placement "$dir/sites.json")"
jq -e '[.placement.windows[] | .workers | length] == [2, 2]' "$dir/sites.json" >/dev/null ||
  fail "each window takes its two site workers: $(jq -c .placement "$dir/sites.json")"
# the hub measured its round trips: site B is the long link away, site A is not
rtt_b=$(hcurl /v1/nodes | jq '[.nodes[] | select(.site == "site-b") | .rtt_ms] | min')
rtt_a=$(hcurl /v1/nodes | jq '[.nodes[] | select(.site == "site-a") | .rtt_ms] | max')
awk -v b="$rtt_b" -v a="$rtt_a" 'BEGIN { exit !(b >= 40 && b < 200 && a < 40) }' ||
  fail "measured round trips: site B $rtt_b ms (want >= 40), site A $rtt_a ms (want < 40)"
jq -e '[.round_trips[] | select(.a == "site-a" and .b == "site-b") | .rtt_ms_max >= 40] == [true]' "$dir/sites.json" \
  >/dev/null || fail "no round trip between the sites: $(jq -c .round_trips "$dir/sites.json")"
hcurl /v1/market | jq -e '[.shards[] | .sites == (if .layer == 0 then ["site-a"] else ["site-b"] end)] | all' \
  >/dev/null || fail "the market does not carry the sites: $(hcurl /v1/market)"
echo "ok: the hub measured site A at ${rtt_a} ms at most, site B at ${rtt_b} ms at least, and placed site-a on" \
  "layer 0, site-b on layer 1, each on its own two workers"

# ---- the ring of sites: a ring node in each, from the hub's placement
topo_bg a2 "$dir/ra.out" "$KV" ring --hub "$hub" --site site-a --budget 64M --data "$dir/ra" \
  --listen "${TOPO_IP[a2]}:7400" --key "$dir/ra.key" --allow-key "$dir/allow" --threads 1
topo_bg b1 "$dir/rb.out" "$KV" ring --hub "$hub" --site site-b --budget 64M --data "$dir/rb" \
  --listen "${TOPO_IP[b1]}:7400" --key "$dir/rb.key" --allow-key "$dir/allow" --threads 1
whole() { grep -q "ring whole" "$dir/ra.out.err" && grep -q "ring whole" "$dir/rb.out.err"; }
wait_until 60 whole || fail "the ring of sites did not close"
grep -q "site site-a: the hub's placement gives it layers 0-0, 2 site workers" "$dir/ra.out.err" ||
  fail "ring node A did not take site A's window"
rings() { hcurl /v1/sites | jq -e '[.placement.windows[] | .ring | length == 1] | all' >/dev/null; }
wait_until 20 rings || fail "the placement lists no ring node per window: $(hcurl /v1/sites)"

# ---- kvasir plan: sites, their round trip, both predictions
topo_exec a2 "$KV" plan --hub "$hub" >"$dir/plan.txt" 2>"$dir/plan.err" || fail "plan failed"
topo_exec a2 "$KV" plan --hub "$hub" --json >"$dir/plan.json" 2>>"$dir/plan.err" || fail "plan --json failed"
grep -q "site-a <-> site-b: at most" "$dir/plan.txt" || fail "plan shows no round trip between the sites"
grep -q "placement in force: a ring of 2 sites" "$dir/plan.txt" || fail "plan: $(cat "$dir/plan.txt")"
jq -e '.predicted.sites_ms >= 40 and .predicted.experts_ms >= 40 and .predicted.sites_crossings == 2' \
  "$dir/plan.json" >/dev/null || fail "plan's predictions: $(jq -c .predicted "$dir/plan.json")"
echo "ok: plan predicts $(jq .predicted.sites_ms "$dir/plan.json") ms per token for the ring of sites," \
  "$(jq .predicted.experts_ms "$dir/plan.json") ms for per-layer dispatch"

# ---- the gateway serves the ring of sites by itself; another forced per layer
gateway() { # NAME PLACEMENT
  topo_bg a2 "$dir/$1.out" "$KV" gateway --hub "$hub" --placement "$2" --data "$dir/coord_$1" --listen 127.0.0.1:0 \
    --threads 1 --worker-timeout-ms 3000
}
gwaddr() { sed -n 's/^listening on \(.*\)$/\1/p' "$dir/$1.out" 2>/dev/null | head -1; }
gateway gws sites
gateway gwe experts
for g in gws gwe; do wait_until 60 eval '[ -n "$(gwaddr $g)" ]' || fail "gateway $g did not start"; done
grep -q "placement sites: the hub's ring of 2 sites" "$dir/gws.out.err" || fail "gateway gws is not on the ring"
grep -q "over a ring" "$dir/gwe.out.err" && fail "gateway gwe went to the ring with --placement experts"
healthy() { [ "$(topo_exec a2 curl -s -o /dev/null -w '%{http_code}' "http://$(gwaddr "$1")/health")" = 200 ]; }
for g in gws gwe; do wait_until 60 healthy "$g" || fail "gateway $g is not healthy"; done
chat() { # GATEWAY MAX_TOKENS OUT
  topo_exec a2 curl -s "http://$(gwaddr "$1")/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "$(jq -nc --arg p "$PROMPT" --argjson n "$2" '{model: "kvasir", messages: [{role: "user", content: $p}],
    max_tokens: $n, temperature: 0, seed: 1}')" >"$3"
}
text() { jq -r '.choices[0].message.content' "$1"; }
chat gws 12 "$dir/s1.json" || fail "chat through the ring of sites failed"
[ "$(text "$dir/s1.json")" = "$ref" ] || fail "the ring of sites' text differs from kvasir run: $(cat "$dir/s1.json")"
chat gwe 12 "$dir/e1.json" || fail "chat through per-layer dispatch failed"
[ "$(text "$dir/e1.json")" = "$ref" ] || fail "per-layer dispatch's text differs from kvasir run: $(cat "$dir/e1.json")"
echo "ok: a completion through the ring of sites, and one through per-layer dispatch, equal kvasir run's text"

# ---- one of site B's workers killed mid-decode
served() { hcurl /v1/nodes | jq --arg a "${TOPO_IP[b1]}:7300" '.nodes[] | select(.addr == $a) | .served_pairs'; }
s0=$(served)
chat gws "$n_long" "$dir/s2.json" &
CHATP=$!
rose() { [ "$(served)" -gt "$s0" ] || ! kill -0 "$CHATP" 2>/dev/null; }
wait_until 30 rose || fail "site B's first worker served nothing of the decode"
kill -0 "$CHATP" 2>/dev/null || fail "the decode ended before the worker was killed: make it longer"
kill -9 "$NB1"
wait "$NB1" 2>/dev/null || true
wait "$CHATP" || fail "the completion with a site B worker killed failed"
[ "$(text "$dir/s2.json")" = "$ref_long" ] ||
  fail "the completion in flight differs from the local run after the kill: $(cat "$dir/s2.json")"
echo "ok: site B's worker ${TOPO_IP[b1]}:7300 killed mid-decode (after it served $(($(served) - s0)) experts" \
  "of it): the completion in flight equals the local run ($n_long tokens), its replica in site B took over"
