/* Model anatomy and skeleton tests.
 *
 * - inspect figures on a small generated qwen3moe model (q4_K and q8_0)
 *   equal a naive recomputation from the tensor list: bytes = row size x
 *   rows per tensor, summed per class by plain name rules written here, the
 *   slab count n_layer x n_expert, and one expert's bytes from the three
 *   expert matrices' shapes;
 * - classes of synthetic qwen35moe / other tensor names (recurrent attn_qkv
 *   is linear attention, MTP glue is MTP, the shared gate is shared experts);
 * - the Q4_K_M rule on hand-picked tensors;
 * - the three skeleton presets: tensor count, the metadata values of the
 *   real configs, names/shapes/types of chosen tensors against the values
 *   of issue 3 (n_embd 3072, 256 experts, n_ff_exp 1024, ...), 12,544 slabs
 *   of 5,308,416 / 6,119,424 bytes on the 122B, the file is sparse (blocks
 *   allocated << size), and measuring it reads no tensor data (the data
 *   section is mapped PROT_NONE: any read would fault);
 * - inspect --json parses and carries the same figures;
 * - errors: truncated file, non-GGUF, missing file give one-line errors
 *   (library and CLI). */
#include <fcntl.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvasir/anatomy.h"
#include "kvasir/gen.h"
#include "kvasir/gguf.h"
#include "kvasir/quant.h"
#include "kvtest.h"

static char tmpdir[256];
static const char *g_bin;

static void path_in(char *out, size_t cap, const char *name) { snprintf(out, cap, "%s/%s", tmpdir, name); }

/* ---- naive reference -------------------------------------------------- */

/* Class by plain substring rules (independent of the library's parser). */
static int naive_class(const char *n) {
    if (strstr(n, "_exps")) return KV_ANAT_ROUTED_EXPERTS;
    if (strstr(n, "_shexp")) return KV_ANAT_SHARED_EXPERTS;
    if (strstr(n, "ffn_gate_inp")) return KV_ANAT_ROUTER;
    if (strstr(n, "norm")) return KV_ANAT_NORMS;
    if (strstr(n, ".attn_")) return KV_ANAT_ATTENTION;
    if (!strcmp(n, "token_embd.weight")) return KV_ANAT_EMBEDDINGS;
    if (!strcmp(n, "output.weight")) return KV_ANAT_LM_HEAD;
    return KV_ANAT_OTHER;
}

static uint64_t naive_bytes(const kv_gguf_tensor *t) {
    return kv_type_row_size(t->type, t->ne[0]) * t->ne[1] * t->ne[2] * t->ne[3];
}

static void check_generated(uint32_t type, const char *file) {
    kv_gen_config c;
    kv_diag d = {0};
    ASSERT_EQ(kv_gen_preset_get("tiny", &c, &d), 0);
    c.n_layer = 3;
    c.n_expert = 6;
    c.n_vocab = 512;
    c.n_threads = 1;
    c.type = type;
    c.log = NULL;
    char p[512];
    path_in(p, sizeof p, file);
    ASSERT_EQ(kv_gen_model(&c, p, &d), 0);

    kv_gguf *g = NULL;
    ASSERT_EQ(kv_gguf_open(&g, p, &d), 0);
    if (!g) return;
    kv_anatomy *a = NULL;
    ASSERT_EQ(kv_anatomy_from_gguf(&a, g, &d), 0);
    if (!a) {
        kv_gguf_close(g);
        return;
    }
    uint64_t cls[KV_ANAT_CLASS_COUNT] = {0}, total = 0;
    for (size_t i = 0; i < kv_gguf_n_tensors(g); i++) {
        const kv_gguf_tensor *t = kv_gguf_tensor_at(g, i);
        char name[128];
        snprintf(name, sizeof name, "%.*s", (int)t->name.len, t->name.ptr);
        cls[naive_class(name)] += naive_bytes(t);
        total += naive_bytes(t);
    }
    for (int k = 0; k < KV_ANAT_CLASS_COUNT; k++) ASSERT_EQ(a->class_bytes[k], cls[k]);
    ASSERT_EQ(a->tensor_bytes, total);
    ASSERT_EQ(a->n_tensors, kv_gguf_n_tensors(g));
    ASSERT_STREQ(a->arch, "qwen3moe");
    ASSERT_EQ(a->block_count, 3);
    ASSERT_EQ(a->n_layers, 3);
    ASSERT_EQ(a->n_moe_layers, 3);
    ASSERT_EQ(a->n_slabs, 3 * 6);
    /* one expert: gate and up are n_ff_exp rows of n_embd, down n_embd rows
     * of n_ff_exp, all of the matrix type (tiny's sizes fit every block) */
    uint64_t ex = 2 * c.n_ff_exp * kv_type_row_size(type, c.n_embd) + c.n_embd * kv_type_row_size(type, c.n_ff_exp);
    ASSERT_EQ(a->expert_min, ex);
    ASSERT_EQ(a->expert_max, ex);
    ASSERT_NEAR(a->expert_mean, (double)ex, 1e-6);
    ASSERT_EQ(a->n_combos, 1);
    ASSERT_EQ(a->combos[0].n_slabs, 18);
    ASSERT_EQ(a->combos[0].n_layers, 3);
    char want[96];
    const char *tn = kv_type_get_ref(type)->name;
    snprintf(want, sizeof want, "gate %s, up %s, down %s", tn, tn, tn);
    ASSERT_STREQ(a->combos[0].types, want);
    for (size_t i = 0; i < a->n_layers; i++) {
        ASSERT_EQ(a->layers[i].index, i);
        ASSERT_EQ(a->layers[i].kind, KV_ANAT_LAYER_ATTN | KV_ANAT_LAYER_MOE);
        ASSERT_EQ(a->layers[i].bytes[KV_ANAT_ROUTED_EXPERTS], 6 * ex);
    }
    /* types: the matrix type and f32 (norms and router), summing to all */
    uint64_t tsum = 0;
    for (size_t i = 0; i < a->n_types; i++) tsum += a->types[i].bytes;
    ASSERT_EQ(tsum, total);
    ASSERT_EQ(a->n_types, type == KV_TYPE_F32 ? 1 : 2);
    kv_anatomy_free(a);
    kv_gguf_close(g);
}

