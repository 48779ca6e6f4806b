#!/usr/bin/env bash
# kv-test-labels: fuzz
# Runs every libFuzzer target (one per parser: fuzz/fuzz_<name>.c) for a
# short, bounded time (KV_FUZZ_SECONDS each, default 12) from its seeds in
# fuzz/corpus/<name>, and fails on any crash, sanitizer report, leak, slow
# input or OOM. The binaries come from the fuzz build: `make test` builds it
# (clang, -DKV_FUZZ=ON: library instrumented with ASan/UBSan) and sets
# KV_FUZZ_BUILD. A missing binary is a failure, not a skip: an unfuzzed
# parser must not pass as a fuzzed one. The seed is fixed (KV_FUZZ_SEED, default 1) so a
# run is repeatable; longer and randomly seeded runs: `make fuzz`.
set -u
secs=${KV_FUZZ_SECONDS:-12}
src=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
if [ -z "${KV_FUZZ_BUILD:-}" ]; then
  echo "FAIL: KV_FUZZ_BUILD is not set; run through 'make test', which builds the fuzz build" \
       "(clang, -DKV_FUZZ=ON) and points KV_FUZZ_BUILD at it" >&2
  exit 1
fi
names=()
for f in "$src"/fuzz/fuzz_*.c; do n=$(basename "$f" .c); names+=("${n#fuzz_}"); done
if [ ${#names[@]} -eq 0 ]; then echo "FAIL: no fuzz targets under $src/fuzz" >&2; exit 1; fi

run_one() {
  local name=$1 bin="$KV_FUZZ_BUILD/fuzz_$1" seeds="$src/fuzz/corpus/$1"
  if [ ! -x "$bin" ]; then
    echo "FAIL: fuzz target $bin is missing; build it with" \
         "cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DKV_FUZZ=ON && cmake --build build-fuzz --target fuzzers" >&2
    return 1
  fi
  if [ ! -d "$seeds" ] || [ -z "$(ls -A "$seeds")" ]; then
    echo "FAIL: seed corpus $seeds is missing or empty" >&2
    return 1
  fi
  if ! nm "$bin" 2>/dev/null | grep -q __asan_init; then
    echo "FAIL: $bin is not built with AddressSanitizer" >&2
    return 1
  fi
  local work
  work=$(mktemp -d "${TMPDIR:-/tmp}/kv_fuzz_$name.XXXXXX")
  mkdir -p "$work/corpus"
  local log="$work/log"
  "$bin" -seed="${KV_FUZZ_SEED:-1}" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$work/" "$work/corpus" "$seeds" >"$log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "FAIL: fuzz_$name exited with $rc; log tail:" >&2
    tail -n 60 "$log" >&2
    for f in "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-*; do
      [ -f "$f" ] || continue
      mkdir -p "${KV_BUILD:-$KV_FUZZ_BUILD}/fuzz-artifacts"
      cp "$f" "${KV_BUILD:-$KV_FUZZ_BUILD}/fuzz-artifacts/" && echo "reproducer saved: ${KV_BUILD:-$KV_FUZZ_BUILD}/fuzz-artifacts/$(basename "$f")" >&2
    done
    rm -rf "$work"
    return 1
  fi
  local runs cov
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$')
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1)
  echo "fuzz_$name: ${runs:-?} inputs in ${secs}s, ${cov:-cov unknown}, no crash"
  if [ -z "${runs:-}" ] || [ "$runs" -lt 100 ]; then
    echo "FAIL: fuzz_$name ran too few inputs (${runs:-0}); log tail:" >&2
    tail -n 20 "$log" >&2
    rm -rf "$work"
    return 1
  fi
  rm -rf "$work"
}

fail=0
for n in "${names[@]}"; do run_one "$n" || fail=1; done
exit $fail
