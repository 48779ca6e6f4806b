/* Split GGUF models (gguf.h): the writer and the assembly of the parts.
 *
 * 1. Round trip: a model of 7 tensors of known bytes written as 3 parts by
 *    kv_gguf_split_write; each part read alone (kv_gguf_open_file) has the
 *    keys llama.cpp's loader reads, with llama.cpp's value types (split.no
 *    and split.count u16, split.tensors.count i32) and the metadata only in
 *    the first part; opened by any part (kv_gguf_open) the model has every
 *    tensor with the source's bytes, and one identity, which is the split
 *    identity of slice.h computed here from the parts' own identities.
 * 2. --split-max-size: the cut equals an independent greedy plan; a source
 *    at alignment 64 keeps it in every part; a hole in the source (a
 *    skeleton) stays a hole in its part.
 * 3. Broken sets, made part by part with the plain writer: a missing part, a
 *    part of another split count, a wrong split.no, a tensor in two parts, a
 *    wrong tensor total, a name without -NNNNN-of-MMMMM.gguf, a count past
 *    KV_GGUF_MAX_SPLITS, a key contradicting the first part's: each is
 *    refused with the code and a message naming the part or the fault. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvasir/err.h"
#include "kvasir/gguf.h"
#include "kvasir/pieces.h"
#include "kvasir/quant.h"
#include "kvasir/slice.h"
#include "kvtest.h"

#define NT 7
static const uint64_t rows[NT] = {3, 40, 1, 17, 64, 5, 9}; /* x 32 f32 each */
static float *src_data[NT];
static char tmpdir[200];

static void path_of(char *out, size_t cap, const char *name) { snprintf(out, cap, "%s/%s", tmpdir, name); }

static int setup(void) {
    const char *t = getenv("TMPDIR");
    snprintf(tmpdir, sizeof tmpdir, "%s/kv_test_gguf_split_XXXXXX", t && *t ? t : "/tmp");
    if (!mkdtemp(tmpdir)) return 1;
    kv_diag d = {0};
    kv_gguf_writer *w = NULL;
    char p[512];
    path_of(p, sizeof p, "src.gguf");
    if (kv_gguf_writer_new(&w, &d)) return 1;
    int rc = kv_gguf_writer_set_str(w, "general.architecture", "test", &d);
    if (!rc) rc = kv_gguf_writer_set_u32(w, "test.block_count", 7, &d);
    for (int i = 0; i < NT && !rc; i++) {
        char name[32];
        snprintf(name, sizeof name, "t%d.weight", i);
        const uint64_t ne[2] = {32, rows[i]};
        rc = kv_gguf_writer_add_tensor(w, name, 2, ne, KV_TYPE_F32, NULL, &d);
        src_data[i] = malloc(32 * rows[i] * sizeof(float));
        for (uint64_t k = 0; k < 32 * rows[i]; k++) src_data[i][k] = (float)(i * 1000 + (int)k) * 0.25f + 1.0f;
    }
    if (!rc) rc = kv_gguf_writer_begin(w, p, &d);
    for (int i = 0; i < NT && !rc; i++)
        rc = kv_gguf_writer_write_data(w, (size_t)i, 0, src_data[i], 32 * rows[i] * sizeof(float), &d);
    if (!rc) rc = kv_gguf_writer_finish(w, &d);
    kv_gguf_writer_free(w);
    if (rc) fprintf(stderr, "setup: %s\n", d.msg);
    return rc;
}

static void teardown(void) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd)) fprintf(stderr, "cannot remove %s\n", tmpdir);
    for (int i = 0; i < NT; i++) free(src_data[i]);
}

/* ---- 1. round trip --------------------------------------------------- */

