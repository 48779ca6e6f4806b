/* The SQLite backend of the ledger store (store.h): WAL journal,
 * synchronous=FULL (a committed transfer survives a crash of the process or
 * the machine), busy_timeout so writers from many processes queue instead of
 * failing, BEGIN IMMEDIATE for every write transaction so the write lock is
 * taken before any balance is read. Every statement is prepared once per
 * connection with bound parameters; no SQL is ever built from data. Every
 * value read back is bounds-checked (a corrupt row is KV_EFORMAT). */
#include <sqlite3.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ledger/store.h"

enum {
    Q_META_GET, Q_META_PUT, Q_ACCT_GET, Q_ACCT_PUT, Q_XFER_GET, Q_XFER_PUT, Q_AUTH_GET, Q_AUTH_PUT,
    Q_AUTH_HELD, Q_RCPT_USED, Q_RCPT_PUT, Q_EACH_ALL, Q_EACH_ACCT, Q_RCPT_SUM, Q_COUNT
};
static const char *const kv_sql[Q_COUNT] = {
    [Q_META_GET] = "SELECT value FROM meta WHERE key=?1",
    [Q_META_PUT] = "INSERT OR REPLACE INTO meta(key,value) VALUES(?1,?2)",
    [Q_ACCT_GET] = "SELECT kind,balance,debits,credits FROM accounts WHERE id=?1",
    [Q_ACCT_PUT] = "INSERT INTO accounts(id,kind,balance,debits,credits) VALUES(?1,?2,?3,?4,?5) "
                   "ON CONFLICT(id) DO UPDATE SET balance=?3,debits=?4,credits=?5",
    [Q_XFER_GET] = "SELECT seq,debit,credit,amount,code,ref,ts FROM transfers WHERE id=?1",
    [Q_XFER_PUT] = "INSERT INTO transfers(id,debit,credit,amount,code,ref,ts) VALUES(?1,?2,?3,?4,?5,?6,?7)",
    [Q_AUTH_GET] = "SELECT gateway,max,expires,state,settle_digest,cost,fee,to_nodes,returned "
                   "FROM auths WHERE consumer=?1 AND nonce=?2",
    [Q_AUTH_PUT] = "INSERT OR REPLACE INTO auths(consumer,nonce,gateway,max,expires,state,"
                   "settle_digest,cost,fee,to_nodes,returned,ref) VALUES(?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12)",
    [Q_AUTH_HELD] = "SELECT consumer,nonce FROM auths WHERE gateway=?1 AND state=1 LIMIT ?2",
    [Q_RCPT_USED] = "SELECT 1 FROM receipts WHERE node=?1 AND (nonce=?2 OR (consumer=?3 AND auth_nonce=?4))",
    [Q_RCPT_PUT] = "INSERT INTO receipts(node,nonce,consumer,auth_nonce,n_products,transfer_id) "
                   "VALUES(?1,?2,?3,?4,?5,?6)",
    [Q_EACH_ALL] = "SELECT id FROM transfers ORDER BY seq",
    [Q_EACH_ACCT] = "SELECT id FROM transfers WHERE debit=?1 OR credit=?1 ORDER BY seq",
    [Q_RCPT_SUM] = "SELECT COUNT(*),COALESCE(SUM(n_products),0) FROM receipts WHERE node=?1",
};

