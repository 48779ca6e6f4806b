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
"$KV" inspect "$dir/demo.gguf" | head -n 24
echo "== kvasir gen-model --skeleton: Qwen3.5-122B-A10B's real header, data left as holes"
"$KV" gen-model --preset qwen35-122b-a10b --skeleton --out "$dir/q35-122b.gguf" >/dev/null
du -h --apparent-size "$dir/q35-122b.gguf" | awk '{printf "   apparent size %s, ", $1}'
du -h "$dir/q35-122b.gguf" | awk '{printf "on disk %s\n", $1}'
"$KV" inspect "$dir/q35-122b.gguf" | head -n 20
echo "== kvasir tokenize"
"$KV" tokenize -m "$dir/demo.gguf" "Hello, swarm! <|im_end|>"
echo "== kvasir run (greedy, 32 tokens; random weights, so the text is gibberish)"
"$KV" run -m "$dir/demo.gguf" -p "The expert slabs travel across the swarm" -n 32 --temp 0
echo "== kvasir run --chat --json (sampled, seed 42)"
"$KV" run -m "$dir/demo.gguf" -p "What is a mixture of experts?" --chat -n 16 --seed 42 --json
echo "== kvasir bench"
"$KV" bench -m "$dir/demo.gguf" -p 64 -n 32 --reps 1
