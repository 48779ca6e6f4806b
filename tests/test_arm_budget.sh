#!/usr/bin/env bash
# kv-test-labels: net
# A small device: `kvasir node --budget B` on the emulated ARM (the aarch64
# build under qemu-user) in a swarm whose slabs need more than B. It must
# hold at most B bytes of slabs, serve them for a live decode by an x86
# coordinator (tokens and logits equal the local run: the pair promises
# identical bits), and its peak resident memory (VmHWM of the qemu process,
# which includes the emulator itself) must stay within B plus the stated
# overhead, KV_ARM_OVERHEAD (docs/BENCHMARKS.md has the measured figures).
# An x86 node holds the rest. Defaults are small for make test (B = 24M);
# make bench-arm runs B = 256M on a larger model and prints the figures.
# Skips without the aarch64 binary, unless KV_REQUIRE_ARM=1.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-.}
ARM=${KV_ARM_BIN:-$SRC/build-aarch64/kvasir}
B=${KV_ARM_BUDGET:-24M}
OVER=${KV_ARM_OVERHEAD:-64M}
GEN=(${KV_ARM_MODEL:---layers 2 --embd 512 --ff-exp 512 --experts 32 --type q8_0})
if [ ! -x "$ARM" ] || ! command -v qemu-aarch64 >/dev/null; then
  [ "${KV_REQUIRE_ARM:-0}" = 1 ] && { echo "FAIL: KV_REQUIRE_ARM=1 but no aarch64 binary at $ARM" >&2; exit 1; }
  echo "SKIP: no aarch64 binary at $ARM (make arm)"
  exit 0
fi
dir=$(mktemp -d -t kvasir-armbudget.XXXXXX)
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
bytes() { # SIZE with K/M/G suffix -> bytes
  local v=${1%[KMG]} u=${1: -1}
  case "$u" in K) echo $((v << 10));; M) echo $((v << 20));; G) echo $((v << 30));; *) echo "$1";; esac
}
wait_until() {
  local t=$1
  shift
  for _ in $(seq $((t * 5))); do
    if "$@"; then return 0; fi
    sleep 0.2
  done
  return 1
}
Bb=$(bytes "$B")
Ob=$(bytes "$OVER")
"$KV" gen-model --preset tiny "${GEN[@]}" --out "$dir/m.gguf" >/dev/null 2>&1 || fail "gen-model ${GEN[*]}"
"$KV" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab 4 >/dev/null 2>&1
total=0
for f in "$dir/sl/experts/"*.gguf; do total=$((total + $(stat -c %s "$f"))); done
[ "$total" -gt "$Bb" ] || fail "the slabs ($total bytes) fit the budget $B: the test needs more"
n_slabs=$(jq '.slabs | length' "$dir/sl/manifest.json")
RUN=(-p "A small device holds a few experts" -n ${KV_ARM_TOKENS:-4} --temp 0 --json --threads 1)
"$KV" run -m "$dir/m.gguf" "${RUN[@]}" --logits-out "$dir/local.bin" >"$dir/local.json"
mkdir -p "$dir/coord"
CPK=$("$KV" key --key "$dir/coord/coordinator.key")
"$KV" hub --model "$dir/sl/manifest.json" --db "$dir/hub.db" --listen 127.0.0.1:0 --deadline-ms 6000 \
  --vouch-key "$CPK" --quiet >"$dir/hub.out" 2>"$dir/hub.err" &
pids+=($!)
url=
for _ in $(seq 300); do
  url=$(sed -n 's/^listening on \(.*\)$/http:\/\/\1/p' "$dir/hub.out" 2>/dev/null | head -1 || true)
  [ -n "$url" ] && break
  sleep 0.05
done
[ -n "$url" ] || fail "hub did not start"
qemu-aarch64 -L / "$ARM" node --hub "$url" --budget "$B" --data "$dir/arm" --interval-ms 500 --threads 1 \
  >"$dir/arm.out" 2>"$dir/arm.err" &
armpid=$!
pids+=($armpid)
# the x86 node joins once the ARM node serves, and covers what is left
wait_until 120 grep -q "^node: registered" "$dir/arm.err" || fail "the ARM node did not register"
sleep 1
rss0=$(awk '/^VmRSS:/ {print $2 * 1024}' "/proc/$armpid/status") # serving, nothing computed yet
"$KV" node --hub "$url" --budget "$((total * 2))" --data "$dir/x86" --interval-ms 500 --threads 1 \
  >"$dir/x86.out" 2>"$dir/x86.err" &
pids+=($!)
market() { curl -sf "$url/v1/market"; }
covered() { [ "$(market | jq .covered)" = true ]; }
wait_until 120 covered || fail "no coverage: $(market)"
held=0
for f in "$dir/arm/pieces/experts/"*.gguf; do [ -f "$f" ] && held=$((held + $(stat -c %s "$f"))); done
[ "$held" -gt 0 ] && [ "$held" -le "$Bb" ] || fail "the ARM node holds $held bytes of slabs, budget $Bb"
"$KV" run --hub "$url" --data "$dir/coord" "${RUN[@]}" --worker-timeout-ms 60000 --logits-out "$dir/hub.bin" \
  >"$dir/hub.json" 2>"$dir/hub.err" || fail "run --hub failed"
cmp -s "$dir/local.bin" "$dir/hub.bin" || fail "logits differ from the local run"
armpairs=$(jq '[.dispatch.workers[] | select(.backend == "neon" or .backend == "neondot") | .pairs] | add // 0' "$dir/hub.json")
# replica choice sends work to the replica expected to answer first, and the x86 node
# holds everything: the emulated ARM node may then answer only requests that a hedge
# beat (counted as requests, its pairs taken from the replica); it must have computed
armreq=$(jq '[.dispatch.workers[] | select(.backend == "neon" or .backend == "neondot") | .requests] | add // 0' "$dir/hub.json")
[ "$armpairs" -gt 0 ] || [ "$armreq" -gt 0 ] || fail "the ARM node computed nothing: $(jq -c .dispatch.workers "$dir/hub.json")"
hwm=$(awk '/^VmHWM:/ {print $2 * 1024}' "/proc/$armpid/status")
rss=$(awk '/^VmRSS:/ {print $2 * 1024}' "/proc/$armpid/status")
[ "$hwm" -le $((Bb + Ob)) ] || fail "ARM node peak RSS $hwm bytes > budget $Bb + overhead $Ob"
echo "ok: ARM node, budget $B: holds $held bytes of $total in slabs, computed $armpairs experts of a byte-identical decode;" \
  "peak RSS $((hwm >> 20)) MiB (now $((rss >> 20)) MiB; $((rss0 >> 20)) MiB serving before any compute), budget + stated overhead $(((Bb + Ob) >> 20)) MiB"
