/* NEON kernels of the verifier (quant/vdot.h) for aarch64 (base ASIMD,
 * which every aarch64 CPU has). f64 in 2-lane registers, 4 columns at a
 * time: a chunk of PC projection rows (of r, f32 widened, or s, f64) against
 * NT answers, 2 PC NT accumulators, each row loaded once for all answers.
 * Lane l of chain h holds the columns j = 2h + l mod 4 in increasing j;
 * the chains are added at the end. The same terms as the reference in
 * another order (quant/vdot.h states the bound). On other architectures
 * this file compiles to nothing. */
#if defined(__aarch64__)
#include <arm_neon.h>

#include "quant/quant_internal.h"
#include "quant/vdot.h"

#define AI static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 32") /* the chains must stay in registers */

/* 4 columns as two f64 pairs */
AI void ld4(const float *p, float64x2_t *lo, float64x2_t *hi) {
    const float32x4_t v = vld1q_f32(p);
    *lo = vcvt_f64_f32(vget_low_f32(v));
    *hi = vcvt_high_f64_f32(v);
}
AI void ld4d(const double *p, float64x2_t *lo, float64x2_t *hi) {
    *lo = vld1q_f64(p);
    *hi = vld1q_f64(p + 2);
}

#define KV_PROJ(NAME, MT, LOAD)                                                                                      \
    AI void NAME(const int PC, const int NT, const MT *m, uint32_t n, uint32_t p0, uint32_t P,                       \
                 const float *const *v, double *out) {                                                               \
        const int U = PC * NT >= 4 ? 1 : 4 / (PC * NT); /* column blocks in flight: >= 8 chains */                   \
        float64x2_t acc[16][2];                                                                                      \
        UNROLL for (int k = 0; k < PC * NT * U; k++) acc[k][0] = acc[k][1] = vdupq_n_f64(0);                         \
        uint32_t j = 0;                                                                                              \
        for (; j + 4 * U <= n; j += 4 * U)                                                                           \
            UNROLL for (int u = 0; u < U; u++) {                                                                     \
                float64x2_t vl[4], vh[4];                                                                            \
                UNROLL for (int t = 0; t < NT; t++) ld4(v[t] + j + 4 * u, &vl[t], &vh[t]);                           \
                UNROLL for (int c = 0; c < PC; c++) {                                                                \
                    float64x2_t ml, mh;                                                                              \
                    LOAD(m + (size_t)(p0 + c) * n + j + 4 * u, &ml, &mh);                                            \
                    UNROLL for (int t = 0; t < NT; t++) {                                                            \
                        const int k = (c * NT + t) * U + u;                                                          \
                        acc[k][0] = vfmaq_f64(acc[k][0], ml, vl[t]);                                                 \
                        acc[k][1] = vfmaq_f64(acc[k][1], mh, vh[t]);                                                 \
                    }                                                                                                \
                }                                                                                                    \
            }                                                                                                        \
        for (; j + 4 <= n; j += 4)                                                                                   \
            UNROLL for (int c = 0; c < PC; c++) {                                                                    \
                float64x2_t ml, mh;                                                                                  \
                LOAD(m + (size_t)(p0 + c) * n + j, &ml, &mh);                                                        \
                UNROLL for (int t = 0; t < NT; t++) {                                                                \
                    float64x2_t vl, vh;                                                                              \
                    ld4(v[t] + j, &vl, &vh);                                                                         \
                    const int k = (c * NT + t) * U;                                                                  \
                    acc[k][0] = vfmaq_f64(acc[k][0], ml, vl);                                                        \
                    acc[k][1] = vfmaq_f64(acc[k][1], mh, vh);                                                        \
                }                                                                                                    \
            }                                                                                                        \
        UNROLL for (int c = 0; c < PC; c++) UNROLL for (int t = 0; t < NT; t++) {                                    \
            float64x2_t sum = vaddq_f64(acc[(c * NT + t) * U][0], acc[(c * NT + t) * U][1]);                         \
            UNROLL for (int u = 1; u < U; u++)                                                                       \
                sum = vaddq_f64(sum, vaddq_f64(acc[(c * NT + t) * U + u][0], acc[(c * NT + t) * U + u][1]));         \
            double q = vaddvq_f64(sum);                                                                              \
            for (uint32_t jj = j; jj < n; jj++) q += (double)m[(size_t)(p0 + c) * n + jj] * (double)v[t][jj];        \
            out[t * P + p0 + c] = q;                                                                                 \
        }                                                                                                            \
    }
