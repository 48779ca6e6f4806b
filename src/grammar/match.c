/* The matcher: a pushdown automaton over code points whose configurations
 * are interned.
 *
 * A stack frame is a node {pos, parent}: pos indexes kv_grammar.el (the
 * next element to match in this frame), parent is the frame to return to.
 * Nodes are hash-consed, so two equal stacks are one node id and a set of
 * stacks is a sorted list of distinct ids; node 0 is the empty stack (the
 * text so far is complete). Every stack in a set is normalized: its top
 * element is a character set, or it is node 0. Sets are interned as states,
 * and a state's transitions (per code point) and token mask (per
 * vocabulary) are cached, so a state met again costs a lookup.
 *
 * Normalizing expands rule references. A reference that ends its
 * alternative pushes no return frame (a tail call: x* written as R ::= x R
 * stays one frame deep). The parser refused left recursion, so expansion
 * ends; it is still bounded (steps, stacks, depth) so that an ambiguous
 * grammar is a clear KV_ERANGE. A stack deeper than max_stack_depth is
 * dropped: the grammar cannot nest further, and when that leaves nothing,
 * the error says so.
 *
 * Memory: every table is counted in mem; past half of max_memory_bytes,
 * the next call rebuilds the tables from the current state alone (a flush),
 * and a single call that would pass the whole budget is KV_ERANGE. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_internal.h"

#define NIL 0u
#define ST_DEAD (-1)
#define ST_ERR (-2)
#define ST_UNKNOWN (-3)
#define ST_DEEP (-4) /* dead because every continuation nests past max_stack_depth */
/* A state's ASCII table: 128 transitions, then the bytes that lead back to
 * the state itself (two 64-bit words), then whether those are known. */
#define ASCII_SLOTS 133
#define LOOP_BITS 128
#define LOOP_DONE 132

struct kv_grammar_matcher {
    const kv_grammar *g;
    /* nodes */
    uint32_t *n_pos, *n_par, *n_depth; /* [cap_nodes] */
    uint32_t n_nodes, cap_nodes;
    uint32_t *node_hash;               /* [node_hash_cap] node id + 1, 0 empty */
    uint32_t node_hash_cap;
    /* states */
    uint32_t *st_off, *st_len;         /* [cap_states] the state's node ids: pool[off .. off+len) */
    int32_t **st_ascii;                /* [cap_states] NULL or [128] cached transitions */
    uint32_t **st_mask;                /* [cap_states] NULL or the cached mask (mask_vocab) */
    uint32_t n_states, cap_states;
    uint32_t *pool;
    size_t n_pool, cap_pool;
    uint32_t *st_hash;                 /* [st_hash_cap] state id + 1 */
    uint32_t st_hash_cap;
    /* non-ASCII transitions: key state << 21 | cp, value state or ST_DEAD */
    uint64_t *tr_key;                  /* [tr_cap] UINT64_MAX empty */
    int32_t *tr_val;
    uint32_t tr_cap, tr_n;
    /* where the text is */
    uint32_t cur;                      /* current state */
    uint32_t pend_acc;                 /* bits of a code point split across feeds */
    uint8_t pend_need, pend_len;       /* continuation bytes still due, bytes seen */
    /* scratch */
    uint32_t *work, *outl;
    size_t cap_work, cap_out;
    struct mframe *frames;
    size_t cap_frames;
    const kv_grammar_vocab *mask_vocab;/* the vocabulary whose masks st_mask holds */
    uint32_t *apply_buf;               /* kv_grammar_apply's mask, apply_words words */
    size_t apply_words;
    size_t mask_words;
    size_t mem;                        /* bytes of the tables above */
    bool depth_dropped;                /* the transition being computed dropped a too-deep stack */
    kv_diag *d;                        /* the caller's, during a call */
    kv_grammar_stats stats;
};

typedef struct mframe {
    uint32_t node;  /* trie node */
    uint32_t next;  /* the next child to visit (a node id) */
    uint32_t left;  /* children not yet visited */
    uint32_t state;
    uint32_t acc;   /* code point bits so far */
    uint8_t need, len;
} mframe;

static int oom(kv_grammar_matcher *m) { return kv_fail(m->d, KV_ENOMEM, "grammar matcher: out of memory"); }

/* Grows *v (elem bytes each) to hold need, counting the bytes in m->mem. */
static int mgrow(kv_grammar_matcher *m, void **v, size_t elem, size_t need, size_t *cap) {
    if (need <= *cap) return 0;
    size_t nc = *cap ? *cap * 2 : 64;
    while (nc < need) nc *= 2;
    if (m->mem + (nc - *cap) * elem > m->g->lim.max_memory_bytes)
        return kv_fail(m->d, KV_ERANGE, "grammar matcher: tables over %zu bytes (max_memory_bytes)",
                       m->g->lim.max_memory_bytes);
    void *nv = realloc(*v, nc * elem);
    if (!nv) return oom(m);
    m->mem += (nc - *cap) * elem;
    *v = nv;
    *cap = nc;
    return 0;
}

