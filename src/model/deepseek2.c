/* The deepseek2 blocks (DeepSeek-V3, R1, Kimi K2), as llama.cpp's
 * src/models/deepseek2.cpp computes them with MLA's absorption:
 *
 * attention RMSNorm; q = attn_q_b(rmsnorm(attn_q_a x)) per head [qk_nope |
 * rope]; kv = attn_kv_a_mqa x = [latent (kv_lora_rank) | k_pe (n_rot)];
 * the latent RMSNorm'ed, k_pe and each head's q_pe rotated (RoPE of
 * adjacent pairs, YaRN when the file says so); the cache keeps per token
 * only [latent | k_pe] (head_dim = kv_lora_rank + n_rot floats); each
 * head's query is absorbed: [attn_k_b[h] q_nope | q_pe], so a score is one
 * dot product with a cache row, times hp->attn_scale (YaRN's mscale^2 /
 * sqrt(key_length_mla)); the softmax-weighted sum of the cached latents
 * goes through attn_v_b[h], then attn_output; residual; FFN RMSNorm; a
 * dense SwiGLU FFN in the leading blocks, else the router (sigmoid, bias,
 * groups: src/moe/route.c), routed experts through the provider, their
 * weighted sum in rank order, plus the shared experts (SwiGLU); residual.
 *
 * Each token's arithmetic is its own (the per-head matmuls run row by row;
 * in attention each (token, head) score is one fma chain over the cache
 * row in increasing dimension and each output element one fma chain over
 * the positions in increasing order, whatever the grouping into units), so
 * results do not depend on chunking, batching or threads. In a chunk's last
 * block (kv_trim_here) every token's latent and rope part go into the
 * cache, and only the tokens whose logits are wanted run the queries,
 * attention and FFN (kv_trim_rows), as the other architectures do. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/quant.h"
#include "model/model_internal.h"
#include "quant/vec.h"

typedef struct kv_ds2_state {
    float *qa;    /* [B][q_lora_rank] */
    float *q;     /* [B][n_head][head_dim_k_mla] */
    float *kva;   /* [B][kv_lora_rank + n_rot] */
    float *qabs;  /* [B][n_head][kv_lora_rank + n_rot] absorbed queries */
    uint8_t *hq;  /* [n_head][B] rows of attn_k_b / attn_v_b's input in their vec_dot type */
    size_t hq_row; /* bytes of one hq row (the widest of the two weights' over the layers) */
    float *olat;  /* [B][n_head][kv_lora_rank] attention output in the latent */
    float *ov;    /* [B][n_head * v_mla] */
    float *fg, *fu; /* [B][max(n_ff, n_ff_shexp)] */
    float *sh;    /* [B][n_embd] shared experts' output */
    void *scratch;
} kv_ds2_state;

static size_t kv_max(size_t a, size_t b) { return a > b ? a : b; }

