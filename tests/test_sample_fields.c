/* The sampler's logit bias, presence and frequency penalties and
 * log-probabilities (kv_sampler_logprobs) against an independent f64
 * computation of the documented formulas: bias added first, the repetition
 * penalty over the distinct tokens of the last repeat_last_n accepted
 * (prompt and generated), then OpenAI's presence and frequency penalties
 * over the generated tokens only; the reported log-probability is the f64
 * log-softmax of the adjusted logits, the top alternatives the true top-k
 * (lower id first on ties). A +100 bias forces a token, -100 bans one; a
 * bias of 0 draws exactly what no bias draws; bad values are refused. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "kvasir/sample.h"
#include "kvtest.h"

#define NV 300

static void fill_logits(float *l, uint64_t seed) {
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (int i = 0; i < NV; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        l[i] = (float)((double)(x >> 11) / 9007199254740992.0 * 10.0 - 5.0);
    }
}

typedef struct ref_state {
    int32_t hist[4096];  /* every token accepted */
    int n_hist;
    int32_t gen[4096];   /* the generated ones */
    int n_gen;
} ref_state;

/* the documented adjustment in f64 */
static void ref_adjust(const float *l, const kv_sample_params *p, const ref_state *st, double *out) {
    for (int i = 0; i < NV; i++) out[i] = l[i];
    for (uint32_t i = 0; i < p->n_bias; i++) out[p->bias[i].token] += p->bias[i].bias;
    if (p->repeat_penalty != 1.0f) {
        bool seen[NV] = {false};
        const int from = st->n_hist > p->repeat_last_n ? st->n_hist - p->repeat_last_n : 0;
        for (int h = from; h < st->n_hist; h++) {
            const int32_t t = st->hist[h];
            if (seen[t]) continue;
            seen[t] = true;
            out[t] = out[t] > 0 ? out[t] / p->repeat_penalty : out[t] * p->repeat_penalty;
        }
    }
    int cnt[NV] = {0};
    for (int i = 0; i < st->n_gen; i++) cnt[st->gen[i]]++;
    for (int t = 0; t < NV; t++)
        if (cnt[t]) out[t] -= cnt[t] * (double)p->frequency_penalty + p->presence_penalty;
}

static void ref_logsoftmax(const double *x, double *out) {
    double max = -INFINITY, sum = 0;
    for (int i = 0; i < NV; i++)
        if (x[i] > max) max = x[i];
    for (int i = 0; i < NV; i++) sum += exp(x[i] - max);
    const double lse = max + log(sum);
    for (int i = 0; i < NV; i++) out[i] = x[i] - lse;
}

/* the k-th best (0-based) by value desc, id asc */
static int ref_kth(const double *x, int k) {
    bool used[NV] = {false};
    int best = -1;
    for (int r = 0; r <= k; r++) {
        best = -1;
        for (int i = 0; i < NV; i++)
            if (!used[i] && (best < 0 || x[i] > x[best])) best = i;
        used[best] = true;
    }
    return best;
}

/* Without bias or penalties: the model's own distribution. */
static void test_logprobs_plain(void) {
    float l[NV];
    fill_logits(l, 3);
    l[10] = l[20] = 7.0f; /* a tie at the top: the lower id first */
    l[5] = -INFINITY;     /* an undrawable token */
    kv_sample_params p = kv_sample_defaults();
    kv_sampler *s = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), 0);
    double x[NV], ls[NV];
    for (int i = 0; i < NV; i++) x[i] = l[i];
    ref_logsoftmax(x, ls);
    kv_token_logprob out;
    ASSERT_EQ(kv_sampler_logprobs(s, l, 42, 20, &out), 0);
    ASSERT_EQ(out.token, 42);
    ASSERT_TRUE(fabs(out.logprob - ls[42]) < 1e-12);
    ASSERT_EQ(out.n_top, 20u);
    ASSERT_EQ(out.top_id[0], 10);
    ASSERT_EQ(out.top_id[1], 20);
    for (int k = 0; k < 20; k++) {
        ASSERT_EQ(out.top_id[k], ref_kth(ls, k));
        ASSERT_TRUE(fabs(out.top_logprob[k] - ls[out.top_id[k]]) < 1e-12);
    }
    ASSERT_EQ(kv_sampler_logprobs(s, l, 5, 0, &out), 0);
    ASSERT_TRUE(isinf(out.logprob) && out.logprob < 0);
    ASSERT_EQ(out.n_top, 0u);
    ASSERT_EQ(kv_sampler_logprobs(s, l, NV, 1, &out), KV_ERANGE);
    l[7] = NAN;
    ASSERT_EQ(kv_sampler_logprobs(s, l, 1, 1, &out), KV_ERANGE);
    kv_sampler_free(s);
}

/* Bias and every penalty over a sampled sequence: at each step the reported
 * distribution is the formula's, and a greedy draw its argmax. */
