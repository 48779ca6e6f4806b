/* Loading a model: hyper-parameters from GGUF metadata, tokenizer, and every
 * weight as a view into the mapping, each checked for presence, shape and a
 * type we can compute before anything runs. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/model.h"
#include "kvasir/quant.h"
#include "model/model_internal.h"

static const char *kv_arch_names[KV_ARCH_COUNT] = {[KV_ARCH_QWEN3MOE] = "qwen3moe",
                                                    [KV_ARCH_QWEN35MOE] = "qwen35moe"};

/* Reads "<arch>.<suffix>" as u32 into *out; required or optional. */
int kv_hp_u32(const kv_gguf *g, const char *arch, const char *suffix, uint32_t *out,
                     bool required, uint32_t lo, uint32_t hi, kv_diag *d) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = kv_gguf_get_u32(g, key, out, d);
    if (rc == KV_ENOTFOUND && !required) return 0;
    if (rc == KV_ENOTFOUND) return kv_fail(d, KV_EFORMAT, "model: missing metadata key '%s'", key);
    if (rc) return rc;
    if (*out < lo || *out > hi)
        return kv_fail(d, KV_EFORMAT, "model: %s = %u is out of range [%u, %u]", key, *out, lo, hi);
    return 0;
}

static int kv_hp_f32(const kv_gguf *g, const char *arch, const char *suffix, float *out,
                     bool required, kv_diag *d) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = kv_gguf_get_f32(g, key, out, d);
    if (rc == KV_ENOTFOUND && !required) return 0;
    if (rc == KV_ENOTFOUND) return kv_fail(d, KV_EFORMAT, "model: missing metadata key '%s'", key);
    if (rc) return rc;
    if (!(*out == *out) || *out > 1e30f || *out < -1e30f)
        return kv_fail(d, KV_EFORMAT, "model: %s is not a finite number", key);
    return 0;
}

