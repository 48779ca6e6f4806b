/* Token sampling: a candidate list filtered by the llama.cpp-ordered chain,
 * then one uniform draw. The draw is counter-based: a hash (splitmix64's
 * finalizer) of the seed, the position of the token being sampled (the
 * tokens accepted so far: prompt and generated) and the draws made at that
 * position, so it depends on where the sequence is and not on how it got
 * there: a sequence rebuilt from its tokens (a ring request replayed after a
 * break, a session re-prompted with its history) draws what the unbroken one
 * would. Buffers are allocated once per sampler. */
#include "kvasir/sample.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

typedef struct kv_cand {
    int32_t id;
    float logit;
    float p;
} kv_cand;

struct kv_sampler {
    kv_sample_params p;
    int32_t n_vocab;
    kv_cand *cand;     /* [n_vocab], NULL when the caller lends scratch */
    int32_t *hist;     /* ring of the last repeat_last_n tokens */
    int32_t n_hist, hist_at;
    uint64_t key;      /* the seed, mixed */
    uint64_t pos;      /* tokens accepted: the position of the token sampled next */
    uint64_t n_draw;   /* draws made at pos (0 for every first draw) */
    kv_logit_bias *bias; /* [n_bias] a copy of p.bias */
    uint32_t *gen_cnt; /* [n_vocab] times each token was generated (presence/frequency penalties on), or NULL */
    int32_t *gen_ids;  /* [n_gen_ids] the distinct tokens generated, in order */
    int32_t n_gen_ids;
    kv_cand *lp_cand;  /* [n_vocab] kv_sampler_logprobs' scratch, allocated at its first call */
};

kv_sample_params kv_sample_defaults(void) {
    return (kv_sample_params){0.8f, 40, 0.95f, 0.05f, 1.0f, 64, 0, 0.0f, 0.0f, NULL, 0};
}

static uint64_t kv_splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t kv_fmix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The uniform in [0, 1) of the n_draw-th draw at position pos: a pure
 * function of (key, pos, n_draw), 53 bits. */
static double kv_uniform_at(uint64_t key, uint64_t pos, uint64_t n_draw) {
    const uint64_t h = kv_fmix(kv_fmix(key ^ (pos * 0x9e3779b97f4a7c15ull)) + n_draw * 0xd1b54a32d192ed03ull);
    return (double)(h >> 11) * (1.0 / 9007199254740992.0);
}

int kv_sampler_new(kv_sampler **out, int32_t n_vocab, const kv_sample_params *p, kv_diag *d) {
    return kv_sampler_new_ex(out, n_vocab, p, true, d);
}

size_t kv_sampler_scratch_bytes(int32_t n_vocab) { return n_vocab > 0 ? (size_t)n_vocab * sizeof(kv_cand) : 0; }

