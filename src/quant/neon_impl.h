/* NEON kernels (aarch64), included by neon.c (base ASIMD) and neon_dot.c
 * (ASIMD + the int8 dot-product extension, compiled with +dotprod and only
 * called when getauxval(AT_HWCAP) has HWCAP_ASIMDDP). KV_NEON_DOT selects
 * how the exact integer group sums are formed; everything after them is
 * shared.
 *
 * Every kernel follows the canonical reduction order of quant_internal.h,
 * so results are bit-identical to the scalar reference (and therefore to
 * AVX2 and AVX-512):
 *  - float types: lanes 0-3 and 4-7 of the 8 canonical lanes are two
 *    float32x4 accumulators updated with vfmaq_f32 (a fused multiply-add,
 *    as fmaf) in element order; the tail and kv_hsum8 are the scalar code.
 *  - Q8_0, Q4_0 and the K-quants: the int32 sum of each 4-element group is
 *    exact, however it is formed (vdotq_s32 sums 4 consecutive bytes per
 *    lane: the canonical group; without it vmull_s8 + two pairwise adds give
 *    the same sum); the float steps are one fused vfmaq per lane group in
 *    block order, as the reference. Q8_0 adds the groups of a block's two
 *    16-byte halves lane by lane (4 lanes); Q4_0 keeps them apart (16).
 * Activation blocks hold values in [-127, 127], so a product of an int8 and
 * a weight quant (|q| <= 63 for the unsigned K-quant values, <= 128 for
 * Q8_0) fits int16 in the non-dot path. */
#ifndef KV_QUANT_NEON_IMPL_H
#define KV_QUANT_NEON_IMPL_H

#include <arm_neon.h>

#include "quant/quant_internal.h"

#define AI static inline __attribute__((always_inline))

AI float h2f(uint16_t h) { return kv_fp16_to_fp32(h); }

/* Sums of the 4-byte groups of x*y (16 signed bytes each): lane g holds
 * sum_{i=4g..4g+3} x[i]*y[i], exactly. */
AI int32x4_t grp4(int8x16_t x, int8x16_t y) {
#ifdef KV_NEON_DOT
    return vdotq_s32(vdupq_n_s32(0), x, y);
#else
    int16x8_t p0 = vmull_s8(vget_low_s8(x), vget_low_s8(y));
    int16x8_t p1 = vmull_high_s8(x, y);
    return vpaddq_s32(vpaddlq_s16(p0), vpaddlq_s16(p1));
#endif
}

/* Store the 8 canonical lanes and reduce with the scalar tree. */
AI float hsum8_v(float32x4_t lo, float32x4_t hi) {
    float l[8];
    vst1q_f32(l, lo);
    vst1q_f32(l + 4, hi);
    return kv_hsum8(l);
}

/* ================================================================== */
/* float types                                                          */

AI float32x4_t ld_f16(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
AI float32x4_t ld_bf16(const uint16_t *p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }

static void f32_dot(int64_t n, float *s, const void *w, const void *a) {
    const float *x = w, *y = a;
    float32x4_t lo = vdupq_n_f32(0), hi = vdupq_n_f32(0);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        lo = vfmaq_f32(lo, vld1q_f32(x + i), vld1q_f32(y + i));
        hi = vfmaq_f32(hi, vld1q_f32(x + i + 4), vld1q_f32(y + i + 4));
    }
    float l[8];
    vst1q_f32(l, lo);
    vst1q_f32(l + 4, hi);
    for (; i < n; i++) l[i & 7] = fmaf(x[i], y[i], l[i & 7]);
    *s = kv_hsum8(l);
}

