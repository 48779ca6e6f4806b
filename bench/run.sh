#!/usr/bin/env bash
# `make bench`: Kvasir vs llama.cpp speed on synthetic qwen3moe models with
# Qwen3-30B-A3B layer shapes (n_embd 2048, 128 experts, top-8, n_ff_exp 768,
# 32/4 heads, head_dim 128, vocab 151936), few enough layers to be 1-2 GB,
# in Q8_0 and Q4_K, and on qwen35moe models (below). Not part of `make test`.
# See docs/BENCHMARKS.md.
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
# A second family, qwen35moe with Qwen3.5-35B-A3B layer shapes (the
# skeleton preset qwen35-35b-a3b's: n_embd 2048, 256 experts, top-8,
# n_ff_exp 512, shared expert 512, 16/2 heads x 256, delta net 16 key /
# 32 value heads x 128, conv 4, full attention every 4th block, rope dims 64
# in sections 11,11,10,0, vocab 248320), 4 layers = 3 linear-attention + 1
# full-attention block, no MTP block; keys qwen35-q4_k, qwen35-q8_0.
#
# Every thread count of KV_BENCH_THREADS ("1 2" by default, or nproc if
# that is 1) runs in the same invocation, and one table lists them all:
# model, threads, prefill and decode ratio against llama.cpp, the prefill
# ratio again with every prompt token through Kvasir's whole last block
# (`kvasir bench --all-rows`: what the blocks cost per token, without the
# saving of running the last block's attention output and experts only for
# the token with logits, which on these 2-4 layer models is a quarter to a
# half of the work and on a 48-layer one about 2%), decode bound,
# and the time to first token of a KV_BENCH_TTFT-token prompt (2048; one
# alternating round per model and thread count; 0 skips it).
# KV_BENCH_ISA=avx2 benchmarks the AVX2 paths on a CPU that has more:
# Kvasir with KV_QUANT_BACKEND=avx2, llama.cpp with its variants above
# "haswell" hidden (bench/llama_isa.sh; needs root for a mount namespace);
# KV_BENCH_ISA=avxvnni the same for AVX2 + AVX-VNNI (Intel client CPUs):
# Kvasir's avxvnni backend against llama.cpp's "alderlake" variant.
# q4_k_m: Q4_K with ffn_down*, attn_v and output in Q6_K (llama.cpp's mix).
#
# Env: KV_BENCH_THREADS ("1 2"), KV_BENCH_REPS (5), KV_BENCH_TTFT (2048), KV_BENCH_ISA (native),
#      KV_BENCH_ARCHS ("qwen3moe qwen35moe"; also deepseek2, gpt-oss: keys ds2-T, gptoss-T),
#      KV_BENCH_DS2_TYPES ("q8_0 q4_k"), KV_BENCH_DS2_LAYERS_Q8_0 (2), KV_BENCH_DS2_LAYERS_Q4_K (4),
#      KV_BENCH_GPTOSS_TYPES ("q8_0 mxfp4"), KV_BENCH_GPTOSS_LAYERS_Q8_0 / _MXFP4 (2),
#      KV_BENCH_LAYERS_Q8_0 (2), KV_BENCH_LAYERS_Q4_K (4),
#      KV_BENCH_Q35_LAYERS_Q8_0 (4), KV_BENCH_Q35_LAYERS_Q4_K (4),
#      KV_BENCH_TYPES ("q8_0 q4_k q4_k_m"; both families), KV_BENCH_REGEN=1 rewrites the models,
#      KV_BENCH_SHAPE="--preset small" other gen-model shape flags (smoke test),
#      KV_BENCH_Q35_SHAPE="..." the same for qwen35moe,
#      KV_BENCH_RESULTS (results.json) the summary's file name in bench/out,
#      KV_BENCH_122B (1; 0 skips the 122B skeleton rows), KV_BENCH_122B_REPS (3 warm rounds),
#      KV_BENCH_COLD_REPS (2).
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
BIN=${1:-$SRC/build/kvasir}
BIN=$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")
OUT=$SRC/bench/out
NPROC=$(nproc 2>/dev/null || echo 2)
THREADS=${KV_BENCH_THREADS:-$([ "$NPROC" -ge 2 ] && echo "1 2" || echo 1)}
TTFT=${KV_BENCH_TTFT:-2048}
ISA=${KV_BENCH_ISA:-native}
case $ISA in
  native) KVENV=() ;;
  avx2) KVENV=(KV_QUANT_BACKEND=avx2) ;;
  avxvnni) KVENV=(KV_QUANT_BACKEND=avxvnni) ;;
  *) echo "bench: KV_BENCH_ISA: native, avx2 or avxvnni" >&2; exit 1 ;;
