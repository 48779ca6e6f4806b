/* kv-test-labels: unit attack
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
 *     detectable change of one output element, by type (docs/BENCHMARKS.md);
 *   structured lies (test_attack): pairs +a/-a (the lie the sign vectors let
 *     through 1 time in 4), one element, sign patterns, scaled and borrowed
 *     answers, each from just above theta x the tolerance to 5 max|y|, on
 *     every stage: none passes, and each vector alone passes about as often
 *     as the Gaussian bound says; an attacker who learned a generation's
 *     vectors aims lies at their blind spot (orthogonal to all of them, or
 *     on the rows they weigh least): they pass that generation, and the
 *     next one catches every one. KV_ATTACK_FULL=1: 25x more lies;
 *   honest answers from every backend this CPU has, checked under every
 *     backend (our kernels give the same bits; the test keeps that honest),
 *     and honest answers summed in other orders (f32 front to back, f64),
 *     as another engine or a GPU would: all pass;
 *   the check's kernels (quant/vdot.h) of every backend this CPU has against
 *     the scalar reference: projections within the f64 rounding bound of
 *     any summation order, Q8 quantization and dequantization, finiteness,
 *     SwiGLU and the rows of s bit for bit (KV_REQUIRE_BACKENDS=avx2,avx512 or neon fails a skipped one);
 *   kv_verify_check_batch against one kv_verify_check per answer: the same
 *     verdicts, failing index, stage, tolerance and generations;
 *   experts with gate Q8_0 and up Q4_K (two activation types): honest
 *     answers pass, gate and up lies caught by their own stage;
 *   kv_verify_supported accepts every type the engine computes, refuses
 *     one it cannot read naming the tensor and type; the bytes held count
 *     Q4_1/Q5_1's projected block mins. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "kvasir/gguf.h"
#include "kvasir/model.h"
#include "kvasir/ops.h"
#include "kvasir/pool.h"
#include "kvasir/slice.h"
#include "kvasir/quant.h"
#include "kvasir/verify.h"
#include "kvtest.h"
#include "quant/vdot.h"
#include "verify/verify_internal.h"

#define N_EMBD 256
#define N_FF 512
#define N_EXPERT 4
#define N_TOK 48

static char g_dir[64];
#ifndef KV_TEST_VERIFY_TYPES /* tests/test_verify_legacy.c runs this file on other types */
#define KV_TEST_VERIFY_TYPES {"f32", "q8_0", "q4_k"}
#endif
static const char *g_types[3] = KV_TEST_VERIFY_TYPES;
#ifndef KV_TEST_VERIFY_ARCH /* tests/test_verify_gptoss.c: gpt-oss's biased, clamped experts */
#define KV_TEST_VERIFY_ARCH "--arch qwen3moe"
#endif
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
    kv_expert_weights w = {0};
    for (uint32_t e = 0; e < N_EXPERT && v; e++) {
        ASSERT_EQ(acquire(g_g[k], 0, e, &w, &d), 0);
        ASSERT_EQ(kv_verify_supported(&w, 0, N_EMBD, N_FF, &d), 0);
        ASSERT_EQ(kv_verify_prepare(v, 0, e, &w, &d), 0);
        ASSERT_EQ(kv_verify_prepare(v, 0, e, &w, &d), 0); /* idempotent */
    }
    if (v) {
        /* what is held: vectors, projections, statistics, and with Q8_1 activations (Q4_1, Q5_1) one
         * f64 per block of 32 columns per vector per matrix (the projected mins) */
        const size_t P = o && o->n_proj ? o->n_proj : KV_VERIFY_DEFAULT_PROJ;
        const bool q81 = kv_type_get(w.gate_type)->vec_dot_type == KV_TYPE_Q8_1;
        const size_t extra = q81 ? P * (2 * (N_EMBD / 32) + N_FF / 32) * sizeof(double) : 0;
        ASSERT_EQ(kv_verify_bytes(v), N_EXPERT * (kv_verify_expert_bytes(N_EMBD, N_FF, (uint32_t)P) + extra));
        ASSERT_EQ(kv_verify_weights_bytes(&w, N_EMBD, N_FF, (uint32_t)P),
                  kv_verify_expert_bytes(N_EMBD, N_FF, (uint32_t)P) + extra);
    }
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


/* ---- structured lies ------------------------------------------------------------------- */

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd64(void) {
    g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
    return g_rng;
}
static double runif(void) { return (double)(rnd64() >> 11) * (1.0 / 9007199254740992.0); }
static double rnorm(void) { return sqrt(-2.0 * log(1.0 - runif())) * cos(6.283185307179586 * runif()); }

enum { LIE_PAIR, LIE_PAIR_ADJ, LIE_ONE, LIE_SIGNS, LIE_ALTERNATE, LIE_HALVES, LIE_SCALE, LIE_BORROW, LIE_RANDOM,
       LIE_COUNT };
static const char *const lie_names[LIE_COUNT] = {"pair +a/-a", "adjacent pair", "one element", "signs on k rows",
                                                 "alternating signs", "+a/-a halves", "scaled answer",
                                                 "another token's answer", "random direction"};

/* A lie of class c on a stage's output o [L] (t: the token; A: every answer), as a
 * direction e [L] of any norm. */
static void lie_shape(int c, const answers *A, int t, int stage, const float *o, int L, double *e) {
    memset(e, 0, (size_t)L * sizeof *e);
    const int i = (int)(rnd64() % (uint64_t)L), j = (i + 1 + (int)(rnd64() % (uint64_t)(L - 1))) % L;
    switch (c) {
    case LIE_PAIR: e[i] = 1, e[j] = -1; break;
    case LIE_PAIR_ADJ: e[i] = 1, e[(i + 1) % L] = -1; break;
    case LIE_ONE: e[i] = rnd64() & 1 ? 1 : -1; break;
    case LIE_SIGNS: {
        const int k = 2 + (int)(rnd64() % (uint64_t)(L - 1));
        for (int n = 0; n < k; n++) e[rnd64() % (uint64_t)L] = rnd64() & 1 ? 1 : -1;
        break;
    }
    case LIE_ALTERNATE:
        for (int n = 0; n < L; n++) e[n] = n & 1 ? -1 : 1;
        break;
    case LIE_HALVES:
        for (int n = 0; n < L; n++) e[n] = n < L / 2 ? 1 : -1;
        break;
    case LIE_SCALE:
        for (int n = 0; n < L; n++) e[n] = o[n];
        break;
    case LIE_BORROW: { /* the answer of another token for the same expert */
        const int t2 = (t + N_EXPERT * (1 + (int)(rnd64() % (N_TOK / N_EXPERT - 1)))) % N_TOK;
        const float *o2 = stage == 0 ? A->g[t2] : stage == 1 ? A->u[t2] : A->y[t2];
        for (int n = 0; n < L; n++) e[n] = (double)o2[n] - o[n];
        break;
    }
    default:
        for (int n = 0; n < L; n++) e[n] = rnorm();
    }
}

