/* NEON kernels of the verifier (quant/vdot.h) for aarch64 (base ASIMD,
 * which every aarch64 CPU has). f64 in 2-lane registers: a row of P
 * interleaved projections (P a multiple of 4) is P/2 registers, 8 or more
 * independent accumulator chains, added at the end. The same terms as the
 * reference in another order (quant/vdot.h states the bound). Other P: the
 * reference. On other architectures this file compiles to nothing. */
#if defined(__aarch64__)
#include <arm_neon.h>

#include "quant/quant_internal.h"
#include "quant/vdot.h"

#define AI static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16") /* the chains must stay in registers */

/* NP = P / 2 registers per row, U rows in flight */
AI void dots2(const uint32_t NP, const uint32_t U, const float *r, const float *o, uint32_t n_out,
              const double *s, const float *a, const float *b, const float *x, uint32_t n_in, double *lhs,
              double *rhs, double *S, double *B) {
    const uint32_t P = 2 * NP;
    float64x2_t acc[16];
    UNROLL
    for (int k = 0; k < 16; k++) acc[k] = vdupq_n_f64(0);
    uint32_t i = 0;
    for (; i + U <= n_out; i += U)
        UNROLL
        for (uint32_t u = 0; u < U; u++) {
            const double ou = (double)o[i + u];
            const float *ri = r + (size_t)(i + u) * P;
            UNROLL
            for (uint32_t c = 0; c < NP; c += 2) {
                const float32x4_t rv = vld1q_f32(ri + 2 * c);
                acc[u * NP + c] = vfmaq_n_f64(acc[u * NP + c], vcvt_f64_f32(vget_low_f32(rv)), ou);
                acc[u * NP + c + 1] = vfmaq_n_f64(acc[u * NP + c + 1], vcvt_high_f64_f32(rv), ou);
            }
        }
    for (; i < n_out; i++) {
        const double ou = (double)o[i];
        UNROLL
        for (uint32_t c = 0; c < NP; c += 2) {
            const float32x4_t rv = vld1q_f32(r + (size_t)i * P + 2 * c);
            acc[c] = vfmaq_n_f64(acc[c], vcvt_f64_f32(vget_low_f32(rv)), ou);
            acc[c + 1] = vfmaq_n_f64(acc[c + 1], vcvt_high_f64_f32(rv), ou);
        }
    }
    UNROLL
    for (uint32_t c = 0; c < NP; c++) {
        float64x2_t t = acc[c];
        UNROLL
        for (uint32_t u = 1; u < U; u++) t = vaddq_f64(t, acc[u * NP + c]);
        vst1q_f64(lhs + 2 * c, t);
    }
    UNROLL
    for (int k = 0; k < 16; k++) acc[k] = vdupq_n_f64(0);
    float64x2_t sa = vdupq_n_f64(0), sb = vdupq_n_f64(0);
    uint32_t j = 0;
    for (; j + 4 <= n_in; j += 4) {
        const float32x4_t xf = vld1q_f32(x + j), af = vld1q_f32(a + j), bf = vld1q_f32(b + j);
        const float64x2_t x0 = vcvt_f64_f32(vget_low_f32(xf)), x1 = vcvt_high_f64_f32(xf);
        sa = vfmaq_f64(sa, vcvt_f64_f32(vget_low_f32(af)), vabsq_f64(x0));
        sa = vfmaq_f64(sa, vcvt_high_f64_f32(af), vabsq_f64(x1));
        sb = vfmaq_f64(sb, vmulq_f64(vcvt_f64_f32(vget_low_f32(bf)), x0), x0);
        sb = vfmaq_f64(sb, vmulq_f64(vcvt_high_f64_f32(bf), x1), x1);
        const double xd[4] = {vgetq_lane_f64(x0, 0), vgetq_lane_f64(x0, 1), vgetq_lane_f64(x1, 0),
                              vgetq_lane_f64(x1, 1)};
        UNROLL
        for (uint32_t k = 0; k < 4; k++) {
            const double *sj = s + (size_t)(j + k) * P;
            const uint32_t u = k % U;
            UNROLL
            for (uint32_t c = 0; c < NP; c++) acc[u * NP + c] = vfmaq_n_f64(acc[u * NP + c], vld1q_f64(sj + 2 * c), xd[k]);
        }
    }
    double s_ = vaddvq_f64(sa), b_ = vaddvq_f64(sb);
    for (; j < n_in; j++) {
        const double xj = x[j];
        UNROLL
        for (uint32_t c = 0; c < NP; c++) acc[c] = vfmaq_n_f64(acc[c], vld1q_f64(s + (size_t)j * P + 2 * c), xj);
        s_ += (double)a[j] * (xj < 0 ? -xj : xj);
        b_ += (double)b[j] * xj * xj;
    }
    UNROLL
    for (uint32_t c = 0; c < NP; c++) {
        float64x2_t t = acc[c];
        UNROLL
        for (uint32_t u = 1; u < U; u++) t = vaddq_f64(t, acc[u * NP + c]);
        vst1q_f64(rhs + 2 * c, t);
    }
    *S = s_, *B = b_;
}

/* one answer at a time (no shared loads across answers here yet) */
void kv_vdots_neon(KV_VDOT_ARGS) {
    for (uint32_t t = 0; t < nt; t++) {
        double *lt = lhs + t * P, *rt = rhs + t * P;
        switch (P) {
        case 4: dots2(2, 4, r, o[t], n_out, s, a, b, x[t], n_in, lt, rt, S + t, B + t); break;
        case 8: dots2(4, 2, r, o[t], n_out, s, a, b, x[t], n_in, lt, rt, S + t, B + t); break;
        case 16: dots2(8, 2, r, o[t], n_out, s, a, b, x[t], n_in, lt, rt, S + t, B + t); break;
        default: kv_vdots_ref(P, 1, r, o + t, n_out, s, a, b, x + t, n_in, lt, rt, S + t, B + t);
        }
    }
}

/* d * (float)q, one rounded multiply per value: the bits of to_float */
AI void deq16(const int8_t *q, float d, float *out) {
    const int8x16_t w = vld1q_s8(q);
    const int16x8_t lo = vmovl_s8(vget_low_s8(w)), hi = vmovl_s8(vget_high_s8(w));
    vst1q_f32(out, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), d));
    vst1q_f32(out + 4, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))), d));
    vst1q_f32(out + 8, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), d));
    vst1q_f32(out + 12, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi))), d));
}

void kv_vdeq_neon(uint32_t vdt, const void *q, float *out, uint32_t n) {
    if (vdt == KV_TYPE_Q8_K) {
        const kv_block_q8_K *bk = q;
        for (uint32_t i = 0; i < n / KV_QK_K; i++)
            UNROLL
            for (int c = 0; c < KV_QK_K / 16; c++) deq16(bk[i].qs + 16 * c, bk[i].d, out + (size_t)i * KV_QK_K + 16 * c);
    } else if (vdt == KV_TYPE_Q8_0) {
        const kv_block_q8_0 *b0 = q;
        for (uint32_t i = 0; i < n / KV_QK8_0; i++) {
            const float d = kv_fp16_to_fp32(b0[i].d);
            deq16(b0[i].qs, d, out + (size_t)i * KV_QK8_0);
            deq16(b0[i].qs + 16, d, out + (size_t)i * KV_QK8_0 + 16);
        }
    } else {
        kv_vdeq_ref(vdt, q, out, n);
    }
}
#else
typedef int kv_vdot_neon_unused; /* ISO C wants a declaration in every file */
#endif
