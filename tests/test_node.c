/* Node unit tests: the shard choice against a naive reference and against
 * the properties it promises, and the budget size parser.
 * kv-test-labels: unit attack
 *
 * The reference is written from the rule in node.h, not from the code: it
 * keeps every last live replica, then repeatedly scans all shards for the
 * best one still open (smallest class, held, larger deficit, smaller tie,
 * smaller index) and takes it if it fits, O(n^2), no sorting. */
#include <stdarg.h>

#include "kvasir/hub.h"
#include "kvasir/node.h"
#include "kvtest.h"

static uint64_t rng = 88172645463325252ull;
static uint64_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

/* true if a ranks before b */
static int better(const kv_hub_shard_view *s, const uint8_t *held, uint64_t salt, size_t a, size_t b) {
    long long oa = (long long)s[a].live - held[a], ob = (long long)s[b].live - held[b];
    int ca = oa == 0 ? 0 : oa + 1 <= (long long)s[a].wanted ? 1 : 2;
    int cb = ob == 0 ? 0 : ob + 1 <= (long long)s[b].wanted ? 1 : 2;
    if (ca != cb) return ca < cb;
    if (held[a] != held[b]) return held[a] > held[b];
    long long da = (long long)s[a].wanted - oa, db = (long long)s[b].wanted - ob;
    if (da != db) return da > db;
    uint64_t ta = kv_node_tie(salt, s[a].layer, s[a].first), tb = kv_node_tie(salt, s[b].layer, s[b].first);
    if (ta != tb) return ta < tb;
    return a < b;
}

static uint64_t naive_choose(const kv_hub_shard_view *s, size_t n, uint64_t budget, const uint8_t *held,
                             uint64_t salt, uint8_t *take) {
    uint8_t seen[64] = {0};
    uint64_t used = 0;
    for (size_t i = 0; i < n; i++) {
        take[i] = 0;
        if (held[i] && s[i].live == held[i]) {
            take[i] = seen[i] = 1;
            used += s[i].bytes;
        }
    }
    for (;;) {
        size_t best = n;
        for (size_t i = 0; i < n; i++)
            if (!seen[i] && (best == n || better(s, held, salt, i, best))) best = i;
        if (best == n) break;
        seen[best] = 1;
        if (used + s[best].bytes <= budget) {
            take[best] = 1;
            used += s[best].bytes;
        }
    }
    return used;
}

static void random_market(kv_hub_shard_view *s, uint8_t *held, size_t n) {
    for (size_t i = 0; i < n; i++) {
        held[i] = rnd() % 3 == 0;
        uint32_t wanted = 1 + (uint32_t)(rnd() % 3);
        uint32_t live = held[i] + (uint32_t)(rnd() % 4);
        s[i] = (kv_hub_shard_view){(uint32_t)(i / 4), (uint32_t)(i % 4) * 2, (uint32_t)(i % 4) * 2 + 1,
                                   1000 + rnd() % 4 * 500, wanted, live, 0, 0, 0};
    }
}

static void test_choose_vs_naive(void) {
    kv_hub_shard_view s[64];
    uint8_t held[64], a[64], b[64];
    int mismatches = 0;
    for (int it = 0; it < 5000; it++) {
        size_t n = 1 + rnd() % 40;
        random_market(s, held, n);
        uint64_t budget = rnd() % 20000, salt = rnd(), ab = 0;
        kv_diag d = {0};
        ASSERT_EQ(kv_node_choose(s, n, budget, held, salt, a, &ab, &d), 0);
        uint64_t bb = naive_choose(s, n, budget, held, salt, b);
        if (ab != bb || memcmp(a, b, n)) mismatches++;
        /* properties, independent of both */
        uint64_t forced = 0, sum = 0;
        for (size_t i = 0; i < n; i++) {
            if (held[i] && s[i].live == 1) {
                ASSERT_TRUE(a[i]); /* the last live replica is kept */
                forced += s[i].bytes;
            }
            if (a[i]) sum += s[i].bytes;
        }
        ASSERT_EQ(sum, ab);
        ASSERT_TRUE(sum <= (budget > forced ? budget : forced));
        /* an uncovered shard that would fit in the room a chosen third
         * replica takes is never left for it */
        for (size_t i = 0; i < n; i++) {
            if (a[i] || held[i] || s[i].live != 0) continue;
            for (size_t j = 0; j < n; j++) {
                long long oj = (long long)s[j].live - held[j];
                if (sum <= budget && a[j] && oj + 1 > (long long)s[j].wanted && oj > 0) {
                    ASSERT_TRUE(s[i].bytes > budget - sum + s[j].bytes);
                }
            }
        }
    }
    ASSERT_EQ(mismatches, 0);
}

