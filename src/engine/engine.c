/* The engine (include/kvasir/engine.h): sessions over one kv_state whose
 * sequence slots they borrow, stepped together.
 *
 * Invariants: a session owns slot `slot` of the state from kv_session_new
 * to kv_session_free (the slot's cache and recurrent state are empty when
 * it is taken and emptied when it is given back); sessions are kept in
 * creation order, which is the order prompt chunks are served; a step
 * first reserves each participant's KV blocks (a session that cannot get
 * them fails alone), then runs one kv_state_batch, and only then moves any
 * session's cursors, so a failed step leaves every session as it was.
 *
 * Hot path: kv_engine_step fills preallocated step buffers (tokens,
 * sequences, logit rows for at most max_sessions outputs) and calls
 * kv_state_batch; nothing is allocated there except KV blocks the pool
 * hands out (kv_state_reserve).
 *
 * The prompt cache (prefix_cache.h; engine.h says what it keeps): a session
 * records the tokens it fed (hist, positions 0..pos-1) so that after each
 * step every block it completed is stored under the chain of its prefix,
 * and a new session's first prompt chunk first looks its prompt up. */
#include "kvasir/engine.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "kvasir/dispatch_remote.h"
#include "kvasir/grammar.h"
#include "kvasir/quant.h"
#include "kvasir/slice.h"
#include "engine/prefix_cache.h"
#include "engine/spec.h"

struct kv_session {
    kv_engine *e;
    uint32_t slot;              /* sequence of e->st */
    uint64_t id;                /* 1, 2, ... */
    kv_session_opts o;
    kv_sampler *smp;
    kv_session *prev, *next;    /* e's list, creation order */
    enum kv_session_status status;
    enum kv_stop stop;
    bool paused;
    int32_t *prompt;            /* [prompt_cap] queued prompt tokens */
    uint32_t prompt_cap, n_prompt, prompt_at; /* capacity, queued, fed so far */
    int32_t pending;            /* emitted, to be fed next (DECODE) */
    int32_t token;              /* emitted by the last step, -1 none */
    const float *logits;        /* its row in e->logits, NULL none */
    kv_token_logprob lp;        /* token's log-probability (o.logprobs) */
    bool has_lp;
    uint32_t chunk;             /* prompt tokens in the current step */
    bool in_step;               /* takes part in the current step */
    int err;                    /* 0 or the failure's code */
    char msg[sizeof(((kv_diag *)0)->msg)]; /* the failure's message */
    kv_session_stats st;
    uint64_t products;          /* (token, expert) products of the steps it took part in that succeeded */
    kv_grammar_matcher *gm;     /* kv_session_set_grammar's, NULL: unconstrained */
    uint32_t *gmask;            /* [(n_vocab + 31) / 32] what gm allows next */
    bool gmask_ready;           /* gmask is gm's present state's */
    bool gdone;                 /* gm complete after the token just taken */
    int32_t *hist;              /* [hist_cap] tokens fed, positions 0..n_hist-1 (prompt cache only) */
    uint32_t n_hist, hist_cap;
    bool pc_tried;              /* its prompt was looked up in the prompt cache */
    bool pc_off;                /* its history could not be kept: it stores no more blocks (nor drafts) */
    /* speculative decoding */
    int32_t fed[KV_DRAFT_MAX + 1]; /* this step's fed tokens: pending, then n_draft drafted ones */
    uint32_t n_draft;           /* drafted tokens in this step (0: plain) */
    /* tokens taken but not yet handed out (one per step): q_tok[q_at, q_n) */
    int32_t q_tok[KV_DRAFT_MAX + 1];
    const float *q_row[KV_DRAFT_MAX + 1]; /* their logits (rows of e->logits this step, then qlog) */
    kv_token_logprob q_lp[KV_DRAFT_MAX + 1];
    bool q_has_lp[KV_DRAFT_MAX + 1];
    uint32_t q_n, q_at;
    float *qlog;                /* [draft_max][n_vocab] logits of tokens waiting past a step, NULL until needed */
    float *hid;                 /* [n_embd] mtp source: the final-normed hidden state that gave pending */
    bool hid_ok;                /* hid is pending's */
    /* o.prompt_logprobs: the prompt's own log-probabilities */
    kv_sampler *plp_smp;        /* a neutral sampler (no bias, no penalties): the model's distribution */
    kv_token_logprob *plp;      /* [plp_cap] plp[p]: of the token at position p given those before */
    uint32_t plp_cap;
};

struct kv_engine {
    kv_engine_opts o;
    kv_model *own_model;        /* loaded here (NULL when borrowed) */
    const kv_model *m;
    kv_slices *slices;          /* sliced, no workers */
    kv_remote *remote;          /* with workers */
    kv_expert_provider prov;    /* over the slices (owned), .free NULL otherwise */
    const kv_expert_provider *experts; /* NULL: in-process from m */
    kv_pool *pool;
    kv_state *st;
    uint32_t n_vocab, n_ctx, n_batch, max_sessions, max_tok;
    kv_session **slot;          /* [max_sessions] owner of each sequence, NULL free */
    kv_session *head, *tail;    /* open sessions, creation order */
    uint64_t next_id;
    int32_t *b_tok;             /* [max_tok] step tokens */
    uint32_t *b_seq;            /* [max_tok] their sequences */
    uint32_t *b_out;            /* [max_sessions] token index of each logit row */
    kv_session **b_who;         /* [max_sessions] session of each logit row */
    int32_t *b_plp;             /* [max_sessions] a prompt row's position + 1 (its logits score the next
                                   prompt token: kv_session_prompt_logprobs), or 0: a row to sample from */
    float *logits;              /* [max_sessions][n_vocab] */
    void *cand;                 /* sampler scratch shared by every session (one thread samples) */
    kv_grammar_vocab *gvocab;   /* the vocabulary's trie, built at the first grammar; NULL before */
    kv_engine_stats stats;
    kv_pcache *pc;              /* the prompt cache, NULL: none */
    uint32_t pc_block;          /* its tokens per block */
    bool pc_rec;                /* its blocks carry recurrent states (chunks are cut at block ends) */
    kv_pc_entry **pc_path;      /* [n_ctx / pc_block + 1] a matched chain */
    kv_draft *draft;            /* the draft source, NULL: no speculation */
    uint32_t draft_max;         /* tokens drafted per verify */
    uint32_t draft_budget;      /* drafted tokens per step, all sessions */
    uint32_t max_rows;          /* logit rows per step: max_sessions + draft_budget */
};

#define KV_SPEC_SESSIONS 8u     /* sessions' worth of drafts one step carries */

/* Tokens a verify step took that are still to be handed out keep the
 * session generating, as plain decoding would be until the last of them. */
static bool kv_session_waiting(const kv_session *s) { return s->q_at < s->q_n && s->status != KV_SESSION_FAILED; }


static double kv_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- opening ---------------------------------------------------------------- */

