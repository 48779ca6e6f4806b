/* kv-test-labels: unit */
/* The engine's prompt cache (src/engine/prefix_cache.c, engine.h) against
 * an independent reference: each request run alone through the plain
 * kv_state path (one sequence, kv_state_eval over the prompt in chunks of
 * 3 tokens, then every generated token; its own sampler), from the model
 * file, with no cache anywhere. For qwen3moe and qwen35moe (generated
 * models), with cache blocks of 32 tokens and a prompt budget of 80 tokens
 * a step (so chunk boundaries differ between the cached engine, the
 * uncached one and the reference):
 *   - cold, warm and half-shared: a request run cold (nothing cached), the
 *     same again (a hit: every whole block but the one holding the last
 *     token is copied in), and one sharing 150 of its tokens (4 blocks
 *     reused) give tokens and the logits of every token byte-identical to
 *     the reference, greedy and sampled; the session and engine counters
 *     say what was reused;
 *   - in a batch: a warm request and a cold one stepped together, beside a
 *     decode, equal the reference too;
 *   - LRU under a budget of two and a half prompts: A, B, A again, then C
 *     evicts B's blocks (the least recently used), never A's: A hits whole,
 *     B only in part; eviction counted, bytes within the budget, outputs
 *     still exact;
 *   - one prompt over the budget: qwen3moe keeps and reuses the blocks that
 *     fit; qwen35moe drops its chain's older recurrent states and resumes
 *     from the deepest (all of its whole blocks);
 *   - the cache alone (prefix_cache.c) against a naive model of the same
 *     policy over thousands of random chains sharing prefixes, with and
 *     without recurrent states, fills that fail, budgets of 3 to 8 blocks:
 *     the same matches, each block's bytes its own prefix's, the same bytes
 *     held, never over the budget;
 *   - F16 KV: cold and warm equal an F16 engine without a cache;
 *   - an uncached engine (budget 0) reports nothing; bad options are
 *     refused with a message naming them. */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kvasir/engine.h"
#include "kvasir/gen.h"
#include "kvasir/quant.h"
#include "kvtest.h"
#include "engine_fixture.h"
#include "engine/prefix_cache.h"

#define MAX_GEN 10
#define N_CTX 512 /* the fixtures' n_ctx (tests/engine_fixture.h) */
#define BLOCK 32
#define N_BATCH 80

/* A request: its prompt (tokens), its sampling. */
typedef struct req {
    int32_t prompt[N_CTX];
    uint32_t n_prompt;
    float temp;
    uint64_t seed;
    uint32_t max_tokens;
} req;

typedef struct result {
    int32_t tok[MAX_GEN];
    float *logits; /* [MAX_GEN][n_vocab] */
    uint32_t n;
    uint32_t n_cached; /* the session's counter */
    int err;
} result;

/* tokens [from, from + n) of the stream numbered `seed` */
static void fill(int32_t *out, uint32_t n, uint64_t seed, uint32_t V) {
    uint64_t x = seed * 2654435761u + 1;
    for (uint32_t i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        out[i] = (int32_t)(3 + (x >> 33) % (V - 3));
    }
}

static kv_sample_params params(const req *r) {
    kv_sample_params p = kv_sample_defaults();
    p.temp = r->temp;
    p.seed = r->seed;
    p.repeat_penalty = 1.1f;
    return p;
}

