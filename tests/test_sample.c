/* Sampling: greedy is argmax; the same seed gives the same draws; every
 * draw lies in the candidate set that an independent f64 computation of
 * top-k / top-p / min-p admits; draw frequencies follow the tempered
 * probabilities; the repetition penalty changes exactly the penalized
 * tokens; non-finite logits are an error, never a crash or a silent token. */
#include <float.h>
#include <stdbool.h>
#include <stdint.h>

#include "kvasir/sample.h"
#include "kvtest.h"

#define NV 200

static void fill_logits(float *l, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < NV; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        l[i] = (float)((double)(x >> 11) / 9007199254740992.0 * 8.0 - 4.0);
    }
}

/* Reference: which tokens may be drawn, and their probabilities, in f64. */
static void ref_allowed(const float *l, int top_k, double top_p, double min_p, double temp,
                        bool *allowed, double *prob) {
    int order[NV];
    for (int i = 0; i < NV; i++) order[i] = i;
    for (int i = 0; i < NV; i++) /* selection sort by logit desc, id asc */
        for (int j = i + 1; j < NV; j++)
            if (l[order[j]] > l[order[i]] || (l[order[j]] == l[order[i]] && order[j] < order[i])) {
                int t = order[i];
                order[i] = order[j];
                order[j] = t;
            }
    int n = top_k > 0 && top_k < NV ? top_k : NV;
    double p[NV], sum = 0;
    for (int i = 0; i < n; i++) sum += (p[i] = exp((double)l[order[i]] - l[order[0]]));
    for (int i = 0; i < n; i++) p[i] /= sum;
    if (top_p < 1.0) {
        double cum = 0;
        for (int i = 0; i < n; i++) {
            cum += p[i];
            if (cum >= top_p) { n = i + 1; break; }
        }
    }
    if (min_p > 0) { /* p_i >= min_p * p_max  <=>  exp(l_i - l_max) >= min_p */
        int keep = 1;
        while (keep < n && exp((double)l[order[keep]] - l[order[0]]) >= min_p) keep++;
        n = keep;
    }
    memset(allowed, 0, NV * sizeof *allowed);
    for (int i = 0; i < NV; i++) prob[i] = 0;
    sum = 0;
    for (int i = 0; i < n; i++) sum += exp(((double)l[order[i]] - l[order[0]]) / temp);
    for (int i = 0; i < n; i++) {
        allowed[order[i]] = true;
        prob[order[i]] = exp(((double)l[order[i]] - l[order[0]]) / temp) / sum;
    }
}

static void test_greedy(void) {
    float l[NV];
    kv_diag d = {0};
    kv_sampler *s = NULL;
    fill_logits(l, 1);
    int best = 0;
    for (int i = 1; i < NV; i++) if (l[i] > l[best]) best = i;
    kv_sample_params p = kv_sample_defaults();
    p.temp = 0;
    ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), 0);
    ASSERT_EQ(kv_sampler_sample(s, l), best);
    kv_sampler_free(s);
    /* without a penalty greedy takes its own pass (no candidate array): the
     * same argmax, the lowest id among equal maxima, -Inf leading, NaN and
     * +Inf refused wherever they are */
    p.repeat_penalty = 1.0f;
    ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), 0);
    ASSERT_EQ(kv_sampler_sample(s, l), best);
    for (int i = 0; i < NV; i++) l[i] = (float)(i % 7);
    ASSERT_EQ(kv_sampler_sample(s, l), 6);
    l[0] = -INFINITY; l[1] = -INFINITY;
    ASSERT_EQ(kv_sampler_sample(s, l), 6);
    l[NV - 1] = 9.0f; l[NV - 2] = 9.0f;
    ASSERT_EQ(kv_sampler_sample(s, l), NV - 2);
    l[NV - 1] = NAN;
    ASSERT_EQ(kv_sampler_sample(s, l), KV_ERANGE);
    l[NV - 1] = INFINITY;
    ASSERT_EQ(kv_sampler_sample(s, l), KV_ERANGE);
    for (int i = 0; i < NV; i++) l[i] = -INFINITY;
    ASSERT_EQ(kv_sampler_sample(s, l), KV_ERANGE);
    kv_sampler_free(s);
}

/* A tiny temperature is greedy in the limit: 1e-38, the smallest normal,
 * denormals down to the smallest (1e-45) and 0 all give the argmax of an
 * independent scan, over logits of either sign and of large magnitude, with
 * and without top-k / top-p / min-p and a penalty. Before, logit / temp
 * overflowed to +-Inf, the softmax turned every probability into NaN and
 * the draw fell through to the least likely kept token. */
