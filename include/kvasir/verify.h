/* Verified expert compute: Freivalds checks of a stranger's expert output.
 *
 * An expert is y = Wd q(swiglu(g, u)), g = Wg q(x), u = Wu q(x), where q()
 * is the conversion of activations to the weight type's vec_dot_type (the
 * worker's kernels quantize x to Q8_0 / Q8_K for quantized weights). A
 * worker returns g and u beside y. For each matrix W (out x in) and each of
 * n_proj secret random sign vectors r (out), the verifier keeps s = W^T r
 * and the column magnitudes a = |W|^T 1 (both in), computed once from the
 * weights it trusts (a slab whose SHA-256 it checked) and never sent to
 * anyone. It then checks, in f64,
 *     r . g  ~  s_g . q(x)        r . u  ~  s_u . q(x)
 *     r . y  ~  s_d . q(swiglu(g, u))
 * within a tolerance that follows from f32 rounding in the worker's dot
 * products (docs/VERIFY.md derives it): a few dot products of length in +
 * out per (token, expert) instead of three matrix-vector products.
 *
 * The down input is recomputed here from the worker's g and u with the
 * engine's own SwiGLU and quantization, so an honest worker's y is the
 * product of exactly the vector checked. Thread-safety: a kv_verify is used
 * by one thread (the coordinator's compute); prepare and check allocate
 * nothing after kv_verify_new except each expert's projections, once. */
#ifndef KVASIR_VERIFY_H
#define KVASIR_VERIFY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/moe.h"

#define KV_VERIFY_MAX_PROJ 8u    /* random vectors per matrix */
#define KV_VERIFY_KAPPA 64.0     /* default tolerance factor (docs/VERIFY.md) */

typedef struct kv_verify kv_verify;

typedef struct kv_verify_opts {
    uint32_t n_proj;   /* random sign vectors per matrix, 1..KV_VERIFY_MAX_PROJ; 0 = 2 */
    double kappa;      /* statistical tolerance factor; 0 = KV_VERIFY_KAPPA */
    bool worst_case;   /* the rigorous bound n u sum|W||x| instead (never a false alarm on
                          F32/F16/Q8_0 weights, but blind to small lies; docs/VERIFY.md) */
    uint64_t seed;     /* 0: secret vectors from the OS's RNG; tests fix one */
} kv_verify_opts;

/* One failed (or passed) comparison, for logs and tests. */
typedef struct kv_verify_report {
    int stage;         /* 0 gate, 1 up, 2 down; -1 when all passed */
    uint32_t proj;     /* which random vector */
    double lhs, rhs;   /* r . out and s . in */
    double tol;        /* allowed |lhs - rhs| */
    double worst_ratio; /* max |lhs - rhs| / tol over every comparison made */
} kv_verify_report;

/* A verifier for n_layer x n_expert experts of dims n_embd x n_ff (no
 * projections yet). KV_EINVAL / KV_ENOMEM. Free with kv_verify_free. */
int kv_verify_new(kv_verify **out, uint32_t n_layer, uint32_t n_expert, uint32_t n_embd, uint32_t n_ff,
                  const kv_verify_opts *opts, kv_diag *d);
void kv_verify_free(kv_verify *v);

/* Computes expert (layer, e)'s projections from its weights (one pass over
 * the three matrices, dequantized to f64); a second call is a no-op.
 * KV_EUNSUPPORTED for a weight type without to_float, KV_ENOMEM. */
int kv_verify_prepare(kv_verify *v, uint32_t layer, uint32_t e, const kv_expert_weights *w, kv_diag *d);
bool kv_verify_ready(const kv_verify *v, uint32_t layer, uint32_t e);

/* Checks one (token, expert) answer: x [n_embd] (the hidden state sent),
 * gate, up [n_ff] and y [n_embd] (what the worker returned). Returns 0 if
 * every comparison holds, KV_EPROTO ("caught": d names the stage) if one
 * does not or a value is not finite, KV_ENOTFOUND if the expert is not
 * prepared. rep (may be NULL) gets the details. */
int kv_verify_check(kv_verify *v, uint32_t layer, uint32_t e, const float *x, const float *gate, const float *up,
                    const float *y, kv_verify_report *rep, kv_diag *d);

/* Bytes of projections held now, and per prepared expert. */
size_t kv_verify_bytes(const kv_verify *v);
size_t kv_verify_expert_bytes(uint32_t n_embd, uint32_t n_ff, uint32_t n_proj);

#endif
