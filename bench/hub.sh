#!/usr/bin/env bash
# Hub benchmarks (make bench-hub): the market view at the 122B skeleton's
# scale (12,544 shards, 2,000 nodes) and a load of 2,000 nodes heartbeating
# every 5 s while coordinators read the placement map. Loopback only.
# Figures: docs/BENCHMARKS.md. HUB_LOAD_SECONDS sets the load duration (30).
# HUB_PG=1 runs the load a second time on a throw-away PostgreSQL store
# (tests/pg_env.sh), in the same invocation, so the two compare as a ratio.
set -euo pipefail
build=${1:-build}
bin=$build/kvasir
work=$(mktemp -d "${TMPDIR:-/tmp}/kv_bench_hub.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -n1), $(nproc) threads"
"$bin" gen-model --preset qwen35-122b-a10b --skeleton --out "$work/s.gguf" >/dev/null 2>&1 2>&1
"$bin" slice "$work/s.gguf" --out "$work/s" --experts-per-slab 1 >/dev/null 2>&1 2>&1
"$build/bench_hub" market "$work/s/manifest.json" --nodes 2000 --reps 20
"$bin" gen-model --preset tiny --out "$work/t.gguf" >/dev/null 2>&1 2>&1
"$bin" slice "$work/t.gguf" --out "$work/t" --experts-per-slab 1 >/dev/null 2>&1 2>&1
"$build/bench_hub" load "$work/t/manifest.json" --nodes 2000 --seconds "${HUB_LOAD_SECONDS:-30}" \
  --interval-ms 5000 --threads 16 --readers 4 --read-ms 100
if [ "${HUB_PG:-0}" = 1 ]; then
  src=$(cd "$(dirname "$0")/.." && pwd)
  # shellcheck source=../tests/pg_env.sh
  source "$src/tests/pg_env.sh"
  trap 'kv_pg_stop; rm -rf "$work"' EXIT
  kv_pg_start
  echo "--- the same load on a PostgreSQL store ($(psql -X -At "$KV_PG" -c 'SHOW server_version'), unix socket, fsync off)"
  "$build/bench_hub" load "$work/t/manifest.json" --nodes 2000 --seconds "${HUB_LOAD_SECONDS:-30}" \
    --interval-ms 5000 --threads 16 --readers 4 --read-ms 100 --db "$(kv_pg_createdb kvbench)"
fi