static int kv_read_hparams(kv_model *m, kv_diag *d) {
    const kv_gguf *g = m->gguf;
    kv_hparams *hp = &m->hp;
    kv_str a;
    int rc = kv_gguf_get_str(g, "general.architecture", &a, d);
    if (rc == KV_ENOTFOUND)
        return kv_fail(d, KV_EFORMAT, "model: missing metadata key 'general.architecture'");
    if (rc) return rc;
    if (a.len >= sizeof hp->arch_name)
        return kv_fail(d, KV_EUNSUPPORTED, "model: unknown architecture (name of %zu bytes)", a.len);
    memcpy(hp->arch_name, a.ptr, a.len);
    hp->arch_name[a.len] = 0;
    int arch = -1;
    for (int i = 0; i < KV_ARCH_COUNT; i++)
        if (!strcmp(hp->arch_name, kv_arch_names[i])) arch = i;
    if (arch < 0)
        return kv_fail(d, KV_EUNSUPPORTED, "model: unknown architecture '%s' (supported: qwen3moe, qwen35moe)",
                       hp->arch_name);
    hp->arch = (enum kv_arch)arch;
    const char *an = hp->arch_name;

    if ((rc = kv_hp_u32(g, an, "block_count", &hp->n_layer, true, 1, KV_MAX_LAYERS, d)) ||
        (rc = kv_hp_u32(g, an, "embedding_length", &hp->n_embd, true, 1, KV_MAX_EMBD, d)) ||
        (rc = kv_hp_u32(g, an, "attention.head_count", &hp->n_head, true, 1, KV_MAX_HEADS, d)) ||
        (rc = kv_hp_u32(g, an, "context_length", &hp->n_ctx_train, true, 1, KV_MAX_CTX, d)) ||
        (rc = kv_hp_u32(g, an, "expert_count", &hp->n_expert, true, 1, KV_MAX_EXPERTS, d)) ||
        (rc = kv_hp_u32(g, an, "expert_used_count", &hp->n_expert_used, true, 1,
                        KV_MAX_EXPERTS_USED, d)) ||
        (rc = kv_hp_u32(g, an, "expert_feed_forward_length", &hp->n_ff_exp, true, 1, KV_MAX_FF, d)))
        return rc;
    hp->n_head_kv = hp->n_head;
    if ((rc = kv_hp_u32(g, an, "attention.head_count_kv", &hp->n_head_kv, false, 1, KV_MAX_HEADS, d)))
        return rc;
    hp->head_dim = hp->n_embd / hp->n_head;
    if ((rc = kv_hp_u32(g, an, "attention.key_length", &hp->head_dim, false, 1, KV_MAX_HEAD_DIM, d)))
        return rc;
    uint32_t vdim = hp->head_dim;
    if ((rc = kv_hp_u32(g, an, "attention.value_length", &vdim, false, 1, KV_MAX_HEAD_DIM, d)))
        return rc;
    if (vdim != hp->head_dim)
        return kv_fail(d, KV_EUNSUPPORTED, "model: key_length %u != value_length %u", hp->head_dim, vdim);
    hp->n_rot = hp->head_dim;
    if ((rc = kv_hp_u32(g, an, "rope.dimension_count", &hp->n_rot, false, 1, KV_MAX_HEAD_DIM, d)))
        return rc;
    if (hp->n_rot != hp->head_dim && hp->arch != KV_ARCH_QWEN35MOE) /* partial rotary: qwen35moe */
        return kv_fail(d, KV_EUNSUPPORTED, "model: rope.dimension_count %u != head dim %u", hp->n_rot,
                       hp->head_dim);
    if (hp->n_head % hp->n_head_kv)
        return kv_fail(d, KV_EFORMAT, "model: head_count %u is not a multiple of head_count_kv %u",
                       hp->n_head, hp->n_head_kv);
    if (hp->n_expert_used > hp->n_expert)
        return kv_fail(d, KV_EFORMAT, "model: expert_used_count %u > expert_count %u",
                       hp->n_expert_used, hp->n_expert);
    if (hp->head_dim % 2) return kv_fail(d, KV_EFORMAT, "model: head dim %u is odd", hp->head_dim);
    if ((rc = kv_hp_f32(g, an, "attention.layer_norm_rms_epsilon", &hp->rms_eps, true, d))) return rc;
    if (!(hp->rms_eps >= 0.0f && hp->rms_eps < 1.0f))
        return kv_fail(d, KV_EFORMAT, "model: layer_norm_rms_epsilon %g out of range", hp->rms_eps);
    hp->rope_freq_base = 10000.0f;
    if ((rc = kv_hp_f32(g, an, "rope.freq_base", &hp->rope_freq_base, false, d))) return rc;
    if (!(hp->rope_freq_base > 1.0f))
        return kv_fail(d, KV_EFORMAT, "model: rope.freq_base %g must be > 1", hp->rope_freq_base);
    float factor = 0.0f;
    if ((rc = kv_hp_f32(g, an, "rope.scaling.factor", &factor, false, d))) return rc;
    hp->rope_freq_scale = factor > 0.0f ? 1.0f / factor : 1.0f;
    hp->expert_weights_norm = true; /* qwen3moe always renormalizes the top-k weights */
    {
        char key[128];
        bool b;
        snprintf(key, sizeof key, "%s.expert_weights_norm", an);
        rc = kv_gguf_get_bool(g, key, &b, d);
        if (rc == 0) hp->expert_weights_norm = b;
        else if (rc != KV_ENOTFOUND) return rc;
    }
    hp->expert_weights_scale = 0.0f;
    if ((rc = kv_hp_f32(g, an, "expert_weights_scale", &hp->expert_weights_scale, false, d))) return rc;
    if (hp->arch == KV_ARCH_QWEN35MOE) return kv_q35_read_hparams(m, d);
    return 0;
}

/* Looks up a tensor and checks its shape ([ne0, ne1, ne2] with trailing 1s
 * omitted by n_dims) and type; f32_only for norms. */
