/* The qwen35moe model (Qwen3.5 MoE): loading and forward pass, as llama.cpp
 * computes it (src/models/qwen35moe.cpp, delta-net-base.cpp, ggml-cpu ops).
 *
 * Blocks are of two kinds. Every full_attention_interval-th block (il + 1 a
 * multiple of it) is gated full attention: one projection gives per head hd
 * query rows then hd gate rows; Q and K get a per-head RMSNorm and the
 * interleaved multi-section RoPE (IMROPE) on the first n_rot dims, each
 * rotary pair taking the position component of its section (text: t = h =
 * w = position, e = 0, as llama.cpp feeds text tokens); causal softmax
 * attention; the output times sigmoid(gate); output projection. Every other
 * block is a gated delta net (linear attention):
 *   qkv = W_qkv x; z = W_gate x; beta = sigmoid(W_beta x);
 *   g = ssm_a * softplus(W_alpha x + dt_bias)         (ssm_a = -exp(A_log))
 *   c = silu(causal conv1d over [conv state | qkv], kernel d_conv, per channel)
 *   q, k = l2norm per key head of c's first two thirds; v = the rest;
 *   per value head j (key head j % n_k_heads), state S [S_v x S_v]:
 *     S *= exp(g); d = (v - S^T k) * beta; S += k d^T; o = (S^T q) / sqrt(S_v)
 *   (one pass per state row: kv_f32_delta_rows, quant/vec.h, fixed order)
 *   o = rmsnorm(o) * ssm_norm * silu(z) per head; out = W_out o.
 * Each block then adds its residual, applies post_attention_norm, and runs
 * the routed experts (softmax, top-k, renormalized) plus the shared expert
 * scaled by sigmoid(W_shexp_gate x). The MTP block (nextn) is not part of
 * the forward pass; it runs alone as a draft model (kv_mtp_step, at the end).
 *
 * State: next to the KV cache (kept for full-attention blocks only), each
 * sequence (from its first use until it is reset) has per recurrent block a conv state [conv_dim][d_conv-1] and a
 * delta state [n_v_heads][S_v][S_v] (row j of a head = column j of S, as
 * ggml stores it), in two slots: a chunk reads the committed slot and writes
 * the other (the first token's step reads one and writes the other, so no
 * copy), and the slot flips only when the whole chunk succeeded, so a
 * failed chunk (expert provider error) leaves every sequence as it was. A
 * sequence at position 0 starts from zero state whatever the slots hold.
 *
 * Prefill and decode take the same token-by-token recurrence (llama.cpp's
 * CPU backend uses its fused recurrent gated-delta-net op for both); the
 * threads split value heads, never one head's recurrence, so results do not
 * depend on the thread count or on how tokens are chunked. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/quant.h"
#include "model/model_internal.h"
#include "quant/vec.h"

typedef struct kv_q35_state kv_q35_state;

struct kv_q35_state {
    uint32_t n_lin;      /* recurrent blocks */
    int32_t *lin_of;     /* [n_layer] index among recurrent blocks, -1 for attention */
    size_t conv_n;       /* floats of one conv state: conv_dim * (d_conv - 1) */
    size_t ssm_n;        /* floats of one delta state: n_v_heads * S_v * S_v */
    float **rec;         /* [n_seq] recurrent state, NULL until used: [2 slots][n_lin][conv_n]
                            conv states, then [2 slots][n_lin][ssm_n] delta states */
    uint32_t n_rec;      /* sequences holding a recurrent state */
    uint8_t *cur;        /* [n_seq] slot holding the committed state */
    float *qkv;          /* [max_tok][conv_dim] projection (conv input) */
    float *cv;           /* [max_tok][conv_dim] conv + silu; q, k l2-normed */
    float *z;            /* [max_tok][value_dim] output gate */
    float *beta;         /* [max_tok][n_v_heads] */
    float *g;            /* [max_tok][n_v_heads] log decay */
    float *o;            /* [max_tok][value_dim] delta-net output, then gated-normed */
    float *qg;           /* [max_tok][n_head*2*head_dim] joint query + gate */
    float *sh_g, *sh_u;  /* [max_tok][n_ff_shexp] shared expert */
    float *sh_out;       /* [max_tok][n_embd] */
    float *sh_gate;      /* [max_tok] */
    void *scratch;       /* matmul scratch for the widest input */
    /* speculative rollback: states kept after a call's first tokens of a sequence */
    float **snap;        /* [n_seq] NULL or [snap_cap][packed state] (kv_q35_rec_get's layout) */
    uint32_t *snap_cap;  /* [n_seq] states snap[seq] holds room for */
    uint32_t *snap_want; /* [n_seq] states the next call keeps (its first tokens of seq) */
    uint32_t *snap_base; /* [n_seq] position before the call that kept them */
    uint32_t *snap_have; /* [n_seq] states kept by that call: after positions base .. base+have-1 */
};

/* ---- blocks ---------------------------------------------------------------
 * Keys, tensor names and shapes are the table in src/arch/qwen35moe.c, read
 * by the loader (model_load.c). */

static bool kv_q35_recurrent(const kv_hparams *hp, uint32_t il) {
    return il < hp->n_layer && (il + 1) % hp->full_attn_interval != 0;
}

/* Recurrent blocks of the model's window (a ring node keeps state for its own only). */
static bool kv_q35_has_state(const kv_model *m, uint32_t il) {
    return kv_model_in_window(m, il) && kv_q35_recurrent(&m->hp, il);
}

/* ---- state --------------------------------------------------------------- */

static size_t kv_zmax(size_t a, size_t b) { return a > b ? a : b; }

