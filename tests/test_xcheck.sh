#!/usr/bin/env bash
# kv-test-labels: unit
# kvasir xcheck: the backend matrix of sampled experts, for a model of each
# compute tensor type. Every backend this machine runs (KV_REQUIRE_BACKENDS
# names the ones that must appear; NEON through the aarch64 build under
# qemu when KV_ARM_BIN is there, required with KV_REQUIRE_ARM=1) is in the
# matrix, and every pair is bit-identical, the bound docs/NUMERICS.md
# states. Broken input from the emulated side is refused with exit 2.
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-.}
ARM=${KV_ARM_BIN:-$SRC/build-aarch64/kvasir}
dir=$(mktemp -d -t kvasir-xcheck.XXXXXX)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
armflag=()
if [ -x "$ARM" ] && command -v qemu-aarch64 >/dev/null; then
  armflag=(--arm "$ARM")
elif [ "${KV_REQUIRE_ARM:-0}" = 1 ]; then
  fail "KV_REQUIRE_ARM=1 but no aarch64 binary at $ARM"
else
  echo "SKIP: NEON (no aarch64 binary at $ARM)"
fi
for ty in f32 f16 bf16 q8_0 q4_0 q4_k q5_k q6_k; do
  "$KV" gen-model --preset tiny --type "$ty" --out "$dir/$ty.gguf" >/dev/null 2>&1
  "$KV" xcheck -m "$dir/$ty.gguf" --json --tokens 3 "${armflag[@]}" >"$dir/$ty.json" 2>"$dir/$ty.err" ||
    fail "$ty: xcheck exit $?: $(cat "$dir/$ty.err")"
  j="$dir/$ty.json"
  want=(scalar)
  IFS=, read -ra req <<<"${KV_REQUIRE_BACKENDS:-}"
  for b in "${req[@]}"; do case "$b" in neon|neondot) ;; *) [ -n "$b" ] && want+=("$b");; esac; done
  [ ${#armflag[@]} = 0 ] || want+=(aarch64:scalar aarch64:neon aarch64:neondot)
  for b in "${want[@]}"; do
    jq -e --arg b "$b" '.backends | index($b) != null' "$j" >/dev/null || fail "$ty: backend $b missing: $(jq -c .backends "$j")"
  done
  nb=$(jq '.backends | length' "$j")
  [ "$(jq '.pairs | length' "$j")" = $((nb * (nb - 1) / 2)) ] || fail "$ty: not every pair"
  jq -e '.within_bounds and all(.pairs[]; .identical and .cosine == 1 and .max_rel_err == 0)' "$j" >/dev/null ||
    fail "$ty: $(jq -c .pairs "$j")"
  echo "ok: $ty: $nb backends, every pair identical: $(jq -c .backends "$j")"
done
# the emulated side's output is checked: a binary that is not one fails cleanly
printf '#!/bin/sh\nexit 0\n' >"$dir/fake"
chmod +x "$dir/fake"
set +e
"$KV" xcheck -m "$dir/q4_k.gguf" --arm "$dir/fake" >/dev/null 2>"$dir/fake.err"
rc=$?
set -e
[ "$rc" = 2 ] && [ "$(wc -l <"$dir/fake.err")" = 1 ] || fail "fake --arm: exit $rc: $(cat "$dir/fake.err")"
echo "ok: a broken --arm binary is one clear error"