static void f16_dot(int64_t n, float *s, const void *w, const void *a) {
    const uint16_t *x = w, *y = a;
    float32x4_t lo = vdupq_n_f32(0), hi = vdupq_n_f32(0);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        lo = vfmaq_f32(lo, ld_f16(x + i), ld_f16(y + i));
        hi = vfmaq_f32(hi, ld_f16(x + i + 4), ld_f16(y + i + 4));
    }
    float l[8];
    vst1q_f32(l, lo);
    vst1q_f32(l + 4, hi);
    for (; i < n; i++) l[i & 7] = fmaf(kv_fp16_to_fp32(x[i]), kv_fp16_to_fp32(y[i]), l[i & 7]);
    *s = kv_hsum8(l);
}

static void bf16_dot(int64_t n, float *s, const void *w, const void *a) {
    const uint16_t *x = w, *y = a;
    float32x4_t lo = vdupq_n_f32(0), hi = vdupq_n_f32(0);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        lo = vfmaq_f32(lo, ld_bf16(x + i), ld_bf16(y + i));
        hi = vfmaq_f32(hi, ld_bf16(x + i + 4), ld_bf16(y + i + 4));
    }
    float l[8];
    vst1q_f32(l, lo);
    vst1q_f32(l + 4, hi);
    for (; i < n; i++) l[i & 7] = fmaf(kv_bf16_to_fp32(x[i]), kv_bf16_to_fp32(y[i]), l[i & 7]);
    *s = kv_hsum8(l);
}

/* ================================================================== */
/* Q8_0 . Q8_0: 4 lanes, lane l = values j with (j % 16) / 4 == l        */

/* Lane l: sum of x*y over bytes 4l..4l+3 of both 16-byte halves (values
 * 4l..4l+3 and 16+4l..16+4l+3), exact in int32. */
AI int32x4_t q8_lanes(const int8_t *x, const int8_t *y) {
    const int8x16_t x0 = vld1q_s8(x), x1 = vld1q_s8(x + 16);
    const int8x16_t y0 = vld1q_s8(y), y1 = vld1q_s8(y + 16);
#ifdef KV_NEON_DOT
    return vdotq_s32(vdotq_s32(vdupq_n_s32(0), x0, y0), x1, y1);
#else
    return vaddq_s32(grp4(x0, y0), grp4(x1, y1));
#endif
}

/* One fma chain per lane in block order, then kv_hsum4. */
static void q8_0_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_q8_0 *x = w, *y = a;
    float32x4_t acc = vdupq_n_f32(0);
    for (int64_t b = 0; b < n / KV_QK8_0; b++) {
        const float d = h2f(x[b].d) * h2f(y[b].d);
        acc = vfmaq_n_f32(acc, vcvtq_f32_s32(q8_lanes(x[b].qs, y[b].qs)), d);
    }
    float l[4];
    vst1q_f32(l, acc);
    *s = kv_hsum4(l);
}

/* ================================================================== */
/* Q4_0 . Q8_0: 16 lanes, lane 8*(b&1) + g                              */

/* acc[0..1]: even block lanes 0-3 / 4-7; acc[2..3]: odd block. */
AI void q80_step(float32x4_t acc[4], int64_t b, int8x16_t x0, int8x16_t x1, const kv_block_q8_0 *y,
                 float dw) {
    const float d = dw * h2f(y->d);
    const int32x4_t g0 = grp4(x0, vld1q_s8(y->qs)), g1 = grp4(x1, vld1q_s8(y->qs + 16));
    const int o = (int)(b & 1) * 2;
    acc[o] = vfmaq_n_f32(acc[o], vcvtq_f32_s32(g0), d);
    acc[o + 1] = vfmaq_n_f32(acc[o + 1], vcvtq_f32_s32(g1), d);
}

AI float q80_result(const float32x4_t acc[4]) {
    float l[16];
    for (int k = 0; k < 4; k++) vst1q_f32(l + 4 * k, acc[k]);
    return kv_fold16(l);
}

