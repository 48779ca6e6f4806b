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


/* Q8_0 / Q4_0 against Q8_0, one 32-value block per ymm (8 canonical lanes,
 * one 4-value group each). vpdpbusd needs unsigned weights: q8 weights are
 * flipped to w + 128 (xor 0x80), q4 nibbles are already 0..15 (= w + 8); the
 * offset K * (sum of each 4 activations) is subtracted by starting the
 * integer accumulation from -K * groupsum. That start vector and the
 * activation scale as a float are per token and block: kv_mat_rows computes
 * them once per call (q80_prep) into a stack buffer, the lone vec_dot
 * inline; the integers are exact either way, so the bits agree.
 *
 * Per (row, block): one weight load + unpack, one fp16 scale broadcast, and
 * per token one vpdpbusd, one convert, one scale product, one fma. */

/* Per-token precomputed data: [nb] start vectors (32 B) then [nb] floats. */
#define KV_PRE_BYTES (64 * 1024)
#ifndef KV_Q80_PF
#define KV_Q80_PF 1
#endif
AI size_t q80_pre_stride(int64_t nb) { return ((size_t)nb * 36 + 63) & ~(size_t)63; }

AI void q80_prep(const kv_block_q8_0 *y, int64_t nb, char K, uint8_t *pre) {
    __m256i *ng = (__m256i *)(void *)pre;
    float *da = (float *)(void *)(pre + (size_t)nb * 32);
    const __m256i kk = _mm256_set1_epi8(K);
    for (int64_t b = 0; b < nb; b++) {
        __m256i yv = _mm256_loadu_si256((const __m256i *)y[b].qs);
        _mm256_store_si256(ng + b, _mm256_sub_epi32(_mm256_setzero_si256(),
                                                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), kk, yv)));
        da[b] = h2f(y[b].d);
    }
}

/* Q4_0 block -> 32 unsigned bytes 0..15 in element order. */
AI __m256i q4_0_u8(const kv_block_q4_0 *b) {
    __m128i v = _mm_loadu_si128((const __m128i *)b->qs);
    __m256i x = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    return _mm256_and_si256(x, _mm256_set1_epi8(0xF));
}

/* One block b of an RT x TT tile into accumulator set E (b & 1). */
#define Q80_STEP(WBLK, WQ4, b, E)                                                               \
    do {                                                                                        \
        __m256i yv[8], ng[8];                                                                   \
        __m256 da[8];                                                                           \
        UNROLL for (int t = 0; t < TT; t++) {                                                   \
            const kv_block_q8_0 *y = (const kv_block_q8_0 *)(a + t * ab) + (b);                 \
            yv[t] = _mm256_loadu_si256((const __m256i *)y->qs);                                 \
            if (pre) {                                                                          \
                const uint8_t *p_ = pre + t * ps;                                               \
                ng[t] = _mm256_load_si256((const __m256i *)(const void *)p_ + (b));             \
                da[t] = _mm256_broadcast_ss((const float *)(const void *)(p_ + nb * 32) + (b)); \
            } else {                                                                            \
                ng[t] = _mm256_sub_epi32(_mm256_setzero_si256(),                                \
                                         _mm256_dpbusd_epi32(_mm256_setzero_si256(), kk, yv[t])); \
                da[t] = _mm256_set1_ps(h2f(y->d));                                              \
            }                                                                                   \
        }                                                                                       \
        if (KV_Q80_PF && RT > 1) {                                                              \
            /* multi-row tiles: fetch the next tile's rows as one sequential run */             \
            const char *nx_ = (const char *)w + RT * rb + (b) * (RT * sizeof(WBLK));            \
            UNROLL for (int l_ = 0; l_ < (int)(RT * sizeof(WBLK) + 63) / 64; l_++)              \
                _mm_prefetch(nx_ + 64 * l_, _MM_HINT_T0);                                       \
        }                                                                                       \
        UNROLL for (int r = 0; r < RT; r++) {                                                   \
            const WBLK *x = (const WBLK *)(w + r * rb) + (b);                                   \
            __m256i wu;                                                                         \
            if (WQ4)                                                                            \
                wu = q4_0_u8((const kv_block_q4_0 *)(const void *)x);                           \
            else                                                                                \
                wu = _mm256_xor_si256(                                                          \
                    _mm256_loadu_si256((const __m256i *)((const kv_block_q8_0 *)(const void *)x)->qs), k80); \
            const __m256 dw = _mm256_cvtph_ps(_mm_set1_epi16((short)x->d));                     \
            UNROLL for (int t = 0; t < TT; t++) {                                               \
                __m256i p = _mm256_dpbusd_epi32(ng[t], wu, yv[t]);                              \
                acc[r][t][E] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, da[t]), acc[r][t][E]); \
            }                                                                                   \
        }                                                                                       \
    } while (0)

