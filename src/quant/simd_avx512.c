/* AVX-512 (F/BW/VL/DQ/VNNI) kernels; only called after run-time detection.
 * Same canonical reduction order as the reference (quant_internal.h), so
 * results are bit-identical to it and to AVX2. Types not here (the float
 * types) inherit the AVX2 kernels.
 *
 * Q8_0 / Q4_0: one zmm holds two blocks, i.e. exactly the 16 canonical
 * lanes; vpdpbusd (u8 x s8, groups of 4) does the integer part: weights are
 * made unsigned (q8: w ^ 0x80 = w + 128; q4: nibbles 0..15) and the offset
 * is removed by starting the accumulation from -K * (sum of 4 activations),
 * computed once per token and reused across rows.
 * K-quants: vpmaddubsw then vpdpwssd with the sub-block scales, 64 values per
 * instruction; integer super-block sums as in the reference. */
#include <immintrin.h>

#include "quant/quant_internal.h"

/* Software prefetch distance (bytes ahead in each weight row): decode
 * streams several rows at once and the hardware prefetcher alone leaves
 * DRAM bandwidth unused. */
#define KV_PF_DIST 1024

#define AI static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 8")

AI float h2f(uint16_t h) { return _cvtsh_ss(h); }

AI float hsum_ps8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AI __m512i ld2x256(const void *lo, const void *hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)lo)),
                              _mm256_loadu_si256((const __m256i *)hi), 1);
}
AI __m512 set2(float lo, float hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(lo)), _mm256_set1_ps(hi), 1);
}

/* Q4_0 block -> 32 unsigned bytes 0..15 in element order. */
AI __m256i q4_0_u8(const kv_block_q4_0 *b) {
    __m128i v = _mm_loadu_si128((const __m128i *)b->qs);
    __m256i x = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    return _mm256_and_si256(x, _mm256_set1_epi8(0xF));
}

/* Q4: WQ4 = 1. K = offset removed from the unsigned weights. */
#define Q80_TILE512(NAME, WBLK, WQ4)                                                            \
    AI void NAME(int RT, int TT, int64_t n, const uint8_t *w, size_t rb, const uint8_t *a,      \
                 size_t ab, float *out) {                                                       \
        __m512 acc[4][4];                                                                       \
        UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++) acc[r][t] =     \
            _mm512_setzero_ps();                                                                \
        const __m512i koff = _mm512_set1_epi8(WQ4 ? 8 : (char)0x80);                            \
        const int64_t nb = n / 32;                                                              \
        for (int64_t b = 0; b < nb; b += 2) {                                                   \
            const int two = b + 1 < nb;                                                         \
            __m512i yv[4], ng[4];                                                               \
            __m512 da[4];                                                                       \
            UNROLL for (int t = 0; t < TT; t++) {                                               \
                const kv_block_q8_0 *y = (const kv_block_q8_0 *)(a + t * ab) + b;               \
                if (two) {                                                                      \
                    yv[t] = ld2x256(y[0].qs, y[1].qs);                                          \
                    da[t] = set2(h2f(y[0].d), h2f(y[1].d));                                     \
                } else {                                                                        \
                    yv[t] = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)y[0].qs)); \
                    yv[t] = _mm512_inserti64x4(yv[t], _mm256_setzero_si256(), 1);               \
                    da[t] = set2(h2f(y[0].d), 0.0f);                                            \
                }                                                                               \
                ng[t] = _mm512_sub_epi32(_mm512_setzero_si512(),                                \
                                         _mm512_dpbusd_epi32(_mm512_setzero_si512(), koff, yv[t])); \
            }                                                                                   \
            UNROLL for (int r = 0; r < RT; r++) {                                               \
                const WBLK *x = (const WBLK *)(w + r * rb) + b;                                 \
                __m512i wu;                                                                     \
                __m512 dw;                                                                      \
                if (WQ4) {                                                                      \
                    const kv_block_q4_0 *x4 = (const kv_block_q4_0 *)(const void *)x;           \
                    __m256i w0 = q4_0_u8(x4), w1 = two ? q4_0_u8(x4 + 1) : _mm256_setzero_si256(); \
                    wu = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);                 \
                } else {                                                                        \
                    const kv_block_q8_0 *x8 = (const kv_block_q8_0 *)(const void *)x;           \
                    __m256i w0 = _mm256_loadu_si256((const __m256i *)x8[0].qs);                 \
                    __m256i w1 = two ? _mm256_loadu_si256((const __m256i *)x8[1].qs) : _mm256_set1_epi8((char)0x80); \
                    wu = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1), koff); \
                }                                                                               \
                dw = set2(h2f(x[0].d), two ? h2f(x[1].d) : 0.0f);                               \
                _mm_prefetch((const char *)x + KV_PF_DIST, _MM_HINT_T0);                        \
                UNROLL for (int t = 0; t < TT; t++) {                                           \
                    __m512i p = _mm512_dpbusd_epi32(ng[t], wu, yv[t]);                          \
                    acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, da[t]), acc[r][t]); \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++) {               \
            __m256 f = _mm256_add_ps(_mm512_castps512_ps256(acc[r][t]),                          \
                                     _mm512_extractf32x8_ps(acc[r][t], 1));                     \
            out[r * TT + t] = hsum_ps8(f);                                                      \
        }                                                                                       \
    }

