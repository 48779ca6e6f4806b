#!/usr/bin/env bash
# kv-test-labels: net
# A mixed swarm: one model's expert slabs spread over workers that each run
# another backend (scalar, AVX2, AVX-512, OpenCL and, with the aarch64
# build under qemu, NEON and NEON with the int8 dot product), each backend
# announced in its HELLO_ACK and reported per worker by `kvasir run --json`.
# Every backend here follows the canonical reduction order, so the pairs
# all promise identical bits (docs/NUMERICS.md): the mixed decode must give
# the tokens and logits of the local run byte for byte, as must a decode
# where every worker runs the coordinator's own backend. A backend this
# machine cannot run is skipped, and the test fails if KV_REQUIRE_BACKENDS
# names it; NEON is skipped without KV_ARM_BIN unless KV_REQUIRE_ARM=1.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-.}
ARM=${KV_ARM_BIN:-$SRC/build-aarch64/kvasir}
dir=$(mktemp -d -t kvasir-mixed.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in "$dir"/*.err; do [ -f "$f" ] && { echo "--- $f" >&2; tail -5 "$f" >&2; }; done
  exit 1
}
required() { case ",${KV_REQUIRE_BACKENDS:-}," in *",$1,"*) return 0;; esac; return 1; }

# which backends run here: the CPU kernels from the x86 binary's own list
# (a worker refuses --backend for one the CPU lacks), OpenCL if a device is
# there, NEON through the aarch64 binary
have_arm=0
if [ -x "$ARM" ] && command -v qemu-aarch64 >/dev/null; then have_arm=1; fi
if [ "$have_arm" = 0 ] && [ "${KV_REQUIRE_ARM:-0}" = 1 ]; then fail "KV_REQUIRE_ARM=1 but no aarch64 binary at $ARM"; fi

"$KV" gen-model --preset tiny --type q4_k --out "$dir/m.gguf" >/dev/null 2>&1
"$KV" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab 2 >/dev/null 2>&1
mapfile -t slabs < <(ls "$dir/sl/experts/"*.gguf)
[ "${#slabs[@]}" = 8 ] || fail "want 8 slabs, got ${#slabs[@]}"
KEY="$dir/coord.key"
PK=$("$KV" key --key "$KEY")
RUN=(-m "$dir/sl/manifest.json" -p "Every backend computes the same experts" -n 8 --temp 0 --json --threads 1 --key "$KEY")
"$KV" run -m "$dir/m.gguf" -p "Every backend computes the same experts" -n 8 --temp 0 --json --threads 1 \
  --logits-out "$dir/local.bin" >"$dir/local.json"

# start_worker NAME BACKEND SLABS [emulated]: a worker on a free port; sets $addr
start_worker() {
  local name=$1 be=$2 sl=$3 emu=${4:-}
  if [ -n "$emu" ]; then
    qemu-aarch64 -L / -cpu "$emu" "$ARM" worker --slabs "$sl" --listen 127.0.0.1:0 --threads 1 --quiet --allow-key "$PK" \
      --backend "$be" >"$dir/$name.out" 2>"$dir/$name.err" &
  else
    "$KV" worker --slabs "$sl" --listen 127.0.0.1:0 --threads 1 --quiet --allow-key "$PK" --backend "$be" \
      >"$dir/$name.out" 2>"$dir/$name.err" &
  fi
  pids+=($!)
  addr=
  for _ in $(seq 600); do
    addr=$(sed -n 's/^listening on //p' "$dir/$name.out" 2>/dev/null | head -1 || true)
    [ -n "$addr" ] && return 0
    kill -0 "${pids[-1]}" 2>/dev/null || return 1
    sleep 0.05
  done
  return 1
}

# 8 slabs over the backends that run here, round robin
declare -a bes emus
for b in scalar avx2 avxvnni avx512 opencl; do
  if "$KV" worker --backend "$b" --help >/dev/null 2>&1 && { [ "$b" != opencl ] || clinfo -l 2>/dev/null | grep -q "Device #"; }; then
    bes+=("$b"); emus+=("")
  elif required "$b"; then
    fail "backend $b is required (KV_REQUIRE_BACKENDS) but this machine cannot run it"
  else
    echo "SKIP backend $b: not available here"
  fi
done
if [ "$have_arm" = 1 ]; then
  bes+=(neondot neon); emus+=(max cortex-a72)
else
  echo "SKIP backend neon/neondot: no aarch64 binary (make arm)"
fi
nb=${#bes[@]}
declare -a lists
for i in "${!slabs[@]}"; do
  k=$((i % nb))
  lists[$k]="${lists[$k]:+${lists[$k]},}${slabs[$i]}"
done
W=()
for k in $(seq 0 $((nb - 1))); do
  [ -n "${lists[$k]:-}" ] || continue
  start_worker "w$k" "${bes[$k]}" "${lists[$k]}" "${emus[$k]}" || fail "worker ${bes[$k]} did not start"
  W+=(--worker "$addr")
done
"$KV" run "${RUN[@]}" "${W[@]}" --worker-timeout-ms 30000 --logits-out "$dir/mixed.bin" >"$dir/mixed.json" \
  2>"$dir/mixed.err" || fail "mixed run failed"
[ "$(jq -c .tokens "$dir/local.json")" = "$(jq -c .tokens "$dir/mixed.json")" ] || fail "mixed: tokens differ"
cmp -s "$dir/local.bin" "$dir/mixed.bin" || fail "mixed: logits differ from the local run"
[ "$(jq .dispatch.pairs_local "$dir/mixed.json")" = 0 ] || fail "mixed: experts computed locally"
for k in $(seq 0 $((nb - 1))); do
  [ -n "${lists[$k]:-}" ] || continue
  jq -e --arg b "${bes[$k]}" '[.dispatch.workers[] | select(.backend == $b and .pairs > 0)] | length == 1' \
    "$dir/mixed.json" >/dev/null || fail "mixed: backend ${bes[$k]} computed nothing: $(jq -c .dispatch.workers "$dir/mixed.json")"
done
# which backend computed each expert of each step: one row per engine step;
# its per-worker counts add up to each worker's total, its per-backend counts
# to the step's, and the backends are the ones the workers announced
jq -e '.dispatch as $d | ($d.steps | length) == .engine.steps and
    ([range($d.workers | length) as $i | ([$d.steps[].workers[$i]] | add) == $d.workers[$i].pairs] | all) and
    ([$d.steps[] | (.backends | [.[]] | add // 0) == ((.workers | add) + .local)] | all) and
    ([$d.steps[].workers[]] | add) == $d.pairs_remote and
    ([$d.steps[].backends | keys[]] | unique) == ([$d.workers[] | select(.pairs > 0) | .backend] | unique) and
    ([$d.steps[] | select((.workers | add) > 0)] | length) > 1' "$dir/mixed.json" >/dev/null ||
  fail "mixed: per-step backends do not add up: $(jq -c '[.engine.steps, .dispatch.steps]' "$dir/mixed.json")"
echo "ok: mixed swarm equals the local run byte for byte: $(jq -c '[.dispatch.workers[] | {backend, pairs}]' "$dir/mixed.json");" \
  "step 1 by backend: $(jq -c '.dispatch.steps[0].backends' "$dir/mixed.json")"
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
wait 2>/dev/null || true
pids=()

# every worker on the coordinator's own (dispatched) backend
W=()
for k in 0 1; do
  l=$(IFS=,; echo "${slabs[*]:$((4 * k)):4}")
  "$KV" worker --slabs "$l" --listen 127.0.0.1:0 --threads 1 --quiet --allow-key "$PK" >"$dir/s$k.out" 2>"$dir/s$k.err" &
  pids+=($!)
  addr=
  for _ in $(seq 200); do
    addr=$(sed -n 's/^listening on //p' "$dir/s$k.out" 2>/dev/null | head -1 || true)
    [ -n "$addr" ] && break
    sleep 0.05
  done
  [ -n "$addr" ] || fail "same-backend worker $k did not start"
  W+=(--worker "$addr")
done
"$KV" run "${RUN[@]}" "${W[@]}" --logits-out "$dir/same.bin" >"$dir/same.json" 2>"$dir/same.err" || fail "same-backend run failed"
cmp -s "$dir/local.bin" "$dir/same.bin" || fail "same backend: logits differ from the local run"
[ "$(jq -r '[.dispatch.workers[].backend] | unique | length' "$dir/same.json")" = 1 ] || fail "same backend: $(jq -c .dispatch.workers "$dir/same.json")"
echo "ok: every worker on the coordinator's backend ($(jq -r '.dispatch.workers[0].backend' "$dir/same.json")): byte-identical"
