/* SQLite backend of the hub store (store.h): one hub process per file.
 *
 * One connection, WAL journal, synchronous=NORMAL (a commit survives a
 * process crash; an OS crash may lose the last commits, which only rolls a
 * node's counter back to one the node has already outrun, since node
 * counters are derived from the clock). All SQL goes through prepared
 * statements with bound parameters. Rows read back are bounds-checked like
 * any other input: a row that does not fit is an error, never a crash. */
#include <sqlite3.h>
#include <stdlib.h>
#include <string.h>

#include "hub/store.h"
#include "pg/pq.h"

typedef struct kv_sql {
    sqlite3 *db;
    sqlite3_stmt *meta_get, *meta_put, *meta_new, *node_put, *hold_del, *hold_put, *touch, *node_all,
        *hold_all;
} kv_sql;

static const char *kv_sql_schema =
    "PRAGMA journal_mode=WAL;"
    "PRAGMA synchronous=NORMAL;"
    "PRAGMA foreign_keys=ON;"
    "CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);"
    "CREATE TABLE IF NOT EXISTS nodes(pk BLOB PRIMARY KEY, addr TEXT NOT NULL, backend TEXT NOT NULL,"
    " memory INTEGER NOT NULL, counter INTEGER NOT NULL, last_seen_ms INTEGER NOT NULL,"
    " registered_ms INTEGER NOT NULL, site TEXT NOT NULL DEFAULT '');"
    "CREATE TABLE IF NOT EXISTS holdings(pk BLOB NOT NULL REFERENCES nodes(pk) ON DELETE CASCADE,"
    " layer INTEGER NOT NULL, first INTEGER NOT NULL, last INTEGER NOT NULL, sha256 BLOB NOT NULL,"
    " PRIMARY KEY(pk, layer, first));"
    /* the market's state and the demand budgets (a store made before them gets them here) */
    "CREATE TABLE IF NOT EXISTS market(layer INTEGER NOT NULL, first INTEGER NOT NULL, rate REAL NOT NULL,"
    " wait REAL NOT NULL, top_rate REAL NOT NULL, top_pk BLOB NOT NULL, rate_ms INTEGER NOT NULL,"
    " wanted INTEGER NOT NULL, changed_ms INTEGER NOT NULL, above_ms INTEGER NOT NULL, below_ms INTEGER NOT NULL,"
    " version INTEGER NOT NULL, PRIMARY KEY(layer, first));"
    "CREATE TABLE IF NOT EXISTS demand_keys(pk BLOB PRIMARY KEY, counter INTEGER NOT NULL,"
    " window_ms INTEGER NOT NULL, used INTEGER NOT NULL);"
    "CREATE TABLE IF NOT EXISTS demand_nets(net TEXT PRIMARY KEY, window_ms INTEGER NOT NULL,"
    " used INTEGER NOT NULL);";

static int kv_sql_err(kv_sql *s, kv_diag *d, const char *what) {
    return kv_fail(d, KV_EIO, "hub store (sqlite): %s: %s", what, sqlite3_errmsg(s->db));
}

static void kv_sql_close(void *impl) {
    kv_sql *s = impl;
    if (!s) return;
    sqlite3_stmt *all[] = {s->meta_get, s->meta_put, s->meta_new, s->node_put, s->hold_del,
                           s->hold_put, s->touch,    s->node_all, s->hold_all};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) sqlite3_finalize(all[i]);
    sqlite3_close(s->db);
    free(s);
}