Q80_TILE512(q8_0_tile, kv_block_q8_0, 0)
Q80_TILE512(q4_0_tile, kv_block_q4_0, 1)

/* 8 scales and 8 mins of a q4_K/q5_K block as bytes, branch-free. */
AI void k4_scales(const uint8_t *q, uint32_t sc[2], uint32_t mn[2]) {
    uint32_t w0, w1, w2;
    memcpy(&w0, q, 4);
    memcpy(&w1, q + 4, 4);
    memcpy(&w2, q + 8, 4);
    sc[0] = w0 & 0x3f3f3f3fu;
    mn[0] = w1 & 0x3f3f3f3fu;
    sc[1] = (w2 & 0x0f0f0f0fu) | (((w0 >> 6) & 0x03030303u) << 4);
    mn[1] = ((w2 >> 4) & 0x0f0f0f0fu) | (((w1 >> 6) & 0x03030303u) << 4);
}

AI int32_t hsum_i32_512(__m512i v) { return _mm512_reduce_add_epi32(v); }

#define K4_TILE512(NAME, WBLK, Q5)                                                              \
    AI void NAME(int RT, int TT, int64_t n, const uint8_t *w, size_t rb, const uint8_t *a,      \
                 size_t ab, float *out) {                                                       \
        float acc[4][4] = {{0}}, accm[4][4] = {{0}};                                            \
        const __m512i m4 = _mm512_set1_epi8(0xF);                                               \
        for (int64_t i = 0; i < n / KV_QK_K; i++) {                                             \
            __m512i isum[4][4], s16[4];                                                         \
            __m256i mdup[4];                                                                    \
            UNROLL for (int r = 0; r < RT; r++) {                                               \
                const WBLK *x = (const WBLK *)(w + r * rb) + i;                                 \
                uint32_t sc[2], mn[2];                                                          \
                k4_scales(x->scales, sc, mn);                                                   \
                __m128i s8 = _mm_set_epi32(0, 0, (int)sc[1], (int)sc[0]);                       \
                __m128i m8 = _mm_set_epi32(0, 0, (int)mn[1], (int)mn[0]);                       \
                /* s16: 8 scales as int16, repeated in all four 128-bit lanes */                \
                s16[r] = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(s8));                         \
                mdup[r] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));                      \
                UNROLL for (int t = 0; t < TT; t++) isum[r][t] = _mm512_setzero_si512();        \
            }                                                                                   \
            for (int c = 0; c < 4; c++) {                                                       \
                __m512i yv[4];                                                                  \
                UNROLL for (int t = 0; t < TT; t++)                                             \
                    yv[t] = _mm512_loadu_si512((const void *)(((const kv_block_q8_K *)(a + t * ab) + i)->qs + 64 * c)); \
                /* int16 lanes 0-15 take scale 2c, lanes 16-31 scale 2c+1 */                    \
                const __m512i pick = _mm512_inserti64x4(                                        \
                    _mm512_castsi256_si512(_mm256_set1_epi16((short)(0x0100 * (4 * c + 1) + 4 * c))), \
                    _mm256_set1_epi16((short)(0x0100 * (4 * c + 3) + 4 * c + 2)), 1);           \
                UNROLL for (int r = 0; r < RT; r++) {                                           \
                    const WBLK *x = (const WBLK *)(w + r * rb) + i;                             \
                    __m256i qv = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * c));         \
                    _mm_prefetch((const char *)x->qs + 32 * c + KV_PF_DIST, _MM_HINT_T0);       \
                    __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(qv), _mm256_srli_epi16(qv, 4), 1); \
                    q = _mm512_and_si512(q, m4);                                                \
                    if (Q5) {                                                                   \
                        __m256i qh = _mm256_loadu_si256((const __m256i *)((const kv_block_q5_K *)(const void *)x)->qh); \
                        __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(qh, 2 * c)), \
                                                       _mm256_srli_epi16(qh, 2 * c + 1), 1);    \
                        h = _mm512_and_si512(h, _mm512_set1_epi8(1));                           \
                        q = _mm512_or_si512(q, _mm512_slli_epi16(h, 4));                        \
                    }                                                                           \
                    __m512i sc = _mm512_shuffle_epi8(s16[r], pick);                             \
                    UNROLL for (int t = 0; t < TT; t++)                                         \
                        isum[r][t] = _mm512_dpwssd_epi32(isum[r][t], _mm512_maddubs_epi16(q, yv[t]), sc); \
                }                                                                               \
            }                                                                                   \
            UNROLL for (int r = 0; r < RT; r++) {                                               \
                const WBLK *x = (const WBLK *)(w + r * rb) + i;                                 \
                float d = h2f(x->d), dmin = h2f(x->dmin);                                       \
                UNROLL for (int t = 0; t < TT; t++) {                                           \
                    const kv_block_q8_K *y = (const kv_block_q8_K *)(a + t * ab) + i;           \
                    __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);                 \
                    __m256i mp = _mm256_madd_epi16(bs, mdup[r]);                                \
                    __m128i m2 = _mm_add_epi32(_mm256_castsi256_si128(mp), _mm256_extracti128_si256(mp, 1)); \
                    m2 = _mm_add_epi32(m2, _mm_shuffle_epi32(m2, 0x4e));                        \
                    m2 = _mm_add_epi32(m2, _mm_shuffle_epi32(m2, 0xb1));                        \
                    int32_t ms = _mm_cvtsi128_si32(m2);                                         \
                    int32_t is = hsum_i32_512(isum[r][t]);                                      \
                    acc[r][t] = fmaf(y->d * d, (float)is, acc[r][t]);                           \
                    accm[r][t] = fmaf(y->d * dmin, (float)ms, accm[r][t]);                      \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        for (int r = 0; r < RT; r++)                                                            \
            for (int t = 0; t < TT; t++) out[r * TT + t] = acc[r][t] - accm[r][t];              \
    }

