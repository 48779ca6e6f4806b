/* GGUF reader/writer tests.
 *
 * 1. Round trip: the writer emits every metadata type (scalars, arrays of
 *    every scalar type, string arrays) and tensors of several types/shapes
 *    at alignment 32 and 64; the reader (mmap path) must give back exactly
 *    what was written: values, shapes, offsets, and tensor bytes compared
 *    with the source buffers; unwritten tensors read as zeros (holes). The
 *    raw header bytes are also checked against an independent hand-built
 *    encoding of the first fields.
 * 2. Typed getters: conversions that fit succeed, others fail with EFORMAT,
 *    missing keys give ENOTFOUND.
 * 3. Writer misuse: every invalid declaration is refused.
 * 4. Corrupt inputs, hand-assembled byte by byte: each must fail with the
 *    expected code and a message naming the problem, and never crash (the
 *    ASan build runs this too; every buffer is an exact-size heap copy so
 *    an overread is caught). Includes every truncation of a valid file. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvasir/gguf.h"
#include "kvasir/quant.h"
#include "kvtest.h"

/* ---- a byte builder for hand-made files ------------------------------ */

typedef struct B {
    uint8_t *p;
    size_t len, cap;
} B;

static void b_put(B *b, const void *s, size_t n) {
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        if (!b->p) abort();
    }
    if (n) memcpy(b->p + b->len, s, n);
    b->len += n;
}
static void b_u8(B *b, uint8_t v) { b_put(b, &v, 1); }
static void b_u32(B *b, uint32_t v) {
    uint8_t x[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    b_put(b, x, 4);
}
static void b_u64(B *b, uint64_t v) {
    b_u32(b, (uint32_t)v);
    b_u32(b, (uint32_t)(v >> 32));
}
static void b_str(B *b, const char *s) {
    b_u64(b, strlen(s));
    b_put(b, s, strlen(s));
}
static void b_hdr(B *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
    b_u32(b, KV_GGUF_MAGIC);
    b_u32(b, version);
    b_u64(b, n_tensors);
    b_u64(b, n_kv);
}
static void b_kv_u32(B *b, const char *key, uint32_t v) {
    b_str(b, key);
    b_u32(b, KV_GGUF_UINT32);
    b_u32(b, v);
}
static void b_tinfo(B *b, const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type,
                    uint64_t off) {
    b_str(b, name);
    b_u32(b, n_dims);
    for (uint32_t i = 0; i < n_dims; i++) b_u64(b, ne[i]);
    b_u32(b, type);
    b_u64(b, off);
}
static void b_pad(B *b, size_t align) {
    while (b->len % align) b_u8(b, 0);
}
static void b_zeros(B *b, size_t n) {
    for (size_t i = 0; i < n; i++) b_u8(b, 0);
}

/* Opens an exact-size heap copy of buf[0..len). */
static int open_copy(const void *buf, size_t len, kv_gguf **g, kv_diag *d) {
    void *c = malloc(len ? len : 1);
    if (len) memcpy(c, buf, len);
    int rc = kv_gguf_open_mem(g, c, len, d);
    if (rc == 0) {
        /* walk everything while the copy is alive */
        for (size_t i = 0; i < kv_gguf_n_tensors(*g); i++) {
            const kv_gguf_tensor *t = kv_gguf_tensor_at(*g, i);
            volatile uint8_t s = 0;
            for (uint64_t k = 0; k < t->nbytes; k++) s ^= ((const uint8_t *)t->data)[k];
            (void)s;
        }
        kv_gguf_close(*g);
        *g = NULL;
    }
    free(c);
    return rc;
}

static int n_cases = 0;
#define EXPECT_FAIL(b, want, substr)                                                        \
    do {                                                                                   \
        kv_diag d_ = {0};                                                                  \
        kv_gguf *g_ = NULL;                                                                \
        int rc_ = open_copy((b)->p, (b)->len, &g_, &d_);                                   \
        n_cases++;                                                                         \
        ASSERT_EQ(rc_, (want));                                                            \
        ASSERT_TRUE(g_ == NULL);                                                           \
        ASSERT_EQ(d_.code, (want));                                                        \
        if (!strstr(d_.msg, (substr))) KVT_FAIL("message '%s' lacks '%s'", d_.msg, (substr)); \
        ASSERT_TRUE(strncmp(d_.msg, "gguf: ", 6) == 0);                                    \
        ASSERT_TRUE(strchr(d_.msg, '\n') == NULL);                                         \
        free((b)->p);                                                                      \
        memset((b), 0, sizeof *(b));                                                       \
    } while (0)

#define EXPECT_OK(b)                                                                       \
    do {                                                                                   \
        kv_diag d_ = {0};                                                                  \
        kv_gguf *g_ = NULL;                                                                \
        int rc_ = open_copy((b)->p, (b)->len, &g_, &d_);                                   \
        if (rc_) KVT_FAIL("expected success, got %s: %s", kv_err_name(rc_), d_.msg);       \
        ASSERT_EQ(rc_, 0);                                                                 \
        free((b)->p);                                                                      \
        memset((b), 0, sizeof *(b));                                                       \
    } while (0)

static char tmpdir[256];

static void mk_tmpdir(void) {
    const char *t = getenv("TMPDIR");
    snprintf(tmpdir, sizeof tmpdir, "%s/kv_test_gguf_XXXXXX", t && *t ? t : "/tmp");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        exit(1);
    }
}

static uint8_t *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *p = malloc(n ? (size_t)n : 1);
    if (fread(p, 1, (size_t)n, f) != (size_t)n) {
        free(p);
        fclose(f);
        return NULL;
    }
    fclose(f);
    *len = (size_t)n;
    return p;
}

/* ---- 1. round trip ---------------------------------------------------- */

typedef struct tspec {
    const char *name;
    uint32_t n_dims;
    uint64_t ne[4];
    uint32_t type;
    int write; /* 0: leave as a hole; 1: one write; 2: two halves */
} tspec;

static const tspec kTensors[] = {
    {"a.f32", 1, {7, 1, 1, 1}, KV_TYPE_F32, 1},
    {"b.f16", 2, {64, 3, 1, 1}, KV_TYPE_F16, 2},
    {"c.q8_0", 3, {64, 2, 3, 1}, KV_TYPE_Q8_0, 1},
    {"blk.0.attn_q.weight", 2, {256, 2, 1, 1}, KV_TYPE_Q4_K, 2},
    {"e.bf16.4d", 4, {4, 3, 2, 2}, KV_TYPE_BF16, 1},
    {"f.hole", 2, {32, 5, 1, 1}, KV_TYPE_Q4_0, 0},
    {"g.q6_k", 1, {512, 1, 1, 1}, KV_TYPE_Q6_K, 1},
};
#define N_T (sizeof kTensors / sizeof kTensors[0])

static uint64_t spec_nbytes(const tspec *s) {
    uint64_t n = kv_type_row_size(s->type, s->ne[0]);
    for (uint32_t j = 1; j < s->n_dims; j++) n *= s->ne[j];
    return n;
}

static void fill_pattern(uint8_t *p, size_t n, uint32_t seed) {
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        p[i] = (uint8_t)(x >> 24);
    }
}