static int kv_ds2_state_new(kv_state *s, kv_diag *d) {
    const kv_hparams *hp = &s->m->hp;
    kv_ds2_state *z = calloc(1, sizeof *z);
    if (!z) return kv_fail(d, KV_ENOMEM, "state: out of memory");
    s->arch_state = z;
    const size_t B = s->max_tok, H = hp->n_head, D = (size_t)hp->kv_lora_rank + hp->n_rot;
    const size_t nope = hp->head_dim_k_mla - hp->n_rot;
    const size_t FF = kv_max(hp->n_ff, hp->n_ff_shexp);
    z->qa = malloc(B * hp->q_lora_rank * sizeof(float));
    z->q = malloc(B * H * hp->head_dim_k_mla * sizeof(float));
    z->kva = malloc(B * D * sizeof(float));
    z->qabs = malloc(B * H * D * sizeof(float));
    for (uint32_t il = s->m->il_first; il <= s->m->il_last; il++) {
        const kv_layer *L = &s->m->layers[il];
        z->hq_row = kv_max(z->hq_row, kv_type_row_size(kv_type_get(L->wk_b.type)->vec_dot_type, nope));
        z->hq_row = kv_max(z->hq_row, kv_type_row_size(kv_type_get(L->wv_b.type)->vec_dot_type, hp->kv_lora_rank));
    }
    z->hq = malloc(B * H * kv_max(z->hq_row, 1));
    z->olat = malloc(B * H * hp->kv_lora_rank * sizeof(float));
    z->ov = malloc(B * H * hp->head_dim_v_mla * sizeof(float));
    z->fg = malloc(B * FF * sizeof(float));
    z->fu = malloc(B * FF * sizeof(float));
    z->sh = malloc(B * hp->n_embd * sizeof(float));
    size_t k = kv_max(hp->n_embd, hp->q_lora_rank);
    k = kv_max(k, kv_max(nope, hp->kv_lora_rank));
    k = kv_max(k, kv_max(H * hp->head_dim_v_mla, FF));
    k = kv_max(k, hp->n_ff_exp);
    z->scratch = malloc(kv_matmul_scratch((int64_t)k, (int64_t)B));
    if (!z->qa || !z->q || !z->kva || !z->qabs || !z->hq || !z->olat || !z->ov || !z->fg || !z->fu ||
        !z->sh || !z->scratch)
        return kv_fail(d, KV_ENOMEM, "state: out of memory (deepseek2 buffers for %zu tokens)", B);
    return 0;
}

static void kv_ds2_state_free(kv_state *s) {
    kv_ds2_state *z = s->arch_state;
    if (!z) return;
    free(z->qa);
    free(z->q);
    free(z->kva);
    free(z->qabs);
    free(z->hq);
    free(z->olat);
    free(z->ov);
    free(z->fg);
    free(z->fu);
    free(z->sh);
    free(z->scratch);
    free(z);
    s->arch_state = NULL;
}

const kv_arch_state_ops kv_ds2_state_ops = {
    .state_new = kv_ds2_state_new,
    .state_free = kv_ds2_state_free,
};

/* ---- RoPE (adjacent pairs) with YaRN, as ggml's rope_yarn ------------------ */

static float kv_yarn_corr_dim(int n_dims, uint32_t n_ctx_orig, float n_rot, float base) {
    return (float)n_dims * logf((float)n_ctx_orig / (n_rot * 2 * (float)M_PI)) / (2 * logf(base));
}

/* cos/sin (times the magnitude factor) of token position pos for the n_rot/2 pairs. */
static void kv_ds2_rope_table(const kv_hparams *hp, int32_t pos, float *cs, float *sn) {
    const int n_dims = (int)hp->n_rot;
    const float theta_scale = powf(hp->rope_freq_base, -2.0f / (float)n_dims);
    float corr[2] = {0.0f, 0.0f};
    if (hp->yarn_ext_factor != 0.0f) {
        const float start = floorf(kv_yarn_corr_dim(n_dims, hp->n_ctx_orig_yarn, hp->yarn_beta_fast, hp->rope_freq_base));
        const float end = ceilf(kv_yarn_corr_dim(n_dims, hp->n_ctx_orig_yarn, hp->yarn_beta_slow, hp->rope_freq_base));
        corr[0] = start > 0.0f ? start : 0.0f;
        corr[1] = end < (float)(n_dims - 1) ? end : (float)(n_dims - 1);
    }
    const float fs = hp->rope_freq_scale;
    float theta = (float)pos;
    for (int i0 = 0; i0 < n_dims; i0 += 2) {
        const float interp = fs * theta;
        float t = interp, mscale = hp->yarn_attn_factor;
        if (hp->yarn_ext_factor != 0.0f) {
            const float den = corr[1] - corr[0] > 0.001f ? corr[1] - corr[0] : 0.001f;
            const float y = (float)(i0 / 2 - corr[0]) / den;
            const float ramp = 1.0f - fminf(1.0f, fmaxf(0.0f, y));
            const float mix = ramp * hp->yarn_ext_factor;
            t = interp * (1 - mix) + theta * mix;
            mscale *= 1.0f + 0.1f * logf(1.0f / fs);
        }
        cs[i0 / 2] = cosf(t) * mscale;
        sn[i0 / 2] = sinf(t) * mscale;
        theta *= theta_scale;
    }
}