/* Checks answer t with e (scaled to norm nrm) added to stage's output. */
static int check_lie(kv_verify *v, const answers *A, int t, int stage, const double *e, double nrm,
                     kv_verify_report *rep) {
    static float g[N_FF], u[N_FF], y[N_EMBD];
    memcpy(g, A->g[t], sizeof g);
    memcpy(u, A->u[t], sizeof u);
    memcpy(y, A->y[t], sizeof y);
    float *o = stage == 0 ? g : stage == 1 ? u : y;
    const int L = stage == 2 ? N_EMBD : N_FF;
    double n2 = 0;
    for (int i = 0; i < L; i++) n2 += e[i] * e[i];
    const double f = nrm / sqrt(n2);
    for (int i = 0; i < L; i++) o[i] = (float)((double)o[i] + f * e[i]);
    kv_diag d = {0};
    return kv_verify_check(v, 0, (uint32_t)A->ids[t], A->x[t], g, u, y, rep, &d);
}

/* An attacker who knows generation G's vectors of (expert, stage): a lie in their blind
 * spot. blind = 0: orthogonal to all of them (a random direction, Gram-Schmidt);
 * blind = 1: on the n_proj + 1 rows they weigh least (sum_p r_p,i^2), in the null
 * space of those columns, so it passes G exactly. */
static void blind_lie(kv_verify *v, uint32_t e_id, int stage, int blind, double *e, uint64_t *gen) {
    const uint32_t P = KV_VERIFY_DEFAULT_PROJ;
    const int L = stage == 2 ? N_EMBD : N_FF;
    static float R[KV_VERIFY_MAX_PROJ][N_FF > N_EMBD ? N_FF : N_EMBD];
    for (uint32_t p = 0; p < P; p++) ASSERT_EQ(kv_verify_peek(v, 0, e_id, stage, p, R[p], gen), 0);
    if (blind == 0) {
        for (int i = 0; i < L; i++) e[i] = rnorm();
        static double Q[KV_VERIFY_MAX_PROJ][N_FF > N_EMBD ? N_FF : N_EMBD];
        for (uint32_t p = 0; p < P; p++) { /* an orthonormal basis of the span, then project it out */
            for (int i = 0; i < L; i++) Q[p][i] = R[p][i];
            for (uint32_t q = 0; q < p; q++) {
                double dq = 0;
                for (int i = 0; i < L; i++) dq += Q[q][i] * Q[p][i];
                for (int i = 0; i < L; i++) Q[p][i] -= dq * Q[q][i];
            }
            double n2 = 0;
            for (int i = 0; i < L; i++) n2 += Q[p][i] * Q[p][i];
            for (int i = 0; i < L; i++) Q[p][i] /= sqrt(n2);
        }
        for (int pass = 0; pass < 2; pass++)
            for (uint32_t p = 0; p < P; p++) {
                double dq = 0;
                for (int i = 0; i < L; i++) dq += Q[p][i] * e[i];
                for (int i = 0; i < L; i++) e[i] -= dq * Q[p][i];
            }
        return;
    }
    /* the P + 1 least weighted rows */
    int rows[KV_VERIFY_MAX_PROJ + 1];
    double wt[KV_VERIFY_MAX_PROJ + 1];
    const int K = (int)P + 1;
    for (int k = 0; k < K; k++) wt[k] = INFINITY, rows[k] = -1;
    for (int i = 0; i < L; i++) {
        double w = 0;
        for (uint32_t p = 0; p < P; p++) w += (double)R[p][i] * R[p][i];
        for (int k = 0; k < K; k++)
            if (w < wt[k]) {
                for (int m = K - 1; m > k; m--) wt[m] = wt[m - 1], rows[m] = rows[m - 1];
                wt[k] = w, rows[k] = i;
                break;
            }
    }
    /* null vector of the P x (P + 1) matrix M[p][k] = R[p][rows[k]]: Gaussian elimination */
    double M[KV_VERIFY_MAX_PROJ][KV_VERIFY_MAX_PROJ + 1];
    for (uint32_t p = 0; p < P; p++)
        for (int k = 0; k < K; k++) M[p][k] = R[p][rows[k]];
    for (int c = 0; c < (int)P; c++) {
        int piv = c;
        for (int r = c + 1; r < (int)P; r++)
            if (fabs(M[r][c]) > fabs(M[piv][c])) piv = r;
        for (int k = 0; k < K; k++) {
            const double tmp = M[c][k];
            M[c][k] = M[piv][k], M[piv][k] = tmp;
        }
        for (int r = 0; r < (int)P; r++) {
            if (r == c) continue;
            const double f = M[r][c] / M[c][c];
            for (int k = 0; k < K; k++) M[r][k] -= f * M[c][k];
        }
    }
    memset(e, 0, (size_t)L * sizeof *e);
    e[rows[P]] = 1; /* the free variable; x_c = -M[c][P] / M[c][c] */
    for (int c = 0; c < (int)P; c++) e[rows[c]] = -M[c][P] / M[c][c];
}

