/* The run state, its paged KV cache, the chunk driver shared by both
 * architectures, and the qwen3moe blocks.
 *
 * Per qwen3moe block: attention RMSNorm; Q/K/V projections; per-head
 * RMSNorm of Q and K; NeoX RoPE; causal softmax attention over the KV cache
 * (GQA: query head h reads KV head h / (n_head / n_head_kv)); output
 * projection and residual; FFN RMSNorm; router softmax, top-k, weight
 * renormalization; routed experts through the expert provider; weighted sum
 * in top-k rank order; residual. Then the final norm and the LM head on the
 * tokens whose logits are wanted.
 *
 * A call carries any tokens of any sequences (each at its own position):
 * prompt chunks and decode tokens take the same path, and each output
 * element is computed the same way whatever the batch, so results depend
 * neither on chunking nor on what else shares the call. The KV cache is a
 * pool of blocks of KV_BLOCK positions (attending layers only, F32 or F16):
 * attention reads a sequence's blocks in position order with the same
 * per-element operation order as over contiguous rows. Buffers are
 * allocated in kv_state_new; the pool grows in kv_state_reserve, before a
 * chunk runs, never inside it. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvasir/quant.h"
#include "model/model_internal.h"
#include "quant/vec.h"


static size_t kv_max3(size_t a, size_t b, size_t c) {
    size_t m = a > b ? a : b;
    return m > c ? m : c;
}

/* Layers with an attention cache: every block but the recurrent ones. */
static bool kv_layer_attends(const kv_model *m, uint32_t il) {
    if (!kv_model_in_window(m, il)) return false; /* another node's block: no cache here */
    return !(m->hp.hook_flags & KV_AH_RECURRENT) || !m->layers[il].recurrent;
}

/* The architecture's part of the run state (kv_arch_table.state): each
 * operation, or nothing when the table has none. */
