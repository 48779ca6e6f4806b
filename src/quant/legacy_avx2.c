/* AVX2 kernels of Q4_1, Q5_1 (against Q8_1 activations), Q5_0, IQ4_NL and
 * MXFP4 (against Q8_0) (compiled with -mavx2 -mfma -mf16c; called only after
 * run-time detection). They follow the canonical order of quant/legacy.h,
 * so their results are bit-identical to legacy_ref.c.
 *
 * Hot path: one weight row against up to LX_TT tokens at a time; a block is
 * unpacked to 32 int8 weights once (legacy_x86.h) and reused for every
 * token. The int32 group sums of 4 products are one maddubs + madd:
 * unsigned weights (Q4_1, Q5_1: 0..31) go in as they are; signed ones
 * (|w| <= 127) as |w| against the activation with w's sign (vpsignb), so no
 * int16 pair sum can saturate (activations are in [-127, 127]). Even and
 * odd blocks accumulate in two ymm: the 16 canonical lanes (Q4_1 and Q5_1:
 * one ymm, ggml's order, and the min term one scalar fma per block). Q5_0,
 * IQ4_NL and MXFP4 take their own one-token (mat_s1) and several-token
 * (tile2_mat) paths with prepared activations; row_tile remains for vec_dot
 * and rows past those paths' buffers. */
#include "quant/legacy_x86.h"

#define AI LX_AI
#define LX_TT 4 /* tokens per row pass */
#define LX_TUNROLL _Pragma("GCC unroll 8")

AI __m256i grp_u(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* Fixed 8-lane tree, the order of kv_hsum8. */
AI float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

typedef __m256i (*lx_unpack)(const void *row, int64_t b, float *dw, float *mw);

/* Activation block b of a token: Q8_1 (36 bytes: d, s, qs) with a min
 * (Q4_1, Q5_1), else Q8_0 (34 bytes: d, qs). */
AI const uint8_t *act(int has_min, const uint8_t *a, int64_t b) { return a + b * (has_min ? 36 : 34); }

/* Block b of one row against TT tokens into acc[t] (and summ[t]). */
AI void rt_step(lx_unpack un, int has_min, int TT, int64_t b, const void *w, const uint8_t *a, size_t ab, __m256 *acc,
                float *summ) {
    float dw, mw;
    const __m256i xv = un(w, b, &dw, &mw);
    const __m256i ax = has_min ? xv : _mm256_sign_epi8(xv, xv);
    LX_TUNROLL for (int t = 0; t < TT; t++) {
        const uint8_t *y = act(has_min, a + (size_t)t * ab, b);
        uint16_t yd;
        memcpy(&yd, y, 2);
        const __m256i yv = _mm256_loadu_si256((const __m256i *)(y + (has_min ? 4 : 2)));
        const float da = _cvtsh_ss(yd);
        const __m256i p = grp_u(ax, has_min ? yv : _mm256_sign_epi8(yv, xv));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * da), acc[t]);
        if (has_min) {
            uint16_t ys;
            memcpy(&ys, y + 2, 2);
            summ[t] = fmaf(mw, _cvtsh_ss(ys), summ[t]);
        }
    }
}

/* out[t] = dot(row w, token t) for t < TT; tokens ab bytes apart. Even and
 * odd blocks (Q4_1/Q5_1: every block) into accumulators named at compile
 * time, the token loop unrolled: they stay in registers. */
AI void row_tile(lx_unpack un, int has_min, int TT, int64_t n, const void *w, const uint8_t *a, size_t ab,
                 float *out) {
    __m256 acc[2][LX_TT];
    float summ[LX_TT];
    LX_TUNROLL for (int t = 0; t < TT; t++) {
        acc[0][t] = acc[1][t] = _mm256_setzero_ps();
        summ[t] = 0;
    }
    const int64_t nb = n / 32;
    int64_t b = 0;
    if (has_min) /* Q4_1/Q5_1: one chain */
        for (; b < nb; b++) rt_step(un, has_min, TT, b, w, a, ab, acc[0], summ);
    else {
        for (; b + 2 <= nb; b += 2) {
            rt_step(un, has_min, TT, b, w, a, ab, acc[0], summ);
            rt_step(un, has_min, TT, b + 1, w, a, ab, acc[1], summ);
        }
        if (b < nb) rt_step(un, has_min, TT, b, w, a, ab, acc[0], summ);
    }
    LX_TUNROLL for (int t = 0; t < TT; t++) {
        out[t] = has_min ? hsum_ps(acc[0][t]) + summ[t] : hsum_ps(_mm256_add_ps(acc[0][t], acc[1][t]));
    }
}

