#!/usr/bin/env bash
# kv-test-labels: net
# The prompt cache over the ring (docs/PROTOCOL.md "Prompt cache over the
# ring"): every `kvasir ring --prompt-cache` node keeps the prompt blocks of
# its own window, a LOOKUP round the ring agrees on the prefix every node
# holds, and the sequence begins there. For rings of 2 and 3 nodes, qwen3moe
# and qwen35moe (recurrent state at block ends): a first long prompt reports
# 0 cached tokens, a second sharing its prefix (sent to another node, its
# home) reports cached tokens > 0 and every node says it began from its
# cache; the same first prompt again is cached too; every answer's tokens
# and logits are byte-identical to `kvasir run -m` without any cache (and
# so to the first request's); speculative decoding (--draft ngram) with a
# cache hit gives the same bytes. A node with a tiny budget (it evicts)
# makes the ring reuse less, still byte-identical; blocks evicted between
# the lookup and the start (a test hook) give a clear miss, and the home
# begins the request again from position 0, still byte-identical; a break
# while such a request decodes replays it with the local bytes. A v4 peer
# is told the version by name, and bad --prompt-cache flags are refused
# naming them. Then a gateway over the ring: the official `openai` client
# sees usage.prompt_tokens_details.cached_tokens > 0 on a repeated long
# chat (whole and streamed) with the same text, Anthropic's
# cache_read_input_tokens too, and /metrics counts lookups and hits.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
dir=$(mktemp -d -t kvasir-ringcache.XXXXXX)
. "$SRC/tests/ring_support.sh"
trap ring_cleanup EXIT
ring_keys
command -v jq >/dev/null || fail "jq is needed"

# a long shared prefix (some hundreds of tokens), two endings, and an unrelated prompt
BASE=""
for i in $(seq 1 24); do BASE="$BASE Sentence $i tells of river $((i * 7)) and mountain $((i * 13))."; done
P1="$BASE So the first question ends here"
P2="$BASE Yet another, different ending"
P3="Nothing in common with the others: an unrelated prompt about weather and tea, said over and over."
P3="$P3 $P3 $P3 $P3"
RUN=(-n 10 --temp 0 --json)

# same OUT REF WHAT: tokens, prompt tokens and logits equal
same() {
  [ "$(jq -c .tokens "$1.json")" = "$(jq -c .tokens "$2.json")" ] ||
    fail "$3: tokens differ: $(jq -c .tokens "$1.json") vs $(jq -c .tokens "$2.json")"
  [ "$(jq -c .prompt_tokens "$1.json")" = "$(jq -c .prompt_tokens "$2.json")" ] || fail "$3: prompt tokens differ"
  [ -s "$1.bin" ] || fail "$3: no logits came back"
  cmp -s "$1.bin" "$2.bin" || fail "$3: logits differ"
}
# ask NODE PROMPT OUT [FLAGS...]: a request through node NODE
ask() {
  local node=$1 p=$2 o=$3
  shift 3
  "$KV" run --ring "${RING_ADDR[$node]}" "${RK[@]}" -p "$p" "${RUN[@]}" --logits-out "$o.bin" "$@" >"$o.json" ||
    fail "request to node $node failed"
}
cached() { jq -r .cached_tokens "$1.json"; }