static void test_attack(void) {
    const bool full = getenv("KV_ATTACK_FULL") && strcmp(getenv("KV_ATTACK_FULL"), "0");
    const int n_lies = full ? 25000 : 1000, n_blind = full ? 500 : 40; /* per type */
    static const double scales[] = {1.02, 1.2, 2.0, 10.0, 1e3, 0}; /* x theta x tolerance; 0: 5 max|y| */
    const int n_scales = (int)(sizeof scales / sizeof scales[0]);
    static answers A;
    static double e[N_FF > N_EMBD ? N_FF : N_EMBD];
    long passed = 0, tried = 0, blind_before = 0, blind_after = 0, blind_tried = 0;
    long thr_proj = 0, thr_proj_pass = 0, by_class[LIE_COUNT] = {0};
    double bound = 0;
    for (int k = 0; k < 3; k++) {
        kv_diag d = {0};
        kv_expert_source src = {g_g[k], acquire, NULL, 1, N_EXPERT, N_EMBD, N_FF, 1};
        kv_expert_provider p;
        ASSERT_EQ(kv_expert_local_new_src(&p, &src, g_pool, N_TOK, &d), 0);
        compute(k, &A, &p);
        /* one fixed generation: everything the worker does not know is caught */
        const kv_verify_opts o = {.seed = 77 + (uint64_t)k, .rotate_every = UINT32_MAX};
        kv_verify *v = prepared(k, &o);
        for (int q = 0; q < n_lies && v; q++) {
            const int t = (int)(rnd64() % N_TOK), stage = q % 3, c = (q / 3) % LIE_COUNT;
            const double sc = scales[(q / (3 * LIE_COUNT)) % n_scales];
            const int L = stage == 2 ? N_EMBD : N_FF;
            const float *o2 = stage == 0 ? A.g[t] : stage == 1 ? A.u[t] : A.y[t];
            lie_shape(c, &A, t, stage, o2, L, e);
            double nrm;
            if (sc > 0) {
                nrm = sc * KV_VERIFY_THETA * tol_of(v, &A, t, stage);
            } else {
                double mx = 0;
                for (int i = 0; i < L; i++) mx = fmax(mx, fabs(o2[i]));
                nrm = 5 * mx; /* the lie of the report, whatever its shape */
            }
            kv_verify_report rep;
            const int rc = check_lie(v, &A, t, stage, e, nrm, &rep);
            tried++;
            if (rc != KV_EPROTO || rep.stage != stage) {
                passed++;
                by_class[c]++;
                printf("  PASSED: %s lie on stage %d, %.3g x theta x tolerance (%s)\n", lie_names[c], stage, sc,
                       g_types[k]);
            } else if (sc == scales[0] && (c <= LIE_SIGNS || c == LIE_RANDOM)) {
                /* each vector alone, just above the threshold (shapes drawn afresh each time: the
                 * fixed ones repeat one direction per token, so their outcomes are not independent) */
                thr_proj += KV_VERIFY_DEFAULT_PROJ;
                thr_proj_pass += KV_VERIFY_DEFAULT_PROJ - rep.n_over;
            }
        }
        /* an attacker who learned generation G: blind spots of G pass G, G + 1 catches them */
        const kv_verify_opts orot = {.seed = 991 + (uint64_t)k, .rotate_every = 6};
        kv_verify *vr = prepared(k, &orot);
        for (int q = 0; q < n_blind && vr; q++) {
            const int t = (int)(rnd64() % N_TOK), stage = q % 3, blind = (q / 3) % 2;
            const uint32_t eid = (uint32_t)A.ids[t];
            /* line up with a rotation, so that the lie meets the generation it was aimed at */
            const double nrm = (q % 2 ? 10.0 : 1e3) * KV_VERIFY_THETA * tol_of(vr, &A, t, stage);
            kv_verify_report rep;
            uint64_t gen = 0, gen2;
            ASSERT_EQ(kv_verify_check(vr, 0, eid, A.x[t], A.g[t], A.u[t], A.y[t], &rep, &d), 0);
            for (uint64_t g0 = rep.generation, n = 0; rep.generation == g0 && n < 8; n++)
                ASSERT_EQ(kv_verify_check(vr, 0, eid, A.x[t], A.g[t], A.u[t], A.y[t], &rep, &d), 0);
            blind_lie(vr, eid, stage, blind, e, &gen);
            const int rc0 = check_lie(vr, &A, t, stage, e, nrm, &rep);
            /* aimed right: G's vectors of that stage let it through (a gate or up lie is still
             * caught by the down check, whose input it changes) */
            if ((rc0 == 0 || rep.stage > stage) && rep.generation == gen) blind_before++;
            /* honest work until the expert's vectors rotate */
            gen2 = rep.generation;
            for (int n = 0; n < 8 && gen2 == gen; n++) {
                ASSERT_EQ(kv_verify_check(vr, 0, eid, A.x[t], A.g[t], A.u[t], A.y[t], &rep, &d), 0);
                gen2 = rep.generation;
            }
            ASSERT_TRUE(gen2 > gen);
            const int rc1 = check_lie(vr, &A, t, stage, e, nrm, &rep);
            blind_tried++;
            if (rc1 != KV_EPROTO || rep.stage != stage) { /* caught by the stage it lies in */
                blind_after++;
                printf("  PASSED after rotation: blind-spot lie %d on stage %d (%s)\n", blind, stage, g_types[k]);
            }
        }
        bound = kv_verify_miss_bound(KV_VERIFY_DEFAULT_PROJ, KV_VERIFY_THETA, N_FF);
        kv_verify_free(vr);
        kv_verify_free(v);
        p.free(p.impl);
    }
    /* the stated bound: below 2^-20 for the default count at theta, even at the 122B's rows */
    ASSERT_TRUE(bound < pow(2, -20));
    ASSERT_TRUE(kv_verify_miss_bound(KV_VERIFY_DEFAULT_PROJ, KV_VERIFY_THETA, 3072) < pow(2, -20));
    ASSERT_TRUE(kv_verify_miss_bound(KV_VERIFY_DEFAULT_PROJ, KV_VERIFY_THETA, 16384) < pow(2, -20));
    ASSERT_EQ(passed, 0);
    for (int c = 0; c < LIE_COUNT; c++) ASSERT_EQ(by_class[c], 0);
    ASSERT_EQ(blind_after, 0);
    ASSERT_EQ(blind_before, blind_tried); /* the blind spots were real: without rotation they pass for good */
    /* each vector alone passes a threshold lie at most as often as the bound says (plus 4 sigma) */
    const double one = kv_verify_miss_bound(1, KV_VERIFY_THETA * scales[0], N_FF);
    const double rate = thr_proj ? (double)thr_proj_pass / thr_proj : 1;
    ASSERT_TRUE(thr_proj > 0 && rate <= one + 4 * sqrt(one * (1 - one) / thr_proj));
    printf("  %ld structured lies on 3 types (%d shapes, %.3g to 1e3 x theta x tolerance and 5 max|y|): %ld passed; "
           "each vector alone let %.1f%% of the threshold lies through (bound %.1f%%), all %u together < %.2g\n",
           tried, LIE_COUNT, scales[0], passed, 100 * rate, 100 * one, KV_VERIFY_DEFAULT_PROJ,
           kv_verify_miss_bound(KV_VERIFY_DEFAULT_PROJ, KV_VERIFY_THETA * scales[0], N_FF));
    printf("  %ld blind-spot lies aimed at a learned generation: %ld passed it, %ld passed the next\n", blind_tried,
           blind_before, blind_after);
}

