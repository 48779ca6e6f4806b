/* libFuzzer target for the GGUF reader.
 *
 * Opens the input with kv_gguf_open_mem over an exact-size copy (so any
 * read past the end is an ASan error, not a silent read of libFuzzer's
 * padding), then walks everything a loader would touch: every key and
 * value, every string-array element through both the iterator and indexed
 * access, nested arrays' bytes, the typed getters on every key, every
 * tensor's name, shape and first/last data byte, and a copy of every pair
 * into a writer (which must accept whatever the reader accepted).
 * Invariants the reader promises are checked with __builtin_trap so a
 * violation is reported as a crash. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/gguf.h"

#define CHECK(x)                     \
    do {                             \
        if (!(x)) __builtin_trap();  \
    } while (0)

static volatile uint8_t sink;

static void touch(const void *p, size_t n) {
    const uint8_t *b = p;
    if (n) sink ^= b[0] ^ b[n - 1];
}

static void walk_kv(const kv_gguf *g, const kv_gguf_kv *kv, kv_gguf_writer *w) {
    kv_diag d = {0};
    char key[KV_GGUF_MAX_NAME + 1];
    CHECK(kv->key.len > 0 && kv->key.len <= KV_GGUF_MAX_NAME);
    touch(kv->key.ptr, kv->key.len);
    const kv_gguf_value *v = &kv->val;
    CHECK(v->type < KV_GGUF_TYPE_COUNT);
    if (v->type == KV_GGUF_STRING) {
        CHECK(v->v.str.len <= KV_GGUF_MAX_STRING);
        touch(v->v.str.ptr, v->v.str.len);
    } else if (v->type == KV_GGUF_ARRAY) {
        CHECK(v->v.arr.n <= KV_GGUF_MAX_ARRAY);
        touch(v->v.arr.data, v->v.arr.nbytes);
        size_t es = kv_gguf_type_size(v->v.arr.elem_type);
        if (es) CHECK(v->v.arr.nbytes == v->v.arr.n * es);
        if (v->v.arr.elem_type == KV_GGUF_STRING) {
            size_t pos = 0;
            uint64_t count = 0;
            kv_str s;
            while (kv_gguf_arr_str_iter(v, &pos, &s) == 0) {
                touch(s.ptr, s.len);
                count++;
                CHECK(count <= v->v.arr.n);
            }
            CHECK(count == v->v.arr.n && pos == v->v.arr.nbytes);
            if (v->v.arr.n) {
                CHECK(kv_gguf_arr_str(v, 0, &s) == 0);
                CHECK(kv_gguf_arr_str(v, v->v.arr.n - 1, &s) == 0);
                touch(s.ptr, s.len);
            }
            CHECK(kv_gguf_arr_str(v, v->v.arr.n, &s) == KV_ERANGE);
        }
    }
    /* typed getters by name must find this very pair and never crash */
    memcpy(key, kv->key.ptr, kv->key.len);
    key[kv->key.len] = '\0';
    if (!memchr(kv->key.ptr, 0, kv->key.len)) {
        uint32_t u32;
        int32_t i32;
        uint64_t u64, n;
        float f;
        bool b;
        kv_str s;
        const uint8_t *data;
        CHECK(kv_gguf_find_kv(g, key) == kv);
        (void)kv_gguf_get_u32(g, key, &u32, &d);
        (void)kv_gguf_get_i32(g, key, &i32, &d);
        (void)kv_gguf_get_u64(g, key, &u64, &d);
        (void)kv_gguf_get_f32(g, key, &f, &d);
        (void)kv_gguf_get_bool(g, key, &b, &d);
        if (kv_gguf_get_str(g, key, &s, &d) == 0) touch(s.ptr, s.len);
        if (v->type == KV_GGUF_ARRAY)
            CHECK(kv_gguf_get_arr(g, key, v->v.arr.elem_type, &n, &data, &d) == 0);
        CHECK(kv_gguf_writer_copy_kv(w, kv, &d) == 0);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy) return 0;
    if (size) memcpy(copy, data, size);
    kv_gguf *g = NULL;
    kv_diag d = {0};
    int rc = kv_gguf_open_mem(&g, copy, size, &d);
    if (rc != 0) {
        CHECK(g == NULL && rc < 0 && d.code == rc && d.msg[0] != '\0');
        free(copy);
        return 0;
    }
    kv_gguf_writer *w = NULL;
    if (kv_gguf_writer_new(&w, &d) != 0) abort();
    for (size_t i = 0; i < kv_gguf_n_kv(g); i++) walk_kv(g, kv_gguf_kv_at(g, i), w);
    kv_gguf_writer_free(w);

    uint64_t data_off = kv_gguf_data_offset(g), fsize = kv_gguf_file_size(g);
    CHECK(fsize == size && data_off <= fsize);
    CHECK(kv_gguf_alignment(g) && (kv_gguf_alignment(g) & (kv_gguf_alignment(g) - 1)) == 0);
    for (size_t i = 0; i < kv_gguf_n_tensors(g); i++) {
        const kv_gguf_tensor *t = kv_gguf_tensor_at(g, i);
        char name[KV_GGUF_MAX_TENSOR_NAME + 1];
        CHECK(t->name.len > 0 && t->name.len <= KV_GGUF_MAX_TENSOR_NAME);
        CHECK(t->n_dims >= 1 && t->n_dims <= KV_GGUF_MAX_DIMS);
        CHECK(t->file_offset == data_off + t->offset && t->offset % kv_gguf_alignment(g) == 0);
        CHECK(t->file_offset <= fsize && t->nbytes <= fsize - t->file_offset);
        CHECK((const uint8_t *)t->data == copy + t->file_offset);
        touch(t->data, (size_t)t->nbytes);
        memcpy(name, t->name.ptr, t->name.len);
        name[t->name.len] = '\0';
        if (!memchr(t->name.ptr, 0, t->name.len)) CHECK(kv_gguf_find_tensor(g, name) == t);
    }
    kv_gguf_close(g);
    free(copy);
    return 0;
}