K4_TILE512(q4_K_tile, kv_block_q4_K, 0)
K4_TILE512(q5_K_tile, kv_block_q5_K, 1)

/* Q6_K: 64 values per step: quarters (0,1) then (2,3) of each half. */
AI void q6_K_tile(int RT, int TT, int64_t n, const uint8_t *w, size_t rb, const uint8_t *a,
                  size_t ab, float *out) {
    float acc[4][4] = {{0}};
    const __m512i m4 = _mm512_set1_epi8(0xF), m3 = _mm512_set1_epi8(3);
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        __m512i isum[4][4], sc16[4];
        UNROLL for (int r = 0; r < RT; r++) {
            const kv_block_q6_K *x = (const kv_block_q6_K *)(w + r * rb) + i;
            sc16[r] = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x->scales)));
            UNROLL for (int t = 0; t < TT; t++) isum[r][t] = _mm512_setzero_si512();
        }
        for (int h = 0; h < 2; h++) {
            for (int kp = 0; kp < 2; kp++) {
                /* values 128h + 64kp .. +63; int16 lane j uses scale 8h + 4kp + j/8 */
                static const int16_t lane_grp[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                     2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
                const __m512i idx = _mm512_add_epi16(_mm512_set1_epi16((short)(8 * h + 4 * kp)),
                                                     _mm512_loadu_si512((const void *)lane_grp));
                __m512i yv[4];
                UNROLL for (int t = 0; t < TT; t++)
                    yv[t] = _mm512_loadu_si512((const void *)(((const kv_block_q8_K *)(a + t * ab) + i)->qs + 128 * h + 64 * kp));
                UNROLL for (int r = 0; r < RT; r++) {
                    const kv_block_q6_K *x = (const kv_block_q6_K *)(w + r * rb) + i;
                    __m512i ql = _mm512_loadu_si512((const void *)(x->ql + 64 * h));
                    __m256i qh = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * h));
                    __m512i lo = kp ? _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4) : _mm512_and_si512(ql, m4);
                    __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(qh, 4 * kp)),
                                                    _mm256_srli_epi16(qh, 4 * kp + 2), 1);
                    hb = _mm512_and_si512(hb, m3);
                    __m512i q = _mm512_or_si512(lo, _mm512_slli_epi16(hb, 4));
                    __m512i sc = _mm512_permutexvar_epi16(idx, sc16[r]);
                    UNROLL for (int t = 0; t < TT; t++)
                        isum[r][t] = _mm512_dpwssd_epi32(isum[r][t], _mm512_maddubs_epi16(q, yv[t]), sc);
                }
            }
        }
        UNROLL for (int r = 0; r < RT; r++) {
            const kv_block_q6_K *x = (const kv_block_q6_K *)(w + r * rb) + i;
            __m256i sc = _mm512_castsi512_si256(sc16[r]);
            float d = h2f(x->d);
            UNROLL for (int t = 0; t < TT; t++) {
                const kv_block_q8_K *y = (const kv_block_q8_K *)(a + t * ab) + i;
                __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);
                __m256i mp = _mm256_madd_epi16(bs, sc);
                __m128i m2 = _mm_add_epi32(_mm256_castsi256_si128(mp), _mm256_extracti128_si256(mp, 1));
                m2 = _mm_add_epi32(m2, _mm_shuffle_epi32(m2, 0x4e));
                m2 = _mm_add_epi32(m2, _mm_shuffle_epi32(m2, 0xb1));
                int32_t is = hsum_i32_512(isum[r][t]) - 32 * _mm_cvtsi128_si32(m2);
                acc[r][t] = fmaf(y->d * d, (float)is, acc[r][t]);
            }
        }
    }
    for (int r = 0; r < RT; r++)
        for (int t = 0; t < TT; t++) out[r * TT + t] = acc[r][t];
}

