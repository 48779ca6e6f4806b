/* Cost of grammar-constrained sampling per generated token (not a test):
 *   build/bench_grammar [--model F.gguf] [--tokens N] [--seeds N]
 *
 * For a few JSON schemas, generates constrained samples the way a server
 * would (random logits, kv_grammar_apply, greedy pick of the best allowed
 * token after a random draw, kv_grammar_accept) and times the mask and the
 * accept of every token: mean, the slowest single token, and how often the
 * mask came from the state cache. Times are the thread's CPU time. Vocabularies: the tokenizer of --model
 * when given; else the 151,936-token vocabulary that `gen-model --preset
 * qwen3-30b-a3b-bench` writes (the bench models' own, mostly padding past
 * what the bundled corpus teaches), and a dense one of as many distinct
 * pieces (corpus substrings of 1-12 bytes, with and without a leading
 * space) whose trie is as bushy as a real 150k vocabulary's.
 * docs/BENCHMARKS.md ("Grammar-constrained sampling") holds the figures. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/gen.h"
#include "kvasir/grammar.h"
#include "kvasir/tok.h"

#define N_VOCAB 151936

/* The thread's CPU time: on a shared machine, wall time would charge the
 * mask with whatever preempted it. */
static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int tok_from_gguf(const char *path, kv_tok **t, kv_diag *d) {
    kv_gguf *g = NULL;
    int rc = kv_gguf_open(&g, path, d);
    if (!rc) rc = kv_tok_load(t, g, d);
    kv_gguf_close(g);
    return rc;
}

/* The bench models' tokenizer: trained as gen-model trains it. */
static int bench_tok(kv_tok **t, kv_diag *d) {
    kv_bpe_vocab v;
    size_t clen;
    const char *corpus = kv_bpe_default_corpus(&clen);
    int rc = kv_bpe_train(corpus, clen, "qwen2", N_VOCAB, &v, d);
    if (rc) return rc;
    char path[] = "/tmp/kv_bench_grammar_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) {
        kv_bpe_vocab_free(&v);
        return kv_fail(d, KV_EIO, "mkstemp");
    }
    close(fd);
    kv_gguf_writer *w = NULL;
    rc = kv_gguf_writer_new(&w, d);
    if (!rc) rc = kv_gguf_writer_set_str(w, "general.architecture", "qwen3moe", d);
    if (!rc) rc = kv_gen_write_tokenizer(w, &v, "qwen2", d);
    if (!rc) rc = kv_gguf_writer_begin(w, path, d);
    if (!rc) rc = kv_gguf_writer_finish(w, d);
    kv_gguf_writer_free(w);
    kv_bpe_vocab_free(&v);
    if (!rc) rc = tok_from_gguf(path, t, d);
    unlink(path);
    return rc;
}

static uint64_t fnv(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
    return h;
}

