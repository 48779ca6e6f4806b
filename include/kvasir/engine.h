/* The engine: one model (from a GGUF file, a sliced model, or a sliced
 * model whose experts live on workers) serving many sessions at once.
 *
 * A session is one conversation: its own sampler, its own KV cache blocks
 * and recurrent state, its own stop conditions. Sessions are created, fed a
 * prompt, stepped and freed at any time while others run. One engine step
 * is one batched forward pass: every session that is generating feeds its
 * last token, and sessions with prompt tokens waiting fold up to n_batch of
 * them in as well (chunked prefill, oldest session first); the expert
 * provider gets one request per MoE layer carrying all of those tokens.
 * Each session's tokens and logits are byte-identical to running it alone,
 * whatever joins, prefills or leaves beside it (kv_state_batch's guarantee:
 * no result depends on batch composition).
 *
 * Errors are per session where they belong to one: a session whose KV
 * blocks cannot be had (the pool's cap) or whose logits are not finite
 * fails alone, with its own code and message (kv_session_error); the others
 * continue. An error that belongs to the step (the expert provider could
 * not answer) fails the step: kv_engine_step returns it and no session
 * advances, so the step can be retried.
 *
 * Threads: an engine and its sessions are driven from one thread at a time
 * (no call may overlap another on the same engine or any of its sessions);
 * the engine parallelizes each step internally on its own pool. A server
 * keeps one scheduler thread that owns the engine: request threads hand it
 * work (create, prompt, free) through their own queue and read tokens it
 * publishes. Nothing in here blocks except kv_engine_step (compute, and the
 * network when workers serve the experts). */
#ifndef KVASIR_ENGINE_H
#define KVASIR_ENGINE_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "kvasir/err.h"
#include "kvasir/model.h"
#include "kvasir/sample.h"

typedef struct kv_engine kv_engine;
typedef struct kv_session kv_session;
struct kv_remote;
struct kv_slices;
struct kv_voucher;
struct kv_evidence;
struct kv_verify_opts;

#define KV_ENGINE_MAX_SESSIONS 4096u
#define KV_SESSION_MAX_STOP 16u

typedef struct kv_engine_opts {
    int n_threads;               /* compute threads; 0 = all CPUs */
    uint32_t n_ctx;              /* positions per session; 0 = the model's context */
    uint32_t n_batch;            /* prompt tokens per step (chunked prefill); 0 = 256 */
    uint32_t max_sessions;       /* sessions alive at once; 0 = 64 */
    uint32_t kv_type;            /* KV cache elements: KV_TYPE_F32 (0, default) or KV_TYPE_F16 */
    uint64_t kv_bytes_max;       /* cap of the KV block pool; 0 = max_sessions full contexts */
    /* sliced model (path is DIR or DIR/manifest.json) */
    uint64_t expert_cache_bytes; /* no workers: bounded LRU expert cache filled from the slabs;
                                    0 = map every slab */
    bool skip_hashes;            /* check sizes and identity, not every SHA-256 */
    bool allow_sparse;           /* accept a sparse manifest (a sliced skeleton: its holes read
                                    as zeros; pieces checked for size, header and identity) */
    const char *const *workers;  /* [n_workers] "HOST:PORT": experts computed there */
    uint32_t n_workers;
    uint32_t worker_timeout_ms;  /* per-layer deadline before a worker is dropped; 0 = 10000 */
    uint32_t wire;               /* KV_ENC_* of hidden states to workers; 0 = F32 (exact) */
    uint32_t max_workers;        /* room for workers added later (kv_remote_add_worker through
                                    kv_engine_remote); nonzero makes a coordinator even with no
                                    worker yet; 0 = n_workers */
    bool allow_uncovered;        /* coordinator: open even when some expert has no worker up
                                    (a step needing it fails until one comes) */
    FILE *log;                   /* worker connects and drops; NULL = silent */
    /* authenticated dispatch (used at open only, with workers) */
    const uint8_t *key_sk;       /* [64] the coordinator's Ed25519 secret key: required with workers */
    const struct kv_voucher *voucher; /* a hub voucher for that key; NULL = none */
    const uint8_t (*worker_keys)[32]; /* [n_workers] keys the workers must prove; NULL = any */
    bool insecure_plaintext;     /* dial workers over plain TCP (--insecure-plaintext); off: TLS 1.3
                                    pinned to each worker's key, bound into the key handshake */
    /* verified compute (docs/VERIFY.md; see kv_remote_opts) */
    const struct kv_verify_opts *verify; /* NULL = no checks */
    double recompute_rate;       /* fraction of answers also recomputed from the local slab */
    void (*on_caught)(void *arg, uint32_t worker, const char *addr, const uint8_t key[32], const char *why,
                      const struct kv_evidence *ev); /* ev: what it signed, or NULL (kv_remote_opts) */
    void *caught_arg;
    bool prefault;               /* fault the backbone in on a background thread at open
                                    (kv_model_prefault): a shorter cold start */
    /* the prompt cache (below) */
    uint64_t prompt_cache_bytes; /* its memory budget; 0 = no prompt cache */
    uint32_t prompt_cache_block; /* tokens per cache block, a multiple of 16 up to 4096; 0 = 64 */
    /* speculative decoding (below) */
    const char *draft;           /* draft source: NULL or "none", "ngram", "mtp", "test:FILE:P[:SEED]" */
    uint32_t draft_max;          /* tokens drafted per verify step, at most 15; 0 = 3 */
} kv_engine_opts;

