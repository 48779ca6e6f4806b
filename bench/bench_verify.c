/* Cost of a Freivalds check (include/kvasir/verify.h) against the expert
 * compute it checks (not a test). One expert of the given shape and weight
 * type (random weights), n_tok tokens through the in-process provider on one
 * thread (the worker's kernels, pool NULL), then kv_verify_check on every
 * (token, expert) answer, one call per answer (kv_verify_check) and all
 * answers in one call (kv_verify_check_batch). For each quant backend this CPU runs (the verify
 * kernels follow the same choice) it prints the median over `runs` runs of
 * the per-token time of each, and the ratios check / expert (the medians of
 * the runs' ratios), and the time of one rotation (the next generation of
 * the expert's vectors: a pass over its weights). Times are the process's CPU
 * time, so a machine shared with other work disturbs them less.
 * Usage: bench_verify [n_embd n_ff type n_tok runs]; defaults: the 122B's
 * expert shape, 3072 1024 q4_K 64 7. KV_BENCH_BACKENDS=avx2,avx512 names the
 * backends (default: scalar, avx2, avx512 where the CPU runs them);
 * KV_BENCH_COLD=N also times checks that go round N experts (their projections
 * no longer in the caches: a coordinator verifying many experts);
 * KV_BENCH_PROJ=16 sets the vectors per matrix (default 8);
 * KV_BENCH_PROFILE=1 (one at a time) or 2 (batched) first runs 20,000
 * checks alone, 3 runs 100 rotations (for perf). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvasir/model.h"
#include "kvasir/moe.h"
#include "kvasir/quant.h"
#include "kvasir/verify.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t g_rng = 0x243f6a8885a308d3ull;
static double rnorm(void) {
    double u[2];
    for (int i = 0; i < 2; i++) {
        g_rng ^= g_rng << 13, g_rng ^= g_rng >> 7, g_rng ^= g_rng << 17;
        u[i] = ((double)(g_rng >> 11) + 0.5) * (1.0 / 9007199254740992.0);
    }
    return sqrt(-2.0 * log(u[0])) * cos(6.283185307179586 * u[1]);
}

static kv_expert_weights g_w;
static int acquire(void *ctx, uint32_t layer, uint32_t e, kv_expert_weights *w, kv_diag *d) {
    (void)ctx, (void)layer, (void)e, (void)d;
    *w = g_w;
    return 0;
}

/* rows x n random weights of type t (scale sigma) */
static void *matrix(uint32_t t, uint32_t rows, uint32_t n, double sigma) {
    const size_t rb = kv_type_row_size(t, n);
    uint8_t *W = malloc(rb * rows);
    float *row = malloc(n * sizeof(float));
    for (uint32_t i = 0; i < rows; i++) {
        for (uint32_t j = 0; j < n; j++) row[j] = (float)(sigma * rnorm());
        if (t == KV_TYPE_F32)
            memcpy(W + i * rb, row, rb);
        else
            kv_type_get(t)->from_float(row, W + i * rb, n);
    }
    free(row);
    return W;
}