/* ---- classes ---------------------------------------------------------- */

static void check_classes(void) {
    static const struct {
        const char *name;
        bool recurrent;
        int cls;
        int32_t layer;
    } cases[] = {
        {"token_embd.weight", false, KV_ANAT_EMBEDDINGS, -1},
        {"output.weight", false, KV_ANAT_LM_HEAD, -1},
        {"output_norm.weight", false, KV_ANAT_NORMS, -1},
        {"rope_freqs.weight", false, KV_ANAT_OTHER, -1},
        {"blk.0.attn_qkv.weight", true, KV_ANAT_LINEAR_ATTENTION, 0},
        {"blk.0.attn_gate.weight", true, KV_ANAT_LINEAR_ATTENTION, 0},
        {"blk.0.ssm_conv1d.weight", true, KV_ANAT_LINEAR_ATTENTION, 0},
        {"blk.0.ssm_a", true, KV_ANAT_LINEAR_ATTENTION, 0},
        {"blk.0.ssm_dt.bias", true, KV_ANAT_LINEAR_ATTENTION, 0},
        {"blk.0.ssm_norm.weight", true, KV_ANAT_LINEAR_ATTENTION, 0},
        {"blk.0.ssm_alpha.weight", true, KV_ANAT_LINEAR_ATTENTION, 0},
        {"blk.0.ssm_beta.weight", true, KV_ANAT_LINEAR_ATTENTION, 0},
        {"blk.0.ssm_out.weight", true, KV_ANAT_LINEAR_ATTENTION, 0},
        {"blk.0.attn_norm.weight", true, KV_ANAT_NORMS, 0},
        {"blk.0.post_attention_norm.weight", true, KV_ANAT_NORMS, 0},
        {"blk.3.attn_q.weight", false, KV_ANAT_ATTENTION, 3},
        {"blk.3.attn_qkv.weight", false, KV_ANAT_ATTENTION, 3}, /* fused attention elsewhere */
        {"blk.3.attn_output.weight", false, KV_ANAT_ATTENTION, 3},
        {"blk.3.attn_q_norm.weight", false, KV_ANAT_NORMS, 3},
        {"blk.47.ffn_gate_exps.weight", false, KV_ANAT_ROUTED_EXPERTS, 47},
        {"blk.47.ffn_down_exps.weight", false, KV_ANAT_ROUTED_EXPERTS, 47},
        {"blk.47.ffn_gate_up_exps.weight", false, KV_ANAT_ROUTED_EXPERTS, 47},
        {"blk.47.ffn_up_shexp.weight", false, KV_ANAT_SHARED_EXPERTS, 47},
        {"blk.47.ffn_gate_inp_shexp.weight", false, KV_ANAT_SHARED_EXPERTS, 47},
        {"blk.47.ffn_gate_inp.weight", false, KV_ANAT_ROUTER, 47},
        {"blk.47.exp_probs_b.bias", false, KV_ANAT_ROUTER, 47},
        {"blk.48.nextn.eh_proj.weight", false, KV_ANAT_MTP, 48},
        {"blk.48.nextn.shared_head_norm.weight", false, KV_ANAT_MTP, 48},
        {"blk.2.ffn_up.weight", false, KV_ANAT_DENSE_FFN, 2},
        {"blk.2.mystery.weight", false, KV_ANAT_OTHER, 2},
        {"blk.x.attn_q.weight", false, KV_ANAT_OTHER, -1},
        {"blk.99999.attn_q.weight", false, KV_ANAT_OTHER, -1}, /* beyond KV_ANAT_MAX_LAYERS */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int32_t layer = 7;
        int c = kv_anat_classify(cases[i].name, strlen(cases[i].name), cases[i].recurrent, &layer);
        if (c != cases[i].cls) fprintf(stderr, "  class of %s: %s\n", cases[i].name, kv_anat_class_id(c));
        ASSERT_EQ(c, cases[i].cls);
        ASSERT_EQ(layer, cases[i].layer);
    }
    ASSERT_STREQ(kv_anat_class_id(KV_ANAT_ROUTED_EXPERTS), "routed_experts");
    ASSERT_STREQ(kv_anat_class_id(99), "?");
}

