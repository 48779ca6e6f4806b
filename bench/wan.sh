#!/usr/bin/env bash
# `make bench-wan`: the WAN cost model of docs/WAN.md checked against the test
# bed. A coordinator (`kvasir bench` on a sliced model's backbone) in one
# network namespace, one expert worker holding every expert in another, the
# two joined by kv-netdelay (tests/netns_wan.sh) at each round trip of
# WAN_RTTS and each rate of WAN_RATES; decode time per token measured and
# predicted by the model:
#
#   t_token = t_compute + rounds * (rtt + max(wire(bytes_req) + wire(bytes_resp), t_line))
#
# rtt is the path's round trip as ping measures it just before the row (the
# line's setting plus what the delay line adds on a loaded machine: a user
# plugs in the round trip they measure, not a nominal one);
#   wire(b) = (b + 22 * frames + 52 * ceil(b / 1448)) * 8 / rate
#
# where t_compute (the coordinator's and the worker's compute and the
# per-call software cost) is measured in the same invocation with the worker
# on loopback, rounds (expert round trips per token) and the bytes of each
# request and answer are read from the same loopback run (`kvasir bench
# --json`: rounds_per_step, bytes_per_step), 22 bytes are a TLS 1.3 record's
# overhead and 52 bytes each TCP/IP packet's (MSS 1448 with timestamps).
# t_line is the line's own time to carry one crossing's bytes (kv-netdelay
# forwards each packet through two TUN devices in userspace: a request and an
# answer of tens of packets cost it more than one small ping), measured in the
# same run at 0 ms: the round trip of a request-sized message and an
# answer-sized one over plain TCP through the line, each side idle for half a
# crossing's share of t_compute before it writes (the line sleeps between
# crossings in a decode, and its wake-ups are part of its cost), less the same
# on loopback (already in t_compute), less ping's round trip through the line
# at 0 ms (already in rtt). A link carries
# a crossing at the slower of its rate and the line's own pace, so the larger
# of the two times counts, not their sum.
# Nothing of the delayed runs feeds the prediction.
#
# Then aggregate decode tokens/s with 1, 4 and 16 sequences per step
# (continuous batching: one crossing carries every sequence's hidden state)
# on the hidden-state wire encodings f32, f16 and bf16 at one round trip and
# rate (WAN_BATCH_RTT, WAN_BATCH_RATE).
#
# Env: WAN_LAYERS (8), WAN_SHAPE (gen-model flags), WAN_RTTS ("0 10 40 80",
#      ms), WAN_RATES ("0 1000000 100000 10000", kbit/s, 0 = unlimited),
#      WAN_GEN (decode tokens per row, 8), WAN_PARALLEL ("1 4 16"),
#      WAN_WIRES ("f32 f16 bf16"), WAN_BATCH_RTT (40), WAN_BATCH_RATE (100000),
#      WAN_JSON (a file: every row as one JSON object per line).
# Needs root (network namespaces); not part of `make test` (its short version
# is tests/test_wan_cost.sh). Figures: docs/BENCHMARKS.md, docs/WAN.md.
set -euo pipefail
build=${1:-build}
KV=$(cd "$build" && pwd)/kvasir
KV_BUILD=$(dirname "$KV")
SRC=$(cd "$(dirname "$0")/.." && pwd)
dir=$(mktemp -d "${TMPDIR:-/tmp}/kv_bench_wan.XXXXXX")
. "$SRC/tests/netns_wan.sh"
. "$SRC/bench/wan_lib.sh"
trap 'wcm_xfer_stop; wan_cleanup; kill $(jobs -p) 2>/dev/null || true; rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
wan_available || fail "needs root and network namespaces"

LAYERS=${WAN_LAYERS:-8}
SHAPE=${WAN_SHAPE:---embd 2048 --ff-exp 128 --experts 16 --experts-used 4 --heads 16 --kv-heads 4 --head-dim 128 --vocab 2000}
RTTS=${WAN_RTTS:-0 10 40 80}
RATES=${WAN_RATES:-0 1000000 100000 10000}
GEN=${WAN_GEN:-8}
PAR=${WAN_PARALLEL:-1 4 16}
WIRES=${WAN_WIRES:-f32 f16 bf16}
BRTT=${WAN_BATCH_RTT:-40}
BRATE=${WAN_BATCH_RATE:-100000}
JSON_OUT=${WAN_JSON:-$dir/rows.jsonl}
: >"$JSON_OUT"

echo "CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -n1), $(nproc) threads; load average $(cut -d' ' -f1-3 /proc/loadavg)"
wcm_model "$LAYERS" "$SHAPE"
echo "model: qwen3moe, $LAYERS layers, $SHAPE, q8_0; $GEN decode tokens per row, best of 2"

# the loopback calibration: compute and software cost, rounds and bytes
wcm_worker_local
read -r T_C ROUNDS BREQ BRESP < <(wcm_calibrate "$GEN")
echo "loopback: $(awk -v t="$T_C" 'BEGIN { printf "%.2f", t * 1000 }') ms per token, $ROUNDS expert round trips per token," \
  "$BREQ bytes per request, $BRESP per answer"
