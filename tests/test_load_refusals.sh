#!/usr/bin/env bash
# kv-test-labels: net
# A tensor type no backend computes is refused when it is loaded, naming
# the tensor and its type, on every path that loads experts (issue 34, item
# 5): a gen-model F16 model sliced, one slab's blk.1.ffn_down_exps patched
# to I16 (two bytes a value like F16, so the file stays well-formed):
#   - `kvasir worker --slabs` (CPU) exits at startup with the tensor and type;
#   - `kvasir worker --backend opencl` likewise, before any request (when
#     this machine has an OpenCL device);
#   - `kvasir ring` over the patched full model with a window holding
#     block 1 exits at startup likewise; a window without it starts.
# The unpatched slab starts a worker (so what is refused is the type).
# The OpenCL provider's and the verifier's own load-time checks (a type they
# do not compute, passed over by the CPU checks) are unit-tested in
# tests/test_opencl.c (test_refused_at_load) and tests/test_verify.c
# (test_supported).
set -euo pipefail
KV=${KV_BIN:-build/kvasir}
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
dir=$(mktemp -d -t kvasir-refuse.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
fail() { echo "test_load_refusals: FAIL: $*" >&2; exit 1; }
. "$SRC/tests/gguf_patch_support.sh"
PK=$("$KV" key --key "$dir/coord.key")

unrunnable_model "$dir/m.gguf"
"$KV" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab 2 >/dev/null 2>&1 || fail "slice"
slab=$(ls "$dir/sl/experts/"blk.1.*.gguf | head -1)
[ -n "$slab" ] || fail "no slab of layer 1"
cp "$slab" "$dir/bad.gguf"
cp "$dir/m.gguf" "$dir/p.gguf"
# blk.1.ffn_down_exps.weight's type F16 (1) -> I16 (25)
gguf_patch_type "$dir/bad.gguf" blk.1.ffn_down_exps.weight 1 25 || fail "patching the slab"
gguf_patch_type "$dir/p.gguf" blk.1.ffn_down_exps.weight 1 25 || fail "patching the model"
WANT=$UNRUNNABLE_WANT

# refused_at_start NAME CMD...: the command exits (bounded: 20 s) non-zero, saying WANT
refused_at_start() {
  local name=$1
  shift
  set +e
  timeout 20 "$@" >"$dir/$name.out" 2>"$dir/$name.err"
  local rc=$?
  set -e
  [ "$rc" != 124 ] || fail "$name: still running after 20 s (not refused at load)"
  [ "$rc" != 0 ] || fail "$name: exited 0"
  grep -qF "$WANT" "$dir/$name.err" || fail "$name: does not name the tensor and its type: $(cat "$dir/$name.err")"
  grep -q "listening on" "$dir/$name.out" && fail "$name: listened before refusing"
  echo "ok: $name refused at load: $(head -1 "$dir/$name.err")"
}

# the unpatched slab serves
"$KV" worker --slabs "$slab" --listen 127.0.0.1:0 --threads 1 --quiet --allow-key "$PK" >"$dir/good.out" 2>"$dir/good.err" &
pids+=($!)
for _ in $(seq 200); do grep -q "^listening on" "$dir/good.out" && break; sleep 0.05; done
grep -q "^listening on" "$dir/good.out" || fail "the unpatched slab's worker did not start: $(cat "$dir/good.err")"

refused_at_start worker "$KV" worker --slabs "$dir/bad.gguf" --listen 127.0.0.1:0 --threads 1 --quiet --allow-key "$PK"
if command -v clinfo >/dev/null 2>&1 && clinfo -l 2>/dev/null | grep -q Device; then
  refused_at_start "opencl worker" "$KV" worker --slabs "$dir/bad.gguf" --backend opencl --listen 127.0.0.1:0 \
    --threads 1 --quiet --allow-key "$PK"
else
  echo "skip: no OpenCL device here for the opencl worker"
fi

# a ring node: windows with block 1 are refused, one without it starts
for k in 0 1 2; do "$KV" key --key "$dir/k$k.key" >>"$dir/allow"; done
refused_at_start "ring node 1-1" "$KV" ring -m "$dir/p.gguf" --layers 1-1 --listen 127.0.0.1:0 --next 127.0.0.1:9 \
  --threads 1 --key "$dir/k1.key" --allow-key "$dir/allow"
refused_at_start "ring node 0-1" "$KV" ring -m "$dir/p.gguf" --layers 0-1 --listen 127.0.0.1:0 --next 127.0.0.1:9 \
  --threads 1 --key "$dir/k0.key" --allow-key "$dir/allow"
"$KV" ring -m "$dir/p.gguf" --layers 0-0 --listen 127.0.0.1:0 --next 127.0.0.1:9 --threads 1 --key "$dir/k0.key" \
  --allow-key "$dir/allow" >"$dir/r0.out" 2>"$dir/r0.err" &
pids+=($!)
for _ in $(seq 200); do grep -q "^listening on" "$dir/r0.out" && break; sleep 0.05; done
grep -q "^listening on" "$dir/r0.out" || fail "a ring window without block 1 did not start: $(cat "$dir/r0.err")"
echo "ok: a ring window without the patched block starts"
echo "test_load_refusals: all ok"