/* A dense vocabulary: the 256 bytes, then distinct corpus substrings. */
static int dense_vocab(kv_grammar_vocab **out, int32_t *eos, kv_diag *d) {
    size_t clen;
    const char *corpus = kv_bpe_default_corpus(&clen);
    char **p = calloc(N_VOCAB, sizeof *p);
    uint32_t *len = calloc(N_VOCAB, sizeof *len);
    bool *eog = calloc(N_VOCAB, sizeof *eog);
    size_t hcap = 1 << 19;
    uint64_t *seen = calloc(hcap, sizeof *seen);
    char *bytes = malloc(256);
    if (!p || !len || !eog || !seen || !bytes) return kv_fail(d, KV_ENOMEM, "oom");
    int32_t n = 0;
    for (int b = 0; b < 256; b++) {
        bytes[b] = (char)b;
        p[n] = bytes + b;
        len[n++] = 1;
    }
    for (int pass = 0; pass < 2 && n < N_VOCAB - 1; pass++) {
        for (size_t i = 0; i + 1 < clen && n < N_VOCAB - 1; i++) {
            bool word_start = i == 0 || corpus[i - 1] == ' ' || corpus[i - 1] == '\n';
            if (pass == 0 && !word_start) continue;
            size_t from = (pass == 0 && i > 0 && corpus[i - 1] == ' ') ? i - 1 : i;
            for (size_t l = 2; l <= 12 && from + l <= clen && n < N_VOCAB - 1; l++) {
                uint64_t h = fnv(corpus + from, l);
                size_t k = h & (hcap - 1);
                bool dup = false;
                while (seen[k]) {
                    if (seen[k] == h) {
                        dup = true;
                        break;
                    }
                    k = (k + 1) & (hcap - 1);
                }
                if (dup) continue;
                seen[k] = h;
                p[n] = (char *)corpus + from;
                len[n++] = (uint32_t)l;
            }
        }
    }
    /* the rest, if the corpus ran out: numbered pieces */
    static char num[N_VOCAB][8];
    while (n < N_VOCAB - 1) {
        int k = snprintf(num[n], sizeof num[n], "%d", n);
        p[n] = num[n];
        len[n++] = (uint32_t)k;
    }
    eog[n] = true; /* the last: an end-of-generation token with no piece */
    p[n] = "";
    len[n++] = 0;
    *eos = n - 1;
    int rc = kv_grammar_vocab_new(out, (const char *const *)p, len, eog, n, d);
    free(p);
    free(len);
    free(eog);
    free(seen);
    /* bytes stays: the vocabulary copied it, but keep it simple */
    free(bytes);
    return rc;
}

static const struct {
    const char *name, *schema;
} k_schemas[] = {
    {"json_object", "{\"type\": \"object\"}"},
    {"tool_call",
     "{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\", \"maxLength\": 40}, \"unit\": {\"enum\":"
     " [\"celsius\", \"fahrenheit\"]}, \"days\": {\"type\": \"integer\", \"minimum\": 1, \"maximum\": 14}, \"tags\":"
     " {\"type\": \"array\", \"items\": {\"type\": \"string\"}, \"maxItems\": 4}}, \"required\": [\"city\", \"unit\"],"
     " \"additionalProperties\": false}"},
    {"person",
     "{\"type\": \"object\", \"properties\": {\"name\": {\"type\": \"string\"}, \"age\": {\"type\": \"integer\"},"
     " \"email\": {\"type\": [\"string\", \"null\"]}, \"scores\": {\"type\": \"array\", \"items\": {\"type\": \"number\"}}},"
     " \"required\": [\"name\", \"age\", \"email\", \"scores\"]}"},
};