static void q4_0_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_q4_0 *x = w;
    const kv_block_q8_0 *y = a;
    float32x4_t acc[4] = {vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)};
    const uint8x16_t m4 = vdupq_n_u8(0xF);
    const int8x16_t eight = vdupq_n_s8(8);
    for (int64_t b = 0; b < n / KV_QK4_0; b++) {
        const uint8x16_t v = vld1q_u8(x[b].qs);
        const int8x16_t lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, m4)), eight);
        const int8x16_t hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), eight);
        q80_step(acc, b, lo, hi, &y[b], h2f(x[b].d));
    }
    *s = q80_result(acc);
}

/* ================================================================== */
/* K-quants . Q8_K: 8 lanes, lane j = groups with (e/4) % 8 == j        */

/* Lane sums of 32 quants q[0..32) (as two int8x16, values >= 0) against 32
 * activations: lanes 0-3 take groups 0-3 (q[0..16)), lanes 4-7 groups 4-7. */
AI void grp32(int32x4_t *lo, int32x4_t *hi, int8x16_t q0, int8x16_t q1, const int8_t *a) {
    *lo = grp4(q0, vld1q_s8(a));
    *hi = grp4(q1, vld1q_s8(a + 16));
}

/* Sub-block mins times bsum pairs: M_j = m_j * (bsums[2j] + bsums[2j+1]). */
AI void k4_mins(const uint8_t m[8], const int16_t *bsums, int32x4_t *mlo, int32x4_t *mhi) {
    const int32x4_t p0 = vpaddlq_s16(vld1q_s16(bsums)), p1 = vpaddlq_s16(vld1q_s16(bsums + 8));
    const int32_t mm[8] = {m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7]};
    *mlo = vmulq_s32(p0, vld1q_s32(mm));
    *mhi = vmulq_s32(p1, vld1q_s32(mm + 4));
}

/* Q5 selects the fifth bit from qh. */
AI void k4_dot(int64_t n, float *s, const void *w, const void *a, int q5) {
    const kv_block_q8_K *y = a;
    float32x4_t acc0 = vdupq_n_f32(0), acc1 = vdupq_n_f32(0);
    float32x4_t accm0 = vdupq_n_f32(0), accm1 = vdupq_n_f32(0);
    const uint8x16_t m4 = vdupq_n_u8(0xF), b16 = vdupq_n_u8(0x10);
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        const uint8_t *scales, *qs, *qh = NULL;
        uint16_t d16, dm16;
        if (q5) {
            const kv_block_q5_K *x = (const kv_block_q5_K *)w + i;
            scales = x->scales; qs = x->qs; qh = x->qh; d16 = x->d; dm16 = x->dmin;
        } else {
            const kv_block_q4_K *x = (const kv_block_q4_K *)w + i;
            scales = x->scales; qs = x->qs; d16 = x->d; dm16 = x->dmin;
        }
        uint8_t sc[8], m[8];
        kv_unpack_k4(scales, sc, m);
        int32x4_t L0 = vdupq_n_s32(0), L1 = vdupq_n_s32(0);
        uint8x16_t h0 = vdupq_n_u8(0), h1 = vdupq_n_u8(0);
        if (q5) {
            h0 = vld1q_u8(qh);
            h1 = vld1q_u8(qh + 16);
        }
        for (int c = 0; c < 4; c++) {
            const uint8x16_t v0 = vld1q_u8(qs + 32 * c), v1 = vld1q_u8(qs + 32 * c + 16);
            uint8x16_t lo0 = vandq_u8(v0, m4), lo1 = vandq_u8(v1, m4);
            uint8x16_t hi0 = vshrq_n_u8(v0, 4), hi1 = vshrq_n_u8(v1, 4);
            if (q5) {
                /* bit 2c of qh -> bit 4 (shift by 4-2c), bit 2c+1 -> bit 4 (3-2c) */
                const int8x16_t sl = vdupq_n_s8((int8_t)(4 - 2 * c)), sh = vdupq_n_s8((int8_t)(3 - 2 * c));
                lo0 = vorrq_u8(lo0, vandq_u8(vshlq_u8(h0, sl), b16));
                lo1 = vorrq_u8(lo1, vandq_u8(vshlq_u8(h1, sl), b16));
                hi0 = vorrq_u8(hi0, vandq_u8(vshlq_u8(h0, sh), b16));
                hi1 = vorrq_u8(hi1, vandq_u8(vshlq_u8(h1, sh), b16));
            }
            const int8_t *a8 = y[i].qs + 64 * c;
            int32x4_t pl0, pl1, ph0, ph1;
            grp32(&pl0, &pl1, vreinterpretq_s8_u8(lo0), vreinterpretq_s8_u8(lo1), a8);
            grp32(&ph0, &ph1, vreinterpretq_s8_u8(hi0), vreinterpretq_s8_u8(hi1), a8 + 32);
            L0 = vmlaq_n_s32(vmlaq_n_s32(L0, pl0, sc[2 * c]), ph0, sc[2 * c + 1]);
            L1 = vmlaq_n_s32(vmlaq_n_s32(L1, pl1, sc[2 * c]), ph1, sc[2 * c + 1]);
        }
        int32x4_t M0, M1;
        k4_mins(m, y[i].bsums, &M0, &M1);
        const float dd = y[i].d * h2f(d16), dm = y[i].d * h2f(dm16);
        acc0 = vfmaq_n_f32(acc0, vcvtq_f32_s32(L0), dd);
        acc1 = vfmaq_n_f32(acc1, vcvtq_f32_s32(L1), dd);
        accm0 = vfmaq_n_f32(accm0, vcvtq_f32_s32(M0), dm);
        accm1 = vfmaq_n_f32(accm1, vcvtq_f32_s32(M1), dm);
    }
    *s = hsum8_v(vsubq_f32(acc0, accm0), vsubq_f32(acc1, accm1));
}