for arch in qwen3moe qwen35moe; do
  m="$dir/$arch.gguf"
  if [ $arch = qwen3moe ]; then
    "$KV" gen-model --arch qwen3moe --out "$m" --layers 4 --embd 64 --ff-exp 64 --experts 8 --experts-used 2 \
      --heads 4 --kv-heads 2 --head-dim 16 --vocab 600 --type q8_0 --seed 7 --ctx 2048 >/dev/null 2>&1
  else
    "$KV" gen-model --arch qwen35moe --out "$m" --layers 4 --nextn 1 --embd 128 --ff-exp 64 --experts 8 \
      --experts-used 2 --heads 4 --kv-heads 2 --head-dim 32 --vocab 600 --type q8_0 --seed 7 --ctx 2048 >/dev/null 2>&1
  fi
  for i in 1 2 3; do
    eval "p=\$P$i"
    "$KV" run -m "$m" -p "$p" "${RUN[@]}" --threads 1 --logits-out "$dir/$arch.l$i.bin" >"$dir/$arch.l$i.json"
  done
  np=$(jq '.prompt_tokens | length' "$dir/$arch.l1.json")
  [ "$np" -gt 256 ] || fail "$arch: the long prompt has only $np tokens"

  for wins in "0-1 2-3" "0-0 1-2 3-3"; do
    read -r -a W <<<"$wins"
    nn=${#W[@]}
    RING_EXTRA="--prompt-cache 64M" ring_start "$m" "${W[@]}"
    ask 0 "$P1" "$dir/a"
    same "$dir/a" "$dir/$arch.l1" "$arch, $nn nodes, first request"
    [ "$(cached "$dir/a")" = 0 ] || fail "$arch, $nn nodes: the first request reports $(cached "$dir/a") cached tokens"
    ask $((nn - 1)) "$P2" "$dir/b" # another home: the caches are the windows', not the home's
    same "$dir/b" "$dir/$arch.l2" "$arch, $nn nodes, second request (shared prefix)"
    cb=$(cached "$dir/b")
    [ "$cb" -gt 0 ] || fail "$arch, $nn nodes: a request sharing a long prefix reports no cached tokens"
    [ $((cb % 64)) = 0 ] && [ "$cb" -lt "$np" ] || fail "$arch, $nn nodes: $cb cached tokens is not whole blocks"
    for i in "${!RING_PID[@]}"; do
      grep -q ": $cb positions from the prompt cache" "$dir/ring$i.err" ||
        fail "$arch, $nn nodes: node $i did not begin from its cache: $(cat "$dir/ring$i.err")"
    done
    ask 1 "$P1" "$dir/c"
    same "$dir/c" "$dir/$arch.l1" "$arch, $nn nodes, the first prompt again"
    same "$dir/c" "$dir/a" "$arch, $nn nodes, the first prompt again vs the first request"
    [ "$(cached "$dir/c")" -gt 0 ] || fail "$arch, $nn nodes: the first prompt again reports no cached tokens"
    ask 0 "$P2" "$dir/d" --draft ngram
    same "$dir/d" "$dir/$arch.l2" "$arch, $nn nodes, --draft ngram with a cache hit"
    [ "$(cached "$dir/d")" -gt 0 ] || fail "$arch, $nn nodes: --draft ngram: no cached tokens"
    echo "ok: $arch, ring of $nn ($wins), --prompt-cache on every node: $cb of $np prompt tokens reused," \
      "tokens and logits identical to kvasir run -m (plain and --draft ngram)"
    ring_stop
  done

  # a node with a tiny budget: the ring reuses what every node holds, still the same bytes
  t=1 # the small node: one whose blocks are large (qwen35moe's layers 1-2 are recurrent: small blocks)
  [ $arch = qwen35moe ] && t=2
  RING_NODE_EXTRA=()
  RING_NODE_EXTRA[$t]="--prompt-cache 120K"
  RING_EXTRA="--prompt-cache 64M" ring_start "$m" 0-0 1-2 3-3
  RING_NODE_EXTRA=()
  ask 0 "$P1" "$dir/a"
  ask 2 "$P3" "$dir/e" # an unrelated prompt: the small node evicts the first one's blocks for it
  same "$dir/e" "$dir/$arch.l3" "$arch, tiny budget, an unrelated prompt"
  ask 1 "$P2" "$dir/b"
  same "$dir/a" "$dir/$arch.l1" "$arch, tiny budget, first request"
  same "$dir/b" "$dir/$arch.l2" "$arch, tiny budget, second request"
  ct=$(cached "$dir/b")
  [ "$ct" -lt "$cb" ] || fail "$arch: a node with a tiny budget, yet $ct cached tokens (the ring of 3 reused $cb)"
  ring_stop
  grep -q "prompt cache: .* [1-9][0-9]* evicted" "$dir/ring$t.err" ||
    fail "$arch: the small node evicted nothing: $(grep 'prompt cache:' "$dir/ring$t.err")"
  echo "ok: $arch: a node with a tiny budget evicts and the ring reuses $ct tokens (not $cb), bytes identical"

  # a miss: the agreed blocks gone from one node between the LOOKUP and the START (a test hook
  # empties its cache there): it fails the attempt, the home begins again from position 0
  RING_NODE_EXTRA=("" "--test-cache-drop 1")
  RING_EXTRA="--prompt-cache 64M" ring_start "$m" 0-1 2-3
  RING_NODE_EXTRA=()
  ask 0 "$P1" "$dir/a"
  ask 0 "$P2" "$dir/b"
  same "$dir/b" "$dir/$arch.l2" "$arch, a cache miss after the lookup"
  [ "$(cached "$dir/b")" = 0 ] || fail "$arch: a miss reports $(cached "$dir/b") cached tokens"
  grep -q "request .*node 2-3: prompt cache miss" "$dir/ring0.err" ||
    fail "$arch: the home did not begin again after node 2-3's miss: $(cat "$dir/ring0.err")"
  ask 1 "$P2" "$dir/c"
  same "$dir/c" "$dir/$arch.l2" "$arch, after a miss"
  [ "$(cached "$dir/c")" -gt 0 ] || fail "$arch: after a miss the cache was not filled again"
  ring_stop
  grep -q "prompt cache: .* 1 misses" "$dir/ring1.err" || fail "$arch: node 1 counted no miss: $(cat "$dir/ring1.err")"
  echo "ok: $arch: a block evicted between the lookup and the start: a clear miss, begun again from 0, same bytes"
done

# ---- a break while a request that began from the caches decodes: the middle node dies, a
# replacement (its cache empty) takes its window, the home replays the request from its
# tokens (a new LOOKUP: nothing held by every node), and the client gets the local bytes
m="$dir/qwen3moe.gguf"
"$KV" run -m "$m" -p "$P2" -n 40 --temp 0 --json --threads 1 --logits-out "$dir/l2long.bin" >"$dir/l2long.json"
RING_NODE_EXTRA=("" "--die-after-frames 25" "")
RING_EXTRA="--prompt-cache 64M" ring_start "$m" 0-1 2-2 3-3
RING_NODE_EXTRA=()
A1=${RING_ADDR[1]} A2=${RING_ADDR[2]}
ask 0 "$P1" "$dir/a" # about 12 frames: 3 of prompt, then one per token
"$KV" run --ring "$A2" "${RK[@]}" -p "$P2" -n 40 --temp 0 --json --logits-out "$dir/r.bin" >"$dir/r.json" 2>"$dir/r.err" &
c=$!
for _ in $(seq 400); do kill -0 "${RING_PID[1]}" 2>/dev/null || break; sleep 0.05; done
kill -0 "${RING_PID[1]}" 2>/dev/null && fail "the middle node did not die"
wait "${RING_PID[1]}" 2>/dev/null || true
grep -q "dying after 25 frames" "$dir/ring1.err" || fail "the middle node died for another reason: $(cat "$dir/ring1.err")"
grep -q "positions from the prompt cache" "$dir/ring1.err" || fail "the request did not begin from the caches"
mv "$dir/ring1.err" "$dir/ring1.dead.err"
ring_node 1 "$m" 2-2 "$A1" "$A2" --prompt-cache 64M
wait $c || fail "the request failed after the replacement: $(cat "$dir/r.err")"
same "$dir/r" "$dir/l2long" "a request begun from the caches, replayed across a break"
grep -q "replaying request" "$dir/ring2.err" || fail "its home did not replay it: $(cat "$dir/ring2.err")"
[ "$(cached "$dir/r")" -gt 0 ] || fail "the replayed request reports no cached tokens (its first attempt's)"
ring_stop
echo "ok: a request begun from the caches, its middle node dead mid-decode and replaced: replayed, same bytes"

# ---- a v4 peer (a node before the prompt cache) is told the version by name
ring_start "$dir/qwen3moe.gguf" 0-1 2-3
python3 - "${RING_ADDR[0]#*:}" >"$dir/v4.out" 2>&1 <<'EOF' || true
import socket, struct, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
s.sendall(b"KVRG" + struct.pack("<HHI", 4, 1, 88) + bytes(88))  # a v4 HELLO
data = b""
try:
    while len(data) < 4096:
        b = s.recv(4096)
        if not b: break
        data += b
except Exception:
    pass
sys.stdout.write(data.decode("latin-1"))
EOF
grep -aq "protocol version 4, this node speaks 5" "$dir/v4.out" || fail "a v4 peer got no clear version error: $(cat "$dir/v4.out")"
ring_stop
echo "ok: a v4 peer is told 'protocol version 4, this node speaks 5'"

# ---- flags: a bad size or block is refused naming the flag
"$KV" ring -m "$dir/qwen3moe.gguf" --layers 0-3 --listen 127.0.0.1:0 --next 127.0.0.1:1 --open \
  --prompt-cache 12Q 2>"$dir/f1" && fail "--prompt-cache 12Q was taken"
grep -q -- "--prompt-cache" "$dir/f1" || fail "a bad --prompt-cache: $(cat "$dir/f1")"
"$KV" ring -m "$dir/qwen3moe.gguf" --layers 0-3 --listen 127.0.0.1:0 --next 127.0.0.1:1 --open \
  --prompt-cache 1G --prompt-cache-block 24 2>"$dir/f2" && fail "--prompt-cache-block 24 was taken"
grep -q -- "--prompt-cache-block" "$dir/f2" || fail "a bad --prompt-cache-block: $(cat "$dir/f2")"
echo "ok: --prompt-cache and --prompt-cache-block refused naming the flag"

# ---- a gateway over the ring: the official openai client sees cached_tokens
[ -f "$SRC/tests/oracle/node_modules/openai/package.json" ] || fail "package missing: openai (make oracle)"
command -v node >/dev/null 2>&1 || fail "node not found"
m="$dir/tiny.gguf"
"$KV" gen-model --preset tiny --ctx 2048 --out "$m" >/dev/null 2>&1 || fail "gen-model"
RING_EXTRA="--prompt-cache 64M" ring_start "$m" 0-0 1-1
"$KV" gateway --ring "${RING_ADDR[0]}" --ring "${RING_ADDR[1]}" --key "$dir/client.key" --listen 127.0.0.1:0 \
  --api-key sk-rc --name tiny >"$dir/gw.out" 2>"$dir/gw.err" &
RING_ALL+=($!)
for _ in $(seq 1 400); do
  grep -q "^listening on " "$dir/gw.out" 2>/dev/null && break
  sleep 0.05
done
GW=$(sed -n 's/^listening on //p' "$dir/gw.out")
[ -n "$GW" ] || fail "the gateway did not start: $(cat "$dir/gw.err")"
for _ in $(seq 1 200); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://$GW/health")" = 200 ] && break
  sleep 0.05
done
node "$SRC/tests/oracle/ring_cache_client.mjs" "http://$GW/v1" "$BASE" || fail "the openai client over the ring"
body=$(jq -n --arg t "$BASE Tell me more." '{model:"tiny",messages:[{role:"user",content:$t}],max_tokens:6,temperature:0}')
curl -sf "http://$GW/v1/messages" -H 'x-api-key: sk-rc' -H 'content-type: application/json' -d "$body" >/dev/null ||
  fail "anthropic request"
a=$(curl -sf "http://$GW/v1/messages" -H 'x-api-key: sk-rc' -H 'content-type: application/json' -d "$body") ||
  fail "anthropic request"
cr=$(jq -r .usage.cache_read_input_tokens <<<"$a")
[ "$cr" -gt 0 ] || fail "Anthropic cache_read_input_tokens over the ring: $a"
met=$(curl -sf "http://$GW/metrics" -H 'authorization: Bearer sk-rc')
lk=$(awk '$1 == "kvasir_gateway_prompt_cache_lookups_total" {print $2}' <<<"$met")
ht=$(awk '$1 == "kvasir_gateway_prompt_cache_hits_total" {print $2}' <<<"$met")
[ "${lk:-0}" -ge 5 ] && [ "${ht:-0}" -ge 3 ] || fail "/metrics over the ring: lookups ${lk:-none}, hits ${ht:-none}"
echo "ok: gateway --ring: openai cached_tokens > 0 (whole and streamed), Anthropic cache_read_input_tokens $cr," \
  "/metrics $lk lookups, $ht hits"
