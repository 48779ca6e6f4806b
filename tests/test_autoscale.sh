#!/usr/bin/env bash
# kv-test-labels: net
# Local experts and demand metering (docs/GATEWAY.md "Local experts"), with
# real processes on loopback: a sliced qwen3moe model with a skewed router
# (gen-model --router-skew 2), two workers that hold every expert and answer
# 2 ms late (--test-delay), and a coordinator folder that also holds the slabs.
#   - demand: `kvasir run --json` over the workers reports per shard the
#     expert computations it needed: each layer's sum is exactly the forward
#     pass's (tokens forwarded x experts used, from the run's own token
#     counts; in the last layer only the sampled token of each step), equals the pairs the workers and local slabs
#     answered, the skew shows (the hottest shard of a layer needed more than
#     the coldest), and every shard that was needed was waited for (wait_us);
#   - a gateway with --local-experts (two slabs' worth) and a step target
#     forced to 0.01 ms widens while two completions run, and tightens when the
#     shorter one ends (sessions halved), then widens again: the share changes
#     several times in the middle of the longer request. Both texts equal
#     `kvasir run` on the GGUF; /metrics shows the mode, the share, both
#     decisions, the held slabs, pairs computed both here (held) and on the
#     workers, and per-shard demand equal in sum to the pairs computed;
#   - a gateway with --local-experts and the default (derived) target on a
#     single request stays tight: every held expert computed here;
#   - `kvasir bench --local-share S` splits the pairs as asked (none here at
#     0, all at 1, both at 0.5, the same total);
#   - bad flags are refused with a message that names them.
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_autoscale: FAIL: $*" >&2; exit 1; }
command -v jq >/dev/null 2>&1 || fail "jq not found"
command -v curl >/dev/null 2>&1 || fail "curl not found"
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
D=$(mktemp -d "${TMPDIR:-/tmp}/kv_autoscale.XXXXXX")
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$D"
}
trap cleanup EXIT

LAYERS=4
USED=2
"$BIN" gen-model --arch qwen3moe --out "$D/m.gguf" --layers $LAYERS --embd 128 --ff-exp 64 --experts 8 \
  --experts-used $USED --heads 4 --kv-heads 2 --head-dim 32 --vocab 600 --type q8_0 --seed 7 --router-skew 2 \
  >/dev/null 2>&1 || fail "gen-model"
"$BIN" slice "$D/m.gguf" --out "$D/sl" --experts-per-slab 2 >/dev/null 2>&1 || fail "slice"
mkdir -p "$D/coord/experts"
cp "$D/sl/backbone.gguf" "$D/sl/manifest.json" "$D/coord/"
cp "$D/sl/experts/"*.gguf "$D/coord/experts/"
SLAB=$(stat -c %s "$D/sl/experts/blk.0.0000-0001.gguf")
PK=$("$BIN" key --key "$D/coord.key")

start_worker() { # NAME: sets $addr
  local name=$1
  "$BIN" worker --slabs "$D/sl/experts" --listen 127.0.0.1:0 --threads 1 --quiet --allow-key "$PK" --test-delay=2 \
    >"$D/$name.out" 2>"$D/$name.err" &
  PIDS+=("$!")
  addr=""
  for _ in $(seq 1 200); do
    addr=$(sed -n 's/^listening on \(.*\)$/\1/p' "$D/$name.out" 2>/dev/null | head -1 || true)
    [ -n "$addr" ] && return 0
    sleep 0.05
  done
  fail "worker $name did not start: $(cat "$D/$name.err")"
}
start_worker a
A=$addr
start_worker b
B=$addr

# ---- bad flags ---------------------------------------------------------------
bad() { # EXPECTED-WORD ARGS...: refused, and the error names it
  local want=$1
  shift
  if "$BIN" gateway --listen 127.0.0.1:0 --key "$D/coord.key" "$@" >/dev/null 2>"$D/bad.err"; then
    fail "gateway accepted $*"
  fi
  grep -q -- "$want" "$D/bad.err" || fail "$*: the error does not name $want: $(cat "$D/bad.err")"
}
bad --local-experts -m "$D/m.gguf" --local-experts 1M
bad --local-experts -m "$D/coord/manifest.json" --worker "$A" --local-experts 0
bad --local-experts -m "$D/coord/manifest.json" --worker "$A" --local-experts lots
bad --step-target-ms -m "$D/coord/manifest.json" --worker "$A" --step-target-ms 5
bad --step-target-ms -m "$D/coord/manifest.json" --worker "$A" --local-experts 1M --step-target-ms 0
bad --step-target-ms -m "$D/coord/manifest.json" --worker "$A" --local-experts 1M --step-target-ms 70000
bad --local-experts -m "$D/coord/manifest.json" --worker "$A" --local-experts 1K
echo "ok: bad flags refused"