/* Speculative decoding (docs/SPECULATIVE.md). With a draft source, a
 * generating session feeds its last token together with up to draft_max
 * tokens the source guesses come next, all in one forward pass (with a
 * coordinator: one request per MoE layer for all of them), and gets the
 * logits of every position. It then samples position by position exactly
 * as plain decoding would (the sampler's draw is a function of the seed and
 * the position, kv_sampler_*; penalties, logit bias, grammar and stop
 * conditions all advance token by token) and keeps a drafted token only
 * when it equals the token drawn there; the first draw that differs is
 * emitted as well and the rest is thrown away: the KV cache shortens and a
 * qwen35moe recurrent state is restored from the copy kept after the last
 * kept position (kv_state_spec_keep: draft_max copies per session).
 * Tokens and logits are therefore those of plain decoding, byte for byte.
 * Callers see no difference but speed: each kv_engine_step still hands each
 * session at most one token; the extra tokens a verify step accepted wait
 * in the session and are handed out by the next steps, which run no
 * forward pass for it (kv_session_status says DECODE until the last is
 * handed out). Drafted tokens per step are bounded by draft_max x 8
 * (sessions beyond that decode plainly in that step), by the context and by
 * max_tokens. A session that fails in the middle of a verify step (a
 * non-finite logit at a drafted position, a grammar limit) loses the
 * tokens still waiting: it fails where plain decoding would have, or
 * earlier, never with other tokens. */

/* The prompt cache (a prefix cache across sessions). Every time a session's
 * position reaches a multiple of prompt_cache_block, the block of positions
 * just completed is kept (its KV rows; for qwen35moe also the recurrent
 * state there, when a step ended on that boundary), keyed by the token ids
 * from position 0: a hash chain, each block checked exactly against its
 * parent block and its own tokens. A new session (nothing evaluated yet)
 * whose prompt starts with cached blocks copies the longest such prefix
 * into its own state (for qwen35moe, the longest that ends at a block with
 * a recurrent state) and evaluates only the rest; at least the prompt's
 * last token is always evaluated, so its logits are computed. With a
 * recurrent model, prompt chunks are cut at block boundaries so that the
 * state there exists. The copied bytes are exactly those the session
 * would have computed (kv_state_kv_get: nothing later depends on how the
 * prefix was chunked or batched), so tokens and logits are byte-identical
 * with and without a hit. Memory: at most prompt_cache_bytes, the least
 * recently used block that no other cached block extends evicted first.
 * The cache belongs to the engine (a coordinator's, whoever computes the
 * experts). */

/* Opens path: a GGUF file (experts in-process from it), or a sliced model
 * (DIR or DIR/manifest.json: the backbone resident, experts from the slabs,
 * or from opts->workers when given, with slabs present as fallback). Every
 * check of kv_model_load / kv_slices_open / kv_remote_open applies, with
 * their errors; *out is NULL on error. Free with kv_engine_free (accepts
 * NULL; frees every session still open). */
