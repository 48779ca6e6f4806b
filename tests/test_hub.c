/* Hub tests: the real `kvasir hub` process on 127.0.0.1 port 0, driven
 * with libcurl and the client library (key files, signing, challenges).
 * kv-test-labels: net attack
 *
 * References are independent of the hub: pieces and ranges are compared
 * with the files read directly, the market with one recomputed naively
 * from the manifest and the nodes this test registered, and every refused
 * request is followed by a check that the hub's state (status, market,
 * placement) is byte-for-byte what it was. */
#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <math.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include <sodium.h>

#include "kvasir/dispatch_evidence.h"
#include "kvasir/dispatch_proto.h"
#include "kvasir/dispatch_worker.h"
#include "kvasir/hub.h"
#include "kvasir/ledger.h"
#include "kvasir/node.h"
#include "kvasir/slice.h"
#include "kvtest.h"

#define HUBT_DIR_TAG "hub"
#define HUBT_DB_TAG "kvh"
#include "hub_support.h"

static resp get_range(const hub_proc *p, const char *path, const char *range) {
    char url[1024], h[256];
    snprintf(url, sizeof url, "%s%s", p->url, path);
    snprintf(h, sizeof h, "Range: %s", range);
    const char *hs[] = {h, NULL};
    return http("GET", url, hs, NULL, 0);
}

/* status + market + placement: the observable state. */
static char *snapshot(const hub_proc *p) {
    resp a = get(p, "/v1/status"), b = get(p, "/v1/placement");
    /* the market has no timestamps, so it compares byte for byte */
    resp c = get(p, "/v1/market");
    size_t n = a.n + b.n + c.n + 4;
    char *s = malloc(n);
    snprintf(s, n, "%s|%s|%s", a.body, b.body, c.body);
    resp_free(&a);
    resp_free(&b);
    resp_free(&c);
    return s;
}

static unsigned char *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)sz + 1);
    *n = fread(b, 1, (size_t)sz, f);
    fclose(f);
    return b;
}

/* ---- cases: parsers and identity (no server) ------------------------------- */

static void test_range_parse(void) {
    struct {
        const char *h;
        uint64_t size;
        int rc;
        uint64_t off, len;
    } t[] = {
        {"bytes=0-9", 100, 0, 0, 10},        {"bytes=90-", 100, 0, 90, 10},
        {"bytes=-10", 100, 0, 90, 10},       {"bytes=-1000", 100, 0, 0, 100},
        {"bytes=50-500", 100, 0, 50, 50},    {"bytes=99-99", 100, 0, 99, 1},
        {"bytes=100-", 100, KV_ERANGE, 0, 0}, {"bytes=-0", 100, KV_ERANGE, 0, 0},
        {"bytes=5-4", 100, KV_EFORMAT, 0, 0}, {"bytes=0-1,5-6", 100, KV_EFORMAT, 0, 0},
        {"items=0-1", 100, KV_EFORMAT, 0, 0}, {"bytes=", 100, KV_EFORMAT, 0, 0},
        {"bytes=-", 100, KV_EFORMAT, 0, 0},   {"bytes=99999999999999999999-", 100, KV_EFORMAT, 0, 0},
        {"bytes=0-0", 0, KV_ERANGE, 0, 0},    {"bytes=1x-2", 100, KV_EFORMAT, 0, 0},
    };
    for (size_t i = 0; i < KVT_N(t); i++) {
        uint64_t off = 7, len = 7;
        kv_diag d = {0};
        int rc = kv_hub_parse_range(t[i].h, t[i].size, &off, &len, &d);
        ASSERT_EQ(rc, t[i].rc);
        if (!rc) {
            ASSERT_EQ(off, t[i].off);
            ASSERT_EQ(len, t[i].len);
        } else {
            ASSERT_TRUE(d.msg[0] != 0);
        }
    }
}

static void test_key_file(void) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/node1", g_dir);
    kv_node_key a, b;
    kv_diag d = {0};
    ASSERT_EQ(kv_node_key_load(&a, dir, false, &d), KV_ENOTFOUND);
    ASSERT_EQ(kv_node_key_load(&a, dir, true, &d), 0);
    ASSERT_EQ(kv_node_key_load(&b, dir, false, &d), 0);
    ASSERT_TRUE(!memcmp(a.pk, b.pk, 32) && !memcmp(a.sk, b.sk, 64));
    char path[600];
    snprintf(path, sizeof path, "%s/node.key", dir);
    struct stat st;
    ASSERT_EQ(stat(path, &st), 0);
    ASSERT_EQ(st.st_mode & 0777, 0600);
    /* a damaged file is refused and left as it is */
    FILE *f = fopen(path, "w");
    fputs("not a key\n", f);
    fclose(f);
    ASSERT_EQ(kv_node_key_load(&b, dir, true, &d), KV_EFORMAT);
    size_t n;
    unsigned char *s = read_file(path, &n);
    ASSERT_TRUE(s && n == 10 && !memcmp(s, "not a key\n", 10));
    free(s);
    /* signatures: verify accepts exactly what was signed */
    kv_hub_auth au;
    kv_hub_sign(&a, "POST", "/v1/heartbeat", "{}", 2, 42, &au);
    uint8_t pk[32], sg[64];
    uint64_t ctr;
    ASSERT_EQ(kv_hub_parse_auth(au.key, au.counter, au.sig, pk, &ctr, sg, &d), 0);
    ASSERT_EQ(ctr, 42);
    ASSERT_EQ(kv_hub_verify(pk, sg, "POST", "/v1/heartbeat", "{}", 2, 42), 0);
    ASSERT_EQ(kv_hub_verify(pk, sg, "POST", "/v1/heartbeat", "{}", 2, 43), KV_EPROTO);
    ASSERT_EQ(kv_hub_verify(pk, sg, "POST", "/v1/register", "{}", 2, 42), KV_EPROTO);
    ASSERT_EQ(kv_hub_verify(pk, sg, "POST", "/v1/heartbeat", "{ }", 3, 42), KV_EPROTO);
    ASSERT_EQ(kv_hub_parse_auth(au.key, "042", au.sig, pk, &ctr, sg, &d), KV_EPROTO);
    ASSERT_EQ(kv_hub_parse_auth(au.key, "0", au.sig, pk, &ctr, sg, &d), KV_EPROTO);
    ASSERT_EQ(kv_hub_parse_auth(au.key, "18446744073709551616", au.sig, pk, &ctr, sg, &d), KV_EPROTO);
    ASSERT_EQ(kv_hub_parse_auth(NULL, au.counter, au.sig, pk, &ctr, sg, &d), KV_EPROTO);
    uint64_t c1 = kv_node_next_counter(&a), c2 = kv_node_next_counter(&a);
    ASSERT_TRUE(c2 > c1);
}

/* ---- cases: serving --------------------------------------------------------- */

static void test_pieces_range(void) {
    char db[512];
    db_path(db, sizeof db, "pieces");
    hub_proc p;
    if (hub_start(&p, db, NULL)) {
        ASSERT_TRUE(0);
        return;
    }
    size_t mn;
    unsigned char *mf = read_file(g_manifest, &mn);
    resp r = get(&p, "/v1/manifest");
    ASSERT_EQ(r.status, 200);
    ASSERT_TRUE(mf && r.n == mn && !memcmp(r.body, mf, mn));
    resp_free(&r);
    free(mf);
    /* the backbone and one slab, whole and in ranges, against the files */
    const kv_manifest_file *files[2] = {&g_m->backbone, &g_m->slabs[g_m->n_slabs - 1].file};
    for (int fi = 0; fi < 2; fi++) {
        char fp[1024], up[600];
        snprintf(fp, sizeof fp, "%s/sl/%s", g_dir, files[fi]->path);
        snprintf(up, sizeof up, "/v1/pieces/%s", files[fi]->path);
        size_t n;
        unsigned char *b = read_file(fp, &n);
        ASSERT_TRUE(b && n == files[fi]->size);
        r = get(&p, up);
        ASSERT_EQ(r.status, 200);
        ASSERT_TRUE(r.n == n && !memcmp(r.body, b, n));
        resp_free(&r);
        {
            char url[1024];
            snprintf(url, sizeof url, "%s%s", p.url, up);
            r = http("HEAD", url, NULL, NULL, 0);
            ASSERT_EQ(r.status, 200);
            ASSERT_EQ(r.n, 0);
            resp_free(&r);
        }
        uint64_t offs[][2] = {{0, 0}, {1, 4096}, {n / 2, n - 1}, {n - 1, n - 1}};
        for (int k = 0; k < 4; k++) {
            char rg[96], want[128];
            snprintf(rg, sizeof rg, "bytes=%llu-%llu", (unsigned long long)offs[k][0], (unsigned long long)offs[k][1]);
            snprintf(want, sizeof want, "bytes %llu-%llu/%zu", (unsigned long long)offs[k][0],
                     (unsigned long long)offs[k][1], n);
            r = get_range(&p, up, rg);
            ASSERT_EQ(r.status, 206);
            ASSERT_STREQ(r.range, want);
            size_t len = (size_t)(offs[k][1] - offs[k][0] + 1);
            ASSERT_TRUE(r.n == len && !memcmp(r.body, b + offs[k][0], len));
            resp_free(&r);
        }
        /* resume: the rest from an offset, and a suffix */
        r = get_range(&p, up, "bytes=1000-");
        ASSERT_EQ(r.status, 206);
        ASSERT_TRUE(r.n == n - 1000 && !memcmp(r.body, b + 1000, n - 1000));
        resp_free(&r);
        r = get_range(&p, up, "bytes=-77");
        ASSERT_TRUE(r.status == 206 && r.n == 77 && !memcmp(r.body, b + n - 77, 77));
        resp_free(&r);
        char past[64];
        snprintf(past, sizeof past, "bytes=%zu-", n);
        r = get_range(&p, up, past);
        ASSERT_EQ(r.status, 416);
        ASSERT_TRUE(is_json_error(&r));
        resp_free(&r);
        r = get_range(&p, up, "bytes=0-1,4-5");
        ASSERT_EQ(r.status, 400);
        ASSERT_TRUE(is_json_error(&r));
        resp_free(&r);
        free(b);
    }
    /* paths that try to leave the folder, or name what the manifest does not */
    const char *bad[] = {"/v1/pieces/../h.db", "/v1/pieces/experts/../../m.gguf", "/v1/pieces//etc/passwd",
                         "/v1/pieces/./backbone.gguf", "/v1/pieces/experts/", "/v1/pieces/%2e%2e/m.gguf"};
    for (size_t i = 0; i < KVT_N(bad); i++) {
        r = get(&p, bad[i]);
        ASSERT_EQ(r.status, 400);
        ASSERT_TRUE(is_json_error(&r));
        resp_free(&r);
    }
    r = get(&p, "/v1/pieces/manifest.json.bak");
    ASSERT_EQ(r.status, 404);
    ASSERT_TRUE(is_json_error(&r));
    resp_free(&r);
    r = get(&p, "/v1/nope");
    ASSERT_EQ(r.status, 404);
    resp_free(&r);
    r = get(&p, "/v1/heartbeat");
    ASSERT_EQ(r.status, 405);
    resp_free(&r);
    ASSERT_EQ(hub_stop(&p), 0);
}

/* ---- cases: registry -------------------------------------------------------- */

/* The market recomputed from the manifest and what the test registered:
 * live[i] = number of live test nodes holding slab i. */
