#!/usr/bin/env bash
# kv-test-labels: net
# An ARM device in the swarm: the aarch64 build of kvasir (make arm), run
# under qemu-user, joins a hub on loopback as `kvasir node`, takes shards
# from the coverage market, downloads and verifies its slabs and computes
# them with its NEON kernels for a live decode by an x86 coordinator
# (`kvasir run --hub`). NEON and the x86 kernels follow one reduction order
# (src/quant/quant_internal.h), so the pair promises identical bits: the
# tokens and logits must equal the local x86 run byte for byte, and the
# run's per-worker report must name the node's NEON backend.
#
# KV_ARM_BIN: the aarch64 binary (default build-aarch64/kvasir beside the
# source). Without it the test skips, unless KV_REQUIRE_ARM=1 (make test
# sets it), when it fails. KV_ARM_FULL=1 (make test-arm): two ARM nodes, one
# on a CPU model without the dot product (plain "neon"), two tensor types
# and a longer decode; the short version (make test) is one node, q4_K, 6
# tokens.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-.}
ARM=${KV_ARM_BIN:-$SRC/build-aarch64/kvasir}
# -L /: libc6:arm64 (multiarch) provides the loader and its own libc, and
# no prefix from the environment may pair it with another glibc build
# (that pair hangs in pthread_create; cmake/aarch64.cmake says why)
QEMU=(qemu-aarch64 -L /)
if [ ! -x "$ARM" ] || ! command -v qemu-aarch64 >/dev/null; then
  if [ "${KV_REQUIRE_ARM:-0}" = 1 ]; then
    echo "FAIL: KV_REQUIRE_ARM=1 but no aarch64 binary at $ARM or no qemu-aarch64 (make arm)" >&2
    exit 1
  fi
  echo "SKIP: no aarch64 binary at $ARM or no qemu-aarch64 (make arm builds it)"
  exit 0
fi
dir=$(mktemp -d -t kvasir-arm.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 60); do
    alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.05
  done
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*" >&2
  for f in "$dir"/*.err "$dir"/*/*.err; do [ -f "$f" ] && { echo "--- $f" >&2; tail -5 "$f" >&2; }; done
  exit 1
}
# wait_until SECONDS CMD...: polls CMD every 0.2 s (a bounded wait, not a timing assertion)
wait_until() {
  local t=$1
  shift
  for _ in $(seq $((t * 5))); do
    if "$@"; then return 0; fi
    sleep 0.2
  done
  return 1
}

# the aarch64 binary runs and picks NEON at run time
be=$("${QEMU[@]}" "$ARM" run --help 2>&1 | head -1 || true)
[ -n "$be" ] || fail "the aarch64 binary does not run under qemu"

if [ "${KV_ARM_FULL:-0}" = 1 ]; then
  TYPES=(f32 f16 bf16 q8_0 q4_0 q4_k q5_k q6_k)
  NTOK=12
  CPUS=(max cortex-a72) # with and without the int8 dot product
else
  TYPES=(q4_k)
  NTOK=6
  CPUS=(max)
fi

for ty in "${TYPES[@]}"; do
  d="$dir/$ty"
  mkdir -p "$d"
  "$KV" gen-model --preset tiny --type "$ty" --out "$d/m.gguf" >/dev/null 2>&1
  "$KV" slice "$d/m.gguf" --out "$d/sl" --experts-per-slab 4 >/dev/null 2>&1
  n_slabs=$(jq '.slabs | length' "$d/sl/manifest.json")
  total=0
  for f in "$d/sl/experts/"*.gguf; do total=$((total + $(stat -c %s "$f"))); done
  RUN=(-p "An ARM node computes experts" -n "$NTOK" --temp 0 --json --threads 1)
  "$KV" run -m "$d/m.gguf" "${RUN[@]}" --logits-out "$d/local.bin" >"$d/local.json"

  # the hub vouches for the coordinator key of $d/coord (operator-approved)
  mkdir -p "$d/coord"
  CPK=$("$KV" key --key "$d/coord/coordinator.key")
  "$KV" hub --model "$d/sl/manifest.json" --db "$d/hub.db" --listen 127.0.0.1:0 --deadline-ms 4000 \
    --vouch-key "$CPK" --quiet >"$d/hub.out" 2>"$d/hub.err" &
  pids+=($!)
  url=
  for _ in $(seq 300); do
    url=$(sed -n 's/^listening on \(.*\)$/http:\/\/\1/p' "$d/hub.out" 2>/dev/null | head -1 || true)
    [ -n "$url" ] && break
    sleep 0.05
  done
  [ -n "$url" ] || fail "$ty: hub did not start"

  # each ARM node's budget holds every slab: one node alone covers the model
  budget=$((total + total / 4))
  i=0
  for cpu in "${CPUS[@]}"; do
    i=$((i + 1))
    "${QEMU[@]}" -cpu "$cpu" "$ARM" node --hub "$url" --budget "$budget" \
      --data "$d/n$i" --interval-ms 300 --threads 1 >"$d/n$i.out" 2>"$d/n$i.err" &
    pids+=($!)
  done
  market() { curl -sf "$url/v1/market"; }
  live_all() { # every shard held by every ARM node
    [ "$(market | jq --argjson k "${#CPUS[@]}" '[.shards[] | select(.live >= $k)] | length')" = "$n_slabs" ]
  }
  wait_until 90 live_all || fail "$ty: the ARM nodes did not cover the model: $(market)"
  for j in $(seq "$i"); do
    for f in "$d/n$j/pieces/experts/"*.gguf; do
      cmp -s "$f" "$d/sl/experts/$(basename "$f")" || fail "$ty: ARM node $j holds other bytes for $(basename "$f")"
    done
    grep -q "^node: fetched experts/" "$d/n$j.err" || fail "$ty: ARM node $j downloaded nothing"
  done

  "$KV" run --hub "$url" --data "$d/coord" "${RUN[@]}" --worker-timeout-ms 30000 --logits-out "$d/hub.bin" \
    >"$d/hub.json" 2>"$d/hub.err" || fail "$ty: run --hub failed"
  [ "$(jq -c .tokens "$d/local.json")" = "$(jq -c .tokens "$d/hub.json")" ] || fail "$ty: tokens differ"
  cmp -s "$d/local.bin" "$d/hub.bin" || fail "$ty: logits differ from the x86 run"
  [ "$(jq .dispatch.pairs_local "$d/hub.json")" = 0 ] || fail "$ty: experts computed by the coordinator"
  [ "$(jq '.dispatch.pairs_remote' "$d/hub.json")" -gt 0 ] || fail "$ty: no expert computed remotely"
  # every worker that computed is an ARM node with a NEON backend
  jq -e '[.dispatch.workers[] | select(.pairs > 0) | .backend] | length > 0 and all(. == "neon" or . == "neondot")' \
    "$d/hub.json" >/dev/null || fail "$ty: workers: $(jq -c '.dispatch.workers' "$d/hub.json")"
  if [ "${#CPUS[@]}" -gt 1 ]; then
    for b in neon neondot; do
      jq -e --arg b "$b" '[.dispatch.workers[] | select(.backend == $b)] | length > 0' "$d/hub.json" >/dev/null ||
        fail "$ty: no $b worker: $(jq -c '.dispatch.workers' "$d/hub.json")"
    done
  fi
  echo "ok: $ty: ARM node(s) on ${CPUS[*]} joined, held $n_slabs slabs, and a decode of $NTOK tokens equals the x86 run byte for byte ($(jq -c '[.dispatch.workers[] | {backend, pairs}]' "$d/hub.json"))"
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  pids=()
done
