#!/usr/bin/env bash
# kv-test-labels: net
# Replica choice and hedged requests (docs/PROTOCOL.md, "Replica choice and
# hedging"), with real processes on loopback. Three workers hold every expert
# of a sliced qwen3moe model and answer each request 5 ms late (--test-delay,
# a stand-in for a network round trip); one of them also stalls STALL_MS on
# every second request it takes (--test-stall-ms/--test-stall-every, test
# only); a fourth answers 40 ms late. The same greedy decode runs in one
# process on the GGUF, over the two healthy workers, over a healthy one and
# the staller, and over both healthy ones and the slow one:
#   - tokens and every logit row are byte-identical to the one-process run in
#     each (whichever replica answers, and whichever answer of a hedged
#     request wins);
#   - with the staller, requests were hedged (counted in the run's JSON), the
#     replica won, and no stall was waited for: every request the staller
#     stalled was called off before it computed it (its log names each
#     stalled and each cancelled request: an awaited stall is answered, not
#     cancelled), or was a probe, a late answer or in flight when the run
#     ended (none of these is waited for), and each hedge of its requests
#     left within half a stall (the coordinator's --verbose log). These are
#     counts and per-request times, not a comparison of the two decodes'
#     wall times, which a loaded machine moves by seconds (the healthy decode
#     took 5.7 s instead of 4.3 s at load 8; a coordinator kept off the CPU
#     half the time takes 7.9 s with the staller and waits for no stall);
#   - the losers were called off (protocol v6 CANCEL): the staller's own count
#     of requests it dropped (printed when it exits) equals the CANCELLED the
#     coordinator counted, at least one, and the expert computations it
#     served equal those the coordinator took from it (no late answer, no
#     probe): the stalled requests were never computed;
#   - with three replicas of different speeds, the slow one gets fewer pairs
#     than each fast one (load-aware choice), the fast ones some;
#   - a gateway over the healthy worker and a fresh staller (this one stalls
#     every request it takes, so that it has a stalled request to hedge
#     whichever requests the replica choice gives it) answers a completion
#     with the text of `kvasir run`, and its /metrics, read as soon as the
#     completion is answered, counts the hedges (kvasir_gateway_hedges_total,
#     _hedges_won_total, _hedges_cancelled_total).
# Bad stall flags are refused with a message that names them.
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_hedge: FAIL: $*" >&2; exit 1; }
command -v jq >/dev/null 2>&1 || fail "jq not found"
command -v curl >/dev/null 2>&1 || fail "curl not found"
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
D=$(mktemp -d "${TMPDIR:-/tmp}/kv_hedge.XXXXXX")
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$D"
}
trap cleanup EXIT
STALL_MS=4000
N=200
now() { date +%s.%N; }

"$BIN" gen-model --arch qwen3moe --out "$D/m.gguf" --layers 4 --embd 128 --ff-exp 64 --experts 8 --experts-used 2 \
  --heads 4 --kv-heads 2 --head-dim 32 --vocab 600 --type q8_0 --seed 5 >/dev/null 2>&1 || fail "gen-model"
"$BIN" slice "$D/m.gguf" --out "$D/sl" --experts-per-slab 4 >/dev/null 2>&1 || fail "slice"
mkdir -p "$D/coord"
cp "$D/sl/backbone.gguf" "$D/sl/manifest.json" "$D/coord/"
PK=$("$BIN" key --key "$D/coord.key")

# bad flags: refused, named
for bad in --test-stall-ms=0 --test-stall-ms=60001 --test-stall-every=0 --test-stall-ms=x; do
  if "$BIN" worker --slabs "$D/sl/experts" --listen 127.0.0.1:0 --allow-key "$PK" "$bad" >/dev/null 2>"$D/bad.err"; then
    fail "worker accepted $bad"
  fi
  grep -q -- "${bad%%=*}" "$D/bad.err" || fail "$bad: the error does not name it: $(cat "$D/bad.err")"
done
if "$BIN" worker --slabs "$D/sl/experts" --listen 127.0.0.1:0 --allow-key "$PK" --test-stall-every=3 >/dev/null 2>"$D/bad.err"; then
  fail "worker accepted --test-stall-every without --test-stall-ms"
