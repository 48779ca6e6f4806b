#!/usr/bin/env bash
# Where the cost model's delayed rows lose 5-13% on fast links (docs/WAN.md
# "Checked against the test bed"): the model adds ping's mean round trip per
# crossing; this measures what a crossing's bytes actually take through the
# same line, with no kvasir in the path. Two namespaces joined by the line
# of tests/netns_wan.sh (kv-netdelay where the kernel has no netem), at each
# round trip of WX_RTTS; for each, ping's mean (as the bench takes it), then
# a plain-TCP request/answer echo (TCP_NODELAY, as kvasir's dispatch) of
#   small     64 B / 64 B (one packet each way: what ping measures, over TCP)
#   crossing  8,260 B / 32,860 B (bench/wan.sh's COMPUTE and RESULT: 6 and
#             23 packets)
# printing per round: the time, and the answering side's TCP congestion
# window (TCP_INFO snd_cwnd, in packets) just before it writes the answer;
# summarized as mean, p10/p50/p90 and the share of rounds over 1.5 x ping;
# then kvasir itself: bench/wan.sh's model (qwen3moe, 8 layers, embd 2048, 16
# experts top-4 of 128, q8_0), `kvasir bench` in namespace 0 and one worker
# of every expert in namespace 1: what the delay adds per crossing (the time
# per token less the same bed's at 0 ms, over the crossings) against what
# ping says it adds (ping less ping at 0 ms), as bench/wan_sites.sh predicts. All of it once for each TCP
# congestion control of WX_CCS, set with sysctl inside the two namespaces
# only (new sockets take it; the worker is restarted under each).
# WX_SSAI=0 also reruns the crossing echo with
# net.ipv4.tcp_slow_start_after_idle=0 in both namespaces.
#
#   sudo bash bench/wan_excess.sh build   (WX_RTTS "0 10 40", WX_N 100 rounds,
#                                          WX_GAP_MS 1: each side's idle per round,
#                                          WX_CCS "bbr reno", WX_GEN 16)
set -euo pipefail
build=${1:-build}
KV=$(cd "$build" && pwd)/kvasir
KV_BUILD=$(dirname "$KV")
SRC=$(cd "$(dirname "$0")/.." && pwd)
dir=$(mktemp -d "${TMPDIR:-/tmp}/kv_bench_wanexcess.XXXXXX")
. "$SRC/tests/netns_wan.sh"
. "$SRC/bench/wan_lib.sh"
trap 'wcm_worker_stop; wan_cleanup; kill $(jobs -p) 2>/dev/null || true; rm -rf "$dir"' EXIT
fail() {
  echo "FAIL: $*" >&2
  exit 1
}
wan_available || fail "needs root and network namespaces"
RTTS=${WX_RTTS:-0 10 40}
N=${WX_N:-100}
CCS=${WX_CCS:-bbr reno}
GEN=${WX_GEN:-16}
GAP=${WX_GAP_MS:-1}

PY='
import socket, struct, sys, time
mode, host, breq, bresp, gap = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]) / 1000
def readn(c, n):
    got = 0
    while got < n:
        b = c.recv(min(1 << 20, n - got))
        if not b: return False
        got += len(b)
    return True
def cwnd(c):  # struct tcp_info: 8 bytes of u8 fields, then u32s; snd_cwnd at 80, total_retrans at 100
    ti = c.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    return struct.unpack_from("<I", ti, 80)[0], struct.unpack_from("<I", ti, 100)[0]
if mode == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0)); s.listen(4); print("listening", s.getsockname()[1], flush=True)
    out = b"r" * bresp
    while True:
        c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        log = []
        while readn(c, breq):
            time.sleep(gap); log.append(cwnd(c)); c.sendall(out)
        print(" ".join("%d/%d" % x for x in log), flush=True)
        c.close()
