/* NEON kernels of Q4_1, Q5_1 (against Q8_1 activations), Q5_0, IQ4_NL and
 * MXFP4 (against Q8_0), included by legacy_neon.c (base ASIMD) and
 * legacy_neon_dot.c (KV_NEON_DOT: compiled with +dotprod, called only when
 * HWCAP_ASIMDDP is set); bit-identical to legacy_ref.c (the canonical order
 * of quant/legacy.h). A block is unpacked to two int8x16 of weights (elements
 * 0..15, 16..31; table types through vqtbl1q_s8, fifth bits through vtst);
 * the int32 sum of each 4-element group is one vdotq_s32 (SDOT) or, without
 * it, vmull_s8 + two pairwise adds (exact: |w| <= 127, |a| <= 127, so every
 * int16 product fits): the same integers; lanes 0-3 /
 * 4-7 of an even block and of an odd block are four float32x4 accumulators
 * (Q4_1/Q5_1: the first two, one chain), updated with vfmaq (fused, as
 * fmaf); the min term is a scalar fmaf. */
#ifndef KV_QUANT_LEGACY_NEON_IMPL_H
#define KV_QUANT_LEGACY_NEON_IMPL_H
#include <arm_neon.h>

#include "quant/legacy.h"

#define AI static inline __attribute__((always_inline))

AI int32x4_t grp4(int8x16_t x, int8x16_t y) {
#ifdef KV_NEON_DOT
    return vdotq_s32(vdupq_n_s32(0), x, y);
#else
    const int16x8_t p0 = vmull_s8(vget_low_s8(x), vget_low_s8(y));
    const int16x8_t p1 = vmull_high_s8(x, y);
    return vpaddq_s32(vpaddlq_s16(p0), vpaddlq_s16(p1));
#endif
}

/* qs[16] -> nibbles of elements 0..15 (lo) and 16..31 (hi). */
AI void nibbles(const uint8_t *qs, uint8x16_t *lo, uint8x16_t *hi) {
    const uint8x16_t v = vld1q_u8(qs);
    *lo = vandq_u8(v, vdupq_n_u8(0xF));
    *hi = vshrq_n_u8(v, 4);
}

/* Bits j of qh (j = 0..15 in lo, 16..31 in hi) -> 0x10 in byte j. */
AI void bit4(const uint8_t *qh, uint8x16_t *lo, uint8x16_t *hi) {
    static const uint8_t bits[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t m = vld1q_u8(bits), x10 = vdupq_n_u8(0x10);
    const uint8x16_t b01 = vcombine_u8(vdup_n_u8(qh[0]), vdup_n_u8(qh[1]));
    const uint8x16_t b23 = vcombine_u8(vdup_n_u8(qh[2]), vdup_n_u8(qh[3]));
    *lo = vandq_u8(vtstq_u8(b01, m), x10);
    *hi = vandq_u8(vtstq_u8(b23, m), x10);
}

typedef void (*lx_unpack)(const void *row, int64_t b, int8x16_t *w0, int8x16_t *w1, float *dw, float *mw);

AI void un_q4_1(const void *row, int64_t b, int8x16_t *w0, int8x16_t *w1, float *dw, float *mw) {
    const kv_block_q4_1 *x = (const kv_block_q4_1 *)row + b;
    uint8x16_t lo, hi;
    nibbles(x->qs, &lo, &hi);
    *w0 = vreinterpretq_s8_u8(lo);
    *w1 = vreinterpretq_s8_u8(hi);
    *dw = kv_fp16_to_fp32(x->d);
    *mw = kv_fp16_to_fp32(x->m);
}
AI void un_q5_1(const void *row, int64_t b, int8x16_t *w0, int8x16_t *w1, float *dw, float *mw) {
    const kv_block_q5_1 *x = (const kv_block_q5_1 *)row + b;
    uint8x16_t lo, hi, h0, h1;
    nibbles(x->qs, &lo, &hi);
    bit4(x->qh, &h0, &h1);
    *w0 = vreinterpretq_s8_u8(vorrq_u8(lo, h0));
    *w1 = vreinterpretq_s8_u8(vorrq_u8(hi, h1));
    *dw = kv_fp16_to_fp32(x->d);
    *mw = kv_fp16_to_fp32(x->m);
}
AI void un_q5_0(const void *row, int64_t b, int8x16_t *w0, int8x16_t *w1, float *dw, float *mw) {
    const kv_block_q5_0 *x = (const kv_block_q5_0 *)row + b;
    uint8x16_t lo, hi, h0, h1;
    nibbles(x->qs, &lo, &hi);
    bit4(x->qh, &h0, &h1);
    const int8x16_t sixteen = vdupq_n_s8(16);
    *w0 = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(lo, h0)), sixteen);
    *w1 = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(hi, h1)), sixteen);
    *dw = kv_fp16_to_fp32(x->d);
    *mw = 0;
}
AI void un_iq4_nl(const void *row, int64_t b, int8x16_t *w0, int8x16_t *w1, float *dw, float *mw) {
    const kv_block_iq4_nl *x = (const kv_block_iq4_nl *)row + b;
    uint8x16_t lo, hi;
    nibbles(x->qs, &lo, &hi);
    const int8x16_t tab = vld1q_s8(kv_iq4nl_values);
    *w0 = vqtbl1q_s8(tab, lo);
    *w1 = vqtbl1q_s8(tab, hi);
    *dw = kv_fp16_to_fp32(x->d);
    *mw = 0;
}
AI void un_mxfp4(const void *row, int64_t b, int8x16_t *w0, int8x16_t *w1, float *dw, float *mw) {
    const kv_block_mxfp4 *x = (const kv_block_mxfp4 *)row + b;
    uint8x16_t lo, hi;
    nibbles(x->qs, &lo, &hi);
    const int8x16_t tab = vld1q_s8(kv_mxfp4_values);
    *w0 = vqtbl1q_s8(tab, lo);
    *w1 = vqtbl1q_s8(tab, hi);
    *dw = kv_e8m0_half(x->e);
    *mw = 0;
}

