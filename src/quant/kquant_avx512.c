/* Q2_K, Q3_K and IQ4_XS against Q8_K with AVX-512 (F, BW, VL; installed
 * only after run-time detection). Two chunks of 32 values per zmm step:
 * int32 lanes 0..7 hold chunk c's canonical lanes, 8..15 chunk c+1's; the
 * two halves are added (exact integers) into the 8 canonical lanes before
 * the float steps, which are the reference's (kquant_ref.c), so the result
 * is bit-identical to it. vec_dot only; kv_mat_rows uses the generic tile. */
#include <immintrin.h>

#include "quant/legacy.h" /* kv_iq4nl_values */
#include "quant/quant_internal.h"

#define AI static inline __attribute__((always_inline))

AI float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

/* Lanes 0..7 + lanes 8..15: the 8 canonical int32 lanes. */
AI __m256i fold16(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

/* Words 2c..2c+3 of the 16 int16 scales s16, 8 copies each: the scales of
 * the four groups of 16 in chunks c and c+1. */
AI __m512i pick_quad(__m512i s16, int c) {
    const long long r = 0x0001000100010001ll; /* one per word */
    const __m512i grp = _mm512_set_epi64(3 * r, 3 * r, 2 * r, 2 * r, r, r, 0, 0);
    return _mm512_permutexvar_epi16(_mm512_add_epi16(grp, _mm512_set1_epi16((short)(2 * c))), s16);
}

/* The 32 bytes of q in both halves, shifted right by sh0 (low) and sh1
 * (high) bits per 16-bit word. */
AI __m512i two_shifts(__m256i q, int sh0, int sh1) {
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(q), q, 1);
    const __m512i cnt = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)sh0)),
                                           _mm256_set1_epi16((short)sh1), 1);
    return _mm512_srlv_epi16(z, cnt);
}

static void q2_K_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_q2_K *x = w;
    const kv_block_q8_K *y = a;
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0xF);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)x[i].scales);
        const __m512i s16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(sc8, m4)));
        const __m256i m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc8, 4), m4));
        __m512i isum = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(x[i].qs + 32 * h));
            for (int k = 0; k < 4; k += 2) {
                const int c = 4 * h + k;
                const __m512i u = _mm512_and_si512(two_shifts(q, 2 * k, 2 * k + 2), m3);
                const __m512i av = _mm512_loadu_si512((const void *)(y[i].qs + 32 * c));
                isum = _mm512_add_epi32(isum, _mm512_madd_epi16(_mm512_maddubs_epi16(u, av), pick_quad(s16, c)));
            }
        }
        const __m256i M = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y[i].bsums), m16);
        const float dd = y[i].d * kv_fp16_to_fp32(x[i].d), dm = y[i].d * kv_fp16_to_fp32(x[i].dmin);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold16(isum)), _mm256_set1_ps(dd), acc);
        accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), _mm256_set1_ps(dm), accm);
    }
    *s = hsum8(_mm256_sub_ps(acc, accm));
}

static void q3_K_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_q3_K *x = w;
    const kv_block_q8_K *y = a;
    const __m512i m3 = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        int8_t sc[16];
        kv_unpack_q3_scales(x[i].scales, sc);
        const __m256i s16y = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        const __m512i s16 = _mm512_castsi256_si512(s16y);
        const __m256i hm = _mm256_loadu_si256((const __m256i *)x[i].hmask);
        __m512i isum = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(x[i].qs + 32 * h));
            for (int k = 0; k < 4; k += 2) {
                const int c = 4 * h + k;
                const __m512i hb = _mm512_and_si512(two_shifts(hm, c, c + 1), one);
                const __m512i u = _mm512_or_si512(_mm512_and_si512(two_shifts(q, 2 * k, 2 * k + 2), m3),
                                                  _mm512_slli_epi16(hb, 2));
                const __m512i av = _mm512_loadu_si512((const void *)(y[i].qs + 32 * c));
                isum = _mm512_add_epi32(isum, _mm512_madd_epi16(_mm512_maddubs_epi16(u, av), pick_quad(s16, c)));
            }
        }
        const __m256i C = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y[i].bsums), s16y);
        const float dd = y[i].d * kv_fp16_to_fp32(x[i].d);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(fold16(isum), _mm256_slli_epi32(C, 2))),
                              _mm256_set1_ps(dd), acc);
    }
    *s = hsum8(acc);
}

static void iq4_xs_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_iq4_xs *x = w;
    const kv_block_q8_K *y = a;
    const __m512i tbl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)kv_iq4nl_values));
    const __m512i m4 = _mm512_set1_epi8(0xF), zero = _mm512_setzero_si512();
    /* per 128-bit lane: low nibbles, high nibbles, low, high */
    const __m512i cnt = _mm512_set_epi64(0x0004000400040004ll, 0x0004000400040004ll, 0, 0,
                                         0x0004000400040004ll, 0x0004000400040004ll, 0, 0);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        __m512i isum = _mm512_setzero_si512();
        for (int ib = 0; ib < 8; ib += 2) {
            const __m128i qa = _mm_loadu_si128((const __m128i *)(x[i].qs + 16 * ib));
            const __m128i qb = _mm_loadu_si128((const __m128i *)(x[i].qs + 16 * ib + 16));
            const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(qa, qa)),
                                                 _mm256_set_m128i(qb, qb), 1);
            const __m512i v = _mm512_shuffle_epi8(tbl, _mm512_and_si512(_mm512_srlv_epi16(z, cnt), m4));
            const __m512i av = _mm512_loadu_si512((const void *)(y[i].qs + 32 * ib));
            const __mmask64 neg = _mm512_movepi8_mask(v);
            const __m512i sa = _mm512_mask_sub_epi8(av, neg, zero, av); /* a with v's sign (v != 0) */
            const __m512i p = _mm512_maddubs_epi16(_mm512_abs_epi8(v), sa);
            const __m512i ls = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_set1_epi16((short)kv_iq4_xs_scale(&x[i], ib))),
                _mm256_set1_epi16((short)kv_iq4_xs_scale(&x[i], ib + 1)), 1);
            isum = _mm512_add_epi32(isum, _mm512_madd_epi16(p, ls));
        }
        const float dd = y[i].d * kv_fp16_to_fp32(x[i].d);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold16(isum)), _mm256_set1_ps(dd), acc);
    }
    *s = hsum8(acc);
}

void kv_kquant_fill_avx512(kv_kernels *k) {
    k[KV_TYPE_Q2_K].vec_dot = q2_K_dot;
    k[KV_TYPE_Q3_K].vec_dot = q3_K_dot;
    k[KV_TYPE_IQ4_XS].vec_dot = iq4_xs_dot;
}
