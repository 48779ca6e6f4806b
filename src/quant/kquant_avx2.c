/* Q2_K, Q3_K and IQ4_XS against Q8_K with AVX2 (compiled with -mavx2 -mfma
 * -mf16c -mbmi2; installed only after run-time detection). Bit-identical to
 * kquant_ref.c: per super-block, each chunk of 32 values is one
 * maddubs + madd step whose 8 int32 lanes hold lane j = values 4j..4j+3 of
 * the chunk, i.e. the canonical lane (p / 4) % 8 of quant_internal.h; the
 * integers are exact, and the float steps (one conversion, one fma per
 * lane and super-block, kv_hsum8's tree) are the reference's.
 *
 * vec_dot is one row and one token. mat (kq_mat below, also installed on
 * the AVX-512 level) decodes each weight chunk once per row and uses it for
 * up to KQ_TT tokens, prefetches the next row, and with one token reads the
 * rows from KV_KQ_STREAMS far-apart parts of the range in turn, as the
 * Q4_K kernels of simd_avx2.c do. Per (row, token) the int32 lane sums and
 * the float steps are vec_dot's, so the bits are the same. */
#include <immintrin.h>
#include <string.h>

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
        const float dd = y[i].d * _cvtsh_ss(x[i].d), dm = y[i].d * _cvtsh_ss(x[i].dmin);
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
        const float dd = y[i].d * _cvtsh_ss(x[i].d);
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
        const float dd = y[i].d * _cvtsh_ss(x[i].d);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dd), acc);
    }
    *s = hsum8(acc);
}

/* ------------------------------------------------------------------ */
/* Row tiles: one row x TT (1..KQ_TT) tokens, out[t] = vec_dot(row, token t). */

#define KQ_TT 4
#define KQ_UNROLL _Pragma("GCC unroll 8")
/* An int32 accumulator materialized here (no instruction): keeps gcc from
 * holding every unrolled partial product in a register and spilling. */
#define KQ_KEEP(v) __asm__("" : "+x"(v))
#ifndef KV_KQ_STREAMS
#define KV_KQ_STREAMS 2
#endif

/* Bit c (0..7) of every byte of hm at bit 2 (the third bit of a q3_K
 * value): one 16-bit shift (none for c = 2) and one mask; bits a shift
 * moves across bytes land outside bit 2. */
AI __m256i q3_hi(__m256i hm, int c) {
    const __m256i m = _mm256_set1_epi8(4);
    return _mm256_and_si256(c < 2 ? _mm256_slli_epi16(hm, 2 - c) : c > 2 ? _mm256_srli_epi16(hm, c - 2) : hm, m);
}

/* kv_unpack_q3_scales's 16 bytes, built in two general registers and moved
 * to a vector (no store and reload of the bytes). */
AI __m128i q3_scales(const uint8_t *b) {
    uint32_t a0, a1, t;
    memcpy(&a0, b, 4);
    memcpy(&a1, b + 4, 4);
    memcpy(&t, b + 8, 4);
    const uint32_t m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    const uint64_t lo = ((a0 & m4) | ((t & m2) << 4)) | (uint64_t)((a1 & m4) | (((t >> 2) & m2) << 4)) << 32;
    const uint64_t hi = (((a0 >> 4) & m4) | (((t >> 4) & m2) << 4)) | (uint64_t)(((a1 >> 4) & m4) | (((t >> 6) & m2) << 4)) << 32;
    const __m128i v = _mm_set_epi64x((long long)hi, (long long)lo);
    return _mm_sub_epi8(v, _mm_set1_epi8(32)); /* each byte: value - 32 */
}

/* Chunk c's pair of group scales from sh = the 8 scales of c's half of
 * the super-block (words 0..7 of s16 for c < 4, 8..15 for c >= 4) in both
 * 128-bit lanes: word 2(c%4) in the low lane, 2(c%4)+1 in the high one,
 * pick_pair's result with one in-lane shuffle. */
AI __m256i pick_half(__m256i sh, int c) {
    const int k = c & 3;
    return _mm256_shuffle_epi8(sh, _mm256_set_m128i(_mm_set1_epi16((short)(0x0100 * (4 * k + 3) + 4 * k + 2)),
                                                    _mm_set1_epi16((short)(0x0100 * (4 * k + 1) + 4 * k))));
}

