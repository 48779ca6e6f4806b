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
 *     engine without a source (the reference), with fewer forward passes;
 *   - the MTP block (kv_mtp_step) against an f64 reference written here
 *     from the block's definition (eh_proj over [enorm(embedding);
 *     hnorm(h)], gated attention with per-head norms and interleaved
 *     multi-section RoPE over its own K/V, softmax top-k experts and the
 *     gated shared expert, shared_head_norm, LM head), over a chain of
 *     positions and after forgetting some; the mtp source in the engine
 *     exact like the others. */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kvasir/engine.h"
#include "kvasir/gen.h"
#include "kvasir/quant.h"
#include "kvtest.h"
#include "engine_fixture.h"
#include "ref64.h"
#include "engine/spec.h"
#include "model/model_internal.h"

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

/* ---- the MTP block against an f64 reference ---------------------------------- */

/* y = W x for a 2-D F32 weight (or one expert matrix at base), in double */
static void mv(const kv_weight *w, const float *base, const double *x, double *y) {
    ref_matvec(y, base ? base : (const float *)w->data, x, (int)w->ne[1], (int)w->ne[0]);
}

/* interleaved multi-section RoPE from its definition: pair i (of n_rot/2,
 * NeoX pairing i, i + n_rot/2) takes the position of its section's
 * component (t, h, w cycling over sectors, each within 3x its count; e = 0
 * for text), angle pos * base^(-2i/n_rot) * freq_scale */
static void imrope_ref(double *x, const kv_hparams *hp, uint32_t pos) {
    const int64_t half = hp->n_rot / 2;
    const int32_t *sec = hp->rope_sections;
    const int sd = sec[0] + sec[1] + sec[2] + sec[3];
    for (int64_t i = 0; i < half; i++) {
        const int sector = (int)(i % sd);
        double p = 0; /* e */
        if ((sector % 3 == 1 && sector < 3 * sec[1]) || (sector % 3 == 2 && sector < 3 * sec[2]) ||
            (sector % 3 == 0 && sector < 3 * sec[0]))
            p = pos;
        const double th = p * pow((double)hp->rope_freq_base, -2.0 * (double)i / (double)hp->n_rot) *
                          (double)hp->rope_freq_scale;
        const double a = x[i], b = x[i + half];
        x[i] = a * cos(th) - b * sin(th);
        x[i + half] = a * sin(th) + b * cos(th);
    }
}

#define RMAX 64
typedef struct mtp_ref {
    double k[RMAX][256], v[RMAX][256];
    uint32_t pos[RMAX];
    uint32_t n;
} mtp_ref;