fi
grep -q -- "--test-stall-ms" "$D/bad.err" || fail "--test-stall-every alone: $(cat "$D/bad.err")"

# start_worker NAME DELAY_MS [FLAGS...]: sets $addr
start_worker() {
  local name=$1 delay=$2 quiet=${WORKER_QUIET---quiet}
  shift 2
  "$BIN" worker --slabs "$D/sl/experts" --listen 127.0.0.1:0 --threads 1 $quiet --allow-key "$PK" --test-delay="$delay" "$@" \
    >"$D/$name.out" 2>"$D/$name.err" &
  PIDS+=("$!")
  eval "pid_$name=$!"
  addr=""
  for _ in $(seq 1 200); do
    addr=$(sed -n 's/^listening on \(.*\)$/\1/p' "$D/$name.out" 2>/dev/null | head -1 || true)
    [ -n "$addr" ] && return 0
    sleep 0.05
  done
  fail "worker $name did not start: $(cat "$D/$name.err")"
}
STALL=(--test-stall-ms=$STALL_MS --test-stall-every=2)
start_worker a 5
A=$addr
start_worker b 5
B=$addr
# (with its per-connection log: each request it cancels is named)
WORKER_QUIET= start_worker s 5 "${STALL[@]}"
S=$addr
start_worker z 40
Z=$addr

P="The swarm computes every expert where it lives, and the tokens come out the same"
RUN=(-p "$P" -n $N --temp 0 --json --threads 1)
"$BIN" run -m "$D/m.gguf" "${RUN[@]}" --logits-out "$D/local.bin" >"$D/local.json" || fail "local run"

t0=$(now)
"$BIN" run -m "$D/coord/manifest.json" --worker "$A" --worker "$B" --key "$D/coord.key" "${RUN[@]}" \
  --logits-out "$D/healthy.bin" >"$D/healthy.json" || fail "run over the healthy replicas"
t1=$(now)
# the staller logs each stall it takes ("... stalls N ms"); its start-up lines do not count
n_stalls() { grep -c "stalls [0-9]* ms" "$D/$1.err" || true; }
s0=$(n_stalls s)
"$BIN" run -m "$D/coord/manifest.json" --worker "$A" --worker "$S" --key "$D/coord.key" "${RUN[@]}" --verbose \
  --logits-out "$D/stall.bin" >"$D/stall.json" 2>"$D/stall.err" || fail "run with a stalling replica: $(cat "$D/stall.err")"
t2=$(now)
stalls=$(($(n_stalls s) - s0))
th=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
ts=$(awk -v a="$t1" -v b="$t2" 'BEGIN { printf "%.2f", b - a }')

for k in healthy stall; do
  [ "$(jq -c .tokens "$D/local.json")" = "$(jq -c .tokens "$D/$k.json")" ] || fail "$k: tokens differ from the one-process run"
  cmp -s "$D/local.bin" "$D/$k.bin" || fail "$k: logits differ from the one-process run"
  [ "$(jq .dispatch.pairs_local "$D/$k.json")" = 0 ] || fail "$k: experts computed locally"
done
[ "$(jq '[.dispatch.workers[] | select(.pairs > 0)] | length' "$D/healthy.json")" = 2 ] ||
  fail "healthy replicas: one got no work: $(jq -c '[.dispatch.workers[].pairs]' "$D/healthy.json")"
H=$(jq .dispatch.hedges "$D/stall.json")
HW=$(jq .dispatch.hedges_won "$D/stall.json")
SH=$(jq '.dispatch.workers[1].hedged' "$D/stall.json")
echo "healthy: $th s ($(jq -c '[.dispatch.workers[].pairs]' "$D/healthy.json") pairs, $(jq .dispatch.hedges "$D/healthy.json") hedges);" \
  "with the staller: $ts s, $stalls stalls of $STALL_MS ms taken by it, $H hedges ($SH of its requests), $HW won by the replica," \
  "$(jq .dispatch.late_answers "$D/stall.json") late answers discarded; pairs $(jq -c '[.dispatch.workers[].pairs]' "$D/stall.json")," \
  "p95 $(jq -c '[.dispatch.workers[].p95_ms]' "$D/stall.json") ms"
