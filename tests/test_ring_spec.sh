#!/usr/bin/env bash
# kv-test-labels: net
# Speculative decoding over the ring (docs/SPECULATIVE.md "Over the ring"),
# on loopback, against `kvasir run -m F.gguf` without --draft (plain
# decoding, one token per forward pass: the reference):
#  1. qwen3moe and qwen35moe (delta net: its recurrent state rolls back from
#     per-position snapshots on every node), rings of 2 and 3 nodes, greedy
#     and seeded (top-k/top-p/min-p): `kvasir run --ring --draft ...` gives
#     the reference's tokens and the logits of every generated token byte
#     for byte, for the ngram source and the test source at acceptance 0,
#     0.5 and 1 with k = 1, 3 and 7; the measured acceptance (accepted /
#     drafted, from the TOKEN frames' spec word) is 0 at 0 and 1 at 1; at
#     acceptance 1 with k = 3 the passes (ring crossings) drop to about a quarter.
#  2. three drafting requests in flight at once, each to another node: each
#     one the reference's.
#  3. a middle node dies in the middle of a drafting request (its
#     --die-after-frames hook) and a replacement takes its window: the
#     request, replayed from the tokens its home had (accepted ones only),
#     completes with the reference's tokens and logits.
#  4. a v3 peer gets a clear version error; a bad --draft is refused
#     (--draft mtp over a ring: tests/test_ring_spec_mtp.sh).
#  5. a gateway --ring --draft test:...: the same text as a gateway without
#     --draft (greedy; and seeded under a JSON schema with log-probabilities:
#     the grammar advanced token by token at the tail), and /metrics reports
#     the ring's acceptance.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
dir=$(mktemp -d -t kvasir-rspec.XXXXXX)
. "$SRC/tests/ring_support.sh"
GW_PID=
cleanup() { [ -n "$GW_PID" ] && kill "$GW_PID" 2>/dev/null; ring_cleanup; }
trap cleanup EXIT
ring_keys
command -v jq >/dev/null || fail "jq is needed"

P="the river and the mountain, the river and the mountain, the river and"
N=32
GREEDY=(--temp 0)
SEEDED=(--temp 0.9 --seed 1234 --top-k 40 --top-p 0.95 --min-p 0.02)

# same OUT_PREFIX REF_PREFIX WHAT: tokens and logits equal
same() {
  [ "$(jq -c .tokens "$1.json")" = "$(jq -c .tokens "$2.json")" ] ||
    fail "$3: tokens differ: $(jq -c .tokens "$1.json") vs $(jq -c .tokens "$2.json")"
  [ -s "$1.bin" ] || fail "$3: no logits came back"
  cmp -s "$1.bin" "$2.bin" || fail "$3: logits differ"
}

for arch in qwen3moe qwen35moe; do
  m="$dir/$arch.gguf"
  if [ $arch = qwen3moe ]; then
    "$KV" gen-model --arch qwen3moe --out "$m" --layers 4 --embd 64 --ff-exp 64 --experts 8 --experts-used 2 \
      --heads 4 --kv-heads 2 --head-dim 16 --vocab 600 --type q8_0 --seed 7 >/dev/null 2>&1
  else
    "$KV" gen-model --arch qwen35moe --out "$m" --layers 4 --nextn 1 --embd 64 --ff-exp 32 --experts 6 \
      --experts-used 2 --heads 4 --kv-heads 2 --head-dim 16 --vocab 600 --attn-interval 2 --seed 12 >/dev/null 2>&1
  fi
  for mode in greedy seeded; do
    [ $mode = greedy ] && S=("${GREEDY[@]}") || S=("${SEEDED[@]}")
    "$KV" run -m "$m" -p "$P" -n $N "${S[@]}" --json --threads 1 --logits-out "$dir/$arch.$mode.bin" \
      >"$dir/$arch.$mode.json"
    jq -c .tokens "$dir/$arch.$mode.json" >"$dir/$arch.$mode.rec"
  done
  for wins in "0-1 2-3" "0-0 1-2 3-3"; do
    # shellcheck disable=SC2086
    ring_start "$m" $wins
    nn=${#RING_ADDR[@]}
    for mode in greedy seeded; do
      [ $mode = greedy ] && S=("${GREEDY[@]}") || S=("${SEEDED[@]}")
      rec="$dir/$arch.$mode.rec"
      for D in "ngram 3" "test:$rec:0 3" "test:$rec:0.5 3" "test:$rec:1 1" "test:$rec:1 3" "test:$rec:0.5:7 7"; do
        read -r src k <<<"$D"
        via=$((RANDOM % nn))
        o="$dir/o"
        "$KV" run --ring "${RING_ADDR[$via]}" "${RK[@]}" -p "$P" -n $N "${S[@]}" --json --draft "$src" --draft-max "$k" \
          --logits-out "$o.bin" >"$o.json" 2>"$o.err" || fail "$arch $nn nodes $mode --draft $src: $(cat "$o.err")"
        same "$o" "$dir/$arch.$mode" "$arch, $nn nodes, $mode, --draft ${src##*/} k=$k"
        dr=$(jq .spec.drafted "$o.json")
        ac=$(jq .spec.accepted "$o.json")
        pa=$(jq .spec.passes "$o.json")
        case "$src" in
        *:0) [ "$ac" = 0 ] || fail "$arch: acceptance 0 accepted $ac of $dr" ;;
        *:1) [ "$dr" -gt 0 ] && [ "$ac" = "$dr" ] || fail "$arch: acceptance 1 accepted $ac of $dr" ;;
        esac
        if [ "$src" = "test:$rec:1" ] && [ "$k" = 3 ]; then
          # the prompt's pass, then 4 tokens per pass: about N / 4 crossings
          [ "$pa" -le $((N / 4 + 2)) ] || fail "$arch: acceptance 1, k = 3: $pa passes for $N tokens"
        fi
        echo "ok: $arch, $nn nodes, $mode, --draft ${src##*/} k=$k: identical; $pa passes, accepted $ac of $dr"
      done
    done
    # three drafting requests at once, each to another node
    pids=()
    for i in 0 1 2; do
      "$KV" run --ring "${RING_ADDR[$((i % nn))]}" "${RK[@]}" -p "$P" -n $N "${SEEDED[@]}" --json \
        --draft "test:$dir/$arch.seeded.rec:0.7" --draft-max 3 --logits-out "$dir/c$i.bin" >"$dir/c$i.json" &
      pids+=($!)
    done
    for i in 0 1 2; do wait "${pids[$i]}" || fail "$arch: concurrent drafting request $i failed"; done
    for i in 0 1 2; do same "$dir/c$i" "$dir/$arch.seeded" "$arch, $nn nodes, concurrent $i"; done
    echo "ok: $arch, $nn nodes: 3 concurrent drafting requests identical"
    ring_stop
  done