static void check_market(const hub_proc *p, const int *live, uint32_t wanted, uint64_t base) {
    resp r = get(p, "/v1/market");
    ASSERT_EQ(r.status, 200);
    kv_hub_market m;
    kv_diag d = {0};
    ASSERT_EQ(kv_hub_parse_market(&m, r.body, r.n, &d), 0);
    ASSERT_EQ(m.n_shards, g_m->n_slabs);
    int covered = 1;
    for (size_t i = 0; i < g_m->n_slabs; i++) covered &= live[i] > 0;
    ASSERT_EQ(m.covered, covered);
    int *seen = calloc(g_m->n_slabs, sizeof *seen);
    for (size_t k = 0; k < m.n_shards; k++) {
        const kv_hub_shard_view *s = &m.shards[k];
        size_t i = 0;
        while (i < g_m->n_slabs && !(g_m->slabs[i].layer == s->layer && g_m->slabs[i].first == s->first)) i++;
        ASSERT_TRUE(i < g_m->n_slabs);
        if (i == g_m->n_slabs) break;
        seen[i]++;
        ASSERT_EQ(s->last, g_m->slabs[i].last);
        ASSERT_EQ(s->bytes, g_m->slabs[i].file.size);
        ASSERT_EQ(s->wanted, wanted);
        ASSERT_EQ(s->live, live[i]);
        ASSERT_EQ(s->reward, base * wanted / (uint64_t)(live[i] + 1));
        if (k) { /* scarcest first */
            const kv_hub_shard_view *q = &m.shards[k - 1];
            ASSERT_TRUE((uint64_t)q->live * s->wanted <= (uint64_t)s->live * q->wanted);
        }
    }
    for (size_t i = 0; i < g_m->n_slabs; i++) ASSERT_EQ(seen[i], 1);
    free(seen);
    kv_hub_market_free(&m);
    resp_free(&r);
}

/* Nodes in placement for slab i, as "addr" strings joined by ','. */
static void placement_addrs(const hub_proc *p, size_t i, char *out, size_t cap) {
    out[0] = 0;
    resp r = get(p, "/v1/placement");
    json_t *j = json_loads(r.body, 0, NULL);
    json_t *sh = json_array_get(json_object_get(j, "shards"), i);
    ASSERT_EQ(json_integer_value(json_object_get(sh, "layer")), g_m->slabs[i].layer);
    ASSERT_EQ(json_integer_value(json_object_get(sh, "first")), g_m->slabs[i].first);
    json_t *nodes = json_object_get(sh, "nodes");
    for (size_t k = 0; k < json_array_size(nodes); k++) {
        const char *a = json_string_value(json_object_get(json_array_get(nodes, k), "addr"));
        size_t l = strlen(out);
        snprintf(out + l, cap - l, "%s%s", l ? "," : "", a ? a : "?");
    }
    json_decref(j);
    resp_free(&r);
}

static void test_register_market_placement(void) {
    char db[512];
    db_path(db, sizeof db, "market");
    hub_proc p;
    if (hub_start(&p, db, "--wanted 3 --reward 600")) {
        ASSERT_TRUE(0);
        return;
    }
    int live[64] = {0};
    check_market(&p, live, 3, 600);
    kv_node_key k[3];
    const int s0[] = {0, 1}, s1[] = {1, 2}, s2[] = {1};
    const int *sets[] = {s0, s1, s2};
    size_t ns[] = {2, 2, 1};
    for (int i = 0; i < 3; i++) {
        test_key(&k[i], 100 + i);
        char addr[32];
        snprintf(addr, sizeof addr, "127.0.0.1:%d", 9100 + i);
        char *reply = NULL;
        ASSERT_EQ(do_register(&p, &k[i], addr, sets[i], ns[i], &reply), 200);
        json_t *j = json_loads(reply, 0, NULL);
        ASSERT_TRUE(json_is_true(json_object_get(j, "ok")));
        ASSERT_TRUE(json_is_object(json_object_get(j, "challenge")));
        json_decref(j);
        free(reply);
        for (size_t q = 0; q < ns[i]; q++) live[sets[i][q]]++;
        check_market(&p, live, 3, 600);
    }
    char a[512];
    placement_addrs(&p, 1, a, sizeof a);
    ASSERT_STREQ(a, "127.0.0.1:9100,127.0.0.1:9101,127.0.0.1:9102");
    placement_addrs(&p, 3, a, sizeof a);
    ASSERT_STREQ(a, "");
    resp r = get(&p, "/v1/placement?layer=99");
    ASSERT_EQ(r.status, 400);
    resp_free(&r);
    /* heartbeats */
    r = post_signed(&p, &k[0], "/v1/heartbeat", "{}", kv_node_next_counter(&k[0]));
    ASSERT_EQ(r.status, 200);
    resp_free(&r);
    /* a node re-announcing replaces its holdings */
    const int s0b[] = {3};
    ASSERT_EQ(do_register(&p, &k[0], "127.0.0.1:9100", s0b, 1, NULL), 200);
    live[0]--;
    live[1]--;
    live[3]++;
    check_market(&p, live, 3, 600);
    /* kvasir market prints it: one line per shard plus two header lines */
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s' market --hub %s | wc -l", getenv("KV_BIN"), p.url);
    FILE *f = popen(cmd, "r");
    int lines = -1;
    if (f) {
        if (fscanf(f, "%d", &lines) != 1) lines = -1;
        pclose(f);
    }
    ASSERT_EQ(lines, (int)g_m->n_slabs + 2);
    snprintf(cmd, sizeof cmd, "'%s' market --hub %s --json", getenv("KV_BIN"), p.url);
    f = popen(cmd, "r");
    char buf[65536];
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) pclose(f);
    buf[n] = 0;
    kv_hub_market m;
    kv_diag d = {0};
    ASSERT_EQ(kv_hub_parse_market(&m, buf, n, &d), 0);
    ASSERT_EQ(m.n_shards, g_m->n_slabs);
    kv_hub_market_free(&m);
    ASSERT_EQ(hub_stop(&p), 0);
}

static void test_deadline(void) {
    char db[512];
    db_path(db, sizeof db, "deadline");
    hub_proc p;
    if (hub_start(&p, db, "--deadline-ms 3000")) {
        ASSERT_TRUE(0);
        return;
    }
    kv_node_key a, b;
    test_key(&a, 200);
    test_key(&b, 201);
    const int sa[] = {0, 1, 2, 3}, sb[] = {2};
    ASSERT_EQ(do_register(&p, &a, "127.0.0.1:9200", sa, 4, NULL), 200);
    int live[64] = {1, 1, 1, 1};
    check_market(&p, live, 2, 1000000);
    usleep(2000 * 1000);
    ASSERT_EQ(do_register(&p, &b, "127.0.0.1:9201", sb, 1, NULL), 200);
    usleep(1500 * 1000); /* a is now 3.5 s old: past the deadline; b is 1.5 s (1.5 s to spare) */
    int live2[64] = {0, 0, 1, 0};
    check_market(&p, live2, 2, 1000000);
    char ad[256];
    placement_addrs(&p, 2, ad, sizeof ad);
    ASSERT_STREQ(ad, "127.0.0.1:9201");
    /* a heartbeat brings a back */
    resp r = post_signed(&p, &a, "/v1/heartbeat", "{}", kv_node_next_counter(&a));
    ASSERT_EQ(r.status, 200);
    resp_free(&r);
    int live3[64] = {1, 1, 2, 1};
    check_market(&p, live3, 2, 1000000);
    ASSERT_EQ(hub_stop(&p), 0);
}

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Heartbeat bodies: the parser on good, truncated, out-of-range and
 * unknown input; then a hub turns two reports into the rates and totals
 * of GET /v1/nodes (bounded by the times the test measured around them),
 * refuses bad bodies with a 400 and keeps serving, and serves GET / as
 * the HTML status page. */
static void test_nodes_served(void) {
    kv_diag d = {0};
    kv_hub_beat b;
    ASSERT_EQ(kv_hub_parse_beat(&b, "", 0, &d), 0);
    ASSERT_TRUE(!b.has);
    ASSERT_EQ(kv_hub_parse_beat(&b, "{}", 2, &d), 0);
    ASSERT_TRUE(!b.has);
    const char *ok = "{\"served_pairs\":12,\"served_tokens\":3,\"later\":[1]}";
    ASSERT_EQ(kv_hub_parse_beat(&b, ok, strlen(ok), &d), 0);
    ASSERT_TRUE(b.has && b.served_pairs == 12 && b.served_tokens == 3);
    const char *bad[] = {"{\"served_pairs\":12", "{\"served_pairs\":12}", "{\"served_pairs\":-1,\"served_tokens\":0}",
                         "{\"served_pairs\":9007199254740993,\"served_tokens\":0}", "[]",
                         "{\"served_pairs\":1.5,\"served_tokens\":0}", "{\"served_pairs\":1,\"served_pairs\":2}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memset(&d, 0, sizeof d);
        b.has = true;
        if (kv_hub_parse_beat(&b, bad[i], strlen(bad[i]), &d) == 0 || b.has || !d.msg[0])
            KVT_FAIL("heartbeat body '%s' was accepted", bad[i]);
        kvt_checks++;
    }

    char db[512];
    db_path(db, sizeof db, "served");
    hub_proc p;
    if (hub_start(&p, db, NULL)) {
        ASSERT_TRUE(0);
        return;
    }
    kv_node_key a;
    test_key(&a, 300);
    const int sa[] = {0, 1};
    ASSERT_EQ(do_register(&p, &a, "127.0.0.1:9300", sa, 2, NULL), 200);
    const double t0 = mono_s();
    resp r = post_signed(&p, &a, "/v1/heartbeat", "{\"served_pairs\":100,\"served_tokens\":10}", kv_node_next_counter(&a));
    const double t1 = mono_s();
    ASSERT_EQ(r.status, 200);
    resp_free(&r);
    usleep(300 * 1000);
    const double t2 = mono_s();
    r = post_signed(&p, &a, "/v1/heartbeat", "{\"served_pairs\":700,\"served_tokens\":70}", kv_node_next_counter(&a));
    const double t3 = mono_s();
    ASSERT_EQ(r.status, 200);
    resp_free(&r);
    r = get(&p, "/v1/nodes");
    ASSERT_EQ(r.status, 200);
    json_t *j = json_loads(r.body, 0, NULL);
    json_t *n0 = json_array_get(json_object_get(j, "nodes"), 0);
    ASSERT_EQ(json_array_size(json_object_get(j, "nodes")), 1);
    ASSERT_EQ(json_integer_value(json_object_get(n0, "served_pairs")), 700);
    ASSERT_EQ(json_integer_value(json_object_get(n0, "served_tokens")), 70);
    ASSERT_TRUE(json_is_true(json_object_get(n0, "live")));
    ASSERT_EQ(json_array_size(json_object_get(n0, "shards")), 2);
    ASSERT_TRUE(json_object_get(n0, "earned_micro_kvr") == NULL); /* no ledger behind this hub */
    /* 600 computations between the reports, which the hub saw between
       t2 - t1 and t3 - t0 apart (ms clock: 2 ms of slack each way) */
    const double ps = json_number_value(json_object_get(n0, "pairs_per_s"));
    const double lo = 600 / (t3 - t0 + 0.002), hi = 600 / (t2 - t1 - 0.002);
    if (!(ps >= lo && ps <= hi)) KVT_FAIL("pairs_per_s %.3f outside [%.3f, %.3f]", ps, lo, hi);
    kvt_checks++;
    const double ts = json_number_value(json_object_get(n0, "tokens_per_s"));
    if (!(fabs(ts * 10 - ps) <= 0.02 * ps)) KVT_FAIL("tokens_per_s %.3f is not a tenth of %.3f", ts, ps);
    kvt_checks++;
    /* the swarm's tokens/s: computations / (MoE layers x experts used) */
    const double per_tok = (double)json_integer_value(json_object_get(j, "moe_layers")) *
                           (double)json_integer_value(json_object_get(j, "n_expert_used"));
    ASSERT_EQ(json_integer_value(json_object_get(j, "moe_layers")), (json_int_t)g_m->n_layer);
    const double sw = json_number_value(json_object_get(j, "tokens_per_s"));
    if (!(per_tok > 0 && fabs(sw - ps / per_tok) <= 0.002 + 1e-6 * ps)) KVT_FAIL("swarm tokens/s %.3f vs %.3f", sw, ps / per_tok);
    kvt_checks++;
    json_decref(j);
    resp_free(&r);
    /* totals that went down (a restarted node): no rate */
    r = post_signed(&p, &a, "/v1/heartbeat", "{\"served_pairs\":5,\"served_tokens\":1}", kv_node_next_counter(&a));
    ASSERT_EQ(r.status, 200);
    resp_free(&r);
    r = get(&p, "/v1/nodes");
    j = json_loads(r.body, 0, NULL);
    n0 = json_array_get(json_object_get(j, "nodes"), 0);
    ASSERT_EQ(json_integer_value(json_object_get(n0, "served_pairs")), 5);
    ASSERT_TRUE(json_number_value(json_object_get(n0, "pairs_per_s")) == 0);
    json_decref(j);
    resp_free(&r);
    /* bad bodies: 400 in the hub's error shape, state unchanged, still serving */
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        r = post_signed(&p, &a, "/v1/heartbeat", bad[i], kv_node_next_counter(&a));
        if (r.status != 400 || !is_json_error(&r)) KVT_FAIL("heartbeat '%s': status %ld", bad[i], r.status);
        kvt_checks++;
        resp_free(&r);
    }
    r = get(&p, "/v1/nodes");
    j = json_loads(r.body, 0, NULL);
    ASSERT_EQ(json_integer_value(json_object_get(json_array_get(json_object_get(j, "nodes"), 0), "served_pairs")), 5);
    json_decref(j);
    resp_free(&r);
    r = get(&p, "/");
    ASSERT_EQ(r.status, 200);
    ASSERT_TRUE(strstr(r.body, "<title>Kvasir hub</title>") != NULL);
    ASSERT_TRUE(strstr(r.body, "/v1/nodes") != NULL && strstr(r.body, "/v1/market") != NULL);
    resp_free(&r);
    ASSERT_EQ(hub_stop(&p), 0);
}