static int kv_sql_open(void **impl, const char *uri, kv_diag *d) {
    *impl = NULL;
    kv_sql *s = calloc(1, sizeof *s);
    if (!s) return kv_fail(d, KV_ENOMEM, "hub store: out of memory");
    if (sqlite3_open_v2(uri, &s->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX,
                        NULL) != SQLITE_OK) {
        int rc = kv_fail(d, KV_EIO, "hub store: cannot open '%s': %s", uri,
                         s->db ? sqlite3_errmsg(s->db) : "out of memory");
        kv_sql_close(s);
        return rc;
    }
    sqlite3_busy_timeout(s->db, 5000);
    char *em = NULL;
    if (sqlite3_exec(s->db, kv_sql_schema, NULL, NULL, &em) != SQLITE_OK) {
        int rc = kv_fail(d, KV_EIO, "hub store: '%s': schema: %s", uri, em ? em : "?");
        sqlite3_free(em);
        kv_sql_close(s);
        return rc;
    }
    /* a store made before sites has no site column: add it (an error here means it is there) */
    sqlite3_exec(s->db, "ALTER TABLE nodes ADD COLUMN site TEXT NOT NULL DEFAULT ''", NULL, NULL, NULL);
    struct {
        sqlite3_stmt **st;
        const char *sql;
    } q[] = {
        {&s->meta_get, "SELECT value FROM meta WHERE key=?1"},
        {&s->meta_put, "INSERT INTO meta(key,value) VALUES(?1,?2) ON CONFLICT(key) DO UPDATE SET value=?2"},
        {&s->meta_new, "INSERT INTO meta(key,value) VALUES(?1,?2) ON CONFLICT(key) DO NOTHING"},
        {&s->node_put, "INSERT INTO nodes(pk,addr,backend,memory,counter,last_seen_ms,registered_ms,site)"
                       " VALUES(?1,?2,?3,?4,?5,?6,?7,?8) ON CONFLICT(pk) DO UPDATE SET addr=?2,backend=?3,"
                       "memory=?4,counter=?5,last_seen_ms=?6,registered_ms=?7,site=?8 WHERE nodes.counter < ?5"},
        {&s->hold_del, "DELETE FROM holdings WHERE pk=?1"},
        {&s->hold_put, "INSERT INTO holdings(pk,layer,first,last,sha256) VALUES(?1,?2,?3,?4,?5)"},
        {&s->touch, "UPDATE nodes SET counter=?2,last_seen_ms=CASE WHEN ?3 < 0 THEN last_seen_ms ELSE ?3 END"
                    " WHERE pk=?1 AND counter < ?2"},
        {&s->node_all, "SELECT pk,addr,backend,memory,counter,last_seen_ms,registered_ms,site FROM nodes ORDER BY pk"},
        {&s->hold_all, "SELECT layer,first,last,sha256 FROM holdings WHERE pk=?1 ORDER BY layer,first"},
    };
    for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) {
        if (sqlite3_prepare_v2(s->db, q[i].sql, -1, q[i].st, NULL) != SQLITE_OK) {
            int rc = kv_sql_err(s, d, "prepare");
            kv_sql_close(s);
            return rc;
        }
    }
    *impl = s;
    return 0;
}

static int kv_sql_meta_get(void *impl, const char *key, char *val, size_t cap, kv_diag *d) {
    kv_sql *s = impl;
    val[0] = 0;
    sqlite3_reset(s->meta_get);
    sqlite3_bind_text(s->meta_get, 1, key, -1, SQLITE_STATIC);
    int r = sqlite3_step(s->meta_get), rc = 0;
    if (r == SQLITE_ROW) {
        const unsigned char *t = sqlite3_column_text(s->meta_get, 0);
        int n = sqlite3_column_bytes(s->meta_get, 0);
        if (!t || n < 0 || (size_t)n >= cap)
            rc = kv_fail(d, KV_EFORMAT, "hub store: meta '%s' is longer than %zu bytes", key, cap - 1);
        else
            memcpy(val, t, (size_t)n + 1);
    } else if (r != SQLITE_DONE) {
        rc = kv_sql_err(s, d, "meta_get");
    }
    sqlite3_reset(s->meta_get);
    return rc;
}

static int kv_sql_meta_put(void *impl, const char *key, const char *val, kv_diag *d) {
    kv_sql *s = impl;
    sqlite3_reset(s->meta_put);
    sqlite3_bind_text(s->meta_put, 1, key, -1, SQLITE_STATIC);
    sqlite3_bind_text(s->meta_put, 2, val, -1, SQLITE_STATIC);
    int r = sqlite3_step(s->meta_put);
    sqlite3_reset(s->meta_put);
    return r == SQLITE_DONE ? 0 : kv_sql_err(s, d, "meta_put");
}

