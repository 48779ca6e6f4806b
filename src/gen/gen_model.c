/* Synthetic qwen3moe and qwen35moe models: metadata, vocabulary and seeded
 * weights.
 *
 * What llama.cpp needs to load the file (src/models/qwen3moe.cpp,
 * qwen35moe.cpp, llama-model.cpp, llama-vocab.cpp): the <arch>.*
 * hyperparameters as u32 (f32 for the RMS epsilon and RoPE base), a
 * gpt2/qwen2 (qwen35) vocabulary with merges and token types, and the
 * tensors of the architecture's table (src/arch/: names, which blocks carry
 * them, shapes in hyper-parameters, ne[0] innermost, and the distribution of
 * each), written in the table's file order; output.weight is absent when
 * tied.
 *
 * Expert weights are always renormalized after top-k in llama.cpp's qwen3moe
 * graph, so no key for that is written.
 *
 * Weight scales (std = gain / sqrt(fan_in); norms around 1) are chosen so
 * that every matrix product sees unit-RMS inputs, each layer adds O(1) to
 * the residual stream, the router's logits spread by ~2 (clear top-k), and
 * the LM head gives logits with a standard deviation of ~3: a clear but not
 * one-hot next-token distribution whose top two rarely tie. The residual
 * contributions are kept a few times larger than the embedding so that a
 * tied LM head does not simply echo the input token. Padding tokens (type
 * UNUSED, which fill a large vocabulary beyond what the corpus teaches) get
 * all-zero embedding and output rows: their logit is exactly 0, well below
 * the top of the real tokens, so generation does not wander into tokens
 * that detokenize to nothing.
 *
 * Hot path: drawing and quantizing the weights, one slice of rows at a time
 * (GEN_CHUNK elements) split over a thread pool by rows, written with pwrite
 * at the tensor's final place. Each row is its own PRNG stream (seeded from
 * seed, tensor name and row index), so the bytes do not depend on the
 * thread count or the slice size. */
#include "kvasir/gen.h"

#include "kvasir/arch.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/gguf.h"
#include "kvasir/pool.h"
#include "kvasir/quant.h"
#include "kvasir/tok.h"

#define GEN_CHUNK (1u << 20) /* floats drawn and quantized per slice */
#define GEN_LOG_BYTES (64ull << 20) /* models larger than this report progress */

/* The weight scales of each tensor are in the architecture tables (src/arch/). */
#define GEN_RMS_EPS 1e-6f
#define GEN_ROPE_BASE 1000000.0f

static const char kv_chatml_template[] =
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/* ---- presets ---------------------------------------------------------- */

#define GEN_QWEN3MOE(L, E, F, X, K, H, HKV, HD, V, CTX, T)                                         \
    {.arch = "qwen3moe", .n_layer = L, .n_embd = E, .n_ff_exp = F, .n_expert = X,                 \
     .n_expert_used = K, .n_head = H, .n_head_kv = HKV, .head_dim = HD, .n_vocab = V, .n_ctx = CTX, \
     .type = T, .seed = 42}

static const kv_gen_preset kv_presets[] = {
    {"tiny", "2 layers, embd 256, 8 experts (top-2) of 256, 4/2 heads x 64, vocab 2048, ctx 512, f32",
     GEN_QWEN3MOE(2, 256, 256, 8, 2, 4, 2, 64, 2048, 512, KV_TYPE_F32)},
    {"small", "4 layers, embd 512, 16 experts (top-4) of 512, 8/2 heads x 64, vocab 4096, ctx 1024, f32",
     GEN_QWEN3MOE(4, 512, 512, 16, 4, 8, 2, 64, 4096, 1024, KV_TYPE_F32)},
    {"qwen3-30b-a3b-bench",
     "Qwen3-30B-A3B layer shapes: embd 2048, 128 experts (top-8) of 768, 32/4 heads x 128, "
     "vocab 151936, ctx 4096; 4 layers, q4_K (~1.8 GB; q8_0 ~3.3 GB)",
     GEN_QWEN3MOE(4, 2048, 768, 128, 8, 32, 4, 128, 151936, 4096, KV_TYPE_Q4_K)},
    /* DeepSeek-V3's routing and MLA head shapes (256 experts top-8 in 8
     * groups of which 4 are chosen, one shared expert, sigmoid scores scaled
     * by 2.5; q_lora 1536, kv_lora 512, query heads of 128 + 64 rope, values
     * of 128; YaRN factor 40; the first block dense at V3's 9x the expert
     * width), at n_embd 2048 with 16 heads and experts of 512, so a layer is
     * about Qwen3-30B-A3B's (805M expert weights against 604M) */
    {"deepseek-v3-bench",
     "DeepSeek-V3 routing and MLA shapes at embd 2048: 256 experts (top-8, 8 groups, 4 used) of 512, "
     "1 shared, 16 heads x (128+64), kv_lora 512, q_lora 1536, first block dense (4608), YaRN 40, "
     "vocab 129280, ctx 4096; 4 layers, q4_K (~1.7 GB)",
     {.arch = "deepseek2", .n_layer = 4, .n_embd = 2048, .n_ff_exp = 512, .n_expert = 256, .n_expert_used = 8,
      .n_head = 16, .n_head_kv = 1, .head_dim = 192, .n_vocab = 129280, .n_ctx = 4096, .type = KV_TYPE_Q4_K,
      .seed = 42, .n_rot = 64, .q_lora_rank = 1536, .kv_lora_rank = 512, .head_dim_v = 128, .n_ff = 4608,
      .n_dense_lead = 1, .n_expert_shared = 1, .n_expert_groups = 8, .n_group_used = 4,
      .expert_weights_scale = 2.5f, .yarn_factor = 40.0f, .yarn_orig_ctx = 4096}},
    /* gpt-oss-20b as it is (24 blocks there, a few here): the 120b has the
     * same blocks with 128 experts, 4x the expert bytes of one layer */
    {"gpt-oss-20b-bench",
     "gpt-oss-20b shapes: embd 2880, 32 experts (top-4) of 2880, 64/8 heads x 64, sliding window 128 "
     "in even blocks, sinks, YaRN 32 over 4096, vocab 201088, ctx 4096; 2 layers, mxfp4 (~1.6 GB)",
     {.arch = "gpt-oss", .n_layer = 2, .n_embd = 2880, .n_ff_exp = 2880, .n_expert = 32, .n_expert_used = 4,
      .n_head = 64, .n_head_kv = 8, .head_dim = 64, .n_vocab = 201088, .n_ctx = 4096, .type = KV_TYPE_MXFP4,
      .seed = 42, .n_swa = 128, .swa_pattern = 2, .yarn_factor = 32.0f, .yarn_orig_ctx = 4096}},
};

const kv_gen_preset *kv_gen_presets(size_t *n) {
    *n = sizeof kv_presets / sizeof kv_presets[0];
    return kv_presets;
}

