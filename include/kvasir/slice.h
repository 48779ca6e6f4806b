/* Slices: a model cut into a backbone and expert slabs, a manifest that
 * names and hashes every piece, and running from those pieces.
 *
 * Folder layout written by kv_slice_model:
 *   DIR/backbone.gguf            every tensor but the routed experts, all the
 *                                source metadata plus kvasir.* keys
 *   DIR/experts/blk.L.F-T.gguf   one slab: layer L's experts [F, T] as the
 *                                3-D tensors blk.L.ffn_{gate,up,down}_exps
 *                                (same names and types, ne[2] = T-F+1)
 *   DIR/manifest.json            model identity, architecture, hparams, and
 *                                size + SHA-256 of every file
 * Every tensor's data is the source's byte range, copied verbatim.
 *
 * Model identity (kvasir.source.id, manifest model.id), in hex:
 *   id   = SHA-256( "kvasir-model-id-v2" NUL || SHA-256(header)
 *                   || u64le(D) || leaf_0 || leaf_1 || ... )
 *   leaf_i = SHA-256(data[i*2^20, min((i+1)*2^20, D)))
 * where header is the file's bytes [0, data offset) (all metadata, tensor
 * names, shapes, types and offsets) and data is the D bytes from the data
 * offset to the end of the last tensor (padding included, trailing bytes
 * not). So two models that differ in any weight byte, or any header byte,
 * differ. It is cheap to get: the leaves hash in parallel (the slicer does
 * it before writing, since every piece's header carries the id), and a
 * leaf wholly inside a hole (SEEK_DATA) is the constant hash of 2^20 zero
 * bytes, not read, so a skeleton's identity costs time proportional to its
 * data, not its size, and equals that of the same bytes written densely.
 * kv_pieces_model_id (pieces.h) computes it; the pieces are then bound to
 * it by their SHA-256 in the manifest.
 *
 * A split model (gguf.h: N files, one model) has the identity of its parts
 * taken in order:
 *   id   = SHA-256( "kvasir-model-id-split-v1" NUL || u32le(N)
 *                   || id_1 || ... || id_N )
 * where id_k is part k's identity as above, as 64 hex digits. Which part
 * a command was given does not matter; a re-split of the same model (other
 * cuts) is another identity, as any header change is. Its pieces are sliced
 * as from one file: the backbone takes the first part's metadata without
 * the split.* keys.
 *
 * Slab metadata (all slabs): general.architecture, general.name (if the
 * source has one), general.alignment (if the source has one), and
 *   kvasir.slice.version u32   KV_SLICE_VERSION
 *   kvasir.source.id     str   model identity (64 hex digits)
 *   kvasir.slab.layer    u32   block index
 *   kvasir.slab.first    u32   first expert held
 *   kvasir.slab.last     u32   last expert held (inclusive)
 *   kvasir.slab.n_expert u32   routed experts in the layer (in the source)
 * The backbone carries kvasir.slice.version and kvasir.source.id too.
 *
 * Multi-token prediction (qwen35moe): a file with nextn_predict_layers = K
 * stores K MTP blocks after the trunk, as blocks n_layer-K .. n_layer-1 of
 * block_count = n_layer. An MTP block has routed experts like any other
 * block, and they are sliced like any other: into slabs, never into the
 * backbone, so the backbone is the model minus every routed expert and the
 * pieces together are the whole file. The manifest's n_layer counts every
 * block (block_count) and hparams.n_layer_nextn says how many of the last
 * are MTP (absent or 0 for models without them). The forward pass runs only
 * the trunk, so running (kv_slices_open, the remote provider) needs the
 * slabs, or workers, of trunk layers 0 .. n_layer-n_layer_nextn-1 only: a
 * manifest sliced with --layers 0-(trunk end) runs, and MTP slabs that are
 * present are verified like the rest but never read. */
#ifndef KVASIR_SLICE_H
#define KVASIR_SLICE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/gguf.h"
#include "kvasir/model.h"
#include "kvasir/moe.h"
#include "kvasir/pool.h"

#define KV_SLICE_VERSION 1u
#define KV_MANIFEST_FORMAT "kvasir-slices"
#define KV_MANIFEST_MAX_BYTES (64u << 20)   /* manifest.json size bound */
#define KV_MANIFEST_MAX_SLABS (1u << 20)    /* slabs listed in one manifest */
#define KV_MANIFEST_MAX_PATH 255u           /* bytes in a relative file path */
#define KV_MANIFEST_MAX_FILE_SIZE (1ull << 50) /* one piece, 1 PiB: bounds sizes read from JSON */

/* ---- SHA-256 (streaming, OpenSSL's libcrypto: SHA-NI/AVX2 where the
 * CPU has them) ---------------------------------------------------------- */

typedef struct kv_sha256 {
    void *ctx; /* EVP_MD_CTX, owned; freed by final or discard */
} kv_sha256;

