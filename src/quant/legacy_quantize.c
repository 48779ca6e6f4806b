/* Weight quantizers of Q4_1, Q5_0, Q5_1, IQ4_NL and MXFP4 (used to write
 * model files; not a hot path). Each picks a block's scale (and min), rounds
 * it to its stored form, then quantizes every value against the stored
 * scale, so a file decodes to the best values its scales allow:
 *   - Q4_1 / Q5_1: x ~ d*q + m from the block's min and max;
 *   - Q5_0: x ~ d*(q - 16), the signed extreme mapped to -16 (as ggml);
 *   - IQ4_NL: x ~ d*grid[i]: a few candidate scales (the signed extreme on
 *     either end of the grid, +-10%), each refit by least squares to its
 *     assignment; the one of least squared error wins;
 *   - MXFP4: the shared exponent floor(log2 amax) - 2 + 127 (ggml's) or
 *     one above, whichever has the smaller squared error. */
#include "quant/legacy.h"

static uint8_t clamp_q(int q, int hi) { return (uint8_t)(q < 0 ? 0 : q > hi ? hi : q); }

/* Stores 32 quants q[j] as nibbles (Q4_0's arrangement) and, if qh, their
 * fifth bits. */
static void pack(const uint8_t q[32], uint8_t qs[16], uint8_t *qh) {
    uint32_t h = 0;
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t)((q[j] & 0xF) | (q[j + 16] & 0xF) << 4);
    for (int j = 0; j < 32; j++) h |= (uint32_t)(q[j] >> 4 & 1) << j;
    if (qh)
        for (int k = 0; k < 4; k++) qh[k] = (uint8_t)(h >> (8 * k));
}

/* x ~ d*q + m, q in [0, nmax]: d, m as fp16 and the quants. */
static void fit_min(const float *x, int nmax, uint16_t *d16, uint16_t *m16, uint8_t q[32]) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < 32; j++) {
        lo = fminf(lo, x[j]);
        hi = fmaxf(hi, x[j]);
    }
    *d16 = kv_fp32_to_fp16((hi - lo) / nmax);
    *m16 = kv_fp32_to_fp16(lo);
    const float d = kv_fp16_to_fp32(*d16), m = kv_fp16_to_fp32(*m16);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; j++) q[j] = clamp_q(kv_nearest_int((x[j] - m) * id), nmax);
}

void kv_quant_q4_1_from_float(const float *src, void *dst, int64_t n) {
    kv_block_q4_1 *b = dst;
    for (int64_t i = 0; i < n / 32; i++) {
        uint8_t q[32];
        fit_min(src + 32 * i, 15, &b[i].d, &b[i].m, q);
        pack(q, b[i].qs, NULL);
    }
}

void kv_quant_q5_1_from_float(const float *src, void *dst, int64_t n) {
    kv_block_q5_1 *b = dst;
    for (int64_t i = 0; i < n / 32; i++) {
        uint8_t q[32];
        fit_min(src + 32 * i, 31, &b[i].d, &b[i].m, q);
        pack(q, b[i].qs, b[i].qh);
    }
}

/* The value of largest magnitude, with its sign (the first on ties). */
static float signed_max(const float *x) {
    float amax = 0, max = 0;
    for (int j = 0; j < 32; j++)
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    return max;
}

void kv_quant_q5_0_from_float(const float *src, void *dst, int64_t n) {
    kv_block_q5_0 *b = dst;
    for (int64_t i = 0; i < n / 32; i++) {
        const float *x = src + 32 * i;
        b[i].d = kv_fp32_to_fp16(signed_max(x) / -16);
        const float d = kv_fp16_to_fp32(b[i].d), id = d != 0.0f ? 1.0f / d : 0.0f;
        uint8_t q[32];
        for (int j = 0; j < 32; j++) q[j] = clamp_q(kv_nearest_int(x[j] * id) + 16, 31);
        pack(q, b[i].qs, b[i].qh);
    }
}

/* Index of the table value nearest to v (the first on ties). */
static int nearest(const int8_t tab[16], float v) {
    int best = 0;
    float be = fabsf(v - tab[0]);
    for (int k = 1; k < 16; k++) {
        const float e = fabsf(v - tab[k]);
        if (e < be) {
            be = e;
            best = k;
        }
    }
    return best;
}

/* Squared error of x against d*tab[q] with q the nearest indices. */
static float grid_err(const float *x, const int8_t tab[16], float d, uint8_t q[32]) {
    float err = 0;
    for (int j = 0; j < 32; j++) {
        q[j] = (uint8_t)(d != 0.0f ? nearest(tab, x[j] / d) : nearest(tab, 0.0f)); /* /d: 1/d may overflow */
        const float e = x[j] - d * tab[q[j]];
        err += e * e;
    }
    return err;
}

void kv_quant_iq4_nl_from_float(const float *src, void *dst, int64_t n) {
    kv_block_iq4_nl *b = dst;
    for (int64_t i = 0; i < n / 32; i++) {
        const float *x = src + 32 * i;
        const float max = signed_max(x);
        uint8_t q[32];
        float best_d = 0, best_err = INFINITY;
        for (int end = 0; end < 2 && max != 0; end++) {
            for (int k = -5; k <= 5; k++) {
                const float d0 = max / (end ? 113.0f : -127.0f) * (1.0f + 0.02f * k);
                grid_err(x, kv_iq4nl_values, d0, q);
                float sxv = 0, svv = 0;
                for (int j = 0; j < 32; j++) {
                    sxv += x[j] * kv_iq4nl_values[q[j]];
                    svv += (float)kv_iq4nl_values[q[j]] * kv_iq4nl_values[q[j]];
                }
                const float d = svv > 0 ? sxv / svv : d0;
                const float e = grid_err(x, kv_iq4nl_values, kv_fp16_to_fp32(kv_fp32_to_fp16(d)), q);
                if (e < best_err) {
                    best_err = e;
                    best_d = d;
                }
            }
        }
        b[i].d = kv_fp32_to_fp16(best_d);
        grid_err(x, kv_iq4nl_values, kv_fp16_to_fp32(b[i].d), q);
        pack(q, b[i].qs, NULL);
    }
}

void kv_quant_mxfp4_from_float(const float *src, void *dst, int64_t n) {
    kv_block_mxfp4 *b = dst;
    for (int64_t i = 0; i < n / 32; i++) {
        const float *x = src + 32 * i;
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
        uint8_t q[32];
        int best_e = 0;
        if (amax > 0) {
            const int e0 = (int)floorf(log2f(amax)) - 2 + 127;
            float best_err = INFINITY;
            for (int e = e0; e <= e0 + 1; e++) {
                if (e < 0 || e > 254) continue;
                const float err = grid_err(x, kv_mxfp4_values, kv_e8m0_half((uint8_t)e), q);
                if (err < best_err) {
                    best_err = err;
                    best_e = e;
                }
            }
        }
        b[i].e = (uint8_t)best_e;
        if (amax > 0) grid_err(x, kv_mxfp4_values, kv_e8m0_half(b[i].e), q);
        else memset(q, 0, sizeof q);
        pack(q, b[i].qs, NULL);
    }
}