/* One token against rows w and w + rb (decode): the two rows' chains are
 * independent, so the single chain of Q4_1/Q5_1 is not the limit; each
 * row's arithmetic is row_tile's. The rows KV_LX_PF pairs ahead are
 * prefetched, a block (bs bytes) at a time. */
#define KV_LX_PF 4
AI void rows2(lx_unpack un, int has_min, int64_t n, const uint8_t *w, size_t rb, size_t bs, const uint8_t *a,
              float out[2]) {
    __m256 acc[2][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}, {_mm256_setzero_ps(), _mm256_setzero_ps()}};
    float summ[2] = {0, 0};
    for (int64_t b = 0; b < n / 32; b++) {
        const int odd = has_min ? 0 : (int)(b & 1);
        const uint8_t *y = act(has_min, a, b);
        uint16_t yd, ys;
        memcpy(&yd, y, 2);
        memcpy(&ys, y + 2, 2);
        const __m256i yv = _mm256_loadu_si256((const __m256i *)(y + (has_min ? 4 : 2)));
        const float da = _cvtsh_ss(yd);
        for (int r = 0; r < 2; r++) {
            _mm_prefetch((const char *)(w + (size_t)(r + 2 * KV_LX_PF) * rb + (size_t)b * bs), _MM_HINT_T0);
            float dw, mw;
            const __m256i xv = un(w + (size_t)r * rb, b, &dw, &mw);
            const __m256i ax = has_min ? xv : _mm256_sign_epi8(xv, xv);
            const __m256i p = grp_u(ax, has_min ? yv : _mm256_sign_epi8(yv, xv));
            acc[r][odd] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * da), acc[r][odd]);
            if (has_min) summ[r] = fmaf(mw, _cvtsh_ss(ys), summ[r]);
        }
    }
    for (int r = 0; r < 2; r++)
        out[r] = has_min ? hsum_ps(acc[r][0]) + summ[r] : hsum_ps(_mm256_add_ps(acc[r][0], acc[r][1]));
}

/* Q4_1/Q5_1, one token, two rows a pass (rows2's arithmetic): both rows'
 * (dw, mw) converted in one step ([dw0, mw0, dw1, mw1]), the products
 * dw * da one multiply and both summ chains one fma against per-call
 * prepared [da, 0, da, 0] and [0, s, 0, s] (lane r's steps are rows2's
 * scalar steps, so the same bits). */
#define LXM_PRE (32 * 1024) /* 32 bytes a block: n <= 32,768 */
AI void rows2m(lx_unpack un, int64_t n, const uint8_t *w, size_t rb, size_t bs, const uint8_t *a, const float *pre,
               float out[2]) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m128 summ = _mm_setzero_ps(); /* lanes 1, 3: rows 0, 1 */
    for (int64_t b = 0; b < n / 32; b++) {
        const __m256i yv = _mm256_loadu_si256((const __m256i *)(const void *)(a + 36 * b + 4));
        uint32_t dm0, dm1;
        memcpy(&dm0, w + (size_t)b * bs, 4);
        memcpy(&dm1, w + rb + (size_t)b * bs, 4);
        const __m128 v = _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128((int)dm0), (int)dm1, 1)); /* dw0 mw0 dw1 mw1 */
        const __m128 dd = _mm_mul_ps(v, _mm_load_ps(pre + 8 * b));
        summ = _mm_fmadd_ps(v, _mm_load_ps(pre + 8 * b + 4), summ);
        _mm_prefetch((const char *)(w + (size_t)2 * KV_LX_PF * rb + (size_t)b * bs), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + (size_t)(2 * KV_LX_PF + 1) * rb + (size_t)b * bs), _MM_HINT_T0);
        float dw, mw;
        const __m256i x0 = un(w, b, &dw, &mw), x1 = un(w + rb, b, &dw, &mw);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(grp_u(x0, yv)), _mm256_broadcastss_ps(dd), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(grp_u(x1, yv)),
                               _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dd), _mm256_set1_epi32(2)), acc1);
    }
    _Alignas(16) float sm[4];
    _mm_store_ps(sm, summ);
    out[0] = hsum_ps(acc0) + sm[1];
    out[1] = hsum_ps(acc1) + sm[3];
}

