/* In-process expert provider: computes routed-expert FFNs from the expert
 * tensors of a loaded model.
 *
 * A request's (token, rank) slots are grouped by expert (stable order), the
 * quantized inputs gathered per expert, and then three parallel phases run:
 * gate+up rows of every active expert, SwiGLU + re-quantization per slot,
 * down rows of every active expert. Work is split over the concatenated rows
 * of all active experts, so a decode step with 8 experts keeps every thread
 * busy. Every output element is one whole dot product, so results do not
 * depend on thread count or on which tokens share a step. Scratch is
 * allocated once for max_tokens. */
#include <stdlib.h>
#include <string.h>

#include "kvasir/quant.h"
#include "model/model_internal.h"

typedef struct kv_local {
    const kv_model *m;
    kv_pool *pool;
    uint32_t max_tokens;
    uint32_t n_slots_max;   /* max_tokens * n_expert_used */
    /* per-call scratch */
    int32_t *slot_order;    /* [n_slots] slots sorted by expert */
    int32_t *exp_first;     /* [n_expert+1] start of each expert's run in slot_order */
    int32_t *active;        /* [n_expert] experts with at least one slot */
    int32_t *cursor;        /* [n_expert] fill positions while sorting */
    uint8_t *xq;            /* [n_slots][row] gathered quantized inputs (gate/up type) */
    float *gate;            /* [n_slots][n_ff] */
    float *up;              /* [n_slots][n_ff] */
    uint8_t *hq;            /* [n_slots][row] quantized SwiGLU outputs (down type) */
    float *down;            /* [n_slots][n_embd] */
} kv_local;

typedef struct kv_local_job {
    kv_local *l;
    const kv_layer *L;
    const kv_expert_req *req;
    int n_active;
    size_t xq_stride, hq_stride;
    float *out;
    int phase;
} kv_local_job;

/* Runs kv_mat_rows over this thread's share of the concatenated rows of all
 * active experts' matrices of w, for their gathered slot inputs. */
static void kv_local_rows(kv_local_job *j, const kv_weight *w, const uint8_t *A, size_t a_stride,
                          float *Y, int ith, int nth) {
    kv_local *l = j->l;
    const long rows = (long)w->ne[1];
    const long blocks_per = (rows + 15) / 16, total = blocks_per * j->n_active;
    long lo, hi;
    kv_pool_split(total, ith, nth, &lo, &hi);
    for (long b = lo; b < hi;) {
        const long ai = b / blocks_per;
        const long bend = (ai + 1) * blocks_per < hi ? (ai + 1) * blocks_per : hi;
        const int32_t e = l->active[ai];
        const int32_t s0 = l->exp_first[e], s1 = l->exp_first[e + 1];
        long r0 = (b - ai * blocks_per) * 16, r1 = (bend - ai * blocks_per) * 16;
        if (r1 > rows) r1 = rows;
        kv_mat_rows(w->type, (const uint8_t *)w->data + (size_t)e * w->nb2, w->row_bytes, w->ne[0],
                    r0, r1, A + (size_t)s0 * a_stride, a_stride, s1 - s0, Y + (size_t)s0 * (size_t)rows,
                    (size_t)rows);
        b = bend;
    }
}

static void kv_local_worker(void *arg, int ith, int nth) {
    kv_local_job *j = arg;
    kv_local *l = j->l;
    const kv_layer *L = j->L;
    const kv_expert_req *r = j->req;
    const int64_t n_ff = L->up_exps.ne[1], E = r->n_embd;
    const long n_slots = (long)r->n_tokens * r->n_used;
    long lo, hi;
    switch (j->phase) {
    case 0: /* gather + quantize inputs, in sorted slot order */
        kv_pool_split(n_slots, ith, nth, &lo, &hi);
        for (long i = lo; i < hi; i++) {
            const int32_t slot = l->slot_order[i];
            const int32_t t = slot / (int32_t)r->n_used;
            kv_quantize_rows(kv_type_get(L->up_exps.type)->vec_dot_type, r->x + (size_t)t * (size_t)E,
                             (size_t)E, E, 1, l->xq + (size_t)i * j->xq_stride, j->xq_stride);
        }
        break;
    case 1: /* gate and up rows */
        kv_local_rows(j, &L->gate_exps, l->xq, j->xq_stride, l->gate, ith, nth);
        kv_local_rows(j, &L->up_exps, l->xq, j->xq_stride, l->up, ith, nth);
        break;
    case 2: /* SwiGLU and quantize for down */
        kv_pool_split(n_slots, ith, nth, &lo, &hi);
        for (long i = lo; i < hi; i++) {
            float *g = l->gate + (size_t)i * (size_t)n_ff;
            kv_swiglu(g, g, l->up + (size_t)i * (size_t)n_ff, n_ff);
            kv_quantize_rows(kv_type_get(L->down_exps.type)->vec_dot_type, g, (size_t)n_ff, n_ff, 1,
                             l->hq + (size_t)i * j->hq_stride, j->hq_stride);
        }
        break;
    case 3: /* down rows */
        kv_local_rows(j, &L->down_exps, l->hq, j->hq_stride, l->down, ith, nth);
        break;
    case 4: /* scatter back to (token, rank) order */
        kv_pool_split(n_slots, ith, nth, &lo, &hi);
        for (long i = lo; i < hi; i++)
            memcpy(j->out + (size_t)l->slot_order[i] * (size_t)E, l->down + (size_t)i * (size_t)E,
                   (size_t)E * sizeof(float));
        break;
    }
}

