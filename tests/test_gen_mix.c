/* gen-model's --mix: llama-quantize's tensor-type recipes (Q2_K, Q3_K_M,
 * Q4_K_M, IQ4_XS). The expected types below are written out by hand, tensor
 * by tensor, from llama-quant.cpp's llama_tensor_get_type for each shape
 * (not computed by a rule), and the files written are read back: each
 * tensor's type, general.file_type, the names of the mixes, the block
 * fallbacks, and the values against an F32 file of the same seed. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvasir/gen.h"
#include "kvasir/gguf.h"
#include "kvasir/quant.h"
#include "kvtest.h"

enum { Q2 = KV_TYPE_Q2_K, Q3 = KV_TYPE_Q3_K, Q4 = KV_TYPE_Q4_K, Q5 = KV_TYPE_Q5_K, Q6 = KV_TYPE_Q6_K,
       Q8 = KV_TYPE_Q8_0, IQ = KV_TYPE_IQ4_XS, F32 = KV_TYPE_F32 };

static char dir[64];

static kv_gen_config cfg(uint32_t layers, uint32_t experts, uint32_t heads, uint32_t kv_heads, bool tied) {
    kv_gen_config c;
    memset(&c, 0, sizeof c);
    c.arch = "qwen3moe";
    c.n_layer = layers;
    c.n_embd = 256;
    c.n_ff_exp = 256;
    c.n_expert = experts;
    c.n_expert_used = 2;
    c.n_head = heads;
    c.n_head_kv = kv_heads;
    c.head_dim = 256 / heads;
    c.n_vocab = 1000;
    c.n_ctx = 256;
    c.type = KV_TYPE_F32;
    c.seed = 5;
    c.tied = tied;
    c.n_threads = 2;
    return c;
}

/* Per block: attn_q, attn_k, attn_v, attn_output, gate_exps, up_exps, down_exps. */
typedef struct { uint32_t q, k, v, o, g, u, dn; } blk_types;

static void check_file(const char *path, uint32_t ftype, uint32_t embd, uint32_t out, int n_layer,
                       const blk_types *b) {
    kv_diag d = {0};
    kv_gguf *g = NULL;
    ASSERT_EQ(kv_gguf_open(&g, path, &d), 0);
    if (!g) return;
    uint32_t ft = 0;
    ASSERT_EQ(kv_gguf_get_u32(g, "general.file_type", &ft, &d), 0);
    ASSERT_EQ(ft, ftype);
    const kv_gguf_tensor *t = kv_gguf_find_tensor(g, "token_embd.weight");
    ASSERT_TRUE(t && t->type == embd);
    t = kv_gguf_find_tensor(g, "output.weight");
    if (out == F32)
        ASSERT_TRUE(t == NULL); /* tied */
    else
        ASSERT_TRUE(t && t->type == out);
    static const char *const roles[] = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_exps",
                                        "ffn_up_exps", "ffn_down_exps"};
    for (int il = 0; il < n_layer; il++) {
        const uint32_t want[7] = {b[il].q, b[il].k, b[il].v, b[il].o, b[il].g, b[il].u, b[il].dn};
        for (int r = 0; r < 7; r++) {
            char nm[96];
            snprintf(nm, sizeof nm, "blk.%d.%s.weight", il, roles[r]);
            t = kv_gguf_find_tensor(g, nm);
            ASSERT_TRUE(t != NULL);
            if (t && t->type != want[r])
                KVT_FAIL("%s: %s is %s, want %s", path, nm, kv_type_get_ref(t->type)->name,
                         kv_type_get_ref(want[r])->name);
            kvt_checks++;
        }
        char nm[96];
        snprintf(nm, sizeof nm, "blk.%d.ffn_gate_inp.weight", il);
        t = kv_gguf_find_tensor(g, nm);
        ASSERT_TRUE(t && t->type == F32); /* the router is never quantized */
    }
    kv_gguf_close(g);
}

/* Largest |a - b| / rms(b) between a tensor of two files. */
static double rel_err(const char *pa, const char *pb, const char *name) {
    kv_diag d = {0};
    kv_gguf *a = NULL, *b = NULL;
    if (kv_gguf_open(&a, pa, &d) || kv_gguf_open(&b, pb, &d)) {
        kv_gguf_close(a);
        return INFINITY;
    }
    const kv_gguf_tensor *ta = kv_gguf_find_tensor(a, name), *tb = kv_gguf_find_tensor(b, name);
    double e = INFINITY;
    if (ta && tb && tb->type == F32) {
        const size_t n = (size_t)(ta->ne[0] * ta->ne[1] * ta->ne[2]);
        float *x = malloc(n * sizeof(float));
        kv_type_get_ref(ta->type)->to_float(ta->data, x, (int64_t)n);
        const float *y = tb->data;
        double se = 0, sy = 0;
        for (size_t i = 0; i < n; i++) se += (x[i] - (double)y[i]) * (x[i] - (double)y[i]), sy += (double)y[i] * y[i];
        e = sqrt(se / sy);
        free(x);
    }
    kv_gguf_close(a);
    kv_gguf_close(b);
    return e;
}