static int kv_sql_meta_put_new(void *impl, const char *key, const char *val, kv_diag *d) {
    kv_sql *s = impl;
    sqlite3_reset(s->meta_new);
    sqlite3_bind_text(s->meta_new, 1, key, -1, SQLITE_STATIC);
    sqlite3_bind_text(s->meta_new, 2, val, -1, SQLITE_STATIC);
    int r = sqlite3_step(s->meta_new);
    sqlite3_reset(s->meta_new);
    return r == SQLITE_DONE ? 0 : kv_sql_err(s, d, "meta_put_new");
}

static int kv_sql_exec(kv_sql *s, const char *sql) { return sqlite3_exec(s->db, sql, NULL, NULL, NULL); }

static int kv_sql_step1(kv_sql *s, sqlite3_stmt *st) {
    int r = sqlite3_step(st);
    sqlite3_reset(st);
    return r == SQLITE_DONE ? 0 : -1;
}

/* After a conditional update that changed no row: no node, or a stale counter. */
static int kv_sql_why_not(kv_sql *s, const uint8_t pk[32], kv_diag *d, const char *what) {
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(s->db, "SELECT counter FROM nodes WHERE pk=?1", -1, &st, NULL) != SQLITE_OK)
        return kv_sql_err(s, d, what);
    sqlite3_bind_blob(st, 1, pk, 32, SQLITE_STATIC);
    int r = sqlite3_step(st);
    long long c = r == SQLITE_ROW ? sqlite3_column_int64(st, 0) : 0;
    sqlite3_finalize(st);
    if (r == SQLITE_DONE) return kv_fail(d, KV_ENOTFOUND, "hub store: %s: no such node", what);
    if (r != SQLITE_ROW) return kv_sql_err(s, d, what);
    return kv_fail(d, KV_EPROTO, "replayed or stale request: counter not above last accepted %lld", c);
}

static int kv_sql_node_put(void *impl, const kv_hub_node_rec *n, const uint8_t nonce[32], int64_t now_ms,
                           kv_diag *d) {
    kv_sql *s = impl;
    if (nonce) return kv_fail(d, KV_EUNSUPPORTED, "hub store (sqlite): nonces are kept by the hub process");
    if (kv_sql_exec(s, "BEGIN IMMEDIATE")) return kv_sql_err(s, d, "begin");
    sqlite3_stmt *st = s->node_put;
    sqlite3_bind_blob(st, 1, n->pk, 32, SQLITE_STATIC);
    sqlite3_bind_text(st, 2, n->addr, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 3, n->backend, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 4, (sqlite3_int64)n->memory);
    sqlite3_bind_int64(st, 5, (sqlite3_int64)n->counter);
    sqlite3_bind_int64(st, 6, n->last_seen_ms);
    sqlite3_bind_int64(st, 7, n->registered_ms);
    sqlite3_bind_text(st, 8, n->site, -1, SQLITE_STATIC);
    int bad = kv_sql_step1(s, st);
    if (!bad && sqlite3_changes(s->db) != 1) {
        int rc = kv_sql_why_not(s, n->pk, d, "node_put");
        kv_sql_exec(s, "ROLLBACK");
        return rc;
    }
    if (!bad) {
        sqlite3_bind_blob(s->hold_del, 1, n->pk, 32, SQLITE_STATIC);
        bad = kv_sql_step1(s, s->hold_del);
    }
    for (size_t i = 0; !bad && i < n->n_shards; i++) {
        st = s->hold_put;
        sqlite3_bind_blob(st, 1, n->pk, 32, SQLITE_STATIC);
        sqlite3_bind_int64(st, 2, n->shards[i].layer);
        sqlite3_bind_int64(st, 3, n->shards[i].first);
        sqlite3_bind_int64(st, 4, n->shards[i].last);
        sqlite3_bind_blob(st, 5, n->shards[i].sha256, 32, SQLITE_STATIC);
        bad = kv_sql_step1(s, st);
    }
    if (bad) {
        int rc = kv_sql_err(s, d, "node_put");
        kv_sql_exec(s, "ROLLBACK");
        return rc;
    }
    if (kv_sql_exec(s, "COMMIT")) {
        int rc = kv_sql_err(s, d, "commit");
        kv_sql_exec(s, "ROLLBACK");
        return rc;
    }
    return 0;
}

