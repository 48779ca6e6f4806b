/* kv-test-labels: unit
 * Sites (src/hub/sites.c) and the plan's predictions (src/dispatch/plan.c):
 *  - the site placement by hand: contiguous windows from layer 0, every
 *    expert of a window held in its site, dense layers held anywhere, and
 *    the fallback (no placement, the layer and the missing expert named)
 *    when a site lacks an expert;
 *  - against a brute-force reference over random layouts: the placement
 *    exists exactly when some order of distinct sites with windows covers
 *    every layer, and whatever it returns is valid;
 *  - a site's name: given, "auto:hub" near the hub or on loopback, else
 *    "auto:" and the subnet;
 *  - GET /v1/sites rendered from a snapshot, read back by the plan and by
 *    the ring (kv_plan_sites_parse, kv_ring_parse_sites), and the predicted
 *    time per token worked out by hand for two sites 40 ms apart;
 *  - the announcement's optional site, bounded and checked;
 *  - malformed /v1/sites answers refused with a message. */
#include "hub/hub_internal.h"
#include "kvasir/dispatch_proto.h"
#include "kvasir/hub.h"
#include "kvasir/plan.h"
#include "kvasir/ring.h"
#include "kvtest.h"

#define MS 4   /* sites at most, in the random layouts */
#define ML 8   /* layers */
#define ME 4   /* experts */

typedef struct {
    uint32_t n_site, n_layer, n_expert;
    uint8_t moe[ML];
    uint8_t holds[MS][ML][ME];
} layout;

/* The library's view: holds packed as [n_site][n_layer][n_expert]. */
static kv_hub_site_layout kvt_lay(const layout *l) {
    static uint8_t packed[MS * ML * ME];
    size_t o = 0;
    for (uint32_t s = 0; s < l->n_site; s++)
        for (uint32_t L = 0; L < l->n_layer; L++)
            for (uint32_t e = 0; e < l->n_expert; e++) packed[o++] = l->holds[s][L][e];
    return (kv_hub_site_layout){.n_layer = l->n_layer, .n_expert = l->n_expert, .moe = l->moe, .n_site = l->n_site,
                                .holds = packed};
}

static void kvt_hold(layout *l, uint32_t s, uint32_t first, uint32_t last) { /* every expert of the layers */
    for (uint32_t L = first; L <= last; L++)
        for (uint32_t e = 0; e < l->n_expert; e++) l->holds[s][L][e] = 1;
}

static bool kvt_site_holds(const layout *l, uint32_t s, uint32_t L) {
    if (!l->moe[L]) return true;
    for (uint32_t e = 0; e < l->n_expert; e++)
        if (!l->holds[s][L][e]) return false;
    return true;
}

/* Checks the properties of a placement: windows consecutive from 0 to the
 * last layer, distinct sites, every expert of a window held in its site. */
static void kvt_valid(const layout *l, const kv_hub_site_window *w, uint32_t n) {
    uint32_t next = 0;
    bool used[MS] = {0};
    ASSERT_TRUE(n >= 1 && n <= l->n_site);
    for (uint32_t i = 0; i < n; i++) {
        ASSERT_EQ(w[i].first, next);
        ASSERT_TRUE(w[i].last >= w[i].first && w[i].site < l->n_site);
        ASSERT_TRUE(!used[w[i].site]);
        used[w[i].site] = true;
        for (uint32_t L = w[i].first; L <= w[i].last; L++) ASSERT_TRUE(kvt_site_holds(l, w[i].site, L));
        next = w[i].last + 1;
    }
    ASSERT_EQ(next, l->n_layer);
}

