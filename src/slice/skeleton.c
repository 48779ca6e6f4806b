/* Skeleton models: the header of a real MoE model at true scale, exactly as
 * llama.cpp's converter (convert_hf_to_gguf.py) and quantizer (llama-quant.cpp,
 * Q4_K_M) lay it out, with the tensor data left as holes except in the small
 * tensors (token embeddings, norms, routers: see "real small tensors").
 *
 * What "exactly" covers: the architecture's metadata keys with the values of
 * the model's config.json, a tokenizer of the real vocabulary size (our own
 * BPE trained on the bundled corpus and padded, not Qwen's token texts), every
 * tensor with its real name, shape and Q4_K_M type, in the order llama.cpp's
 * quantizer writes them (non-block tensors first, then block by block, names
 * sorted within a block: its loader's weight map order). Sources of each
 * figure are listed in docs/ANATOMY.md. Names and shapes come from the
 * architecture's table (arch.h); the config gives the hyper-parameters.
 *
 * The Q4_K_M type rule (kv_skeleton_q4_k_m_type) restates llama-quant.cpp's
 * behaviour for the tensors these architectures have:
 *   - not quantized (kept in the converter's type, F32 for all of these):
 *     tensors of fewer than 2 dims, norms, the router (ffn_gate_inp), the
 *     gated-delta-net conv kernel (ssm_conv1d), names not ending in "weight";
 *   - output.weight (and token_embd when tied): Q6_K;
 *   - attn_v / attn_qkv ("attention-v-like"): Q6_K when their rank i among
 *     all such tensors satisfies "use more bits", else Q4_K;
 *   - every ffn_down* tensor (routed and shared): Q6_K when its block number
 *     satisfies "use more bits" over the block count including MTP blocks;
 *   - everything else: Q4_K;
 *   - a row length not a multiple of the block falls back (Q4_K -> Q5_0,
 *     Q6_K -> Q8_0, then F16).
 * "use more bits"(i, n) = i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvasir/anatomy.h"
#include "kvasir/arch.h"
#include "kvasir/gen.h"
#include "kvasir/gguf.h"
#include "kvasir/quant.h"
#include "kvasir/tok.h"

#define LLAMA_FTYPE_MOSTLY_Q4_K_M 15u /* general.file_type of a Q4_K_M file */

/* One model's hyperparameters, as its config.json gives them. */
typedef struct skel_cfg {
    const char *preset;
    const char *summary;
    const char *arch;          /* "qwen3moe" or "qwen35moe" */
    const char *name;          /* general.name */
    const char *basename;      /* general.basename */
    const char *size_label;    /* general.size_label */
    const char *pre;           /* tokenizer.ggml.pre */
    uint32_t n_layer;          /* trunk blocks (num_hidden_layers) */
    uint32_t n_nextn;          /* MTP blocks appended after the trunk */
    uint32_t n_embd;           /* hidden_size */
    uint32_t n_ff;             /* intermediate_size (feed_forward_length), 0: absent */
    uint32_t n_head, n_head_kv, head_dim;
    uint32_t n_expert, n_expert_used, n_ff_exp;
    uint32_t n_ff_shexp;       /* shared expert, 0: none */
    uint32_t n_vocab, n_ctx;
    float rope_base, rms_eps;
    /* gated delta net (qwen35moe); 0 for plain attention models */
    uint32_t full_attn_interval; /* every k-th block is full attention */
    uint32_t ssm_conv;           /* linear_conv_kernel_dim */
    uint32_t ssm_state;          /* linear_key_head_dim (= value head dim) */
    uint32_t ssm_group;          /* linear_num_key_heads */
    uint32_t ssm_dt_rank;        /* linear_num_value_heads */
    uint32_t rope_dim;           /* head_dim * partial_rotary_factor */
    int32_t rope_sections[4];    /* mrope_section padded to 4 */
    /* deepseek2 (MLA); 0 otherwise. head_dim is qk_nope_head_dim + qk_rope_head_dim,
     * rope_dim qk_rope_head_dim */
    uint32_t q_lora, kv_lora;    /* q_lora_rank, kv_lora_rank */
    uint32_t head_dim_v;         /* v_head_dim */
    uint32_t n_dense_lead;       /* first_k_dense_replace */
    uint32_t n_expert_shared;    /* n_shared_experts (of n_ff_exp each) */
    uint32_t n_group, n_group_used; /* n_group, topk_group */
    float weights_scale;         /* routed_scaling_factor */
    float yarn_factor;           /* rope_scaling.factor */
    uint32_t yarn_orig_ctx;      /* rope_scaling.original_max_position_embeddings */
    float yarn_beta_fast, yarn_beta_slow, mscale_all_dim;
    const char *license;         /* general.license, NULL: apache-2.0 */
} skel_cfg;

