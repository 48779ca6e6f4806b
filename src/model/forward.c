/* The qwen3moe forward pass over one sequence.
 *
 * Per block: attention RMSNorm; Q/K/V projections; per-head RMSNorm of Q and
 * K; NeoX RoPE; causal softmax attention over the KV cache (GQA: query head
 * h reads KV head h / (n_head / n_head_kv)); output projection and residual;
 * FFN RMSNorm; router softmax, top-k, weight renormalization; routed experts
 * through the expert provider; weighted sum in top-k rank order; residual.
 * Then the final norm and the LM head on the last token.
 *
 * The state is allocated once (kv_state_new); kv_state_eval only computes.
 * Prompts run as batches of up to n_batch tokens, decode one token at a
 * time; both take the same path, and each output element is computed the
 * same way whatever the batch, so results do not depend on chunking. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/quant.h"
#include "model/model_internal.h"
#include "quant/vec.h"


static size_t kv_max3(size_t a, size_t b, size_t c) {
    size_t m = a > b ? a : b;
    return m > c ? m : c;
}

int kv_state_new(kv_state **out, const kv_model *m, kv_pool *pool, const kv_state_opts *opts,
                 kv_diag *d) {
    *out = NULL;
    const kv_hparams *hp = &m->hp;
    kv_state_opts o = opts ? *opts : (kv_state_opts){0};
    if (o.n_ctx == 0) o.n_ctx = hp->n_ctx_train < 4096 ? hp->n_ctx_train : 4096;
    if (o.n_batch == 0) o.n_batch = 256;
    if (o.n_ctx > KV_MAX_CTX) return kv_fail(d, KV_EINVAL, "context: %u exceeds max %u", o.n_ctx, KV_MAX_CTX);
    if (o.n_batch > o.n_ctx) o.n_batch = o.n_ctx;
    if (o.n_seq == 0) o.n_seq = 1;
    if (o.n_seq > 4096) return kv_fail(d, KV_EINVAL, "state: %u sequences exceed max 4096", o.n_seq);
    kv_state *s = calloc(1, sizeof *s);
    if (!s) return kv_fail(d, KV_ENOMEM, "state: out of memory");
    s->m = m;
    s->pool = pool;
    s->n_ctx = o.n_ctx;
    s->n_batch = o.n_batch;
    s->n_seq = o.n_seq;
    s->max_tok = o.n_batch > o.n_seq ? o.n_batch : o.n_seq;
    const size_t B = s->max_tok, E = hp->n_embd, QD = (size_t)hp->n_head * hp->head_dim,
                 KVD = (size_t)hp->n_head_kv * hp->head_dim, K = hp->n_expert_used;
    size_t cache_elems;
    if (!kv_mul_ok((size_t)hp->n_layer * o.n_ctx * o.n_seq, KVD, &cache_elems) ||
        cache_elems > ((size_t)1 << 40) / sizeof(float)) {
        kv_state_free(s);
        return kv_fail(d, KV_EINVAL, "context: KV cache for %u tokens is too large", o.n_ctx);
    }
    s->k_cache = malloc(cache_elems * sizeof(float));
    s->v_cache = malloc(cache_elems * sizeof(float));
    s->x = malloc(B * E * sizeof(float));
    s->xb = malloc(B * E * sizeof(float));
    s->q = malloc(B * QD * sizeof(float));
    s->k = malloc(B * KVD * sizeof(float));
    s->v = malloc(B * KVD * sizeof(float));
    s->att = malloc(B * QD * sizeof(float));
    s->tmp = malloc(B * E * sizeof(float));
    s->router = malloc(B * hp->n_expert * sizeof(float));
    s->ids = malloc(B * K * sizeof(int32_t));
    s->wts = malloc(B * K * sizeof(float));
    s->eo = malloc(B * K * E * sizeof(float));
    s->scores = malloc((size_t)kv_pool_size(pool) * o.n_ctx * sizeof(float));
    s->pos = calloc(o.n_seq, sizeof *s->pos);
    s->tok_seq = malloc(B * sizeof *s->tok_seq);
    s->tok_pos = malloc(B * sizeof *s->tok_pos);
    s->hout = malloc(B * E * sizeof(float));
    s->out_all = malloc(B * sizeof *s->out_all);
    s->scratch = malloc(kv_matmul_scratch((int64_t)kv_max3(E, QD, hp->n_ff_exp), (int64_t)B));
    if (!s->k_cache || !s->v_cache || !s->x || !s->xb || !s->q || !s->k || !s->v || !s->att ||
        !s->tmp || !s->router || !s->ids || !s->wts || !s->eo || !s->scores || !s->scratch ||
        !s->pos || !s->tok_seq || !s->tok_pos || !s->hout || !s->out_all) {
        kv_state_free(s);
        return kv_fail(d, KV_ENOMEM, "state: out of memory (context %u, batch %u)", o.n_ctx, o.n_batch);
    }
    for (size_t i = 0; i < B; i++) s->out_all[i] = (uint32_t)i;
    if (hp->arch == KV_ARCH_QWEN35MOE) {
        int rc = kv_q35_state_new(s, d);
        if (rc) {
            kv_state_free(s);
            return rc;
        }
    }
    if (o.experts) {
        s->experts = o.experts;
    } else if (!m->has_experts) {
        kv_state_free(s);
        return kv_fail(d, KV_EINVAL, "state: the model has no routed experts of its own; an expert provider is required");
    } else {
        int rc = kv_expert_local_new(&s->own, m, pool, s->max_tok, d);
        if (rc) {
            kv_state_free(s);
            return rc;
        }
        s->experts = &s->own;
    }
    *out = s;
    return 0;
}

void kv_state_free(kv_state *s) {
    if (!s) return;
    if (s->own.free) s->own.free(s->own.impl);
    kv_q35_state_free(s);
    free(s->k_cache);
    free(s->v_cache);
    free(s->x);
    free(s->xb);
    free(s->q);
    free(s->k);
    free(s->v);
    free(s->att);
    free(s->tmp);
    free(s->router);
    free(s->ids);
    free(s->wts);
    free(s->eo);
    free(s->scores);
    free(s->scratch);
    free(s->pos);
    free(s->tok_seq);
    free(s->tok_pos);
    free(s->hout);
    free(s->out_all);
    free(s);
}

uint32_t kv_state_n_ctx(const kv_state *s) { return s->n_ctx; }
uint32_t kv_state_n_seq(const kv_state *s) { return s->n_seq; }
uint32_t kv_state_pos(const kv_state *s) { return s->pos[0]; }
uint32_t kv_state_pos_seq(const kv_state *s, uint32_t seq) { return seq < s->n_seq ? s->pos[seq] : 0; }
void kv_state_reset(kv_state *s) { memset(s->pos, 0, s->n_seq * sizeof *s->pos); }
void kv_state_reset_seq(kv_state *s, uint32_t seq) {
    if (seq < s->n_seq) s->pos[seq] = 0;
}

/* First cache row of (seq, layer). */
static size_t kv_cache_row(const kv_state *s, uint32_t seq, uint32_t il) {
    return ((size_t)seq * s->m->hp.n_layer + il) * s->n_ctx;
}

