/* Synthetic model generator (`kvasir gen-model`).
 *
 * Writes a GGUF model of a supported architecture (qwen3moe, qwen35moe)
 * with the metadata llama.cpp expects and the tensor names/shapes of the
 * architecture's table (arch.h), a real byte-level BPE
 * vocabulary trained on the bundled corpus (kv_bpe_train), and deterministic
 * pseudo-random weights of sane scale: activations stay O(1) through the
 * layers and logits spread over a few units, so greedy decoding is not
 * degenerate and top logits rarely tie.
 *
 * Determinism: the weights of a tensor depend only on (seed, tensor name,
 * row), not on the thread count, and are drawn with integer-only arithmetic plus single IEEE float
 * multiplies/adds, then quantized with the scalar reference quantizer, so a
 * given configuration produces the same bytes on every machine and build.
 * The underlying float weights do not depend on --type: an f32 and a q8_0
 * model of the same seed hold the same weights before rounding.
 *
 * Memory: tensor data is generated and written in slices of whole rows
 * (a few MB), so a multi-GB model needs only a few MB of RAM besides the
 * vocabulary. */
#ifndef KVASIR_GEN_H
#define KVASIR_GEN_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "kvasir/err.h"
#include "kvasir/gguf.h"
#include "kvasir/tok.h"

/* Bounds on every size a configuration may ask for. */
#define KV_GEN_MAX_LAYER 512u         /* llama.cpp's LLAMA_MAX_LAYERS */
#define KV_GEN_MAX_EMBD 65536u
#define KV_GEN_MAX_FF 131072u
#define KV_GEN_MAX_EXPERT 1024u       /* llama.cpp's LLAMA_MAX_EXPERTS */
#define KV_GEN_MAX_HEAD 1024u
#define KV_GEN_MAX_HEAD_DIM 1024u
#define KV_GEN_MIN_VOCAB 259u         /* 256 byte tokens + 3 special tokens */
#define KV_GEN_MAX_CTX (1u << 20)
#define KV_GEN_MAX_ROUTER_SKEW 16.0f
#define KV_GEN_MAX_BYTES (256ull << 30) /* refuse to write models over 256 GiB */

typedef struct kv_gen_config {
    const char *arch;       /* "qwen3moe", "qwen35moe" or "deepseek2" */
    const char *name;       /* general.name; NULL: "kvasir-synthetic" */
    uint32_t n_layer;       /* blocks */
    uint32_t n_embd;        /* hidden size */
    uint32_t n_ff_exp;      /* hidden size of one routed expert */
    uint32_t n_expert;      /* routed experts per layer */
    uint32_t n_expert_used; /* experts chosen per token (top-k) */
    uint32_t n_head;        /* query heads */
    uint32_t n_head_kv;     /* key/value heads; divides n_head */
    uint32_t head_dim;      /* per head, even (NeoX RoPE rotates pairs) */
    uint32_t n_vocab;       /* tokens, >= KV_GEN_MIN_VOCAB */
    uint32_t n_ctx;         /* context_length written to the file */
    uint32_t type;          /* kv_type of the matrices (embedding, output,
                               attention, experts); norms and router stay F32 */
    bool q6_mix;            /* with type Q4_K: the mix of llama.cpp's Q4_K_M, i.e.
                               ffn_down* (routed and shared), attn_v and output
                               in Q6_K, the other matrices Q4_K */
    uint32_t mix;           /* kv_gen_mix: llama-quantize's recipe for the
                               matrices (overrides type and q6_mix); 0: none */
    uint64_t seed;          /* weights PRNG seed */
    float router_skew;      /* 0: every expert alike; S > 0: in each layer's router the
                               row of the expert of rank r (a seeded shuffle per layer)
                               has its std scaled by 1 + S / (1 + r), so a few experts
                               win top-k far more often than the rest, as in real
                               routers; bounded by KV_GEN_MAX_ROUTER_SKEW */
    bool tied;              /* true: no output.weight (LM head = token_embd) */
    int n_threads;          /* threads drawing/quantizing; 0: all CPUs (the
                               bytes written do not depend on it) */
    FILE *log;              /* progress and fallback notes; NULL: silent */
    /* qwen35moe only (ignored for qwen3moe); 0 = kv_gen_fill_defaults' value */
    uint32_t n_ff_shexp;    /* shared expert hidden size (default n_ff_exp) */
    uint32_t full_attn_interval; /* every k-th block is full attention (default 4) */
    uint32_t ssm_d_conv;    /* conv kernel (default 4) */
    uint32_t ssm_d_state;   /* delta-net head dim (default head_dim) */
    uint32_t ssm_n_group;   /* delta-net key heads (default 2) */
    uint32_t ssm_dt_rank;   /* delta-net value heads, a multiple of ssm_n_group (default 4) */
    uint32_t n_rot;         /* rotary dims, even, <= head_dim (default head_dim / 4) */
    int32_t rope_sections[4]; /* pairs per section; all 0: n_rot/2 split t, h, w as Qwen3.5 */
    uint32_t n_nextn;       /* MTP blocks after the trunk (not defaulted: 0 = none) */
    /* deepseek2 only (head_dim is key_length_mla = qk_nope + n_rot, n_rot the rope
     * part, n_head_kv ignored: MLA has one latent KV head); 0 = kv_gen_fill_defaults' value */
    uint32_t q_lora_rank;   /* default 2 * n_embd / 3, even */
    uint32_t kv_lora_rank;  /* the cached latent (default n_embd / 4) */
    uint32_t head_dim_v;    /* value_length_mla (default head_dim - n_rot) */
    uint32_t n_ff;          /* the leading blocks' dense FFN (default 4 * n_ff_exp) */
    uint32_t n_dense_lead;  /* leading dense blocks (not defaulted: 0 = none) */
    uint32_t n_expert_shared; /* shared experts of n_ff_exp (default 1) */
    uint32_t n_expert_groups; /* expert groups, 0/1: none (not defaulted) */
    uint32_t n_group_used;  /* groups chosen from (default n_expert_groups / 2 when grouped) */
    float expert_weights_scale; /* routed scaling factor (default 2.5, DeepSeek-V3's) */
    float yarn_factor;      /* YaRN rope.scaling.factor, 0: no scaling (not defaulted) */
    uint32_t yarn_orig_ctx; /* its original_context_length (default n_ctx / 4) */
} kv_gen_config;

