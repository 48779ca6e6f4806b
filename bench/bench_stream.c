/* Decode-shaped kernel streaming against a read probe (not a test): how
 * close the one-token matrix kernels come to the memory's read bandwidth
 * when their weights come from a GGUF file's mapping, as the engine reads
 * them, and from an anonymous copy of the same bytes. Each round: the probe
 * (a sum over a 1 GiB anonymous buffer, the bench/run.sh probe's loop), the
 * kernel over the file mapping, the kernel over the copy; single thread.
 *
 *   bench_stream F.gguf TENSOR [rounds]   one kv_mat_rows over every row of TENSOR
 *   bench_stream F.gguf experts [rounds]  every MoE layer's gate, up and down of 8
 *                                         random experts, one call per expert matrix
 *                                         (what the local provider does per token)
 *
 * KV_QUANT_BACKEND picks the kernels. The copy is skipped past 4 GiB. Rows
 * of a 3-D tensor are its experts' rows, one after another. Prints one line
 * per round: GB/s of weights and the share of that round's probe. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvasir/arch.h"
#include "kvasir/gguf.h"
#include "kvasir/quant.h"

#define PROBE_BYTES ((size_t)1 << 30)
#define COPY_MAX ((size_t)4 << 30)
#define N_USED 8

typedef struct {
    const uint8_t *w[2]; /* the file mapping, the copy (NULL: none) */
    uint32_t type;
    int64_t n, rows;     /* row length, rows per call */
    size_t rb, stride;   /* bytes per row, bytes per expert (0: one matrix) */
    int64_t n_mat;       /* experts in the tensor (1: one matrix) */
} bs_mat;

static double bs_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* One pass of the probe: a sum of every 64-bit word, with 256-bit loads
 * on x86 (the -O3 -march=native loop of bench/run.sh's probe), so the loads
 * and not the adds bound it; the best of 4 passes, two of them with a
 * software prefetch 4 KiB ahead. */
#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("avx2"))) static uint64_t bs_sum(const uint64_t *p, size_t words, size_t pf) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    for (size_t i = 0; i < words; i += 8) {
        if (pf) _mm_prefetch((const char *)(p + i) + pf, _MM_HINT_T0);
        a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *)(const void *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *)(const void *)(p + i + 4)));
    }
    uint64_t o[4];
    _mm256_storeu_si256((__m256i *)(void *)o, _mm256_add_epi64(a0, a1));
    return o[0] + o[1] + o[2] + o[3];
}
#else
static uint64_t bs_sum(const uint64_t *p, size_t words, size_t pf) {
    (void)pf;
    uint64_t a[8] = {0};
    for (size_t i = 0; i < words; i += 8)
        for (int k = 0; k < 8; k++) a[k] += p[i + (size_t)k];
    return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}
#endif

static volatile uint64_t bs_sink;
static double bs_probe(const uint64_t *p, size_t words) {
    double best = 0;
    for (int rep = 0; rep < 4; rep++) { /* without and with a 4 KiB software prefetch, twice */
        const double t0 = bs_now();
        bs_sink = bs_sum(p, words, rep & 1 ? 4096 : 0);
        const double g = (double)words * 8 / (bs_now() - t0) / 1e9;
        if (g > best) best = g;
    }
    return best;
}

