/* Row operations shared by the forward pass (src/model/) and the expert
 * providers (src/moe/), written to follow ggml's arithmetic so results track
 * llama.cpp's. Implemented in src/model/ops.c; thread-safe, no allocation. */
#ifndef KVASIR_OPS_H
#define KVASIR_OPS_H

#include <stddef.h>
#include <stdint.h>

/* silu(g) * u elementwise, as ggml's swiglu. */
void kv_swiglu(float *y, const float *g, const float *u, int64_t n);
/* gpt-oss's clamped SwiGLU, as ggml's swiglu_oai with alpha 1.702 and
 * limit 7: x = min(g, 7), v = clamp(u, -7, 7), y = x / (1 + e^(-1.702 x))
 * * (v + 1). */
#define KV_SWIGLU_OAI_ALPHA 1.702f
#define KV_SWIGLU_OAI_LIMIT 7.0f
void kv_swiglu_oai(float *y, const float *g, const float *u, int64_t n);
/* The expert activation act (enum kv_expert_act: 0 SwiGLU, 1 clamped; others SwiGLU). */
void kv_expert_act(uint32_t act, float *y, const float *g, const float *u, int64_t n);

/* Bytes of scratch kv_matmul needs for n_tok rows of length k (any type). */
size_t kv_matmul_scratch(int64_t k, int64_t n_tok);
/* Converts n_tok rows of x (f32, length k, x_stride floats apart) to w's
 * vec_dot_type into q (q_stride bytes apart). */
void kv_quantize_rows(uint32_t vec_dot_type, const float *x, size_t x_stride, int64_t k,
                      int64_t n_tok, void *q, size_t q_stride);

#endif
