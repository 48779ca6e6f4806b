/* Time to first token with the prompt cache (not a test): two requests
 * through one engine that share a prefix of `prefix` tokens, each followed
 * by `suffix` tokens of its own. The first finds nothing cached and
 * evaluates its whole prompt; the second copies the cached whole blocks of
 * the shared prefix into its state and evaluates the rest. Prints both
 * times to the first token (wall time from kv_session_prompt to the step
 * that emitted it), their ratio, the tokens reused, and whether the second
 * request's first-token logits equal, bit for bit, those of the same
 * request on an engine without a cache (timed too: the cold cost of the
 * second prompt).
 * Usage: bench_pcache MODEL.gguf [prefix suffix threads block]; defaults
 * 6000 64 0 (all CPUs) 64. docs/BENCHMARKS.md, "Prompt cache". */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvasir/engine.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* One request: its time to the first token; its logits copied to lg. */
static double ttft(kv_engine *e, const int32_t *p, uint32_t n, float *lg, uint32_t V, uint32_t *cached) {
    kv_diag d = {0};
    kv_session *s = NULL;
    kv_session_opts o = {.sample = kv_sample_defaults(), .max_tokens = 1};
    o.sample.temp = 0.0f;
    const double t0 = now();
    if (kv_session_new(&s, e, &o, &d) || kv_session_prompt(s, p, n, &d)) {
        fprintf(stderr, "bench_pcache: %s\n", d.msg);
        exit(1);
    }
    while (kv_session_token(s) < 0) {
        if (kv_engine_step(e, &d) < 0 || kv_session_status(s) == KV_SESSION_FAILED) {
            kv_session_error(s, &d);
            fprintf(stderr, "bench_pcache: %s\n", d.msg);
            exit(1);
        }
    }
    const double t = now() - t0;
    memcpy(lg, kv_session_logits(s), V * sizeof(float));
    kv_session_stats st;
    kv_session_get_stats(s, &st);
    *cached = st.n_cached;
    kv_session_free(s);
    return t;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_pcache MODEL.gguf [prefix suffix threads block]\n");
        return 2;
    }
    const uint32_t prefix = argc > 2 ? (uint32_t)atoi(argv[2]) : 6000, suffix = argc > 3 ? (uint32_t)atoi(argv[3]) : 64;
    const int threads = argc > 4 ? atoi(argv[4]) : 0;
    const uint32_t block = argc > 5 ? (uint32_t)atoi(argv[5]) : 64;
    if (prefix < 1 || suffix < 1 || prefix > 100000 || suffix > 100000) {
        fprintf(stderr, "bench_pcache: prefix and suffix are 1..100000 tokens\n");
        return 2;
    }
    const uint32_t n = prefix + suffix;
    kv_diag d = {0};
    kv_engine *e = NULL, *ref = NULL;
    kv_engine_opts o = {.n_threads = threads, .n_ctx = n + 16, .n_batch = 256, .max_sessions = 2,
                        .prompt_cache_bytes = (uint64_t)8 << 30, .prompt_cache_block = block};
    if (kv_engine_open(&e, argv[1], &o, &d)) {
        fprintf(stderr, "bench_pcache: %s\n", d.msg);
        return 1;
    }
    o.prompt_cache_bytes = 0;
    if (kv_engine_open(&ref, argv[1], &o, &d)) {
        fprintf(stderr, "bench_pcache: %s\n", d.msg);
        return 1;
    }
    const kv_hparams *hp = kv_model_hparams(kv_engine_model(e));
    const uint32_t V = hp->n_vocab;
    int32_t *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b);
    float *la = malloc(V * sizeof(float)), *lb = malloc(V * sizeof(float)), *lr = malloc(V * sizeof(float));
    if (!a || !b || !la || !lb || !lr) return 1;
    uint64_t x = 12345;
    for (uint32_t i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        a[i] = b[i] = (int32_t)(3 + (x >> 33) % (V - 3));
    }
    for (uint32_t i = prefix; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        b[i] = (int32_t)(3 + (x >> 33) % (V - 3));
    }
    uint32_t ca, cb, cr;
    const double t_first = ttft(e, a, n, la, V, &ca);
    const double t_second = ttft(e, b, n, lb, V, &cb);
    const double t_ref = ttft(ref, b, n, lr, V, &cr);
    kv_engine_stats es;
    kv_engine_get_stats(e, &es);
    const bool same = !memcmp(lb, lr, V * sizeof(float));
    printf("model %s (%s, %u layers), %d threads, prompt %u = shared prefix %u + %u own tokens, cache blocks of %u\n",
           argv[1], hp->arch == KV_ARCH_QWEN35MOE ? "qwen35moe" : "qwen3moe", hp->n_layer, kv_engine_n_threads(e), n,
           prefix, suffix, block);
    printf("first request (cold):   time to first token %8.3f s (%u tokens reused)\n", t_first, ca);
    printf("second request (warm):  time to first token %8.3f s (%u tokens reused)\n", t_second, cb);
    printf("second request, no cache (reference): %8.3f s\n", t_ref);
    printf("ratio cold / warm: %.1fx; cache holds %u blocks, %.1f MiB\n", t_first / t_second, es.cache_blocks,
           es.cache_bytes / 1048576.0);
    printf("second request's first-token logits equal the uncached engine's: %s\n", same ? "yes (bit for bit)" : "NO");
    free(a);
    free(b);
    free(la);
    free(lb);
    free(lr);
    kv_engine_free(e);
    kv_engine_free(ref);
    return same ? 0 : 1;
}
