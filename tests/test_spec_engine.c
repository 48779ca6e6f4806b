/* kv-test-labels: unit */
/* Speculative decoding's parts against independent references:
 *
 *   - the ngram source (kv_draft_ngram) against a brute-force search
 *     written here from its definition (longest suffix up to 4 tokens, its
 *     latest earlier occurrence, what follows), on random token strings
 *     over small alphabets;
 *   - rollback (kv_state_spec_keep / kv_state_seq_rollback): a sequence
 *     fed 1 + k tokens in one call and rolled back to each kept length has
 *     exactly the recurrent state (qwen35moe, byte compare) of a sequence
 *     fed only those tokens, one at a time, and the logits of the next
 *     token are byte-identical to that sequence's; for qwen3moe (no
 *     recurrent state) the same logits;
 *   - the engine: four sessions joining at different steps (prefill
 *     chunks beside verify passes), greedy, seeded and with penalties, each
 *     session's tokens, logits and stop reason with the ngram source and
 *     with the test source (the last session's plain tokens at acceptance 0.8, so
 *     accepted and rejected drafts share steps) byte-identical to the same
 *     engine without a source (the reference), with fewer forward passes. */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kvasir/engine.h"
#include "kvasir/gen.h"
#include "kvasir/quant.h"
#include "kvtest.h"
#include "engine/spec.h"

static char g_dir[200];

typedef struct fixture {
    char model[300];
    kv_model *m;
    uint32_t n_vocab;
} fixture;
static fixture g_fx[2]; /* qwen3moe, qwen35moe */

static bool fixture_make(fixture *f, const char *arch) {
    kv_diag d = {0};
    kv_gen_config c;
    if (!strcmp(arch, "qwen3moe")) {
        if (kv_gen_preset_get("tiny", &c, &d)) return false;
        c.n_layer = 3; c.n_embd = 64; c.n_ff_exp = 32; c.n_expert = 8; c.n_expert_used = 3;
        c.n_head = 4; c.n_head_kv = 2; c.head_dim = 16; c.n_vocab = 400; c.type = KV_TYPE_Q8_0;
        c.seed = 31;
    } else {
        c = (kv_gen_config){.arch = "qwen35moe", .n_layer = 4, .n_embd = 64, .n_ff_exp = 32, .n_expert = 8,
                            .n_expert_used = 2, .n_head = 4, .n_head_kv = 2, .head_dim = 16, .n_vocab = 400,
                            .type = KV_TYPE_F32, .seed = 32, .full_attn_interval = 2,
                            .ssm_d_state = 16, .ssm_n_group = 2, .ssm_dt_rank = 4, .n_rot = 8,
                            .rope_sections = {2, 1, 1, 0}, .n_nextn = 1, .n_ff_shexp = 32};
        kv_gen_fill_defaults(&c);
    }
    c.n_ctx = 512;
    c.n_threads = 1;
    c.log = NULL;
    snprintf(f->model, sizeof f->model, "%s/%s.gguf", g_dir, arch);
    if (kv_gen_model(&c, f->model, &d) || kv_model_load(&f->m, f->model, &d)) {
        fprintf(stderr, "fixture %s: %s\n", arch, d.msg);
        return false;
    }
    f->n_vocab = kv_model_hparams(f->m)->n_vocab;
    return true;
}

static uint64_t g_rng = 0x1234567;
static uint32_t rnd(uint32_t n) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(g_rng >> 33) % n;
}

/* ---- ngram against brute force ---------------------------------------------- */

/* From the definition: for g = min(4, n-1) down to 1, the largest i with
 * i + g < n and toks[i..i+g) == toks[n-g..n); the tokens after it, at most
 * k and up to n. */
static uint32_t ngram_ref(const int32_t *t, uint32_t n, uint32_t k, int32_t *out) {
    if (n < 2 || k == 0) return 0;
    for (int g = (int)(n - 1 < 4 ? n - 1 : 4); g >= 1; g--) {
        int best = -1;
        for (int i = 0; i + g < (int)n; i++) {
            bool eq = true;
            for (int j = 0; j < g; j++) eq &= t[i + j] == t[(int)n - g + j];
            if (eq) best = i;
        }
        if (best < 0) continue;
        uint32_t m = 0;
        for (uint32_t j = (uint32_t)best + (uint32_t)g; j < n && m < k; j++) out[m++] = t[j];
        return m;
    }
    return 0;
}

