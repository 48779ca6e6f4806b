/* GGUF v3 writer.
 *
 * Metadata and tensor infos are collected in memory (each metadata value
 * kept already serialized, little-endian, exactly as it will appear after
 * its type tag), then kv_gguf_writer_begin lays tensor data out in
 * declaration order, each tensor at a multiple of the alignment and padded
 * to it (the layout ggml requires), writes the header plus padding, and
 * leaves the file open. Tensor data goes in with pwrite at its final place,
 * in any order and in parts, so a generator can stream a model one slice at
 * a time. kv_gguf_writer_finish extends the file to its full size with
 * ftruncate, so tensors never written read as zeros from sparse holes.
 *
 * Everything the writer accepts, the reader accepts: the same maxima,
 * non-empty unique names, block-size multiples, a u32 power-of-two
 * general.alignment. */
#include "kvasir/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvasir/quant.h"

typedef struct kv_wkv {
    char *key;      /* NUL-terminated copy */
    uint32_t type;  /* enum kv_gguf_type of the value */
    uint8_t *val;   /* serialized value bytes (after the type tag) */
    size_t val_len; /* bytes */
} kv_wkv;

typedef struct kv_wtensor {
    char *name;                    /* NUL-terminated copy */
    uint32_t n_dims;               /* 1..4 */
    uint64_t ne[KV_GGUF_MAX_DIMS]; /* unused dims = 1 */
    uint32_t type;                 /* ggml type id */
    uint64_t nbytes;               /* data bytes */
    uint64_t offset;               /* relative to the data section, set by begin */
} kv_wtensor;

struct kv_gguf_writer {
    kv_wkv *kvs;          /* [n_kv] in insertion order */
    size_t n_kv, cap_kv;
    kv_wtensor *ts;       /* [n_t] in declaration order */
    size_t n_t, cap_t;
    int fd;               /* -1 until begin, and after finish */
    int begun;            /* header written */
    int finished;         /* file complete and closed */
    uint64_t data_offset; /* absolute start of tensor data */
    uint64_t total_size;  /* final file size */
};

/* ---- growable byte buffer -------------------------------------------- */

typedef struct kv_buf {
    uint8_t *p;
    size_t len, cap;
    int oom; /* sticky allocation/overflow failure */
} kv_buf;

static void buf_put(kv_buf *b, const void *src, size_t n) {
    if (b->oom || n == 0) return;
    size_t need;
    if (!kv_add_ok(b->len, n, &need)) {
        b->oom = 1;
        return;
    }
    if (need > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < need) {
            if (cap > (size_t)-1 / 2) {
                cap = need;
                break;
            }
            cap *= 2;
        }
        uint8_t *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, src, n);
    b->len = need;
}

static void buf_u32(kv_buf *b, uint32_t v) {
    uint8_t x[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    buf_put(b, x, 4);
}

static void buf_u64(kv_buf *b, uint64_t v) {
    buf_u32(b, (uint32_t)v);
    buf_u32(b, (uint32_t)(v >> 32));
}

static void buf_str(kv_buf *b, const char *s, size_t n) {
    buf_u64(b, n);
    buf_put(b, s, n);
}

/* ---- lifecycle -------------------------------------------------------- */

int kv_gguf_writer_new(kv_gguf_writer **out, kv_diag *d) {
    *out = calloc(1, sizeof **out);
    if (!*out) return kv_fail(d, KV_ENOMEM, "gguf writer: out of memory");
    (*out)->fd = -1;
    return 0;
}

void kv_gguf_writer_free(kv_gguf_writer *w) {
    if (!w) return;
    if (w->fd >= 0) close(w->fd);
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kvs[i].key);
        free(w->kvs[i].val);
    }
    for (size_t i = 0; i < w->n_t; i++) free(w->ts[i].name);
    free(w->kvs);
    free(w->ts);
    free(w);
}

/* ---- metadata --------------------------------------------------------- */

/* Stores (key, type, serialized value), replacing an existing key in place.
 * Takes ownership of val (freed on failure too). */