[ "$stalls" -ge 1 ] || fail "the staller never stalled during the run"
[ "$SH" -ge 1 ] || fail "no request of the staller was hedged: $(jq -c .dispatch "$D/stall.json")"
[ "$HW" -ge 1 ] || fail "no hedge won"
[ "$(jq '.dispatch.workers[1].drops' "$D/stall.json")" = 0 ] || fail "the staller was dropped (a stall is not a fault)"
# each hedge of the staller's requests left within half a stall
hq=$(sed -n "s/^kvasir remote: worker $S has not answered in \([0-9]*\) ms .*: request hedged to .*/\1/p" "$D/stall.err")
[ "$(wc -w <<<"$hq")" = "$SH" ] || fail "the coordinator logged $(wc -w <<<"$hq") hedges of the staller's requests, counted $SH"
for q in $hq; do
  [ "$q" -lt $((STALL_MS / 2)) ] || fail "a request of the staller was hedged after $q ms: its stall of $STALL_MS ms was waited for"
done
awk -v ts="$ts" 'BEGIN { exit !(ts < 30) }' || fail "the decode took $ts s"
echo "ok: byte-identical with and without a stalling replica; the staller's requests hedged after $(tr '\n' ' ' <<<"$hq")ms"

# ---- the losers were cancelled: the staller computed none of them ----------------
kill "$pid_s" 2>/dev/null || true
wait "$pid_s" 2>/dev/null || true
summary=$(grep "^worker: served" "$D/s.err" | tail -1)
served=$(sed -n 's/^worker: served \([0-9]*\) expert computations.*/\1/p' <<<"$summary")
dropped=$(sed -n 's/.*, \([0-9]*\) requests cancelled$/\1/p' <<<"$summary")
[ -n "$served" ] && [ -n "$dropped" ] || fail "the staller printed no summary: $(tail -2 "$D/s.err")"
SC=$(jq '.dispatch.workers[1].cancelled' "$D/stall.json")
HC=$(jq .dispatch.hedges_cancelled "$D/stall.json")
SP=$(jq '.dispatch.workers[1].pairs' "$D/stall.json")
SL=$(jq '.dispatch.workers[1].late' "$D/stall.json")
SPR=$(jq '.dispatch.workers[1].probes' "$D/stall.json")
echo "the staller: $dropped requests dropped on a CANCEL (the coordinator counted $SC CANCELLED, $HC in all)," \
  "$served expert computations served, $SP taken from it by the coordinator ($SL late answers, $SPR probes)"
[ "$SC" -ge 1 ] || fail "no superseded request of the staller was cancelled: $(jq -c '.dispatch | del(.steps, .demand)' "$D/stall.json")"
[ "$dropped" = "$SC" ] || fail "the staller dropped $dropped requests, the coordinator counted $SC CANCELLED from it"
[ "$HC" = "$(jq '[.dispatch.workers[].cancelled] | add' "$D/stall.json")" ] || fail "hedges_cancelled is not the workers' sum"
# no stall was waited for: each request the staller stalled was cancelled
# before it was computed; an awaited one is answered instead. A probe that
# stalled (not answered within half a stall, per the coordinator's log), a
# late answer (superseded, answered before its CANCEL came) and a request
# still in flight when the run ended and closed its connections (neither
# computed nor cancelled: requests and probes sent, less those the staller
# computed and cancelled) are not waited for either: so many stalls may go
# uncancelled.
computed=$(sed -n 's/^worker: served [0-9]* expert computations (\([0-9]*\) requests.*/\1/p' <<<"$summary")
SREQ=$(jq '.dispatch.workers[1].requests' "$D/stall.json")
at_close=$((SREQ + SPR - computed - dropped))
[ "$at_close" -ge 0 ] || fail "the staller computed $computed and cancelled $dropped requests, the coordinator sent it $SREQ and $SPR probes"
fastp=$(sed -n "s/^kvasir remote: worker $S answered a probe in \([0-9]*\) ms$/\1/p" "$D/stall.err" |
  awk -v h=$((STALL_MS / 2)) '$1 < h' | grep -c . || true)