static void test_ngram(void) {
    int32_t t[300], a[KV_DRAFT_MAX], b[KV_DRAFT_MAX];
    for (int trial = 0; trial < 3000; trial++) {
        const uint32_t n = 1 + rnd(200), alpha = 2 + rnd(trial % 3 ? 6 : 40), k = 1 + rnd(KV_DRAFT_MAX);
        for (uint32_t i = 0; i < n; i++) t[i] = (int32_t)rnd(alpha);
        const uint32_t ma = kv_draft_ngram(t, n, k, a), mb = ngram_ref(t, n, k, b);
        ASSERT_EQ(ma, mb);
        if (ma == mb && memcmp(a, b, ma * sizeof *a)) KVT_FAIL("trial %d: ngram drafts differ", trial);
    }
    /* a repeat is found: "1 2 3 4 1 2" continues "3 4 1 2" */
    const int32_t r[] = {1, 2, 3, 4, 1, 2};
    ASSERT_EQ(kv_draft_ngram(r, 6, 4, a), 4);
    ASSERT_EQ(a[0], 3);
    ASSERT_EQ(a[3], 2);
    ASSERT_EQ(kv_draft_ngram(r, 6, 0, a), 0);
}

/* ---- rollback against a sequence fed only the kept tokens -------------------- */

static void test_rollback(fixture *f) {
    kv_diag d = {0};
    kv_pool *pool = NULL;
    kv_state *st = NULL;
    const kv_state_opts so = {.n_ctx = 256, .n_batch = 32, .n_seq = 2, .max_tokens = 32};
    ASSERT_EQ(kv_pool_new(&pool, 2, &d), 0);
    ASSERT_EQ(kv_state_new(&st, f->m, pool, &so, &d), 0);
    if (!st) return;
    const uint32_t V = f->n_vocab, K = 5;
    int32_t prompt[19], fed[K + 1];
    for (uint32_t i = 0; i < 19; i++) prompt[i] = (int32_t)(3 + rnd(V - 3));
    for (uint32_t i = 0; i <= K; i++) fed[i] = (int32_t)(3 + rnd(V - 3));
    const uint64_t rb = kv_state_rec_bytes(st);
    uint8_t *ra = rb ? malloc(rb) : NULL, *rr = rb ? malloc(rb) : NULL;
    float *la = malloc(V * sizeof *la), *lr = malloc(V * sizeof *lr), *lk = malloc((K + 1) * V * sizeof *lk);
    uint32_t out[K + 1], seq0[K + 1];
    for (uint32_t i = 0; i <= K; i++) out[i] = i, seq0[i] = 0;
    for (uint32_t keep = 1; keep <= K + 1; keep++) {
        kv_state_reset(st);
        /* sequence 0: the prompt, then 1 + K tokens in one call, rolled back to keep of them */
        ASSERT_EQ(kv_state_eval_seq(st, 0, prompt, 19, NULL, &d), 0);
        ASSERT_EQ(kv_state_spec_keep(st, 0, K, &d), 0);
        ASSERT_EQ(kv_state_batch(st, fed, seq0, K + 1, out, K + 1, lk, &d), 0);
        ASSERT_TRUE(kv_state_hidden_out(st, K) != NULL);
        ASSERT_TRUE(kv_state_hidden_out(st, K + 1) == NULL);
        ASSERT_EQ(kv_state_seq_rollback(st, 0, 19 + keep, &d), 0);
        ASSERT_EQ(kv_state_pos_seq(st, 0), 19 + keep);
        /* sequence 1: the prompt, then those keep tokens one at a time */
        ASSERT_EQ(kv_state_eval_seq(st, 1, prompt, 19, NULL, &d), 0);
        for (uint32_t i = 0; i < keep; i++) {
            ASSERT_EQ(kv_state_eval_seq(st, 1, fed + i, 1, lr, &d), 0);
            /* the verify pass's logits of position i are the plain ones */
            if (memcmp(lr, lk + (size_t)i * V, V * sizeof *lr)) KVT_FAIL("keep %u: verify logits %u differ", keep, i);
        }
        if (rb) {
            ASSERT_EQ(kv_state_rec_get(st, 0, ra, &d), 0);
            ASSERT_EQ(kv_state_rec_get(st, 1, rr, &d), 0);
            if (memcmp(ra, rr, rb)) KVT_FAIL("keep %u: recurrent state differs from the plain sequence's", keep);
        }
        /* the next token: the same logits */
        const int32_t nx = 7;
        ASSERT_EQ(kv_state_eval_seq(st, 0, &nx, 1, la, &d), 0);
        ASSERT_EQ(kv_state_eval_seq(st, 1, &nx, 1, lr, &d), 0);
        if (memcmp(la, lr, V * sizeof *la)) KVT_FAIL("keep %u: next logits differ after the rollback", keep);
    }
    /* what cannot be rolled back is refused, nothing changed */
    const uint32_t pos = kv_state_pos_seq(st, 0);
    ASSERT_EQ(kv_state_seq_rollback(st, 0, pos + 1, &d), KV_EINVAL);
    if (rb) ASSERT_EQ(kv_state_seq_rollback(st, 0, pos - 3, &d), KV_EINVAL); /* nothing kept by the last call */
    ASSERT_EQ(kv_state_pos_seq(st, 0), pos);
    ASSERT_EQ(kv_state_spec_keep(st, 0, KV_SPEC_MAX_KEEP + 1, &d), KV_EINVAL);
    free(ra);
    free(rr);
    free(la);
    free(lr);
    free(lk);
    kv_state_free(st);
    kv_pool_free(pool);
}

