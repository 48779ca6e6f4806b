/* Synthetic model generator tests.
 *
 * - A tiny qwen3moe model is generated and reopened with kv_gguf_open:
 *   every key llama.cpp reads is present with the type llama.cpp demands
 *   (u32 counts, f32 epsilon/base, string/int32 arrays) and the right value;
 *   the special token ids name <|im_end|> / <|endoftext|>; every tensor has
 *   the name, shape and type llama.cpp's qwen3moe loader expects.
 * - Weight statistics match the documented scales (f32 model: mean and std
 *   of norms and matrices).
 * - Determinism: the same seed gives identical bytes (with 1 and 3 threads),
 *   another seed differs (in data, not in header).
 * - --tied omits output.weight; untied has it.
 * - Quantized models: matrices get the type, norms and router stay f32,
 *   rows that do not fit the block fall back (q4_K -> q8_0 -> f16), and the
 *   dequantized weights match the f32 model of the same seed (the type
 *   changes rounding only).
 * - Validation and the CLI: bad configurations and flags give one-line
 *   errors and exit status 1; --help succeeds. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvasir/gen.h"
#include "kvasir/gguf.h"
#include "kvasir/quant.h"
#include "kvtest.h"

static char tmpdir[256];

static kv_gen_config small_cfg(void) {
    kv_gen_config c;
    kv_diag d = {0};
    if (kv_gen_preset_get("tiny", &c, &d)) abort();
    c.n_vocab = 512; /* keeps training fast */
    c.n_threads = 1;
    c.log = NULL;
    return c;
}

static uint8_t *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *p = malloc((size_t)n + 1);
    if (fread(p, 1, (size_t)n, f) != (size_t)n) {
        free(p);
        p = NULL;
    }
    fclose(f);
    *len = (size_t)n;
    return p;
}

static void check_u32(const kv_gguf *g, const char *key, uint32_t want) {
    const kv_gguf_kv *kv = kv_gguf_find_kv(g, key);
    if (!kv) {
        KVT_FAIL("missing key %s", key);
        return;
    }
    ASSERT_EQ(kv->val.type, KV_GGUF_UINT32); /* llama.cpp's get_key demands the exact type */
    if (kv->val.v.u64 != want) KVT_FAIL("%s = %llu, want %u", key, (unsigned long long)kv->val.v.u64, want);
    kvt_checks++;
}

static void check_f32(const kv_gguf *g, const char *key, float want) {
    const kv_gguf_kv *kv = kv_gguf_find_kv(g, key);
    if (!kv) {
        KVT_FAIL("missing key %s", key);
        return;
    }
    ASSERT_EQ(kv->val.type, KV_GGUF_FLOAT32);
    ASSERT_TRUE((float)kv->val.v.f64 == want);
}

static void check_str(const kv_gguf *g, const char *key, const char *want) {
    kv_str s;
    kv_diag d = {0};
    ASSERT_EQ(kv_gguf_get_str(g, key, &s, &d), 0);
    if (!kv_str_eq(s, want)) KVT_FAIL("%s is '%.*s', want '%s'", key, (int)s.len, s.ptr, want);
}

static const kv_gguf_tensor *check_tensor(const kv_gguf *g, const char *name, uint32_t n_dims,
                                          uint64_t ne0, uint64_t ne1, uint64_t ne2, uint32_t type) {
    const kv_gguf_tensor *t = kv_gguf_find_tensor(g, name);
    if (!t) {
        KVT_FAIL("missing tensor %s", name);
        return NULL;
    }
    uint64_t ne[3] = {ne0, ne1, ne2};
    ASSERT_EQ(t->n_dims, n_dims);
    for (uint32_t j = 0; j < n_dims; j++)
        if (t->ne[j] != ne[j]) KVT_FAIL("%s ne[%u] = %llu, want %llu", name, j, (unsigned long long)t->ne[j],
                                        (unsigned long long)ne[j]);
    if (t->type != type) KVT_FAIL("%s has type %u, want %u", name, t->type, type);
    kvt_checks++;
    return t;
}