static void check_model(const kv_gguf *g) {
    ASSERT_EQ(kv_gguf_n_tensors(g), NT);
    for (int i = 0; i < NT; i++) {
        char name[32];
        snprintf(name, sizeof name, "t%d.weight", i);
        const kv_gguf_tensor *t = kv_gguf_find_tensor(g, name);
        ASSERT_TRUE(t != NULL);
        if (!t) continue;
        ASSERT_EQ(t->ne[1], rows[i]);
        ASSERT_EQ(t->nbytes, 32 * rows[i] * sizeof(float));
        ASSERT_TRUE(!memcmp(t->data, src_data[i], (size_t)t->nbytes));
        /* the part it names holds it, at the offset it says */
        const kv_gguf *p = kv_gguf_part(g, t->part);
        ASSERT_TRUE(p != NULL);
        if (p) ASSERT_TRUE((const uint8_t *)kv_gguf_base(p) + t->file_offset == (const uint8_t *)t->data);
    }
    uint32_t bc = 0;
    ASSERT_EQ(kv_gguf_get_u32(g, "test.block_count", &bc, NULL), 0);
    ASSERT_EQ(bc, 7);
}

static void test_roundtrip(void) {
    char src[512], prefix[256], p[3][512];
    path_of(src, sizeof src, "src.gguf");
    path_of(prefix, sizeof prefix, "rt");
    kv_diag d = {0};
    uint32_t n = 0;
    ASSERT_EQ(kv_gguf_split_write(src, prefix, 3, 0, &n, &d), 0);
    ASSERT_EQ(n, 3);
    size_t held = 0;
    for (int k = 0; k < 3; k++) {
        snprintf(p[k], sizeof p[k], "%s-%05d-of-00003.gguf", prefix, k + 1);
        kv_gguf *g = NULL;
        ASSERT_EQ(kv_gguf_open_file(&g, p[k], &d), 0);
        if (!g) continue;
        ASSERT_EQ(kv_gguf_n_parts(g), 1);
        const kv_gguf_kv *no = kv_gguf_find_kv(g, "split.no"), *cnt = kv_gguf_find_kv(g, "split.count"),
                         *tc = kv_gguf_find_kv(g, "split.tensors.count");
        ASSERT_TRUE(no && cnt && tc);
        if (no && cnt && tc) {
            ASSERT_EQ(no->val.type, KV_GGUF_UINT16);
            ASSERT_EQ(cnt->val.type, KV_GGUF_UINT16);
            ASSERT_EQ(tc->val.type, KV_GGUF_INT32);
            ASSERT_EQ(no->val.v.u64, k);
            ASSERT_EQ(cnt->val.v.u64, 3);
            ASSERT_EQ(tc->val.v.i64, NT);
        }
        ASSERT_EQ(kv_gguf_find_kv(g, "general.architecture") != NULL, k == 0);
        ASSERT_TRUE(kv_gguf_n_tensors(g) >= 1);
        held += kv_gguf_n_tensors(g);
        kv_gguf_close(g);
    }
    ASSERT_EQ(held, NT);
    /* the whole model from any part, one identity */
    char ids[3][65], ref_part[3][65];
    for (int k = 0; k < 3; k++) {
        kv_gguf *g = NULL;
        ASSERT_EQ(kv_gguf_open(&g, p[k], &d), 0);
        if (!g) return;
        ASSERT_EQ(kv_gguf_n_parts(g), 3);
        ASSERT_STREQ(kv_gguf_path(g), p[0]);
        check_model(g);
        char mt[65];
        ASSERT_EQ(kv_pieces_model_id(g, p[k], 1, ids[k], &d), 0);
        kv_slice_model_id(g, mt);
        ASSERT_STREQ(mt, ids[k]);
        kv_gguf_close(g);
        kv_gguf *one = NULL;
        ASSERT_EQ(kv_gguf_open_file(&one, p[k], &d), 0);
        if (one) kv_slice_model_id(one, ref_part[k]);
        kv_gguf_close(one);
    }
    ASSERT_STREQ(ids[0], ids[1]);
    ASSERT_STREQ(ids[0], ids[2]);
    /* slice.h: SHA-256(tag NUL || u32le(3) || id_1 || id_2 || id_3) */
    kv_sha256 h;
    uint8_t raw[32], n4[4] = {3, 0, 0, 0};
    char want[65];
    kv_sha256_init(&h);
    kv_sha256_update(&h, "kvasir-model-id-split-v1", sizeof "kvasir-model-id-split-v1");
    kv_sha256_update(&h, n4, 4);
    for (int k = 0; k < 3; k++) kv_sha256_update(&h, ref_part[k], 64);
    kv_sha256_final(&h, raw);
    kv_sha256_hex(raw, want);
    ASSERT_STREQ(ids[0], want);
    /* the unsplit source is another file, so another identity */
    kv_gguf *g = NULL;
    ASSERT_EQ(kv_gguf_open(&g, src, &d), 0);
    if (g) {
        char sid[65];
        kv_slice_model_id(g, sid);
        ASSERT_TRUE(strcmp(sid, ids[0]) != 0);
        ASSERT_EQ(kv_gguf_n_parts(g), 1);
        check_model(g);
    }
    kv_gguf_close(g);
    /* a split model splits again (from any part) */
    char prefix2[256], q[512];
    path_of(prefix2, sizeof prefix2, "rt2");
    ASSERT_EQ(kv_gguf_split_write(p[1], prefix2, 2, 0, &n, &d), 0);
    ASSERT_EQ(n, 2);
    snprintf(q, sizeof q, "%s-00002-of-00002.gguf", prefix2);
    ASSERT_EQ(kv_gguf_open(&g, q, &d), 0);
    if (g) {
        ASSERT_EQ(kv_gguf_n_parts(g), 2);
        check_model(g);
        kv_str a;
        ASSERT_EQ(kv_gguf_get_str(g, "general.architecture", &a, NULL), 0);
    }
    kv_gguf_close(g);
    /* bad arguments */
    ASSERT_EQ(kv_gguf_split_write(src, prefix2, 8, 0, NULL, &d), KV_EINVAL); /* 8 parts of 7 tensors */
    ASSERT_TRUE(strstr(d.msg, "only 7 tensors") != NULL);
    ASSERT_EQ(kv_gguf_split_write(src, prefix2, 2, 100, NULL, &d), KV_EINVAL);
    ASSERT_EQ(kv_gguf_split_write(src, prefix2, 0, 0, NULL, &d), KV_EINVAL);
}

