#!/usr/bin/env bash
# Runs the GGUF reader's libFuzzer target for a short, bounded time
# (KV_FUZZ_SECONDS, default 30) from the seeds in fuzz/corpus/gguf, and
# fails on any crash, sanitizer report, leak, slow input or OOM.
# The binary comes from the fuzz build: `make test` builds it (clang,
# -DKV_FUZZ=ON) and sets KV_FUZZ_BUILD. A missing binary is a failure, not a
# skip: an unfuzzed parser must not pass as a fuzzed one.
set -u
secs=${KV_FUZZ_SECONDS:-30}
src=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
if [ -z "${KV_FUZZ_BUILD:-}" ]; then
  echo "FAIL: KV_FUZZ_BUILD is not set; run through 'make test', which builds the fuzz build" \
       "(clang, -DKV_FUZZ=ON) and points KV_FUZZ_BUILD at it" >&2
  exit 1
fi
bin="$KV_FUZZ_BUILD/fuzz_gguf"
if [ ! -x "$bin" ]; then
  echo "FAIL: fuzz target $bin is missing; build it with" \
       "cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DKV_FUZZ=ON && cmake --build build-fuzz" >&2
  exit 1
fi
seeds="$src/fuzz/corpus/gguf"
if [ ! -d "$seeds" ] || [ -z "$(ls -A "$seeds")" ]; then
  echo "FAIL: seed corpus $seeds is missing or empty" >&2
  exit 1
fi
if ! nm "$bin" 2>/dev/null | grep -q __asan_init; then
  echo "WARNING: $bin is not built with AddressSanitizer: out-of-bounds reads that do not" \
       "segfault go unnoticed (the fuzz build should compile the library with" \
       "-fsanitize=fuzzer-no-link,address,undefined)" >&2
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/kv_fuzz_gguf.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/corpus"
log="$work/log"
"$bin" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix="$work/" "$work/corpus" "$seeds" >"$log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  echo "FAIL: fuzz_gguf exited with $rc; log tail:" >&2
  tail -n 60 "$log" >&2
  for f in "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-*; do
    [ -f "$f" ] || continue
    mkdir -p "${KV_BUILD:-$work}/fuzz-artifacts"
    cp "$f" "${KV_BUILD:-$work}/fuzz-artifacts/" && echo "reproducer saved: ${KV_BUILD:-$work}/fuzz-artifacts/$(basename "$f")" >&2
  done
  exit 1
fi
runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$')
cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1)
echo "fuzz_gguf: ${runs:-?} inputs in ${secs}s, ${cov:-cov unknown}, no crash"
if [ -z "${runs:-}" ] || [ "$runs" -lt 100 ]; then
  echo "FAIL: fuzz_gguf ran too few inputs (${runs:-0}); log tail:" >&2
  tail -n 20 "$log" >&2
  exit 1
fi
