/* Q2_K, Q3_K and IQ4_XS against Q8_K with AVX-512 (F, BW, VL; installed
 * only after run-time detection). Two chunks of 32 values per zmm step:
 * int32 lanes 0..7 hold chunk c's canonical lanes, 8..15 chunk c+1's; the
 * two halves are added (exact integers) into the 8 canonical lanes before
 * the float steps, which are the reference's (kquant_ref.c), so the result
 * is bit-identical to it. mat: one token runs the decode kernels below
 * (*_dec: prepared activations, KV_KD_R far-apart rows a pass, prefetch; the
 * zmm dots row by row when n is past their buffer); several tokens run the
 * AVX2 level's row tiles (kquant_avx2.c, one weight decode for up to 4
 * tokens), the same bits. */
#include <immintrin.h>
#include <string.h>

#include "quant/legacy.h" /* kv_iq4nl_values */
#include "quant/quant_internal.h"

#define AI static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 8") /* constant row counts: the accumulators stay in registers */

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

AI void q2_K_row(int64_t n, float *s, const void *w, const void *a, size_t rb) {
    const kv_block_q2_K *x = w;
    const kv_block_q8_K *y = a;
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0xF);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        if (rb) { /* the next row */
            _mm_prefetch((const char *)&x[i] + rb, _MM_HINT_T0);
            _mm_prefetch((const char *)&x[i] + rb + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)&x[i] + rb + sizeof(x[i]) - 1, _MM_HINT_T0);
        }
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
        const float dd = y[i].d * _cvtsh_ss(x[i].d), dm = y[i].d * _cvtsh_ss(x[i].dmin);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold16(isum)), _mm256_set1_ps(dd), acc);
        accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), _mm256_set1_ps(dm), accm);
    }
    *s = hsum8(_mm256_sub_ps(acc, accm));
}

AI void q3_K_row(int64_t n, float *s, const void *w, const void *a, size_t rb) {
    const kv_block_q3_K *x = w;
    const kv_block_q8_K *y = a;
    const __m512i m3 = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        if (rb) { /* the next row */
            _mm_prefetch((const char *)&x[i] + rb, _MM_HINT_T0);
            _mm_prefetch((const char *)&x[i] + rb + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)&x[i] + rb + sizeof(x[i]) - 1, _MM_HINT_T0);
        }
        const __m256i s16y = _mm256_cvtepi8_epi16(q3_scales(x[i].scales));
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
        const float dd = y[i].d * _cvtsh_ss(x[i].d);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(fold16(isum), _mm256_slli_epi32(C, 2))),
                              _mm256_set1_ps(dd), acc);
    }
    *s = hsum8(acc);
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

AI void iq4_xs_row(int64_t n, float *s, const void *w, const void *a, size_t rb) {
    const kv_block_iq4_xs *x = w;
    const kv_block_q8_K *y = a;
    const __m512i tbl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)kv_iq4nl_values));
    const __m512i m4 = _mm512_set1_epi8(0xF), zero = _mm512_setzero_si512();
    /* per 128-bit lane: low nibbles, high nibbles, low, high */
    const __m512i cnt = _mm512_set_epi64(0x0004000400040004ll, 0x0004000400040004ll, 0, 0,
                                         0x0004000400040004ll, 0x0004000400040004ll, 0, 0);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / KV_QK_K; i++) {
        if (rb) { /* the next row */
            _mm_prefetch((const char *)&x[i] + rb, _MM_HINT_T0);
            _mm_prefetch((const char *)&x[i] + rb + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)&x[i] + rb + sizeof(x[i]) - 1, _MM_HINT_T0);
        }
        __m512i isum = _mm512_setzero_si512();
        const __m512i ls8 = _mm512_broadcast_i32x4(iq4_xs_scales(&x[i]));
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
            const __m512i ls = _mm512_shuffle_epi8( /* words ib (low half), ib + 1 (high half) */
                ls8, _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)(0x0100 * (2 * ib + 1) + 2 * ib))),
                                        _mm256_set1_epi16((short)(0x0100 * (2 * ib + 3) + 2 * ib + 2)), 1));
            isum = _mm512_add_epi32(isum, _mm512_madd_epi16(p, ls));
        }
        const float dd = y[i].d * _cvtsh_ss(x[i].d);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(fold16(isum)), _mm256_set1_ps(dd), acc);
    }
    *s = hsum8(acc);
}

