/* Micro-benchmark of the matrix kernel (not a test): for each compute type
 * and backend, decode-shaped (1 token, a weight matrix larger than the
 * caches: memory bound), prefill-shaped (64 tokens: compute bound) and
 * expert-shaped (8 tokens: what one routed expert gets in a 128-token MoE
 * prefill) calls of kv_mat_rows, single-threaded. Prints GB/s of weights
 * read and G multiply-adds/s. Times are the process's CPU time, so that a
 * machine shared with other work disturbs them less than wall time would.
 * Usage: bench_quant [type ...]; KV_BENCH_NO_SCALAR=1 skips the scalar rows;
 * KV_BENCH_BACKENDS=avx2,avx512 names the backends (default: every x86 one
 * this CPU runs); KV_BENCH_DEC_ROWS=N sets the decode matrix's rows (default
 * 8192: 5-9 MB at n = 2048, which a large L3 holds; 131072 reads 70-280 MB
 * from memory, as a model's LM head or expert set does). */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvasir/quant.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const char *types[] = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_K", "q5_K", "q6_K"};
    const char *bes[] = {"scalar", "avx2", "avxvnni", "avx512"};
    const char *only = getenv("KV_BENCH_BACKENDS");
    const char *dr = getenv("KV_BENCH_DEC_ROWS");
    const int64_t n = 2048, rows_pf = 768, ntok = 64;
    const int64_t rows_dec = dr && atol(dr) >= 256 && atol(dr) <= (1 << 20) ? atol(dr) : 8192;
    if (dr && rows_dec != atol(dr)) {
        fprintf(stderr, "KV_BENCH_DEC_ROWS: want 256 .. 1048576 rows, got '%s'\n", dr);
        return 2;
    }
    int nt = argc > 1 ? argc - 1 : 8;
    float *x = malloc(sizeof(float) * n * ntok);
    for (int64_t i = 0; i < n * ntok; i++) x[i] = (float)((i * 2654435761u) % 1000) / 1000.f - 0.5f;
    printf("%-6s %-7s %12s %14s %14s %14s %14s\n", "type", "backend", "decode GB/s", "decode GMAC/s",
           "dec-L2 GMAC/s", "prefill GMAC/s", "expert8 GMAC/s");
    for (int ti = 0; ti < nt; ti++) {
        int type = kv_type_from_name(argc > 1 ? argv[1 + ti] : types[ti]);
        if (type < 0) continue;
        for (int b = 0; b < 4; b++) {
            if (b == 0 && getenv("KV_BENCH_NO_SCALAR")) continue; /* the slow one */
            if (only && !strstr(only, bes[b])) continue;
            if (kv_quant_set_backend(bes[b])) continue;
            const kv_type_info *t = kv_type_get((uint32_t)type), *ta = kv_type_get(t->vec_dot_type);
            size_t rb = kv_type_row_size((uint32_t)type, n), ab = kv_type_row_size(t->vec_dot_type, n);
            uint8_t *W = malloc(rb * rows_dec), *A = malloc(ab * ntok);
            float *Y = malloc(sizeof(float) * rows_dec * ntok);
            for (int64_t r = 0; r < rows_dec; r++) /* row r is row r % ntok: quantized once */
                if (r < ntok) t->from_float(x + r * n, W + r * rb, n);
                else memcpy(W + r * rb, W + (r % ntok) * rb, rb);
            for (int64_t k = 0; k < ntok; k++) ta->from_float(x + k * n, A + k * ab, n);
            int reps = b == 0 ? 1 : 5;
            double t0 = now();
            for (int rep = 0; rep < reps; rep++) kv_mat_rows((uint32_t)type, W, rb, n, 0, rows_dec, A, ab, 1, Y, rows_dec);
            double td = (now() - t0) / reps;
            int reps3 = b == 0 ? 2 : 200;
            t0 = now();
            for (int rep = 0; rep < reps3; rep++) kv_mat_rows((uint32_t)type, W, rb, n, 0, 256, A, ab, 1, Y, 256);
            double th = (now() - t0) / reps3;
            int reps2 = b == 0 ? 1 : 5;
            t0 = now();
            for (int rep = 0; rep < reps2; rep++) kv_mat_rows((uint32_t)type, W, rb, n, 0, rows_pf, A, ab, ntok, Y, rows_pf);
            double tp = (now() - t0) / reps2;
            int reps4 = b == 0 ? 1 : 40;
            t0 = now();
            for (int rep = 0; rep < reps4; rep++) kv_mat_rows((uint32_t)type, W, rb, n, 0, rows_pf, A, ab, 8, Y, rows_pf);
            double te = (now() - t0) / reps4;
            printf("%-6s %-7s %12.2f %14.2f %14.2f %14.2f %14.2f\n", t->name, bes[b], rb * rows_dec / td / 1e9,
                   n * rows_dec / td / 1e9, n * 256 / th / 1e9, (double)n * rows_pf * ntok / tp / 1e9,
                   (double)n * rows_pf * 8 / te / 1e9);
            free(W); free(A); free(Y);
        }
    }
    free(x);
    return 0;
}