static void test_tiny_temp(void) {
    float l[NV];
    kv_diag d = {0};
    const float temps[] = {1e-30f, 1e-37f, 1e-38f, FLT_MIN, FLT_MIN / 2, 1e-40f, 1e-44f, 1e-45f, 0.0f};
    const struct { int k; float tp, mp, rp; } cfg[] = {
        {0, 1.0f, 0.0f, 1.0f}, {40, 0.95f, 0.05f, 1.0f}, {0, 1.0f, 0.0f, 1.1f}, {5, 1.0f, 0.0f, 1.0f},
    };
    const float scales[] = {1.0f, 25.0f, 1e4f};
    const float shifts[] = {0.0f, -50.0f, 30.0f};
    int checked = 0;
    for (size_t ti = 0; ti < sizeof temps / sizeof temps[0]; ti++)
        for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++)
            for (size_t si = 0; si < 3; si++)
                for (size_t hi = 0; hi < 3; hi++) {
                    kv_sample_params p = kv_sample_defaults();
                    p.temp = temps[ti]; p.top_k = cfg[ci].k; p.top_p = cfg[ci].tp; p.min_p = cfg[ci].mp;
                    p.repeat_penalty = cfg[ci].rp; p.seed = 11 + ti;
                    kv_sampler *s = NULL;
                    ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), 0);
                    for (int round = 0; round < 8; round++) {
                        fill_logits(l, 3000 + 97 * ti + 13 * ci + 5 * si + hi + (uint64_t)round * 7919);
                        for (int i = 0; i < NV; i++) l[i] = l[i] * scales[si] + shifts[hi];
                        /* the reference: penalty (no history yet: none), then a plain scan */
                        int best = 0;
                        for (int i = 1; i < NV; i++) if (l[i] > l[best]) best = i;
                        const int32_t t = kv_sampler_sample(s, l);
                        if (t != best)
                            KVT_FAIL("temp %g cfg %zu scale %g shift %g: drew %d (logit %g), argmax %d (logit %g)",
                                     (double)temps[ti], ci, (double)scales[si], (double)shifts[hi], (int)t,
                                     t >= 0 ? (double)l[t] : 0.0, best, (double)l[best]);
                        checked++;
                    }
                    kv_sampler_free(s);
                }
    ASSERT_EQ(checked, 9 * 4 * 3 * 3 * 8);
}

/* same seed, same draws; different seed, different sequence */
static void test_seed(void) {
    float l[NV];
    kv_diag d = {0};
    kv_sampler *s = NULL;
    fill_logits(l, 1);
    kv_sample_params p = kv_sample_defaults();
    p.temp = 1.5f; p.top_k = 0; p.top_p = 1.0f; p.min_p = 0.0f; p.seed = 42;
    int32_t a[64], b[64], c[64];
    kv_sampler *s2 = NULL, *s3 = NULL;
    ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), 0);
    ASSERT_EQ(kv_sampler_new(&s2, NV, &p, &d), 0);
    p.seed = 43;
    ASSERT_EQ(kv_sampler_new(&s3, NV, &p, &d), 0);
    int differ = 0;
    for (int i = 0; i < 64; i++) {
        a[i] = kv_sampler_sample(s, l);
        b[i] = kv_sampler_sample(s2, l);
        c[i] = kv_sampler_sample(s3, l);
        differ += a[i] != c[i];
        ASSERT_EQ(a[i], b[i]);
    }
    ASSERT_TRUE(differ > 0);
    kv_sampler_free(s); kv_sampler_free(s2); kv_sampler_free(s3);
}