AI void q3_K_rtile(const int TT, int64_t nsb, const uint8_t *w, size_t rb, const uint8_t *a, size_t ab,
                   float *out) {
    const __m256i m3 = _mm256_set1_epi8(3);
    __m256 acc[KQ_TT];
    KQ_UNROLL for (int t = 0; t < TT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nsb; i++) {
        const kv_block_q3_K *x = (const kv_block_q3_K *)(const void *)w + i;
        _mm_prefetch((const char *)x + rb, _MM_HINT_T0); /* the next row */
        _mm_prefetch((const char *)x + rb + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)x + rb + sizeof(*x) - 1, _MM_HINT_T0);
        const __m256i s16 = _mm256_cvtepi8_epi16(q3_scales(x->scales));
        const __m256i hm = _mm256_loadu_si256((const __m256i *)(const void *)x->hmask);
        __m256i isum[KQ_TT];
        KQ_UNROLL for (int t = 0; t < TT; t++) isum[t] = _mm256_setzero_si256();
        KQ_UNROLL for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(const void *)(x->qs + 32 * h));
            const __m256i sh = (h ? _mm256_permute4x64_epi64(s16, 0xEE) : _mm256_permute4x64_epi64(s16, 0x44));
            KQ_UNROLL for (int k = 0; k < 4; k++) {
                const int c = 4 * h + k;
                const __m256i u = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * k), m3), q3_hi(hm, c));
                const __m256i sp = pick_half(sh, c);
                KQ_UNROLL for (int t = 0; t < TT; t++) {
                    const kv_block_q8_K *y = (const kv_block_q8_K *)(const void *)(a + t * ab) + i;
                    const __m256i av = _mm256_loadu_si256((const __m256i *)(const void *)(y->qs + 32 * c));
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(_mm256_maddubs_epi16(u, av), sp));
                    KQ_KEEP(isum[t]);
                }
            }
        }
        const float xd = _cvtsh_ss(x->d);
        KQ_UNROLL for (int t = 0; t < TT; t++) {
            const kv_block_q8_K *y = (const kv_block_q8_K *)(const void *)(a + t * ab) + i;
            const __m256i C = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(const void *)y->bsums), s16);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[t], _mm256_slli_epi32(C, 2))),
                                     _mm256_set1_ps(y->d * xd), acc[t]);
        }
    }
    KQ_UNROLL for (int t = 0; t < TT; t++) out[t] = hsum8(acc[t]);
}

AI void q2_K_rtile(const int TT, int64_t nsb, const uint8_t *w, size_t rb, const uint8_t *a, size_t ab,
                   float *out) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0xF);
    __m256 acc[KQ_TT], accm[KQ_TT];
    KQ_UNROLL for (int t = 0; t < TT; t++) acc[t] = accm[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nsb; i++) {
        const kv_block_q2_K *x = (const kv_block_q2_K *)(const void *)w + i;
        _mm_prefetch((const char *)x + rb, _MM_HINT_T0); /* the next row */
        _mm_prefetch((const char *)x + rb + sizeof(*x) - 1, _MM_HINT_T0);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(const void *)x->scales);
        const __m256i s16 = _mm256_cvtepu8_epi16(_mm_and_si128(sc8, m4));
        const __m256i m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc8, 4), m4));
        __m256i isum[KQ_TT];
        KQ_UNROLL for (int t = 0; t < TT; t++) isum[t] = _mm256_setzero_si256();
        KQ_UNROLL for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(const void *)(x->qs + 32 * h));
            const __m256i sh = (h ? _mm256_permute4x64_epi64(s16, 0xEE) : _mm256_permute4x64_epi64(s16, 0x44));
            KQ_UNROLL for (int k = 0; k < 4; k++) {
                const int c = 4 * h + k;
                const __m256i u = _mm256_and_si256(_mm256_srli_epi16(q, 2 * k), m3);
                const __m256i sp = pick_half(sh, c);
                KQ_UNROLL for (int t = 0; t < TT; t++) {
                    const kv_block_q8_K *y = (const kv_block_q8_K *)(const void *)(a + t * ab) + i;
                    const __m256i av = _mm256_loadu_si256((const __m256i *)(const void *)(y->qs + 32 * c));
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(_mm256_maddubs_epi16(u, av), sp));
                    KQ_KEEP(isum[t]);
                }
            }
        }
        const float xd = _cvtsh_ss(x->d), xm = _cvtsh_ss(x->dmin);
        KQ_UNROLL for (int t = 0; t < TT; t++) {
            const kv_block_q8_K *y = (const kv_block_q8_K *)(const void *)(a + t * ab) + i;
            const __m256i M = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(const void *)y->bsums), m16);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(y->d * xd), acc[t]);
            accm[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), _mm256_set1_ps(y->d * xm), accm[t]);
        }
    }
    KQ_UNROLL for (int t = 0; t < TT; t++) out[t] = hsum8(_mm256_sub_ps(acc[t], accm[t]));
}

