/* Architectures: one table per architecture, read by everything that needs
 * to know what a model file holds (the loader, gen-model, skeletons,
 * anatomy, the slicer and the worker), in the spirit of llama.cpp's
 * LLM_TENSOR_NAMES / llama-arch.cpp.
 *
 * A table (kv_arch_table) gives, for each tensor kind the architecture has
 * (kv_tensor_desc): its name ("blk.%u." + name for block tensors), which
 * blocks carry it (all, recurrent, full-attention, MTP), its shape in
 * hyper-parameters (kv_dim), whether it must be f32, whether it may be
 * absent, its role (routed expert, router, norm, ...) and the distribution
 * gen-model draws it from. It also lists the hyper-parameter keys with
 * their bounds (kv_hparam_key), the kind of each block, a check of the
 * hyper-parameters as a whole, and the block function of the forward pass.
 * Entries are in file order: the global tensors listed before the first
 * block tensor come before the blocks, the others after them, and a block's
 * tensors follow the table's order (gen-model writes files this way).
 *
 * Adding an architecture means one new file in src/arch/ (a table) and one
 * line in src/arch/arch.c's registry; new tensor kinds or dimensions add an
 * enum value here.
 *
 * This module sits below model/, gen/ and slice/: it depends only on err.h
 * and gguf.h. Tables are static and immutable; every function here is
 * thread-safe. */
#ifndef KVASIR_ARCH_H
#define KVASIR_ARCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/gguf.h"

#define KV_MAX_LAYERS 512
#define KV_MAX_EXPERTS 1024
#define KV_MAX_EXPERTS_USED 64
#define KV_MAX_EMBD 65536
#define KV_MAX_HEADS 1024
#define KV_MAX_HEAD_DIM 1024
#define KV_MAX_VOCAB (1u << 22)
#define KV_MAX_CTX (1u << 20)
#define KV_MAX_FF 262144

enum kv_arch { KV_ARCH_QWEN3MOE = 0, KV_ARCH_QWEN35MOE, KV_ARCH_DEEPSEEK2, KV_ARCH_COUNT };

/* ---- the forward-pass hooks (kv_arch_table.hooks, kv_hparams) ------------- */

/* How a block attends. */
enum kv_attn_kind {
    KV_ATTN_GQA = 0, /* grouped-query softmax attention; the cache holds K and V (n_head_kv*head_dim each) */
    KV_ATTN_GATED,   /* GQA whose output is gated by sigmoid(a second query projection) (qwen35moe) */
    KV_ATTN_MLA,     /* multi-head latent attention: the cache holds, per token, the kv_lora_rank latent
                        and the n_rot rope part (head_dim = kv_lora_rank + n_rot, one KV head), not
                        full keys and values; queries are absorbed through attn_k_b, outputs through
                        attn_v_b (deepseek2) */
};

/* How the router turns its logits into the top-k experts and their weights. */
enum kv_router_kind {
    KV_ROUTER_SOFTMAX = 0, /* softmax over the experts, top-k (lower id first on ties), weights the top-k
                              probabilities, renormalized when expert_weights_norm, times
                              expert_weights_scale when neither 0 nor 1 */
    KV_ROUTER_SIGMOID,     /* sigmoid scores; selection on score + exp_probs_b (the correction bias) within
                              the n_group_used best of n_expert_groups groups (a group's score: the sum of
                              its two best); weights the unbiased scores, then renorm and scale as above */
    KV_ROUTER_TOPK_SOFTMAX, /* top-k of the logits, softmax over the k (gpt-oss) */
};

/* The routed experts' activation. */
enum kv_expert_act {
    KV_ACT_SWIGLU = 0,   /* silu(gate) * up */
    KV_ACT_SWIGLU_CLAMP, /* gpt-oss: gate and up clamped, gate * sigmoid(alpha * gate) * (up + 1) */
};