KV_PROJ(proj_r, float, ld4)
KV_PROJ(proj_s, double, ld4d)

AI void sums2(const float *a, const float *b, const float *x, uint32_t n_in, double *S, double *B) {
    float64x2_t sa = vdupq_n_f64(0), sb = vdupq_n_f64(0);
    uint32_t j = 0;
    for (; j + 4 <= n_in; j += 4) {
        float64x2_t x0, x1, a0, a1, b0, b1;
        ld4(x + j, &x0, &x1);
        ld4(a + j, &a0, &a1);
        ld4(b + j, &b0, &b1);
        sa = vfmaq_f64(sa, a0, vabsq_f64(x0));
        sa = vfmaq_f64(sa, a1, vabsq_f64(x1));
        sb = vfmaq_f64(sb, vmulq_f64(b0, x0), x0);
        sb = vfmaq_f64(sb, vmulq_f64(b1, x1), x1);
    }
    double s_ = vaddvq_f64(sa), b_ = vaddvq_f64(sb);
    for (; j < n_in; j++) {
        const double xj = x[j];
        s_ += (double)a[j] * (xj < 0 ? -xj : xj);
        b_ += (double)b[j] * xj * xj;
    }
    *S = s_, *B = b_;
}

AI void dotsT(const int PC, const int NT, uint32_t P, const float *r, const float *const *o, uint32_t n_out,
              const double *s, const float *const *x, uint32_t n_in, double *lhs, double *rhs) {
    uint32_t p = 0;
    for (; p + PC <= P; p += PC) {
        proj_r(PC, NT, r, n_out, p, P, o, lhs);
        proj_s(PC, NT, s, n_in, p, P, x, rhs);
    }
    /* the rows left over, in chunks of 4, 2, 1 (each with enough chains, below) */
    if (PC > 4 && p + 4 <= P) {
        proj_r(4, NT, r, n_out, p, P, o, lhs);
        proj_s(4, NT, s, n_in, p, P, x, rhs);
        p += 4;
    }
    if (PC > 2 && p + 2 <= P) {
        proj_r(2, NT, r, n_out, p, P, o, lhs);
        proj_s(2, NT, s, n_in, p, P, x, rhs);
        p += 2;
    }
    if (p < P) {
        proj_r(1, NT, r, n_out, p, P, o, lhs);
        proj_s(1, NT, s, n_in, p, P, x, rhs);
    }
}

void kv_vdots_neon(KV_VDOT_ARGS) {
    for (uint32_t t = 0; t < nt; t++) sums2(a, b, x[t], n_in, S + t, B + t);
    switch (nt) {
    case 1: dotsT(4, 1, P, r, o, n_out, s, x, n_in, lhs, rhs); return;
    case 2: dotsT(4, 2, P, r, o, n_out, s, x, n_in, lhs, rhs); return;
    case 3: dotsT(2, 3, P, r, o, n_out, s, x, n_in, lhs, rhs); return;
    case 4: dotsT(2, 4, P, r, o, n_out, s, x, n_in, lhs, rhs); return;
    default: kv_vdots_ref(P, nt, r, o, n_out, s, a, b, x, n_in, lhs, rhs, S, B); /* nt > KV_VDOT_MAX_NT */
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
void kv_vaxpy_neon(uint32_t P, const double *rp, const float *w, uint32_t n, double *s, size_t stride) {
    uint32_t j = 0;
    for (; j + 4 <= n; j += 4) {
        float64x2_t w0, w1;
        ld4(w + j, &w0, &w1);
        for (uint32_t p = 0; p < P; p++) {
            double *sp = s + p * stride + j;
            vst1q_f64(sp, vaddq_f64(vld1q_f64(sp), vmulq_n_f64(w0, rp[p])));
            vst1q_f64(sp + 2, vaddq_f64(vld1q_f64(sp + 2), vmulq_n_f64(w1, rp[p])));
        }
    }
    for (uint32_t p = 0; p < P; p++)
        for (uint32_t jj = j; jj < n; jj++) s[p * stride + jj] += rp[p] * (double)w[jj];
}
#else
typedef int kv_vdot_neon_unused; /* ISO C wants a declaration in every file */
#endif
