# The WAN cost model's pieces (sourced by bench/wan.sh and
# tests/test_wan_cost.sh; needs KV, dir, and tests/netns_wan.sh sourced).
#
#   wcm_model LAYERS SHAPE      a q8_0 qwen3moe model, sliced: $dir/sl (experts),
#                               $dir/co (the coordinator's backbone and manifest)
#   wcm_worker_local            a worker of every expert on loopback (WCM_ADDR)
#   wcm_worker_ns I             the same in namespace I at WAN_IP[I]:7800
#   wcm_worker_stop             stops it
#   wcm_calibrate GEN           "T_C ROUNDS BYTES_REQ BYTES_RESP": the loopback run's
#                               seconds per token, expert round trips per token and
#                               bytes of one request and one answer
#   wcm_measure GEN S WIRE      seconds per decode step (S sequences, WIRE encoding)
#                               from namespace 0 to the worker (best of 2)
#   wcm_predict T_C ROUNDS BREQ BRESP RTT_MS RATE_KBIT
#                               the model's seconds per token (docs/WAN.md)
#   wcm_rate_name KBIT          "unlimited", "10 Mbit/s", ...
#   wcm_ping_ms FROM TO         the path's mean round trip as ping measures it (20 small
#                               pings), ms: the model's rtt input, as a user would measure it
WCM_ADDR=""
WCM_PID=""
WCM_MSS=1448     # TCP payload per packet (MTU 1500, IPv4 and TCP with timestamps)
WCM_PKT_OVH=52   # IPv4 (20) + TCP with timestamps (32) per packet
WCM_TLS_OVH=22   # a TLS 1.3 record: 5 header + 1 content type + 16 tag
WCM_TLS_REC=16384

wcm_model() {
  local layers=$1 shape=$2
  "$KV" gen-model --arch qwen3moe --out "$dir/m.gguf" --layers "$layers" $shape --type q8_0 --seed 1 >/dev/null 2>&1 ||
    fail "gen-model failed"
  "$KV" slice "$dir/m.gguf" --out "$dir/sl" >/dev/null 2>&1 || fail "slice failed"
  mkdir -p "$dir/co"
  cp "$dir/sl/backbone.gguf" "$dir/sl/manifest.json" "$dir/co/"
  WCM_PK=$("$KV" key --key "$dir/coord.key")
}

wcm_worker_start() { # WRAP... -- LISTEN
  local wrap=() listen
  while [ "$1" != -- ]; do wrap+=("$1"); shift; done
  listen=$2
  rm -f "$dir/worker.out"
  "${wrap[@]}" "$KV" worker --slabs "$dir/sl/experts" --listen "$listen" --threads 1 --quiet \
    --allow-key "$WCM_PK" >"$dir/worker.out" 2>"$dir/worker.err" &
  WCM_PID=$!
  for _ in $(seq 300); do
    WCM_ADDR=$(sed -n 's/^listening on //p' "$dir/worker.out" 2>/dev/null | head -1)
    [ -n "$WCM_ADDR" ] && return 0
    kill -0 "$WCM_PID" 2>/dev/null || break
    sleep 0.02
  done
  cat "$dir/worker.err" >&2
  fail "the worker did not start"
}
wcm_worker_local() { wcm_worker_start env -- 127.0.0.1:0; }
wcm_worker_ns() { wcm_worker_start ip netns exec "${WAN_NS[$1]}" -- "${WAN_IP[$1]}:7800"; }
wcm_worker_stop() {
  [ -n "$WCM_PID" ] && { kill "$WCM_PID" 2>/dev/null || true; wait "$WCM_PID" 2>/dev/null || true; }
  WCM_PID=""
}

wcm_bench() { # WRAP... -- GEN S WIRE: kvasir bench --json from inside WRAP
  local wrap=()
  while [ "$1" != -- ]; do wrap+=("$1"); shift; done
  "${wrap[@]}" "$KV" bench -m "$dir/co/manifest.json" --worker "$WCM_ADDR" --key "$dir/coord.key" -p 8 -n "$2" \
    --parallel "$3" --wire "$4" --reps 2 --threads 1 --json 2>"$dir/bench.err" || {
    cat "$dir/bench.err" >&2
    fail "kvasir bench failed"
  }
}

wcm_calibrate() {
  local j
  j=$(wcm_bench env -- "$1" 1 f32)
  jq -r '"\(1 / .decode_tok_s_best) \(.rounds_per_step) \(.bytes_sent_per_round) \(.bytes_recv_per_round)"' <<<"$j"
}

wcm_measure() {
  local j
  j=$(wcm_bench ip netns exec "${WAN_NS[0]}" -- "$1" "$2" "$3")
  jq -r --argjson s "$2" '$s / .decode_tok_s_best' <<<"$j"
}

wcm_predict() {
  awk -v tc="$1" -v rounds="$2" -v breq="$3" -v bresp="$4" -v rtt="$5" -v rate="$6" \
    -v mss="$WCM_MSS" -v povh="$WCM_PKT_OVH" -v tovh="$WCM_TLS_OVH" -v trec="$WCM_TLS_REC" '
    function ceil(x) { return x == int(x) ? x : int(x) + 1 }
    function onwire(b,   tls) { tls = b + tovh * ceil(b / trec); return tls + povh * ceil(tls / mss) }
    BEGIN {
      ser = rate > 0 ? (onwire(breq) + onwire(bresp)) * 8 / (rate * 1000) : 0
      printf "%.6f\n", tc + rounds * (rtt / 1000 + ser)
    }'
}

wcm_rate_name() {
  awk -v r="$1" 'BEGIN {
    if (r == 0) print "unlimited"; else if (r >= 1000000) printf "%g Gbit/s\n", r / 1000000;
    else if (r >= 1000) printf "%g Mbit/s\n", r / 1000; else printf "%g kbit/s\n", r }'
}

wcm_ping_ms() {
  ip netns exec "${WAN_NS[$1]}" ping -n -q -c 20 -i 0.02 -W 2 "${WAN_IP[$2]}" 2>/dev/null |
    sed -n 's|^rtt min/avg/max/mdev = [0-9.]*/\([0-9.]*\)/.*|\1|p'
}
