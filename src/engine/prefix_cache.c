/* The engine's prompt cache (prefix_cache.h): a hash table of blocks keyed
 * by their hash chain, each checked exactly against its parent and tokens,
 * on one LRU list; eviction takes the least recently used leaf.
 *
 * Invariants: bytes is the sum of the entries' sizes and never exceeds
 * budget after an insert returns; n_child counts the entries whose parent
 * is this one, so an entry with n_child == 0 is a leaf and may go; an
 * entry's parent outlives it. While room is made, a block being inserted
 * is not on the list yet, and one being given its state is held as if it
 * had a child (and has no state to drop), so neither can go. */
#include "engine/prefix_cache.h"

#include <stdlib.h>
#include <string.h>

struct kv_pc_entry {
    uint64_t key;               /* hash chain through this block */
    kv_pc_entry *parent;        /* block depth-1's entry, NULL for depth 0 */
    uint32_t depth;             /* block index in its prefix */
    uint32_t n_child;           /* entries whose parent this is */
    kv_pc_entry *hnext;         /* hash bucket chain */
    kv_pc_entry *older, *newer; /* the LRU list */
    uint64_t bytes;             /* counted against the budget */
    int32_t *tokens;            /* [block_tokens] */
    void *kv;                   /* [kv_bytes] */
    void *rec;                  /* [rec_bytes] or NULL */
};

struct kv_pcache {
    uint64_t budget, bytes;
    uint32_t block_tokens;
    uint64_t kv_bytes, rec_bytes;
    kv_pc_entry **bucket;       /* [n_bucket] */
    uint32_t n_bucket;          /* a power of two */
    kv_pc_entry *oldest, *newest;
    uint32_t entries;
    uint64_t inserts, evictions;
    uint64_t states_dropped;    /* recurrent states dropped from blocks kept as links */
};

