/* PostgreSQL backend of the hub store (store.h): any number of hub
 * processes on one database share one registry.
 *
 * Concurrency. Every write is one transaction whose condition is in the
 * SQL: a node row is written only WHERE its stored counter is below the
 * request's (an upsert with a WHERE on its DO UPDATE, or an UPDATE ... WHERE
 * counter < $n), so the row lock PostgreSQL takes on the node decides
 * between two hubs that race with one signed request, and the loser sees
 * zero rows changed. A registration consumes its nonce with DELETE ...
 * RETURNING in the same transaction: of two hubs given the same nonce, one
 * deletes the row, the other finds none. Nonces live in a ring of
 * KV_HUB_MAX_NONCES slots (a sequence picks the slot), so unauthenticated
 * GET /v1/nonce traffic cannot grow the table. node_each reads nodes and
 * holdings in one REPEATABLE READ snapshot. Schema creation takes an
 * advisory lock, so hubs that start together do not race on CREATE.
 *
 * Tables live in schema kvhub (the ledger's in kvledger), so the hub and
 * the ledger may share one database. Every row read back is bounds-checked (pg/pq.h). */
#include <stdlib.h>
#include <string.h>

#include "hub/store.h"
#include "pg/pq.h"

#ifdef KV_HAVE_PG
#define WHO "hub store"

typedef struct kv_hpg {
    kv_pq p;
} kv_hpg;

enum { Q_META_GET, Q_META_PUT, Q_META_NEW, Q_NODE_PUT, Q_HOLD_DEL, Q_HOLD_PUT, Q_TOUCH, Q_WHY, Q_NODES, Q_HOLDS,
       Q_NODE1, Q_HOLD1, Q_NONCE_TAKE, Q_NONCE_SLOT, Q_NONCE_PUT, Q_MKT_ALL, Q_MKT_INS, Q_MKT_UPD, Q_DK_NEW,
       Q_DK_GET, Q_DK_PUT, Q_DN_NEW, Q_DN_GET, Q_DN_PUT, Q_DK_PRUNE, Q_DN_PRUNE };

