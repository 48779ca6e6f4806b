/* The slice manifest (DIR/manifest.json): parsing, validation, writing.
 *
 * The manifest is untrusted input (it may come from a hub or a download), so
 * every field is type-checked and bounded before use: integers must be JSON
 * integers inside named ranges, strings have length limits, paths are
 * relative, '/'-separated, made of [A-Za-z0-9._-] components other than "."
 * and "..", and the slabs of every MoE layer in the declared layer range must
 * cover its experts exactly once. A manifest that passes kv_manifest_parse
 * can be used without further checks on its own fields; the files it names
 * are checked against it when opened (slabs.c). */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvasir/link.h" /* kv_unhex */
#include "kvasir/pieces.h"
#include "kvasir/slice.h"

void kv_manifest_free(kv_manifest *m) {
    if (!m) return;
    free(m->moe_layer);
    free(m->slabs);
    free(m);
}

/* ---- field readers: each returns 0 or fails naming the field ---------- */

static int kv_m_int(json_t *o, const char *ctx, const char *key, uint64_t lo, uint64_t hi, uint64_t *out,
                    kv_diag *d) {
    json_t *v = json_object_get(o, key);
    if (!v) return kv_fail(d, KV_EFORMAT, "manifest: %s: missing '%s'", ctx, key);
    if (!json_is_integer(v)) return kv_fail(d, KV_EFORMAT, "manifest: %s: '%s' must be an integer", ctx, key);
    const json_int_t x = json_integer_value(v);
    if (x < 0 || (uint64_t)x < lo || (uint64_t)x > hi)
        return kv_fail(d, KV_EFORMAT, "manifest: %s: '%s' = %" JSON_INTEGER_FORMAT " is out of range [%" PRIu64
                       ", %" PRIu64 "]", ctx, key, x, lo, hi);
    *out = (uint64_t)x;
    return 0;
}

static int kv_m_u32(json_t *o, const char *ctx, const char *key, uint32_t lo, uint32_t hi, uint32_t *out,
                    kv_diag *d) {
    uint64_t v;
    int rc = kv_m_int(o, ctx, key, lo, hi, &v, d);
    if (!rc) *out = (uint32_t)v;
    return rc;
}

/* Copies a string field of at most cap-1 bytes (no NUL inside). */
static int kv_m_str(json_t *o, const char *ctx, const char *key, char *out, size_t cap, bool required,
                    kv_diag *d) {
    json_t *v = json_object_get(o, key);
    out[0] = 0;
    if (!v && !required) return 0;
    if (!v) return kv_fail(d, KV_EFORMAT, "manifest: %s: missing '%s'", ctx, key);
    if (!json_is_string(v)) return kv_fail(d, KV_EFORMAT, "manifest: %s: '%s' must be a string", ctx, key);
    const size_t n = json_string_length(v);
    if (n >= cap || memchr(json_string_value(v), 0, n))
        return kv_fail(d, KV_EFORMAT, "manifest: %s: '%s' is longer than %zu bytes or holds a NUL", ctx, key,
                       cap - 1);
    memcpy(out, json_string_value(v), n + 1);
    return 0;
}

static bool kv_is_hex64(const char *s) {
    uint8_t b[32];
    return strlen(s) == 64 && kv_unhex(s, 64, b, sizeof b, false) == 0;
}

/* A relative path that cannot leave its folder: components of
 * [A-Za-z0-9._-], none empty, "." or "..". Symlinks are checked at open. */
static bool kv_path_ok(const char *p) {
    if (!*p) return false;
    const char *c = p;
    while (*c) {
        const char *e = c;
        while (*e && *e != '/') {
            const char ch = *e;
            if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
                  ch == '.' || ch == '_' || ch == '-'))
                return false;
            e++;
        }
        const size_t n = (size_t)(e - c);
        if (n == 0 || (n == 1 && c[0] == '.') || (n == 2 && c[0] == '.' && c[1] == '.')) return false;
        c = *e ? e + 1 : e;
        if (*e && !*c) return false; /* trailing slash */
    }
    return true;
}

/* Every key of o must be one of allowed (NULL-terminated): a manifest has
 * no room for extensions it does not understand, and an unknown key is the
 * cheapest place to hide padding. */