static void test_round_trip(uint32_t align) {
    char path[400];
    snprintf(path, sizeof path, "%s/rt_%u.gguf", tmpdir, align);
    kv_diag d = {0};
    kv_gguf_writer *w = NULL;
    ASSERT_EQ(kv_gguf_writer_new(&w, &d), 0);

    /* scalars with setters */
    ASSERT_EQ(kv_gguf_writer_set_str(w, "general.architecture", "qwen3moe", &d), 0);
    if (align != KV_GGUF_DEFAULT_ALIGNMENT) ASSERT_EQ(kv_gguf_writer_set_alignment(w, align, &d), 0);
    ASSERT_EQ(kv_gguf_writer_set_u32(w, "t.u32", 4000000000u, &d), 0);
    ASSERT_EQ(kv_gguf_writer_set_i32(w, "t.i32", -123456, &d), 0);
    ASSERT_EQ(kv_gguf_writer_set_u64(w, "t.u64", 0xfedcba9876543210ull, &d), 0);
    ASSERT_EQ(kv_gguf_writer_set_f32(w, "t.f32", 1e-6f, &d), 0);
    ASSERT_EQ(kv_gguf_writer_set_bool(w, "t.bool", true, &d), 0);
    ASSERT_EQ(kv_gguf_writer_set_strn(w, "t.strn", "a\0b", 3, &d), 0);
    ASSERT_EQ(kv_gguf_writer_set_str(w, "t.empty", "", &d), 0);
    /* replacing keeps position and type changes */
    ASSERT_EQ(kv_gguf_writer_set_u32(w, "t.replace", 1, &d), 0);
    ASSERT_EQ(kv_gguf_writer_set_str(w, "t.replace", "second", &d), 0);

    /* scalars without setters, via copy_kv from hand-built values */
    kv_gguf_kv ck[6];
    memset(ck, 0, sizeof ck);
    const char *ckeys[6] = {"t.u8", "t.i8", "t.u16", "t.i16", "t.i64", "t.f64"};
    uint32_t ctypes[6] = {KV_GGUF_UINT8, KV_GGUF_INT8, KV_GGUF_UINT16, KV_GGUF_INT16,
                          KV_GGUF_INT64, KV_GGUF_FLOAT64};
    for (int i = 0; i < 6; i++) {
        ck[i].key.ptr = ckeys[i];
        ck[i].key.len = strlen(ckeys[i]);
        ck[i].val.type = ctypes[i];
    }
    ck[0].val.v.u64 = 250;
    ck[1].val.v.i64 = -100;
    ck[2].val.v.u64 = 65000;
    ck[3].val.v.i64 = -32000;
    ck[4].val.v.i64 = -((int64_t)1 << 62);
    ck[5].val.v.f64 = 3.141592653589793;
    for (int i = 0; i < 6; i++) ASSERT_EQ(kv_gguf_writer_copy_kv(w, &ck[i], &d), 0);

    /* arrays of every scalar type */
    uint8_t a_u8[5] = {0, 1, 2, 254, 255};
    int8_t a_i8[3] = {-128, 0, 127};
    uint16_t a_u16[2] = {1, 65535};
    int16_t a_i16[2] = {-32768, 32767};
    uint32_t a_u32[3] = {0, 7, 0xffffffffu};
    int32_t a_i32[4] = {1, 2, 3, -4};
    float a_f32[3] = {0.5f, -2.0f, 1e30f};
    uint8_t a_bool[4] = {1, 0, 0, 1};
    uint64_t a_u64[2] = {0, UINT64_MAX};
    int64_t a_i64[2] = {INT64_MIN, INT64_MAX};
    double a_f64[2] = {-0.0, 1e300};
    struct {
        const char *key;
        uint32_t type;
        const void *data;
        uint64_t n;
    } arrs[] = {
        {"a.u8", KV_GGUF_UINT8, a_u8, 5},     {"a.i8", KV_GGUF_INT8, a_i8, 3},
        {"a.u16", KV_GGUF_UINT16, a_u16, 2},  {"a.i16", KV_GGUF_INT16, a_i16, 2},
        {"a.u32", KV_GGUF_UINT32, a_u32, 3},  {"a.i32", KV_GGUF_INT32, a_i32, 4},
        {"a.f32", KV_GGUF_FLOAT32, a_f32, 3}, {"a.bool", KV_GGUF_BOOL, a_bool, 4},
        {"a.u64", KV_GGUF_UINT64, a_u64, 2},  {"a.i64", KV_GGUF_INT64, a_i64, 2},
        {"a.f64", KV_GGUF_FLOAT64, a_f64, 2}, {"a.empty", KV_GGUF_UINT32, NULL, 0},
    };
    size_t n_arrs = sizeof arrs / sizeof arrs[0];
    for (size_t i = 0; i < n_arrs; i++)
        ASSERT_EQ(kv_gguf_writer_set_arr(w, arrs[i].key, arrs[i].type, arrs[i].data, arrs[i].n, &d), 0);

    /* string array incl. empty string, UTF-8, embedded NUL */
    kv_str strs[5] = {{"hello", 5}, {"", 0}, {"\xc3\xa9t\xc3\xa9", 5}, {"x\0y", 3}, {"<|im_end|>", 10}};
    ASSERT_EQ(kv_gguf_writer_set_arr_str(w, "a.str", strs, 5, &d), 0);

    /* tensors */
    size_t idx[N_T];
    uint8_t *src[N_T];
    for (size_t i = 0; i < N_T; i++) {
        ASSERT_EQ(kv_gguf_writer_add_tensor(w, kTensors[i].name, kTensors[i].n_dims, kTensors[i].ne,
                                            kTensors[i].type, &idx[i], &d),
                  0);
        ASSERT_EQ(idx[i], i);
        size_t nb = (size_t)spec_nbytes(&kTensors[i]);
        src[i] = malloc(nb);
        fill_pattern(src[i], nb, (uint32_t)i + align);
    }
    ASSERT_EQ(kv_gguf_writer_begin(w, path, &d), 0);
    /* write in reverse order to show order does not matter */
    for (size_t k = N_T; k-- > 0;) {
        size_t nb = (size_t)spec_nbytes(&kTensors[k]);
        if (kTensors[k].write == 1) ASSERT_EQ(kv_gguf_writer_write_data(w, k, 0, src[k], nb, &d), 0);
        if (kTensors[k].write == 2) {
            size_t h = nb / 2;
            ASSERT_EQ(kv_gguf_writer_write_data(w, k, h, src[k] + h, nb - h, &d), 0);
            ASSERT_EQ(kv_gguf_writer_write_data(w, k, 0, src[k], h, &d), 0);
        }
    }
    /* out-of-range write refused */
    ASSERT_EQ(kv_gguf_writer_write_data(w, 0, 1, src[0], (size_t)spec_nbytes(&kTensors[0]), &d), KV_EINVAL);
    ASSERT_EQ(kv_gguf_writer_write_data(w, N_T, 0, src[0], 1, &d), KV_EINVAL);
    ASSERT_EQ(kv_gguf_writer_set_u32(w, "late", 1, &d), KV_EINVAL);
    ASSERT_EQ(kv_gguf_writer_finish(w, &d), 0);
    kv_gguf_writer_free(w);

    /* raw bytes: the first fields, encoded independently */
    size_t flen = 0;
    uint8_t *raw = read_file(path, &flen);
    ASSERT_TRUE(raw != NULL);
    if (!raw) return;
    B e = {0};
    b_hdr(&e, 3, N_T, 0);
    ASSERT_TRUE(memcmp(raw, e.p, 16) == 0); /* magic, version, n_tensors */
    free(e.p);
    memset(&e, 0, sizeof e);
    b_str(&e, "general.architecture");
    b_u32(&e, KV_GGUF_STRING);
    b_str(&e, "qwen3moe");
    ASSERT_TRUE(flen > 24 + e.len && memcmp(raw + 24, e.p, e.len) == 0);
    free(e.p);

    kv_gguf *g = NULL;
    int rc = kv_gguf_open(&g, path, &d);
    if (rc) KVT_FAIL("open: %s", d.msg);
    ASSERT_EQ(rc, 0);
    if (!g) {
        free(raw);
        return;
    }
    ASSERT_EQ(kv_gguf_version(g), 3);
    ASSERT_EQ(kv_gguf_alignment(g), align);
    ASSERT_EQ(kv_gguf_data_offset(g) % align, 0);
    ASSERT_EQ(kv_gguf_file_size(g), flen);
    /* 1 arch + (alignment) + 8 setters (replace counted once) + 6 copies + 12 arrays + 1 str arr */
    ASSERT_EQ(kv_gguf_n_kv(g), 1 + (align != 32) + 8 + 6 + n_arrs + 1);
    ASSERT_TRUE(kv_str_eq(kv_gguf_kv_at(g, 0)->key, "general.architecture"));

    kv_str s;
    uint32_t u32;
    int32_t i32;
    uint64_t u64;
    float f;
    bool bo;
    ASSERT_EQ(kv_gguf_get_str(g, "general.architecture", &s, &d), 0);
    ASSERT_TRUE(kv_str_eq(s, "qwen3moe"));
    ASSERT_EQ(kv_gguf_get_u32(g, "t.u32", &u32, &d), 0);
    ASSERT_EQ(u32, 4000000000u);
    ASSERT_EQ(kv_gguf_get_i32(g, "t.i32", &i32, &d), 0);
    ASSERT_EQ(i32, -123456);
    ASSERT_EQ(kv_gguf_get_u64(g, "t.u64", &u64, &d), 0);
    ASSERT_TRUE(u64 == 0xfedcba9876543210ull);
    ASSERT_EQ(kv_gguf_get_f32(g, "t.f32", &f, &d), 0);
    ASSERT_TRUE(f == 1e-6f);
    ASSERT_EQ(kv_gguf_get_bool(g, "t.bool", &bo, &d), 0);
    ASSERT_TRUE(bo);
    ASSERT_EQ(kv_gguf_get_str(g, "t.strn", &s, &d), 0);
    ASSERT_TRUE(s.len == 3 && memcmp(s.ptr, "a\0b", 3) == 0);
    ASSERT_EQ(kv_gguf_get_str(g, "t.empty", &s, &d), 0);
    ASSERT_EQ(s.len, 0);
    ASSERT_EQ(kv_gguf_get_str(g, "t.replace", &s, &d), 0);
    ASSERT_TRUE(kv_str_eq(s, "second"));
    /* replaced key kept its position (right after t.u32 .. t.empty) */
    const kv_gguf_kv *rep = kv_gguf_find_kv(g, "t.replace");
    ASSERT_TRUE(rep == kv_gguf_kv_at(g, (align != 32) + 8));

    for (int i = 0; i < 6; i++) {
        const kv_gguf_kv *kv = kv_gguf_find_kv(g, ckeys[i]);
        ASSERT_TRUE(kv != NULL);
        if (!kv) continue;
        ASSERT_EQ(kv->val.type, ctypes[i]);
        if (ctypes[i] == KV_GGUF_FLOAT64)
            ASSERT_TRUE(kv->val.v.f64 == ck[i].val.v.f64);
        else
            ASSERT_TRUE(kv->val.v.u64 == ck[i].val.v.u64);
    }

    for (size_t i = 0; i < n_arrs; i++) {
        uint64_t n;
        const uint8_t *data;
        ASSERT_EQ(kv_gguf_get_arr(g, arrs[i].key, arrs[i].type, &n, &data, &d), 0);
        ASSERT_EQ(n, arrs[i].n);
        size_t nb = (size_t)n * kv_gguf_type_size(arrs[i].type);
        ASSERT_TRUE(nb == 0 || memcmp(data, arrs[i].data, nb) == 0); /* host is little-endian */
        const kv_gguf_kv *kv = kv_gguf_find_kv(g, arrs[i].key);
        ASSERT_EQ(kv->val.v.arr.nbytes, nb);
    }

    const kv_gguf_kv *sa = kv_gguf_find_kv(g, "a.str");
    ASSERT_TRUE(sa && sa->val.type == KV_GGUF_ARRAY && sa->val.v.arr.elem_type == KV_GGUF_STRING);
    if (sa) {
        ASSERT_EQ(sa->val.v.arr.n, 5);
        size_t pos = 0;
        for (int i = 0; i < 5; i++) {
            ASSERT_EQ(kv_gguf_arr_str_iter(&sa->val, &pos, &s), 0);
            ASSERT_TRUE(s.len == strs[i].len && memcmp(s.ptr, strs[i].ptr, s.len) == 0);
            kv_str s2;
            ASSERT_EQ(kv_gguf_arr_str(&sa->val, (uint64_t)i, &s2), 0);
            ASSERT_TRUE(s2.ptr == s.ptr && s2.len == s.len);
        }
        ASSERT_EQ(kv_gguf_arr_str_iter(&sa->val, &pos, &s), KV_ERANGE);
        ASSERT_EQ(kv_gguf_arr_str(&sa->val, 5, &s), KV_ERANGE);
        ASSERT_EQ(pos, sa->val.v.arr.nbytes);
    }
    const kv_gguf_kv *nonstr = kv_gguf_find_kv(g, "a.u8");
    size_t pos0 = 0;
    ASSERT_EQ(kv_gguf_arr_str_iter(&nonstr->val, &pos0, &s), KV_EINVAL);

    /* tensors: shapes, layout, bytes */
    ASSERT_EQ(kv_gguf_n_tensors(g), N_T);
    uint64_t expect_off = 0;
    for (size_t i = 0; i < N_T; i++) {
        const kv_gguf_tensor *t = kv_gguf_tensor_at(g, i);
        ASSERT_TRUE(kv_str_eq(t->name, kTensors[i].name));
        ASSERT_TRUE(kv_gguf_find_tensor(g, kTensors[i].name) == t);
        ASSERT_EQ(t->n_dims, kTensors[i].n_dims);
        for (int j = 0; j < 4; j++) ASSERT_EQ(t->ne[j], kTensors[i].ne[j]);
        ASSERT_EQ(t->type, kTensors[i].type);
        ASSERT_EQ(t->offset, expect_off);
        ASSERT_EQ(t->offset % align, 0);
        ASSERT_EQ(t->file_offset, kv_gguf_data_offset(g) + t->offset);
        ASSERT_TRUE((const uint8_t *)t->data == (const uint8_t *)kv_gguf_base(g) + t->file_offset);
        uint64_t nb = spec_nbytes(&kTensors[i]);
        ASSERT_EQ(t->nbytes, nb);
        if (kTensors[i].write) {
            ASSERT_TRUE(memcmp(t->data, src[i], (size_t)nb) == 0);
            ASSERT_TRUE(memcmp(raw + t->file_offset, src[i], (size_t)nb) == 0);
        } else {
            int zero = 1;
            for (uint64_t k = 0; k < nb; k++) zero &= ((const uint8_t *)t->data)[k] == 0;
            ASSERT_TRUE(zero);
        }
        expect_off += (nb + align - 1) / align * align;
    }
    ASSERT_EQ(kv_gguf_file_size(g), kv_gguf_data_offset(g) + expect_off);
    ASSERT_TRUE(kv_gguf_find_tensor(g, "nope") == NULL);
    ASSERT_TRUE(kv_gguf_find_kv(g, "nope") == NULL);
    ASSERT_TRUE(kv_gguf_kv_at(g, 1000) == NULL);
    ASSERT_TRUE(kv_gguf_tensor_at(g, 1000) == NULL);

    /* getters: conversions and refusals */
    ASSERT_EQ(kv_gguf_get_u32(g, "t.u8", &u32, &d), 0);
    ASSERT_EQ(u32, 250);
    ASSERT_EQ(kv_gguf_get_i32(g, "t.i16", &i32, &d), 0);
    ASSERT_EQ(i32, -32000);
    ASSERT_EQ(kv_gguf_get_u32(g, "t.i8", &u32, &d), KV_EFORMAT); /* negative */
    ASSERT_TRUE(strstr(d.msg, "t.i8") != NULL);
    ASSERT_EQ(kv_gguf_get_i32(g, "t.u32", &i32, &d), KV_EFORMAT); /* 4e9 > INT32_MAX */
    ASSERT_EQ(kv_gguf_get_u32(g, "t.u64", &u32, &d), KV_EFORMAT);
    ASSERT_EQ(kv_gguf_get_u64(g, "t.i64", &u64, &d), KV_EFORMAT);
    ASSERT_EQ(kv_gguf_get_u32(g, "t.f32", &u32, &d), KV_EFORMAT);
    ASSERT_EQ(kv_gguf_get_u32(g, "t.bool", &u32, &d), KV_EFORMAT);
    ASSERT_EQ(kv_gguf_get_f32(g, "t.f64", &f, &d), 0);
    ASSERT_TRUE(f == (float)3.141592653589793);
    ASSERT_EQ(kv_gguf_get_f32(g, "t.u32", &f, &d), KV_EFORMAT);
    ASSERT_EQ(kv_gguf_get_bool(g, "t.u8", &bo, &d), KV_EFORMAT);
    ASSERT_EQ(kv_gguf_get_str(g, "t.u8", &s, &d), KV_EFORMAT);
    ASSERT_EQ(kv_gguf_get_u32(g, "missing.key", &u32, &d), KV_ENOTFOUND);
    ASSERT_TRUE(strstr(d.msg, "missing.key") != NULL);
    uint64_t an;
    const uint8_t *ad;
    ASSERT_EQ(kv_gguf_get_arr(g, "a.u8", KV_GGUF_INT8, &an, &ad, &d), KV_EFORMAT);
    ASSERT_EQ(kv_gguf_get_arr(g, "t.u8", KV_GGUF_UINT8, &an, &ad, &d), KV_EFORMAT);
    ASSERT_EQ(kv_gguf_get_arr(g, "nope", KV_GGUF_UINT8, &an, &ad, &d), KV_ENOTFOUND);

    /* copy every pair to a new file and compare the metadata bytes */
    {
        char p2[420];
        snprintf(p2, sizeof p2, "%s/copy_%u.gguf", tmpdir, align);
        kv_gguf_writer *w2 = NULL;
        ASSERT_EQ(kv_gguf_writer_new(&w2, &d), 0);
        for (size_t i = 0; i < kv_gguf_n_kv(g); i++)
            ASSERT_EQ(kv_gguf_writer_copy_kv(w2, kv_gguf_kv_at(g, i), &d), 0);
        ASSERT_EQ(kv_gguf_writer_begin(w2, p2, &d), 0);
        ASSERT_EQ(kv_gguf_writer_finish(w2, &d), 0);
        kv_gguf_writer_free(w2);
        size_t l2 = 0;
        uint8_t *r2 = read_file(p2, &l2);
        /* same kv section: bytes 24.. up to the first tensor info */
        size_t kv_end = 24;
        {
            kv_gguf *g2 = NULL;
            ASSERT_EQ(kv_gguf_open(&g2, p2, &d), 0);
            if (g2) {
                ASSERT_EQ(kv_gguf_n_tensors(g2), 0);
                ASSERT_EQ(kv_gguf_n_kv(g2), kv_gguf_n_kv(g));
                kv_end = (size_t)kv_gguf_data_offset(g2); /* no tensors: end of header */
                kv_gguf_close(g2);
            }
        }
        ASSERT_TRUE(r2 && l2 >= kv_end && kv_end > 24);
        if (r2) {
            /* the n_kv field is identical, and the whole kv section too */
            ASSERT_TRUE(memcmp(r2 + 16, raw + 16, 8) == 0);
            size_t kvlen = kv_end - 24;
            ASSERT_TRUE(memcmp(r2 + 24, raw + 24, kvlen) == 0);
        }
        free(r2);
    }

    kv_gguf_close(g);
    free(raw);
    for (size_t i = 0; i < N_T; i++) free(src[i]);
}

