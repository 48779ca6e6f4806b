/* Test support for the f64 reference forward passes: they read the model
 * straight from the GGUF file by tensor name and metadata key, never through
 * the loader's structs (kv_model, kv_layer, kv_hparams), so a loader bug that
 * maps the wrong tensor or mis-reads a key cannot hide behind a reference
 * that shares it. Only F32 tensors are read (the references run on F32
 * models); a missing tensor, a wrong type or a wrong element count is a test
 * failure, and the reference then reads zeros from a static fallback. */
#ifndef KVASIR_REF_GGUF_H
#define KVASIR_REF_GGUF_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>

#include "kvasir/gguf.h"
#include "kvtest.h"

/* The model file as the reference sees it. */
typedef struct ref_model {
    kv_gguf *g;
    char arch[32]; /* general.architecture */
} ref_model;

static inline int ref_open(ref_model *r, const char *path) {
    kv_diag d = {0};
    memset(r, 0, sizeof *r);
    if (kv_gguf_open(&r->g, path, &d)) {
        KVT_FAIL("reference: open %s: %s", path, d.msg);
        return -1;
    }
    kv_str s;
    if (kv_gguf_get_str(r->g, "general.architecture", &s, &d) || s.len >= sizeof r->arch) {
        KVT_FAIL("reference: general.architecture: %s", d.msg);
        return -1;
    }
    memcpy(r->arch, s.ptr, s.len);
    r->arch[s.len] = 0;
    return 0;
}

static inline void ref_close(ref_model *r) {
    kv_gguf_close(r->g);
    r->g = NULL;
}

/* True if the file has a tensor of that name. */
static inline bool ref_has(const ref_model *r, const char *fmt, ...) {
    char name[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    return kv_gguf_find_tensor(r->g, name) != NULL;
}

/* The data of F32 tensor `fmt...`, which must hold exactly n elements. */
static inline const float *ref_f32(const ref_model *r, int64_t n, const char *fmt, ...) {
    static const float zeros[1 << 16];
    char name[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    const kv_gguf_tensor *t = kv_gguf_find_tensor(r->g, name);
    if (!t) {
        KVT_FAIL("reference: tensor %s not in the file", name);
        return zeros;
    }
    int64_t ne = 1;
    for (uint32_t i = 0; i < t->n_dims; i++) ne *= t->ne[i];
    if (t->type != 0 /* F32 */ || ne != n) {
        KVT_FAIL("reference: tensor %s: type %u, %lld elements (want f32, %lld)", name, t->type,
                 (long long)ne, (long long)n);
        return zeros;
    }
    return (const float *)t->data;
}

/* Metadata ARCH.suffix. */
static inline uint32_t ref_u32(const ref_model *r, const char *suffix) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", r->arch, suffix);
    uint32_t v = 0;
    kv_diag d = {0};
    if (kv_gguf_get_u32(r->g, key, &v, &d)) KVT_FAIL("reference: %s: %s", key, d.msg);
    return v;
}
static inline uint32_t ref_u32_or(const ref_model *r, const char *suffix, uint32_t dflt) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", r->arch, suffix);
    return kv_gguf_find_kv(r->g, key) ? ref_u32(r, suffix) : dflt;
}
static inline double ref_f32_key(const ref_model *r, const char *suffix) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", r->arch, suffix);
    float v = 0;
    kv_diag d = {0};
    if (kv_gguf_get_f32(r->g, key, &v, &d)) KVT_FAIL("reference: %s: %s", key, d.msg);
    return v;
}
/* Rows of token_embd.weight (the vocabulary size). */
static inline int ref_n_vocab(const ref_model *r) {
    const kv_gguf_tensor *t = kv_gguf_find_tensor(r->g, "token_embd.weight");
    if (!t || t->n_dims != 2) {
        KVT_FAIL("reference: token_embd.weight missing or not 2-D");
        return 0;
    }
    return (int)t->ne[1];
}

#endif