/* The reference: r alone on a fresh single-sequence state, no engine. */
static void ref_run(const fixture *f, const req *r, result *out) {
    kv_diag d = {0};
    kv_pool *pool = NULL;
    kv_state *st = NULL;
    kv_sampler *smp = NULL;
    const uint32_t V = f->n_vocab;
    memset(out, 0, sizeof *out);
    out->logits = calloc((size_t)MAX_GEN * V, sizeof(float));
    float *lg = malloc(V * sizeof(float));
    const kv_state_opts so = {.n_ctx = N_CTX, .n_batch = 3};
    const kv_sample_params p = params(r);
    if (kv_pool_new(&pool, 1, &d) || kv_state_new(&st, f->m, pool, &so, &d) ||
        kv_sampler_new(&smp, (int32_t)V, &p, &d)) {
        KVT_FAIL("reference: %s", d.msg);
        goto done;
    }
    for (uint32_t i = 0; i < r->n_prompt; i++) kv_sampler_accept(smp, r->prompt[i]);
    if (kv_state_eval(st, r->prompt, r->n_prompt, lg, &d)) KVT_FAIL("reference eval: %s", d.msg);
    while (out->n < r->max_tokens) {
        const int32_t t = kv_sampler_sample(smp, lg);
        kv_sampler_accept(smp, t);
        memcpy(out->logits + (size_t)out->n * V, lg, V * sizeof(float));
        out->tok[out->n++] = t;
        if (kv_tok_is_eog(kv_model_tok(f->m), t) || out->n == r->max_tokens) break;
        if (kv_state_eval(st, &t, 1, lg, &d)) {
            KVT_FAIL("reference eval: %s", d.msg);
            break;
        }
    }
done:
    free(lg);
    kv_sampler_free(smp);
    kv_state_free(st);
    kv_pool_free(pool);
}

static kv_engine *open_engine_kv(const fixture *f, uint64_t cache_bytes, uint32_t kv_type) {
    kv_diag d = {0};
    kv_engine *e = NULL;
    const kv_engine_opts o = {.n_threads = 2, .n_ctx = N_CTX, .n_batch = N_BATCH, .max_sessions = 4,
                              .prompt_cache_bytes = cache_bytes, .prompt_cache_block = BLOCK, .kv_type = kv_type};
    if (kv_engine_open(&e, f->model, &o, &d)) KVT_FAIL("engine: %s", d.msg);
    return e;
}

static kv_engine *open_engine(const fixture *f, uint64_t cache_bytes) {
    return open_engine_kv(f, cache_bytes, KV_TYPE_F32);
}

/* The n requests as sessions stepped together until all are done. */
static void run(kv_engine *e, const req *rs, int n, result *out) {
    kv_session *ss[4] = {0};
    const uint32_t V = kv_model_hparams(kv_engine_model(e))->n_vocab;
    for (int i = 0; i < n; i++) {
        kv_diag d = {0};
        memset(&out[i], 0, sizeof out[i]);
        out[i].logits = calloc((size_t)MAX_GEN * V, sizeof(float));
        const kv_session_opts o = {.sample = params(&rs[i]), .max_tokens = rs[i].max_tokens};
        ASSERT_EQ(kv_session_new(&ss[i], e, &o, &d), 0);
        if (ss[i]) ASSERT_EQ(kv_session_prompt(ss[i], rs[i].prompt, rs[i].n_prompt, &d), 0);
    }
    for (int step = 0; step < 200 && kv_engine_busy(e); step++) {
        kv_diag d = {0};
        if (kv_engine_step(e, &d) < 0) {
            KVT_FAIL("step: %s", d.msg);
            break;
        }
        for (int i = 0; i < n; i++) {
            const int32_t t = ss[i] ? kv_session_token(ss[i]) : -1;
            if (t >= 0 && out[i].n < MAX_GEN) {
                memcpy(out[i].logits + (size_t)out[i].n * V, kv_session_logits(ss[i]), V * sizeof(float));
                out[i].tok[out[i].n++] = t;
            }
        }
    }
    for (int i = 0; i < n; i++) {
        if (!ss[i]) continue;
        kv_session_stats st;
        kv_session_get_stats(ss[i], &st);
        out[i].n_cached = st.n_cached;
        out[i].err = kv_session_error(ss[i], NULL);
        ASSERT_EQ(kv_session_status(ss[i]), KV_SESSION_DONE);
        kv_session_free(ss[i]);
    }
}

static void free_res(result *r, int n) {
    for (int i = 0; i < n; i++) free(r[i].logits);
}

/* got equals the reference bit for bit (tokens and every logit) */
static void check_same(const result *got, const result *ref, uint32_t V, const char *what) {
    bool ok = !got->err && got->n == ref->n && got->n > 0;
    for (uint32_t i = 0; ok && i < got->n; i++) ok = got->tok[i] == ref->tok[i];
    ok = ok && !memcmp(got->logits, ref->logits, (size_t)got->n * V * sizeof(float));
    if (!ok) KVT_FAIL("%s: %u tokens (reference %u), err %d: not byte-identical to the reference", what, got->n,
                      ref->n, got->err);
}