static const char *const kv_hpg_sql[] = {
    [Q_META_GET] = "SELECT value FROM meta WHERE key=$1",
    [Q_META_PUT] = "INSERT INTO meta(key,value) VALUES($1,$2) ON CONFLICT(key) DO UPDATE SET value=EXCLUDED.value",
    [Q_META_NEW] = "INSERT INTO meta(key,value) VALUES($1,$2) ON CONFLICT(key) DO NOTHING",
    [Q_NODE_PUT] = "INSERT INTO nodes(pk,addr,backend,memory,counter,last_seen_ms,registered_ms,site)"
                   " VALUES($1,$2,$3,$4,$5,$6,$7,$8) ON CONFLICT(pk) DO UPDATE SET addr=EXCLUDED.addr,"
                   "backend=EXCLUDED.backend,memory=EXCLUDED.memory,counter=EXCLUDED.counter,site=EXCLUDED.site,"
                   "last_seen_ms=EXCLUDED.last_seen_ms,registered_ms=EXCLUDED.registered_ms"
                   " WHERE nodes.counter < EXCLUDED.counter",
    [Q_HOLD_DEL] = "DELETE FROM holdings WHERE pk=$1",
    [Q_HOLD_PUT] = "INSERT INTO holdings(pk,layer,first,last,sha256) VALUES($1,$2,$3,$4,$5)",
    [Q_TOUCH] = "UPDATE nodes SET counter=$2, last_seen_ms=CASE WHEN $3::bigint < 0 THEN last_seen_ms"
                " ELSE $3::bigint END WHERE pk=$1 AND counter < $2",
    [Q_WHY] = "SELECT counter FROM nodes WHERE pk=$1",
    [Q_NODES] = "SELECT pk,addr,backend,memory,counter,last_seen_ms,registered_ms,site FROM nodes ORDER BY pk",
    [Q_HOLDS] = "SELECT pk,layer,first,last,sha256 FROM holdings ORDER BY pk,layer,first",
    [Q_NODE1] = "SELECT pk,addr,backend,memory,counter,last_seen_ms,registered_ms,site FROM nodes WHERE pk=$1",
    [Q_HOLD1] = "SELECT pk,layer,first,last,sha256 FROM holdings WHERE pk=$1 ORDER BY layer,first",
    [Q_NONCE_TAKE] = "DELETE FROM nonces WHERE slot=$1 AND nonce=$2 AND expires_ms >= $3 RETURNING slot",
    [Q_NONCE_SLOT] = "SELECT nextval('nonce_seq') % $1",
    [Q_NONCE_PUT] = "INSERT INTO nonces(slot,nonce,expires_ms) VALUES($1,$2,$3)"
                    " ON CONFLICT(slot) DO UPDATE SET nonce=EXCLUDED.nonce, expires_ms=EXCLUDED.expires_ms",
    [Q_MKT_ALL] = "SELECT layer,first,rate,wait,top_rate,top_pk,rate_ms,wanted,changed_ms,above_ms,below_ms,version"
                  " FROM market ORDER BY layer,first",
    [Q_MKT_INS] = "INSERT INTO market(layer,first,rate,wait,top_rate,top_pk,rate_ms,wanted,changed_ms,above_ms,"
                  "below_ms,version) VALUES($1,$2,$3::float8,$4::float8,$5::float8,$6,$7,$8,$9,$10,$11,$12)"
                  " ON CONFLICT(layer,first) DO NOTHING",
    [Q_MKT_UPD] = "UPDATE market SET rate=$3::float8,wait=$4::float8,top_rate=$5::float8,top_pk=$6,rate_ms=$7,"
                  "wanted=$8,changed_ms=$9,above_ms=$10,below_ms=$11,version=$12"
                  " WHERE layer=$1 AND first=$2 AND version=$13",
    [Q_DK_NEW] = "INSERT INTO demand_keys(pk,counter,window_ms,used) VALUES($1,0,$2,0) ON CONFLICT(pk) DO NOTHING",
    [Q_DK_GET] = "SELECT window_ms,used,counter FROM demand_keys WHERE pk=$1 FOR UPDATE",
    [Q_DK_PUT] = "UPDATE demand_keys SET counter=$2,window_ms=$3,used=$4 WHERE pk=$1",
    [Q_DN_NEW] = "INSERT INTO demand_nets(net,window_ms,used) VALUES($1,$2,0) ON CONFLICT(net) DO NOTHING",
    [Q_DN_GET] = "SELECT window_ms,used FROM demand_nets WHERE net=$1 FOR UPDATE",
    [Q_DN_PUT] = "UPDATE demand_nets SET window_ms=$2,used=$3 WHERE net=$1",
    [Q_DK_PRUNE] = "DELETE FROM demand_keys WHERE window_ms < $1",
    [Q_DN_PRUNE] = "DELETE FROM demand_nets WHERE window_ms < $1",
};

static const char *const kv_hpg_schema =
    "SELECT pg_advisory_lock(7079018201);"
    "CREATE SCHEMA IF NOT EXISTS kvhub;"
    "CREATE TABLE IF NOT EXISTS meta(key text PRIMARY KEY, value text NOT NULL);"
    "CREATE TABLE IF NOT EXISTS nodes(pk bytea PRIMARY KEY CHECK (length(pk) = 32),"
    " addr text NOT NULL, backend text NOT NULL, memory bigint NOT NULL CHECK (memory >= 0),"
    " counter bigint NOT NULL CHECK (counter >= 0), last_seen_ms bigint NOT NULL, registered_ms bigint NOT NULL);"
    /* a store made before sites has none */
    "ALTER TABLE nodes ADD COLUMN IF NOT EXISTS site text NOT NULL DEFAULT '';"
    "CREATE TABLE IF NOT EXISTS holdings(pk bytea NOT NULL REFERENCES nodes(pk) ON DELETE CASCADE,"
    " layer bigint NOT NULL, first bigint NOT NULL, last bigint NOT NULL, sha256 bytea NOT NULL,"
    " PRIMARY KEY(pk, layer, first));"
    "CREATE TABLE IF NOT EXISTS nonces(slot integer PRIMARY KEY, nonce bytea NOT NULL,"
    " expires_ms bigint NOT NULL);"
    "CREATE SEQUENCE IF NOT EXISTS nonce_seq;"
    /* the market's state and the demand budgets (a store made before them gets them here) */
    "CREATE TABLE IF NOT EXISTS market(layer bigint NOT NULL, first bigint NOT NULL, rate float8 NOT NULL,"
    " wait float8 NOT NULL, top_rate float8 NOT NULL, top_pk bytea NOT NULL, rate_ms bigint NOT NULL,"
    " wanted bigint NOT NULL, changed_ms bigint NOT NULL, above_ms bigint NOT NULL, below_ms bigint NOT NULL,"
    " version bigint NOT NULL, PRIMARY KEY(layer, first));"
    "CREATE TABLE IF NOT EXISTS demand_keys(pk bytea PRIMARY KEY CHECK (length(pk) = 32), counter bigint NOT NULL,"
    " window_ms bigint NOT NULL, used bigint NOT NULL);"
    "CREATE TABLE IF NOT EXISTS demand_nets(net text PRIMARY KEY, window_ms bigint NOT NULL, used bigint NOT NULL);"
    "SELECT pg_advisory_unlock(7079018201);";