static int kv_sql_node_touch(void *impl, const uint8_t pk[32], uint64_t counter, int64_t last_seen_ms,
                             kv_diag *d) {
    kv_sql *s = impl;
    sqlite3_bind_blob(s->touch, 1, pk, 32, SQLITE_STATIC);
    sqlite3_bind_int64(s->touch, 2, (sqlite3_int64)counter);
    sqlite3_bind_int64(s->touch, 3, last_seen_ms);
    if (kv_sql_step1(s, s->touch)) return kv_sql_err(s, d, "node_touch");
    if (sqlite3_changes(s->db) != 1) return kv_sql_why_not(s, pk, d, "node_touch");
    return 0;
}

static int kv_sql_node_drop_shards(void *impl, const uint8_t pk[32], uint64_t counter, int64_t last_seen_ms,
                                   kv_diag *d) {
    kv_sql *s = impl;
    if (kv_sql_exec(s, "BEGIN IMMEDIATE")) return kv_sql_err(s, d, "begin");
    /* the counter moves on (the request that failed was signed) */
    sqlite3_bind_blob(s->touch, 1, pk, 32, SQLITE_STATIC);
    sqlite3_bind_int64(s->touch, 2, (sqlite3_int64)counter);
    sqlite3_bind_int64(s->touch, 3, last_seen_ms);
    int bad = kv_sql_step1(s, s->touch);
    if (!bad && sqlite3_changes(s->db) != 1) {
        int rc = kv_sql_why_not(s, pk, d, "node_drop_shards");
        kv_sql_exec(s, "ROLLBACK");
        return rc;
    }
    if (!bad) {
        sqlite3_bind_blob(s->hold_del, 1, pk, 32, SQLITE_STATIC);
        bad = kv_sql_step1(s, s->hold_del);
    }
    if (bad || kv_sql_exec(s, "COMMIT")) {
        int rc = kv_sql_err(s, d, "node_drop_shards");
        kv_sql_exec(s, "ROLLBACK");
        return rc;
    }
    return 0;
}

/* Copies a text column of at most cap-1 bytes. */
static int kv_sql_text(sqlite3_stmt *st, int col, char *out, size_t cap) {
    const unsigned char *t = sqlite3_column_text(st, col);
    int n = sqlite3_column_bytes(st, col);
    if (!t || n < 0 || (size_t)n >= cap) return -1;
    memcpy(out, t, (size_t)n + 1);
    return 0;
}

static int kv_sql_node_each(void *impl, int (*cb)(void *arg, const kv_hub_node_rec *n), void *arg,
                            kv_diag *d) {
    kv_sql *s = impl;
    int rc = 0, r;
    kv_hub_held *held = NULL;
    size_t cap = 0;
    sqlite3_reset(s->node_all);
    while (!rc && (r = sqlite3_step(s->node_all)) == SQLITE_ROW) {
        kv_hub_node_rec n;
        memset(&n, 0, sizeof n);
        sqlite3_stmt *st = s->node_all;
        if (sqlite3_column_bytes(st, 0) != 32 || kv_sql_text(st, 1, n.addr, sizeof n.addr) ||
            kv_sql_text(st, 2, n.backend, sizeof n.backend) || sqlite3_column_int64(st, 3) < 0 ||
            sqlite3_column_int64(st, 4) < 0 || kv_sql_text(st, 7, n.site, sizeof n.site) ||
            (n.site[0] && kv_hub_site_check(n.site, NULL))) {
            rc = kv_fail(d, KV_EFORMAT, "hub store: a nodes row is malformed");
            break;
        }
        memcpy(n.pk, sqlite3_column_blob(st, 0), 32);
        n.memory = (uint64_t)sqlite3_column_int64(st, 3);
        n.counter = (uint64_t)sqlite3_column_int64(st, 4);
        n.last_seen_ms = sqlite3_column_int64(st, 5);
        n.registered_ms = sqlite3_column_int64(st, 6);
        size_t nh = 0;
        sqlite3_stmt *h = s->hold_all;
        sqlite3_reset(h);
        sqlite3_bind_blob(h, 1, n.pk, 32, SQLITE_TRANSIENT);
        while ((r = sqlite3_step(h)) == SQLITE_ROW) {
            if (nh == KV_HUB_MAX_SHARDS_PER_NODE) {
                rc = kv_fail(d, KV_EFORMAT, "hub store: a node holds more than %u shards",
                             KV_HUB_MAX_SHARDS_PER_NODE);
                break;
            }
            if (nh == cap) {
                size_t nc = cap ? cap * 2 : 64;
                kv_hub_held *nhp = realloc(held, nc * sizeof *held);
                if (!nhp) {
                    rc = kv_fail(d, KV_ENOMEM, "hub store: out of memory");
                    break;
                }
                held = nhp;
                cap = nc;
            }
            sqlite3_int64 L = sqlite3_column_int64(h, 0), F = sqlite3_column_int64(h, 1),
                          T = sqlite3_column_int64(h, 2);
            if (L < 0 || F < 0 || T < F || L > UINT32_MAX || T > UINT32_MAX ||
                sqlite3_column_bytes(h, 3) != 32) {
                rc = kv_fail(d, KV_EFORMAT, "hub store: a holdings row is malformed");
                break;
            }
            held[nh].layer = (uint32_t)L;
            held[nh].first = (uint32_t)F;
            held[nh].last = (uint32_t)T;
            memcpy(held[nh].sha256, sqlite3_column_blob(h, 3), 32);
            nh++;
        }
        if (!rc && r != SQLITE_DONE && r != SQLITE_ROW) rc = kv_sql_err(s, d, "holdings");
        sqlite3_reset(h);
        if (rc) break;
        n.shards = held;
        n.n_shards = nh;
        rc = cb(arg, &n);
    }
    if (!rc && r != SQLITE_DONE) rc = kv_sql_err(s, d, "nodes");
    sqlite3_reset(s->node_all);
    free(held);
    return rc;
}