else:
    n = int(sys.argv[6]); port = int(sys.argv[7])
    c = socket.create_connection((host, port)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = b"q" * breq
    for i in range(n + 10):
        time.sleep(gap)
        t = time.perf_counter(); c.sendall(msg)
        if not readn(c, bresp): sys.exit("echo closed")
        if i >= 10: print("%.4f" % (1000 * (time.perf_counter() - t)))
'
ping_ms() {
  wan_exec 0 ping -n -q -c 20 -i 0.02 -W 2 "${WAN_IP[1]}" 2>/dev/null | sed -n 's|^rtt min/avg/max/mdev = [0-9.]*/\([0-9.]*\)/.*|\1|p'
}
echo_run() { # NAME BREQ BRESP PING: one echo of N rounds, summarized
  local name=$1 breq=$2 bresp=$3 ping=$4 port
  wan_exec 1 python3 -c "$PY" server "${WAN_IP[1]}" "$breq" "$bresp" "$GAP" >"$dir/srv.out" 2>"$dir/srv.err" &
  local spid=$!
  for _ in $(seq 200); do
    port=$(sed -n 's/^listening //p' "$dir/srv.out" 2>/dev/null)
    [ -n "$port" ] && break
    sleep 0.02
  done
  [ -n "$port" ] || fail "echo server: $(cat "$dir/srv.err")"
  wan_exec 0 python3 -c "$PY" client "${WAN_IP[1]}" "$breq" "$bresp" "$GAP" "$N" "$port" >"$dir/times" ||
    fail "echo client"
  for _ in $(seq 100); do [ "$(wc -l <"$dir/srv.out")" -ge 2 ] && break; sleep 0.05; done
  kill "$spid" 2>/dev/null || true
  wait "$spid" 2>/dev/null || true
  sed -n 2p "$dir/srv.out" | tr ' ' '\n' | tail -n "$N" >"$dir/cw"
  python3 - "$name" "$ping" "$dir/times" "$dir/cw" <<'EOF'
import sys
name, ping = sys.argv[1], float(sys.argv[2])
t = [float(x) for x in open(sys.argv[3]).read().split()]
cw = [tuple(int(v) for v in x.split("/")) for x in open(sys.argv[4]).read().split()]
m = len(t); s = sorted(t); c = sorted(x[0] for x in cw) or [0]
slow = sum(1 for x in t if ping > 1 and x > 1.5 * ping)
print("%-22s %8.2f %8.2f %8.2f %8.2f %7.1f%% %8.2f   cwnd %d..%d, retransmits %d" % (name, sum(t) / m,
      s[m // 10], s[m // 2], s[m * 9 // 10], 100.0 * slow / m, sum(t) / m - ping, c[0], c[-1], cw[-1][1] if cw else 0))
EOF
}

echo "CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -n1), $(nproc) threads; load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "host's congestion control: $(sysctl -n net.ipv4.tcp_congestion_control) (the namespaces' default)"
wcm_model 8 "--embd 2048 --ff-exp 128 --experts 16 --experts-used 4 --heads 16 --kv-heads 4 --head-dim 128 --vocab 2000"
wcm_worker_local
read -r T_C ROUNDS BREQ BRESP < <(wcm_calibrate "$GEN") # the bytes and crossings
wcm_worker_stop
echo "kvasir on loopback: $(awk -v t="$T_C" 'BEGIN { printf "%.2f", t * 1000 }') ms per token, $ROUNDS crossings," \
  "$BREQ B out and $BRESP B back per crossing"
wan_setup 2 0
echo "line: $WAN_MECH; $N rounds per echo, each side idle $GAP ms per round"
for cc in $CCS; do
  for i in 0 1; do wan_exec "$i" sysctl -q -w net.ipv4.tcp_congestion_control="$cc" || fail "no congestion control $cc"; done
  wcm_worker_ns 1
  echo
  echo "== congestion control $cc"
  printf "%-22s %8s %8s %8s %8s %8s %8s\n" "echo (req/answer B)" "mean ms" p10 p50 p90 ">1.5 ping" "mean-ping"
  for rtt in $RTTS; do
    wan_line "$(awk -v r="$rtt" 'BEGIN { print r / 2 }')"
    p=$(ping_ms)
    echo "-- $rtt ms set: ping mean $p ms"
    echo_run "small 64/64" 64 64 "$p"
    echo_run "crossing $BREQ/$BRESP" "$BREQ" "$BRESP" "$p"
    if [ "${WX_SSAI:-1}" = 0 ]; then
      for i in 0 1; do wan_exec "$i" sysctl -q -w net.ipv4.tcp_slow_start_after_idle=0; done
      echo_run "crossing, no SSAI" "$BREQ" "$BRESP" "$p"
      for i in 0 1; do wan_exec "$i" sysctl -q -w net.ipv4.tcp_slow_start_after_idle=1; done
    fi
    t=$(wcm_measure "$GEN" 1 f32)
    if [ "$rtt" = 0 ]; then
      T0=$t P0=$p
      awk -v t="$t" 'BEGIN { printf "%-22s %8.2f ms per token (t_0)\n", "kvasir bench", t * 1000 }'
    elif [ -n "${T0:-}" ]; then # per crossing: what the delay added to a token, against what ping says it adds
      awk -v t="$t" -v t0="$T0" -v x="$ROUNDS" -v p="$p" -v p0="$P0" 'BEGIN { c = (t - t0) * 1000 / x; d = p - p0
        printf "%-22s %8.2f ms per token; per crossing %.2f ms over t_0, ping %.2f over its 0 ms: %+.2f ms (%+.1f%%)\n",
          "kvasir bench", t * 1000, c, d, c - d, 100 * (c - d) / d }'
    else
      awk -v t="$t" 'BEGIN { printf "%-22s %8.2f ms per token (no 0 ms row to compare)\n", "kvasir bench", t * 1000 }'
    fi
  done
  wcm_worker_stop
done