/* ---- 3. writer misuse ------------------------------------------------- */

static void test_writer_errors(void) {
    kv_diag d = {0};
    kv_gguf_writer *w = NULL;
    ASSERT_EQ(kv_gguf_writer_new(&w, &d), 0);
    uint64_t ne[4] = {32, 2, 1, 1};
    ASSERT_EQ(kv_gguf_writer_add_tensor(w, "x", 2, ne, KV_TYPE_Q8_0, NULL, &d), 0);
    ASSERT_EQ(kv_gguf_writer_add_tensor(w, "x", 2, ne, KV_TYPE_Q8_0, NULL, &d), KV_EINVAL);
    ASSERT_TRUE(strstr(d.msg, "duplicate") != NULL);
    ASSERT_EQ(kv_gguf_writer_add_tensor(w, "y", 5, ne, KV_TYPE_F32, NULL, &d), KV_EINVAL);
    ASSERT_EQ(kv_gguf_writer_add_tensor(w, "y", 0, ne, KV_TYPE_F32, NULL, &d), KV_EINVAL);
    ASSERT_EQ(kv_gguf_writer_add_tensor(w, "", 1, ne, KV_TYPE_F32, NULL, &d), KV_EINVAL);
    ASSERT_EQ(kv_gguf_writer_add_tensor(w, "y", 2, ne, KV_TYPE_Q4_K, NULL, &d), KV_EINVAL);
    ASSERT_TRUE(strstr(d.msg, "block size") != NULL);
    ASSERT_EQ(kv_gguf_writer_add_tensor(w, "y", 2, ne, 4 /* removed Q4_2 */, NULL, &d), KV_EUNSUPPORTED);
    ASSERT_EQ(kv_gguf_writer_add_tensor(w, "y", 2, ne, 9999, NULL, &d), KV_EUNSUPPORTED);
    char longname[80];
    memset(longname, 'n', 64);
    longname[64] = 0;
    ASSERT_EQ(kv_gguf_writer_add_tensor(w, longname, 1, ne, KV_TYPE_F32, NULL, &d), KV_EINVAL);
    longname[63] = 0;
    ASSERT_EQ(kv_gguf_writer_add_tensor(w, longname, 1, ne, KV_TYPE_F32, NULL, &d), 0);
    uint64_t big[4] = {1ull << 32, 1ull << 32, 1, 1};
    ASSERT_EQ(kv_gguf_writer_add_tensor(w, "big", 2, big, KV_TYPE_F32, NULL, &d), KV_EINVAL);
    ASSERT_EQ(kv_gguf_writer_set_alignment(w, 0, &d), KV_EINVAL);
    ASSERT_EQ(kv_gguf_writer_set_alignment(w, 48, &d), KV_EINVAL);
    ASSERT_EQ(kv_gguf_writer_set_alignment(w, 1u << 17, &d), KV_EINVAL);
    ASSERT_EQ(kv_gguf_writer_set_u32(w, "", 1, &d), KV_EINVAL);
    uint8_t badbool[2] = {0, 2};
    ASSERT_EQ(kv_gguf_writer_set_arr(w, "bb", KV_GGUF_BOOL, badbool, 2, &d), KV_EINVAL);
    ASSERT_EQ(kv_gguf_writer_set_arr(w, "bs", KV_GGUF_STRING, badbool, 2, &d), KV_EINVAL);
    /* general.alignment of the wrong type is refused at begin */
    ASSERT_EQ(kv_gguf_writer_set_u64(w, "general.alignment", 32, &d), 0);
    char path[400];
    snprintf(path, sizeof path, "%s/bad.gguf", tmpdir);
    ASSERT_EQ(kv_gguf_writer_begin(w, path, &d), KV_EINVAL);
    ASSERT_EQ(kv_gguf_writer_finish(w, &d), KV_EINVAL);
    ASSERT_EQ(kv_gguf_writer_write_data(w, 0, 0, ne, 1, &d), KV_EINVAL);
    kv_gguf_writer_free(w);
    kv_gguf_writer_free(NULL);

    /* begin into a missing directory fails cleanly */
    ASSERT_EQ(kv_gguf_writer_new(&w, &d), 0);
    ASSERT_EQ(kv_gguf_writer_begin(w, "/nonexistent-dir-kv/x.gguf", &d), KV_EIO);
    kv_gguf_writer_free(w);
}

