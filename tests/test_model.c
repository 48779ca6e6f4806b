/* The qwen3moe forward pass:
 *  - against an independent f64 re-implementation (naive loops, doubles
 *    throughout) on an F32 model: max |logit difference| bounded;
 *  - logits bit-identical for 1, 2 and 4 threads (F32, Q8_0, Q4_K models);
 *  - bit-identical whether the prompt runs as one batch, in chunks, or token
 *    by token (results do not depend on batch composition);
 *  - bit-identical when experts come through a different provider (one that
 *    forwards every token separately, in reverse order);
 *  - bit-identical whether the last block runs every token or only those
 *    whose logits are wanted (any order, repeated), and the cache it leaves
 *    decodes the same (check_dropped);
 *  - the context limit is enforced without changing the state.
 * Models are written by `kvasir gen-model` ($KV_BIN) into a temp dir. */
#include <stdbool.h>
#include <stdint.h>
#include <unistd.h>

#include "kvasir/model.h"
#include "kvasir/quant.h"
#include "kvtest.h"
#include "ref64.h"
#include "ref_gguf.h"

static char g_dir[256];

static int gen(const char *name, const char *args, char *path, size_t cap) {
    const char *bin = getenv("KV_BIN");
    if (!bin) { fprintf(stderr, "KV_BIN is not set\n"); return -1; }
    snprintf(path, cap, "%s/%s.gguf", g_dir, name);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s gen-model --arch qwen3moe --out %s %s >/dev/null 2>&1", bin, path, args);
    return system(cmd);
}

/* ---- f64 reference forward ------------------------------------------- */
/* Reads the file itself (tests/ref_gguf.h): tensors by name, dims from the
 * metadata keys, nothing from the loader. */

/* Runs tokens[0..n) through the F32 qwen3moe file at rm and returns the
 * logits of the last one. */
