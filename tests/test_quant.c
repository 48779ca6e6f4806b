/* Tests of the tensor types module: size table and names; fp16/bf16
 * conversions (exhaustive over all 65536 halfs, rounding cases, hardware F16C
 * as an independent oracle); dequantization of hand-built blocks against f64
 * values computed from the documented layouts; quantize->dequantize error
 * bounds; vec_dot against an f64 dot of the dequantized operands; every SIMD
 * backend bit-identical to the scalar reference; kv_mat_rows bit-identical to
 * per-element vec_dot for odd row/token counts; the attention helpers of
 * quant/vec.h in their documented order on every backend. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvasir/quant.h"
#include "kvtest.h"
#include "quant/vec.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_X86 1
#endif

/* ---- deterministic random numbers ---- */
static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd_u32(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}
static float rnd_unif(void) { return (rnd_u32() & 0xffffff) / 16777216.0f; } /* [0,1) */
static float rnd_gauss(void) {
    float u = rnd_unif() + 1e-7f, v = rnd_unif();
    return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}
static void fill_gauss(float *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) x[i] = rnd_gauss() * scale;
}

static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static const uint32_t compute_types[] = {KV_TYPE_F32, KV_TYPE_F16, KV_TYPE_BF16, KV_TYPE_Q8_0,
                                         KV_TYPE_Q4_0, KV_TYPE_Q4_K, KV_TYPE_Q5_K, KV_TYPE_Q6_K};
#define N_COMPUTE (sizeof compute_types / sizeof compute_types[0])

/* ------------------------------------------------------------------ */

static void test_sizes_and_names(void) {
    ASSERT_EQ(kv_type_row_size(KV_TYPE_F32, 10), 40);
    ASSERT_EQ(kv_type_row_size(KV_TYPE_Q8_0, 64), 68);
    ASSERT_EQ(kv_type_row_size(KV_TYPE_Q4_0, 64), 36);
    ASSERT_EQ(kv_type_row_size(KV_TYPE_Q4_K, 512), 288);
    ASSERT_EQ(kv_type_row_size(KV_TYPE_Q5_K, 256), 176);
    ASSERT_EQ(kv_type_row_size(KV_TYPE_Q6_K, 256), 210);
    ASSERT_EQ(kv_type_row_size(KV_TYPE_Q8_K, 256), 292);
    ASSERT_EQ(kv_type_row_size(KV_TYPE_BF16, 3), 6);
    ASSERT_EQ(kv_type_row_size(KV_TYPE_Q4_K, 100), 0); /* not a multiple of 256 */
    ASSERT_EQ(kv_type_row_size(5, 32), 0);              /* hole */
    ASSERT_EQ(kv_type_row_size(KV_TYPE_COUNT, 32), 0);
    ASSERT_EQ(kv_type_from_name("q4_k"), KV_TYPE_Q4_K);
    ASSERT_EQ(kv_type_from_name("Q4_K"), KV_TYPE_Q4_K);
    ASSERT_EQ(kv_type_from_name("BF16"), KV_TYPE_BF16);
    ASSERT_EQ(kv_type_from_name("q4_k_m"), -1);
    ASSERT_EQ(kv_type_from_name(""), -1);
    ASSERT_TRUE(kv_type_get(5) == NULL);
    ASSERT_TRUE(kv_type_get(1000) == NULL);
    for (size_t i = 0; i < N_COMPUTE; i++) {
        const kv_type_info *t = kv_type_get(compute_types[i]), *r = kv_type_get_ref(compute_types[i]);
        ASSERT_TRUE(t && r && t->compute && r->compute && t->vec_dot && t->to_float && t->from_float);
        ASSERT_EQ(t->vec_dot_type, r->vec_dot_type);
    }
    ASSERT_EQ(kv_type_get(KV_TYPE_Q4_K)->vec_dot_type, KV_TYPE_Q8_K);
    ASSERT_EQ(kv_type_get(KV_TYPE_Q6_K)->vec_dot_type, KV_TYPE_Q8_K);
    ASSERT_EQ(kv_type_get(KV_TYPE_Q4_0)->vec_dot_type, KV_TYPE_Q8_0);
    ASSERT_EQ(kv_type_get(KV_TYPE_F16)->vec_dot_type, KV_TYPE_F16);
    ASSERT_TRUE(kv_type_get(KV_TYPE_Q8_K)->from_float != NULL);
    ASSERT_TRUE(!kv_type_get(KV_TYPE_IQ2_XXS)->compute); /* Q3_K computes since kquant_ref.c */
    ASSERT_EQ(kv_quant_set_backend("bogus"), -1);
    ASSERT_EQ(kv_quant_set_backend(NULL), -1);
}

/* ------------------------------------------------------------------ */
/* fp16 / bf16 */

#ifdef HAVE_X86
#include <cpuid.h>
__attribute__((target("f16c"))) static uint16_t hw_f32_to_f16(float f) {
    return (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(f), 0), 0);
}
__attribute__((target("f16c"))) static float hw_f16_to_f32(uint16_t h) {
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}
#elif defined(__aarch64__)
/* the FCVT instruction (base ARMv8): widening is exact, as the reference */
static float hw_f16_to_f32(uint16_t h) {
    __fp16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}
#endif