static int put_kv(kv_gguf_writer *w, const char *key, uint32_t type, kv_buf *val, kv_diag *d) {
    int rc = 0;
    size_t klen = key ? strlen(key) : 0;
    if (w->begun) {
        rc = kv_fail(d, KV_EINVAL, "gguf writer: metadata added after begin");
        goto out;
    }
    if (val->oom) {
        rc = kv_fail(d, KV_ENOMEM, "gguf writer: out of memory for key '%s'", key ? key : "");
        goto out;
    }
    if (klen == 0 || klen > KV_GGUF_MAX_NAME) {
        rc = kv_fail(d, KV_EINVAL, "gguf writer: key length %zu, must be 1..%u", klen, KV_GGUF_MAX_NAME);
        goto out;
    }
    for (size_t i = 0; i < w->n_kv; i++) {
        if (strcmp(w->kvs[i].key, key) == 0) {
            free(w->kvs[i].val);
            w->kvs[i].type = type;
            w->kvs[i].val = val->p;
            w->kvs[i].val_len = val->len;
            return 0;
        }
    }
    if (w->n_kv >= KV_GGUF_MAX_KV) {
        rc = kv_fail(d, KV_ERANGE, "gguf writer: more than %u metadata pairs", KV_GGUF_MAX_KV);
        goto out;
    }
    if (w->n_kv == w->cap_kv) {
        size_t cap = w->cap_kv ? w->cap_kv * 2 : 32;
        kv_wkv *p = realloc(w->kvs, cap * sizeof *p);
        if (!p) {
            rc = kv_fail(d, KV_ENOMEM, "gguf writer: out of memory");
            goto out;
        }
        w->kvs = p;
        w->cap_kv = cap;
    }
    char *k = malloc(klen + 1);
    if (!k) {
        rc = kv_fail(d, KV_ENOMEM, "gguf writer: out of memory");
        goto out;
    }
    memcpy(k, key, klen + 1);
    w->kvs[w->n_kv++] = (kv_wkv){k, type, val->p, val->len};
    return 0;
out:
    free(val->p);
    return rc;
}

int kv_gguf_writer_set_alignment(kv_gguf_writer *w, uint32_t alignment, kv_diag *d) {
    if (alignment == 0 || (alignment & (alignment - 1)) || alignment > KV_GGUF_MAX_ALIGNMENT)
        return kv_fail(d, KV_EINVAL, "gguf writer: alignment %" PRIu32 " is not a power of two in [1, %u]",
                       alignment, KV_GGUF_MAX_ALIGNMENT);
    return kv_gguf_writer_set_u32(w, "general.alignment", alignment, d);
}

static int put_scalar(kv_gguf_writer *w, const char *key, uint32_t type, uint64_t bits, kv_diag *d) {
    kv_buf b = {0};
    size_t n = kv_gguf_type_size(type);
    uint8_t x[8];
    for (size_t i = 0; i < n; i++) x[i] = (uint8_t)(bits >> (8 * i));
    buf_put(&b, x, n);
    return put_kv(w, key, type, &b, d);
}

int kv_gguf_writer_set_u16(kv_gguf_writer *w, const char *key, uint16_t v, kv_diag *d) {
    return put_scalar(w, key, KV_GGUF_UINT16, v, d);
}

int kv_gguf_writer_set_u32(kv_gguf_writer *w, const char *key, uint32_t v, kv_diag *d) {
    return put_scalar(w, key, KV_GGUF_UINT32, v, d);
}

int kv_gguf_writer_set_i32(kv_gguf_writer *w, const char *key, int32_t v, kv_diag *d) {
    return put_scalar(w, key, KV_GGUF_INT32, (uint32_t)v, d);
}

int kv_gguf_writer_set_u64(kv_gguf_writer *w, const char *key, uint64_t v, kv_diag *d) {
    return put_scalar(w, key, KV_GGUF_UINT64, v, d);
}

int kv_gguf_writer_set_f32(kv_gguf_writer *w, const char *key, float v, kv_diag *d) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return put_scalar(w, key, KV_GGUF_FLOAT32, bits, d);
}

int kv_gguf_writer_set_bool(kv_gguf_writer *w, const char *key, bool v, kv_diag *d) {
    return put_scalar(w, key, KV_GGUF_BOOL, v ? 1 : 0, d);
}

int kv_gguf_writer_set_strn(kv_gguf_writer *w, const char *key, const char *v, size_t len,
                            kv_diag *d) {
    if (len > KV_GGUF_MAX_STRING)
        return kv_fail(d, KV_EINVAL, "gguf writer: key '%s': string of %zu bytes, max %u", key, len,
                       KV_GGUF_MAX_STRING);
    kv_buf b = {0};
    buf_str(&b, v, len);
    return put_kv(w, key, KV_GGUF_STRING, &b, d);
}

int kv_gguf_writer_set_str(kv_gguf_writer *w, const char *key, const char *v, kv_diag *d) {
    return kv_gguf_writer_set_strn(w, key, v, strlen(v), d);
}