int kv_q35_state_new(kv_state *s, kv_diag *d) {
    const kv_hparams *hp = &s->m->hp;
    kv_q35_state *q = calloc(1, sizeof *q);
    if (!q) return kv_fail(d, KV_ENOMEM, "state: out of memory");
    s->q35 = q;
    const size_t B = s->max_tok, E = hp->n_embd, SV = hp->ssm_d_state, NV = hp->ssm_dt_rank;
    const size_t C = 2 * (size_t)hp->ssm_d_state * hp->ssm_n_group + hp->ssm_d_inner, VD = hp->ssm_d_inner;
    q->lin_of = malloc(hp->n_layer * sizeof *q->lin_of);
    if (!q->lin_of) return kv_fail(d, KV_ENOMEM, "state: out of memory");
    for (uint32_t il = 0; il < hp->n_layer; il++)
        q->lin_of[il] = kv_q35_has_state(s->m, il) ? (int32_t)q->n_lin++ : -1;
    q->conv_n = C * (hp->ssm_d_conv - 1);
    q->ssm_n = NV * SV * SV;
    size_t per_seq = 2 * (size_t)q->n_lin, conv_all, ssm_all;
    if (!kv_mul_ok(per_seq, q->conv_n, &conv_all) || !kv_mul_ok(per_seq, q->ssm_n, &ssm_all) ||
        ssm_all > ((size_t)1 << 36) / sizeof(float))
        return kv_fail(d, KV_EINVAL, "state: recurrent state of one sequence is too large");
    q->rec = calloc(s->n_seq, sizeof *q->rec);
    q->cur = calloc(s->n_seq, 1);
    q->snap = calloc(s->n_seq, sizeof *q->snap);
    q->snap_cap = calloc(s->n_seq, sizeof *q->snap_cap);
    q->snap_want = calloc(s->n_seq, sizeof *q->snap_want);
    q->snap_base = calloc(s->n_seq, sizeof *q->snap_base);
    q->snap_have = calloc(s->n_seq, sizeof *q->snap_have);
    q->qkv = malloc(B * C * sizeof(float));
    q->cv = malloc(B * C * sizeof(float));
    q->z = malloc(B * VD * sizeof(float));
    q->beta = malloc(B * NV * sizeof(float));
    q->g = malloc(B * NV * sizeof(float));
    q->o = malloc(B * VD * sizeof(float));
    q->qg = malloc(B * 2 * (size_t)hp->n_head * hp->head_dim * sizeof(float));
    q->sh_g = malloc(B * hp->n_ff_shexp * sizeof(float));
    q->sh_u = malloc(B * hp->n_ff_shexp * sizeof(float));
    q->sh_out = malloc(B * E * sizeof(float));
    q->sh_gate = malloc(B * sizeof(float));
    size_t kmax = kv_zmax(kv_zmax(E, VD), kv_zmax(hp->n_ff_shexp, (size_t)hp->n_head * hp->head_dim));
    q->scratch = malloc(kv_matmul_scratch((int64_t)kmax, (int64_t)B));
    if (!q->snap || !q->snap_cap || !q->snap_want || !q->snap_base || !q->snap_have)
        return kv_fail(d, KV_ENOMEM, "state: out of memory (recurrent state of %u sequences)", s->n_seq);
    if (!q->rec || !q->cur || !q->qkv || !q->cv || !q->z || !q->beta || !q->g || !q->o ||
        !q->qg || !q->sh_g || !q->sh_u || !q->sh_out || !q->sh_gate || !q->scratch)
        return kv_fail(d, KV_ENOMEM, "state: out of memory (recurrent state of %u sequences)", s->n_seq);
    return 0;
}

void kv_q35_state_free(kv_state *s) {
    kv_q35_state *q = s->q35;
    if (!q) return;
    free(q->lin_of);
    if (q->rec)
        for (uint32_t i = 0; i < s->n_seq; i++) free(q->rec[i]);
    free(q->rec);
    free(q->cur);
    if (q->snap)
        for (uint32_t i = 0; i < s->n_seq; i++) free(q->snap[i]);
    free(q->snap);
    free(q->snap_cap);
    free(q->snap_want);
    free(q->snap_base);
    free(q->snap_have);
    free(q->qkv);
    free(q->cv);
    free(q->z);
    free(q->beta);
    free(q->g);
    free(q->o);
    free(q->qg);
    free(q->sh_g);
    free(q->sh_u);
    free(q->sh_out);
    free(q->sh_gate);
    free(q->scratch);
    free(q);
    s->q35 = NULL;
}

static size_t kv_q35_seq_floats(const kv_q35_state *q) { return 2 * (size_t)q->n_lin * (q->conv_n + q->ssm_n); }

int kv_q35_seq_alloc(kv_state *s, uint32_t seq, kv_diag *d) {
    kv_q35_state *q = s->q35;
    if (!q || q->rec[seq] || !q->n_lin) return 0;
    /* 64-byte aligned (the delta rule's streaming stores need 32), zeroed */
    const size_t bytes = (kv_q35_seq_floats(q) * sizeof(float) + 63) & ~(size_t)63;
    if (!(q->rec[seq] = aligned_alloc(64, bytes)))
        return kv_fail(d, KV_ENOMEM, "state: out of memory for the recurrent state of sequence %u", seq);
    memset(q->rec[seq], 0, bytes);
    q->cur[seq] = 0;
    q->n_rec++;
    return 0;
}

void kv_q35_seq_free(kv_state *s, uint32_t seq) {
    kv_q35_state *q = s->q35;
    if (!q || !q->rec[seq]) return;
    free(q->rec[seq]);
    q->rec[seq] = NULL;
    q->n_rec--;
    free(q->snap[seq]);
    q->snap[seq] = NULL;
    q->snap_cap[seq] = q->snap_want[seq] = q->snap_have[seq] = 0;
}

uint64_t kv_q35_bytes(const kv_state *s) {
    const kv_q35_state *q = s->q35;
    return q ? (uint64_t)q->n_rec * kv_q35_seq_floats(q) * sizeof(float) : 0;
}

static float *kv_q35_conv_at(const kv_state *s, uint32_t seq, uint32_t slot, uint32_t li) {
    const kv_q35_state *q = s->q35;
    return q->rec[seq] + ((size_t)slot * q->n_lin + li) * q->conv_n;
}

static float *kv_q35_ssm_at(const kv_state *s, uint32_t seq, uint32_t slot, uint32_t li) {
    const kv_q35_state *q = s->q35;
    return q->rec[seq] + 2 * (size_t)q->n_lin * q->conv_n + ((size_t)slot * q->n_lin + li) * q->ssm_n;
}

/* Token t is its sequence's first of this call (its state comes from the
 * committed slot, or is zero at position 0). */
static bool kv_q35_first(const kv_state *s, uint32_t t) { return s->tok_pos[t] == s->pos[s->tok_seq[t]]; }

/* Floats of one packed state (kv_q35_rec_get's layout). */
static size_t kv_q35_rec_floats(const kv_q35_state *q) { return (size_t)q->n_lin * (q->conv_n + q->ssm_n); }

/* The kept state after token t, or NULL when t's state is not kept (the
 * token is not among the first snap_want of its sequence in this call). */
static float *kv_q35_snap_of(const kv_state *s, uint32_t t) {
    const kv_q35_state *q = s->q35;
    const uint32_t seq = s->tok_seq[t], j = s->tok_pos[t] - s->pos[seq];
    return j < q->snap_want[seq] ? q->snap[seq] + (size_t)j * kv_q35_rec_floats(q) : NULL;
}

/* ---- ops ------------------------------------------------------------------ */

static float kv_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
static float kv_softplus(float x) { return x > 20.0f ? x : logf(1.0f + expf(x)); }

/* x /= max(||x||, eps), the norm's square summed in double (ggml_l2_norm). */
static void kv_l2norm(float *x, int64_t n, float eps) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
    const float scale = 1.0f / fmaxf(sqrtf((float)sum), eps);
    for (int64_t i = 0; i < n; i++) x[i] *= scale;
}

