/* The KVR ledger: wallets, payment authorizations, work receipts, and a
 * double-entry journal in SQLite (docs/LEDGER.md has every byte format).
 *
 * Money is integer micro-KVR. Every change is one store transaction (BEGIN
 * IMMEDIATE) holding one or more journal entries, each debiting one account
 * and crediting another; balances are checked inside that transaction and
 * never go below zero (the mint, which issuance debits, is the one account
 * whose balance is the negative of the supply). Every amount and every
 * balance stays below KV_LEDGER_MAX_AMOUNT (2^62), every sum is checked.
 *
 * Nothing moves without a signature from a key allowed to move it:
 *   issuance   signed by the operator key recorded when the ledger was made;
 *   escrow     a consumer's signed authorization, usable once, for one gateway,
 *              before its expiry, only if the consumer's balance covers max;
 *   settle     pays at most the authorized max; a node is credited only for
 *              work in the coordinator's dispatch log, backed by a receipt the
 *              node signed, and each receipt is used once;
 *   release    returns the whole hold when the completion did not happen.
 *
 * What the gateway calls, per completion:
 *   kv_auth_decode(header)                       -> kv_auth (signature checked)
 *   kv_ledger_escrow(l, &auth, my_gateway_id, now) -> hold auth.max
 *   ... run the completion, collect kv_receipt from the nodes ...
 *   kv_ledger_settle(l, &req, &res)  (cost from tokens x prices; fee; nodes;
 *                                     the rest back to the consumer)
 *   or kv_ledger_release(l, consumer, nonce) when it failed;
 *   kv_ledger_recover(l, my_gateway_id) once on start: releases every hold the
 *   previous run of that gateway left behind.
 * A refusal (kv_ledger_refused(rc)) is a 402: nothing was charged.
 *
 * Threads: a kv_ledger is one store connection; use one per thread (or lock
 * around it). Any number of handles, in any number of processes, may share
 * one database file: the store serializes writers. */
#ifndef KVASIR_LEDGER_H
#define KVASIR_LEDGER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"

#define KV_LEDGER_MAX_AMOUNT ((UINT64_C(1) << 62) - 1) /* any amount, balance or supply */
#define KV_LEDGER_MAX_PRODUCTS (UINT64_C(1) << 40)    /* (token, expert) products per node */
#define KV_LEDGER_MAX_LOG 1024                        /* nodes in one dispatch log */
#define KV_LEDGER_ACCOUNT_MAX 80                      /* account id string, with NUL */
#define KV_GATEWAY_ID_MAX 32                          /* bytes of a gateway id */

/* ---- results --------------------------------------------------------------
 * Ledger calls return 0 (done), KV_LEDGER_EXISTS (an identical retry of
 * something already done: nothing changed), a refusal below (nothing
 * changed; a gateway answers 402), or a negative KV_E* error (bad input,
 * store failure; nothing changed). */
#define KV_LEDGER_EXISTS 1
#define KV_LEDGER_REFUSAL_MAP(X)                                              \
    X(RFUNDS,     -200, "insufficient funds")                                 \
    X(RREPLAY,    -201, "authorization already used")                         \
    X(REXPIRED,   -202, "authorization expired")                              \
    X(RGATEWAY,   -203, "authorization is for another gateway")               \
    X(RSIGNATURE, -204, "bad signature")                                      \
    X(RCONFLICT,  -205, "id already used with other fields")                  \
    X(RRECEIPT,   -206, "invalid work receipt")                               \
    X(RSTATE,     -207, "authorization is not held")                          \
    X(ROVERMAX,   -208, "cost exceeds the authorized maximum")                \
    X(RLIMIT,     -209, "amount limit exceeded")                              \
    X(RACCOUNT,   -210, "account not allowed here")
enum kv_ledger_refusal {
#define KV_LR_ENUM(name, val, str) KV_LEDGER_##name = (val),
    KV_LEDGER_REFUSAL_MAP(KV_LR_ENUM)
#undef KV_LR_ENUM
};
static inline bool kv_ledger_refused(int rc) { return rc <= -200 && rc >= -299; }
/* "RFUNDS", "EXISTS", "OK" or kv_err_name(rc); never NULL. */
const char *kv_ledger_rc_name(int rc);

/* ---- wallets -------------------------------------------------------------- */
typedef struct kv_wallet {
    uint8_t pk[32]; /* Ed25519 public key: the account */
    uint8_t sk[64]; /* libsodium secret key (seed || pk) */
} kv_wallet;

/* Fresh random key. Returns 0 or KV_EINTERNAL (libsodium failed to start). */
int kv_wallet_generate(kv_wallet *w, kv_diag *d);
/* Writes "kvasir-ed25519-v1 <64 hex of the seed>\n" to a new file (mode 0600;
 * refuses to overwrite). Returns 0 or KV_EIO. */