/* ---- 2. by size ------------------------------------------------------- */

static void test_max_size(void) {
    char src[512], prefix[256];
    path_of(src, sizeof src, "src.gguf");
    path_of(prefix, sizeof prefix, "ms");
    const uint64_t max = 6000; /* bytes of tensor data per part */
    /* independent plan: a new part when the next (padded) tensor would pass max */
    uint32_t want_part[NT], np = 1;
    uint64_t cur = 0;
    for (int i = 0; i < NT; i++) {
        const uint64_t b = (32 * rows[i] * 4 + 31) / 32 * 32;
        if (cur > 0 && cur + b > max) np++, cur = 0;
        want_part[i] = np - 1;
        cur += b;
    }
    kv_diag d = {0};
    uint32_t n = 0;
    ASSERT_EQ(kv_gguf_split_write(src, prefix, 0, max, &n, &d), 0);
    ASSERT_EQ(n, np);
    char p[512];
    snprintf(p, sizeof p, "%s-00001-of-%05u.gguf", prefix, np);
    kv_gguf *g = NULL;
    ASSERT_EQ(kv_gguf_open(&g, p, &d), 0);
    if (!g) return;
    check_model(g);
    for (int i = 0; i < NT; i++) ASSERT_EQ(kv_gguf_tensor_at(g, (size_t)i)->part, want_part[i]);
    kv_gguf_close(g);
}

/* A source at alignment 64: every part keeps it (its own key), so each
 * part's tensor data lies at multiples of 64 as in the source. */
