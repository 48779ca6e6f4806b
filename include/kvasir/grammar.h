/* Grammar-constrained generation: a GBNF grammar (llama.cpp's grammar text
 * format), a JSON-schema-to-grammar compiler, a matcher over UTF-8 code
 * points, and the sampler side that masks the tokens a grammar forbids.
 *
 * A grammar (kv_grammar) is immutable once built and may be shared by many
 * threads. A matcher (kv_grammar_matcher) is one generation's position in
 * it: a set of parse stacks (a pushdown automaton, as llama.cpp's grammar
 * stacks), interned so that an identical set is one state, with the
 * transitions and token masks of a state cached. Every table a matcher grows
 * is bounded (kv_grammar_limits); a grammar that would need more (left
 * recursion, an ambiguity that multiplies the stacks, nesting past the
 * depth) is a clear error, never unbounded memory or time. A matcher is not
 * thread-safe; use one per generation.
 *
 * Hot path: kv_grammar_mask walks a byte trie of the vocabulary's pieces
 * once per uncached state, pruning every subtree whose prefix the grammar
 * rejects; a state met again (inside a string, between array items) costs a
 * copy of its cached mask. docs/GRAMMAR.md gives the format, the schema
 * subset and the measured cost. */
#ifndef KVASIR_GRAMMAR_H
#define KVASIR_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/tok.h"

typedef struct kv_grammar_limits {
    size_t max_text_bytes;     /* GBNF or schema text accepted */
    uint32_t max_rules;        /* rules, counting those made for groups and repetitions */
    uint32_t max_elements;     /* symbols over all rules after expansion */
    uint32_t max_nesting;      /* parentheses (GBNF) or schema nesting */
    uint32_t max_repeat;       /* the largest m or n in x{m,n}, minItems, maxLength */
    uint32_t max_stacks;       /* parse stacks alive at once in a matcher */
    uint32_t max_stack_depth;  /* frames of one stack (grammar recursion depth) */
    size_t max_memory_bytes;   /* a matcher's interning tables and caches */
} kv_grammar_limits;

/* Text 1 MiB, 4096 rules, 1M elements, nesting 64, repeat 4096, 512 stacks,
 * depth 512, 256 MiB of matcher tables. */
void kv_grammar_limits_default(kv_grammar_limits *l);

typedef struct kv_grammar kv_grammar;

/* Parses GBNF text (len bytes, need not be NUL-terminated) whose start
 * rule is `root`. lim NULL: the defaults. Errors: KV_EFORMAT for a syntax
 * error or an undefined rule (the message gives line:column), KV_ERANGE for
 * a limit (named), KV_EUNSUPPORTED for a left-recursive rule or a repetition
 * of something that can match empty text (named, with its line:column).
 * Free with kv_grammar_free (accepts NULL). */
int kv_grammar_parse(kv_grammar **out, const char *text, size_t len, const kv_grammar_limits *lim,
                     kv_diag *d);
void kv_grammar_free(kv_grammar *g);
/* Rules in g, counting generated ones. */
uint32_t kv_grammar_n_rules(const kv_grammar *g);

/* Compiles a JSON schema (len bytes of JSON text) to GBNF text: a
 * malloc'd NUL-terminated string in *gbnf (caller frees). The subset is in
 * docs/GRAMMAR.md; a keyword outside it that would constrain the value is
 * KV_EUNSUPPORTED naming the keyword and its JSON pointer, never ignored.
 * Whitespace between tokens is bounded. Errors: KV_EFORMAT (not JSON, or a
 * malformed schema), KV_EUNSUPPORTED, KV_ERANGE (a limit), KV_ENOMEM. */
int kv_grammar_schema_to_gbnf(char **gbnf, const char *schema, size_t len,
                              const kv_grammar_limits *lim, kv_diag *d);
/* The same rules with every rule name prefixed by `name` and "-", and no
 * root: the value is rule `name` itself, so the text can sit inside a larger
 * grammar (a tool call's arguments between fixed text) beside other
 * schemas' rules. name: 1-64 letters, digits, '-' or '_' (KV_EINVAL
 * otherwise). Same errors as kv_grammar_schema_to_gbnf. */
int kv_grammar_schema_to_gbnf_named(char **gbnf, const char *schema, size_t len, const char *name,
                                    const kv_grammar_limits *lim, kv_diag *d);
