/* The architecture registry and what every table shares: dimensions in
 * hyper-parameters, tensor names, name matching, and reading the
 * hyper-parameter keys of a table from GGUF metadata.
 *
 * Invariants: names from a file are matched by length and bytes (never
 * assumed NUL-terminated); a block number parsed from a name is bounded
 * (KV_MAX_LAYERS) before it is returned; every key read is checked against
 * its table bounds before anything uses it. */
#include <stdio.h>
#include <string.h>

#include "arch/arch_internal.h"

static const kv_arch_table *const kv_arch_tables[KV_ARCH_COUNT] = {
    [KV_ARCH_QWEN3MOE] = &kv_arch_qwen3moe,
    [KV_ARCH_QWEN35MOE] = &kv_arch_qwen35moe,
    [KV_ARCH_DEEPSEEK2] = &kv_arch_deepseek2,
};

const kv_arch_table *kv_arch_get(enum kv_arch id) {
    return (unsigned)id < KV_ARCH_COUNT ? kv_arch_tables[id] : NULL;
}

const kv_arch_table *kv_arch_find(const char *name) {
    for (int i = 0; name && i < KV_ARCH_COUNT; i++)
        if (!strcmp(kv_arch_tables[i]->name, name)) return kv_arch_tables[i];
    return NULL;
}

const char *kv_arch_list(void) { return "qwen3moe, qwen35moe, deepseek2"; }

/* ---- dimensions and names ------------------------------------------------- */

int64_t kv_dim_value(enum kv_dim dim, const kv_hparams *hp) {
    switch (dim) {
    case KV_D_1: return 1;
    case KV_D_EMBD: return hp->n_embd;
    case KV_D_EMBD_X2: return 2 * (int64_t)hp->n_embd;
    case KV_D_VOCAB: return hp->n_vocab;
    case KV_D_HEAD_DIM: return hp->head_dim;
    case KV_D_Q: return (int64_t)hp->n_head * hp->head_dim;
    case KV_D_Q_X2: return 2 * (int64_t)hp->n_head * hp->head_dim;
    case KV_D_KV: return (int64_t)hp->n_head_kv * hp->head_dim;
    case KV_D_FF_EXP: return hp->n_ff_exp;
    case KV_D_EXPERT: return hp->n_expert;
    case KV_D_FF_SHEXP: return hp->n_ff_shexp;
    case KV_D_SSM_CONV: return hp->ssm_d_conv;
    case KV_D_SSM_STATE: return hp->ssm_d_state;
    case KV_D_SSM_HEADS: return hp->ssm_dt_rank;
    case KV_D_SSM_INNER: return hp->ssm_d_inner;
    case KV_D_SSM_CONV_DIM: return 2 * (int64_t)hp->ssm_d_state * hp->ssm_n_group + hp->ssm_d_inner;
    case KV_D_FF: return hp->n_ff;
    case KV_D_HEADS: return hp->n_head;
    case KV_D_Q_LORA: return hp->q_lora_rank;
    case KV_D_KV_LORA: return hp->kv_lora_rank;
    case KV_D_KV_A: return (int64_t)hp->kv_lora_rank + hp->n_rot;
    case KV_D_Q_MLA: return (int64_t)hp->n_head * hp->head_dim_k_mla;
    case KV_D_QK_NOPE: return (int64_t)hp->head_dim_k_mla - hp->n_rot;
    case KV_D_V_MLA: return hp->head_dim_v_mla;
    case KV_D_O_MLA: return (int64_t)hp->n_head * hp->head_dim_v_mla;
    default: return 0;
    }
}

const char *kv_dim_name(enum kv_dim dim) {
    static const char *const names[KV_D_COUNT] = {
        [KV_D_1] = "1", [KV_D_EMBD] = "n_embd", [KV_D_EMBD_X2] = "2*n_embd", [KV_D_VOCAB] = "n_vocab",
        [KV_D_HEAD_DIM] = "head_dim", [KV_D_Q] = "n_head*head_dim", [KV_D_Q_X2] = "2*n_head*head_dim",
        [KV_D_KV] = "n_head_kv*head_dim", [KV_D_FF_EXP] = "n_ff_exp", [KV_D_EXPERT] = "n_expert",
        [KV_D_FF_SHEXP] = "n_ff_shexp", [KV_D_SSM_CONV] = "ssm_d_conv", [KV_D_SSM_STATE] = "ssm_d_state",
        [KV_D_SSM_HEADS] = "ssm_dt_rank", [KV_D_SSM_INNER] = "ssm_d_inner",
        [KV_D_SSM_CONV_DIM] = "2*ssm_d_state*ssm_n_group+ssm_d_inner",
        [KV_D_FF] = "n_ff", [KV_D_HEADS] = "n_head", [KV_D_Q_LORA] = "q_lora_rank",
        [KV_D_KV_LORA] = "kv_lora_rank", [KV_D_KV_A] = "kv_lora_rank+n_rot",
        [KV_D_Q_MLA] = "n_head*key_length_mla", [KV_D_QK_NOPE] = "key_length_mla-n_rot",
        [KV_D_V_MLA] = "value_length_mla", [KV_D_O_MLA] = "n_head*value_length_mla",
    };
    return (unsigned)dim < KV_D_COUNT ? names[dim] : "?";
}

