/* Pieces: the one owner of the checks that say whether files are the pieces
 * of a model: opening a file only if it is a regular file, SHA-256 of a
 * file, the model identity (defined in slice.h's opening comment), what a
 * slab says it holds, and verifying a slice folder against its manifest
 * (every file inside the folder, its size, SHA-256, GGUF header, identity,
 * each slab's layer, range, shapes and types) with the slab index built
 * from it. The slicer, kv_slices_open (slabs.c), the coordinator
 * (kv_remote_open) and the worker (kv_worker_open) all call these, so a rule
 * is written once.
 *
 * Verification opens each listed file once: resolved inside the manifest's
 * folder (after symlinks), stat'd before it is opened (a FIFO would block
 * open(2) forever), opened O_NOFOLLOW|O_NONBLOCK and fstat'd again. Hashing
 * runs on a few threads, one file each. Any failure frees everything and
 * names the file; nothing stays open.
 *
 * Modes: a runner (kv_slices_open) needs every slab; a coordinator that
 * holds only the backbone and the manifest sets slabs_may_be_missing, and
 * whichever slabs are present are verified like the rest. A sparse manifest
 * (a sliced skeleton: pieces without hashes) is refused unless allow_sparse
 * is set; then pieces without a hash are checked for size, header and
 * identity only. */
#ifndef KVASIR_PIECES_H
#define KVASIR_PIECES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/gguf.h"
#include "kvasir/model.h"
#include "kvasir/slice.h"

/* ---- files --------------------------------------------------------------- */

/* Opens path read-only if and only if it is a regular file: stat (lstat with
 * nofollow) first, so a FIFO or device is refused without being opened, then
 * open with O_NONBLOCK (and O_NOFOLLOW with nofollow) and fstat again (same
 * inode, still regular). On success *fd (blocking mode restored; the caller
 * closes it) and *size (bytes; may be NULL). KV_ENOTFOUND if absent, KV_EIO
 * otherwise ("PATH: not a regular file"). */
int kv_pieces_open_file(const char *path, bool nofollow, int *fd, uint64_t *size, kv_diag *d);

/* SHA-256 of the whole regular file at path (what sha256sum prints, as
 * bytes). For the handshake: a worker reports this for each slab it serves.
 * KV_ENOTFOUND, KV_EIO (not regular, read error, file changed size). */
int kv_pieces_hash_file(const char *path, uint8_t out[32], kv_diag *d);

/* The manifest's entry for the slab holding exactly layer's experts
 * [first, last], or NULL. Its file.sha256 (valid when file.has_sha256) is
 * the hash a worker serving that slab must report. O(log n_slabs). */
const kv_manifest_slab *kv_manifest_find_slab(const kv_manifest *m, uint32_t layer, uint32_t first, uint32_t last);

/* ---- identity -------------------------------------------------------------- */

#define KV_MODEL_ID_CHUNK (1u << 20) /* bytes of tensor data per leaf hash */
#define KV_MODEL_ID_TAG "kvasir-model-id-v2"
#define KV_MODEL_ID_SPLIT_TAG "kvasir-model-id-split-v1" /* a split model's (slice.h) */

/* The model identity of the GGUF g, opened from path (slice.h defines it:
 * header + every byte of tensor data, in 1 MiB leaves). Holes (SEEK_DATA)
 * are not read: a leaf wholly inside a hole is the hash of zeros, so a
 * sparse skeleton gets its identity in time proportional to its data, and
 * equals the identity of the same bytes written densely. A split model's
 * identity combines its parts' (each read from its own file; path is then
 * only the name it was opened by). n_threads readers (0 = all CPUs). out: 64 hex digits + NUL. KV_EIO if path no longer holds
 * the file g maps (size changed) or cannot be read. */
int kv_pieces_model_id(const kv_gguf *g, const char *path, int n_threads, char out[65], kv_diag *d);

/* The identity a file belongs to: its kvasir.source.id if it has one (a
 * piece; must be 64 lowercase hex digits, else KV_EFORMAT), else the model
 * identity computed over the file (a full model). path names the file in
 * messages and is read for the computation. */
int kv_pieces_file_identity(const kv_gguf *g, const char *path, char id[65], kv_diag *d);

/* What a slab says it holds (kvasir.slab.*). KV_ENOTFOUND if g is not a slab
 * (no kvasir.slab.layer); KV_EFORMAT if the keys are partial or
 * inconsistent (first > last, last >= n_expert, n_expert or layer past the
 * KV_MAX_* bounds). Any output may be NULL. */
int kv_pieces_slab_meta(const kv_gguf *g, uint32_t *layer, uint32_t *first, uint32_t *last, uint32_t *n_expert,
                        kv_diag *d);

/* ---- a slice folder ------------------------------------------------------------ */