static int kv_m_keys(json_t *o, const char *ctx, const char *const *allowed, kv_diag *d) {
    const char *k;
    json_t *v;
    json_object_foreach(o, k, v) {
        size_t i = 0;
        while (allowed[i] && strcmp(allowed[i], k)) i++;
        if (!allowed[i]) return kv_fail(d, KV_EFORMAT, "manifest: %s: unknown key '%.64s'", ctx, k);
    }
    return 0;
}

/* Bounds on the raw text, checked before jansson builds a tree (whose nodes
 * cost ~50-100 bytes each, so a few MB of "[0,0,0,...]" would cost GBs).
 * A manifest's containers nest at most 3 deep (root, slabs array, slab
 * object); every object at depth 3 is a slab entry. Its size and the number
 * of its JSON tokens (',' ':' '{' '[' outside strings) are then bounded by
 * what that many slabs can need: a slab entry is at most ~500 bytes (a
 * 255-byte path, a 64-digit hash, six keys, indentation) and 13 tokens, the
 * rest at most a few KB and KV_MAX_LAYERS "moe" entries. */
#define KV_MANIFEST_MAX_DEPTH 3u
#define KV_MANIFEST_BYTES_BASE (16u << 10)
#define KV_MANIFEST_BYTES_PER_LAYER 16u
#define KV_MANIFEST_BYTES_PER_SLAB 1024u
#define KV_MANIFEST_TOKENS_BASE 128u
#define KV_MANIFEST_TOKENS_PER_SLAB 16u

static int kv_m_prescan(const char *p, size_t n, kv_diag *d) {
    size_t depth = 0, slabs = 0, tokens = 0;
    for (size_t i = 0; i < n; i++) {
        const char c = p[i];
        if (c == '"') { /* skip the string; an unterminated one is jansson's to report */
            for (i++; i < n && p[i] != '"'; i++)
                if (p[i] == '\\') i++;
        } else if (c == '{' || c == '[') {
            if (++depth > KV_MANIFEST_MAX_DEPTH)
                return kv_fail(d, KV_EFORMAT, "manifest: nested deeper than %u levels at byte %zu",
                               KV_MANIFEST_MAX_DEPTH, i);
            slabs += c == '{' && depth == KV_MANIFEST_MAX_DEPTH;
            tokens++;
        } else if (c == '}' || c == ']') {
            if (depth) depth--;
        } else if (c == ',' || c == ':') {
            tokens++;
        }
    }
    if (slabs > KV_MANIFEST_MAX_SLABS)
        return kv_fail(d, KV_EFORMAT, "manifest: %zu slabs, more than %u", slabs, KV_MANIFEST_MAX_SLABS);
    const uint64_t max_bytes = KV_MANIFEST_BYTES_BASE + (uint64_t)KV_MANIFEST_BYTES_PER_LAYER * KV_MAX_LAYERS +
                               (uint64_t)KV_MANIFEST_BYTES_PER_SLAB * slabs,
                   max_tokens = KV_MANIFEST_TOKENS_BASE + 2ull * KV_MAX_LAYERS +
                                (uint64_t)KV_MANIFEST_TOKENS_PER_SLAB * slabs;
    if (n > max_bytes)
        return kv_fail(d, KV_EFORMAT, "manifest: %zu bytes for %zu slabs, more than the %" PRIu64 " they can need", n,
                       slabs, max_bytes);
    if (tokens > max_tokens)
        return kv_fail(d, KV_EFORMAT, "manifest: %zu JSON values for %zu slabs, more than the %" PRIu64
                       " they can need", tokens, slabs, max_tokens);
    return 0;
}

