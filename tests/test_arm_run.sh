#!/usr/bin/env bash
# kv-test-labels: net
# What users run, on the aarch64 build (make arm) under qemu-aarch64 with
# default options: `kvasir run` (a thread per CPU, the backbone prefault
# on, and again with 4 threads), `kvasir bench`, and `kvasir gateway` on
# loopback answering one chat completion. NEON and the x86 kernels follow
# one reduction order (src/quant/quant_internal.h) and results do not
# depend on the thread count, so the tokens, the logits and the chat text
# must equal the x86 build's byte for byte. Every ARM command is bounded
# by `timeout`: a hang fails the test instead of stalling make test.
#
# The emulator runs as `qemu-aarch64 -L /` (cmake/aarch64.cmake): the
# multiarch loader with its own libc. One step runs with QEMU_LD_PREFIX
# set to the cross tree /usr/aarch64-linux-gnu, as the usual cross recipe
# has it; without `-L /` that pairs two glibc builds and the first
# pthread_create spins forever (every run with a second thread hung).
#
# KV_ARM_BIN: the aarch64 binary (default build-aarch64/kvasir beside the
# source). Without it the test skips, unless KV_REQUIRE_ARM=1 (make test
# sets it), when it fails. KV_ARM_FULL=1: three tensor types and longer
# outputs; the short version (make test) is q4_K and 4 tokens.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-.}
ARM=${KV_ARM_BIN:-$SRC/build-aarch64/kvasir}
QEMU=(qemu-aarch64 -L /)
T=${KV_ARM_TIMEOUT:-60} # seconds any one ARM command may take (a tiny model takes under 1 s)
if [ ! -x "$ARM" ] || ! command -v qemu-aarch64 >/dev/null; then
  if [ "${KV_REQUIRE_ARM:-0}" = 1 ]; then
    echo "FAIL: KV_REQUIRE_ARM=1 but no aarch64 binary at $ARM or no qemu-aarch64 (make arm)" >&2
    exit 1
  fi
  echo "SKIP: no aarch64 binary at $ARM or no qemu-aarch64 (make arm builds it)"
  exit 0
