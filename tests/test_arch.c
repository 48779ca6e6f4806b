/* The architecture tables (arch.h) against the files they describe: every
 * tensor of a generated model and of every skeleton is named by its table,
 * in a block of the right kind, with the table's shape, and the counts match
 * hand-computed figures; the loader loads the generated models; the metadata
 * keys of those files are keys the table knows; the table's roles agree with
 * anatomy's name rules; name matching rejects what it should. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvasir/anatomy.h"
#include "kvasir/arch.h"
#include "kvasir/gen.h"
#include "kvasir/gguf.h"
#include "kvasir/model.h"
#include "kvasir/quant.h"
#include "kvtest.h"

static char tmpdir[256];

/* ---- the tables themselves ------------------------------------------------ */

static void test_registry(void) {
    ASSERT_TRUE(kv_arch_get(KV_ARCH_QWEN3MOE) == kv_arch_find("qwen3moe"));
    ASSERT_TRUE(kv_arch_get(KV_ARCH_QWEN35MOE) == kv_arch_find("qwen35moe"));
    ASSERT_TRUE(kv_arch_find("llama") == NULL);
    ASSERT_TRUE(kv_arch_find(NULL) == NULL);
    ASSERT_TRUE(kv_arch_get(KV_ARCH_COUNT) == NULL);
    for (int id = 0; id < KV_ARCH_COUNT; id++) {
        const kv_arch_table *a = kv_arch_get((enum kv_arch)id);
        ASSERT_TRUE(a != NULL);
        if (!a) continue;
        ASSERT_EQ(a->id, id);
        ASSERT_TRUE(a->block_kind != NULL);
        ASSERT_TRUE(a->blocks != NULL); /* the forward pass runs through the table */
        ASSERT_TRUE(strstr(kv_arch_list(), a->name) != NULL);
        int seen[KV_T_COUNT] = {0};
        for (size_t i = 0; i < a->n_tensors; i++) {
            const kv_tensor_desc *t = &a->tensors[i];
            ASSERT_TRUE((unsigned)t->kind < KV_T_COUNT);
            if ((unsigned)t->kind < KV_T_COUNT) ASSERT_EQ(seen[t->kind]++, 0); /* one entry per kind */
            ASSERT_TRUE(t->n_dims >= 1 && t->n_dims <= 3);
            for (uint32_t k = t->n_dims; k < 3; k++) ASSERT_EQ(t->ne[k], KV_D_1);
            ASSERT_TRUE(kv_arch_tensor(a, t->kind) == t);
            ASSERT_EQ(t->blocks & ~KV_BLK_ALL, 0);
            /* routed experts: 3-D, expert index outermost, never f32-only */
            if (t->role == KV_ROLE_EXPERT) {
                ASSERT_EQ(t->n_dims, 3);
                ASSERT_EQ(t->ne[2], KV_D_EXPERT);
                ASSERT_EQ(t->flags & KV_TF_F32, 0);
            }
            /* names unique among globals / among block tensors */
            for (size_t j = 0; j < i; j++)
                if (!a->tensors[j].blocks == !t->blocks) ASSERT_TRUE(strcmp(a->tensors[j].name, t->name) != 0);
            ASSERT_TRUE(t->init_gain > 0.0f || t->init_std > 0.0f);
        }
        ASSERT_EQ(seen[KV_T_TOKEN_EMBD], 1);
        ASSERT_EQ(seen[KV_T_FFN_GATE_EXPS] + seen[KV_T_FFN_UP_EXPS] + seen[KV_T_FFN_DOWN_EXPS], 3);
        /* the expert stems the slicer, slab reader and worker use name this table's experts */
        if (seen[KV_T_FFN_GATE_EXPS] + seen[KV_T_FFN_UP_EXPS] + seen[KV_T_FFN_DOWN_EXPS] == 3) {
            ASSERT_STREQ(kv_arch_tensor(a, KV_T_FFN_GATE_EXPS)->name, "ffn_gate_exps.weight");
            ASSERT_STREQ(kv_arch_tensor(a, KV_T_FFN_UP_EXPS)->name, "ffn_up_exps.weight");
            ASSERT_STREQ(kv_arch_tensor(a, KV_T_FFN_DOWN_EXPS)->name, "ffn_down_exps.weight");
            ASSERT_STREQ(kv_arch_tensor(a, KV_T_FFN_GATE_EXPS)->name, KV_EXPERT_STEM_GATE ".weight");
        }
        for (size_t i = 0; i < a->n_keys; i++)
            for (size_t j = 0; j < i; j++) ASSERT_TRUE(strcmp(a->keys[i].key, a->keys[j].key) != 0);
    }
    ASSERT_TRUE(kv_arch_get(KV_ARCH_QWEN35MOE)->blocks == kv_q35_blocks);
}