static inline uint32_t mix32(uint32_t a, uint32_t b) {
    uint64_t x = ((uint64_t)a << 32 | b) * 0x9E3779B97F4A7C15ull;
    return (uint32_t)(x >> 32) ^ (uint32_t)x;
}

static int node_rehash(kv_grammar_matcher *m, uint32_t nc) {
    size_t bytes = (size_t)nc * sizeof(uint32_t);
    if (m->mem + bytes > m->g->lim.max_memory_bytes)
        return kv_fail(m->d, KV_ERANGE, "grammar matcher: tables over %zu bytes (max_memory_bytes)",
                       m->g->lim.max_memory_bytes);
    uint32_t *h = calloc(nc, sizeof *h);
    if (!h) return oom(m);
    for (uint32_t id = 1; id < m->n_nodes; id++) {
        uint32_t k = mix32(m->n_pos[id], m->n_par[id]) & (nc - 1);
        while (h[k]) k = (k + 1) & (nc - 1);
        h[k] = id + 1;
    }
    m->mem -= (size_t)m->node_hash_cap * sizeof(uint32_t);
    m->mem += bytes;
    free(m->node_hash);
    m->node_hash = h;
    m->node_hash_cap = nc;
    return 0;
}

/* The node {pos, par}: *out its id, or UINT32_MAX when it would be deeper
 * than max_stack_depth (then m->depth_dropped is set). */
static int node_intern(kv_grammar_matcher *m, uint32_t pos, uint32_t par, uint32_t *out) {
    uint32_t depth = m->n_depth[par] + 1;
    if (depth > m->g->lim.max_stack_depth) {
        m->depth_dropped = true;
        *out = UINT32_MAX;
        return 0;
    }
    uint32_t k = mix32(pos, par) & (m->node_hash_cap - 1);
    while (m->node_hash[k]) {
        uint32_t id = m->node_hash[k] - 1;
        if (m->n_pos[id] == pos && m->n_par[id] == par) {
            *out = id;
            return 0;
        }
        k = (k + 1) & (m->node_hash_cap - 1);
    }
    if ((size_t)(m->n_nodes + 1) * 2 > m->node_hash_cap) {
        int rc = node_rehash(m, m->node_hash_cap * 2);
        if (rc) return rc;
        k = mix32(pos, par) & (m->node_hash_cap - 1);
        while (m->node_hash[k]) k = (k + 1) & (m->node_hash_cap - 1);
    }
    size_t c1 = m->cap_nodes, c2 = m->cap_nodes, c3 = m->cap_nodes;
    int rc = mgrow(m, (void **)&m->n_pos, sizeof(uint32_t), m->n_nodes + 1, &c1);
    if (!rc) rc = mgrow(m, (void **)&m->n_par, sizeof(uint32_t), m->n_nodes + 1, &c2);
    if (!rc) rc = mgrow(m, (void **)&m->n_depth, sizeof(uint32_t), m->n_nodes + 1, &c3);
    if (rc) return rc;
    m->cap_nodes = (uint32_t)c1;
    uint32_t id = m->n_nodes++;
    m->n_pos[id] = pos;
    m->n_par[id] = par;
    m->n_depth[id] = depth;
    m->node_hash[k] = id + 1;
    *out = id;
    return 0;
}

static uint32_t list_hash(const uint32_t *v, size_t n) {
    uint32_t h = 0x811C9DC5u ^ (uint32_t)n;
    for (size_t i = 0; i < n; i++) h = mix32(h, v[i]);
    return h;
}

static int state_rehash(kv_grammar_matcher *m, uint32_t nc) {
    size_t bytes = (size_t)nc * sizeof(uint32_t);
    if (m->mem + bytes > m->g->lim.max_memory_bytes)
        return kv_fail(m->d, KV_ERANGE, "grammar matcher: tables over %zu bytes (max_memory_bytes)",
                       m->g->lim.max_memory_bytes);
    uint32_t *h = calloc(nc, sizeof *h);
    if (!h) return oom(m);
    for (uint32_t s = 0; s < m->n_states; s++) {
        uint32_t k = list_hash(m->pool + m->st_off[s], m->st_len[s]) & (nc - 1);
        while (h[k]) k = (k + 1) & (nc - 1);
        h[k] = s + 1;
    }
    m->mem -= (size_t)m->st_hash_cap * sizeof(uint32_t);
    m->mem += bytes;
    free(m->st_hash);
    m->st_hash = h;
    m->st_hash_cap = nc;
    return 0;
}