/* ---- attention ---------------------------------------------------------- */

typedef struct kv_attn_job {
    kv_state *s;
    uint32_t il, n_tok;
} kv_attn_job;

static void kv_attn_worker(void *arg, int ith, int nth) {
    kv_attn_job *j = arg;
    kv_state *s = j->s;
    const kv_hparams *hp = &s->m->hp;
    const int64_t HD = hp->head_dim, H = hp->n_head, KVD = (int64_t)hp->n_head_kv * HD;
    const int64_t gqa = hp->n_head / hp->n_head_kv;
    const float scale = 1.0f / sqrtf((float)HD);
    float *sc = s->scores + (size_t)ith * s->n_ctx;
    long lo, hi;
    kv_pool_split((long)j->n_tok * H, ith, nth, &lo, &hi);
    for (long w = lo; w < hi; w++) {
        const int64_t t = w / H, h = w % H, kvh = h / gqa;
        const int64_t n_kv = (int64_t)s->tok_pos[t] + 1; /* causal: keys 0..pos of its sequence */
        const size_t row0 = kv_cache_row(s, s->tok_seq[t], j->il);
        const float *kc = s->k_cache + row0 * (size_t)KVD, *vc = s->v_cache + row0 * (size_t)KVD;
        const float *q = s->q + (size_t)t * (size_t)(H * HD) + (size_t)h * (size_t)HD;
        /* fixed order per output element (quant/vec.h): never depends on threads */
        kv_f32_dot_rows(q, kc + (size_t)kvh * (size_t)HD, (size_t)KVD, n_kv, HD, scale, sc);
        kv_softmax(sc, n_kv);
        float *o = s->att + (size_t)t * (size_t)(H * HD) + (size_t)h * (size_t)HD;
        kv_f32_wsum_rows(o, sc, vc + (size_t)kvh * (size_t)HD, (size_t)KVD, n_kv, HD);
    }
}

