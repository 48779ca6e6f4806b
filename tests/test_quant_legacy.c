/* kv-test-labels: unit
 * Tests of the 32-value block types Q4_1, Q5_0, Q5_1, IQ4_NL and MXFP4
 * (src/quant/legacy.h): sizes, names and activation type; the Q8_1
 * activation quantizer against ggml's definition; dequantization of
 * blocks packed here from chosen quants against the layouts and formulas
 * ggml documents (ggml-common.h, dequantize_row_*), computed in f64;
 * quantize -> dequantize error bounds; the scalar reference dot against an
 * f64 dot of the dequantized operands; every SIMD backend (AVX2, AVX-VNNI,
 * AVX-512, NEON, NEON+dot) bit-identical to the scalar reference, for
 * vec_dot and for kv_mat_rows with any token count. Under qemu-aarch64 (the
 * cross build) the NEON backends are the ones checked. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/quant.h"
#include "kvtest.h"

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static uint32_t rnd_u32(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}
static float rnd_unif(void) { return (rnd_u32() & 0xffffff) / 16777216.0f; }
static float rnd_gauss(void) {
    float u = rnd_unif() + 1e-7f, v = rnd_unif();
    return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}
static void fill_gauss(float *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) x[i] = rnd_gauss() * scale;
}
static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static const uint32_t types[] = {KV_TYPE_Q4_1, KV_TYPE_Q5_0, KV_TYPE_Q5_1, KV_TYPE_IQ4_NL, KV_TYPE_MXFP4};
#define N_TYPES (sizeof types / sizeof types[0])

static void test_sizes_and_names(void) {
    const struct { uint32_t type; const char *name; uint32_t size, vdt; } want[] = {
        {KV_TYPE_Q4_1, "q4_1", 20, KV_TYPE_Q8_1}, {KV_TYPE_Q5_0, "q5_0", 22, KV_TYPE_Q8_0},
        {KV_TYPE_Q5_1, "q5_1", 24, KV_TYPE_Q8_1}, {KV_TYPE_IQ4_NL, "iq4_nl", 18, KV_TYPE_Q8_0},
        {KV_TYPE_MXFP4, "mxfp4", 17, KV_TYPE_Q8_0},
    };
    for (size_t i = 0; i < KVT_N(want); i++) {
        const kv_type_info *t = kv_type_get(want[i].type);
        ASSERT_TRUE(t != NULL);
        ASSERT_STREQ(t->name, want[i].name);
        ASSERT_EQ(t->blck, 32);
        ASSERT_EQ(t->size, want[i].size);
        ASSERT_TRUE(t->compute);
        ASSERT_EQ(t->vec_dot_type, want[i].vdt); /* ggml's pairing */
        ASSERT_TRUE(kv_type_get_ref(want[i].type)->from_float != NULL);
        ASSERT_EQ(kv_type_row_size(want[i].type, 96), 3 * want[i].size);
        ASSERT_EQ(kv_type_from_name(want[i].name), (int)want[i].type);
    }
    ASSERT_EQ(kv_type_from_name("IQ4_NL"), KV_TYPE_IQ4_NL);
    ASSERT_EQ(kv_type_from_name("MXFP4"), KV_TYPE_MXFP4);
}

/* Q8_1 (the activations of Q4_1/Q5_1), as ggml's x86 quantize_row_q8_1:
 * Q8_0's bytes, and s = fp16(d * sum qs) with d = amax/127 unrounded. */
