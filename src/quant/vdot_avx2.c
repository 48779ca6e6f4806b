/* AVX2 kernels of the verifier (quant/vdot.h); only called after run-time
 * detection. f64 in 4-lane ymm registers: a row of P interleaved projections
 * is P/4 registers, and each stage keeps 8 independent accumulator chains
 * (rows i, i + 1, ... in turn) so that the FMA latency is hidden; the chains
 * are added at the end. Two to four answers of P = 4 or 8 (dotsT) share
 * each load of r and s. The same terms as the reference in another order
 * (quant/vdot.h states the bound). P not a multiple of 4: the reference. */
#include <immintrin.h>
#include <math.h>

#include "quant/quant_internal.h"
#include "quant/vdot.h"

#define AI static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16") /* the chains must stay in registers */

AI double hsum4d(__m256d v) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

/* NP = P / 4 registers per row, U rows in flight (NP * U = 8 chains) */
AI void dots4(const uint32_t NP, const uint32_t U, const float *r, const float *o, uint32_t n_out,
              const double *s, const float *a, const float *b, const float *x, uint32_t n_in, double *lhs,
              double *rhs, double *S, double *B) {
    const uint32_t P = 4 * NP;
    __m256d acc[8];
    UNROLL
    for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_pd();
    uint32_t i = 0;
    for (; i + U <= n_out; i += U)
        UNROLL
        for (uint32_t u = 0; u < U; u++) {
            const __m256d ou = _mm256_set1_pd((double)o[i + u]);
            UNROLL
            for (uint32_t c = 0; c < NP; c++)
                acc[u * NP + c] = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(r + (size_t)(i + u) * P + 4 * c)),
                                                  ou, acc[u * NP + c]);
        }
    for (; i < n_out; i++) {
        const __m256d ou = _mm256_set1_pd((double)o[i]);
        UNROLL
        for (uint32_t c = 0; c < NP; c++)
            acc[c] = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(r + (size_t)i * P + 4 * c)), ou, acc[c]);
    }
    UNROLL
    for (uint32_t c = 0; c < NP; c++) {
        __m256d t = acc[c];
        UNROLL
        for (uint32_t u = 1; u < U; u++) t = _mm256_add_pd(t, acc[u * NP + c]);
        _mm256_storeu_pd(lhs + 4 * c, t);
    }
    UNROLL
    for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_pd();
    __m256d sa = _mm256_setzero_pd(), sb = _mm256_setzero_pd();
    const __m256d nosign = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffll));
    double xd[8] __attribute__((aligned(32)));
    uint32_t j = 0;
    for (; j + 8 <= n_in; j += 8) {
        UNROLL
        for (int h = 0; h < 2; h++) {
            const __m256d xv = _mm256_cvtps_pd(_mm_loadu_ps(x + j + 4 * h));
            sa = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(a + j + 4 * h)), _mm256_and_pd(xv, nosign), sa);
            sb = _mm256_fmadd_pd(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(b + j + 4 * h)), xv), xv, sb);
            _mm256_store_pd(xd + 4 * h, xv);
        }
        UNROLL
        for (uint32_t k = 0; k < 8; k++) {
            const __m256d xk = _mm256_broadcast_sd(xd + k);
            const double *sj = s + (size_t)(j + k) * P;
            const uint32_t u = k % U;
            UNROLL
            for (uint32_t c = 0; c < NP; c++)
                acc[u * NP + c] = _mm256_fmadd_pd(_mm256_loadu_pd(sj + 4 * c), xk, acc[u * NP + c]);
        }
    }
    double s_ = hsum4d(sa), b_ = hsum4d(sb);
    for (; j < n_in; j++) {
        const double xj = x[j];
        const __m256d xk = _mm256_set1_pd(xj);
        UNROLL
        for (uint32_t c = 0; c < NP; c++)
            acc[c] = _mm256_fmadd_pd(_mm256_loadu_pd(s + (size_t)j * P + 4 * c), xk, acc[c]);
        s_ += (double)a[j] * (xj < 0 ? -xj : xj);
        b_ += (double)b[j] * xj * xj;
    }
    UNROLL
    for (uint32_t c = 0; c < NP; c++) {
        __m256d t = acc[c];
        UNROLL
        for (uint32_t u = 1; u < U; u++) t = _mm256_add_pd(t, acc[u * NP + c]);
        _mm256_storeu_pd(rhs + 4 * c, t);
    }
    *S = s_, *B = b_;
}

