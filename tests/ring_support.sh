# Shared by the ring's script tests (sourced): start and stop a ring of
# `kvasir ring` nodes on loopback. Needs KV (the binary) and dir (a scratch
# folder). Sets RING_ADDR[i], RING_PID[i]; node i logs to $dir/ring$i.err.
RING_ADDR=()
RING_PID=()
RING_ALL=()
fail() { echo "FAIL: $*" >&2; exit 1; }

ring_cleanup() {
  for p in "${RING_ALL[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}

# free_ports N: N free loopback ports (bound and released at once).
free_ports() {
  python3 -c '
import socket, sys
ss = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in ss: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in ss))' "$1"
}

# ring_keys: node keys $dir/k0.key .. k9.key (node i uses k$i), a client key
# $dir/client.key, and $dir/allow listing all of them: every node admits
# every other and the client. RK holds the client's flags for run --ring.
ring_keys() {
  local i
  : >"$dir/allow"
  for i in 0 1 2 3 4 5 6 7 8 9 client; do
    k="$dir/k$i.key"
    [ $i = client ] && k="$dir/client.key"
    "$KV" key --key "$k" >>"$dir/allow" || fail "kvasir key failed"
  done
  RK=(--key "$dir/client.key")
}

# ring_node I MODEL WINDOW LISTEN NEXT [EXTRA...]: starts node I.
ring_node() {
  local i=$1 model=$2 win=$3 listen=$4 next=$5
  shift 5
  [ -s "$dir/allow" ] || ring_keys
  "$KV" ring -m "$model" --layers "$win" --listen "$listen" --next "$next" --threads 1 \
    --key "$dir/k$((i % 10)).key" --allow-key "$dir/allow" "$@" \
    >"$dir/ring$i.out" 2>"$dir/ring$i.err" &
  RING_PID[$i]=$!
  RING_ALL+=($!)
  RING_ADDR[$i]=$listen
}

# ring_listening PID OUT: waits (bounded, 15 s) until OUT has "listening on" (0)
# or PID has ended (1).
ring_listening() {
  for _ in $(seq 300); do
    grep -q "^listening on" "$2" 2>/dev/null && return 0
    kill -0 "$1" 2>/dev/null || break
    sleep 0.05
  done
  return 1
}

# ring_wait_listen I: node I is listening (bounded). Under ring_form
# (RING_RETRYING set), a node that ended because its port was taken returns
# 2, so that ring_form tries other ports.
ring_wait_listen() {
  ring_listening "${RING_PID[$1]}" "$dir/ring$1.out" && return 0
  if [ -n "${RING_RETRYING:-}" ] && ring_bind_failed "$1"; then return 2; fi
  cat "$dir/ring$1.err" >&2
  fail "ring node $1 did not start"
}

# ring_wait_whole: every node logged "ring whole" since its start (bounded).
# Returns 2 when a node could not bind its port (another process took it
# between free_ports and the bind: the machine is shared), so that
# ring_form can try other ports.
# Says which node found its port taken, unless ring_form (which retries on
# other ports) is the caller: a script that calls ring_wait_whole itself
# (netns_wan.sh, on fixed ports in namespaces of its own) under set -e ends
# on its status 2, and this line says why.
ring_port_taken() {
  [ -n "${RING_RETRYING:-}" ] || echo "ring_wait_whole: node $1: its port was taken between free_ports and its bind" >&2
}

# ring_bind_failed I: node I ended because its port was taken.
ring_bind_failed() { grep -q "Address already in use" "$dir/ring$1.err" 2>/dev/null; }

ring_wait_whole() {
  local i n
  for _ in $(seq 400); do
    n=0
    for i in "${!RING_PID[@]}"; do
      if ring_bind_failed "$i"; then ring_port_taken "$i"; return 2; fi
      if ! kill -0 "${RING_PID[$i]}" 2>/dev/null || grep -q "^kvasir ring: " "$dir/ring$i.err" 2>/dev/null; then
        # (it may have written why and ended since the look above: a taken port is no death)
        if ring_bind_failed "$i"; then ring_port_taken "$i"; return 2; fi
        cat "$dir/ring$i.err" >&2
        fail "ring node $i died"
      fi
      grep -q "ring whole" "$dir/ring$i.err" 2>/dev/null && n=$((n + 1))
    done
    [ "$n" = "${#RING_PID[@]}" ] && return 0
    sleep 0.05
  done
  for i in "${!RING_PID[@]}"; do cat "$dir/ring$i.err" >&2; done
  fail "the ring did not form"
}

# ring_form N START [ARGS...]: N free loopback ports in RING_PORT[0..N-1],
# then START ARGS..., a function of the caller that starts the ring's nodes
# on them (ring_node; ring_at I is "127.0.0.1:${RING_PORT[I]}") and whatever
# they need before the ring can be whole (a worker started late, say);
# returns once every node logged "ring whole" (with RING_FORM_UNTIL=listen:
# once every node listens, for a ring that is not meant to form). When a
# node found its port taken (another process bound it between free_ports and
# the node's bind, as a test running in parallel can: the machine is shared),
# or START returned 2 (a port it gave to another process was taken:
# ring_started_listening), the nodes are stopped and START runs again on new
# ports, up to 5 tries. Every script that starts a ring on ports of its own
# picking starts it through here.
ring_form() {
  local n=$1 start=$2 try rc i
  shift 2
  for try in 1 2 3 4 5; do
    read -r -a RING_PORT <<<"$(free_ports "$n")"
    RING_ADDR=()
    RING_PID=()
    rc=0
    "$start" "$@" || rc=$?
    [ $rc = 0 ] || [ $rc = 2 ] || fail "ring_form: $start failed (exit $rc)"
    if [ $rc = 0 ] && [ "${RING_FORM_UNTIL:-whole}" = listen ]; then
      for i in "${!RING_PID[@]}"; do
        RING_RETRYING=1 ring_wait_listen "$i" || { rc=$?; break; }
      done
    elif [ $rc = 0 ]; then
      RING_RETRYING=1 ring_wait_whole || rc=$?
    fi
    [ $rc = 0 ] && return 0
    ring_stop
  done
  fail "no free ports for a ring after 5 tries"
}