/* kv_arch_hooks.flags: what the blocks carry beyond attention and routed experts */
#define KV_AH_EXPERT_BIAS 1u   /* biases on the expert matrices (ffn_*_exps.bias) */
#define KV_AH_ROUTER_BIAS 2u   /* a bias on the router logits (ffn_gate_inp.bias) */
#define KV_AH_SHEXP 4u         /* shared experts, always run, added to the routed mixture */
#define KV_AH_SHEXP_GATE 8u    /* ... scaled by sigmoid(ffn_gate_inp_shexp . x) (qwen35moe) */
#define KV_AH_DENSE_LEAD 16u   /* the first leading_dense_block_count blocks have a dense FFN, no router */
#define KV_AH_RECURRENT 32u    /* recurrent blocks with per-sequence state (kv_arch_table.state) */
#define KV_AH_SINKS 64u        /* attention sinks (a per-head logit in every softmax) */
#define KV_AH_SWA 128u         /* sliding-window attention in some blocks */

/* An architecture's defaults; a table's check may change the per-file ones
 * in kv_hparams (attn, router, act), e.g. from a gating-function key. */
typedef struct kv_arch_hooks {
    enum kv_attn_kind attn;
    enum kv_router_kind router;
    enum kv_expert_act act;
    uint32_t flags; /* KV_AH_* */
} kv_arch_hooks;

typedef struct kv_hparams {
    enum kv_arch arch;
    char arch_name[32];      /* general.architecture */
    uint32_t n_layer;        /* blocks */
    uint32_t n_embd;         /* hidden size */
    uint32_t n_head;         /* query heads */
    uint32_t n_head_kv;      /* key/value heads (GQA) */
    uint32_t head_dim;       /* key_length == value_length */
    uint32_t head_dim_v;     /* value_length (checked == head_dim) */
    uint32_t n_rot;          /* rotary dims (== head_dim for qwen3moe) */
    uint32_t n_expert;       /* routed experts per layer */
    uint32_t n_expert_used;  /* top-k */
    uint32_t n_ff_exp;       /* expert hidden size */
    uint32_t n_vocab;        /* rows of token_embd */
    uint32_t n_ctx_train;    /* context_length */
    float rms_eps;           /* attention.layer_norm_rms_epsilon */
    float rope_freq_base;    /* rope.freq_base */
    float rope_freq_scale;   /* 1 / rope.scaling.factor, 1 if absent */
    bool expert_weights_norm;   /* renormalize top-k weights to sum 1 */
    float expert_weights_scale; /* applied when != 0 and != 1 */
    bool tied_output;        /* output.weight absent: LM head is token_embd */
    /* qwen35moe (hybrid gated delta net + gated full attention); 0 otherwise */
    uint32_t n_layer_nextn;  /* MTP blocks after the n_layer trunk blocks (loaded, not run) */
    uint32_t full_attn_interval; /* every k-th block is full attention */
    uint32_t n_ff_shexp;     /* shared expert hidden size, 0: none */
    uint32_t n_ff;           /* feed_forward_length (qwen35moe: the shared expert's fallback) */
    int32_t rope_sections[4];/* rope.dimension_sections (pairs per position component) */
    uint32_t ssm_d_conv;     /* ssm.conv_kernel: causal conv window */
    uint32_t ssm_d_state;    /* ssm.state_size: key/value head dim of the delta net */
    uint32_t ssm_n_group;    /* ssm.group_count: key heads */
    uint32_t ssm_dt_rank;    /* ssm.time_step_rank: value heads */
    uint32_t ssm_d_inner;    /* ssm.inner_size == ssm_d_state * ssm_dt_rank */
    /* the hooks of this file (the table's defaults, then its check) */
    enum kv_attn_kind attn;
    enum kv_router_kind router;
    enum kv_expert_act act;
    uint32_t hook_flags;     /* KV_AH_* */
    /* routing and FFN layout; 0 otherwise */
    uint32_t n_expert_groups;   /* expert_group_count: groups of experts (0 or 1: no groups) */
    uint32_t n_group_used;      /* expert_group_used_count: groups whose experts may be chosen */
    uint32_t expert_gating_func;/* expert_gating_func as written (deepseek2: 0/1 softmax, 2 sigmoid) */
    uint32_t n_expert_shared;   /* expert_shared_count (deepseek2: n_ff_shexp = it * n_ff_exp) */
    uint32_t n_layer_dense_lead;/* leading_dense_block_count: blocks with a dense FFN of n_ff */
    /* MLA (attn == KV_ATTN_MLA): head_dim = kv_lora_rank + n_rot and n_head_kv = 1 are the cache's
     * row (MQA over the latent); the per-head sizes of the uncompressed attention: */
    uint32_t q_lora_rank;       /* attention.q_lora_rank: 0: one attn_q projection */
    uint32_t kv_lora_rank;      /* attention.kv_lora_rank: the latent */
    uint32_t head_dim_k_mla;    /* attention.key_length_mla: qk_nope + n_rot */
    uint32_t head_dim_v_mla;    /* attention.value_length_mla */
    /* YaRN RoPE (rope.scaling.type = yarn; rope_freq_scale = 1 / factor) */
    bool rope_yarn;
    uint32_t n_ctx_orig_yarn;   /* rope.scaling.original_context_length */
    float rope_yarn_log_mul;    /* rope.scaling.yarn_log_multiplier as written (0.1 * mscale_all_dim) */
    float yarn_ext_factor;      /* 1 with YaRN, else 0 */
    float yarn_attn_factor;     /* the rotation's magnitude factor as llama.cpp's context derives it */
    float yarn_beta_fast, yarn_beta_slow;
    float attn_scale;           /* the softmax scale of the scores (0: 1/sqrt(head_dim)) */
} kv_hparams;

