/* AVX2 + FMA + F16C kernels (compiled with -mavx2 -mfma -mf16c -mbmi2; only
 * called after run-time detection). Every kernel follows the canonical
 * reduction order of quant_internal.h, so its results are bit-identical to
 * the scalar reference.
 *
 * Hot path: each type has one tile routine computing an RT x TT block of
 * (weight row, token) dot products over the whole row. Weight blocks are
 * loaded and unpacked once per tile and reused for all TT tokens;
 * activation blocks once and reused for all RT rows. vec_dot is the 1x1
 * tile, so a lone dot and a tiled one run the same arithmetic per pair.
 * kv_mat_rows walks the rows in tiles (RT rows x TT tokens); with few
 * tokens it uses taller tiles. */
#include <immintrin.h>

#include "quant/quant_internal.h"

#define AI static inline __attribute__((always_inline))
#ifndef KV_KPF_TILES
#define KV_KPF_TILES 8 /* K-quant tiles: prefetch the row tile this many tiles ahead */
#endif
/* One-token K-quant rows from this many far-apart parts of the row range
 * in turn, as in the AVX-512 file (memory sees that many sequential
 * streams; each row is still one whole dot product). */
#ifndef KV_K_STREAMS
#define KV_K_STREAMS 2
#endif
#define UNROLL _Pragma("GCC unroll 8")
/* An int32 accumulator materialized here: keeps gcc from reassociating a
 * run of integer adds across unrolled steps (it would, holding every
 * partial product in a register, and spill). No instruction. */
#define KM_KEEP(v) __asm__("" : "+x"(v))

/* The integer steps, AVX2 or AVX-VNNI (this file compiled again as
 * simd_avxvnni.c): I8DOT(u, s) = the 8 int32 sums of 4 u8 x s8 products
 * (vpmaddubsw's int16 pair sums cannot saturate here: u <= 128 and
 * -128 <= s <= 127, so every pair sum is in [-32768, 32512], and the two
 * forms give the same integers); I16DOT(acc, a, b) = acc + the int32 sums
 * of int16 pairs (vpdpwssd wraps like vpaddd). */
#ifdef KV_AVX2_VNNI
#define I8DOT(u, s) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (u), (s))
#define I16DOT(acc, a, b) _mm256_dpwssd_avx_epi32((acc), (a), (b))
#else
#define I8DOT(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1))
#define I16DOT(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#endif

AI float h2f(uint16_t h) { return _cvtsh_ss(h); }

AI int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* Fixed 8-lane tree, same order as kv_hsum8. */
AI float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l+l4 */
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                        /* (0+4)+(2+6), (1+5)+(3+7) */
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Run a tile routine over rows [r0,r1) x tokens [0,n_tok): RT x TT tiles,
 * then the leftovers with 1-row / 1-token tiles. F(rt, tt, w, a, out)
 * must compute out[r*tt + t] for the rt rows at w and tt tokens at a. */
#define KV_MAT_DRIVER(F, RT, TT, RT1)                                                         \
    do {                                                                                      \
        const uint8_t *wb = (const uint8_t *)W, *ab = (const uint8_t *)A;                     \
        float o[(RT1) > (RT) * (TT) ? (RT1) : (RT) * (TT)];                                   \
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

/* The same, with each row tile's tokens split into the fewest tiles of at
 * most TT (<= 3), as even as possible (8 tokens: 3 + 3 + 2, not 3 + 3 +
 * 1 + 1), so an expert's few tokens never fall to one-token tiles. */
#define KV_MAT_CASE(F, RT_, c)                                                                \
    case c:                                                                                   \
        F(RT_, c, wb + r * row_bytes, ab + t * a_stride, o);                                  \
        for (int i = 0; i < (RT_); i++)                                                       \
            for (int j = 0; j < (c); j++) Y[(t + j) * y_stride + r + i] = o[i * (c) + j];     \
        break
#define KV_MAT_TOKENS(F, RT_, TT)                                                             \
    do {                                                                                      \
        const int64_t nj_ = (n_tok + (TT) - 1) / (TT);                                        \
        int64_t t = 0;                                                                        \
        for (int64_t j_ = 0; j_ < nj_; j_++) {                                                \
            const int64_t left_ = nj_ - j_, tt_ = (n_tok - t + left_ - 1) / left_;            \
            switch (tt_) {                                                                    \
                KV_MAT_CASE(F, RT_, 1);                                                       \
                KV_MAT_CASE(F, RT_, 2);                                                       \
                KV_MAT_CASE(F, RT_, 3);                                                       \
            default: break;                                                                   \
            }                                                                                 \
            t += tt_;                                                                         \
        }                                                                                     \
    } while (0)
#define KV_MAT_DRIVER_EVEN(F, RT, TT, RT1)                                                    \
    do {                                                                                      \
        _Static_assert((TT) <= 3, "KV_MAT_TOKENS has cases 1..3");                            \
        const uint8_t *wb = (const uint8_t *)W, *ab = (const uint8_t *)A;                     \
        float o[(RT1) > (RT) * (TT) ? (RT1) : (RT) * (TT)];                                   \
        int64_t r = r0;                                                                       \
        if (n_tok == 1 && (RT1) == 1) { /* one row at a time from KV_K_STREAMS far-apart streams */ \
            const int64_t h_ = (r1 - r0) / KV_K_STREAMS;                                      \
            for (int64_t i_ = 0; i_ < h_; i_++)                                               \
                for (int s_ = 0; s_ < KV_K_STREAMS; s_++) {                                   \
                    r = r0 + s_ * h_ + i_;                                                    \
                    F(1, 1, wb + r * row_bytes, ab, o);                                       \
                    Y[r] = o[0];                                                              \
                }                                                                             \
            r = r0 + KV_K_STREAMS * h_;                                                       \
        }                                                                                     \
        if (n_tok == 1)                                                                       \
            for (; r + (RT1) <= r1; r += (RT1)) {                                             \
                F(RT1, 1, wb + r * row_bytes, ab, o);                                         \
                for (int i = 0; i < (RT1); i++) Y[r + i] = o[i];                              \
            }                                                                                 \
        for (; r + (RT) <= r1; r += (RT)) KV_MAT_TOKENS(F, RT, TT);                           \
        for (; r < r1; r++) KV_MAT_TOKENS(F, 1, TT);                                          \
    } while (0)

/* ================================================================== */
/* float types: 8 lanes, lane i%8, fma in element order                */

#define FLOAT_TILE(NAME, ELT, LOAD, SCAL)                                                      \
    AI void NAME(int RT, int TT, int64_t n, const uint8_t *w, size_t rb, const uint8_t *a,     \
                 size_t ab, float *out) {                                                      \
        __m256 acc[4][4];                                                                      \
        UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++) acc[r][t] =    \
            _mm256_setzero_ps();                                                               \
        int64_t i = 0;                                                                         \
        for (; i + 8 <= n; i += 8) {                                                           \
            if (TT == 1) { /* one token (decode): the next tile's rows, one sequential sweep */ \
                const size_t off_ = (size_t)i * RT * sizeof(ELT);                               \
                if ((off_ & 63) < (size_t)RT * 8 * sizeof(ELT))                                  \
                    UNROLL for (int l_ = 0; l_ < (int)((RT * 8 * sizeof(ELT) + 63) / 64); l_++)  \
                        _mm_prefetch((const char *)(w + (size_t)RT * rb + (off_ & ~(size_t)63)) + 64 * l_, _MM_HINT_T0); \
            }                                                                                  \
            __m256 av[4];                                                                      \
            UNROLL for (int t = 0; t < TT; t++) av[t] = LOAD((const ELT *)(a + t * ab) + i);   \
            UNROLL for (int r = 0; r < RT; r++) {                                              \
                __m256 wv = LOAD((const ELT *)(w + r * rb) + i);                               \
                UNROLL for (int t = 0; t < TT; t++) acc[r][t] = _mm256_fmadd_ps(wv, av[t], acc[r][t]); \
            }                                                                                  \
        }                                                                                      \
        if (i == n) { /* no tail (head_dim, n_embd): the lanes folded in registers */          \
            UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++)            \
                out[r * TT + t] = hsum_ps(acc[r][t]);                                          \
            return;                                                                            \
        }                                                                                      \
        for (int r = 0; r < RT; r++)                                                           \
            for (int t = 0; t < TT; t++) {                                                     \
                float l[8];                                                                    \
                _mm256_storeu_ps(l, acc[r][t]);                                                \
                const ELT *x = (const ELT *)(w + r * rb), *y = (const ELT *)(a + t * ab);      \
                for (int64_t k = i; k < n; k++) l[k & 7] = fmaf(SCAL(x[k]), SCAL(y[k]), l[k & 7]); \
                out[r * TT + t] = kv_hsum8(l);                                                 \
            }                                                                                  \
    }