/* ---- Q4_K_M rule ------------------------------------------------------ */

static void check_q4km(void) {
    uint64_t mat[4] = {3072, 1024, 256, 1}, down[4] = {1024, 3072, 256, 1}, vec[4] = {3072, 1, 1, 1};
    uint64_t odd[4] = {100, 64, 1, 1}, odd2[4] = {96, 64, 1, 1};
    /* 49 blocks: layers 0-5, 8, 11, ..., 41, 42-48 get more bits */
    ASSERT_EQ(kv_skeleton_q4_k_m_type("blk.0.ffn_down_exps.weight", 3, down, KV_TYPE_BF16, 0, 49, 49, false), KV_TYPE_Q6_K);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("blk.6.ffn_down_exps.weight", 3, down, KV_TYPE_BF16, 0, 49, 49, false), KV_TYPE_Q4_K);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("blk.8.ffn_down_exps.weight", 3, down, KV_TYPE_BF16, 0, 49, 49, false), KV_TYPE_Q6_K);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("blk.41.ffn_down_shexp.weight", 2, down, KV_TYPE_BF16, 0, 49, 49, false), KV_TYPE_Q6_K);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("blk.40.ffn_down_exps.weight", 3, down, KV_TYPE_BF16, 0, 49, 49, false), KV_TYPE_Q4_K);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("blk.42.ffn_down_exps.weight", 3, down, KV_TYPE_BF16, 0, 49, 49, false), KV_TYPE_Q6_K);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("blk.40.ffn_gate_exps.weight", 3, mat, KV_TYPE_BF16, 0, 49, 49, false), KV_TYPE_Q4_K);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("blk.5.attn_qkv.weight", 2, mat, KV_TYPE_BF16, 5, 49, 49, false), KV_TYPE_Q6_K);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("blk.6.attn_qkv.weight", 2, mat, KV_TYPE_BF16, 6, 49, 49, false), KV_TYPE_Q4_K);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("blk.7.attn_v.weight", 2, mat, KV_TYPE_BF16, 7, 49, 49, false), KV_TYPE_Q4_K);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("blk.11.attn_v.weight", 2, mat, KV_TYPE_BF16, 11, 49, 49, false), KV_TYPE_Q6_K);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("output.weight", 2, mat, KV_TYPE_BF16, 0, 49, 49, false), KV_TYPE_Q6_K);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("token_embd.weight", 2, mat, KV_TYPE_BF16, 0, 49, 49, false), KV_TYPE_Q4_K);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("token_embd.weight", 2, mat, KV_TYPE_BF16, 0, 49, 49, true), KV_TYPE_Q6_K);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("blk.0.ffn_gate_inp.weight", 2, mat, KV_TYPE_F32, 0, 49, 49, false), KV_TYPE_F32);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("blk.0.ssm_conv1d.weight", 2, mat, KV_TYPE_F32, 0, 49, 49, false), KV_TYPE_F32);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("blk.0.attn_norm.weight", 1, vec, KV_TYPE_F32, 0, 49, 49, false), KV_TYPE_F32);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("blk.0.ssm_a", 1, vec, KV_TYPE_F32, 0, 49, 49, false), KV_TYPE_F32);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("blk.0.ssm_alpha.weight", 2, mat, KV_TYPE_BF16, 0, 49, 49, false), KV_TYPE_Q4_K);
    /* fallbacks for rows that do not fit 256 */
    ASSERT_EQ(kv_skeleton_q4_k_m_type("blk.9.attn_q.weight", 2, odd2, KV_TYPE_BF16, 0, 49, 49, false), KV_TYPE_Q5_0);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("output.weight", 2, odd2, KV_TYPE_BF16, 0, 49, 49, false), KV_TYPE_Q8_0);
    ASSERT_EQ(kv_skeleton_q4_k_m_type("blk.9.attn_q.weight", 2, odd, KV_TYPE_BF16, 0, 49, 49, false), KV_TYPE_F16);
}