/* ---- market state and demand budgets ---------------------------------------- */

/* A market row is bounds-checked like any input: finite non-negative rates,
 * wanted in 1..KV_MKT_MAX_WANTED, a 32-byte key. */
static int kv_sql_mkt_row(sqlite3_stmt *st, kv_mkt_row *r) {
    memset(r, 0, sizeof *r);
    const sqlite3_int64 L = sqlite3_column_int64(st, 0), F = sqlite3_column_int64(st, 1),
                        W = sqlite3_column_int64(st, 7), V = sqlite3_column_int64(st, 11);
    const double rate = sqlite3_column_double(st, 2), wait = sqlite3_column_double(st, 3),
                 top = sqlite3_column_double(st, 4);
    if (L < 0 || L > UINT32_MAX || F < 0 || F > UINT32_MAX || W < 1 || W > KV_MKT_MAX_WANTED || V < 1 ||
        !(rate >= 0 && rate <= KV_MKT_MAX_RATE) || !(wait >= 0 && wait <= KV_MKT_MAX_RATE) ||
        !(top >= 0 && top <= KV_MKT_MAX_RATE) || sqlite3_column_bytes(st, 5) != 32)
        return -1;
    r->layer = (uint32_t)L;
    r->first = (uint32_t)F;
    r->s.rate = rate;
    r->s.wait = wait;
    r->s.top_rate = top;
    memcpy(r->s.top_pk, sqlite3_column_blob(st, 5), 32);
    r->s.rate_ms = sqlite3_column_int64(st, 6);
    r->s.wanted = (uint32_t)W;
    r->s.changed_ms = sqlite3_column_int64(st, 8);
    r->s.above_ms = sqlite3_column_int64(st, 9);
    r->s.below_ms = sqlite3_column_int64(st, 10);
    r->s.version = V;
    return 0;
}

static int kv_sql_mkt_each(void *impl, int (*cb)(void *arg, const kv_mkt_row *r), void *arg, kv_diag *d) {
    kv_sql *s = impl;
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(s->db, "SELECT layer,first,rate,wait,top_rate,top_pk,rate_ms,wanted,changed_ms,above_ms,"
                           "below_ms,version FROM market ORDER BY layer,first", -1, &st, NULL) != SQLITE_OK)
        return kv_sql_err(s, d, "mkt_each");
    int rc = 0, r;
    while (!rc && (r = sqlite3_step(st)) == SQLITE_ROW) {
        kv_mkt_row row;
        if (kv_sql_mkt_row(st, &row)) rc = kv_fail(d, KV_EFORMAT, "hub store: a market row is malformed");
        else rc = cb(arg, &row);
    }
    if (!rc && r != SQLITE_DONE) rc = kv_sql_err(s, d, "mkt_each");
    sqlite3_finalize(st);
    return rc;
}