# ---- demand metered by kvasir run --------------------------------------------
P="The swarm computes every expert where it lives, and the tokens come out the same"
N=60
"$BIN" run -m "$D/coord/manifest.json" --worker "$A" --worker "$B" --key "$D/coord.key" -p "$P" -n $N --temp 0 \
  --json --threads 1 >"$D/run.json" || fail "run over the workers"
"$BIN" run -m "$D/m.gguf" -p "$P" -n $N --temp 0 --json --threads 1 >"$D/local.json" || fail "local run"
[ "$(jq -c .tokens "$D/local.json")" = "$(jq -c .tokens "$D/run.json")" ] || fail "run over workers: tokens differ"
fwd=$(jq '.engine.prefill_tokens + .engine.decode_tokens' "$D/run.json")
steps=$(jq '.engine.steps' "$D/run.json")
sum=$(jq '[.dispatch.demand[].computations] | add' "$D/run.json")
ans=$(jq '.dispatch.pairs_remote + .dispatch.pairs_local' "$D/run.json")
# every token goes through every layer but the last, where only the tokens
# whose logits are sampled (one per step) are computed
want=$((USED * ((LAYERS - 1) * fwd + steps)))
[ "$sum" = "$want" ] ||
  fail "demand: $sum computations metered, the forward pass needed $USED x ($((LAYERS - 1)) x $fwd + $steps) = $want"
for L in $(seq 0 $((LAYERS - 1))); do
  per=$(jq --argjson L "$L" '[.dispatch.demand[] | select(.layer == $L) | .computations] | add' "$D/run.json")
  t=$fwd
  [ "$L" = $((LAYERS - 1)) ] && t=$steps
  [ "$per" = $((USED * t)) ] || fail "demand: layer $L: $per computations, the forward pass needed $USED x $t"
done
[ "$sum" = "$ans" ] || fail "demand: $sum computations metered, $ans answered"
[ "$(jq '.dispatch.demand | length' "$D/run.json")" = $((LAYERS * 4)) ] || fail "demand: not one entry per shard"
jq -e '[.dispatch.demand[] | select(.computations > 0 and .wait_us == 0)] | length == 0' "$D/run.json" >/dev/null ||
  fail "demand: a shard needed but never waited for: $(jq -c .dispatch.demand "$D/run.json")"
# the skew: in some layer the hottest shard needed more than twice the coldest
jq -e '[.dispatch.demand | group_by(.layer)[] | ([.[].computations] | max > 2 * min)] | any' "$D/run.json" >/dev/null ||
  fail "demand: no skew visible: $(jq -c '[.dispatch.demand[].computations]' "$D/run.json")"
echo "ok: demand: $sum computations over $(jq '.dispatch.demand | length' "$D/run.json") shards" \
  "($(jq -c '[.dispatch.demand[].computations]' "$D/run.json"))"

# ---- kvasir bench --local-share: a fixed share (bench/pair_cost.sh) ------------
# every pair of the timed phase is computed whole on one side: none here at
# share 0, none sent at share 1, both at 0.5, the same total each time
for s in 0 0.5 1; do
  "$BIN" bench -m "$D/coord/manifest.json" --worker "$A" --worker "$B" --key "$D/coord.key" -p 4 -n 6 --reps 1 \
    --parallel 3 --threads 1 --local-share $s --json >"$D/bench$s.json" 2>"$D/bench.err" ||
    fail "bench --local-share $s: $(cat "$D/bench.err")"
