/* Q2_K, Q3_K and IQ4_XS against Q8_K with NEON (aarch64 ASIMD; installed
 * only when the kernel's hwcaps report it). Bit-identical to kquant_ref.c:
 * each group of 16 values is multiplied into int16 (vmull_s8: every
 * product fits), folded pairwise twice into 4 int32 lanes holding values
 * 4j..4j+3, which are the canonical lanes of quant_internal.h (the first
 * 16 values of a chunk give lanes 0..3, the last 16 lanes 4..7); the
 * integers are exact, and the float steps (one conversion, one fused
 * multiply-add per lane and super-block, kv_hsum8's tree) are the
 * reference's. vec_dot only; kv_mat_rows uses the generic tile. */
#if defined(__aarch64__)
#include <arm_neon.h>

#include "quant/legacy.h" /* kv_iq4nl_values */
#include "quant/quant_internal.h"

#define AI static inline __attribute__((always_inline))

/* The 4 int32 sums of values 4j..4j+3 of w[0..16) * a[0..16). */
AI int32x4_t dot16(int8x16_t w, int8x16_t a) {
    const int32x4_t lo = vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(a)));
    const int32x4_t hi = vpaddlq_s16(vmull_high_s8(w, a));
    return vpaddq_s32(lo, hi);
}

/* kv_hsum8 over lanes lo = l0..l3, hi = l4..l7. */
AI float hsum8(float32x4_t lo, float32x4_t hi) {
    const float32x4_t a = vaddq_f32(lo, hi);
    const float b0 = vgetq_lane_f32(a, 0) + vgetq_lane_f32(a, 2), b1 = vgetq_lane_f32(a, 1) + vgetq_lane_f32(a, 3);
    return b0 + b1;
}

/* Chunk c's 32 values u[0..32) (two registers) against its activations:
 * lanes 0..3 scaled by s0, 4..7 by s1, added to L. */
AI void chunk(int32x4_t L[2], uint8x16_t u0, uint8x16_t u1, const int8_t *a, int32_t s0, int32_t s1) {
    L[0] = vmlaq_n_s32(L[0], dot16(vreinterpretq_s8_u8(u0), vld1q_s8(a)), s0);
    L[1] = vmlaq_n_s32(L[1], dot16(vreinterpretq_s8_u8(u1), vld1q_s8(a + 16)), s1);
}

static void q2_K_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_q2_K *x = w;
    const kv_block_q8_K *y = a;
    const uint8x16_t m3 = vdupq_n_u8(3);
    float32x4_t acc[2] = {vdupq_n_f32(0), vdupq_n_f32(0)}, accm[2] = {vdupq_n_f32(0), vdupq_n_f32(0)};
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        int32x4_t L[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
        for (int h = 0; h < 2; h++) {
            const uint8x16_t q0 = vld1q_u8(x[i].qs + 32 * h), q1 = vld1q_u8(x[i].qs + 32 * h + 16);
            for (int k = 0; k < 4; k++) {
                const int c = 4 * h + k;
                const int8x16_t sh = vdupq_n_s8((int8_t)(-2 * k));
                chunk(L, vandq_u8(vshlq_u8(q0, sh), m3), vandq_u8(vshlq_u8(q1, sh), m3), y[i].qs + 32 * c,
                      x[i].scales[2 * c] & 0xF, x[i].scales[2 * c + 1] & 0xF);
            }
        }
        int32_t M[8];
        for (int j = 0; j < 8; j++)
            M[j] = (x[i].scales[2 * j] >> 4) * y[i].bsums[2 * j] + (x[i].scales[2 * j + 1] >> 4) * y[i].bsums[2 * j + 1];
        const float32x4_t dd = vdupq_n_f32(y[i].d * kv_fp16_to_fp32(x[i].d));
        const float32x4_t dm = vdupq_n_f32(y[i].d * kv_fp16_to_fp32(x[i].dmin));
        for (int r = 0; r < 2; r++) {
            acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(L[r]), dd);
            accm[r] = vfmaq_f32(accm[r], vcvtq_f32_s32(vld1q_s32(M + 4 * r)), dm);
        }
    }
    *s = hsum8(vsubq_f32(acc[0], accm[0]), vsubq_f32(acc[1], accm[1]));
}

