/* Slices: SHA-256 against libsodium; slicing copies bytes exactly on every
 * type; running from pieces (mmap and bounded cache, with waves) gives the
 * same logits bit for bit as the full file; one expert alone from a slab
 * equals the full file and stays within a bound of an f64 reference; bad
 * manifests, slabs and paths fail with one clear line and nothing loaded;
 * a sparse skeleton slices without reading its holes; qwen35moe (4 trunk
 * blocks + 1 MTP): inspect's classes, slicing (MTP experts into slabs, the
 * delta net and shared expert in the backbone), and running from pieces or
 * trunk-only slabs bit for bit. */
#include <fcntl.h>
#include <jansson.h>
#include <sodium.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/model.h"
#include "kvasir/quant.h"
#include "kvasir/slice.h"
#include "kvtest.h"

static char g_dir[64];
static const char *g_bin;

static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...) {
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 999;
}

static void *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *p = malloc(sz > 0 ? (size_t)sz : 1);
    *n = p ? fread(p, 1, (size_t)sz, f) : 0;
    fclose(f);
    return p;
}

static void gen_model(const char *out, const char *type, const char *extra) {
    ASSERT_EQ(sh("%s gen-model --arch qwen3moe --out %s --layers 2 --embd 256 --ff-exp 256 --experts 8 "
                 "--experts-used 2 --heads 4 --kv-heads 2 --head-dim 64 --vocab 1024 --type %s %s >/dev/null 2>&1",
                 g_bin, out, type, extra),
              0);
}

static bool one_line(const kv_diag *d) { return d->msg[0] && !strchr(d->msg, '\n'); }

/* ---- SHA-256 ----------------------------------------------------------- */

static void test_sha256(void) {
    ASSERT_EQ(sodium_init() >= 0, 1);
    const size_t n = 5000;
    uint8_t *b = malloc(n);
    for (size_t i = 0; i < n; i++) b[i] = (uint8_t)((i * 2654435761u) >> 13);
    {
        int bad = 0;
        for (size_t len = 0; len < n; len += len < 200 ? 1 : 97) {
            uint8_t a[32], c[32];
            crypto_hash_sha256(a, b, len);
            kv_sha256 s;
            kv_sha256_init(&s);
            for (size_t o = 0; o < len;) { /* odd piece sizes cross block boundaries */
                size_t k = (o % 7 + 1) * 11;
                if (k > len - o) k = len - o;
                kv_sha256_update(&s, b + o, k);
                o += k;
            }
            kv_sha256_final(&s, c);
            bad += memcmp(a, c, 32) != 0;
        }
        ASSERT_EQ(bad, 0);
    }
    printf("sha256 backend: %s\n", kv_sha256_backend());
    free(b);
}

/* ---- slicing copies bytes ----------------------------------------------- */

static void hash_file(const char *path, uint8_t out[32]) {
    size_t n;
    uint8_t *p = slurp(path, &n);
    crypto_hash_sha256(out, p, n);
    free(p);
}

/* Every slab tensor equals its source byte range; the backbone holds every
 * other tensor byte-identical and every source key with its exact bytes;
 * sizes and hashes in the manifest are those of the files. */
static void check_slices(const char *src, const char *dir, uint32_t per, uint32_t n_moe) {
    kv_diag d = {0};
    kv_gguf *g = NULL, *b = NULL;
    kv_manifest *m = NULL;
    char p[1024];
    ASSERT_EQ(kv_gguf_open(&g, src, &d), 0);
    snprintf(p, sizeof p, "%s/manifest.json", dir);
    ASSERT_EQ(kv_manifest_load(&m, p, &d), 0);
    if (!g || !m) return;
    char id[65];
    kv_slice_model_id(g, id);
    ASSERT_STREQ(m->model_id, id);
    ASSERT_EQ(m->n_slabs, n_moe * ((8 + per - 1) / per));
    size_t copied_tensors = 0;
    for (size_t i = 0; i < m->n_slabs; i++) {
        const kv_manifest_slab *s = &m->slabs[i];
        kv_gguf *sg = NULL;
        snprintf(p, sizeof p, "%s/%s", dir, s->file.path);
        ASSERT_EQ(kv_gguf_open(&sg, p, &d), 0);
        if (!sg) continue;
        uint8_t h[32];
        hash_file(p, h);
        ASSERT_EQ(memcmp(h, s->file.sha256, 32), 0);
        ASSERT_EQ(kv_gguf_file_size(sg), s->file.size);
        uint32_t L = 99, f = 99, l = 99;
        kv_gguf_get_u32(sg, "kvasir.slab.layer", &L, &d);
        kv_gguf_get_u32(sg, "kvasir.slab.first", &f, &d);
        kv_gguf_get_u32(sg, "kvasir.slab.last", &l, &d);
        ASSERT_EQ(L, s->layer);
        ASSERT_EQ(f, s->first);
        ASSERT_EQ(l, s->last);
        ASSERT_EQ(kv_gguf_n_tensors(sg), 3);
        for (size_t k = 0; k < kv_gguf_n_tensors(sg); k++) {
            const kv_gguf_tensor *t = kv_gguf_tensor_at(sg, k);
            char name[80];
            snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
            const kv_gguf_tensor *o = kv_gguf_find_tensor(g, name);
            ASSERT_TRUE(o != NULL);
            if (!o) continue;
            ASSERT_EQ(t->type, o->type);
            ASSERT_EQ(t->ne[0], o->ne[0]);
            ASSERT_EQ(t->ne[1], o->ne[1]);
            ASSERT_EQ(t->ne[2], (uint64_t)s->last - s->first + 1);
            const uint64_t nb2 = o->nbytes / o->ne[2];
            ASSERT_EQ(t->nbytes, nb2 * t->ne[2]);
            ASSERT_EQ(memcmp(t->data, (const uint8_t *)o->data + s->first * nb2, t->nbytes), 0);
            copied_tensors++;
        }
        kv_gguf_close(sg);
    }
    ASSERT_EQ(copied_tensors, 3 * m->n_slabs);
    snprintf(p, sizeof p, "%s/backbone.gguf", dir);
    ASSERT_EQ(kv_gguf_open(&b, p, &d), 0);
    if (b) {
        uint8_t h[32];
        hash_file(p, h);
        ASSERT_EQ(memcmp(h, m->backbone.sha256, 32), 0);
        ASSERT_EQ(kv_gguf_n_tensors(b), kv_gguf_n_tensors(g) - 3 * n_moe);
        for (size_t k = 0; k < kv_gguf_n_tensors(b); k++) {
            const kv_gguf_tensor *t = kv_gguf_tensor_at(b, k);
            char name[80];
            snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
            ASSERT_TRUE(strstr(name, "_exps") == NULL);
            const kv_gguf_tensor *o = kv_gguf_find_tensor(g, name);
            ASSERT_TRUE(o && o->nbytes == t->nbytes && o->type == t->type && !memcmp(o->data, t->data, t->nbytes));
        }
        ASSERT_EQ(kv_gguf_n_kv(b), kv_gguf_n_kv(g) + 2);
        int same = 0;
        for (size_t k = 0; k < kv_gguf_n_kv(g); k++) {
            const kv_gguf_kv *a = kv_gguf_kv_at(g, k), *c = kv_gguf_kv_at(b, k);
            if (a->key.len == c->key.len && !memcmp(a->key.ptr, c->key.ptr, a->key.len) && a->val.type == c->val.type)
                same++;
        }
        ASSERT_EQ(same, (int)kv_gguf_n_kv(g));
        kv_model *bm = NULL;
        ASSERT_EQ(kv_model_load_ex(&bm, p, &(kv_model_opts){.no_experts = true}, &d), 0);
        ASSERT_TRUE(bm && !kv_model_has_experts(bm));
        kv_model_free(bm);
    }
    kv_gguf_close(b);
    kv_gguf_close(g);
    kv_manifest_free(m);
}