/* Everything after the model and provider are known: sizes, state, buffers. */
static int kv_engine_setup(kv_engine *e, kv_diag *d) {
    const kv_hparams *hp = kv_model_hparams(e->m);
    e->n_vocab = hp->n_vocab;
    e->n_ctx = e->o.n_ctx ? e->o.n_ctx : hp->n_ctx_train;
    if (e->n_ctx > KV_MAX_CTX) e->n_ctx = KV_MAX_CTX;
    kv_state_opts so = {.n_ctx = e->n_ctx, .n_batch = e->n_batch, .experts = e->experts,
                        .n_seq = e->max_sessions, .max_tokens = e->max_tok, .kv_type = e->o.kv_type,
                        .kv_bytes_max = e->o.kv_bytes_max};
    int rc = kv_state_new(&e->st, e->m, e->pool, &so, d);
    if (rc) return rc;
    e->max_tok = kv_state_max_tokens(e->st);
    e->slot = calloc(e->max_sessions, sizeof *e->slot);
    e->b_tok = malloc(e->max_tok * sizeof *e->b_tok);
    e->b_seq = malloc(e->max_tok * sizeof *e->b_seq);
    e->max_rows = e->max_sessions + e->draft_budget;
    e->b_out = malloc(e->max_rows * sizeof *e->b_out);
    e->b_who = malloc(e->max_rows * sizeof *e->b_who);
    e->b_plp = calloc(e->max_rows, sizeof *e->b_plp);
    size_t nl;
    if (!kv_mul_ok(e->max_rows, e->n_vocab, &nl) || nl > ((size_t)1 << 34))
        return kv_fail(d, KV_EINVAL, "engine: logits of %u rows x %u tokens are too large", e->max_rows,
                       e->n_vocab);
    e->logits = malloc(nl * sizeof(float));
    e->cand = malloc(kv_sampler_scratch_bytes((int32_t)e->n_vocab));
    if (!e->cand || !e->slot || !e->b_tok || !e->b_seq || !e->b_out || !e->b_who || !e->b_plp || !e->logits)
        return kv_fail(d, KV_ENOMEM, "engine: out of memory for %u sessions", e->max_sessions);
    if (e->remote && (rc = kv_remote_tally_open(e->remote, e->max_sessions, d))) return rc;
    if (e->o.draft && (rc = kv_draft_open(&e->draft, e->o.draft, e->m, e->experts, e->pool, e->max_sessions, d))) return rc;
    /* the MTP block's experts (layer n_layer) are not among those the trunk
     * needs served: a missing holder is refused here, not at the first draft
     * (unless workers may come later: until then its drafts are empty) */
    if (kv_draft_kind(e->draft) == KV_DRAFT_MTP && e->remote && !e->o.allow_uncovered &&
        (rc = kv_remote_check_layer(e->remote, hp->n_layer, d)))
        return kv_diag_prefix(d, rc, "mtp: the MTP block's experts (--draft mtp needs a worker serving layer %u)",
                              hp->n_layer);
    if (e->o.prompt_cache_bytes) {
        kv_state_mem mem;
        kv_state_get_mem(e->st, &mem);
        e->pc_block = e->o.prompt_cache_block ? e->o.prompt_cache_block : 64;
        if (e->pc_block % mem.block_tokens || e->pc_block > KV_PCACHE_MAX_BLOCK)
            return kv_fail(d, KV_EINVAL, "engine: prompt cache block of %u tokens is not a multiple of %u up to %u",
                           e->pc_block, mem.block_tokens, KV_PCACHE_MAX_BLOCK);
        const uint64_t rec = kv_state_rec_bytes(e->st);
        e->pc_rec = rec != 0;
        if ((rc = kv_pcache_new(&e->pc, e->o.prompt_cache_bytes, e->pc_block, kv_state_kv_bytes(e->st, e->pc_block),
                                rec, d)))
            return rc;
        if (!(e->pc_path = malloc((e->n_ctx / e->pc_block + 1) * sizeof *e->pc_path)))
            return kv_fail(d, KV_ENOMEM, "engine: out of memory for the prompt cache");
    }
    return 0;
}

/* Options checked and defaults applied; the step size is what providers
 * must accept per call. */
static int kv_engine_alloc(kv_engine **out, const kv_engine_opts *opts, kv_diag *d) {
    *out = NULL;
    kv_engine_opts o = opts ? *opts : (kv_engine_opts){0};
    if (o.max_sessions == 0) o.max_sessions = 64;
    if (o.max_sessions > KV_ENGINE_MAX_SESSIONS)
        return kv_fail(d, KV_EINVAL, "engine: %u sessions exceed max %u", o.max_sessions, KV_ENGINE_MAX_SESSIONS);
    if (o.n_batch == 0) o.n_batch = 256;
    if (o.n_batch > 65536) return kv_fail(d, KV_EINVAL, "engine: batch %u exceeds max 65536", o.n_batch);
    if (o.n_ctx > KV_MAX_CTX) return kv_fail(d, KV_EINVAL, "engine: context %u exceeds max %u", o.n_ctx, KV_MAX_CTX);
    if (o.kv_type != KV_TYPE_F32 && o.kv_type != KV_TYPE_F16)
        return kv_fail(d, KV_EINVAL, "engine: KV cache type %u is not f32 or f16", o.kv_type);
    if (o.draft_max > KV_DRAFT_MAX)
        return kv_fail(d, KV_EINVAL, "engine: draft-max %u exceeds max %u", o.draft_max, KV_DRAFT_MAX);
    kv_engine *e = calloc(1, sizeof *e);
    if (!e) return kv_fail(d, KV_ENOMEM, "engine: out of memory");
    e->o = o;
    e->max_sessions = o.max_sessions;
    e->n_batch = o.n_batch;
    const bool spec = o.draft && o.draft[0] && strcmp(o.draft, "none");
    e->draft_max = spec ? (o.draft_max ? o.draft_max : 3) : 0;
    e->draft_budget = e->draft_max * (o.max_sessions < KV_SPEC_SESSIONS ? o.max_sessions : KV_SPEC_SESSIONS);
    /* every decode token plus a full prompt chunk, plus the drafts */
    e->max_tok = o.n_batch + o.max_sessions + e->draft_budget;
    e->next_id = 1;
    *out = e;
    return 0;
}

int kv_engine_open_model(kv_engine **out, const kv_model *m, const kv_expert_provider *experts,
                         const kv_engine_opts *opts, kv_diag *d) {
    kv_engine *e;
    *out = NULL;
    int rc = kv_engine_alloc(&e, opts, d);
    if (rc) return rc;
    e->m = m;
    e->experts = experts;
    if (e->n_batch > kv_model_hparams(m)->n_ctx_train && !e->o.n_ctx) e->n_batch = kv_model_hparams(m)->n_ctx_train;
    if ((rc = kv_pool_new(&e->pool, e->o.n_threads, d)) || (rc = kv_engine_setup(e, d))) {
        kv_engine_free(e);
        return rc;
    }
    *out = e;
    return 0;
}