/* ---- tensors -------------------------------------------------------------- */

/* Tensor kinds, shared by every architecture (a table lists those it has). */
enum kv_tensor {
    KV_T_TOKEN_EMBD = 0,   /* token_embd.weight */
    KV_T_OUTPUT_NORM,      /* output_norm.weight */
    KV_T_OUTPUT,           /* output.weight (absent: tied to token_embd) */
    KV_T_ATTN_NORM,        /* blk.N.attn_norm.weight */
    KV_T_POST_NORM,        /* blk.N.post_attention_norm.weight */
    KV_T_ATTN_Q,
    KV_T_ATTN_K,
    KV_T_ATTN_V,
    KV_T_ATTN_OUT,
    KV_T_ATTN_Q_NORM,
    KV_T_ATTN_K_NORM,
    KV_T_FFN_NORM,
    KV_T_ATTN_QKV,         /* gated delta net: joint q, k, v projection */
    KV_T_ATTN_GATE,        /* gated delta net: output gate z */
    KV_T_SSM_CONV1D,
    KV_T_SSM_DT,
    KV_T_SSM_A,
    KV_T_SSM_BETA,
    KV_T_SSM_ALPHA,
    KV_T_SSM_NORM,
    KV_T_SSM_OUT,
    KV_T_FFN_GATE_INP,     /* router */
    KV_T_FFN_GATE_EXPS,    /* routed experts, expert index outermost */
    KV_T_FFN_UP_EXPS,
    KV_T_FFN_DOWN_EXPS,
    KV_T_FFN_GATE_INP_SHEXP, /* shared expert gate */
    KV_T_FFN_GATE_SHEXP,
    KV_T_FFN_UP_SHEXP,
    KV_T_FFN_DOWN_SHEXP,
    KV_T_NEXTN_EH_PROJ,    /* MTP glue */
    KV_T_NEXTN_ENORM,
    KV_T_NEXTN_HNORM,
    KV_T_NEXTN_SHARED_HEAD_NORM,
    /* MLA (deepseek2) */
    KV_T_ATTN_Q_A,         /* [n_embd] -> [q_lora_rank] */
    KV_T_ATTN_Q_A_NORM,
    KV_T_ATTN_Q_B,         /* [q_lora_rank] -> [n_head * head_dim_k_mla] */
    KV_T_ATTN_KV_A_MQA,    /* [n_embd] -> [kv_lora_rank + n_rot] */
    KV_T_ATTN_KV_A_NORM,
    KV_T_ATTN_K_B,         /* per head [qk_nope] -> [kv_lora_rank] (3-D, head outermost) */
    KV_T_ATTN_V_B,         /* per head [kv_lora_rank] -> [head_dim_v_mla] */
    /* dense FFN (leading blocks) and the router's correction bias */
    KV_T_FFN_GATE,
    KV_T_FFN_UP,
    KV_T_FFN_DOWN,
    KV_T_FFN_EXP_PROBS_B,  /* exp_probs_b.bias [n_expert] */
    KV_T_COUNT
};