static void test_by_hand(void) {
    layout l = {.n_site = 2, .n_layer = 8, .n_expert = 4};
    memset(l.moe, 1, sizeof l.moe);
    kvt_hold(&l, 0, 0, 3); /* site 0: layers 0-3; site 1: layers 2-7 */
    kvt_hold(&l, 1, 2, 7);
    kv_hub_site_layout in = kvt_lay(&l);
    kv_hub_site_window w[MS];
    uint32_t n = 99;
    kv_diag d = {0};
    ASSERT_EQ(kv_hub_site_place(&in, w, &n, &d), 0);
    ASSERT_EQ(n, 2);
    ASSERT_TRUE(w[0].site == 0 && w[0].first == 0 && w[0].last == 3);
    ASSERT_TRUE(w[1].site == 1 && w[1].first == 4 && w[1].last == 7);
    kvt_valid(&l, w, n);
    /* one site holding everything takes the whole model: no crossing */
    kvt_hold(&l, 1, 0, 7);
    in = kvt_lay(&l);
    ASSERT_EQ(kv_hub_site_place(&in, w, &n, &d), 0);
    ASSERT_TRUE(n == 1 && w[0].site == 1 && w[0].first == 0 && w[0].last == 7);
    /* the fallback: site 1 lacks expert 2 of layer 6, site 0 never held it */
    memset(l.holds, 0, sizeof l.holds);
    kvt_hold(&l, 0, 0, 3);
    kvt_hold(&l, 1, 2, 7);
    l.holds[1][6][2] = 0;
    in = kvt_lay(&l);
    n = 99;
    ASSERT_EQ(kv_hub_site_place(&in, w, &n, &d), KV_ENOTFOUND);
    ASSERT_EQ(n, 0);
    ASSERT_TRUE(strstr(d.msg, "layer 6") != NULL);
    ASSERT_TRUE(strstr(d.msg, "lacks expert") != NULL);
    /* a dense layer (no routed experts) is held by any site: site 1 runs through it */
    l.moe[6] = 0;
    in = kvt_lay(&l);
    ASSERT_EQ(kv_hub_site_place(&in, w, &n, &d), 0);
    ASSERT_EQ(n, 2);
    kvt_valid(&l, w, n);
    /* no site at all */
    in.n_site = 0;
    ASSERT_EQ(kv_hub_site_place(&in, w, &n, &d), KV_ENOTFOUND);
    /* the furthest reach is a dead end: site 0 holds 0-4 and 7, site 1
     * 0-1, site 2 2-6. Site 0 first (0-4) leaves 7 to nobody; the search
     * backs off to 1 (0-1), 2 (2-6), 0 (7) */
    memset(l.holds, 0, sizeof l.holds);
    memset(l.moe, 1, sizeof l.moe);
    l.n_site = 3;
    kvt_hold(&l, 0, 0, 4);
    kvt_hold(&l, 0, 7, 7);
    kvt_hold(&l, 1, 0, 1);
    kvt_hold(&l, 2, 2, 6);
    in = kvt_lay(&l);
    ASSERT_EQ(kv_hub_site_place(&in, w, &n, &d), 0);
    kvt_valid(&l, w, n);
    ASSERT_EQ(n, 3);
    ASSERT_TRUE(w[0].site == 1 && w[0].last == 1 && w[1].site == 2 && w[1].last == 6 && w[2].site == 0);
}

/* The reference: does some sequence of distinct sites, each taking a run of
 * layers it holds, cover 0..n_layer-1? (every split point, every order) */
static bool kvt_exists(const layout *l, uint32_t p, bool *used) {
    if (p == l->n_layer) return true;
    for (uint32_t s = 0; s < l->n_site; s++) {
        if (used[s]) continue;
        used[s] = true;
        for (uint32_t e = p; e < l->n_layer && kvt_site_holds(l, s, e); e++)
            if (kvt_exists(l, e + 1, used)) {
                used[s] = false;
                return true;
            }
        used[s] = false;
    }
    return false;
}

