/* Models: loading a GGUF into weight views, and running the forward pass.
 *
 * kv_model holds the hyper-parameters, the tokenizer and the weights as
 * views into the GGUF mapping (nothing is copied). kv_state holds what its
 * sequences need while running: KV cache blocks, recurrent states,
 * activation and routing buffers. Buffers are allocated once in
 * kv_state_new; the KV block pool grows only when a sequence needs a block
 * no one holds (kv_state_reserve), never inside the forward pass. Routed experts are computed through a kv_expert_provider
 * (moe.h): by default the in-process one reading the model file, but any
 * provider with the same answers can stand in. */
#ifndef KVASIR_MODEL_H
#define KVASIR_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/arch.h"
#include "kvasir/err.h"
#include "kvasir/gguf.h"
#include "kvasir/moe.h"
#include "kvasir/pool.h"
#include "kvasir/tok.h"

/* KV_MAX_* bounds, enum kv_arch and kv_hparams live in arch.h. */

/* A weight tensor as a view into the mapping. For 3-D expert tensors,
 * expert e's matrix starts at data + e*nb2. */
typedef struct kv_weight {
    const void *data;  /* view into the GGUF mapping */
    uint32_t type;     /* kv_type */
    int64_t ne[3];     /* ne[0] = row length (input dim), ne[1] = rows, ne[2] = experts */
    size_t row_bytes;  /* bytes per row */
    size_t nb2;        /* bytes per expert matrix (ne[1] * row_bytes) */
} kv_weight;

typedef struct kv_layer {
    kv_weight attn_norm;     /* [n_embd] f32 */
    kv_weight wq, wk, wv;    /* [n_embd] -> [n_head*hd], [n_head_kv*hd] */
    kv_weight wo;            /* [n_head*hd] -> [n_embd] */
    kv_weight q_norm, k_norm;/* [head_dim] f32 */
    kv_weight ffn_norm;      /* [n_embd] f32 */
    kv_weight gate_inp;      /* router [n_embd] -> [n_expert] */
    kv_weight gate_exps;     /* [n_expert][n_ff_exp][n_embd] */
    kv_weight up_exps;       /* [n_expert][n_ff_exp][n_embd] */
    kv_weight down_exps;     /* [n_expert][n_embd][n_ff_exp] */
    /* qwen35moe only (data NULL otherwise). Full-attention blocks use wq as
     * the joint query+gate projection [n_embd] -> [n_head*2*hd] (per head:
     * hd query rows, then hd gate rows) and have no ffn_norm. */
    bool recurrent;          /* gated-delta-net block (no wq/wk/wv/wo) */
    kv_weight post_norm;     /* post_attention_norm [n_embd] f32 */
    kv_weight wqkv;          /* [n_embd] -> [2*key_dim + value_dim] (q, k, v) */
    kv_weight wqkv_gate;     /* attn_gate (z) [n_embd] -> [value_dim] */
    kv_weight ssm_conv1d;    /* [conv_dim][d_conv] f32 */
    kv_weight ssm_dt;        /* dt bias [n_v_heads] f32 */
    kv_weight ssm_a;         /* -exp(A_log) [n_v_heads] f32 */
    kv_weight ssm_beta;      /* [n_embd] -> [n_v_heads] */
    kv_weight ssm_alpha;     /* [n_embd] -> [n_v_heads] */
    kv_weight ssm_norm;      /* gated RMSNorm [head_v_dim] f32 */
    kv_weight ssm_out;       /* [value_dim] -> [n_embd] */
    kv_weight gate_inp_shexp;/* shared expert gate [n_embd] -> 1 */
    kv_weight gate_shexp, up_shexp; /* [n_embd] -> [n_ff_shexp] */
    kv_weight down_shexp;    /* [n_ff_shexp] -> [n_embd] */
    /* MTP block only (il == n_layer): nextn glue */
    kv_weight nextn_eh_proj; /* [2*n_embd] -> [n_embd] */
    kv_weight nextn_enorm, nextn_hnorm, nextn_head_norm; /* [n_embd] f32 (head norm optional) */
    /* deepseek2 (MLA) only */
    kv_weight wq_a, q_a_norm, wq_b; /* [n_embd] -> [q_lora_rank] (normed) -> [n_head*head_dim_k_mla] */
    kv_weight wkv_a, kv_a_norm;  /* [n_embd] -> [kv_lora_rank + n_rot]; norm of the latent */
    kv_weight wk_b, wv_b;        /* per head [qk_nope] -> [kv_lora_rank]; [kv_lora_rank] -> [head_dim_v_mla] */
    kv_weight ffn_gate, ffn_up, ffn_down; /* a leading block's dense FFN */
    kv_weight exp_probs_b;       /* the router's selection bias [n_expert] f32, absent: none */
    /* gpt-oss only: biases (f32, absent: none) and attention sinks */
    kv_weight bq, bk, bv, bo;    /* [n_head*hd], [n_head_kv*hd] x2, [n_embd] */
    kv_weight sinks;             /* [n_head] a logit per head in every softmax */
    kv_weight gate_inp_b;        /* [n_expert] added to the router logits */
    kv_weight gate_exps_b, up_exps_b; /* [n_expert][n_ff_exp] */
    kv_weight down_exps_b;       /* [n_expert][n_embd] */
} kv_layer;

