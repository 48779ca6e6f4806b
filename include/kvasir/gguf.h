/* GGUF v3 reader and writer.
 *
 * File layout (all little-endian):
 *   u32 magic "GGUF" | u32 version (3) | u64 n_tensors | u64 n_kv
 *   n_kv x { string key | u32 value_type | value }
 *       string = u64 len | len bytes (not NUL-terminated)
 *       array  = u32 elem_type | u64 n | n values (nested arrays allowed by
 *                the format; we accept depth <= KV_GGUF_MAX_ARRAY_DEPTH)
 *   n_tensors x { string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type
 *                 | u64 offset (relative to data section, multiple of alignment) }
 *   padding to general.alignment (default 32)
 *   tensor data
 *
 * The reader mmaps the file; every string, key, tensor name and tensor data
 * pointer returned is a view into the mapping, valid until kv_gguf_close.
 * Every count, length, offset and shape is checked against what remains of
 * the file and against the named maxima below before use; a malformed file
 * yields KV_EFORMAT (or KV_EUNSUPPORTED for an unknown version/type) with a
 * message naming the offending field, and nothing is loaded.
 *
 * Split models (llama.cpp's gguf-split layout, how most large files are
 * published): one model in N files PREFIX-00001-of-0000N.gguf ..., each a
 * complete GGUF file holding some of the tensors, with the keys
 *   split.no (u16, 0-based part index), split.count (u16, N) and
 *   split.tensors.count (i32, tensors over all parts);
 * the first part also holds all of the model's metadata. kv_gguf_open given
 * any part opens every part and returns one handle over the whole model
 * (see kv_gguf_open); each tensor says which part holds its data. */
#ifndef KVASIR_GGUF_H
#define KVASIR_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"

#define KV_GGUF_MAGIC 0x46554747u /* "GGUF" little-endian */
#define KV_GGUF_VERSION 3u
#define KV_GGUF_DEFAULT_ALIGNMENT 32u

/* Named maxima for untrusted headers. */
#define KV_GGUF_MAX_TENSORS (1u << 20)     /* tensors per file */
#define KV_GGUF_MAX_KV (1u << 16)          /* metadata pairs per file */
#define KV_GGUF_MAX_STRING (1u << 24)      /* bytes in one string (16 MiB) */
#define KV_GGUF_MAX_NAME 256u              /* bytes in a key or tensor name */
#define KV_GGUF_MAX_TENSOR_NAME 63u        /* bytes in a tensor name (ggml's GGML_MAX_NAME - 1) */
#define KV_GGUF_MAX_ARRAY (1u << 26)       /* elements in one array */
#define KV_GGUF_MAX_ARRAY_DEPTH 2u         /* nesting of arrays */
#define KV_GGUF_MAX_DIMS 4u                /* tensor dimensions */
#define KV_GGUF_MAX_ALIGNMENT 65536u       /* general.alignment upper bound */
#define KV_GGUF_MAX_SPLITS 4096u           /* parts of one split model (split.count) */

enum kv_gguf_type {
    KV_GGUF_UINT8 = 0,
    KV_GGUF_INT8 = 1,
    KV_GGUF_UINT16 = 2,
    KV_GGUF_INT16 = 3,
    KV_GGUF_UINT32 = 4,
    KV_GGUF_INT32 = 5,
    KV_GGUF_FLOAT32 = 6,
    KV_GGUF_BOOL = 7,
    KV_GGUF_STRING = 8,
    KV_GGUF_ARRAY = 9,
    KV_GGUF_UINT64 = 10,
    KV_GGUF_INT64 = 11,
    KV_GGUF_FLOAT64 = 12,
    KV_GGUF_TYPE_COUNT
};

/* A string view into the mapping (or into writer-owned memory). */
typedef struct kv_str {
    const char *ptr; /* not NUL-terminated */
    size_t len;      /* bytes */
} kv_str;

