/* GGUF v3 reader: parses and validates a whole file before handing out any
 * view into it.
 *
 * Everything is read through a bounded reader ({p, left}) with little-endian
 * helpers; no packed struct is ever cast over file bytes. Every count, length,
 * shape and offset is checked against what remains of the buffer and against
 * the KV_GGUF_MAX_* maxima before it is used to allocate, index or advance.
 * Allocations proportional to counts in the header happen only after the
 * count has been bounded by the bytes that could possibly hold it.
 *
 * Rules beyond "stay inside the buffer", chosen to accept exactly what
 * ggml's gguf.cpp accepts (or less):
 *   - version 3 only (1/2 named as obsolete, byte-swapped versions named as
 *     big-endian files);
 *   - keys non-empty, unique; general.alignment, if present, is a UINT32
 *     power of two in [1, KV_GGUF_MAX_ALIGNMENT];
 *   - arrays nest at most KV_GGUF_MAX_ARRAY_DEPTH deep (ggml accepts none);
 *   - tensor names non-empty, unique, shorter than ggml's 64-byte limit;
 *     1..4 dims, each ne in [0, INT64_MAX], element count < INT64_MAX; type
 *     known to kv_type_get_ref; ne[0] a multiple of the block size;
 *   - tensor data packed in declaration order: each offset is a multiple of
 *     the alignment and equals the padded end of the previous tensor (ggml
 *     requires this exact layout, which also rules out overlap), and every
 *     data range lies inside the file.
 *
 * Lookups by key or tensor name go through open-addressing hash tables built
 * at open time, so a hostile file with a million tensors costs O(n), not
 * O(n^2), to check for duplicates.
 *
 * This file reads one file (kv_gguf_open_file, kv_gguf_open_mem);
 * kv_gguf_open then hands a part of a split model to gguf_split.c, which
 * opens its siblings the same way and merges them into one handle. */
#include "kvasir/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvasir/quant.h"
#include "gguf/gguf_internal.h"

/* Smallest possible encodings, used to bound counts by the bytes left. */
#define KV_GGUF_MIN_KV_BYTES 14u     /* u64 len + 1 byte key + u32 type + 1-byte value */
#define KV_GGUF_MIN_TENSOR_BYTES 33u /* u64 len + 1 byte name + u32 n_dims + u64 ne + u32 type + u64 off */
#define KV_GGUF_MIN_ARRAY_BYTES 12u  /* u32 elem_type + u64 n (an empty nested array) */

/* ---- bounded reader --------------------------------------------------- */

typedef struct kv_rd {
    const uint8_t *p;    /* next unread byte */
    size_t left;         /* bytes remaining after p */
    const uint8_t *base; /* start of the buffer, for offsets in messages */
} kv_rd;

static size_t rd_pos(const kv_rd *r) { return (size_t)(r->p - r->base); }

static int rd_bytes(kv_rd *r, size_t n, const uint8_t **out) {
    if (n > r->left) return 0;
    *out = r->p;
    r->p += n;
    r->left -= n;
    return 1;
}

static int rd_u8(kv_rd *r, uint8_t *v) {
    if (r->left < 1) return 0;
    *v = r->p[0];
    r->p += 1;
    r->left -= 1;
    return 1;
}

static uint16_t le16(const uint8_t *p) { return (uint16_t)(p[0] | (uint16_t)p[1] << 8); }
static uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t le64(const uint8_t *p) { return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32; }

static int rd_u16(kv_rd *r, uint16_t *v) {
    if (r->left < 2) return 0;
    *v = le16(r->p);
    r->p += 2;
    r->left -= 2;
    return 1;
}
static int rd_u32(kv_rd *r, uint32_t *v) {
    if (r->left < 4) return 0;
    *v = le32(r->p);
    r->p += 4;
    r->left -= 4;
    return 1;
}
static int rd_u64(kv_rd *r, uint64_t *v) {
    if (r->left < 8) return 0;
    *v = le64(r->p);
    r->p += 8;
    r->left -= 8;
    return 1;
}

/* ---- message helpers -------------------------------------------------- */

/* Copies untrusted bytes into buf for a one-line message: non-printable
 * bytes become '?', long names are cut with "...". */
