/* qwen35moe forward pass (src/model/qwen35.c): an independent f64 reference
 * of the whole model (gated delta rule with its conv, gated full attention
 * with IMROPE sections, routed + shared experts) on a generated F32 model,
 * and bit-identity of our f32 logits across thread counts, prefill chunking
 * vs token-by-token decode, and several sequences decoded together; and
 * with the last block a full-attention or a delta-net one, the same bits
 * whether it runs every token or only those whose logits are wanted
 * (test_dropped_rows). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvasir/gen.h"
#include "kvasir/model.h"
#include "kvtest.h"
#include "ref64.h"
#include "ref_gguf.h"

/* Logits of the last token of toks[0..n) by a plain f64 forward over the
 * F32 file at rm (tests/ref_gguf.h: tensors by name, dims from metadata). */
static void ref_forward(const ref_model *rm, const int32_t *toks, int n, double *logits) {
    const int E = (int)ref_u32(rm, "embedding_length"), H = (int)ref_u32(rm, "attention.head_count");
    const int HKV = (int)ref_u32(rm, "attention.head_count_kv"), HD = (int)ref_u32(rm, "attention.key_length");
    const int V = ref_n_vocab(rm);
    const int SV = (int)ref_u32(rm, "ssm.state_size"), NK = (int)ref_u32(rm, "ssm.group_count");
    const int NV = (int)ref_u32(rm, "ssm.time_step_rank"), KC = (int)ref_u32(rm, "ssm.conv_kernel");
    const int KD = SV * NK, VD = SV * NV, C = 2 * KD + VD, X = (int)ref_u32(rm, "expert_count");
    const int K = (int)ref_u32(rm, "expert_used_count"), FF = (int)ref_u32(rm, "expert_feed_forward_length");
    const int S = (int)ref_u32(rm, "expert_shared_feed_forward_length");
    const int L = (int)ref_u32(rm, "block_count") - (int)ref_u32_or(rm, "nextn_predict_layers", 0);
    const int R = (int)ref_u32(rm, "rope.dimension_count");
    const double eps = ref_f32_key(rm, "attention.layer_norm_rms_epsilon");
    const double base = ref_f32_key(rm, "rope.freq_base");
    int sec[4] = {0, 0, 0, 0};
    {
        char key[96];
        snprintf(key, sizeof key, "%s.rope.dimension_sections", rm->arch);
        uint64_t ns = 0;
        const uint8_t *sd = NULL;
        kv_diag d = {0};
        if (kv_gguf_get_arr(rm->g, key, KV_GGUF_INT32, &ns, &sd, &d) || ns < 1 || ns > 4) {
            KVT_FAIL("reference: %s: %s", key, d.msg);
            return;
        }
        for (uint64_t i = 0; i < ns; i++) memcpy(&sec[i], sd + 4 * i, 4);
    }
    if (E <= 0 || H <= 0 || HKV <= 0 || V <= 0 || L <= 0 || K > 64 || C > 4096 || SV > 1024 || HD > 1024) {
        KVT_FAIL("reference: implausible dims");
        return;
    }
    double *x = calloc((size_t)n * E, sizeof *x), *xb = calloc(E, sizeof *xb);
    double *qkv = calloc((size_t)n * C, sizeof *qkv), *tmp = calloc(E > V ? (E > C ? E : C) : (V > C ? V : C), sizeof *tmp);
    double *kc = calloc((size_t)n * HKV * HD, sizeof *kc), *vc = calloc((size_t)n * HKV * HD, sizeof *vc);
    double *qg = calloc((size_t)n * 2 * H * HD, sizeof *qg), *att = calloc(H * HD > VD ? H * HD : VD, sizeof *att);
    double *st = calloc((size_t)NV * SV * SV, sizeof *st), *z = calloc(VD, sizeof *z);
    double *pr = calloc(X, sizeof *pr), *g = calloc(FF > S ? FF : S, sizeof *g), *u = calloc(FF > S ? FF : S, sizeof *u);
    double *acc = calloc(E, sizeof *acc), *sc = calloc(n, sizeof *sc), *bb = calloc(NV, sizeof *bb), *aa = calloc(NV, sizeof *aa);
    /* embeddings (token_embd is F32 in this test model) */
    const float *te = ref_f32(rm, (int64_t)V * E, "token_embd.weight");
    for (int t = 0; t < n; t++)
        for (int i = 0; i < E; i++) x[(size_t)t * E + i] = te[(size_t)toks[t] * E + i];
    for (int il = 0; il < L; il++) {
        const float *attn_norm = ref_f32(rm, E, "blk.%d.attn_norm.weight", il);
        if (ref_has(rm, "blk.%d.ssm_a", il)) { /* gated delta-net block */
            const float *wqkv = ref_f32(rm, (int64_t)C * E, "blk.%d.attn_qkv.weight", il);
            const float *wgate = ref_f32(rm, (int64_t)VD * E, "blk.%d.attn_gate.weight", il);
            const float *wbeta = ref_f32(rm, (int64_t)NV * E, "blk.%d.ssm_beta.weight", il);
            const float *walpha = ref_f32(rm, (int64_t)NV * E, "blk.%d.ssm_alpha.weight", il);
            const float *conv = ref_f32(rm, (int64_t)C * KC, "blk.%d.ssm_conv1d.weight", il);
            const float *dt = ref_f32(rm, NV, "blk.%d.ssm_dt.bias", il);
            const float *ssm_a = ref_f32(rm, NV, "blk.%d.ssm_a", il);
            const float *ssm_norm = ref_f32(rm, SV, "blk.%d.ssm_norm.weight", il);
            const float *ssm_out = ref_f32(rm, (int64_t)E * VD, "blk.%d.ssm_out.weight", il);
            /* projections for every token, then conv + delta rule in order */
            memset(st, 0, (size_t)NV * SV * SV * sizeof *st);
            for (int t = 0; t < n; t++) {
                ref_rms(xb, x + (size_t)t * E, attn_norm, E, eps);
                ref_matvec(qkv + (size_t)t * C, wqkv, xb, C, E);
            }
            double *out = calloc((size_t)n * E, sizeof *out);
            for (int t = 0; t < n; t++) {
                ref_rms(xb, x + (size_t)t * E, attn_norm, E, eps);
                ref_matvec(z, wgate, xb, VD, E);
                ref_matvec(bb, wbeta, xb, NV, E);
                ref_matvec(aa, walpha, xb, NV, E);
                double cv[4096];
                for (int c = 0; c < C; c++) {
                    double s = 0;
                    for (int i = 0; i < KC; i++) {
                        int tt = t - (KC - 1) + i;
                        if (tt >= 0) s += qkv[(size_t)tt * C + c] * conv[(size_t)c * KC + i];
                    }
                    cv[c] = ref_silu(s);
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
                    double a = aa[h] + dt[h];
                    double sp = a > 20 ? a : log1p(exp(a));
                    double decay = exp(sp * ssm_a[h]), beta = ref_sigm(bb[h]);
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
                    ref_rms(att + h * SV, o, ssm_norm, SV, eps);
                    for (int j = 0; j < SV; j++) att[h * SV + j] *= ref_silu(z[h * SV + j]);
                }
                ref_matvec(out + (size_t)t * E, ssm_out, att, E, VD);
            }
            for (size_t i = 0; i < (size_t)n * E; i++) x[i] += out[i];
            free(out);
        } else { /* gated full attention */
            const float *wq = ref_f32(rm, (int64_t)2 * H * HD * E, "blk.%d.attn_q.weight", il);
            const float *wk = ref_f32(rm, (int64_t)HKV * HD * E, "blk.%d.attn_k.weight", il);
            const float *wv = ref_f32(rm, (int64_t)HKV * HD * E, "blk.%d.attn_v.weight", il);
            const float *wo = ref_f32(rm, (int64_t)E * H * HD, "blk.%d.attn_output.weight", il);
            const float *q_norm = ref_f32(rm, HD, "blk.%d.attn_q_norm.weight", il);
            const float *k_norm = ref_f32(rm, HD, "blk.%d.attn_k_norm.weight", il);
            double *out = calloc((size_t)n * E, sizeof *out);
            for (int t = 0; t < n; t++) {
                ref_rms(xb, x + (size_t)t * E, attn_norm, E, eps);
                ref_matvec(qg + (size_t)t * 2 * H * HD, wq, xb, 2 * H * HD, E);
                ref_matvec(kc + (size_t)t * HKV * HD, wk, xb, HKV * HD, E);
                ref_matvec(vc + (size_t)t * HKV * HD, wv, xb, HKV * HD, E);
            }
            /* norms and IMROPE: pair i of n_rot/2, sector i % sum, component by the interleave */
            const int sd = sec[0] + sec[1] + sec[2] + sec[3];
            for (int t = 0; t < n; t++) {
                const double pos[4] = {t, t, t, 0};
                for (int h = 0; h < H + HKV; h++) {
                    double *v = h < H ? qg + (size_t)t * 2 * H * HD + (size_t)h * 2 * HD : kc + (size_t)t * HKV * HD + (size_t)(h - H) * HD;
                    double tmpv[1024];
                    ref_rms(tmpv, v, h < H ? q_norm : k_norm, HD, eps);
                    for (int i = 0; i < R / 2; i++) {
                        int s = i % sd, c = 3;
                        if (s % 3 == 1 && s < 3 * sec[1]) c = 1;
                        else if (s % 3 == 2 && s < 3 * sec[2]) c = 2;
                        else if (s % 3 == 0 && s < 3 * sec[0]) c = 0;
                        double th = pos[c] * pow(base, -2.0 * i / R);
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
                        att[h * HD + i] = o * ref_sigm(q[HD + i]);
                    }
                }
                ref_matvec(out + (size_t)t * E, wo, att, E, H * HD);
            }
            for (size_t i = 0; i < (size_t)n * E; i++) x[i] += out[i];
            free(out);
        }
        /* post-attention norm, routed + shared experts */
        const float *post_norm = ref_f32(rm, E, "blk.%d.post_attention_norm.weight", il);
        const float *router = ref_f32(rm, (int64_t)X * E, "blk.%d.ffn_gate_inp.weight", il);
        const float *gate_exps = ref_f32(rm, (int64_t)X * FF * E, "blk.%d.ffn_gate_exps.weight", il);
        const float *up_exps = ref_f32(rm, (int64_t)X * FF * E, "blk.%d.ffn_up_exps.weight", il);
        const float *down_exps = ref_f32(rm, (int64_t)X * E * FF, "blk.%d.ffn_down_exps.weight", il);
        const float *gate_sh = ref_f32(rm, (int64_t)S * E, "blk.%d.ffn_gate_shexp.weight", il);
        const float *up_sh = ref_f32(rm, (int64_t)S * E, "blk.%d.ffn_up_shexp.weight", il);
        const float *down_sh = ref_f32(rm, (int64_t)E * S, "blk.%d.ffn_down_shexp.weight", il);
        const float *gate_inp_sh = ref_f32(rm, E, "blk.%d.ffn_gate_inp_shexp.weight", il);
        for (int t = 0; t < n; t++) {
            double *xt = x + (size_t)t * E;
            ref_rms(xb, xt, post_norm, E, eps);
            ref_matvec(pr, router, xb, X, E);
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
                ref_matvec(g, gate_exps + (size_t)e * FF * E, xb, FF, E);
                ref_matvec(u, up_exps + (size_t)e * FF * E, xb, FF, E);
                for (int i = 0; i < FF; i++) g[i] = ref_silu(g[i]) * u[i];
                ref_matvec(tmp, down_exps + (size_t)e * E * FF, g, E, FF);
                for (int i = 0; i < E; i++) acc[i] += pr[e] / wsum * tmp[i];
            }
            ref_matvec(g, gate_sh, xb, S, E);
            ref_matvec(u, up_sh, xb, S, E);
            for (int i = 0; i < S; i++) g[i] = ref_silu(g[i]) * u[i];
            ref_matvec(tmp, down_sh, g, E, S);
            double gs;
            ref_matvec(&gs, gate_inp_sh, xb, 1, E);
            for (int i = 0; i < E; i++) xt[i] += acc[i] + tmp[i] * ref_sigm(gs);
        }
    }
    const float *on = ref_f32(rm, E, "output_norm.weight");
    const float *ow = ref_has(rm, "output.weight") ? ref_f32(rm, (int64_t)V * E, "output.weight") : te;
    ref_rms(xb, x + (size_t)(n - 1) * E, on, E, eps);
    ref_matvec(logits, ow, xb, V, E);
    free(x); free(xb); free(qkv); free(tmp); free(kc); free(vc); free(qg); free(att); free(st); free(z);
    free(pr); free(g); free(u); free(acc); free(sc); free(bb); free(aa);
}