static const skel_cfg skel_cfgs[] = {
    {.preset = "qwen35-122b-a10b",
     .summary = "Qwen3.5-122B-A10B Q4_K_M skeleton (qwen35moe, 48+1 MTP blocks, 256 experts, ~76 GB sparse)",
     .arch = "qwen35moe", .name = "Qwen3.5 122B A10B", .basename = "Qwen3.5", .size_label = "122B-A10B",
     .pre = "qwen35", .n_layer = 48, .n_nextn = 1, .n_embd = 3072, .n_ff = 0, .n_head = 32, .n_head_kv = 2,
     .head_dim = 256, .n_expert = 256, .n_expert_used = 8, .n_ff_exp = 1024, .n_ff_shexp = 1024,
     .n_vocab = 248320, .n_ctx = 262144, .rope_base = 10000000.0f, .rms_eps = 1e-6f,
     .full_attn_interval = 4, .ssm_conv = 4, .ssm_state = 128, .ssm_group = 16, .ssm_dt_rank = 64,
     .rope_dim = 64, .rope_sections = {11, 11, 10, 0}},
    {.preset = "qwen35-35b-a3b",
     .summary = "Qwen3.5-35B-A3B Q4_K_M skeleton (qwen35moe, 40+1 MTP blocks, 256 experts, ~22 GB sparse)",
     .arch = "qwen35moe", .name = "Qwen3.5 35B A3B", .basename = "Qwen3.5", .size_label = "35B-A3B",
     .pre = "qwen35", .n_layer = 40, .n_nextn = 1, .n_embd = 2048, .n_ff = 0, .n_head = 16, .n_head_kv = 2,
     .head_dim = 256, .n_expert = 256, .n_expert_used = 8, .n_ff_exp = 512, .n_ff_shexp = 512,
     .n_vocab = 248320, .n_ctx = 262144, .rope_base = 10000000.0f, .rms_eps = 1e-6f,
     .full_attn_interval = 4, .ssm_conv = 4, .ssm_state = 128, .ssm_group = 16, .ssm_dt_rank = 32,
     .rope_dim = 64, .rope_sections = {11, 11, 10, 0}},
    {.preset = "qwen3-30b-a3b",
     .summary = "Qwen3-30B-A3B Q4_K_M skeleton (qwen3moe, 48 blocks, 128 experts, ~18.6 GB sparse)",
     .arch = "qwen3moe", .name = "Qwen3 30B A3B", .basename = "Qwen3", .size_label = "30B-A3B",
     .pre = "qwen2", .n_layer = 48, .n_nextn = 0, .n_embd = 2048, .n_ff = 6144, .n_head = 32, .n_head_kv = 4,
     .head_dim = 128, .n_expert = 128, .n_expert_used = 8, .n_ff_exp = 768, .n_ff_shexp = 0,
     .n_vocab = 151936, .n_ctx = 40960, .rope_base = 1000000.0f, .rms_eps = 1e-6f},
    /* deepseek-ai/DeepSeek-V3 config.json (R1 and V3-0324 share the shapes) */
    {.preset = "deepseek-v3",
     .summary = "DeepSeek-V3/R1 671B Q4_K_M skeleton (deepseek2, 61 blocks (3 dense), 256 experts, ~405 GB sparse)",
     .arch = "deepseek2", .name = "DeepSeek V3", .basename = "DeepSeek-V3", .size_label = "256x20B",
     .pre = "qwen2", .n_layer = 61, .n_nextn = 0, .n_embd = 7168, .n_ff = 18432, .n_head = 128, .n_head_kv = 1,
     .head_dim = 192, .n_expert = 256, .n_expert_used = 8, .n_ff_exp = 2048, .n_vocab = 129280,
     .n_ctx = 163840, .rope_base = 10000.0f, .rms_eps = 1e-6f, .rope_dim = 64, .q_lora = 1536, .kv_lora = 512,
     .head_dim_v = 128, .n_dense_lead = 3, .n_expert_shared = 1, .n_group = 8, .n_group_used = 4,
     .weights_scale = 2.5f, .yarn_factor = 40.0f, .yarn_orig_ctx = 4096, .yarn_beta_fast = 32.0f,
     .yarn_beta_slow = 1.0f, .mscale_all_dim = 1.0f, .license = "mit"},
    /* moonshotai/Kimi-K2-Instruct config.json */
    {.preset = "kimi-k2",
     .summary = "Kimi K2 1T Q4_K_M skeleton (deepseek2, 61 blocks (1 dense), 384 experts, ~620 GB sparse)",
     .arch = "deepseek2", .name = "Kimi K2 Instruct", .basename = "Kimi-K2", .size_label = "384x14B",
     .pre = "qwen2", .n_layer = 61, .n_nextn = 0, .n_embd = 7168, .n_ff = 18432, .n_head = 64, .n_head_kv = 1,
     .head_dim = 192, .n_expert = 384, .n_expert_used = 8, .n_ff_exp = 2048, .n_vocab = 163840,
     .n_ctx = 131072, .rope_base = 50000.0f, .rms_eps = 1e-6f, .rope_dim = 64, .q_lora = 1536, .kv_lora = 512,
     .head_dim_v = 128, .n_dense_lead = 1, .n_expert_shared = 1, .n_group = 1, .n_group_used = 1,
     .weights_scale = 2.827f, .yarn_factor = 32.0f, .yarn_orig_ctx = 4096, .yarn_beta_fast = 1.0f,
     .yarn_beta_slow = 1.0f, .mscale_all_dim = 1.0f, .license = "other"},
};
#define N_SKEL (sizeof skel_cfgs / sizeof skel_cfgs[0])