# ring_started_listening PID OUT ERR: the process PID (not a ring node: a
# worker, say) listens (its OUT has "listening on"): 0; it ended because its
# port was taken: 2, for a ring_form START to return; else the test fails.
ring_started_listening() {
  ring_listening "$1" "$2" && return 0
  grep -q "Address already in use" "$3" 2>/dev/null && return 2
  cat "$3" >&2
  fail "process $1 did not start listening"
}

ring_at() { echo "127.0.0.1:${RING_PORT[$1]}"; }

# ring_start MODEL WINDOW...: one node per window, each linked to the next,
# through ring_form. Every node gets the flags in RING_EXTRA, node i also
# those in RING_NODE_EXTRA[i].
ring_start() {
  ring_form $(($# - 1)) ring_start_nodes "$@"
}

ring_start_nodes() {
  local model=$1 i
  shift
  local n=$#
  local wins=("$@")
  for ((i = 0; i < n; i++)); do
    ring_node "$i" "$model" "${wins[$i]}" "$(ring_at $i)" "$(ring_at $(((i + 1) % n)))" \
      ${RING_EXTRA:-} ${RING_NODE_EXTRA[$i]:-}
  done
}

# ring_hub MANIFEST [FLAGS...]: a hub of the sliced model MANIFEST on a free
# port (database $dir/hub.db, log $dir/hub.out/.err) with FLAGS (the ring's
# windows, deadlines...); sets url once it listens. ring_cleanup ends it.
ring_hub() {
  local manifest=$1
  shift
  "$KV" hub --model "$manifest" --db "$dir/hub.db" --listen 127.0.0.1:0 "$@" >"$dir/hub.out" 2>"$dir/hub.err" &
  RING_ALL+=($!)
  url=
  for _ in $(seq 200); do
    url=$(sed -n 's/^listening on \(.*\)$/http:\/\/\1/p' "$dir/hub.out" 2>/dev/null | head -1 || true)
    [ -n "$url" ] && return 0
    sleep 0.05
  done
  fail "the hub did not start: $(cat "$dir/hub.err")"
}

# hub_node I [EXTRA...]: node I from the market of the hub at $url (budget
# 64M, data folder $dir/dI, key kI), with EXTRA flags; returns once it
# registered its layers. Sets RING_PID[I] and RING_ADDR[I]. Its ring comes
# from the hub, so a node that found its port taken (it binds before it
# registers) is started again alone on another, up to 5 tries.
hub_node() {
  local i=$1 pp try
  shift
  for try in 1 2 3 4 5; do
    read -r -a pp <<<"$(free_ports 1)"
    "$KV" ring --hub "$url" --budget 64M --data "$dir/d$i" --listen "127.0.0.1:${pp[0]}" --threads 1 \
      --key "$dir/k$i.key" --allow-key "$dir/allow" "$@" >"$dir/ring$i.out" 2>"$dir/ring$i.err" &
    RING_PID[$i]=$!
    RING_ALL+=($!)
    RING_ADDR[$i]=127.0.0.1:${pp[0]}
    for _ in $(seq 300); do
      grep -q "registered layers" "$dir/ring$i.err" 2>/dev/null && return 0
      kill -0 "${RING_PID[$i]}" 2>/dev/null || break
      sleep 0.05
    done
    if kill -0 "${RING_PID[$i]}" 2>/dev/null || ! ring_bind_failed "$i"; then break; fi
  done
  cat "$dir/ring$i.err" >&2
  fail "market node $i did not register"
}

ring_stop() {
  local p
  for p in "${RING_PID[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${RING_PID[@]}"; do wait "$p" 2>/dev/null || true; done
  RING_PID=()
  RING_ADDR=()
}

# mapped_rss PID FILE: bytes of FILE's mapping resident in PID.
mapped_rss() {
  awk -v f="$(readlink -f "$2")" '
    /^[0-9a-f]+-[0-9a-f]+ / { on = ($NF == f) }
    on && /^Rss:/ { s += $2 }
    END { print s * 1024 }' "/proc/$1/smaps"
}

# ring_worker NAME SLABS: an expert worker for a ring's windows, admitting the
# keys in $dir/allow; sets $waddr
ring_worker() {
  "$KV" worker --slabs "$2" --listen 127.0.0.1:0 --threads 1 --quiet --allow-key "$dir/allow" \
    >"$dir/$1.out" 2>"$dir/$1.err" &
  RING_ALL+=($!)
  waddr=
  for _ in $(seq 200); do
    waddr=$(sed -n 's/^listening on \(.*\)$/\1/p' "$dir/$1.out" 2>/dev/null | head -1 || true)
    [ -n "$waddr" ] && return 0
    sleep 0.05
  done
  fail "worker $1 did not start: $(cat "$dir/$1.err")"
}
