/* Scalar reference kernels: half/bfloat conversion, dequantization (exactly
 * ggml's formulas), the activation quantizers (bit-exact with what ggml's CPU
 * backend does on x86: Q8_0 with id = 127/amax and round-half-even, Q8_K as
 * quantize_row_q8_K_ref), and dot products in the canonical order described
 * in quant_internal.h. This file is the oracle for the SIMD variants; it is
 * written for clarity, not speed. Weight quantizers with a quality search
 * live in quantize.c. */
#include "quant/quant_internal.h"

/* ------------------------------------------------------------------ */
/* fp16 / bf16                                                         */

float kv_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24, exact in f32 */
        float v = (float)mant * 0x1p-24f;
        return kv_u2f(kv_f2u(v) | sign);
    }
    if (exp == 31) return kv_u2f(sign | 0x7f800000u | (mant << 13));
    return kv_u2f(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t kv_fp32_to_fp16(float f) {
    uint32_t u = kv_f2u(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00;  /* NaN -> quiet NaN, as ggml */
    if (a >= 0x477ff000u) return sign | 0x7c00; /* >= 65520 rounds to inf */
    if (a < 0x38800000u) {
        /* below 2^-14: half subnormals are multiples of 2^-24, the ulp of
         * floats in [0.5, 1), so adding 0.5 rounds (RNE) to the grid */
        float t = kv_u2f(a) + 0.5f;
        return sign | (uint16_t)(kv_f2u(t) - 0x3f000000u);
    }
    uint32_t odd = (a >> 13) & 1;
    a += 0xc8000fffu + odd; /* rebias exponent 127 -> 15 and round to nearest even */
    return sign | (uint16_t)(a >> 13);
}

float kv_bf16_to_fp32(uint16_t h) { return kv_u2f((uint32_t)h << 16); }

uint16_t kv_fp32_to_bf16(float f) {
    uint32_t u = kv_f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 64); /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* ------------------------------------------------------------------ */
/* float types                                                         */

static void f32_to_float(const void *src, float *dst, int64_t n) { memcpy(dst, src, (size_t)n * 4); }
static void f32_from_float(const float *src, void *dst, int64_t n) { memcpy(dst, src, (size_t)n * 4); }

static void f16_to_float(const void *src, float *dst, int64_t n) {
    const uint16_t *h = src;
    for (int64_t i = 0; i < n; i++) dst[i] = kv_fp16_to_fp32(h[i]);
}
static void f16_from_float(const float *src, void *dst, int64_t n) {
    uint16_t *h = dst;
    for (int64_t i = 0; i < n; i++) h[i] = kv_fp32_to_fp16(src[i]);
}
static void bf16_to_float(const void *src, float *dst, int64_t n) {
    const uint16_t *h = src;
    for (int64_t i = 0; i < n; i++) dst[i] = kv_bf16_to_fp32(h[i]);
}
static void bf16_from_float(const float *src, void *dst, int64_t n) {
    uint16_t *h = dst;
    for (int64_t i = 0; i < n; i++) h[i] = kv_fp32_to_bf16(src[i]);
}

static void f32_dot(int64_t n, float *s, const void *w, const void *a) {
    const float *x = w, *y = a;
    float l[8] = {0};
    for (int64_t i = 0; i < n; i++) l[i & 7] = fmaf(x[i], y[i], l[i & 7]);
    *s = kv_hsum8(l);
}
static void f16_dot(int64_t n, float *s, const void *w, const void *a) {
    const uint16_t *x = w, *y = a;
    float l[8] = {0};
    for (int64_t i = 0; i < n; i++)
        l[i & 7] = fmaf(kv_fp16_to_fp32(x[i]), kv_fp16_to_fp32(y[i]), l[i & 7]);
    *s = kv_hsum8(l);
}
static void bf16_dot(int64_t n, float *s, const void *w, const void *a) {
    const uint16_t *x = w, *y = a;
    float l[8] = {0};
    for (int64_t i = 0; i < n; i++)
        l[i & 7] = fmaf(kv_bf16_to_fp32(x[i]), kv_bf16_to_fp32(y[i]), l[i & 7]);
    *s = kv_hsum8(l);
}

/* ------------------------------------------------------------------ */
/* Q8_0                                                                */

static void q8_0_to_float(const void *src, float *dst, int64_t n) {
    const kv_block_q8_0 *b = src;
    for (int64_t i = 0; i < n / KV_QK8_0; i++) {
        float d = kv_fp16_to_fp32(b[i].d);
        for (int j = 0; j < KV_QK8_0; j++) dst[i * KV_QK8_0 + j] = b[i].qs[j] * d;
    }
}

/* As ggml's x86 quantize_row_q8_0: d = amax/127 stored as fp16, values
 * scaled by 127/amax (not 1/d) and rounded half to even. */
static void q8_0_from_float(const float *src, void *dst, int64_t n) {
    kv_block_q8_0 *b = dst;
    for (int64_t i = 0; i < n / KV_QK8_0; i++) {
        const float *x = src + i * KV_QK8_0;
        float amax = 0.0f;
        for (int j = 0; j < KV_QK8_0; j++) amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.f;
        float id = amax != 0.0f ? 127.f / amax : 0.0f;
        b[i].d = kv_fp32_to_fp16(d);
        for (int j = 0; j < KV_QK8_0; j++) {
            int q = kv_nearest_int(x[j] * id);
            b[i].qs[j] = (int8_t)(q > 127 ? 127 : q < -128 ? -128 : q);
        }
    }
}

/* Canonical order (quant_internal.h): 4 lanes, lane l holds the values j
 * of each block with (j % 16) / 4 == l, one fma chain over the blocks. */
static void q8_0_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_q8_0 *x = w, *y = a;
    float l[4] = {0};
    for (int64_t b = 0; b < n / KV_QK8_0; b++) {
        float d = kv_fp16_to_fp32(x[b].d) * kv_fp16_to_fp32(y[b].d);
        for (int g = 0; g < 4; g++) {
            int32_t p = 0;
            for (int i = 4 * g; i < 4 * g + 4; i++) p += x[b].qs[i] * y[b].qs[i] + x[b].qs[16 + i] * y[b].qs[16 + i];
            l[g] = fmaf((float)p, d, l[g]);
        }
    }
    *s = kv_hsum4(l);
}

/* ------------------------------------------------------------------ */
/* Q4_0                                                                */

static void q4_0_to_float(const void *src, float *dst, int64_t n) {
    const kv_block_q4_0 *b = src;
    for (int64_t i = 0; i < n / KV_QK4_0; i++) {
        float d = kv_fp16_to_fp32(b[i].d);
        for (int j = 0; j < 16; j++) {
            dst[i * 32 + j] = ((b[i].qs[j] & 0xF) - 8) * d;
            dst[i * 32 + j + 16] = ((b[i].qs[j] >> 4) - 8) * d;
        }
    }
}

static void q4_0_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_q4_0 *x = w;
    const kv_block_q8_0 *y = a;
    float l[16] = {0};
    for (int64_t b = 0; b < n / KV_QK4_0; b++) {
        float d = kv_fp16_to_fp32(x[b].d) * kv_fp16_to_fp32(y[b].d);
        for (int g = 0; g < 8; g++) {
            int32_t p = 0;
            for (int i = 4 * g; i < 4 * g + 4; i++) {
                int q = i < 16 ? (x[b].qs[i] & 0xF) : (x[b].qs[i - 16] >> 4);
                p += (q - 8) * y[b].qs[i];
            }
            float *lane = &l[8 * (b & 1) + g];
            *lane = fmaf((float)p, d, *lane);
        }
    }
    *s = kv_fold16(l);
}

