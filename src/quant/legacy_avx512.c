/* AVX-512 (F, BW, DQ, VL, VNNI) kernels of Q5_0, IQ4_NL and MXFP4 against
 * Q8_0 activations; called only after run-time detection. Bit-identical to
 * legacy_ref.c: the canonical order of quant/legacy.h puts block b's 8
 * group sums in lanes 8*(b&1) + g, which is exactly one zmm holding an even
 * block in its low half and the next odd block in its high half. Group sums
 * are one vpdpbusd (u8 x s8, int32 accumulation, no saturation) of |w|
 * against the activation negated where w < 0 (row_tile: vec_dot, and rows
 * past the prepared buffers). A row with an odd block count ends with its
 * last block in the low half alone. One token (decode: dec_rows) and
 * several (tile_rows) take Q4_0's form instead: unsigned u = w + K from
 * prepared -K x group sums, the same integers. Q4_1 and Q5_1 keep the AVX2
 * kernels for several tokens: their order is one 8-lane chain (ggml's),
 * which a zmm cannot split; their one-token kernel (decm_rows) is that
 * chain with ymm vpdpbusd, two rows a pass. */
#include "quant/legacy_x86.h"

#include <string.h>

#define AI LX_AI
#define LX_TT 4 /* tokens per row pass */
#define UNROLL _Pragma("GCC unroll 8")

typedef __m256i (*lx_unpack)(const void *row, int64_t b, float *dw, float *mw);

/* Group sums of signed weights xv (32 or 64 bytes) against activations yv. */
AI __m512i grp(__m512i xv, __m512i yv) {
    const __mmask64 neg = _mm512_movepi8_mask(xv);
    const __m512i sy = _mm512_mask_sub_epi8(yv, neg, _mm512_setzero_si512(), yv);
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(xv), sy);
}

AI __m512 two(float lo, float hi) { return _mm512_insertf32x8(_mm512_set1_ps(lo), _mm256_set1_ps(hi), 1); }

AI __m256i ld_qs(const kv_block_q8_0 *y) { return _mm256_loadu_si256((const __m256i *)y->qs); }

AI void row_tile(lx_unpack un, int TT, int64_t n, const void *w, const uint8_t *a, size_t ab, float *out) {
    __m512 acc[LX_TT];
    UNROLL for (int t = 0; t < TT; t++) acc[t] = _mm512_setzero_ps();
    const int64_t nb = n / 32;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        float dw0, dw1, mw;
        const __m256i x0 = un(w, b, &dw0, &mw), x1 = un(w, b + 1, &dw1, &mw);
        const __m512i xv = _mm512_inserti64x4(_mm512_castsi256_si512(x0), x1, 1);
        UNROLL for (int t = 0; t < TT; t++) {
            const kv_block_q8_0 *y = (const kv_block_q8_0 *)(a + (size_t)t * ab) + b;
            const __m512i yv = _mm512_inserti64x4(_mm512_castsi256_si512(ld_qs(&y[0])), ld_qs(&y[1]), 1);
            const __m512 d = two(dw0 * _cvtsh_ss(y[0].d), dw1 * _cvtsh_ss(y[1].d));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(grp(xv, yv)), d, acc[t]);
        }
    }
    if (b < nb) { /* an even last block: low half only */
        float dw, mw;
        const __m512i xv = _mm512_castsi256_si512(un(w, b, &dw, &mw));
        UNROLL for (int t = 0; t < TT; t++) {
            const kv_block_q8_0 *y = (const kv_block_q8_0 *)(a + (size_t)t * ab) + b;
            const __m512i yv = _mm512_castsi256_si512(ld_qs(y));
            __m256 lo = _mm512_castps512_ps256(acc[t]);
            lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm512_castsi512_si256(grp(xv, yv))),
                                 _mm256_set1_ps(dw * _cvtsh_ss(y->d)), lo);
            acc[t] = _mm512_insertf32x8(acc[t], lo, 0);
        }
    }
    UNROLL for (int t = 0; t < TT; t++) { /* kv_fold16: low + high half, then the kv_hsum8 tree */
        const __m256 f = _mm256_add_ps(_mm512_castps512_ps256(acc[t]), _mm512_extractf32x8_ps(acc[t], 1));
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        out[t] = _mm_cvtss_f32(s);
    }
}

