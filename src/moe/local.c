/* In-process expert provider: computes routed-expert FFNs from an expert
 * source (the model file's expert tensors, slab files, a cache).
 *
 * A request's (token, rank) slots are grouped by expert (stable order), the
 * weights of every active expert acquired, the quantized inputs gathered per
 * expert, and then parallel phases run: gate+up rows of every active expert,
 * SwiGLU + re-quantization per slot, down rows of every active expert,
 * scatter back. Work is split over the concatenated rows of all active
 * experts, so a decode step with 8 experts keeps every thread busy. Every
 * output element is one whole dot product, so results do not depend on
 * thread count, on which tokens share a step, or on where the weights live.
 * Scratch is allocated once for max_tokens. */
#include <stdlib.h>
#include <string.h>

#include "kvasir/model.h"
#include "kvasir/ops.h"
#include "kvasir/pool.h"
#include "kvasir/quant.h"

typedef struct kv_local {
    kv_expert_source src;
    kv_pool *pool;
    uint32_t n_slots_max;   /* max_tokens * n_expert_used */
    /* per-call scratch */
    int32_t *slot_order;    /* [n_slots] slots sorted by expert */
    int32_t *exp_first;     /* [n_expert+1] start of each expert's run in slot_order */
    int32_t *active;        /* [n_expert] experts with at least one slot */
    int32_t *cursor;        /* [n_expert] fill positions while sorting */
    kv_expert_weights *w;   /* [n_expert] weights of active expert i (by active index) */
    uint8_t *xq;            /* [n_slots][row] gathered quantized inputs (up's type) */
    uint8_t *xg;            /* [n_slots][row] the same in gate's type when it differs from
                               up's (gate Q8_0, up Q4_K); allocated on first need */
    float *gate;            /* [n_slots][n_ff] */
    float *up;              /* [n_slots][n_ff] */
    uint8_t *hq;            /* [n_slots][row] quantized SwiGLU outputs (down type) */
    float *down;            /* [n_slots][n_embd] */
    float *pre_gate, *pre_up; /* kv_expert_local_compute_pre: [n_slots][n_ff] outputs in
                                 (token, rank) order, or NULL */
} kv_local;

typedef struct kv_local_job {
    kv_local *l;
    const kv_expert_req *req;
    int n_active;
    uint32_t up_vdt, gate_vdt, down_vdt; /* activation types of up, gate and down */
    size_t xq_stride, xg_stride, hq_stride; /* xg_stride 0: gate reads xq */
    float *out;
    int phase;
} kv_local_job;

enum { KV_MAT_GATE, KV_MAT_UP, KV_MAT_DOWN };

/* The first of the concatenated row blocks whose cost starts at or after c,
 * a block of active expert i costing its token count + 1 (the one for
 * streaming the block's weights). */
static long kv_local_block_at(const kv_local *l, int n_active, long blocks_per, long c) {
    long cum = 0;
    for (int i = 0; i < n_active; i++) {
        const int32_t e = l->active[i];
        const long w = (long)(l->exp_first[e + 1] - l->exp_first[e]) + 1, span = w * blocks_per;
        if (cum + span > c) return (long)i * blocks_per + (c - cum + w - 1) / w;
        cum += span;
    }
    return (long)n_active * blocks_per;
}

/* Runs kv_mat_rows over this thread's share of the concatenated rows of one
 * matrix kind of all active experts, for their gathered slot inputs. The
 * shares are even in cost, not in rows: in a prefill the experts' token
 * counts differ several-fold, and an even row split left one thread waiting. */
