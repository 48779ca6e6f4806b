# Sourced by bench/pair_cost.sh and bench/lanes.sh: the model both measure.
# paircost_model KV FF DIR NAME: a synthetic qwen3moe (8 layers, embd 512,
# 16 experts of FF, top-4, q8_0, --router-skew 2) in DIR/m.gguf, sliced 2
# experts per slab in DIR/sl, unless DIR already holds it. It is kept: on the
# VMs of docs/BENCHMARKS.md, files written minutes before were computed on at
# up to 1.7x the kernel time, growing from round to round, and files kept
# from an earlier run were not.
paircost_model() {
  local kv=$1 ff=$2 dir=$3 name=$4
  mkdir -p "$dir"
  [ -s "$dir/sl/manifest.json" ] && return 0
  "$kv" gen-model --arch qwen3moe --out "$dir/m.gguf" --layers 8 --embd 512 --ff-exp "$ff" --experts 16 \
    --experts-used 4 --heads 8 --kv-heads 4 --head-dim 64 --vocab 4000 --type q8_0 --seed 11 --router-skew 2 \
    >/dev/null 2>&1
  rm -rf "$dir/sl"
  "$kv" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab 2 >/dev/null 2>&1
  echo "$name: wrote the model to $dir (fresh files: see docs/BENCHMARKS.md; a second run reuses them)"
}