static void test_rollback_qwen3moe(void) { test_rollback(&g_fx[0]); }
static void test_rollback_qwen35moe(void) { test_rollback(&g_fx[1]); }

/* ---- the engine: with and without a source ---------------------------------- */

#define NS 4
#define GEN 40

typedef struct res {
    int32_t tok[GEN];
    float *logits; /* [GEN][n_vocab] */
    uint32_t n;
    enum kv_stop stop;
} res;

/* Runs NS sessions (session i joins at step 3*i) to their end; returns
 * the forward passes and fills r. */
static uint64_t run_engine(fixture *f, const char *draft, int mode, res *r, kv_engine_stats *es) {
    kv_diag d = {0};
    kv_engine *e = NULL;
    const kv_engine_opts eo = {.n_threads = 2, .n_ctx = 256, .n_batch = 9, .max_sessions = NS, .draft = draft,
                               .draft_max = 4};
    if (kv_engine_open_model(&e, f->m, NULL, &eo, &d)) {
        KVT_FAIL("engine: %s", d.msg);
        return 0;
    }
    kv_session *s[NS] = {0};
    int32_t prompt[30];
    for (uint32_t i = 0; i < 30; i++) prompt[i] = (int32_t)(10 + (i % 7) * 3); /* repeats: ngram finds them */
    for (int step = 0, live = NS; live > 0; step++) {
        for (int i = 0; i < NS; i++)
            if (!s[i] && step == 3 * i) {
                kv_session_opts so = {.sample = kv_sample_defaults(), .max_tokens = GEN - 2 * (uint32_t)i,
                                      .ignore_eog = true};
                so.sample.seed = 100 + (uint64_t)i;
                if (mode == 0) so.sample.temp = 0;
                if (mode == 2) {
                    so.sample.repeat_penalty = 1.2f;
                    so.sample.presence_penalty = 0.3f;
                    so.sample.frequency_penalty = 0.2f;
                }
                ASSERT_EQ(kv_session_new(&s[i], e, &so, &d), 0);
                ASSERT_EQ(kv_session_prompt(s[i], prompt, 12 + 6 * (uint32_t)i, &d), 0);
                r[i].logits = malloc((size_t)GEN * f->n_vocab * sizeof(float));
                r[i].n = 0;
            }
        if (kv_engine_step(e, &d) < 0) {
            KVT_FAIL("step: %s", d.msg);
            break;
        }
        live = 0;
        for (int i = 0; i < NS; i++) {
            if (!s[i]) {
                live++;
                continue;
            }
            const int32_t t = kv_session_token(s[i]);
            if (t >= 0 && r[i].n < GEN) {
                memcpy(r[i].logits + (size_t)r[i].n * f->n_vocab, kv_session_logits(s[i]), f->n_vocab * sizeof(float));
                r[i].tok[r[i].n++] = t;
            }
            const enum kv_session_status ss = kv_session_status(s[i]);
            if (ss == KV_SESSION_DONE) r[i].stop = kv_session_stop_reason(s[i]);
            else live++;
            ASSERT_TRUE(ss != KV_SESSION_FAILED);
            if (ss == KV_SESSION_FAILED) live--;
        }
        if (step > 2000) {
            KVT_FAIL("no end");
            break;
        }
    }
    kv_engine_get_stats(e, es);
    kv_engine_free(e);
    return es->steps;
}

static void check_same(fixture *f, res *a, res *b, int mode, const char *what) {
    for (int i = 0; i < NS; i++) {
        ASSERT_EQ(a[i].n, b[i].n);
        ASSERT_EQ(a[i].stop, b[i].stop);
        ASSERT_TRUE(a[i].n > 0);
        if (a[i].n == b[i].n && memcmp(a[i].tok, b[i].tok, a[i].n * sizeof(int32_t)))
            KVT_FAIL("%s mode %d session %d: tokens differ", what, mode, i);
        if (a[i].n == b[i].n && memcmp(a[i].logits, b[i].logits, (size_t)a[i].n * f->n_vocab * sizeof(float)))
            KVT_FAIL("%s mode %d session %d: logits differ", what, mode, i);
        free(b[i].logits);
    }
}

