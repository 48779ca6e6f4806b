/* kv-test-labels: unit
 * The OpenCL expert backend (kvasir/opencl.h) against the scalar reference:
 * for every compute tensor type, random experts computed by the CPU
 * provider on the scalar backend and by the OpenCL provider on the first
 * device (PoCL here) for decode- and prefill-shaped requests. The stated
 * bound is bit-identity (the kernel follows the canonical order); cosine
 * and max relative error are printed for docs/NUMERICS.md. Bad requests
 * (layer, expert id, shape) are refused with an error. gpt-oss experts
 * (MXFP4 and Q8_0, biases on all three matrices, the clamped SwiGLU, the
 * clamp met) give the CPU path's bits too. A tensor type the kernels do not
 * compute, or experts of one layer that differ in type, are refused when
 * the provider is made, naming the tensor, not at the first request
 * (docs/NUMERICS.md, "OpenCL"). kv_opencl_expert_compute_pre returns the
 * CPU path's pre-activations (what --verify checks). Without OpenCL (no
 * headers at build time or no device) the backend is skipped, which fails
 * when KV_REQUIRE_BACKENDS names "opencl". */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/arch.h"
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
    float *bg, *bu, *bd;       /* gpt-oss: [layer][expert] biases of n_ff, n_ff, n_embd; NULL: none */
    uint32_t act;              /* enum kv_expert_act */
    int odd_layer, odd_expert; /* >= 0: that expert's up is of type odd_type (refused at load) */
    uint32_t odd_type;
    int absent_expert;         /* >= 0: acquire says the source does not hold it */
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
    if ((int)e == x->absent_expert) return kv_fail(d, KV_ENOTFOUND, "test: expert %u is not held", e);
    size_t i = (size_t)layer * N_EXPERT + e;
    *w = (kv_expert_weights){x->gate + i * x->gb, x->up + i * x->ub, x->down + i * x->db, x->type[0], x->type[1],
                             x->type[2], x->bg ? x->bg + i * N_FF : NULL, x->bu ? x->bu + i * N_FF : NULL,
                             x->bd ? x->bd + i * N_EMBD : NULL, x->act};
    if ((int)layer == x->odd_layer && (int)e == x->odd_expert) w->up_type = x->odd_type;
    return 0;
}

