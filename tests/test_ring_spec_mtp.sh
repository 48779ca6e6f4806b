#!/usr/bin/env bash
# kv-test-labels: net
# The MTP draft source over a ring (docs/SPECULATIVE.md "Over the ring"):
# the tail (the window with the last trunk layer and the LM head) maps the
# MTP block and the token embedding and drafts from the hidden state that
# gave each token. A qwen35moe gen-model model with an MTP block (--nextn 1):
#  1. a ring of two whole-file windows: `kvasir run --ring --draft mtp`
#     gives the tokens and logits of plain `kvasir run -m F.gguf` byte for
#     byte, greedy and seeded, and drafts as many tokens as in-process MTP
#     (and accepts as many); a gateway over it with --draft mtp answers what
#     one without answers, and /metrics counts the drafts;
#  2. a sliced ring whose tail holds no slab, its experts (the MTP block's
#     layer 4 too) on two `kvasir worker` processes: the same bytes and
#     counts;
#  3. refusals naming the cause: a tail whose workers do not serve layer 4
#     (while plain and ngram requests on that ring are served), a tail
#     without the slabs of layer 4, and a qwen3moe ring (no MTP block).
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
dir=$(mktemp -d -t kvasir-rmtp.XXXXXX)
. "$SRC/tests/ring_support.sh"
trap ring_cleanup EXIT
ring_keys
command -v jq >/dev/null || fail "jq is needed"

P="the river and the mountain, the river and the mountain, the river and"
N=24
GREEDY=(--temp 0)
SEEDED=(--temp 0.9 --seed 1234 --top-k 0 --top-p 1 --min-p 0)
m="$dir/q35.gguf"
"$KV" gen-model --arch qwen35moe --out "$m" --layers 4 --nextn 1 --embd 64 --ff-exp 32 --experts 6 \
  --experts-used 2 --heads 4 --kv-heads 2 --head-dim 16 --vocab 600 --attn-interval 2 --seed 12 >/dev/null 2>&1 ||
  fail "gen-model qwen35moe"
sl="$dir/q35.sl"
"$KV" slice "$m" --out "$sl" --experts-per-slab 3 >/dev/null 2>&1 || fail "slice"
for mode in greedy seeded; do
  [ $mode = greedy ] && S=("${GREEDY[@]}") || S=("${SEEDED[@]}")
  "$KV" run -m "$m" -p "$P" -n $N "${S[@]}" --json --threads 1 --logits-out "$dir/$mode.bin" >"$dir/$mode.json"
  "$KV" run -m "$m" -p "$P" -n $N "${S[@]}" --json --threads 1 --draft mtp --draft-max 3 >"$dir/$mode.mtp.json"
  [ "$(jq .spec.drafted "$dir/$mode.mtp.json")" -gt $((N / 2)) ] || fail "$mode: in-process MTP drafted too little"
done

# over_ring NAME: --draft mtp through either node equals plain decoding and drafts what in-process MTP drafts
over_ring() {
  local mode via i=0
  for mode in greedy seeded; do
    [ $mode = greedy ] && S=("${GREEDY[@]}") || S=("${SEEDED[@]}")
    via=${RING_ADDR[$((i++ % 2))]}
    "$KV" run --ring "$via" "${RK[@]}" -p "$P" -n $N "${S[@]}" --json --draft mtp --draft-max 3 \
      --logits-out "$dir/o.bin" >"$dir/o.json" 2>"$dir/o.err" || fail "$1 $mode: $(cat "$dir/o.err")"
    [ "$(jq -c .tokens "$dir/o.json")" = "$(jq -c .tokens "$dir/$mode.json")" ] ||
      fail "$1 $mode: tokens differ: $(jq -c .tokens "$dir/o.json") vs $(jq -c .tokens "$dir/$mode.json")"
    cmp -s "$dir/o.bin" "$dir/$mode.bin" || fail "$1 $mode: logits differ"
    for f in drafted accepted; do
      [ "$(jq .spec.$f "$dir/o.json")" = "$(jq .spec.$f "$dir/$mode.mtp.json")" ] ||
        fail "$1 $mode: $f $(jq .spec.$f "$dir/o.json") over the ring, $(jq .spec.$f "$dir/$mode.mtp.json") in process"
    done
    echo "ok: $1, $mode: plain decoding's bytes, $(jq -c .spec "$dir/o.json") as in process"
  done
}

# ---- 1. whole-file windows; a gateway over them
ring_start "$m" 0-1 2-3
over_ring "a ring of whole-file windows"
GW_PID=
gw() { # EXTRA...: a gateway over the ring; GW_ADDR its address once /health answers
  "$KV" gateway --ring "${RING_ADDR[0]}" "${RK[@]}" --listen 127.0.0.1:0 --name m "$@" >"$dir/gw.out" 2>"$dir/gw.err" &
  GW_PID=$!
  RING_ALL+=($GW_PID)
  GW_ADDR=
  for _ in $(seq 300); do
    GW_ADDR=$(sed -n 's/^listening on //p' "$dir/gw.out" 2>/dev/null)
    [ -n "$GW_ADDR" ] && curl -sf "http://$GW_ADDR/health" >/dev/null 2>&1 && return 0
    kill -0 "$GW_PID" 2>/dev/null || break
    sleep 0.05
  done
  fail "the gateway did not start: $(cat "$dir/gw.err")"
}
ask() { # SEED (-1: greedy) -> the text
  jq -n --arg p "$P" --argjson s "$1" '{model:"m",prompt:$p,max_tokens:24,temperature:(if $s < 0 then 0 else 0.9 end),
    seed:(if $s < 0 then 0 else $s end)}' |
    curl -sf "http://$GW_ADDR/v1/completions" -H 'content-type: application/json' -d @- | jq -r '.choices[0].text'
}
gw
for s in -1 5; do ask $s >"$dir/gw.plain.$s" || fail "the plain ring gateway did not answer"; done
kill "$GW_PID"
wait "$GW_PID" 2>/dev/null || true
gw --draft mtp --draft-max 3
for s in -1 5; do
  ask $s >"$dir/gw.mtp.$s" || fail "the --draft mtp ring gateway did not answer"
  [ -s "$dir/gw.plain.$s" ] && cmp -s "$dir/gw.plain.$s" "$dir/gw.mtp.$s" ||
    fail "gateway seed $s: '$(cat "$dir/gw.mtp.$s")' with --draft mtp, '$(cat "$dir/gw.plain.$s")' without"
