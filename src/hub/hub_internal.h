/* Hub internals shared by the server and the benchmarks (never by nodes):
 * a way to place a node in the registry without HTTP, signatures or hash
 * checks, so the market can be measured at a scale that a test could not
 * register by hand. */
#ifndef KVASIR_HUB_INTERNAL_H
#define KVASIR_HUB_INTERNAL_H

#include "kvasir/hub.h"

/* Adds (or replaces) node pk holding the manifest's slabs slab_idx[0..n) with
 * the given last heartbeat (Unix ms), in memory only. */
int kv_hub_inject_node(kv_hub *h, const uint8_t pk[32], const char *addr, const uint32_t *slab_idx,
                       size_t n, int64_t last_seen_ms, kv_diag *d);
/* Number of slabs in the served manifest. */
size_t kv_hub_n_shards(const kv_hub *h);
/* GET /v1/placement as a malloc'd string (caller frees). */
int kv_hub_placement_json(kv_hub *h, char **out, size_t *len, kv_diag *d);

/* kv_hub_challenge_answer over a file relative to an open folder (the hub
 * answers its own challenges from the folder it serves). */
int kv_hub_challenge_answer_at(int dir_fd, const char *rel, uint64_t size, const uint8_t nonce[32],
                               uint8_t out[32], kv_diag *d);

#endif