typedef struct kv_model kv_model;

/* Opens path, reads hyper-parameters and tokenizer, maps and checks every
 * tensor (name, shape, type). Errors: KV_EUNSUPPORTED for an unknown
 * architecture or a tensor type we cannot compute; KV_EFORMAT for missing
 * or mis-shaped tensors and bad metadata; d names the culprit. Free with
 * kv_model_free (accepts NULL). Thread-safe to share once loaded. */
int kv_model_load(kv_model **out, const char *path, kv_diag *d);

typedef struct kv_model_opts {
    bool no_experts; /* the file holds no routed experts (a backbone): they
                        must come from an expert provider given to kv_state_new */
    /* A layer window (the ring): only blocks [layer_first, layer_last] are
     * loaded (their tensors are the only ones touched, so only their pages
     * of the mapping become resident); the token embedding only when the
     * window starts at block 0, the final norm and LM head only when it ends
     * at the last block (the embedding too then, if the head is tied). MTP
     * blocks are not loaded unless mtp is set. KV_EINVAL for a window
     * outside the model. */
    bool window;
    uint32_t layer_first, layer_last;
    bool mtp;        /* a window that ends at the last block loads the MTP blocks
                        too (experts unless no_experts), and the token embedding
                        they read (views: only the rows drafted from are touched) */
} kv_model_opts;
int kv_model_load_ex(kv_model **out, const char *path, const kv_model_opts *opts, kv_diag *d);
/* True if the model's routed experts were loaded from its own file. */
bool kv_model_has_experts(const kv_model *m);
/* The blocks the model holds: [0, n_layer - 1] unless loaded as a window. */
void kv_model_window(const kv_model *m, uint32_t *first, uint32_t *last);
/* Bytes of the tensors loaded (views into the mapping, each counted once):
 * what a window's node must hold. */
uint64_t kv_model_weight_bytes(const kv_model *m);
void kv_model_free(kv_model *m);
/* Cold start: a background thread faults in the backbone (every loaded
 * tensor but the routed experts and the token embedding, whose rows are
 * read one by one), block by block in the order a forward pass reads it:
 * madvise(MADV_WILLNEED) on each tensor's pages, then one read per page so
 * the compute threads take no page faults there. It overlaps tokenization
 * and the first layers; it never changes a result. Call at most once;
 * kv_model_free stops and joins it. Returns 0, or KV_ENOMEM / KV_EIO if no
 * thread could start (the model still works, only colder). */
int kv_model_prefault(const kv_model *m, kv_diag *d);
/* Every loaded tensor's pages, the routed experts and embedding included,
 * faulted in now on the calling thread (benchmark warm-up); the bytes. */
uint64_t kv_model_fault_in(const kv_model *m);
/* Bytes the prefault thread has made resident so far, and whether it ended. */
uint64_t kv_model_prefault_done(const kv_model *m, bool *finished);