/* Interleaved multi-section RoPE (ggml_rope_multi, GGML_ROPE_TYPE_IMROPE)
 * on the first n_rot dims of one head (NeoX pairing i, i + n_rot/2). Pair i
 * belongs to sector i % sum(sections); sectors cycle t, h, w (each within
 * 3 * its section count), the rest take e. pos[4] = (t, h, w, e). */
static void kv_rope_imrope_table(float *cs, float *sn, int64_t n_rot, const int32_t pos[4], const int32_t sec[4],
                                 float freq_base, float freq_scale) {
    const float theta_scale = powf(freq_base, -2.0f / (float)n_rot);
    const int sect_dims = sec[0] + sec[1] + sec[2] + sec[3];
    const int64_t half = n_rot / 2;
    float th[4] = {(float)pos[0], (float)pos[1], (float)pos[2], (float)pos[3]};
    for (int64_t i = 0; i < half; i++) {
        const int sector = (int)(i % sect_dims);
        int c = 3; /* e */
        if (sector % 3 == 1 && sector < 3 * sec[1]) c = 1;
        else if (sector % 3 == 2 && sector < 3 * sec[2]) c = 2;
        else if (sector % 3 == 0 && sector < 3 * sec[0]) c = 0;
        const float t = freq_scale * th[c];
        cs[i] = cosf(t);
        sn[i] = sinf(t);
        for (int k = 0; k < 4; k++) th[k] *= theta_scale;
    }
}

/* ---- gated delta net ------------------------------------------------------ */

typedef struct kv_q35_dn_job {
    kv_state *s;
    uint32_t li, T;
    bool stream; /* a sequence's delta states exceed KV_Q35_STREAM_BYTES */
} kv_q35_dn_job;

/* Above this much delta-net state per sequence (all recurrent blocks), a
 * token's new state is written with streaming stores: it cannot stay in
 * any cache until the next token (the 122B shape: 151 MB). */
#define KV_Q35_STREAM_BYTES ((size_t)64 << 20)

/* Value heads split over threads; each head runs its tokens in order. A
 * sequence's first token of the chunk reads the committed slot and writes
 * the other (no copy); later tokens update the written slot in place. */
static void kv_q35_dn_worker(void *arg, int ith, int nth) {
    const kv_q35_dn_job *j = arg;
    kv_state *s = j->s;
    kv_q35_state *q = s->q35;
    const kv_hparams *hp = &s->m->hp;
    const int64_t SV = hp->ssm_d_state, NV = hp->ssm_dt_rank, NK = hp->ssm_n_group;
    const int64_t KD = SV * NK, C = 2 * KD + hp->ssm_d_inner, VD = hp->ssm_d_inner;
    const float scale = 1.0f / sqrtf((float)SV);
    long lo, hi;
    kv_pool_split((long)NV, ith, nth, &lo, &hi);
    for (long h = lo; h < hi; h++) {
        const int64_t kh = h % NK; /* value head h reads key head h mod n_k_heads */
        for (uint32_t t = 0; t < j->T; t++) {
            const uint32_t seq = s->tok_seq[t], rd = q->cur[seq];
            float *M = kv_q35_ssm_at(s, seq, rd ^ 1u, j->li) + (size_t)h * (size_t)(SV * SV);
            const float *src = M;
            if (kv_q35_first(s, t)) {
                if (s->tok_pos[t] == 0)
                    memset(M, 0, (size_t)(SV * SV) * sizeof(float));
                else
                    src = kv_q35_ssm_at(s, seq, rd, j->li) + (size_t)h * (size_t)(SV * SV);
            }
            const float *row = q->cv + (size_t)t * (size_t)C;
            const float *qv = row + kh * SV, *kv = row + KD + kh * SV, *vv = row + 2 * KD + h * SV;
            const float beta = q->beta[(size_t)t * NV + h];
            const float decay = expf(q->g[(size_t)t * NV + h]);
            float *o = q->o + (size_t)t * (size_t)VD + (size_t)h * (size_t)SV;
            /* a state far past the caches, written to the other slot and read again
             * only at the sequence's next token: streamed past the caches */
            if (j->stream && src != M && (t + 1 == j->T || s->tok_seq[t + 1] != seq))
                kv_f32_delta_rows_stream(src, M, SV, SV, kv, qv, vv, decay, beta, scale, o);
            else
                kv_f32_delta_rows(src, M, SV, SV, kv, qv, vv, decay, beta, scale, o);
            float *keep = kv_q35_snap_of(s, t);
            if (keep) /* head h of the delta state after token t */
                memcpy(keep + (size_t)q->n_lin * q->conv_n + (size_t)j->li * q->ssm_n + (size_t)h * (size_t)(SV * SV), M,
                       (size_t)(SV * SV) * sizeof(float));
        }
    }
}

typedef struct kv_q35_cv_job {
    kv_state *s;
    const kv_layer *L;
    uint32_t li, T;
    int phase; /* 0: conv1d + silu + q/k l2 norms; 1: gated RMSNorm of the output */
} kv_q35_cv_job;

/* Phase 0: channels split over threads in whole heads (SV channels), each
 * channel running its tokens in order through its conv state, then the l2
 * norm of each query/key head the thread holds. Phase 1: the (token, value
 * head) pairs split over threads. The same arithmetic per element as one
 * thread, so the same bits. */
