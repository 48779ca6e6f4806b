/* libpq plumbing of the PostgreSQL stores (pq.h): one connection, lazily
 * prepared statements, bounded column readers. A connection that dropped
 * is reset once before the next statement outside a transaction (its
 * prepared statements are gone with it, so they are prepared again); inside
 * a transaction the error is returned, since the server rolled it back. */
#include "pg/pq.h"

#ifdef KV_HAVE_PG
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "kvasir/link.h" /* kv_unhex */

static void kv_pq_quiet(void *arg, const char *msg) { (void)arg, (void)msg; }

/* One line of a libpq message: its trailing newline(s) cut. */
static int kv_pq_fail(kv_pq *p, kv_diag *d, const char *what, const char *msg) {
    char m[400];
    snprintf(m, sizeof m, "%s", msg ? msg : "?");
    for (char *s = m; *s; s++)
        if (*s == '\n' || *s == '\r') *s = ' ';
    size_t n = strlen(m);
    while (n && m[n - 1] == ' ') m[--n] = 0;
    return kv_fail(d, KV_EIO, "%s (postgresql): %s: %s", p->who, what, m);
}

/* The settings every statement relies on; lost with a connection. */
static int kv_pq_session(kv_pq *p, kv_diag *d) {
    PQsetNoticeProcessor(p->c, kv_pq_quiet, NULL);
    /* a lock wait or a stuck server is an error after a minute, like
     * SQLite's busy timeout, never a hang */
    const char *sql[2] = {"SET statement_timeout = 60000; SET bytea_output = 'hex'", p->session};
    for (int i = 0; i < 2 && sql[i]; i++) {
        PGresult *r = PQexec(p->c, sql[i]); /* not kv_pq_exec: it may call us */
        int ok = PQresultStatus(r) == PGRES_COMMAND_OK;
        if (!ok) kv_pq_fail(p, d, sql[i], r ? PQresultErrorMessage(r) : PQerrorMessage(p->c));
        PQclear(r);
        if (!ok) return KV_EIO;
    }
    return 0;
}

int kv_pq_open(kv_pq *p, const char *conninfo, const char *who, const char *session, kv_diag *d) {
    memset(p, 0, sizeof *p);
    p->who = who;
    p->session = session;
    p->c = PQconnectdb(conninfo);
    if (!p->c) return kv_fail(d, KV_ENOMEM, "%s (postgresql): out of memory", who);
    if (PQstatus(p->c) != CONNECTION_OK) {
        int rc = kv_pq_fail(p, d, "cannot connect", PQerrorMessage(p->c));
        kv_pq_close(p);
        return rc;
    }
    int rc = kv_pq_session(p, d);
    if (rc) kv_pq_close(p);
    return rc;
}

void kv_pq_close(kv_pq *p) {
    if (p && p->c) PQfinish(p->c);
    if (p) p->c = NULL;
}

void kv_pq_arg_i64(kv_pq_args *a, int64_t v) {
    KV_ASSERT(a->n < KV_PQ_MAX_PARAMS);
    snprintf(a->num[a->n], sizeof a->num[a->n], "%" PRId64, v);
    a->v[a->n] = a->num[a->n];
    a->len[a->n] = 0;
    a->fmt[a->n] = 0;
    a->n++;
}
void kv_pq_arg_text(kv_pq_args *a, const char *s) {
    KV_ASSERT(a->n < KV_PQ_MAX_PARAMS);
    a->v[a->n] = s;
    a->len[a->n] = 0;
    a->fmt[a->n] = 0;
    a->n++;
}
void kv_pq_arg_blob(kv_pq_args *a, const void *b, size_t n) {
    KV_ASSERT(a->n < KV_PQ_MAX_PARAMS && n <= INT32_MAX);
    static const char empty[1];
    a->v[a->n] = n ? b : empty;
    a->len[a->n] = (int)n;
    a->fmt[a->n] = 1;
    a->n++;
}

static void kv_pq_maybe_reset(kv_pq *p) {
    if (p->in_txn) return;
    if (PQstatus(p->c) == CONNECTION_BAD) {
        PQreset(p->c);
        p->prepared = 0;
        p->need_session = true;
    }
    /* until the session settings are back no statement of ours is run:
     * without its search_path a statement fails, it never reads elsewhere */
    if (p->need_session && PQstatus(p->c) == CONNECTION_OK && !kv_pq_session(p, NULL)) p->need_session = false;
}