/* S and B of one answer, 4 columns per register */
AI void sums4(const float *a, const float *b, const float *x, uint32_t n_in, double *S, double *B) {
    const __m256d nosign = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffll));
    __m256d sa = _mm256_setzero_pd(), sb = _mm256_setzero_pd();
    uint32_t j = 0;
    for (; j + 4 <= n_in; j += 4) {
        const __m256d xv = _mm256_cvtps_pd(_mm_loadu_ps(x + j));
        sa = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm_loadu_ps(a + j)), _mm256_and_pd(xv, nosign), sa);
        sb = _mm256_fmadd_pd(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(b + j)), xv), xv, sb);
    }
    double s_ = hsum4d(sa), b_ = hsum4d(sb);
    for (; j < n_in; j++) {
        const double xj = x[j];
        s_ += (double)a[j] * (xj < 0 ? -xj : xj);
        b_ += (double)b[j] * xj * xj;
    }
    *S = s_, *B = b_;
}

/* NT answers at once: each row of r and of s is loaded once for all of
 * them; NP registers per row, U rows in flight, NT * U * NP <= 8 chains */
AI void dotsT(const uint32_t NP, const uint32_t U, const uint32_t NT, const float *r, const float *const *o,
              uint32_t n_out, const double *s, const float *const *x, uint32_t n_in, double *lhs, double *rhs) {
    const uint32_t P = 4 * NP;
    __m256d acc[8];
    UNROLL
    for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_pd();
    uint32_t i = 0;
    for (; i + U <= n_out; i += U)
        UNROLL
        for (uint32_t u = 0; u < U; u++) {
            __m256d rv[2];
            UNROLL
            for (uint32_t c = 0; c < NP; c++) rv[c] = _mm256_cvtps_pd(_mm_loadu_ps(r + (size_t)(i + u) * P + 4 * c));
            UNROLL
            for (uint32_t t = 0; t < NT; t++) {
                const __m256d ot = _mm256_set1_pd((double)o[t][i + u]);
                UNROLL
                for (uint32_t c = 0; c < NP; c++)
                    acc[(t * U + u) * NP + c] = _mm256_fmadd_pd(rv[c], ot, acc[(t * U + u) * NP + c]);
            }
        }
    for (; i < n_out; i++)
        UNROLL
        for (uint32_t c = 0; c < NP; c++) {
            const __m256d rv = _mm256_cvtps_pd(_mm_loadu_ps(r + (size_t)i * P + 4 * c));
            UNROLL
            for (uint32_t t = 0; t < NT; t++)
                acc[t * U * NP + c] = _mm256_fmadd_pd(rv, _mm256_set1_pd((double)o[t][i]), acc[t * U * NP + c]);
        }
    UNROLL
    for (uint32_t t = 0; t < NT; t++)
        UNROLL
        for (uint32_t c = 0; c < NP; c++) {
            __m256d v = acc[t * U * NP + c];
            UNROLL
            for (uint32_t u = 1; u < U; u++) v = _mm256_add_pd(v, acc[(t * U + u) * NP + c]);
            _mm256_storeu_pd(lhs + t * P + 4 * c, v);
        }
    UNROLL
    for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_pd();
    double xd[4][8] __attribute__((aligned(32)));
    uint32_t j = 0;
    for (; j + 8 <= n_in; j += 8) {
        UNROLL
        for (uint32_t t = 0; t < NT; t++) {
            _mm256_store_pd(xd[t], _mm256_cvtps_pd(_mm_loadu_ps(x[t] + j)));
            _mm256_store_pd(xd[t] + 4, _mm256_cvtps_pd(_mm_loadu_ps(x[t] + j + 4)));
        }
        UNROLL
        for (uint32_t k = 0; k < 8; k++) {
            const uint32_t u = k % U;
            UNROLL
            for (uint32_t c = 0; c < NP; c++) {
                const __m256d sv = _mm256_loadu_pd(s + (size_t)(j + k) * P + 4 * c);
                UNROLL
                for (uint32_t t = 0; t < NT; t++)
                    acc[(t * U + u) * NP + c] = _mm256_fmadd_pd(sv, _mm256_broadcast_sd(&xd[t][k]), acc[(t * U + u) * NP + c]);
            }
        }
    }
    for (; j < n_in; j++)
        UNROLL
        for (uint32_t c = 0; c < NP; c++) {
            const __m256d sv = _mm256_loadu_pd(s + (size_t)j * P + 4 * c);
            UNROLL
            for (uint32_t t = 0; t < NT; t++)
                acc[t * U * NP + c] = _mm256_fmadd_pd(sv, _mm256_set1_pd((double)x[t][j]), acc[t * U * NP + c]);
        }
    UNROLL
    for (uint32_t t = 0; t < NT; t++)
        UNROLL
        for (uint32_t c = 0; c < NP; c++) {
            __m256d v = acc[t * U * NP + c];
            UNROLL
            for (uint32_t u = 1; u < U; u++) v = _mm256_add_pd(v, acc[(t * U + u) * NP + c]);
            _mm256_storeu_pd(rhs + t * P + 4 * c, v);
        }
}