AI __m256 ld_f32(const float *p) { return _mm256_loadu_ps(p); }
AI __m256 ld_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
AI __m256 ld_bf16(const uint16_t *p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
AI float sc_f32(float x) { return x; }
AI float sc_f16(uint16_t h) { return _cvtsh_ss(h); }
AI float sc_bf16(uint16_t h) { return kv_u2f((uint32_t)h << 16); }

FLOAT_TILE(f32_tile, float, ld_f32, sc_f32)
FLOAT_TILE(f16_tile, uint16_t, ld_f16, sc_f16)
FLOAT_TILE(bf16_tile, uint16_t, ld_bf16, sc_bf16)

/* ================================================================== */
/* Q4_0 against Q8_0: 16 lanes (even / odd block accumulators)          */

/* Signed x signed 32-byte dot in 4-element groups -> 8 int32. */
AI __m256i dot_i8_groups(__m256i ax, __m256i sy) {
    return I8DOT(ax, sy);
}

/* Q4_0 block -> 32 signed bytes (q - 8) in element order. */
AI __m256i q4_0_bytes(const kv_block_q4_0 *b) {
    __m128i v = _mm_loadu_si128((const __m128i *)b->qs);
    __m256i x = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    x = _mm256_and_si256(x, _mm256_set1_epi8(0xF));
    return _mm256_sub_epi8(x, _mm256_set1_epi8(8));
}

#define Q80_TILE(NAME, WBLK, WBYTES)                                                            \
    AI void NAME(int RT, int TT, int64_t n, const uint8_t *w, size_t rb, const uint8_t *a,      \
                 size_t ab, float *out) {                                                       \
        __m256 acc[4][4][2];                                                                    \
        UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++) {               \
            acc[r][t][0] = _mm256_setzero_ps();                                                 \
            acc[r][t][1] = _mm256_setzero_ps();                                                 \
        }                                                                                       \
        const int64_t nb = n / 32;                                                              \
        for (int64_t b = 0; b < nb; b++) {                                                      \
            const int odd = (int)(b & 1);                                                       \
            if (odd) /* the row tile KV_KPF_TILES ahead, a line per two blocks */               \
                UNROLL for (int r = 0; r < RT; r++)                                             \
                    _mm_prefetch((const char *)((const WBLK *)(w + (r + KV_KPF_TILES * RT) * rb) + b), _MM_HINT_T0); \
            __m256i yv[4];                                                                      \
            float da[4];                                                                        \
            UNROLL for (int t = 0; t < TT; t++) {                                               \
                const kv_block_q8_0 *y = (const kv_block_q8_0 *)(a + t * ab) + b;               \
                yv[t] = _mm256_loadu_si256((const __m256i *)y->qs);                             \
                da[t] = h2f(y->d);                                                              \
            }                                                                                   \
            UNROLL for (int r = 0; r < RT; r++) {                                               \
                const WBLK *x = (const WBLK *)(w + r * rb) + b;                                 \
                __m256i xv = WBYTES(x);                                                         \
                __m256i ax = _mm256_sign_epi8(xv, xv);                                          \
                float dw = h2f(x->d);                                                           \
                UNROLL for (int t = 0; t < TT; t++) {                                           \
                    __m256i p = dot_i8_groups(ax, _mm256_sign_epi8(yv[t], xv));                 \
                    __m256 d = _mm256_set1_ps(dw * da[t]);                                      \
                    if (odd) acc[r][t][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc[r][t][1]); \
                    else acc[r][t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc[r][t][0]); \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++)                 \
            out[r * TT + t] = hsum_ps(_mm256_add_ps(acc[r][t][0], acc[r][t][1]));               \
    }

Q80_TILE(q4_0_tile, kv_block_q4_0, q4_0_bytes)

/* ================================================================== */
/* Q8_0 against Q8_0: 4 canonical lanes, one fma chain (quant_internal.h) */

/* The 8 int32 sums of 4 products of u = |x| (unsigned) and s = y with x's
 * sign, two such steps added: lane l of a 128-bit half sums the values
 * 4l..4l+3 of the first pair and of the second. With the block's two
 * 16-byte halves as the two pairs, a half is one output's 4 canonical lanes. */
#ifdef KV_AVX2_VNNI
#define I8DOT2(u0, s0, u1, s1) _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (u0), (s0)), (u1), (s1))
#else
#define I8DOT2(u0, s0, u1, s1) _mm256_add_epi32(I8DOT((u0), (s0)), I8DOT((u1), (s1)))
#endif

/* A block's d broadcast: d and the next two bytes in one 32-bit load, lane
 * 0 of their conversion is d (3 instructions instead of h2f's zeroing,
 * insert, conversion and broadcast). */
AI __m256 q8_dw(const kv_block_q8_0 *x) {
    int v;
    memcpy(&v, &x->d, 4);
    return _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(v)));
}
#include "quant/q8_0_ymm.h"

/* Several tokens: one row x up to KV_Q8P_TT tokens. The tokens go in pairs,
 * token 2k's lanes in the low half of pair k's vector, 2k+1's in the high
 * half; the activations are laid out once per call chunk (q8p_prep): per
 * block and pair the low 16-byte halves of both tokens, then the high
 * halves, then each token's scale four times. The row's block halves are
 * each broadcast to both halves of a ymm, so per pair and block it is two
 * sign + maddubs + madd steps (or two dpbusd), one add, one convert, one
 * scale product and one fma for 64 products. */
#ifndef KV_Q8P_TT
#define KV_Q8P_TT 16 /* tokens per tile (8 pairs: 8 accumulators) */
#endif
#ifndef KV_Q8P_CHUNK
#define KV_Q8P_CHUNK (512u << 10) /* bytes of weight rows per row chunk */
#endif
#define KV_Q8P_BUF (192 * 1024) /* prepared activations per chunk of tokens */
#define KV_Q8P_PAIR 96          /* bytes per block and token pair */
#ifndef KV_Q8P_PF
#define KV_Q8P_PF 8 /* rows ahead to prefetch */
#endif
AI void q8p_tile(int NP, int64_t nb, const uint8_t *w, size_t rb, const uint8_t *pre, size_t pb, float *out) {
    __m256 acc[KV_Q8P_TT / 2];
    UNROLL for (int k = 0; k < NP; k++) acc[k] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const kv_block_q8_0 *x = (const kv_block_q8_0 *)(const void *)w + b;
        if (b & 1) _mm_prefetch((const char *)x + KV_Q8P_PF * rb, _MM_HINT_T0);
        const __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)x->qs));
        const __m256i xh = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)(x->qs + 16)));
        const __m256i al = _mm256_sign_epi8(xl, xl), ah = _mm256_sign_epi8(xh, xh);
        const __m256 dw = q8_dw(x);
        const uint8_t *pk = pre + (size_t)b * pb;
        UNROLL for (int k = 0; k < NP; k++) {
            const __m256i yl = _mm256_load_si256((const __m256i *)(const void *)(pk + KV_Q8P_PAIR * k));
            const __m256i yh = _mm256_load_si256((const __m256i *)(const void *)(pk + KV_Q8P_PAIR * k + 32));
            const __m256i q = I8DOT2(al, _mm256_sign_epi8(yl, xl), ah, _mm256_sign_epi8(yh, xh));
            const __m256 d = _mm256_mul_ps(dw, _mm256_load_ps((const float *)(const void *)(pk + KV_Q8P_PAIR * k + 64)));
            acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, acc[k]);
        }
    }
    UNROLL for (int k = 0; k < NP; k++) q8_hsum4x2(acc[k], out + 2 * k, out + 2 * k + 1);
}

/* Tokens [0, nt) at a (stride ab) into pre: block-major, pb bytes per
 * block (np pairs); an odd last token is paired with itself. */
