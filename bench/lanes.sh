#!/usr/bin/env bash
# Two coordinators as two micro-batches (docs/BENCHMARKS.md "Why 1.5x at 16
# clients is out of reach on two cores"): does splitting bench-autoscale's
# 16 sequences into two coordinators of 8 on the gateway's core, so that one
# runs its attention while the other waits for the workers (the overlap that
# DeepSeek's two-batch overlap builds into one step), beat one local-only
# coordinator of 16?
#
#   bench/lanes.sh [path/to/kvasir] [REPS]
#
# The model and workers of bench/pair_cost.sh (kept in bench/out/paircost-FF,
# KV_PC_FF_EXP default 768; two `kvasir worker --threads 1` on CPU 1). Each
# round, all on CPU 0 with `kvasir bench -p 8 -n 128 --threads 1`:
#   local16   one local-only bench of 16 sequences, from the slab files (the
#             sliced model, no workers: the pages the workers and the sliced
#             benches compute on)
#   gguf16    the same from the GGUF. On this VM one file's memory can run
#             slower or faster than another's for minutes (docs/BENCHMARKS.md),
#             so the comparisons are made on the same files, and this row
#             shows how far the GGUF's pages were off
#   local8    one local-only bench of 8 sequences (slab files)
#   local8x2  two of them at once (what sharing the core costs)
#   sS x2     two sliced benches of 8 at once, local share S (KV_LANES_SHARES,
#             default 0 0.5 0.75), the rest on the workers
#   sSx1      one sliced bench of 16 at share S (KV_LANES_ONE, default 0.5)
# Each figure is the decode tokens/s a bench reports (the median of its 3
# repetitions; the sum of both for a pair, which decode side by side) and the
# benches' CPU (user + system, both for a pair: model loads, prompts and all);
# printed per round, then as medians: tokens/s, and over the local16 run of
# the same round; the last line as JSON.
set -euo pipefail
KV=$(realpath "${1:-build/kvasir}")
REPS=${2:-3}
FF=${KV_PC_FF_EXP:-768}
[ "$(nproc)" -ge 2 ] || { echo "bench/lanes.sh: needs 2 CPUs" >&2; exit 1; }
M=${KV_PC_DIR:-$(dirname "$0")/out/paircost-$FF}
D=$(mktemp -d "${TMPDIR:-/tmp}/kv_bench_lanes.XXXXXX")
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$D"
}
trap cleanup EXIT
. "$(dirname "$0")/paircost_model.sh"
paircost_model "$KV" "$FF" "$M" bench/lanes.sh
PK=$("$KV" key --key "$D/coord.key")
ADDR=()
for n in a b; do
  taskset -c 1 "$KV" worker --slabs "$M/sl/experts" --listen 127.0.0.1:0 --threads 1 --allow-key "$PK" --quiet \
    >"$D/w$n.out" 2>"$D/w$n.err" &
  PIDS+=("$!")
done
for n in a b; do
  for _ in $(seq 1 200); do grep -q '^listening on ' "$D/w$n.out" && break; sleep 0.05; done
  ADDR+=(--worker "$(sed -n 's/^listening on //p' "$D/w$n.out")")
done
NTOK=128
gguf() { taskset -c 0 "$KV" bench -m "$M/m.gguf" --parallel "$1" -p 8 -n $NTOK --threads 1 --json; }
loc() { taskset -c 0 "$KV" bench -m "$M/sl/manifest.json" --parallel "$1" -p 8 -n $NTOK --threads 1 --json; }
sl() {
  taskset -c 0 "$KV" bench -m "$M/sl/manifest.json" "${ADDR[@]}" --key "$D/coord.key" --parallel "$1" -p 8 -n $NTOK \
    --threads 1 --json --local-share "$2"
}
timed() { # OUT CPUFILE CMD...: runs CMD (stdout to OUT), its user + system seconds to CPUFILE
  local out=$1 cf=$2 TIMEFORMAT='%U %S'
  shift 2
  { time "$@" >"$out"; } 2>"$cf.t"
  awk '{ print $1 + $2 }' "$cf.t" >"$cf"
}
run1() { # NAME N CMD...: one bench alone; prints NAME tok/s cpu_s
  local name=$1
  shift 2
  timed "$D/o1.json" "$D/c1" "$@"
  echo "$name $(jq -r .decode_tok_s "$D/o1.json") $(cat "$D/c1")"
}
run2() { # NAME N CMD...: two at once; prints NAME tok/s (both) cpu_s (both)
  local name=$1 p1 p2
  shift 2
  timed "$D/o1.json" "$D/c1" "$@" &
  p1=$!
  timed "$D/o2.json" "$D/c2" "$@" &
  p2=$!
  wait "$p1" "$p2"
  echo "$name $(jq -s '.[0].decode_tok_s + .[1].decode_tok_s' "$D/o1.json" "$D/o2.json") \
    $(cat "$D/c1" "$D/c2" | awk '{ s += $1 } END { print s }')"
}
SHARES=${KV_LANES_SHARES:-0 0.5 0.75}
ONE=${KV_LANES_ONE:-0.5} # one sliced bench of 16 at this share, for comparison
echo "bench/lanes.sh: $REPS rounds on CPU 0, workers on CPU 1 ($(lscpu | sed -n 's/^Model name: *//p'), experts of 512 x $FF)"
: >"$D/all.txt"
for r in $(seq 1 "$REPS"); do
  {
    run1 local16 16 loc 16
    run1 gguf16 16 gguf 16
    run1 local8 8 loc 8
    run2 local8x2 8 loc 8
    for s in $SHARES; do run2 "s${s}x2" 8 sl 8 "$s"; done
    run1 "s${ONE}x1" 16 sl 16 "$ONE"
  } | tee "$D/r.txt" | sed "s/^/  round $r: /"
  awk -v r="$r" '{ print r, $0 }' "$D/r.txt" >>"$D/all.txt"
done
python3 - "$D/all.txt" <<'PYEOF'
import json, statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
tok = {(r, n): float(t) for r, n, t, c in rows}
cpu = {(r, n): float(c) for r, n, t, c in rows}
rounds = sorted({r for r, n, t, c in rows})
names = list(dict.fromkeys(n for r, n, t, c in rows))
res = {}
for n in names:
    res[n] = {"tok_s": round(statistics.median(tok[(r, n)] for r in rounds), 1),
              "tok_s_over_local16": round(statistics.median(tok[(r, n)] / tok[(r, "local16")] for r in rounds), 3),
              "cpu_over_local16": round(statistics.median(cpu[(r, n)] / cpu[(r, "local16")] for r in rounds), 3)}
print("%-10s %9s %12s %14s" % ("", "tok/s", "/ local16", "CPU / local16"))
for n, v in res.items():
    print("%-10s %9.1f %12.3f %14.3f" % (n, v["tok_s"], v["tok_s_over_local16"], v["cpu_over_local16"]))
print(json.dumps(res))
PYEOF
