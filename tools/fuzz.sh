#!/usr/bin/env bash
# Runs every libFuzzer target in a fuzz build for a bounded time each.
#   tools/fuzz.sh BUILD_DIR [SECONDS]     (make fuzz: BUILD_DIR=build-fuzz, SECONDS=300)
# Target BUILD_DIR/fuzz_X starts from the seeds in fuzz/corpus/X (if any);
# inputs it discovers go to BUILD_DIR/fuzz-work/X (the seed folder in the
# repository is never written), crash reproducers to BUILD_DIR/fuzz-artifacts.
# Exits non-zero if any target crashes, leaks, times out on an input or
# exceeds its memory limit, or if no target was found.
set -u
build=${1:?usage: tools/fuzz.sh BUILD_DIR [SECONDS]}
secs=${2:-300}
src=$(cd "$(dirname "$0")/.." && pwd)
case $secs in ''|*[!0-9]*) echo "fuzz.sh: SECONDS must be a positive integer, got '$secs'" >&2; exit 2;; esac

shopt -s nullglob
targets=("$build"/fuzz_*)
found=0
failed=()
for bin in "${targets[@]}"; do
  [ -f "$bin" ] && [ -x "$bin" ] || continue
  found=$((found + 1))
  name=$(basename "$bin"); name=${name#fuzz_}
  work="$build/fuzz-work/$name"; arts="$build/fuzz-artifacts"
  mkdir -p "$work" "$arts"
  seeds=()
  [ -d "$src/fuzz/corpus/$name" ] && seeds=("$src/fuzz/corpus/$name")
  echo "== fuzz_$name for ${secs}s (seeds: ${seeds[*]:-none})"
  if ! "$bin" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
       -artifact_prefix="$arts/$name-" "$work" "${seeds[@]}" 2>"$build/fuzz-$name.log"; then
    echo "fuzz_$name FAILED; last lines of $build/fuzz-$name.log:" >&2
    tail -n 40 "$build/fuzz-$name.log" >&2
    failed+=("$name")
  else
    grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb)' "$build/fuzz-$name.log" || true
    grep -o 'cov: [0-9]*' "$build/fuzz-$name.log" | tail -n 1 || true
  fi
done
if [ "$found" -eq 0 ]; then
  echo "fuzz.sh: no fuzz_* executables in '$build' (configure with -DKV_FUZZ=ON and clang)" >&2
  exit 1
fi
if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzz.sh: crashed: ${failed[*]} (reproducers in $build/fuzz-artifacts)" >&2
  exit 1
fi
echo "fuzz.sh: $found target(s) ran ${secs}s each without a crash"
