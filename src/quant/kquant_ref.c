/* Q2_K, Q3_K and IQ4_XS: the scalar reference (dequantization exactly as
 * ggml's formulas, dot products against Q8_K in the canonical order of
 * quant_internal.h) and the weight quantizers that gen-model writes files
 * with. The quantizers fit each sub-block's scale (and min) by a small
 * search for the least weighted squared error, then round the sub-block
 * scales to their stored form and quantize every value again against the
 * stored scale; they need not match llama-quantize's choices, only produce
 * blocks that decode as ggml decodes them. Not a hot path; the oracle for
 * kquant_avx2.c, kquant_avx512.c and kquant_neon.c. */
#include "quant/legacy.h" /* kv_iq4nl_values */
#include "quant/quant_internal.h"

/* ------------------------------------------------------------------ */
/* Q2_K                                                                */

/* Quant e (0..255) of a q2_K block, 0..3. */
static inline int q2_K_get(const kv_block_q2_K *b, int e) {
    return (b->qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
}

static void q2_K_to_float(const void *src, float *dst, int64_t n) {
    const kv_block_q2_K *b = src;
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        const float d = kv_fp16_to_fp32(b[i].d), dmin = kv_fp16_to_fp32(b[i].dmin);
        for (int e = 0; e < KV_QK_K; e++) {
            const uint8_t sc = b[i].scales[e / 16];
            const float dl = d * (sc & 0xF), ml = dmin * (sc >> 4);
            dst[i * KV_QK_K + e] = dl * q2_K_get(&b[i], e) - ml;
        }
    }
}

static void q2_K_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_q2_K *x = w;
    const kv_block_q8_K *y = a;
    float acc[8] = {0}, accm[8] = {0};
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        int32_t L[8] = {0}, M[8];
        for (int e = 0; e < KV_QK_K; e++) L[(e >> 2) & 7] += (x[i].scales[e / 16] & 0xF) * q2_K_get(&x[i], e) * y[i].qs[e];
        for (int j = 0; j < 8; j++)
            M[j] = (x[i].scales[2 * j] >> 4) * y[i].bsums[2 * j] + (x[i].scales[2 * j + 1] >> 4) * y[i].bsums[2 * j + 1];
        kv_k_lanes(acc, accm, L, M, y[i].d * kv_fp16_to_fp32(x[i].d), y[i].d * kv_fp16_to_fp32(x[i].dmin));
    }
    *s = kv_k_result(acc, accm);
}

/* ------------------------------------------------------------------ */
/* Q3_K                                                                */

/* Quant e (0..255) of a q3_K block as u = q + 4, 0..7. */
static inline int q3_K_get(const kv_block_q3_K *b, int e) {
    const int c = e / 32, l = e % 32;
    const int lo = (b->qs[32 * (c / 4) + l] >> (2 * (c % 4))) & 3;
    return lo | (((b->hmask[l] >> c) & 1) << 2);
}

static void q3_K_to_float(const void *src, float *dst, int64_t n) {
    const kv_block_q3_K *b = src;
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        const float d = kv_fp16_to_fp32(b[i].d);
        int8_t sc[16];
        kv_unpack_q3_scales(b[i].scales, sc);
        for (int e = 0; e < KV_QK_K; e++) dst[i * KV_QK_K + e] = d * sc[e / 16] * (q3_K_get(&b[i], e) - 4);
    }
}

static void q3_K_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_q3_K *x = w;
    const kv_block_q8_K *y = a;
    float acc[8] = {0};
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        int8_t sc[16];
        kv_unpack_q3_scales(x[i].scales, sc);
        int32_t L[8] = {0};
        for (int e = 0; e < KV_QK_K; e++) L[(e >> 2) & 7] += sc[e / 16] * q3_K_get(&x[i], e) * y[i].qs[e];
        const float dd = y[i].d * kv_fp16_to_fp32(x[i].d);
        for (int j = 0; j < 8; j++) {
            const int32_t C = sc[2 * j] * y[i].bsums[2 * j] + sc[2 * j + 1] * y[i].bsums[2 * j + 1];
            acc[j] = fmaf((float)(L[j] - 4 * C), dd, acc[j]);
        }
    }
    *s = kv_hsum8(acc);
}