/* Checks the whole qwen3moe layout of a model generated from c. */
static void check_model(const char *path, const kv_gen_config *c, int expect_output) {
    kv_gguf *g = NULL;
    kv_diag d = {0};
    int rc = kv_gguf_open(&g, path, &d);
    if (rc) KVT_FAIL("open %s: %s", path, d.msg);
    ASSERT_EQ(rc, 0);
    if (!g) return;

    check_str(g, "general.architecture", "qwen3moe");
    check_u32(g, "qwen3moe.context_length", c->n_ctx);
    check_u32(g, "qwen3moe.embedding_length", c->n_embd);
    check_u32(g, "qwen3moe.block_count", c->n_layer);
    check_u32(g, "qwen3moe.feed_forward_length", c->n_ff_exp * c->n_expert_used);
    check_u32(g, "qwen3moe.expert_feed_forward_length", c->n_ff_exp);
    check_u32(g, "qwen3moe.expert_count", c->n_expert);
    check_u32(g, "qwen3moe.expert_used_count", c->n_expert_used);
    check_u32(g, "qwen3moe.attention.head_count", c->n_head);
    check_u32(g, "qwen3moe.attention.head_count_kv", c->n_head_kv);
    check_u32(g, "qwen3moe.attention.key_length", c->head_dim);
    check_u32(g, "qwen3moe.attention.value_length", c->head_dim);
    check_f32(g, "qwen3moe.attention.layer_norm_rms_epsilon", 1e-6f);
    check_f32(g, "qwen3moe.rope.freq_base", 1e6f);
    check_str(g, "tokenizer.ggml.model", "gpt2");
    check_str(g, "tokenizer.ggml.pre", "qwen2");

    /* vocabulary */
    const kv_gguf_kv *toks = kv_gguf_find_kv(g, "tokenizer.ggml.tokens");
    ASSERT_TRUE(toks && toks->val.type == KV_GGUF_ARRAY && toks->val.v.arr.elem_type == KV_GGUF_STRING);
    uint64_t n_types = 0;
    const uint8_t *types = NULL;
    ASSERT_EQ(kv_gguf_get_arr(g, "tokenizer.ggml.token_type", KV_GGUF_INT32, &n_types, &types, &d), 0);
    const kv_gguf_kv *merges = kv_gguf_find_kv(g, "tokenizer.ggml.merges");
    ASSERT_TRUE(merges && merges->val.type == KV_GGUF_ARRAY && merges->val.v.arr.elem_type == KV_GGUF_STRING);
    if (merges) ASSERT_TRUE(merges->val.v.arr.n > 0);
    if (toks) {
        ASSERT_EQ(toks->val.v.arr.n, c->n_vocab);
        ASSERT_EQ(n_types, c->n_vocab);
        uint32_t eos = 0, bos = 0, pad = 0;
        ASSERT_EQ(kv_gguf_get_u32(g, "tokenizer.ggml.eos_token_id", &eos, &d), 0);
        ASSERT_EQ(kv_gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &bos, &d), 0);
        ASSERT_EQ(kv_gguf_get_u32(g, "tokenizer.ggml.padding_token_id", &pad, &d), 0);
        kv_str s = {0};
        ASSERT_EQ(kv_gguf_arr_str(&toks->val, eos, &s), 0);
        ASSERT_TRUE(kv_str_eq(s, "<|im_end|>"));
        ASSERT_EQ(kv_gguf_arr_str(&toks->val, bos, &s), 0);
        ASSERT_TRUE(kv_str_eq(s, "<|endoftext|>"));
        ASSERT_EQ(pad, bos);
        /* the three specials exist, are CONTROL (3), and are unique */
        int found[3] = {0, 0, 0};
        const char *sp[3] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
        size_t pos = 0;
        for (uint64_t i = 0; i < toks->val.v.arr.n; i++) {
            if (kv_gguf_arr_str_iter(&toks->val, &pos, &s)) break;
            for (int k = 0; k < 3; k++)
                if (kv_str_eq(s, sp[k])) {
                    found[k]++;
                    int32_t ty;
                    memcpy(&ty, types + 4 * i, 4);
                    ASSERT_EQ(ty, 3);
                }
        }
        for (int k = 0; k < 3; k++) ASSERT_EQ(found[k], 1);
    }
    bool add_bos = true;
    ASSERT_EQ(kv_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &add_bos, &d), 0);
    ASSERT_TRUE(!add_bos);
    kv_str tmpl;
    ASSERT_EQ(kv_gguf_get_str(g, "tokenizer.chat_template", &tmpl, &d), 0);
    ASSERT_TRUE(tmpl.len > 0 && memmem(tmpl.ptr, tmpl.len, "<|im_start|>", 12) != NULL);

    /* tensors */
    uint64_t E = c->n_embd, V = c->n_vocab, Q = (uint64_t)c->n_head * c->head_dim,
             KVd = (uint64_t)c->n_head_kv * c->head_dim, F = c->n_ff_exp, X = c->n_expert;
    uint32_t T = c->type, F32 = KV_TYPE_F32;
    const uint32_t T6 = c->q6_mix ? KV_TYPE_Q6_K : T; /* the q4_k_m mix's Q6_K matrices */
    ASSERT_EQ(kv_gguf_n_tensors(g), 2 + 12 * (size_t)c->n_layer + (expect_output ? 1 : 0));
    check_tensor(g, "token_embd.weight", 2, E, V, 1, kv_gen_matrix_type(T, E));
    check_tensor(g, "output_norm.weight", 1, E, 1, 1, F32);
    if (expect_output)
        check_tensor(g, "output.weight", 2, E, V, 1, kv_gen_matrix_type(T6, E));
    else
        ASSERT_TRUE(kv_gguf_find_tensor(g, "output.weight") == NULL);
    for (uint32_t i = 0; i < c->n_layer; i++) {
        char nm[96];
#define N(s) (snprintf(nm, sizeof nm, "blk.%u." s, i), nm)
        check_tensor(g, N("attn_norm.weight"), 1, E, 1, 1, F32);
        check_tensor(g, N("attn_q.weight"), 2, E, Q, 1, kv_gen_matrix_type(T, E));
        check_tensor(g, N("attn_k.weight"), 2, E, KVd, 1, kv_gen_matrix_type(T, E));
        check_tensor(g, N("attn_v.weight"), 2, E, KVd, 1, kv_gen_matrix_type(T6, E));
        check_tensor(g, N("attn_output.weight"), 2, Q, E, 1, kv_gen_matrix_type(T, Q));
        check_tensor(g, N("attn_q_norm.weight"), 1, c->head_dim, 1, 1, F32);
        check_tensor(g, N("attn_k_norm.weight"), 1, c->head_dim, 1, 1, F32);
        check_tensor(g, N("ffn_norm.weight"), 1, E, 1, 1, F32);
        check_tensor(g, N("ffn_gate_inp.weight"), 2, E, X, 1, F32);
        check_tensor(g, N("ffn_gate_exps.weight"), 3, E, F, X, kv_gen_matrix_type(T, E));
        check_tensor(g, N("ffn_up_exps.weight"), 3, E, F, X, kv_gen_matrix_type(T, E));
        check_tensor(g, N("ffn_down_exps.weight"), 3, F, E, X, kv_gen_matrix_type(T6, F));
#undef N
    }
    kv_gguf_close(g);
}