/* Starts a hash. Allocation failure is fatal (KV_ASSERT): it cannot come
 * from input. Every init is followed by exactly one final or discard. */
void kv_sha256_init(kv_sha256 *s);
void kv_sha256_update(kv_sha256 *s, const void *data, size_t n);
void kv_sha256_final(kv_sha256 *s, uint8_t out[32]);
void kv_sha256_discard(kv_sha256 *s);
/* Name of the implementation, for logs ("openssl <version>"). */
const char *kv_sha256_backend(void);
/* 64 lowercase hex digits + NUL. */
void kv_sha256_hex(const uint8_t h[32], char out[65]);

/* Model identity of an open GGUF (see above) read through its mapping, on
 * this thread, as 64 hex digits + NUL. kv_pieces_model_id (pieces.h) gives
 * the same value in parallel and without reading holes. */
void kv_slice_model_id(const kv_gguf *g, char out[65]);

/* ---- slicing --------------------------------------------------------- */

typedef struct kv_slice_opts {
    uint32_t experts_per_slab; /* experts per slab; 0 = all of a layer's */
    int64_t layer_first;       /* first layer to write slabs for; -1 = 0 */
    int64_t layer_last;        /* last layer (inclusive); -1 = the last */
    int n_threads;             /* parallel files; 0 = all CPUs */
} kv_slice_opts;

typedef struct kv_slice_stats {
    uint32_t n_slabs;          /* slab files written */
    uint32_t n_moe_layers;     /* layers holding routed experts in the source */
    uint64_t bytes_logical;    /* sum of written file sizes */
    uint64_t bytes_copied;     /* tensor bytes read and written (holes excluded) */
    uint64_t bytes_holes;      /* tensor bytes left as holes (sparse source) */
    bool sparse;               /* the source had holes in tensor data: hashes omitted */
    double seconds;            /* wall time */
} kv_slice_stats;

/* Slices the GGUF at src into out_dir (created if absent; existing files of
 * the same names are replaced). Works on any architecture: routed experts
 * are the 3-D tensors blk.L.ffn_{gate,up,down}_exps of equal ne[2]. A hole
 * in the source (SEEK_HOLE) stays a hole and is not read, so a skeleton
 * slices in time proportional to its header; files with holes get no
 * SHA-256 in the manifest (sha256 null, "sparse": true) and run only when
 * asked (kv_slices_opts.allow_sparse, `run --allow-sparse`). The model
 * identity is computed first (one parallel read of the source's data,
 * holes skipped). Errors: KV_EIO, KV_EFORMAT (no routed experts, inconsistent expert
 * tensors), KV_ERANGE (bad layer range). stats may be NULL. */
int kv_slice_model(const char *src, const char *out_dir, const kv_slice_opts *opts,
                   kv_slice_stats *stats, kv_diag *d);

/* ---- manifest --------------------------------------------------------- */

typedef struct kv_manifest_file {
    char path[KV_MANIFEST_MAX_PATH + 1]; /* relative to the manifest's folder, '/'-separated */
    uint64_t size;                       /* bytes */
    uint8_t sha256[32];                  /* valid when has_sha256 */
    bool has_sha256;                     /* false for sparse (skeleton) pieces */
} kv_manifest_file;

typedef struct kv_manifest_slab {
    kv_manifest_file file;
    uint32_t layer;         /* block index */
    uint32_t first, last;   /* expert range, inclusive */
} kv_manifest_slab;

typedef struct kv_manifest {
    uint32_t version;             /* KV_SLICE_VERSION */
    char model_id[65];            /* 64 hex digits */
    char name[256];               /* general.name, "" if none */
    char arch[64];                /* general.architecture */
    uint32_t n_layer;             /* blocks (block_count: trunk + MTP) */
    uint32_t n_layer_nextn;       /* of them, MTP blocks at the end (0: none) */
    uint32_t n_embd;              /* hidden size */
    uint32_t n_expert;            /* routed experts per MoE layer */
    uint32_t n_expert_used;       /* top-k (0 if the source does not say) */
    uint32_t n_ff_exp;            /* expert hidden size */
    uint32_t layer_first, layer_last; /* layers whose experts the slabs cover */
    uint8_t *moe_layer;           /* [n_layer] 1 if the layer has routed experts */
    bool sparse;                  /* some piece has no hash (skeleton) */
    kv_manifest_file backbone;
    kv_manifest_slab *slabs;      /* [n_slabs] sorted by (layer, first) */
    size_t n_slabs;
} kv_manifest;

/* Parses and validates manifest JSON (len bytes, need not be NUL-terminated).
 * Before any tree is built, the text must nest at most 3 deep and its size
 * and JSON token count stay within what its slab entries can need (about
 * 1 KiB and 16 tokens a slab, plus a fixed part); every object refuses
 * unknown keys. Checks types and bounds of every field, relative paths only (no "..", no
 * absolute path, no empty or "." component, no backslash or NUL), hex hashes,
 * and that in every MoE layer of [layer_first, layer_last] the slabs cover
 * experts [0, n_expert) exactly once (no overlap, no gap), and no slab lies
 * outside. On error *out is NULL and d names the field. Free with
 * kv_manifest_free (accepts NULL). */