static void test_q8_1(void) {
    float x[128];
    uint8_t q1[4 * 36], q0[4 * 34];
    for (int rep = 0; rep < 50; rep++) {
        fill_gauss(x, 128, rep % 2 ? 1.0f : 30.0f);
        if (rep == 7) memset(x, 0, sizeof x);
        kv_type_get_ref(KV_TYPE_Q8_1)->from_float(x, q1, 128);
        kv_type_get_ref(KV_TYPE_Q8_0)->from_float(x, q0, 128);
        for (int b = 0; b < 4; b++) {
            ASSERT_TRUE(!memcmp(q1 + 36 * b, q0 + 34 * b, 2));           /* d */
            ASSERT_TRUE(!memcmp(q1 + 36 * b + 4, q0 + 34 * b + 2, 32)); /* qs */
            float amax = 0;
            int sum = 0;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[32 * b + j]));
            for (int j = 0; j < 32; j++) sum += (int8_t)q1[36 * b + 4 + j];
            const uint16_t s = (uint16_t)(q1[36 * b + 2] | q1[36 * b + 3] << 8);
            ASSERT_EQ(s, kv_fp32_to_fp16(amax / 127.f * (float)sum));
        }
        float y[128];
        kv_type_get_ref(KV_TYPE_Q8_1)->to_float(q1, y, 128);
        for (int i = 0; i < 128; i++)
            if (!(fabsf(y[i] - x[i]) <= 0.6f * fabsf(kv_fp16_to_fp32((uint16_t)(q1[36 * (i / 32)] | q1[36 * (i / 32) + 1] << 8))) + 1e-6f))
                KVT_FAIL("q8_1 value %d: %g for %g", i, y[i], x[i]);
    }
}

/* ---- hand-packed blocks, decoded here from ggml's documented layouts ---- */

static void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }

/* Nibble j of the block: low nibble of qs[j] (j < 16), high of qs[j-16]. */
static void put_nibbles(uint8_t *qs, const int q[32]) {
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t)((q[j] & 15) | (q[j + 16] & 15) << 4);
}
static void put_qh(uint8_t *qh, const int q[32]) {
    uint32_t h = 0;
    for (int j = 0; j < 32; j++) h |= (uint32_t)((q[j] >> 4) & 1) << j;
    for (int k = 0; k < 4; k++) qh[k] = (uint8_t)(h >> (8 * k));
}

static void check_block(uint32_t type, const uint8_t *blk, const double want[32], const char *what) {
    float got[32];
    kv_type_get_ref(type)->to_float(blk, got, 32);
    int bad = 0;
    for (int j = 0; j < 32; j++)
        if ((double)got[j] != (double)(float)want[j]) {
            if (!bad) fprintf(stderr, "  %s [%d]: got %.9g want %.9g\n", what, j, got[j], want[j]);
            bad++;
        }
    if (bad) KVT_FAIL("%s: %d of 32 values differ from the layout", what, bad);
    kvt_checks++;
    /* every backend's dequantizer agrees */
    const char *bes[] = {"avx2", "avxvnni", "avx512", "neon", "neondot"};
    for (size_t b = 0; b < KVT_N(bes); b++) {
        if (kv_quant_set_backend(bes[b]) != 0) continue;
        float f[32];
        kv_type_get(type)->to_float(blk, f, 32);
        if (memcmp(f, got, sizeof f)) KVT_FAIL("%s: backend %s dequantizes differently", what, bes[b]);
        kvt_checks++;
    }
    kv_quant_set_backend("scalar");
}

static void test_dequant_handmade(void) {
    static const int iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
    static const double e2m1[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};
    for (int rep = 0; rep < 20; rep++) {
        int q[32];
        double want[32];
        uint8_t blk[24];
        const double d = 0.125 * (1 + rep), m = -0.75 + 0.0625 * rep; /* exact in fp16 */
        const uint16_t d16 = kv_fp32_to_fp16((float)d), m16 = kv_fp32_to_fp16((float)m);
        /* Q4_1: d, m, qs[16]; x = q*d + m */
        for (int j = 0; j < 32; j++) q[j] = (int)(rnd_u32() % 16), want[j] = q[j] * d + m;
        put16(blk, d16); put16(blk + 2, m16); put_nibbles(blk + 4, q);
        check_block(KV_TYPE_Q4_1, blk, want, "q4_1");
        /* Q5_0: d, qh[4], qs[16]; x = (q - 16)*d, bit 4 of q[j] in bit j of qh */
        for (int j = 0; j < 32; j++) q[j] = (int)(rnd_u32() % 32), want[j] = (q[j] - 16) * d;
        put16(blk, d16); put_qh(blk + 2, q); put_nibbles(blk + 6, q);
        check_block(KV_TYPE_Q5_0, blk, want, "q5_0");
        /* Q5_1: d, m, qh[4], qs[16]; x = q*d + m */
        for (int j = 0; j < 32; j++) q[j] = (int)(rnd_u32() % 32), want[j] = q[j] * d + m;
        put16(blk, d16); put16(blk + 2, m16); put_qh(blk + 4, q); put_nibbles(blk + 8, q);
        check_block(KV_TYPE_Q5_1, blk, want, "q5_1");
        /* IQ4_NL: d, qs[16]; x = d*grid[nibble] */
        for (int j = 0; j < 32; j++) q[j] = (int)(rnd_u32() % 16), want[j] = d * iq4nl[q[j]];
        put16(blk, d16); put_nibbles(blk + 2, q);
        check_block(KV_TYPE_IQ4_NL, blk, want, "iq4_nl");
        /* MXFP4: e, qs[16]; x = 2^(e-127) * E2M1(nibble); e over the whole
         * range, subnormal scales (e = 0, 1) included */
        const int es[] = {0, 1, 2, 100, 127, 128, 140, 200, 254};
        const int e = es[rep % 9];
        for (int j = 0; j < 32; j++) q[j] = (int)(rnd_u32() % 16), want[j] = ldexp(e2m1[q[j]], e - 127);
        blk[0] = (uint8_t)e; put_nibbles(blk + 1, q);
        check_block(KV_TYPE_MXFP4, blk, want, "mxfp4");
    }
}