static int kv_m_file(json_t *o, const char *ctx, bool sparse, kv_manifest_file *f, kv_diag *d) {
    int rc;
    if (!json_is_object(o)) return kv_fail(d, KV_EFORMAT, "manifest: %s must be an object", ctx);
    static const char *const file_keys[] = {"path", "size", "sha256", NULL};
    static const char *const slab_keys[] = {"path", "size", "sha256", "layer", "first", "last", NULL};
    if ((rc = kv_m_keys(o, ctx, strcmp(ctx, "backbone") ? slab_keys : file_keys, d))) return rc;
    if ((rc = kv_m_str(o, ctx, "path", f->path, sizeof f->path, true, d))) return rc;
    if (!kv_path_ok(f->path))
        return kv_fail(d, KV_EFORMAT, "manifest: %s: path '%s' must be relative, inside the manifest's folder "
                       "(no '..', '.', empty or absolute parts; characters A-Z a-z 0-9 . _ -)", ctx, f->path);
    if ((rc = kv_m_int(o, ctx, "size", 0, KV_MANIFEST_MAX_FILE_SIZE, &f->size, d))) return rc;
    json_t *h = json_object_get(o, "sha256");
    if ((!h || json_is_null(h)) && sparse) {
        f->has_sha256 = false;
        return 0;
    }
    if (!h) return kv_fail(d, KV_EFORMAT, "manifest: %s: missing 'sha256'", ctx);
    if (!json_is_string(h) || json_string_length(h) != 64 ||
        kv_unhex(json_string_value(h), 64, f->sha256, 32, false))
        return kv_fail(d, KV_EFORMAT, "manifest: %s: 'sha256' must be 64 lowercase hex digits%s", ctx,
                       json_is_null(h) ? " (null only in a sparse manifest)" : "");
    f->has_sha256 = true;
    return 0;
}

static int kv_slab_cmp(const void *a, const void *b) {
    const kv_manifest_slab *x = a, *y = b;
    if (x->layer != y->layer) return x->layer < y->layer ? -1 : 1;
    if (x->first != y->first) return x->first < y->first ? -1 : 1;
    return (x->last > y->last) - (x->last < y->last);
}

static int kv_path_cmp(const void *a, const void *b) {
    return strcmp((*(const kv_manifest_file *const *)a)->path, (*(const kv_manifest_file *const *)b)->path);
}

/* Every MoE layer in [layer_first, layer_last] covered exactly once; slabs
 * only there; no two entries naming one file. slabs sorted on return. */
static int kv_m_check_cover(kv_manifest *m, kv_diag *d) {
    qsort(m->slabs, m->n_slabs, sizeof *m->slabs, kv_slab_cmp);
    size_t i = 0;
    for (uint32_t L = 0; L < m->n_layer; L++) {
        const bool want = m->moe_layer[L] && L >= m->layer_first && L <= m->layer_last;
        uint32_t next = 0; /* first expert not yet covered */
        for (; i < m->n_slabs && m->slabs[i].layer == L; i++) {
            const kv_manifest_slab *s = &m->slabs[i];
            if (!want)
                return kv_fail(d, KV_EFORMAT, "manifest: slab '%s' holds layer %u, which is %s", s->file.path, L,
                               m->moe_layer[L] ? "outside the manifest's layer range" : "not a MoE layer");
            if (s->first < next)
                return kv_fail(d, KV_EFORMAT, "manifest: slab '%s' (layer %u, experts %u-%u) overlaps '%s' "
                               "(experts %u-%u)", s->file.path, L, s->first, s->last, m->slabs[i - 1].file.path,
                               m->slabs[i - 1].first, m->slabs[i - 1].last);
            if (s->first > next)
                return kv_fail(d, KV_EFORMAT, "manifest: layer %u experts %u-%u are in no slab", L, next,
                               s->first - 1);
            next = s->last + 1;
        }
        if (want && next < m->n_expert)
            return kv_fail(d, KV_EFORMAT, "manifest: layer %u experts %u-%u are in no slab", L, next,
                           m->n_expert - 1);
    }
    /* duplicate file names (also against the backbone) */
    const kv_manifest_file **fs = malloc((m->n_slabs + 1) * sizeof *fs);
    if (!fs) return kv_fail(d, KV_ENOMEM, "manifest: out of memory");
    for (size_t k = 0; k < m->n_slabs; k++) fs[k] = &m->slabs[k].file;
    fs[m->n_slabs] = &m->backbone;
    qsort(fs, m->n_slabs + 1, sizeof *fs, kv_path_cmp);
    for (size_t k = 1; k <= m->n_slabs; k++)
        if (!strcmp(fs[k]->path, fs[k - 1]->path)) {
            int rc = kv_fail(d, KV_EFORMAT, "manifest: file '%s' is listed twice", fs[k]->path);
            free(fs);
            return rc;
        }
    free(fs);
    return 0;
}