PGresult *kv_pq_run(kv_pq *p, int q, const char *sql, const kv_pq_args *a, char state[6], kv_diag *d) {
    KV_ASSERT(q >= 0 && q < KV_PQ_MAX_STMTS);
    if (state) state[0] = 0;
    kv_pq_maybe_reset(p);
    char name[16];
    snprintf(name, sizeof name, "kvq%d", q);
    static const kv_pq_args none;
    if (!a) a = &none;
    if (!(p->prepared >> q & 1)) {
        PGresult *r = PQprepare(p->c, name, sql, a->n, NULL);
        if (PQresultStatus(r) != PGRES_COMMAND_OK) {
            if (state) snprintf(state, 6, "%s", PQresultErrorField(r, PG_DIAG_SQLSTATE) ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : "");
            kv_pq_fail(p, d, "prepare", PQerrorMessage(p->c));
            PQclear(r);
            return NULL;
        }
        PQclear(r);
        p->prepared |= UINT64_C(1) << q;
    }
    PGresult *r = PQexecPrepared(p->c, name, a->n, a->v, a->len, a->fmt, 0);
    ExecStatusType st = PQresultStatus(r);
    if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK) return r;
    const char *ss = r ? PQresultErrorField(r, PG_DIAG_SQLSTATE) : NULL;
    if (state) snprintf(state, 6, "%s", ss ? ss : "");
    kv_pq_fail(p, d, name, r ? PQresultErrorMessage(r) : PQerrorMessage(p->c));
    PQclear(r);
    return NULL;
}

int kv_pq_exec(kv_pq *p, const char *sql, kv_diag *d) {
    kv_pq_maybe_reset(p);
    PGresult *r = PQexec(p->c, sql);
    ExecStatusType st = PQresultStatus(r);
    int rc = 0;
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK)
        rc = kv_pq_fail(p, d, sql, r ? PQresultErrorMessage(r) : PQerrorMessage(p->c));
    PQclear(r);
    return rc;
}

long kv_pq_changed(PGresult *r) {
    const char *t = PQcmdTuples(r);
    return t && *t ? strtol(t, NULL, 10) : 0;
}

int kv_pq_i64(PGresult *r, int row, int col, int64_t min, int64_t max, int64_t *out, kv_diag *d,
              const char *who, const char *what) {
    if (PQgetisnull(r, row, col)) return kv_fail(d, KV_EFORMAT, "%s: %s is NULL", who, what);
    const char *s = PQgetvalue(r, row, col);
    if ((size_t)PQgetlength(r, row, col) != strlen(s)) return kv_fail(d, KV_EFORMAT, "%s: %s holds a NUL byte", who, what);
    char *e;
    errno = 0;
    /* the server writes [-]digits; strtoll alone would also take blanks and '+' */
    long long v = strtoll(s, &e, 10);
    if (!((s[0] >= '0' && s[0] <= '9') || (s[0] == '-' && s[1] >= '0' && s[1] <= '9')) || *e || errno || v < min ||
        v > max)
        return kv_fail(d, KV_EFORMAT, "%s: %s = '%.40s' is not an integer in [%" PRId64 ", %" PRId64 "]", who, what,
                       s, min, max);
    *out = (int64_t)v;
    return 0;
}

int kv_pq_text(PGresult *r, int row, int col, char *out, size_t cap, kv_diag *d, const char *who,
               const char *what) {
    if (PQgetisnull(r, row, col)) return kv_fail(d, KV_EFORMAT, "%s: %s is NULL", who, what);
    int n = PQgetlength(r, row, col);
    if (n < 0 || (size_t)n >= cap) return kv_fail(d, KV_EFORMAT, "%s: %s is longer than %zu bytes", who, what, cap - 1);
    if (memchr(PQgetvalue(r, row, col), 0, (size_t)n)) return kv_fail(d, KV_EFORMAT, "%s: %s holds a NUL byte", who, what);
    memcpy(out, PQgetvalue(r, row, col), (size_t)n);
    out[n] = 0;
    return 0;
}

int kv_pq_bytea(PGresult *r, int row, int col, uint8_t *out, size_t want, size_t *got, kv_diag *d,
                const char *who, const char *what) {
    if (PQgetisnull(r, row, col)) return kv_fail(d, KV_EFORMAT, "%s: %s is NULL", who, what);
    const char *s = PQgetvalue(r, row, col);
    size_t n = (size_t)PQgetlength(r, row, col);
    /* bytea_output = hex: "\x" then two digits a byte */
    if (n < 2 || s[0] != '\\' || s[1] != 'x' || (n - 2) % 2)
        return kv_fail(d, KV_EFORMAT, "%s: %s is not hex bytea", who, what);
    size_t nb = (n - 2) / 2;
    if (got ? nb > want : nb != want)
        return kv_fail(d, KV_EFORMAT, "%s: %s has %zu bytes, want %s%zu", who, what, nb, got ? "at most " : "", want);
    if (kv_unhex(s + 2, n - 2, out, nb, true)) return kv_fail(d, KV_EFORMAT, "%s: %s is not hex bytea", who, what);
    if (got) *got = nb;
    return 0;
}
#endif