/* RT rows x TT tokens over nb blocks. pre: per-token data (stride ps) of
 * the TT tokens, or NULL to compute it inline. WQ4: weights are q4_0. */
#define Q80_TILE(NAME, WBLK, WQ4)                                                               \
    AI void NAME(int RT, int TT, int64_t nb, const uint8_t *w, size_t rb, const uint8_t *a,     \
                 size_t ab, const uint8_t *pre, size_t ps, float *out) {                        \
        __m256 acc[8][8][2];                                                                    \
        UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++) {               \
            acc[r][t][0] = _mm256_setzero_ps();                                                 \
            acc[r][t][1] = _mm256_setzero_ps();                                                 \
        }                                                                                       \
        const __m256i k80 = _mm256_set1_epi8((char)0x80);                                       \
        const __m256i kk = _mm256_set1_epi8(WQ4 ? 8 : (char)0x80);                              \
        (void)k80; (void)kk;                                                                    \
        int64_t b = 0;                                                                          \
        for (; b + 1 < nb; b += 2) {                                                            \
            Q80_STEP(WBLK, WQ4, b, 0);                                                          \
            Q80_STEP(WBLK, WQ4, b + 1, 1);                                                      \
        }                                                                                       \
        if (b < nb) Q80_STEP(WBLK, WQ4, b, 0);                                                  \
        UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++)                 \
            out[r * TT + t] = hsum_ps8(_mm256_add_ps(acc[r][t][0], acc[r][t][1]));              \
    }

Q80_TILE(q8_0_tile, kv_block_q8_0, 0)
Q80_TILE(q4_0_tile, kv_block_q4_0, 1)

/* Rows [r0,r1) x tokens [0,nt) with F(rt, tt, r, t, out) computing an
 * rt x tt tile at row r, token t: RT x TT tiles (RTD x 1 when there is a
 * single token), token leftovers as narrower tiles, row leftovers one by
 * one. Every output is one whole dot product whatever tile computes it. */
#define KV_TSTORE(RT_, TT_)                                                                    \
    for (int i = 0; i < (RT_); i++)                                                           \
        for (int j = 0; j < (TT_); j++) Y[(t + j) * y_stride + r + i] = o_[i * (TT_) + j]
#define KV_TILE_LOOP(F, RT, TT, RTD)                                                           \
    do {                                                                                      \
        float o_[64];                                                                         \
        int64_t r = r0;                                                                       \
        if (nt == 1)                                                                          \
            for (; r + (RTD) <= r1; r += (RTD)) {                                             \
                F(RTD, 1, r, 0, o_);                                                          \
                for (int i = 0; i < (RTD); i++) Y[r + i] = o_[i];                             \
            }                                                                                 \
        for (; r + (RT) <= r1; r += (RT)) {                                                   \
            int64_t t = 0;                                                                    \
            for (; t + (TT) <= nt; t += (TT)) {                                               \
                F(RT, TT, r, t, o_);                                                          \
                for (int i = 0; i < (RT); i++)                                                \
                    for (int j = 0; j < (TT); j++) Y[(t + j) * y_stride + r + i] = o_[i * (TT) + j]; \
            }                                                                                 \
            /* leftover tokens: tiles of 4, 3, 2, 1 */                                        \
            if ((TT) > 4 && nt - t >= 4) { F(RT, 4, r, t, o_); KV_TSTORE(RT, 4); t += 4; }    \
            if ((TT) > 3 && nt - t == 3) { F(RT, 3, r, t, o_); KV_TSTORE(RT, 3); t += 3; }    \
            if ((TT) > 2 && nt - t >= 2) { F(RT, 2, r, t, o_); KV_TSTORE(RT, 2); t += 2; }    \
            if ((TT) > 1 && nt - t == 1) { F(RT, 1, r, t, o_); KV_TSTORE(RT, 1); t += 1; }    \
        }                                                                                     \
        for (; r < r1; r++) {                                                                 \
            int64_t t = 0;                                                                    \
            for (; t + (TT) <= nt; t += (TT)) {                                               \
                F(1, TT, r, t, o_);                                                           \
                for (int j = 0; j < (TT); j++) Y[(t + j) * y_stride + r] = o_[j];             \
            }                                                                                 \
            for (; t < nt; t++) {                                                             \
                F(1, 1, r, t, o_);                                                            \
                Y[t * y_stride + r] = o_[0];                                                  \
            }                                                                                 \
        }                                                                                     \
    } while (0)

