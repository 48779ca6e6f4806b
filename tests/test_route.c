/* The routers (src/moe/route.c) against a double-precision reference
 * written from the models' own descriptions, on seeded random logits:
 *   - sigmoid (DeepSeek-V3's noaux_tc): scores sigmoid(logit); the groups
 *     ranked by the sum of their two best biased scores, by sorting every
 *     group; the top-k biased scores among the experts of the best
 *     n_group_used groups, found by sorting the allowed experts; weights the
 *     unbiased scores normalized to sum 1, times the scale; also without
 *     groups and without a bias;
 *   - softmax (qwen3moe): softmax, top-k, renormalized;
 *   - top-k then softmax over the k (gpt-oss).
 * The sigmoid scores and their biased sums are float, as ggml defines them
 * (two experts 1e-7 apart are ordered by those bits); the rest is double.
 * The ids must match exactly and the weights within float rounding. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvtest.h"
#include "model/model_internal.h"

static uint64_t g_s = 0x1234567;
static double unif(void) {
    g_s = g_s * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(g_s >> 11) / 9007199254740992.0;
}

typedef struct idx_val {
    int i;
    double v;
} idx_val;
static int by_val_desc(const void *a, const void *b) {
    const idx_val *x = a, *y = b;
    return x->v < y->v ? 1 : x->v > y->v ? -1 : x->i - y->i;
}

/* reference: ids[K] and weights[K] of one token */
static void ref_route(const kv_hparams *hp, const float *logit, const float *bias, int *ids, double *w) {
    const int NE = (int)hp->n_expert, K = (int)hp->n_expert_used;
    double sc[KV_MAX_EXPERTS], sel[KV_MAX_EXPERTS];
    idx_val iv[KV_MAX_EXPERTS];
    int n = 0;
    if (hp->router == KV_ROUTER_SIGMOID) {
        /* the scores as ggml defines them, in float (sigmoid, then + bias): near
         * ties (1e-7 apart) are ordered by those bits, not by the exact values */
        for (int e = 0; e < NE; e++) {
            const float f = 1.0f / (1.0f + expf(-logit[e]));
            sc[e] = f;
            sel[e] = bias ? f + bias[e] : f;
        }
        bool allowed[KV_MAX_EXPERTS];
        for (int e = 0; e < NE; e++) allowed[e] = true;
        const int G = (int)hp->n_expert_groups;
        if (G > 1) {
            const int per = NE / G;
            idx_val gv[KV_MAX_EXPERTS];
            for (int g = 0; g < G; g++) {
                idx_val m[KV_MAX_EXPERTS];
                for (int e = 0; e < per; e++) m[e] = (idx_val){e, sel[g * per + e]};
                qsort(m, (size_t)per, sizeof *m, by_val_desc);
                gv[g] = (idx_val){g, m[0].v + m[1].v};
            }
            qsort(gv, (size_t)G, sizeof *gv, by_val_desc);
            for (int e = 0; e < NE; e++) allowed[e] = false;
            for (uint32_t u = 0; u < hp->n_group_used; u++)
                for (int e = 0; e < per; e++) allowed[gv[u].i * per + e] = true;
        }
        for (int e = 0; e < NE; e++)
            if (allowed[e]) iv[n++] = (idx_val){e, sel[e]};
    } else if (hp->router == KV_ROUTER_SOFTMAX) {
        double mx = -1e300, sum = 0;
        for (int e = 0; e < NE; e++) mx = fmax(mx, logit[e]);
        for (int e = 0; e < NE; e++) sum += (sc[e] = exp(logit[e] - mx));
        for (int e = 0; e < NE; e++) iv[n++] = (idx_val){e, sc[e] /= sum};
    } else {
        for (int e = 0; e < NE; e++) iv[n++] = (idx_val){e, sc[e] = logit[e]};
    }
    qsort(iv, (size_t)n, sizeof *iv, by_val_desc);
    double sum = 0;
    for (int r = 0; r < K; r++) {
        ids[r] = iv[r].i;
        w[r] = sc[ids[r]];
    }
    if (hp->router == KV_ROUTER_TOPK_SOFTMAX) {
        double mx = w[0], s2 = 0;
        for (int r = 0; r < K; r++) s2 += (w[r] = exp(w[r] - mx));
        for (int r = 0; r < K; r++) w[r] /= s2;
    }
    for (int r = 0; r < K; r++) sum += w[r];
    for (int r = 0; r < K; r++) {
        if (hp->expert_weights_norm) w[r] /= sum;
        if (hp->expert_weights_scale != 0.0f) w[r] *= hp->expert_weights_scale;
    }
}