AI void mat(lx_unpack un, const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1, const void *A,
            size_t a_stride, int64_t n_tok, float *Y, size_t y_stride) {
    const uint8_t *wb = W, *ab = A;
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t t = 0; t < n_tok; t += LX_TT) {
            float o[LX_TT];
            const int64_t tt = n_tok - t < LX_TT ? n_tok - t : LX_TT;
            switch (tt) { /* constant TT: the token loop unrolls */
            case 1: row_tile(un, 1, n, wb + r * row_bytes, ab + t * a_stride, a_stride, o); break;
            case 2: row_tile(un, 2, n, wb + r * row_bytes, ab + t * a_stride, a_stride, o); break;
            case 3: row_tile(un, 3, n, wb + r * row_bytes, ab + t * a_stride, a_stride, o); break;
            default: row_tile(un, 4, n, wb + r * row_bytes, ab + t * a_stride, a_stride, o); break;
            }
            for (int64_t j = 0; j < tt; j++) Y[(size_t)(t + j) * y_stride + (size_t)r] = o[j];
        }
    }
}

/* ---- One token (decode) ------------------------------------------------
 * Q4_0's form: the weights made unsigned (u = w + K: Q5_0 q itself, K = 16;
 * IQ4_NL and MXFP4 a table of grid value + 128, K = 128), and the offset
 * removed by starting each group's vpdpbusd from -K * (the group's sum of
 * activations), computed once per call (dec_prep) with the activations
 * copied contiguously and the scales as floats. The group sums are the
 * same exact integers as grp()'s, the float steps the same (lane 8(b&1) + g,
 * fma((float)p, dw * da) in block order), so the same bits. KV_LXD_R rows
 * per pass, taken from as many far-apart parts of the range (sequential
 * streams for memory), sharing the activation loads, their accumulators in
 * registers (the rows' loop unrolled); each prefetches its row KV_LXD_PF
 * rows ahead, one line per block pair. Per row and 8 blocks the 8 scales
 * are gathered from the blocks by one vpermt2w/vpermt2d, converted and
 * multiplied by the 8 da in one step each; a pair's [8 x dw*da, 8 x dw*da]
 * is then one vpermps. The order fixes one fma per block and lane (each
 * block has its own dw * da), so the integer sums cannot be carried across
 * blocks; the 16 lanes are folded once per row. */
#ifndef KV_LXD_PF
#define KV_LXD_PF 8
#endif
#define LXD_PRE (48 * 1024) /* stack buffer: 68 bytes a block, n <= 22,560 */

/* Per-call prepared activations: [nb] 32 quants, [nb] 8 int32 -K*groupsum, [nb] float da. */
typedef struct {
    const int8_t *q;
    const int32_t *ng;
    const float *da;
} lxd_pre;

AI void dec_prep(const uint8_t *a, int64_t nb, int K, uint8_t *buf, lxd_pre *P) {
    int8_t *q = (int8_t *)(void *)buf;
    int32_t *ng = (int32_t *)(void *)(buf + (size_t)nb * 32);
    float *da = (float *)(void *)(buf + (size_t)nb * 64);
    const __m256i kk = _mm256_set1_epi8((char)K);
    for (int64_t b = 0; b < nb; b++) {
        const kv_block_q8_0 *y = (const kv_block_q8_0 *)(const void *)a + b;
        const __m256i yv = ld_qs(y);
        _mm256_storeu_si256((__m256i *)(void *)(q + 32 * b), yv);
        _mm256_storeu_si256((__m256i *)(void *)(ng + 8 * b),
                            _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_dpbusd_epi32(_mm256_setzero_si256(), kk, yv)));
        da[b] = _cvtsh_ss(y->d);
    }
    P->q = q;
    P->ng = ng;
    P->da = da;
}

/* Nibbles of blocks q0 (low 256 bits) and q1 (high), each in element order. */
AI __m512i nib2(const uint8_t *q0, const uint8_t *q1) {
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q0))),
                                         _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q1)), 1);
    const long long f = 0x0004000400040004ll; /* per 128-bit lane: 0, 4, 0, 4 */
    return _mm512_and_si512(_mm512_srlv_epi16(z, _mm512_set_epi64(f, f, 0, 0, f, f, 0, 0)), _mm512_set1_epi8(0xF));
}

/* u = w + K of the blocks at x0 (low 256 bits) and x1 (high; x1 = x0 for a
 * lone block in the low half). */
typedef __m512i (*lxd_unpack)(const uint8_t *x0, const uint8_t *x1);
/* dw * da of the block pair at x (its first 32 bytes hold both scales) as
 * [8 x block b, 8 x block b + 1], da2 the activation scales laid out alike;
 * and the lone block's dw as a float. */
typedef __m512 (*lxd_scale)(const uint8_t *x, __m512 da2);
typedef float (*lxd_dw)(const uint8_t *x);

