#!/usr/bin/env bash
# `make bench`: Kvasir vs llama.cpp speed on synthetic models with
# Qwen3-30B-A3B layer shapes (n_embd 2048, 128 experts, top-8, n_ff_exp 768,
# 32/4 heads, head_dim 128, vocab 151936), few enough layers to be 1-2 GB,
# in Q8_0 and Q4_K. Not part of `make test`. See docs/BENCHMARKS.md.
#
#   bench/run.sh [path/to/kvasir]
#
# For each model: `kvasir bench --json` and llama.cpp (node-llama-cpp 3.21.1,
# bench/llama_bench.mjs) with the same thread count, prefill of 128 tokens
# and 64 decoded tokens, KV_BENCH_REPS alternating rounds (best and mean
# reported); the memory read
# bandwidth (a small C probe written and compiled here); the bytes of
# weights read per decoded token (from the GGUF tensor table); a table on
# stdout and everything in bench/out/results.json.
#
# Env: KV_BENCH_THREADS (default: nproc), KV_BENCH_REPS (5),
#      KV_BENCH_LAYERS_Q8_0 (2), KV_BENCH_LAYERS_Q4_K (4),
#      KV_BENCH_TYPES ("q8_0 q4_k"), KV_BENCH_REGEN=1 rewrites the models,
#      KV_BENCH_SHAPE="--preset small" other gen-model shape flags (smoke test).
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
BIN=${1:-$SRC/build/kvasir}
BIN=$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")
OUT=$SRC/bench/out
THREADS=${KV_BENCH_THREADS:-$(nproc 2>/dev/null || echo 2)}
REPS=${KV_BENCH_REPS:-5}
TYPES=${KV_BENCH_TYPES:-q8_0 q4_k}
P=128
N=64
mkdir -p "$OUT"
export NODE_LLAMA_CPP_SKIP_DOWNLOAD=true

die() { echo "bench: $*" >&2; exit 1; }
[ -x "$BIN" ] || die "kvasir binary not found: $BIN"
command -v node >/dev/null || die "node not found (llama.cpp side needs the test oracle: make oracle)"
[ -f "$SRC/tests/oracle/node_modules/node-llama-cpp/package.json" ] || die "oracle missing: run tools/install-oracle.sh"

# --- memory read bandwidth probe --------------------------------------------
# Each of T threads sums its own slice of a 1 GiB buffer (far above any
# cache) with wide vector loads; best of 5 passes. That is the ceiling for
# streaming weights from RAM, which is what decoding does.
cat > "$OUT/membw.c" <<'EOF'
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define BYTES ((size_t)1 << 30)
static uint64_t *buf; static size_t per; static int nt;
static volatile uint64_t sink[64];
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void *work(void *arg) {
  size_t id = (size_t)arg; const uint64_t *p = buf + id * per;
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
  for (size_t i = 0; i < per; i += 8) {
    a0 += p[i]; a1 += p[i + 1]; a2 += p[i + 2]; a3 += p[i + 3];
    a4 += p[i + 4]; a5 += p[i + 5]; a6 += p[i + 6]; a7 += p[i + 7];
  }
  sink[id] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
  return NULL;
}
int main(int argc, char **argv) {
  nt = argc > 1 ? atoi(argv[1]) : 1; if (nt < 1 || nt > 64) nt = 1;
  buf = aligned_alloc(64, BYTES); if (!buf) return 1;
  memset(buf, 1, BYTES);
  per = BYTES / 8 / nt; per -= per % 8;
  double best = 0;
  for (int rep = 0; rep < 5; rep++) {
    pthread_t th[64]; double t0 = now();
    for (int i = 0; i < nt; i++) pthread_create(&th[i], NULL, work, (void *)(size_t)i);
    for (int i = 0; i < nt; i++) pthread_join(th[i], NULL);
    double gbs = (double)per * 8 * nt / (now() - t0) / 1e9;
    if (gbs > best) best = gbs;
  }
  printf("{\"threads\":%d,\"read_gb_s\":%.2f,\"buffer_bytes\":%zu,\"method\":\"C, per-thread sum of a 1 GiB buffer, -O3 -march=native, best of 5\"}\n", nt, best, BYTES);
  return 0;
}
EOF
cc -O3 -march=native -pthread -o "$OUT/membw" "$OUT/membw.c"
echo "bench: memory bandwidth ($THREADS threads)..."
"$OUT/membw" "$THREADS" > "$OUT/membw.json"
"$OUT/membw" 1 > "$OUT/membw1.json"
cat "$OUT/membw.json"

# --- models -----------------------------------------------------------------
PRESET=qwen3-30b-a3b-bench
SHAPE=(--embd 2048 --experts 128 --experts-used 8 --ff-exp 768 --heads 32 --kv-heads 4 --head-dim 128 --vocab 151936)
HELP=$("$BIN" gen-model --help 2>&1 || true)
if echo "$HELP" | grep -q -- "$PRESET"; then SHAPE=(--preset "$PRESET"); fi
NAME=qwen3-30b-a3b-shape
# smoke test of this script: KV_BENCH_SHAPE="--preset small" (another file name)
if [ -n "${KV_BENCH_SHAPE:-}" ]; then read -r -a SHAPE <<< "$KV_BENCH_SHAPE"; NAME=custom-$(echo "$KV_BENCH_SHAPE" | tr -c 'A-Za-z0-9' '_'); fi
models=()
for t in $TYPES; do
  case $t in
    q8_0) L=${KV_BENCH_LAYERS_Q8_0:-2} ;;
    q4_k) L=${KV_BENCH_LAYERS_Q4_K:-4} ;;
    *) L=${KV_BENCH_LAYERS:-2} ;;
  esac
  f="$OUT/$NAME-$t-L$L.gguf"
  if [ ! -f "$f" ] || [ -n "${KV_BENCH_REGEN:-}" ]; then
    echo "bench: kvasir gen-model ${SHAPE[*]} --layers $L --type $t -> $f"
    "$BIN" gen-model --arch qwen3moe "${SHAPE[@]}" --layers "$L" --type "$t" --ctx 4096 --seed 7 --out "$f.tmp"
    mv "$f.tmp" "$f"
  fi
  models+=("$t:$f")
done

# --- runs -------------------------------------------------------------------
for m in "${models[@]}"; do
  t=${m%%:*}; f=${m#*:}
  echo "bench: $t: weights per token"
  node "$SRC/bench/llama_bench.mjs" bytes "$f" > "$OUT/$t.bytes.json"
  # Rounds alternate the two engines so that both see the same machine
  # load (the shared build machine is noisy); each round is one process
  # with its own untimed warm-up.
  : > "$OUT/$t.kvasir.jsonl"
  : > "$OUT/$t.llama.jsonl"
  for r in $(seq "$REPS"); do
    echo "bench: $t: round $r/$REPS: kvasir bench -p $P -n $N --threads $THREADS; llama.cpp the same"
    "$BIN" bench -m "$f" -p "$P" -n "$N" --threads "$THREADS" --reps 1 --json >> "$OUT/$t.kvasir.jsonl"
    echo >> "$OUT/$t.kvasir.jsonl"
    node "$SRC/bench/llama_bench.mjs" speed "$f" --threads "$THREADS" -p "$P" -n "$N" --reps 1 >> "$OUT/$t.llama.jsonl"
  done
done

node "$SRC/bench/llama_bench.mjs" report "$OUT" "$THREADS" $TYPES