/* The state of the sorted distinct node ids v[0..n). */
static int state_intern(kv_grammar_matcher *m, const uint32_t *v, size_t n, uint32_t *out) {
    uint32_t h = list_hash(v, n);
    uint32_t k = h & (m->st_hash_cap - 1);
    while (m->st_hash[k]) {
        uint32_t s = m->st_hash[k] - 1;
        if (m->st_len[s] == n && !memcmp(m->pool + m->st_off[s], v, n * sizeof *v)) {
            *out = s;
            return 0;
        }
        k = (k + 1) & (m->st_hash_cap - 1);
    }
    if ((size_t)(m->n_states + 1) * 2 > m->st_hash_cap) {
        int rc = state_rehash(m, m->st_hash_cap * 2);
        if (rc) return rc;
        k = h & (m->st_hash_cap - 1);
        while (m->st_hash[k]) k = (k + 1) & (m->st_hash_cap - 1);
    }
    size_t c1 = m->cap_states, c2 = c1, c3 = c1, c4 = c1;
    int rc = mgrow(m, (void **)&m->st_off, sizeof(uint32_t), m->n_states + 1, &c1);
    if (!rc) rc = mgrow(m, (void **)&m->st_len, sizeof(uint32_t), m->n_states + 1, &c2);
    if (!rc) rc = mgrow(m, (void **)&m->st_ascii, sizeof(int32_t *), m->n_states + 1, &c3);
    if (!rc) rc = mgrow(m, (void **)&m->st_mask, sizeof(uint32_t *), m->n_states + 1, &c4);
    if (!rc) rc = mgrow(m, (void **)&m->pool, sizeof(uint32_t), m->n_pool + n, &m->cap_pool);
    if (rc) return rc;
    m->cap_states = (uint32_t)c1;
    uint32_t s = m->n_states++;
    m->st_off[s] = (uint32_t)m->n_pool;
    m->st_len[s] = (uint32_t)n;
    m->st_ascii[s] = NULL;
    m->st_mask[s] = NULL;
    memcpy(m->pool + m->n_pool, v, n * sizeof *v);
    m->n_pool += n;
    m->st_hash[k] = s + 1;
    *out = s;
    return 0;
}

static int push_u32(kv_grammar_matcher *m, uint32_t **v, size_t *n, size_t *cap, uint32_t x) {
    if (*n == *cap) {
        int rc = mgrow(m, (void **)v, sizeof(uint32_t), *n + 1, cap);
        if (rc) return rc;
    }
    (*v)[(*n)++] = x;
    return 0;
}

/* Expands node x until every stack's top is a character set (or NIL),
 * appending the tops to m->outl[*n_out..]. */
static int normalize(kv_grammar_matcher *m, uint32_t x, size_t *n_out) {
    const kv_grammar *g = m->g;
    size_t nw = 0;
    int rc = push_u32(m, &m->work, &nw, &m->cap_work, x);
    uint64_t steps = 0, max_steps = (uint64_t)g->lim.max_stacks * 64 + 4096;
    while (!rc && nw) {
        uint32_t n = m->work[--nw];
        if (++steps > max_steps)
            return kv_fail(m->d, KV_ERANGE,
                           "grammar: expanding a position took over %llu steps (an ambiguous grammar; max_stacks %u)",
                           (unsigned long long)max_steps, g->lim.max_stacks);
        if (n == NIL) {
            rc = push_u32(m, &m->outl, n_out, &m->cap_out, NIL);
            continue;
        }
        uint32_t e = g->el[m->n_pos[n]];
        if (GEL_KIND(e) == GEL_END) {
            rc = push_u32(m, &m->work, &nw, &m->cap_work, m->n_par[n]);
        } else if (GEL_KIND(e) == GEL_SET) {
            rc = push_u32(m, &m->outl, n_out, &m->cap_out, n);
        } else {
            uint32_t r = GEL_ARG(e), nxt = m->n_pos[n] + 1, ret;
            if (GEL_KIND(g->el[nxt]) == GEL_END) ret = m->n_par[n]; /* tail call */
            else if ((rc = node_intern(m, nxt, m->n_par[n], &ret))) return rc;
            if (ret == UINT32_MAX) continue;
            for (uint32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1] && !rc; a++) {
                uint32_t c;
                if ((rc = node_intern(m, g->alt[a], ret, &c))) return rc;
                if (c != UINT32_MAX) rc = push_u32(m, &m->work, &nw, &m->cap_work, c);
            }
        }
    }
    return rc;
}

static int cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* Sorts m->outl[0..n), drops duplicates, interns: *out the state, or
 * ST_DEAD for an empty set. */
