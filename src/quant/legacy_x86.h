/* Block unpacking shared by legacy_avx2.c and legacy_avx512.c (each
 * compiles it with its own ISA flags): one 32-value block of Q4_1, Q5_0,
 * Q5_1, IQ4_NL or MXFP4 -> 32 int8 weights w_j in element order (the w of
 * quant/legacy.h), its scale dw and min mw. */
#ifndef KV_QUANT_LEGACY_X86_H
#define KV_QUANT_LEGACY_X86_H

#include <immintrin.h>

#include "quant/legacy.h"

#define LX_AI static inline __attribute__((always_inline))

/* qs[16] -> 32 nibbles (low nibbles are elements 0..15, high 16..31). */
LX_AI __m256i lx_nibbles(const uint8_t *qs) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0xF));
}

/* Bit j of qh[0..4) -> 0x10 in byte j. */
LX_AI __m256i lx_bit4(const uint8_t *qh) {
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi32((int)kv_rd_qh(qh)), spread); /* byte j = qh byte j/8 */
    h = _mm256_or_si256(h, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));              /* all bits but j%8 set */
    return _mm256_and_si256(_mm256_cmpeq_epi8(h, _mm256_set1_epi8(-1)), _mm256_set1_epi8(0x10));
}

LX_AI __m256i lx_table(const int8_t tab[16]) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)tab));
}

LX_AI __m256i lx_q4_1(const void *row, int64_t b, float *dw, float *mw) {
    const kv_block_q4_1 *x = (const kv_block_q4_1 *)row + b;
    *dw = _cvtsh_ss(x->d);
    *mw = _cvtsh_ss(x->m);
    return lx_nibbles(x->qs);
}
LX_AI __m256i lx_q5_0(const void *row, int64_t b, float *dw, float *mw) {
    const kv_block_q5_0 *x = (const kv_block_q5_0 *)row + b;
    *dw = _cvtsh_ss(x->d);
    *mw = 0;
    return _mm256_sub_epi8(_mm256_or_si256(lx_nibbles(x->qs), lx_bit4(x->qh)), _mm256_set1_epi8(16));
}
LX_AI __m256i lx_q5_1(const void *row, int64_t b, float *dw, float *mw) {
    const kv_block_q5_1 *x = (const kv_block_q5_1 *)row + b;
    *dw = _cvtsh_ss(x->d);
    *mw = _cvtsh_ss(x->m);
    return _mm256_or_si256(lx_nibbles(x->qs), lx_bit4(x->qh));
}
LX_AI __m256i lx_iq4_nl(const void *row, int64_t b, float *dw, float *mw) {
    const kv_block_iq4_nl *x = (const kv_block_iq4_nl *)row + b;
    *dw = _cvtsh_ss(x->d);
    *mw = 0;
    return _mm256_shuffle_epi8(lx_table(kv_iq4nl_values), lx_nibbles(x->qs));
}
LX_AI __m256i lx_mxfp4(const void *row, int64_t b, float *dw, float *mw) {
    const kv_block_mxfp4 *x = (const kv_block_mxfp4 *)row + b;
    *dw = kv_e8m0_half(x->e);
    *mw = 0;
    return _mm256_shuffle_epi8(lx_table(kv_mxfp4_values), lx_nibbles(x->qs));
}

#endif