/* Logits of a short prompt and 6 greedy steps. */
static int run_logits(const kv_model *m, const kv_expert_provider *prov, kv_pool *pool, float *out, int steps) {
    kv_state *st = NULL;
    kv_diag d = {0};
    kv_state_opts so = {.n_ctx = 64, .n_batch = 4, .experts = prov};
    if (kv_state_new(&st, m, pool, &so, &d)) {
        fprintf(stderr, "state: %s\n", d.msg);
        return -1;
    }
    const uint32_t nv = kv_model_hparams(m)->n_vocab;
    int32_t toks[7] = {1, 17, 300, 5, 999, 42, 7};
    int rc = kv_state_eval(st, toks, 7, out, &d);
    for (int s = 1; s < steps && !rc; s++) {
        int32_t best = 0;
        for (uint32_t i = 1; i < nv; i++)
            if (out[(size_t)(s - 1) * nv + i] > out[(size_t)(s - 1) * nv + best]) best = (int32_t)i;
        rc = kv_state_eval(st, &best, 1, out + (size_t)s * nv, &d);
    }
    if (rc) fprintf(stderr, "eval: %s\n", d.msg);
    kv_state_free(st);
    return rc;
}

/* The models and slices test_slice_types makes (m_<type>.gguf, s_<type>/),
 * for the cases that read them when run alone. */
static void ensure_types(void) {
    static const char *types[] = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k"};
    for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++) {
        char src[512], dir[512], man[600];
        struct stat st;
        snprintf(src, sizeof src, "%s/m_%s.gguf", g_dir, types[ti]);
        snprintf(dir, sizeof dir, "%s/s_%s", g_dir, types[ti]);
        snprintf(man, sizeof man, "%s/manifest.json", dir);
        if (!stat(man, &st)) continue;
        gen_model(src, types[ti], "");
        kv_diag d = {0};
        ASSERT_EQ(kv_slice_model(src, dir, &(kv_slice_opts){ti % 2 ? 3 : 0, -1, -1, 2}, NULL, &d), 0);
    }
}

static void test_slice_types(void) {
    static const char *types[] = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k"};
    kv_pool *pool = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_pool_new(&pool, 2, &d), 0);
    for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++) {
        char src[512], dir[512], man[600];
        snprintf(src, sizeof src, "%s/m_%s.gguf", g_dir, types[ti]);
        snprintf(dir, sizeof dir, "%s/s_%s", g_dir, types[ti]);
        snprintf(man, sizeof man, "%s/manifest.json", dir);
        gen_model(src, types[ti], "");
        const uint32_t per = ti % 2 ? 3 : 0; /* uneven slabs, and whole layers */
        kv_slice_stats st;
        ASSERT_EQ(kv_slice_model(src, dir, &(kv_slice_opts){per, -1, -1, 2}, &st, &d), 0);
        ASSERT_TRUE(!st.sparse && st.bytes_copied > 0);
        check_slices(src, dir, per ? per : 8, 2);

        /* running from pieces: same logits, bit for bit */
        kv_model *full = NULL, *bb = NULL;
        kv_slices *sl = NULL, *slc = NULL;
        ASSERT_EQ(kv_model_load(&full, src, &d), 0);
        ASSERT_EQ(kv_slices_open(&sl, man, &(kv_slices_opts){0, false, 2, false}, &d), 0);
        if (!full || !sl) continue;
        ASSERT_EQ(kv_model_load_ex(&bb, kv_slices_backbone_path(sl), &(kv_model_opts){.no_experts = true}, &d), 0);
        ASSERT_EQ(kv_slices_check_model(sl, bb, &d), 0);
        const uint32_t nv = kv_model_hparams(full)->n_vocab;
        const int steps = 6;
        float *a = calloc((size_t)steps * nv, 4), *b = calloc((size_t)steps * nv, 4), *c = calloc((size_t)steps * nv, 4);
        ASSERT_EQ(run_logits(full, NULL, pool, a, steps), 0);
        kv_expert_provider p1, p2;
        ASSERT_EQ(kv_slices_provider_new(&p1, sl, pool, 4, &d), 0);
        ASSERT_EQ(run_logits(bb, &p1, pool, b, steps), 0);
        ASSERT_EQ(memcmp(a, b, (size_t)steps * nv * 4), 0);
        p1.free(p1.impl);
        /* a cache of 2 experts: waves in prefill (up to 8 active), evictions */
        kv_slices_stats cs;
        ASSERT_EQ(kv_slices_open(&slc, man, &(kv_slices_opts){1, false, 2, false}, &d), KV_EINVAL); /* < one expert */
        ASSERT_TRUE(one_line(&d));
        const kv_weight *gw = &kv_model_layer(full, 0)->gate_exps, *dw = &kv_model_layer(full, 0)->down_exps;
        const uint64_t eb = 2 * gw->nb2 + dw->nb2 + 3 * 64;
        ASSERT_EQ(kv_slices_open(&slc, man, &(kv_slices_opts){2 * eb + 10, false, 2, false}, &d), 0);
        if (slc) {
            ASSERT_EQ(kv_slices_provider_new(&p2, slc, pool, 4, &d), 0);
            ASSERT_EQ(run_logits(bb, &p2, pool, c, steps), 0);
            ASSERT_EQ(memcmp(a, c, (size_t)steps * nv * 4), 0);
            kv_slices_get_stats(slc, &cs);
            ASSERT_EQ(cs.cache_slots, 2);
            ASSERT_TRUE(cs.waves > 0 && cs.evictions > 0 && cs.misses > 0);
            ASSERT_EQ(cs.bytes_read, cs.misses * (2 * gw->nb2 + dw->nb2));
            p2.free(p2.impl);
        }
        printf("%-5s slices: %u slabs, logits identical (mmap and 2-expert cache: %llu waves, %llu misses)\n",
               types[ti], st.n_slabs, (unsigned long long)cs.waves, (unsigned long long)cs.misses);
        free(a);
        free(b);
        free(c);
        kv_slices_free(slc);
        kv_slices_free(sl);
        kv_model_free(bb);
        kv_model_free(full);
    }
    kv_pool_free(pool);
}

/* ---- the cache's LRU and pins ------------------------------------------ */