static int finish_state(kv_grammar_matcher *m, size_t n, int32_t *out) {
    if (n == 0) {
        *out = ST_DEAD;
        return 0;
    }
    qsort(m->outl, n, sizeof *m->outl, cmp_u32);
    size_t u = 1;
    for (size_t i = 1; i < n; i++)
        if (m->outl[i] != m->outl[u - 1]) m->outl[u++] = m->outl[i];
    if (u > m->g->lim.max_stacks)
        return kv_fail(m->d, KV_ERANGE, "grammar: %zu parse stacks at once, max %u (an ambiguous grammar; max_stacks)",
                       u, m->g->lim.max_stacks);
    uint32_t s;
    int rc = state_intern(m, m->outl, u, &s);
    if (!rc) *out = (int32_t)s;
    return rc;
}

/* The state after code point cp from state s, uncached. */
static int step_uncached(kv_grammar_matcher *m, uint32_t s, uint32_t cp, int32_t *out) {
    const kv_grammar *g = m->g;
    size_t n = 0;
    int rc = 0;
    m->depth_dropped = false;
    for (uint32_t i = 0; i < m->st_len[s] && !rc; i++) {
        uint32_t t = m->pool[m->st_off[s] + i];
        if (t == NIL) continue;
        uint32_t e = g->el[m->n_pos[t]];
        if (!kv_gset_match(g, GEL_ARG(e), cp)) continue;
        uint32_t x;
        if ((rc = node_intern(m, m->n_pos[t] + 1, m->n_par[t], &x))) break;
        if (x != UINT32_MAX) rc = normalize(m, x, &n);
    }
    if (!rc) rc = finish_state(m, n, out);
    if (!rc && *out == ST_DEAD && m->depth_dropped) *out = ST_DEEP;
    return rc;
}

static int tr_grow(kv_grammar_matcher *m) {
    uint32_t nc = m->tr_cap ? m->tr_cap * 2 : 256;
    size_t bytes = (size_t)nc * (sizeof(uint64_t) + sizeof(int32_t));
    if (m->mem + bytes > m->g->lim.max_memory_bytes)
        return kv_fail(m->d, KV_ERANGE, "grammar matcher: tables over %zu bytes (max_memory_bytes)",
                       m->g->lim.max_memory_bytes);
    uint64_t *k = malloc((size_t)nc * sizeof *k);
    int32_t *v = malloc((size_t)nc * sizeof *v);
    if (!k || !v) {
        free(k);
        free(v);
        return oom(m);
    }
    memset(k, 0xff, (size_t)nc * sizeof *k);
    for (uint32_t i = 0; i < m->tr_cap; i++) {
        if (m->tr_key[i] == UINT64_MAX) continue;
        uint32_t h = mix32((uint32_t)(m->tr_key[i] >> 21), (uint32_t)m->tr_key[i]) & (nc - 1);
        while (k[h] != UINT64_MAX) h = (h + 1) & (nc - 1);
        k[h] = m->tr_key[i];
        v[h] = m->tr_val[i];
    }
    m->mem -= (size_t)m->tr_cap * (sizeof(uint64_t) + sizeof(int32_t));
    m->mem += bytes;
    free(m->tr_key);
    free(m->tr_val);
    m->tr_key = k;
    m->tr_val = v;
    m->tr_cap = nc;
    return 0;
}

/* The state after cp from s (cached): >= 0, ST_DEAD, or ST_ERR (m->d set). */
static int32_t step(kv_grammar_matcher *m, uint32_t s, uint32_t cp) {
    int32_t r;
    if (cp < 128) {
        int32_t *t = m->st_ascii[s];
        if (t && t[cp] != ST_UNKNOWN) return t[cp];
        if (!t) {
            if (m->mem + ASCII_SLOTS * sizeof(int32_t) > m->g->lim.max_memory_bytes) {
                kv_fail(m->d, KV_ERANGE, "grammar matcher: tables over %zu bytes (max_memory_bytes)",
                        m->g->lim.max_memory_bytes);
                return ST_ERR;
            }
            t = malloc(ASCII_SLOTS * sizeof *t);
            if (!t) {
                oom(m);
                return ST_ERR;
            }
            for (int i = 0; i < 128; i++) t[i] = ST_UNKNOWN;
            t[LOOP_DONE] = 0;
            m->st_ascii[s] = t;
            m->mem += ASCII_SLOTS * sizeof *t;
        }
        if (step_uncached(m, s, cp, &r)) return ST_ERR;
        m->st_ascii[s][cp] = r; /* st_ascii may have moved: state_intern grows it */
        return r;
    }
    uint64_t key = (uint64_t)s << 21 | cp;
    if (m->tr_cap) {
        uint32_t h = mix32(s, cp) & (m->tr_cap - 1);
        while (m->tr_key[h] != UINT64_MAX) {
            if (m->tr_key[h] == key) return m->tr_val[h];
            h = (h + 1) & (m->tr_cap - 1);
        }
    }
    if (step_uncached(m, s, cp, &r)) return ST_ERR;
    if ((size_t)(m->tr_n + 1) * 2 > m->tr_cap && tr_grow(m)) return ST_ERR;
    uint32_t h = mix32(s, cp) & (m->tr_cap - 1);
    while (m->tr_key[h] != UINT64_MAX) h = (h + 1) & (m->tr_cap - 1);
    m->tr_key[h] = key;
    m->tr_val[h] = r;
    m->tr_n++;
    return r;
}

