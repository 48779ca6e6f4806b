/* NEON kernels with the int8 dot-product extension (vdotq_s32, ARMv8.2
 * DotProd). Compiled with +dotprod (CMakeLists.txt) and called only when
 * getauxval(AT_HWCAP) has HWCAP_ASIMDDP (quant/types.c), so a CPU without
 * it never runs an SDOT. The integer group sums differ from neon.c only in
 * how they are formed; the results are bit-identical to the scalar
 * reference. On other architectures this file compiles to nothing. */
#if defined(__aarch64__)
#define KV_NEON_DOT 1
#include "quant/neon_impl.h"

void kv_quant_fill_neondot(kv_kernels *k) { neon_fill(k); }
#else
typedef int kv_quant_neon_dot_unused; /* ISO C wants a declaration in every file */
#endif