const kv_hparams *kv_model_hparams(const kv_model *m);
const kv_tok *kv_model_tok(const kv_model *m);
const kv_gguf *kv_model_gguf(const kv_model *m);
/* Block il < n_layer + n_layer_nextn (the MTP blocks follow the trunk). */
const kv_layer *kv_model_layer(const kv_model *m, uint32_t il);
/* Bytes of weights read for one decoded token (attention, router, top-k
 * experts, LM head, embedding row): used by bench to relate speed to
 * memory bandwidth. */
uint64_t kv_model_bytes_per_token(const kv_model *m);

/* The in-process expert provider computing from m's own expert tensors,
 * parallel over pool, with scratch for up to max_tokens tokens per call.
 * Free with provider.free(provider.impl). */
int kv_expert_local_new(kv_expert_provider *out, const kv_model *m, kv_pool *pool,
                        uint32_t max_tokens, kv_diag *d);
/* The same computation over any expert source (slabs, caches). src is
 * copied; src->ctx is borrowed and must outlive the provider. */
int kv_expert_local_new_src(kv_expert_provider *out, const kv_expert_source *src, kv_pool *pool,
                            uint32_t max_tokens, kv_diag *d);
/* The same call as p->compute on a provider made by kv_expert_local_new*,
 * also writing each slot's gate and up pre-activations (before SwiGLU) to
 * gate/up[(t*n_used + k)*n_ff_exp + i]: the values the down product was
 * computed from, for a verifier (include/kvasir/verify.h). Not thread-safe
 * (like compute). KV_EINVAL for another kind of provider. */
int kv_expert_local_compute_pre(const kv_expert_provider *p, const kv_expert_req *req, float *out, float *gate,
                                float *up, kv_diag *d);
/* The expert source reading m's own expert tensors (views, never fails). */
kv_expert_source kv_model_expert_source(const kv_model *m);

typedef struct kv_state kv_state;

typedef struct kv_state_opts {
    uint32_t n_ctx;     /* KV cache length per sequence; 0 = min(n_ctx_train, 4096) */
    uint32_t n_batch;   /* tokens per forward chunk (prefill); 0 = 256 */
    const kv_expert_provider *experts; /* NULL = in-process from the model */
    uint32_t n_seq;     /* independent sequences (own caches); 0 = 1 */
    uint32_t max_tokens;/* tokens per forward call (kv_state_batch); 0 = max(n_batch, n_seq) */
    uint32_t kv_type;   /* KV cache elements: KV_TYPE_F32 (0, exact) or KV_TYPE_F16 */
    uint64_t kv_bytes_max; /* cap of the KV block pool; 0 = n_seq full contexts */
} kv_state_opts;

/* Allocates the run state for n_seq sequences. pool is borrowed (must
 * outlive the state). Free with kv_state_free (accepts NULL).
 *
 * KV memory follows use: attending layers only (every qwen3moe block, the
 * full-attention blocks of qwen35moe) keep K and V, in blocks of
 * KV_BLOCK positions taken from a pool as a sequence grows (the pool
 * allocates arenas of blocks on demand, up to kv_bytes_max) and given
 * back when the sequence is reset; a qwen35moe sequence's recurrent state
 * is allocated at its first use and freed at its reset. Results do not
 * depend on which blocks a sequence holds. */
int kv_state_new(kv_state **out, const kv_model *m, kv_pool *pool, const kv_state_opts *opts,
                 kv_diag *d);
void kv_state_free(kv_state *s);
uint32_t kv_state_n_ctx(const kv_state *s);
uint32_t kv_state_n_seq(const kv_state *s);
uint32_t kv_state_pos(const kv_state *s);   /* tokens in sequence 0's cache */
uint32_t kv_state_pos_seq(const kv_state *s, uint32_t seq);
uint32_t kv_state_max_tokens(const kv_state *s); /* tokens per kv_state_batch call */
/* False once a NaN or Inf appeared in the hidden state of one of seq's
 * tokens (a lying expert provider, a NaN weight), until its reset. Checked
 * on every projection's input, so a quantized matmul cannot hide it. */