static int cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    const uint32_t E = argc > 1 ? (uint32_t)atoi(argv[1]) : 3072, F = argc > 2 ? (uint32_t)atoi(argv[2]) : 1024;
    const int type = kv_type_from_name(argc > 3 ? argv[3] : "q4_K");
    const uint32_t T = argc > 4 ? (uint32_t)atoi(argv[4]) : 64;
    const int runs = argc > 5 ? atoi(argv[5]) : 7;
    if (type < 0 || !E || !F || !T || runs < 1 || runs > 99 || !kv_type_row_size((uint32_t)type, E) ||
        !kv_type_row_size((uint32_t)type, F)) {
        fprintf(stderr, "usage: bench_verify [n_embd n_ff type n_tok runs]\n");
        return 2;
    }
    g_w = (kv_expert_weights){matrix((uint32_t)type, F, E, 0.02), matrix((uint32_t)type, F, E, 0.02),
                              matrix((uint32_t)type, E, F, 0.03), (uint32_t)type, (uint32_t)type, (uint32_t)type,
                              NULL, NULL, NULL, 0};
    float *x = malloc(sizeof(float) * T * E), *y = malloc(sizeof(float) * T * E);
    float *g = malloc(sizeof(float) * T * F), *u = malloc(sizeof(float) * T * F);
    int32_t *ids = calloc(T, sizeof *ids);
    for (size_t i = 0; i < (size_t)T * E; i++) x[i] = (float)rnorm();
    const char *bes[] = {"scalar", "avx2", "avx512", "neon"};
    const char *only = getenv("KV_BENCH_BACKENDS");
    printf("verify cost: expert %u x %u %s, %u tokens, one thread, median of %d runs (CPU time), %s projections\n", E,
           F, kv_type_get((uint32_t)type)->name, T, runs, getenv("KV_BENCH_PROJ") ? getenv("KV_BENCH_PROJ") : "8");
    printf("%-8s %14s %14s %8s %14s %8s %10s %11s\n", "backend", "expert us/tok", "check us/tok", "ratio",
           "batch us/tok", "ratio", "worst res", "rotation ms");
    for (int b = 0; b < 4; b++) {
        if (only && !strstr(only, bes[b])) continue;
        if (kv_quant_set_backend(bes[b])) continue;
        kv_diag d = {0};
        const kv_expert_source src = {NULL, acquire, NULL, 1, 1, E, F, 1};
        kv_expert_provider p;
        kv_verify *v = NULL;
        const uint32_t np = getenv("KV_BENCH_PROJ") ? (uint32_t)atoi(getenv("KV_BENCH_PROJ")) : 0;
        const kv_verify_opts o = {.n_proj = np, .seed = 7, .rotate_every = UINT32_MAX};
        if (kv_expert_local_new_src(&p, &src, NULL, T, &d) || kv_verify_new(&v, 1, 1, E, F, &o, &d) ||
            kv_verify_prepare(v, 0, 0, &g_w, &d)) {
            fprintf(stderr, "bench_verify: %s\n", d.msg);
            return 1;
        }
        const kv_expert_req req = {0, T, E, 1, x, ids, NULL};
        if (kv_expert_local_compute_pre(&p, &req, y, g, u, &d)) {
            fprintf(stderr, "bench_verify: %s\n", d.msg);
            return 1;
        }
        const float **xp = malloc(T * sizeof *xp), **gp = malloc(T * sizeof *gp), **up_ = malloc(T * sizeof *up_),
                    **yp = malloc(T * sizeof *yp);
        for (uint32_t t = 0; t < T; t++)
            xp[t] = x + (size_t)t * E, gp[t] = g + (size_t)t * F, up_[t] = u + (size_t)t * F, yp[t] = y + (size_t)t * E;
        if (getenv("KV_BENCH_PROFILE")) /* checks alone, for a profiler: =1 one at a time, =2 batched */
            for (int k = 0; k < 20000; k++) {
                const uint32_t t = k % T;
                if (atoi(getenv("KV_BENCH_PROFILE")) == 2) {
                    kv_verify_check_batch(v, 0, 0, T, xp, gp, up_, yp, NULL, NULL, &d);
                    k += T - 1;
                } else
                    kv_verify_check(v, 0, 0, xp[t], gp[t], up_[t], yp[t], NULL, &d);
            }
        double tx[99], tc[99], tb[99], worst = 0;
        int fails = 0;
        for (int r = 0; r < runs; r++) {
            double t0 = now();
            p.compute(p.impl, &req, y, &d);
            double t1 = now();
            const int reps = 4;
            for (int k = 0; k < reps; k++)
                for (uint32_t t = 0; t < T; t++) {
                    kv_verify_report rep;
                    fails += kv_verify_check(v, 0, 0, x + (size_t)t * E, g + (size_t)t * F, u + (size_t)t * F,
                                             y + (size_t)t * E, &rep, &d) != 0;
                    if (rep.worst_ratio > worst) worst = rep.worst_ratio;
                }
            double t2 = now();
            for (int k = 0; k < reps; k++) { /* the whole batch at once: kv_verify_check_batch */
                kv_verify_report rep;
                fails += kv_verify_check_batch(v, 0, 0, T, xp, gp, up_, yp, NULL, &rep, &d) != 0;
                if (rep.worst_ratio > worst) worst = rep.worst_ratio;
            }
            double t3 = now();
            tx[r] = (t1 - t0) / T * 1e6;
            tc[r] = (t2 - t1) / (reps * T) * 1e6;
            tb[r] = (t3 - t2) / (reps * T) * 1e6;
        }
        if (fails) {
            fprintf(stderr, "bench_verify: %d honest answers failed (%s)\n", fails, d.msg);
            return 1;
        }
        double ratio[99], ratiob[99];
        for (int r = 0; r < runs; r++) ratio[r] = tc[r] / tx[r], ratiob[r] = tb[r] / tx[r];
        qsort(tx, runs, sizeof *tx, cmp);
        qsort(tc, runs, sizeof *tc, cmp);
        qsort(tb, runs, sizeof *tb, cmp);
        qsort(ratio, runs, sizeof *ratio, cmp);
        qsort(ratiob, runs, sizeof *ratiob, cmp);
        /* one rotation: a verifier that replaces its vectors at every second check */
        kv_verify *vr = NULL;
        const kv_verify_opts orot = {.n_proj = np, .seed = 7, .rotate_every = 1};
        double trot = 0;
        if (!kv_verify_new(&vr, 1, 1, E, F, &orot, &d) && !kv_verify_prepare(vr, 0, 0, &g_w, &d)) {
            kv_verify_check(vr, 0, 0, xp[0], gp[0], up_[0], yp[0], NULL, &d);
            for (int k = 0; getenv("KV_BENCH_PROFILE") && atoi(getenv("KV_BENCH_PROFILE")) == 3 && k < 100; k++)
                kv_verify_check(vr, 0, 0, xp[0], gp[0], up_[0], yp[0], NULL, &d); /* rotations, for perf */
            const double t0 = now();
            kv_verify_check(vr, 0, 0, xp[0], gp[0], up_[0], yp[0], NULL, &d); /* rotates first */
            trot = (now() - t0) * 1e3;
        }
        kv_verify_free(vr);
        printf("%-8s %14.2f %14.2f %7.1f%% %14.2f %7.1f%% %10.3f %11.1f\n", bes[b], tx[runs / 2], tc[runs / 2],
               100 * ratio[runs / 2], tb[runs / 2], 100 * ratiob[runs / 2], worst, trot);
        /* cold: KV_BENCH_COLD=N experts' projections (N x 0.61 MB at the 122B shape), a
         * different expert at every check, as in a coordinator that verifies many */
        const int ncold = getenv("KV_BENCH_COLD") ? atoi(getenv("KV_BENCH_COLD")) : 0;
        kv_verify *vc = NULL;
        if (ncold > 0 && ncold <= 4096 && !kv_verify_new(&vc, 1, (uint32_t)ncold, E, F, &o, &d)) {
            for (int e = 0; e < ncold; e++) kv_verify_prepare(vc, 0, (uint32_t)e, &g_w, &d);
            double c1[99], c4[99];
            for (int r = 0; r < runs; r++) {
                double t0 = now();
                for (uint32_t t = 0; t < 4; t++)
                    for (int e = 0; e < ncold; e++)
                        fails += kv_verify_check(vc, 0, (uint32_t)e, xp[t], gp[t], up_[t], yp[t], NULL, &d) != 0;
                double t1 = now();
                for (int e = 0; e < ncold; e++)
                    fails += kv_verify_check_batch(vc, 0, (uint32_t)e, 4, xp, gp, up_, yp, NULL, NULL, &d) != 0;
                double t2 = now();
                c1[r] = (t1 - t0) / (4.0 * ncold) * 1e6, c4[r] = (t2 - t1) / (4.0 * ncold) * 1e6;
            }
            qsort(c1, runs, sizeof *c1, cmp);
            qsort(c4, runs, sizeof *c4, cmp);
            printf("%-8s cold (%d experts' projections, %.0f MB): check %.2f us alone, %.2f us per answer in "
                   "batches of 4%s\n",
                   bes[b], ncold, ncold * kv_verify_expert_bytes(E, F, np ? np : KV_VERIFY_DEFAULT_PROJ) / 1e6,
                   c1[runs / 2], c4[runs / 2], fails ? " (FAILED)" : "");
        }
        kv_verify_free(vc);
        free(xp);
        free(gp);
        free(up_);
        free(yp);
        kv_verify_free(v);
        p.free(p.impl);
    }
    free(x);
    free(y);
    free(g);
    free(u);
    free(ids);
    free((void *)g_w.gate);
    free((void *)g_w.up);
    free((void *)g_w.down);
    return 0;
}