static int bs_add(bs_mat *m, const kv_gguf *g, const char *name, int64_t *n_mats) {
    const kv_gguf_tensor *t = kv_gguf_find_tensor(g, name);
    if (!t) return 0;
    if (t->n_dims < 2 || !kv_type_get(t->type) || !kv_type_get(t->type)->compute) {
        fprintf(stderr, "bench_stream: %s: not a matrix of a compute type\n", name);
        return -1;
    }
    bs_mat *x = &m[(*n_mats)++];
    x->w[0] = t->data;
    x->w[1] = NULL;
    x->type = t->type;
    x->n = (int64_t)t->ne[0];
    x->rb = kv_type_row_size(t->type, t->ne[0]);
    x->n_mat = t->n_dims > 2 ? (int64_t)t->ne[2] : 1;
    x->rows = (int64_t)t->ne[1];
    x->stride = x->rb * (size_t)x->rows;
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: bench_stream F.gguf TENSOR|experts [rounds]\n");
        return 2;
    }
    const int rounds = argc > 3 ? atoi(argv[3]) : 4;
    if (rounds < 1 || rounds > 100) {
        fprintf(stderr, "bench_stream: rounds must be 1..100\n");
        return 2;
    }
    kv_gguf *g = NULL;
    kv_diag d = {0};
    if (kv_gguf_open(&g, argv[1], &d)) {
        fprintf(stderr, "bench_stream: %s\n", d.msg);
        return 1;
    }
    const int experts = strcmp(argv[2], "experts") == 0;
    bs_mat m[3 * 256];
    int64_t nm = 0;
    if (experts) {
        for (int il = 0; il < 256; il++)
            for (int k = 0; k < 3; k++) {
                static const char *stem[3] = {KV_EXPERT_STEM_GATE, KV_EXPERT_STEM_UP, KV_EXPERT_STEM_DOWN};
                char name[64];
                snprintf(name, sizeof name, "blk.%d.%s.weight", il, stem[k]);
                if (bs_add(m, g, name, &nm)) return 1;
            }
    } else if (bs_add(m, g, argv[2], &nm)) {
        return 1;
    }
    if (nm == 0) {
        fprintf(stderr, "bench_stream: %s: no such tensor in %s\n", experts ? "routed-expert tensors" : argv[2], argv[1]);
        return 1;
    }
    size_t total = 0, n_max = 0, rows_max = 0;
    for (int64_t i = 0; i < nm; i++) {
        total += m[i].stride * (size_t)m[i].n_mat;
        if ((size_t)m[i].n > n_max) n_max = (size_t)m[i].n;
        const size_t r = (size_t)m[i].rows * (experts ? 1 : (size_t)m[i].n_mat);
        if (r > rows_max) rows_max = r;
    }
    if (total <= COPY_MAX)
        for (int64_t i = 0; i < nm; i++) {
            uint8_t *c = malloc(m[i].stride * (size_t)m[i].n_mat);
            if (!c) break;
            memcpy(c, m[i].w[0], m[i].stride * (size_t)m[i].n_mat);
            m[i].w[1] = c;
        }
    uint64_t *probe = aligned_alloc(64, PROBE_BYTES);
    float *x = malloc(n_max * sizeof(float)), *y = malloc(rows_max * sizeof(float));
    uint8_t *a = malloc(n_max * 4 + 64);
    if (!probe || !x || !y || !a) {
        fprintf(stderr, "bench_stream: out of memory\n");
        return 1;
    }
    memset(probe, 1, PROBE_BYTES);
    for (size_t i = 0; i < n_max; i++) x[i] = (float)((i * 2654435761u) % 1000) / 1000.f - 0.5f;
    printf("%s %s, %s kernels, %.1f MB of weights a pass%s\n", argv[1], argv[2], kv_quant_backend(),
           (experts ? (double)total * N_USED / (double)m[0].n_mat : (double)total) / 1e6,
           m[0].w[1] ? "" : " (no copy: too large)");
    /* untimed: fault the mapping in and read the file into the page cache */
    for (int64_t i = 0; i < nm; i++) {
        const uint8_t *w = m[i].w[0];
        for (size_t o = 0; o < m[i].stride * (size_t)m[i].n_mat; o += 4096) bs_sink += w[o];
    }
    srand(7);
    for (int r = 0; r < rounds; r++) {
        const double pb = bs_probe(probe, PROBE_BYTES / 8);
        double gbs[2] = {0, 0};
        for (int src = 0; src < 2 && m[0].w[src]; src++) {
            size_t bytes = 0;
            const double t0 = bs_now();
            for (int64_t i = 0; i < nm; i++) {
                const kv_type_info *ti = kv_type_get(m[i].type), *ta = kv_type_get(ti->vec_dot_type);
                ta->from_float(x, a, m[i].n);
                const int64_t calls = experts ? N_USED : 1;
                for (int64_t c = 0; c < calls; c++) {
                    const int64_t e = experts ? rand() % m[i].n_mat : 0;
                    const int64_t rows = experts ? m[i].rows : m[i].rows * m[i].n_mat;
                    kv_mat_rows(m[i].type, m[i].w[src] + (size_t)e * m[i].stride, m[i].rb, m[i].n, 0, rows, a, 0, 1,
                                y, (size_t)rows);
                    bytes += m[i].rb * (size_t)rows;
                }
            }
            gbs[src] = (double)bytes / (bs_now() - t0) / 1e9;
        }
        printf("round %d: probe %.2f GB/s; file mapping %.2f GB/s (%.0f%%)", r + 1, pb, gbs[0], 100 * gbs[0] / pb);
        if (m[0].w[1]) printf("; anonymous copy %.2f GB/s (%.0f%%)", gbs[1], 100 * gbs[1] / pb);
        printf("\n");
    }
    for (int64_t i = 0; i < nm; i++) free((void *)m[i].w[1]);
    free(probe);
    free(x);
    free(y);
    free(a);
    kv_gguf_close(g);
    return 0;
}