/* Honest answers computed on every backend this CPU has pass checks made on every one. */
static void test_backends(void) {
    static const char *const bes[] = {"scalar", "avx2", "avxvnni", "avx512", "neon", "neondot"};
    const int n_be = (int)(sizeof bes / sizeof bes[0]);
    char was[32];
    snprintf(was, sizeof was, "%s", kv_quant_backend());
    static answers A[6];
    for (int k = 0; k < 3; k++) {
        kv_diag d = {0};
        int have[6] = {0}, n_have = 0, differ = 0;
        for (int b = 0; b < n_be; b++) {
            if (kv_quant_set_backend(bes[b])) continue;
            have[b] = 1, n_have++;
            kv_expert_source src = {g_g[k], acquire, NULL, 1, N_EXPERT, N_EMBD, N_FF, 1};
            kv_expert_provider p;
            ASSERT_EQ(kv_expert_local_new_src(&p, &src, g_pool, N_TOK, &d), 0);
            g_seed = 4242; /* the same inputs on every backend */
            compute(k, &A[b], &p);
            p.free(p.impl);
            if (b && memcmp(A[b].y, A[0].y, sizeof A[b].y)) differ++;
        }
        double worst = 0;
        int fails = 0;
        for (int cb = 0; cb < n_be; cb++) { /* the checker's backend */
            if (!have[cb]) continue;
            ASSERT_EQ(kv_quant_set_backend(bes[cb]), 0);
            const kv_verify_opts o = {.seed = 555};
            kv_verify *v = prepared(k, &o);
            for (int b = 0; b < n_be && v; b++) {
                if (!have[b]) continue;
                for (int t = 0; t < N_TOK; t++) {
                    kv_verify_report rep;
                    fails += kv_verify_check(v, 0, (uint32_t)A[b].ids[t], A[b].x[t], A[b].g[t], A[b].u[t], A[b].y[t],
                                             &rep, &d) != 0;
                    worst = fmax(worst, rep.worst_ratio);
                }
            }
            kv_verify_free(v);
        }
        ASSERT_EQ(fails, 0);
        printf("  %-5s honest answers of %d backends (%d differ from scalar's bits), checked on each: 0 of %d caught, "
               "worst residual/tolerance %.3f\n",
               g_types[k], n_have, differ, n_have * n_have * N_TOK, worst);
    }
    ASSERT_EQ(kv_quant_set_backend(was), 0);
}

/* One matrix-vector product of an honest worker with another reduction order:
 * dequantized rows against q(in), summed in f32 front to back (order 0: the
 * worst ordinary order) or in f64 (order 1: nearly exact). */
static void matvec_order(const void *W, uint32_t type, const float *in, uint32_t n, uint32_t m, float *out, int order) {
    const kv_type_info *ti = kv_type_get(type);
    const uint32_t vdt = ti->vec_dot_type;
    static float row[N_FF > N_EMBD ? N_FF : N_EMBD], qin[N_FF > N_EMBD ? N_FF : N_EMBD];
    static uint8_t qb[(N_FF > N_EMBD ? N_FF : N_EMBD) * 4 + 64];
    if (vdt == KV_TYPE_F32) {
        memcpy(qin, in, n * sizeof(float));
    } else {
        kv_quantize_rows(vdt, in, n, n, 1, qb, (size_t)kv_type_row_size(vdt, n));
        kv_type_get(vdt)->to_float(qb, qin, n);
    }
    for (uint32_t i = 0; i < m; i++) {
        const uint8_t *wr = (const uint8_t *)W + (size_t)i * kv_type_row_size(type, n);
        ti->to_float(wr, row, n);
        float f = 0;
        double g = 0;
        for (uint32_t j = 0; j < n; j++) {
            /* Q8_1 activations (Q4_1, Q5_1): a block's min multiplies the activation's
             * stored sum s (fp16), not the sum of its dequantized values */
            const float mn = vdt == KV_TYPE_Q8_1 ? kv_fp16_to_fp32((uint16_t)(wr[ti->size * (j / 32) + 2] |
                                                                             wr[ti->size * (j / 32) + 3] << 8)) : 0;
            f += (row[j] - mn) * qin[j];
            g += ((double)row[j] - mn) * qin[j];
            if (vdt == KV_TYPE_Q8_1 && j % 32 == 31) {
                const uint8_t *q = qb + 36 * (j / 32);
                const float sb = kv_fp16_to_fp32((uint16_t)(q[2] | q[3] << 8));
                f += mn * sb;
                g += (double)mn * sb;
            }
        }
        out[i] = order ? (float)g : f;
    }
}

/* Honest workers that sum in another order than ours (a GPU, another engine) pass. */
static void test_orders(void) {
    static answers A;
    for (int k = 0; k < 3; k++) {
        kv_diag d = {0};
        kv_expert_source src = {g_g[k], acquire, NULL, 1, N_EXPERT, N_EMBD, N_FF, 1};
        kv_expert_provider p;
        ASSERT_EQ(kv_expert_local_new_src(&p, &src, g_pool, N_TOK, &d), 0);
        compute(k, &A, &p);
        p.free(p.impl);
        const kv_verify_opts o = {.seed = 31337};
        kv_verify *v = prepared(k, &o);
        double worst[2] = {0, 0};
        int fails = 0, differ = 0;
        for (int order = 0; order < 2 && v; order++)
            for (int t = 0; t < N_TOK; t++) {
                kv_expert_weights w;
                ASSERT_EQ(acquire(g_g[k], 0, (uint32_t)A.ids[t], &w, &d), 0);
                float g[N_FF], u[N_FF], h[N_FF], y[N_EMBD], gb[N_FF], ub[N_FF];
                matvec_order(w.gate, w.gate_type, A.x[t], N_EMBD, N_FF, g, order);
                matvec_order(w.up, w.up_type, A.x[t], N_EMBD, N_FF, u, order);
                for (int i = 0; i < N_FF; i++) { /* gpt-oss: the biases, then its clamped SwiGLU */
                    gb[i] = w.gate_b ? g[i] + w.gate_b[i] : g[i];
                    ub[i] = w.up_b ? u[i] + w.up_b[i] : u[i];
                }
                kv_expert_act(w.act, h, gb, ub, N_FF);
                matvec_order(w.down, w.down_type, h, N_FF, N_EMBD, y, order);
                for (int i = 0; i < N_EMBD && w.down_b; i++) y[i] += w.down_b[i];
                differ += memcmp(y, A.y[t], sizeof y) != 0;
                kv_verify_report rep;
                fails += kv_verify_check(v, 0, (uint32_t)A.ids[t], A.x[t], g, u, y, &rep, &d) != 0;
                worst[order] = fmax(worst[order], rep.worst_ratio);
            }
        ASSERT_EQ(fails, 0);
        ASSERT_TRUE(differ > 0); /* they are other bits, not ours again */
        printf("  %-5s honest answers summed in f32 row order / in f64 (%d of %d differ from the kernel's bits): 0 "
               "caught, worst residual/tolerance %.3f / %.3f\n",
               g_types[k], differ, 2 * N_TOK, worst[0], worst[1]);
        kv_verify_free(v);
    }
}

