/* Private to the quant module: the 32-value block types that pair with
 * Q8_0 activations besides Q4_0 (Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4): ggml's
 * block layouts pinned by static asserts, the value tables, the unpacking
 * every backend shares, and the backend fill functions (legacy_*.c).
 *
 * Values. Element j of a block (0..31) is stored in the low nibble of
 * qs[j] for j < 16 and in the high nibble of qs[j-16] otherwise (Q4_0's
 * arrangement); Q5_0/Q5_1 take a fifth bit from bit j of the little-endian
 * 32-bit qh. Dequantized:
 *   Q4_1   x = d*q + m          q = nibble (0..15)
 *   Q5_0   x = d*(q - 16)       q = nibble | bit<<4 (0..31)
 *   Q5_1   x = d*q + m          q as Q5_0
 *   IQ4_NL x = d*kv_iq4nl[nib]  (the non-linear grid, -127..113)
 *   MXFP4  x = e8m0half(e)*kv_mxfp4[nib]  (twice the E2M1 values, times
 *          2^(e-128): the OCP MX scale with the doubling folded in)
 *
 * Activations, as ggml pairs them: Q8_0 for Q5_0, IQ4_NL and MXFP4; Q8_1
 * for Q4_1 and Q5_1 (Q8_0's bytes plus s = fp16(d * sum of the block's
 * quants), d the unrounded amax/127), which carries the min term m*sum(x).
 *
 * Reduction order of the dot (all backends, so scalar, AVX2, AVX-512, NEON
 * and OpenCL give identical bits). Each block's weights are first turned
 * into 32 integers w_j (q for Q4_1/Q5_1, q - 16 for Q5_0, the table value
 * for IQ4_NL/MXFP4). For block b and group g (values 4g..4g+3, g = 0..7)
 * p = sum w_j*a_j is exact int32, and a lane takes
 *   lane = fma((float)p, dw*da, lane)
 * in block order (dw, da the fp16 scales widened to float; MXFP4's dw is
 * the e8m0 half-scale).
 *  - Q5_0, IQ4_NL, MXFP4: 16 lanes, lane 8*(b&1) + g (Q4_0's order); the
 *    result is kv_fold16 of the lanes.
 *  - Q4_1, Q5_1: 8 lanes, lane g, one chain over the blocks, and a scalar
 *    summ = fma(mw, s, summ) in block order (mw the block's fp16 min, s the
 *    activation block's); the result is kv_hsum8(lanes) + summ. This is
 *    the order of ggml's AVX2 ggml_vec_dot_q4_1_q8_1 / _q5_1_q8_1 (what
 *    llama.cpp runs on x86), so Kvasir's results are llama.cpp's bits there:
 *    any other order leaves last-bit differences that the cancelling min
 *    term magnifies until activations round differently (0.1 in log-prob).
 */
#ifndef KV_QUANT_LEGACY_H
#define KV_QUANT_LEGACY_H

#include "quant/quant_internal.h"

typedef struct {
    uint16_t d;      /* fp16 scale (amax/127) */
    uint16_t s;      /* fp16 of d*sum(qs), d unrounded */
    int8_t qs[32];   /* x = d * qs */
} kv_block_q8_1;
_Static_assert(sizeof(kv_block_q8_1) == 36, "q8_1 block size");

typedef struct {
    uint16_t d;      /* fp16 scale */
    uint16_t m;      /* fp16 min (the value of q = 0) */
    uint8_t qs[16];  /* nibbles: x[j] low, x[j+16] high */
} kv_block_q4_1;
_Static_assert(sizeof(kv_block_q4_1) == 20, "q4_1 block size");

typedef struct {
    uint16_t d;      /* fp16 scale */
    uint8_t qh[4];   /* bit j: fifth bit of x[j], little-endian */
    uint8_t qs[16];  /* low 4 bits, as q4_1 */
} kv_block_q5_0;
_Static_assert(sizeof(kv_block_q5_0) == 22, "q5_0 block size");

typedef struct {
    uint16_t d;      /* fp16 scale */
    uint16_t m;      /* fp16 min */
    uint8_t qh[4];   /* as q5_0 */
    uint8_t qs[16];  /* as q5_0 */
} kv_block_q5_1;
_Static_assert(sizeof(kv_block_q5_1) == 24, "q5_1 block size");

typedef struct {
    uint16_t d;      /* fp16 scale */
    uint8_t qs[16];  /* nibbles index kv_iq4nl_values */
} kv_block_iq4_nl;
_Static_assert(sizeof(kv_block_iq4_nl) == 18, "iq4_nl block size");

typedef struct {
    uint8_t e;       /* E8M0 shared exponent */
    uint8_t qs[16];  /* nibbles index kv_mxfp4_values (E2M1 codes) */
} kv_block_mxfp4;
_Static_assert(sizeof(kv_block_mxfp4) == 17, "mxfp4 block size");

/* ggml's kvalues_iq4nl and kvalues_mxfp4 (E2M1 doubled). */
static const int8_t kv_iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                           1,    13,   25,  38,  53,  69,  89,  113};
static const int8_t kv_mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(e-128) (half the E8M0 scale 2^(e-127)), exact: e < 2 are subnormal. */
static inline float kv_e8m0_half(uint8_t e) {
    return kv_u2f(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}

static inline uint32_t kv_rd_qh(const uint8_t qh[4]) {
    return (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
}

/* Element j's nibble of a qs[16] array. */
static inline int kv_nib(const uint8_t *qs, int j) { return j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4; }

/* Filled by each backend file (legacy_ref.c, legacy_avx2.c, ...). */
void kv_quant_fill_legacy_ref(kv_kernels *k);
void kv_quant_fill_legacy_avx2(kv_kernels *k);
void kv_quant_fill_legacy_avx512(kv_kernels *k);
void kv_quant_fill_legacy_neon(kv_kernels *k);    /* aarch64 only */
void kv_quant_fill_legacy_neondot(kv_kernels *k); /* aarch64 with DotProd only */

/* Weight quantizers (legacy_quantize.c), scalar; the dispatched tables use them. */
void kv_quant_q4_1_from_float(const float *src, void *dst, int64_t n);
void kv_quant_q5_0_from_float(const float *src, void *dst, int64_t n);
void kv_quant_q5_1_from_float(const float *src, void *dst, int64_t n);
void kv_quant_iq4_nl_from_float(const float *src, void *dst, int64_t n);
void kv_quant_mxfp4_from_float(const float *src, void *dst, int64_t n);

#endif
