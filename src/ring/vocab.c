/* The tokenizer a ring node hands to a client (VOCAB_ACK, docs/PROTOCOL.md
 * "Ring protocol"): the model's tokenizer.* metadata (vocabulary, merges,
 * token types, special ids, the chat template) written as a GGUF v3 file
 * with no tensors, so the client reads it with the same GGUF reader and
 * tokenizer loader a local model goes through and tokenizes exactly as the
 * node would. The pairs are written as the file holds them (scalars
 * re-encoded from their values, arrays copied byte for byte from the
 * mapping, where the reader checked them). */
#include <stdlib.h>
#include <string.h>

#include "kvasir/ring.h"

typedef struct kv_vbuf {
    uint8_t *p;
    size_t n, cap;
} kv_vbuf;

static int kv_vb_put(kv_vbuf *b, const void *src, size_t n) {
    if (b->n + n > KV_RING_MAX_VOCAB_BYTES) return KV_ERANGE;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 1u << 16;
        while (cap < b->n + n) cap *= 2;
        uint8_t *np = realloc(b->p, cap);
        if (!np) return KV_ENOMEM;
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
    return 0;
}

static int kv_vb_u32(kv_vbuf *b, uint32_t v) {
    const uint8_t x[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    return kv_vb_put(b, x, 4);
}

static int kv_vb_u64(kv_vbuf *b, uint64_t v) {
    int rc = kv_vb_u32(b, (uint32_t)v);
    return rc ? rc : kv_vb_u32(b, (uint32_t)(v >> 32));
}

/* One pair: key, type, value. */
static int kv_vb_kv(kv_vbuf *b, const kv_gguf_kv *kv) {
    int rc = kv_vb_u64(b, kv->key.len);
    if (!rc) rc = kv_vb_put(b, kv->key.ptr, kv->key.len);
    if (!rc) rc = kv_vb_u32(b, kv->val.type);
    if (rc) return rc;
    const kv_gguf_value *v = &kv->val;
    switch (v->type) {
    case KV_GGUF_STRING:
        rc = kv_vb_u64(b, v->v.str.len);
        return rc ? rc : kv_vb_put(b, v->v.str.ptr, v->v.str.len);
    case KV_GGUF_ARRAY:
        if (v->v.arr.elem_type == KV_GGUF_ARRAY) return KV_EUNSUPPORTED;
        rc = kv_vb_u32(b, v->v.arr.elem_type);
        if (!rc) rc = kv_vb_u64(b, v->v.arr.n);
        return rc ? rc : kv_vb_put(b, v->v.arr.data, v->v.arr.nbytes);
    case KV_GGUF_FLOAT32: {
        const float f = (float)v->v.f64;
        uint32_t u;
        memcpy(&u, &f, 4);
        return kv_vb_u32(b, u);
    }
    case KV_GGUF_FLOAT64: {
        uint64_t u;
        memcpy(&u, &v->v.f64, 8);
        return kv_vb_u64(b, u);
    }
    default: {
        const size_t sz = kv_gguf_type_size(v->type);
        if (!sz || sz > 8) return KV_EUNSUPPORTED;
        const uint64_t u = v->type == KV_GGUF_INT8 || v->type == KV_GGUF_INT16 || v->type == KV_GGUF_INT32 ||
                                   v->type == KV_GGUF_INT64
                               ? (uint64_t)v->v.i64
                               : v->v.u64;
        uint8_t x[8];
        for (size_t i = 0; i < 8; i++) x[i] = (uint8_t)(u >> (8 * i));
        return kv_vb_put(b, x, sz);
    }
    }
}

int kv_ring_vocab_pack(const kv_gguf *g, uint8_t **out, size_t *len, kv_diag *d) {
    *out = NULL;
    *len = 0;
    if (!g) return kv_fail(d, KV_ENOTFOUND, "the model's metadata is not available");
    uint64_t n_kv = 0;
    for (size_t i = 0; i < kv_gguf_n_kv(g); i++)
        n_kv += kv_gguf_kv_at(g, i)->key.len >= 10 && !strncmp(kv_gguf_kv_at(g, i)->key.ptr, "tokenizer.", 10);
    if (!n_kv) return kv_fail(d, KV_ENOTFOUND, "the model has no tokenizer.* metadata");
    kv_vbuf b = {0};
    int rc = kv_vb_put(&b, "GGUF", 4);
    if (!rc) rc = kv_vb_u32(&b, 3);
    if (!rc) rc = kv_vb_u64(&b, 0); /* tensors */
    if (!rc) rc = kv_vb_u64(&b, n_kv);
    for (size_t i = 0; i < kv_gguf_n_kv(g) && !rc; i++) {
        const kv_gguf_kv *kv = kv_gguf_kv_at(g, i);
        if (kv->key.len >= 10 && !strncmp(kv->key.ptr, "tokenizer.", 10)) rc = kv_vb_kv(&b, kv);
    }
    static const uint8_t zero[32];
    if (!rc && b.n % 32) rc = kv_vb_put(&b, zero, 32 - b.n % 32); /* the data section's alignment */
    if (rc) {
        free(b.p);
        return kv_fail(d, rc, rc == KV_ERANGE ? "the tokenizer exceeds %u bytes" : "cannot pack the tokenizer (%u bytes max)",
                       KV_RING_MAX_VOCAB_BYTES);
    }
    *out = b.p;
    *len = b.n;
    return 0;
}