AI __m512i ud_q5_0(const uint8_t *x0, const uint8_t *x1) {
    const kv_block_q5_0 *a = (const kv_block_q5_0 *)(const void *)x0, *c = (const kv_block_q5_0 *)(const void *)x1;
    const __m512i u = nib2(a->qs, c->qs);
    const __mmask64 hb = (uint64_t)kv_rd_qh(a->qh) | (uint64_t)kv_rd_qh(c->qh) << 32;
    return _mm512_mask_add_epi8(u, hb, u, _mm512_set1_epi8(16));
}
AI __m512i ud_iq4_nl(const uint8_t *x0, const uint8_t *x1) {
    const __m512i tbl = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)kv_iq4nl_values)),
                                         _mm512_set1_epi8((char)0x80)); /* value + 128 */
    return _mm512_shuffle_epi8(tbl, nib2(((const kv_block_iq4_nl *)(const void *)x0)->qs,
                                         ((const kv_block_iq4_nl *)(const void *)x1)->qs));
}
AI __m512i ud_mxfp4(const uint8_t *x0, const uint8_t *x1) {
    const __m512i tbl = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)kv_mxfp4_values)),
                                         _mm512_set1_epi8((char)0x80));
    return _mm512_shuffle_epi8(tbl, nib2(((const kv_block_mxfp4 *)(const void *)x0)->qs,
                                         ((const kv_block_mxfp4 *)(const void *)x1)->qs));
}

/* fp16 scales at bytes 0 and 2*W1 of the pair: one vpermw spreads them to
 * [8 x d0, 8 x d1], one vcvtph2ps widens them (exact), one multiply. */
AI __m512 sc_f16(const uint8_t *x, __m512 da2, int W1) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)x);
    const __m256i idx = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, (short)W1, (short)W1, (short)W1, (short)W1,
                                          (short)W1, (short)W1, (short)W1, (short)W1);
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_permutexvar_epi16(idx, v)), da2);
}
AI __m512 sc_q5_0(const uint8_t *x, __m512 da2) { return sc_f16(x, da2, 11); }   /* 22-byte blocks */
AI __m512 sc_iq4_nl(const uint8_t *x, __m512 da2) { return sc_f16(x, da2, 9); } /* 18-byte blocks */
/* E8M0 bytes at 0 and 17: vpermd puts dword 0 in lanes 0-7 and dword 4
 * (bytes 16-19, e1 in its byte 1) in lanes 8-15, a shift and mask leave e;
 * dw * da = da * 2^(e-128) exactly rounded once, which vscalefps computes
 * (dw = 2^(e-128) is exact, subnormal for e < 2, so the product dw * da is
 * that same correctly rounded value). */
AI __m512 sc_mxfp4(const uint8_t *x, __m512 da2) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)x);
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
    const __m512i sh = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
    const __m512i e = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(idx, _mm512_castsi256_si512(v)), sh),
                                       _mm512_set1_epi32(0xFF));
    return _mm512_scalef_ps(da2, _mm512_cvtepi32_ps(_mm512_sub_epi32(e, _mm512_set1_epi32(128))));
}
/* dw * da of 8 blocks at x (blocks b..b+7 of a row; da8 their activation
 * scales): the 8 scales gathered by vpermt2w/vpermt2d from loads inside the
 * 8 blocks, converted in one step; a pair's [8 x, 8 x] is then one vpermps. */
