/* Private to the quant module: ggml's block layouts, small inline helpers
 * shared by the scalar reference and the SIMD files, and the per-backend
 * kernel tables.
 *
 * The canonical reduction order. Every backend computes a dot product in
 * exactly the order below, so scalar, AVX2 and AVX-512 give identical bits
 * (the SIMD files are tested bit-for-bit against the scalar reference):
 *
 *  - F32, F16, BF16: element i goes to lane i % 8; each lane accumulates
 *    with a fused multiply-add in increasing i (f16/bf16 widened to f32
 *    exactly first); the 8 lanes are then summed by kv_hsum8's fixed tree.
 *  - Q8_0.Q8_0: 4 lanes. For block b (32 values) and lane l, the integer
 *    sum p = sum w*a over the 8 values j with (j % 16) / 4 == l (values
 *    4l..4l+3 and 16+4l..16+4l+3) is exact; lane l accumulates
 *    fma((float)p, dw_b*da_b, lane) in block order, one chain; then
 *    kv_hsum4 ((l0+l1) + (l2+l3)). What two maddubs+madd (or dpbusd) steps
 *    leave in one 128-bit half when a block's two 16-byte halves are the two
 *    operands, so a ymm carries two (row, token) outputs and a zmm four;
 *    NEON's sdot on the two halves gives exactly these lanes.
 *  - Q4_0.Q8_0: 16 lanes. For block b (32 values) and group g
 *    (values 4g..4g+3) the integer sum p = sum w*a is exact; lane
 *    8*(b&1) + g accumulates fma((float)p, dw_b*da_b, lane) in block order;
 *    then kv_fold16 (lane l + lane l+8, then kv_hsum8). This is what one
 *    maddubs+madd (AVX2) or dpbusd (VNNI) step yields per block in a ymm;
 *    even and odd blocks go to two accumulators.
 *  - K-quants . Q8_K: 8 lanes, no horizontal sum until the end of the row.
 *    Lane j of a super-block takes the values p with (p / 4) % 8 == j (what
 *    one maddubs + madd/dpwssd step leaves in int32 lane j of a ymm, or in
 *    lanes j and j+8 of a zmm). Q4_K, Q5_K: L_j = sum sc*q*a over lane j
 *    (q unsigned), M_j = m_j * (bsums[2j] + bsums[2j+1]) (sub-block j's
 *    min), both exact; acc_j = fma((float)L_j, da*d, acc_j),
 *    accm_j = fma((float)M_j, da*dmin, accm_j) in super-block order; result
 *    kv_hsum8(acc - accm). Q6_K: L_j as above with q unsigned 0..63,
 *    C_j = sc_2j*bsums[2j] + sc_2j+1*bsums[2j+1]; acc_j =
 *    fma((float)(L_j - 32*C_j), da*d, acc_j); result kv_hsum8(acc).
 *  - Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4: written in quant/legacy.h.
 *  - Q2_K, Q3_K, IQ4_XS . Q8_K: the same 8 lanes (lane j: values p with
 *    (p / 4) % 8 == j) and one fma per lane and super-block:
 *    Q2_K: L_j = sum sc*q*a (q 0..3, sc the 4-bit scale of q's group of
 *    16), M_j = m_2j*bsums[2j] + m_2j+1*bsums[2j+1] (4-bit mins), then as
 *    Q4_K: acc_j = fma((float)L_j, da*d, acc_j), accm_j = fma((float)M_j,
 *    da*dmin, accm_j), result kv_hsum8(acc - accm). Q3_K: as Q6_K with
 *    u = q + 4 (0..7) and s = the 6-bit scale - 32: L_j = sum s*u*a,
 *    C_j = s_2j*bsums[2j] + s_2j+1*bsums[2j+1], acc_j = fma((float)(L_j -
 *    4*C_j), da*d, acc_j), result kv_hsum8(acc). IQ4_XS: L_j = sum
 *    (ls-32)*v*a (v = kvalues_iq4nl[q], ls the 6-bit scale of q's 32),
 *    acc_j = fma((float)L_j, da*d, acc_j), result kv_hsum8(acc). Each
 *    integer is exact, so only the lane partition and the float steps are
 *    fixed: the SIMD files may gather a lane's integers in any order
 *    (kquant_ref.c, kquant_avx2.c, kquant_avx512.c, kquant_neon.c).
 *
 * Activation blocks must hold values in [-127, 127] (what our quantizers
 * produce); the AVX2 sign trick relies on it. */