static const char *safe_name(char *buf, size_t cap, const char *s, size_t len) {
    size_t o = 0, lim = cap - 4;
    for (size_t i = 0; i < len && o < lim; i++) {
        unsigned char c = (unsigned char)s[i];
        buf[o++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
    }
    if (len > lim) {
        memcpy(buf + o, "...", 3);
        o += 3;
    }
    buf[o] = '\0';
    return buf;
}
#define SAFE(buf, str) safe_name((buf), sizeof(buf), (str).ptr, (str).len)

static int truncated(kv_diag *d, const kv_rd *r, const char *what) {
    return kv_fail(d, KV_EFORMAT, "file truncated at offset %zu reading %s", rd_pos(r), what);
}

/* ---- public small helpers --------------------------------------------- */

size_t kv_gguf_type_size(uint32_t type) {
    switch (type) {
    case KV_GGUF_UINT8: case KV_GGUF_INT8: case KV_GGUF_BOOL: return 1;
    case KV_GGUF_UINT16: case KV_GGUF_INT16: return 2;
    case KV_GGUF_UINT32: case KV_GGUF_INT32: case KV_GGUF_FLOAT32: return 4;
    case KV_GGUF_UINT64: case KV_GGUF_INT64: case KV_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

const char *kv_gguf_type_name(uint32_t type) {
    static const char *const names[KV_GGUF_TYPE_COUNT] = {
        "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "str", "arr", "u64", "i64", "f64",
    };
    return type < KV_GGUF_TYPE_COUNT ? names[type] : "unknown";
}

bool kv_str_eq(kv_str s, const char *c) {
    size_t n = strlen(c);
    return n == s.len && (n == 0 || memcmp(s.ptr, c, n) == 0);
}

/* ---- hash tables ------------------------------------------------------ */

static uint64_t str_hash(const char *p, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)p[i];
        h *= 1099511628211ull;
    }
    return h;
}

size_t kv_gguf_hash_cap(size_t n) {
    size_t cap = 8;
    while (cap < 2 * n) cap <<= 1;
    return cap;
}

/* Inserts index i (name s) into table; returns the index+1 of an existing
 * entry with the same name, or 0 if inserted. */
uint32_t kv_gguf_hash_insert(uint32_t *tab, size_t cap, const kv_str *names, size_t stride,
                             kv_str s, size_t i) {
    size_t m = cap - 1, h = (size_t)str_hash(s.ptr, s.len) & m;
    for (;;) {
        uint32_t e = tab[h];
        if (e == 0) {
            tab[h] = (uint32_t)(i + 1);
            return 0;
        }
        const kv_str *o = (const kv_str *)((const char *)names + (size_t)(e - 1) * stride);
        if (o->len == s.len && memcmp(o->ptr, s.ptr, s.len) == 0) return e;
        h = (h + 1) & m;
    }
}

static long hash_find(const uint32_t *tab, size_t cap, const kv_str *names, size_t stride,
                      const char *s) {
    if (!tab) return -1;
    size_t n = strlen(s), m = cap - 1, h = (size_t)str_hash(s, n) & m;
    for (;;) {
        uint32_t e = tab[h];
        if (e == 0) return -1;
        const kv_str *o = (const kv_str *)((const char *)names + (size_t)(e - 1) * stride);
        if (o->len == n && memcmp(o->ptr, s, n) == 0) return (long)(e - 1);
        h = (h + 1) & m;
    }
}

/* ---- metadata values -------------------------------------------------- */

/* Reads a string (u64 len + bytes), bounded by max. `what` names it in
 * messages; key (may be NULL) is the metadata key it belongs to. */
static int rd_str(kv_rd *r, uint64_t max, kv_str *out, const char *what, const char *key,
                  kv_diag *d) {
    uint64_t len;
    const uint8_t *p;
    char ctx[160];
    if (key)
        snprintf(ctx, sizeof ctx, "key '%s': %s", key, what);
    else
        snprintf(ctx, sizeof ctx, "%s", what);
    if (!rd_u64(r, &len)) return truncated(d, r, ctx);
    if (len > max)
        return kv_fail(d, KV_EFORMAT, "%s: string of %" PRIu64 " bytes, max %" PRIu64, ctx, len, max);
    if (len > r->left)
        return kv_fail(d, KV_EFORMAT,
                       "%s: string of %" PRIu64 " bytes at offset %zu runs past end of file "
                       "(%zu bytes left)",
                       ctx, len, rd_pos(r), r->left);
    rd_bytes(r, (size_t)len, &p);
    out->ptr = (const char *)p;
    out->len = (size_t)len;
    return 0;
}

static int rd_value(kv_rd *r, uint32_t type, unsigned depth, const char *key, kv_gguf_value *v,
                    kv_diag *d);

/* Reads an array body (after the ARRAY type tag) at nesting depth `depth`
 * (1 for a top-level array). */
static int rd_array(kv_rd *r, unsigned depth, const char *key, kv_gguf_value *v, kv_diag *d) {
    uint32_t et;
    uint64_t n;
    if (depth > KV_GGUF_MAX_ARRAY_DEPTH)
        return kv_fail(d, KV_EFORMAT, "key '%s': arrays nested %u deep, max %u", key, depth,
                       KV_GGUF_MAX_ARRAY_DEPTH);
    if (!rd_u32(r, &et)) return truncated(d, r, "array element type");
    if (!rd_u64(r, &n)) return truncated(d, r, "array element count");
    if (et >= KV_GGUF_TYPE_COUNT)
        return kv_fail(d, KV_EFORMAT, "key '%s': array of unknown value type %" PRIu32, key, et);
    if (n > KV_GGUF_MAX_ARRAY)
        return kv_fail(d, KV_EFORMAT, "key '%s': array of %" PRIu64 " elements, max %u", key, n,
                       KV_GGUF_MAX_ARRAY);
    const uint8_t *start = r->p;
    size_t es = kv_gguf_type_size(et);
    /* The cheapest element still takes es (scalar), 8 (string) or 12 (array)
     * bytes: reject counts the remaining bytes cannot hold before walking. */
    size_t min_es = es ? es : (et == KV_GGUF_STRING ? 8 : KV_GGUF_MIN_ARRAY_BYTES);
    if (n > r->left / min_es)
        return kv_fail(d, KV_EFORMAT,
                       "key '%s': array of %" PRIu64 " %s elements at offset %zu runs past end "
                       "of file (%zu bytes left)",
                       key, n, kv_gguf_type_name(et), rd_pos(r), r->left);
    if (es) {
        const uint8_t *p = r->p;
        rd_bytes(r, (size_t)n * es, &p);
        if (et == KV_GGUF_BOOL)
            for (uint64_t i = 0; i < n; i++)
                if (p[i] > 1)
                    return kv_fail(d, KV_EFORMAT, "key '%s': bool element %" PRIu64 " is %u, not 0 or 1",
                                   key, i, p[i]);
    } else {
        for (uint64_t i = 0; i < n; i++) {
            kv_gguf_value tmp;
            int rc = et == KV_GGUF_STRING
                         ? rd_str(r, KV_GGUF_MAX_STRING, &tmp.v.str, "array string", key, d)
                         : rd_value(r, et, depth + 1, key, &tmp, d);
            if (rc) return rc;
        }
    }
    v->type = KV_GGUF_ARRAY;
    v->v.arr.elem_type = et;
    v->v.arr.n = n;
    v->v.arr.data = start;
    v->v.arr.nbytes = (size_t)(r->p - start);
    return 0;
}

static int rd_value(kv_rd *r, uint32_t type, unsigned depth, const char *key, kv_gguf_value *v,
                    kv_diag *d) {
    uint8_t b;
    uint16_t h;
    uint32_t w;
    uint64_t q;
    memset(v, 0, sizeof *v);
    v->type = type;
    switch (type) {
    case KV_GGUF_UINT8:
        if (!rd_u8(r, &b)) return truncated(d, r, "u8 value");
        v->v.u64 = b;
        return 0;
    case KV_GGUF_INT8:
        if (!rd_u8(r, &b)) return truncated(d, r, "i8 value");
        v->v.i64 = (int8_t)b;
        return 0;
    case KV_GGUF_BOOL:
        if (!rd_u8(r, &b)) return truncated(d, r, "bool value");
        if (b > 1) return kv_fail(d, KV_EFORMAT, "key '%s': bool value %u is not 0 or 1", key, b);
        v->v.u64 = b;
        return 0;
    case KV_GGUF_UINT16:
        if (!rd_u16(r, &h)) return truncated(d, r, "u16 value");
        v->v.u64 = h;
        return 0;
    case KV_GGUF_INT16:
        if (!rd_u16(r, &h)) return truncated(d, r, "i16 value");
        v->v.i64 = (int16_t)h;
        return 0;
    case KV_GGUF_UINT32:
        if (!rd_u32(r, &w)) return truncated(d, r, "u32 value");
        v->v.u64 = w;
        return 0;
    case KV_GGUF_INT32:
        if (!rd_u32(r, &w)) return truncated(d, r, "i32 value");
        v->v.i64 = (int32_t)w;
        return 0;
    case KV_GGUF_FLOAT32: {
        float f;
        if (!rd_u32(r, &w)) return truncated(d, r, "f32 value");
        memcpy(&f, &w, sizeof f);
        v->v.f64 = f;
        return 0;
    }
    case KV_GGUF_UINT64:
        if (!rd_u64(r, &q)) return truncated(d, r, "u64 value");
        v->v.u64 = q;
        return 0;
    case KV_GGUF_INT64:
        if (!rd_u64(r, &q)) return truncated(d, r, "i64 value");
        v->v.i64 = (int64_t)q;
        return 0;
    case KV_GGUF_FLOAT64: {
        double f;
        if (!rd_u64(r, &q)) return truncated(d, r, "f64 value");
        memcpy(&f, &q, sizeof f);
        v->v.f64 = f;
        return 0;
    }
    case KV_GGUF_STRING:
        return rd_str(r, KV_GGUF_MAX_STRING, &v->v.str, "value", key, d);
    case KV_GGUF_ARRAY:
        return rd_array(r, depth, key, v, d);
    default:
        return kv_fail(d, KV_EFORMAT, "key '%s' has unknown value type %" PRIu32, key, type);
    }
}

/* ---- open ------------------------------------------------------------- */

void kv_gguf_close(kv_gguf *g) {
    if (!g) return;
    if (g->mapped && g->base) munmap((void *)g->base, g->size);
    if (!g->borrowed_kvs) {
        free(g->kvs);
        free(g->kv_hash);
    }
    free(g->tensors);
    free(g->t_hash);
    if (g->parts)
        for (size_t i = 0; i < g->n_parts; i++) kv_gguf_close(g->parts[i]);
    free(g->parts);
    free(g->path);
    free(g);
}

static int parse_header(kv_gguf *g, kv_diag *d) {
    kv_rd r = {g->base, g->size, g->base};
    uint32_t magic, version;
    uint64_t n_tensors, n_kv;
    char nb[96];
    int rc;

    if (!rd_u32(&r, &magic)) return truncated(d, &r, "magic");
    if (magic != KV_GGUF_MAGIC) {
        char m[4];
        for (int i = 0; i < 4; i++) {
            unsigned char c = g->base[i];
            m[i] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
        }
        return kv_fail(d, KV_EFORMAT, "bad magic '%.4s' (0x%08" PRIx32 "), expected 'GGUF': not a GGUF file",
                       m, magic);
    }
    if (!rd_u32(&r, &version)) return truncated(d, &r, "version");
    if (version == 0) return kv_fail(d, KV_EFORMAT, "bad version 0");
    if ((version & 0xffffu) == 0)
        return kv_fail(d, KV_EUNSUPPORTED,
                       "version field is 0x%08" PRIx32 ": this is a big-endian GGUF file "
                       "(byte-swapped version %" PRIu32 "); only little-endian files are supported",
                       version, (uint32_t)__builtin_bswap32(version));
    if (version == 1 || version == 2)
        return kv_fail(d, KV_EUNSUPPORTED,
                       "version %" PRIu32 " is obsolete; only GGUF version 3 is supported "
                       "(re-convert the model with a current llama.cpp)",
                       version);
    if (version != KV_GGUF_VERSION)
        return kv_fail(d, KV_EUNSUPPORTED, "version %" PRIu32 " is newer than the supported version 3",
                       version);
    g->version = version;
    if (!rd_u64(&r, &n_tensors)) return truncated(d, &r, "tensor count");
    if (!rd_u64(&r, &n_kv)) return truncated(d, &r, "metadata count");
    if (n_tensors > KV_GGUF_MAX_TENSORS)
        return kv_fail(d, KV_EFORMAT, "%" PRIu64 " tensors, max %u", n_tensors, KV_GGUF_MAX_TENSORS);
    if (n_kv > KV_GGUF_MAX_KV)
        return kv_fail(d, KV_EFORMAT, "%" PRIu64 " metadata pairs, max %u", n_kv, KV_GGUF_MAX_KV);
    /* Bound both counts by the bytes that could hold them before allocating. */
    if (n_kv > r.left / KV_GGUF_MIN_KV_BYTES ||
        n_tensors > (r.left - n_kv * KV_GGUF_MIN_KV_BYTES) / KV_GGUF_MIN_TENSOR_BYTES)
        return kv_fail(d, KV_EFORMAT,
                       "header claims %" PRIu64 " metadata pairs and %" PRIu64
                       " tensors but only %zu bytes follow",
                       n_kv, n_tensors, r.left);

    g->kvs = calloc(n_kv ? (size_t)n_kv : 1, sizeof *g->kvs);
    g->tensors = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof *g->tensors);
    g->kv_hash_cap = kv_gguf_hash_cap((size_t)n_kv);
    g->t_hash_cap = kv_gguf_hash_cap((size_t)n_tensors);
    g->kv_hash = calloc(g->kv_hash_cap, sizeof *g->kv_hash);
    g->t_hash = calloc(g->t_hash_cap, sizeof *g->t_hash);
    if (!g->kvs || !g->tensors || !g->kv_hash || !g->t_hash)
        return kv_fail(d, KV_ENOMEM, "out of memory for %" PRIu64 " pairs and %" PRIu64 " tensors",
                       n_kv, n_tensors);

    /* metadata */
    for (size_t i = 0; i < (size_t)n_kv; i++) {
        kv_gguf_kv *kv = &g->kvs[i];
        uint32_t type;
        char what[48];
        snprintf(what, sizeof what, "key %zu", i);
        if ((rc = rd_str(&r, KV_GGUF_MAX_NAME, &kv->key, what, NULL, d))) return rc;
        if (kv->key.len == 0) return kv_fail(d, KV_EFORMAT, "key %zu is empty", i);
        SAFE(nb, kv->key);
        uint32_t dup = kv_gguf_hash_insert(g->kv_hash, g->kv_hash_cap, &g->kvs[0].key, sizeof *g->kvs,
                                   kv->key, i);
        if (dup) return kv_fail(d, KV_EFORMAT, "duplicate key '%s' (pairs %u and %zu)", nb, dup - 1, i);
        if (!rd_u32(&r, &type)) return truncated(d, &r, "value type");
        if ((rc = rd_value(&r, type, 1, nb, &kv->val, d))) return rc;
        g->n_kv = i + 1;
    }

    /* alignment */
    g->alignment = KV_GGUF_DEFAULT_ALIGNMENT;
    const kv_gguf_kv *al = kv_gguf_find_kv(g, "general.alignment");
    if (al) {
        if (al->val.type != KV_GGUF_UINT32)
            return kv_fail(d, KV_EFORMAT, "key 'general.alignment' has type %s, must be u32",
                           kv_gguf_type_name(al->val.type));
        uint64_t a = al->val.v.u64;
        if (a == 0 || (a & (a - 1)) != 0 || a > KV_GGUF_MAX_ALIGNMENT)
            return kv_fail(d, KV_EFORMAT,
                           "general.alignment %" PRIu64 " is not a power of two in [1, %u]", a,
                           KV_GGUF_MAX_ALIGNMENT);
        g->alignment = (size_t)a;
    }

    /* tensor infos */
    for (size_t i = 0; i < (size_t)n_tensors; i++) {
        kv_gguf_tensor *t = &g->tensors[i];
        char what[48];
        snprintf(what, sizeof what, "tensor %zu name", i);
        if ((rc = rd_str(&r, KV_GGUF_MAX_NAME, &t->name, what, NULL, d))) return rc;
        if (t->name.len == 0) return kv_fail(d, KV_EFORMAT, "tensor %zu has an empty name", i);
        SAFE(nb, t->name);
        if (t->name.len > KV_GGUF_MAX_TENSOR_NAME)
            return kv_fail(d, KV_EFORMAT, "tensor '%s' name is %zu bytes, max %u", nb, t->name.len,
                           KV_GGUF_MAX_TENSOR_NAME);
        uint32_t dup = kv_gguf_hash_insert(g->t_hash, g->t_hash_cap, &g->tensors[0].name,
                                   sizeof *g->tensors, t->name, i);
        if (dup)
            return kv_fail(d, KV_EFORMAT, "duplicate tensor name '%s' (tensors %u and %zu)", nb,
                           dup - 1, i);
        if (!rd_u32(&r, &t->n_dims)) return truncated(d, &r, "tensor dims");
        if (t->n_dims == 0 || t->n_dims > KV_GGUF_MAX_DIMS)
            return kv_fail(d, KV_EFORMAT, "tensor '%s' has %" PRIu32 " dims, must be 1..%u", nb,
                           t->n_dims, KV_GGUF_MAX_DIMS);
        uint64_t nel = 1;
        for (uint32_t j = 0; j < KV_GGUF_MAX_DIMS; j++) {
            t->ne[j] = 1;
            if (j < t->n_dims && !rd_u64(&r, &t->ne[j])) return truncated(d, &r, "tensor shape");
            if (t->ne[j] > (uint64_t)INT64_MAX)
                return kv_fail(d, KV_EFORMAT, "tensor '%s' dim %" PRIu32 " has %" PRIu64 " elements", nb,
                               j, t->ne[j]);
        }
        for (uint32_t j = 0; j < KV_GGUF_MAX_DIMS; j++) {
            if (t->ne[j] != 0 && nel > (uint64_t)INT64_MAX / t->ne[j])
                return kv_fail(d, KV_EFORMAT,
                               "tensor '%s' shape [%" PRIu64 ", %" PRIu64 ", %" PRIu64 ", %" PRIu64
                               "] has too many elements",
                               nb, t->ne[0], t->ne[1], t->ne[2], t->ne[3]);
            nel *= t->ne[j];
        }
        if (!rd_u32(&r, &t->type)) return truncated(d, &r, "tensor type");
        const kv_type_info *ti = kv_type_get_ref(t->type);
        if (!ti)
            return kv_fail(d, KV_EUNSUPPORTED, "tensor '%s' has unknown type id %" PRIu32, nb, t->type);
        if (t->ne[0] % ti->blck)
            return kv_fail(d, KV_EFORMAT,
                           "tensor '%s' of type %s has %" PRIu64
                           " elements per row, not a multiple of its block size %u",
                           nb, ti->name, t->ne[0], ti->blck);
        uint64_t nb_row = t->ne[0] / ti->blck * ti->size, rows = nel ? nel / t->ne[0] : 0;
        if (rows && nb_row > UINT64_MAX / rows)
            return kv_fail(d, KV_EFORMAT, "tensor '%s' size in bytes overflows", nb);
        t->nbytes = nb_row * rows;
        if (!rd_u64(&r, &t->offset)) return truncated(d, &r, "tensor offset");
        g->n_tensors = i + 1;
    }

    /* data section: aligned start, tensors packed in order inside the file */
    uint64_t hdr_end = rd_pos(&r);
    g->data_offset = hdr_end;
    if (n_tensors > 0) {
        g->data_offset = (hdr_end + g->alignment - 1) & ~(uint64_t)(g->alignment - 1);
        if (g->data_offset > g->size)
            return kv_fail(d, KV_EFORMAT,
                           "data section would start at offset %" PRIu64 ", past end of file (%zu bytes)",
                           g->data_offset, g->size);
    }
    uint64_t expect = 0;
    for (size_t i = 0; i < g->n_tensors; i++) {
        kv_gguf_tensor *t = &g->tensors[i];
        SAFE(nb, t->name);
        if (t->offset % g->alignment)
            return kv_fail(d, KV_EFORMAT,
                           "tensor '%s' data offset %" PRIu64 " is not a multiple of the alignment %zu", nb,
                           t->offset, g->alignment);
        uint64_t room = g->size - g->data_offset;
        if (t->offset > room || t->nbytes > room - t->offset)
            return kv_fail(d, KV_EFORMAT,
                           "tensor '%s' data [%" PRIu64 ", +%" PRIu64 ") runs past end of file (data "
                           "section holds %" PRIu64 " bytes)",
                           nb, t->offset, t->nbytes, room);
        if (t->offset != expect) {
            if (i > 0 && t->offset < expect) {
                const kv_gguf_tensor *p = &g->tensors[i - 1];
                char pb[96];
                SAFE(pb, p->name);
                if (t->offset < p->offset + p->nbytes && p->offset < t->offset + t->nbytes)
                    return kv_fail(d, KV_EFORMAT,
                                   "tensor '%s' data [%" PRIu64 ", %" PRIu64 ") overlaps tensor '%s' [%" PRIu64
                                   ", %" PRIu64 ")",
                                   nb, t->offset, t->offset + t->nbytes, pb, p->offset,
                                   p->offset + p->nbytes);
            }
            return kv_fail(d, KV_EFORMAT,
                           "tensor '%s' has data offset %" PRIu64 ", expected %" PRIu64
                           " (tensor data must be packed in declaration order)",
                           nb, t->offset, expect);
        }
        t->file_offset = g->data_offset + t->offset;
        t->data = g->base + t->file_offset;
        /* t->offset + nbytes <= size, so this padding cannot overflow */
        expect = (t->offset + t->nbytes + g->alignment - 1) & ~(uint64_t)(g->alignment - 1);
    }
    return 0;
}

