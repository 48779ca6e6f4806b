/* Charging completions in KVR (docs/LEDGER.md "The gateway"): the gateway
 * side of the ledger. Every completion request carries a consumer's signed
 * authorization (header X-KVR-Payment); before any compute the gateway
 * checks it covers the prompt and at least one completion token at the
 * published prices and holds its max in escrow; after the completion it
 * settles prompt and completion tokens at those prices, pays the nodes that
 * computed the session's experts against their receipts, and returns the
 * rest. A completion that produced nothing (failed, or its client left
 * before any compute) is released whole.
 *
 * Threads: any connection thread may call these; one mutex serializes the
 * one ledger connection (the ledger itself serializes writers across
 * processes). */
#ifndef KVASIR_GATEWAY_PAY_H
#define KVASIR_GATEWAY_PAY_H

#include <stdbool.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/ledger.h"

typedef struct kv_gw_pay kv_gw_pay;

/* One completion's charge, owned by its connection. */
typedef struct kv_gw_charge {
    bool held;          /* escrow held and neither settled nor released yet */
    kv_auth a;          /* the authorization held */
    uint64_t n_prompt;  /* prompt tokens charged */
} kv_gw_charge;

/* Who computed a session's experts: the engine's count for the session
 * (kv_session_work) and, per worker of the dispatch, what it answered, with
 * its key when the handshake proved one. */
typedef struct kv_gw_work_node {
    bool has_key;
    uint8_t key[32];     /* the worker's node key */
    uint64_t answered;   /* (token, expert) products it answered for the session */
    const kv_receipt *receipt; /* its signed receipt, NULL when none came */
} kv_gw_work_node;

typedef struct kv_gw_work {
    uint64_t products;            /* every product of the session */
    const kv_gw_work_node *nodes; /* [n_nodes] */
    uint32_t n_nodes;
} kv_gw_work;

/* Opens the ledger (an initialized one: kvasir ledger init), loads the
 * gateway's node key, and releases every hold a previous run of this
 * gateway id left (*n_recovered counts them; may be NULL). id NULL: "gw-"
 * and the first 24 hex digits of the key. Errors: the ledger's and the key
 * file's, KV_EINVAL for a bad id or prices over 2^62. */
int kv_gw_pay_open(kv_gw_pay **out, const char *ledger_path, const char *key_path, const char *id,
                   uint64_t price_prompt, uint64_t price_completion, uint64_t *n_recovered, kv_diag *d);
void kv_gw_pay_free(kv_gw_pay *p); /* accepts NULL */
const char *kv_gw_pay_id(const kv_gw_pay *p);
const uint8_t *kv_gw_pay_node_key(const kv_gw_pay *p); /* the gateway's node key (its account) */

/* Checks header (NULL when absent) and holds its max for a completion of
 * n_prompt prompt tokens. *max_tokens is lowered to what the authorization
 * can pay for at the completion price. Returns 0 (ch->held), or an error
 * with d's message and *status: 402 (missing, malformed, bad signature,
 * expired, another gateway, replayed, funds short, max below the prompt's
 * cost plus one token: nothing was charged), or 500 (the ledger failed). */
int kv_gw_pay_hold(kv_gw_pay *p, const char *header, uint64_t n_prompt, uint32_t *max_tokens, kv_gw_charge *ch,
                   unsigned *status, kv_diag *d);
/* Settles a held charge: prompt + completion_tokens at the prices, the
 * nodes of w paid in proportion (work by a worker without a key, and work
 * done in this process, is booked to the gateway's own node account with a
 * receipt the gateway signs: only the operator can vouch for it). A charge
 * whose completion produced nothing (no tokens, no products) is released
 * instead. No-op when !ch->held. Returns 0 or the ledger's error (the hold
 * then stays, and the next start releases it). */
int kv_gw_pay_settle(kv_gw_pay *p, kv_gw_charge *ch, uint64_t completion_tokens, const kv_gw_work *w,
                     kv_settle_result *res, kv_diag *d);
/* Returns the whole hold (a failed completion). No-op when !ch->held. */
int kv_gw_pay_release(kv_gw_pay *p, kv_gw_charge *ch, kv_diag *d);
/* GET /v1/prices body (malloc'd JSON). */
char *kv_gw_pay_prices_json(const kv_gw_pay *p);
/* The digest of a dispatch log entry the receipt signs: BLAKE2b-256 of
 * "kvr-log-v1", the gateway id (32 bytes, zero-padded), the authorization's
 * consumer and nonce, the node key and n_products (u64 LE). */
void kv_gw_pay_log_digest(const char *gateway, const uint8_t consumer[32], const uint8_t nonce[16],
                          const uint8_t node[32], uint64_t n_products, uint8_t out[32]);

typedef struct kv_gw_pay_stats {
    uint64_t held, settled, released, refused; /* charges */
    uint64_t charged;                          /* micro-KVR settled as cost */
    uint64_t to_nodes, fees;                   /* of which paid to nodes / to the treasury */
} kv_gw_pay_stats;
void kv_gw_pay_get_stats(kv_gw_pay *p, kv_gw_pay_stats *out);

#endif