static PGresult *kv_hpg_run(kv_hpg *s, int q, const kv_pq_args *a, kv_diag *d) {
    return kv_pq_run(&s->p, q, kv_hpg_sql[q], a, NULL, d);
}

static void kv_hpg_close(void *impl) {
    kv_hpg *s = impl;
    if (!s) return;
    kv_pq_close(&s->p);
    free(s);
}

static int kv_hpg_open(void **impl, const char *uri, kv_diag *d) {
    *impl = NULL;
    kv_hpg *s = calloc(1, sizeof *s);
    if (!s) return kv_fail(d, KV_ENOMEM, "hub store: out of memory");
    int rc = kv_pq_open(&s->p, kv_pq_uri(uri), WHO, "SET search_path = kvhub", d);
    if (!rc) rc = kv_pq_exec(&s->p, kv_hpg_schema, d);
    if (rc) {
        kv_hpg_close(s);
        return rc;
    }
    *impl = s;
    return 0;
}

static int kv_hpg_meta_get(void *impl, const char *key, char *val, size_t cap, kv_diag *d) {
    kv_hpg *s = impl;
    val[0] = 0;
    kv_pq_args a = {0};
    kv_pq_arg_text(&a, key);
    PGresult *r = kv_hpg_run(s, Q_META_GET, &a, d);
    if (!r) return KV_EIO;
    int rc = PQntuples(r) ? kv_pq_text(r, 0, 0, val, cap, d, WHO, "meta value") : 0;
    PQclear(r);
    return rc;
}

static int kv_hpg_meta_put(void *impl, const char *key, const char *val, kv_diag *d) {
    kv_hpg *s = impl;
    kv_pq_args a = {0};
    kv_pq_arg_text(&a, key);
    kv_pq_arg_text(&a, val);
    PGresult *r = kv_hpg_run(s, Q_META_PUT, &a, d);
    PQclear(r);
    return r ? 0 : KV_EIO;
}

static int kv_hpg_meta_put_new(void *impl, const char *key, const char *val, kv_diag *d) {
    kv_hpg *s = impl;
    kv_pq_args a = {0};
    kv_pq_arg_text(&a, key);
    kv_pq_arg_text(&a, val);
    PGresult *r = kv_hpg_run(s, Q_META_NEW, &a, d);
    PQclear(r);
    return r ? 0 : KV_EIO;
}

static int kv_hpg_begin(kv_hpg *s, kv_diag *d) {
    int rc = kv_pq_exec(&s->p, "BEGIN", d);
    s->p.in_txn = !rc;
    return rc;
}
static int kv_hpg_commit(kv_hpg *s, kv_diag *d) {
    int rc = kv_pq_exec(&s->p, "COMMIT", d);
    if (rc) kv_pq_exec(&s->p, "ROLLBACK", NULL);
    s->p.in_txn = false;
    return rc;
}
static int kv_hpg_rollback(kv_hpg *s, int rc) {
    kv_pq_exec(&s->p, "ROLLBACK", NULL);
    s->p.in_txn = false;
    return rc;
}

/* After a conditional write that changed no row: no node, or a stale counter. */
static int kv_hpg_why_not(kv_hpg *s, const uint8_t pk[32], kv_diag *d, const char *what) {
    kv_pq_args a = {0};
    kv_pq_arg_blob(&a, pk, 32);
    PGresult *r = kv_hpg_run(s, Q_WHY, &a, d);
    if (!r) return KV_EIO;
    int64_t c = 0;
    int rc = !PQntuples(r) ? kv_fail(d, KV_ENOTFOUND, "hub store: %s: no such node", what)
             : kv_pq_i64(r, 0, 0, 0, INT64_MAX, &c, d, WHO, "counter")
                 ? KV_EFORMAT
                 : kv_fail(d, KV_EPROTO, "replayed or stale request: counter not above last accepted %lld",
                           (long long)c);
    PQclear(r);
    return rc;
}