static void kv_local_rows(kv_local_job *j, int which, const uint8_t *A, size_t a_stride, float *Y,
                          int ith, int nth) {
    kv_local *l = j->l;
    const int64_t n_in = which == KV_MAT_DOWN ? l->src.n_ff_exp : l->src.n_embd;
    const long rows = which == KV_MAT_DOWN ? (long)l->src.n_embd : (long)l->src.n_ff_exp;
    const long blocks_per = (rows + 15) / 16;
    long total = 0;
    for (int i = 0; i < j->n_active; i++)
        total += blocks_per * ((long)(l->exp_first[l->active[i] + 1] - l->exp_first[l->active[i]]) + 1);
    const long lo = kv_local_block_at(l, j->n_active, blocks_per, (long)((double)total * ith / nth)),
               hi = ith == nth - 1 ? (long)j->n_active * blocks_per
                                   : kv_local_block_at(l, j->n_active, blocks_per, (long)((double)total * (ith + 1) / nth));
    for (long b = lo; b < hi;) {
        const long ai = b / blocks_per;
        const long bend = (ai + 1) * blocks_per < hi ? (ai + 1) * blocks_per : hi;
        const int32_t e = l->active[ai];
        const int32_t s0 = l->exp_first[e], s1 = l->exp_first[e + 1];
        const kv_expert_weights *w = &l->w[ai];
        const void *mat = which == KV_MAT_GATE ? w->gate : which == KV_MAT_UP ? w->up : w->down;
        const uint32_t type = which == KV_MAT_GATE ? w->gate_type : which == KV_MAT_UP ? w->up_type : w->down_type;
        long r0 = (b - ai * blocks_per) * 16, r1 = (bend - ai * blocks_per) * 16;
        if (r1 > rows) r1 = rows;
        kv_mat_rows(type, mat, (size_t)kv_type_row_size(type, (uint64_t)n_in), n_in, r0, r1,
                    A + (size_t)s0 * a_stride, a_stride, s1 - s0, Y + (size_t)s0 * (size_t)rows,
                    (size_t)rows);
        b = bend;
    }
}

static void kv_local_worker(void *arg, int ith, int nth) {
    kv_local_job *j = arg;
    kv_local *l = j->l;
    const kv_expert_req *r = j->req;
    const int64_t n_ff = l->src.n_ff_exp, E = r->n_embd;
    const long n_slots = (long)r->n_tokens * r->n_used;
    long lo, hi;
    switch (j->phase) {
    case 0: /* gather + quantize inputs, in sorted slot order */
        kv_pool_split(n_slots, ith, nth, &lo, &hi);
        for (long i = lo; i < hi; i++) {
            const int32_t t = l->slot_order[i] / (int32_t)r->n_used;
            kv_quantize_rows(j->up_vdt, r->x + (size_t)t * (size_t)E, (size_t)E, E, 1,
                             l->xq + (size_t)i * j->xq_stride, j->xq_stride);
            if (j->xg_stride)
                kv_quantize_rows(j->gate_vdt, r->x + (size_t)t * (size_t)E, (size_t)E, E, 1,
                                 l->xg + (size_t)i * j->xg_stride, j->xg_stride);
        }
        break;
    case 1: /* gate and up rows */
        if (j->xg_stride)
            kv_local_rows(j, KV_MAT_GATE, l->xg, j->xg_stride, l->gate, ith, nth);
        else
            kv_local_rows(j, KV_MAT_GATE, l->xq, j->xq_stride, l->gate, ith, nth);
        kv_local_rows(j, KV_MAT_UP, l->xq, j->xq_stride, l->up, ith, nth);
        break;
    case 2: /* SwiGLU and quantize for down */
        kv_pool_split(n_slots, ith, nth, &lo, &hi);
        for (long i = lo; i < hi; i++) {
            float *g = l->gate + (size_t)i * (size_t)n_ff;
            if (l->pre_gate) { /* the pre-activations a verifier checks, before SwiGLU overwrites them */
                const size_t o = (size_t)l->slot_order[i] * (size_t)n_ff;
                memcpy(l->pre_gate + o, g, (size_t)n_ff * sizeof(float));
                memcpy(l->pre_up + o, l->up + (size_t)i * (size_t)n_ff, (size_t)n_ff * sizeof(float));
            }
            kv_swiglu(g, g, l->up + (size_t)i * (size_t)n_ff, n_ff);
            kv_quantize_rows(j->down_vdt, g, (size_t)n_ff, n_ff, 1, l->hq + (size_t)i * j->hq_stride,
                             j->hq_stride);
        }
        break;
    case 3: /* down rows */
        kv_local_rows(j, KV_MAT_DOWN, l->hq, j->hq_stride, l->down, ith, nth);
        break;
    case 4: /* scatter back to (token, rank) order */
        kv_pool_split(n_slots, ith, nth, &lo, &hi);
        for (long i = lo; i < hi; i++)
            memcpy(j->out + (size_t)l->slot_order[i] * (size_t)E, l->down + (size_t)i * (size_t)E,
                   (size_t)E * sizeof(float));
        break;
    }
}

static void kv_local_release(kv_local *l, uint32_t layer, int n) {
    if (!l->src.release) return;
    for (int i = 0; i < n; i++) l->src.release(l->src.ctx, layer, (uint32_t)l->active[i]);
}

