/* gpt-oss forward pass (src/model/gptoss.c, the sinks and window in
 * forward.c's attention, the clamped SwiGLU and expert biases in
 * src/moe/local.c): an independent f64 reference of the whole model written
 * from OpenAI's own formulation of gpt-oss (attention over [scores, sink]
 * with the sink's column dropped after the softmax; keys older than the
 * window masked in the sliding blocks; half-split rotary; the router's top-k
 * of biased logits and a softmax over those k; experts with biases and the
 * clamped SwiGLU x * sigmoid(1.702 x) * (y + 1), x clamped above at 7 and y
 * to [-7, 7]) on a generated F32 model whose window is shorter than the
 * prompt; bit-identity of our f32 logits across threads, chunked prefill
 * and several sequences decoded together, and with only the wanted rows in
 * the last block and through an expert provider other than the model's own. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvasir/gen.h"
#include "kvasir/model.h"
#include "kvasir/ops.h"
#include "kvtest.h"
#include "ref64.h"
#include "ref_gguf.h"

/* rotary over the whole head, first half against second half */
static void ref_rope(double *x, int hd, int pos, double base) {
    const int half = hd / 2;
    for (int i = 0; i < half; i++) {
        const double th = pos * pow(base, -2.0 * i / hd), c = cos(th), s = sin(th);
        const double a = x[i], b = x[i + half];
        x[i] = a * c - b * s;
        x[i + half] = a * s + b * c;
    }
}
static double clampd(double v, double lo, double hi) { return v < lo ? lo : v > hi ? hi : v; }

/* Logits of the last token of toks[0..n) by a plain f64 forward over the
 * F32 file at rm (tests/ref_gguf.h: tensors by name, dims from metadata). */