typedef __m256 (*lxd_scale8)(const uint8_t *x, __m256 da8);
AI __m256 sc8_q5_0(const uint8_t *x, __m256 da8) { /* d at 22k: loads at 0, 48, 112 (176 bytes) */
    const __m512i a = _mm512_loadu_si512((const void *)x), m = _mm512_loadu_si512((const void *)(x + 48)),
                  c = _mm512_loadu_si512((const void *)(x + 112));
    const __m512i i1 = _mm512_castsi128_si512(_mm_setr_epi16(0, 11, 22, 32 + 9, 32 + 20, 32 + 31, 0, 0));
    const __m512i i2 = _mm512_castsi128_si512(_mm_setr_epi16(0, 1, 2, 3, 4, 5, 32 + 10, 32 + 21));
    const __m512i h = _mm512_permutex2var_epi16(_mm512_permutex2var_epi16(a, i1, m), i2, c);
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm512_castsi512_si128(h)), da8);
}
AI __m256 sc8_iq4_nl(const uint8_t *x, __m256 da8) { /* d at 18k: loads at 0, 64 (144 bytes) */
    const __m512i a = _mm512_loadu_si512((const void *)x), c = _mm512_loadu_si512((const void *)(x + 64));
    const __m512i i = _mm512_castsi128_si512(_mm_setr_epi16(0, 9, 18, 27, 32 + 4, 32 + 13, 32 + 22, 32 + 31));
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutex2var_epi16(a, i, c))), da8);
}
AI __m256 sc8_mxfp4(const uint8_t *x, __m256 da8) { /* e at 17k: loads at 0, 64 (136 bytes) */
    const __m512i a = _mm512_loadu_si512((const void *)x), c = _mm512_loadu_si512((const void *)(x + 64));
    const __m512i i = _mm512_setr_epi32(0, 4, 8, 12, 16 + 1, 16 + 5, 16 + 9, 16 + 13, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m256i w = _mm512_castsi512_si256(_mm512_permutex2var_epi32(a, i, c)); /* e_k in byte k & 3 */
    const __m256i e = _mm256_and_si256(_mm256_srlv_epi32(w, _mm256_setr_epi32(0, 8, 16, 24, 0, 8, 16, 24)),
                                       _mm256_set1_epi32(0xFF));
    return _mm256_scalef_ps(da8, _mm256_cvtepi32_ps(_mm256_sub_epi32(e, _mm256_set1_epi32(128)))); /* as sc_mxfp4 */
}

AI float dw_q5_0(const uint8_t *x) { return _cvtsh_ss(((const kv_block_q5_0 *)(const void *)x)->d); }
AI float dw_iq4_nl(const uint8_t *x) { return _cvtsh_ss(((const kv_block_iq4_nl *)(const void *)x)->d); }
AI float dw_mxfp4(const uint8_t *x) { return kv_e8m0_half(x[0]); }

#ifndef KV_LXD_R
#define KV_LXD_R 4 /* rows per pass (far-apart streams) */
#endif

/* R rows w[r] against the prepared token; bs bytes a block. The R rows'
 * loop is unrolled (the accumulators stay in registers). */
AI void dec_rows(lxd_unpack un, lxd_scale sc, lxd_scale8 sc8, lxd_dw dwf, int R, int64_t nb, const uint8_t *const *w, size_t rb,
                 size_t bs, const lxd_pre *P, float *out) {
    __m512 acc[KV_LXD_R];
    UNROLL for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i lo2 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) { /* 8 blocks: the scales of each row in one step */
        const __m256 da8 = _mm256_loadu_ps(P->da + b);
        __m512 s8[KV_LXD_R];
        UNROLL for (int r = 0; r < R; r++) s8[r] = _mm512_castps256_ps512(sc8(w[r] + (size_t)b * bs, da8));
        UNROLL for (int k = 0; k < 4; k++) {
            const int64_t c = b + 2 * k;
            const __m512i yv = _mm512_loadu_si512((const void *)(P->q + 32 * c));
            const __m512i ng = _mm512_loadu_si512((const void *)(P->ng + 8 * c));
            const __m512i ik = _mm512_add_epi32(lo2, _mm512_set1_epi32(2 * k));
            UNROLL for (int r = 0; r < R; r++) {
                const uint8_t *x = w[r] + (size_t)c * bs;
                _mm_prefetch((const char *)(x + KV_LXD_PF * rb), _MM_HINT_T0);
                const __m512i u = un(x, x + bs);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(ng, u, yv)),
                                         _mm512_permutexvar_ps(ik, s8[r]), acc[r]);
            }
        }
    }
    for (; b + 2 <= nb; b += 2) {
        const __m512i yv = _mm512_loadu_si512((const void *)(P->q + 32 * b));
        const __m512i ng = _mm512_loadu_si512((const void *)(P->ng + 8 * b));
        const __m512 da2 = _mm512_permutexvar_ps(lo2, _mm512_castps128_ps512(
                                                          _mm_castpd_ps(_mm_load_sd((const double *)(const void *)(P->da + b)))));
        UNROLL for (int r = 0; r < R; r++) {
            const uint8_t *x = w[r] + (size_t)b * bs;
            _mm_prefetch((const char *)(x + KV_LXD_PF * rb), _MM_HINT_T0);
            const __m512i u = un(x, x + bs);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(ng, u, yv)), sc(x, da2), acc[r]);
        }
    }
    if (b < nb) { /* an even last block: low half only */
        const __m256i yv = _mm256_loadu_si256((const __m256i *)(const void *)(P->q + 32 * b));
        const __m256i ng = _mm256_loadu_si256((const __m256i *)(const void *)(P->ng + 8 * b));
        UNROLL for (int r = 0; r < R; r++) {
            const uint8_t *x = w[r] + (size_t)b * bs;
            const __m256i u = _mm512_castsi512_si256(un(x, x));
            const __m256 d = _mm256_set1_ps(dwf(x) * P->da[b]);
            __m256 lo = _mm512_castps512_ps256(acc[r]);
            lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_dpbusd_epi32(ng, u, yv)), d, lo);
            acc[r] = _mm512_insertf32x8(acc[r], lo, 0);
        }
    }
    UNROLL for (int r = 0; r < R; r++) { /* kv_fold16 */
        const __m256 f = _mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm512_extractf32x8_ps(acc[r], 1));
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        out[r] = _mm_cvtss_f32(s);
    }
}