static int kv_local_compute(void *impl, const kv_expert_req *req, float *out, kv_diag *d) {
    kv_local *l = impl;
    const kv_hparams *hp = kv_model_hparams(l->m);
    if (req->layer >= hp->n_layer)
        return kv_fail(d, KV_ERANGE, "experts: layer %u out of range (%u layers)", req->layer, hp->n_layer);
    if (req->n_embd != hp->n_embd || req->n_used == 0 || req->n_tokens == 0 ||
        (uint64_t)req->n_tokens * req->n_used > l->n_slots_max)
        return kv_fail(d, KV_EINVAL, "experts: request shape (%u tokens x %u experts, embd %u) exceeds "
                       "provider limits", req->n_tokens, req->n_used, req->n_embd);
    const kv_layer *L = kv_model_layer(l->m, req->layer);
    const uint32_t n_slots = req->n_tokens * req->n_used;
    /* counting sort of slots by expert id: stable, so each expert's slots
     * stay in token order */
    memset(l->exp_first, 0, (hp->n_expert + 1) * sizeof(int32_t));
    for (uint32_t s = 0; s < n_slots; s++) {
        const int32_t e = req->ids[s];
        if (e < 0 || (uint32_t)e >= hp->n_expert)
            return kv_fail(d, KV_ERANGE, "experts: expert id %d out of range (%u experts)", e, hp->n_expert);
        l->exp_first[e + 1]++;
    }
    int n_active = 0;
    for (uint32_t e = 0; e < hp->n_expert; e++) {
        if (l->exp_first[e + 1]) l->active[n_active++] = (int32_t)e;
        l->exp_first[e + 1] += l->exp_first[e];
    }
    memcpy(l->cursor, l->exp_first, hp->n_expert * sizeof(int32_t));
    for (uint32_t s = 0; s < n_slots; s++) l->slot_order[l->cursor[req->ids[s]]++] = (int32_t)s;
    kv_local_job j = {l, L, req, n_active,
                      (size_t)kv_type_row_size(kv_type_get(L->up_exps.type)->vec_dot_type, hp->n_embd),
                      (size_t)kv_type_row_size(kv_type_get(L->down_exps.type)->vec_dot_type, hp->n_ff_exp),
                      out, 0};
    for (j.phase = 0; j.phase <= 4; j.phase++) kv_pool_run(l->pool, kv_local_worker, &j);
    return 0;
}

static void kv_local_free(void *impl) {
    kv_local *l = impl;
    if (!l) return;
    free(l->slot_order);
    free(l->exp_first);
    free(l->active);
    free(l->cursor);
    free(l->xq);
    free(l->gate);
    free(l->up);
    free(l->hq);
    free(l->down);
    free(l);
}

int kv_expert_local_new(kv_expert_provider *out, const kv_model *m, kv_pool *pool,
                        uint32_t max_tokens, kv_diag *d) {
    memset(out, 0, sizeof *out);
    const kv_hparams *hp = kv_model_hparams(m);
    if (max_tokens == 0) return kv_fail(d, KV_EINVAL, "experts: max_tokens must be > 0");
    kv_local *l = calloc(1, sizeof *l);
    if (!l) return kv_fail(d, KV_ENOMEM, "experts: out of memory");
    l->m = m;
    l->pool = pool;
    l->max_tokens = max_tokens;
    const size_t ns = (size_t)max_tokens * hp->n_expert_used;
    l->n_slots_max = (uint32_t)ns;
    const size_t row_in = kv_matmul_scratch(hp->n_embd, 1), row_ff = kv_matmul_scratch(hp->n_ff_exp, 1);
    l->slot_order = malloc(ns * sizeof(int32_t));
    l->exp_first = malloc((hp->n_expert + 1) * sizeof(int32_t));
    l->active = malloc(hp->n_expert * sizeof(int32_t));
    l->xq = malloc(ns * row_in);
    l->gate = malloc(ns * hp->n_ff_exp * sizeof(float));
    l->up = malloc(ns * hp->n_ff_exp * sizeof(float));
    l->hq = malloc(ns * row_ff);
    l->down = malloc(ns * hp->n_embd * sizeof(float));
    l->cursor = malloc(hp->n_expert * sizeof(int32_t));
    if (!l->slot_order || !l->exp_first || !l->active || !l->xq || !l->gate || !l->up || !l->hq ||
        !l->down || !l->cursor) {
        kv_local_free(l);
        return kv_fail(d, KV_ENOMEM, "experts: out of memory for %u tokens", max_tokens);
    }
    out->impl = l;
    out->compute = kv_local_compute;
    out->free = kv_local_free;
    out->name = "local";
    return 0;
}
