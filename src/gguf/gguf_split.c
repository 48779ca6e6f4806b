/* Split models: assembling the parts of a split GGUF into one handle, and
 * writing a model as a split set (the layout is in gguf.h's opening comment;
 * it is llama.cpp's gguf-split layout, byte for byte in the keys and names).
 *
 * Assembly trusts nothing it reads: split.count is bounded by
 * KV_GGUF_MAX_SPLITS before anything is allocated for the parts, each part
 * is a complete file checked by the one-file reader, its split.* keys must
 * agree with the part it was reached from, and the union of tensors is
 * checked for duplicates through one hash table (O(total tensors)). A part
 * that is missing or wrong fails the whole open with a message naming its
 * number and path; nothing stays open.
 *
 * The writer reads tensor data through the source's mapping and writes it
 * in 1 MiB chunks; a chunk in a hole of the source (SEEK_DATA) is not read
 * and an all-zero 4 KiB block not written, so a sparse skeleton splits in time
 * proportional to its data and stays sparse (holes read as the same zeros). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gguf/gguf_internal.h"
#include "kvasir/gguf.h"

#define KV_SPLIT_KEY_NO "split.no"
#define KV_SPLIT_KEY_COUNT "split.count"
#define KV_SPLIT_KEY_TENSORS "split.tensors.count"
#define KV_SPLIT_SUFFIX "-%05u-of-%05u.gguf" /* 1-based part number, count */
#define KV_SPLIT_SUFFIX_MAX 32u              /* bytes of a formatted suffix + NUL */
#define KV_SPLIT_CHUNK (1u << 20)            /* bytes examined per step (source holes skipped) */
#define KV_SPLIT_BLOCK 4096u                 /* zero blocks of this size are not written */

/* ---- reading ------------------------------------------------------------ */

typedef struct kv_split_keys {
    uint32_t no;      /* split.no: 0-based */
    uint32_t count;   /* split.count */
    uint64_t tensors; /* split.tensors.count */
} kv_split_keys;

/* Reads the split.* keys of one part. *is_split false (and 0 returned) when
 * split.count is absent or <= 1: a file of its own. */
static int split_keys(const kv_gguf *g, const char *path, kv_split_keys *k, bool *is_split, kv_diag *d) {
    *is_split = false;
    uint32_t count;
    int rc = kv_gguf_get_u32(g, KV_SPLIT_KEY_COUNT, &count, d);
    if (rc == KV_ENOTFOUND) return 0;
    if (rc) return kv_diag_prefix(d, rc, "gguf: %s", path);
    if (count <= 1) return 0;
    if (count > KV_GGUF_MAX_SPLITS)
        return kv_fail(d, KV_EFORMAT, "gguf: %s: split.count %u exceeds the maximum of %u parts", path, count,
                       KV_GGUF_MAX_SPLITS);
    if ((rc = kv_gguf_get_u32(g, KV_SPLIT_KEY_NO, &k->no, d)))
        return kv_fail(d, KV_EFORMAT, "gguf: %s: part of a split model (split.count %u) without a valid split.no", path,
                       count);
    if (k->no >= count)
        return kv_fail(d, KV_EFORMAT, "gguf: %s: split.no %u is not below split.count %u", path, k->no, count);
    if ((rc = kv_gguf_get_u64(g, KV_SPLIT_KEY_TENSORS, &k->tensors, d)))
        return kv_fail(d, KV_EFORMAT, "gguf: %s: part of a split model without a valid split.tensors.count", path);
    if (k->tensors > KV_GGUF_MAX_TENSORS)
        return kv_fail(d, KV_EFORMAT, "gguf: %s: split.tensors.count %" PRIu64 " exceeds the maximum %u", path,
                       k->tensors, KV_GGUF_MAX_TENSORS);
    k->count = count;
    *is_split = true;
    return 0;
}

static bool is_split_key(kv_str key) { return key.len > 6 && !memcmp(key.ptr, "split.", 6); }

