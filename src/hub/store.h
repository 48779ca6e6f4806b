/* The hub's persistent state behind one interface.
 *
 * The server keeps its registry in memory (the market and placement are
 * computed from there) and writes every change through a kv_hub_store
 * before it answers, so a restart reloads exactly what was acknowledged.
 * A backend is one file that fills a kv_hub_store_ops table: SQLite
 * (store_sqlite.c, one hub process per file) and PostgreSQL (store_pg.c,
 * any number of hub processes on one database); kv_hub_store_open picks one
 * from the URI (src/pg/pq.h: "postgresql://...", "pg:CONNINFO", else a
 * SQLite file path).
 *
 * Replay protection lives in the store, not only in a hub's memory: every
 * write that a signed request causes (node_put, node_touch,
 * node_drop_shards) is conditional on the stored counter being below the
 * request's, inside one transaction, so of two hubs on one database that
 * receive the same signed request only one accepts it. A shared backend
 * (ops->shared) also keeps the registration nonces (node_put consumes one
 * in the same transaction), so a nonce handed out by hub A can be used once,
 * at A or at B.
 *
 * Contract for every operation: returns 0 or a negative KV_E* code with d
 * filled; a failed write changes nothing (each runs in one transaction).
 * Calls on one store are serialized by the caller (the hub's state lock);
 * a second kv_hub_store on the same URI is an independent connection. */
#ifndef KVASIR_HUB_STORE_H
#define KVASIR_HUB_STORE_H

#include <stdbool.h>
#include <stdint.h>

#include "hub/market.h"
#include "kvasir/err.h"
#include "kvasir/hub.h"

/* One node as stored. */
typedef struct kv_hub_node_rec {
    uint8_t pk[32];                     /* identity */
    char addr[KV_HUB_MAX_ADDR + 1];     /* dispatch HOST:PORT it announced */
    char backend[KV_HUB_MAX_BACKEND + 1];
    char site[KV_HUB_MAX_SITE + 1];     /* as announced; "" = none (the hub groups it) */
    uint64_t memory;                    /* announced memory budget, bytes */
    uint64_t counter;                   /* last accepted request counter */
    int64_t last_seen_ms;               /* wall clock of the last heartbeat (Unix ms) */
    int64_t registered_ms;              /* wall clock of the last registration */
    const kv_hub_held *shards;          /* [n_shards] held (sha256 as announced) */
    size_t n_shards;
} kv_hub_node_rec;

/* One shard's market state as stored (market.h), keyed by its slab. */
typedef struct kv_mkt_row {
    uint32_t layer, first;              /* the manifest slab */
    kv_mkt_state s;
} kv_mkt_row;

/* What a demand report may count (the hub's bounds, docs/HUB.md "Demand"). */
typedef struct kv_demand_budget {
    int64_t window_ms;                  /* length of one accounting window (> 0) */
    uint64_t key_tokens;                /* tokens one key may report per window */
    uint64_t net_tokens;                /* tokens all keys of one address block may report per window */
} kv_demand_budget;

