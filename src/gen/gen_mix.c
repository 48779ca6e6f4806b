/* llama-quantize's tensor-type recipes for the file types Q2_K, Q3_K_M,
 * Q4_K_M and IQ4_XS, restated from llama-quant.cpp (llama_tensor_get_type)
 * for the tensors our architectures have, without an importance matrix:
 *
 *   - output.weight (and token_embd when tied): Q6_K (Q8_0 if its rows do
 *     not fit the mix's default block);
 *   - token_embd (untied): the default type;
 *   - attn_v-like (attn_v, attn_qkv, attn_kv_b): Q2_K: Q4_K if n_gqa >= 4
 *     else Q3_K; Q3_K_M: Q5_K for the first two, then Q4_K; Q4_K_M: Q6_K
 *     where "use more bits"(rank, count); IQ4_XS: Q5_K if n_gqa >= 4; then,
 *     with exactly 8 experts, Q8_0;
 *   - attn_k: Q8_0 with exactly 8 experts;
 *   - ffn_down* (routed, shared, dense), by block il of n: Q2_K: Q3_K;
 *     Q3_K_M: Q5_K if il < n/16 else Q4_K; Q4_K_M: Q6_K where "use more
 *     bits"(il, n); IQ4_XS: Q5_K if il < n/8;
 *   - attn_output: with 8 experts Q5_K; otherwise Q2_K: Q3_K, Q3_K_M: Q4_K;
 *   - everything else: the default type (Q2_K, Q3_K, Q4_K, IQ4_XS).
 * "use more bits"(i, n) = i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2.
 * Then llama.cpp's fallback for rows that do not fit the type's block. */
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "kvasir/gen.h"
#include "kvasir/quant.h"

static const struct {
    const char *name;
    uint32_t def;   /* the default (most tensors') type */
    uint32_t ftype; /* llama_ftype */
} kv_mixes[KV_GEN_MIX_COUNT] = {
    [KV_GEN_MIX_Q2_K] = {"q2_k", KV_TYPE_Q2_K, 10},
    [KV_GEN_MIX_Q3_K_M] = {"q3_k_m", KV_TYPE_Q3_K, 12},
    [KV_GEN_MIX_Q4_K_M] = {"q4_k_m", KV_TYPE_Q4_K, 15},
    [KV_GEN_MIX_IQ4_XS] = {"iq4_xs", KV_TYPE_IQ4_XS, 30},
};

int kv_gen_mix_from_name(const char *name) {
    for (int i = 1; name && i < KV_GEN_MIX_COUNT; i++)
        if (!strcasecmp(name, kv_mixes[i].name)) return i;
    return -1;
}

const char *kv_gen_mix_name(uint32_t mix) {
    return mix > 0 && mix < KV_GEN_MIX_COUNT ? kv_mixes[mix].name : NULL;
}

uint32_t kv_gen_mix_ftype(uint32_t mix) { return mix > 0 && mix < KV_GEN_MIX_COUNT ? kv_mixes[mix].ftype : 0; }

static bool more_bits(int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }
static bool has(const char *s, const char *sub) { return strstr(s, sub) != NULL; }

/* llama-quant.cpp's tensor_type_fallback, then what Kvasir can write. */
static uint32_t fallback(uint32_t t, uint64_t ne0) {
    const kv_type_info *ti = kv_type_get_ref(t);
    if (ti && ne0 % ti->blck == 0 && ti->from_float) return t;
    if (ti && ne0 % ti->blck) {
        switch (t) {
        case KV_TYPE_Q2_K: case KV_TYPE_Q3_K: t = KV_TYPE_Q4_0; break;
        case KV_TYPE_Q4_K: t = KV_TYPE_Q5_0; break;
        case KV_TYPE_Q5_K: t = KV_TYPE_Q5_1; break;
        case KV_TYPE_Q6_K: t = KV_TYPE_Q8_0; break;
        case KV_TYPE_IQ4_XS: t = KV_TYPE_IQ4_NL; break;
        default: break;
        }
        ti = kv_type_get_ref(t);
        if (ne0 % ti->blck) return KV_TYPE_F16;
    }
    if (ti->from_float) return t;
    return ne0 % 32 ? KV_TYPE_F16 : KV_TYPE_Q8_0; /* a type gen-model cannot write */
}

uint32_t kv_gen_mix_type(uint32_t mix, const char *name, uint64_t ne0, const kv_gen_mix_ctx *c) {
    if (mix == 0 || mix >= KV_GEN_MIX_COUNT) return KV_TYPE_F32;
    const uint32_t def = kv_mixes[mix].def;
    uint32_t t = def;
    const bool x8 = c->n_expert == 8;
    if (!strcmp(name, "output.weight") || (c->tied && !strcmp(name, "token_embd.weight"))) {
        t = ne0 % KV_QK_K ? KV_TYPE_Q8_0 : KV_TYPE_Q6_K;
    } else if (!strcmp(name, "token_embd.weight")) {
        t = def;
    } else if (has(name, "attn_qkv.weight") || has(name, "attn_kv_b.weight") || has(name, "attn_v.weight")) {
        switch (mix) {
        case KV_GEN_MIX_Q2_K: t = c->n_gqa >= 4 ? KV_TYPE_Q4_K : KV_TYPE_Q3_K; break;
        case KV_GEN_MIX_Q3_K_M: t = c->i_wv < 2 ? KV_TYPE_Q5_K : KV_TYPE_Q4_K; break;
        case KV_GEN_MIX_Q4_K_M: if (more_bits(c->i_wv, c->n_wv)) t = KV_TYPE_Q6_K; break;
        case KV_GEN_MIX_IQ4_XS: if (c->n_gqa >= 4) t = KV_TYPE_Q5_K; break;
        }
        if (x8) t = KV_TYPE_Q8_0;
    } else if (has(name, "attn_k.weight")) {
        if (x8) t = KV_TYPE_Q8_0;
    } else if (has(name, "attn_q.weight")) {
        /* nothing for these file types */
    } else if (has(name, "attn_output.weight")) {
        if (x8)
            t = KV_TYPE_Q5_K;
        else if (mix == KV_GEN_MIX_Q2_K)
            t = KV_TYPE_Q3_K;
        else if (mix == KV_GEN_MIX_Q3_K_M)
            t = KV_TYPE_Q4_K;
    } else if (has(name, "ffn_up") || has(name, "ffn_gate")) {
        /* nothing for these file types (llama.cpp tests ffn_up, ffn_gate before ffn_down) */
    } else if (has(name, "ffn_down")) {
        int il = 0; /* dense models count; our MoE names carry the block */
        if (sscanf(name, "blk.%d.", &il) != 1 || il < 0) il = 0;
        const int n = c->n_layer_all;
        switch (mix) {
        case KV_GEN_MIX_Q2_K: t = KV_TYPE_Q3_K; break;
        case KV_GEN_MIX_Q3_K_M: t = il < n / 16 ? KV_TYPE_Q5_K : KV_TYPE_Q4_K; break;
        case KV_GEN_MIX_Q4_K_M: if (more_bits(il, n)) t = KV_TYPE_Q6_K; break;
        case KV_GEN_MIX_IQ4_XS: if (il < n / 8) t = KV_TYPE_Q5_K; break;
        }
    }
    return fallback(t, ne0);
}
