/* Draft sources for speculative decoding (the engine's; engine.h says what
 * the engine does with their drafts, docs/SPECULATIVE.md why it is exact).
 *
 * A draft source proposes up to k tokens that may follow a session's
 * context. It is only a guess: the engine evaluates the drafts in one
 * batched forward pass with the token before them and keeps the prefix that
 * equals what plain decoding draws, so a source can never change the
 * output, only how many tokens one forward pass yields. Sources:
 *   ngram  the continuation of the latest earlier occurrence of the
 *          context's longest suffix (up to KV_NGRAM_MAX tokens) in the
 *          context itself: any architecture, no weights;
 *   mtp    the model's own MTP (nextn) block (kv_mtp_step): from the
 *          final-normed hidden state that produced the token fed next
 *          and that token, a greedy chain of k steps, each on the previous
 *          step's output; its K/V keeps only the positions run from the
 *          trunk's hidden state (qwen35moe: a whole GGUF file, or a
 *          backbone whose slabs or workers serve the block's experts);
 *   test   FOR MEASUREMENT ONLY: a recorded continuation (token ids from a
 *          plain run) proposed with a chosen acceptance rate p: at the
 *          turn's generated position g it proposes the recorded token with
 *          probability p (a hash of the seed and g, so reproducible) and a
 *          wrong token otherwise, and stops after a wrong one, so that each
 *          drafted token is accepted with probability p.
 * Thread safety: a source is used by the engine's one thread. */
#ifndef KVASIR_ENGINE_SPEC_H
#define KVASIR_ENGINE_SPEC_H

#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/model.h"

#define KV_DRAFT_MAX 15u        /* drafted tokens per verify step (k) */
#define KV_NGRAM_MAX 4u         /* longest suffix matched */
#define KV_NGRAM_WINDOW 8192u   /* context tokens searched back */
#define KV_DRAFT_TEST_MAX (1u << 20) /* tokens of a recorded continuation */

enum kv_draft_kind {
    KV_DRAFT_NONE = 0,
    KV_DRAFT_NGRAM,
    KV_DRAFT_MTP,
    KV_DRAFT_TEST,
    KV_DRAFT_KIND_COUNT
};

typedef struct kv_draft kv_draft;

/* What a source sees of one session before it proposes. */
typedef struct kv_draft_ctx {
    const int32_t *toks;   /* [n] the context: every token fed, then the one fed next */
    uint32_t n;
    uint32_t n_gen;        /* tokens generated this turn, the one fed next included */
    const float *hidden;   /* [n_embd] final-normed hidden state of position n - 2 (whose
                              logits gave toks[n - 1]), or NULL when not known */
    uint32_t seq;          /* the session's sequence (the mtp source's own K/V) */
} kv_draft_ctx;

/* Parses spec ("none", "ngram", "mtp", "test:FILE:P" with P in [0, 1],
 * optionally "test:FILE:P:SEED") and opens the source over m and pool
 * (borrowed; must outlive it) for n_seq sequences. experts (borrowed, may
 * be NULL: m's own) computes the mtp source's routed experts. *out is NULL for "none". Errors: KV_EINVAL naming the bad
 * part, KV_EUNSUPPORTED for mtp on a model without an MTP block, KV_EIO /
 * KV_EFORMAT for the test file, KV_ENOMEM. Free with kv_draft_free
 * (accepts NULL). */
int kv_draft_open(kv_draft **out, const char *spec, const kv_model *m, const kv_expert_provider *experts, kv_pool *pool,
                  uint32_t n_seq, kv_diag *d);
/* A new session takes sequence seq: the source forgets what it kept of it. */
void kv_draft_reset(kv_draft *dr, uint32_t seq);
void kv_draft_free(kv_draft *dr);
enum kv_draft_kind kv_draft_kind(const kv_draft *dr);
const char *kv_draft_kind_name(enum kv_draft_kind k); /* "none", "ngram", "mtp", "test" */
/* Writes up to k (<= KV_DRAFT_MAX) proposed tokens to out; returns how
 * many (0: no guess), or a negative code (the mtp block failed: the
 * engine then decodes plainly). */
int kv_draft_propose(kv_draft *dr, const kv_draft_ctx *c, uint32_t k, int32_t *out);

/* The ngram source's search alone (tests call it): the continuation of the
 * latest earlier occurrence of the longest suffix of toks[0, n) of length
 * KV_NGRAM_MAX down to 1, at most k tokens. */
uint32_t kv_draft_ngram(const int32_t *toks, uint32_t n, uint32_t k, int32_t *out);

/* The test source's guess alone (the ring's tail drafts with it from a
 * recording its request carried): at most k tokens for a turn whose n_gen
 * tokens were generated, the one fed next included. */
uint32_t kv_draft_test_guess(const int32_t *rec, uint32_t n_rec, double p, uint64_t seed, uint32_t n_vocab,
                             uint32_t n_gen, uint32_t k, int32_t *out);
/* The test source's "FILE:P[:SEED]" (after "test:") read without a model:
 * *rec (malloc'd, *n_rec tokens, each below n_vocab), *p and *seed. Errors
 * as kv_draft_open's. */
int kv_draft_test_load(const char *arg, uint32_t n_vocab, int32_t **rec, uint32_t *n_rec, double *p, uint64_t *seed,
                       kv_diag *d);

#endif