static void test_match(void) {
    const kv_arch_table *a = kv_arch_find("qwen35moe");
    int32_t il = 99;
    const char *n = "blk.17.ffn_gate_exps.weight";
    const kv_tensor_desc *t = kv_arch_match(a, n, strlen(n), &il);
    ASSERT_TRUE(t && t->kind == KV_T_FFN_GATE_EXPS);
    ASSERT_EQ(il, 17);
    n = "token_embd.weight";
    t = kv_arch_match(a, n, strlen(n), &il);
    ASSERT_TRUE(t && t->kind == KV_T_TOKEN_EMBD);
    ASSERT_EQ(il, -1);
    /* a prefix of a longer buffer: only len bytes count */
    n = "blk.3.ssm_a.weight";
    t = kv_arch_match(a, n, strlen("blk.3.ssm_a"), &il);
    ASSERT_TRUE(t && t->kind == KV_T_SSM_A);
    ASSERT_TRUE(kv_arch_match(a, n, strlen(n), &il) == NULL);
    static const char *const bad[] = {"blk.0.token_embd.weight", "attn_norm.weight", "blk..attn_norm.weight",
                                      "blk.x.attn_norm.weight", "blk.512.attn_norm.weight",
                                      "blk.99999999999.attn_norm.weight", "blk.1", "blk.1.", "",
                                      "blk.1.attn_norm.weigh"};
    for (size_t i = 0; i < KVT_N(bad); i++) {
        ASSERT_TRUE(kv_arch_match(a, bad[i], strlen(bad[i]), &il) == NULL);
        ASSERT_EQ(il, -1);
    }
    char buf[64];
    ASSERT_EQ(kv_tensor_name(kv_arch_tensor(a, KV_T_SSM_DT), 5, buf, sizeof buf), (int)strlen("blk.5.ssm_dt.bias"));
    ASSERT_STREQ(buf, "blk.5.ssm_dt.bias");
    ASSERT_EQ(kv_tensor_name(kv_arch_tensor(a, KV_T_SSM_DT), 5, buf, 8), -1);
    ASSERT_TRUE(kv_arch_tensor(kv_arch_find("qwen3moe"), KV_T_SSM_DT) == NULL);
}

/* ---- hyper-parameter keys ------------------------------------------------- */

/* A metadata-only qwen35moe file: the base keys, with `skip` left out and
 * `over` (if not NULL) set to val; returns kv_arch_read_hparams' code. */