/* ---- One token (decode) ----------------------------------------------------
 * The activations are copied once per call (kd_prep) in the order the weights
 * unpack: Q2_K/Q3_K part k (0..3) = [values 32k..32k+31 | 128+32k..], the two
 * chunks whose 2-bit fields share bits 2k of the qs bytes; IQ4_XS the natural
 * order, with -128 * (each group of 4's sum) per group (its weights go in as
 * grid value + 128, unsigned). Weights are never shifted into place: a part
 * is the qs masked where its field lies, so its vpdpbusd sums carry the factor
 * 4^k (Q3_K part 3: 32, its bits brought down by one), which the scale words
 * undo by a uniform factor: the two parts of a pair share an int16 pair per
 * lane (the high part's sum shifted into the high word, exact), one vpdpwssd
 * with (scale, scale) words pre-multiplied so that every term is 4x its
 * value, and the super-block's lane sums shifted right by 2 (exact). The
 * integers are the reference's, the float steps its own, so the same bits. */
#define KD_PRE (48 * 1024)
#ifndef KV_KD_PF
#define KV_KD_PF 8 /* rows ahead */
#endif
#ifndef KV_KD_R
#define KV_KD_R 4 /* rows a pass, from as many far-apart parts of the range (2 -> 4: dec-L2 Q3_K 66 -> 72, IQ4_XS 74 -> 86 GMAC/s) */
#endif

/* Per super-block 256 quants (+ for IQ4_XS 256 bytes of -128 * group sums). */
AI void kd_prep(const kv_block_q8_K *y, int64_t nsb, int iq, uint8_t *buf) {
    const size_t ss = iq ? 512 : 256;
    for (int64_t i = 0; i < nsb; i++) {
        uint8_t *o = buf + (size_t)i * ss;
        const int8_t *q = y[i].qs;
        if (iq) { /* half H: [lo: values 0..15 of sub-blocks 4H..4H+3][hi: 16..31] */
            for (int sb = 0; sb < 8; sb++) {
                memcpy(o + 128 * (sb / 4) + 16 * (sb % 4), q + 32 * sb, 16);
                memcpy(o + 128 * (sb / 4) + 64 + 16 * (sb % 4), q + 32 * sb + 16, 16);
            }
            for (int k = 0; k < 4; k++) {
                const __m512i v = _mm512_loadu_si512((const void *)(o + 64 * k));
                _mm512_storeu_si512((void *)(o + 256 + 64 * k),
                                    _mm512_sub_epi32(_mm512_setzero_si512(),
                                                     _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80), v)));
            }
        } else
            for (int k = 0; k < 4; k++) {
                memcpy(o + 64 * k, q + 32 * k, 32);
                memcpy(o + 64 * k + 32, q + 128 + 32 * k, 32);
            }
    }
}

/* Int16 pairs (lo sum, hi sum) per int32 lane: lo is in int16 range, hi is
 * f * sum with the shift sh making it sum * 65536. */
AI __m512i pair16(__m512i lo, __m512i hi, int sh) {
    return _mm512_mask_blend_epi16(0xAAAAAAAAu, lo, _mm512_slli_epi32(hi, (unsigned)sh));
}

/* Word indices into [16 scales, 16 scales x 4] for the pair (k0 low word,
 * k1 high word): int32 lane l < 8 takes chunk k's sub-block 2k + l/4,
 * lane l >= 8 chunk 4 + k's; t0, t1: which table (0 or 16). */
AI __m512i kd_sidx(int k0, int t0, int k1, int t1) {
    int16_t ix[32];
    for (int l = 0; l < 16; l++) {
        const int c0 = (l < 8 ? 0 : 4) + k0, c1 = (l < 8 ? 0 : 4) + k1, g = (l & 7) / 4;
        ix[2 * l] = (int16_t)(t0 + 2 * c0 + g);
        ix[2 * l + 1] = (int16_t)(t1 + 2 * c1 + g);
    }
    return _mm512_loadu_si512((const void *)ix);
}