/* One MTP position in f64; hout[E], logits[V]. */
static void mtp_ref_step(const kv_model *m, mtp_ref *r, const float *hin, int32_t tok, uint32_t pos, double *hout,
                         double *logits) {
    const kv_hparams *hp = &m->hp;
    const kv_layer *L = &m->layers[hp->n_layer];
    const int64_t E = hp->n_embd, HD = hp->head_dim, H = hp->n_head, HKV = hp->n_head_kv, QD = H * HD;
    const int64_t KVD = HKV * HD, NE = hp->n_expert, K = hp->n_expert_used, F = hp->n_ff_exp, S = hp->n_ff_shexp;
    const double eps = hp->rms_eps;
    double cat[1024], e[512], hh[512], u[512], xb[512], qg[1024], q[512], k[256], v[256], o[512], t[512];
    const float *emb = (const float *)m->tok_embd.data + (size_t)tok * E;
    for (int64_t i = 0; i < E; i++) e[i] = emb[i], hh[i] = hin[i];
    ref_rms(cat, e, L->nextn_enorm.data, E, eps);
    ref_rms(cat + E, hh, L->nextn_hnorm.data, E, eps);
    mv(&L->nextn_eh_proj, NULL, cat, u);
    ref_rms(xb, u, L->attn_norm.data, E, eps);
    mv(&L->wq, NULL, xb, qg);
    mv(&L->wk, NULL, xb, k);
    mv(&L->wv, NULL, xb, v);
    for (int64_t h = 0; h < H; h++) {
        ref_rms(q + h * HD, qg + h * 2 * HD, L->q_norm.data, HD, eps);
        imrope_ref(q + h * HD, hp, pos);
    }
    for (int64_t h = 0; h < HKV; h++) {
        ref_rms(k + h * HD, k + h * HD, L->k_norm.data, HD, eps);
        imrope_ref(k + h * HD, hp, pos);
    }
    /* this position's K/V replaces any at pos or after (what kv_mtp_step's caller forgot) */
    uint32_t n = 0;
    while (n < r->n && r->pos[n] < pos) n++;
    memcpy(r->k[n], k, KVD * sizeof(double));
    memcpy(r->v[n], v, KVD * sizeof(double));
    r->pos[n] = pos;
    r->n = n + 1;
    for (int64_t h = 0; h < H; h++) {
        const int64_t kh = h / (H / HKV);
        double sc[RMAX], mx = -1e300, sum = 0;
        for (uint32_t j = 0; j < r->n; j++) {
            double dd = 0;
            for (int64_t i = 0; i < HD; i++) dd += q[h * HD + i] * r->k[j][kh * HD + i];
            sc[j] = dd / sqrt((double)HD);
            if (sc[j] > mx) mx = sc[j];
        }
        for (uint32_t j = 0; j < r->n; j++) sum += (sc[j] = exp(sc[j] - mx));
        for (int64_t i = 0; i < HD; i++) {
            double acc = 0;
            for (uint32_t j = 0; j < r->n; j++) acc += sc[j] / sum * r->v[j][kh * HD + i];
            o[h * HD + i] = acc * ref_sigm(qg[h * 2 * HD + HD + i]);
        }
    }
    (void)QD;
    mv(&L->wo, NULL, o, t);
    double x[512], ffn[512], pr[256], g[512], up[512], act[512], y[512];
    for (int64_t i = 0; i < E; i++) x[i] = u[i] + t[i], ffn[i] = 0;
    ref_rms(xb, x, L->post_norm.data, E, eps);
    mv(&L->gate_inp, NULL, xb, pr);
    double mx = -1e300, sum = 0;
    for (int64_t i = 0; i < NE; i++) mx = pr[i] > mx ? pr[i] : mx;
    for (int64_t i = 0; i < NE; i++) sum += (pr[i] = exp(pr[i] - mx));
    for (int64_t i = 0; i < NE; i++) pr[i] /= sum;
    int ids[16];
    double w[16], ws = 0;
    for (int64_t rr = 0; rr < K; rr++) {
        int best = -1;
        for (int64_t ex = 0; ex < NE; ex++) {
            bool taken = false;
            for (int64_t qq = 0; qq < rr; qq++) taken |= ids[qq] == ex;
            if (!taken && (best < 0 || pr[ex] > pr[best])) best = (int)ex;
        }
        ids[rr] = best;
        ws += (w[rr] = pr[best]);
    }
    for (int64_t rr = 0; rr < K; rr++) {
        if (hp->expert_weights_norm) w[rr] /= ws;
        const int ex = ids[rr];
        mv(&L->gate_exps, (const float *)((const uint8_t *)L->gate_exps.data + (size_t)ex * L->gate_exps.nb2), xb, g);
        mv(&L->up_exps, (const float *)((const uint8_t *)L->up_exps.data + (size_t)ex * L->up_exps.nb2), xb, up);
        for (int64_t i = 0; i < F; i++) act[i] = ref_silu(g[i]) * up[i];
        mv(&L->down_exps, (const float *)((const uint8_t *)L->down_exps.data + (size_t)ex * L->down_exps.nb2), act, y);
        for (int64_t i = 0; i < E; i++) ffn[i] += w[rr] * y[i];
    }
    mv(&L->gate_shexp, NULL, xb, g);
    mv(&L->up_shexp, NULL, xb, up);
    for (int64_t i = 0; i < S; i++) act[i] = ref_silu(g[i]) * up[i];
    mv(&L->down_shexp, NULL, act, y);
    double gs;
    mv(&L->gate_inp_shexp, NULL, xb, &gs);
    for (int64_t i = 0; i < E; i++) x[i] += ffn[i] + y[i] * ref_sigm(gs);
    ref_rms(hout, x, (L->nextn_head_norm.data ? L->nextn_head_norm.data : m->output_norm.data), E, eps);
    mv(&m->output, NULL, hout, logits);
}