static void kv_q35_cv_worker(void *arg, int ith, int nth) {
    const kv_q35_cv_job *j = arg;
    kv_state *s = j->s;
    kv_q35_state *q = s->q35;
    const kv_hparams *hp = &s->m->hp;
    const int64_t SV = hp->ssm_d_state, NV = hp->ssm_dt_rank, NK = hp->ssm_n_group;
    const int64_t KD = SV * NK, VD = hp->ssm_d_inner, C = 2 * KD + VD, KC = hp->ssm_d_conv;
    long lo, hi;
    if (j->phase == 0) {
        const float *w = j->L->ssm_conv1d.data; /* [C][KC] */
        kv_pool_split((long)(C / SV), ith, nth, &lo, &hi);
        const int64_t c0 = (int64_t)lo * SV, c1 = ith == nth - 1 ? C : (int64_t)hi * SV;
        for (uint32_t t = 0; t < j->T; t++) {
            const uint32_t seq = s->tok_seq[t];
            float *st = kv_q35_conv_at(s, seq, q->cur[seq] ^ 1u, j->li);
            const float *x = q->qkv + (size_t)t * C;
            float *y = q->cv + (size_t)t * C;
            for (int64_t c = c0; c < c1; c++) {
                float *sc = st + c * (KC - 1);
                const float *wc = w + c * KC;
                float sum = 0.0f;
                for (int64_t i = 0; i < KC - 1; i++) sum += sc[i] * wc[i];
                sum += x[c] * wc[KC - 1];
                y[c] = sum;
                for (int64_t i = 0; i + 1 < KC - 1; i++) sc[i] = sc[i + 1];
                sc[KC - 2] = x[c];
            }
            float *keep = kv_q35_snap_of(s, t);
            if (keep) /* this thread's channels of the conv state after token t */
                memcpy(keep + (size_t)j->li * q->conv_n + (size_t)c0 * (KC - 1), st + c0 * (KC - 1),
                       (size_t)(c1 - c0) * (size_t)(KC - 1) * sizeof(float));
            kv_f32_silu(y + c0, y + c0, c1 - c0); /* the vectorized documented exp (quant/vec.h) */
            /* l2-normalized query and key heads */
            for (int64_t h = c0 / SV; h < 2 * NK && (h + 1) * SV <= c1; h++) kv_l2norm(y + h * SV, SV, hp->rms_eps);
        }
    } else {
        kv_pool_split((long)j->T * (long)NV, ith, nth, &lo, &hi);
        for (long i = lo; i < hi; i++) {
            const int64_t t = i / NV, h = i % NV;
            float *o = q->o + (size_t)t * VD + (size_t)h * SV;
            const float *z = q->z + (size_t)t * VD + (size_t)h * SV;
            kv_rmsnorm(o, o, j->L->ssm_norm.data, SV, hp->rms_eps);
            float zs[128];
            for (int64_t k0 = 0; k0 < SV; k0 += 128) {
                const int64_t m = SV - k0 < 128 ? SV - k0 : 128;
                kv_f32_silu(zs, z + k0, m);
                for (int64_t k = 0; k < m; k++) o[k0 + k] = o[k0 + k] * zs[k];
            }
        }
    }
}

/* Linear-attention block il (recurrent index li) on s->xb; output in s->tmp. */
static void kv_q35_linear(kv_state *s, const kv_layer *L, uint32_t li, uint32_t T) {
    kv_q35_state *q = s->q35;
    const kv_hparams *hp = &s->m->hp;
    const int64_t NV = hp->ssm_dt_rank;
    const int64_t VD = hp->ssm_d_inner;
    /* projections */
    uint64_t pt = kv_prof_start(s);
    kv_matmul(s->pool, &L->wqkv, NULL, s->xb, T, q->qkv, q->scratch);
    kv_matmul(s->pool, &L->wqkv_gate, NULL, s->xb, T, q->z, q->scratch);
    kv_matmul(s->pool, &L->ssm_beta, NULL, s->xb, T, q->beta, q->scratch);
    kv_matmul(s->pool, &L->ssm_alpha, NULL, s->xb, T, q->g, q->scratch);
    pt = kv_prof_mark(s, KV_PROF_DELTA_PROJ, pt);
    const float *dt = L->ssm_dt.data, *a = L->ssm_a.data;
    for (uint32_t t = 0; t < T; t++)
        for (int64_t h = 0; h < NV; h++) {
            float *bt = q->beta + (size_t)t * NV + h, *gt = q->g + (size_t)t * NV + h;
            *bt = kv_sigmoid(*bt);
            *gt = kv_softplus(*gt + dt[h]) * a[h];
        }
    /* causal conv1d over [state | tokens], then silu (kv_q35_cv_worker); a
     * sequence's first token of the chunk starts the written slot from the
     * committed one (or zeros at position 0) */
    for (uint32_t t = 0; t < T; t++)
        if (kv_q35_first(s, t)) {
            const uint32_t seq = s->tok_seq[t], rd = q->cur[seq];
            float *st = kv_q35_conv_at(s, seq, rd ^ 1u, li);
            if (s->tok_pos[t] == 0)
                memset(st, 0, q->conv_n * sizeof(float));
            else
                memcpy(st, kv_q35_conv_at(s, seq, rd, li), q->conv_n * sizeof(float));
        }
    kv_q35_cv_job cj = {s, L, li, T, 0};
    kv_pool_run(s->pool, kv_q35_cv_worker, &cj);
    /* the delta rule, per value head */
    kv_q35_dn_job job = {s, li, T, (size_t)q->n_lin * q->ssm_n * sizeof(float) > KV_Q35_STREAM_BYTES};
    kv_pool_run(s->pool, kv_q35_dn_worker, &job);
    /* gated RMSNorm per head (kv_q35_cv_worker), output projection */
    cj.phase = 1;
    kv_pool_run(s->pool, kv_q35_cv_worker, &cj);
    kv_check_rows(s, q->o, (size_t)VD, T, VD);
    pt = kv_prof_mark(s, KV_PROF_DELTA, pt);
    kv_matmul(s->pool, &L->ssm_out, NULL, q->o, T, s->tmp, q->scratch);
    kv_prof_mark(s, KV_PROF_DELTA_PROJ, pt);
}

/* Token t's per-head Q/K RMSNorm and imrope (L: its layer; the queries
 * from the interleaved query/gate projection). The angles are computed once
 * for the token, into its own row of s->att (free until the attention writes
 * it; n_rot <= head_dim floats). */
static void kv_q35_qk_tok(kv_state *s, const void *ctx, uint32_t t) {
    const kv_qk_ctx *c = ctx;
    const kv_layer *L = c->L;
    const kv_hparams *hp = &s->m->hp;
    const int64_t HD = hp->head_dim, H = hp->n_head, HKV = hp->n_head_kv, QD = H * HD, KVD = HKV * HD;
    float *cs = s->att + (size_t)t * (size_t)QD, *sn = cs + hp->n_rot / 2;
    const int32_t p = (int32_t)s->tok_pos[t];
    const int32_t pos[4] = {p, p, p, 0}; /* text: t = h = w = position, e = 0 */
    kv_rope_imrope_table(cs, sn, hp->n_rot, pos, hp->rope_sections, hp->rope_freq_base, hp->rope_freq_scale);
    for (int64_t h = 0; h < (c->q ? H : 0); h++) {
        float *qh = s->q + (size_t)t * QD + (size_t)h * HD;
        kv_rmsnorm(qh, s->q35->qg + (size_t)t * 2 * QD + (size_t)h * 2 * HD, L->q_norm.data, HD, hp->rms_eps);
        kv_rope_apply(qh, hp->n_rot, cs, sn);
    }
    for (int64_t h = 0; h < (c->k ? HKV : 0); h++) {
        float *kh = s->k + (size_t)t * KVD + (size_t)h * HD;
        kv_rmsnorm(kh, kh, L->k_norm.data, HD, hp->rms_eps);
        kv_rope_apply(kh, hp->n_rot, cs, sn);
    }
}