static void test_fp16(void) {
    int bad_rt = 0, bad_val = 0, bad_hw = 0;
#ifdef HAVE_X86
    unsigned ca, cb, cc, cd;
    int hw = __get_cpuid(1, &ca, &cb, &cc, &cd) && (cc & (1u << 29)); /* CPUID.1:ECX.F16C */
#elif defined(__aarch64__)
    int hw = 1;
#else
    int hw = 0;
#endif
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kv_fp16_to_fp32((uint16_t)h);
        int e = (h >> 10) & 31, m = h & 1023;
        double want = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
        if (h & 0x8000) want = -want;
        if (isnan(want)) {
            if (!isnan(f)) bad_val++;
            uint16_t back = kv_fp32_to_fp16(f);
            if ((back & 0x7c00) != 0x7c00 || !(back & 0x3ff) || (back & 0x8000) != (h & 0x8000)) bad_rt++;
            continue;
        }
        if ((double)f != want || !!signbit(f) != !!(h & 0x8000)) bad_val++;
        if (kv_fp32_to_fp16(f) != h) bad_rt++;
#if defined(HAVE_X86) || defined(__aarch64__)
        if (hw && f2u(hw_f16_to_f32((uint16_t)h)) != f2u(f)) bad_hw++;
#endif
    }
    ASSERT_EQ(bad_val, 0);
    ASSERT_EQ(bad_rt, 0);
    ASSERT_EQ(bad_hw, 0);
    /* rounding: ties to even, overflow, subnormals */
    ASSERT_EQ(kv_fp32_to_fp16(1.0f + 0x1p-11f), 0x3c00);       /* tie -> even (down) */
    ASSERT_EQ(kv_fp32_to_fp16(1.0f + 3 * 0x1p-11f), 0x3c02);   /* tie -> even (up) */
    ASSERT_EQ(kv_fp32_to_fp16(1.0f + 0x1p-11f + 0x1p-20f), 0x3c01);
    ASSERT_EQ(kv_fp32_to_fp16(65504.f), 0x7bff);
    ASSERT_EQ(kv_fp32_to_fp16(65519.99f), 0x7bff);
    ASSERT_EQ(kv_fp32_to_fp16(65520.f), 0x7c00);
    ASSERT_EQ(kv_fp32_to_fp16(-1e10f), 0xfc00);
    ASSERT_EQ(kv_fp32_to_fp16(0x1p-24f), 0x0001);
    ASSERT_EQ(kv_fp32_to_fp16(0x1p-25f), 0x0000);              /* tie -> even (zero) */
    ASSERT_EQ(kv_fp32_to_fp16(3 * 0x1p-25f), 0x0002);          /* tie -> even */
    ASSERT_EQ(kv_fp32_to_fp16(0x1p-14f - 0x1p-26f), 0x0400);   /* rounds up to min normal */
    ASSERT_EQ(kv_fp32_to_fp16(-0.0f), 0x8000);
    ASSERT_EQ(kv_fp32_to_fp16(1e-30f), 0x0000);
    ASSERT_EQ(kv_fp32_to_fp16(INFINITY), 0x7c00);
    ASSERT_TRUE((kv_fp32_to_fp16(NAN) & 0x7fff) > 0x7c00);
#ifdef HAVE_X86
    /* random floats of all magnitudes against the hardware conversion */
    if (hw) {
        int bad = 0;
        for (int i = 0; i < 2000000; i++) {
            uint32_t u = rnd_u32();
            if (i & 1) u = (u & 0x87ffffffu) | 0x30000000u; /* concentrate near the half range */
            float f = u2f(u);
            if (isnan(f)) continue;
            if (kv_fp32_to_fp16(f) != hw_f32_to_f16(f)) bad++;
        }
        ASSERT_EQ(bad, 0);
    }
#endif
}

static void test_bf16(void) {
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kv_bf16_to_fp32((uint16_t)h);
        if (f2u(f) != h << 16) bad++;
        uint16_t back = kv_fp32_to_bf16(f);
        if (isnan(f) ? !isnan(kv_bf16_to_fp32(back)) : back != h) bad++;
    }
    ASSERT_EQ(bad, 0);
    ASSERT_EQ(kv_fp32_to_bf16(1.0f + 0x1p-8f), 0x3f80);       /* tie -> even (down) */
    ASSERT_EQ(kv_fp32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);   /* tie -> even (up) */
    ASSERT_EQ(kv_fp32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
    ASSERT_EQ(kv_fp32_to_bf16(u2f(0x7f7fffffu)), 0x7f80);     /* max float rounds to inf */
    ASSERT_EQ(kv_fp32_to_bf16(u2f(0x7fa00000u)), 0x7fe0);     /* signalling NaN made quiet */
    /* random: result is the nearest bf16, ties to even, by an f64 check */
    int badr = 0;
    for (int i = 0; i < 200000; i++) {
        float f = u2f(rnd_u32() & 0xbfffffffu); /* finite, exponent < 128 */
        uint16_t b = kv_fp32_to_bf16(f);
        double lo = kv_bf16_to_fp32(b), err = fabs((double)f - lo);
        double up = kv_bf16_to_fp32((uint16_t)(b + 1)), dn = kv_bf16_to_fp32((uint16_t)(b - 1));
        if (err > fabs((double)f - up) || err > fabs((double)f - dn)) badr++;
        if ((err == fabs((double)f - up) || err == fabs((double)f - dn)) && (b & 1)) badr++;
    }
    ASSERT_EQ(badr, 0);
}

/* ------------------------------------------------------------------ */
/* Dequantization of hand-built blocks: expected values in f64 straight from
 * the layout description (ggml-common.h), written independently. */

static void put_f16(uint8_t *p, float v) {
    uint16_t h = kv_fp32_to_fp16(v);
    p[0] = (uint8_t)h;
    p[1] = (uint8_t)(h >> 8);
}

static void check_dequant(uint32_t type, const uint8_t *blk, const double *want, int n) {
    float got[256];
    kv_type_get_ref(type)->to_float(blk, got, n);
    int bad = 0;
    for (int i = 0; i < n; i++)
        if (fabs(got[i] - want[i]) > 1e-6 * fabs(want[i]) + 1e-9) bad++;
    if (bad) KVT_FAIL("dequant type %u: %d of %d values wrong", type, bad, n);
    kvt_checks++;
    /* the dispatched table decodes identically */
    float got2[256];
    kv_type_get(type)->to_float(blk, got2, n);
    ASSERT_TRUE(!memcmp(got, got2, sizeof(float) * (size_t)n));
}

/* 6-bit scale/min packing of q4_K/q5_K, written as bit placement: scale j
 * bits 0-3 / mins: j<4: byte j (scale, 6 bits) and byte j+4 (min);
 * j>=4: low nibbles in byte j+4, top 2 bits in bits 6-7 of bytes j-4 / j. */
