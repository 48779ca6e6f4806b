/* Scalar reference of Q4_1, Q5_0, Q5_1, IQ4_NL and MXFP4: dequantization
 * with ggml's formulas, the Q8_1 activation quantizer, and the dot product
 * with a Q8_0 / Q8_1 activation row in the canonical order of
 * quant/legacy.h. The oracle for the SIMD files;
 * written for clarity, not speed. */
#include "quant/legacy.h"

/* Block b of a row as 32 integer weights w (legacy.h), its scale dw and
 * min mw (0 for the types without one). */
static void unpack_q4_1(const void *row, int64_t b, int8_t w[32], float *dw, float *mw) {
    const kv_block_q4_1 *x = (const kv_block_q4_1 *)row + b;
    for (int j = 0; j < 32; j++) w[j] = (int8_t)kv_nib(x->qs, j);
    *dw = kv_fp16_to_fp32(x->d);
    *mw = kv_fp16_to_fp32(x->m);
}
static void unpack_q5_0(const void *row, int64_t b, int8_t w[32], float *dw, float *mw) {
    const kv_block_q5_0 *x = (const kv_block_q5_0 *)row + b;
    const uint32_t qh = kv_rd_qh(x->qh);
    for (int j = 0; j < 32; j++) w[j] = (int8_t)((kv_nib(x->qs, j) | (int)((qh >> j) & 1) << 4) - 16);
    *dw = kv_fp16_to_fp32(x->d);
    *mw = 0;
}
static void unpack_q5_1(const void *row, int64_t b, int8_t w[32], float *dw, float *mw) {
    const kv_block_q5_1 *x = (const kv_block_q5_1 *)row + b;
    const uint32_t qh = kv_rd_qh(x->qh);
    for (int j = 0; j < 32; j++) w[j] = (int8_t)(kv_nib(x->qs, j) | (int)((qh >> j) & 1) << 4);
    *dw = kv_fp16_to_fp32(x->d);
    *mw = kv_fp16_to_fp32(x->m);
}
static void unpack_iq4_nl(const void *row, int64_t b, int8_t w[32], float *dw, float *mw) {
    const kv_block_iq4_nl *x = (const kv_block_iq4_nl *)row + b;
    for (int j = 0; j < 32; j++) w[j] = kv_iq4nl_values[kv_nib(x->qs, j)];
    *dw = kv_fp16_to_fp32(x->d);
    *mw = 0;
}
static void unpack_mxfp4(const void *row, int64_t b, int8_t w[32], float *dw, float *mw) {
    const kv_block_mxfp4 *x = (const kv_block_mxfp4 *)row + b;
    for (int j = 0; j < 32; j++) w[j] = kv_mxfp4_values[kv_nib(x->qs, j)];
    *dw = kv_e8m0_half(x->e);
    *mw = 0;
}

typedef void (*unpack_fn)(const void *row, int64_t b, int8_t w[32], float *dw, float *mw);

/* ggml's dequantization: d*w (+ m), one rounding each (no fma). */
static void to_float(unpack_fn un, int has_min, const void *src, float *dst, int64_t n) {
    for (int64_t b = 0; b < n / 32; b++) {
        int8_t w[32];
        float dw, mw;
        un(src, b, w, &dw, &mw);
        for (int j = 0; j < 32; j++) dst[32 * b + j] = has_min ? w[j] * dw + mw : w[j] * dw;
    }
}

/* Q8_1, as ggml's x86 quantize_row_q8_1: Q8_0's quants (scaled by
 * 127/amax, rounded half to even) and s = fp16(d * sum qs), d = amax/127
 * before its rounding to fp16. */
static void q8_1_from_float(const float *src, void *dst, int64_t n) {
    kv_block_q8_1 *b = dst;
    for (int64_t i = 0; i < n / 32; i++) {
        const float *x = src + 32 * i;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.f, id = amax != 0.0f ? 127.f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            const int q = kv_nearest_int(x[j] * id);
            b[i].qs[j] = (int8_t)(q > 127 ? 127 : q < -128 ? -128 : q);
            sum += b[i].qs[j];
        }
        b[i].d = kv_fp32_to_fp16(d);
        b[i].s = kv_fp32_to_fp16(d * (float)sum);
    }
}

static void q8_1_to_float(const void *src, float *dst, int64_t n) {
    const kv_block_q8_1 *b = src;
    for (int64_t i = 0; i < n / 32; i++) {
        const float d = kv_fp16_to_fp32(b[i].d);
        for (int j = 0; j < 32; j++) dst[32 * i + j] = b[i].qs[j] * d;
    }
}

/* The canonical order of legacy.h; a is Q8_1 when has_min, else Q8_0. */
static void dot(unpack_fn un, int has_min, int64_t n, float *s, const void *wrow, const void *a) {
    float l[16] = {0}, summ = 0;
    for (int64_t b = 0; b < n / 32; b++) {
        int8_t w[32];
        float dw, mw;
        un(wrow, b, w, &dw, &mw);
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
        for (int g = 0; g < 8; g++) {
            int32_t p = 0;
            for (int i = 4 * g; i < 4 * g + 4; i++) p += w[i] * qa[i];
            float *lane = has_min ? &l[g] : &l[8 * (b & 1) + g];
            *lane = fmaf((float)p, d, *lane);
        }
    }
    *s = has_min ? kv_hsum8(l) + summ : kv_fold16(l);
}

#define LEGACY_REF(T, HAS_MIN)                                                                   \
    static void T##_to_float(const void *src, float *dst, int64_t n) {                           \
        to_float(unpack_##T, HAS_MIN, src, dst, n);                                              \
    }                                                                                            \
    static void T##_dot(int64_t n, float *s, const void *w, const void *a) {                     \
        dot(unpack_##T, HAS_MIN, n, s, w, a);                                                    \
    }
LEGACY_REF(q4_1, 1)
LEGACY_REF(q5_0, 0)
LEGACY_REF(q5_1, 1)
LEGACY_REF(iq4_nl, 0)
LEGACY_REF(mxfp4, 0)

void kv_quant_fill_legacy_ref(kv_kernels *k) {
    k[KV_TYPE_Q8_1] = (kv_kernels){q8_1_to_float, q8_1_from_float, NULL, NULL};
    k[KV_TYPE_Q4_1] = (kv_kernels){q4_1_to_float, kv_quant_q4_1_from_float, q4_1_dot, NULL};
    k[KV_TYPE_Q5_0] = (kv_kernels){q5_0_to_float, kv_quant_q5_0_from_float, q5_0_dot, NULL};
    k[KV_TYPE_Q5_1] = (kv_kernels){q5_1_to_float, kv_quant_q5_1_from_float, q5_1_dot, NULL};
    k[KV_TYPE_IQ4_NL] = (kv_kernels){iq4_nl_to_float, kv_quant_iq4_nl_from_float, iq4_nl_dot, NULL};
    k[KV_TYPE_MXFP4] = (kv_kernels){mxfp4_to_float, kv_quant_mxfp4_from_float, mxfp4_dot, NULL};
}
