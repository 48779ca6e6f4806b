/* qwen35moe forward pass (src/model/qwen35.c): an independent f64 reference
 * of the whole model (gated delta rule with its conv, gated full attention
 * with IMROPE sections, routed + shared experts) on a generated F32 model,
 * and bit-identity of our f32 logits across thread counts, prefill chunking
 * vs token-by-token decode, and several sequences decoded together. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvasir/gen.h"
#include "kvasir/model.h"
#include "kvtest.h"

#define F(w) ((const float *)(w)->data)

static void ref_matvec(double *y, const float *w, const double *x, int rows, int cols) {
    for (int r = 0; r < rows; r++) {
        double s = 0;
        for (int c = 0; c < cols; c++) s += (double)w[(size_t)r * cols + c] * x[c];
        y[r] = s;
    }
}
static void ref_rms(double *y, const double *x, const float *w, int n, double eps) {
    double s = 0;
    for (int i = 0; i < n; i++) s += x[i] * x[i];
    double k = 1.0 / sqrt(s / n + eps);
    for (int i = 0; i < n; i++) y[i] = x[i] * k * w[i];
}
static double sigm(double x) { return 1.0 / (1.0 + exp(-x)); }
static double silu(double x) { return x * sigm(x); }

/* Logits of the last token of toks[0..n) by a plain f64 forward. */
static void ref_forward(const kv_model *m, const int32_t *toks, int n, double *logits) {
    const kv_hparams *hp = kv_model_hparams(m);
    const int E = hp->n_embd, H = hp->n_head, HKV = hp->n_head_kv, HD = hp->head_dim, V = hp->n_vocab;
    const int SV = hp->ssm_d_state, NK = hp->ssm_n_group, NV = hp->ssm_dt_rank, KC = hp->ssm_d_conv;
    const int KD = SV * NK, VD = SV * NV, C = 2 * KD + VD, X = hp->n_expert, K = hp->n_expert_used;
    const int FF = hp->n_ff_exp, S = hp->n_ff_shexp, L = hp->n_layer;
    const double eps = hp->rms_eps;
    double *x = calloc((size_t)n * E, sizeof *x), *xb = calloc(E, sizeof *xb);
    double *qkv = calloc((size_t)n * C, sizeof *qkv), *tmp = calloc(E > V ? (E > C ? E : C) : (V > C ? V : C), sizeof *tmp);
    double *kc = calloc((size_t)n * HKV * HD, sizeof *kc), *vc = calloc((size_t)n * HKV * HD, sizeof *vc);
    double *qg = calloc((size_t)n * 2 * H * HD, sizeof *qg), *att = calloc(H * HD > VD ? H * HD : VD, sizeof *att);
    double *st = calloc((size_t)NV * SV * SV, sizeof *st), *z = calloc(VD, sizeof *z);
    double *pr = calloc(X, sizeof *pr), *g = calloc(FF > S ? FF : S, sizeof *g), *u = calloc(FF > S ? FF : S, sizeof *u);
    double *acc = calloc(E, sizeof *acc), *sc = calloc(n, sizeof *sc), *bb = calloc(NV, sizeof *bb), *aa = calloc(NV, sizeof *aa);
    /* embeddings (token_embd is F32 in this test model) */
    const kv_gguf_tensor *te = kv_gguf_find_tensor(kv_model_gguf(m), "token_embd.weight");
    for (int t = 0; t < n; t++)
        for (int i = 0; i < E; i++) x[(size_t)t * E + i] = ((const float *)te->data)[(size_t)toks[t] * E + i];
    for (int il = 0; il < L; il++) {
        const kv_layer *ly = kv_model_layer(m, (uint32_t)il);
        if (ly->recurrent) {
            /* projections for every token, then conv + delta rule in order */
            memset(st, 0, (size_t)NV * SV * SV * sizeof *st);
            for (int t = 0; t < n; t++) {
                ref_rms(xb, x + (size_t)t * E, F(&ly->attn_norm), E, eps);
                ref_matvec(qkv + (size_t)t * C, F(&ly->wqkv), xb, C, E);
            }
            double *out = calloc((size_t)n * E, sizeof *out);
            for (int t = 0; t < n; t++) {
                ref_rms(xb, x + (size_t)t * E, F(&ly->attn_norm), E, eps);
                ref_matvec(z, F(&ly->wqkv_gate), xb, VD, E);
                ref_matvec(bb, F(&ly->ssm_beta), xb, NV, E);
                ref_matvec(aa, F(&ly->ssm_alpha), xb, NV, E);
                double cv[4096];
                for (int c = 0; c < C; c++) {
                    double s = 0;
                    for (int i = 0; i < KC; i++) {
                        int tt = t - (KC - 1) + i;
                        if (tt >= 0) s += qkv[(size_t)tt * C + c] * F(&ly->ssm_conv1d)[(size_t)c * KC + i];
                    }
                    cv[c] = silu(s);
                }
                for (int h = 0; h < 2 * NK; h++) {
                    double s = 0;
                    for (int i = 0; i < SV; i++) s += cv[h * SV + i] * cv[h * SV + i];
                    double k = 1.0 / fmax(sqrt(s), eps);
                    for (int i = 0; i < SV; i++) cv[h * SV + i] *= k;
                }
                for (int h = 0; h < NV; h++) {
                    const int kh = h % NK;
                    const double *q = cv + kh * SV, *k = cv + KD + kh * SV, *v = cv + 2 * KD + h * SV;
                    double a = aa[h] + F(&ly->ssm_dt)[h];
                    double sp = a > 20 ? a : log1p(exp(a));
                    double decay = exp(sp * F(&ly->ssm_a)[h]), beta = sigm(bb[h]);
                    double *Sh = st + (size_t)h * SV * SV; /* Sh[i*SV + j] = S[i][j], i key dim, j value dim */
                    for (int i = 0; i < SV * SV; i++) Sh[i] *= decay;
                    for (int j = 0; j < SV; j++) {
                        double kv = 0;
                        for (int i = 0; i < SV; i++) kv += Sh[i * SV + j] * k[i];
                        double dj = (v[j] - kv) * beta;
                        for (int i = 0; i < SV; i++) Sh[i * SV + j] += k[i] * dj;
                    }
                    double o[1024];
                    for (int j = 0; j < SV; j++) {
                        double s = 0;
                        for (int i = 0; i < SV; i++) s += Sh[i * SV + j] * q[i];
                        o[j] = s / sqrt((double)SV);
                    }
                    ref_rms(att + h * SV, o, F(&ly->ssm_norm), SV, eps);
                    for (int j = 0; j < SV; j++) att[h * SV + j] *= silu(z[h * SV + j]);
                }
                ref_matvec(out + (size_t)t * E, F(&ly->ssm_out), att, E, VD);
            }
            for (size_t i = 0; i < (size_t)n * E; i++) x[i] += out[i];
            free(out);
        } else {
            double *out = calloc((size_t)n * E, sizeof *out);
            for (int t = 0; t < n; t++) {
                ref_rms(xb, x + (size_t)t * E, F(&ly->attn_norm), E, eps);
                ref_matvec(qg + (size_t)t * 2 * H * HD, F(&ly->wq), xb, 2 * H * HD, E);
                ref_matvec(kc + (size_t)t * HKV * HD, F(&ly->wk), xb, HKV * HD, E);
                ref_matvec(vc + (size_t)t * HKV * HD, F(&ly->wv), xb, HKV * HD, E);
            }
            /* norms and IMROPE: pair i of n_rot/2, sector i % sum, component by the interleave */
            const int *sec = hp->rope_sections, sd = sec[0] + sec[1] + sec[2] + sec[3], R = hp->n_rot;
            for (int t = 0; t < n; t++) {
                const double pos[4] = {t, t, t, 0};
                for (int h = 0; h < H + HKV; h++) {
                    double *v = h < H ? qg + (size_t)t * 2 * H * HD + (size_t)h * 2 * HD : kc + (size_t)t * HKV * HD + (size_t)(h - H) * HD;
                    double tmpv[1024];
                    ref_rms(tmpv, v, h < H ? F(&ly->q_norm) : F(&ly->k_norm), HD, eps);
                    for (int i = 0; i < R / 2; i++) {
                        int s = i % sd, c = 3;
                        if (s % 3 == 1 && s < 3 * sec[1]) c = 1;
                        else if (s % 3 == 2 && s < 3 * sec[2]) c = 2;
                        else if (s % 3 == 0 && s < 3 * sec[0]) c = 0;
                        double th = pos[c] * pow(hp->rope_freq_base, -2.0 * i / R);
                        double a = tmpv[i], b = tmpv[i + R / 2];
                        tmpv[i] = a * cos(th) - b * sin(th);
                        tmpv[i + R / 2] = a * sin(th) + b * cos(th);
                    }
                    memcpy(v, tmpv, HD * sizeof *v);
                }
            }
            for (int t = 0; t < n; t++) {
                for (int h = 0; h < H; h++) {
                    const int kh = h / (H / HKV);
                    const double *q = qg + (size_t)t * 2 * H * HD + (size_t)h * 2 * HD;
                    double mx = -1e300, sum = 0;
                    for (int p = 0; p <= t; p++) {
                        double s = 0;
                        for (int i = 0; i < HD; i++) s += q[i] * kc[(size_t)p * HKV * HD + kh * HD + i];
                        sc[p] = s / sqrt((double)HD);
                        if (sc[p] > mx) mx = sc[p];
                    }
                    for (int p = 0; p <= t; p++) sum += (sc[p] = exp(sc[p] - mx));
                    for (int i = 0; i < HD; i++) {
                        double o = 0;
                        for (int p = 0; p <= t; p++) o += sc[p] / sum * vc[(size_t)p * HKV * HD + kh * HD + i];
                        att[h * HD + i] = o * sigm(q[HD + i]);
                    }
                }
                ref_matvec(out + (size_t)t * E, F(&ly->wo), att, E, H * HD);
            }
            for (size_t i = 0; i < (size_t)n * E; i++) x[i] += out[i];
            free(out);
        }
        /* post-attention norm, routed + shared experts */
        for (int t = 0; t < n; t++) {
            double *xt = x + (size_t)t * E;
            ref_rms(xb, xt, F(&ly->post_norm), E, eps);
            ref_matvec(pr, F(&ly->gate_inp), xb, X, E);
            double mx = -1e300, sum = 0;
            for (int e = 0; e < X; e++) mx = pr[e] > mx ? pr[e] : mx;
            for (int e = 0; e < X; e++) sum += (pr[e] = exp(pr[e] - mx));
            for (int e = 0; e < X; e++) pr[e] /= sum;
            int ids[64];
            double wsum = 0;
            for (int r = 0; r < K; r++) {
                int best = -1;
                for (int e = 0; e < X; e++) {
                    int taken = 0;
                    for (int q = 0; q < r; q++) taken |= ids[q] == e;
                    if (!taken && (best < 0 || pr[e] > pr[best])) best = e;
                }
                ids[r] = best;
                wsum += pr[best];
            }
            memset(acc, 0, E * sizeof *acc);
            for (int r = 0; r < K; r++) {
                int e = ids[r];
                ref_matvec(g, F(&ly->gate_exps) + (size_t)e * FF * E, xb, FF, E);
                ref_matvec(u, F(&ly->up_exps) + (size_t)e * FF * E, xb, FF, E);
                for (int i = 0; i < FF; i++) g[i] = silu(g[i]) * u[i];
                ref_matvec(tmp, F(&ly->down_exps) + (size_t)e * E * FF, g, E, FF);
                for (int i = 0; i < E; i++) acc[i] += pr[e] / wsum * tmp[i];
            }
            ref_matvec(g, F(&ly->gate_shexp), xb, S, E);
            ref_matvec(u, F(&ly->up_shexp), xb, S, E);
            for (int i = 0; i < S; i++) g[i] = silu(g[i]) * u[i];
            ref_matvec(tmp, F(&ly->down_shexp), g, E, S);
            double gs;
            ref_matvec(&gs, F(&ly->gate_inp_shexp), xb, 1, E);
            for (int i = 0; i < E; i++) xt[i] += acc[i] + tmp[i] * sigm(gs);
        }
    }
    const kv_gguf_tensor *on = kv_gguf_find_tensor(kv_model_gguf(m), "output_norm.weight");
    const kv_gguf_tensor *ow = kv_gguf_find_tensor(kv_model_gguf(m), "output.weight");
    ref_rms(xb, x + (size_t)(n - 1) * E, on->data, E, eps);
    ref_matvec(logits, ow ? ow->data : te->data, xb, V, E);
    free(x); free(xb); free(qkv); free(tmp); free(kc); free(vc); free(qg); free(att); free(st); free(z);
    free(pr); free(g); free(u); free(acc); free(sc); free(bb); free(aa);
}