/* Experts with gate, up, down in types tg, tu, td. */
static void make(exps *x, uint32_t tg, uint32_t tu, uint32_t td) {
    const kv_type_info *g = kv_type_get_ref(tg), *u = kv_type_get_ref(tu), *t = kv_type_get_ref(td);
    memset(x, 0, sizeof *x);
    x->odd_layer = x->odd_expert = x->absent_expert = -1;
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

/* gpt-oss's experts: biases and the clamped SwiGLU. Every fourth gate and
 * up bias is large (+-9), so the clamp at 7 is met on those rows. */
static void make_gptoss(exps *x, uint32_t t) {
    make(x, t, t, t);
    const size_t n = (size_t)N_LAYER * N_EXPERT;
    x->act = KV_ACT_SWIGLU_CLAMP;
    x->bg = malloc(sizeof(float) * n * N_FF);
    x->bu = malloc(sizeof(float) * n * N_FF);
    x->bd = malloc(sizeof(float) * n * N_EMBD);
    for (size_t i = 0; i < n * N_FF; i++) {
        x->bg[i] = i % 4 == 0 ? 9.0f : 0.5f * gauss();
        x->bu[i] = i % 4 == 1 ? (i % 8 == 1 ? 9.0f : -9.0f) : 0.5f * gauss();
    }
    for (size_t i = 0; i < n * N_EMBD; i++) x->bd[i] = 0.5f * gauss();
}

static void unmake(exps *x) {
    free(x->gate);
    free(x->up);
    free(x->down);
    free(x->bg);
    free(x->bu);
    free(x->bd);
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
    /* and gpt-oss's experts: MXFP4 as published, Q8_0 as requantized */
    static const uint32_t gptoss[] = {KV_TYPE_MXFP4, KV_TYPE_Q8_0};
    const size_t n_same = sizeof types / sizeof types[0], n_mixed = sizeof mixed / sizeof mixed[0];
    const size_t n_gptoss = sizeof gptoss / sizeof gptoss[0];
    ASSERT_EQ(kv_quant_set_backend("scalar"), 0);
    kv_diag d = {0};
    kv_pool *pool = NULL;
    ASSERT_EQ(kv_pool_new(&pool, 1, &d), 0);
    const uint32_t toks[] = {1, 5};
    float *x = malloc(sizeof(float) * 5 * N_EMBD);
    int32_t ids[5 * N_USED];
    float *o1 = malloc(sizeof(float) * 5 * N_USED * N_EMBD), *o2 = malloc(sizeof(float) * 5 * N_USED * N_EMBD);
    for (size_t ti = 0; ti < n_same + n_mixed + n_gptoss; ti++) {
        exps ex;
        if (ti < n_same)
            make(&ex, types[ti], types[ti], types[ti]);
        else if (ti < n_same + n_mixed)
            make(&ex, mixed[ti - n_same][0], mixed[ti - n_same][1], mixed[ti - n_same][2]);
        else
            make_gptoss(&ex, gptoss[ti - n_same - n_mixed]);
        char nm[48];
        if (ti < n_same)
            snprintf(nm, sizeof nm, "%s", kv_type_get(ex.type[0])->name);
        else if (ti >= n_same + n_mixed)
            snprintf(nm, sizeof nm, "gpt-oss %s", kv_type_get(ex.type[0])->name);
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
        printf("  opencl %-11s vs scalar: %ld of %d values differ, cosine %.9f, max rel err %.3g\n",
               nm, diff, 2 * (1 + 5) * N_USED * N_EMBD, worst_cos, worst_rel);
        if (diff) KVT_FAIL("opencl %s: %ld values differ from the scalar reference", nm, diff);
        kvt_checks++;
        /* the pre-activations a verifier checks (gate and up before biases): the CPU path's too */
        {
            static float g1[5 * N_USED * N_FF], u1[5 * N_USED * N_FF], g2[5 * N_USED * N_FF], u2[5 * N_USED * N_FF];
            for (uint32_t i = 0; i < 5 * N_EMBD; i++) x[i] = gauss();
            for (uint32_t t = 0; t < 5; t++)
                for (int u = 0; u < N_USED; u++) ids[t * N_USED + u] = (int32_t)((t + (uint32_t)u * 2) % N_EXPERT);
            kv_expert_req rq = {1, 5, N_EMBD, N_USED, x, ids, NULL};
            ASSERT_EQ(kv_expert_local_compute_pre(&ref, &rq, o1, g1, u1, &d), 0);
            ASSERT_EQ(kv_opencl_expert_compute_pre(&cl, &rq, o2, g2, u2, &d), 0);
            const size_t n = (size_t)5 * N_USED;
            if (memcmp(o1, o2, n * N_EMBD * sizeof(float)) || memcmp(g1, g2, n * N_FF * sizeof(float)) ||
                memcmp(u1, u2, n * N_FF * sizeof(float)))
                KVT_FAIL("opencl %s: pre-activations or outputs differ from the CPU path's", nm);
            kvt_checks++;
            ASSERT_EQ(kv_opencl_expert_compute_pre(&ref, &rq, o2, g2, u2, &d), KV_EINVAL); /* not an OpenCL provider */
        }
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

/* What the kernels cannot compute is refused when the provider is made,
 * naming the tensor and its type; experts the source does not hold are
 * passed over. */
static void test_refused_at_load(void) {
    if (!kv_opencl_available(NULL, 0)) {
        kvt_skip_backend("opencl", "no OpenCL in this build or no device");
        return;
    }
    kv_diag d = {0};
    exps ex;
    make(&ex, KV_TYPE_Q8_0, KV_TYPE_Q8_0, KV_TYPE_Q8_0);
    kv_expert_source src = {&ex, acquire, NULL, N_LAYER, N_EXPERT, N_EMBD, N_FF, N_USED};
    kv_expert_provider cl;
    /* Q8_K is an activation type: no kernel takes it as weights */
    ex.odd_layer = 1, ex.odd_expert = 4, ex.odd_type = KV_TYPE_Q8_K;
    ASSERT_EQ(kv_opencl_expert_new(&cl, &src, 4, &d), KV_EUNSUPPORTED);
    ASSERT_TRUE(strstr(d.msg, "blk.1.ffn_up_exps.weight") != NULL && strstr(d.msg, "q8_K") != NULL);
    printf("  refused at load: %s\n", d.msg);
    /* a type the kernels compute, but not the layer's other experts' */
    ex.odd_type = KV_TYPE_Q4_K;
    ASSERT_EQ(kv_opencl_expert_new(&cl, &src, 4, &d), KV_EFORMAT);
    ASSERT_TRUE(strstr(d.msg, "layer 1 expert 4") != NULL);
    /* the odd expert not held: nothing to refuse, and the rest computes */
    ex.absent_expert = 4;
    ASSERT_EQ(kv_opencl_expert_new(&cl, &src, 4, &d), 0);
    float x[N_EMBD], y[N_USED * N_EMBD];
    for (int i = 0; i < N_EMBD; i++) x[i] = gauss();
    int32_t ids[N_USED] = {0, 2, 5};
    kv_expert_req rq = {1, 1, N_EMBD, N_USED, x, ids, NULL};
    ASSERT_EQ(cl.compute(cl.impl, &rq, y, &d), 0);
    cl.free(cl.impl);
    unmake(&ex);
}

static const kvt_case cases[] = {KVT_CASE(test_types_vs_scalar), KVT_CASE(test_refused_at_load)};

int main(int argc, char **argv) { return kvt_run(argc, argv, cases, KVT_N(cases)); }