int kv_wallet_save(const kv_wallet *w, const char *path, kv_diag *d);
/* Reads a key file written by kv_wallet_save, or a node / coordinator key
 * file of `kvasir key` (64 lowercase hex digits of the seed and a newline:
 * a node's account is its node key). Size and format checked. Returns 0,
 * KV_EIO or KV_EFORMAT. */
int kv_wallet_load(kv_wallet *w, const char *path, kv_diag *d);
/* The same from n bytes in memory (a trailing newline is optional).
 * Returns 0 or KV_EFORMAT. */
int kv_wallet_parse(kv_wallet *w, const uint8_t *b, size_t n, kv_diag *d);
/* The node key format (exactly 65 bytes). Returns 0 or KV_EFORMAT. */
int kv_wallet_parse_node_key(kv_wallet *w, const uint8_t *b, size_t n, kv_diag *d);
/* A key in an account id or a wallet: exactly 64 hex digits of either case
 * (kv_unhex of kvasir/link.h; ids are printed with kv_hex, lowercase).
 * Returns 0 or KV_EFORMAT. */
int kv_unhex32(const char *s, uint8_t out[32], kv_diag *d);

/* ---- accounts ---------------------------------------------------------------
 * Account ids are strings: "consumer:<hex pk>", "node:<hex pk>", "treasury",
 * "escrow", "mint". */
void kv_ledger_account_consumer(const uint8_t pk[32], char out[KV_LEDGER_ACCOUNT_MAX]);
void kv_ledger_account_node(const uint8_t pk[32], char out[KV_LEDGER_ACCOUNT_MAX]);
/* Checks the syntax of an account id; a bare 64-hex key means the consumer. */
int kv_ledger_account_parse(const char *s, char out[KV_LEDGER_ACCOUNT_MAX], kv_diag *d);

/* ---- payment authorizations (header X-KVR-Payment) -------------------------- */
#define KV_AUTH_BODY_SIZE 104 /* bytes signed */
#define KV_AUTH_SIZE 168      /* body + Ed25519 signature */
#define KV_AUTH_HEADER_MAX 232 /* "kvr1." + base64url(168) + NUL */
typedef struct kv_auth {
    uint8_t consumer[32];                /* consumer's public key */
    char gateway[KV_GATEWAY_ID_MAX + 1]; /* gateway id, [A-Za-z0-9._:-], 1..32 bytes */
    uint64_t max;                        /* micro-KVR, 1..KV_LEDGER_MAX_AMOUNT */
    uint64_t expires;                    /* unix seconds; usable while now < expires */
    uint8_t nonce[16];                   /* random; (consumer, nonce) is the authorization id */
    uint8_t sig[64];                     /* over the body bytes */
} kv_auth;

/* Fills a and signs it with a fresh random nonce. Returns 0 or KV_EINVAL. */
int kv_auth_sign(kv_auth *a, const kv_wallet *w, const char *gateway, uint64_t max,
                 uint64_t expires, kv_diag *d);
/* Canonical bytes (body, then signature). Returns 0 or KV_EINVAL (a field
 * out of its bounds). */
int kv_auth_to_bytes(const kv_auth *a, uint8_t out[KV_AUTH_SIZE], kv_diag *d);
/* Parses canonical bytes and verifies the signature. Returns 0, KV_EFORMAT,
 * or KV_LEDGER_RSIGNATURE; a is unspecified on failure. */
int kv_auth_from_bytes(kv_auth *a, const uint8_t *b, size_t n, kv_diag *d);
/* Header text "kvr1.<base64url, no padding>" into out (cap >= KV_AUTH_HEADER_MAX). */
int kv_auth_encode(const kv_auth *a, char *out, size_t cap, kv_diag *d);
/* Parses a header value of length n (no NUL needed) and verifies it. Returns
 * 0, KV_EFORMAT or KV_LEDGER_RSIGNATURE. */
int kv_auth_decode(kv_auth *a, const char *s, size_t n, kv_diag *d);

/* ---- work receipts ---------------------------------------------------------- */
#define KV_RECEIPT_BODY_SIZE 176
#define KV_RECEIPT_SIZE 240
typedef struct kv_receipt {
    uint8_t node[32];                    /* node's public key (its account) */
    char gateway[KV_GATEWAY_ID_MAX + 1]; /* gateway/coordinator that dispatched */
    uint8_t consumer[32];                /* authorization it worked for ... */
    uint8_t auth_nonce[16];              /* ... (consumer, nonce) */
    uint64_t n_products;                 /* (token, expert) products computed, 1..2^40 */
    uint8_t log_digest[32];              /* digest of the coordinator's dispatch log to this node */
    uint8_t nonce[16];                   /* random; (node, nonce) is the receipt id */
    uint8_t sig[64];                     /* by node, over the body bytes */
} kv_receipt;