const kv_skeleton_preset *kv_skeleton_presets(size_t *n) {
    static kv_skeleton_preset list[N_SKEL];
    for (size_t i = 0; i < N_SKEL; i++) list[i] = (kv_skeleton_preset){skel_cfgs[i].preset, skel_cfgs[i].summary};
    *n = N_SKEL;
    return list;
}

static const skel_cfg *find_cfg(const char *name) {
    for (size_t i = 0; name && i < N_SKEL; i++)
        if (!strcmp(skel_cfgs[i].preset, name)) return &skel_cfgs[i];
    return NULL;
}

bool kv_skeleton_has(const char *name) { return find_cfg(name) != NULL; }

/* ---- the Q4_K_M rule -------------------------------------------------- */

static bool use_more_bits(int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

static bool has_sub(const char *s, const char *sub) { return strstr(s, sub) != NULL; }

uint32_t kv_skeleton_q4_k_m_type(const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t src_type,
                                 int i_wv, int n_wv, int n_layer_all, bool tied) {
    /* may it be quantized at all? */
    size_t len = strlen(name);
    bool q = n_dims >= 2 && len >= 6 && !strcmp(name + len - 6, "weight") && !has_sub(name, "_norm.weight") &&
             !has_sub(name, "ffn_gate_inp.weight") && !has_sub(name, "ssm_conv1d");
    if (!q) return src_type;

    uint32_t t = KV_TYPE_Q4_K;
    bool output = !strcmp(name, "output.weight"), embd = !strcmp(name, "token_embd.weight");
    if (output || (tied && embd)) {
        t = ne[0] % KV_QK_K ? KV_TYPE_Q8_0 : KV_TYPE_Q6_K;
    } else if (embd) {
        t = KV_TYPE_Q4_K;
    } else if (has_sub(name, "attn_qkv.weight") || has_sub(name, "attn_v.weight")) {
        if (use_more_bits(i_wv, n_wv)) t = KV_TYPE_Q6_K;
    } else if (has_sub(name, "ffn_down")) {
        /* MoE models: the layer comes from the name, n from the block count */
        int il = -1;
        if (sscanf(name, "blk.%d.", &il) == 1 && il >= 0 && use_more_bits(il, n_layer_all)) t = KV_TYPE_Q6_K;
    }
    /* rows that do not fit the type's block */
    const kv_type_info *ti = kv_type_get_ref(t);
    if (ne[0] % ti->blck) {
        t = t == KV_TYPE_Q6_K ? KV_TYPE_Q8_0 : KV_TYPE_Q5_0;
        if (ne[0] % 32) t = KV_TYPE_F16;
    }
    return t;
}

/* ---- tensor list ------------------------------------------------------ */

typedef struct skel_tensor {
    char name[KV_GGUF_MAX_TENSOR_NAME + 1];
    int32_t layer;   /* block, -1 for none */
    uint32_t n_dims;
    uint64_t ne[4];
    uint32_t src;    /* type in the converted (bf16) file */
    uint32_t type;   /* after Q4_K_M */
    enum kv_role role; /* from the table: decides which tensors get real values */
    float mean, std; /* norms: their distribution */
    size_t idx;      /* index in the writer */
} skel_tensor;

typedef struct skel_list {
    skel_tensor *t;
    size_t n, cap;
    int oom;
} skel_list;

/* Adds the table's tensor t of block il (-1 for a global). Tensors the
 * table keeps in f32 (norms, router, conv kernel, 1-D vectors) are F32 in
 * the converted file; the rest BF16. */
static void add(skel_list *l, const kv_tensor_desc *t, const kv_hparams *hp, int32_t layer) {
    if (l->oom) return;
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 256;
        skel_tensor *p = realloc(l->t, cap * sizeof *p);
        if (!p) {
            l->oom = 1;
            return;
        }
        l->t = p;
        l->cap = cap;
    }
    skel_tensor *st = &l->t[l->n++];
    memset(st, 0, sizeof *st);
    if (kv_tensor_name(t, layer < 0 ? 0 : (uint32_t)layer, st->name, sizeof st->name) < 0) l->oom = 1;
    st->layer = layer;
    int64_t ne[3];
    kv_tensor_shape(t, hp, ne);
    for (int i = 0; i < 3; i++) st->ne[i] = (uint64_t)ne[i];
    st->ne[3] = 1;
    st->n_dims = t->n_dims;
    st->src = t->flags & (KV_TF_F32 | KV_TF_KEEP_F32) ? KV_TYPE_F32 : KV_TYPE_BF16;
    st->role = t->role;
    st->mean = t->init_mean;
    st->std = t->init_std;
}