static int read_keys(const char *skip, const char *over, uint32_t val, kv_hparams *hp, kv_diag *d) {
    static const struct {
        const char *k;
        uint32_t v;
    } u[] = {{"block_count", 5},          {"embedding_length", 64},     {"attention.head_count", 4},
             {"context_length", 512},     {"expert_count", 8},          {"expert_used_count", 2},
             {"expert_feed_forward_length", 32}, {"attention.head_count_kv", 2}, {"attention.key_length", 16},
             {"attention.value_length", 16}, {"rope.dimension_count", 4}, {"nextn_predict_layers", 1},
             {"full_attention_interval", 2}, {"ssm.conv_kernel", 4},     {"ssm.state_size", 16},
             {"ssm.group_count", 2},      {"ssm.time_step_rank", 4},    {"ssm.inner_size", 64},
             {"expert_shared_feed_forward_length", 32}};
    char p[512], key[128];
    snprintf(p, sizeof p, "%s/keys.gguf", tmpdir);
    kv_gguf_writer *w = NULL;
    int rc = kv_gguf_writer_new(&w, d);
    if (!rc) rc = kv_gguf_writer_set_str(w, "general.architecture", "qwen35moe", d);
    for (size_t i = 0; i < KVT_N(u) && !rc; i++) {
        if (skip && !strcmp(skip, u[i].k)) continue;
        snprintf(key, sizeof key, "qwen35moe.%s", u[i].k);
        rc = kv_gguf_writer_set_u32(w, key, over && !strcmp(over, u[i].k) ? val : u[i].v, d);
    }
    if (!rc && over && !strcmp(over, "attention.recurrent_layers"))
        rc = kv_gguf_writer_set_u32(w, "qwen35moe.attention.recurrent_layers", val, d);
    if (!rc && !(skip && !strcmp(skip, "attention.layer_norm_rms_epsilon")))
        rc = kv_gguf_writer_set_f32(w, "qwen35moe.attention.layer_norm_rms_epsilon", 1e-6f, d);
    const int32_t sec[4] = {1, 1, 0, 0};
    if (!rc && !(skip && !strcmp(skip, "rope.dimension_sections")))
        rc = kv_gguf_writer_set_arr(w, "qwen35moe.rope.dimension_sections", KV_GGUF_INT32, sec, 4, d);
    if (!rc) rc = kv_gguf_writer_begin(w, p, d);
    if (!rc) rc = kv_gguf_writer_finish(w, d);
    kv_gguf_writer_free(w);
    if (rc) return 1000 + rc; /* the test's own failure */
    kv_gguf *g = NULL;
    if ((rc = kv_gguf_open(&g, p, d))) return 2000 + rc;
    rc = kv_arch_read_hparams(g, hp, d);
    kv_gguf_close(g);
    remove(p);
    return rc;
}

static void test_keys(void) {
    kv_hparams hp;
    kv_diag d = {0};
    ASSERT_EQ(read_keys(NULL, NULL, 0, &hp, &d), 0);
    ASSERT_EQ(hp.arch, KV_ARCH_QWEN35MOE);
    ASSERT_EQ(hp.n_layer, 4); /* block_count 5 less one MTP block */
    ASSERT_EQ(hp.n_layer_nextn, 1);
    ASSERT_EQ(hp.head_dim, 16);
    ASSERT_EQ(hp.n_ff_shexp, 32);
    ASSERT_EQ(hp.rope_sections[1], 1);
    ASSERT_NEAR(hp.rope_freq_base, 10000.0, 0); /* the table's default */
    ASSERT_NEAR(hp.rope_freq_scale, 1.0, 0);
    ASSERT_TRUE(hp.expert_weights_norm);
    ASSERT_EQ(hp.ssm_d_inner, 64);
    /* each wrong input: its code, a message naming the key, on one line */
    static const struct {
        const char *skip, *over;
        uint32_t val;
        int code;
        const char *msg;
    } bad[] = {
        {"expert_count", NULL, 0, KV_EFORMAT, "qwen35moe.expert_count"},
        {NULL, "expert_count", KV_MAX_EXPERTS + 1, KV_EFORMAT, "out of range"},
        {NULL, "expert_used_count", 9, KV_EFORMAT, "expert_used_count 9 > expert_count 8"},
        {NULL, "ssm.conv_kernel", 1, KV_EFORMAT, "ssm.conv_kernel = 1"},
        {NULL, "nextn_predict_layers", 5, KV_EFORMAT, "nextn_predict_layers = 5 is out of range [0, 4]"},
        {NULL, "attention.value_length", 8, KV_EUNSUPPORTED, "value_length"},
        {NULL, "attention.head_count_kv", 3, KV_EFORMAT, "head_count_kv"},
        {NULL, "ssm.inner_size", 60, KV_EUNSUPPORTED, "inner_size"},
        {NULL, "attention.recurrent_layers", 1, KV_EUNSUPPORTED, "recurrent_layers"},
        {"attention.layer_norm_rms_epsilon", NULL, 0, KV_EFORMAT, "layer_norm_rms_epsilon"},
        {"rope.dimension_sections", NULL, 0, KV_EFORMAT, "rope.dimension_sections"},
        {NULL, "rope.dimension_count", 5, KV_EFORMAT, "rope.dimension_count 5"},
    };
    for (size_t i = 0; i < KVT_N(bad); i++) {
        memset(&d, 0, sizeof d);
        int rc = read_keys(bad[i].skip, bad[i].over, bad[i].val, &hp, &d);
        ASSERT_EQ(rc, bad[i].code);
        if (!strstr(d.msg, bad[i].msg) || strchr(d.msg, '\n'))
            KVT_FAIL("case %zu: message '%s' lacks '%s'", i, d.msg, bad[i].msg);
    }
}