/* ---- the check's kernels against the scalar reference ------------------------------------ */

static const char *vk_expected(const char *be) {
    if (!strcmp(be, "avx512")) return "avx512";
    if (!strcmp(be, "avx2") || !strcmp(be, "avxvnni")) return "avx2";
    if (!strncmp(be, "neon", 4)) return "neon";
    return "scalar";
}

static void test_kernels(void) {
    static const char *const bes[] = {"scalar", "avx2", "avxvnni", "avx512", "neon", "neondot"};
    char was[32];
    snprintf(was, sizeof was, "%s", kv_quant_backend());
    const kv_vkernels *R = kv_vkernels_ref();
    enum { NMAX = 1100, NT = KV_VDOT_MAX_NT };
    static float r[16 * NMAX], a[NMAX], b[NMAX], o[NT][NMAX], x[NT][NMAX];
    static double s[16 * NMAX];
    for (int i = 0; i < 16 * NMAX; i++) r[i] = (float)rnorm(), s[i] = rnorm() * 3.0;
    for (int j = 0; j < NMAX; j++) a[j] = (float)fabs(rnorm()) * 4, b[j] = (float)(rnorm() * rnorm());
    for (int t = 0; t < NT; t++)
        for (int j = 0; j < NMAX; j++) o[t][j] = (float)(rnorm() * 100), x[t][j] = (float)(rnorm() * 0.01);
    const float *op[NT] = {o[0], o[1], o[2], o[3]}, *xp[NT] = {x[0], x[1], x[2], x[3]};
    int n_tested = 0;
    for (int bi = 0; bi < 6; bi++) {
        if (kv_quant_set_backend(bes[bi])) {
            if (strcmp(bes[bi], "avxvnni") && strcmp(bes[bi], "neondot"))
                kvt_skip_backend(vk_expected(bes[bi]), "this CPU does not run it");
            continue;
        }
        const kv_vkernels *K = kv_vkernels_get();
        ASSERT_STREQ(K->name, vk_expected(bes[bi]));
        n_tested++;
        /* projections: P 1..16 (the 4- and 8-wide chunks and the rows left over), 1..4 answers,
         * lengths with and without a tail */
        static const uint32_t Ps[] = {1, 3, 4, 5, 8, 12, 16}, ns[][2] = {{256, 512}, {259, 37}, {1, 8}, {1024, 1100}};
        int bad = 0, cases = 0;
        for (size_t pi = 0; pi < sizeof Ps / sizeof Ps[0]; pi++)
            for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
                for (uint32_t nt = 1; nt <= NT; nt++) {
                    const uint32_t P = Ps[pi], n_out = ns[ni][0], n_in = ns[ni][1];
                    double l1[NT * 16], h1[NT * 16], S1[NT], B1[NT], l0[NT * 16], h0[NT * 16], S0[NT], B0[NT];
                    K->dots(P, nt, r, op, n_out, s, a, b, xp, n_in, l1, h1, S1, B1);
                    R->dots(P, nt, r, op, n_out, s, a, b, xp, n_in, l0, h0, S0, B0);
                    for (uint32_t t = 0; t < nt; t++) {
                        double sa = 0, sb = 0;
                        for (uint32_t j = 0; j < n_in; j++) sa += fabs(a[j] * x[t][j]), sb += fabs(b[j] * x[t][j] * x[t][j]);
                        /* both orders are within (n + 1) u64 sum |terms| of the exact sum (2 rounded ops in B) */
                        bad += fabs(S1[t] - S0[t]) > 2.0 * (n_in + 1) * 0x1p-53 * sa;
                        bad += fabs(B1[t] - B0[t]) > 2.0 * (n_in + 2) * 0x1p-53 * sb;
                        for (uint32_t p = 0; p < P; p++) {
                            double gl = 0, gh = 0;
                            for (uint32_t i = 0; i < n_out; i++) gl += fabs((double)r[p * n_out + i] * o[t][i]);
                            for (uint32_t j = 0; j < n_in; j++) gh += fabs(s[p * n_in + j] * x[t][j]);
                            bad += !(fabs(l1[t * P + p] - l0[t * P + p]) <= 2.0 * (n_out + 1) * 0x1p-53 * gl);
                            bad += !(fabs(h1[t * P + p] - h0[t * P + p]) <= 2.0 * (n_in + 1) * 0x1p-53 * gh);
                        }
                    }
                    cases++;
                }
        ASSERT_EQ(bad, 0);
        /* the Q8 dequantization: to_float's bits */
        static float src[NMAX], d1[NMAX], d0[NMAX];
        static uint8_t q[NMAX * 2];
        const uint32_t vdts[2] = {KV_TYPE_Q8_0, KV_TYPE_Q8_K}, nq = 1024;
        for (int k = 0; k < 2; k++) {
            for (uint32_t j = 0; j < nq; j++) src[j] = (float)(rnorm() * (j % 97 + 1));
            kv_quantize_rows(vdts[k], src, nq, nq, 1, q, sizeof q);
            K->deq(vdts[k], q, d1, nq);
            kv_type_get_ref(vdts[k])->to_float(q, d0, nq);
            ASSERT_EQ(memcmp(d1, d0, nq * sizeof(float)), 0);
        }
        /* Q8_K quantization where a backend has its own: from_float's bits, ties and
         * repeated maxima included */
        if (K->q8k) {
            static uint8_t q1[NMAX * 2], q0[NMAX * 2];
            for (uint32_t j = 0; j < nq; j++) src[j] = (float)(rnorm() * (j % 97 + 1));
            src[5] = -400, src[77] = 400;                  /* the first of equal magnitudes sets the sign */
            for (uint32_t j = 256; j < 512; j++) src[j] = 0; /* an all-zero block */
            for (uint32_t j = 512; j < 768; j++) src[j] = (float)(j % 200) - 99.5f; /* halves: ties to even */
            src[600] = 127; /* iscale -1 */
            K->q8k(src, q1, nq);
            kv_type_get_ref(KV_TYPE_Q8_K)->from_float(src, q0, nq);
            ASSERT_EQ(memcmp(q1, q0, kv_type_row_size(KV_TYPE_Q8_K, nq)), 0);
        }
        /* finiteness: an infinity or a NaN anywhere, the tail included */
        int fbad = 0;
        const float specials[3] = {INFINITY, -INFINITY, NAN};
        for (uint32_t n = 1; n <= 37; n += 9)
            for (uint32_t at = 0; at < n; at++)
                for (int sp = 0; sp < 3; sp++) {
                    float v[40];
                    for (uint32_t j = 0; j < n; j++) v[j] = (float)(rnorm() * 1e37);
                    fbad += !K->finite(v, n) || !R->finite(v, n);
                    v[at] = specials[sp];
                    fbad += K->finite(v, n) || R->finite(v, n);
                }
        ASSERT_EQ(fbad, 0);
        /* SwiGLU: kv_swiglu's bits, over ordinary, huge, tiny and special values */
        static float g[NMAX], u[NMAX], h1[NMAX], h0[NMAX];
        const uint32_t n = 1037;
        for (uint32_t j = 0; j < n; j++) {
            g[j] = (float)(rnorm() * (j % 5 == 0 ? 60 : 4));
            u[j] = (float)(rnorm() * (j % 7 == 0 ? 1e30 : 3));
        }
        g[1] = INFINITY, g[2] = -INFINITY, g[3] = NAN, g[4] = -0.0f, g[6] = 1e-40f, g[7] = 89.0f, g[8] = -89.0f;
        K->swiglu(h1, g, u, n);
        kv_swiglu(h0, g, u, n);
        ASSERT_EQ(memcmp(h1, h0, n * sizeof(float)), 0);
        /* the rows of s = W^T r: the reference's bits (multiply, then add) */
        static double s1[16 * 300], s0[16 * 300];
        for (int i = 0; i < 16 * 300; i++) s1[i] = s0[i] = rnorm();
        double rp[16];
        for (int p = 0; p < 16; p++) rp[p] = rnorm();
        K->axpy(13, rp, g + 20, 259, s1 + 7, 300);
        R->axpy(13, rp, g + 20, 259, s0 + 7, 300);
        ASSERT_EQ(memcmp(s1, s0, sizeof s1), 0);
        printf("  kernels %-6s (level %s): %d projection cases within the f64 bound of the reference; dequant, "
               "finite, SwiGLU, s rows%s bit for bit\n",
               K->name, bes[bi], cases, K->q8k ? ", Q8_K quantization" : "");
    }
    ASSERT_TRUE(n_tested >= 1);
    ASSERT_EQ(kv_quant_set_backend(was), 0);
}