/* Q5_0, IQ4_NL, MXFP4, one token: KV_LXS_R rows a pass from far-apart
 * parts of the range, even and odd blocks in two accumulators per row held
 * in registers (the loop over rows and the block pair unrolled; indexing
 * them by b & 1 at run time had kept them on the stack). Per row and 8
 * blocks, the 8 scales are gathered into one vector and converted in one
 * step (fp16: vcvtph2ps; E8M0: kv_e8m0_half's two cases as vector ops),
 * multiplied by the 8 activation scales (dw * da, the scalar product of
 * each lane) and stored; each block broadcasts its lane back. The group
 * sums: Q5_0 and MXFP4 as unsigned u = w + K (K = 16, 12: u <= 31 or 24, so
 * vpmaddubsw cannot saturate) against the activations, started from the
 * prepared -K x group sum (the same integers, Q4_0's form); IQ4_NL (values
 * up to 127 in size) by the sign trick as row_tile. */
#ifndef KV_LXS_R
#define KV_LXS_R 2
#endif
#define LXS_UNROLL _Pragma("GCC unroll 8")

/* The 8 scales of blocks x, x + bs, ... as floats (exact widening). */
AI __m256 dw8_f16(const uint8_t *x, size_t bs) {
    uint64_t lo = 0, hi = 0;
    for (int k = 0; k < 4; k++) {
        uint16_t a, c;
        memcpy(&a, x + (size_t)k * bs, 2);
        memcpy(&c, x + (size_t)(k + 4) * bs, 2);
        lo |= (uint64_t)a << (16 * k);
        hi |= (uint64_t)c << (16 * k);
    }
    return _mm256_cvtph_ps(_mm_set_epi64x((long long)hi, (long long)lo));
}
AI uint64_t e8_bytes(const uint8_t *x, size_t bs) {
    uint64_t v = 0;
    for (int k = 0; k < 8; k++) v |= (uint64_t)x[(size_t)k * bs] << (8 * k);
    return v;
}
/* Nonzero when a byte of v is below 32: an exponent whose scale times an
 * fp16 activation scale can fall below the smallest normal float. */
AI uint64_t e8_small(uint64_t v) { return (v - 0x2020202020202020ull) & ~v & 0x8080808080808080ull; }
AI __m256 dw8_e8m0v(uint64_t v) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)v));
    const __m256i nrm = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23); /* e >= 2 */
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);            /* e < 2 */
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(nrm, sub, small));
}
AI __m256 dw8_e8m0(const uint8_t *x, size_t bs) { return dw8_e8m0v(e8_bytes(x, bs)); }

/* Group sums of block x (kind 0: Q5_0 u, 1: IQ4_NL sign trick, 2: MXFP4 u)
 * against activations yv, ng = -K x group sums. */
AI __m256i lxs_grp(int kind, const uint8_t *x, __m256i yv, __m256i ng, __m256i tbl) {
    if (kind == 0) {
        const kv_block_q5_0 *q = (const kv_block_q5_0 *)(const void *)x;
        const __m256i u = _mm256_or_si256(lx_nibbles(q->qs), lx_bit4(q->qh));
        return _mm256_add_epi32(grp_u(u, yv), ng);
    }
    const __m256i v = _mm256_shuffle_epi8(tbl, lx_nibbles(x + (kind == 1 ? 2 : 1)));
    if (kind == 2) return _mm256_add_epi32(grp_u(v, yv), ng);
    return grp_u(_mm256_sign_epi8(v, v), _mm256_sign_epi8(yv, v));
}

/* An MXFP4 group of 8 blocks of which some exponent is small: a scale (and
 * its product with da) that is not a normal float costs a microcode assist
 * in every multiply and fma that touches it, on every lane of the vector
 * (the zero blocks a quantizer writes for zero rows have e = 0: a head of
 * mostly unused rows spent 88% of its decode so). Per block and row the same
 * operations as the vector path, dw x da then one fma into acc[r][k & 1];
 * a block whose group sums are all 0 is skipped, which changes nothing (an
 * accumulator that starts at +0 is never -0, so acc + 0 x d is acc). */
AI void mxfp4_group_slow(int R, int64_t b, const uint8_t *const *w, size_t rb, size_t bs, const int8_t *q,
                         const int32_t *ngp, const float *da, __m256i tbl, __m256 (*acc)[2]) {
    LXS_UNROLL for (int k = 0; k < 8; k++) {
        const int64_t c = b + k;
        const __m256i yv = _mm256_loadu_si256((const __m256i *)(const void *)(q + 32 * c));
        const __m256i ng = _mm256_loadu_si256((const __m256i *)(const void *)(ngp + 8 * c));
        LXS_UNROLL for (int r = 0; r < R; r++) {
            const uint8_t *x = w[r] + (size_t)c * bs;
            if (!(k & 1)) _mm_prefetch((const char *)(x + KV_LX_PF * 2 * rb), _MM_HINT_T0);
            const __m256i p = lxs_grp(2, x, yv, ng, tbl);
            if (_mm256_testz_si256(p, p)) continue;
            const __m256 d = _mm256_set1_ps(kv_e8m0_half(x[0]) * da[c]);
            acc[r][k & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc[r][k & 1]);
        }
    }
}