done
tot=$(jq '.pairs_remote + .pairs_local' "$D/bench0.json")
[ "$tot" -gt 0 ] || fail "bench: no pairs"
jq -e --argjson t "$tot" '.pairs_local == 0 and .pairs_remote == $t and .local_share == 0 and .held_slabs == 16' \
  "$D/bench0.json" >/dev/null || fail "bench --local-share 0: $(cat "$D/bench0.json")"
jq -e --argjson t "$tot" '.pairs_remote == 0 and .pairs_held_local == $t' "$D/bench1.json" >/dev/null ||
  fail "bench --local-share 1: $(cat "$D/bench1.json")"
jq -e --argjson t "$tot" '.pairs_remote > 0 and .pairs_held_local > 0 and .pairs_held_local == .pairs_local and
  .pairs_remote + .pairs_local == $t' "$D/bench0.5.json" >/dev/null || fail "bench --local-share 0.5: $(cat "$D/bench0.5.json")"
"$BIN" bench -m "$D/m.gguf" --local-share 0.5 >/dev/null 2>"$D/bad.err" && fail "bench --local-share without workers"
grep -q -- "--local-share needs workers" "$D/bad.err" || fail "bench --local-share without workers: $(cat "$D/bad.err")"
"$BIN" bench -m "$D/coord/manifest.json" --worker "$A" --local-share 1.5 >/dev/null 2>"$D/bad.err" && fail "bench --local-share 1.5"
grep -q -- "--local-share: '1.5'" "$D/bad.err" || fail "bench --local-share 1.5: $(cat "$D/bad.err")"
mkdir -p "$D/bare" # a coordinator folder without slabs: nothing to compute here
cp "$D/sl/backbone.gguf" "$D/sl/manifest.json" "$D/bare/"
"$BIN" bench -m "$D/bare/manifest.json" --worker "$A" --worker "$B" --key "$D/coord.key" --local-share 0.5 -p 2 -n 2 \
  --reps 1 >/dev/null 2>"$D/bad.err" && fail "bench --local-share with no slab here"
grep -q -- "--local-share: no slab" "$D/bad.err" || fail "bench --local-share with no slab here: $(cat "$D/bad.err")"
echo "ok: bench --local-share: $tot pairs, $(jq .pairs_local "$D/bench0.5.json") here at 0.5, all remote at 0, all here at 1"

# ---- a gateway whose share changes in the middle of requests --------------------
start_gateway() { # ARGS...: sets $GW
  "$BIN" gateway --listen 127.0.0.1:0 --threads 1 -m "$D/coord/manifest.json" --worker "$A" --worker "$B" \
    --key "$D/coord.key" --no-web-ui "$@" >"$D/gw.out" 2>"$D/gw.err" &
  GWPID=$!
  PIDS+=("$GWPID")
  GW=""
  for _ in $(seq 1 300); do
    GW=$(sed -n 's/^listening on //p' "$D/gw.out" 2>/dev/null)
    [ -n "$GW" ] && return 0
    kill -0 "$GWPID" 2>/dev/null || fail "gateway exited: $(cat "$D/gw.err")"
    sleep 0.05
  done
  fail "gateway did not start"
}
metric() { sed -n "s/^$1 \\([0-9.]*\\)\$/\\1/p" "$D/metrics.txt"; }
start_gateway --local-experts $((2 * SLAB)) --step-target-ms 0.01
NS=150
NL=400
PL="Once upon a time" # 447 tokens before its end of text: the long one runs to max_tokens
P2="Every layer of the model is a market of experts"
curl -sf "http://$GW/v1/completions" \
  -d "$(jq -nc --arg p "$PL" --argjson n $NL '{prompt: $p, max_tokens: $n, temperature: 0}')" >"$D/long.json" &
LONG=$!
sleep 0.2
curl -sf "http://$GW/v1/completions" \
  -d "$(jq -nc --arg p "$P2" --argjson n $NS '{prompt: $p, max_tokens: $n, temperature: 0}')" >"$D/short.json" ||
  fail "short completion: $(cat "$D/gw.err")"
