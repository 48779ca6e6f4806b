/* AVX-512 (F/BW/VL/DQ/VNNI) kernels; only called after run-time detection.
 * Same canonical reduction order as the reference (quant_internal.h), so
 * results are bit-identical to it and to AVX2. Types not here (F16, BF16
 * types) inherit the AVX2 kernels.
 *
 * Q8_0: four outputs' 4 canonical lanes per zmm (four tokens, or four
 * rows for one token). Q4_0: one block per ymm (its 8 canonical lanes per
 * block parity). vpdpbusd (u8 x s8, groups of 4) does the integer part:
 * weights are made unsigned (q8: w ^ 0x80 = w + 128; q4: nibbles 0..15)
 * and the offset is removed by starting the accumulation from -K * (the
 * activations' sum), computed once per token and reused across rows.
 * K-quants: vpmaddubsw then vpdpwssd with the sub-block scales, 64 values per
 * instruction; integer super-block sums as in the reference. */
#include <immintrin.h>

#include "quant/quant_internal.h"

#define AI static inline __attribute__((always_inline))
#ifndef KV_PF_TILES
#define KV_PF_TILES 8 /* K-quant tiles: prefetch the row tile this many tiles ahead (1 -> 8: decode +10-25%) */
#endif
/* One-token K-quant rows are taken from this many far-apart parts of the row
 * range in turn (row i of each part, then row i + 1), so memory sees that
 * many sequential streams; each row is still one whole dot product. From
 * memory on a 2.2 GHz Sapphire Rapids-class Xeon, 1 thread: Q4_K 82-84% ->
 * 90-93% of the read probe, Q6_K 83-84% -> 90% (with one-row tiles). */
#ifndef KV_K_STREAMS
#define KV_K_STREAMS 2
#endif
#define UNROLL _Pragma("GCC unroll 8")

AI float h2f(uint16_t h) { return _cvtsh_ss(h); }

AI float hsum_ps8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}


/* Q4_0 against Q8_0, one 32-value block per ymm (8 canonical lanes, one
 * 4-value group each). vpdpbusd needs unsigned weights: the q4 nibbles are
 * already 0..15 (= w + 8); the
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
#define Q80_STEP(WBLK, b, E)                                                               \
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
            const __m256i wu = q4_0_u8((const kv_block_q4_0 *)(const void *)x);                 \
            const __m256 dw = _mm256_cvtph_ps(_mm_set1_epi16((short)x->d));                     \
            UNROLL for (int t = 0; t < TT; t++) {                                               \
                __m256i p = _mm256_dpbusd_epi32(ng[t], wu, yv[t]);                              \
                acc[r][t][E] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, da[t]), acc[r][t][E]); \
            }                                                                                   \
        }                                                                                       \
    } while (0)

/* RT rows x TT tokens over nb blocks. pre: per-token data (stride ps) of
 * the TT tokens, or NULL to compute it inline. */
#define Q80_TILE(NAME, WBLK)                                                               \
    AI void NAME(int RT, int TT, int64_t nb, const uint8_t *w, size_t rb, const uint8_t *a,     \
                 size_t ab, const uint8_t *pre, size_t ps, float *out) {                        \
        __m256 acc[8][8][2];                                                                    \
        UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++) {               \
            acc[r][t][0] = _mm256_setzero_ps();                                                 \
            acc[r][t][1] = _mm256_setzero_ps();                                                 \
        }                                                                                       \
        const __m256i kk = _mm256_set1_epi8(8);                                                 \
        (void)kk;                                                                               \
        int64_t b = 0;                                                                          \
        for (; b + 1 < nb; b += 2) {                                                            \
            Q80_STEP(WBLK, b, 0);                                                          \
            Q80_STEP(WBLK, b + 1, 1);                                                      \
        }                                                                                       \
        if (b < nb) Q80_STEP(WBLK, b, 0);                                                  \
        UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++)                 \
            out[r * TT + t] = hsum_ps8(_mm256_add_ps(acc[r][t][0], acc[r][t][1]));              \
    }

Q80_TILE(q4_0_tile, kv_block_q4_0)

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

#define Q80_ENTRY(T, RT, TT, RTD)                                                          \
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
                         8, pre + (size_t)t * ps);                                              \
            _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wunused-value\"") \
            KV_TILE_LOOP(T##_TF, RT, TT, RTD);                                                  \
            _Pragma("GCC diagnostic pop")                                                       \
        }                                                                                       \
    }

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
Q80_ENTRY(q4_0, KV_Q80_RT, KV_Q80_TT, KV_Q80_RTD)

/* 16 int32 lanes -> 8: lane j + lane j+8 (the canonical K-quant lanes). */
AI __m256i fold_i32(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

#define KT_R 4
#define KT_T 8

/* Q4_K / Q5_K against Q8_K. One zmm of weights is 64 bytes of qs, i.e. two
 * 32-value chunks; its low nibbles are values 128k+0..31 and 128k+64..95 of
 * the super-block (k = 0, 1), its high nibbles 128k+32..63 and 128k+96..127.
 * The activations are read in that order: kv_mat_rows copies them once per
 * call into a stack buffer (k4_prep), the lone vec_dot assembles them from
 * two halves. vpmaddubsw + vpdpwssd (with the sub-block scales) leave int32
 * lane l (0..15) holding the 4-value group l % 8 of one sub-block, so lane
 * l + lane l+8 (fold_i32) is the canonical lane j = l; the integer sums are
 * exact whatever the order, so the bits agree with the reference.
 *
 * Per (row, super-block): 2 weight loads, 3 unpack ops, the scale/min
 * unpacking (vector), 4 scale shuffles, and the products d*da, dmin*da for
 * all tokens of the tile in one multiply each; per (row, token,
 * super-block): 4 vpdpbusd (unsigned nibbles x signed activations, the
 * unscaled 4-value sums, which fit int16), the low/high-nibble sums paired
 * into one int16 pair per lane (shift + blend) and 2 vpdpwssd with the
 * (scale_lo, scale_hi) pairs: 6 multiply-pipe ops instead of the 8 of
 * vpmaddubsw + vpdpwssd (KV_K4_DPB=0 keeps that older path; ~10% faster
 * on Zen 4, where they share one 512-bit multiply pipe), then the
 * canonical float steps with the
 * products broadcast from memory and (float)M formed as m * pair sum.
 * Tiles are 2 rows x up to 8 tokens: experts see few tokens each. */

/* Prepared activations of a chunk of nt tokens (kv_mat_rows builds them
 * once per call in a stack buffer). Per super-block, ss bytes:
 * [nt][256] the quants reordered as above, [nt][8] float pair sums
 * bsums[2j] + bsums[2j+1] (exact), [nt + 8] float d (zero-padded), so
 * the tokens of a tile sit at fixed offsets and their d load as a vector. */
typedef struct {
    const uint8_t *q;  /* quants of the tile's first token, super-block 0 */
    const float *b;    /* pair sums of the first token, super-block 0 */
    const float *d;    /* d of the first token, super-block 0 */
    size_t ss;         /* bytes per super-block */
} k4_pre;

AI size_t k4_pre_ss(int64_t nt) { return ((size_t)nt * 292 + 32 + 63) & ~(size_t)63; }

/* Token t (of nt) into the chunk buffer at pre. */
AI void k4_prep(const kv_block_q8_K *y, int64_t nsb, uint8_t *pre, int64_t t, int64_t nt) {
    const size_t ss = k4_pre_ss(nt);
    for (int64_t i = 0; i < nsb; i++) {
        const int8_t *q = y[i].qs;
        uint8_t *base = pre + (size_t)i * ss;
        __m256i *o = (__m256i *)(void *)(base + (size_t)t * 256);
        UNROLL for (int k = 0; k < 2; k++) {
            _mm256_store_si256(o + 4 * k + 0, _mm256_loadu_si256((const __m256i *)(q + 128 * k)));
            _mm256_store_si256(o + 4 * k + 1, _mm256_loadu_si256((const __m256i *)(q + 128 * k + 64)));
            _mm256_store_si256(o + 4 * k + 2, _mm256_loadu_si256((const __m256i *)(q + 128 * k + 32)));
            _mm256_store_si256(o + 4 * k + 3, _mm256_loadu_si256((const __m256i *)(q + 128 * k + 96)));
        }
        const __m256i bp = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y[i].bsums), _mm256_set1_epi16(1));
        _mm256_storeu_ps((float *)(void *)(base + (size_t)nt * 256 + (size_t)t * 32), _mm256_cvtepi32_ps(bp));
        float *d = (float *)(void *)(base + (size_t)nt * 288);
        d[t] = y[i].d;
        if (t == nt - 1)
            for (int j = 0; j < 8; j++) d[nt + j] = 0.0f;
    }
}