static void check(kv_hparams hp, bool with_bias, const char *what) {
    const int NE = (int)hp.n_expert, K = (int)hp.n_expert_used;
    float logit[KV_MAX_EXPERTS], p[KV_MAX_EXPERTS], bias[KV_MAX_EXPERTS], sel[KV_MAX_EXPERTS], w[KV_MAX_EXPERTS_USED];
    int32_t ids[KV_MAX_EXPERTS_USED];
    int rid[KV_MAX_EXPERTS_USED];
    double rw[KV_MAX_EXPERTS_USED], worst = 0;
    int bad = 0;
    for (int tok = 0; tok < 200; tok++) {
        for (int e = 0; e < NE; e++) {
            logit[e] = (float)(4.0 * unif() - 2.0);
            bias[e] = (float)(0.2 * unif() - 0.1);
        }
        memcpy(p, logit, (size_t)NE * sizeof *p);
        kv_route_token(&hp, p, with_bias ? bias : NULL, sel, ids, w);
        ref_route(&hp, logit, with_bias ? bias : NULL, rid, rw);
        for (int r = 0; r < K; r++) {
            if (ids[r] != rid[r])
                printf("  token %d rank %d: ours %d (sel %.9g), reference %d (sel %.9g)\n", tok, r, ids[r], sel[ids[r]],
                       rid[r], sel[rid[r]]);
            bad += ids[r] != rid[r];
            worst = fmax(worst, fabs(w[r] - rw[r]) / fmax(1.0, fabs(rw[r])));
        }
    }
    printf("%-40s ids mismatched %d, max weight error %.2g\n", what, bad, worst);
    ASSERT_EQ(bad, 0);
    ASSERT_TRUE(worst < 1e-5);
}

static void test_sigmoid_groups(void) {
    /* DeepSeek-V3: 256 experts in 8 groups, 4 searched, top-8, scale 2.5 */
    kv_hparams hp = {.n_expert = 256, .n_expert_used = 8, .n_expert_groups = 8, .n_group_used = 4,
                     .router = KV_ROUTER_SIGMOID, .expert_weights_norm = true, .expert_weights_scale = 2.5f};
    check(hp, true, "sigmoid, bias, 8 groups (4 used)");
    hp.n_expert = 12, hp.n_expert_used = 3, hp.n_expert_groups = 6, hp.n_group_used = 2;
    check(hp, true, "sigmoid, bias, 6 groups of 2 (2 used)");
}

static void test_sigmoid_flat(void) {
    /* Kimi K2: 384 experts, no groups, scale 2.827 */
    kv_hparams hp = {.n_expert = 384, .n_expert_used = 8, .router = KV_ROUTER_SIGMOID, .expert_weights_norm = true,
                     .expert_weights_scale = 2.827f};
    check(hp, true, "sigmoid, bias, no groups");
    hp.expert_weights_norm = false;
    hp.expert_weights_scale = 0.0f;
    check(hp, false, "sigmoid, no bias, no norm, no scale");
}

static void test_softmax(void) {
    kv_hparams hp = {.n_expert = 128, .n_expert_used = 8, .router = KV_ROUTER_SOFTMAX, .expert_weights_norm = true};
    check(hp, false, "softmax, top-k, renormalized");
}

static void test_topk_softmax(void) {
    kv_hparams hp = {.n_expert = 128, .n_expert_used = 4, .router = KV_ROUTER_TOPK_SOFTMAX};
    check(hp, false, "top-k, then softmax over the k");
}

static const kvt_case cases[] = {KVT_CASE(test_sigmoid_groups), KVT_CASE(test_sigmoid_flat), KVT_CASE(test_softmax),
                                 KVT_CASE(test_topk_softmax)};

int main(int argc, char **argv) { return kvt_run(argc, argv, cases, KVT_N(cases)); }
