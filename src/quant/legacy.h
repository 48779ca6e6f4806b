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
 * Reduction order of the dot with a Q8_0 activation row (all backends, so
 * scalar, AVX2, AVX-512, NEON and OpenCL give identical bits). Each block's
 * weights are first turned into 32 integers w_j (q for Q4_1/Q5_1, q - 16
 * for Q5_0, the table value for IQ4_NL/MXFP4). For block b and group g
 * (values 4g..4g+3, g = 0..7) the sums p = sum w_j*a_j and, for Q4_1/Q5_1,
 * s = sum a_j are exact int32. Lane 8*(b&1) + g takes
 *   lane = fma((float)p, dw*da, lane)              then, Q4_1/Q5_1 only,
 *   lane = fma((float)s, mw*da, lane)
 * in block order (dw, mw, da the fp16 scales widened to float; MXFP4's dw
 * is the e8m0 half-scale), and the row's result is kv_fold16 of the 16
 * lanes: Q4_0's order, with the min term folded into the same lanes. ggml
 * pairs Q4_1/Q5_1 with Q8_1 (whose s is d*sum rounded to fp16); with Q8_0
 * the sum stays exact, and the qs bytes are the same. */
#ifndef KV_QUANT_LEGACY_H
#define KV_QUANT_LEGACY_H

#include "quant/quant_internal.h"

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
void kv_quant_fill_legacy_neon(kv_kernels *k); /* aarch64 only */

/* Weight quantizers (legacy_quantize.c), scalar; the dispatched tables use them. */
void kv_quant_q4_1_from_float(const float *src, void *dst, int64_t n);
void kv_quant_q5_0_from_float(const float *src, void *dst, int64_t n);
void kv_quant_q5_1_from_float(const float *src, void *dst, int64_t n);
void kv_quant_iq4_nl_from_float(const float *src, void *dst, int64_t n);
void kv_quant_mxfp4_from_float(const float *src, void *dst, int64_t n);

#endif
