# A WAN in network namespaces, for the tests and benchmarks that need a real
# delayed link between kernel TCP stacks (sourced; needs root). N namespaces,
# node i at 10.77.0.(i+1), every pair of them one configured one-way delay
# apart (so a round trip is twice it). Nothing is routed outside them: the
# namespaces have no link to the caller's namespace.
#
# The delay line, chosen by wan_setup (NETNS_WAN_MODE=auto, the default):
#   netem     when the kernel has sch_netem: every namespace has a veth on a
#             bridge (in a namespace of its own) and `tc netem` on its egress;
#   netdelay  otherwise: every namespace has a TUN device, and one kv-netdelay
#             process (tools/netdelay.c, in the caller's namespace, attached to
#             all of them) holds each packet for the delay before passing it on;
#   none      the veth/bridge topology with no delay (a baseline).
# WAN_MECH says in words which one runs.
#
#   wan_available             0 when namespaces can be made here (root, ip netns)
#   wan_setup N DELAY_MS [--jitter-ms J] [--loss-pct P] [--rate-kbit R] [--limit PKTS]
#                             sets WAN_NS[i], WAN_IP[i], WAN_MODE, WAN_MECH
#   wan_exec I CMD...         runs CMD in namespace I
#   wan_line DELAY_MS [opts]  the same topology with another delay line
#   wan_stats                 kv-netdelay's counters (JSON; netdelay mode only)
#   wan_ring_start MODEL WIN... one `kvasir ring` node per window, node i in
#                             namespace i at WAN_IP[i]:7700 (ring_support.sh)
#   wan_cleanup               kills what runs in the namespaces, deletes them
#                             (call it from an EXIT trap; safe to call twice)
# Needs KV_BUILD or KV (kv-netdelay is looked up next to the kvasir binary)
# and dir (a scratch folder). tests/netns_topo.sh builds the internet test bed
# (two sites, a NAT router) on these helpers.
WAN_NS=()
WAN_IP=()
WAN_MODE=""
WAN_MECH=""
WAN_PREFIX="kvw$$"
WAN_LINE_PID=""
WAN_OPTS=()

wan_available() {
  [ "$(id -u)" = 0 ] || return 1
  command -v ip >/dev/null 2>&1 || return 1
  ip netns add "${WAN_PREFIX}p" 2>/dev/null || return 1
  ip netns del "${WAN_PREFIX}p" 2>/dev/null
  return 0
}

# wan_has_netem: the kernel accepts a netem qdisc (probed in a scratch namespace)
wan_has_netem() {
  local ns="${WAN_PREFIX}p" ok=1
  ip netns add "$ns" 2>/dev/null || return 1
  ip netns exec "$ns" tc qdisc add dev lo root netem delay 1ms 2>/dev/null && ok=0
  ip netns del "$ns" 2>/dev/null
  return $ok
}

wan_fail() {
  echo "netns_wan: $*" >&2
  exit 1
}

# namespaces left by a run that was killed before its trap ran (its pid is gone)
wan_reap_stale() {
  local ns pid
  for ns in $(ip netns list 2>/dev/null | awk '{ print $1 }' | grep -E '^kvw[0-9]+([nhp][0-9]*|t[a-z0-9]+)$' || true); do
    pid=$(echo "$ns" | sed -E 's/^kvw([0-9]+).*/\1/')
    kill -0 "$pid" 2>/dev/null && continue
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
}

wan_netdelay_bin() {
  local b
  for b in "${KV_BUILD:-}/kv-netdelay" "$(dirname "${KV:-build/kvasir}")/kv-netdelay"; do
    [ -x "$b" ] && { echo "$b"; return 0; }
  done
  wan_fail "kv-netdelay not built (cmake --build build --target kv-netdelay)"
}

wan_setup() {
  local n=$1 i ns mode=${NETNS_WAN_MODE:-auto}
  shift
  wan_reap_stale
  WAN_NS=()
  WAN_IP=()
  if [ "$mode" = auto ]; then
    if wan_has_netem; then mode=netem; else mode=netdelay; fi
  fi
  case $mode in netem | netdelay | none) ;; *) wan_fail "NETNS_WAN_MODE=$mode: not auto, netem, netdelay or none" ;; esac
  WAN_MODE=$mode
  for ((i = 0; i < n; i++)); do
    ns="${WAN_PREFIX}n$i"
    WAN_NS+=("$ns")
    WAN_IP+=("10.77.0.$((i + 1))")
    ip netns add "$ns" || wan_fail "ip netns add $ns failed"
    ip -n "$ns" link set lo up
    # IPv4 only: no router solicitations or MLD reports on the link
    ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
  done
  if [ "$mode" = netdelay ]; then
    for ((i = 0; i < n; i++)); do
      ip -n "${WAN_NS[$i]}" tuntap add dev kvw0 mode tun || wan_fail "no TUN device in ${WAN_NS[$i]}"
      ip -n "${WAN_NS[$i]}" link set kvw0 mtu 1500 txqueuelen 4096 up
      ip -n "${WAN_NS[$i]}" addr add "${WAN_IP[$i]}/24" dev kvw0
    done
  else
    local hub="${WAN_PREFIX}h"
    WAN_NS+=("$hub") # deleted with the others; not a node
    ip netns add "$hub" || wan_fail "ip netns add $hub failed"
    ip -n "$hub" link add br0 type bridge
    ip -n "$hub" link set br0 up
    for ((i = 0; i < n; i++)); do
      ip -n "${WAN_NS[$i]}" link add kvw0 type veth peer name "p$i" netns "$hub" || wan_fail "no veth pair"
      ip -n "$hub" link set "p$i" master br0 up
      ip -n "${WAN_NS[$i]}" addr add "${WAN_IP[$i]}/24" dev kvw0
      ip -n "${WAN_NS[$i]}" link set kvw0 up
    done
  fi
  WAN_N=$n
  wan_line "$@"
}

