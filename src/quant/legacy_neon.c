/* NEON (base ASIMD) kernels of the 32-value block types (legacy_neon_impl.h),
 * for every aarch64 CPU. On other architectures this file compiles to
 * nothing. */
#if defined(__aarch64__)
#include "quant/legacy_neon_impl.h"

void kv_quant_fill_legacy_neon(kv_kernels *k) { legacy_neon_fill(k); }
#else
typedef int kv_quant_legacy_neon_unused; /* ISO C wants a declaration in every file */
#endif
