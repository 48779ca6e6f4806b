#!/usr/bin/env bash
# `make bench-gateway`: aggregate tokens/s for 1, 4 and 16 concurrent clients
# through `kvasir gateway -m MODEL` against llama.cpp decoding the same number
# of parallel sequences in one context (bench/gateway_bench.mjs), same model
# file and thread count. Not part of `make test`. See docs/BENCHMARKS.md.
#
#   bench/gateway.sh [path/to/kvasir]
#
# Env: KV_BENCH_THREADS (default: nproc), KV_BENCH_REPS (3), KV_BENCH_GW_N (32 tokens
#      per client), KV_BENCH_GW_CLIENTS ("1,4,16"), KV_BENCH_GW_SHAPE ("--preset small
#      --type q8_0": gen-model flags of the model), KV_BENCH_REGEN=1 rewrites the model.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
BIN=${1:-$SRC/build/kvasir}
BIN=$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")
OUT=$SRC/bench/out
THREADS=${KV_BENCH_THREADS:-$(nproc 2>/dev/null || echo 2)}
REPS=${KV_BENCH_REPS:-3}
N=${KV_BENCH_GW_N:-32}
CLIENTS=${KV_BENCH_GW_CLIENTS:-1,4,16}
SHAPE=${KV_BENCH_GW_SHAPE:---preset small --type q8_0}
export NODE_LLAMA_CPP_SKIP_DOWNLOAD=true
die() { echo "bench-gateway: $*" >&2; exit 1; }
[ -x "$BIN" ] || die "kvasir binary not found: $BIN"
[ -f "$SRC/tests/oracle/node_modules/node-llama-cpp/package.json" ] || die "oracle missing: run tools/install-oracle.sh"
mkdir -p "$OUT"
model=$OUT/gateway-model.gguf
if [ ! -f "$model" ] || [ "${KV_BENCH_REGEN:-0}" = 1 ]; then
  # shellcheck disable=SC2086
  "$BIN" gen-model $SHAPE --out "$model" >/dev/null
fi
max=$(echo "$CLIENTS" | tr ',' '\n' | sort -n | tail -1)
gw_out=$(mktemp) gw_err=$(mktemp)
"$BIN" gateway -m "$model" --name bench --listen 127.0.0.1:0 --threads "$THREADS" --parallel "$max" \
  --queue $((max * 2)) >"$gw_out" 2>"$gw_err" &
GW=$!
trap 'kill $GW 2>/dev/null; wait $GW 2>/dev/null; rm -f "$gw_out" "$gw_err"' EXIT
for _ in $(seq 600); do
  grep -q '^listening on ' "$gw_out" && break
  kill -0 $GW 2>/dev/null || die "gateway exited: $(cat "$gw_err")"
  sleep 0.1
done
addr=$(sed -n 's/^listening on //p' "$gw_out")
[ -n "$addr" ] || die "gateway did not start"
node "$SRC/bench/gateway_bench.mjs" "http://$addr" "$model" --threads "$THREADS" --clients "$CLIENTS" -n "$N" \
  --reps "$REPS" >"$OUT/gateway.json"
node -e '
const r = JSON.parse(require("fs").readFileSync(process.argv[1], "utf8"));
console.log(`${r.cpu}, ${r.nproc} cpus, load ${r.loadavg.map((x) => x.toFixed(2)).join(" ")}; ${r.threads} threads; best of ${r.reps} alternating rounds`);
console.log("clients  tokens each  kvasir tok/s  llama.cpp tok/s  ratio  (means: kvasir, llama.cpp, ratio)");
for (const x of r.rows)
  console.log(`${String(x.clients).padStart(7)}  ${String(x.n_gen_each).padStart(11)}  ${x.kvasir.tok_s.toFixed(1).padStart(12)}  ` +
    `${x.llama.tok_s.toFixed(1).padStart(15)}  ${x.ratio.toFixed(2).padStart(5)}  (${x.kvasir.tok_s_mean.toFixed(1)}, ${x.llama.tok_s_mean.toFixed(1)}, ${x.ratio_mean.toFixed(2)})`);
' "$OUT/gateway.json"
echo "bench-gateway: wrote $OUT/gateway.json"