/* The hyper-parameters of a config, for the table's shapes. */
static void skel_hparams(const skel_cfg *c, kv_hparams *hp) {
    memset(hp, 0, sizeof *hp);
    hp->n_layer = c->n_layer;
    hp->n_layer_nextn = c->n_nextn;
    hp->n_embd = c->n_embd;
    hp->n_head = c->n_head;
    hp->n_head_kv = c->n_head_kv;
    hp->head_dim = c->head_dim;
    hp->n_rot = c->rope_dim ? c->rope_dim : c->head_dim;
    hp->n_expert = c->n_expert;
    hp->n_expert_used = c->n_expert_used;
    hp->n_ff_exp = c->n_ff_exp;
    hp->n_ff_shexp = c->n_ff_shexp;
    hp->n_vocab = c->n_vocab;
    hp->n_ctx_train = c->n_ctx;
    hp->rms_eps = c->rms_eps;
    hp->full_attn_interval = c->full_attn_interval;
    hp->ssm_d_conv = c->ssm_conv;
    hp->ssm_d_state = c->ssm_state;
    hp->ssm_n_group = c->ssm_group;
    hp->ssm_dt_rank = c->ssm_dt_rank;
    hp->ssm_d_inner = c->ssm_state * c->ssm_dt_rank;
    if (c->kv_lora) { /* MLA: the cached row is the latent and the rope part */
        hp->head_dim = c->kv_lora + c->rope_dim;
        hp->n_head_kv = 1;
        hp->head_dim_k_mla = c->head_dim;
        hp->head_dim_v_mla = c->head_dim_v;
        hp->q_lora_rank = c->q_lora;
        hp->kv_lora_rank = c->kv_lora;
        hp->n_ff = c->n_ff;
        hp->n_layer_dense_lead = c->n_dense_lead;
        hp->n_expert_shared = c->n_expert_shared;
        hp->n_ff_shexp = c->n_ff_exp * c->n_expert_shared;
    }
}

/* Every tensor the architecture's table gives the config (sorted later). */
static void build_list(const skel_cfg *c, skel_list *l) {
    const kv_arch_table *a = kv_arch_find(c->arch);
    kv_hparams hp;
    skel_hparams(c, &hp);
    for (size_t i = 0; i < a->n_tensors; i++)
        if (!a->tensors[i].blocks) add(l, &a->tensors[i], &hp, -1);
    for (uint32_t il = 0; il < kv_arch_n_blocks(&hp); il++)
        for (size_t i = 0; i < a->n_tensors; i++)
            if (kv_tensor_in_block(a, &a->tensors[i], &hp, il)) add(l, &a->tensors[i], &hp, (int32_t)il);
}