static void test_alignment(void) {
    char src[512], prefix[256], p[512];
    path_of(src, sizeof src, "a64.gguf");
    path_of(prefix, sizeof prefix, "a64s");
    kv_diag d = {0};
    kv_gguf_writer *w = NULL;
    ASSERT_EQ(kv_gguf_writer_new(&w, &d), 0);
    if (!w) return;
    ASSERT_EQ(kv_gguf_writer_set_alignment(w, 64, &d), 0);
    for (int i = 0; i < 4; i++) {
        char name[16];
        snprintf(name, sizeof name, "u%d", i);
        const uint64_t ne[1] = {8 + 8 * (uint64_t)i}; /* 32..128 bytes: padding between tensors */
        ASSERT_EQ(kv_gguf_writer_add_tensor(w, name, 1, ne, KV_TYPE_F32, NULL, &d), 0);
    }
    ASSERT_EQ(kv_gguf_writer_begin(w, src, &d), 0);
    for (int i = 0; i < 4; i++) {
        float v[32];
        for (int k = 0; k < 32; k++) v[k] = (float)(i * 100 + k);
        ASSERT_EQ(kv_gguf_writer_write_data(w, (size_t)i, 0, v, (8 + 8 * (size_t)i) * sizeof(float), &d), 0);
    }
    ASSERT_EQ(kv_gguf_writer_finish(w, &d), 0);
    kv_gguf_writer_free(w);
    uint32_t n = 0;
    ASSERT_EQ(kv_gguf_split_write(src, prefix, 2, 0, &n, &d), 0);
    ASSERT_EQ(n, 2);
    for (int k = 0; k < 2; k++) {
        snprintf(p, sizeof p, "%s-%05d-of-00002.gguf", prefix, k + 1);
        kv_gguf *g = NULL;
        ASSERT_EQ(kv_gguf_open_file(&g, p, &d), 0);
        if (!g) continue;
        uint32_t al = 0;
        ASSERT_EQ(kv_gguf_get_u32(g, "general.alignment", &al, NULL), 0);
        ASSERT_EQ(al, 64);
        ASSERT_EQ(kv_gguf_alignment(g), 64);
        for (size_t i = 0; i < kv_gguf_n_tensors(g); i++) ASSERT_EQ(kv_gguf_tensor_at(g, i)->file_offset % 64, 0);
        kv_gguf_close(g);
    }
    kv_gguf *a = NULL, *b = NULL;
    ASSERT_EQ(kv_gguf_open(&a, src, &d), 0);
    ASSERT_EQ(kv_gguf_open(&b, p, &d), 0);
    if (a && b) {
        ASSERT_EQ(kv_gguf_n_tensors(b), 4);
        for (size_t i = 0; i < 4; i++) {
            const kv_gguf_tensor *x = kv_gguf_tensor_at(a, i), *y = kv_gguf_tensor_at(b, i);
            ASSERT_TRUE(x->name.len == y->name.len && !memcmp(x->name.ptr, y->name.ptr, x->name.len));
            ASSERT_EQ(x->nbytes, y->nbytes);
            ASSERT_TRUE(!memcmp(x->data, y->data, (size_t)x->nbytes));
        }
    }
    kv_gguf_close(a);
    kv_gguf_close(b);
}

/* A source whose big tensor was never written (a hole, as in a skeleton):
 * its part stays sparse, and reads back as zeros. */
static void test_sparse(void) {
    char src[512], prefix[256], p[512];
    path_of(src, sizeof src, "sparse.gguf");
    path_of(prefix, sizeof prefix, "sparses");
    kv_diag d = {0};
    kv_gguf_writer *w = NULL;
    ASSERT_EQ(kv_gguf_writer_new(&w, &d), 0);
    if (!w) return;
    const uint64_t small[1] = {64}, big[2] = {1024, 2048}; /* 8 MiB of f32 */
    ASSERT_EQ(kv_gguf_writer_add_tensor(w, "small", 1, small, KV_TYPE_F32, NULL, &d), 0);
    ASSERT_EQ(kv_gguf_writer_add_tensor(w, "big", 2, big, KV_TYPE_F32, NULL, &d), 0);
    ASSERT_EQ(kv_gguf_writer_begin(w, src, &d), 0);
    float v[64];
    for (int k = 0; k < 64; k++) v[k] = (float)k + 0.5f;
    ASSERT_EQ(kv_gguf_writer_write_data(w, 0, 0, v, sizeof v, &d), 0);
    ASSERT_EQ(kv_gguf_writer_finish(w, &d), 0);
    kv_gguf_writer_free(w);
    uint32_t n = 0;
    ASSERT_EQ(kv_gguf_split_write(src, prefix, 2, 0, &n, &d), 0);
    snprintf(p, sizeof p, "%s-00002-of-00002.gguf", prefix);
    struct stat st;
    ASSERT_EQ(stat(p, &st), 0);
    ASSERT_TRUE(st.st_size > (8 << 20));
    if ((uint64_t)st.st_blocks * 512 >= (1u << 20))
        KVT_FAIL("the part holding the hole takes %lld bytes of disk", (long long)st.st_blocks * 512);
    kv_gguf *g = NULL;
    ASSERT_EQ(kv_gguf_open(&g, p, &d), 0);
    if (!g) return;
    const kv_gguf_tensor *t = kv_gguf_find_tensor(g, "big"), *s = kv_gguf_find_tensor(g, "small");
    ASSERT_TRUE(t && s);
    if (t && s) {
        ASSERT_EQ(t->part, 1);
        ASSERT_TRUE(!memcmp(s->data, v, sizeof v));
        const uint8_t *b = t->data;
        size_t nz = 0;
        for (uint64_t i = 0; i < t->nbytes; i += 4093) nz += b[i] != 0;
        ASSERT_EQ(nz, 0);
    }
    kv_gguf_close(g);
}