/* Fills the zero qwen35moe-only fields of a qwen35moe config with the
 * defaults above (no-op for other architectures). */
void kv_gen_fill_defaults(kv_gen_config *cfg);

typedef struct kv_gen_preset {
    const char *name;    /* "tiny", ... */
    const char *summary; /* one line for --help */
    kv_gen_config cfg;   /* arch, sizes, type, seed, tied; name/log NULL, threads 0 */
} kv_gen_preset;

/* The built-in presets (static storage); *n gets their count. The first is
 * the default. */
const kv_gen_preset *kv_gen_presets(size_t *n);

/* Fills *cfg with the preset's values. KV_ENOTFOUND (listing the presets in
 * the message) if there is no preset of that name. */
int kv_gen_preset_get(const char *name, kv_gen_config *cfg, kv_diag *d);

/* Checks every field against the bounds above and the architecture's rules
 * (n_head % n_head_kv == 0, n_expert_used <= n_expert, even head_dim, a
 * type we can quantize to, total size <= KV_GEN_MAX_BYTES). Returns 0,
 * KV_EINVAL naming the field, or KV_EUNSUPPORTED for an unknown
 * architecture/type. */
int kv_gen_validate(const kv_gen_config *cfg, kv_diag *d);

/* Storage type for a matrix whose rows hold row_len elements when `want` was
 * asked for: `want` if row_len is a multiple of its block size, else the
 * fallback (K-quants -> Q8_0, then F16 if the row is not a multiple of 32 -
 * the same shape of rule as llama.cpp's quantizer, restricted to types
 * Kvasir computes with). */
uint32_t kv_gen_matrix_type(uint32_t want, uint64_t row_len);

/* llama-quantize's tensor-type recipes ("mixes") of the file types people
 * download, as llama-quant.cpp assigns them (gen_mix.c). */
typedef enum kv_gen_mix {
    KV_GEN_MIX_NONE = 0,
    KV_GEN_MIX_Q2_K,   /* LLAMA_FTYPE_MOSTLY_Q2_K (10) */
    KV_GEN_MIX_Q3_K_M, /* LLAMA_FTYPE_MOSTLY_Q3_K_M (12) */
    KV_GEN_MIX_Q4_K_M, /* LLAMA_FTYPE_MOSTLY_Q4_K_M (15) */
    KV_GEN_MIX_IQ4_XS, /* LLAMA_FTYPE_MOSTLY_IQ4_XS (30) */
    KV_GEN_MIX_COUNT
} kv_gen_mix;

/* What the recipe needs to know of the model and of a tensor's place. */
typedef struct kv_gen_mix_ctx {
    int i_wv, n_wv;     /* rank of this tensor among the attn_v-like ones (attn_v,
                           attn_qkv, attn_kv_b) in file order, and their count */
    int n_layer_all;    /* blocks, MTP blocks included */
    uint32_t n_expert;  /* routed experts (llama.cpp treats 8 specially) */
    uint32_t n_gqa;     /* n_head / n_head_kv */
    bool tied;          /* no output.weight: token_embd is the LM head */
} kv_gen_mix_ctx;

/* The mix's name ("q2_k", "q3_k_m", "q4_k_m", "iq4_xs") -> id; -1 unknown. */
int kv_gen_mix_from_name(const char *name);
const char *kv_gen_mix_name(uint32_t mix); /* NULL for none/unknown */
uint32_t kv_gen_mix_ftype(uint32_t mix);   /* general.file_type (llama_ftype) */
/* The type the recipe gives a quantizable matrix `name` (2+ dims, rows of
 * ne0): llama-quant.cpp's rule for these file types, then its fallback for
 * rows that do not fit the block (Q2_K, Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K ->
 * Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL, then F16), then, where Kvasir
 * cannot write that type, Q8_0 (or F16 if the row is not a multiple of 32). */
uint32_t kv_gen_mix_type(uint32_t mix, const char *name, uint64_t ne0, const kv_gen_mix_ctx *ctx);

/* Bytes the model file will have (header excluded), or 0 if cfg is invalid
 * or the size overflows. */
uint64_t kv_gen_data_bytes(const kv_gen_config *cfg);

/* Validates cfg, trains the vocabulary and writes the model to path (via
 * "<path>.part", renamed on success; on failure path is left untouched and
 * the partial file removed).
 * Returns 0 or a negative KV_E* code with d naming the problem. Not
 * thread-safe with respect to cfg->log. */
int kv_gen_model(const kv_gen_config *cfg, const char *path, kv_diag *d);

/* Writes the tokenizer.* metadata of a trained vocabulary as Qwen files carry
 * it: model "gpt2", pre-tokenizer `pre` ("qwen2" or "qwen35"), tokens, token
 * types, merges, <|im_end|> as EOS, <|endoftext|> as BOS and padding, no BOS
 * added, and a ChatML chat template. Used by gen-model and the skeletons. */
int kv_gen_write_tokenizer(kv_gguf_writer *w, const kv_bpe_vocab *v, const char *pre, kv_diag *d);

#endif