/* llama.cpp's loader order: block -1 first, then by block, then by name. */
static int cmp_tensor(const void *a, const void *b) {
    const skel_tensor *x = a, *y = b;
    if (x->layer != y->layer) return x->layer < y->layer ? -1 : 1;
    return strcmp(x->name, y->name);
}

static void assign_types(const skel_cfg *c, skel_list *l) {
    qsort(l->t, l->n, sizeof *l->t, cmp_tensor);
    bool tied = true;
    int n_wv = 0, i_wv = 0;
    for (size_t i = 0; i < l->n; i++) {
        if (!strcmp(l->t[i].name, "output.weight")) tied = false;
        if (has_sub(l->t[i].name, "attn_qkv.weight") || has_sub(l->t[i].name, "attn_v.weight")) n_wv++;
    }
    int n_all = (int)(c->n_layer + c->n_nextn);
    for (size_t i = 0; i < l->n; i++) {
        skel_tensor *t = &l->t[i];
        bool wv = has_sub(t->name, "attn_qkv.weight") || has_sub(t->name, "attn_v.weight");
        t->type = kv_skeleton_q4_k_m_type(t->name, t->n_dims, t->ne, t->src, i_wv, n_wv, n_all, tied);
        if (wv) i_wv++;
    }
}

/* ---- metadata --------------------------------------------------------- */

