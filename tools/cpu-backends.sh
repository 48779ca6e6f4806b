#!/usr/bin/env bash
# Prints the kernel backends this CPU runs, comma-separated ("avx2,avxvnni,avx512";
# "neon,neondot" on aarch64),
# from /proc/cpuinfo, with the same feature sets the run-time detection in
# src/quant/types.c requires. `make test` exports it as KV_REQUIRE_BACKENDS,
# so a test that skips one of them fails instead of passing unchecked.
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has() { for x in "$@"; do case "$flags" in *" $x "*) ;; *) return 1;; esac; done; }
out=
if has avx2 fma f16c bmi2; then
  out=avx2
  if has avx_vnni; then out=$out,avxvnni; fi
  if has avx512f avx512dq avx512bw avx512vl avx512_vnni; then out=$out,avx512; fi
fi
# aarch64: the Features line ("asimd", "asimddp" for the int8 dot product)
feats=" $(grep -m1 '^Features' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
case "$feats" in *" asimd "*)
  out=${out:+$out,}neon
  case "$feats" in *" asimddp "*) out=$out,neondot;; esac;;
esac
# an OpenCL device (PoCL counts: tests/test_opencl.c then must not skip)
if command -v clinfo >/dev/null 2>&1 && clinfo -l 2>/dev/null | grep -q "Device #"; then
  out=${out:+$out,}opencl
fi
echo "$out"
