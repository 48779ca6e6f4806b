/* Model anatomy: what the bytes of a GGUF file are, read from its header
 * alone, plus "skeleton" models (the header of a real model at true scale,
 * tensor data left as holes).
 *
 * Every tensor is put in one class from its name and shape only, so files of
 * architectures Kvasir cannot run are still measured; names we do not know go
 * to KV_ANAT_OTHER. When the file's architecture has a table (arch.h), the
 * tensors it names take their class from the table's role (test_arch checks
 * the two agree); the rules (first match wins) classify the rest:
 *   blk.N.nextn.*, nextn.*                       -> MTP (multi-token prediction)
 *   blk.N.ssm_*, time_mix_*, shortconv.*         -> linear attention
 *   blk.N.attn_qkv/attn_gate in a layer holding
 *     ssm_* tensors (gated delta net projections)-> linear attention
 *   *_exps.* (expert index outermost)            -> routed experts
 *   *_shexp.*, *_chexp.* (incl. the shared gate) -> shared experts
 *   ffn_gate_inp.*, exp_probs_b.*                -> router
 *   *norm* (any norm weight)                     -> norms
 *   attn_*                                       -> attention
 *   ffn_* (a dense FFN block)                    -> dense FFN
 *   token_embd, per_layer_token_embd, pos/types  -> embeddings
 *   output.weight                                -> LM head
 *   anything else                                -> other
 * The MTP block's attention, experts and norms keep their own classes (its
 * experts are expert slabs like any layer's); only the nextn.* glue tensors
 * are "MTP".
 *
 * An expert slab is one routed expert of one layer: the slice [e] of every
 * *_exps tensor of that layer (outermost dimension = expert index). Its bytes
 * are the sum over those tensors of nbytes / n_expert.
 *
 * Nothing here reads tensor data: a 70 GB file or a sparse skeleton is
 * measured in the time it takes to parse its header. */
#ifndef KVASIR_ANATOMY_H
#define KVASIR_ANATOMY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvasir/err.h"
#include "kvasir/gguf.h"

enum kv_anat_class {
    KV_ANAT_ROUTED_EXPERTS = 0,
    KV_ANAT_SHARED_EXPERTS,
    KV_ANAT_ATTENTION,
    KV_ANAT_LINEAR_ATTENTION,
    KV_ANAT_ROUTER,
    KV_ANAT_DENSE_FFN,
    KV_ANAT_NORMS,
    KV_ANAT_EMBEDDINGS,
    KV_ANAT_LM_HEAD,
    KV_ANAT_MTP,
    KV_ANAT_OTHER,
    KV_ANAT_CLASS_COUNT
};

/* Layer kind flags (kv_anat_layer.kind). */
#define KV_ANAT_LAYER_ATTN 1u    /* holds full-attention tensors */
#define KV_ANAT_LAYER_LINEAR 2u  /* holds linear-attention (ssm_*) tensors */
#define KV_ANAT_LAYER_MOE 4u     /* holds routed experts */
#define KV_ANAT_LAYER_DENSE 8u   /* holds a dense FFN */
#define KV_ANAT_LAYER_MTP 16u    /* an MTP/nextn block */

#define KV_ANAT_MAX_LAYERS 4096u   /* block numbers accepted (llama.cpp allows 512) */
#define KV_ANAT_COMBO_LEN 96u      /* bytes of a type-combination label */

/* One block (blk.N). */
typedef struct kv_anat_layer {
    uint32_t index;                          /* N of blk.N */
    uint32_t kind;                           /* KV_ANAT_LAYER_* flags */
    uint32_t n_tensors;                      /* tensors in this block */
    uint64_t bytes[KV_ANAT_CLASS_COUNT];     /* bytes per class */
    uint64_t total;                          /* bytes of all its tensors */
    uint32_t n_expert;                       /* routed experts (outermost dim of *_exps), 0 if none */
    bool expert_mismatch;                    /* *_exps tensors disagree on n_expert */
    uint64_t expert_bytes;                   /* bytes of one expert slab of this layer */
    char expert_types[KV_ANAT_COMBO_LEN];    /* "gate q4_K, up q4_K, down q6_K" */
} kv_anat_layer;

/* Bytes held in one tensor type. */
typedef struct kv_anat_type {
    uint32_t type;      /* ggml type id */
    uint64_t n_tensors; /* tensors of this type */
    uint64_t bytes;     /* their data bytes */
} kv_anat_type;

/* Expert slabs sharing one type combination and size. */
typedef struct kv_anat_combo {
    char types[KV_ANAT_COMBO_LEN]; /* as kv_anat_layer.expert_types */
    uint64_t expert_bytes;         /* bytes of one slab */
    uint32_t n_layers;             /* layers with this combination */
    uint64_t n_slabs;              /* slabs (sum of those layers' n_expert) */
} kv_anat_combo;

/* One file of a split model. */
typedef struct kv_anat_part {
    uint64_t file_size;  /* bytes of the file */
    uint64_t n_tensors;  /* tensors it holds */
    uint64_t tensor_bytes; /* their data bytes */
} kv_anat_part;

