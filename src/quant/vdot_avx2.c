/* AVX2 kernels of the verifier (quant/vdot.h); only called after run-time
 * detection. f64 in 4-lane ymm registers, 4 columns at a time: a chunk of
 * PC projection rows (of r, f32 widened, or s, f64) against NT answers,
 * PC * NT <= 8 accumulators, each input vector widened once per chunk and
 * each row loaded once for all answers; no broadcasts. Lane l of a chain
 * holds the columns j = l mod 4 in increasing j; the lanes are added at the
 * end. The same terms as the reference in another order (quant/vdot.h
 * states the bound). Also the Q8 dequantization, the finiteness test and
 * SwiGLU of the check (bit for bit the engine's), which AVX-512 shares. */
#include <immintrin.h>
#include <math.h>

#include "quant/quant_internal.h"
#include "quant/vdot.h"

#define AI static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 32") /* the chains must stay in registers */

AI double hsum4d(__m256d v) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}
AI __m256d ld4(const float *p) { return _mm256_cvtps_pd(_mm_loadu_ps(p)); }
AI __m256d ld4d(const double *p) { return _mm256_loadu_pd(p); }

/* out[t P + p] for p in p0 .. p0 + PC - 1: rows m + p n against v[t] */
#define KV_PROJ(NAME, MT, LOAD)                                                                                      \
    AI void NAME(const int PC, const int NT, const MT *m, uint32_t n, uint32_t p0, uint32_t P,                       \
                 const float *const *v, double *out) {                                                               \
        const int U = PC * NT >= 8 ? 1 : 8 / (PC * NT); /* column blocks in flight: >= 8 chains */                   \
        __m256d acc[8];                                                                                              \
        UNROLL for (int k = 0; k < PC * NT * U; k++) acc[k] = _mm256_setzero_pd();                                   \
        uint32_t j = 0;                                                                                              \
        for (; j + 4 * U <= n; j += 4 * U)                                                                           \
            UNROLL for (int u = 0; u < U; u++) {                                                                     \
                __m256d vt[4];                                                                                       \
                UNROLL for (int t = 0; t < NT; t++) vt[t] = ld4(v[t] + j + 4 * u);                                   \
                UNROLL for (int c = 0; c < PC; c++) {                                                                \
                    const __m256d mv = LOAD(m + (size_t)(p0 + c) * n + j + 4 * u);                                   \
                    UNROLL for (int t = 0; t < NT; t++)                                                              \
                        acc[(c * NT + t) * U + u] = _mm256_fmadd_pd(mv, vt[t], acc[(c * NT + t) * U + u]);           \
                }                                                                                                    \
            }                                                                                                        \
        for (; j + 4 <= n; j += 4) {                                                                                 \
            UNROLL for (int c = 0; c < PC; c++) {                                                                    \
                const __m256d mv = LOAD(m + (size_t)(p0 + c) * n + j);                                               \
                UNROLL for (int t = 0; t < NT; t++)                                                                  \
                    acc[(c * NT + t) * U] = _mm256_fmadd_pd(mv, ld4(v[t] + j), acc[(c * NT + t) * U]);               \
            }                                                                                                        \
        }                                                                                                            \
        UNROLL for (int c = 0; c < PC; c++) UNROLL for (int t = 0; t < NT; t++) {                                    \
            __m256d sum = acc[(c * NT + t) * U];                                                                     \
            UNROLL for (int u = 1; u < U; u++) sum = _mm256_add_pd(sum, acc[(c * NT + t) * U + u]);                  \
            double q = hsum4d(sum);                                                                                  \
            for (uint32_t jj = j; jj < n; jj++) q += (double)m[(size_t)(p0 + c) * n + jj] * (double)v[t][jj];        \
            out[t * P + p0 + c] = q;                                                                                 \
        }                                                                                                            \
    }
KV_PROJ(proj_r, float, ld4)
KV_PROJ(proj_s, double, ld4d)

/* S and B of one answer, 4 columns per register */
AI void sums4(const float *a, const float *b, const float *x, uint32_t n_in, double *S, double *B) {
    const __m256d nosign = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffll));
    __m256d sa = _mm256_setzero_pd(), sb = _mm256_setzero_pd();
    uint32_t j = 0;
    for (; j + 4 <= n_in; j += 4) {
        const __m256d xv = ld4(x + j);
        sa = _mm256_fmadd_pd(ld4(a + j), _mm256_and_pd(xv, nosign), sa);
        sb = _mm256_fmadd_pd(_mm256_mul_pd(ld4(b + j), xv), xv, sb);
    }
    double s_ = hsum4d(sa), b_ = hsum4d(sb);
    for (; j < n_in; j++) {
        const double xj = x[j];
        s_ += (double)a[j] * (xj < 0 ? -xj : xj);
        b_ += (double)b[j] * xj * xj;
    }
    *S = s_, *B = b_;
}

AI void dotsT(const int PC, const int NT, uint32_t P, const float *r, const float *const *o, uint32_t n_out,
              const double *s, const float *const *x, uint32_t n_in, double *lhs, double *rhs) {
    uint32_t p = 0;
    for (; p + PC <= P; p += PC) {
        proj_r(PC, NT, r, n_out, p, P, o, lhs);
        proj_s(PC, NT, s, n_in, p, P, x, rhs);
    }
    /* the rows left over, in chunks of 4, 2, 1 (each with enough chains, below) */
    if (PC > 4 && p + 4 <= P) {
        proj_r(4, NT, r, n_out, p, P, o, lhs);
        proj_s(4, NT, s, n_in, p, P, x, rhs);
        p += 4;
    }
    if (PC > 2 && p + 2 <= P) {
        proj_r(2, NT, r, n_out, p, P, o, lhs);
        proj_s(2, NT, s, n_in, p, P, x, rhs);
        p += 2;
    }
    if (p < P) {
        proj_r(1, NT, r, n_out, p, P, o, lhs);
        proj_s(1, NT, s, n_in, p, P, x, rhs);
    }
}

void kv_vdots_avx2(KV_VDOT_ARGS) {
    for (uint32_t t = 0; t < nt; t++) sums4(a, b, x[t], n_in, S + t, B + t);
    switch (nt) {
    case 1: dotsT(8, 1, P, r, o, n_out, s, x, n_in, lhs, rhs); return;
    case 2: dotsT(4, 2, P, r, o, n_out, s, x, n_in, lhs, rhs); return;
    case 3: dotsT(2, 3, P, r, o, n_out, s, x, n_in, lhs, rhs); return;
    case 4: dotsT(2, 4, P, r, o, n_out, s, x, n_in, lhs, rhs); return;
    default: kv_vdots_ref(P, nt, r, o, n_out, s, a, b, x, n_in, lhs, rhs, S, B); /* nt > KV_VDOT_MAX_NT */
    }
}

void kv_vaxpy_avx2(uint32_t P, const double *rp, const float *w, uint32_t n, double *s, size_t stride) {
    uint32_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const __m256d wv = ld4(w + j);
        for (uint32_t p = 0; p < P; p++) {
            double *sp = s + p * stride + j;
            _mm256_storeu_pd(sp, _mm256_add_pd(_mm256_loadu_pd(sp), _mm256_mul_pd(_mm256_set1_pd(rp[p]), wv)));
        }
    }
    for (uint32_t p = 0; p < P; p++)
        for (uint32_t jj = j; jj < n; jj++) s[p * stride + jj] += rp[p] * (double)w[jj];
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