/* Rows [r0, r1) against one token; 0 when n is past the buffer. KV_LXD_R
 * rows a pass, row i of each of KV_LXD_R equal parts of the range. */
AI int dec_mat(lxd_unpack un, lxd_scale sc, lxd_scale8 sc8, lxd_dw dwf, int K, const uint8_t *W, size_t row_bytes, int64_t n,
               int64_t r0, int64_t r1, const uint8_t *A, float *Y) {
    const int64_t nb = n / 32;
    if (nb < 1 || (size_t)nb * 68 > LXD_PRE) return 0;
    _Alignas(64) uint8_t buf[LXD_PRE];
    lxd_pre P;
    dec_prep(A, nb, K, buf, &P);
    const size_t bs = row_bytes / (size_t)nb;
    const int64_t h = (r1 - r0) / KV_LXD_R;
    for (int64_t i = 0; i < h; i++) {
        const uint8_t *w[KV_LXD_R];
        float o[KV_LXD_R];
        UNROLL for (int s = 0; s < KV_LXD_R; s++) w[s] = W + (size_t)(r0 + s * h + i) * row_bytes;
        dec_rows(un, sc, sc8, dwf, KV_LXD_R, nb, w, row_bytes, bs, &P, o);
        UNROLL for (int s = 0; s < KV_LXD_R; s++) Y[r0 + s * h + i] = o[s];
    }
    int64_t r = r0 + KV_LXD_R * h;
    for (; r + 2 <= r1; r += 2) {
        const uint8_t *w[2] = {W + (size_t)r * row_bytes, W + (size_t)(r + 1) * row_bytes};
        dec_rows(un, sc, sc8, dwf, 2, nb, w, row_bytes, bs, &P, Y + r);
    }
    for (; r < r1; r++) {
        const uint8_t *w[1] = {W + (size_t)r * row_bytes};
        dec_rows(un, sc, sc8, dwf, 1, nb, w, row_bytes, bs, &P, Y + r);
    }
    return 1;
}

/* ---- Several tokens (prefill, experts) ------------------------------------
 * The one-token form for up to LXT_TT tokens a row pass (8 was slower): the weights unpacked
 * once per block pair as u = w + K (ud_*), their scales widened once (fp16:
 * vcvtph2ps; E8M0: e - 128 as a float), and per token one vpdpbusd started
 * from its prepared -K x group sums, one convert, the pair's dw x da (a
 * multiply, or vscalefps for E8M0: the same correctly rounded product, as in
 * sc_mxfp4) against its prepared [8 x da, 8 x da], one fma. The integers and
 * the float steps are row_tile's (lane 8(b&1) + g, block order), so the same
 * bits. Rows in chunks of about 512 KiB (from memory once, from cache for
 * every token tile); per chunk the token tiles, each prepared once. */
#define LXT_PRE (64 * 1024) /* LXT_TT tokens x 64 bytes a block */
#ifndef LXT_TT
#define LXT_TT 4 /* tokens per row pass (8: prefill 78 -> 70 GMAC/s) */
#endif
typedef __m512 (*lxt_base)(const uint8_t *x);
typedef __m512 (*lxt_comb)(__m512 base, __m512 da2);
AI __m512 tb_f16(const uint8_t *x, int W1) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)x);
    const __m256i idx = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, (short)W1, (short)W1, (short)W1, (short)W1,
                                          (short)W1, (short)W1, (short)W1, (short)W1);
    return _mm512_cvtph_ps(_mm256_permutexvar_epi16(idx, v));
}
AI __m512 tb_q5_0(const uint8_t *x) { return tb_f16(x, 11); }
AI __m512 tb_iq4_nl(const uint8_t *x) { return tb_f16(x, 9); }
AI __m512 tb_mxfp4(const uint8_t *x) { /* e - 128 of the pair, as sc_mxfp4 */
    const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)x);
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
    const __m512i sh = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
    const __m512i e = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(idx, _mm512_castsi256_si512(v)), sh),
                                       _mm512_set1_epi32(0xFF));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(e, _mm512_set1_epi32(128)));
}
AI __m512 tc_q5_0(__m512 base, __m512 da2) { return _mm512_mul_ps(base, da2); }
AI __m512 tc_iq4_nl(__m512 base, __m512 da2) { return _mm512_mul_ps(base, da2); }
AI __m512 tc_mxfp4(__m512 base, __m512 da2) { return _mm512_scalef_ps(da2, base); }

/* One row (bs bytes a block) against TT tokens (ab bytes apart; pre: their
 * prepared data, ps bytes apart: [nb] x 8 int32 -K x group sums, then [nb]
 * x 8 copies of da). */