static void pack_k4_scales(uint8_t s12[12], const int sc[8], const int mn[8]) {
    memset(s12, 0, 12);
    for (int j = 0; j < 4; j++) {
        s12[j] = (uint8_t)(sc[j] | ((sc[j + 4] >> 4) << 6));
        s12[j + 4] = (uint8_t)(mn[j] | ((mn[j + 4] >> 4) << 6));
        s12[j + 8] = (uint8_t)((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
    }
}

static void test_dequant_handmade(void) {
    double want[256];
    uint8_t blk[292];
    /* Q8_0: d = 0.5, qs = -16..15 */
    put_f16(blk, 0.5f);
    for (int j = 0; j < 32; j++) { blk[2 + j] = (uint8_t)(int8_t)(j - 16); want[j] = 0.5 * (j - 16); }
    check_dequant(KV_TYPE_Q8_0, blk, want, 32);
    /* Q4_0: d = -0.25; byte j: low nibble element j, high nibble element j+16 */
    put_f16(blk, -0.25f);
    for (int j = 0; j < 16; j++) {
        int lo = j, hi = 15 - j;
        blk[2 + j] = (uint8_t)(lo | (hi << 4));
        want[j] = -0.25 * (lo - 8);
        want[j + 16] = -0.25 * (hi - 8);
    }
    check_dequant(KV_TYPE_Q4_0, blk, want, 32);
    /* Q4_K and Q5_K: scales > 15 exercise the 2 high bits */
    int sc[8], mn[8];
    for (int j = 0; j < 8; j++) { sc[j] = (5 * j + 29) & 63; mn[j] = 63 - 7 * j; }
    for (int q5 = 0; q5 < 2; q5++) {
        memset(blk, 0, sizeof blk);
        put_f16(blk, 0.0625f);
        put_f16(blk + 2, 0.03125f);
        pack_k4_scales(blk + 4, sc, mn);
        uint8_t *qh = blk + 16, *qs = blk + (q5 ? 48 : 16);
        for (int e = 0; e < 256; e++) {
            int q = (e * 7 + 3) % (q5 ? 32 : 16);
            int chunk = e / 64, within = e % 64, l = within % 32, hi = within / 32;
            qs[32 * chunk + l] |= (uint8_t)((q & 15) << (4 * hi));
            if (q5 && (q & 16)) qh[l] |= (uint8_t)(1 << (2 * chunk + hi));
            int j = e / 32;
            want[e] = 0.0625 * sc[j] * q - 0.03125 * mn[j];
        }
        check_dequant(q5 ? KV_TYPE_Q5_K : KV_TYPE_Q4_K, blk, want, 256);
    }
    /* Q6_K: element e = 128h + 32k + l: low nibble in ql[64h + l + 32(k&1)]
     * (bits 4(k>>1)..), high 2 bits in qh[32h + l] bits 2k..2k+1 */
    memset(blk, 0, sizeof blk);
    int8_t s6[16];
    for (int g = 0; g < 16; g++) s6[g] = (int8_t)(g * 17 - 128);
    for (int e = 0; e < 256; e++) {
        int q = (e * 13 + 5) % 64;
        int h = e / 128, k = (e % 128) / 32, l = e % 32;
        blk[64 * h + l + 32 * (k & 1)] |= (uint8_t)((q & 15) << (4 * (k >> 1)));
        blk[128 + 32 * h + l] |= (uint8_t)((q >> 4) << (2 * k));
        want[e] = 0.001953125 * s6[e / 16] * (q - 32);
    }
    memcpy(blk + 192, s6, 16);
    put_f16(blk + 208, 0.001953125f);
    check_dequant(KV_TYPE_Q6_K, blk, want, 256);
    /* Q8_K: float d, then qs, then bsums */
    float d8 = -0.75f;
    memcpy(blk, &d8, 4);
    for (int e = 0; e < 256; e++) { blk[4 + e] = (uint8_t)(int8_t)(e - 128); want[e] = -0.75 * (e - 128); }
    check_dequant(KV_TYPE_Q8_K, blk, want, 256);
}

/* Activation quantizers on hand-made rows with ties (round half to even). */
static void test_activation_rounding(void) {
    float x[256];
    uint8_t out[292 * 2];
    /* Q8_0: amax 127 -> d = 1, id = 1 */
    for (int j = 0; j < 32; j++) x[j] = 0;
    x[0] = 127; x[1] = 2.5f; x[2] = 3.5f; x[3] = -2.5f; x[4] = -0.5f; x[5] = 0.5f; x[6] = 1.5f;
    kv_type_get_ref(KV_TYPE_Q8_0)->from_float(x, out, 32);
    const int8_t *q = (const int8_t *)out + 2;
    ASSERT_EQ(out[0] | (out[1] << 8), 0x3c00); /* d = 127/127 = 1.0 */
    ASSERT_EQ(q[0], 127); ASSERT_EQ(q[1], 2); ASSERT_EQ(q[2], 4); ASSERT_EQ(q[3], -2);
    ASSERT_EQ(q[4], 0); ASSERT_EQ(q[5], 0); ASSERT_EQ(q[6], 2);
    /* Q8_K: the signed extreme -127 maps to -127 -> iscale = 1, d = 1 */
    for (int j = 0; j < 256; j++) x[j] = (float)((j % 7) - 3) + 0.5f * (j % 2);
    x[10] = -127;
    kv_type_get_ref(KV_TYPE_Q8_K)->from_float(x, out, 256);
    float d; memcpy(&d, out, 4);
    ASSERT_TRUE(d == 1.0f);
    const int8_t *q8 = (const int8_t *)out + 4;
    int bad = 0;
    for (int j = 0; j < 256; j++) {
        double v = x[j], r = nearbyint(v); /* default mode: ties to even */
        if (q8[j] != (int)r) bad++;
    }
    ASSERT_EQ(bad, 0);
    int16_t bs[16];
    memcpy(bs, out + 260, 32);
    for (int g = 0; g < 16; g++) {
        int s = 0;
        for (int j = 0; j < 16; j++) s += q8[16 * g + j];
        ASSERT_EQ(bs[g], s);
    }
    /* a positive extreme maps to -127: d negative */
    for (int j = 0; j < 256; j++) x[j] = (j == 3) ? 254.f : 1.0f;
    kv_type_get_ref(KV_TYPE_Q8_K)->from_float(x, out, 256);
    memcpy(&d, out, 4);
    ASSERT_TRUE(d == -2.0f);
    ASSERT_EQ(((const int8_t *)out)[4 + 3], -127);
    ASSERT_EQ(((const int8_t *)out)[4 + 0], 0); /* -0.5 -> 0 (even) */
    /* all-zero block */
    memset(x, 0, sizeof x);
    kv_type_get_ref(KV_TYPE_Q8_K)->from_float(x, out, 256);
    memcpy(&d, out, 4);
    ASSERT_TRUE(d == 0.0f && out[4] == 0);
}

/* ------------------------------------------------------------------ */
/* Quantize -> dequantize error on random rows. RMSE relative to the RMS
 * of the data, bounds per type (measured values are well below; the bound
 * is what each format's step size implies for gaussian data):
 *   f32 0, f16 2^-11 per element (relative), bf16 2^-8 per element,
 *   q8_0 0.008, q8_K 0.015 (one scale per 256), q4_0 0.12, q4_K 0.09, q5_K 0.045, q6_K 0.025 */
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

static void test_roundtrip_error(void) {
    const int64_t n = 256 * 64;
    float *x = malloc(sizeof(float) * n), *y = malloc(sizeof(float) * n);
    void *buf = malloc((size_t)n * 4 + 1024);
    struct { uint32_t type; double bound; } cases[] = {
        {KV_TYPE_Q8_0, 0.008}, {KV_TYPE_Q8_K, 0.015}, {KV_TYPE_Q4_0, 0.12},
        {KV_TYPE_Q4_K, 0.09},  {KV_TYPE_Q5_K, 0.045}, {KV_TYPE_Q6_K, 0.025},
    };
    for (int dist = 0; dist < 2; dist++) {
        fill_gauss(x, n, 0.02f);
        if (dist == 1) /* rows with a few outliers and an offset per 32 */
            for (int64_t i = 0; i < n; i++) x[i] += (i % 97 == 0 ? 0.1f : 0.f) + 0.01f * ((i / 32) % 3);
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            double e = rel_rmse(cases[c].type, x, n, y, buf);
            printf("  roundtrip %-5s dist %d: rel rmse %.5f (bound %.3f)\n",
                   kv_type_get(cases[c].type)->name, dist, e, cases[c].bound);
            if (!(e <= cases[c].bound)) KVT_FAIL("%s rel rmse %g > %g", kv_type_get(cases[c].type)->name, e, cases[c].bound);
            kvt_checks++;
        }
        /* float types: per-element relative bounds (normal range) */
        rel_rmse(KV_TYPE_F32, x, n, y, buf);
        ASSERT_TRUE(!memcmp(x, y, sizeof(float) * (size_t)n));
        int bad = 0;
        rel_rmse(KV_TYPE_F16, x, n, y, buf);
        for (int64_t i = 0; i < n; i++)
            if (fabsf(x[i]) > 1e-4f && fabs((double)y[i] - x[i]) > 0x1p-11 * fabsf(x[i])) bad++;
        rel_rmse(KV_TYPE_BF16, x, n, y, buf);
        for (int64_t i = 0; i < n; i++)
            if (fabs((double)y[i] - x[i]) > 0x1p-8 * fabsf(x[i])) bad++;
        ASSERT_EQ(bad, 0);
    }
    /* all-zero and constant rows quantize without NaN */
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        for (int k = 0; k < 2; k++) {
            for (int64_t i = 0; i < 256; i++) x[i] = k ? 0.5f : 0.0f;
            const kv_type_info *t = kv_type_get_ref(cases[c].type);
            t->from_float(x, buf, 256);
            t->to_float(buf, y, 256);
            int bad = 0;
            for (int i = 0; i < 256; i++) if (!(fabsf(y[i] - x[i]) <= 0.5f * 0.07f)) bad++;
            if (bad) KVT_FAIL("%s constant %d row: %d bad", t->name, k, bad);
            kvt_checks++;
        }
    }
    free(x); free(y); free(buf);
}

