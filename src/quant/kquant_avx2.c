/* Q2_K, Q3_K and IQ4_XS against Q8_K with AVX2 (compiled with -mavx2 -mfma
 * -mf16c -mbmi2; installed only after run-time detection). Bit-identical to
 * kquant_ref.c: per super-block, each chunk of 32 values is one
 * maddubs + madd step whose 8 int32 lanes hold lane j = values 4j..4j+3 of
 * the chunk, i.e. the canonical lane (p / 4) % 8 of quant_internal.h; the
 * integers are exact, and the float steps (one conversion, one fma per
 * lane and super-block, kv_hsum8's tree) are the reference's.
 *
 * Hot path: vec_dot of one row; kv_mat_rows walks (row, token) pairs with
 * it (the generic tile), so a tiled product is the same arithmetic. */
#include <immintrin.h>

#include "quant/legacy.h" /* kv_iq4nl_values */
#include "quant/quant_internal.h"

#define AI static inline __attribute__((always_inline))

/* kv_hsum8's tree: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)). */
AI float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

/* 16 int16 scales s (words 0..15) -> words 2c in the low 128-bit lane and
 * 2c+1 in the high one, 8 copies each: the scales of chunk c's two groups. */
AI __m256i pick_pair(__m256i s16, int c) {
    const __m256i dw = _mm256_permutevar8x32_epi32(s16, _mm256_set1_epi32(c));
    const __m256i idx = _mm256_set_epi8(3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2,
                                        1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
    return _mm256_shuffle_epi8(dw, idx);
}

static void q2_K_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_q2_K *x = w;
    const kv_block_q8_K *y = a;
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0xF);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)x[i].scales);
        const __m256i s16 = _mm256_cvtepu8_epi16(_mm_and_si128(sc8, m4));
        const __m256i m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc8, 4), m4));
        __m256i isum = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(x[i].qs + 32 * h));
            for (int k = 0; k < 4; k++) {
                const int c = 4 * h + k;
                const __m256i u = _mm256_and_si256(_mm256_srli_epi16(q, 2 * k), m3);
                const __m256i av = _mm256_loadu_si256((const __m256i *)(y[i].qs + 32 * c));
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(u, av), pick_pair(s16, c)));
            }
        }
        const __m256i M = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y[i].bsums), m16);
        const float dd = y[i].d * kv_fp16_to_fp32(x[i].d), dm = y[i].d * kv_fp16_to_fp32(x[i].dmin);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dd), acc);
        accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), _mm256_set1_ps(dm), accm);
    }
    *s = hsum8(_mm256_sub_ps(acc, accm));
}

static void q3_K_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_q3_K *x = w;
    const kv_block_q8_K *y = a;
    const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        int8_t sc[16];
        kv_unpack_q3_scales(x[i].scales, sc);
        const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        const __m256i hm = _mm256_loadu_si256((const __m256i *)x[i].hmask);
        __m256i isum = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(x[i].qs + 32 * h));
            for (int k = 0; k < 4; k++) {
                const int c = 4 * h + k;
                const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, c), one);
                const __m256i u = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * k), m3),
                                                  _mm256_slli_epi16(hb, 2));
                const __m256i av = _mm256_loadu_si256((const __m256i *)(y[i].qs + 32 * c));
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(u, av), pick_pair(s16, c)));
            }
        }
        const __m256i C = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y[i].bsums), s16);
        const float dd = y[i].d * kv_fp16_to_fp32(x[i].d);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum, _mm256_slli_epi32(C, 2))),
                              _mm256_set1_ps(dd), acc);
    }
    *s = hsum8(acc);
}

static void iq4_xs_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_iq4_xs *x = w;
    const kv_block_q8_K *y = a;
    const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kv_iq4nl_values));
    const __m128i m4 = _mm_set1_epi8(0xF);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        __m256i isum = _mm256_setzero_si256();
        for (int ib = 0; ib < 8; ib++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(x[i].qs + 16 * ib));
            const __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
            const __m256i v = _mm256_shuffle_epi8(tbl, idx);
            const __m256i av = _mm256_loadu_si256((const __m256i *)(y[i].qs + 32 * ib));
            /* |v| * (a with v's sign): pair sums <= 2 * 127 * 127, no saturation */
            const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(av, v));
            const __m256i ls = _mm256_set1_epi16((short)kv_iq4_xs_scale(&x[i], ib));
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, ls));
        }
        const float dd = y[i].d * kv_fp16_to_fp32(x[i].d);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dd), acc);
    }
    *s = hsum8(acc);
}

void kv_kquant_fill_avx2(kv_kernels *k) {
    k[KV_TYPE_Q2_K].vec_dot = q2_K_dot;
    k[KV_TYPE_Q3_K].vec_dot = q3_K_dot;
    k[KV_TYPE_IQ4_XS].vec_dot = iq4_xs_dot;
    k[KV_TYPE_Q2_K].mat = k[KV_TYPE_Q3_K].mat = k[KV_TYPE_IQ4_XS].mat = NULL; /* the generic tile */
}
