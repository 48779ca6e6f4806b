#!/usr/bin/env bash
# kv-test-labels: net
# Faults in the ring, on loopback, against `kvasir run -m F.gguf` (greedy):
#  1. a middle node dies in the middle of two requests (its --die-after-frames
#     hook ends it abruptly at a known point); a replacement takes its window
#     on the same address; the ring re-forms and both requests, replayed from
#     their tokens, complete with the local run's tokens and logits byte for byte.
#     The same with temperature 0.8 and a seed: the sampler's draw is a function
#     of (seed, position), so the replayed tail is the unbroken run's too.
#  2. a node dies and nothing replaces it: the waiting request fails within
#     its replay deadline with one clear "ring broken" line (exit 2), and every
#     logit row it streamed before is the local run's (never a wrong token).
#  3. the home node itself dies: its client gets a clear error at once.
#  4. a peer that is not the node before (wrong window) is refused a link, and
#     garbage on a node's port closes that connection only: the ring serves on.
#  5. authentication: a client whose key the nodes do not admit is refused
#     (EAUTH, one line); a SUBMIT sent without AUTH is refused before anything
#     runs; a node whose key is not admitted gets no link either way, so the
#     ring never forms and a request fails clearly.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
dir=$(mktemp -d -t kvasir-ringf.XXXXXX)
. "$SRC/tests/ring_support.sh"
trap ring_cleanup EXIT
ring_keys

m="$dir/m.gguf"
"$KV" gen-model --arch qwen3moe --out "$m" --layers 4 --embd 64 --ff-exp 64 --experts 8 --experts-used 2 \
  --heads 4 --kv-heads 2 --head-dim 16 --vocab 600 --type q8_0 --seed 11 >/dev/null 2>&1
P1="A node that dies breaks the ring with a clear error"
P2="and a replacement takes its window from the hub"
N=40
for i in 1 2; do
  pv=P$i
  "$KV" run -m "$m" -p "${!pv}" -n $N --temp 0 --json --threads 1 --logits-out "$dir/local$i.bin" >"$dir/local$i.json"
done
rowb=$((600 * 4))

# ---- 1. die, replace, replay ------------------------------------------------------
RING_NODE_EXTRA=("" "--die-after-frames 30" "")
ring_start "$m" 0-1 2-2 3-3
RING_NODE_EXTRA=()
A0=${RING_ADDR[0]} A1=${RING_ADDR[1]} A2=${RING_ADDR[2]}
"$KV" run --ring "$A0" "${RK[@]}" -p "$P1" -n $N --temp 0 --json --logits-out "$dir/r1.bin" >"$dir/r1.json" 2>"$dir/r1.err" &
c1=$!
"$KV" run --ring "$A2" "${RK[@]}" -p "$P2" -n $N --temp 0 --json --logits-out "$dir/r2.bin" >"$dir/r2.json" 2>"$dir/r2.err" &
c2=$!
# the middle node ends itself after 30 frames (two requests of 40 tokens need 80)
for _ in $(seq 200); do kill -0 "${RING_PID[1]}" 2>/dev/null || break; sleep 0.05; done
kill -0 "${RING_PID[1]}" 2>/dev/null && fail "the middle node did not die"
wait "${RING_PID[1]}" 2>/dev/null || true
grep -q "dying after 30 frames" "$dir/ring1.err" || fail "the middle node died for another reason: $(cat "$dir/ring1.err")"
sleep 0.3 # the requests wait, held by their homes
kill -0 $c1 2>/dev/null || fail "request 1 ended before a replacement came: $(cat "$dir/r1.err")"
mv "$dir/ring1.err" "$dir/ring1.dead.err"
ring_node 1 "$m" 2-2 "$A1" "$A2"
wait $c1 || fail "request 1 failed after the replacement: $(cat "$dir/r1.err")"
wait $c2 || fail "request 2 failed after the replacement: $(cat "$dir/r2.err")"
for i in 1 2; do
  [ "$(jq -c .tokens "$dir/r$i.json")" = "$(jq -c .tokens "$dir/local$i.json")" ] || fail "request $i: tokens differ after the replay"
  cmp -s "$dir/r$i.bin" "$dir/local$i.bin" || fail "request $i: logits differ after the replay"