/* True if the two values are the same type and bytes. */
static bool same_value(const kv_gguf_value *a, const kv_gguf_value *b) {
    if (a->type != b->type) return false;
    switch (a->type) {
    case KV_GGUF_STRING:
        return a->v.str.len == b->v.str.len && !memcmp(a->v.str.ptr, b->v.str.ptr, a->v.str.len);
    case KV_GGUF_ARRAY:
        return a->v.arr.elem_type == b->v.arr.elem_type && a->v.arr.n == b->v.arr.n &&
               a->v.arr.nbytes == b->v.arr.nbytes && !memcmp(a->v.arr.data, b->v.arr.data, a->v.arr.nbytes);
    case KV_GGUF_FLOAT32:
    case KV_GGUF_FLOAT64:
        return !memcmp(&a->v.f64, &b->v.f64, sizeof a->v.f64);
    default:
        return a->v.u64 == b->v.u64; /* integers and bool share the 64-bit slot */
    }
}

/* Part p (not the first) against the first: split keys equal where they
 * must be, and no other key contradicting the first part's. */
static int check_part(const kv_gguf *first, const kv_gguf *part, const char *path, uint32_t p,
                      const kv_split_keys *want, kv_diag *d) {
    kv_split_keys k;
    bool is_split;
    int rc = split_keys(part, path, &k, &is_split, d);
    if (rc) return rc;
    if (!is_split)
        return kv_fail(d, KV_EFORMAT, "gguf: %s: part %u of %u has no split.count of %u (not a part of this model)",
                       path, p + 1, want->count, want->count);
    if (k.count != want->count || k.tensors != want->tensors)
        return kv_fail(d, KV_EFORMAT,
                       "gguf: %s: part %u says split.count %u and split.tensors.count %" PRIu64
                       ", the other parts %u and %" PRIu64 " (parts of different models?)",
                       path, p + 1, k.count, k.tensors, want->count, want->tensors);
    if (k.no != p)
        return kv_fail(d, KV_EFORMAT, "gguf: %s: named as part %u but its split.no says part %u", path, p + 1,
                       k.no + 1);
    if (part == first) return 0;
    for (size_t i = 0; i < kv_gguf_n_kv(part); i++) {
        const kv_gguf_kv *kv = kv_gguf_kv_at(part, i);
        if (is_split_key(kv->key)) continue;
        char key[KV_GGUF_MAX_NAME + 1];
        snprintf(key, sizeof key, "%.*s", (int)kv->key.len, kv->key.ptr);
        const kv_gguf_kv *f = kv_gguf_find_kv(first, key);
        if (f && !same_value(&f->val, &kv->val))
            return kv_fail(d, KV_EFORMAT,
                           "gguf: %s: part %u's '%s' differs from the first part's (parts of different models?)", path,
                           p + 1, key);
    }
    return 0;
}

