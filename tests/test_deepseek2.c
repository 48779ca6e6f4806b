/* deepseek2 forward pass (src/model/deepseek2.c, src/moe/route.c): an
 * independent f64 reference of the whole model on a generated F32 file,
 * written from DeepSeek-V3's own formulation rather than llama.cpp's: MLA
 * *without* absorption (each head's keys and values decompressed from the
 * latent through attn_k_b / attn_v_b, then ordinary attention), YaRN as
 * DeepSeek's modeling code computes it (inv_freq blended between
 * interpolation and extrapolation by a linear ramp over the correction
 * range, softmax scale mscale^2 / sqrt(q_head_dim)), rope on interleaved
 * pairs, a leading dense block, sigmoid routing with the selection bias and
 * group-limited top-k, normalized and scaled weights, shared experts. Then
 * bit-identity of our f32 logits across thread counts, prefill chunking
 * and several sequences decoded together, and with the last block run only
 * for the rows whose logits are wanted; the F16 cache close to the F32
 * one; ring windows chained by hidden states; the cache holding only the
 * latent and the rope part; and metadata
 * kvasir cannot run as llama.cpp would (the joint attn_kv_b, another gating
 * function, bad groups, several KV heads, MTP blocks) refused at load. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvasir/gen.h"
#include "kvasir/model.h"
#include "kvasir/quant.h"
#include "kvtest.h"
#include "ref64.h"
#include "ref_gguf.h"


/* y = down(ref_silu(gate x) * up x) */
static void ref_ffn(double *y, const float *gate, const float *up, const float *down, const double *x, int F, int E) {
    double *g = calloc(F, sizeof *g), *u = calloc(F, sizeof *u);
    ref_matvec(g, gate, x, F, E);
    ref_matvec(u, up, x, F, E);
    for (int i = 0; i < F; i++) g[i] = ref_silu(g[i]) * u[i];
    ref_matvec(y, down, g, E, F);
    free(g);
    free(u);
}

/* argmax over v[0..n) skipping taken[] (lower index first on ties) */
static int ref_best(const double *v, int n, const int *taken) {
    int b = -1;
    for (int e = 0; e < n; e++)
        if (!taken[e] && (b < 0 || v[e] > v[b])) b = e;
    return b;
}

/* DeepSeek's YaRN inverse frequencies of the R/2 rope pairs, and the
 * softmax scale. */
static void ref_yarn(const ref_model *rm, int R, int KM, double *inv_freq, double *scale) {
    const double base = ref_f32_key(rm, "rope.freq_base");
    char key[96];
    snprintf(key, sizeof key, "%s.rope.scaling.factor", rm->arch);
    const bool yarn = kv_gguf_find_kv(rm->g, key) != NULL;
    const double factor = yarn ? ref_f32_key(rm, "rope.scaling.factor") : 1.0;
    *scale = 1.0 / sqrt((double)KM);
    for (int i = 0; i < R / 2; i++) inv_freq[i] = pow(base, -2.0 * i / R);
    if (!yarn) return;
    const double orig = ref_u32(rm, "rope.scaling.original_context_length");
    const double mscale_all = ref_f32_key(rm, "rope.scaling.yarn_log_multiplier") / 0.1;
    const double beta_fast = 32, beta_slow = 1;
    const double lo_d = floor(R * log(orig / (beta_fast * 2 * M_PI)) / (2 * log(base)));
    const double hi_d = ceil(R * log(orig / (beta_slow * 2 * M_PI)) / (2 * log(base)));
    double lo = lo_d > 0 ? lo_d : 0, hi = hi_d < R - 1 ? hi_d : R - 1;
    if (hi == lo) hi += 0.001;
    for (int i = 0; i < R / 2; i++) {
        double ramp = (i - lo) / (hi - lo);
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        const double extra = inv_freq[i], inter = inv_freq[i] / factor;
        inv_freq[i] = inter * ramp + extra * (1 - ramp);
    }
    const double m = 0.1 * mscale_all * log(factor) + 1.0;
    *scale *= m * m;
}