/* mean and std of an f32 tensor */
static void stats(const kv_gguf_tensor *t, double *mean, double *std) {
    const float *p = t->data;
    uint64_t n = t->nbytes / 4;
    double s = 0, s2 = 0;
    for (uint64_t i = 0; i < n; i++) {
        s += p[i];
        s2 += (double)p[i] * p[i];
    }
    *mean = s / (double)n;
    *std = sqrt(s2 / (double)n - *mean * *mean);
}

static void test_weights(const char *path, const kv_gen_config *c) {
    kv_gguf *g = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_gguf_open(&g, path, &d), 0);
    if (!g) return;
    double m, s;
    const kv_gguf_tensor *t;
    if ((t = kv_gguf_find_tensor(g, "blk.0.attn_norm.weight"))) {
        stats(t, &m, &s);
        ASSERT_NEAR(m, 1.0, 0.03);
        ASSERT_NEAR(s, 0.1, 0.02);
    }
    if ((t = kv_gguf_find_tensor(g, "blk.1.attn_q_norm.weight"))) {
        stats(t, &m, &s);
        ASSERT_NEAR(m, 1.5, 0.08);
    }
    struct {
        const char *name;
        double std;
    } mats[] = {
        {"token_embd.weight", 3.0 / sqrt(c->n_embd)},
        {"output.weight", 3.0 / sqrt(c->n_embd)},
        {"blk.0.attn_q.weight", 1.0 / sqrt(c->n_embd)},
        {"blk.1.attn_output.weight", 2.5 / sqrt((double)c->n_head * c->head_dim)},
        {"blk.0.ffn_gate_inp.weight", 2.0 / sqrt(c->n_embd)},
        {"blk.0.ffn_up_exps.weight", 1.0 / sqrt(c->n_embd)},
        {"blk.1.ffn_down_exps.weight", 5.0 / sqrt(c->n_ff_exp)},
    };
    for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++) {
        t = kv_gguf_find_tensor(g, mats[i].name);
        ASSERT_TRUE(t != NULL);
        if (!t) continue;
        stats(t, &m, &s);
        ASSERT_NEAR(m, 0.0, 0.05 * mats[i].std);
        ASSERT_NEAR(s / mats[i].std, 1.0, 0.03);
    }
    /* different tensors are not the same stream */
    const kv_gguf_tensor *a = kv_gguf_find_tensor(g, "blk.0.ffn_gate_exps.weight"),
                         *b = kv_gguf_find_tensor(g, "blk.0.ffn_up_exps.weight");
    if (a && b) ASSERT_TRUE(memcmp(a->data, b->data, 64) != 0);
    kv_gguf_close(g);
}