/* ---- 4. corrupt inputs ------------------------------------------------ */

/* A small valid file: 2 kvs, 2 tensors (f32 [8], q8_0 [32,2]) at align 32. */
static void valid_small(B *b) {
    b_hdr(b, 3, 2, 2);
    b_kv_u32(b, "k.one", 1);
    b_str(b, "k.str");
    b_u32(b, KV_GGUF_STRING);
    b_str(b, "value");
    uint64_t ne0[1] = {8}, ne1[2] = {32, 2};
    b_tinfo(b, "t0", 1, ne0, KV_TYPE_F32, 0);
    b_tinfo(b, "t1", 2, ne1, KV_TYPE_Q8_0, 32);
    b_pad(b, 32);
    for (int i = 0; i < 32; i++) b_u8(b, (uint8_t)i);       /* t0: 32 bytes */
    for (int i = 0; i < 68; i++) b_u8(b, (uint8_t)(i * 3)); /* t1: 2 blocks of 34 */
}

static void test_truncations(void) {
    B v = {0};
    valid_small(&v);
    kv_diag d = {0};
    kv_gguf *g = NULL;
    ASSERT_EQ(open_copy(v.p, v.len, &g, &d), 0);
    /* every strict prefix fails with EFORMAT, no crash */
    int bad = 0;
    for (size_t n = 0; n < v.len; n++) {
        kv_diag dd = {0};
        int rc = open_copy(v.p, n, &g, &dd);
        if (rc != KV_EFORMAT || g != NULL || dd.msg[0] == 0) {
            bad++;
            KVT_FAIL("prefix %zu: rc %d (%s)", n, rc, dd.msg);
        }
    }
    ASSERT_EQ(bad, 0);
    /* trailing bytes after the data are allowed */
    b_zeros(&v, 7);
    EXPECT_OK(&v);
}