int kv_gguf_writer_set_arr(kv_gguf_writer *w, const char *key, uint32_t elem_type,
                           const void *data, uint64_t n, kv_diag *d) {
    size_t es = kv_gguf_type_size(elem_type), nb;
    if (es == 0)
        return kv_fail(d, KV_EINVAL, "gguf writer: key '%s': element type %s is not a scalar", key,
                       kv_gguf_type_name(elem_type));
    if (n > KV_GGUF_MAX_ARRAY || !kv_mul_ok((size_t)n, es, &nb))
        return kv_fail(d, KV_EINVAL, "gguf writer: key '%s': array of %" PRIu64 " elements, max %u",
                       key, n, KV_GGUF_MAX_ARRAY);
    if (elem_type == KV_GGUF_BOOL)
        for (uint64_t i = 0; i < n; i++)
            if (((const uint8_t *)data)[i] > 1)
                return kv_fail(d, KV_EINVAL, "gguf writer: key '%s': bool element %" PRIu64 " is not 0 or 1",
                               key, i);
    kv_buf b = {0};
    buf_u32(&b, elem_type);
    buf_u64(&b, n);
    buf_put(&b, data, nb);
    return put_kv(w, key, KV_GGUF_ARRAY, &b, d);
}

int kv_gguf_writer_set_arr_str(kv_gguf_writer *w, const char *key, const kv_str *strs,
                               uint64_t n, kv_diag *d) {
    if (n > KV_GGUF_MAX_ARRAY)
        return kv_fail(d, KV_EINVAL, "gguf writer: key '%s': array of %" PRIu64 " strings, max %u",
                       key, n, KV_GGUF_MAX_ARRAY);
    kv_buf b = {0};
    buf_u32(&b, KV_GGUF_STRING);
    buf_u64(&b, n);
    for (uint64_t i = 0; i < n; i++) {
        if (strs[i].len > KV_GGUF_MAX_STRING) {
            free(b.p);
            return kv_fail(d, KV_EINVAL, "gguf writer: key '%s': string %" PRIu64 " has %zu bytes, max %u",
                           key, i, strs[i].len, KV_GGUF_MAX_STRING);
        }
        buf_str(&b, strs[i].ptr, strs[i].len);
    }
    return put_kv(w, key, KV_GGUF_ARRAY, &b, d);
}

int kv_gguf_writer_copy_kv(kv_gguf_writer *w, const kv_gguf_kv *kv, kv_diag *d) {
    char key[KV_GGUF_MAX_NAME + 1];
    if (kv->key.len == 0 || kv->key.len > KV_GGUF_MAX_NAME || memchr(kv->key.ptr, 0, kv->key.len))
        return kv_fail(d, KV_EINVAL, "gguf writer: cannot copy a key of %zu bytes", kv->key.len);
    memcpy(key, kv->key.ptr, kv->key.len);
    key[kv->key.len] = '\0';
    const kv_gguf_value *v = &kv->val;
    kv_buf b = {0};
    switch (v->type) {
    case KV_GGUF_STRING:
        buf_str(&b, v->v.str.ptr, v->v.str.len);
        break;
    case KV_GGUF_ARRAY:
        /* The reader validated the element bytes; copy them verbatim. */
        buf_u32(&b, v->v.arr.elem_type);
        buf_u64(&b, v->v.arr.n);
        buf_put(&b, v->v.arr.data, v->v.arr.nbytes);
        break;
    case KV_GGUF_FLOAT32: {
        float f = (float)v->v.f64;
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        buf_u32(&b, bits);
        break;
    }
    case KV_GGUF_FLOAT64: {
        uint64_t bits;
        memcpy(&bits, &v->v.f64, sizeof bits);
        buf_u64(&b, bits);
        break;
    }
    default: {
        size_t n = kv_gguf_type_size(v->type);
        if (n == 0) return kv_fail(d, KV_EINVAL, "gguf writer: key '%s' has unknown type %" PRIu32, key, v->type);
        uint64_t bits = v->v.u64; /* i64 shares the bits; low n bytes are the value */
        uint8_t x[8];
        for (size_t i = 0; i < n; i++) x[i] = (uint8_t)(bits >> (8 * i));
        buf_put(&b, x, n);
    }
    }
    return put_kv(w, key, v->type, &b, d);
}

/* ---- tensors ---------------------------------------------------------- */

