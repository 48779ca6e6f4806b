/* NEON kernels for aarch64 CPUs without the dot-product extension (base
 * ASIMD, which every aarch64 CPU has). The kernels are in neon_impl.h,
 * shared with neon_dot.c; both are bit-identical to the scalar reference.
 * On other architectures this file compiles to nothing. */
#if defined(__aarch64__)
#include "quant/neon_impl.h"

void kv_quant_fill_neon(kv_kernels *k) { neon_fill(k); }

void kv_f32_wsum_neon(float *o, const float *w, const float *V, size_t v_stride, int64_t n_rows,
                      int64_t n, int acc) {
    wsum_neon(o, w, V, v_stride, n_rows, n, acc);
}
#else
typedef int kv_quant_neon_unused; /* ISO C wants a declaration in every file */
#endif
