/* Tests of the Q2_K, Q3_K and IQ4_XS types: sizes and activation type;
 * dequantization of random blocks against f64 values computed here from
 * ggml's documented loops (dequantize_row_q2_K / q3_K / iq4_xs, written
 * independently of kquant_ref.c's helpers); quantize->dequantize error
 * bounds; the reference vec_dot against an f64 dot of the dequantized
 * operands; every SIMD backend (AVX2, AVX-VNNI, AVX-512, NEON, NEON dot;
 * those the CPU runs) bit-identical to the scalar reference on quantized
 * rows and on random blocks (every scale and index reachable), and
 * kv_mat_rows bit-identical to lone vec_dots. */
#define _POSIX_C_SOURCE 200809L
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

static const uint32_t types[] = {KV_TYPE_Q2_K, KV_TYPE_Q3_K, KV_TYPE_IQ4_XS};
#define N_TYPES (sizeof types / sizeof types[0])
static const int iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static double h2d(const uint8_t *p) { return kv_fp16_to_fp32((uint16_t)(p[0] | p[1] << 8)); }
static void put_h(uint8_t *p, float v) {
    uint16_t h = kv_fp32_to_fp16(v);
    p[0] = (uint8_t)h;
    p[1] = (uint8_t)(h >> 8);
}

/* A random block of type t: random bytes, then sane fp16 super-scales. */
static void random_block(uint32_t t, uint8_t *b) {
    const uint32_t sz = kv_type_get_ref(t)->size;
    for (uint32_t i = 0; i < sz; i++) b[i] = (uint8_t)rnd_u32();
    if (t == KV_TYPE_Q2_K) {
        put_h(b + 80, 0.01f + 0.02f * rnd_unif());
        put_h(b + 82, 0.01f * rnd_unif());
    } else if (t == KV_TYPE_Q3_K) {
        put_h(b + 108, (rnd_unif() - 0.5f) * 0.004f);
    } else {
        put_h(b, (rnd_unif() - 0.5f) * 0.0004f);
    }
}

