/* PostgreSQL plumbing shared by the hub store and the ledger store
 * (src/hub/store_pg.c, src/ledger/store_pg.c): which store URIs name a
 * PostgreSQL server, one connection with lazily prepared statements, and
 * readers of result columns that bound every value like any other
 * untrusted input (a row that does not fit is KV_EFORMAT, never a crash).
 *
 * Every statement takes its values as bound parameters (text for numbers
 * and strings, binary for bytea), never spliced into SQL. Results are in
 * text format; bytea columns arrive as "\x" hex and are decoded here.
 *
 * Built without libpq (KV_HAVE_PG undefined) only kv_pq_uri exists, and the
 * stores answer KV_EUNSUPPORTED with a message that says so. */
#ifndef KVASIR_PG_PQ_H
#define KVASIR_PG_PQ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kvasir/err.h"

/* A store URI names PostgreSQL when it starts with "postgresql://" or
 * "postgres://" (a libpq URI, passed as is) or "pg:" (the rest is a libpq
 * key=value conninfo, e.g. "pg:host=/tmp/x dbname=kvasir"). Returns the
 * conninfo to hand to libpq, or NULL when the URI is a file path. */
static inline const char *kv_pq_uri(const char *uri) {
    if (!uri) return NULL;
    if (!strncmp(uri, "postgresql://", 13) || !strncmp(uri, "postgres://", 11)) return uri;
    if (!strncmp(uri, "pg:", 3)) return uri + 3;
    return NULL;
}

#ifdef KV_HAVE_PG
#include <libpq-fe.h>

#define KV_PQ_MAX_PARAMS 16
#define KV_PQ_MAX_STMTS 64

typedef struct kv_pq {
    PGconn *c;
    const char *who;       /* "hub store", "ledger store": prefix of every message */
    const char *session;   /* SET commands of this store (its search_path), run on every connect */
    uint64_t prepared;     /* bit q: statement "kvq<q>" is prepared on this connection */
    bool in_txn;
    bool need_session;     /* reconnected, session settings not yet restored */
} kv_pq;

/* Connects (conninfo from kv_pq_uri), sets a statement timeout for lock
 * waits, hex bytea output and quiet notices, then runs session (a fixed
 * string, e.g. "SET search_path = kvhub"); the same again after every
 * reset of a lost connection. Returns 0, KV_EIO (d says why). */
int kv_pq_open(kv_pq *p, const char *conninfo, const char *who, const char *session, kv_diag *d);
void kv_pq_close(kv_pq *p); /* accepts a zeroed or closed one */

/* One parameter list: text values (NULL = SQL NULL) or binary blobs. */
typedef struct kv_pq_args {
    int n;
    const char *v[KV_PQ_MAX_PARAMS];
    int len[KV_PQ_MAX_PARAMS];
    int fmt[KV_PQ_MAX_PARAMS];
    char num[KV_PQ_MAX_PARAMS][24]; /* storage of numbers rendered as text */
} kv_pq_args;
void kv_pq_arg_i64(kv_pq_args *a, int64_t v);
void kv_pq_arg_text(kv_pq_args *a, const char *s); /* s must outlive the call */
void kv_pq_arg_blob(kv_pq_args *a, const void *b, size_t n);

/* Runs statement q (0..63, prepared once per connection as sql) with args.
 * Returns the result (PQclear it) when it succeeded, else NULL with d
 * filled; when state is not NULL it receives the SQLSTATE ("" if none), so
 * a caller can tell a unique violation ("23505") from a lost connection. */
PGresult *kv_pq_run(kv_pq *p, int q, const char *sql, const kv_pq_args *a, char state[6], kv_diag *d);
/* A fixed command without parameters (BEGIN, COMMIT, schema). 0 or KV_EIO. */
int kv_pq_exec(kv_pq *p, const char *sql, kv_diag *d);
/* Rows changed by an INSERT/UPDATE/DELETE result. */
long kv_pq_changed(PGresult *r);

/* Column readers: 0, or KV_EFORMAT naming what (a NULL, a value outside
 * [min, max], a text of cap bytes or more, a bytea of another length). */
int kv_pq_i64(PGresult *r, int row, int col, int64_t min, int64_t max, int64_t *out, kv_diag *d,
              const char *who, const char *what);
int kv_pq_text(PGresult *r, int row, int col, char *out, size_t cap, kv_diag *d, const char *who,
               const char *what);
/* want bytes exactly, or (got != NULL) at most want, length into *got. */
int kv_pq_bytea(PGresult *r, int row, int col, uint8_t *out, size_t want, size_t *got, kv_diag *d,
                const char *who, const char *what);
#endif

#endif
