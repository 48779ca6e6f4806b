/* Draft sources for speculative decoding (spec.h). A source only guesses:
 * the engine keeps a drafted token only when it equals the token plain
 * decoding draws at that position, so nothing here can change an output.
 * Every size is bounded (KV_DRAFT_MAX, KV_NGRAM_WINDOW, KV_DRAFT_TEST_MAX)
 * and the test source's file is checked token by token. */
#include "engine/spec.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


struct kv_draft {
    enum kv_draft_kind kind;
    uint32_t n_vocab;
    /* test */
    int32_t *rec;       /* [n_rec] the recorded continuation */
    uint32_t n_rec;
    double p;           /* chance of proposing the recorded token */
    uint64_t seed;
    /* mtp */
    kv_mtp *mtp;
    float *h[2];        /* [n_embd] chain hidden states */
    float *logits;      /* [n_vocab] */
};

const char *kv_draft_kind_name(enum kv_draft_kind k) {
    static const char *const n[] = {"none", "ngram", "mtp", "test"};
    return (unsigned)k < KV_DRAFT_KIND_COUNT ? n[k] : "?";
}

enum kv_draft_kind kv_draft_kind(const kv_draft *dr) { return dr ? dr->kind : KV_DRAFT_NONE; }

/* Reads a recorded continuation: decimal token ids separated by spaces,
 * commas, newlines or brackets (a JSON array too), each in the vocabulary. */
static int kv_draft_read_test(kv_draft *dr, const char *path, kv_diag *d) {
    FILE *f = fopen(path, "r");
    if (!f) return kv_fail(d, KV_EIO, "draft test: cannot open '%s': %s", path, strerror(errno));
    uint32_t cap = 256;
    int rc = 0;
    if (!(dr->rec = malloc(cap * sizeof *dr->rec))) {
        fclose(f);
        return kv_fail(d, KV_ENOMEM, "draft test: out of memory");
    }
    int c;
    long long v = -1;
    for (;;) {
        c = fgetc(f);
        if (c >= '0' && c <= '9') {
            v = (v < 0 ? 0 : v) * 10 + (c - '0');
            if (v >= (long long)dr->n_vocab) {
                rc = kv_fail(d, KV_EFORMAT, "draft test: '%s': token %u is outside the vocabulary (%u)", path,
                             dr->n_rec, dr->n_vocab);
                break;
            }
            continue;
        }
        if (v >= 0) {
            if (dr->n_rec == KV_DRAFT_TEST_MAX) {
                rc = kv_fail(d, KV_EFORMAT, "draft test: '%s' holds more than %u tokens", path, KV_DRAFT_TEST_MAX);
                break;
            }
            if (dr->n_rec == cap) {
                int32_t *n = realloc(dr->rec, (size_t)cap * 2 * sizeof *n);
                if (!n) {
                    rc = kv_fail(d, KV_ENOMEM, "draft test: out of memory");
                    break;
                }
                dr->rec = n;
                cap *= 2;
            }
            dr->rec[dr->n_rec++] = (int32_t)v;
            v = -1;
        }
        if (c == EOF) break;
        if (!(c == ' ' || c == ',' || c == '\n' || c == '\r' || c == '\t' || c == '[' || c == ']')) {
            rc = kv_fail(d, KV_EFORMAT, "draft test: '%s': unexpected byte 0x%02x after %u tokens (token ids separated "
                         "by spaces or commas)", path, (unsigned)c, dr->n_rec);
            break;
        }
    }
    fclose(f);
    if (!rc && dr->n_rec == 0) rc = kv_fail(d, KV_EFORMAT, "draft test: '%s' holds no token", path);
    return rc;
}