static void test_corrupt(void) {
    B b = {0};
    uint64_t ne1[1] = {8};

    /* empty and tiny buffers */
    EXPECT_FAIL(&b, KV_EFORMAT, "truncated");

    b_put(&b, "GGUG", 4);
    b_u32(&b, 3);
    b_u64(&b, 0);
    b_u64(&b, 0);
    EXPECT_FAIL(&b, KV_EFORMAT, "magic");

    b_hdr(&b, 2, 0, 0);
    EXPECT_FAIL(&b, KV_EUNSUPPORTED, "version 2");
    b_hdr(&b, 1, 0, 0);
    EXPECT_FAIL(&b, KV_EUNSUPPORTED, "version 1");
    b_hdr(&b, 0x03000000u, 0, 0);
    EXPECT_FAIL(&b, KV_EUNSUPPORTED, "big-endian");
    b_hdr(&b, 4, 0, 0);
    EXPECT_FAIL(&b, KV_EUNSUPPORTED, "version 4");
    b_hdr(&b, 0, 0, 0);
    EXPECT_FAIL(&b, KV_EFORMAT, "version 0");

    /* an empty but valid file */
    b_hdr(&b, 3, 0, 0);
    EXPECT_OK(&b);

    /* huge counts */
    b_hdr(&b, 3, 0, 1ull << 40);
    EXPECT_FAIL(&b, KV_EFORMAT, "metadata pairs, max");
    b_hdr(&b, 3, UINT64_MAX, 0);
    EXPECT_FAIL(&b, KV_EFORMAT, "tensors, max");
    b_hdr(&b, 3, 0, KV_GGUF_MAX_KV);
    b_kv_u32(&b, "a", 1);
    EXPECT_FAIL(&b, KV_EFORMAT, "bytes follow");
    b_hdr(&b, 3, KV_GGUF_MAX_TENSORS, 0);
    b_tinfo(&b, "t", 1, ne1, KV_TYPE_F32, 0);
    EXPECT_FAIL(&b, KV_EFORMAT, "bytes follow");

    /* key length past end / over max / empty */
    b_hdr(&b, 3, 0, 1);
    b_u64(&b, 200);
    b_put(&b, "abcdefghij", 10);
    EXPECT_FAIL(&b, KV_EFORMAT, "past end");
    b_hdr(&b, 3, 0, 1);
    b_u64(&b, KV_GGUF_MAX_NAME + 1);
    b_zeros(&b, KV_GGUF_MAX_NAME + 8);
    EXPECT_FAIL(&b, KV_EFORMAT, "max 256");
    b_hdr(&b, 3, 0, 1);
    b_u64(&b, 0);
    b_u32(&b, KV_GGUF_UINT8);
    b_u8(&b, 1);
    b_zeros(&b, 4);
    EXPECT_FAIL(&b, KV_EFORMAT, "empty");

    /* string value length past end, and over the max */
    b_hdr(&b, 3, 0, 1);
    b_str(&b, "k");
    b_u32(&b, KV_GGUF_STRING);
    b_u64(&b, 50);
    b_put(&b, "short", 5);
    EXPECT_FAIL(&b, KV_EFORMAT, "past end");
    b_hdr(&b, 3, 0, 1);
    b_str(&b, "k");
    b_u32(&b, KV_GGUF_STRING);
    b_u64(&b, UINT64_MAX);
    b_zeros(&b, 16);
    EXPECT_FAIL(&b, KV_EFORMAT, "max");

    /* array counts: over the max, overflowing n*size, past end */
    b_hdr(&b, 3, 0, 1);
    b_str(&b, "arr");
    b_u32(&b, KV_GGUF_ARRAY);
    b_u32(&b, KV_GGUF_UINT32);
    b_u64(&b, 1ull << 62);
    b_zeros(&b, 64);
    EXPECT_FAIL(&b, KV_EFORMAT, "elements, max");
    b_hdr(&b, 3, 0, 1);
    b_str(&b, "arr");
    b_u32(&b, KV_GGUF_ARRAY);
    b_u32(&b, KV_GGUF_UINT64);
    b_u64(&b, KV_GGUF_MAX_ARRAY);
    b_zeros(&b, 64);
    EXPECT_FAIL(&b, KV_EFORMAT, "past end");
    b_hdr(&b, 3, 0, 1);
    b_str(&b, "arr");
    b_u32(&b, KV_GGUF_ARRAY);
    b_u32(&b, KV_GGUF_STRING);
    b_u64(&b, 3);
    b_str(&b, "x");
    b_u64(&b, 100); /* second string runs past end */
    b_zeros(&b, 20);
    EXPECT_FAIL(&b, KV_EFORMAT, "past end");
    b_hdr(&b, 3, 0, 1);
    b_str(&b, "arr");
    b_u32(&b, KV_GGUF_ARRAY);
    b_u32(&b, KV_GGUF_STRING);
    b_u64(&b, 1000); /* count * 8 > bytes left */
    b_str(&b, "x");
    EXPECT_FAIL(&b, KV_EFORMAT, "past end");

    /* nested arrays: depth 2 accepted, depth 3 refused */
    b_hdr(&b, 3, 0, 1);
    b_str(&b, "nest");
    b_u32(&b, KV_GGUF_ARRAY);
    b_u32(&b, KV_GGUF_ARRAY);
    b_u64(&b, 2);
    b_u32(&b, KV_GGUF_UINT8);
    b_u64(&b, 3);
    b_put(&b, "abc", 3);
    b_u32(&b, KV_GGUF_STRING);
    b_u64(&b, 1);
    b_str(&b, "s");
    {
        kv_gguf *g = NULL;
        kv_diag d = {0};
        ASSERT_EQ(kv_gguf_open_mem(&g, b.p, b.len, &d), 0);
        if (g) {
            const kv_gguf_kv *kv = kv_gguf_find_kv(g, "nest");
            ASSERT_EQ(kv->val.v.arr.elem_type, KV_GGUF_ARRAY);
            ASSERT_EQ(kv->val.v.arr.n, 2);
            ASSERT_EQ(kv->val.v.arr.nbytes, (4 + 8 + 3) + (4 + 8 + 8 + 1));
            kv_gguf_close(g);
        }
    }
    EXPECT_OK(&b);
    b_hdr(&b, 3, 0, 1);
    b_str(&b, "nest3");
    b_u32(&b, KV_GGUF_ARRAY);
    b_u32(&b, KV_GGUF_ARRAY);
    b_u64(&b, 1);
    b_u32(&b, KV_GGUF_ARRAY);
    b_u64(&b, 1);
    b_u32(&b, KV_GGUF_UINT8);
    b_u64(&b, 1);
    b_u8(&b, 0);
    EXPECT_FAIL(&b, KV_EFORMAT, "nested");

    /* unknown metadata types */
    b_hdr(&b, 3, 0, 1);
    b_str(&b, "k");
    b_u32(&b, 13);
    b_zeros(&b, 8);
    EXPECT_FAIL(&b, KV_EFORMAT, "unknown value type 13");
    b_hdr(&b, 3, 0, 1);
    b_str(&b, "k");
    b_u32(&b, KV_GGUF_ARRAY);
    b_u32(&b, 0xffffffffu);
    b_u64(&b, 0);
    EXPECT_FAIL(&b, KV_EFORMAT, "unknown value type");

    /* bad bool */
    b_hdr(&b, 3, 0, 1);
    b_str(&b, "b");
    b_u32(&b, KV_GGUF_BOOL);
    b_u8(&b, 2);
    EXPECT_FAIL(&b, KV_EFORMAT, "bool");

    /* duplicate key */
    b_hdr(&b, 3, 0, 2);
    b_kv_u32(&b, "dup.key", 1);
    b_kv_u32(&b, "dup.key", 2);
    EXPECT_FAIL(&b, KV_EFORMAT, "duplicate key 'dup.key'");

    /* alignment: zero, not a power of two, too big, wrong type */
    uint32_t bad_al[3] = {0, 48, 1u << 20};
    for (int i = 0; i < 3; i++) {
        b_hdr(&b, 3, 0, 1);
        b_kv_u32(&b, "general.alignment", bad_al[i]);
        EXPECT_FAIL(&b, KV_EFORMAT, "general.alignment");
    }
    b_hdr(&b, 3, 0, 1);
    b_str(&b, "general.alignment");
    b_u32(&b, KV_GGUF_UINT64);
    b_u64(&b, 32);
    EXPECT_FAIL(&b, KV_EFORMAT, "must be u32");

    /* tensor dims */
    uint64_t ne5[5] = {8, 1, 1, 1, 1};
    b_hdr(&b, 3, 1, 0);
    b_tinfo(&b, "blk.0.attn_q.weight", 5, ne5, KV_TYPE_F32, 0);
    b_pad(&b, 32);
    b_zeros(&b, 64);
    EXPECT_FAIL(&b, KV_EFORMAT, "tensor 'blk.0.attn_q.weight' has 5 dims");
    b_hdr(&b, 3, 1, 0);
    b_tinfo(&b, "t", 0, ne5, KV_TYPE_F32, 0);
    b_pad(&b, 32);
    b_zeros(&b, 64);
    EXPECT_FAIL(&b, KV_EFORMAT, "0 dims");

    /* ne product overflow, ne > INT64_MAX */
    uint64_t neo[3] = {1ull << 32, 1ull << 31, 4};
    b_hdr(&b, 3, 1, 0);
    b_tinfo(&b, "huge", 3, neo, KV_TYPE_F32, 0);
    b_pad(&b, 32);
    b_zeros(&b, 64);
    EXPECT_FAIL(&b, KV_EFORMAT, "too many elements");
    uint64_t neb[2] = {8, UINT64_MAX};
    b_hdr(&b, 3, 1, 0);
    b_tinfo(&b, "neg", 2, neb, KV_TYPE_F32, 0);
    b_pad(&b, 32);
    b_zeros(&b, 64);
    EXPECT_FAIL(&b, KV_EFORMAT, "dim 1");
    /* bytes overflow: elements fit in int64 but bytes would not */
    uint64_t neby[2] = {1ull << 32, (1ull << 31) - 1};
    b_hdr(&b, 3, 1, 0);
    b_tinfo(&b, "wide", 2, neby, KV_TYPE_F64, 0);
    b_pad(&b, 32);
    b_zeros(&b, 64);
    EXPECT_FAIL(&b, KV_EFORMAT, "wide");

    /* unknown tensor types (a hole in the id space, and far out) */
    b_hdr(&b, 3, 1, 0);
    b_tinfo(&b, "blk.3.ffn_up_exps.weight", 1, ne1, 4, 0);
    b_pad(&b, 32);
    b_zeros(&b, 64);
    EXPECT_FAIL(&b, KV_EUNSUPPORTED, "'blk.3.ffn_up_exps.weight' has unknown type id 4");
    b_hdr(&b, 3, 1, 0);
    b_tinfo(&b, "t", 1, ne1, 100000, 0);
    b_pad(&b, 32);
    b_zeros(&b, 64);
    EXPECT_FAIL(&b, KV_EUNSUPPORTED, "type id 100000");

    /* row not a multiple of the block */
    uint64_t ne33[1] = {33};
    b_hdr(&b, 3, 1, 0);
    b_tinfo(&b, "q", 1, ne33, KV_TYPE_Q8_0, 0);
    b_pad(&b, 32);
    b_zeros(&b, 64);
    EXPECT_FAIL(&b, KV_EFORMAT, "block size 32");

    /* misaligned offset */
    uint64_t ne2[1] = {2};
    b_hdr(&b, 3, 2, 0);
    b_tinfo(&b, "a", 1, ne2, KV_TYPE_F32, 0);
    b_tinfo(&b, "b", 1, ne2, KV_TYPE_F32, 8);
    b_pad(&b, 32);
    b_zeros(&b, 64);
    EXPECT_FAIL(&b, KV_EFORMAT, "not a multiple of the alignment");

    /* data past EOF */
    uint64_t ne256[1] = {256};
    b_hdr(&b, 3, 1, 0);
    b_tinfo(&b, "big", 1, ne256, KV_TYPE_F32, 0);
    b_pad(&b, 32);
    b_zeros(&b, 1023);
    EXPECT_FAIL(&b, KV_EFORMAT, "past end of file");
    b_hdr(&b, 3, 1, 0);
    b_tinfo(&b, "far", 1, ne1, KV_TYPE_F32, 1ull << 60);
    b_pad(&b, 32);
    b_zeros(&b, 64);
    EXPECT_FAIL(&b, KV_EFORMAT, "past end of file");
    /* header ends but no room for the data section's padding */
    b_hdr(&b, 3, 1, 0);
    uint64_t ne0[1] = {0};
    b_tinfo(&b, "z", 1, ne0, KV_TYPE_F32, 0);
    EXPECT_FAIL(&b, KV_EFORMAT, "data section");

    /* overlapping tensors, and a gap */
    b_hdr(&b, 3, 2, 0);
    b_tinfo(&b, "first", 1, ne1, KV_TYPE_F32, 0);
    b_tinfo(&b, "second", 1, ne1, KV_TYPE_F32, 0);
    b_pad(&b, 32);
    b_zeros(&b, 64);
    EXPECT_FAIL(&b, KV_EFORMAT, "overlaps tensor 'first'");
    b_hdr(&b, 3, 2, 0);
    b_tinfo(&b, "first", 1, ne1, KV_TYPE_F32, 0);
    b_tinfo(&b, "second", 1, ne1, KV_TYPE_F32, 64);
    b_pad(&b, 32);
    b_zeros(&b, 128);
    EXPECT_FAIL(&b, KV_EFORMAT, "expected 32");
    /* tensors declared out of order (second before first in the data) */
    b_hdr(&b, 3, 2, 0);
    b_tinfo(&b, "first", 1, ne1, KV_TYPE_F32, 32);
    b_tinfo(&b, "second", 1, ne1, KV_TYPE_F32, 0);
    b_pad(&b, 32);
    b_zeros(&b, 64);
    EXPECT_FAIL(&b, KV_EFORMAT, "expected 0");

    /* duplicate tensor name, empty name, too long name */
    b_hdr(&b, 3, 2, 0);
    b_tinfo(&b, "same", 1, ne1, KV_TYPE_F32, 0);
    b_tinfo(&b, "same", 1, ne1, KV_TYPE_F32, 32);
    b_pad(&b, 32);
    b_zeros(&b, 64);
    EXPECT_FAIL(&b, KV_EFORMAT, "duplicate tensor name 'same'");
    b_hdr(&b, 3, 1, 0);
    b_tinfo(&b, "", 1, ne1, KV_TYPE_F32, 0);
    b_pad(&b, 32);
    b_zeros(&b, 32);
    EXPECT_FAIL(&b, KV_EFORMAT, "empty name");
    char n64[65];
    memset(n64, 'x', 64);
    n64[64] = 0;
    b_hdr(&b, 3, 1, 0);
    b_tinfo(&b, n64, 1, ne1, KV_TYPE_F32, 0);
    b_pad(&b, 32);
    b_zeros(&b, 32);
    EXPECT_FAIL(&b, KV_EFORMAT, "max 63");

    /* names with control bytes are sanitized in messages */
    b_hdr(&b, 3, 0, 2);
    b_kv_u32(&b, "bad\nkey", 1);
    b_kv_u32(&b, "bad\nkey", 1);
    EXPECT_FAIL(&b, KV_EFORMAT, "bad?key");

    /* zero-element tensors are accepted (ggml allows ne = 0) */
    b_hdr(&b, 3, 2, 0);
    b_tinfo(&b, "empty", 2, (uint64_t[]){0, 4}, KV_TYPE_Q8_0, 0);
    b_tinfo(&b, "after", 1, ne1, KV_TYPE_F32, 0);
    b_pad(&b, 32);
    b_zeros(&b, 32);
    EXPECT_OK(&b);

    /* custom alignment respected for data section and offsets */
    b_hdr(&b, 3, 2, 1);
    b_kv_u32(&b, "general.alignment", 64);
    b_tinfo(&b, "a", 1, ne1, KV_TYPE_F32, 0);
    b_tinfo(&b, "b", 1, ne1, KV_TYPE_F32, 32); /* would be fine at 32, not at 64 */
    b_pad(&b, 64);
    b_zeros(&b, 128);
    EXPECT_FAIL(&b, KV_EFORMAT, "alignment 64");
}