esac
REPS=${KV_BENCH_REPS:-5}
TYPES=${KV_BENCH_TYPES:-q8_0 q4_k q4_k_m}
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
# cache) with wide vector loads, with the hardware prefetcher alone and with
# software prefetch 1-16 KiB ahead (as the weight kernels do); the best of
# all is the ceiling for streaming weights from RAM, which is what decoding does.
cat > "$OUT/membw.c" <<'EOF'
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define BYTES ((size_t)1 << 30)
static uint64_t *buf; static size_t per; static int nt; static size_t pfd;
static volatile uint64_t sink[64];
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void *work(void *arg) {
  size_t id = (size_t)arg; const uint64_t *p = buf + id * per;
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
  const size_t d = pfd / 8;
  for (size_t i = 0; i < per; i += 8) {
    if (d) __builtin_prefetch(p + i + d);
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
  /* the hardware prefetcher alone, and software prefetch 1-16 KiB ahead
   * (the weight kernels prefetch rows ahead): the best of all is the bound */
  static const size_t dist[] = {0, 1024, 2048, 4096, 8192, 16384};
  double best = 0, best_plain = 0; size_t best_d = 0;
  for (size_t k = 0; k < sizeof dist / sizeof dist[0]; k++) {
    pfd = dist[k];
    for (int rep = 0; rep < 3; rep++) {
      pthread_t th[64]; double t0 = now();
      for (int i = 0; i < nt; i++) pthread_create(&th[i], NULL, work, (void *)(size_t)i);
      for (int i = 0; i < nt; i++) pthread_join(th[i], NULL);
      double gbs = (double)per * 8 * nt / (now() - t0) / 1e9;
      if (gbs > best) { best = gbs; best_d = pfd; }
      if (!pfd && gbs > best_plain) best_plain = gbs;
    }
  }
  printf("{\"threads\":%d,\"read_gb_s\":%.2f,\"read_gb_s_no_prefetch\":%.2f,\"prefetch_bytes\":%zu,\"buffer_bytes\":%zu,"
         "\"method\":\"C, per-thread sum of a 1 GiB buffer, -O3 -march=native, best of 3 for each software prefetch distance (none, 1-16 KiB)\"}\n",
         nt, best, best_plain, best_d, BYTES);
  return 0;
}
EOF
cc -O3 -march=native -pthread -o "$OUT/membw" "$OUT/membw.c"
for th in $THREADS; do
  echo "bench: memory bandwidth ($th threads)..."
  "$OUT/membw" "$th" > "$OUT/membw-t$th.json"
  cat "$OUT/membw-t$th.json"
done

# --- models -----------------------------------------------------------------
ARCHS=${KV_BENCH_ARCHS:-qwen3moe qwen35moe}
HELP=$("$BIN" gen-model --help 2>&1 || true)
models=()
# gen_models ARCH NAME KEYPREFIX LAYERVAR_PREFIX SHAPE...
gen_models() {
  local arch=$1 name=$2 kp=$3 lv=$4; shift 4
  local t L f v
  for t in $TYPES; do
    case $t in
      q8_0) v=${lv}Q8_0; L=${!v:-} ;;
      q4_k|q4_k_m) v=${lv}Q4_K; L=${!v:-} ;;
      *) v=${lv}${t^^}; L=${!v:-${KV_BENCH_LAYERS:-}} ;;
    esac
    [ -n "$L" ] || case $arch:$t in qwen3moe:q4_k*|qwen35moe:*|deepseek2:q4_k*) L=4 ;; *) L=2 ;; esac
    f="$OUT/$name-$t-L$L.gguf"
    if [ ! -f "$f" ] || [ -n "${KV_BENCH_REGEN:-}" ]; then
      echo "bench: kvasir gen-model --arch $arch $* --layers $L --type $t -> $f"
      "$BIN" gen-model --arch "$arch" "$@" --layers "$L" --type "$t" --ctx 4096 --seed 7 --out "$f.tmp"
      mv "$f.tmp" "$f"
    fi
    models+=("$kp$t:$f")
  done
}
for arch in $ARCHS; do
  case $arch in
    qwen3moe)
      PRESET=qwen3-30b-a3b-bench
      SHAPE=(--embd 2048 --experts 128 --experts-used 8 --ff-exp 768 --heads 32 --kv-heads 4 --head-dim 128 --vocab 151936)
      if echo "$HELP" | grep -q -- "$PRESET"; then SHAPE=(--preset "$PRESET"); fi
      NAME=qwen3-30b-a3b-shape
      # smoke test of this script: KV_BENCH_SHAPE="--preset small" (another file name)
      if [ -n "${KV_BENCH_SHAPE:-}" ]; then read -r -a SHAPE <<< "$KV_BENCH_SHAPE"; NAME=custom-$(echo "$KV_BENCH_SHAPE" | tr -c 'A-Za-z0-9' '_'); fi
      gen_models qwen3moe "$NAME" "" KV_BENCH_LAYERS_ "${SHAPE[@]}" ;;
    qwen35moe)
      # Qwen3.5-35B-A3B (src/slice/skeleton.c, preset qwen35-35b-a3b): 40 blocks
      # there, a few here; the MTP block is left out (it is not run per token)
      SHAPE=(--embd 2048 --experts 256 --experts-used 8 --ff-exp 512 --ff-shexp 512 --heads 16 --kv-heads 2
             --head-dim 256 --vocab 248320 --attn-interval 4 --ssm-conv 4 --ssm-state 128 --ssm-groups 16
             --ssm-heads 32 --rope-dim 64 --rope-sections 11,11,10,0 --nextn 0)
      NAME=qwen35-35b-a3b-shape
      if [ -n "${KV_BENCH_Q35_SHAPE:-}" ]; then read -r -a SHAPE <<< "$KV_BENCH_Q35_SHAPE"; NAME=custom35-$(echo "$KV_BENCH_Q35_SHAPE" | tr -c 'A-Za-z0-9' '_'); fi
      gen_models qwen35moe "$NAME" qwen35- KV_BENCH_Q35_LAYERS_ "${SHAPE[@]}" ;;
    deepseek2)
      # DeepSeek-V3's routing and MLA head shapes at n_embd 2048 (gen-model
      # --preset deepseek-v3-bench): Q8_0 2 layers = the dense first block +
      # one MoE block, Q4_K 4 layers
      TYPES=${KV_BENCH_DS2_TYPES:-q8_0 q4_k} gen_models deepseek2 deepseek-v3-bench ds2- KV_BENCH_DS2_LAYERS_ --preset deepseek-v3-bench ;;
    gpt-oss)
      # gpt-oss-20b's blocks (gen-model --preset gpt-oss-20b-bench), 2 layers
      # = one sliding-window block and one full; its expert rows of 2880 do
      # not fit K-quant blocks, so Q8_0 and MXFP4 (the published experts' type)
      TYPES=${KV_BENCH_GPTOSS_TYPES:-q8_0 mxfp4} gen_models gpt-oss gpt-oss-20b-bench gptoss- KV_BENCH_GPTOSS_LAYERS_ --preset gpt-oss-20b-bench ;;
    *) die "unknown arch in KV_BENCH_ARCHS: $arch (qwen3moe, qwen35moe, deepseek2, gpt-oss)" ;;
  esac