/* One statement of a transaction: 0 or KV_EIO; *changed the rows it changed. */
static int kv_hpg_step(kv_hpg *s, int q, const kv_pq_args *a, long *changed, kv_diag *d) {
    PGresult *r = kv_hpg_run(s, q, a, d);
    if (!r) return KV_EIO;
    if (changed) *changed = kv_pq_changed(r);
    PQclear(r);
    return 0;
}

static int kv_hpg_node_put(void *impl, const kv_hub_node_rec *n, const uint8_t nonce[32], int64_t now_ms,
                           kv_diag *d) {
    kv_hpg *s = impl;
    int rc = kv_hpg_begin(s, d);
    if (rc) return rc;
    long ch = 0;
    if (nonce) {
        uint32_t slot = (uint32_t)nonce[0] | (uint32_t)nonce[1] << 8 | (uint32_t)nonce[2] << 16 |
                        (uint32_t)nonce[3] << 24;
        kv_pq_args a = {0};
        kv_pq_arg_i64(&a, slot % KV_HUB_MAX_NONCES);
        kv_pq_arg_blob(&a, nonce, 32);
        kv_pq_arg_i64(&a, now_ms);
        if ((rc = kv_hpg_step(s, Q_NONCE_TAKE, &a, &ch, d))) return kv_hpg_rollback(s, rc);
        if (ch != 1)
            return kv_hpg_rollback(s, kv_fail(d, KV_ENOTFOUND, "registration nonce is unknown, used or expired"));
    }
    kv_pq_args a = {0};
    kv_pq_arg_blob(&a, n->pk, 32);
    kv_pq_arg_text(&a, n->addr);
    kv_pq_arg_text(&a, n->backend);
    kv_pq_arg_i64(&a, (int64_t)n->memory);
    kv_pq_arg_i64(&a, (int64_t)n->counter);
    kv_pq_arg_i64(&a, n->last_seen_ms);
    kv_pq_arg_i64(&a, n->registered_ms);
    kv_pq_arg_text(&a, n->site);
    if ((rc = kv_hpg_step(s, Q_NODE_PUT, &a, &ch, d))) return kv_hpg_rollback(s, rc);
    if (ch != 1) {
        rc = kv_hpg_why_not(s, n->pk, d, "node_put");
        return kv_hpg_rollback(s, rc);
    }
    kv_pq_args k = {0};
    kv_pq_arg_blob(&k, n->pk, 32);
    if ((rc = kv_hpg_step(s, Q_HOLD_DEL, &k, NULL, d))) return kv_hpg_rollback(s, rc);
    for (size_t i = 0; i < n->n_shards; i++) {
        kv_pq_args h = {0};
        kv_pq_arg_blob(&h, n->pk, 32);
        kv_pq_arg_i64(&h, n->shards[i].layer);
        kv_pq_arg_i64(&h, n->shards[i].first);
        kv_pq_arg_i64(&h, n->shards[i].last);
        kv_pq_arg_blob(&h, n->shards[i].sha256, 32);
        if ((rc = kv_hpg_step(s, Q_HOLD_PUT, &h, NULL, d))) return kv_hpg_rollback(s, rc);
    }
    return kv_hpg_commit(s, d);
}

static int kv_hpg_touch_in(kv_hpg *s, const uint8_t pk[32], uint64_t counter, int64_t last_seen_ms, kv_diag *d,
                           const char *what) {
    kv_pq_args a = {0};
    kv_pq_arg_blob(&a, pk, 32);
    kv_pq_arg_i64(&a, (int64_t)counter);
    kv_pq_arg_i64(&a, last_seen_ms);
    long ch = 0;
    int rc = kv_hpg_step(s, Q_TOUCH, &a, &ch, d);
    if (!rc && ch != 1) rc = kv_hpg_why_not(s, pk, d, what);
    return rc;
}

static int kv_hpg_node_touch(void *impl, const uint8_t pk[32], uint64_t counter, int64_t last_seen_ms,
                             kv_diag *d) {
    return kv_hpg_touch_in(impl, pk, counter, last_seen_ms, d, "node_touch");
}

static int kv_hpg_node_drop_shards(void *impl, const uint8_t pk[32], uint64_t counter, int64_t last_seen_ms,
                                   kv_diag *d) {
    kv_hpg *s = impl;
    int rc = kv_hpg_begin(s, d);
    if (rc) return rc;
    if ((rc = kv_hpg_touch_in(s, pk, counter, last_seen_ms, d, "node_drop_shards"))) return kv_hpg_rollback(s, rc);
    kv_pq_args k = {0};
    kv_pq_arg_blob(&k, pk, 32);
    if ((rc = kv_hpg_step(s, Q_HOLD_DEL, &k, NULL, d))) return kv_hpg_rollback(s, rc);
    return kv_hpg_commit(s, d);
}