int kv_gguf_writer_add_tensor(kv_gguf_writer *w, const char *name, uint32_t n_dims,
                              const uint64_t *ne, uint32_t type, size_t *idx, kv_diag *d) {
    if (w->begun) return kv_fail(d, KV_EINVAL, "gguf writer: tensor '%s' added after begin", name);
    size_t nlen = strlen(name);
    if (nlen == 0 || nlen > KV_GGUF_MAX_TENSOR_NAME)
        return kv_fail(d, KV_EINVAL, "gguf writer: tensor name '%s' has %zu bytes, must be 1..%u", name,
                       nlen, KV_GGUF_MAX_TENSOR_NAME);
    if (n_dims == 0 || n_dims > KV_GGUF_MAX_DIMS)
        return kv_fail(d, KV_EINVAL, "gguf writer: tensor '%s' has %" PRIu32 " dims, must be 1..%u", name,
                       n_dims, KV_GGUF_MAX_DIMS);
    const kv_type_info *ti = kv_type_get_ref(type);
    if (!ti) return kv_fail(d, KV_EUNSUPPORTED, "gguf writer: tensor '%s' has unknown type id %" PRIu32, name, type);
    if (w->n_t >= KV_GGUF_MAX_TENSORS)
        return kv_fail(d, KV_ERANGE, "gguf writer: more than %u tensors", KV_GGUF_MAX_TENSORS);
    kv_wtensor t = {.n_dims = n_dims, .type = type};
    uint64_t nel = 1;
    for (uint32_t j = 0; j < KV_GGUF_MAX_DIMS; j++) {
        t.ne[j] = j < n_dims ? ne[j] : 1;
        if (t.ne[j] > (uint64_t)INT64_MAX || (t.ne[j] && nel > (uint64_t)INT64_MAX / t.ne[j]))
            return kv_fail(d, KV_EINVAL, "gguf writer: tensor '%s' has too many elements", name);
        nel *= t.ne[j];
    }
    if (t.ne[0] % ti->blck)
        return kv_fail(d, KV_EINVAL,
                       "gguf writer: tensor '%s' of type %s has %" PRIu64
                       " elements per row, not a multiple of its block size %u",
                       name, ti->name, t.ne[0], ti->blck);
    uint64_t row = t.ne[0] / ti->blck * ti->size, rows = nel ? nel / t.ne[0] : 0;
    if (rows && row > UINT64_MAX / 2 / rows)
        return kv_fail(d, KV_EINVAL, "gguf writer: tensor '%s' is too large", name);
    t.nbytes = row * rows;
    for (size_t i = 0; i < w->n_t; i++)
        if (strcmp(w->ts[i].name, name) == 0)
            return kv_fail(d, KV_EINVAL, "gguf writer: duplicate tensor name '%s'", name);
    if (w->n_t == w->cap_t) {
        size_t cap = w->cap_t ? w->cap_t * 2 : 64;
        kv_wtensor *p = realloc(w->ts, cap * sizeof *p);
        if (!p) return kv_fail(d, KV_ENOMEM, "gguf writer: out of memory");
        w->ts = p;
        w->cap_t = cap;
    }
    t.name = malloc(nlen + 1);
    if (!t.name) return kv_fail(d, KV_ENOMEM, "gguf writer: out of memory");
    memcpy(t.name, name, nlen + 1);
    if (idx) *idx = w->n_t;
    w->ts[w->n_t++] = t;
    return 0;
}

/* ---- file ------------------------------------------------------------- */

static int write_all(int fd, const uint8_t *p, size_t n, uint64_t at) {
    while (n > 0) {
        size_t chunk = n > (1u << 30) ? (1u << 30) : n;
        ssize_t k = pwrite(fd, p, chunk, (off_t)at);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (k == 0) {
            errno = EIO;
            return -1;
        }
        p += k;
        n -= (size_t)k;
        at += (uint64_t)k;
    }
    return 0;
}