static void ref_rope(double *x, int R, const double *inv_freq, int pos) {
    for (int i = 0; i < R / 2; i++) {
        const double th = pos * inv_freq[i], a = x[2 * i], b = x[2 * i + 1];
        x[2 * i] = a * cos(th) - b * sin(th);
        x[2 * i + 1] = a * sin(th) + b * cos(th);
    }
}

/* Logits of the last token of toks[0..n). */
static void ref_forward(const ref_model *rm, const int32_t *toks, int n, double *logits) {
    const int E = (int)ref_u32(rm, "embedding_length"), H = (int)ref_u32(rm, "attention.head_count");
    const int V = ref_n_vocab(rm), L = (int)ref_u32(rm, "block_count");
    const int QL = (int)ref_u32(rm, "attention.q_lora_rank"), KL = (int)ref_u32(rm, "attention.kv_lora_rank");
    const int KM = (int)ref_u32(rm, "attention.key_length_mla"), VM = (int)ref_u32(rm, "attention.value_length_mla");
    const int R = (int)ref_u32(rm, "rope.dimension_count"), NOPE = KM - R;
    const int X = (int)ref_u32(rm, "expert_count"), K = (int)ref_u32(rm, "expert_used_count");
    const int FF = (int)ref_u32(rm, "expert_feed_forward_length"), FD = (int)ref_u32(rm, "feed_forward_length");
    const int S = FF * (int)ref_u32(rm, "expert_shared_count"), DL = (int)ref_u32(rm, "leading_dense_block_count");
    const int G = (int)ref_u32_or(rm, "expert_group_count", 0), GU = (int)ref_u32_or(rm, "expert_group_used_count", 0);
    const double eps = ref_f32_key(rm, "attention.layer_norm_rms_epsilon");
    const double wscale = ref_f32_key(rm, "expert_weights_scale");
    double inv_freq[512], scale;
    ref_yarn(rm, R, KM, inv_freq, &scale);
    const float *te = ref_f32(rm, (int64_t)V * E, "token_embd.weight");
    double *x = calloc((size_t)n * E, sizeof *x), *xb = calloc(E, sizeof *xb);
    double *qa = calloc(QL, sizeof *qa), *q = calloc((size_t)n * H * KM, sizeof *q);
    double *kva = calloc(KL + R, sizeof *kva), *lat = calloc((size_t)n * KL, sizeof *lat);
    double *kpe = calloc((size_t)n * R, sizeof *kpe);
    double *kh = calloc((size_t)n * H * KM, sizeof *kh), *vh = calloc((size_t)n * H * VM, sizeof *vh);
    double *sc = calloc(n, sizeof *sc), *att = calloc((size_t)H * VM, sizeof *att), *tmp = calloc(E, sizeof *tmp);
    double *pr = calloc(X, sizeof *pr), *sel = calloc(X, sizeof *sel), *acc = calloc(E, sizeof *acc);
    double *out = calloc((size_t)n * E, sizeof *out);
    for (int t = 0; t < n; t++)
        for (int i = 0; i < E; i++) x[(size_t)t * E + i] = te[(size_t)toks[t] * E + i];
    for (int il = 0; il < L; il++) {
        const float *attn_norm = ref_f32(rm, E, "blk.%d.attn_norm.weight", il);
        const float *wqa = ref_f32(rm, (int64_t)QL * E, "blk.%d.attn_q_a.weight", il);
        const float *qan = ref_f32(rm, QL, "blk.%d.attn_q_a_norm.weight", il);
        const float *wqb = ref_f32(rm, (int64_t)H * KM * QL, "blk.%d.attn_q_b.weight", il);
        const float *wkva = ref_f32(rm, (int64_t)(KL + R) * E, "blk.%d.attn_kv_a_mqa.weight", il);
        const float *kvan = ref_f32(rm, KL, "blk.%d.attn_kv_a_norm.weight", il);
        const float *wkb = ref_f32(rm, (int64_t)H * KL * NOPE, "blk.%d.attn_k_b.weight", il);
        const float *wvb = ref_f32(rm, (int64_t)H * VM * KL, "blk.%d.attn_v_b.weight", il);
        const float *wo = ref_f32(rm, (int64_t)E * H * VM, "blk.%d.attn_output.weight", il);
        for (int t = 0; t < n; t++) {
            ref_rms(xb, x + (size_t)t * E, attn_norm, E, eps);
            ref_matvec(qa, wqa, xb, QL, E);
            ref_rms(qa, qa, qan, QL, eps);
            ref_matvec(q + (size_t)t * H * KM, wqb, qa, H * KM, QL);
            for (int h = 0; h < H; h++) ref_rope(q + ((size_t)t * H + h) * KM + NOPE, R, inv_freq, t);
            ref_matvec(kva, wkva, xb, KL + R, E);
            ref_rms(lat + (size_t)t * KL, kva, kvan, KL, eps);
            memcpy(kpe + (size_t)t * R, kva + KL, R * sizeof *kva);
            ref_rope(kpe + (size_t)t * R, R, inv_freq, t);
            /* decompressed keys [k_nope | k_pe] and values per head */
            for (int h = 0; h < H; h++) {
                double *k = kh + ((size_t)t * H + h) * KM;
                for (int j = 0; j < NOPE; j++) {
                    double s = 0;
                    for (int c = 0; c < KL; c++) s += (double)wkb[((size_t)h * KL + c) * NOPE + j] * lat[(size_t)t * KL + c];
                    k[j] = s;
                }
                memcpy(k + NOPE, kpe + (size_t)t * R, R * sizeof *k);
                ref_matvec(vh + ((size_t)t * H + h) * VM, wvb + (size_t)h * VM * KL, lat + (size_t)t * KL, VM, KL);
            }
        }
        for (int t = 0; t < n; t++) {
            for (int h = 0; h < H; h++) {
                const double *qh = q + ((size_t)t * H + h) * KM;
                double mx = -1e300, sum = 0;
                for (int p = 0; p <= t; p++) {
                    double s = 0;
                    for (int i = 0; i < KM; i++) s += qh[i] * kh[((size_t)p * H + h) * KM + i];
                    sc[p] = s * scale;
                    if (sc[p] > mx) mx = sc[p];
                }
                for (int p = 0; p <= t; p++) sum += (sc[p] = exp(sc[p] - mx));
                for (int i = 0; i < VM; i++) {
                    double o = 0;
                    for (int p = 0; p <= t; p++) o += sc[p] / sum * vh[((size_t)p * H + h) * VM + i];
                    att[h * VM + i] = o;
                }
            }
            ref_matvec(out + (size_t)t * E, wo, att, E, H * VM);
        }
        for (size_t i = 0; i < (size_t)n * E; i++) x[i] += out[i];
        const float *ffn_norm = ref_f32(rm, E, "blk.%d.ffn_norm.weight", il);
        if (il < DL) {
            const float *g = ref_f32(rm, (int64_t)FD * E, "blk.%d.ffn_gate.weight", il);
            const float *u = ref_f32(rm, (int64_t)FD * E, "blk.%d.ffn_up.weight", il);
            const float *dn = ref_f32(rm, (int64_t)E * FD, "blk.%d.ffn_down.weight", il);
            for (int t = 0; t < n; t++) {
                ref_rms(xb, x + (size_t)t * E, ffn_norm, E, eps);
                ref_ffn(tmp, g, u, dn, xb, FD, E);
                for (int i = 0; i < E; i++) x[(size_t)t * E + i] += tmp[i];
            }
            continue;
        }
        const float *router = ref_f32(rm, (int64_t)X * E, "blk.%d.ffn_gate_inp.weight", il);
        const float *bias = ref_f32(rm, X, "blk.%d.exp_probs_b.bias", il);
        const float *ge = ref_f32(rm, (int64_t)X * FF * E, "blk.%d.ffn_gate_exps.weight", il);
        const float *ue = ref_f32(rm, (int64_t)X * FF * E, "blk.%d.ffn_up_exps.weight", il);
        const float *de = ref_f32(rm, (int64_t)X * E * FF, "blk.%d.ffn_down_exps.weight", il);
        const float *gs = ref_f32(rm, (int64_t)S * E, "blk.%d.ffn_gate_shexp.weight", il);
        const float *us = ref_f32(rm, (int64_t)S * E, "blk.%d.ffn_up_shexp.weight", il);
        const float *ds = ref_f32(rm, (int64_t)E * S, "blk.%d.ffn_down_shexp.weight", il);
        for (int t = 0; t < n; t++) {
            double *xt = x + (size_t)t * E;
            ref_rms(xb, xt, ffn_norm, E, eps);
            ref_matvec(pr, router, xb, X, E);
            for (int e = 0; e < X; e++) sel[e] = (pr[e] = ref_sigm(pr[e])) + bias[e];
            int taken[1024] = {0};
            if (G > 1) { /* groups by the sum of their two best; the others masked */
                const int per = X / G;
                double gsc[1024];
                for (int g = 0; g < G; g++) {
                    int tk[1024] = {0};
                    const int a = ref_best(sel + g * per, per, tk);
                    tk[a] = 1;
                    gsc[g] = sel[g * per + a] + sel[g * per + ref_best(sel + g * per, per, tk)];
                }
                int gt[1024] = {0};
                for (int u = 0; u < GU; u++) gt[ref_best(gsc, G, gt)] = 1;
                for (int e = 0; e < X; e++) taken[e] = !gt[e / per];
            }
            int ids[64];
            double wsum = 0;
            for (int r = 0; r < K; r++) {
                ids[r] = ref_best(sel, X, taken);
                taken[ids[r]] = 1;
                wsum += pr[ids[r]];
            }
            memset(acc, 0, E * sizeof *acc);
            for (int r = 0; r < K; r++) {
                const int e = ids[r];
                ref_ffn(tmp, ge + (size_t)e * FF * E, ue + (size_t)e * FF * E, de + (size_t)e * E * FF, xb, FF, E);
                for (int i = 0; i < E; i++) acc[i] += pr[e] / wsum * wscale * tmp[i];
            }
            ref_ffn(tmp, gs, us, ds, xb, S, E);
            for (int i = 0; i < E; i++) xt[i] += acc[i] + tmp[i];
        }
    }
    const float *on = ref_f32(rm, E, "output_norm.weight");
    const float *ow = ref_has(rm, "output.weight") ? ref_f32(rm, (int64_t)V * E, "output.weight") : te;
    ref_rms(xb, x + (size_t)(n - 1) * E, on, E, eps);
    ref_matvec(logits, ow, xb, V, E);
    free(x); free(xb); free(qa); free(q); free(kva); free(lat); free(kpe); free(kh); free(vh);
    free(sc); free(att); free(tmp); free(pr); free(sel); free(acc); free(out);
}