/* ---- files against their table -------------------------------------------- */

/* Anatomy's class for a role, written out here independently of anatomy.c. */
static int role_class(enum kv_role r) {
    switch (r) {
    case KV_ROLE_EMBD: return KV_ANAT_EMBEDDINGS;
    case KV_ROLE_LM_HEAD: return KV_ANAT_LM_HEAD;
    case KV_ROLE_NORM: return KV_ANAT_NORMS;
    case KV_ROLE_ATTN: return KV_ANAT_ATTENTION;
    case KV_ROLE_LINEAR: return KV_ANAT_LINEAR_ATTENTION;
    case KV_ROLE_ROUTER: return KV_ANAT_ROUTER;
    case KV_ROLE_EXPERT: return KV_ANAT_ROUTED_EXPERTS;
    case KV_ROLE_SHEXP: return KV_ANAT_SHARED_EXPERTS;
    case KV_ROLE_MTP: return KV_ANAT_MTP;
    case KV_ROLE_FFN: return KV_ANAT_DENSE_FFN;
    default: return -1;
    }
}

/* Checks every tensor of g against the table; returns how many there are
 * (or -1 if the file could not be read as the table's architecture). */
static long check_file(const kv_gguf *g, bool *tied) {
    kv_hparams hp;
    kv_diag d = {0};
    int rc = kv_arch_read_hparams(g, &hp, &d);
    ASSERT_EQ(rc, 0);
    if (rc) {
        fprintf(stderr, "  %s\n", d.msg);
        return -1;
    }
    const kv_arch_table *a = kv_arch_get(hp.arch);
    const kv_gguf_tensor *te = kv_gguf_find_tensor(g, "token_embd.weight");
    ASSERT_TRUE(te != NULL);
    if (!te) return -1;
    hp.n_vocab = (uint32_t)te->ne[1];
    *tied = kv_gguf_find_tensor(g, "output.weight") == NULL;
    const uint32_t nb = kv_arch_n_blocks(&hp);
    /* every tensor in the file is named by the table, in a block that carries it, with its shape */
    size_t nt = kv_gguf_n_tensors(g);
    for (size_t i = 0; i < nt; i++) {
        const kv_gguf_tensor *t = kv_gguf_tensor_at(g, i);
        int32_t il;
        const kv_tensor_desc *td = kv_arch_match(a, t->name.ptr, t->name.len, &il);
        if (!td) {
            KVT_FAIL("tensor '%.*s' is not in the %s table", (int)t->name.len, t->name.ptr, a->name);
            continue;
        }
        if (td->blocks) ASSERT_TRUE(kv_tensor_in_block(a, td, &hp, (uint32_t)il));
        int64_t ne[3];
        kv_tensor_shape(td, &hp, ne);
        ASSERT_EQ(t->n_dims, td->n_dims);
        for (int k = 0; k < 3; k++) ASSERT_EQ(t->ne[k], ne[k]);
        if (td->flags & (KV_TF_F32 | KV_TF_KEEP_F32)) ASSERT_EQ(t->type, 0); /* f32 */
        /* the table's role and anatomy's name rules agree */
        bool rec = il >= 0 && a->block_kind(&hp, (uint32_t)il) == KV_BLK_RECURRENT;
        ASSERT_EQ(kv_anat_classify(t->name.ptr, t->name.len, rec, NULL), role_class(td->role));
    }
    /* and every tensor the table asks for is in the file */
    long want = 0;
    char name[128];
    for (size_t k = 0; k < a->n_tensors; k++) {
        const kv_tensor_desc *td = &a->tensors[k];
        for (uint32_t il = 0; il < (td->blocks ? nb : 1); il++) {
            if (td->blocks && !kv_tensor_in_block(a, td, &hp, il)) continue;
            if ((td->flags & KV_TF_TIED) && *tied) continue;
            want++;
            ASSERT_TRUE(kv_tensor_name(td, il, name, sizeof name) > 0);
            if (!kv_gguf_find_tensor(g, name) && !(td->flags & KV_TF_OPTIONAL))
                KVT_FAIL("table tensor '%s' missing from the file", name);
        }
    }
    ASSERT_EQ(want, (long)nt);
    /* every "<arch>." key of the file is a key of the table */
    size_t pl = strlen(a->name);
    for (size_t i = 0; i < kv_gguf_n_kv(g); i++) {
        const kv_gguf_kv *kv = kv_gguf_kv_at(g, i);
        if (kv->key.len <= pl + 1 || memcmp(kv->key.ptr, a->name, pl) || kv->key.ptr[pl] != '.') continue;
        bool known = false;
        for (size_t k = 0; k < a->n_keys && !known; k++)
            known = strlen(a->keys[k].key) == kv->key.len - pl - 1 &&
                    !memcmp(a->keys[k].key, kv->key.ptr + pl + 1, kv->key.len - pl - 1);
        if (!known) KVT_FAIL("key '%.*s' is not in the %s table", (int)kv->key.len, kv->key.ptr, a->name);
    }
    return (long)nt;
}