static void gen(kv_gen_config *c, const char *name, char *path, size_t cap) {
    snprintf(path, cap, "%s/%s.gguf", dir, name);
    kv_diag d = {0};
    const int rc = kv_gen_model(c, path, &d);
    if (rc) KVT_FAIL("gen %s: %s", name, d.msg);
    kvt_checks++;
}

static void test_names(void) {
    ASSERT_EQ(kv_gen_mix_from_name("q2_k"), KV_GEN_MIX_Q2_K);
    ASSERT_EQ(kv_gen_mix_from_name("Q3_K_M"), KV_GEN_MIX_Q3_K_M);
    ASSERT_EQ(kv_gen_mix_from_name("q4_k_m"), KV_GEN_MIX_Q4_K_M);
    ASSERT_EQ(kv_gen_mix_from_name("iq4_xs"), KV_GEN_MIX_IQ4_XS);
    ASSERT_EQ(kv_gen_mix_from_name("q5_k_m"), -1);
    ASSERT_EQ(kv_gen_mix_from_name(NULL), -1);
    ASSERT_STREQ(kv_gen_mix_name(KV_GEN_MIX_IQ4_XS), "iq4_xs");
    ASSERT_TRUE(kv_gen_mix_name(0) == NULL && kv_gen_mix_name(99) == NULL);
    ASSERT_EQ(kv_gen_mix_ftype(KV_GEN_MIX_Q2_K), 10);
    ASSERT_EQ(kv_gen_mix_ftype(KV_GEN_MIX_Q3_K_M), 12);
    ASSERT_EQ(kv_gen_mix_ftype(KV_GEN_MIX_Q4_K_M), 15);
    ASSERT_EQ(kv_gen_mix_ftype(KV_GEN_MIX_IQ4_XS), 30);
    kv_gen_config c = cfg(2, 8, 4, 2, false);
    c.mix = 99;
    kv_diag d = {0};
    ASSERT_EQ(kv_gen_validate(&c, &d), KV_EINVAL);
    ASSERT_TRUE(strstr(d.msg, "mix") != NULL);
}

/* llama-quant.cpp's fallbacks for rows that do not fit a 256 block. */
static void test_fallback(void) {
    const kv_gen_mix_ctx m = {.n_layer_all = 4, .n_expert = 16, .n_gqa = 2};
    ASSERT_EQ(kv_gen_mix_type(KV_GEN_MIX_Q2_K, "blk.1.attn_q.weight", 320, &m), KV_TYPE_Q4_0);
    ASSERT_EQ(kv_gen_mix_type(KV_GEN_MIX_Q4_K_M, "blk.3.ffn_down_exps.weight", 320, &m), KV_TYPE_Q8_0); /* Q6_K */
    ASSERT_EQ(kv_gen_mix_type(KV_GEN_MIX_Q2_K, "output.weight", 320, &m), KV_TYPE_Q8_0);
    ASSERT_EQ(kv_gen_mix_type(KV_GEN_MIX_Q2_K, "blk.1.attn_q.weight", 100, &m), KV_TYPE_F16);
    /* Q4_K -> Q5_0 and IQ4_XS -> IQ4_NL where gen-model writes them, else Q8_0 */
    const uint32_t q50 = kv_type_get_ref(KV_TYPE_Q5_0)->from_float ? KV_TYPE_Q5_0 : KV_TYPE_Q8_0;
    const uint32_t nl = kv_type_get_ref(KV_TYPE_IQ4_NL)->from_float ? KV_TYPE_IQ4_NL : KV_TYPE_Q8_0;
    ASSERT_EQ(kv_gen_mix_type(KV_GEN_MIX_Q4_K_M, "blk.1.attn_q.weight", 320, &m), q50);
    ASSERT_EQ(kv_gen_mix_type(KV_GEN_MIX_IQ4_XS, "blk.1.attn_q.weight", 320, &m), nl);
}