#ifndef KV_QUANT_INTERNAL_H
#define KV_QUANT_INTERNAL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvasir/quant.h"

#define KV_QK8_0 32
#define KV_QK4_0 32
#define KV_K_SCALE_SIZE 12

typedef struct {
    uint16_t d;                /* fp16 scale */
    int8_t qs[KV_QK8_0];       /* x = d * qs */
} kv_block_q8_0;
_Static_assert(sizeof(kv_block_q8_0) == 34, "q8_0 block size");

typedef struct {
    uint16_t d;                /* fp16 scale */
    uint8_t qs[KV_QK4_0 / 2];  /* x[j] = d*((qs[j]&15)-8), x[j+16] = d*((qs[j]>>4)-8) */
} kv_block_q4_0;
_Static_assert(sizeof(kv_block_q4_0) == 18, "q4_0 block size");

typedef struct {
    uint16_t d;                      /* fp16 super-scale of the 6-bit scales */
    uint16_t dmin;                   /* fp16 super-scale of the 6-bit mins */
    uint8_t scales[KV_K_SCALE_SIZE]; /* 8 scales + 8 mins, 6 bits each, packed */
    uint8_t qs[KV_QK_K / 2];         /* 4-bit quants: 64-element chunks, low nibbles first */
} kv_block_q4_K;
_Static_assert(sizeof(kv_block_q4_K) == 144, "q4_K block size");

typedef struct {
    uint16_t d;                      /* fp16 super-scale of the 6-bit scales */
    uint16_t dmin;                   /* fp16 super-scale of the 6-bit mins */
    uint8_t scales[KV_K_SCALE_SIZE]; /* as q4_K */
    uint8_t qh[KV_QK_K / 8];         /* 5th bit: bit 2c (low) / 2c+1 (high) of chunk c */
    uint8_t qs[KV_QK_K / 2];         /* low 4 bits, as q4_K */
} kv_block_q5_K;
_Static_assert(sizeof(kv_block_q5_K) == 176, "q5_K block size");

typedef struct {
    uint8_t ql[KV_QK_K / 2];     /* low 4 bits */
    uint8_t qh[KV_QK_K / 4];     /* high 2 bits */
    int8_t scales[KV_QK_K / 16]; /* one int8 scale per 16 elements */
    uint16_t d;                  /* fp16 super-scale */
} kv_block_q6_K;
_Static_assert(sizeof(kv_block_q6_K) == 210, "q6_K block size");

typedef struct {
    float d;                      /* scale (may be negative) */
    int8_t qs[KV_QK_K];           /* x = d * qs */
    int16_t bsums[KV_QK_K / 16];  /* sum of qs in each group of 16 */
} kv_block_q8_K;
_Static_assert(sizeof(kv_block_q8_K) == 292, "q8_K block size");

typedef struct {
    uint8_t scales[KV_QK_K / 16]; /* per 16 values: scale (low 4 bits), min (high 4 bits) */
    uint8_t qs[KV_QK_K / 4];      /* 2-bit quants: value 128h + 32k + l at bits 2k of qs[32h + l] */
    uint16_t d;                   /* fp16 super-scale of the scales */
    uint16_t dmin;                /* fp16 super-scale of the mins */
} kv_block_q2_K;
_Static_assert(sizeof(kv_block_q2_K) == 84, "q2_K block size");

typedef struct {
    uint8_t hmask[KV_QK_K / 8]; /* 3rd bit: value 32c + l at bit c of hmask[l]; clear means -4 */
    uint8_t qs[KV_QK_K / 4];    /* low 2 bits, laid out as q2_K */
    uint8_t scales[12];         /* 16 scales, 6 bits each (stored + 32), packed */
    uint16_t d;                 /* fp16 super-scale */
} kv_block_q3_K;
_Static_assert(sizeof(kv_block_q3_K) == 110, "q3_K block size");