/* ---- one chunk ------------------------------------------------------------ */

static void kv_topk(const float *p, int n, int k, int32_t *ids) {
    /* selection by descending probability, lower id first on ties */
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

int kv_moe_routed(kv_state *s, const kv_layer *L, uint32_t il, uint32_t T, kv_diag *d) {
    const kv_hparams *hp = &s->m->hp;
    const int64_t E = hp->n_embd, K = hp->n_expert_used, NE = hp->n_expert;
    kv_matmul(s->pool, &L->gate_inp, NULL, s->xb, T, s->router, s->scratch);
    for (uint32_t t = 0; t < T; t++) {
        float *p = s->router + (size_t)t * NE;
        int32_t *ids = s->ids + (size_t)t * K;
        float *w = s->wts + (size_t)t * K;
        kv_softmax(p, NE);
        kv_topk(p, (int)NE, (int)K, ids);
        for (int64_t r = 0; r < K; r++) w[r] = p[ids[r]];
        if (hp->expert_weights_norm) {
            double sum = 0.0;
            for (int64_t r = 0; r < K; r++) sum += (double)w[r];
            float fs = (float)sum;
            if (fs < 6.103515625e-5f) fs = 6.103515625e-5f;
            for (int64_t r = 0; r < K; r++) w[r] = w[r] / fs;
        }
        if (hp->expert_weights_scale != 0.0f && hp->expert_weights_scale != 1.0f)
            for (int64_t r = 0; r < K; r++) w[r] *= hp->expert_weights_scale;
    }
    /* routed experts, wherever they are computed */
    kv_expert_req req = {il, T, (uint32_t)E, (uint32_t)K, s->xb, s->ids};
    int rc = s->experts->compute(s->experts->impl, &req, s->eo, d);
    if (rc) return kv_diag_prefix(d, rc, "layer %u experts", il);
    /* weighted sum in rank order */
    for (uint32_t t = 0; t < T; t++) {
        float *acc = s->tmp + (size_t)t * E;
        const float *w = s->wts + (size_t)t * K;
        const float *eo = s->eo + (size_t)t * K * E;
        for (int64_t i = 0; i < E; i++) acc[i] = eo[i] * w[0];
        for (int64_t r = 1; r < K; r++)
            for (int64_t i = 0; i < E; i++) acc[i] = acc[i] + eo[(size_t)r * E + i] * w[r];
    }
    return 0;
}

void kv_attn_run(kv_state *s, uint32_t il, uint32_t n_tok) {
    kv_attn_job aj = {s, il, n_tok};
    kv_pool_run(s->pool, kv_attn_worker, &aj);
}

/* The qwen3moe blocks over the T embedded tokens in s->x (sequence
 * s->tok_seq[t], position s->tok_pos[t]). */
static int kv_q3_blocks(kv_state *s, uint32_t T, kv_diag *d) {
    const kv_model *m = s->m;
    const kv_hparams *hp = &m->hp;
    const int64_t E = hp->n_embd, HD = hp->head_dim, H = hp->n_head, HKV = hp->n_head_kv;
    const int64_t QD = H * HD, KVD = HKV * HD;

    for (uint32_t il = 0; il < hp->n_layer; il++) {
        const kv_layer *L = &m->layers[il];
        /* attention rmsnorm */
        for (uint32_t t = 0; t < T; t++)
            kv_rmsnorm(s->xb + (size_t)t * E, s->x + (size_t)t * E, L->attn_norm.data, E, hp->rms_eps);
        /* Q, K, V projections */
        kv_matmul(s->pool, &L->wq, NULL, s->xb, T, s->q, s->scratch);
        kv_matmul(s->pool, &L->wk, NULL, s->xb, T, s->k, s->scratch);
        kv_matmul(s->pool, &L->wv, NULL, s->xb, T, s->v, s->scratch);
        /* per-head Q/K norm, RoPE, then K and V into the cache */
        for (uint32_t t = 0; t < T; t++) {
            const int32_t pos = (int32_t)s->tok_pos[t];
            for (int64_t h = 0; h < H; h++) {
                float *qh = s->q + (size_t)t * QD + (size_t)h * HD;
                kv_rmsnorm(qh, qh, L->q_norm.data, HD, hp->rms_eps);
                kv_rope_neox(qh, HD, hp->n_rot, pos, hp->rope_freq_base, hp->rope_freq_scale);
            }
            for (int64_t h = 0; h < HKV; h++) {
                float *kh = s->k + (size_t)t * KVD + (size_t)h * HD;
                kv_rmsnorm(kh, kh, L->k_norm.data, HD, hp->rms_eps);
                kv_rope_neox(kh, HD, hp->n_rot, pos, hp->rope_freq_base, hp->rope_freq_scale);
            }
        }
        for (uint32_t t = 0; t < T; t++) {
            const size_t row = kv_cache_row(s, s->tok_seq[t], il) + s->tok_pos[t];
            memcpy(s->k_cache + row * (size_t)KVD, s->k + (size_t)t * KVD, (size_t)KVD * sizeof(float));
            memcpy(s->v_cache + row * (size_t)KVD, s->v + (size_t)t * KVD, (size_t)KVD * sizeof(float));
        }
        /* causal attention */
        kv_attn_run(s, il, T);
        /* output projection + residual */
        kv_matmul(s->pool, &L->wo, NULL, s->att, T, s->tmp, s->scratch);
        for (size_t i = 0; i < (size_t)T * E; i++) s->x[i] = s->tmp[i] + s->x[i];
        /* FFN rmsnorm, routed experts, residual */
        for (uint32_t t = 0; t < T; t++)
            kv_rmsnorm(s->xb + (size_t)t * E, s->x + (size_t)t * E, L->ffn_norm.data, E, hp->rms_eps);
        int rc = kv_moe_routed(s, L, il, T, d);
        if (rc) return rc;
        for (size_t i = 0; i < (size_t)T * E; i++) s->x[i] = s->tmp[i] + s->x[i];
    }
    return 0;
}

/* Runs T tokens (sequence s->tok_seq[t], position s->tok_pos[t]): token
 * embeddings, the architecture's blocks, then the final norm and LM head for
 * the n_out tokens listed in out_idx (in that order). */
static int kv_eval_chunk(kv_state *s, const int32_t *tokens, uint32_t T, const uint32_t *out_idx,
                         uint32_t n_out, float *logits, kv_diag *d) {
    const kv_model *m = s->m;
    const kv_hparams *hp = &m->hp;
    const int64_t E = hp->n_embd;
    const kv_type_info *et = kv_type_get(m->tok_embd.type);
    for (uint32_t t = 0; t < T; t++)
        et->to_float((const uint8_t *)m->tok_embd.data + (size_t)tokens[t] * m->tok_embd.row_bytes,
                     s->x + (size_t)t * (size_t)E, E);
    int rc = hp->arch == KV_ARCH_QWEN35MOE ? kv_q35_blocks(s, T, d) : kv_q3_blocks(s, T, d);
    if (rc) return rc;
    if (logits && n_out) {
        for (uint32_t i = 0; i < n_out; i++)
            kv_rmsnorm(s->hout + (size_t)i * E, s->x + (size_t)out_idx[i] * E, m->output_norm.data, E,
                       hp->rms_eps);
        kv_matmul(s->pool, &m->output, NULL, s->hout, n_out, logits, s->scratch);
    }
    return 0;
}

static int kv_check_tokens(const kv_state *s, const int32_t *tokens, uint32_t n, kv_diag *d) {
    for (uint32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= s->m->hp.n_vocab)
            return kv_fail(d, KV_ERANGE, "eval: token id %d out of range (vocab %u)", tokens[i],
                           s->m->hp.n_vocab);
    return 0;
}

int kv_state_eval_seq(kv_state *s, uint32_t seq, const int32_t *tokens, uint32_t n, float *logits,
                      kv_diag *d) {
    if (n == 0) return kv_fail(d, KV_EINVAL, "eval: no tokens");
    if (seq >= s->n_seq) return kv_fail(d, KV_ERANGE, "eval: sequence %u out of range (%u)", seq, s->n_seq);
    if ((uint64_t)s->pos[seq] + n > s->n_ctx)
        return kv_fail(d, KV_ECTXFULL, "context full: %u tokens in cache + %u new > context %u",
                       s->pos[seq], n, s->n_ctx);
    int rc = kv_check_tokens(s, tokens, n, d);
    if (rc) return rc;
    const uint32_t pos_start = s->pos[seq];
    for (uint32_t done = 0; done < n;) {
        const uint32_t T = n - done < s->n_batch ? n - done : s->n_batch;
        for (uint32_t t = 0; t < T; t++) {
            s->tok_seq[t] = seq;
            s->tok_pos[t] = s->pos[seq] + t;
        }
        const uint32_t last = T - 1;
        rc = kv_eval_chunk(s, tokens + done, T, &last, 1, done + T == n ? logits : NULL, d);
        if (rc) {
            s->pos[seq] = pos_start;
            if (done > 0 && s->q35) {
                /* earlier chunks already advanced the recurrent state, which
                 * cannot be rolled back: the sequence starts over */
                s->pos[seq] = 0;
                kv_diag_prefix(d, rc, "sequence %u reset to empty (recurrent state)", seq);
            }
            return rc;
        }
        s->pos[seq] += T;
        done += T;
    }
    return 0;
}

int kv_state_eval(kv_state *s, const int32_t *tokens, uint32_t n, float *logits, kv_diag *d) {
    return kv_state_eval_seq(s, 0, tokens, n, logits, d);
}

int kv_state_decode(kv_state *s, const int32_t *tokens, const uint32_t *seqs, uint32_t n,
                    float *logits, kv_diag *d) {
    if (n == 0) return kv_fail(d, KV_EINVAL, "decode: no tokens");
    if (n > s->max_tok) return kv_fail(d, KV_EINVAL, "decode: %u tokens exceed the step size %u", n, s->max_tok);
    for (uint32_t i = 0; i < n; i++) {
        if (seqs[i] >= s->n_seq)
            return kv_fail(d, KV_ERANGE, "decode: sequence %u out of range (%u)", seqs[i], s->n_seq);
        for (uint32_t k = 0; k < i; k++)
            if (seqs[k] == seqs[i]) return kv_fail(d, KV_EINVAL, "decode: sequence %u given twice", seqs[i]);
        if (s->pos[seqs[i]] + 1 > s->n_ctx)
            return kv_fail(d, KV_ECTXFULL, "context full: sequence %u holds %u tokens of %u", seqs[i],
                           s->pos[seqs[i]], s->n_ctx);
        s->tok_seq[i] = seqs[i];
        s->tok_pos[i] = s->pos[seqs[i]];
    }
    int rc = kv_check_tokens(s, tokens, n, d);
    if (rc) return rc;
    rc = kv_eval_chunk(s, tokens, n, s->out_all, n, logits, d);
    if (rc) return rc;
    for (uint32_t i = 0; i < n; i++) s->pos[seqs[i]]++;
    return 0;
}