/* 16 blocks, 16 experts, n_gqa 2, untied: the per-layer rules. */
static void test_mixes_16_blocks(void) {
    char p[128], pf[128];
    kv_gen_config c = cfg(16, 16, 4, 2, false);
    gen(&c, "f32-16", pf, sizeof pf);
    blk_types b[16];
    /* Q2_K: attn_v Q3_K (n_gqa < 4), attn_output Q3_K, ffn_down Q3_K */
    for (int i = 0; i < 16; i++) b[i] = (blk_types){Q2, Q2, Q3, Q3, Q2, Q2, Q3};
    c.mix = KV_GEN_MIX_Q2_K;
    gen(&c, "q2_k-16", p, sizeof p);
    check_file(p, 10, Q2, Q6, 16, b);
    ASSERT_TRUE(rel_err(p, pf, "blk.3.ffn_up_exps.weight") < 0.40);
    ASSERT_TRUE(rel_err(p, pf, "blk.3.ffn_down_exps.weight") < 0.22);
    /* Q3_K_M: attn_v Q5_K in the first two, then Q4_K; attn_output Q4_K;
     * ffn_down Q5_K in block 0 (< 16/16), then Q4_K */
    for (int i = 0; i < 16; i++) b[i] = (blk_types){Q3, Q3, i < 2 ? Q5 : Q4, Q4, Q3, Q3, i < 1 ? Q5 : Q4};
    c.mix = KV_GEN_MIX_Q3_K_M;
    gen(&c, "q3_k_m-16", p, sizeof p);
    check_file(p, 12, Q3, Q6, 16, b);
    ASSERT_TRUE(rel_err(p, pf, "blk.3.ffn_gate_exps.weight") < 0.22);
    /* Q4_K_M: attn_v and ffn_down Q6_K where "more bits": blocks 0, 1, 4, 7, 10, 13, 14, 15 */
    static const int more[16] = {1, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 1, 1};
    for (int i = 0; i < 16; i++) b[i] = (blk_types){Q4, Q4, more[i] ? Q6 : Q4, Q4, Q4, Q4, more[i] ? Q6 : Q4};
    c.mix = KV_GEN_MIX_Q4_K_M;
    gen(&c, "q4_k_m-16", p, sizeof p);
    check_file(p, 15, Q4, Q6, 16, b);
    /* IQ4_XS: ffn_down Q5_K in blocks 0, 1 (< 16/8); attn_v stays (n_gqa < 4) */
    for (int i = 0; i < 16; i++) b[i] = (blk_types){IQ, IQ, IQ, IQ, IQ, IQ, i < 2 ? Q5 : IQ};
    c.mix = KV_GEN_MIX_IQ4_XS;
    gen(&c, "iq4_xs-16", p, sizeof p);
    check_file(p, 30, IQ, Q6, 16, b);
    ASSERT_TRUE(rel_err(p, pf, "blk.5.ffn_up_exps.weight") < 0.12);
}

/* 2 blocks, 8 experts (llama.cpp's Mixtral rules), n_gqa 4, tied. */
static void test_mixes_8_experts_tied(void) {
    char p[128];
    kv_gen_config c = cfg(2, 8, 8, 2, true);
    blk_types b[2];
    /* 8 experts: attn_v and attn_k Q8_0, attn_output Q5_K; tied: token_embd Q6_K */
    for (int i = 0; i < 2; i++) b[i] = (blk_types){Q2, Q8, Q8, Q5, Q2, Q2, Q3};
    c.mix = KV_GEN_MIX_Q2_K;
    gen(&c, "q2_k-8", p, sizeof p);
    check_file(p, 10, Q6, F32, 2, b);
    for (int i = 0; i < 2; i++) b[i] = (blk_types){IQ, Q8, Q8, Q5, IQ, IQ, IQ};
    c.mix = KV_GEN_MIX_IQ4_XS;
    gen(&c, "iq4_xs-8", p, sizeof p);
    check_file(p, 30, Q6, F32, 2, b);
    /* 16 experts, n_gqa 4: Q2_K's attn_v Q4_K, IQ4_XS's Q5_K */
    c = cfg(2, 16, 8, 2, false);
    for (int i = 0; i < 2; i++) b[i] = (blk_types){Q2, Q2, Q4, Q3, Q2, Q2, Q3};
    c.mix = KV_GEN_MIX_Q2_K;
    gen(&c, "q2_k-gqa4", p, sizeof p);
    check_file(p, 10, Q2, Q6, 2, b);
    for (int i = 0; i < 2; i++) b[i] = (blk_types){IQ, IQ, Q5, IQ, IQ, IQ, IQ};
    c.mix = KV_GEN_MIX_IQ4_XS;
    gen(&c, "iq4_xs-gqa4", p, sizeof p);
    check_file(p, 30, IQ, Q6, 2, b);
}

/* --type with the new types: every matrix in it, file types 10, 11, 30. */
static void test_plain_types(void) {
    static const struct { uint32_t t, ft; } ts[] = {{Q2, 10}, {Q3, 11}, {IQ, 30}};
    for (size_t i = 0; i < 3; i++) {
        char p[128];
        kv_gen_config c = cfg(2, 8, 4, 2, false);
        c.type = ts[i].t;
        gen(&c, kv_type_get_ref(ts[i].t)->name, p, sizeof p);
        blk_types b[2];
        for (int k = 0; k < 2; k++) b[k] = (blk_types){ts[i].t, ts[i].t, ts[i].t, ts[i].t, ts[i].t, ts[i].t, ts[i].t};
        check_file(p, ts[i].ft, ts[i].t, ts[i].t, 2, b);
    }
}

static const kvt_case cases[] = {
    KVT_CASE(test_names), KVT_CASE(test_fallback), KVT_CASE(test_mixes_16_blocks),
    KVT_CASE(test_mixes_8_experts_tied), KVT_CASE(test_plain_types),
};

int main(int argc, char **argv) {
    snprintf(dir, sizeof dir, "/tmp/kv-gen-mix-XXXXXX");
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    const int rc = kvt_run(argc, argv, cases, KVT_N(cases));
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
    return rc;
}
