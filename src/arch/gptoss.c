/* gpt-oss (gpt-oss-120b, gpt-oss-20b; llama.cpp's LLM_ARCH_OPENAI_MOE,
 * general.architecture "gpt-oss", src/models/openai-moe.cpp): every block is
 * grouped-query attention with biases on Q, K, V and the output, NeoX RoPE
 * over the whole head, no Q/K norm, a learned per-head sink logit in every
 * softmax, and a sliding window in the blocks the pattern names (the even
 * ones for the default pattern 2); then post-attention RMSNorm and a routed
 * MoE whose router has a bias and takes the softmax of the top-k logits only
 * (no renormalization, no scale), whose experts have biases on gate, up and
 * down and the clamped SwiGLU (gate clamped above at 7, up to [-7, 7],
 * gate * sigmoid(1.702 gate) * (up + 1)). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "arch/arch_internal.h"

/* gen-model's scales for the tensors qwen3moe lacks: biases of small RMS,
 * sinks of the scores' own size (so a head's sink takes a real share), and
 * expert gate/up wide enough that the clamp at 7 bites now and then (down
 * scaled back so the mixture adds ~2.5 RMS). */
#define KV_GPTOSS_BIAS_STD 0.1f
#define KV_GPTOSS_SINK_STD 1.0f
#define KV_GPTOSS_ROUTER_BIAS_STD 0.5f
#define KV_GPTOSS_EXP_BIAS_STD 0.5f
#define KV_GPTOSS_GAIN_UPGATE 3.0f
#define KV_GPTOSS_GAIN_DOWN 0.3f

