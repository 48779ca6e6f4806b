/* qwen35moe (Qwen3.5 MoE): a hybrid of gated delta nets (linear attention,
 * "recurrent" blocks) and gated full attention (every
 * full_attention_interval-th block), each followed by routed experts plus a
 * gated shared expert; MTP (nextn) blocks follow the trunk. Names, shapes
 * and keys as llama.cpp's qwen35moe loader (llama-arch.cpp,
 * llama-model.cpp) has them; the forward pass is src/model/qwen35.c. */
#include <stdio.h>
#include <string.h>

#include "arch/arch_internal.h"

#define REC KV_BLK_RECURRENT
#define ATT (KV_BLK_ATTN | KV_BLK_MTP) /* MTP blocks are full attention */

static const kv_tensor_desc kv_q35_tensors[] = {
    KV_TD(KV_T_TOKEN_EMBD, "token_embd.weight", 0, 2, KV_D_EMBD, KV_D_VOCAB, KV_D_1, KV_TF_VOCAB_ROWS,
          KV_ROLE_EMBD, KV_MAT(KV_INIT_GAIN_EMBD)),
    KV_TD(KV_T_ATTN_NORM, "attn_norm.weight", KV_BLK_ALL, 1, KV_D_EMBD, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_NORM,
          KV_VEC(1.0f, KV_INIT_NORM_STD)),
    KV_TD(KV_T_POST_NORM, "post_attention_norm.weight", KV_BLK_ALL, 1, KV_D_EMBD, KV_D_1, KV_D_1, KV_TF_F32,
          KV_ROLE_NORM, KV_VEC(1.0f, KV_INIT_NORM_STD)),
    /* gated delta net */
    KV_TD(KV_T_ATTN_QKV, "attn_qkv.weight", REC, 2, KV_D_EMBD, KV_D_SSM_CONV_DIM, KV_D_1, 0, KV_ROLE_LINEAR,
          KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_ATTN_GATE, "attn_gate.weight", REC, 2, KV_D_EMBD, KV_D_SSM_INNER, KV_D_1, 0, KV_ROLE_LINEAR,
          KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_SSM_CONV1D, "ssm_conv1d.weight", REC, 2, KV_D_SSM_CONV, KV_D_SSM_CONV_DIM, KV_D_1, KV_TF_F32,
          KV_ROLE_LINEAR, KV_VEC(0.0f, KV_INIT_CONV_STD)),
    KV_TD(KV_T_SSM_DT, "ssm_dt.bias", REC, 1, KV_D_SSM_HEADS, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_LINEAR,
          KV_VEC(KV_INIT_DT_MEAN, KV_INIT_DT_STD)),
    KV_TD(KV_T_SSM_A, "ssm_a", REC, 1, KV_D_SSM_HEADS, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_LINEAR,
          KV_VEC(KV_INIT_SSM_A_MEAN, KV_INIT_SSM_A_STD)),
    KV_TD(KV_T_SSM_BETA, "ssm_beta.weight", REC, 2, KV_D_EMBD, KV_D_SSM_HEADS, KV_D_1, 0, KV_ROLE_LINEAR,
          KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_SSM_ALPHA, "ssm_alpha.weight", REC, 2, KV_D_EMBD, KV_D_SSM_HEADS, KV_D_1, 0, KV_ROLE_LINEAR,
          KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_SSM_NORM, "ssm_norm.weight", REC, 1, KV_D_SSM_STATE, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_LINEAR,
          KV_VEC(1.0f, KV_INIT_NORM_STD)),
    KV_TD(KV_T_SSM_OUT, "ssm_out.weight", REC, 2, KV_D_SSM_INNER, KV_D_EMBD, KV_D_1, 0, KV_ROLE_LINEAR,
          KV_MAT(KV_INIT_GAIN_SSM_OUT)),
    /* gated full attention: attn_q holds per head hd query rows, then hd gate rows */
    KV_TD(KV_T_ATTN_Q, "attn_q.weight", ATT, 2, KV_D_EMBD, KV_D_Q_X2, KV_D_1, 0, KV_ROLE_ATTN,
          KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_ATTN_K, "attn_k.weight", ATT, 2, KV_D_EMBD, KV_D_KV, KV_D_1, 0, KV_ROLE_ATTN,
          KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_ATTN_V, "attn_v.weight", ATT, 2, KV_D_EMBD, KV_D_KV, KV_D_1, 0, KV_ROLE_ATTN,
          KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_ATTN_OUT, "attn_output.weight", ATT, 2, KV_D_Q, KV_D_EMBD, KV_D_1, 0, KV_ROLE_ATTN,
          KV_MAT(KV_INIT_GAIN_WO)),
    KV_TD(KV_T_ATTN_Q_NORM, "attn_q_norm.weight", ATT, 1, KV_D_HEAD_DIM, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_NORM,
          KV_VEC(KV_INIT_QKNORM_MEAN, KV_INIT_QKNORM_STD)),
    KV_TD(KV_T_ATTN_K_NORM, "attn_k_norm.weight", ATT, 1, KV_D_HEAD_DIM, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_NORM,
          KV_VEC(KV_INIT_QKNORM_MEAN, KV_INIT_QKNORM_STD)),
    /* routed experts and the gated shared expert */
    KV_TD(KV_T_FFN_GATE_INP, "ffn_gate_inp.weight", KV_BLK_ALL, 2, KV_D_EMBD, KV_D_EXPERT, KV_D_1, KV_TF_KEEP_F32,
          KV_ROLE_ROUTER, KV_MAT(KV_INIT_GAIN_ROUTER)),
    KV_TD(KV_T_FFN_GATE_EXPS, KV_EXPERT_STEM_GATE ".weight", KV_BLK_ALL, 3, KV_D_EMBD, KV_D_FF_EXP, KV_D_EXPERT, 0,
          KV_ROLE_EXPERT, KV_MAT(KV_INIT_GAIN_UPGATE)),
    KV_TD(KV_T_FFN_UP_EXPS, KV_EXPERT_STEM_UP ".weight", KV_BLK_ALL, 3, KV_D_EMBD, KV_D_FF_EXP, KV_D_EXPERT, 0,
          KV_ROLE_EXPERT, KV_MAT(KV_INIT_GAIN_UPGATE)),
    KV_TD(KV_T_FFN_DOWN_EXPS, KV_EXPERT_STEM_DOWN ".weight", KV_BLK_ALL, 3, KV_D_FF_EXP, KV_D_EMBD, KV_D_EXPERT, 0,
          KV_ROLE_EXPERT, KV_MAT(KV_INIT_GAIN_DOWN)),
    KV_TD(KV_T_FFN_GATE_INP_SHEXP, "ffn_gate_inp_shexp.weight", KV_BLK_ALL, 1, KV_D_EMBD, KV_D_1, KV_D_1,
          KV_TF_KEEP_F32, KV_ROLE_SHEXP, KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_FFN_GATE_SHEXP, "ffn_gate_shexp.weight", KV_BLK_ALL, 2, KV_D_EMBD, KV_D_FF_SHEXP, KV_D_1, 0,
          KV_ROLE_SHEXP, KV_MAT(KV_INIT_GAIN_UPGATE)),
    KV_TD(KV_T_FFN_UP_SHEXP, "ffn_up_shexp.weight", KV_BLK_ALL, 2, KV_D_EMBD, KV_D_FF_SHEXP, KV_D_1, 0,
          KV_ROLE_SHEXP, KV_MAT(KV_INIT_GAIN_UPGATE)),
    KV_TD(KV_T_FFN_DOWN_SHEXP, "ffn_down_shexp.weight", KV_BLK_ALL, 2, KV_D_FF_SHEXP, KV_D_EMBD, KV_D_1, 0,
          KV_ROLE_SHEXP, KV_MAT(KV_INIT_GAIN_SHEXP_DOWN)),
    /* MTP glue (loaded for speculative decoding, not run) */
    KV_TD(KV_T_NEXTN_EH_PROJ, "nextn.eh_proj.weight", KV_BLK_MTP, 2, KV_D_EMBD_X2, KV_D_EMBD, KV_D_1, 0,
          KV_ROLE_MTP, KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_NEXTN_ENORM, "nextn.enorm.weight", KV_BLK_MTP, 1, KV_D_EMBD, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_MTP,
          KV_VEC(1.0f, KV_INIT_NORM_STD)),
    KV_TD(KV_T_NEXTN_HNORM, "nextn.hnorm.weight", KV_BLK_MTP, 1, KV_D_EMBD, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_MTP,
          KV_VEC(1.0f, KV_INIT_NORM_STD)),
    KV_TD(KV_T_NEXTN_SHARED_HEAD_NORM, "nextn.shared_head_norm.weight", KV_BLK_MTP, 1, KV_D_EMBD, KV_D_1, KV_D_1,
          KV_TF_F32 | KV_TF_OPTIONAL, KV_ROLE_MTP, KV_VEC(1.0f, KV_INIT_NORM_STD)),
    KV_TD(KV_T_OUTPUT_NORM, "output_norm.weight", 0, 1, KV_D_EMBD, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_NORM,
          KV_VEC(1.0f, KV_INIT_NORM_STD)),
    KV_TD(KV_T_OUTPUT, "output.weight", 0, 2, KV_D_EMBD, KV_D_VOCAB, KV_D_1, KV_TF_TIED | KV_TF_VOCAB_ROWS,
          KV_ROLE_LM_HEAD, KV_MAT(KV_INIT_GAIN_OUT)),
};