static char g_dir[] = "/tmp/kvasir-test-ds2-XXXXXX", g_path[128];
static kv_model *g_m;
enum { N = 11 };
static const int32_t toks[N] = {17, 300, 5, 599, 42, 42, 7, 123, 256, 3, 77};
static float *g_a; /* our logits after each token, token by token on 1 thread */
static int V;

static int setup(void) {
    if (!mkdtemp(g_dir)) return 1;
    snprintf(g_path, sizeof g_path, "%s/m.gguf", g_dir);
    kv_gen_config c = {.arch = "deepseek2", .n_layer = 3, .n_embd = 128, .n_ff_exp = 64, .n_expert = 8,
                       .n_expert_used = 3, .n_head = 4, .head_dim = 40, .n_rot = 16, .n_vocab = 600,
                       .n_ctx = 256, .type = 0 /* KV_TYPE_F32 */, .seed = 5, .q_lora_rank = 48,
                       .kv_lora_rank = 32, .head_dim_v = 20, .n_ff = 96, .n_dense_lead = 1, .n_expert_shared = 2,
                       .n_expert_groups = 4, .n_group_used = 2, .yarn_factor = 4.0f, .yarn_orig_ctx = 32,
                       .n_threads = 1};
    if (ref_gen_load(&c, g_path, &g_m)) return 1;
    V = (int)kv_model_hparams(g_m)->n_vocab;
    g_a = ref_ours(g_m, toks, N, 1, 0, KV_TYPE_F32);
    return 0;
}

