/* The PostgreSQL backend of the ledger store (store.h), for several
 * gateways (processes, machines) settling into one ledger.
 *
 * Serialization. begin_write opens a READ COMMITTED transaction and takes
 * one transaction-scoped advisory lock that every writer of every process
 * takes first, so writers queue exactly as under SQLite's BEGIN IMMEDIATE:
 * a balance read after the lock cannot change before commit, and a spend
 * that it does not cover is refused inside the transaction. (READ COMMITTED
 * matters: each statement after the lock sees every commit made before it;
 * a REPEATABLE READ snapshot would be taken before the wait.) Accounts are
 * also read FOR UPDATE inside a write, so a writer that did not take the
 * lock would still block on the rows, and the schema's CHECKs (balance >= 0
 * except the mint's, amount > 0) and UNIQUE transfer ids, authorization
 * refs and receipts hold against any writer at all. begin_read is a
 * REPEATABLE READ READ ONLY snapshot, so a check sees one consistent state.
 *
 * A process killed mid-transaction loses its connection and PostgreSQL
 * rolls the transaction back: nothing half-written, nothing doubled.
 *
 * Tables live in schema kvledger (the hub's in kvhub), so the hub and the
 * ledger may share one database; the tables and columns are those of the
 * SQLite backend. Every value read back is bounds-checked (pg/pq.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ledger/store.h"
#include "pg/pq.h"

#ifdef KV_HAVE_PG
#define WHO "ledger store"
#define KV_LEDGER_LOCK "7079018202"

enum {
    Q_META_GET, Q_META_PUT, Q_ACCT_GET, Q_ACCT_LOCK, Q_ACCT_PUT, Q_XFER_GET, Q_XFER_PUT, Q_AUTH_GET, Q_AUTH_PUT,
    Q_AUTH_HELD, Q_RCPT_USED, Q_RCPT_PUT, Q_EACH_ALL, Q_EACH_ACCT, Q_RCPT_SUM, Q_CHECK0, Q_COUNT = Q_CHECK0 + 20
};
static const char *const kv_sql[Q_CHECK0] = {
    [Q_META_GET] = "SELECT value FROM meta WHERE key=$1",
    [Q_META_PUT] = "INSERT INTO meta(key,value) VALUES($1,$2) ON CONFLICT(key) DO UPDATE SET value=EXCLUDED.value",
    [Q_ACCT_GET] = "SELECT kind,balance,debits,credits FROM accounts WHERE id=$1",
    [Q_ACCT_LOCK] = "SELECT kind,balance,debits,credits FROM accounts WHERE id=$1 FOR UPDATE",
    [Q_ACCT_PUT] = "INSERT INTO accounts(id,kind,balance,debits,credits) VALUES($1,$2,$3,$4,$5) "
                   "ON CONFLICT(id) DO UPDATE SET balance=EXCLUDED.balance,debits=EXCLUDED.debits,"
                   "credits=EXCLUDED.credits",
    [Q_XFER_GET] = "SELECT seq,debit,credit,amount,code,ref,ts FROM transfers WHERE id=$1",
    [Q_XFER_PUT] = "INSERT INTO transfers(id,debit,credit,amount,code,ref,ts) VALUES($1,$2,$3,$4,$5,$6,$7)",
    [Q_AUTH_GET] = "SELECT gateway,max,expires,state,settle_digest,cost,fee,to_nodes,returned "
                   "FROM auths WHERE consumer=$1 AND nonce=$2",
    [Q_AUTH_PUT] = "INSERT INTO auths(consumer,nonce,gateway,max,expires,state,settle_digest,cost,fee,to_nodes,"
                   "returned,ref) VALUES($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12) ON CONFLICT(consumer,nonce) DO "
                   "UPDATE SET gateway=EXCLUDED.gateway,max=EXCLUDED.max,expires=EXCLUDED.expires,"
                   "state=EXCLUDED.state,settle_digest=EXCLUDED.settle_digest,cost=EXCLUDED.cost,fee=EXCLUDED.fee,"
                   "to_nodes=EXCLUDED.to_nodes,returned=EXCLUDED.returned,ref=EXCLUDED.ref",
    [Q_AUTH_HELD] = "SELECT consumer,nonce FROM auths WHERE gateway=$1 AND state=1 ORDER BY consumer,nonce LIMIT $2",
    [Q_RCPT_USED] = "SELECT 1 FROM receipts WHERE node=$1 AND (nonce=$2 OR (consumer=$3 AND auth_nonce=$4))",
    [Q_RCPT_PUT] = "INSERT INTO receipts(node,nonce,consumer,auth_nonce,n_products,transfer_id) "
                   "VALUES($1,$2,$3,$4,$5,$6)",
    [Q_EACH_ALL] = "SELECT id FROM transfers ORDER BY seq",
    [Q_EACH_ACCT] = "SELECT id FROM transfers WHERE debit=$1 OR credit=$1 ORDER BY seq",
    [Q_RCPT_SUM] = "SELECT COUNT(*)::bigint, COALESCE(SUM(n_products),0)::bigint FROM receipts WHERE node=$1",
};

static const char *const kv_schema =
    "CREATE SCHEMA IF NOT EXISTS kvledger;"
    "CREATE TABLE IF NOT EXISTS meta(key text PRIMARY KEY, value bytea NOT NULL);"
    "CREATE TABLE IF NOT EXISTS accounts(id text PRIMARY KEY, kind integer NOT NULL,"
    " balance bigint NOT NULL, debits bigint NOT NULL, credits bigint NOT NULL,"
    " CHECK (kind = 5 OR balance >= 0), CHECK (debits >= 0 AND credits >= 0));"
    "CREATE TABLE IF NOT EXISTS transfers(seq bigserial PRIMARY KEY,"
    " id bytea NOT NULL UNIQUE, debit text NOT NULL REFERENCES accounts(id),"
    " credit text NOT NULL REFERENCES accounts(id), amount bigint NOT NULL CHECK (amount > 0),"
    " code integer NOT NULL, ref bytea NOT NULL, ts bigint NOT NULL, CHECK (debit <> credit));"
    "CREATE INDEX IF NOT EXISTS transfers_debit ON transfers(debit);"
    "CREATE INDEX IF NOT EXISTS transfers_credit ON transfers(credit);"
    "CREATE INDEX IF NOT EXISTS transfers_ref ON transfers(ref);"
    "CREATE TABLE IF NOT EXISTS auths(consumer bytea NOT NULL, nonce bytea NOT NULL,"
    " gateway text NOT NULL, max bigint NOT NULL, expires bigint NOT NULL, state integer NOT NULL,"
    " settle_digest bytea NOT NULL, cost bigint NOT NULL, fee bigint NOT NULL,"
    " to_nodes bigint NOT NULL, returned bigint NOT NULL, ref bytea NOT NULL UNIQUE,"
    " PRIMARY KEY(consumer, nonce));"
    "CREATE INDEX IF NOT EXISTS auths_held ON auths(gateway, state);"
    "CREATE TABLE IF NOT EXISTS receipts(node bytea NOT NULL, nonce bytea NOT NULL,"
    " consumer bytea NOT NULL, auth_nonce bytea NOT NULL, n_products bigint NOT NULL,"
    " transfer_id bytea NOT NULL UNIQUE, PRIMARY KEY(node, nonce), UNIQUE(node, consumer, auth_nonce));";

struct kv_store {
    kv_pq p;
    bool write; /* inside a write transaction: account reads lock their rows */
};