int kv_sampler_new_ex(kv_sampler **out, int32_t n_vocab, const kv_sample_params *p, bool own_scratch,
                      kv_diag *d) {
    *out = NULL;
    if (n_vocab < 1) return kv_fail(d, KV_EINVAL, "sampler: vocabulary is empty");
    if (!(p->temp >= 0.0f && p->temp <= 100.0f)) return kv_fail(d, KV_EINVAL, "sampler: temp %g out of range [0, 100]", p->temp);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f)) return kv_fail(d, KV_EINVAL, "sampler: top-p %g out of range (0, 1]", p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f)) return kv_fail(d, KV_EINVAL, "sampler: min-p %g out of range [0, 1]", p->min_p);
    if (!(p->repeat_penalty > 0.0f && p->repeat_penalty <= 100.0f))
        return kv_fail(d, KV_EINVAL, "sampler: repeat penalty %g out of range (0, 100]", p->repeat_penalty);
    if (p->repeat_last_n < 0 || p->repeat_last_n > 1 << 20)
        return kv_fail(d, KV_EINVAL, "sampler: repeat-last-n %d out of range", p->repeat_last_n);
    if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f))
        return kv_fail(d, KV_EINVAL, "sampler: presence penalty %g out of range [-2, 2]", p->presence_penalty);
    if (!(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f))
        return kv_fail(d, KV_EINVAL, "sampler: frequency penalty %g out of range [-2, 2]", p->frequency_penalty);
    if (p->n_bias > KV_SAMPLE_MAX_BIAS || (p->n_bias && !p->bias))
        return kv_fail(d, KV_EINVAL, "sampler: %u logit biases, at most %u", p->n_bias, KV_SAMPLE_MAX_BIAS);
    for (uint32_t i = 0; i < p->n_bias; i++) {
        if (p->bias[i].token < 0 || p->bias[i].token >= n_vocab)
            return kv_fail(d, KV_EINVAL, "sampler: logit bias token %d outside the vocabulary [0, %d)",
                           p->bias[i].token, n_vocab);
        if (!(p->bias[i].bias >= -100.0f && p->bias[i].bias <= 100.0f))
            return kv_fail(d, KV_EINVAL, "sampler: logit bias %g of token %d out of range [-100, 100]",
                           p->bias[i].bias, p->bias[i].token);
    }
    kv_sampler *s = calloc(1, sizeof *s);
    if (!s) return kv_fail(d, KV_ENOMEM, "sampler: out of memory");
    s->p = *p;
    s->p.bias = NULL;
    s->n_vocab = n_vocab;
    s->cand = own_scratch ? malloc((size_t)n_vocab * sizeof *s->cand) : NULL;
    s->hist = malloc(((size_t)p->repeat_last_n + 1) * sizeof *s->hist);
    bool oom = (own_scratch && !s->cand) || !s->hist;
    if (p->n_bias && (s->bias = malloc(p->n_bias * sizeof *s->bias)))
        memcpy(s->bias, p->bias, p->n_bias * sizeof *s->bias);
    oom |= p->n_bias && !s->bias;
    if (p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f) {
        s->gen_cnt = calloc((size_t)n_vocab, sizeof *s->gen_cnt);
        s->gen_ids = malloc((size_t)n_vocab * sizeof *s->gen_ids);
        oom |= !s->gen_cnt || !s->gen_ids;
    }
    if (oom) {
        kv_sampler_free(s);
        return kv_fail(d, KV_ENOMEM, "sampler: out of memory");
    }
    uint64_t x = p->seed;
    s->key = kv_splitmix(&x);
    *out = s;
    return 0;
}

void kv_sampler_free(kv_sampler *s) {
    if (!s) return;
    free(s->cand);
    free(s->hist);
    free(s->bias);
    free(s->gen_cnt);
    free(s->gen_ids);
    free(s->lp_cand);
    free(s);
}

void kv_sampler_accept(kv_sampler *s, int32_t token) {
    s->pos++;
    s->n_draw = 0;
    if (s->p.repeat_last_n == 0) return;
    s->hist[s->hist_at] = token;
    s->hist_at = (s->hist_at + 1) % s->p.repeat_last_n;
    if (s->n_hist < s->p.repeat_last_n) s->n_hist++;
}

void kv_sampler_accept_sampled(kv_sampler *s, int32_t token) {
    kv_sampler_accept(s, token);
    if (!s->gen_cnt || token < 0 || token >= s->n_vocab) return;
    if (s->gen_cnt[token]++ == 0) s->gen_ids[s->n_gen_ids++] = token;
}

/* Does anything change the logits before the chain's filters? */
static bool kv_sampler_adjusts(const kv_sampler *s) {
    return s->p.repeat_penalty != 1.0f || s->p.n_bias || s->gen_cnt;
}

/* The logit bias and the penalties over c[n_vocab] (c[i].id == i), in
 * llama.cpp's order: bias, then per token its repetition penalty
 * (divided when positive, multiplied otherwise; each distinct token of the
 * last repeat_last_n once), then presence and frequency (OpenAI's formula
 * over the generated tokens). Float arithmetic, as the draw uses it. */
static void kv_adjust(const kv_sampler *s, kv_cand *c) {
    const kv_sample_params *p = &s->p;
    const int32_t n = s->n_vocab;
    for (uint32_t i = 0; i < p->n_bias; i++) c[s->bias[i].token].logit += s->bias[i].bias;
    /* repetition penalty: each distinct token of the history once */
    if (p->repeat_penalty != 1.0f) {
        for (int32_t h = 0; h < s->n_hist; h++) {
            const int32_t t = s->hist[h];
            if (t < 0 || t >= n) continue;
            bool seen = false;
            for (int32_t g = 0; g < h; g++) seen |= s->hist[g] == t;
            if (seen) continue;
            c[t].logit = c[t].logit > 0 ? c[t].logit / p->repeat_penalty : c[t].logit * p->repeat_penalty;
        }
    }
    for (int32_t i = 0; s->gen_cnt && i < s->n_gen_ids; i++) {
        const int32_t t = s->gen_ids[i];
        c[t].logit -= (float)s->gen_cnt[t] * p->frequency_penalty + p->presence_penalty;
    }
}