/* Token t's attention output times the sigmoid of its gate. */
static void kv_q35_gate_tok(kv_state *s, const void *ctx, uint32_t t) {
    (void)ctx;
    const kv_hparams *hp = &s->m->hp;
    const int64_t HD = hp->head_dim, H = hp->n_head, QD = H * HD;
    for (int64_t h = 0; h < H; h++) {
        float *o = s->att + (size_t)t * QD + (size_t)h * HD;
        const float *gate = s->q35->qg + (size_t)t * 2 * QD + (size_t)h * 2 * HD + HD;
        for (int64_t i = 0; i < HD; i++) o[i] = o[i] * kv_sigmoid(gate[i]);
    }
}

/* Gated full-attention block il on s->xb; output in s->tmp. In the block
 * where the chunk drops rows, every token's K and V go to the cache and the
 * rest is for the kept tokens. Returns the tokens it ran (0: none left). */
static uint32_t kv_q35_attention(kv_state *s, const kv_layer *L, uint32_t il, uint32_t T) {
    kv_q35_state *q = s->q35;
    const kv_hparams *hp = &s->m->hp;
    const int64_t QD = hp->n_head * hp->head_dim;
    const bool trim = kv_trim_here(s, il);
    uint64_t pt = kv_prof_start(s);
    if (!trim) kv_matmul(s->pool, &L->wq, NULL, s->xb, T, q->qg, q->scratch);
    kv_matmul(s->pool, &L->wk, NULL, s->xb, T, s->k, q->scratch);
    kv_matmul(s->pool, &L->wv, NULL, s->xb, T, s->v, q->scratch);
    pt = kv_prof_mark(s, KV_PROF_ATTN_PROJ, pt);
    kv_per_token(s, T, kv_q35_qk_tok, &(kv_qk_ctx){L, !trim, true});
    pt = kv_prof_mark(s, KV_PROF_NORM, pt);
    kv_cache_put(s, il, T);
    if (trim) {
        if (!(T = kv_trim_rows(s, T, false))) return 0;
        pt = kv_prof_mark(s, KV_PROF_NORM, pt);
        kv_matmul(s->pool, &L->wq, NULL, s->xb, T, q->qg, q->scratch);
        pt = kv_prof_mark(s, KV_PROF_ATTN_PROJ, pt);
        kv_per_token(s, T, kv_q35_qk_tok, &(kv_qk_ctx){L, true, false});
        pt = kv_prof_mark(s, KV_PROF_NORM, pt);
    }
    kv_attn_run(s, il, T);
    kv_per_token(s, T, kv_q35_gate_tok, NULL);
    kv_check_rows(s, s->att, (size_t)QD, T, QD);
    pt = kv_prof_mark(s, KV_PROF_ATTN, pt);
    kv_matmul(s->pool, &L->wo, NULL, s->att, T, s->tmp, q->scratch);
    kv_prof_mark(s, KV_PROF_ATTN_PROJ, pt);
    return T;
}

/* Routed experts plus the gated shared expert on s->xb; output in s->tmp. */
static int kv_q35_ffn(kv_state *s, const kv_layer *L, uint32_t il, uint32_t T, kv_diag *d) {
    kv_q35_state *q = s->q35;
    const kv_hparams *hp = &s->m->hp;
    const int64_t E = hp->n_embd, S = hp->n_ff_shexp;
    int rc = kv_moe_routed(s, L, il, T, d);
    if (rc) return rc;
    uint64_t pt = kv_prof_start(s);
    kv_matmul(s->pool, &L->gate_shexp, NULL, s->xb, T, q->sh_g, q->scratch);
    kv_matmul(s->pool, &L->up_shexp, NULL, s->xb, T, q->sh_u, q->scratch);
    kv_swiglu(q->sh_g, q->sh_g, q->sh_u, (int64_t)T * S);
    kv_matmul(s->pool, &L->down_shexp, NULL, q->sh_g, T, q->sh_out, q->scratch);
    kv_matmul(s->pool, &L->gate_inp_shexp, NULL, s->xb, T, q->sh_gate, q->scratch);
    for (uint32_t t = 0; t < T; t++) {
        const float gt = kv_sigmoid(q->sh_gate[t]);
        float *acc = s->tmp + (size_t)t * E;
        const float *sh = q->sh_out + (size_t)t * E;
        for (int64_t i = 0; i < E; i++) acc[i] = acc[i] + sh[i] * gt;
    }
    kv_prof_mark(s, KV_PROF_SHARED, pt);
    return 0;
}

int kv_q35_blocks(kv_state *s, uint32_t T, kv_diag *d) {
    const kv_model *m = s->m;
    const kv_hparams *hp = &m->hp;
    kv_q35_state *q = s->q35;
    const int64_t E = hp->n_embd;
    const uint32_t T_all = T;

    for (uint32_t il = m->il_first; il <= m->il_last; il++) { /* the window: every block unless a ring node */
        const kv_layer *L = &m->layers[il];
        uint64_t pt = kv_prof_start(s);
        kv_resid_norm(s, T, 0, L->attn_norm.data);
        kv_check_rows(s, s->xb, (size_t)E, T, E);
        kv_prof_mark(s, KV_PROF_NORM, pt);
        if (!L->recurrent) {
            if (!(T = kv_q35_attention(s, L, il, T))) break;
        } else {
            kv_q35_linear(s, L, (uint32_t)q->lin_of[il], T); /* every token: the recurrent state */
            if (kv_trim_here(s, il) && !(T = kv_trim_rows(s, T, true))) break;
        }
        pt = kv_prof_start(s);
        /* residual, post-attention norm, MoE with shared expert, residual */
        kv_resid_norm(s, T, 1, L->post_norm.data);
        kv_check_rows(s, s->xb, (size_t)E, T, E);
        kv_prof_mark(s, KV_PROF_NORM, pt);
        int rc = kv_q35_ffn(s, L, il, T, d);
        if (rc) { /* the committed recurrent slots are untouched; nothing was kept */
            kv_trim_restore(s);
            for (uint32_t t = 0; t < T_all; t++) q->snap_want[s->tok_seq[t]] = q->snap_have[s->tok_seq[t]] = 0;
            return rc;
        }
        pt = kv_prof_start(s);
        kv_resid_norm(s, T, 1, NULL);
        kv_prof_mark(s, KV_PROF_NORM, pt);
    }
    /* commit: each sequence of the chunk now reads the slot just written */
    kv_trim_restore(s);
    for (uint32_t t = 0; t < T_all; t++) {
        const uint32_t seq = s->tok_seq[t];
        if (kv_q35_first(s, t)) {
            q->cur[seq] ^= 1u;
            q->snap_base[seq] = s->pos[seq];
            q->snap_have[seq] = 0;
        }
        if (kv_q35_snap_of(s, t)) q->snap_have[seq]++;
    }
    for (uint32_t t = 0; t < T_all; t++) q->snap_want[s->tok_seq[t]] = 0; /* one call's request */
    return 0;
}

/* ---- snapshots (the engine's prompt cache) -------------------------------- */