static void test_mtp_f64(void) {
    const kv_model *m = g_fx[1].m;
    const kv_hparams *hp = &m->hp;
    const uint32_t E = hp->n_embd, V = hp->n_vocab;
    ASSERT_TRUE(E <= 512 && (int64_t)hp->n_head_kv * hp->head_dim <= 256 && m->tok_embd.type == KV_TYPE_F32);
    kv_diag d = {0};
    kv_pool *pool = NULL;
    kv_mtp *t = NULL;
    ASSERT_EQ(kv_pool_new(&pool, 2, &d), 0);
    ASSERT_EQ(kv_mtp_new(&t, m, NULL, pool, 2, &d), 0);
    if (!t) return;
    static mtp_ref r;
    memset(&r, 0, sizeof r);
    float h[512], ho[512];
    double rh[512], rl[1024];
    float *lg = malloc(V * sizeof *lg);
    for (uint32_t i = 0; i < E; i++) h[i] = (float)((int)rnd(2001) - 1000) / 700.0f;
    /* positions 0..5 chained on the block's own output, then 3 again after forgetting from 3 */
    const uint32_t seqpos[] = {0, 1, 2, 3, 4, 5, 3, 4};
    double worst = 0, worst_h = 0;
    for (size_t st = 0; st < sizeof seqpos / sizeof *seqpos; st++) {
        const uint32_t pos = seqpos[st];
        const int32_t tok = (int32_t)(3 + rnd(V - 3));
        if (st == 6) kv_mtp_forget(t, 1, 3);
        ASSERT_EQ(kv_mtp_step(t, 1, h, tok, pos, ho, lg, &d), 0);
        mtp_ref_step(m, &r, h, tok, pos, rh, rl);
        double lmax = 0;
        for (uint32_t i = 0; i < V; i++) lmax = fabs(rl[i]) > lmax ? fabs(rl[i]) : lmax;
        for (uint32_t i = 0; i < V; i++) {
            const double e = fabs((double)lg[i] - rl[i]) / lmax;
            worst = e > worst ? e : worst;
        }
        for (uint32_t i = 0; i < E; i++) {
            const double e = fabs((double)ho[i] - rh[i]);
            worst_h = e > worst_h ? e : worst_h;
        }
        memcpy(h, ho, sizeof h);
    }
    fprintf(stderr, "  mtp vs f64: logits max error %.3g of the largest, hidden %.3g\n", worst, worst_h);
    ASSERT_TRUE(worst < 1e-4);
    ASSERT_TRUE(worst_h < 1e-3);
    /* sequence 0 untouched by sequence 1's positions; out-of-range refused */
    ASSERT_EQ(kv_mtp_step(t, 2, h, 5, 0, ho, lg, &d), KV_ERANGE);
    ASSERT_EQ(kv_mtp_step(t, 0, h, (int32_t)V, 0, ho, lg, &d), KV_ERANGE);
    ASSERT_EQ(kv_mtp_step(t, 0, h, 5, KV_MTP_MAX_POS, ho, lg, &d), KV_ERANGE);
    /* a model without an MTP block is refused */
    kv_mtp *t2 = NULL;
    ASSERT_EQ(kv_mtp_new(&t2, g_fx[0].m, NULL, pool, 1, &d), KV_EUNSUPPORTED);
    free(lg);
    kv_mtp_free(t);
    kv_pool_free(pool);
}

/* A provider that counts its calls and hands them to another (the
 * engine's slab or remote provider stands where this one does). */
typedef struct {
    kv_expert_provider inner;
    uint32_t calls, bad; /* calls; calls not of one token of layer n_layer */
    uint32_t layer;
} counting_prov;

static int counting_compute(void *impl, const kv_expert_req *req, float *out, kv_diag *d) {
    counting_prov *c = impl;
    c->calls++;
    c->bad += req->layer != c->layer || req->n_tokens != 1;
    return c->inner.compute(c->inner.impl, req, out, d);
}

/* kv_mtp_new with a caller's provider: the block's experts (layer n_layer,
 * one token per step) are asked of it, and every output is the in-process
 * block's bit for bit; a backbone (no experts of its own) without a
 * provider is refused. */