const kv_tensor_desc *kv_arch_tensor(const kv_arch_table *a, enum kv_tensor k) {
    for (size_t i = 0; a && i < a->n_tensors; i++)
        if (a->tensors[i].kind == k) return &a->tensors[i];
    return NULL;
}

int kv_tensor_name(const kv_tensor_desc *t, uint32_t il, char *buf, size_t cap) {
    int n = t->blocks ? snprintf(buf, cap, "blk.%u.%s", il, t->name) : snprintf(buf, cap, "%s", t->name);
    return n < 0 || (size_t)n >= cap ? -1 : n;
}

void kv_tensor_shape(const kv_tensor_desc *t, const kv_hparams *hp, int64_t ne[3]) {
    for (uint32_t i = 0; i < 3; i++) ne[i] = i < t->n_dims ? kv_dim_value(t->ne[i], hp) : 1;
}

uint32_t kv_arch_n_blocks(const kv_hparams *hp) { return hp->n_layer + hp->n_layer_nextn; }

bool kv_tensor_in_block(const kv_arch_table *a, const kv_tensor_desc *t, const kv_hparams *hp, uint32_t il) {
    return t->blocks && il < kv_arch_n_blocks(hp) && (t->blocks & a->block_kind(hp, il));
}

const kv_tensor_desc *kv_arch_match(const kv_arch_table *a, const char *name, size_t len, int32_t *il) {
    *il = -1;
    const char *r = name;
    size_t rl = len;
    if (len > 4 && !memcmp(name, "blk.", 4)) {
        size_t i = 4;
        uint32_t n = 0;
        while (i < len && name[i] >= '0' && name[i] <= '9') {
            n = n * 10 + (uint32_t)(name[i] - '0');
            if (n >= KV_MAX_LAYERS) return NULL;
            i++;
        }
        if (i == 4 || i >= len || name[i] != '.') return NULL;
        *il = (int32_t)n;
        r = name + i + 1;
        rl = len - i - 1;
    }
    for (size_t k = 0; k < a->n_tensors; k++) {
        const kv_tensor_desc *t = &a->tensors[k];
        if ((t->blocks != 0) != (*il >= 0)) continue;
        if (strlen(t->name) == rl && !memcmp(t->name, r, rl)) return t;
    }
    *il = -1;
    return NULL;
}

/* ---- hyper-parameters ----------------------------------------------------- */

static int kv_read_key(const kv_gguf *g, const char *an, const kv_hparam_key *k, kv_hparams *hp, kv_diag *d) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", an, k->key);
    void *field = (char *)hp + k->off;
    int rc;
    switch (k->type) {
    case KV_KEY_U32: {
        uint32_t *out = field;
        if (!k->required) *out = (uint32_t)k->def;
        rc = kv_gguf_get_u32(g, key, out, d);
        if (rc == KV_ENOTFOUND && !k->required) return 0;
        if (rc == KV_ENOTFOUND) return kv_fail(d, KV_EFORMAT, "model: missing metadata key '%s'", key);
        if (rc) return rc;
        if (*out < k->lo || *out > k->hi)
            return kv_fail(d, KV_EFORMAT, "model: %s = %u is out of range [%u, %u]", key, *out, k->lo, k->hi);
        return 0;
    }
    case KV_KEY_F32: {
        float *out = field;
        if (!k->required) *out = k->def;
        rc = kv_gguf_get_f32(g, key, out, d);
        if (rc == KV_ENOTFOUND && !k->required) return 0;
        if (rc == KV_ENOTFOUND) return kv_fail(d, KV_EFORMAT, "model: missing metadata key '%s'", key);
        if (rc) return rc;
        if (!(*out == *out) || *out > 1e30f || *out < -1e30f)
            return kv_fail(d, KV_EFORMAT, "model: %s is not a finite number", key);
        return 0;
    }
    case KV_KEY_BOOL: {
        bool *out = field;
        *out = k->def != 0.0f;
        rc = kv_gguf_get_bool(g, key, out, d);
        if (rc == KV_ENOTFOUND && !k->required) return 0;
        if (rc == KV_ENOTFOUND) return kv_fail(d, KV_EFORMAT, "model: missing metadata key '%s'", key);
        return rc;
    }
    case KV_KEY_I32_ARR4: { /* up to 4 integers (a scalar repeats) */
        int32_t *out = field;
        memset(out, 0, 4 * sizeof *out);
        uint64_t n = 0;
        const uint8_t *data = NULL;
        rc = kv_gguf_get_arr(g, key, KV_GGUF_INT32, &n, &data, d);
        if (rc == KV_EFORMAT) rc = kv_gguf_get_arr(g, key, KV_GGUF_UINT32, &n, &data, d);
        if (rc == KV_ENOTFOUND) {
            int32_t v;
            if (kv_gguf_get_i32(g, key, &v, NULL)) {
                if (!k->required) return 0;
                return kv_fail(d, KV_EFORMAT, "model: missing metadata key '%s'", key);
            }
            for (int i = 0; i < 4; i++) out[i] = v;
            return 0;
        }
        if (rc) return rc;
        if (n < 1 || n > 4)
            return kv_fail(d, KV_EFORMAT, "model: %s has %llu elements, expected 1..4", key, (unsigned long long)n);
        for (uint64_t i = 0; i < n; i++) {
            uint32_t u = (uint32_t)data[4 * i] | (uint32_t)data[4 * i + 1] << 8 | (uint32_t)data[4 * i + 2] << 16 |
                         (uint32_t)data[4 * i + 3] << 24;
            out[i] = (int32_t)u;
        }
        return 0;
    }
    case KV_KEY_IGNORED:
        return 0;
    case KV_KEY_ABSENT:
        if (kv_gguf_find_kv(g, key))
            return kv_fail(d, KV_EUNSUPPORTED, "model: '%s' is not supported by kvasir's %s", key, an);
        return 0;
    }
    return kv_fail(d, KV_EINTERNAL, "model: key '%s' has an unknown type in the table", key);
}