static void ref_forward(const ref_model *rm, const int32_t *tokens, int n, double *logits) {
    const int E = (int)ref_u32(rm, "embedding_length"), H = (int)ref_u32(rm, "attention.head_count");
    const int HKV = (int)ref_u32(rm, "attention.head_count_kv"), HD = (int)ref_u32(rm, "attention.key_length");
    const int QD = H * HD, KVD = HKV * HD, NE = (int)ref_u32(rm, "expert_count");
    const int K = (int)ref_u32(rm, "expert_used_count"), FF = (int)ref_u32(rm, "expert_feed_forward_length");
    const int V = ref_n_vocab(rm), L = (int)ref_u32(rm, "block_count");
    const double eps = ref_f32_key(rm, "attention.layer_norm_rms_epsilon");
    const double base = ref_f32_key(rm, "rope.freq_base");
    if (E <= 0 || H <= 0 || HKV <= 0 || HD <= 0 || V <= 0 || L <= 0 || K > 64 || K > NE) {
        KVT_FAIL("reference: implausible dims");
        return;
    }
    double *x = calloc((size_t)n * E, sizeof *x), *xb = calloc(E, sizeof *xb);
    double *kc = calloc((size_t)L * n * KVD, sizeof *kc), *vc = calloc((size_t)L * n * KVD, sizeof *vc);
    double *q = calloc(QD, sizeof *q), *att = calloc(QD, sizeof *att), *tmp = calloc(E > V ? E : V, sizeof *tmp);
    double *sc = calloc(n, sizeof *sc), *pr = calloc(NE, sizeof *pr), *g = calloc(FF, sizeof *g);
    double *u = calloc(FF, sizeof *u), *acc = calloc(E, sizeof *acc);
    const float *te = ref_f32(rm, (int64_t)V * E, "token_embd.weight");
    const float *to = ref_has(rm, "output.weight") ? ref_f32(rm, (int64_t)V * E, "output.weight") : te;
    const float *tn = ref_f32(rm, E, "output_norm.weight");
    for (int t = 0; t < n; t++)
        for (int i = 0; i < E; i++) x[(size_t)t * E + i] = te[(size_t)tokens[t] * E + i];
    for (int l = 0; l < L; l++) {
        const float *attn_norm = ref_f32(rm, E, "blk.%d.attn_norm.weight", l);
        const float *wq = ref_f32(rm, (int64_t)QD * E, "blk.%d.attn_q.weight", l);
        const float *wk = ref_f32(rm, (int64_t)KVD * E, "blk.%d.attn_k.weight", l);
        const float *wv = ref_f32(rm, (int64_t)KVD * E, "blk.%d.attn_v.weight", l);
        const float *wo = ref_f32(rm, (int64_t)E * QD, "blk.%d.attn_output.weight", l);
        const float *q_norm = ref_f32(rm, HD, "blk.%d.attn_q_norm.weight", l);
        const float *k_norm = ref_f32(rm, HD, "blk.%d.attn_k_norm.weight", l);
        const float *ffn_norm = ref_f32(rm, E, "blk.%d.ffn_norm.weight", l);
        const float *router = ref_f32(rm, (int64_t)NE * E, "blk.%d.ffn_gate_inp.weight", l);
        const float *gate_exps = ref_f32(rm, (int64_t)NE * FF * E, "blk.%d.ffn_gate_exps.weight", l);
        const float *up_exps = ref_f32(rm, (int64_t)NE * FF * E, "blk.%d.ffn_up_exps.weight", l);
        const float *down_exps = ref_f32(rm, (int64_t)NE * E * FF, "blk.%d.ffn_down_exps.weight", l);
        for (int t = 0; t < n; t++) { /* causal: token t sees 0..t; process in order */
            double *xt = x + (size_t)t * E;
            ref_rms(xb, xt, attn_norm, E, eps);
            ref_matvec(q, wq, xb, QD, E);
            double *kt = kc + ((size_t)l * n + t) * KVD, *vt = vc + ((size_t)l * n + t) * KVD;
            ref_matvec(kt, wk, xb, KVD, E);
            ref_matvec(vt, wv, xb, KVD, E);
            for (int h = 0; h < H + HKV; h++) {
                double *v = h < H ? q + h * HD : kt + (h - H) * HD;
                ref_rms(v, v, h < H ? q_norm : k_norm, HD, eps);
                for (int i = 0; i < HD / 2; i++) {
                    double th = t * pow(base, -2.0 * i / HD);
                    double a = v[i], b = v[i + HD / 2];
                    v[i] = a * cos(th) - b * sin(th);
                    v[i + HD / 2] = a * sin(th) + b * cos(th);
                }
            }
            for (int h = 0; h < H; h++) {
                int kh = h / (H / HKV);
                double mx = -1e300, sum = 0;
                for (int p = 0; p <= t; p++) {
                    double s = 0;
                    for (int i = 0; i < HD; i++) s += q[h * HD + i] * kc[((size_t)l * n + p) * KVD + kh * HD + i];
                    sc[p] = s / sqrt((double)HD);
                    if (sc[p] > mx) mx = sc[p];
                }
                for (int p = 0; p <= t; p++) sum += (sc[p] = exp(sc[p] - mx));
                for (int i = 0; i < HD; i++) {
                    double o = 0;
                    for (int p = 0; p <= t; p++) o += sc[p] / sum * vc[((size_t)l * n + p) * KVD + kh * HD + i];
                    att[h * HD + i] = o;
                }
            }
            ref_matvec(tmp, wo, att, E, QD);
            for (int i = 0; i < E; i++) xt[i] += tmp[i];
            ref_rms(xb, xt, ffn_norm, E, eps);
            ref_matvec(pr, router, xb, NE, E);
            double mx = -1e300, sum = 0;
            for (int e = 0; e < NE; e++) if (pr[e] > mx) mx = pr[e];
            for (int e = 0; e < NE; e++) sum += (pr[e] = exp(pr[e] - mx));
            for (int e = 0; e < NE; e++) pr[e] /= sum;
            int sel[64];
            double wsum = 0;
            for (int r = 0; r < K; r++) {
                int b = -1;
                for (int e = 0; e < NE; e++) {
                    bool taken = false;
                    for (int z = 0; z < r; z++) taken |= sel[z] == e;
                    if (!taken && (b < 0 || pr[e] > pr[b])) b = e;
                }
                sel[r] = b;
                wsum += pr[b];
            }
            for (int i = 0; i < E; i++) acc[i] = 0;
            for (int r = 0; r < K; r++) {
                const int e = sel[r];
                ref_matvec(g, gate_exps + (size_t)e * FF * E, xb, FF, E);
                ref_matvec(u, up_exps + (size_t)e * FF * E, xb, FF, E);
                for (int i = 0; i < FF; i++) g[i] = g[i] / (1 + exp(-g[i])) * u[i];
                ref_matvec(tmp, down_exps + (size_t)e * E * FF, g, E, FF);
                for (int i = 0; i < E; i++) acc[i] += pr[e] / wsum * tmp[i];
            }
            for (int i = 0; i < E; i++) xt[i] += acc[i];
        }
    }
    ref_rms(xb, x + (size_t)(n - 1) * E, tn, E, eps);
    ref_matvec(logits, to, xb, V, E);
    free(x); free(xb); free(kc); free(vc); free(q); free(att); free(tmp); free(sc); free(pr);
    free(g); free(u); free(acc);
}