static void kv_rope_pairs(float *x, int64_t n_rot, const float *cs, const float *sn) {
    for (int64_t i = 0; i < n_rot / 2; i++) {
        const float x0 = x[2 * i], x1 = x[2 * i + 1];
        x[2 * i] = x0 * cs[i] - x1 * sn[i];
        x[2 * i + 1] = x0 * sn[i] + x1 * cs[i];
    }
}

/* ---- the cache: one row [latent | k_pe] per token ------------------------- */

typedef struct kv_ds2_ctx {
    const kv_layer *L;
    bool kv; /* the latent's norm and k_pe's rotation (row t of kva) */
    bool q;  /* each head's q_pe rotated into the absorbed query (row t of q, qabs) */
} kv_ds2_ctx;

/* Token t: the latent's norm, k_pe's rotation (the cache row), and/or each
 * head's q_pe rotated into its absorbed query. */
static void kv_ds2_kv_tok(kv_state *s, const void *ctx, uint32_t t) {
    const kv_ds2_ctx *c = ctx;
    const kv_hparams *hp = &s->m->hp;
    kv_ds2_state *z = s->arch_state;
    const int64_t R = hp->kv_lora_rank, NR = hp->n_rot, D = R + NR, H = hp->n_head, KM = hp->head_dim_k_mla;
    float cs[KV_MAX_HEAD_DIM / 2], sn[KV_MAX_HEAD_DIM / 2];
    kv_ds2_rope_table(hp, (int32_t)s->tok_pos[t], cs, sn);
    if (c->kv) {
        float *kv = z->kva + (size_t)t * D;
        kv_rmsnorm(kv, kv, c->L->kv_a_norm.data, R, hp->rms_eps);
        kv_rope_pairs(kv + R, NR, cs, sn);
    }
    for (int64_t h = 0; c->q && h < H; h++) {
        float *q = z->q + ((size_t)t * H + h) * KM;
        kv_rope_pairs(q + (KM - NR), NR, cs, sn);
        memcpy(z->qabs + ((size_t)t * H + h) * D + R, q + (KM - NR), (size_t)NR * sizeof(float));
    }
}

static void kv_ds2_cache_put(kv_state *s, uint32_t il, uint32_t T) {
    const kv_hparams *hp = &s->m->hp;
    kv_ds2_state *z = s->arch_state;
    const int64_t D = (int64_t)hp->kv_lora_rank + hp->n_rot;
    const uint32_t ai = (uint32_t)s->attn_of[il];
    const kv_type_info *f16 = s->kv_type == KV_TYPE_F16 ? kv_type_get(KV_TYPE_F16) : NULL;
    for (uint32_t t = 0; t < T; t++) {
        uint8_t *row = kv_cache_row(s, s->tok_seq[t], ai, s->tok_pos[t]);
        const float *src = z->kva + (size_t)t * D;
        if (f16)
            f16->from_float(src, row, D);
        else
            memcpy(row, src, (size_t)D * sizeof(float));
    }
}

/* ---- attention: (token group, head slice) units --------------------------- */

typedef struct kv_ds2_attn_job {
    kv_state *s;
    uint32_t il, n_grp, nh; /* token groups (s->att_grp), query heads per unit */
} kv_ds2_attn_job;

/* The n rows of positions p0.. (one cache block, p0 a multiple of
 * KV_BLOCK) of sequence seq as F32 rows of D floats, *stride floats apart:
 * the cache itself (F32) or widened, exactly, into buf (F16). */