int kv_engine_open(kv_engine **out, const char *path, const kv_engine_opts *opts, kv_diag *d) {
    kv_engine *e;
    *out = NULL;
    int rc = kv_engine_alloc(&e, opts, d);
    if (rc) return rc;
    char *manifest = NULL;
    struct stat mst;
    const size_t pl = strlen(path);
    const bool is_dir = !stat(path, &mst) && S_ISDIR(mst.st_mode);
    if (is_dir || (pl >= 5 && !strcmp(path + pl - 5, ".json"))) { /* a sliced model */
        if (!(manifest = malloc(pl + 16))) {
            rc = kv_fail(d, KV_ENOMEM, "engine: out of memory");
            goto fail;
        }
        snprintf(manifest, pl + 16, is_dir ? "%s/manifest.json" : "%s", path);
    }
    const bool coord = e->o.n_workers || e->o.max_workers; /* experts on workers (maybe added later) */
    if (!manifest && (coord || e->o.expert_cache_bytes || e->o.skip_hashes || e->o.allow_sparse)) {
        rc = kv_fail(d, KV_EINVAL, "engine: workers, an expert cache, skipped hashes and sparse pieces need a sliced model "
                                   "(DIR/manifest.json), not '%s'", path);
        goto fail;
    }
    if (coord && e->o.expert_cache_bytes) {
        rc = kv_fail(d, KV_EINVAL, "engine: an expert cache and workers cannot be combined");
        goto fail;
    }
    if ((rc = kv_pool_new(&e->pool, e->o.n_threads, d))) goto fail;
    if (coord) {
        /* the coordinator: backbone + manifest here, experts on the workers */
        const kv_remote_opts ro = {e->o.workers, e->o.n_workers, e->o.worker_timeout_ms, 0, e->o.wire,
                                   e->max_tok, e->o.skip_hashes, e->o.log, e->o.allow_sparse,
                                   e->o.key_sk, e->o.voucher, e->o.worker_keys,
                                   .max_workers = e->o.max_workers, .allow_uncovered = e->o.allow_uncovered,
                                   .verify = e->o.verify, .recompute_rate = e->o.recompute_rate,
                                   .on_caught = e->o.on_caught, .caught_arg = e->o.caught_arg,
                                   .insecure_plaintext = e->o.insecure_plaintext};
        if ((rc = kv_remote_open(&e->remote, manifest, e->pool, &ro, d))) goto fail;
        e->m = kv_remote_model(e->remote);
        e->experts = kv_remote_provider(e->remote);
    } else if (manifest) {
        const kv_slices_opts so = {.cache_bytes = e->o.expert_cache_bytes, .skip_hashes = e->o.skip_hashes, .n_threads = e->o.n_threads,
                                   .allow_sparse = e->o.allow_sparse};
        if ((rc = kv_slices_open(&e->slices, manifest, &so, d))) goto fail;
        if ((rc = kv_model_load_ex(&e->own_model, kv_slices_backbone_path(e->slices),
                                   &(kv_model_opts){.no_experts = true}, d)) ||
            (rc = kv_slices_check_model(e->slices, e->own_model, d)))
            goto fail;
        e->m = e->own_model;
        if ((rc = kv_slices_provider_new(&e->prov, e->slices, e->pool, e->max_tok, d))) goto fail;
        e->experts = &e->prov;
    } else {
        if ((rc = kv_model_load(&e->own_model, path, d))) goto fail;
        e->m = e->own_model;
    }
    if (e->o.prefault) {
        kv_diag pd = {0};
        (void)kv_model_prefault(e->m, &pd); /* only colder without it */
    }
    if ((rc = kv_engine_setup(e, d))) goto fail;
    free(manifest);
    *out = e;
    return 0;
fail:
    free(manifest);
    kv_engine_free(e);
    return rc;
}

void kv_engine_free(kv_engine *e) {
    if (!e) return;
    while (e->head) kv_session_free(e->head);
    kv_state_free(e->st);
    kv_pcache_free(e->pc);
    free(e->pc_path);
    if (e->prov.free) e->prov.free(e->prov.impl);
    kv_remote_free(e->remote);
    kv_slices_free(e->slices);
    kv_pool_free(e->pool);
    kv_model_free(e->own_model);
    free(e->slot);
    free(e->b_tok);
    free(e->b_seq);
    free(e->b_out);
    free(e->b_who);
    free(e->b_plp);
    free(e->logits);
    free(e->cand);
    kv_grammar_vocab_free(e->gvocab);
    kv_draft_free(e->draft);
    free(e);
}

const kv_model *kv_engine_model(const kv_engine *e) { return e->m; }
kv_remote *kv_engine_remote(kv_engine *e) { return e->remote; }
kv_slices *kv_engine_slices(kv_engine *e) { return e->slices; }
int kv_engine_n_threads(const kv_engine *e) { return kv_pool_size(e->pool); }
uint32_t kv_engine_n_ctx(const kv_engine *e) { return e->n_ctx; }

void kv_engine_set_profile(kv_engine *e, kv_profile *p) { kv_state_set_profile(e->st, p); }
void kv_engine_set_all_rows(kv_engine *e, bool on) { kv_state_set_all_rows(e->st, on); }

void kv_engine_get_stats(const kv_engine *e, kv_engine_stats *out) {
    *out = e->stats;
    kv_state_get_mem(e->st, &out->mem);
    if (e->pc) {
        kv_pcache_stats ps;
        kv_pcache_get_stats(e->pc, &ps);
        out->cache_budget = ps.budget_bytes;
        out->cache_bytes = ps.bytes;
        out->cache_blocks = ps.entries;
        out->cache_block_tokens = ps.block_tokens;
        out->cache_inserts = ps.inserts;
        out->cache_evictions = ps.evictions;
    }
}

bool kv_engine_busy(const kv_engine *e) {
    for (const kv_session *s = e->head; s; s = s->next)
        if (!s->paused && (s->status == KV_SESSION_PREFILL || s->status == KV_SESSION_DECODE || kv_session_waiting(s)))
            return true;
    return false;
}

/* ---- sessions ---------------------------------------------------------------- */

int kv_session_new(kv_session **out, kv_engine *e, const kv_session_opts *opts, kv_diag *d) {
    *out = NULL;
    kv_session_opts o;
    if (opts) {
        o = *opts;
    } else {
        memset(&o, 0, sizeof o);
        o.sample = kv_sample_defaults();
    }
    if (o.n_stop > KV_SESSION_MAX_STOP)
        return kv_fail(d, KV_EINVAL, "session: %u stop tokens exceed max %u", o.n_stop, KV_SESSION_MAX_STOP);
    for (uint32_t i = 0; i < o.n_stop; i++)
        if (o.stop_tokens[i] < 0 || (uint32_t)o.stop_tokens[i] >= e->n_vocab)
            return kv_fail(d, KV_EINVAL, "session: stop token %d out of range (vocab %u)", o.stop_tokens[i], e->n_vocab);
    if (o.prompt_logprobs && e->draft) /* their rows and a verify's share the step's logit rows */
        return kv_fail(d, KV_EUNSUPPORTED, "session: prompt log-probabilities with speculative decoding (--draft) "
                       "are not supported; run without --draft");
    uint32_t slot = 0;
    while (slot < e->max_sessions && e->slot[slot]) slot++;
    if (slot == e->max_sessions)
        return kv_fail(d, KV_ENOMEM, "session: all %u session slots are in use", e->max_sessions);
    kv_session *s = calloc(1, sizeof *s);
    if (!s) return kv_fail(d, KV_ENOMEM, "session: out of memory");
    int rc = kv_sampler_new_ex(&s->smp, (int32_t)e->n_vocab, &o.sample, false, d);
    if (rc) {
        free(s);
        return rc;
    }
    if (o.prompt_logprobs) { /* the model's own distribution: neither bias nor penalties */
        kv_sample_params np = kv_sample_defaults();
        rc = kv_sampler_new(&s->plp_smp, (int32_t)e->n_vocab, &np, d);
        if (rc) {
            kv_sampler_free(s->smp);
            free(s);
            return rc;
        }
        s->pc_tried = true; /* a prefix from the prompt cache would have no logits */
    }
    s->e = e;
    s->slot = slot;
    s->id = e->next_id++;
    s->o = o;
    s->o.sample.bias = NULL; /* the sampler holds its copy */
    if (s->o.top_logprobs > KV_SAMPLE_MAX_TOP) s->o.top_logprobs = KV_SAMPLE_MAX_TOP;
    s->token = -1;
    s->status = KV_SESSION_IDLE;
    kv_state_reset_seq(e->st, slot); /* empty already; the contract says so */
    kv_draft_reset(e->draft, slot);
    if (e->remote) kv_remote_tally_reset(e->remote, slot); /* the work tally is the session's */
    e->slot[slot] = s;
    s->prev = e->tail;
    if (e->tail) e->tail->next = s;
    else e->head = s;
    e->tail = s;
    e->stats.sessions_created++;
    e->stats.sessions_open++;
    *out = s;
    return 0;
}