/* One metadata value. For arrays, `arr` describes the elements: scalar
 * elements are packed little-endian at arr.data (elem size from
 * kv_gguf_type_size); string elements must be read with kv_gguf_arr_str. */
typedef struct kv_gguf_value {
    uint32_t type; /* enum kv_gguf_type */
    union {
        uint64_t u64; /* UINT8/16/32/64 and BOOL (0/1) */
        int64_t i64;  /* INT8/16/32/64 */
        double f64;   /* FLOAT32/64 */
        kv_str str;   /* STRING */
        struct {
            uint32_t elem_type;  /* enum kv_gguf_type */
            uint64_t n;          /* element count */
            const uint8_t *data; /* first element in the mapping */
            size_t nbytes;       /* bytes spanned by all elements */
        } arr;                   /* ARRAY */
    } v;
} kv_gguf_value;

typedef struct kv_gguf_kv {
    kv_str key;
    kv_gguf_value val;
} kv_gguf_kv;

typedef struct kv_gguf_tensor {
    kv_str name;
    uint32_t n_dims;                 /* 1..KV_GGUF_MAX_DIMS */
    uint64_t ne[KV_GGUF_MAX_DIMS];   /* elements per dim, ne[0] innermost; unused dims = 1 */
    uint32_t type;                   /* ggml type id (kv_type in quant.h) */
    uint64_t offset;                 /* relative to the data section */
    uint64_t nbytes;                 /* bytes of data, from type and shape */
    uint64_t file_offset;            /* absolute offset in the file holding it (part `part`) */
    const void *data;                /* view into the mapping */
    uint32_t part;                   /* 0, or the index of its part in a split model */
} kv_gguf_tensor;

typedef struct kv_gguf kv_gguf;

/* Opens and validates a GGUF file by mmap. On success *out owns the mapping;
 * free with kv_gguf_close. On error *out is NULL and d says why. Tensor data
 * ranges are checked to lie inside the file. Types unknown to kv_type_info
 * are rejected with KV_EUNSUPPORTED (name and type id in the message).
 *
 * A part of a split model (split.count > 1; any part, not only the first)
 * opens the whole model: every part is found by its name (the path must end
 * in -NNNNN-of-MMMMM.gguf, the numbers those of split.no + 1 and
 * split.count), opened and checked: each present (KV_ENOTFOUND naming the
 * missing part), each with the same split.count and split.tensors.count and
 * its own split.no, no metadata key of a later part contradicting the first
 * part's, no tensor in two parts, and as many tensors in all as
 * split.tensors.count (KV_EFORMAT otherwise, naming the parts). The handle
 * then reads as one model: the first part's metadata (split.* included),
 * every part's tensors. */
int kv_gguf_open(kv_gguf **out, const char *path, kv_diag *d);

/* Opens exactly the one file at path, as kv_gguf_open does, without looking
 * for the other parts of a split model. */
int kv_gguf_open_file(kv_gguf **out, const char *path, kv_diag *d);

/* Same, over caller memory (not copied; must outlive the handle). Used by
 * tests and the fuzzer. */
int kv_gguf_open_mem(kv_gguf **out, const void *buf, size_t size, kv_diag *d);

/* Accepts NULL. */
void kv_gguf_close(kv_gguf *g);

/* Files behind a handle: 1, or a split model's part count. kv_gguf_part(g,
 * i) is part i as a one-file handle (g itself for one file; NULL past the
 * end), owned by g; its tensors' offsets and data are its own.
 * kv_gguf_path: the path the file was opened from (NULL over memory; a
 * split model's: its first part's). kv_gguf_total_size: bytes of all its
 * files. The per-file accessors below (base, sizes, data offset, alignment)
 * are the first part's for a split model: go through kv_gguf_part for
 * byte ranges. */
size_t kv_gguf_n_parts(const kv_gguf *g);
const kv_gguf *kv_gguf_part(const kv_gguf *g, size_t i);
const char *kv_gguf_path(const kv_gguf *g);
uint64_t kv_gguf_total_size(const kv_gguf *g);