static void test_cache_lru(void) {
    ensure_types();
    char man[600];
    kv_diag d = {0};
    kv_slices *s = NULL;
    snprintf(man, sizeof man, "%s/s_q4_k/manifest.json", g_dir);
    ASSERT_EQ(kv_slices_open(&s, man, &(kv_slices_opts){1, false, 1, false}, &d), KV_EINVAL);
    /* find the slot size, then open with exactly two slots */
    ASSERT_EQ(kv_slices_open(&s, man, &(kv_slices_opts){64u << 20, false, 1, false}, &d), 0);
    kv_slices_stats st;
    kv_slices_get_stats(s, &st);
    kv_slices_free(s);
    s = NULL;
    ASSERT_EQ(kv_slices_open(&s, man, &(kv_slices_opts){2 * st.slot_bytes, false, 1, false}, &d), 0);
    if (!s) return;
    kv_expert_source src = kv_slices_expert_source(s);
    kv_expert_weights w1, w2, w3;
    ASSERT_EQ(src.acquire(src.ctx, 0, 1, &w1, &d), 0);
    ASSERT_EQ(src.acquire(src.ctx, 0, 2, &w2, &d), 0);
    ASSERT_EQ(src.acquire(src.ctx, 1, 3, &w3, &d), KV_ERANGE); /* both slots pinned */
    ASSERT_TRUE(one_line(&d) && strstr(d.msg, "pinned"));
    src.release(src.ctx, 0, 1);
    ASSERT_EQ(src.acquire(src.ctx, 1, 3, &w3, &d), 0); /* evicts (0,1) */
    src.release(src.ctx, 1, 3);
    src.release(src.ctx, 0, 2);
    ASSERT_EQ(src.acquire(src.ctx, 0, 2, &w2, &d), 0); /* hit */
    src.release(src.ctx, 0, 2);
    ASSERT_EQ(src.acquire(src.ctx, 0, 1, &w1, &d), 0); /* miss, evicts LRU (1,3) */
    src.release(src.ctx, 0, 1);
    ASSERT_EQ(src.acquire(src.ctx, 0, 2, &w2, &d), 0); /* still a hit */
    src.release(src.ctx, 0, 2);
    kv_slices_get_stats(s, &st);
    ASSERT_EQ(st.hits, 2);
    ASSERT_EQ(st.misses, 4);
    ASSERT_EQ(st.evictions, 2);
    ASSERT_EQ(src.acquire(src.ctx, 2, 0, &w1, &d), KV_ERANGE);
    ASSERT_EQ(src.acquire(src.ctx, 0, 8, &w1, &d), KV_ERANGE);
    kv_slices_free(s);
}

/* ---- one expert alone ----------------------------------------------------- */

static void test_expert_one(void) {
    ensure_types();
    static const char *types[] = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k"};
    static const double bound[] = {1e-5, 1e-2, 2e-2, 1e-2, 1e-2, 2e-2, 2e-2, 2e-2};
    kv_diag d = {0};
    const uint32_t nt = 5;
    for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++) {
        char src[512], slab[600], xin[600], y1[600], y2[600];
        snprintf(src, sizeof src, "%s/m_%s.gguf", g_dir, types[ti]);
        const uint32_t per = ti % 2 ? 3 : 8, L = 1, E = 4, first = E / per * per, last = first + per - 1 < 7 ? first + per - 1 : 7;
        snprintf(slab, sizeof slab, "%s/s_%s/experts/blk.%u.%04u-%04u.gguf", g_dir, types[ti], L, first, last);
        kv_gguf *gf = NULL, *gs = NULL;
        ASSERT_EQ(kv_gguf_open(&gf, src, &d), 0);
        ASSERT_EQ(kv_gguf_open(&gs, slab, &d), 0);
        if (!gf || !gs) continue;
        kv_expert_weights wf, ws;
        uint32_t ne, nf, ne2, nf2;
        ASSERT_EQ(kv_expert_find(gf, L, E, &wf, &ne, &nf, &d), 0);
        ASSERT_EQ(kv_expert_find(gs, L, E, &ws, &ne2, &nf2, &d), 0);
        ASSERT_EQ(kv_expert_find(gs, L, last + 1 < 8 ? last + 1 : first - 1, &ws, &ne2, &nf2, &d), KV_ENOTFOUND);
        ASSERT_EQ(kv_expert_find(gs, 0, E, &ws, &ne2, &nf2, &d), KV_ENOTFOUND);
        ASSERT_EQ(kv_expert_find(gs, L, E, &ws, &ne2, &nf2, &d), 0);
        float *x = malloc((size_t)nt * ne * 4), *a = malloc((size_t)nt * ne * 4), *b = malloc((size_t)nt * ne * 4);
        uint32_t r = 12345;
        for (size_t i = 0; i < (size_t)nt * ne; i++) {
            r = r * 1103515245u + 12345u;
            x[i] = ((float)((r >> 8) & 0xffff) / 65536.0f - 0.5f) * 4.0f;
        }
        ASSERT_EQ(kv_expert_compute_one(&wf, ne, nf, NULL, x, nt, a, &d), 0);
        ASSERT_EQ(kv_expert_compute_one(&ws, ne, nf, NULL, x, nt, b, &d), 0);
        ASSERT_EQ(memcmp(a, b, (size_t)nt * ne * 4), 0);
        /* f64 reference over the same dequantized weights */
        const kv_type_info *tg = kv_type_get_ref(wf.gate_type), *tu = kv_type_get_ref(wf.up_type),
                           *td = kv_type_get_ref(wf.down_type);
        float *G = malloc((size_t)nf * ne * 4), *U = malloc((size_t)nf * ne * 4), *D = malloc((size_t)nf * ne * 4);
        tg->to_float(wf.gate, G, (int64_t)nf * ne);
        tu->to_float(wf.up, U, (int64_t)nf * ne);
        td->to_float(wf.down, D, (int64_t)nf * ne);
        double max_err = 0, max_ref = 0;
        double *h = malloc(nf * sizeof *h);
        for (uint32_t t = 0; t < nt; t++) {
            const float *xt = x + (size_t)t * ne;
            for (uint32_t j = 0; j < nf; j++) {
                double gs_ = 0, us = 0;
                for (uint32_t i = 0; i < ne; i++) {
                    gs_ += (double)G[(size_t)j * ne + i] * xt[i];
                    us += (double)U[(size_t)j * ne + i] * xt[i];
                }
                h[j] = gs_ / (1.0 + exp(-gs_)) * us;
            }
            for (uint32_t i = 0; i < ne; i++) {
                double y = 0;
                for (uint32_t j = 0; j < nf; j++) y += (double)D[(size_t)i * nf + j] * h[j];
                const double e = fabs(y - a[(size_t)t * ne + i]);
                if (e > max_err) max_err = e;
                if (fabs(y) > max_ref) max_ref = fabs(y);
            }
        }
        const double rel = max_err / max_ref;
        printf("expert %-5s: slab == full file bit for bit; max |f32 - f64 ref| / max |ref| = %.3g (bound %.0e)\n",
               types[ti], rel, bound[ti]);
        ASSERT_TRUE(rel < bound[ti]);
        /* the CLI on both files: same bytes */
        snprintf(xin, sizeof xin, "%s/x.f32", g_dir);
        snprintf(y1, sizeof y1, "%s/y1.f32", g_dir);
        snprintf(y2, sizeof y2, "%s/y2.f32", g_dir);
        FILE *f = fopen(xin, "wb");
        fwrite(x, 4, (size_t)nt * ne, f);
        fclose(f);
        ASSERT_EQ(sh("%s expert -m %s --layer %u --expert %u --in %s --out %s 2>/dev/null", g_bin, src, L, E, xin, y1), 0);
        ASSERT_EQ(sh("%s expert -m %s --layer %u --expert %u --in %s --out %s --threads 1 2>/dev/null", g_bin, slab, L, E,
                     xin, y2), 0);
        size_t n1 = 0, n2 = 0;
        float *c1 = slurp(y1, &n1), *c2 = slurp(y2, &n2);
        ASSERT_EQ(n1, (size_t)nt * ne * 4);
        ASSERT_TRUE(n1 == n2 && c1 && c2 && !memcmp(c1, c2, n1) && !memcmp(c1, a, n1));
        free(c1);
        free(c2);
        free(h);
        free(G);
        free(U);
        free(D);
        free(x);
        free(a);
        free(b);
        kv_gguf_close(gf);
        kv_gguf_close(gs);
    }
    /* bad input to the CLI: wrong size, expert out of the slab */
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "%s/x.f32", g_dir);
    FILE *f = fopen(cmd, "ab");
    fputc(0, f);
    fclose(f);
    ASSERT_EQ(sh("%s expert -m %s/m_q4_k.gguf --layer 0 --expert 1 --in %s/x.f32 --out %s/y.f32 2>/dev/null", g_bin,
                 g_dir, g_dir, g_dir), 2);
    ASSERT_EQ(sh("%s expert -m %s/s_q4_k/experts/blk.0.0000-0007.gguf --layer 1 --expert 1 --in %s/x.f32 --out %s/y.f32 "
                 "2>/dev/null", g_bin, g_dir, g_dir, g_dir), 2);
}