static void q4_K_dot(int64_t n, float *s, const void *w, const void *a) { k4_dot(n, s, w, a, 0); }
static void q5_K_dot(int64_t n, float *s, const void *w, const void *a) { k4_dot(n, s, w, a, 1); }

/* Q6_K: half h (128 values), quarter k (32): quant l = low 4 bits from
 * ql[64h + 32(k&1) + l] (low or high nibble by k&2) | 2 bits from
 * qh[32h + l] >> 2k, unsigned 0..63; scale 8h+2k for l < 16, 8h+2k+1 else. */
static void q6_K_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_q6_K *x = w;
    const kv_block_q8_K *y = a;
    float32x4_t acc0 = vdupq_n_f32(0), acc1 = vdupq_n_f32(0);
    const uint8x16_t m4 = vdupq_n_u8(0xF), m3 = vdupq_n_u8(0x30);
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        int32x4_t L0 = vdupq_n_s32(0), L1 = vdupq_n_s32(0);
        const int8_t *sc = x[i].scales;
        for (int h = 0; h < 2; h++) {
            const uint8x16_t qh0 = vld1q_u8(x[i].qh + 32 * h), qh1 = vld1q_u8(x[i].qh + 32 * h + 16);
            for (int k = 0; k < 4; k++) {
                const uint8_t *ql = x[i].ql + 64 * h + 32 * (k & 1);
                uint8x16_t l0 = vld1q_u8(ql), l1 = vld1q_u8(ql + 16);
                if (k & 2) {
                    l0 = vshrq_n_u8(l0, 4);
                    l1 = vshrq_n_u8(l1, 4);
                } else {
                    l0 = vandq_u8(l0, m4);
                    l1 = vandq_u8(l1, m4);
                }
                /* bits 2k, 2k+1 of qh -> bits 4, 5 (shift by 4-2k) */
                const int8x16_t sh = vdupq_n_s8((int8_t)(4 - 2 * k));
                l0 = vorrq_u8(l0, vandq_u8(vshlq_u8(qh0, sh), m3));
                l1 = vorrq_u8(l1, vandq_u8(vshlq_u8(qh1, sh), m3));
                int32x4_t p0, p1;
                grp32(&p0, &p1, vreinterpretq_s8_u8(l0), vreinterpretq_s8_u8(l1), y[i].qs + 128 * h + 32 * k);
                L0 = vmlaq_n_s32(L0, p0, sc[8 * h + 2 * k]);
                L1 = vmlaq_n_s32(L1, p1, sc[8 * h + 2 * k + 1]);
            }
        }
        /* C_j = sc_2j * bsums[2j] + sc_2j+1 * bsums[2j+1], as int32 */
        const int16x8_t sc16a = vmovl_s8(vld1_s8(sc)), sc16b = vmovl_s8(vld1_s8(sc + 8));
        const int32x4_t C0 = vpaddq_s32(vmull_s16(vget_low_s16(sc16a), vld1_s16(y[i].bsums)),
                                        vmull_high_s16(sc16a, vld1q_s16(y[i].bsums)));
        const int32x4_t C1 = vpaddq_s32(vmull_s16(vget_low_s16(sc16b), vld1_s16(y[i].bsums + 8)),
                                        vmull_high_s16(sc16b, vld1q_s16(y[i].bsums + 8)));
        const float dd = y[i].d * h2f(x[i].d);
        acc0 = vfmaq_n_f32(acc0, vcvtq_f32_s32(vsubq_s32(L0, vshlq_n_s32(C0, 5))), dd);
        acc1 = vfmaq_n_f32(acc1, vcvtq_f32_s32(vsubq_s32(L1, vshlq_n_s32(C1, 5))), dd);
    }
    *s = hsum8_v(acc0, acc1);
}