/* ---- quantizers ---- */

static double rel_rmse(uint32_t type, const float *x, int64_t n, float *y, void *buf) {
    const kv_type_info *t = kv_type_get_ref(type);
    t->from_float(x, buf, n);
    t->to_float(buf, y, n);
    double se = 0, sx = 0;
    for (int64_t i = 0; i < n; i++) {
        se += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
        sx += (double)x[i] * x[i];
    }
    return sqrt(se / sx);
}

/* Bounds: a uniform grid of 2^b steps over a gaussian block's range gives
 * ~range/2^b/sqrt(12) rms error; measured (gaussian, then offsets and
 * outliers): q4_1 0.078/0.076, q5_0 0.042/0.053 (no min: the offsets
 * cost it), q5_1 0.038/0.037, iq4_nl 0.073/0.085, mxfp4 0.113/0.121 (E2M1
 * has 2-3 magnitudes per octave). */
static void test_roundtrip_error(void) {
    const int64_t n = 256 * 64;
    float *x = malloc(sizeof(float) * n), *y = malloc(sizeof(float) * n);
    void *buf = malloc((size_t)n * 4);
    const double bound[] = {0.10, 0.065, 0.05, 0.10, 0.16};
    for (int dist = 0; dist < 2; dist++) {
        fill_gauss(x, n, 0.02f);
        if (dist == 1)
            for (int64_t i = 0; i < n; i++) x[i] += (i % 97 == 0 ? 0.1f : 0.f) + 0.01f * ((i / 32) % 3);
        for (size_t c = 0; c < N_TYPES; c++) {
            double e = rel_rmse(types[c], x, n, y, buf);
            printf("  roundtrip %-6s dist %d: rel rmse %.5f (bound %.3f)\n", kv_type_get(types[c])->name, dist, e,
                   bound[c]);
            if (!(e <= bound[c])) KVT_FAIL("%s rel rmse %g > %g", kv_type_get(types[c])->name, e, bound[c]);
            kvt_checks++;
        }
    }
    /* zero and constant rows (and for MXFP4, whose scale spans the float
     * range, a tiny one) quantize to finite values close to the input */
    const float consts[] = {0.0f, 0.5f, -3.0f, 1e-30f};
    for (size_t c = 0; c < N_TYPES; c++)
        for (size_t k = 0; k < KVT_N(consts); k++) {
            if (consts[k] == 1e-30f && types[c] != KV_TYPE_MXFP4) continue; /* below fp16 scales */
            for (int i = 0; i < 64; i++) x[i] = consts[k] * (i % 5 == 0 ? 1.0f : 0.5f);
            const kv_type_info *t = kv_type_get_ref(types[c]);
            t->from_float(x, buf, 64);
            t->to_float(buf, y, 64);
            int bad = 0;
            for (int i = 0; i < 64; i++)
                if (!isfinite(y[i]) || !(fabsf(y[i] - x[i]) <= 0.25f * fabsf(consts[k]) + 1e-38f)) bad++;
            if (bad) KVT_FAIL("%s row of %g: %d bad values", t->name, consts[k], bad);
            kvt_checks++;
        }
    free(x); free(y); free(buf);
}

/* ---- the reference dot against f64 ---- */