/* ---- running through the CLI -------------------------------------------- */

static void test_cli_run(void) {
    ensure_types();
    const char *types[] = {"q4_k", "q8_0", "f16"};
    for (int i = 0; i < 3; i++) {
        const char *t = types[i];
        ASSERT_EQ(sh("cd %s && %s run -m m_%s.gguf -p 'Hello world, once more' -n 12 --temp 0 --logits-out la_%s.bin "
                     "--json >ta_%s.json 2>/dev/null", g_dir, g_bin, t, t, t), 0);
        ASSERT_EQ(sh("cd %s && %s run -m s_%s/manifest.json -p 'Hello world, once more' -n 12 --temp 0 --logits-out "
                     "lb_%s.bin --json >tb_%s.json 2>/dev/null", g_dir, g_bin, t, t, t), 0);
        ASSERT_EQ(sh("cd %s && %s run -m s_%s --expert-cache-mb 1 -p 'Hello world, once more' -n 12 --temp 0 "
                     "--logits-out lc_%s.bin --json >tc_%s.json 2>/dev/null", g_dir, g_bin, t, t, t), 0);
        ASSERT_EQ(sh("cd %s && cmp -s la_%s.bin lb_%s.bin && cmp -s la_%s.bin lc_%s.bin", g_dir, t, t, t, t), 0);
        /* tokens equal (timings differ) */
        ASSERT_EQ(sh("cd %s && for f in ta tb tc; do sed 's/,\"timings.*//' ${f}_%s.json >${f}_%s.tok; done && "
                     "cmp -s ta_%s.tok tb_%s.tok && cmp -s ta_%s.tok tc_%s.tok", g_dir, t, t, t, t, t, t), 0);
        size_t n = 0;
        char p[600];
        snprintf(p, sizeof p, "%s/la_%s.bin", g_dir, t);
        free(slurp(p, &n));
        ASSERT_EQ(n, 12u * 1024 * 4);
    }
}

/* ---- bad input ------------------------------------------------------------ */

/* Writes a modified copy of the q4_k slice's manifest via fn, then expects
 * kv_slices_open to fail with code (0 = any) and a message holding `want`. */
static void expect_open_fails(const char *man, int code, const char *want, const char *what) {
    kv_diag d = {0};
    kv_slices *s = (kv_slices *)1;
    int rc = kv_slices_open(&s, man, NULL, &d);
    ASSERT_TRUE(rc < 0 && s == NULL);
    if (code) ASSERT_EQ(rc, code);
    ASSERT_TRUE(one_line(&d));
    if (!strstr(d.msg, want)) KVT_FAIL("%s: message '%s' lacks '%s'", what, d.msg, want);
    printf("  bad input (%s): %s\n", what, d.msg);
}

static json_t *load_json(const char *p) { return json_load_file(p, 0, NULL); }

static void save_json(json_t *j, const char *p) {
    json_dump_file(j, p, JSON_INDENT(1));
    json_decref(j);
}

