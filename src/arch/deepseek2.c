/* deepseek2 (DeepSeek-V3, R1, Kimi K2): multi-head latent attention (MLA)
 * over a compressed KV cache, a few leading blocks with a dense FFN, then
 * routed experts (sigmoid scores, a selection bias, group-limited top-k, a
 * routed scaling factor) plus shared experts, and YaRN RoPE. Names, shapes
 * and keys as llama.cpp's deepseek2 loader has them (src/models/deepseek2.cpp,
 * llama-arch.cpp, llama-model.cpp, convert_hf_to_gguf.py's DeepseekV2/V3):
 * attn_kv_b is split into attn_k_b and attn_v_b (what current GGUFs hold;
 * files with the legacy joint attn_kv_b, which lack key_length_mla, are
 * refused). The q_lora_rank path (attn_q_a, attn_q_a_norm, attn_q_b) is
 * required: the "lite" models with one attn_q (DeepSeek-V2-Lite) are not
 * supported. The forward pass is src/model/deepseek2.c. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "arch/arch_internal.h"

#define DNS KV_BLK_DENSE
#define MOE KV_BLK_ATTN
#define ALLB (KV_BLK_DENSE | KV_BLK_ATTN)

static const kv_tensor_desc kv_ds2_tensors[] = {
    KV_TD(KV_T_TOKEN_EMBD, "token_embd.weight", 0, 2, KV_D_EMBD, KV_D_VOCAB, KV_D_1, KV_TF_VOCAB_ROWS,
          KV_ROLE_EMBD, KV_MAT(KV_INIT_GAIN_EMBD)),
    KV_TD(KV_T_ATTN_NORM, "attn_norm.weight", ALLB, 1, KV_D_EMBD, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_NORM,
          KV_VEC(1.0f, KV_INIT_NORM_STD)),
    KV_TD(KV_T_ATTN_Q_A_NORM, "attn_q_a_norm.weight", ALLB, 1, KV_D_Q_LORA, KV_D_1, KV_D_1, KV_TF_F32,
          KV_ROLE_NORM, KV_VEC(1.0f, KV_INIT_NORM_STD)),
    KV_TD(KV_T_ATTN_KV_A_NORM, "attn_kv_a_norm.weight", ALLB, 1, KV_D_KV_LORA, KV_D_1, KV_D_1, KV_TF_F32,
          KV_ROLE_NORM, KV_VEC(1.0f, KV_INIT_NORM_STD)),
    KV_TD(KV_T_ATTN_Q_A, "attn_q_a.weight", ALLB, 2, KV_D_EMBD, KV_D_Q_LORA, KV_D_1, 0, KV_ROLE_ATTN,
          KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_ATTN_Q_B, "attn_q_b.weight", ALLB, 2, KV_D_Q_LORA, KV_D_Q_MLA, KV_D_1, 0, KV_ROLE_ATTN,
          KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_ATTN_KV_A_MQA, "attn_kv_a_mqa.weight", ALLB, 2, KV_D_EMBD, KV_D_KV_A, KV_D_1, 0, KV_ROLE_ATTN,
          KV_MAT(KV_INIT_GAIN_QKV)),
    /* per head (outermost): [qk_nope] -> [kv_lora_rank] and [kv_lora_rank] -> [v_mla] */
    KV_TD(KV_T_ATTN_K_B, "attn_k_b.weight", ALLB, 3, KV_D_QK_NOPE, KV_D_KV_LORA, KV_D_HEADS, 0, KV_ROLE_ATTN,
          KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_ATTN_V_B, "attn_v_b.weight", ALLB, 3, KV_D_KV_LORA, KV_D_V_MLA, KV_D_HEADS, 0, KV_ROLE_ATTN,
          KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_ATTN_OUT, "attn_output.weight", ALLB, 2, KV_D_O_MLA, KV_D_EMBD, KV_D_1, 0, KV_ROLE_ATTN,
          KV_MAT(KV_INIT_GAIN_WO)),
    KV_TD(KV_T_FFN_NORM, "ffn_norm.weight", ALLB, 1, KV_D_EMBD, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_NORM,
          KV_VEC(1.0f, KV_INIT_NORM_STD)),
    /* the leading blocks' dense FFN */
    KV_TD(KV_T_FFN_GATE, "ffn_gate.weight", DNS, 2, KV_D_EMBD, KV_D_FF, KV_D_1, 0, KV_ROLE_FFN,
          KV_MAT(KV_INIT_GAIN_UPGATE)),
    KV_TD(KV_T_FFN_DOWN, "ffn_down.weight", DNS, 2, KV_D_FF, KV_D_EMBD, KV_D_1, 0, KV_ROLE_FFN,
          KV_MAT(KV_INIT_GAIN_SHEXP_DOWN)),
    KV_TD(KV_T_FFN_UP, "ffn_up.weight", DNS, 2, KV_D_EMBD, KV_D_FF, KV_D_1, 0, KV_ROLE_FFN,
          KV_MAT(KV_INIT_GAIN_UPGATE)),
    /* router, its selection bias, routed and shared experts */
    KV_TD(KV_T_FFN_GATE_INP, "ffn_gate_inp.weight", MOE, 2, KV_D_EMBD, KV_D_EXPERT, KV_D_1, KV_TF_KEEP_F32,
          KV_ROLE_ROUTER, KV_MAT(KV_INIT_GAIN_ROUTER)),
    KV_TD(KV_T_FFN_EXP_PROBS_B, "exp_probs_b.bias", MOE, 1, KV_D_EXPERT, KV_D_1, KV_D_1,
          KV_TF_F32 | KV_TF_OPTIONAL, KV_ROLE_ROUTER, KV_VEC(0.0f, 0.05f)),
    KV_TD(KV_T_FFN_GATE_EXPS, KV_EXPERT_STEM_GATE ".weight", MOE, 3, KV_D_EMBD, KV_D_FF_EXP, KV_D_EXPERT, 0,
          KV_ROLE_EXPERT, KV_MAT(KV_INIT_GAIN_UPGATE)),
    KV_TD(KV_T_FFN_DOWN_EXPS, KV_EXPERT_STEM_DOWN ".weight", MOE, 3, KV_D_FF_EXP, KV_D_EMBD, KV_D_EXPERT, 0,
          KV_ROLE_EXPERT, KV_MAT(KV_INIT_GAIN_DOWN)),
    KV_TD(KV_T_FFN_UP_EXPS, KV_EXPERT_STEM_UP ".weight", MOE, 3, KV_D_EMBD, KV_D_FF_EXP, KV_D_EXPERT, 0,
          KV_ROLE_EXPERT, KV_MAT(KV_INIT_GAIN_UPGATE)),
    KV_TD(KV_T_FFN_GATE_SHEXP, "ffn_gate_shexp.weight", MOE, 2, KV_D_EMBD, KV_D_FF_SHEXP, KV_D_1, 0,
          KV_ROLE_SHEXP, KV_MAT(KV_INIT_GAIN_UPGATE)),
    KV_TD(KV_T_FFN_DOWN_SHEXP, "ffn_down_shexp.weight", MOE, 2, KV_D_FF_SHEXP, KV_D_EMBD, KV_D_1, 0,
          KV_ROLE_SHEXP, KV_MAT(KV_INIT_GAIN_SHEXP_DOWN)),
    KV_TD(KV_T_FFN_UP_SHEXP, "ffn_up_shexp.weight", MOE, 2, KV_D_EMBD, KV_D_FF_SHEXP, KV_D_1, 0,
          KV_ROLE_SHEXP, KV_MAT(KV_INIT_GAIN_UPGATE)),
    KV_TD(KV_T_OUTPUT_NORM, "output_norm.weight", 0, 1, KV_D_EMBD, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_NORM,
          KV_VEC(1.0f, KV_INIT_NORM_STD)),
    KV_TD(KV_T_OUTPUT, "output.weight", 0, 2, KV_D_EMBD, KV_D_VOCAB, KV_D_1, KV_TF_TIED | KV_TF_VOCAB_ROWS,
          KV_ROLE_LM_HEAD, KV_MAT(KV_INIT_GAIN_OUT)),
};