int kv_gen_preset_get(const char *name, kv_gen_config *cfg, kv_diag *d) {
    size_t n;
    const kv_gen_preset *p = kv_gen_presets(&n);
    for (size_t i = 0; i < n; i++)
        if (strcmp(p[i].name, name) == 0) {
            *cfg = p[i].cfg;
            return 0;
        }
    return kv_fail(d, KV_ENOTFOUND, "unknown preset '%s' (presets: tiny, small, qwen3-30b-a3b-bench, "
                   "deepseek-v3-bench, gpt-oss-20b-bench)",
                   name);
}

/* ---- tensor list ------------------------------------------------------ */

typedef struct gen_tensor {
    char name[KV_GGUF_MAX_TENSOR_NAME + 1];
    uint32_t n_dims;
    uint64_t ne[4];
    uint32_t type;  /* storage type after fallback */
    uint32_t want;  /* type asked for */
    float mean;     /* weight distribution */
    float std;
    int vocab_rows; /* rows are tokens: UNUSED tokens get all-zero rows */
    int matrix;     /* quantizable (the config's type or mix), else F32 */
    uint64_t nbytes;
} gen_tensor;

uint32_t kv_gen_matrix_type(uint32_t want, uint64_t row_len) {
    const kv_type_info *ti = kv_type_get_ref(want);
    if (!ti || row_len % ti->blck == 0) return want;
    if (ti->blck > 32 && row_len % 32 == 0) return KV_TYPE_Q8_0;
    return KV_TYPE_F16;
}

static int is_gen_type(uint32_t t) {
    switch (t) {
    case KV_TYPE_F32: case KV_TYPE_F16: case KV_TYPE_BF16: case KV_TYPE_Q8_0:
    case KV_TYPE_Q4_0: case KV_TYPE_Q4_K: case KV_TYPE_Q5_K: case KV_TYPE_Q6_K:
    case KV_TYPE_Q4_1: case KV_TYPE_Q5_0: case KV_TYPE_Q5_1: case KV_TYPE_IQ4_NL: case KV_TYPE_MXFP4:
    case KV_TYPE_Q2_K: case KV_TYPE_Q3_K: case KV_TYPE_IQ4_XS:
        return 1;
    default:
        return 0;
    }
}

typedef struct gen_list {
    gen_tensor *t;
    size_t n, cap;
    uint64_t bytes; /* data section size, each tensor padded to 32 */
    int overflow;
} gen_list;

static void size_bytes(gen_list *l, gen_tensor *t);

static void add_t(gen_list *l, const char *name, uint32_t n_dims, uint64_t ne0, uint64_t ne1,
                  uint64_t ne2, uint32_t want, int matrix, float mean, float std) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        gen_tensor *p = realloc(l->t, cap * sizeof *p);
        if (!p) {
            l->overflow = 1;
            return;
        }
        l->t = p;
        l->cap = cap;
    }
    gen_tensor *t = &l->t[l->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->n_dims = n_dims;
    t->ne[0] = ne0;
    t->ne[1] = ne1;
    t->ne[2] = ne2;
    t->ne[3] = 1;
    t->want = matrix ? want : KV_TYPE_F32;
    t->type = matrix ? kv_gen_matrix_type(want, ne0) : KV_TYPE_F32;
    t->matrix = matrix;
    t->mean = mean;
    t->std = std;
    size_bytes(l, t);
}

/* t's byte size from its type, added to the list's total. Sizes are
 * bounded by validation (< 2^60 elements), so only the sum needs care. */
static void size_bytes(gen_list *l, gen_tensor *t) {
    uint64_t nb = kv_type_row_size(t->type, t->ne[0]) * t->ne[1] * t->ne[2];
    t->nbytes = nb;
    uint64_t padded = (nb + 31) & ~(uint64_t)31;
    if (l->bytes > UINT64_MAX - padded)
        l->overflow = 1;
    else
        l->bytes += padded;
}

/* The mix's recipe over the whole list (it needs every attn_v-like
 * tensor's rank and whether output.weight exists): types and sizes again. */
static void apply_mix(gen_list *l, const kv_gen_config *c, const kv_hparams *hp) {
    kv_gen_mix_ctx m = {.n_layer_all = (int)kv_arch_n_blocks(hp), .n_expert = c->n_expert,
                        .n_gqa = c->n_head / c->n_head_kv, .tied = true};
    for (size_t i = 0; i < l->n; i++) {
        const char *nm = l->t[i].name;
        if (!strcmp(nm, "output.weight")) m.tied = false;
        if (strstr(nm, "attn_v.weight") || strstr(nm, "attn_qkv.weight") || strstr(nm, "attn_kv_b.weight")) m.n_wv++;
    }
    l->bytes = 0;
    for (size_t i = 0; i < l->n; i++) {
        gen_tensor *t = &l->t[i];
        const char *nm = t->name;
        if (t->matrix) {
            t->type = t->want = kv_gen_mix_type(c->mix, nm, t->ne[0], &m);
            if (strstr(nm, "attn_v.weight") || strstr(nm, "attn_qkv.weight") || strstr(nm, "attn_kv_b.weight")) m.i_wv++;
        }
        size_bytes(l, t);
    }
}

static float gain(float g, uint64_t fan_in) { return g / sqrtf((float)fan_in); }

static bool is_q35(const kv_gen_config *c) { return c->arch && !strcmp(c->arch, "qwen35moe"); }
static bool is_ds2(const kv_gen_config *c) { return c->arch && !strcmp(c->arch, "deepseek2"); }
static bool is_gptoss(const kv_gen_config *c) { return c->arch && !strcmp(c->arch, "gpt-oss"); }

/* deepseek2's defaults: a small MLA (the latent a quarter of n_embd, the
 * rope part a third of the query head) and V3's routing (sigmoid, scaled). */
static void fill_defaults_ds2(kv_gen_config *c) {
    if (!c->n_rot) c->n_rot = c->head_dim / 3 >= 2 ? (c->head_dim / 3) & ~1u : 2;
    if (!c->q_lora_rank) c->q_lora_rank = (2 * c->n_embd / 3) & ~1u ? (2 * c->n_embd / 3) & ~1u : 2;
    if (!c->kv_lora_rank) c->kv_lora_rank = c->n_embd / 4 ? c->n_embd / 4 : 1;
    if (!c->head_dim_v) c->head_dim_v = c->head_dim > c->n_rot ? c->head_dim - c->n_rot : 1;
    if (!c->n_ff) c->n_ff = 4 * c->n_ff_exp;
    if (!c->n_expert_shared) c->n_expert_shared = 1;
    if (c->n_expert_groups > 1 && !c->n_group_used) c->n_group_used = c->n_expert_groups / 2 ? c->n_expert_groups / 2 : 1;
    if (c->expert_weights_scale == 0.0f) c->expert_weights_scale = 2.5f;
    if (c->yarn_factor > 0.0f && !c->yarn_orig_ctx) c->yarn_orig_ctx = c->n_ctx / 4 ? c->n_ctx / 4 : 1;
    c->n_head_kv = 1;
}

