/* The hub store interface (src/hub/store.h) against a reference model: a
 * plain array of the node records this test wrote. Every backend passes
 * these cases: SQLite by default, PostgreSQL when KV_TEST_PG_URI names a
 * fresh database (tests/test_pg_store.sh). Rows damaged behind the store's
 * back must come back as an error, never as out-of-range values. Counters
 * are checked by the store itself: of many connections racing to write one
 * signed request's counter, exactly one wins, and (shared backends) a
 * registration nonce put through one connection is consumed once, whichever
 * connection presents it.
 * kv-test-labels: unit */
#include <pthread.h>
#include <sqlite3.h>
#include <unistd.h>

#include "hub/store.h"
#include "kvtest.h"
#include "pg/pq.h"

#define N_NODES 20

typedef struct ref_node {
    kv_hub_node_rec r;
    kv_hub_held held[8];
} ref_node;

static char g_db[1024];
static bool g_pg; /* the backend under test is PostgreSQL */
static ref_node g_ref[N_NODES];

static void make_ref(void) {
    for (int i = 0; i < N_NODES; i++) {
        ref_node *n = &g_ref[i];
        memset(n, 0, sizeof *n);
        /* keys sorted by byte 0 so the store's order (by pk) is the array's */
        n->r.pk[0] = (uint8_t)(i * 7);
        n->r.pk[31] = (uint8_t)i;
        snprintf(n->r.addr, sizeof n->r.addr, "10.1.2.%d:%d", i, 7000 + i);
        snprintf(n->r.backend, sizeof n->r.backend, i % 2 ? "avx2" : "scalar");
        if (i % 3) snprintf(n->r.site, sizeof n->r.site, "site-%d", i % 3); /* else none given */
        n->r.memory = (uint64_t)i << 30;
        n->r.counter = 1000 + (uint64_t)i;
        n->r.last_seen_ms = 1700000000000 + i;
        n->r.registered_ms = 1600000000000 + i;
        size_t nh = (size_t)(i % 5);
        for (size_t k = 0; k < nh; k++) {
            n->held[k] = (kv_hub_held){.layer = (uint32_t)k, .first = (uint32_t)(4 * i), .last = (uint32_t)(4 * i + 3)};
            memset(n->held[k].sha256, (int)(i + k), 32);
        }
        n->r.shards = n->held;
        n->r.n_shards = nh;
    }
}

typedef struct cmp_state {
    int seen;
    int bad;
} cmp_state;

static int cmp_cb(void *arg, const kv_hub_node_rec *n) {
    cmp_state *s = arg;
    if (s->seen >= N_NODES) {
        s->bad++;
        return 0;
    }
    const kv_hub_node_rec *r = &g_ref[s->seen++].r;
    int ok = !memcmp(n->pk, r->pk, 32) && !strcmp(n->addr, r->addr) && !strcmp(n->backend, r->backend) &&
             !strcmp(n->site, r->site) &&
             n->memory == r->memory && n->counter == r->counter && n->last_seen_ms == r->last_seen_ms &&
             n->registered_ms == r->registered_ms && n->n_shards == r->n_shards;
    for (size_t k = 0; ok && k < n->n_shards; k++) ok = !memcmp(&n->shards[k], &r->shards[k], sizeof n->shards[k]);
    if (!ok) {
        s->bad++;
        fprintf(stderr, "node %d differs from the reference\n", s->seen - 1);
    }
    return 0;
}

static void check_against_ref(kv_hub_store *st) {
    cmp_state cs = {0};
    kv_diag d = {0};
    ASSERT_EQ(st->ops->node_each(st->impl, cmp_cb, &cs, &d), 0);
    ASSERT_EQ(cs.seen, N_NODES);
    ASSERT_EQ(cs.bad, 0);
}