static void test_restart(void) {
    char db[512];
    db_path(db, sizeof db, "restart");
    hub_proc p;
    if (hub_start(&p, db, NULL)) {
        ASSERT_TRUE(0);
        return;
    }
    kv_node_key a;
    test_key(&a, 300);
    const int sa[] = {1, 3};
    ASSERT_EQ(do_register(&p, &a, "127.0.0.1:9300", sa, 2, NULL), 200);
    uint64_t ctr = kv_node_next_counter(&a);
    resp hb = post_signed(&p, &a, "/v1/heartbeat", "{}", ctr);
    ASSERT_EQ(hb.status, 200);
    resp_free(&hb);
    resp r = get(&p, "/v1/market");
    char *market_before = r.body;
    ASSERT_EQ(hub_stop(&p), 0);
    if (hub_start(&p, db, NULL)) {
        ASSERT_TRUE(0);
        free(market_before);
        return;
    }
    r = get(&p, "/v1/market");
    ASSERT_STREQ(r.body, market_before);
    resp_free(&r);
    free(market_before);
    int live[64] = {0, 1, 0, 1};
    check_market(&p, live, 2, 1000000);
    char ad[256];
    placement_addrs(&p, 3, ad, sizeof ad);
    ASSERT_STREQ(ad, "127.0.0.1:9300");
    /* the counter survived: the heartbeat captured before the restart is a replay */
    hb = post_signed(&p, &a, "/v1/heartbeat", "{}", ctr);
    ASSERT_EQ(hb.status, 409);
    ASSERT_TRUE(is_json_error(&hb));
    resp_free(&hb);
    hb = post_signed(&p, &a, "/v1/heartbeat", "{}", kv_node_next_counter(&a));
    ASSERT_EQ(hb.status, 200);
    resp_free(&hb);
    ASSERT_EQ(hub_stop(&p), 0);
}

/* ---- cases: bad input --------------------------------------------------------- */

/* Copies t with NONCE replaced by nonce and HASH by 64 'a's. */
static void subst(char *out, size_t cap, const char *t, const char *nonce) {
    size_t o = 0;
    while (*t && o + 65 < cap) {
        if (!strncmp(t, "NONCE", 5)) {
            o += (size_t)snprintf(out + o, cap - o, "%s", nonce);
            t += 5;
        } else if (!strncmp(t, "HASH", 4)) {
            memset(out + o, 'a', 64);
            o += 64;
            t += 4;
        } else {
            out[o++] = *t++;
        }
    }
    out[o] = 0;
}

static void test_bad_requests(void) {
    char db[512];
    db_path(db, sizeof db, "bad");
    hub_proc p;
    if (hub_start(&p, db, "--max-body 4096")) {
        ASSERT_TRUE(0);
        return;
    }
    kv_node_key a, evil;
    test_key(&a, 400);
    test_key(&evil, 401);
    const int sa[] = {0};
    ASSERT_EQ(do_register(&p, &a, "127.0.0.1:9400", sa, 1, NULL), 200);
    char *before = snapshot(&p);
    char url[400];
    snprintf(url, sizeof url, "%s/v1/heartbeat", p.url);

    /* unsigned */
    resp r = http("POST", url, NULL, "{}", 2);
    ASSERT_EQ(r.status, 401);
    ASSERT_TRUE(is_json_error(&r));
    resp_free(&r);
    /* forged: a's key with evil's signature */
    {
        kv_hub_auth au, ev;
        uint64_t c = kv_node_next_counter(&a);
        kv_hub_sign(&a, "POST", "/v1/heartbeat", "{}", 2, c, &au);
        kv_hub_sign(&evil, "POST", "/v1/heartbeat", "{}", 2, c, &ev);
        char h1[128], h2[64], h3[192];
        snprintf(h1, sizeof h1, "X-Kvasir-Key: %s", au.key);
        snprintf(h2, sizeof h2, "X-Kvasir-Counter: %s", au.counter);
        snprintf(h3, sizeof h3, "X-Kvasir-Signature: %s", ev.sig);
        const char *hs[] = {h1, h2, h3, NULL};
        r = http("POST", url, hs, "{}", 2);
        ASSERT_EQ(r.status, 401);
        ASSERT_TRUE(is_json_error(&r));
        resp_free(&r);
        /* a's real signature, but over another body */
        snprintf(h3, sizeof h3, "X-Kvasir-Signature: %s", au.sig);
        r = http("POST", url, hs, "{\"x\":1}", 7);
        ASSERT_EQ(r.status, 401);
        resp_free(&r);
        /* malformed headers */
        const char *hs2[] = {h1, "X-Kvasir-Counter: 12abc", h3, NULL};
        r = http("POST", url, hs2, "{}", 2);
        ASSERT_EQ(r.status, 401);
        ASSERT_TRUE(is_json_error(&r));
        resp_free(&r);
    }
    /* an unknown (but validly signed) node */
    r = post_signed(&p, &evil, "/v1/heartbeat", "{}", kv_node_next_counter(&evil));
    ASSERT_EQ(r.status, 404);
    ASSERT_TRUE(is_json_error(&r));
    resp_free(&r);
    char *mid = snapshot(&p);
    ASSERT_STREQ(mid, before);
    free(mid);

    /* replay: the same signed heartbeat twice; a lower counter */
    uint64_t c = kv_node_next_counter(&a);
    r = post_signed(&p, &a, "/v1/heartbeat", "{}", c);
    ASSERT_EQ(r.status, 200);
    resp_free(&r);
    free(before);
    before = snapshot(&p);
    r = post_signed(&p, &a, "/v1/heartbeat", "{}", c);
    ASSERT_EQ(r.status, 409);
    ASSERT_TRUE(is_json_error(&r));
    resp_free(&r);
    r = post_signed(&p, &a, "/v1/heartbeat", "{}", c - 1);
    ASSERT_EQ(r.status, 409);
    resp_free(&r);

    /* registration: replayed nonce, malformed, wrong hash, unknown shard */
    char *nonce = fresh_nonce(&p);
    kv_node_key b;
    test_key(&b, 402);
    char *body = announce_json(nonce, "127.0.0.1:9401", sa, 1, -1);
    uint64_t cb = kv_node_next_counter(&b);
    r = post_signed(&p, &b, "/v1/register", body, cb);
    ASSERT_EQ(r.status, 200);
    resp_free(&r);
    free(before);
    before = snapshot(&p);
    r = post_signed(&p, &b, "/v1/register", body, cb); /* exact replay */
    ASSERT_EQ(r.status, 409);
    ASSERT_TRUE(is_json_error(&r));
    resp_free(&r);
    r = post_signed(&p, &b, "/v1/register", body, kv_node_next_counter(&b)); /* nonce used */
    ASSERT_EQ(r.status, 409);
    resp_free(&r);
    free(body);
    free(nonce);
    kv_node_key c2;
    test_key(&c2, 403);
    nonce = fresh_nonce(&p);
    const int all[] = {0, 1, 2, 3};
    body = announce_json(nonce, "127.0.0.1:9402", all, 4, 2);
    r = post_signed(&p, &c2, "/v1/register", body, kv_node_next_counter(&c2));
    ASSERT_EQ(r.status, 422);
    ASSERT_TRUE(is_json_error(&r) && strstr(r.body, "sha256"));
    resp_free(&r);
    free(body);
    const char *malformed[] = {
        "{", "[]", "{\"nonce\":\"00\",\"addr\":\"h:1\",\"memory\":1,\"backend\":\"x\",\"shards\":[]}",
        "{\"nonce\":\"NONCE\",\"addr\":\"nohostport\",\"memory\":1,\"backend\":\"x\",\"shards\":[]}",
        "{\"nonce\":\"NONCE\",\"addr\":\"h:1\",\"memory\":-1,\"backend\":\"x\",\"shards\":[]}",
        "{\"nonce\":\"NONCE\",\"addr\":\"h:1\",\"memory\":1,\"backend\":\"x\",\"shards\":[{\"layer\":0}]}",
        "{\"nonce\":\"NONCE\",\"addr\":\"h\\\"x:1\",\"memory\":1,\"backend\":\"x\",\"shards\":[]}",
        "{\"nonce\":\"NONCE\",\"addr\":\"h:1\",\"memory\":1,\"backend\":\"x\",\"shards\":[]}",
        "{\"nonce\":\"NONCE\",\"addr\":\"h:1\",\"memory\":1,\"backend\":\"x\",\"shards\":[{\"layer\":99,\"first\":0,"
        "\"last\":3,\"sha256\":\"HASH\"}]}",
    };
    for (size_t i = 0; i < KVT_N(malformed); i++) {
        char js[1024];
        subst(js, sizeof js, malformed[i], nonce);
        r = post_signed(&p, &c2, "/v1/register", js, kv_node_next_counter(&c2));
        ASSERT_EQ(r.status, i + 2 >= KVT_N(malformed) ? 422 : 400);
        ASSERT_TRUE(is_json_error(&r));
        resp_free(&r);
    }
    free(nonce);
    /* oversized body: refused before it is read */
    char *big = malloc(8192);
    memset(big, ' ', 8191);
    big[0] = '{';
    big[8190] = '}';
    big[8191] = 0;
    r = post_signed(&p, &a, "/v1/heartbeat", big, kv_node_next_counter(&a));
    ASSERT_EQ(r.status, 413);
    ASSERT_TRUE(is_json_error(&r));
    resp_free(&r);
    /* the same without a Content-Length (chunked): refused once it passes the bound */
    {
        const char *hs[] = {"Transfer-Encoding: chunked", NULL};
        r = http("POST", url, hs, big, strlen(big));
        ASSERT_EQ(r.status, 413);
        ASSERT_TRUE(is_json_error(&r));
        resp_free(&r);
        char surl[400];
        snprintf(surl, sizeof surl, "%s/v1/status", p.url);
        r = http("GETBODY", surl, hs, big, strlen(big)); /* a GET with a body */
        ASSERT_EQ(r.status, 400);
        ASSERT_TRUE(is_json_error(&r));
        resp_free(&r);
    }
    free(big);
    /* nothing above changed state (the counters of refused requests included:
     * the next request with a counter just above the last accepted one works) */
    char *after = snapshot(&p);
    ASSERT_STREQ(after, before);
    free(after);
    free(before);
    r = post_signed(&p, &a, "/v1/heartbeat", "{}", c + 1);
    ASSERT_EQ(r.status, 200);
    resp_free(&r);
    /* still serving */
    r = get(&p, "/v1/status");
    ASSERT_EQ(r.status, 200);
    resp_free(&r);
    ASSERT_EQ(hub_stop(&p), 0);
}