static const char *const kv_schema =
    "CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value BLOB NOT NULL);"
    "CREATE TABLE IF NOT EXISTS accounts(id TEXT PRIMARY KEY, kind INTEGER NOT NULL,"
    " balance INTEGER NOT NULL, debits INTEGER NOT NULL, credits INTEGER NOT NULL,"
    " CHECK (kind = 5 OR balance >= 0), CHECK (debits >= 0 AND credits >= 0));"
    "CREATE TABLE IF NOT EXISTS transfers(seq INTEGER PRIMARY KEY AUTOINCREMENT,"
    " id BLOB NOT NULL UNIQUE, debit TEXT NOT NULL REFERENCES accounts(id),"
    " credit TEXT NOT NULL REFERENCES accounts(id), amount INTEGER NOT NULL CHECK (amount > 0),"
    " code INTEGER NOT NULL, ref BLOB NOT NULL, ts INTEGER NOT NULL, CHECK (debit <> credit));"
    "CREATE INDEX IF NOT EXISTS transfers_debit ON transfers(debit);"
    "CREATE INDEX IF NOT EXISTS transfers_credit ON transfers(credit);"
    "CREATE INDEX IF NOT EXISTS transfers_ref ON transfers(ref);"
    "CREATE TABLE IF NOT EXISTS auths(consumer BLOB NOT NULL, nonce BLOB NOT NULL,"
    " gateway TEXT NOT NULL, max INTEGER NOT NULL, expires INTEGER NOT NULL, state INTEGER NOT NULL,"
    " settle_digest BLOB NOT NULL, cost INTEGER NOT NULL, fee INTEGER NOT NULL,"
    " to_nodes INTEGER NOT NULL, returned INTEGER NOT NULL, ref BLOB NOT NULL UNIQUE,"
    " PRIMARY KEY(consumer, nonce));"
    "CREATE INDEX IF NOT EXISTS auths_held ON auths(gateway, state);"
    "CREATE TABLE IF NOT EXISTS receipts(node BLOB NOT NULL, nonce BLOB NOT NULL,"
    " consumer BLOB NOT NULL, auth_nonce BLOB NOT NULL, n_products INTEGER NOT NULL,"
    " transfer_id BLOB NOT NULL UNIQUE, PRIMARY KEY(node, nonce), UNIQUE(node, consumer, auth_nonce));";

struct kv_store {
    sqlite3 *db;
    sqlite3_stmt *st[Q_COUNT]; /* prepared lazily, finalized on close */
    int in_txn;
};

static int kv_sq_err(kv_store *s, kv_diag *d, const char *what) {
    return kv_fail(d, KV_EIO, "ledger store: %s: %s", what, sqlite3_errmsg(s->db));
}

static sqlite3_stmt *kv_sq_stmt(kv_store *s, int q, kv_diag *d) {
    if (!s->st[q] && sqlite3_prepare_v2(s->db, kv_sql[q], -1, &s->st[q], NULL) != SQLITE_OK) {
        kv_sq_err(s, d, "prepare");
        return NULL;
    }
    sqlite3_reset(s->st[q]);
    sqlite3_clear_bindings(s->st[q]);
    return s->st[q];
}

static int kv_sq_exec(kv_store *s, const char *sql, kv_diag *d) {
    char *msg = NULL;
    if (sqlite3_exec(s->db, sql, NULL, NULL, &msg) != SQLITE_OK) {
        int rc = kv_fail(d, KV_EIO, "ledger store: %s", msg ? msg : sqlite3_errmsg(s->db));
        sqlite3_free(msg);
        return rc;
    }
    return 0;
}

static void kv_sq_close(kv_store *s) {
    if (!s) return;
    for (int i = 0; i < Q_COUNT; i++) sqlite3_finalize(s->st[i]);
    sqlite3_close(s->db);
    free(s);
}

static int kv_sq_open_flags(kv_store **out, const char *path, bool ro, kv_diag *d) {
    *out = NULL;
    kv_store *s = calloc(1, sizeof *s);
    if (!s) return kv_fail(d, KV_ENOMEM, "ledger store: out of memory");
    const int flags = ro ? SQLITE_OPEN_READONLY | SQLITE_OPEN_NOMUTEX
                         : SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX;
    if (sqlite3_open_v2(path, &s->db, flags, NULL) != SQLITE_OK) {
        int rc = kv_fail(d, KV_EIO, "ledger store: cannot open '%s': %s", path,
                         s->db ? sqlite3_errmsg(s->db) : "out of memory");
        kv_sq_close(s);
        return rc;
    }
    sqlite3_busy_timeout(s->db, 60000);
    sqlite3_extended_result_codes(s->db, 1);
    /* a reader changes nothing, not even the journal mode (the writers set WAL) */
    int rc = ro ? kv_sq_exec(s, "PRAGMA query_only=ON;", d)
                : kv_sq_exec(s, "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON;", d);
    if (rc) {
        kv_diag_prefix(d, rc, "'%s'", path);
        kv_sq_close(s);
        return rc;
    }
    *out = s;
    return 0;
}
static int kv_sq_open(kv_store **out, const char *path, kv_diag *d) { return kv_sq_open_flags(out, path, false, d); }
static int kv_sq_open_ro(kv_store **out, const char *path, kv_diag *d) { return kv_sq_open_flags(out, path, true, d); }

