/* The ledger's storage interface: every SQL statement of the ledger lives
 * behind these operations; SQLite (store_sqlite.c) and PostgreSQL
 * (store_pg.c) implement them, chosen from the path like the hub's store
 * ("postgresql://...", "postgres://...", "pg:CONNINFO", else a file). The logic (signatures, balances, limits,
 * idempotency) lives in ledger.c and never sees SQL.
 *
 * Contract for every backend: begin_write starts a transaction that
 * serializes with every other writer on the same database, in any process
 * (SQLite: BEGIN IMMEDIATE; PostgreSQL: SERIALIZABLE or a table lock), so a
 * balance read inside it cannot change before commit. Reads of a row that
 * does not exist return KV_ENOTFOUND. Every integer read back is checked
 * against its bounds (a corrupt row is KV_EFORMAT, never trusted). Strings
 * and blobs have fixed maxima; a longer one is KV_EFORMAT. */
#ifndef KVASIR_LEDGER_STORE_H
#define KVASIR_LEDGER_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/ledger.h"

enum { KV_ACCT_CONSUMER = 1, KV_ACCT_NODE, KV_ACCT_TREASURY, KV_ACCT_ESCROW, KV_ACCT_MINT };
enum { KV_AUTH_HELD = 1, KV_AUTH_SETTLED, KV_AUTH_RELEASED };
#define KV_REF_MAX 48

typedef struct kv_store_account {
    char id[KV_LEDGER_ACCOUNT_MAX];
    int kind;         /* KV_ACCT_* */
    int64_t balance;  /* credits - debits; only the mint's is negative */
    uint64_t debits;  /* sum of amounts debited */
    uint64_t credits; /* sum of amounts credited */
} kv_store_account;

typedef struct kv_store_transfer {
    int64_t seq;                           /* journal order (set by the store) */
    uint8_t id[16];                        /* client-chosen, unique */
    char debit[KV_LEDGER_ACCOUNT_MAX];
    char credit[KV_LEDGER_ACCOUNT_MAX];
    uint64_t amount;                       /* 1..KV_LEDGER_MAX_AMOUNT */
    int code;                              /* KV_XFER_* */
    uint8_t ref[KV_REF_MAX];               /* authorization key (consumer||nonce) or issue id */
    size_t ref_len;
    int64_t ts;                            /* unix seconds */
} kv_store_transfer;

typedef struct kv_store_auth {
    uint8_t consumer[32], nonce[16];
    char gateway[KV_GATEWAY_ID_MAX + 1];
    uint64_t max, expires;
    int state;                 /* KV_AUTH_* */
    uint8_t settle_digest[32]; /* of the settle request, for identical retries */
    uint64_t cost, fee, to_nodes, returned;
} kv_store_auth;

typedef struct kv_store_receipt {
    uint8_t node[32], nonce[16];
    uint8_t consumer[32], auth_nonce[16];
    uint64_t n_products;
    uint8_t transfer_id[16]; /* the REWARD transfer it backs */
} kv_store_receipt;

/* Aggregates for kv_ledger_check, computed by the store in one read
 * transaction. */
typedef struct kv_store_check {
    uint64_t n_accounts, n_transfers, n_receipts;
    uint64_t sum_amount;         /* over the journal */
    uint64_t sum_debits, sum_credits; /* over accounts' posted totals */
    uint64_t n_bad_account;      /* posted totals or balance != journal sums */
    char bad_account[KV_LEDGER_ACCOUNT_MAX];
    uint64_t n_negative;         /* non-mint balance < 0, or mint balance > 0 */
    uint64_t supply;             /* sum of non-mint balances */
    uint64_t issued;             /* sum of ISSUE transfers */
    int64_t mint_balance;
    uint64_t escrow_balance, held_sum;
    uint64_t n_untraced_reward;  /* REWARD transfers with no receipt, receipts with no REWARD */
    uint64_t n_bad_node_credit;  /* credits to a node account other than REWARD */
    uint64_t n_bad_auth;         /* outflows from escrow != its hold, or holds != 1 */
    uint64_t n_held, n_settled, n_released;
} kv_store_check;

typedef struct kv_store kv_store;
typedef struct kv_store_ops {
    const char *name;
    int (*open)(kv_store **out, const char *path, kv_diag *d);
    void (*close)(kv_store *s);
    int (*init_schema)(kv_store *s, kv_diag *d);
    int (*begin_write)(kv_store *s, kv_diag *d);
    int (*begin_read)(kv_store *s, kv_diag *d);
    int (*commit)(kv_store *s, kv_diag *d);
    void (*rollback)(kv_store *s);
    int (*meta_get)(kv_store *s, const char *key, uint8_t *val, size_t cap, size_t *len, kv_diag *d);
    int (*meta_put)(kv_store *s, const char *key, const uint8_t *val, size_t len, kv_diag *d);
    int (*account_get)(kv_store *s, const char *id, kv_store_account *a, kv_diag *d);
    int (*account_put)(kv_store *s, const kv_store_account *a, kv_diag *d);
    int (*transfer_get)(kv_store *s, const uint8_t id[16], kv_store_transfer *t, kv_diag *d);
    int (*transfer_put)(kv_store *s, const kv_store_transfer *t, kv_diag *d);
    int (*auth_get)(kv_store *s, const uint8_t consumer[32], const uint8_t nonce[16],
                    kv_store_auth *a, kv_diag *d);
    int (*auth_put)(kv_store *s, const kv_store_auth *a, kv_diag *d); /* insert or replace */
    /* Up to cap held authorizations of gateway; *n set. */
    int (*auth_held)(kv_store *s, const char *gateway, kv_store_auth *out, size_t cap, size_t *n,
                     kv_diag *d);
    /* 1 when (node, nonce) or (node, consumer, auth_nonce) is already used, else 0. */
    int (*receipt_used)(kv_store *s, const kv_store_receipt *r, kv_diag *d);
    int (*receipt_put)(kv_store *s, const kv_store_receipt *r, kv_diag *d);
    int (*each_transfer)(kv_store *s, const char *account,
                         int (*fn)(void *ctx, const kv_store_transfer *t), void *ctx, kv_diag *d);
    int (*check)(kv_store *s, kv_store_check *c, kv_diag *d);
    /* How many receipts of node are recorded, and the sum of their products. */
    int (*node_receipts)(kv_store *s, const uint8_t node[32], uint64_t *n, uint64_t *products, kv_diag *d);
    /* open, read-only: every write (and begin_write) fails */
    int (*open_ro)(kv_store **out, const char *path, kv_diag *d);
} kv_store_ops;

extern const kv_store_ops kv_store_sqlite; /* a file path */
extern const kv_store_ops kv_store_pg;     /* a store URI that pg/pq.h's kv_pq_uri accepts */

#endif