static int write_meta(kv_gguf_writer *w, const skel_cfg *c, const kv_bpe_vocab *v, kv_diag *d) {
    int rc;
    char k[96];
    const char *A = c->arch;
#define TRY(x) \
    if ((rc = (x))) return rc
#define KEY(s) (snprintf(k, sizeof k, "%s." s, A), k)
    /* in the order the converter writes them */
    TRY(kv_gguf_writer_set_str(w, "general.architecture", A, d));
    TRY(kv_gguf_writer_set_str(w, "general.type", "model", d));
    TRY(kv_gguf_writer_set_str(w, "general.name", c->name, d));
    TRY(kv_gguf_writer_set_str(w, "general.basename", c->basename, d));
    TRY(kv_gguf_writer_set_str(w, "general.size_label", c->size_label, d));
    TRY(kv_gguf_writer_set_str(w, "general.license", c->license ? c->license : "apache-2.0", d));
    TRY(kv_gguf_writer_set_u32(w, KEY("block_count"), c->n_layer + c->n_nextn, d));
    TRY(kv_gguf_writer_set_u32(w, KEY("context_length"), c->n_ctx, d));
    TRY(kv_gguf_writer_set_u32(w, KEY("embedding_length"), c->n_embd, d));
    if (c->n_ff) TRY(kv_gguf_writer_set_u32(w, KEY("feed_forward_length"), c->n_ff, d));
    TRY(kv_gguf_writer_set_u32(w, KEY("attention.head_count"), c->n_head, d));
    TRY(kv_gguf_writer_set_u32(w, KEY("attention.head_count_kv"), c->n_head_kv, d));
    if (c->rope_sections[0])
        TRY(kv_gguf_writer_set_arr(w, KEY("rope.dimension_sections"), KV_GGUF_INT32, c->rope_sections, 4, d));
    TRY(kv_gguf_writer_set_f32(w, KEY("rope.freq_base"), c->rope_base, d));
    TRY(kv_gguf_writer_set_f32(w, KEY("attention.layer_norm_rms_epsilon"), c->rms_eps, d));
    TRY(kv_gguf_writer_set_u32(w, KEY("expert_count"), c->n_expert, d));
    TRY(kv_gguf_writer_set_u32(w, KEY("expert_used_count"), c->n_expert_used, d));
    if (c->kv_lora) { /* deepseek2, keys as its converter writes them */
        TRY(kv_gguf_writer_set_u32(w, KEY("rope.dimension_count"), c->rope_dim, d));
        TRY(kv_gguf_writer_set_str(w, KEY("rope.scaling.type"), "yarn", d));
        TRY(kv_gguf_writer_set_f32(w, KEY("rope.scaling.factor"), c->yarn_factor, d));
        TRY(kv_gguf_writer_set_u32(w, KEY("rope.scaling.original_context_length"), c->yarn_orig_ctx, d));
        TRY(kv_gguf_writer_set_f32(w, KEY("rope.scaling.yarn_beta_fast"), c->yarn_beta_fast, d));
        TRY(kv_gguf_writer_set_f32(w, KEY("rope.scaling.yarn_beta_slow"), c->yarn_beta_slow, d));
        if (c->n_group > 1) {
            TRY(kv_gguf_writer_set_u32(w, KEY("expert_group_count"), c->n_group, d));
            TRY(kv_gguf_writer_set_u32(w, KEY("expert_group_used_count"), c->n_group_used, d));
        }
        TRY(kv_gguf_writer_set_u32(w, KEY("expert_gating_func"), 2, d)); /* sigmoid */
        TRY(kv_gguf_writer_set_u32(w, KEY("leading_dense_block_count"), c->n_dense_lead, d));
        TRY(kv_gguf_writer_set_u32(w, KEY("vocab_size"), c->n_vocab, d));
        TRY(kv_gguf_writer_set_u32(w, KEY("attention.q_lora_rank"), c->q_lora, d));
        TRY(kv_gguf_writer_set_u32(w, KEY("attention.kv_lora_rank"), c->kv_lora, d));
        TRY(kv_gguf_writer_set_u32(w, KEY("attention.key_length"), c->kv_lora + c->rope_dim, d));
        TRY(kv_gguf_writer_set_u32(w, KEY("attention.value_length"), c->kv_lora, d));
        TRY(kv_gguf_writer_set_u32(w, KEY("attention.key_length_mla"), c->head_dim, d));
        TRY(kv_gguf_writer_set_u32(w, KEY("attention.value_length_mla"), c->head_dim_v, d));
        TRY(kv_gguf_writer_set_u32(w, KEY("expert_shared_count"), c->n_expert_shared, d));
        TRY(kv_gguf_writer_set_f32(w, KEY("expert_weights_scale"), c->weights_scale, d));
        TRY(kv_gguf_writer_set_bool(w, KEY("expert_weights_norm"), true, d));
        TRY(kv_gguf_writer_set_f32(w, KEY("rope.scaling.yarn_log_multiplier"), 0.1f * c->mscale_all_dim, d));
    } else {
        TRY(kv_gguf_writer_set_u32(w, KEY("attention.key_length"), c->head_dim, d));
        TRY(kv_gguf_writer_set_u32(w, KEY("attention.value_length"), c->head_dim, d));
    }
    TRY(kv_gguf_writer_set_u32(w, "general.file_type", LLAMA_FTYPE_MOSTLY_Q4_K_M, d));
    TRY(kv_gguf_writer_set_u32(w, KEY("expert_feed_forward_length"), c->n_ff_exp, d));
    if (c->n_ff_shexp) TRY(kv_gguf_writer_set_u32(w, KEY("expert_shared_feed_forward_length"), c->n_ff_shexp, d));
    if (c->n_nextn) TRY(kv_gguf_writer_set_u32(w, KEY("nextn_predict_layers"), c->n_nextn, d));
    if (c->full_attn_interval) {
        TRY(kv_gguf_writer_set_u32(w, KEY("ssm.conv_kernel"), c->ssm_conv, d));
        TRY(kv_gguf_writer_set_u32(w, KEY("ssm.state_size"), c->ssm_state, d));
        TRY(kv_gguf_writer_set_u32(w, KEY("ssm.group_count"), c->ssm_group, d));
        TRY(kv_gguf_writer_set_u32(w, KEY("ssm.time_step_rank"), c->ssm_dt_rank, d));
        TRY(kv_gguf_writer_set_u32(w, KEY("ssm.inner_size"), c->ssm_state * c->ssm_dt_rank, d));
        TRY(kv_gguf_writer_set_u32(w, KEY("full_attention_interval"), c->full_attn_interval, d));
        TRY(kv_gguf_writer_set_u32(w, KEY("rope.dimension_count"), c->rope_dim, d));
    }
    TRY(kv_gguf_writer_set_u32(w, "general.quantization_version", 2, d));
#undef KEY

    TRY(kv_gen_write_tokenizer(w, v, c->pre, d));
#undef TRY
    return 0;
}

/* ---- real small tensors ----------------------------------------------
 * Token embeddings (the rows of tokens the vocabulary really has), norms and
 * routers carry seeded values; everything else stays a hole that reads as
 * zeros. With every projection and expert zero, a token's hidden state is
 * its embedding in every block, so each layer's router sees the normed
 * embedding and routing spreads over the experts as in a real model (an
 * all-zero router would pick experts 0..k-1 for every token).
 *
 * Disk: a router row e holds values only in SKEL_ROUTER_DIMS dims, the first
 * ones for even e and the last ones for odd e, so rows 2j+1 and 2j+2 share
 * one run of bytes: about n_expert/2 pages per layer instead of the whole
 * [n_embd][n_expert] f32 matrix (3 MB a layer on the 122B). */