static const kv_tensor_desc kv_gptoss_tensors[] = {
    KV_TD(KV_T_TOKEN_EMBD, "token_embd.weight", 0, 2, KV_D_EMBD, KV_D_VOCAB, KV_D_1, KV_TF_VOCAB_ROWS,
          KV_ROLE_EMBD, KV_MAT(KV_INIT_GAIN_EMBD)),
    KV_TD(KV_T_ATTN_NORM, "attn_norm.weight", KV_BLK_ATTN, 1, KV_D_EMBD, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_NORM,
          KV_VEC(1.0f, KV_INIT_NORM_STD)),
    KV_TD(KV_T_ATTN_Q, "attn_q.weight", KV_BLK_ATTN, 2, KV_D_EMBD, KV_D_Q, KV_D_1, 0, KV_ROLE_ATTN,
          KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_ATTN_Q_BIAS, "attn_q.bias", KV_BLK_ATTN, 1, KV_D_Q, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_ATTN,
          KV_VEC(0.0f, KV_GPTOSS_BIAS_STD)),
    KV_TD(KV_T_ATTN_K, "attn_k.weight", KV_BLK_ATTN, 2, KV_D_EMBD, KV_D_KV, KV_D_1, 0, KV_ROLE_ATTN,
          KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_ATTN_K_BIAS, "attn_k.bias", KV_BLK_ATTN, 1, KV_D_KV, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_ATTN,
          KV_VEC(0.0f, KV_GPTOSS_BIAS_STD)),
    KV_TD(KV_T_ATTN_V, "attn_v.weight", KV_BLK_ATTN, 2, KV_D_EMBD, KV_D_KV, KV_D_1, 0, KV_ROLE_ATTN,
          KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_ATTN_V_BIAS, "attn_v.bias", KV_BLK_ATTN, 1, KV_D_KV, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_ATTN,
          KV_VEC(0.0f, KV_GPTOSS_BIAS_STD)),
    KV_TD(KV_T_ATTN_OUT, "attn_output.weight", KV_BLK_ATTN, 2, KV_D_Q, KV_D_EMBD, KV_D_1, 0, KV_ROLE_ATTN,
          KV_MAT(KV_INIT_GAIN_WO)),
    KV_TD(KV_T_ATTN_OUT_BIAS, "attn_output.bias", KV_BLK_ATTN, 1, KV_D_EMBD, KV_D_1, KV_D_1, KV_TF_F32,
          KV_ROLE_ATTN, KV_VEC(0.0f, KV_GPTOSS_BIAS_STD)),
    KV_TD(KV_T_ATTN_SINKS, "attn_sinks.weight", KV_BLK_ATTN, 1, KV_D_HEADS, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_ATTN,
          KV_VEC(0.0f, KV_GPTOSS_SINK_STD)),
    KV_TD(KV_T_POST_NORM, "post_attention_norm.weight", KV_BLK_ATTN, 1, KV_D_EMBD, KV_D_1, KV_D_1, KV_TF_F32,
          KV_ROLE_NORM, KV_VEC(1.0f, KV_INIT_NORM_STD)),
    /* llama.cpp's quantizer never quantizes the router */
    KV_TD(KV_T_FFN_GATE_INP, "ffn_gate_inp.weight", KV_BLK_ATTN, 2, KV_D_EMBD, KV_D_EXPERT, KV_D_1, KV_TF_KEEP_F32,
          KV_ROLE_ROUTER, KV_MAT(KV_INIT_GAIN_ROUTER)),
    KV_TD(KV_T_FFN_GATE_INP_BIAS, "ffn_gate_inp.bias", KV_BLK_ATTN, 1, KV_D_EXPERT, KV_D_1, KV_D_1, KV_TF_F32,
          KV_ROLE_ROUTER, KV_VEC(0.0f, KV_GPTOSS_ROUTER_BIAS_STD)),
    KV_TD(KV_T_FFN_GATE_EXPS, KV_EXPERT_STEM_GATE ".weight", KV_BLK_ATTN, 3, KV_D_EMBD, KV_D_FF_EXP, KV_D_EXPERT, 0,
          KV_ROLE_EXPERT, KV_MAT(KV_GPTOSS_GAIN_UPGATE)),
    KV_TD(KV_T_FFN_GATE_EXPS_BIAS, KV_EXPERT_STEM_GATE ".bias", KV_BLK_ATTN, 2, KV_D_FF_EXP, KV_D_EXPERT, KV_D_1,
          KV_TF_F32, KV_ROLE_EXPERT_BIAS, KV_VEC(0.0f, KV_GPTOSS_EXP_BIAS_STD)),
    KV_TD(KV_T_FFN_UP_EXPS, KV_EXPERT_STEM_UP ".weight", KV_BLK_ATTN, 3, KV_D_EMBD, KV_D_FF_EXP, KV_D_EXPERT, 0,
          KV_ROLE_EXPERT, KV_MAT(KV_GPTOSS_GAIN_UPGATE)),
    KV_TD(KV_T_FFN_UP_EXPS_BIAS, KV_EXPERT_STEM_UP ".bias", KV_BLK_ATTN, 2, KV_D_FF_EXP, KV_D_EXPERT, KV_D_1,
          KV_TF_F32, KV_ROLE_EXPERT_BIAS, KV_VEC(0.0f, KV_GPTOSS_EXP_BIAS_STD)),
    KV_TD(KV_T_FFN_DOWN_EXPS, KV_EXPERT_STEM_DOWN ".weight", KV_BLK_ATTN, 3, KV_D_FF_EXP, KV_D_EMBD, KV_D_EXPERT, 0,
          KV_ROLE_EXPERT, KV_MAT(KV_GPTOSS_GAIN_DOWN)),
    KV_TD(KV_T_FFN_DOWN_EXPS_BIAS, KV_EXPERT_STEM_DOWN ".bias", KV_BLK_ATTN, 2, KV_D_EMBD, KV_D_EXPERT, KV_D_1,
          KV_TF_F32, KV_ROLE_EXPERT_BIAS, KV_VEC(0.0f, KV_GPTOSS_EXP_BIAS_STD)),
    KV_TD(KV_T_OUTPUT_NORM, "output_norm.weight", 0, 1, KV_D_EMBD, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_NORM,
          KV_VEC(1.0f, KV_INIT_NORM_STD)),
    /* llama.cpp requires output.weight for gpt-oss (never tied) */
    KV_TD(KV_T_OUTPUT, "output.weight", 0, 2, KV_D_EMBD, KV_D_VOCAB, KV_D_1, KV_TF_VOCAB_ROWS, KV_ROLE_LM_HEAD,
          KV_MAT(KV_INIT_GAIN_OUT)),
};

/* llama.cpp reads neither expert_weights_norm nor expert_weights_scale for
 * gpt-oss: the common keys' values are read and then set aside (check). */