static int kv_local_compute(void *impl, const kv_expert_req *req, float *out, kv_diag *d) {
    kv_local *l = impl;
    const kv_expert_source *src = &l->src;
    if (req->layer >= src->n_layer)
        return kv_fail(d, KV_ERANGE, "experts: layer %u out of range (%u layers)", req->layer, src->n_layer);
    if (req->n_embd != src->n_embd || req->n_used == 0 || req->n_tokens == 0 ||
        (uint64_t)req->n_tokens * req->n_used > l->n_slots_max)
        return kv_fail(d, KV_EINVAL, "experts: request shape (%u tokens x %u experts, embd %u) exceeds "
                       "provider limits", req->n_tokens, req->n_used, req->n_embd);
    const uint32_t n_slots = req->n_tokens * req->n_used;
    /* counting sort of slots by expert id: stable, so each expert's slots
     * stay in token order */
    memset(l->exp_first, 0, (src->n_expert + 1) * sizeof(int32_t));
    for (uint32_t s = 0; s < n_slots; s++) {
        const int32_t e = req->ids[s];
        if (e < 0 || (uint32_t)e >= src->n_expert)
            return kv_fail(d, KV_ERANGE, "experts: expert id %d out of range (%u experts)", e, src->n_expert);
        l->exp_first[e + 1]++;
    }
    int n_active = 0;
    for (uint32_t e = 0; e < src->n_expert; e++) {
        if (l->exp_first[e + 1]) l->active[n_active++] = (int32_t)e;
        l->exp_first[e + 1] += l->exp_first[e];
    }
    memcpy(l->cursor, l->exp_first, src->n_expert * sizeof(int32_t));
    for (uint32_t s = 0; s < n_slots; s++) l->slot_order[l->cursor[req->ids[s]]++] = (int32_t)s;
    /* weights of every active expert; all three matrices of a layer must
     * share the activation type per role across experts */
    for (int i = 0; i < n_active; i++) {
        int rc = src->acquire(src->ctx, req->layer, (uint32_t)l->active[i], &l->w[i], d);
        if (rc) {
            kv_local_release(l, req->layer, i);
            return rc;
        }
        if (i > 0 && (l->w[i].up_type != l->w[0].up_type || l->w[i].gate_type != l->w[0].gate_type ||
                      l->w[i].down_type != l->w[0].down_type)) {
            kv_local_release(l, req->layer, i + 1);
            return kv_fail(d, KV_EFORMAT, "experts: layer %u expert %d has other tensor types than expert %d",
                           req->layer, l->active[i], l->active[0]);
        }
    }
    kv_local_job j = {l, req, n_active, 0, 0, 0, 0, 0, 0, out, 0};
    const kv_type_info *tg = kv_type_get(l->w[0].gate_type), *tu = kv_type_get(l->w[0].up_type),
                       *td = kv_type_get(l->w[0].down_type);
    if (!tg || !tu || !td || !tg->compute || !tu->compute || !td->compute) {
        kv_local_release(l, req->layer, n_active);
        return kv_fail(d, KV_EUNSUPPORTED, "experts: layer %u: unsupported expert tensor types (%s, %s, %s)",
                       req->layer, tg ? tg->name : "?", tu ? tu->name : "?", td ? td->name : "?");
    }
    j.up_vdt = tu->vec_dot_type;
    j.gate_vdt = tg->vec_dot_type;
    j.down_vdt = td->vec_dot_type;
    j.xq_stride = (size_t)kv_type_row_size(j.up_vdt, src->n_embd);
    if (j.gate_vdt != j.up_vdt) { /* gate and up quantize their inputs differently */
        if (!l->xg && !(l->xg = malloc((size_t)l->n_slots_max * kv_matmul_scratch(src->n_embd, 1)))) {
            kv_local_release(l, req->layer, n_active);
            return kv_fail(d, KV_ENOMEM, "experts: out of memory for gate inputs of layer %u", req->layer);
        }
        j.xg_stride = (size_t)kv_type_row_size(j.gate_vdt, src->n_embd);
    }
    j.hq_stride = (size_t)kv_type_row_size(j.down_vdt, src->n_ff_exp);
    for (j.phase = 0; j.phase <= 4; j.phase++) kv_pool_run(l->pool, kv_local_worker, &j);
    kv_local_release(l, req->layer, n_active);
    return 0;
}