/* Name stems of the routed-expert tensors in a block ("blk.N." + stem +
 * ".weight"), the same in every table (test_arch checks): the slicer, the
 * slab reader and the worker find expert tensors by them. */
#define KV_EXPERT_STEM_GATE "ffn_gate_exps"
#define KV_EXPERT_STEM_UP "ffn_up_exps"
#define KV_EXPERT_STEM_DOWN "ffn_down_exps"

/* A dimension expressed in hyper-parameters (kv_dim_value gives it). */
enum kv_dim {
    KV_D_1 = 0,        /* 1 (an absent dimension) */
    KV_D_EMBD,         /* n_embd */
    KV_D_EMBD_X2,      /* 2 * n_embd */
    KV_D_VOCAB,        /* n_vocab */
    KV_D_HEAD_DIM,     /* head_dim */
    KV_D_Q,            /* n_head * head_dim */
    KV_D_Q_X2,         /* 2 * n_head * head_dim (query and its gate) */
    KV_D_KV,           /* n_head_kv * head_dim */
    KV_D_FF_EXP,       /* n_ff_exp */
    KV_D_EXPERT,       /* n_expert */
    KV_D_FF_SHEXP,     /* n_ff_shexp */
    KV_D_SSM_CONV,     /* ssm_d_conv */
    KV_D_SSM_STATE,    /* ssm_d_state */
    KV_D_SSM_HEADS,    /* ssm_dt_rank (value heads) */
    KV_D_SSM_INNER,    /* ssm_d_inner (value dim) */
    KV_D_SSM_CONV_DIM, /* 2 * ssm_d_state * ssm_n_group + ssm_d_inner */
    KV_D_FF,           /* n_ff (dense FFN) */
    KV_D_HEADS,        /* n_head */
    KV_D_Q_LORA,       /* q_lora_rank */
    KV_D_KV_LORA,      /* kv_lora_rank */
    KV_D_KV_A,         /* kv_lora_rank + n_rot */
    KV_D_Q_MLA,        /* n_head * head_dim_k_mla */
    KV_D_QK_NOPE,      /* head_dim_k_mla - n_rot */
    KV_D_V_MLA,        /* head_dim_v_mla */
    KV_D_O_MLA,        /* n_head * head_dim_v_mla */
    KV_D_COUNT
};

/* Kinds of block (kv_tensor_desc.blocks is a mask of them; 0: a global
 * tensor, outside the blocks). */
#define KV_BLK_RECURRENT 1u /* gated delta net (linear attention) */
#define KV_BLK_ATTN 2u      /* full attention */
#define KV_BLK_MTP 4u       /* multi-token-prediction block after the trunk */
#define KV_BLK_DENSE 8u     /* full attention, then a dense FFN (deepseek2's leading blocks) */
#define KV_BLK_ALL 15u

/* What a tensor is for. Routed experts are the tensors slabs carry. */
enum kv_role {
    KV_ROLE_EMBD = 0,  /* token embeddings */
    KV_ROLE_LM_HEAD,
    KV_ROLE_NORM,
    KV_ROLE_ATTN,      /* full attention */
    KV_ROLE_LINEAR,    /* linear attention (gated delta net), its norm included */
    KV_ROLE_ROUTER,
    KV_ROLE_EXPERT,    /* routed expert: outermost dimension = expert index */
    KV_ROLE_SHEXP,     /* shared expert, its gate included */
    KV_ROLE_MTP,       /* MTP glue (nextn.*) */
    KV_ROLE_FFN,       /* a dense FFN (deepseek2's leading blocks) */
    KV_ROLE_COUNT
};