static void gen_and_check(kv_gen_config *c, const char *file, long want_tensors) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", tmpdir, file);
    kv_gen_fill_defaults(c);
    kv_diag d = {0};
    int rc = kv_gen_model(c, p, &d);
    ASSERT_EQ(rc, 0);
    if (rc) {
        fprintf(stderr, "  %s\n", d.msg);
        return;
    }
    kv_gguf *g = NULL;
    ASSERT_EQ(kv_gguf_open(&g, p, &d), 0);
    if (!g) return;
    bool tied = false;
    ASSERT_EQ(check_file(g, &tied), want_tensors);
    ASSERT_EQ(tied, c->tied);
    kv_hparams hp;
    ASSERT_EQ(kv_arch_read_hparams(g, &hp, &d), 0);
    ASSERT_EQ(hp.n_layer, c->n_layer);
    ASSERT_EQ(hp.n_layer_nextn, c->n_nextn);
    ASSERT_EQ(hp.n_embd, c->n_embd);
    ASSERT_EQ(hp.n_expert, c->n_expert);
    ASSERT_EQ(hp.head_dim, c->head_dim);
    kv_gguf_close(g);
    /* the loader, reading the same table, accepts it */
    kv_model *m = NULL;
    rc = kv_model_load(&m, p, &d);
    ASSERT_EQ(rc, 0);
    if (rc) fprintf(stderr, "  %s\n", d.msg);
    if (m) {
        const kv_layer *L = kv_model_layer(m, 0);
        ASSERT_TRUE(L && L->gate_exps.data && L->gate_exps.ne[2] == c->n_expert);
        ASSERT_EQ(kv_model_hparams(m)->tied_output, c->tied);
    }
    kv_model_free(m);
    remove(p);
}

static void test_gen_qwen3moe(void) {
    kv_gen_config c;
    ASSERT_EQ(kv_gen_preset_get("tiny", &c, NULL), 0);
    c.n_layer = 3;
    c.n_embd = 64;
    c.head_dim = 16;
    c.n_ff_exp = 32;
    c.n_vocab = 300;
    gen_and_check(&c, "q3.gguf", 3 + 3 * 12); /* token_embd, output_norm, output; 12 per block */
    c.tied = true;
    gen_and_check(&c, "q3t.gguf", 2 + 3 * 12);
}

static void test_gen_qwen35moe(void) {
    kv_gen_config c;
    ASSERT_EQ(kv_gen_preset_get("tiny", &c, NULL), 0);
    c.arch = "qwen35moe";
    c.n_layer = 4;
    c.n_nextn = 1;
    c.full_attn_interval = 2;
    c.n_embd = 64;
    c.head_dim = 16;
    c.n_ff_exp = 32;
    c.n_vocab = 300;
    /* blocks 0, 2 recurrent (19 tensors), 1, 3 full attention (16), MTP 4 (16 + 4 nextn) */
    gen_and_check(&c, "q35.gguf", 3 + 2 * 19 + 2 * 16 + 20);
}

