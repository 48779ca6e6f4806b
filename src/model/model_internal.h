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
    uint32_t il_first, il_last; /* blocks loaded and run: [0, n_layer-1] unless a window */
    bool has_embd;       /* tok_embd loaded (a window from block 0, or a tied head) */
    bool has_head;       /* output_norm and output loaded (a window to the last block) */
    struct kv_prefault *prefault; /* the backbone prefetch thread (kv_model_prefault), NULL: none */
};

/* Whether block il is in the model's window (and so has weights and state). */
static inline bool kv_model_in_window(const kv_model *m, uint32_t il) {
    return il >= m->il_first && il <= m->il_last;
}

#define KV_BLOCK 16 /* positions per KV cache block */
#define KV_ARENA 16 /* blocks per pool allocation */

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
    /* KV cache: a pool of blocks (pages) of KV_BLOCK positions, handed to
     * sequences as they grow and taken back when they are reset, so memory
     * follows the tokens held; only attending layers have a cache */
    uint32_t kv_type;      /* KV_TYPE_F32 or KV_TYPE_F16: cache element type */
    uint32_t n_attn;       /* layers with an attention cache */
    int32_t *attn_of;      /* [n_layer] index among attending layers, -1: none */
    size_t kv_row;         /* bytes of one token's K (or V) in one layer: n_head_kv*head_dim elements */
    uint32_t kv_planes;    /* 2: K then V; 1: one row per token (MLA's latent and rope part) */
    size_t blk_bytes;      /* one block: kv_planes planes (K, then V), each [n_attn][KV_BLOCK] rows of kv_row bytes */
    uint32_t blk_max;      /* pool cap in blocks */
    uint32_t blk_n;        /* blocks allocated so far (a multiple of KV_ARENA below the cap) */
    uint8_t **arena;       /* [ceil(blk_max / KV_ARENA)] arenas of KV_ARENA blocks, NULL until needed */
    uint32_t *blk_free;    /* [blk_n] stack of free block ids */
    uint32_t n_free;       /* entries on blk_free */
    uint32_t **seq_blk;    /* [n_seq] block table: entry i holds positions [i*KV_BLOCK, (i+1)*KV_BLOCK) */
    uint32_t *seq_nblk;    /* [n_seq] blocks held */
    uint32_t *seq_cap;     /* [n_seq] entries allocated in seq_blk[seq] */
    float *kv_wide;        /* [n_threads][2][KV_BLOCK][head_dim] F16 rows widened for the kernels */
    uint8_t *bad;          /* [max_tok] a NaN/Inf appeared in this token's hidden state (this call) */
    uint8_t *tainted;      /* [n_seq] ... in one of the sequence's tokens since its reset */
    float *x;              /* [max_tok][n_embd] residual stream */
    float *xb;             /* [max_tok][n_embd] normed input */
    float *q;              /* [max_tok][n_head*head_dim] */
    float *k;              /* [max_tok][n_head_kv*head_dim] */
    float *v;              /* [max_tok][n_head_kv*head_dim] */
    float *att;            /* [max_tok][n_head*head_dim] attention output */
    float *tmp;            /* [max_tok][n_embd] projection output */
    float *router;         /* [max_tok][n_expert] */
    float *route_sel;      /* [n_expert] the router's selection scores (kv_route_token) */
    int32_t *ids;          /* [max_tok][n_expert_used] */
    float *wts;            /* [max_tok][n_expert_used] */
    float *eo;             /* [max_tok][n_expert_used][n_embd] expert outputs */
    float *scores;         /* [n_threads][att_tok*att_heads][n_ctx] attention scores per thread */
    float *att_qbuf;       /* [n_threads][att_tok*att_heads][head_dim] one unit's queries, gathered */
    uint32_t *att_grp;     /* [max_tok+1] start of each attention token group (this call) */
    uint32_t att_tok;      /* tokens per attention unit (consecutive positions of one sequence) */
    uint32_t att_heads;    /* query heads per attention unit (of the n_head/n_head_kv sharing a KV head) */
    float *hout;           /* [max_tok][n_embd] final-normed rows whose logits are wanted */
    uint32_t n_hout;       /* rows of hout the last successful call wrote (kv_state_hidden_out) */
    void *scratch;         /* matmul activation scratch */
    /* The chunk's last block when nothing reads its hidden states but the LM
     * head's rows (no x_out, the window ends at the head): every token
     * writes its K/V (and recurrent state), and only the tokens whose
     * logits are wanted run the rest (kv_trim_rows) */
    bool trim;             /* this chunk may drop rows in block il_last */
    bool all_rows;         /* never drop rows (kv_state_set_all_rows) */
    bool x_kept;           /* x holds the kept rows: token keep[i] at row i */
    uint32_t n_keep;       /* tokens kept: the out_idx tokens, increasing, no repeats (0: no logits) */
    uint32_t *keep;        /* [max_tok] the kept tokens */
    uint32_t *keep_row;    /* [max_tok] token -> its row once trimmed */
    uint32_t trim_T;       /* the chunk's tokens while trimmed, 0: rows are tokens */
    uint32_t *full_seq, *full_pos; /* [max_tok] the chunk's tok_seq and tok_pos while trimmed */
    uint8_t *full_bad;     /* [max_tok] the chunk's bad flags while trimmed */
    struct kv_q35_state *q35; /* qwen35moe: recurrent state and buffers (qwen35.c), else NULL */
    void *arch_state;      /* another architecture's part (kv_arch_table.state), NULL: none */
    kv_profile *prof;      /* per-stage timers (kvasir bench --profile), NULL: off */
};