void kv_session_free(kv_session *s) {
    if (!s) return;
    kv_engine *e = s->e;
    if (s->prev) s->prev->next = s->next;
    else e->head = s->next;
    if (s->next) s->next->prev = s->prev;
    else e->tail = s->prev;
    kv_state_reset_seq(e->st, s->slot);
    e->slot[s->slot] = NULL;
    e->stats.sessions_open--;
    kv_sampler_free(s->smp);
    kv_sampler_free(s->plp_smp);
    free(s->plp);
    kv_grammar_matcher_free(s->gm);
    free(s->gmask);
    free(s->prompt);
    free(s->hist);
    free(s->qlog);
    free(s->hid);
    free(s);
}

int kv_session_prompt(kv_session *s, const int32_t *tokens, uint32_t n, kv_diag *d) {
    kv_engine *e = s->e;
    if (s->status == KV_SESSION_FAILED)
        return kv_fail(d, KV_EINVAL, "session %llu: failed earlier (%s)", (unsigned long long)s->id, s->msg);
    if (s->status == KV_SESSION_DECODE || s->q_at < s->q_n)
        return kv_fail(d, KV_EINVAL, "session %llu: is generating; a prompt comes before or after", (unsigned long long)s->id);
    if (n == 0) return kv_fail(d, KV_EINVAL, "session %llu: empty prompt", (unsigned long long)s->id);
    for (uint32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= e->n_vocab)
            return kv_fail(d, KV_ERANGE, "session %llu: prompt token %d out of range (vocab %u)",
                           (unsigned long long)s->id, tokens[i], e->n_vocab);
    const uint64_t held = (uint64_t)kv_state_pos_seq(e->st, s->slot) + (s->n_prompt - s->prompt_at);
    if (held + n > e->n_ctx)
        return kv_fail(d, KV_ECTXFULL, "session %llu: prompt of %u tokens does not fit: %llu held, context %u",
                       (unsigned long long)s->id, n, (unsigned long long)held, e->n_ctx);
    /* compact the consumed part, then grow */
    if (s->prompt_at) {
        memmove(s->prompt, s->prompt + s->prompt_at, (s->n_prompt - s->prompt_at) * sizeof *s->prompt);
        s->n_prompt -= s->prompt_at;
        s->prompt_at = 0;
    }
    if (s->n_prompt + n > s->prompt_cap) {
        uint32_t cap = s->prompt_cap ? s->prompt_cap : 64;
        while (cap < s->n_prompt + n) cap *= 2;
        int32_t *np = realloc(s->prompt, (size_t)cap * sizeof *np);
        if (!np) return kv_fail(d, KV_ENOMEM, "session %llu: out of memory for the prompt", (unsigned long long)s->id);
        s->prompt = np;
        s->prompt_cap = cap;
    }
    if (s->o.prompt_logprobs && held + n > s->plp_cap) { /* every position it will hold, unknown until scored */
        kv_token_logprob *np = realloc(s->plp, (size_t)(held + n) * sizeof *np);
        if (!np) return kv_fail(d, KV_ENOMEM, "session %llu: out of memory for prompt log-probabilities",
                                (unsigned long long)s->id);
        for (uint64_t i = s->plp_cap; i < held + n; i++) np[i] = (kv_token_logprob){.token = -1};
        s->plp = np;
        s->plp_cap = (uint32_t)(held + n);
    }
    memcpy(s->prompt + s->n_prompt, tokens, (size_t)n * sizeof *tokens);
    s->n_prompt += n;
    for (uint32_t i = 0; i < n; i++) kv_sampler_accept(s->smp, tokens[i]);
    if (s->status != KV_SESSION_PREFILL) {
        s->status = KV_SESSION_PREFILL;
        s->stop = KV_STOP_NONE;
        s->st.n_gen = 0;
    }
    return 0;
}

int kv_session_force(kv_session *s, const int32_t *tokens, uint32_t n, kv_diag *d) {
    kv_engine *e = s->e;
    if (s->status != KV_SESSION_DECODE && s->status != KV_SESSION_PREFILL)
        return kv_fail(d, KV_EINVAL, "session %llu: tokens are forced only while it prefills or generates",
                       (unsigned long long)s->id);
    if (s->gm) return kv_fail(d, KV_EINVAL, "session %llu: has a grammar; forced tokens would bypass it",
                              (unsigned long long)s->id);
    if (e->draft) /* drafted tokens may already hold positions past the pending one */
        return kv_fail(d, KV_EUNSUPPORTED, "session %llu: forced tokens (a reasoning budget) with speculative "
                       "decoding (--draft) are not supported", (unsigned long long)s->id);
    if (n == 0 || n > KV_SESSION_MAX_FORCE)
        return kv_fail(d, KV_EINVAL, "session %llu: %u forced tokens, must be 1 to %u", (unsigned long long)s->id, n,
                       KV_SESSION_MAX_FORCE);
    for (uint32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= e->n_vocab)
            return kv_fail(d, KV_ERANGE, "session %llu: forced token %d out of range (vocab %u)",
                           (unsigned long long)s->id, tokens[i], e->n_vocab);
    /* generating: the emitted token, not fed yet, goes first */
    int32_t q[KV_SESSION_MAX_FORCE + 1];
    uint32_t m = 0;
    if (s->status == KV_SESSION_DECODE) q[m++] = s->pending;
    memcpy(q + m, tokens, (size_t)n * sizeof *tokens);
    m += n;
    const uint64_t held = (uint64_t)kv_state_pos_seq(e->st, s->slot) + (s->n_prompt - s->prompt_at);
    if (held + m > e->n_ctx)
        return kv_fail(d, KV_ECTXFULL, "session %llu: %u forced tokens do not fit: %llu held, context %u",
                       (unsigned long long)s->id, n, (unsigned long long)held, e->n_ctx);
    if (s->n_prompt + m > s->prompt_cap) {
        uint32_t cap = s->prompt_cap ? s->prompt_cap : 64;
        while (cap < s->n_prompt + m) cap *= 2;
        int32_t *np = realloc(s->prompt, (size_t)cap * sizeof *np);
        if (!np) return kv_fail(d, KV_ENOMEM, "session %llu: out of memory for forced tokens", (unsigned long long)s->id);
        s->prompt = np;
        s->prompt_cap = cap;
    }
    memcpy(s->prompt + s->n_prompt, q, (size_t)m * sizeof *q);
    s->n_prompt += m;
    for (uint32_t i = 0; i < n; i++) kv_sampler_accept_sampled(s->smp, tokens[i]); /* as if sampled */
    s->st.n_gen += n;
    s->st.n_gen_total += n;
    s->status = KV_SESSION_PREFILL;
    return 0;
}