typedef struct {
    uint16_t d;                     /* fp16 super-scale */
    uint16_t scales_h;              /* high 2 bits of the 8 sub-block scales */
    uint8_t scales_l[KV_QK_K / 64]; /* low 4 bits of the 8 scales, two per byte */
    uint8_t qs[KV_QK_K / 2];        /* 4-bit indices into kv_iq4nl_values (legacy.h), as q4_0 per 32 */
} kv_block_iq4_xs;
_Static_assert(sizeof(kv_block_iq4_xs) == 136, "iq4_xs block size");

/* The 16 signed scales (-32..31) of a q3_K block: scale k has low bits
 * (k < 8 ? b[k] & 15 : b[k-8] >> 4) and high bits (b[8 + k%4] >> 2(k/4)) & 3,
 * unpacked four at a time in 32-bit words. */
static inline void kv_unpack_q3_scales(const uint8_t *b, int8_t s[16]) {
    uint32_t a0, a1, t;
    memcpy(&a0, b, 4);
    memcpy(&a1, b + 4, 4);
    memcpy(&t, b + 8, 4);
    const uint32_t m4 = 0x0f0f0f0fu, m2 = 0x03030303u, b32 = 0x20202020u;
    /* +0x80 per byte before the subtraction keeps each byte from borrowing */
    const uint32_t w[4] = {(a0 & m4) | ((t & m2) << 4), (a1 & m4) | (((t >> 2) & m2) << 4),
                           ((a0 >> 4) & m4) | (((t >> 4) & m2) << 4), ((a1 >> 4) & m4) | (((t >> 6) & m2) << 4)};
    for (int i = 0; i < 4; i++) {
        const uint32_t v = ((w[i] | 0x80808080u) - b32) ^ 0x80808080u; /* each byte: value - 32 */
        memcpy(s + 4 * i, &v, 4);
    }
}