static int kv_sql_mkt_put(void *impl, const kv_mkt_row *r, int64_t prev, kv_diag *d) {
    kv_sql *s = impl;
    sqlite3_stmt *st;
    const char *sql = prev ? "UPDATE market SET rate=?3,wait=?4,top_rate=?5,top_pk=?6,rate_ms=?7,wanted=?8,"
                             "changed_ms=?9,above_ms=?10,below_ms=?11,version=?12 WHERE layer=?1 AND first=?2"
                             " AND version=?13"
                           : "INSERT INTO market(layer,first,rate,wait,top_rate,top_pk,rate_ms,wanted,changed_ms,"
                             "above_ms,below_ms,version) VALUES(?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12)"
                             " ON CONFLICT(layer,first) DO NOTHING";
    if (sqlite3_prepare_v2(s->db, sql, -1, &st, NULL) != SQLITE_OK) return kv_sql_err(s, d, "mkt_put");
    sqlite3_bind_int64(st, 1, r->layer);
    sqlite3_bind_int64(st, 2, r->first);
    sqlite3_bind_double(st, 3, r->s.rate);
    sqlite3_bind_double(st, 4, r->s.wait);
    sqlite3_bind_double(st, 5, r->s.top_rate);
    sqlite3_bind_blob(st, 6, r->s.top_pk, 32, SQLITE_STATIC);
    sqlite3_bind_int64(st, 7, r->s.rate_ms);
    sqlite3_bind_int64(st, 8, r->s.wanted);
    sqlite3_bind_int64(st, 9, r->s.changed_ms);
    sqlite3_bind_int64(st, 10, r->s.above_ms);
    sqlite3_bind_int64(st, 11, r->s.below_ms);
    sqlite3_bind_int64(st, 12, r->s.version);
    if (prev) sqlite3_bind_int64(st, 13, prev);
    const int x = sqlite3_step(st);
    sqlite3_finalize(st);
    if (x != SQLITE_DONE) return kv_sql_err(s, d, "mkt_put");
    if (sqlite3_changes(s->db) != 1)
        return kv_fail(d, KV_EPROTO, "hub store: market state of layer %u first %u changed meanwhile", r->layer,
                       r->first);
    return 0;
}

/* One budget row (key or block): what is used in the window now, after a
 * window that ended starts over. -1 on a store error. */
static int kv_sql_budget_used(kv_sql *s, const char *sel, const void *k, int klen, int64_t now, int64_t win,
                              int64_t *wstart, uint64_t *used, uint64_t *counter) {
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(s->db, sel, -1, &st, NULL) != SQLITE_OK) return -1;
    if (klen) sqlite3_bind_blob(st, 1, k, klen, SQLITE_STATIC);
    else sqlite3_bind_text(st, 1, k, -1, SQLITE_STATIC);
    int r = sqlite3_step(st), rc = 0;
    *wstart = now;
    *used = 0;
    if (counter) *counter = 0;
    if (r == SQLITE_ROW) {
        const sqlite3_int64 ws = sqlite3_column_int64(st, 0), u = sqlite3_column_int64(st, 1);
        if (counter) *counter = (uint64_t)sqlite3_column_int64(st, 2);
        if (u >= 0 && ws <= now && now - ws < win) {
            *wstart = ws;
            *used = (uint64_t)u;
        }
    } else if (r != SQLITE_DONE) {
        rc = -1;
    }
    sqlite3_finalize(st);
    return rc;
}

static int kv_sql_exec_bound(kv_sql *s, const char *sql, const void *k, int klen, int64_t a, int64_t b, int64_t c) {
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(s->db, sql, -1, &st, NULL) != SQLITE_OK) return -1;
    if (klen) sqlite3_bind_blob(st, 1, k, klen, SQLITE_STATIC);
    else if (k) sqlite3_bind_text(st, 1, k, -1, SQLITE_STATIC);
    else sqlite3_bind_null(st, 1);
    sqlite3_bind_int64(st, 2, a);
    sqlite3_bind_int64(st, 3, b);
    sqlite3_bind_int64(st, 4, c);
    const int r = sqlite3_step(st);
    sqlite3_finalize(st);
    return r == SQLITE_DONE ? 0 : -1;
}