/* Our logits after each of the n tokens, evaluated in chunks of `batch`
 * (0: one eval of all), on a pool of nth threads, as sequence `seq` of an
 * n_seq state. */
static float *ours(const kv_model *m, const int32_t *toks, int n, int nth, uint32_t batch) {
    const int V = (int)kv_model_hparams(m)->n_vocab;
    float *out = calloc((size_t)n * V, sizeof *out);
    kv_diag d = {0};
    kv_pool *pool = NULL;
    kv_state *s = NULL;
    kv_state_opts o = {.n_ctx = 64, .n_batch = batch ? batch : 64};
    if (kv_pool_new(&pool, nth, &d) || kv_state_new(&s, m, pool, &o, &d)) {
        KVT_FAIL("state: %s", d.msg);
        kv_pool_free(pool);
        return out;
    }
    /* token by token, keeping every step's logits */
    for (int t = 0; t < n; t++)
        if (kv_state_eval(s, toks + t, 1, out + (size_t)t * V, &d)) KVT_FAIL("eval: %s", d.msg);
    if (batch) { /* the whole prompt again, chunked: overwrite the last row */
        kv_state_reset(s);
        if (kv_state_eval(s, toks, (uint32_t)n, out + (size_t)(n - 1) * V, &d)) KVT_FAIL("eval: %s", d.msg);
    }
    kv_state_free(s);
    kv_pool_free(pool);
    return out;
}