static const kv_hparam_key kv_gptoss_keys[] = {
    KV_ARCH_COMMON_KEYS_NORM(0),
    {"feed_forward_length", KV_KEY_U32, KV_HP_OFF(n_ff), false, 1, KV_MAX_FF, 0},
    {"attention.sliding_window", KV_KEY_U32, KV_HP_OFF(n_swa), true, 1, KV_MAX_CTX, 0},
    {"attention.sliding_window_pattern", KV_KEY_U32, KV_HP_OFF(swa_pattern), false, 1, KV_MAX_LAYERS, 2},
    /* a different base for the sliding blocks is not computed */
    {"rope.freq_base_swa", KV_KEY_ABSENT, 0, false, 0, 0, 0},
    /* YaRN (rope.scaling.type = yarn, read by the check): what llama.cpp's
     * loader reads for every architecture; beta_fast/slow keep its defaults */
    {"rope.scaling.original_context_length", KV_KEY_U32, KV_HP_OFF(n_ctx_orig_yarn), false, 1, KV_MAX_CTX, 0},
    {"rope.scaling.attn_factor", KV_KEY_F32, KV_HP_OFF(yarn_attn_factor), false, 0, 0, 1.0f},
};

static uint32_t kv_gptoss_block_kind(const kv_hparams *hp, uint32_t il) {
    (void)hp;
    (void)il;
    return KV_BLK_ATTN;
}

static int kv_gptoss_check(kv_hparams *hp, const kv_gguf *g, kv_diag *d) {
    const char *an = hp->arch_name;
    if (hp->n_rot != hp->head_dim) /* RoPE over the whole head */
        return kv_fail(d, KV_EUNSUPPORTED, "model: rope.dimension_count %u != head dim %u", hp->n_rot, hp->head_dim);
    /* RoPE scaling: none, linear (rope.scaling.factor) or yarn, as llama.cpp's
     * context derives it: ext_factor 1, beta_fast 32, beta_slow 1, and the
     * rotation's magnitude attn_factor * (1 + 0.1 ln factor) where
     * attn_factor = mscale(factor) / (1 + 0.1 ln factor) * rope.scaling.attn_factor */
    char key[128];
    snprintf(key, sizeof key, "%s.rope.scaling.type", an);
    kv_str st;
    if (!kv_gguf_get_str(g, key, &st, NULL)) {
        if (st.len == 4 && !memcmp(st.ptr, "yarn", 4))
            hp->rope_yarn = true;
        else if (!(st.len == 4 && !memcmp(st.ptr, "none", 4)) && !(st.len == 6 && !memcmp(st.ptr, "linear", 6)))
            return kv_fail(d, KV_EUNSUPPORTED, "model: %s = '%.*s' is not supported (none, linear, yarn)", key,
                           (int)(st.len > 32 ? 32 : st.len), st.ptr);
    }
    if (!(hp->yarn_attn_factor > 0.0f))
        return kv_fail(d, KV_EFORMAT, "model: %s.rope.scaling.attn_factor must be > 0", an);
    if (hp->rope_yarn) {
        if (!hp->n_ctx_orig_yarn) hp->n_ctx_orig_yarn = hp->n_ctx_train;
        hp->yarn_ext_factor = 1.0f;
        hp->yarn_beta_fast = 32.0f;
        hp->yarn_beta_slow = 1.0f;
        const float factor = 1.0f / hp->rope_freq_scale; /* check_common turned the factor into its inverse */
        const float ms = factor <= 1.0f ? 1.0f : 0.1f * logf(factor) + 1.0f;
        hp->yarn_attn_factor = ms * (1.0f / (1.0f + 0.1f * logf(factor))) * hp->yarn_attn_factor;
    }
    hp->expert_weights_norm = false;
    hp->expert_weights_scale = 0.0f;
    return 0;
}

const kv_arch_table kv_arch_gptoss = {
    .id = KV_ARCH_GPTOSS,
    .name = "gpt-oss",
    .tensors = kv_gptoss_tensors,
    .n_tensors = sizeof kv_gptoss_tensors / sizeof kv_gptoss_tensors[0],
    .keys = kv_gptoss_keys,
    .n_keys = sizeof kv_gptoss_keys / sizeof kv_gptoss_keys[0],
    .block_kind = kv_gptoss_block_kind,
    .check = kv_gptoss_check,
    .blocks = kv_gptoss_blocks, /* src/model/gptoss.c */
    .hooks = {KV_ATTN_GQA, KV_ROUTER_TOPK_SOFTMAX, KV_ACT_SWIGLU_CLAMP,
              KV_AH_EXPERT_BIAS | KV_AH_ROUTER_BIAS | KV_AH_SINKS | KV_AH_SWA},
};