static void ref_forward(const ref_model *rm, const int32_t *toks, int n, double *logits) {
    const int E = (int)ref_u32(rm, "embedding_length"), H = (int)ref_u32(rm, "attention.head_count");
    const int HKV = (int)ref_u32(rm, "attention.head_count_kv"), HD = (int)ref_u32(rm, "attention.key_length");
    const int NL = (int)ref_u32(rm, "block_count"), NE = (int)ref_u32(rm, "expert_count");
    const int K = (int)ref_u32(rm, "expert_used_count"), F = (int)ref_u32(rm, "expert_feed_forward_length");
    const int W = (int)ref_u32(rm, "attention.sliding_window");
    const int P = (int)ref_u32_or(rm, "attention.sliding_window_pattern", 2);
    const double eps = ref_f32_key(rm, "attention.layer_norm_rms_epsilon"), base = ref_f32_key(rm, "rope.freq_base");
    const int V = ref_n_vocab(rm), QD = H * HD, KVD = HKV * HD;
    double *x = calloc((size_t)n * E, sizeof *x), *xb = calloc(E, sizeof *xb), *q = calloc(QD, sizeof *q);
    double *kc = calloc((size_t)n * KVD, sizeof *kc), *vc = calloc((size_t)n * KVD, sizeof *vc);
    double *att = calloc(QD, sizeof *att), *o = calloc(E, sizeof *o), *sc = calloc(n + 1, sizeof *sc);
    double *lg = calloc(NE, sizeof *lg), *g = calloc(F, sizeof *g), *u = calloc(F, sizeof *u), *y = calloc(E, sizeof *y);
    const float *emb = ref_f32(rm, (int64_t)V * E, "token_embd.weight");
    for (int t = 0; t < n; t++)
        for (int i = 0; i < E; i++) x[(size_t)t * E + i] = emb[(size_t)toks[t] * E + i];
    for (int l = 0; l < NL; l++) {
        const bool sliding = l % P < P - 1;
        const float *an = ref_f32(rm, E, "blk.%d.attn_norm.weight", l), *pn = ref_f32(rm, E, "blk.%d.post_attention_norm.weight", l);
        const float *wq = ref_f32(rm, (int64_t)QD * E, "blk.%d.attn_q.weight", l), *bq = ref_f32(rm, QD, "blk.%d.attn_q.bias", l);
        const float *wk = ref_f32(rm, (int64_t)KVD * E, "blk.%d.attn_k.weight", l), *bk = ref_f32(rm, KVD, "blk.%d.attn_k.bias", l);
        const float *wv = ref_f32(rm, (int64_t)KVD * E, "blk.%d.attn_v.weight", l), *bv = ref_f32(rm, KVD, "blk.%d.attn_v.bias", l);
        const float *wo = ref_f32(rm, (int64_t)E * QD, "blk.%d.attn_output.weight", l), *bo = ref_f32(rm, E, "blk.%d.attn_output.bias", l);
        const float *sinks = ref_f32(rm, H, "blk.%d.attn_sinks.weight", l);
        const float *wr = ref_f32(rm, (int64_t)NE * E, "blk.%d.ffn_gate_inp.weight", l), *br = ref_f32(rm, NE, "blk.%d.ffn_gate_inp.bias", l);
        const float *wg = ref_f32(rm, (int64_t)NE * F * E, "blk.%d.ffn_gate_exps.weight", l);
        const float *wu = ref_f32(rm, (int64_t)NE * F * E, "blk.%d.ffn_up_exps.weight", l);
        const float *wd = ref_f32(rm, (int64_t)NE * E * F, "blk.%d.ffn_down_exps.weight", l);
        const float *bg = ref_f32(rm, (int64_t)NE * F, "blk.%d.ffn_gate_exps.bias", l);
        const float *bu = ref_f32(rm, (int64_t)NE * F, "blk.%d.ffn_up_exps.bias", l);
        const float *bd = ref_f32(rm, (int64_t)NE * E, "blk.%d.ffn_down_exps.bias", l);
        /* every token's K and V first (causal: token t reads 0..t) */
        for (int t = 0; t < n; t++) {
            ref_rms(xb, x + (size_t)t * E, an, E, eps);
            double *kt = kc + (size_t)t * KVD, *vt = vc + (size_t)t * KVD;
            ref_matvec(kt, wk, xb, KVD, E);
            ref_matvec(vt, wv, xb, KVD, E);
            for (int i = 0; i < KVD; i++) kt[i] += bk[i], vt[i] += bv[i];
            for (int h = 0; h < HKV; h++) ref_rope(kt + h * HD, HD, t, base);
        }
        for (int t = 0; t < n; t++) {
            double *xt = x + (size_t)t * E;
            ref_rms(xb, xt, an, E, eps);
            ref_matvec(q, wq, xb, QD, E);
            for (int i = 0; i < QD; i++) q[i] += bq[i];
            for (int h = 0; h < H; h++) ref_rope(q + h * HD, HD, t, base);
            const int lo = sliding && t - W + 1 > 0 ? t - W + 1 : 0;
            for (int h = 0; h < H; h++) {
                const int kh = h / (H / HKV);
                /* softmax over [scores of keys lo..t, sink]; the sink's share is dropped */
                double m = sinks[h];
                for (int p = lo; p <= t; p++) {
                    double s = 0;
                    for (int i = 0; i < HD; i++) s += q[h * HD + i] * kc[(size_t)p * KVD + kh * HD + i];
                    sc[p] = s / sqrt((double)HD);
                    if (sc[p] > m) m = sc[p];
                }
                double sum = exp(sinks[h] - m);
                for (int p = lo; p <= t; p++) sum += (sc[p] = exp(sc[p] - m));
                for (int i = 0; i < HD; i++) {
                    double a = 0;
                    for (int p = lo; p <= t; p++) a += sc[p] / sum * vc[(size_t)p * KVD + kh * HD + i];
                    att[h * HD + i] = a;
                }
            }
            ref_matvec(o, wo, att, E, QD);
            for (int i = 0; i < E; i++) xt[i] += o[i] + bo[i];
            /* MoE: top-k of the biased logits, softmax over the k */
            ref_rms(xb, xt, pn, E, eps);
            ref_matvec(lg, wr, xb, NE, E);
            for (int e = 0; e < NE; e++) lg[e] += br[e];
            int ids[64];
            double wts[64], mx = -INFINITY, ws = 0;
            for (int r = 0; r < K; r++) {
                int best = -1;
                for (int e = 0; e < NE; e++) {
                    bool used = false;
                    for (int j = 0; j < r; j++) used |= ids[j] == e;
                    if (!used && (best < 0 || lg[e] > lg[best])) best = e;
                }
                ids[r] = best;
                if (lg[best] > mx) mx = lg[best];
            }
            for (int r = 0; r < K; r++) ws += (wts[r] = exp(lg[ids[r]] - mx));
            for (int r = 0; r < K; r++) {
                const int e = ids[r];
                ref_matvec(g, wg + (size_t)e * F * E, xb, F, E);
                ref_matvec(u, wu + (size_t)e * F * E, xb, F, E);
                for (int i = 0; i < F; i++) {
                    const double xg = fmin(g[i] + bg[(size_t)e * F + i], 7.0);
                    const double yl = clampd(u[i] + bu[(size_t)e * F + i], -7.0, 7.0);
                    g[i] = xg / (1.0 + exp(-1.702 * xg)) * (yl + 1.0);
                }
                ref_matvec(y, wd + (size_t)e * E * F, g, E, F);
                for (int i = 0; i < E; i++) xt[i] += wts[r] / ws * (y[i] + bd[(size_t)e * E + i]);
            }
        }
    }
    ref_rms(xb, x + (size_t)(n - 1) * E, ref_f32(rm, E, "output_norm.weight"), E, eps);
    ref_matvec(logits, ref_f32(rm, (int64_t)V * E, "output.weight"), xb, V, E);
    free(x); free(xb); free(q); free(kc); free(vc); free(att); free(o); free(sc);
    free(lg); free(g); free(u); free(y);
}

