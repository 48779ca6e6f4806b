/* Float vector helpers for attention, dispatched at run time like the
 * quant kernels (scalar reference, AVX2, AVX-512; all bit-identical).
 *
 * Each output element has a fixed reduction order that depends only on its
 * own inputs, never on threads, batching or which backend runs:
 *  - kv_f32_dot_rows: out[p] = dot(K row p, q) * scale, where dot is F32
 *    vec_dot's canonical order (quant_internal.h: lane i%8, fma in
 *    increasing i, kv_hsum8), then one rounded multiply by scale.
 *  - kv_f32_wsum_rows: o[i] = sum over p = 0..n_rows-1 of w[p]*V[p][i],
 *    accumulated from 0 with one fma per p in increasing p.
 *  - kv_f32_delta_rows (one gated delta-rule step, row by row): for row j,
 *    m[i] = S_j[i] * decay (one rounded multiply); a = dot(m, k) in F32
 *    vec_dot's order; d = (v[j] - a) * beta (rounded subtract, then
 *    multiply); D_j[i] = fma(k[i], d, m[i]); o[j] = dot(D_j, q) in vec_dot's
 *    order, then one rounded multiply by scale.
 *  - kv_f32_softmax: x[i] = x[i] * scale (rounded); m = max x[i]; e[i] =
 *    kv_exp of x[i] - m (rounded subtract) as below; sum = the e[i] as
 *    doubles in 8 lanes (element i in lane i % 8, increasing i), folded
 *    ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)); x[i] = e[i] *
 *    (float)(1 / sum). kv_exp(y), for y <= 88: t = fma(y, log2 e, 1.5 * 2^23)
 *    (n = the nearest integer, in t's low bits), f = t - 1.5 * 2^23,
 *    r = fma(f, -ln2_hi, y), r = fma(f, -ln2_lo, r), p = the Taylor
 *    polynomial of degree 7 by Horner (p = 1/7!, then p = fma(p, r, c_k) for
 *    c_k = 1/6!, ..., 1/1!, 1/0!), e = p * 2^n (2^n built from n's bits);
 *    0 when y < -87. All constants are the floats named in ref.c.
 *  - kv_f32_silu: y[i] = x[i] / (1 + kv_exp(-x[i])) (one rounded add, one
 *    rounded divide) for -x[i] <= 88, else x[i] * 0 (-0; NaN for -inf, as
 *    x / (1 + e^inf) in libm floats); a NaN x gives x's NaN. */
#ifndef KV_QUANT_VEC_H
#define KV_QUANT_VEC_H

#include <stddef.h>
#include <stdint.h>

/* K row p at K + p*k_stride (floats); q and each row hold n floats. */
void kv_f32_dot_rows(const float *q, const float *K, size_t k_stride, int64_t n_rows, int64_t n,
                     float scale, float *out);
/* V row p at V + p*v_stride (floats); o gets n floats. */
void kv_f32_wsum_rows(float *o, const float *w, const float *V, size_t v_stride, int64_t n_rows,
                      int64_t n);
/* The same, continuing each o[i]'s fma chain from its current value, so a
 * sum over rows split in pieces (a paged KV cache) has the bits of one
 * call over all the rows. */
void kv_f32_wsum_rows_acc(float *o, const float *w, const float *V, size_t v_stride, int64_t n_rows,
                          int64_t n);
/* n_q weighted sums over the same rows: query j's weights at w + j*w_stride,
 * its output (n floats) at o + j*o_stride; each output element has the
 * bits of kv_f32_wsum_rows (acc = 0) or kv_f32_wsum_rows_acc (acc = 1) of
 * its query alone (the V loads are shared, the fma chains are not). */
void kv_f32_wsum_rows_multi(float *o, size_t o_stride, const float *w, size_t w_stride, int64_t n_q,
                            const float *V, size_t v_stride, int64_t n_rows, int64_t n, int acc);
/* One delta-rule token step over n_rows state rows of n floats (row j at
 * S + j*n, written to D + j*n; D may equal S, else the two must not
 * overlap). k, q have n floats; v and o have n_rows. */
void kv_f32_delta_rows(const float *S, float *D, int64_t n_rows, int64_t n, const float *k,
                       const float *q, const float *v, float decay, float beta, float scale,
                       float *o);
/* The same step (same bits) with D written past the caches where the backend
 * can (x86: streaming stores when D != S and D is 32-byte aligned): for a
 * state far larger than the caches that is read again only at the next token. */
void kv_f32_delta_rows_stream(const float *S, float *D, int64_t n_rows, int64_t n, const float *k,
                              const float *q, const float *v, float decay, float beta, float scale,
                              float *o);

/* Softmax of n floats in place after scaling each by scale (1: none),
 * the order above; n >= 1. */
void kv_f32_softmax(float *x, int64_t n, float scale);
/* y = silu(x) = x / (1 + e^-x) by the documented exp; y may be x. */
void kv_f32_silu(float *y, const float *x, int64_t n);

#endif