static const float *kv_ds2_rows(const kv_state *s, uint32_t seq, uint32_t ai, int64_t p0, int64_t n, int64_t D,
                                float *buf, size_t *stride) {
    const uint8_t *b = kv_cache_row(s, seq, ai, (uint32_t)p0);
    if (s->kv_type != KV_TYPE_F16) {
        *stride = s->kv_row / sizeof(float);
        return (const float *)(const void *)b;
    }
    const kv_type_info *f16 = kv_type_get(KV_TYPE_F16);
    for (int64_t r = 0; r < n; r++) f16->to_float(b + (size_t)r * s->kv_row, buf + r * D, D);
    *stride = (size_t)D;
    return buf;
}

/* One unit: query heads h0 .. h0+nh-1 of the group's nt tokens (consecutive
 * positions of one sequence), over the one latent KV head every head reads.
 * Each score is q . row as one fma chain over the D dimensions in
 * increasing order, from 0 (the block's rows transposed to [D][KV_BLOCK],
 * so a block's scores are kv_f32_wsum_rows_multi's weighted sum of its
 * dimension rows, vectorized across positions); the softmax (its rounded
 * multiply by attn_scale first) over the token's own positions 0..pos; each
 * latent output element one fma chain over the positions in increasing
 * order, from 0, continued block to block. These are the bits of one
 * (token, head) computed alone with scalar fmaf loops, whatever nt, nh and
 * the threads. */
static void kv_ds2_attn_unit(kv_state *s, uint32_t ai, uint32_t t0, uint32_t nt, int64_t h0, int64_t nh, int ith) {
    const kv_hparams *hp = &s->m->hp;
    kv_ds2_state *z = s->arch_state;
    const int64_t R = hp->kv_lora_rank, D = R + hp->n_rot, H = hp->n_head;
    const size_t SCS = s->n_ctx, AQ = (size_t)s->att_tok * s->att_heads;
    float *sc = s->scores + (size_t)ith * AQ * SCS;
    float *qb = s->att_qbuf + (size_t)ith * AQ * (size_t)D;
    float *kt = s->kv_wide + (size_t)ith * 2 * KV_BLOCK * (size_t)D; /* [D][KV_BLOCK] */
    float *vb = kt + (size_t)KV_BLOCK * D;                             /* [KV_BLOCK][D] */
    const uint32_t seq = s->tok_seq[t0];
    const int64_t pos0 = s->tok_pos[t0], maxkv = (int64_t)s->tok_pos[t0 + nt - 1] + 1;
    for (uint32_t u = 0; u < nt; u++)
        memcpy(qb + (size_t)u * nh * D, z->qabs + ((size_t)(t0 + u) * H + h0) * D, (size_t)(nh * D) * sizeof(float));
    /* scores: token u reads positions 0..pos0+u; the unit's positions past
     * that (up to maxkv, all written) are computed with the others, never read */
    for (int64_t p0 = 0; p0 < maxkv; p0 += KV_BLOCK) {
        const int64_t n = maxkv - p0 < KV_BLOCK ? maxkv - p0 : KV_BLOCK;
        const uint32_t ulo = p0 > pos0 ? (uint32_t)(p0 - pos0) : 0; /* tokens with a position in this block */
        size_t rs;
        const float *rows = kv_ds2_rows(s, seq, ai, p0, n, D, vb, &rs);
        for (int64_t r = 0; r < n; r++)
            for (int64_t c = 0; c < D; c++) kt[(size_t)c * KV_BLOCK + (size_t)r] = rows[(size_t)r * rs + (size_t)c];
        kv_f32_wsum_rows_multi(sc + (size_t)ulo * nh * SCS + p0, SCS, qb + (size_t)ulo * nh * D, (size_t)D,
                               (int64_t)(nt - ulo) * nh, kt, KV_BLOCK, D, n, 0);
    }
    for (uint32_t u = 0; u < nt; u++)
        for (int64_t j = 0; j < nh; j++)
            kv_f32_softmax(sc + ((size_t)u * nh + (size_t)j) * SCS, pos0 + u + 1, hp->attn_scale);
    /* the softmax-weighted sum of the latents (a row's first R floats) */
    for (int64_t p0 = 0; p0 < maxkv; p0 += KV_BLOCK) {
        const int64_t n = maxkv - p0 < KV_BLOCK ? maxkv - p0 : KV_BLOCK;
        size_t rs;
        const float *V = kv_ds2_rows(s, seq, ai, p0, n, D, vb, &rs);
        for (uint32_t u = 0; u < nt; u++) {
            const int64_t n_kv = pos0 + u + 1;
            if (n_kv <= p0) continue;
            const int64_t m = n_kv - p0 < n ? n_kv - p0 : n;
            float *o = z->olat + ((size_t)(t0 + u) * H + h0) * R;
            kv_f32_wsum_rows_multi(o, (size_t)R, sc + (size_t)u * nh * SCS + p0, SCS, nh, V, rs, m, R, p0 != 0);
        }
    }
}