AI void rowsS(int kind, int R, int64_t nb, const uint8_t *const *w, size_t rb, size_t bs, const int8_t *q,
              const int32_t *ngp, const float *da, float *out) {
    __m256 acc[KV_LXS_R][2];
    LXS_UNROLL for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    __m256i tbl = _mm256_setzero_si256();
    if (kind == 1) tbl = lx_table(kv_iq4nl_values);
    if (kind == 2) tbl = _mm256_add_epi8(lx_table(kv_mxfp4_values), _mm256_set1_epi8(12));
    _Alignas(32) float sd[KV_LXS_R][8];
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        if (kind == 2) { /* MXFP4: groups with a small exponent go one block at a time (below) */
            uint64_t small = 0;
            LXS_UNROLL for (int r = 0; r < R; r++) small |= e8_small(e8_bytes(w[r] + (size_t)b * bs, bs));
            if (small) {
                mxfp4_group_slow(R, b, w, rb, bs, q, ngp, da, tbl, acc);
                continue;
            }
        }
        LXS_UNROLL for (int r = 0; r < R; r++) {
            const uint8_t *x = w[r] + (size_t)b * bs;
            const __m256 dw = kind == 2 ? dw8_e8m0(x, bs) : dw8_f16(x, bs);
            _mm256_store_ps(sd[r], _mm256_mul_ps(dw, _mm256_loadu_ps(da + b)));
        }
        LXS_UNROLL for (int k = 0; k < 8; k++) {
            const int64_t c = b + k;
            const __m256i yv = _mm256_loadu_si256((const __m256i *)(const void *)(q + 32 * c));
            const __m256i ng = _mm256_loadu_si256((const __m256i *)(const void *)(ngp + 8 * c));
            LXS_UNROLL for (int r = 0; r < R; r++) {
                const uint8_t *x = w[r] + (size_t)c * bs;
                if (!(k & 1)) _mm_prefetch((const char *)(x + KV_LX_PF * 2 * rb), _MM_HINT_T0);
                const __m256i p = lxs_grp(kind, x, yv, ng, tbl);
                acc[r][k & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&sd[r][k]), acc[r][k & 1]);
            }
        }
    }
    for (; b < nb; b++) { /* the last blocks one at a time */
        const __m256i yv = _mm256_loadu_si256((const __m256i *)(const void *)(q + 32 * b));
        const __m256i ng = _mm256_loadu_si256((const __m256i *)(const void *)(ngp + 8 * b));
        LXS_UNROLL for (int r = 0; r < R; r++) {
            const uint8_t *x = w[r] + (size_t)b * bs;
            float dw;
            if (kind == 2) dw = kv_e8m0_half(x[0]);
            else {
                uint16_t h;
                memcpy(&h, x, 2);
                dw = _cvtsh_ss(h);
            }
            const __m256 d = _mm256_set1_ps(dw * da[b]);
            const __m256i p = lxs_grp(kind, x, yv, ng, tbl);
            if (b & 1) acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc[r][1]);
            else acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc[r][0]);
        }
    }
    LXS_UNROLL for (int r = 0; r < R; r++) out[r] = hsum_ps(_mm256_add_ps(acc[r][0], acc[r][1]));
}

#define LXS_PRE (48 * 1024) /* 68 bytes a block: n <= 22,560 */
/* Rows [r0, r1) of Q5_0/IQ4_NL/MXFP4 against one Q8_0 token; 0 when n is
 * past the buffer. */
