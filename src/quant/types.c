/* The type table: names, block sizes and byte sizes of every ggml type id
 * (ggml-common.h block structs), plus one kernel table per backend (scalar
 * reference, AVX2, AVX-512) and the run-time choice between them.
 *
 * Invariants: the tables are built once (pthread_once) from CPU features
 * (cpuid + xgetbv on x86, getauxval(AT_HWCAP) on aarch64); a backend's table is built only if the CPU runs it, so
 * no SIMD code is ever executed on a CPU that lacks it. A backend that does
 * not implement a kernel inherits the next lower one's, so every table is
 * complete for the compute types. */
#include <ctype.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/err.h"
#include "quant/legacy.h"
#include "quant/quant_internal.h"
#include "quant/vec.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define KV_X86 1
#endif
#if defined(__aarch64__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

/* Filled for every known id. Holes: name NULL. */
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

/* Activation type of each compute type (ggml's vec_dot_type). */
static uint32_t kv_vec_dot_type(uint32_t t) {
    switch (t) {
    case KV_TYPE_Q8_0: case KV_TYPE_Q4_0: return KV_TYPE_Q8_0;
    case KV_TYPE_Q5_0: case KV_TYPE_IQ4_NL: case KV_TYPE_MXFP4: return KV_TYPE_Q8_0; /* quant/legacy.h */
    case KV_TYPE_Q4_1: case KV_TYPE_Q5_1: return KV_TYPE_Q8_1;
    case KV_TYPE_Q4_K: case KV_TYPE_Q5_K: case KV_TYPE_Q6_K: return KV_TYPE_Q8_K;
    case KV_TYPE_Q2_K: case KV_TYPE_Q3_K: case KV_TYPE_IQ4_XS: return KV_TYPE_Q8_K;
    default: return t;
    }
}

enum { KV_BE_SCALAR, KV_BE_AVX2, KV_BE_AVXVNNI, KV_BE_AVX512, KV_BE_NEON, KV_BE_NEONDOT, KV_BE_COUNT };
static const char *const kv_be_names[KV_BE_COUNT] = {"scalar", "avx2", "avxvnni", "avx512", "neon", "neondot"};

static kv_type_info kv_tabs[KV_BE_COUNT][KV_TYPE_COUNT];
static kv_mat_fn kv_mats[KV_BE_COUNT][KV_TYPE_COUNT];
static bool kv_be_ok[KV_BE_COUNT];
static int kv_be_cur;
static kv_wsum_fn kv_wsums[KV_BE_COUNT];
static kv_delta_fn kv_deltas[KV_BE_COUNT], kv_deltas_stream[KV_BE_COUNT];
static kv_wsum_multi_fn kv_wsum_multis[KV_BE_COUNT]; /* NULL: one query at a time */
static kv_softmax_fn kv_softmaxes[KV_BE_COUNT];
static kv_silu_fn kv_silus[KV_BE_COUNT];
static pthread_once_t kv_once = PTHREAD_ONCE_INIT;
#if defined(__aarch64__)
static void kv_init_neon(void);
#endif

#ifdef KV_X86
static uint64_t kv_xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}
#endif

/* Which SIMD levels this CPU and OS support. */
__attribute__((unused)) static void kv_detect(bool *avx2, bool *avxvnni, bool *avx512) {
    *avx2 = *avxvnni = *avx512 = false;
#ifdef KV_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return;
    bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29);
    if (!osxsave) return;
    uint64_t xcr0 = kv_xgetbv0();
    bool ymm_os = (xcr0 & 6) == 6, zmm_os = (xcr0 & 0xe6) == 0xe6;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return;
    bool has_avx2 = b & (1u << 5), bmi2 = b & (1u << 8);
    bool f512 = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
    bool vnni = c & (1u << 11);
    *avx2 = ymm_os && has_avx2 && fma && f16c && bmi2;
    *avx512 = *avx2 && zmm_os && f512 && dq && bw && vl && vnni;
    /* AVX-VNNI (the VEX forms of vpdpbusd / vpdpwssd): CPUID.(7,1):EAX bit 4 */
    if (*avx2 && __get_cpuid_count(7, 1, &a, &b, &c, &d)) *avxvnni = a & (1u << 4);
#endif
}

static void kv_build(int be, const kv_kernels *k) {
    for (uint32_t i = 0; i < KV_TYPE_COUNT; i++) {
        kv_type_info *t = &kv_tabs[be][i];
        t->name = kv_sizes[i].name;
        t->blck = kv_sizes[i].blck;
        t->size = kv_sizes[i].size;
        t->vec_dot_type = kv_vec_dot_type(i);
        t->to_float = k[i].to_float;
        t->from_float = k[i].from_float;
        t->vec_dot = k[i].vec_dot;
        t->compute = k[i].vec_dot != NULL;
        kv_mats[be][i] = k[i].mat;
    }
}