/* ------------------------------------------------------------------ */
/* Q8_K (activations of the K-quants)                                  */

/* As ggml's quantize_row_q8_K_ref (what x86 uses): the signed value of
 * largest magnitude maps to -127, values rounded half to even. */
static void q8_K_from_float(const float *src, void *dst, int64_t n) {
    kv_block_q8_K *b = dst;
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        const float *x = src + i * KV_QK_K;
        float amax = 0, max = 0;
        for (int j = 0; j < KV_QK_K; j++) {
            float ax = fabsf(x[j]);
            if (ax > amax) { amax = ax; max = x[j]; }
        }
        if (amax == 0) {
            memset(&b[i], 0, sizeof b[i]);
            continue;
        }
        float iscale = -127.f / max;
        for (int j = 0; j < KV_QK_K; j++) {
            int v = kv_nearest_int(iscale * x[j]);
            b[i].qs[j] = (int8_t)(v > 127 ? 127 : v);
        }
        for (int g = 0; g < KV_QK_K / 16; g++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += b[i].qs[g * 16 + j];
            b[i].bsums[g] = (int16_t)sum;
        }
        b[i].d = 1 / iscale;
    }
}

static void q8_K_to_float(const void *src, float *dst, int64_t n) {
    const kv_block_q8_K *b = src;
    for (int64_t i = 0; i < n / KV_QK_K; i++)
        for (int j = 0; j < KV_QK_K; j++) dst[i * KV_QK_K + j] = b[i].d * b[i].qs[j];
}