int kv_engine_open(kv_engine **out, const char *path, const kv_engine_opts *opts, kv_diag *d);
/* The same over a loaded model (borrowed; must outlive the engine) and an
 * expert provider (borrowed; NULL = in-process from m's own experts). The
 * source fields of opts (expert cache, hashes, workers) are ignored. */
int kv_engine_open_model(kv_engine **out, const kv_model *m, const kv_expert_provider *experts,
                         const kv_engine_opts *opts, kv_diag *d);
void kv_engine_free(kv_engine *e);

const kv_model *kv_engine_model(const kv_engine *e);      /* hparams, tokenizer */
struct kv_remote *kv_engine_remote(kv_engine *e);         /* NULL unless opened with workers */
struct kv_slices *kv_engine_slices(kv_engine *e);         /* NULL unless sliced without workers */
int kv_engine_n_threads(const kv_engine *e);
uint32_t kv_engine_n_ctx(const kv_engine *e);

/* Runs one step (see the top). Returns the number of sessions that got a
 * new token (0 when no session had work), or a negative code when the step
 * as a whole failed (d says why, prefixed "step N"); then no session
 * advanced. Per-session failures do not fail the step. */
int kv_engine_step(kv_engine *e, kv_diag *d);
/* True while some session is prefilling or generating (and not paused). */
bool kv_engine_busy(const kv_engine *e);

typedef struct kv_engine_stats {
    uint64_t steps;              /* forward passes run */
    uint64_t steps_failed;       /* steps that returned an error */
    uint64_t steps_headless;     /* steps that wanted no logits (prompt chunks but no prompt's last
                                    token): their last block ran no attention output, no experts */
    uint64_t tokens_prefill;     /* prompt tokens evaluated */
    uint64_t tokens_decode;      /* generated tokens fed back and evaluated */
    uint64_t tokens_sampled;     /* tokens handed to sessions */
    uint64_t sessions_created;
    uint64_t sessions_failed;    /* sessions that ended in an error */
    uint32_t sessions_open;      /* alive now */
    uint32_t max_step_tokens;    /* most tokens one step carried */
    double t_prefill_s;          /* step time, split between prefill and decode by their */
    double t_decode_s;           /* share of the step's tokens */
    kv_state_mem mem;            /* KV blocks and recurrent state now */
    /* the prompt cache (all 0 without one) */
    uint64_t cache_budget;       /* bytes allowed */
    uint64_t cache_bytes;        /* bytes held now */
    uint32_t cache_blocks;       /* blocks held now */
    uint32_t cache_block_tokens; /* tokens per block */
    uint64_t cache_lookups;      /* new sessions' prompts looked up */
    uint64_t cache_hits;         /* ... that found a prefix */
    uint64_t cache_tokens;       /* prompt tokens taken from the cache, not evaluated */
    uint64_t cache_inserts;      /* blocks stored */
    uint64_t cache_evictions;    /* blocks evicted for room */
    /* speculative decoding (all 0 without a draft source) */
    uint64_t spec_steps;         /* verify passes: session-steps that fed drafted tokens */
    uint64_t spec_drafted;       /* drafted tokens fed */
    uint64_t spec_accepted;      /* ... that equalled the token drawn there */
    uint64_t spec_emitted;       /* tokens the verify passes yielded (accepted + one per pass
                                    unless the session stopped first) */
    uint64_t spec_digest;        /* FNV-1a 64 of every drafted token fed, in order (0: none): two
                                    runs that drafted the same tokens have the same digest */
} kv_engine_stats;
void kv_engine_get_stats(const kv_engine *e, kv_engine_stats *out);
/* Per-stage timers of the engine's forward passes into p (kv_state_set_profile);
 * NULL stops. */
void kv_engine_set_profile(kv_engine *e, kv_profile *p);
/* Every prompt token through the whole last block from the next step on
 * (kv_state_set_all_rows): the same results, for kvasir bench --all-rows. */
void kv_engine_set_all_rows(kv_engine *e, bool on);