static void test_open_file_errors(void) {
    kv_diag d = {0};
    kv_gguf *g = NULL;
    ASSERT_EQ(kv_gguf_open(&g, "/nonexistent/x.gguf", &d), KV_EIO);
    ASSERT_TRUE(g == NULL && strstr(d.msg, "/nonexistent/x.gguf") != NULL);
    ASSERT_EQ(kv_gguf_open(&g, tmpdir, &d), KV_EIO);
    char path[400];
    snprintf(path, sizeof path, "%s/empty.gguf", tmpdir);
    FILE *f = fopen(path, "wb");
    fclose(f);
    ASSERT_EQ(kv_gguf_open(&g, path, &d), KV_EFORMAT);
    ASSERT_TRUE(strstr(d.msg, "empty") != NULL);
    /* a corrupt file on disk names the path */
    snprintf(path, sizeof path, "%s/v2.gguf", tmpdir);
    B b = {0};
    b_hdr(&b, 2, 0, 0);
    f = fopen(path, "wb");
    fwrite(b.p, 1, b.len, f);
    fclose(f);
    free(b.p);
    ASSERT_EQ(kv_gguf_open(&g, path, &d), KV_EUNSUPPORTED);
    ASSERT_TRUE(strstr(d.msg, path) != NULL && strstr(d.msg, "version 2") != NULL);
    kv_gguf_close(NULL);
}