/* The 8 sub-block scales (-32..31) of an iq4_xs block as int16 words
 * 0..7 (kv_iq4_xs_scale for ib = 0..7): nibble ib of scales_l and bit pair
 * ib of scales_h spread to byte ib with pdep. */
AI __m128i iq4_xs_scales(const kv_block_iq4_xs *x) {
    uint32_t l;
    memcpy(&l, x->scales_l, 4);
    const uint64_t b = _pdep_u64(l, 0x0F0F0F0F0F0F0F0Full) | (_pdep_u64(x->scales_h, 0x0303030303030303ull) << 4);
    return _mm_cvtepi8_epi16(_mm_sub_epi8(_mm_cvtsi64_si128((long long)b), _mm_set1_epi8(32)));
}

AI void iq4_xs_rtile(const int TT, int64_t nsb, const uint8_t *w, size_t rb, const uint8_t *a, size_t ab,
                     float *out) {
    const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)kv_iq4nl_values));
    const __m128i m4 = _mm_set1_epi8(0xF);
    __m256 acc[KQ_TT];
    KQ_UNROLL for (int t = 0; t < TT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nsb; i++) {
        const kv_block_iq4_xs *x = (const kv_block_iq4_xs *)(const void *)w + i;
        _mm_prefetch((const char *)x + rb, _MM_HINT_T0); /* the next row */
        _mm_prefetch((const char *)x + rb + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)x + rb + sizeof(*x) - 1, _MM_HINT_T0);
        __m256i isum[KQ_TT];
        KQ_UNROLL for (int t = 0; t < TT; t++) isum[t] = _mm256_setzero_si256();
        const __m256i ls8 = _mm256_broadcastsi128_si256(iq4_xs_scales(x));
        KQ_UNROLL for (int ib = 0; ib < 8; ib++) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(const void *)(x->qs + 16 * ib));
            const __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
            const __m256i v = _mm256_shuffle_epi8(tbl, idx), va = _mm256_sign_epi8(v, v);
            const __m256i ls = _mm256_shuffle_epi8(ls8, _mm256_set1_epi16((short)(0x0100 * (2 * ib + 1) + 2 * ib)));
            KQ_UNROLL for (int t = 0; t < TT; t++) {
                const kv_block_q8_K *y = (const kv_block_q8_K *)(const void *)(a + t * ab) + i;
                const __m256i av = _mm256_loadu_si256((const __m256i *)(const void *)(y->qs + 32 * ib));
                /* |v| * (a with v's sign): pair sums <= 2 * 127 * 127, no saturation */
                const __m256i p = _mm256_maddubs_epi16(va, _mm256_sign_epi8(av, v));
                isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p, ls));
                KQ_KEEP(isum[t]);
            }
        }
        const float xd = _cvtsh_ss(x->d);
        KQ_UNROLL for (int t = 0; t < TT; t++) {
            const kv_block_q8_K *y = (const kv_block_q8_K *)(const void *)(a + t * ab) + i;
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(y->d * xd), acc[t]);
        }
    }
    KQ_UNROLL for (int t = 0; t < TT; t++) out[t] = hsum8(acc[t]);
}

