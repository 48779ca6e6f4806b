/* Sampling the next token from logits: repetition penalty, top-k, top-p,
 * min-p, temperature, then one uniform draw (or greedy argmax when temp <=
 * 0). The order follows llama.cpp's default sampler chain (penalties,
 * top-k, top-p, min-p, temperature, distribution). The draw is a function of
 * the seed and the position of the token sampled (the number of tokens
 * kv_sampler_accept took before it) alone, not of the draws before: the
 * same seed, logits and history always give the same token, and a sampler
 * fed a sequence's tokens afresh (a replay) draws what the first one drew. */
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
} kv_sample_params;

/* llama.cpp's defaults: temp 0.8, top-k 40, top-p 0.95, min-p 0.05,
 * repeat penalty 1.0 over the last 64 tokens, seed 0. */
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

#endif