/* ------------------------------------------------------------------ */
/* vec_dot (reference) against f64 over the dequantized operands. Bound:
 * each of the 8 lanes sums n/8 float terms (or n/32 blocks, n/256 super-
 * blocks), each step rounding by at most 2^-24 of the running magnitude, so
 * |ref - f64| <= (n/8 + 8) * 2^-23 * sum|w_i a_i|. */
static void make_operands(uint32_t type, int64_t n, float *xw, float *xa, void *w, void *a) {
    fill_gauss(xw, n, 0.05f);
    fill_gauss(xa, n, 1.0f);
    for (int64_t i = 0; i < n; i += 61) xa[i] *= 8; /* activation outliers */
    const kv_type_info *t = kv_type_get_ref(type), *ta = kv_type_get_ref(t->vec_dot_type);
    t->from_float(xw, w, n);
    ta->from_float(xa, a, n);
}

static void test_vec_dot_ref(void) {
    const int64_t ns[] = {256, 512, 2048, 256 * 13};
    float *xw = malloc(4 * 4096), *xa = malloc(4 * 4096), *dw = malloc(4 * 4096), *da = malloc(4 * 4096);
    uint8_t *w = malloc(4 * 4096), *a = malloc(4 * 4096);
    for (size_t ti = 0; ti < N_COMPUTE; ti++) {
        uint32_t type = compute_types[ti];
        const kv_type_info *t = kv_type_get_ref(type), *ta = kv_type_get_ref(t->vec_dot_type);
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            int64_t n = ns[k];
            make_operands(type, n, xw, xa, w, a);
            t->to_float(w, dw, n);
            ta->to_float(a, da, n);
            double exact = 0, mag = 0;
            for (int64_t i = 0; i < n; i++) {
                exact += (double)dw[i] * da[i];
                mag += fabs((double)dw[i] * da[i]);
            }
            float s;
            t->vec_dot(n, &s, w, a);
            double bound = (n / 8.0 + 8) * 0x1p-23 * mag;
            if (!(fabs(s - exact) <= bound))
                KVT_FAIL("%s n=%lld: dot %.9g vs f64 %.9g (bound %g)", t->name, (long long)n, s, exact, bound);
            kvt_checks++;
            /* and the quantized dot tracks the float dot of the original data */
            double fx = 0;
            for (int64_t i = 0; i < n; i++) fx += (double)xw[i] * xa[i];
            if (!(fabs(s - fx) <= 0.25 * sqrt(mag * mag / n) * sqrt((double)n) + 1e-3 * mag))
                KVT_FAIL("%s n=%lld: dot %.6g far from float dot %.6g", t->name, (long long)n, s, fx);
            kvt_checks++;
        }
    }
    free(xw); free(xa); free(dw); free(da); free(w); free(a);
}

/* ------------------------------------------------------------------ */
/* SIMD backends: bit-identical to the scalar reference. */

static const char *const backends[] = {"avx2", "avxvnni", "avx512", "neon", "neondot"};

