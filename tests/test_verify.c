/* kv-test-labels: unit
 * Freivalds checks (include/kvasir/verify.h) against the engine's own
 * expert kernels on generated F32, Q8_0 and Q4_K models. The reference for
 * the projections is f64 over the dequantized weights; the answers checked
 * are the in-process provider's (kv_expert_local_compute_pre, the worker's
 * path), whose outputs equal kv_expert_compute_one bit for bit. Cases:
 *   honest answers all pass (the worst residual / tolerance is printed);
 *   the tolerance's edge: a gate, up or output element moved by 2x the
 *     tolerance is caught, by half of what the honest residual leaves is
 *     not (so the tolerance is what the docs say, on both sides);
 *   another expert's answer, a stale answer (another token's), a NaN: caught;
 *   the worst-case bound passes honest answers and is far blinder;
 *   cost of a check against the compute it checks, and the smallest
 *     detectable change of one output element, by type (docs/BENCHMARKS.md). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "kvasir/gguf.h"
#include "kvasir/model.h"
#include "kvasir/pool.h"
#include "kvasir/slice.h"
#include "kvasir/verify.h"
#include "kvtest.h"

#define N_EMBD 256
#define N_FF 512
#define N_EXPERT 4
#define N_TOK 48

static char g_dir[64];
static const char *g_types[3] = {"f32", "q8_0", "q4_k"};
static kv_gguf *g_g[3];
static kv_pool *g_pool;

static int acquire(void *ctx, uint32_t layer, uint32_t e, kv_expert_weights *w, kv_diag *d) {
    uint32_t E, F;
    return kv_expert_find(ctx, layer, e, w, &E, &F, d);
}

static uint32_t g_seed = 11;
static float frand(void) {
    g_seed = g_seed * 1664525u + 1013904223u;
    return ((float)(g_seed >> 8) / 16777216.0f - 0.5f) * 4.0f;
}

typedef struct answers {
    float x[N_TOK][N_EMBD];
    int32_t ids[N_TOK];
    float y[N_TOK][N_EMBD], g[N_TOK][N_FF], u[N_TOK][N_FF];
} answers;

/* Every token with expert t % N_EXPERT, through the worker's path. */
static void compute(int k, answers *a, kv_expert_provider *p) {
    kv_diag d = {0};
    for (int t = 0; t < N_TOK; t++) {
        for (int i = 0; i < N_EMBD; i++) a->x[t][i] = frand();
        a->ids[t] = t % N_EXPERT;
    }
    const kv_expert_req req = {0, N_TOK, N_EMBD, 1, &a->x[0][0], a->ids, NULL};
    ASSERT_EQ(kv_expert_local_compute_pre(p, &req, &a->y[0][0], &a->g[0][0], &a->u[0][0], &d), 0);
    /* the same bits as the engine's one-expert path */
    int bad = 0;
    for (int t = 0; t < N_TOK; t += 7) {
        kv_expert_weights w;
        float y1[N_EMBD];
        ASSERT_EQ(acquire(g_g[k], 0, (uint32_t)a->ids[t], &w, &d), 0);
        ASSERT_EQ(kv_expert_compute_one(&w, N_EMBD, N_FF, NULL, a->x[t], 1, y1, &d), 0);
        bad += memcmp(y1, a->y[t], sizeof y1) != 0;
    }
    ASSERT_EQ(bad, 0);
}

static kv_verify *prepared(int k, const kv_verify_opts *o) {
    kv_verify *v = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_verify_new(&v, 1, N_EXPERT, N_EMBD, N_FF, o, &d), 0);
    for (uint32_t e = 0; e < N_EXPERT && v; e++) {
        kv_expert_weights w;
        ASSERT_EQ(acquire(g_g[k], 0, e, &w, &d), 0);
        ASSERT_EQ(kv_verify_prepare(v, 0, e, &w, &d), 0);
        ASSERT_EQ(kv_verify_prepare(v, 0, e, &w, &d), 0); /* idempotent */
    }
    if (v)
        ASSERT_EQ(kv_verify_bytes(v),
                  N_EXPERT * kv_verify_expert_bytes(N_EMBD, N_FF, o && o->n_proj ? o->n_proj : KV_VERIFY_DEFAULT_PROJ));
    return v;
}

/* The tolerance of stage `stage` for token t: from a large corruption's report
 * (the tolerance depends on the input only, not on the value checked). */
static double tol_of(kv_verify *v, answers *a, int t, int stage) {
    float g[N_FF], u[N_FF], y[N_EMBD];
    memcpy(g, a->g[t], sizeof g);
    memcpy(u, a->u[t], sizeof u);
    memcpy(y, a->y[t], sizeof y);
    float *tgt = stage == 0 ? g : stage == 1 ? u : y;
    tgt[3] += 1e6f;
    kv_verify_report rep;
    kv_diag d = {0};
    ASSERT_EQ(kv_verify_check(v, 0, (uint32_t)a->ids[t], a->x[t], g, u, y, &rep, &d), KV_EPROTO);
    ASSERT_EQ(rep.stage, stage);
    return rep.tol;
}