/* A level's float kernels (weighted sums, softmax, silu, delta rule). */
typedef struct {
    kv_wsum_fn wsum;
    kv_wsum_multi_fn wsum_multi; /* NULL: one query at a time */
    kv_softmax_fn softmax;
    kv_silu_fn silu;
    kv_delta_fn delta, delta_stream;
} kv_floats;

/* Level be: the cumulative kernel table k as it stands and these float
 * kernels; the best level set so far is the one dispatched. */
static void kv_level(int be, const kv_kernels *k, const kv_floats *f) {
    kv_build(be, k);
    kv_be_ok[be] = true;
    kv_wsums[be] = f->wsum;
    kv_wsum_multis[be] = f->wsum_multi;
    kv_softmaxes[be] = f->softmax;
    kv_silus[be] = f->silu;
    kv_deltas[be] = f->delta;
    kv_deltas_stream[be] = f->delta_stream;
    kv_be_cur = be;
}

static void kv_init(void) {
    static kv_kernels k[KV_TYPE_COUNT]; /* cumulative: each level overlays the last */
    kv_quant_fill_ref(k);
    kv_quant_fill_legacy_ref(k);
    kv_kquant_fill_ref(k);
    kv_level(KV_BE_SCALAR, k,
             &(kv_floats){kv_f32_wsum_ref, NULL, kv_f32_softmax_ref, kv_f32_silu_ref, kv_f32_delta_ref, kv_f32_delta_ref});
#ifdef KV_X86
    bool avx2, avxvnni, avx512;
    kv_detect(&avx2, &avxvnni, &avx512);
    /* AVX2 and AVX-VNNI share the AVX2 file's float kernels; AVX-512 has its
     * own weighted sums, and the ymm softmax, silu and delta rule (the same
     * bits) */
    const kv_floats f2 = {kv_f32_wsum_avx2,    kv_f32_wsum_multi_avx2, kv_f32_softmax_avx2,
                          kv_f32_silu_avx2,    kv_f32_delta_avx2,      kv_f32_delta_stream_avx2};
    const kv_floats f512 = {kv_f32_wsum_avx512, kv_f32_wsum_multi_avx512, kv_f32_softmax_avx2,
                            kv_f32_silu_avx2,   kv_f32_delta_avx2,        kv_f32_delta_stream_avx2};
    if (avx2) {
        kv_quant_fill_avx2(k);
        kv_quant_fill_legacy_avx2(k);
        kv_kquant_fill_avx2(k);
        kv_level(KV_BE_AVX2, k, &f2);
    }
    if (avxvnni) { /* the AVX2 table with the VNNI integer steps; AVX-512 overlays it */
        kv_quant_fill_avxvnni(k);
        kv_level(KV_BE_AVXVNNI, k, &f2);
    }
    if (avx512) {
        kv_quant_fill_avx512(k);
        kv_quant_fill_legacy_avx512(k);
        kv_kquant_fill_avx512(k);
        kv_level(KV_BE_AVX512, k, &f512);
    }
#endif
#if defined(__aarch64__)
    kv_init_neon();
#endif
    /* KV_QUANT_BACKEND=scalar|avx2|avxvnni|avx512|neon|neondot caps the choice (benchmarks of a
     * lower path on a CPU that has a higher one); a level the CPU lacks or
     * an unknown name leaves the detected one. */
    const char *want = getenv("KV_QUANT_BACKEND");
    for (int i = 0; want && i < KV_BE_COUNT; i++)
        if (!strcmp(want, kv_be_names[i]) && kv_be_ok[i]) kv_be_cur = i;
}

#if defined(__aarch64__)
/* aarch64: NEON (ASIMD) and its int8 dot-product extension, from the
 * kernel's hwcaps; each table overlays the scalar one (neon.c, neon_dot.c). */
static void kv_init_neon(void) {
    const unsigned long hw = getauxval(AT_HWCAP);
    if (!(hw & HWCAP_ASIMD)) return;
    static kv_kernels k[KV_TYPE_COUNT];
    const kv_floats f = {kv_f32_wsum_neon, NULL, kv_f32_softmax_ref, kv_f32_silu_ref, kv_f32_delta_ref, kv_f32_delta_ref};
    kv_quant_fill_ref(k);
    kv_quant_fill_legacy_ref(k);
    kv_kquant_fill_ref(k);
    kv_quant_fill_neon(k);
    kv_quant_fill_legacy_neon(k);
    kv_kquant_fill_neon(k);
    kv_level(KV_BE_NEON, k, &f);
    if (!(hw & HWCAP_ASIMDDP)) return;
    kv_quant_fill_neondot(k);
    kv_quant_fill_legacy_neondot(k);
    kv_level(KV_BE_NEONDOT, k, &f);
}
#endif

static inline void kv_ensure(void) { pthread_once(&kv_once, kv_init); }