/* ---- 3. broken sets --------------------------------------------------- */

/* Writes one part by hand: split keys as given (count 0 = none), the
 * tensors named in names (1-row f32), and arch as general.architecture if
 * not NULL. */
static void make_part(const char *file, int no, int count, int total, const char *const *names, int n_names,
                      const char *arch) {
    char p[512];
    path_of(p, sizeof p, file);
    kv_diag d = {0};
    kv_gguf_writer *w = NULL;
    int rc = kv_gguf_writer_new(&w, &d);
    if (!rc && arch) rc = kv_gguf_writer_set_str(w, "general.architecture", arch, &d);
    if (!rc && count) rc = kv_gguf_writer_set_u16(w, "split.no", (uint16_t)no, &d);
    if (!rc && count) rc = kv_gguf_writer_set_u32(w, "split.count", (uint32_t)count, &d);
    if (!rc && count) rc = kv_gguf_writer_set_i32(w, "split.tensors.count", total, &d);
    for (int i = 0; i < n_names && !rc; i++) {
        const uint64_t ne[1] = {32};
        rc = kv_gguf_writer_add_tensor(w, names[i], 1, ne, KV_TYPE_F32, NULL, &d);
    }
    if (!rc) rc = kv_gguf_writer_begin(w, p, &d);
    if (!rc) rc = kv_gguf_writer_finish(w, &d);
    kv_gguf_writer_free(w);
    ASSERT_EQ(rc, 0);
}

/* kv_gguf_open of file fails with code and a message holding each of want[]. */
static void expect_fail(const char *file, int code, const char *w1, const char *w2) {
    char p[512];
    path_of(p, sizeof p, file);
    kv_gguf *g = (kv_gguf *)1;
    kv_diag d = {0};
    const int rc = kv_gguf_open(&g, p, &d);
    ASSERT_EQ(rc, code);
    ASSERT_TRUE(g == NULL);
    if (w1 && !strstr(d.msg, w1)) KVT_FAIL("'%s' lacks '%s'", d.msg, w1);
    if (w2 && !strstr(d.msg, w2)) KVT_FAIL("'%s' lacks '%s'", d.msg, w2);
    if (rc == 0) kv_gguf_close(g);
}

