#!/usr/bin/env bash
# `make bench-pair-cost`: what one remote expert pair costs the coordinator
# and the nodes against computing it in the coordinator, and the most that
# `make bench-autoscale`'s layout (gateway on CPU 0, both nodes on CPU 1)
# can gain at 16 clients with those costs (docs/BENCHMARKS.md "Remote expert
# pairs" and "Why 1.5x is out of reach on two cores").
#
#   bench/pair_cost.sh [path/to/kvasir] [REPS]
#
# The model and layout of bench/autoscale.sh without the hub and the
# gateway: a synthetic qwen3moe (8 layers, embd 512, 16 experts of
# KV_PC_FF_EXP (768), top-4, q8_0, --router-skew 2) sliced 2 experts per
# slab; two `kvasir worker --threads 1` holding every slab on CPU 1; the
# coordinator `kvasir bench --parallel 16 -p 8 -n 128 --threads 1` on CPU 0
# with every expert on the workers (TLS on loopback), then the same bench on
# the GGUF (local only, with --profile for the experts' share), then the
# sliced model with a fixed share of the experts computed here
# (`bench --local-share S`, S in KV_PC_SHARES, default 0.25 0.5 0.75 1: the
# coordinator's folder holds the slabs too). REPS (default 5) rounds, all
# alternated; medians; each share's decode tokens/s over the local-only
# run's of the same round. CPU time: the
# bench's user + system time, the workers' utime + stime (/proc/PID/stat).
#   c_g = (coordinator CPU - the local run's non-expert CPU) / its expert CPU
#   c_n = workers' CPU / the local run's expert CPU
# Bounds at the best local share s, in units of the local-only time (B the
# non-expert share, X = 1 - B the experts'):
#   gateway G(s) = B + X s + c_g X (1 - s), nodes N(s) = c_n X (1 - s)
#   perfect overlap (nodes busy while the gateway runs attention): 1 / max(G, N)
#   today's step (nodes wait for the gateway's backbone, it for them):
#     1 / (B + max(X s + c_g X (1 - s), c_n X (1 - s)))
# and the largest c_n that 1.5x allows with perfect overlap at this c_g.
# Printed as text and as one JSON line (last line).
# Placement: KV_PC_COORD_CPU (0) the coordinator, KV_PC_NODE_CPUS ("1 1")
# worker a's and worker b's CPU lists; on 3 or more CPUs "1 2" gives each
# worker a core of its own (the bounds then read the nodes' side as two
# cores: N(s) halves).
set -euo pipefail
KV=$(realpath "${1:-build/kvasir}")
REPS=${2:-5}
FF=${KV_PC_FF_EXP:-768}
CC=${KV_PC_COORD_CPU:-0}
read -r -a NODEC <<<"${KV_PC_NODE_CPUS:-1 1}"
[ "${#NODEC[@]}" -eq 2 ] || { echo "bench/pair_cost.sh: KV_PC_NODE_CPUS needs two CPU lists (worker a, worker b)" >&2; exit 1; }
# the nodes' cores: 1 when both workers share one (the issue's layout), 2 when apart
NCORES=$([ "${NODEC[0]}" = "${NODEC[1]}" ] && echo 1 || echo 2)
[ "$(nproc)" -ge 2 ] || { echo "bench/pair_cost.sh: needs 2 CPUs" >&2; exit 1; }
D=$(mktemp -d "${TMPDIR:-/tmp}/kv_bench_paircost.XXXXXX")
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$D"
}
trap cleanup EXIT
# the model is kept (KV_PC_DIR, default bench/out/paircost-FF; why: bench/paircost_model.sh)
M=${KV_PC_DIR:-$(dirname "$0")/out/paircost-$FF}
. "$(dirname "$0")/paircost_model.sh"
paircost_model "$KV" "$FF" "$M" bench/pair_cost.sh
ln -s "$(realpath "$M/m.gguf")" "$D/m.gguf"
ln -s "$(realpath "$M/sl")" "$D/sl"
PK=$("$KV" key --key "$D/coord.key")
BENCH=(--parallel 16 -p 8 -n 128 --threads 1)
ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
HZ=$(getconf CLK_TCK)
cpu_of() { # COMMAND...: prints its user + system seconds (its stdout in $D/out.json)
  local TIMEFORMAT='%U %S'
  { time "$@" >"$D/out.json" 2>"$D/err.txt"; } 2>"$D/time.txt" || { cat "$D/err.txt" >&2; return 1; }
  awk '{ printf "%.3f", $1 + $2 }' "$D/time.txt"
}
W=()
for i in 0 1; do
  n=$([ "$i" = 0 ] && echo a || echo b)
  taskset -c "${NODEC[$i]}" "$KV" worker --slabs "$D/sl/experts" --listen 127.0.0.1:0 --threads 1 --allow-key "$PK" --quiet \
    >"$D/w$n.out" 2>"$D/w$n.err" &
  PIDS+=("$!")
  W+=("$!")
done
ADDR=()
for n in a b; do
  for _ in $(seq 1 200); do grep -q '^listening on ' "$D/w$n.out" && break; sleep 0.05; done
  ADDR+=(--worker "$(sed -n 's/^listening on //p' "$D/w$n.out")")