/* ---- cases: storage challenge -------------------------------------------------- */

/* Answers the challenge in a register/heartbeat reply from the file at path
 * (the real slab, or a fake one). Returns the HTTP status of the answer. */
static long answer_challenge(const hub_proc *p, kv_node_key *k, const char *reply, const char *path_override) {
    json_t *j = json_loads(reply, 0, NULL);
    json_t *ch = json_object_get(j, "challenge");
    const char *nh = json_string_value(json_object_get(ch, "nonce"));
    const char *rel = json_string_value(json_object_get(ch, "path"));
    long st = -1;
    if (nh && rel) {
        uint8_t nonce[32];
        for (int i = 0; i < 32; i++) {
            unsigned x;
            sscanf(nh + 2 * i, "%2x", &x);
            nonce[i] = (uint8_t)x;
        }
        size_t i = 0;
        while (i < g_m->n_slabs && strcmp(g_m->slabs[i].file.path, rel)) i++;
        ASSERT_TRUE(i < g_m->n_slabs);
        /* the range is derived from the nonce: both sides agree on it */
        uint64_t off, len;
        kv_hub_challenge_range(nonce, g_m->slabs[i].file.size, &off, &len);
        ASSERT_EQ(off, json_integer_value(json_object_get(ch, "offset")));
        ASSERT_EQ(len, json_integer_value(json_object_get(ch, "length")));
        char path[1024];
        if (path_override) snprintf(path, sizeof path, "%s", path_override);
        else snprintf(path, sizeof path, "%s/sl/%s", g_dir, rel);
        uint8_t ans[32];
        kv_diag d = {0};
        ASSERT_EQ(kv_hub_challenge_answer(path, g_m->slabs[i].file.size, nonce, ans, &d), 0);
        char ah[65], body[200];
        kv_hex(ans, 32, ah);
        snprintf(body, sizeof body, "{\"nonce\":\"%s\",\"sha256\":\"%s\"}", nh, ah);
        resp r = post_signed(p, k, "/v1/challenge", body, kv_node_next_counter(k));
        st = r.status;
        if (st != 200) ASSERT_TRUE(is_json_error(&r));
        resp_free(&r);
    }
    json_decref(j);
    return st;
}

static void test_challenge(void) {
    char db[512];
    db_path(db, sizeof db, "challenge");
    hub_proc p;
    if (hub_start(&p, db, NULL)) {
        ASSERT_TRUE(0);
        return;
    }
    kv_node_key honest, liar;
    test_key(&honest, 500);
    test_key(&liar, 501);
    const int one[] = {2};
    char *reply = NULL;
    ASSERT_EQ(do_register(&p, &honest, "127.0.0.1:9500", one, 1, &reply), 200);
    ASSERT_EQ(answer_challenge(&p, &honest, reply, NULL), 200);
    /* the same answer again: no challenge is pending any more */
    ASSERT_EQ(answer_challenge(&p, &honest, reply, NULL), 409);
    free(reply);
    /* the liar announces the right hash but holds other bytes (same size) */
    char fake[600];
    snprintf(fake, sizeof fake, "%s/fake.gguf", g_dir);
    FILE *f = fopen(fake, "wb");
    for (uint64_t i = 0; i < g_m->slabs[2].file.size; i++) fputc((int)(i * 7 & 255), f);
    fclose(f);
    ASSERT_EQ(do_register(&p, &liar, "127.0.0.1:9501", one, 1, &reply), 200);
    int live[64] = {0, 0, 2, 0};
    check_market(&p, live, 2, 1000000);
    ASSERT_EQ(answer_challenge(&p, &liar, reply, fake), 422);
    free(reply);
    int live2[64] = {0, 0, 1, 0};
    check_market(&p, live2, 2, 1000000);
    char ad[256];
    placement_addrs(&p, 2, ad, sizeof ad);
    ASSERT_STREQ(ad, "127.0.0.1:9500");
    /* a malformed answer is refused and changes nothing */
    char *before = snapshot(&p);
    resp r = post_signed(&p, &honest, "/v1/challenge", "{\"nonce\":1}", kv_node_next_counter(&honest));
    ASSERT_EQ(r.status, 400);
    ASSERT_TRUE(is_json_error(&r));
    resp_free(&r);
    char *after = snapshot(&p);
    ASSERT_STREQ(after, before);
    free(after);
    free(before);
    ASSERT_EQ(hub_stop(&p), 0);
}

/* ---- cases: resources ------------------------------------------------------------ */

static int tcp_connect(const hub_proc *p) {
    unsigned port = 0;
    const char *c = strrchr(p->url, ':');
    if (c) port = (unsigned)atoi(c + 1);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* 1 if the peer closes fd within ms, 0 if it stays open. */
static int closed_within(int fd, int ms) {
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    if (poll(&pf, 1, ms) != 1) return 0;
    char b[256];
    return read(fd, b, sizeof b) <= 0;
}

static void test_connection_limits(void) {
    char db[512];
    db_path(db, sizeof db, "limits");
    hub_proc p;
    if (hub_start(&p, db, "--per-ip-conns 4 --timeout 1 --threads 1")) {
        ASSERT_TRUE(0);
        return;
    }
    int fds[5];
    for (int i = 0; i < 4; i++) fds[i] = tcp_connect(&p);
    usleep(100 * 1000);
    /* a fifth idle connection from the same address is refused at once */
    fds[4] = tcp_connect(&p);
    ASSERT_TRUE(fds[4] < 0 || closed_within(fds[4], 700));
    /* idle connections do not hold their slot past the timeout */
    for (int i = 0; i < 4; i++) ASSERT_EQ(closed_within(fds[i], 6000), 1);
    for (int i = 0; i < 5; i++)
        if (fds[i] >= 0) close(fds[i]);
    /* a request that starts a body and never finishes it is dropped too */
    int fd = tcp_connect(&p);
    const char *half = "POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{";
    ASSERT_TRUE(write(fd, half, strlen(half)) == (ssize_t)strlen(half));
    ASSERT_EQ(closed_within(fd, 6000), 1);
    close(fd);
    /* and the hub still serves (libmicrohttpd frees a closed connection's
     * per-IP slot on its next loop turn, so allow it a moment) */
    long st = 0;
    for (int i = 0; i < 20 && st != 200; i++) {
        if (i) usleep(100 * 1000);
        resp r = get(&p, "/v1/status");
        st = r.status;
        resp_free(&r);
    }
    ASSERT_EQ(st, 200);
    ASSERT_EQ(hub_stop(&p), 0);
}

/* A store belongs to one model: opening it for another fails, and the
 * store is left as it was (the first model's hub opens it again). */
static void test_store_of_other_model(void) {
    char db[512], cmd[2048], other[600];
    db_path(db, sizeof db, "model_a");
    hub_proc p;
    if (hub_start(&p, db, NULL)) {
        ASSERT_TRUE(0);
        return;
    }
    kv_node_key a;
    char kdir[600];
    snprintf(kdir, sizeof kdir, "%s/node_a", g_dir);
    kv_diag d = {0};
    ASSERT_EQ(kv_node_key_load(&a, kdir, true, &d), 0);
    const int sa[] = {0};
    ASSERT_EQ(do_register(&p, &a, "127.0.0.1:9600", sa, 1, NULL), 200);
    ASSERT_EQ(hub_stop(&p), 0);
    snprintf(other, sizeof other, "%s/other/manifest.json", g_dir);
    snprintf(cmd, sizeof cmd,
             "'%s' gen-model --preset tiny --type f16 --out '%s/o.gguf' >/dev/null 2>&1 && "
             "'%s' slice '%s/o.gguf' --out '%s/other' --experts-per-slab 4 >/dev/null 2>&1",
             getenv("KV_BIN"), g_dir, getenv("KV_BIN"), g_dir, g_dir);
    ASSERT_EQ(run_cmd(cmd), 0);
    snprintf(cmd, sizeof cmd, "'%s' hub --model '%s' --db '%s' --quiet 2>&1 | grep -q 'belongs to model'",
             getenv("KV_BIN"), other, db);
    ASSERT_EQ(run_cmd(cmd), 0);
    if (hub_start(&p, db, NULL)) {
        ASSERT_TRUE(0);
        return;
    }
    int live[64] = {1, 0, 0, 0};
    check_market(&p, live, 2, 1000000);
    ASSERT_EQ(hub_stop(&p), 0);
}

/* Challenges come with heartbeats too, and one left unanswered fails. */
static void test_challenge_schedule(void) {
    char db[512];
    db_path(db, sizeof db, "schedule");
    hub_proc p;
    if (hub_start(&p, db, "--challenge-every 2 --challenge-ttl-ms 1500")) {
        ASSERT_TRUE(0);
        return;
    }
    kv_node_key a, b;
    test_key(&a, 700);
    test_key(&b, 701);
    const int sa[] = {0, 3}, sb[] = {3};
    char *reply = NULL;
    ASSERT_EQ(do_register(&p, &a, "127.0.0.1:9700", sa, 2, &reply), 200);
    ASSERT_EQ(answer_challenge(&p, &a, reply, NULL), 200);
    free(reply);
    ASSERT_EQ(do_register(&p, &b, "127.0.0.1:9701", sb, 1, NULL), 200); /* b never answers */
    int live[64] = {1, 0, 0, 2};
    check_market(&p, live, 2, 1000000);
    /* a's second heartbeat carries a new challenge, and a answers it */
    resp r = post_signed(&p, &a, "/v1/heartbeat", "{}", kv_node_next_counter(&a));
    ASSERT_TRUE(r.status == 200 && !strstr(r.body, "challenge"));
    resp_free(&r);
    r = post_signed(&p, &a, "/v1/heartbeat", "{}", kv_node_next_counter(&a));
    ASSERT_TRUE(r.status == 200 && strstr(r.body, "\"challenge\""));
    ASSERT_EQ(answer_challenge(&p, &a, r.body, NULL), 200);
    resp_free(&r);
    usleep(1800 * 1000);
    /* b's next heartbeat finds its challenge expired: holdings dropped */
    r = post_signed(&p, &b, "/v1/heartbeat", "{}", kv_node_next_counter(&b));
    ASSERT_EQ(r.status, 200);
    ASSERT_TRUE(strstr(r.body, "\"dropped\"") != NULL);
    resp_free(&r);
    int live2[64] = {1, 0, 0, 1};
    check_market(&p, live2, 2, 1000000);
    ASSERT_EQ(hub_stop(&p), 0);
    /* the drop was stored */
    if (hub_start(&p, db, NULL)) {
        ASSERT_TRUE(0);
        return;
    }
    check_market(&p, live2, 2, 1000000);
    ASSERT_EQ(hub_stop(&p), 0);
}

/* The hub refuses to serve pieces whose bytes differ from the manifest
 * (it answers storage challenges from them). */
static void test_corrupt_piece(void) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "cp -r '%s/sl' '%s/bad' && printf 'X' | dd of='%s/bad/%s' bs=1 seek=1000 conv=notrunc 2>/dev/null && "
             "'%s' hub --model '%s/bad/manifest.json' --db '%s/bad.db' 2>&1 | grep -q 'does not match'",
             g_dir, g_dir, g_dir, g_m->slabs[1].file.path, getenv("KV_BIN"), g_dir, g_dir);
    ASSERT_EQ(run_cmd(cmd), 0);
}

