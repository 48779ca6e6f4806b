/* Elementwise and matrix operations of the forward pass, written to follow
 * ggml's arithmetic (accumulation types, operation order) so our logits
 * track llama.cpp's closely. kv_matmul is the hot path: activations are
 * converted once to the weight type's vec_dot_type, then output rows are
 * split across threads (never one dot product's reduction). */
#include <math.h>
#include <string.h>

#include "kvasir/quant.h"
#include "quant/vec.h"
#include "model/model_internal.h"

void kv_rmsnorm(float *y, const float *x, const float *w, int64_t n, float eps) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
    const float mean = (float)(sum / (double)n);
    const float scale = 1.0f / sqrtf(mean + eps);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] * scale) * w[i];
}

void kv_softmax(float *x, int64_t n) {
    /* quant/vec.h: one fixed order (the max, the documented exp, a double
     * sum in 8 lanes and a fixed tree), vectorized, the same bits on every
     * backend */
    kv_f32_softmax(x, n, 1.0f);
}

void kv_rope_neox_table(float *cs, float *sn, int64_t n_rot, int32_t pos, float freq_base, float freq_scale) {
    const float theta_scale = powf(freq_base, -2.0f / (float)n_rot);
    float theta = (float)pos;
    for (int64_t i = 0; i < n_rot / 2; i++) {
        const float t = freq_scale * theta;
        cs[i] = cosf(t);
        sn[i] = sinf(t);
        theta *= theta_scale;
    }
}

void kv_rope_apply(float *x, int64_t n_rot, const float *cs, const float *sn) {
    const int64_t half = n_rot / 2;
    for (int64_t i = 0; i < half; i++) {
        const float x0 = x[i], x1 = x[i + half];
        x[i] = x0 * cs[i] - x1 * sn[i];
        x[i + half] = x0 * sn[i] + x1 * cs[i];
    }
}

void kv_swiglu(float *y, const float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
}

void kv_swiglu_oai(float *y, const float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i] > KV_SWIGLU_OAI_LIMIT ? KV_SWIGLU_OAI_LIMIT : g[i]; /* NaN stays NaN */
        const float v = u[i] < -KV_SWIGLU_OAI_LIMIT ? -KV_SWIGLU_OAI_LIMIT
                        : u[i] > KV_SWIGLU_OAI_LIMIT ? KV_SWIGLU_OAI_LIMIT : u[i];
        y[i] = (x / (1.0f + expf(KV_SWIGLU_OAI_ALPHA * -x))) * (v + 1.0f);
    }
}

void kv_expert_act(uint32_t act, float *y, const float *g, const float *u, int64_t n) {
    if (act == KV_ACT_SWIGLU_CLAMP)
        kv_swiglu_oai(y, g, u, n);
    else
        kv_swiglu(y, g, u, n);
}

size_t kv_matmul_scratch(int64_t k, int64_t n_tok) {
    /* f32 is the widest vec_dot_type (4 bytes/element); 64 bytes of slack per row */
    return (size_t)n_tok * ((size_t)k * 4 + 64);
}

void kv_quantize_rows(uint32_t vdt, const float *x, size_t x_stride, int64_t k, int64_t n_tok,
                      void *q, size_t q_stride) {
    const kv_type_info *ti = kv_type_get(vdt);
    for (int64_t t = 0; t < n_tok; t++) {
        const float *src = x + (size_t)t * x_stride;
        uint8_t *dst = (uint8_t *)q + (size_t)t * q_stride;
        if (vdt == KV_TYPE_F32)
            memcpy(dst, src, (size_t)k * sizeof(float));
        else
            ti->from_float(src, dst, k);
    }
}

typedef struct kv_mm_job {
    const kv_weight *w;
    const void *mat;   /* first row of the matrix */
    const float *x;    /* [n_tok][k] */
    int64_t n_tok;
    float *y;          /* [n_tok][rows] */
    void *q;           /* quantized x */
    size_t q_stride;
    int phase;         /* 0: quantize, 1: rows */
} kv_mm_job;

static void kv_mm_worker(void *arg, int ith, int nth) {
    kv_mm_job *j = arg;
    const kv_weight *w = j->w;
    const uint32_t vdt = kv_type_get(w->type)->vec_dot_type;
    long lo, hi;
    if (j->phase == 0) {
        kv_pool_split((long)j->n_tok, ith, nth, &lo, &hi);
        kv_quantize_rows(vdt, j->x + (size_t)lo * (size_t)w->ne[0], (size_t)w->ne[0], w->ne[0],
                         hi - lo, (uint8_t *)j->q + (size_t)lo * j->q_stride, j->q_stride);
        return;
    }
    /* split rows in multiples of 16 so SIMD tiles stay whole */
    const long rows = (long)w->ne[1], blocks = (rows + 15) / 16;
    kv_pool_split(blocks, ith, nth, &lo, &hi);
    lo *= 16;
    hi = hi * 16 < rows ? hi * 16 : rows;
    if (lo >= hi) return;
    kv_mat_rows(w->type, j->mat, w->row_bytes, w->ne[0], lo, hi, j->q, j->q_stride, j->n_tok, j->y,
                (size_t)w->ne[1]);
}

void kv_matmul(kv_pool *pool, const kv_weight *w, const void *mat, const float *x, int64_t n_tok,
               float *y, void *scratch) {
    const uint32_t vdt = kv_type_get(w->type)->vec_dot_type;
    kv_mm_job j = {w, mat ? mat : w->data, x, n_tok, y, scratch,
                   (size_t)kv_type_row_size(vdt, (uint64_t)w->ne[0]), 0};
    if (n_tok >= 4 && kv_pool_size(pool) > 1)
        kv_pool_run(pool, kv_mm_worker, &j);
    else
        kv_quantize_rows(vdt, x, (size_t)w->ne[0], w->ne[0], n_tok, scratch, j.q_stride);
    j.phase = 1;
    kv_pool_run(pool, kv_mm_worker, &j);
}