AI void tile_rows(lxd_unpack un, lxt_base tb, lxt_comb tc, lxd_dw dwf, int TT, int64_t nb, const uint8_t *w, size_t bs,
                  const uint8_t *a, size_t ab, const uint8_t *pre, size_t ps, float *out) {
    __m512 acc[LXT_TT];
    UNROLL for (int t = 0; t < TT; t++) acc[t] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *x = w + (size_t)b * bs;
        const __m512i u = un(x, x + bs);
        const __m512 base = tb(x);
        UNROLL for (int t = 0; t < TT; t++) {
            const kv_block_q8_0 *y = (const kv_block_q8_0 *)(const void *)(a + (size_t)t * ab) + b;
            const __m512i yv = _mm512_inserti64x4(_mm512_castsi256_si512(ld_qs(&y[0])), ld_qs(&y[1]), 1);
            const uint8_t *p = pre + (size_t)t * ps;
            const __m512i ng = _mm512_loadu_si512((const void *)(p + (size_t)b * 32));
            const __m512 da2 = _mm512_loadu_ps((const void *)(p + (size_t)nb * 32 + (size_t)b * 32));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(ng, u, yv)), tc(base, da2), acc[t]);
        }
    }
    if (b < nb) { /* an even last block: low half only */
        const uint8_t *x = w + (size_t)b * bs;
        const __m256i u = _mm512_castsi512_si256(un(x, x));
        const float dw = dwf(x);
        UNROLL for (int t = 0; t < TT; t++) {
            const kv_block_q8_0 *y = (const kv_block_q8_0 *)(const void *)(a + (size_t)t * ab) + b;
            const uint8_t *p = pre + (size_t)t * ps;
            const __m256i ng = _mm256_load_si256((const __m256i *)(const void *)(p + (size_t)b * 32));
            const float da = *(const float *)(const void *)(p + (size_t)nb * 32 + (size_t)b * 32);
            __m256 lo = _mm512_castps512_ps256(acc[t]);
            lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_dpbusd_epi32(ng, u, ld_qs(y))), _mm256_set1_ps(dw * da), lo);
            acc[t] = _mm512_insertf32x8(acc[t], lo, 0);
        }
    }
    UNROLL for (int t = 0; t < TT; t++) { /* kv_fold16 */
        const __m256 f = _mm256_add_ps(_mm512_castps512_ps256(acc[t]), _mm512_extractf32x8_ps(acc[t], 1));
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        out[t] = _mm_cvtss_f32(s);
    }
}

/* Rows [r0, r1) x tokens [0, n_tok); 0 when n is past the buffer. */
AI int tile_mat(lxd_unpack un, lxt_base tb, lxt_comb tc, lxd_dw dwf, int K, const uint8_t *W, size_t row_bytes,
                int64_t n, int64_t r0, int64_t r1, const uint8_t *A, size_t a_stride, int64_t n_tok, float *Y,
                size_t y_stride) {
    const int64_t nb = n / 32;
    if (nb < 1 || (size_t)nb * 64 * LXT_TT > LXT_PRE) return 0;
    _Alignas(64) uint8_t buf[LXT_PRE];
    const size_t ps = (size_t)nb * 64, bs = row_bytes / (size_t)nb;
    const __m256i kk = _mm256_set1_epi8((char)K);
    const int64_t rows_chunk = (int64_t)((512u << 10) / row_bytes) + 1;
    for (int64_t rc = r0; rc < r1; rc += rows_chunk) {
        const int64_t rc_end = rc + rows_chunk < r1 ? rc + rows_chunk : r1;
        for (int64_t t = 0; t < n_tok; t += LXT_TT) {
            const int64_t tt = n_tok - t < LXT_TT ? n_tok - t : LXT_TT;
            const uint8_t *at = A + (size_t)t * a_stride;
            for (int64_t j = 0; j < tt; j++)
                for (int64_t b = 0; b < nb; b++) {
                    const kv_block_q8_0 *y = (const kv_block_q8_0 *)(const void *)(at + (size_t)j * a_stride) + b;
                    uint8_t *p = buf + (size_t)j * ps;
                    _mm256_store_si256((__m256i *)(void *)(p + (size_t)b * 32),
                                       _mm256_sub_epi32(_mm256_setzero_si256(),
                                                        _mm256_dpbusd_epi32(_mm256_setzero_si256(), kk, ld_qs(y))));
                    _mm256_store_ps((float *)(void *)(p + (size_t)nb * 32 + (size_t)b * 32), _mm256_set1_ps(_cvtsh_ss(y->d)));
                }
            for (int64_t r = rc; r < rc_end; r++) {
                float o[LXT_TT];
                const uint8_t *w = W + (size_t)r * row_bytes;
                switch (tt) { /* constant TT: the token loop unrolls */
                case 1: tile_rows(un, tb, tc, dwf, 1, nb, w, bs, at, a_stride, buf, ps, o); break;
                case 2: tile_rows(un, tb, tc, dwf, 2, nb, w, bs, at, a_stride, buf, ps, o); break;
                case 3: tile_rows(un, tb, tc, dwf, 3, nb, w, bs, at, a_stride, buf, ps, o); break;
                case 4: tile_rows(un, tb, tc, dwf, 4, nb, w, bs, at, a_stride, buf, ps, o); break;
#if LXT_TT > 4
                case 5: tile_rows(un, tb, tc, dwf, 5, nb, w, bs, at, a_stride, buf, ps, o); break;
                case 6: tile_rows(un, tb, tc, dwf, 6, nb, w, bs, at, a_stride, buf, ps, o); break;
                case 7: tile_rows(un, tb, tc, dwf, 7, nb, w, bs, at, a_stride, buf, ps, o); break;
                case 8: tile_rows(un, tb, tc, dwf, 8, nb, w, bs, at, a_stride, buf, ps, o); break;
#endif
                default: break;
                }
                for (int64_t j = 0; j < tt; j++) Y[(size_t)(t + j) * y_stride + (size_t)r] = o[j];
            }
        }
    }
    return 1;
}