static void q8p_prep(const uint8_t *a, size_t ab, int64_t nt, int64_t nb, uint8_t *pre, size_t pb) {
    for (int64_t k = 0; 2 * k < nt; k++) {
        const kv_block_q8_0 *y0 = (const kv_block_q8_0 *)(const void *)(a + (size_t)(2 * k) * ab);
        const kv_block_q8_0 *y1 = 2 * k + 1 < nt ? (const kv_block_q8_0 *)(const void *)(a + (size_t)(2 * k + 1) * ab) : y0;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = pre + (size_t)b * pb + KV_Q8P_PAIR * (size_t)k;
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(const void *)y0[b].qs);
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(const void *)y1[b].qs);
            _mm256_store_si256((__m256i *)(void *)o, _mm256_permute2x128_si256(v0, v1, 0x20));
            _mm256_store_si256((__m256i *)(void *)(o + 32), _mm256_permute2x128_si256(v0, v1, 0x31));
            _mm256_store_ps((float *)(void *)(o + 64), _mm256_set_m128(_mm_set1_ps(h2f(y1[b].d)), _mm_set1_ps(h2f(y0[b].d))));
        }
    }
}

#define Q8P_CASE(c)                                                                             \
    case c:                                                                                     \
        for (int64_t r = rc; r < rc_end; r++) {                                                 \
            q8p_tile(c, nb, wb + (size_t)r * row_bytes, row_bytes, pre + (size_t)k0 * nb * KV_Q8P_PAIR, \
                     (size_t)(c) * KV_Q8P_PAIR, o);                                             \
            for (int64_t j = 0; j < 2 * (c) && 2 * k0 + j < nt; j++) Y[(size_t)(2 * k0 + j) * y_stride + r] = o[j]; \
        }                                                                                       \
        break

/* One token: row pairs (q8d_tile). Several: per chunk of tokens the
 * prepared pairs, then rows in chunks of about 512 KiB of weights (read
 * from memory once, then from L2 by every token tile), per chunk the pairs
 * in the fewest tiles of at most KV_Q8P_TT tokens, as even as possible,
 * the rows inner. Every output is one whole dot product either way. */
static void q8_0_mat(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1, const void *A,
                     size_t a_stride, int64_t n_tok, float *Y0, size_t y_stride) {
    const int64_t nb = n / 32;
    const uint8_t *wb = (const uint8_t *)W, *ab = (const uint8_t *)A;
    float o[KV_Q8P_TT];
    size_t tc_max = KV_Q8P_BUF / ((size_t)nb * KV_Q8P_PAIR) * 2; /* tokens per chunk */
    if (tc_max > (size_t)KV_Q8_MAX_TILES * KV_Q8P_TT) tc_max = (size_t)KV_Q8_MAX_TILES * KV_Q8P_TT;
    if (n_tok == 1 || tc_max < 2) {
        q8_0_mat1(W, row_bytes, n, r0, r1, A, a_stride, n_tok, Y0, y_stride);
        return;
    }
    _Alignas(32) uint8_t pre[KV_Q8P_BUF];
    const int64_t rows_chunk = (int64_t)((KV_Q8P_CHUNK) / row_bytes) + 1;
    for (int64_t t0 = 0; t0 < n_tok; t0 += (int64_t)tc_max) {
        const int64_t nt = n_tok - t0 < (int64_t)tc_max ? n_tok - t0 : (int64_t)tc_max, np = (nt + 1) / 2;
        float *Y = Y0 + (size_t)t0 * y_stride;
        /* each tile's pairs block-major in a region of their own (one
         * region for all: a tile would read kk of np pairs per block, at a
         * stride that can crowd a few L1 sets) */
        int64_t kks[KV_Q8_MAX_TILES];
        const int64_t nj = q8_tile_split(np, KV_Q8P_TT / 2, kks);
        for (int64_t j = 0, k0 = 0; j < nj; k0 += kks[j++])
            q8p_prep(ab + (size_t)(t0 + 2 * k0) * a_stride, a_stride, 2 * kks[j] < nt - 2 * k0 ? 2 * kks[j] : nt - 2 * k0,
                     nb, pre + (size_t)k0 * nb * KV_Q8P_PAIR, (size_t)kks[j] * KV_Q8P_PAIR);
        for (int64_t rc = r0; rc < r1; rc += rows_chunk) {
            const int64_t rc_end = rc + rows_chunk < r1 ? rc + rows_chunk : r1;
            for (int64_t j = 0, k0 = 0; j < nj; k0 += kks[j++]) {
                switch (kks[j]) {
                    Q8P_CASE(1); Q8P_CASE(2); Q8P_CASE(3); Q8P_CASE(4);
#if KV_Q8P_TT > 8
                    Q8P_CASE(5); Q8P_CASE(6); Q8P_CASE(7); Q8P_CASE(8);
#endif
                default: break;
                }
            }
        }
    }
}

/* ================================================================== */
/* K-quants against Q8_K                                                */

/* q4_K/q5_K: per super-block int sums, then the scalar float steps. */
/* The 8 scales and 8 mins of a q4_K/q5_K block, branch-free: s16 = the
 * scales as int16 in both 128-bit lanes, mdup = each min as int16 twice
 * (one per bsums pair). Bytes are packed in general registers, so the
 * vector side is one move and two widenings each. */
AI void k4_scale_vecs(const uint8_t *q, __m256i *s16, __m256i *mdup) {
    uint32_t w0, w1, w2;
    memcpy(&w0, q, 4);
    memcpy(&w1, q + 4, 4);
    memcpy(&w2, q + 8, 4);
    const uint64_t sc = (w0 & 0x3f3f3f3fu) | (uint64_t)((w2 & 0x0f0f0f0fu) | (((w0 >> 6) & 0x03030303u) << 4)) << 32;
    const uint64_t mn = (w1 & 0x3f3f3f3fu) | (uint64_t)(((w2 >> 4) & 0x0f0f0f0fu) | (((w1 >> 6) & 0x03030303u) << 4)) << 32;
    const __m128i s8 = _mm_cvtsi64_si128((long long)sc), m8 = _mm_cvtsi64_si128((long long)mn);
    *s16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi64(s8, s8));
    *mdup = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
}

/* Bit j (0..7) of every byte of qh at bit 4 (the 5th bit of a q5_K value):
 * one 16-bit shift (none for j = 4) and one mask; bits a shift moves across
 * bytes land outside bit 4. */
AI __m256i q5_hi(__m256i qh, int j) {
    const __m256i m10 = _mm256_set1_epi8(0x10);
    return _mm256_and_si256(j < 4 ? _mm256_slli_epi16(qh, 4 - j) : j > 4 ? _mm256_srli_epi16(qh, j - 4) : qh, m10);
}

/* q4_K/q5_K: int32 lane sums per super-block, then the canonical float lanes. */
/* Quarter c (64 values) of super-block i of a K4 tile: the int32 lane sums. */
#define K4_QUARTER(WBLK, Q5, c)                                                                 \
    do {                                                                                        \
                __m256i ylo[4], yhi[4];                                                         \
                UNROLL for (int t = 0; t < TT; t++) {                                           \
                    const kv_block_q8_K *y = (const kv_block_q8_K *)(a + t * ab) + i;           \
                    ylo[t] = _mm256_loadu_si256((const __m256i *)(y->qs + 64 * c));             \
                    yhi[t] = _mm256_loadu_si256((const __m256i *)(y->qs + 64 * c + 32));        \
                }                                                                               \
                /* int16 words 2c / 2c+1 of s16 broadcast to every lane */                      \
                const __m256i pick0 = _mm256_set1_epi16((short)(0x0100 * (4 * c + 1) + 4 * c)); \
                const __m256i pick1 = _mm256_set1_epi16((short)(0x0100 * (4 * c + 3) + 4 * c + 2)); \
                UNROLL for (int r = 0; r < RT; r++) {                                           \
                    const WBLK *x = (const WBLK *)(w + r * rb) + i;                             \
                    __m256i qv = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * c));         \
                    __m256i lo = _mm256_and_si256(qv, m4);                                      \
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qv, 4), m4);                \
                    if (Q5) {                                                                   \
                        __m256i qh = _mm256_loadu_si256((const __m256i *)((const kv_block_q5_K *)(const void *)x)->qh); \
                        lo = _mm256_or_si256(lo, q5_hi(qh, 2 * c));                             \
                        hi = _mm256_or_si256(hi, q5_hi(qh, 2 * c + 1));                         \
                    }                                                                           \
                    const __m256i s0 = _mm256_shuffle_epi8(s16[r], pick0);                      \
                    const __m256i s1 = _mm256_shuffle_epi8(s16[r], pick1);                      \
                    UNROLL for (int t = 0; t < TT; t++) {                                       \
                        __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, ylo[t]), s0);   \
                        __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, yhi[t]), s1);   \
                        isum[r][t] = _mm256_add_epi32(isum[r][t], _mm256_add_epi32(p0, p1));    \
                        KM_KEEP(isum[r][t]);                                                    \
                    }                                                                           \
                }                                                                               \
    } while (0)