/* ggml's dequantization loops, in f64, from the block bytes. */
static void ref_dequant(uint32_t t, const uint8_t *b, double *y) {
    if (t == KV_TYPE_Q2_K) { /* scales[16] qs[64] d dmin */
        const uint8_t *sc = b, *q = b + 16;
        const double d = h2d(b + 80), mn = h2d(b + 82);
        int is = 0;
        for (int n = 0; n < 256; n += 128) {
            for (int shift = 0; shift < 8; shift += 2) {
                for (int half = 0; half < 2; half++) {
                    const uint8_t s = sc[is++];
                    for (int l = 0; l < 16; l++) *y++ = d * (s & 0xF) * ((q[l + 16 * half] >> shift) & 3) - mn * (s >> 4);
                }
            }
            q += 32;
        }
    } else if (t == KV_TYPE_Q3_K) { /* hmask[32] qs[64] scales[12] d */
        const uint8_t *hm = b, *q = b + 32, *s12 = b + 96;
        const double d = h2d(b + 108);
        uint32_t aux[4];
        memcpy(aux, s12, 12);
        const uint32_t tmp = aux[2];
        aux[2] = ((aux[0] >> 4) & 0x0f0f0f0fu) | (((tmp >> 4) & 0x03030303u) << 4);
        aux[3] = ((aux[1] >> 4) & 0x0f0f0f0fu) | (((tmp >> 6) & 0x03030303u) << 4);
        aux[0] = (aux[0] & 0x0f0f0f0fu) | (((tmp >> 0) & 0x03030303u) << 4);
        aux[1] = (aux[1] & 0x0f0f0f0fu) | (((tmp >> 2) & 0x03030303u) << 4);
        uint8_t scales[16];
        memcpy(scales, aux, 16);
        int is = 0;
        uint8_t m = 1;
        for (int n = 0; n < 256; n += 128) {
            for (int shift = 0; shift < 8; shift += 2) {
                for (int half = 0; half < 2; half++) {
                    const double dl = d * ((int)scales[is++] - 32);
                    for (int l = 16 * half; l < 16 * half + 16; l++)
                        *y++ = dl * ((int)((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
                }
                m = (uint8_t)(m << 1);
            }
            q += 32;
        }
    } else { /* d scales_h scales_l[4] qs[128] */
        const double d = h2d(b);
        const unsigned sh = (unsigned)(b[2] | b[3] << 8);
        for (int ib = 0; ib < 8; ib++) {
            const int ls = ((b[4 + ib / 2] >> 4 * (ib % 2)) & 0xF) | (((sh >> 2 * ib) & 3) << 4);
            const double dl = d * (ls - 32);
            const uint8_t *q = b + 8 + 16 * ib;
            for (int j = 0; j < 16; j++) {
                y[j] = dl * iq4nl[q[j] & 0xF];
                y[j + 16] = dl * iq4nl[q[j] >> 4];
            }
            y += 32;
        }
    }
}

static void test_sizes(void) {
    ASSERT_EQ(kv_type_row_size(KV_TYPE_Q2_K, 512), 168);
    ASSERT_EQ(kv_type_row_size(KV_TYPE_Q3_K, 256), 110);
    ASSERT_EQ(kv_type_row_size(KV_TYPE_IQ4_XS, 768), 408);
    ASSERT_EQ(kv_type_row_size(KV_TYPE_Q3_K, 128), 0);
    for (size_t i = 0; i < N_TYPES; i++) {
        const kv_type_info *t = kv_type_get(types[i]);
        ASSERT_TRUE(t && t->compute && t->to_float && t->from_float && t->vec_dot);
        ASSERT_EQ(t->vec_dot_type, KV_TYPE_Q8_K);
        ASSERT_EQ(t->blck, 256);
    }
    ASSERT_EQ(kv_type_from_name("Q3_K"), KV_TYPE_Q3_K);
    ASSERT_EQ(kv_type_from_name("iq4_xs"), KV_TYPE_IQ4_XS);
}

/* to_float of random blocks equals ggml's loops to the f32 rounding of one
 * product (the reference multiplies d*scale, rounds, then times q). */
static void test_dequant_random(void) {
    uint8_t b[4 * 136];
    double want[4 * 256];
    float got[4 * 256];
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        const kv_type_info *t = kv_type_get_ref(types[ti]);
        int bad = 0;
        for (int rep = 0; rep < 200; rep++) {
            for (int k = 0; k < 4; k++) random_block(types[ti], b + k * t->size);
            for (int k = 0; k < 4; k++) ref_dequant(types[ti], b + k * t->size, want + 256 * k);
            t->to_float(b, got, 1024);
            for (int k = 0; k < 4; k++) {
                /* every term of a value is at most T; each f32 step rounds by 2^-24 of one */
                const uint8_t *bk = b + k * t->size;
                const double T = types[ti] == KV_TYPE_Q2_K   ? fabs(h2d(bk + 80)) * 45 + fabs(h2d(bk + 82)) * 15
                                 : types[ti] == KV_TYPE_Q3_K ? fabs(h2d(bk + 108)) * 128
                                                             : fabs(h2d(bk)) * 32 * 127;
                for (int i = 256 * k; i < 256 * k + 256; i++)
                    if (!(fabs(got[i] - want[i]) <= 4 * 0x1p-24 * T) && bad++ < 5)
                        fprintf(stderr, "  %s rep %d value %d: %.9g vs %.9g\n", t->name, rep, i, got[i], want[i]);
            }
        }
        if (bad) KVT_FAIL("%s: %d values differ from ggml's loops", t->name, bad);
        kvt_checks++;
    }
}

/* Quantize -> dequantize relative RMS error on Gaussian rows. */
static void test_roundtrip(void) {
    const struct { uint32_t t; double bound; } cases[] = {
        {KV_TYPE_Q2_K, 0.40}, {KV_TYPE_Q3_K, 0.22}, {KV_TYPE_IQ4_XS, 0.12}};
    const int64_t n = 256 * 16;
    float *x = malloc(4 * n), *y = malloc(4 * n);
    uint8_t *q = malloc(4 * n);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const kv_type_info *t = kv_type_get_ref(cases[c].t);
        fill_gauss(x, n, 0.05f);
        for (int64_t i = 0; i < n; i += 97) x[i] *= 6; /* outliers */
        t->from_float(x, q, n);
        t->to_float(q, y, n);
        double e = 0, s = 0;
        for (int64_t i = 0; i < n; i++) e += (double)(y[i] - x[i]) * (y[i] - x[i]), s += (double)x[i] * x[i];
        const double r = sqrt(e / s);
        printf("  %s: relative rms error %.4f (bound %.2f)\n", t->name, r, cases[c].bound);
        ASSERT_TRUE(r <= cases[c].bound);
        /* all zero rows quantize to blocks that decode to zero */
        memset(x, 0, 4 * 256);
        t->from_float(x, q, 256);
        t->to_float(q, y, 256);
        int nz = 0;
        for (int i = 0; i < 256; i++) nz += y[i] != 0;
        ASSERT_EQ(nz, 0);
    }
    free(x); free(y); free(q);
}

/* Operands: weights quantized (or random blocks), activations as Q8_K. */
static void make(uint32_t t, int64_t n, int random, float *xw, float *xa, uint8_t *w, uint8_t *a) {
    const kv_type_info *ti = kv_type_get_ref(t);
    fill_gauss(xw, n, 0.05f);
    fill_gauss(xa, n, 1.0f);
    for (int64_t i = 0; i < n; i += 61) xa[i] *= 8;
    if (random)
        for (int64_t b = 0; b < n / 256; b++) random_block(t, w + b * ti->size);
    else
        ti->from_float(xw, w, n);
    kv_type_get_ref(KV_TYPE_Q8_K)->from_float(xa, a, n);
}

/* Bound as test_quant.c: 8 lanes, n/256 fma steps each, on exact integer
 * sums, so |ref - f64| <= (n/8 + 8) 2^-23 sum |w a|. */
static void test_dot_ref(void) {
    const int64_t ns[] = {256, 512, 2048, 256 * 13};
    float *xw = malloc(4 * 4096), *xa = malloc(4 * 4096), *dw = malloc(4 * 4096), *da = malloc(4 * 4096);
    uint8_t *w = malloc(4 * 4096), *a = malloc(4 * 4096);
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        const kv_type_info *t = kv_type_get_ref(types[ti]), *ta = kv_type_get_ref(KV_TYPE_Q8_K);
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++)
            for (int random = 0; random < 2; random++) {
                const int64_t n = ns[k];
                make(types[ti], n, random, xw, xa, w, a);
                t->to_float(w, dw, n);
                ta->to_float(a, da, n);
                double exact = 0, mag = 0;
                for (int64_t i = 0; i < n; i++) exact += (double)dw[i] * da[i], mag += fabs((double)dw[i] * da[i]);
                float s;
                t->vec_dot(n, &s, w, a);
                const double bound = (n / 8.0 + 8) * 0x1p-23 * mag;
                if (!(fabs(s - exact) <= bound))
                    KVT_FAIL("%s n=%lld random=%d: dot %.9g vs f64 %.9g (bound %g)", t->name, (long long)n, random, s,
                             exact, bound);
                kvt_checks++;
                if (random) continue;
                double fx = 0, sq = 0; /* and it tracks the float dot of the unquantized data */
                for (int64_t i = 0; i < n; i++) fx += (double)xw[i] * xa[i], sq += ((double)xw[i] * xa[i]) * ((double)xw[i] * xa[i]);
                const double rel = types[ti] == KV_TYPE_Q2_K ? 0.40 : types[ti] == KV_TYPE_Q3_K ? 0.22 : 0.12;
                if (!(fabs(s - fx) <= 5 * rel * sqrt(sq) + 1e-3 * mag))
                    KVT_FAIL("%s n=%lld: dot %.6g far from float dot %.6g", t->name, (long long)n, s, fx);
                kvt_checks++;
            }
    }
    free(xw); free(xa); free(dw); free(da); free(w); free(a);
}