/* Activation part p (0: low nibbles of k = 0, 1: high, 2, 3: k = 1) of
 * super-block i of token t: prepared (P) or assembled from the block at
 * a + t * ab (P NULL: the lone vec_dot). */
AI __m512i k4_act(const k4_pre *P, const uint8_t *a, size_t ab, int64_t i, int t, int p) {
    if (P) return _mm512_load_si512((const void *)(P->q + (size_t)i * P->ss + 256 * t + 64 * p));
    const int8_t *q = ((const kv_block_q8_K *)(a + t * ab) + i)->qs + 128 * (p >> 1) + 32 * (p & 1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)q)),
                              _mm256_loadu_si256((const __m256i *)(q + 64)), 1);
}

/* The 8 scales (bytes 0-7) and 8 mins (bytes 8-15) of a q4_K/q5_K block,
 * as kv_scale_min_k4 gives them, with 128-bit ops. q: the 12 scale bytes,
 * followed by at least 4 more bytes of the block. */
AI __m128i k4_scales_v(const uint8_t *q) {
    const __m128i v = _mm_loadu_si128((const __m128i *)q);              /* w0 w1 w2 . */
    const __m128i p = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));    /* w0 w2 w1 w2 */
    const __m128i h = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));    /* w0 w0 w1 w1 */
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(p, _mm_setr_epi32(0, 0, 0, 4)),
                                     _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(h, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(lo, hi);
}

/* vpshufb indices that widen scale byte s to int16 (index 0x80 zeroes the
 * high byte) over the int16 lanes of part p (of the broadcast scale
 * bytes): lanes 0-15 take sub-block 4k + (p & 1), lanes 16-31 sub-block
 * 4k + 2 + (p & 1). */
AI __m512i k4_pick(int p) {
    const int s0 = 4 * (p >> 1) + (p & 1), s1 = s0 + 2;
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)(0x8000 | s0))),
                              _mm256_set1_epi16((short)(0x8000 | s1)), 1);
}
/* vpshufb indices for the vpdpbusd path: int16 lanes alternate the scale
 * of the low-nibble part and the high-nibble part of chunk pair k: int32
 * lanes 0-7 take (sc 4k, sc 4k+1), lanes 8-15 (sc 4k+2, sc 4k+3). */
AI __m512i k4_pair_pick(int k) {
    const uint32_t s0 = 4u * (uint32_t)k; /* unsigned: the top index byte sets bit 31 */
    const uint32_t lo = (0x80u << 8 | s0) | (0x80u << 8 | (s0 + 1)) << 16;
    const uint32_t hi = (0x80u << 8 | (s0 + 2)) | (0x80u << 8 | (s0 + 3)) << 16;
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32((int)lo)),
                              _mm256_set1_epi32((int)hi), 1);
}
#ifndef KV_K4_DPB
#define KV_K4_DPB 1
#endif
/* Indices that make int16 (m0, m0, m1, m1, ..., m7, m7) for vpmaddwd with
 * the bsums, from the scale/min bytes in both 128-bit lanes. */
AI __m256i k4_mpick(void) {
    return _mm256_setr_epi8(8, -128, 8, -128, 9, -128, 9, -128, 10, -128, 10, -128, 11, -128, 11, -128,
                            12, -128, 12, -128, 13, -128, 13, -128, 14, -128, 14, -128, 15, -128, 15, -128);
}

/* Q5_K: bit selectors of part p in qh (both 256-bit halves hold qh):
 * chunk c's low values use bit 2c, its high values bit 2c+1. */
AI __m512i k5_bits(int p) {
    const int c0 = 2 * (p >> 1), b0 = 2 * c0 + (p & 1), b1 = b0 + 2;
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi8((char)(1 << b0))),
                              _mm256_set1_epi8((char)(1 << b1)), 1);
}

/* Number of independent int32 chains per (row, token): tiles with few
 * products get more so the vpdpwssd latency stays hidden. */
#define K_NCH(RT, TT) ((RT) * (TT) == 1 ? 4 : (RT) * (TT) == 2 ? 2 : 1)

/* One q4_K super-block of one row against one prepared token: its int32
 * lane sums (16 lanes, not yet folded), from the scale bytes s16
 * broadcast to every 128-bit lane. The tile's vpdpbusd path, its two
 * vpdpwssd in one chain (integer sums: any order gives the same). */
AI __m512i k4_one_sums(const kv_block_q4_K *x, const uint8_t *yq, __m512i s16) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    __m512i is = _mm512_setzero_si512();
    UNROLL for (int k = 0; k < 2; k++) {
        const __m512i qv = _mm512_loadu_si512((const void *)(x->qs + 64 * k));
        const __m512i y0 = _mm512_load_si512((const void *)(yq + 128 * k));
        const __m512i y1 = _mm512_load_si512((const void *)(yq + 128 * k + 64));
        const __m512i xl = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(qv, m4), y0);
        /* the high nibbles in place (16 q): 16 x the 4-value sum, exact in
         * int32; << 12 puts the sum itself in the high int16, as << 16 of the
         * shifted nibbles' sum would, one shift fewer */
        const __m512i xh = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_andnot_si512(m4, qv), y1);
        const __m512i c2 = _mm512_mask_blend_epi16(0xAAAAAAAAu, xl, _mm512_slli_epi32(xh, 12));
        is = _mm512_dpwssd_epi32(is, c2, _mm512_shuffle_epi8(s16, k4_pair_pick(k)));
    }
    return is;
}

/* q4_K, one row x one prepared token (decode): two super-blocks per step,
 * so the scale/min decode, the folds, the conversions and the scale
 * products run once for both in 256- or 512-bit registers (~36 vector ops
 * a super-block instead of ~46); the float steps are the tile's, super-block
 * by super-block in order (fma into acc / accm, i then i + 1), so the same
 * bits. An odd last super-block takes the same steps alone. */