done
grep -q "ring broken" "$dir/ring0.err" || fail "node 0 did not see the break"
# the 30 frames the middle node computed were of one request or both: what was in flight was
# replayed (a request that arrived after the break waited and started once the ring re-formed)
grep -q "replaying request" "$dir/ring0.err" "$dir/ring2.err" || fail "no home replayed a request"
echo "ok: a middle node died after 30 frames, a replacement took layers 2-2, both requests replayed from" \
  "their tokens and equal the local run ($N tokens, logits identical)"

# ---- 1b. the same with temperature > 0: one request, the middle node dies after 20 frames
ring_stop
T=(--temp 0.8 --top-k 40 --top-p 0.95 --min-p 0.05 --seed 4242)
"$KV" run -m "$m" -p "$P1" -n $N "${T[@]}" --json --threads 1 --logits-out "$dir/localt.bin" >"$dir/localt.json"
RING_NODE_EXTRA=("" "--die-after-frames 20" "")
ring_start "$m" 0-1 2-2 3-3
RING_NODE_EXTRA=()
A0=${RING_ADDR[0]} A1=${RING_ADDR[1]} A2=${RING_ADDR[2]}
"$KV" run --ring "$A2" "${RK[@]}" -p "$P1" -n $N "${T[@]}" --json --logits-out "$dir/rt.bin" >"$dir/rt.json" 2>"$dir/rt.err" &
ct=$!
for _ in $(seq 200); do kill -0 "${RING_PID[1]}" 2>/dev/null || break; sleep 0.05; done
kill -0 "${RING_PID[1]}" 2>/dev/null && fail "temp 0.8: the middle node did not die"
wait "${RING_PID[1]}" 2>/dev/null || true
kill -0 $ct 2>/dev/null || fail "temp 0.8: the request ended before a replacement came: $(cat "$dir/rt.err")"
mv "$dir/ring1.err" "$dir/ring1.deadt.err"
ring_node 1 "$m" 2-2 "$A1" "$A2"
wait $ct || fail "temp 0.8: the request failed after the replacement: $(cat "$dir/rt.err")"
grep -q "replaying request .* from its [0-9]* + [1-9][0-9]* tokens" "$dir/ring2.err" ||
  fail "temp 0.8: the home did not replay the request with streamed tokens: $(cat "$dir/ring2.err")"
[ "$(jq -c .tokens "$dir/rt.json")" = "$(jq -c .tokens "$dir/localt.json")" ] ||
  fail "temp 0.8: tokens differ after the replay: $(jq -c .tokens "$dir/rt.json") vs $(jq -c .tokens "$dir/localt.json")"
cmp -s "$dir/rt.bin" "$dir/localt.bin" || fail "temp 0.8: logits differ after the replay"
[ "$(jq -c .tokens "$dir/localt.json")" != "$(jq -c .tokens "$dir/local1.json")" ] ||
  fail "temp 0.8 sampled the greedy tokens: the case tests nothing"
echo "ok: temperature 0.8, seed 4242: the middle node died after 20 frames, the request replayed from" \
  "$(sed -n 's/.*from its \([0-9]* + [0-9]*\) tokens.*/\1/p' "$dir/ring2.err" | head -1) tokens equals the local run ($N tokens, logits identical)"