/* ---- skeletons -------------------------------------------------------- */

static const kv_gguf_tensor *tensor(const kv_gguf *g, const char *name) {
    const kv_gguf_tensor *t = kv_gguf_find_tensor(g, name);
    if (!t) KVT_FAIL("tensor %s missing", name);
    return t;
}

static void check_t(const kv_gguf *g, const char *name, uint64_t n0, uint64_t n1, uint64_t n2, uint32_t type) {
    const kv_gguf_tensor *t = tensor(g, name);
    if (!t) return;
    uint32_t nd = n2 > 1 ? 3 : n1 > 1 ? 2 : 1;
    if (t->ne[0] != n0 || t->ne[1] != n1 || t->ne[2] != n2 || t->type != type || t->n_dims != nd)
        fprintf(stderr, "  %s: got [%llu,%llu,%llu] type %u dims %u\n", name, (unsigned long long)t->ne[0],
                (unsigned long long)t->ne[1], (unsigned long long)t->ne[2], t->type, t->n_dims);
    ASSERT_EQ(t->n_dims, nd);
    ASSERT_EQ(t->ne[0], n0);
    ASSERT_EQ(t->ne[1], n1);
    ASSERT_EQ(t->ne[2], n2);
    ASSERT_EQ(t->type, type);
}

static void check_key(const kv_gguf *g, const char *key, uint32_t want) {
    uint32_t v = 0;
    kv_diag d = {0};
    int rc = kv_gguf_get_u32(g, key, &v, &d);
    if (rc) fprintf(stderr, "  %s: %s\n", key, d.msg);
    ASSERT_EQ(rc, 0);
    ASSERT_EQ(v, want);
}

/* Measures the file at path with its data section unreadable: the header is
 * copied into a mapping whose pages past the header are PROT_NONE. */
static void check_no_data_read(const char *path, uint64_t want_slabs) {
    kv_gguf *g = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_gguf_open(&g, path, &d), 0);
    if (!g) return;
    uint64_t size = kv_gguf_file_size(g), hdr = kv_gguf_data_offset(g);
    kv_gguf_close(g);
    long pg = sysconf(_SC_PAGESIZE);
    size_t hdr_pages = (size_t)((hdr + (uint64_t)pg - 1) / (uint64_t)pg * (uint64_t)pg);
    uint8_t *m = mmap(NULL, (size_t)size + (size_t)pg, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    ASSERT_TRUE(m != MAP_FAILED);
    if (m == MAP_FAILED) return;
    ASSERT_EQ(mprotect(m, hdr_pages, PROT_READ | PROT_WRITE), 0);
    int fd = open(path, O_RDONLY);
    ASSERT_TRUE(fd >= 0);
    ASSERT_EQ(pread(fd, m, (size_t)hdr, 0), (long long)hdr);
    close(fd);
    ASSERT_EQ(mprotect(m, hdr_pages, PROT_READ), 0);
    /* the tensor data of the first tensors may share the header's last page;
     * everything beyond is unreadable, so any read of data would fault */
    ASSERT_EQ(kv_gguf_open_mem(&g, m, (size_t)size, &d), 0);
    kv_anatomy *a = NULL;
    if (g) ASSERT_EQ(kv_anatomy_from_gguf(&a, g, &d), 0);
    if (a) ASSERT_EQ(a->n_slabs, want_slabs);
    kv_anatomy_free(a);
    kv_gguf_close(g);
    munmap(m, (size_t)size + (size_t)pg);
}