/* Plain, then ngram, then the test source replaying the last session's
 * plain tokens at acceptance 0.8 (its drafts mostly right, the others'
 * mostly wrong: accepted and rejected drafts in the same steps). */
static void test_engine(fixture *f) {
    for (int mode = 0; mode < 3; mode++) {
        res a[NS] = {0}, b[NS] = {0}, c[NS] = {0};
        kv_engine_stats ea, eb, ec;
        const uint64_t pa = run_engine(f, NULL, mode, a, &ea);
        const uint64_t pb = run_engine(f, "ngram", mode, b, &eb);
        check_same(f, a, b, mode, "ngram");
        char path[300], spec[340];
        snprintf(path, sizeof path, "%s/rec-%d.txt", g_dir, mode);
        FILE *fp = fopen(path, "w");
        for (uint32_t i = 0; fp && i < a[NS - 1].n; i++) fprintf(fp, "%d%c", a[NS - 1].tok[i], i % 10 == 9 ? '\n' : ',');
        if (fp) fclose(fp);
        snprintf(spec, sizeof spec, "test:%s:0.8:5", path);
        const uint64_t pc = run_engine(f, spec, mode, c, &ec);
        check_same(f, a, c, mode, "test");
        for (int i = 0; i < NS; i++) free(a[i].logits);
        ASSERT_EQ(ea.spec_steps, 0);
        ASSERT_TRUE(eb.spec_accepted <= eb.spec_drafted);
        ASSERT_TRUE(ec.spec_steps > 0);
        ASSERT_TRUE(ec.spec_accepted > 0 && ec.spec_accepted < ec.spec_drafted);
        ASSERT_EQ(ea.tokens_sampled, eb.tokens_sampled);
        ASSERT_EQ(ea.tokens_sampled, ec.tokens_sampled);
        ASSERT_TRUE(pb <= pa);
        ASSERT_TRUE(pc < pa);
        fprintf(stderr, "  mode %d: %llu forward passes plain, %llu with ngram (%llu/%llu accepted), %llu with test "
                "(%llu/%llu)\n", mode, (unsigned long long)pa, (unsigned long long)pb,
                (unsigned long long)eb.spec_accepted, (unsigned long long)eb.spec_drafted, (unsigned long long)pc,
                (unsigned long long)ec.spec_accepted, (unsigned long long)ec.spec_drafted);
    }
}

static void test_engine_qwen3moe(void) { test_engine(&g_fx[0]); }
static void test_engine_qwen35moe(void) { test_engine(&g_fx[1]); }

static void test_opts(void) {
    kv_diag d = {0};
    kv_engine *e = NULL;
    kv_engine_opts eo = {.n_threads = 1, .n_ctx = 64, .draft = "ngram", .draft_max = KV_DRAFT_MAX + 1};
    ASSERT_EQ(kv_engine_open_model(&e, g_fx[0].m, NULL, &eo, &d), KV_EINVAL);
    ASSERT_TRUE(strstr(d.msg, "draft-max") != NULL);
    eo.draft_max = 2;
    eo.draft = "wat";
    ASSERT_EQ(kv_engine_open_model(&e, g_fx[0].m, NULL, &eo, &d), KV_EINVAL);
    ASSERT_TRUE(strstr(d.msg, "unknown source") != NULL);
    eo.draft = "test:/nonexistent/x:0.5";
    ASSERT_EQ(kv_engine_open_model(&e, g_fx[0].m, NULL, &eo, &d), KV_EIO);
    eo.draft = "none";
    ASSERT_EQ(kv_engine_open_model(&e, g_fx[0].m, NULL, &eo, &d), 0);
    kv_engine_free(e);
}

static int setup(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/kvasir-spec.XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    return !fixture_make(&g_fx[0], "qwen3moe") || !fixture_make(&g_fx[1], "qwen35moe");
}

static void teardown(void) {
    for (int i = 0; i < 2; i++) kv_model_free(g_fx[i].m);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (!kvt_failures) (void)!system(cmd);
}

static const kvt_case cases[] = {
    KVT_CASE(test_ngram),           KVT_CASE(test_rollback_qwen3moe), KVT_CASE(test_rollback_qwen35moe),
    KVT_CASE(test_engine_qwen3moe), KVT_CASE(test_engine_qwen35moe),  KVT_CASE(test_opts),
};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
