/* qwen3moe (Qwen3 MoE): every block is grouped-query attention with per-head
 * Q/K RMSNorm and NeoX RoPE over the whole head, then a routed MoE (softmax
 * router, top-k, renormalized weights), as llama.cpp's qwen3moe
 * (src/models/qwen3moe.cpp, llama-arch.cpp). */
#include "arch/arch_internal.h"

static const kv_tensor_desc kv_q3_tensors[] = {
    KV_TD(KV_T_TOKEN_EMBD, "token_embd.weight", 0, 2, KV_D_EMBD, KV_D_VOCAB, KV_D_1, KV_TF_VOCAB_ROWS,
          KV_ROLE_EMBD, KV_MAT(KV_INIT_GAIN_EMBD)),
    KV_TD(KV_T_ATTN_NORM, "attn_norm.weight", KV_BLK_ALL, 1, KV_D_EMBD, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_NORM,
          KV_VEC(1.0f, KV_INIT_NORM_STD)),
    KV_TD(KV_T_ATTN_Q, "attn_q.weight", KV_BLK_ALL, 2, KV_D_EMBD, KV_D_Q, KV_D_1, 0, KV_ROLE_ATTN,
          KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_ATTN_K, "attn_k.weight", KV_BLK_ALL, 2, KV_D_EMBD, KV_D_KV, KV_D_1, 0, KV_ROLE_ATTN,
          KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_ATTN_V, "attn_v.weight", KV_BLK_ALL, 2, KV_D_EMBD, KV_D_KV, KV_D_1, 0, KV_ROLE_ATTN,
          KV_MAT(KV_INIT_GAIN_QKV)),
    KV_TD(KV_T_ATTN_OUT, "attn_output.weight", KV_BLK_ALL, 2, KV_D_Q, KV_D_EMBD, KV_D_1, 0, KV_ROLE_ATTN,
          KV_MAT(KV_INIT_GAIN_WO)),
    KV_TD(KV_T_ATTN_Q_NORM, "attn_q_norm.weight", KV_BLK_ALL, 1, KV_D_HEAD_DIM, KV_D_1, KV_D_1, KV_TF_F32,
          KV_ROLE_NORM, KV_VEC(KV_INIT_QKNORM_MEAN, KV_INIT_QKNORM_STD)),
    KV_TD(KV_T_ATTN_K_NORM, "attn_k_norm.weight", KV_BLK_ALL, 1, KV_D_HEAD_DIM, KV_D_1, KV_D_1, KV_TF_F32,
          KV_ROLE_NORM, KV_VEC(KV_INIT_QKNORM_MEAN, KV_INIT_QKNORM_STD)),
    KV_TD(KV_T_FFN_NORM, "ffn_norm.weight", KV_BLK_ALL, 1, KV_D_EMBD, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_NORM,
          KV_VEC(1.0f, KV_INIT_NORM_STD)),
    /* llama.cpp's quantizer never quantizes the router */
    KV_TD(KV_T_FFN_GATE_INP, "ffn_gate_inp.weight", KV_BLK_ALL, 2, KV_D_EMBD, KV_D_EXPERT, KV_D_1, KV_TF_KEEP_F32,
          KV_ROLE_ROUTER, KV_MAT(KV_INIT_GAIN_ROUTER)),
    KV_TD(KV_T_FFN_GATE_EXPS, KV_EXPERT_STEM_GATE ".weight", KV_BLK_ALL, 3, KV_D_EMBD, KV_D_FF_EXP, KV_D_EXPERT, 0,
          KV_ROLE_EXPERT, KV_MAT(KV_INIT_GAIN_UPGATE)),
    KV_TD(KV_T_FFN_UP_EXPS, KV_EXPERT_STEM_UP ".weight", KV_BLK_ALL, 3, KV_D_EMBD, KV_D_FF_EXP, KV_D_EXPERT, 0,
          KV_ROLE_EXPERT, KV_MAT(KV_INIT_GAIN_UPGATE)),
    KV_TD(KV_T_FFN_DOWN_EXPS, KV_EXPERT_STEM_DOWN ".weight", KV_BLK_ALL, 3, KV_D_FF_EXP, KV_D_EMBD, KV_D_EXPERT, 0,
          KV_ROLE_EXPERT, KV_MAT(KV_INIT_GAIN_DOWN)),
    KV_TD(KV_T_OUTPUT_NORM, "output_norm.weight", 0, 1, KV_D_EMBD, KV_D_1, KV_D_1, KV_TF_F32, KV_ROLE_NORM,
          KV_VEC(1.0f, KV_INIT_NORM_STD)),
    KV_TD(KV_T_OUTPUT, "output.weight", 0, 2, KV_D_EMBD, KV_D_VOCAB, KV_D_1, KV_TF_TIED | KV_TF_VOCAB_ROWS,
          KV_ROLE_LM_HEAD, KV_MAT(KV_INIT_GAIN_OUT)),
};

static const kv_hparam_key kv_q3_keys[] = {
    KV_ARCH_COMMON_KEYS,
    /* the HF config's dense FFN size, unused by the MoE graph */
    {"feed_forward_length", KV_KEY_U32, KV_HP_OFF(n_ff), false, 1, KV_MAX_FF, 0},
};

static uint32_t kv_q3_block_kind(const kv_hparams *hp, uint32_t il) {
    (void)hp;
    (void)il;
    return KV_BLK_ATTN;
}

static int kv_q3_check(kv_hparams *hp, const kv_gguf *g, kv_diag *d) {
    (void)g;
    if (hp->n_rot != hp->head_dim) /* RoPE over the whole head */
        return kv_fail(d, KV_EUNSUPPORTED, "model: rope.dimension_count %u != head dim %u", hp->n_rot,
                       hp->head_dim);
    return 0;
}

const kv_arch_table kv_arch_qwen3moe = {
    .id = KV_ARCH_QWEN3MOE,
    .name = "qwen3moe",
    .tensors = kv_q3_tensors,
    .n_tensors = sizeof kv_q3_tensors / sizeof kv_q3_tensors[0],
    .keys = kv_q3_keys,
    .n_keys = sizeof kv_q3_keys / sizeof kv_q3_keys[0],
    .block_kind = kv_q3_block_kind,
    .check = kv_q3_check,
    .blocks = kv_q3_blocks, /* src/model/forward.c */
    .hooks = {KV_ATTN_GQA, KV_ROUTER_SOFTMAX, KV_ACT_SWIGLU, 0},
};
