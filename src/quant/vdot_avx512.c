/* AVX-512 kernels of the verifier (quant/vdot.h); only called after
 * run-time detection. f64 in 8-lane zmm registers, 8 columns at a time: a
 * chunk of PC projection rows (of r, f32 widened, or s, f64) against NT
 * answers, PC * NT accumulators, each input vector widened once per chunk
 * and each row loaded once for all answers; no broadcasts. Lane l of a
 * chain holds the columns j = l mod 8 in increasing j; the 8 lanes are
 * added at the end. The same terms as the reference in another order
 * (quant/vdot.h states the bound). */
#include <immintrin.h>
#include <string.h>

#include "quant/quant_internal.h"
#include "quant/vdot.h"

#define AI static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 32") /* the chains must stay in registers */

AI __m512d ld8(const float *p) { return _mm512_cvtps_pd(_mm256_loadu_ps(p)); }
AI __m512d ld8d(const double *p) { return _mm512_loadu_pd(p); }

/* out[t P + p] for p in p0 .. p0 + PC - 1: rows m + p n (f32 when F, else
 * f64) against v[t] (n floats) */
#define KV_PROJ(NAME, MT, LOAD)                                                                                      \
    AI void NAME(const int PC, const int NT, const MT *m, uint32_t n, uint32_t p0, uint32_t P,                       \
                 const float *const *v, double *out) {                                                               \
        const int U = PC * NT >= 8 ? 1 : 8 / (PC * NT); /* column blocks in flight: >= 8 chains */                   \
        __m512d acc[32];                                                                                             \
        UNROLL for (int k = 0; k < PC * NT * U; k++) acc[k] = _mm512_setzero_pd();                                   \
        uint32_t j = 0;                                                                                              \
        for (; j + 8 * U <= n; j += 8 * U)                                                                           \
            UNROLL for (int u = 0; u < U; u++) {                                                                     \
                __m512d vt[4];                                                                                       \
                UNROLL for (int t = 0; t < NT; t++) vt[t] = ld8(v[t] + j + 8 * u);                                   \
                UNROLL for (int c = 0; c < PC; c++) {                                                                \
                    const __m512d mv = LOAD(m + (size_t)(p0 + c) * n + j + 8 * u);                                   \
                    UNROLL for (int t = 0; t < NT; t++)                                                              \
                        acc[(c * NT + t) * U + u] = _mm512_fmadd_pd(mv, vt[t], acc[(c * NT + t) * U + u]);           \
                }                                                                                                    \
            }                                                                                                        \
        for (; j + 8 <= n; j += 8) {                                                                                 \
            UNROLL for (int c = 0; c < PC; c++) {                                                                    \
                const __m512d mv = LOAD(m + (size_t)(p0 + c) * n + j);                                               \
                UNROLL for (int t = 0; t < NT; t++)                                                                  \
                    acc[(c * NT + t) * U] = _mm512_fmadd_pd(mv, ld8(v[t] + j), acc[(c * NT + t) * U]);               \
            }                                                                                                        \
        }                                                                                                            \
        UNROLL for (int c = 0; c < PC; c++) UNROLL for (int t = 0; t < NT; t++) {                                    \
            __m512d sum = acc[(c * NT + t) * U];                                                                     \
            UNROLL for (int u = 1; u < U; u++) sum = _mm512_add_pd(sum, acc[(c * NT + t) * U + u]);                  \
            double q = _mm512_reduce_add_pd(sum);                                                                    \
            for (uint32_t jj = j; jj < n; jj++) q += (double)m[(size_t)(p0 + c) * n + jj] * (double)v[t][jj];        \
            out[t * P + p0 + c] = q;                                                                                 \
        }                                                                                                            \
    }
KV_PROJ(proj_r, float, ld8)
KV_PROJ(proj_s, double, ld8d)

