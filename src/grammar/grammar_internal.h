/* The compiled form of a grammar, shared by the GBNF parser (gbnf.c), the
 * matcher (match.c) and the vocabulary trie (vocab.c).
 *
 * Every rule is a list of alternatives; every alternative a sequence of
 * elements ending in GEL_END. Elements of all rules live in one array, so a
 * parse-stack frame is one index into it (the next element to match).
 * Groups and repetitions are rewritten into generated rules at parse time,
 * so the matcher knows only three element kinds: a reference to a rule, a
 * set of code-point ranges, and the end of an alternative. Invariants the
 * parser establishes and the matcher relies on:
 *   - no rule reaches itself at its left edge (no left recursion), so
 *     expanding a stack without consuming a code point terminates;
 *   - every rule reference names a defined rule; root exists. */
#ifndef KV_GRAMMAR_INTERNAL_H
#define KV_GRAMMAR_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "kvasir/grammar.h"

enum { GEL_END = 0, GEL_REF = 1, GEL_SET = 2 };

/* One element: kind in the top 2 bits, rule or set index below. */
#define GEL(kind, arg) (((uint32_t)(kind) << 30) | (uint32_t)(arg))
#define GEL_KIND(e) ((e) >> 30)
#define GEL_ARG(e) ((e) & 0x3fffffffu)

typedef struct kv_gset {
    uint32_t first;  /* index of its first range in kv_grammar.ranges */
    uint32_t n;      /* ranges */
    bool negated;    /* matches code points outside every range */
} kv_gset;

typedef struct kv_grange {
    uint32_t lo, hi; /* inclusive code points */
} kv_grange;

struct kv_grammar {
    uint32_t *el;          /* [n_el] elements of every alternative, GEL_END-terminated */
    uint32_t n_el;
    kv_gset *sets;         /* [n_sets] */
    uint32_t n_sets;
    kv_grange *ranges;     /* [n_ranges] each set's sorted by lo, merged (disjoint, not adjacent) */
    uint32_t n_ranges;
    uint32_t *alt;         /* [n_alt] start of each alternative in el */
    uint32_t n_alt;
    uint32_t *rule_alt;    /* [n_rules + 1] rule r's alternatives: alt[rule_alt[r] .. rule_alt[r+1]) */
    uint32_t n_rules;
    uint32_t root;         /* rule index of `root` */
    kv_grammar_limits lim; /* the limits it was built under (the matcher's too) */
};

/* A vocabulary: the pieces and a byte trie over them, laid out in
 * preorder. Node 0 is the root (the empty prefix); node k's subtree is the
 * nodes k .. k + size[k] - 1, its first child is k + 1 and each next
 * sibling follows the previous one's subtree; the tokens whose piece ends
 * in k's subtree are tok_ids[tok_first[k] .. tok_first[k + size[k]]), those
 * ending at k itself the first tok_n[k] of them. sub_ascii[k] holds the
 * bytes on the edges below k (bit b of word b / 64; bit 127 of word 1
 * standing for every byte >= 0x80), so a walk can take a whole subtree
 * whose bytes all leave the grammar's state unchanged without visiting it. */
struct kv_grammar_vocab {
    int32_t n_vocab;
    uint8_t *bytes;        /* pieces back to back */
    uint32_t *off;         /* [n_vocab + 1] piece i is bytes[off[i] .. off[i+1]) */
    bool *eog;             /* [n_vocab] end-of-generation tokens */
    int32_t *eog_ids;      /* [n_eog] */
    int32_t n_eog;
    uint32_t n_nodes;      /* trie nodes, root included */
    uint32_t *size;        /* [n_nodes] nodes in the subtree, itself included */
    uint16_t *child_n;     /* [n_nodes] at most 256 */
    uint8_t *byte;         /* [n_nodes] the byte on the edge into the node */
    uint32_t *tok_first;   /* [n_nodes + 1] */
    uint32_t *tok_n;       /* [n_nodes] */
    int32_t *tok_ids;      /* tokens in the preorder of the node their piece ends at */
    uint64_t (*sub_ascii)[2]; /* [n_nodes] */
    uint32_t max_len;      /* longest piece, bytes */
};

/* The range of set s holding cp, or NULL (ranges are sorted, merged). */
static inline const kv_grange *kv_gset_find(const kv_grammar *g, uint32_t set, uint32_t cp) {
    const kv_gset *s = &g->sets[set];
    if (s->n == 0) return NULL;
    const kv_grange *r = g->ranges + s->first;
    uint32_t lo = 0, hi = s->n;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (r[mid].hi < cp) lo = mid + 1;
        else hi = mid;
    }
    return lo < s->n && r[lo].lo <= cp ? &r[lo] : NULL;
}

/* True when code point cp is in set s of g. */
static inline bool kv_gset_match(const kv_grammar *g, uint32_t set, uint32_t cp) {
    return (kv_gset_find(g, set, cp) != NULL) != g->sets[set].negated;
}

/* True when set s of g holds some code point in [lo, hi]. */
bool kv_gset_overlaps(const kv_grammar *g, uint32_t set, uint32_t lo, uint32_t hi);

#endif