static void test_market_cli_errors(void) {
    char cmd[1024];
    /* usage errors exit 1, a hub that cannot be reached exits 2, one line each */
    snprintf(cmd, sizeof cmd, "'%s' market 2>/dev/null", getenv("KV_BIN"));
    ASSERT_EQ(run_cmd(cmd), 1);
    snprintf(cmd, sizeof cmd, "'%s' market --hub http://127.0.0.1:1 --timeout-ms 2000 2>&1 >/dev/null | wc -l | grep -qx 1",
             getenv("KV_BIN"));
    ASSERT_EQ(run_cmd(cmd), 0);
    snprintf(cmd, sizeof cmd, "'%s' market --hub http://127.0.0.1:1 --timeout-ms 2000 2>/dev/null", getenv("KV_BIN"));
    ASSERT_EQ(run_cmd(cmd), 2);
    snprintf(cmd, sizeof cmd, "'%s' hub --model '%s' 2>/dev/null", getenv("KV_BIN"), g_manifest);
    ASSERT_EQ(run_cmd(cmd), 1);
    snprintf(cmd, sizeof cmd, "'%s' hub --model /nonexistent/manifest.json --db '%s/x.db' 2>/dev/null", getenv("KV_BIN"),
             g_dir);
    ASSERT_EQ(run_cmd(cmd), 2);
    snprintf(cmd, sizeof cmd, "'%s' hub --model '%s' --db '%s/y.db' --listen 127.0.0.1:99999 2>/dev/null",
             getenv("KV_BIN"), g_manifest, g_dir);
    ASSERT_EQ(run_cmd(cmd), 2);
}

/* ---- two hubs on one PostgreSQL store -------------------------------------------- */
/* A node registered at one hub is placed by the other; a nonce handed out
 * by one is good once at either; a signed request accepted by one is a
 * replay at the other; both publish the same market. */
static void test_two_hubs_one_store(void) {
    char db[512];
    db_path(db, sizeof db, "shared");
    hub_proc a, b;
    if (hub_start(&a, db, "--refresh-ms 100")) {
        ASSERT_TRUE(0);
        return;
    }
    if (hub_start(&b, db, "--refresh-ms 100")) {
        ASSERT_TRUE(0);
        hub_stop(&a);
        return;
    }
    resp st = get(&b, "/v1/status"), sa = get(&a, "/v1/status");
    ASSERT_TRUE(strstr(st.body, "\"store\":\"postgresql\"") != NULL);
    /* one hub key for the swarm: vouchers from either hub check alike */
    json_t *ja = json_loads(sa.body, 0, NULL), *jb = json_loads(st.body, 0, NULL);
    const char *ka = json_string_value(json_object_get(ja, "hub_key")), *kb = json_string_value(json_object_get(jb, "hub_key"));
    ASSERT_TRUE(ka && kb && !strcmp(ka, kb));
    json_decref(ja);
    json_decref(jb);
    resp_free(&st);
    resp_free(&sa);
    kv_node_key k, k2;
    test_key(&k, 700);
    test_key(&k2, 701);
    const int s0[] = {0, 2};
    /* a nonce from A, the registration at B */
    char *nonce = fresh_nonce(&a);
    ASSERT_TRUE(nonce != NULL);
    char *body = announce_json(nonce, "127.0.0.1:9700", s0, 2, -1);
    uint64_t c1 = kv_node_next_counter(&k);
    resp r = post_signed(&b, &k, "/v1/register", body, c1);
    ASSERT_EQ(r.status, 200);
    resp_free(&r);
    /* the same request replayed at A, and at B */
    r = post_signed(&a, &k, "/v1/register", body, c1);
    ASSERT_EQ(r.status, 409);
    ASSERT_TRUE(is_json_error(&r));
    resp_free(&r);
    r = post_signed(&b, &k, "/v1/register", body, c1);
    ASSERT_EQ(r.status, 409);
    resp_free(&r);
    /* the used nonce under a fresh counter, by another key, at A: refused */
    free(body);
    body = announce_json(nonce, "127.0.0.1:9701", s0, 2, -1);
    r = post_signed(&a, &k2, "/v1/register", body, kv_node_next_counter(&k2));
    ASSERT_EQ(r.status, 409);
    ASSERT_TRUE(r.body && strstr(r.body, "nonce") != NULL);
    resp_free(&r);
    free(body);
    free(nonce);
    /* a heartbeat at A (which never saw the registration) is accepted;
     * the same bytes at B are a replay */
    uint64_t c2 = kv_node_next_counter(&k);
    r = post_signed(&a, &k, "/v1/heartbeat", "{}", c2);
    ASSERT_EQ(r.status, 200);
    resp_free(&r);
    r = post_signed(&b, &k, "/v1/heartbeat", "{}", c2);
    ASSERT_EQ(r.status, 409);
    resp_free(&r);
    r = post_signed(&b, &k, "/v1/heartbeat", "{}", kv_node_next_counter(&k));
    ASSERT_EQ(r.status, 200);
    resp_free(&r);
    /* a second node at A; both hubs then publish one market and place both */
    const int s1[] = {1};
    ASSERT_EQ(do_register(&a, &k2, "127.0.0.1:9702", s1, 1, NULL), 200);
    usleep(250000); /* past both views' refresh_ms */
    int live[64] = {1, 1, 1};
    check_market(&a, live, 2, 1000000);
    check_market(&b, live, 2, 1000000);
    resp ma = get(&a, "/v1/market"), mb = get(&b, "/v1/market");
    ASSERT_STREQ(ma.body, mb.body);
    resp_free(&ma);
    resp_free(&mb);
    char ad[256];
    placement_addrs(&b, 1, ad, sizeof ad);
    ASSERT_STREQ(ad, "127.0.0.1:9702");
    placement_addrs(&a, 2, ad, sizeof ad);
    ASSERT_STREQ(ad, "127.0.0.1:9700");
    ASSERT_EQ(hub_stop(&a), 0);
    ASSERT_EQ(hub_stop(&b), 0);
}

static const kvt_case cases_pg[] = {KVT_CASE(test_two_hubs_one_store)};
/* The hub's key from GET /v1/status (parsed with the node's parser). */
static int status_key(const hub_proc *p, uint8_t out[32]) {
    resp r = get(p, "/v1/status");
    kv_diag d = {0};
    int rc = r.status == 200 ? kv_node_parse_hub_key(r.body, r.n, out, &d) : -1;
    resp_free(&r);
    return rc;
}

/* Vouchers: a listed key (--vouch-key) gets one signed by the hub's key
 * (checked with libsodium over the documented text), a stranger 403 EAUTH,
 * an unsigned or forged request 401; with --vouch-open anyone gets one.
 * The hub's key survives a restart (kept in the store). */
static void test_voucher(void) {
    char db[512];
    db_path(db, sizeof db, "voucher");
    kv_node_key c, x;
    test_key(&c, 700);
    test_key(&x, 701);
    char hex[65], extra[128];
    kv_hex(c.pk, 32, hex);
    snprintf(extra, sizeof extra, "--vouch-key %s --voucher-ttl-ms 5000", hex);
    hub_proc p;
    if (hub_start(&p, db, extra)) {
        ASSERT_TRUE(0);
        return;
    }
    uint8_t hk[32], hk2[32];
    ASSERT_EQ(status_key(&p, hk), 0);
    resp r = post_signed(&p, &c, "/v1/voucher", "{}", kv_node_next_counter(&c));
    ASSERT_EQ(r.status, 200);
    kv_voucher v;
    uint8_t rk[32];
    kv_diag d = {0};
    ASSERT_EQ(kv_node_parse_voucher(r.body, r.n, &v, rk, &d), 0);
    ASSERT_TRUE(!memcmp(rk, hk, 32) && !memcmp(v.key, c.pk, 32));
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    const int64_t now = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    ASSERT_TRUE((int64_t)v.expires_ms > now && (int64_t)v.expires_ms <= now + 5000 + 1000);
    /* the signed text, rebuilt here from docs/HUB.md */
    uint8_t e[8], dg[32];
    for (int i = 0; i < 8; i++) e[i] = (uint8_t)(v.expires_ms >> (8 * i));
    crypto_hash_sha256_state st;
    crypto_hash_sha256_init(&st);
    crypto_hash_sha256_update(&st, (const uint8_t *)"kvasir-voucher-v1\n", 18);
    crypto_hash_sha256_update(&st, (const uint8_t *)g_m->model_id, 64);
    crypto_hash_sha256_update(&st, c.pk, 32);
    crypto_hash_sha256_update(&st, e, 8);
    crypto_hash_sha256_final(&st, dg);
    ASSERT_EQ(crypto_sign_verify_detached(v.sig, dg, 32, hk), 0);
    resp_free(&r);
    /* a stranger, an unsigned request, a forged one */
    r = post_signed(&p, &x, "/v1/voucher", "{}", kv_node_next_counter(&x));
    ASSERT_TRUE(r.status == 403 && is_json_error(&r) && strstr(r.body, "EAUTH"));
    resp_free(&r);
    char url[1024];
    snprintf(url, sizeof url, "%s/v1/voucher", p.url);
    r = http("POST", url, NULL, "{}", 2);
    ASSERT_EQ(r.status, 401);
    resp_free(&r);
    r = post_signed(&p, &c, "/v1/voucher", "{\"x\":1}", 0); /* counter 0 is out of range */
    ASSERT_EQ(r.status, 401);
    resp_free(&r);
    ASSERT_EQ(hub_stop(&p), 0);
    /* open vouching; the same hub key after the restart */
    if (hub_start(&p, db, "--vouch-open")) {
        ASSERT_TRUE(0);
        return;
    }
    ASSERT_EQ(status_key(&p, hk2), 0);
    ASSERT_TRUE(!memcmp(hk, hk2, 32));
    r = post_signed(&p, &x, "/v1/voucher", "{}", kv_node_next_counter(&x));
    ASSERT_EQ(r.status, 200);
    ASSERT_EQ(kv_node_parse_voucher(r.body, r.n, &v, rk, &d), 0);
    ASSERT_TRUE(!memcmp(v.key, x.pk, 32));
    resp_free(&r);
    ASSERT_EQ(hub_stop(&p), 0);
}


/* Reports: a node registered, then reported by a vouched coordinator, is
 * no longer placed and may not register again; an unvouched reporter is
 * 403 and changes nothing; a malformed body is 400; an unknown node 404. */
static void report_with_evidence(const hub_proc *p, kv_node_key *c, kv_node_key *c2);

/* POST /v1/report: only vouched coordinators may report, a malformed or
 * unknown one is refused, and a report acts only on evidence: a bare one
 * changes nothing (422); then report_with_evidence. */
static void test_report(void) {
    char db[512];
    db_path(db, sizeof db, "report");
    kv_node_key c, x, n1, c2;
    test_key(&c, 710);
    test_key(&x, 711);
    test_key(&n1, 712);
    test_key(&c2, 713);
    char hex[65], extra[256], nhex[65], hex2[65];
    kv_hex(c.pk, 32, hex);
    kv_hex(n1.pk, 32, nhex);
    kv_hex(c2.pk, 32, hex2);
    snprintf(extra, sizeof extra, "--vouch-key %s --vouch-key %s", hex, hex2);
    hub_proc p;
    if (hub_start(&p, db, extra)) {
        ASSERT_TRUE(0);
        return;
    }
    const int sl[] = {0, 1};
    ASSERT_EQ(do_register(&p, &n1, "127.0.0.1:9712", sl, 2, NULL), 200);
    resp r = get(&p, "/v1/placement");
    ASSERT_TRUE(strstr(r.body, nhex) != NULL);
    resp_free(&r);
    char body[256];
    snprintf(body, sizeof body, "{\"key\":\"%s\",\"reason\":\"caught: gate product differs\"}", nhex);
    r = post_signed(&p, &x, "/v1/report", body, kv_node_next_counter(&x));
    ASSERT_TRUE(r.status == 403 && is_json_error(&r));
    resp_free(&r);
    r = get(&p, "/v1/placement");
    ASSERT_TRUE(strstr(r.body, nhex) != NULL); /* nothing changed */
    resp_free(&r);
    r = post_signed(&p, &c, "/v1/report", "{\"key\":\"zz\"}", kv_node_next_counter(&c));
    ASSERT_EQ(r.status, 400);
    resp_free(&r);
    char other[256];
    snprintf(other, sizeof other, "{\"key\":\"%064d\",\"reason\":\"x\"}", 7);
    r = post_signed(&p, &c, "/v1/report", other, kv_node_next_counter(&c));
    ASSERT_EQ(r.status, 404);
    resp_free(&r);
    /* a vouched coordinator's word alone: refused, nothing changes */
    r = post_signed(&p, &c, "/v1/report", body, kv_node_next_counter(&c));
    ASSERT_EQ(r.status, 422);
    ASSERT_TRUE(is_json_error(&r) && strstr(r.body, "evidence") && strstr(r.body, "\"action\":\"none\""));
    resp_free(&r);
    r = get(&p, "/v1/placement");
    ASSERT_TRUE(strstr(r.body, nhex) != NULL);
    resp_free(&r);
    ASSERT_EQ(do_register(&p, &n1, "127.0.0.1:9712", sl, 2, NULL), 200);
    report_with_evidence(&p, &c, &c2);
    ASSERT_EQ(hub_stop(&p), 0);
}