/* IQ4_XS, one token (decode): 32 qs bytes are sub-blocks 2p (low 128-bit
 * lane) and 2p + 1 (high); their low nibbles (values 0..15 of each) and high
 * nibbles (16..31) are two ymm against the activations copied once per call
 * in that order (iq4_xs_prep), each 128-bit lane scaled by its sub-block's
 * scale. The int32 lanes of the low-nibble products are canonical lanes 0..3
 * (twice: one per sub-block), the high ones 4..7: summed per canonical lane
 * at the end of the super-block. Exact integers, the reference's float steps:
 * the same bits. */
#define KD2_PRE (32 * 1024) /* 256 bytes a super-block: n <= 32,768 */
AI void iq4_xs_prep(const kv_block_q8_K *y, int64_t nsb, uint8_t *buf) {
    for (int64_t i = 0; i < nsb; i++)
        for (int sb = 0; sb < 8; sb++) { /* pair p: [lo: 0..15 of 2p, 2p+1][hi: 16..31 of 2p, 2p+1] */
            uint8_t *o = buf + 256 * i + 64 * (sb / 2) + 16 * (sb % 2);
            memcpy(o, y[i].qs + 32 * sb, 16);
            memcpy(o + 32, y[i].qs + 32 * sb + 16, 16);
        }
}

AI float iq4_xs_dec1(int64_t nsb, const uint8_t *w, size_t rb, const uint8_t *pre, const kv_block_q8_K *y) {
    const __m256i tbl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)kv_iq4nl_values));
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nsb; i++) {
        const kv_block_iq4_xs *x = (const kv_block_iq4_xs *)(const void *)w + i;
        _mm_prefetch((const char *)x + rb, _MM_HINT_T0); /* the next row */
        _mm_prefetch((const char *)x + rb + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)x + rb + sizeof(*x) - 1, _MM_HINT_T0);
        const __m256i ls8 = _mm256_broadcastsi128_si256(iq4_xs_scales(x));
        __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
        KQ_UNROLL for (int p = 0; p < 4; p++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(const void *)(x->qs + 32 * p));
            const __m256i vl = _mm256_shuffle_epi8(tbl, _mm256_and_si256(q, m4));
            const __m256i vh = _mm256_shuffle_epi8(tbl, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
            const __m256i al = _mm256_load_si256((const __m256i *)(const void *)(pre + 256 * i + 64 * p));
            const __m256i ah = _mm256_load_si256((const __m256i *)(const void *)(pre + 256 * i + 64 * p + 32));
            /* words 2p (low lane), 2p + 1 (high lane) of the scales */
            const __m256i ls = _mm256_shuffle_epi8(ls8, _mm256_set_m128i(_mm_set1_epi16((short)(0x0100 * (4 * p + 3) + 4 * p + 2)),
                                                                         _mm_set1_epi16((short)(0x0100 * (4 * p + 1) + 4 * p))));
            /* |v| * (a with v's sign): pair sums <= 2 * 127 * 127, no saturation */
            lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(vl, vl), _mm256_sign_epi8(al, vl)), ls));
            hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(vh, vh), _mm256_sign_epi8(ah, vh)), ls));
        }
        /* lanes 0..3: lo's two 128-bit lanes summed; 4..7: hi's */
        const __m256i is = _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_set1_ps(y[i].d * _cvtsh_ss(x->d)), acc);
    }
    return hsum8(acc);
}

/* Rows [r0,r1) x n_tok tokens. One token: one row at a time from
 * KV_KQ_STREAMS far-apart parts of the range in turn (each row's next row
 * prefetched as it goes). Several: rows in chunks of about 512 KiB of
 * weights (read from memory once, then from L2 by every token tile); per
 * chunk, token tiles of at most KQ_TT, split as evenly as possible, outer;
 * the rows inner. */
#define KQ_CASE(TILE, c)                                                                        \
    case c:                                                                                     \
        for (int64_t r = rc; r < rc_end; r++) {                                                 \
            TILE(c, nsb, wb + (size_t)r * row_bytes, row_bytes, ab + (size_t)t * a_stride, a_stride, o); \
            for (int j = 0; j < (c); j++) Y[(size_t)(t + j) * y_stride + r] = o[j];             \
        }                                                                                       \
        break