void kv_gen_fill_defaults(kv_gen_config *c) {
    if (is_ds2(c)) {
        fill_defaults_ds2(c);
        return;
    }
    if (is_gptoss(c)) {
        if (!c->n_swa) c->n_swa = 8;
        if (!c->swa_pattern) c->swa_pattern = 2;
        if (c->yarn_factor > 0.0f && !c->yarn_orig_ctx) c->yarn_orig_ctx = c->n_ctx / 4 ? c->n_ctx / 4 : 1;
        return;
    }
    if (!is_q35(c)) return;
    if (!c->n_ff_shexp) c->n_ff_shexp = c->n_ff_exp;
    if (!c->full_attn_interval) c->full_attn_interval = 4;
    if (!c->ssm_d_conv) c->ssm_d_conv = 4;
    if (!c->ssm_d_state) c->ssm_d_state = c->head_dim;
    if (!c->ssm_n_group) c->ssm_n_group = 2;
    if (!c->ssm_dt_rank) c->ssm_dt_rank = 2 * c->ssm_n_group;
    if (!c->n_rot) c->n_rot = c->head_dim / 4 >= 2 ? (c->head_dim / 4) & ~1u : 2;
    if (!c->rope_sections[0] && !c->rope_sections[1] && !c->rope_sections[2] && !c->rope_sections[3]) {
        int32_t p = (int32_t)(c->n_rot / 2); /* Qwen3.5: 32 pairs as 11, 11, 10 */
        c->rope_sections[0] = (p + 2) / 3;
        c->rope_sections[1] = (p + 1) / 3;
        c->rope_sections[2] = p / 3;
    }
}

/* The hyper-parameters a config describes, for the table's shapes. */
static void gen_hparams(const kv_gen_config *c, kv_hparams *hp) {
    memset(hp, 0, sizeof *hp);
    hp->n_layer = c->n_layer;
    hp->n_embd = c->n_embd;
    hp->n_head = c->n_head;
    hp->n_head_kv = c->n_head_kv;
    hp->head_dim = c->head_dim;
    hp->n_expert = c->n_expert;
    hp->n_expert_used = c->n_expert_used;
    hp->n_ff_exp = c->n_ff_exp;
    hp->n_vocab = c->n_vocab;
    if (is_ds2(c)) {
        hp->n_rot = c->n_rot;
        hp->n_head_kv = 1;
        hp->head_dim = c->kv_lora_rank + c->n_rot;
        hp->head_dim_k_mla = c->head_dim;
        hp->head_dim_v_mla = c->head_dim_v;
        hp->q_lora_rank = c->q_lora_rank;
        hp->kv_lora_rank = c->kv_lora_rank;
        hp->n_ff = c->n_ff;
        hp->n_layer_dense_lead = c->n_dense_lead;
        hp->n_ff_shexp = c->n_ff_exp * c->n_expert_shared;
        return;
    }
    if (!is_q35(c)) return;
    hp->n_layer_nextn = c->n_nextn;
    hp->full_attn_interval = c->full_attn_interval;
    hp->n_ff_shexp = c->n_ff_shexp;
    hp->ssm_d_conv = c->ssm_d_conv;
    hp->ssm_d_state = c->ssm_d_state;
    hp->ssm_n_group = c->ssm_n_group;
    hp->ssm_dt_rank = c->ssm_dt_rank;
    hp->ssm_d_inner = c->ssm_d_state * c->ssm_dt_rank;
}

/* Adds the table's tensor t (of block il) to the list: matrices in the
 * config's type, f32 tensors (norms, router, conv kernel...) in f32. */
static void add_desc(gen_list *l, const kv_gen_config *c, const kv_hparams *hp, const kv_tensor_desc *t,
                     uint32_t il) {
    char nm[KV_GGUF_MAX_TENSOR_NAME + 1];
    if (kv_tensor_name(t, il, nm, sizeof nm) < 0) {
        l->overflow = 1;
        return;
    }
    int64_t ne[3];
    kv_tensor_shape(t, hp, ne);
    const int matrix = !(t->flags & (KV_TF_F32 | KV_TF_KEEP_F32));
    const float std = t->init_gain != 0.0f ? gain(t->init_gain, (uint64_t)ne[0]) : t->init_std;
    uint32_t want = c->type;
    if (c->q6_mix && (strstr(nm, "ffn_down") || strstr(nm, "attn_v.") || !strcmp(nm, "output.weight")))
        want = KV_TYPE_Q6_K;
    add_t(l, nm, t->n_dims, (uint64_t)ne[0], (uint64_t)ne[1], (uint64_t)ne[2], matrix ? want : 0, matrix,
          t->init_mean, std);
    if (!l->overflow && (t->flags & KV_TF_VOCAB_ROWS)) l->t[l->n - 1].vocab_rows = 1;
}

/* Builds the tensor list of a validated config from its architecture's
 * table, in the table's file order: the global tensors before the first
 * block tensor, every block's tensors, then the other global tensors
 * (output.weight left out when tied). Returns 0 or KV_ENOMEM. */
static int build_list(const kv_gen_config *c, gen_list *l) {
    memset(l, 0, sizeof *l);
    const kv_arch_table *a = kv_arch_find(c->arch);
    if (!a) return KV_ENOMEM; /* validated before: cannot happen */
    kv_hparams hp;
    gen_hparams(c, &hp);
    size_t first_blk = 0;
    while (first_blk < a->n_tensors && !a->tensors[first_blk].blocks) first_blk++;
    for (size_t i = 0; i < first_blk; i++) add_desc(l, c, &hp, &a->tensors[i], 0);
    for (uint32_t il = 0; il < kv_arch_n_blocks(&hp); il++)
        for (size_t i = first_blk; i < a->n_tensors; i++)
            if (kv_tensor_in_block(a, &a->tensors[i], &hp, il)) add_desc(l, c, &hp, &a->tensors[i], il);
    for (size_t i = first_blk; i < a->n_tensors; i++) {
        const kv_tensor_desc *t = &a->tensors[i];
        if (t->blocks || ((t->flags & KV_TF_TIED) && c->tied)) continue;
        add_desc(l, c, &hp, t, 0);
    }
    if (!l->overflow && c->mix) apply_mix(l, c, &hp);
    if (l->overflow) {
        free(l->t);
        memset(l, 0, sizeof *l);
        return KV_ENOMEM;
    }
    return 0;
}

/* ---- validation ------------------------------------------------------- */

static int check_range(kv_diag *d, const char *what, uint64_t v, uint64_t lo, uint64_t hi) {
    if (v < lo || v > hi)
        return kv_fail(d, KV_EINVAL, "%s is %" PRIu64 ", must be in [%" PRIu64 ", %" PRIu64 "]", what,
                       v, lo, hi);
    return 0;
}