/* Raw SQL behind the store's back (damage, reset). 0 when it ran. */
static int raw_sql(const char *sql) {
    if (!g_pg) {
        sqlite3 *db;
        if (sqlite3_open(g_db, &db) != SQLITE_OK) return -1;
        int rc = sqlite3_exec(db, sql, NULL, NULL, NULL);
        sqlite3_close(db);
        return rc == SQLITE_OK ? 0 : -1;
    }
#ifdef KV_HAVE_PG
    PGconn *c = PQconnectdb(kv_pq_uri(g_db));
    int rc = -1;
    if (PQstatus(c) == CONNECTION_OK) {
        PGresult *r = PQexec(c, "SET search_path = kvhub");
        PQclear(r);
        r = PQexec(c, sql);
        rc = PQresultStatus(r) == PGRES_COMMAND_OK || PQresultStatus(r) == PGRES_TUPLES_OK ? 0 : -1;
        if (rc) fprintf(stderr, "raw sql: %s", PQresultErrorMessage(r));
        PQclear(r);
    }
    PQfinish(c);
    return rc;
#else
    return -1;
#endif
}

/* A store with exactly the reference's nodes. */
static void fill_ref(kv_hub_store *st) {
    kv_diag d = {0};
    ASSERT_EQ(raw_sql("DELETE FROM holdings; DELETE FROM nodes"), 0);
    for (int i = N_NODES - 1; i >= 0; i--) ASSERT_EQ(st->ops->node_put(st->impl, &g_ref[i].r, NULL, 0, &d), 0);
}

static void test_put_touch_drop_reopen(void) {
    kv_hub_store st;
    kv_diag d = {0};
    ASSERT_EQ(kv_hub_store_open(&st, g_db, &d), 0);
    if (d.msg[0]) fprintf(stderr, "open: %s\n", d.msg);
    ASSERT_STREQ(st.ops->name, g_pg ? "postgresql" : "sqlite");
    ASSERT_EQ(st.ops->shared, g_pg);
    fill_ref(&st);
    check_against_ref(&st);
    /* replace one node's holdings (a later registration: higher counter) */
    g_ref[3].r.n_shards = 1;
    g_ref[3].held[0].layer = 9;
    g_ref[3].r.counter = 2003;
    ASSERT_EQ(st.ops->node_put(st.impl, &g_ref[3].r, NULL, 0, &d), 0);
    /* heartbeat and drop */
    g_ref[5].r.counter = 99999;
    g_ref[5].r.last_seen_ms = 1800000000000;
    ASSERT_EQ(st.ops->node_touch(st.impl, g_ref[5].r.pk, 99999, 1800000000000, &d), 0);
    g_ref[4].r.counter = 55555;
    g_ref[4].r.n_shards = 0;
    ASSERT_EQ(st.ops->node_drop_shards(st.impl, g_ref[4].r.pk, 55555, -1, &d), 0);
    g_ref[6].r.counter = 66666;
    g_ref[6].r.n_shards = 0;
    g_ref[6].r.last_seen_ms = 1900000000000;
    ASSERT_EQ(st.ops->node_drop_shards(st.impl, g_ref[6].r.pk, 66666, 1900000000000, &d), 0);
    uint8_t nobody[32] = {0xff};
    ASSERT_EQ(st.ops->node_touch(st.impl, nobody, 1, 1, &d), KV_ENOTFOUND);
    check_against_ref(&st);
    ASSERT_EQ(st.ops->meta_put(st.impl, "model_id", "abc", &d), 0);
    kv_hub_store_close(&st);
    /* everything survives a reopen */
    ASSERT_EQ(kv_hub_store_open(&st, g_db, &d), 0);
    check_against_ref(&st);
    char v[16];
    ASSERT_EQ(st.ops->meta_get(st.impl, "model_id", v, sizeof v, &d), 0);
    ASSERT_STREQ(v, "abc");
    /* put_new keeps what is there (the first of two starting hubs wins) */
    ASSERT_EQ(st.ops->meta_put_new(st.impl, "model_id", "xyz", &d), 0);
    ASSERT_EQ(st.ops->meta_get(st.impl, "model_id", v, sizeof v, &d), 0);
    ASSERT_STREQ(v, "abc");
    ASSERT_EQ(st.ops->meta_put_new(st.impl, "fresh", "1", &d), 0);
    ASSERT_EQ(st.ops->meta_get(st.impl, "fresh", v, sizeof v, &d), 0);
    ASSERT_STREQ(v, "1");
    ASSERT_EQ(st.ops->meta_get(st.impl, "absent", v, sizeof v, &d), 0);
    ASSERT_STREQ(v, "");
    ASSERT_EQ(st.ops->meta_put(st.impl, "long", "0123456789abcdefXYZ", &d), 0);
    ASSERT_EQ(st.ops->meta_get(st.impl, "long", v, sizeof v, &d), KV_EFORMAT);
    kv_hub_store_close(&st);
}