static void kv_ds2_attn_worker(void *arg, int ith, int nth) {
    const kv_ds2_attn_job *j = arg;
    kv_state *s = j->s;
    const int64_t slices = (int64_t)s->m->hp.n_head / j->nh;
    const uint32_t ai = (uint32_t)s->attn_of[j->il];
    for (long w = ith; w < (long)j->n_grp * slices; w += nth) {
        const uint32_t g = (uint32_t)(w / slices), t0 = s->att_grp[g];
        kv_ds2_attn_unit(s, ai, t0, s->att_grp[g + 1] - t0, (w % slices) * j->nh, j->nh, ith);
    }
}

/* Groups the T tokens (up to s->att_tok consecutive positions of one
 * sequence), then splits the heads (s->att_heads at most per unit, fewer
 * while there are fewer units than threads: a decode step's heads spread
 * over the pool) and runs the units. */
static void kv_ds2_attn_run(kv_state *s, uint32_t il, uint32_t T) {
    uint32_t ng = 0;
    for (uint32_t t = 0; t < T; t++) {
        const uint32_t g0 = ng ? s->att_grp[ng - 1] : 0;
        if (!ng || t - g0 >= s->att_tok || s->tok_seq[t] != s->tok_seq[t - 1] ||
            s->tok_pos[t] != s->tok_pos[t - 1] + 1)
            s->att_grp[ng++] = t;
    }
    s->att_grp[ng] = T;
    uint32_t nh = s->att_heads;
    const uint64_t nth = (uint64_t)kv_pool_size(s->pool);
    while (nh % 2 == 0 && (uint64_t)ng * (s->m->hp.n_head / nh) < nth) nh /= 2;
    kv_ds2_attn_job aj = {s, il, ng, nh};
    kv_pool_run(s->pool, kv_ds2_attn_worker, &aj);
}

/* Per head h: dst[t][h*dst_head ..][0..n) = W[h] . src[t][h*src_head ..][0..k)
 * for the T tokens (W: a 3-D weight, head outermost), every head in the same
 * two pool runs (the (head, token) inputs converted to the vec_dot type, then
 * (head, 16 output rows) units split over the threads) rather than two per
 * head. Each element is the vec_dot of its pair (kv_mat_rows), the bits of
 * kv_matmul of one head alone. */
typedef struct kv_ds2_ph_job {
    const kv_weight *w;
    const float *src;
    size_t src_stride, src_head;
    float *dst;
    size_t dst_stride, dst_head;
    uint32_t T;
    uint8_t *q;      /* [head][T] converted rows */
    size_t q_stride; /* bytes per converted row */
    int phase;       /* 0: convert, 1: rows */
} kv_ds2_ph_job;