/* Fills r (fresh nonce) and signs it with the node's key. */
int kv_receipt_sign(kv_receipt *r, const kv_wallet *node, const kv_auth *a,
                    uint64_t n_products, const uint8_t log_digest[32], kv_diag *d);
int kv_receipt_to_bytes(const kv_receipt *r, uint8_t out[KV_RECEIPT_SIZE], kv_diag *d);
/* Parses and verifies. Returns 0, KV_EFORMAT or KV_LEDGER_RSIGNATURE. */
int kv_receipt_from_bytes(kv_receipt *r, const uint8_t *b, size_t n, kv_diag *d);

/* ---- issuance (signed by the operator) --------------------------------------- */
#define KV_ISSUE_BODY_SIZE 64
#define KV_ISSUE_SIZE 128
typedef struct kv_issue {
    uint8_t consumer[32]; /* account funded */
    uint64_t amount;      /* micro-KVR, 1..KV_LEDGER_MAX_AMOUNT */
    uint8_t id[16];       /* client-chosen; an identical retry answers EXISTS */
    uint8_t sig[64];      /* by the operator, over the body bytes */
} kv_issue;
/* id NULL: a random one. */
int kv_issue_sign(kv_issue *is, const kv_wallet *op, const uint8_t consumer[32], uint64_t amount,
                  const uint8_t *id, kv_diag *d);
int kv_issue_to_bytes(const kv_issue *is, uint8_t out[KV_ISSUE_SIZE], kv_diag *d);
int kv_issue_from_bytes(kv_issue *is, const uint8_t *b, size_t n, kv_diag *d); /* no key check */

/* ---- the ledger --------------------------------------------------------------- */
typedef struct kv_ledger kv_ledger;

/* Creates the schema in a new or empty file, recording the operator's public
 * key and the protocol fee (basis points, 0..10000). Re-running with the same
 * key and fee answers KV_LEDGER_EXISTS; with another, KV_LEDGER_RCONFLICT. */
int kv_ledger_init(const char *path, const uint8_t operator_pk[32], uint32_t fee_bps, kv_diag *d);
/* Opens an initialized ledger (WAL). Caller frees with kv_ledger_free. */
int kv_ledger_open(kv_ledger **out, const char *path, kv_diag *d);
/* The same, read-only (SQLite READONLY + query_only): every write call
 * fails with the store's error and nothing changes. */
int kv_ledger_open_readonly(kv_ledger **out, const char *path, kv_diag *d);
void kv_ledger_free(kv_ledger *l); /* accepts NULL */

/* Credits is->consumer from the mint. The signature must verify against the
 * operator key; total supply stays <= KV_LEDGER_MAX_AMOUNT. */
int kv_ledger_issue(kv_ledger *l, const kv_issue *is, kv_diag *d);

/* Holds a->max from the consumer in escrow. Verifies the signature, that
 * a->gateway equals gateway_id, that now < a->expires, that (consumer, nonce)
 * was never seen (any second call is RREPLAY: the gateway never serves two
 * completions on one authorization), and that the balance covers max. */
int kv_ledger_escrow(kv_ledger *l, const kv_auth *a, const char *gateway_id, uint64_t now,
                     kv_diag *d);

typedef struct kv_dispatch_entry {
    uint8_t node[32];       /* who computed */
    uint64_t n_products;    /* how many (token, expert) products, 1..2^40 */
    uint8_t log_digest[32]; /* digest of what was dispatched to it (its receipt signs this) */
} kv_dispatch_entry;

typedef struct kv_settle_req {
    uint8_t consumer[32], nonce[16];     /* the held authorization */
    uint64_t prompt_tokens, completion_tokens;
    uint64_t price_prompt, price_completion; /* micro-KVR per token, published by the gateway */
    const kv_dispatch_entry *log;        /* the coordinator's own dispatch log, nodes distinct */
    size_t n_log;                        /* 0..KV_LEDGER_MAX_LOG */
    const kv_receipt *receipts;          /* at most one per node of the log */
    size_t n_receipts;
} kv_settle_req;

typedef struct kv_settle_result {
    uint64_t cost;     /* tokens x prices, <= max */
    uint64_t fee;      /* to the treasury: floor(cost * fee_bps / 10000) */
    uint64_t to_nodes; /* paid to nodes with a valid receipt */
    uint64_t returned; /* back to the consumer: max - fee - to_nodes */
} kv_settle_result;