/* ---- helpers ------------------------------------------------------------ */

/* Evaluates prompt in chunks of n_batch on a pool of nth threads, then
 * decodes n_dec greedy tokens; returns all logits concatenated (caller frees). */
static float *run(const kv_model *m, int nth, uint32_t n_batch, const int32_t *prompt, int n,
                  int n_dec, const kv_expert_provider *prov) {
    const uint32_t V = kv_model_hparams(m)->n_vocab;
    kv_diag d = {0};
    kv_pool *pool = NULL;
    kv_state *s = NULL;
    float *out = calloc((size_t)(n_dec + 1) * V, sizeof *out);
    if (kv_pool_new(&pool, nth, &d)) { KVT_FAIL("pool: %s", d.msg); return out; }
    kv_state_opts o = {.n_ctx = 64, .n_batch = n_batch, .experts = prov};
    if (kv_state_new(&s, m, pool, &o, &d)) { KVT_FAIL("state: %s", d.msg); kv_pool_free(pool); return out; }
    if (n_batch == 1) {
        for (int i = 0; i < n; i++)
            if (kv_state_eval(s, prompt + i, 1, i == n - 1 ? out : NULL, &d)) KVT_FAIL("eval: %s", d.msg);
    } else if (kv_state_eval(s, prompt, (uint32_t)n, out, &d)) {
        KVT_FAIL("eval: %s", d.msg);
    }
    for (int k = 0; k < n_dec; k++) {
        const float *l = out + (size_t)k * V;
        int32_t best = 0;
        for (uint32_t i = 1; i < V; i++) if (l[i] > l[best]) best = (int32_t)i;
        if (kv_state_eval(s, &best, 1, out + (size_t)(k + 1) * V, &d)) KVT_FAIL("decode: %s", d.msg);
    }
    kv_state_free(s);
    kv_pool_free(pool);
    return out;
}

/* A provider that forwards each token separately, last token first. */
typedef struct { kv_expert_provider inner; } per_token;
static int per_token_compute(void *impl, const kv_expert_req *r, float *out, kv_diag *d) {
    per_token *p = impl;
    for (int t = (int)r->n_tokens - 1; t >= 0; t--) {
        kv_expert_req one = *r;
        one.n_tokens = 1;
        one.x = r->x + (size_t)t * r->n_embd;
        one.ids = r->ids + (size_t)t * r->n_used;
        one.tok = r->tok ? r->tok + t : NULL;
        int rc = p->inner.compute(p->inner.impl, &one, out + (size_t)t * r->n_used * r->n_embd, d);
        if (rc) return rc;
    }
    return 0;
}

/* The prompt in one call, once with every token's logits (no row dropped)
 * in sequence 0, once with the logits of tokens n-1, 2, 2 (the others leave
 * the last block after its K/V) in sequence 1: the wanted rows are the
 * same bits, the last one those of base (the lone run), and a decode step
 * on both caches gives the same logits. */
static void check_dropped(const kv_model *m, const int32_t *p, uint32_t np, const float *base) {
    const uint32_t V = kv_model_hparams(m)->n_vocab;
    kv_diag d = {0};
    kv_pool *pool = NULL;
    kv_state *s = NULL;
    kv_pool_new(&pool, 2, &d);
    kv_state_opts o = {.n_ctx = 64, .n_batch = 16, .n_seq = 2};
    if (np > 16 || np < 3 || kv_state_new(&s, m, pool, &o, &d)) {
        KVT_FAIL("dropped rows: state: %s", d.msg);
        kv_pool_free(pool);
        return;
    }
    uint32_t all[16], seq0[16], seq1[16];
    for (uint32_t i = 0; i < np; i++) all[i] = i, seq0[i] = 0, seq1[i] = 1;
    float *full = calloc((size_t)np * V, sizeof *full), *part = calloc((size_t)3 * V, sizeof *part);
    float *step = calloc((size_t)2 * V, sizeof *step);
    ASSERT_EQ(kv_state_batch(s, p, seq0, np, all, np, full, &d), 0);
    ASSERT_TRUE(!kv_state_dropped_rows(s));
    const uint32_t some[3] = {np - 1, 2, 2};
    ASSERT_EQ(kv_state_batch(s, p, seq1, np, some, 3, part, &d), 0);
    ASSERT_TRUE(kv_state_dropped_rows(s));
    ASSERT_TRUE(memcmp(full + (size_t)(np - 1) * V, base, V * sizeof(float)) == 0);
    ASSERT_TRUE(memcmp(part, base, V * sizeof(float)) == 0);
    ASSERT_TRUE(memcmp(part + V, full + (size_t)2 * V, V * sizeof(float)) == 0);
    ASSERT_TRUE(memcmp(part + 2 * V, full + (size_t)2 * V, V * sizeof(float)) == 0);
    const int32_t tok[2] = {42, 42};
    const uint32_t seqs[2] = {0, 1};
    ASSERT_EQ(kv_state_decode(s, tok, seqs, 2, step, &d), 0);
    ASSERT_TRUE(!kv_state_dropped_rows(s));
    ASSERT_TRUE(memcmp(step, step + V, V * sizeof(float)) == 0);
    /* no logits at all: only the K/V of the last block; then the same decode */
    kv_state_reset_seq(s, 1);
    ASSERT_EQ(kv_state_batch(s, p, seq1, np, NULL, 0, NULL, &d), 0);
    ASSERT_TRUE(kv_state_dropped_rows(s));
    const int32_t t1 = 42;
    const uint32_t s1 = 1;
    ASSERT_EQ(kv_state_decode(s, &t1, &s1, 1, part, &d), 0);
    ASSERT_TRUE(memcmp(part, step + V, V * sizeof(float)) == 0);
    free(full);
    free(part);
    free(step);
    kv_state_free(s);
    kv_pool_free(pool);
}

