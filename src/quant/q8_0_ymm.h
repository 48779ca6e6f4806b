/* Q8_0 . Q8_0 in ymm registers, the canonical 4 lanes of an output in a
 * 128-bit half (quant_internal.h): the lone dot and the one-token rows.
 * Included by the AVX2/AVX-VNNI and the AVX-512 kernel files, each with its
 * own I8DOT(u, s) (8 int32 sums of 4 u8 x s8 products), AI, UNROLL and h2f.
 * Activations in [-127, 127] (the sign trick). */
#ifndef KV_Q8_0_YMM_H
#define KV_Q8_0_YMM_H

/* Two blocks' d: the first in lanes 0-3, the second in lanes 4-7. */
AI __m256 q8_dw2(const kv_block_q8_0 *x0, const kv_block_q8_0 *x1) {
    const __m128i h = _mm_cvtsi32_si128((int)((uint32_t)x0->d | (uint32_t)x1->d << 16));
    return _mm256_cvtph_ps(_mm_shuffle_epi8(h, _mm_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3)));
}
/* (l0+l1) + (l2+l3) of each half: out[0] from the low half, out[1] the high. */
AI void q8_hsum4x2(__m256 v, float *o0, float *o1) {
    __m128 s = _mm_hadd_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l0+l1, l2+l3, h0+h1, h2+h3 */
    s = _mm_hadd_ps(s, s);
    *o0 = _mm_cvtss_f32(s);
    *o1 = _mm_cvtss_f32(_mm_movehdup_ps(s));
}

/* One row, one token, the blocks in order: the lone dot. */
static void q8_0_dot(int64_t n, float *s, const void *w, const void *a) {
    const kv_block_q8_0 *x = (const kv_block_q8_0 *)w, *y = (const kv_block_q8_0 *)a;
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < n / 32; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(const void *)x[b].qs);
        const __m256i m = I8DOT(_mm256_sign_epi8(xv, xv),
                                _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(const void *)y[b].qs), xv));
        const __m128i p = _mm_add_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
        acc = _mm_fmadd_ps(_mm_cvtepi32_ps(p), _mm_set1_ps(h2f(x[b].d) * h2f(y[b].d)), acc);
    }
    __m128 t = _mm_hadd_ps(acc, acc);
    *s = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* One token, two rows: row w0's lanes in the low half of the vector, row
 * w1's in the high half (the block's 8 group sums of each row, halves
 * swapped in and added). The two rows are far apart (the first and second
 * half of the rows), so each is a sequential stream; every other block a
 * line of each stream KV_Q8D_PF rows ahead is prefetched. */
#ifndef KV_Q8D_PF
#define KV_Q8D_PF 4 /* rows ahead (4: 35 GB/s, none 32, 8 30 from memory on Zen 5) */
#endif
AI void q8d_tile(int64_t nb, const uint8_t *w0, const uint8_t *w1, size_t rb, const kv_block_q8_0 *y, float *out) {
    __m256 acc = _mm256_setzero_ps();
    const kv_block_q8_0 *x0 = (const kv_block_q8_0 *)(const void *)w0, *x1 = (const kv_block_q8_0 *)(const void *)w1;
    for (int64_t b = 0; b < nb; b++) {
        const __m256i yv = _mm256_loadu_si256((const __m256i *)(const void *)y[b].qs);
        const __m256 da = _mm256_set1_ps(h2f(y[b].d));
        if (KV_Q8D_PF && (b & 1)) {
            _mm_prefetch((const char *)(x0 + b) + KV_Q8D_PF * rb, _MM_HINT_T0);
            _mm_prefetch((const char *)(x1 + b) + KV_Q8D_PF * rb, _MM_HINT_T0);
        }
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)(const void *)x0[b].qs);
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(const void *)x1[b].qs);
        const __m256i m0 = I8DOT(_mm256_sign_epi8(v0, v0), _mm256_sign_epi8(yv, v0));
        const __m256i m1 = I8DOT(_mm256_sign_epi8(v1, v1), _mm256_sign_epi8(yv, v1));
        const __m256i q = _mm256_add_epi32(_mm256_permute2x128_si256(m0, m1, 0x20), _mm256_permute2x128_si256(m0, m1, 0x31));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(q8_dw2(x0 + b, x1 + b), da), acc);
    }
    q8_hsum4x2(acc, out, out + 1);
}

/* ng token groups (pairs or quads) in the fewest tiles of at most per
 * groups, as even as possible: the sizes to kk[], the count returned
 * (at most KV_Q8_MAX_TILES: callers cap their token chunks to it). */
#define KV_Q8_MAX_TILES 512
static int64_t q8_tile_split(int64_t ng, int64_t per, int64_t kk[KV_Q8_MAX_TILES]) {
    const int64_t nj = (ng + per - 1) / per;
    for (int64_t j = 0, k0 = 0; j < nj; j++) {
        kk[j] = (ng - k0 + nj - j - 1) / (nj - j);
        k0 += kk[j];
    }
    return nj;
}

/* One token at a time: rows in two streams (q8d_tile), an odd last row
 * alone. */
static void q8_0_mat1(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1, const void *A,
                      size_t a_stride, int64_t n_tok, float *Y0, size_t y_stride) {
    const int64_t nb = n / 32;
    const uint8_t *wb = (const uint8_t *)W, *ab = (const uint8_t *)A;
    float o[2];
    for (int64_t t = 0; t < n_tok; t++) {
        const kv_block_q8_0 *y = (const kv_block_q8_0 *)(const void *)(ab + (size_t)t * a_stride);
        float *Y = Y0 + (size_t)t * y_stride;
        const int64_t h = (r1 - r0) / 2;
        for (int64_t i = 0; i < h; i++) {
            q8d_tile(nb, wb + (size_t)(r0 + i) * row_bytes, wb + (size_t)(r0 + h + i) * row_bytes, row_bytes, y, o);
            Y[r0 + i] = o[0];
            Y[r0 + h + i] = o[1];
        }
        if (r0 + 2 * h < r1) q8_0_dot(n, Y + r0 + 2 * h, wb + (size_t)(r0 + 2 * h) * row_bytes, y);
    }
}

#endif