static void run_adjusted(float temp, float rp, int32_t last_n, float pres, float freq, uint64_t seed) {
    kv_logit_bias bias[4] = {{7, 3.5f}, {100, -2.0f}, {7, 1.0f}, {299, 0.25f}};
    kv_sample_params p = kv_sample_defaults();
    p.temp = temp;
    p.top_k = 0;
    p.repeat_penalty = rp;
    p.repeat_last_n = last_n;
    p.presence_penalty = pres;
    p.frequency_penalty = freq;
    p.bias = bias;
    p.n_bias = 4;
    p.seed = seed;
    kv_sampler *s = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), 0);
    bias[0].bias = 99; /* the sampler holds its copy */
    p.bias = (kv_logit_bias[]){{7, 3.5f}, {100, -2.0f}, {7, 1.0f}, {299, 0.25f}};
    ref_state *st = calloc(1, sizeof *st);
    for (int i = 0; i < 20; i++) { /* a prompt: history, not generated */
        const int32_t t = (int32_t)((seed * 31 + (uint64_t)i * 17) % NV);
        kv_sampler_accept(s, t);
        st->hist[st->n_hist++] = t;
    }
    float l[NV];
    double x[NV], ls[NV];
    double worst = 0;
    for (int step = 0; step < 60; step++) {
        fill_logits(l, seed * 1000 + (uint64_t)(step % 4)); /* a few logit sets again and again: repeats */
        ref_adjust(l, &p, st, x);
        ref_logsoftmax(x, ls);
        const int32_t t = kv_sampler_sample(s, l);
        ASSERT_TRUE(t >= 0 && t < NV);
        if (temp <= 0) ASSERT_EQ(t, ref_kth(ls, 0));
        kv_token_logprob out;
        ASSERT_EQ(kv_sampler_logprobs(s, l, t, 5, &out), 0);
        const double e = fabs(out.logprob - ls[t]);
        if (e > worst) worst = e;
        for (uint32_t k = 0; k < out.n_top; k++) {
            ASSERT_EQ(out.top_id[k], ref_kth(ls, (int)k));
            ASSERT_TRUE(fabs(out.top_logprob[k] - ls[out.top_id[k]]) < 1e-5);
        }
        kv_sampler_accept_sampled(s, t);
        st->hist[st->n_hist++] = t;
        st->gen[st->n_gen++] = t;
    }
    ASSERT_TRUE(worst < 1e-5); /* f32 adjustment in the sampler, f64 here */
    free(st);
    kv_sampler_free(s);
}

static void test_adjusted(void) {
    run_adjusted(0.0f, 1.0f, 64, 0.0f, 0.0f, 1);    /* bias alone, greedy */
    run_adjusted(0.0f, 1.3f, 64, 0.0f, 0.0f, 2);    /* + repetition */
    run_adjusted(0.0f, 1.0f, 64, 0.7f, 0.4f, 3);    /* + presence, frequency */
    run_adjusted(0.0f, 1.2f, 8, -0.5f, 1.5f, 4);    /* all, a short window */
    run_adjusted(0.9f, 1.1f, 64, 2.0f, -2.0f, 5);   /* sampled, the range's ends */
    run_adjusted(1.3f, 1.0f, 0, 0.3f, 0.3f, 6);     /* no repetition window */
}

/* +100 forces, -100 bans (greedy); a zero bias draws what none draws. */
static void test_bias_force_ban(void) {
    float l[NV];
    fill_logits(l, 9);
    kv_sample_params p = kv_sample_defaults();
    p.temp = 0;
    kv_sampler *s = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), 0);
    const int32_t g = kv_sampler_sample(s, l);
    kv_sampler_free(s);
    const int32_t forced = (g + 123) % NV;
    p.bias = &(kv_logit_bias){forced, 100.0f};
    p.n_bias = 1;
    ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), 0);
    ASSERT_EQ(kv_sampler_sample(s, l), forced);
    kv_sampler_free(s);
    p.bias = &(kv_logit_bias){g, -100.0f};
    ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), 0);
    const int32_t b = kv_sampler_sample(s, l);
    ASSERT_NE(b, g);
    kv_sampler_free(s);
    /* sampled: a zero bias and zero penalties take the slow path and draw the same */
    kv_sample_params q = kv_sample_defaults();
    q.seed = 77;
    kv_sample_params r = q;
    r.bias = &(kv_logit_bias){5, 0.0f};
    r.n_bias = 1;
    kv_sampler *a = NULL, *c = NULL;
    ASSERT_EQ(kv_sampler_new(&a, NV, &q, &d), 0);
    ASSERT_EQ(kv_sampler_new(&c, NV, &r, &d), 0);
    bool same = true;
    for (int i = 0; i < 200; i++) {
        fill_logits(l, (uint64_t)i);
        const int32_t x = kv_sampler_sample(a, l), y = kv_sampler_sample(c, l);
        same &= x == y;
        kv_sampler_accept_sampled(a, x);
        kv_sampler_accept_sampled(c, y);
    }
    ASSERT_TRUE(same);
    kv_sampler_free(a);
    kv_sampler_free(c);
}

static void test_bad_fields(void) {
    kv_diag d = {0};
    kv_sampler *s = NULL;
    kv_sample_params p = kv_sample_defaults();
    p.presence_penalty = 2.5f;
    ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), KV_EINVAL);
    p = kv_sample_defaults();
    p.frequency_penalty = NAN;
    ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), KV_EINVAL);
    p = kv_sample_defaults();
    p.bias = &(kv_logit_bias){NV, 1.0f};
    p.n_bias = 1;
    ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), KV_EINVAL);
    p.bias = &(kv_logit_bias){-1, 1.0f};
    ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), KV_EINVAL);
    p.bias = &(kv_logit_bias){3, 100.5f};
    ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), KV_EINVAL);
    p.bias = &(kv_logit_bias){3, 1.0f};
    p.n_bias = KV_SAMPLE_MAX_BIAS + 1;
    ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), KV_EINVAL);
    p.bias = NULL;
    p.n_bias = 1;
    ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), KV_EINVAL);
    ASSERT_TRUE(s == NULL);
}

static const kvt_case cases[] = {
    KVT_CASE(test_logprobs_plain), KVT_CASE(test_adjusted), KVT_CASE(test_bias_force_ban), KVT_CASE(test_bad_fields),
};

int main(int argc, char **argv) { return kvt_run(argc, argv, cases, KVT_N(cases)); }