uint64_t kv_q35_rec_bytes(const kv_state *s) {
    const kv_q35_state *q = s->q35;
    return q && q->n_lin ? (uint64_t)q->n_lin * (q->conv_n + q->ssm_n) * sizeof(float) : 0;
}

/* The committed slot's conv states [n_lin][conv_n], then delta states
 * [n_lin][ssm_n], packed. */
int kv_q35_rec_get(const kv_state *s, uint32_t seq, void *dst, kv_diag *d) {
    const kv_q35_state *q = s->q35;
    if (!kv_q35_rec_bytes(s)) return 0;
    if (seq >= s->n_seq || !q->rec[seq] || !s->pos[seq])
        return kv_fail(d, KV_EINVAL, "recurrent snapshot: sequence %u holds no state", seq);
    float *o = dst;
    const uint32_t c = q->cur[seq];
    for (uint32_t li = 0; li < q->n_lin; li++, o += q->conv_n)
        memcpy(o, kv_q35_conv_at(s, seq, c, li), q->conv_n * sizeof(float));
    for (uint32_t li = 0; li < q->n_lin; li++, o += q->ssm_n)
        memcpy(o, kv_q35_ssm_at(s, seq, c, li), q->ssm_n * sizeof(float));
    return 0;
}

int kv_q35_rec_set(kv_state *s, uint32_t seq, const void *src, kv_diag *d) {
    kv_q35_state *q = s->q35;
    if (!kv_q35_rec_bytes(s)) return 0;
    int rc = kv_q35_seq_alloc(s, seq, d);
    if (rc) return rc;
    const float *i = src;
    const uint32_t c = q->cur[seq];
    for (uint32_t li = 0; li < q->n_lin; li++, i += q->conv_n)
        memcpy(kv_q35_conv_at(s, seq, c, li), i, q->conv_n * sizeof(float));
    for (uint32_t li = 0; li < q->n_lin; li++, i += q->ssm_n)
        memcpy(kv_q35_ssm_at(s, seq, c, li), i, q->ssm_n * sizeof(float));
    return 0;
}

/* ---- speculative rollback ------------------------------------------------- */

int kv_q35_spec_keep(kv_state *s, uint32_t seq, uint32_t n, kv_diag *d) {
    kv_q35_state *q = s->q35;
    if (!q->n_lin) return 0;
    if (n > q->snap_cap[seq]) {
        size_t bytes;
        if (!kv_mul_ok((size_t)n * sizeof(float), kv_q35_rec_floats(q), &bytes))
            return kv_fail(d, KV_EINVAL, "spec keep: %u recurrent states are too large", n);
        float *p = malloc(bytes);
        if (!p) return kv_fail(d, KV_ENOMEM, "spec keep: out of memory for %u recurrent states of sequence %u", n, seq);
        free(q->snap[seq]);
        q->snap[seq] = p;
        q->snap_cap[seq] = n;
        q->snap_have[seq] = 0;
    }
    q->snap_want[seq] = n;
    return 0;
}

int kv_q35_rollback(kv_state *s, uint32_t seq, uint32_t pos, kv_diag *d) {
    kv_q35_state *q = s->q35;
    if (!q->n_lin) return 0;
    const uint32_t base = q->snap_base[seq];
    if (!q->rec[seq] || pos <= base || pos - base > q->snap_have[seq])
        return kv_fail(d, KV_EINVAL, "rollback: sequence %u has no recurrent state kept after position %u (kept: %u "
                       "after %u)", seq, pos - 1, q->snap_have[seq], base);
    int rc = kv_q35_rec_set(s, seq, q->snap[seq] + (size_t)(pos - base - 1) * kv_q35_rec_floats(q), d);
    q->snap_have[seq] = 0; /* the states past pos are gone; those before are not needed */
    return rc;
}

/* ---- the MTP (nextn) block as a draft model ------------------------------- *
 * One position at a time (kv_mtp_step): u = eh_proj [enorm(embed(tok));
 * hnorm(h)], then block n_layer as a gated full-attention block over its
 * own K/V (per sequence, the positions it was run at, up to
 * KV_MTP_MAX_POS), the routed experts and the gated shared expert, then
 * shared_head_norm (output_norm when absent) and the LM head. The same
 * kernels as the trunk's blocks (kv_matmul, kv_rmsnorm, imrope), plain
 * loops for its attention. Buffers allocated once; each sequence's K/V at
 * its first use. */

struct kv_mtp {
    const kv_model *m;
    kv_pool *pool;
    kv_expert_provider prov; /* in-process, from m's own MTP experts (unset when borrowed) */
    const kv_expert_provider *ex; /* who computes the MTP experts: &prov or the caller's */
    uint32_t n_seq;
    float **k, **v;      /* [n_seq] NULL or [KV_MTP_MAX_POS][n_head_kv*head_dim] */
    uint8_t **have;      /* [n_seq] NULL or [KV_MTP_MAX_POS] the position's K/V was written */
    float *e2;           /* [2*n_embd] [enorm(embedding); hnorm(h)] */
    float *x, *xb, *tmp; /* [n_embd] residual, normed, projection output */
    float *qg, *q, *kk, *vv, *att; /* [2*QD], [QD], [KVD], [KVD], [QD] */
    float *router, *wts, *eo; /* [n_expert], [n_used], [n_used][n_embd] */
    int32_t *ids;        /* [n_used] */
    float *sh_g, *sh_u, *sh_out, *sh_gate; /* shared expert [S], [S], [n_embd], [1] */
    float *scores;       /* [KV_MTP_MAX_POS] */
    void *scratch;
};