int kv_manifest_parse(kv_manifest **out, const char *json, size_t len, kv_diag *d) {
    *out = NULL;
    if (len > KV_MANIFEST_MAX_BYTES)
        return kv_fail(d, KV_EFORMAT, "manifest: %zu bytes, more than the limit of %u", len, KV_MANIFEST_MAX_BYTES);
    int rc = kv_m_prescan(json, len, d);
    if (rc) return rc;
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        /* jansson quotes the offending input: keep the message on one printable line */
        for (char *c = je.text; *c; c++)
            if ((unsigned char)*c < 0x20 || *c == 0x7f) *c = ' ';
        return kv_fail(d, KV_EFORMAT, "manifest: invalid JSON at line %d column %d: %s", je.line, je.column, je.text);
    }
    kv_manifest *m = calloc(1, sizeof *m);
    char buf[64];
    if (!m) {
        rc = kv_fail(d, KV_ENOMEM, "manifest: out of memory");
        goto done;
    }
    if (!json_is_object(root)) {
        rc = kv_fail(d, KV_EFORMAT, "manifest: the top level must be an object");
        goto done;
    }
    static const char *const top_keys[] = {"format", "version", "model", "hparams", "layers", "sparse",
                                           "backbone", "slabs", NULL};
    if ((rc = kv_m_keys(root, "top level", top_keys, d))) goto done;
    if ((rc = kv_m_str(root, "top level", "format", buf, sizeof buf, true, d))) goto done;
    if (strcmp(buf, KV_MANIFEST_FORMAT)) {
        rc = kv_fail(d, KV_EFORMAT, "manifest: format is '%s', expected '%s'", buf, KV_MANIFEST_FORMAT);
        goto done;
    }
    if ((rc = kv_m_u32(root, "top level", "version", 0, UINT32_MAX, &m->version, d))) goto done;
    if (m->version != KV_SLICE_VERSION) {
        rc = kv_fail(d, KV_EUNSUPPORTED, "manifest: version %u, this build reads version %u", m->version,
                     KV_SLICE_VERSION);
        goto done;
    }
    json_t *model = json_object_get(root, "model"), *hp = json_object_get(root, "hparams"),
           *layers = json_object_get(root, "layers"), *sparse = json_object_get(root, "sparse"),
           *slabs = json_object_get(root, "slabs");
    if (!json_is_object(model) || !json_is_object(hp) || !json_is_object(layers) || !json_is_array(slabs)) {
        rc = kv_fail(d, KV_EFORMAT, "manifest: needs objects 'model', 'hparams', 'layers' and an array 'slabs'");
        goto done;
    }
    if (sparse && !json_is_boolean(sparse)) {
        rc = kv_fail(d, KV_EFORMAT, "manifest: 'sparse' must be true or false");
        goto done;
    }
    m->sparse = sparse && json_is_true(sparse);
    static const char *const model_keys[] = {"id", "name", "architecture", NULL};
    static const char *const hp_keys[] = {"n_layer", "n_embd", "n_expert", "n_expert_used", "n_ff_exp",
                                          "n_layer_nextn", NULL};
    static const char *const layer_keys[] = {"first", "last", "moe", NULL};
    if ((rc = kv_m_keys(model, "model", model_keys, d)) || (rc = kv_m_keys(hp, "hparams", hp_keys, d)) ||
        (rc = kv_m_keys(layers, "layers", layer_keys, d)))
        goto done;
    if ((rc = kv_m_str(model, "model", "id", m->model_id, sizeof m->model_id, true, d))) goto done;
    if (!kv_is_hex64(m->model_id)) {
        rc = kv_fail(d, KV_EFORMAT, "manifest: model: 'id' must be 64 lowercase hex digits");
        goto done;
    }
    if ((rc = kv_m_str(model, "model", "name", m->name, sizeof m->name, false, d)) ||
        (rc = kv_m_str(model, "model", "architecture", m->arch, sizeof m->arch, true, d)))
        goto done;
    for (const char *c = m->arch; *c; c++)
        if (!((*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '_' || *c == '-')) {
            rc = kv_fail(d, KV_EFORMAT, "manifest: model: architecture '%s' has characters outside [a-z0-9_-]", m->arch);
            goto done;
        }
    if (!m->arch[0]) {
        rc = kv_fail(d, KV_EFORMAT, "manifest: model: empty architecture");
        goto done;
    }
    if ((rc = kv_m_u32(hp, "hparams", "n_layer", 1, KV_MAX_LAYERS, &m->n_layer, d)) ||
        (rc = kv_m_u32(hp, "hparams", "n_embd", 1, KV_MAX_EMBD, &m->n_embd, d)) ||
        (rc = kv_m_u32(hp, "hparams", "n_expert", 1, KV_MAX_EXPERTS, &m->n_expert, d)) ||
        (rc = kv_m_u32(hp, "hparams", "n_expert_used", 0, m->n_expert, &m->n_expert_used, d)) ||
        (rc = kv_m_u32(hp, "hparams", "n_ff_exp", 1, KV_MAX_FF, &m->n_ff_exp, d)) ||
        (json_object_get(hp, "n_layer_nextn") &&
         (rc = kv_m_u32(hp, "hparams", "n_layer_nextn", 0, m->n_layer - 1, &m->n_layer_nextn, d))) ||
        (rc = kv_m_u32(layers, "layers", "first", 0, m->n_layer - 1, &m->layer_first, d)) ||
        (rc = kv_m_u32(layers, "layers", "last", m->layer_first, m->n_layer - 1, &m->layer_last, d)))
        goto done;
    json_t *moe = json_object_get(layers, "moe");
    if (!json_is_array(moe) || json_array_size(moe) > m->n_layer) {
        rc = kv_fail(d, KV_EFORMAT, "manifest: layers: 'moe' must be an array of at most n_layer layer indices");
        goto done;
    }
    if (!(m->moe_layer = calloc(m->n_layer, 1))) {
        rc = kv_fail(d, KV_ENOMEM, "manifest: out of memory");
        goto done;
    }
    for (size_t k = 0; k < json_array_size(moe); k++) {
        json_t *v = json_array_get(moe, k);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= m->n_layer ||
            m->moe_layer[json_integer_value(v)]) {
            rc = kv_fail(d, KV_EFORMAT, "manifest: layers: moe[%zu] must be a distinct layer index below %u", k,
                         m->n_layer);
            goto done;
        }
        m->moe_layer[json_integer_value(v)] = 1;
    }
    if ((rc = kv_m_file(json_object_get(root, "backbone"), "backbone", m->sparse, &m->backbone, d))) goto done;
    m->n_slabs = json_array_size(slabs);
    if (m->n_slabs > KV_MANIFEST_MAX_SLABS) {
        rc = kv_fail(d, KV_EFORMAT, "manifest: %zu slabs, more than %u", m->n_slabs, KV_MANIFEST_MAX_SLABS);
        goto done;
    }
    if (m->n_slabs && !(m->slabs = calloc(m->n_slabs, sizeof *m->slabs))) {
        rc = kv_fail(d, KV_ENOMEM, "manifest: out of memory");
        goto done;
    }
    for (size_t k = 0; k < m->n_slabs; k++) {
        char ctx[48];
        snprintf(ctx, sizeof ctx, "slabs[%zu]", k);
        json_t *s = json_array_get(slabs, k);
        kv_manifest_slab *sl = &m->slabs[k];
        if ((rc = kv_m_file(s, ctx, m->sparse, &sl->file, d)) ||
            (rc = kv_m_u32(s, ctx, "layer", 0, m->n_layer - 1, &sl->layer, d)) ||
            (rc = kv_m_u32(s, ctx, "first", 0, m->n_expert - 1, &sl->first, d)) ||
            (rc = kv_m_u32(s, ctx, "last", sl->first, m->n_expert - 1, &sl->last, d)))
            goto done;
    }
    rc = kv_m_check_cover(m, d);