static const kv_hparam_key kv_q35_keys[] = {
    KV_ARCH_COMMON_KEYS,
    /* block_count counts the MTP blocks too; the check bounds this by it */
    {"nextn_predict_layers", KV_KEY_U32, KV_HP_OFF(n_layer_nextn), false, 0, KV_MAX_LAYERS, 0},
    {"full_attention_interval", KV_KEY_U32, KV_HP_OFF(full_attn_interval), false, 1, KV_MAX_LAYERS,
     4}, /* llama.cpp's default */
    {"ssm.conv_kernel", KV_KEY_U32, KV_HP_OFF(ssm_d_conv), true, 2, 64, 0},
    {"ssm.state_size", KV_KEY_U32, KV_HP_OFF(ssm_d_state), true, 1, KV_MAX_HEAD_DIM, 0},
    {"ssm.group_count", KV_KEY_U32, KV_HP_OFF(ssm_n_group), true, 1, KV_MAX_HEADS, 0},
    {"ssm.time_step_rank", KV_KEY_U32, KV_HP_OFF(ssm_dt_rank), true, 1, KV_MAX_HEADS, 0},
    {"ssm.inner_size", KV_KEY_U32, KV_HP_OFF(ssm_d_inner), true, 1, KV_MAX_EMBD, 0},
    {"attention.recurrent_layers", KV_KEY_ABSENT, 0, false, 0, 0, 0}, /* only full_attention_interval */
    {"expert_shared_feed_forward_length", KV_KEY_U32, KV_HP_OFF(n_ff_shexp), false, 1, KV_MAX_FF, 0},
    {"feed_forward_length", KV_KEY_U32, KV_HP_OFF(n_ff), false, 1, KV_MAX_FF, 0},
    {"rope.dimension_sections", KV_KEY_I32_ARR4, KV_HP_OFF(rope_sections), true, 0, 0, 0},
};