/* |ref - f64| <= (n/16 + 16) * 2^-23 * mag: each of 16 lanes takes n/16 /
 * 4 groups' worth of fused steps (one per block, two with a min), each
 * rounding by 2^-24 of the lane's running magnitude, plus the scale
 * product and the 16-lane fold. mag sums |d*w*a| and |m*a| separately
 * (for Q4_1/Q5_1 the two terms of one value may cancel). */
static void test_vec_dot_ref(void) {
    const int64_t ns[] = {32, 64, 96, 256, 2048, 32 * 77};
    float *xw = malloc(4 * 4096), *xa = malloc(4 * 4096), *dw = malloc(4 * 4096), *da = malloc(4 * 4096);
    uint8_t *w = malloc(4 * 4096), *a = malloc(4 * 4096);
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        const uint32_t type = types[ti];
        const kv_type_info *t = kv_type_get_ref(type), *ta = kv_type_get_ref(t->vec_dot_type);
        const int has_min = type == KV_TYPE_Q4_1 || type == KV_TYPE_Q5_1;
        for (size_t k = 0; k < KVT_N(ns); k++) {
            const int64_t n = ns[k];
            fill_gauss(xw, n, 0.05f);
            fill_gauss(xa, n, 1.0f);
            for (int64_t i = 0; i < n; i += 61) xa[i] *= 8;
            t->from_float(xw, w, n);
            ta->from_float(xa, a, n);
            t->to_float(w, dw, n);
            ta->to_float(a, da, n);
            double exact = 0, mag = 0, mag_s = 0;
            for (int64_t b = 0; b < n / 32; b++) {
                double m = 0, sa = 0;
                if (has_min) m = kv_fp16_to_fp32((uint16_t)(w[t->size * b + 2] | w[t->size * b + 3] << 8));
                for (int64_t i = 32 * b; i < 32 * b + 32; i++) {
                    exact += (double)dw[i] * da[i];
                    mag += (fabs((double)dw[i]) + 2 * fabs(m)) * fabs((double)da[i]);
                    sa += da[i];
                }
                mag_s += fabs(m * sa);
            }
            float s;
            t->vec_dot(n, &s, w, a);
            /* Q8_1's s is d*sum in fp16 from the unrounded d, the f64 side
             * sums the fp16 d's values: 2^-11 apart each, at most */
            const double bound = (n / 16.0 + 16) * 0x1p-23 * mag + 0x1p-10 * mag_s;
            if (!(fabs(s - exact) <= bound))
                KVT_FAIL("%s n=%lld: dot %.9g vs f64 %.9g (bound %g)", t->name, (long long)n, s, exact, bound);
            kvt_checks++;
            /* and it tracks the float dot of the data before quantization */
            /* (6 sigma of the sum of the per-element quantization errors,
             * taken as independent) */
            double fx = 0, var = 0;
            for (int64_t i = 0; i < n; i++) {
                fx += (double)xw[i] * xa[i];
                const double ew = ((double)dw[i] - xw[i]) * xa[i], ea = (double)dw[i] * ((double)da[i] - xa[i]);
                var += ew * ew + ea * ea;
            }
            if (!(fabs(s - fx) <= 6 * sqrt(var) + bound))
                KVT_FAIL("%s n=%lld: dot %.6g far from the float dot %.6g", t->name, (long long)n, s, fx);
            kvt_checks++;
        }
    }
    free(xw); free(xa); free(dw); free(da); free(w); free(a);
}

/* ---- every SIMD backend bit-identical to the reference ---- */

static const char *const backends[] = {"avx2", "avxvnni", "avx512", "neon", "neondot"};