static char g_dir[] = "/tmp/kvasir-test-gptoss-XXXXXX", g_path[128];
static kv_model *g_m;
enum { N = 13 };
static const int32_t toks[N] = {17, 300, 5, 599, 42, 42, 7, 123, 256, 3, 77, 500, 9};
static float *g_a; /* our logits after each token, token by token on 1 thread */
static int V;

static int setup(void) {
    if (!mkdtemp(g_dir)) return 1;
    snprintf(g_path, sizeof g_path, "%s/m.gguf", g_dir);
    /* window 4 < N: the sliding blocks (0 and 2) forget the prompt's start */
    kv_gen_config c = {.arch = "gpt-oss", .n_layer = 3, .n_embd = 128, .n_ff_exp = 64, .n_expert = 8,
                       .n_expert_used = 3, .n_head = 4, .n_head_kv = 2, .head_dim = 32, .n_vocab = 600,
                       .n_ctx = 256, .type = 0 /* KV_TYPE_F32 */, .seed = 7, .n_swa = 4, .n_threads = 1};
    if (ref_gen_load(&c, g_path, &g_m)) return 1;
    V = (int)kv_model_hparams(g_m)->n_vocab;
    g_a = ref_ours(g_m, toks, N, 1, 0, KV_TYPE_F32);
    return 0;
}

static void teardown(void) { ref_gen_close(g_a, g_m, g_path, g_dir); }

static void test_loaded(void) {
    const kv_hparams *hp = kv_model_hparams(g_m);
    ASSERT_EQ(hp->arch, KV_ARCH_GPTOSS);
    ASSERT_EQ(hp->n_swa, 4);
    ASSERT_EQ(hp->swa_pattern, 2);
    ASSERT_EQ(hp->router, KV_ROUTER_TOPK_SOFTMAX);
    ASSERT_EQ(hp->act, KV_ACT_SWIGLU_CLAMP);
    ASSERT_TRUE(!hp->expert_weights_norm);
    const kv_layer *L = kv_model_layer(g_m, 2);
    ASSERT_TRUE(L->sinks.data && L->bq.data && L->bk.data && L->bv.data && L->bo.data && L->gate_inp_b.data);
    ASSERT_TRUE(L->gate_exps_b.data && L->up_exps_b.data && L->down_exps_b.data);
}

/* f64 reference at several prefix lengths (inside and past the window) */
static void test_f64_reference(void) {
    double worst = ref_max_dlogit(g_path, ref_forward, toks, N, 3, g_a, V);
    printf("f32 gpt-oss vs f64 reference: max |dlogit| = %.3g\n", worst);
    ASSERT_TRUE(worst < 2e-4);
}

/* The activation itself: the clamp bites (gate above 7, up beyond +-7). */
static void test_swiglu_oai(void) {
    const float g[5] = {-3.0f, 0.5f, 6.5f, 9.0f, 30.0f}, u[5] = {-9.0f, 0.25f, 7.5f, -2.0f, 1.0f};
    float y[5];
    kv_swiglu_oai(y, g, u, 5);
    for (int i = 0; i < 5; i++) {
        const double x = fmin(g[i], 7.0), v = clampd(u[i], -7.0, 7.0);
        const double want = x / (1.0 + exp(-1.702 * x)) * (v + 1.0);
        ASSERT_TRUE(fabs(y[i] - want) <= 1e-6 * (1.0 + fabs(want)));
    }
    ASSERT_TRUE(y[3] == -0.5f * y[4]); /* gates 9 and 30 both act as 7 (ups -2 and 1) */
}

/* bit-identity: threads, token-by-token vs chunked prefill (chunks of 4) */
static void test_bit_identity(void) {
    float *b = ref_ours(g_m, toks, N, 2, 4, KV_TYPE_F32), *cc = ref_ours(g_m, toks, N, 3, 0, KV_TYPE_F32);
    ASSERT_TRUE(memcmp(g_a, cc, (size_t)N * V * sizeof *g_a) == 0);
    ASSERT_TRUE(memcmp(g_a, b, (size_t)N * V * sizeof *g_a) == 0);
    free(b);
    free(cc);
}