uint32_t kv_gguf_version(const kv_gguf *g);
size_t kv_gguf_alignment(const kv_gguf *g);
uint64_t kv_gguf_data_offset(const kv_gguf *g); /* absolute start of tensor data */
uint64_t kv_gguf_file_size(const kv_gguf *g);
const void *kv_gguf_base(const kv_gguf *g);     /* start of the mapping */

size_t kv_gguf_n_kv(const kv_gguf *g);
const kv_gguf_kv *kv_gguf_kv_at(const kv_gguf *g, size_t i);
/* Returns the pair with this key (NUL-terminated), or NULL. */
const kv_gguf_kv *kv_gguf_find_kv(const kv_gguf *g, const char *key);

size_t kv_gguf_n_tensors(const kv_gguf *g);
const kv_gguf_tensor *kv_gguf_tensor_at(const kv_gguf *g, size_t i);
const kv_gguf_tensor *kv_gguf_find_tensor(const kv_gguf *g, const char *name);

/* Typed getters. Each returns 0 and writes *out, KV_ENOTFOUND if the key is
 * absent, or KV_EFORMAT if it has an incompatible type or its value does not
 * fit (messages name the key). Integer getters accept any integer type whose
 * value fits; kv_gguf_get_f32 accepts FLOAT32/FLOAT64. */
int kv_gguf_get_u32(const kv_gguf *g, const char *key, uint32_t *out, kv_diag *d);
int kv_gguf_get_i32(const kv_gguf *g, const char *key, int32_t *out, kv_diag *d);
int kv_gguf_get_u64(const kv_gguf *g, const char *key, uint64_t *out, kv_diag *d);
int kv_gguf_get_f32(const kv_gguf *g, const char *key, float *out, kv_diag *d);
int kv_gguf_get_bool(const kv_gguf *g, const char *key, bool *out, kv_diag *d);
int kv_gguf_get_str(const kv_gguf *g, const char *key, kv_str *out, kv_diag *d);
/* Array of given element type: *n elements, *data as in kv_gguf_value.arr. */
int kv_gguf_get_arr(const kv_gguf *g, const char *key, uint32_t elem_type,
                    uint64_t *n, const uint8_t **data, kv_diag *d);

/* i-th string of a STRING array value (bounds-checked; walks from the start,
 * so iterate with kv_gguf_arr_str_iter for O(n) passes). */
int kv_gguf_arr_str(const kv_gguf_value *arr, uint64_t i, kv_str *out);
/* Iterator over a STRING array: *pos starts at 0 (byte offset), each call
 * yields the next string and advances; returns 0, or KV_ERANGE at the end. */
int kv_gguf_arr_str_iter(const kv_gguf_value *arr, size_t *pos, kv_str *out);

/* Size in bytes of one scalar of a metadata type (0 for STRING/ARRAY/unknown). */
size_t kv_gguf_type_size(uint32_t type);
const char *kv_gguf_type_name(uint32_t type);

/* True if s equals the NUL-terminated c. */
bool kv_str_eq(kv_str s, const char *c);

/* ---- writer ----------------------------------------------------------
 * Build metadata and tensor infos in memory, then kv_gguf_writer_begin
 * writes the header and lays out data offsets; tensor data is then written
 * per tensor (any order) with kv_gguf_writer_write_data, possibly in parts;
 * kv_gguf_writer_finish sets the final size. Tensors whose data is never
 * written are left as holes (a sparse file), which is how skeleton models
 * are made. All strings and arrays given to setters are copied. */
typedef struct kv_gguf_writer kv_gguf_writer;

int kv_gguf_writer_new(kv_gguf_writer **out, kv_diag *d);
void kv_gguf_writer_free(kv_gguf_writer *w); /* accepts NULL; closes an unfinished file */

