/* AVX-512 (F, BW, DQ, VL, VNNI) kernels of Q5_0, IQ4_NL and MXFP4 against
 * Q8_0 activations; called only after run-time detection. Bit-identical to
 * legacy_ref.c: the canonical order of quant/legacy.h puts block b's 8
 * group sums in lanes 8*(b&1) + g, which is exactly one zmm holding an even
 * block in its low half and the next odd block in its high half. Group sums
 * are one vpdpbusd (u8 x s8, int32 accumulation, no saturation) of |w|
 * against the activation negated where w < 0. A row with an odd block count
 * ends with its last block in the low half alone. Q4_1 and Q5_1 keep the
 * AVX2 kernels: their order is one 8-lane chain (ggml's), which a zmm
 * cannot split. */
#include "quant/legacy_x86.h"

#define AI LX_AI
#define LX_TT 4 /* tokens per row pass */

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
    for (int t = 0; t < TT; t++) acc[t] = _mm512_setzero_ps();
    const int64_t nb = n / 32;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        float dw0, dw1, mw;
        const __m256i x0 = un(w, b, &dw0, &mw), x1 = un(w, b + 1, &dw1, &mw);
        const __m512i xv = _mm512_inserti64x4(_mm512_castsi256_si512(x0), x1, 1);
        for (int t = 0; t < TT; t++) {
            const kv_block_q8_0 *y = (const kv_block_q8_0 *)(a + (size_t)t * ab) + b;
            const __m512i yv = _mm512_inserti64x4(_mm512_castsi256_si512(ld_qs(&y[0])), ld_qs(&y[1]), 1);
            const __m512 d = two(dw0 * _cvtsh_ss(y[0].d), dw1 * _cvtsh_ss(y[1].d));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(grp(xv, yv)), d, acc[t]);
        }
    }
    if (b < nb) { /* an even last block: low half only */
        float dw, mw;
        const __m512i xv = _mm512_castsi256_si512(un(w, b, &dw, &mw));
        for (int t = 0; t < TT; t++) {
            const kv_block_q8_0 *y = (const kv_block_q8_0 *)(a + (size_t)t * ab) + b;
            const __m512i yv = _mm512_castsi256_si512(ld_qs(y));
            __m256 lo = _mm512_castps512_ps256(acc[t]);
            lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm512_castsi512_si256(grp(xv, yv))),
                                 _mm256_set1_ps(dw * _cvtsh_ss(y->d)), lo);
            acc[t] = _mm512_insertf32x8(acc[t], lo, 0);
        }
    }
    for (int t = 0; t < TT; t++) { /* kv_fold16: low + high half, then the kv_hsum8 tree */
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

#define LEGACY_AVX512(T)                                                                         \
    static void T##_dot(int64_t n, float *s, const void *w, const void *a) {                     \
        row_tile(lx_##T, 1, n, w, a, 0, s);                                                      \
    }                                                                                            \
    static void T##_mat(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1,      \
                        const void *A, size_t a_stride, int64_t n_tok, float *Y, size_t y_stride) { \
        mat(lx_##T, W, row_bytes, n, r0, r1, A, a_stride, n_tok, Y, y_stride);                   \
    }
LEGACY_AVX512(q5_0)
LEGACY_AVX512(iq4_nl)
LEGACY_AVX512(mxfp4)

void kv_quant_fill_legacy_avx512(kv_kernels *k) {
    k[KV_TYPE_Q5_0].vec_dot = q5_0_dot;     k[KV_TYPE_Q5_0].mat = q5_0_mat;
    k[KV_TYPE_IQ4_NL].vec_dot = iq4_nl_dot; k[KV_TYPE_IQ4_NL].mat = iq4_nl_mat;
    k[KV_TYPE_MXFP4].vec_dot = mxfp4_dot;   k[KV_TYPE_MXFP4].mat = mxfp4_mat;
}