static void test_bad_input(void) {
    ensure_types();
    char base[600], work[600], man[700], p[800], q[800];
    snprintf(base, sizeof base, "%s/s_q4_k", g_dir);
    snprintf(work, sizeof work, "%s/bad", g_dir);
    snprintf(man, sizeof man, "%s/manifest.json", work);
    const char *slab0 = "experts/blk.0.0000-0002.gguf"; /* the q4_k slice has 3 experts per slab */
#define RESET() ASSERT_EQ(sh("rm -rf %s %s/outside.gguf && cp -r %s %s", work, g_dir, base, work), 0)

    /* a slab from another model (other header), its size and hash put in the manifest */
    char other[600], odir[600];
    snprintf(other, sizeof other, "%s/other.gguf", g_dir);
    snprintf(odir, sizeof odir, "%s/s_other", g_dir);
    gen_model(other, "q4_k", "--ctx 300");
    kv_diag d = {0};
    ASSERT_EQ(kv_slice_model(other, odir, &(kv_slice_opts){3, -1, -1, 1}, NULL, &d), 0);
    RESET();
    ASSERT_EQ(sh("cp %s/%s %s/%s", odir, slab0, work, slab0), 0);
    {
        json_t *j = load_json(man);
        kv_manifest *om = NULL;
        snprintf(p, sizeof p, "%s/manifest.json", odir);
        ASSERT_EQ(kv_manifest_load(&om, p, &d), 0);
        json_t *s0 = json_array_get(json_object_get(j, "slabs"), 0);
        char hex[65];
        kv_sha256_hex(om->slabs[0].file.sha256, hex);
        json_object_set_new(s0, "sha256", json_string(hex));
        json_object_set_new(s0, "size", json_integer((json_int_t)om->slabs[0].file.size));
        kv_manifest_free(om);
        save_json(j, man);
    }
    expect_open_fails(man, KV_EFORMAT, "belongs to another model", "slab from another model");

    /* hash mismatch: one flipped byte in a slab's tensor data */
    RESET();
    snprintf(p, sizeof p, "%s/%s", work, slab0);
    {
        int fd = open(p, O_RDWR);
        uint8_t c;
        struct stat st;
        fstat(fd, &st);
        pread(fd, &c, 1, st.st_size - 1000);
        c ^= 0x10;
        pwrite(fd, &c, 1, st.st_size - 1000);
        close(fd);
    }
    expect_open_fails(man, KV_EHASH, "corrupt", "flipped byte");
    ASSERT_NE(sh("%s run -m %s -p hi -n 2 >/dev/null 2>%s/err.txt", g_bin, man, g_dir), 0);
    {
        size_t n;
        snprintf(q, sizeof q, "%s/err.txt", g_dir);
        char *e = slurp(q, &n);
        ASSERT_TRUE(e && n > 0 && !strncmp(e, "kvasir run: ", 12) && memchr(e, '\n', n) == e + n - 1);
        free(e);
    }

    /* missing slab */
    RESET();
    ASSERT_EQ(sh("rm %s/%s", work, slab0), 0);
    expect_open_fails(man, KV_ENOTFOUND, "missing", "missing slab");

    /* a size that does not match */
    RESET();
    ASSERT_EQ(sh("truncate -s -1 %s/%s", work, slab0), 0);
    expect_open_fails(man, KV_EFORMAT, "bytes", "truncated slab");

    /* a symlink out of the folder (target has the right bytes) */
    RESET();
    ASSERT_EQ(sh("mv %s/%s %s/outside.gguf && ln -s %s/outside.gguf %s/%s", work, slab0, g_dir, g_dir, work, slab0), 0);
    expect_open_fails(man, KV_EFORMAT, "outside the manifest's folder", "symlink out");

    /* manifest edits: overlap, gap, paths, types, numbers */
    struct { const char *path; const char *key; const char *json; const char *want; } edits[] = {
        {"slabs/1", "first", "2", "overlaps"},
        {"slabs/0", "last", "5", "overlaps"},
        {"slabs/1", "first", "4", "in no slab"},
        {"slabs/2", "last", "6", "in no slab"},
        {"slabs/0", "path", "\"../s_q4_k/experts/blk.0.0000-0007.gguf\"", "must be relative"},
        {"slabs/0", "path", "\"/etc/passwd\"", "must be relative"},
        {"slabs/0", "path", "\"experts/./blk.0.0000-0007.gguf\"", "must be relative"},
        {"slabs/0", "path", "\"experts/blk.0.0003-0005.gguf\"", "listed twice"},
        {"backbone", "path", "\"a\\\\..\\\\b\"", "must be relative"},
        {"slabs/0", "size", "\"332608\"", "must be an integer"},
        {"slabs/0", "size", "1.5", "must be an integer"},
        {"slabs/0", "size", "-1", "out of range"},
        {"slabs/0", "size", "9223372036854775807", "out of range"},
        {"slabs/0", "layer", "7", "out of range"},
        {"slabs/0", "sha256", "\"00\"", "64 lowercase hex"},
        {"slabs/0", "sha256", "null", "64 lowercase hex"},
        {"hparams", "n_expert", "4000000000", "out of range"},
        {"hparams", "n_layer", "0", "out of range"},
        {"model", "id", "\"abc\"", "64 lowercase hex"},
        {"", "version", "2", "version 2"},
        {"", "format", "\"gguf\"", "format"},
        {"", "slabs", "{}", "array 'slabs'"},
        {"layers", "moe", "[0,0]", "distinct"},
        {"layers", "first", "1", "outside the manifest's layer range"},
        {"layers", "moe", "[1]", "not a MoE layer"},
    };
    for (size_t i = 0; i < sizeof edits / sizeof *edits; i++) {
        RESET();
        json_t *j = load_json(man), *o = j;
        if (!strncmp(edits[i].path, "slabs/", 6)) o = json_array_get(json_object_get(j, "slabs"), (size_t)atoi(edits[i].path + 6));
        else if (edits[i].path[0]) o = json_object_get(j, edits[i].path);
        json_error_t je;
        json_t *v = json_loads(edits[i].json, JSON_DECODE_ANY, &je);
        ASSERT_TRUE(o && v);
        json_object_set_new(o, edits[i].key, v);
        save_json(j, man);
        char what[160];
        snprintf(what, sizeof what, "%s.%s = %s", edits[i].path, edits[i].key, edits[i].json);
        expect_open_fails(man, 0, edits[i].want, what);
    }
    /* raw text: malformed JSON, huge numbers, wrong top level, duplicates */
    const char *raw[][2] = {
        {"{\"format\": \"kvasir-slices\", \"version\": 1", "invalid JSON"},
        {"[1,2,3]", "top level"},
        {"{\"format\": \"kvasir-slices\", \"version\": 1e400}", "invalid JSON"},
        {"{\"format\": \"kvasir-slices\", \"version\": 123456789012345678901234567890}", "invalid JSON"},
        {"{\"format\": \"kvasir-slices\", \"format\": \"kvasir-slices\"}", "invalid JSON"},
        {"", "invalid JSON"},
        {"{\"format\": \"kvasir-slices\", \"version\": 1, \"model\": 5}", "needs objects"},
    };
    for (size_t i = 0; i < sizeof raw / sizeof *raw; i++) {
        RESET();
        FILE *f = fopen(man, "wb");
        fputs(raw[i][0], f);
        fclose(f);
        expect_open_fails(man, KV_EFORMAT, raw[i][1], raw[i][0][0] ? raw[i][0] : "(empty)");
    }
    /* a partial manifest (--layers) parses but cannot be run */
    snprintf(p, sizeof p, "%s/s_part", g_dir);
    snprintf(q, sizeof q, "%s/m_q4_k.gguf", g_dir);
    ASSERT_EQ(kv_slice_model(q, p, &(kv_slice_opts){4, 1, 1, 1}, NULL, &d), 0);
    snprintf(q, sizeof q, "%s/s_part/manifest.json", g_dir);
    kv_manifest *pm = NULL;
    ASSERT_EQ(kv_manifest_load(&pm, q, &d), 0);
    ASSERT_TRUE(pm && pm->n_slabs == 2 && pm->slabs[0].layer == 1 && pm->layer_first == 1);
    kv_manifest_free(pm);
    expect_open_fails(q, KV_EFORMAT, "covers layers 1-1 only", "partial manifest");
    snprintf(q, sizeof q, "%s/m_q4_k.gguf", g_dir);
    ASSERT_EQ(kv_slice_model(q, p, &(kv_slice_opts){4, 1, 5, 1}, NULL, &d), KV_ERANGE);
    /* slicing something that is not a model with experts */
    snprintf(q, sizeof q, "%s/s_q4_k/backbone.gguf", g_dir);
    ASSERT_EQ(kv_slice_model(q, p, NULL, NULL, &d), KV_EFORMAT);
    ASSERT_TRUE(one_line(&d) && strstr(d.msg, "no routed-expert"));
    sh("rm -rf %s %s/outside.gguf", work, g_dir);
#undef RESET
}

/* ---- a sparse skeleton ------------------------------------------------------ */

