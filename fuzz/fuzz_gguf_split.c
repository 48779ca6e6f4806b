/* libFuzzer target for the assembly of split GGUF models (gguf_split.c).
 *
 * Input: u8 n (parts, 1..4 used), u8 pick (the part opened), then up to n
 * chunks, each u32le length + that many bytes (a short last chunk is cut).
 * Chunk k is written as part k of n, named as llama.cpp names them
 * (f-0000k-of-0000n.gguf) in a private folder; parts not given are absent.
 * kv_gguf_open of the picked part must either fail with a message or give
 * a handle whose invariants hold: n_parts parts, each tensor's part in
 * range and its data inside that part's file, names unique across parts
 * (find_tensor returns the tensor itself), every key of the first part
 * readable. Violations trap. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvasir/gguf.h"

#define CHECK(x)                    \
    do {                            \
        if (!(x)) __builtin_trap(); \
    } while (0)

#define MAX_PARTS 4u

static char dir[64];
static volatile uint8_t sink;

static void part_name(char *out, size_t cap, unsigned k, unsigned n) {
    snprintf(out, cap, "%s/f-%05u-of-%05u.gguf", dir, k + 1, n);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!dir[0]) {
        snprintf(dir, sizeof dir, "/tmp/kv_fuzz_split_XXXXXX");
        if (!mkdtemp(dir)) abort();
    }
    if (size < 2) return 0;
    const unsigned n = 1 + data[0] % MAX_PARTS, pick = data[1] % n;
    data += 2;
    size -= 2;
    char path[128];
    for (unsigned k = 0; k < MAX_PARTS; k++) /* clear the last input's files */
        for (unsigned m = 1; m <= MAX_PARTS; m++) {
            part_name(path, sizeof path, k, m);
            unlink(path);
        }
    bool written[MAX_PARTS] = {0};
    for (unsigned k = 0; k < n && size >= 4; k++) {
        uint32_t len = (uint32_t)data[0] | (uint32_t)data[1] << 8 | (uint32_t)data[2] << 16 | (uint32_t)data[3] << 24;
        data += 4;
        size -= 4;
        if (len > size) len = (uint32_t)size;
        part_name(path, sizeof path, k, n);
        FILE *f = fopen(path, "wb");
        if (!f) abort();
        if (len && fwrite(data, 1, len, f) != len) abort();
        fclose(f);
        written[k] = len > 0;
        data += len;
        size -= len;
    }
    if (!written[pick]) return 0;
    part_name(path, sizeof path, pick, n);
    kv_gguf *g = NULL;
    kv_diag d = {0};
    if (kv_gguf_open(&g, path, &d)) {
        CHECK(g == NULL && d.msg[0]);
        return 0;
    }
    const size_t np = kv_gguf_n_parts(g);
    CHECK(np >= 1 && np <= MAX_PARTS);
    for (size_t i = 0; i < kv_gguf_n_kv(g); i++) {
        const kv_gguf_kv *kv = kv_gguf_kv_at(g, i);
        CHECK(kv && kv->key.len);
        sink ^= (uint8_t)kv->key.ptr[kv->key.len - 1];
    }
    for (size_t i = 0; i < kv_gguf_n_tensors(g); i++) {
        const kv_gguf_tensor *t = kv_gguf_tensor_at(g, i);
        CHECK(t && t->part < np);
        const kv_gguf *p = kv_gguf_part(g, t->part);
        CHECK(p && kv_gguf_n_parts(p) == 1);
        CHECK(t->file_offset + t->nbytes <= kv_gguf_file_size(p));
        CHECK((const uint8_t *)t->data == (const uint8_t *)kv_gguf_base(p) + t->file_offset);
        if (t->nbytes) sink ^= ((const uint8_t *)t->data)[0] ^ ((const uint8_t *)t->data)[t->nbytes - 1];
        char name[KV_GGUF_MAX_TENSOR_NAME + 1];
        memcpy(name, t->name.ptr, t->name.len);
        name[t->name.len] = 0;
        if (!memchr(name, 0, t->name.len)) CHECK(kv_gguf_find_tensor(g, name) == t);
    }
    kv_gguf_close(g);
    return 0;
}