/* Same tiling driver as the AVX2 file. */
#define KV_MAT_DRIVER(F, RT, TT, RT1)                                                         \
    do {                                                                                      \
        const uint8_t *wb = (const uint8_t *)W, *ab = (const uint8_t *)A;                     \
        float o[16];                                                                          \
        int64_t r = r0;                                                                       \
        if (n_tok < (TT)) {                                                                   \
            for (; r + (RT1) <= r1; r += (RT1))                                               \
                for (int64_t t = 0; t < n_tok; t++) {                                         \
                    F(RT1, 1, wb + r * row_bytes, ab + t * a_stride, o);                      \
                    for (int i = 0; i < (RT1); i++) Y[t * y_stride + r + i] = o[i];           \
                }                                                                             \
        }                                                                                     \
        for (; r + (RT) <= r1; r += (RT)) {                                                   \
            int64_t t = 0;                                                                    \
            for (; t + (TT) <= n_tok; t += (TT)) {                                            \
                F(RT, TT, wb + r * row_bytes, ab + t * a_stride, o);                          \
                for (int i = 0; i < (RT); i++)                                                \
                    for (int j = 0; j < (TT); j++) Y[(t + j) * y_stride + r + i] = o[i * (TT) + j]; \
            }                                                                                 \
            for (; t < n_tok; t++) {                                                          \
                F(RT, 1, wb + r * row_bytes, ab + t * a_stride, o);                           \
                for (int i = 0; i < (RT); i++) Y[t * y_stride + r + i] = o[i];                \
            }                                                                                 \
        }                                                                                     \
        for (; r < r1; r++) {                                                                 \
            int64_t t = 0;                                                                    \
            for (; t + (TT) <= n_tok; t += (TT)) {                                            \
                F(1, TT, wb + r * row_bytes, ab + t * a_stride, o);                           \
                for (int j = 0; j < (TT); j++) Y[(t + j) * y_stride + r] = o[j];              \
            }                                                                                 \
            for (; t < n_tok; t++) {                                                          \
                F(1, 1, wb + r * row_bytes, ab + t * a_stride, o);                            \
                Y[t * y_stride + r] = o[0];                                                   \
            }                                                                                 \
        }                                                                                     \
    } while (0)