static int open_common(kv_gguf **out, kv_gguf *g, kv_diag *d) {
    int rc = parse_header(g, d);
    if (rc) {
        kv_gguf_close(g);
        return rc;
    }
    *out = g;
    return 0;
}

int kv_gguf_open_mem(kv_gguf **out, const void *buf, size_t size, kv_diag *d) {
    *out = NULL;
    if (!buf && size) return kv_fail(d, KV_EINVAL, "gguf: NULL buffer");
    kv_gguf *g = calloc(1, sizeof *g);
    if (!g) return kv_fail(d, KV_ENOMEM, "gguf: out of memory");
    static const uint8_t empty[1];
    g->base = buf ? buf : empty;
    g->size = size;
    g->n_parts = 1;
    int rc = open_common(out, g, d);
    if (rc) kv_diag_prefix(d, rc, "gguf");
    return rc;
}

int kv_gguf_open(kv_gguf **out, const char *path, kv_diag *d) {
    int rc = kv_gguf_open_file(out, path, d);
    if (!rc) rc = kv_gguf_split_assemble(out, d);
    return rc;
}

int kv_gguf_open_file(kv_gguf **out, const char *path, kv_diag *d) {
    *out = NULL;
    /* Refuse anything but a regular file before opening it: open(2) on a
     * FIFO blocks until a writer comes, and a device may do anything. The
     * open is nonblocking in case the name was swapped since the stat, and
     * the descriptor is checked again (same file, still regular). */
    struct stat st, st0;
    if (stat(path, &st0) != 0) return kv_fail(d, KV_EIO, "gguf: %s: cannot open: %s", path, strerror(errno));
    if (!S_ISREG(st0.st_mode)) return kv_fail(d, KV_EIO, "gguf: %s: not a regular file", path);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return kv_fail(d, KV_EIO, "gguf: %s: cannot open: %s", path, strerror(errno));
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return kv_fail(d, KV_EIO, "gguf: %s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode) || st.st_dev != st0.st_dev || st.st_ino != st0.st_ino) {
        close(fd);
        return kv_fail(d, KV_EIO, "gguf: %s: not a regular file", path);
    }
    if (st.st_size == 0) {
        close(fd);
        return kv_fail(d, KV_EFORMAT, "gguf: %s: file is empty", path);
    }
    if ((uint64_t)st.st_size > (uint64_t)SIZE_MAX) {
        close(fd);
        return kv_fail(d, KV_ERANGE, "gguf: %s: file too large to map", path);
    }
    size_t size = (size_t)st.st_size;
    void *m = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (m == MAP_FAILED) return kv_fail(d, KV_EIO, "gguf: %s: mmap failed: %s", path, strerror(e));
    kv_gguf *g = calloc(1, sizeof *g);
    if (!g) {
        munmap(m, size);
        return kv_fail(d, KV_ENOMEM, "gguf: out of memory");
    }
    g->base = m;
    g->size = size;
    g->mapped = 1;
    g->n_parts = 1;
    if (!(g->path = strdup(path))) {
        kv_gguf_close(g);
        return kv_fail(d, KV_ENOMEM, "gguf: out of memory");
    }
    int rc = open_common(out, g, d);
    if (rc) kv_diag_prefix(d, rc, "gguf: %s", path);
    return rc;
}