static void check_skeleton_122b(void) {
    char p[512];
    path_in(p, sizeof p, "q122.gguf");
    kv_diag d = {0};
    int rc = kv_skeleton_write("qwen35-122b-a10b", p, NULL, &d);
    if (rc) fprintf(stderr, "  skeleton: %s\n", d.msg);
    ASSERT_EQ(rc, 0);
    kv_gguf *g = NULL;
    ASSERT_EQ(kv_gguf_open(&g, p, &d), 0);
    if (!g) return;

    /* 3 global; 36 linear blocks x 19; 12 full-attention blocks x 16; MTP 20 */
    ASSERT_EQ(kv_gguf_n_tensors(g), 3 + 36 * 19 + 12 * 16 + 20);
    kv_str s;
    ASSERT_EQ(kv_gguf_get_str(g, "general.architecture", &s, &d), 0);
    ASSERT_TRUE(kv_str_eq(s, "qwen35moe"));
    ASSERT_EQ(kv_gguf_get_str(g, "tokenizer.ggml.pre", &s, &d), 0);
    ASSERT_TRUE(kv_str_eq(s, "qwen35"));
    check_key(g, "general.file_type", 15);
    check_key(g, "qwen35moe.block_count", 49);
    check_key(g, "qwen35moe.nextn_predict_layers", 1);
    check_key(g, "qwen35moe.embedding_length", 3072);
    check_key(g, "qwen35moe.context_length", 262144);
    check_key(g, "qwen35moe.attention.head_count", 32);
    check_key(g, "qwen35moe.attention.head_count_kv", 2);
    check_key(g, "qwen35moe.attention.key_length", 256);
    check_key(g, "qwen35moe.attention.value_length", 256);
    check_key(g, "qwen35moe.expert_count", 256);
    check_key(g, "qwen35moe.expert_used_count", 8);
    check_key(g, "qwen35moe.expert_feed_forward_length", 1024);
    check_key(g, "qwen35moe.expert_shared_feed_forward_length", 1024);
    check_key(g, "qwen35moe.ssm.conv_kernel", 4);
    check_key(g, "qwen35moe.ssm.state_size", 128);
    check_key(g, "qwen35moe.ssm.group_count", 16);
    check_key(g, "qwen35moe.ssm.time_step_rank", 64);
    check_key(g, "qwen35moe.ssm.inner_size", 8192);
    check_key(g, "qwen35moe.full_attention_interval", 4);
    check_key(g, "qwen35moe.rope.dimension_count", 64);
    float f = 0;
    ASSERT_EQ(kv_gguf_get_f32(g, "qwen35moe.rope.freq_base", &f, &d), 0);
    ASSERT_NEAR(f, 1e7, 1);
    uint64_t n = 0;
    const uint8_t *arr = NULL;
    ASSERT_EQ(kv_gguf_get_arr(g, "qwen35moe.rope.dimension_sections", KV_GGUF_INT32, &n, &arr, &d), 0);
    ASSERT_EQ(n, 4);
    if (arr && n == 4) {
        int32_t sec[4];
        memcpy(sec, arr, sizeof sec);
        ASSERT_EQ(sec[0], 11);
        ASSERT_EQ(sec[1], 11);
        ASSERT_EQ(sec[2], 10);
        ASSERT_EQ(sec[3], 0);
    }
    const kv_gguf_kv *tok = kv_gguf_find_kv(g, "tokenizer.ggml.tokens");
    ASSERT_TRUE(tok != NULL);
    if (tok) ASSERT_EQ(tok->val.v.arr.n, 248320);

    /* tensors: the shapes llama.cpp's qwen35moe loader creates, Q4_K_M types */
    check_t(g, "token_embd.weight", 3072, 248320, 1, KV_TYPE_Q4_K);
    check_t(g, "output.weight", 3072, 248320, 1, KV_TYPE_Q6_K);
    check_t(g, "output_norm.weight", 3072, 1, 1, KV_TYPE_F32);
    check_t(g, "blk.0.attn_qkv.weight", 3072, 2 * 16 * 128 + 64 * 128, 1, KV_TYPE_Q6_K);
    check_t(g, "blk.6.attn_qkv.weight", 3072, 12288, 1, KV_TYPE_Q4_K);
    check_t(g, "blk.0.attn_gate.weight", 3072, 64 * 128, 1, KV_TYPE_Q4_K);
    check_t(g, "blk.0.ssm_conv1d.weight", 4, 12288, 1, KV_TYPE_F32);
    check_t(g, "blk.0.ssm_a", 64, 1, 1, KV_TYPE_F32);
    check_t(g, "blk.0.ssm_dt.bias", 64, 1, 1, KV_TYPE_F32);
    check_t(g, "blk.0.ssm_alpha.weight", 3072, 64, 1, KV_TYPE_Q4_K);
    check_t(g, "blk.0.ssm_norm.weight", 128, 1, 1, KV_TYPE_F32);
    check_t(g, "blk.0.ssm_out.weight", 8192, 3072, 1, KV_TYPE_Q4_K);
    check_t(g, "blk.3.attn_q.weight", 3072, 32 * 256 * 2, 1, KV_TYPE_Q4_K);
    check_t(g, "blk.3.attn_k.weight", 3072, 2 * 256, 1, KV_TYPE_Q4_K);
    check_t(g, "blk.3.attn_v.weight", 3072, 2 * 256, 1, KV_TYPE_Q6_K);
    check_t(g, "blk.7.attn_v.weight", 3072, 512, 1, KV_TYPE_Q4_K);
    check_t(g, "blk.3.attn_output.weight", 32 * 256, 3072, 1, KV_TYPE_Q4_K);
    check_t(g, "blk.3.attn_q_norm.weight", 256, 1, 1, KV_TYPE_F32);
    check_t(g, "blk.0.ffn_gate_inp.weight", 3072, 256, 1, KV_TYPE_F32);
    check_t(g, "blk.0.ffn_gate_exps.weight", 3072, 1024, 256, KV_TYPE_Q4_K);
    check_t(g, "blk.0.ffn_up_exps.weight", 3072, 1024, 256, KV_TYPE_Q4_K);
    check_t(g, "blk.0.ffn_down_exps.weight", 1024, 3072, 256, KV_TYPE_Q6_K);
    check_t(g, "blk.6.ffn_down_exps.weight", 1024, 3072, 256, KV_TYPE_Q4_K);
    check_t(g, "blk.47.ffn_down_exps.weight", 1024, 3072, 256, KV_TYPE_Q6_K);
    check_t(g, "blk.6.ffn_down_shexp.weight", 1024, 3072, 1, KV_TYPE_Q4_K);
    check_t(g, "blk.0.ffn_gate_inp_shexp.weight", 3072, 1, 1, KV_TYPE_F32);
    check_t(g, "blk.0.ffn_gate_shexp.weight", 3072, 1024, 1, KV_TYPE_Q4_K);
    check_t(g, "blk.48.attn_q.weight", 3072, 16384, 1, KV_TYPE_Q4_K);
    check_t(g, "blk.48.ffn_down_exps.weight", 1024, 3072, 256, KV_TYPE_Q6_K);
    check_t(g, "blk.48.nextn.eh_proj.weight", 6144, 3072, 1, KV_TYPE_Q4_K);
    check_t(g, "blk.48.nextn.enorm.weight", 3072, 1, 1, KV_TYPE_F32);
    ASSERT_TRUE(kv_gguf_find_tensor(g, "blk.3.attn_qkv.weight") == NULL);
    ASSERT_TRUE(kv_gguf_find_tensor(g, "blk.48.ssm_out.weight") == NULL);

    kv_anatomy *a = NULL;
    ASSERT_EQ(kv_anatomy_from_gguf(&a, g, &d), 0);
    if (a) {
        ASSERT_EQ(a->n_moe_layers, 49);
        ASSERT_EQ(a->n_slabs, 12544);
        /* gate+up: 1024 rows x 12 q4_K blocks of 144 B; down: 3072 rows x 4
         * blocks, q4_K (144 B) or q6_K (210 B) */
        ASSERT_EQ(a->expert_min, 2 * 1024 * 12 * 144 + 3072 * 4 * 144);
        ASSERT_EQ(a->expert_max, 2 * 1024 * 12 * 144 + 3072 * 4 * 210);
        ASSERT_EQ(a->expert_min, 5308416);
        ASSERT_EQ(a->expert_max, 6119424);
        ASSERT_EQ(a->n_combos, 2);
        if (a->n_combos == 2) {
            ASSERT_STREQ(a->combos[0].types, "gate q4_K, up q4_K, down q6_K");
            ASSERT_EQ(a->combos[0].n_layers, 25);
            ASSERT_EQ(a->combos[0].n_slabs, 25 * 256);
            ASSERT_EQ(a->combos[1].n_layers, 24);
        }
        ASSERT_EQ(a->class_bytes[KV_ANAT_ROUTED_EXPERTS], 256ull * (25 * 6119424ull + 24 * 5308416ull));
        double share = (double)a->class_bytes[KV_ANAT_ROUTED_EXPERTS] / (double)a->tensor_bytes;
        ASSERT_TRUE(share > 0.94 && share < 0.95);
        ASSERT_EQ(a->class_tensors[KV_ANAT_MTP], 4);
        ASSERT_EQ(a->class_tensors[KV_ANAT_LINEAR_ATTENTION], 36 * 9);
        ASSERT_EQ(a->n_layers, 49);
        if (a->n_layers == 49) {
            ASSERT_EQ(a->layers[0].kind, KV_ANAT_LAYER_LINEAR | KV_ANAT_LAYER_MOE);
            ASSERT_EQ(a->layers[3].kind, KV_ANAT_LAYER_ATTN | KV_ANAT_LAYER_MOE);
            ASSERT_TRUE(a->layers[48].kind & KV_ANAT_LAYER_MTP);
        }
        ASSERT_TRUE(a->file_size > 75000000000ull);
    }
    kv_anatomy_free(a);
    kv_gguf_close(g);

    /* sparse: the data are holes */
    struct stat st;
    ASSERT_EQ(stat(p, &st), 0);
    ASSERT_TRUE((uint64_t)st.st_size > 75000000000ull);
    ASSERT_TRUE((uint64_t)st.st_blocks * 512 < 64ull << 20);
    check_no_data_read(p, 12544);

    /* the CLI, in JSON */
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "'%s' inspect '%s' --json > '%s/q122.json'", g_bin, p, tmpdir);
    ASSERT_EQ(system(cmd), 0);
    snprintf(cmd, sizeof cmd, "%s/q122.json", tmpdir);
    json_error_t je;
    json_t *j = json_load_file(cmd, 0, &je);
    ASSERT_TRUE(j != NULL);
    if (j) {
        json_t *ex = json_object_get(j, "experts");
        ASSERT_EQ(json_integer_value(json_object_get(ex, "slabs")), 12544);
        ASSERT_EQ(json_integer_value(json_object_get(ex, "bytes_min")), 5308416);
        ASSERT_EQ(json_integer_value(json_object_get(ex, "bytes_max")), 6119424);
        json_t *c0 = json_array_get(json_object_get(j, "classes"), 0);
        ASSERT_STREQ(json_string_value(json_object_get(c0, "class")), "routed_experts");
        ASSERT_TRUE(json_real_value(json_object_get(c0, "share")) > 0.94);
        ASSERT_EQ(json_array_size(json_object_get(j, "layers")), 49);
        json_decref(j);
    }
    snprintf(cmd, sizeof cmd, "'%s' inspect '%s' > /dev/null", g_bin, p);
    ASSERT_EQ(system(cmd), 0);
    unlink(p);
}