bool kv_state_seq_finite(const kv_state *s, uint32_t seq);
/* Empties every sequence's cache / sequence seq's, giving its KV blocks
 * back to the pool and freeing its recurrent state. */
void kv_state_reset(kv_state *s);
void kv_state_reset_seq(kv_state *s, uint32_t seq);
/* Makes sequence seq able to hold n_tok tokens: its KV blocks and its
 * recurrent state. Errors: KV_ECTXFULL when n_tok > n_ctx; KV_ENOMEM when
 * the pool's cap is reached ("KV cache full: ...") or memory runs out; the
 * sequence keeps what it held before. Other sequences are not touched. */
int kv_state_reserve(kv_state *s, uint32_t seq, uint32_t n_tok, kv_diag *d);

typedef struct kv_state_mem {
    uint32_t block_tokens;     /* positions per block */
    uint64_t block_bytes;      /* bytes per block (K and V of every attending layer) */
    uint32_t blocks_held;      /* by sequences now */
    uint32_t blocks_allocated; /* by the pool so far (held + free) */
    uint32_t blocks_max;       /* the pool's cap */
    uint64_t kv_bytes;         /* blocks_allocated * block_bytes */
    uint64_t recurrent_bytes;  /* qwen35moe recurrent states held */
    uint32_t n_attn_layers;    /* layers with a KV cache */
    uint32_t kv_type;          /* KV_TYPE_F32 / KV_TYPE_F16 */
} kv_state_mem;
void kv_state_get_mem(const kv_state *s, kv_state_mem *out);

/* Snapshots of a sequence's prefix, for a prompt cache (the engine's):
 * the KV rows of whole blocks of block_tokens positions (kv_state_get_mem)
 * in the state's own layout, and the recurrent state (qwen35moe) as it
 * stands after the sequence's last token. Copied back into an empty
 * sequence they make it exactly the sequence that computed them: every
 * later token reads only these bytes (attention reads K and V from the
 * cache, never from the chunk that wrote them; the recurrence reads the
 * committed state), so its results do not depend on where the prefix
 * came from.
 *
 * kv_state_kv_bytes: bytes of n positions (a multiple of block_tokens).
 * kv_state_kv_get: positions [p0, p0 + n) of seq (whole blocks it holds)
 * into dst. kv_state_kv_set: the same into an empty seq whose blocks
 * kv_state_reserve made (p0 + n reserved). kv_state_rec_bytes: bytes of
 * one recurrent state (0: the model has none). kv_state_rec_get: seq's,
 * after its last token. kv_state_seq_resume: makes the empty seq hold pos
 * positions (a multiple of block_tokens, reserved, their KV set) with the
 * recurrent state rec (required when kv_state_rec_bytes is not 0).
 * Errors: KV_EINVAL naming what does not fit; nothing changes then. */
uint64_t kv_state_kv_bytes(const kv_state *s, uint32_t n);
int kv_state_kv_get(const kv_state *s, uint32_t seq, uint32_t p0, uint32_t n, void *dst, kv_diag *d);
int kv_state_kv_set(kv_state *s, uint32_t seq, uint32_t p0, uint32_t n, const void *src, kv_diag *d);
uint64_t kv_state_rec_bytes(const kv_state *s);
int kv_state_rec_get(const kv_state *s, uint32_t seq, void *dst, kv_diag *d);
int kv_state_seq_resume(kv_state *s, uint32_t seq, uint32_t pos, const void *rec, kv_diag *d);

/* Per-stage wall time of the forward passes (kvasir bench --profile): each
 * stage is timed on the calling thread around its whole parallel section,
 * so the stages add up to the forward passes' wall time. */