static void teardown(void) { ref_gen_close(g_a, g_m, g_path, g_dir); }

static void test_loaded(void) {
    const kv_hparams *hp = kv_model_hparams(g_m);
    ASSERT_EQ(hp->arch, KV_ARCH_DEEPSEEK2);
    ASSERT_EQ(hp->attn, KV_ATTN_MLA);
    ASSERT_EQ(hp->router, KV_ROUTER_SIGMOID);
    ASSERT_EQ(hp->n_layer_dense_lead, 1);
    ASSERT_EQ(hp->n_head_kv, 1);
    ASSERT_EQ(hp->head_dim, 32 + 16); /* the cached row: latent + rope part */
    ASSERT_EQ(hp->n_ff_shexp, 2 * 64);
    ASSERT_TRUE(hp->rope_yarn && hp->expert_weights_norm);
    ASSERT_TRUE(kv_model_layer(g_m, 0)->ffn_gate.data && !kv_model_layer(g_m, 0)->gate_exps.data);
    ASSERT_TRUE(kv_model_layer(g_m, 1)->exp_probs_b.data && kv_model_layer(g_m, 1)->wk_b.data);
}

/* the cache holds per token and layer only kv_lora_rank + n_rot elements */
static void test_cache_bytes(void) {
    kv_diag d = {0};
    kv_pool *pool = NULL;
    kv_state *s = NULL;
    kv_state_opts o = {.n_ctx = 64};
    ASSERT_EQ(kv_pool_new(&pool, 1, &d), 0);
    ASSERT_EQ(kv_state_new(&s, g_m, pool, &o, &d), 0);
    if (s) {
        kv_state_mem mem;
        kv_state_get_mem(s, &mem);
        ASSERT_EQ(mem.n_attn_layers, 3);
        ASSERT_EQ(mem.block_bytes, (uint64_t)3 * mem.block_tokens * (32 + 16) * sizeof(float));
        kv_state_free(s);
    }
    kv_pool_free(pool);
}