int kv_gguf_split_assemble(kv_gguf **gp, kv_diag *d) {
    kv_gguf *g = *gp;
    kv_split_keys want;
    bool is_split;
    const char *path = g->path ? g->path : "(memory)";
    int rc = split_keys(g, path, &want, &is_split, d);
    if (rc || !is_split || !g->path) {
        if (rc) {
            kv_gguf_close(g);
            *gp = NULL;
        }
        return rc;
    }
    /* the siblings' names from this part's */
    char suffix[KV_SPLIT_SUFFIX_MAX];
    snprintf(suffix, sizeof suffix, KV_SPLIT_SUFFIX, want.no + 1, want.count);
    const size_t len = strlen(g->path), sl = strlen(suffix);
    if (len <= sl || strcmp(g->path + len - sl, suffix)) {
        rc = kv_fail(d, KV_EFORMAT,
                     "gguf: %s is part %u of a split model of %u parts, but is not named PREFIX%s: its other parts "
                     "cannot be found (rename the parts as llama.cpp's gguf-split names them)",
                     g->path, want.no + 1, want.count, suffix);
        kv_gguf_close(g);
        *gp = NULL;
        return rc;
    }
    const size_t pre = len - sl;
    kv_gguf *m = calloc(1, sizeof *m);
    char *pp = malloc(pre + KV_SPLIT_SUFFIX_MAX);
    if (m) m->parts = calloc(want.count, sizeof *m->parts);
    if (!m || !pp || !m->parts) {
        free(pp);
        if (m) free(m->parts);
        free(m);
        kv_gguf_close(g);
        *gp = NULL;
        return kv_fail(d, KV_ENOMEM, "gguf: out of memory");
    }
    m->n_parts = want.count;
    m->parts[want.no] = g;
    memcpy(pp, g->path, pre);
    for (uint32_t p = 0; p < want.count && !rc; p++) {
        snprintf(pp + pre, KV_SPLIT_SUFFIX_MAX, KV_SPLIT_SUFFIX, p + 1, want.count);
        if (!m->parts[p]) {
            struct stat st;
            if (stat(pp, &st) != 0 && errno == ENOENT) {
                rc = kv_fail(d, KV_ENOTFOUND, "gguf: split model: part %u of %u is missing: %s", p + 1, want.count, pp);
                break;
            }
            if ((rc = kv_gguf_open_file(&m->parts[p], pp, d))) {
                kv_diag_prefix(d, rc, "gguf: split model: part %u of %u", p + 1, want.count);
                break;
            }
        }
    }
    free(pp);
    for (uint32_t p = 0; p < want.count && !rc; p++)
        rc = check_part(m->parts[0], m->parts[p], m->parts[p]->path, p, &want, d);
    /* the union of tensors */
    uint64_t total = 0;
    for (uint32_t p = 0; p < want.count && !rc; p++) total += m->parts[p]->n_tensors;
    if (!rc && total > KV_GGUF_MAX_TENSORS) /* before indexes (u32) and memory are spent on them */
        rc = kv_fail(d, KV_EFORMAT, "gguf: split model %s: its %u parts hold %" PRIu64 " tensors, max %u",
                     m->parts[0]->path, want.count, total, KV_GGUF_MAX_TENSORS);
    if (!rc) {
        m->t_hash_cap = kv_gguf_hash_cap((size_t)total);
        m->tensors = calloc(total ? (size_t)total : 1, sizeof *m->tensors);
        m->t_hash = calloc(m->t_hash_cap, sizeof *m->t_hash);
        m->path = strdup(m->parts[0]->path);
        if (!m->tensors || !m->t_hash || !m->path) rc = kv_fail(d, KV_ENOMEM, "gguf: out of memory");
    }
    uint32_t *owner = NULL; /* part of each merged tensor, for the duplicate message */
    if (!rc && !(owner = malloc((total ? (size_t)total : 1) * sizeof *owner)))
        rc = kv_fail(d, KV_ENOMEM, "gguf: out of memory");
    for (uint32_t p = 0; p < want.count && !rc; p++) {
        const kv_gguf *part = m->parts[p];
        for (size_t i = 0; i < part->n_tensors && !rc; i++) {
            const size_t at = m->n_tensors;
            m->tensors[at] = part->tensors[i];
            m->tensors[at].part = p;
            owner[at] = p;
            const uint32_t dup = kv_gguf_hash_insert(m->t_hash, m->t_hash_cap, &m->tensors[0].name,
                                                     sizeof *m->tensors, m->tensors[at].name, at);
            if (dup)
                rc = kv_fail(d, KV_EFORMAT, "gguf: split model %s: tensor '%.*s' is in part %u and again in part %u",
                             m->parts[0]->path, (int)m->tensors[at].name.len, m->tensors[at].name.ptr,
                             owner[dup - 1] + 1, p + 1);
            else
                m->n_tensors = at + 1;
        }
    }
    free(owner);
    if (!rc && total != want.tensors)
        rc = kv_fail(d, KV_EFORMAT, "gguf: split model %s: split.tensors.count is %" PRIu64
                     " but its %u parts hold %" PRIu64 " tensors", m->parts[0]->path, want.tensors, want.count, total);
    if (rc) {
        kv_gguf_close(m); /* closes every part opened, g included */
        *gp = NULL;
        return rc;
    }
    const kv_gguf *f = m->parts[0];
    m->base = f->base;
    m->size = f->size;
    m->mapped = 0;
    m->version = f->version;
    m->alignment = f->alignment;
    m->data_offset = f->data_offset;
    m->kvs = f->kvs;
    m->n_kv = f->n_kv;
    m->kv_hash = f->kv_hash;
    m->kv_hash_cap = f->kv_hash_cap;
    m->borrowed_kvs = true;
    *gp = m;
    return 0;
}