/* Stage timers: t = kv_prof_start(s) once, then after each stage
 * t = kv_prof_mark(s, KV_PROF_..., t) adds the time since t to the stage. */
uint64_t kv_prof_clock(void);
static inline uint64_t kv_prof_start(const kv_state *s) { return s->prof ? kv_prof_clock() : 0; }
static inline uint64_t kv_prof_mark(kv_state *s, int stage, uint64_t t) {
    if (!s->prof) return 0;
    const uint64_t now = kv_prof_clock();
    s->prof->ns[stage] += now - t;
    return now;
}

/* ---- shared by the forward passes (src/model/forward.c) ---- */

/* Causal softmax attention of the chunk's n_tok tokens (s->q, stride
 * n_head*head_dim) over layer il's KV cache rows, into s->att. */
void kv_attn_run(kv_state *s, uint32_t il, uint32_t n_tok);
/* Writes the chunk's K and V rows (s->k, s->v) of layer il into the cache
 * at each token's (sequence, position); the blocks are reserved. */
void kv_cache_put(kv_state *s, uint32_t il, uint32_t n_tok);
/* The cache row of position p of sequence seq in attending layer ai, in
 * the first plane (kv_row bytes; the block must be reserved). MLA keeps
 * one untransposed row per token there (kv_planes == 1). */
uint8_t *kv_cache_row(const kv_state *s, uint32_t seq, uint32_t ai, uint32_t p);
/* Marks token t (< n_tok) bad when one of the n floats at x + t*stride is
 * NaN or Inf. Called on the inputs of the projections (normed rows,
 * attention and delta-net outputs) and on the final-normed rows: a
 * quantized matmul would turn a NaN into finite garbage. */
void kv_check_rows(kv_state *s, const float *x, size_t stride, uint32_t n_tok, int64_t n);
/* fn(s, ctx, t) for every token t < T, the tokens split over the pool's
 * threads when there are enough of them to pay for waking it (a decode
 * step runs inline). fn must touch only token t's rows, so the bits are
 * those of one thread. Not from inside a pool job. */
typedef void (*kv_tok_fn)(kv_state *s, const void *ctx, uint32_t t);
void kv_per_token(kv_state *s, uint32_t T, kv_tok_fn fn, const void *ctx);
/* Whether block il is where the chunk drops rows (kv_trim_rows). */
static inline bool kv_trim_here(const kv_state *s, uint32_t il) { return s->trim && il == s->m->il_last; }
/* Keeps only the rows of the s->n_keep kept tokens in x, xb (and tmp when
 * with_tmp): row i becomes token keep[i], and tok_seq, tok_pos and bad
 * follow (the chunk's own are saved). Returns the new token count
 * (n_keep; 0: the rest of the block has nothing to compute). Each kept
 * row's arithmetic is what it would be among all of them: every kernel
 * computes a token's row alone. */
uint32_t kv_trim_rows(kv_state *s, uint32_t T, bool with_tmp);
/* Gives tok_seq, tok_pos and bad back their per-token meaning (a kept
 * row's bad flag merged into its token's). Does nothing when not trimmed. */
void kv_trim_restore(kv_state *s);
/* The per-token Q/K norm and RoPE passes' argument: layer L, the Q heads
 * (q), the K heads (k) or both. */