static void kv_ds2_ph_worker(void *arg, int ith, int nth) {
    const kv_ds2_ph_job *j = arg;
    const kv_weight *w = j->w;
    const int64_t k = w->ne[0], n = w->ne[1], H = w->ne[2], T = j->T;
    long lo, hi;
    if (j->phase == 0) {
        const uint32_t vdt = kv_type_get(w->type)->vec_dot_type;
        kv_pool_split((long)(H * T), ith, nth, &lo, &hi);
        for (long u = lo; u < hi; u++)
            kv_quantize_rows(vdt, j->src + (size_t)(u % T) * j->src_stride + (size_t)(u / T) * j->src_head,
                             (size_t)k, k, 1, j->q + (size_t)u * j->q_stride, j->q_stride);
        return;
    }
    const long nb = (long)((n + 15) / 16);
    kv_pool_split((long)H * nb, ith, nth, &lo, &hi);
    for (long u = lo; u < hi;) {
        const long h = u / nb, b0 = u % nb, b1 = nb < b0 + (hi - u) ? nb : b0 + (hi - u);
        const int64_t r0 = (int64_t)b0 * 16, r1 = (int64_t)b1 * 16 < n ? (int64_t)b1 * 16 : n;
        kv_mat_rows(w->type, (const uint8_t *)w->data + (size_t)h * w->nb2, w->row_bytes, k, r0, r1,
                    j->q + (size_t)h * (size_t)T * j->q_stride, j->q_stride, T, j->dst + (size_t)h * j->dst_head,
                    j->dst_stride);
        u += b1 - b0;
    }
}

static void kv_ds2_per_head(kv_state *s, const kv_weight *w, const float *src, size_t src_stride, size_t src_head,
                            float *dst, size_t dst_stride, size_t dst_head, uint32_t T) {
    kv_ds2_state *z = s->arch_state;
    const uint32_t vdt = kv_type_get(w->type)->vec_dot_type;
    kv_ds2_ph_job j = {w, src, src_stride, src_head, dst, dst_stride, dst_head, T, z->hq,
                       (size_t)kv_type_row_size(vdt, (uint64_t)w->ne[0]), 0};
    kv_pool_run(s->pool, kv_ds2_ph_worker, &j);
    j.phase = 1;
    kv_pool_run(s->pool, kv_ds2_ph_worker, &j);
}

/* y = down(silu(gate x) * up x) over T rows of s->xb. */
static void kv_ds2_ffn(kv_state *s, const kv_weight *gate, const kv_weight *up, const kv_weight *down, uint32_t T,
                       float *y) {
    kv_ds2_state *z = s->arch_state;
    const int64_t F = gate->ne[1];
    kv_matmul(s->pool, gate, NULL, s->xb, T, z->fg, z->scratch);
    kv_matmul(s->pool, up, NULL, s->xb, T, z->fu, z->scratch);
    for (uint32_t t = 0; t < T; t++) kv_swiglu(z->fg + (size_t)t * F, z->fg + (size_t)t * F, z->fu + (size_t)t * F, F);
    kv_matmul(s->pool, down, NULL, z->fg, T, y, z->scratch);
}

typedef struct kv_qa_ctx {
    const float *w;
} kv_qa_ctx;

static void kv_ds2_qa_tok(kv_state *s, const void *ctx, uint32_t t) {
    const kv_qa_ctx *c = ctx;
    const kv_hparams *hp = &s->m->hp;
    kv_ds2_state *z = s->arch_state;
    float *r = z->qa + (size_t)t * hp->q_lora_rank;
    kv_rmsnorm(r, r, c->w, hp->q_lora_rank, hp->rms_eps);
}

