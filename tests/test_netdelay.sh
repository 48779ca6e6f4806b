#!/usr/bin/env bash
# kv-test-labels: net
# A real delayed link between network namespaces (tests/netns_wan.sh), with
# the kernel's own TCP stacks on both ends: kv-netdelay (tools/netdelay.c,
# the userspace delay line used where the kernel has no sch_netem) must give
# a ping and a TCP connect() the round trip of twice the one-way delay
# (references: iputils ping, the kernel's handshake), move a bulk transfer
# byte for byte (SHA-256 of both ends) with no drop, and make jitter, loss,
# a bounded queue and a rate limit behave as configured (its counters
# against what the receiver counted). Then a 2-node `kvasir ring`, one node
# per namespace and the client in a third, must give the tokens and logits
# of the one-process `kvasir run`, at no less than one round trip per token.
# Without the delay the same path (and the veth/bridge topology that netem
# would use) answers in under 5 ms. Where the kernel has netem, the netem
# line is measured too. Needs root (network namespaces): without, it fails.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
KV_BUILD=${KV_BUILD:-$(dirname "$KV")}
dir=$(mktemp -d -t kvasir-netdelay.XXXXXX)
. "$SRC/tests/ring_support.sh"
. "$SRC/tests/netns_wan.sh"
trap 'wan_cleanup; ring_cleanup' EXIT
PROBE=(python3 "$SRC/tests/wan_probe.py")
wan_available || fail "needs root and network namespaces (ip netns add failed)"

# ping_rtts NS_INDEX DST COUNT [ARGS]: the RTT of every reply, ms, one a line
ping_rtts() {
  local i=$1 dst=$2 c=$3
  shift 3
  wan_exec "$i" ping -n -c "$c" -i 0.02 -W 1 "$@" "$dst" 2>/dev/null | sed -n 's/.* time=\([0-9.]*\) ms$/\1/p' || true
}
# summ FILE: "n min median max" of one number a line
summ() { sort -n "$1" | awk '{ a[NR] = $1 } END { if (NR) print NR, a[1], a[int((NR + 1) / 2)], a[NR]; else print 0 }'; }
# within V LO HI
within() { awk -v v="$1" -v lo="$2" -v hi="$3" 'BEGIN { exit !(v >= lo && v <= hi) }'; }
# no_drops JSON WHAT: every drop counter of kv-netdelay is zero
no_drops() {
  [ "$(jq '.dropped_queue + .dropped_loss + .dropped_noroute + .dropped_bad + .write_errors' <<<"$1")" = 0 ] ||
    fail "$2: kv-netdelay dropped packets: $1"
}
wait_file() { for _ in $(seq 200); do [ -s "$1" ] && return 0; sleep 0.02; done; fail "$2 did not start"; }

# ---- 3 namespaces through kv-netdelay, 20 ms one way
NETNS_WAN_MODE=netdelay wan_setup 3 20
echo "link: $WAN_MECH"
ping_rtts 0 "${WAN_IP[1]}" 10 >"$dir/ping"
read -r n lo med hi < <(summ "$dir/ping")
[ "$n" = 10 ] || fail "ping: $n of 10 replies"
within "$lo" 39.5 1000 || fail "ping: a round trip of $lo ms, below the 40 ms of two 20 ms hops"
within "$med" 38 80 || fail "ping: median round trip $med ms, not within 38-80"
echo "ok: ping across 20 ms: min/median/max $lo/$med/$hi ms"

rm -f "$dir/acc.ready"
wan_exec 1 "${PROBE[@]}" accept 7000 5 "$dir/acc.ready" &
acc=$!
wait_file "$dir/acc.ready" "the accept probe"
wan_exec 0 "${PROBE[@]}" connect "${WAN_IP[1]}" 7000 5 >"$dir/conn"
wait "$acc"
read -r n lo med hi < <(summ "$dir/conn")
[ "$n" = 5 ] || fail "connect: $n of 5"
within "$lo" 39.5 1000 || fail "TCP connect in $lo ms: the SYN/SYN-ACK round trip was not delayed"
within "$med" 38 80 || fail "TCP connect: median $med ms, not within 38-80"
echo "ok: TCP connect() across 20 ms: min/median/max $lo/$med/$hi ms"

