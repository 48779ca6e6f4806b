/* AVX-512 kernels of the verifier (quant/vdot.h); only called after
 * run-time detection. f64 in 8-lane zmm registers: a row of P interleaved
 * projections (P = 8 or 16) is P/8 registers, 8 independent accumulator
 * chains per stage, added at the end; the tolerance's sums S and B take 8
 * columns per register. Several answers (dotsT) share each load of r and s.
 * The same terms as the reference in another order (quant/vdot.h states
 * the bound). Other P: the AVX2 kernel. The
 * activation blocks are dequantized by the AVX2 kernel (vdot_avx2.c). */
#include <immintrin.h>

#include "quant/quant_internal.h"
#include "quant/vdot.h"

#define AI static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16") /* the chains must stay in registers */

/* NP = P / 8 registers per row, U rows in flight (NP * U = 8 chains) */
AI void dots8(const uint32_t NP, const uint32_t U, const float *r, const float *o, uint32_t n_out,
              const double *s, const float *a, const float *b, const float *x, uint32_t n_in, double *lhs,
              double *rhs, double *S, double *B) {
    const uint32_t P = 8 * NP;
    __m512d acc[8];
    UNROLL
    for (int k = 0; k < 8; k++) acc[k] = _mm512_setzero_pd();
    uint32_t i = 0;
    for (; i + U <= n_out; i += U)
        UNROLL
        for (uint32_t u = 0; u < U; u++) {
            const __m512d ou = _mm512_set1_pd((double)o[i + u]);
            UNROLL
            for (uint32_t c = 0; c < NP; c++)
                acc[u * NP + c] = _mm512_fmadd_pd(
                    _mm512_cvtps_pd(_mm256_loadu_ps(r + (size_t)(i + u) * P + 8 * c)), ou, acc[u * NP + c]);
        }
    for (; i < n_out; i++) {
        const __m512d ou = _mm512_set1_pd((double)o[i]);
        UNROLL
        for (uint32_t c = 0; c < NP; c++)
            acc[c] = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_loadu_ps(r + (size_t)i * P + 8 * c)), ou, acc[c]);
    }
    UNROLL
    for (uint32_t c = 0; c < NP; c++) {
        __m512d t = acc[c];
        UNROLL
        for (uint32_t u = 1; u < U; u++) t = _mm512_add_pd(t, acc[u * NP + c]);
        _mm512_storeu_pd(lhs + 8 * c, t);
    }
    UNROLL
    for (int k = 0; k < 8; k++) acc[k] = _mm512_setzero_pd();
    __m512d sa = _mm512_setzero_pd(), sb = _mm512_setzero_pd();
    double xd[8] __attribute__((aligned(64)));
    uint32_t j = 0;
    for (; j + 8 <= n_in; j += 8) {
        const __m512d xv = _mm512_cvtps_pd(_mm256_loadu_ps(x + j));
        sa = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_loadu_ps(a + j)), _mm512_abs_pd(xv), sa);
        sb = _mm512_fmadd_pd(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(b + j)), xv), xv, sb);
        _mm512_store_pd(xd, xv);
        UNROLL
        for (uint32_t k = 0; k < 8; k++) {
            const __m512d xk = _mm512_set1_pd(xd[k]);
            const double *sj = s + (size_t)(j + k) * P;
            const uint32_t u = k % U;
            UNROLL
            for (uint32_t c = 0; c < NP; c++)
                acc[u * NP + c] = _mm512_fmadd_pd(_mm512_loadu_pd(sj + 8 * c), xk, acc[u * NP + c]);
        }
    }
    double s_ = _mm512_reduce_add_pd(sa), b_ = _mm512_reduce_add_pd(sb);
    for (; j < n_in; j++) {
        const double xj = x[j];
        const __m512d xk = _mm512_set1_pd(xj);
        UNROLL
        for (uint32_t c = 0; c < NP; c++)
            acc[c] = _mm512_fmadd_pd(_mm512_loadu_pd(s + (size_t)j * P + 8 * c), xk, acc[c]);
        s_ += (double)a[j] * (xj < 0 ? -xj : xj);
        b_ += (double)b[j] * xj * xj;
    }
    UNROLL
    for (uint32_t c = 0; c < NP; c++) {
        __m512d t = acc[c];
        UNROLL
        for (uint32_t u = 1; u < U; u++) t = _mm512_add_pd(t, acc[u * NP + c]);
        _mm512_storeu_pd(rhs + 8 * c, t);
    }
    *S = s_, *B = b_;
}

/* S and B of one answer, 8 columns per register */
AI void sums8(const float *a, const float *b, const float *x, uint32_t n_in, double *S, double *B) {
    __m512d sa = _mm512_setzero_pd(), sb = _mm512_setzero_pd();
    uint32_t j = 0;
    for (; j + 8 <= n_in; j += 8) {
        const __m512d xv = _mm512_cvtps_pd(_mm256_loadu_ps(x + j));
        sa = _mm512_fmadd_pd(_mm512_cvtps_pd(_mm256_loadu_ps(a + j)), _mm512_abs_pd(xv), sa);
        sb = _mm512_fmadd_pd(_mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(b + j)), xv), xv, sb);
    }
    double s_ = _mm512_reduce_add_pd(sa), b_ = _mm512_reduce_add_pd(sb);
    for (; j < n_in; j++) {
        const double xj = x[j];
        s_ += (double)a[j] * (xj < 0 ? -xj : xj);
        b_ += (double)b[j] * xj * xj;
    }
    *S = s_, *B = b_;
}

/* NT answers at once: each row of r and of s is loaded once for all of
 * them; NP registers per row, U rows in flight, NT * U * NP chains */