/* A FIFO (or any non-regular file) named as a model is refused before it is
 * opened for reading: open(2) on a FIFO with no writer would block forever.
 * Run in a child under alarm() so that a hang fails the test instead of
 * stalling it. */
static void test_open_fifo(void) {
    char path[400];
    snprintf(path, sizeof path, "%s/fifo.gguf", tmpdir);
    ASSERT_EQ(mkfifo(path, 0600), 0);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(5);
        kv_diag d = {0};
        kv_gguf *g = NULL;
        int rc = kv_gguf_open(&g, path, &d);
        _exit(rc == KV_EIO && g == NULL && strstr(d.msg, "not a regular file") && !strchr(d.msg, '\n') ? 0 : 1);
    }
    int st = 0;
    ASSERT_TRUE(pid > 0 && waitpid(pid, &st, 0) == pid);
    if (!WIFEXITED(st)) KVT_FAIL("kv_gguf_open on a FIFO hung (killed by signal %d)", WTERMSIG(st));
    else ASSERT_EQ(WEXITSTATUS(st), 0);
    unlink(path);
}

/* With KV_GGUF_SEED_DIR set, writes small valid files as fuzzing seeds
 * (fuzz/corpus/gguf is made this way; names end in .bin, not .gguf). */
static void write_seed(const char *dir, const char *name, const B *b) {
    char path[600];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    ASSERT_TRUE(f != NULL);
    if (!f) return;
    ASSERT_EQ(fwrite(b->p, 1, b->len, f), b->len);
    fclose(f);
}