/* kv_tensor_desc.flags */
#define KV_TF_F32 1u       /* must be f32 (the loader refuses other types) */
#define KV_TF_KEEP_F32 2u  /* never quantized (llama.cpp's quantizer keeps it):
                              written f32, computed in any type */
#define KV_TF_OPTIONAL 4u  /* may be absent from a file */
#define KV_TF_TIED 8u      /* absent when the LM head is tied to token_embd */
#define KV_TF_VOCAB_ROWS 16u /* rows are tokens */

typedef struct kv_tensor_desc {
    enum kv_tensor kind;
    const char *name;    /* "token_embd.weight"; for block tensors the part after "blk.N." */
    uint32_t blocks;     /* KV_BLK_* mask; 0: global */
    uint32_t n_dims;     /* 1..3 */
    enum kv_dim ne[3];   /* innermost first; KV_D_1 past n_dims */
    uint32_t flags;      /* KV_TF_* */
    enum kv_role role;
    /* gen-model's weights: mean + N(0, std), std = gain / sqrt(ne[0]) when
     * gain != 0 */
    float init_mean, init_std, init_gain;
} kv_tensor_desc;

/* ---- hyper-parameters ----------------------------------------------------- */

enum kv_key_type {
    KV_KEY_U32 = 0,  /* u32 in [lo, hi] */
    KV_KEY_F32,      /* a finite f32 */
    KV_KEY_BOOL,
    KV_KEY_I32_ARR4, /* up to 4 integers (a scalar repeats), into an int32_t[4] */
    KV_KEY_ABSENT,   /* must not be present: its meaning is not supported */
    KV_KEY_IGNORED,  /* may be present, not read here: llama.cpp ignores it too, or the
                        table's check reads it (a string) */
};

typedef struct kv_hparam_key {
    const char *key;       /* after "<arch>." */
    enum kv_key_type type;
    size_t off;            /* offsetof(kv_hparams, field); unused for KV_KEY_ABSENT and _IGNORED */
    bool required;         /* else the field keeps its default */
    uint32_t lo, hi;       /* u32 bounds */
    float def;             /* default of an optional u32/f32/bool (0: none; checks fill derived defaults) */
} kv_hparam_key;

/* ---- the table ------------------------------------------------------------ */

struct kv_state;
/* Runs the trunk blocks over the n_tok embedded tokens of a run state (the
 * engine's chunk driver embeds and computes logits). */
typedef int kv_arch_blocks_fn(struct kv_state *s, uint32_t n_tok, kv_diag *d);

/* A run state's per-architecture part (recurrent state, own buffers), kept
 * by the engine through these; NULL members do nothing (bytes: 0). */
typedef struct kv_arch_state_ops {
    int (*state_new)(struct kv_state *s, kv_diag *d);     /* at kv_state_new */
    void (*state_free)(struct kv_state *s);               /* at kv_state_free (also after a failed new) */
    int (*seq_alloc)(struct kv_state *s, uint32_t seq, kv_diag *d); /* before a sequence runs */
    void (*seq_free)(struct kv_state *s, uint32_t seq);   /* at its reset */
    uint64_t (*bytes)(const struct kv_state *s);          /* recurrent state held now */
    uint64_t (*rec_bytes)(const struct kv_state *s);      /* one sequence's committed recurrent state */
    int (*rec_get)(const struct kv_state *s, uint32_t seq, void *dst, kv_diag *d);
    int (*rec_set)(struct kv_state *s, uint32_t seq, const void *src, kv_diag *d);
    /* speculative decoding: keep the states after the next call's first n tokens of seq, and go
     * back to the one after position pos - 1 (the KV cache needs neither: rows are rewritten) */
    int (*spec_keep)(struct kv_state *s, uint32_t seq, uint32_t n, kv_diag *d);
    int (*rollback)(struct kv_state *s, uint32_t seq, uint32_t pos, kv_diag *d);
} kv_arch_state_ops;