/* True when some stack of s can take a code point in [lo, hi]. */
static bool state_can_take(const kv_grammar_matcher *m, uint32_t s, uint32_t lo, uint32_t hi) {
    for (uint32_t i = 0; i < m->st_len[s]; i++) {
        uint32_t t = m->pool[m->st_off[s] + i];
        if (t != NIL && kv_gset_overlaps(m->g, GEL_ARG(m->g->el[m->n_pos[t]]), lo, hi)) return true;
    }
    return false;
}

static const uint32_t k_utf8_min[5] = {0, 0, 0x80, 0x800, 0x10000};

/* True when some stack of s can take a code point that starts with the
 * len bytes seen (bits acc) and has need bytes to come: overlong forms,
 * surrogates and values past U+10FFFF excluded, so a prefix the grammar
 * admits always has a valid completion. */
static bool partial_ok(const kv_grammar_matcher *m, uint32_t s, uint32_t acc, uint8_t need, uint8_t len) {
    uint32_t sh = 6u * need, lo = acc << sh, hi = lo | ((1u << sh) - 1);
    uint32_t min = k_utf8_min[len + need];
    if (lo < min) lo = min;
    if (hi > 0x10FFFF) hi = 0x10FFFF;
    if (lo > hi) return false;
    if (lo < 0xD800 && state_can_take(m, s, lo, hi < 0xD7FF ? hi : 0xD7FF)) return true;
    if (hi > 0xDFFF && state_can_take(m, s, lo > 0xE000 ? lo : 0xE000, hi)) return true;
    return false;
}

static bool state_can_end(const kv_grammar_matcher *m, uint32_t s) {
    return m->st_len[s] && m->pool[m->st_off[s]] == NIL;
}

static void free_tables(kv_grammar_matcher *m) {
    for (uint32_t s = 0; s < m->n_states; s++) {
        free(m->st_ascii[s]);
        free(m->st_mask[s]);
    }
    free(m->n_pos);
    free(m->n_par);
    free(m->n_depth);
    free(m->node_hash);
    free(m->st_off);
    free(m->st_len);
    free(m->st_ascii);
    free(m->st_mask);
    free(m->pool);
    free(m->st_hash);
    free(m->tr_key);
    free(m->tr_val);
    free(m->work);
    free(m->outl);
    free(m->frames);
    m->n_pos = m->n_par = m->n_depth = m->node_hash = NULL;
    m->st_off = m->st_len = m->pool = m->st_hash = NULL;
    m->st_ascii = NULL;
    m->st_mask = NULL;
    m->tr_key = NULL;
    m->tr_val = NULL;
    m->work = m->outl = NULL;
    m->frames = NULL;
    m->n_nodes = m->cap_nodes = m->node_hash_cap = 0;
    m->n_states = m->cap_states = m->st_hash_cap = 0;
    m->n_pool = m->cap_pool = 0;
    m->tr_cap = m->tr_n = 0;
    m->cap_work = m->cap_out = m->cap_frames = 0;
    m->mem = 0;
}

/* Empty tables holding only NIL. */
static int init_tables(kv_grammar_matcher *m) {
    size_t c = 0;
    int rc = mgrow(m, (void **)&m->n_pos, sizeof(uint32_t), 1024, &c);
    c = 0;
    if (!rc) rc = mgrow(m, (void **)&m->n_par, sizeof(uint32_t), 1024, &c);
    c = 0;
    if (!rc) rc = mgrow(m, (void **)&m->n_depth, sizeof(uint32_t), 1024, &c);
    if (rc) return rc;
    m->cap_nodes = 1024;
    m->n_pos[NIL] = UINT32_MAX;
    m->n_par[NIL] = NIL;
    m->n_depth[NIL] = 0;
    m->n_nodes = 1;
    if ((rc = node_rehash(m, 2048))) return rc;
    if ((rc = state_rehash(m, 256))) return rc;
    return 0;
}

/* Rebuilds the tables holding only the current state (its stacks walked
 * down to NIL and interned again). */