static void test_backends_identical(void) {
    const int64_t nq[] = {256, 512, 768, 2048, 256 * 13, 256 * 17};
    const int64_t nf[] = {1, 7, 8, 9, 31, 33, 100, 1000, 4099};
    float *xw = malloc(4 * 8192), *xa = malloc(4 * 8192);
    uint8_t *w = malloc(4 * 8192), *a = malloc(4 * 8192), *w2 = malloc(4 * 8192);
    float *f1 = malloc(4 * 8192), *f2 = malloc(4 * 8192);
    for (size_t b = 0; b < sizeof backends / sizeof backends[0]; b++) {
        if (kv_quant_set_backend(backends[b]) != 0) {
            kvt_skip_backend(backends[b], "not available on this CPU (test_backends_identical)");
            continue;
        }
        printf("  backend %s: checking\n", backends[b]);
        /* the fast table really points at other code than the reference */
        ASSERT_TRUE(kv_type_get(KV_TYPE_Q8_0)->vec_dot != kv_type_get_ref(KV_TYPE_Q8_0)->vec_dot);
        ASSERT_TRUE(kv_type_get(KV_TYPE_Q4_K)->vec_dot != kv_type_get_ref(KV_TYPE_Q4_K)->vec_dot);
        ASSERT_STREQ(kv_quant_backend(), backends[b]);
        int bad_dot = 0, bad_q = 0, bad_deq = 0;
        for (size_t ti = 0; ti < N_COMPUTE + 1; ti++) {
            uint32_t type = ti < N_COMPUTE ? compute_types[ti] : KV_TYPE_Q8_K;
            const kv_type_info *r = kv_type_get_ref(type), *f = kv_type_get(type);
            int is_float = type == KV_TYPE_F32 || type == KV_TYPE_F16 || type == KV_TYPE_BF16;
            const int64_t *ns = is_float ? nf : nq;
            size_t nn = is_float ? sizeof nf / sizeof nf[0] : sizeof nq / sizeof nq[0];
            for (size_t k = 0; k < nn; k++) {
                int64_t n = ns[k];
                if (type == KV_TYPE_Q8_0 || type == KV_TYPE_Q4_0) n = n / 256 * 32 * 3 + 32 * (k + 1);
                for (int rep = 0; rep < 3; rep++) {
                    fill_gauss(xw, n, rep == 2 ? 1e-3f : 0.05f);
                    fill_gauss(xa, n, 1.0f);
                    if (rep == 1) for (int64_t i = 0; i < n; i += 5) xa[i] = 0; /* zeros and ties */
                    /* activation quantizer of this type's vec_dot_type */
                    const kv_type_info *ra = kv_type_get_ref(r->vec_dot_type), *fa = kv_type_get(r->vec_dot_type);
                    uint64_t asz = kv_type_row_size(r->vec_dot_type, (uint64_t)n);
                    ra->from_float(xa, a, n);
                    fa->from_float(xa, w2, n);
                    if (memcmp(a, w2, asz)) bad_q++;
                    if (type == KV_TYPE_Q8_K) continue;
                    uint64_t wsz = kv_type_row_size(type, (uint64_t)n);
                    r->from_float(xw, w, n);
                    f->from_float(xw, w2, n);
                    if (memcmp(w, w2, wsz)) bad_q++;
                    r->to_float(w, f1, n);
                    f->to_float(w, f2, n);
                    if (memcmp(f1, f2, sizeof(float) * (size_t)n)) bad_deq++;
                    float s1, s2;
                    r->vec_dot(n, &s1, w, a);
                    f->vec_dot(n, &s2, w, a);
                    if (f2u(s1) != f2u(s2)) {
                        bad_dot++;
                        fprintf(stderr, "  %s %s n=%lld: ref %.9g fast %.9g\n", backends[b], r->name,
                                (long long)n, s1, s2);
                    }
                }
            }
        }
        ASSERT_EQ(bad_dot, 0);
        ASSERT_EQ(bad_q, 0);
        ASSERT_EQ(bad_deq, 0);
    }
    kv_quant_set_backend("scalar");
    free(xw); free(xa); free(w); free(a); free(w2); free(f1); free(f2);
}

/* ------------------------------------------------------------------ */
/* kv_mat_rows: each output equals a lone vec_dot of the same backend. */

static void test_mat_rows(void) {
    const char *bes[] = {"scalar", "avx2", "avxvnni", "avx512", "neon", "neondot"};
    /* every tile width 1..8 and uneven token splits (9: 5 + 4, 17: 6 + 6 + 5);
     * for the 32-value block types also an odd block count (544: Q4_0's
     * odd last block) and rows long enough (8224) that 17 tokens need more
     * than one chunk of prepared activations (Q8_0: 14 tokens a chunk on
     * AVX2, 8 on AVX-512); for the K-quants 2
     * and 3 super-blocks (the AVX-512 one-token q4_K loop takes them in
     * pairs, an odd last one alone) */
    const int toks[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17};
    const int n_rows = 37, nmax = 8224, ns[] = {512, 544, 768, 8224};
    float *x = malloc(sizeof(float) * nmax * 40);
    uint8_t *W = malloc((size_t)nmax * 4 * n_rows), *A = malloc(((size_t)nmax * 4 + 8) * 17);
    float *Y = malloc(sizeof(float) * 64 * 17);
    for (size_t b = 0; b < sizeof bes / sizeof bes[0]; b++) {
        if (kv_quant_set_backend(bes[b]) != 0) { kvt_skip_backend(bes[b], "not available on this CPU"); continue; }
        int bad = 0, bad_ref = 0, bad_untouched = 0;
        for (size_t ti = 0; ti < N_COMPUTE; ti++)
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
            uint32_t type = compute_types[ti];
            const int n = ns[ni];
            const kv_type_info *t = kv_type_get(type), *ta = kv_type_get(t->vec_dot_type);
            const kv_type_info *tr = kv_type_get_ref(type);
            if (n % t->blck || (t->blck != 32 && n != 512 && n != 768)) continue;
            size_t rb = kv_type_row_size(type, n), ab = kv_type_row_size(t->vec_dot_type, n) + 8;
            fill_gauss(x, (int64_t)n * n_rows, 0.05f);
            for (int r = 0; r < n_rows; r++) t->from_float(x + (size_t)r * n, W + r * rb, n);
            fill_gauss(x, (int64_t)n * 17, 1.0f);
            for (int k = 0; k < 17; k++) ta->from_float(x + (size_t)k * n, A + k * ab, n);
            for (size_t tk = 0; tk < sizeof toks / sizeof toks[0]; tk++) {
                int nt = toks[tk];
                for (int range = 0; range < 3; range++) {
                    int r0 = range == 0 ? 0 : range == 1 ? 3 : 5, r1 = range == 0 ? n_rows : range == 1 ? 4 : 30;
                    size_t ys = 41;
                    for (size_t i = 0; i < 64 * 17; i++) Y[i] = -12345.f;
                    kv_mat_rows(type, W, rb, n, r0, r1, A, ab, nt, Y, ys);
                    for (int k = 0; k < nt; k++)
                        for (int r = 0; r < (int)ys; r++) {
                            float got = Y[(size_t)k * ys + r];
                            if (r < r0 || r >= r1) {
                                if (got != -12345.f) bad_untouched++;
                                continue;
                            }
                            float want, want_ref;
                            t->vec_dot(n, &want, W + r * rb, A + k * ab);
                            tr->vec_dot(n, &want_ref, W + r * rb, A + k * ab);
                            if (f2u(got) != f2u(want)) bad++;
                            if (f2u(got) != f2u(want_ref)) bad_ref++;
                        }
                }
            }
        }
        if (bad || bad_ref || bad_untouched)
            KVT_FAIL("mat_rows backend %s: %d differ from its vec_dot, %d from the reference, %d outside range written",
                     bes[b], bad, bad_ref, bad_untouched);
        kvt_checks++;
    }
    kv_quant_set_backend("scalar");
    free(x); free(W); free(A); free(Y);
}

