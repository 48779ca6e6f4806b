/* Loading a model: hyper-parameters from GGUF metadata, tokenizer, and every
 * weight as a view into the mapping, each checked for presence, shape and a
 * type we can compute before anything runs. What to read comes from the
 * architecture's table (arch.h): its keys, and for every block the tensors
 * the block's kind carries, with their shapes in hyper-parameters. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvasir/arch.h"
#include "kvasir/model.h"
#include "kvasir/quant.h"
#include "model/model_internal.h"

static int kv_read_hparams(kv_model *m, kv_diag *d) { return kv_arch_read_hparams(m->gguf, &m->hp, d); }

/* Looks up a tensor and checks its shape ([ne0, ne1, ne2] with trailing 1s
 * omitted by n_dims) and type; f32_only for norms. */
int kv_get_w(kv_model *m, kv_weight *w, const char *name, uint32_t n_dims, int64_t ne0,
                    int64_t ne1, int64_t ne2, bool f32_only, bool required, kv_diag *d) {
    memset(w, 0, sizeof *w);
    const kv_gguf_tensor *t = kv_gguf_find_tensor(m->gguf, name);
    if (!t) {
        if (!required) return KV_ENOTFOUND;
        if (kv_gguf_n_parts(m->gguf) > 1)
            return kv_fail(d, KV_EFORMAT, "model: missing tensor '%s' (in none of the split model's %zu parts)", name,
                           kv_gguf_n_parts(m->gguf));
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

/* Where a block tensor of kind k lands in kv_layer (NULL: not a block tensor). */
static kv_weight *kv_layer_slot(kv_layer *L, enum kv_tensor k) {
    switch (k) {
    case KV_T_ATTN_NORM: return &L->attn_norm;
    case KV_T_POST_NORM: return &L->post_norm;
    case KV_T_ATTN_Q: return &L->wq;
    case KV_T_ATTN_K: return &L->wk;
    case KV_T_ATTN_V: return &L->wv;
    case KV_T_ATTN_OUT: return &L->wo;
    case KV_T_ATTN_Q_NORM: return &L->q_norm;
    case KV_T_ATTN_K_NORM: return &L->k_norm;
    case KV_T_FFN_NORM: return &L->ffn_norm;
    case KV_T_ATTN_QKV: return &L->wqkv;
    case KV_T_ATTN_GATE: return &L->wqkv_gate;
    case KV_T_SSM_CONV1D: return &L->ssm_conv1d;
    case KV_T_SSM_DT: return &L->ssm_dt;
    case KV_T_SSM_A: return &L->ssm_a;
    case KV_T_SSM_BETA: return &L->ssm_beta;
    case KV_T_SSM_ALPHA: return &L->ssm_alpha;
    case KV_T_SSM_NORM: return &L->ssm_norm;
    case KV_T_SSM_OUT: return &L->ssm_out;
    case KV_T_FFN_GATE_INP: return &L->gate_inp;
    case KV_T_FFN_GATE_EXPS: return &L->gate_exps;
    case KV_T_FFN_UP_EXPS: return &L->up_exps;
    case KV_T_FFN_DOWN_EXPS: return &L->down_exps;
    case KV_T_FFN_GATE_INP_SHEXP: return &L->gate_inp_shexp;
    case KV_T_FFN_GATE_SHEXP: return &L->gate_shexp;
    case KV_T_FFN_UP_SHEXP: return &L->up_shexp;
    case KV_T_FFN_DOWN_SHEXP: return &L->down_shexp;
    case KV_T_NEXTN_EH_PROJ: return &L->nextn_eh_proj;
    case KV_T_NEXTN_ENORM: return &L->nextn_enorm;
    case KV_T_NEXTN_HNORM: return &L->nextn_hnorm;
    case KV_T_NEXTN_SHARED_HEAD_NORM: return &L->nextn_head_norm;
    case KV_T_ATTN_Q_A: return &L->wq_a;
    case KV_T_ATTN_Q_A_NORM: return &L->q_a_norm;
    case KV_T_ATTN_Q_B: return &L->wq_b;
    case KV_T_ATTN_KV_A_MQA: return &L->wkv_a;
    case KV_T_ATTN_KV_A_NORM: return &L->kv_a_norm;
    case KV_T_ATTN_K_B: return &L->wk_b;
    case KV_T_ATTN_V_B: return &L->wv_b;
    case KV_T_FFN_GATE: return &L->ffn_gate;
    case KV_T_FFN_UP: return &L->ffn_up;
    case KV_T_FFN_DOWN: return &L->ffn_down;
    case KV_T_FFN_EXP_PROBS_B: return &L->exp_probs_b;
    case KV_T_ATTN_Q_BIAS: return &L->bq;
    case KV_T_ATTN_K_BIAS: return &L->bk;
    case KV_T_ATTN_V_BIAS: return &L->bv;
    case KV_T_ATTN_OUT_BIAS: return &L->bo;
    case KV_T_ATTN_SINKS: return &L->sinks;
    case KV_T_FFN_GATE_INP_BIAS: return &L->gate_inp_b;
    case KV_T_FFN_GATE_EXPS_BIAS: return &L->gate_exps_b;
    case KV_T_FFN_UP_EXPS_BIAS: return &L->up_exps_b;
    case KV_T_FFN_DOWN_EXPS_BIAS: return &L->down_exps_b;
    default: return NULL;
    }
}

/* Maps and checks tensor t (of block il) into w as the table says. */
static int kv_load_tensor(kv_model *m, const kv_tensor_desc *t, uint32_t il, kv_weight *w, kv_diag *d) {
    char n[KV_GGUF_MAX_TENSOR_NAME + 1];
    if (kv_tensor_name(t, il, n, sizeof n) < 0)
        return kv_fail(d, KV_EINTERNAL, "model: tensor name '%s' of block %u too long", t->name, il);
    int64_t ne[3];
    kv_tensor_shape(t, &m->hp, ne);
    const bool required = !(t->flags & (KV_TF_OPTIONAL | KV_TF_TIED));
    return kv_get_w(m, w, n, t->n_dims, ne[0], ne[1], ne[2], t->flags & KV_TF_F32, required, d);
}

static int kv_load_weights(kv_model *m, bool experts, const kv_model_opts *opts, kv_diag *d) {
    kv_hparams *hp = &m->hp;
    const kv_arch_table *a = kv_arch_get(hp->arch);
    const kv_tensor_desc *embd = kv_arch_tensor(a, KV_T_TOKEN_EMBD);
    const kv_tensor_desc *onorm = kv_arch_tensor(a, KV_T_OUTPUT_NORM);
    const kv_tensor_desc *out = kv_arch_tensor(a, KV_T_OUTPUT);
    if (!embd || !onorm || !out) return kv_fail(d, KV_EINTERNAL, "model: table of %s lacks a global tensor", a->name);
    /* the vocabulary size comes from the embedding's rows */
    const kv_gguf_tensor *te = kv_gguf_find_tensor(m->gguf, embd->name);
    if (!te) return kv_fail(d, KV_EFORMAT, "model: missing tensor '%s'", embd->name);
    if (te->n_dims != 2 || te->ne[1] < 1 || te->ne[1] > KV_MAX_VOCAB)
        return kv_fail(d, KV_EFORMAT, "model: tensor '%s' must be 2-D [n_embd, n_vocab]", embd->name);
    hp->n_vocab = (uint32_t)te->ne[1];
    if (kv_tok_n_vocab(m->tok) != (int32_t)hp->n_vocab)
        return kv_fail(d, KV_EFORMAT, "model: vocabulary has %d tokens but token_embd has %u rows",
                       kv_tok_n_vocab(m->tok), hp->n_vocab);
    const bool window = opts && opts->window;
    m->il_first = 0;
    m->il_last = hp->n_layer - 1;
    if (window) {
        if (opts->layer_first > opts->layer_last || opts->layer_last >= hp->n_layer)
            return kv_fail(d, KV_EINVAL, "model: layer window %u-%u is outside the model's blocks 0-%u",
                           opts->layer_first, opts->layer_last, hp->n_layer - 1);
        m->il_first = opts->layer_first;
        m->il_last = opts->layer_last;
    }
    m->has_head = m->il_last == hp->n_layer - 1;
    /* the LM head is tied when output.weight is absent (a header lookup: no data touched) */
    char oname[KV_GGUF_MAX_TENSOR_NAME + 1];
    if (kv_tensor_name(out, 0, oname, sizeof oname) < 0)
        return kv_fail(d, KV_EINTERNAL, "model: tensor name '%s' too long", out->name);
    hp->tied_output = !kv_gguf_find_tensor(m->gguf, oname) && (out->flags & KV_TF_TIED);
    const bool mtp_here = window && opts->mtp && m->has_head && hp->n_layer_nextn; /* the MTP blocks follow the head */
    m->has_embd = m->il_first == 0 || (m->has_head && (hp->tied_output || mtp_here));
    int rc;
    if (m->has_embd && (rc = kv_load_tensor(m, embd, 0, &m->tok_embd, d))) return rc;
    if (m->has_head) {
        if ((rc = kv_load_tensor(m, onorm, 0, &m->output_norm, d))) return rc;
        rc = kv_load_tensor(m, out, 0, &m->output, d);
        if (rc == KV_ENOTFOUND) {
            m->output = m->tok_embd;
            hp->tied_output = true;
        } else if (rc) {
            return rc;
        }
    }
    const uint32_t n_blocks = kv_arch_n_blocks(hp);
    m->layers = calloc(n_blocks, sizeof *m->layers);
    if (!m->layers) return kv_fail(d, KV_ENOMEM, "model: out of memory");
    for (uint32_t il = 0; il < n_blocks; il++) {
        kv_layer *L = &m->layers[il];
        if (window && !kv_model_in_window(m, il) && !(mtp_here && il >= hp->n_layer))
            continue; /* another node's blocks (MTP too, unless asked for) */
        L->recurrent = a->block_kind(hp, il) == KV_BLK_RECURRENT;
        for (size_t i = 0; i < a->n_tensors; i++) {
            const kv_tensor_desc *t = &a->tensors[i];
            if (!kv_tensor_in_block(a, t, hp, il)) continue;
            if ((t->role == KV_ROLE_EXPERT || t->role == KV_ROLE_EXPERT_BIAS) && !experts)
                continue; /* a backbone: from a provider */
            kv_weight *w = kv_layer_slot(L, t->kind);
            if (!w) return kv_fail(d, KV_EINTERNAL, "model: tensor kind %d has no place in a block", (int)t->kind);
            rc = kv_load_tensor(m, t, il, w, d);
            if (rc == KV_ENOTFOUND) continue; /* optional */
            if (rc) return rc;
        }
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
    if ((rc = kv_load_weights(m, experts, opts, d))) goto fail;
    m->has_experts = experts;
    *out = m;
    return 0;
fail:
    kv_model_free(m);
    return rc;
}

/* ---- backbone prefault ------------------------------------------------ */

#ifdef MADV_POPULATE_READ
#define KV_MADV_POPULATE_READ MADV_POPULATE_READ
#else
#define KV_MADV_POPULATE_READ 22 /* linux/mman.h; older headers lack it (EINVAL then: the loads) */
#endif

struct kv_prefault {
    pthread_t th;
    const kv_model *m;
    atomic_bool stop, finished;
    _Atomic uint64_t bytes;
    bool experts; /* kv_model_fault_in: the routed experts and embedding too */
};

static void kv_prefault_range(struct kv_prefault *p, const void *data, uint64_t n) {
    if (!data || !n) return;
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = (uintptr_t)data & ~(pg - 1);
    const uintptr_t end = (uintptr_t)data + n;
    /* in 4 MiB steps (stoppable): MADV_POPULATE_READ (Linux 5.14) faults
     * the range in through the normal read-fault path, readahead and large
     * folios included; where the kernel lacks it, one load per page */
    for (uintptr_t c = a; c < end && !atomic_load(&p->stop); c += (uintptr_t)4 << 20) {
        const uintptr_t ce = c + ((uintptr_t)4 << 20) < end ? c + ((uintptr_t)4 << 20) : end;
        if (madvise((void *)c, ce - c, KV_MADV_POPULATE_READ) != 0) {
            uint8_t sink = 0;
            for (uintptr_t q = c; q < ce; q += pg) sink ^= *(volatile const uint8_t *)q;
            (void)sink;
        }
        atomic_fetch_add(&p->bytes, (uint64_t)(ce - c));
    }
}

static void kv_prefault_w(struct kv_prefault *p, const kv_weight *w) {
    if (w->data) kv_prefault_range(p, w->data, (uint64_t)w->nb2 * (uint64_t)w->ne[2]);
}

static void *kv_prefault_main(void *arg) {
    struct kv_prefault *p = arg;
    const kv_model *m = p->m;
    for (uint32_t il = m->il_first; il <= m->il_last && il < m->hp.n_layer; il++) {
        const kv_layer *L = &m->layers[il];
        /* every backbone kv_weight of a block in the order a pass reads them */
        const kv_weight *all[] = {&L->attn_norm, &L->wqkv, &L->wqkv_gate, &L->ssm_beta, &L->ssm_alpha,
                                  &L->ssm_conv1d, &L->ssm_dt, &L->ssm_a, &L->ssm_norm, &L->ssm_out,
                                  &L->wq, &L->wk, &L->wv, &L->q_norm, &L->k_norm, &L->wo,
                                  &L->ffn_norm, &L->post_norm, &L->gate_inp, &L->gate_inp_shexp,
                                  &L->gate_shexp, &L->up_shexp, &L->down_shexp, &L->wq_a, &L->q_a_norm,
                                  &L->wq_b, &L->wkv_a, &L->kv_a_norm, &L->wk_b, &L->wv_b, &L->ffn_gate,
                                  &L->ffn_up, &L->ffn_down, &L->exp_probs_b, &L->bq, &L->bk, &L->bv,
                                  &L->bo, &L->sinks, &L->gate_inp_b};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) kv_prefault_w(p, all[i]);
        if (p->experts) {
            kv_prefault_w(p, &L->gate_exps);
            kv_prefault_w(p, &L->up_exps);
            kv_prefault_w(p, &L->down_exps);
        }
    }
    if (p->experts) kv_prefault_w(p, &m->tok_embd);
    kv_prefault_w(p, &m->output_norm);
    kv_prefault_w(p, &m->output);
    atomic_store(&p->finished, true);
    return NULL;
}

int kv_model_prefault(const kv_model *cm, kv_diag *d) {
    kv_model *m = (kv_model *)cm; /* the thread handle is bookkeeping, not model data */
    if (m->prefault) return 0;
    struct kv_prefault *p = calloc(1, sizeof *p);
    if (!p) return kv_fail(d, KV_ENOMEM, "prefault: out of memory");
    p->m = m;
    atomic_init(&p->stop, false);
    atomic_init(&p->finished, false);
    atomic_init(&p->bytes, 0);
    if (pthread_create(&p->th, NULL, kv_prefault_main, p)) {
        free(p);
        return kv_fail(d, KV_EIO, "prefault: cannot start a thread");
    }
    m->prefault = p;
    return 0;
}

uint64_t kv_model_fault_in(const kv_model *m) {
    struct kv_prefault p = {.m = m, .experts = true};
    atomic_init(&p.stop, false);
    atomic_init(&p.finished, false);
    atomic_init(&p.bytes, 0);
    kv_prefault_main(&p);
    return atomic_load(&p.bytes);
}

uint64_t kv_model_prefault_done(const kv_model *m, bool *finished) {
    if (finished) *finished = m->prefault ? atomic_load(&m->prefault->finished) : false;
    return m->prefault ? atomic_load(&m->prefault->bytes) : 0;
}

void kv_model_free(kv_model *m) {
    if (!m) return;
    if (m->prefault) {
        atomic_store(&m->prefault->stop, true);
        pthread_join(m->prefault->th, NULL);
        free(m->prefault);
    }
    free(m->layers);
    kv_tok_free(m->tok);
    kv_gguf_close(m->gguf);
    free(m);
}

const kv_hparams *kv_model_hparams(const kv_model *m) { return &m->hp; }
bool kv_model_has_experts(const kv_model *m) { return m->has_experts; }
void kv_model_window(const kv_model *m, uint32_t *first, uint32_t *last) {
    *first = m->il_first;
    *last = m->il_last;
}

static uint64_t kv_w_bytes(const kv_weight *w) { return w->data ? (uint64_t)w->nb2 * (uint64_t)w->ne[2] : 0; }

uint64_t kv_model_weight_bytes(const kv_model *m) {
    uint64_t b = kv_w_bytes(&m->tok_embd) + kv_w_bytes(&m->output_norm);
    if (m->output.data != m->tok_embd.data) b += kv_w_bytes(&m->output);
    for (uint32_t il = 0; il < kv_arch_n_blocks(&m->hp); il++) {
        /* every kv_weight of a block, in declaration order */
        const kv_layer *L = &m->layers[il];
        const kv_weight *all[] = {&L->attn_norm, &L->wq, &L->wk, &L->wv, &L->wo, &L->q_norm, &L->k_norm,
                                  &L->ffn_norm, &L->gate_inp, &L->gate_exps, &L->up_exps, &L->down_exps,
                                  &L->post_norm, &L->wqkv, &L->wqkv_gate, &L->ssm_conv1d, &L->ssm_dt, &L->ssm_a,
                                  &L->ssm_beta, &L->ssm_alpha, &L->ssm_norm, &L->ssm_out, &L->gate_inp_shexp,
                                  &L->gate_shexp, &L->up_shexp, &L->down_shexp, &L->nextn_eh_proj,
                                  &L->nextn_enorm, &L->nextn_hnorm, &L->nextn_head_norm, &L->wq_a,
                                  &L->q_a_norm, &L->wq_b, &L->wkv_a, &L->kv_a_norm, &L->wk_b, &L->wv_b,
                                  &L->ffn_gate, &L->ffn_up, &L->ffn_down, &L->exp_probs_b, &L->bq, &L->bk,
                                  &L->bv, &L->bo, &L->sinks, &L->gate_inp_b, &L->gate_exps_b, &L->up_exps_b,
                                  &L->down_exps_b};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) b += kv_w_bytes(all[i]);
    }
    return b;
}
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
        b += L->wq_a.nb2 + L->wq_b.nb2 + L->wkv_a.nb2 + L->wk_b.nb2 * L->wk_b.ne[2] + L->wv_b.nb2 * L->wv_b.ne[2];
        b += L->ffn_gate.nb2 + L->ffn_up.nb2 + L->ffn_down.nb2;
        b += (uint64_t)hp->n_expert_used * (L->gate_exps.nb2 + L->up_exps.nb2 + L->down_exps.nb2);
        b += ((uint64_t)hp->n_embd * 2 + hp->head_dim * 2) * 4;
    }
    return b;
}
