/* Internals shared by the model files (loader, forward pass, local experts). */
#ifndef KVASIR_MODEL_INTERNAL_H
#define KVASIR_MODEL_INTERNAL_H

#include "kvasir/model.h"

struct kv_model {
    kv_gguf *gguf;       /* owns the mapping all weights point into */
    kv_tok *tok;
    kv_hparams hp;
    kv_weight tok_embd;  /* [n_vocab][n_embd] */
    kv_weight output_norm; /* [n_embd] f32 */
    kv_weight output;    /* [n_vocab][n_embd]; == tok_embd when tied */
    kv_layer *layers;    /* [n_layer] */
    bool has_experts;    /* expert tensors loaded (false for a backbone) */
};

/* ---- ops (src/model/ops.c) ---- */

/* y = rmsnorm(x) * w over n elements, as ggml: sum of squares in double,
 * scale = 1/sqrtf(mean + eps), y[i] = (x[i]*scale) * w[i]. */
void kv_rmsnorm(float *y, const float *x, const float *w, int64_t n, float eps);
/* In-place softmax as ggml: max, exp(x-max) summed in double, times 1/sum. */
void kv_softmax(float *x, int64_t n);
/* NeoX RoPE on one head of head_dim floats at position pos. */
void kv_rope_neox(float *x, int64_t head_dim, int64_t n_rot, int32_t pos, float freq_base,
                  float freq_scale);
/* silu(g) * u elementwise, as ggml's swiglu. */
void kv_swiglu(float *y, const float *g, const float *u, int64_t n);

/* Bytes of scratch kv_matmul needs for n_tok rows of length k (any type). */
size_t kv_matmul_scratch(int64_t k, int64_t n_tok);
/* Converts n_tok rows of x (f32, length k, x_stride floats apart) to w's
 * vec_dot_type into q (q_stride bytes apart). */
void kv_quantize_rows(uint32_t vec_dot_type, const float *x, size_t x_stride, int64_t k,
                      int64_t n_tok, void *q, size_t q_stride);
/* Y[t][r] = W·x[t] for all rows of a 2-D weight (or one expert matrix at
 * mat), parallel over rows on pool. scratch from kv_matmul_scratch. */
void kv_matmul(kv_pool *pool, const kv_weight *w, const void *mat, const float *x, int64_t n_tok,
               float *y, void *scratch);

#endif