static void check_skeleton_other(const char *preset, size_t n_tensors, uint32_t n_moe, uint32_t n_expert,
                                 uint64_t ex_min, uint64_t ex_max) {
    char p[512];
    path_in(p, sizeof p, "other.gguf");
    kv_diag d = {0};
    ASSERT_EQ(kv_skeleton_write(preset, p, NULL, &d), 0);
    kv_anatomy *a = NULL;
    ASSERT_EQ(kv_anatomy_open(&a, p, &d), 0);
    if (a) {
        ASSERT_EQ(a->n_tensors, n_tensors);
        ASSERT_EQ(a->n_moe_layers, n_moe);
        ASSERT_EQ(a->n_slabs, (uint64_t)n_moe * n_expert);
        ASSERT_EQ(a->expert_min, ex_min);
        ASSERT_EQ(a->expert_max, ex_max);
    }
    kv_anatomy_free(a);
    unlink(p);
}

/* ---- errors ----------------------------------------------------------- */

static void write_file(const char *p, const void *b, size_t n) {
    FILE *f = fopen(p, "wb");
    ASSERT_TRUE(f != NULL);
    if (!f) return;
    ASSERT_EQ(fwrite(b, 1, n, f), n);
    fclose(f);
}

static void check_one_line_error(const char *p, const char *what) {
    kv_anatomy *a = NULL;
    kv_diag d = {0};
    int rc = kv_anatomy_open(&a, p, &d);
    ASSERT_TRUE(rc < 0);
    ASSERT_TRUE(a == NULL);
    ASSERT_TRUE(d.msg[0] != 0);
    ASSERT_TRUE(strchr(d.msg, '\n') == NULL);
    /* CLI: exit status 2, exactly one line on stderr, nothing on stdout */
    char cmd[1200], out[600];
    snprintf(cmd, sizeof cmd, "'%s' inspect '%s' > '%s/out.txt' 2> '%s/err.txt'", g_bin, p, tmpdir, tmpdir);
    int st = system(cmd);
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 2);
    snprintf(out, sizeof out, "%s/err.txt", tmpdir);
    FILE *f = fopen(out, "r");
    int lines = 0;
    char buf[1024];
    while (f && fgets(buf, sizeof buf, f)) {
        lines++;
        ASSERT_TRUE(strncmp(buf, "kvasir inspect: ", 16) == 0);
    }
    if (f) fclose(f);
    ASSERT_EQ(lines, 1);
    snprintf(out, sizeof out, "%s/out.txt", tmpdir);
    struct stat sb;
    ASSERT_EQ(stat(out, &sb), 0);
    ASSERT_EQ(sb.st_size, 0);
    if (lines != 1 || rc >= 0) fprintf(stderr, "  (%s) %s\n", what, d.msg);
}

