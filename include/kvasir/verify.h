/* Verified expert compute: Freivalds checks of a stranger's expert output.
 *
 * An expert is y = Wd q(swiglu(g, u)), g = Wg q(x), u = Wu q(x), where q()
 * is the conversion of activations to the weight type's vec_dot_type (the
 * worker's kernels quantize x to Q8_0 / Q8_K for quantized weights). A
 * worker returns g and u beside y. For each matrix W (out x in) the verifier
 * keeps n_proj secret Gaussian vectors r (out), s = W^T r (in, f64), and the
 * column statistics a = |W|^T 1 and b = (W o W)^T 1 (in), computed from the
 * weights it trusts (a slab whose SHA-256 it checked) and never sent to
 * anyone. It then checks, in f64, for every r,
 *     r . g  ~  s_g . q(x)        r . u  ~  s_u . q(x)
 *     r . y  ~  s_d . q(swiglu(g, u))
 * within a tolerance T that follows from f32 rounding in the worker's dot
 * products and does not depend on r: a few dot products of length in + out
 * per (token, expert) instead of three matrix-vector products. They run in
 * the SIMD kernels of src/quant/vdot.h (f64 lanes: their order of addition is
 * within the rounding the bound already carries, docs/VERIFY.md), and
 * kv_verify_check_batch shares each read of an expert's projections, which
 * is what a check's time is bound by, among up to four answers.
 *
 * Why it cannot be fooled (docs/VERIFY.md derives it): an answer whose
 * error vector e (answer minus the exact product) has |e|_2 >= theta T
 * passes one Gaussian r with probability at most 2 T / (sqrt(2 pi) |e|),
 * and all n_proj of them at most kv_verify_miss_bound(n_proj, theta): below
 * 2^-20 per check at the defaults, whatever the shape of e (pairs, signs,
 * one element). The vectors come from a secret seed and a per-expert
 * generation counter through ChaCha20, and every `rotate_every` checks of
 * an expert they are replaced by the next generation, so a lie aimed at
 * vectors that leaked (or that passed once by luck) does not keep passing.
 *
 * The down input is recomputed here from the worker's g and u with the
 * engine's own SwiGLU and quantization, so an honest worker's y is the
 * product of exactly the vector checked. gpt-oss experts (biases, the
 * clamped SwiGLU) are checked the same way: g and u are answered before
 * their biases, the verifier adds them and applies the clamped activation
 * as src/moe/local.c does, and y carries down's bias, whose projection
 * r . b_d is taken off r . y (docs/VERIFY.md, "Biases"). Thread-safety: a kv_verify is used
 * by one thread (the coordinator's compute); prepare allocates each
 * expert's projections once; check never allocates. */
#ifndef KVASIR_VERIFY_H
#define KVASIR_VERIFY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/moe.h"

#define KV_VERIFY_MAX_PROJ 16u    /* Gaussian vectors per matrix, at most */
#define KV_VERIFY_DEFAULT_PROJ 8u /* per matrix by default: kv_verify_miss_bound(8, 5) < 2^-21 */
#define KV_VERIFY_KAPPA 64.0      /* default tolerance factor (docs/VERIFY.md) */
#define KV_VERIFY_THETA 5.0       /* |error| / tolerance from which a lie is caught w.p. > 1 - 2^-20 */
#define KV_VERIFY_ROTATE 65536u   /* checks of one expert per generation of its vectors, by default */

typedef struct kv_verify kv_verify;

typedef struct kv_verify_opts {
    uint32_t n_proj;   /* Gaussian vectors per matrix, 1..KV_VERIFY_MAX_PROJ; 0 = KV_VERIFY_DEFAULT_PROJ */
    double kappa;      /* statistical tolerance factor; 0 = KV_VERIFY_KAPPA */
    bool worst_case;   /* the rigorous bound n u max|r| sum|W||x| instead (never a false alarm on
                          F32/F16/Q8_0 weights, but blind to small lies; docs/VERIFY.md) */
    uint64_t seed;     /* 0: secret vectors from the OS's RNG; tests fix one */
    uint32_t rotate_every; /* checks of one expert after which its vectors are replaced by the
                          next generation (one pass over its weights); 0 = KV_VERIFY_ROTATE,
                          UINT32_MAX = never */
} kv_verify_opts;