int kv_gguf_writer_begin(kv_gguf_writer *w, const char *path, kv_diag *d) {
    if (w->begun) return kv_fail(d, KV_EINVAL, "gguf writer: begin called twice");
    uint64_t align = KV_GGUF_DEFAULT_ALIGNMENT;
    for (size_t i = 0; i < w->n_kv; i++) {
        if (strcmp(w->kvs[i].key, "general.alignment") != 0) continue;
        uint32_t a = 0;
        if (w->kvs[i].type == KV_GGUF_UINT32)
            a = (uint32_t)w->kvs[i].val[0] | (uint32_t)w->kvs[i].val[1] << 8 |
                (uint32_t)w->kvs[i].val[2] << 16 | (uint32_t)w->kvs[i].val[3] << 24;
        if (a == 0 || (a & (a - 1)) || a > KV_GGUF_MAX_ALIGNMENT)
            return kv_fail(d, KV_EINVAL, "gguf writer: general.alignment must be a u32 power of two in [1, %u]",
                           KV_GGUF_MAX_ALIGNMENT);
        align = a;
    }

    kv_buf h = {0};
    buf_u32(&h, KV_GGUF_MAGIC);
    buf_u32(&h, KV_GGUF_VERSION);
    buf_u64(&h, w->n_t);
    buf_u64(&h, w->n_kv);
    for (size_t i = 0; i < w->n_kv; i++) {
        buf_str(&h, w->kvs[i].key, strlen(w->kvs[i].key));
        buf_u32(&h, w->kvs[i].type);
        buf_put(&h, w->kvs[i].val, w->kvs[i].val_len);
    }
    uint64_t off = 0;
    for (size_t i = 0; i < w->n_t; i++) {
        kv_wtensor *t = &w->ts[i];
        buf_str(&h, t->name, strlen(t->name));
        buf_u32(&h, t->n_dims);
        for (uint32_t j = 0; j < t->n_dims; j++) buf_u64(&h, t->ne[j]);
        buf_u32(&h, t->type);
        buf_u64(&h, off);
        t->offset = off;
        uint64_t padded = (t->nbytes + align - 1) & ~(align - 1);
        if (padded < t->nbytes || off > UINT64_MAX / 2 - padded) {
            free(h.p);
            return kv_fail(d, KV_ERANGE, "gguf writer: total tensor data overflows");
        }
        off += padded;
    }
    size_t pad = (size_t)((align - h.len % align) % align);
    static const uint8_t zeros[KV_GGUF_MAX_ALIGNMENT];
    buf_put(&h, zeros, pad);
    if (h.oom) {
        free(h.p);
        return kv_fail(d, KV_ENOMEM, "gguf writer: out of memory for the header");
    }
    w->data_offset = h.len;
    w->total_size = h.len + off;

    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        int e = errno;
        free(h.p);
        return kv_fail(d, KV_EIO, "gguf writer: %s: cannot create: %s", path, strerror(e));
    }
    if (write_all(fd, h.p, h.len, 0) != 0) {
        int e = errno;
        free(h.p);
        close(fd);
        unlink(path);
        return kv_fail(d, KV_EIO, "gguf writer: %s: write failed: %s", path, strerror(e));
    }
    free(h.p);
    w->fd = fd;
    w->begun = 1;
    return 0;
}

int kv_gguf_writer_write_data(kv_gguf_writer *w, size_t idx, uint64_t at, const void *data,
                              size_t nbytes, kv_diag *d) {
    if (!w->begun || w->finished || w->fd < 0)
        return kv_fail(d, KV_EINVAL, "gguf writer: write_data outside begin..finish");
    if (idx >= w->n_t) return kv_fail(d, KV_EINVAL, "gguf writer: tensor index %zu out of range", idx);
    const kv_wtensor *t = &w->ts[idx];
    if (at > t->nbytes || nbytes > t->nbytes - at)
        return kv_fail(d, KV_EINVAL,
                       "gguf writer: write of %zu bytes at %" PRIu64 " exceeds tensor '%s' (%" PRIu64 " bytes)",
                       nbytes, at, t->name, t->nbytes);
    if (write_all(w->fd, data, nbytes, w->data_offset + t->offset + at) != 0)
        return kv_fail(d, KV_EIO, "gguf writer: writing tensor '%s': %s", t->name, strerror(errno));
    return 0;
}

int kv_gguf_writer_finish(kv_gguf_writer *w, kv_diag *d) {
    if (!w->begun || w->finished || w->fd < 0)
        return kv_fail(d, KV_EINVAL, "gguf writer: finish without begin");
    int fd = w->fd;
    w->fd = -1;
    w->finished = 1;
    if (ftruncate(fd, (off_t)w->total_size) != 0) {
        int e = errno;
        close(fd);
        return kv_fail(d, KV_EIO, "gguf writer: cannot extend file to %" PRIu64 " bytes: %s",
                       w->total_size, strerror(e));
    }
    if (close(fd) != 0) return kv_fail(d, KV_EIO, "gguf writer: close failed: %s", strerror(errno));
    return 0;
}