/* ------------------------------------------------------------------ */
/* IQ4_XS                                                              */

static void iq4_xs_to_float(const void *src, float *dst, int64_t n) {
    const kv_block_iq4_xs *b = src;
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        const float d = kv_fp16_to_fp32(b[i].d);
        for (int ib = 0; ib < 8; ib++) {
            const float dl = d * kv_iq4_xs_scale(&b[i], ib);
            const uint8_t *q = b[i].qs + 16 * ib;
            float *o = dst + i * KV_QK_K + 32 * ib;
            for (int j = 0; j < 16; j++) {
                o[j] = dl * kv_iq4nl_values[q[j] & 0xF];
                o[j + 16] = dl * kv_iq4nl_values[q[j] >> 4];
            }
        }
    }
}

static void iq4_xs_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_iq4_xs *x = w;
    const kv_block_q8_K *y = a;
    float acc[8] = {0};
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        int32_t L[8] = {0};
        for (int e = 0; e < KV_QK_K; e++) {
            const int ib = e / 32, l = e % 32;
            const uint8_t q = x[i].qs[16 * ib + l % 16];
            const int v = kv_iq4nl_values[l < 16 ? q & 0xF : q >> 4];
            L[(e >> 2) & 7] += kv_iq4_xs_scale(&x[i], ib) * v * y[i].qs[e];
        }
        const float dd = y[i].d * kv_fp16_to_fp32(x[i].d);
        for (int j = 0; j < 8; j++) acc[j] = fmaf((float)L[j], dd, acc[j]);
    }
    *s = kv_hsum8(acc);
}

/* ------------------------------------------------------------------ */
/* Quantizers                                                          */

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* Weighted fit of x ~ s*L - m over n values, L in [0, nmax], m >= 0:
 * candidate inverse scales (nmax - 0.5 + 0.2 k)/(hi - lo), k = 0..5, each
 * followed by the least-squares s and m for its L. Returns s, sets *mn. */
static float fit_min(int n, int nmax, const float *x, const float *w, float *mn) {
    float lo = x[0], hi = x[0];
    for (int i = 1; i < n; i++) {
        lo = fminf(lo, x[i]);
        hi = fmaxf(hi, x[i]);
    }
    if (lo > 0) lo = 0;
    *mn = -lo;
    if (hi <= lo) return 0.f;
    float best_s = (hi - lo) / nmax, best_m = -lo, best_e = INFINITY;
    for (int k = 0; k <= 5; k++) {
        const float is = (nmax - 0.5f + 0.2f * k) / (hi - lo);
        float sw = 0, swl = 0, swll = 0, swx = 0, swxl = 0;
        for (int i = 0; i < n; i++) {
            const float l = (float)clampi(kv_nearest_int((x[i] - lo) * is), 0, nmax);
            sw += w[i], swl += w[i] * l, swll += w[i] * l * l, swx += w[i] * x[i], swxl += w[i] * x[i] * l;
        }
        const float det = sw * swll - swl * swl;
        if (det <= 0) continue;
        float s = (sw * swxl - swx * swl) / det, b = (swll * swx - swl * swxl) / det;
        if (b > 0) { /* the min must be <= 0: refit s alone with b = 0 */
            b = 0;
            s = swll > 0 ? swxl / swll : 0;
        }
        if (s <= 0) continue;
        float e = 0;
        for (int i = 0; i < n; i++) {
            const float l = (float)clampi(kv_nearest_int((x[i] - b) / s), 0, nmax);
            const float r = s * l + b - x[i];
            e += w[i] * r * r;
        }
        if (e < best_e) best_e = e, best_s = s, best_m = -b;
    }
    *mn = best_m;
    return best_s;
}

/* Weighted symmetric fit of x ~ s*L over n values, L in [lmin, lmax]
 * (lmin = -lmax - 1): candidate scales around the signed extreme / lmin,
 * each followed by the least-squares s for its L. */