typedef struct kv_qk_ctx {
    const kv_layer *L;
    bool q, k;
} kv_qk_ctx;
/* Per token: x += tmp (add), then xb = rmsnorm(x) * w (w not NULL). */
void kv_resid_norm(kv_state *s, uint32_t T, int add, const float *w);
/* Routed MoE of layer il on the normed rows s->xb: router softmax, top-k,
 * renormalized weights, experts through the provider, weighted sum in rank
 * order into s->tmp. Errors: what the provider returns. */
int kv_moe_routed(kv_state *s, const kv_layer *L, uint32_t il, uint32_t n_tok, kv_diag *d);

/* The router (src/moe/route.c): token's logits p[n_expert] (overwritten by
 * its scores) into the top-k ids (rank order) and weights, as hp->router
 * says; bias: the selection bias (NULL: none); sel: n_expert floats of
 * scratch. */
void kv_route_token(const kv_hparams *hp, float *p, const float *bias, float *sel, int32_t *ids, float *w);

/* ---- loader helpers (src/model/model_load.c) ---- */
int kv_get_w(kv_model *m, kv_weight *w, const char *name, uint32_t n_dims, int64_t ne0, int64_t ne1,
             int64_t ne2, bool f32_only, bool required, kv_diag *d);

/* ---- qwen35moe (src/model/qwen35.c) ---- */

/* Allocates s->q35 (buffers; each sequence's recurrent state comes with
 * kv_q35_seq_alloc). */
int kv_q35_state_new(kv_state *s, kv_diag *d);
void kv_q35_state_free(kv_state *s);
/* Allocates sequence seq's recurrent state if it has none (KV_ENOMEM). */
int kv_q35_seq_alloc(kv_state *s, uint32_t seq, kv_diag *d);
/* Frees sequence seq's recurrent state (it starts from zero when next used). */
void kv_q35_seq_free(kv_state *s, uint32_t seq);
/* Bytes of recurrent state held now. */
uint64_t kv_q35_bytes(const kv_state *s);
/* Bytes of one sequence's committed recurrent state (kv_state_rec_bytes;
 * 0 without recurrent blocks), and its copy out of / into sequence seq's
 * committed slot (set allocates the state; both do nothing at 0 bytes). */
uint64_t kv_q35_rec_bytes(const kv_state *s);
int kv_q35_rec_get(const kv_state *s, uint32_t seq, void *dst, kv_diag *d);
int kv_q35_rec_set(kv_state *s, uint32_t seq, const void *src, kv_diag *d);
/* Speculative rollback (kv_state_spec_keep / kv_state_seq_rollback): keep
 * the recurrent state after each of seq's first n tokens of the next call;
 * make the committed state the one kept after position pos - 1. */
int kv_q35_spec_keep(kv_state *s, uint32_t seq, uint32_t n, kv_diag *d);
int kv_q35_rollback(kv_state *s, uint32_t seq, uint32_t pos, kv_diag *d);
/* The qwen35moe blocks over the T embedded tokens in s->x (the chunk driver
 * in forward.c embeds and computes logits). On error no sequence's
 * recurrent state changes. */
int kv_q35_blocks(kv_state *s, uint32_t T, kv_diag *d);

/* ---- ops (src/model/ops.c) ---- */

/* y = rmsnorm(x) * w over n elements, as ggml: sum of squares in double,
 * scale = 1/sqrtf(mean + eps), y[i] = (x[i]*scale) * w[i]. */
void kv_rmsnorm(float *y, const float *x, const float *w, int64_t n, float eps);
/* In-place softmax as ggml: max, exp(x-max) summed in double (8 lanes, i % 8,
 * then a fixed tree: ops.c), times 1/sum. */
void kv_softmax(float *x, int64_t n);
/* NeoX RoPE in two steps, so that the heads of one token share the angles:
 * the cos/sin of its n_rot/2 pairs (theta = pos * base^(-2i/n_rot), times
 * freq_scale), then the rotation of one head's first n_rot dims with them
 * (dims past n_rot pass through). */
void kv_rope_neox_table(float *cs, float *sn, int64_t n_rot, int32_t pos, float freq_base, float freq_scale);
void kv_rope_apply(float *x, int64_t n_rot, const float *cs, const float *sn);

/* Y[t][r] = W·x[t] for all rows of a 2-D weight (or one expert matrix at
 * mat), parallel over rows on pool. scratch from kv_matmul_scratch. */
void kv_matmul(kv_pool *pool, const kv_weight *w, const void *mat, const float *x, int64_t n_tok,
               float *y, void *scratch);

#endif