typedef struct kv_hub_store_ops {
    const char *name;                                        /* "sqlite", "postgresql" */
    bool shared;    /* other processes may change the state: the hub refreshes its view */
    int (*open)(void **impl, const char *uri, kv_diag *d);
    void (*close)(void *impl);                               /* accepts NULL */
    /* meta key/value (model_id, settings); *val "" when absent; put
     * inserts or replaces */
    int (*meta_get)(void *impl, const char *key, char *val, size_t cap, kv_diag *d);
    int (*meta_put)(void *impl, const char *key, const char *val, kv_diag *d);
    /* put only if the key is absent (of hubs that start together on one
     * store, the first wins; each then reads the value back) */
    int (*meta_put_new)(void *impl, const char *key, const char *val, kv_diag *d);
    /* Insert or replace a node with its whole holding list, only if no
     * stored counter for pk is >= n->counter (else KV_EPROTO, nothing
     * written). With nonce (shared backends), the registration nonce is
     * consumed in the same transaction: unknown, used or expired at now_ms
     * is KV_ENOTFOUND and nothing is written. */
    int (*node_put)(void *impl, const kv_hub_node_rec *n, const uint8_t nonce[32], int64_t now_ms, kv_diag *d);
    /* A heartbeat: counter and last_seen only, if the stored counter is
     * below counter. KV_ENOTFOUND: no such node; KV_EPROTO: stale counter. */
    int (*node_touch)(void *impl, const uint8_t pk[32], uint64_t counter, int64_t last_seen_ms,
                      kv_diag *d);
    /* Drop a node's holdings (failed challenge) and move its counter on,
     * under the same condition and codes as node_touch; last_seen_ms < 0
     * keeps the stored one. */
    int (*node_drop_shards)(void *impl, const uint8_t pk[32], uint64_t counter, int64_t last_seen_ms,
                            kv_diag *d);
    /* calls cb for every node (shards valid during the call only), from
     * one consistent snapshot; a non-zero return from cb stops and is
     * returned */
    int (*node_each)(void *impl, int (*cb)(void *arg, const kv_hub_node_rec *n), void *arg,
                     kv_diag *d);
    /* The market state (table market): cb for every stored shard (rows
     * bounds-checked: KV_EFORMAT for one that does not fit). */
    int (*mkt_each)(void *impl, int (*cb)(void *arg, const kv_mkt_row *r), void *arg, kv_diag *d);
    /* Writes r only if the stored version of (layer, first) is prev (0: no
     * row yet); r->s.version must be prev + 1. KV_EPROTO (nothing written)
     * when another write came first: of hubs that step one state at once,
     * one wins and the others reload. */
    int (*mkt_put)(void *impl, const kv_mkt_row *r, int64_t prev, kv_diag *d);
    /* A demand report of `tokens` by key pk (signed with counter) from
     * address block net, at now_ms, in one transaction: KV_EPROTO when the
     * stored counter of pk is >= counter (a replay; nothing written); else
     * the counter is stored and *granted = min(tokens, what is left of the
     * key's and of the block's budget in their current windows), which is
     * charged to both. A window older than b->window_ms starts over, and
     * rows of windows that ended a window ago are pruned (the hub refuses
     * reports whose counter, the reporter's clock, is more than a window
     * off its own, so a pruned key's old reports stay refused). */
    int (*demand_charge)(void *impl, const uint8_t pk[32], uint64_t counter, const char *net, int64_t now_ms,
                         const kv_demand_budget *b, uint64_t tokens, uint64_t *granted, kv_diag *d);
    /* shared backends only (NULL otherwise): */
    /* one node, KV_ENOTFOUND when absent */
    int (*node_get)(void *impl, const uint8_t pk[32], int (*cb)(void *arg, const kv_hub_node_rec *n), void *arg,
                    kv_diag *d);
    /* records a registration nonce until expires_ms; the store picks its
     * slot in a bounded ring of KV_HUB_MAX_NONCES (the oldest is forgotten)
     * and writes it into nonce[0..3]; bytes 4..31 are the caller's random */
    int (*nonce_put)(void *impl, uint8_t nonce[32], int64_t expires_ms, kv_diag *d);
} kv_hub_store_ops;

extern const kv_hub_store_ops kv_hub_store_sqlite;
extern const kv_hub_store_ops kv_hub_store_pg;

typedef struct kv_hub_store {
    const kv_hub_store_ops *ops;
    void *impl;
} kv_hub_store;

/* Opens the backend the URI names: PostgreSQL for "postgresql://...",
 * "postgres://..." and "pg:CONNINFO" (KV_EUNSUPPORTED when built without
 * libpq), else a SQLite file path. */
int kv_hub_store_open(kv_hub_store *s, const char *uri, kv_diag *d);
void kv_hub_store_close(kv_hub_store *s);

#endif