/* ---- batched checks against one check per answer ----------------------------------------- */

static void test_batch(void) {
    static answers A;
    const int k = 2; /* q4_K */
    kv_diag d = {0};
    kv_expert_source src = {g_g[k], acquire, NULL, 1, N_EXPERT, N_EMBD, N_FF, 1};
    kv_expert_provider p;
    ASSERT_EQ(kv_expert_local_new_src(&p, &src, g_pool, N_TOK, &d), 0);
    compute(k, &A, &p);
    p.free(p.impl);
    /* the answers of expert 1: tokens 1, 5, 9, ... (12 of them) */
    enum { NB = N_TOK / N_EXPERT };
    const uint32_t e = 1;
    float g[NB][N_FF], u[NB][N_FF], y[NB][N_EMBD];
    const float *xp[NB], *gp[NB], *up[NB], *yp[NB];
    for (int i = 0; i < NB; i++) {
        const int t = i * N_EXPERT + (int)e;
        memcpy(g[i], A.g[t], sizeof g[i]);
        memcpy(u[i], A.u[t], sizeof u[i]);
        memcpy(y[i], A.y[t], sizeof y[i]);
        xp[i] = A.x[t], gp[i] = g[i], up[i] = u[i], yp[i] = y[i];
    }
    /* rotate_every 5: groups of four meet the generation boundaries */
    const kv_verify_opts o = {.seed = 99, .rotate_every = 5};
    int mism = 0;
    for (int round = 0; round < 8; round++) {
        kv_verify *vb = prepared(k, &o), *vs = prepared(k, &o);
        if (!vb || !vs) return;
        /* a lie (or none, round 0) at answer `at`, on stage round % 3, or a NaN (round 7) */
        const int at = round == 0 ? -1 : (round * 5) % NB;
        float save = 0, *tgt = NULL;
        if (at >= 0) {
            tgt = round == 7 ? &y[at][3] : round % 3 == 0 ? &g[at][7] : round % 3 == 1 ? &u[at][7] : &y[at][7];
            save = *tgt;
            *tgt = round == 7 ? NAN : *tgt + 1.0f;
        }
        /* the batch after 3 single checks, so the groups straddle a rotation */
        kv_verify_report rb, rs;
        kv_diag db = {0}, ds = {0};
        for (int i = 0; i < 3; i++) {
            ASSERT_EQ(kv_verify_check(vb, 0, e, xp[i], gp[i], up[i], yp[i], NULL, &d), i == at ? KV_EPROTO : 0);
            ASSERT_EQ(kv_verify_check(vs, 0, e, xp[i], gp[i], up[i], yp[i], NULL, &d), i == at ? KV_EPROTO : 0);
        }
        const int first = at >= 3 ? at : -1;
        uint32_t bad = 12345;
        const int rcb = kv_verify_check_batch(vb, 0, e, NB - 3, xp + 3, gp + 3, up + 3, yp + 3, &bad, &rb, &db);
        int rcs = 0, is = 3;
        double worst = 0;
        for (; is < NB; is++) {
            rcs = kv_verify_check(vs, 0, e, xp[is], gp[is], up[is], yp[is], &rs, &ds);
            worst = fmax(worst, rs.worst_ratio);
            if (rcs) break;
        }
        ASSERT_EQ(rcb, rcs);
        ASSERT_EQ(rcb, first >= 0 ? KV_EPROTO : 0);
        if (rcb) {
            ASSERT_EQ((int)bad + 3, is);
            ASSERT_EQ(is, first);
            ASSERT_STREQ(db.msg, ds.msg);
            ASSERT_EQ(rb.stage, rs.stage);
            ASSERT_EQ(rb.proj, rs.proj);
            ASSERT_EQ(rb.n_over, rs.n_over);
            if (rs.stage >= 0) ASSERT_NEAR(rb.tol, rs.tol, 1e-12 * rs.tol);
        }
        ASSERT_EQ(rb.generation, rs.generation);
        mism += fabs(rb.worst_ratio - worst) > 1e-9 * (1 + worst);
        /* afterwards both are at the same point of the same generation: the next answers
         * give the same projections */
        kv_verify_report nb, ns;
        for (int i = 0; i < 6; i++) {
            ASSERT_EQ(kv_verify_check(vb, 0, e, xp[0], A.g[e], A.u[e], A.y[e], &nb, &d), 0);
            ASSERT_EQ(kv_verify_check(vs, 0, e, xp[0], A.g[e], A.u[e], A.y[e], &ns, &d), 0);
            ASSERT_EQ(nb.generation, ns.generation);
            mism += fabs(nb.worst_ratio - ns.worst_ratio) > 1e-9;
        }
        if (tgt) *tgt = save;
        kv_verify_free(vb);
        kv_verify_free(vs);
    }
    ASSERT_EQ(mism, 0);
    printf("  batched checks: the verdicts, first failing answer, stage, tolerance and generations of one check "
           "per answer (8 rounds, rotation every 5)\n");
}