static int kv_sq_init_schema(kv_store *s, kv_diag *d) { return kv_sq_exec(s, kv_schema, d); }

static int kv_sq_begin_write(kv_store *s, kv_diag *d) {
    int rc = kv_sq_exec(s, "BEGIN IMMEDIATE", d);
    if (!rc) s->in_txn = 1;
    return rc;
}
static int kv_sq_begin_read(kv_store *s, kv_diag *d) {
    int rc = kv_sq_exec(s, "BEGIN DEFERRED", d);
    if (!rc) s->in_txn = 1;
    return rc;
}
static int kv_sq_commit(kv_store *s, kv_diag *d) {
    int rc = kv_sq_exec(s, "COMMIT", d);
    if (rc) sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
    s->in_txn = 0;
    return rc;
}
static void kv_sq_rollback(kv_store *s) {
    if (s->in_txn) sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
    s->in_txn = 0;
}

/* Column readers with bounds: a row outside them is corrupt. */
static int kv_col_u64(sqlite3_stmt *st, int i, uint64_t max, uint64_t *out, kv_diag *d, const char *what) {
    if (sqlite3_column_type(st, i) != SQLITE_INTEGER)
        return kv_fail(d, KV_EFORMAT, "ledger store: %s is not an integer", what);
    sqlite3_int64 v = sqlite3_column_int64(st, i);
    if (v < 0 || (uint64_t)v > max)
        return kv_fail(d, KV_EFORMAT, "ledger store: %s = %lld is out of range", what, (long long)v);
    *out = (uint64_t)v;
    return 0;
}
static int kv_col_blob(sqlite3_stmt *st, int i, uint8_t *out, size_t want, size_t *got, kv_diag *d,
                       const char *what) {
    if (sqlite3_column_type(st, i) != SQLITE_BLOB && !(got && sqlite3_column_type(st, i) == SQLITE_NULL))
        return kv_fail(d, KV_EFORMAT, "ledger store: %s is not a blob", what);
    const void *p = sqlite3_column_blob(st, i);
    size_t n = (size_t)sqlite3_column_bytes(st, i);
    if (got ? n > want : n != want)
        return kv_fail(d, KV_EFORMAT, "ledger store: %s has %zu bytes, want %s%zu", what, n,
                       got ? "at most " : "", want);
    if (n) memcpy(out, p, n);
    if (got) *got = n;
    return 0;
}
static int kv_col_text(sqlite3_stmt *st, int i, char *out, size_t cap, kv_diag *d, const char *what) {
    if (sqlite3_column_type(st, i) != SQLITE_TEXT)
        return kv_fail(d, KV_EFORMAT, "ledger store: %s is not text", what);
    const unsigned char *p = sqlite3_column_text(st, i);
    size_t n = (size_t)sqlite3_column_bytes(st, i);
    if (!p || n >= cap || memchr(p, 0, n))
        return kv_fail(d, KV_EFORMAT, "ledger store: %s is too long or has NUL", what);
    memcpy(out, p, n);
    out[n] = 0;
    return 0;
}