/* ------------------------------------------------------------------ */
/* softmax (quant/vec.h): the scalar reference within a few float ulps of
 * an f64 softmax of the same scaled inputs, every backend bit-identical to
 * it; ties, -inf entries, values far below the max (exp flushed to 0 under
 * -87) and every tail length. */

static void test_softmax(void) {
    const char *bes[] = {"scalar", "avx2", "avxvnni", "avx512", "neon", "neondot"};
    const int ns[] = {1, 2, 7, 8, 9, 15, 16, 17, 100, 1031};
    const float scales[] = {1.0f, 0.088388347f};
    float *in = malloc(sizeof(float) * 1031), *ref = malloc(sizeof(float) * 1031), *x = malloc(sizeof(float) * 1031);
    int bad_acc = 0, bad_id = 0, checked = 0;
    double worst = 0.0;
    for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
        for (int kind = 0; kind < 3; kind++)
            for (size_t si = 0; si < 2; si++) {
                const int n = ns[ni];
                const float sc = scales[si];
                fill_gauss(in, n, kind == 0 ? 3.0f : kind == 1 ? 40.0f : 1.0f);
                if (kind == 2) /* ties, a -inf (a masked key) and one far below the max */
                    for (int i = 0; i < n; i++) in[i] = i % 5 == 3 ? -INFINITY : i % 7 == 1 ? -150.0f : in[i] > 0 ? 1.0f : in[i];
                if (kind == 2 && n > 1) in[n - 1] = 2.0f; /* a finite max whatever the pattern */
                /* the reference: the scalar backend, against f64 */
                kv_quant_set_backend("scalar");
                memcpy(ref, in, sizeof(float) * (size_t)n);
                kv_f32_softmax(ref, n, sc);
                double mx = -INFINITY, sum = 0.0;
                for (int i = 0; i < n; i++) mx = fmax(mx, (double)(in[i] * sc));
                for (int i = 0; i < n; i++) sum += exp((double)(in[i] * sc) - mx);
                for (int i = 0; i < n; i++) {
                    const double want = exp((double)(in[i] * sc) - mx) / sum;
                    const double err = fabs((double)ref[i] - want);
                    /* relative to the value: a few ulps, plus the float rounding of
                     * y = x - max itself (|y| * 2^-24, which any float softmax has);
                     * absolute where exp is flushed (e^-87 below the max) */
                    const double y = (double)(in[i] * sc) - mx, rel = 4e-7 + fabs(y) * 6e-8;
                    if (want > 1e-36) {
                        if (!(err <= rel * want)) bad_acc++;
                        if (err / want / rel > worst) worst = err / want / rel;
                    } else if (!(err <= 1e-36)) {
                        bad_acc++;
                    }
                }
                for (size_t b = 1; b < sizeof bes / sizeof bes[0]; b++) {
                    if (kv_quant_set_backend(bes[b]) != 0) continue;
                    memcpy(x, in, sizeof(float) * (size_t)n);
                    kv_f32_softmax(x, n, sc);
                    for (int i = 0; i < n; i++) bad_id += f2u(x[i]) != f2u(ref[i]);
                    checked++;
                }
            }
    kv_quant_set_backend("scalar");
    printf("  softmax: worst error %.2f of its bound against f64; %d backend runs compared\n", worst, checked);
    if (bad_acc) KVT_FAIL("softmax: %d elements outside the bound against f64", bad_acc);
    if (bad_id) KVT_FAIL("softmax: %d elements differ from the scalar reference", bad_id);
    kvt_checks++;
    free(in); free(ref); free(x);
}

/* kv_f32_silu (the qwen35 conv and output gate): every backend the scalar
 * reference's bits, and the reference within a few ulps of f64 silu, over
 * tails, both signs, the clamp, zeros, infinities and a NaN. */
static void test_silu(void) {
    const char *bes[] = {"scalar", "avx2", "avxvnni", "avx512", "neon", "neondot"};
    const int n = 1031;
    float *in = malloc(sizeof(float) * n), *ref = malloc(sizeof(float) * n), *y = malloc(sizeof(float) * n);
    int bad_acc = 0, bad_id = 0, checked = 0;
    double worst = 0.0;
    for (int kind = 0; kind < 3; kind++) {
        fill_gauss(in, n, kind == 0 ? 2.0f : kind == 1 ? 30.0f : 100.0f);
        in[0] = 0.0f; in[1] = -0.0f; in[2] = INFINITY; in[3] = -INFINITY; in[4] = NAN;
        in[5] = -88.5f; in[6] = 88.5f; in[7] = -87.5f; in[8] = 1e-30f; in[9] = -1e-30f;
        kv_quant_set_backend("scalar");
        kv_f32_silu(ref, in, n);
        for (int i = 0; i < n; i++) {
            const double x = (double)in[i];
            if (isnan(x)) { bad_acc += !isnan(ref[i]); continue; }
            if (isinf(x)) { bad_acc += x > 0 ? ref[i] != in[i] : !isnan(ref[i]); continue; } /* inf / 1, -inf * 0 */
            const double want = x / (1.0 + exp(-x));
            const double err = fabs((double)ref[i] - want);
            /* a few ulps of the result; below -88 (-0 there) the true value is under 1e-36 */
            const double bound = 6e-7 * fabs(want) + 1e-36;
            if (!(err <= bound)) bad_acc++;
            else if (err / bound > worst) worst = err / bound;
        }
        for (size_t b = 1; b < sizeof bes / sizeof bes[0]; b++) {
            if (kv_quant_set_backend(bes[b]) != 0) continue;
            for (int len = 1; len <= n; len = len < 20 ? len + 1 : len * 3) {
                memcpy(y, in, sizeof(float) * (size_t)n);
                kv_f32_silu(y, y, len); /* in place, as qwen35 calls it */
                for (int i = 0; i < len; i++) bad_id += f2u(y[i]) != f2u(ref[i]);
                for (int i = len; i < n; i++) bad_id += f2u(y[i]) != f2u(in[i]);
                checked++;
            }
        }
    }
    kv_quant_set_backend("scalar");
    printf("  silu: worst error %.2f of its bound against f64; %d backend runs compared\n", worst, checked);
    if (bad_acc) KVT_FAIL("silu: %d elements outside the bound against f64", bad_acc);
    if (bad_id) KVT_FAIL("silu: %d elements differ from the scalar reference", bad_id);
    kvt_checks++;
    free(in); free(ref); free(y);
}