static float fit_sym(int n, int lmin, int lmax, const float *x, const float *w) {
    float amax = 0, max = 0;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) amax = fabsf(x[i]), max = x[i];
    if (amax == 0) return 0.f;
    float best_s = max / lmin, best_e = INFINITY;
    for (int k = -2; k <= 2; k++) {
        const float s0 = max / (lmin + 0.2f * k);
        float sxl = 0, sll = 0;
        for (int i = 0; i < n; i++) {
            const float l = (float)clampi(kv_nearest_int(x[i] / s0), lmin, lmax);
            sxl += w[i] * x[i] * l, sll += w[i] * l * l;
        }
        if (sll <= 0) continue;
        const float s = sxl / sll;
        float e = 0;
        for (int i = 0; i < n; i++) {
            const float r = s * clampi(kv_nearest_int(x[i] / s), lmin, lmax) - x[i];
            e += w[i] * r * r;
        }
        if (e < best_e) best_e = e, best_s = s;
    }
    return best_s;
}

/* Weights of the squared error: rms of the sub-block plus |x| (large
 * values matter more), as ggml's reference quantizers weigh them. */
static void fit_weights(int n, const float *x, float *w) {
    float sx2 = 0;
    for (int i = 0; i < n; i++) sx2 += x[i] * x[i];
    const float rms = sqrtf(sx2 / n);
    for (int i = 0; i < n; i++) w[i] = rms + fabsf(x[i]);
}

static void q2_K_from_float(const float *src, void *dst, int64_t n) {
    kv_block_q2_K *b = dst;
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        const float *x = src + i * KV_QK_K;
        float s[16], m[16], w[16], max_s = 0, max_m = 0;
        for (int g = 0; g < 16; g++) {
            fit_weights(16, x + 16 * g, w);
            s[g] = fit_min(16, 3, x + 16 * g, w, &m[g]);
            max_s = fmaxf(max_s, s[g]);
            max_m = fmaxf(max_m, m[g]);
        }
        memset(&b[i], 0, sizeof b[i]);
        b[i].d = kv_fp32_to_fp16(max_s / 15.f);
        b[i].dmin = kv_fp32_to_fp16(max_m / 15.f);
        const float is = max_s > 0 ? 15.f / max_s : 0.f, im = max_m > 0 ? 15.f / max_m : 0.f;
        const float d = kv_fp16_to_fp32(b[i].d), dmin = kv_fp16_to_fp32(b[i].dmin);
        for (int g = 0; g < 16; g++) {
            const int ls = clampi(kv_nearest_int(is * s[g]), 0, 15), lm = clampi(kv_nearest_int(im * m[g]), 0, 15);
            b[i].scales[g] = (uint8_t)(ls | (lm << 4));
            const float dl = d * ls, ml = dmin * lm;
            for (int l = 0; l < 16; l++) {
                const int e = 16 * g + l;
                const int q = dl > 0 ? clampi(kv_nearest_int((x[e] + ml) / dl), 0, 3) : 0;
                b[i].qs[32 * (e / 128) + e % 32] |= (uint8_t)(q << (2 * ((e % 128) / 32)));
            }
        }
    }
}

static void q3_K_from_float(const float *src, void *dst, int64_t n) {
    kv_block_q3_K *b = dst;
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        const float *x = src + i * KV_QK_K;
        float s[16], w[16], amax = 0, max = 0;
        for (int g = 0; g < 16; g++) {
            fit_weights(16, x + 16 * g, w);
            s[g] = fit_sym(16, -4, 3, x + 16 * g, w);
            if (fabsf(s[g]) > amax) amax = fabsf(s[g]), max = s[g];
        }
        memset(&b[i], 0, sizeof b[i]);
        const float is = amax > 0 ? -32.f / max : 0.f;
        b[i].d = kv_fp32_to_fp16(is != 0 ? 1 / is : 0.f);
        const float d = kv_fp16_to_fp32(b[i].d);
        for (int g = 0; g < 16; g++) {
            const int ls = clampi(kv_nearest_int(is * s[g]), -32, 31);
            const int v = ls + 32; /* stored 6 bits */
            if (g < 8)
                b[i].scales[g] |= (uint8_t)(v & 0xF);
            else
                b[i].scales[g - 8] |= (uint8_t)((v & 0xF) << 4);
            b[i].scales[8 + g % 4] |= (uint8_t)((v >> 4) << (2 * (g / 4)));
            const float dl = d * ls;
            for (int l = 0; l < 16; l++) {
                const int e = 16 * g + l, c = e / 32, k = e % 32;
                const int u = (dl != 0 ? clampi(kv_nearest_int(x[e] / dl), -4, 3) : 0) + 4;
                b[i].qs[32 * (c / 4) + k] |= (uint8_t)((u & 3) << (2 * (c % 4)));
                b[i].hmask[k] |= (uint8_t)((u >> 2) << c);
            }
        }
    }
}

