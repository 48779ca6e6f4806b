/* Routed experts whose three matrices have different types, as some
 * published mixes write them (gate Q8_0 with up Q4_K; gate IQ4_XS with up
 * Q8_0; down in Q2_K or Q3_K): the in-process provider (src/moe/local.c)
 * computes them, each matrix against its input quantized to its own
 * vec_dot_type. Checked against a reference written here from the scalar
 * kernels (bit for bit: every backend is bit-identical to them) and
 * against an f64 SwiGLU FFN of the dequantized weights (a loose bound:
 * the activations are quantized), with 1 and 3 threads. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/model.h"
#include "kvasir/moe.h"
#include "kvasir/ops.h"
#include "kvasir/pool.h"
#include "kvasir/quant.h"
#include "kvtest.h"

#define E 256     /* n_embd */
#define F 512     /* n_ff_exp */
#define NX 4      /* experts */
#define NU 2      /* used per token */
#define NT 3      /* tokens */

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float rnd_gauss(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    const float u = ((uint32_t)(rng >> 40) + 1) / 16777217.0f;
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    const float v = (uint32_t)(rng >> 40) / 16777216.0f;
    return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}

typedef struct {
    uint32_t type[3];         /* gate, up, down */
    uint8_t *w[NX][3];        /* quantized matrices */
} fixture;

static int acquire(void *ctx, uint32_t layer, uint32_t e, kv_expert_weights *w, kv_diag *d) {
    (void)layer, (void)d;
    fixture *f = ctx;
    *w = (kv_expert_weights){f->w[e][0], f->w[e][1], f->w[e][2], f->type[0], f->type[1], f->type[2]};
    return 0;
}

/* y[r] = dot(row r of W, x) for `rows` rows of n, as the scalar reference. */
static void ref_rows(uint32_t type, const uint8_t *W, int rows, int n, const float *x, float *y) {
    const kv_type_info *t = kv_type_get_ref(type), *ta = kv_type_get_ref(t->vec_dot_type);
    uint8_t *q = malloc(kv_type_row_size(t->vec_dot_type, (uint64_t)n) + 64);
    ta->from_float(x, q, n);
    const size_t rb = kv_type_row_size(type, (uint64_t)n);
    for (int r = 0; r < rows; r++) t->vec_dot(n, &y[r], W + (size_t)r * rb, q);
    free(q);
}