static void test_vs_reference(void) {
    uint64_t seed = 12345;
    uint32_t found = 0, none = 0;
    for (int t = 0; t < 4000; t++) {
        layout l = {0};
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        l.n_site = 1 + (uint32_t)(seed >> 60) % MS;
        l.n_layer = 1 + (uint32_t)(seed >> 52) % ML;
        l.n_expert = 1 + (uint32_t)(seed >> 44) % ME;
        for (uint32_t L = 0; L < l.n_layer; L++) {
            seed = seed * 6364136223846793005ull + 1442695040888963407ull;
            l.moe[L] = (seed >> 58) % 5 != 0; /* one layer in five dense */
            for (uint32_t s = 0; s < l.n_site; s++)
                for (uint32_t e = 0; e < l.n_expert; e++) {
                    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
                    l.holds[s][L][e] = (seed >> 40) % 100 < 85;
                }
        }
        kv_hub_site_layout in = kvt_lay(&l);
        kv_hub_site_window w[MS];
        uint32_t n = 0;
        kv_diag d = {0};
        bool used[MS] = {0};
        const bool want = kvt_exists(&l, 0, used);
        const int rc = kv_hub_site_place(&in, w, &n, &d);
        ASSERT_EQ(rc == 0, want);
        if (rc == 0) {
            kvt_valid(&l, w, n);
            found++;
        } else {
            ASSERT_EQ(rc, KV_ENOTFOUND);
            ASSERT_TRUE(d.msg[0] != 0);
            none++;
        }
    }
    ASSERT_TRUE(found > 100 && none > 100); /* both outcomes exercised */
}

static void test_names(void) {
    char s[64];
    kv_hub_site_name("dc-1", 50, "10.0.0.1", "10.0.0.0/24", s, sizeof s);
    ASSERT_STREQ(s, "dc-1");
    kv_hub_site_name("", 1.0, "10.0.0.1", "10.0.0.0/24", s, sizeof s);
    ASSERT_STREQ(s, "auto:hub");
    kv_hub_site_name("", -1, "127.0.0.1", "127.0.0.0/24", s, sizeof s);
    ASSERT_STREQ(s, "auto:hub");
    kv_hub_site_name("", 40, "10.77.2.1", "10.77.2.0/24", s, sizeof s);
    ASSERT_STREQ(s, "auto:10.77.2.0/24");
    kv_hub_site_name("", -1, "10.77.2.1", "10.77.2.0/24", s, sizeof s); /* not measured: its LAN */
    ASSERT_STREQ(s, "auto:10.77.2.0/24");
    kv_diag d = {0};
    ASSERT_EQ(kv_hub_site_check("site-b.2", &d), 0);
    const char *bad[] = {"", "Site", "a b", "auto:hub", "-x", "0123456789012345678901234567890123", "\xc3\xa9"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) ASSERT_EQ(kv_hub_site_check(bad[i], &d), KV_EINVAL);
}

/* A manifest of 4 MoE layers of 4 experts, top-2, embd 64, a slab per layer. */
static kv_manifest *kvt_manifest(void) {
    char buf[8192];
    int o = snprintf(buf, sizeof buf,
                     "{\"format\":\"kvasir-slices\",\"version\":1,\"model\":{\"id\":\"%064d\",\"name\":\"t\",\"architecture\":"
                     "\"qwen3moe\"},\"hparams\":{\"n_layer\":4,\"n_embd\":64,\"n_expert\":4,\"n_expert_used\":2,"
                     "\"n_ff_exp\":64},\"layers\":{\"first\":0,\"last\":3,\"moe\":[0,1,2,3]},\"sparse\":false,"
                     "\"backbone\":{\"path\":\"backbone.gguf\",\"size\":100,\"sha256\":\"%064d\"},\"slabs\":[",
                     0, 0);
    for (int L = 0; L < 4; L++)
        o += snprintf(buf + o, sizeof buf - (size_t)o,
                      "%s{\"path\":\"experts/blk.%d.gguf\",\"size\":100,\"sha256\":\"%064d\",\"layer\":%d,\"first\":0,"
                      "\"last\":3}", L ? "," : "", L, 0, L);
    snprintf(buf + o, sizeof buf - (size_t)o, "]}");
    kv_manifest *m = NULL;
    kv_diag d = {0};
    if (kv_manifest_parse(&m, buf, strlen(buf), &d)) fprintf(stderr, "manifest: %s\n", d.msg);
    return m;
}