/* filters: every draw allowed by the f64 reference; frequencies close */
static void test_filters(void) {
    float l[NV];
    kv_diag d = {0};
    kv_sampler *s = NULL;
    kv_sample_params p;
    struct { int k; float tp, mp, temp; } cases[] = {
        {40, 1.0f, 0.0f, 1.0f}, {0, 0.5f, 0.0f, 1.0f}, {0, 1.0f, 0.2f, 1.0f},
        {10, 0.9f, 0.05f, 0.7f}, {5, 1.0f, 0.0f, 2.0f},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        fill_logits(l, 100 + ci);
        bool allowed[NV];
        double prob[NV];
        ref_allowed(l, cases[ci].k, cases[ci].tp, cases[ci].mp, cases[ci].temp, allowed, prob);
        p = kv_sample_defaults();
        p.top_k = cases[ci].k; p.top_p = cases[ci].tp; p.min_p = cases[ci].mp; p.temp = cases[ci].temp;
        p.seed = 7 + ci;
        ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), 0);
        const int N = 20000;
        int cnt[NV] = {0}, bad = 0;
        for (int i = 0; i < N; i++) {
            int32_t t = kv_sampler_sample(s, l);
            if (t < 0 || t >= NV || !allowed[t]) bad++;
            else cnt[t]++;
        }
        ASSERT_EQ(bad, 0);
        double maxdev = 0;
        for (int i = 0; i < NV; i++) {
            double dev = fabs(cnt[i] / (double)N - prob[i]);
            if (dev > maxdev) maxdev = dev;
        }
        /* 20000 draws: a binomial sd is at most 0.0035; allow ~5 sd */
        ASSERT_TRUE(maxdev < 0.018);
        kv_sampler_free(s);
    }
}

/* repetition penalty: penalized token's logit divided (positive) or multiplied (negative) */
static void test_repeat_penalty(void) {
    float l[NV];
    kv_diag d = {0};
    kv_sampler *s = NULL;
    for (int i = 0; i < NV; i++) l[i] = 0.0f;
    l[3] = 2.0f; l[4] = 1.9f;
    kv_sample_params p = kv_sample_defaults();
    p.temp = 0; p.repeat_penalty = 1.5f;
    ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), 0);
    ASSERT_EQ(kv_sampler_sample(s, l), 3);
    kv_sampler_accept(s, 3); /* 2.0/1.5 = 1.33 < 1.9 */
    ASSERT_EQ(kv_sampler_sample(s, l), 4);
    kv_sampler_free(s);
}

/* bad parameters are refused */
static void test_bad_params(void) {
    kv_diag d = {0};
    kv_sampler *s = NULL;
    kv_sample_params p = kv_sample_defaults();
    p.top_p = 0.0f;
    ASSERT_NE(kv_sampler_new(&s, NV, &p, &d), 0);
    p = kv_sample_defaults();
    p.temp = -1.0f;
    ASSERT_NE(kv_sampler_new(&s, NV, &p, &d), 0);
}

/* Non-finite logits (a lying worker, a NaN weight) are refused with
 * KV_ERANGE: before, NaN made the top-k quickselect run past the array
 * (kv_cand_desc is no order on NaN) and greedy silently returned token 0.
 * Each setting of the chain is tried with NaN at the front, in the middle,
 * everywhere, and with +Inf; -Inf logits stay legal (undrawable tokens). */
static void test_nonfinite(void) {
    float l[NV];
    kv_diag d = {0};
    const struct { int k; float tp, mp, temp; } cfg[] = {
        {0, 1.0f, 0.0f, 0.0f}, {40, 0.95f, 0.05f, 0.8f}, {0, 1.0f, 0.0f, 1.0f}, {199, 0.5f, 0.0f, 1.0f},
    };
    for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++) {
        kv_sample_params p = kv_sample_defaults();
        p.top_k = cfg[ci].k; p.top_p = cfg[ci].tp; p.min_p = cfg[ci].mp; p.temp = cfg[ci].temp;
        for (int mode = 0; mode < 4; mode++) {
            kv_sampler *s = NULL;
            ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), 0);
            fill_logits(l, 9 + (uint64_t)mode);
            if (mode == 0) l[0] = NAN;
            else if (mode == 1) for (int i = 0; i < NV; i += 3) l[i] = NAN;
            else if (mode == 2) for (int i = 0; i < NV; i++) l[i] = NAN;
            else l[NV / 2] = INFINITY;
            ASSERT_EQ(kv_sampler_sample(s, l), KV_ERANGE);
            kv_sampler_free(s);
        }
        /* all -Inf: nothing can be drawn */
        kv_sampler *s = NULL;
        ASSERT_EQ(kv_sampler_new(&s, NV, &p, &d), 0);
        for (int i = 0; i < NV; i++) l[i] = -INFINITY;
        ASSERT_EQ(kv_sampler_sample(s, l), KV_ERANGE);
        /* -Inf except two tokens: only those are drawn */
        l[17] = 1.0f; l[101] = 1.5f;
        for (int i = 0; i < 200; i++) {
            const int32_t t = kv_sampler_sample(s, l);
            ASSERT_TRUE(t == 17 || t == 101);
            if (cfg[ci].temp == 0.0f) ASSERT_EQ(t, 101);
        }
        kv_sampler_free(s);
    }
}