/* The scale (-32..31) of sub-block ib (0..7) of an iq4_xs block. */
static inline int kv_iq4_xs_scale(const kv_block_iq4_xs *b, int ib) {
    return (((b->scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF) | (((b->scales_h >> (2 * ib)) & 3) << 4)) - 32;
}

/* ---- helpers shared by all backends ---- */

static inline uint32_t kv_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float kv_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Round to nearest, ties to even, for |v| < 2^22 (ggml's nearest_int; also
 * what _mm256_round_ps(v, _MM_ROUND_NEAREST) gives). */
static inline int kv_nearest_int(float v) {
    float t = v + 12582912.f;  /* 1.5 * 2^23: the add rounds to an integer */
    return (int)(kv_f2u(t) & 0x007fffff) - 0x00400000;
}

/* Fixed 8-lane tree: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), the order of
 * the usual 256 -> 128 -> 64 -> 32 bit SIMD horizontal sum. */
static inline float kv_hsum8(const float l[8]) {
    float a0 = l[0] + l[4], a1 = l[1] + l[5], a2 = l[2] + l[6], a3 = l[3] + l[7];
    float b0 = a0 + a2, b1 = a1 + a3;
    return b0 + b1;
}

/* 4 lanes: (l0+l1) + (l2+l3), what two horizontal adds give. */
static inline float kv_hsum4(const float l[4]) { return (l[0] + l[1]) + (l[2] + l[3]); }

/* 16 lanes -> 8 (l + l+8) -> kv_hsum8. */
static inline float kv_fold16(const float l[16]) {
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = l[i] + l[i + 8];
    return kv_hsum8(f);
}

/* One super-block's lane sums into the K-quant float lanes (canonical order). */
static inline void kv_k_lanes(float acc[8], float accm[8], const int32_t L[8], const int32_t M[8],
                              float dd, float dm) {
    for (int j = 0; j < 8; j++) {
        acc[j] = fmaf((float)L[j], dd, acc[j]);
        accm[j] = fmaf((float)M[j], dm, accm[j]);
    }
}
static inline float kv_k_result(const float acc[8], const float accm[8]) {
    float l[8];
    for (int j = 0; j < 8; j++) l[j] = acc[j] - accm[j];
    return kv_hsum8(l);
}

/* The 6-bit scale and min of sub-block j (0..7) of a q4_K/q5_K block. */
static inline void kv_scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Unpack all 8 scales and 8 mins of a q4_K/q5_K block. */
static inline void kv_unpack_k4(const uint8_t *q, uint8_t sc[8], uint8_t m[8]) {
    for (int j = 0; j < 8; j++) kv_scale_min_k4(j, q, &sc[j], &m[j]);
}

/* ---- kernel tables ---- */

typedef void (*kv_mat_fn)(const void *W, size_t row_bytes, int64_t n, int64_t r0, int64_t r1,
                          const void *A, size_t a_stride, int64_t n_tok, float *Y,
                          size_t y_stride);

/* One backend's kernels for one type. Unset entries fall back to the next
 * lower backend (avx512 -> avx2 -> ref). */
typedef struct {
    kv_to_float_fn to_float;
    kv_from_float_fn from_float;
    kv_vec_dot_fn vec_dot;
    kv_mat_fn mat;
} kv_kernels;

/* Filled by each backend file; index = type id. */
void kv_quant_fill_ref(kv_kernels *k);
void kv_quant_fill_avx2(kv_kernels *k);
void kv_quant_fill_avxvnni(kv_kernels *k); /* AVX2 + AVX-VNNI: the AVX2 kernels, integer steps by vpdpbusd */
void kv_quant_fill_avx512(kv_kernels *k);
void kv_quant_fill_neon(kv_kernels *k);    /* aarch64 only */
void kv_quant_fill_neondot(kv_kernels *k); /* aarch64 with DotProd only */
/* Q2_K, Q3_K, IQ4_XS (kquant_*.c): each overlays its entries on a table
 * filled by the function above of the same level. */
void kv_kquant_fill_ref(kv_kernels *k);
void kv_kquant_fill_avx2(kv_kernels *k);
void kv_kquant_fill_avx512(kv_kernels *k);
void kv_kquant_fill_neon(kv_kernels *k); /* aarch64 only */

/* kv_f32_wsum_rows per backend (quant/vec.h); acc: continue from o's
 * values instead of 0 (kv_f32_wsum_rows_acc). */
typedef void (*kv_wsum_fn)(float *o, const float *w, const float *V, size_t v_stride,
                           int64_t n_rows, int64_t n, int acc);
void kv_f32_wsum_ref(float *o, const float *w, const float *V, size_t v_stride, int64_t n_rows,
                     int64_t n, int acc);
void kv_f32_wsum_avx2(float *o, const float *w, const float *V, size_t v_stride, int64_t n_rows,
                      int64_t n, int acc);
void kv_f32_wsum_avx512(float *o, const float *w, const float *V, size_t v_stride, int64_t n_rows,
                        int64_t n, int acc);
void kv_f32_wsum_neon(float *o, const float *w, const float *V, size_t v_stride, int64_t n_rows,
                      int64_t n, int acc); /* aarch64 only */

/* kv_f32_wsum_rows_multi per backend (quant/vec.h). */
typedef void (*kv_wsum_multi_fn)(float *o, size_t o_stride, const float *w, size_t w_stride, int64_t n_q,
                                 const float *V, size_t v_stride, int64_t n_rows, int64_t n, int acc);
void kv_f32_wsum_multi_avx2(float *o, size_t o_stride, const float *w, size_t w_stride, int64_t n_q,
                            const float *V, size_t v_stride, int64_t n_rows, int64_t n, int acc);
void kv_f32_wsum_multi_avx512(float *o, size_t o_stride, const float *w, size_t w_stride, int64_t n_q,
                              const float *V, size_t v_stride, int64_t n_rows, int64_t n, int acc);

/* kv_f32_softmax per backend (quant/vec.h), and its constants. */
typedef void (*kv_softmax_fn)(float *x, int64_t n, float scale);
void kv_f32_softmax_ref(float *x, int64_t n, float scale);
void kv_f32_softmax_avx2(float *x, int64_t n, float scale);
/* kv_f32_silu per backend (quant/vec.h). */
typedef void (*kv_silu_fn)(float *y, const float *x, int64_t n);
void kv_f32_silu_ref(float *y, const float *x, int64_t n);
void kv_f32_silu_avx2(float *y, const float *x, int64_t n);
#define KV_EXP_L2E 0x1.715476p+0f     /* log2(e) */
#define KV_EXP_MAGIC 0x1.8p+23f       /* 1.5 * 2^23: adding it rounds to an integer */
#define KV_EXP_LN2_HI 0x1.62e4p-1f    /* ln 2, high bits (trailing zeros: f * hi exact) */
#define KV_EXP_LN2_LO 0x1.7f7d1cp-20f /* ln 2 - hi */
#define KV_EXP_MIN (-87.0f)           /* below: 0 */
#define KV_EXP_MAX 88.0f              /* kv_f32_silu: -x above it gives x * 0 (e^-x past float) */
/* 1/k! for k = 7 .. 0 */
#define KV_EXP_C7 0x1.a01a02p-13f
#define KV_EXP_C6 0x1.6c16c2p-10f
#define KV_EXP_C5 0x1.111112p-7f
#define KV_EXP_C4 0x1.555556p-5f
#define KV_EXP_C3 0x1.555556p-3f
#define KV_EXP_C2 0x1p-1f
#define KV_EXP_C1 0x1p+0f
#define KV_EXP_C0 0x1p+0f

/* kv_exp (quant/vec.h) of one float; the vector backends run the same
 * operations lane by lane and use this for their tails. */
static inline float kv_exp_ref(float y) {
    const float t = fmaf(y, KV_EXP_L2E, KV_EXP_MAGIC), f = t - KV_EXP_MAGIC;
    float r = fmaf(f, -KV_EXP_LN2_HI, y);
    r = fmaf(f, -KV_EXP_LN2_LO, r);
    float p = KV_EXP_C7;
    p = fmaf(p, r, KV_EXP_C6);
    p = fmaf(p, r, KV_EXP_C5);
    p = fmaf(p, r, KV_EXP_C4);
    p = fmaf(p, r, KV_EXP_C3);
    p = fmaf(p, r, KV_EXP_C2);
    p = fmaf(p, r, KV_EXP_C1);
    p = fmaf(p, r, KV_EXP_C0);
    uint32_t tb, sb;
    memcpy(&tb, &t, 4);
    sb = (tb - 0x4B400000u + 127u) << 23; /* 0x4B400000: the bits of KV_EXP_MAGIC */
    float sc;
    memcpy(&sc, &sb, 4);
    const float e = p * sc;
    return y < KV_EXP_MIN ? 0.0f : e;
}

/* kv_f32_delta_rows per backend (quant/vec.h). */
typedef void (*kv_delta_fn)(const float *S, float *D, int64_t n_rows, int64_t n, const float *k,
                            const float *q, const float *v, float decay, float beta, float scale,
                            float *o);
void kv_f32_delta_ref(const float *S, float *D, int64_t n_rows, int64_t n, const float *k,
                      const float *q, const float *v, float decay, float beta, float scale, float *o);
void kv_f32_delta_avx2(const float *S, float *D, int64_t n_rows, int64_t n, const float *k,
                       const float *q, const float *v, float decay, float beta, float scale, float *o);
void kv_f32_delta_stream_avx2(const float *S, float *D, int64_t n_rows, int64_t n, const float *k,
                              const float *q, const float *v, float decay, float beta, float scale, float *o);

/* Generic mat kernel: calls vec_dot per (row, token) pair. */
void kv_mat_generic(kv_vec_dot_fn dot, const void *W, size_t row_bytes, int64_t n, int64_t r0,
                    int64_t r1, const void *A, size_t a_stride, int64_t n_tok, float *Y,
                    size_t y_stride);

#endif