static const char *const backends[] = {"avx2", "avxvnni", "avx512", "neon", "neondot"};

static void test_backends(void) {
    const int64_t ns[] = {256, 512, 768, 2048, 256 * 13};
    float *xw = malloc(4 * 4096), *xa = malloc(4 * 4096), *f1 = malloc(4 * 4096), *f2 = malloc(4 * 4096);
    uint8_t *w = malloc(4 * 4096), *a = malloc(4 * 4096), *w2 = malloc(4 * 4096);
    int ran = 0;
    for (size_t b = 0; b < sizeof backends / sizeof backends[0]; b++) {
        if (kv_quant_set_backend(backends[b]) != 0) {
            printf("  backend %s: not available on this CPU\n", backends[b]);
            continue;
        }
        ran++;
        int bad_dot = 0, bad_q = 0, bad_deq = 0;
        for (size_t ti = 0; ti < N_TYPES; ti++) {
            const kv_type_info *r = kv_type_get_ref(types[ti]), *f = kv_type_get(types[ti]);
            ASSERT_TRUE(f->vec_dot != r->vec_dot); /* really another kernel */
            for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++)
                for (int rep = 0; rep < 6; rep++) {
                    const int64_t n = ns[k];
                    make(types[ti], n, rep >= 3, xw, xa, w, a);
                    if (rep == 1) {
                        for (int64_t i = 0; i < n; i += 3) xa[i] = 0;
                        kv_type_get_ref(KV_TYPE_Q8_K)->from_float(xa, a, n);
                    }
                    f->from_float(xw, w2, n);
                    r->from_float(xw, w2 + 2048, n);
                    if (memcmp(w2, w2 + 2048, kv_type_row_size(types[ti], (uint64_t)n))) bad_q++;
                    r->to_float(w, f1, n);
                    f->to_float(w, f2, n);
                    if (memcmp(f1, f2, 4 * (size_t)n)) bad_deq++;
                    float s1, s2;
                    r->vec_dot(n, &s1, w, a);
                    f->vec_dot(n, &s2, w, a);
                    if (f2u(s1) != f2u(s2)) {
                        if (bad_dot++ < 5)
                            fprintf(stderr, "  %s %s n=%lld rep %d: ref %.9g fast %.9g\n", backends[b], r->name,
                                    (long long)n, rep, s1, s2);
                    }
                }
        }
        printf("  backend %s: checked\n", backends[b]);
        ASSERT_EQ(bad_dot, 0);
        ASSERT_EQ(bad_q, 0);
        ASSERT_EQ(bad_deq, 0);
    }
    printf("  %d SIMD backends checked\n", ran);
    kv_quant_set_backend("scalar");
    free(xw); free(xa); free(f1); free(f2); free(w); free(a); free(w2);
}