/* splitmix64's finalizer: every input bit reaches every output bit */
static uint64_t kv_pc_mix(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* The chain: the key of a block from its parent's key (0 for the first). */
static uint64_t kv_pc_key(uint64_t parent_key, const int32_t *tok, uint32_t n) {
    uint64_t h = kv_pc_mix(parent_key ^ 0x9e3779b97f4a7c15ull);
    for (uint32_t i = 0; i < n; i++) h = kv_pc_mix(h ^ (uint32_t)tok[i]) + i;
    return h;
}

int kv_pcache_new(kv_pcache **out, uint64_t budget_bytes, uint32_t block_tokens, uint64_t kv_bytes,
                  uint64_t rec_bytes, kv_diag *d) {
    *out = NULL;
    if (!budget_bytes || !block_tokens || block_tokens > KV_PCACHE_MAX_BLOCK)
        return kv_fail(d, KV_EINVAL, "prompt cache: budget %llu bytes and block of %u tokens (1..%u) are not valid",
                       (unsigned long long)budget_bytes, block_tokens, KV_PCACHE_MAX_BLOCK);
    kv_pcache *c = calloc(1, sizeof *c);
    if (!c) return kv_fail(d, KV_ENOMEM, "prompt cache: out of memory");
    c->budget = budget_bytes;
    c->block_tokens = block_tokens;
    c->kv_bytes = kv_bytes;
    c->rec_bytes = rec_bytes;
    c->n_bucket = 1024;
    if (!(c->bucket = calloc(c->n_bucket, sizeof *c->bucket))) {
        free(c);
        return kv_fail(d, KV_ENOMEM, "prompt cache: out of memory");
    }
    *out = c;
    return 0;
}

static void kv_pc_entry_free(kv_pc_entry *e) {
    if (!e) return;
    free(e->tokens);
    free(e->kv);
    free(e->rec);
    free(e);
}

void kv_pcache_free(kv_pcache *c) {
    if (!c) return;
    for (kv_pc_entry *e = c->oldest, *n; e; e = n) {
        n = e->newer;
        kv_pc_entry_free(e);
    }
    free(c->bucket);
    free(c);
}

static void kv_pc_unlink(kv_pcache *c, kv_pc_entry *e) {
    if (e->older) e->older->newer = e->newer;
    else c->oldest = e->newer;
    if (e->newer) e->newer->older = e->older;
    else c->newest = e->older;
    e->older = e->newer = NULL;
}

static void kv_pc_push_newest(kv_pcache *c, kv_pc_entry *e) {
    e->older = c->newest;
    e->newer = NULL;
    if (c->newest) c->newest->newer = e;
    else c->oldest = e;
    c->newest = e;
}

/* The table doubles at a load of one entry per bucket (bounded: the budget
 * bounds the entries). On failure it stays as it was (chains still work). */
static void kv_pc_grow(kv_pcache *c) {
    if (c->entries < c->n_bucket || c->n_bucket >= (1u << 24)) return;
    const uint32_t nb = c->n_bucket * 2;
    kv_pc_entry **b = calloc(nb, sizeof *b);
    if (!b) return;
    for (uint32_t i = 0; i < c->n_bucket; i++)
        for (kv_pc_entry *e = c->bucket[i], *n; e; e = n) {
            n = e->hnext;
            e->hnext = b[e->key & (nb - 1)];
            b[e->key & (nb - 1)] = e;
        }
    free(c->bucket);
    c->bucket = b;
    c->n_bucket = nb;
}

static kv_pc_entry *kv_pc_find(const kv_pcache *c, uint64_t key, const kv_pc_entry *parent, uint32_t depth,
                               const int32_t *tok) {
    for (kv_pc_entry *e = c->bucket[key & (c->n_bucket - 1)]; e; e = e->hnext)
        if (e->key == key && e->parent == parent && e->depth == depth &&
            !memcmp(e->tokens, tok, (size_t)c->block_tokens * sizeof *tok))
            return e;
    return NULL;
}

uint32_t kv_pcache_match(kv_pcache *c, const int32_t *tokens, uint32_t n, uint32_t max_blocks, kv_pc_entry **path) {
    const uint32_t B = c->block_tokens;
    kv_pc_entry *parent = NULL;
    uint32_t i = 0;
    for (; i < max_blocks && (uint64_t)(i + 1) * B <= n; i++) {
        const int32_t *tok = tokens + (size_t)i * B;
        kv_pc_entry *e = kv_pc_find(c, kv_pc_key(parent ? parent->key : 0, tok, B), parent, i, tok);
        if (!e) break;
        path[i] = parent = e;
    }
    return i;
}

void kv_pcache_touch(kv_pcache *c, kv_pc_entry *const *path, uint32_t n) {
    for (uint32_t i = n; i-- > 0;) {
        kv_pc_unlink(c, path[i]);
        kv_pc_push_newest(c, path[i]);
    }
}

static void kv_pc_remove(kv_pcache *c, kv_pc_entry *e) {
    KV_ASSERT(e->n_child == 0);
    kv_pc_entry **pp = &c->bucket[e->key & (c->n_bucket - 1)];
    while (*pp != e) pp = &(*pp)->hnext;
    *pp = e->hnext;
    kv_pc_unlink(c, e);
    if (e->parent) e->parent->n_child--;
    c->bytes -= e->bytes;
    c->entries--;
    kv_pc_entry_free(e);
}

/* Evicts least recently used leaves until `need` more bytes fit; when no
 * leaf is left (one chain fills the budget: a long prompt of a recurrent
 * model), drops the recurrent states of its least recently used blocks
 * instead, which then serve as links only: the deepest state is the one a
 * later prompt can resume from. */
static bool kv_pc_make_room(kv_pcache *c, uint64_t need) {
    while (c->bytes + need > c->budget) {
        kv_pc_entry *e = c->oldest;
        while (e && e->n_child) e = e->newer;
        if (e) {
            kv_pc_remove(c, e);
            c->evictions++;
            continue;
        }
        for (e = c->oldest; e && !e->rec; e = e->newer) {}
        if (!e) return false;
        free(e->rec);
        e->rec = NULL;
        e->bytes -= c->rec_bytes;
        c->bytes -= c->rec_bytes;
        c->states_dropped++;
    }
    return true;
}

kv_pc_entry *kv_pcache_insert(kv_pcache *c, kv_pc_entry *parent, uint32_t depth, const int32_t *tokens,
                              bool with_rec, kv_pc_fill_fn fill, void *arg) {
    const uint32_t B = c->block_tokens;
    KV_ASSERT((parent == NULL) == (depth == 0) && (!parent || parent->depth + 1 == depth));
    const uint64_t key = kv_pc_key(parent ? parent->key : 0, tokens, B);
    kv_pc_entry *e = kv_pc_find(c, key, parent, depth, tokens);
    with_rec = with_rec && c->rec_bytes;
    if (e) {
        if (with_rec && !e->rec) { /* a link of the chain gets its state */
            if (parent) parent->n_child++; /* hold the chain while making room */
            e->n_child++;
            const bool room = kv_pc_make_room(c, c->rec_bytes);
            e->n_child--;
            if (parent) parent->n_child--;
            if (room && (e->rec = malloc(c->rec_bytes))) {
                if (fill(arg, NULL, e->rec)) {
                    free(e->rec);
                    e->rec = NULL;
                } else {
                    e->bytes += c->rec_bytes;
                    c->bytes += c->rec_bytes;
                }
            }
        }
        kv_pc_unlink(c, e);
        kv_pc_push_newest(c, e);
        return e;
    }
    const uint64_t bytes = sizeof *e + (uint64_t)B * sizeof *tokens + c->kv_bytes + (with_rec ? c->rec_bytes : 0);
    if (bytes > c->budget) return NULL;
    if (parent) parent->n_child++; /* its chain is not a leaf while room is made */
    if (!kv_pc_make_room(c, bytes) || !(e = calloc(1, sizeof *e)) ||
        !(e->tokens = malloc((size_t)B * sizeof *tokens)) || !(e->kv = malloc(c->kv_bytes ? c->kv_bytes : 1)) ||
        (with_rec && !(e->rec = malloc(c->rec_bytes))) || fill(arg, e->kv, e->rec)) {
        if (parent) parent->n_child--;
        kv_pc_entry_free(e);
        return NULL;
    }
    memcpy(e->tokens, tokens, (size_t)B * sizeof *tokens);
    e->key = key;
    e->parent = parent;
    e->depth = depth;
    e->bytes = bytes;
    e->hnext = c->bucket[key & (c->n_bucket - 1)];
    c->bucket[key & (c->n_bucket - 1)] = e;
    kv_pc_push_newest(c, e);
    c->bytes += bytes;
    c->entries++;
    c->inserts++;
    kv_pc_grow(c);
    return e;
}

const void *kv_pc_entry_kv(const kv_pc_entry *e) { return e->kv; }
const void *kv_pc_entry_rec(const kv_pc_entry *e) { return e->rec; }

void kv_pcache_get_stats(const kv_pcache *c, kv_pcache_stats *out) {
    *out = (kv_pcache_stats){.block_tokens = c->block_tokens, .budget_bytes = c->budget, .bytes = c->bytes,
                             .entries = c->entries, .inserts = c->inserts, .evictions = c->evictions,
                             .states_dropped = c->states_dropped};
}