static void kv_local_free(void *impl) {
    kv_local *l = impl;
    if (!l) return;
    free(l->slot_order);
    free(l->exp_first);
    free(l->active);
    free(l->cursor);
    free(l->w);
    free(l->xq);
    free(l->xg);
    free(l->gate);
    free(l->up);
    free(l->hq);
    free(l->down);
    free(l);
}

int kv_expert_local_new_src(kv_expert_provider *out, const kv_expert_source *src, kv_pool *pool,
                            uint32_t max_tokens, kv_diag *d) {
    memset(out, 0, sizeof *out);
    if (max_tokens == 0) return kv_fail(d, KV_EINVAL, "experts: max_tokens must be > 0");
    if (!src->acquire || !src->n_expert || !src->n_embd || !src->n_ff_exp || !src->n_expert_used)
        return kv_fail(d, KV_EINVAL, "experts: incomplete expert source");
    kv_local *l = calloc(1, sizeof *l);
    if (!l) return kv_fail(d, KV_ENOMEM, "experts: out of memory");
    l->src = *src;
    l->pool = pool;
    const size_t ns = (size_t)max_tokens * src->n_expert_used;
    l->n_slots_max = (uint32_t)ns;
    const size_t row_in = kv_matmul_scratch(src->n_embd, 1), row_ff = kv_matmul_scratch(src->n_ff_exp, 1);
    l->slot_order = malloc(ns * sizeof(int32_t));
    l->exp_first = malloc((src->n_expert + 1) * sizeof(int32_t));
    l->active = malloc(src->n_expert * sizeof(int32_t));
    l->cursor = malloc(src->n_expert * sizeof(int32_t));
    l->w = calloc(src->n_expert, sizeof *l->w);
    l->xq = malloc(ns * row_in);
    l->gate = malloc(ns * src->n_ff_exp * sizeof(float));
    l->up = malloc(ns * src->n_ff_exp * sizeof(float));
    l->hq = malloc(ns * row_ff);
    l->down = malloc(ns * src->n_embd * sizeof(float));
    if (!l->slot_order || !l->exp_first || !l->active || !l->cursor || !l->w || !l->xq || !l->gate ||
        !l->up || !l->hq || !l->down) {
        kv_local_free(l);
        return kv_fail(d, KV_ENOMEM, "experts: out of memory for %u tokens", max_tokens);
    }
    out->impl = l;
    out->compute = kv_local_compute;
    out->free = kv_local_free;
    out->name = "local";
    return 0;
}

int kv_expert_local_compute_pre(const kv_expert_provider *p, const kv_expert_req *req, float *out, float *gate,
                                float *up, kv_diag *d) {
    if (p->compute != kv_local_compute) return kv_fail(d, KV_EINVAL, "experts: not an in-process provider");
    kv_local *l = p->impl;
    l->pre_gate = gate;
    l->pre_up = up;
    int rc = kv_local_compute(l, req, out, d);
    l->pre_gate = l->pre_up = NULL;
    return rc;
}

/* ---- the model file as an expert source ---------------------------------- */

static int kv_model_src_acquire(void *ctx, uint32_t layer, uint32_t e, kv_expert_weights *w, kv_diag *d) {
    const kv_model *m = ctx;
    const kv_layer *L = kv_model_layer(m, layer);
    if (!L || e >= kv_model_hparams(m)->n_expert)
        return kv_fail(d, KV_ERANGE, "experts: layer %u expert %u out of range", layer, e);
    w->gate = (const uint8_t *)L->gate_exps.data + (size_t)e * L->gate_exps.nb2;
    w->up = (const uint8_t *)L->up_exps.data + (size_t)e * L->up_exps.nb2;
    w->down = (const uint8_t *)L->down_exps.data + (size_t)e * L->down_exps.nb2;
    w->gate_type = L->gate_exps.type;
    w->up_type = L->up_exps.type;
    w->down_type = L->down_exps.type;
    return 0;
}

kv_expert_source kv_model_expert_source(const kv_model *m) {
    const kv_hparams *hp = kv_model_hparams(m);
    return (kv_expert_source){(void *)m, kv_model_src_acquire, NULL, hp->n_layer, hp->n_expert,
                              hp->n_embd, hp->n_ff_exp, hp->n_expert_used};
}

int kv_expert_local_new(kv_expert_provider *out, const kv_model *m, kv_pool *pool,
                        uint32_t max_tokens, kv_diag *d) {
    kv_expert_source src = kv_model_expert_source(m);
    return kv_expert_local_new_src(out, &src, pool, max_tokens, d);
}
