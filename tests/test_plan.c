/* kv-test-labels: unit
 * The plan (include/kvasir/plan.h) against figures worked out by hand and
 * against a naive reference written from the coordinator's rule
 * (src/dispatch/remote.c kv_remote_pick: scan every worker from the
 * rotation start, take the first with the strictly fewest pairs), over
 * random placements; malformed placements refused with a message. The
 * real decode is compared with the plan in tests/test_swarm_cli.sh. */
#include "kvasir/dispatch_proto.h"
#include "kvasir/dispatch_remote.h"
#include "kvasir/plan.h"
#include "kvtest.h"

#define NL 2
#define NE 8

/* A manifest of NL MoE layers of NE experts, top-k, embd 256, in slabs of 4. */
static kv_manifest *kvt_manifest(uint32_t k) {
    char buf[8192];
    int o = snprintf(buf, sizeof buf,
                     "{\"format\":\"kvasir-slices\",\"version\":1,\"model\":{\"id\":\"%064d\",\"name\":\"t\",\"architecture\":"
                     "\"qwen3moe\"},\"hparams\":{\"n_layer\":%d,\"n_embd\":256,\"n_expert\":%d,\"n_expert_used\":%u,"
                     "\"n_ff_exp\":256},\"layers\":{\"first\":0,\"last\":%d,\"moe\":[0,1]},\"sparse\":false,"
                     "\"backbone\":{\"path\":\"backbone.gguf\",\"size\":100,\"sha256\":\"%064d\"},\"slabs\":[",
                     0, NL, NE, k, NL - 1, 0);
    for (int L = 0; L < NL; L++)
        for (int f = 0; f < NE; f += 4)
            o += snprintf(buf + o, sizeof buf - (size_t)o,
                          "%s{\"path\":\"experts/blk.%d.%04d-%04d.gguf\",\"size\":100,\"sha256\":\"%064d\",\"layer\":%d,"
                          "\"first\":%d,\"last\":%d}", L || f ? "," : "", L, f, f + 3, 0, L, f, f + 3);
    snprintf(buf + o, sizeof buf - (size_t)o, "]}");
    kv_manifest *m = NULL;
    kv_diag d = {0};
    if (kv_manifest_parse(&m, buf, strlen(buf), &d)) fprintf(stderr, "manifest: %s\n", d.msg);
    return m;
}

/* A placement: holds[w][L][e] for n_w workers at 127.0.0.1:(7000 + w). */
static char *kvt_placement(uint32_t n_w, uint8_t holds[][NL][NE]) {
    static char buf[1 << 16];
    int o = snprintf(buf, sizeof buf, "{\"shards\":[");
    bool first = true;
    for (int L = 0; L < NL; L++)
        for (int e = 0; e < NE; e++) { /* one shard per expert keeps the builder simple */
            o += snprintf(buf + o, sizeof buf - (size_t)o, "%s{\"layer\":%d,\"first\":%d,\"last\":%d,\"nodes\":[",
                          first ? "" : ",", L, e, e);
            first = false;
            bool fn = true;
            for (uint32_t w = 0; w < n_w; w++) {
                if (!holds[w][L][e]) continue;
                o += snprintf(buf + o, sizeof buf - (size_t)o,
                              "%s{\"key\":\"%064u\",\"addr\":\"127.0.0.1:%u\",\"backend\":\"x\",\"last_seen_ms\":1}",
                              fn ? "" : ",", w, 7000 + w);
                fn = false;
            }
            o += snprintf(buf + o, sizeof buf - (size_t)o, "]}");
        }
    snprintf(buf + o, sizeof buf - (size_t)o, "]}");
    return buf;
}

/* Workers in placement order (first seen), as the coordinator dials them. */
static uint32_t kvt_order(uint32_t n_w, uint8_t holds[][NL][NE], uint32_t *order) {
    uint32_t n = 0;
    bool seen[16] = {0};
    for (int L = 0; L < NL; L++)
        for (int e = 0; e < NE; e++)
            for (uint32_t w = 0; w < n_w; w++)
                if (holds[w][L][e] && !seen[w]) seen[w] = true, order[n++] = w;
    return n;
}

