/* Test support for the f64 reference forward passes (tests/test_model.c,
 * test_deepseek2.c, test_gptoss.c, test_qwen35.c, and the MTP reference of
 * test_spec_engine.c): the plain double kernels every reference is built
 * from (matrix-vector product over an F32 weight, RMS norm, sigmoid, SiLU),
 * our f32 logits token by token and chunked through kv_state, and the
 * worst |logit difference| between the two over several prefix lengths.
 * The kernels are naive loops on purpose: they share nothing with src/cpu.
 * Also the family tests' generate-and-load and teardown of their model.
 * Header-only (static functions): include it once per test executable. */
#ifndef KVASIR_REF64_H
#define KVASIR_REF64_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "kvasir/gen.h"
#include "kvasir/model.h"
#include "kvasir/quant.h" /* KV_TYPE_*: ref_ours' cache type */
#include "kvtest.h"
#include "ref_gguf.h"

#if defined(__GNUC__)
#define REF64_UNUSED __attribute__((unused))
#else
#define REF64_UNUSED
#endif

/* y[rows] = w[rows][cols] x[cols] */
static REF64_UNUSED void ref_matvec(double *y, const float *w, const double *x, int rows, int cols) {
    for (int r = 0; r < rows; r++) {
        double s = 0;
        for (int c = 0; c < cols; c++) s += (double)w[(size_t)r * cols + c] * x[c];
        y[r] = s;
    }
}

/* y = x / sqrt(mean(x^2) + eps) * w; y may be x */
static REF64_UNUSED void ref_rms(double *y, const double *x, const float *w, int n, double eps) {
    double s = 0;
    for (int i = 0; i < n; i++) s += x[i] * x[i];
    double k = 1.0 / sqrt(s / n + eps);
    for (int i = 0; i < n; i++) y[i] = x[i] * k * w[i];
}

static REF64_UNUSED double ref_sigm(double x) { return 1.0 / (1.0 + exp(-x)); }
static REF64_UNUSED double ref_silu(double x) { return x * ref_sigm(x); }

/* Our logits after each of the n tokens, token by token, then (batch != 0)
 * the whole prompt again in chunks of `batch` over the last row; nth
 * threads, cache of kv_type. Returns [n][n_vocab] (caller frees); a failure
 * is a test failure and leaves zeros. */
static REF64_UNUSED float *ref_ours(const kv_model *m, const int32_t *toks, int n, int nth, uint32_t batch,
                                    uint32_t kv_type) {
    const int V = (int)kv_model_hparams(m)->n_vocab;
    float *out = calloc((size_t)n * V, sizeof *out);
    kv_diag d = {0};
    kv_pool *pool = NULL;
    kv_state *s = NULL;
    kv_state_opts o = {.n_ctx = 64, .n_batch = batch ? batch : 64, .kv_type = kv_type};
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

/* The logits of the last of toks[0..n) by an f64 reference over the file. */
typedef void (*ref_forward_fn)(const ref_model *rm, const int32_t *toks, int n, double *logits);

/* max |reference - ours| over the prefixes 1, 1 + step, ... <= n_tok of the
 * F32 model at path; ours is ref_ours' token-by-token [n_tok][V]. */
static REF64_UNUSED double ref_max_dlogit(const char *path, ref_forward_fn fwd, const int32_t *toks, int n_tok,
                                          int step, const float *ours, int V) {
    double *ref = calloc(V, sizeof *ref), worst = 0;
    ref_model rm;
    ASSERT_EQ(ref_open(&rm, path), 0);
    for (int n = 1; n <= n_tok; n += step) {
        fwd(&rm, toks, n, ref);
        for (int i = 0; i < V; i++) {
            double e = fabs(ref[i] - ours[(size_t)(n - 1) * V + i]);
            if (e > worst) worst = e;
        }
    }
    ref_close(&rm);
    free(ref);
    return worst;
}

/* A family test's model: fill C's defaults, write it to PATH and load it into
 * *M; 0, or 1 with the reason on stderr. */
static REF64_UNUSED int ref_gen_load(kv_gen_config *c, const char *path, kv_model **m) {
    kv_gen_fill_defaults(c);
    kv_diag d = {0};
    if (kv_gen_model(c, path, &d) || kv_model_load(m, path, &d)) {
        fprintf(stderr, "model: %s\n", d.msg);
        return 1;
    }
    return 0;
}

/* Its teardown: our logits A, the model, its file PATH and folder DIR. */
static REF64_UNUSED void ref_gen_close(float *a, kv_model *m, const char *path, const char *dir) {
    free(a);
    kv_model_free(m);
    unlink(path);
    rmdir(dir);
}

#endif