#define K4_TILE(NAME, WBLK, Q5)                                                                 \
    AI void NAME(int RT, int TT, int64_t n, const uint8_t *w, size_t rb, const uint8_t *a,      \
                 size_t ab, float *out) {                                                       \
        __m256 acc[4][4], accm[4][4];                                                           \
        UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++) {               \
            acc[r][t] = _mm256_setzero_ps();                                                    \
            accm[r][t] = _mm256_setzero_ps();                                                   \
        }                                                                                       \
        const __m256i m4 = _mm256_set1_epi8(0xF);                                               \
        for (int64_t i = 0; i < n / KV_QK_K; i++) {                                             \
            UNROLL for (int r = 0; r < RT; r++) { /* the row tile KV_KPF_TILES ahead */         \
                const char *nx = (const char *)((const WBLK *)(w + (r + KV_KPF_TILES * RT) * rb) + i);         \
                _mm_prefetch(nx, _MM_HINT_T0);                                                  \
                _mm_prefetch(nx + 64, _MM_HINT_T0);                                             \
                _mm_prefetch(nx + sizeof(WBLK) - 1, _MM_HINT_T0);                               \
            }                                                                                   \
            __m256i isum[4][4];                                                                 \
            __m256i s16[4], mdup[4];                                                            \
            UNROLL for (int r = 0; r < RT; r++) {                                               \
                const WBLK *x = (const WBLK *)(w + r * rb) + i;                                 \
                k4_scale_vecs(x->scales, &s16[r], &mdup[r]);                                    \
                UNROLL for (int t = 0; t < TT; t++) isum[r][t] = _mm256_setzero_si256();        \
            }                                                                                   \
            /* one token: the quarters unrolled (constant shuffles); more: rolled, which\
             * keeps the tile's registers (measured: +15% decode, -7% prefill unrolled) */\
            if (RT * TT <= 2) {                                                                 \
                UNROLL for (int c = 0; c < 4; c++) K4_QUARTER(WBLK, Q5, c);                      \
            } else {                                                                            \
                for (int c = 0; c < 4; c++) K4_QUARTER(WBLK, Q5, c);                             \
            }                                                                                   \
            UNROLL for (int r = 0; r < RT; r++) {                                               \
                const WBLK *x = (const WBLK *)(w + r * rb) + i;                                 \
                uint32_t dpair; /* d and dmin, adjacent fp16: one conversion */                 \
                memcpy(&dpair, &x->d, 4);                                                       \
                const __m128 ddm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dpair));                 \
                UNROLL for (int t = 0; t < TT; t++) {                                           \
                    const kv_block_q8_K *y = (const kv_block_q8_K *)(a + t * ab) + i;           \
                    __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);                 \
                    __m256i mp = _mm256_madd_epi16(bs, mdup[r]);                                \
                    /* [y->d * d, y->d * dmin]: the same rounded products as two scalars */     \
                    const __m256 p = _mm256_castps128_ps256(_mm_mul_ps(ddm, _mm_set1_ps(y->d))); \
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][t]),                 \
                                                _mm256_broadcastss_ps(_mm256_castps256_ps128(p)), acc[r][t]); \
                    accm[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mp),                        \
                                                 _mm256_permutevar8x32_ps(p, _mm256_set1_epi32(1)), accm[r][t]); \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++)                 \
            out[r * TT + t] = hsum_ps(_mm256_sub_ps(acc[r][t], accm[r][t]));                    \
    }

K4_TILE(q4_K_tile, kv_block_q4_K, 0)
K4_TILE(q5_K_tile, kv_block_q5_K, 1)

/* Bits 2k, 2k+1 of every byte of qh at bits 4, 5 (the high two bits of a
 * 6-bit q6_K value): one shift (none for k = 2) and one mask. The 16-bit
 * shifts move bits across bytes only into bits the mask clears. */
AI __m256i q6_hi(__m256i qh, int k) {
    const __m256i m30 = _mm256_set1_epi8(0x30);
    return _mm256_and_si256(k == 0 ? _mm256_slli_epi16(qh, 4) : k == 1 ? _mm256_slli_epi16(qh, 2)
                            : k == 2 ? qh : _mm256_srli_epi16(qh, 2), m30);
}

AI void q6_K_tile(int RT, int TT, int64_t n, const uint8_t *w, size_t rb, const uint8_t *a,
                  size_t ab, float *out) {
    __m256 acc[4][4];
    UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++) acc[r][t] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0xF);
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        UNROLL for (int r = 0; r < RT; r++) { /* the row tile KV_KPF_TILES ahead */
            const char *nx = (const char *)((const kv_block_q6_K *)(w + (r + KV_KPF_TILES * RT) * rb) + i);
            _mm_prefetch(nx, _MM_HINT_T0);
            _mm_prefetch(nx + 64, _MM_HINT_T0);
            _mm_prefetch(nx + 128, _MM_HINT_T0);
            _mm_prefetch(nx + sizeof(kv_block_q6_K) - 1, _MM_HINT_T0);
        }
        __m256i isum[4][4], sc16[4];
        UNROLL for (int r = 0; r < RT; r++) {
            const kv_block_q6_K *x = (const kv_block_q6_K *)(w + r * rb) + i;
            sc16[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x->scales));
            UNROLL for (int t = 0; t < TT; t++) isum[r][t] = _mm256_setzero_si256();
        }
        UNROLL for (int h = 0; h < 2; h++) { /* unrolled: the shuffles and shifts below are constants */
            /* s16 of quarter k: scale 8h+2k in the low 128 bits, 8h+2k+1 in the high */
            __m256i sh[4];
            UNROLL for (int r = 0; r < RT; r++)
                sh[r] = h ? _mm256_permute2x128_si256(sc16[r], sc16[r], 0x11)
                          : _mm256_permute2x128_si256(sc16[r], sc16[r], 0x00);
            UNROLL for (int k = 0; k < 4; k++) {
                __m256i yv[4];
                UNROLL for (int t = 0; t < TT; t++) {
                    const kv_block_q8_K *y = (const kv_block_q8_K *)(a + t * ab) + i;
                    yv[t] = _mm256_loadu_si256((const __m256i *)(y->qs + 128 * h + 32 * k));
                }
                const __m256i pick = _mm256_setr_epi8(4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1,
                                                      4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1,
                                                      4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3,
                                                      4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3);
                UNROLL for (int r = 0; r < RT; r++) {
                    const kv_block_q6_K *x = (const kv_block_q6_K *)(w + r * rb) + i;
                    __m256i ql = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h + 32 * (k & 1)));
                    __m256i qh = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * h));
                    __m256i lo = (k & 2) ? _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4) : _mm256_and_si256(ql, m4);
                    __m256i q = _mm256_or_si256(lo, q6_hi(qh, k));
                    __m256i s16 = _mm256_shuffle_epi8(sh[r], pick);
                    UNROLL for (int t = 0; t < TT; t++) {
                        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, yv[t]), s16);
                        isum[r][t] = _mm256_add_epi32(isum[r][t], p);
                        KM_KEEP(isum[r][t]);
                    }
                }
            }
        }
        UNROLL for (int r = 0; r < RT; r++) {
            const kv_block_q6_K *x = (const kv_block_q6_K *)(w + r * rb) + i;
            float d = h2f(x->d);
            UNROLL for (int t = 0; t < TT; t++) {
                const kv_block_q8_K *y = (const kv_block_q8_K *)(a + t * ab) + i;
                __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);
                __m256i mp = _mm256_madd_epi16(bs, sc16[r]);
                __m256i is = _mm256_sub_epi32(isum[r][t], _mm256_slli_epi32(mp, 5));
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(y->d * d), acc[r][t]);
            }
        }
    }
    UNROLL for (int r = 0; r < RT; r++) UNROLL for (int t = 0; t < TT; t++) out[r * TT + t] = hsum_ps(acc[r][t]);
}