static char g_dir[] = "/tmp/kvasir-test-q35-XXXXXX", g_path[128];
static kv_model *g_m;
enum { N = 11 };
static const int32_t toks[N] = {17, 300, 5, 599, 42, 42, 7, 123, 256, 3, 77};
static float *g_a; /* our logits after each token, token by token on 1 thread */
static int V;

static int setup(void) {
    if (!mkdtemp(g_dir)) return 1;
    snprintf(g_path, sizeof g_path, "%s/m.gguf", g_dir);
    kv_gen_config c = {.arch = "qwen35moe", .n_layer = 4, .n_embd = 128, .n_ff_exp = 64, .n_expert = 8,
                       .n_expert_used = 2, .n_head = 4, .n_head_kv = 2, .head_dim = 32, .n_vocab = 600,
                       .n_ctx = 256, .type = 0 /* KV_TYPE_F32 */, .seed = 5, .full_attn_interval = 2,
                       .ssm_d_state = 16, .ssm_n_group = 2, .ssm_dt_rank = 6, .n_rot = 12,
                       .rope_sections = {2, 1, 2, 1}, .n_nextn = 1, .n_ff_shexp = 48, .n_threads = 1};
    if (ref_gen_load(&c, g_path, &g_m)) return 1;
    V = (int)kv_model_hparams(g_m)->n_vocab;
    g_a = ref_ours(g_m, toks, N, 1, 0, KV_TYPE_F32);
    return 0;
}

