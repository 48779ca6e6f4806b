/* Demand metering shared by every coordinator (kvasir/dispatch_demand.h):
 * the meter around an in-process provider counts, per manifest slab, each
 * (token, expert) pair of a successful call once and the call's duration
 * once per slab it needed, against a naive recount of the same calls and
 * the wall clock around them; a failed call counts nothing; experts outside
 * the manifest's slabs are not counted; the report of what grew is the
 * difference, shards without computations left out. And the hub's rule for
 * ring windows (kv_mkt_keep_held): only the slabs held stay.
 * kv-test-labels: unit
 */
#include <time.h>

#include "hub/market.h"
#include "kvasir/dispatch_demand.h"
#include "kvtest.h"

#define NL 2u
#define NE 8u
#define SLEEP_US 3000u

typedef struct fake {
    int fail;     /* the next call fails */
    uint32_t calls;
} fake;

static int fake_compute(void *impl, const kv_expert_req *req, float *out, kv_diag *d) {
    fake *f = impl;
    f->calls++;
    const struct timespec ts = {0, SLEEP_US * 1000L};
    nanosleep(&ts, NULL);
    if (f->fail) return kv_fail(d, KV_EIO, "fake: failing as asked");
    memset(out, 0, (size_t)req->n_tokens * req->n_used * req->n_embd * sizeof *out);
    return 0;
}

static double mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(void) {
    /* two layers of 8 experts, 4 per slab; layer 1's experts 4-7 in no slab */
    kv_manifest_slab slabs[3] = {{.layer = 0, .first = 0, .last = 3}, {.layer = 0, .first = 4, .last = 7},
                                 {.layer = 1, .first = 0, .last = 3}};
    kv_manifest m = {.n_layer = NL, .n_expert = NE, .n_expert_used = 2, .slabs = slabs, .n_slabs = 3};
    fake f = {0};
    const kv_expert_provider inner = {&f, fake_compute, NULL, "fake"};
    kv_demand_meter *dm = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_demand_meter_new(&dm, &inner, &m, &d), 0);
    const kv_expert_provider *p = kv_demand_meter_provider(dm);
    ASSERT_STREQ(p->name, "fake");

    /* the calls, and a naive recount: slab = layer 0: e / 4; layer 1: 2 if e < 4, none else */
    const int32_t ids0[6] = {0, 5, 1, 2, 7, 6};     /* layer 0, 3 tokens x 2 */
    const int32_t ids1[4] = {3, 6, 9, -1};          /* layer 1, 2 tokens x 2: 9 and -1 are no expert */
    const int32_t ids2[2] = {4, 4};                 /* layer 0, 1 token: slab 1 only */
    struct { uint32_t layer, n_tok; const int32_t *ids; int fail; } calls[4] = {
        {0, 3, ids0, 0}, {1, 2, ids1, 0}, {0, 3, ids0, 1}, {0, 1, ids2, 0}};
    uint64_t want_n[3] = {0}, want_calls[3] = {0};
    double wall[3] = {0};
    float x[3 * 4] = {0}, out[3 * 2 * 4];
    for (int c = 0; c < 4; c++) {
        const kv_expert_req req = {calls[c].layer, calls[c].n_tok, 4, 2, x, calls[c].ids, NULL};
        f.fail = calls[c].fail;
        const double t0 = mono();
        const int rc = p->compute(p->impl, &req, out, &d);
        const double t = mono() - t0;
        ASSERT_EQ(rc, calls[c].fail ? KV_EIO : 0);
        if (rc) continue;
        int used[3] = {0};
        for (uint32_t s = 0; s < calls[c].n_tok * 2; s++) {
            const int32_t e = calls[c].ids[s];
            if (e < 0 || e >= (int32_t)NE) continue;
            const int sl = calls[c].layer == 0 ? e / 4 : e < 4 ? 2 : -1;
            if (sl < 0) continue;
            want_n[sl]++;
            used[sl] = 1;
        }
        for (int s = 0; s < 3; s++)
            if (used[s]) want_calls[s]++, wall[s] += t;
    }
    ASSERT_EQ(f.calls, 4);
    kv_remote_demand got[3];
    ASSERT_EQ(kv_demand_meter_get(dm, got, 3), 3);
    for (int s = 0; s < 3; s++) {
        ASSERT_EQ(got[s].computations, want_n[s]);
        /* each call that needed the slab waited its whole duration: at least the provider's
           sleep, at most the wall clock around the call */
        ASSERT_TRUE(got[s].wait_us >= want_calls[s] * SLEEP_US);
        ASSERT_TRUE(got[s].wait_us <= (uint64_t)(wall[s] * 1e6) + 1);
    }
    ASSERT_EQ(want_n[0], 3);
    ASSERT_EQ(want_n[1], 5);
    ASSERT_EQ(want_n[2], 1);
    kv_remote_demand part[1];
    ASSERT_EQ(kv_demand_meter_get(dm, part, 1), 3); /* a short cap: one copied, n_slabs returned */
    ASSERT_EQ(part[0].computations, got[0].computations);

    /* the report: what grew since a baseline, shards without computations left out */
    kv_remote_demand base[3] = {{3, 10}, {1, 5}, {1, 7}};
    kv_hub_demand_shard sh[3];
    ASSERT_EQ(kv_demand_build(&m, got, base, sh), 1); /* slabs 0 and 2 did not grow */
    ASSERT_EQ(sh[0].layer, 0);
    ASSERT_EQ(sh[0].first, 4);
    ASSERT_EQ(sh[0].last, 7);
    ASSERT_EQ(sh[0].computations, 4);
    ASSERT_EQ(sh[0].wait_us, got[1].wait_us - 5);
    ASSERT_EQ(kv_demand_build(&m, got, NULL, sh), 3);
    ASSERT_EQ(sh[2].layer, 1);
    ASSERT_EQ(sh[2].computations, 1);
    kv_demand_meter_free(dm);
    kv_demand_meter_free(NULL);

    /* nothing to report: no request at all (the URL is never dialed) */
    kv_node_key key = {0};
    kv_remote_demand zero[3] = {{0, 0}, {0, 0}, {0, 0}};
    ASSERT_EQ(kv_demand_report_once("http://127.0.0.1:1", &key, &m, zero, 100, &d), 0);
    ASSERT_EQ(kv_demand_report_once("http://127.0.0.1:1", &key, &m, got, 0, &d), 0);

    /* the hub's rule 5: a ring window's report keeps only the slabs it holds */
    double acc[5] = {1, 2, 3, 4, 5}, wt[5] = {10, 20, 30, 40, 50};
    const uint32_t held[2] = {1, 3};
    ASSERT_NEAR(kv_mkt_keep_held(5, held, 2, acc, wt), 6.0, 0);
    const double want_acc[5] = {0, 2, 0, 4, 0}, want_wt[5] = {0, 20, 0, 40, 0};
    for (int i = 0; i < 5; i++) {
        ASSERT_NEAR(acc[i], want_acc[i], 0);
        ASSERT_NEAR(wt[i], want_wt[i], 0);
    }
    ASSERT_NEAR(kv_mkt_keep_held(5, NULL, 0, acc, wt), 0.0, 0);
    KV_TEST_END();
}