fi
dir=$(mktemp -d -t kvasir-armrun.XXXXXX)
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
  for f in "$dir"/*/*.err; do [ -s "$f" ] && { echo "--- $f" >&2; tail -5 "$f" >&2; }; done
  exit 1
}
# arm NAME CMD...: the aarch64 binary under qemu, bounded; stdout to NAME.out, stderr to NAME.err
arm() {
  local name=$1
  shift
  local rc=0
  timeout -k 5 "$T" "${QEMU[@]}" "$ARM" "$@" >"$name.out" 2>"$name.err" || rc=$?
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && fail "ARM \`kvasir $1\` did not finish in $T s (hung): $*"
  [ "$rc" = 0 ] || fail "ARM \`kvasir $1\` failed ($rc): $*"
}
# start_gateway NAME BIN...: a gateway on an ephemeral loopback port; sets gw (its URL) and gwpid
start_gateway() {
  local name=$1
  shift
  timeout -k 5 $((T * 4)) "$@" gateway -m "$d/m.gguf" --listen 127.0.0.1:0 >"$name.out" 2>"$name.err" &
  gwpid=$!
  pids+=("$gwpid")
  gw=
  for _ in $(seq $((T * 20))); do
    gw=$(sed -n 's/^listening on \(.*\)$/http:\/\/\1/p' "$name.out" 2>/dev/null | head -1 || true)
    [ -n "$gw" ] && return 0
    kill -0 "$gwpid" 2>/dev/null || fail "gateway $name exited: $(tail -3 "$name.err")"
    sleep 0.05
  done
  fail "gateway $name did not listen within $T s"
}
chat() { # chat URL OUT: one greedy chat completion
  jq -n --arg p "$PROMPT" --argjson n "$NTOK" \
    '{model: "m", messages: [{role: "user", content: $p}], max_tokens: $n, temperature: 0, seed: 1}' |
    curl -sf -m "$T" "$1/v1/chat/completions" -H 'Content-Type: application/json' -d @- >"$2"
}

if [ "${KV_ARM_FULL:-0}" = 1 ]; then
  TYPES=(q4_k q8_0 f16)
  NTOK=12
else
  TYPES=(q4_k)
  NTOK=4
fi
PROMPT="A phone runs the model"

for ty in "${TYPES[@]}"; do
  d="$dir/$ty"
  mkdir -p "$d"
  "$KV" gen-model --preset tiny --type "$ty" --out "$d/m.gguf" >/dev/null 2>&1
  RUN=(-m "$d/m.gguf" -p "$PROMPT" -n "$NTOK" --temp 0 --json)
  "$KV" run "${RUN[@]}" --threads 1 --no-prefault --logits-out "$d/x86.bin" >"$d/x86.json"
  same() { # same NAME: NAME's tokens and logits equal the x86 run's
    [ "$(jq -c .tokens "$d/x86.json")" = "$(jq -c .tokens "$d/$1.out")" ] ||
      fail "$ty: $1: tokens $(jq -c .tokens "$d/$1.out") differ from x86's $(jq -c .tokens "$d/x86.json")"
    cmp -s "$d/x86.bin" "$d/$1.bin" || fail "$ty: $1: logits differ from the x86 run"
  }

  # run with default options: a thread per CPU and the prefault thread
  arm "$d/run" run "${RUN[@]}" --logits-out "$d/run.bin"
  same run
  # several pool threads whatever the CPU count
  arm "$d/run4" run "${RUN[@]}" --threads 4 --logits-out "$d/run4.bin"
  same run4
  # a prefix in the environment that names the cross tree's loader is not taken
  if [ -e /usr/aarch64-linux-gnu/lib/ld-linux-aarch64.so.1 ]; then
    QEMU_LD_PREFIX=/usr/aarch64-linux-gnu arm "$d/runpfx" run "${RUN[@]}" --logits-out "$d/runpfx.bin"
    same runpfx
  fi
  echo "ok: $ty: ARM run (default threads with prefault, 4 threads$([ -e /usr/aarch64-linux-gnu/lib/ld-linux-aarch64.so.1 ] && echo ', QEMU_LD_PREFIX set')): $NTOK tokens and logits equal the x86 run"

  # bench with default options
  arm "$d/bench" bench -m "$d/m.gguf" -p 16 -n "$NTOK" --reps 1 --json
  jq -e '.prefill_tok_s > 0 and .decode_tok_s > 0' "$d/bench.out" >/dev/null ||
    fail "$ty: ARM bench: $(cat "$d/bench.out")"
  echo "ok: $ty: ARM bench: $(jq -c '{prefill_tok_s, decode_tok_s}' "$d/bench.out")"

  # gateway with default options: one chat completion, the x86 gateway's answer
  start_gateway "$d/gx86" "$KV"
  chat "$gw" "$d/chat_x86.json" || fail "$ty: x86 gateway: the chat completion failed"
  kill -TERM "$gwpid"
  wait "$gwpid" || fail "$ty: x86 gateway did not stop cleanly on SIGTERM"
  start_gateway "$d/garm" "${QEMU[@]}" "$ARM"
  chat "$gw" "$d/chat_arm.json" || fail "$ty: ARM gateway: the chat completion failed (or took over $T s)"
  want=$(jq -r '.choices[0].message.content' "$d/chat_x86.json")
  got=$(jq -r '.choices[0].message.content' "$d/chat_arm.json")
  [ -n "$want" ] || fail "$ty: x86 gateway answered no text: $(cat "$d/chat_x86.json")"
  [ "$got" = "$want" ] || fail "$ty: ARM gateway text '$got' differs from x86's '$want'"
  [ "$(jq -c .usage "$d/chat_arm.json")" = "$(jq -c .usage "$d/chat_x86.json")" ] ||
    fail "$ty: ARM gateway usage $(jq -c .usage "$d/chat_arm.json") differs from x86's $(jq -c .usage "$d/chat_x86.json")"
  kill -TERM "$gwpid"
  rc=0
  wait "$gwpid" || rc=$?
  [ "$rc" = 0 ] || fail "$ty: ARM gateway did not stop cleanly on SIGTERM ($rc)"
  echo "ok: $ty: ARM gateway: chat completion equals the x86 gateway's byte for byte ($(jq -c .usage "$d/chat_arm.json")), stopped on SIGTERM"
  pids=()
done