/* ---- gpt-oss: biases and the clamped SwiGLU --------------------------------------------- */
#ifdef KV_TEST_VERIFY_GPTOSS

/* Token t's answer from a worker that gets one part of gpt-oss's expert wrong (lie 1: plain
 * SwiGLU, no clamp; 2: no down bias; 3: no gate and up biases), summed in f64 (an honest
 * worker summing so passes: test_orders); lie 0: none. g, u: the products it answers. */
static void gptoss_answer(const kv_expert_weights *w, const float *x, int lie, float *g, float *u, float *y) {
    float gb[N_FF], ub[N_FF], h[N_FF];
    matvec_order(w->gate, w->gate_type, x, N_EMBD, N_FF, g, 1);
    matvec_order(w->up, w->up_type, x, N_EMBD, N_FF, u, 1);
    for (int i = 0; i < N_FF; i++) {
        gb[i] = lie == 3 ? g[i] : g[i] + w->gate_b[i];
        ub[i] = lie == 3 ? u[i] : u[i] + w->up_b[i];
    }
    kv_expert_act(lie == 1 ? KV_ACT_SWIGLU : w->act, h, gb, ub, N_FF);
    matvec_order(w->down, w->down_type, h, N_FF, N_EMBD, y, 1);
    for (int i = 0; i < N_EMBD && lie != 2; i++) y[i] += w->down_b[i];
}

/* The files are gpt-oss's: every expert has its three biases and the clamped activation, and the
 * clamp is met. Honest answers pass (test_types, test_orders); a worker that skips the clamp,
 * down's bias or gate's and up's is caught on every token where its output is off by theta x the
 * tolerance or more, and there are such tokens for each. */
static void test_gptoss(void) {
    static answers A;
    static const char *const lies[4] = {"none", "no clamp", "no down bias", "no gate/up biases"};
    for (int k = 0; k < 3; k++) {
        kv_diag d = {0};
        kv_expert_source src = {g_g[k], acquire, NULL, 1, N_EXPERT, N_EMBD, N_FF, 1};
        kv_expert_provider p;
        ASSERT_EQ(kv_expert_local_new_src(&p, &src, g_pool, N_TOK, &d), 0);
        compute(k, &A, &p);
        p.free(p.impl);
        const kv_verify_opts o = {.seed = 4711};
        kv_verify *v = prepared(k, &o);
        if (!v) return;
        long clamped = 0, elems = 0;
        int due[4] = {0}, caught[4] = {0}, missed = 0;
        for (int t = 0; t < N_TOK; t++) {
            kv_expert_weights w;
            ASSERT_EQ(acquire(g_g[k], 0, (uint32_t)A.ids[t], &w, &d), 0);
            ASSERT_EQ(w.act, (uint32_t)KV_ACT_SWIGLU_CLAMP);
            ASSERT_TRUE(w.gate_b && w.up_b && w.down_b);
            for (int i = 0; i < N_FF; i++) {
                const float gb = A.g[t][i] + w.gate_b[i], ub = A.u[t][i] + w.up_b[i];
                clamped += gb > KV_SWIGLU_OAI_LIMIT || fabsf(ub) > KV_SWIGLU_OAI_LIMIT;
            }
            elems += N_FF;
            const double T = tol_of(v, &A, t, 2);
            float y0[N_EMBD];
            for (int lie = 0; lie < 4; lie++) {
                float g[N_FF], u[N_FF], y[N_EMBD];
                gptoss_answer(&w, A.x[t], lie, g, u, y);
                if (lie == 0) memcpy(y0, y, sizeof y0);
                double e2 = 0;
                for (int i = 0; i < N_EMBD; i++) e2 += ((double)y[i] - y0[i]) * ((double)y[i] - y0[i]);
                kv_verify_report rep;
                const int rc = kv_verify_check(v, 0, (uint32_t)A.ids[t], A.x[t], g, u, y, &rep, &d);
                if (lie == 0) {
                    missed += rc != 0; /* honest, in f64 */
                } else if (sqrt(e2) >= KV_VERIFY_THETA * T) {
                    due[lie]++;
                    caught[lie] += rc == KV_EPROTO && rep.stage == 2;
                }
            }
        }
        ASSERT_EQ(missed, 0);
        ASSERT_TRUE(clamped > 0);
        for (int lie = 1; lie < 4; lie++) {
            ASSERT_TRUE(due[lie] > 0);
            ASSERT_EQ(caught[lie], due[lie]);
        }
        printf("  %-5s gpt-oss experts: %.1f%% of the activations clamped; honest f64 answers 0 of %d caught; lies "
               "caught: %s %d/%d, %s %d/%d, %s %d/%d\n",
               g_types[k], 100.0 * clamped / elems, N_TOK, lies[1], caught[1], due[1], lies[2], caught[2], due[2],
               lies[3], caught[3], due[3]);
        kv_verify_free(v);
    }
}
#endif

/* Experts whose gate and up take different activation types (gate Q8_0: Q8_0 activations; up and
 * down Q4_K: Q8_K), as some published mixes write them: the check quantizes x once per type, as
 * the kernels do. Honest answers pass; a lie on up or gate is caught by its own stage. */