#define KQ_MAT(NAME, TILE)                                                                      \
    static void NAME(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1, const void *A, \
                     size_t a_stride, int64_t n_tok, float *Y, size_t y_stride) {               \
        const uint8_t *wb = (const uint8_t *)W, *ab = (const uint8_t *)A;                       \
        const int64_t nsb = n / KV_QK_K;                                                        \
        float o[KQ_TT];                                                                         \
        if (n_tok == 1) {                                                                       \
            const int64_t h = (r1 - r0) / KV_KQ_STREAMS;                                        \
            for (int64_t i = 0; i < h; i++)                                                     \
                for (int s = 0; s < KV_KQ_STREAMS; s++) {                                       \
                    const int64_t r = r0 + s * h + i;                                           \
                    TILE(1, nsb, wb + (size_t)r * row_bytes, row_bytes, ab, a_stride, Y + r);   \
                }                                                                               \
            for (int64_t r = r0 + KV_KQ_STREAMS * h; r < r1; r++)                               \
                TILE(1, nsb, wb + (size_t)r * row_bytes, row_bytes, ab, a_stride, Y + r);       \
            return;                                                                             \
        }                                                                                       \
        const int64_t nj = (n_tok + KQ_TT - 1) / KQ_TT;                                         \
        const int64_t rows_chunk = (int64_t)((512u << 10) / row_bytes) + 1;                     \
        for (int64_t rc = r0; rc < r1; rc += rows_chunk) {                                      \
            const int64_t rc_end = rc + rows_chunk < r1 ? rc + rows_chunk : r1;                 \
            int64_t t = 0;                                                                      \
            for (int64_t j_ = 0; j_ < nj; j_++) {                                               \
                const int64_t left = nj - j_, tt = (n_tok - t + left - 1) / left;               \
                switch (tt) {                                                                   \
                    KQ_CASE(TILE, 1); KQ_CASE(TILE, 2); KQ_CASE(TILE, 3); KQ_CASE(TILE, 4);     \
                default: break;                                                                 \
                }                                                                               \
                t += tt;                                                                        \
            }                                                                                   \
        }                                                                                       \
    }

KQ_MAT(q3_K_mat, q3_K_rtile)
KQ_MAT(q2_K_mat, q2_K_rtile)
KQ_MAT(iq4_xs_mat_tiles, iq4_xs_rtile)

/* IQ4_XS: one token through iq4_xs_dec1 (rows from KV_KQ_STREAMS far-apart
 * parts in turn), else the row tiles. */
static void iq4_xs_mat(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1, const void *A,
                       size_t a_stride, int64_t n_tok, float *Y, size_t y_stride) {
    const int64_t nsb = n / KV_QK_K;
    if (n_tok != 1 || nsb < 1 || (size_t)nsb * 256 > KD2_PRE) {
        iq4_xs_mat_tiles(W, row_bytes, n, r0, r1, A, a_stride, n_tok, Y, y_stride);
        return;
    }
    _Alignas(64) uint8_t pre[KD2_PRE];
    const kv_block_q8_K *y = A;
    const uint8_t *wb = W;
    iq4_xs_prep(y, nsb, pre);
    const int64_t h = (r1 - r0) / KV_KQ_STREAMS;
    for (int64_t i = 0; i < h; i++)
        for (int s = 0; s < KV_KQ_STREAMS; s++) {
            const int64_t r = r0 + s * h + i;
            Y[r] = iq4_xs_dec1(nsb, wb + (size_t)r * row_bytes, row_bytes, pre, y);
        }
    for (int64_t r = r0 + KV_KQ_STREAMS * h; r < r1; r++)
        Y[r] = iq4_xs_dec1(nsb, wb + (size_t)r * row_bytes, row_bytes, pre, y);
}

void kv_kquant_fill_avx2(kv_kernels *k) {
    k[KV_TYPE_Q2_K].vec_dot = q2_K_dot;
    k[KV_TYPE_Q3_K].vec_dot = q3_K_dot;
    k[KV_TYPE_IQ4_XS].vec_dot = iq4_xs_dot;
    k[KV_TYPE_Q2_K].mat = q2_K_mat; /* also the AVX-512 level's (it sets only vec_dot) */
    k[KV_TYPE_Q3_K].mat = q3_K_mat;
    k[KV_TYPE_IQ4_XS].mat = iq4_xs_mat;
}