/* ---- Q4_1 and Q5_1, one token ------------------------------------------
 * ggml's order (quant/legacy.h): per row one 8-lane chain acc = fma((float)p,
 * dw * da, acc) in block order, and a scalar summ = fma(mw, s, summ). A ymm
 * vpdpbusd (VL) forms the 8 exact group sums of the unsigned q in one step
 * (AVX2: vpmaddubsw + vpmaddwd). Two rows per pass (two far-apart streams,
 * sharing the activation loads, each prefetching KV_LXD_PF rows ahead): their
 * dw, mw are converted in one step ([dw0, mw0, dw1, mw1]), the products
 * dw * da of both rows are one multiply and both summ chains one fma, lane
 * by lane the scalar steps of the AVX2 kernel, so the same bits. */
typedef __m256i (*lxm_unpack)(const uint8_t *blk);
AI __m256i um_q4_1(const uint8_t *blk) {
    const kv_block_q4_1 *x = (const kv_block_q4_1 *)(const void *)blk;
    const __m256i z = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)x->qs));
    return _mm256_and_si256(_mm256_srlv_epi16(z, _mm256_set_epi64x(0x0004000400040004ll, 0x0004000400040004ll, 0, 0)),
                            _mm256_set1_epi8(0xF));
}
AI __m256i um_q5_1(const uint8_t *blk) {
    const kv_block_q5_1 *x = (const kv_block_q5_1 *)(const void *)blk;
    const __m256i z = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)x->qs));
    const __m256i u = _mm256_and_si256(
        _mm256_srlv_epi16(z, _mm256_set_epi64x(0x0004000400040004ll, 0x0004000400040004ll, 0, 0)), _mm256_set1_epi8(0xF));
    return _mm256_mask_add_epi8(u, (__mmask32)kv_rd_qh(x->qh), u, _mm256_set1_epi8(16));
}

#define LXM_PRE (48 * 1024) /* 32 bytes a block: n <= 49,152 */

/* R rows (1 or 2) of Q4_1/Q5_1 (bs bytes a block: d, m first) against the
 * Q8_1 token a; pre: per block [da, 0, da, 0] and [0, s, 0, s]. */
AI void decm_rows(lxm_unpack un, int R, int64_t nb, const uint8_t *const *w, size_t rb, size_t bs, const uint8_t *a,
                  const float *pre, float *out) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m128 summ = _mm_setzero_ps(); /* lanes 1, 3: rows 0, 1 */
    for (int64_t b = 0; b < nb; b++) {
        const __m256i yv = _mm256_loadu_si256((const __m256i *)(const void *)(a + 36 * b + 4));
        uint32_t dm0, dm1 = 0;
        memcpy(&dm0, w[0] + (size_t)b * bs, 4);
        if (R > 1) memcpy(&dm1, w[1] + (size_t)b * bs, 4);
        const __m128 v = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128((int)dm0), (int)dm1, 1)); /* dw0 mw0 dw1 mw1 */
        const __m128 dd = _mm_mul_ps(v, _mm_load_ps(pre + 8 * b));
        summ = _mm_fmadd_ps(v, _mm_load_ps(pre + 8 * b + 4), summ);
        for (int r = 0; r < R; r++) {
            _mm_prefetch((const char *)(w[r] + KV_LXD_PF * rb + (size_t)b * bs), _MM_HINT_T0);
            const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), un(w[r] + (size_t)b * bs), yv);
            const __m256 d = r == 0 ? _mm256_broadcastss_ps(dd)
                                    : _mm256_permutexvar_ps(_mm256_set1_epi32(2), _mm256_castps128_ps256(dd));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc[r]);
        }
    }
    _Alignas(16) float sm[4];
    _mm_store_ps(sm, summ);
    for (int r = 0; r < R; r++) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        out[r] = _mm_cvtss_f32(s) + sm[1 + 2 * r];
    }
}

