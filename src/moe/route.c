/* The routers (kv_hparams.router, src/arch/ tables): one token's router
 * logits into its top-k expert ids (rank order) and their weights.
 *
 * As llama.cpp's build_moe_ffn (llama-graph.cpp): softmax or sigmoid
 * scores; selection on the scores plus the correction bias (exp_probs_b)
 * when there is one, within the n_group_used best groups when the experts
 * are grouped (a group's score: its two best, summed); weights the unbiased
 * scores of the chosen experts, renormalized to sum 1 when asked (the sum
 * clamped below at 2^-14, as ggml), then scaled. KV_ROUTER_TOPK_SOFTMAX
 * (gpt-oss) selects on the logits and takes a softmax over the k chosen.
 * Selection is by descending value, the lower id first on ties. */
#include <math.h>

#include "model/model_internal.h"

/* The k largest of p[0..n) in descending order, the lower index first on
 * ties (masked entries, -INFINITY, come last). */
static void kv_topk(const float *p, int n, int k, int32_t *ids) {
    for (int r = 0; r < k; r++) {
        int best = -1;
        for (int e = 0; e < n; e++) {
            bool taken = false;
            for (int q = 0; q < r; q++) taken |= ids[q] == e;
            if (taken) continue;
            if (best < 0 || p[e] > p[best]) best = e;
        }
        ids[r] = best;
    }
}

void kv_route_token(const kv_hparams *hp, float *p, const float *bias, float *sel, int32_t *ids, float *w) {
    const int NE = (int)hp->n_expert, K = (int)hp->n_expert_used;
    if (hp->router == KV_ROUTER_SIGMOID) {
        for (int e = 0; e < NE; e++) p[e] = 1.0f / (1.0f + expf(-p[e]));
        for (int e = 0; e < NE; e++) sel[e] = bias ? p[e] + bias[e] : p[e];
        const int G = (int)hp->n_expert_groups;
        if (G > 1) {
            const int per = NE / G;
            float gs[KV_MAX_EXPERTS];
            int32_t top2[2], gsel[KV_MAX_EXPERTS];
            for (int g = 0; g < G; g++) {
                kv_topk(sel + g * per, per, 2, top2);
                gs[g] = sel[g * per + top2[0]] + sel[g * per + top2[1]];
            }
            kv_topk(gs, G, (int)hp->n_group_used, gsel);
            for (int g = 0; g < G; g++) {
                bool used = false;
                for (uint32_t u = 0; u < hp->n_group_used; u++) used |= gsel[u] == g;
                if (!used)
                    for (int e = 0; e < per; e++) sel[g * per + e] = -INFINITY;
            }
        }
        kv_topk(sel, NE, K, ids);
    } else if (hp->router == KV_ROUTER_TOPK_SOFTMAX) {
        kv_topk(p, NE, K, ids); /* on the logits; the softmax over the k follows */
    } else {
        kv_softmax(p, NE);
        kv_topk(p, NE, K, ids);
    }
    for (int r = 0; r < K; r++) w[r] = p[ids[r]];
    if (hp->router == KV_ROUTER_TOPK_SOFTMAX) kv_softmax(w, K);
    if (hp->expert_weights_norm) {
        double sum = 0.0;
        for (int r = 0; r < K; r++) sum += (double)w[r];
        float fs = (float)sum;
        if (fs < 6.103515625e-5f) fs = 6.103515625e-5f;
        for (int r = 0; r < K; r++) w[r] = w[r] / fs;
    }
    if (hp->expert_weights_scale != 0.0f && hp->expert_weights_scale != 1.0f)
        for (int r = 0; r < K; r++) w[r] *= hp->expert_weights_scale;
}
