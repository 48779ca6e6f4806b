/* The verifier's kernels (quant/vdot.h): the scalar reference, the
 * finiteness test, and the run-time choice of a backend, which follows the
 * quant kernels' level (a level is only ever chosen on a CPU that runs it,
 * quant/types.c), so no SIMD code runs on a CPU without it. */
#include <math.h>
#include <string.h>

#include "kvasir/ops.h"
#include "kvasir/quant.h"
#include "quant/quant_internal.h"
#include "quant/vdot.h"

#if defined(__x86_64__) || defined(__i386__)
#define KV_VX86 1
#endif

/* The reference: every sum in f64 in increasing index, one chain each. */
void kv_vdots_ref(KV_VDOT_ARGS) {
    for (uint32_t t = 0; t < nt; t++) {
        for (uint32_t p = 0; p < P; p++) {
            const float *rp = r + (size_t)p * n_out;
            const double *sp = s + (size_t)p * n_in;
            double l = 0, h = 0;
            for (uint32_t i = 0; i < n_out; i++) l += (double)rp[i] * (double)o[t][i];
            for (uint32_t j = 0; j < n_in; j++) h += sp[j] * (double)x[t][j];
            lhs[t * P + p] = l, rhs[t * P + p] = h;
        }
        double s_ = 0, b_ = 0;
        for (uint32_t j = 0; j < n_in; j++) {
            const double xj = x[t][j];
            s_ += (double)a[j] * fabs(xj);
            b_ += (double)b[j] * xj * xj;
        }
        S[t] = s_, B[t] = b_;
    }
}

void kv_vdeq_ref(uint32_t vdt, const void *q, float *out, uint32_t n) { kv_type_get_ref(vdt)->to_float(q, out, n); }

/* by the exponent bits, as the SIMD versions do */
bool kv_vfinite_ref(const float *x, uint32_t n) {
    uint32_t bad = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        bad |= (u & 0x7f800000u) == 0x7f800000u; /* exponent all ones: inf or NaN */
    }
    return !bad;
}

void kv_vswiglu_ref(float *h, const float *g, const float *u, uint32_t n) { kv_swiglu(h, g, u, n); }

void kv_vaxpy_ref(uint32_t P, const double *rp, const float *w, uint32_t n, double *s, size_t stride) {
    for (uint32_t p = 0; p < P; p++) {
        double *sp = s + p * stride;
        for (uint32_t j = 0; j < n; j++) sp[j] += rp[p] * (double)w[j];
    }
}

static const kv_vkernels kv_vk_ref = {"scalar", kv_vdots_ref, kv_vdeq_ref, kv_vfinite_ref, kv_vswiglu_ref, kv_vaxpy_ref, NULL};
#ifdef KV_VX86
static const kv_vkernels kv_vk_avx2 = {"avx2", kv_vdots_avx2, kv_vdeq_avx2, kv_vfinite_avx2, kv_vswiglu_avx2, kv_vaxpy_avx2, NULL};
static const kv_vkernels kv_vk_avx512 = {"avx512", kv_vdots_avx512, kv_vdeq_avx2, kv_vfinite_avx2, kv_vswiglu_avx2, kv_vaxpy_avx512, kv_vq8k_avx512};
#endif
#if defined(__aarch64__)
static const kv_vkernels kv_vk_neon = {"neon", kv_vdots_neon, kv_vdeq_neon, kv_vfinite_ref, kv_vswiglu_ref, kv_vaxpy_neon, NULL};
#endif

const kv_vkernels *kv_vkernels_ref(void) { return &kv_vk_ref; }

const kv_vkernels *kv_vkernels_get(void) {
    const char *be = kv_quant_backend();
#ifdef KV_VX86
    if (!strcmp(be, "avx512")) return &kv_vk_avx512;
    if (!strcmp(be, "avx2") || !strcmp(be, "avxvnni")) return &kv_vk_avx2;
#endif
#if defined(__aarch64__)
    if (!strncmp(be, "neon", 4)) return &kv_vk_neon;
#endif
    (void)be;
    return &kv_vk_ref;
}
