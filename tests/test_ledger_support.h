/* Shared helpers of the ledger tests: a temp folder of real SQLite files
 * (or, when KV_TEST_PG holds a libpq conninfo of a server, one fresh
 * PostgreSQL database per ledger: tests/test_pg_store.sh), an operator key,
 * settle requests with node-signed receipts, the invariant check after
 * every case, raw SQL and a naive read-then-write spend behind the ledger's
 * back for either backend, and the independent reference for the split
 * (OpenSSL big integers, not the library's 128-bit arithmetic). */
#ifndef KVASIR_TEST_LEDGER_SUPPORT_H
#define KVASIR_TEST_LEDGER_SUPPORT_H

#include <openssl/bn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <sqlite3.h>

#include "kvasir/ledger.h"
#include "kvtest.h"
#include "pg/pq.h"

static char lt_dir[200];
static kv_wallet lt_op;
static int lt_seq;
#define LT_GW "gw-test"
#define LT_FEE_BPS 500

static const char *lt_pg; /* conninfo of the PostgreSQL server under test, or NULL (SQLite) */

static int lt_setup(void) {
    snprintf(lt_dir, sizeof lt_dir, "%s/kv_ledger_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(lt_dir)) return 1;
    lt_pg = getenv("KV_TEST_PG");
    if (lt_pg && !*lt_pg) lt_pg = NULL;
    return kv_wallet_generate(&lt_op, NULL);
}

/* Runs sql on the store at path, behind the ledger's back. 0 when it ran. */
static int lt_sql(const char *path, const char *sql) {
    if (!kv_pq_uri(path)) {
        sqlite3 *db;
        if (sqlite3_open(path, &db) != SQLITE_OK) return -1;
        sqlite3_busy_timeout(db, 10000);
        int rc = sqlite3_exec(db, sql, NULL, NULL, NULL);
        sqlite3_close(db);
        return rc == SQLITE_OK ? 0 : -1;
    }
#ifdef KV_HAVE_PG
    PGconn *c = PQconnectdb(kv_pq_uri(path));
    int rc = -1;
    if (PQstatus(c) == CONNECTION_OK) {
        PGresult *r = PQexec(c, "SET search_path = kvledger");
        PQclear(r);
        r = PQexec(c, sql);
        rc = PQresultStatus(r) == PGRES_COMMAND_OK || PQresultStatus(r) == PGRES_TUPLES_OK ? 0 : -1;
        if (rc) fprintf(stderr, "lt_sql: %s", PQresultErrorMessage(r));
        PQclear(r);
    } else {
        fprintf(stderr, "lt_sql: %s", PQerrorMessage(c));
    }
    PQfinish(c);
    return rc;
#else
    return -1;
#endif
}

/* A new store location: a file path under lt_dir, or a fresh PostgreSQL
 * database (created empty). Into path (256 bytes). */
static void lt_fresh(char *path, const char *tag) {
    static int n;
    n++;
    if (!lt_pg) {
        snprintf(path, 256, "%s/%s-%d.db", lt_dir, tag, n);
        return;
    }
    char admin[300], sql[128];
    snprintf(admin, sizeof admin, "pg:%s dbname=postgres", lt_pg);
    snprintf(sql, sizeof sql, "CREATE DATABASE kvl_%s_%ld_%d", tag, (long)getpid(), n);
    ASSERT_EQ(lt_sql(admin, sql), 0);
    snprintf(path, 256, "pg:%s dbname=kvl_%s_%ld_%d", lt_pg, tag, (long)getpid(), n);
}

/* The naive spend the attack tests exploit: read the balance, wait(arg)
 * (every spender reads the same balance), then write balance - amount and
 * credit the escrow, in separate statements without a lock. Returns 0
 * spent, 1 not covered, 2 error. */
static int lt_naive_spend(const char *path, const char *acct, uint64_t amount, void (*wait)(void *), void *arg) {
    int rc = 2;
    if (!kv_pq_uri(path)) {
        sqlite3 *db;
        if (sqlite3_open(path, &db) != SQLITE_OK) return 2;
        sqlite3_busy_timeout(db, 10000);
        sqlite3_stmt *st;
        sqlite3_prepare_v2(db, "SELECT balance FROM accounts WHERE id=?1", -1, &st, NULL);
        sqlite3_bind_text(st, 1, acct, -1, SQLITE_STATIC);
        sqlite3_int64 bal = sqlite3_step(st) == SQLITE_ROW ? sqlite3_column_int64(st, 0) : 0;
        sqlite3_finalize(st);
        wait(arg);
        rc = 1;
        if (bal >= (sqlite3_int64)amount) {
            sqlite3_prepare_v2(db, "UPDATE accounts SET balance=?2 WHERE id=?1", -1, &st, NULL);
            sqlite3_bind_text(st, 1, acct, -1, SQLITE_STATIC);
            sqlite3_bind_int64(st, 2, bal - (sqlite3_int64)amount);
            rc = sqlite3_step(st) == SQLITE_DONE ? 0 : 2;
            sqlite3_finalize(st);
            sqlite3_prepare_v2(db, "UPDATE accounts SET balance=balance+?1 WHERE id='escrow'", -1, &st, NULL);
            sqlite3_bind_int64(st, 1, (sqlite3_int64)amount);
            sqlite3_step(st);
            sqlite3_finalize(st);
        }
        sqlite3_close(db);
        return rc;
    }
#ifdef KV_HAVE_PG
    PGconn *c = PQconnectdb(kv_pq_uri(path));
    if (PQstatus(c) != CONNECTION_OK) {
        PQfinish(c);
        wait(arg);
        return 2;
    }
    PQclear(PQexec(c, "SET search_path = kvledger"));
    const char *v[2] = {acct, NULL};
    PGresult *r = PQexecParams(c, "SELECT balance FROM accounts WHERE id=$1", 1, NULL, v, NULL, NULL, 0);
    long long bal = PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) ? strtoll(PQgetvalue(r, 0, 0), NULL, 10) : 0;
    PQclear(r);
    wait(arg);
    rc = 1;
    if (bal >= (long long)amount) {
        char nb[32], am[32];
        snprintf(nb, sizeof nb, "%lld", bal - (long long)amount);
        snprintf(am, sizeof am, "%llu", (unsigned long long)amount);
        const char *u[2] = {acct, nb};
        r = PQexecParams(c, "UPDATE accounts SET balance=$2 WHERE id=$1", 2, NULL, u, NULL, NULL, 0);
        rc = PQresultStatus(r) == PGRES_COMMAND_OK ? 0 : 2;
        PQclear(r);
        const char *e[1] = {am};
        r = PQexecParams(c, "UPDATE accounts SET balance=balance+$1 WHERE id='escrow'", 1, NULL, e, NULL, NULL, 0);
        PQclear(r);
    }
    PQfinish(c);
    return rc;
#else
    wait(arg);
    return 2;
#endif
}
static void lt_teardown(void) {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", lt_dir);
    if (system(cmd)) fprintf(stderr, "could not remove %s\n", lt_dir);
}