/* ---- writing ------------------------------------------------------------ */

static uint64_t pad_to(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

/* Part of every tensor (part[i]), N parts in *n. */
static int plan_parts(const kv_gguf *g, uint32_t n_split, uint64_t max_bytes, uint32_t *part, uint32_t *n,
                      kv_diag *d) {
    const size_t nt = kv_gguf_n_tensors(g);
    const uint64_t al = kv_gguf_alignment(g);
    uint64_t total = 0;
    for (size_t i = 0; i < nt; i++) total += pad_to(kv_gguf_tensor_at(g, i)->nbytes, al);
    uint32_t p = 0;
    uint64_t cur = 0, cum = 0; /* bytes in part p; bytes before tensor i */
    size_t in_p = 0;
    for (size_t i = 0; i < nt; i++) {
        const uint64_t b = pad_to(kv_gguf_tensor_at(g, i)->nbytes, al);
        bool next;
        if (n_split) /* past this part's share, or one tensor left per remaining part */
            next = in_p > 0 && p + 1 < n_split &&
                   (cum >= (total / n_split) * (p + 1) || nt - i <= (size_t)(n_split - 1 - p));
        else
            next = in_p > 0 && cur + b > max_bytes;
        if (next) {
            if (++p >= KV_GGUF_MAX_SPLITS)
                return kv_fail(d, KV_ERANGE, "gguf-split: parts of at most %" PRIu64 " bytes would need more than %u "
                               "parts", max_bytes, KV_GGUF_MAX_SPLITS);
            cur = 0;
            in_p = 0;
        }
        part[i] = p;
        cur += b;
        cum += b;
        in_p++;
    }
    *n = p + 1;
    return 0;
}

/* Writes tensor data, leaving all-zero blocks as holes. fd (or -1) reads
 * the file holding t: a chunk inside one of its holes (SEEK_DATA) is
 * skipped unread, so a sparse skeleton splits in time proportional to its
 * data. */
static int write_tensor(kv_gguf_writer *w, size_t idx, const kv_gguf_tensor *t, int fd, kv_diag *d) {
    static const uint8_t zeros[KV_SPLIT_CHUNK];
    const uint8_t *src = t->data;
    uint64_t hole_to = 0; /* file offsets below this (from the last SEEK_DATA) are a hole */
    for (uint64_t at = 0; at < t->nbytes; at += KV_SPLIT_CHUNK) {
        const size_t k = t->nbytes - at < KV_SPLIT_CHUNK ? (size_t)(t->nbytes - at) : KV_SPLIT_CHUNK;
        const uint64_t a = t->file_offset + at;
        if (fd >= 0 && a + k > hole_to) {
            const off_t nd = lseek(fd, (off_t)a, SEEK_DATA);
            hole_to = nd >= 0 ? (uint64_t)nd : errno == ENXIO ? UINT64_MAX : 0;
        }
        if (a + k <= hole_to) continue;
        /* the chunk's runs of non-zero 4 KiB blocks; zero blocks stay holes */
        for (size_t b = 0; b < k;) {
            size_t e = b;
            while (e < k) {
                const size_t m = k - e < KV_SPLIT_BLOCK ? k - e : KV_SPLIT_BLOCK;
                if (!memcmp(src + at + e, zeros, m)) break;
                e += m;
            }
            if (e > b) {
                int rc = kv_gguf_writer_write_data(w, idx, at + b, src + at + b, e - b, d);
                if (rc) return rc;
            }
            b = e < k ? e + (k - e < KV_SPLIT_BLOCK ? k - e : KV_SPLIT_BLOCK) : k;
        }
    }
    return 0;
}

static int write_part(const kv_gguf *g, const uint32_t *part, uint32_t p, uint32_t n, const char *path,
                      kv_diag *d) {
    kv_gguf_writer *w = NULL;
    int rc = kv_gguf_writer_new(&w, d);
    if (rc) return rc;
    const size_t nt = kv_gguf_n_tensors(g);
    for (size_t i = 0; i < kv_gguf_n_kv(g) && !rc; i++) {
        const kv_gguf_kv *kv = kv_gguf_kv_at(g, i);
        if (is_split_key(kv->key)) continue;
        if (p == 0 || kv_str_eq(kv->key, "general.alignment")) rc = kv_gguf_writer_copy_kv(w, kv, d);
    }
    if (!rc) rc = kv_gguf_writer_set_u16(w, KV_SPLIT_KEY_NO, (uint16_t)p, d);
    if (!rc) rc = kv_gguf_writer_set_u16(w, KV_SPLIT_KEY_COUNT, (uint16_t)n, d);
    if (!rc) rc = kv_gguf_writer_set_i32(w, KV_SPLIT_KEY_TENSORS, (int32_t)nt, d);
    for (size_t i = 0; i < nt && !rc; i++) {
        if (part[i] != p) continue;
        const kv_gguf_tensor *t = kv_gguf_tensor_at(g, i);
        char name[KV_GGUF_MAX_TENSOR_NAME + 1];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        rc = kv_gguf_writer_add_tensor(w, name, t->n_dims, t->ne, t->type, NULL, d);
    }
    char tmp[PATH_MAX + 8];
    snprintf(tmp, sizeof tmp, "%s.part", path);
    if (!rc) rc = kv_gguf_writer_begin(w, tmp, d);
    int fd = -1;
    uint32_t fd_part = 0; /* the source part fd reads */
    for (size_t i = 0, k = 0; i < nt && !rc; i++) {
        if (part[i] != p) continue;
        const kv_gguf_tensor *t = kv_gguf_tensor_at(g, i);
        if (fd < 0 || fd_part != t->part) {
            if (fd >= 0) close(fd);
            const char *sp = kv_gguf_path(kv_gguf_part(g, t->part));
            fd = sp ? open(sp, O_RDONLY | O_CLOEXEC | O_NONBLOCK) : -1; /* -1: no hole skipping */
            fd_part = t->part;
        }
        rc = write_tensor(w, k++, t, fd, d);
    }
    if (fd >= 0) close(fd);
    if (!rc) rc = kv_gguf_writer_finish(w, d);
    if (!rc && rename(tmp, path)) rc = kv_fail(d, KV_EIO, "gguf-split: cannot rename '%s': %s", tmp, strerror(errno));
    kv_gguf_writer_free(w);
    if (rc) remove(tmp);
    return rc;
}

int kv_gguf_split_write(const char *src, const char *out_prefix, uint32_t n_split, uint64_t max_bytes,
                        uint32_t *n_out, kv_diag *d) {
    if (!!n_split == !!max_bytes)
        return kv_fail(d, KV_EINVAL, "gguf-split: give either a part count or a maximum part size");
    if (n_split > KV_GGUF_MAX_SPLITS)
        return kv_fail(d, KV_EINVAL, "gguf-split: %u parts, max %u", n_split, KV_GGUF_MAX_SPLITS);
    if (strlen(out_prefix) + KV_SPLIT_SUFFIX_MAX + 8 > PATH_MAX)
        return kv_fail(d, KV_EINVAL, "gguf-split: output prefix too long");
    kv_gguf *g = NULL;
    int rc = kv_gguf_open(&g, src, d);
    if (rc) return rc;
    const size_t nt = kv_gguf_n_tensors(g);
    uint32_t *part = malloc((nt ? nt : 1) * sizeof *part), n = 0;
    if (!part) rc = kv_fail(d, KV_ENOMEM, "gguf-split: out of memory");
    else if (nt == 0) rc = kv_fail(d, KV_EINVAL, "gguf-split: %s has no tensors to split", src);
    else if (n_split > nt) rc = kv_fail(d, KV_EINVAL, "gguf-split: %u parts but %s has only %zu tensors", n_split, src, nt);
    if (!rc) rc = plan_parts(g, n_split, max_bytes, part, &n, d);
    char path[PATH_MAX];
    for (uint32_t p = 0; p < n && !rc; p++) {
        snprintf(path, sizeof path, "%s" KV_SPLIT_SUFFIX, out_prefix, p + 1, n);
        rc = write_part(g, part, p, n, path, d);
    }
    if (!rc && n_out) *n_out = n;
    free(part);
    kv_gguf_close(g);
    return rc;
}