wait $LONG || fail "long completion: $(cat "$D/gw.err")"
want_long=$("$BIN" run -m "$D/m.gguf" -p "$PL" -n $NL --temp 0 --json --threads 1 | jq -r .text)
want_short=$("$BIN" run -m "$D/m.gguf" -p "$P2" -n $NS --temp 0 --json --threads 1 | jq -r .text)
[ "$(jq -r '.choices[0].text' "$D/long.json")" = "$want_long" ] || fail "long completion: text differs from kvasir run"
[ "$(jq -r '.choices[0].text' "$D/short.json")" = "$want_short" ] || fail "short completion: text differs from kvasir run"
[ "$(jq -r '.usage.completion_tokens' "$D/long.json")" = $NL ] || fail "the long completion stopped early: $(jq -c .usage "$D/long.json")"
curl -sf "http://$GW/metrics" >"$D/metrics.txt" || fail "/metrics"
wid=$(metric 'kvasir_gateway_local_decisions_total{decision="widen"}')
tig=$(metric 'kvasir_gateway_local_decisions_total{decision="tighten"}')
held=$(metric 'kvasir_gateway_expert_pairs_total{where="held"}')
remote=$(metric 'kvasir_gateway_expert_pairs_total{where="remote"}')
local_=$(metric 'kvasir_gateway_expert_pairs_total{where="local"}')
[ -n "$wid" ] && [ -n "$tig" ] && [ -n "$held" ] && [ -n "$remote" ] || fail "/metrics lacks the local-experts lines: $(grep local "$D/metrics.txt")"
[ "$(metric kvasir_gateway_local_held_slabs)" = 2 ] || fail "not two slabs held: $(grep held "$D/metrics.txt")"
[ "$(metric kvasir_gateway_local_held_bytes)" = $((2 * SLAB)) ] || fail "held bytes: $(grep held "$D/metrics.txt")"
[ -n "$(metric 'kvasir_gateway_local_share')" ] || fail "/metrics: no local share"
[ "$(grep -c '^kvasir_gateway_local_mode{mode="[a-z]*"} 1$' "$D/metrics.txt")" = 1 ] || fail "/metrics: not one mode set"
[ "$wid" -ge 1 ] || fail "the share widened $wid times (forced target): $(grep -i local "$D/gw.err")"
[ "$tig" -ge 1 ] || fail "the share never tightened when the short request ended: $(grep -i local "$D/gw.err")"
[ "$held" -gt 0 ] && [ "$remote" -gt 0 ] || fail "pairs held here $held, on workers $remote: the share did not move work"
dsum=$(grep '^kvasir_gateway_shard_computations_total{' "$D/metrics.txt" | awk '{s += $2} END {print s}')
[ "$dsum" = $((remote + local_)) ] || fail "/metrics: shard demand $dsum != pairs computed $remote + $local_"
echo "ok: two completions byte-identical to kvasir run while the share moved ($wid widen, $tig tighten;" \
  "$held pairs held here, $remote on workers, demand $dsum)"
kill "$GWPID" 2>/dev/null || true
wait "$GWPID" 2>/dev/null || true

# ---- quiet: one request, derived target: stays tight ------------------------------
start_gateway --local-experts $((2 * SLAB))
curl -sf "http://$GW/v1/completions" \
  -d "$(jq -nc --arg p "$P2" --argjson n $NS '{prompt: $p, max_tokens: $n, temperature: 0}')" >"$D/quiet.json" ||
  fail "quiet completion: $(cat "$D/gw.err")"
[ "$(jq -r '.choices[0].text' "$D/quiet.json")" = "$want_short" ] || fail "quiet completion: text differs from kvasir run"
curl -sf "http://$GW/metrics" >"$D/metrics.txt" || fail "/metrics"
[ "$(metric 'kvasir_gateway_local_mode{mode="tight"}')" = 1 ] || fail "one request: not tight: $(grep local "$D/metrics.txt")"
[ "$(metric 'kvasir_gateway_local_decisions_total{decision="widen"}')" = 0 ] || fail "one request: it widened"
[ "$(metric 'kvasir_gateway_expert_pairs_total{where="held"}')" -gt 0 ] || fail "one request: no held expert computed here"
! grep -q '^kvasir_gateway_demand_reports_total' "$D/metrics.txt" || fail "a gateway without --hub reports demand"
awk -v t="$(metric kvasir_gateway_step_target_seconds)" 'BEGIN { exit !(t > 0) }' || fail "no target derived"
echo "ok: quiet: tight, target derived ($(metric kvasir_gateway_step_target_seconds) s)"
echo "test_autoscale: ok"
