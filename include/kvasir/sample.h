/* Sampling the next token from logits: logit bias, repetition, presence
 * and frequency penalties, top-k, top-p, min-p, temperature, then one
 * uniform draw (or greedy argmax when temp <= 0). The order follows
 * llama.cpp's default sampler chain (logit bias, penalties, top-k, top-p,
 * min-p, temperature, distribution). The draw is a function of
 * the seed and the position of the token sampled (the number of tokens
 * kv_sampler_accept took before it) alone, not of the draws before: the
 * same seed, logits and history always give the same token, and a sampler
 * fed a sequence's tokens afresh (a replay) draws what the first one drew
 * (with presence or frequency penalties: when the generated ones are fed
 * with kv_sampler_accept_sampled, as they were the first time). */
#ifndef KVASIR_SAMPLE_H
#define KVASIR_SAMPLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"

typedef struct kv_sample_params {
    float temp;            /* <= 0: greedy */
    int32_t top_k;         /* <= 0: off */
    float top_p;           /* >= 1: off */
    float min_p;           /* <= 0: off */
    float repeat_penalty;  /* 1: off */
    int32_t repeat_last_n; /* tokens of history the penalty looks at */
    uint64_t seed;
    /* OpenAI's presence and frequency penalties, each in [-2, 2] (0: off),
       over the tokens generated so far (kv_sampler_accept_sampled), not
       the prompt: logit -= count * frequency + (count > 0) * presence */
    float presence_penalty;
    float frequency_penalty;
    /* added to the logits first: bias[i].bias (in [-100, 100]) to token
       bias[i].token (in the vocabulary); copied by kv_sampler_new; at most
       KV_SAMPLE_MAX_BIAS entries (a token given twice gets both) */
    const struct kv_logit_bias *bias;
    uint32_t n_bias;
} kv_sample_params;

#define KV_SAMPLE_MAX_BIAS 1024u
#define KV_SAMPLE_MAX_TOP 20u   /* alternatives kv_sampler_logprobs reports */

typedef struct kv_logit_bias {
    int32_t token;
    float bias;
} kv_logit_bias;

/* A sampled token's log-probability and the n_top most likely tokens at
 * its position (best first, lower id first on ties), kv_sampler_logprobs'. */
typedef struct kv_token_logprob {
    int32_t token;
    double logprob;
    uint32_t n_top;
    int32_t top_id[KV_SAMPLE_MAX_TOP];
    double top_logprob[KV_SAMPLE_MAX_TOP];
} kv_token_logprob;

/* llama.cpp's defaults: temp 0.8, top-k 40, top-p 0.95, min-p 0.05,
 * repeat penalty 1.0 over the last 64 tokens, seed 0; no presence or
 * frequency penalty, no logit bias. */
kv_sample_params kv_sample_defaults(void);

typedef struct kv_sampler kv_sampler;

/* Allocates buffers for n_vocab candidates. Free with kv_sampler_free
 * (accepts NULL). Errors: KV_EINVAL for out-of-range parameters. */
int kv_sampler_new(kv_sampler **out, int32_t n_vocab, const kv_sample_params *p, kv_diag *d);
void kv_sampler_free(kv_sampler *s);
/* Picks a token from logits[n_vocab] (not modified): returns its id (>= 0),
 * or KV_ERANGE when a logit is NaN or +Inf or every logit is -Inf (no token
 * is drawn then, and the generator does not advance). -Inf logits are
 * allowed (tokens that cannot be drawn). Not thread-safe. */
int32_t kv_sampler_sample(kv_sampler *s, const float *logits);
/* The same sampler without a candidate buffer of its own (n_vocab x 12
 * bytes): the caller lends one to each kv_sampler_sample_in, so many
 * samplers used from one thread share one buffer. own_scratch = true is
 * kv_sampler_new. */
int kv_sampler_new_ex(kv_sampler **out, int32_t n_vocab, const kv_sample_params *p, bool own_scratch,
                      kv_diag *d);
/* Bytes of scratch kv_sampler_sample_in needs for n_vocab candidates. */
size_t kv_sampler_scratch_bytes(int32_t n_vocab);
/* kv_sampler_sample with scratch of kv_sampler_scratch_bytes (NULL: the
 * sampler's own; KV_EINVAL if it has none). The result does not depend on
 * whose buffer is used. */
int32_t kv_sampler_sample_in(kv_sampler *s, const float *logits, void *scratch);
/* kv_sampler_sample_in over the tokens allow permits alone: bit i % 32 of
 * allow[i / 32] set for every token i that may be drawn (a grammar's mask,
 * kv_grammar_mask); the others are left out before the chain, as if their
 * logits were -Inf, and are never returned. The repetition penalty, the
 * chain and the draw are those of kv_sampler_sample_in, which allow NULL
 * is, bit for bit. KV_ERANGE also when allow permits no token with a finite
 * logit. */
int32_t kv_sampler_sample_allowed(kv_sampler *s, const float *logits, void *scratch, const uint32_t *allow);
/* Adds a token to the penalty history (prompt and generated tokens) and
 * moves the draw to the next position. Drawing twice without an accept
 * between gives two independent draws (the second is the first's successor
 * at the same position). */
void kv_sampler_accept(kv_sampler *s, int32_t token);
/* kv_sampler_accept for a token the sampler drew (a generated one): it
 * also counts for the presence and frequency penalties. */
void kv_sampler_accept_sampled(kv_sampler *s, int32_t token);
/* The distribution token is drawn from at this position (call before
 * accepting it): the log-softmax, computed in f64, of logits[n_vocab]
 * after the logit bias and the penalties, before top-k, top-p, min-p and
 * temperature (with neither bias nor penalties: the model's own
 * distribution). out gets token's log-probability and the n_top (at most
 * KV_SAMPLE_MAX_TOP) most likely tokens. Returns 0, KV_ERANGE for logits
 * kv_sampler_sample refuses or a token outside the vocabulary, KV_ENOMEM
 * (its scratch of kv_sampler_scratch_bytes is allocated at the first
 * call). */
int kv_sampler_logprobs(kv_sampler *s, const float *logits, int32_t token, uint32_t n_top, kv_token_logprob *out);

#endif