static void test_sparse(void) {
    /* A qwen3moe-shaped header whose tensor data is all holes: 4 layers of
     * 128 experts of 2048 x 768 (q4_K gate/up, q6_K down: ~1.6 GB logical), plus small norms. */
    char src[600], dir[600], man[700];
    snprintf(src, sizeof src, "%s/skel.gguf", g_dir);
    snprintf(dir, sizeof dir, "%s/s_skel", g_dir);
    kv_diag d = {0};
    kv_gguf_writer *w = NULL;
    ASSERT_EQ(kv_gguf_writer_new(&w, &d), 0);
    kv_gguf_writer_set_str(w, "general.architecture", "qwen3moe", &d);
    kv_gguf_writer_set_str(w, "general.name", "skeleton", &d);
    kv_gguf_writer_set_u32(w, "qwen3moe.block_count", 4, &d);
    kv_gguf_writer_set_u32(w, "qwen3moe.expert_count", 128, &d);
    kv_gguf_writer_set_u32(w, "qwen3moe.expert_used_count", 8, &d);
    for (int L = 0; L < 4; L++) {
        char n[64];
        const uint64_t ng[3] = {2048, 768, 128}, nd[3] = {768, 2048, 128}, nn[1] = {2048};
        snprintf(n, sizeof n, "blk.%d.attn_norm.weight", L);
        kv_gguf_writer_add_tensor(w, n, 1, nn, KV_TYPE_F32, NULL, &d);
        snprintf(n, sizeof n, "blk.%d.ffn_gate_exps.weight", L);
        kv_gguf_writer_add_tensor(w, n, 3, ng, KV_TYPE_Q4_K, NULL, &d);
        snprintf(n, sizeof n, "blk.%d.ffn_up_exps.weight", L);
        kv_gguf_writer_add_tensor(w, n, 3, ng, KV_TYPE_Q4_K, NULL, &d);
        snprintf(n, sizeof n, "blk.%d.ffn_down_exps.weight", L);
        ASSERT_EQ(kv_gguf_writer_add_tensor(w, n, 3, nd, KV_TYPE_Q6_K, NULL, &d), 0);
    }
    ASSERT_EQ(kv_gguf_writer_begin(w, src, &d), 0);
    float ones[2048];
    for (int i = 0; i < 2048; i++) ones[i] = 1.0f;
    ASSERT_EQ(kv_gguf_writer_write_data(w, 0, 0, ones, sizeof ones, &d), 0); /* one real tensor */
    ASSERT_EQ(kv_gguf_writer_finish(w, &d), 0);
    kv_gguf_writer_free(w);
    struct stat st;
    stat(src, &st);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    kv_slice_stats ss;
    ASSERT_EQ(kv_slice_model(src, dir, &(kv_slice_opts){16, -1, -1, 2}, &ss, &d), 0);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    printf("skeleton: %.2f GB logical, %lld KB on disk, sliced into %u slabs in %.3f s; %llu bytes copied, %.2f GB of "
           "holes kept\n", (double)st.st_size / 1e9, (long long)st.st_blocks / 2, ss.n_slabs, secs,
           (unsigned long long)ss.bytes_copied, (double)ss.bytes_holes / 1e9);
    ASSERT_TRUE(ss.sparse);
    ASSERT_EQ(ss.n_slabs, 32);
    ASSERT_TRUE(ss.bytes_copied < (1u << 20));
    ASSERT_TRUE(ss.bytes_holes > 1500000000ull);
    ASSERT_TRUE(secs < 10.0); /* reading 1.6 GB of zeros and hashing them would take longer than this on a slow disk */
    uint64_t alloc = 0, logical = 0;
    kv_manifest *m = NULL;
    snprintf(man, sizeof man, "%s/manifest.json", dir);
    ASSERT_EQ(kv_manifest_load(&m, man, &d), 0);
    if (m) {
        ASSERT_TRUE(m->sparse && !m->backbone.has_sha256);
        for (size_t i = 0; i <= m->n_slabs; i++) {
            char p[900];
            snprintf(p, sizeof p, "%s/%s", dir, i < m->n_slabs ? m->slabs[i].file.path : m->backbone.path);
            struct stat fs;
            ASSERT_EQ(stat(p, &fs), 0);
            ASSERT_EQ((uint64_t)fs.st_size, i < m->n_slabs ? m->slabs[i].file.size : m->backbone.size);
            alloc += (uint64_t)fs.st_blocks * 512;
            logical += (uint64_t)fs.st_size;
        }
        printf("skeleton slices: %.2f GB logical, %llu KB allocated\n", (double)logical / 1e9,
               (unsigned long long)(alloc >> 10));
        ASSERT_TRUE(alloc < (8u << 20));
        ASSERT_TRUE(logical > 1500000000ull);
        kv_manifest_free(m);
    }
    kv_slices *s = NULL;
    ASSERT_EQ(kv_slices_open(&s, man, NULL, &d), KV_EUNSUPPORTED);
    ASSERT_TRUE(s == NULL && one_line(&d) && strstr(d.msg, "skeleton"));
}

/* ---- qwen35moe: inspect, slice, run from pieces --------------------------- */

/* The class a qwen35moe tensor must have (docs/ANATOMY.md), from its name. */
static const char *q35_class(const char *n) {
    if (strstr(n, ".nextn.")) return "mtp";
    if (strstr(n, "_exps")) return "routed_experts";
    if (strstr(n, "_shexp")) return "shared_experts";
    if (strstr(n, ".ssm_") || strstr(n, ".attn_qkv.") || strstr(n, ".attn_gate.")) return "linear_attention";
    if (strstr(n, ".ffn_gate_inp.")) return "router";
    if (strstr(n, "norm")) return "norms";
    if (strstr(n, ".attn_")) return "attention";
    if (!strcmp(n, "token_embd.weight")) return "embeddings";
    if (!strcmp(n, "output.weight")) return "lm_head";
    return "other";
}

/* `kvasir inspect --json` of a 4+1-block qwen35moe: every class's bytes and
 * tensor count are the sums over the tensors the rules above put there, and
 * the blocks are linear x3, full attention, MTP, each with routed experts. */