int kv_ds2_blocks(kv_state *s, uint32_t T, kv_diag *d) {
    const kv_model *m = s->m;
    const kv_hparams *hp = &m->hp;
    kv_ds2_state *z = s->arch_state;
    const int64_t E = hp->n_embd, H = hp->n_head, R = hp->kv_lora_rank, D = R + hp->n_rot;
    const int64_t KM = hp->head_dim_k_mla, VM = hp->head_dim_v_mla;
    for (uint32_t il = m->il_first; il <= m->il_last; il++) {
        const kv_layer *L = &m->layers[il];
        uint64_t pt = kv_prof_start(s);
        kv_resid_norm(s, T, 0, L->attn_norm.data);
        kv_check_rows(s, s->xb, (size_t)E, T, E);
        pt = kv_prof_mark(s, KV_PROF_NORM, pt);
        /* the compressed KV of every token into the cache; then, in a
         * chunk's last block, only the rows whose logits are wanted */
        const bool trim = kv_trim_here(s, il);
        kv_matmul(s->pool, &L->wkv_a, NULL, s->xb, T, z->kva, z->scratch);
        kv_per_token(s, T, kv_ds2_kv_tok, &(kv_ds2_ctx){L, true, false});
        kv_ds2_cache_put(s, il, T);
        if (trim && !(T = kv_trim_rows(s, T, false))) break;
        /* queries through the low-rank path, q_pe rotated */
        kv_matmul(s->pool, &L->wq_a, NULL, s->xb, T, z->qa, z->scratch);
        kv_per_token(s, T, kv_ds2_qa_tok, &(kv_qa_ctx){L->q_a_norm.data});
        kv_matmul(s->pool, &L->wq_b, NULL, z->qa, T, z->q, z->scratch);
        kv_per_token(s, T, kv_ds2_kv_tok, &(kv_ds2_ctx){L, false, true});
        /* absorbed queries: attn_k_b[h] . q_nope into the first kv_lora_rank */
        kv_ds2_per_head(s, &L->wk_b, z->q, (size_t)(H * KM), (size_t)KM, z->qabs, (size_t)(H * D), (size_t)D, T);
        pt = kv_prof_mark(s, KV_PROF_ATTN_PROJ, pt);
        kv_ds2_attn_run(s, il, T);
        pt = kv_prof_mark(s, KV_PROF_ATTN, pt);
        /* out of the latent: attn_v_b[h], then attn_output */
        kv_ds2_per_head(s, &L->wv_b, z->olat, (size_t)(H * R), (size_t)R, z->ov, (size_t)(H * VM), (size_t)VM, T);
        kv_check_rows(s, z->ov, (size_t)(H * VM), T, H * VM);
        kv_matmul(s->pool, &L->wo, NULL, z->ov, T, s->tmp, z->scratch);
        pt = kv_prof_mark(s, KV_PROF_ATTN_PROJ, pt);
        kv_resid_norm(s, T, 1, L->ffn_norm.data);
        kv_check_rows(s, s->xb, (size_t)E, T, E);
        kv_prof_mark(s, KV_PROF_NORM, pt);
        if (il < hp->n_layer_dense_lead) {
            pt = kv_prof_start(s);
            kv_ds2_ffn(s, &L->ffn_gate, &L->ffn_up, &L->ffn_down, T, s->tmp);
            kv_prof_mark(s, KV_PROF_SHARED, pt);
        } else {
            int rc = kv_moe_routed(s, L, il, T, d);
            if (rc) return rc;
            pt = kv_prof_start(s);
            kv_ds2_ffn(s, &L->gate_shexp, &L->up_shexp, &L->down_shexp, T, z->sh);
            for (size_t i = 0; i < (size_t)T * (size_t)E; i++) s->tmp[i] = s->tmp[i] + z->sh[i];
            kv_prof_mark(s, KV_PROF_SHARED, pt);
        }
        pt = kv_prof_start(s);
        kv_resid_norm(s, T, 1, NULL);
        kv_prof_mark(s, KV_PROF_NORM, pt);
    }
    return 0;
}