#define SKEL_SEED 0x6b7661736b656cull /* "kvaskel" */
#define SKEL_ROUTER_DIMS 64u
#define SKEL_ROUTER_GAIN 2.0f /* router logits of std ~2: a clear top-k */

static uint64_t skel_mix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Approximately standard normal (sum of four 16-bit uniforms), integer
 * arithmetic and one multiply: the same bits everywhere. */
static float skel_normal(uint64_t *s) {
    uint64_t r = skel_mix(s);
    int32_t sum = (int32_t)(r & 0xffff) + (int32_t)((r >> 16) & 0xffff) + (int32_t)((r >> 32) & 0xffff) +
                  (int32_t)(r >> 48);
    return (float)(sum - 131070) * (1.0f / 37837.23f);
}

/* The PRNG stream of row `row` of tensor `name`. */
static uint64_t skel_stream(const char *name, uint64_t row) {
    uint64_t h = 1469598103934665603ull;
    for (const char *p = name; *p; p++) {
        h ^= (unsigned char)*p;
        h *= 1099511628211ull;
    }
    uint64_t s = SKEL_SEED ^ h ^ (row * 0x100000001b3ull);
    skel_mix(&s);
    return s;
}

static void skel_draw(float *f, size_t n, const char *name, uint64_t row, float mean, float std) {
    uint64_t st = skel_stream(name, row);
    for (size_t i = 0; i < n; i++) {
        float z = skel_normal(&st) * std;
        f[i] = mean + z;
    }
}

/* Writes the real values of t (a norm, a router or the token embedding;
 * other tensors are left alone). unused[r]: token r is padding. buf holds
 * at least 4 * ne[0] bytes, f as many floats. */
static int skel_write_real(kv_gguf_writer *w, const skel_tensor *t, const uint8_t *unused, size_t n_vocab, float *f,
                           uint8_t *buf, kv_diag *d) {
    const uint64_t E = t->ne[0];
    if (t->role == KV_ROLE_NORM && t->type == KV_TYPE_F32) {
        skel_draw(f, (size_t)E, t->name, 0, t->mean, t->std);
        return kv_gguf_writer_write_data(w, t->idx, 0, f, (size_t)E * sizeof(float), d);
    }
    if (t->role == KV_ROLE_ROUTER && t->type == KV_TYPE_F32 && t->n_dims == 2) {
        const uint64_t k = E < SKEL_ROUTER_DIMS ? E : SKEL_ROUTER_DIMS;
        const float std = SKEL_ROUTER_GAIN / sqrtf((float)k);
        for (uint64_t e = 0; e < t->ne[1]; e++) {
            const uint64_t first = e % 2 ? E - k : 0; /* odd rows: their last dims */
            skel_draw(f, (size_t)k, t->name, e, 0.0f, std);
            int rc = kv_gguf_writer_write_data(w, t->idx, (e * E + first) * sizeof(float), f, (size_t)k * sizeof(float), d);
            if (rc) return rc;
        }
        return 0;
    }
    if (t->role == KV_ROLE_EMBD) {
        const kv_type_info *ti = kv_type_get_ref(t->type);
        const uint64_t rb = kv_type_row_size(t->type, E);
        if (!ti || !ti->from_float || !rb) return kv_fail(d, KV_EINTERNAL, "skeleton: cannot quantize %s", t->name);
        const float std = 1.0f; /* RMSNorm follows: only the direction matters */
        for (uint64_t r = 0; r < t->ne[1] && r < n_vocab; r++) {
            if (unused[r]) continue;
            skel_draw(f, (size_t)E, t->name, r, 0.0f, std);
            ti->from_float(f, buf, (int64_t)E);
            int rc = kv_gguf_writer_write_data(w, t->idx, r * rb, buf, (size_t)rb, d);
            if (rc) return rc;
        }
    }
    return 0;
}

/* ---- writing ---------------------------------------------------------- */

int kv_skeleton_write(const char *name, const char *path, FILE *log, kv_diag *d) {
    return kv_skeleton_write_ex(name, path, true, log, d);
}