AI int mat_s1(int kind, const uint8_t *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1, const uint8_t *A,
              float *Y) {
    const int64_t nb = n / 32;
    if (nb < 1 || (size_t)nb * 68 > LXS_PRE) return 0;
    _Alignas(32) uint8_t buf[LXS_PRE];
    int8_t *q = (int8_t *)(void *)buf;
    int32_t *ng = (int32_t *)(void *)(buf + (size_t)nb * 32);
    float *da = (float *)(void *)(buf + (size_t)nb * 64);
    const int K = kind == 0 ? 16 : kind == 2 ? 12 : 0;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *y = act(0, A, b);
        uint16_t yd;
        memcpy(&yd, y, 2);
        da[b] = _cvtsh_ss(yd);
        const __m256i yv = _mm256_loadu_si256((const __m256i *)(const void *)(y + 2));
        _mm256_storeu_si256((__m256i *)(void *)(q + 32 * b), yv);
        const __m256i gs = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), yv), _mm256_set1_epi16(1));
        _mm256_storeu_si256((__m256i *)(void *)(ng + 8 * b), _mm256_mullo_epi32(gs, _mm256_set1_epi32(-K)));
    }
    const size_t bs = row_bytes / (size_t)nb;
    const int64_t h = (r1 - r0) / KV_LXS_R;
    for (int64_t i = 0; i < h; i++) {
        const uint8_t *w[KV_LXS_R];
        float o[KV_LXS_R];
        LXS_UNROLL for (int s = 0; s < KV_LXS_R; s++) w[s] = W + (size_t)(r0 + s * h + i) * row_bytes;
        rowsS(kind, KV_LXS_R, nb, w, row_bytes, bs, q, ng, da, o);
        LXS_UNROLL for (int s = 0; s < KV_LXS_R; s++) Y[r0 + s * h + i] = o[s];
    }
    for (int64_t r = r0 + KV_LXS_R * h; r < r1; r++) {
        const uint8_t *w[1] = {W + (size_t)r * row_bytes};
        rowsS(kind, 1, nb, w, row_bytes, bs, q, ng, da, Y + r);
    }
    return 1;
}

/* Several tokens of Q4_1/Q5_1 (prefill): one row against up to LX_TT8
 * tokens per pass, each block unpacked once for all of them. The tokens'
 * activation scales are converted once per token tile (da, sa: block-major,
 * 8 per block), so per block the 8 products dw * da and the 8 min terms
 * fma(mw, s, summ) are one vector step each: lane t is token t's own
 * scalar step of row_tile (the same roundings, in the same order). */
#define LX_TT8 8
#define LX_UNROLL _Pragma("GCC unroll 8")
#define LX_MAX_BLK 512 /* most blocks per row for this path (n <= 16384) */
AI void row_tile8(lx_unpack un, int TT, int64_t n, const void *w, const uint8_t *a, size_t ab, const float *da,
                  const float *sa, float *out) {
    __m256 acc[LX_TT8];
    LX_UNROLL for (int t = 0; t < TT; t++) acc[t] = _mm256_setzero_ps();
    __m256 summ = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / 32; b++) {
        float dw, mw;
        const __m256i xv = un(w, b, &dw, &mw);
        _Alignas(32) float dd[LX_TT8];
        _mm256_store_ps(dd, _mm256_mul_ps(_mm256_set1_ps(dw), _mm256_load_ps(da + LX_TT8 * b)));
        summ = _mm256_fmadd_ps(_mm256_set1_ps(mw), _mm256_load_ps(sa + LX_TT8 * b), summ);
        LX_UNROLL for (int t = 0; t < TT; t++) { /* unrolled: acc[] stays in registers */
            const __m256i yv = _mm256_loadu_si256((const __m256i *)(const void *)(act(1, a + (size_t)t * ab, b) + 4));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(grp_u(xv, yv)), _mm256_broadcast_ss(dd + t), acc[t]);
        }
    }
    _Alignas(32) float sm[LX_TT8];
    _mm256_store_ps(sm, summ);
    LX_UNROLL for (int t = 0; t < TT; t++) out[t] = hsum_ps(acc[t]) + sm[t];
}

