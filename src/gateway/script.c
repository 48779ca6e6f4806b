/* TEST ONLY: scripted outputs. With the environment variable
 * KVASIR_GATEWAY_TEST_SCRIPT naming a file, a gateway over an engine
 * answers each chat or completion request with one of the file's texts
 * instead of the model's sampled tokens: the texts are separated by the
 * byte 0x1E (ASCII record separator), each is tokenized as the model's
 * output would be (special token texts as their ids), and the requests take
 * them in turn (the first request the first text, and round again). The
 * engine still runs every step for the request (its sampled token is
 * discarded and the scripted one published in its place), so queueing,
 * streaming, stop strings, max_tokens and the API shapes are the real ones;
 * only the tokens are chosen. This exists so the end-to-end tests of tool
 * calling and reasoning can drive official clients through a model with
 * random weights (tests/test_gateway_tools.sh); it is said on stderr at
 * start, and never set in production. Bounded: KV_GW_SCRIPT_MAX texts,
 * KV_GW_SCRIPT_MAX_BYTES bytes in all. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/server_internal.h"

int kv_gw_script_load(kv_gateway *g, kv_diag *d) {
    const char *path = getenv("KVASIR_GATEWAY_TEST_SCRIPT");
    if (!path || !*path) return 0;
    if (!g->e) return kv_fail(d, KV_EINVAL, "gateway: KVASIR_GATEWAY_TEST_SCRIPT needs an engine (not a ring)");
    FILE *f = fopen(path, "rb");
    if (!f) return kv_fail(d, KV_EIO, "gateway: KVASIR_GATEWAY_TEST_SCRIPT: cannot open '%.200s'", path);
    char *b = malloc(KV_GW_SCRIPT_MAX_BYTES + 1);
    size_t n = b ? fread(b, 1, KV_GW_SCRIPT_MAX_BYTES + 1, f) : 0;
    fclose(f);
    if (!b) return kv_fail(d, KV_ENOMEM, "gateway: out of memory");
    if (n > KV_GW_SCRIPT_MAX_BYTES) {
        free(b);
        return kv_fail(d, KV_ERANGE, "gateway: KVASIR_GATEWAY_TEST_SCRIPT '%.200s' is over %u bytes", path,
                       KV_GW_SCRIPT_MAX_BYTES);
    }
    int rc = 0;
    for (size_t at = 0; at <= n && !rc;) {
        const char *e = memchr(b + at, 0x1e, n - at);
        const size_t len = e ? (size_t)(e - (b + at)) : n - at;
        if (g->n_script == KV_GW_SCRIPT_MAX) {
            rc = kv_fail(d, KV_ERANGE, "gateway: KVASIR_GATEWAY_TEST_SCRIPT has over %u texts", KV_GW_SCRIPT_MAX);
            break;
        }
        kv_gw_script *s = &g->script[g->n_script];
        const size_t cap = 3 * len + 8;
        if (!(s->toks = malloc(cap * sizeof *s->toks))) {
            rc = kv_fail(d, KV_ENOMEM, "gateway: out of memory");
            break;
        }
        size_t nt = 0;
        rc = kv_tok_encode(g->tok, b + at, len, true, s->toks, cap, &nt, d);
        s->n = (uint32_t)nt;
        g->n_script++;
        at += len + 1;
    }
    free(b);
    if (!rc)
        fprintf(stderr, "gateway: TEST ONLY: answers are the %u scripted texts of %s (KVASIR_GATEWAY_TEST_SCRIPT), "
                "not the model's\n", g->n_script, path);
    return rc;
}

void kv_gw_script_free(kv_gateway *g) {
    for (uint32_t i = 0; i < g->n_script; i++) free(g->script[i].toks);
    g->n_script = 0;
}