static int validate_ds2(const kv_gen_config *c, kv_diag *d) {
    int rc;
    if ((rc = check_range(d, "rope-dim", c->n_rot, 2, c->head_dim > 2 ? c->head_dim - 1 : 2)) ||
        (rc = check_range(d, "q-lora", c->q_lora_rank, 1, KV_GEN_MAX_EMBD)) ||
        (rc = check_range(d, "kv-lora", c->kv_lora_rank, 1, KV_GEN_MAX_HEAD_DIM - c->n_rot)) ||
        (rc = check_range(d, "head-dim-v", c->head_dim_v, 1, KV_GEN_MAX_HEAD_DIM)) ||
        (rc = check_range(d, "ff", c->n_ff, 1, KV_GEN_MAX_FF)) ||
        (rc = check_range(d, "dense-layers", c->n_dense_lead, 0, c->n_layer)) ||
        (rc = check_range(d, "shared-experts", c->n_expert_shared, 1, 64)) ||
        (rc = check_range(d, "shared experts' rows", (uint64_t)c->n_expert_shared * c->n_ff_exp, 1, KV_GEN_MAX_FF)) ||
        (rc = check_range(d, "expert-groups", c->n_expert_groups, 0, c->n_expert)))
        return rc;
    if (c->n_rot % 2) return kv_fail(d, KV_EINVAL, "rope-dim %" PRIu32 " must be even", c->n_rot);
    if (c->n_expert_groups > 1) {
        const uint32_t per = c->n_expert / c->n_expert_groups;
        if (c->n_expert % c->n_expert_groups || per < 2)
            return kv_fail(d, KV_EINVAL, "expert-groups %" PRIu32 " must divide experts %" PRIu32 " in groups of 2 or more",
                           c->n_expert_groups, c->n_expert);
        if ((rc = check_range(d, "groups-used", c->n_group_used, 1, c->n_expert_groups - 1))) return rc;
        if (c->n_expert_used > c->n_group_used * per)
            return kv_fail(d, KV_EINVAL, "experts-used %" PRIu32 " exceeds the %" PRIu32 " experts of the groups used",
                           c->n_expert_used, c->n_group_used * per);
    }
    if (!(c->expert_weights_scale > 0.0f && c->expert_weights_scale <= 100.0f))
        return kv_fail(d, KV_EINVAL, "expert weights scale %g must be in (0, 100]", (double)c->expert_weights_scale);
    if (!(c->yarn_factor == 0.0f || (c->yarn_factor >= 1.0f && c->yarn_factor <= 1024.0f)))
        return kv_fail(d, KV_EINVAL, "yarn factor %g must be 0 (none) or in [1, 1024]", (double)c->yarn_factor);
    if (c->yarn_factor > 0.0f && (rc = check_range(d, "yarn-orig-ctx", c->yarn_orig_ctx, 1, KV_GEN_MAX_CTX))) return rc;
    return 0;
}

int kv_gen_validate(const kv_gen_config *c, kv_diag *d) {
    int rc;
    if (!c->arch || (strcmp(c->arch, "qwen3moe") != 0 && !is_q35(c) && !is_ds2(c) && !is_gptoss(c)))
        return kv_fail(d, KV_EUNSUPPORTED,
                       "unknown architecture '%s' (supported: qwen3moe, qwen35moe, deepseek2, gpt-oss)",
                       c->arch ? c->arch : "(null)");
    if (is_ds2(c) && (rc = validate_ds2(c, d))) return rc;
    if (is_gptoss(c)) {
        if ((rc = check_range(d, "swa", c->n_swa, 1, KV_GEN_MAX_CTX)) ||
            (rc = check_range(d, "swa-pattern", c->swa_pattern, 1, KV_GEN_MAX_LAYER)))
            return rc;
        if (c->tied) return kv_fail(d, KV_EINVAL, "gpt-oss has an untied LM head (output.weight): drop --tied");
        if (!(c->yarn_factor == 0.0f || (c->yarn_factor >= 1.0f && c->yarn_factor <= 1024.0f)))
            return kv_fail(d, KV_EINVAL, "yarn factor %g must be 0 (none) or in [1, 1024]", (double)c->yarn_factor);
        if (c->yarn_factor > 0.0f && (rc = check_range(d, "yarn-orig-ctx", c->yarn_orig_ctx, 1, KV_GEN_MAX_CTX)))
            return rc;
    }
    if (is_q35(c)) {
        if ((rc = check_range(d, "ff-shexp", c->n_ff_shexp, 1, KV_GEN_MAX_FF)) ||
            (rc = check_range(d, "attn-interval", c->full_attn_interval, 1, KV_GEN_MAX_LAYER)) ||
            (rc = check_range(d, "ssm-conv", c->ssm_d_conv, 2, 64)) ||
            (rc = check_range(d, "ssm-state", c->ssm_d_state, 1, KV_GEN_MAX_HEAD_DIM)) ||
            (rc = check_range(d, "ssm-groups", c->ssm_n_group, 1, KV_GEN_MAX_HEAD)) ||
            (rc = check_range(d, "ssm-heads", c->ssm_dt_rank, 1, KV_GEN_MAX_HEAD)) ||
            (rc = check_range(d, "rope-dim", c->n_rot, 2, c->head_dim)) ||
            (rc = check_range(d, "nextn", c->n_nextn, 0, 1)) ||
            (rc = check_range(d, "layers + nextn", (uint64_t)c->n_layer + c->n_nextn, 1, KV_GEN_MAX_LAYER)))
            return rc;
        if (c->ssm_dt_rank % c->ssm_n_group)
            return kv_fail(d, KV_EINVAL, "ssm-heads (%" PRIu32 ") must be a multiple of ssm-groups (%" PRIu32 ")",
                           c->ssm_dt_rank, c->ssm_n_group);
        if (c->n_rot % 2) return kv_fail(d, KV_EINVAL, "rope-dim %" PRIu32 " must be even", c->n_rot);
        int64_t sum = 0;
        for (int i = 0; i < 4; i++) {
            if (c->rope_sections[i] < 0) return kv_fail(d, KV_EINVAL, "rope section %d is negative", i);
            sum += c->rope_sections[i];
        }
        if (sum < 1 || sum > c->head_dim)
            return kv_fail(d, KV_EINVAL, "rope sections sum to %lld, must be in [1, head-dim]", (long long)sum);
    }
    if ((rc = check_range(d, "layers", c->n_layer, 1, KV_GEN_MAX_LAYER)) ||
        (rc = check_range(d, "embd", c->n_embd, 1, KV_GEN_MAX_EMBD)) ||
        (rc = check_range(d, "ff-exp", c->n_ff_exp, 1, KV_GEN_MAX_FF)) ||
        (rc = check_range(d, "experts", c->n_expert, 1, KV_GEN_MAX_EXPERT)) ||
        (rc = check_range(d, "experts-used", c->n_expert_used, 1, c->n_expert)) ||
        (rc = check_range(d, "heads", c->n_head, 1, KV_GEN_MAX_HEAD)) ||
        (rc = check_range(d, "kv-heads", c->n_head_kv, 1, c->n_head)) ||
        (rc = check_range(d, "head-dim", c->head_dim, 2, KV_GEN_MAX_HEAD_DIM)) ||
        (rc = check_range(d, "vocab", c->n_vocab, KV_GEN_MIN_VOCAB, KV_TOK_MAX_VOCAB)) ||
        (rc = check_range(d, "ctx", c->n_ctx, 1, KV_GEN_MAX_CTX)))
        return rc;
    if (c->n_head % c->n_head_kv)
        return kv_fail(d, KV_EINVAL, "heads (%" PRIu32 ") must be a multiple of kv-heads (%" PRIu32 ")",
                       c->n_head, c->n_head_kv);
    if (c->head_dim % 2)
        return kv_fail(d, KV_EINVAL, "head-dim %" PRIu32 " must be even (RoPE rotates pairs)", c->head_dim);
    if (!(c->router_skew >= 0.0f && c->router_skew <= KV_GEN_MAX_ROUTER_SKEW))
        return kv_fail(d, KV_EINVAL, "router skew %g must be in [0, %g]", (double)c->router_skew,
                       (double)KV_GEN_MAX_ROUTER_SKEW);
    if (c->mix >= KV_GEN_MIX_COUNT)
        return kv_fail(d, KV_EINVAL, "mix %" PRIu32 " is not one of q2_k, q3_k_m, q4_k_m, iq4_xs", c->mix);
    const kv_type_info *ti = kv_type_get_ref(c->type);
    if (!is_gen_type(c->type) || !ti || !ti->from_float)
        return kv_fail(d, KV_EUNSUPPORTED,
                       "type %s cannot be generated (use f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, "
                       "iq4_nl, mxfp4, q2_k, q3_k, q4_k, q5_k, q6_k or iq4_xs)",
                       ti ? ti->name : "unknown");
    uint64_t bytes = kv_gen_data_bytes(c);
    if (bytes == 0 || bytes > KV_GEN_MAX_BYTES)
        return kv_fail(d, KV_EINVAL, "model would be %.1f GiB, max %.0f GiB", (double)bytes / (1 << 30),
                       (double)KV_GEN_MAX_BYTES / (1 << 30));
    return 0;
}