/* one answer at a time, as dots4 does it */
static void one4(uint32_t P, const float *r, const float *o, uint32_t n_out, const double *s, const float *a,
                 const float *b, const float *x, uint32_t n_in, double *lhs, double *rhs, double *S, double *B) {
    switch (P) {
    case 4: dots4(1, 8, r, o, n_out, s, a, b, x, n_in, lhs, rhs, S, B); return;
    case 8: dots4(2, 4, r, o, n_out, s, a, b, x, n_in, lhs, rhs, S, B); return;
    case 12: dots4(3, 2, r, o, n_out, s, a, b, x, n_in, lhs, rhs, S, B); return;
    case 16: dots4(4, 2, r, o, n_out, s, a, b, x, n_in, lhs, rhs, S, B); return;
    default: kv_vdots_ref(P, 1, r, &o, n_out, s, a, b, &x, n_in, lhs, rhs, S, B);
    }
}

void kv_vdots_avx2(KV_VDOT_ARGS) {
    if (nt >= 2 && nt <= 4 && (P == 4 || P == 8)) {
        for (uint32_t t = 0; t < nt; t++) sums4(a, b, x[t], n_in, S + t, B + t);
        switch (nt * 100 + P) {
        case 204: dotsT(1, 4, 2, r, o, n_out, s, x, n_in, lhs, rhs); return;
        case 304: dotsT(1, 2, 3, r, o, n_out, s, x, n_in, lhs, rhs); return;
        case 404: dotsT(1, 2, 4, r, o, n_out, s, x, n_in, lhs, rhs); return;
        case 208: dotsT(2, 2, 2, r, o, n_out, s, x, n_in, lhs, rhs); return;
        case 308: dotsT(2, 1, 3, r, o, n_out, s, x, n_in, lhs, rhs); return;
        default: dotsT(2, 1, 4, r, o, n_out, s, x, n_in, lhs, rhs); return;
        }
    }
    for (uint32_t t = 0; t < nt; t++) /* wider rows (P = 12, 16) keep 8 chains per answer */
        one4(P, r, o[t], n_out, s, a, b, x[t], n_in, lhs + t * P, rhs + t * P, S + t, B + t);
}

/* d * (float)q, one rounded multiply per value: the bits of to_float */
AI void deq32(const int8_t *q, float d, float *out) {
    const __m256 dv = _mm256_set1_ps(d);
    UNROLL
    for (int k = 0; k < 4; k++) {
        const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * k)));
        _mm256_storeu_ps(out + 8 * k, _mm256_mul_ps(_mm256_cvtepi32_ps(w), dv));
    }
}

void kv_vdeq_avx2(uint32_t vdt, const void *q, float *out, uint32_t n) {
    if (vdt == KV_TYPE_Q8_K) {
        const kv_block_q8_K *bk = q;
        for (uint32_t i = 0; i < n / KV_QK_K; i++)
            UNROLL
            for (int c = 0; c < KV_QK_K / 32; c++) deq32(bk[i].qs + 32 * c, bk[i].d, out + (size_t)i * KV_QK_K + 32 * c);
    } else if (vdt == KV_TYPE_Q8_0) {
        const kv_block_q8_0 *b0 = q;
        for (uint32_t i = 0; i < n / KV_QK8_0; i++) deq32(b0[i].qs, kv_fp16_to_fp32(b0[i].d), out + (size_t)i * KV_QK8_0);
    } else {
        kv_vdeq_ref(vdt, q, out, n);
    }
}

bool kv_vfinite_avx2(const float *x, uint32_t n) {
    const __m256i e = _mm256_set1_epi32(0x7f800000);
    __m256i bad = _mm256_setzero_si256();
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8)
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), e), e));
    return _mm256_testz_si256(bad, bad) && kv_vfinite_ref(x + i, n - i);
}

/* kv_swiglu (model/ops.c): h = (g / (1 + expf(-g))) * u, each operation
 * rounded once in f32 (no contraction), so lanes give its bits. */
void kv_vswiglu_avx2(float *h, const float *g, const float *u, uint32_t n) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (uint32_t i = 0; i < n; i++) h[i] = expf(-g[i]); /* h first holds e^-g */
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 q = _mm256_div_ps(_mm256_loadu_ps(g + i), _mm256_add_ps(one, _mm256_loadu_ps(h + i)));
        _mm256_storeu_ps(h + i, _mm256_mul_ps(q, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) h[i] = (g[i] / (1.0f + h[i])) * u[i];
}