# ---- 2. die, no replacement: a clear error, a true prefix ---------------------------
ring_stop
RING_NODE_EXTRA=("--replay-timeout-ms 1000" "--die-after-frames 15" "--replay-timeout-ms 1000")
ring_start "$m" 0-1 2-2 3-3
RING_NODE_EXTRA=()
A0=${RING_ADDR[0]}
t0=$(date +%s%N)
set +e
"$KV" run --ring "$A0" "${RK[@]}" -p "$P1" -n $N --temp 0 --logits-out "$dir/e.bin" >"$dir/e.out" 2>"$dir/e.err"
rc=$?
set -e
t1=$(date +%s%N)
[ $rc = 2 ] || fail "a broken ring: exit $rc, expected 2 ($(cat "$dir/e.err"))"
[ "$(wc -l <"$dir/e.err")" = 1 ] || fail "a broken ring: expected one line, got: $(cat "$dir/e.err")"
grep -q "ring broken: layers 2-2 are gone: the link .* closed" "$dir/e.err" || fail "unclear error: $(cat "$dir/e.err")"
grep -q "did not re-form within 1000 ms" "$dir/e.err" || fail "error does not name the deadline: $(cat "$dir/e.err")"
[ $(((t1 - t0) / 1000000)) -lt 8000 ] || fail "the error took $(((t1 - t0) / 1000000)) ms"
sz=$(stat -c %s "$dir/e.bin")
[ "$sz" -gt 0 ] && [ $((sz % rowb)) = 0 ] && [ "$sz" -lt $((N * rowb)) ] || fail "streamed $sz bytes of logits"
cmp -s -n "$sz" "$dir/e.bin" "$dir/local1.bin" || fail "a token streamed before the break differs from the local run"
echo "ok: no replacement: '$(cut -c1-110 "$dir/e.err")...' after $(((t1 - t0) / 1000000)) ms;" \
  "the $((sz / rowb)) tokens streamed before are the local run's"

# ---- 3. the home dies: its client hears at once -------------------------------------
ring_stop
RING_NODE_EXTRA=("--die-after-frames 10")
ring_start "$m" 0-1 2-3
RING_NODE_EXTRA=()
A0=${RING_ADDR[0]}
set +e
"$KV" run --ring "$A0" "${RK[@]}" -p "$P1" -n $N --temp 0 >"$dir/h.out" 2>"$dir/h.err"
rc=$?
set -e
[ $rc = 2 ] && grep -q "the node closed the connection" "$dir/h.err" || fail "home died: exit $rc, $(cat "$dir/h.err")"
echo "ok: the home died: $(cat "$dir/h.err")"

# ---- 4. a wrong neighbour and garbage are refused; the ring serves on ---------------
ring_stop
ring_start "$m" 0-1 2-3
for try in 1 2 3 4 5; do # (on another port when its own was taken between free_ports and its bind)
  read -r -a p2 <<<"$(free_ports 1)"
  ring_node 9 "$m" 0-0 "127.0.0.1:${p2[0]}" "${RING_ADDR[0]}" # claims to precede layer 0 but ends at 0
  for _ in $(seq 100); do
    grep -q "refused the link" "$dir/ring9.err" 2>/dev/null && break
    kill -0 "${RING_PID[9]}" 2>/dev/null || break
    sleep 0.05
  done
  kill -0 "${RING_PID[9]}" 2>/dev/null || grep -q "refused the link" "$dir/ring9.err" || ! ring_bind_failed 9 || continue
  break
done
grep -q "the next node refused the link: ring: layer 0 already has a live link\|the next node refused the link: ring: the peer holds layers 0-0" \
  "$dir/ring9.err" || fail "a wrong neighbour was not refused: $(cat "$dir/ring9.err")"
kill "${RING_PID[9]}" 2>/dev/null || true
unset 'RING_PID[9]' 'RING_ADDR[9]'
python3 - "${RING_ADDR[1]}" <<'PY'
import socket, sys
h, p = sys.argv[1].rsplit(":", 1)
for payload in [b"GET / HTTP/1.1\r\n\r\n", b"KVRG\x01\x00\x06\x00\xff\xff\xff\x7f", b"KVRG\x01\x00\x01\x00\x58\x00\x00\x00" + b"\x01" * 88]:
    s = socket.create_connection((h, int(p)))
    s.sendall(payload)
    s.settimeout(5)
    data = s.recv(4096)
    assert data[:4] == b"KVRG" and data[6] == 8, data[:16]  # an ERROR frame, then close
    s.close()
PY
"$KV" run --ring "${RING_ADDR[1]}" "${RK[@]}" -p "$P1" -n $N --temp 0 --json --logits-out "$dir/g.bin" >"$dir/g.json" ||
  fail "the ring stopped serving after garbage"