static int flush(kv_grammar_matcher *m) {
    uint32_t *chains = NULL;
    size_t n = 0, cap = 0;
    int rc = 0;
    for (uint32_t i = 0; i < m->st_len[m->cur] && !rc; i++) {
        uint32_t t = m->pool[m->st_off[m->cur] + i];
        for (uint32_t x = t; x != NIL && !rc; x = m->n_par[x]) {
            if (n == cap) {
                cap = cap ? cap * 2 : 256;
                uint32_t *nc = realloc(chains, cap * sizeof *nc);
                if (!nc) rc = oom(m);
                else chains = nc;
            }
            if (!rc) chains[n++] = m->n_pos[x];
        }
        if (!rc && n == cap) {
            cap = cap ? cap * 2 : 256;
            uint32_t *nc = realloc(chains, cap * sizeof *nc);
            if (!nc) rc = oom(m);
            else chains = nc;
        }
        if (!rc) chains[n++] = UINT32_MAX; /* end of one stack (top first) */
    }
    const kv_grammar_vocab *mv = m->mask_vocab;
    size_t mw = m->mask_words;
    free_tables(m);
    if (!rc) rc = init_tables(m);
    size_t n_out = 0;
    for (size_t i = 0; i < n && !rc;) {
        size_t end = i;
        while (chains[end] != UINT32_MAX) end++;
        uint32_t x = NIL;
        for (size_t k = end; k > i && !rc; k--) rc = node_intern(m, chains[k - 1], x, &x);
        if (!rc) rc = push_u32(m, &m->outl, &n_out, &m->cap_out, x);
        i = end + 1;
    }
    int32_t s = ST_DEAD;
    if (!rc) rc = finish_state(m, n_out, &s);
    if (!rc && s < 0) rc = kv_fail(m->d, KV_EINTERNAL, "grammar matcher: empty state after a flush");
    if (!rc) m->cur = (uint32_t)s;
    m->mask_vocab = mv;
    m->mask_words = mw;
    free(chains);
    return rc;
}

static int maybe_flush(kv_grammar_matcher *m) {
    if (m->mem <= m->g->lim.max_memory_bytes / 2) return 0;
    m->stats.flushes++;
    return flush(m);
}

int kv_grammar_matcher_new(kv_grammar_matcher **out, const kv_grammar *g, kv_diag *d) {
    *out = NULL;
    kv_grammar_matcher *m = calloc(1, sizeof *m);
    if (!m) return kv_fail(d, KV_ENOMEM, "grammar matcher: out of memory");
    m->g = g;
    m->d = d;
    int rc = init_tables(m);
    size_t n = 0;
    for (uint32_t a = g->rule_alt[g->root]; a < g->rule_alt[g->root + 1] && !rc; a++) {
        uint32_t x;
        if ((rc = node_intern(m, g->alt[a], NIL, &x))) break;
        if (x != UINT32_MAX) rc = normalize(m, x, &n);
    }
    int32_t s = ST_DEAD;
    if (!rc) rc = finish_state(m, n, &s);
    if (!rc && s < 0) rc = kv_fail(d, KV_ERANGE, "grammar: the start rule cannot begin within max_stack_depth %u",
                                   g->lim.max_stack_depth);
    if (rc) {
        kv_grammar_matcher_free(m);
        return rc;
    }
    m->cur = (uint32_t)s;
    m->d = NULL;
    *out = m;
    return 0;
}

void kv_grammar_matcher_free(kv_grammar_matcher *m) {
    if (!m) return;
    free_tables(m);
    free(m->apply_buf);
    free(m);
}

bool kv_grammar_can_end(const kv_grammar_matcher *m) {
    return m->pend_need == 0 && state_can_end(m, m->cur);
}

/* Feeds bytes from (*s, pending) forward; KV_EINVAL at a byte the grammar
 * refuses. */
static int feed_bytes(kv_grammar_matcher *m, const uint8_t *b, size_t n, uint32_t *s, uint32_t *acc, uint8_t *need,
                      uint8_t *len) {
    int32_t r = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t c = b[i];
        if (*need == 0) {
            if (c < 0x80) {
                r = step(m, *s, c);
                if (r == ST_ERR) return m->d ? m->d->code : KV_ERANGE;
                if (r < 0) goto refuse;
                *s = (uint32_t)r;
                continue;
            }
            if (c >= 0xC2 && c <= 0xDF) *acc = c & 0x1F, *need = 1;
            else if (c >= 0xE0 && c <= 0xEF) *acc = c & 0x0F, *need = 2;
            else if (c >= 0xF0 && c <= 0xF4) *acc = c & 0x07, *need = 3;
            else goto refuse;
            *len = 1;
        } else {
            if ((c & 0xC0) != 0x80) goto refuse;
            *acc = (*acc << 6) | (c & 0x3F);
            (*need)--;
            (*len)++;
            if (*need == 0) {
                if (*acc < k_utf8_min[*len] || *acc > 0x10FFFF || (*acc >= 0xD800 && *acc <= 0xDFFF)) goto refuse;
                r = step(m, *s, *acc);
                if (r == ST_ERR) return m->d ? m->d->code : KV_ERANGE;
                if (r < 0) goto refuse;
                *s = (uint32_t)r;
                *acc = 0;
                continue;
            }
        }
        if (!partial_ok(m, *s, *acc, *need, *len)) goto refuse;
    }
    return 0;