/* ---- cold, warm, half-shared; in a batch -------------------------------- */

/* A request of other tokens that takes (and overwrites) the KV blocks the
 * last one gave back to the pool, so a hit cannot pass by finding its own
 * bytes still there: one lookup, a miss. */
static void scrub(kv_engine *e, uint64_t seed) {
    static req x;
    x = (req){.n_prompt = 310, .temp = 0.0f, .max_tokens = 1};
    fill(x.prompt, x.n_prompt, seed, kv_model_hparams(kv_engine_model(e))->n_vocab);
    result o;
    run(e, &x, 1, &o);
    ASSERT_EQ(o.n_cached, 0);
    free_res(&o, 1);
}

static void cold_warm(int fi) {
    const fixture *f = &g_fx[fi];
    const uint32_t V = f->n_vocab;
    static req a, h, g, c;
    a = (req){.n_prompt = 300, .temp = 0.0f, .max_tokens = MAX_GEN};
    fill(a.prompt, a.n_prompt, 1, V);
    h = (req){.n_prompt = 230, .temp = 0.8f, .seed = 5, .max_tokens = MAX_GEN}; /* a's first 150 tokens */
    memcpy(h.prompt, a.prompt, 150 * sizeof(int32_t));
    fill(h.prompt + 150, 80, 2, V);
    g = a; /* a, sampled */
    g.temp = 1.1f;
    g.seed = 17;
    c = (req){.n_prompt = 120, .temp = 0.0f, .max_tokens = MAX_GEN};
    fill(c.prompt, c.n_prompt, 3, V);
    result ra, rh, rg, rc;
    ref_run(f, &a, &ra);
    ref_run(f, &h, &rh);
    ref_run(f, &g, &rg);
    ref_run(f, &c, &rc);

    kv_engine *e = open_engine(f, 64u << 20);
    if (!e) return;
    kv_engine_stats es;
    result o[3];
    run(e, &a, 1, o); /* cold */
    check_same(&o[0], &ra, V, "cold");
    ASSERT_EQ(o[0].n_cached, 0);
    kv_engine_get_stats(e, &es);
    ASSERT_EQ(es.cache_lookups, 1);
    ASSERT_EQ(es.cache_hits, 0);
    ASSERT_EQ(es.cache_block_tokens, BLOCK);
    /* 300 prompt + 9 fed generated tokens: 9 whole blocks of 32 */
    ASSERT_EQ(es.cache_blocks, 9);
    ASSERT_EQ(es.cache_inserts, 9);
    ASSERT_TRUE(es.cache_bytes > 0 && es.cache_bytes <= es.cache_budget);
    free_res(o, 1);

    scrub(e, 100);
    run(e, &a, 1, o); /* warm: 9 blocks (288 tokens) cached; 299 / 32 = 9 may be reused */
    check_same(&o[0], &ra, V, "warm");
    kv_engine_get_stats(e, &es);
    ASSERT_EQ(es.cache_hits, 1);
    /* qwen35moe: recurrent states exist where steps ended at a block end:
       chunks of 80 cut at 64, 128, 192, 256, and 288 (the decode reaching it) */
    ASSERT_EQ(o[0].n_cached, 288);
    ASSERT_EQ(es.cache_tokens, 288);
    ASSERT_TRUE(es.tokens_prefill > 0);
    free_res(o, 1);

    scrub(e, 101);
    run(e, &h, 1, o); /* shares 150 tokens: 4 blocks (128 tokens) */
    check_same(&o[0], &rh, V, "half-shared");
    ASSERT_EQ(o[0].n_cached, 128);
    free_res(o, 1);

    /* together: a sampled (warm), c (cold), beside each other's decodes */
    scrub(e, 102);
    req two[2] = {g, c};
    run(e, two, 2, o);
    check_same(&o[0], &rg, V, "warm in a batch");
    check_same(&o[1], &rc, V, "cold in a batch");
    ASSERT_EQ(o[0].n_cached, 288);
    ASSERT_EQ(o[1].n_cached, 0);
    free_res(o, 2);
    kv_engine_get_stats(e, &es);
    ASSERT_EQ(es.cache_lookups, 8); /* and 3 scrubs */
    ASSERT_EQ(es.cache_hits, 3);
    ASSERT_EQ(es.cache_evictions, 0);
    kv_engine_free(e);

    /* no cache: nothing reported, the same bits */
    e = open_engine(f, 0);
    if (!e) return;
    run(e, &a, 1, o);
    check_same(&o[0], &ra, V, "uncached");
    kv_engine_get_stats(e, &es);
    ASSERT_EQ(es.cache_lookups + es.cache_blocks + es.cache_budget, 0);
    free_res(o, 1);
    kv_engine_free(e);
    free_res(&ra, 1);
    free_res(&rh, 1);
    free_res(&rg, 1);
    free_res(&rc, 1);
}