done

# ---- a ring of one node (the head is the tail: the drafts come back to itself)
m="$dir/qwen35moe.gguf"
ring_start "$m" 0-3
for D in "ngram 3" "test:$dir/qwen35moe.seeded.rec:0.7 3"; do
  read -r src k <<<"$D"
  "$KV" run --ring "${RING_ADDR[0]}" "${RK[@]}" -p "$P" -n $N "${SEEDED[@]}" --json --draft "$src" --draft-max "$k" \
    --logits-out "$dir/o.bin" >"$dir/o.json" 2>"$dir/o.err" || fail "ring of one --draft $src: $(cat "$dir/o.err")"
  same "$dir/o" "$dir/qwen35moe.seeded" "qwen35moe, a ring of one, --draft ${src##*/}"
done
ring_stop
echo "ok: a ring of one node, drafting: identical"

# ---- 3. a middle node dies mid-decode; the replay carries accepted tokens only
m="$dir/qwen35moe.gguf"
N2=48
"$KV" run -m "$m" -p "$P" -n $N2 "${SEEDED[@]}" --json --threads 1 --logits-out "$dir/long.bin" >"$dir/long.json"
jq -c .tokens "$dir/long.json" >"$dir/long.rec"
# (ring_start: other ports when one was taken between free_ports and the bind, as by
# another test in parallel; ring_wait_whole's 2 for that would end this script unexplained)
RING_NODE_EXTRA=("" "--die-after-frames 8" "")
ring_start "$m" 0-1 2-2 3-3
RING_NODE_EXTRA=()
A0=${RING_ADDR[0]} A1=${RING_ADDR[1]} A2=${RING_ADDR[2]}
"$KV" run --ring "$A0" "${RK[@]}" -p "$P" -n $N2 "${SEEDED[@]}" --json --draft "test:$dir/long.rec:0.6" --draft-max 3 \
  --logits-out "$dir/k.bin" >"$dir/k.json" 2>"$dir/k.err" &
c1=$!
for _ in $(seq 200); do kill -0 "${RING_PID[1]}" 2>/dev/null || break; sleep 0.05; done
kill -0 "${RING_PID[1]}" 2>/dev/null && fail "the middle node did not die"
wait "${RING_PID[1]}" 2>/dev/null || true
grep -q "dying after 8 frames" "$dir/ring1.err" || fail "the middle node died for another reason: $(cat "$dir/ring1.err")"
mv "$dir/ring1.err" "$dir/ring1.dead.err"
ring_node 1 "$m" 2-2 "$A1" "$A2"
ring_wait_listen 1 # (the dead node's port, free for a moment: a taken one is named here)
wait $c1 || fail "the drafting request failed after the replacement: $(cat "$dir/k.err")"
same "$dir/k" "$dir/long" "qwen35moe, a middle node killed mid-decode, drafting"
grep -q "replaying request" "$dir/ring0.err" || fail "the home did not replay the request"
echo "ok: a middle node died after 8 frames of a drafting request; replayed from its accepted tokens, identical"