/* ---- accessors -------------------------------------------------------- */

uint32_t kv_gguf_version(const kv_gguf *g) { return g->version; }
size_t kv_gguf_alignment(const kv_gguf *g) { return g->alignment; }
uint64_t kv_gguf_data_offset(const kv_gguf *g) { return g->data_offset; }
uint64_t kv_gguf_file_size(const kv_gguf *g) { return g->size; }
const void *kv_gguf_base(const kv_gguf *g) { return g->base; }
size_t kv_gguf_n_kv(const kv_gguf *g) { return g->n_kv; }
size_t kv_gguf_n_tensors(const kv_gguf *g) { return g->n_tensors; }
size_t kv_gguf_n_parts(const kv_gguf *g) { return g->n_parts; }
const char *kv_gguf_path(const kv_gguf *g) { return g->path; }

const kv_gguf *kv_gguf_part(const kv_gguf *g, size_t i) {
    if (!g->parts) return i == 0 ? g : NULL;
    return i < g->n_parts ? g->parts[i] : NULL;
}

uint64_t kv_gguf_total_size(const kv_gguf *g) {
    uint64_t n = 0;
    for (size_t i = 0; i < g->n_parts; i++) n += kv_gguf_part(g, i)->size;
    return n;
}

const kv_gguf_kv *kv_gguf_kv_at(const kv_gguf *g, size_t i) {
    return i < g->n_kv ? &g->kvs[i] : NULL;
}