/* several sequences decoded together == each alone */
static void test_multi_seq(void) {
    kv_diag d = {0};
    kv_pool *pool = NULL;
    kv_state *s = NULL;
    kv_state_opts o = {.n_ctx = 64, .n_seq = 3};
    ASSERT_EQ(kv_pool_new(&pool, 2, &d), 0);
    ASSERT_EQ(kv_state_new(&s, g_m, pool, &o, &d), 0);
    if (!s) {
        kv_pool_free(pool);
        return;
    }
    float *lg = calloc((size_t)3 * V, sizeof *lg);
    ASSERT_EQ(kv_state_eval_seq(s, 1, toks, 5, NULL, &d), 0); /* seq 1 ahead by 5: past the window */
    int ok = 1;
    for (int t = 0; t < 8; t++) {
        int32_t tk[3] = {toks[t], toks[t + 5], toks[t]};
        uint32_t sq[3] = {0, 1, 2};
        ASSERT_EQ(kv_state_decode(s, tk, sq, 3, lg, &d), 0);
        ok &= !memcmp(lg, g_a + (size_t)t * V, V * sizeof *lg);
        ok &= !memcmp(lg + V, g_a + (size_t)(t + 5) * V, V * sizeof *lg);
        ok &= !memcmp(lg + 2 * V, g_a + (size_t)t * V, V * sizeof *lg);
    }
    ASSERT_TRUE(ok);
    free(lg);
    kv_state_free(s);
    kv_pool_free(pool);
}

/* only the wanted rows through the last block: the same bits */
static void test_dropped_rows(void) {
    kv_diag d = {0};
    kv_pool *pool = NULL;
    kv_state *s = NULL;
    kv_state_opts o = {.n_ctx = 64, .n_seq = 2};
    ASSERT_EQ(kv_pool_new(&pool, 2, &d), 0);
    ASSERT_EQ(kv_state_new(&s, g_m, pool, &o, &d), 0);
    if (!s) {
        kv_pool_free(pool);
        return;
    }
    uint32_t all[N], sq0[N], sq1[N];
    for (uint32_t i = 0; i < N; i++) all[i] = i, sq0[i] = 0, sq1[i] = 1;
    float *full = calloc((size_t)N * V, sizeof *full), *part = calloc((size_t)V, sizeof *part);
    const uint32_t some[1] = {N - 1};
    ASSERT_EQ(kv_state_batch(s, toks, sq0, N, all, N, full, &d), 0);
    ASSERT_EQ(kv_state_batch(s, toks, sq1, N, some, 1, part, &d), 0);
    ASSERT_TRUE(kv_state_dropped_rows(s));
    ASSERT_TRUE(!memcmp(part, full + (size_t)(N - 1) * V, V * sizeof *part));
    ASSERT_TRUE(!memcmp(part, g_a + (size_t)(N - 1) * V, V * sizeof *part));
    free(full);
    free(part);
    kv_state_free(s);
    kv_pool_free(pool);
}

/* Another expert provider (as slabs, workers and ring nodes pass one): the
 * biases and activation travel with the weights, the same bits. */
static void test_other_provider(void) {
    kv_diag d = {0};
    kv_pool *pool = NULL;
    kv_state *s = NULL;
    kv_expert_provider p;
    ASSERT_EQ(kv_pool_new(&pool, 1, &d), 0);
    kv_expert_source src = kv_model_expert_source(g_m);
    ASSERT_EQ(kv_expert_local_new_src(&p, &src, pool, 64, &d), 0);
    kv_state_opts o = {.n_ctx = 64, .experts = &p};
    ASSERT_EQ(kv_state_new(&s, g_m, pool, &o, &d), 0);
    float *lg = calloc((size_t)V, sizeof *lg);
    if (s) {
        ASSERT_EQ(kv_state_eval(s, toks, N, lg, &d), 0);
        ASSERT_TRUE(!memcmp(lg, g_a + (size_t)(N - 1) * V, V * sizeof *lg));
    }
    free(lg);
    kv_state_free(s);
    p.free(p.impl);
    kv_pool_free(pool);
}

static const kvt_case cases[] = {KVT_CASE(test_loaded), KVT_CASE(test_f64_reference), KVT_CASE(test_swiglu_oai),
                                 KVT_CASE(test_bit_identity), KVT_CASE(test_multi_seq), KVT_CASE(test_dropped_rows),
                                 KVT_CASE(test_other_provider)};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
