#!/usr/bin/env bash
# kv-test-labels: unit
# The portable build's instruction-set promise, read off its object files:
# a kernel file may use only the ISA its run-time detection checked for.
#  - *_avx2.c and *_avxvnni.c objects: no AVX-512 (no zmm, no mask
#    registers k0-k7, no xmm/ymm16-31, no EVEX encoding). gcc cannot emit
#    those under -mavx2 by itself, but inline asm can: a memory-source
#    `vpsrlw $4` exists only as EVEX, and the assembler picks it silently.
#    test_quant runs these kernels on whatever CPU CI has; on an AVX-512
#    machine such an instruction would pass there and fault on AVX2 ones.
#  - every other x86 object of the library: no AVX at all (no ymm/zmm), as
#    the baseline build promises (skipped for KV_NATIVE=ON builds).
#  - a control: the *_avx512.c object does use zmm, so the scan sees them.
# KV_BUILD: the build directory (CMake sets it). x86 hosts only.
set -euo pipefail
B=${KV_BUILD:-build}
OBJ=$B/CMakeFiles/kvasir_lib.dir/src
case $(uname -m) in x86_64 | amd64 | i?86) ;; *) echo "SKIP: not an x86 host"; exit 0 ;; esac
command -v objdump >/dev/null || { echo "FAIL: objdump (binutils) not found" >&2; exit 1; }
[ -d "$OBJ" ] || { echo "FAIL: no object files under $OBJ (KV_BUILD=$B)" >&2; exit 1; }
fail=0
# count of lines of the disassembly of $1 matching the extended regex $2
hits() { objdump -d --no-show-raw-insn "$1" | grep -cE "$2" || true; }
# scan REGEX WHAT MIN FIND-ARGS...: every object find(1) lists must have no
# instruction matching REGEX (else FAIL naming WHAT, fail=1); fewer than MIN
# objects is a FAIL too (the scan would pass on nothing)
scan() {
  local re=$1 what=$2 min=$3 n=0 f c bad=0
  shift 3
  while IFS= read -r f; do
    n=$((n + 1))
    c=$(hits "$f" "$re")
    if [ "$c" != 0 ]; then
      echo "FAIL: ${f#"$OBJ"/}: $c $what:" >&2
      objdump -d --no-show-raw-insn "$f" | grep -E "$re" | head -5 >&2
      bad=1 fail=1
    fi
  done < <(find "$OBJ" "$@")
  [ "$n" -ge "$min" ] || { echo "FAIL: expected at least $min objects for this scan, found $n" >&2; exit 1; }
  scanned=$n
  return $bad
}
evex='%zmm|%k[0-7]|%[xy]mm(1[6-9]|2[0-9]|3[01])\b|\{evex\}'
scan "$evex" "AVX-512 instruction(s) in an AVX2 kernel file" 2 -name '*_avx2.c.o' -o -name '*_avxvnni.c.o' &&
  echo "ok: $scanned AVX2 / AVX-VNNI kernel objects without AVX-512 instructions"

a512=$(find "$OBJ" -name 'simd_avx512.c.o' | head -1)
[ -n "$a512" ] || { echo "FAIL: no simd_avx512.c.o to check the scan against" >&2; exit 1; }
c=$(hits "$a512" '%zmm')
[ "$c" -gt 100 ] || { echo "FAIL: the scan finds only $c zmm lines in $a512: it would miss them elsewhere" >&2; exit 1; }
echo "ok: control: $c zmm lines in the avx512 kernels"

if grep -q '^KV_NATIVE:BOOL=ON' "$B/CMakeCache.txt" 2>/dev/null; then
  echo "SKIP: generic objects (a KV_NATIVE=ON build is built for this CPU)"
else
  scan '%[yz]mm' "AVX instruction(s) outside the per-ISA kernel files" 20 \
    -name '*.o' ! -name '*_avx2.c.o' ! -name '*_avxvnni.c.o' ! -name '*_avx512.c.o' &&
    echo "ok: $scanned generic objects without AVX"
fi
exit $fail