/* The cases the rule names, by hand. */
static void test_choose_cases(void) {
    kv_diag d = {0};
    uint64_t bytes;
    uint8_t take[4];
    /* a third replica of a covered shard vs an uncovered one, room for one */
    kv_hub_shard_view s1[2] = {{0, 0, 1, 100, 2, 2, 0, 0, 0}, {0, 2, 3, 100, 2, 0, 0, 0, 0}};
    uint8_t h1[2] = {0, 0};
    ASSERT_EQ(kv_node_choose(s1, 2, 150, h1, 7, take, &bytes, &d), 0);
    ASSERT_EQ(take[0], 0);
    ASSERT_EQ(take[1], 1);
    /* a held third replica yields to an uncovered shard */
    kv_hub_shard_view s2[2] = {{0, 0, 1, 100, 2, 3, 0, 0, 0}, {0, 2, 3, 100, 2, 0, 0, 0, 0}};
    uint8_t h2[2] = {1, 0};
    ASSERT_EQ(kv_node_choose(s2, 2, 150, h2, 7, take, &bytes, &d), 0);
    ASSERT_EQ(take[0], 0);
    ASSERT_EQ(take[1], 1);
    /* the last live replica is kept even over a smaller budget */
    kv_hub_shard_view s3[2] = {{0, 0, 1, 100, 2, 1, 0, 0, 0}, {0, 2, 3, 100, 2, 0, 0, 0, 0}};
    uint8_t h3[2] = {1, 0};
    ASSERT_EQ(kv_node_choose(s3, 2, 50, h3, 7, take, &bytes, &d), 0);
    ASSERT_EQ(take[0], 1);
    ASSERT_EQ(take[1], 0);
    ASSERT_EQ(bytes, 100);
    /* a held wanted replica is not traded for an equal one */
    kv_hub_shard_view s4[2] = {{0, 0, 1, 100, 2, 2, 0, 0, 0}, {0, 2, 3, 100, 2, 1, 0, 0, 0}};
    uint8_t h4[2] = {1, 0};
    ASSERT_EQ(kv_node_choose(s4, 2, 100, h4, 7, take, &bytes, &d), 0);
    ASSERT_EQ(take[0], 1);
    ASSERT_EQ(take[1], 0);
    /* nothing fits */
    ASSERT_EQ(kv_node_choose(s1, 2, 99, h1, 7, take, &bytes, &d), 0);
    ASSERT_EQ(bytes, 0);
}

static void test_parse_size(void) {
    kv_diag d = {0};
    uint64_t v;
    ASSERT_EQ(kv_node_parse_size("12345", &v, &d), 0);
    ASSERT_EQ(v, 12345);
    ASSERT_EQ(kv_node_parse_size("8K", &v, &d), 0);
    ASSERT_EQ(v, 8192);
    ASSERT_EQ(kv_node_parse_size("3m", &v, &d), 0);
    ASSERT_EQ(v, 3u << 20);
    ASSERT_EQ(kv_node_parse_size("2G", &v, &d), 0);
    ASSERT_EQ(v, 2ull << 30);
    ASSERT_EQ(kv_node_parse_size("1T", &v, &d), 0);
    ASSERT_EQ(v, 1ull << 40);
    ASSERT_EQ(kv_node_parse_size("4GiB", &v, &d), 0);
    ASSERT_EQ(v, 4ull << 30);
    const char *bad[] = {"", "G", "-1", "1.5G", "1X", "1GG", "99999999999999999999", "20000000000G", " 1", "1 "};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ASSERT_EQ(kv_node_parse_size(bad[i], &v, &d), KV_EINVAL);
        ASSERT_EQ(v, 0);
    }
}