typedef struct kv_anatomy {
    char arch[64];                        /* general.architecture, "" if absent */
    char name[128];                       /* general.name, "" if absent */
    uint64_t file_size;                   /* bytes of the file (of all parts of a split model) */
    uint64_t data_offset;                 /* header bytes (start of tensor data; summed over parts) */
    kv_anat_part *parts;                  /* [n_parts] when n_parts > 1 (a split model), else NULL */
    size_t n_parts;                       /* files: 1, or the parts of a split model */
    uint64_t n_uncomputable;              /* tensors of a type kvasir computes with no backend */
    char uncomputable[64];                /* the first of them, "" if none */
    uint32_t uncomputable_type;           /* its type id */
    uint64_t tensor_bytes;                /* sum of every tensor's nbytes */
    size_t n_tensors;
    uint64_t class_bytes[KV_ANAT_CLASS_COUNT];   /* bytes per class */
    uint64_t class_tensors[KV_ANAT_CLASS_COUNT]; /* tensors per class */
    uint32_t block_count;                 /* <arch>.block_count, 0 if absent */
    uint32_t nextn_layers;                /* <arch>.nextn_predict_layers, 0 if absent */
    kv_anat_layer *layers;                /* [n_layers], blocks present, by index */
    size_t n_layers;
    /* expert slabs */
    uint32_t n_moe_layers;                /* layers holding routed experts */
    uint64_t n_slabs;                     /* sum of n_expert over those layers */
    uint64_t expert_min, expert_max;      /* bytes of the smallest/largest slab */
    double expert_mean;                   /* mean bytes per slab */
    kv_anat_combo *combos;                /* [n_combos], by descending slab count */
    size_t n_combos;
    kv_anat_type *types;                  /* [n_types], by descending bytes */
    size_t n_types;
} kv_anatomy;

/* Stable lower-case identifier of a class ("routed_experts", ...) and a
 * human label ("routed experts"); "?" for an unknown value. */
const char *kv_anat_class_id(int cls);
const char *kv_anat_class_label(int cls);

/* Class of a tensor from its name alone (the rules above). `recurrent` says
 * whether the tensor's block holds ssm_* tensors (it decides attn_qkv and
 * attn_gate). Writes the block number to *layer (-1 if none; may be NULL). */
int kv_anat_classify(const char *name, size_t len, bool recurrent, int32_t *layer);

/* Measures an open file from its header. On success *out is a new anatomy
 * the caller frees with kv_anatomy_free. Reads no tensor data. Errors:
 * KV_EFORMAT (a block number beyond KV_ANAT_MAX_LAYERS), KV_ENOMEM. */
int kv_anatomy_from_gguf(kv_anatomy **out, const kv_gguf *g, kv_diag *d);

/* Opens path (kv_gguf_open), measures it, closes it. Errors as
 * kv_gguf_open's (a non-GGUF or truncated file gives KV_EFORMAT with a
 * one-line message naming the file) and kv_anatomy_from_gguf's. */
int kv_anatomy_open(kv_anatomy **out, const char *path, kv_diag *d);

void kv_anatomy_free(kv_anatomy *a); /* accepts NULL */

/* The anatomy as a JSON document (malloc'd, NUL-terminated, caller frees),
 * or NULL on out-of-memory. Shape documented in docs/ANATOMY.md. */
char *kv_anatomy_to_json(const kv_anatomy *a);

/* Human-readable report (summary, classes, expert slabs, types, per-layer
 * table). */
void kv_anatomy_print(const kv_anatomy *a, FILE *f);

/* ---- skeletons --------------------------------------------------------
 * The header of a real model exactly as llama.cpp's converter and its
 * Q4_K_M quantizer lay it out (metadata, tokenizer arrays of the real
 * vocabulary size, every tensor with its real name, shape and type), tensor
 * data left as holes: a file of the real size that takes a few MB of disk. */

typedef struct kv_skeleton_preset {
    const char *name;    /* "qwen35-122b-a10b", ... */
    const char *summary; /* one line for --help */
} kv_skeleton_preset;

/* The skeleton presets (static storage); *n gets their count. */
const kv_skeleton_preset *kv_skeleton_presets(size_t *n);
bool kv_skeleton_has(const char *name);

/* Writes the skeleton of preset `name` to path (via "<path>.part", renamed on
 * success). log (may be NULL) gets progress notes. The small tensors carry
 * real seeded values (token embeddings of the tokens the vocabulary has,
 * norms, routers: a few MB), so routing spreads over the experts as in a
 * real model; experts and projections stay holes that read as zeros.
 * Errors: KV_ENOTFOUND (no such preset, listing them), KV_EIO, KV_ENOMEM. */
int kv_skeleton_write(const char *name, const char *path, FILE *log, kv_diag *d);
/* The same; real = false leaves every tensor a hole (header only). */
int kv_skeleton_write_ex(const char *name, const char *path, bool real, FILE *log, kv_diag *d);

/* The type llama.cpp's Q4_K_M quantizer gives a tensor (llama-quant.cpp),
 * for tests and docs: `src_type` is its type in the converted (f16/bf16)
 * file, `i_wv`/`n_wv` its rank among the attn_v/attn_qkv tensors and their
 * count, `n_layer_all` the block count including MTP blocks, `tied` whether
 * the file lacks output.weight. */
uint32_t kv_skeleton_q4_k_m_type(const char *name, uint32_t n_dims, const uint64_t *ne,
                                 uint32_t src_type, int i_wv, int n_wv, int n_layer_all,
                                 bool tied);

#endif