/* Steps a statement expected to yield one row: 0 row, KV_ENOTFOUND, KV_EIO. */
static int kv_sq_row(kv_store *s, sqlite3_stmt *st, kv_diag *d) {
    int r = sqlite3_step(st);
    if (r == SQLITE_ROW) return 0;
    if (r == SQLITE_DONE) return KV_ENOTFOUND;
    return kv_sq_err(s, d, "step");
}
static int kv_sq_done(kv_store *s, sqlite3_stmt *st, kv_diag *d) {
    int r = sqlite3_step(st);
    sqlite3_reset(st);
    if (r == SQLITE_DONE) return 0;
    return kv_sq_err(s, d, "write");
}

static int kv_sq_meta_get(kv_store *s, const char *key, uint8_t *val, size_t cap, size_t *len, kv_diag *d) {
    if (!s->st[Q_META_GET] && sqlite3_prepare_v2(s->db, kv_sql[Q_META_GET], -1, &s->st[Q_META_GET], NULL) != SQLITE_OK)
        return strstr(sqlite3_errmsg(s->db), "no such table") ? kv_fail(d, KV_ENOTFOUND, "no ledger schema")
                                                               : kv_sq_err(s, d, "prepare");
    sqlite3_stmt *st = kv_sq_stmt(s, Q_META_GET, d);
    if (!st) return KV_EIO;
    sqlite3_bind_text(st, 1, key, -1, SQLITE_STATIC);
    int rc = kv_sq_row(s, st, d);
    if (!rc) rc = kv_col_blob(st, 0, val, cap, len, d, "meta value");
    sqlite3_reset(st);
    return rc;
}
static int kv_sq_meta_put(kv_store *s, const char *key, const uint8_t *val, size_t len, kv_diag *d) {
    sqlite3_stmt *st = kv_sq_stmt(s, Q_META_PUT, d);
    if (!st) return KV_EIO;
    sqlite3_bind_text(st, 1, key, -1, SQLITE_STATIC);
    sqlite3_bind_blob(st, 2, val, (int)len, SQLITE_STATIC);
    return kv_sq_done(s, st, d);
}

static int kv_sq_account_get(kv_store *s, const char *id, kv_store_account *a, kv_diag *d) {
    sqlite3_stmt *st = kv_sq_stmt(s, Q_ACCT_GET, d);
    if (!st) return KV_EIO;
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    int rc = kv_sq_row(s, st, d);
    uint64_t kind = 0;
    if (!rc) {
        memset(a, 0, sizeof *a);
        snprintf(a->id, sizeof a->id, "%s", id);
        sqlite3_int64 bal = sqlite3_column_int64(st, 1);
        if (!(rc = kv_col_u64(st, 0, KV_ACCT_MINT, &kind, d, "account kind")) &&
            !(rc = kv_col_u64(st, 2, KV_LEDGER_MAX_AMOUNT * 4, &a->debits, d, "account debits")) &&
            !(rc = kv_col_u64(st, 3, KV_LEDGER_MAX_AMOUNT * 4, &a->credits, d, "account credits"))) {
            if (sqlite3_column_type(st, 1) != SQLITE_INTEGER || bal > (sqlite3_int64)KV_LEDGER_MAX_AMOUNT ||
                bal < -(sqlite3_int64)KV_LEDGER_MAX_AMOUNT || kind == 0)
                rc = kv_fail(d, KV_EFORMAT, "ledger store: account '%s' has a corrupt row", id);
            a->kind = (int)kind;
            a->balance = bal;
        }
    }
    sqlite3_reset(st);
    return rc;
}
static int kv_sq_account_put(kv_store *s, const kv_store_account *a, kv_diag *d) {
    sqlite3_stmt *st = kv_sq_stmt(s, Q_ACCT_PUT, d);
    if (!st) return KV_EIO;
    sqlite3_bind_text(st, 1, a->id, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 2, a->kind);
    sqlite3_bind_int64(st, 3, a->balance);
    sqlite3_bind_int64(st, 4, (sqlite3_int64)a->debits);
    sqlite3_bind_int64(st, 5, (sqlite3_int64)a->credits);
    return kv_sq_done(s, st, d);
}