static PGresult *kv_lp_run(kv_store *s, int q, const kv_pq_args *a, char state[6], kv_diag *d) {
    return kv_pq_run(&s->p, q, kv_sql[q], a, state, d);
}

static void kv_lp_close(kv_store *s) {
    if (!s) return;
    kv_pq_close(&s->p);
    free(s);
}

static int kv_lp_open(kv_store **out, const char *path, kv_diag *d) {
    *out = NULL;
    kv_store *s = calloc(1, sizeof *s);
    if (!s) return kv_fail(d, KV_ENOMEM, "ledger store: out of memory");
    int rc = kv_pq_open(&s->p, kv_pq_uri(path), WHO, "SET search_path = kvledger", d);
    if (rc) {
        kv_lp_close(s);
        return rc;
    }
    *out = s;
    return 0;
}

/* A reader: every transaction of the session is read-only (a write fails). */
static int kv_lp_open_ro(kv_store **out, const char *path, kv_diag *d) {
    int rc = kv_lp_open(out, path, d);
    if (!rc && (rc = kv_pq_exec(&(*out)->p, "SET default_transaction_read_only = on", d))) {
        kv_lp_close(*out);
        *out = NULL;
    }
    return rc;
}

static int kv_lp_init_schema(kv_store *s, kv_diag *d) { return kv_pq_exec(&s->p, kv_schema, d); }