refuse:
    if (r == ST_DEEP)
        return kv_fail(m->d, KV_ERANGE, "grammar: text nests deeper than max_stack_depth %u", m->g->lim.max_stack_depth);
    return kv_fail(m->d, KV_EINVAL, "grammar: the text does not continue the grammar");
}

int kv_grammar_feed(kv_grammar_matcher *m, const char *bytes, size_t n, kv_diag *d) {
    m->d = d;
    int rc = maybe_flush(m);
    uint32_t s = m->cur, acc = m->pend_acc;
    uint8_t need = m->pend_need, len = m->pend_len;
    if (!rc) rc = feed_bytes(m, (const uint8_t *)bytes, n, &s, &acc, &need, &len);
    if (!rc) {
        m->cur = s;
        m->pend_acc = acc;
        m->pend_need = need;
        m->pend_len = len;
    }
    m->d = NULL;
    return rc;
}

/* The ASCII bytes (but DEL) after which state s is s again, in loop[2]:
 * ST_ERR on an error. Computed once per state. */
static int self_loops(kv_grammar_matcher *m, uint32_t s, uint64_t loop[2]) {
    if (step(m, s, 0) == ST_ERR) return ST_ERR; /* makes the table */
    int32_t *t = m->st_ascii[s];
    if (!t[LOOP_DONE]) {
        uint64_t l[2] = {0, 0};
        for (uint32_t b = 0; b < 127; b++) {
            int32_t r = step(m, s, b);
            if (r == ST_ERR) return ST_ERR;
            if (r == (int32_t)s) l[b >> 6] |= 1ull << (b & 63);
        }
        t = m->st_ascii[s];
        memcpy(t + LOOP_BITS, l, sizeof l);
        t[LOOP_DONE] = 1;
    }
    memcpy(loop, t + LOOP_BITS, 2 * sizeof *loop);
    return 0;
}

/* Uncached mask of the current state (with its pending bytes) into mask. */
static int mask_walk(kv_grammar_matcher *m, const kv_grammar_vocab *v, uint32_t *mask) {
    size_t need_frames = (size_t)v->max_len + 2;
    if (m->cap_frames < need_frames) {
        size_t c = m->cap_frames;
        int rc = mgrow(m, (void **)&m->frames, sizeof(mframe), need_frames, &c);
        if (rc) return rc;
        m->cap_frames = c;
    }
    mframe *f = m->frames;
    size_t top = 0;
    f[0] = (mframe){.node = 0, .next = 1, .left = v->child_n[0], .state = m->cur, .acc = m->pend_acc,
                    .need = m->pend_need, .len = m->pend_len};
    uint64_t visited = 0;
    for (;;) {
        mframe *F = &f[top];
        if (F->left == 0) {
            if (top == 0) break;
            top--;
            continue;
        }
        uint32_t c = F->next;
        F->next += v->size[c];
        F->left--;
        uint8_t b = v->byte[c];
        uint32_t s = F->state, acc = F->acc;
        uint8_t need = F->need, len = F->len;
        visited++;
        if (need == 0) {
            if (b < 0x80) {
                int32_t r = step(m, s, b);
                if (r == ST_ERR) return m->d ? m->d->code : KV_ERANGE;
                if (r < 0) continue;
                s = (uint32_t)r;
            } else {
                if (b >= 0xC2 && b <= 0xDF) acc = b & 0x1F, need = 1;
                else if (b >= 0xE0 && b <= 0xEF) acc = b & 0x0F, need = 2;
                else if (b >= 0xF0 && b <= 0xF4) acc = b & 0x07, need = 3;
                else continue;
                len = 1;
            }
        } else {
            if ((b & 0xC0) != 0x80) continue;
            acc = (acc << 6) | (b & 0x3F);
            need--;
            len++;
            if (need == 0) {
                if (acc < k_utf8_min[len] || acc > 0x10FFFF || (acc >= 0xD800 && acc <= 0xDFFF)) continue;
                int32_t r = step(m, s, acc);
                if (r == ST_ERR) return m->d ? m->d->code : KV_ERANGE;
                if (r < 0) continue;
                s = (uint32_t)r;
                acc = 0;
            }
        }
        if (need && !partial_ok(m, s, acc, need, len)) continue;
        if (v->size[c] > 8 && need == 0 && F->need == 0 && s == F->state) {
            /* a byte that left the state as it was (a string's character):
             * when every byte below does too, the whole subtree is allowed */
            uint64_t loop[2];
            if (self_loops(m, s, loop) == ST_ERR) return m->d ? m->d->code : KV_ERANGE;
            if (!(v->sub_ascii[c][0] & ~loop[0]) && !(v->sub_ascii[c][1] & ~loop[1])) {
                for (uint32_t k = v->tok_first[c]; k < v->tok_first[c + v->size[c]]; k++) {
                    int32_t id = v->tok_ids[k];
                    mask[id >> 5] |= 1u << (id & 31);
                }
                continue;
            }
        }
        for (uint32_t k = 0; k < v->tok_n[c]; k++) {
            int32_t id = v->tok_ids[v->tok_first[c] + k];
            mask[id >> 5] |= 1u << (id & 31);
        }
        if (v->child_n[c]) {
            KV_ASSERT(top + 1 < m->cap_frames);
            f = m->frames;
            f[++top] = (mframe){.node = c, .next = c + 1, .left = v->child_n[c], .state = s, .acc = acc, .need = need,
                                .len = len};
        }
    }
    m->stats.trie_nodes += visited;
    return 0;
}

