# The WAN test bed of issue 30 in network namespaces (sourced; needs root,
# nft). Builds on tests/netns_wan.sh (source that first) and kv-netdelay's
# per-pair delay table. docs/NETDELAY.md "The WAN test bed" draws it:
#
#   site A (the hub's datacentre)        site B (another city)
#     hub    10.77.1.1                     b1      10.77.2.1
#     a1     10.77.1.2                     router  10.77.2.254 (public side)
#     a2     10.77.1.3                       | lan0 192.168.7.1, masquerades
#                                          nat     192.168.7.2 (home LAN, veth)
#
# Every public host has a TUN device kvw0 with its address in 10.77.0.0/16,
# all attached to one kv-netdelay, whose table puts hosts of one site
# TOPO_SITE_MS apart one way and the sites TOPO_LONG_MS apart, with
# TOPO_LONG_LOSS percent loss each way on the long link. The home LAN is a
# plain veth pair (no delay). The router forwards and masquerades what leaves
# by kvw0 (nftables); from the public side it takes only replies
# (ct state established,related) and pings, and drops the rest, so `nat` can open
# connections outwards and nothing can reach it inwards: no public host has a
# route to 192.168.7.0/24, and kv-netdelay has no port for it either.
#
#   topo_setup                builds it; sets TOPO_NS[name], TOPO_IP[name],
#                             TOPO_SITE[name], TOPO_HOSTS (names, in order)
#   topo_exec NAME CMD...     runs CMD in host NAME's namespace
#   topo_bg NAME OUT CMD...   the same in the background, stdout/err to OUT(.err);
#                             the pid in TOPO_BG_PID (killed with the namespaces)
#   topo_rtt_ms A B           the round trip A -> B that the table sets, ms
#   topo_stats                kv-netdelay's counters (JSON, with per-lane counts)
#   topo_port_index NAME      NAME's port index in kv-netdelay (its "lanes")
#   topo_cleanup              kills what runs inside, deletes the namespaces
#                             and the delay line (EXIT trap; safe to call twice)
# Needs KV_BUILD or KV (kv-netdelay is found next to kvasir) and dir.
TOPO_SITE_MS=${TOPO_SITE_MS:-1.5}
TOPO_LONG_MS=${TOPO_LONG_MS:-20}
TOPO_LONG_LOSS=${TOPO_LONG_LOSS:-0.5}
TOPO_SEED=${TOPO_SEED:-1}
TOPO_HOSTS=(hub a1 a2 b1 router nat)
declare -gA TOPO_NS=() TOPO_IP=() TOPO_SITE=()
TOPO_PUBLIC=(hub a1 a2 b1 router) # the ports of the delay line, in this order
TOPO_LAN=192.168.7.0/24
TOPO_LINE_PID=""
TOPO_BG_ALL=()

topo_fail() {
  echo "netns_topo: $*" >&2
  exit 1
}

topo_setup() {
  command -v nft >/dev/null 2>&1 || topo_fail "nft not installed (apt-get install nftables; tools/install-deps.sh)"
  wan_reap_stale
  TOPO_IP=([hub]=10.77.1.1 [a1]=10.77.1.2 [a2]=10.77.1.3 [b1]=10.77.2.1 [router]=10.77.2.254 [nat]=192.168.7.2)
  TOPO_SITE=([hub]=A [a1]=A [a2]=A [b1]=B [router]=B [nat]=B)
  local h ns
  for h in "${TOPO_HOSTS[@]}"; do
    ns="${WAN_PREFIX}t$h"
    TOPO_NS[$h]=$ns
    ip netns add "$ns" || topo_fail "ip netns add $ns failed"
    WAN_NS+=("$ns") # wan_cleanup deletes it too
    ip -n "$ns" link set lo up
    ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1
  done
  # the public side: a TUN per host, the whole 10.77.0.0/16 on-link through it
  for h in "${TOPO_PUBLIC[@]}"; do
    ns=${TOPO_NS[$h]}
    ip -n "$ns" tuntap add dev kvw0 mode tun || topo_fail "no TUN device in $ns"
    ip -n "$ns" link set kvw0 mtu 1500 txqueuelen 4096 up
    ip -n "$ns" addr add "${TOPO_IP[$h]}/16" dev kvw0
  done
  # the home LAN: router <-> nat, a veth pair; nat's only route is the router
  local r=${TOPO_NS[router]} n=${TOPO_NS[nat]}
  ip -n "$r" link add lan0 type veth peer name lan0 netns "$n" || topo_fail "no veth pair"
  ip -n "$r" addr add 192.168.7.1/24 dev lan0
  ip -n "$r" link set lan0 up
  ip -n "$n" addr add 192.168.7.2/24 dev lan0
  ip -n "$n" link set lan0 up
  ip -n "$n" route add default via 192.168.7.1
  ip netns exec "$r" sysctl -qw net.ipv4.ip_forward=1
  # a home router: masquerade outwards, take only replies inwards
  ip netns exec "$r" nft -f - <<'EOF' || topo_fail "nft rules refused in the router"
table ip kvhome {
  chain postrouting {
    type nat hook postrouting priority srcnat; policy accept;
    oifname "kvw0" masquerade
  }
  chain forward {
    type filter hook forward priority filter; policy drop;
    iifname "lan0" oifname "kvw0" accept
    iifname "kvw0" oifname "lan0" ct state established,related accept
  }
  chain input {
    type filter hook input priority filter; policy accept;
    iifname "kvw0" ct state established,related accept
    iifname "kvw0" icmp type echo-request accept
    iifname "kvw0" drop
  }
}
EOF
  topo_line
}

