/* The type table: names, block sizes and byte sizes of every ggml type id,
 * as ggml defines them (ggml-common.h block structs). Kernels are attached
 * by the quant module's init for the types we compute with. */
#include "kvasir/quant.h"

#include <ctype.h>
#include <string.h>

/* Filled for every known id; kernels NULL until attached. Holes: name NULL. */
static const struct { const char *name; uint32_t blck, size; } kv_sizes[KV_TYPE_COUNT] = {
    [KV_TYPE_F32] = {"f32", 1, 4},         [KV_TYPE_F16] = {"f16", 1, 2},
    [KV_TYPE_Q4_0] = {"q4_0", 32, 18},     [KV_TYPE_Q4_1] = {"q4_1", 32, 20},
    [KV_TYPE_Q5_0] = {"q5_0", 32, 22},     [KV_TYPE_Q5_1] = {"q5_1", 32, 24},
    [KV_TYPE_Q8_0] = {"q8_0", 32, 34},     [KV_TYPE_Q8_1] = {"q8_1", 32, 36},
    [KV_TYPE_Q2_K] = {"q2_K", 256, 84},    [KV_TYPE_Q3_K] = {"q3_K", 256, 110},
    [KV_TYPE_Q4_K] = {"q4_K", 256, 144},   [KV_TYPE_Q5_K] = {"q5_K", 256, 176},
    [KV_TYPE_Q6_K] = {"q6_K", 256, 210},   [KV_TYPE_Q8_K] = {"q8_K", 256, 292},
    [KV_TYPE_IQ2_XXS] = {"iq2_xxs", 256, 66}, [KV_TYPE_IQ2_XS] = {"iq2_xs", 256, 74},
    [KV_TYPE_IQ3_XXS] = {"iq3_xxs", 256, 98}, [KV_TYPE_IQ1_S] = {"iq1_s", 256, 50},
    [KV_TYPE_IQ4_NL] = {"iq4_nl", 32, 18},  [KV_TYPE_IQ3_S] = {"iq3_s", 256, 110},
    [KV_TYPE_IQ2_S] = {"iq2_s", 256, 82},   [KV_TYPE_IQ4_XS] = {"iq4_xs", 256, 136},
    [KV_TYPE_I8] = {"i8", 1, 1},           [KV_TYPE_I16] = {"i16", 1, 2},
    [KV_TYPE_I32] = {"i32", 1, 4},         [KV_TYPE_I64] = {"i64", 1, 8},
    [KV_TYPE_F64] = {"f64", 1, 8},         [KV_TYPE_IQ1_M] = {"iq1_m", 256, 56},
    [KV_TYPE_BF16] = {"bf16", 1, 2},       [KV_TYPE_TQ1_0] = {"tq1_0", 256, 54},
    [KV_TYPE_TQ2_0] = {"tq2_0", 256, 66},  [KV_TYPE_MXFP4] = {"mxfp4", 32, 17},
    [KV_TYPE_NVFP4] = {"nvfp4", 64, 36},   [KV_TYPE_Q1_0] = {"q1_0", 128, 18},
    [KV_TYPE_Q2_0] = {"q2_0", 64, 18},
};

static kv_type_info kv_ref_table[KV_TYPE_COUNT];
static int kv_ref_ready;

static void kv_types_fill(kv_type_info *t) {
    for (int i = 0; i < KV_TYPE_COUNT; i++) {
        t[i].name = kv_sizes[i].name;
        t[i].blck = kv_sizes[i].blck;
        t[i].size = kv_sizes[i].size;
        t[i].vec_dot_type = (uint32_t)i;
    }
}

/* Placeholder dispatch until the kernel module attaches its tables. */
const kv_type_info *kv_type_get_ref(uint32_t type) {
    if (!kv_ref_ready) { kv_types_fill(kv_ref_table); kv_ref_ready = 1; }
    if (type >= KV_TYPE_COUNT || !kv_sizes[type].name) return NULL;
    return &kv_ref_table[type];
}

const kv_type_info *kv_type_get(uint32_t type) { return kv_type_get_ref(type); }

int kv_type_from_name(const char *name) {
    for (int i = 0; i < KV_TYPE_COUNT; i++) {
        const char *n = kv_sizes[i].name;
        if (!n) continue;
        size_t k = 0;
        while (n[k] && name[k] && tolower((unsigned char)n[k]) == tolower((unsigned char)name[k])) k++;
        if (!n[k] && !name[k]) return i;
    }
    return -1;
}

uint64_t kv_type_row_size(uint32_t type, uint64_t n) {
    if (type >= KV_TYPE_COUNT || !kv_sizes[type].name) return 0;
    if (n % kv_sizes[type].blck) return 0;
    return n / kv_sizes[type].blck * kv_sizes[type].size;
}