static void q3_K_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_q3_K *x = w;
    const kv_block_q8_K *y = a;
    const uint8x16_t m3 = vdupq_n_u8(3), one = vdupq_n_u8(1);
    float32x4_t acc[2] = {vdupq_n_f32(0), vdupq_n_f32(0)};
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        int8_t sc[16];
        kv_unpack_q3_scales(x[i].scales, sc);
        const uint8x16_t hm0 = vld1q_u8(x[i].hmask), hm1 = vld1q_u8(x[i].hmask + 16);
        int32x4_t L[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
        for (int h = 0; h < 2; h++) {
            const uint8x16_t q0 = vld1q_u8(x[i].qs + 32 * h), q1 = vld1q_u8(x[i].qs + 32 * h + 16);
            for (int k = 0; k < 4; k++) {
                const int c = 4 * h + k;
                const int8x16_t sh = vdupq_n_s8((int8_t)(-2 * k)), shh = vdupq_n_s8((int8_t)-c);
                const uint8x16_t u0 = vorrq_u8(vandq_u8(vshlq_u8(q0, sh), m3), vshlq_n_u8(vandq_u8(vshlq_u8(hm0, shh), one), 2));
                const uint8x16_t u1 = vorrq_u8(vandq_u8(vshlq_u8(q1, sh), m3), vshlq_n_u8(vandq_u8(vshlq_u8(hm1, shh), one), 2));
                chunk(L, u0, u1, y[i].qs + 32 * c, sc[2 * c], sc[2 * c + 1]);
            }
        }
        int32_t C[8];
        for (int j = 0; j < 8; j++) C[j] = sc[2 * j] * y[i].bsums[2 * j] + sc[2 * j + 1] * y[i].bsums[2 * j + 1];
        const float32x4_t dd = vdupq_n_f32(y[i].d * kv_fp16_to_fp32(x[i].d));
        for (int r = 0; r < 2; r++)
            acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(vsubq_s32(L[r], vshlq_n_s32(vld1q_s32(C + 4 * r), 2))), dd);
    }
    *s = hsum8(acc[0], acc[1]);
}

static void iq4_xs_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_iq4_xs *x = w;
    const kv_block_q8_K *y = a;
    const int8x16_t tbl = vld1q_s8(kv_iq4nl_values);
    const uint8x16_t m4 = vdupq_n_u8(0xF);
    float32x4_t acc[2] = {vdupq_n_f32(0), vdupq_n_f32(0)};
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        int32x4_t L[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
        for (int ib = 0; ib < 8; ib++) {
            const uint8x16_t q = vld1q_u8(x[i].qs + 16 * ib);
            const int8x16_t v0 = vqtbl1q_s8(tbl, vandq_u8(q, m4)), v1 = vqtbl1q_s8(tbl, vshrq_n_u8(q, 4));
            const int32_t ls = kv_iq4_xs_scale(&x[i], ib);
            L[0] = vmlaq_n_s32(L[0], dot16(v0, vld1q_s8(y[i].qs + 32 * ib)), ls);
            L[1] = vmlaq_n_s32(L[1], dot16(v1, vld1q_s8(y[i].qs + 32 * ib + 16)), ls);
        }
        const float32x4_t dd = vdupq_n_f32(y[i].d * kv_fp16_to_fp32(x[i].d));
        for (int r = 0; r < 2; r++) acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(L[r]), dd);
    }
    *s = hsum8(acc[0], acc[1]);
}

void kv_kquant_fill_neon(kv_kernels *k) {
    k[KV_TYPE_Q2_K].vec_dot = q2_K_dot;
    k[KV_TYPE_Q3_K].vec_dot = q3_K_dot;
    k[KV_TYPE_IQ4_XS].vec_dot = iq4_xs_dot;
}
#else
typedef int kv_kquant_neon_unused; /* ISO C wants a declaration in every file */
#endif