# bulk: 4 MiB of random bytes from namespace 0 to namespace 1
head -c 4194304 /dev/urandom >"$dir/bulk"
want=$(sha256sum "$dir/bulk" | cut -d' ' -f1)
before=$(wan_stats)
rm -f "$dir/sink.ready"
wan_exec 1 "${PROBE[@]}" sink 7001 "$dir/sink.ready" &
sink=$!
wait_file "$dir/sink.ready" "the sink"
read -r got len secs < <(wan_exec 0 "${PROBE[@]}" send "${WAN_IP[1]}" 7001 "$dir/bulk")
wait "$sink"
[ "$got" = "$want" ] && [ "$len" = 4194304 ] || fail "bulk: received $len bytes, sha256 $got, sent $want"
after=$(wan_stats)
no_drops "$after" "bulk transfer"
fwd=$(($(jq .forwarded <<<"$after") - $(jq .forwarded <<<"$before")))
[ "$fwd" -ge $((4194304 / 1500)) ] || fail "bulk: only $fwd packets went through kv-netdelay"
echo "ok: 4 MiB across 20 ms in $secs s, byte-identical (sha256), $fwd packets through the line, none dropped"

# ---- the ring across the namespaces: nodes in 0 and 1, the client in 2
m="$dir/m.gguf"
"$KV" gen-model --arch qwen3moe --out "$m" --layers 4 --embd 64 --ff-exp 64 --experts 8 --experts-used 2 \
  --heads 4 --kv-heads 2 --head-dim 16 --vocab 600 --type q8_0 --seed 7 >/dev/null 2>&1
PROMPTS=("The ring passes each token's hidden state to its neighbour" "No node holds the model and no node is master")
RUN=(-n 8 --temp 0 --json)
for i in 0 1; do
  "$KV" run -m "$m" -p "${PROMPTS[$i]}" "${RUN[@]}" --threads 1 --logits-out "$dir/local$i.bin" >"$dir/local$i.json"
done
ring_keys
wan_ring_start "$m" 0-1 2-3
for i in 0 1; do
  # ask node i; every token crosses 0 -> 1 -> 0, one 40 ms round trip
  wan_exec 2 "$KV" run --ring "${RING_ADDR[$i]}" "${RK[@]}" -p "${PROMPTS[$i]}" "${RUN[@]}" \
    --logits-out "$dir/r$i.bin" >"$dir/r$i.json" || fail "ring request via node $i failed"
  [ "$(jq -c .tokens "$dir/r$i.json")" = "$(jq -c .tokens "$dir/local$i.json")" ] ||
    fail "ring via node $i: tokens $(jq -c .tokens "$dir/r$i.json"), one process $(jq -c .tokens "$dir/local$i.json")"
  cmp -s "$dir/r$i.bin" "$dir/local$i.bin" || fail "ring via node $i: logits differ from the one-process run"
  span=$(jq '.timings.t_last - .timings.t_first' "$dir/r$i.json")
  ntok=$(jq '.tokens | length' "$dir/r$i.json")
  within "$span" "$(awk -v n="$ntok" 'BEGIN { print (n - 1) * 0.040 * 0.95 }')" 1000 ||
    fail "ring: $ntok tokens in $span s, faster than one 40 ms round trip per token: the link was not delayed"
  echo "ok: 2-node ring across 20 ms links, client in a third namespace, via node $i: tokens and logits of the one-process run; $ntok tokens in $span s"
done
ring_stop
no_drops "$(wan_stats)" "ring"

# ---- jitter: each way 20 +- 10 ms, in order
wan_line 20 --jitter-ms 10 --seed 3
ping_rtts 0 "${WAN_IP[1]}" 30 >"$dir/ping"
read -r n lo med hi < <(summ "$dir/ping")
[ "$n" = 30 ] || fail "jitter: $n of 30 replies"
within "$lo" 19.5 "$hi" && within "$hi" "$lo" 80 || fail "jitter: round trips $lo..$hi ms, not within 20-60 (+ load)"
awk -v a="$lo" -v b="$hi" 'BEGIN { exit !(b - a >= 4) }' || fail "jitter: round trips $lo..$hi ms do not vary"
no_drops "$(wan_stats)" "jitter"
echo "ok: jitter 20 +- 10 ms: round trips $lo..$hi ms (median $med)"