/* ================================================================== */
/* K-quants, several tokens: one row x up to 8 tokens                  */
/*
 * The RT x TT tiles above spend most of their instructions outside the
 * multiplies (unpacking, scale shuffles, the per-super-block float steps,
 * register spills of a 2 x 3 tile), so several tokens ran at ~60% of the
 * two multiply pipes. Here one weight row meets up to 8 tokens: each
 * 32-value sub-block is unpacked and its scale broadcast once, then every
 * token is a maddubs with the activations as a memory operand, a madd with
 * the scale and an add (8 int32 accumulators in registers). Same int32
 * lane sums per super-block as the tiles (integer adds in another order)
 * and the same float steps, so the same bits. Tokens are split into the
 * fewest tiles of at most 8, as even as possible; the token tiles are the
 * outer loop, so a tile's activations stay in L1 while the rows stream.
 */
#define KM_TT 8
/* most super-blocks per row for KM_MAT (n <= 16384); longer rows use the tiles */
#define KM_MAX_SB 64

#define K4M_TILE(NAME, WBLK, Q5)                                                                \
    AI void NAME(const int TT, int64_t nsb, const uint8_t *w, size_t rb, const uint8_t *a,      \
                 size_t ab, const float *yd, float *out) {                                      \
        __m256 acc[KM_TT], accm[KM_TT];                                                         \
        UNROLL for (int t = 0; t < TT; t++) acc[t] = accm[t] = _mm256_setzero_ps();             \
        const __m256i m4 = _mm256_set1_epi8(0xF);                                               \
        for (int64_t i = 0; i < nsb; i++) {                                                     \
            const WBLK *x = (const WBLK *)(const void *)w + i;                                  \
            _mm_prefetch((const char *)(x) + rb, _MM_HINT_T0); /* the next row */               \
            _mm_prefetch((const char *)(x) + rb + 64, _MM_HINT_T0);                             \
            _mm_prefetch((const char *)(x) + rb + sizeof(WBLK) - 1, _MM_HINT_T0);               \
            __m256i s16, mdup;                                                                  \
            k4_scale_vecs(x->scales, &s16, &mdup);                                              \
            __m256i isum[KM_TT];                                                                \
            UNROLL for (int t = 0; t < TT; t++) isum[t] = _mm256_setzero_si256();               \
            UNROLL for (int c = 0; c < 4; c++) {                                                \
                const __m256i qv = _mm256_loadu_si256((const __m256i *)(const void *)(x->qs + 32 * c)); \
                __m256i lo = _mm256_and_si256(qv, m4);                                          \
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qv, 4), m4);                    \
                if (Q5) {                                                                       \
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(const void *)((const kv_block_q5_K *)(const void *)x)->qh); \
                    lo = _mm256_or_si256(lo, q5_hi(qh, 2 * c));                                 \
                    hi = _mm256_or_si256(hi, q5_hi(qh, 2 * c + 1));                             \
                }                                                                               \
                const __m256i s0 = _mm256_shuffle_epi8(s16, _mm256_set1_epi16((short)(0x0100 * (4 * c + 1) + 4 * c))); \
                UNROLL for (int t = 0; t < TT; t++) {                                           \
                    const kv_block_q8_K *y = (const kv_block_q8_K *)(const void *)(a + t * ab) + i; \
                    const __m256i yv = _mm256_loadu_si256((const __m256i *)(const void *)(y->qs + 64 * c)); \
                    isum[t] = I16DOT(isum[t], _mm256_maddubs_epi16(lo, yv), s0); \
                    KM_KEEP(isum[t]);                                                           \
                }                                                                               \
                const __m256i s1 = _mm256_shuffle_epi8(s16, _mm256_set1_epi16((short)(0x0100 * (4 * c + 3) + 4 * c + 2))); \
                UNROLL for (int t = 0; t < TT; t++) {                                           \
                    const kv_block_q8_K *y = (const kv_block_q8_K *)(const void *)(a + t * ab) + i; \
                    const __m256i yv = _mm256_loadu_si256((const __m256i *)(const void *)(y->qs + 64 * c + 32)); \
                    isum[t] = I16DOT(isum[t], _mm256_maddubs_epi16(hi, yv), s1); \
                    KM_KEEP(isum[t]);                                                           \
                }                                                                               \
            }                                                                                   \
            _Alignas(32) float dd[2 * KM_TT]; /* y->d * d and y->d * dmin of the 8 tokens */    \
            const __m256 ydv = _mm256_load_ps(yd + KM_TT * i);                                   \
            _mm256_store_ps(dd, _mm256_mul_ps(_mm256_set1_ps(h2f(x->d)), ydv));                  \
            _mm256_store_ps(dd + KM_TT, _mm256_mul_ps(_mm256_set1_ps(h2f(x->dmin)), ydv));       \
            UNROLL for (int t = 0; t < TT; t++) {                                               \
                const kv_block_q8_K *y = (const kv_block_q8_K *)(const void *)(a + t * ab) + i; \
                const __m256i mp = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(const void *)y->bsums), mdup); \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_broadcast_ss(dd + t), acc[t]); \
                accm[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mp), _mm256_broadcast_ss(dd + KM_TT + t), accm[t]); \
            }                                                                                   \
        }                                                                                       \
        UNROLL for (int t = 0; t < TT; t++) out[t] = hsum_ps(_mm256_sub_ps(acc[t], accm[t]));   \
    }

K4M_TILE(q4_K_mtile, kv_block_q4_K, 0)
K4M_TILE(q5_K_mtile, kv_block_q5_K, 1)

AI void q6_K_mtile(const int TT, int64_t nsb, const uint8_t *w, size_t rb, const uint8_t *a, size_t ab,
                   const float *yd, float *out) {
    __m256 acc[KM_TT];
    UNROLL for (int t = 0; t < TT; t++) acc[t] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0xF);
    for (int64_t i = 0; i < nsb; i++) {
        const kv_block_q6_K *x = (const kv_block_q6_K *)(const void *)w + i;
        _mm_prefetch((const char *)x + rb, _MM_HINT_T0); /* the next row */
        _mm_prefetch((const char *)x + rb + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)x + rb + 128, _MM_HINT_T0);
        _mm_prefetch((const char *)x + rb + sizeof(kv_block_q6_K) - 1, _MM_HINT_T0);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)x->scales));
        __m256i isum[KM_TT];
        UNROLL for (int t = 0; t < TT; t++) isum[t] = _mm256_setzero_si256();
        UNROLL for (int h = 0; h < 2; h++) {
            const __m256i sh = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11) : _mm256_permute2x128_si256(sc16, sc16, 0x00);
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(const void *)(x->qh + 32 * h));
            UNROLL for (int k = 0; k < 4; k++) {
                const __m256i ql = _mm256_loadu_si256((const __m256i *)(const void *)(x->ql + 64 * h + 32 * (k & 1)));
                const __m256i lo = (k & 2) ? _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4) : _mm256_and_si256(ql, m4);
                const __m256i q = _mm256_or_si256(lo, q6_hi(qh, k));
                const __m256i pick = _mm256_setr_epi8(4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1,
                                                      4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1,
                                                      4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3,
                                                      4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3);
                const __m256i s16 = _mm256_shuffle_epi8(sh, pick);
                UNROLL for (int t = 0; t < TT; t++) {
                    const kv_block_q8_K *y = (const kv_block_q8_K *)(const void *)(a + t * ab) + i;
                    const __m256i yv = _mm256_loadu_si256((const __m256i *)(const void *)(y->qs + 128 * h + 32 * k));
                    isum[t] = I16DOT(isum[t], _mm256_maddubs_epi16(q, yv), s16);
                    KM_KEEP(isum[t]);
                }
            }
        }
        _Alignas(32) float dd[KM_TT]; /* y->d * d of the 8 tokens */
        _mm256_store_ps(dd, _mm256_mul_ps(_mm256_set1_ps(h2f(x->d)), _mm256_load_ps(yd + KM_TT * i)));
        UNROLL for (int t = 0; t < TT; t++) {
            const kv_block_q8_K *y = (const kv_block_q8_K *)(const void *)(a + t * ab) + i;
            const __m256i mp = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(const void *)y->bsums), sc16);
            const __m256i is = _mm256_sub_epi32(isum[t], _mm256_slli_epi32(mp, 5));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_broadcast_ss(dd + t), acc[t]);
        }
    }
    UNROLL for (int t = 0; t < TT; t++) out[t] = hsum_ps(acc[t]);
}

/* Rows [r0,r1) x tokens, n_tok >= 2: rows in chunks of about 512 KiB of
 * weights (read from memory once, then from L2 by every token tile); per
 * chunk, token tiles of at most KM_TT, split as evenly as possible, outer;
 * the rows inner. */