static int kv_sq_transfer_get(kv_store *s, const uint8_t id[16], kv_store_transfer *t, kv_diag *d) {
    sqlite3_stmt *st = kv_sq_stmt(s, Q_XFER_GET, d);
    if (!st) return KV_EIO;
    sqlite3_bind_blob(st, 1, id, 16, SQLITE_STATIC);
    int rc = kv_sq_row(s, st, d);
    uint64_t code = 0, ts = 0;
    if (!rc) {
        memset(t, 0, sizeof *t);
        memcpy(t->id, id, 16);
        t->seq = sqlite3_column_int64(st, 0);
        if (!(rc = kv_col_text(st, 1, t->debit, sizeof t->debit, d, "transfer debit")) &&
            !(rc = kv_col_text(st, 2, t->credit, sizeof t->credit, d, "transfer credit")) &&
            !(rc = kv_col_u64(st, 3, KV_LEDGER_MAX_AMOUNT, &t->amount, d, "transfer amount")) &&
            !(rc = kv_col_u64(st, 4, KV_XFER_COUNT - 1, &code, d, "transfer code")) &&
            !(rc = kv_col_blob(st, 5, t->ref, KV_REF_MAX, &t->ref_len, d, "transfer ref")) &&
            !(rc = kv_col_u64(st, 6, INT64_MAX, &ts, d, "transfer time"))) {
            t->code = (int)code;
            t->ts = (int64_t)ts;
        }
    }
    sqlite3_reset(st);
    return rc;
}
static int kv_sq_transfer_put(kv_store *s, const kv_store_transfer *t, kv_diag *d) {
    sqlite3_stmt *st = kv_sq_stmt(s, Q_XFER_PUT, d);
    if (!st) return KV_EIO;
    sqlite3_bind_blob(st, 1, t->id, 16, SQLITE_STATIC);
    sqlite3_bind_text(st, 2, t->debit, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 3, t->credit, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 4, (sqlite3_int64)t->amount);
    sqlite3_bind_int(st, 5, t->code);
    sqlite3_bind_blob(st, 6, t->ref, (int)t->ref_len, SQLITE_STATIC);
    sqlite3_bind_int64(st, 7, t->ts);
    return kv_sq_done(s, st, d);
}