AI void mat_min(lx_unpack un, const uint8_t *wb, size_t row_bytes, int64_t n, int64_t r0, int64_t r1,
                const uint8_t *ab, size_t a_stride, int64_t n_tok, float *Y, size_t y_stride) {
    _Alignas(32) float da[LX_TT8 * LX_MAX_BLK], sa[LX_TT8 * LX_MAX_BLK];
    const int64_t nb = n / 32, nj = (n_tok + LX_TT8 - 1) / LX_TT8;
    /* rows in chunks of about 512 KiB (read from memory once, then from L2
     * by every token tile); per chunk the token tiles, as even as possible */
    const int64_t rows_chunk = (int64_t)((512u << 10) / row_bytes) + 1;
    for (int64_t rc = r0; rc < r1; rc += rows_chunk) {
        const int64_t rc_end = rc + rows_chunk < r1 ? rc + rows_chunk : r1;
        int64_t t = 0;
        for (int64_t j = 0; j < nj; j++) {
            const int64_t left = nj - j, tt = (n_tok - t + left - 1) / left;
            for (int64_t b = 0; b < nb; b++)
                for (int64_t k = 0; k < LX_TT8; k++) {
                    uint16_t yd = 0, ys = 0;
                    if (k < tt) {
                        const uint8_t *y = act(1, ab + (size_t)(t + k) * a_stride, b);
                        memcpy(&yd, y, 2);
                        memcpy(&ys, y + 2, 2);
                    }
                    da[LX_TT8 * b + k] = _cvtsh_ss(yd);
                    sa[LX_TT8 * b + k] = _cvtsh_ss(ys);
                }
            for (int64_t r = rc; r < rc_end; r++) {
                float o[LX_TT8];
                const uint8_t *w = wb + (size_t)r * row_bytes, *a = ab + (size_t)t * a_stride;
                switch (tt) { /* constant TT: the token loop unrolls */
                case 1: row_tile8(un, 1, n, w, a, a_stride, da, sa, o); break;
                case 2: row_tile8(un, 2, n, w, a, a_stride, da, sa, o); break;
                case 3: row_tile8(un, 3, n, w, a, a_stride, da, sa, o); break;
                case 4: row_tile8(un, 4, n, w, a, a_stride, da, sa, o); break;
                case 5: row_tile8(un, 5, n, w, a, a_stride, da, sa, o); break;
                case 6: row_tile8(un, 6, n, w, a, a_stride, da, sa, o); break;
                case 7: row_tile8(un, 7, n, w, a, a_stride, da, sa, o); break;
                default: row_tile8(un, 8, n, w, a, a_stride, da, sa, o); break;
                }
                for (int64_t k = 0; k < tt; k++) Y[(size_t)(t + k) * y_stride + (size_t)r] = o[k];
            }
            t += tt;
        }
    }
}

/* Q5_0, IQ4_NL, MXFP4, several tokens: a row against up to LX_TT tokens
 * per pass with the activations prepared once per token tile and row chunk
 * (-K x group sums, da as floats): per block and row the weights unpacked
 * (lxs_grp's forms) and dw converted once; per token the group sums, one
 * convert, dw x da (a vector multiply: each lane the scalar product) and one
 * fma into the block parity's accumulator, as row_tile (the same bits). */
#define LXT2_PRE (48 * 1024) /* LX_TT tokens x 36 bytes a block: n <= 10,912 */
AI void t2_step(int kind, int TT, int64_t b, int64_t nb, const uint8_t *w, size_t bs, const uint8_t *a, size_t ab,
                const uint8_t *pre, size_t ps, __m256i tbl, __m256 *acc) {
    const uint8_t *x = w + (size_t)b * bs;
    float dw;
    __m256i v;
    if (kind == 0) {
        const kv_block_q5_0 *q = (const kv_block_q5_0 *)(const void *)x;
        dw = _cvtsh_ss(q->d);
        v = _mm256_or_si256(lx_nibbles(q->qs), lx_bit4(q->qh));
    } else if (kind == 1) {
        dw = _cvtsh_ss(((const kv_block_iq4_nl *)(const void *)x)->d);
        v = _mm256_shuffle_epi8(tbl, lx_nibbles(x + 2));
    } else {
        if (x[0] < 32) { /* a zero block (e = 0 as written for zero rows): its group sums are all 0 and an
                          * fma of 0 leaves acc as it is; skipping it spares the subnormal scale's assists */
            const __m128i z = _mm_loadu_si128((const __m128i *)(const void *)(x + 1));
            if (_mm_testz_si128(z, z)) return;
        }
        dw = kv_e8m0_half(x[0]);
        v = _mm256_shuffle_epi8(tbl, lx_nibbles(x + 1));
    }
    const __m256 dwv = _mm256_set1_ps(dw);
    const __m256i ax = kind == 1 ? _mm256_sign_epi8(v, v) : v;
    LX_TUNROLL for (int t = 0; t < TT; t++) {
        const __m256i yv = _mm256_loadu_si256((const __m256i *)(const void *)(a + (size_t)t * ab + 34 * (size_t)b + 2));
        const uint8_t *p = pre + (size_t)t * ps;
        const __m256i g = kind == 1 ? grp_u(ax, _mm256_sign_epi8(yv, v))
                                    : _mm256_add_epi32(grp_u(v, yv), _mm256_loadu_si256((const __m256i *)(const void *)(p + 32 * (size_t)b)));
        const __m256 d = _mm256_mul_ps(dwv, _mm256_broadcast_ss((const float *)(const void *)(p + 32 * (size_t)nb) + b));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(g), d, acc[t]);
    }
}