/* "FILE:P[:SEED]" of the test source. */
static int kv_draft_parse_test(kv_draft *dr, const char *arg, kv_diag *d) {
    char buf[4096];
    if (strlen(arg) >= sizeof buf) return kv_fail(d, KV_EINVAL, "draft test: argument longer than %zu bytes", sizeof buf);
    strcpy(buf, arg);
    char *colon = strrchr(buf, ':');
    if (!colon) return kv_fail(d, KV_EINVAL, "draft test: '%s' is not FILE:P[:SEED]", arg);
    /* FILE:P:SEED when the last two fields are numbers, else FILE:P */
    char *end;
    char *c2 = NULL;
    *colon = 0;
    char *prev = strrchr(buf, ':');
    if (prev) {
        strtod(prev + 1, &end);
        if (*end == 0 && end != prev + 1) c2 = prev;
    }
    if (c2) {
        errno = 0;
        const unsigned long long sd = strtoull(colon + 1, &end, 10);
        if (*end || end == colon + 1 || errno)
            return kv_fail(d, KV_EINVAL, "draft test: seed '%s' is not a number", colon + 1);
        dr->seed = sd;
        *c2 = 0;
        colon = c2;
    }
    const double p = strtod(colon + 1, &end);
    if (*end || end == colon + 1 || !(p >= 0.0 && p <= 1.0))
        return kv_fail(d, KV_EINVAL, "draft test: acceptance '%s' is not a number in [0, 1]", colon + 1);
    dr->p = p;
    if (!buf[0]) return kv_fail(d, KV_EINVAL, "draft test: no file in '%s'", arg);
    return kv_draft_read_test(dr, buf, d);
}

int kv_draft_test_load(const char *arg, uint32_t n_vocab, int32_t **rec, uint32_t *n_rec, double *p, uint64_t *seed,
                       kv_diag *d) {
    kv_draft dr = {.kind = KV_DRAFT_TEST, .n_vocab = n_vocab};
    const int rc = kv_draft_parse_test(&dr, arg, d);
    if (rc) {
        free(dr.rec);
        return rc;
    }
    *rec = dr.rec;
    *n_rec = dr.n_rec;
    *p = dr.p;
    *seed = dr.seed;
    return 0;
}

int kv_draft_open(kv_draft **out, const char *spec, const kv_model *m, const kv_expert_provider *experts, kv_pool *pool,
                  uint32_t n_seq, kv_diag *d) {
    *out = NULL;
    if (!spec || !strcmp(spec, "none") || !spec[0]) return 0;
    kv_draft *dr = calloc(1, sizeof *dr);
    if (!dr) return kv_fail(d, KV_ENOMEM, "draft: out of memory");
    dr->n_vocab = kv_model_hparams(m)->n_vocab;
    int rc = 0;
    if (!strcmp(spec, "ngram")) {
        dr->kind = KV_DRAFT_NGRAM;
    } else if (!strcmp(spec, "mtp")) {
        dr->kind = KV_DRAFT_MTP;
        const uint32_t E = kv_model_hparams(m)->n_embd;
        dr->h[0] = malloc(E * sizeof(float));
        dr->h[1] = malloc(E * sizeof(float));
        dr->logits = malloc((size_t)dr->n_vocab * sizeof(float));
        if (!dr->h[0] || !dr->h[1] || !dr->logits) rc = kv_fail(d, KV_ENOMEM, "draft: out of memory");
        else rc = kv_mtp_new(&dr->mtp, m, experts, pool, n_seq, d);
    } else if (!strncmp(spec, "test:", 5)) {
        dr->kind = KV_DRAFT_TEST;
        rc = kv_draft_parse_test(dr, spec + 5, d);
    } else {
        rc = kv_fail(d, KV_EINVAL, "draft: unknown source '%.64s' (mtp, ngram, none or test:FILE:P)", spec);
    }
    if (rc) {
        kv_draft_free(dr);
        return rc;
    }
    *out = dr;
    return 0;
}

void kv_draft_free(kv_draft *dr) {
    if (!dr) return;
    free(dr->rec);
    kv_mtp_free(dr->mtp);
    free(dr->h[0]);
    free(dr->h[1]);
    free(dr->logits);
    free(dr);
}

void kv_draft_reset(kv_draft *dr, uint32_t seq) {
    if (dr && dr->mtp) kv_mtp_reset(dr->mtp, seq);
}