static void test_skeletons(void) {
    static const struct {
        const char *preset;
        long tensors;
    } sk[] = {
        {"qwen3-30b-a3b", 3 + 48 * 12},
        {"qwen35-35b-a3b", 3 + 30 * 19 + 10 * 16 + 20},
        {"qwen35-122b-a10b", 3 + 36 * 19 + 12 * 16 + 20},
        /* deepseek2: 13 tensors a dense block, 18 a MoE block (router, selection bias, 3 routed, 3 shared) */
        {"deepseek-v3", 3 + 3 * 13 + 58 * 18},
        {"kimi-k2", 3 + 1 * 13 + 60 * 18},
    };
    for (size_t i = 0; i < KVT_N(sk); i++) {
        char p[512];
        snprintf(p, sizeof p, "%s/skel.gguf", tmpdir);
        kv_diag d = {0};
        ASSERT_EQ(kv_skeleton_write(sk[i].preset, p, NULL, &d), 0);
        kv_gguf *g = NULL;
        ASSERT_EQ(kv_gguf_open(&g, p, &d), 0);
        if (!g) continue;
        bool tied = true;
        ASSERT_EQ(check_file(g, &tied), sk[i].tensors);
        ASSERT_TRUE(!tied);
        kv_gguf_close(g);
        remove(p);
    }
}

/* ---- a skeleton's real small tensors -------------------------------------- */

/* Top-k experts of the router of layer il for token tok, computed here from
 * the file's bytes in double: the embedding row (every block adds zero, so
 * it is the hidden state), RMSNorm with post_attention_norm, the router. */
static int route(const kv_gguf *g, uint32_t il, uint32_t tok, uint32_t k, int *top) {
    char n[96];
    const kv_gguf_tensor *te = kv_gguf_find_tensor(g, "token_embd.weight");
    snprintf(n, sizeof n, "blk.%u.post_attention_norm.weight", il);
    const kv_gguf_tensor *tn = kv_gguf_find_tensor(g, n);
    snprintf(n, sizeof n, "blk.%u.ffn_gate_inp.weight", il);
    const kv_gguf_tensor *tr = kv_gguf_find_tensor(g, n);
    if (!te || !tn || !tr || tr->type != 0 || tn->type != 0) return -1;
    const uint64_t E = te->ne[0], X = tr->ne[1];
    const kv_type_info *ti = kv_type_get_ref(te->type);
    float *x = malloc(E * sizeof *x);
    double *logit = malloc(X * sizeof *logit);
    if (!x || !logit || !ti || !ti->to_float) {
        free(x);
        free(logit);
        return -1;
    }
    ti->to_float((const uint8_t *)te->data + tok * kv_type_row_size(te->type, E), x, (int64_t)E);
    double ss = 0;
    for (uint64_t i = 0; i < E; i++) ss += (double)x[i] * x[i];
    const double scale = 1.0 / sqrt(ss / (double)E + 1e-6);
    const float *nw = tn->data, *W = tr->data;
    for (uint64_t e = 0; e < X; e++) {
        double acc = 0;
        for (uint64_t i = 0; i < E; i++) acc += (double)W[e * E + i] * (x[i] * scale * nw[i]);
        logit[e] = acc;
    }
    for (uint32_t j = 0; j < k; j++) { /* selection, ties to the lower id as top-k does */
        int best = -1;
        for (uint64_t e = 0; e < X; e++) {
            bool taken = false;
            for (uint32_t q = 0; q < j; q++) taken |= top[q] == (int)e;
            if (!taken && (best < 0 || logit[e] > logit[best])) best = (int)e;
        }
        top[j] = best;
    }
    free(x);
    free(logit);
    return 0;
}