/* One failed (or passed) comparison, for logs and tests. */
typedef struct kv_verify_report {
    int stage;         /* 0 gate, 1 up, 2 down; -1 when all passed */
    uint32_t proj;     /* the first vector beyond its tolerance */
    uint32_t n_over;   /* how many of the stage's n_proj vectors are beyond it */
    double lhs, rhs;   /* r . out and s . in */
    double tol;        /* allowed |lhs - rhs| */
    double worst_ratio; /* max |lhs - rhs| / tol over every comparison made */
    uint64_t generation; /* of the expert's vectors that were used */
} kv_verify_report;

/* A verifier for n_layer x n_expert experts of dims n_embd x n_ff (no
 * projections yet). KV_EINVAL / KV_ENOMEM. Free with kv_verify_free. */
int kv_verify_new(kv_verify **out, uint32_t n_layer, uint32_t n_expert, uint32_t n_embd, uint32_t n_ff,
                  const kv_verify_opts *opts, kv_diag *d);
void kv_verify_free(kv_verify *v);

/* Computes expert (layer, e)'s projections from its weights (one pass over
 * the three matrices, dequantized, accumulated in f64); a second call is a
 * no-op. The matrices w points to are read again whenever the expert's
 * vectors rotate, and its biases at every check, so they must stay readable
 * (a mapped slab) until kv_verify_free; *w itself is copied. KV_EUNSUPPORTED for what kv_verify_supported
 * refuses, KV_ENOMEM. */
int kv_verify_prepare(kv_verify *v, uint32_t layer, uint32_t e, const kv_expert_weights *w, kv_diag *d);
bool kv_verify_ready(const kv_verify *v, uint32_t layer, uint32_t e);

/* Checks one (token, expert) answer: x [n_embd] (the hidden state sent),
 * gate, up [n_ff] and y [n_embd] (what the worker returned). Returns 0 if
 * every comparison holds, KV_EPROTO ("caught": d names the stage) if one
 * does not or a value is not finite, KV_ENOTFOUND if the expert is not
 * prepared. rep (may be NULL) gets the details. The expert's rotate_every-th
 * check since its vectors were made first replaces them (one pass over its
 * weights). */
int kv_verify_check(kv_verify *v, uint32_t layer, uint32_t e, const float *x, const float *gate, const float *up,
                    const float *y, kv_verify_report *rep, kv_diag *d);

/* n answers of expert (layer, e) at once: answer k is x[k], gate[k], up[k],
 * y[k]. The same outcome as kv_verify_check on each in turn, stopping at the
 * first that fails (its index in *bad, may be NULL; rep as that call would
 * fill it, worst_ratio over every answer checked), but each load of the
 * projections serves up to four answers: what a check's time is bound by
 * (docs/VERIFY.md, "Cost"). Answers of one expert in one message should be
 * checked this way. */
int kv_verify_check_batch(kv_verify *v, uint32_t layer, uint32_t e, uint32_t n, const float *const *x,
                          const float *const *gate, const float *const *up, const float *const *y, uint32_t *bad,
                          kv_verify_report *rep, kv_diag *d);

/* The probability bound of docs/VERIFY.md: an answer of a matrix with out
 * rows whose error has norm ratio x the tolerance passes n_proj independent
 * Gaussian vectors with probability at most
 * (sqrt(2 / pi) (1 / ratio + 2^-23 sqrt(out)))^n_proj, 1 when that exceeds 1
 * (the 2^-23 sqrt(out) covers the vectors' rounding to f32). */
double kv_verify_miss_bound(uint32_t n_proj, double ratio, uint32_t out);

/* Bytes of projections held now, and per prepared expert: the vectors,
 * projections and statistics (kv_verify_expert_bytes), plus for the
 * matrices with Q8_1 activations (Q4_1, Q5_1) their projected block mins
 * (kv_verify_weights_bytes counts them for w's types). */
size_t kv_verify_bytes(const kv_verify *v);
size_t kv_verify_expert_bytes(uint32_t n_embd, uint32_t n_ff, uint32_t n_proj);
size_t kv_verify_weights_bytes(const kv_expert_weights *w, uint32_t n_embd, uint32_t n_ff, uint32_t n_proj);

/* Whether the verifier can check experts of layer `layer` with w's tensor
 * types and activation (what kv_verify_prepare would refuse), without
 * preparing anything: callers run it when they load the weights, so a type
 * the verifier cannot read is refused at startup, naming the tensor and its
 * type, never at the first answer. 0 or KV_EUNSUPPORTED. */
int kv_verify_supported(const kv_expert_weights *w, uint32_t layer, uint32_t n_embd, uint32_t n_ff, kv_diag *d);

#endif