int kv_arch_check_common(kv_hparams *hp, kv_diag *d) {
    /* defaults derived from other values */
    if (!hp->n_head_kv) hp->n_head_kv = hp->n_head;
    if (!hp->head_dim) hp->head_dim = hp->n_embd / hp->n_head;
    if (!hp->head_dim_v) hp->head_dim_v = hp->head_dim;
    if (!hp->n_rot) hp->n_rot = hp->head_dim;
    if (hp->head_dim_v != hp->head_dim && hp->attn != KV_ATTN_MLA) /* MLA: the value is the latent */
        return kv_fail(d, KV_EUNSUPPORTED, "model: key_length %u != value_length %u", hp->head_dim, hp->head_dim_v);
    if (hp->n_head % hp->n_head_kv)
        return kv_fail(d, KV_EFORMAT, "model: head_count %u is not a multiple of head_count_kv %u", hp->n_head,
                       hp->n_head_kv);
    if (hp->n_expert_used > hp->n_expert)
        return kv_fail(d, KV_EFORMAT, "model: expert_used_count %u > expert_count %u", hp->n_expert_used,
                       hp->n_expert);
    if (hp->head_dim % 2) return kv_fail(d, KV_EFORMAT, "model: head dim %u is odd", hp->head_dim);
    if (!(hp->rms_eps >= 0.0f && hp->rms_eps < 1.0f))
        return kv_fail(d, KV_EFORMAT, "model: layer_norm_rms_epsilon %g out of range", hp->rms_eps);
    if (!(hp->rope_freq_base > 1.0f))
        return kv_fail(d, KV_EFORMAT, "model: rope.freq_base %g must be > 1", hp->rope_freq_base);
    /* the table read rope.scaling.factor into rope_freq_scale */
    const float factor = hp->rope_freq_scale;
    hp->rope_freq_scale = factor > 0.0f ? 1.0f / factor : 1.0f;
    return 0;
}

int kv_arch_read_hparams(const kv_gguf *g, kv_hparams *hp, kv_diag *d) {
    memset(hp, 0, sizeof *hp);
    kv_str s;
    int rc = kv_gguf_get_str(g, "general.architecture", &s, d);
    if (rc == KV_ENOTFOUND) return kv_fail(d, KV_EFORMAT, "model: missing metadata key 'general.architecture'");
    if (rc) return rc;
    if (s.len >= sizeof hp->arch_name)
        return kv_fail(d, KV_EUNSUPPORTED, "model: unknown architecture (name of %zu bytes)", s.len);
    memcpy(hp->arch_name, s.ptr, s.len);
    hp->arch_name[s.len] = 0;
    const kv_arch_table *a = strlen(hp->arch_name) == s.len ? kv_arch_find(hp->arch_name) : NULL;
    if (!a)
        return kv_fail(d, KV_EUNSUPPORTED, "model: unknown architecture '%s' (supported: %s)", hp->arch_name,
                       kv_arch_list());
    hp->arch = a->id;
    hp->attn = a->hooks.attn;
    hp->router = a->hooks.router;
    hp->act = a->hooks.act;
    hp->hook_flags = a->hooks.flags;
    for (size_t i = 0; i < a->n_keys; i++)
        if ((rc = kv_read_key(g, hp->arch_name, &a->keys[i], hp, d))) return rc;
    if ((rc = kv_arch_check_common(hp, d))) return rc;
    return a->check ? a->check(hp, g, d) : 0;
}