static void test_render_and_predict(void) {
    kv_manifest *m = kvt_manifest();
    ASSERT_TRUE(m != NULL);
    if (!m) return;
    /* site a (near the hub): workers a1 (layers 0-1), a2 (0-1 replica), ring node ra;
     * site b (40 ms): worker b1 (layers 2-3, and 0 too), ring node rb */
    static const uint32_t a_sl[] = {0, 1}, b_sl[] = {0, 2, 3};
    kv_hub_site_node nd[5];
    memset(nd, 0, sizeof nd);
    const char *names[] = {"a", "a", "b", "a", "b"};
    const double rtt[] = {0.2, 0.3, 40.2, -1, -1};
    for (int i = 0; i < 5; i++) {
        snprintf(nd[i].site, sizeof nd[i].site, "%s", names[i]);
        nd[i].given = true;
        nd[i].rtt_ms = rtt[i];
        nd[i].pk[0] = (uint8_t)(i + 1);
        snprintf(nd[i].addr, sizeof nd[i].addr, "10.0.%d.1:7300", i);
    }
    nd[0].slabs = a_sl, nd[0].n_slabs = 2;
    nd[1].slabs = a_sl, nd[1].n_slabs = 2;
    nd[2].slabs = b_sl, nd[2].n_slabs = 3;
    static const uint32_t ra_sl[] = {0, 1}, rb_sl[] = {2, 3};
    nd[3].ring = true, nd[3].slabs = ra_sl, nd[3].n_slabs = 2;
    nd[4].ring = true, nd[4].slabs = rb_sl, nd[4].n_slabs = 2;
    char *js = NULL;
    size_t len = 0;
    kv_diag d = {0};
    ASSERT_EQ(kv_hub_sites_render(m, nd, 5, &js, &len, &d), 0);
    /* the ring reads the windows: a takes 0-1 on a1, a2; b takes 2-3 on b1 */
    kv_ring_sites *rs = calloc(1, sizeof *rs);
    ASSERT_EQ(kv_ring_parse_sites(js, len, rs, &d), 0);
    ASSERT_TRUE(rs->placed && rs->n_win == 2);
    ASSERT_STREQ(rs->win[0].site, "a");
    ASSERT_TRUE(rs->win[0].first == 0 && rs->win[0].last == 1 && rs->win[0].n_workers == 2);
    ASSERT_STREQ(rs->win[0].ring, "10.0.3.1:7300");
    ASSERT_STREQ(rs->win[1].site, "b");
    ASSERT_TRUE(rs->win[1].first == 2 && rs->win[1].last == 3 && rs->win[1].n_workers == 1);
    ASSERT_STREQ(rs->win[1].workers[0], "10.0.2.1:7300");
    ASSERT_STREQ(rs->win[1].ring, "10.0.4.1:7300");
    /* the plan reads the sites: medians 0.25 (a) and 40.2 (b), at most 40.45 apart */
    kv_plan_sites *ps = NULL;
    ASSERT_EQ(kv_plan_sites_parse(js, len, 4, &ps, &d), 0);
    ASSERT_TRUE(ps && ps->n_site == 2 && ps->placed && ps->n_win == 2);
    ASSERT_NEAR(ps->rtt_ms[0], 0.25, 1e-9);
    ASSERT_NEAR(ps->between_ms[0][1], 40.45, 1e-9);
    /* a placement map of the workers (keys as the snapshot's) */
    char pl[4096], k[3][65];
    for (int i = 0; i < 3; i++) kv_hex(nd[i].pk, 32, k[i]);
    snprintf(pl, sizeof pl,
             "{\"shards\":[{\"layer\":0,\"first\":0,\"last\":3,\"nodes\":[{\"key\":\"%s\",\"addr\":\"10.0.0.1:7300\"},"
             "{\"key\":\"%s\",\"addr\":\"10.0.1.1:7300\"},{\"key\":\"%s\",\"addr\":\"10.0.2.1:7300\"}]},"
             "{\"layer\":1,\"first\":0,\"last\":3,\"nodes\":[{\"key\":\"%s\",\"addr\":\"10.0.0.1:7300\"}]},"
             "{\"layer\":2,\"first\":0,\"last\":3,\"nodes\":[{\"key\":\"%s\",\"addr\":\"10.0.2.1:7300\"}]},"
             "{\"layer\":3,\"first\":0,\"last\":3,\"nodes\":[{\"key\":\"%s\",\"addr\":\"10.0.2.1:7300\"}]}]}",
             k[0], k[1], k[2], k[0], k[2], k[2]);
    kv_plan *p = NULL;
    ASSERT_EQ(kv_plan_open(&p, m, pl, strlen(pl), &d), 0);
    kv_plan_prediction pr;
    const kv_plan_net net = {.lan_ms = 1.0, .from_site = -1};
    ASSERT_EQ(kv_plan_predict(p, ps, KV_ENC_F32, &net, &pr, &d), 0);
    /* per-layer from site a: layer 0 has a holder in b (40.45), layer 1 only
     * in a (1.0), layers 2-3 only in b (40.45 each) */
    ASSERT_EQ(pr.from_site, 0);
    ASSERT_EQ(pr.experts.crossings, 3);
    ASSERT_EQ(pr.experts.lan_round_trips, 1);
    ASSERT_NEAR(pr.experts_ms, 3 * 40.45 + 1.0, 1e-9);
    /* the ring of two sites: half of 40.45 each way, 4 LAN round trips */
    ASSERT_TRUE(pr.sites_ok);
    ASSERT_EQ(pr.sites.crossings, 2);
    ASSERT_NEAR(pr.sites_ms, 40.45 + 4 * 1.0, 1e-9);
    ASSERT_EQ(pr.sites.wan_bytes, 2 * (KV_RING_HEADER + kv_ring_hidden_size(1, 64)));
    /* the cost model: bytes at a link's rate, plus compute */
    kv_plan_cost c = {.wait_ms = 10, .wan_bytes = 125000, .bandwidth_mbit = 10, .compute_ms = 2};
    ASSERT_NEAR(kv_plan_cost_ms(&c), 10 + 100 + 2, 1e-9);
    c.bandwidth_mbit = 0;
    ASSERT_NEAR(kv_plan_cost_ms(&c), 12, 1e-9);
    kv_plan_free(p);
    kv_plan_sites_free(ps);
    free(js);
    /* site b loses expert 3 of layer 3: no placement, the reason named, in both readers */
    static const uint32_t b2[] = {0, 2};
    nd[2].slabs = b2, nd[2].n_slabs = 2;
    ASSERT_EQ(kv_hub_sites_render(m, nd, 5, &js, &len, &d), 0);
    ASSERT_EQ(kv_ring_parse_sites(js, len, rs, &d), 0);
    ASSERT_TRUE(!rs->placed && strstr(rs->reason, "layer 3") != NULL);
    ASSERT_EQ(kv_plan_sites_parse(js, len, 4, &ps, &d), 0);
    ASSERT_TRUE(!ps->placed && strstr(ps->reason, "layer 3") != NULL);
    kv_plan_sites_free(ps);
    free(js);
    free(rs);
    kv_manifest_free(m);
}