AI void tile2_rows(int kind, int TT, int64_t nb, const uint8_t *w, size_t bs, const uint8_t *a, size_t ab,
                   const uint8_t *pre, size_t ps, float *out) {
    __m256i tbl = _mm256_setzero_si256();
    if (kind == 1) tbl = lx_table(kv_iq4nl_values);
    if (kind == 2) tbl = _mm256_add_epi8(lx_table(kv_mxfp4_values), _mm256_set1_epi8(12));
    __m256 acc[2][LX_TT];
    LX_TUNROLL for (int t = 0; t < TT; t++) acc[0][t] = acc[1][t] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        t2_step(kind, TT, b, nb, w, bs, a, ab, pre, ps, tbl, acc[0]);
        t2_step(kind, TT, b + 1, nb, w, bs, a, ab, pre, ps, tbl, acc[1]);
    }
    if (b < nb) t2_step(kind, TT, b, nb, w, bs, a, ab, pre, ps, tbl, acc[0]);
    LX_TUNROLL for (int t = 0; t < TT; t++) out[t] = hsum_ps(_mm256_add_ps(acc[0][t], acc[1][t]));
}

/* Rows [r0, r1) x tokens [0, n_tok); 0 when n is past the buffer. */
AI int tile2_mat(int kind, const uint8_t *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1, const uint8_t *A,
                 size_t a_stride, int64_t n_tok, float *Y, size_t y_stride) {
    const int64_t nb = n / 32;
    if (nb < 1 || (size_t)nb * 36 * LX_TT > LXT2_PRE) return 0;
    _Alignas(32) uint8_t buf[LXT2_PRE];
    const size_t ps = (size_t)nb * 36, bs = row_bytes / (size_t)nb;
    const int K = kind == 0 ? 16 : kind == 2 ? 12 : 0;
    const int64_t rows_chunk = (int64_t)((512u << 10) / row_bytes) + 1;
    for (int64_t rc = r0; rc < r1; rc += rows_chunk) {
        const int64_t rc_end = rc + rows_chunk < r1 ? rc + rows_chunk : r1;
        for (int64_t t = 0; t < n_tok; t += LX_TT) {
            const int64_t tt = n_tok - t < LX_TT ? n_tok - t : LX_TT;
            const uint8_t *at = A + (size_t)t * a_stride;
            for (int64_t j = 0; j < tt; j++)
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t *y = at + (size_t)j * a_stride + 34 * (size_t)b;
                    uint8_t *p = buf + (size_t)j * ps;
                    uint16_t yd;
                    memcpy(&yd, y, 2);
                    const __m256i yv = _mm256_loadu_si256((const __m256i *)(const void *)(y + 2));
                    const __m256i gs = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), yv), _mm256_set1_epi16(1));
                    _mm256_storeu_si256((__m256i *)(void *)(p + 32 * (size_t)b), _mm256_mullo_epi32(gs, _mm256_set1_epi32(-K)));
                    const float da = _cvtsh_ss(yd);
                    memcpy(p + 32 * (size_t)nb + 4 * (size_t)b, &da, 4);
                }
            for (int64_t r = rc; r < rc_end; r++) {
                float o[LX_TT];
                const uint8_t *w = W + (size_t)r * row_bytes;
                switch (tt) { /* constant TT: the token loop unrolls */
                case 1: tile2_rows(kind, 1, nb, w, bs, at, a_stride, buf, ps, o); break;
                case 2: tile2_rows(kind, 2, nb, w, bs, at, a_stride, buf, ps, o); break;
                case 3: tile2_rows(kind, 3, nb, w, bs, at, a_stride, buf, ps, o); break;
                default: tile2_rows(kind, 4, nb, w, bs, at, a_stride, buf, ps, o); break;
                }
                for (int64_t j = 0; j < tt; j++) Y[(size_t)(t + j) * y_stride + (size_t)r] = o[j];
            }
        }
    }
    return 1;
}