typedef struct kv_pieces_opts {
    const char *who;            /* message prefix ("slices", "remote"); NULL = "pieces" */
    bool runnable;              /* refuse (before hashing) what kv_pieces_check_runnable refuses */
    bool slabs_may_be_missing;  /* absent slabs are skipped (a coordinator's folder) */
    bool allow_sparse;          /* accept a sparse manifest: pieces without hash unhashed */
    bool skip_hashes;           /* check sizes, headers and identity but not SHA-256 */
    bool keep_gguf;             /* keep each present slab's kv_gguf open (mmap views) */
    bool keep_fd;               /* keep each present slab's descriptor open (pread; the
                                   open-file limit is raised to fit, or KV_EUNSUPPORTED) */
    int n_threads;              /* parallel hashing; 0 = all CPUs */
} kv_pieces_opts;

typedef struct kv_piece_slab {
    char *path;                 /* resolved absolute path; NULL if absent */
    kv_gguf *g;                 /* open if keep_gguf and present, else NULL */
    int fd;                     /* open if keep_fd and present, else -1 */
    uint32_t layer, first, last;/* what it holds (equal to the manifest's entry) */
    uint64_t off[3];            /* file offsets of gate, up, down data (expert `first`) */
    uint64_t nb2[3];            /* bytes per expert matrix */
    const uint8_t *base[3];     /* data views (valid while g is open) */
    uint32_t type[3];           /* tensor types, equal across a layer's slabs */
    /* the experts' biases (gpt-oss), f32 rows of n_ff, n_ff, n_embd per expert: all three or none */
    bool has_bias;
    uint64_t b_off[3];          /* file offsets of the gate, up, down bias rows (expert `first`) */
    uint64_t b_nb[3];           /* bytes per expert's bias row */
    const uint8_t *b_base[3];   /* data views (valid while g is open) */
    uint32_t act;               /* the experts' activation from general.architecture (enum kv_expert_act) */
} kv_piece_slab;

typedef struct kv_pieces {
    kv_manifest *m;             /* owned (kv_pieces_take_manifest moves it out) */
    char *dir;                  /* resolved manifest folder */
    char *backbone;             /* resolved backbone path (always present) */
    kv_piece_slab *slabs;       /* [n_slabs], manifest order (sorted by layer, first) */
    size_t n_slabs;             /* m->n_slabs (kept when the manifest is taken) */
    size_t n_present;           /* slabs present (== m->n_slabs unless slabs_may_be_missing) */
    int32_t *where;             /* [n_layer * n_expert] present slab holding each expert, -1 none */
} kv_pieces;

/* Loads the manifest at manifest_path and verifies the folder (see above).
 * On error *out is NULL and d names the file: KV_ENOTFOUND (missing),
 * KV_EHASH (SHA-256 differs), KV_EFORMAT (size, header, identity, layout,
 * outside the folder), KV_EUNSUPPORTED (sparse without allow_sparse, a type
 * we cannot compute), KV_EIO. Free with kv_pieces_free (accepts NULL). */
int kv_pieces_open(kv_pieces **out, const char *manifest_path, const kv_pieces_opts *opts, kv_diag *d);
void kv_pieces_free(kv_pieces *p);
/* Moves the manifest out: the caller frees it, p->m becomes NULL; the rest
 * of p stays valid until kv_pieces_free. A caller may likewise take a
 * slab's g or fd (set the field to NULL / -1). */
kv_manifest *kv_pieces_take_manifest(kv_pieces *p);

/* A manifest that can be run from: slabs covering every trunk layer
 * (0 .. n_layer-n_layer_nextn-1) and 0 < n_expert_used. KV_EFORMAT naming
 * manifest_path otherwise. */
int kv_pieces_check_runnable(const kv_manifest *m, const char *who, const char *manifest_path, kv_diag *d);
/* A backbone loaded with no_experts agrees with the manifest (architecture,
 * hparams, every trunk layer MoE). KV_EFORMAT otherwise. */
int kv_pieces_check_model(const kv_manifest *m, const kv_model *model, const char *who, kv_diag *d);

/* The tensor k (0 gate, 1 up, 2 down) of layer's routed experts in g, or
 * NULL (slabs.c owns the names). */
const kv_gguf_tensor *kv_slab_expert_tensor(const kv_gguf *g, uint32_t layer, int k);
/* The bias of expert matrix k (0 gate, 1 up, 2 down) of a layer
 * ("blk.L.ffn_*_exps.bias", [rows][n_expert]), NULL if the file has none. */
const kv_gguf_tensor *kv_slab_expert_bias(const kv_gguf *g, uint32_t layer, int k);
/* The expert activation (enum kv_expert_act) of g's general.architecture:
 * its table's, SwiGLU when the name is absent or has no table;
 * *needs_bias: the architecture's experts have biases. */
uint32_t kv_slab_expert_act(const kv_gguf *g, bool *needs_bias);
/* Views of expert e of a slab whose g is open (mmap): matrices, types,
 * biases and activation. */
void kv_piece_slab_weights(const kv_piece_slab *sl, uint32_t e, kv_expert_weights *w);

#endif