AI void q4_K_one(int64_t nsb, const uint8_t *w, size_t rb, const k4_pre *P, int pf, float *out) {
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    const size_t fs = P->ss / 4; /* floats per prepared super-block */
    const __m512i pdi = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i pmi = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3);
    int64_t i = 0;
    for (; i + 2 <= nsb; i += 2) {
        if (pf) { /* the next row (the next tile), spread over the super-blocks */
            const char *nx = (const char *)w + KV_PF_TILES * rb + i * (int64_t)sizeof(kv_block_q4_K);
            UNROLL for (int l = 0; l < (int)(2 * sizeof(kv_block_q4_K) + 63) / 64; l++) _mm_prefetch(nx + 64 * l, _MM_HINT_T0);
        }
        const kv_block_q4_K *x0 = (const kv_block_q4_K *)(const void *)w + i, *x1 = x0 + 1;
        /* k4_scales_v of both blocks in one ymm (block i low, i + 1 high) */
        const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)x0->scales)),
                                                  _mm_loadu_si128((const __m128i *)x1->scales), 1);
        const __m256i pv = _mm256_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)), hv = _mm256_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));
        const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(pv, _mm256_setr_epi32(0, 0, 0, 4, 0, 0, 0, 4)),
                                            _mm256_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f,
                                                              0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(hv, 2), _mm256_setr_epi32(0, 0x30303030, 0, 0x30303030,
                                                                                         0, 0x30303030, 0, 0x30303030));
        const __m256i sm = _mm256_or_si256(lo, hi);
        const __m512i smz = _mm512_castsi256_si512(sm);
        const uint8_t *yq = P->q + (size_t)i * P->ss;
        const __m512i is0 = k4_one_sums(x0, yq, _mm512_shuffle_i32x4(smz, smz, 0x00));
        const __m512i is1 = k4_one_sums(x1, yq + P->ss, _mm512_shuffle_i32x4(smz, smz, 0x55));
        /* fold_i32 of both (lane j + lane j+8), one convert */
        const __m512 lf = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_shuffle_i64x2(is0, is1, 0x44),
                                                              _mm512_shuffle_i64x2(is0, is1, 0xEE)));
        /* [d0, dmin0, d1, dmin1] * [da0, da0, da1, da1]: the tile's rounded products */
        uint32_t d0, d1;
        memcpy(&d0, &x0->d, 4);
        memcpy(&d1, &x1->d, 4);
        const float da0 = P->d[(size_t)i * fs], da1 = P->d[(size_t)(i + 1) * fs];
        const __m128 p4 = _mm_mul_ps(_mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128((int)d0), (int)d1, 1)),
                                     _mm_setr_ps(da0, da0, da1, da1));
        const __m512 p4z = _mm512_castps128_ps512(p4);
        const __m512 pd = _mm512_permutexvar_ps(pdi, p4z), pm = _mm512_permutexvar_ps(pmi, p4z);
        /* (float)M exactly: m * pair sum, both blocks at once */
        const __m512 mf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(_mm256_permute4x64_epi64(sm, 0xD))));
        const __m512 bp = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(P->b + (size_t)i * fs)),
                                             _mm256_loadu_ps(P->b + (size_t)(i + 1) * fs), 1);
        const __m512 mm = _mm512_mul_ps(mf, bp);
        acc = _mm256_fmadd_ps(_mm512_castps512_ps256(lf), _mm512_castps512_ps256(pd), acc);
        accm = _mm256_fmadd_ps(_mm512_castps512_ps256(mm), _mm512_castps512_ps256(pm), accm);
        acc = _mm256_fmadd_ps(_mm512_extractf32x8_ps(lf, 1), _mm512_extractf32x8_ps(pd, 1), acc);
        accm = _mm256_fmadd_ps(_mm512_extractf32x8_ps(mm, 1), _mm512_extractf32x8_ps(pm, 1), accm);
    }
    if (i < nsb) {
        if (pf) {
            const char *nx = (const char *)w + KV_PF_TILES * rb + i * (int64_t)sizeof(kv_block_q4_K);
            UNROLL for (int l = 0; l < (int)(sizeof(kv_block_q4_K) + 63) / 64; l++) _mm_prefetch(nx + 64 * l, _MM_HINT_T0);
        }
        const kv_block_q4_K *x = (const kv_block_q4_K *)(const void *)w + i;
        const __m128i sm = k4_scales_v(x->scales);
        const __m512i is = k4_one_sums(x, P->q + (size_t)i * P->ss, _mm512_broadcast_i32x4(sm));
        uint32_t dp;
        memcpy(&dp, &x->d, 4);
        const __m128 p = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)dp)), _mm_set1_ps(P->d[(size_t)i * fs]));
        const __m256 pd = _mm256_broadcastss_ps(p), pm = _mm256_permutexvar_ps(_mm256_set1_epi32(1), _mm256_castps128_ps256(p));
        const __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold_i32(is)), pd, acc);
        accm = _mm256_fmadd_ps(_mm256_mul_ps(mf, _mm256_loadu_ps(P->b + (size_t)i * fs)), pm, accm);
    }
    *out = hsum_ps8(_mm256_sub_ps(acc, accm));
}

/* RT rows x TT tokens over nsb super-blocks. P: the first token's
 * prepared activations, or NULL (the block at a). pf: prefetch the next RT rows (the next
 * tile) as one sequential run, spread over the super-blocks. */