/* kv_mat_rows (rows [1, 8) of 8 x 1, 3, 6 or 9 tokens: the one-token
 * streams with a leftover row, and token tiles split evenly) equals lone
 * vec_dots on every backend. */
static void test_mat_rows(void) {
    const char *bes[] = {"scalar", "avx2", "avxvnni", "avx512", "neon", "neondot"};
    enum { ROWS = 8, MAXT = 9 };
    const int64_t n = 512, rows = ROWS, tok_counts[] = {1, 3, 6, MAXT};
    float *x = malloc(4 * n * (ROWS > MAXT ? ROWS : MAXT));
    uint8_t *W = malloc(4 * n * rows), *A = malloc(4 * n * MAXT);
    fill_gauss(x, n * MAXT, 1.0f);
    const size_t ab = kv_type_row_size(KV_TYPE_Q8_K, n);
    for (int64_t t = 0; t < MAXT; t++) kv_type_get_ref(KV_TYPE_Q8_K)->from_float(x + t * n, A + t * ab, n);
    for (size_t b = 0; b < sizeof bes / sizeof bes[0]; b++) {
        if (kv_quant_set_backend(bes[b]) != 0) continue;
        for (size_t ti = 0; ti < N_TYPES; ti++) {
            const kv_type_info *f = kv_type_get(types[ti]);
            const size_t rb = kv_type_row_size(types[ti], n);
            fill_gauss(x, n * rows, 0.05f);
            for (int64_t r = 0; r < rows; r++) f->from_float(x + r * n, W + r * rb, n);
            for (size_t k = 0; k < sizeof tok_counts / sizeof tok_counts[0]; k++) {
                const int64_t toks = tok_counts[k];
                float Y[MAXT * ROWS], one;
                memset(Y, 0, sizeof Y);
                kv_mat_rows(types[ti], W, rb, n, 1, rows, A, ab, toks, Y, rows);
                int bad = 0;
                for (int64_t t = 0; t < toks; t++)
                    for (int64_t r = 1; r < rows; r++) {
                        f->vec_dot(n, &one, W + r * rb, A + t * ab);
                        bad += f2u(one) != f2u(Y[t * rows + r]);
                    }
                if (bad)
                    KVT_FAIL("%s %s, %d tokens: kv_mat_rows differs from vec_dot in %d outputs", bes[b], f->name,
                             (int)toks, bad);
                kvt_checks++;
            }
        }
    }
    kv_quant_set_backend("scalar");
    free(x); free(W); free(A);
}

static const kvt_case cases[] = {
    KVT_CASE(test_sizes), KVT_CASE(test_dequant_random), KVT_CASE(test_roundtrip),
    KVT_CASE(test_dot_ref), KVT_CASE(test_backends), KVT_CASE(test_mat_rows),
};

int main(int argc, char **argv) {
    printf("dispatched backend: %s\n", kv_quant_backend());
    return kvt_run(argc, argv, cases, KVT_N(cases));
}