/* kv_grammar_schema_to_gbnf then kv_grammar_parse. */
int kv_grammar_from_schema(kv_grammar **out, const char *schema, size_t len,
                           const kv_grammar_limits *lim, kv_diag *d);
/* Any JSON object (OpenAI's response_format json_object): the schema
 * {"type": "object"}. */
int kv_grammar_json_object(kv_grammar **out, const kv_grammar_limits *lim, kv_diag *d);

/* ---- vocabulary ------------------------------------------------------ */

typedef struct kv_grammar_vocab kv_grammar_vocab;

/* The vocabulary as the matcher sees it: pieces[i] (lens[i] bytes) is what
 * token i adds to the text; eog[i] marks end-of-generation tokens (allowed
 * exactly when the grammar can end). A non-eog token with an empty piece is
 * never allowed (it would make no progress). Builds the byte trie. Errors:
 * KV_EINVAL (n_vocab out of range, a piece over KV_TOK_MAX_TOKEN_BYTES),
 * KV_ENOMEM. Free with kv_grammar_vocab_free (accepts NULL). Immutable:
 * share it between matchers and threads. */
int kv_grammar_vocab_new(kv_grammar_vocab **out, const char *const *pieces, const uint32_t *lens,
                         const bool *eog, int32_t n_vocab, kv_diag *d);
/* Same from a tokenizer: pieces as generated text (kv_tok_piece without
 * special), eog from kv_tok_is_eog; control tokens other than eog never
 * allowed. */
int kv_grammar_vocab_from_tok(kv_grammar_vocab **out, const kv_tok *t, kv_diag *d);
void kv_grammar_vocab_free(kv_grammar_vocab *v);
int32_t kv_grammar_vocab_n(const kv_grammar_vocab *v);

/* ---- matcher ----------------------------------------------------------- */

typedef struct kv_grammar_matcher kv_grammar_matcher;

/* A matcher at the start of g (g must outlive it). Errors: KV_ERANGE when
 * the start alone exceeds a limit, KV_ENOMEM. Free with
 * kv_grammar_matcher_free (accepts NULL). */
int kv_grammar_matcher_new(kv_grammar_matcher **out, const kv_grammar *g, kv_diag *d);
void kv_grammar_matcher_free(kv_grammar_matcher *m);

/* Feeds n bytes of text (UTF-8; a code point may be split across calls).
 * Returns 0 when the grammar accepts them as a continuation, KV_EINVAL
 * when it does not (the matcher is then unchanged), KV_ERANGE for a limit
 * (named in d; the matcher is unchanged). */
int kv_grammar_feed(kv_grammar_matcher *m, const char *bytes, size_t n, kv_diag *d);
/* True when the text fed so far is a complete sentence of the grammar. */
bool kv_grammar_can_end(const kv_grammar_matcher *m);

/* Sets bit i of mask[(n_vocab + 31) / 32] (bit i % 32 of word i / 32) for
 * every token i the grammar allows next: a token whose piece continues the
 * text, and an eog token when the grammar can end. Errors: KV_ERANGE for a
 * limit (the mask is then all zero), KV_ENOMEM. */
int kv_grammar_mask(kv_grammar_matcher *m, const kv_grammar_vocab *v, uint32_t *mask, kv_diag *d);
/* kv_grammar_mask, then every forbidden logit set to -INFINITY. */
int kv_grammar_apply(kv_grammar_matcher *m, const kv_grammar_vocab *v, float *logits, kv_diag *d);
/* Advances past token id (its piece; an eog token ends the text and leaves
 * the matcher as it is). KV_EINVAL when the grammar forbids it (matcher
 * unchanged), KV_ERANGE for a limit. */
int kv_grammar_accept(kv_grammar_matcher *m, const kv_grammar_vocab *v, int32_t id, kv_diag *d);

/* Counters of a matcher, for benchmarks and tests. */
typedef struct kv_grammar_stats {
    uint64_t masks;        /* kv_grammar_mask calls */
    uint64_t mask_hits;    /* of which answered from the mask cache */
    uint64_t trie_nodes;   /* trie nodes visited by uncached masks */
    uint64_t flushes;      /* tables rebuilt from the current state (max_memory_bytes / 2 passed) */
    uint32_t states;       /* interned stack sets now */
    size_t memory_bytes;   /* bytes of interning tables and caches now */
} kv_grammar_stats;
void kv_grammar_get_stats(const kv_grammar_matcher *m, kv_grammar_stats *s);

#endif