static void test_broken(void) {
    static const char *const a[] = {"a"}, *const b[] = {"b"}, *const c[] = {"c"}, *const bc[] = {"b", "c"};
    /* a good set of 3, then each part damaged in turn */
    make_part("x-00001-of-00003.gguf", 0, 3, 3, a, 1, "test");
    make_part("x-00002-of-00003.gguf", 1, 3, 3, b, 1, NULL);
    make_part("x-00003-of-00003.gguf", 2, 3, 3, c, 1, NULL);
    kv_gguf *g = NULL;
    kv_diag d = {0};
    char p[512];
    path_of(p, sizeof p, "x-00003-of-00003.gguf");
    ASSERT_EQ(kv_gguf_open(&g, p, &d), 0);
    if (g) ASSERT_EQ(kv_gguf_n_tensors(g), 3);
    kv_gguf_close(g);

    path_of(p, sizeof p, "x-00002-of-00003.gguf");
    ASSERT_EQ(unlink(p), 0);
    expect_fail("x-00001-of-00003.gguf", KV_ENOTFOUND, "part 2 of 3 is missing", "x-00002-of-00003.gguf");
    expect_fail("x-00003-of-00003.gguf", KV_ENOTFOUND, "part 2 of 3 is missing", NULL);

    make_part("x-00002-of-00003.gguf", 1, 4, 3, b, 1, NULL); /* another count */
    expect_fail("x-00001-of-00003.gguf", KV_EFORMAT, "part 2 says split.count 4", NULL);
    make_part("x-00002-of-00003.gguf", 2, 3, 3, b, 1, NULL); /* says it is part 3 */
    expect_fail("x-00001-of-00003.gguf", KV_EFORMAT, "named as part 2 but its split.no says part 3", NULL);
    make_part("x-00002-of-00003.gguf", 1, 3, 3, a, 1, NULL); /* a again */
    expect_fail("x-00001-of-00003.gguf", KV_EFORMAT, "tensor 'a' is in part 1 and again in part 2", NULL);
    make_part("x-00002-of-00003.gguf", 1, 3, 3, bc, 2, NULL); /* c twice, and 4 tensors */
    expect_fail("x-00001-of-00003.gguf", KV_EFORMAT, "tensor 'c'", NULL);
    make_part("x-00002-of-00003.gguf", 1, 3, 3, b, 1, "other"); /* another model's key */
    expect_fail("x-00003-of-00003.gguf", KV_EFORMAT, "general.architecture' differs", NULL);
    make_part("x-00002-of-00003.gguf", 1, 0, 0, b, 1, NULL); /* not a part at all */
    expect_fail("x-00001-of-00003.gguf", KV_EFORMAT, "part 2 of 3 has no split.count", NULL);
    make_part("x-00002-of-00003.gguf", 1, 3, 3, b, 1, NULL); /* good again */
    make_part("x-00001-of-00003.gguf", 0, 3, 4, a, 1, "test");
    expect_fail("x-00001-of-00003.gguf", KV_EFORMAT, "split.tensors.count", NULL);
    make_part("y-00001-of-00002.gguf", 0, 2, 3, a, 1, "test"); /* total 3 in parts of 2 tensors */
    make_part("y-00002-of-00002.gguf", 1, 2, 3, b, 1, NULL);
    expect_fail("y-00002-of-00002.gguf", KV_EFORMAT, "split.tensors.count is 3 but its 2 parts hold 2", NULL);

    make_part("model.gguf", 0, 2, 2, a, 1, "test"); /* not named as a part */
    expect_fail("model.gguf", KV_EFORMAT, "not named PREFIX-00001-of-00002.gguf", NULL);
    make_part("z-00001-of-04097.gguf", 0, 4097, 1, a, 1, "test");
    expect_fail("z-00001-of-04097.gguf", KV_EFORMAT, "exceeds the maximum of 4096 parts", NULL);
    make_part("w-00003-of-00002.gguf", 2, 2, 1, a, 1, "test");
    expect_fail("w-00003-of-00002.gguf", KV_EFORMAT, "split.no 2 is not below split.count 2", NULL);
    /* split.count 1: a file of its own */
    make_part("one-00001-of-00001.gguf", 0, 1, 1, a, 1, "test");
    path_of(p, sizeof p, "one-00001-of-00001.gguf");
    ASSERT_EQ(kv_gguf_open(&g, p, &d), 0);
    if (g) ASSERT_EQ(kv_gguf_n_parts(g), 1);
    kv_gguf_close(g);
}

static const kvt_case cases[] = {KVT_CASE(test_roundtrip), KVT_CASE(test_max_size), KVT_CASE(test_alignment), KVT_CASE(test_sparse),
                                  KVT_CASE(test_broken)};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