done:
    json_decref(root);
    if (rc) {
        kv_manifest_free(m);
        return rc;
    }
    *out = m;
    return 0;
}

int kv_manifest_load(kv_manifest **out, const char *path, kv_diag *d) {
    *out = NULL;
    int fd = -1;
    uint64_t size = 0;
    int rc = kv_pieces_open_file(path, false, &fd, &size, d);
    if (rc) return kv_diag_prefix(d, rc, "manifest");
    if (size > KV_MANIFEST_MAX_BYTES) {
        close(fd);
        return kv_fail(d, KV_EFORMAT, "manifest: %s: %" PRIu64 " bytes, more than the limit of %u", path, size,
                       KV_MANIFEST_MAX_BYTES);
    }
    char *buf = malloc((size_t)size + 1);
    if (!buf) {
        close(fd);
        return kv_fail(d, KV_ENOMEM, "manifest: out of memory");
    }
    size_t n = 0;
    while (n < size) {
        const ssize_t r = pread(fd, buf + n, (size_t)size - n, (off_t)n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        n += (size_t)r;
    }
    close(fd);
    if (n != size) {
        free(buf);
        return kv_fail(d, KV_EIO, "manifest: %s: short read", path);
    }
    rc = kv_manifest_parse(out, buf, n, d);
    free(buf);
    if (rc) kv_diag_prefix(d, rc, "%s", path);
    return rc;
}

static json_t *kv_m_file_json(const kv_manifest_file *f) {
    char hex[65];
    json_t *o = json_object();
    json_object_set_new(o, "path", json_string(f->path));
    json_object_set_new(o, "size", json_integer((json_int_t)f->size));
    if (f->has_sha256) {
        kv_sha256_hex(f->sha256, hex);
        json_object_set_new(o, "sha256", json_string(hex));
    } else {
        json_object_set_new(o, "sha256", json_null());
    }
    return o;
}

int kv_manifest_write(const kv_manifest *m, const char *path, kv_diag *d) {
    json_t *root = json_object(), *model = json_object(), *hp = json_object(), *layers = json_object(),
           *moe = json_array(), *slabs = json_array();
    json_object_set_new(root, "format", json_string(KV_MANIFEST_FORMAT));
    json_object_set_new(root, "version", json_integer(m->version));
    json_object_set_new(model, "id", json_string(m->model_id));
    json_object_set_new(model, "name", json_string(m->name));
    json_object_set_new(model, "architecture", json_string(m->arch));
    json_object_set_new(root, "model", model);
    json_object_set_new(hp, "n_layer", json_integer(m->n_layer));
    json_object_set_new(hp, "n_embd", json_integer(m->n_embd));
    json_object_set_new(hp, "n_expert", json_integer(m->n_expert));
    json_object_set_new(hp, "n_expert_used", json_integer(m->n_expert_used));
    json_object_set_new(hp, "n_ff_exp", json_integer(m->n_ff_exp));
    if (m->n_layer_nextn) json_object_set_new(hp, "n_layer_nextn", json_integer(m->n_layer_nextn));
    json_object_set_new(root, "hparams", hp);
    json_object_set_new(layers, "first", json_integer(m->layer_first));
    json_object_set_new(layers, "last", json_integer(m->layer_last));
    for (uint32_t L = 0; L < m->n_layer; L++)
        if (m->moe_layer[L]) json_array_append_new(moe, json_integer(L));
    json_object_set_new(layers, "moe", moe);
    json_object_set_new(root, "layers", layers);
    json_object_set_new(root, "sparse", json_boolean(m->sparse));
    json_object_set_new(root, "backbone", kv_m_file_json(&m->backbone));
    for (size_t k = 0; k < m->n_slabs; k++) {
        const kv_manifest_slab *s = &m->slabs[k];
        json_t *o = kv_m_file_json(&s->file);
        json_object_set_new(o, "layer", json_integer(s->layer));
        json_object_set_new(o, "first", json_integer(s->first));
        json_object_set_new(o, "last", json_integer(s->last));
        json_array_append_new(slabs, o);
    }
    json_object_set_new(root, "slabs", slabs);
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.part", path) >= (int)sizeof tmp) {
        json_decref(root);
        return kv_fail(d, KV_EINVAL, "manifest: path too long");
    }
    int rc = json_dump_file(root, tmp, JSON_INDENT(1) | JSON_PRESERVE_ORDER);
    json_decref(root);
    if (rc || rename(tmp, path)) {
        unlink(tmp);
        return kv_fail(d, KV_EIO, "manifest: cannot write '%s': %s", path, strerror(errno));
    }
    return 0;
}