/* A strict total order (best first, lower id first on ties), NaN after
 * every number: with NaN treated as unordered the quickselect's scans would
 * find no stopper and run past the array. kv_sampler_sample refuses NaN
 * before sorting; the order stays total anyway. */
static int kv_cand_desc(const void *a, const void *b) {
    const kv_cand *x = a, *y = b;
    const bool xn = isnan(x->logit), yn = isnan(y->logit);
    if (xn != yn) return xn ? 1 : -1;
    if (!xn && x->logit != y->logit) return x->logit < y->logit ? 1 : -1;
    return x->id < y->id ? -1 : (x->id > y->id);
}

/* Moves the k best candidates (by kv_cand_desc) to c[0..k), any order
 * (Hoare quickselect, middle pivot). */
static void kv_select(kv_cand *c, int32_t n, int32_t k) {
    int32_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const kv_cand piv = c[lo + (hi - lo) / 2];
        int32_t i = lo, j = hi;
        while (i <= j) {
            while (kv_cand_desc(&c[i], &piv) < 0) i++;
            while (kv_cand_desc(&c[j], &piv) > 0) j--;
            if (i <= j) {
                const kv_cand t = c[i];
                c[i++] = c[j];
                c[j--] = t;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

/* softmax over n sorted candidates into .p */
static void kv_cand_softmax(kv_cand *c, int32_t n) {
    const float max = c[0].logit;
    double sum = 0.0;
    for (int32_t i = 0; i < n; i++) sum += (c[i].p = expf(c[i].logit - max));
    for (int32_t i = 0; i < n; i++) c[i].p = (float)(c[i].p / sum);
}

int32_t kv_sampler_sample(kv_sampler *s, const float *logits) { return kv_sampler_sample_in(s, logits, NULL); }

int32_t kv_sampler_sample_in(kv_sampler *s, const float *logits, void *scratch) {
    return kv_sampler_sample_allowed(s, logits, scratch, NULL);
}

static inline bool kv_allowed(const uint32_t *allow, int32_t i) { return (allow[i >> 5] >> (i & 31)) & 1u; }

/* Greedy over the allowed tokens: the argmax (lowest id on ties) of those
 * with a finite logit. */
static int32_t kv_greedy_allowed(const float *logits, int32_t n, const uint32_t *allow) {
    int32_t best = -1;
    float bv = -INFINITY;
    for (int32_t i = 0; i < n; i++) {
        const float l = logits[i];
        if (isnan(l) || l == INFINITY) return KV_ERANGE;
        if (l == -INFINITY || !kv_allowed(allow, i)) continue;
        if (best < 0 || l > bv) {
            bv = l;
            best = i;
        }
    }
    return best >= 0 ? best : KV_ERANGE;
}

int32_t kv_sampler_sample_allowed(kv_sampler *s, const float *logits, void *scratch, const uint32_t *allow) {
    const kv_sample_params *p = &s->p;
    kv_cand *c = scratch ? scratch : s->cand;
    if (!c) return KV_EINVAL;
    int32_t n = s->n_vocab;
    bool any_finite = false;
    if (allow && p->temp <= 0.0f && !kv_sampler_adjusts(s)) return kv_greedy_allowed(logits, n, allow);
    if (p->temp <= 0.0f && !kv_sampler_adjusts(s)) {
        /* greedy, nothing to penalize: the argmax (lowest id on ties) in the
         * checking pass, without filling the candidate array (that copy was
         * 7% of a decode step over a 152k vocabulary) */
        int32_t best = 0;
        float bv = logits[0]; /* the best value in a register: no load in the chain */
        for (int32_t i = 0; i < n; i++) {
            const float l = logits[i];
            if (isnan(l) || l == INFINITY) return KV_ERANGE;
            any_finite |= l != -INFINITY;
            if (l > bv) {
                bv = l;
                best = i;
            }
        }
        return any_finite ? best : KV_ERANGE;
    }
    for (int32_t i = 0; i < n; i++) {
        const float l = logits[i];
        if (isnan(l) || l == INFINITY) return KV_ERANGE; /* a lie, not a value */
        any_finite |= l != -INFINITY;
        c[i] = (kv_cand){i, l, 0.0f};
    }
    if (!any_finite) return KV_ERANGE; /* nothing can be drawn */
    kv_adjust(s, c); /* bias and penalties (they index candidates by id) */
    if (allow) {
        /* after the adjustments: the forbidden tokens, and those that cannot
           be drawn, leave the list, so no rounding in the draw below can
           fall on one */
        int32_t m = 0;
        for (int32_t i = 0; i < n; i++)
            if (c[i].logit != -INFINITY && kv_allowed(allow, i)) c[m++] = c[i];
        if (m == 0) return KV_ERANGE;
        n = m;
    }
    if (p->temp <= 0.0f) {
        int32_t best = 0;
        for (int32_t i = 1; i < n; i++)
            if (c[i].logit > c[best].logit) best = i;
        return c[best].id; /* best itself but after an allow mask's compaction */
    }
    if (p->top_k > 0 && p->top_k < n) {
        kv_select(c, n, p->top_k);
        n = p->top_k;
    }
    qsort(c, (size_t)n, sizeof *c, kv_cand_desc);
    if (p->top_p < 1.0f) {
        kv_cand_softmax(c, n);
        double cum = 0.0;
        for (int32_t i = 0; i < n; i++) {
            cum += c[i].p;
            if (cum >= p->top_p && i + 1 < n) {
                n = i + 1;
                break;
            }
        }
    }
    if (p->min_p > 0.0f) {
        kv_cand_softmax(c, n);
        const float thr = c[0].p * p->min_p;
        int32_t keep = 1;
        while (keep < n && c[keep].p >= thr) keep++;
        n = keep;
    }
    /* Tempering. A tiny temperature (below about 1e-37, or a denormal)
     * overflows the best logit to +-Inf, and the softmax's Inf - Inf would
     * make every probability NaN, the draw then falling through to the least
     * likely kept token. Shifted by the best logit first, every tempered
     * value is <= 0 and the best exactly 0: the limit is the argmax, as it
     * should be. The plain division stays where it is finite, so every
     * ordinary temperature draws the bits it always drew. */
    if (isfinite(c[0].logit / p->temp)) {
        for (int32_t i = 0; i < n; i++) c[i].logit /= p->temp;
    } else {
        const float top = c[0].logit;
        for (int32_t i = 0; i < n; i++) c[i].logit = (c[i].logit - top) / p->temp;
    }
    kv_cand_softmax(c, n);
    const double r = kv_uniform_at(s->key, s->pos, s->n_draw++);
    double cum = 0.0;
    for (int32_t i = 0; i < n; i++) {
        cum += c[i].p;
        if (r < cum) return c[i].id;
    }
    return c[n - 1].id;
}

int kv_sampler_logprobs(kv_sampler *s, const float *logits, int32_t token, uint32_t n_top, kv_token_logprob *out) {
    const int32_t n = s->n_vocab;
    if (token < 0 || token >= n) return KV_ERANGE;
    if (n_top > KV_SAMPLE_MAX_TOP) n_top = KV_SAMPLE_MAX_TOP;
    if (!s->lp_cand && !(s->lp_cand = malloc((size_t)n * sizeof *s->lp_cand))) return KV_ENOMEM;
    kv_cand *c = s->lp_cand;
    for (int32_t i = 0; i < n; i++) {
        const float l = logits[i];
        if (isnan(l) || l == INFINITY) return KV_ERANGE;
        c[i] = (kv_cand){i, l, 0.0f};
    }
    kv_adjust(s, c);
    /* log-sum-exp in f64, shifted by the largest logit; the top n_top kept
       sorted by insertion (best first, lower id first on ties) */
    double max = -INFINITY;
    for (int32_t i = 0; i < n; i++)
        if (c[i].logit > max) max = c[i].logit;
    if (max == -INFINITY) return KV_ERANGE;
    double sum = 0.0;
    uint32_t k = 0;
    for (int32_t i = 0; i < n; i++) {
        const double l = c[i].logit;
        sum += exp(l - max);
        if (!n_top || (k == n_top && l <= (double)c[out->top_id[k - 1]].logit)) continue;
        uint32_t at = k < n_top ? k++ : n_top - 1;
        while (at > 0 && l > (double)c[out->top_id[at - 1]].logit) {
            out->top_id[at] = out->top_id[at - 1];
            at--;
        }
        out->top_id[at] = i;
    }
    const double lse = max + log(sum);
    out->token = token;
    out->logprob = (double)c[token].logit - lse;
    out->n_top = k;
    for (uint32_t j = 0; j < k; j++) out->top_logprob[j] = (double)c[out->top_id[j]].logit - lse;
    return 0;
}