const kv_gguf_tensor *kv_gguf_tensor_at(const kv_gguf *g, size_t i) {
    return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const kv_gguf_kv *kv_gguf_find_kv(const kv_gguf *g, const char *key) {
    long i = hash_find(g->kv_hash, g->kv_hash_cap, &g->kvs[0].key, sizeof *g->kvs, key);
    return i >= 0 && (size_t)i < g->n_kv ? &g->kvs[i] : NULL;
}

const kv_gguf_tensor *kv_gguf_find_tensor(const kv_gguf *g, const char *name) {
    long i = hash_find(g->t_hash, g->t_hash_cap, &g->tensors[0].name, sizeof *g->tensors, name);
    return i >= 0 && (size_t)i < g->n_tensors ? &g->tensors[i] : NULL;
}

/* ---- typed getters ---------------------------------------------------- */

static const kv_gguf_kv *get_kv(const kv_gguf *g, const char *key, kv_diag *d) {
    const kv_gguf_kv *kv = kv_gguf_find_kv(g, key);
    if (!kv) kv_fail(d, KV_ENOTFOUND, "key '%s' not found", key);
    return kv;
}

static int is_uint(uint32_t t) {
    return t == KV_GGUF_UINT8 || t == KV_GGUF_UINT16 || t == KV_GGUF_UINT32 || t == KV_GGUF_UINT64;
}
static int is_sint(uint32_t t) {
    return t == KV_GGUF_INT8 || t == KV_GGUF_INT16 || t == KV_GGUF_INT32 || t == KV_GGUF_INT64;
}

/* Integer value of kv within [lo, hi] (hi as u64, lo as i64 <= 0). */
static int get_int(const kv_gguf *g, const char *key, int64_t lo, uint64_t hi, int *neg,
                   uint64_t *mag, kv_diag *d) {
    const kv_gguf_kv *kv = get_kv(g, key, d);
    if (!kv) return KV_ENOTFOUND;
    uint32_t t = kv->val.type;
    if (is_uint(t)) {
        if (kv->val.v.u64 > hi)
            return kv_fail(d, KV_EFORMAT, "key '%s' value %" PRIu64 " is out of range", key,
                           kv->val.v.u64);
        *neg = 0;
        *mag = kv->val.v.u64;
        return 0;
    }
    if (is_sint(t)) {
        int64_t v = kv->val.v.i64;
        if (v < lo || (v >= 0 && (uint64_t)v > hi))
            return kv_fail(d, KV_EFORMAT, "key '%s' value %" PRId64 " is out of range", key, v);
        *neg = v < 0;
        *mag = v < 0 ? (uint64_t)(-(v + 1)) + 1 : (uint64_t)v;
        return 0;
    }
    return kv_fail(d, KV_EFORMAT, "key '%s' has type %s, expected an integer", key,
                   kv_gguf_type_name(t));
}

int kv_gguf_get_u32(const kv_gguf *g, const char *key, uint32_t *out, kv_diag *d) {
    int neg;
    uint64_t m;
    int rc = get_int(g, key, 0, UINT32_MAX, &neg, &m, d);
    if (!rc) *out = (uint32_t)m;
    return rc;
}

int kv_gguf_get_i32(const kv_gguf *g, const char *key, int32_t *out, kv_diag *d) {
    int neg;
    uint64_t m;
    int rc = get_int(g, key, INT32_MIN, INT32_MAX, &neg, &m, d);
    if (!rc) *out = neg ? (int32_t)(-(int64_t)m) : (int32_t)m;
    return rc;
}

int kv_gguf_get_u64(const kv_gguf *g, const char *key, uint64_t *out, kv_diag *d) {
    int neg;
    uint64_t m;
    int rc = get_int(g, key, 0, UINT64_MAX, &neg, &m, d);
    if (!rc) *out = m;
    return rc;
}

int kv_gguf_get_f32(const kv_gguf *g, const char *key, float *out, kv_diag *d) {
    const kv_gguf_kv *kv = get_kv(g, key, d);
    if (!kv) return KV_ENOTFOUND;
    if (kv->val.type != KV_GGUF_FLOAT32 && kv->val.type != KV_GGUF_FLOAT64)
        return kv_fail(d, KV_EFORMAT, "key '%s' has type %s, expected a float", key,
                       kv_gguf_type_name(kv->val.type));
    double v = kv->val.v.f64;
    if (isfinite(v) && fabs(v) > FLT_MAX)
        return kv_fail(d, KV_EFORMAT, "key '%s' value %g does not fit in f32", key, v);
    *out = (float)v;
    return 0;
}

int kv_gguf_get_bool(const kv_gguf *g, const char *key, bool *out, kv_diag *d) {
    const kv_gguf_kv *kv = get_kv(g, key, d);
    if (!kv) return KV_ENOTFOUND;
    if (kv->val.type != KV_GGUF_BOOL)
        return kv_fail(d, KV_EFORMAT, "key '%s' has type %s, expected bool", key,
                       kv_gguf_type_name(kv->val.type));
    *out = kv->val.v.u64 != 0;
    return 0;
}

int kv_gguf_get_str(const kv_gguf *g, const char *key, kv_str *out, kv_diag *d) {
    const kv_gguf_kv *kv = get_kv(g, key, d);
    if (!kv) return KV_ENOTFOUND;
    if (kv->val.type != KV_GGUF_STRING)
        return kv_fail(d, KV_EFORMAT, "key '%s' has type %s, expected str", key,
                       kv_gguf_type_name(kv->val.type));
    *out = kv->val.v.str;
    return 0;
}

int kv_gguf_get_arr(const kv_gguf *g, const char *key, uint32_t elem_type, uint64_t *n,
                    const uint8_t **data, kv_diag *d) {
    const kv_gguf_kv *kv = get_kv(g, key, d);
    if (!kv) return KV_ENOTFOUND;
    if (kv->val.type != KV_GGUF_ARRAY || kv->val.v.arr.elem_type != elem_type)
        return kv_fail(d, KV_EFORMAT, "key '%s' has type %s%s%s, expected arr[%s]", key,
                       kv_gguf_type_name(kv->val.type), kv->val.type == KV_GGUF_ARRAY ? "[" : "",
                       kv->val.type == KV_GGUF_ARRAY
                           ? kv_gguf_type_name(kv->val.v.arr.elem_type)
                           : "",
                       kv_gguf_type_name(elem_type));
    *n = kv->val.v.arr.n;
    *data = kv->val.v.arr.data;
    return 0;
}

/* ---- string arrays ---------------------------------------------------- */

int kv_gguf_arr_str_iter(const kv_gguf_value *arr, size_t *pos, kv_str *out) {
    if (!arr || arr->type != KV_GGUF_ARRAY || arr->v.arr.elem_type != KV_GGUF_STRING)
        return KV_EINVAL;
    size_t nb = arr->v.arr.nbytes, p = *pos;
    if (p > nb || nb - p < 8) return KV_ERANGE;
    uint64_t len = le64(arr->v.arr.data + p);
    if (len > nb - p - 8) return KV_ERANGE;
    out->ptr = (const char *)arr->v.arr.data + p + 8;
    out->len = (size_t)len;
    *pos = p + 8 + (size_t)len;
    return 0;
}

int kv_gguf_arr_str(const kv_gguf_value *arr, uint64_t i, kv_str *out) {
    if (!arr || arr->type != KV_GGUF_ARRAY || arr->v.arr.elem_type != KV_GGUF_STRING)
        return KV_EINVAL;
    if (i >= arr->v.arr.n) return KV_ERANGE;
    size_t pos = 0;
    kv_str s;
    for (uint64_t k = 0; k <= i; k++) {
        int rc = kv_gguf_arr_str_iter(arr, &pos, &s);
        if (rc) return rc;
    }
    *out = s;
    return 0;
}