#define KM_CASE(TILE, c)                                                                        \
    case c:                                                                                     \
        for (int64_t r = rc; r < rc_end; r++) {                                                 \
            TILE(c, nsb, wb + (size_t)r * row_bytes, row_bytes, ab + (size_t)t * a_stride, a_stride, yd, o); \
            for (int j = 0; j < (c); j++) Y[(size_t)(t + j) * y_stride + r] = o[j];             \
        }                                                                                       \
        break
#define KM_MAT(NAME, TILE)                                                                      \
    static void NAME(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1, const void *A, \
                     size_t a_stride, int64_t n_tok, float *Y, size_t y_stride) {               \
        const uint8_t *wb = (const uint8_t *)W, *ab = (const uint8_t *)A;                       \
        const int64_t nsb = n / KV_QK_K, nj = (n_tok + KM_TT - 1) / KM_TT;                      \
        const int64_t rows_chunk = (int64_t)((512u << 10) / row_bytes) + 1;                     \
        float o[KM_TT];                                                                         \
        _Alignas(32) float yd[KM_TT * KM_MAX_SB]; /* block-major scales of the tile's tokens */ \
        for (int64_t rc = r0; rc < r1; rc += rows_chunk) {                                      \
            const int64_t rc_end = rc + rows_chunk < r1 ? rc + rows_chunk : r1;                 \
            int64_t t = 0;                                                                      \
            for (int64_t j_ = 0; j_ < nj; j_++) {                                               \
                const int64_t left = nj - j_, tt = (n_tok - t + left - 1) / left;              \
                for (int64_t i = 0; i < nsb; i++)                                               \
                    for (int64_t k = 0; k < KM_TT; k++)                                         \
                        yd[KM_TT * i + k] = k < tt ? ((const kv_block_q8_K *)(const void *)(ab + (size_t)(t + k) * a_stride))[i].d : 0.0f; \
                switch (tt) {                                                                   \
                    KM_CASE(TILE, 1); KM_CASE(TILE, 2); KM_CASE(TILE, 3); KM_CASE(TILE, 4);     \
                    KM_CASE(TILE, 5); KM_CASE(TILE, 6); KM_CASE(TILE, 7); KM_CASE(TILE, 8);     \
                default: break;                                                                 \
                }                                                                               \
                t += tt;                                                                        \
            }                                                                                   \
        }                                                                                       \
    }

KM_MAT(q4_K_mmat, q4_K_mtile)
KM_MAT(q5_K_mmat, q5_K_mtile)
KM_MAT(q6_K_mmat, q6_K_mtile)

/* ================================================================== */
/* vec_dot and mat entry points                                         */

/* T##_dot (the 1x1 tile) and T##_mat (DRIVER over RT x TT tiles) of a type */
#define ENTRY_WITH(DRIVER, T, TILE, RT, TT, RT1)                                                \
    static void T##_dot(int64_t n, float *s, const void *w, const void *a) {                    \
        TILE(1, 1, n, (const uint8_t *)w, 0, (const uint8_t *)a, 0, s);                         \
    }                                                                                           \
    static void T##_mat(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1,     \
                        const void *A, size_t a_stride, int64_t n_tok, float *Y, size_t y_stride) { \
        _Static_assert((RT) <= 4 && (TT) <= 4 && (RT1) <= 4, "tile too big");                   \
        DRIVER(T##_F, RT, TT, RT1);                                                             \
    }
#define ENTRY_EVEN(T, TILE, RT, TT, RT1) ENTRY_WITH(KV_MAT_DRIVER_EVEN, T, TILE, RT, TT, RT1)
#define ENTRY(T, TILE, RT, TT, RT1) ENTRY_WITH(KV_MAT_DRIVER, T, TILE, RT, TT, RT1)

/* The tile F(rt, tt, w, a, o) call used by KV_MAT_DRIVER, per type. */
#define f32_F(rt, tt, w, a, o) f32_tile(rt, tt, n, w, row_bytes, a, a_stride, o)
#define f16_F(rt, tt, w, a, o) f16_tile(rt, tt, n, w, row_bytes, a, a_stride, o)
#define bf16_F(rt, tt, w, a, o) bf16_tile(rt, tt, n, w, row_bytes, a, a_stride, o)
#define q4_0_F(rt, tt, w, a, o) q4_0_tile(rt, tt, n, w, row_bytes, a, a_stride, o)
#define q4_K_F(rt, tt, w, a, o) q4_K_tile(rt, tt, n, w, row_bytes, a, a_stride, o)
#define q5_K_F(rt, tt, w, a, o) q5_K_tile(rt, tt, n, w, row_bytes, a, a_stride, o)
#define q6_K_F(rt, tt, w, a, o) q6_K_tile(rt, tt, n, w, row_bytes, a, a_stride, o)

/* f32, one token: 2-row tiles (two fma chains: 64 GB/s from L2) whose
 * next tile is prefetched as one sequential sweep; 4 rows read side by
 * side streamed 20-25% below one sequential read on Zen 5. f16/bf16 keep
 * 4 (2 chains would be 32 GB/s of their rows, at the memory's speed). */
ENTRY(f32, f32_tile, 3, 4, 2)
ENTRY(f16, f16_tile, 3, 4, 4)
ENTRY(bf16, bf16_tile, 3, 4, 4)
ENTRY(q4_0, q4_0_tile, 2, 3, 1)
ENTRY_EVEN(q4_K, q4_K_tile, 2, 3, 1)
ENTRY_EVEN(q5_K, q5_K_tile, 2, 3, 1)
ENTRY_EVEN(q6_K, q6_K_tile, 2, 3, 1)

/* one token: the RT x TT driver's one-row tiles (they stream best from memory); several: KM_MAT */
#define KM_PICK(T)                                                                              \
    static void T##_matx(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1, const void *A, \
                         size_t a_stride, int64_t n_tok, float *Y, size_t y_stride) {           \
        (n_tok < 2 || n / KV_QK_K > KM_MAX_SB ? T##_mat : T##_mmat)(W, row_bytes, n, r0, r1, A, a_stride, n_tok, Y, y_stride); \
    }
KM_PICK(q4_K)
KM_PICK(q5_K)
KM_PICK(q6_K)

#ifndef KV_AVX2_VNNI /* the float kernels: once, in the AVX2 file */
/* ================================================================== */
/* attention weighted sum: o[i] = fma chain over p (quant/vec.h)        */

void kv_f32_wsum_avx2(float *o, const float *w, const float *V, size_t v_stride, int64_t n_rows,
                      int64_t n, int acc0) {
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m256 acc[8];
        UNROLL for (int k = 0; k < 8; k++) acc[k] = acc0 ? _mm256_loadu_ps(o + i + 8 * k) : _mm256_setzero_ps();
        for (int64_t p = 0; p < n_rows; p++) {
            const float *v = V + (size_t)p * v_stride + i;
            __m256 wp = _mm256_broadcast_ss(w + p);
            UNROLL for (int k = 0; k < 8; k++) acc[k] = _mm256_fmadd_ps(wp, _mm256_loadu_ps(v + 8 * k), acc[k]);
        }
        UNROLL for (int k = 0; k < 8; k++) _mm256_storeu_ps(o + i + 8 * k, acc[k]);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 acc = acc0 ? _mm256_loadu_ps(o + i) : _mm256_setzero_ps();
        for (int64_t p = 0; p < n_rows; p++)
            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(w + p), _mm256_loadu_ps(V + (size_t)p * v_stride + i), acc);
        _mm256_storeu_ps(o + i, acc);
    }
    for (; i < n; i++) {
        float acc = acc0 ? o[i] : 0.0f;
        for (int64_t p = 0; p < n_rows; p++) acc = fmaf(w[p], V[(size_t)p * v_stride + i], acc);
        o[i] = acc;
    }
}

/* Several queries' weighted sums over the same V rows (quant/vec.h): the
 * fma chain of kv_f32_wsum_avx2 per element, each V load shared by up to
 * 4 queries (16 columns x 4 queries = 8 ymm accumulators). */
/* Fewer than 16 columns (the last, partial block of attention scores):
 * the same 2 x ymm per query under lane masks, QT (4 or 1) queries per
 * pass. */