/* The mtp source: a greedy chain from the token fed next (position n - 1).
 * Only the first step's K/V (computed from the trunk's hidden state) is
 * kept for later calls. */
static int kv_draft_mtp(kv_draft *dr, const kv_draft_ctx *c, uint32_t k, int32_t *out) {
    if (!c->hidden || c->n == 0) return 0;
    const uint32_t pos = c->n - 1;
    if (pos >= KV_MTP_MAX_POS) return 0;
    if (pos + k > KV_MTP_MAX_POS) k = KV_MTP_MAX_POS - pos;
    kv_mtp_forget(dr->mtp, c->seq, pos); /* what a rejected chain or an earlier turn left */
    const float *h = c->hidden;
    int32_t tok = c->toks[pos];
    uint32_t m = 0;
    kv_diag d = {0};
    for (; m < k; m++) {
        float *ho = dr->h[m & 1];
        /* an error only shortens the drafts: they are guesses, the verify pass decides */
        if (kv_mtp_step(dr->mtp, c->seq, h, tok, pos + m, ho, dr->logits, &d)) break;
        int32_t best = 0;
        for (uint32_t i = 1; i < dr->n_vocab; i++)
            if (dr->logits[i] > dr->logits[best]) best = (int32_t)i;
        out[m] = tok = best;
        h = ho;
    }
    kv_mtp_forget(dr->mtp, c->seq, pos + 1);
    return (int)m;
}

uint32_t kv_draft_ngram(const int32_t *toks, uint32_t n, uint32_t k, int32_t *out) {
    if (n < 2 || k == 0) return 0;
    const uint32_t lo = n > KV_NGRAM_WINDOW ? n - KV_NGRAM_WINDOW : 0;
    for (uint32_t g = n - 1 < KV_NGRAM_MAX ? n - 1 : KV_NGRAM_MAX; g >= 1; g--) {
        const int32_t *suf = toks + n - g;
        /* the latest earlier occurrence i (toks[i, i+g) == suffix, i + g < n) */
        for (uint32_t i = n - g; i-- > lo;) {
            if (memcmp(toks + i, suf, (size_t)g * sizeof *toks)) continue;
            uint32_t m = 0;
            while (m < k && i + g + m < n) {
                out[m] = toks[i + g + m];
                m++;
            }
            return m;
        }
    }
    return 0;
}

/* A uniform in [0, 1) from (seed, position): splitmix64's finalizer. */
static double kv_draft_uniform(uint64_t seed, uint64_t g) {
    uint64_t z = seed ^ (g * 0x9e3779b97f4a7c15ull) ^ 0x5851f42d4c957f2dull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

uint32_t kv_draft_test_guess(const int32_t *rec, uint32_t n_rec, double p, uint64_t seed, uint32_t n_vocab,
                             uint32_t n_gen, uint32_t k, int32_t *out) {
    /* generated token g (0-based) of the turn is rec[g]; the one fed next is n_gen - 1 */
    uint32_t m = 0;
    for (uint32_t g = n_gen; m < k && g < n_rec; g++) {
        const bool right = kv_draft_uniform(seed, g) < p;
        out[m++] = right ? rec[g] : (int32_t)(((uint32_t)rec[g] + 1) % n_vocab);
        if (!right) break;
    }
    return m;
}

int kv_draft_propose(kv_draft *dr, const kv_draft_ctx *c, uint32_t k, int32_t *out) {
    if (k > KV_DRAFT_MAX) k = KV_DRAFT_MAX;
    switch (dr->kind) {
    case KV_DRAFT_NGRAM:
        return (int)kv_draft_ngram(c->toks, c->n, k, out);
    case KV_DRAFT_TEST:
        return (int)kv_draft_test_guess(dr->rec, dr->n_rec, dr->p, dr->seed, dr->n_vocab, c->n_gen, k, out);
    case KV_DRAFT_MTP:
        return kv_draft_mtp(dr, c, k, out);
    default:
        return 0;
    }
}