#define K4_TILE512(NAME, WBLK, Q5)                                                              \
    AI void NAME(const int RT, const int TT, int64_t nsb, const uint8_t *w, size_t rb,          \
                 const uint8_t *a, size_t ab, const k4_pre *P, int pf, float *out) {            \
        /* callers pass P as a constant NULL or a local's address: both specialize */           \
        if (RT == 1 && TT == 1 && P && !(Q5)) { /* decode: the two-super-block loop */          \
            q4_K_one(nsb, w, rb, P, pf, out);                                                   \
            return;                                                                             \
        }                                                                                       \
        /* with P, tokens 2u and 2u+1 share a zmm (acc2, accm2: the first one's 8 \
         * lanes low, the second one's high); an odd last token and the lone   \
         * vec_dot use the ymm accumulators */                                  \
        __m256 acc[KT_R][KT_T], accm[KT_R][KT_T];                                               \
        __m512 acc2[KT_R][KT_T / 2], accm2[KT_R][KT_T / 2];                                     \
        const int TP = P ? TT / 2 : 0;                                                          \
        UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++) {               \
            acc[r][t] = _mm256_setzero_ps();                                                    \
            accm[r][t] = _mm256_setzero_ps();                                                   \
            if (t < TP) acc2[r][t] = accm2[r][t] = _mm512_setzero_ps();                         \
        }                                                                                       \
        const __m512i m4 = _mm512_set1_epi8(0xF);                                               \
        for (int64_t i = 0; i < nsb; i++) {                                                     \
            if (pf) {                                                                           \
                const char *nx_ = (const char *)w + KV_PF_TILES * RT * rb + i * (int64_t)(RT * sizeof(WBLK)); \
                UNROLL for (int l_ = 0; l_ < (int)(RT * sizeof(WBLK) + 63) / 64; l_++)          \
                    _mm_prefetch(nx_ + 64 * l_, _MM_HINT_T0);                                   \
            }                                                                                   \
            __m512i isum[4][KT_R][KT_T], s16[KT_R];                                             \
            __m256i mdup[KT_R];                                                                 \
            __m256 dr[KT_R], dmr[KT_R], mf[KT_R];                                               \
            /* with P: the products d*da, dmin*da of each row and token */                      \
            float pd[KT_R][8], pm[KT_R][8];                                                     \
            __m512 pdz[KT_R], pmz[KT_R], mf2[KT_R];                                             \
            UNROLL for (int r = 0; r < RT; r++) {                                               \
                const WBLK *x = (const WBLK *)(w + r * rb) + i;                                 \
                const __m128i sm = k4_scales_v(x->scales);                                      \
                s16[r] = _mm512_broadcast_i32x4(sm);                                            \
                uint32_t dp_; /* d and dmin, adjacent fp16: one conversion */                   \
                memcpy(&dp_, &x->d, 4);                                                         \
                const __m256 ddm_ = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128((int)dp_))); \
                dr[r] = _mm256_broadcastss_ps(_mm256_castps256_ps128(ddm_));                    \
                dmr[r] = _mm256_permutexvar_ps(_mm256_set1_epi32(1), ddm_);                     \
                if (P && TT == 1) { /* [d * da, dmin * da] broadcast: no trip through memory */ \
                    const __m256 p_ = _mm256_mul_ps(ddm_, _mm256_broadcast_ss(P->d + (size_t)i * P->ss / 4)); \
                    pdz[r] = _mm512_castps256_ps512(_mm256_broadcastss_ps(_mm256_castps256_ps128(p_))); \
                    pmz[r] = _mm512_castps256_ps512(_mm256_permutexvar_ps(_mm256_set1_epi32(1), p_)); \
                    mf[r] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));    \
                } else if (P) {                                                                 \
                    const __m256 dav = _mm256_loadu_ps(P->d + (size_t)i * P->ss / 4);           \
                    const __m256 pdv = _mm256_mul_ps(dr[r], dav), pmv = _mm256_mul_ps(dmr[r], dav); \
                    _mm256_storeu_ps(pd[r], pdv);                                               \
                    _mm256_storeu_ps(pm[r], pmv);                                               \
                    pdz[r] = _mm512_castps256_ps512(pdv);                                       \
                    pmz[r] = _mm512_castps256_ps512(pmv);                                       \
                    mf[r] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));    \
                    mf2[r] = _mm512_insertf32x8(_mm512_castps256_ps512(mf[r]), mf[r], 1);       \
                } else {                                                                        \
                    mdup[r] = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(sm), k4_mpick()); \
                }                                                                               \
                UNROLL for (int t = 0; t < TT; t++)                                             \
                    isum[0][r][t] = isum[1][r][t] = isum[2][r][t] = isum[3][r][t] =             \
                        _mm512_setzero_si512();                                                 \
            }                                                                                   \
            UNROLL for (int k = 0; k < 2; k++) {                                                \
                __m512i q[KT_R][2], sc[KT_R][2];                                                \
                UNROLL for (int r = 0; r < RT; r++) {                                           \
                    const WBLK *x = (const WBLK *)(w + r * rb) + i;                             \
                    const __m512i qv = _mm512_loadu_si512((const void *)(x->qs + 64 * k));      \
                    q[r][0] = _mm512_and_si512(qv, m4);                                         \
                    q[r][1] = _mm512_and_si512(_mm512_srli_epi16(qv, 4), m4);                   \
                    if (Q5) {                                                                   \
                        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(           \
                            (const __m256i *)((const kv_block_q5_K *)(const void *)x)->qh));    \
                        UNROLL for (int h = 0; h < 2; h++)                                      \
                            q[r][h] = _mm512_mask_add_epi8(                                     \
                                q[r][h], _mm512_test_epi8_mask(qh, k5_bits(2 * k + h)), q[r][h], \
                                _mm512_set1_epi8(16));                                          \
                    }                                                                           \
                    if (KV_K4_DPB) {                                                            \
                        sc[r][0] = _mm512_shuffle_epi8(s16[r], k4_pair_pick(k));                \
                    } else {                                                                    \
                        sc[r][0] = _mm512_shuffle_epi8(s16[r], k4_pick(2 * k));                 \
                        sc[r][1] = _mm512_shuffle_epi8(s16[r], k4_pick(2 * k + 1));             \
                    }                                                                           \
                }                                                                               \
                if (KV_K4_DPB) {                                                                \
                    /* vpdpbusd per part (unscaled 4-value sums, |.| <= 7620: int16), low     \
                     * part's sums in the low int16 and high part's in the high int16 of     \
                     * each lane, then one vpdpwssd with the (sc_lo, sc_hi) pairs */          \
                    UNROLL for (int t = 0; t < TT; t++) {                                       \
                        const int c_ = K_NCH(RT, TT) == 4 ? 2 * k : K_NCH(RT, TT) == 2 ? k : 0; \
                        const __m512i y0 = k4_act(P, a, ab, i, t, 2 * k);                       \
                        const __m512i y1 = k4_act(P, a, ab, i, t, 2 * k + 1);                   \
                        UNROLL for (int r = 0; r < RT; r++) {                                   \
                            const __m512i xl = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[r][0], y0); \
                            const __m512i xh = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[r][1], y1); \
                            const __m512i c2 = _mm512_mask_blend_epi16(0xAAAAAAAAu, xl, _mm512_slli_epi32(xh, 16)); \
                            isum[c_][r][t] = _mm512_dpwssd_epi32(isum[c_][r][t], c2, sc[r][0]); \
                        }                                                                       \
                    }                                                                           \
                } else                                                                          \
                UNROLL for (int t = 0; t < TT; t++) UNROLL for (int h = 0; h < 2; h++) {        \
                    const int p = 2 * k + h;                                                    \
                    const int c_ = K_NCH(RT, TT) == 4 ? p : K_NCH(RT, TT) == 2 ? h : 0;         \
                    const __m512i yv = k4_act(P, a, ab, i, t, p);                               \
                    UNROLL for (int r = 0; r < RT; r++)                                         \
                        isum[c_][r][t] = _mm512_dpwssd_epi32(isum[c_][r][t],                   \
                                                             _mm512_maddubs_epi16(q[r][h], yv), sc[r][h]); \
                }                                                                               \
            }                                                                                   \
            /* pairs: fold both tokens' 16 lanes to 8 at once, one convert and     \
             * the same per-lane fma steps as the ymm code below (same bits) */     \
            UNROLL for (int u = 0; u < TP; u++) {                                               \
                const __m512 bp2 = _mm512_loadu_ps(P->b + (size_t)i * P->ss / 4 + 16 * u);      \
                const __m512i sel = _mm512_setr_epi32(2 * u, 2 * u, 2 * u, 2 * u, 2 * u, 2 * u, \
                    2 * u, 2 * u, 2 * u + 1, 2 * u + 1, 2 * u + 1, 2 * u + 1, 2 * u + 1,       \
                    2 * u + 1, 2 * u + 1, 2 * u + 1);                                           \
                UNROLL for (int r = 0; r < RT; r++) {                                           \
                    __m512i i0 = isum[0][r][2 * u], i1 = isum[0][r][2 * u + 1];                 \
                    if (K_NCH(RT, TT) >= 2) {                                                   \
                        i0 = _mm512_add_epi32(i0, isum[1][r][2 * u]);                           \
                        i1 = _mm512_add_epi32(i1, isum[1][r][2 * u + 1]);                       \
                    }                                                                           \
                    const __m512i f = _mm512_add_epi32(_mm512_shuffle_i64x2(i0, i1, 0x44),      \
                                                       _mm512_shuffle_i64x2(i0, i1, 0xEE));     \
                    acc2[r][u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(f), _mm512_permutexvar_ps(sel, pdz[r]), \
                                                 acc2[r][u]);                                   \
                    accm2[r][u] = _mm512_fmadd_ps(_mm512_mul_ps(mf2[r], bp2),                   \
                                                  _mm512_permutexvar_ps(sel, pmz[r]), accm2[r][u]); \
                }                                                                               \
            }                                                                                   \
            UNROLL for (int t = 2 * TP; t < TT; t++) {                                          \
                __m256 da, bp;                                                                  \
                __m256i bs;                                                                     \
                if (P) {                                                                        \
                    bp = _mm256_loadu_ps(P->b + (size_t)i * P->ss / 4 + 8 * t);                 \
                } else {                                                                        \
                    const kv_block_q8_K *y = (const kv_block_q8_K *)(a + t * ab) + i;           \
                    da = _mm256_broadcast_ss(&y->d);                                            \
                    bs = _mm256_loadu_si256((const __m256i *)y->bsums);                         \
                }                                                                               \
                UNROLL for (int r = 0; r < RT; r++) {                                           \
                    __m512i is = isum[0][r][t];                                                 \
                    if (K_NCH(RT, TT) >= 2) is = _mm512_add_epi32(is, isum[1][r][t]);           \
                    if (K_NCH(RT, TT) == 4)                                                     \
                        is = _mm512_add_epi32(is, _mm512_add_epi32(isum[2][r][t], isum[3][r][t])); \
                    const __m256 lf = _mm256_cvtepi32_ps(fold_i32(is));                         \
                    /* (float)M exactly: m * pair sum (both small integers) */                  \
                    if (P && TT == 1) {                                                         \
                        acc[r][t] = _mm256_fmadd_ps(lf, _mm512_castps512_ps256(pdz[r]), acc[r][t]); \
                        accm[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(mf[r], bp),                  \
                                                     _mm512_castps512_ps256(pmz[r]), accm[r][t]); \
                    } else if (P) {                                                             \
                        acc[r][t] = _mm256_fmadd_ps(lf, _mm256_broadcast_ss(&pd[r][t]), acc[r][t]); \
                        accm[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(mf[r], bp),                  \
                                                     _mm256_broadcast_ss(&pm[r][t]), accm[r][t]); \
                    } else {                                                                    \
                        const __m256i mp = _mm256_madd_epi16(bs, mdup[r]);                      \
                        acc[r][t] = _mm256_fmadd_ps(lf, _mm256_mul_ps(dr[r], da), acc[r][t]);   \
                        accm[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mp), _mm256_mul_ps(dmr[r], da), \
                                                     accm[r][t]);                               \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        UNROLL for (int r = 0; r < RT; r++) UNROLL for (int u = 0; u < TP; u++) {               \
            acc[r][2 * u] = _mm512_castps512_ps256(acc2[r][u]);                                 \
            acc[r][2 * u + 1] = _mm512_extractf32x8_ps(acc2[r][u], 1);                          \
            accm[r][2 * u] = _mm512_castps512_ps256(accm2[r][u]);                               \
            accm[r][2 * u + 1] = _mm512_extractf32x8_ps(accm2[r][u], 1);                        \
        }                                                                                       \
        UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++)                 \
            out[r * TT + t] = hsum_ps8(_mm256_sub_ps(acc[r][t], accm[r][t]));                   \
    }