int kv_get_w(kv_model *m, kv_weight *w, const char *name, uint32_t n_dims, int64_t ne0,
                    int64_t ne1, int64_t ne2, bool f32_only, bool required, kv_diag *d) {
    memset(w, 0, sizeof *w);
    const kv_gguf_tensor *t = kv_gguf_find_tensor(m->gguf, name);
    if (!t) {
        if (!required) return KV_ENOTFOUND;
        return kv_fail(d, KV_EFORMAT, "model: missing tensor '%s'", name);
    }
    const int64_t want[3] = {ne0, ne1, ne2};
    bool ok = t->n_dims == n_dims;
    for (uint32_t i = 0; i < 3 && ok; i++) ok = (int64_t)t->ne[i] == (i < n_dims ? want[i] : 1);
    if (!ok) {
        char got[96], exp[96];
        int k = snprintf(got, sizeof got, "[");
        for (uint32_t i = 0; i < t->n_dims && k < (int)sizeof got; i++)
            k += snprintf(got + k, sizeof got - (size_t)k, "%s%llu", i ? ", " : "",
                          (unsigned long long)t->ne[i]);
        if (k < (int)sizeof got) snprintf(got + k, sizeof got - (size_t)k, "]");
        k = snprintf(exp, sizeof exp, "[");
        for (uint32_t i = 0; i < n_dims && k < (int)sizeof exp; i++)
            k += snprintf(exp + k, sizeof exp - (size_t)k, "%s%lld", i ? ", " : "", (long long)want[i]);
        if (k < (int)sizeof exp) snprintf(exp + k, sizeof exp - (size_t)k, "]");
        return kv_fail(d, KV_EFORMAT, "model: tensor '%s' has shape %s, expected %s", name, got, exp);
    }
    const kv_type_info *ti = kv_type_get(t->type);
    if (!ti || !ti->compute)
        return kv_fail(d, KV_EUNSUPPORTED, "model: tensor '%s' has type %s (%u), which kvasir cannot compute",
                       name, ti && ti->name ? ti->name : "unknown", t->type);
    if (f32_only && t->type != KV_TYPE_F32)
        return kv_fail(d, KV_EUNSUPPORTED, "model: tensor '%s' has type %s, expected f32", name, ti->name);
    w->data = t->data;
    w->type = t->type;
    w->ne[0] = ne0;
    w->ne[1] = n_dims > 1 ? ne1 : 1;
    w->ne[2] = n_dims > 2 ? ne2 : 1;
    w->row_bytes = (size_t)kv_type_row_size(t->type, (uint64_t)ne0);
    w->nb2 = w->row_bytes * (size_t)w->ne[1];
    return 0;
}

static int kv_load_weights(kv_model *m, bool experts, kv_diag *d) {
    kv_hparams *hp = &m->hp;
    const int64_t E = hp->n_embd, HD = hp->head_dim, H = hp->n_head, HKV = hp->n_head_kv;
    const kv_gguf_tensor *te = kv_gguf_find_tensor(m->gguf, "token_embd.weight");
    if (!te) return kv_fail(d, KV_EFORMAT, "model: missing tensor 'token_embd.weight'");
    if (te->n_dims != 2 || te->ne[1] < 1 || te->ne[1] > KV_MAX_VOCAB)
        return kv_fail(d, KV_EFORMAT, "model: tensor 'token_embd.weight' must be 2-D [n_embd, n_vocab]");
    hp->n_vocab = (uint32_t)te->ne[1];
    if (kv_tok_n_vocab(m->tok) != (int32_t)hp->n_vocab)
        return kv_fail(d, KV_EFORMAT, "model: vocabulary has %d tokens but token_embd has %u rows",
                       kv_tok_n_vocab(m->tok), hp->n_vocab);
    int rc;
    if ((rc = kv_get_w(m, &m->tok_embd, "token_embd.weight", 2, E, hp->n_vocab, 1, false, true, d)) ||
        (rc = kv_get_w(m, &m->output_norm, "output_norm.weight", 1, E, 1, 1, true, true, d)))
        return rc;
    rc = kv_get_w(m, &m->output, "output.weight", 2, E, hp->n_vocab, 1, false, false, d);
    if (rc == KV_ENOTFOUND) {
        m->output = m->tok_embd;
        hp->tied_output = true;
    } else if (rc) {
        return rc;
    }
    m->layers = calloc((size_t)hp->n_layer + hp->n_layer_nextn, sizeof *m->layers);
    if (!m->layers) return kv_fail(d, KV_ENOMEM, "model: out of memory");
    if (hp->arch == KV_ARCH_QWEN35MOE) {
        for (uint32_t il = 0; il < hp->n_layer + hp->n_layer_nextn; il++)
            if ((rc = kv_q35_load_layer(m, il, experts, d))) return rc;
        return 0;
    }
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        kv_layer *L = &m->layers[il];
        char n[96];
#define KV_W(field, suffix, nd, a, b, c, f32)                                              \
    do {                                                                                  \
        snprintf(n, sizeof n, "blk.%u.%s.weight", il, suffix);                           \
        if ((rc = kv_get_w(m, &L->field, n, nd, a, b, c, f32, true, d))) return rc;       \
    } while (0)
        KV_W(attn_norm, "attn_norm", 1, E, 1, 1, true);
        KV_W(wq, "attn_q", 2, E, H * HD, 1, false);
        KV_W(wk, "attn_k", 2, E, HKV * HD, 1, false);
        KV_W(wv, "attn_v", 2, E, HKV * HD, 1, false);
        KV_W(wo, "attn_output", 2, H * HD, E, 1, false);
        KV_W(q_norm, "attn_q_norm", 1, HD, 1, 1, true);
        KV_W(k_norm, "attn_k_norm", 1, HD, 1, 1, true);
        KV_W(ffn_norm, "ffn_norm", 1, E, 1, 1, true);
        KV_W(gate_inp, "ffn_gate_inp", 2, E, hp->n_expert, 1, false);
        if (experts) {
            KV_W(gate_exps, "ffn_gate_exps", 3, E, hp->n_ff_exp, hp->n_expert, false);
            KV_W(up_exps, "ffn_up_exps", 3, E, hp->n_ff_exp, hp->n_expert, false);
            KV_W(down_exps, "ffn_down_exps", 3, hp->n_ff_exp, E, hp->n_expert, false);
        }
#undef KV_W
    }
    return 0;
}