static void run(const char *vname, const kv_grammar_vocab *v, int tokens, int seeds) {
    int32_t nv = kv_grammar_vocab_n(v);
    float *logits = malloc((size_t)nv * sizeof *logits);
    for (size_t s = 0; s < sizeof k_schemas / sizeof k_schemas[0]; s++) {
        kv_grammar *g = NULL;
        kv_diag d = {0};
        if (kv_grammar_from_schema(&g, k_schemas[s].schema, strlen(k_schemas[s].schema), NULL, &d)) {
            fprintf(stderr, "%s: %s\n", k_schemas[s].name, d.msg);
            exit(1);
        }
        double t_mask = 0, t_acc = 0, worst = 0, t_miss = 0;
        long n_miss = 0;
        long n_tok = 0, hits = 0, masks = 0, ended = 0;
        double nodes = 0;
        for (int seed = 0; seed < seeds; seed++) {
            kv_grammar_matcher *m = NULL;
            if (kv_grammar_matcher_new(&m, g, &d)) exit(1);
            uint64_t x = (uint64_t)seed * 0x9E3779B97F4A7C15ull + 7;
            for (int step = 0; step < tokens; step++) {
                for (int32_t t = 0; t < nv; t++) {
                    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                    logits[t] = (float)((x >> 40) & 0xffff) / 4096.0f;
                }
                kv_grammar_stats before;
                kv_grammar_get_stats(m, &before);
                double t0 = now_ms();
                if (kv_grammar_apply(m, v, logits, &d)) {
                    fprintf(stderr, "apply: %s\n", d.msg);
                    exit(1);
                }
                double t1 = now_ms();
                kv_grammar_stats after;
                kv_grammar_get_stats(m, &after);
                if (after.mask_hits == before.mask_hits) t_miss += t1 - t0, n_miss++;
                int32_t best = -1;
                for (int32_t t = 0; t < nv; t++)
                    if (logits[t] > -1e30f && (best < 0 || logits[t] > logits[best])) best = t;
                double t2 = now_ms();
                if (best < 0 || kv_grammar_accept(m, v, best, &d)) {
                    fprintf(stderr, "accept: %s\n", d.msg);
                    exit(1);
                }
                double t3 = now_ms();
                t_mask += t1 - t0;
                t_acc += t3 - t2;
                if (t1 - t0 + t3 - t2 > worst) worst = t1 - t0 + t3 - t2;
                n_tok++;
                if (best == nv - 1 || kv_grammar_can_end(m)) {
                    /* a finished value: count it and start the next (no eog forcing) */
                    if (kv_grammar_can_end(m)) ended++;
                    break;
                }
            }
            kv_grammar_stats st;
            kv_grammar_get_stats(m, &st);
            hits += (long)st.mask_hits;
            masks += (long)st.masks;
            nodes += (double)st.trie_nodes;
            kv_grammar_matcher_free(m);
        }
        printf("%-8s %-12s tokens %6ld  mask %.3f ms  accept %.4f ms  per token %.3f ms  slowest %.2f ms  "
               "cache hits %.0f%%  uncached mask %.3f ms  trie nodes per walk %.0f  values ended %ld/%d\n",
               vname, k_schemas[s].name, n_tok, t_mask / n_tok, t_acc / n_tok, (t_mask + t_acc) / n_tok, worst,
               100.0 * hits / (masks ? masks : 1), n_miss ? t_miss / n_miss : 0.0, nodes / (masks - hits ? masks - hits : 1), ended, seeds);
        kv_grammar_free(g);
    }
    free(logits);
}

int main(int argc, char **argv) {
    const char *model = NULL;
    int tokens = 256, seeds = 8;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--model") && i + 1 < argc) model = argv[++i];
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) tokens = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seeds") && i + 1 < argc) seeds = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_grammar [--model F.gguf] [--tokens N (256)] [--seeds N (8)]\n");
            return 2;
        }
    }
    if (tokens < 1 || tokens > 100000 || seeds < 1 || seeds > 10000) {
        fprintf(stderr, "bench_grammar: --tokens 1..100000, --seeds 1..10000\n");
        return 2;
    }
    kv_diag d = {0};
    kv_tok *t = NULL;
    kv_grammar_vocab *v = NULL;
    double t0 = now_ms();
    if ((model ? tok_from_gguf(model, &t, &d) : bench_tok(&t, &d)) || kv_grammar_vocab_from_tok(&v, t, &d)) {
        fprintf(stderr, "bench_grammar: %s\n", d.msg);
        return 1;
    }
    printf("vocabulary %s: %d tokens, built in %.0f ms (trie included)\n", model ? model : "gen-model bench (trained)",
           kv_tok_n_vocab(t), now_ms() - t0);
    run("bench", v, tokens, seeds);
    kv_grammar_vocab_free(v);
    kv_tok_free(t);
    if (!model) {
        int32_t eos;
        t0 = now_ms();
        if (dense_vocab(&v, &eos, &d)) {
            fprintf(stderr, "bench_grammar: %s\n", d.msg);
            return 1;
        }
        printf("vocabulary dense: %d distinct pieces, built in %.0f ms\n", kv_grammar_vocab_n(v), now_ms() - t0);
        run("dense", v, tokens, seeds);
        kv_grammar_vocab_free(v);
    }
    return 0;
}
