/* The reader's handle, shared by gguf_read.c (one file) and gguf_split.c (a
 * split model assembled from its parts). Not a public header.
 *
 * A handle is either one file (n_parts 1, parts NULL) or a split set: then
 * kvs and kv_hash are borrowed from parts[0] (the part holding the model's
 * metadata), tensors is the union of every part's tensors in part order (each
 * a copy with .part set, its data a view into that part's mapping), and
 * base/size/data_offset/alignment are parts[0]'s. */
#ifndef KVASIR_GGUF_INTERNAL_H
#define KVASIR_GGUF_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/gguf.h"

struct kv_gguf {
    const uint8_t *base;     /* start of the file bytes (mapping or caller memory) */
    size_t size;             /* bytes */
    int mapped;              /* 1 if base is our mmap to munmap */
    uint32_t version;        /* always 3 once open */
    size_t alignment;        /* general.alignment or 32 */
    uint64_t data_offset;    /* absolute start of the tensor data section */
    kv_gguf_kv *kvs;         /* [n_kv] */
    size_t n_kv;
    kv_gguf_tensor *tensors; /* [n_tensors] */
    size_t n_tensors;
    uint32_t *kv_hash;       /* [kv_hash_cap] index+1, 0 = empty */
    size_t kv_hash_cap;      /* power of two >= 2*n_kv */
    uint32_t *t_hash;        /* [t_hash_cap] index+1, 0 = empty */
    size_t t_hash_cap;
    char *path;              /* the file's path as opened (owned); NULL over memory */
    kv_gguf **parts;         /* [n_parts] of a split set (owned), NULL for one file */
    size_t n_parts;          /* 1 for one file */
    bool borrowed_kvs;       /* kvs and kv_hash belong to parts[0] */
};

/* Open-addressing tables over names (gguf_read.c). */
size_t kv_gguf_hash_cap(size_t n);
/* Inserts index i (name s); returns index+1 of an entry with the same name,
 * or 0 once inserted. */
uint32_t kv_gguf_hash_insert(uint32_t *tab, size_t cap, const kv_str *names, size_t stride, kv_str s, size_t i);

/* If the one-file handle g is a part of a split model (split.count > 1),
 * opens its siblings and replaces *g with the assembled set (g itself
 * becomes one of its parts); otherwise leaves *g as it is. On error *g is
 * closed and set to NULL and d names the part (gguf_split.c). */
int kv_gguf_split_assemble(kv_gguf **g, kv_diag *d);

#endif