stalled=$(sed -n 's/^worker: TEST MODE: request \([0-9]*\) (COMPUTE [0-9]*) stalls .*/\1/p' "$D/s.err" | sort)
called_off=$(sed -n 's/^worker: conn .*: request \([0-9]*\) cancelled before it was computed$/\1/p' "$D/s.err" | sort)
[ "$(wc -w <<<"$called_off")" = "$dropped" ] || fail "the staller logged $(wc -w <<<"$called_off") cancels, counted $dropped"
awaited=$(comm -23 <(tr ' ' '\n' <<<"$stalled") <(tr ' ' '\n' <<<"$called_off") | grep -c . || true)
[ "$awaited" -le $((SPR - fastp + SL + at_close)) ] ||
  fail "$awaited of the staller's stalled requests ($(tr '\n' ' ' <<<"$stalled")) were not cancelled (cancelled: $(tr '\n' ' ' <<<"$called_off"); $SPR probes, $fastp of them answered at once, $SL late answers, $at_close in flight at the end): a stall was waited for"
if [ "$SL" = 0 ] && [ "$SPR" = 0 ]; then
  [ "$served" = "$SP" ] ||
    fail "the staller computed $served pairs, the coordinator took $SP from it: a cancelled request was computed"
fi
echo "ok: every superseded request of the staller was called off before it was computed, every stalled one among them"

# ---- three replicas of different speeds: the slow one gets the least work ------
"$BIN" run -m "$D/coord/manifest.json" --worker "$A" --worker "$Z" --worker "$B" --key "$D/coord.key" "${RUN[@]}" \
  --logits-out "$D/mixed.bin" >"$D/mixed.json" || fail "run over replicas of different speeds"
[ "$(jq -c .tokens "$D/local.json")" = "$(jq -c .tokens "$D/mixed.json")" ] || fail "mixed speeds: tokens differ"
cmp -s "$D/local.bin" "$D/mixed.bin" || fail "mixed speeds: logits differ"
pa=$(jq '.dispatch.workers[0].pairs' "$D/mixed.json")
pz=$(jq '.dispatch.workers[1].pairs' "$D/mixed.json")
pb=$(jq '.dispatch.workers[2].pairs' "$D/mixed.json")
echo "replicas answering 5, 40 and 5 ms late: $pa, $pz, $pb pairs; estimates" \
  "$(jq -c '[.dispatch.workers[].latency_ms | . * 10 | round / 10]' "$D/mixed.json") ms"
[ "$pz" -lt "$pa" ] && [ "$pz" -lt "$pb" ] || fail "the slow replica got more work than a fast one ($pa, $pz, $pb)"
[ "$pa" -gt 0 ] && [ "$pb" -gt 0 ] || fail "a fast replica got no work ($pa, $pz, $pb)"
echo "ok: replicas of different speeds: byte-identical, the slow one least used"

# ---- a gateway: the same, and its /metrics counts the hedges ----------------------
kill "$pid_s" 2>/dev/null || true
# every request it takes stalls: the first one it is given in the prefill's
# first round, before it has an answer time, is hedged whatever the replica
# choice does next (with every second one, a slow first answer could get it
# demoted, and its second request, the first to stall, would be a probe,
# which is not hedged)
start_worker s2 5 --test-stall-ms=$STALL_MS --test-stall-every=1
S2=$addr
"$BIN" gateway --listen 127.0.0.1:0 --threads 1 -m "$D/coord/manifest.json" --worker "$A" --worker "$S2" \
  --key "$D/coord.key" >"$D/gw.out" 2>"$D/gw.err" &
GWPID=$!
PIDS+=("$GWPID")
GW=""
for _ in $(seq 1 300); do
  GW=$(sed -n 's/^listening on //p' "$D/gw.out" 2>/dev/null)
  [ -n "$GW" ] && break
  kill -0 "$GWPID" 2>/dev/null || fail "gateway exited: $(cat "$D/gw.err")"
  sleep 0.05