K4_TILE512(q4_K_tile, kv_block_q4_K, 0)
K4_TILE512(q5_K_tile, kv_block_q5_K, 1)

/* Q6_K: 64 values per step: quarters (0,1) then (2,3) of each half. */
AI void q6_K_tile(const int RT, const int TT, int64_t nsb, const uint8_t *w, size_t rb,
                  const uint8_t *a, size_t ab, int pf, float *out) {
    /* tokens 2u, 2u+1 share a zmm accumulator (acc2: the first one's 8 lanes
     * low); an odd last token uses the ymm ones */
    __m256 acc[KT_R][KT_T];
    __m512 acc2[KT_R][KT_T / 2];
    const int TP = TT / 2;
    UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++) {
        acc[r][t] = _mm256_setzero_ps();
        if (t < TP) acc2[r][t] = _mm512_setzero_ps();
    }
    const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
    for (int64_t i = 0; i < nsb; i++) {
        if (pf) {
            const char *nx = (const char *)w + KV_PF_TILES * RT * rb + i * (int64_t)(RT * sizeof(kv_block_q6_K));
            UNROLL for (int l = 0; l < (int)(RT * sizeof(kv_block_q6_K) + 63) / 64; l++)
                _mm_prefetch(nx + 64 * l, _MM_HINT_T0);
        }
        __m512i isum[KT_R][KT_T], isum2[KT_R][KT_T], sc16[KT_R];
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
                    /* the two high bits of each value shifted to bits 4-5 (16-bit shifts
                     * move bits across bytes only outside 4-5), then lo | (hs & 0x30) */
                    __m512i hs = _mm512_inserti64x4(_mm512_castsi256_si512(kp ? qh : _mm256_slli_epi16(qh, 4)),
                                                    kp ? _mm256_srli_epi16(qh, 2) : _mm256_slli_epi16(qh, 2), 1);
                    __m512i q = _mm512_ternarylogic_epi32(lo, hs, m30, 0xF8);
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
        /* pairs: both tokens' scale sums, fold, convert and fma at once (the
         * same per-lane steps as below, so the same bits) */
        __m512i bs2[KT_T / 2];
        __m512 da2[KT_T / 2];
        UNROLL for (int u = 0; u < TP; u++) {
            const kv_block_q8_K *y0 = (const kv_block_q8_K *)(a + 2 * u * ab) + i;
            const kv_block_q8_K *y1 = (const kv_block_q8_K *)(a + (2 * u + 1) * ab) + i;
            bs2[u] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)y0->bsums)),
                                        _mm256_loadu_si256((const __m256i *)y1->bsums), 1);
            da2[u] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(y0->d)), _mm256_set1_ps(y1->d), 1);
        }
        UNROLL for (int r = 0; r < RT; r++) {
            const kv_block_q6_K *x = (const kv_block_q6_K *)(w + r * rb) + i;
            __m256i sc = _mm512_castsi512_si256(sc16[r]);
            float d = h2f(x->d);
            if (TP) {
                const __m512i sc2 = _mm512_inserti64x4(_mm512_castsi256_si512(sc), sc, 1);
                const __m512 d2 = _mm512_set1_ps(d);
                UNROLL for (int u = 0; u < TP; u++) {
                    const __m512i i0 = isum[r][2 * u], i1 = isum[r][2 * u + 1];
                    const __m512i f = _mm512_add_epi32(_mm512_shuffle_i64x2(i0, i1, 0x44),
                                                       _mm512_shuffle_i64x2(i0, i1, 0xEE));
                    const __m512i mp = _mm512_madd_epi16(bs2[u], sc2);
                    const __m512i is = _mm512_sub_epi32(f, _mm512_slli_epi32(mp, 5));
                    acc2[r][u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(da2[u], d2), acc2[r][u]);
                }
            }
            UNROLL for (int t = 2 * TP; t < TT; t++) {
                const kv_block_q8_K *y = (const kv_block_q8_K *)(a + t * ab) + i;
                __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);
                __m256i mp = _mm256_madd_epi16(bs, sc);
                __m256i is = _mm256_sub_epi32(fold_i32(isum[r][t]), _mm256_slli_epi32(mp, 5));
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(y->d * d), acc[r][t]);
            }
        }
    }
    UNROLL for (int r = 0; r < RT; r++) UNROLL for (int u = 0; u < TP; u++) {
        acc[r][2 * u] = _mm512_castps512_ps256(acc2[r][u]);
        acc[r][2 * u + 1] = _mm512_extractf32x8_ps(acc2[r][u], 1);
    }
    UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++) out[r * TT + t] = hsum_ps8(acc[r][t]);
}

/* K-quant tiling: rows [r0,r1) x tokens [0,nt) with F(rt, tt, r, t, pf, o)
 * computing an rt x tt tile at row r, token t (pf: also prefetch the next
 * rt rows). RT-row tiles (RTD-row tiles for a single token; with RTD 1,
 * rows from KV_K_STREAMS parts of the range in turn), the tokens of each
 * row tile split into the fewest tiles of at most TT, as even as possible
 * (9 tokens: 5 + 4, not 8 + 1); leftover rows one by one. Every output is
 * one whole dot product whatever tile computes it. */
#define K_CASE(F, RT_, TT, c)                                                                 \
    case c:                                                                                   \
        if ((c) <= (TT)) {                                                                    \
            F(RT_, c, r, t, j_ == 0, o_);                                                     \
            KV_TSTORE(RT_, c);                                                                \
        }                                                                                     \
        break
#define K_TOKENS(F, RT_, TT)                                                                  \
    do {                                                                                      \
        const int64_t nj_ = (nt + (TT) - 1) / (TT);                                           \
        int64_t t = 0;                                                                        \
        for (int64_t j_ = 0; j_ < nj_; j_++) {                                                \
            const int64_t left_ = nj_ - j_, tt_ = (nt - t + left_ - 1) / left_;               \
            switch (tt_) {                                                                    \
                K_CASE(F, RT_, TT, 1); K_CASE(F, RT_, TT, 2); K_CASE(F, RT_, TT, 3);          \
                K_CASE(F, RT_, TT, 4); K_CASE(F, RT_, TT, 5); K_CASE(F, RT_, TT, 6);          \
                K_CASE(F, RT_, TT, 7); K_CASE(F, RT_, TT, 8);                                 \
            default: break;                                                                   \
            }                                                                                 \
            t += tt_;                                                                         \
        }                                                                                     \
    } while (0)
#define K_TILE_LOOP(F, RT, TT, RTD)                                                           \
    do {                                                                                      \
        float o_[64];                                                                         \
        int64_t r = r0;                                                                       \
        if (nt == 1 && (RTD) == 1) { /* one row at a time from KV_K_STREAMS far-apart streams */ \
            const int64_t h_ = (r1 - r0) / KV_K_STREAMS;                                      \
            for (int64_t i_ = 0; i_ < h_; i_++)                                               \
                UNROLL for (int s_ = 0; s_ < KV_K_STREAMS; s_++) {                            \
                    r = r0 + s_ * h_ + i_;                                                    \
                    F(1, 1, r, 0, 1, o_);                                                     \
                    Y[r] = o_[0];                                                             \
                }                                                                             \
            r = r0 + KV_K_STREAMS * h_;                                                       \
        }                                                                                     \
        if (nt == 1)                                                                          \
            for (; r + (RTD) <= r1; r += (RTD)) {                                             \
                F(RTD, 1, r, 0, 1, o_);                                                       \
                for (int i = 0; i < (RTD); i++) Y[r + i] = o_[i];                             \
            }                                                                                 \
        for (; r + (RT) <= r1; r += (RT)) K_TOKENS(F, RT, TT);                                \
        for (; r < r1; r++) K_TOKENS(F, 1, TT);                                               \
    } while (0)

#ifndef KV_K4_RT
#define KV_K4_RT 2
#endif
#ifndef KV_K4_TT
#define KV_K4_TT 8
#endif
#ifndef KV_K6_RT
#define KV_K6_RT 4
#endif
#ifndef KV_K6_TT
#define KV_K6_TT 4
#endif

/* q4_K / q5_K: activations prepared per call (k4_prep) in token chunks
 * that fit the stack buffer, then the tile loop. */
