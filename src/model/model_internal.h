/* Internals shared by the model files (loader, forward pass, local experts). */
#ifndef KVASIR_MODEL_INTERNAL_H
#define KVASIR_MODEL_INTERNAL_H

#include "kvasir/model.h"
#include "kvasir/ops.h" /* kv_swiglu, kv_matmul_scratch, kv_quantize_rows */

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

/* The run state (allocated in forward.c, extended by qwen35.c). */
struct kv_state {
    const kv_model *m;
    kv_pool *pool;
    uint32_t n_ctx;        /* cache rows per sequence */
    uint32_t n_batch;      /* tokens per prefill chunk */
    uint32_t n_seq;        /* sequences */
    uint32_t max_tok;      /* tokens per forward call: max(n_batch, n_seq) */
    uint32_t *pos;         /* [n_seq] tokens in each sequence's cache */
    uint32_t *tok_seq;     /* [max_tok] sequence of each token of the call */
    uint32_t *tok_pos;     /* [max_tok] position of each token of the call */
    uint32_t *out_all;     /* [max_tok] 0, 1, 2, ...: every token's logits wanted */
    kv_expert_provider own;          /* in-process provider (if no other given) */
    const kv_expert_provider *experts;
    float *k_cache;        /* [n_seq][n_layer][n_ctx][n_head_kv*head_dim] */
    float *v_cache;        /* [n_seq][n_layer][n_ctx][n_head_kv*head_dim] */
    float *x;              /* [max_tok][n_embd] residual stream */
    float *xb;             /* [max_tok][n_embd] normed input */
    float *q;              /* [max_tok][n_head*head_dim] */
    float *k;              /* [max_tok][n_head_kv*head_dim] */
    float *v;              /* [max_tok][n_head_kv*head_dim] */
    float *att;            /* [max_tok][n_head*head_dim] attention output */
    float *tmp;            /* [max_tok][n_embd] projection output */
    float *router;         /* [max_tok][n_expert] */
    int32_t *ids;          /* [max_tok][n_expert_used] */
    float *wts;            /* [max_tok][n_expert_used] */
    float *eo;             /* [max_tok][n_expert_used][n_embd] expert outputs */
    float *scores;         /* [n_threads][n_ctx] attention scores per thread */
    float *hout;           /* [max_tok][n_embd] final-normed rows whose logits are wanted */
    void *scratch;         /* matmul activation scratch */
    struct kv_q35_state *q35; /* qwen35moe: recurrent state and buffers (qwen35.c), else NULL */
};

/* ---- shared by the forward passes (src/model/forward.c) ---- */

/* Causal softmax attention of the chunk's n_tok tokens (s->q, stride
 * n_head*head_dim) over layer il's KV cache rows, into s->att. */
void kv_attn_run(kv_state *s, uint32_t il, uint32_t n_tok);
/* Routed MoE of layer il on the normed rows s->xb: router softmax, top-k,
 * renormalized weights, experts through the provider, weighted sum in rank
 * order into s->tmp. Errors: what the provider returns. */
int kv_moe_routed(kv_state *s, const kv_layer *L, uint32_t il, uint32_t n_tok, kv_diag *d);

/* ---- loader helpers (src/model/model_load.c) ---- */
int kv_get_w(kv_model *m, kv_weight *w, const char *name, uint32_t n_dims, int64_t ne0, int64_t ne1,
             int64_t ne2, bool f32_only, bool required, kv_diag *d);

/* ---- qwen35moe (src/model/qwen35.c) ---- */

/* Allocates s->q35 (recurrent state of every sequence, buffers). */
int kv_q35_state_new(kv_state *s, kv_diag *d);
void kv_q35_state_free(kv_state *s);
/* The qwen35moe blocks over the T embedded tokens in s->x (the chunk driver
 * in forward.c embeds and computes logits). On error no sequence's
 * recurrent state changes. */
int kv_q35_blocks(kv_state *s, uint32_t T, kv_diag *d);

/* ---- ops (src/model/ops.c) ---- */

/* y = rmsnorm(x) * w over n elements, as ggml: sum of squares in double,
 * scale = 1/sqrtf(mean + eps), y[i] = (x[i]*scale) * w[i]. */
void kv_rmsnorm(float *y, const float *x, const float *w, int64_t n, float eps);
/* In-place softmax as ggml: max, exp(x-max) summed in double, times 1/sum. */
void kv_softmax(float *x, int64_t n);
/* NeoX RoPE on one head of head_dim floats at position pos. */
void kv_rope_neox(float *x, int64_t head_dim, int64_t n_rot, int32_t pos, float freq_base,
                  float freq_scale);

/* Y[t][r] = W·x[t] for all rows of a 2-D weight (or one expert matrix at
 * mat), parallel over rows on pool. scratch from kv_matmul_scratch. */
void kv_matmul(kv_pool *pool, const kv_weight *w, const void *mat, const float *x, int64_t n_tok,
               float *y, void *scratch);

#endif