done
[ -n "$GW" ] || fail "gateway did not start"
NG=120
body=$(jq -nc --arg p "$P" --argjson n $NG '{prompt: $p, max_tokens: $n, temperature: 0}')
t3=$(now)
curl -sf "http://$GW/v1/completions" -d "$body" >"$D/gw.json" || fail "completion failed: $(cat "$D/gw.err")"
t4=$(now)
# at once: the completion's hedges are counted by the time it is answered
curl -sf "http://$GW/metrics" >"$D/metrics.txt" || fail "/metrics"
want=$("$BIN" run -m "$D/m.gguf" -p "$P" -n $NG --temp 0 --json --threads 1 | jq -r .text)
[ "$(jq -r '.choices[0].text' "$D/gw.json")" = "$want" ] || fail "gateway: text differs from kvasir run"
gh=$(sed -n 's/^kvasir_gateway_hedges_total \([0-9]*\)$/\1/p' "$D/metrics.txt")
gw=$(sed -n 's/^kvasir_gateway_hedges_won_total \([0-9]*\)$/\1/p' "$D/metrics.txt")
gl=$(sed -n 's/^kvasir_gateway_late_answers_total \([0-9]*\)$/\1/p' "$D/metrics.txt")
gc=$(sed -n 's/^kvasir_gateway_hedges_cancelled_total \([0-9]*\)$/\1/p' "$D/metrics.txt")
[ -n "$gh" ] && [ -n "$gw" ] && [ -n "$gl" ] && [ -n "$gc" ] || fail "/metrics has no hedge counters: $(grep hedge "$D/metrics.txt")"
# answer signatures: each connection's first checked on arrival, over the
# TLS links a sample of the rest taken unchecked (docs/PROTOCOL.md "Signed results")
sc=$(sed -n 's/^kvasir_gateway_answer_signatures_total{check="checked"} \([0-9]*\)$/\1/p' "$D/metrics.txt")
sd=$(sed -n 's/^kvasir_gateway_answer_signatures_total{check="deferred"} \([0-9]*\)$/\1/p' "$D/metrics.txt")
[ -n "$sc" ] && [ -n "$sd" ] || fail "/metrics has no signature counters: $(grep signature "$D/metrics.txt")"
[ "$sc" -ge 2 ] || fail "/metrics: $sc answer signatures checked (each worker's first is)"
[ "$sd" -gt "$sc" ] || fail "/metrics: $sd signatures deferred against $sc checked (1 in 16 checked over TLS)"
# the staller's own counts, for a failure message: stalls taken, then (once
# it has exited) what it served and dropped on a CANCEL
s2_counts() {
  kill "$pid_s2" 2>/dev/null || true
  wait "$pid_s2" 2>/dev/null || true
  echo "the staller took $(n_stalls s2) stalls; $(grep "^worker: served" "$D/s2.err" | tail -1 || echo "no summary")"
}
[ "$gh" -ge 1 ] || fail "/metrics: no hedges counted ($(s2_counts); /metrics: $(grep -v '^#' "$D/metrics.txt" | grep -E 'hedge|late' | tr '\n' ' '))"
[ "$gw" -le "$gh" ] || fail "/metrics: more hedges won ($gw) than sent ($gh)"
[ "$gc" -ge 1 ] && [ "$gc" -le "$gh" ] || fail "/metrics: $gc hedges cancelled of $gh ($(s2_counts))"
# a replica whose request was called off loses its share until its estimate is
# stale (0.5 s) and it is tried again, each time it is called off, not only
# the first: about one stalled request per 0.5 s of decode (twice that, plus
# 2, allowed), not one per round
tg=$(awk -v a="$t3" -v b="$t4" 'BEGIN { printf "%.2f", b - a }')
ns2=$(n_stalls s2)
awk -v n="$ns2" -v t="$tg" 'BEGIN { exit !(n <= 2 + 4 * t) }' ||
  fail "the staller was given $ns2 requests in a decode of $tg s: called off, it kept its share ($(s2_counts))"
echo "ok: gateway: same text as kvasir run in $tg s; /metrics: $gh hedges, $gw won, $gl late answers, $gc cancelled;" \
  "the staller took $ns2 requests"
echo "test_hedge: ok"