void kv_session_pause(kv_session *s, bool paused) { s->paused = paused; }
enum kv_session_status kv_session_status(const kv_session *s) {
    return kv_session_waiting(s) ? KV_SESSION_DECODE : s->status;
}
enum kv_stop kv_session_stop_reason(const kv_session *s) { return kv_session_waiting(s) ? KV_STOP_NONE : s->stop; }
int32_t kv_session_token(const kv_session *s) { return s->token; }
const float *kv_session_logits(const kv_session *s) { return s->logits; }
const kv_token_logprob *kv_session_logprob(const kv_session *s) { return s->has_lp ? &s->lp : NULL; }
const kv_token_logprob *kv_session_prompt_logprobs(const kv_session *s, uint32_t *n) {
    const uint32_t held = kv_state_pos_seq(s->e->st, s->slot);
    *n = held < s->plp_cap ? held : s->plp_cap;
    return s->plp;
}
uint64_t kv_session_id(const kv_session *s) { return s->id; }

uint64_t kv_session_work(const kv_session *s, uint64_t *answered, uint32_t n_workers) {
    kv_remote *rm = s->e->remote;
    const uint32_t nw = rm ? kv_remote_n_workers(rm) : 0;
    for (uint32_t i = 0; i < n_workers; i++) {
        answered[i] = 0;
        if (i < nw) kv_remote_tally_get(rm, s->slot, i, NULL, &answered[i]);
    }
    return s->products;
}
void *kv_session_data(const kv_session *s) { return s->o.data; }

int kv_session_error(const kv_session *s, kv_diag *d) {
    if (s->err && d) {
        d->code = s->err;
        memcpy(d->msg, s->msg, sizeof d->msg);
    }
    return s->err;
}

void kv_session_get_stats(const kv_session *s, kv_session_stats *out) {
    *out = s->st;
    const uint32_t wait = kv_session_waiting(s) ? s->q_n - s->q_at : 0;
    out->n_gen -= wait;
    out->n_gen_total -= wait;
    out->pos = kv_state_pos_seq(s->e->st, s->slot);
    out->n_pending = s->n_prompt - s->prompt_at;
}

const char *kv_session_status_name(enum kv_session_status st) {
    static const char *const n[] = {"idle", "prefill", "decode", "done", "failed"};
    return (unsigned)st < KV_SESSION_STATUS_COUNT ? n[st] : "?";
}

const char *kv_stop_name(enum kv_stop r) {
    static const char *const n[] = {"none", "eog", "stop_token", "max_tokens", "ctx_full", "error", "grammar"};
    return (unsigned)r < KV_STOP_COUNT ? n[r] : "?";
}

/* The session ends in an error of its own; its KV blocks and recurrent
 * state go back at once (it cannot continue), the slot stays until freed. */
static void kv_session_fail(kv_session *s, int code, const char *msg) {
    s->status = KV_SESSION_FAILED;
    s->stop = KV_STOP_ERROR;
    s->err = code;
    snprintf(s->msg, sizeof s->msg, "%s", msg);
    s->in_step = false;
    s->q_n = s->q_at = 0;
    kv_state_reset_seq(s->e->st, s->slot);
    s->e->stats.sessions_failed++;
}

/* ---- the prompt cache ------------------------------------------------------------ */

/* Appends n fed tokens to s's history; out of memory, the session only
 * stops storing blocks. */
static void kv_pc_hist_add(kv_session *s, const int32_t *tok, uint32_t n) {
    if (s->pc_off) return;
    if (s->n_hist + n > s->hist_cap) {
        uint32_t cap = s->hist_cap ? s->hist_cap : 256;
        while (cap < s->n_hist + n) cap *= 2; /* n_hist + n <= n_ctx <= KV_MAX_CTX: no overflow */
        int32_t *h = realloc(s->hist, (size_t)cap * sizeof *h);
        if (!h) {
            s->pc_off = true;
            return;
        }
        s->hist = h;
        s->hist_cap = cap;
    }
    memcpy(s->hist + s->n_hist, tok, (size_t)n * sizeof *tok);
    s->n_hist += n;
}

/* A new session's prompt: the longest cached prefix of whole blocks that
 * leaves at least its last token to evaluate (with recurrent state at its
 * end, for a recurrent model) becomes its state; when the copy cannot be
 * made (no KV blocks to be had) it prefills from scratch, as if missed. */
static void kv_pc_restore(kv_engine *e, kv_session *s) {
    const uint32_t B = e->pc_block;
    s->pc_tried = true;
    e->stats.cache_lookups++;
    uint32_t m = kv_pcache_match(e->pc, s->prompt, s->n_prompt, (s->n_prompt - 1) / B, e->pc_path);
    if (e->pc_rec)
        while (m && !kv_pc_entry_rec(e->pc_path[m - 1])) m--;
    if (!m) return;
    kv_diag d = {0};
    int rc = kv_state_reserve(e->st, s->slot, m * B, &d);
    for (uint32_t i = 0; !rc && i < m; i++)
        rc = kv_state_kv_set(e->st, s->slot, i * B, B, kv_pc_entry_kv(e->pc_path[i]), &d);
    if (!rc) rc = kv_state_seq_resume(e->st, s->slot, m * B, kv_pc_entry_rec(e->pc_path[m - 1]), &d);
    if (rc) {
        kv_state_reset_seq(e->st, s->slot);
        return;
    }
    kv_pcache_touch(e->pc, e->pc_path, m);
    s->prompt_at = m * B;
    s->st.n_cached += m * B;
    kv_pc_hist_add(s, s->prompt, m * B);
    e->stats.cache_hits++;
    e->stats.cache_tokens += m * B;
}

typedef struct kv_pc_fill_arg {
    kv_state *st;
    uint32_t seq, p0, n;
} kv_pc_fill_arg;

static int kv_pc_fill(void *arg, void *kv, void *rec) {
    const kv_pc_fill_arg *a = arg;
    kv_diag d = {0};
    if (kv && kv_state_kv_get(a->st, a->seq, a->p0, a->n, kv, &d)) return d.code ? d.code : KV_EINVAL;
    if (rec && kv_state_rec_get(a->st, a->seq, rec, &d)) return d.code ? d.code : KV_EINVAL;
    return 0;
}

/* After a step that took s from position pos0: stores the blocks it
 * completed, under the cached chain of its earlier blocks (none stored
 * when that chain is no longer whole); the recurrent state goes with the
 * block that ends where s now stands. */
static void kv_pc_store(kv_engine *e, kv_session *s, uint32_t pos0) {
    const uint32_t B = e->pc_block, pos = kv_state_pos_seq(e->st, s->slot);
    const uint32_t k0 = pos0 / B, k1 = pos / B; /* blocks [k0, k1) completed in the step */
    if (s->pc_off || k0 == k1) return;
    KV_ASSERT(s->n_hist == pos);
    if (kv_pcache_match(e->pc, s->hist, pos, k0, e->pc_path) < k0) return;
    kv_pc_entry *parent = k0 ? e->pc_path[k0 - 1] : NULL;
    for (uint32_t k = k0; k < k1; k++) {
        kv_pc_fill_arg a = {e->st, s->slot, k * B, B};
        if (!(parent = kv_pcache_insert(e->pc, parent, k, s->hist + (size_t)k * B, (k + 1) * B == pos, kv_pc_fill, &a)))
            break;
    }
}

/* ---- the step ------------------------------------------------------------------ */

/* ---- grammar (kv_session_set_grammar) ------------------------------------------ */