int kv_gguf_writer_set_alignment(kv_gguf_writer *w, uint32_t alignment, kv_diag *d);
/* Setters replace an existing key of the same name, keeping its position. */
int kv_gguf_writer_set_u16(kv_gguf_writer *w, const char *key, uint16_t v, kv_diag *d);
int kv_gguf_writer_set_u32(kv_gguf_writer *w, const char *key, uint32_t v, kv_diag *d);
int kv_gguf_writer_set_i32(kv_gguf_writer *w, const char *key, int32_t v, kv_diag *d);
int kv_gguf_writer_set_u64(kv_gguf_writer *w, const char *key, uint64_t v, kv_diag *d);
int kv_gguf_writer_set_f32(kv_gguf_writer *w, const char *key, float v, kv_diag *d);
int kv_gguf_writer_set_bool(kv_gguf_writer *w, const char *key, bool v, kv_diag *d);
int kv_gguf_writer_set_str(kv_gguf_writer *w, const char *key, const char *v, kv_diag *d);
int kv_gguf_writer_set_strn(kv_gguf_writer *w, const char *key, const char *v, size_t len, kv_diag *d);
/* Array of scalars: n elements of elem_type packed little-endian at data. */
int kv_gguf_writer_set_arr(kv_gguf_writer *w, const char *key, uint32_t elem_type,
                           const void *data, uint64_t n, kv_diag *d);
/* Array of strings: n (pointer,length) pairs. */
int kv_gguf_writer_set_arr_str(kv_gguf_writer *w, const char *key, const kv_str *strs,
                               uint64_t n, kv_diag *d);
/* Copies a metadata pair verbatim from a reader (used by slicing). */
int kv_gguf_writer_copy_kv(kv_gguf_writer *w, const kv_gguf_kv *kv, kv_diag *d);

/* Declares a tensor; returns its index via *idx (may be NULL). Shape ne[0]
 * innermost; ne[0] must be a multiple of the type's block size. */
int kv_gguf_writer_add_tensor(kv_gguf_writer *w, const char *name, uint32_t n_dims,
                              const uint64_t *ne, uint32_t type, size_t *idx, kv_diag *d);

/* Creates/truncates path and writes the header; after this no more metadata
 * or tensors may be added. */
int kv_gguf_writer_begin(kv_gguf_writer *w, const char *path, kv_diag *d);
/* Writes nbytes at byte offset `at` within tensor idx's data (bounds-checked). */
int kv_gguf_writer_write_data(kv_gguf_writer *w, size_t idx, uint64_t at,
                              const void *data, size_t nbytes, kv_diag *d);
/* Extends the file to its full size (holes stay holes), fsyncs nothing,
 * closes. */
int kv_gguf_writer_finish(kv_gguf_writer *w, kv_diag *d);

/* ---- writing a split model --------------------------------------------
 * Rewrites the model src (any GGUF; itself possibly split) as a split model
 * in the layout described at the top, as llama.cpp's gguf-split writes it:
 * tensors in their order, cut into consecutive runs; the first part carries
 * all metadata (existing split.* keys dropped) and every part split.no,
 * split.count, split.tensors.count (and general.alignment if src has it).
 * The cut: n_split > 0 gives n_split parts of about equal tensor bytes;
 * else max_bytes > 0 starts a new part whenever the next tensor (padded to
 * the alignment) would take the current one past max_bytes (a tensor larger
 * than max_bytes gets a part of its own). Files: out_prefix-00001-of-0000N.gguf
 * ...; each written as .part then renamed. n_out (may be NULL) gets N.
 * KV_EINVAL if both or neither cut is given, or n_split exceeds the tensors
 * or KV_GGUF_MAX_SPLITS; KV_ERANGE if max_bytes would need more parts. */
int kv_gguf_split_write(const char *src, const char *out_prefix, uint32_t n_split, uint64_t max_bytes,
                        uint32_t *n_out, kv_diag *d);

#endif