#define KVT_ANN "{\"nonce\":\"%064d\",\"addr\":\"10.0.0.1:7300\",\"memory\":1,\"backend\":\"x\"%s," \
                "\"shards\":[{\"layer\":0,\"first\":0,\"last\":1,\"sha256\":\"%064d\"}]}"

/* The announcement's site: optional, kept, serialized back, and bounded. */
static void test_announce(void) {
    char js[1024];
    kv_hub_announce a;
    kv_diag d = {0};
    snprintf(js, sizeof js, KVT_ANN, 0, "", 0);
    ASSERT_EQ(kv_hub_parse_announce(&a, js, strlen(js), &d), 0);
    ASSERT_STREQ(a.site, "");
    char *back = kv_hub_announce_json(&a);
    ASSERT_TRUE(back && !strstr(back, "\"site\""));
    free(back);
    kv_hub_announce_free(&a);
    snprintf(js, sizeof js, KVT_ANN, 0, ",\"site\":\"fra-1\"", 0);
    ASSERT_EQ(kv_hub_parse_announce(&a, js, strlen(js), &d), 0);
    ASSERT_STREQ(a.site, "fra-1");
    back = kv_hub_announce_json(&a);
    kv_hub_announce b;
    ASSERT_EQ(kv_hub_parse_announce(&b, back, strlen(back), &d), 0);
    ASSERT_STREQ(b.site, "fra-1");
    free(back);
    kv_hub_announce_free(&a);
    kv_hub_announce_free(&b);
    const char *bad[] = {",\"site\":\"\"", ",\"site\":\"Fra\"", ",\"site\":\"auto:hub\"", ",\"site\":7",
                         ",\"site\":\"0123456789abcdef0123456789abcdef\"", ",\"site\":\"-x\""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(js, sizeof js, KVT_ANN, 0, bad[i], 0);
        d = (kv_diag){0};
        ASSERT_EQ(kv_hub_parse_announce(&a, js, strlen(js), &d), KV_EFORMAT);
        ASSERT_TRUE(strstr(d.msg, "site") != NULL);
    }
}