/* A write whose counter is not above the stored one changes nothing. */
static void test_stale_counters(void) {
    kv_hub_store st;
    kv_diag d = {0};
    ASSERT_EQ(kv_hub_store_open(&st, g_db, &d), 0);
    fill_ref(&st);
    kv_hub_node_rec r = g_ref[7].r; /* counter 1007 */
    kv_hub_held other = {.layer = 3, .first = 0, .last = 0};
    r.shards = &other;
    r.n_shards = 1;
    snprintf(r.addr, sizeof r.addr, "6.6.6.6:6");
    ASSERT_EQ(st.ops->node_put(st.impl, &r, NULL, 0, &d), KV_EPROTO); /* equal: a replay */
    r.counter = 5;
    ASSERT_EQ(st.ops->node_put(st.impl, &r, NULL, 0, &d), KV_EPROTO); /* lower */
    ASSERT_EQ(st.ops->node_touch(st.impl, r.pk, 1007, 1, &d), KV_EPROTO);
    ASSERT_EQ(st.ops->node_touch(st.impl, r.pk, 1006, 1, &d), KV_EPROTO);
    ASSERT_EQ(st.ops->node_drop_shards(st.impl, r.pk, 1007, 1, &d), KV_EPROTO);
    ASSERT_TRUE(strstr(d.msg, "1007") != NULL);
    check_against_ref(&st); /* nothing changed */
    kv_hub_store_close(&st);
}

/* ---- many connections, one signed request ---------------------------------- */
#define RACERS 8
typedef struct racer {
    pthread_barrier_t *bar;
    int what; /* 0 touch, 1 put, 2 drop */
    int rc;
} racer;

static void *race_one(void *p) {
    racer *t = p;
    kv_hub_store st;
    kv_diag d = {0};
    int orc = kv_hub_store_open(&st, g_db, &d);
    pthread_barrier_wait(t->bar);
    if (orc) {
        t->rc = orc;
        return NULL;
    }
    kv_hub_node_rec r = g_ref[9].r;
    r.counter = 5000 + (uint64_t)t->what; /* every racer presents the same request */
    if (t->what == 0) t->rc = st.ops->node_touch(st.impl, r.pk, r.counter, 1750000000000, &d);
    else if (t->what == 1) t->rc = st.ops->node_put(st.impl, &r, NULL, 0, &d);
    else t->rc = st.ops->node_drop_shards(st.impl, r.pk, r.counter, -1, &d);
    if (t->rc && t->rc != KV_EPROTO) fprintf(stderr, "racer: %s\n", d.msg);
    kv_hub_store_close(&st);
    return NULL;
}

