/* Tensor element types with ggml's exact block layouts and numbering.
 *
 * Every type GGUF files may carry has a size entry (so headers of any model
 * can be measured); the types Kvasir computes with (F32, F16, BF16, Q8_0,
 * Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
 * IQ4_XS, plus Q8_K and Q8_1 for activations) also have a scalar
 * reference dequantizer, quantizer and dot product, and optional SIMD
 * variants chosen at run time from CPU features.
 *
 * Dot products take one weight row of `type` and one activation row already
 * converted to the type's `vec_dot_type` (F32->F32, F16->F16, BF16->BF16,
 * Q8_0/Q4_0/Q5_0/IQ4_NL/MXFP4->Q8_0, Q4_1/Q5_1->Q8_1, K-quants and
 * IQ4_XS->Q8_K), mirroring ggml so our logits track
 * llama.cpp's. A dot product's reduction order is fixed per type and backend
 * and never depends on which other rows/tokens are computed alongside. */
#ifndef KVASIR_QUANT_H
#define KVASIR_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum kv_type {
    KV_TYPE_F32 = 0,
    KV_TYPE_F16 = 1,
    KV_TYPE_Q4_0 = 2,
    KV_TYPE_Q4_1 = 3,
    KV_TYPE_Q5_0 = 6,
    KV_TYPE_Q5_1 = 7,
    KV_TYPE_Q8_0 = 8,
    KV_TYPE_Q8_1 = 9,
    KV_TYPE_Q2_K = 10,
    KV_TYPE_Q3_K = 11,
    KV_TYPE_Q4_K = 12,
    KV_TYPE_Q5_K = 13,
    KV_TYPE_Q6_K = 14,
    KV_TYPE_Q8_K = 15,
    KV_TYPE_IQ2_XXS = 16,
    KV_TYPE_IQ2_XS = 17,
    KV_TYPE_IQ3_XXS = 18,
    KV_TYPE_IQ1_S = 19,
    KV_TYPE_IQ4_NL = 20,
    KV_TYPE_IQ3_S = 21,
    KV_TYPE_IQ2_S = 22,
    KV_TYPE_IQ4_XS = 23,
    KV_TYPE_I8 = 24,
    KV_TYPE_I16 = 25,
    KV_TYPE_I32 = 26,
    KV_TYPE_I64 = 27,
    KV_TYPE_F64 = 28,
    KV_TYPE_IQ1_M = 29,
    KV_TYPE_BF16 = 30,
    KV_TYPE_TQ1_0 = 34,
    KV_TYPE_TQ2_0 = 35,
    KV_TYPE_MXFP4 = 39,
    KV_TYPE_NVFP4 = 40,
    KV_TYPE_Q1_0 = 41,
    KV_TYPE_Q2_0 = 42,
    KV_TYPE_COUNT = 43 /* one past the largest id we know; ids in between are holes */
};

#define KV_QK_K 256 /* super-block size of the K-quants */

typedef void (*kv_to_float_fn)(const void *src, float *dst, int64_t n);
typedef void (*kv_from_float_fn)(const float *src, void *dst, int64_t n);
/* *s = dot(w[0..n), a[0..n)); w in the weight type, a in its vec_dot_type. */
typedef void (*kv_vec_dot_fn)(int64_t n, float *s, const void *w, const void *a);

typedef struct kv_type_info {
    const char *name;          /* ggml's name: "q4_K", "f16", ... */
    uint32_t blck;             /* elements per block */
    uint32_t size;             /* bytes per block */
    bool compute;              /* true if the kernels below are set */
    uint32_t vec_dot_type;     /* activation type for vec_dot */
    kv_to_float_fn to_float;   /* dequantize n elements (n % blck == 0) */
    kv_from_float_fn from_float; /* quantize n elements (n % blck == 0) */
    kv_vec_dot_fn vec_dot;     /* dot of one row */
} kv_type_info;

/* Dispatched table (fastest variant for this CPU). NULL for unknown ids.
 * Thread-safe; the first call detects CPU features. */
const kv_type_info *kv_type_get(uint32_t type);
/* Scalar reference table: the oracle for the fast variants. */
const kv_type_info *kv_type_get_ref(uint32_t type);
/* Name -> id ("q4_k" and "Q4_K" both accepted); -1 if unknown. */
int kv_type_from_name(const char *name);
/* Bytes for n elements of type, or 0 if unknown type or n % blck != 0. */
uint64_t kv_type_row_size(uint32_t type, uint64_t n);

/* Which SIMD level the dispatched table uses: "scalar", "avx2", "avxvnni"
 * (AVX2 + AVX-VNNI), "avx512", "neon" (aarch64 ASIMD) or "neondot" (ASIMD +
 * the int8 dot product). */
const char *kv_quant_backend(void);
/* Force a backend for tests/benchmarks (a name above); returns
 * 0, or -1 if the CPU lacks it. Not thread-safe: call before computing. */
int kv_quant_set_backend(const char *name);

/* Half/bfloat conversions with ggml's rounding (round-to-nearest-even;
 * bf16 NaNs kept quiet). */
float kv_fp16_to_fp32(uint16_t h);
uint16_t kv_fp32_to_fp16(float f);
float kv_bf16_to_fp32(uint16_t h);
uint16_t kv_fp32_to_bf16(float f);

/* Multiply W (n_rows rows of `type`, each row_bytes long, row r at
 * W + r*row_bytes) by activations A already converted to the vec_dot_type
 * (n_tok rows, a_stride bytes apart), for rows [r0, r1):
 *   Y[t*y_stride + r] = dot(W row r, A row t)
 * Each output element is exactly vec_dot of its pair (identical bits to a
 * lone vec_dot call), whatever the tiling. Single-threaded: callers split
 * row ranges across threads. */
void kv_mat_rows(uint32_t type, const void *W, size_t row_bytes, int64_t n, int64_t r0,
                 int64_t r1, const void *A, size_t a_stride, int64_t n_tok, float *Y,
                 size_t y_stride);

#endif