/* Row i of a nodes result into n (shards not set). */
static int kv_hpg_node_row(PGresult *r, int i, kv_hub_node_rec *n, kv_diag *d) {
    memset(n, 0, sizeof *n);
    int64_t mem, ctr, seen, reg;
    if (kv_pq_bytea(r, i, 0, n->pk, 32, NULL, d, WHO, "node key") ||
        kv_pq_text(r, i, 1, n->addr, sizeof n->addr, d, WHO, "node addr") ||
        kv_pq_text(r, i, 2, n->backend, sizeof n->backend, d, WHO, "node backend") ||
        kv_pq_i64(r, i, 3, 0, INT64_MAX, &mem, d, WHO, "node memory") ||
        kv_pq_i64(r, i, 4, 0, INT64_MAX, &ctr, d, WHO, "node counter") ||
        kv_pq_i64(r, i, 5, INT64_MIN, INT64_MAX, &seen, d, WHO, "node last_seen_ms") ||
        kv_pq_i64(r, i, 6, INT64_MIN, INT64_MAX, &reg, d, WHO, "node registered_ms") ||
        kv_pq_text(r, i, 7, n->site, sizeof n->site, d, WHO, "node site"))
        return KV_EFORMAT;
    if (n->site[0] && kv_hub_site_check(n->site, d)) {
        kv_diag_prefix(d, KV_EFORMAT, "%s: node site", WHO);
        if (d) d->code = KV_EFORMAT; /* a damaged row, not a caller's mistake */
        return KV_EFORMAT;
    }
    n->memory = (uint64_t)mem;
    n->counter = (uint64_t)ctr;
    n->last_seen_ms = seen;
    n->registered_ms = reg;
    return 0;
}

/* Holdings rows [*j, ...) whose key is pk, into held (grown); *j advanced. */
static int kv_hpg_holds(PGresult *h, int *j, const uint8_t pk[32], kv_hub_held **held, size_t *cap, size_t *nh,
                        kv_diag *d) {
    *nh = 0;
    int nrow = PQntuples(h);
    while (*j < nrow) {
        uint8_t k[32];
        if (kv_pq_bytea(h, *j, 0, k, 32, NULL, d, WHO, "holding key")) return KV_EFORMAT;
        int c = memcmp(k, pk, 32);
        if (c < 0) { (*j)++; continue; } /* a holding of no node (cannot be: foreign key) */
        if (c > 0) break;
        if (*nh == KV_HUB_MAX_SHARDS_PER_NODE)
            return kv_fail(d, KV_EFORMAT, "hub store: a node holds more than %u shards", KV_HUB_MAX_SHARDS_PER_NODE);
        if (*nh == *cap) {
            size_t nc = *cap ? *cap * 2 : 64;
            kv_hub_held *p = realloc(*held, nc * sizeof *p);
            if (!p) return kv_fail(d, KV_ENOMEM, "hub store: out of memory");
            *held = p;
            *cap = nc;
        }
        int64_t L, F, T;
        kv_hub_held *e = &(*held)[*nh];
        if (kv_pq_i64(h, *j, 1, 0, UINT32_MAX, &L, d, WHO, "holding layer") ||
            kv_pq_i64(h, *j, 2, 0, UINT32_MAX, &F, d, WHO, "holding first") ||
            kv_pq_i64(h, *j, 3, F, UINT32_MAX, &T, d, WHO, "holding last") ||
            kv_pq_bytea(h, *j, 4, e->sha256, 32, NULL, d, WHO, "holding sha256"))
            return KV_EFORMAT;
        e->layer = (uint32_t)L;
        e->first = (uint32_t)F;
        e->last = (uint32_t)T;
        (*nh)++;
        (*j)++;
    }
    return 0;
}

/* Calls cb for every row of nodes with its holdings from holds (both
 * ordered by pk; bytea compares bytewise, as memcmp). */