# wan_line DELAY_MS [opts]: (re)starts the delay line of the topology
wan_line() {
  local delay=$1 i
  shift
  WAN_OPTS=("$@")
  case $WAN_MODE in
  netdelay)
    wan_line_stop
    local ports=()
    for ((i = 0; i < WAN_N; i++)); do ports+=(--port "${WAN_NS[$i]}:kvw0:${WAN_IP[$i]}/32"); done
    local bin
    bin=$(wan_netdelay_bin)
    rm -f "$dir/netdelay.out" # the last line's "ready" must not count for this one
    "$bin" "${ports[@]}" --delay-ms "$delay" "$@" >"$dir/netdelay.out" 2>"$dir/netdelay.err" &
    WAN_LINE_PID=$!
    for _ in $(seq 200); do
      grep -q '^ready' "$dir/netdelay.out" 2>/dev/null && break
      kill -0 "$WAN_LINE_PID" 2>/dev/null || { cat "$dir/netdelay.err" >&2; wan_fail "kv-netdelay did not start"; }
      sleep 0.02
    done
    grep -q '^ready' "$dir/netdelay.out" || wan_fail "kv-netdelay not ready"
    WAN_MECH="a userspace delay line (kv-netdelay on TUN devices, this kernel has no sch_netem): ${delay} ms one way${*:+, $*}"
    ;;
  netem)
    local q=(delay "${delay}ms") more=()
    while [ $# -gt 0 ]; do
      case $1 in
      --jitter-ms) q+=("$2ms") ;; # right after the delay, so set once
      --loss-pct) more+=(loss "$2%") ;;
      --rate-kbit) more+=(rate "$2kbit") ;;
      --limit) more+=(limit "$2") ;;
      --seed) ;; # kv-netdelay's PRNG; netem draws its own
      *) wan_fail "wan_line: unknown option $1" ;;
      esac
      shift 2
    done
    q+=("${more[@]}")
    for ((i = 0; i < WAN_N; i++)); do
      ip netns exec "${WAN_NS[$i]}" tc qdisc replace dev kvw0 root netem "${q[@]}" || wan_fail "tc netem failed"
    done
    WAN_MECH="tc netem ${q[*]} on every namespace's veth (a bridge between them)"
    ;;
  none)
    [ "$delay" = 0 ] && [ $# = 0 ] || wan_fail "mode none has no delay line"
    WAN_MECH="veth pairs on a bridge, no delay"
    ;;
  esac
}

wan_line_stop() {
  if [ -n "$WAN_LINE_PID" ]; then
    kill "$WAN_LINE_PID" 2>/dev/null || true
    wait "$WAN_LINE_PID" 2>/dev/null || true
    WAN_LINE_PID=""
  fi
}

# wan_stats: the line's counters now (one JSON object)
wan_stats() {
  [ "$WAN_MODE" = netdelay ] || wan_fail "wan_stats: only kv-netdelay counts"
  local before
  before=$(grep -c '^{' "$dir/netdelay.out" || true)
  kill -USR1 "$WAN_LINE_PID"
  for _ in $(seq 100); do
    [ "$(grep -c '^{' "$dir/netdelay.out" || true)" -gt "$before" ] && break
    sleep 0.01
  done
  grep '^{' "$dir/netdelay.out" | tail -n 1
}

wan_exec() {
  local i=$1
  shift
  ip netns exec "${WAN_NS[$i]}" "$@"
}

# wan_ring_start MODEL WINDOW...: node i in namespace i, listening on
# WAN_IP[i]:7700, its successor the next namespace's node (RING_EXTRA: more
# flags). Needs ring_support.sh (keys, RING_PID, ring_wait_whole).
wan_ring_start() {
  local model=$1 i
  shift
  local wins=("$@") n=$#
  [ "$n" -le "$WAN_N" ] || wan_fail "wan_ring_start: $n windows, $WAN_N namespaces"
  [ -s "$dir/allow" ] || ring_keys
  RING_ADDR=()
  RING_PID=()
  for ((i = 0; i < n; i++)); do
    ip netns exec "${WAN_NS[$i]}" "$KV" ring -m "$model" --layers "${wins[$i]}" --listen "${WAN_IP[$i]}:7700" \
      --next "${WAN_IP[$(((i + 1) % n))]}:7700" --threads 1 --key "$dir/k$((i % 10)).key" --allow-key "$dir/allow" \
      ${RING_EXTRA:-} >"$dir/ring$i.out" 2>"$dir/ring$i.err" &
    RING_PID[$i]=$!
    RING_ALL+=($!)
    RING_ADDR[$i]="${WAN_IP[$i]}:7700"
  done
  ring_wait_whole
}

wan_cleanup() {
  local ns
  wan_line_stop
  for ns in "${WAN_NS[@]}"; do
    # whatever still runs inside (started by this script) dies with its namespace
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  WAN_NS=()
}