AI void wsum_narrow(float *o, size_t o_stride, const float *w, size_t w_stride, int QT, const float *V,
                    size_t v_stride, int64_t n_rows, __m256i m0, __m256i m1, int acc0) {
    __m256 acc[4][2];
    UNROLL for (int j = 0; j < 4; j++)
        if (j < QT) {
            acc[j][0] = acc0 ? _mm256_maskload_ps(o + (size_t)j * o_stride, m0) : _mm256_setzero_ps();
            acc[j][1] = acc0 ? _mm256_maskload_ps(o + (size_t)j * o_stride + 8, m1) : _mm256_setzero_ps();
        }
    for (int64_t p = 0; p < n_rows; p++) {
        const float *v = V + (size_t)p * v_stride;
        const __m256 v0 = _mm256_maskload_ps(v, m0), v1 = _mm256_maskload_ps(v + 8, m1);
        UNROLL for (int j = 0; j < 4; j++)
            if (j < QT) {
                const __m256 wp = _mm256_broadcast_ss(w + (size_t)j * w_stride + p);
                acc[j][0] = _mm256_fmadd_ps(wp, v0, acc[j][0]);
                acc[j][1] = _mm256_fmadd_ps(wp, v1, acc[j][1]);
            }
    }
    UNROLL for (int j = 0; j < 4; j++)
        if (j < QT) {
            _mm256_maskstore_ps(o + (size_t)j * o_stride, m0, acc[j][0]);
            _mm256_maskstore_ps(o + (size_t)j * o_stride + 8, m1, acc[j][1]);
        }
}

void kv_f32_wsum_multi_avx2(float *o, size_t o_stride, const float *w, size_t w_stride, int64_t n_q,
                            const float *V, size_t v_stride, int64_t n_rows, int64_t n, int acc0) {
    int64_t q0 = 0;
    if (n < 16) {
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lane),
                      m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n - 8), lane);
        for (; q0 + 4 <= n_q; q0 += 4)
            wsum_narrow(o + (size_t)q0 * o_stride, o_stride, w + (size_t)q0 * w_stride, w_stride, 4, V, v_stride,
                        n_rows, m0, m1, acc0);
        for (; q0 < n_q; q0++)
            wsum_narrow(o + (size_t)q0 * o_stride, o_stride, w + (size_t)q0 * w_stride, w_stride, 1, V, v_stride,
                        n_rows, m0, m1, acc0);
        return;
    }
    for (; q0 + 4 <= n_q && n >= 16; q0 += 4) {
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            __m256 acc[4][2];
            UNROLL for (int j = 0; j < 4; j++) UNROLL for (int k = 0; k < 2; k++) acc[j][k] =
                acc0 ? _mm256_loadu_ps(o + (size_t)(q0 + j) * o_stride + i + 8 * k) : _mm256_setzero_ps();
            for (int64_t p = 0; p < n_rows; p++) {
                const float *v = V + (size_t)p * v_stride + i;
                const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
                UNROLL for (int j = 0; j < 4; j++) {
                    const __m256 wp = _mm256_broadcast_ss(w + (size_t)(q0 + j) * w_stride + p);
                    acc[j][0] = _mm256_fmadd_ps(wp, v0, acc[j][0]);
                    acc[j][1] = _mm256_fmadd_ps(wp, v1, acc[j][1]);
                }
            }
            UNROLL for (int j = 0; j < 4; j++) UNROLL for (int k = 0; k < 2; k++)
                _mm256_storeu_ps(o + (size_t)(q0 + j) * o_stride + i + 8 * k, acc[j][k]);
        }
        if (i < n)
            for (int j = 0; j < 4; j++)
                kv_f32_wsum_avx2(o + (size_t)(q0 + j) * o_stride + i, w + (size_t)(q0 + j) * w_stride, V + i,
                                 v_stride, n_rows, n - i, acc0);
    }
    for (; q0 < n_q; q0++)
        kv_f32_wsum_avx2(o + (size_t)q0 * o_stride, w + (size_t)q0 * w_stride, V, v_stride, n_rows, n, acc0);
}

/* ================================================================== */
/* softmax (quant/vec.h): kv_exp_ref's operations on 8 lanes            */

AI __m256 exp8(__m256 y) {
    const __m256 magic = _mm256_set1_ps(KV_EXP_MAGIC);
    const __m256 t = _mm256_fmadd_ps(y, _mm256_set1_ps(KV_EXP_L2E), magic), f = _mm256_sub_ps(t, magic);
    __m256 r = _mm256_fmadd_ps(f, _mm256_set1_ps(-KV_EXP_LN2_HI), y);
    r = _mm256_fmadd_ps(f, _mm256_set1_ps(-KV_EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(KV_EXP_C7);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KV_EXP_C6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KV_EXP_C5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KV_EXP_C4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KV_EXP_C3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KV_EXP_C2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KV_EXP_C1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(KV_EXP_C0));
    const __m256i sb = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(0x4B400000)), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(sb));
    return _mm256_andnot_ps(_mm256_cmp_ps(y, _mm256_set1_ps(KV_EXP_MIN), _CMP_LT_OQ), e);
}

/* silu as the reference: -x (the sign flipped); past KV_EXP_MAX x * 0,
 * else the same exp, one add, one correctly rounded divide (the exp's input
 * clamped so those lanes compute something finite; vminps keeps a NaN's
 * lane on the divide, whose NaN is x's, as in the reference). */
void kv_f32_silu_avx2(float *y, const float *x, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), mx = _mm256_set1_ps(KV_EXP_MAX), sg = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i), nv = _mm256_xor_ps(v, sg);
        const __m256 e = exp8(_mm256_min_ps(nv, mx));
        const __m256 r = _mm256_div_ps(v, _mm256_add_ps(one, e));
        _mm256_storeu_ps(y + i, _mm256_blendv_ps(r, _mm256_mul_ps(v, _mm256_setzero_ps()),
                                                 _mm256_cmp_ps(nv, mx, _CMP_GT_OQ)));
    }
    if (i < n) kv_f32_silu_ref(y + i, x + i, n - i);
}

void kv_f32_softmax_avx2(float *x, int64_t n, float scale) {
    const __m256 sc = _mm256_set1_ps(scale);
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), sc);
        _mm256_storeu_ps(x + i, v);
        m = _mm256_max_ps(v, m); /* v > m ? v : m, lane by lane */
    }
    _Alignas(32) float m8[8];
    _mm256_store_ps(m8, m);
    for (; i < n; i++) {
        x[i] *= scale;
        m8[i & 7] = x[i] > m8[i & 7] ? x[i] : m8[i & 7];
    }
    float max = -INFINITY;
    for (int l = 0; l < 8; l++) max = m8[l] > max ? m8[l] : max;
    const __m256 mx = _mm256_set1_ps(max);
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mx));
        _mm256_storeu_ps(x + i, e);
        s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    _Alignas(32) double l8[8];
    _mm256_store_pd(l8, s0);
    _mm256_store_pd(l8 + 4, s1);
    for (; i < n; i++) {
        const float e = kv_exp_ref(x[i] - max);
        x[i] = e;
        l8[i & 7] += (double)e;
    }
    const double sum = ((l8[0] + l8[4]) + (l8[2] + l8[6])) + ((l8[1] + l8[5]) + (l8[3] + l8[7]));
    const __m256 inv = _mm256_set1_ps((float)(1.0 / sum));
    for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    for (; i < n; i++) x[i] *= _mm256_cvtss_f32(inv);
}

/* ================================================================== */
/* gated delta-rule step (quant/vec.h): rows in groups of 4 for ILP, each
 * row's dots in one 8-lane accumulator (lane i%8, fma in increasing i, then
 * the kv_hsum8 tree), exactly the reference order. The decayed state is
 * recomputed in the second pass (same rounded multiply) instead of stored. */