static int kv_hpg_emit(PGresult *nodes, PGresult *holds, int (*cb)(void *arg, const kv_hub_node_rec *n), void *arg,
                       kv_diag *d) {
    kv_hub_held *held = NULL;
    size_t cap = 0, nh = 0;
    int rc = 0, j = 0;
    for (int i = 0; !rc && i < PQntuples(nodes); i++) {
        kv_hub_node_rec n;
        if ((rc = kv_hpg_node_row(nodes, i, &n, d)) || (rc = kv_hpg_holds(holds, &j, n.pk, &held, &cap, &nh, d)))
            break;
        n.shards = held;
        n.n_shards = nh;
        rc = cb(arg, &n);
    }
    free(held);
    return rc;
}

static int kv_hpg_node_each(void *impl, int (*cb)(void *arg, const kv_hub_node_rec *n), void *arg, kv_diag *d) {
    kv_hpg *s = impl;
    int rc = kv_pq_exec(&s->p, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY", d);
    if (rc) return rc;
    s->p.in_txn = true;
    PGresult *nodes = kv_hpg_run(s, Q_NODES, NULL, d), *holds = nodes ? kv_hpg_run(s, Q_HOLDS, NULL, d) : NULL;
    kv_hpg_rollback(s, 0); /* a read: nothing to commit */
    if (!nodes || !holds) rc = KV_EIO;
    else rc = kv_hpg_emit(nodes, holds, cb, arg, d);
    PQclear(nodes);
    PQclear(holds);
    return rc;
}

static int kv_hpg_node_get(void *impl, const uint8_t pk[32], int (*cb)(void *arg, const kv_hub_node_rec *n),
                           void *arg, kv_diag *d) {
    kv_hpg *s = impl;
    int rc = kv_pq_exec(&s->p, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY", d);
    if (rc) return rc;
    s->p.in_txn = true;
    kv_pq_args a = {0};
    kv_pq_arg_blob(&a, pk, 32);
    PGresult *nodes = kv_hpg_run(s, Q_NODE1, &a, d), *holds = nodes ? kv_hpg_run(s, Q_HOLD1, &a, d) : NULL;
    kv_hpg_rollback(s, 0);
    if (!nodes || !holds) rc = KV_EIO;
    else if (!PQntuples(nodes)) rc = kv_fail(d, KV_ENOTFOUND, "hub store: no such node");
    else rc = kv_hpg_emit(nodes, holds, cb, arg, d);
    PQclear(nodes);
    PQclear(holds);
    return rc;
}

static int kv_hpg_nonce_put(void *impl, uint8_t nonce[32], int64_t expires_ms, kv_diag *d) {
    kv_hpg *s = impl;
    kv_pq_args a = {0};
    kv_pq_arg_i64(&a, KV_HUB_MAX_NONCES);
    PGresult *r = kv_hpg_run(s, Q_NONCE_SLOT, &a, d);
    if (!r) return KV_EIO;
    int64_t slot = 0;
    int rc = PQntuples(r) == 1 ? kv_pq_i64(r, 0, 0, 0, KV_HUB_MAX_NONCES - 1, &slot, d, WHO, "nonce slot")
                               : kv_fail(d, KV_EIO, "hub store: no nonce slot");
    PQclear(r);
    if (rc) return rc;
    for (int i = 0; i < 4; i++) nonce[i] = (uint8_t)(slot >> (8 * i));
    kv_pq_args b = {0};
    kv_pq_arg_i64(&b, slot);
    kv_pq_arg_blob(&b, nonce, 32);
    kv_pq_arg_i64(&b, expires_ms);
    return kv_hpg_step(s, Q_NONCE_PUT, &b, NULL, d);
}

/* ---- market state and demand budgets ---------------------------------------- */

/* A float8 column: finite, in [0, max]. */
static int kv_hpg_f64(PGresult *r, int row, int col, double max, double *out, kv_diag *d, const char *what) {
    char t[64], *e;
    if (kv_pq_text(r, row, col, t, sizeof t, d, WHO, what)) return KV_EFORMAT;
    const double v = strtod(t, &e);
    if (e == t || *e || !(v >= 0 && v <= max)) return kv_fail(d, KV_EFORMAT, "%s: %s '%s' out of range", WHO, what, t);
    *out = v;
    return 0;
}

static int kv_hpg_mkt_each(void *impl, int (*cb)(void *arg, const kv_mkt_row *r), void *arg, kv_diag *d) {
    kv_hpg *s = impl;
    PGresult *r = kv_hpg_run(s, Q_MKT_ALL, NULL, d);
    if (!r) return KV_EIO;
    int rc = 0;
    for (int i = 0; !rc && i < PQntuples(r); i++) {
        kv_mkt_row w;
        memset(&w, 0, sizeof w);
        int64_t L, F, W, V;
        if (kv_pq_i64(r, i, 0, 0, UINT32_MAX, &L, d, WHO, "market layer") ||
            kv_pq_i64(r, i, 1, 0, UINT32_MAX, &F, d, WHO, "market first") ||
            kv_hpg_f64(r, i, 2, KV_MKT_MAX_RATE, &w.s.rate, d, "market rate") ||
            kv_hpg_f64(r, i, 3, KV_MKT_MAX_RATE, &w.s.wait, d, "market wait") ||
            kv_hpg_f64(r, i, 4, KV_MKT_MAX_RATE, &w.s.top_rate, d, "market top_rate") ||
            kv_pq_bytea(r, i, 5, w.s.top_pk, 32, NULL, d, WHO, "market top_pk") ||
            kv_pq_i64(r, i, 6, INT64_MIN, INT64_MAX, &w.s.rate_ms, d, WHO, "market rate_ms") ||
            kv_pq_i64(r, i, 7, 1, KV_MKT_MAX_WANTED, &W, d, WHO, "market wanted") ||
            kv_pq_i64(r, i, 8, INT64_MIN, INT64_MAX, &w.s.changed_ms, d, WHO, "market changed_ms") ||
            kv_pq_i64(r, i, 9, INT64_MIN, INT64_MAX, &w.s.above_ms, d, WHO, "market above_ms") ||
            kv_pq_i64(r, i, 10, INT64_MIN, INT64_MAX, &w.s.below_ms, d, WHO, "market below_ms") ||
            kv_pq_i64(r, i, 11, 1, INT64_MAX, &V, d, WHO, "market version")) {
            rc = KV_EFORMAT;
            break;
        }
        w.layer = (uint32_t)L;
        w.first = (uint32_t)F;
        w.s.wanted = (uint32_t)W;
        w.s.version = V;
        rc = cb(arg, &w);
    }
    PQclear(r);
    return rc;
}

static int kv_hpg_mkt_put(void *impl, const kv_mkt_row *w, int64_t prev, kv_diag *d) {
    kv_hpg *s = impl;
    char rate[40], wait[40], top[40];
    snprintf(rate, sizeof rate, "%.17g", w->s.rate);
    snprintf(wait, sizeof wait, "%.17g", w->s.wait);
    snprintf(top, sizeof top, "%.17g", w->s.top_rate);
    kv_pq_args a = {0};
    kv_pq_arg_i64(&a, w->layer);
    kv_pq_arg_i64(&a, w->first);
    kv_pq_arg_text(&a, rate);
    kv_pq_arg_text(&a, wait);
    kv_pq_arg_text(&a, top);
    kv_pq_arg_blob(&a, w->s.top_pk, 32);
    kv_pq_arg_i64(&a, w->s.rate_ms);
    kv_pq_arg_i64(&a, w->s.wanted);
    kv_pq_arg_i64(&a, w->s.changed_ms);
    kv_pq_arg_i64(&a, w->s.above_ms);
    kv_pq_arg_i64(&a, w->s.below_ms);
    kv_pq_arg_i64(&a, w->s.version);
    if (prev) kv_pq_arg_i64(&a, prev);
    long ch = 0;
    int rc = kv_hpg_step(s, prev ? Q_MKT_UPD : Q_MKT_INS, &a, &ch, d);
    if (!rc && ch != 1)
        rc = kv_fail(d, KV_EPROTO, "hub store: market state of layer %u first %u changed meanwhile", w->layer,
                     w->first);
    return rc;
}

/* The locked budget row (made first when absent): window start and use,
 * after a window that ended starts over. */
static int kv_hpg_budget(kv_hpg *s, int q_new, int q_get, const kv_pq_args *key, int64_t now, int64_t win,
                         int64_t *ws, int64_t *used, int64_t *counter, kv_diag *d) {
    kv_pq_args a = *key;
    kv_pq_arg_i64(&a, now);
    int rc = kv_hpg_step(s, q_new, &a, NULL, d);
    if (rc) return rc;
    PGresult *r = kv_hpg_run(s, q_get, key, d);
    if (!r) return KV_EIO;
    rc = PQntuples(r) != 1 ? kv_fail(d, KV_EIO, "%s: a demand budget row went away", WHO)
         : kv_pq_i64(r, 0, 0, INT64_MIN, INT64_MAX, ws, d, WHO, "demand window_ms") ||
                   kv_pq_i64(r, 0, 1, 0, INT64_MAX, used, d, WHO, "demand used") ||
                   (counter && kv_pq_i64(r, 0, 2, 0, INT64_MAX, counter, d, WHO, "demand counter"))
             ? KV_EFORMAT
             : 0;
    PQclear(r);
    if (!rc && !(*ws <= now && now - *ws < win)) {
        *ws = now;
        *used = 0;
    }
    return rc;
}

static int kv_hpg_demand_charge(void *impl, const uint8_t pk[32], uint64_t counter, const char *net, int64_t now,
                                const kv_demand_budget *b, uint64_t tokens, uint64_t *granted, kv_diag *d) {
    kv_hpg *s = impl;
    *granted = 0;
    if (counter > (uint64_t)INT64_MAX) return kv_fail(d, KV_EPROTO, "demand: counter out of range");
    int rc = kv_hpg_begin(s, d);
    if (rc) return rc;
    kv_pq_args kk = {0}, nk = {0};
    kv_pq_arg_blob(&kk, pk, 32);
    kv_pq_arg_text(&nk, net);
    int64_t kw, ku, kc, nw, nu;
    if ((rc = kv_hpg_budget(s, Q_DK_NEW, Q_DK_GET, &kk, now, b->window_ms, &kw, &ku, &kc, d)) ||
        (rc = kv_hpg_budget(s, Q_DN_NEW, Q_DN_GET, &nk, now, b->window_ms, &nw, &nu, NULL, d)))
        return kv_hpg_rollback(s, rc);
    if ((uint64_t)kc >= counter)
        return kv_hpg_rollback(s, kv_fail(d, KV_EPROTO, "replayed or stale demand report: counter not above last "
                                          "accepted %lld", (long long)kc));
    uint64_t g = tokens;
    const uint64_t kl = b->key_tokens > (uint64_t)ku ? b->key_tokens - (uint64_t)ku : 0,
                   nl = b->net_tokens > (uint64_t)nu ? b->net_tokens - (uint64_t)nu : 0;
    if (g > kl) g = kl;
    if (g > nl) g = nl;
    kv_pq_args a = kk, c = nk, p = {0};
    kv_pq_arg_i64(&a, (int64_t)counter);
    kv_pq_arg_i64(&a, kw);
    kv_pq_arg_i64(&a, ku + (int64_t)g);
    kv_pq_arg_i64(&c, nw);
    kv_pq_arg_i64(&c, nu + (int64_t)g);
    kv_pq_arg_i64(&p, now - 2 * b->window_ms);
    if ((rc = kv_hpg_step(s, Q_DK_PUT, &a, NULL, d)) || (rc = kv_hpg_step(s, Q_DN_PUT, &c, NULL, d)) ||
        (rc = kv_hpg_step(s, Q_DK_PRUNE, &p, NULL, d)) || (rc = kv_hpg_step(s, Q_DN_PRUNE, &p, NULL, d)))
        return kv_hpg_rollback(s, rc);
    if ((rc = kv_hpg_commit(s, d))) return rc;
    *granted = g;
    return 0;
}

const kv_hub_store_ops kv_hub_store_pg = {
    .name = "postgresql",
    .shared = true,
    .open = kv_hpg_open,
    .close = kv_hpg_close,
    .meta_get = kv_hpg_meta_get,
    .meta_put = kv_hpg_meta_put,
    .meta_put_new = kv_hpg_meta_put_new,
    .node_put = kv_hpg_node_put,
    .node_touch = kv_hpg_node_touch,
    .node_drop_shards = kv_hpg_node_drop_shards,
    .node_each = kv_hpg_node_each,
    .node_get = kv_hpg_node_get,
    .nonce_put = kv_hpg_nonce_put,
    .mkt_each = kv_hpg_mkt_each,
    .mkt_put = kv_hpg_mkt_put,
    .demand_charge = kv_hpg_demand_charge,
};

#else /* built without libpq */

static int kv_hpg_none(void **impl, const char *uri, kv_diag *d) {
    *impl = NULL;
    return kv_fail(d, KV_EUNSUPPORTED,
                   "hub store: '%.60s' names PostgreSQL, but this kvasir was built without libpq "
                   "(install libpq-dev and rebuild)", uri);
}
static void kv_hpg_noclose(void *impl) { (void)impl; }
const kv_hub_store_ops kv_hub_store_pg = {.name = "postgresql", .shared = true, .open = kv_hpg_none,
                                          .close = kv_hpg_noclose};
#endif