AI void dotsT(const uint32_t NP, const uint32_t U, const uint32_t NT, const float *r, const float *const *o,
              uint32_t n_out, const double *s, const float *const *x, uint32_t n_in, double *lhs, double *rhs) {
    const uint32_t P = 8 * NP;
    __m512d acc[16];
    UNROLL
    for (int k = 0; k < 16; k++) acc[k] = _mm512_setzero_pd();
    uint32_t i = 0;
    for (; i + U <= n_out; i += U)
        UNROLL
        for (uint32_t u = 0; u < U; u++) {
            __m512d rv[2];
            UNROLL
            for (uint32_t c = 0; c < NP; c++) rv[c] = _mm512_cvtps_pd(_mm256_loadu_ps(r + (size_t)(i + u) * P + 8 * c));
            UNROLL
            for (uint32_t t = 0; t < NT; t++) {
                const __m512d ot = _mm512_set1_pd((double)o[t][i + u]);
                UNROLL
                for (uint32_t c = 0; c < NP; c++)
                    acc[(t * U + u) * NP + c] = _mm512_fmadd_pd(rv[c], ot, acc[(t * U + u) * NP + c]);
            }
        }
    for (; i < n_out; i++)
        UNROLL
        for (uint32_t c = 0; c < NP; c++) {
            const __m512d rv = _mm512_cvtps_pd(_mm256_loadu_ps(r + (size_t)i * P + 8 * c));
            UNROLL
            for (uint32_t t = 0; t < NT; t++)
                acc[t * U * NP + c] = _mm512_fmadd_pd(rv, _mm512_set1_pd((double)o[t][i]), acc[t * U * NP + c]);
        }
    UNROLL
    for (uint32_t t = 0; t < NT; t++)
        UNROLL
        for (uint32_t c = 0; c < NP; c++) {
            __m512d v = acc[t * U * NP + c];
            UNROLL
            for (uint32_t u = 1; u < U; u++) v = _mm512_add_pd(v, acc[(t * U + u) * NP + c]);
            _mm512_storeu_pd(lhs + t * P + 8 * c, v);
        }
    UNROLL
    for (int k = 0; k < 16; k++) acc[k] = _mm512_setzero_pd();
    double xd[4][8] __attribute__((aligned(64)));
    uint32_t j = 0;
    for (; j + 8 <= n_in; j += 8) {
        UNROLL
        for (uint32_t t = 0; t < NT; t++) _mm512_store_pd(xd[t], _mm512_cvtps_pd(_mm256_loadu_ps(x[t] + j)));
        UNROLL
        for (uint32_t k = 0; k < 8; k++) {
            const uint32_t u = k % U;
            UNROLL
            for (uint32_t c = 0; c < NP; c++) {
                const __m512d sv = _mm512_loadu_pd(s + (size_t)(j + k) * P + 8 * c);
                UNROLL
                for (uint32_t t = 0; t < NT; t++)
                    acc[(t * U + u) * NP + c] = _mm512_fmadd_pd(sv, _mm512_set1_pd(xd[t][k]), acc[(t * U + u) * NP + c]);
            }
        }
    }
    for (; j < n_in; j++)
        UNROLL
        for (uint32_t c = 0; c < NP; c++) {
            const __m512d sv = _mm512_loadu_pd(s + (size_t)j * P + 8 * c);
            UNROLL
            for (uint32_t t = 0; t < NT; t++)
                acc[t * U * NP + c] = _mm512_fmadd_pd(sv, _mm512_set1_pd((double)x[t][j]), acc[t * U * NP + c]);
        }
    UNROLL
    for (uint32_t t = 0; t < NT; t++)
        UNROLL
        for (uint32_t c = 0; c < NP; c++) {
            __m512d v = acc[t * U * NP + c];
            UNROLL
            for (uint32_t u = 1; u < U; u++) v = _mm512_add_pd(v, acc[(t * U + u) * NP + c]);
            _mm512_storeu_pd(rhs + t * P + 8 * c, v);
        }
}

void kv_vdots_avx512(KV_VDOT_ARGS) {
    if (nt == 1 && (P == 8 || P == 16)) {
        if (P == 8)
            dots8(1, 8, r, o[0], n_out, s, a, b, x[0], n_in, lhs, rhs, S, B);
        else
            dots8(2, 4, r, o[0], n_out, s, a, b, x[0], n_in, lhs, rhs, S, B);
        return;
    }
    if (P != 8 && P != 16) {
        kv_vdots_avx2(P, nt, r, o, n_out, s, a, b, x, n_in, lhs, rhs, S, B);
        return;
    }
    for (uint32_t t = 0; t < nt; t++) sums8(a, b, x[t], n_in, S + t, B + t);
    switch (nt * 100 + P) {
    case 208: dotsT(1, 4, 2, r, o, n_out, s, x, n_in, lhs, rhs); return;
    case 308: dotsT(1, 2, 3, r, o, n_out, s, x, n_in, lhs, rhs); return;
    case 408: dotsT(1, 2, 4, r, o, n_out, s, x, n_in, lhs, rhs); return;
    case 216: dotsT(2, 2, 2, r, o, n_out, s, x, n_in, lhs, rhs); return;
    case 316: dotsT(2, 1, 3, r, o, n_out, s, x, n_in, lhs, rhs); return;
    case 416: dotsT(2, 1, 4, r, o, n_out, s, x, n_in, lhs, rhs); return;
    default: kv_vdots_ref(P, nt, r, o, n_out, s, a, b, x, n_in, lhs, rhs, S, B); /* nt > KV_VDOT_MAX_NT */
    }
}