static int kv_sq_auth_get(kv_store *s, const uint8_t consumer[32], const uint8_t nonce[16],
                          kv_store_auth *a, kv_diag *d) {
    sqlite3_stmt *st = kv_sq_stmt(s, Q_AUTH_GET, d);
    if (!st) return KV_EIO;
    sqlite3_bind_blob(st, 1, consumer, 32, SQLITE_STATIC);
    sqlite3_bind_blob(st, 2, nonce, 16, SQLITE_STATIC);
    int rc = kv_sq_row(s, st, d);
    uint64_t state = 0;
    if (!rc) {
        memset(a, 0, sizeof *a);
        memcpy(a->consumer, consumer, 32);
        memcpy(a->nonce, nonce, 16);
        if (!(rc = kv_col_text(st, 0, a->gateway, sizeof a->gateway, d, "auth gateway")) &&
            !(rc = kv_col_u64(st, 1, KV_LEDGER_MAX_AMOUNT, &a->max, d, "auth max")) &&
            !(rc = kv_col_u64(st, 2, INT64_MAX, &a->expires, d, "auth expires")) &&
            !(rc = kv_col_u64(st, 3, KV_AUTH_RELEASED, &state, d, "auth state")) &&
            !(rc = kv_col_blob(st, 4, a->settle_digest, 32, NULL, d, "auth settle digest")) &&
            !(rc = kv_col_u64(st, 5, KV_LEDGER_MAX_AMOUNT, &a->cost, d, "auth cost")) &&
            !(rc = kv_col_u64(st, 6, KV_LEDGER_MAX_AMOUNT, &a->fee, d, "auth fee")) &&
            !(rc = kv_col_u64(st, 7, KV_LEDGER_MAX_AMOUNT, &a->to_nodes, d, "auth to_nodes")) &&
            !(rc = kv_col_u64(st, 8, KV_LEDGER_MAX_AMOUNT, &a->returned, d, "auth returned"))) {
            if (state == 0) rc = kv_fail(d, KV_EFORMAT, "ledger store: auth state 0");
            a->state = (int)state;
        }
    }
    sqlite3_reset(st);
    return rc;
}
static int kv_sq_auth_put(kv_store *s, const kv_store_auth *a, kv_diag *d) {
    sqlite3_stmt *st = kv_sq_stmt(s, Q_AUTH_PUT, d);
    if (!st) return KV_EIO;
    sqlite3_bind_blob(st, 1, a->consumer, 32, SQLITE_STATIC);
    sqlite3_bind_blob(st, 2, a->nonce, 16, SQLITE_STATIC);
    sqlite3_bind_text(st, 3, a->gateway, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 4, (sqlite3_int64)a->max);
    sqlite3_bind_int64(st, 5, (sqlite3_int64)a->expires);
    sqlite3_bind_int(st, 6, a->state);
    sqlite3_bind_blob(st, 7, a->settle_digest, 32, SQLITE_STATIC);
    sqlite3_bind_int64(st, 8, (sqlite3_int64)a->cost);
    sqlite3_bind_int64(st, 9, (sqlite3_int64)a->fee);
    sqlite3_bind_int64(st, 10, (sqlite3_int64)a->to_nodes);
    sqlite3_bind_int64(st, 11, (sqlite3_int64)a->returned);
    uint8_t ref[48];
    memcpy(ref, a->consumer, 32);
    memcpy(ref + 32, a->nonce, 16);
    sqlite3_bind_blob(st, 12, ref, 48, SQLITE_TRANSIENT);
    return kv_sq_done(s, st, d);
}
static int kv_sq_auth_held(kv_store *s, const char *gateway, kv_store_auth *out, size_t cap, size_t *n,
                           kv_diag *d) {
    uint8_t keys[64][48];
    size_t k = 0;
    *n = 0;
    if (cap > 64) cap = 64;
    sqlite3_stmt *st = kv_sq_stmt(s, Q_AUTH_HELD, d);
    if (!st) return KV_EIO;
    sqlite3_bind_text(st, 1, gateway, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 2, (sqlite3_int64)cap);
    int rc = 0, r;
    while (k < cap && (r = sqlite3_step(st)) == SQLITE_ROW) {
        if ((rc = kv_col_blob(st, 0, keys[k], 32, NULL, d, "auth consumer")) ||
            (rc = kv_col_blob(st, 1, keys[k] + 32, 16, NULL, d, "auth nonce")))
            break;
        k++;
    }
    sqlite3_reset(st);
    if (rc) return rc;
    for (size_t i = 0; i < k; i++) {
        if ((rc = kv_sq_auth_get(s, keys[i], keys[i] + 32, &out[i], d))) return rc;
    }
    *n = k;
    return 0;
}
static int kv_sq_receipt_used(kv_store *s, const kv_store_receipt *r, kv_diag *d) {
    sqlite3_stmt *st = kv_sq_stmt(s, Q_RCPT_USED, d);
    if (!st) return KV_EIO;
    sqlite3_bind_blob(st, 1, r->node, 32, SQLITE_STATIC);
    sqlite3_bind_blob(st, 2, r->nonce, 16, SQLITE_STATIC);
    sqlite3_bind_blob(st, 3, r->consumer, 32, SQLITE_STATIC);
    sqlite3_bind_blob(st, 4, r->auth_nonce, 16, SQLITE_STATIC);
    int rc = kv_sq_row(s, st, d);
    sqlite3_reset(st);
    if (rc == KV_ENOTFOUND) return 0;
    return rc ? rc : 1;
}
static int kv_sq_receipt_put(kv_store *s, const kv_store_receipt *r, kv_diag *d) {
    sqlite3_stmt *st = kv_sq_stmt(s, Q_RCPT_PUT, d);
    if (!st) return KV_EIO;
    sqlite3_bind_blob(st, 1, r->node, 32, SQLITE_STATIC);
    sqlite3_bind_blob(st, 2, r->nonce, 16, SQLITE_STATIC);
    sqlite3_bind_blob(st, 3, r->consumer, 32, SQLITE_STATIC);
    sqlite3_bind_blob(st, 4, r->auth_nonce, 16, SQLITE_STATIC);
    sqlite3_bind_int64(st, 5, (sqlite3_int64)r->n_products);
    sqlite3_bind_blob(st, 6, r->transfer_id, 16, SQLITE_STATIC);
    return kv_sq_done(s, st, d);
}

