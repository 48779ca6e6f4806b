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
#   wcm_predict T_C ROUNDS BREQ BRESP RTT_MS RATE_KBIT [LINE_MS]
#                               the model's seconds per token (docs/WAN.md); LINE_MS
#                               (default 0) is the line's own time to carry one
#                               crossing's bytes (wcm_line_ms)
#   wcm_xfer_ms NS HOST BREQ BRESP GAP_MS
#                               the mean round trip (ms) of a BREQ-byte message and its
#                               BRESP-byte answer over TCP from namespace NS (or "-": this
#                               one) to a wcm_xfer_server at HOST (WCM_XADDR), 20 warm-up
#                               rounds then WCM_XFER_N (300), the mean of the middle 90%;
#                               each side idles GAP_MS before it writes (the line goes
#                               idle between crossings as in a decode, and wakes up for
#                               each message), the server's idle inside the round trip
#   wcm_xfer_server NS HOST BREQ BRESP GAP_MS   starts that echo in namespace NS on HOST,
#                               a free port (WCM_XPID, WCM_XADDR "HOST,PORT"); wcm_xfer_stop
#   wcm_line_ms LINE LOOP PING  the line's fixed cost of one crossing: a request and
#                               answer's round trip through the line at 0 ms (LINE) less
#                               the same on loopback with the same gaps (LOOP: the gap and
#                               the loopback part, in t_compute already) less ping's round
#                               trip through the line at 0 ms (PING: the model's rtt has
#                               it already); 0 when negative
#   wcm_rate_name KBIT          "unlimited", "10 Mbit/s", ...
#   wcm_ping_ms FROM TO         the path's mean round trip as ping measures it (20 small
#                               pings), ms: the model's rtt input, as a user would measure it
WCM_ADDR=""
WCM_PID=""
WCM_XPID=""
WCM_XADDR=""
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
  awk -v tc="$1" -v rounds="$2" -v breq="$3" -v bresp="$4" -v rtt="$5" -v rate="$6" -v line="${7:-0}" \
    -v mss="$WCM_MSS" -v povh="$WCM_PKT_OVH" -v tovh="$WCM_TLS_OVH" -v trec="$WCM_TLS_REC" '
    function ceil(x) { return x == int(x) ? x : int(x) + 1 }
    function onwire(b,   tls) { tls = b + tovh * ceil(b / trec); return tls + povh * ceil(tls / mss) }
    BEGIN {
      ser = rate > 0 ? (onwire(breq) + onwire(bresp)) * 8 / (rate * 1000) : 0
      if (line / 1000 > ser) ser = line / 1000  # the line carries a crossing no faster than it can
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

# A request/answer echo over plain TCP (the bytes of a crossing, without the
# dispatch's TLS and compute: what the line adds to a crossing of that size).
WCM_XFER_PY='
import socket, sys, time
mode, host, breq, bresp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
gap = float(sys.argv[5]) / 1000  # each side idles this long before it writes, as a compute would
host, _, port = host.partition(",")
def readn(c, n):
    got = 0
    while got < n:
        b = c.recv(min(1 << 20, n - got))
        if not b: return False
        got += len(b)
    return True
if mode == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0)); s.listen(4); print("listening", s.getsockname()[1], flush=True)
    while True:
        c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = b"r" * bresp
        while readn(c, breq):
            time.sleep(gap); c.sendall(out)
        c.close()
else:
    n = int(sys.argv[6])
    c = socket.create_connection((host, int(port))); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = b"q" * breq
    ts = []
    for i in range(n + 20):
        time.sleep(gap)
        t = time.perf_counter(); c.sendall(msg)
        if not readn(c, bresp): sys.exit("echo closed")
        if i >= 20: ts.append(time.perf_counter() - t)
    ts.sort(); k = len(ts) // 20; ts = ts[k:len(ts) - k]  # the middle 90%: a descheduled round is not the line
    print("%.4f" % (1000 * sum(ts) / len(ts)))
'
wcm_xfer_server() {
  local wrap=(env)
  [ "$1" != - ] && wrap=(ip netns exec "${WAN_NS[$1]}")
  rm -f "$dir/xfer.out"
  "${wrap[@]}" python3 -c "$WCM_XFER_PY" server "$2" "$3" "$4" "${5:-0}" >"$dir/xfer.out" 2>"$dir/xfer.err" &
  WCM_XPID=$!
  for _ in $(seq 200); do
    WCM_XADDR=$(sed -n 's/^listening /'"$2"',/p' "$dir/xfer.out" 2>/dev/null)
    [ -n "$WCM_XADDR" ] && return 0
    sleep 0.02
  done
  cat "$dir/xfer.err" >&2
  fail "the echo did not start"
}
wcm_xfer_stop() {
  [ -n "$WCM_XPID" ] && { kill "$WCM_XPID" 2>/dev/null || true; wait "$WCM_XPID" 2>/dev/null || true; }
  WCM_XPID=""
}
wcm_xfer_ms() {
  local wrap=(env)
  [ "$1" != - ] && wrap=(ip netns exec "${WAN_NS[$1]}")
  "${wrap[@]}" python3 -c "$WCM_XFER_PY" client "$2" "$3" "$4" "${5:-0}" "${WCM_XFER_N:-300}" 2>>"$dir/xfer.err" ||
    { cat "$dir/xfer.err" >&2; fail "the echo round trips failed"; }
}
wcm_line_ms() {
  awk -v l="$1" -v o="$2" -v p="$3" 'BEGIN { x = l - o - p; printf "%.4f\n", (x > 0 ? x : 0) }'
}
