/* Shared by the architecture tables (the files of src/arch/): the hyper-parameter keys
 * every MoE architecture has, gen-model's weight scales, and the table
 * entry macros. */
#ifndef KVASIR_ARCH_INTERNAL_H
#define KVASIR_ARCH_INTERNAL_H

#include <stddef.h>

#include "kvasir/arch.h"

/* gen-model's weights: std = gain / sqrt(fan_in) for the matrices, chosen so
 * that every matrix product sees unit-RMS inputs, each layer adds O(1) to
 * the residual stream, the router's logits spread by ~2 (clear top-k) and
 * the LM head gives logits of std ~3 (see src/gen/gen_model.c). */
#define KV_INIT_GAIN_EMBD 3.0f   /* token_embd: tied logits std ~3 */
#define KV_INIT_GAIN_OUT 3.0f    /* output: logits std ~3 */
#define KV_INIT_GAIN_QKV 1.0f    /* q/k/v (and other input projections) of unit RMS */
#define KV_INIT_GAIN_WO 2.5f     /* attention output adds ~2.5 RMS */
#define KV_INIT_GAIN_ROUTER 2.0f /* router logits std ~2 */
#define KV_INIT_GAIN_UPGATE 1.0f /* expert gate/up of unit RMS */
#define KV_INIT_GAIN_DOWN 5.0f   /* expert mixture adds ~2.5 RMS */
#define KV_INIT_NORM_STD 0.1f    /* RMSNorm weights: 1 +- 0.1 */
#define KV_INIT_QKNORM_MEAN 1.5f /* Q/K norm weights: attention scores std ~2 */
#define KV_INIT_QKNORM_STD 0.2f
#define KV_INIT_GAIN_SSM_OUT 2.5f /* delta-net output adds ~2.5 RMS */
#define KV_INIT_CONV_STD 0.6f     /* conv taps: output of ~unit RMS */
#define KV_INIT_SSM_A_MEAN -0.6f  /* -exp(A_log): negative (decay < 1) */
#define KV_INIT_SSM_A_STD 0.15f
#define KV_INIT_DT_MEAN -1.0f     /* dt bias: decay exp(g) mostly 0.5 .. 0.9 */
#define KV_INIT_DT_STD 0.5f
#define KV_INIT_GAIN_SHEXP_DOWN 2.5f

/* A matrix drawn with gain g over its fan-in; a vector/norm of mean m, std s. */
#define KV_MAT(g) 0.0f, 0.0f, (g)
#define KV_VEC(m, s) (m), (s), 0.0f

/* One tensor entry: kind, name, blocks, dims (innermost first), flags, role, init. */
#define KV_TD(kind, name, blocks, nd, d0, d1, d2, flags, role, init) \
    {kind, name, blocks, nd, {d0, d1, d2}, flags, role, init}

#define KV_HP_OFF(field) offsetof(kv_hparams, field)

/* The keys of every MoE architecture, in reading order. Defaults derived
 * from other values (head_count_kv, key_length, value_length,
 * rope.dimension_count, rope.scaling.factor) are filled by
 * kv_arch_check_common. */
#define KV_ARCH_COMMON_KEYS_NORM(norm_def)                                                               \
    {"block_count", KV_KEY_U32, KV_HP_OFF(n_layer), true, 1, KV_MAX_LAYERS, 0},                          \
    {"embedding_length", KV_KEY_U32, KV_HP_OFF(n_embd), true, 1, KV_MAX_EMBD, 0},                        \
    {"attention.head_count", KV_KEY_U32, KV_HP_OFF(n_head), true, 1, KV_MAX_HEADS, 0},                   \
    {"context_length", KV_KEY_U32, KV_HP_OFF(n_ctx_train), true, 1, KV_MAX_CTX, 0},                      \
    {"expert_count", KV_KEY_U32, KV_HP_OFF(n_expert), true, 1, KV_MAX_EXPERTS, 0},                       \
    {"expert_used_count", KV_KEY_U32, KV_HP_OFF(n_expert_used), true, 1, KV_MAX_EXPERTS_USED, 0},        \
    {"expert_feed_forward_length", KV_KEY_U32, KV_HP_OFF(n_ff_exp), true, 1, KV_MAX_FF, 0},              \
    {"attention.head_count_kv", KV_KEY_U32, KV_HP_OFF(n_head_kv), false, 1, KV_MAX_HEADS, 0},            \
    {"attention.key_length", KV_KEY_U32, KV_HP_OFF(head_dim), false, 1, KV_MAX_HEAD_DIM, 0},             \
    {"attention.value_length", KV_KEY_U32, KV_HP_OFF(head_dim_v), false, 1, KV_MAX_HEAD_DIM, 0},         \
    {"rope.dimension_count", KV_KEY_U32, KV_HP_OFF(n_rot), false, 1, KV_MAX_HEAD_DIM, 0},                \
    {"attention.layer_norm_rms_epsilon", KV_KEY_F32, KV_HP_OFF(rms_eps), true, 0, 0, 0},                 \
    {"rope.freq_base", KV_KEY_F32, KV_HP_OFF(rope_freq_base), false, 0, 0, 10000.0f},                    \
    {"rope.scaling.factor", KV_KEY_F32, KV_HP_OFF(rope_freq_scale), false, 0, 0, 0},                     \
    {"expert_weights_norm", KV_KEY_BOOL, KV_HP_OFF(expert_weights_norm), false, 0, 0, norm_def},        \
    {"expert_weights_scale", KV_KEY_F32, KV_HP_OFF(expert_weights_scale), false, 0, 0, 0}
/* qwen3moe and qwen35moe always renormalize the top-k unless told */
#define KV_ARCH_COMMON_KEYS KV_ARCH_COMMON_KEYS_NORM(1)

/* Derived defaults and the checks every architecture shares (run by
 * kv_arch_read_hparams before the table's own check). */
int kv_arch_check_common(kv_hparams *hp, kv_diag *d);

extern const kv_arch_table kv_arch_qwen3moe;
extern const kv_arch_table kv_arch_qwen35moe;
extern const kv_arch_table kv_arch_deepseek2;

#endif
