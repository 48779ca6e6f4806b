#!/usr/bin/env bash
# bench/llama_isa.sh ISA CMD...: runs CMD (the llama.cpp side of bench/run.sh)
# with node-llama-cpp's CPU variants above ISA hidden, so llama.cpp's
# run-time choice falls to that ISA's kernels as on a CPU that has no more.
# ISA: avx2 (the "haswell" variant: AVX2 + FMA + F16C, as Kvasir's avx2
# backend), avxvnni (also "alderlake": AVX2 + AVX-VNNI, as Kvasir's avxvnni
# backend) or native (no change). Hiding is a bind mount of /dev/null over
# each other variant's library inside a private mount namespace (unshare -m,
# needs root); without it the command runs unchanged and a note says so.
set -euo pipefail
ISA=$1; shift
[ "$ISA" = native ] && exec "$@"
case $ISA in avx2 | avxvnni) ;; *) echo "llama_isa: unknown ISA '$ISA' (avx2, avxvnni, native)" >&2; exit 2;; esac
SRC=$(cd "$(dirname "$0")/.." && pwd)
BINS=$(ls -d "$SRC"/tests/oracle/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64 2>/dev/null || true)
[ -n "$BINS" ] || { echo "llama_isa: node-llama-cpp binaries not found" >&2; exit 2; }
BINS=$(readlink -f "$BINS")
if ! unshare -m true 2>/dev/null; then
  echo "llama_isa: cannot make a mount namespace (not root?): llama.cpp runs its own best variant" >&2
  exec "$@"
fi
HIDE=""
for f in "$BINS"/libggml-cpu-*.so; do
  b=$(basename "$f")
  case $b in libggml-cpu-haswell.so|libggml-cpu-x64.so|libggml-cpu-sse42.so|libggml-cpu-sandybridge.so|libggml-cpu-ivybridge.so|libggml-cpu-piledriver.so) continue ;; esac
  [ "$ISA" = avxvnni ] && [ "$b" = libggml-cpu-alderlake.so ] && continue
  HIDE="$HIDE $f"
done
exec unshare -m bash -c 'for f in '"$HIDE"'; do mount --bind /dev/null "$f"; done; exec "$@"' llama_isa "$@"