/* F16 KV: the cache holds the rounded rows the cache held; warm equals an
 * F16 engine without a cache (the reference is F32, so not that) */
static void f16(int fi) {
    const fixture *f = &g_fx[fi];
    const uint32_t V = f->n_vocab;
    static req a;
    a = (req){.n_prompt = 260, .temp = 0.7f, .seed = 3, .max_tokens = MAX_GEN};
    fill(a.prompt, a.n_prompt, 60, V);
    kv_engine *n = open_engine_kv(f, 0, KV_TYPE_F16), *e = open_engine_kv(f, 64u << 20, KV_TYPE_F16);
    if (!n || !e) return;
    result ref[1], o[1];
    run(n, &a, 1, ref);
    run(e, &a, 1, o);
    check_same(&o[0], &ref[0], V, "f16 cold");
    free_res(o, 1);
    scrub(e, 103);
    run(e, &a, 1, o);
    check_same(&o[0], &ref[0], V, "f16 warm");
    ASSERT_EQ(o[0].n_cached, 256);
    free_res(o, 1);
    free_res(ref, 1);
    kv_engine_free(n);
    kv_engine_free(e);
}

static void test_f16(void) {
    f16(0);
    f16(1);
}

static void test_cold_warm_qwen3moe(void) { cold_warm(0); }
static void test_cold_warm_qwen35moe(void) { cold_warm(1); }

/* ---- LRU ------------------------------------------------------------------ */

static void lru(int fi) {
    const fixture *f = &g_fx[fi];
    const uint32_t V = f->n_vocab;
    static req p[3];
    result ref[3], o[1];
    for (int i = 0; i < 3; i++) {
        p[i] = (req){.n_prompt = 200, .temp = 0.0f, .max_tokens = 8}; /* 6 blocks, nothing past 208 */
        fill(p[i].prompt, p[i].n_prompt, 40 + (uint64_t)i, V);
        ref_run(f, &p[i], &ref[i]);
    }
    /* the bytes of one prompt's blocks, measured */
    kv_engine *e = open_engine(f, 64u << 20);
    if (!e) return;
    kv_engine_stats es;
    run(e, &p[0], 1, o);
    free_res(o, 1);
    kv_engine_get_stats(e, &es);
    const uint64_t one = es.cache_bytes;
    ASSERT_EQ(es.cache_blocks, 6);
    kv_engine_free(e);

    e = open_engine(f, one * 2 + one / 2);
    if (!e) return;
    const int order[] = {0, 1, 0, 2}; /* A, B, A again (most recent), C: B goes */
    const uint32_t want_cached[] = {0, 0, 192, 0};
    for (int k = 0; k < 4; k++) {
        run(e, &p[order[k]], 1, o);
        check_same(&o[0], &ref[order[k]], V, "LRU fill");
        ASSERT_EQ(o[0].n_cached, want_cached[k]);
        free_res(o, 1);
    }
    kv_engine_get_stats(e, &es);
    ASSERT_TRUE(es.cache_evictions >= 3); /* C's 6 blocks into room for 2.5 prompts */
    ASSERT_TRUE(es.cache_bytes <= es.cache_budget);
    run(e, &p[0], 1, o); /* A: whole */
    check_same(&o[0], &ref[0], V, "LRU A");
    ASSERT_EQ(o[0].n_cached, 192);
    free_res(o, 1);
    run(e, &p[2], 1, o); /* C: whole */
    check_same(&o[0], &ref[2], V, "LRU C");
    ASSERT_EQ(o[0].n_cached, 192);
    free_res(o, 1);
    run(e, &p[1], 1, o); /* B: its end was evicted first (leaves go first) */
    check_same(&o[0], &ref[1], V, "LRU B");
    ASSERT_TRUE(o[0].n_cached < 192);
    free_res(o, 1);
    kv_engine_free(e);

    /* one prompt does not fit (nine tenths of its bytes): qwen3moe keeps
       the blocks that fit and reuses them; qwen35moe drops the older
       recurrent states of its chain instead and resumes from the deepest */
    e = open_engine(f, one - one / 10);
    if (!e) return;
    run(e, &p[0], 1, o);
    free_res(o, 1);
    run(e, &p[0], 1, o);
    check_same(&o[0], &ref[0], V, "one chain over budget");
    ASSERT_EQ(o[0].n_cached, fi == 0 ? 160 : 192);
    free_res(o, 1);
    kv_engine_get_stats(e, &es);
    ASSERT_TRUE(es.cache_bytes <= es.cache_budget);
    ASSERT_EQ(es.cache_blocks, fi == 0 ? 5 : 6);
    kv_engine_free(e);
    free_res(ref, 3);
}