int kv_session_set_grammar(kv_session *s, const kv_grammar *g, kv_diag *d) {
    kv_engine *e = s->e;
    if (s->status == KV_SESSION_DECODE || s->status == KV_SESSION_FAILED || kv_session_waiting(s))
        return kv_fail(d, KV_EINVAL, "session %llu: a grammar is set before generating", (unsigned long long)s->id);
    kv_grammar_matcher *m = NULL;
    if (g) {
        int rc;
        if (!e->gvocab && (rc = kv_grammar_vocab_from_tok(&e->gvocab, kv_model_tok(e->m), d))) return rc;
        if (!s->gmask && !(s->gmask = malloc(((size_t)e->n_vocab + 31) / 32 * sizeof *s->gmask)))
            return kv_fail(d, KV_ENOMEM, "session %llu: out of memory for a grammar mask", (unsigned long long)s->id);
        if ((rc = kv_grammar_matcher_new(&m, g, d))) return rc;
    }
    kv_grammar_matcher_free(s->gm);
    s->gm = m;
    s->gmask_ready = s->gdone = false;
    return 0;
}

/* s->gmask for s's next token; nonzero: s failed (msg says why). */
static int kv_session_grammar_mask(kv_session *s, uint64_t step, char *msg, size_t cap) {
    if (s->gmask_ready) return 0;
    kv_diag gd = {0};
    const int rc = kv_grammar_mask(s->gm, s->e->gvocab, s->gmask, &gd);
    if (rc) {
        snprintf(msg, cap, "session %llu: step %llu: %.400s", (unsigned long long)s->id, (unsigned long long)step, gd.msg);
        kv_session_fail(s, rc, msg);
        return rc;
    }
    s->gmask_ready = true;
    return 0;
}

/* The grammar past t, and whether it is complete: it can end and allows
 * nothing but end-of-generation next (that mask is then the next draw's).
 * Nonzero: s failed (msg says why). */
static int kv_session_grammar_take(kv_session *s, int32_t t, uint64_t step, char *msg, size_t cap) {
    kv_engine *e = s->e;
    kv_diag gd = {0};
    const int rc = kv_grammar_accept(s->gm, e->gvocab, t, &gd);
    s->gmask_ready = false;
    if (rc) {
        snprintf(msg, cap, "session %llu: step %llu: %.400s", (unsigned long long)s->id, (unsigned long long)step, gd.msg);
        kv_session_fail(s, rc, msg);
        return rc;
    }
    s->gdone = false;
    if (!kv_grammar_can_end(s->gm)) return 0;
    if (kv_session_grammar_mask(s, step, msg, cap)) return -1;
    const kv_tok *tok = kv_model_tok(e->m);
    bool more = false;
    for (uint32_t w = 0; w < (e->n_vocab + 31) / 32 && !more; w++)
        for (uint32_t bits = s->gmask[w]; bits && !more; bits &= bits - 1)
            more = !kv_tok_is_eog(tok, (int32_t)(w * 32 + (uint32_t)__builtin_ctz(bits)));
    s->gdone = !more;
    return 0;
}

/* Takes a sampled token: stop conditions, or the next decode. pos is the
 * positions s holds once every token before t is fed (a verify step's
 * logical position, not the state's). The token waits in s's queue until a
 * step hands it out (kv_session_publish). */
static void kv_session_take(kv_session *s, int32_t t, const float *row, uint32_t pos) {
    kv_engine *e = s->e;
    kv_sampler_accept_sampled(s->smp, t);
    KV_ASSERT(s->q_n <= KV_DRAFT_MAX);
    s->q_tok[s->q_n] = t;
    s->q_row[s->q_n] = row;
    s->q_has_lp[s->q_n] = s->has_lp;
    if (s->has_lp) s->q_lp[s->q_n] = s->lp;
    s->q_n++;
    s->has_lp = false;
    s->st.n_gen++;
    s->st.n_gen_total++;
    e->stats.tokens_sampled++;
    bool stop_tok = false;
    for (uint32_t i = 0; i < s->o.n_stop; i++) stop_tok |= s->o.stop_tokens[i] == t;
    if (!s->o.ignore_eog && kv_tok_is_eog(kv_model_tok(e->m), t)) s->stop = KV_STOP_EOG;
    else if (stop_tok) s->stop = KV_STOP_TOKEN;
    else if (s->gdone) s->stop = KV_STOP_GRAMMAR;
    else if (s->o.max_tokens && s->st.n_gen >= s->o.max_tokens) s->stop = KV_STOP_MAX_TOKENS;
    else if (pos >= e->n_ctx) s->stop = KV_STOP_CTX_FULL;
    if (s->stop != KV_STOP_NONE) {
        s->status = KV_SESSION_DONE;
    } else {
        s->status = KV_SESSION_DECODE;
        s->pending = t;
    }
}

/* Hands out s's next waiting token as the step's (kv_session_token). */
static bool kv_session_publish(kv_session *s) {
    if (s->paused || !kv_session_waiting(s)) return false;
    const uint32_t i = s->q_at++;
    s->token = s->q_tok[i];
    s->logits = s->q_row[i];
    s->has_lp = s->q_has_lp[i];
    if (s->has_lp) s->lp = s->q_lp[i];
    if (s->q_at == s->q_n) s->q_at = s->q_n = 0;
    return true;
}

/* Samples s's next token from row (its logits at that position) and takes
 * it: the non-finite check, the grammar, the sampler, the log-probability.
 * Returns the token, or -1 when s failed (its message says why). */
static int32_t kv_session_row(kv_session *s, const float *row, uint64_t step, uint32_t pos) {
    kv_engine *e = s->e;
    char msg[sizeof ((kv_diag *)0)->msg];
    /* non-finite logits are a lie (a worker) or a broken model, never a value */
    uint32_t bad = e->n_vocab;
    for (uint32_t i = 0; i < e->n_vocab && bad == e->n_vocab; i++)
        if (!isfinite(row[i])) bad = i;
    if (bad < e->n_vocab) {
        snprintf(msg, sizeof msg, "session %llu: step %llu: logit %u of position %u is %s: non-finite logits "
                 "(an expert provider or the model produced them); no token taken",
                 (unsigned long long)s->id, (unsigned long long)step, bad, pos - 1,
                 isnan(row[bad]) ? "NaN" : row[bad] > 0 ? "+Inf" : "-Inf");
        kv_session_fail(s, KV_ERANGE, msg);
        return -1;
    }
    if (s->gm && kv_session_grammar_mask(s, step, msg, sizeof msg)) return -1;
    const int32_t t = kv_sampler_sample_allowed(s->smp, row, e->cand, s->gm ? s->gmask : NULL);
    if (t < 0) { /* without a grammar cannot happen with finite logits; kept as a clear error */
        snprintf(msg, sizeof msg, s->gm ? "session %llu: step %llu: the grammar allows no token here (%s)"
                                        : "session %llu: step %llu: the sampler refused the logits (%s)",
                 (unsigned long long)s->id, (unsigned long long)step, kv_err_name(t));
        kv_session_fail(s, t, msg);
        return -1;
    }
    s->has_lp = false;
    if (s->o.logprobs) { /* before the token enters the penalties' history */
        const int lrc = kv_sampler_logprobs(s->smp, row, t, s->o.top_logprobs, &s->lp);
        if (lrc) {
            snprintf(msg, sizeof msg, "session %llu: step %llu: log-probabilities: %s", (unsigned long long)s->id,
                     (unsigned long long)step, kv_err_name(lrc));
            kv_session_fail(s, lrc, msg);
            return -1;
        }
        s->has_lp = true;
    }
    if (s->gm && kv_session_grammar_take(s, t, step, msg, sizeof msg)) return -1;
    kv_session_take(s, t, row, pos);
    return t;
}

