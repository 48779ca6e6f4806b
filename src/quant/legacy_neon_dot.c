/* NEON kernels of the 32-value block types with the int8 dot product
 * (vdotq_s32; legacy_neon_impl.h), compiled with +dotprod (CMakeLists.txt)
 * and called only when getauxval(AT_HWCAP) has HWCAP_ASIMDDP. On other
 * architectures this file compiles to nothing. */
#if defined(__aarch64__)
#define KV_NEON_DOT 1
#include "quant/legacy_neon_impl.h"

void kv_quant_fill_legacy_neondot(kv_kernels *k) { legacy_neon_fill(k); }
#else
typedef int kv_quant_legacy_neon_dot_unused; /* ISO C wants a declaration in every file */
#endif