int kv_mtp_new(kv_mtp **out, const kv_model *m, const kv_expert_provider *experts, kv_pool *pool, uint32_t n_seq,
               kv_diag *d) {
    *out = NULL;
    const kv_hparams *hp = &m->hp;
    if (hp->n_layer_nextn == 0)
        return kv_fail(d, KV_EUNSUPPORTED, "mtp: the model has no MTP (nextn) block");
    if (hp->arch != KV_ARCH_QWEN35MOE)
        return kv_fail(d, KV_EUNSUPPORTED, "mtp: only a qwen35moe MTP block is run, and this model is %s",
                       hp->arch_name);
    if (!m->layers[hp->n_layer].nextn_eh_proj.data)
        return kv_fail(d, KV_EUNSUPPORTED, "mtp: the MTP block (layer %u) is not loaded here", hp->n_layer);
    if (!m->has_embd || !m->has_head)
        return kv_fail(d, KV_EUNSUPPORTED, "mtp: the MTP block needs the token embedding and the LM head, and this "
                       "model holds %s", !m->has_embd && !m->has_head ? "neither" : !m->has_embd ? "no embedding"
                                                                                            : "no head");
    if (!experts && !m->has_experts)
        return kv_fail(d, KV_EUNSUPPORTED, "mtp: the model holds no experts and no provider was given for the MTP "
                       "block's (layer %u)", hp->n_layer);
    kv_mtp *t = calloc(1, sizeof *t);
    if (!t) return kv_fail(d, KV_ENOMEM, "mtp: out of memory");
    t->m = m;
    t->pool = pool;
    t->n_seq = n_seq;
    const size_t E = hp->n_embd, QD = (size_t)hp->n_head * hp->head_dim, KVD = (size_t)hp->n_head_kv * hp->head_dim;
    const size_t S = hp->n_ff_shexp, NE = hp->n_expert, K = hp->n_expert_used;
    t->k = calloc(n_seq, sizeof *t->k);
    t->v = calloc(n_seq, sizeof *t->v);
    t->have = calloc(n_seq, sizeof *t->have);
    t->e2 = malloc(2 * E * sizeof(float));
    t->x = malloc(E * sizeof(float));
    t->xb = malloc(E * sizeof(float));
    t->tmp = malloc(E * sizeof(float));
    t->qg = malloc(2 * QD * sizeof(float));
    t->q = malloc(QD * sizeof(float));
    t->kk = malloc(KVD * sizeof(float));
    t->vv = malloc(KVD * sizeof(float));
    t->att = malloc(QD * sizeof(float));
    t->router = malloc(NE * sizeof(float));
    t->wts = malloc(K * sizeof(float));
    t->eo = malloc(K * E * sizeof(float));
    t->ids = malloc(K * sizeof(int32_t));
    t->sh_g = malloc((S ? S : 1) * sizeof(float));
    t->sh_u = malloc((S ? S : 1) * sizeof(float));
    t->sh_out = malloc(E * sizeof(float));
    t->sh_gate = malloc(sizeof(float));
    t->scores = malloc(KV_MTP_MAX_POS * sizeof(float));
    const size_t kmax = kv_zmax(kv_zmax(2 * E, QD), kv_zmax(S, E));
    t->scratch = malloc(kv_matmul_scratch((int64_t)kmax, 1));
    int rc = 0;
    if (!t->k || !t->v || !t->have || !t->e2 || !t->x || !t->xb || !t->tmp || !t->qg || !t->q || !t->kk || !t->vv ||
        !t->att || !t->router || !t->wts || !t->eo || !t->ids || !t->sh_g || !t->sh_u || !t->sh_out || !t->sh_gate ||
        !t->scores || !t->scratch)
        rc = kv_fail(d, KV_ENOMEM, "mtp: out of memory");
    if (experts) {
        t->ex = experts; /* the engine's: slabs or workers, layer n_layer among theirs */
    } else {
        kv_expert_source src = kv_model_expert_source(m);
        src.n_layer = hp->n_layer + hp->n_layer_nextn; /* the MTP block's experts follow the trunk's */
        if (!rc) rc = kv_expert_local_new_src(&t->prov, &src, pool, 1, d);
        t->ex = &t->prov;
    }
    if (rc) {
        kv_mtp_free(t);
        return rc;
    }
    *out = t;
    return 0;
}

void kv_mtp_free(kv_mtp *t) {
    if (!t) return;
    for (uint32_t i = 0; i < t->n_seq; i++) kv_mtp_reset(t, i);
    if (t->prov.free) t->prov.free(t->prov.impl);
    free(t->k);
    free(t->v);
    free(t->have);
    void *bufs[] = {t->e2, t->x, t->xb, t->tmp, t->qg, t->q, t->kk, t->vv, t->att, t->router, t->wts, t->eo,
                    t->ids, t->sh_g, t->sh_u, t->sh_out, t->sh_gate, t->scores, t->scratch};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    free(t);
}

void kv_mtp_reset(kv_mtp *t, uint32_t seq) {
    if (!t || seq >= t->n_seq || !t->k) return;
    free(t->k[seq]);
    free(t->v[seq]);
    free(t->have[seq]);
    t->k[seq] = t->v[seq] = NULL;
    t->have[seq] = NULL;
}

void kv_mtp_forget(kv_mtp *t, uint32_t seq, uint32_t from) {
    if (!t || seq >= t->n_seq || !t->have[seq] || from >= KV_MTP_MAX_POS) return;
    memset(t->have[seq] + from, 0, KV_MTP_MAX_POS - from);
}