const kv_type_info *kv_type_get_ref(uint32_t type) {
    kv_ensure();
    if (type >= KV_TYPE_COUNT || !kv_sizes[type].name) return NULL;
    return &kv_tabs[KV_BE_SCALAR][type];
}

const kv_type_info *kv_type_get(uint32_t type) {
    kv_ensure();
    if (type >= KV_TYPE_COUNT || !kv_sizes[type].name) return NULL;
    return &kv_tabs[kv_be_cur][type];
}

const char *kv_quant_backend(void) {
    kv_ensure();
    return kv_be_names[kv_be_cur];
}

int kv_quant_set_backend(const char *name) {
    kv_ensure();
    for (int i = 0; i < KV_BE_COUNT; i++) {
        if (name && !strcmp(name, kv_be_names[i])) {
            if (!kv_be_ok[i]) return -1;
            kv_be_cur = i;
            return 0;
        }
    }
    return -1;
}

int kv_type_from_name(const char *name) {
    if (!name) return -1;
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

void kv_mat_rows(uint32_t type, const void *W, size_t row_bytes, int64_t n, int64_t r0,
                 int64_t r1, const void *A, size_t a_stride, int64_t n_tok, float *Y,
                 size_t y_stride) {
    kv_ensure();
    KV_ASSERT(type < KV_TYPE_COUNT && kv_tabs[kv_be_cur][type].vec_dot);
    if (r1 <= r0 || n_tok <= 0) return;
    kv_mat_fn mat = kv_mats[kv_be_cur][type];
    if (mat) {
        mat(W, row_bytes, n, r0, r1, A, a_stride, n_tok, Y, y_stride);
        return;
    }
    kv_mat_generic(kv_tabs[kv_be_cur][type].vec_dot, W, row_bytes, n, r0, r1, A, a_stride, n_tok, Y, y_stride);
}

void kv_f32_dot_rows(const float *q, const float *K, size_t k_stride, int64_t n_rows, int64_t n,
                     float scale, float *out) {
    if (n_rows <= 0) return;
    kv_mat_rows(KV_TYPE_F32, K, k_stride * sizeof(float), n, 0, n_rows, q, 0, 1, out, 0);
    for (int64_t p = 0; p < n_rows; p++) out[p] *= scale;
}

void kv_f32_wsum_rows(float *o, const float *w, const float *V, size_t v_stride, int64_t n_rows,
                      int64_t n) {
    kv_ensure();
    kv_wsums[kv_be_cur](o, w, V, v_stride, n_rows, n, 0);
}

void kv_f32_wsum_rows_acc(float *o, const float *w, const float *V, size_t v_stride, int64_t n_rows,
                          int64_t n) {
    kv_ensure();
    kv_wsums[kv_be_cur](o, w, V, v_stride, n_rows, n, 1);
}

void kv_f32_wsum_rows_multi(float *o, size_t o_stride, const float *w, size_t w_stride, int64_t n_q,
                            const float *V, size_t v_stride, int64_t n_rows, int64_t n, int acc) {
    kv_ensure();
    if (n_q <= 0 || n_rows <= 0) {
        if (!acc)
            for (int64_t j = 0; j < n_q; j++) memset(o + (size_t)j * o_stride, 0, (size_t)n * sizeof(float));
        return;
    }
    if (kv_wsum_multis[kv_be_cur]) {
        kv_wsum_multis[kv_be_cur](o, o_stride, w, w_stride, n_q, V, v_stride, n_rows, n, acc);
        return;
    }
    for (int64_t j = 0; j < n_q; j++)
        kv_wsums[kv_be_cur](o + (size_t)j * o_stride, w + (size_t)j * w_stride, V, v_stride, n_rows, n, acc);
}

void kv_f32_softmax(float *x, int64_t n, float scale) {
    kv_ensure();
    (kv_softmaxes[kv_be_cur] ? kv_softmaxes[kv_be_cur] : kv_f32_softmax_ref)(x, n, scale);
}

void kv_f32_silu(float *y, const float *x, int64_t n) {
    kv_ensure();
    if (n <= 0) return;
    (kv_silus[kv_be_cur] ? kv_silus[kv_be_cur] : kv_f32_silu_ref)(y, x, n);
}

void kv_f32_delta_rows(const float *S, float *D, int64_t n_rows, int64_t n, const float *k,
                       const float *q, const float *v, float decay, float beta, float scale,
                       float *o) {
    kv_ensure();
    kv_deltas[kv_be_cur](S, D, n_rows, n, k, q, v, decay, beta, scale, o);
}

void kv_f32_delta_rows_stream(const float *S, float *D, int64_t n_rows, int64_t n, const float *k,
                              const float *q, const float *v, float decay, float beta, float scale,
                              float *o) {
    kv_ensure();
    kv_deltas_stream[kv_be_cur](S, D, n_rows, n, k, q, v, decay, beta, scale, o);
}