static void test_race_one_request(void) {
    kv_hub_store st;
    kv_diag d = {0};
    ASSERT_EQ(kv_hub_store_open(&st, g_db, &d), 0);
    fill_ref(&st);
    for (int what = 0; what < 3; what++) {
        pthread_barrier_t bar;
        pthread_barrier_init(&bar, NULL, RACERS);
        racer t[RACERS];
        pthread_t th[RACERS];
        for (int i = 0; i < RACERS; i++) {
            t[i] = (racer){&bar, what, 99};
            pthread_create(&th[i], NULL, race_one, &t[i]);
        }
        int won = 0, refused = 0;
        for (int i = 0; i < RACERS; i++) {
            pthread_join(th[i], NULL);
            won += t[i].rc == 0;
            refused += t[i].rc == KV_EPROTO;
        }
        pthread_barrier_destroy(&bar);
        ASSERT_EQ(won, 1);
        ASSERT_EQ(refused, RACERS - 1);
        g_ref[9].r.counter = 5000 + (uint64_t)what;
        if (what == 0) g_ref[9].r.last_seen_ms = 1750000000000;
        if (what == 2) g_ref[9].r.n_shards = 0;
    }
    check_against_ref(&st);
    kv_hub_store_close(&st);
}

/* Two connections (two hubs on one database): a nonce put at A is used
 * once, at B; a replay at A is refused, and so is a counter accepted at A
 * presented again at B. */
static void test_shared_nonce_once(void) {
    kv_hub_store a, b;
    kv_diag d = {0};
    ASSERT_EQ(kv_hub_store_open(&a, g_db, &d), 0);
    ASSERT_EQ(kv_hub_store_open(&b, g_db, &d), 0);
    if (!a.ops->shared) {
        /* a file store keeps no nonces: the hub process does (test_hub) */
        ASSERT_TRUE(a.ops->nonce_put == NULL && a.ops->node_get == NULL);
        uint8_t n[32] = {0};
        ASSERT_EQ(a.ops->node_put(a.impl, &g_ref[0].r, n, 0, &d), KV_EUNSUPPORTED);
        kv_hub_store_close(&a);
        kv_hub_store_close(&b);
        return;
    }
    fill_ref(&a);
    const int64_t now = 1700000000000;
    uint8_t n1[32], n2[32];
    memset(n1, 0xab, 32);
    memset(n2, 0xcd, 32);
    ASSERT_EQ(a.ops->nonce_put(a.impl, n1, now + 60000, &d), 0);
    ASSERT_EQ(a.ops->nonce_put(a.impl, n2, now + 60000, &d), 0);
    ASSERT_TRUE(memcmp(n1, n2, 4) != 0); /* two slots */
    ASSERT_TRUE(n1[4] == 0xab && n1[31] == 0xab);
    kv_hub_node_rec r = g_ref[11].r;
    r.counter = 7000;
    ASSERT_EQ(b.ops->node_put(b.impl, &r, n1, now, &d), 0);
    r.counter = 7001;
    ASSERT_EQ(a.ops->node_put(a.impl, &r, n1, now, &d), KV_ENOTFOUND); /* used */
    uint8_t forged[32];
    memcpy(forged, n2, 32);
    forged[20] ^= 1;
    ASSERT_EQ(a.ops->node_put(a.impl, &r, forged, now, &d), KV_ENOTFOUND);
    ASSERT_EQ(a.ops->node_put(a.impl, &r, n2, now + 60001, &d), KV_ENOTFOUND); /* expired */
    ASSERT_EQ(b.ops->node_put(b.impl, &r, n2, now + 100, &d), 0);
    /* a refused registration consumed nothing and wrote nothing */
    g_ref[11].r.counter = 7001;
    /* a heartbeat accepted at A is a replay at B */
    ASSERT_EQ(a.ops->node_touch(a.impl, r.pk, 7002, now, &d), 0);
    ASSERT_EQ(b.ops->node_touch(b.impl, r.pk, 7002, now, &d), KV_EPROTO);
    g_ref[11].r.counter = 7002;
    g_ref[11].r.last_seen_ms = now;
    check_against_ref(&b);
    /* one node read by key, as a hub does for a key registered elsewhere */
    cmp_state cs = {.seen = 11};
    ASSERT_EQ(b.ops->node_get(b.impl, r.pk, cmp_cb, &cs, &d), 0);
    ASSERT_EQ(cs.seen, 12);
    ASSERT_EQ(cs.bad, 0);
    uint8_t nobody[32] = {0xfe};
    ASSERT_EQ(b.ops->node_get(b.impl, nobody, cmp_cb, &cs, &d), KV_ENOTFOUND);
    kv_hub_store_close(&a);
    kv_hub_store_close(&b);
}