static void test_lru_qwen3moe(void) { lru(0); }
static void test_lru_qwen35moe(void) { lru(1); }

/* ---- the cache alone against a naive model ------------------------------- */

/* The model: a flat array of blocks, each its whole prefix of tokens, a
 * use tick, a recurrent flag; the same policy written the slow way
 * (eviction: the least recently used block that no live block extends and
 * that is not held; then the least recently used state). Random chains
 * over a 3-token alphabet (prefixes shared often) with budgets of a few
 * blocks: every match must equal the model's, every matched block's bytes
 * must be those filled for its own prefix, and the bytes held must stay
 * within the budget. */
#define MB 4        /* tokens per block */
#define MD 6        /* deepest block */
#define MN 4096     /* model blocks ever */

typedef struct mblk {
    int32_t tok[MD * MB];
    uint32_t depth;
    uint64_t used;
    bool rec, alive;
} mblk;

static mblk g_m[MN];
static uint32_t g_mn;
static uint64_t g_tick, g_mbytes, g_e0, g_rb, g_budget;

static uint64_t prefix_hash(const int32_t *tok, uint32_t n) {
    uint64_t h = 1469598103934665603ull;
    for (uint32_t i = 0; i < n; i++) h = (h ^ (uint32_t)tok[i]) * 1099511628211ull;
    return h;
}

typedef struct fill_ctx {
    const int32_t *tok;
    uint32_t n;
    bool fail;
} fill_ctx;

static int fill_fn(void *arg, void *kv, void *rec) {
    const fill_ctx *c = arg;
    if (c->fail) return KV_EIO;
    const uint64_t h = prefix_hash(c->tok, c->n);
    if (kv) memcpy(kv, &h, 8);
    if (rec) {
        memcpy(rec, &h, 8);
        memcpy((uint8_t *)rec + 8, &c->n, 4);
    }
    return 0;
}

static int m_find(const int32_t *tok, uint32_t depth) {
    for (uint32_t i = 0; i < g_mn; i++)
        if (g_m[i].alive && g_m[i].depth == depth && !memcmp(g_m[i].tok, tok, (depth + 1) * MB * sizeof *tok))
            return (int)i;
    return -1;
}

static bool m_has_child(int i) {
    for (uint32_t j = 0; j < g_mn; j++)
        if (g_m[j].alive && g_m[j].depth == g_m[i].depth + 1 && !memcmp(g_m[j].tok, g_m[i].tok, (g_m[i].depth + 1) * MB * 4))
            return true;
    return false;
}