uint64_t kv_gen_data_bytes(const kv_gen_config *c) {
    /* the list itself needs only bounded sizes: each factor <= 2^22, and
     * products of three stay < 2^63 */
    if (!c->n_embd || c->n_embd > KV_GEN_MAX_EMBD || !c->n_vocab || c->n_vocab > KV_TOK_MAX_VOCAB ||
        !c->n_ff_exp || c->n_ff_exp > KV_GEN_MAX_FF || !c->n_expert || c->n_expert > KV_GEN_MAX_EXPERT ||
        !c->n_head || c->n_head > KV_GEN_MAX_HEAD || !c->n_head_kv || c->n_head_kv > KV_GEN_MAX_HEAD ||
        !c->head_dim || c->head_dim > KV_GEN_MAX_HEAD_DIM || c->n_layer > KV_GEN_MAX_LAYER ||
        !kv_type_get_ref(c->type))
        return 0;
    if (is_q35(c) && (!c->full_attn_interval || c->n_ff_shexp > KV_GEN_MAX_FF || c->ssm_d_state > KV_GEN_MAX_HEAD_DIM ||
                      c->ssm_n_group > KV_GEN_MAX_HEAD || c->ssm_dt_rank > KV_GEN_MAX_HEAD || c->ssm_d_conv > 64 ||
                      c->n_nextn > 1))
        return 0;
    gen_list l;
    if (build_list(c, &l)) return 0;
    uint64_t b = l.bytes;
    free(l.t);
    return b;
}

/* ---- weights ---------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Approximately standard normal: the sum of four 16-bit uniforms (Irwin-Hall),
 * centred and scaled to unit variance. Integer arithmetic and one float
 * multiply, so it is bit-identical everywhere; tails end at +-3.46 sigma,
 * which suits weights (no outliers to blow up quantization scales). */
static float gen_normal(uint64_t *s) {
    uint64_t r = splitmix64(s);
    int32_t sum = (int32_t)(r & 0xffff) + (int32_t)((r >> 16) & 0xffff) +
                  (int32_t)((r >> 32) & 0xffff) + (int32_t)(r >> 48);
    return (float)(sum - 131070) * (1.0f / 37837.23f);
}

static uint64_t name_seed(uint64_t seed, const char *name) {
    uint64_t h = 1469598103934665603ull;
    for (const char *p = name; *p; p++) {
        h ^= (unsigned char)*p;
        h *= 1099511628211ull;
    }
    uint64_t s = seed ^ h;
    splitmix64(&s);
    return s;
}

/* Seed of one row's stream: rows are independent streams so that any
 * number of threads can draw them and produce the same bytes. */
static uint64_t row_seed(uint64_t tensor_seed, uint64_t row) {
    uint64_t a = row, b;
    b = splitmix64(&a) ^ tensor_seed;
    splitmix64(&b);
    return b;
}

typedef struct gen_job {
    const gen_tensor *t;    /* tensor being drawn */
    const kv_type_info *ti; /* its storage type (scalar reference quantizer) */
    uint64_t seed;          /* tensor seed */
    uint64_t r0, nr;        /* rows [r0, r0 + nr) of the tensor in this slice */
    uint64_t row_len;       /* elements per row */
    uint64_t row_bytes;     /* bytes per stored row */
    const uint8_t *unused;  /* [n_vocab] 1 for UNUSED tokens, if t->vocab_rows */
    const float *row_gain;  /* [ne1] std multiplier per row (router skew), or NULL */
    float *fbuf;            /* [nr * row_len] */
    uint8_t *qbuf;          /* [nr * row_bytes] */
} gen_job;

/* Pool task: thread ith draws and quantizes its share of the slice's rows. */
static void gen_rows(void *arg, int ith, int nth) {
    const gen_job *j = arg;
    long lo, hi;
    kv_pool_split((long)j->nr, ith, nth, &lo, &hi);
    if (lo >= hi) return;
    for (long r = lo; r < hi; r++) {
        uint64_t st = row_seed(j->seed, j->r0 + (uint64_t)r);
        float *f = j->fbuf + (size_t)r * j->row_len;
        if (j->t->vocab_rows && j->unused[j->r0 + (uint64_t)r]) {
            memset(f, 0, j->row_len * sizeof *f);
            continue;
        }
        const float std = j->row_gain ? j->t->std * j->row_gain[(j->r0 + (uint64_t)r) % j->t->ne[1]] : j->t->std;
        for (uint64_t i = 0; i < j->row_len; i++) {
            /* two statements: no fused multiply-add whatever the compiler */
            float z = gen_normal(&st) * std;
            f[i] = j->t->mean + z;
        }
    }
    j->ti->from_float(j->fbuf + (size_t)lo * j->row_len, j->qbuf + (size_t)lo * j->row_bytes,
                      (int64_t)((uint64_t)(hi - lo) * j->row_len));
}

/* True for a layer's router (blk.N.ffn_gate_inp.weight, not the shared
 * expert's gate). */
static int is_router(const char *name) {
    static const char suf[] = ".ffn_gate_inp.weight";
    size_t n = strlen(name), k = sizeof suf - 1;
    return n > k && !strcmp(name + n - k, suf);
}

/* The router skew's std multipliers of one router tensor (rows = experts):
 * a Fisher-Yates shuffle seeded from the tensor's seed ranks the experts,
 * and the expert of rank r gets 1 + skew / (1 + r). A larger std spreads
 * that expert's logits, so it lands in the top-k more often. */
