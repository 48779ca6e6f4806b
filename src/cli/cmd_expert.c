/* kvasir expert: one routed expert's FFN, from a slab or a full model. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli/cli.h"
#include "kvasir/slice.h"

#define CMD "expert"
#define KV_EXPERT_MAX_TOKENS 65536u /* rows of X accepted */

static const char *const kv_value_flags[] = {"-m", "--model", "--layer", "--expert", "--in", "--out", "--threads", "-t", NULL};

static const char *kv_expert_help =
    "usage: kvasir expert -m SLAB_OR_MODEL.gguf --layer L --expert E --in X.f32 --out Y.f32\n"
    "  -m F          a slab (kvasir slice) or a full model file\n"
    "  --layer L     block index\n"
    "  --expert E    expert id within the layer (global id, also for a slab)\n"
    "  --in X.f32    hidden states: n_tokens x n_embd little-endian f32 (n_tokens from the size,\n"
    "                at most 65536)\n"
    "  --out Y.f32   output: n_tokens x n_embd f32, down(silu(gate x) * up x)\n"
    "  --threads N   threads (default: all CPUs; same bits for any N)\n";

int kv_cmd_expert(int argc, char **argv) {
    const char *model = NULL, *in = NULL, *outp = NULL;
    long layer = -1, expert = -1, threads = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_expert_help, stdout);
            return 0;
        } else if (!(v = kv_arg_value(CMD, argc, argv, &i, kv_value_flags))) {
            return 1;
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            model = v;
        } else if (!strcmp(a, "--layer")) {
            if (kv_arg_long(CMD, a, v, 0, KV_MAX_LAYERS - 1, &layer)) return 1;
        } else if (!strcmp(a, "--expert")) {
            if (kv_arg_long(CMD, a, v, 0, KV_MAX_EXPERTS - 1, &expert)) return 1;
        } else if (!strcmp(a, "--in")) {
            in = v;
        } else if (!strcmp(a, "--out")) {
            outp = v;
        } else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) {
            if (kv_arg_long(CMD, a, v, 1, KV_POOL_MAX_THREADS, &threads)) return 1;
        } else {
            return kv_cli_err(CMD, 1, "unknown option '%s' (see kvasir expert --help)", a);
        }
    }
    if (!model || !in || !outp || layer < 0 || expert < 0)
        return kv_cli_err(CMD, 1, "needs -m, --layer, --expert, --in and --out (see kvasir expert --help)");
    int rc = 2;
    kv_diag d = {0};
    kv_gguf *g = NULL;
    kv_pool *pool = NULL;
    float *x = NULL, *y = NULL;
    FILE *f = NULL;
    kv_expert_weights w;
    uint32_t E, F;
    if (kv_gguf_open(&g, model, &d) || kv_expert_find(g, (uint32_t)layer, (uint32_t)expert, &w, &E, &F, &d)) {
        rc = kv_cli_diag(CMD, &d);
        goto done;
    }
    struct stat st;
    const size_t row = (size_t)E * sizeof(float);
    if (!(f = fopen(in, "rb")) || fstat(fileno(f), &st)) {
        rc = kv_cli_err(CMD, 2, "cannot open '%s'", in);
        goto done;
    }
    if (st.st_size <= 0 || (size_t)st.st_size % row || (size_t)st.st_size / row > KV_EXPERT_MAX_TOKENS) {
        rc = kv_cli_err(CMD, 2, "'%s' has %lld bytes; want a positive multiple of n_embd x 4 = %zu, at most %u rows", in,
                        (long long)st.st_size, row, KV_EXPERT_MAX_TOKENS);
        goto done;
    }
    const uint32_t n = (uint32_t)((size_t)st.st_size / row);
    x = malloc((size_t)n * row);
    y = malloc((size_t)n * row);
    if (!x || !y) {
        rc = kv_cli_err(CMD, 2, "out of memory");
        goto done;
    }
    if (fread(x, row, n, f) != n) {
        rc = kv_cli_err(CMD, 2, "short read on '%s'", in);
        goto done;
    }
    fclose(f);
    f = NULL;
    /* inputs are little-endian on disk; this build targets little-endian hosts */
    _Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "kvasir expert assumes a little-endian host");
    for (size_t i = 0; i < (size_t)n * E; i++)
        if (!(x[i] - x[i] == 0.0f)) {
            rc = kv_cli_err(CMD, 2, "'%s': value %zu (token %zu) is not finite", in, i, i / E);
            goto done;
        }
    if (kv_pool_new(&pool, (int)threads, &d) || kv_expert_compute_one(&w, E, F, pool, x, n, y, &d)) {
        rc = kv_cli_diag(CMD, &d);
        goto done;
    }
    if (!(f = fopen(outp, "wb")) || fwrite(y, row, n, f) != n) {
        rc = kv_cli_err(CMD, 2, "cannot write '%s'", outp);
        goto done;
    }
    if (fclose(f)) {
        f = NULL;
        rc = kv_cli_err(CMD, 2, "cannot write '%s'", outp);
        goto done;
    }
    f = NULL;
    fprintf(stderr, "kvasir expert: layer %ld expert %ld: %u tokens x %u -> %u -> %u\n", layer, expert, n, E, F, E);
    rc = 0;
done:
    if (f) fclose(f);
    free(x);
    free(y);
    kv_pool_free(pool);
    kv_gguf_close(g);
    return rc;
}