/* ------------------------------------------------------------------ */
/* Q4_K                                                                */

static void q4_K_to_float(const void *src, float *dst, int64_t n) {
    const kv_block_q4_K *b = src;
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        float d = kv_fp16_to_fp32(b[i].d), dmin = kv_fp16_to_fp32(b[i].dmin);
        uint8_t sc[8], m[8];
        kv_unpack_k4(b[i].scales, sc, m);
        float *y = dst + i * KV_QK_K;
        for (int c = 0; c < 4; c++) {
            const uint8_t *q = b[i].qs + 32 * c;
            float d1 = d * sc[2 * c], m1 = dmin * m[2 * c];
            float d2 = d * sc[2 * c + 1], m2 = dmin * m[2 * c + 1];
            for (int l = 0; l < 32; l++) y[64 * c + l] = d1 * (q[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++) y[64 * c + 32 + l] = d2 * (q[l] >> 4) - m2;
        }
    }
}

static void q4_K_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_q4_K *x = w;
    const kv_block_q8_K *y = a;
    float acc[8] = {0}, accm[8] = {0};
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        uint8_t sc[8], m[8];
        kv_unpack_k4(x[i].scales, sc, m);
        int32_t L[8] = {0}, M[8];
        for (int c = 0; c < 4; c++) {
            const uint8_t *q = x[i].qs + 32 * c;
            const int8_t *a8 = y[i].qs + 64 * c;
            for (int l = 0; l < 32; l++)
                L[l >> 2] += sc[2 * c] * (q[l] & 0xF) * a8[l] + sc[2 * c + 1] * (q[l] >> 4) * a8[32 + l];
        }
        for (int j = 0; j < 8; j++) M[j] = m[j] * (y[i].bsums[2 * j] + y[i].bsums[2 * j + 1]);
        kv_k_lanes(acc, accm, L, M, y[i].d * kv_fp16_to_fp32(x[i].d), y[i].d * kv_fp16_to_fp32(x[i].dmin));
    }
    *s = kv_k_result(acc, accm);
}

/* ------------------------------------------------------------------ */
/* Q5_K                                                                */