static void teardown(void) { ref_gen_close(g_a, g_m, g_path, g_dir); }

static void test_loaded(void) {
    const kv_hparams *hp = kv_model_hparams(g_m);
    ASSERT_EQ(hp->arch, KV_ARCH_QWEN35MOE);
    ASSERT_EQ(hp->n_layer, 4);
    ASSERT_EQ(hp->n_layer_nextn, 1);
    ASSERT_TRUE(kv_model_layer(g_m, 0)->recurrent && !kv_model_layer(g_m, 1)->recurrent);
    ASSERT_TRUE(kv_model_layer(g_m, 4)->nextn_eh_proj.data != NULL); /* MTP loaded */
}

/* f64 reference at several prefix lengths (positions cross the conv window
 * and attention layers) */
static void test_f64_reference(void) {
    double worst = ref_max_dlogit(g_path, ref_forward, toks, N, 3, g_a, V);
    printf("f32 qwen35moe vs f64 reference: max |dlogit| = %.3g\n", worst);
    ASSERT_TRUE(worst < 2e-4);
}

/* bit-identity: threads, token-by-token vs chunked prefill (chunks of 4) */
static void test_bit_identity(void) {
    float *b = ref_ours(g_m, toks, N, 2, 4, KV_TYPE_F32), *cc = ref_ours(g_m, toks, N, 2, 0, KV_TYPE_F32);
    ASSERT_TRUE(memcmp(g_a, cc, (size_t)N * V * sizeof *g_a) == 0);
    ASSERT_TRUE(memcmp(g_a, b, (size_t)N * V * sizeof *g_a) == 0);
    free(b);
    free(cc);
}

