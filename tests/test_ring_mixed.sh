#!/usr/bin/env bash
# kv-test-labels: net
# One market, two modes, on one mixed placement: layers 0-1 served by a ring
# window that holds its layers' slabs, layers 2-3 by a ring node holding only
# the backbone and the manifest, whose routed experts are computed by two
# `kvasir worker` expert workers (the dispatch protocol, authenticated: the
# workers admit the ring node's key). Tokens and logits must equal
# `kvasir run -m F.gguf`'s byte for byte, for qwen3moe and qwen35moe. For
# qwen35moe the second worker starts 1.5 s after the ring node: the node
# waits for it (--worker-wait-ms) instead of failing at open.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
dir=$(mktemp -d -t kvasir-ringmix.XXXXXX)
. "$SRC/tests/ring_support.sh"
trap ring_cleanup EXIT
ring_keys
P="Some layers are a ring window and the others expert workers"
N=12

worker() { ring_worker "$@"; } # ring_support.sh

# mixed_nodes: the two ring nodes on ring_form's first two ports; for
# qwen35moe the second worker on the third, started 1.5 s after the node that
# waits for it
mixed_nodes() {
  A0=$(ring_at 0) A1=$(ring_at 1)
  [ $arch = qwen3moe ] || wb=$(ring_at 2) # not up yet when the ring node opens
  ring_node 0 "$w0/manifest.json" 0-1 "$A0" "$A1"
  ring_node 1 "$w1/manifest.json" 2-3 "$A1" "$A0" --worker "$wa" --worker "$wb" --worker-wait-ms 20000
  if [ $arch = qwen35moe ]; then
    sleep 1.5
    kill -0 "${RING_PID[1]}" 2>/dev/null || fail "$arch: the ring node gave up before its worker came: $(cat "$dir/ring1.err")"
    "$KV" worker --slabs "$sl/experts/blk.2.0004-0007.gguf,$sl/experts/blk.3.0004-0007.gguf" --listen "$wb" \
      --threads 1 --quiet --allow-key "$dir/allow" >"$dir/$arch-b.out" 2>"$dir/$arch-b.err" &
    RING_ALL+=($!)
    ring_started_listening $! "$dir/$arch-b.out" "$dir/$arch-b.err" || return # 2: its port was taken, ring_form retries
  fi
}

for arch in qwen3moe qwen35moe; do
  m="$dir/$arch.gguf"
  if [ $arch = qwen3moe ]; then
    "$KV" gen-model --arch qwen3moe --out "$m" --layers 4 --embd 64 --ff-exp 64 --experts 8 --experts-used 2 \
      --heads 4 --kv-heads 2 --head-dim 16 --vocab 600 --type q8_0 --seed 17 >/dev/null 2>&1
  else
    "$KV" gen-model --arch qwen35moe --out "$m" --layers 4 --embd 128 --ff-exp 64 --experts 8 \
      --experts-used 2 --heads 4 --kv-heads 2 --head-dim 32 --vocab 600 --type q8_0 --seed 17 >/dev/null 2>&1
  fi
  sl="$dir/$arch.sl"
  "$KV" slice "$m" --out "$sl" --experts-per-slab 4 >/dev/null 2>&1
  "$KV" run -m "$m" -p "$P" -n $N --temp 0 --json --threads 1 --logits-out "$dir/$arch.local.bin" >"$dir/$arch.local.json"
  # the window node of layers 0-1: its own slabs only
  w0="$dir/$arch.w0"
  mkdir -p "$w0/experts"
  cp "$sl/backbone.gguf" "$sl/manifest.json" "$w0/"
  cp "$sl"/experts/blk.0.* "$sl"/experts/blk.1.* "$w0/experts/"
  # the node of layers 2-3: no slab at all (so every expert of its layers must come from the
  # workers, or the run fails); two workers hold layer 2-3 experts half each
  w1="$dir/$arch.w1"
  mkdir -p "$w1"
  cp "$sl/backbone.gguf" "$sl/manifest.json" "$w1/"
  worker "$arch-a" "$sl/experts/blk.2.0000-0003.gguf,$sl/experts/blk.3.0000-0003.gguf"
  wa=$waddr
  if [ $arch = qwen3moe ]; then
    worker "$arch-b" "$sl/experts/blk.2.0004-0007.gguf,$sl/experts/blk.3.0004-0007.gguf"
    wb=$waddr
  fi
  ring_form 3 mixed_nodes
  for via in "$A0" "$A1"; do
    "$KV" run --ring "$via" "${RK[@]}" -p "$P" -n $N --temp 0 --json --logits-out "$dir/r.bin" >"$dir/r.json" ||
      fail "$arch: the mixed ring failed"
    [ "$(jq -c .tokens "$dir/r.json")" = "$(jq -c .tokens "$dir/$arch.local.json")" ] || fail "$arch: tokens differ"
    cmp -s "$dir/r.bin" "$dir/$arch.local.bin" || fail "$arch: logits differ"
  done
  ring_stop
  echo "ok: $arch: layers 0-1 a ring window with its slabs, layers 2-3 a ring node whose experts two workers" \
    "compute: tokens and logits identical to one process"
done
echo "PASS: one market, two modes: a mixed placement gives the local bytes"