/* The naive reference: every ordered k-tuple, remote.c's scan, in f64. */
static void kvt_reference(uint32_t n_w, uint8_t holds[][NL][NE], uint32_t k, uint32_t *mn, uint32_t *mx, double *mean) {
    uint32_t order[16];
    const uint32_t n = kvt_order(n_w, holds, order);
    *mn = 0, *mx = 0, *mean = 0;
    for (int L = 0; L < NL; L++) {
        uint32_t lmin = 1000, lmax = 0, cnt = 0;
        double sum = 0;
        uint32_t idx[8] = {0};
        for (;;) {
            bool distinct = true;
            for (uint32_t a = 0; a < k; a++)
                for (uint32_t b = 0; b < a; b++) distinct &= idx[a] != idx[b];
            if (distinct) {
                uint32_t load[16] = {0}, msgs = 0;
                for (uint32_t s = 0; s < k; s++) {
                    const uint32_t key = (uint32_t)L * NE + idx[s];
                    int best = -1;
                    for (uint32_t j = 0; j < n; j++) {
                        const uint32_t i = (key + j) % n;
                        if (!holds[order[i]][L][idx[s]]) continue;
                        if (best < 0 || load[i] < load[best]) best = (int)i;
                    }
                    msgs += load[best] == 0;
                    load[best]++;
                }
                sum += msgs;
                cnt++;
                if (msgs < lmin) lmin = msgs;
                if (msgs > lmax) lmax = msgs;
            }
            uint32_t a = 0;
            while (a < k && ++idx[a] == NE) idx[a++] = 0;
            if (a == k) break;
        }
        *mn += lmin, *mx += lmax, *mean += sum / cnt;
    }
}

static void kvt_figures(kv_manifest *m, uint32_t n_w, uint8_t holds[][NL][NE], kv_plan_figures *f, int want_rc) {
    const char *pl = kvt_placement(n_w, holds);
    kv_plan *p = NULL;
    kv_diag d = {0};
    int rc = kv_plan_open(&p, m, pl, strlen(pl), &d);
    ASSERT_EQ(rc, want_rc);
    if (rc) return;
    ASSERT_EQ(kv_plan_figures_get(p, KV_ENC_F32, f, &d), 0);
    kv_plan_free(p);
}

static void test_by_hand(void) {
    kv_manifest *m = kvt_manifest(2);
    ASSERT_TRUE(m != NULL);
    if (!m) return;
    static uint8_t h[2][NL][NE];
    kv_plan_figures f;
    /* two workers, disjoint halves: of the 56 ordered pairs, 24 stay on one
     * worker (1 message) and 32 go to both (2), in each of the two layers */
    memset(h, 0, sizeof h);
    for (int L = 0; L < NL; L++)
        for (int e = 0; e < NE; e++) h[e < 4 ? 0 : 1][L][e] = 1;
    kvt_figures(m, 2, h, &f, 0);
    ASSERT_EQ(f.experts_missing, 0);
    ASSERT_EQ(f.round_trips, 2);
    ASSERT_EQ(f.expert_pairs, 4);
    ASSERT_EQ(f.messages_min, 2);
    ASSERT_EQ(f.messages_max, 4);
    ASSERT_NEAR(f.messages_expected, 2.0 * 88.0 / 56.0, 1e-12);
    ASSERT_TRUE(f.exact);
    ASSERT_EQ(f.routings, 2 * 56); /* ordered pairs of distinct experts, per layer */
    /* COMPUTE (header, fixed, one row) + RESULT (header, fixed, a v4 signature) */
    ASSERT_EQ(f.bytes_per_message, 16 + 20 + 256 * 4 + 16 + 12 + 64);
    ASSERT_EQ(f.bytes_per_pair, 8 + 256 * 4);
    ASSERT_EQ(f.bytes_min, 2 * 1152 + 4 * 1032);
    ASSERT_EQ(f.bytes_max, 4 * 1152 + 4 * 1032);
    ASSERT_NEAR(f.bytes_expected, 2.0 * 88.0 / 56.0 * 1152 + 4 * 1032, 1e-9);
    /* two full replicas: the balancing sends a token's two experts to both */
    memset(h, 1, sizeof h);
    kvt_figures(m, 2, h, &f, 0);
    ASSERT_EQ(f.messages_min, 4);
    ASSERT_EQ(f.messages_max, 4);
    /* one worker holds all: one message per layer */
    kvt_figures(m, 1, h, &f, 0);
    ASSERT_EQ(f.messages_min, 2);
    ASSERT_EQ(f.messages_max, 2);
    ASSERT_EQ(f.bytes_min, 2 * 1152 + 4 * 1032);
    /* half of each layer held by nobody */
    memset(h, 0, sizeof h);
    for (int L = 0; L < NL; L++)
        for (int e = 0; e < 4; e++) h[0][L][e] = 1;
    kvt_figures(m, 1, h, &f, 0);
    ASSERT_EQ(f.experts_missing, 8);
    ASSERT_EQ(f.missing_layer, 0);
    ASSERT_EQ(f.missing_expert, 4);
    kv_manifest_free(m);
}

