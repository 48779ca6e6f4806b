#!/usr/bin/env bash
# kv-test-labels: net
# The short version of `make bench-wan` (bench/wan.sh, docs/WAN.md): the WAN
# cost model's inputs and the bench's rows, on a 2-layer model in two network
# namespaces joined by kv-netdelay.
# - The bytes the model charges per expert round trip are the frame sizes of
#   docs/PROTOCOL.md, recomputed here from the model's shape: a COMPUTE of
#   16 + 20 + S n_embd size(enc) + 8 S k bytes and a RESULT of
#   16 + 12 + S k n_embd size(enc) + 64 (the signature), for f32 and f16 and
#   S = 1 and 2 sequences per step; the rounds per token are the layers.
# - bench/wan.sh runs its rows (two round trips, an unlimited and a 10 Mbit/s
#   line, batched rows) and writes one JSON row each; no row beats physics:
#   a token takes at least its rounds times the round trip.
# - the line's fixed cost per crossing (measured by the bench at 0 ms) enters
#   the formula as the larger of it and the bytes' time at the rate (by hand).
# - bench --json counts every answer signature as checked or deferred (TLS).
# Timing figures are the benchmark's (docs/BENCHMARKS.md), not asserted here.
# Needs root (network namespaces).
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
KV_BUILD=${KV_BUILD:-$(dirname "$KV")}
dir=$(mktemp -d -t kvasir-wancost.XXXXXX)
fail() {
  echo "FAIL: $*" >&2
  for f in "$dir"/*.err; do [ -s "$f" ] && { echo "--- $f" >&2; tail -5 "$f" >&2; }; done
  exit 1
}
. "$SRC/tests/netns_wan.sh"
. "$SRC/bench/wan_lib.sh"
trap 'wcm_worker_stop; wcm_xfer_stop; wan_cleanup; rm -rf "$dir"' EXIT
wan_available || fail "needs root and network namespaces"

EMBD=256 K=2 LAYERS=2
wcm_model "$LAYERS" "--embd $EMBD --ff-exp 64 --experts 8 --experts-used $K --heads 4 --kv-heads 2 --head-dim 64 --vocab 600"
wcm_worker_local
for enc in f32:4 f16:2; do
  w=${enc%:*} sz=${enc#*:}
  for S in 1 2; do
    j=$(wcm_bench env -- 4 "$S" "$w")
    req=$((16 + 20 + S * EMBD * sz + 8 * S * K))
    resp=$((16 + 12 + S * K * EMBD * sz + 64))
    got=$(jq -r '"\(.bytes_sent_per_round) \(.bytes_recv_per_round) \(.rounds_per_step)"' <<<"$j")
    read -r greq gresp grounds <<<"$got"
    awk -v a="$greq" -v b="$req" 'BEGIN { exit !(a == b) }' || fail "$w S=$S: $greq bytes per COMPUTE, PROTOCOL.md says $req"
    awk -v a="$gresp" -v b="$resp" 'BEGIN { exit !(a == b) }' || fail "$w S=$S: $gresp bytes per RESULT, PROTOCOL.md says $resp"
    awk -v a="$grounds" -v b="$LAYERS" 'BEGIN { exit !(a == b) }' || fail "$w S=$S: $grounds rounds per token, want $LAYERS"
    # every signed answer of the timed phase (one worker: one per round) is either
    # checked on arrival or, over TLS, taken unchecked (docs/PROTOCOL.md "Signed
    # results": 1 in 16 checked after the connection's first, so of 8 answers at
    # least one is deferred but with probability 16^-8)
    read -r sc sd <<<"$(jq -r '"\(.sigs_checked) \(.sigs_deferred)"' <<<"$j")"
    [ "$((sc + sd))" = "$((LAYERS * 4))" ] || fail "$w S=$S: $sc + $sd answer signatures, $((LAYERS * 4)) answers"
    [ "$sd" -ge 1 ] || fail "$w S=$S: over TLS no answer signature was deferred ($sc checked)"
    echo "ok: $w, $S per step: COMPUTE $greq and RESULT $gresp bytes (PROTOCOL.md), $grounds rounds per token, signatures $sc checked + $sd deferred"
  done
done
wcm_worker_stop

# the model itself, on numbers worked by hand: 10 Mbit/s, one 8260-byte
# request (one record, 6 packets) and one 32860-byte answer (3 records, 23
# packets), 8 rounds at 40 ms over 10 ms of compute
p=$(wcm_predict 0.010 8 8260 32860 40 10000)
want=$(awk 'BEGIN { req = 8260 + 22 + 52 * 6; resp = 32860 + 66 + 52 * 23; printf "%.6f", 0.010 + 8 * (0.040 + (req + resp) * 8 / 1e7) }')
[ "$p" = "$want" ] || fail "wcm_predict gives $p, by hand $want"
echo "ok: the cost model's formula: $p s per token (by hand $want)"
# the line's own cost per crossing (docs/WAN.md): the larger of it and the
# bytes' time at the rate counts. Unlimited: 8 x 0.39 ms; 10 Mbit/s: the rate's
# 34.17 ms a crossing hides the line's 0.39
p=$(wcm_predict 0.010 8 8260 32860 40 0 0.39)
[ "$p" = 0.333120 ] || fail "wcm_predict with a 0.39 ms line, unlimited: $p, by hand 0.333120"
p=$(wcm_predict 0.010 8 8260 32860 40 10000 0.39)
[ "$p" = "$want" ] || fail "wcm_predict with a 0.39 ms line at 10 Mbit/s: $p, by hand $want"
[ "$(wcm_line_ms 0.52 0.03 0.07)" = 0.4200 ] || fail "wcm_line_ms 0.52 0.03 0.07: $(wcm_line_ms 0.52 0.03 0.07)"
[ "$(wcm_line_ms 0.05 0.03 0.07)" = 0.0000 ] || fail "wcm_line_ms below zero: $(wcm_line_ms 0.05 0.03 0.07)"
echo "ok: the line's cost per crossing: the larger of it and the rate's time"

WAN_LAYERS=$LAYERS WAN_SHAPE="--embd $EMBD --ff-exp 64 --experts 8 --experts-used $K --heads 4 --kv-heads 2 --head-dim 64 --vocab 600" \
  WAN_RTTS="0 20" WAN_RATES="0 10000" WAN_GEN=3 WAN_PARALLEL="1 2" WAN_WIRES="f32 f16" WAN_BATCH_RTT=20 \
  WAN_JSON="$dir/rows.jsonl" bash "$SRC/bench/wan.sh" "$KV_BUILD" >"$dir/bench.out" 2>"$dir/bench.err" ||
  { cat "$dir/bench.out"; fail "bench/wan.sh failed"; }
cat "$dir/bench.out"
[ "$(jq -s '[.[] | select(.kind == "decode")] | length' "$dir/rows.jsonl")" = 4 ] || fail "not 4 decode rows"
[ "$(jq -s '[.[] | select(.kind == "batch")] | length' "$dir/rows.jsonl")" = 4 ] || fail "not 4 batched rows"
jq -e -s --argjson l "$LAYERS" 'all(.[] | select(.kind == "decode"); .measured_s >= $l * .rtt_ms / 1000 and .predicted_s > 0 and .line_ms >= 0)' \
  "$dir/rows.jsonl" >/dev/null || fail "a row beats its round trips: $(cat "$dir/rows.jsonl")"
jq -e -s 'all(.[] | select(.kind == "batch"); .step_s >= 0.020)' "$dir/rows.jsonl" >/dev/null ||
  fail "a batched step beats its round trip"
echo "ok: bench/wan.sh wrote its rows; none beats its round trips"
