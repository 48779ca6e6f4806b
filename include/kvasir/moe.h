/* The expert-provider interface: how the forward pass gets routed-expert
 * FFN outputs without knowing who computes them.
 *
 * A request carries, for one MoE layer, the normalized hidden states of
 * n_tokens tokens and, for each token, the n_used expert ids chosen by the
 * router (in top-k rank order). The provider returns one raw (unweighted)
 * output vector per (token, rank). The coordinator applies the router
 * weights and sums in rank order, so the combination is fixed no matter who
 * answered. Implementations: in-process from the full model file (here),
 * from slab files, and remote workers (later issues). */
#ifndef KVASIR_MOE_H
#define KVASIR_MOE_H

#include <stdint.h>

#include "kvasir/err.h"

typedef struct kv_expert_req {
    uint32_t layer;      /* block index */
    uint32_t n_tokens;   /* tokens in this step */
    uint32_t n_embd;     /* hidden size */
    uint32_t n_used;     /* experts per token */
    const float *x;      /* [n_tokens][n_embd] input to the experts (after ffn_norm) */
    const int32_t *ids;  /* [n_tokens][n_used] expert ids, top-k rank order */
    const uint32_t *tok; /* [n_tokens] the step's token each row is (a step's last block carries
                            only the tokens whose logits are wanted), NULL: row t is token t */
} kv_expert_req;

typedef struct kv_expert_provider {
    void *impl;
    /* Writes out[(t*n_used + k)*n_embd + i]. Returns 0 or a negative code
     * with d filled; on error out is unspecified and must not be used. */
    int (*compute)(void *impl, const kv_expert_req *req, float *out, kv_diag *d);
    /* Releases impl (may be NULL). */
    void (*free)(void *impl);
    const char *name; /* "local", "slabs", "remote" ... for logs */
} kv_expert_provider;

/* Where the in-process provider finds an expert's weights: the full model
 * file, slab files, a bounded cache... acquire() returns views of expert e
 * of a layer (gate and up: n_ff rows of n_embd; down: n_embd rows of n_ff;
 * row-major in the given ggml types) that stay valid until the matching
 * release(). acquire may block (e.g. to read a slab) and may fail with a
 * clear error, in which case the request fails and nothing is produced. */
typedef struct kv_expert_weights {
    const void *gate, *up, *down; /* matrix starts */
    uint32_t gate_type, up_type, down_type;
    /* f32 biases added to the gate, up and down products (gpt-oss):
     * [n_ff], [n_ff], [n_embd]; NULL: none */
    const float *gate_b, *up_b, *down_b;
    /* the activation between up and down, as the weights' architecture
     * says: enum kv_expert_act (arch.h), 0 = SwiGLU, 1 = gpt-oss's clamped
     * SwiGLU */
    uint32_t act;
} kv_expert_weights;

typedef struct kv_expert_source {
    void *ctx;
    int (*acquire)(void *ctx, uint32_t layer, uint32_t expert, kv_expert_weights *w, kv_diag *d);
    void (*release)(void *ctx, uint32_t layer, uint32_t expert); /* may be NULL */
    uint32_t n_layer, n_expert, n_embd, n_ff_exp, n_expert_used;
} kv_expert_source;

#endif