#define Q80_ENTRY(T, WQ4, RT, TT, RTD)                                                          \
    static void T##_dot(int64_t n, float *s, const void *w, const void *a) {                    \
        T##_tile(1, 1, n / 32, (const uint8_t *)w, 0, (const uint8_t *)a, 0, NULL, 0, s);       \
    }                                                                                           \
    static void T##_mat(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1,     \
                        const void *A, size_t a_stride, int64_t n_tok, float *Y0, size_t y_stride) { \
        _Static_assert((RT) * (TT) <= 32 && (RT) <= 8 && (TT) <= 8 && (RTD) <= 8, "tile");      \
        const int64_t nb = n / 32;                                                              \
        const size_t ps = q80_pre_stride(nb);                                                   \
        const int64_t tc = (int64_t)(KV_PRE_BYTES / ps);                                        \
        if (tc == 0) {                                                                          \
            kv_mat_generic(T##_dot, W, row_bytes, n, r0, r1, A, a_stride, n_tok, Y0, y_stride); \
            return;                                                                             \
        }                                                                                       \
        _Alignas(64) uint8_t pre[KV_PRE_BYTES];                                                 \
        const uint8_t *wb = (const uint8_t *)W;                                                 \
        for (int64_t t0 = 0; t0 < n_tok; t0 += tc) {                                            \
            const int64_t nt = n_tok - t0 < tc ? n_tok - t0 : tc;                               \
            const uint8_t *ab = (const uint8_t *)A + (size_t)t0 * a_stride;                     \
            float *Y = Y0 + (size_t)t0 * y_stride;                                              \
            for (int64_t t = 0; t < nt; t++)                                                    \
                q80_prep((const kv_block_q8_0 *)(const void *)(ab + (size_t)t * a_stride), nb,  \
                         WQ4 ? 8 : (char)0x80, pre + (size_t)t * ps);                           \
            _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wunused-value\"") \
            KV_TILE_LOOP(T##_TF, RT, TT, RTD);                                                  \
            _Pragma("GCC diagnostic pop")                                                       \
        }                                                                                       \
    }

#define q8_0_TF(rt, tt, r, t, o)                                                                \
    q8_0_tile(rt, tt, nb, wb + (size_t)(r) * row_bytes, row_bytes, ab + (size_t)(t) * a_stride, \
              a_stride, pre + (size_t)(t) * ps, ps, o)
#define q4_0_TF(rt, tt, r, t, o)                                                                \
    q4_0_tile(rt, tt, nb, wb + (size_t)(r) * row_bytes, row_bytes, ab + (size_t)(t) * a_stride, \
              a_stride, pre + (size_t)(t) * ps, ps, o)

#ifndef KV_Q80_RT
#define KV_Q80_RT 4
#endif
#ifndef KV_Q80_TT
#define KV_Q80_TT 3
#endif
#ifndef KV_Q80_RTD
#define KV_Q80_RTD 1
#endif
Q80_ENTRY(q8_0, 0, KV_Q80_RT, KV_Q80_TT, KV_Q80_RTD)
Q80_ENTRY(q4_0, 1, KV_Q80_RT, KV_Q80_TT, KV_Q80_RTD)

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

/* 16 int32 lanes -> 8: lane j + lane j+8 (the canonical K-quant lanes). */
AI __m256i fold_i32(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

#define K4_TILE512(NAME, WBLK, Q5)                                                              \
    AI void NAME(int RT, int TT, int64_t n, const uint8_t *w, size_t rb, const uint8_t *a,      \
                 size_t ab, float *out) {                                                       \
        __m256 acc[4][4], accm[4][4];                                                           \
        UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++) {               \
            acc[r][t] = _mm256_setzero_ps();                                                    \
            accm[r][t] = _mm256_setzero_ps();                                                   \
        }                                                                                       \
        const __m512i m4 = _mm512_set1_epi8(0xF);                                               \
        for (int64_t i = 0; i < n / KV_QK_K; i++) {                                             \
            __m512i isum[4][4], isum2[4][4], s16[4];                                            \
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
                UNROLL for (int t = 0; t < TT; t++) isum[r][t] = isum2[r][t] = _mm512_setzero_si512(); \
            }                                                                                   \
            UNROLL for (int c = 0; c < 4; c++) {                                                \
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
                    UNROLL for (int t = 0; t < TT; t++) {                                       \
                        /* small tiles: two dependency chains (integer sums, exact) */          \
                        if (RT * TT <= 2 && (c & 1))                                            \
                            isum2[r][t] = _mm512_dpwssd_epi32(isum2[r][t], _mm512_maddubs_epi16(q, yv[t]), sc); \
                        else                                                                    \
                            isum[r][t] = _mm512_dpwssd_epi32(isum[r][t], _mm512_maddubs_epi16(q, yv[t]), sc); \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            UNROLL for (int r = 0; r < RT; r++) {                                               \
                const WBLK *x = (const WBLK *)(w + r * rb) + i;                                 \
                float d = h2f(x->d), dmin = h2f(x->dmin);                                       \
                UNROLL for (int t = 0; t < TT; t++) {                                           \
                    const kv_block_q8_K *y = (const kv_block_q8_K *)(a + t * ab) + i;           \
                    __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);                 \
                    __m256i mp = _mm256_madd_epi16(bs, mdup[r]);                                \
                    if (RT * TT <= 2) isum[r][t] = _mm512_add_epi32(isum[r][t], isum2[r][t]);   \
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold_i32(isum[r][t])),       \
                                                _mm256_set1_ps(y->d * d), acc[r][t]);           \
                    accm[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mp),                        \
                                                 _mm256_set1_ps(y->d * dmin), accm[r][t]);      \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++)                 \
            out[r * TT + t] = hsum_ps8(_mm256_sub_ps(acc[r][t], accm[r][t]));                   \
    }