static void run_case(const uint32_t types[3]) {
    fixture f;
    memcpy(f.type, types, sizeof f.type);
    const int n_in[3] = {E, E, F}, n_rows[3] = {F, F, E};
    float *src = malloc(sizeof(float) * (size_t)E * F);
    float *deq[NX][3];
    for (int e = 0; e < NX; e++)
        for (int m = 0; m < 3; m++) {
            const size_t nel = (size_t)n_in[m] * n_rows[m];
            for (size_t i = 0; i < nel; i++) src[i] = rnd_gauss() / sqrtf((float)n_in[m]);
            f.w[e][m] = malloc(kv_type_row_size(types[m], nel));
            kv_type_get_ref(types[m])->from_float(src, f.w[e][m], (int64_t)nel);
            deq[e][m] = malloc(sizeof(float) * nel);
            kv_type_get_ref(types[m])->to_float(f.w[e][m], deq[e][m], (int64_t)nel);
        }
    float x[NT * E];
    for (int i = 0; i < NT * E; i++) x[i] = rnd_gauss();
    const int32_t ids[NT * NU] = {0, 3, 2, 1, 3, 0};

    /* the reference: scalar kernels, each matrix with its own activation type */
    float want[NT * NU * E], g[F], u[F], h[F];
    double worst = 0, scale = 0;
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < NU; k++) {
            const int e = ids[t * NU + k];
            ref_rows(types[0], f.w[e][0], F, E, x + t * E, g);
            ref_rows(types[1], f.w[e][1], F, E, x + t * E, u);
            kv_swiglu(h, g, u, F);
            ref_rows(types[2], f.w[e][2], E, F, h, want + (t * NU + k) * E);
            /* f64 FFN of the dequantized weights */
            double hd[F];
            for (int r = 0; r < F; r++) {
                double gd = 0, ud = 0;
                for (int i = 0; i < E; i++) {
                    gd += (double)deq[e][0][(size_t)r * E + i] * x[t * E + i];
                    ud += (double)deq[e][1][(size_t)r * E + i] * x[t * E + i];
                }
                hd[r] = gd / (1 + exp(-gd)) * ud;
            }
            for (int r = 0; r < E; r++) {
                double o = 0;
                for (int i = 0; i < F; i++) o += (double)deq[e][2][(size_t)r * F + i] * hd[i];
                const double diff = fabs(o - want[(t * NU + k) * E + r]);
                worst = diff > worst ? diff : worst;
                scale += o * o;
            }
        }
    const double rms = sqrt(scale / (NT * NU * E));
    printf("  %s/%s/%s: reference vs f64 max |diff| %.3g (rms of outputs %.3g)\n", kv_type_get_ref(types[0])->name,
           kv_type_get_ref(types[1])->name, kv_type_get_ref(types[2])->name, worst, rms);
    ASSERT_TRUE(worst <= 0.1 * rms); /* 8-bit activations: a few per cent of the typical output */

    kv_expert_source s = {.ctx = &f, .acquire = acquire, .n_layer = 1, .n_expert = NX, .n_embd = E,
                          .n_ff_exp = F, .n_expert_used = NU};
    for (int nth = 1; nth <= 3; nth += 2) {
        kv_diag d = {0};
        kv_pool *pool = NULL;
        ASSERT_EQ(kv_pool_new(&pool, nth, &d), 0);
        kv_expert_provider p;
        ASSERT_EQ(kv_expert_local_new_src(&p, &s, pool, 8, &d), 0);
        float got[NT * NU * E];
        const kv_expert_req req = {.layer = 0, .n_tokens = NT, .n_embd = E, .n_used = NU, .x = x, .ids = ids};
        const int rc = p.compute(p.impl, &req, got, &d);
        if (rc) KVT_FAIL("compute with %d threads: %s", nth, d.msg);
        kvt_checks++;
        if (!rc && memcmp(got, want, sizeof got)) {
            int bad = 0;
            for (int i = 0; i < NT * NU * E; i++) bad += got[i] != want[i];
            KVT_FAIL("%d threads: %d of %d outputs differ from the reference", nth, bad, NT * NU * E);
        }
        kvt_checks++;
        p.free(p.impl);
        kv_pool_free(pool);
    }
    for (int e = 0; e < NX; e++)
        for (int m = 0; m < 3; m++) free(f.w[e][m]), free(deq[e][m]);
    free(src);
}

static void test_gate_q8_0_up_q4_k(void) { run_case((const uint32_t[3]){KV_TYPE_Q8_0, KV_TYPE_Q4_K, KV_TYPE_Q2_K}); }
static void test_gate_iq4_xs_up_q8_0(void) { run_case((const uint32_t[3]){KV_TYPE_IQ4_XS, KV_TYPE_Q8_0, KV_TYPE_Q3_K}); }
static void test_same_vdt(void) { run_case((const uint32_t[3]){KV_TYPE_Q3_K, KV_TYPE_Q2_K, KV_TYPE_Q8_0}); }

static const kvt_case cases[] = {
    KVT_CASE(test_gate_q8_0_up_q4_k),
    KVT_CASE(test_gate_iq4_xs_up_q8_0),
    KVT_CASE(test_same_vdt),
};

int main(int argc, char **argv) {
    printf("dispatched backend: %s\n", kv_quant_backend());
    return kvt_run(argc, argv, cases, KVT_N(cases));
}