/* The 8 canonical lanes of one super-block's 4 x (lane sums). */
AI __m256i kd_fold4(__m512i v) { return _mm256_srai_epi32(fold16(v), 2); }

/* Q2_K: R rows against the prepared token (q: its quants); y: the Q8_K blocks. */
AI void q2_K_dec(int R, int64_t nsb, const uint8_t *const *w, size_t rb, const uint8_t *q, const kv_block_q8_K *y,
                 float *out, __m512i ixA, __m512i ixB) {
    __m256 acc[KV_KD_R], accm[KV_KD_R];
    UNROLL for (int r = 0; r < R; r++) acc[r] = accm[r] = _mm256_setzero_ps();
    const __m512i m0 = _mm512_set1_epi8(0x03), m1 = _mm512_set1_epi8(0x0C), m2 = _mm512_set1_epi8(0x30),
                  m3 = _mm512_set1_epi8((char)0xC0);
    for (int64_t i = 0; i < nsb; i++) {
        const uint8_t *yq = q + (size_t)i * 256;
        const __m512i y0 = _mm512_load_si512((const void *)yq), y1 = _mm512_load_si512((const void *)(yq + 64)),
                      y2 = _mm512_load_si512((const void *)(yq + 128)), y3 = _mm512_load_si512((const void *)(yq + 192));
        const __m256i bs = _mm256_loadu_si256((const __m256i *)y[i].bsums);
        const __m128 yd = _mm_set1_ps(y[i].d);
        UNROLL for (int r = 0; r < R; r++) {
            const kv_block_q2_K *x = (const kv_block_q2_K *)(const void *)w[r] + i;
            _mm_prefetch((const char *)x + KV_KD_PF * rb, _MM_HINT_T0);
            _mm_prefetch((const char *)x + KV_KD_PF * rb + sizeof(*x) - 1, _MM_HINT_T0);
            const __m128i sc8 = _mm_loadu_si128((const __m128i *)x->scales);
            const __m256i s16 = _mm256_cvtepu8_epi16(_mm_and_si128(sc8, _mm_set1_epi8(0xF)));
            const __m512i st = _mm512_inserti64x4(_mm512_castsi256_si512(s16), _mm256_slli_epi16(s16, 2), 1);
            const __m512i qv = _mm512_loadu_si512((const void *)x->qs);
            const __m512i z = _mm512_setzero_si512();
            const __m512i x0 = _mm512_dpbusd_epi32(z, _mm512_and_si512(qv, m0), y0);
            const __m512i x1 = _mm512_dpbusd_epi32(z, _mm512_and_si512(qv, m1), y1);
            const __m512i x2 = _mm512_dpbusd_epi32(z, _mm512_and_si512(qv, m2), y2);
            const __m512i x3 = _mm512_dpbusd_epi32(z, _mm512_and_si512(qv, m3), y3);
            __m512i is = _mm512_dpwssd_epi32(z, pair16(x0, x3, 10), _mm512_permutexvar_epi16(ixA, st));
            is = _mm512_dpwssd_epi32(is, pair16(x1, x2, 12), _mm512_permutexvar_epi16(ixB, st));
            const __m256i m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc8, 4), _mm_set1_epi8(0xF)));
            const __m256i M = _mm256_madd_epi16(bs, m16);
            uint32_t dh; /* d, dmin: adjacent fp16, widened in one step (exact); [da*d, da*dmin] one multiply */
            memcpy(&dh, &x->d, 4);
            const __m256 dd = _mm256_castps128_ps256(_mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)dh)), yd));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(kd_fold4(is)), _mm256_permutexvar_ps(_mm256_setzero_si256(), dd), acc[r]);
            accm[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), _mm256_permutexvar_ps(_mm256_set1_epi32(1), dd), accm[r]);
        }
    }
    UNROLL for (int r = 0; r < R; r++) out[r] = hsum8(_mm256_sub_ps(acc[r], accm[r]));
}