# ---- loss: 30% of the packets each way; what ping lost is what the line dropped
wan_line 20 --loss-pct 30 --seed 5
ping_rtts 0 "${WAN_IP[1]}" 40 >"$dir/ping"
n=$(wc -l <"$dir/ping")
s=$(wan_stats)
lost=$(jq .dropped_loss <<<"$s")
[ "$lost" -gt 0 ] || fail "loss 30%: nothing dropped of 80 packets"
[ $((n + lost)) = 40 ] || fail "loss: ping got $n of 40 replies, the line dropped $lost (requests and replies)"
# every request that arrived was answered, every reply that arrived was counted by ping
[ "$(jq -c '[.ports[0].in, .ports[0].out, .ports[1].in - .ports[1].out, .forwarded + .dropped_loss - .ports[0].in - .ports[1].in]' <<<"$s")" = "[40,$n,0,0]" ] ||
  fail "loss: ping got $n of 40, the line counted otherwise: $s"
echo "ok: loss 30%: $lost of ~80 packets dropped, ping received $n of 40"

# ---- a bounded queue: 300 datagrams back to back into a 16-packet line
wan_line 20 --limit 16
rm -f "$dir/udp.ready"
wan_exec 1 "${PROBE[@]}" udp-sink 7002 "$dir/udp.ready" 1 >"$dir/udp.n" &
sink=$!
wait_file "$dir/udp.ready" "the UDP sink"
wan_exec 0 "${PROBE[@]}" udp-burst "${WAN_IP[1]}" 7002 300
wait "$sink"
got=$(cat "$dir/udp.n")
s=$(wan_stats)
q=$(jq .dropped_queue <<<"$s")
[ "$q" -gt 0 ] && [ "$(jq .max_held <<<"$s")" = 16 ] || fail "limit 16: no queue drop or the queue grew past 16: $s"
[ $((got + q)) = 300 ] && [ "$(jq .forwarded <<<"$s")" = "$got" ] ||
  fail "limit 16: the sink got $got of 300 datagrams, the line counted $q dropped: $s"
echo "ok: a 16-packet queue: $got of 300 datagrams through, $q dropped and counted"

# ---- a rate limit: 512 KiB over 8 Mbit/s takes at least 0.52 s
wan_line 20 --rate-kbit 8000
head -c 524288 /dev/urandom >"$dir/half"
want=$(sha256sum "$dir/half" | cut -d' ' -f1)
rm -f "$dir/sink.ready"
wan_exec 1 "${PROBE[@]}" sink 7003 "$dir/sink.ready" &
sink=$!
wait_file "$dir/sink.ready" "the sink"
read -r got len secs < <(wan_exec 0 "${PROBE[@]}" send "${WAN_IP[1]}" 7003 "$dir/half")
wait "$sink"
[ "$got" = "$want" ] || fail "rate: the bytes differ"
within "$secs" 0.524 8 || fail "rate 8 Mbit/s: 512 KiB in $secs s (the payload alone needs 0.524 s)"
echo "ok: rate 8 Mbit/s: 512 KiB in $secs s (payload alone 0.524 s), byte-identical"

# ---- no delay: the same path through kv-netdelay, then plain veth pairs on a bridge
wan_line 0
ping_rtts 0 "${WAN_IP[1]}" 10 >"$dir/ping"
read -r n lo med hi < <(summ "$dir/ping")
[ "$n" = 10 ] && within "$med" 0 5 || fail "kv-netdelay at 0 ms: $n replies, median $med ms (want < 5)"
echo "ok: kv-netdelay at 0 ms: median round trip $med ms"
wan_cleanup
NETNS_WAN_MODE=none wan_setup 2 0
ping_rtts 0 "${WAN_IP[1]}" 10 >"$dir/ping"
read -r n lo med hi < <(summ "$dir/ping")
[ "$n" = 10 ] && within "$med" 0 5 || fail "veth/bridge: $n replies, median $med ms (want < 5)"
echo "ok: veth pairs on a bridge (the netem topology, no qdisc): median round trip $med ms"
wan_cleanup

# ---- what the benchmarks get by default
if wan_has_netem; then
  wan_setup 2 20
  ping_rtts 0 "${WAN_IP[1]}" 10 >"$dir/ping"
  read -r n lo med hi < <(summ "$dir/ping")
  [ "$n" = 10 ] && within "$med" 38 80 || fail "netem 20 ms: $n replies, median $med ms"
  echo "ok: $WAN_MECH: median round trip $med ms"
  wan_cleanup
else
  echo "note: this kernel has no sch_netem: wan_setup's default is kv-netdelay"
fi
echo "PASS: a real 20 ms link between namespaces (ping, TCP, bulk, jitter, loss, queue, rate), a ring across it exact"