static void test_f64_reference(void) {
    double worst = ref_max_dlogit(g_path, ref_forward, toks, N, 2, g_a, V);
    printf("f32 deepseek2 vs f64 reference: max |dlogit| = %.3g\n", worst);
    ASSERT_TRUE(worst < 2e-4);
}

static void test_bit_identity(void) {
    float *b = ref_ours(g_m, toks, N, 2, 4, KV_TYPE_F32), *cc = ref_ours(g_m, toks, N, 2, 0, KV_TYPE_F32);
    ASSERT_TRUE(memcmp(g_a, cc, (size_t)N * V * sizeof *g_a) == 0);
    ASSERT_TRUE(memcmp(g_a, b, (size_t)N * V * sizeof *g_a) == 0);
    free(b);
    free(cc);
}

/* The last block of a call runs the queries, attention and FFN only for the
 * rows whose logits are wanted (every token's latent still goes into the
 * cache): the prompt's last logits and a decode step after it are those of
 * token-by-token evaluation, and those of a call that keeps every row. */
static void test_dropped_rows(void) {
    kv_diag d = {0};
    kv_pool *pool = NULL;
    kv_state *s = NULL;
    kv_state_opts o = {.n_ctx = 64, .n_batch = 16};
    ASSERT_EQ(kv_pool_new(&pool, 2, &d), 0);
    ASSERT_EQ(kv_state_new(&s, g_m, pool, &o, &d), 0);
    float *l = calloc((size_t)V, sizeof *l);
    if (s && l) {
        for (int all = 0; all < 2; all++) {
            kv_state_reset(s);
            kv_state_set_all_rows(s, all);
            ASSERT_EQ(kv_state_eval(s, toks, N - 1, l, &d), 0);
            ASSERT_TRUE(kv_state_dropped_rows(s) == !all);
            ASSERT_TRUE(memcmp(l, g_a + (size_t)(N - 2) * V, (size_t)V * sizeof *l) == 0);
            ASSERT_EQ(kv_state_eval(s, toks + N - 1, 1, l, &d), 0);
            ASSERT_TRUE(memcmp(l, g_a + (size_t)(N - 1) * V, (size_t)V * sizeof *l) == 0);
        }
    }
    free(l);
    kv_state_free(s);
    kv_pool_free(pool);
}

