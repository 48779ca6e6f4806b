/* Weight quantizers (used to write model files): Q4_0 as ggml's reference
 * (scale from the signed extreme, d = max/-8), and the K-quants with a
 * search for the scale (and min) of each sub-block that minimizes a
 * weighted squared error, in the spirit of ggml's reference quantizers:
 *   - Q4_K / Q5_K: x ~ s*L - m with L in [0, nmax], m >= 0, per 32 values;
 *     s and m then stored as 6-bit integers times fp16 super-scales.
 *   - Q6_K: x ~ s*(L - 32) per 16 values; s stored as int8 times an fp16
 *     super-scale.
 * After the sub-block scales are rounded to their stored form, every value
 * is quantized again against the stored scale, so the file decodes to the
 * best values its scales allow. Not a hot path. */
#include "quant/quant_internal.h"

/* Weighted fit of x ~ s*L + b (b <= 0) with L = clamp(round((x-lo)*is)),
 * trying candidate inverse scales is = (nmax + rmin + k*rdelta)/(hi - lo)
 * for k = 0..nstep. Writes the best L; returns s and stores -b in *mn. */
static float fit_scale_min(int n, int nmax, const float *x, const float *w, uint8_t *L,
                           float *mn, float rmin, float rdelta, int nstep) {
    float lo = x[0], hi = x[0];
    for (int i = 1; i < n; i++) {
        lo = fminf(lo, x[i]);
        hi = fmaxf(hi, x[i]);
    }
    if (lo > 0) lo = 0;
    if (hi == lo) {
        memset(L, 0, (size_t)n);
        *mn = -lo;
        return 0.f;
    }
    float sw = 0, swx = 0;
    for (int i = 0; i < n; i++) {
        sw += w[i];
        swx += w[i] * x[i];
    }
    /* start: plain min/max grid */
    float best_s = (hi - lo) / nmax, best_b = lo, best_err = 0;
    for (int i = 0; i < n; i++) {
        int l = kv_nearest_int((x[i] - lo) / best_s);
        l = l < 0 ? 0 : l > nmax ? nmax : l;
        L[i] = (uint8_t)l;
        float e = best_s * l + lo - x[i];
        best_err += w[i] * e * e;
    }
    uint8_t cand[32];
    for (int k = 0; k <= nstep; k++) {
        float is = (nmax + rmin + rdelta * k) / (hi - lo);
        float swl = 0, swll = 0, swxl = 0;
        for (int i = 0; i < n; i++) {
            int l = kv_nearest_int((x[i] - lo) * is);
            l = l < 0 ? 0 : l > nmax ? nmax : l;
            cand[i] = (uint8_t)l;
            swl += w[i] * l;
            swll += w[i] * l * l;
            swxl += w[i] * l * x[i];
        }
        /* normal equations of the weighted least squares in (s, b) */
        float det = sw * swll - swl * swl;
        if (!(det > 0)) continue;
        float s = (sw * swxl - swx * swl) / det;
        float b = (swll * swx - swl * swxl) / det;
        if (b > 0) { /* the stored min cannot be positive: refit with b = 0 */
            b = 0;
            s = swll > 0 ? swxl / swll : 0;
        }
        float err = 0;
        for (int i = 0; i < n; i++) {
            float e = s * cand[i] + b - x[i];
            err += w[i] * e * e;
        }
        if (err < best_err) {
            best_err = err;
            best_s = s;
            best_b = b;
            memcpy(L, cand, (size_t)n);
        }
    }
    *mn = -best_b;
    return best_s;
}

/* Weighted fit of x ~ s*l with l in [-nmax, nmax-1] (w = x^2), trying
 * inverse scales -(nmax + 0.1k)/max for k = -9..9 where max is the signed
 * value of largest magnitude. Returns s (0 for an all-zero group). */
static float fit_scale_sym(int n, int nmax, const float *x) {
    float amax = 0, max = 0;
    for (int i = 0; i < n; i++) {
        if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }
    }
    if (amax < 1e-15f) return 0.f;
    float best_s = -max / nmax, best_q = -1;
    for (int k = -9; k <= 9; k++) {
        float is = -(nmax + 0.1f * k) / max;
        float sxl = 0, sll = 0;
        for (int i = 0; i < n; i++) {
            int l = kv_nearest_int(is * x[i]);
            l = l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l;
            float w = x[i] * x[i];
            sxl += w * x[i] * l;
            sll += w * l * l;
        }
        /* the error at the optimal s for these l is sum(w x^2) - sxl^2/sll */
        if (sll > 0 && sxl * sxl / sll > best_q) {
            best_q = sxl * sxl / sll;
            best_s = sxl / sll;
        }
    }
    return best_s;
}

