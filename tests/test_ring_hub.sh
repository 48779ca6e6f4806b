#!/usr/bin/env bash
# kv-test-labels: net
# The layer market: a hub trading two layer windows (--ring-windows 0-1,2-3)
# of a sliced model; `kvasir ring --hub URL --budget SIZE` nodes take the
# scarcest window that fits, fetch only its pieces (hash checked), register,
# and learn their next node from the hub, so the ring forms from the market
# on its own; its tokens and logits equal `kvasir run -m F.gguf`'s. Then the
# node of layers 2-3 dies in the middle of a request: the hub sees the window
# go scarce, a new node given the same budget takes exactly that window, the
# ring re-forms through the hub and the request, replayed from its tokens,
# completes with the same bytes. Ring nodes are never placed as expert workers.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
dir=$(mktemp -d -t kvasir-ringhub.XXXXXX)
. "$SRC/tests/ring_support.sh"
trap ring_cleanup EXIT
ring_keys

m="$dir/m.gguf"
"$KV" gen-model --arch qwen3moe --out "$m" --layers 4 --embd 64 --ff-exp 64 --experts 8 --experts-used 2 \
  --heads 4 --kv-heads 2 --head-dim 16 --vocab 600 --type q8_0 --seed 13 >/dev/null 2>&1
"$KV" slice "$m" --out "$dir/sl" --experts-per-slab 4 >/dev/null 2>&1
P="The ring forms from the market on its own"
N=40
"$KV" run -m "$m" -p "$P" -n $N --temp 0 --json --threads 1 --logits-out "$dir/local.bin" >"$dir/local.json"

ring_hub "$dir/sl/manifest.json" --deadline-ms 1500 --ring-windows 0-1,2-3
curl -sf "$url/v1/ring" >"$dir/ring0.json" || fail "GET /v1/ring failed"
[ "$(jq -c '[.windows[] | [.first, .last, .live]]' "$dir/ring0.json")" = "[[0,1,0],[2,3,0]]" ] ||
  fail "the market's windows: $(cat "$dir/ring0.json")"

hub_node 0
grep -q "took layers 0-1 from the market" "$dir/ring0.err" || fail "node 0 did not take the scarcest window: $(cat "$dir/ring0.err")"
hub_node 1 --die-after-frames 25
grep -q "took layers 2-3 from the market" "$dir/ring1.err" || fail "node 1 did not take the window left: $(cat "$dir/ring1.err")"
ring_wait_whole
# each node fetched its window's slabs only
[ -e "$dir/d0/pieces/experts/blk.0.0000-0003.gguf" ] && [ ! -e "$dir/d0/pieces/experts/blk.2.0000-0003.gguf" ] ||
  fail "node 0 holds other windows' slabs: $(ls "$dir/d0/pieces/experts")"
curl -sf "$url/v1/ring" >"$dir/ring1.json"
[ "$(jq -c '[.windows[] | .live]' "$dir/ring1.json")" = "[1,1]" ] || fail "the market after joining: $(cat "$dir/ring1.json")"
[ "$(curl -sf "$url/v1/placement" | jq '[.shards[].nodes[]] | length')" = 0 ] || fail "ring nodes were placed as expert workers"
echo "ok: two nodes took windows 0-1 and 2-3 from the market, fetched only their slabs, and formed a ring from the hub"

# a request through the market's ring; node 1 dies in the middle of it
"$KV" run --ring "${RING_ADDR[0]}" "${RK[@]}" -p "$P" -n $N --temp 0 --json --logits-out "$dir/r.bin" >"$dir/r.json" \
  2>"$dir/r.err" &
c=$!
for _ in $(seq 200); do kill -0 "${RING_PID[1]}" 2>/dev/null || break; sleep 0.05; done
kill -0 "${RING_PID[1]}" 2>/dev/null && fail "node 1 did not die"
wait "${RING_PID[1]}" 2>/dev/null || true
# the hub sees window 2-3 go scarce once node 1 misses its deadline
for _ in $(seq 100); do
  [ "$(curl -sf "$url/v1/ring" | jq -c '[.windows[] | .live]')" = "[1,0]" ] && break
  sleep 0.1
done
[ "$(curl -sf "$url/v1/ring" | jq -c '[.windows[] | .live]')" = "[1,0]" ] || fail "the market did not see window 2-3 go"
kill -0 $c 2>/dev/null || fail "the request ended before a replacement came: $(cat "$dir/r.err")"
hub_node 2
grep -q "took layers 2-3 from the market" "$dir/ring2.err" || fail "the replacement took another window: $(cat "$dir/ring2.err")"
wait $c || fail "the request failed after the replacement: $(cat "$dir/r.err")"
[ "$(jq -c .tokens "$dir/r.json")" = "$(jq -c .tokens "$dir/local.json")" ] || fail "tokens differ after the replay"
cmp -s "$dir/r.bin" "$dir/local.bin" || fail "logits differ after the replay"
grep -q "replaying request" "$dir/ring0.err" || fail "node 0 did not replay"
grep -q "next node: ${RING_ADDR[2]} (from the hub)" "$dir/ring0.err" || fail "node 0 did not learn its new next from the hub"
echo "ok: node 1 died after 25 frames; the market showed 2-3 scarce; a new node took it, the ring re-formed" \
  "through the hub, and the replayed request equals the local run ($N tokens, logits identical)"
echo "PASS: the layer market forms and re-forms the ring"