int kv_model_load(kv_model **out, const char *path, kv_diag *d) {
    return kv_model_load_ex(out, path, NULL, d);
}

int kv_model_load_ex(kv_model **out, const char *path, const kv_model_opts *opts, kv_diag *d) {
    *out = NULL;
    const bool experts = !(opts && opts->no_experts);
    kv_model *m = calloc(1, sizeof *m);
    if (!m) return kv_fail(d, KV_ENOMEM, "model: out of memory");
    int rc = kv_gguf_open(&m->gguf, path, d);
    if (rc) goto fail;
    if ((rc = kv_read_hparams(m, d))) goto fail;
    if ((rc = kv_tok_load(&m->tok, m->gguf, d))) goto fail;
    if ((rc = kv_load_weights(m, experts, d))) goto fail;
    m->has_experts = experts;
    *out = m;
    return 0;
fail:
    kv_model_free(m);
    return rc;
}

void kv_model_free(kv_model *m) {
    if (!m) return;
    free(m->layers);
    kv_tok_free(m->tok);
    kv_gguf_close(m->gguf);
    free(m);
}

const kv_hparams *kv_model_hparams(const kv_model *m) { return &m->hp; }
bool kv_model_has_experts(const kv_model *m) { return m->has_experts; }
const kv_tok *kv_model_tok(const kv_model *m) { return m->tok; }
const kv_gguf *kv_model_gguf(const kv_model *m) { return m->gguf; }
const kv_layer *kv_model_layer(const kv_model *m, uint32_t il) {
    return il < m->hp.n_layer + m->hp.n_layer_nextn ? &m->layers[il] : NULL;
}

uint64_t kv_model_bytes_per_token(const kv_model *m) {
    const kv_hparams *hp = &m->hp;
    uint64_t b = m->tok_embd.row_bytes + m->output.nb2 + (uint64_t)hp->n_embd * 4;
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        const kv_layer *L = &m->layers[il];
        b += L->wq.nb2 + L->wk.nb2 + L->wv.nb2 + L->wo.nb2 + L->gate_inp.nb2;
        b += L->wqkv.nb2 + L->wqkv_gate.nb2 + L->ssm_beta.nb2 + L->ssm_alpha.nb2 + L->ssm_out.nb2;
        b += L->gate_inp_shexp.nb2 + L->gate_shexp.nb2 + L->up_shexp.nb2 + L->down_shexp.nb2;
        b += (uint64_t)hp->n_expert_used * (L->gate_exps.nb2 + L->up_exps.nb2 + L->down_exps.nb2);
        b += ((uint64_t)hp->n_embd * 2 + hp->head_dim * 2) * 4;
    }
    return b;
}