static int kv_lp_begin(kv_store *s, const char *sql, bool write, kv_diag *d) {
    int rc = kv_pq_exec(&s->p, sql, d);
    if (!rc) {
        s->p.in_txn = true;
        s->write = write;
    }
    return rc;
}
static int kv_lp_begin_write(kv_store *s, kv_diag *d) {
    return kv_lp_begin(s, "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_advisory_xact_lock(" KV_LEDGER_LOCK ")",
                       true, d);
}
static int kv_lp_begin_read(kv_store *s, kv_diag *d) {
    return kv_lp_begin(s, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY", false, d);
}
static int kv_lp_commit(kv_store *s, kv_diag *d) {
    int rc = kv_pq_exec(&s->p, "COMMIT", d);
    if (rc) kv_pq_exec(&s->p, "ROLLBACK", NULL);
    s->p.in_txn = s->write = false;
    return rc;
}
static void kv_lp_rollback(kv_store *s) {
    if (s->p.in_txn) kv_pq_exec(&s->p, "ROLLBACK", NULL);
    s->p.in_txn = s->write = false;
}

/* Runs a statement that returns at most one row: 0 with *r set, KV_ENOTFOUND
 * (no row; *r NULL), or KV_EIO. */
static int kv_lp_one(kv_store *s, int q, const kv_pq_args *a, PGresult **r, kv_diag *d) {
    char st[6];
    *r = kv_lp_run(s, q, a, st, d);
    if (!*r) return !strcmp(st, "42P01") ? kv_fail(d, KV_ENOTFOUND, "no ledger schema") : KV_EIO;
    if (PQntuples(*r) == 0) {
        PQclear(*r);
        *r = NULL;
        return KV_ENOTFOUND;
    }
    return 0;
}
static int kv_lp_do(kv_store *s, int q, const kv_pq_args *a, kv_diag *d) {
    PGresult *r = kv_lp_run(s, q, a, NULL, d);
    PQclear(r);
    return r ? 0 : KV_EIO;
}
static int kv_lp_u64(PGresult *r, int col, uint64_t max, uint64_t *out, kv_diag *d, const char *what) {
    int64_t v;
    int rc = kv_pq_i64(r, 0, col, 0, max > INT64_MAX ? INT64_MAX : (int64_t)max, &v, d, WHO, what);
    if (!rc) *out = (uint64_t)v;
    return rc;
}

static int kv_lp_meta_get(kv_store *s, const char *key, uint8_t *val, size_t cap, size_t *len, kv_diag *d) {
    kv_pq_args a = {0};
    kv_pq_arg_text(&a, key);
    PGresult *r;
    int rc = kv_lp_one(s, Q_META_GET, &a, &r, d);
    if (!rc) rc = kv_pq_bytea(r, 0, 0, val, cap, len, d, WHO, "meta value");
    PQclear(r);
    return rc;
}
static int kv_lp_meta_put(kv_store *s, const char *key, const uint8_t *val, size_t len, kv_diag *d) {
    kv_pq_args a = {0};
    kv_pq_arg_text(&a, key);
    kv_pq_arg_blob(&a, val, len);
    return kv_lp_do(s, Q_META_PUT, &a, d);
}

static int kv_lp_account_get(kv_store *s, const char *id, kv_store_account *a, kv_diag *d) {
    kv_pq_args p = {0};
    kv_pq_arg_text(&p, id);
    PGresult *r;
    int rc = kv_lp_one(s, s->write ? Q_ACCT_LOCK : Q_ACCT_GET, &p, &r, d);
    if (rc) return rc;
    memset(a, 0, sizeof *a);
    snprintf(a->id, sizeof a->id, "%s", id);
    uint64_t kind = 0;
    int64_t bal = 0;
    if (!(rc = kv_lp_u64(r, 0, KV_ACCT_MINT, &kind, d, "account kind")) &&
        !(rc = kv_pq_i64(r, 0, 1, -(int64_t)KV_LEDGER_MAX_AMOUNT, (int64_t)KV_LEDGER_MAX_AMOUNT, &bal, d, WHO,
                         "account balance")) &&
        !(rc = kv_lp_u64(r, 2, KV_LEDGER_MAX_AMOUNT * 4, &a->debits, d, "account debits")) &&
        !(rc = kv_lp_u64(r, 3, KV_LEDGER_MAX_AMOUNT * 4, &a->credits, d, "account credits"))) {
        if (kind == 0) rc = kv_fail(d, KV_EFORMAT, "ledger store: account '%s' has a corrupt row", id);
        a->kind = (int)kind;
        a->balance = bal;
    }
    PQclear(r);
    return rc;
}
static int kv_lp_account_put(kv_store *s, const kv_store_account *a, kv_diag *d) {
    kv_pq_args p = {0};
    kv_pq_arg_text(&p, a->id);
    kv_pq_arg_i64(&p, a->kind);
    kv_pq_arg_i64(&p, a->balance);
    kv_pq_arg_i64(&p, (int64_t)a->debits);
    kv_pq_arg_i64(&p, (int64_t)a->credits);
    return kv_lp_do(s, Q_ACCT_PUT, &p, d);
}

static int kv_lp_transfer_get(kv_store *s, const uint8_t id[16], kv_store_transfer *t, kv_diag *d) {
    kv_pq_args p = {0};
    kv_pq_arg_blob(&p, id, 16);
    PGresult *r;
    int rc = kv_lp_one(s, Q_XFER_GET, &p, &r, d);
    if (rc) return rc;
    memset(t, 0, sizeof *t);
    memcpy(t->id, id, 16);
    uint64_t code = 0, ts = 0;
    if (!(rc = kv_pq_i64(r, 0, 0, 1, INT64_MAX, &t->seq, d, WHO, "transfer seq")) &&
        !(rc = kv_pq_text(r, 0, 1, t->debit, sizeof t->debit, d, WHO, "transfer debit")) &&
        !(rc = kv_pq_text(r, 0, 2, t->credit, sizeof t->credit, d, WHO, "transfer credit")) &&
        !(rc = kv_lp_u64(r, 3, KV_LEDGER_MAX_AMOUNT, &t->amount, d, "transfer amount")) &&
        !(rc = kv_lp_u64(r, 4, KV_XFER_COUNT - 1, &code, d, "transfer code")) &&
        !(rc = kv_pq_bytea(r, 0, 5, t->ref, KV_REF_MAX, &t->ref_len, d, WHO, "transfer ref")) &&
        !(rc = kv_lp_u64(r, 6, INT64_MAX, &ts, d, "transfer time"))) {
        t->code = (int)code;
        t->ts = (int64_t)ts;
    }
    PQclear(r);
    return rc;
}
static int kv_lp_transfer_put(kv_store *s, const kv_store_transfer *t, kv_diag *d) {
    kv_pq_args p = {0};
    kv_pq_arg_blob(&p, t->id, 16);
    kv_pq_arg_text(&p, t->debit);
    kv_pq_arg_text(&p, t->credit);
    kv_pq_arg_i64(&p, (int64_t)t->amount);
    kv_pq_arg_i64(&p, t->code);
    kv_pq_arg_blob(&p, t->ref, t->ref_len);
    kv_pq_arg_i64(&p, t->ts);
    return kv_lp_do(s, Q_XFER_PUT, &p, d);
}

static int kv_lp_auth_get(kv_store *s, const uint8_t consumer[32], const uint8_t nonce[16], kv_store_auth *a,
                          kv_diag *d) {
    kv_pq_args p = {0};
    kv_pq_arg_blob(&p, consumer, 32);
    kv_pq_arg_blob(&p, nonce, 16);
    PGresult *r;
    int rc = kv_lp_one(s, Q_AUTH_GET, &p, &r, d);
    if (rc) return rc;
    memset(a, 0, sizeof *a);
    memcpy(a->consumer, consumer, 32);
    memcpy(a->nonce, nonce, 16);
    uint64_t state = 0;
    if (!(rc = kv_pq_text(r, 0, 0, a->gateway, sizeof a->gateway, d, WHO, "auth gateway")) &&
        !(rc = kv_lp_u64(r, 1, KV_LEDGER_MAX_AMOUNT, &a->max, d, "auth max")) &&
        !(rc = kv_lp_u64(r, 2, INT64_MAX, &a->expires, d, "auth expires")) &&
        !(rc = kv_lp_u64(r, 3, KV_AUTH_RELEASED, &state, d, "auth state")) &&
        !(rc = kv_pq_bytea(r, 0, 4, a->settle_digest, 32, NULL, d, WHO, "auth settle digest")) &&
        !(rc = kv_lp_u64(r, 5, KV_LEDGER_MAX_AMOUNT, &a->cost, d, "auth cost")) &&
        !(rc = kv_lp_u64(r, 6, KV_LEDGER_MAX_AMOUNT, &a->fee, d, "auth fee")) &&
        !(rc = kv_lp_u64(r, 7, KV_LEDGER_MAX_AMOUNT, &a->to_nodes, d, "auth to_nodes")) &&
        !(rc = kv_lp_u64(r, 8, KV_LEDGER_MAX_AMOUNT, &a->returned, d, "auth returned"))) {
        if (state == 0) rc = kv_fail(d, KV_EFORMAT, "ledger store: auth state 0");
        a->state = (int)state;
    }
    PQclear(r);
    return rc;
}
static int kv_lp_auth_put(kv_store *s, const kv_store_auth *a, kv_diag *d) {
    uint8_t ref[48];
    memcpy(ref, a->consumer, 32);
    memcpy(ref + 32, a->nonce, 16);
    kv_pq_args p = {0};
    kv_pq_arg_blob(&p, a->consumer, 32);
    kv_pq_arg_blob(&p, a->nonce, 16);
    kv_pq_arg_text(&p, a->gateway);
    kv_pq_arg_i64(&p, (int64_t)a->max);
    kv_pq_arg_i64(&p, (int64_t)a->expires);
    kv_pq_arg_i64(&p, a->state);
    kv_pq_arg_blob(&p, a->settle_digest, 32);
    kv_pq_arg_i64(&p, (int64_t)a->cost);
    kv_pq_arg_i64(&p, (int64_t)a->fee);
    kv_pq_arg_i64(&p, (int64_t)a->to_nodes);
    kv_pq_arg_i64(&p, (int64_t)a->returned);
    kv_pq_arg_blob(&p, ref, 48);
    return kv_lp_do(s, Q_AUTH_PUT, &p, d);
}
static int kv_lp_auth_held(kv_store *s, const char *gateway, kv_store_auth *out, size_t cap, size_t *n,
                           kv_diag *d) {
    uint8_t keys[64][48];
    *n = 0;
    if (cap > 64) cap = 64;
    kv_pq_args p = {0};
    kv_pq_arg_text(&p, gateway);
    kv_pq_arg_i64(&p, (int64_t)cap);
    PGresult *r = kv_lp_run(s, Q_AUTH_HELD, &p, NULL, d);
    if (!r) return KV_EIO;
    int rc = 0;
    size_t k = 0;
    for (int i = 0; i < PQntuples(r) && k < cap; i++, k++) {
        if ((rc = kv_pq_bytea(r, i, 0, keys[k], 32, NULL, d, WHO, "auth consumer")) ||
            (rc = kv_pq_bytea(r, i, 1, keys[k] + 32, 16, NULL, d, WHO, "auth nonce")))
            break;
    }
    PQclear(r);
    if (rc) return rc;
    for (size_t i = 0; i < k; i++)
        if ((rc = kv_lp_auth_get(s, keys[i], keys[i] + 32, &out[i], d))) return rc;
    *n = k;
    return 0;
}
static int kv_lp_receipt_used(kv_store *s, const kv_store_receipt *rc_, kv_diag *d) {
    kv_pq_args p = {0};
    kv_pq_arg_blob(&p, rc_->node, 32);
    kv_pq_arg_blob(&p, rc_->nonce, 16);
    kv_pq_arg_blob(&p, rc_->consumer, 32);
    kv_pq_arg_blob(&p, rc_->auth_nonce, 16);
    PGresult *r;
    int rc = kv_lp_one(s, Q_RCPT_USED, &p, &r, d);
    PQclear(r);
    if (rc == KV_ENOTFOUND) return 0;
    return rc ? rc : 1;
}
static int kv_lp_receipt_put(kv_store *s, const kv_store_receipt *r, kv_diag *d) {
    kv_pq_args p = {0};
    kv_pq_arg_blob(&p, r->node, 32);
    kv_pq_arg_blob(&p, r->nonce, 16);
    kv_pq_arg_blob(&p, r->consumer, 32);
    kv_pq_arg_blob(&p, r->auth_nonce, 16);
    kv_pq_arg_i64(&p, (int64_t)r->n_products);
    kv_pq_arg_blob(&p, r->transfer_id, 16);
    return kv_lp_do(s, Q_RCPT_PUT, &p, d);
}

static int kv_lp_node_receipts(kv_store *s, const uint8_t node[32], uint64_t *n, uint64_t *products, kv_diag *d) {
    *n = *products = 0;
    kv_pq_args p = {0};
    kv_pq_arg_blob(&p, node, 32);
    PGresult *r;
    int rc = kv_lp_one(s, Q_RCPT_SUM, &p, &r, d);
    if (rc) return rc == KV_ENOTFOUND ? kv_fail(d, KV_EIO, "ledger store: receipt sum: no row") : rc;
    if (!(rc = kv_lp_u64(r, 0, INT64_MAX, n, d, "receipt count")))
        rc = kv_lp_u64(r, 1, KV_LEDGER_MAX_AMOUNT, products, d, "receipt products");
    PQclear(r);
    return rc;
}

static int kv_lp_each_transfer(kv_store *s, const char *account, int (*fn)(void *ctx, const kv_store_transfer *t),
                               void *ctx, kv_diag *d) {
    kv_pq_args p = {0};
    if (account) kv_pq_arg_text(&p, account);
    PGresult *r = kv_lp_run(s, account ? Q_EACH_ACCT : Q_EACH_ALL, &p, NULL, d);
    if (!r) return KV_EIO;
    int n = PQntuples(r), rc = 0;
    uint8_t (*ids)[16] = malloc((size_t)(n ? n : 1) * 16);
    if (!ids) rc = kv_fail(d, KV_ENOMEM, "ledger store: out of memory");
    for (int i = 0; !rc && i < n; i++) rc = kv_pq_bytea(r, i, 0, ids[i], 16, NULL, d, WHO, "transfer id");
    PQclear(r);
    /* rows after the ids: the callback may use this store */
    for (int i = 0; !rc && i < n; i++) {
        kv_store_transfer t;
        if ((rc = kv_lp_transfer_get(s, ids[i], &t, d))) break;
        rc = fn(ctx, &t);
    }
    free(ids);
    return rc;
}

static int kv_lp_check(kv_store *s, kv_store_check *c, kv_diag *d) {
    memset(c, 0, sizeof *c);
    /* sums are numeric in PostgreSQL; the cast to bigint fails on overflow,
     * so an aggregate out of range is an error, never a wrapped value */
    static const char *const q[] = {
        "SELECT count(*) FROM accounts",
        "SELECT count(*) FROM transfers",
        "SELECT count(*) FROM receipts",
        "SELECT coalesce(sum(amount),0)::bigint FROM transfers",
        "SELECT coalesce(sum(debits),0)::bigint FROM accounts",
        "SELECT coalesce(sum(credits),0)::bigint FROM accounts",
        "SELECT count(*) FROM accounts a WHERE a.debits <> coalesce((SELECT sum(amount) FROM transfers"
        " WHERE debit=a.id),0) OR a.credits <> coalesce((SELECT sum(amount) FROM transfers WHERE credit=a.id),0)"
        " OR a.balance <> a.credits - a.debits",
        "SELECT count(*) FROM accounts WHERE (kind <> 5 AND balance < 0) OR (kind = 5 AND balance > 0)",
        "SELECT coalesce(sum(balance),0)::bigint FROM accounts WHERE kind <> 5",
        "SELECT coalesce(sum(amount),0)::bigint FROM transfers WHERE code = 1",
        "SELECT coalesce(sum(balance),0)::bigint FROM accounts WHERE kind = 5",
        "SELECT coalesce(sum(balance),0)::bigint FROM accounts WHERE kind = 4",
        "SELECT coalesce(sum(max),0)::bigint FROM auths WHERE state = 1",
        "SELECT (SELECT count(*) FROM transfers t WHERE code = 4 AND NOT EXISTS (SELECT 1 FROM receipts r"
        " WHERE r.transfer_id = t.id AND t.credit = 'node:' || encode(r.node, 'hex'))) +"
        " (SELECT count(*) FROM receipts r WHERE NOT EXISTS (SELECT 1 FROM transfers t WHERE t.id = r.transfer_id"
        " AND t.code = 4))",
        "SELECT count(*) FROM transfers t JOIN accounts a ON a.id = t.credit WHERE a.kind = 2 AND t.code <> 4",
        "SELECT count(*) FROM auths u WHERE (SELECT count(*) FROM transfers WHERE code = 2 AND ref = u.ref) <> 1"
        " OR coalesce((SELECT sum(amount) FROM transfers WHERE debit = 'escrow' AND ref = u.ref),0)"
        " <> CASE WHEN u.state = 1 THEN 0 ELSE u.max END"
        " OR (u.state = 2 AND u.fee + u.to_nodes + u.returned <> u.max)",
        "SELECT count(*) FROM auths WHERE state = 1",
        "SELECT count(*) FROM auths WHERE state = 2",
        "SELECT count(*) FROM auths WHERE state = 3",
        "SELECT a.id FROM accounts a WHERE a.debits <> coalesce((SELECT sum(amount) FROM"
        " transfers WHERE debit=a.id),0) OR a.credits <> coalesce((SELECT sum(amount) FROM"
        " transfers WHERE credit=a.id),0) OR a.balance <> a.credits - a.debits ORDER BY a.id LIMIT 1",
    };
    _Static_assert(sizeof q / sizeof q[0] == 20, "one statement slot per check query");
    int64_t v[19];
    for (int i = 0; i < 19; i++) {
        PGresult *r = kv_pq_run(&s->p, Q_CHECK0 + i, q[i], NULL, NULL, d);
        if (!r) return KV_EIO;
        int rc = PQntuples(r) == 1 ? kv_pq_i64(r, 0, 0, i == 10 ? INT64_MIN : 0, INT64_MAX, &v[i], d, WHO, "aggregate")
                                   : kv_fail(d, KV_EIO, "ledger store: check %d returned no row", i);
        PQclear(r);
        if (rc) return rc;
    }
    c->n_accounts = (uint64_t)v[0];
    c->n_transfers = (uint64_t)v[1];
    c->n_receipts = (uint64_t)v[2];
    c->sum_amount = (uint64_t)v[3];
    c->sum_debits = (uint64_t)v[4];
    c->sum_credits = (uint64_t)v[5];
    c->n_bad_account = (uint64_t)v[6];
    c->n_negative = (uint64_t)v[7];
    c->supply = (uint64_t)v[8];
    c->issued = (uint64_t)v[9];
    c->mint_balance = v[10];
    c->escrow_balance = (uint64_t)v[11];
    c->held_sum = (uint64_t)v[12];
    c->n_untraced_reward = (uint64_t)v[13];
    c->n_bad_node_credit = (uint64_t)v[14];
    c->n_bad_auth = (uint64_t)v[15];
    c->n_held = (uint64_t)v[16];
    c->n_settled = (uint64_t)v[17];
    c->n_released = (uint64_t)v[18];
    if (c->n_bad_account) {
        PGresult *r = kv_pq_run(&s->p, Q_CHECK0 + 19, q[19], NULL, NULL, d);
        if (r && PQntuples(r) == 1 &&
            kv_pq_text(r, 0, 0, c->bad_account, sizeof c->bad_account, NULL, WHO, "account id"))
            snprintf(c->bad_account, sizeof c->bad_account, "?");
        PQclear(r);
    }
    return 0;
}

const kv_store_ops kv_store_pg = {
    .name = "postgresql",
    .open = kv_lp_open,
    .close = kv_lp_close,
    .init_schema = kv_lp_init_schema,
    .begin_write = kv_lp_begin_write,
    .begin_read = kv_lp_begin_read,
    .commit = kv_lp_commit,
    .rollback = kv_lp_rollback,
    .meta_get = kv_lp_meta_get,
    .meta_put = kv_lp_meta_put,
    .account_get = kv_lp_account_get,
    .account_put = kv_lp_account_put,
    .transfer_get = kv_lp_transfer_get,
    .transfer_put = kv_lp_transfer_put,
    .auth_get = kv_lp_auth_get,
    .auth_put = kv_lp_auth_put,
    .auth_held = kv_lp_auth_held,
    .receipt_used = kv_lp_receipt_used,
    .receipt_put = kv_lp_receipt_put,
    .each_transfer = kv_lp_each_transfer,
    .check = kv_lp_check,
    .node_receipts = kv_lp_node_receipts,
    .open_ro = kv_lp_open_ro,
};

#else /* built without libpq */

static int kv_lp_none(kv_store **out, const char *path, kv_diag *d) {
    *out = NULL;
    return kv_fail(d, KV_EUNSUPPORTED,
                   "ledger store: '%.60s' names PostgreSQL, but this kvasir was built without libpq "
                   "(install libpq-dev and rebuild)", path);
}
const kv_store_ops kv_store_pg = {.name = "postgresql", .open = kv_lp_none, .open_ro = kv_lp_none};
#endif