wcm_worker_stop
# the line's own cost of a crossing: the echo with each side idle for half a
# crossing's share of the compute before it writes, on loopback and through
# the line at 0 ms
GAP=$(awk -v t="$T_C" -v r="$ROUNDS" 'BEGIN { printf "%.4f", (r > 0 ? t * 1000 / r / 2 : 0) }')
wcm_xfer_server - 127.0.0.1 "$BREQ" "$BRESP" "$GAP"
X_LOOP=$(wcm_xfer_ms - "$WCM_XADDR" "$BREQ" "$BRESP" "$GAP")
wcm_xfer_stop

wan_setup 2 0
wcm_xfer_server 1 "${WAN_IP[1]}" "$BREQ" "$BRESP" "$GAP"
X_LINE=$(wcm_xfer_ms 0 "$WCM_XADDR" "$BREQ" "$BRESP" "$GAP")
wcm_xfer_stop
X_PING=$(wcm_ping_ms 0 1)
[ -n "$X_PING" ] || fail "no ping across the line"
T_LINE=$(wcm_line_ms "$X_LINE" "$X_LOOP" "$X_PING")
wcm_worker_ns 1
echo "line: $WAN_MECH"
echo "line's cost of one crossing at 0 ms: a TCP echo of $BREQ + $BRESP bytes, each side idle $GAP ms before it writes:" \
  "$X_LINE ms through the line, $X_LOOP ms on loopback, ping $X_PING ms: t_line $T_LINE ms"
echo
echo "decode, one sequence: measured vs the cost model"
printf "%8s  %9s  %12s  %14s  %14s  %8s\n" "rtt ms" "ping ms" "rate" "measured ms" "predicted ms" "error"
worst=0
for rate in $RATES; do
  for rtt in $RTTS; do
    args=()
    [ "$rate" != 0 ] && args=(--rate-kbit "$rate")
    wan_line "$(awk -v r="$rtt" 'BEGIN { print r / 2 }')" "${args[@]}"
    pr=$(wcm_ping_ms 0 1)
    [ -n "$pr" ] || fail "no ping across the line"
    meas=$(wcm_measure "$GEN" 1 f32)
    pred=$(wcm_predict "$T_C" "$ROUNDS" "$BREQ" "$BRESP" "$pr" "$rate" "$T_LINE")
    err=$(awk -v m="$meas" -v p="$pred" 'BEGIN { printf "%.1f", 100 * (p - m) / m }')
    worst=$(awk -v w="$worst" -v e="$err" 'BEGIN { e = e < 0 ? -e : e; print (e > w ? e : w) }')
    printf "%8s  %9s  %12s  %14.2f  %14.2f  %7s%%\n" "$rtt" "$pr" "$(wcm_rate_name "$rate")" "$(awk -v m="$meas" 'BEGIN { print m * 1000 }')" \
      "$(awk -v p="$pred" 'BEGIN { print p * 1000 }')" "$err"
    jq -nc --argjson rtt "$rtt" --argjson ping "$pr" --argjson rate "$rate" --argjson m "$meas" --argjson p "$pred" \
      --argjson tl "$T_LINE" \
      '{kind: "decode", rtt_ms: $rtt, ping_ms: $ping, rate_kbit: $rate, line_ms: $tl, measured_s: $m, predicted_s: $p}' >>"$JSON_OUT"
  done
done
echo "worst error: ${worst}%"

echo
echo "aggregate decode tokens/s, S sequences per step, rtt $BRTT ms, $(wcm_rate_name "$BRATE"):"
args=()
[ "$BRATE" != 0 ] && args=(--rate-kbit "$BRATE")
wan_line "$(awk -v r="$BRTT" 'BEGIN { print r / 2 }')" "${args[@]}"
printf "%6s" S
for w in $WIRES; do printf "  %10s" "$w"; done
printf "  %18s\n" "predicted (f32)"
for S in $PAR; do
  printf "%6s" "$S"
  for w in $WIRES; do
    t=$(wcm_measure "$GEN" "$S" "$w")
    printf "  %10.1f" "$(awk -v t="$t" -v s="$S" 'BEGIN { print s / t }')"
    jq -nc --argjson rtt "$BRTT" --argjson rate "$BRATE" --argjson s "$S" --arg w "$w" --argjson t "$t" \
      '{kind: "batch", rtt_ms: $rtt, rate_kbit: $rate, parallel: $s, wire: $w, step_s: $t}' >>"$JSON_OUT"
  done
  p=$(wcm_predict "$T_C" "$ROUNDS" "$((BREQ * S))" "$((BRESP * S))" "$BRTT" "$BRATE" "$(awk -v l="$T_LINE" -v s="$S" 'BEGIN { print l * s }')")
  printf "  %18.1f\n" "$(awk -v p="$p" -v s="$S" 'BEGIN { print s / p }')"
done
echo "(predicted with S times the bytes, S times t_line and the one-sequence compute: an upper bound where compute grows with S)"