static void test_vs_reference(void) {
    kv_manifest *m = kvt_manifest(2), *m3 = kvt_manifest(3);
    ASSERT_TRUE(m && m3);
    if (!m || !m3) return;
    static uint8_t h[5][NL][NE];
    uint64_t seed = 12345;
    for (int t = 0; t < 200; t++) {
        const uint32_t n_w = 1 + (uint32_t)(t % 5), k = t % 2 ? 3 : 2;
        memset(h, 0, sizeof h);
        for (int L = 0; L < NL; L++)
            for (int e = 0; e < NE; e++) {
                seed = seed * 6364136223846793005ull + 1442695040888963407ull;
                uint32_t bits = (uint32_t)(seed >> 33);
                h[bits % n_w][L][e] = 1; /* one holder at least */
                for (uint32_t w = 0; w < n_w; w++) h[w][L][e] |= (bits >> (8 + w)) & (bits >> (16 + w)) & 1;
            }
        kv_plan_figures f;
        kvt_figures(k == 2 ? m : m3, n_w, h, &f, 0);
        uint32_t mn, mx;
        double mean;
        kvt_reference(n_w, h, k, &mn, &mx, &mean);
        ASSERT_EQ(f.messages_min, mn);
        ASSERT_EQ(f.messages_max, mx);
        ASSERT_NEAR(f.messages_expected, mean, 1e-9);
        ASSERT_TRUE(f.exact);
    }
    kv_manifest_free(m);
    kv_manifest_free(m3);
}

static void test_sampled(void) {
    kv_manifest *m = kvt_manifest(8); /* 8^8 steps: more than KV_PLAN_ENUM, so sampled */
    ASSERT_TRUE(m != NULL);
    if (!m) return;
    static uint8_t h[2][NL][NE];
    memset(h, 0, sizeof h);
    for (int L = 0; L < NL; L++)
        for (int e = 0; e < NE; e++) h[e % 2][L][e] = 1;
    kv_plan_figures f, g;
    kvt_figures(m, 2, h, &f, 0);
    ASSERT_TRUE(!f.exact);
    ASSERT_EQ(f.routings, 2 * KV_PLAN_SAMPLES);
    /* all 8 experts are picked: both workers, every time */
    ASSERT_EQ(f.messages_min, 4);
    ASSERT_EQ(f.messages_max, 4);
    kvt_figures(m, 2, h, &g, 0);
    ASSERT_TRUE(f.messages_expected == g.messages_expected); /* seeded: the same figures again */
    kv_manifest_free(m);
}

static void test_malformed(void) {
    kv_manifest *m = kvt_manifest(2);
    ASSERT_TRUE(m != NULL);
    if (!m) return;
    const char *bad[] = {
        "", "{", "[]", "{\"shards\":{}}",
        "{\"shards\":[{\"layer\":2,\"first\":0,\"last\":0,\"nodes\":[]}]}",
        "{\"shards\":[{\"layer\":0,\"first\":3,\"last\":2,\"nodes\":[]}]}",
        "{\"shards\":[{\"layer\":0,\"first\":0,\"last\":8,\"nodes\":[]}]}",
        "{\"shards\":[{\"layer\":-1,\"first\":0,\"last\":0,\"nodes\":[]}]}",
        "{\"shards\":[{\"layer\":\"0\",\"first\":0,\"last\":0,\"nodes\":[]}]}",
        "{\"shards\":[{\"layer\":0,\"first\":0,\"last\":0,\"nodes\":[{\"addr\":\"a b:1\"}]}]}",
        "{\"shards\":[{\"layer\":0,\"first\":0,\"last\":0,\"nodes\":[{\"key\":\"x\"}]}]}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kv_plan *p = (kv_plan *)1;
        kv_diag d = {0};
        ASSERT_TRUE(kv_plan_open(&p, m, bad[i], strlen(bad[i]), &d) < 0);
        ASSERT_TRUE(p == NULL);
        ASSERT_TRUE(d.msg[0] != 0);
    }
    /* a key that is not 64 hex digits is ignored, not stored */
    const char *ok = "{\"shards\":[{\"layer\":0,\"first\":0,\"last\":7,\"nodes\":[{\"key\":\"zz\",\"addr\":\"h:1\"}]}]}";
    kv_plan *p = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_plan_open(&p, m, ok, strlen(ok), &d), 0);
    ASSERT_EQ(kv_plan_n_nodes(p), 1);
    ASSERT_STREQ(kv_plan_node_key(p, 0), "");
    ASSERT_STREQ(kv_plan_node_addr(p, 0), "h:1");
    ASSERT_TRUE(kv_plan_holds(p, 0, 0, 7) && !kv_plan_holds(p, 0, 1, 0) && !kv_plan_holds(p, 0, 0, 8));
    kv_plan_figures f;
    ASSERT_EQ(kv_plan_figures_get(p, 99, &f, &d), KV_EINVAL);
    ASSERT_EQ(kv_plan_figures_get(p, KV_ENC_F16, &f, &d), 0);
    ASSERT_EQ(f.experts_missing, 8);
    ASSERT_EQ(f.bytes_per_pair, 8 + 256 * 2);
    kv_plan_free(p);
    kv_plan_free(NULL);
    kv_manifest_free(m);
}

static const kvt_case cases[] = {KVT_CASE(test_by_hand), KVT_CASE(test_vs_reference), KVT_CASE(test_sampled),
                                 KVT_CASE(test_malformed)};
int main(int argc, char **argv) { return kvt_run(argc, argv, cases, KVT_N(cases)); }