static void check_q35_inspect(const char *src, const kv_gguf *g) {
    char out[600];
    snprintf(out, sizeof out, "%s/inspect_q35.json", g_dir);
    ASSERT_EQ(sh("%s inspect %s --json >%s", g_bin, src, out), 0);
    json_t *j = json_load_file(out, 0, NULL);
    ASSERT_TRUE(j != NULL);
    if (!j) return;
    ASSERT_STREQ(json_string_value(json_object_get(j, "architecture")), "qwen35moe");
    ASSERT_EQ(json_integer_value(json_object_get(j, "block_count")), 5);
    ASSERT_EQ(json_integer_value(json_object_get(j, "nextn_predict_layers")), 1);
    json_t *cls = json_object_get(j, "classes");
    size_t i;
    json_t *c;
    int seen = 0;
    json_array_foreach(cls, i, c) {
        const char *id = json_string_value(json_object_get(c, "class"));
        uint64_t bytes = 0, n = 0;
        for (size_t k = 0; k < kv_gguf_n_tensors(g); k++) {
            const kv_gguf_tensor *t = kv_gguf_tensor_at(g, k);
            char name[96];
            snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
            if (!strcmp(q35_class(name), id)) bytes += t->nbytes, n++;
        }
        if ((uint64_t)json_integer_value(json_object_get(c, "bytes")) != bytes ||
            (uint64_t)json_integer_value(json_object_get(c, "tensors")) != n)
            fprintf(stderr, "class %s: inspect says %lld B in %lld tensors, expected %llu in %llu\n", id,
                    (long long)json_integer_value(json_object_get(c, "bytes")),
                    (long long)json_integer_value(json_object_get(c, "tensors")), (unsigned long long)bytes,
                    (unsigned long long)n);
        ASSERT_EQ((uint64_t)json_integer_value(json_object_get(c, "bytes")), bytes);
        ASSERT_EQ((uint64_t)json_integer_value(json_object_get(c, "tensors")), n);
        /* 3 expert tensors x 5 blocks (MTP too); 4 shared-expert tensors x 5;
         * 9 delta-net tensors x 3 linear blocks; 4 nextn glue tensors */
        if (!strcmp(id, "routed_experts")) { ASSERT_EQ(n, 15); seen++; }
        if (!strcmp(id, "shared_experts")) { ASSERT_EQ(n, 20); seen++; }
        if (!strcmp(id, "linear_attention")) { ASSERT_EQ(n, 27); seen++; }
        if (!strcmp(id, "attention")) { ASSERT_EQ(n, 8); seen++; }
        if (!strcmp(id, "mtp")) { ASSERT_EQ(n, 4); seen++; }
        if (!strcmp(id, "other")) { ASSERT_EQ(n, 0); seen++; }
    }
    ASSERT_EQ(seen, 6);
    static const char *const kinds[5] = {"linear+moe", "linear+moe", "linear+moe", "attn+moe", "mtp+moe"};
    json_t *layers = json_object_get(j, "layers");
    ASSERT_EQ(json_array_size(layers), 5);
    json_array_foreach(layers, i, c) {
        if (i >= 5) break;
        ASSERT_STREQ(json_string_value(json_object_get(c, "kind")), kinds[i]);
        ASSERT_EQ(json_integer_value(json_object_get(c, "n_expert")), 8);
    }
    json_t *ex = json_object_get(j, "experts");
    ASSERT_EQ(json_integer_value(json_object_get(ex, "moe_layers")), 5);
    ASSERT_EQ(json_integer_value(json_object_get(ex, "slabs")), 40);
    json_decref(j);
}