typedef struct kv_arch_table {
    enum kv_arch id;
    const char *name;                /* general.architecture */
    const kv_tensor_desc *tensors;   /* [n_tensors], file order */
    size_t n_tensors;
    const kv_hparam_key *keys;       /* [n_keys], in reading order */
    size_t n_keys;
    /* KV_BLK_RECURRENT, _ATTN, _DENSE or _MTP for block il < n_layer + n_layer_nextn */
    uint32_t (*block_kind)(const kv_hparams *hp, uint32_t il);
    /* After the keys are read: derived defaults and cross-checks (g for keys
     * whose meaning depends on others). Errors KV_EFORMAT / KV_EUNSUPPORTED. */
    int (*check)(kv_hparams *hp, const kv_gguf *g, kv_diag *d);
    /* The forward pass of the trunk blocks (src/model/). Required. */
    kv_arch_blocks_fn *blocks;
    /* The forward pass's defaults (copied into kv_hparams before check). */
    kv_arch_hooks hooks;
    /* The run state's architecture part, NULL: none. */
    const kv_arch_state_ops *state;
} kv_arch_table;

/* The table of an architecture, NULL for an id out of range. */
const kv_arch_table *kv_arch_get(enum kv_arch id);
/* The table named `name` (general.architecture), NULL if none. */
const kv_arch_table *kv_arch_find(const char *name);
/* "qwen3moe, qwen35moe, deepseek2": the supported names, for messages. */
const char *kv_arch_list(void);

/* The value of a dimension for hp (0 for KV_D_COUNT or above). */
int64_t kv_dim_value(enum kv_dim dim, const kv_hparams *hp);
/* Its name for messages ("n_embd", "2*n_head*head_dim", ...). */
const char *kv_dim_name(enum kv_dim dim);

/* The table's entry for kind k, NULL if the architecture has none. */
const kv_tensor_desc *kv_arch_tensor(const kv_arch_table *a, enum kv_tensor k);
/* Writes the tensor's name for block il (ignored for globals) to buf;
 * returns its length, or -1 if it does not fit in cap. */
int kv_tensor_name(const kv_tensor_desc *t, uint32_t il, char *buf, size_t cap);
/* Shape of t for hp: ne[0..2] (1 past n_dims). */
void kv_tensor_shape(const kv_tensor_desc *t, const kv_hparams *hp, int64_t ne[3]);
/* Number of blocks, trunk and MTP (n_layer + n_layer_nextn). */
uint32_t kv_arch_n_blocks(const kv_hparams *hp);
/* Whether block il carries t (false for a global tensor). */
bool kv_tensor_in_block(const kv_arch_table *a, const kv_tensor_desc *t, const kv_hparams *hp, uint32_t il);
/* The entry naming `name` (len bytes, not NUL-terminated), NULL if the
 * table has none; *il gets the block number (-1 for a global). The block
 * kind is not checked (kv_tensor_in_block does). */
const kv_tensor_desc *kv_arch_match(const kv_arch_table *a, const char *name, size_t len, int32_t *il);

/* Reads general.architecture and every key of its table into *hp (zeroed
 * first), then runs the table's check. Errors: KV_EUNSUPPORTED for an
 * unknown architecture or an unsupported key, KV_EFORMAT for a missing
 * required key, a value out of its bounds or inconsistent values; d names
 * the key. n_vocab and tied_output are left to whoever sees the tensors. */
int kv_arch_read_hparams(const kv_gguf *g, kv_hparams *hp, kv_diag *d);

/* ---- block functions the engine defines (src/model/), named by tables ---- */
int kv_q35_blocks(struct kv_state *s, uint32_t n_tok, kv_diag *d);
int kv_q3_blocks(struct kv_state *s, uint32_t n_tok, kv_diag *d);
int kv_ds2_blocks(struct kv_state *s, uint32_t n_tok, kv_diag *d);
extern const kv_arch_state_ops kv_ds2_state_ops;
extern const kv_arch_state_ops kv_q35_state_ops;

#endif