static int kv_sql_demand_charge(void *impl, const uint8_t pk[32], uint64_t counter, const char *net, int64_t now,
                                const kv_demand_budget *b, uint64_t tokens, uint64_t *granted, kv_diag *d) {
    kv_sql *s = impl;
    *granted = 0;
    if (counter > (uint64_t)INT64_MAX) return kv_fail(d, KV_EPROTO, "demand: counter out of range");
    if (kv_sql_exec(s, "BEGIN IMMEDIATE")) return kv_sql_err(s, d, "begin");
    int64_t kw, nw;
    uint64_t ku, nu, kc;
    if (kv_sql_budget_used(s, "SELECT window_ms,used,counter FROM demand_keys WHERE pk=?1", pk, 32, now,
                           b->window_ms, &kw, &ku, &kc) ||
        kv_sql_budget_used(s, "SELECT window_ms,used FROM demand_nets WHERE net=?1", net, 0, now, b->window_ms, &nw,
                           &nu, NULL)) {
        int rc = kv_sql_err(s, d, "demand_charge");
        kv_sql_exec(s, "ROLLBACK");
        return rc;
    }
    if (kc >= counter) {
        kv_sql_exec(s, "ROLLBACK");
        return kv_fail(d, KV_EPROTO, "replayed or stale demand report: counter not above last accepted %llu",
                       (unsigned long long)kc);
    }
    uint64_t g = tokens;
    const uint64_t kl = b->key_tokens > ku ? b->key_tokens - ku : 0, nl = b->net_tokens > nu ? b->net_tokens - nu : 0;
    if (g > kl) g = kl;
    if (g > nl) g = nl;
    if (kv_sql_exec_bound(s, "INSERT INTO demand_keys(pk,counter,window_ms,used) VALUES(?1,?2,?3,?4)"
                          " ON CONFLICT(pk) DO UPDATE SET counter=?2,window_ms=?3,used=?4", pk, 32, (int64_t)counter,
                          kw, (int64_t)(ku + g)) ||
        kv_sql_exec_bound(s, "INSERT INTO demand_nets(net,window_ms,used) VALUES(?1,?2,?3)"
                          " ON CONFLICT(net) DO UPDATE SET window_ms=?2,used=?3", net, 0, nw, (int64_t)(nu + g), 0) ||
        kv_sql_exec_bound(s, "DELETE FROM demand_nets WHERE window_ms < ?2 - ?3", NULL, 0, now, 2 * b->window_ms, 0) ||
        kv_sql_exec_bound(s, "DELETE FROM demand_keys WHERE window_ms < ?2 - ?3", NULL, 0, now, 2 * b->window_ms, 0) ||
        kv_sql_exec(s, "COMMIT")) {
        int rc = kv_sql_err(s, d, "demand_charge");
        kv_sql_exec(s, "ROLLBACK");
        return rc;
    }
    *granted = g;
    return 0;
}

const kv_hub_store_ops kv_hub_store_sqlite = {
    .name = "sqlite",
    .open = kv_sql_open,
    .close = kv_sql_close,
    .meta_get = kv_sql_meta_get,
    .meta_put = kv_sql_meta_put,
    .meta_put_new = kv_sql_meta_put_new,
    .node_put = kv_sql_node_put,
    .node_touch = kv_sql_node_touch,
    .node_drop_shards = kv_sql_node_drop_shards,
    .node_each = kv_sql_node_each,
    .mkt_each = kv_sql_mkt_each,
    .mkt_put = kv_sql_mkt_put,
    .demand_charge = kv_sql_demand_charge,
};

int kv_hub_store_open(kv_hub_store *s, const char *uri, kv_diag *d) {
    s->ops = kv_pq_uri(uri) ? &kv_hub_store_pg : &kv_hub_store_sqlite;
    s->impl = NULL;
    return s->ops->open(&s->impl, uri, d);
}

void kv_hub_store_close(kv_hub_store *s) {
    if (s && s->ops) s->ops->close(s->impl);
    if (s) s->impl = NULL;
}