static void test_mtp_provider(void) {
    const kv_model *m = g_fx[1].m;
    const kv_hparams *hp = &m->hp;
    const uint32_t E = hp->n_embd, V = hp->n_vocab;
    kv_diag d = {0};
    kv_pool *pool = NULL;
    ASSERT_EQ(kv_pool_new(&pool, 2, &d), 0);
    kv_expert_source src = kv_model_expert_source(m);
    src.n_layer = hp->n_layer + hp->n_layer_nextn;
    counting_prov cp = {.layer = hp->n_layer};
    ASSERT_EQ(kv_expert_local_new_src(&cp.inner, &src, pool, 1, &d), 0);
    const kv_expert_provider prov = {&cp, counting_compute, NULL, "counting"};
    kv_mtp *a = NULL, *b = NULL;
    ASSERT_EQ(kv_mtp_new(&a, m, NULL, pool, 1, &d), 0);
    ASSERT_EQ(kv_mtp_new(&b, m, &prov, pool, 1, &d), 0);
    float h[512], ha[512], hb[512];
    float *la = malloc(V * sizeof *la), *lb = malloc(V * sizeof *lb);
    ASSERT_TRUE(E <= 512 && la && lb);
    for (uint32_t i = 0; i < E; i++) h[i] = (float)((int)rnd(2001) - 1000) / 700.0f;
    for (uint32_t pos = 0; pos < 6; pos++) {
        const int32_t tok = (int32_t)(3 + rnd(V - 3));
        ASSERT_EQ(kv_mtp_step(a, 0, h, tok, pos, ha, la, &d), 0);
        ASSERT_EQ(kv_mtp_step(b, 0, h, tok, pos, hb, lb, &d), 0);
        ASSERT_TRUE(!memcmp(ha, hb, E * sizeof *ha));
        ASSERT_TRUE(!memcmp(la, lb, V * sizeof *la));
        memcpy(h, ha, E * sizeof *h);
    }
    ASSERT_EQ(cp.calls, 6);
    ASSERT_EQ(cp.bad, 0);
    kv_mtp_free(a);
    kv_mtp_free(b); /* the borrowed provider is not freed with it */
    ASSERT_TRUE(cp.inner.compute != NULL);
    cp.inner.free(cp.inner.impl);
    free(la);
    free(lb);
    /* a model loaded without its experts (a backbone) needs a provider */
    kv_model *bb = NULL;
    ASSERT_EQ(kv_model_load_ex(&bb, g_fx[1].model, &(kv_model_opts){.no_experts = true}, &d), 0);
    kv_mtp *c = NULL;
    ASSERT_EQ(kv_mtp_new(&c, bb, NULL, pool, 1, &d), KV_EUNSUPPORTED);
    ASSERT_TRUE(strstr(d.msg, "no provider") != NULL);
    kv_model_free(bb);
    kv_pool_free(pool);
}

/* The mtp source in the engine: exact like every source; the drafts come
 * (acceptance on synthetic weights is what it is: reported, not asserted). */
static void test_engine_mtp(void) {
    fixture *f = &g_fx[1];
    for (int mode = 0; mode < 2; mode++) {
        res a[NS] = {0}, b[NS] = {0};
        kv_engine_stats ea, eb;
        run_engine(f, NULL, mode, a, &ea);
        run_engine(f, "mtp", mode, b, &eb);
        check_same(f, a, b, mode, "mtp");
        for (int i = 0; i < NS; i++) free(a[i].logits);
        ASSERT_TRUE(eb.spec_drafted > 0);
        fprintf(stderr, "  mode %d: mtp accepted %llu of %llu drafted\n", mode, (unsigned long long)eb.spec_accepted,
                (unsigned long long)eb.spec_drafted);
    }
}

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

static int setup(void) { return fixtures_open("/tmp/kvasir-spec.XXXXXX", 31, 32, 1); }

static void teardown(void) { fixtures_close(); }

static const kvt_case cases[] = {
    KVT_CASE(test_ngram),           KVT_CASE(test_rollback_qwen3moe), KVT_CASE(test_rollback_qwen35moe),
    KVT_CASE(test_engine_qwen3moe), KVT_CASE(test_engine_qwen35moe),  KVT_CASE(test_mtp_f64),
    KVT_CASE(test_mtp_provider),    KVT_CASE(test_engine_mtp),        KVT_CASE(test_opts),
};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