static void q5_K_to_float(const void *src, float *dst, int64_t n) {
    const kv_block_q5_K *b = src;
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        float d = kv_fp16_to_fp32(b[i].d), dmin = kv_fp16_to_fp32(b[i].dmin);
        uint8_t sc[8], m[8];
        kv_unpack_k4(b[i].scales, sc, m);
        float *y = dst + i * KV_QK_K;
        for (int c = 0; c < 4; c++) {
            const uint8_t *q = b[i].qs + 32 * c;
            const uint8_t *qh = b[i].qh;
            uint8_t u1 = (uint8_t)(1u << (2 * c)), u2 = (uint8_t)(2u << (2 * c));
            float d1 = d * sc[2 * c], m1 = dmin * m[2 * c];
            float d2 = d * sc[2 * c + 1], m2 = dmin * m[2 * c + 1];
            for (int l = 0; l < 32; l++) y[64 * c + l] = d1 * ((q[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
            for (int l = 0; l < 32; l++) y[64 * c + 32 + l] = d2 * ((q[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
        }
    }
}

static void q5_K_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_q5_K *x = w;
    const kv_block_q8_K *y = a;
    float acc[8] = {0}, accm[8] = {0};
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        uint8_t sc[8], m[8];
        kv_unpack_k4(x[i].scales, sc, m);
        int32_t L[8] = {0}, M[8];
        for (int c = 0; c < 4; c++) {
            const uint8_t *q = x[i].qs + 32 * c;
            const int8_t *a8 = y[i].qs + 64 * c;
            for (int l = 0; l < 32; l++) {
                int ql = (q[l] & 0xF) | (((x[i].qh[l] >> (2 * c)) & 1) << 4);
                int qhv = (q[l] >> 4) | (((x[i].qh[l] >> (2 * c + 1)) & 1) << 4);
                L[l >> 2] += sc[2 * c] * ql * a8[l] + sc[2 * c + 1] * qhv * a8[32 + l];
            }
        }
        for (int j = 0; j < 8; j++) M[j] = m[j] * (y[i].bsums[2 * j] + y[i].bsums[2 * j + 1]);
        kv_k_lanes(acc, accm, L, M, y[i].d * kv_fp16_to_fp32(x[i].d), y[i].d * kv_fp16_to_fp32(x[i].dmin));
    }
    *s = kv_k_result(acc, accm);
}

/* ------------------------------------------------------------------ */
/* Q6_K                                                                */

/* Quant e (0..255) of a q6_K block, unsigned 0..63 (value = q - 32). */
static inline int q6_K_get(const kv_block_q6_K *b, int e) {
    int h = e / 128, r = e % 128, quarter = r / 32, l = r % 32;
    const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
    int lo = (quarter & 1) ? ql[l + 32] : ql[l];
    lo = (quarter & 2) ? lo >> 4 : lo & 0xF;
    int hi = (qh[l] >> (2 * quarter)) & 3;
    return lo | (hi << 4);
}

static void q6_K_to_float(const void *src, float *dst, int64_t n) {
    const kv_block_q6_K *b = src;
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        float d = kv_fp16_to_fp32(b[i].d);
        for (int e = 0; e < KV_QK_K; e++)
            dst[i * KV_QK_K + e] = d * b[i].scales[e / 16] * (q6_K_get(&b[i], e) - 32);
    }
}

static void q6_K_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_q6_K *x = w;
    const kv_block_q8_K *y = a;
    float acc[8] = {0};
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        int32_t L[8] = {0};
        for (int e = 0; e < KV_QK_K; e++) L[(e >> 2) & 7] += x[i].scales[e / 16] * q6_K_get(&x[i], e) * y[i].qs[e];
        const float dd = y[i].d * kv_fp16_to_fp32(x[i].d);
        for (int j = 0; j < 8; j++) {
            const int32_t C = x[i].scales[2 * j] * y[i].bsums[2 * j] + x[i].scales[2 * j + 1] * y[i].bsums[2 * j + 1];
            acc[j] = fmaf((float)(L[j] - 32 * C), dd, acc[j]);
        }
    }
    *s = kv_hsum8(acc);
}

/* ------------------------------------------------------------------ */

void kv_quant_q4_0_from_float(const float *src, void *dst, int64_t n);
void kv_quant_q4_K_from_float(const float *src, void *dst, int64_t n);
void kv_quant_q5_K_from_float(const float *src, void *dst, int64_t n);
void kv_quant_q6_K_from_float(const float *src, void *dst, int64_t n);

void kv_f32_wsum_ref(float *o, const float *w, const float *V, size_t v_stride, int64_t n_rows,
                     int64_t n, int acc) {
    if (!acc)
        for (int64_t i = 0; i < n; i++) o[i] = 0.0f;
    for (int64_t p = 0; p < n_rows; p++) {
        const float *v = V + (size_t)p * v_stride, wp = w[p];
        for (int64_t i = 0; i < n; i++) o[i] = fmaf(wp, v[i], o[i]);
    }
}

