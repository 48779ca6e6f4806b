/* Hub internals shared by the server and the benchmarks (never by nodes):
 * a way to place a node in the registry without HTTP, signatures or hash
 * checks, so the market can be measured at a scale that a test could not
 * register by hand. */
#ifndef KVASIR_HUB_INTERNAL_H
#define KVASIR_HUB_INTERNAL_H

#include "kvasir/hub.h"
#include "kvasir/slice.h"

/* Adds (or replaces) node pk holding the manifest's slabs slab_idx[0..n) with
 * the given last heartbeat (Unix ms), in memory only. */
int kv_hub_inject_node(kv_hub *h, const uint8_t pk[32], const char *addr, const uint32_t *slab_idx,
                       size_t n, int64_t last_seen_ms, kv_diag *d);
/* Number of slabs in the served manifest. */
size_t kv_hub_n_shards(const kv_hub *h);
/* GET /v1/placement as a malloc'd string (caller frees). */
int kv_hub_placement_json(kv_hub *h, char **out, size_t *len, kv_diag *d);

/* One node as the sites see it (a snapshot taken under the hub's lock). */
typedef struct kv_hub_site_node {
    char site[48];             /* its site: given, or the hub's auto name (kv_hub_site_name) */
    bool given;                /* the node named it (--site) */
    bool ring;                 /* a ring node (holds a layer window), else an expert worker */
    double rtt_ms;             /* measured by the hub; < 0 = not yet */
    uint8_t pk[32];
    char addr[KV_HUB_MAX_ADDR + 1];
    const uint32_t *slabs;     /* [n_slabs] manifest slabs it holds, proven (workers) */
    size_t n_slabs;
} kv_hub_site_node;

/* A node's site: `given` when not empty, else "auto:hub" (measured within
 * KV_HUB_SITE_NEAR_MS, or on loopback), else "auto:" and its subnet. */
void kv_hub_site_name(const char *given, double rtt_ms, const char *host, const char *subnet, char *out, size_t cap);
/* GET /v1/sites from a snapshot of the live nodes (sites.c). */
int kv_hub_sites_render(const kv_manifest *m, const kv_hub_site_node *nodes, size_t n_nodes, char **out, size_t *len,
                        kv_diag *d);

/* kv_hub_challenge_answer over a file relative to an open folder (the hub
 * answers its own challenges from the folder it serves). */
int kv_hub_challenge_answer_at(int dir_fd, const char *rel, uint64_t size, const uint8_t nonce[32],
                               uint8_t out[32], kv_diag *d);

#endif