/* A fresh initialized ledger file; its path into path (256 bytes). */
static kv_ledger *lt_new(char *path) {
    char p[256];
    if (!path) path = p;
    lt_seq++;
    lt_fresh(path, "ledger");
    kv_diag d = {0};
    int rc = kv_ledger_init(path, lt_op.pk, LT_FEE_BPS, &d);
    ASSERT_EQ(rc, 0);
    kv_ledger *l = NULL;
    rc = kv_ledger_open(&l, path, &d);
    ASSERT_EQ(rc, 0);
    if (rc) fprintf(stderr, "open: %s\n", d.msg);
    return l;
}

static int lt_issue(kv_ledger *l, const uint8_t pk[32], uint64_t amount) {
    kv_issue is;
    kv_diag d = {0};
    int rc = kv_issue_sign(&is, &lt_op, pk, amount, NULL, &d);
    if (!rc) rc = kv_ledger_issue(l, &is, &d);
    if (rc < 0) fprintf(stderr, "issue: %s\n", d.msg);
    return rc;
}

static uint64_t lt_bal(kv_ledger *l, const char *acct) {
    uint64_t b = 0;
    ASSERT_EQ(kv_ledger_balance(l, acct, &b, NULL), 0);
    return b;
}
static uint64_t lt_bal_c(kv_ledger *l, const uint8_t pk[32]) {
    char a[KV_LEDGER_ACCOUNT_MAX];
    kv_ledger_account_consumer(pk, a);
    return lt_bal(l, a);
}
static uint64_t lt_bal_n(kv_ledger *l, const uint8_t pk[32]) {
    char a[KV_LEDGER_ACCOUNT_MAX];
    kv_ledger_account_node(pk, a);
    return lt_bal(l, a);
}

/* Every invariant holds (kv_ledger_check) and the check can see them. */
static void lt_check(kv_ledger *l) {
    kv_ledger_report r;
    kv_diag d = {0};
    int rc = kv_ledger_check(l, &r, &d);
    ASSERT_EQ(rc, 0);
    if (rc) fprintf(stderr, "check: %s\n", d.msg);
}

static kv_auth lt_auth(const kv_wallet *w, const char *gw, uint64_t max) {
    kv_auth a;
    ASSERT_EQ(kv_auth_sign(&a, w, gw, max, (uint64_t)time(NULL) + 3600, NULL), 0);
    return a;
}