/* kvasir hub --ledger FILE: each node's earned_micro_kvr is its rewards in
 * the ledger (read independently here), 0 for a node never paid, and the
 * hub changes nothing in the ledger. */
static void test_ledger_earnings(void) {
    kv_diag d = {0};
    char db[512], ldb[600], extra[700];
    db_path(db, sizeof db, "earn");
    snprintf(ldb, sizeof ldb, "%s.ledger", db);
    kv_wallet op, c, na;
    kv_node_key a, b;
    test_key(&a, 500);
    test_key(&b, 501);
    memcpy(na.pk, a.pk, 32);
    memcpy(na.sk, a.sk, 64);
    ASSERT_EQ(kv_wallet_generate(&op, &d) | kv_wallet_generate(&c, &d), 0);
    ASSERT_EQ(kv_ledger_init(ldb, op.pk, 0, &d), 0);
    kv_ledger *l = NULL;
    ASSERT_EQ(kv_ledger_open(&l, ldb, &d), 0);
    if (!l) return;
    kv_issue is;
    ASSERT_EQ(kv_issue_sign(&is, &op, c.pk, 100000, NULL, &d), 0);
    ASSERT_EQ(kv_ledger_issue(l, &is, &d), 0);
    /* one completion paid to node a against its receipt */
    kv_auth au;
    ASSERT_EQ(kv_auth_sign(&au, &c, "gw-hub", 9000, (uint64_t)time(NULL) + 60, &d), 0);
    ASSERT_EQ(kv_ledger_escrow(l, &au, "gw-hub", (uint64_t)time(NULL), &d), 0);
    uint8_t dg[32] = {1, 2, 3};
    kv_receipt rc;
    ASSERT_EQ(kv_receipt_sign(&rc, &na, &au, 40, dg, &d), 0);
    kv_dispatch_entry e = {.n_products = 40};
    memcpy(e.node, a.pk, 32);
    memcpy(e.log_digest, dg, 32);
    kv_settle_req q = {.prompt_tokens = 11, .completion_tokens = 9, .price_prompt = 3, .price_completion = 7,
                       .log = &e, .n_log = 1, .receipts = &rc, .n_receipts = 1};
    memcpy(q.consumer, c.pk, 32);
    memcpy(q.nonce, au.nonce, 16);
    kv_settle_result res;
    ASSERT_EQ(kv_ledger_settle(l, &q, &res, &d), 0);
    char acct[KV_LEDGER_ACCOUNT_MAX];
    uint64_t bal = 0;
    kv_ledger_account_node(a.pk, acct);
    ASSERT_EQ(kv_ledger_balance(l, acct, &bal, &d), 0);
    ASSERT_EQ(bal, 11 * 3 + 9 * 7); /* no fee: the whole cost */
    kv_ledger_report before, after;
    ASSERT_EQ(kv_ledger_check(l, &before, &d), 0);
    hub_proc p;
    snprintf(extra, sizeof extra, "--ledger '%s'", ldb);
    if (hub_start(&p, db, extra)) {
        ASSERT_TRUE(0);
        kv_ledger_free(l);
        return;
    }
    const int sa[] = {0}, sb[] = {1};
    ASSERT_EQ(do_register(&p, &a, "127.0.0.1:9501", sa, 1, NULL), 200);
    ASSERT_EQ(do_register(&p, &b, "127.0.0.1:9502", sb, 1, NULL), 200);
    resp r = get(&p, "/v1/nodes");
    ASSERT_EQ(r.status, 200);
    json_t *j = json_loads(r.body, 0, NULL);
    json_t *nodes = json_object_get(j, "nodes");
    ASSERT_EQ(json_array_size(nodes), 2);
    char ha[65], hb[65];
    kv_hex(a.pk, 32, ha);
    kv_hex(b.pk, 32, hb);
    int seen = 0;
    for (size_t i = 0; i < json_array_size(nodes); i++) {
        json_t *n = json_array_get(nodes, i);
        const char *k = json_string_value(json_object_get(n, "key"));
        json_t *ej = json_object_get(n, "earned_micro_kvr");
        ASSERT_TRUE(k && json_is_integer(ej));
        if (k && !strcmp(k, ha)) {
            seen++;
            ASSERT_EQ(json_integer_value(ej), (long long)bal);
        }
        if (k && !strcmp(k, hb)) {
            seen++;
            ASSERT_EQ(json_integer_value(ej), 0);
        }
    }
    ASSERT_EQ(seen, 2);
    json_decref(j);
    resp_free(&r);
    ASSERT_EQ(hub_stop(&p), 0);
    ASSERT_EQ(kv_ledger_check(l, &after, &d), 0);
    ASSERT_EQ(after.n_transfers, before.n_transfers);
    kv_ledger_free(l);
}

/* ---- proof of service ----------------------------------------------------- */

/* A real worker in this process over the test's slices, with key i. */
typedef struct test_worker {
    kv_worker *w;
    pthread_t t;
    kv_node_key key;
} test_worker;

static void *worker_main(void *a) {
    kv_diag d = {0};
    kv_worker_serve(a, &d);
    return NULL;
}

static int worker_up(test_worker *tw, int key_i, const uint8_t hub_key[32], int lie) {
    char slabs[600];
    snprintf(slabs, sizeof slabs, "%s/sl", g_dir);
    test_key(&tw->key, key_i);
    kv_worker_opts o = {.slabs = slabs, .listen = "127.0.0.1:0", .n_threads = 1, .quiet = true,
                        .key_sk = tw->key.sk, .hub_key = hub_key, .test_lie = lie};
    kv_diag d = {0};
    if (kv_worker_open(&tw->w, &o, &d)) {
        fprintf(stderr, "worker: %s\n", d.msg);
        return -1;
    }
    return pthread_create(&tw->t, NULL, worker_main, tw->w);
}

static void worker_down(test_worker *tw) {
    if (!tw->w) return;
    kv_worker_stop(tw->w);
    pthread_join(tw->t, NULL);
    kv_worker_free(tw->w);
    tw->w = NULL;
}

static bool placed(const hub_proc *p, const kv_node_key *k, size_t i);

/* One authenticated COMPUTE to the worker at addr (which must prove wpk),
 * as coordinator c with voucher v: nt token rows x, np pairs. Returns the
 * RESULT frame (malloc'd, *m decoded into it) or NULL. */
static uint8_t *signed_compute(const char *addr, const uint8_t wpk[32], const kv_node_key *c, const kv_voucher *v,
                               uint16_t max_version, uint32_t layer, const float *x, uint32_t nt,
                               const kv_proto_pair *pairs, uint32_t np, kv_msg *m) {
    kv_diag d = {0};
    const uint32_t E = g_m->n_embd;
    const size_t cap = 1u << 20;
    uint8_t *rb = malloc(cap), *ob = malloc(cap);
    int fd = -1;
    kv_frame_rx rx;
    kv_frame_rx_init(&rx, rb, cap);
    size_t n = 0;
    int rc = kv_link_connect(addr, 2000, &fd, &d);
    kv_msg_hello h = {KV_PROTO_AUTH_VERSION, max_version, {0}, 1u << KV_ENC_F32};
    memcpy(h.model_id, g_m->model_id, KV_PROTO_MODEL_ID_LEN);
    if (!rc) rc = kv_msg_hello_encode(ob, cap, 1, &h, &n, &d) || kv_proto_write_all(fd, ob, n, 2000, &d) ||
                  kv_proto_read_msg(&rx, fd, 2000, NULL, m, &d) || m->h.type != KV_MSG_HELLO_ACK;
    const uint16_t ver = rc ? 0 : m->u.ack.version;
    ASSERT_EQ(ver, max_version);
    kv_frame_rx_reset(&rx);
    if (!rc) rc = kv_proto_read_msg(&rx, fd, 2000, NULL, m, &d) || m->h.type != KV_MSG_AUTH_CHALLENGE ||
                  memcmp(m->u.challenge.worker_key, wpk, 32);
    kv_msg_auth a = {.flags = KV_PROTO_AUTH_VOUCHER, .voucher_expires_ms = v->expires_ms};
    uint8_t dg[32];
    if (!rc) {
        memcpy(a.key, c->pk, 32);
        memcpy(a.voucher_sig, v->sig, 64);
        randombytes_buf(a.nonce, 32);
        kv_dispatch_digest('C', g_m->model_id, ver, wpk, m->u.challenge.challenge, a.key, a.nonce, dg);
        kv_link_sign(c->sk, dg, a.sig);
        rc = kv_msg_auth_encode(ob, cap, 2, &a, &n, &d);
        kv_frame_set_version(ob, ver);
        kv_frame_rx_reset(&rx);
        rc = rc || kv_proto_write_all(fd, ob, n, 2000, &d) || kv_proto_read_msg(&rx, fd, 2000, NULL, m, &d) ||
             m->h.type != KV_MSG_AUTH_OK;
    }
    const kv_msg_compute cm = {.layer = layer, .enc = KV_ENC_F32, .out_enc = KV_ENC_F32, .n_tokens = nt, .n_embd = E,
                               .n_pairs = np, .x = x, .pairs = pairs};
    if (!rc) {
        rc = kv_msg_compute_encode(ob, cap, 3, &cm, &n, &d);
        kv_frame_set_version(ob, ver);
        kv_frame_rx_reset(&rx);
        rc = rc || kv_proto_write_all(fd, ob, n, 2000, &d) || kv_proto_read_msg(&rx, fd, 5000, NULL, m, &d) ||
             m->h.type != KV_MSG_RESULT || m->u.result.n_pairs != np ||
             !m->u.result.sig != (ver < KV_PROTO_SIG_VERSION);
    }
    if (fd >= 0) close(fd);
    free(ob);
    if (rc) {
        fprintf(stderr, "signed_compute %s: %s (type %u)\n", addr, d.msg, m->h.type);
        free(rb);
        return NULL;
    }
    return rb;
}

/* The evidence of pair p of a signed RESULT for the COMPUTE above: its
 * rows, proof and signature, as a coordinator would keep them. */