int main(void) {
    char dir[] = "/tmp/kvasir-test-q35-XXXXXX", path[128];
    if (!mkdtemp(dir)) return 1;
    snprintf(path, sizeof path, "%s/m.gguf", dir);
    kv_gen_config c = {.arch = "qwen35moe", .n_layer = 4, .n_embd = 128, .n_ff_exp = 64, .n_expert = 8,
                       .n_expert_used = 2, .n_head = 4, .n_head_kv = 2, .head_dim = 32, .n_vocab = 600,
                       .n_ctx = 256, .type = 0 /* KV_TYPE_F32 */, .seed = 5, .full_attn_interval = 2,
                       .ssm_d_state = 16, .ssm_n_group = 2, .ssm_dt_rank = 6, .n_rot = 12,
                       .rope_sections = {2, 1, 2, 1}, .n_nextn = 1, .n_ff_shexp = 48, .n_threads = 1};
    kv_gen_fill_defaults(&c);
    kv_diag d = {0};
    ASSERT_EQ(kv_gen_model(&c, path, &d), 0);
    kv_model *m = NULL;
    ASSERT_EQ(kv_model_load(&m, path, &d), 0);
    if (!m) {
        fprintf(stderr, "load: %s\n", d.msg);
        return 1;
    }
    const kv_hparams *hp = kv_model_hparams(m);
    ASSERT_EQ(hp->arch, KV_ARCH_QWEN35MOE);
    ASSERT_EQ(hp->n_layer, 4);
    ASSERT_EQ(hp->n_layer_nextn, 1);
    ASSERT_TRUE(kv_model_layer(m, 0)->recurrent && !kv_model_layer(m, 1)->recurrent);
    ASSERT_TRUE(kv_model_layer(m, 4)->nextn_eh_proj.data != NULL); /* MTP loaded */

    enum { N = 11 };
    const int32_t toks[N] = {17, 300, 5, 599, 42, 42, 7, 123, 256, 3, 77};
    const int V = (int)hp->n_vocab;
    float *a = ours(m, toks, N, 1, 0), *b = ours(m, toks, N, 2, 4), *cc = ours(m, toks, N, 2, 0);
    /* f64 reference at several prefix lengths (positions cross the conv window and attention layers) */
    double *ref = calloc(V, sizeof *ref), worst = 0;
    for (int n = 1; n <= N; n += 3) {
        ref_forward(m, toks, n, ref);
        for (int i = 0; i < V; i++) {
            double e = fabs(ref[i] - a[(size_t)(n - 1) * V + i]);
            if (e > worst) worst = e;
        }
    }
    printf("f32 qwen35moe vs f64 reference: max |dlogit| = %.3g\n", worst);
    ASSERT_TRUE(worst < 2e-4);
    /* bit-identity: threads, token-by-token vs chunked prefill (chunks of 4) */
    ASSERT_TRUE(memcmp(a, cc, (size_t)N * V * sizeof *a) == 0);
    ASSERT_TRUE(memcmp(a, b, (size_t)N * V * sizeof *a) == 0);

    /* several sequences decoded together == each alone; a reset sequence starts over */
    {
        kv_pool *pool = NULL;
        kv_state *s = NULL;
        kv_state_opts o = {.n_ctx = 64, .n_seq = 3};
        ASSERT_EQ(kv_pool_new(&pool, 2, &d), 0);
        ASSERT_EQ(kv_state_new(&s, m, pool, &o, &d), 0);
        float *lg = calloc((size_t)3 * V, sizeof *lg);
        ASSERT_EQ(kv_state_eval_seq(s, 1, toks, 3, NULL, &d), 0); /* seq 1 ahead by 3 */
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
        kv_state_reset_seq(s, 2);
        ASSERT_EQ(kv_state_eval_seq(s, 2, toks, 1, lg, &d), 0);
        ASSERT_TRUE(!memcmp(lg, a, V * sizeof *lg));
        free(lg);
        kv_state_free(s);
        kv_pool_free(pool);
    }
    free(a); free(b); free(cc); free(ref);
    kv_model_free(m);
    unlink(path);
    rmdir(dir);
    printf("%d checks, %d failed\n", kvt_checks, kvt_failures);
    return kvt_failures ? 1 : 0;
}