/* several sequences decoded together == each alone; a reset sequence starts over */
static void test_multi_seq(void) {
    const float *a = g_a;
    kv_diag d = {0};
    kv_pool *pool = NULL;
    kv_state *s = NULL;
    kv_state_opts o = {.n_ctx = 64, .n_seq = 3};
    ASSERT_EQ(kv_pool_new(&pool, 2, &d), 0);
    ASSERT_EQ(kv_state_new(&s, g_m, pool, &o, &d), 0);
    if (!s) { kv_pool_free(pool); return; }
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

/* The prompt with every token's logits (nothing dropped) against the logits
 * of tokens N-1, 2, 2 (the other tokens leave the last block after its
 * cache writes), and with none: the wanted rows and a decode step after
 * them are the same bits. */
static void dropped_on(const kv_model *m, const char *what) {
    const uint32_t Vm = kv_model_hparams(m)->n_vocab;
    kv_diag d = {0};
    kv_pool *pool = NULL;
    kv_state *s = NULL;
    kv_state_opts o = {.n_ctx = 64, .n_seq = 3};
    if (kv_pool_new(&pool, 2, &d) || kv_state_new(&s, m, pool, &o, &d)) {
        KVT_FAIL("%s: state: %s", what, d.msg);
        kv_pool_free(pool);
        return;
    }
    uint32_t all[N], sq[3][N];
    for (uint32_t i = 0; i < N; i++) all[i] = i, sq[0][i] = 0, sq[1][i] = 1, sq[2][i] = 2;
    float *full = calloc((size_t)N * Vm, sizeof *full), *part = calloc((size_t)3 * Vm, sizeof *part);
    float *step = calloc((size_t)3 * Vm, sizeof *step);
    const uint32_t some[3] = {N - 1, 2, 2};
    ASSERT_EQ(kv_state_batch(s, toks, sq[0], N, all, N, full, &d), 0);
    ASSERT_TRUE(!kv_state_dropped_rows(s));
    ASSERT_EQ(kv_state_batch(s, toks, sq[1], N, some, 3, part, &d), 0);
    ASSERT_TRUE(kv_state_dropped_rows(s));
    ASSERT_EQ(kv_state_batch(s, toks, sq[2], N, NULL, 0, NULL, &d), 0);
    ASSERT_TRUE(kv_state_dropped_rows(s));
    const size_t b = Vm * sizeof(float);
    ASSERT_TRUE(!memcmp(part, full + (size_t)(N - 1) * Vm, b));
    ASSERT_TRUE(!memcmp(part + Vm, full + (size_t)2 * Vm, b) && !memcmp(part + 2 * Vm, full + (size_t)2 * Vm, b));
    const int32_t tk[3] = {42, 42, 42};
    const uint32_t seqs[3] = {0, 1, 2};
    ASSERT_EQ(kv_state_decode(s, tk, seqs, 3, step, &d), 0);
    ASSERT_TRUE(!memcmp(step, step + Vm, b) && !memcmp(step, step + 2 * Vm, b));
    printf("%s: the last block on the wanted rows only: same bits\n", what);
    free(full);
    free(part);
    free(step);
    kv_state_free(s);
    kv_pool_free(pool);
}

static void test_dropped_rows(void) {
    ASSERT_TRUE(!kv_model_layer(g_m, 3)->recurrent);
    dropped_on(g_m, "last block full attention");
    /* 3 blocks: the last (2) a delta-net block */
    char path[160];
    snprintf(path, sizeof path, "%s/m3.gguf", g_dir);
    kv_gen_config c = {.arch = "qwen35moe", .n_layer = 3, .n_embd = 128, .n_ff_exp = 64, .n_expert = 8,
                       .n_expert_used = 2, .n_head = 4, .n_head_kv = 2, .head_dim = 32, .n_vocab = 600,
                       .n_ctx = 256, .type = 0 /* KV_TYPE_F32 */, .seed = 6, .full_attn_interval = 2,
                       .ssm_d_state = 16, .ssm_n_group = 2, .ssm_dt_rank = 6, .n_rot = 12,
                       .rope_sections = {2, 1, 2, 1}, .n_ff_shexp = 48, .n_threads = 1};
    kv_gen_fill_defaults(&c);
    kv_diag d = {0};
    kv_model *m3 = NULL;
    if (kv_gen_model(&c, path, &d) || kv_model_load(&m3, path, &d)) {
        KVT_FAIL("3-block model: %s", d.msg);
        unlink(path);
        return;
    }
    ASSERT_TRUE(kv_model_layer(m3, 2)->recurrent);
    dropped_on(m3, "last block delta net");
    /* chunked prefill (rows dropped) against token by token (none) */
    float *a = ref_ours(m3, toks, N, 1, 0, KV_TYPE_F32), *cb = ref_ours(m3, toks, N, 2, 4, KV_TYPE_F32);
    ASSERT_TRUE(!memcmp(a, cb, (size_t)N * kv_model_hparams(m3)->n_vocab * sizeof *a));
    free(a);
    free(cb);
    kv_model_free(m3);
    unlink(path);
}

static const kvt_case cases[] = {KVT_CASE(test_loaded), KVT_CASE(test_f64_reference),
                                 KVT_CASE(test_bit_identity), KVT_CASE(test_multi_seq),
                                 KVT_CASE(test_dropped_rows)};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