/* a: Q8_1 blocks (d, s, qs) when has_min, else Q8_0 (d, qs). */
AI void dot(lx_unpack un, int has_min, int64_t n, float *s, const void *w, const void *a) {
    float32x4_t acc[4] = {vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)};
    float summ = 0;
    for (int64_t b = 0; b < n / 32; b++) {
        int8x16_t w0, w1;
        float dw, mw;
        un(w, b, &w0, &w1, &dw, &mw);
        const int8_t *qa;
        float da;
        if (has_min) {
            const kv_block_q8_1 *y = (const kv_block_q8_1 *)a + b;
            qa = y->qs;
            da = kv_fp16_to_fp32(y->d);
            summ = fmaf(mw, kv_fp16_to_fp32(y->s), summ);
        } else {
            const kv_block_q8_0 *y = (const kv_block_q8_0 *)a + b;
            qa = y->qs;
            da = kv_fp16_to_fp32(y->d);
        }
        const float d = dw * da;
        const int o = has_min ? 0 : (int)(b & 1) * 2; /* Q4_1/Q5_1: one 8-lane chain */
        acc[o] = vfmaq_n_f32(acc[o], vcvtq_f32_s32(grp4(w0, vld1q_s8(qa))), d);
        acc[o + 1] = vfmaq_n_f32(acc[o + 1], vcvtq_f32_s32(grp4(w1, vld1q_s8(qa + 16))), d);
    }
    float l[16];
    for (int k = 0; k < 4; k++) vst1q_f32(l + 4 * k, acc[k]);
    *s = has_min ? kv_hsum8(l) + summ : kv_fold16(l);
}

#define LEGACY_NEON(T, HAS_MIN)                                                                  \
    static void T##_dot(int64_t n, float *s, const void *w, const void *a) { dot(un_##T, HAS_MIN, n, s, w, a); }
LEGACY_NEON(q4_1, 1)
LEGACY_NEON(q5_0, 0)
LEGACY_NEON(q5_1, 1)
LEGACY_NEON(iq4_nl, 0)
LEGACY_NEON(mxfp4, 0)

AI void legacy_neon_fill(kv_kernels *k) {
    k[KV_TYPE_Q4_1].vec_dot = q4_1_dot;     k[KV_TYPE_Q4_1].mat = NULL;
    k[KV_TYPE_Q5_0].vec_dot = q5_0_dot;     k[KV_TYPE_Q5_0].mat = NULL;
    k[KV_TYPE_Q5_1].vec_dot = q5_1_dot;     k[KV_TYPE_Q5_1].mat = NULL;
    k[KV_TYPE_IQ4_NL].vec_dot = iq4_nl_dot; k[KV_TYPE_IQ4_NL].mat = NULL;
    k[KV_TYPE_MXFP4].vec_dot = mxfp4_dot;   k[KV_TYPE_MXFP4].mat = NULL;
}
#endif
