/* The hub store interface (src/hub/store.h) against a reference model: a
 * plain array of the node records this test wrote. Every backend must pass
 * these cases; today that is SQLite. Rows damaged behind the store's back
 * must come back as an error, never as out-of-range values.
 * kv-test-labels: unit */
#include <sqlite3.h>
#include <unistd.h>

#include "hub/store.h"
#include "kvtest.h"

#define N_NODES 20

typedef struct ref_node {
    kv_hub_node_rec r;
    kv_hub_held held[8];
} ref_node;

static char g_db[256];
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

static void test_put_touch_drop_reopen(void) {
    kv_hub_store st;
    kv_diag d = {0};
    ASSERT_EQ(kv_hub_store_open(&st, g_db, &d), 0);
    ASSERT_STREQ(st.ops->name, "sqlite");
    for (int i = N_NODES - 1; i >= 0; i--) ASSERT_EQ(st.ops->node_put(st.impl, &g_ref[i].r, &d), 0);
    check_against_ref(&st);
    /* replace one node's holdings */
    g_ref[3].r.n_shards = 1;
    g_ref[3].held[0].layer = 9;
    ASSERT_EQ(st.ops->node_put(st.impl, &g_ref[3].r, &d), 0);
    /* heartbeat and drop */
    g_ref[5].r.counter = 99999;
    g_ref[5].r.last_seen_ms = 1800000000000;
    ASSERT_EQ(st.ops->node_touch(st.impl, g_ref[5].r.pk, 99999, 1800000000000, &d), 0);
    g_ref[4].r.counter = 55555;
    g_ref[4].r.n_shards = 0;
    ASSERT_EQ(st.ops->node_drop_shards(st.impl, g_ref[4].r.pk, 55555, &d), 0);
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
    ASSERT_EQ(st.ops->meta_get(st.impl, "absent", v, sizeof v, &d), 0);
    ASSERT_STREQ(v, "");
    ASSERT_EQ(st.ops->meta_put(st.impl, "long", "0123456789abcdefXYZ", &d), 0);
    ASSERT_EQ(st.ops->meta_get(st.impl, "long", v, sizeof v, &d), KV_EFORMAT);
    kv_hub_store_close(&st);
}

static void damage(const char *sql) {
    sqlite3 *db;
    ASSERT_EQ(sqlite3_open(g_db, &db), SQLITE_OK);
    ASSERT_EQ(sqlite3_exec(db, sql, NULL, NULL, NULL), SQLITE_OK);
    sqlite3_close(db);
}

static int count_cb(void *arg, const kv_hub_node_rec *n) {
    (*(int *)arg)++;
    return 0;
}

static void test_damaged_rows(void) {
    const char *bad[] = {
        "UPDATE nodes SET addr=printf('%.300c', 'x') WHERE rowid=1",
        "UPDATE nodes SET pk=x'0102' WHERE rowid=1",
        "UPDATE nodes SET counter=-5 WHERE rowid=1",
        "INSERT INTO holdings SELECT pk, 1, 10, 2, zeroblob(32) FROM nodes LIMIT 1",
        "INSERT INTO holdings SELECT pk, 77, 1, 5000000000, zeroblob(32) FROM nodes LIMIT 1",
        "INSERT INTO holdings SELECT pk, 78, 1, 2, x'00' FROM nodes LIMIT 1",
    };
    for (size_t i = 0; i < KVT_N(bad); i++) {
        char cp[600];
        snprintf(cp, sizeof cp, "cp '%s' '%s.bak'", g_db, g_db);
        ASSERT_EQ(system(cp), 0);
        damage(bad[i]);
        kv_hub_store st;
        kv_diag d = {0};
        ASSERT_EQ(kv_hub_store_open(&st, g_db, &d), 0);
        int n = 0;
        int rc = st.ops->node_each(st.impl, count_cb, &n, &d);
        ASSERT_EQ(rc, KV_EFORMAT);
        ASSERT_TRUE(d.msg[0] != 0);
        kv_hub_store_close(&st);
        snprintf(cp, sizeof cp, "mv '%s.bak' '%s'", g_db, g_db);
        ASSERT_EQ(system(cp), 0);
    }
}

static int setup(void) {
    snprintf(g_db, sizeof g_db, "%s/kv_hub_store_%ld.db", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (long)getpid());
    make_ref();
    return 0;
}

static void teardown(void) {
    char p[300];
    unlink(g_db);
    snprintf(p, sizeof p, "%s-wal", g_db);
    unlink(p);
    snprintf(p, sizeof p, "%s-shm", g_db);
    unlink(p);
}

static const kvt_case cases[] = {KVT_CASE(test_put_touch_drop_reopen), KVT_CASE(test_damaged_rows)};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