static void make_evidence(kv_evidence *ev, const uint8_t wpk[32], const uint8_t cpk[32], uint32_t layer,
                          const uint8_t *xw, uint32_t nt, const kv_proto_pair *pairs, uint32_t np,
                          const kv_msg_result *res, uint32_t p) {
    const size_t rb = (size_t)g_m->n_embd * 4;
    uint8_t(*xh)[32] = malloc((size_t)nt * 32), (*lv)[32] = malloc((size_t)np * 32);
    for (uint32_t t = 0; t < nt; t++) kv_result_xhash(xw + t * rb, rb, xh[t]);
    for (uint32_t i = 0; i < np; i++) kv_result_leaf(xh[pairs[i].token], pairs[i].expert, res->y_wire + i * rb, rb, lv[i]);
    *ev = (kv_evidence){.layer = layer, .enc = KV_ENC_F32, .out_enc = KV_ENC_F32, .n_pairs = np, .pair = p,
                        .expert = pairs[p].expert, .n_embd = g_m->n_embd, .x = xw + pairs[p].token * rb,
                        .y = res->y_wire + p * rb};
    memcpy(ev->worker_key, wpk, 32);
    memcpy(ev->coord_key, cpk, 32);
    memcpy(ev->sig, res->sig, 64);
    ev->n_proof = kv_result_proof((const uint8_t(*)[32])lv, np, p, ev->proof);
    free(xh);
    free(lv);
}

/* Reports with evidence, against two real workers in this process (a v4
 * dispatch handshake and COMPUTE each, as coordinator c): the honest one
 * reported with its own signed, right answer: nothing changes; with a y it
 * never signed: 422, nothing changes. The liar (it computes another expert
 * than asked) reported with its signed answer by a vouched coordinator it
 * did not answer: 422; by the one it answered: unlisted, and it may not
 * register again. */
static void report_with_evidence(const hub_proc *p, kv_node_key *c, kv_node_key *c2) {
    kv_diag d = {0};
    uint8_t hk[32];
    kv_voucher v;
    ASSERT_EQ(kv_node_fetch_hub_key(p->url, hk, &d), 0);
    ASSERT_EQ(kv_node_fetch_auth(p->url, c, NULL, 0, NULL, &v, &d), 0);
    test_worker a = {0}, liar = {0};
    ASSERT_EQ(worker_up(&a, 720, hk, 0), 0);
    ASSERT_EQ(worker_up(&liar, 721, hk, KV_WORKER_LIE_SWAP), 0);
    const int sl[] = {0, 1};
    ASSERT_EQ(do_register(p, &a.key, kv_worker_addr(a.w), sl, 2, NULL), 200);
    ASSERT_EQ(do_register(p, &liar.key, kv_worker_addr(liar.w), sl, 2, NULL), 200);
    ASSERT_TRUE(placed(p, &a.key, 0) && placed(p, &liar.key, 0));
    /* 3 tokens, 5 pairs through slab 0's experts */
    const kv_manifest_slab *s0 = &g_m->slabs[0];
    const uint32_t E = g_m->n_embd, NT = 3, NP = 5, span = s0->last - s0->first + 1;
    float *x = malloc(sizeof(float) * E * NT);
    for (uint32_t i = 0; i < E * NT; i++) x[i] = sinf(0.37f * (float)i + 1.0f);
    uint8_t *xw = malloc((size_t)E * NT * 4);
    kv_msg_rows_put(xw, KV_ENC_F32, x, (size_t)E * NT);
    const kv_proto_pair pairs[5] = {{0, s0->first}, {1, s0->first + 1 % span}, {2, s0->first},
                                    {1, s0->first + 2 % span}, {0, s0->first + 3 % span}};
    kv_msg ma, ml;
    uint8_t *fa = signed_compute(kv_worker_addr(a.w), a.key.pk, c, &v, 4, s0->layer, x, NT, pairs, NP, &ma);
    uint8_t *fl = signed_compute(kv_worker_addr(liar.w), liar.key.pk, c, &v, 4, s0->layer, x, NT, pairs, NP, &ml);
    ASSERT_TRUE(fa && fl);
    /* a v3 coordinator is still served, unsigned, the same bytes */
    kv_msg m3;
    uint8_t *f3 = signed_compute(kv_worker_addr(a.w), a.key.pk, c, &v, 3, s0->layer, x, NT, pairs, NP, &m3);
    ASSERT_TRUE(f3 && fa && !m3.u.result.sig && !memcmp(m3.u.result.y_wire, ma.u.result.y_wire, (size_t)NP * E * 4));
    free(f3);
    if (fa && fl) {
        kv_evidence ev;
        bool unlisted = true;
        /* the honest worker, reported with the truth it signed */
        make_evidence(&ev, a.key.pk, c->pk, s0->layer, xw, NT, pairs, NP, &ma.u.result, 3);
        ASSERT_EQ(kv_evidence_check(&ev, g_m->model_id, &d), 0);
        ASSERT_EQ(kv_node_report(p->url, c, a.key.pk, "false report: a right answer", &ev, &unlisted, &d), 0);
        ASSERT_TRUE(!unlisted);
        ASSERT_TRUE(placed(p, &a.key, 0) && placed(p, &a.key, 1));
        /* ... and with a y it never signed (its y, one value moved) */
        uint8_t *y2 = malloc((size_t)E * 4);
        memcpy(y2, ev.y, (size_t)E * 4);
        float f;
        memcpy(&f, y2, 4);
        f = f * 2 + 1;
        memcpy(y2, &f, 4);
        ev.y = y2;
        ASSERT_EQ(kv_node_report(p->url, c, a.key.pk, "false report: a forged y", &ev, &unlisted, &d), KV_EINVAL);
        ASSERT_TRUE(strstr(d.msg, "422") && strstr(d.msg, "signature"));
        ASSERT_TRUE(placed(p, &a.key, 0) && placed(p, &a.key, 1));
        free(y2);
        /* the liar: its answer differs from the honest one's, signed */
        float *ya = malloc(sizeof(float) * E * 2), *yl = ya + E;
        kv_msg_result_row(&ma.u.result, 3, ya);
        kv_msg_result_row(&ml.u.result, 3, yl);
        ASSERT_TRUE(memcmp(ya, yl, E * sizeof(float)) != 0);
        free(ya);
        make_evidence(&ev, liar.key.pk, c->pk, s0->layer, xw, NT, pairs, NP, &ml.u.result, 3);
        ASSERT_EQ(kv_evidence_check(&ev, g_m->model_id, &d), 0);
        /* shown by another vouched coordinator: the answer was not signed for it */
        ASSERT_EQ(kv_node_report(p->url, c2, liar.key.pk, "someone else's evidence", &ev, &unlisted, &d), KV_EINVAL);
        ASSERT_TRUE(placed(p, &liar.key, 0));
        /* by the coordinator it answered: a confirmed lie */
        ASSERT_EQ(kv_node_report(p->url, c, liar.key.pk, "caught: another expert's answer", &ev, &unlisted, &d), 0);
        ASSERT_TRUE(unlisted);
        ASSERT_TRUE(!placed(p, &liar.key, 0) && !placed(p, &liar.key, 1));
        ASSERT_TRUE(placed(p, &a.key, 0));
        ASSERT_EQ(do_register(p, &liar.key, kv_worker_addr(liar.w), sl, 2, NULL), 403);
    }
    free(fa);
    free(fl);
    free(x);
    free(xw);
    worker_down(&a);
    worker_down(&liar);
}

/* Whether placement lists key k for slab i. */
static bool placed(const hub_proc *p, const kv_node_key *k, size_t i) {
    char hex[65];
    kv_hex(k->pk, 32, hex);
    resp r = get(p, "/v1/placement");
    json_t *j = json_loads(r.body, 0, NULL);
    json_t *nodes = json_object_get(json_array_get(json_object_get(j, "shards"), i), "nodes");
    bool hit = false;
    for (size_t n = 0; n < json_array_size(nodes) && !hit; n++)
        hit = !strcmp(json_string_value(json_object_get(json_array_get(nodes, n), "key")) ?: "", hex);
    json_decref(j);
    resp_free(&r);
    return hit;
}

/* Polls until placed(p, k, i) == want, at most ms; returns the last value. */
static bool wait_placed(const hub_proc *p, const kv_node_key *k, size_t i, bool want, int ms) {
    bool v = placed(p, k, i);
    for (int t = 0; t < ms && v != want; t += 50) {
        usleep(50000);
        v = placed(p, k, i);
    }
    return v;
}

/* Node k's field of GET /v1/nodes, as a new reference (NULL if absent). */
static json_t *node_field(const hub_proc *p, const kv_node_key *k, const char *field) {
    char hex[65];
    kv_hex(k->pk, 32, hex);
    resp r = get(p, "/v1/nodes");
    json_t *j = json_loads(r.body, 0, NULL), *out = NULL;
    json_t *nodes = json_object_get(j, "nodes");
    for (size_t n = 0; n < json_array_size(nodes) && !out; n++) {
        json_t *nd = json_array_get(nodes, n);
        if (!strcmp(json_string_value(json_object_get(nd, "key")) ?: "", hex)) out = json_incref(json_object_get(nd, field));
    }
    json_decref(j);
    resp_free(&r);
    return out;
}

static bool prove_error_has(const hub_proc *p, const kv_node_key *k, const char *what) {
    json_t *e = node_field(p, k, "prove_error");
    bool hit = e && strstr(json_string_value(e) ?: "", what);
    if (!hit) fprintf(stderr, "prove_error: '%s', wanted '%s'\n", e ? json_string_value(e) : "(none)", what);
    json_decref(e);
    return hit;
}

/* The placement's "nodes" of every shard, without last_seen_ms (which
 * heartbeats move): what a coordinator would dial. */
static char *placement_nodes(const hub_proc *p) {
    resp r = get(p, "/v1/placement");
    json_t *j = json_loads(r.body, 0, NULL);
    json_t *sh = json_object_get(j, "shards");
    for (size_t i = 0; i < json_array_size(sh); i++) {
        json_t *nodes = json_object_get(json_array_get(sh, i), "nodes");
        for (size_t n = 0; n < json_array_size(nodes); n++) json_object_del(json_array_get(nodes, n), "last_seen_ms");
    }
    char *out = json_dumps(sh, JSON_COMPACT);
    json_decref(j);
    resp_free(&r);
    return out;
}

/* A hub that proves nodes (no --trust-announced) on the store `name`, and
 * its key in hk: 0, or -1 when it did not start or answer. */
static int proving_hub_start(hub_proc *p, const char *name, const char *extra, uint8_t hk[32]) {
    char db[512];
    db_path(db, sizeof db, name);
    g_trust = false;
    int hs = hub_start(p, db, extra);
    g_trust = true;
    if (hs) return -1;
    kv_diag d = {0};
    if (kv_node_fetch_hub_key(p->url, hk, &d)) {
        hub_stop(p);
        return -1;
    }
    return 0;
}

/* A hub lists a node only once the worker at its address proved the
 * node's key and answered compute challenges for its slabs: an honest
 * worker is listed; a stranger's key at the honest worker's address (the
 * map one registration used to freeze), an address where nothing listens
 * and a worker that answers with another expert's output never are, and
 * the coordinator's view of the map keeps the honest worker under its own
 * key. A listed worker that stops answering is unlisted. Then strangers
 * register keys by the dozen (KV_ATTACK_FULL=1: a thousand) at the honest
 * address and at addresses of their own, claiming the honest node's slabs:
 * the placement and the market stay what they were, and the per-address
 * limit refuses the rest. */