AI int decm_mat(lxm_unpack un, const uint8_t *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1,
                const uint8_t *A, float *Y) {
    const int64_t nb = n / 32;
    if (nb < 1 || (size_t)nb * 32 > LXM_PRE) return 0;
    _Alignas(64) float pre[LXM_PRE / 4];
    for (int64_t b = 0; b < nb; b++) {
        const kv_block_q8_1 *y = (const kv_block_q8_1 *)(const void *)A + b;
        const float da = _cvtsh_ss(y->d), s = _cvtsh_ss(y->s);
        float *p = pre + 8 * b;
        p[0] = da, p[1] = 0, p[2] = da, p[3] = 0;
        p[4] = 0, p[5] = s, p[6] = 0, p[7] = s;
    }
    const size_t bs = row_bytes / (size_t)nb;
    const int64_t h = (r1 - r0) / 2;
    for (int64_t i = 0; i < h; i++) {
        const uint8_t *w[2] = {W + (size_t)(r0 + i) * row_bytes, W + (size_t)(r0 + h + i) * row_bytes};
        float o[2];
        decm_rows(un, 2, nb, w, row_bytes, bs, A, pre, o);
        Y[r0 + i] = o[0];
        Y[r0 + h + i] = o[1];
    }
    for (int64_t r = r0 + 2 * h; r < r1; r++) {
        const uint8_t *w[1] = {W + (size_t)r * row_bytes};
        decm_rows(un, 1, nb, w, row_bytes, bs, A, pre, Y + r);
    }
    return 1;
}

/* The AVX2 level's Q4_1/Q5_1 mat (several tokens), saved before the overlay. */
static kv_mat_fn lxm_multi[2];
#define LEGACY_MIN512(T, I)                                                                      \
    static void T##_mat(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1,      \
                        const void *A, size_t a_stride, int64_t n_tok, float *Y, size_t y_stride) { \
        if (n_tok == 1 && decm_mat(um_##T, W, row_bytes, n, r0, r1, A, Y)) return;               \
        lxm_multi[I](W, row_bytes, n, r0, r1, A, a_stride, n_tok, Y, y_stride);                  \
    }
LEGACY_MIN512(q4_1, 0)
LEGACY_MIN512(q5_1, 1)

#define LEGACY_AVX512(T, K)                                                                      \
    static void T##_dot(int64_t n, float *s, const void *w, const void *a) {                     \
        row_tile(lx_##T, 1, n, w, a, 0, s);                                                      \
    }                                                                                            \
    static void T##_mat(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1,      \
                        const void *A, size_t a_stride, int64_t n_tok, float *Y, size_t y_stride) { \
        if (n_tok == 1 && dec_mat(ud_##T, sc_##T, sc8_##T, dw_##T, K, W, row_bytes, n, r0, r1, A, Y)) return; \
        if (tile_mat(ud_##T, tb_##T, tc_##T, dw_##T, K, W, row_bytes, n, r0, r1, A, a_stride, n_tok, Y, y_stride)) \
            return;                                                                              \
        mat(lx_##T, W, row_bytes, n, r0, r1, A, a_stride, n_tok, Y, y_stride);                   \
    }
LEGACY_AVX512(q5_0, 16)
LEGACY_AVX512(iq4_nl, 128)
LEGACY_AVX512(mxfp4, 128)

void kv_quant_fill_legacy_avx512(kv_kernels *k) {
    k[KV_TYPE_Q5_0].vec_dot = q5_0_dot;     k[KV_TYPE_Q5_0].mat = q5_0_mat;
    k[KV_TYPE_IQ4_NL].vec_dot = iq4_nl_dot; k[KV_TYPE_IQ4_NL].mat = iq4_nl_mat;
    k[KV_TYPE_MXFP4].vec_dot = mxfp4_dot;   k[KV_TYPE_MXFP4].mat = mxfp4_mat;
    if (k[KV_TYPE_Q4_1].mat && k[KV_TYPE_Q5_1].mat) { /* the AVX2 level's, for several tokens */
        lxm_multi[0] = k[KV_TYPE_Q4_1].mat;
        lxm_multi[1] = k[KV_TYPE_Q5_1].mat;
        k[KV_TYPE_Q4_1].mat = q4_1_mat;
        k[KV_TYPE_Q5_1].mat = q5_1_mat;
    }
}