/* The draw depends on the position, not on the draws before it: a sampler
 * fed a sequence's prompt and its first k sampled tokens afresh (a replay
 * after a break) samples the rest exactly as the unbroken one did, with
 * temperature > 0 and a penalty; and a different position draws anew. */
static void test_replay_same_draws(void) {
    float l[NV];
    kv_diag d = {0};
    kv_sample_params p = kv_sample_defaults();
    p.temp = 0.9f; p.top_k = 0; p.top_p = 0.98f; p.min_p = 0.0f; p.repeat_penalty = 1.1f; p.seed = 1234;
    enum { NP = 7, NG = 40, CUT = 17 };
    int32_t seq[NP + NG];
    for (int i = 0; i < NP; i++) seq[i] = (i * 37) % NV;
    kv_sampler *a = NULL;
    ASSERT_EQ(kv_sampler_new(&a, NV, &p, &d), 0);
    for (int i = 0; i < NP; i++) kv_sampler_accept(a, seq[i]);
    for (int i = 0; i < NG; i++) {
        fill_logits(l, 900 + (uint64_t)i);
        seq[NP + i] = kv_sampler_sample(a, l);
        ASSERT_TRUE(seq[NP + i] >= 0);
        kv_sampler_accept(a, seq[NP + i]);
    }
    kv_sampler *b = NULL;
    ASSERT_EQ(kv_sampler_new(&b, NV, &p, &d), 0);
    for (int i = 0; i < NP + CUT; i++) kv_sampler_accept(b, seq[i]);
    int same = 1, distinct = 0;
    for (int i = CUT; i < NG; i++) {
        fill_logits(l, 900 + (uint64_t)i);
        const int32_t t = kv_sampler_sample(b, l);
        same &= t == seq[NP + i];
        distinct += t != seq[NP + i - 1];
        kv_sampler_accept(b, t);
    }
    ASSERT_TRUE(same);
    ASSERT_TRUE(distinct > 0); /* the draws are not constant */
    /* one position later the same logits draw differently at least once */
    fill_logits(l, 4242);
    int moved = 0;
    for (int i = 0; i < 32; i++) {
        kv_sampler *e = NULL;
        ASSERT_EQ(kv_sampler_new(&e, NV, &p, &d), 0);
        for (int k = 0; k < i; k++) kv_sampler_accept(e, 0);
        const int32_t t0 = kv_sampler_sample(e, l);
        kv_sampler_accept(e, 0);
        moved += kv_sampler_sample(e, l) != t0;
        kv_sampler_free(e);
    }
    ASSERT_TRUE(moved > 0);
    kv_sampler_free(a);
    kv_sampler_free(b);
}

/* A sampler on lent scratch draws exactly what one with its own buffer
 * draws, and one without any refuses to sample. */
static void test_shared_scratch(void) {
    float l[NV];
    kv_diag d = {0};
    kv_sampler *own = NULL, *lent = NULL;
    kv_sample_params p = kv_sample_defaults();
    p.seed = 5;
    ASSERT_EQ(kv_sampler_new(&own, NV, &p, &d), 0);
    ASSERT_EQ(kv_sampler_new_ex(&lent, NV, &p, false, &d), 0);
    void *buf = malloc(kv_sampler_scratch_bytes(NV));
    int same = 1;
    for (int i = 0; i < 300; i++) {
        fill_logits(l, 500 + (uint64_t)i);
        const int32_t a = kv_sampler_sample(own, l), b = kv_sampler_sample_in(lent, l, buf);
        same &= a == b && a >= 0;
        kv_sampler_accept(own, a);
        kv_sampler_accept(lent, b);
    }
    ASSERT_TRUE(same);
    ASSERT_EQ(kv_sampler_sample(lent, l), KV_EINVAL);
    free(buf);
    kv_sampler_free(own);
    kv_sampler_free(lent);
}

static const kvt_case cases[] = {
    KVT_CASE(test_greedy), KVT_CASE(test_tiny_temp), KVT_CASE(test_seed), KVT_CASE(test_replay_same_draws), KVT_CASE(test_filters), KVT_CASE(test_repeat_penalty),
    KVT_CASE(test_bad_params), KVT_CASE(test_nonfinite), KVT_CASE(test_shared_scratch),
};

int main(int argc, char **argv) { return kvt_run(argc, argv, cases, KVT_N(cases)); }