static bool m_room(uint64_t need, int held0, int held1) {
    while (g_mbytes + need > g_budget) {
        int best = -1;
        for (uint32_t i = 0; i < g_mn; i++)
            if (g_m[i].alive && (int)i != held0 && (int)i != held1 && !m_has_child((int)i) &&
                (best < 0 || g_m[i].used < g_m[best].used))
                best = (int)i;
        if (best >= 0) {
            g_m[best].alive = false;
            g_mbytes -= g_e0 + (g_m[best].rec ? g_rb : 0);
            continue;
        }
        for (uint32_t i = 0; i < g_mn; i++)
            if (g_m[i].alive && g_m[i].rec && (best < 0 || g_m[i].used < g_m[best].used)) best = (int)i;
        if (best < 0) return false;
        g_m[best].rec = false;
        g_mbytes -= g_rb;
    }
    return true;
}

/* the model's insert: the block's index, or -1 when not kept */
static int m_insert(int parent, const int32_t *tok, uint32_t depth, bool with_rec, bool fail) {
    with_rec = with_rec && g_rb;
    int e = m_find(tok, depth);
    if (e >= 0) {
        if (with_rec && !g_m[e].rec && m_room(g_rb, parent, e) && !fail) {
            g_m[e].rec = true;
            g_mbytes += g_rb;
        }
        g_m[e].used = ++g_tick;
        return e;
    }
    const uint64_t bytes = g_e0 + (with_rec ? g_rb : 0);
    if (bytes > g_budget || !m_room(bytes, parent, -1) || fail) return -1;
    KV_ASSERT(g_mn < MN);
    mblk *b = &g_m[g_mn];
    memcpy(b->tok, tok, (depth + 1) * MB * sizeof *tok);
    b->depth = depth;
    b->rec = with_rec;
    b->alive = true;
    b->used = ++g_tick;
    g_mbytes += bytes;
    return (int)g_mn++;
}

static void cache_vs_model(uint64_t rec_bytes, uint32_t budget_blocks, uint64_t seed) {
    kv_diag d = {0};
    kv_pcache *c = NULL;
    /* one block's size, measured: an empty cache, one insert */
    ASSERT_EQ(kv_pcache_new(&c, 1 << 20, MB, 8, rec_bytes, &d), 0);
    const int32_t z[MB] = {0};
    fill_ctx fz = {z, MB, false};
    ASSERT_TRUE(kv_pcache_insert(c, NULL, 0, z, false, fill_fn, &fz) != NULL);
    kv_pcache_stats ps;
    kv_pcache_get_stats(c, &ps);
    kv_pcache_free(c);
    g_e0 = ps.bytes;
    g_rb = rec_bytes;
    g_budget = budget_blocks * g_e0 + (budget_blocks / 2) * rec_bytes;
    g_mn = 0;
    g_tick = g_mbytes = 0;
    ASSERT_EQ(kv_pcache_new(&c, g_budget, MB, 8, rec_bytes, &d), 0);
    kv_pc_entry *path[MD];
    uint64_t x = seed;
    uint32_t n_match = 0;
    for (int op = 0; op < 3000 && g_mn < MN - MD; op++) {
        int32_t tok[MD * MB];
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const uint32_t nb = 1 + (uint32_t)(x >> 60) % MD;
        /* one of three base streams, often with one token changed: prefixes shared */
        const uint32_t base = (uint32_t)(x >> 20) % 3;
        for (uint32_t i = 0; i < nb * MB; i++) tok[i] = (int32_t)((base * 7 + i * (base + 1)) % 5);
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        if (x >> 63) tok[(x >> 32) % (nb * MB)] = 9;
        /* match: the cache and the model agree, and the bytes are the prefix's own */
        const uint32_t m = kv_pcache_match(c, tok, nb * MB, nb, path);
        uint32_t mm = 0;
        while (mm < nb && m_find(tok, mm) >= 0) mm++;
        if (m != mm) {
            KVT_FAIL("op %d: matched %u blocks, the model %u", op, m, mm);
            break;
        }
        for (uint32_t i = 0; i < m; i++) {
            uint64_t h;
            memcpy(&h, kv_pc_entry_kv(path[i]), 8);
            if (h != prefix_hash(tok, (i + 1) * MB)) KVT_FAIL("op %d: block %u holds another prefix's bytes", op, i);
            const bool has = kv_pc_entry_rec(path[i]) != NULL;
            if (has != g_m[m_find(tok, i)].rec) KVT_FAIL("op %d: block %u state %d, the model %d", op, i, has, !has);
        }
        n_match += m;
        kv_pcache_touch(c, path, m);
        for (uint32_t i = m; i-- > 0;) g_m[m_find(tok, i)].used = ++g_tick;
        /* then store the rest of the chain, as a session completing blocks does */
        kv_pc_entry *parent = m ? path[m - 1] : NULL;
        int mparent = m ? m_find(tok, m - 1) : -1;
        for (uint32_t k = m; k < nb; k++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            const bool with_rec = (x >> 63) != 0, fail = (x >> 32) % 50 == 0;
            fill_ctx fc = {tok, (k + 1) * MB, fail};
            kv_pc_entry *e = kv_pcache_insert(c, parent, k, tok + k * MB, with_rec, fill_fn, &fc);
            const int me = m_insert(mparent, tok, k, with_rec, fail);
            if ((e != NULL) != (me >= 0)) {
                KVT_FAIL("op %d: insert of block %u: cache %s, model %s", op, k, e ? "kept" : "no", me >= 0 ? "kept" : "no");
                op = 1 << 30;
                break;
            }
            if (!e) break;
            parent = e;
            mparent = me;
        }
        kv_pcache_get_stats(c, &ps);
        if (ps.bytes != g_mbytes || ps.bytes > g_budget) {
            KVT_FAIL("op %d: %llu bytes held, the model %llu, budget %llu", op, (unsigned long long)ps.bytes,
                     (unsigned long long)g_mbytes, (unsigned long long)g_budget);
            break;
        }
    }
    ASSERT_TRUE(n_match > 100); /* the run did reuse */
    kv_pcache_get_stats(c, &ps);
    ASSERT_TRUE(ps.evictions > 0);
    kv_pcache_free(c);
}