#define K4_ENTRY(T, RT, TT, RTD)                                                                \
    static void T##_dot(int64_t n, float *s, const void *w, const void *a) {                    \
        T##_tile(1, 1, n / KV_QK_K, (const uint8_t *)w, 0, (const uint8_t *)a, 0, NULL, 0, s);  \
    }                                                                                           \
    static void T##_mat(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1,     \
                        const void *A, size_t a_stride, int64_t n_tok, float *Y0, size_t y_stride) { \
        _Static_assert((RT) <= KT_R && (TT) <= KT_T && (RTD) <= KT_R, "tile");                  \
        const int64_t nsb = n / KV_QK_K;                                                        \
        int64_t tc = n_tok;                                                                     \
        while (tc > 1 && (size_t)nsb * k4_pre_ss(tc) > KV_PRE_BYTES) tc = (tc + 1) / 2;         \
        if ((size_t)nsb * k4_pre_ss(tc) > KV_PRE_BYTES) { /* rows too long for the buffer */    \
            kv_mat_generic(T##_dot, W, row_bytes, n, r0, r1, A, a_stride, n_tok, Y0, y_stride);  \
            return;                                                                             \
        }                                                                                       \
        _Alignas(64) uint8_t pre[KV_PRE_BYTES];                                                 \
        const uint8_t *wb = (const uint8_t *)W;                                                 \
        for (int64_t t0 = 0; t0 < n_tok; t0 += tc) {                                            \
            const int64_t nt = n_tok - t0 < tc ? n_tok - t0 : tc;                               \
            const uint8_t *ab = (const uint8_t *)A + (size_t)t0 * a_stride;                     \
            const size_t ss = k4_pre_ss(nt);                                                    \
            float *Y = Y0 + (size_t)t0 * y_stride;                                              \
            for (int64_t t = 0; t < nt; t++)                                                    \
                k4_prep((const kv_block_q8_K *)(const void *)(ab + (size_t)t * a_stride), nsb, pre, t, nt); \
            K_TILE_LOOP(T##_TF, RT, TT, RTD);                                                   \
        }                                                                                       \
    }
#define K4_TF(T, rt, tt, r, t, pf, o)                                                          \
    do {                                                                                       \
        const k4_pre P_ = {pre + (size_t)(t) * 256, (const float *)(const void *)(pre + (size_t)nt * 256) + 8 * (t), \
                           (const float *)(const void *)(pre + (size_t)nt * 288) + (t), ss};   \
        T##_tile(rt, tt, nsb, wb + (size_t)(r) * row_bytes, row_bytes, NULL, 0, &P_, pf, o);   \
    } while (0)
#define q4_K_TF(rt, tt, r, t, pf, o) K4_TF(q4_K, rt, tt, r, t, pf, o)
#define q5_K_TF(rt, tt, r, t, pf, o) K4_TF(q5_K, rt, tt, r, t, pf, o)
#ifndef KV_K4_RTD
#define KV_K4_RTD 1 /* rows per one-token tile */
#endif
K4_ENTRY(q4_K, KV_K4_RT, KV_K4_TT, KV_K4_RTD)
K4_ENTRY(q5_K, KV_K4_RT, KV_K4_TT, KV_K4_RTD)

/* q6_K: no activation prep. */
#define K6_ENTRY(T, RT, TT, RTD)                                                                \
    static void T##_dot(int64_t n, float *s, const void *w, const void *a) {                    \
        T##_tile(1, 1, n / KV_QK_K, (const uint8_t *)w, 0, (const uint8_t *)a, 0, 0, s);        \
    }                                                                                           \
    static void T##_mat(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1,     \
                        const void *A, size_t a_stride, int64_t n_tok, float *Y, size_t y_stride) { \
        _Static_assert((RT) <= KT_R && (TT) <= KT_T && (RTD) <= KT_R, "tile");                  \
        const int64_t nsb = n / KV_QK_K, nt = n_tok;                                            \
        const uint8_t *wb = (const uint8_t *)W, *ab = (const uint8_t *)A;                       \
        K_TILE_LOOP(T##_TF, RT, TT, RTD);                                                       \
    }
#define q6_K_TF(rt, tt, r, t, pf, o)                                                           \
    q6_K_tile(rt, tt, nsb, wb + (size_t)(r) * row_bytes, row_bytes, ab + (size_t)(t) * a_stride, \
              a_stride, pf, o)
#ifndef KV_K6_RTD
#define KV_K6_RTD 1 /* rows per one-token tile: one, from KV_K_STREAMS streams (two adjacent rows: 83-84%) */
#endif
K6_ENTRY(q6_K, KV_K6_RT, KV_K6_TT, KV_K6_RTD)


/* Q8_0 . Q8_0, the 4 canonical lanes of an output in a 128-bit quarter
 * of a zmm (quant_internal.h): vpdpbusd on a block's two 16-byte halves
 * leaves lane l of a quarter the sum over the values j with (j % 16) / 4
 * == l. Weights are made unsigned (w ^ 0x80 = w + 128) and the offset is
 * removed by starting from -128 * (the activations' sum over the lane). */

/* (l0+l1) + (l2+l3) of each quarter of v, quarter i to out[i]. */
AI void q8q_hsum4x4(__m512 v, float *out) {
    const __m512 t = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1)); /* l0+l1, l1+l0, l2+l3, l3+l2 */
    const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E)); /* lane 0: (l0+l1) + (l2+l3) */
    _Alignas(64) float f[16];
    _mm512_store_ps(f, u);
    for (int i = 0; i < 4; i++) out[i] = f[4 * i];
}

/* The lone dot and one token (two row streams): the ymm kernels, with
 * vpdpbusd for the integer step. */
#define I8DOT(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (s))
#include "quant/q8_0_ymm.h"

/* Several tokens: one row x up to 4 * KV_Q8Q_NQ tokens, four tokens (a
 * quad) per zmm. Per block and quad the activations are laid out once per
 * call chunk (q8q_prep): the four tokens' low 16-byte halves, their high
 * halves, the offset start vector, each token's scale four times (256
 * bytes); the row's block halves are broadcast to the four quarters. Per
 * (row, quad, block): two vpdpbusd, a convert, a scale product and an fma
 * for 128 products. Each tile's quads have a region of their own. */
#ifndef KV_Q8Q_NQ
#define KV_Q8Q_NQ 2 /* quads per tile (3 or 4: 64 KiB of prepared activations at 2048 values, past L1; 16 tokens 155 -> 55 GMAC/s) */
#endif
#define KV_Q8Q_QUAD 256 /* bytes per block and quad */
#define KV_Q8Q_BUF (192 * 1024)
#ifndef KV_Q8Q_CHUNK
#define KV_Q8Q_CHUNK (512u << 10) /* bytes of weight rows per row chunk */
#endif
#ifndef KV_Q8Q_PF
#define KV_Q8Q_PF 8 /* rows ahead */
#endif
AI void q8q_tile(int NQ, int64_t nb, const uint8_t *w, size_t rb, const uint8_t *pre, float *out) {
    __m512 acc[KV_Q8Q_NQ];
    UNROLL for (int k = 0; k < NQ; k++) acc[k] = _mm512_setzero_ps();
    const __m512i k80 = _mm512_set1_epi8((char)0x80);
    const size_t pb = (size_t)NQ * KV_Q8Q_QUAD;
    for (int64_t b = 0; b < nb; b++) {
        const kv_block_q8_0 *x = (const kv_block_q8_0 *)(const void *)w + b;
        if (b & 1) _mm_prefetch((const char *)x + KV_Q8Q_PF * rb, _MM_HINT_T0);
        const __m512i wl = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(const void *)x->qs)), k80);
        const __m512i wh = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(const void *)(x->qs + 16))), k80);
        const __m512 dw = _mm512_set1_ps(h2f(x->d));
        const uint8_t *pk = pre + (size_t)b * pb;
        UNROLL for (int k = 0; k < NQ; k++) {
            const uint8_t *p = pk + (size_t)k * KV_Q8Q_QUAD;
            const __m512i q = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_load_si512((const void *)(p + 128)), wl,
                                                                      _mm512_load_si512((const void *)p)),
                                                  wh, _mm512_load_si512((const void *)(p + 64)));
            acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_mul_ps(dw, _mm512_load_ps((const void *)(p + 192))), acc[k]);
        }
    }
    UNROLL for (int k = 0; k < NQ; k++) q8q_hsum4x4(acc[k], out + 4 * k);
}