done
echo "bench/pair_cost.sh: $REPS rounds of: 2 workers on CPUs ${NODEC[0]} and ${NODEC[1]} + coordinator on CPU $CC, then local only on CPU $CC ($(lscpu | sed -n 's/^Model name: *//p'))"
SHARES=${KV_PC_SHARES:-0.25 0.5 0.75 1}
RC=() RW=() RL=() RX=() RT=()
for r in $(seq 1 "$REPS"); do
  w0=$(( $(ticks "${W[0]}") + $(ticks "${W[1]}") ))
  c=$(cpu_of taskset -c "$CC" "$KV" bench -m "$D/sl/manifest.json" "${ADDR[@]}" --key "$D/coord.key" "${BENCH[@]}" --json \
    --local-share 0)
  w1=$(( $(ticks "${W[0]}") + $(ticks "${W[1]}") ))
  t="0:$(jq -r .decode_tok_s "$D/out.json")"
  l=$(cpu_of taskset -c "$CC" "$KV" bench -m "$D/m.gguf" "${BENCH[@]}" --json --profile)
  x=$(jq -r '(.profile.prefill.stages_ms.experts + .profile.decode.stages_ms.experts) / 1000' "$D/out.json")
  tl=$(jq -r .decode_tok_s "$D/out.json")
  for s in $SHARES; do # the same pairs, a fixed share computed here: tokens/s only
    cpu_of taskset -c "$CC" "$KV" bench -m "$D/sl/manifest.json" "${ADDR[@]}" --key "$D/coord.key" "${BENCH[@]}" --json \
      --local-share "$s" >/dev/null
    t="$t $s:$(jq -r .decode_tok_s "$D/out.json")"
  done
  wk=$(awk -v t=$((w1 - w0)) -v hz="$HZ" 'BEGIN { printf "%.3f", t / hz }')
  echo "  round $r: share 0: coordinator $c s, workers $wk s; local only $l s (experts $x s), $tl tok/s; by share: $t tok/s"
  RC+=("$c") RW+=("$wk") RL+=("$l") RX+=("$x") RT+=("local:$tl $t")
done
printf '%s\n' "${RT[@]}" >"$D/tok.txt"
python3 - "${RC[*]}" "${RW[*]}" "${RL[*]}" "${RX[*]}" "$D/tok.txt" "$NCORES" <<'PYEOF'
import json, statistics, sys
ncores = int(sys.argv[6])  # the nodes' cores: their CPU time spreads over them
c, w, l, x = ([float(v) for v in a.split()] for a in sys.argv[1:5])
C, W, L, E = (statistics.median(v) for v in (c, w, l, x))
ratios = {}  # share -> [tok/s over the local-only run's, per round]
for line in open(sys.argv[5]):
    kv = dict(f.split(":") for f in line.split())
    loc = float(kv.pop("local"))
    for sh, v in kv.items():
        ratios.setdefault(sh, []).append(float(v) / loc)
measured = {sh: round(statistics.median(v), 3) for sh, v in ratios.items()}
B = L - E
cg, cn = (C - B) / E, W / E
X, Bs = E / L, B / L
def G(s): return Bs + X * s + cg * X * (1 - s)
def N(s): return cn * X * (1 - s) / ncores
grid = [i / 1000 for i in range(1001)]
s1 = min(grid, key=lambda s: max(G(s), N(s)))
s2 = min(grid, key=lambda s: Bs + max(X * s + cg * X * (1 - s), N(s)))
ov = 1 / max(G(s1), N(s1))
st = 1 / (Bs + max(X * s2 + cg * X * (1 - s2), N(s2)))
# 1.5x with perfect overlap: G(s) <= 2/3 caps s; then N(s) <= 2/3 caps c_n
smax = (2 / 3 - Bs - cg * X) / (X * (1 - cg))
cn_max = ncores * (2 / 3) / (X * (1 - smax)) if 0 <= smax < 1 else None  # None: the gateway's own part alone is over 2/3
print("medians: coordinator %.2f s, workers %.2f s, local only %.2f s (experts %.2f s: X = %.3f)" % (C, W, L, E, X))
print("c_g = %.3f (coordinator cost of a remote pair / computing it), c_n = %.3f (nodes' cost / the coordinator computing it)" % (cg, cn))
print("16 sequences, at most: %.2fx with perfect overlap (s = %.3f), %.2fx with today's step (s = %.3f)" % (ov, s1, st, s2))
if cn_max is None:
    print("1.5x is out of reach at this c_g whatever the nodes cost: the gateway's own part at share 0 is %.3f of the "
          "local-only time (1.5x needs <= 0.667)" % G(0))
else:
    print("1.5x with perfect overlap needs c_n <= %.3f at this c_g (local share <= %.3f)" % (cn_max, smax))
print("measured decode tok/s over the local-only run's, by fixed local share: " +
      ", ".join("%s: %.3f" % (sh, v) for sh, v in sorted(measured.items(), key=lambda kv: float(kv[0]))))
print(json.dumps({"coordinator_s": round(C, 3), "workers_s": round(W, 3), "local_s": round(L, 3), "experts_s": round(E, 3),
                  "x": round(X, 4), "c_g": round(cg, 4), "c_n": round(cn, 4), "bound_overlap": round(ov, 3),
                  "share_overlap": s1, "bound_step": round(st, 3), "share_step": s2,
                  "c_n_max_for_1_5": None if cn_max is None else round(cn_max, 4), "measured_by_share": measured, "reps": len(c),
                  "node_cores": ncores}))
PYEOF