void kv_quant_q4_0_from_float(const float *src, void *dst, int64_t n) {
    kv_block_q4_0 *b = dst;
    for (int64_t i = 0; i < n / KV_QK4_0; i++) {
        const float *x = src + i * KV_QK4_0;
        float amax = 0, max = 0;
        for (int j = 0; j < KV_QK4_0; j++) {
            if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); max = x[j]; }
        }
        float d = max / -8, id = d != 0 ? 1.0f / d : 0.0f;
        b[i].d = kv_fp32_to_fp16(d);
        for (int j = 0; j < 16; j++) {
            int q0 = (int)(x[j] * id + 8.5f), q1 = (int)(x[j + 16] * id + 8.5f);
            q0 = q0 > 15 ? 15 : q0 < 0 ? 0 : q0;
            q1 = q1 > 15 ? 15 : q1 < 0 ? 0 : q1;
            b[i].qs[j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

/* Shared by Q4_K (nmax 15) and Q5_K (nmax 31): sub-block fits, 6-bit
 * scales/mins, final values L[256] in [0, nmax]. */
static void k4_quantize_block(const float *x, int nmax, float rmin, int nstep, uint16_t *d_out,
                              uint16_t *dmin_out, uint8_t scales[12], uint8_t L[256]) {
    float s[8], m[8], w[32];
    float max_s = 0, max_m = 0;
    for (int j = 0; j < 8; j++) {
        const float *xs = x + 32 * j;
        float sx2 = 0;
        for (int l = 0; l < 32; l++) sx2 += xs[l] * xs[l];
        float rms = sqrtf(sx2 / 32);
        for (int l = 0; l < 32; l++) w[l] = rms + fabsf(xs[l]);
        s[j] = fit_scale_min(32, nmax, xs, w, L + 32 * j, &m[j], rmin, 0.1f, nstep);
        max_s = fmaxf(max_s, s[j]);
        max_m = fmaxf(max_m, m[j]);
    }
    float is = max_s > 0 ? 63.f / max_s : 0.f, im = max_m > 0 ? 63.f / max_m : 0.f;
    memset(scales, 0, 12);
    for (int j = 0; j < 8; j++) {
        int ls = kv_nearest_int(is * s[j]), lm = kv_nearest_int(im * m[j]);
        ls = ls < 0 ? 0 : ls > 63 ? 63 : ls;
        lm = lm < 0 ? 0 : lm > 63 ? 63 : lm;
        if (j < 4) {
            scales[j] |= (uint8_t)ls;
            scales[j + 4] |= (uint8_t)lm;
        } else {
            scales[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            scales[j - 4] |= (uint8_t)((ls >> 4) << 6);
            scales[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    *d_out = kv_fp32_to_fp16(max_s / 63.f);
    *dmin_out = kv_fp32_to_fp16(max_m / 63.f);
    float d = kv_fp16_to_fp32(*d_out), dmin = kv_fp16_to_fp32(*dmin_out);
    for (int j = 0; j < 8; j++) {
        uint8_t sc, mm;
        kv_scale_min_k4(j, scales, &sc, &mm);
        float dd = d * sc, dm = dmin * mm;
        if (dd == 0) continue; /* keep the fit's L: they decode to -dm anyway */
        for (int l = 0; l < 32; l++) {
            int q = kv_nearest_int((x[32 * j + l] + dm) / dd);
            L[32 * j + l] = (uint8_t)(q < 0 ? 0 : q > nmax ? nmax : q);
        }
    }
}

void kv_quant_q4_K_from_float(const float *src, void *dst, int64_t n) {
    kv_block_q4_K *b = dst;
    uint8_t L[256];
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        k4_quantize_block(src + i * KV_QK_K, 15, -1.0f, 20, &b[i].d, &b[i].dmin, b[i].scales, L);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++)
                b[i].qs[32 * c + l] = (uint8_t)(L[64 * c + l] | (L[64 * c + 32 + l] << 4));
    }
}

void kv_quant_q5_K_from_float(const float *src, void *dst, int64_t n) {
    kv_block_q5_K *b = dst;
    uint8_t L[256];
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        k4_quantize_block(src + i * KV_QK_K, 31, -0.5f, 15, &b[i].d, &b[i].dmin, b[i].scales, L);
        memset(b[i].qh, 0, sizeof b[i].qh);
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 32; l++) {
                int lo = L[64 * c + l], hi = L[64 * c + 32 + l];
                b[i].qs[32 * c + l] = (uint8_t)((lo & 0xF) | ((hi & 0xF) << 4));
                b[i].qh[l] |= (uint8_t)(((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1)));
            }
    }
}

void kv_quant_q6_K_from_float(const float *src, void *dst, int64_t n) {
    kv_block_q6_K *b = dst;
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        const float *x = src + i * KV_QK_K;
        float s[16], max_s = 0, amax_s = 0;
        for (int g = 0; g < 16; g++) {
            s[g] = fit_scale_sym(16, 32, x + 16 * g);
            if (fabsf(s[g]) > amax_s) { amax_s = fabsf(s[g]); max_s = s[g]; }
        }
        memset(&b[i], 0, sizeof b[i]);
        uint8_t L[256];
        memset(L, 32, sizeof L);
        if (amax_s >= 1e-15f) {
            float is = -128.f / max_s;
            b[i].d = kv_fp32_to_fp16(1 / is);
            float d = kv_fp16_to_fp32(b[i].d);
            for (int g = 0; g < 16; g++) {
                int q = kv_nearest_int(is * s[g]);
                b[i].scales[g] = (int8_t)(q > 127 ? 127 : q < -128 ? -128 : q);
                float dd = d * b[i].scales[g];
                if (dd == 0) continue;
                for (int l = 0; l < 16; l++) {
                    int v = kv_nearest_int(x[16 * g + l] / dd);
                    v = v < -32 ? -32 : v > 31 ? 31 : v;
                    L[16 * g + l] = (uint8_t)(v + 32);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            uint8_t *ql = b[i].ql + 64 * h, *qh = b[i].qh + 32 * h;
            const uint8_t *Lh = L + 128 * h;
            for (int l = 0; l < 32; l++) {
                ql[l] = (uint8_t)((Lh[l] & 0xF) | ((Lh[l + 64] & 0xF) << 4));
                ql[l + 32] = (uint8_t)((Lh[l + 32] & 0xF) | ((Lh[l + 96] & 0xF) << 4));
                qh[l] = (uint8_t)((Lh[l] >> 4) | ((Lh[l + 32] >> 4) << 2) | ((Lh[l + 64] >> 4) << 4) |
                                  ((Lh[l + 96] >> 4) << 6));
            }
        }
    }
}
