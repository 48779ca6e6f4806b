/* The hub's persistent state behind one interface.
 *
 * The server keeps its registry in memory (the market and placement are
 * computed from there) and writes every change through a kv_hub_store
 * before it answers, so a restart reloads exactly what was acknowledged.
 * A backend is one file that fills a kv_hub_store_ops table: SQLite
 * (store_sqlite.c) today; a PostgreSQL one (libpq) would be one more file
 * and a branch in kv_hub_store_open.
 *
 * Contract for every operation: returns 0 or a negative KV_E* code with d
 * filled; a failed write changes nothing (each runs in one transaction).
 * Calls on one store are serialized by the caller (the hub's state lock). */
#ifndef KVASIR_HUB_STORE_H
#define KVASIR_HUB_STORE_H

#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/hub.h"

/* One node as stored. */
typedef struct kv_hub_node_rec {
    uint8_t pk[32];                     /* identity */
    char addr[KV_HUB_MAX_ADDR + 1];     /* dispatch HOST:PORT it announced */
    char backend[KV_HUB_MAX_BACKEND + 1];
    uint64_t memory;                    /* announced memory budget, bytes */
    uint64_t counter;                   /* last accepted request counter */
    int64_t last_seen_ms;               /* wall clock of the last heartbeat (Unix ms) */
    int64_t registered_ms;              /* wall clock of the last registration */
    const kv_hub_held *shards;          /* [n_shards] held (sha256 as announced) */
    size_t n_shards;
} kv_hub_node_rec;

typedef struct kv_hub_store_ops {
    const char *name;                                        /* "sqlite" */
    int (*open)(void **impl, const char *uri, kv_diag *d);
    void (*close)(void *impl);                               /* accepts NULL */
    /* meta key/value (model_id, settings); *val "" when absent */
    int (*meta_get)(void *impl, const char *key, char *val, size_t cap, kv_diag *d);
    int (*meta_put)(void *impl, const char *key, const char *val, kv_diag *d);
    /* insert or replace a node with its whole holding list */
    int (*node_put)(void *impl, const kv_hub_node_rec *n, kv_diag *d);
    /* a heartbeat: counter and last_seen only */
    int (*node_touch)(void *impl, const uint8_t pk[32], uint64_t counter, int64_t last_seen_ms,
                      kv_diag *d);
    /* drop a node's holdings (failed challenge), keep its counter */
    int (*node_drop_shards)(void *impl, const uint8_t pk[32], uint64_t counter, kv_diag *d);
    /* calls cb for every node (shards valid during the call only); a
     * non-zero return from cb stops and is returned */
    int (*node_each)(void *impl, int (*cb)(void *arg, const kv_hub_node_rec *n), void *arg,
                     kv_diag *d);
} kv_hub_store_ops;

extern const kv_hub_store_ops kv_hub_store_sqlite;

typedef struct kv_hub_store {
    const kv_hub_store_ops *ops;
    void *impl;
} kv_hub_store;

/* Opens the backend the URI names (today: any path is a SQLite file). */
int kv_hub_store_open(kv_hub_store *s, const char *uri, kv_diag *d);
void kv_hub_store_close(kv_hub_store *s);

#endif