AI void q3_K_dec(int R, int64_t nsb, const uint8_t *const *w, size_t rb, const uint8_t *q, const kv_block_q8_K *y,
                 float *out, __m512i ixA, __m512i ixB) {
    __m256 acc[KV_KD_R];
    UNROLL for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const long long f4 = 0x0004000400040004ll;
    const __m512i hcnt = _mm512_set_epi64(f4, f4, f4, f4, 0, 0, 0, 0);
    for (int64_t i = 0; i < nsb; i++) {
        const uint8_t *yq = q + (size_t)i * 256;
        const __m512i y0 = _mm512_load_si512((const void *)yq), y1 = _mm512_load_si512((const void *)(yq + 64)),
                      y2 = _mm512_load_si512((const void *)(yq + 128)), y3 = _mm512_load_si512((const void *)(yq + 192));
        const __m256i bs = _mm256_loadu_si256((const __m256i *)y[i].bsums);
        UNROLL for (int r = 0; r < R; r++) {
            const kv_block_q3_K *x = (const kv_block_q3_K *)(const void *)w[r] + i;
            _mm_prefetch((const char *)x + KV_KD_PF * rb, _MM_HINT_T0);
            _mm_prefetch((const char *)x + KV_KD_PF * rb + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)x + KV_KD_PF * rb + sizeof(*x) - 1, _MM_HINT_T0);
            const __m256i s16 = _mm256_cvtepi8_epi16(q3_scales(x->scales));
            const __m512i st = _mm512_inserti64x4(_mm512_castsi256_si512(s16), _mm256_slli_epi16(s16, 2), 1);
            const __m512i qv = _mm512_loadu_si512((const void *)x->qs);
            /* chunk k's third bit (low half) and chunk 4 + k's (high half) at bit k */
            const __m512i h = _mm512_srlv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)x->hmask)), hcnt);
            const __m512i z = _mm512_setzero_si512();
            /* u * 4^k (k < 3), u * 32 (k = 3): (q & field) | (third bit at the field's top + 1) */
            const __m512i u0 = _mm512_ternarylogic_epi32(_mm512_and_si512(qv, _mm512_set1_epi8(0x03)),
                                                         _mm512_slli_epi16(h, 2), _mm512_set1_epi8(0x04), 0xF8);
            const __m512i u1 = _mm512_ternarylogic_epi32(_mm512_and_si512(qv, _mm512_set1_epi8(0x0C)),
                                                         _mm512_slli_epi16(h, 3), _mm512_set1_epi8(0x10), 0xF8);
            const __m512i u2 = _mm512_ternarylogic_epi32(_mm512_and_si512(qv, _mm512_set1_epi8(0x30)),
                                                         _mm512_slli_epi16(h, 4), _mm512_set1_epi8(0x40), 0xF8);
            const __m512i u3 = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(qv, 1), _mm512_set1_epi8(0x60)),
                                                         _mm512_slli_epi16(h, 4), _mm512_set1_epi8((char)0x80), 0xF8);
            const __m512i x0 = _mm512_dpbusd_epi32(z, u0, y0), x1 = _mm512_dpbusd_epi32(z, u1, y1);
            const __m512i x2 = _mm512_dpbusd_epi32(z, u2, y2), x3 = _mm512_dpbusd_epi32(z, u3, y3);
            __m512i is = _mm512_dpwssd_epi32(z, pair16(x0, x3, 11), _mm512_permutexvar_epi16(ixA, st));
            is = _mm512_dpwssd_epi32(is, pair16(x1, x2, 12), _mm512_permutexvar_epi16(ixB, st));
            const __m256i C = _mm256_madd_epi16(bs, s16);
            const float dd = y[i].d * _cvtsh_ss(x->d);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(kd_fold4(is), _mm256_slli_epi32(C, 2))),
                                     _mm256_set1_ps(dd), acc[r]);
        }
    }
    UNROLL for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

/* IQ4_XS: half H (0, 1) of a super-block is its 64 qs bytes: 128-bit lane s
 * holds sub-block 4H + s, low nibbles its values 0..15, high nibbles 16..31
 * (the prepared activations in the same order: kd_prep). Each sub-block's
 * exact group sums times its scale (vpmulld, the scale per 128-bit lane),
 * summed per canonical lane at the end of the super-block. */