/* ---- sessions ---------------------------------------------------------- */

enum kv_session_status {
    KV_SESSION_IDLE = 0,  /* no prompt yet */
    KV_SESSION_PREFILL,   /* prompt tokens waiting */
    KV_SESSION_DECODE,    /* generating */
    KV_SESSION_DONE,      /* stopped (kv_session_stop_reason); a new prompt continues it */
    KV_SESSION_FAILED,    /* an error (kv_session_error); only kv_session_free remains */
    KV_SESSION_STATUS_COUNT
};

enum kv_stop {
    KV_STOP_NONE = 0,
    KV_STOP_EOG,          /* an end-of-generation token (it is the last token emitted) */
    KV_STOP_TOKEN,        /* one of opts.stop_tokens (emitted too) */
    KV_STOP_MAX_TOKENS,   /* opts.max_tokens emitted */
    KV_STOP_CTX_FULL,     /* the session holds n_ctx positions */
    KV_STOP_ERROR,        /* see kv_session_error */
    KV_STOP_GRAMMAR,      /* the session's grammar is complete: the last token emitted ends a
                             sentence that nothing but end-of-generation may follow */
    KV_STOP_COUNT
};

typedef struct kv_session_opts {
    kv_sample_params sample;     /* kv_sample_defaults() for llama.cpp's */
    uint32_t max_tokens;         /* tokens emitted per prompt before KV_STOP_MAX_TOKENS; 0 = no limit */
    bool ignore_eog;             /* keep going past end-of-generation tokens */
    int32_t stop_tokens[KV_SESSION_MAX_STOP]; /* extra stop tokens (copied) */
    uint32_t n_stop;
    bool logprobs;               /* each emitted token's log-probability (kv_session_logprob) */
    uint32_t top_logprobs;       /* ... with this many most likely tokens (at most KV_SAMPLE_MAX_TOP) */
    bool prompt_logprobs;        /* the prompt's tokens' too (kv_session_prompt_logprobs); its prompt is
                                  * not taken from the prompt cache, and a step evaluates at most as many
                                  * of its prompt tokens as it has logit rows to spare (max_sessions less
                                  * the sessions open, plus one) */
    void *data;                  /* the caller's, never touched */
} kv_session_opts;

/* Opens a session (IDLE). Errors: KV_ENOMEM when max_sessions are open or
 * memory is short; KV_EINVAL for bad sampler parameters or stop tokens.
 * Free with kv_session_free. */
int kv_session_new(kv_session **out, kv_engine *e, const kv_session_opts *opts, kv_diag *d);
/* Leaves the batch at once (between steps), giving back its KV blocks and
 * recurrent state. Accepts NULL. */
void kv_session_free(kv_session *s);

/* Queues n prompt tokens (copied; they also enter the sampler's penalty
 * history). Allowed when IDLE, PREFILL (appends) or DONE (the next turn:
 * the stop reason and token count reset; the last emitted token was not fed
 * to the model, so a caller continuing a conversation puts it first).
 * Errors: KV_EINVAL while generating or after a failure, KV_ERANGE for a
 * token outside the vocabulary, KV_ECTXFULL when the session would exceed
 * n_ctx; nothing is queued then. */
int kv_session_prompt(kv_session *s, const int32_t *tokens, uint32_t n, kv_diag *d);
/* Appends n tokens to s's output as if it had sampled them (they enter the
 * sampler's history as sampled tokens and count toward opts.max_tokens),
 * between steps, while it prefills or generates: the model is fed them
 * (after the token the last step emitted, which was not fed yet) and the
 * next token is sampled after the last of them. For forcing a family's
 * end-of-reasoning marker at a reasoning budget; the caller publishes the
 * tokens itself (kv_session_token never shows them), and keeps n within
 * what max_tokens leaves. Errors: KV_EINVAL in another state, with a
 * grammar (it would be bypassed) or n outside [1, KV_SESSION_MAX_FORCE];
 * KV_ERANGE a token outside the vocabulary; KV_ECTXFULL; KV_ENOMEM;
 * nothing is queued then. */