enum {
    KV_PROF_EMBED,      /* token embeddings (rows dequantized) */
    KV_PROF_NORM,       /* RMSNorms, Q/K norms, RoPE, residual adds, NaN checks */
    KV_PROF_ATTN_PROJ,  /* attention Q/K/V/output projections */
    KV_PROF_ATTN,       /* KV cache writes, scores, softmax, weighted sums */
    KV_PROF_DELTA_PROJ, /* qwen35moe linear attention: QKV/gate/beta/alpha/output projections */
    KV_PROF_DELTA,      /* qwen35moe: causal conv, gates, the delta rule, gated norm */
    KV_PROF_ROUTER,     /* router matmul, softmax, top-k */
    KV_PROF_EXPERTS,    /* routed experts (in process or over the wire) and their weighted sum */
    KV_PROF_SHARED,     /* qwen35moe shared expert and its gate */
    KV_PROF_HEAD,       /* final norm and LM head */
    KV_PROF_COUNT
};
typedef struct kv_profile {
    uint64_t ns[KV_PROF_COUNT];
    uint64_t chunks;    /* forward calls timed */
    uint64_t tokens;    /* tokens they carried */
} kv_profile;
/* The stage's name ("embed", "norm", ...; NULL out of range). */
const char *kv_profile_stage_name(int stage);
/* Accumulate into p from now on (NULL stops); p must outlive the state or
 * the next call. Off by default: no clock is read. */
void kv_state_set_profile(kv_state *s, kv_profile *p);

/* Appends n tokens to sequence 0 at its current position and runs them
 * through the model in chunks of n_batch. If logits is not NULL, writes the
 * n_vocab logits of the last token. Errors: KV_ECTXFULL when pos + n > n_ctx
 * and KV_ENOMEM when the KV pool cannot hold them (nothing is evaluated),
 * KV_ERANGE for a token id outside the vocabulary,
 * or what the expert provider returns (the cache is then rolled back to its
 * previous position). */
int kv_state_eval(kv_state *s, const int32_t *tokens, uint32_t n, float *logits, kv_diag *d);
/* The same for sequence seq. */
int kv_state_eval_seq(kv_state *s, uint32_t seq, const int32_t *tokens, uint32_t n, float *logits,
                      kv_diag *d);
/* One shared step: token i is appended to sequence seqs[i] (distinct), all
 * n tokens run through the model together (each expert provider call
 * carries all of them), and logits[i*n_vocab ..] gets token i's logits
 * (logits may be NULL). Each sequence's results are bit-identical to
 * running it alone. n <= max(n_batch, n_seq). Errors as kv_state_eval;
 * on error no sequence advances. */
int kv_state_decode(kv_state *s, const int32_t *tokens, const uint32_t *seqs, uint32_t n,
                    float *logits, kv_diag *d);
/* The general step: n tokens (n <= kv_state_max_tokens), token i appended
 * to sequence seqs[i]; a sequence may appear several times (a prompt chunk)
 * and its tokens take consecutive positions in batch order, so decode
 * tokens of some sequences and prompt chunks of others run in one forward
 * pass. logits[k*n_vocab ..] gets the logits of token out_idx[k] for k <
 * n_out (logits may be NULL). Each token's results are bit-identical to
 * running its sequence alone. Errors as kv_state_decode, plus KV_ENOMEM
 * from kv_state_reserve (reserve first to fail one sequence alone); on
 * error no sequence advances.
 *
 * The last block's hidden states feed only the logits, so when some tokens
 * want none (a prompt's tokens but its last), those tokens run that block
 * only as far as its cache writes (K and V, the recurrent state): its
 * attention output and its experts are computed for the out_idx tokens
 * alone (for none when logits is NULL), with the same bits.
 * kv_state_dropped_rows says whether the last call did. */
int kv_state_batch(kv_state *s, const int32_t *tokens, const uint32_t *seqs, uint32_t n,
                   const uint32_t *out_idx, uint32_t n_out, float *logits, kv_diag *d);
/* Whether the last call left the tokens without logits out of its last
 * block's attention output and experts (kv_state_batch): true when such
 * tokens were in the call, no x_out was asked for and all_rows is off. */
bool kv_state_dropped_rows(const kv_state *s);
/* on: every token runs the whole last block, as if each wanted logits (the
 * same logits, more work: for measuring what a block costs per token,
 * kvasir bench --all-rows). Off by default. */