static void check_errors(void) {
    char p[512], q[512];
    /* truncated: a real model cut inside its tensor infos, and inside data */
    kv_gen_config c;
    kv_diag d = {0};
    ASSERT_EQ(kv_gen_preset_get("tiny", &c, &d), 0);
    c.n_vocab = 300;
    c.n_threads = 1;
    c.log = NULL;
    path_in(p, sizeof p, "full.gguf");
    ASSERT_EQ(kv_gen_model(&c, p, &d), 0);
    FILE *f = fopen(p, "rb");
    ASSERT_TRUE(f != NULL);
    if (!f) return;
    static uint8_t buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    kv_gguf *g = NULL;
    ASSERT_EQ(kv_gguf_open(&g, p, &d), 0);
    uint64_t hdr = g ? kv_gguf_data_offset(g) : 0;
    kv_gguf_close(g);
    ASSERT_TRUE(hdr > 64 && hdr + 100 <= n);
    path_in(q, sizeof q, "trunc_header.gguf");
    write_file(q, buf, (size_t)(hdr - 40));
    check_one_line_error(q, "truncated header");
    path_in(q, sizeof q, "trunc_data.gguf");
    write_file(q, buf, (size_t)(hdr + 100));
    check_one_line_error(q, "truncated data");
    path_in(q, sizeof q, "empty.gguf");
    write_file(q, "", 0);
    check_one_line_error(q, "empty");
    path_in(q, sizeof q, "text.gguf");
    static const char text[] = "{\"this\": \"is json, not a model\"}\n";
    write_file(q, text, sizeof text - 1);
    check_one_line_error(q, "not GGUF");
    path_in(q, sizeof q, "missing.gguf");
    check_one_line_error(q, "missing");

    /* CLI usage errors: status 1 */
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "'%s' inspect > /dev/null 2>&1", g_bin);
    int st = system(cmd);
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1);
    snprintf(cmd, sizeof cmd, "'%s' inspect '%s' --bogus > /dev/null 2>&1", g_bin, p);
    st = system(cmd);
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1);
    snprintf(cmd, sizeof cmd, "'%s' gen-model --preset qwen35-122b-a10b --out '%s/x.gguf' > /dev/null 2>&1", g_bin,
             tmpdir);
    st = system(cmd);
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1);
    snprintf(cmd, sizeof cmd, "'%s' gen-model --preset tiny --skeleton --out '%s/x.gguf' > /dev/null 2>&1", g_bin,
             tmpdir);
    st = system(cmd);
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1);
    ASSERT_EQ(kv_skeleton_write("nope", q, NULL, &d), KV_ENOTFOUND);
}