static const kv_arch_state_ops *kv_sops(const kv_state *s) { return kv_arch_get(s->m->hp.arch)->state; }
static int kv_arch_seq_alloc(kv_state *s, uint32_t seq, kv_diag *d) {
    const kv_arch_state_ops *o = kv_sops(s);
    return o && o->seq_alloc ? o->seq_alloc(s, seq, d) : 0;
}
static uint64_t kv_arch_rec_bytes(const kv_state *s) {
    const kv_arch_state_ops *o = kv_sops(s);
    return o && o->rec_bytes ? o->rec_bytes(s) : 0;
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
    if (o.max_tokens > 65536) return kv_fail(d, KV_EINVAL, "state: %u tokens per step exceed max 65536", o.max_tokens);
    if (o.kv_type != KV_TYPE_F32 && o.kv_type != KV_TYPE_F16)
        return kv_fail(d, KV_EINVAL, "state: KV cache type %u is not f32 or f16", o.kv_type);
    kv_state *s = calloc(1, sizeof *s);
    if (!s) return kv_fail(d, KV_ENOMEM, "state: out of memory");
    s->m = m;
    s->pool = pool;
    s->n_ctx = o.n_ctx;
    s->n_batch = o.n_batch;
    s->n_seq = o.n_seq;
    s->max_tok = o.n_batch > o.n_seq ? o.n_batch : o.n_seq;
    if (o.max_tokens > s->max_tok) s->max_tok = o.max_tokens;
    s->kv_type = o.kv_type;
    const size_t B = s->max_tok, E = hp->n_embd, QD = (size_t)hp->n_head * hp->head_dim,
                 KVD = (size_t)hp->n_head_kv * hp->head_dim, K = hp->n_expert_used;
    const size_t NT = (size_t)kv_pool_size(pool);
    /* the block pool: a cap (never more than every sequence's full context) */
    s->attn_of = malloc(hp->n_layer * sizeof *s->attn_of);
    if (!s->attn_of) {
        kv_state_free(s);
        return kv_fail(d, KV_ENOMEM, "state: out of memory");
    }
    for (uint32_t il = 0; il < hp->n_layer; il++)
        s->attn_of[il] = kv_layer_attends(m, il) ? (int32_t)s->n_attn++ : -1;
    s->kv_row = KVD * (o.kv_type == KV_TYPE_F16 ? 2 : 4);
    /* MLA caches one row per token (the latent and the rope part: its
     * values are the latent's first kv_lora_rank elements); others K and V */
    s->kv_planes = hp->attn == KV_ATTN_MLA ? 1 : 2;
    s->blk_bytes = s->kv_planes * (size_t)s->n_attn * KV_BLOCK * s->kv_row;
    const uint64_t full = (uint64_t)o.n_seq * ((o.n_ctx + KV_BLOCK - 1) / KV_BLOCK);
    uint64_t cap = full;
    if (o.kv_bytes_max && s->blk_bytes) {
        const uint64_t c = o.kv_bytes_max / s->blk_bytes;
        if (c < cap) cap = c;
    }
    if (s->blk_bytes && cap * s->blk_bytes > ((uint64_t)1 << 40)) {
        kv_state_free(s);
        return kv_fail(d, KV_EINVAL, "context: KV cache for %u sequences of %u tokens is too large; cap it", o.n_seq, o.n_ctx);
    }
    s->blk_max = s->n_attn ? (uint32_t)cap : 0;
    s->arena = calloc((s->blk_max + KV_ARENA - 1) / KV_ARENA + 1, sizeof *s->arena);
    s->seq_blk = calloc(o.n_seq, sizeof *s->seq_blk);
    s->seq_nblk = calloc(o.n_seq, sizeof *s->seq_nblk);
    s->seq_cap = calloc(o.n_seq, sizeof *s->seq_cap);
    s->kv_wide = malloc(NT * 2 * KV_BLOCK * hp->head_dim * sizeof(float));
    s->bad = calloc(B, 1);
    s->tainted = calloc(o.n_seq, 1);
    s->x = malloc(B * E * sizeof(float));
    s->xb = malloc(B * E * sizeof(float));
    s->q = malloc(B * QD * sizeof(float));
    s->k = malloc(B * KVD * sizeof(float));
    s->v = malloc(B * KVD * sizeof(float));
    s->att = malloc(B * QD * sizeof(float));
    s->tmp = malloc(B * E * sizeof(float));
    s->router = malloc(B * hp->n_expert * sizeof(float));
    s->route_sel = malloc(hp->n_expert * sizeof(float));
    s->ids = malloc(B * K * sizeof(int32_t));
    s->wts = malloc(B * K * sizeof(float));
    s->eo = malloc(B * K * E * sizeof(float));
    /* attention units: the query heads of one KV head (and up to 64 query
     * rows of consecutive tokens) share each K/V block load; the score rows
     * of a unit are bounded to 16 MiB per thread */
    const uint32_t gqa = hp->n_head_kv ? hp->n_head / hp->n_head_kv : 1;
    s->att_heads = gqa;
    s->att_tok = gqa < 64 ? 64 / gqa : 1;
    while (s->att_tok > 1 && (uint64_t)s->att_tok * s->att_heads * o.n_ctx * 4 > ((uint64_t)16 << 20)) s->att_tok /= 2;
    while (s->att_heads > 1 && s->att_heads % 2 == 0 && (uint64_t)s->att_heads * o.n_ctx * 4 > ((uint64_t)16 << 20))
        s->att_heads /= 2;
    const size_t AQ = (size_t)s->att_tok * s->att_heads;
    s->scores = malloc(NT * AQ * o.n_ctx * sizeof(float));
    s->att_qbuf = malloc(NT * AQ * hp->head_dim * sizeof(float));
    s->att_grp = malloc((B + 1) * sizeof *s->att_grp);
    s->pos = calloc(o.n_seq, sizeof *s->pos);
    s->tok_seq = malloc(B * sizeof *s->tok_seq);
    s->tok_pos = malloc(B * sizeof *s->tok_pos);
    s->hout = malloc(B * E * sizeof(float));
    s->out_all = malloc(B * sizeof *s->out_all);
    s->keep = malloc(B * sizeof *s->keep);
    s->keep_row = malloc(B * sizeof *s->keep_row);
    s->full_seq = malloc(B * sizeof *s->full_seq);
    s->full_pos = malloc(B * sizeof *s->full_pos);
    s->full_bad = malloc(B);
    s->scratch = malloc(kv_matmul_scratch((int64_t)kv_max3(E, QD, hp->n_ff_exp), (int64_t)B));
    if (!s->bad || !s->tainted || !s->arena || !s->seq_blk || !s->seq_nblk || !s->seq_cap || !s->kv_wide || !s->x || !s->xb || !s->q ||
        !s->k || !s->v || !s->att || !s->tmp || !s->router || !s->route_sel || !s->ids || !s->wts || !s->eo || !s->scores || !s->att_qbuf || !s->att_grp ||
        !s->scratch || !s->pos || !s->tok_seq || !s->tok_pos || !s->hout || !s->out_all ||
        !s->keep || !s->keep_row || !s->full_seq || !s->full_pos || !s->full_bad) {
        kv_state_free(s);
        return kv_fail(d, KV_ENOMEM, "state: out of memory (context %u, batch %u)", o.n_ctx, o.n_batch);
    }
    for (size_t i = 0; i < B; i++) s->out_all[i] = (uint32_t)i;
    const kv_arch_state_ops *so = kv_arch_get(hp->arch)->state;
    if (so && so->state_new) {
        int rc = so->state_new(s, d);
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
    const kv_arch_state_ops *so = kv_sops(s);
    if (so && so->state_free) so->state_free(s);
    if (s->arena)
        for (uint32_t a = 0; a < (s->blk_n + KV_ARENA - 1) / KV_ARENA; a++) free(s->arena[a]);
    free(s->arena);
    if (s->seq_blk)
        for (uint32_t i = 0; i < s->n_seq; i++) free(s->seq_blk[i]);
    free(s->seq_blk);
    free(s->seq_nblk);
    free(s->seq_cap);
    free(s->blk_free);
    free(s->attn_of);
    free(s->kv_wide);
    free(s->bad);
    free(s->tainted);
    free(s->x);
    free(s->xb);
    free(s->q);
    free(s->k);
    free(s->v);
    free(s->att);
    free(s->tmp);
    free(s->router);
    free(s->route_sel);
    free(s->ids);
    free(s->wts);
    free(s->eo);
    free(s->scores);
    free(s->att_qbuf);
    free(s->att_grp);
    free(s->scratch);
    free(s->pos);
    free(s->tok_seq);
    free(s->tok_pos);
    free(s->hout);
    free(s->out_all);
    free(s->keep);
    free(s->keep_row);
    free(s->full_seq);
    free(s->full_pos);
    free(s->full_bad);
    free(s);
}

uint32_t kv_state_n_ctx(const kv_state *s) { return s->n_ctx; }

uint64_t kv_prof_clock(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static const char *const kv_prof_names[KV_PROF_COUNT] = {
    "embed", "norm", "attn_proj", "attention", "delta_proj", "delta_rule", "router", "experts", "shared_expert", "head"};

const char *kv_profile_stage_name(int stage) {
    return stage >= 0 && stage < KV_PROF_COUNT ? kv_prof_names[stage] : NULL;
}

void kv_state_set_profile(kv_state *s, kv_profile *p) { s->prof = p; }
uint32_t kv_state_n_seq(const kv_state *s) { return s->n_seq; }
uint32_t kv_state_max_tokens(const kv_state *s) { return s->max_tok; }
uint32_t kv_state_pos(const kv_state *s) { return s->pos[0]; }
bool kv_state_dropped_rows(const kv_state *s) { return s->x_kept; }
void kv_state_set_all_rows(kv_state *s, bool on) { s->all_rows = on; }
bool kv_state_seq_finite(const kv_state *s, uint32_t seq) { return seq < s->n_seq && !s->tainted[seq]; }

void kv_check_rows(kv_state *s, const float *x, size_t stride, uint32_t T, int64_t n) {
    for (uint32_t t = 0; t < T; t++) {
        const float *r = x + (size_t)t * stride;
        float acc = 0.0f; /* x * 0 is NaN exactly for NaN and +-Inf */
        for (int64_t i = 0; i < n; i++) acc += r[i] * 0.0f;
        if (acc != acc) s->bad[t] = 1;
    }
}
uint32_t kv_trim_rows(kv_state *s, uint32_t T, bool with_tmp) {
    const size_t E = s->m->hp.n_embd;
    memcpy(s->full_seq, s->tok_seq, T * sizeof *s->tok_seq);
    memcpy(s->full_pos, s->tok_pos, T * sizeof *s->tok_pos);
    memcpy(s->full_bad, s->bad, T);
    for (uint32_t i = 0; i < s->n_keep; i++) { /* keep[i] >= i: front to back, in place */
        const uint32_t t = s->keep[i];
        s->tok_seq[i] = s->full_seq[t];
        s->tok_pos[i] = s->full_pos[t];
        s->bad[i] = s->full_bad[t];
        if (t == i) continue;
        memcpy(s->x + i * E, s->x + t * E, E * sizeof(float));
        memcpy(s->xb + i * E, s->xb + t * E, E * sizeof(float));
        if (with_tmp) memcpy(s->tmp + i * E, s->tmp + t * E, E * sizeof(float));
    }
    s->trim_T = T;
    s->x_kept = true;
    return s->n_keep;
}

void kv_trim_restore(kv_state *s) {
    if (!s->trim_T) return;
    for (uint32_t i = 0; i < s->n_keep; i++) s->full_bad[s->keep[i]] |= s->bad[i];
    memcpy(s->tok_seq, s->full_seq, s->trim_T * sizeof *s->tok_seq);
    memcpy(s->tok_pos, s->full_pos, s->trim_T * sizeof *s->tok_pos);
    memcpy(s->bad, s->full_bad, s->trim_T);
    s->trim_T = 0;
}

uint32_t kv_state_pos_seq(const kv_state *s, uint32_t seq) { return seq < s->n_seq ? s->pos[seq] : 0; }

void kv_state_reset_seq(kv_state *s, uint32_t seq) {
    if (seq >= s->n_seq) return;
    s->pos[seq] = 0;
    s->tainted[seq] = 0;
    /* its blocks go back to the pool (most recent on top), its recurrent state is freed */
    for (uint32_t i = s->seq_nblk[seq]; i-- > 0;) s->blk_free[s->n_free++] = s->seq_blk[seq][i];
    s->seq_nblk[seq] = 0;
    const kv_arch_state_ops *so = kv_sops(s);
    if (so && so->seq_free) so->seq_free(s, seq);
}

void kv_state_reset(kv_state *s) {
    for (uint32_t i = 0; i < s->n_seq; i++) kv_state_reset_seq(s, i);
}

/* One more arena of KV_ARENA blocks (fewer for the last one below the cap)
 * onto the free stack. */
static int kv_pool_grow(kv_state *s, kv_diag *d) {
    const uint32_t a = s->blk_n / KV_ARENA;
    const uint32_t n = s->blk_max - s->blk_n < KV_ARENA ? s->blk_max - s->blk_n : KV_ARENA;
    KV_ASSERT(n > 0 && s->blk_n % KV_ARENA == 0);
    uint32_t *nf = realloc(s->blk_free, ((size_t)s->blk_n + n) * sizeof *nf);
    if (!nf) return kv_fail(d, KV_ENOMEM, "KV cache: out of memory growing the block pool past %u blocks", s->blk_n);
    s->blk_free = nf;
    if (!(s->arena[a] = malloc(n * s->blk_bytes)))
        return kv_fail(d, KV_ENOMEM, "KV cache: out of memory growing the block pool past %u blocks", s->blk_n);
    /* pushed so that the lowest id is taken first */
    for (uint32_t i = n; i-- > 0;) s->blk_free[s->n_free++] = s->blk_n + i;
    s->blk_n += n;
    return 0;
}

int kv_state_reserve(kv_state *s, uint32_t seq, uint32_t n_tok, kv_diag *d) {
    if (seq >= s->n_seq) return kv_fail(d, KV_ERANGE, "reserve: sequence %u out of range (%u)", seq, s->n_seq);
    if (n_tok > s->n_ctx)
        return kv_fail(d, KV_ECTXFULL, "context full: sequence %u needs %u tokens of a context of %u", seq, n_tok, s->n_ctx);
    int rc = kv_arch_seq_alloc(s, seq, d);
    if (rc) return rc;
    if (!s->n_attn) return 0;
    const uint32_t need = (n_tok + KV_BLOCK - 1) / KV_BLOCK;
    if (need <= s->seq_nblk[seq]) return 0;
    const uint32_t more = need - s->seq_nblk[seq];
    const uint64_t avail = (uint64_t)s->n_free + (s->blk_max > s->blk_n ? s->blk_max - s->blk_n : 0);
    if (more > avail)
        return kv_fail(d, KV_ENOMEM, "KV cache full: sequence %u needs %u more blocks of %u tokens, %llu free of %u",
                       seq, more, KV_BLOCK, (unsigned long long)avail, s->blk_max);
    if (need > s->seq_cap[seq]) {
        uint32_t cap = s->seq_cap[seq] ? s->seq_cap[seq] : 8;
        while (cap < need) cap *= 2;
        uint32_t *nt = realloc(s->seq_blk[seq], (size_t)cap * sizeof *nt);
        if (!nt) return kv_fail(d, KV_ENOMEM, "KV cache: out of memory for the block table of sequence %u", seq);
        s->seq_blk[seq] = nt;
        s->seq_cap[seq] = cap;
    }
    while (s->seq_nblk[seq] < need) {
        if (!s->n_free && (rc = kv_pool_grow(s, d))) return rc;
        s->seq_blk[seq][s->seq_nblk[seq]++] = s->blk_free[--s->n_free];
    }
    return 0;
}

void kv_state_get_mem(const kv_state *s, kv_state_mem *out) {
    uint32_t held = 0;
    for (uint32_t i = 0; i < s->n_seq; i++) held += s->seq_nblk[i];
    out->block_tokens = KV_BLOCK;
    out->block_bytes = s->blk_bytes;
    out->blocks_held = held;
    out->blocks_allocated = s->blk_n;
    out->blocks_max = s->blk_max;
    out->kv_bytes = (uint64_t)s->blk_n * s->blk_bytes;
    const kv_arch_state_ops *so = kv_sops(s);
    out->recurrent_bytes = so && so->bytes ? so->bytes(s) : 0;
    out->n_attn_layers = s->n_attn;
    out->kv_type = s->kv_type;
}

/* Start of the K (v = 0) or V (v = 1) row of position p of sequence seq in
 * attending layer ai. The block must be reserved. V is stored by position
 * ([p % KV_BLOCK][n_head_kv * head_dim]); K by dimension within its block
 * ([n_head_kv * head_dim][KV_BLOCK], see kv_cache_put): the K region of a
 * block is kv_cache_at(.., 0, p - p % KV_BLOCK) and has the same size. */
static uint8_t *kv_cache_at(const kv_state *s, uint32_t seq, uint32_t ai, int v, uint32_t p) {
    const uint32_t b = s->seq_blk[seq][p / KV_BLOCK];
    uint8_t *blk = s->arena[b / KV_ARENA] + (size_t)(b % KV_ARENA) * s->blk_bytes;
    return blk + (((size_t)v * s->n_attn + ai) * KV_BLOCK + p % KV_BLOCK) * s->kv_row;
}

uint8_t *kv_cache_row(const kv_state *s, uint32_t seq, uint32_t ai, uint32_t p) { return kv_cache_at(s, seq, ai, 0, p); }

void kv_cache_put(kv_state *s, uint32_t il, uint32_t T) {
    const kv_hparams *hp = &s->m->hp;
    const int64_t KVD = (int64_t)hp->n_head_kv * hp->head_dim;
    const uint32_t ai = (uint32_t)s->attn_of[il];
    KV_ASSERT(s->attn_of[il] >= 0);
    const kv_type_info *f16 = s->kv_type == KV_TYPE_F16 ? kv_type_get(KV_TYPE_F16) : NULL;
    for (uint32_t t = 0; t < T; t++) {
        uint8_t *kd = kv_cache_at(s, s->tok_seq[t], ai, 0, s->tok_pos[t]);
        uint8_t *vd = kv_cache_at(s, s->tok_seq[t], ai, 1, s->tok_pos[t]);
        const float *ks = s->k + (size_t)t * KVD, *vs = s->v + (size_t)t * KVD;
        /* K transposed within the block: element c of position p at
         * [c][p % KV_BLOCK], so the scores of a block's keys are one
         * weighted sum over the dimensions (kv_attn_unit) */
        const uint32_t j = s->tok_pos[t] % KV_BLOCK;
        uint8_t *kb = kd - (size_t)j * s->kv_row;
        if (f16) {
            for (int64_t c = 0; c < KVD; c++) f16->from_float(ks + c, kb + ((size_t)c * KV_BLOCK + j) * 2, 1);
            f16->from_float(vs, vd, KVD);
        } else {
            float *kf = (float *)(void *)kb;
            for (int64_t c = 0; c < KVD; c++) kf[(size_t)c * KV_BLOCK + j] = ks[c];
            memcpy(vd, vs, (size_t)KVD * sizeof(float));
        }
    }
}

/* ---- per-token work ------------------------------------------------------ */

/* Fewer tokens than this run on the calling thread (a pool wake-up costs
 * more than their norms). */
#define KV_TOK_POOL_MIN 8

typedef struct kv_tok_job {
    kv_state *s;
    kv_tok_fn fn;
    const void *ctx;
    uint32_t T;
} kv_tok_job;

static void kv_tok_worker(void *arg, int ith, int nth) {
    const kv_tok_job *j = arg;
    long lo, hi;
    kv_pool_split((long)j->T, ith, nth, &lo, &hi);
    for (long t = lo; t < hi; t++) j->fn(j->s, j->ctx, (uint32_t)t);
}

void kv_per_token(kv_state *s, uint32_t T, kv_tok_fn fn, const void *ctx) {
    if (T < KV_TOK_POOL_MIN || kv_pool_size(s->pool) < 2) {
        for (uint32_t t = 0; t < T; t++) fn(s, ctx, t);
        return;
    }
    kv_tok_job j = {s, fn, ctx, T};
    kv_pool_run(s->pool, kv_tok_worker, &j);
}

typedef struct kv_resid_norm_ctx {
    const float *w;
    int add;
} kv_resid_norm_ctx;

static void kv_resid_norm_tok(kv_state *s, const void *ctx, uint32_t t) {
    const kv_resid_norm_ctx *c = ctx;
    const int64_t E = s->m->hp.n_embd;
    float *x = s->x + (size_t)t * (size_t)E;
    if (c->add) {
        const float *r = s->tmp + (size_t)t * (size_t)E;
        for (int64_t i = 0; i < E; i++) x[i] = r[i] + x[i];
    }
    if (c->w) kv_rmsnorm(s->xb + (size_t)t * (size_t)E, x, c->w, E, s->m->hp.rms_eps);
}

void kv_resid_norm(kv_state *s, uint32_t T, int add, const float *w) {
    const kv_resid_norm_ctx c = {w, add};
    kv_per_token(s, T, kv_resid_norm_tok, &c);
}

/* ---- attention ---------------------------------------------------------- */

typedef struct kv_attn_job {
    kv_state *s;
    uint32_t il, n_grp;
} kv_attn_job;

/* For KV head kvh of sequence seq, the block starting at p0 (a multiple
 * of KV_BLOCK) holding n positions: V (v = 1) as n F32 rows of head_dim at
 * *stride floats apart, or K (v = 0) as head_dim F32 rows of KV_BLOCK (one
 * per dimension, *stride = KV_BLOCK); the cache itself (F32) or widened
 * (exactly) into buf (F16). */
static const float *kv_attn_rows(const kv_state *s, uint32_t seq, uint32_t ai, int v, int64_t p0, int64_t n,
                                 int64_t kvh, float *buf, size_t *stride) {
    const kv_hparams *hp = &s->m->hp;
    const int64_t HD = hp->head_dim;
    const size_t esz = s->kv_type == KV_TYPE_F16 ? 2 : 4;
    if (!v) {
        const uint8_t *b = kv_cache_at(s, seq, ai, 0, (uint32_t)p0) + (size_t)kvh * (size_t)HD * KV_BLOCK * esz;
        *stride = KV_BLOCK;
        if (s->kv_type != KV_TYPE_F16) return (const float *)(const void *)b;
        kv_type_get(KV_TYPE_F16)->to_float(b, buf, HD * KV_BLOCK);
        return buf;
    }
    const uint8_t *b = kv_cache_at(s, seq, ai, v, (uint32_t)p0) + (size_t)kvh * (size_t)HD * esz;
    if (s->kv_type != KV_TYPE_F16) {
        *stride = (size_t)hp->n_head_kv * (size_t)HD;
        return (const float *)(const void *)b;
    }
    const kv_type_info *ti = kv_type_get(KV_TYPE_F16);
    for (int64_t r = 0; r < n; r++) ti->to_float(b + (size_t)r * s->kv_row, buf + r * HD, HD);
    *stride = (size_t)HD;
    return buf;
}

/* One unit: the att_heads query heads h0.. (sharing KV head kvh) of the
 * group's tokens (consecutive positions of one sequence). Per query the
 * same arithmetic as one (token, head) alone: scores block by block, each
 * score one fma chain over the dimensions in increasing order (the block's
 * K is stored by dimension, so a block's scores are a weighted sum of its
 * dimension rows with the query as the weights: kv_f32_wsum_rows_multi,
 * vectorized across keys, no horizontal sums), then the rounded multiply
 * by the scale; softmax over the
 * token's own keys 0..pos; the weighted sum of V rows continued block to
 * block in increasing position (kv_f32_wsum_rows_multi: each output
 * element's fma chain is that query's alone). So the bits do not depend on
 * how tokens and heads are grouped, nor on threads. */
/* Softmax of x[lo, n) * scale with a sink logit (-INFINITY: none) in the
 * denominator, as ggml's soft_max with sinks: m = max(max x * scale, sink),
 * e = expf(x * scale - m), sum (double, increasing i) plus expf(sink - m);
 * x[0, lo) (keys outside a sliding window) get 0. */
static void kv_softmax_sink(float *x, int64_t lo, int64_t n, float scale, float sink) {
    float m = sink;
    for (int64_t i = lo; i < n; i++) {
        x[i] = x[i] * scale;
        if (x[i] > m) m = x[i];
    }
    double sum = sink > -INFINITY ? (double)expf(sink - m) : 0.0;
    for (int64_t i = lo; i < n; i++) {
        x[i] = expf(x[i] - m);
        sum += (double)x[i];
    }
    const float inv = (float)(1.0 / sum);
    for (int64_t i = 0; i < lo; i++) x[i] = 0.0f;
    for (int64_t i = lo; i < n; i++) x[i] = x[i] * inv;
}

/* sinks: the layer's per-query-head sink logits (NULL: none); n_swa: the
 * sliding window (0: full causal attention). */
static void kv_attn_unit(kv_state *s, uint32_t ai, uint32_t t0, uint32_t nt, int64_t kvh, int64_t h0, int ith,
                         const float *sinks, uint32_t n_swa) {
    const kv_hparams *hp = &s->m->hp;
    const int64_t HD = hp->head_dim, H = hp->n_head, NH = s->att_heads;
    const float scale = 1.0f / sqrtf((float)HD);
    const size_t SCS = s->n_ctx, AQ = (size_t)s->att_tok * s->att_heads;
    float *sc = s->scores + (size_t)ith * AQ * SCS;
    float *qb = s->att_qbuf + (size_t)ith * AQ * (size_t)HD;
    float *wide = s->kv_wide + (size_t)ith * 2 * KV_BLOCK * (size_t)HD;
    const uint32_t seq = s->tok_seq[t0];
    const int64_t pos0 = s->tok_pos[t0], maxkv = (int64_t)s->tok_pos[t0 + nt - 1] + 1;
    /* a sliding window: the blocks before the first token's window hold no
     * key any token of the unit reads (their weights would be exactly 0, and
     * o + 0 * v is o for the finite values of the cache), so they are skipped */
    const int64_t plo = n_swa && pos0 + 1 > (int64_t)n_swa ? (pos0 + 1 - (int64_t)n_swa) / KV_BLOCK * KV_BLOCK : 0;
    for (uint32_t u = 0; u < nt; u++)
        memcpy(qb + (size_t)u * NH * HD, s->q + (size_t)(t0 + u) * (size_t)(H * HD) + (size_t)h0 * (size_t)HD,
               (size_t)(NH * HD) * sizeof(float));
    /* scores: token u attends keys 0..pos0+u; the unit's keys past that (up
     * to maxkv, all written) are computed with the others and never read */
    for (int64_t p0 = plo; p0 < maxkv; p0 += KV_BLOCK) {
        const int64_t n = maxkv - p0 < KV_BLOCK ? maxkv - p0 : KV_BLOCK;
        const uint32_t ulo = p0 > pos0 ? (uint32_t)(p0 - pos0) : 0; /* tokens with a key in this block */
        size_t ks;
        const float *K = kv_attn_rows(s, seq, ai, 0, p0, n, kvh, wide, &ks);
        kv_f32_wsum_rows_multi(sc + (size_t)ulo * NH * SCS + p0, SCS, qb + (size_t)ulo * NH * HD, (size_t)HD,
                               (int64_t)(nt - ulo) * NH, K, ks, HD, n, 0);
    }
    for (uint32_t u = 0; u < nt; u++) {
        const int64_t n_kv = pos0 + u + 1;
        const int64_t lo = n_swa && n_kv > (int64_t)n_swa ? n_kv - (int64_t)n_swa : 0;
        for (int64_t j = 0; j < NH; j++) {
            float *row = sc + ((size_t)u * NH + (size_t)j) * SCS;
            if (sinks || lo)
                kv_softmax_sink(row, lo, n_kv, scale, sinks ? sinks[h0 + j] : -INFINITY);
            else
                kv_f32_softmax(row, n_kv, scale);
        }
    }
    for (int64_t p0 = plo; p0 < maxkv; p0 += KV_BLOCK) {
        const int64_t n = maxkv - p0 < KV_BLOCK ? maxkv - p0 : KV_BLOCK;
        size_t vs;
        const float *V = kv_attn_rows(s, seq, ai, 1, p0, n, kvh, wide + KV_BLOCK * HD, &vs);
        for (uint32_t u = 0; u < nt; u++) {
            const int64_t n_kv = pos0 + u + 1;
            if (n_kv <= p0) continue;
            const int64_t m = n_kv - p0 < n ? n_kv - p0 : n;
            float *o = s->att + (size_t)(t0 + u) * (size_t)(H * HD) + (size_t)h0 * (size_t)HD;
            kv_f32_wsum_rows_multi(o, (size_t)HD, sc + (size_t)u * NH * SCS + p0, SCS, NH, V, vs, m, HD, p0 != plo);
        }
    }
}

/* Units (token group, KV head, head slice) dealt round-robin to the
 * threads, so the long-context groups of a chunk's end are shared. */
static void kv_attn_worker(void *arg, int ith, int nth) {
    kv_attn_job *j = arg;
    kv_state *s = j->s;
    const kv_hparams *hp = &s->m->hp;
    const int64_t gqa = hp->n_head / hp->n_head_kv, slices = gqa / s->att_heads;
    const uint32_t ai = (uint32_t)s->attn_of[j->il];
    const long n_units = (long)j->n_grp * hp->n_head_kv * slices;
    /* gpt-oss: sinks, and a sliding window in the blocks its pattern names */
    const float *sinks = s->m->layers[j->il].sinks.data;
    const uint32_t n_swa = (hp->hook_flags & KV_AH_SWA) && hp->swa_pattern &&
                                   j->il % hp->swa_pattern < hp->swa_pattern - 1 ? hp->n_swa : 0;
    for (long w = ith; w < n_units; w += nth) {
        const long g = w / (hp->n_head_kv * slices), r = w % (hp->n_head_kv * slices);
        const int64_t kvh = r / slices, h0 = kvh * gqa + (r % slices) * s->att_heads;
        const uint32_t t0 = s->att_grp[g];
        kv_attn_unit(s, ai, t0, s->att_grp[g + 1] - t0, kvh, h0, ith, sinks, n_swa);
    }
}

/* ---- one chunk ------------------------------------------------------------ */

int kv_moe_routed(kv_state *s, const kv_layer *L, uint32_t il, uint32_t T, kv_diag *d) {
    const kv_hparams *hp = &s->m->hp;
    const int64_t E = hp->n_embd, K = hp->n_expert_used, NE = hp->n_expert;
    uint64_t pt = kv_prof_start(s);
    kv_matmul(s->pool, &L->gate_inp, NULL, s->xb, T, s->router, s->scratch);
    for (uint32_t t = 0; t < T; t++) {
        float *p = s->router + (size_t)t * NE;
        if (L->gate_inp_b.data) /* gpt-oss: a bias on the logits */
            for (int64_t e = 0; e < NE; e++) p[e] = p[e] + ((const float *)L->gate_inp_b.data)[e];
        int32_t *ids = s->ids + (size_t)t * K;
        float *w = s->wts + (size_t)t * K;
        kv_route_token(hp, p, L->exp_probs_b.data, s->route_sel, ids, w);
    }
    pt = kv_prof_mark(s, KV_PROF_ROUTER, pt);
    /* routed experts, wherever they are computed */
    kv_expert_req req = {il, T, (uint32_t)E, (uint32_t)K, s->xb, s->ids, s->trim_T ? s->keep : NULL};
    int rc = s->experts->compute(s->experts->impl, &req, s->eo, d);
    if (rc) {
        kv_prof_mark(s, KV_PROF_EXPERTS, pt);
        return kv_diag_prefix(d, rc, "layer %u experts", il);
    }
    /* weighted sum in rank order */
    for (uint32_t t = 0; t < T; t++) {
        float *acc = s->tmp + (size_t)t * E;
        const float *w = s->wts + (size_t)t * K;
        const float *eo = s->eo + (size_t)t * K * E;
        for (int64_t i = 0; i < E; i++) acc[i] = eo[i] * w[0];
        for (int64_t r = 1; r < K; r++)
            for (int64_t i = 0; i < E; i++) acc[i] = acc[i] + eo[(size_t)r * E + i] * w[r];
    }
    kv_prof_mark(s, KV_PROF_EXPERTS, pt);
    return 0;
}

void kv_attn_run(kv_state *s, uint32_t il, uint32_t n_tok) {
    /* token groups: up to att_tok consecutive positions of one sequence */
    uint32_t ng = 0;
    for (uint32_t t = 0; t < n_tok; t++) {
        const uint32_t g0 = ng ? s->att_grp[ng - 1] : 0;
        if (!ng || t - g0 >= s->att_tok || s->tok_seq[t] != s->tok_seq[t - 1] ||
            s->tok_pos[t] != s->tok_pos[t - 1] + 1)
            s->att_grp[ng++] = t;
    }
    s->att_grp[ng] = n_tok;
    kv_attn_job aj = {s, il, ng};
    kv_pool_run(s->pool, kv_attn_worker, &aj);
}

/* Token t's per-head Q/K RMSNorm and RoPE (of layer L, the Q heads, the K
 * heads or both). The angles are computed once for the token, into its own
 * row of s->att (n_rot <= head_dim floats; att is free until this layer's
 * attention writes it). */
static void kv_q3_qk_tok(kv_state *s, const void *ctx, uint32_t t) {
    const kv_qk_ctx *c = ctx;
    const kv_layer *L = c->L;
    const kv_hparams *hp = &s->m->hp;
    const int64_t HD = hp->head_dim, H = hp->n_head, HKV = hp->n_head_kv, QD = H * HD, KVD = HKV * HD;
    float *cs = s->att + (size_t)t * (size_t)QD, *sn = cs + hp->n_rot / 2;
    kv_rope_neox_table(cs, sn, hp->n_rot, (int32_t)s->tok_pos[t], hp->rope_freq_base, hp->rope_freq_scale);
    for (int64_t h = c->q ? 0 : H; h < (c->k ? H + HKV : H); h++) {
        float *xh = h < H ? s->q + (size_t)t * QD + (size_t)h * HD : s->k + (size_t)t * KVD + (size_t)(h - H) * HD;
        kv_rmsnorm(xh, xh, (h < H ? L->q_norm : L->k_norm).data, HD, hp->rms_eps);
        kv_rope_apply(xh, hp->n_rot, cs, sn);
    }
}

/* The qwen3moe blocks over the T embedded tokens in s->x (sequence
 * s->tok_seq[t], position s->tok_pos[t]). */
int kv_q3_blocks(kv_state *s, uint32_t T, kv_diag *d) {
    const kv_model *m = s->m;
    const kv_hparams *hp = &m->hp;
    const int64_t E = hp->n_embd, QD = hp->n_head * hp->head_dim;

    for (uint32_t il = m->il_first; il <= m->il_last; il++) { /* the window: every block unless a ring node */
        const kv_layer *L = &m->layers[il];
        uint64_t pt = kv_prof_start(s);
        /* attention rmsnorm */
        kv_resid_norm(s, T, 0, L->attn_norm.data);
        kv_check_rows(s, s->xb, (size_t)E, T, E);
        pt = kv_prof_mark(s, KV_PROF_NORM, pt);
        /* Q, K, V projections (Q after trimming, in a chunk's last block) */
        const bool trim = kv_trim_here(s, il);
        if (!trim) kv_matmul(s->pool, &L->wq, NULL, s->xb, T, s->q, s->scratch);
        kv_matmul(s->pool, &L->wk, NULL, s->xb, T, s->k, s->scratch);
        kv_matmul(s->pool, &L->wv, NULL, s->xb, T, s->v, s->scratch);
        pt = kv_prof_mark(s, KV_PROF_ATTN_PROJ, pt);
        /* per-head Q/K norm, RoPE, then K and V into the cache */
        kv_per_token(s, T, kv_q3_qk_tok, &(kv_qk_ctx){L, !trim, true});
        pt = kv_prof_mark(s, KV_PROF_NORM, pt);
        kv_cache_put(s, il, T);
        if (trim) { /* every token's K and V are in the cache: the rest only for the kept ones */
            if (!(T = kv_trim_rows(s, T, false))) break;
            pt = kv_prof_mark(s, KV_PROF_NORM, pt);
            kv_matmul(s->pool, &L->wq, NULL, s->xb, T, s->q, s->scratch);
            pt = kv_prof_mark(s, KV_PROF_ATTN_PROJ, pt);
            kv_per_token(s, T, kv_q3_qk_tok, &(kv_qk_ctx){L, true, false});
            pt = kv_prof_mark(s, KV_PROF_NORM, pt);
        }
        /* causal attention */
        kv_attn_run(s, il, T);
        /* output projection + residual */
        kv_check_rows(s, s->att, (size_t)QD, T, QD);
        pt = kv_prof_mark(s, KV_PROF_ATTN, pt);
        kv_matmul(s->pool, &L->wo, NULL, s->att, T, s->tmp, s->scratch);
        pt = kv_prof_mark(s, KV_PROF_ATTN_PROJ, pt);
        /* residual, FFN rmsnorm, routed experts, residual */
        kv_resid_norm(s, T, 1, L->ffn_norm.data);
        kv_check_rows(s, s->xb, (size_t)E, T, E);
        kv_prof_mark(s, KV_PROF_NORM, pt);
        int rc = kv_moe_routed(s, L, il, T, d);
        if (rc) return rc;
        pt = kv_prof_start(s);
        kv_resid_norm(s, T, 1, NULL);
        kv_prof_mark(s, KV_PROF_NORM, pt);
    }
    return 0;
}

/* Runs T tokens (sequence s->tok_seq[t], position s->tok_pos[t]): token
 * embeddings, the architecture's blocks, then the final norm and LM head for
 * the n_out tokens listed in out_idx (in that order). */
static int kv_eval_chunk(kv_state *s, const int32_t *tokens, const float *x_in, uint32_t T,
                         const uint32_t *out_idx, uint32_t n_out, float *logits, float *x_out, kv_diag *d) {
    const kv_model *m = s->m;
    const kv_hparams *hp = &m->hp;
    const int64_t E = hp->n_embd;
    memset(s->bad, 0, T);
    s->n_hout = 0;
    /* rows to keep in the last block: the tokens whose logits are wanted,
     * when nothing else reads the hidden states */
    const uint32_t n_want = logits ? n_out : 0;
    s->x_kept = false;
    s->trim_T = 0;
    s->trim = !s->all_rows && !x_out && m->has_head && n_want < T;
    if (s->trim) {
        for (uint32_t t = 0; t < T; t++) s->keep_row[t] = UINT32_MAX;
        for (uint32_t i = 0; i < n_want; i++) s->keep_row[out_idx[i]] = 0;
        s->n_keep = 0;
        for (uint32_t t = 0; t < T; t++)
            if (s->keep_row[t] == 0) {
                s->keep_row[t] = s->n_keep;
                s->keep[s->n_keep++] = t;
            }
        s->trim = s->n_keep < T;
    }
    if (s->prof) {
        s->prof->chunks++;
        s->prof->tokens += T;
    }
    uint64_t pt = kv_prof_start(s);
    if (x_in) { /* a ring node: the hidden states of the window before */
        memcpy(s->x, x_in, (size_t)T * (size_t)E * sizeof(float));
        kv_check_rows(s, s->x, (size_t)E, T, E);
    } else {
        const kv_type_info *et = kv_type_get(m->tok_embd.type);
        for (uint32_t t = 0; t < T; t++)
            et->to_float((const uint8_t *)m->tok_embd.data + (size_t)tokens[t] * m->tok_embd.row_bytes,
                         s->x + (size_t)t * (size_t)E, E);
    }
    kv_prof_mark(s, KV_PROF_EMBED, pt);
    /* the architecture's own blocks, from its table (src/arch/) */
    int rc = kv_arch_get(hp->arch)->blocks(s, T, d);
    kv_trim_restore(s);
    if (rc) return rc;
    pt = kv_prof_start(s);
    if (x_out) memcpy(x_out, s->x, (size_t)T * (size_t)E * sizeof(float));
    if (logits && n_out) {
        for (uint32_t i = 0; i < n_out; i++) {
            float *h = s->hout + (size_t)i * E;
            const uint32_t row = s->x_kept ? s->keep_row[out_idx[i]] : out_idx[i];
            kv_rmsnorm(h, s->x + (size_t)row * E, m->output_norm.data, E, hp->rms_eps);
            float acc = 0.0f;
            for (int64_t k = 0; k < E; k++) acc += h[k] * 0.0f;
            if (acc != acc) s->bad[out_idx[i]] = 1;
        }
        kv_matmul(s->pool, &m->output, NULL, s->hout, n_out, logits, s->scratch);
    }
    s->n_hout = logits ? n_out : 0;
    kv_prof_mark(s, KV_PROF_HEAD, pt);
    /* the call succeeded: a sequence that met a NaN/Inf stays marked until its reset */
    for (uint32_t t = 0; t < T; t++)
        if (s->bad[t]) s->tainted[s->tok_seq[t]] = 1;
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
    if ((rc = kv_state_reserve(s, seq, s->pos[seq] + n, d))) return rc;
    const uint32_t pos_start = s->pos[seq];
    for (uint32_t done = 0; done < n;) {
        const uint32_t T = n - done < s->n_batch ? n - done : s->n_batch;
        for (uint32_t t = 0; t < T; t++) {
            s->tok_seq[t] = seq;
            s->tok_pos[t] = s->pos[seq] + t;
        }
        const uint32_t last = T - 1;
        rc = kv_eval_chunk(s, tokens + done, NULL, T, &last, 1, done + T == n ? logits : NULL, NULL, d);
        if (rc) {
            s->pos[seq] = pos_start;
            if (done > 0 && (s->m->hp.hook_flags & KV_AH_RECURRENT)) {
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

int kv_state_batch(kv_state *s, const int32_t *tokens, const uint32_t *seqs, uint32_t n,
                   const uint32_t *out_idx, uint32_t n_out, float *logits, kv_diag *d) {
    return kv_state_batch_window(s, tokens, NULL, seqs, n, out_idx, n_out, logits, NULL, d);
}

int kv_state_batch_window(kv_state *s, const int32_t *tokens, const float *x_in, const uint32_t *seqs,
                          uint32_t n, const uint32_t *out_idx, uint32_t n_out, float *logits, float *x_out,
                          kv_diag *d) {
    if (n == 0) return kv_fail(d, KV_EINVAL, "batch: no tokens");
    if (!x_in && !s->m->has_embd)
        return kv_fail(d, KV_EINVAL, "batch: the window starts at block %u: hidden states are needed, not tokens",
                       s->m->il_first);
    if (logits && n_out && !s->m->has_head)
        return kv_fail(d, KV_EINVAL, "batch: the window ends at block %u: it has no LM head", s->m->il_last);
    if (n > s->max_tok) return kv_fail(d, KV_EINVAL, "batch: %u tokens exceed the step size %u", n, s->max_tok);
    if (n_out > n) return kv_fail(d, KV_EINVAL, "batch: %u logit rows wanted of %u tokens", n_out, n);
    for (uint32_t i = 0; i < n_out; i++)
        if (out_idx[i] >= n) return kv_fail(d, KV_ERANGE, "batch: logit row %u out of range (%u tokens)", out_idx[i], n);
    int rc = x_in ? 0 : kv_check_tokens(s, tokens, n, d);
    if (rc) return rc;
    /* positions: each sequence's tokens follow its cache in batch order;
     * s->pos is the committed count until the chunk succeeds */
    for (uint32_t i = 0; i < n; i++) {
        if (seqs[i] >= s->n_seq) return kv_fail(d, KV_ERANGE, "batch: sequence %u out of range (%u)", seqs[i], s->n_seq);
        uint32_t before = 0;
        for (uint32_t k = 0; k < i; k++) before += seqs[k] == seqs[i];
        s->tok_seq[i] = seqs[i];
        s->tok_pos[i] = s->pos[seqs[i]] + before;
        if (s->tok_pos[i] >= s->n_ctx)
            return kv_fail(d, KV_ECTXFULL, "context full: sequence %u holds %u tokens of %u", seqs[i], s->pos[seqs[i]],
                           s->n_ctx);
    }
    for (uint32_t i = 0; i < n; i++)
        if ((rc = kv_state_reserve(s, seqs[i], s->tok_pos[i] + 1, d))) return rc;
    rc = kv_eval_chunk(s, tokens, x_in, n, out_idx, n_out, logits, x_out, d);
    if (rc) return rc;
    for (uint32_t i = 0; i < n; i++) s->pos[seqs[i]]++;
    return 0;
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
    }
    return kv_state_batch(s, tokens, seqs, n, s->out_all, n, logits, d);
}

/* ---- prefix snapshots (the engine's prompt cache) ------------------------- */

/* Block b (a pool block id) of the arena. */
static uint8_t *kv_blk_at(const kv_state *s, uint32_t b) {
    return s->arena[b / KV_ARENA] + (size_t)(b % KV_ARENA) * s->blk_bytes;
}

uint64_t kv_state_kv_bytes(const kv_state *s, uint32_t n) {
    return (uint64_t)(n / KV_BLOCK) * s->blk_bytes;
}

int kv_state_kv_get(const kv_state *s, uint32_t seq, uint32_t p0, uint32_t n, void *dst, kv_diag *d) {
    if (seq >= s->n_seq || p0 % KV_BLOCK || n % KV_BLOCK || (uint64_t)p0 + n > s->pos[seq])
        return kv_fail(d, KV_EINVAL, "KV snapshot: positions [%u, %u) of sequence %u are not whole blocks it holds",
                       p0, p0 + n, seq);
    for (uint32_t i = 0; i < n / KV_BLOCK && s->n_attn; i++)
        memcpy((uint8_t *)dst + (size_t)i * s->blk_bytes, kv_blk_at(s, s->seq_blk[seq][p0 / KV_BLOCK + i]),
               s->blk_bytes);
    return 0;
}

int kv_state_kv_set(kv_state *s, uint32_t seq, uint32_t p0, uint32_t n, const void *src, kv_diag *d) {
    if (seq >= s->n_seq || p0 % KV_BLOCK || n % KV_BLOCK || s->pos[seq] ||
        (s->n_attn && (uint64_t)p0 + n > (uint64_t)s->seq_nblk[seq] * KV_BLOCK))
        return kv_fail(d, KV_EINVAL, "KV restore: positions [%u, %u) of sequence %u are not reserved whole blocks "
                       "of an empty sequence", p0, p0 + n, seq);
    for (uint32_t i = 0; i < n / KV_BLOCK && s->n_attn; i++)
        memcpy(kv_blk_at(s, s->seq_blk[seq][p0 / KV_BLOCK + i]), (const uint8_t *)src + (size_t)i * s->blk_bytes,
               s->blk_bytes);
    return 0;
}

int kv_state_seq_resume(kv_state *s, uint32_t seq, uint32_t pos, const void *rec, kv_diag *d) {
    if (seq >= s->n_seq || s->pos[seq] || pos == 0 || pos % KV_BLOCK || pos > s->n_ctx ||
        (s->n_attn && pos > s->seq_nblk[seq] * KV_BLOCK))
        return kv_fail(d, KV_EINVAL, "KV restore: sequence %u cannot resume at %u (not empty, or not reserved)", seq, pos);
    if (kv_arch_rec_bytes(s) && !rec)
        return kv_fail(d, KV_EINVAL, "KV restore: sequence %u needs a recurrent state to resume at %u", seq, pos);
    const kv_arch_state_ops *so = kv_sops(s);
    int rc = so && so->rec_set ? so->rec_set(s, seq, rec, d) : 0;
    if (rc) return rc;
    s->pos[seq] = pos;
    s->tainted[seq] = 0;
    return 0;
}

uint64_t kv_state_rec_bytes(const kv_state *s) { return kv_arch_rec_bytes(s); }
int kv_state_rec_get(const kv_state *s, uint32_t seq, void *dst, kv_diag *d) {
    const kv_arch_state_ops *so = kv_sops(s);
    return so && so->rec_get ? so->rec_get(s, seq, dst, d) : 0;
}

/* ---- speculative rollback ------------------------------------------------- */

int kv_state_spec_keep(kv_state *s, uint32_t seq, uint32_t n, kv_diag *d) {
    if (seq >= s->n_seq) return kv_fail(d, KV_ERANGE, "spec keep: sequence %u out of range (%u)", seq, s->n_seq);
    if (n > KV_SPEC_MAX_KEEP) return kv_fail(d, KV_EINVAL, "spec keep: %u states exceed max %u", n, KV_SPEC_MAX_KEEP);
    const kv_arch_state_ops *so = kv_sops(s);
    return so && so->spec_keep ? so->spec_keep(s, seq, n, d) : 0;
}

int kv_state_seq_rollback(kv_state *s, uint32_t seq, uint32_t pos, kv_diag *d) {
    if (seq >= s->n_seq) return kv_fail(d, KV_ERANGE, "rollback: sequence %u out of range (%u)", seq, s->n_seq);
    if (pos > s->pos[seq])
        return kv_fail(d, KV_EINVAL, "rollback: sequence %u holds %u positions, not %u", seq, s->pos[seq], pos);
    if (pos == s->pos[seq]) return 0;
    const kv_arch_state_ops *so = kv_sops(s);
    if (so && so->rollback) {
        int rc = so->rollback(s, seq, pos, d);
        if (rc) return rc;
    }
    s->pos[seq] = pos; /* the KV rows past pos are rewritten before any token reads them */
    return 0;
}

const float *kv_state_hidden_out(const kv_state *s, uint32_t i) {
    return i < s->n_hout ? s->hout + (size_t)i * s->m->hp.n_embd : NULL;
}