static void test_qwen35(void) {
    /* f32 at embd 128; q4_k at embd 256 (rows of 128 fall back to q8_0) */
    static const struct { const char *type; int embd, ff; uint32_t per; } cases[] = {{"f32", 128, 64, 0},
                                                                                    {"q4_k", 256, 256, 3}};
    kv_pool *pool = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_pool_new(&pool, 2, &d), 0);
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        const char *ty = cases[ci].type;
        char src[512], dir[512], man[600], dir3[512], man3[600], dir2[512], man2[600];
        snprintf(src, sizeof src, "%s/q35_%s.gguf", g_dir, ty);
        snprintf(dir, sizeof dir, "%s/q35s_%s", g_dir, ty);
        snprintf(man, sizeof man, "%s/manifest.json", dir);
        ASSERT_EQ(sh("%s gen-model --arch qwen35moe --out %s --layers 4 --nextn 1 --embd %d --ff-exp %d --experts 8 "
                     "--experts-used 2 --heads 4 --kv-heads 2 --head-dim 32 --vocab 1024 --type %s --threads 2 "
                     ">/dev/null 2>&1", g_bin, src, cases[ci].embd, cases[ci].ff, ty), 0);
        kv_gguf *g = NULL;
        ASSERT_EQ(kv_gguf_open(&g, src, &d), 0);
        if (!g) continue;
        if (ci == 0) check_q35_inspect(src, g);

        /* slicing: MTP experts go to slabs like every block's */
        const uint32_t per = cases[ci].per;
        kv_slice_stats st;
        ASSERT_EQ(kv_slice_model(src, dir, &(kv_slice_opts){per, -1, -1, 2}, &st, &d), 0);
        ASSERT_EQ(st.n_moe_layers, 5);
        check_slices(src, dir, per ? per : 8, 5);
        kv_manifest *m = NULL;
        ASSERT_EQ(kv_manifest_load(&m, man, &d), 0);
        if (m) {
            ASSERT_EQ(m->n_layer, 5);
            ASSERT_EQ(m->n_layer_nextn, 1);
            ASSERT_EQ(m->layer_last, 4);
            ASSERT_EQ(m->slabs[m->n_slabs - 1].layer, 4);
        }
        kv_manifest_free(m);
        {   /* the backbone keeps the delta net, the gated attention, the shared
             * expert, the router and the MTP glue, byte for byte (check_slices) */
            static const char *const keep[] = {
                "blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_conv1d.weight", "blk.0.ssm_dt.bias",
                "blk.0.ssm_a", "blk.0.ssm_beta.weight", "blk.0.ssm_alpha.weight", "blk.0.ssm_norm.weight",
                "blk.0.ssm_out.weight", "blk.2.ssm_out.weight", "blk.0.ffn_gate_inp_shexp.weight",
                "blk.0.ffn_gate_shexp.weight", "blk.0.ffn_up_shexp.weight", "blk.0.ffn_down_shexp.weight",
                "blk.3.attn_q.weight", "blk.3.attn_k.weight", "blk.3.attn_output.weight", "blk.3.attn_q_norm.weight",
                "blk.3.post_attention_norm.weight", "blk.3.ffn_gate_inp.weight", "blk.4.nextn.eh_proj.weight",
                "blk.4.nextn.enorm.weight", "blk.4.ffn_down_shexp.weight", "blk.4.attn_q.weight"};
            char p[600];
            snprintf(p, sizeof p, "%s/backbone.gguf", dir);
            kv_gguf *b = NULL;
            ASSERT_EQ(kv_gguf_open(&b, p, &d), 0);
            for (size_t k = 0; b && k < sizeof keep / sizeof *keep; k++) {
                const kv_gguf_tensor *t = kv_gguf_find_tensor(b, keep[k]);
                if (!t) fprintf(stderr, "backbone lacks %s\n", keep[k]);
                ASSERT_TRUE(t != NULL);
            }
            for (size_t k = 0; b && k < kv_gguf_n_tensors(b); k++) { /* every class but routed experts */
                const kv_gguf_tensor *t = kv_gguf_tensor_at(b, k);
                char name[96];
                snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
                ASSERT_TRUE(strcmp(q35_class(name), "routed_experts") && strcmp(q35_class(name), "other"));
            }
            /* and the slabs only the three expert tensors (check_slices) */
            kv_gguf_close(b);
        }

        /* running from pieces: same logits bit for bit (mmap; 2-expert cache) */
        kv_model *full = NULL, *bb = NULL;
        kv_slices *sl = NULL, *slc = NULL;
        ASSERT_EQ(kv_model_load(&full, src, &d), 0);
        ASSERT_EQ(kv_slices_open(&sl, man, &(kv_slices_opts){0, false, 2, false}, &d), 0);
        if (!full || !sl) {
            kv_gguf_close(g);
            continue;
        }
        ASSERT_EQ(kv_model_load_ex(&bb, kv_slices_backbone_path(sl), &(kv_model_opts){.no_experts = true}, &d), 0);
        ASSERT_EQ(kv_slices_check_model(sl, bb, &d), 0);
        ASSERT_TRUE(bb && !kv_model_has_experts(bb) && kv_model_hparams(bb)->n_layer == 4 &&
                    kv_model_hparams(bb)->n_layer_nextn == 1);
        const uint32_t nv = kv_model_hparams(full)->n_vocab;
        const int steps = 6;
        const size_t nb = (size_t)steps * nv * 4;
        float *a = calloc(nb, 1), *b = calloc(nb, 1), *c = calloc(nb, 1);
        ASSERT_EQ(run_logits(full, NULL, pool, a, steps), 0);
        kv_expert_provider p1, p2;
        ASSERT_EQ(kv_slices_provider_new(&p1, sl, pool, 4, &d), 0);
        ASSERT_EQ(run_logits(bb, &p1, pool, b, steps), 0);
        ASSERT_EQ(memcmp(a, b, nb), 0);
        p1.free(p1.impl);
        const kv_weight *gw = &kv_model_layer(full, 0)->gate_exps, *dw = &kv_model_layer(full, 0)->down_exps;
        const uint64_t eb = 2 * gw->nb2 + dw->nb2 + 3 * 64;
        ASSERT_EQ(kv_slices_open(&slc, man, &(kv_slices_opts){2 * eb + 10, false, 2, false}, &d), 0);
        kv_slices_stats cs = {0};
        if (slc) {
            memset(c, 0, nb);
            ASSERT_EQ(kv_slices_provider_new(&p2, slc, pool, 4, &d), 0);
            ASSERT_EQ(run_logits(bb, &p2, pool, c, steps), 0);
            ASSERT_EQ(memcmp(a, c, nb), 0);
            kv_slices_get_stats(slc, &cs);
            ASSERT_TRUE(cs.waves > 0 && cs.evictions > 0);
            p2.free(p2.impl);
        }
        kv_slices_free(slc);
        slc = NULL;

        /* slabs of the trunk only (no MTP experts): runs, same logits; one
         * trunk layer short: refused with one line */
        snprintf(dir3, sizeof dir3, "%s/q35s3_%s", g_dir, ty);
        snprintf(man3, sizeof man3, "%s/manifest.json", dir3);
        snprintf(dir2, sizeof dir2, "%s/q35s2_%s", g_dir, ty);
        snprintf(man2, sizeof man2, "%s/manifest.json", dir2);
        ASSERT_EQ(kv_slice_model(src, dir3, &(kv_slice_opts){per, 0, 3, 2}, NULL, &d), 0);
        ASSERT_EQ(kv_slice_model(src, dir2, &(kv_slice_opts){per, 0, 2, 2}, NULL, &d), 0);
        ASSERT_EQ(kv_slices_open(&slc, man3, &(kv_slices_opts){0, false, 2, false}, &d), 0);
        if (slc) {
            memset(c, 0, nb);
            ASSERT_EQ(kv_slices_check_model(slc, bb, &d), 0);
            ASSERT_EQ(kv_slices_provider_new(&p2, slc, pool, 4, &d), 0);
            ASSERT_EQ(run_logits(bb, &p2, pool, c, steps), 0);
            ASSERT_EQ(memcmp(a, c, nb), 0);
            p2.free(p2.impl);
        }
        kv_slices_free(slc);
        slc = (kv_slices *)1;
        ASSERT_EQ(kv_slices_open(&slc, man2, NULL, &d), KV_EFORMAT);
        ASSERT_TRUE(slc == NULL && one_line(&d) && strstr(d.msg, "running needs layers 0-3"));

        /* the CLI: -m F.gguf, -m DIR/manifest.json, --expert-cache-mb */
        ASSERT_EQ(sh("cd %s && %s run -m q35_%s.gguf -p 'Hello world, once more' -n 10 --temp 0 --threads 2 "
                     "--logits-out qa_%s.bin --json >qta_%s.json 2>/dev/null", g_dir, g_bin, ty, ty, ty), 0);
        ASSERT_EQ(sh("cd %s && %s run -m q35s_%s/manifest.json -p 'Hello world, once more' -n 10 --temp 0 --threads 2 "
                     "--logits-out qb_%s.bin --json >qtb_%s.json 2>/dev/null", g_dir, g_bin, ty, ty, ty), 0);
        ASSERT_EQ(sh("cd %s && %s run -m q35s_%s --expert-cache-mb 1 -p 'Hello world, once more' -n 10 --temp 0 "
                     "--threads 2 --logits-out qc_%s.bin --json >qtc_%s.json 2>/dev/null", g_dir, g_bin, ty, ty, ty), 0);
        ASSERT_EQ(sh("cd %s && cmp -s qa_%s.bin qb_%s.bin && cmp -s qa_%s.bin qc_%s.bin", g_dir, ty, ty, ty, ty), 0);
        ASSERT_EQ(sh("cd %s && for f in qta qtb qtc; do sed 's/,\"timings.*//' ${f}_%s.json >${f}_%s.tok; done && "
                     "cmp -s qta_%s.tok qtb_%s.tok && cmp -s qta_%s.tok qtc_%s.tok", g_dir, ty, ty, ty, ty, ty, ty), 0);
        size_t n = 0;
        char p[600];
        snprintf(p, sizeof p, "%s/qa_%s.bin", g_dir, ty);
        free(slurp(p, &n));
        ASSERT_EQ(n, 10u * nv * 4);
        printf("qwen35moe %-4s: %u slabs (MTP block's too), logits identical from pieces (mmap, 2-expert cache: "
               "%llu waves; trunk-only slabs; CLI with and without --expert-cache-mb)\n", ty, st.n_slabs,
               (unsigned long long)cs.waves);
        free(a);
        free(b);
        free(c);
        kv_slices_free(sl);
        kv_model_free(bb);
        kv_model_free(full);
        kv_gguf_close(g);
    }
    kv_pool_free(pool);
}

static const kvt_case cases[] = {
    KVT_CASE(test_sha256),    KVT_CASE(test_slice_types), KVT_CASE(test_cache_lru), KVT_CASE(test_expert_one),
    KVT_CASE(test_cli_run),   KVT_CASE(test_bad_input),   KVT_CASE(test_sparse),    KVT_CASE(test_qwen35),
};

static int setup(void) {
    g_bin = getenv("KV_BIN");
    if (!g_bin) {
        fprintf(stderr, "FAIL: KV_BIN is not set\n");
        return 1;
    }
    if (sodium_init() < 0) return 1;
    snprintf(g_dir, sizeof g_dir, "/tmp/kv_slice_XXXXXX");
    return mkdtemp(g_dir) ? 0 : 1;
}

static void teardown(void) {
    if (!kvt_failures) sh("rm -rf %s", g_dir);
    else fprintf(stderr, "test files kept in %s\n", g_dir);
}

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