/* Settles a held authorization in one transaction: the fee to the treasury,
 * cost - fee split among the log's nodes in proportion to n_products
 * (kv_ledger_split); a node's share is paid only with its valid receipt
 * (signed by it, for this authorization and gateway, with the log's count
 * and digest, never used before), otherwise it goes back to the consumer
 * with max - cost. Any invalid receipt refuses the whole call (RRECEIPT),
 * changing nothing. An identical retry answers EXISTS (res filled). */
int kv_ledger_settle(kv_ledger *l, const kv_settle_req *r, kv_settle_result *res, kv_diag *d);
/* Returns the whole hold to the consumer. A second call answers EXISTS when
 * already released, RSTATE when settled. */
int kv_ledger_release(kv_ledger *l, const uint8_t consumer[32], const uint8_t nonce[16],
                      kv_diag *d);
/* Releases every hold of gateway_id (the previous run's interrupted
 * completions). *n_released (may be NULL) counts them. A hold that another
 * handle settles while this runs (the dead run's last commit landing late)
 * stays settled and is not counted. */
int kv_ledger_recover(kv_ledger *l, const char *gateway_id, uint64_t *n_released, kv_diag *d);

/* Splits pool among n counts in proportion, exactly: floor shares, then one
 * more micro-KVR to the largest remainders, ties by the smaller id (memcmp
 * of the 32-byte keys). sum(shares) == pool. n in 1..KV_LEDGER_MAX_LOG,
 * counts 1..KV_LEDGER_MAX_PRODUCTS, pool <= KV_LEDGER_MAX_AMOUNT. */
int kv_ledger_split(uint64_t pool, const uint64_t *counts, const uint8_t (*ids)[32], size_t n,
                    uint64_t *shares, kv_diag *d);

/* Balance of an account (0 for one never seen). The mint reports the
 * supply it issued. */
int kv_ledger_balance(kv_ledger *l, const char *account, uint64_t *out, kv_diag *d);

/* What node earned: the sum of its rewards (a node account is credited by
 * rewards only), and the receipts behind them (count, products). Zeros for
 * a node never paid. One read transaction. */
int kv_ledger_node_earnings(kv_ledger *l, const uint8_t node[32], uint64_t *earned, uint64_t *products,
                            uint64_t *n_receipts, kv_diag *d);

/* A read-only view shared by server threads (one connection behind a
 * mutex), for status pages: kv_ledger_reader_earned has the shape of
 * kv_hub_opts.earned (arg = the reader): 0 with *micro_kvr the node's
 * rewards (0 for a node never paid), nonzero on a store error. */
typedef struct kv_ledger_reader kv_ledger_reader;
int kv_ledger_reader_open(kv_ledger_reader **out, const char *path, kv_diag *d);
void kv_ledger_reader_free(kv_ledger_reader *r); /* accepts NULL */
int kv_ledger_reader_earned(void *reader, const uint8_t pk[32], uint64_t *micro_kvr);

typedef struct kv_ledger_entry {
    int64_t seq;                           /* journal order */
    uint8_t id[16];                        /* transfer id */
    char debit[KV_LEDGER_ACCOUNT_MAX];     /* account debited */
    char credit[KV_LEDGER_ACCOUNT_MAX];    /* account credited */
    uint64_t amount;                       /* micro-KVR */
    int code;                              /* KV_XFER_* */
    int64_t ts;                            /* unix seconds */
} kv_ledger_entry;
enum { KV_XFER_ISSUE = 1, KV_XFER_HOLD, KV_XFER_FEE, KV_XFER_REWARD, KV_XFER_RETURN, KV_XFER_COUNT };
const char *kv_ledger_code_name(int code);
/* Calls fn for every entry touching account (all when NULL), in journal
 * order; fn returning non-zero stops the walk (its value returned). */
int kv_ledger_statement(kv_ledger *l, const char *account,
                        int (*fn)(void *ctx, const kv_ledger_entry *e), void *ctx, kv_diag *d);

typedef struct kv_ledger_report {
    uint64_t n_accounts, n_transfers, n_receipts;
    uint64_t supply;        /* sum of every non-mint balance */
    uint64_t issued;        /* sum of issuance transfers */
    uint64_t escrow_held;   /* escrow balance */
    uint64_t n_held, n_settled, n_released; /* authorizations by state */
    char failed[256];       /* first invariant that failed, "" when all hold */
} kv_ledger_report;
/* Checks every invariant in one read transaction: debits == credits; each
 * balance == its journal sum, never negative; supply == issuance; escrow ==
 * sum of holds; every node credit traces to one receipt; no authorization
 * settled twice (its outflows equal its hold). Returns 0 when all hold,
 * KV_EINTERNAL (rep->failed and d name the first failure), or a store error. */
int kv_ledger_check(kv_ledger *l, kv_ledger_report *rep, kv_diag *d);

#endif