static int kv_sq_node_receipts(kv_store *s, const uint8_t node[32], uint64_t *n, uint64_t *products, kv_diag *d) {
    *n = *products = 0;
    sqlite3_stmt *st = kv_sq_stmt(s, Q_RCPT_SUM, d);
    if (!st) return KV_EIO;
    sqlite3_bind_blob(st, 1, node, 32, SQLITE_TRANSIENT);
    int rc = 0;
    if (sqlite3_step(st) != SQLITE_ROW) {
        rc = kv_sq_err(s, d, "receipt sum");
    } else {
        const int64_t c = sqlite3_column_int64(st, 0), p = sqlite3_column_int64(st, 1);
        /* each receipt is at most 2^40 products; a sum past 2^62 is a corrupt row */
        if (c < 0 || p < 0 || (uint64_t)p > KV_LEDGER_MAX_AMOUNT)
            rc = kv_fail(d, KV_EFORMAT, "ledger store: receipt sum out of range");
        else {
            *n = (uint64_t)c;
            *products = (uint64_t)p;
        }
    }
    sqlite3_reset(st);
    return rc;
}

static int kv_sq_each_transfer(kv_store *s, const char *account,
                               int (*fn)(void *ctx, const kv_store_transfer *t), void *ctx, kv_diag *d) {
    /* ids first, rows after: the callback may use this store */
    sqlite3_stmt *st = kv_sq_stmt(s, account ? Q_EACH_ACCT : Q_EACH_ALL, d);
    if (!st) return KV_EIO;
    if (account) sqlite3_bind_text(st, 1, account, -1, SQLITE_TRANSIENT);
    size_t n = 0, cap = 0;
    uint8_t (*ids)[16] = NULL;
    int rc = 0, r;
    while ((r = sqlite3_step(st)) == SQLITE_ROW) {
        if (n == cap) {
            size_t nc = cap ? cap * 2 : 256;
            void *p = realloc(ids, nc * 16);
            if (!p) { rc = kv_fail(d, KV_ENOMEM, "ledger store: out of memory"); break; }
            ids = p;
            cap = nc;
        }
        if ((rc = kv_col_blob(st, 0, ids[n], 16, NULL, d, "transfer id"))) break;
        n++;
    }
    if (!rc && r != SQLITE_DONE && r != SQLITE_ROW) rc = kv_sq_err(s, d, "step");
    sqlite3_reset(st);
    for (size_t i = 0; !rc && i < n; i++) {
        kv_store_transfer t;
        if ((rc = kv_sq_transfer_get(s, ids[i], &t, d))) break;
        rc = fn(ctx, &t);
    }
    free(ids);
    return rc;
}

/* One aggregate query, value into *out (0 when NULL). Each is a fixed string. */
static int kv_sq_scalar(kv_store *s, const char *sql, int64_t *out, kv_diag *d) {
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(s->db, sql, -1, &st, NULL) != SQLITE_OK) return kv_sq_err(s, d, "prepare check");
    int r = sqlite3_step(st), rc = 0;
    if (r == SQLITE_ROW) *out = sqlite3_column_type(st, 0) == SQLITE_NULL ? 0 : sqlite3_column_int64(st, 0);
    else rc = kv_sq_err(s, d, "check");
    sqlite3_finalize(st);
    return rc;
}