int kv_grammar_mask(kv_grammar_matcher *m, const kv_grammar_vocab *v, uint32_t *mask, kv_diag *d) {
    size_t words = ((size_t)v->n_vocab + 31) / 32;
    memset(mask, 0, words * sizeof *mask);
    m->d = d;
    m->stats.masks++;
    int rc = maybe_flush(m);
    if (!rc && m->mask_vocab != v) {
        for (uint32_t s = 0; s < m->n_states; s++) {
            if (m->st_mask[s]) m->mem -= m->mask_words * sizeof(uint32_t);
            free(m->st_mask[s]);
            m->st_mask[s] = NULL;
        }
        m->mask_vocab = v;
        m->mask_words = words;
    }
    bool cacheable = m->pend_need == 0;
    if (!rc && cacheable && m->st_mask[m->cur]) {
        memcpy(mask, m->st_mask[m->cur], words * sizeof *mask);
        m->stats.mask_hits++;
        m->d = NULL;
        return 0;
    }
    uint32_t cur = m->cur;
    if (!rc) rc = mask_walk(m, v, mask);
    if (!rc && kv_grammar_can_end(m))
        for (int32_t k = 0; k < v->n_eog; k++) mask[v->eog_ids[k] >> 5] |= 1u << (v->eog_ids[k] & 31);
    if (!rc && cacheable && m->mem + words * sizeof *mask <= m->g->lim.max_memory_bytes) {
        uint32_t *c = malloc(words * sizeof *c);
        if (c) {
            memcpy(c, mask, words * sizeof *c);
            m->st_mask[cur] = c;
            m->mem += words * sizeof *c;
        }
    }
    if (rc) memset(mask, 0, words * sizeof *mask);
    m->d = NULL;
    return rc;
}

int kv_grammar_apply(kv_grammar_matcher *m, const kv_grammar_vocab *v, float *logits, kv_diag *d) {
    size_t words = ((size_t)v->n_vocab + 31) / 32;
    if (m->apply_words < words) {
        uint32_t *b = realloc(m->apply_buf, words * sizeof *b);
        if (!b) return kv_fail(d, KV_ENOMEM, "grammar: out of memory");
        m->apply_buf = b;
        m->apply_words = words;
    }
    uint32_t *mask = m->apply_buf;
    int rc = kv_grammar_mask(m, v, mask, d);
    for (int32_t i = 0; i < v->n_vocab; i++)
        if (!(mask[i >> 5] >> (i & 31) & 1)) logits[i] = -INFINITY;
    return rc;
}

int kv_grammar_accept(kv_grammar_matcher *m, const kv_grammar_vocab *v, int32_t id, kv_diag *d) {
    if (id < 0 || id >= v->n_vocab) return kv_fail(d, KV_EINVAL, "grammar: token %d out of range", id);
    if (v->eog[id]) {
        if (!kv_grammar_can_end(m)) return kv_fail(d, KV_EINVAL, "grammar: end of generation before the grammar is complete");
        return 0;
    }
    uint32_t len = v->off[id + 1] - v->off[id];
    if (len == 0) return kv_fail(d, KV_EINVAL, "grammar: token %d has no text", id);
    return kv_grammar_feed(m, (const char *)v->bytes + v->off[id], len, d);
}

void kv_grammar_get_stats(const kv_grammar_matcher *m, kv_grammar_stats *s) {
    *s = m->stats;
    s->states = m->n_states;
    s->memory_bytes = m->mem;
}