static void test_backends_identical(void) {
    float *xw = malloc(4 * 8192), *xa = malloc(4 * 8192);
    uint8_t *w = malloc(4 * 8192), *a = malloc(4 * 8192);
    int ran = 0;
    for (size_t b = 0; b < KVT_N(backends); b++) {
        if (kv_quant_set_backend(backends[b]) != 0) {
            kvt_skip_backend(backends[b], "not available on this CPU (test_backends_identical)");
            continue;
        }
        ran++;
        int bad = 0, same_fn = 0;
        for (size_t ti = 0; ti < N_TYPES; ti++) {
            const kv_type_info *r = kv_type_get_ref(types[ti]), *f = kv_type_get(types[ti]);
            if (f->vec_dot == r->vec_dot) same_fn++;
            for (int64_t nb = 1; nb <= 19; nb += (nb < 6 ? 1 : 6)) { /* odd and even block counts */
                const int64_t n = 32 * nb * (nb > 6 ? 7 : 1);
                for (int rep = 0; rep < 4; rep++) {
                    fill_gauss(xw, n, rep == 2 ? 1e-3f : 0.05f);
                    fill_gauss(xa, n, 1.0f);
                    if (rep == 1) for (int64_t i = 0; i < n; i += 5) xa[i] = 0;
                    if (rep == 3) for (int64_t i = 0; i < n; i += 3) xw[i] = -xw[i] * 4; /* skewed blocks */
                    r->from_float(xw, w, n);
                    kv_type_get_ref(r->vec_dot_type)->from_float(xa, a, n);
                    float s1, s2;
                    r->vec_dot(n, &s1, w, a);
                    f->vec_dot(n, &s2, w, a);
                    if (f2u(s1) != f2u(s2)) {
                        if (bad < 5)
                            fprintf(stderr, "  %s %s n=%lld: ref %.9g fast %.9g\n", backends[b], r->name,
                                    (long long)n, s1, s2);
                        bad++;
                    }
                    kvt_checks++;
                }
            }
        }
        printf("  backend %s: %d types checked\n", backends[b], (int)N_TYPES);
        if (same_fn) KVT_FAIL("backend %s: %d types still use the scalar dot", backends[b], same_fn);
        ASSERT_EQ(bad, 0);
    }
    printf("  %d SIMD backends compared\n", ran);
    kv_quant_set_backend("scalar");
    free(xw); free(xa); free(w); free(a);
}

/* kv_mat_rows: every output equals a lone vec_dot of the same backend and
 * the reference, for token counts around the tile width. */
/* MXFP4 blocks whose E8M0 exponent is small (scales and products below the
 * smallest normal float) and all-zero blocks with e = 0, as a quantizer
 * writes for zero rows: every backend's kv_mat_rows equals the reference's
 * vec_dot bit for bit (the AVX2 one-token kernel takes such 8-block groups
 * apart from the others). */
static void test_mxfp4_small_scales(void) {
    const char *bes[] = {"scalar", "avx2", "avxvnni", "avx512", "neon", "neondot"};
    const int n = 544, n_rows = 9, toks[] = {1, 3};
    const size_t rb = kv_type_row_size(KV_TYPE_MXFP4, n), ab = kv_type_row_size(KV_TYPE_Q8_0, n);
    float *x = malloc(sizeof(float) * (size_t)n * n_rows), *Y = malloc(sizeof(float) * 3 * n_rows);
    uint8_t *W = malloc(rb * n_rows), *A = malloc(ab * 3);
    const kv_type_info *tr = kv_type_get_ref(KV_TYPE_MXFP4);
    fill_gauss(x, (int64_t)n * n_rows, 0.05f);
    for (int r = 0; r < n_rows; r++) tr->from_float(x + (size_t)r * n, W + r * rb, n);
    for (int r = 0; r < n_rows; r++)
        for (int b = 0; b < n / 32; b++) {
            uint8_t *blk = W + r * rb + 17 * (size_t)b;
            const int k = r * 17 + b;
            if (k % 4 == 0) { /* a zero block as written for a zero row */
                memset(blk, 0, 17);
            } else if (k % 4 == 1) {
                blk[0] = (uint8_t)(k % 40); /* e 0..39: subnormal scales and products */
            } else if (r == 4) {
                blk[0] = (uint8_t)(k % 3); /* a row all below normal */
            }
        }
    fill_gauss(x, (int64_t)n * 3, 1.0f);
    for (int k = 0; k < 3; k++) kv_type_get_ref(KV_TYPE_Q8_0)->from_float(x + (size_t)k * n, A + k * ab, n);
    int ran = 0;
    for (size_t b = 0; b < KVT_N(bes); b++) {
        if (kv_quant_set_backend(bes[b]) != 0) continue;
        ran++;
        int bad = 0;
        for (size_t tk = 0; tk < KVT_N(toks); tk++) {
            kv_mat_rows(KV_TYPE_MXFP4, W, rb, n, 0, n_rows, A, ab, toks[tk], Y, n_rows);
            for (int k = 0; k < toks[tk]; k++)
                for (int r = 0; r < n_rows; r++) {
                    float want;
                    tr->vec_dot(n, &want, W + r * rb, A + k * ab);
                    if (f2u(Y[(size_t)k * n_rows + r]) != f2u(want)) {
                        if (bad < 3)
                            fprintf(stderr, "  %s tok %d row %d: ref %.9g got %.9g\n", bes[b], k, r, want,
                                    Y[(size_t)k * n_rows + r]);
                        bad++;
                    }
                    kvt_checks++;
                }
        }
        if (bad) KVT_FAIL("mxfp4 small scales, backend %s: %d outputs differ from the reference", bes[b], bad);
    }
    ASSERT_TRUE(ran >= 1);
    kv_quant_set_backend("scalar");
    free(x); free(Y); free(W); free(A);
}