static int check_moved(kv_verify *v, answers *a, int t, int stage, int idx, double delta, kv_verify_report *rep) {
    float g[N_FF], u[N_FF], y[N_EMBD];
    memcpy(g, a->g[t], sizeof g);
    memcpy(u, a->u[t], sizeof u);
    memcpy(y, a->y[t], sizeof y);
    float *tgt = stage == 0 ? g : stage == 1 ? u : y;
    tgt[idx] = (float)((double)tgt[idx] + delta);
    kv_diag d = {0};
    return kv_verify_check(v, 0, (uint32_t)a->ids[t], a->x[t], g, u, y, rep, &d);
}

static void test_types(void) {
    static answers A;
    for (int k = 0; k < 3; k++) {
        kv_diag d = {0};
        kv_expert_source src = {g_g[k], acquire, NULL, 1, N_EXPERT, N_EMBD, N_FF, 1};
        kv_expert_provider p;
        ASSERT_EQ(kv_expert_local_new_src(&p, &src, g_pool, N_TOK, &d), 0);
        compute(k, &A, &p);
        const kv_verify_opts o = {.seed = 1234};
        kv_verify *v = prepared(k, &o);
        if (!v) return;
        /* honest: all pass */
        double worst = 0;
        int fails = 0;
        for (int t = 0; t < N_TOK; t++) {
            kv_verify_report rep;
            fails += kv_verify_check(v, 0, (uint32_t)A.ids[t], A.x[t], A.g[t], A.u[t], A.y[t], &rep, &d) != 0;
            if (rep.worst_ratio > worst) worst = rep.worst_ratio;
        }
        ASSERT_EQ(fails, 0);
        /* the edge, on every stage, for a few tokens. Moving one element by delta moves
         * projection p by r_p,i delta, r Gaussian: theta x the tolerance is caught unless all
         * n_proj |r_p,i| < 1 / theta (probability kv_verify_miss_bound, < 2^-20); a move below
         * (1 - the honest residual) x tolerance / 8 passes unless some |r_p,i| > 8 (1e-15) */
        int edge_bad = 0;
        double rel_min = 1e30;
        for (int t = 0; t < N_TOK; t += 5) {
            kv_verify_report hr;
            kv_verify_check(v, 0, (uint32_t)A.ids[t], A.x[t], A.g[t], A.u[t], A.y[t], &hr, &d);
            for (int stage = 0; stage < 3; stage++) {
                const double T = tol_of(v, &A, t, stage);
                const int idx = (t * 13 + stage) % (stage == 2 ? N_EMBD : N_FF);
                kv_verify_report rep;
                if (check_moved(v, &A, t, stage, idx, KV_VERIFY_THETA * T, &rep) != KV_EPROTO || rep.stage != stage)
                    edge_bad++;
                if (check_moved(v, &A, t, stage, idx, -KV_VERIFY_THETA * T, &rep) != KV_EPROTO) edge_bad++;
                /* below the edge: that stage passes (a moved gate or up element may still be
                 * caught by the down check, whose input it changes: the worker used another h) */
                const int rc = check_moved(v, &A, t, stage, idx, T * (1.0 - hr.worst_ratio) / 8, &rep);
                if (rc != 0 && !(stage < 2 && rep.stage == 2)) edge_bad++;
                if (stage == 2) {
                    double ymax = 0;
                    for (int i = 0; i < N_EMBD; i++) ymax = fmax(ymax, fabs(A.y[t][i]));
                    rel_min = fmin(rel_min, KV_VERIFY_THETA * T / ymax);
                }
            }
        }
        ASSERT_EQ(edge_bad, 0);
        /* another expert's answer; a stale one (another token's); a NaN */
        int missed = 0;
        for (int t = 0; t + N_EXPERT < N_TOK; t++) {
            const int o2 = t + 1; /* expert ids[t] + 1 on token t + 1 */
            const uint32_t e = (uint32_t)A.ids[t];
            missed += kv_verify_check(v, 0, e, A.x[t], A.g[o2], A.u[o2], A.y[o2], NULL, &d) != KV_EPROTO;
            const int same = t + N_EXPERT; /* the same expert, another token: a stale answer */
            missed += kv_verify_check(v, 0, e, A.x[t], A.g[same], A.u[same], A.y[same], NULL, &d) != KV_EPROTO;
        }
        ASSERT_EQ(missed, 0);
        float gn[N_FF];
        memcpy(gn, A.g[0], sizeof gn);
        gn[5] = NAN;
        ASSERT_EQ(kv_verify_check(v, 0, (uint32_t)A.ids[0], A.x[0], gn, A.u[0], A.y[0], NULL, &d), KV_EPROTO);
        ASSERT_TRUE(strstr(d.msg, "not finite") != NULL);
        ASSERT_EQ(kv_verify_check(v, 0, 9, A.x[0], A.g[0], A.u[0], A.y[0], NULL, &d), KV_ENOTFOUND);
        /* the worst-case bound: honest answers pass; how much blinder it is */
        const kv_verify_opts ow = {.seed = 1234, .worst_case = true};
        kv_verify *vw = prepared(k, &ow);
        int wf = 0;
        for (int t = 0; t < N_TOK && vw; t++)
            wf += kv_verify_check(vw, 0, (uint32_t)A.ids[t], A.x[t], A.g[t], A.u[t], A.y[t], NULL, &d) != 0;
        if (k != 2) ASSERT_EQ(wf, 0); /* rigorous for F32/Q8_0; K-quants: see VERIFY.md */
        const double Tw = vw ? tol_of(vw, &A, 0, 2) : 0, Ts = tol_of(v, &A, 0, 2);
        /* cost: checks against the compute they check */
        struct timespec t0, t1, t2;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (int rep = 0; rep < 4; rep++)
            for (int t = 0; t < N_TOK; t++)
                kv_verify_check(v, 0, (uint32_t)A.ids[t], A.x[t], A.g[t], A.u[t], A.y[t], NULL, &d);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        for (int rep = 0; rep < 4; rep++) {
            const kv_expert_req req = {0, N_TOK, N_EMBD, 1, &A.x[0][0], A.ids, NULL};
            p.compute(p.impl, &req, &A.y[0][0], &d);
        }
        clock_gettime(CLOCK_MONOTONIC, &t2);
        const double tc = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
        const double tx = (t2.tv_sec - t1.tv_sec) + (t2.tv_nsec - t1.tv_nsec) * 1e-9;
        printf("  %-5s honest worst residual/tolerance %.3f; smallest output change caught (p > 1 - 2^-20) %.2e of "
               "max|y|; worst-case bound %.0fx wider%s; check/compute time %.3f (embd %d, ff %d, %u projections, "
               "loaded machine)\n",
               g_types[k], worst, rel_min, Tw / Ts, wf ? " (and it flags honest K-quant answers)" : "", tc / tx, N_EMBD,
               N_FF, KV_VERIFY_DEFAULT_PROJ);
        kv_verify_free(vw);
        kv_verify_free(v);
        p.free(p.impl);
    }
}