static void test_cache_model(void) {
    cache_vs_model(0, 8, 1);
    cache_vs_model(0, 3, 2);
    cache_vs_model(24, 8, 3);
    cache_vs_model(24, 4, 4);
}

/* ---- options ------------------------------------------------------------- */

static void test_opts(void) {
    kv_diag d = {0};
    kv_engine *e = NULL;
    kv_engine_opts o = {.n_threads = 1, .n_ctx = N_CTX, .prompt_cache_bytes = 1 << 20, .prompt_cache_block = 24};
    ASSERT_EQ(kv_engine_open(&e, g_fx[0].model, &o, &d), KV_EINVAL);
    ASSERT_TRUE(e == NULL && strstr(d.msg, "prompt cache block of 24") != NULL);
    o.prompt_cache_block = 8192;
    ASSERT_EQ(kv_engine_open(&e, g_fx[0].model, &o, &d), KV_EINVAL);
    /* a budget smaller than one block: nothing is kept, nothing breaks */
    o.prompt_cache_block = 0;
    o.prompt_cache_bytes = 100;
    ASSERT_EQ(kv_engine_open(&e, g_fx[0].model, &o, &d), 0);
    if (!e) return;
    static req a;
    a = (req){.n_prompt = 150, .temp = 0.0f, .max_tokens = 4};
    fill(a.prompt, a.n_prompt, 8, g_fx[0].n_vocab);
    result ref, r[1];
    ref_run(&g_fx[0], &a, &ref);
    for (int k = 0; k < 2; k++) {
        run(e, &a, 1, r);
        check_same(&r[0], &ref, g_fx[0].n_vocab, "tiny budget");
        ASSERT_EQ(r[0].n_cached, 0);
        free_res(r, 1);
    }
    kv_engine_stats es;
    kv_engine_get_stats(e, &es);
    ASSERT_EQ(es.cache_blocks, 0);
    ASSERT_EQ(es.cache_bytes, 0);
    free_res(&ref, 1);
    kv_engine_free(e);
}

static int setup(void) { return fixtures_open("/tmp/kvasir-pcache.XXXXXX", 77, 9, 0); }

static void teardown(void) { fixtures_close(); }

static const kvt_case cases[] = {
    KVT_CASE(test_cold_warm_qwen3moe), KVT_CASE(test_cold_warm_qwen35moe), KVT_CASE(test_lru_qwen3moe),
    KVT_CASE(test_lru_qwen35moe),      KVT_CASE(test_f16),                KVT_CASE(test_cache_model),
    KVT_CASE(test_opts),
};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