static void test_piece_path(void) {
    kv_diag d = {0};
    char p[64];
    ASSERT_EQ(kv_node_piece_path("D", "experts/a.gguf", p, sizeof p, &d), 0);
    ASSERT_STREQ(p, "D/pieces/experts/a.gguf");
    ASSERT_EQ(kv_node_piece_path("D", "../x", p, sizeof p, &d), KV_EINVAL);
    ASSERT_EQ(kv_node_piece_path("D", "/etc/passwd", p, sizeof p, &d), KV_EINVAL);
    ASSERT_EQ(kv_node_piece_path("D", "", p, sizeof p, &d), KV_EINVAL);
}

static void test_parse_placement(void) {
    kv_diag d = {0};
    char **w = NULL;
    uint32_t n = 0;
    const char *ok = "{\"shards\":[{\"layer\":0,\"nodes\":[{\"addr\":\"127.0.0.1:7\"},{\"addr\":\"[::1]:8\"}]},"
                     "{\"layer\":1,\"nodes\":[{\"addr\":\"[::1]:8\"},{\"addr\":\"h-2.example:9\"}]}]}";
    ASSERT_EQ(kv_node_parse_placement(ok, strlen(ok), &w, &n, &d), 0);
    ASSERT_EQ(n, 3);
    if (n == 3) {
        ASSERT_STREQ(w[0], "127.0.0.1:7");
        ASSERT_STREQ(w[1], "[::1]:8");
        ASSERT_STREQ(w[2], "h-2.example:9");
    }
    kv_node_workers_free(w, n);
    const char *bad[] = {"", "[]", "{\"shards\":{}}", "{\"shards\":[{\"nodes\":{}}]}",
                         "{\"shards\":[{\"nodes\":[{\"addr\":\"a b:1\"}]}]}",
                         "{\"shards\":[{\"nodes\":[{\"addr\":\"\"}]}]}",
                         "{\"shards\":[{\"nodes\":[{\"addr\":7}]}]}",
                         "{\"shards\":[{\"nodes\":[{\"addr\":\"x\\\"y:1\"}]}]}",
                         "{\"shards\":[{\"nodes\":[{\"addr\":\"h:1\"}]}]"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        w = (char **)1;
        n = 7;
        d.msg[0] = 0;
        ASSERT_TRUE(kv_node_parse_placement(bad[i], strlen(bad[i]), &w, &n, &d) < 0);
        ASSERT_TRUE(w == NULL && n == 0 && d.msg[0]);
    }
}