int kv_skeleton_write_ex(const char *name, const char *path, bool real, FILE *log, kv_diag *d) {
    const skel_cfg *c = find_cfg(name);
    if (!c)
        return kv_fail(d, KV_ENOTFOUND, "unknown skeleton preset '%s' (skeletons: qwen35-122b-a10b, "
                                        "qwen35-35b-a3b, qwen3-30b-a3b, deepseek-v3, kimi-k2)",
                       name ? name : "(null)");
    skel_list l = {0};
    kv_bpe_vocab voc;
    memset(&voc, 0, sizeof voc);
    kv_gguf_writer *w = NULL;
    char *part = NULL;
    uint8_t *unused = NULL, *qbuf = NULL;
    float *fbuf = NULL;
    size_t n_vocab = 0;
    int part_made = 0, rc;

    build_list(c, &l);
    if (l.oom) {
        rc = kv_fail(d, KV_ENOMEM, "out of memory");
        goto out;
    }
    assign_types(c, &l);

    if (log) fprintf(log, "gen-model: training a %u-token BPE vocabulary (pre-tokenizer %s)\n", c->n_vocab, c->pre);
    size_t corpus_len = 0;
    const char *corpus = kv_bpe_default_corpus(&corpus_len);
    if ((rc = kv_bpe_train(corpus, corpus_len, c->pre, c->n_vocab, &voc, d))) {
        kv_diag_prefix(d, rc, "vocabulary");
        goto out;
    }
    if (voc.n_tokens != c->n_vocab || voc.eos_id < 0 || voc.im_end_id < 0) {
        rc = kv_fail(d, KV_EINTERNAL, "vocabulary: trainer returned %zu tokens for %u", voc.n_tokens, c->n_vocab);
        goto out;
    }
    if ((rc = kv_gguf_writer_new(&w, d))) goto out;
    if ((rc = write_meta(w, c, &voc, d))) goto out;
    if (!(unused = calloc(voc.n_tokens, 1))) {
        rc = kv_fail(d, KV_ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < voc.n_tokens; i++) unused[i] = voc.types[i] == KV_TOK_UNUSED;
    n_vocab = voc.n_tokens;
    kv_bpe_vocab_free(&voc);
    uint64_t bytes = 0;
    for (size_t i = 0; i < l.n; i++) {
        rc = kv_gguf_writer_add_tensor(w, l.t[i].name, l.t[i].n_dims, l.t[i].ne, l.t[i].type, &l.t[i].idx, d);
        if (rc) goto out;
        bytes += kv_type_row_size(l.t[i].type, l.t[i].ne[0]) * l.t[i].ne[1] * l.t[i].ne[2];
    }
    size_t plen = strlen(path);
    if (!(part = malloc(plen + 6))) {
        rc = kv_fail(d, KV_ENOMEM, "out of memory");
        goto out;
    }
    memcpy(part, path, plen);
    memcpy(part + plen, ".part", 6);
    if ((rc = kv_gguf_writer_begin(w, part, d))) goto out;
    part_made = 1;
    /* real values in the small tensors; the rest stays holes */
    if (real) {
        size_t fmax = 0;
        for (size_t i = 0; i < l.n; i++)
            if (l.t[i].ne[0] > fmax) fmax = (size_t)l.t[i].ne[0];
        if (!(fbuf = malloc(fmax * sizeof *fbuf)) || !(qbuf = malloc(fmax * sizeof *fbuf))) {
            rc = kv_fail(d, KV_ENOMEM, "out of memory");
            goto out;
        }
        for (size_t i = 0; i < l.n; i++)
            if ((rc = skel_write_real(w, &l.t[i], unused, n_vocab, fbuf, qbuf, d))) goto out;
    }
    if ((rc = kv_gguf_writer_finish(w, d))) goto out;
    if (rename(part, path) != 0) {
        rc = kv_fail(d, KV_EIO, "cannot rename %s to %s: %s", part, path, strerror(errno));
        goto out;
    }
    part_made = 0;
    if (log)
        fprintf(log, "gen-model: wrote skeleton %s: %s, %zu tensors, %.2f GB of tensor data, holes but for %s\n",
                path, c->preset, l.n, (double)bytes / 1e9,
                real ? "the embeddings, norms and routers" : "none (header only)");
out:
    if (rc && part_made) unlink(part);
    free(part);
    free(unused);
    free(fbuf);
    free(qbuf);
    kv_gguf_writer_free(w);
    kv_bpe_vocab_free(&voc);
    free(l.t);
    return rc;
}