static void test_malformed(void) {
    const char *bad[] = {
        "", "[]", "{\"sites\":{}}",
        "{\"sites\":[{\"name\":\"a\",\"rtt_ms\":-3}],\"round_trips\":[],\"placement\":{}}",
        "{\"sites\":[{\"name\":\"a\"},{\"name\":\"a\"}],\"round_trips\":[],\"placement\":{}}",
        "{\"sites\":[{\"name\":\"a\"}],\"round_trips\":[{\"a\":\"a\",\"b\":\"x\",\"rtt_ms_max\":1}],\"placement\":{}}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kv_plan_sites *s = (kv_plan_sites *)1;
        kv_diag d = {0};
        ASSERT_EQ(kv_plan_sites_parse(bad[i], strlen(bad[i]), 4, &s, &d), KV_EFORMAT);
        ASSERT_TRUE(s == NULL && d.msg[0]);
    }
    /* windows that skip a layer or repeat a site: no placement, said why */
    const char *gap = "{\"sites\":[{\"name\":\"a\"},{\"name\":\"b\"}],\"round_trips\":[],\"placement\":{\"kind\":\"sites\","
                      "\"windows\":[{\"site\":\"a\",\"first\":0,\"last\":1},{\"site\":\"b\",\"first\":3,\"last\":3}]}}";
    kv_plan_sites *s = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_plan_sites_parse(gap, strlen(gap), 4, &s, &d), 0);
    ASSERT_TRUE(s && !s->placed && s->reason[0]);
    kv_plan_sites_free(s);
    kv_plan_sites_free(NULL);
    kv_ring_sites *rs = calloc(1, sizeof *rs);
    const char *rbad[] = {
        "{}", "{\"n_layer\":4,\"placement\":{\"kind\":\"sites\",\"windows\":[]}}",
        "{\"n_layer\":4,\"placement\":{\"kind\":\"sites\",\"windows\":[{\"site\":\"a\",\"first\":0,\"last\":3,"
        "\"workers\":[{\"addr\":\"a b:1\"}],\"ring\":[]}]}}",
        "{\"n_layer\":4,\"placement\":{\"kind\":\"sites\",\"windows\":[{\"site\":\"a\",\"first\":0,\"last\":2,"
        "\"workers\":[],\"ring\":[]}]}}",
    };
    for (size_t i = 0; i < sizeof rbad / sizeof rbad[0]; i++) {
        d = (kv_diag){0};
        ASSERT_EQ(kv_ring_parse_sites(rbad[i], strlen(rbad[i]), rs, &d), KV_EFORMAT);
        ASSERT_TRUE(!rs->placed && d.msg[0]);
    }
    free(rs);
}

static const kvt_case cases[] = {KVT_CASE(test_by_hand), KVT_CASE(test_vs_reference), KVT_CASE(test_names),
                                 KVT_CASE(test_render_and_predict), KVT_CASE(test_announce),
                                 KVT_CASE(test_malformed)};
int main(int argc, char **argv) { return kvt_run(argc, argv, cases, KVT_N(cases)); }