static int kv_sq_check(kv_store *s, kv_store_check *c, kv_diag *d) {
    memset(c, 0, sizeof *c);
    /* Sums use SQLite's checked integer arithmetic: an overflow is an error. */
    static const char *const q[] = {
        "SELECT count(*) FROM accounts",
        "SELECT count(*) FROM transfers",
        "SELECT count(*) FROM receipts",
        "SELECT sum(amount) FROM transfers",
        "SELECT sum(debits) FROM accounts",
        "SELECT sum(credits) FROM accounts",
        "SELECT count(*) FROM accounts a WHERE a.debits <> coalesce((SELECT sum(amount) FROM transfers"
        " WHERE debit=a.id),0) OR a.credits <> coalesce((SELECT sum(amount) FROM transfers WHERE credit=a.id),0)"
        " OR a.balance <> a.credits - a.debits",
        "SELECT count(*) FROM accounts WHERE (kind <> 5 AND balance < 0) OR (kind = 5 AND balance > 0)",
        "SELECT sum(balance) FROM accounts WHERE kind <> 5",
        "SELECT sum(amount) FROM transfers WHERE code = 1",
        "SELECT sum(balance) FROM accounts WHERE kind = 5",
        "SELECT sum(balance) FROM accounts WHERE kind = 4",
        "SELECT sum(max) FROM auths WHERE state = 1",
        "SELECT (SELECT count(*) FROM transfers t WHERE code = 4 AND NOT EXISTS (SELECT 1 FROM receipts r"
        " WHERE r.transfer_id = t.id AND t.credit = 'node:' || lower(hex(r.node)))) +"
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
    };
    int64_t v[sizeof q / sizeof q[0]];
    for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) {
        int rc = kv_sq_scalar(s, q[i], &v[i], d);
        if (rc) return rc;
        if (i != 10 && v[i] < 0) return kv_fail(d, KV_EFORMAT, "ledger store: aggregate %zu is negative", i);
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
        sqlite3_stmt *st = NULL;
        if (sqlite3_prepare_v2(s->db,
                               "SELECT a.id FROM accounts a WHERE a.debits <> coalesce((SELECT sum(amount) FROM"
                               " transfers WHERE debit=a.id),0) OR a.credits <> coalesce((SELECT sum(amount) FROM"
                               " transfers WHERE credit=a.id),0) OR a.balance <> a.credits - a.debits LIMIT 1",
                               -1, &st, NULL) == SQLITE_OK &&
            sqlite3_step(st) == SQLITE_ROW) {
            const unsigned char *t = sqlite3_column_text(st, 0);
            snprintf(c->bad_account, sizeof c->bad_account, "%s", t ? (const char *)t : "?");
        }
        sqlite3_finalize(st);
    }
    return 0;
}

const kv_store_ops kv_store_sqlite = {
    .name = "sqlite",
    .open = kv_sq_open,
    .close = kv_sq_close,
    .init_schema = kv_sq_init_schema,
    .begin_write = kv_sq_begin_write,
    .begin_read = kv_sq_begin_read,
    .commit = kv_sq_commit,
    .rollback = kv_sq_rollback,
    .meta_get = kv_sq_meta_get,
    .meta_put = kv_sq_meta_put,
    .account_get = kv_sq_account_get,
    .account_put = kv_sq_account_put,
    .transfer_get = kv_sq_transfer_get,
    .transfer_put = kv_sq_transfer_put,
    .auth_get = kv_sq_auth_get,
    .auth_put = kv_sq_auth_put,
    .auth_held = kv_sq_auth_held,
    .receipt_used = kv_sq_receipt_used,
    .receipt_put = kv_sq_receipt_put,
    .each_transfer = kv_sq_each_transfer,
    .node_receipts = kv_sq_node_receipts,
    .open_ro = kv_sq_open_ro,
    .check = kv_sq_check,
};