/* ================================================================== */
/* float helper: o[i] = fma chain over rows p (quant/vec.h)             */

AI void wsum_neon(float *o, const float *w, const float *V, size_t v_stride, int64_t n_rows,
                  int64_t n, int acc0) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        float32x4_t acc[4];
        for (int k = 0; k < 4; k++) acc[k] = acc0 ? vld1q_f32(o + i + 4 * k) : vdupq_n_f32(0);
        for (int64_t p = 0; p < n_rows; p++) {
            const float *v = V + (size_t)p * v_stride + i;
            for (int k = 0; k < 4; k++) acc[k] = vfmaq_n_f32(acc[k], vld1q_f32(v + 4 * k), w[p]);
        }
        for (int k = 0; k < 4; k++) vst1q_f32(o + i + 4 * k, acc[k]);
    }
    for (; i < n; i++) {
        float acc = acc0 ? o[i] : 0.0f;
        for (int64_t p = 0; p < n_rows; p++) acc = fmaf(w[p], V[(size_t)p * v_stride + i], acc);
        o[i] = acc;
    }
}

/* Fill this backend's dot products (quantizers and dequantizers inherit the
 * reference's: they are not on the expert hot path). */
AI void neon_fill(kv_kernels *k) {
    k[KV_TYPE_F32].vec_dot = f32_dot;   k[KV_TYPE_F32].mat = NULL;
    k[KV_TYPE_F16].vec_dot = f16_dot;   k[KV_TYPE_F16].mat = NULL;
    k[KV_TYPE_BF16].vec_dot = bf16_dot; k[KV_TYPE_BF16].mat = NULL;
    k[KV_TYPE_Q8_0].vec_dot = q8_0_dot; k[KV_TYPE_Q8_0].mat = NULL;
    k[KV_TYPE_Q4_0].vec_dot = q4_0_dot; k[KV_TYPE_Q4_0].mat = NULL;
    k[KV_TYPE_Q4_K].vec_dot = q4_K_dot; k[KV_TYPE_Q4_K].mat = NULL;
    k[KV_TYPE_Q5_K].vec_dot = q5_K_dot; k[KV_TYPE_Q5_K].mat = NULL;
    k[KV_TYPE_Q6_K].vec_dot = q6_K_dot; k[KV_TYPE_Q6_K].mat = NULL;
}

#endif