AI void iq4_xs_dec(int R, int64_t nsb, const uint8_t *const *w, size_t rb, const uint8_t *q, const kv_block_q8_K *y,
                   float *out, __m512i ixA, __m512i ixB) {
    (void)ixA, (void)ixB;
    __m256 acc[KV_KD_R];
    UNROLL for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m512i tbl = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)kv_iq4nl_values)),
                                         _mm512_set1_epi8((char)0x80));
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i i0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i i1 = _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7);
    for (int64_t i = 0; i < nsb; i++) {
        const uint8_t *yq = q + (size_t)i * 512;
        UNROLL for (int r = 0; r < R; r++) {
            const kv_block_iq4_xs *x = (const kv_block_iq4_xs *)(const void *)w[r] + i;
            _mm_prefetch((const char *)x + KV_KD_PF * rb, _MM_HINT_T0);
            _mm_prefetch((const char *)x + KV_KD_PF * rb + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)x + KV_KD_PF * rb + sizeof(*x) - 1, _MM_HINT_T0);
            const __m512i sc = _mm512_castsi256_si512(_mm256_cvtepi16_epi32(iq4_xs_scales(x)));
            __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
            for (int H = 0; H < 2; H++) {
                const __m512i qv = _mm512_loadu_si512((const void *)(x->qs + 64 * H));
                const __m512i sv = _mm512_permutexvar_epi32(H ? i1 : i0, sc);
                const uint8_t *yh = yq + 128 * H;
                const __m512i gl = _mm512_dpbusd_epi32(_mm512_load_si512((const void *)(yh + 256)),
                                                       _mm512_shuffle_epi8(tbl, _mm512_and_si512(qv, m4)),
                                                       _mm512_load_si512((const void *)yh));
                const __m512i gh = _mm512_dpbusd_epi32(_mm512_load_si512((const void *)(yh + 256 + 64)),
                                                       _mm512_shuffle_epi8(tbl, _mm512_and_si512(_mm512_srli_epi16(qv, 4), m4)),
                                                       _mm512_load_si512((const void *)(yh + 64)));
                lo = _mm512_add_epi32(lo, _mm512_mullo_epi32(gl, sv));
                hi = _mm512_add_epi32(hi, _mm512_mullo_epi32(gh, sv));
            }
            /* lane j < 4: the lo lanes 4s + j summed over s; j >= 4: the hi lanes */
            const __m512i c = _mm512_add_epi32(_mm512_shuffle_i64x2(lo, hi, 0x44), _mm512_shuffle_i64x2(lo, hi, 0xEE));
            const __m512i e = _mm512_add_epi32(_mm512_shuffle_i64x2(c, c, 0x08), _mm512_shuffle_i64x2(c, c, 0x0D));
            const float dd = y[i].d * _cvtsh_ss(x->d);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm512_castsi512_si256(e)), _mm256_set1_ps(dd), acc[r]);
        }
    }
    UNROLL for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

/* Rows [r0, r1) against one token, KV_KD_R rows a pass from as many far-apart
 * parts of the range (that many memory streams); 0 when n is past the buffer. */
#define KD_MAT(T, IQ)                                                                           \
    static int T##_decmat(const uint8_t *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1, \
                          const void *A, float *Y) {                                            \
        const int64_t nsb = n / KV_QK_K;                                                        \
        if (nsb < 1 || (size_t)nsb * ((IQ) ? 512 : 256) > KD_PRE) return 0;                    \
        _Alignas(64) uint8_t buf[KD_PRE];                                                       \
        const kv_block_q8_K *y = A;                                                             \
        kd_prep(y, nsb, IQ, buf);                                                               \
        const __m512i ixA = kd_sidx(0, 16, 3, 16);                                              \
        const __m512i ixB = T##_IXB;                                                            \
        const int64_t h = (r1 - r0) / KV_KD_R;                                                  \
        for (int64_t i = 0; i < h; i++) {                                                       \
            const uint8_t *w[KV_KD_R];                                                          \
            float o[KV_KD_R];                                                                   \
            UNROLL for (int s = 0; s < KV_KD_R; s++) w[s] = W + (size_t)(r0 + s * h + i) * row_bytes; \
            T##_dec(KV_KD_R, nsb, w, row_bytes, buf, y, o, ixA, ixB);                           \
            UNROLL for (int s = 0; s < KV_KD_R; s++) Y[r0 + s * h + i] = o[s];                  \
        }                                                                                       \
        for (int64_t r = r0 + KV_KD_R * h; r < r1; r++) {                                       \
            const uint8_t *w[1] = {W + (size_t)r * row_bytes};                                  \
            T##_dec(1, nsb, w, row_bytes, buf, y, Y + r, ixA, ixB);                             \
        }                                                                                       \
        return 1;                                                                               \
    }
