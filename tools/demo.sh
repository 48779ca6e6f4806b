#!/usr/bin/env bash
# make demo: generate a small synthetic qwen3moe model and run a prompt through it.
set -euo pipefail
KV=${1:-build/kvasir}
dir=$(mktemp -d -t kvasir-demo.XXXXXX)
trap 'rm -rf "$dir"' EXIT
echo "== kvasir gen-model: a small qwen3moe (4 layers, 16 experts, top-4, Q8_0)"
"$KV" gen-model --arch qwen3moe --out "$dir/demo.gguf" --layers 4 --embd 512 --ff-exp 256 \
  --experts 16 --experts-used 4 --heads 8 --kv-heads 2 --head-dim 64 --vocab 4096 --type q8_0 --seed 7
ls -l "$dir/demo.gguf" | awk '{printf "   %s: %.1f MB\n", $NF, $5/1e6}'
echo "== kvasir inspect: where the bytes are"
"$KV" inspect "$dir/demo.gguf" > "$dir/inspect.txt"
head -n 24 "$dir/inspect.txt"
echo "== kvasir gen-model --skeleton: Qwen3.5-122B-A10B's real header, data left as holes"
"$KV" gen-model --preset qwen35-122b-a10b --skeleton --out "$dir/q35-122b.gguf" >/dev/null
du -h --apparent-size "$dir/q35-122b.gguf" | awk '{printf "   apparent size %s, ", $1}'
du -h "$dir/q35-122b.gguf" | awk '{printf "on disk %s\n", $1}'
"$KV" inspect "$dir/q35-122b.gguf" > "$dir/inspect.txt"
head -n 20 "$dir/inspect.txt"
echo "== kvasir tokenize"
"$KV" tokenize -m "$dir/demo.gguf" "Hello, swarm! <|im_end|>"
echo "== kvasir run (greedy, 32 tokens; random weights, so the text is gibberish)"
"$KV" run -m "$dir/demo.gguf" -p "The expert slabs travel across the swarm" -n 32 --temp 0
echo "== kvasir run --chat --json (sampled, seed 42)"
"$KV" run -m "$dir/demo.gguf" -p "What is a mixture of experts?" --chat -n 16 --seed 42 --json
echo "== kvasir bench"
"$KV" bench -m "$dir/demo.gguf" -p 64 -n 32 --reps 1

# ---- distributed: experts computed by workers over loopback --------------------------------
echo "== kvasir slice: backbone + expert slabs (6 experts per slab, 3 slabs per layer) + manifest"
"$KV" slice "$dir/demo.gguf" --out "$dir/sl" --experts-per-slab 6 2>&1 | sed 's/^/   /'
mkdir -p "$dir/coord"
cp "$dir/sl/backbone.gguf" "$dir/sl/manifest.json" "$dir/coord/" # the coordinator gets no slab
wpids=()
trap 'for p in "${wpids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$dir"' EXIT
echo "== kvasir key: the coordinator's key, the only one the workers will serve"
ckey=$("$KV" key --key "$dir/coord.key")
echo "   $ckey"
echo "== kvasir worker x3 on 127.0.0.1, each holding a third of every layer's experts"
waddr=()
for g in 0 1 2; do
  slabs=$(for l in 0 1 2 3; do ls "$dir/sl/experts/blk.$l."*.gguf | sed -n "$((g + 1))p"; done | paste -sd, -)
  "$KV" worker --slabs "$slabs" --listen 127.0.0.1:0 --threads 1 --quiet --allow-key "$ckey" >"$dir/w$g.out" 2>"$dir/w$g.err" &
  wpids+=($!)
  for _ in $(seq 200); do grep -q '^listening on' "$dir/w$g.out" && break; sleep 0.02; done
  waddr+=(--worker "$(sed -n 's/^listening on //p' "$dir/w$g.out")")
  echo "   worker $g: $(sed -n 's/^listening on //p' "$dir/w$g.out"): $(echo "$slabs" | tr , '\n' | xargs -n1 basename | paste -sd' ' -)"
done
prompt="The expert slabs travel across the swarm"
echo "== kvasir run -m coord/manifest.json --worker x3 (greedy, 32 tokens)"
"$KV" run -m "$dir/coord/manifest.json" "${waddr[@]}" --key "$dir/coord.key" -p "$prompt" -n 32 --temp 0 --verbose \
  --logits-out "$dir/remote.bin" >"$dir/remote.txt" 2>"$dir/remote.err"
cat "$dir/remote.txt"
grep -E '^kvasir run: (dispatch|worker)' "$dir/remote.err" | sed 's/^kvasir run: /   /'
"$KV" run -m "$dir/demo.gguf" -p "$prompt" -n 32 --temp 0 --logits-out "$dir/local.bin" >"$dir/local.txt" 2>/dev/null
if cmp -s "$dir/local.txt" "$dir/remote.txt" && cmp -s "$dir/local.bin" "$dir/remote.bin"; then
  echo "   output equals the single-process run: yes (text and every logit, byte for byte)"
else
  echo "   output equals the single-process run: NO" && exit 1
fi
echo "== stopping the workers"
for p in "${wpids[@]}"; do kill -INT "$p" 2>/dev/null || true; done
wait 2>/dev/null || true
wpids=()
for g in 0 1 2; do echo "   worker $g: $(grep -h 'served' "$dir/w$g.err" | sed 's/^worker: //')"; done