static void write_seeds(const char *dir) {
    B b = {0};
    valid_small(&b);
    write_seed(dir, "small.bin", &b);
    free(b.p);
    memset(&b, 0, sizeof b);

    /* every scalar type, a string array, a nested array, alignment 64 */
    b_hdr(&b, 3, 2, 16);
    b_kv_u32(&b, "general.alignment", 64);
    b_str(&b, "general.architecture");
    b_u32(&b, KV_GGUF_STRING);
    b_str(&b, "qwen3moe");
    for (uint32_t t = KV_GGUF_UINT8; t <= KV_GGUF_FLOAT64; t++) {
        size_t es = kv_gguf_type_size(t);
        if (!es) continue;
        char key[16];
        snprintf(key, sizeof key, "s.%s", kv_gguf_type_name(t));
        b_str(&b, key);
        b_u32(&b, t);
        b_u8(&b, 1);
        b_zeros(&b, es - 1);
    }
    b_str(&b, "tokenizer.ggml.tokens");
    b_u32(&b, KV_GGUF_ARRAY);
    b_u32(&b, KV_GGUF_STRING);
    b_u64(&b, 3);
    b_str(&b, "a");
    b_str(&b, "\xc4\xa0" "b");
    b_str(&b, "<|im_end|>");
    b_str(&b, "tokenizer.ggml.token_type");
    b_u32(&b, KV_GGUF_ARRAY);
    b_u32(&b, KV_GGUF_INT32);
    b_u64(&b, 3);
    b_u32(&b, 1);
    b_u32(&b, 1);
    b_u32(&b, 3);
    b_str(&b, "nest");
    b_u32(&b, KV_GGUF_ARRAY);
    b_u32(&b, KV_GGUF_ARRAY);
    b_u64(&b, 1);
    b_u32(&b, KV_GGUF_UINT16);
    b_u64(&b, 2);
    b_u32(&b, 0x00020001u);
    uint64_t ne_a[2] = {32, 2}, ne_b[3] = {256, 1, 1};
    b_tinfo(&b, "blk.0.ffn_up_exps.weight", 2, ne_a, KV_TYPE_Q8_0, 0);
    b_tinfo(&b, "output_norm.weight", 3, ne_b, KV_TYPE_Q4_K, 128);
    b_pad(&b, 64);
    for (int i = 0; i < 128 + 144; i++) b_u8(&b, (uint8_t)(i * 7));
    write_seed(dir, "types.bin", &b);
    free(b.p);
    memset(&b, 0, sizeof b);

    b_hdr(&b, 3, 0, 0);
    write_seed(dir, "empty.bin", &b);
    free(b.p);
}

static void cleanup_tmpdir(void) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", tmpdir);
}

static void test_round_trip_32(void) { test_round_trip(32); }
static void test_round_trip_64(void) { test_round_trip(64); }

/* KV_GGUF_SEED_DIR=DIR writes the fuzz seeds there; the seeds must open. */
static void test_seeds(void) {
    const char *seed_dir = getenv("KV_GGUF_SEED_DIR");
    if (!seed_dir || !*seed_dir) return;
    write_seeds(seed_dir);
    const char *names[3] = {"small.bin", "types.bin", "empty.bin"};
    for (int i = 0; i < 3; i++) {
        char path[600];
        snprintf(path, sizeof path, "%s/%s", seed_dir, names[i]);
        kv_gguf *g = NULL;
        kv_diag d = {0};
        int rc = kv_gguf_open(&g, path, &d);
        kvt_checks++;
        if (rc) KVT_FAIL("seed %s: %s", names[i], d.msg);
        kv_gguf_close(g);
    }
}

static int setup(void) {
    mk_tmpdir();
    return 0;
}
static void teardown(void) {
    printf("%d corrupt-input cases\n", n_cases);
    cleanup_tmpdir();
}

static const kvt_case cases[] = {
    KVT_CASE(test_round_trip_32), KVT_CASE(test_round_trip_64), KVT_CASE(test_writer_errors),
    KVT_CASE(test_truncations),   KVT_CASE(test_corrupt),       KVT_CASE(test_open_file_errors),
    KVT_CASE(test_open_fifo),     KVT_CASE(test_seeds),
};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