/* an F16 cache: the same model within F16 rounding of the latent */
static void test_f16_cache(void) {
    float *h = ref_ours(g_m, toks, N, 2, 0, KV_TYPE_F16);
    double worst = 0;
    for (size_t i = 0; i < (size_t)N * V; i++) worst = fmax(worst, fabs((double)h[i] - g_a[i]));
    printf("f16 cache vs f32 cache: max |dlogit| = %.3g\n", worst);
    ASSERT_TRUE(worst > 0 && worst < 5e-2);
    free(h);
}

static void test_multi_seq(void) {
    const float *a = g_a;
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
    ASSERT_EQ(kv_state_eval_seq(s, 1, toks, 3, NULL, &d), 0);
    int ok = 1;
    for (int t = 0; t < 6; t++) {
        int32_t tk[3] = {toks[t], toks[t + 3], toks[t]};
        uint32_t sq[3] = {0, 1, 2};
        ASSERT_EQ(kv_state_decode(s, tk, sq, 3, lg, &d), 0);
        ok &= !memcmp(lg, a + (size_t)t * V, V * sizeof *lg);
        ok &= !memcmp(lg + V, a + (size_t)(t + 3) * V, V * sizeof *lg);
        ok &= !memcmp(lg + 2 * V, a + (size_t)t * V, V * sizeof *lg);
    }
    ASSERT_TRUE(ok);
    free(lg);
    kv_state_free(s);
    kv_pool_free(pool);
}

/* Ring windows: blocks [0, 0] (the dense block), [1, 1] and [2, 2] loaded
 * apart and chained by hidden states give, token by token, the bits of the
 * whole model (g_a). */
static void test_windows(void) {
    static const uint32_t win[3][2] = {{0, 0}, {1, 1}, {2, 2}};
    kv_model *mw[3] = {0};
    kv_state *sw[3] = {0};
    kv_diag d = {0};
    kv_pool *pool = NULL;
    ASSERT_EQ(kv_pool_new(&pool, 2, &d), 0);
    const size_t E = kv_model_hparams(g_m)->n_embd;
    float *x1 = calloc(E, sizeof *x1), *x2 = calloc(E, sizeof *x2), *lg = calloc(V, sizeof *lg);
    bool ok = true;
    for (int i = 0; i < 3; i++) {
        kv_model_opts o = {.window = true, .layer_first = win[i][0], .layer_last = win[i][1]};
        kv_state_opts so = {.n_ctx = 64};
        if (kv_model_load_ex(&mw[i], g_path, &o, &d) || kv_state_new(&sw[i], mw[i], pool, &so, &d)) {
            KVT_FAIL("window %d: %s", i, d.msg);
            ok = false;
        }
    }
    for (int t = 0; ok && t < N; t++) {
        const uint32_t seq = 0, out = 0;
        ASSERT_EQ(kv_state_batch_window(sw[0], &toks[t], NULL, &seq, 1, &out, 0, NULL, x1, &d), 0);
        ASSERT_EQ(kv_state_batch_window(sw[1], NULL, x1, &seq, 1, &out, 0, NULL, x2, &d), 0);
        ASSERT_EQ(kv_state_batch_window(sw[2], NULL, x2, &seq, 1, &out, 1, lg, NULL, &d), 0);
        ok &= !memcmp(lg, g_a + (size_t)t * V, (size_t)V * sizeof *lg);
    }
    ASSERT_TRUE(ok);
    for (int i = 0; i < 3; i++) {
        kv_state_free(sw[i]);
        kv_model_free(mw[i]);
    }
    free(x1);
    free(x2);
    free(lg);
    kv_pool_free(pool);
}