static void router_gains(float *g, uint32_t *rank, uint32_t n_expert, uint64_t tensor_seed, float skew) {
    for (uint32_t e = 0; e < n_expert; e++) rank[e] = e;
    uint64_t s = tensor_seed ^ 0x5eed5ca1ab1e0001ull;
    for (uint32_t e = n_expert; e > 1; e--) {
        uint32_t k = (uint32_t)(splitmix64(&s) % e), t = rank[e - 1];
        rank[e - 1] = rank[k];
        rank[k] = t;
    }
    for (uint32_t e = 0; e < n_expert; e++) g[e] = 1.0f + skew / (float)(1u + rank[e]);
}

/* Draws, quantizes and writes one tensor, a slice of whole rows at a time. */
static int gen_tensor_data(kv_gguf_writer *w, kv_pool *pool, size_t idx, const gen_tensor *t,
                           uint64_t seed, float router_skew, const uint8_t *unused, float *fbuf,
                           size_t fcap, uint8_t *qbuf, kv_diag *d) {
    float *gains = NULL;
    if (router_skew > 0.0f && is_router(t->name)) {
        uint32_t *rank = malloc(t->ne[1] * sizeof *rank);
        if (!rank || !(gains = malloc(t->ne[1] * sizeof *gains))) {
            free(rank);
            return kv_fail(d, KV_ENOMEM, "out of memory for the router skew of %s", t->name);
        }
        router_gains(gains, rank, (uint32_t)t->ne[1], name_seed(seed, t->name), router_skew);
        free(rank);
    }
    gen_job j = {
        .t = t,
        .ti = kv_type_get_ref(t->type),
        .seed = name_seed(seed, t->name),
        .row_len = t->ne[0],
        .row_bytes = kv_type_row_size(t->type, t->ne[0]),
        .unused = unused,
        .row_gain = gains,
        .fbuf = fbuf,
        .qbuf = qbuf,
    };
    uint64_t rows = t->ne[1] * t->ne[2] * t->ne[3], per = fcap / j.row_len;
    for (j.r0 = 0; j.r0 < rows; j.r0 += per) {
        j.nr = rows - j.r0 < per ? rows - j.r0 : per;
        kv_pool_run(pool, gen_rows, &j);
        int rc = kv_gguf_writer_write_data(w, idx, j.r0 * j.row_bytes, qbuf, (size_t)(j.nr * j.row_bytes), d);
        if (rc) {
            free(gains);
            return rc;
        }
    }
    free(gains);
    return 0;
}

/* ---- model ------------------------------------------------------------ */

static uint32_t file_type_of(const kv_gen_config *c) {
    /* llama_ftype values (general.file_type) for an all-`type` model */
    if (c->mix) return kv_gen_mix_ftype(c->mix);
    if (c->q6_mix && c->type == KV_TYPE_Q4_K) return 15; /* Q4_K_M */
    switch (c->type) {
    case KV_TYPE_F32: return 0;
    case KV_TYPE_F16: return 1;
    case KV_TYPE_Q4_0: return 2;
    case KV_TYPE_Q4_1: return 3;
    case KV_TYPE_Q5_0: return 8;
    case KV_TYPE_Q5_1: return 9;
    case KV_TYPE_IQ4_NL: return 25;
    case KV_TYPE_MXFP4: return 38; /* MXFP4_MOE */
    case KV_TYPE_Q8_0: return 7;
    case KV_TYPE_Q4_K: return 14; /* Q4_K_S */
    case KV_TYPE_Q5_K: return 16; /* Q5_K_S */
    case KV_TYPE_Q6_K: return 18;
    case KV_TYPE_Q2_K: return 10;  /* Q2_K */
    case KV_TYPE_Q3_K: return 11;  /* Q3_K_S */
    case KV_TYPE_IQ4_XS: return 30;
    case KV_TYPE_BF16: return 32;
    default: return 0;
    }
}

/* The qwen35moe.* hyperparameters, keys as llama.cpp reads them. */
static int write_meta_q35(kv_gguf_writer *w, const kv_gen_config *c, kv_diag *d) {
    int rc;
#define TRY(x) \
    if ((rc = (x))) return rc
    TRY(kv_gguf_writer_set_u32(w, "qwen35moe.context_length", c->n_ctx, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen35moe.embedding_length", c->n_embd, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen35moe.block_count", c->n_layer + c->n_nextn, d));
    if (c->n_nextn) TRY(kv_gguf_writer_set_u32(w, "qwen35moe.nextn_predict_layers", c->n_nextn, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen35moe.expert_feed_forward_length", c->n_ff_exp, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen35moe.expert_shared_feed_forward_length", c->n_ff_shexp, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen35moe.expert_count", c->n_expert, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen35moe.expert_used_count", c->n_expert_used, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen35moe.attention.head_count", c->n_head, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen35moe.attention.head_count_kv", c->n_head_kv, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen35moe.attention.key_length", c->head_dim, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen35moe.attention.value_length", c->head_dim, d));
    TRY(kv_gguf_writer_set_f32(w, "qwen35moe.attention.layer_norm_rms_epsilon", GEN_RMS_EPS, d));
    TRY(kv_gguf_writer_set_f32(w, "qwen35moe.rope.freq_base", GEN_ROPE_BASE, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen35moe.rope.dimension_count", c->n_rot, d));
    TRY(kv_gguf_writer_set_arr(w, "qwen35moe.rope.dimension_sections", KV_GGUF_INT32, c->rope_sections, 4, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen35moe.ssm.conv_kernel", c->ssm_d_conv, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen35moe.ssm.state_size", c->ssm_d_state, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen35moe.ssm.group_count", c->ssm_n_group, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen35moe.ssm.time_step_rank", c->ssm_dt_rank, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen35moe.ssm.inner_size", c->ssm_d_state * c->ssm_dt_rank, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen35moe.full_attention_interval", c->full_attn_interval, d));
#undef TRY
    return 0;
}

int kv_gen_write_tokenizer(kv_gguf_writer *w, const kv_bpe_vocab *v, const char *pre, kv_diag *d) {
    int rc;
#define TRY(x) \
    if ((rc = (x))) return rc
    TRY(kv_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2", d));
    TRY(kv_gguf_writer_set_str(w, "tokenizer.ggml.pre", pre, d));
    kv_str *s = malloc((v->n_tokens > v->n_merges ? v->n_tokens : v->n_merges) * sizeof *s + 1);
    if (!s) return kv_fail(d, KV_ENOMEM, "out of memory for the vocabulary");
    for (size_t i = 0; i < v->n_tokens; i++) s[i] = (kv_str){v->tokens[i], strlen(v->tokens[i])};
    rc = kv_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", s, v->n_tokens, d);
    if (!rc) rc = kv_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", KV_GGUF_INT32, v->types,
                                         v->n_tokens, d);
    if (!rc) {
        for (size_t i = 0; i < v->n_merges; i++) s[i] = (kv_str){v->merges[i], strlen(v->merges[i])};
        rc = kv_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", s, v->n_merges, d);
    }
    free(s);
    if (rc) return rc;
    /* as in Qwen3 instruct files: generation ends at <|im_end|>;
     * <|endoftext|> is BOS and padding; no BOS is added */
    TRY(kv_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)v->im_end_id, d));
    TRY(kv_gguf_writer_set_u32(w, "tokenizer.ggml.padding_token_id", (uint32_t)v->eos_id, d));
    TRY(kv_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)v->eos_id, d));
    TRY(kv_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", false, d));
    TRY(kv_gguf_writer_set_str(w, "tokenizer.chat_template", kv_chatml_template, d));
#undef TRY
    return 0;
}