static void test_prove(void) {
    hub_proc p;
    uint8_t hk[32];
    kv_diag d = {0};
    if (proving_hub_start(&p, "prove", "--prove-every-ms 300 --deadline-ms 600000 --max-per-host 8", hk)) {
        ASSERT_TRUE(0);
        return;
    }
    test_worker a = {0}, liar = {0};
    ASSERT_EQ(worker_up(&a, 800, hk, 0), 0);
    ASSERT_EQ(worker_up(&liar, 803, hk, KV_WORKER_LIE_SWAP), 0);
    const int sl[] = {0, 1}, sl2[] = {2, 3};
    ASSERT_EQ(do_register(&p, &a.key, kv_worker_addr(a.w), sl, 2, NULL), 200);
    ASSERT_TRUE(wait_placed(&p, &a.key, 0, true, 10000));
    ASSERT_TRUE(wait_placed(&p, &a.key, 1, true, 10000));
    json_t *ps = node_field(&p, &a.key, "proven_shards");
    ASSERT_EQ(json_integer_value(ps), 2);
    json_decref(ps);
    char *before = placement_nodes(&p);
    resp m0 = get(&p, "/v1/market");

    kv_node_key f1, f2;
    test_key(&f1, 801);
    test_key(&f2, 802);
    ASSERT_EQ(do_register(&p, &f1, kv_worker_addr(a.w), sl, 2, NULL), 200); /* a claim, not a listing */
    ASSERT_EQ(do_register(&p, &f2, "127.0.0.1:1", sl, 2, NULL), 200);
    ASSERT_EQ(do_register(&p, &liar.key, kv_worker_addr(liar.w), sl2, 2, NULL), 200);
    usleep(1500000);
    ASSERT_TRUE(!placed(&p, &f1, 0) && !placed(&p, &f1, 1));
    ASSERT_TRUE(!placed(&p, &f2, 0));
    ASSERT_TRUE(!placed(&p, &liar.key, 2) && !placed(&p, &liar.key, 3));
    ASSERT_TRUE(prove_error_has(&p, &f1, "another key"));
    ASSERT_TRUE(prove_error_has(&p, &f2, "key proof"));
    ASSERT_TRUE(prove_error_has(&p, &liar.key, "wrong answer"));
    ASSERT_TRUE(placed(&p, &a.key, 0) && placed(&p, &a.key, 1));
    /* a coordinator reads the map whole, the honest address under its own key */
    resp r = get(&p, "/v1/placement");
    char **w = NULL;
    uint32_t nw = 0;
    ASSERT_EQ(kv_node_parse_placement(r.body, r.n, &w, &nw, &d), 0);
    ASSERT_EQ(nw, 1);
    uint8_t keys[1][32];
    if (nw == 1) {
        ASSERT_EQ(kv_node_parse_placement_keys(r.body, r.n, w, nw, keys, &d), 0);
        ASSERT_TRUE(!memcmp(keys[0], a.key.pk, 32));
    }
    kv_node_workers_free(w, nw);
    resp_free(&r);
    /* challenged again and again at random times, and passing */
    usleep(1200000);
    json_t *cp = node_field(&p, &a.key, "challenges_passed");
    ASSERT_TRUE(json_integer_value(cp) > 2);
    json_decref(cp);

    /* strangers by the dozen: nothing a coordinator or a node reads moves */
    const char *full = getenv("KV_ATTACK_FULL");
    const int n_fake = full && *full == '1' ? 1000 : 40;
    int refused = 0, accepted = 0;
    for (int i = 0; i < n_fake; i++) {
        kv_node_key f;
        test_key(&f, 2000 + i);
        char addr[64];
        if (i % 2) snprintf(addr, sizeof addr, "%s", kv_worker_addr(a.w));
        else snprintf(addr, sizeof addr, "127.0.%d.%d:9", 1 + i / 250, 2 + i % 250);
        long st = do_register(&p, &f, addr, sl, 2, NULL);
        accepted += st == 200;
        refused += st == 429;
    }
    ASSERT_EQ(accepted + refused, n_fake);
    ASSERT_TRUE(refused > 0); /* the honest address holds at most 8 keys */
    usleep(1500000);
    char *after = placement_nodes(&p);
    ASSERT_STREQ(after, before);
    resp m1 = get(&p, "/v1/market");
    /* the shards as nodes read them (the registry's totals grew) */
    ASSERT_STREQ(strstr(m1.body, "\"shards\""), strstr(m0.body, "\"shards\""));
    resp_free(&m0);
    resp_free(&m1);
    free(before);
    free(after);

    /* a node that trades shards serves them from a new worker, a new port on
     * its host: its key signed the move and its replicas stay listed while
     * the hub proves the new address */
    test_worker a2 = {0};
    ASSERT_EQ(worker_up(&a2, 800, hk, 0), 0);
    ASSERT_EQ(do_register(&p, &a.key, kv_worker_addr(a2.w), sl, 2, NULL), 200);
    ASSERT_TRUE(placed(&p, &a.key, 0) && placed(&p, &a.key, 1));
    worker_down(&a);
    usleep(1200000);
    ASSERT_TRUE(placed(&p, &a.key, 0) && placed(&p, &a.key, 1));
    /* a listed worker that stops answering is unlisted */
    worker_down(&a2);
    ASSERT_TRUE(!wait_placed(&p, &a.key, 0, false, 5000));
    worker_down(&liar);
    ASSERT_EQ(hub_stop(&p), 0);
}

/* The market's live count of manifest slab i, from GET /v1/market. */
static int market_live(const hub_proc *p, size_t i) {
    kv_hub_market mk;
    resp r = get(p, "/v1/market");
    kv_diag d = {0};
    int live = -1;
    if (!kv_hub_parse_market(&mk, r.body, r.n, &d)) {
        for (size_t k = 0; k < mk.n_shards; k++)
            if (mk.shards[k].layer == g_m->slabs[i].layer && mk.shards[k].first == g_m->slabs[i].first)
                live = (int)mk.shards[k].live;
        kv_hub_market_free(&mk);
    }
    resp_free(&r);
    return live;
}

/* Newcomers weigh little until they are established: two honest nodes
 * hold slab 0 and are established (--trust-ms); two strangers who really
 * serve it (real workers, proven) register for it too, and the market
 * still counts 2 of 2, so the honest holders see no over-coverage and stay;
 * once the strangers have been proven for trust_ms themselves they count.
 * On a shard nobody established holds, newcomers count in full: three of
 * them on slab 1 show its over-coverage (3 of 2), so a young swarm still
 * rebalances. */
static void test_trust(void) {
    hub_proc p;
    uint8_t hk[32];
    if (proving_hub_start(&p, "trust", "--prove-every-ms 300 --trust-ms 2500 --deadline-ms 600000 --wanted 2", hk)) {
        ASSERT_TRUE(0);
        return;
    }
    test_worker w[5] = {{0}};
    for (int i = 0; i < 5; i++) ASSERT_EQ(worker_up(&w[i], 850 + i, hk, 0), 0);
    const int s0[] = {0}, s1[] = {1};
    ASSERT_EQ(do_register(&p, &w[0].key, kv_worker_addr(w[0].w), s0, 1, NULL), 200);
    ASSERT_EQ(do_register(&p, &w[1].key, kv_worker_addr(w[1].w), s0, 1, NULL), 200);
    ASSERT_TRUE(wait_placed(&p, &w[0].key, 0, true, 10000) && wait_placed(&p, &w[1].key, 0, true, 10000));
    ASSERT_EQ(market_live(&p, 0), 2);
    usleep(3000000); /* both established */
    ASSERT_EQ(do_register(&p, &w[2].key, kv_worker_addr(w[2].w), s0, 1, NULL), 200);
    ASSERT_EQ(do_register(&p, &w[3].key, kv_worker_addr(w[3].w), s0, 1, NULL), 200);
    ASSERT_TRUE(wait_placed(&p, &w[2].key, 0, true, 10000) && wait_placed(&p, &w[3].key, 0, true, 10000));
    ASSERT_EQ(market_live(&p, 0), 2); /* proven and serving, not yet weighing */
    /* three newcomers alone on slab 1: counted in full */
    for (int i = 2; i < 5; i++) {
        const int both[] = {0, 1};
        ASSERT_EQ(do_register(&p, &w[i].key, kv_worker_addr(w[i].w), i < 4 ? both : s1, i < 4 ? 2 : 1, NULL), 200);
    }
    for (int i = 2; i < 5; i++) ASSERT_TRUE(wait_placed(&p, &w[i].key, 1, true, 10000));
    ASSERT_EQ(market_live(&p, 1), 3);
    ASSERT_EQ(market_live(&p, 0), 2);
    /* established in their turn, the strangers on slab 0 count */
    int live = 0;
    for (int t = 0; t < 100 && (live = market_live(&p, 0)) != 4; t++) usleep(100000);
    ASSERT_EQ(live, 4);
    for (int i = 0; i < 5; i++) worker_down(&w[i]);
    ASSERT_EQ(hub_stop(&p), 0);
}

/* Registrations per address and per subnet are bounded (keys are free,
 * addresses are not), loopback hosts are each their own subnet, a name is
 * refused (the hub resolves none), and the market counts at most half the
 * wanted replicas of a shard from one subnet. The addresses are never
 * dialed: this hub lists what is announced. */
static void test_register_limits(void) {
    char db[512];
    db_path(db, sizeof db, "limits");
    hub_proc p;
    if (hub_start(&p, db, "--max-per-host 2 --max-per-subnet 3 --wanted 2")) {
        ASSERT_TRUE(0);
        return;
    }
    const int s0[] = {0}, s1[] = {1};
    kv_node_key k;
    int ki = 900;
    const struct { const char *addr; const int *sl; long want; } regs[] = {
        {"127.0.0.5:1000", s1, 200}, {"127.0.0.5:1001", s1, 200}, {"127.0.0.5:1002", s1, 429},
        {"127.0.0.6:1000", s1, 200}, {"10.77.0.1:4000", s0, 200}, {"10.77.0.2:4000", s0, 200},
        {"10.77.0.3:4000", s0, 200}, {"10.77.0.4:4000", s0, 429}, {"10.78.0.1:4000", s0, 200},
        {"hub.example:4000", s0, 422},
    };
    for (size_t i = 0; i < KVT_N(regs); i++) {
        test_key(&k, ki++);
        char *reply = NULL;
        long st = do_register(&p, &k, regs[i].addr, regs[i].sl, 1, &reply);
        if (st != regs[i].want) fprintf(stderr, "%s: %ld %s\n", regs[i].addr, st, reply);
        ASSERT_EQ(st, regs[i].want);
        free(reply);
    }
    kv_hub_market mk;
    resp r = get(&p, "/v1/market");
    kv_diag d = {0};
    ASSERT_EQ(kv_hub_parse_market(&mk, r.body, r.n, &d), 0);
    for (size_t i = 0; i < mk.n_shards; i++) {
        if (mk.shards[i].layer == g_m->slabs[0].layer && mk.shards[i].first == g_m->slabs[0].first)
            ASSERT_EQ(mk.shards[i].live, 2); /* one of 10.77.0.0/24's three, and 10.78.0.1 */
        if (mk.shards[i].layer == g_m->slabs[1].layer && mk.shards[i].first == g_m->slabs[1].first)
            ASSERT_EQ(mk.shards[i].live, 3); /* loopback hosts count each */
    }
    kv_hub_market_free(&mk);
    resp_free(&r);
    ASSERT_EQ(hub_stop(&p), 0);
}

static const kvt_case cases[] = {
    KVT_CASE(test_range_parse),   KVT_CASE(test_key_file),  KVT_CASE(test_pieces_range),
    KVT_CASE(test_register_market_placement), KVT_CASE(test_deadline), KVT_CASE(test_restart),
    KVT_CASE(test_nodes_served),
    KVT_CASE(test_bad_requests),  KVT_CASE(test_challenge), KVT_CASE(test_connection_limits),
    KVT_CASE(test_store_of_other_model), KVT_CASE(test_market_cli_errors),
    KVT_CASE(test_challenge_schedule), KVT_CASE(test_corrupt_piece), KVT_CASE(test_voucher), KVT_CASE(test_report),
    KVT_CASE(test_ledger_earnings), KVT_CASE(test_prove), KVT_CASE(test_trust),
    KVT_CASE(test_register_limits),
};

int main(int argc, char **argv) {
    /* on PostgreSQL every case, and those that need a shared store */
    static kvt_case all[KVT_N(cases) + KVT_N(cases_pg)];
    size_t n = 0;
    for (size_t i = 0; i < KVT_N(cases); i++) all[n++] = cases[i];
    if (getenv("KV_TEST_PG") && *getenv("KV_TEST_PG"))
        for (size_t i = 0; i < KVT_N(cases_pg); i++) all[n++] = cases_pg[i];
    return kvt_run_with(argc, argv, all, n, setup, teardown);
}