done

# --- runs -------------------------------------------------------------------
LL=("$SRC/bench/llama_isa.sh" "$ISA" node "$SRC/bench/llama_bench.mjs")
keys=()
for m in "${models[@]}"; do
  t=${m%%:*}; f=${m#*:}
  echo "bench: $t: weights per token"
  node "$SRC/bench/llama_bench.mjs" bytes "$f" > "$OUT/$t.bytes.json"
  for th in $THREADS; do
    k=$t.t$th; keys+=("$k")
    # Rounds alternate the two engines so that both see the same machine
    # load (the shared build machine is noisy); each round is one process
    # with its own untimed warm-up.
    : > "$OUT/$k.kvasir.jsonl"
    : > "$OUT/$k.llama.jsonl"
    : > "$OUT/$k.membw.jsonl"
    for r in $(seq "$REPS"); do
      # this VM's read bandwidth drifts from minute to minute: each round
      # reads the probe again, and the report also gives decode against the
      # bound of its own round
      "$OUT/membw" "$th" >> "$OUT/$k.membw.jsonl"
      echo "bench: $k: round $r/$REPS: kvasir bench -p $P -n $N --threads $th; llama.cpp the same ($ISA)"
      env "${KVENV[@]}" "$BIN" bench -m "$f" -p "$P" -n "$N" --threads "$th" --reps 1 --all-rows --json >> "$OUT/$k.kvasir.jsonl"
      echo >> "$OUT/$k.kvasir.jsonl"
      "${LL[@]}" speed "$f" --threads "$th" -p "$P" -n "$N" --reps 1 >> "$OUT/$k.llama.jsonl"
    done
    rm -f "$OUT/$k.ttft.kvasir.json" "$OUT/$k.ttft.llama.json"
    if [ "$TTFT" -gt 0 ]; then
      # time to first token: a TTFT-token prompt evaluated and the next token
      # picked, one alternating round
      echo "bench: $k: time to first token, $TTFT-token prompt"
      env "${KVENV[@]}" "$BIN" bench -m "$f" -p "$TTFT" -n 1 --threads "$th" --reps 1 --json > "$OUT/$k.ttft.kvasir.json"
      "${LL[@]}" speed "$f" --threads "$th" -p "$TTFT" -n 1 --reps 1 > "$OUT/$k.ttft.llama.json"
    fi
  done
done

# --- the real 122B shape: Qwen3.5-122B-A10B skeleton (no peer: llama.cpp
# asks for 56 GB to load it on this 24 GB machine) ---------------------------
# Warm decode against the read-bandwidth bound, with the per-stage profile,
# at each thread count; then the cold start (page cache dropped, needs root)
# of `kvasir run -n 1`, with and without the backbone prefault, alternating.
rm -f "$OUT"/s122.*.json "$OUT"/s122.*.jsonl
if [ "${KV_BENCH_122B:-1}" = 1 ]; then
  S122=$OUT/qwen35-122b-a10b-skeleton.gguf
  [ -f "$S122" ] || "$BIN" gen-model --preset qwen35-122b-a10b --skeleton --out "$S122"
  R122=${KV_BENCH_122B_REPS:-3}
  for th in $THREADS; do
    # rounds as for the models above: the probe read again before each one
    # process, so each round is against the bandwidth of its own minute
    : > "$OUT/s122.t$th.membw.jsonl"
    : > "$OUT/s122.t$th.jsonl"
    for r in $(seq "$R122"); do
      echo "bench: 122B skeleton: kvasir bench -p 16 -n 24 --threads $th --profile (warm, round $r/$R122)"
      "$OUT/membw" "$th" >> "$OUT/s122.t$th.membw.jsonl"
      env "${KVENV[@]}" "$BIN" bench -m "$S122" -p 16 -n 24 --threads "$th" --reps 1 --profile --json >> "$OUT/s122.t$th.jsonl"
      echo >> "$OUT/s122.t$th.jsonl"
    done
  done
  if ( echo 1 > /proc/sys/vm/drop_caches ) 2>/dev/null; then
    for r in $(seq "${KV_BENCH_COLD_REPS:-2}"); do
      for pf in prefault no-prefault; do
        flag=(); [ $pf = no-prefault ] && flag=(--no-prefault)
        sync; echo 3 > /proc/sys/vm/drop_caches
        echo "bench: 122B skeleton: cold kvasir run -n 1 ($pf, round $r)"
        t0=$(date +%s.%N)
        env "${KVENV[@]}" "$BIN" run -m "$S122" -p "The capital of France is" -n 1 --threads "$NPROC" --json "${flag[@]}" > "$OUT/s122.cold.tmp"
        t1=$(date +%s.%N)
        jq -c --arg pf $pf --argjson wall "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')" '{mode: $pf, wall_s: $wall, prefill_s: .engine.prefill_s, prompt_tokens: (.prompt_tokens | length)}' \
          "$OUT/s122.cold.tmp" >> "$OUT/s122.cold.json"
      done
    done
    rm -f "$OUT/s122.cold.tmp"
  else
    echo "bench: 122B cold start skipped: cannot drop the page cache (not root)"
  fi
fi

KV_BENCH_ISA=$ISA KV_BENCH_RESULTS=${KV_BENCH_RESULTS:-results.json} node "$SRC/bench/llama_bench.mjs" report "$OUT" "$THREADS" "${keys[@]}"