static void test_mat_rows(void) {
    const char *bes[] = {"scalar", "avx2", "avxvnni", "avx512", "neon", "neondot"};
    const int toks[] = {1, 2, 3, 4, 5, 7, 9}, n_rows = 11, ns[] = {32, 96, 544};
    float *x = malloc(sizeof(float) * 544 * 16);
    uint8_t *W = malloc(544 * 4 * 11), *A = malloc((544 * 4 + 8) * 9);
    float *Y = malloc(sizeof(float) * 16 * 9);
    for (size_t b = 0; b < KVT_N(bes); b++) {
        if (kv_quant_set_backend(bes[b]) != 0) continue;
        int bad = 0, untouched = 0;
        for (size_t ti = 0; ti < N_TYPES; ti++)
            for (size_t ni = 0; ni < KVT_N(ns); ni++) {
                const int n = ns[ni];
                const kv_type_info *t = kv_type_get(types[ti]), *tr = kv_type_get_ref(types[ti]);
                const kv_type_info *ta = kv_type_get(t->vec_dot_type);
                const size_t rb = kv_type_row_size(types[ti], n), ab = kv_type_row_size(t->vec_dot_type, n) + 8;
                fill_gauss(x, (int64_t)n * n_rows, 0.05f);
                for (int r = 0; r < n_rows; r++) t->from_float(x + (size_t)r * n, W + r * rb, n);
                fill_gauss(x, (int64_t)n * 9, 1.0f);
                for (int k = 0; k < 9; k++) ta->from_float(x + (size_t)k * n, A + k * ab, n);
                for (size_t tk = 0; tk < KVT_N(toks); tk++) {
                    const int nt = toks[tk], r0 = 2, r1 = 9;
                    const size_t ys = 13;
                    for (size_t i = 0; i < 16 * 9; i++) Y[i] = -12345.f;
                    kv_mat_rows(types[ti], W, rb, n, r0, r1, A, ab, nt, Y, ys);
                    for (int k = 0; k < nt; k++)
                        for (int r = 0; r < (int)ys; r++) {
                            const float got = Y[(size_t)k * ys + r];
                            if (r < r0 || r >= r1) {
                                if (got != -12345.f) untouched++;
                                continue;
                            }
                            float want, want_ref;
                            t->vec_dot(n, &want, W + r * rb, A + k * ab);
                            tr->vec_dot(n, &want_ref, W + r * rb, A + k * ab);
                            if (f2u(got) != f2u(want) || f2u(got) != f2u(want_ref)) bad++;
                        }
                    kvt_checks++;
                }
            }
        if (bad || untouched)
            KVT_FAIL("mat_rows backend %s: %d outputs differ, %d written outside the range", bes[b], bad, untouched);
    }
    kv_quant_set_backend("scalar");
    free(x); free(W); free(A); free(Y);
}

static const kvt_case cases[] = {
    KVT_CASE(test_sizes_and_names), KVT_CASE(test_q8_1), KVT_CASE(test_dequant_handmade), KVT_CASE(test_roundtrip_error),
    KVT_CASE(test_vec_dot_ref),     KVT_CASE(test_backends_identical), KVT_CASE(test_mat_rows), KVT_CASE(test_mxfp4_small_scales),
};

int main(int argc, char **argv) {
    printf("dispatched backend: %s\n", kv_quant_backend());
    return kvt_run(argc, argv, cases, KVT_N(cases));
}