# topo_rtt_ms A B: the round trip between two hosts that the table sets
topo_rtt_ms() {
  local one=$TOPO_LONG_MS
  [ "${TOPO_SITE[$1]}" = "${TOPO_SITE[$2]}" ] && one=$TOPO_SITE_MS
  awk -v d="$one" 'BEGIN { print 2 * d }'
}

topo_port_index() {
  local i
  for i in "${!TOPO_PUBLIC[@]}"; do [ "${TOPO_PUBLIC[$i]}" = "$1" ] && { echo "$i"; return 0; }; done
  topo_fail "topo_port_index: $1 is not on the public side"
}

# topo_line [opts]: (re)starts the delay line with the table of the topology
topo_line() {
  local ports=() a b i j bin
  : >"$dir/topo.delays"
  for ((i = 0; i < ${#TOPO_PUBLIC[@]}; i++)); do
    a=${TOPO_PUBLIC[$i]}
    ports+=(--port "${TOPO_NS[$a]}:kvw0:${TOPO_IP[$a]}/32")
    for ((j = i + 1; j < ${#TOPO_PUBLIC[@]}; j++)); do
      b=${TOPO_PUBLIC[$j]}
      if [ "${TOPO_SITE[$a]}" = "${TOPO_SITE[$b]}" ]; then
        echo "$i $j $TOPO_SITE_MS # $a - $b, site ${TOPO_SITE[$a]}" >>"$dir/topo.delays"
      else
        echo "$i $j $TOPO_LONG_MS $TOPO_LONG_LOSS # $a - $b, the long link" >>"$dir/topo.delays"
      fi
    done
  done
  topo_line_stop
  bin=$(wan_netdelay_bin)
  rm -f "$dir/topo.out"
  "$bin" "${ports[@]}" --delay-table "$dir/topo.delays" --seed "$TOPO_SEED" --limit 16384 "$@" \
    >"$dir/topo.out" 2>"$dir/topo.err" &
  TOPO_LINE_PID=$!
  for _ in $(seq 200); do
    grep -q '^ready' "$dir/topo.out" 2>/dev/null && break
    kill -0 "$TOPO_LINE_PID" 2>/dev/null || { cat "$dir/topo.err" >&2; topo_fail "kv-netdelay did not start"; }
    sleep 0.02
  done
  grep -q '^ready' "$dir/topo.out" || topo_fail "kv-netdelay not ready"
}

topo_line_stop() {
  if [ -n "$TOPO_LINE_PID" ]; then
    kill "$TOPO_LINE_PID" 2>/dev/null || true
    wait "$TOPO_LINE_PID" 2>/dev/null || true
    TOPO_LINE_PID=""
  fi
}

topo_stats() {
  local before
  before=$(grep -c '^{' "$dir/topo.out" || true)
  kill -USR1 "$TOPO_LINE_PID"
  for _ in $(seq 100); do
    [ "$(grep -c '^{' "$dir/topo.out" || true)" -gt "$before" ] && break
    sleep 0.01
  done
  grep '^{' "$dir/topo.out" | tail -n 1
}

topo_exec() {
  local h=$1
  shift
  [ -n "${TOPO_NS[$h]:-}" ] || topo_fail "topo_exec: no host $h"
  ip netns exec "${TOPO_NS[$h]}" "$@"
}

topo_bg() {
  local h=$1 out=$2
  shift 2
  [ -n "${TOPO_NS[$h]:-}" ] || topo_fail "topo_bg: no host $h"
  ip netns exec "${TOPO_NS[$h]}" "$@" >"$out" 2>"$out.err" &
  TOPO_BG_PID=$!
  TOPO_BG_ALL+=("$TOPO_BG_PID")
}

topo_cleanup() {
  local p
  for p in "${TOPO_BG_ALL[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${TOPO_BG_ALL[@]}"; do wait "$p" 2>/dev/null || true; done
  TOPO_BG_ALL=()
  topo_line_stop
  wan_cleanup
  TOPO_NS=()
}