void kv_state_set_all_rows(kv_state *s, bool on);
/* kv_state_batch over the model's layer window (kv_model_opts.window):
 * when x_in is not NULL, the n_embd floats of each token's hidden state
 * entering the window's first block are taken from x_in[n][n_embd]
 * (tokens may then be NULL), else the tokens are embedded (the window must
 * start at block 0). When x_out is not NULL it gets the hidden states
 * leaving the window's last block. Logits need the window to end at the
 * last block. The same computation as kv_state_batch, so a ring of windows
 * gives the bits of one process. Errors as kv_state_batch, plus KV_EINVAL
 * when the window lacks the embedding or the head a call needs. */
int kv_state_batch_window(kv_state *s, const int32_t *tokens, const float *x_in, const uint32_t *seqs,
                          uint32_t n, const uint32_t *out_idx, uint32_t n_out, float *logits, float *x_out,
                          kv_diag *d);

/* Rolling a sequence back (speculative decoding: k drafted tokens verified
 * in one call, the rejected ones undone). kv_state_spec_keep asks the next
 * kv_state_batch to keep, for sequence seq, the recurrent state (qwen35moe)
 * after each of its first n tokens of that call (n <= KV_SPEC_MAX_KEEP;
 * buffers of n x kv_state_rec_bytes allocated here and kept until the
 * sequence's reset: bounded memory; a model without recurrent state keeps
 * nothing). kv_state_seq_rollback makes seq hold pos positions: the KV
 * cache only shortens (rows past pos are written again before any token
 * reads them); the recurrent state becomes the one kept after position
 * pos - 1, which must be among the last call's kept ones or be its last
 * token's. Errors: KV_ENOMEM (keep), KV_EINVAL naming what cannot be
 * rolled back (nothing changes then). */
#define KV_SPEC_MAX_KEEP 16u
int kv_state_spec_keep(kv_state *s, uint32_t seq, uint32_t n, kv_diag *d);
int kv_state_seq_rollback(kv_state *s, uint32_t seq, uint32_t pos, kv_diag *d);
/* The final-normed hidden state (n_embd floats, what the LM head reads) of
 * logit row i of the last successful kv_state_batch; NULL out of range.
 * Valid until the next call. */
const float *kv_state_hidden_out(const kv_state *s, uint32_t i);

/* The qwen35moe MTP (nextn) block run as a draft model (docs/SPECULATIVE.md):
 * kv_mtp_step runs it at position pos of sequence seq on the trunk's (or
 * its own previous) final-normed hidden state h and the token tok there:
 * u = eh_proj [enorm(embed(tok)); hnorm(h)], the block's gated full
 * attention over its own K/V of seq (the positions it ran at, < pos and
 * pos itself; at most KV_MTP_MAX_POS), its routed and shared experts, and
 * shared_head_norm: h_out (n_embd) and, when logits is not NULL, the LM
 * head's n_vocab logits of the token after tok. kv_mtp_forget drops seq's
 * K/V from position from on; kv_mtp_reset all of it. Needs a qwen35moe
 * model with an MTP block, its token embedding and LM head (a whole GGUF
 * file or a backbone; KV_EUNSUPPORTED otherwise). The block's routed
 * experts (layer n_layer) come from experts when not NULL (borrowed, must
 * outlive t: a slab or remote provider that serves layer n_layer), else
 * in process from m's own experts. Not thread-safe; m and pool borrowed. */
#define KV_MTP_MAX_POS 4096u
typedef struct kv_mtp kv_mtp;
int kv_mtp_new(kv_mtp **out, const kv_model *m, const kv_expert_provider *experts, kv_pool *pool, uint32_t n_seq,
               kv_diag *d);
void kv_mtp_free(kv_mtp *t);
void kv_mtp_reset(kv_mtp *t, uint32_t seq);
void kv_mtp_forget(kv_mtp *t, uint32_t seq, uint32_t from);
int kv_mtp_step(kv_mtp *t, uint32_t seq, const float *h, int32_t tok, uint32_t pos, float *h_out, float *logits,
                kv_diag *d);

#endif