#ifndef KV_DN_PF
#define KV_DN_PF 16 /* rows ahead to prefetch (8 KiB of a 128-wide state) */
#endif
#define KV_DN_ROWS_ST(R, STORE)                                                                    \
    do {                                                                                           \
        __m256 acc[R];                                                                             \
        UNROLL for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                           \
        for (int64_t i = 0; i < n; i += 8) {                                                       \
            const __m256 kk = _mm256_loadu_ps(k + i);                                              \
            if (!(i & 15)) /* the rows KV_DN_PF ahead (past the state's end: a harmless hint) */    \
                UNROLL for (int r = 0; r < R; r++)                                                 \
                    _mm_prefetch((const char *)(s + (r + KV_DN_PF) * n + i), _MM_HINT_T0);          \
            UNROLL for (int r = 0; r < R; r++)                                                     \
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s + r * n + i), dec), kk, acc[r]); \
        }                                                                                          \
        __m256 dd[R];                                                                              \
        UNROLL for (int r = 0; r < R; r++) {                                                       \
            dd[r] = _mm256_set1_ps((v[j + r] - hsum_ps(acc[r])) * beta);                           \
            acc[r] = _mm256_setzero_ps();                                                          \
        }                                                                                          \
        for (int64_t i = 0; i < n; i += 8) {                                                       \
            const __m256 kk = _mm256_loadu_ps(k + i), qq = _mm256_loadu_ps(q + i);                 \
            UNROLL for (int r = 0; r < R; r++) {                                                   \
                const __m256 m = _mm256_fmadd_ps(kk, dd[r], _mm256_mul_ps(_mm256_loadu_ps(s + r * n + i), dec)); \
                STORE(d + r * n + i, m);                                                           \
                acc[r] = _mm256_fmadd_ps(m, qq, acc[r]);                                           \
            }                                                                                      \
        }                                                                                          \
        UNROLL for (int r = 0; r < R; r++) o[j + r] = hsum_ps(acc[r]) * scale;                     \
    } while (0)

/* Every row of a delta step, four at a time, then the rest; STORE writes D. */
#define KV_DN_ALL(STORE)                                                                           \
    do {                                                                                           \
        const __m256 dec = _mm256_set1_ps(decay);                                                  \
        int64_t j = 0;                                                                             \
        for (; j + 4 <= n_rows; j += 4) {                                                          \
            const float *s = S + (size_t)j * (size_t)n;                                            \
            float *d = D + (size_t)j * (size_t)n;                                                  \
            KV_DN_ROWS_ST(4, STORE);                                                               \
        }                                                                                          \
        for (; j < n_rows; j++) {                                                                  \
            const float *s = S + (size_t)j * (size_t)n;                                            \
            float *d = D + (size_t)j * (size_t)n;                                                  \
            KV_DN_ROWS_ST(1, STORE);                                                               \
        }                                                                                          \
    } while (0)

void kv_f32_delta_avx2(const float *S, float *D, int64_t n_rows, int64_t n, const float *k,
                       const float *q, const float *v, float decay, float beta, float scale, float *o) {
    if (n % 8) {
        kv_f32_delta_ref(S, D, n_rows, n, k, q, v, decay, beta, scale, o);
        return;
    }
    KV_DN_ALL(_mm256_storeu_ps);
}

/* The same step with D written by streaming (non-temporal) stores, for a
 * state larger than the caches that is read again only at the next token:
 * no read-for-ownership of D's lines, a third less memory traffic. D must
 * not be S and must be 32-byte aligned with n % 8 == 0 (else the plain
 * kernel); same arithmetic, same bits. */
void kv_f32_delta_stream_avx2(const float *S, float *D, int64_t n_rows, int64_t n, const float *k,
                              const float *q, const float *v, float decay, float beta, float scale, float *o) {
    if (n % 8 || S == D || ((uintptr_t)D & 31)) {
        kv_f32_delta_avx2(S, D, n_rows, n, k, q, v, decay, beta, scale, o);
        return;
    }
    KV_DN_ALL(_mm256_stream_ps);
    _mm_sfence(); /* the streamed rows ordered before whatever hands them on */
}

#endif /* KV_AVX2_VNNI */

/* ================================================================== */
/* activation quantizers                                                */

/* As the reference (ggml's x86 quantize_row_q8_0), bit for bit. */
static void q8_0_from_float(const float *src, void *dst, int64_t n) {
    kv_block_q8_0 *b = dst;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < n / 32; i++) {
        const float *x = src + 32 * i;
        __m256 v[4];
        __m256 mx = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(x + 8 * k);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[k]));
        }
        __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        b[i].d = kv_fp32_to_fp16(amax / 127.f);
        __m256 id = _mm256_set1_ps(amax != 0.0f ? 127.f / amax : 0.0f);
        __m256i q[4];
        for (int k = 0; k < 4; k++)
            q[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)b[i].qs, p);
    }
}

/* As the reference quantize_row_q8_K: the first value of largest magnitude
 * sets iscale = -127/max. */
static void q8_K_from_float(const float *src, void *dst, int64_t n) {
    kv_block_q8_K *b = dst;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        const float *x = src + KV_QK_K * i;
        __m256 mx = _mm256_setzero_ps();
        for (int k = 0; k < 32; k++) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * k)));
        __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        if (amax == 0) {
            memset(&b[i], 0, sizeof b[i]);
            continue;
        }
        float max = 0;
        __m256 am = _mm256_set1_ps(amax);
        for (int k = 0; k < 32; k++) {
            int msk = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * k)), am, _CMP_EQ_OQ));
            if (msk) { max = x[8 * k + __builtin_ctz((unsigned)msk)]; break; }
        }
        float iscale = -127.f / max;
        __m256 is = _mm256_set1_ps(iscale);
        const __m256i lim = _mm256_set1_epi32(127);
        for (int g = 0; g < 16; g++) {
            __m256i q0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * g), is), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            __m256i q1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * g + 8), is), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            q0 = _mm256_min_epi32(q0, lim);
            q1 = _mm256_min_epi32(q1, lim);
            b[i].bsums[g] = (int16_t)hsum_i32(_mm256_add_epi32(q0, q1));
            __m256i p = _mm256_packs_epi32(q0, q1);            /* 0-3 8-11 | 4-7 12-15 */
            p = _mm256_permute4x64_epi64(p, 0xd8);              /* 0-7 | 8-15 */
            __m128i p8 = _mm_packs_epi16(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
            _mm_storeu_si128((__m128i *)(b[i].qs + 16 * g), p8);
        }
        b[i].d = 1 / iscale;
    }
}

/* RNE like kv_fp32_to_fp16 (NaN payloads aside: hardware keeps them). */
static void f16_from_float(const float *src, void *dst, int64_t n) {
    uint16_t *h = dst;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) h[i] = kv_fp32_to_fp16(src[i]);
}

static void f16_to_float(const void *src, float *dst, int64_t n) {
    const uint16_t *h = src;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, ld_f16(h + i));
    for (; i < n; i++) dst[i] = kv_fp16_to_fp32(h[i]);
}

static void q8_0_to_float(const void *src, float *dst, int64_t n) {
    const kv_block_q8_0 *b = src;
    for (int64_t i = 0; i < n / 32; i++) {
        __m256 d = _mm256_set1_ps(h2f(b[i].d));
        for (int k = 0; k < 4; k++) {
            __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b[i].qs + 8 * k)));
            _mm256_storeu_ps(dst + 32 * i + 8 * k, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
        }
    }
}

#ifdef KV_AVX2_VNNI
void kv_quant_fill_avxvnni(kv_kernels *k) {
#else
void kv_quant_fill_avx2(kv_kernels *k) {
#endif
    k[KV_TYPE_F32].vec_dot = f32_dot;     k[KV_TYPE_F32].mat = f32_mat;
    k[KV_TYPE_F16].vec_dot = f16_dot;     k[KV_TYPE_F16].mat = f16_mat;
    k[KV_TYPE_BF16].vec_dot = bf16_dot;   k[KV_TYPE_BF16].mat = bf16_mat;
    k[KV_TYPE_Q8_0].vec_dot = q8_0_dot;   k[KV_TYPE_Q8_0].mat = q8_0_mat;
    k[KV_TYPE_Q4_0].vec_dot = q4_0_dot;   k[KV_TYPE_Q4_0].mat = q4_0_mat;
    k[KV_TYPE_Q4_K].vec_dot = q4_K_dot;   k[KV_TYPE_Q4_K].mat = q4_K_matx;
    k[KV_TYPE_Q5_K].vec_dot = q5_K_dot;   k[KV_TYPE_Q5_K].mat = q5_K_matx;
    k[KV_TYPE_Q6_K].vec_dot = q6_K_dot;   k[KV_TYPE_Q6_K].mat = q6_K_matx;
    k[KV_TYPE_Q8_0].from_float = q8_0_from_float;
    k[KV_TYPE_Q8_K].from_float = q8_K_from_float;
    k[KV_TYPE_F16].from_float = f16_from_float;
    k[KV_TYPE_F16].to_float = f16_to_float;
    k[KV_TYPE_Q8_0].to_float = q8_0_to_float;
}