done
dr=$(curl -sf "http://$GW_ADDR/metrics" | sed -n 's/^kvasir_gateway_spec_drafted_tokens_total \(.*\)/\1/p')
[ -n "$dr" ] && [ "$dr" -gt 0 ] || fail "/metrics: no drafted tokens over the ring ($dr)"
kill "$GW_PID"
wait "$GW_PID" 2>/dev/null || true
echo "ok: gateway --ring --draft mtp: the text of a gateway without it, $dr tokens drafted"
ring_stop

# ---- 2 and 3. a sliced ring: the head window with its slabs, the tail's experts on workers
worker() { ring_worker "$@"; } # ring_support.sh
slabs() { # G LAYER...: the slabs of expert group G (3 wide) of those layers
  local g=$1 out="" l
  shift
  for l in "$@"; do out+="${out:+,}$sl/experts/$(printf 'blk.%d.%04d-%04d.gguf' "$l" $((3 * g)) $((3 * g + 2)))"; done
  echo "$out"
}
w0="$dir/w0" w1="$dir/w1" w2="$dir/w2"
mkdir -p "$w0/experts" "$w1" "$w2/experts"
cp "$sl/backbone.gguf" "$sl/manifest.json" "$w0/"
cp "$sl"/experts/blk.0.* "$sl"/experts/blk.1.* "$w0/experts/"
cp "$sl/backbone.gguf" "$sl/manifest.json" "$w1/" # no slab: every expert from the workers
cp "$sl/backbone.gguf" "$sl/manifest.json" "$w2/"
cp "$sl"/experts/blk.2.* "$sl"/experts/blk.3.* "$w2/experts/" # the trunk's slabs, not the MTP block's
sliced_ring() { ring_form 2 sliced_ring_nodes "$@"; } # TAIL_DIR TAIL_FLAGS...
sliced_ring_nodes() {
  local tail=$1
  shift
  ring_node 0 "$w0/manifest.json" 0-1 "$(ring_at 0)" "$(ring_at 1)"
  ring_node 1 "$tail/manifest.json" 2-3 "$(ring_at 1)" "$(ring_at 0)" "$@"
}
refused() { # WHAT WANT...: --draft mtp on the ring fails with a message holding each WANT
  local what=$1
  shift
  if "$KV" run --ring "${RING_ADDR[0]}" "${RK[@]}" -p "$P" -n 4 --draft mtp >/dev/null 2>"$dir/e.err"; then
    fail "$what: --draft mtp was taken"
  fi
  for want in "$@"; do grep -q -- "$want" "$dir/e.err" || fail "$what: the refusal lacks '$want': $(cat "$dir/e.err")"; done
  echo "ok: $what: refused: $(cat "$dir/e.err")"
}
plain_ok() { # WHAT: plain and ngram requests are still served, the plain bytes
  local src
  for src in none ngram; do
    "$KV" run --ring "${RING_ADDR[0]}" "${RK[@]}" -p "$P" -n $N --temp 0 --json --draft $src >"$dir/p.json" 2>"$dir/p.err" ||
      fail "$1: a --draft $src request failed: $(cat "$dir/p.err")"
    [ "$(jq -c .tokens "$dir/p.json")" = "$(jq -c .tokens "$dir/greedy.json")" ] || fail "$1: --draft $src tokens differ"
  done
}
worker a "$(slabs 0 2 3 4)"
wa=$waddr
worker b "$(slabs 1 2 3 4)"
wb=$waddr
sliced_ring "$w1" --worker "$wa" --worker "$wb"
over_ring "a sliced ring, the tail's experts and the MTP block's on two workers"
ring_stop
worker c "$(slabs 0 2 3)"
wc=$waddr
worker d "$(slabs 1 2 3)"
wd=$waddr
sliced_ring "$w1" --worker "$wc" --worker "$wd"
refused "workers without the MTP block's experts" "--draft mtp" "layer 4"
plain_ok "workers without the MTP block's experts"
ring_stop
sliced_ring "$w2"
refused "a tail without the MTP block's slabs" "--draft mtp" "layer 4"
ring_stop

# ---- qwen3moe: no MTP block
q3="$dir/q3.gguf"
"$KV" gen-model --arch qwen3moe --out "$q3" --layers 3 --embd 64 --ff-exp 32 --experts 6 --experts-used 2 \
  --heads 4 --kv-heads 2 --head-dim 16 --vocab 600 --seed 11 >/dev/null 2>&1 || fail "gen-model qwen3moe"
ring_start "$q3" 0-1 2-2
refused "qwen3moe" "--draft mtp" "no MTP (nextn) block"
ring_stop
echo "PASS: --draft mtp over a ring: plain decoding's bytes, in-process MTP's drafts, clear refusals"