/* Dequantized weights of a quantized model against the f32 model of the
 * same seed: relative RMS error within the type's rounding. */
static void compare_dequant(const char *qpath, const char *fpath, const char *name, double tol) {
    kv_gguf *q = NULL, *f = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_gguf_open(&q, qpath, &d), 0);
    ASSERT_EQ(kv_gguf_open(&f, fpath, &d), 0);
    const kv_gguf_tensor *tq = q ? kv_gguf_find_tensor(q, name) : NULL;
    const kv_gguf_tensor *tf = f ? kv_gguf_find_tensor(f, name) : NULL;
    ASSERT_TRUE(tq && tf);
    if (tq && tf) {
        const kv_type_info *ti = kv_type_get_ref(tq->type);
        uint64_t n = tf->nbytes / 4;
        float *deq = malloc(n * sizeof *deq);
        ASSERT_TRUE(ti && ti->to_float);
        if (ti && ti->to_float && deq) {
            ti->to_float(tq->data, deq, (int64_t)n);
            const float *ref = tf->data;
            double e2 = 0, r2 = 0;
            for (uint64_t i = 0; i < n; i++) {
                double e = (double)deq[i] - ref[i];
                e2 += e * e;
                r2 += (double)ref[i] * ref[i];
            }
            double rel = sqrt(e2 / r2);
            if (!(rel < tol)) KVT_FAIL("%s: relative RMS error %g >= %g", name, rel, tol);
            kvt_checks++;
        }
        free(deq);
    }
    kv_gguf_close(q);
    kv_gguf_close(f);
}