/* pair B: (4 x chunk 1's sum, chunk 2's sum): chunk 1 takes the plain scale */
#define q2_K_IXB kd_sidx(1, 0, 2, 16)
#define q3_K_IXB kd_sidx(1, 0, 2, 16)
#define iq4_xs_IXB ixA
KD_MAT(q2_K, 0)
KD_MAT(q3_K, 0)
KD_MAT(iq4_xs, 1)

#ifndef KV_KQ_STREAMS
#define KV_KQ_STREAMS 2
#endif

/* The AVX2 level's mat per type, saved by kv_kquant_fill_avx512 before it
 * overlays its own: the several-token tiles. */
static kv_mat_fn kq_multi[KV_TYPE_COUNT];

#define KQ512(T, TYPE)                                                                          \
    static void T##_dot(int64_t n, float *s, const void *w, const void *a) { T##_row(n, s, w, a, 0); } \
    static void T##_mat(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1, const void *A, \
                        size_t a_stride, int64_t n_tok, float *Y, size_t y_stride) {            \
        const uint8_t *wb = (const uint8_t *)W;                                                 \
        if (n_tok != 1) {                                                                       \
            if (kq_multi[TYPE])                                                                 \
                kq_multi[TYPE](W, row_bytes, n, r0, r1, A, a_stride, n_tok, Y, y_stride);       \
            else                                                                                \
                kv_mat_generic(T##_dot, W, row_bytes, n, r0, r1, A, a_stride, n_tok, Y, y_stride); \
            return;                                                                             \
        }                                                                                       \
        if (T##_decmat(wb, row_bytes, n, r0, r1, A, Y)) return;                                 \
        const int64_t h = (r1 - r0) / KV_KQ_STREAMS;                                            \
        for (int64_t i = 0; i < h; i++)                                                         \
            for (int s = 0; s < KV_KQ_STREAMS; s++) {                                           \
                const int64_t r = r0 + s * h + i;                                               \
                T##_row(n, Y + r, wb + (size_t)r * row_bytes, A, row_bytes);                    \
            }                                                                                   \
        for (int64_t r = r0 + KV_KQ_STREAMS * h; r < r1; r++)                                   \
            T##_row(n, Y + r, wb + (size_t)r * row_bytes, A, row_bytes);                        \
    }

KQ512(q2_K, KV_TYPE_Q2_K)
KQ512(q3_K, KV_TYPE_Q3_K)
KQ512(iq4_xs, KV_TYPE_IQ4_XS)

void kv_kquant_fill_avx512(kv_kernels *k) {
    const int ts[] = {KV_TYPE_Q2_K, KV_TYPE_Q3_K, KV_TYPE_IQ4_XS};
    for (int i = 0; i < 3; i++) kq_multi[ts[i]] = k[ts[i]].mat;
    k[KV_TYPE_Q2_K].vec_dot = q2_K_dot;
    k[KV_TYPE_Q3_K].vec_dot = q3_K_dot;
    k[KV_TYPE_IQ4_XS].vec_dot = iq4_xs_dot;
    k[KV_TYPE_Q2_K].mat = q2_K_mat;
    k[KV_TYPE_Q3_K].mat = q3_K_mat;
    k[KV_TYPE_IQ4_XS].mat = iq4_xs_mat;
}