K4_TILE512(q4_K_tile, kv_block_q4_K, 0)
K4_TILE512(q5_K_tile, kv_block_q5_K, 1)

/* Q6_K: 64 values per step: quarters (0,1) then (2,3) of each half. */
AI void q6_K_tile(int RT, int TT, int64_t n, const uint8_t *w, size_t rb, const uint8_t *a,
                  size_t ab, float *out) {
    __m256 acc[4][4];
    UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++) acc[r][t] = _mm256_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0xF), m3 = _mm512_set1_epi8(3);
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        __m512i isum[4][4], isum2[4][4], sc16[4];
        UNROLL for (int r = 0; r < RT; r++) {
            const kv_block_q6_K *x = (const kv_block_q6_K *)(w + r * rb) + i;
            sc16[r] = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x->scales)));
            UNROLL for (int t = 0; t < TT; t++) isum[r][t] = isum2[r][t] = _mm512_setzero_si512();
        }
        UNROLL for (int h = 0; h < 2; h++) {
            UNROLL for (int kp = 0; kp < 2; kp++) {
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
                    UNROLL for (int t = 0; t < TT; t++) {
                        if (RT * TT <= 2 && kp)
                            isum2[r][t] = _mm512_dpwssd_epi32(isum2[r][t], _mm512_maddubs_epi16(q, yv[t]), sc);
                        else
                            isum[r][t] = _mm512_dpwssd_epi32(isum[r][t], _mm512_maddubs_epi16(q, yv[t]), sc);
                    }
                }
            }
        }
        if (RT * TT <= 2)
            UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++)
                isum[r][t] = _mm512_add_epi32(isum[r][t], isum2[r][t]);
        UNROLL for (int r = 0; r < RT; r++) {
            const kv_block_q6_K *x = (const kv_block_q6_K *)(w + r * rb) + i;
            __m256i sc = _mm512_castsi512_si256(sc16[r]);
            float d = h2f(x->d);
            UNROLL for (int t = 0; t < TT; t++) {
                const kv_block_q8_K *y = (const kv_block_q8_K *)(a + t * ab) + i;
                __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);
                __m256i mp = _mm256_madd_epi16(bs, sc);
                __m256i is = _mm256_sub_epi32(fold_i32(isum[r][t]), _mm256_slli_epi32(mp, 5));
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(y->d * d), acc[r][t]);
            }
        }
    }
    UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++) out[r * TT + t] = hsum_ps8(acc[r][t]);
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

#define q4_K_F(rt, tt, w, a, o) q4_K_tile(rt, tt, n, w, row_bytes, a, a_stride, o)
#define q5_K_F(rt, tt, w, a, o) q5_K_tile(rt, tt, n, w, row_bytes, a, a_stride, o)
#define q6_K_F(rt, tt, w, a, o) q6_K_tile(rt, tt, n, w, row_bytes, a, a_stride, o)

#ifndef KV_KQ_RT1
#define KV_KQ_RT1 1
#endif
ENTRY(q4_K, 4, 4, KV_KQ_RT1)
ENTRY(q5_K, 4, 4, KV_KQ_RT1)
ENTRY(q6_K, 4, 4, KV_KQ_RT1)

void kv_quant_fill_avx512(kv_kernels *k) {
    k[KV_TYPE_Q8_0].vec_dot = q8_0_dot;   k[KV_TYPE_Q8_0].mat = q8_0_mat;
    k[KV_TYPE_Q4_0].vec_dot = q4_0_dot;   k[KV_TYPE_Q4_0].mat = q4_0_mat;
    k[KV_TYPE_Q4_K].vec_dot = q4_K_dot;   k[KV_TYPE_Q4_K].mat = q4_K_mat;
    k[KV_TYPE_Q5_K].vec_dot = q5_K_dot;   k[KV_TYPE_Q5_K].mat = q5_K_mat;
    k[KV_TYPE_Q6_K].vec_dot = q6_K_dot;   k[KV_TYPE_Q6_K].mat = q6_K_mat;
}