/* Tokens [0, nt) at a (stride ab) as quads into pre (NQ quads per block);
 * a short last quad repeats its last token. */
static void q8q_prep(const uint8_t *a, size_t ab, int64_t nt, int64_t nb, int NQ, uint8_t *pre) {
    const __m512i k80 = _mm512_set1_epi8((char)0x80);
    const __m512i lo = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), hi = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
    for (int k = 0; 4 * k < nt; k++) {
        const kv_block_q8_0 *y[4];
        for (int i = 0; i < 4; i++) {
            const int64_t t = 4 * k + i < nt ? 4 * k + i : nt - 1;
            y[i] = (const kv_block_q8_0 *)(const void *)(a + (size_t)t * ab);
        }
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = pre + ((size_t)b * NQ + (size_t)k) * KV_Q8Q_QUAD;
            const __m512i v01 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(const void *)y[0][b].qs)),
                                                   _mm256_loadu_si256((const __m256i *)(const void *)y[1][b].qs), 1);
            const __m512i v23 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(const void *)y[2][b].qs)),
                                                   _mm256_loadu_si256((const __m256i *)(const void *)y[3][b].qs), 1);
            const __m512i yl = _mm512_permutex2var_epi64(v01, lo, v23), yh = _mm512_permutex2var_epi64(v01, hi, v23);
            _mm512_store_si512((void *)o, yl);
            _mm512_store_si512((void *)(o + 64), yh);
            _mm512_store_si512((void *)(o + 128), _mm512_sub_epi32(_mm512_setzero_si512(),
                               _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), k80, yl), k80, yh)));
            _mm512_store_ps((void *)(o + 192), _mm512_setr_ps(h2f(y[0][b].d), h2f(y[0][b].d), h2f(y[0][b].d), h2f(y[0][b].d),
                                                              h2f(y[1][b].d), h2f(y[1][b].d), h2f(y[1][b].d), h2f(y[1][b].d),
                                                              h2f(y[2][b].d), h2f(y[2][b].d), h2f(y[2][b].d), h2f(y[2][b].d),
                                                              h2f(y[3][b].d), h2f(y[3][b].d), h2f(y[3][b].d), h2f(y[3][b].d)));
        }
    }
}

#define Q8Q_CASE(c)                                                                             \
    case c:                                                                                     \
        for (int64_t r = rc; r < rc_end; r++) {                                                 \
            q8q_tile(c, nb, wb + (size_t)r * row_bytes, row_bytes, pre + (size_t)k0 * nb * KV_Q8Q_QUAD, o); \
            for (int64_t j = 0; j < 4 * (c) && 4 * k0 + j < nt; j++) Y[(size_t)(4 * k0 + j) * y_stride + r] = o[j]; \
        }                                                                                       \
        break

/* One token: two row streams (q8_0_mat1). Several: per chunk of tokens the
 * prepared quads, then rows in chunks of about 512 KiB of weights (from
 * memory once, then from L2 by every token tile), the quads in the fewest
 * tiles of at most KV_Q8Q_NQ, as even as possible, the rows inner. */
static void q8q_mat(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1, const void *A,
                    size_t a_stride, int64_t n_tok, float *Y0, size_t y_stride) {
    const int64_t nb = n / 32;
    const uint8_t *wb = (const uint8_t *)W, *ab = (const uint8_t *)A;
    float o[4 * KV_Q8Q_NQ];
    int64_t tc_max = (int64_t)(KV_Q8Q_BUF / ((size_t)nb * KV_Q8Q_QUAD)) * 4; /* tokens per chunk */
    if (tc_max > KV_Q8_MAX_TILES * 4 * KV_Q8Q_NQ) tc_max = KV_Q8_MAX_TILES * 4 * KV_Q8Q_NQ;
    if (n_tok == 1 || tc_max < 4) {
        q8_0_mat1(W, row_bytes, n, r0, r1, A, a_stride, n_tok, Y0, y_stride);
        return;
    }
    _Alignas(64) uint8_t pre[KV_Q8Q_BUF];
    const int64_t rows_chunk = (int64_t)(KV_Q8Q_CHUNK / row_bytes) + 1;
    for (int64_t t0 = 0; t0 < n_tok; t0 += tc_max) {
        const int64_t nt = n_tok - t0 < tc_max ? n_tok - t0 : tc_max, nq = (nt + 3) / 4;
        float *Y = Y0 + (size_t)t0 * y_stride;
        int64_t kks[KV_Q8_MAX_TILES];
        const int64_t nj = q8_tile_split(nq, KV_Q8Q_NQ, kks);
        for (int64_t j = 0, k0 = 0; j < nj; k0 += kks[j++])
            q8q_prep(ab + (size_t)(t0 + 4 * k0) * a_stride, a_stride, 4 * kks[j] < nt - 4 * k0 ? 4 * kks[j] : nt - 4 * k0,
                     nb, (int)kks[j], pre + (size_t)k0 * nb * KV_Q8Q_QUAD);
        for (int64_t rc = r0; rc < r1; rc += rows_chunk) {
            const int64_t rc_end = rc + rows_chunk < r1 ? rc + rows_chunk : r1;
            for (int64_t j = 0, k0 = 0; j < nj; k0 += kks[j++]) {
                switch (kks[j]) {
                    Q8Q_CASE(1); Q8Q_CASE(2);
#if KV_Q8Q_NQ > 2
                    Q8Q_CASE(3); Q8Q_CASE(4);
#endif
                default: break;
                }
            }
        }
    }
}

/* F32 . F32, 8 canonical lanes (lane i%8, fma in increasing i, then
 * kv_hsum8): one zmm carries two tokens' 8 lanes (token 2u low, 2u+1
 * high) and each row's 8 values are broadcast to both halves, so per lane
 * it is the ymm tile's fma chain and the bits are the same. An odd last
 * token fills both halves (the high one is dropped). Tiles of up to 4 rows
 * x 8 tokens (16 accumulators); one token: 2 rows (two fma chains), the
 * next 2 rows prefetched as one sequential sweep; 4 rows read side by side
 * streamed 20-25% below one sequential read on Zen 5, 2 rows with the
 * sweep at its speed. Attention's scores are this kernel: keys as
 * rows, the query heads sharing a KV head (and neighbouring tokens) as
 * tokens. */
AI void f32z_tile(int RT, int TT, int64_t n, const uint8_t *w, size_t rb, const uint8_t *a, size_t ab,
                  float *out) {
    const int TP = (TT + 1) / 2;
    __m512 acc[4][4];
    UNROLL for (int r = 0; r < RT; r++) UNROLL for (int u = 0; u < TP; u++) acc[r][u] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        if (TT == 1) { /* one token (decode): the next tile's rows in one sequential sweep */
            const size_t off_ = (size_t)i * RT * sizeof(float);
            if ((off_ & 63) < (size_t)RT * 32)
                UNROLL for (int l_ = 0; l_ < (RT * 32 + 63) / 64; l_++)
                    _mm_prefetch((const char *)(w + (size_t)RT * rb + (off_ & ~(size_t)63)) + 64 * l_, _MM_HINT_T0);
        }
        __m512 av[4];
        UNROLL for (int u = 0; u < TP; u++) {
            const float *a0 = (const float *)(const void *)(a + (size_t)(2 * u) * ab) + i;
            const float *a1 = 2 * u + 1 < TT ? (const float *)(const void *)(a + (size_t)(2 * u + 1) * ab) + i : a0;
            av[u] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a0)), _mm256_loadu_ps(a1), 1);
        }
        UNROLL for (int r = 0; r < RT; r++) {
            const __m512 wv = _mm512_broadcast_f32x8(_mm256_loadu_ps((const float *)(const void *)(w + (size_t)r * rb) + i));
            UNROLL for (int u = 0; u < TP; u++) acc[r][u] = _mm512_fmadd_ps(wv, av[u], acc[r][u]);
        }
    }
    if (i == n) { /* kv_hsum8 of both halves at once: (l + l+4), (+ l+2), (+ l+1) */
        UNROLL for (int r = 0; r < RT; r++) UNROLL for (int u = 0; u < TP; u++) {
            __m512 v = acc[r][u];
            v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
            v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));
            v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));
            out[r * TT + 2 * u] = _mm512_cvtss_f32(v);
            if (2 * u + 1 < TT) out[r * TT + 2 * u + 1] = _mm_cvtss_f32(_mm512_extractf32x4_ps(v, 2));
        }
        return;
    }
    for (int r = 0; r < RT; r++)
        for (int t = 0; t < TT; t++) {
            float l[16];
            _mm512_storeu_ps(l, acc[r][t / 2]);
            float *h = l + 8 * (t & 1);
            const float *x = (const float *)(const void *)(w + (size_t)r * rb);
            const float *y = (const float *)(const void *)(a + (size_t)t * ab);
            for (int64_t k = i; k < n; k++) h[k & 7] = fmaf(x[k], y[k], h[k & 7]);
            out[r * TT + t] = kv_hsum8(h);
        }
}

