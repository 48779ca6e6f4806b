/* kv-test-labels: unit
 * The OpenCL expert backend (kvasir/opencl.h) against the scalar reference:
 * for every compute tensor type, random experts computed by the CPU
 * provider on the scalar backend and by the OpenCL provider on the first
 * device (PoCL here) for decode- and prefill-shaped requests. The stated
 * bound is bit-identity (the kernel follows the canonical order); cosine
 * and max relative error are printed for docs/NUMERICS.md. Bad requests
 * (layer, expert id, shape) are refused with an error. Without OpenCL (no
 * headers at build time or no device) the backend is skipped, which fails
 * when KV_REQUIRE_BACKENDS names "opencl". */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/model.h"
#include "kvasir/opencl.h"
#include "kvasir/pool.h"
#include "kvasir/quant.h"
#include "kvtest.h"

enum { N_LAYER = 2, N_EXPERT = 6, N_EMBD = 512, N_FF = 256, N_USED = 3 };

typedef struct {
    uint32_t type[3];          /* gate, up, down */
    uint8_t *gate, *up, *down; /* [layer][expert] matrices, back to back */
    size_t gb, ub, db;         /* bytes of one expert's gate, up, down */
} exps;

static uint64_t rng = 88172645463325252ull;
static float gauss(void) {
    double s = 0;
    for (int i = 0; i < 4; i++) {
        rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
        s += (double)(rng >> 11) / 9007199254740992.0 - 0.5;
    }
    return (float)(s * 1.7);
}

static int acquire(void *ctx, uint32_t layer, uint32_t e, kv_expert_weights *w, kv_diag *d) {
    exps *x = ctx;
    if (layer >= N_LAYER || e >= N_EXPERT) return kv_fail(d, KV_ERANGE, "test: layer %u expert %u", layer, e);
    size_t i = (size_t)layer * N_EXPERT + e;
    *w = (kv_expert_weights){x->gate + i * x->gb, x->up + i * x->ub, x->down + i * x->db, x->type[0], x->type[1],
                             x->type[2]};
    return 0;
}

/* Experts with gate, up, down in types tg, tu, td. */
static void make(exps *x, uint32_t tg, uint32_t tu, uint32_t td) {
    const kv_type_info *g = kv_type_get_ref(tg), *u = kv_type_get_ref(tu), *t = kv_type_get_ref(td);
    x->type[0] = tg, x->type[1] = tu, x->type[2] = td;
    x->gb = (size_t)kv_type_row_size(tg, N_EMBD) * N_FF;
    x->ub = (size_t)kv_type_row_size(tu, N_EMBD) * N_FF;
    x->db = (size_t)kv_type_row_size(td, N_FF) * N_EMBD;
    size_t n = (size_t)N_LAYER * N_EXPERT;
    x->gate = malloc(n * x->gb);
    x->up = malloc(n * x->ub);
    x->down = malloc(n * x->db);
    float *row = malloc(sizeof(float) * N_EMBD);
    for (size_t i = 0; i < n; i++) {
        for (int r = 0; r < N_FF; r++) {
            for (int k = 0; k < N_EMBD; k++) row[k] = 0.05f * gauss();
            g->from_float(row, x->gate + i * x->gb + (size_t)r * kv_type_row_size(tg, N_EMBD), N_EMBD);
            for (int k = 0; k < N_EMBD; k++) row[k] = 0.05f * gauss();
            u->from_float(row, x->up + i * x->ub + (size_t)r * kv_type_row_size(tu, N_EMBD), N_EMBD);
        }
        for (int r = 0; r < N_EMBD; r++) {
            for (int k = 0; k < N_FF; k++) row[k] = 0.05f * gauss();
            t->from_float(row, x->down + i * x->db + (size_t)r * kv_type_row_size(td, N_FF), N_FF);
        }
    }
    free(row);
}

static void unmake(exps *x) {
    free(x->gate);
    free(x->up);
    free(x->down);
}

static uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static void test_types_vs_scalar(void) {
    char dev[256];
    if (!kv_opencl_available(dev, sizeof dev)) {
        kvt_skip_backend("opencl", "no OpenCL in this build or no device");
        return;
    }
    printf("  device: %s\n", dev);
    const uint32_t types[] = {KV_TYPE_F32, KV_TYPE_F16, KV_TYPE_BF16, KV_TYPE_Q8_0,
                              KV_TYPE_Q4_0, KV_TYPE_Q4_K, KV_TYPE_Q5_K, KV_TYPE_Q6_K,
                              KV_TYPE_Q4_1, KV_TYPE_Q5_0, KV_TYPE_Q5_1, KV_TYPE_IQ4_NL, KV_TYPE_MXFP4,
                              KV_TYPE_Q2_K, KV_TYPE_Q3_K, KV_TYPE_IQ4_XS};
    /* and experts whose matrices differ in type, gate's activation type
     * differing from up's (some published mixes: gate Q8_0, up Q4_K) */
    static const uint32_t mixed[][3] = {{KV_TYPE_Q8_0, KV_TYPE_Q4_K, KV_TYPE_Q2_K},
                                        {KV_TYPE_IQ4_XS, KV_TYPE_Q8_0, KV_TYPE_Q3_K}};
    const size_t n_same = sizeof types / sizeof types[0], n_mixed = sizeof mixed / sizeof mixed[0];
    ASSERT_EQ(kv_quant_set_backend("scalar"), 0);
    kv_diag d = {0};
    kv_pool *pool = NULL;
    ASSERT_EQ(kv_pool_new(&pool, 1, &d), 0);
    const uint32_t toks[] = {1, 5};
    float *x = malloc(sizeof(float) * 5 * N_EMBD);
    int32_t ids[5 * N_USED];
    float *o1 = malloc(sizeof(float) * 5 * N_USED * N_EMBD), *o2 = malloc(sizeof(float) * 5 * N_USED * N_EMBD);
    for (size_t ti = 0; ti < n_same + n_mixed; ti++) {
        exps ex;
        if (ti < n_same)
            make(&ex, types[ti], types[ti], types[ti]);
        else
            make(&ex, mixed[ti - n_same][0], mixed[ti - n_same][1], mixed[ti - n_same][2]);
        char nm[48];
        if (ti < n_same)
            snprintf(nm, sizeof nm, "%s", kv_type_get(ex.type[0])->name);
        else
            snprintf(nm, sizeof nm, "%s/%s/%s", kv_type_get(ex.type[0])->name, kv_type_get(ex.type[1])->name,
                     kv_type_get(ex.type[2])->name);
        kv_expert_source src = {&ex, acquire, NULL, N_LAYER, N_EXPERT, N_EMBD, N_FF, N_USED};
        kv_expert_provider ref, cl;
        ASSERT_EQ(kv_expert_local_new_src(&ref, &src, pool, 5, &d), 0);
        int rc = kv_opencl_expert_new(&cl, &src, 5, &d);
        if (rc) {
            KVT_FAIL("opencl provider: %s", d.msg);
            ref.free(ref.impl);
            unmake(&ex);
            continue;
        }
        long diff = 0;
        double worst_cos = 1, worst_rel = 0;
        for (int layer = 0; layer < N_LAYER; layer++)
            for (size_t k = 0; k < 2; k++) {
                const uint32_t nt = toks[k];
                for (uint32_t i = 0; i < nt * N_EMBD; i++) x[i] = gauss();
                for (uint32_t t = 0; t < nt; t++)
                    for (int u = 0; u < N_USED; u++) ids[t * N_USED + u] = (int32_t)((t * 2 + (uint32_t)u * 3 + (uint32_t)layer) % N_EXPERT);
                kv_expert_req rq = {(uint32_t)layer, nt, N_EMBD, N_USED, x, ids, NULL};
                ASSERT_EQ(ref.compute(ref.impl, &rq, o1, &d), 0);
                rc = cl.compute(cl.impl, &rq, o2, &d);
                if (rc) {
                    KVT_FAIL("opencl compute %s: %s", nm, d.msg);
                    continue;
                }
                const size_t n = (size_t)nt * N_USED * N_EMBD;
                double dot = 0, n1 = 0, n2 = 0, amax = 0, emax = 0;
                for (size_t i = 0; i < n; i++) {
                    diff += f2u(o1[i]) != f2u(o2[i]);
                    dot += (double)o1[i] * o2[i];
                    n1 += (double)o1[i] * o1[i];
                    n2 += (double)o2[i] * o2[i];
                    if (fabs(o1[i]) > amax) amax = fabs(o1[i]);
                    if (fabs((double)o1[i] - o2[i]) > emax) emax = fabs((double)o1[i] - o2[i]);
                }
                const double cs = dot / sqrt(n1 * n2), rel = amax > 0 ? emax / amax : 0;
                if (cs < worst_cos) worst_cos = cs;
                if (rel > worst_rel) worst_rel = rel;
            }
        printf("  opencl %-5s vs scalar: %ld of %d values differ, cosine %.9f, max rel err %.3g\n",
               nm, diff, 2 * (1 + 5) * N_USED * N_EMBD, worst_cos, worst_rel);
        if (diff) KVT_FAIL("opencl %s: %ld values differ from the scalar reference", nm, diff);
        kvt_checks++;
        /* malformed requests: refused, nothing computed */
        int32_t bad_ids[N_USED] = {0, N_EXPERT, 1};
        kv_expert_req bad = {0, 1, N_EMBD, N_USED, x, bad_ids, NULL};
        ASSERT_EQ(cl.compute(cl.impl, &bad, o2, &d), KV_ERANGE);
        kv_expert_req bad_layer = {N_LAYER, 1, N_EMBD, N_USED, x, ids, NULL};
        ASSERT_EQ(cl.compute(cl.impl, &bad_layer, o2, &d), KV_ERANGE);
        kv_expert_req too_many = {0, 6, N_EMBD, N_USED, x, ids, NULL};
        ASSERT_EQ(cl.compute(cl.impl, &too_many, o2, &d), KV_EINVAL);
        cl.free(cl.impl);
        ref.free(ref.impl);
        unmake(&ex);
    }
    kv_pool_free(pool);
    free(x);
    free(o1);
    free(o2);
}

static const kvt_case cases[] = {KVT_CASE(test_types_vs_scalar)};

int main(int argc, char **argv) { return kvt_run(argc, argv, cases, KVT_N(cases)); }
