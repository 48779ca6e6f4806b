/* libFuzzer target for the slice manifest parser.
 *
 * Parses the input as manifest JSON over an exact-size copy (a read past the
 * end is an ASan error). On success, checks what kv_manifest_parse promises
 * with __builtin_trap: bounded hparams, relative paths without "..", slabs
 * sorted and covering each MoE layer of the declared range exactly once,
 * hashes present unless sparse; then writes the manifest out and parses it
 * again, which must give the same structure. On failure: NULL result, a
 * negative code and a one-line message. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvasir/slice.h"

#define CHECK(x)                    \
    do {                            \
        if (!(x)) __builtin_trap(); \
    } while (0)

static void check_path(const char *p) {
    CHECK(p[0] && p[0] != '/' && strlen(p) <= KV_MANIFEST_MAX_PATH && !strchr(p, '\\'));
    for (const char *c = p; *c;) { /* every component non-empty, not "." or ".." */
        size_t n = strcspn(c, "/");
        CHECK(n > 0 && !(n == 1 && c[0] == '.') && !(n == 2 && c[0] == '.' && c[1] == '.'));
        c += n;
        if (*c) CHECK(*++c);
    }
}

static void check(const kv_manifest *m) {
    CHECK(m->version == KV_SLICE_VERSION && strlen(m->model_id) == 64);
    CHECK(m->n_layer >= 1 && m->n_layer <= KV_MAX_LAYERS && m->n_expert >= 1 && m->n_expert <= KV_MAX_EXPERTS);
    CHECK(m->n_expert_used <= m->n_expert && m->layer_first <= m->layer_last && m->layer_last < m->n_layer);
    check_path(m->backbone.path);
    CHECK(m->backbone.has_sha256 || m->sparse);
    uint32_t layer = UINT32_MAX, next = 0;
    for (size_t i = 0; i < m->n_slabs; i++) {
        const kv_manifest_slab *s = &m->slabs[i];
        check_path(s->file.path);
        CHECK(s->file.has_sha256 || m->sparse);
        CHECK(s->layer >= m->layer_first && s->layer <= m->layer_last && m->moe_layer[s->layer]);
        CHECK(s->first <= s->last && s->last < m->n_expert);
        if (s->layer != layer) {
            CHECK(layer == UINT32_MAX || (s->layer > layer && next == m->n_expert));
            layer = s->layer;
            next = 0;
        }
        CHECK(s->first == next);
        next = s->last + 1;
    }
    CHECK(m->n_slabs == 0 || next == m->n_expert);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *copy = malloc(size ? size : 1);
    if (!copy) return 0;
    if (size) memcpy(copy, data, size);
    kv_manifest *m = (kv_manifest *)1;
    kv_diag d = {0};
    int rc = kv_manifest_parse(&m, copy, size, &d);
    free(copy);
    if (rc) {
        CHECK(m == NULL && rc < 0 && d.code == rc && d.msg[0] && !strchr(d.msg, '\n'));
        return 0;
    }
    check(m);
    /* round trip through the writer */
    char path[64];
    snprintf(path, sizeof path, "/tmp/fuzz_manifest_%d.json", (int)getpid());
    CHECK(kv_manifest_write(m, path, &d) == 0);
    kv_manifest *m2 = NULL;
    CHECK(kv_manifest_load(&m2, path, &d) == 0);
    unlink(path);
    CHECK(m2->n_slabs == m->n_slabs && !strcmp(m2->model_id, m->model_id) && m2->n_layer == m->n_layer &&
          m2->sparse == m->sparse && !memcmp(m2->moe_layer, m->moe_layer, m->n_layer));
    for (size_t i = 0; i < m->n_slabs; i++)
        CHECK(!strcmp(m->slabs[i].file.path, m2->slabs[i].file.path) && m->slabs[i].file.size == m2->slabs[i].file.size &&
              m->slabs[i].first == m2->slabs[i].first && !memcmp(m->slabs[i].file.sha256, m2->slabs[i].file.sha256, 32));
    kv_manifest_free(m2);
    kv_manifest_free(m);
    return 0;
}