#define KV_SESSION_MAX_FORCE 64u
int kv_session_force(kv_session *s, const int32_t *tokens, uint32_t n, kv_diag *d);
/* A paused session is skipped by steps (no prefill, no decode) and keeps
 * its state: backpressure for a slow reader. */
void kv_session_pause(kv_session *s, bool paused);

enum kv_session_status kv_session_status(const kv_session *s);
enum kv_stop kv_session_stop_reason(const kv_session *s);
/* The token the last step emitted for s, or -1 if none. */
int32_t kv_session_token(const kv_session *s);
/* The n_vocab logits that token was sampled from; valid until the next
 * step or kv_session_free; NULL if the last step emitted none for s. */
const float *kv_session_logits(const kv_session *s);
/* With opts.logprobs: the token the last step emitted, its log-probability
 * and the top_logprobs most likely tokens (kv_sampler_logprobs: after the
 * logit bias and penalties, before temperature and truncation); valid until
 * the next step; NULL if none was emitted or logprobs are off. */
const kv_token_logprob *kv_session_logprob(const kv_session *s);
/* With opts.prompt_logprobs: [*n] for the positions evaluated so far
 * (the prompt's once it has emitted a token): entry p the log-probability
 * of the token at position p given those before it, and the top_logprobs
 * most likely there, as the model gives them (kv_sampler_logprobs over a
 * sampler without bias or penalties); token -1 where none was computed
 * (position 0, a token fed after an emitted one). Valid until the next
 * kv_session_prompt or kv_session_free; NULL with *n 0 without. */
const kv_token_logprob *kv_session_prompt_logprobs(const kv_session *s, uint32_t *n);
/* 0, or the session's error code, with its one-line message copied to d
 * (names the session and the step). */
int kv_session_error(const kv_session *s, kv_diag *d);
uint64_t kv_session_id(const kv_session *s);        /* 1, 2, ... in creation order */
/* The session's work, for paying who did it: returns the (token, expert)
 * products of every step it took part in that succeeded (n_layer x
 * n_expert_used per token evaluated), and fills answered[i] (i <
 * n_workers) with those of them worker i of kv_engine_remote answered
 * (0 for an engine without workers, or past its worker count); the rest
 * were computed in this process. */
uint64_t kv_session_work(const kv_session *s, uint64_t *answered, uint32_t n_workers);
void *kv_session_data(const kv_session *s);

struct kv_grammar;
/* Constrains every token s samples from now on (this turn and the next) to
 * g (borrowed: it must outlive s or the next call; NULL removes it), from
 * g's start: before each draw the tokens g forbids are left out
 * (kv_sampler_sample_allowed), an end-of-generation token is allowed only
 * where g can end, and once the text is a sentence of g that only
 * end-of-generation may follow, the session stops (KV_STOP_GRAMMAR). The
 * vocabulary's byte trie (kv_grammar_vocab) is built at the engine's first
 * call, on this thread. A session without a grammar samples exactly as
 * before. Allowed when not generating (KV_EINVAL otherwise); errors of the
 * matcher (KV_ERANGE, a limit; KV_ENOMEM) with d naming them, and later
 * ones (a limit met while generating) fail the session alone. */
int kv_session_set_grammar(kv_session *s, const struct kv_grammar *g, kv_diag *d);

typedef struct kv_session_stats {
    uint32_t n_prompt;      /* prompt tokens evaluated (all turns) */
    uint32_t n_cached;      /* prompt tokens taken from the prompt cache instead (not in n_prompt) */
    uint32_t n_gen;         /* tokens emitted this turn */
    uint32_t n_gen_total;   /* ... over all turns */
    uint32_t pos;           /* positions held in its cache */
    uint32_t n_pending;     /* prompt tokens still waiting */
    uint64_t steps;         /* steps it took part in */
    double t_prefill_s;     /* wall time of the steps that carried its prompt */
    double t_decode_s;      /* ... that carried its generated tokens */
} kv_session_stats;
void kv_session_get_stats(const kv_session *s, kv_session_stats *out);

const char *kv_session_status_name(enum kv_session_status st);
const char *kv_stop_name(enum kv_stop r); /* "none", "eog", "stop_token", "max_tokens", "ctx_full", "error",
                                             "grammar" */

#endif