static void test_classes(void) { check_classes(); }
static void test_q4km(void) { check_q4km(); }
static void test_generated_q4k(void) { check_generated(KV_TYPE_Q4_K, "gen_q4k.gguf"); }
static void test_generated_q8(void) { check_generated(KV_TYPE_Q8_0, "gen_q8.gguf"); }
static void test_skeleton_122b(void) { check_skeleton_122b(); }
static void test_skeleton_35b(void) {
    /* qwen35-35b-a3b: 30 linear x 19 + 10 full x 16 + MTP 20 + 3; experts:
     * gate/up 512 rows x 8 q4_K blocks, down 2048 rows x 2 blocks */
    check_skeleton_other("qwen35-35b-a3b", 3 + 30 * 19 + 10 * 16 + 20, 41, 256,
                         2 * 512 * 8 * 144 + 2048 * 2 * 144, 2 * 512 * 8 * 144 + 2048 * 2 * 210);
}
static void test_skeleton_30b(void) {
    /* qwen3-30b-a3b: 48 x 12 + 3; gate/up 768 rows x 8 blocks, down 2048 rows x 3 */
    check_skeleton_other("qwen3-30b-a3b", 3 + 48 * 12, 48, 128, 2 * 768 * 8 * 144 + 2048 * 3 * 144,
                         2 * 768 * 8 * 144 + 2048 * 3 * 210);
}
static void test_errors(void) { check_errors(); }

static const kvt_case cases[] = {
    KVT_CASE(test_classes),       KVT_CASE(test_q4km),         KVT_CASE(test_generated_q4k),
    KVT_CASE(test_generated_q8),  KVT_CASE(test_skeleton_122b), KVT_CASE(test_skeleton_35b),
    KVT_CASE(test_skeleton_30b),  KVT_CASE(test_errors),
};

static int setup(void) {
    g_bin = getenv("KV_BIN");
    if (!g_bin) {
        fprintf(stderr, "FAIL: KV_BIN is not set\n");
        return 1;
    }
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kv_anatomy_XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    return 0;
}

static void teardown(void) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd)) fprintf(stderr, "could not remove %s\n", tmpdir);
}

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