static const struct { const char *name, *args; } models[] = {
    {"f32", "--layers 2 --embd 128 --ff-exp 64 --experts 8 --experts-used 3 --heads 4 --kv-heads 2 "
            "--head-dim 32 --vocab 1024 --ctx 256 --type f32 --seed 11"},
    {"q8_0", "--layers 2 --embd 128 --ff-exp 96 --experts 6 --experts-used 2 --heads 4 --kv-heads 1 "
             "--head-dim 32 --vocab 1024 --ctx 256 --type q8_0 --seed 12 --tied"},
    {"q4_k", "--layers 2 --embd 256 --ff-exp 256 --experts 4 --experts-used 2 --heads 4 --kv-heads 2 "
             "--head-dim 64 --vocab 1024 --ctx 256 --type q4_k --seed 13"},
};
static const int32_t prompt[] = {5, 77, 300, 12, 999, 4, 250, 640, 33};
enum { n = (int)(sizeof prompt / sizeof prompt[0]) };

/* Every check on one generated model (models[mi]). */
static void check_model(size_t mi) {
    char path[512];
    if (gen(models[mi].name, models[mi].args, path, sizeof path)) { KVT_FAIL("gen-model %s failed", models[mi].name); return; }
    kv_model *m = NULL;
    kv_diag d = {0};
    if (kv_model_load(&m, path, &d)) { KVT_FAIL("load %s: %s", models[mi].name, d.msg); return; }
    const uint32_t V = kv_model_hparams(m)->n_vocab;
    const size_t bytes = (size_t)4 * V * sizeof(float);
    float *base = run(m, 1, 16, prompt, n, 3, NULL);
    for (int nth = 2; nth <= 4; nth *= 2) {
        float *o = run(m, nth, 16, prompt, n, 3, NULL);
        ASSERT_TRUE(memcmp(base, o, bytes) == 0);
        free(o);
    }
    float *chunk = run(m, 2, 4, prompt, n, 3, NULL);
    ASSERT_TRUE(memcmp(base, chunk, bytes) == 0);
    float *single = run(m, 2, 1, prompt, n, 3, NULL);
    ASSERT_TRUE(memcmp(base, single, bytes) == 0);
    free(chunk);
    free(single);
    check_dropped(m, prompt, n, base);
    /* a different provider: same bits */
    kv_pool *pool = NULL;
    kv_pool_new(&pool, 2, &d);
    per_token pt;
    ASSERT_EQ(kv_expert_local_new(&pt.inner, m, pool, 16, &d), 0);
    kv_expert_provider prov = {&pt, per_token_compute, NULL, "per-token"};
    float *viap = run(m, 2, 16, prompt, n, 3, &prov);
    ASSERT_TRUE(memcmp(base, viap, bytes) == 0);
    free(viap);
    pt.inner.free(pt.inner.impl);
    kv_pool_free(pool);
    /* three sequences decoding in shared steps: each bit-identical to
     * running alone (base holds the lone run of `prompt`) */
    {
        kv_pool *p2 = NULL;
        kv_state *s = NULL;
        kv_pool_new(&p2, 2, &d);
        kv_state_opts o = {.n_ctx = 64, .n_batch = 16, .n_seq = 3};
        ASSERT_EQ(kv_state_new(&s, m, p2, &o, &d), 0);
        float *lg = calloc((size_t)3 * V, sizeof *lg);
        /* seq 1 gets the prompt; seqs 0 and 2 other prompts of other lengths */
        ASSERT_EQ(kv_state_eval_seq(s, 0, prompt + 2, (uint32_t)n - 2, lg, &d), 0);
        ASSERT_EQ(kv_state_eval_seq(s, 1, prompt, (uint32_t)n, lg + V, &d), 0);
        ASSERT_EQ(kv_state_eval_seq(s, 2, prompt + 5, (uint32_t)n - 5, lg + 2 * V, &d), 0);
        ASSERT_TRUE(memcmp(lg + V, base, V * sizeof(float)) == 0);
        for (int k = 0; k < 3; k++) {
            int32_t toks[3];
            uint32_t seqs[3] = {2, 0, 1}; /* arrival order must not matter */
            for (int q = 0; q < 3; q++) {
                const float *l = lg + (size_t)seqs[q] * V;
                int32_t best = 0;
                for (uint32_t i = 1; i < V; i++) if (l[i] > l[best]) best = (int32_t)i;
                toks[q] = best;
            }
            float *step = calloc((size_t)3 * V, sizeof *step);
            ASSERT_EQ(kv_state_decode(s, toks, seqs, 3, step, &d), 0);
            for (int q = 0; q < 3; q++) memcpy(lg + (size_t)seqs[q] * V, step + (size_t)q * V, V * sizeof(float));
            free(step);
            ASSERT_TRUE(memcmp(lg + V, base + (size_t)(k + 1) * V, V * sizeof(float)) == 0);
        }
        ASSERT_EQ(kv_state_pos_seq(s, 1), (uint32_t)n + 3);
        uint32_t dup[2] = {1, 1};
        int32_t tt[2] = {1, 2};
        ASSERT_EQ(kv_state_decode(s, tt, dup, 2, NULL, &d), KV_EINVAL);
        free(lg);
        kv_state_free(s);
        kv_pool_free(p2);
    }
    /* logits are finite and not constant */
    bool finite = true;
    float lo = base[0], hi = base[0];
    for (size_t i = 0; i < (size_t)4 * V; i++) {
        finite &= isfinite(base[i]);
        lo = base[i] < lo ? base[i] : lo;
        hi = base[i] > hi ? base[i] : hi;
    }
    ASSERT_TRUE(finite);
    ASSERT_TRUE(hi - lo > 0.5f);
    /* F32 model against the f64 reference */
    if (!strcmp(models[mi].name, "f32")) {
        double *ref = malloc(V * sizeof *ref);
        ref_model rm;
        if (ref_open(&rm, path) == 0) ref_forward(&rm, prompt, n, ref);
        ref_close(&rm);
        double maxd = 0, maxabs = 0;
        for (uint32_t i = 0; i < V; i++) {
            double df = fabs(ref[i] - base[i]);
            maxd = df > maxd ? df : maxd;
            maxabs = fabs(ref[i]) > maxabs ? fabs(ref[i]) : maxabs;
        }
        printf("f32 model vs f64 reference: max |dlogit| = %.3g (max |logit| %.3g)\n", maxd, maxabs);
        ASSERT_TRUE(maxd < 1e-3);
        free(ref);
    }
    /* context limit: nothing evaluated, position unchanged */
    {
        kv_pool *p1 = NULL;
        kv_state *s = NULL;
        kv_pool_new(&p1, 1, &d);
        kv_state_opts o = {.n_ctx = 8, .n_batch = 8};
        ASSERT_EQ(kv_state_new(&s, m, p1, &o, &d), 0);
        ASSERT_EQ(kv_state_eval(s, prompt, 5, NULL, &d), 0);
        ASSERT_EQ(kv_state_eval(s, prompt, 4, NULL, &d), KV_ECTXFULL);
        ASSERT_EQ(kv_state_pos(s), 5);
        int32_t badtok = (int32_t)V;
        ASSERT_EQ(kv_state_eval(s, &badtok, 1, NULL, &d), KV_ERANGE);
        ASSERT_EQ(kv_state_pos(s), 5);
        kv_state_free(s);
        kv_pool_free(p1);
    }
    free(base);
    kv_model_free(m);
}

static void test_f32(void) { check_model(0); }
static void test_q8_0(void) { check_model(1); }
static void test_q4_k(void) { check_model(2); }

static int setup(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/kvasir-test-model-XXXXXX");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 1; }
    return 0;
}
static void teardown(void) {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (system(cmd)) fprintf(stderr, "could not remove %s\n", g_dir);
}

static const kvt_case cases[] = {KVT_CASE(test_f32), KVT_CASE(test_q8_0), KVT_CASE(test_q4_k)};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