static int acquire_mixed(void *ctx, uint32_t layer, uint32_t e, kv_expert_weights *w, kv_diag *d) {
    (void)ctx;
    kv_expert_weights g;
    int rc = acquire(g_g[1], layer, e, &g, d);
    if (!rc) rc = acquire(g_g[2], layer, e, w, d);
    if (rc) return rc;
    w->gate = g.gate;
    w->gate_type = g.gate_type;
    return 0;
}

static void test_mixed_acts(void) {
    if (strcmp(g_types[1], "q8_0") || strcmp(g_types[2], "q4_k")) return; /* the default types only */
    static answers A;
    kv_diag d = {0};
    kv_expert_source src = {NULL, acquire_mixed, NULL, 1, N_EXPERT, N_EMBD, N_FF, 1};
    kv_expert_provider p;
    ASSERT_EQ(kv_expert_local_new_src(&p, &src, g_pool, N_TOK, &d), 0);
    for (int t = 0; t < N_TOK; t++) {
        for (int i = 0; i < N_EMBD; i++) A.x[t][i] = frand();
        A.ids[t] = t % N_EXPERT;
    }
    const kv_expert_req req = {0, N_TOK, N_EMBD, 1, &A.x[0][0], A.ids, NULL};
    ASSERT_EQ(kv_expert_local_compute_pre(&p, &req, &A.y[0][0], &A.g[0][0], &A.u[0][0], &d), 0);
    p.free(p.impl);
    kv_verify *v = NULL;
    const kv_verify_opts o = {.seed = 2024};
    ASSERT_EQ(kv_verify_new(&v, 1, N_EXPERT, N_EMBD, N_FF, &o, &d), 0);
    for (uint32_t e = 0; e < N_EXPERT; e++) {
        kv_expert_weights w;
        ASSERT_EQ(acquire_mixed(NULL, 0, e, &w, &d), 0);
        ASSERT_TRUE(kv_type_get(w.gate_type)->vec_dot_type != kv_type_get(w.up_type)->vec_dot_type);
        ASSERT_EQ(kv_verify_prepare(v, 0, e, &w, &d), 0);
    }
    double worst = 0;
    int fails = 0, missed = 0;
    for (int t = 0; t < N_TOK; t++) {
        kv_verify_report rep;
        fails += kv_verify_check(v, 0, (uint32_t)A.ids[t], A.x[t], A.g[t], A.u[t], A.y[t], &rep, &d) != 0;
        worst = fmax(worst, rep.worst_ratio);
        for (int stage = 0; stage < 2; stage++) {
            const double T = tol_of(v, &A, t, stage);
            missed += check_moved(v, &A, t, stage, (t * 7 + stage) % N_FF, KV_VERIFY_THETA * T, &rep) != KV_EPROTO ||
                      rep.stage != stage;
        }
    }
    ASSERT_EQ(fails, 0);
    ASSERT_EQ(missed, 0);
    printf("  gate q8_0, up and down q4_K (Q8_0 and Q8_K activations): honest worst residual/tolerance %.3f; "
           "gate and up moved by theta x tolerance: all caught by their stage\n", worst);
    kv_verify_free(v);
}

/* A type the verifier cannot read is refused by kv_verify_supported (what a
 * coordinator runs as it loads its slabs), naming the tensor and the type;
 * every type the engine computes is accepted. */
static void test_supported(void) {
    kv_diag d = {0};
    int refused = 0;
    for (uint32_t t = 0; t < KV_TYPE_COUNT; t++) {
        const kv_type_info *ti = kv_type_get(t);
        if (!ti || !ti->compute) continue;
        kv_expert_weights w = {NULL, NULL, NULL, t, t, t, NULL, NULL, NULL, 0};
        refused += kv_verify_supported(&w, 0, N_EMBD, N_FF, &d) != 0;
        w.act = KV_ACT_SWIGLU_CLAMP;
        refused += kv_verify_supported(&w, 0, N_EMBD, N_FF, &d) != 0;
    }
    ASSERT_EQ(refused, 0);
    kv_expert_weights bad = {NULL, NULL, NULL, KV_TYPE_Q8_0, KV_TYPE_I16, KV_TYPE_Q8_0, NULL, NULL, NULL, 0};
    ASSERT_EQ(kv_verify_supported(&bad, 3, N_EMBD, N_FF, &d), KV_EUNSUPPORTED);
    ASSERT_TRUE(strstr(d.msg, "blk.3.ffn_up_exps.weight") && strstr(d.msg, "i16"));
    kv_verify *v = NULL;
    ASSERT_EQ(kv_verify_new(&v, 4, 2, N_EMBD, N_FF, NULL, &d), 0);
    ASSERT_EQ(kv_verify_prepare(v, 3, 1, &bad, &d), KV_EUNSUPPORTED);
    ASSERT_TRUE(strstr(d.msg, "blk.3.ffn_up_exps.weight") != NULL);
    ASSERT_TRUE(!kv_verify_ready(v, 3, 1) && kv_verify_bytes(v) == 0);
    bad.up_type = KV_TYPE_Q8_0, bad.act = 7;
    ASSERT_EQ(kv_verify_supported(&bad, 0, N_EMBD, N_FF, &d), KV_EUNSUPPORTED);
    kv_verify_free(v);
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
    /* 122B scale: 12,544 experts of 3072 x 1024 (printed for docs/VERIFY.md) */
    printf("  projections at 122B scale (12544 experts, embd 3072, ff 1024): %.2f GB with %u vectors, %.2f GB with 4\n",
           12544.0 * kv_verify_expert_bytes(3072, 1024, KV_VERIFY_DEFAULT_PROJ) / 1e9, KV_VERIFY_DEFAULT_PROJ,
           12544.0 * kv_verify_expert_bytes(3072, 1024, 4) / 1e9);
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
        snprintf(cmd, sizeof cmd, "%s gen-model " KV_TEST_VERIFY_ARCH " --out %s --layers 1 --embd %d --ff-exp %d "
                 "--experts %d --experts-used 2 --vocab 300 --type %s --seed 5 >/dev/null 2>&1", bin, path, N_EMBD, N_FF,
                 N_EXPERT, g_types[k]);
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

static const kvt_case cases[] = {KVT_CASE(test_types), KVT_CASE(test_attack), KVT_CASE(test_backends), KVT_CASE(test_orders),
                                 KVT_CASE(test_kernels), KVT_CASE(test_batch),
#ifdef KV_TEST_VERIFY_GPTOSS
                                 KVT_CASE(test_gptoss),
#endif
                                 KVT_CASE(test_supported), KVT_CASE(test_mixed_acts), KVT_CASE(test_bad_args)};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