/* Independent reference of kv_ledger_split with OpenSSL BIGNUMs. */
static void lt_ref_split(uint64_t pool, const uint64_t *c, const uint8_t (*ids)[32], size_t n, uint64_t *out) {
    BN_CTX *ctx = BN_CTX_new();
    BIGNUM *total = BN_new(), *p = BN_new(), *x = BN_new(), *q = BN_new(), *given = BN_new();
    BIGNUM **rem = calloc(n, sizeof *rem);
    BN_zero(total);
    BN_zero(given);
    for (size_t i = 0; i < n; i++) {
        BN_set_word(x, c[i]);
        BN_add(total, total, x);
    }
    for (size_t i = 0; i < n; i++) {
        rem[i] = BN_new();
        BN_set_word(p, pool);
        BN_set_word(x, c[i]);
        BN_mul(p, p, x, ctx);
        BN_div(q, rem[i], p, total, ctx);
        out[i] = BN_get_word(q);
        BN_add(given, given, q);
    }
    BN_set_word(x, pool);
    BN_sub(x, x, given);
    uint64_t left = BN_get_word(x);
    char *taken = calloc(n, 1);
    for (uint64_t k = 0; k < left; k++) {
        size_t best = n;
        for (size_t i = 0; i < n; i++) {
            if (taken[i]) continue;
            if (best == n) { best = i; continue; }
            int cmp = BN_cmp(rem[i], rem[best]);
            if (cmp > 0 || (cmp == 0 && memcmp(ids[i], ids[best], 32) < 0)) best = i;
        }
        taken[best] = 1;
        out[best]++;
    }
    for (size_t i = 0; i < n; i++) BN_free(rem[i]);
    free(rem);
    free(taken);
    BN_free(total); BN_free(p); BN_free(x); BN_free(q); BN_free(given);
    BN_CTX_free(ctx);
}

/* A settle request: nodes[i] computed counts[i] products; receipts for the
 * nodes whose bit is set in mask. Storage is the caller's (log, rc). */
typedef struct lt_settle {
    kv_settle_req req;
    kv_dispatch_entry log[8];
    kv_receipt rc[8];
} lt_settle;
static void lt_mk_settle(lt_settle *s, const kv_auth *a, const kv_wallet *nodes, const uint64_t *counts,
                         size_t n, unsigned mask, uint64_t pt, uint64_t ct, uint64_t pp, uint64_t pc) {
    memset(s, 0, sizeof *s);
    memcpy(s->req.consumer, a->consumer, 32);
    memcpy(s->req.nonce, a->nonce, 16);
    s->req.prompt_tokens = pt;
    s->req.completion_tokens = ct;
    s->req.price_prompt = pp;
    s->req.price_completion = pc;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        memcpy(s->log[i].node, nodes[i].pk, 32);
        s->log[i].n_products = counts[i];
        for (int b = 0; b < 32; b++) s->log[i].log_digest[b] = (uint8_t)(i * 31 + b + counts[i]);
        if (mask & (1u << i)) {
            ASSERT_EQ(kv_receipt_sign(&s->rc[k], &nodes[i], a, counts[i], s->log[i].log_digest, NULL), 0);
            k++;
        }
    }
    s->req.log = s->log;
    s->req.n_log = n;
    s->req.receipts = s->rc;
    s->req.n_receipts = k;
}

/* What a settle must move, from the reference: fee, per-node pay (0 for
 * nodes without receipt), consumer's net charge. */
typedef struct lt_expect {
    uint64_t cost, fee, node[8], charged;
} lt_expect;
static lt_expect lt_expect_of(const lt_settle *s) {
    lt_expect e;
    memset(&e, 0, sizeof e);
    e.cost = s->req.prompt_tokens * s->req.price_prompt + s->req.completion_tokens * s->req.price_completion;
    e.fee = e.cost * LT_FEE_BPS / 10000;
    e.charged = e.fee;
    if (s->req.n_log) {
        uint64_t counts[8], shares[8];
        uint8_t ids[8][32];
        for (size_t i = 0; i < s->req.n_log; i++) {
            counts[i] = s->log[i].n_products;
            memcpy(ids[i], s->log[i].node, 32);
        }
        lt_ref_split(e.cost - e.fee, counts, (const uint8_t(*)[32])ids, s->req.n_log, shares);
        for (size_t i = 0; i < s->req.n_log; i++) {
            int has = 0;
            for (size_t k = 0; k < s->req.n_receipts; k++) has |= !memcmp(s->rc[k].node, s->log[i].node, 32);
            e.node[i] = has ? shares[i] : 0;
            e.charged += e.node[i];
        }
    }
    return e;
}

#endif
