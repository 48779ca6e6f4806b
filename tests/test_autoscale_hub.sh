#!/usr/bin/env bash
# kv-test-labels: net
# A gateway fed by a hub reports its demand per shard to the hub (docs/HUB.md
# "Demand", docs/GATEWAY.md "Demand per shard"): a hub that vouches for any
# coordinator (--vouch-open), one node holding every slab, a gateway with
# --hub. After a completion, within two report intervals (5 s each):
#   - the gateway's /metrics counts an accepted report and the tokens the hub
#     counted (at most the tokens the engine evaluated);
#   - the hub's market (GET /v1/market) shows demand on the shards.
# Then `kvasir run --hub` reports once at its end, and the market's demand
# grows. (A gateway without --hub has no reporter: tests/test_autoscale.sh.)
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
dir=$(mktemp -d -t kvasir-gwdemand.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "test_autoscale_hub: FAIL: $*" >&2
  for f in "$dir"/*.err; do echo "--- $f" >&2; tail -8 "$f" >&2; done
  exit 1
}
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
listening() { [ -n "$(addr_of "$1")" ]; }

"$KV" gen-model --preset tiny --out "$dir/m.gguf" >/dev/null 2>&1
"$KV" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab 4 >/dev/null 2>&1
all=$(du -b "$dir/sl/experts" | cut -f1)
"$KV" hub --vouch-open --model "$dir/sl/manifest.json" --db "$dir/hub.db" --listen 127.0.0.1:0 --wanted 1 --quiet \
  >"$dir/hub.out" 2>"$dir/hub.err" &
pids+=($!)
wait_until 30 listening "$dir/hub.out" || fail "hub did not start"
hub="http://$(addr_of "$dir/hub.out")"
"$KV" node --hub "$hub" --budget $((all * 2)) --data "$dir/a" --interval-ms 300 --threads 1 >"$dir/a.out" 2>"$dir/a.err" &
pids+=($!)
"$KV" gateway --hub "$hub" --data "$dir/gw" --listen 127.0.0.1:0 --threads 1 --hub-refresh-ms 200 --quiet \
  >"$dir/gw.out" 2>"$dir/gw.err" &
pids+=($!)
wait_until 60 listening "$dir/gw.out" || fail "gateway did not start"
gw="http://$(addr_of "$dir/gw.out")"
healthy() { [ "$(curl -s -o /dev/null -w '%{http_code}' "$gw/health")" = 200 ]; }
wait_until 60 healthy || fail "the gateway never became healthy"
curl -sf "$gw/v1/completions" -d '{"prompt":"The market follows demand","max_tokens":40,"temperature":0}' \
  >"$dir/c.json" || fail "completion"
reported() {
  curl -sf "$gw/metrics" >"$dir/metrics.txt" &&
    [ "$(sed -n 's/^kvasir_gateway_demand_reports_total{result="ok"} \([0-9]*\)$/\1/p' "$dir/metrics.txt")" -ge 1 ]
}
wait_until 15 reported || fail "no accepted demand report: $(grep demand "$dir/metrics.txt")"
acc=$(sed -n 's/^kvasir_gateway_demand_tokens_accepted_total \([0-9]*\)$/\1/p' "$dir/metrics.txt")
evald=$(jq '.usage.prompt_tokens + .usage.completion_tokens' "$dir/c.json")
[ "$acc" -ge 1 ] && [ "$acc" -le "$evald" ] || fail "the hub counted $acc tokens of $evald evaluated"
curl -sf "$hub/v1/market" >"$dir/market.json" || fail "GET /v1/market"
jq -e '[.shards[] | select(.demand > 0)] | length > 0' "$dir/market.json" >/dev/null ||
  fail "no shard shows demand: $(jq -c '[.shards[] | {layer, first, demand}]' "$dir/market.json")"
echo "ok: the gateway reported its demand ($acc tokens counted); the market shows" \
  "$(jq '[.shards[] | select(.demand > 0)] | length' "$dir/market.json") of $(jq '.shards | length' "$dir/market.json") shards in demand"
# kvasir run --hub reports once at its end: the market's demand grows
before=$(jq '[.shards[].demand] | add' "$dir/market.json")
"$KV" run --hub "$hub" --data "$dir/r" --threads 1 -p "The market follows demand" -n 40 --temp 0 \
  >/dev/null 2>"$dir/run.err" || fail "run --hub: $(cat "$dir/run.err")"
! grep -q "demand report" "$dir/run.err" || fail "run --hub: $(grep "demand report" "$dir/run.err")"
curl -sf "$hub/v1/market" >"$dir/market2.json" || fail "GET /v1/market"
after=$(jq '[.shards[].demand] | add' "$dir/market2.json")
awk -v a="$after" -v b="$before" 'BEGIN { exit !(a > b) }' || fail "run --hub: the market's demand $before -> $after"
echo "ok: kvasir run --hub reported: the market's demand $before -> $after computations/s"
echo "test_autoscale_hub: ok"