static const kv_hparam_key kv_ds2_keys[] = {
    KV_ARCH_COMMON_KEYS_NORM(0), /* llama.cpp's deepseek2 renormalizes only when told */
    {"leading_dense_block_count", KV_KEY_U32, KV_HP_OFF(n_layer_dense_lead), false, 0, KV_MAX_LAYERS, 0},
    {"feed_forward_length", KV_KEY_U32, KV_HP_OFF(n_ff), false, 1, KV_MAX_FF, 0},
    {"attention.q_lora_rank", KV_KEY_U32, KV_HP_OFF(q_lora_rank), true, 1, KV_MAX_EMBD, 0},
    {"attention.kv_lora_rank", KV_KEY_U32, KV_HP_OFF(kv_lora_rank), true, 1, KV_MAX_HEAD_DIM, 0},
    {"attention.key_length_mla", KV_KEY_U32, KV_HP_OFF(head_dim_k_mla), false, 1, KV_MAX_HEAD_DIM, 0},
    {"attention.value_length_mla", KV_KEY_U32, KV_HP_OFF(head_dim_v_mla), false, 1, KV_MAX_HEAD_DIM, 0},
    {"expert_shared_count", KV_KEY_U32, KV_HP_OFF(n_expert_shared), true, 1, 64, 0},
    {"expert_gating_func", KV_KEY_U32, KV_HP_OFF(expert_gating_func), false, 0, 2, 0},
    {"expert_group_count", KV_KEY_U32, KV_HP_OFF(n_expert_groups), false, 0, KV_MAX_EXPERTS, 0},
    {"expert_group_used_count", KV_KEY_U32, KV_HP_OFF(n_group_used), false, 0, KV_MAX_EXPERTS, 0},
    {"rope.scaling.original_context_length", KV_KEY_U32, KV_HP_OFF(n_ctx_orig_yarn), false, 1, KV_MAX_CTX, 0},
    {"rope.scaling.yarn_log_multiplier", KV_KEY_F32, KV_HP_OFF(rope_yarn_log_mul), false, 0, 0, 0},
    {"rope.scaling.attn_factor", KV_KEY_F32, KV_HP_OFF(yarn_attn_factor), false, 0, 0, 1.0f},
    {"rope.scaling.type", KV_KEY_IGNORED, 0, false, 0, 0, 0}, /* a string: the check reads it */
    {"vocab_size", KV_KEY_IGNORED, 0, false, 0, 0, 0},        /* token_embd's rows give it */
    /* written by the converter from the config (Kimi K2: beta_fast 1), ignored
     * by llama.cpp's deepseek2 (beta_fast 32, beta_slow 1 always), so here */
    {"rope.scaling.yarn_beta_fast", KV_KEY_IGNORED, 0, false, 0, 0, 0},
    {"rope.scaling.yarn_beta_slow", KV_KEY_IGNORED, 0, false, 0, 0, 0},
    {"rope.scaling.yarn_ext_factor", KV_KEY_IGNORED, 0, false, 0, 0, 0},
    {"rope.scaling.yarn_attn_factor", KV_KEY_IGNORED, 0, false, 0, 0, 0},
    /* meanings kvasir does not compute */
    {"nextn_predict_layers", KV_KEY_ABSENT, 0, false, 0, 0, 0},
    {"attention.temperature_scale", KV_KEY_ABSENT, 0, false, 0, 0, 0},
};