cmp -s "$dir/g.bin" "$dir/local1.bin" || fail "after garbage: logits differ"
echo "ok: a wrong neighbour refused, garbage answered with ERROR and closed; the ring serves on, same bytes"

# ---- 5. authentication --------------------------------------------------------------
"$KV" key --key "$dir/stranger.key" >"$dir/stranger.pub"
set +e
"$KV" run --ring "${RING_ADDR[0]}" --key "$dir/stranger.key" -p "$P1" -n 4 --temp 0 >"$dir/s.out" 2>"$dir/s.err"
rc=$?
set -e
[ $rc = 2 ] && grep -q "is not allowed on this node" "$dir/s.err" && [ "$(wc -l <"$dir/s.err")" = 1 ] ||
  fail "a stranger client: exit $rc, $(cat "$dir/s.err")"
python3 - "${RING_ADDR[0]}" <<'PY'
import socket, struct, sys
h, p = sys.argv[1].rsplit(":", 1)
s = socket.create_connection((h, int(p)))
s.settimeout(5)
def frame(t, body, v=5): return struct.pack("<IHHI", 0x4752564b, v, t, len(body)) + body
def read_frame():
    hd = b""
    while len(hd) < 12: hd += s.recv(12 - len(hd))
    magic, ver, t, n = struct.unpack("<IHHI", hd)
    body = b""
    while len(body) < n: body += s.recv(n - len(body))
    return t, body
# a node of ring v1 (before TLS) gets a version error, in plaintext on loopback
o = socket.create_connection((h, int(p)))
o.settimeout(5)
o.sendall(frame(1, struct.pack("<6I", 2, 0, 0, 0, 0, 0) + b"\0" * 64, v=1))
data = o.recv(4096)
assert data[:4] == b"KVRG" and data[6] == 8 and b"version 1, this node speaks 5" in data, data
o.close()
s.sendall(frame(1, struct.pack("<6I", 2, 0, 0, 0, 0, 0) + b"\0" * 64))
assert read_frame()[0] == 2 and read_frame()[0] == 11  # HELLO_ACK, AUTH_CHALLENGE
params = struct.pack("<IIfifffiQ", 0, 4, 0.0, 40, 0.95, 0.05, 1.0, 64, 1)
s.sendall(frame(3, params + struct.pack("<I", 2) + b"hi"))  # SUBMIT without AUTH
t, body = read_frame()
assert t == 8 and struct.unpack("<i", body[8:12])[0] == -13, (t, body)  # ERROR EAUTH
PY
ring_stop
stranger_nodes() {
  A0=$(ring_at 0) A1=$(ring_at 1)
  ring_node 0 "$m" 0-1 "$A0" "$A1" --replay-timeout-ms 1500
  # node 1 holds a key no one admits (it admits the others)
  "$KV" ring -m "$m" --layers 2-3 --listen "$A1" --next "$A0" --threads 1 --key "$dir/stranger.key" \
    --allow-key "$dir/allow" >"$dir/ring1.out" 2>"$dir/ring1.err" &
  RING_PID[1]=$!
  RING_ALL+=($!)
}
RING_FORM_UNTIL=listen ring_form 2 stranger_nodes # this ring never forms: both listening is enough
set +e
"$KV" run --ring "$A0" "${RK[@]}" -p "$P1" -n 4 --temp 0 >"$dir/u.out" 2>"$dir/u.err"
rc=$?
set -e
[ $rc = 2 ] && grep -q "ring broken: .*did not re-form within 1500 ms" "$dir/u.err" || fail "unformed ring: exit $rc, $(cat "$dir/u.err")"
grep -q "not linking" "$dir/ring0.err" || fail "node 0 linked to a stranger: $(cat "$dir/ring0.err")"
grep -q "refused the link: ring: key .* is not allowed" "$dir/ring1.err" || fail "the stranger was not refused: $(cat "$dir/ring1.err")"
ring_stop
echo "ok: authentication: a stranger client refused (EAUTH), SUBMIT before AUTH refused, a stranger node gets no link"
echo "PASS: ring faults: break -> clear error or replay with identical output"