/* The generated file's metadata (no tensors) with key `drop` left out and,
 * when set_key, set_key = set_val (u32); the hyper-parameters read from it:
 * rc and d. */
static int meta_variant(const char *drop, const char *set_key, uint32_t set_val, kv_diag *d) {
    char p[160];
    snprintf(p, sizeof p, "%s/meta.gguf", g_dir);
    kv_gguf *g = NULL, *v = NULL;
    kv_gguf_writer *w = NULL;
    int rc = kv_gguf_open(&g, g_path, d);
    if (!rc) rc = kv_gguf_writer_new(&w, d);
    for (size_t i = 0; !rc && i < kv_gguf_n_kv(g); i++) {
        const kv_gguf_kv *kv = kv_gguf_kv_at(g, i);
        const bool skip = (drop && kv->key.len == strlen(drop) && !memcmp(kv->key.ptr, drop, kv->key.len)) ||
                          (set_key && kv->key.len == strlen(set_key) && !memcmp(kv->key.ptr, set_key, kv->key.len));
        if (!skip) rc = kv_gguf_writer_copy_kv(w, kv, d);
    }
    if (!rc && set_key) rc = kv_gguf_writer_set_u32(w, set_key, set_val, d);
    if (!rc) rc = kv_gguf_writer_begin(w, p, d);
    if (!rc) rc = kv_gguf_writer_finish(w, d);
    kv_gguf_writer_free(w);
    kv_gguf_close(g);
    if (rc) {
        KVT_FAIL("writing the metadata variant: %s", d->msg);
        return rc;
    }
    kv_hparams hp;
    memset(d, 0, sizeof *d);
    if (!(rc = kv_gguf_open(&v, p, d))) rc = kv_arch_read_hparams(v, &hp, d);
    kv_gguf_close(v);
    unlink(p);
    return rc;
}

/* files kvasir cannot run as llama.cpp would are refused at load, naming the key */
static void test_bad_metadata(void) {
    kv_diag d = {0};
    ASSERT_EQ(meta_variant(NULL, NULL, 0, &d), 0); /* the copy itself loads */
    ASSERT_EQ(meta_variant("deepseek2.attention.key_length_mla", NULL, 0, &d), KV_EUNSUPPORTED);
    ASSERT_TRUE(strstr(d.msg, "attn_kv_b") != NULL);
    ASSERT_EQ(meta_variant(NULL, "deepseek2.expert_gating_func", 3, &d), KV_EFORMAT);
    ASSERT_TRUE(strstr(d.msg, "expert_gating_func") != NULL);
    ASSERT_EQ(meta_variant(NULL, "deepseek2.expert_group_count", 3, &d), KV_EFORMAT); /* 8 experts */
    ASSERT_TRUE(strstr(d.msg, "expert_group_count") != NULL);
    ASSERT_EQ(meta_variant(NULL, "deepseek2.expert_group_used_count", 4, &d), KV_EFORMAT);
    ASSERT_EQ(meta_variant(NULL, "deepseek2.attention.head_count_kv", 4, &d), KV_EFORMAT);
    ASSERT_TRUE(strstr(d.msg, "MLA") != NULL);
    ASSERT_EQ(meta_variant(NULL, "deepseek2.leading_dense_block_count", 4, &d), KV_EFORMAT);
    ASSERT_EQ(meta_variant(NULL, "deepseek2.nextn_predict_layers", 1, &d), KV_EUNSUPPORTED);
    printf("refused: %s\n", d.msg);
}

static const kvt_case cases[] = {KVT_CASE(test_bad_metadata), KVT_CASE(test_loaded), KVT_CASE(test_cache_bytes), KVT_CASE(test_f64_reference),
                                 KVT_CASE(test_bit_identity), KVT_CASE(test_dropped_rows), KVT_CASE(test_f16_cache), KVT_CASE(test_multi_seq),
                                 KVT_CASE(test_windows)};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