static int count_cb(void *arg, const kv_hub_node_rec *n) {
    (*(int *)arg)++;
    return 0;
}

static void test_damaged_rows(void) {
    static const char *const bad_sqlite[] = {
        "UPDATE nodes SET addr=printf('%.300c', 'x') WHERE rowid=1",
        "UPDATE nodes SET pk=x'0102' WHERE rowid=1",
        "UPDATE nodes SET counter=-5 WHERE rowid=1",
        "INSERT INTO holdings SELECT pk, 1, 10, 2, zeroblob(32) FROM nodes LIMIT 1",
        "INSERT INTO holdings SELECT pk, 77, 1, 5000000000, zeroblob(32) FROM nodes LIMIT 1",
        "INSERT INTO holdings SELECT pk, 78, 1, 2, x'00' FROM nodes LIMIT 1",
        "UPDATE nodes SET site='Not A Site' WHERE rowid=1",
    };
    /* PostgreSQL's CHECKs refuse a short key or a negative counter, so the
     * damage is what its types and constraints still let through */
    static const char *const bad_pg[] = {
        "UPDATE nodes SET addr=repeat('x', 300) WHERE pk=(SELECT pk FROM nodes ORDER BY pk LIMIT 1)",
        "UPDATE nodes SET backend=repeat('y', 64) WHERE pk=(SELECT pk FROM nodes ORDER BY pk LIMIT 1)",
        "INSERT INTO holdings SELECT pk, 1, 10, 2, '\\x00'::bytea || repeat('a', 31)::bytea FROM nodes LIMIT 1",
        "INSERT INTO holdings SELECT pk, 77, 1, 5000000000, repeat('a', 32)::bytea FROM nodes LIMIT 1",
        "INSERT INTO holdings SELECT pk, 78, 1, 2, '\\x00'::bytea FROM nodes LIMIT 1",
        "INSERT INTO holdings SELECT pk, -1, 1, 2, repeat('a', 32)::bytea FROM nodes LIMIT 1",
        "UPDATE nodes SET site='Not A Site' WHERE pk=(SELECT pk FROM nodes ORDER BY pk LIMIT 1)",
    };
    const char *const *bad = g_pg ? bad_pg : bad_sqlite;
    for (size_t i = 0; i < KVT_N(bad_sqlite); i++) {
        kv_hub_store st;
        kv_diag d = {0};
        ASSERT_EQ(kv_hub_store_open(&st, g_db, &d), 0);
        fill_ref(&st);
        ASSERT_EQ(raw_sql(bad[i]), 0);
        int n = 0;
        int rc = st.ops->node_each(st.impl, count_cb, &n, &d);
        ASSERT_EQ(rc, KV_EFORMAT);
        ASSERT_TRUE(d.msg[0] != 0);
        kv_hub_store_close(&st);
    }
}

static int setup(void) {
    const char *pg = getenv("KV_TEST_PG_URI");
    if (pg && *pg) {
        g_pg = true;
        snprintf(g_db, sizeof g_db, "%s", pg);
    } else {
        snprintf(g_db, sizeof g_db, "%s/kv_hub_store_%ld.db", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp",
                 (long)getpid());
    }
    make_ref();
    return 0;
}

static void teardown(void) {
    if (g_pg) return; /* the script drops the server */
    char p[1100];
    unlink(g_db);
    snprintf(p, sizeof p, "%s-wal", g_db);
    unlink(p);
    snprintf(p, sizeof p, "%s-shm", g_db);
    unlink(p);
}

static const kvt_case cases[] = {
    KVT_CASE(test_put_touch_drop_reopen), KVT_CASE(test_stale_counters), KVT_CASE(test_race_one_request),
    KVT_CASE(test_shared_nonce_once),     KVT_CASE(test_damaged_rows),
};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