/* ------------------------------------------------------------------ */
/* attention helpers (quant/vec.h): every backend bit-identical to the
 * scalar reference and to the documented per-element order. */

static void test_attn_vec(void) {
    const char *bes[] = {"scalar", "avx2", "avxvnni", "avx512", "neon", "neondot"};
    const int dims[] = {1, 7, 8, 15, 16, 24, 64, 100, 128, 136, 256};
    const int rows[] = {1, 2, 5, 33};
    const size_t stride = 300;
    float *V = malloc(sizeof(float) * stride * 33), *w = malloc(sizeof(float) * 33);
    float *q = malloc(sizeof(float) * 256), *o = malloc(sizeof(float) * 260);
    float *want = malloc(sizeof(float) * 260);
    float *Q = malloc(sizeof(float) * 260 * 9), *Y = malloc(sizeof(float) * 40 * 9);
    float *WQ = malloc(sizeof(float) * 40 * 9), *O = malloc(sizeof(float) * 264 * 9);
    fill_gauss(Q, 260 * 9, 1.0f);
    fill_gauss(WQ, 40 * 9, 0.3f);
    fill_gauss(V, (int64_t)stride * 33, 1.0f);
    fill_gauss(w, 33, 0.3f);
    fill_gauss(q, 256, 1.0f);
    for (size_t b = 0; b < sizeof bes / sizeof bes[0]; b++) {
        if (kv_quant_set_backend(bes[b]) != 0) { kvt_skip_backend(bes[b], "not available on this CPU"); continue; }
        int bad = 0;
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++)
            for (size_t ri = 0; ri < sizeof rows / sizeof rows[0]; ri++) {
                int n = dims[di], nr = rows[ri];
                /* weighted sum: one fma per row, increasing row, from 0 */
                for (int i = 0; i < n + 4; i++) o[i] = -7.f;
                kv_f32_wsum_rows(o, w, V, stride, nr, n);
                for (int i = 0; i < n; i++) {
                    float acc = 0.0f;
                    for (int p = 0; p < nr; p++) acc = fmaf(w[p], V[(size_t)p * stride + i], acc);
                    if (f2u(acc) != f2u(o[i])) bad++;
                }
                for (int i = n; i < n + 4; i++) bad += o[i] != -7.f;
                /* scaled dots: F32 vec_dot order, then * scale */
                for (int p = 0; p < nr + 4; p++) o[p] = -7.f;
                kv_f32_dot_rows(q, V, stride, nr, n, 0.125f, o);
                for (int p = 0; p < nr; p++) {
                    float l[8] = {0};
                    for (int i = 0; i < n; i++) l[i & 7] = fmaf(V[(size_t)p * stride + i], q[i], l[i & 7]);
                    float d = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
                    if (f2u(d * 0.125f) != f2u(o[p])) bad++;
                }
                for (int p = nr; p < nr + 4; p++) bad += o[p] != -7.f;
                /* several queries at once: the F32 mat kernel with up to 9
                 * query rows (every zmm pair and an odd last one), each
                 * output the documented dot; and the shared-V weighted sums
                 * (attention's scores over a block's keys and its weighted
                 * sums), fresh and continued, each element its own query's
                 * fma chain, for n of 1-16 (the narrow, masked paths) too */
                for (int nq = 1; nq <= 9; nq++) {
                    const size_t ys = 40;
                    for (size_t i = 0; i < (size_t)nq * ys; i++) Y[i] = -7.f;
                    kv_mat_rows(KV_TYPE_F32, V, stride * sizeof(float), n, 0, nr, Q, 260 * sizeof(float), nq, Y, ys);
                    for (int j = 0; j < nq; j++) {
                        for (int p = 0; p < nr; p++) {
                            float l[8] = {0};
                            for (int i = 0; i < n; i++)
                                l[i & 7] = fmaf(V[(size_t)p * stride + i], Q[(size_t)j * 260 + i], l[i & 7]);
                            float d = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
                            if (f2u(d) != f2u(Y[(size_t)j * ys + p])) bad++;
                        }
                        for (int p = nr; p < (int)ys; p++) bad += Y[(size_t)j * ys + p] != -7.f;
                    }
                    for (int acc0 = 0; acc0 < 2; acc0++) {
                        for (size_t i = 0; i < (size_t)nq * 264; i++) O[i] = acc0 ? 0.25f * (float)(i % 13) - 1.f : -7.f;
                        kv_f32_wsum_rows_multi(O, 264, WQ, 40, nq, V, stride, nr, n, acc0);
                        for (int j = 0; j < nq; j++) {
                            for (int i = 0; i < n; i++) {
                                float acc = acc0 ? 0.25f * (float)(((size_t)j * 264 + (size_t)i) % 13) - 1.f : 0.0f;
                                for (int p = 0; p < nr; p++)
                                    acc = fmaf(WQ[(size_t)j * 40 + p], V[(size_t)p * stride + i], acc);
                                if (f2u(acc) != f2u(O[(size_t)j * 264 + i])) bad++;
                            }
                            for (int i = n; i < 264; i++)
                                bad += O[(size_t)j * 264 + i] != (acc0 ? 0.25f * (float)(((size_t)j * 264 + (size_t)i) % 13) - 1.f : -7.f);
                        }
                    }
                }
            }
        if (bad) KVT_FAIL("attention helpers backend %s: %d differ", bes[b], bad);
        kvt_checks++;
    }
    kv_quant_set_backend("scalar");
    free(V); free(w); free(q); free(o); free(want); free(Q); free(Y); free(WQ); free(O);
}

/* delta-rule step (quant/vec.h): every backend bit-identical to the
 * documented per-row order, in place and out of place. */
