/* The gpt-oss blocks (table: src/arch/gptoss.c), as llama.cpp's
 * openai-moe.cpp computes them.
 *
 * Per block: attention RMSNorm; Q/K/V projections plus their biases; NeoX
 * RoPE over the whole head (no Q/K norm); causal softmax attention over the
 * KV cache with the head's sink logit in the denominator, over the last
 * n_swa positions only in the sliding blocks (the window and sinks live in
 * forward.c's attention unit, named by the layer); output projection plus
 * its bias, residual; post-attention RMSNorm; the router (logits plus bias,
 * top-k, softmax over the k: src/moe/route.c); routed experts through the
 * expert provider (biases and the clamped SwiGLU in the provider:
 * src/moe/local.c); weighted sum in rank order; residual.
 *
 * The expert biases and the activation travel with the expert weights
 * (kv_expert_weights): from the model file, from slabs (which carry the
 * bias rows of their experts) and on workers alike. */
#include <math.h>
#include <string.h>

#include "model/model_internal.h"

typedef struct kv_gptoss_tok_ctx {
    const kv_layer *L;
    bool q;  /* Q: bias and RoPE */
    bool kv; /* K: bias and RoPE; V: bias */
} kv_gptoss_tok_ctx;

static void kv_add_bias(float *x, const kv_weight *b, int64_t n) {
    if (!b->data) return;
    const float *v = b->data;
    for (int64_t i = 0; i < n; i++) x[i] = x[i] + v[i];
}

/* NeoX RoPE angles of position pos with YaRN, as ggml's rope_yarn: per pair
 * i, theta_extrap = pos * base^(-2i/n_rot), theta_interp = freq_scale *
 * theta_extrap, mixed by the ramp between the correction dims, and the
 * magnitude attn_factor * (1 + 0.1 ln(1 / freq_scale)). */
static float kv_yarn_corr_dim(float n_rot, float n_ctx_orig, float rot, float base) {
    return n_rot * logf(n_ctx_orig / (rot * 2.0f * 3.14159265358979f)) / (2.0f * logf(base));
}
static void kv_gptoss_yarn_table(float *cs, float *sn, const kv_hparams *hp, int32_t pos) {
    const float n = (float)hp->n_rot, base = hp->rope_freq_base, fs = hp->rope_freq_scale;
    float lo = floorf(kv_yarn_corr_dim(n, (float)hp->n_ctx_orig_yarn, hp->yarn_beta_fast, base));
    float hi = ceilf(kv_yarn_corr_dim(n, (float)hp->n_ctx_orig_yarn, hp->yarn_beta_slow, base));
    lo = lo > 0.0f ? lo : 0.0f;
    hi = hi < n - 1.0f ? hi : n - 1.0f;
    const float theta_scale = powf(base, -2.0f / n);
    const float mscale = hp->yarn_attn_factor * (1.0f + 0.1f * logf(1.0f / fs));
    float theta = (float)pos;
    for (uint32_t i = 0; i < hp->n_rot / 2; i++) {
        const float y = ((float)i - lo) / fmaxf(0.001f, hi - lo);
        const float mix = (1.0f - fminf(1.0f, fmaxf(0.0f, y))) * hp->yarn_ext_factor;
        const float t = fs * theta * (1.0f - mix) + theta * mix;
        cs[i] = cosf(t) * mscale;
        sn[i] = sinf(t) * mscale;
        theta *= theta_scale;
    }
}

/* Token t's projection biases and RoPE (angles into its own row of s->att,
 * free until this layer's attention writes it). */
static void kv_gptoss_qkv_tok(kv_state *s, const void *ctx, uint32_t t) {
    const kv_gptoss_tok_ctx *c = ctx;
    const kv_layer *L = c->L;
    const kv_hparams *hp = &s->m->hp;
    const int64_t HD = hp->head_dim, H = hp->n_head, HKV = hp->n_head_kv, QD = H * HD, KVD = HKV * HD;
    float *cs = s->att + (size_t)t * (size_t)QD, *sn = cs + hp->n_rot / 2;
    if (hp->rope_yarn)
        kv_gptoss_yarn_table(cs, sn, hp, (int32_t)s->tok_pos[t]);
    else
        kv_rope_neox_table(cs, sn, hp->n_rot, (int32_t)s->tok_pos[t], hp->rope_freq_base, hp->rope_freq_scale);
    if (c->q) {
        float *q = s->q + (size_t)t * QD;
        kv_add_bias(q, &L->bq, QD);
        for (int64_t h = 0; h < H; h++) kv_rope_apply(q + h * HD, hp->n_rot, cs, sn);
    }
    if (c->kv) {
        float *k = s->k + (size_t)t * KVD;
        kv_add_bias(k, &L->bk, KVD);
        kv_add_bias(s->v + (size_t)t * KVD, &L->bv, KVD);
        for (int64_t h = 0; h < HKV; h++) kv_rope_apply(k + h * HD, hp->n_rot, cs, sn);
    }
}

static void kv_gptoss_obias_tok(kv_state *s, const void *ctx, uint32_t t) {
    kv_add_bias(s->tmp + (size_t)t * s->m->hp.n_embd, ctx, s->m->hp.n_embd);
}

int kv_gptoss_blocks(kv_state *s, uint32_t T, kv_diag *d) {
    const kv_model *m = s->m;
    const kv_hparams *hp = &m->hp;
    const int64_t E = hp->n_embd, QD = hp->n_head * hp->head_dim;

    for (uint32_t il = m->il_first; il <= m->il_last; il++) {
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
        /* biases, RoPE, then K and V into the cache */
        kv_per_token(s, T, kv_gptoss_qkv_tok, &(kv_gptoss_tok_ctx){L, !trim, true});
        pt = kv_prof_mark(s, KV_PROF_NORM, pt);
        kv_cache_put(s, il, T);
        if (trim) { /* every token's K and V are in the cache: the rest only for the kept ones */
            if (!(T = kv_trim_rows(s, T, false))) break;
            kv_matmul(s->pool, &L->wq, NULL, s->xb, T, s->q, s->scratch);
            kv_per_token(s, T, kv_gptoss_qkv_tok, &(kv_gptoss_tok_ctx){L, true, false});
            pt = kv_prof_mark(s, KV_PROF_ATTN_PROJ, pt);
        }
        /* causal attention with sinks (and the window in sliding blocks) */
        kv_attn_run(s, il, T);
        kv_check_rows(s, s->att, (size_t)QD, T, QD);
        pt = kv_prof_mark(s, KV_PROF_ATTN, pt);
        /* output projection + bias + residual */
        kv_matmul(s->pool, &L->wo, NULL, s->att, T, s->tmp, s->scratch);
        kv_per_token(s, T, kv_gptoss_obias_tok, &L->bo);
        pt = kv_prof_mark(s, KV_PROF_ATTN_PROJ, pt);
        /* residual, post-attention rmsnorm, routed experts, residual */
        kv_resid_norm(s, T, 1, L->post_norm.data);
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
