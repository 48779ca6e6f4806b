/* Kernels of the verifier's Freivalds checks (src/verify/verify.c,
 * docs/VERIFY.md): the projections of one matrix's answer and input, per
 * backend (scalar reference in vdot.c, AVX2, AVX-512, NEON beside it), chosen
 * at run time with the quant kernels' level (kv_quant_backend()).
 *
 * All sums are f64. The products r_i o_i (f32 x f32) are exact in f64; the
 * backends differ only in the order in which they add the terms (lanes,
 * unrolled chains), so their results differ from the reference by less than
 * the f64 rounding bound that the tolerance already carries for any order:
 * |error| <= (n + 1) 2^-53 sum |terms| (docs/VERIFY.md). tests/test_verify.c
 * holds every backend to the reference within that bound. */
#ifndef KV_QUANT_VDOT_H
#define KV_QUANT_VDOT_H

#include <stdbool.h>
#include <stdint.h>

/* One stage of a check for nt answers (1..KV_VDOT_MAX_NT) of the same
 * matrix, with n_proj = P vectors stored one after the other (r: P rows of
 * n_out, s: P rows of n_in); for each answer t:
 *   lhs[t P + p] = sum_{i < n_out} r[p n_out + i] * o[t][i]   (r f32, o f32)
 *   rhs[t P + p] = sum_{j < n_in}  s[p n_in + j] * x[t][j]    (s f64, x f32)
 *   S[t] = sum_j a[j] |x[t][j]|,  B[t] = sum_j b[j] x[t][j]^2 (the tolerance's sums)
 * written, not accumulated; P in 1..16. Several answers share each load of r
 * and s, which is what bounds a check's time (docs/VERIFY.md, "Cost"). */
#define KV_VDOT_MAX_NT 4
typedef void (*kv_vdot_fn)(uint32_t P, uint32_t nt, const float *r, const float *const *o, uint32_t n_out,
                           const double *s, const float *a, const float *b, const float *const *x, uint32_t n_in,
                           double *lhs, double *rhs, double *S, double *B);
/* out[j] = d * q[j] for the activation blocks of type vdt (Q8_0 or Q8_K):
 * bit for bit the type's to_float (one rounded multiply per value). */
typedef void (*kv_vdeq_fn)(uint32_t vdt, const void *q, float *out, uint32_t n);

typedef struct kv_vkernels {
    const char *name;  /* the backend: "scalar", "avx2", "avx512", "neon" */
    kv_vdot_fn dots;
    kv_vdeq_fn deq;
    bool (*finite)(const float *x, uint32_t n); /* none of x[0..n) is an infinity or a NaN */
    /* h = kv_swiglu(g, u) bit for bit (h must not overlap g or u): the same
     * libm expf per value, the divide, add and multiply in vector lanes */
    void (*swiglu)(float *h, const float *g, const float *u, uint32_t n);
    /* s[p stride + j] += rp[p] * w[j] for p < P, j < n, a rounded multiply then a rounded
     * add (no fused multiply-add: the bits of the reference on every backend); the rows of
     * the vectors' s = W^T r when their generation is made */
    void (*axpy)(uint32_t P, const double *rp, const float *w, uint32_t n, double *s, size_t stride);
    /* x (n floats, finite) to Q8_K blocks: the bits of the type's from_float; NULL: use that */
    void (*q8k)(const float *x, void *dst, uint32_t n);
} kv_vkernels;

/* The kernels of the quant level in use now (kv_quant_backend(); a level's
 * own, else the next lower one's). Never NULL. */
const kv_vkernels *kv_vkernels_get(void);
/* The scalar reference (always available), for tests. */
const kv_vkernels *kv_vkernels_ref(void);


/* Per-ISA entry points (vdot_avx2.c, vdot_avx512.c, vdot_neon.c): only
 * called on a CPU that runs them. */
#define KV_VDOT_ARGS                                                                                            \
    uint32_t P, uint32_t nt, const float *r, const float *const *o, uint32_t n_out, const double *s, const float *a, \
        const float *b, const float *const *x, uint32_t n_in, double *lhs, double *rhs, double *S, double *B
void kv_vdots_ref(KV_VDOT_ARGS);
void kv_vdeq_ref(uint32_t vdt, const void *q, float *out, uint32_t n);
bool kv_vfinite_ref(const float *x, uint32_t n);
bool kv_vfinite_avx2(const float *x, uint32_t n);
void kv_vswiglu_ref(float *h, const float *g, const float *u, uint32_t n);
void kv_vaxpy_ref(uint32_t P, const double *rp, const float *w, uint32_t n, double *s, size_t stride);
void kv_vaxpy_avx2(uint32_t P, const double *rp, const float *w, uint32_t n, double *s, size_t stride);
void kv_vaxpy_avx512(uint32_t P, const double *rp, const float *w, uint32_t n, double *s, size_t stride);
void kv_vq8k_avx512(const float *x, void *dst, uint32_t n);
void kv_vaxpy_neon(uint32_t P, const double *rp, const float *w, uint32_t n, double *s, size_t stride);
void kv_vswiglu_avx2(float *h, const float *g, const float *u, uint32_t n);
void kv_vdots_avx2(KV_VDOT_ARGS);
void kv_vdeq_avx2(uint32_t vdt, const void *q, float *out, uint32_t n);
void kv_vdots_avx512(KV_VDOT_ARGS);
void kv_vdots_neon(KV_VDOT_ARGS);
void kv_vdeq_neon(uint32_t vdt, const void *q, float *out, uint32_t n);

#endif