/* A growable string for building maps. */
typedef struct sbuf {
    char *p;
    size_t n, cap;
} sbuf;
static void sb_add(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_add(sbuf *b, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        const int k = vsnprintf(b->p ? b->p + b->n : NULL, b->p ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (b->p && (size_t)k < b->cap - b->n) {
            b->n += (size_t)k;
            return;
        }
        b->cap = 2 * (b->cap + (size_t)k + 64);
        b->p = realloc(b->p, b->cap);
    }
}

static void key_hex(uint32_t id, char out[65]) { /* a distinct key per id */
    snprintf(out, 65, "%08x", id + 1); /* the first 8 digits name the id */
    memset(out + 8, 'a', 56);
    out[64] = 0;
}

/* One entry can only be skipped, never break the map: an address listed
 * with two keys is dropped (under both), an invalid address or key is
 * skipped, and every other worker is kept with its key. Before, each of
 * these made kv_node_parse_placement(_keys) refuse the whole map. */
static void test_placement_one_bad_entry(void) {
    char k1[65], k2[65], k3[65], kx[65];
    key_hex(1, k1), key_hex(2, k2), key_hex(3, k3), key_hex(99, kx);
    char map[2048];
    snprintf(map, sizeof map,
             "{\"shards\":[{\"layer\":0,\"first\":0,\"last\":3,\"nodes\":[{\"key\":\"%s\",\"addr\":\"10.0.0.1:7001\"},"
             "{\"key\":\"%s\",\"addr\":\"10.0.0.2:7002\"},{\"key\":\"%s\",\"addr\":\"bad addr:1\"},"
             "{\"key\":\"%s\",\"addr\":\"10.0.0.9:0\"},{\"key\":\"%s\",\"addr\":\"noport\"}]},"
             "{\"layer\":0,\"first\":4,\"last\":7,\"nodes\":[{\"key\":\"%s\",\"addr\":\"10.0.0.3:7003\"},"
             "{\"key\":\"%s\",\"addr\":\"10.0.0.2:7002\"},{\"addr\":7}]},{\"layer\":1,\"nodes\":{}}]}",
             k1, k2, kx, kx, kx, k3, kx); /* kx claims 10.0.0.2:7002, which k2 holds */
    kv_diag d = {0};
    char **w = NULL;
    uint32_t n = 0;
    ASSERT_EQ(kv_node_parse_placement(map, strlen(map), &w, &n, &d), 0);
    ASSERT_EQ(n, 2);
    if (n == 2) {
        ASSERT_STREQ(w[0], "10.0.0.1:7001");
        ASSERT_STREQ(w[1], "10.0.0.3:7003");
    }
    char *ask[3] = {"10.0.0.1:7001", "10.0.0.2:7002", "10.0.0.3:7003"};
    uint8_t keys[3][32];
    ASSERT_EQ(kv_node_parse_placement_keys(map, strlen(map), ask, 3, keys, &d), 0);
    ASSERT_EQ(keys[0][3], 2); /* key_hex(1) starts 00000002 */
    static const uint8_t zero[32];
    ASSERT_TRUE(!memcmp(keys[1], zero, 32)); /* dropped: no key to prove */
    ASSERT_EQ(keys[2][3], 4);
    kv_placement pl;
    ASSERT_EQ(kv_node_placement_parse(map, strlen(map), &pl, &d), 0);
    ASSERT_EQ(pl.n_conflicts, 1);
    ASSERT_EQ(pl.n_skipped, 5); /* three bad addresses, a non-string one, a shard without nodes */
    ASSERT_TRUE(strstr(pl.note, "shards[0].nodes[2]") != NULL);
    ASSERT_EQ(pl.n_entry, 2);
    kv_node_placement_free(&pl);
    kv_node_workers_free(w, n);
    /* only the conflicting address: nothing usable is an error, named */
    snprintf(map, sizeof map, "{\"shards\":[{\"nodes\":[{\"key\":\"%s\",\"addr\":\"h:1\"},{\"key\":\"%s\",\"addr\":\"h:1\"}]}]}",
             k1, k2);
    w = (char **)1;
    ASSERT_TRUE(kv_node_parse_placement(map, strlen(map), &w, &n, &d) < 0);
    ASSERT_TRUE(w == NULL && n == 0 && strstr(d.msg, "two keys"));
}

/* The map scales and strangers cannot fill it: 12,544 shards (the 122B's),
 * honest nodes listed first on each shard (the hub lists a shard's holders
 * in registration order) and fakes after them: 1,030 fake addresses that
 * claim shards, all of them also on shard 0, and one fake key at an honest
 * node's address. 5,000 addresses in all (KV_ATTACK_FULL=1: 20,000 with
 * 10,000 fakes). Every honest holder is kept with its key (but the one whose
 * address a fake claimed), every shard keeps an honest holder, no shard more
 * than KV_PLACEMENT_MAX_REPLICAS. Before, the map was refused whole (more
 * than 1024 workers, or an address with two keys). */
static void test_placement_strangers(void) {
    const bool full = getenv("KV_ATTACK_FULL") != NULL;
    const uint32_t n_shard = 12544, n_fake = full ? 10000 : 1030, n_honest = (full ? 20000 : 5000) - n_fake;
    sbuf b = {0};
    sb_add(&b, "{\"model_id\":\"x\",\"shards\":[");
    char key[65];
    for (uint32_t s = 0; s < n_shard; s++) {
        sb_add(&b, "%s{\"layer\":%u,\"first\":%u,\"last\":%u,\"nodes\":[", s ? "," : "", s / 256, s % 256, s % 256);
        /* two honest holders: node s mod H and (s + H/2) mod H */
        const uint32_t h[2] = {s % n_honest, (s + n_honest / 2) % n_honest};
        for (int r = 0; r < 2; r++) {
            key_hex(h[r], key);
            sb_add(&b, "%s{\"key\":\"%s\",\"addr\":\"10.%u.%u.%u:7000\"}", r ? "," : "", key, h[r] >> 16, h[r] >> 8 & 255,
                   h[r] & 255);
        }
        /* fakes: each claims shards f, f + F, ...; every fake claims shard 0 */
        for (uint32_t f = s % n_fake; f < n_fake; f += n_fake) {
            key_hex(1000000 + f, key);
            sb_add(&b, ",{\"key\":\"%s\",\"addr\":\"192.168.%u.%u:9000\"}", key, f >> 8, f & 255);
        }
        if (s == 0)
            for (uint32_t f = 1; f < n_fake; f++) {
                key_hex(1000000 + f, key);
                sb_add(&b, ",{\"key\":\"%s\",\"addr\":\"192.168.%u.%u:9000\"}", key, f >> 8, f & 255);
            }
        if (s == 7) { /* a fake key at honest node 7's address */
            key_hex(2000000, key);
            sb_add(&b, ",{\"key\":\"%s\",\"addr\":\"10.0.0.7:7000\"}", key);
        }
        sb_add(&b, "]}");
    }
    sb_add(&b, "]}");
    kv_diag d = {0};
    kv_placement pl;
    const int rc = kv_node_placement_parse(b.p, b.n, &pl, &d);
    ASSERT_EQ(rc, 0);
    if (rc) {
        fprintf(stderr, "%s\n", d.msg);
        free(b.p);
        return;
    }
    /* the reference: which honest addresses must be there, with which key */
    uint32_t honest_found = 0, fakes_found = 0, bad_key = 0;
    uint8_t *seen = calloc(n_honest, 1);
    for (uint32_t i = 0; i < pl.n_addr; i++) {
        unsigned a, bb, c, port;
        if (sscanf(pl.addr[i], "10.%u.%u.%u:%u", &a, &bb, &c, &port) == 4) {
            const uint32_t id = a << 16 | bb << 8 | c;
            ASSERT_TRUE(id < n_honest && !seen[id]);
            if (id >= n_honest || seen[id]) continue;
            seen[id] = 1;
            honest_found++;
            key_hex(id, key);
            char hex[65];
            kv_hex(pl.key[i], 32, hex);
            bad_key += strcmp(hex, key) != 0;
        } else {
            fakes_found++;
        }
    }
    ASSERT_EQ(honest_found, n_honest - 1);
    ASSERT_EQ(seen[7], 0);
    ASSERT_EQ(bad_key, 0);
    ASSERT_TRUE(fakes_found <= n_fake);
    ASSERT_EQ(pl.n_conflicts, 1);
    /* per shard: at most the cap, and an honest holder first */
    uint32_t *per = calloc(n_shard, sizeof *per);
    uint8_t *honest_at = calloc(n_shard, 1);
    for (size_t e = 0; e < pl.n_entry; e++) {
        per[pl.entry[e].shard]++;
        honest_at[pl.entry[e].shard] |= !strncmp(pl.addr[pl.entry[e].addr], "10.", 3);
    }
    uint32_t over = 0, uncovered = 0;
    for (uint32_t s = 0; s < n_shard; s++) over += per[s] > KV_PLACEMENT_MAX_REPLICAS, uncovered += !honest_at[s];
    ASSERT_EQ(over, 0);
    ASSERT_EQ(uncovered, 0);
    ASSERT_EQ(per[0], KV_PLACEMENT_MAX_REPLICAS);
    ASSERT_TRUE(pl.n_over >= n_fake - KV_PLACEMENT_MAX_REPLICAS);
    ASSERT_TRUE(pl.n_addr <= KV_PLACEMENT_MAX_REPLICAS * n_shard);
    free(per);
    free(honest_at);
    free(seen);
    kv_node_placement_free(&pl);
    free(b.p);
}

/* The relay in a placement map: "relayed" per node kept with its address,
 * the hub's relay port and fingerprint read only when well-formed; the
 * relay's address is the hub URL's host, and a URL's #sha256= pin must be
 * the advertised relay's fingerprint. */
static void test_placement_relay(void) {
    char k1[65], k2[65], map[2048];
    key_hex(1, k1), key_hex(2, k2);
    const char *fp = "166c9e40874fbd0997f8eddb080d8b2cfc6f4b1564787ec3775c8741c296ee1a";
    snprintf(map, sizeof map,
             "{\"relay\":{\"port\":7443,\"sha256\":\"%s\"},\"shards\":[{\"nodes\":[{\"key\":\"%s\",\"addr\":\"10.0.0.1:1\","
             "\"relayed\":false},{\"key\":\"%s\",\"addr\":\"192.168.1.5:2\",\"relayed\":true}]},{\"nodes\":[{\"key\":"
             "\"%s\",\"addr\":\"192.168.1.5:2\"}]}]}", fp, k1, k2, k2);
    kv_placement pl;
    kv_diag d = {0};
    ASSERT_EQ(kv_node_placement_parse(map, strlen(map), &pl, &d), 0);
    ASSERT_EQ(pl.n_addr, 2);
    ASSERT_EQ(pl.relayed[0], 0);
    ASSERT_EQ(pl.relayed[1], 1); /* one entry says so: the address is relayed */
    ASSERT_EQ(pl.relay_port, 7443);
    ASSERT_STREQ(pl.relay_sha256, fp);
    kv_node_placement_free(&pl);
    /* a relay that is not well-formed is no relay; the map still parses */
    char bad[5][200];
    snprintf(bad[0], sizeof bad[0], "{\"port\":0,\"sha256\":\"%s\"}", fp);
    snprintf(bad[1], sizeof bad[1], "{\"port\":70000,\"sha256\":\"%s\"}", fp);
    snprintf(bad[2], sizeof bad[2], "{\"port\":1,\"sha256\":\"%.60s\"}", fp);
    snprintf(bad[3], sizeof bad[3], "{\"port\":\"1\",\"sha256\":\"%s\"}", fp);
    snprintf(bad[4], sizeof bad[4], "[1,\"%s\"]", fp);
    for (size_t i = 0; i < 5; i++) {
        snprintf(map, sizeof map, "{\"relay\":%s,\"shards\":[{\"nodes\":[{\"key\":\"%s\",\"addr\":\"h:1\"}]}]}", bad[i],
                 k1);
        ASSERT_EQ(kv_node_placement_parse(map, strlen(map), &pl, &d), 0);
        ASSERT_EQ(pl.relay_port, 0);
        ASSERT_STREQ(pl.relay_sha256, "");
        kv_node_placement_free(&pl);
    }
    char out[300], url[300];
    ASSERT_EQ(kv_node_relay_addr("http://127.0.0.1:8700", 7443, fp, out, sizeof out, &d), 0);
    ASSERT_STREQ(out, "127.0.0.1:7443");
    ASSERT_EQ(kv_node_relay_addr("https://[::1]:443/", 9, fp, out, sizeof out, &d), 0);
    ASSERT_STREQ(out, "[::1]:9");
    snprintf(url, sizeof url, "https://10.1.2.3:443#sha256=%s", fp);
    ASSERT_EQ(kv_node_relay_addr(url, 443, fp, out, sizeof out, &d), 0);
    ASSERT_STREQ(out, "10.1.2.3:443");
    url[strlen(url) - 1] = 'b'; /* the URL pins another certificate */
    ASSERT_EQ(kv_node_relay_addr(url, 443, fp, out, sizeof out, &d), KV_EAUTH);
    ASSERT_TRUE(strstr(d.msg, "pins") != NULL);
    ASSERT_EQ(kv_node_relay_addr("http://h:1", 0, fp, out, sizeof out, &d), KV_EINVAL);
    ASSERT_EQ(kv_node_relay_addr("nohost", 1, fp, out, sizeof out, &d), KV_EINVAL);
}

static const kvt_case cases[] = {KVT_CASE(test_parse_placement), KVT_CASE(test_placement_one_bad_entry), KVT_CASE(test_placement_strangers), KVT_CASE(test_choose_vs_naive), KVT_CASE(test_choose_cases),
                                 KVT_CASE(test_parse_size), KVT_CASE(test_piece_path), KVT_CASE(test_placement_relay)};
int main(int argc, char **argv) { return kvt_run(argc, argv, cases, KVT_N(cases)); }