static void test_skeleton_routing(void) {
    char p[512];
    snprintf(p, sizeof p, "%s/skel35.gguf", tmpdir);
    kv_diag d = {0};
    ASSERT_EQ(kv_skeleton_write("qwen35-35b-a3b", p, NULL, &d), 0);
    kv_gguf *g = NULL;
    ASSERT_EQ(kv_gguf_open(&g, p, &d), 0);
    if (!g) return;
    uint64_t nt = 0;
    const uint8_t *types = NULL;
    ASSERT_EQ(kv_gguf_get_arr(g, "tokenizer.ggml.token_type", KV_GGUF_INT32, &nt, &types, &d), 0);
    /* 48 real tokens, spread over the learned vocabulary */
    uint32_t toks[48], n_tok = 0, n_real = 0;
    for (uint64_t r = 0; r < nt; r++) {
        int32_t ty;
        memcpy(&ty, types + 4 * r, 4);
        n_real += ty != 5;
    }
    for (uint64_t r = 0, i = 0; r < nt && n_tok < 48; r++) {
        int32_t ty;
        memcpy(&ty, types + 4 * r, 4);
        if (ty == 5) continue;
        if (i++ % (n_real / 48 ? n_real / 48 : 1) == 0) toks[n_tok++] = (uint32_t)r;
    }
    ASSERT_EQ(n_tok, 48);
    const uint32_t layers[] = {0, 3, 40}; /* recurrent, full attention, MTP */
    for (size_t li = 0; li < KVT_N(layers); li++) {
        int hits[256] = {0}, distinct = 0, first8 = 0;
        for (uint32_t t = 0; t < n_tok; t++) {
            int top[8];
            ASSERT_EQ(route(g, layers[li], toks[t], 8, top), 0);
            bool low = true;
            for (int j = 0; j < 8; j++) {
                if (top[j] >= 0 && top[j] < 256 && !hits[top[j]]++) distinct++;
                low &= top[j] >= 0 && top[j] < 8;
            }
            first8 += low;
        }
        /* 48 tokens x 8 choices over 256 experts: an all-zero router gives 8 */
        printf("  layer %u: %d distinct experts chosen by %u tokens\n", layers[li], distinct, n_tok);
        ASSERT_TRUE(distinct >= 128);
        ASSERT_EQ(first8, 0);
    }
    /* experts and projections are holes that read as zeros */
    static const char *const holes[] = {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight",
                                        "blk.0.attn_qkv.weight", "blk.3.attn_output.weight", "output.weight"};
    for (size_t i = 0; i < KVT_N(holes); i++) {
        const kv_gguf_tensor *t = kv_gguf_find_tensor(g, holes[i]);
        ASSERT_TRUE(t != NULL);
        if (!t) continue;
        const uint8_t *b = t->data;
        uint64_t nz = 0;
        for (uint64_t o = 0; o < t->nbytes; o += 4093) nz += b[o] != 0;
        ASSERT_EQ(nz, 0);
    }
    kv_gguf_close(g);
    /* and the file stays small on disk */
    struct stat st;
    ASSERT_EQ(stat(p, &st), 0);
    printf("  qwen35-35b-a3b skeleton: %.1f MB on disk of %.1f GB\n", (double)st.st_blocks * 512 / 1e6,
           (double)st.st_size / 1e9);
    ASSERT_TRUE((uint64_t)st.st_blocks * 512 < 48ull << 20);
    /* header only: no tensor data at all */
    ASSERT_EQ(kv_skeleton_write_ex("qwen35-35b-a3b", p, false, NULL, &d), 0);
    ASSERT_EQ(kv_gguf_open(&g, p, &d), 0);
    if (g) {
        int top[8];
        ASSERT_EQ(route(g, 0, toks[0], 8, top), 0);
        for (int j = 0; j < 8; j++) ASSERT_EQ(top[j], j); /* all-zero router: experts 0..7 */
        kv_gguf_close(g);
    }
    remove(p);
}

static const kvt_case cases[] = {
    KVT_CASE(test_registry),
    KVT_CASE(test_match),
    KVT_CASE(test_keys),
    KVT_CASE(test_gen_qwen3moe),
    KVT_CASE(test_gen_qwen35moe),
    KVT_CASE(test_skeletons),
    KVT_CASE(test_skeleton_routing),
};

static int setup(void) {
    const char *t = getenv("TMPDIR");
    snprintf(tmpdir, sizeof tmpdir, "%s/kv_test_arch_XXXXXX", t && *t ? t : "/tmp");
    return mkdtemp(tmpdir) ? 0 : 1;
}

static void teardown(void) { rmdir(tmpdir); }

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
