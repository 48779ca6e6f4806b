/* The engine's prompt cache: prefixes of token sequences, in blocks of
 * block_tokens positions, each holding what a sequence that ran those
 * tokens from position 0 has in its state at the block's end: the KV rows
 * of the block's positions and (qwen35moe) the recurrent state
 * (kv_state_kv_get, kv_state_rec_get).
 *
 * Keys: block i of a prefix is found by a hash chain (the hash of block
 * i-1's key and block i's token ids) and then checked exactly: its parent
 * is the entry matched for block i-1 (the first block's is none) and its
 * own tokens are equal. So a block is reused only after an identical
 * prefix, whatever the hash does.
 *
 * Memory: every entry's bytes (KV rows, recurrent state, tokens, the entry)
 * count against budget_bytes. When an insert would exceed it, the least
 * recently used entry that no other entry extends (a leaf) is evicted, and
 * so on; a parent is never evicted before its children, so every entry
 * stays reachable from the first block. When only one chain is left (no
 * leaf but the new entry's parent), the recurrent states of its least
 * recently used blocks are dropped instead (the blocks stay, as links). An
 * entry larger than the budget is not kept.
 *
 * Not thread-safe: the engine's thread alone uses it (engine.h). */
#ifndef KVASIR_ENGINE_PREFIX_CACHE_H
#define KVASIR_ENGINE_PREFIX_CACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "kvasir/err.h"

typedef struct kv_pcache kv_pcache;
typedef struct kv_pc_entry kv_pc_entry;

#define KV_PCACHE_MAX_BLOCK 4096u /* tokens per block, at most */

/* budget_bytes > 0; block_tokens in [1, KV_PCACHE_MAX_BLOCK]; kv_bytes and
 * rec_bytes: what one block's KV rows and one recurrent state take (rec 0:
 * none). KV_EINVAL / KV_ENOMEM. Free with kv_pcache_free (accepts NULL). */
int kv_pcache_new(kv_pcache **out, uint64_t budget_bytes, uint32_t block_tokens, uint64_t kv_bytes,
                  uint64_t rec_bytes, kv_diag *d);
void kv_pcache_free(kv_pcache *c);

/* The longest cached prefix of tokens[0..n) made of at most max_blocks
 * blocks, walked from the first block. Returns the number of blocks
 * matched and fills path[0..matched) with their entries (path holds
 * max_blocks). Touches nothing. */
uint32_t kv_pcache_match(kv_pcache *c, const int32_t *tokens, uint32_t n, uint32_t max_blocks, kv_pc_entry **path);
/* Marks path[0..n) used now, the last (deepest) first, so a chain ages
 * from its end. */
void kv_pcache_touch(kv_pcache *c, kv_pc_entry *const *path, uint32_t n);

/* Inserts block `depth` of a prefix under parent (the entry of block
 * depth-1; NULL for depth 0): its tokens [block_tokens], its KV rows and
 * its recurrent state (NULL: not known: the entry serves as a link of the
 * chain only) are copied by fill(arg, kv, rec) into the entry's buffers
 * (rec NULL when not wanted); fill returns 0 or an error (nothing is kept).
 * An existing entry for the same block is touched (and gets the recurrent
 * state if it had none and one is given). Returns the entry, or NULL when
 * it is not kept (larger than the budget, no room, out of memory, fill
 * failed). */
typedef int (*kv_pc_fill_fn)(void *arg, void *kv, void *rec);
kv_pc_entry *kv_pcache_insert(kv_pcache *c, kv_pc_entry *parent, uint32_t depth, const int32_t *tokens,
                              bool with_rec, kv_pc_fill_fn fill, void *arg);

const void *kv_pc_entry_kv(const kv_pc_entry *e);
const void *kv_pc_entry_rec(const kv_pc_entry *e);  /* NULL: none */

typedef struct kv_pcache_stats {
    uint32_t block_tokens;
    uint64_t budget_bytes;
    uint64_t bytes;       /* held now */
    uint32_t entries;     /* blocks held now */
    uint64_t inserts;     /* blocks stored */
    uint64_t evictions;   /* blocks evicted for room */
    uint64_t states_dropped; /* recurrent states dropped for room (their blocks kept as links) */
} kv_pcache_stats;
void kv_pcache_get_stats(const kv_pcache *c, kv_pcache_stats *out);
#endif
