/* Node unit tests: the shard choice against a naive reference and against
 * the properties it promises, and the budget size parser.
 * kv-test-labels: unit
 *
 * The reference is written from the rule in node.h, not from the code: it
 * keeps every last live replica, then repeatedly scans all shards for the
 * best one still open (smallest class, held, larger deficit, smaller tie,
 * smaller index) and takes it if it fits, O(n^2), no sorting. */
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
                                   1000 + rnd() % 4 * 500, wanted, live, 0};
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
    kv_hub_shard_view s1[2] = {{0, 0, 1, 100, 2, 2, 0}, {0, 2, 3, 100, 2, 0, 0}};
    uint8_t h1[2] = {0, 0};
    ASSERT_EQ(kv_node_choose(s1, 2, 150, h1, 7, take, &bytes, &d), 0);
    ASSERT_EQ(take[0], 0);
    ASSERT_EQ(take[1], 1);
    /* a held third replica yields to an uncovered shard */
    kv_hub_shard_view s2[2] = {{0, 0, 1, 100, 2, 3, 0}, {0, 2, 3, 100, 2, 0, 0}};
    uint8_t h2[2] = {1, 0};
    ASSERT_EQ(kv_node_choose(s2, 2, 150, h2, 7, take, &bytes, &d), 0);
    ASSERT_EQ(take[0], 0);
    ASSERT_EQ(take[1], 1);
    /* the last live replica is kept even over a smaller budget */
    kv_hub_shard_view s3[2] = {{0, 0, 1, 100, 2, 1, 0}, {0, 2, 3, 100, 2, 0, 0}};
    uint8_t h3[2] = {1, 0};
    ASSERT_EQ(kv_node_choose(s3, 2, 50, h3, 7, take, &bytes, &d), 0);
    ASSERT_EQ(take[0], 1);
    ASSERT_EQ(take[1], 0);
    ASSERT_EQ(bytes, 100);
    /* a held wanted replica is not traded for an equal one */
    kv_hub_shard_view s4[2] = {{0, 0, 1, 100, 2, 2, 0}, {0, 2, 3, 100, 2, 1, 0}};
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

static const kvt_case cases[] = {KVT_CASE(test_parse_placement), KVT_CASE(test_choose_vs_naive), KVT_CASE(test_choose_cases),
                                 KVT_CASE(test_parse_size), KVT_CASE(test_piece_path)};
int main(int argc, char **argv) { return kvt_run(argc, argv, cases, KVT_N(cases)); }