static void test_delta_rows(void) {
    const char *bes[] = {"scalar", "avx2", "avxvnni", "avx512", "neon", "neondot"};
    const int dims[] = {1, 7, 8, 16, 24, 100, 128, 136};
    const int rows[] = {1, 3, 4, 5, 9, 128};
    const int nmax = 136, rmax = 128;
    float *S = malloc(sizeof(float) * nmax * rmax), *D = aligned_alloc(64, sizeof(float) * nmax * rmax);
    float *W = malloc(sizeof(float) * nmax * rmax), *k = malloc(sizeof(float) * nmax);
    float *q = malloc(sizeof(float) * nmax), *v = malloc(sizeof(float) * (rmax + 4));
    float *o = malloc(sizeof(float) * (rmax + 4)), *wo = malloc(sizeof(float) * rmax);
    fill_gauss(S, (int64_t)nmax * rmax, 0.1f);
    fill_gauss(k, nmax, 0.3f);
    fill_gauss(q, nmax, 0.3f);
    fill_gauss(v, rmax, 1.0f);
    const float decay = 0.93f, beta = 0.61f, scale = 0.088f;
    for (size_t b = 0; b < sizeof bes / sizeof bes[0]; b++) {
        if (kv_quant_set_backend(bes[b]) != 0) { kvt_skip_backend(bes[b], "not available on this CPU"); continue; }
        int bad = 0;
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++)
            for (size_t ri = 0; ri < sizeof rows / sizeof rows[0]; ri++) {
                const int n = dims[di], nr = rows[ri];
                for (int j = 0; j < nr; j++) {
                    const float *s = S + (size_t)j * n;
                    float l[8] = {0}, lq[8] = {0};
                    for (int i = 0; i < n; i++) l[i & 7] = fmaf(s[i] * decay, k[i], l[i & 7]);
                    const float dj = (v[j] - (((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])))) * beta;
                    for (int i = 0; i < n; i++) {
                        const float m = fmaf(k[i], dj, s[i] * decay);
                        W[(size_t)j * n + i] = m;
                        lq[i & 7] = fmaf(m, q[i], lq[i & 7]);
                    }
                    wo[j] = (((lq[0] + lq[4]) + (lq[2] + lq[6])) + ((lq[1] + lq[5]) + (lq[3] + lq[7]))) * scale;
                }
                /* out of place, then in place; then the same with kv_f32_delta_rows_stream
                 * (streaming stores out of place into the 64-byte aligned D, the plain
                 * kernel in place) */
                for (int pass = 0; pass < 4; pass++) {
                    const size_t cnt = (size_t)n * nr;
                    const int inplace = pass & 1;
                    if (inplace) memcpy(D, S, cnt * sizeof(float));
                    else for (size_t i = 0; i < (size_t)nmax * rmax; i++) D[i] = -7.f;
                    for (int j = 0; j < nr + 4; j++) o[j] = -7.f;
                    if (pass < 2) kv_f32_delta_rows(inplace ? D : S, D, nr, n, k, q, v, decay, beta, scale, o);
                    else kv_f32_delta_rows_stream(inplace ? D : S, D, nr, n, k, q, v, decay, beta, scale, o);
                    for (size_t i = 0; i < cnt; i++) bad += f2u(D[i]) != f2u(W[i]);
                    for (size_t i = cnt; i < cnt + 4 && i < (size_t)nmax * rmax; i++) bad += D[i] != -7.f && !inplace;
                    for (int j = 0; j < nr; j++) bad += f2u(o[j]) != f2u(wo[j]);
                    for (int j = nr; j < nr + 4; j++) bad += o[j] != -7.f;
                }
            }
        if (bad) KVT_FAIL("delta rows backend %s: %d differ", bes[b], bad);
        kvt_checks++;
    }
    kv_quant_set_backend("scalar");
    free(S); free(D); free(W); free(k); free(q); free(v); free(o); free(wo);
}

/* ------------------------------------------------------------------ */
/* KV_QUANT_BACKEND caps the run-time choice; it is read once, at the first
 * call, so each value is checked in a fresh process (this test, re-run with
 * --print-backend). */

static int backend_with_env(const char *val, char *out, size_t cap) {
    int fd[2];
    if (pipe(fd)) return -1;
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        dup2(fd[1], 1);
        close(fd[0]);
        if (val) setenv("KV_QUANT_BACKEND", val, 1); else unsetenv("KV_QUANT_BACKEND");
        execl("/proc/self/exe", "test_quant", "--print-backend", (char *)NULL);
        _exit(127);
    }
    close(fd[1]);
    ssize_t n = read(fd[0], out, cap - 1);
    close(fd[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    out[n > 0 ? n : 0] = 0;
    out[strcspn(out, "\n")] = 0;
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

static void test_backend_env(void) {
    char def[32], got[32];
    const char *was = kv_quant_backend();
    const int has_avx2 = kv_quant_set_backend("avx2") == 0, has_vnni = kv_quant_set_backend("avxvnni") == 0,
              has_512 = kv_quant_set_backend("avx512") == 0;
    kv_quant_set_backend(was);
    ASSERT_EQ(backend_with_env(NULL, def, sizeof def), 0);
    /* same CPU, same detection: the best level this process can set (other
       cases leave another one chosen here) */
    const char *best[] = {"neondot", "neon", "avx512", "avxvnni", "avx2", "scalar"}, *want = "scalar";
    for (size_t i = 0; i < sizeof best / sizeof best[0]; i++)
        if (kv_quant_set_backend(best[i]) == 0) {
            want = best[i];
            break;
        }
    ASSERT_STREQ(def, want);
    kv_quant_set_backend(was);
    ASSERT_EQ(backend_with_env("scalar", got, sizeof got), 0);
    ASSERT_STREQ(got, "scalar");
    ASSERT_EQ(backend_with_env("bogus", got, sizeof got), 0);
    ASSERT_STREQ(got, def);
    ASSERT_EQ(backend_with_env("avx2", got, sizeof got), 0);
    ASSERT_STREQ(got, has_avx2 ? "avx2" : def);
    ASSERT_EQ(backend_with_env("avxvnni", got, sizeof got), 0);
    ASSERT_STREQ(got, has_vnni ? "avxvnni" : def);
    ASSERT_EQ(backend_with_env("avx512", got, sizeof got), 0);
    ASSERT_STREQ(got, has_512 ? "avx512" : def);
}

static const kvt_case cases[] = {
    KVT_CASE(test_sizes_and_names), KVT_CASE(test_fp16),          KVT_CASE(test_bf16),
    KVT_CASE(test_dequant_handmade), KVT_CASE(test_activation_rounding),
    KVT_CASE(test_roundtrip_error), KVT_CASE(test_vec_dot_ref),  KVT_CASE(test_backends_identical),
    KVT_CASE(test_mat_rows),         KVT_CASE(test_attn_vec),     KVT_CASE(test_softmax), KVT_CASE(test_silu),     KVT_CASE(test_delta_rows),
    KVT_CASE(test_backend_env),
};

int main(int argc, char **argv) {
    if (argc == 2 && !strcmp(argv[1], "--print-backend")) {
        printf("%s\n", kv_quant_backend());
        return 0;
    }
    printf("dispatched backend: %s\n", kv_quant_backend());
    return kvt_run(argc, argv, cases, KVT_N(cases));
}