int kv_mtp_step(kv_mtp *t, uint32_t seq, const float *h, int32_t tok, uint32_t pos, float *h_out, float *logits,
                kv_diag *d) {
    const kv_model *m = t->m;
    const kv_hparams *hp = &m->hp;
    const uint32_t il = hp->n_layer;
    const kv_layer *L = &m->layers[il];
    const int64_t E = hp->n_embd, HD = hp->head_dim, H = hp->n_head, HKV = hp->n_head_kv;
    const int64_t KVD = HKV * HD, K = hp->n_expert_used, NE = hp->n_expert, S = hp->n_ff_shexp;
    if (seq >= t->n_seq || pos >= KV_MTP_MAX_POS || tok < 0 || (uint32_t)tok >= hp->n_vocab)
        return kv_fail(d, KV_ERANGE, "mtp: sequence %u, position %u or token %d out of range", seq, pos, tok);
    if (!t->k[seq]) {
        t->k[seq] = malloc((size_t)KV_MTP_MAX_POS * (size_t)KVD * sizeof(float));
        t->v[seq] = malloc((size_t)KV_MTP_MAX_POS * (size_t)KVD * sizeof(float));
        t->have[seq] = calloc(KV_MTP_MAX_POS, 1);
        if (!t->k[seq] || !t->v[seq] || !t->have[seq]) {
            kv_mtp_reset(t, seq);
            return kv_fail(d, KV_ENOMEM, "mtp: out of memory for the K/V of sequence %u", seq);
        }
    }
    /* u = eh_proj [enorm(embedding); hnorm(h)] */
    kv_type_get(m->tok_embd.type)->to_float((const uint8_t *)m->tok_embd.data + (size_t)tok * m->tok_embd.row_bytes,
                                            t->tmp, E);
    kv_rmsnorm(t->e2, t->tmp, L->nextn_enorm.data, E, hp->rms_eps);
    kv_rmsnorm(t->e2 + E, h, L->nextn_hnorm.data, E, hp->rms_eps);
    kv_matmul(t->pool, &L->nextn_eh_proj, NULL, t->e2, 1, t->x, t->scratch);
    /* gated full attention over the block's own K/V */
    kv_rmsnorm(t->xb, t->x, L->attn_norm.data, E, hp->rms_eps);
    kv_matmul(t->pool, &L->wq, NULL, t->xb, 1, t->qg, t->scratch);
    kv_matmul(t->pool, &L->wk, NULL, t->xb, 1, t->kk, t->scratch);
    kv_matmul(t->pool, &L->wv, NULL, t->xb, 1, t->vv, t->scratch);
    float cs[KV_MAX_HEAD_DIM / 2], sn[KV_MAX_HEAD_DIM / 2];
    const int32_t p4[4] = {(int32_t)pos, (int32_t)pos, (int32_t)pos, 0};
    kv_rope_imrope_table(cs, sn, hp->n_rot, p4, hp->rope_sections, hp->rope_freq_base, hp->rope_freq_scale);
    for (int64_t hh = 0; hh < H; hh++) {
        kv_rmsnorm(t->q + hh * HD, t->qg + hh * 2 * HD, L->q_norm.data, HD, hp->rms_eps);
        kv_rope_apply(t->q + hh * HD, hp->n_rot, cs, sn);
    }
    for (int64_t hh = 0; hh < HKV; hh++) {
        kv_rmsnorm(t->kk + hh * HD, t->kk + hh * HD, L->k_norm.data, HD, hp->rms_eps);
        kv_rope_apply(t->kk + hh * HD, hp->n_rot, cs, sn);
    }
    memcpy(t->k[seq] + (size_t)pos * KVD, t->kk, (size_t)KVD * sizeof(float));
    memcpy(t->v[seq] + (size_t)pos * KVD, t->vv, (size_t)KVD * sizeof(float));
    t->have[seq][pos] = 1;
    const float scale = 1.0f / sqrtf((float)HD);
    for (int64_t hh = 0; hh < H; hh++) {
        const int64_t kh = hh / (H / HKV);
        const float *qh = t->q + hh * HD;
        float mx = -INFINITY;
        for (uint32_t j = 0; j <= pos; j++) {
            if (!t->have[seq][j]) continue;
            const float *kj = t->k[seq] + (size_t)j * KVD + kh * HD;
            float dot = 0.0f;
            for (int64_t i = 0; i < HD; i++) dot += qh[i] * kj[i];
            t->scores[j] = dot * scale;
            if (t->scores[j] > mx) mx = t->scores[j];
        }
        double sum = 0.0;
        for (uint32_t j = 0; j <= pos; j++)
            if (t->have[seq][j]) sum += (double)(t->scores[j] = expf(t->scores[j] - mx));
        float *o = t->att + hh * HD;
        for (int64_t i = 0; i < HD; i++) o[i] = 0.0f;
        for (uint32_t j = 0; j <= pos; j++) {
            if (!t->have[seq][j]) continue;
            const float w = (float)(t->scores[j] / sum);
            const float *vj = t->v[seq] + (size_t)j * KVD + kh * HD;
            for (int64_t i = 0; i < HD; i++) o[i] += w * vj[i];
        }
        const float *gate = t->qg + hh * 2 * HD + HD;
        for (int64_t i = 0; i < HD; i++) o[i] = o[i] * kv_sigmoid(gate[i]);
    }
    kv_matmul(t->pool, &L->wo, NULL, t->att, 1, t->tmp, t->scratch);
    for (int64_t i = 0; i < E; i++) t->x[i] += t->tmp[i];
    /* routed experts (softmax, top-k, renormalized) plus the gated shared expert */
    kv_rmsnorm(t->xb, t->x, L->post_norm.data, E, hp->rms_eps);
    kv_matmul(t->pool, &L->gate_inp, NULL, t->xb, 1, t->router, t->scratch);
    kv_softmax(t->router, NE);
    for (int64_t r = 0; r < K; r++) { /* descending, lower id first on ties */
        int32_t best = -1;
        for (int64_t e = 0; e < NE; e++) {
            bool taken = false;
            for (int64_t q = 0; q < r; q++) taken |= t->ids[q] == e;
            if (!taken && (best < 0 || t->router[e] > t->router[best])) best = (int32_t)e;
        }
        t->ids[r] = best;
        t->wts[r] = t->router[best];
    }
    if (hp->expert_weights_norm) {
        double sum = 0.0;
        for (int64_t r = 0; r < K; r++) sum += (double)t->wts[r];
        float fs = (float)sum;
        if (fs < 6.103515625e-5f) fs = 6.103515625e-5f;
        for (int64_t r = 0; r < K; r++) t->wts[r] /= fs;
    }
    if (hp->expert_weights_scale != 0.0f && hp->expert_weights_scale != 1.0f)
        for (int64_t r = 0; r < K; r++) t->wts[r] *= hp->expert_weights_scale;
    const kv_expert_req req = {il, 1, (uint32_t)E, (uint32_t)K, t->xb, t->ids, NULL};
    int rc = t->ex->compute(t->ex->impl, &req, t->eo, d);
    if (rc) return kv_diag_prefix(d, rc, "mtp experts");
    for (int64_t i = 0; i < E; i++) t->tmp[i] = t->eo[i] * t->wts[0];
    for (int64_t r = 1; r < K; r++)
        for (int64_t i = 0; i < E; i++) t->tmp[i] = t->tmp[i] + t->eo[r * E + i] * t->wts[r];
    if (S) {
        kv_matmul(t->pool, &L->gate_shexp, NULL, t->xb, 1, t->sh_g, t->scratch);
        kv_matmul(t->pool, &L->up_shexp, NULL, t->xb, 1, t->sh_u, t->scratch);
        kv_swiglu(t->sh_g, t->sh_g, t->sh_u, S);
        kv_matmul(t->pool, &L->down_shexp, NULL, t->sh_g, 1, t->sh_out, t->scratch);
        kv_matmul(t->pool, &L->gate_inp_shexp, NULL, t->xb, 1, t->sh_gate, t->scratch);
        const float g = kv_sigmoid(t->sh_gate[0]);
        for (int64_t i = 0; i < E; i++) t->tmp[i] = t->tmp[i] + t->sh_out[i] * g;
    }
    for (int64_t i = 0; i < E; i++) t->x[i] += t->tmp[i];
    /* the shared head: its norm, then the model's LM head */
    const kv_weight *hn = L->nextn_head_norm.data ? &L->nextn_head_norm : &m->output_norm;
    kv_rmsnorm(h_out, t->x, hn->data, E, hp->rms_eps);
    if (logits) kv_matmul(t->pool, &m->output, NULL, h_out, 1, logits, t->scratch);
    return 0;
}

/* The run state's qwen35moe part, named by its table (src/arch/qwen35moe.c). */
const kv_arch_state_ops kv_q35_state_ops = {
    .state_new = kv_q35_state_new,
    .state_free = kv_q35_state_free,
    .seq_alloc = kv_q35_seq_alloc,
    .seq_free = kv_q35_seq_free,
    .bytes = kv_q35_bytes,
    .rec_bytes = kv_q35_rec_bytes,
    .rec_get = kv_q35_rec_get,
    .rec_set = kv_q35_rec_set,
    .spec_keep = kv_q35_spec_keep,
    .rollback = kv_q35_rollback,
};