/* The deepseek2.* hyperparameters, keys as llama.cpp's deepseek2 loader
 * reads them (MLA with attn_k_b/attn_v_b: key_length is the cached row,
 * kv_lora_rank + n_rot; value_length the latent). */
static int write_meta_ds2(kv_gguf_writer *w, const kv_gen_config *c, kv_diag *d) {
    int rc;
#define TRY(x) \
    if ((rc = (x))) return rc
#define U32(k, v) TRY(kv_gguf_writer_set_u32(w, "deepseek2." k, (v), d))
    U32("context_length", c->n_ctx);
    U32("embedding_length", c->n_embd);
    U32("block_count", c->n_layer);
    U32("feed_forward_length", c->n_ff);
    U32("expert_feed_forward_length", c->n_ff_exp);
    U32("expert_count", c->n_expert);
    U32("expert_used_count", c->n_expert_used);
    U32("expert_shared_count", c->n_expert_shared);
    U32("leading_dense_block_count", c->n_dense_lead);
    U32("expert_gating_func", 2); /* sigmoid */
    TRY(kv_gguf_writer_set_bool(w, "deepseek2.expert_weights_norm", true, d));
    TRY(kv_gguf_writer_set_f32(w, "deepseek2.expert_weights_scale", c->expert_weights_scale, d));
    if (c->n_expert_groups > 1) {
        U32("expert_group_count", c->n_expert_groups);
        U32("expert_group_used_count", c->n_group_used);
    }
    U32("attention.head_count", c->n_head);
    U32("attention.head_count_kv", 1);
    U32("attention.key_length", c->kv_lora_rank + c->n_rot);
    U32("attention.value_length", c->kv_lora_rank);
    U32("attention.key_length_mla", c->head_dim);
    U32("attention.value_length_mla", c->head_dim_v);
    U32("attention.q_lora_rank", c->q_lora_rank);
    U32("attention.kv_lora_rank", c->kv_lora_rank);
    U32("rope.dimension_count", c->n_rot);
    TRY(kv_gguf_writer_set_f32(w, "deepseek2.attention.layer_norm_rms_epsilon", GEN_RMS_EPS, d));
    TRY(kv_gguf_writer_set_f32(w, "deepseek2.rope.freq_base", 10000.0f, d));
    if (c->yarn_factor > 0.0f) {
        TRY(kv_gguf_writer_set_str(w, "deepseek2.rope.scaling.type", "yarn", d));
        TRY(kv_gguf_writer_set_f32(w, "deepseek2.rope.scaling.factor", c->yarn_factor, d));
        U32("rope.scaling.original_context_length", c->yarn_orig_ctx);
        TRY(kv_gguf_writer_set_f32(w, "deepseek2.rope.scaling.yarn_log_multiplier", 0.1f, d)); /* 0.1 * mscale_all_dim */
    }
#undef U32
#undef TRY
    return 0;
}

/* The gpt-oss.* hyperparameters, keys as llama.cpp's openai-moe loader
 * reads them (YaRN when --yarn-factor is given). */
static int write_meta_gptoss(kv_gguf_writer *w, const kv_gen_config *c, kv_diag *d) {
    int rc;
#define TRY(x) \
    if ((rc = (x))) return rc
#define U32(k, v) TRY(kv_gguf_writer_set_u32(w, "gpt-oss." k, (v), d))
    U32("context_length", c->n_ctx);
    U32("embedding_length", c->n_embd);
    U32("block_count", c->n_layer);
    U32("feed_forward_length", c->n_ff_exp);
    U32("expert_feed_forward_length", c->n_ff_exp);
    U32("expert_count", c->n_expert);
    U32("expert_used_count", c->n_expert_used);
    U32("attention.head_count", c->n_head);
    U32("attention.head_count_kv", c->n_head_kv);
    U32("attention.key_length", c->head_dim);
    U32("attention.value_length", c->head_dim);
    U32("attention.sliding_window", c->n_swa);
    if (c->swa_pattern != 2) U32("attention.sliding_window_pattern", c->swa_pattern);
    TRY(kv_gguf_writer_set_f32(w, "gpt-oss.attention.layer_norm_rms_epsilon", GEN_RMS_EPS, d));
    TRY(kv_gguf_writer_set_f32(w, "gpt-oss.rope.freq_base", GEN_ROPE_BASE, d));
    if (c->yarn_factor > 0.0f) {
        TRY(kv_gguf_writer_set_str(w, "gpt-oss.rope.scaling.type", "yarn", d));
        TRY(kv_gguf_writer_set_f32(w, "gpt-oss.rope.scaling.factor", c->yarn_factor, d));
        U32("rope.scaling.original_context_length", c->yarn_orig_ctx);
    }
#undef U32
#undef TRY
    return 0;
}