static void test_bad_args(void) {
    kv_verify *v = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_verify_new(&v, 0, 1, 16, 16, NULL, &d), KV_EINVAL);
    const kv_verify_opts o = {.n_proj = KV_VERIFY_MAX_PROJ + 1};
    ASSERT_EQ(kv_verify_new(&v, 1, 1, 16, 16, &o, &d), KV_EINVAL);
    ASSERT_TRUE(v == NULL);
    ASSERT_EQ(kv_verify_new(&v, 1, 2, 256, 256, NULL, &d), 0);
    kv_expert_weights w = {0};
    ASSERT_EQ(kv_verify_prepare(v, 3, 0, &w, &d), KV_ERANGE);
    ASSERT_TRUE(!kv_verify_ready(v, 0, 0) && kv_verify_bytes(v) == 0);
    /* 122B scale: 12,544 experts of 3072 x 1024 (printed for docs/BENCHMARKS.md) */
    printf("  projections at 122B scale (12544 experts, embd 3072, ff 1024): %.2f GB with 2 vectors, %.2f GB with 1\n",
           12544.0 * kv_verify_expert_bytes(3072, 1024, 2) / 1e9, 12544.0 * kv_verify_expert_bytes(3072, 1024, 1) / 1e9);
    kv_verify_free(v);
    kv_verify_free(NULL);
}

static int setup(void) {
    const char *bin = getenv("KV_BIN");
    if (!bin) return 1;
    snprintf(g_dir, sizeof g_dir, "/tmp/kv_verify_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    for (int k = 0; k < 3; k++) {
        char cmd[1024], path[256];
        snprintf(path, sizeof path, "%s/%s.gguf", g_dir, g_types[k]);
        snprintf(cmd, sizeof cmd, "%s gen-model --arch qwen3moe --out %s --layers 1 --embd %d --ff-exp %d --experts %d "
                 "--experts-used 2 --vocab 300 --type %s --seed 5 >/dev/null 2>&1", bin, path, N_EMBD, N_FF, N_EXPERT,
                 g_types[k]);
        int rc = system(cmd);
        if (!WIFEXITED(rc) || WEXITSTATUS(rc)) return 1;
        kv_diag d = {0};
        if (kv_gguf_open(&g_g[k], path, &d)) return 1;
    }
    kv_diag d = {0};
    return kv_pool_new(&g_pool, 2, &d) ? 1 : 0;
}

static void teardown(void) {
    for (int k = 0; k < 3; k++) kv_gguf_close(g_g[k]);
    kv_pool_free(g_pool);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (system(cmd)) {
    }
}

static const kvt_case cases[] = {KVT_CASE(test_types), KVT_CASE(test_bad_args)};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