void kv_f32_silu_ref(float *y, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float nx = -x[i];
        y[i] = nx > KV_EXP_MAX ? x[i] * 0.0f : x[i] / (1.0f + kv_exp_ref(nx));
    }
}

void kv_f32_softmax_ref(float *x, int64_t n, float scale) {
    float m8[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    for (int64_t i = 0; i < n; i++) {
        x[i] *= scale;
        m8[i & 7] = x[i] > m8[i & 7] ? x[i] : m8[i & 7];
    }
    float max = -INFINITY;
    for (int l = 0; l < 8; l++) max = m8[l] > max ? m8[l] : max;
    double l8[8] = {0};
    for (int64_t i = 0; i < n; i++) {
        const float e = kv_exp_ref(x[i] - max);
        x[i] = e;
        l8[i & 7] += (double)e;
    }
    const double sum = ((l8[0] + l8[4]) + (l8[2] + l8[6])) + ((l8[1] + l8[5]) + (l8[3] + l8[7]));
    const float inv = (float)(1.0 / sum);
    for (int64_t i = 0; i < n; i++) x[i] *= inv;
}

void kv_f32_delta_ref(const float *S, float *D, int64_t n_rows, int64_t n, const float *k,
                      const float *q, const float *v, float decay, float beta, float scale, float *o) {
    for (int64_t j = 0; j < n_rows; j++) {
        const float *s = S + (size_t)j * (size_t)n;
        float *d = D + (size_t)j * (size_t)n;
        float l[8] = {0};
        for (int64_t i = 0; i < n; i++) l[i & 7] = fmaf(s[i] * decay, k[i], l[i & 7]);
        const float dj = (v[j] - kv_hsum8(l)) * beta;
        float lq[8] = {0};
        for (int64_t i = 0; i < n; i++) {
            const float m = fmaf(k[i], dj, s[i] * decay);
            d[i] = m;
            lq[i & 7] = fmaf(m, q[i], lq[i & 7]);
        }
        o[j] = kv_hsum8(lq) * scale;
    }
}

void kv_mat_generic(kv_vec_dot_fn dot, const void *W, size_t row_bytes, int64_t n, int64_t r0,
                    int64_t r1, const void *A, size_t a_stride, int64_t n_tok, float *Y,
                    size_t y_stride) {
    for (int64_t t = 0; t < n_tok; t++)
        for (int64_t r = r0; r < r1; r++)
            dot(n, &Y[(size_t)t * y_stride + (size_t)r], (const uint8_t *)W + (size_t)r * row_bytes,
                (const uint8_t *)A + (size_t)t * a_stride);
}

void kv_quant_fill_ref(kv_kernels *k) {
    k[KV_TYPE_F32] = (kv_kernels){f32_to_float, f32_from_float, f32_dot, NULL};
    k[KV_TYPE_F16] = (kv_kernels){f16_to_float, f16_from_float, f16_dot, NULL};
    k[KV_TYPE_BF16] = (kv_kernels){bf16_to_float, bf16_from_float, bf16_dot, NULL};
    k[KV_TYPE_Q8_0] = (kv_kernels){q8_0_to_float, q8_0_from_float, q8_0_dot, NULL};
    k[KV_TYPE_Q4_0] = (kv_kernels){q4_0_to_float, kv_quant_q4_0_from_float, q4_0_dot, NULL};
    k[KV_TYPE_Q8_K] = (kv_kernels){q8_K_to_float, q8_K_from_float, NULL, NULL};
    k[KV_TYPE_Q4_K] = (kv_kernels){q4_K_to_float, kv_quant_q4_K_from_float, q4_K_dot, NULL};
    k[KV_TYPE_Q5_K] = (kv_kernels){q5_K_to_float, kv_quant_q5_K_from_float, q5_K_dot, NULL};
    k[KV_TYPE_Q6_K] = (kv_kernels){q6_K_to_float, kv_quant_q6_K_from_float, q6_K_dot, NULL};
}