static void f32z_dot(int64_t n, float *s, const void *w, const void *a) {
    f32z_tile(1, 1, n, (const uint8_t *)w, 0, (const uint8_t *)a, 0, s);
}

#define f32z_TF(rt, tt, r, t, pf, o)                                                                \
    f32z_tile(rt, tt, n, wb + (size_t)(r) * row_bytes, row_bytes, ab + (size_t)(t) * a_stride, a_stride, o)

static void f32z_mat(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1, const void *A,
                     size_t a_stride, int64_t n_tok, float *Y, size_t y_stride) {
    const int64_t nt = n_tok;
    const uint8_t *wb = (const uint8_t *)W, *ab = (const uint8_t *)A;
    _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wunused-value\"")
    K_TILE_LOOP(f32z_TF, 4, 8, 2);
    _Pragma("GCC diagnostic pop")
}

/* Up to 16 columns (attention scores: a block's keys; the last block's
 * fewer under a mask): one zmm per query, 8 queries per pass sharing each
 * V load, the weights broadcast from memory. */
AI void wsum_narrow(float *o, size_t o_stride, const float *w, size_t w_stride, int QT, const float *V,
                    size_t v_stride, int64_t n_rows, __mmask16 m, int acc0) {
    __m512 acc[8];
    UNROLL for (int j = 0; j < 8; j++)
        if (j < QT) acc[j] = acc0 ? _mm512_maskz_loadu_ps(m, o + (size_t)j * o_stride) : _mm512_setzero_ps();
    for (int64_t p = 0; p < n_rows; p++) {
        const __m512 v = _mm512_maskz_loadu_ps(m, V + (size_t)p * v_stride);
        UNROLL for (int j = 0; j < 8; j++)
            if (j < QT) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(w[(size_t)j * w_stride + p]), v, acc[j]);
    }
    UNROLL for (int j = 0; j < 8; j++)
        if (j < QT) _mm512_mask_storeu_ps(o + (size_t)j * o_stride, m, acc[j]);
}

/* Several queries' weighted sums over the same V rows (quant/vec.h): per
 * output element the same fma chain as kv_f32_wsum_avx512, with each V
 * load shared by up to 4 queries (64 columns x 4 queries = 16 zmm). */
void kv_f32_wsum_multi_avx512(float *o, size_t o_stride, const float *w, size_t w_stride, int64_t n_q,
                              const float *V, size_t v_stride, int64_t n_rows, int64_t n, int acc0) {
    int64_t q0 = 0;
    if (n <= 16) {
        const __mmask16 m = (__mmask16)((1u << n) - 1u);
        for (; q0 + 8 <= n_q; q0 += 8)
            wsum_narrow(o + (size_t)q0 * o_stride, o_stride, w + (size_t)q0 * w_stride, w_stride, 8, V, v_stride,
                        n_rows, m, acc0);
        for (; q0 < n_q; q0++)
            wsum_narrow(o + (size_t)q0 * o_stride, o_stride, w + (size_t)q0 * w_stride, w_stride, 1, V, v_stride,
                        n_rows, m, acc0);
        return;
    }
    for (; q0 + 4 <= n_q && n >= 64; q0 += 4) {
        int64_t i = 0;
        for (; i + 64 <= n; i += 64) {
            __m512 acc[4][4];
            UNROLL for (int j = 0; j < 4; j++) UNROLL for (int k = 0; k < 4; k++) acc[j][k] =
                acc0 ? _mm512_loadu_ps(o + (size_t)(q0 + j) * o_stride + i + 16 * k) : _mm512_setzero_ps();
            for (int64_t p = 0; p < n_rows; p++) {
                const float *v = V + (size_t)p * v_stride + i;
                const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
                             v3 = _mm512_loadu_ps(v + 48);
                UNROLL for (int j = 0; j < 4; j++) {
                    const __m512 wp = _mm512_set1_ps(w[(size_t)(q0 + j) * w_stride + p]);
                    acc[j][0] = _mm512_fmadd_ps(wp, v0, acc[j][0]);
                    acc[j][1] = _mm512_fmadd_ps(wp, v1, acc[j][1]);
                    acc[j][2] = _mm512_fmadd_ps(wp, v2, acc[j][2]);
                    acc[j][3] = _mm512_fmadd_ps(wp, v3, acc[j][3]);
                }
            }
            UNROLL for (int j = 0; j < 4; j++) UNROLL for (int k = 0; k < 4; k++)
                _mm512_storeu_ps(o + (size_t)(q0 + j) * o_stride + i + 16 * k, acc[j][k]);
        }
        if (i < n)
            for (int j = 0; j < 4; j++)
                kv_f32_wsum_avx512(o + (size_t)(q0 + j) * o_stride + i, w + (size_t)(q0 + j) * w_stride,
                                   V + i, v_stride, n_rows, n - i, acc0);
    }
    for (; q0 < n_q; q0++)
        kv_f32_wsum_avx512(o + (size_t)q0 * o_stride, w + (size_t)q0 * w_stride, V, v_stride, n_rows, n, acc0);
}

/* attention weighted sum: o[i] = fma chain over p (quant/vec.h) */
void kv_f32_wsum_avx512(float *o, const float *w, const float *V, size_t v_stride, int64_t n_rows,
                        int64_t n, int acc0) {
    int64_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m512 acc[8];
        for (int k = 0; k < 8; k++) acc[k] = acc0 ? _mm512_loadu_ps(o + i + 16 * k) : _mm512_setzero_ps();
        for (int64_t p = 0; p < n_rows; p++) {
            const float *v = V + (size_t)p * v_stride + i;
            __m512 wp = _mm512_set1_ps(w[p]);
            for (int k = 0; k < 8; k++) acc[k] = _mm512_fmadd_ps(wp, _mm512_loadu_ps(v + 16 * k), acc[k]);
        }
        for (int k = 0; k < 8; k++) _mm512_storeu_ps(o + i + 16 * k, acc[k]);
    }
    for (; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 acc = acc0 ? _mm512_maskz_loadu_ps(m, o + i) : _mm512_setzero_ps();
        for (int64_t p = 0; p < n_rows; p++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(w[p]), _mm512_maskz_loadu_ps(m, V + (size_t)p * v_stride + i), acc);
        _mm512_mask_storeu_ps(o + i, m, acc);
    }
}

void kv_quant_fill_avx512(kv_kernels *k) {
    k[KV_TYPE_F32].vec_dot = f32z_dot;    k[KV_TYPE_F32].mat = f32z_mat;
    k[KV_TYPE_Q8_0].vec_dot = q8_0_dot;    k[KV_TYPE_Q8_0].mat = q8q_mat;
    k[KV_TYPE_Q4_0].vec_dot = q4_0_dot;   k[KV_TYPE_Q4_0].mat = q4_0_mat;
    k[KV_TYPE_Q4_K].vec_dot = q4_K_dot;   k[KV_TYPE_Q4_K].mat = q4_K_mat;
    k[KV_TYPE_Q5_K].vec_dot = q5_K_dot;   k[KV_TYPE_Q5_K].mat = q5_K_mat;
    k[KV_TYPE_Q6_K].vec_dot = q6_K_dot;   k[KV_TYPE_Q6_K].mat = q6_K_mat;
}
