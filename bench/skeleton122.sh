#!/usr/bin/env bash
# `make bench-122b`: the real Qwen3.5-122B-A10B shape, sliced and decoded
# over 3 loopback workers, against the same skeleton run in one process.
# Not part of `make test`; figures go in docs/BENCHMARKS.md.
#
#   bench/skeleton122.sh [path/to/kvasir]
#
# The skeleton (gen-model --preset qwen35-122b-a10b --skeleton) carries real
# values in its small tensors (embeddings of the learned tokens, norms,
# routers), so routing spreads over the experts as in a real model; experts
# and projections are holes that read as zeros. It is sliced into slabs of
# 32 experts (8 per layer, 392 in all) and slab j of each layer goes to
# worker j % 3. Both runs read the same bytes per token; the distributed one
# adds the dispatch: round trips and bytes on the wire per token. All runs
# use --allow-sparse (a skeleton has no hashes) and greedy decoding.
#
# Env: KV_BENCH_THREADS (coordinator threads, default nproc),
#      KV_BENCH_WORKER_THREADS (per worker, default 1), KV_BENCH_P (16),
#      KV_BENCH_N (16), KV_BENCH_REPS (2), KV_BENCH_DIR (/tmp/kv122).
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
BIN=${1:-$SRC/build/kvasir}
DIR=${KV_BENCH_DIR:-/tmp/kv122}
THREADS=${KV_BENCH_THREADS:-$(nproc 2>/dev/null || echo 2)}
WTHREADS=${KV_BENCH_WORKER_THREADS:-1}
P=${KV_BENCH_P:-16}
N=${KV_BENCH_N:-16}
REPS=${KV_BENCH_REPS:-2}
mkdir -p "$DIR"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

echo "cpu: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores; kernels: $(bash "$SRC/tools/cpu-backends.sh")"
if [ ! -f "$DIR/sl/manifest.json" ]; then
  "$BIN" gen-model --preset qwen35-122b-a10b --skeleton --out "$DIR/s.gguf" >/dev/null
  "$BIN" slice "$DIR/s.gguf" --out "$DIR/sl" --experts-per-slab 32 >/dev/null
fi
# the coordinator's folder: backbone + manifest only
mkdir -p "$DIR/coord"
cp --sparse=always "$DIR/sl/backbone.gguf" "$DIR/sl/manifest.json" "$DIR/coord/"

echo "one process: bench -m sliced skeleton (slabs mapped)"
"$BIN" bench -m "$DIR/sl/manifest.json" --allow-sparse -p "$P" -n "$N" --reps "$REPS" \
  --threads "$THREADS" --json > "$DIR/local.json"

addrs=()
for w in 0 1 2; do
  files=$(ls "$DIR"/sl/experts/*.gguf | awk -v w=$w -F'[.-]' '{ f = $(NF-2) + 0; if ((f / 32) % 3 == w) print }' | paste -sd,)
  "$BIN" worker --slabs "$files" --listen 127.0.0.1:0 --threads "$WTHREADS" --quiet --allow-sparse > "$DIR/w$w.out" 2>&1 &
  pids+=($!)
done
for w in 0 1 2; do
  for _ in $(seq 1 1200); do grep -q 'listening on' "$DIR/w$w.out" 2>/dev/null && break; sleep 0.1; done
  addrs+=(--worker "$(grep -o 'listening on [^ ]*' "$DIR/w$w.out" | awk '{print $3}')")
done
echo "3 workers: bench -m coordinator folder ${addrs[*]}"
"$BIN" bench -m "$DIR/coord/manifest.json" --allow-sparse -p "$P" -n "$N" --reps "$REPS" \
  --threads "$THREADS" "${addrs[@]}" --json > "$DIR/remote.json"

python3 - "$DIR/local.json" "$DIR/remote.json" <<'EOF'
import json, sys
l = json.load(open(sys.argv[1])); r = json.load(open(sys.argv[2]))
print("| run | decode tok/s | ms/token | MB weights/token | round trips/token | wire kB/token | layer RTT p50/p99 us | peak RSS MiB |")
print("|---|---|---|---|---|---|---|---|")
for name, j in (("one process", l), ("3 loopback workers", r)):
    tg = j["decode_tok_s"]
    rt = "%.2f" % j["rounds_per_step"] if "rounds_per_step" in j else "-"
    kb = "%.1f" % (j["bytes_per_step"] / 1e3) if "bytes_per_step" in j else "-"
    rtt = "%.0f / %.0f" % (j["layer_rtt_p50_us"], j["layer_rtt_p99_us"]) if "layer_rtt_p50_us" in j else "-"
    print("| %s | %.3f | %.1f | %.0f | %s | %s | %s | %.0f |" % (name, tg, 1000 / tg if tg else 0,
          j["bytes_per_token"] / 1e6, rt, kb, rtt, j["peak_rss_kb"] / 1024))
print("remote / local decode: %.2fx" % (r["decode_tok_s"] / l["decode_tok_s"]))
EOF