#define ENTRY(T, RT, TT, RT1)                                                                   \
    static void T##_dot(int64_t n, float *s, const void *w, const void *a) {                    \
        T##_tile(1, 1, n, (const uint8_t *)w, 0, (const uint8_t *)a, 0, s);                     \
    }                                                                                           \
    static void T##_mat(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1,     \
                        const void *A, size_t a_stride, int64_t n_tok, float *Y, size_t y_stride) { \
        _Static_assert((RT) * (TT) <= 16 && (RT) <= 4 && (TT) <= 4 && (RT1) <= 4, "tile");       \
        KV_MAT_DRIVER(T##_F, RT, TT, RT1);                                                      \
    }

#define q8_0_F(rt, tt, w, a, o) q8_0_tile(rt, tt, n, w, row_bytes, a, a_stride, o)
#define q4_0_F(rt, tt, w, a, o) q4_0_tile(rt, tt, n, w, row_bytes, a, a_stride, o)
#define q4_K_F(rt, tt, w, a, o) q4_K_tile(rt, tt, n, w, row_bytes, a, a_stride, o)
#define q5_K_F(rt, tt, w, a, o) q5_K_tile(rt, tt, n, w, row_bytes, a, a_stride, o)
#define q6_K_F(rt, tt, w, a, o) q6_K_tile(rt, tt, n, w, row_bytes, a, a_stride, o)

ENTRY(q8_0, 4, 4, 4)
ENTRY(q4_0, 4, 4, 4)
ENTRY(q4_K, 4, 4, 4)
ENTRY(q5_K, 4, 4, 4)
ENTRY(q6_K, 4, 4, 4)

void kv_quant_fill_avx512(kv_kernels *k) {
    k[KV_TYPE_Q8_0].vec_dot = q8_0_dot;   k[KV_TYPE_Q8_0].mat = q8_0_mat;
    k[KV_TYPE_Q4_0].vec_dot = q4_0_dot;   k[KV_TYPE_Q4_0].mat = q4_0_mat;
    k[KV_TYPE_Q4_K].vec_dot = q4_K_dot;   k[KV_TYPE_Q4_K].mat = q4_K_mat;
    k[KV_TYPE_Q5_K].vec_dot = q5_K_dot;   k[KV_TYPE_Q5_K].mat = q5_K_mat;
    k[KV_TYPE_Q6_K].vec_dot = q6_K_dot;   k[KV_TYPE_Q6_K].mat = q6_K_mat;
}