int kv_manifest_parse(kv_manifest **out, const char *json, size_t len, kv_diag *d);
/* Reads (at most KV_MANIFEST_MAX_BYTES) and parses a manifest file. */
int kv_manifest_load(kv_manifest **out, const char *path, kv_diag *d);
/* Serializes m (which must be valid) to path, written whole then renamed. */
int kv_manifest_write(const kv_manifest *m, const char *path, kv_diag *d);
void kv_manifest_free(kv_manifest *m);

/* ---- running from pieces ---------------------------------------------- */

typedef struct kv_slices kv_slices;

typedef struct kv_slices_opts {
    uint64_t cache_bytes; /* 0: mmap every slab; else a bounded expert cache of
                             this many bytes, filled by pread on demand */
    bool skip_hashes;     /* check sizes, headers and identity but not SHA-256 */
    int n_threads;        /* parallel hashing; 0 = all CPUs */
    bool allow_sparse;    /* run a sliced skeleton (sparse manifest: pieces without
                             hashes are checked for size, header and identity) */
} kv_slices_opts;

typedef struct kv_slices_stats {
    uint64_t hits, misses;      /* cache lookups (cache mode) */
    uint64_t evictions;         /* entries dropped to make room */
    uint64_t bytes_read;        /* read from slab files by the cache */
    uint64_t waves;             /* extra passes when a step's experts exceeded the cache */
    uint32_t cache_slots;       /* experts the cache holds at once */
    uint64_t slot_bytes;        /* bytes per cache slot (largest expert) */
} kv_slices_stats;

/* Opens the pieces named by the manifest at manifest_path: every file must
 * lie inside the manifest's folder after resolving symlinks, exist with the
 * listed size and SHA-256 (unless skip_hashes), be a valid GGUF carrying the
 * manifest's model identity, and each slab must hold exactly its listed
 * layer and range with tensor shapes matching the hparams and types equal
 * across slabs of a layer (kv_pieces_open does these checks). A sparse
 * manifest is refused (KV_EUNSUPPORTED) unless opts->allow_sparse; its
 * slabs must cover every trunk layer (from 0 to n_layer-n_layer_nextn-1;
 * MTP blocks may be absent). On any error *out is NULL, nothing stays
 * open, and d says which file and why (KV_EHASH, KV_ENOTFOUND, KV_EFORMAT, KV_EIO). Free with
 * kv_slices_free (accepts NULL). */
int kv_slices_open(kv_slices **out, const char *manifest_path, const kv_slices_opts *opts,
                   kv_diag *d);
void kv_slices_free(kv_slices *s);
const kv_manifest *kv_slices_manifest(const kv_slices *s);
/* Absolute path of the verified backbone (valid while s lives). */
const char *kv_slices_backbone_path(const kv_slices *s);
/* Checks that a backbone loaded with no_experts agrees with the manifest
 * (hparams and identity); KV_EFORMAT otherwise. */
int kv_slices_check_model(const kv_slices *s, const kv_model *m, kv_diag *d);
/* The expert source over the slabs (mmap views, or cache entries pinned
 * between acquire and release). Valid while s lives. Thread-safe. */
kv_expert_source kv_slices_expert_source(kv_slices *s);
/* The in-process provider over the slabs. In cache mode, a step whose
 * distinct experts exceed the cache's slots is computed in waves of at most
 * that many experts (same bits: every output element is one whole dot
 * product), so the cache never exceeds its bound. Free with
 * out->free(out->impl) before kv_slices_free. */
int kv_slices_provider_new(kv_expert_provider *out, kv_slices *s, kv_pool *pool,
                           uint32_t max_tokens, kv_diag *d);
void kv_slices_get_stats(const kv_slices *s, kv_slices_stats *out);

/* ---- one expert alone -------------------------------------------------- */

/* Finds expert `expert` of layer `layer` in an open GGUF that is either a
 * full model or a slab (kvasir.slab.first/last map the global id). Writes
 * views of its three matrices and the dims. KV_ENOTFOUND / KV_ERANGE /
 * KV_EFORMAT with a message otherwise. */
int kv_expert_find(const kv_gguf *g, uint32_t layer, uint32_t expert, kv_expert_weights *w,
                   uint32_t *n_embd, uint32_t *n_ff, kv_diag *d);
/* y[t][n_embd] = down(silu(gate x[t]) * up x[t]) for n_tokens rows of x,
 * with the engine's kernels (the local provider over a one-expert source).
 * pool may be NULL (one thread). */
int kv_expert_compute_one(const kv_expert_weights *w, uint32_t n_embd, uint32_t n_ff,
                          kv_pool *pool, const float *x, uint32_t n_tokens, float *y, kv_diag *d);

#endif