# ---- 4. refusals: an old peer, a bad source
python3 - "${A0#*:}" >"$dir/v3.out" <<'EOF'
import socket, struct, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
s.sendall(struct.pack("<IHHI", 0x4752564b, 3, 1, 88) + bytes(88))  # a v3 HELLO
data = b""
try:
    while True:
        b = s.recv(4096)
        if not b: break
        data += b
except Exception:
    pass
print(data[12 + 16:].decode("latin1", "replace"))
EOF
grep -aq "protocol version 3, this node speaks 5" "$dir/v3.out" || fail "a v3 peer got no clear version error: $(cat "$dir/v3.out")"
echo "ok: a v3 peer is told: $(grep -ao 'ring: protocol version[ a-z0-9,]*' "$dir/v3.out" | head -1)"
if "$KV" run --ring "$A0" "${RK[@]}" -p "$P" -n 4 --draft bogus >/dev/null 2>"$dir/e.err"; then fail "--draft bogus was taken"; fi
grep -q -- "--draft" "$dir/e.err" || fail "--draft bogus: unclear refusal: $(cat "$dir/e.err")"
echo "ok: a bad source is refused over a ring, naming the flag"

# ---- 5. the gateway over the ring, with and without --draft
gw() { # gw EXTRA...: a ring gateway; GW_ADDR its address once /health says the ring is whole
  "$KV" gateway --ring "$A0" --key "$dir/client.key" --listen 127.0.0.1:0 --name m "$@" >"$dir/gw.out" 2>"$dir/gw.err" &
  GW_PID=$!
  GW_ADDR=
  for _ in $(seq 300); do
    GW_ADDR=$(sed -n 's/^listening on //p' "$dir/gw.out" 2>/dev/null)
    [ -n "$GW_ADDR" ] && curl -sf "http://$GW_ADDR/health" >/dev/null 2>&1 && return 0
    kill -0 "$GW_PID" 2>/dev/null || break
    sleep 0.05
  done
  cat "$dir/gw.err" >&2
  fail "the gateway did not start"
}
ask() {
  curl -sf "http://$GW_ADDR/v1/completions" -H 'content-type: application/json' \
    -d "{\"model\":\"m\",\"prompt\":\"$P\",\"max_tokens\":$N2,\"temperature\":0}" | jq -r '.choices[0].text'
}
SCHEMA='{"type":"object","properties":{"city":{"type":"string"},"n":{"type":"integer"}},"required":["city","n"]}'
askg() { # a seeded completion under a JSON schema, with log-probabilities: [text, logprobs]
  curl -sf "http://$GW_ADDR/v1/completions" -H 'content-type: application/json' \
    -d "{\"model\":\"m\",\"prompt\":\"$P\",\"max_tokens\":60,\"temperature\":0.7,\"seed\":5,\"logprobs\":2,\"json_schema\":$SCHEMA}" |
    jq -c '[.choices[0].text, .choices[0].logprobs]'
}
gw
ask >"$dir/gw.plain" || fail "the plain ring gateway did not answer"
askg >"$dir/gwg.plain" || fail "the plain ring gateway did not answer under a schema"
kill "$GW_PID"
wait "$GW_PID" 2>/dev/null || true
"$KV" run -m "$m" -p "$P" -n $N2 --temp 0 --json --threads 1 >"$dir/g.json"
jq -c .tokens "$dir/g.json" >"$dir/g.rec"
gw --draft "test:$dir/g.rec:0.7" --draft-max 3
ask >"$dir/gw.spec" || fail "the drafting ring gateway did not answer"
# the greedy request's acceptance (the recording is its plain run's tokens)
curl -sf "http://$GW_ADDR/metrics" >"$dir/metrics"
acc=$(sed -n 's/^kvasir_gateway_spec_acceptance \(.*\)/\1/p' "$dir/metrics")
[ -n "$acc" ] || fail "/metrics has no acceptance over the ring"
python3 -c "import sys; a = float(sys.argv[1]); sys.exit(0 if 0.3 <= a <= 1 else 1)" "$acc" ||
  fail "/metrics acceptance $acc for a test source at 0.7"
askg >"$dir/gwg.spec" || fail "the drafting ring gateway did not answer under a schema"
# (60 tokens of a synthetic model do not finish the object: it starts as the schema says)
jq -r '.[0]' "$dir/gwg.plain" | grep -q '^{ *"city"' || fail "no JSON under the schema: $(cat "$dir/gwg.plain")"
cmp -s "$dir/gwg.plain" "$dir/gwg.spec" ||
  fail "under a schema, seeded, with log-probabilities: $(cat "$dir/gwg.spec") vs $(cat "$dir/gwg.plain")"
[ -s "$dir/gw.plain" ] || fail "the gateway answered no text"
cmp -s "$dir/gw.plain" "$dir/gw.spec" || fail "the gateway's text differs with --draft over the ring"
echo "ok: gateway --ring --draft: the same text as without (greedy, and seeded under a JSON schema with" \
  "log-probabilities); /metrics acceptance $acc"
echo "PASS: speculative decoding over the ring is exact (qwen3moe, qwen35moe, 2 and 3 nodes, greedy and seeded," \
  "a node killed mid-decode, a gateway)"