/* S and B of one answer, 8 columns per register */
AI void sums8(const float *a, const float *b, const float *x, uint32_t n_in, double *S, double *B) {
    __m512d sa = _mm512_setzero_pd(), sb = _mm512_setzero_pd();
    uint32_t j = 0;
    for (; j + 8 <= n_in; j += 8) {
        const __m512d xv = ld8(x + j);
        sa = _mm512_fmadd_pd(ld8(a + j), _mm512_abs_pd(xv), sa);
        sb = _mm512_fmadd_pd(_mm512_mul_pd(ld8(b + j), xv), xv, sb);
    }
    double s_ = _mm512_reduce_add_pd(sa), b_ = _mm512_reduce_add_pd(sb);
    for (; j < n_in; j++) {
        const double xj = x[j];
        s_ += (double)a[j] * (xj < 0 ? -xj : xj);
        b_ += (double)b[j] * xj * xj;
    }
    *S = s_, *B = b_;
}

/* NT answers: chunks of PC rows (PC * NT <= 24 accumulators), then single rows */
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

void kv_vdots_avx512(KV_VDOT_ARGS) {
    for (uint32_t t = 0; t < nt; t++) sums8(a, b, x[t], n_in, S + t, B + t);
    switch (nt) {
    case 1: dotsT(8, 1, P, r, o, n_out, s, x, n_in, lhs, rhs); return;
    case 2: dotsT(8, 2, P, r, o, n_out, s, x, n_in, lhs, rhs); return;
    case 3: dotsT(8, 3, P, r, o, n_out, s, x, n_in, lhs, rhs); return;
    case 4: dotsT(4, 4, P, r, o, n_out, s, x, n_in, lhs, rhs); return;
    default: kv_vdots_ref(P, nt, r, o, n_out, s, a, b, x, n_in, lhs, rhs, S, B); /* nt > KV_VDOT_MAX_NT */
    }
}

void kv_vaxpy_avx512(uint32_t P, const double *rp, const float *w, uint32_t n, double *s, size_t stride) {
    uint32_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m512d wv = ld8(w + j);
        for (uint32_t p = 0; p < P; p++) {
            double *sp = s + p * stride + j;
            _mm512_storeu_pd(sp, _mm512_add_pd(_mm512_loadu_pd(sp), _mm512_mul_pd(_mm512_set1_pd(rp[p]), wv)));
        }
    }
    for (uint32_t p = 0; p < P; p++)
        for (uint32_t jj = j; jj < n; jj++) s[p * stride + jj] += rp[p] * (double)w[jj];
}

/* Q8_K as the reference quantize_row_q8_K (ref.c) for finite x: the first
 * value of largest magnitude sets iscale = -127 / max, values rounded half to
 * even (|iscale x| <= 127 (1 + 2^-23), so the result fits an int8). */
void kv_vq8k_avx512(const float *x, void *dst, uint32_t n) {
    kv_block_q8_K *bk = dst;
    for (uint32_t i = 0; i < n / KV_QK_K; i++) {
        const float *xb = x + (size_t)i * KV_QK_K;
        __m512 mx = _mm512_setzero_ps();
        for (int k = 0; k < 16; k++) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xb + 16 * k)));
        const float amax = _mm512_reduce_max_ps(mx);
        if (amax == 0) {
            memset(&bk[i], 0, sizeof bk[i]);
            continue;
        }
        float max = 0;
        const __m512 am = _mm512_set1_ps(amax);
        for (int k = 0; k < 16; k++) {
            const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(xb + 16 * k)), am, _CMP_EQ_OQ);
            if (eq) {
                max = xb[16 * k + __builtin_ctz((unsigned)eq)];
                break;
            }
        }
        const float iscale = -127.f / max;
        const __m512 is = _mm512_set1_ps(iscale);
        const __m512i lim = _mm512_set1_epi32(127);
        for (int g = 0; g < 16; g++) {
            __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * g), is),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm512_min_epi32(q, lim);
            bk[i].bsums[g] = (int16_t)_mm512_reduce_add_epi32(q);
            _mm_storeu_si128((__m128i *)(bk[i].qs + 16 * g), _mm512_cvtepi32_epi8(q));
        }
        bk[i].d = 1 / iscale;
    }
}