static int write_meta(kv_gguf_writer *w, const kv_gen_config *c, const kv_bpe_vocab *v, kv_diag *d) {
    int rc;
#define TRY(x) \
    if ((rc = (x))) return rc
    if (is_q35(c)) {
        TRY(kv_gguf_writer_set_str(w, "general.architecture", "qwen35moe", d));
        TRY(kv_gguf_writer_set_str(w, "general.name", c->name ? c->name : "kvasir-synthetic", d));
        TRY(kv_gguf_writer_set_u32(w, "general.file_type", file_type_of(c), d));
        TRY(kv_gguf_writer_set_u32(w, "general.quantization_version", 2, d));
        TRY(write_meta_q35(w, c, d));
        goto vocab;
    }
    if (is_ds2(c)) {
        TRY(kv_gguf_writer_set_str(w, "general.architecture", "deepseek2", d));
        TRY(kv_gguf_writer_set_str(w, "general.name", c->name ? c->name : "kvasir-synthetic", d));
        TRY(kv_gguf_writer_set_u32(w, "general.file_type", file_type_of(c), d));
        TRY(kv_gguf_writer_set_u32(w, "general.quantization_version", 2, d));
        TRY(write_meta_ds2(w, c, d));
        goto vocab;
    }
    if (is_gptoss(c)) {
        TRY(kv_gguf_writer_set_str(w, "general.architecture", "gpt-oss", d));
        TRY(kv_gguf_writer_set_str(w, "general.name", c->name ? c->name : "kvasir-synthetic", d));
        TRY(kv_gguf_writer_set_u32(w, "general.file_type", file_type_of(c), d));
        TRY(kv_gguf_writer_set_u32(w, "general.quantization_version", 2, d));
        TRY(write_meta_gptoss(w, c, d));
        goto vocab;
    }
    TRY(kv_gguf_writer_set_str(w, "general.architecture", "qwen3moe", d));
    TRY(kv_gguf_writer_set_str(w, "general.name", c->name ? c->name : "kvasir-synthetic", d));
    TRY(kv_gguf_writer_set_u32(w, "general.file_type", file_type_of(c), d));
    TRY(kv_gguf_writer_set_u32(w, "general.quantization_version", 2, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen3moe.context_length", c->n_ctx, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen3moe.embedding_length", c->n_embd, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen3moe.block_count", c->n_layer, d));
    /* dense FFN size of the HF config (unused by the MoE graph): k * n_ff_exp,
     * which is what Qwen3-30B-A3B has (6144 = 8 * 768) */
    TRY(kv_gguf_writer_set_u32(w, "qwen3moe.feed_forward_length", c->n_ff_exp * c->n_expert_used, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen3moe.expert_feed_forward_length", c->n_ff_exp, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen3moe.expert_count", c->n_expert, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen3moe.expert_used_count", c->n_expert_used, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen3moe.attention.head_count", c->n_head, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen3moe.attention.head_count_kv", c->n_head_kv, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen3moe.attention.key_length", c->head_dim, d));
    TRY(kv_gguf_writer_set_u32(w, "qwen3moe.attention.value_length", c->head_dim, d));
    TRY(kv_gguf_writer_set_f32(w, "qwen3moe.attention.layer_norm_rms_epsilon", GEN_RMS_EPS, d));
    TRY(kv_gguf_writer_set_f32(w, "qwen3moe.rope.freq_base", GEN_ROPE_BASE, d));

vocab:
    TRY(kv_gen_write_tokenizer(w, v, is_q35(c) ? "qwen35" : "qwen2", d));
#undef TRY
    return 0;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

int kv_gen_model(const kv_gen_config *c, const char *path, kv_diag *d) {
    int rc = kv_gen_validate(c, d);
    if (rc) return rc;
    gen_list l;
    if (build_list(c, &l)) return kv_fail(d, KV_ENOMEM, "out of memory");

    kv_bpe_vocab voc;
    memset(&voc, 0, sizeof voc);
    kv_gguf_writer *w = NULL;
    kv_pool *pool = NULL;
    uint8_t *unused = NULL;
    float *fbuf = NULL;
    uint8_t *qbuf = NULL;
    char *part = NULL;
    int part_made = 0;
    FILE *log = c->log;
    int verbose = log && l.bytes > GEN_LOG_BYTES;
    double t0 = now_s();

    /* notes about type fallbacks, once per tensor kind */
    if (log)
        for (size_t i = 0; i < l.n; i++) {
            const gen_tensor *t = &l.t[i];
            if (t->type == t->want) continue;
            if (strncmp(t->name, "blk.", 4) == 0 && strncmp(t->name, "blk.0.", 6) != 0) continue;
            fprintf(log,
                    "gen-model: note: %s%s has rows of %" PRIu64 ", not a multiple of the %s block "
                    "(%u); writing it as %s\n",
                    t->name, strncmp(t->name, "blk.0.", 6) == 0 ? " (and every layer's)" : "", t->ne[0],
                    kv_type_get_ref(t->want)->name, kv_type_get_ref(t->want)->blck,
                    kv_type_get_ref(t->type)->name);
        }

    if (verbose) fprintf(log, "gen-model: training a %" PRIu32 "-token BPE vocabulary\n", c->n_vocab);
    size_t corpus_len = 0;
    const char *corpus = kv_bpe_default_corpus(&corpus_len);
    rc = kv_bpe_train(corpus, corpus_len, is_q35(c) ? "qwen35" : "qwen2", c->n_vocab, &voc, d);
    if (rc) {
        kv_diag_prefix(d, rc, "vocabulary");
        goto out;
    }
    if (voc.n_tokens != c->n_vocab || voc.eos_id < 0 || voc.im_end_id < 0 ||
        (uint64_t)voc.eos_id >= voc.n_tokens || (uint64_t)voc.im_end_id >= voc.n_tokens) {
        rc = kv_fail(d, KV_EINTERNAL, "vocabulary: trainer returned %zu tokens for %" PRIu32 " (eos %d, im_end %d)",
                     voc.n_tokens, c->n_vocab, voc.eos_id, voc.im_end_id);
        goto out;
    }

    if ((rc = kv_gguf_writer_new(&w, d))) goto out;
    if ((rc = write_meta(w, c, &voc, d))) goto out;
    for (size_t i = 0; i < l.n; i++) {
        size_t idx;
        rc = kv_gguf_writer_add_tensor(w, l.t[i].name, l.t[i].n_dims, l.t[i].ne, l.t[i].type, &idx, d);
        if (rc) goto out;
    }
    /* which rows of token_embd/output are padding tokens; the rest of the
     * vocabulary now lives in the writer */
    unused = calloc(voc.n_tokens, 1);
    if (!unused) {
        rc = kv_fail(d, KV_ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < voc.n_tokens; i++) unused[i] = voc.types[i] == KV_TOK_UNUSED;
    kv_bpe_vocab_free(&voc);

    size_t plen = strlen(path);
    part = malloc(plen + 6);
    if (!part) {
        rc = kv_fail(d, KV_ENOMEM, "out of memory");
        goto out;
    }
    memcpy(part, path, plen);
    memcpy(part + plen, ".part", 6);
    if ((rc = kv_gguf_writer_begin(w, part, d))) goto out;
    part_made = 1;

    size_t fcap = GEN_CHUNK;
    for (size_t i = 0; i < l.n; i++)
        if (l.t[i].ne[0] > fcap) fcap = (size_t)l.t[i].ne[0];
    fbuf = malloc(fcap * sizeof *fbuf);
    qbuf = malloc(fcap * sizeof(float)); /* no type is wider than f32 */
    if (!fbuf || !qbuf) {
        rc = kv_fail(d, KV_ENOMEM, "out of memory for %zu-element buffers", fcap);
        goto out;
    }
    if ((rc = kv_pool_new(&pool, c->n_threads, d))) goto out;
    uint64_t done = 0;
    double last = now_s();
    for (size_t i = 0; i < l.n; i++) {
        if ((rc = gen_tensor_data(w, pool, i, &l.t[i], c->seed, c->router_skew, unused, fbuf, fcap, qbuf, d))) goto out;
        done += l.t[i].nbytes;
        double t = now_s();
        if (verbose && (t - last >= 2.0 || i + 1 == l.n)) {
            fprintf(log, "gen-model: %5.1f%%  %.2f / %.2f GB  (%s)\n", 100.0 * (double)done / (double)l.bytes,
                    (double)done / 1e9, (double)l.bytes / 1e9, l.t[i].name);
            last = t;
        }
    }
    if ((rc = kv_gguf_writer_finish(w, d))) goto out;
    if (rename(part, path) != 0) {
        rc = kv_fail(d, KV_EIO, "cannot rename %s to %s: %s", part, path, strerror(errno));
        goto out;
    }
    part_made = 0;
    if (verbose) fprintf(log, "gen-model: wrote %s in %.1f s\n", path, now_s() - t0);

out:
    if (rc && part_made) unlink(part);
    free(part);
    free(unused);
    free(fbuf);
    free(qbuf);
    kv_gguf_writer_free(w);
    kv_pool_free(pool);
    kv_bpe_vocab_free(&voc);
    free(l.t);
    return rc;
}