/* The drafts of a generating session at pos (its fed tokens so far in
 * hist): up to what the step's budget, the context and max_tokens leave,
 * into s->fed[1..]; returns how many. */
static uint32_t kv_spec_draft(kv_engine *e, kv_session *s, uint32_t pos, uint32_t budget) {
    uint32_t k = e->draft_max < budget ? e->draft_max : budget;
    if (pos + 1 + k > e->n_ctx) k = e->n_ctx > pos + 1 ? e->n_ctx - pos - 1 : 0;
    if (s->o.max_tokens) { /* a verify emits up to k + 1 */
        const uint32_t left = s->o.max_tokens > s->st.n_gen ? s->o.max_tokens - s->st.n_gen : 0;
        if (k + 1 > left) k = left ? left - 1 : 0;
    }
    if (k == 0 || s->pc_off || s->n_hist != pos) return 0;
    kv_pc_hist_add(s, &s->pending, 1); /* the context the source sees ends with the token fed next */
    if (s->pc_off) return 0;
    const kv_draft_ctx c = {s->hist, s->n_hist, s->st.n_gen, s->hid_ok ? s->hid : NULL, s->slot};
    /* the MTP block's experts computed by workers are work done for s */
    const bool tally = e->remote && kv_draft_kind(e->draft) == KV_DRAFT_MTP;
    if (tally) kv_remote_tally_begin(e->remote, &s->slot, 1);
    const int m = kv_draft_propose(e->draft, &c, k, s->fed + 1);
    if (tally) kv_remote_tally_end(e->remote, true);
    s->n_hist--;
    if (m <= 0) return 0;
    for (int i = 1; i <= m; i++)
        if (s->fed[i] < 0 || (uint32_t)s->fed[i] >= e->n_vocab) return 0; /* never fed: a source's bug */
    return (uint32_t)m;
}

/* The mtp source's input: the final-normed hidden state of logit row k,
 * which gave the token s feeds next. */
static void kv_spec_keep_hidden(kv_engine *e, kv_session *s, uint32_t k) {
    s->hid_ok = false;
    if (kv_draft_kind(e->draft) != KV_DRAFT_MTP || s->status != KV_SESSION_DECODE) return;
    const float *h = kv_state_hidden_out(e->st, k);
    const uint32_t E = kv_model_hparams(e->m)->n_embd;
    if (!h || (!s->hid && !(s->hid = malloc(E * sizeof(float))))) return;
    memcpy(s->hid, h, E * sizeof(float));
    s->hid_ok = true;
}

/* After a verify step of s from pos0 (1 + n_draft tokens fed, rows from
 * row k of e->logits): samples position by position as plain decoding
 * would, keeping drafted tokens while they equal the draws; rolls the
 * state back to what was kept. Returns whether s is still alive. */
static bool kv_spec_verify(kv_engine *e, kv_session *s, uint32_t k, uint32_t pos0, uint64_t step) {
    uint32_t m = 0, acc = 0;
    for (uint32_t i = 0; i <= s->n_draft; i++) {
        const int32_t t = kv_session_row(s, e->logits + (size_t)(k + i) * e->n_vocab, step, pos0 + i + 1);
        if (t < 0) return false;
        m++;
        const bool same = i < s->n_draft && t == s->fed[i + 1];
        acc += same;
        if (!same || s->status != KV_SESSION_DECODE) break;
    }
    e->stats.spec_steps++;
    if (!e->stats.spec_drafted) e->stats.spec_digest = 0xcbf29ce484222325ull; /* FNV-1a 64 */
    for (uint32_t i = 1; i <= s->n_draft; i++)
        e->stats.spec_digest = (e->stats.spec_digest ^ (uint32_t)s->fed[i]) * 0x100000001b3ull;
    e->stats.spec_drafted += s->n_draft;
    e->stats.spec_accepted += acc;
    e->stats.spec_emitted += m;
    /* the tokens past the first wait beyond this step: their logits are kept */
    if (m > 1 && !s->qlog && !(s->qlog = malloc((size_t)e->draft_max * e->n_vocab * sizeof(float)))) {
        kv_session_fail(s, KV_ENOMEM, "session: out of memory for the logits of accepted drafts");
        return false;
    }
    for (uint32_t j = 1; j < s->q_n; j++) {
        float *dst = s->qlog + (size_t)(j - 1) * e->n_vocab;
        memcpy(dst, s->q_row[j], e->n_vocab * sizeof(float));
        s->q_row[j] = dst;
    }
    /* positions kept: the token fed first and the m - 1 drafts taken after it */
    kv_diag d = {0};
    if (kv_state_seq_rollback(e->st, s->slot, pos0 + m, &d)) {
        char msg[sizeof d.msg];
        snprintf(msg, sizeof msg, "session %llu: step %llu: %.440s", (unsigned long long)s->id, (unsigned long long)step,
                 d.msg);
        kv_session_fail(s, d.code ? d.code : KV_EINTERNAL, msg);
        return false;
    }
    kv_pc_hist_add(s, s->fed, m);
    if (e->pc) kv_pc_store(e, s, pos0);
    kv_spec_keep_hidden(e, s, k + m - 1);
    return true;
}