/* Index of the IQ4_NL value nearest to v (ties to the lower index): the
 * values ascend, so a binary search for the first one >= v, then its
 * neighbour below. */
static int iq4_nearest(float v) {
    int lo = 0, hi = 16;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (kv_iq4nl_values[mid] < v) lo = mid + 1; else hi = mid;
    }
    if (lo == 16) return 15;
    if (lo > 0 && v - kv_iq4nl_values[lo - 1] <= kv_iq4nl_values[lo] - v) return lo - 1;
    return lo;
}

static void iq4_xs_from_float(const float *src, void *dst, int64_t n) {
    kv_block_iq4_xs *b = dst;
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        const float *x = src + i * KV_QK_K;
        float s[8], w[32], amax_s = 0, max_s = 0;
        for (int ib = 0; ib < 8; ib++) {
            const float *xs = x + 32 * ib;
            fit_weights(32, xs, w);
            float amax = 0, max = 0;
            for (int l = 0; l < 32; l++)
                if (fabsf(xs[l]) > amax) amax = fabsf(xs[l]), max = xs[l];
            s[ib] = 0;
            if (amax > 0) { /* candidates: the signed extreme near each end of the grid */
                float best_e = INFINITY;
                for (int k = -6; k <= 6; k += 2) {
                    const float id = (k + kv_iq4nl_values[0]) / max;
                    float sxv = 0, svv = 0, sxx = 0;
                    for (int l = 0; l < 32; l++) {
                        const float v = kv_iq4nl_values[iq4_nearest(id * xs[l])];
                        sxv += w[l] * xs[l] * v, svv += w[l] * v * v, sxx += w[l] * xs[l] * xs[l];
                    }
                    if (svv <= 0) continue;
                    /* least squares for these indices: error sxx - sxv^2 / svv */
                    const float e = sxx - sxv * sxv / svv;
                    if (e < best_e) best_e = e, s[ib] = sxv / svv;
                }
            }
            if (fabsf(s[ib]) > amax_s) amax_s = fabsf(s[ib]), max_s = s[ib];
        }
        memset(&b[i], 0, sizeof b[i]);
        const float is = amax_s > 0 ? -32.f / max_s : 0.f;
        b[i].d = kv_fp32_to_fp16(is != 0 ? 1 / is : 0.f);
        const float d = kv_fp16_to_fp32(b[i].d);
        for (int ib = 0; ib < 8; ib++) {
            const int ls = clampi(kv_nearest_int(is * s[ib]), -32, 31), v = ls + 32;
            b[i].scales_l[ib / 2] |= (uint8_t)((v & 0xF) << (4 * (ib % 2)));
            b[i].scales_h |= (uint16_t)((v >> 4) << (2 * ib));
            const float dl = d * ls;
            for (int j = 0; j < 16; j++) {
                const int q0 = dl != 0 ? iq4_nearest(x[32 * ib + j] / dl) : 8;
                const int q1 = dl != 0 ? iq4_nearest(x[32 * ib + 16 + j] / dl) : 8;
                b[i].qs[16 * ib + j] = (uint8_t)(q0 | (q1 << 4));
            }
        }
    }
}

void kv_kquant_fill_ref(kv_kernels *k) {
    k[KV_TYPE_Q2_K] = (kv_kernels){q2_K_to_float, q2_K_from_float, q2_K_dot, NULL};
    k[KV_TYPE_Q3_K] = (kv_kernels){q3_K_to_float, q3_K_from_float, q3_K_dot, NULL};
    k[KV_TYPE_IQ4_XS] = (kv_kernels){iq4_xs_to_float, iq4_xs_from_float, iq4_xs_dot, NULL};
}