AI void mat(lx_unpack un, int has_min, const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1,
            const void *A, size_t a_stride, int64_t n_tok, float *Y, size_t y_stride) {
    const uint8_t *wb = W, *ab = A;
    if (has_min && n_tok >= 2 && n / 32 <= LX_MAX_BLK) {
        mat_min(un, wb, row_bytes, n, r0, r1, ab, a_stride, n_tok, Y, y_stride);
        return;
    }
    int64_t r = r0;
    if (has_min && n_tok == 1 && n >= 32 && (size_t)(n / 32) * 32 <= LXM_PRE) { /* decode: row pairs */
        _Alignas(32) float pre[LXM_PRE / 4];
        for (int64_t b = 0; b < n / 32; b++) {
            const uint8_t *y = act(1, ab, b);
            uint16_t yd, ys;
            memcpy(&yd, y, 2);
            memcpy(&ys, y + 2, 2);
            const float da = _cvtsh_ss(yd), sv = _cvtsh_ss(ys);
            float *p = pre + 8 * b;
            p[0] = da, p[1] = 0, p[2] = da, p[3] = 0;
            p[4] = 0, p[5] = sv, p[6] = 0, p[7] = sv;
        }
        for (; r + 2 <= r1; r += 2) {
            float o[2];
            rows2m(un, n, wb + r * row_bytes, row_bytes, row_bytes / (size_t)(n / 32), ab, pre, o);
            Y[r] = o[0];
            Y[r + 1] = o[1];
        }
    }
    if (!has_min && n_tok == 1 && n >= 32 && mat_s1(un == lx_q5_0 ? 0 : un == lx_iq4_nl ? 1 : 2, wb, row_bytes, n, r0, r1, ab, Y))
        return; /* decode */
    if (!has_min && n_tok >= 2 &&
        tile2_mat(un == lx_q5_0 ? 0 : un == lx_iq4_nl ? 1 : 2, wb, row_bytes, n, r0, r1, ab, a_stride, n_tok, Y, y_stride))
        return;
    if (n_tok == 1 && n >= 32) /* decode: row pairs */
        for (; r + 2 <= r1; r += 2) {
            float o[2];
            rows2(un, has_min, n, wb + r * row_bytes, row_bytes, row_bytes / (size_t)(n / 32), ab, o);
            Y[r] = o[0];
            Y[r + 1] = o[1];
        }
    for (; r < r1; r++) {
        for (int64_t t = 0; t < n_tok; t += LX_TT) {
            float o[LX_TT];
            const int64_t tt = n_tok - t < LX_TT ? n_tok - t : LX_TT;
            switch (tt) { /* constant TT: the token loop unrolls */
            case 1: row_tile(un, has_min, 1, n, wb + r * row_bytes, ab + t * a_stride, a_stride, o); break;
            case 2: row_tile(un, has_min, 2, n, wb + r * row_bytes, ab + t * a_stride, a_stride, o); break;
            case 3: row_tile(un, has_min, 3, n, wb + r * row_bytes, ab + t * a_stride, a_stride, o); break;
            default: row_tile(un, has_min, 4, n, wb + r * row_bytes, ab + t * a_stride, a_stride, o); break;
            }
            for (int64_t j = 0; j < tt; j++) Y[(size_t)(t + j) * y_stride + (size_t)r] = o[j];
        }
    }
}

#define LEGACY_AVX2(T, HAS_MIN)                                                                  \
    static void T##_dot(int64_t n, float *s, const void *w, const void *a) {                     \
        row_tile(lx_##T, HAS_MIN, 1, n, w, a, 0, s);                                             \
    }                                                                                            \
    static void T##_mat(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1,      \
                        const void *A, size_t a_stride, int64_t n_tok, float *Y, size_t y_stride) { \
        mat(lx_##T, HAS_MIN, W, row_bytes, n, r0, r1, A, a_stride, n_tok, Y, y_stride);          \
    }
LEGACY_AVX2(q4_1, 1)
LEGACY_AVX2(q5_0, 0)
LEGACY_AVX2(q5_1, 1)
LEGACY_AVX2(iq4_nl, 0)
LEGACY_AVX2(mxfp4, 0)

void kv_quant_fill_legacy_avx2(kv_kernels *k) {
    k[KV_TYPE_Q4_1].vec_dot = q4_1_dot;     k[KV_TYPE_Q4_1].mat = q4_1_mat;
    k[KV_TYPE_Q5_0].vec_dot = q5_0_dot;     k[KV_TYPE_Q5_0].mat = q5_0_mat;
    k[KV_TYPE_Q5_1].vec_dot = q5_1_dot;     k[KV_TYPE_Q5_1].mat = q5_1_mat;
    k[KV_TYPE_IQ4_NL].vec_dot = iq4_nl_dot; k[KV_TYPE_IQ4_NL].mat = iq4_nl_mat;
    k[KV_TYPE_MXFP4].vec_dot = mxfp4_dot;   k[KV_TYPE_MXFP4].mat = mxfp4_mat;
}