static uint32_t kv_q35_block_kind(const kv_hparams *hp, uint32_t il) {
    if (il >= hp->n_layer) return KV_BLK_MTP;
    return (il + 1) % hp->full_attn_interval != 0 ? KV_BLK_RECURRENT : KV_BLK_ATTN;
}

static int kv_q35_check(kv_hparams *hp, const kv_gguf *g, kv_diag *d) {
    (void)g;
    const char *an = hp->arch_name;
    if (hp->n_layer_nextn > hp->n_layer - 1)
        return kv_fail(d, KV_EFORMAT, "model: %s.nextn_predict_layers = %u is out of range [%u, %u]", an,
                       hp->n_layer_nextn, 0u, hp->n_layer - 1);
    hp->n_layer -= hp->n_layer_nextn; /* the trunk */
    if (hp->ssm_d_inner != hp->ssm_d_state * hp->ssm_dt_rank)
        return kv_fail(d, KV_EUNSUPPORTED, "model: ssm.inner_size %u != state_size %u x time_step_rank %u",
                       hp->ssm_d_inner, hp->ssm_d_state, hp->ssm_dt_rank);
    if (hp->ssm_dt_rank % hp->ssm_n_group)
        return kv_fail(d, KV_EFORMAT, "model: ssm.time_step_rank %u is not a multiple of ssm.group_count %u",
                       hp->ssm_dt_rank, hp->ssm_n_group);
    if (hp->n_rot > hp->head_dim || hp->n_rot % 2)
        return kv_fail(d, KV_EFORMAT, "model: rope.dimension_count %u must be even and <= head dim %u",
                       hp->n_rot, hp->head_dim);
    /* shared expert size; llama.cpp falls back to feed_forward_length */
    if (!hp->n_ff_shexp) hp->n_ff_shexp = hp->n_ff;
    if (!hp->n_ff_shexp)
        return kv_fail(d, KV_EFORMAT, "model: missing metadata key '%s.expert_shared_feed_forward_length'", an);
    int64_t sum = 0;
    for (int i = 0; i < 4; i++) {
        if (hp->rope_sections[i] < 0 || hp->rope_sections[i] > (int32_t)KV_MAX_HEAD_DIM)
            return kv_fail(d, KV_EFORMAT, "model: %s.rope.dimension_sections[%d] = %d out of range", an, i,
                           hp->rope_sections[i]);
        sum += hp->rope_sections[i];
    }
    if (sum < 1 || sum > hp->head_dim)
        return kv_fail(d, KV_EFORMAT, "model: %s.rope.dimension_sections sum to %lld, expected 1..%u (head dim)", an,
                       (long long)sum, hp->head_dim);
    return 0;
}

const kv_arch_table kv_arch_qwen35moe = {
    .id = KV_ARCH_QWEN35MOE,
    .name = "qwen35moe",
    .tensors = kv_q35_tensors,
    .n_tensors = sizeof kv_q35_tensors / sizeof kv_q35_tensors[0],
    .keys = kv_q35_keys,
    .n_keys = sizeof kv_q35_keys / sizeof kv_q35_keys[0],
    .block_kind = kv_q35_block_kind,
    .check = kv_q35_check,
    .blocks = kv_q35_blocks,
    .hooks = {KV_ATTN_GATED, KV_ROUTER_SOFTMAX, KV_ACT_SWIGLU, KV_AH_SHEXP | KV_AH_SHEXP_GATE | KV_AH_RECURRENT},
    .state = &kv_q35_state_ops,
};