static uint32_t kv_ds2_block_kind(const kv_hparams *hp, uint32_t il) {
    return il < hp->n_layer_dense_lead ? KV_BLK_DENSE : KV_BLK_ATTN;
}

/* YaRN's magnitude correction, as llama.cpp's context sets it up. */
static float kv_ds2_mscale(float scale, float mscale) {
    return scale <= 1.0f ? 1.0f : 0.1f * mscale * logf(scale) + 1.0f;
}

static int kv_ds2_check(kv_hparams *hp, const kv_gguf *g, kv_diag *d) {
    const char *an = hp->arch_name;
    char key[96];
    if (!hp->head_dim_k_mla || !hp->head_dim_v_mla)
        return kv_fail(d, KV_EUNSUPPORTED,
                       "model: %s.attention.key_length_mla / value_length_mla missing: a file with the joint "
                       "attn_kv_b (convert it again with a current llama.cpp: attn_k_b and attn_v_b)", an);
    if (hp->n_head_kv != 1 || hp->head_dim != hp->kv_lora_rank + hp->n_rot || hp->head_dim_v != hp->kv_lora_rank)
        return kv_fail(d, KV_EFORMAT,
                       "model: MLA needs head_count_kv 1, key_length = kv_lora_rank + rope.dimension_count (%u) "
                       "and value_length = kv_lora_rank (%u); the file has %u, %u, %u",
                       hp->kv_lora_rank + hp->n_rot, hp->kv_lora_rank, hp->n_head_kv, hp->head_dim, hp->head_dim_v);
    if (hp->n_rot % 2 || hp->head_dim_k_mla <= hp->n_rot)
        return kv_fail(d, KV_EFORMAT, "model: rope.dimension_count %u must be even and below key_length_mla %u",
                       hp->n_rot, hp->head_dim_k_mla);
    if (hp->n_layer_dense_lead > hp->n_layer)
        return kv_fail(d, KV_EFORMAT, "model: %s.leading_dense_block_count = %u exceeds block_count %u", an,
                       hp->n_layer_dense_lead, hp->n_layer);
    if (hp->n_layer_dense_lead && !hp->n_ff)
        return kv_fail(d, KV_EFORMAT, "model: missing metadata key '%s.feed_forward_length' (dense blocks)", an);
    if ((uint64_t)hp->n_ff_exp * hp->n_expert_shared > KV_MAX_FF)
        return kv_fail(d, KV_EFORMAT, "model: shared experts of %u x %u rows exceed %u", hp->n_expert_shared,
                       hp->n_ff_exp, KV_MAX_FF);
    hp->n_ff_shexp = hp->n_ff_exp * hp->n_expert_shared;
    /* expert_gating_func: absent (old V2 files) or 1 softmax, 2 sigmoid */
    hp->router = hp->expert_gating_func == 2 ? KV_ROUTER_SIGMOID : KV_ROUTER_SOFTMAX;
    if (hp->n_expert_groups > 1) {
        const uint32_t per = hp->n_expert / hp->n_expert_groups;
        if (hp->n_expert % hp->n_expert_groups || per < 2)
            return kv_fail(d, KV_EFORMAT, "model: %s.expert_group_count %u must divide expert_count %u in groups of 2 or more",
                           an, hp->n_expert_groups, hp->n_expert);
        if (hp->n_group_used < 1 || hp->n_group_used >= hp->n_expert_groups)
            return kv_fail(d, KV_EFORMAT, "model: %s.expert_group_used_count = %u is out of range [1, %u]", an,
                           hp->n_group_used, hp->n_expert_groups - 1);
        if (hp->n_expert_used > hp->n_group_used * per)
            return kv_fail(d, KV_EFORMAT, "model: expert_used_count %u exceeds the %u experts of %u groups",
                           hp->n_expert_used, hp->n_group_used * per, hp->n_group_used);
    }
    /* RoPE scaling: none, linear (the default) or yarn */
    snprintf(key, sizeof key, "%s.rope.scaling.type", an);
    kv_str st = {0};
    int rc = kv_gguf_get_str(g, key, &st, d);
    if (rc && rc != KV_ENOTFOUND) return rc;
    bool none = false;
    if (!rc) {
        if (st.len == 4 && !memcmp(st.ptr, "yarn", 4)) hp->rope_yarn = true;
        else if (st.len == 4 && !memcmp(st.ptr, "none", 4)) none = true;
        else if (!(st.len == 6 && !memcmp(st.ptr, "linear", 6)))
            return kv_fail(d, KV_EUNSUPPORTED, "model: %s = '%.*s' is not supported (none, linear, yarn)", key,
                           (int)(st.len < 32 ? st.len : 32), st.ptr);
    }
    if (none) hp->rope_freq_scale = 1.0f;
    if (!hp->n_ctx_orig_yarn) hp->n_ctx_orig_yarn = hp->n_ctx_train;
    hp->yarn_beta_fast = 32.0f;
    hp->yarn_beta_slow = 1.0f;
    if (!(hp->yarn_attn_factor > 0.0f))
        return kv_fail(d, KV_EFORMAT, "model: %s.rope.scaling.attn_factor must be > 0", an);
    /* the rotation's magnitude and the scores' scale, as llama.cpp derives
     * them: yarn_log_multiplier is written as 0.1 * mscale_all_dim */
    const float log_mul = hp->rope_yarn_log_mul / 0.1f;
    const float rope_attn_factor = hp->yarn_attn_factor; /* rope.scaling.attn_factor */
    float attn_factor = 1.0f;
    hp->yarn_ext_factor = hp->rope_yarn ? 1.0f : 0.0f;
    if (hp->yarn_ext_factor != 0.0f) {
        const float factor = 1.0f / hp->rope_freq_scale;
        if (log_mul != 0.0f) {
            const float mscale = log_mul != 1.0f ? log_mul : 1.0f;
            attn_factor = kv_ds2_mscale(factor, mscale) / kv_ds2_mscale(factor, log_mul);
        } else {
            attn_factor = kv_ds2_mscale(factor, 1.0f);
        }
        attn_factor *= 1.0f / (1.0f + 0.1f * logf(factor));
    }
    attn_factor *= rope_attn_factor;
    hp->yarn_attn_factor = attn_factor;
    const float inv = 1.0f / hp->rope_freq_scale;
    const float attn_factor_org = attn_factor * (1.0f + 0.1f * logf(inv));
    const float mscale = attn_factor_org * (1.0f + 0.1f * log_mul * logf(inv));
    hp->attn_scale = 1.0f * mscale * mscale / sqrtf((float)hp->head_dim_k_mla);
    if (!(hp->attn_scale > 0.0f && hp->attn_scale < 1e6f))
        return kv_fail(d, KV_EFORMAT, "model: the RoPE scaling keys give an attention scale of %g", hp->attn_scale);
    return 0;
}

const kv_arch_table kv_arch_deepseek2 = {
    .id = KV_ARCH_DEEPSEEK2,
    .name = "deepseek2",
    .tensors = kv_ds2_tensors,
    .n_tensors = sizeof kv_ds2_tensors / sizeof kv_ds2_tensors[0],
    .keys = kv_ds2_keys,
    .n_keys = sizeof kv_ds2_keys / sizeof kv_ds2_keys[0],
    .block_kind = kv_ds2_block_kind,
    .check = kv_ds2_check,
    .blocks = kv_ds2_blocks, /* src/model/deepseek2.c */
    .hooks = {KV_ATTN_MLA, KV_ROUTER_SIGMOID, KV_ACT_SWIGLU, KV_AH_SHEXP | KV_AH_DENSE_LEAD},
    .state = &kv_ds2_state_ops,
};