int kv_engine_step(kv_engine *e, kv_diag *d) {
    const uint64_t step = e->stats.steps + e->stats.steps_failed + 1;
    uint32_t n = 0, n_out = 0, n_dec = 0, n_pre = 0, dbudget = e->draft_budget;
    kv_diag sd;
    /* generating sessions feed their last token (and drafts) */
    for (kv_session *s = e->head; s; s = s->next) {
        s->token = -1;
        s->logits = NULL;
        s->has_lp = false;
        s->in_step = false;
        s->chunk = 0;
        s->n_draft = 0;
        if (s->paused || s->status != KV_SESSION_DECODE || s->q_n) continue;
        const uint32_t pos = kv_state_pos_seq(e->st, s->slot);
        memset(&sd, 0, sizeof sd);
        int rc = kv_state_reserve(e->st, s->slot, pos + 1, &sd);
        if (rc) {
            char msg[sizeof sd.msg];
            snprintf(msg, sizeof msg, "session %llu: step %llu: %.440s", (unsigned long long)s->id,
                     (unsigned long long)step, sd.msg);
            kv_session_fail(s, rc, msg);
            continue;
        }
        uint32_t k = e->draft && dbudget ? kv_spec_draft(e, s, pos, dbudget) : 0;
        kv_diag kd = {0}; /* short of memory for drafts: a plain step */
        if (k && (kv_state_reserve(e->st, s->slot, pos + 1 + k, &kd) || kv_state_spec_keep(e->st, s->slot, k, &kd)))
            k = 0;
        s->in_step = true;
        s->fed[0] = s->pending;
        s->n_draft = k;
        dbudget -= k;
        for (uint32_t i = 0; i <= k; i++) {
            e->b_tok[n] = s->fed[i];
            e->b_seq[n] = s->slot;
            e->b_out[n_out] = n;
            e->b_plp[n_out] = 0;
            e->b_who[n_out++] = s;
            n++;
            n_dec++;
        }
    }
    /* then prompt chunks, oldest session first, up to n_batch tokens */
    uint32_t budget = e->n_batch;
    uint32_t extra = 0; /* rows of prompt log-probabilities in this step */
    for (kv_session *s = e->head; s && budget; s = s->next) {
        if (s->paused || s->status != KV_SESSION_PREFILL) continue;
        if (e->pc && !s->pc_tried && s->prompt_at == 0 && kv_state_pos_seq(e->st, s->slot) == 0) kv_pc_restore(e, s);
        const uint32_t left = s->n_prompt - s->prompt_at, pos = kv_state_pos_seq(e->st, s->slot);
        uint32_t take = left < budget ? left : budget;
        if (s->o.prompt_logprobs) { /* a row of logits per token: what the rows leave, one kept for each session */
            const uint32_t room = e->max_sessions - e->stats.sessions_open - extra + 1;
            if (take > room) take = room;
        }
        if (e->pc_rec) { /* end the chunk at a block boundary it crosses: the recurrent state there is kept */
            const uint32_t end = pos + take, b = end / e->pc_block * e->pc_block;
            if (b > pos && b < end) take = b - pos;
        }
        memset(&sd, 0, sizeof sd);
        int rc = kv_state_reserve(e->st, s->slot, pos + take, &sd);
        if (rc) {
            char msg[sizeof sd.msg];
            snprintf(msg, sizeof msg, "session %llu: step %llu: %.440s", (unsigned long long)s->id,
                     (unsigned long long)step, sd.msg);
            kv_session_fail(s, rc, msg);
            continue;
        }
        s->in_step = true;
        s->chunk = take;
        for (uint32_t i = 0; i < take; i++) {
            e->b_tok[n] = s->prompt[s->prompt_at + i];
            e->b_seq[n++] = s->slot;
        }
        for (uint32_t i = 0; s->o.prompt_logprobs && i < take && s->prompt_at + i + 1 < s->n_prompt; i++) {
            const uint32_t p = pos + i + 1; /* the row of position pos + i scores the token at p */
            s->plp[p].token = s->prompt[s->prompt_at + i + 1];
            e->b_out[n_out] = n - take + i;
            e->b_plp[n_out] = (int32_t)p;
            e->b_who[n_out++] = s;
            extra++;
        }
        if (take == left) { /* its last prompt token: logits to sample from */
            e->b_out[n_out] = n - 1;
            e->b_plp[n_out] = 0;
        e->b_who[n_out++] = s;
        }
        budget -= take;
        n_pre += take;
    }
    int emitted = 0;
    if (n == 0) goto publish; /* tokens accepted earlier may still be waiting */
    const double t0 = kv_now();
    if (e->remote) kv_remote_tally_begin(e->remote, e->b_seq, n); /* who computed what, per session */
    int rc = kv_state_batch(e->st, e->b_tok, e->b_seq, n, e->b_out, n_out, e->logits, d);
    const double dt = kv_now() - t0;
    if (e->remote) kv_remote_tally_end(e->remote, rc == 0);
    if (rc) {
        e->stats.steps_failed++;
        for (kv_session *s = e->head; s; s = s->next) s->in_step = false;
        return kv_diag_prefix(d, rc, "step %llu", (unsigned long long)step);
    }
    e->stats.steps++;
    e->stats.tokens_prefill += n_pre;
    e->stats.tokens_decode += n_dec;
    if (n > e->stats.max_step_tokens) e->stats.max_step_tokens = n;
    e->stats.t_prefill_s += dt * (double)n_pre / (double)n;
    e->stats.t_decode_s += dt * (double)n_dec / (double)n;
    /* every block of every supported architecture routes each token to
       n_expert_used experts (kv_moe_routed), so a token is n_layer x n_used
       (token, expert) products, wherever they were computed; but when the
       step dropped rows, a token without logits (a prompt's but its last)
       skipped the last block's experts (kv_state_batch) */
    const kv_hparams *hp = kv_model_hparams(e->m);
    const bool dropped = kv_state_dropped_rows(e->st);
    if (n_out == 0) e->stats.steps_headless++;
    for (kv_session *s = e->head; s; s = s->next) {
        if (!s->in_step) continue;
        const uint64_t t = s->chunk ? s->chunk : 1 + s->n_draft;
        const uint64_t wanted = s->chunk && s->o.prompt_logprobs ? t /* every row had logits */
                              : !s->chunk ? t : s->prompt_at + s->chunk == s->n_prompt;
        s->products += (uint64_t)hp->n_expert_used * ((uint64_t)hp->n_layer * t - (dropped ? t - wanted : 0));
        s->st.steps++;
        /* a verify step's fed tokens enter the history once it is known which are kept */
        if ((e->pc || e->draft) && !s->n_draft)
            kv_pc_hist_add(s, s->chunk ? s->prompt + s->prompt_at : &s->pending, (uint32_t)t);
        if (s->chunk) {
            s->prompt_at += s->chunk;
            s->st.n_prompt += s->chunk;
            s->st.t_prefill_s += dt;
        } else {
            s->st.t_decode_s += dt;
        }
    }
    /* a NaN/Inf anywhere in a session's hidden states fails it, logits or not */
    for (kv_session *s = e->head; s; s = s->next) {
        if (!s->in_step || kv_state_seq_finite(e->st, s->slot)) continue;
        char msg[sizeof sd.msg];
        snprintf(msg, sizeof msg, "session %llu: step %llu: a NaN or Inf appeared in its hidden state at position "
                 "%u or before (from an expert provider or the model's weights); no token taken",
                 (unsigned long long)s->id, (unsigned long long)step, kv_state_pos_seq(e->st, s->slot) - 1);
        kv_session_fail(s, KV_ERANGE, msg);
    }
    if (e->pc)
        for (kv_session *s = e->head; s; s = s->next)
            if (s->in_step && s->status != KV_SESSION_FAILED && !s->n_draft)
                kv_pc_store(e, s, kv_state_pos_seq(e->st, s->slot) - (s->chunk ? s->chunk : 1));
    for (uint32_t k = 0; k < n_out; k++) {
        kv_session *s = e->b_who[k];
        if (s->status == KV_SESSION_FAILED) {
            k += s->n_draft;
            continue;
        }
        if (e->b_plp[k]) { /* a prompt token's row: its log-probability, nothing sampled */
            kv_token_logprob *pl = &s->plp[e->b_plp[k]];
            const float *row = e->logits + (size_t)k * e->n_vocab;
            const int lrc = kv_sampler_logprobs(s->plp_smp, row, pl->token, s->o.top_logprobs, pl);
            if (lrc) {
                char msg[sizeof sd.msg];
                snprintf(msg, sizeof msg, "session %llu: step %llu: prompt log-probabilities: %s",
                         (unsigned long long)s->id, (unsigned long long)step, kv_err_name(lrc));
                kv_session_fail(s, lrc, msg);
            }
            continue;
        }
        const uint32_t pos = kv_state_pos_seq(e->st, s->slot);
        if (s->n_draft) {
            const uint32_t nd = s->n_draft;
            kv_spec_verify(e, s, k, pos - 1 - nd, step);
            k += nd;
            continue;
        }
        if (kv_session_row(s, e->logits + (size_t)k * e->n_vocab, step, pos) >= 0 && e->draft)
            kv_spec_keep_hidden(e, s, k);
    }
publish:
    for (kv_session *s = e->head; s; s = s->next) emitted += kv_session_publish(s);
    return emitted;
}