static int run_cli(const char *args, char *err, size_t cap) {
    const char *bin = getenv("KV_BIN");
    if (!bin) return -1;
    char cmd[2048], ef[400];
    snprintf(ef, sizeof ef, "%s/stderr.txt", tmpdir);
    snprintf(cmd, sizeof cmd, "%s gen-model %s >/dev/null 2>%s", bin, args, ef);
    int st = system(cmd);
    size_t n = 0;
    uint8_t *e = slurp(ef, &n);
    if (err && cap) {
        size_t k = e ? (n < cap - 1 ? n : cap - 1) : 0;
        if (k) memcpy(err, e, k);
        err[k] = 0;
    }
    free(e);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int count_lines(const char *s) {
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

static void test_cli(void) {
    const char *bin = getenv("KV_BIN");
    if (!bin) {
        KVT_FAIL("KV_BIN is not set (ctest sets it to the kvasir binary)");
        return;
    }
    char err[4096], args[1024], p[400];
    ASSERT_EQ(run_cli("--help", err, sizeof err), 0);
    struct {
        const char *args, *needle;
    } bad[] = {
        {"--arch llama --out x.gguf", "llama"},
        {"--preset nope --out x.gguf", "nope"},
        {"--heads 6 --kv-heads 4 --out x.gguf", "kv-heads"},
        {"--experts 4 --experts-used 5 --out x.gguf", "experts-used"},
        {"--head-dim 63 --out x.gguf", "even"},
        {"--vocab 100 --out x.gguf", "--vocab"},
        {"--layers 0 --out x.gguf", "--layers"},
        {"--layers abc --out x.gguf", "--layers"},
        {"--embd 99999999 --out x.gguf", "--embd"},
        {"--type iq2_xxs --out x.gguf", "--type"}, /* a type gen-model does not write */
        {"--seed -1 --out x.gguf", "--seed"},
        {"--bogus --out x.gguf", "--bogus"},
        {"--layers 2", "--out"},
        {"--out", "--out"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = run_cli(bad[i].args, err, sizeof err);
        if (rc != 1) KVT_FAIL("'%s': exit %d, want 1 (%s)", bad[i].args, rc, err);
        if (count_lines(err) != 1) KVT_FAIL("'%s': %d lines of error: %s", bad[i].args, count_lines(err), err);
        if (!strstr(err, bad[i].needle)) KVT_FAIL("'%s': error lacks '%s': %s", bad[i].args, bad[i].needle, err);
        kvt_checks += 3;
    }
    /* a real run through the CLI: tied, q8_0, flags override the preset */
    snprintf(p, sizeof p, "%s/cli_tied.gguf", tmpdir);
    snprintf(args, sizeof args,
             "--arch qwen3moe --out %s --preset tiny --layers 1 --embd 64 --ff-exp 96 --experts 4 "
             "--experts-used 2 --heads 2 --kv-heads 1 --head-dim 32 --vocab 400 --ctx 128 --type q8_0 --seed 5 --tied",
             p);
    ASSERT_EQ(run_cli(args, err, sizeof err), 0);
    kv_gen_config c = small_cfg();
    c.n_layer = 1;
    c.n_embd = 64;
    c.n_ff_exp = 96;
    c.n_expert = 4;
    c.n_expert_used = 2;
    c.n_head = 2;
    c.n_head_kv = 1;
    c.head_dim = 32;
    c.n_vocab = 400;
    c.n_ctx = 128;
    c.type = KV_TYPE_Q8_0;
    c.tied = true;
    check_model(p, &c, 0);
    /* an unwritable output: exit 2, one line, nothing left behind */
    ASSERT_EQ(run_cli("--layers 1 --vocab 300 --out /nonexistent-dir/x.gguf", err, sizeof err), 2);
    ASSERT_EQ(count_lines(err), 1);
}

static void test_validate(void) {
    kv_diag d = {0};
    kv_gen_config c = small_cfg();
    ASSERT_EQ(kv_gen_validate(&c, &d), 0);
    kv_gen_config b = c;
    b.arch = "llama";
    ASSERT_EQ(kv_gen_validate(&b, &d), KV_EUNSUPPORTED);
    b = c;
    b.n_head = 6;
    b.n_head_kv = 4;
    ASSERT_EQ(kv_gen_validate(&b, &d), KV_EINVAL);
    b = c;
    b.n_expert_used = b.n_expert + 1;
    ASSERT_EQ(kv_gen_validate(&b, &d), KV_EINVAL);
    b = c;
    b.head_dim = 33;
    ASSERT_EQ(kv_gen_validate(&b, &d), KV_EINVAL);
    b = c;
    b.n_vocab = 258;
    ASSERT_EQ(kv_gen_validate(&b, &d), KV_EINVAL);
    b = c;
    b.type = KV_TYPE_IQ2_XXS; /* no quantizer */
    ASSERT_EQ(kv_gen_validate(&b, &d), KV_EUNSUPPORTED);
    b = c;
    b.n_layer = 0;
    ASSERT_EQ(kv_gen_validate(&b, &d), KV_EINVAL);
    b = c; /* 512 layers of 1024 experts of 65536 x 131072: far over the size cap */
    b.n_layer = KV_GEN_MAX_LAYER;
    b.n_expert = KV_GEN_MAX_EXPERT;
    b.n_embd = KV_GEN_MAX_EMBD;
    b.n_ff_exp = KV_GEN_MAX_FF;
    ASSERT_EQ(kv_gen_validate(&b, &d), KV_EINVAL);
    ASSERT_TRUE(strstr(d.msg, "GiB") != NULL);

    ASSERT_EQ(kv_gen_matrix_type(KV_TYPE_Q4_K, 256), KV_TYPE_Q4_K);
    ASSERT_EQ(kv_gen_matrix_type(KV_TYPE_Q4_K, 128), KV_TYPE_Q8_0);
    ASSERT_EQ(kv_gen_matrix_type(KV_TYPE_Q6_K, 96), KV_TYPE_Q8_0);
    ASSERT_EQ(kv_gen_matrix_type(KV_TYPE_Q5_K, 48), KV_TYPE_F16);
    ASSERT_EQ(kv_gen_matrix_type(KV_TYPE_Q8_0, 48), KV_TYPE_F16);
    ASSERT_EQ(kv_gen_matrix_type(KV_TYPE_F32, 7), KV_TYPE_F32);

    size_t n;
    const kv_gen_preset *p = kv_gen_presets(&n);
    ASSERT_TRUE(n >= 3);
    for (size_t i = 0; i < n; i++) {
        kv_gen_config pc;
        ASSERT_EQ(kv_gen_preset_get(p[i].name, &pc, &d), 0);
        ASSERT_EQ(kv_gen_validate(&pc, &d), 0);
    }
    kv_gen_config bench;
    ASSERT_EQ(kv_gen_preset_get("qwen3-30b-a3b-bench", &bench, &d), 0);
    ASSERT_EQ(bench.n_embd, 2048);
    ASSERT_EQ(bench.n_expert, 128);
    ASSERT_EQ(bench.n_expert_used, 8);
    ASSERT_EQ(bench.n_ff_exp, 768);
    ASSERT_EQ(bench.n_head, 32);
    ASSERT_EQ(bench.n_head_kv, 4);
    ASSERT_EQ(bench.head_dim, 128);
    ASSERT_EQ(bench.n_vocab, 151936);
    ASSERT_EQ(kv_gen_preset_get("nope", &bench, &d), KV_ENOTFOUND);
}

static char pa[400], pb[400], pc[400], pt[400], pq[400], pf[400], pm[400];

/* a tiny untied f32 model, twice with one seed and once with another */
static void test_seeds(void) {
    kv_diag d = {0};
    kv_gen_config c = small_cfg();
    int rc = kv_gen_model(&c, pa, &d);
    if (rc) KVT_FAIL("gen: %s", d.msg);
    ASSERT_EQ(rc, 0);
    check_model(pa, &c, 1);
    test_weights(pa, &c);
    ASSERT_EQ(access(pa, F_OK), 0);
    char part[420];
    snprintf(part, sizeof part, "%s.part", pa);
    ASSERT_TRUE(access(part, F_OK) != 0);

    kv_gen_config c1 = c; /* same seed, other thread count: same bytes */
    c1.n_threads = c.n_threads == 3 ? 1 : 3;
    ASSERT_EQ(kv_gen_model(&c1, pb, &d), 0);
    kv_gen_config c2 = c;
    c2.seed = c.seed + 1;
    ASSERT_EQ(kv_gen_model(&c2, pc, &d), 0);
    size_t la = 0, lb = 0, lc = 0;
    uint8_t *ba = slurp(pa, &la), *bb = slurp(pb, &lb), *bc = slurp(pc, &lc);
    ASSERT_TRUE(ba && bb && bc);
    if (ba && bb && bc) {
        ASSERT_EQ(la, lb);
        ASSERT_TRUE(la == lb && memcmp(ba, bb, la) == 0);
        ASSERT_EQ(la, lc); /* same shapes, same size */
        kv_gguf *g = NULL;
        ASSERT_EQ(kv_gguf_open(&g, pa, &d), 0);
        size_t hdr = g ? (size_t)kv_gguf_data_offset(g) : 0;
        kv_gguf_close(g);
        ASSERT_TRUE(memcmp(ba, bc, hdr) == 0);          /* header identical */
        ASSERT_TRUE(memcmp(ba + hdr, bc + hdr, la - hdr) != 0); /* weights differ */
    }
    free(ba);
    free(bb);
    free(bc);
}

static void test_tied(void) {
    kv_diag d = {0};
    kv_gen_config ct = small_cfg();
    ct.tied = true;
    ASSERT_EQ(kv_gen_model(&ct, pt, &d), 0);
    check_model(pt, &ct, 0);
}

/* quantized with fallbacks: q4_K matrices; ff-exp 128 rows -> q8_0 */
static void test_quantized(void) {
    kv_diag d = {0};
    kv_gen_config cq = small_cfg();
    cq.n_ff_exp = 128;
    cq.type = KV_TYPE_Q4_K;
    int rc = kv_gen_model(&cq, pq, &d);
    if (rc) KVT_FAIL("gen q4_K: %s", d.msg);
    check_model(pq, &cq, 1);
    kv_gen_config cf = cq;
    cf.type = KV_TYPE_F32;
    ASSERT_EQ(kv_gen_model(&cf, pf, &d), 0);
    compare_dequant(pq, pf, "blk.0.ffn_up_exps.weight", 0.12);  /* q4_K */
    compare_dequant(pq, pf, "blk.1.ffn_down_exps.weight", 0.02); /* q8_0 fallback */
    compare_dequant(pq, pf, "token_embd.weight", 0.12);
    compare_dequant(pq, pf, "blk.0.ffn_gate_inp.weight", 1e-12); /* f32, identical */
}

/* --type q4_k_m: llama.cpp's Q4_K_M mix, ffn_down*, attn_v and output in
 * Q6_K, the other matrices Q4_K; file type 15 (MOSTLY_Q4_K_M) */
static void test_q4_k_m(void) {
    kv_diag d = {0};
    kv_gen_config cm = small_cfg();
    cm.type = KV_TYPE_Q4_K;
    cm.q6_mix = true;
    int rc = kv_gen_model(&cm, pm, &d);
    if (rc) KVT_FAIL("gen q4_k_m: %s", d.msg);
    check_model(pm, &cm, 1);
    kv_gguf *g = NULL;
    ASSERT_EQ(kv_gguf_open(&g, pm, &d), 0);
    if (!g) return;
    check_u32(g, "general.file_type", 15);
    static const struct { const char *name; uint32_t type; } want[] = {
        {"blk.0.ffn_down_exps.weight", KV_TYPE_Q6_K}, {"blk.1.ffn_down_exps.weight", KV_TYPE_Q6_K},
        {"blk.0.attn_v.weight", KV_TYPE_Q6_K},       {"output.weight", KV_TYPE_Q6_K},
        {"blk.0.ffn_up_exps.weight", KV_TYPE_Q4_K},  {"blk.0.ffn_gate_exps.weight", KV_TYPE_Q4_K},
        {"blk.0.attn_q.weight", KV_TYPE_Q4_K},       {"blk.0.attn_k.weight", KV_TYPE_Q4_K},
        {"token_embd.weight", KV_TYPE_Q4_K},         {"blk.0.ffn_gate_inp.weight", KV_TYPE_F32},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const kv_gguf_tensor *t = kv_gguf_find_tensor(g, want[i].name);
        ASSERT_TRUE(t != NULL);
        if (t && t->type != want[i].type) KVT_FAIL("%s: type %u, want %u", want[i].name, t->type, want[i].type);
    }
    kv_gguf_close(g);
    kv_gen_config cf = cm;
    cf.type = KV_TYPE_F32;
    cf.q6_mix = false;
    ASSERT_EQ(kv_gen_model(&cf, pf, &d), 0);
    compare_dequant(pm, pf, "blk.0.ffn_down_exps.weight", 0.03); /* q6_K */
    compare_dequant(pm, pf, "blk.0.ffn_up_exps.weight", 0.12);   /* q4_K */
}

/* a vocabulary larger than the corpus teaches: padding (UNUSED) tokens
 * get all-zero rows in token_embd and output, real tokens do not */
static void test_padding_rows(void) {
    kv_diag d = {0};
    kv_gen_config cv = small_cfg();
    cv.n_vocab = 5000;
    cv.n_layer = 1;
    char pv[400];
    snprintf(pv, sizeof pv, "%s/v.gguf", tmpdir);
    ASSERT_EQ(kv_gen_model(&cv, pv, &d), 0);
    kv_gguf *g = NULL;
    ASSERT_EQ(kv_gguf_open(&g, pv, &d), 0);
    if (g) {
        uint64_t nt = 0;
        const uint8_t *types = NULL;
        ASSERT_EQ(kv_gguf_get_arr(g, "tokenizer.ggml.token_type", KV_GGUF_INT32, &nt, &types, &d), 0);
        const char *names[2] = {"token_embd.weight", "output.weight"};
        uint64_t n_unused = 0, bad = 0;
        for (int k = 0; k < 2; k++) {
            const kv_gguf_tensor *t = kv_gguf_find_tensor(g, names[k]);
            if (!t || nt != cv.n_vocab) break;
            const float *w = t->data;
            for (uint64_t r = 0; r < nt; r++) {
                int32_t ty;
                memcpy(&ty, types + 4 * r, 4);
                int zero = 1;
                for (uint64_t i = 0; i < cv.n_embd; i++) zero &= w[r * cv.n_embd + i] == 0.0f;
                if (ty == 5) n_unused++;
                if (zero != (ty == 5)) bad++;
            }
        }
        ASSERT_TRUE(n_unused > 0); /* the corpus does not fill 5000 tokens */
        ASSERT_EQ(bad, 0);
        kv_gguf_close(g);
    }
}

/* an unwritable path fails cleanly */
static void test_unwritable(void) {
    kv_diag d = {0};
    kv_gen_config c = small_cfg();
    ASSERT_EQ(kv_gen_model(&c, "/nonexistent-dir-kv/m.gguf", &d), KV_EIO);
}

static const kvt_case cases[] = {
    KVT_CASE(test_validate), KVT_CASE(test_seeds),      KVT_CASE(test_tied),       KVT_CASE(test_quantized), KVT_CASE(test_q4_k_m),
    KVT_CASE(test_padding_rows), KVT_CASE(test_unwritable), KVT_CASE(test_cli),
};

static int setup(void) {
    const char *t = getenv("TMPDIR");
    snprintf(tmpdir, sizeof tmpdir, "%s/kv_test_gen_XXXXXX", t && *t ? t : "/tmp");
    if (!mkdtemp(tmpdir)) return 1;
    snprintf(pa, sizeof pa, "%s/a.gguf", tmpdir);
    snprintf(pb, sizeof pb, "%s/b.gguf", tmpdir);
    snprintf(pc, sizeof pc, "%s/c.gguf", tmpdir);
    snprintf(pt, sizeof pt, "%s/t.gguf", tmpdir);
    snprintf(pq, sizeof pq, "%s/q.gguf", tmpdir);
    snprintf(pf, sizeof pf, "%s/f.gguf", tmpdir);
    snprintf(pm, sizeof pm, "%s/m.gguf", tmpdir);
    return 0;
}

static void teardown(void) {
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", tmpdir);
}

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
