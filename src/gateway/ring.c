/* The gateway over a ring (server_internal.h): with entry nodes there is
 * no engine here; requests go to the ring and its tokens come back. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/server_internal.h"

/* ---- a ring -------------------------------------------------------------
 * With entry nodes (o.n_ring) there is no engine: the scheduler admits
 * queued requests (at most max_active at once) and gives each a thread that
 * submits it to an entry node (kv_ring_request_ex: connect, prove the key,
 * SUBMIT_TOKENS) and publishes what comes back exactly as the local
 * scheduler publishes a session's tokens. The prompt is rendered (the
 * model's chat template) and tokenized here, with the tokenizer an entry
 * node sent (VOCAB, loaded once by the watcher), so the ring computes the
 * tokens a local engine would, and user text never becomes control tokens.
 * What the sampler needs travels with the request (the ring's sampling
 * extension: presence and frequency penalties, the logit bias, the GBNF of
 * a grammar, logprobs), since the ring's tail samples; the tail samples as
 * the engine does, so a seeded or greedy request gives the bytes a local
 * gateway gives. The ring computes the concurrent requests as concurrent
 * sequences (pipelined). A request whose node could not be reached is tried
 * at the next entry; once sent it is the ring's (its home replays it across
 * a break or fails it with a clear error), never retried here, so no token
 * comes twice. The prompt cache lives in the ring's nodes (each holds the
 * blocks of its own window; docs/PROTOCOL.md "Prompt cache over the ring"):
 * the home tells how many prompt tokens they gave (CACHED), reported as
 * cached_tokens and counted in /metrics as a local cache's lookups. */

static int kv_ring_on_accept(void *data, const int32_t *prompt, uint32_t n_prompt) {
    kv_gw_req *r = data;
    kv_gateway *g = r->g;
    pthread_mutex_lock(&g->mu);
    /* the home takes the tokens as sent: anything else is a fault of the ring */
    bool same = n_prompt == r->n_prompt;
    for (uint32_t i = 0; same && i < n_prompt && r->prompt; i++) same = prompt[i] == r->prompt[i];
    if (!same) {
        r->err = KV_EPROTO;
        snprintf(r->errmsg, sizeof r->errmsg, "the ring's home accepted %u prompt tokens that are not the %u sent",
                 n_prompt, r->n_prompt);
    }
    r->accepted = same;
    const bool stop = r->cancel || !same;
    pthread_cond_broadcast(&g->out_cv);
    pthread_mutex_unlock(&g->mu);
    return stop;
}

static void kv_ring_on_logprob(void *data, const kv_token_logprob *lp) {
    kv_gw_req *r = data;
    pthread_mutex_lock(&r->g->mu);
    if (r->lps && r->n_toks < r->cap) /* before n_toks shows it: readers take [0, n_toks) unlocked */
        r->lps[r->n_toks] = lp ? *lp : (kv_token_logprob){.token = -1};
    pthread_mutex_unlock(&r->g->mu);
}

static int kv_ring_on_token(void *data, int32_t token, const char *piece, size_t pn, const float *logits,
                            uint32_t n_vocab) {
    (void)piece; /* the text is decoded here, as for a local engine */
    (void)pn;
    (void)logits;
    (void)n_vocab;
    kv_gw_req *r = data;
    kv_gateway *g = r->g;
    pthread_mutex_lock(&g->mu);
    const int stop = r->cancel || r->n_toks >= r->cap;
    if (!stop) {
        r->toks[r->n_toks++] = token;
        r->sst = KV_SESSION_DECODE;
        g->tokens_generated++;
    }
    pthread_cond_broadcast(&g->out_cv);
    pthread_mutex_unlock(&g->mu);
    return stop;
}

static bool kv_ring_cancelled(void *data) {
    kv_gw_req *r = data;
    pthread_mutex_lock(&r->g->mu);
    const bool c = r->cancel || r->g->quit;
    pthread_mutex_unlock(&r->g->mu);
    return c;
}

/* r's sampling as the ring carries it: the session options a local engine
 * would be given (kv_local_req_new), with the extension when a field of it
 * is set. bias[n_bias] is the caller's copy. */
static kv_ring_params kv_ring_params_of(const kv_gw_req *r, const kv_logit_bias *bias) {
    const char *gram = r->lead ? r->lead->rgrammar : r->rgrammar;
    kv_ring_params p = {.flags = r->so.ignore_eog ? KV_RING_SUBMIT_IGNORE_EOG : 0,
                        .n_predict = r->max_tokens < 1 ? 1 : r->max_tokens > (1u << 20) ? 1u << 20 : r->max_tokens,
                        .sample = r->so.sample};
    p.sample.bias = bias;
    const bool ext = r->so.logprobs || p.sample.n_bias || gram || p.sample.presence_penalty != 0 ||
                     p.sample.frequency_penalty != 0;
    if (ext) p.flags |= KV_RING_SUBMIT_EXT;
    if (r->so.logprobs) {
        p.flags |= KV_RING_SUBMIT_LOGPROBS;
        p.top_logprobs = r->so.top_logprobs > KV_SAMPLE_MAX_TOP ? KV_SAMPLE_MAX_TOP : r->so.top_logprobs;
    }
    if (gram) {
        p.grammar = gram;
        p.grammar_len = (uint32_t)strlen(gram);
    }
    return p;
}

static void *kv_ring_thread(void *arg) {
    kv_gw_req *r = arg;
    kv_gateway *g = r->g;
    kv_ring_params rp = kv_ring_params_of(r, r->so.sample.bias);
    int32_t *rec = NULL; /* --draft: the ring's tail drafts (checked when the gateway opened) */
    kv_diag dd = {0};
    if (g->o.ring_draft && kv_ring_draft_params(g->o.ring_draft, g->o.ring_draft_max, &rp, &rec, &dd))
        fprintf(stderr, "kvasir gateway: --draft: %s (the request decodes without it)\n", dd.msg);
    if (dd.code) rp = kv_ring_params_of(r, r->so.sample.bias);
    const kv_ring_req q = {.tokens = r->prompt, .n_tokens = r->n_prompt, .p = rp,
                           .key_sk = g->ring_sk, .voucher = g->has_ring_voucher ? &g->ring_voucher : NULL,
                           .timeout_ms = (int)g->o.ring_timeout_ms,
                           .on_accept = kv_ring_on_accept, .on_token = kv_ring_on_token,
                           .on_logprob = kv_ring_on_logprob, .cancelled = kv_ring_cancelled, .data = r};
    /* the entries whole at the last look first (round robin), then the rest */
    uint32_t order[KV_GATEWAY_MAX_RING], n = 0;
    pthread_mutex_lock(&g->mu);
    const uint32_t first = g->ring_rr++ % g->n_ring;
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t k = 0; k < g->n_ring; k++) {
            const uint32_t i = (first + k) % g->n_ring;
            const bool whole = g->ring_st[i].up && (g->ring_st[i].st.flags & KV_RING_STATUS_WHOLE);
            if (whole == (pass == 0)) order[n++] = i;
        }
    pthread_mutex_unlock(&g->mu);
    kv_diag d = {0};
    kv_ring_result res = {0};
    int rc = KV_EIO;
    for (uint32_t k = 0; k < n; k++) {
        kv_ring_result_free(&res);
        d = (kv_diag){0};
        rc = kv_ring_request_ex(g->ring[order[k]], &q, &res, &d);
        if (rc == 0 || res.submitted || kv_ring_cancelled(r)) break;
        fprintf(stderr, "kvasir gateway: ring node %s: %s\n", g->ring[order[k]], d.msg);
    }
    const uint32_t stop = res.stop;
    free(rec);
    pthread_mutex_lock(&g->mu);
    if (rp.flags & KV_RING_SUBMIT_DRAFT) { /* /metrics: the ring's acceptance, as the engine's */
        g->eng.spec_steps += res.spec_passes;
        g->eng.spec_drafted += res.spec_drafted;
        g->eng.spec_accepted += res.spec_accepted;
        g->eng.spec_emitted += res.n_tokens;
    }
    if (res.cache_looked) { /* the home looked the prompt up in its ring's prompt caches */
        r->n_cached = res.n_cached;
        g->eng.cache_lookups++;
        g->eng.cache_hits += res.n_cached > 0;
        g->eng.cache_tokens += res.n_cached;
    }
    kv_ring_result_free(&res);
    for (kv_gw_req **pp = &g->active; *pp; pp = &(*pp)->next)
        if (*pp == r) {
            *pp = r->next;
            break;
        }
    g->n_active--;
    r->stop = (enum kv_stop)stop;
    if (r->cancel) {
        g->cancelled++;
    } else if (rc && !r->err) {
        r->err = rc;
        snprintf(r->errmsg, sizeof r->errmsg, "%.250s", d.msg);
    } else if (!rc && !r->err) {
        g->completed++;
    }
    r->state = KV_REQ_DONE;
    g->n_ring_threads--;
    pthread_cond_broadcast(&g->out_cv);
    pthread_cond_signal(&g->work_cv);
    kv_gw_req_unref_locked(r);
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

void *kv_gw_sched_ring(kv_gateway *g) {
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pthread_mutex_lock(&g->mu);
    while (!g->quit) {
        for (kv_gw_req **pp = &g->queue, *prev = NULL; *pp;) { /* queued requests whose client left */
            kv_gw_req *r = *pp;
            if (!r->cancel) {
                prev = r;
                pp = &r->next;
                continue;
            }
            *pp = r->next;
            if (g->queue_tail == r) g->queue_tail = prev;
            g->n_queued--;
            g->cancelled++;
            r->state = KV_REQ_DONE;
            kv_gw_req_unref_locked(r);
        }
        while (!g->hold && g->queue && g->n_active < g->o.max_active) {
            kv_gw_req *r = kv_gw_queue_pick_locked(g);
            if (!r) break; /* every queued one waits on another (not over a ring: no choices) */
            r->state = KV_REQ_ACTIVE;
            r->sst = KV_SESSION_PREFILL;
            r->next = g->active;
            g->active = r;
            g->n_active++;
            if (g->n_active > g->max_batch) g->max_batch = g->n_active;
            pthread_t t;
            g->n_ring_threads++; /* the queue's reference passes to the thread */
            if (pthread_create(&t, &at, kv_ring_thread, r)) {
                g->n_ring_threads--;
                g->active = r->next;
                g->n_active--;
                kv_gw_req_finish_locked(g, r, KV_ENOMEM, "cannot start a thread for the request");
            }
        }
        pthread_cond_broadcast(&g->out_cv);
        struct timespec ts;
        kv_gw_deadline(&ts, 1000);
        pthread_cond_timedwait(&g->work_cv, &g->mu, &ts);
    }
    while (g->queue) { /* stopping: queued requests fail, running ones see quit within 100 ms */
        kv_gw_req *r = g->queue;
        g->queue = r->next;
        r->err = KV_EIO;
        snprintf(r->errmsg, sizeof r->errmsg, "the gateway is shutting down");
        r->state = KV_REQ_DONE;
        kv_gw_req_unref_locked(r);
    }
    g->queue_tail = NULL;
    g->n_queued = 0;
    while (g->n_ring_threads) {
        for (kv_gw_req *r = g->active; r; r = r->next) {
            r->err = KV_EIO;
            snprintf(r->errmsg, sizeof r->errmsg, "the gateway is shutting down");
        }
        struct timespec ts;
        kv_gw_deadline(&ts, 100);
        pthread_cond_timedwait(&g->work_cv, &g->mu, &ts);
    }
    pthread_cond_broadcast(&g->out_cv);
    pthread_mutex_unlock(&g->mu);
    pthread_attr_destroy(&at);
    return NULL;
}

/* The ring's tokenizer from entry node i (VOCAB), and the chat template
 * (--chat-template's, or the model's own from the same metadata) opened
 * over it. Once loaded it never changes: tok is set under mu before
 * /health can say healthy, so every request that passed the health check
 * sees it. Returns 0, or the error (why[] says it). */
static int kv_gw_ring_vocab_load(kv_gateway *g, uint32_t i, char *why, size_t cap) {
    uint8_t *buf = NULL;
    size_t len = 0;
    kv_diag d = {0};
    kv_gguf *gg = NULL;
    kv_tok *tok = NULL;
    kv_gw_tmpl *t = NULL;
    int rc = kv_ring_vocab_get(g->ring[i], g->ring_sk, g->has_ring_voucher ? &g->ring_voucher : NULL, 30000, &buf, &len,
                               &d);
    if (!rc && !(rc = kv_gguf_open_mem(&gg, buf, len, &d))) rc = kv_tok_load(&tok, gg, &d);
    if (rc) {
        snprintf(why, cap, "the ring's tokenizer (VOCAB from %.100s): %.250s", g->ring[i], d.msg);
        kv_tok_free(tok);
        kv_gguf_close(gg);
        free(buf);
        return rc;
    }
    const char *src = g->tmpl_own, *name = "--chat-template";
    size_t sl = g->tmpl_own ? g->tmpl_src_len : 0;
    kv_str s = {0};
    kv_diag td = {0};
    if (!src && kv_gguf_find_kv(gg, "tokenizer.chat_template") &&
        !kv_gguf_get_str(gg, "tokenizer.chat_template", &s, &td) && s.len <= KV_GATEWAY_MAX_TEMPLATE) {
        src = s.ptr;
        sl = s.len;
        name = "tokenizer.chat_template";
    }
    if (src && kv_gw_tmpl_open(&t, tok, src, sl, name, &td))
        fprintf(stderr, "gateway: the ring model's chat template cannot be used (%s): prompts are ChatML\n", td.msg);
    else if (!src)
        fprintf(stderr, "gateway: the ring's model has no chat template (tokenizer.chat_template): prompts are ChatML "
                "(--chat-template FILE gives one)\n");
    fprintf(stderr, "gateway: the ring's tokenizer (%d tokens) from %s; prompt template: %s\n", kv_tok_n_vocab(tok),
            g->ring[i], t ? name : "ChatML");
    pthread_mutex_lock(&g->mu);
    g->ring_vocab = buf;
    g->ring_gguf = gg;
    g->ring_tok = tok;
    g->tok = tok;
    if (t) {
        g->ring_tmpl_old = g->tmpl; /* an /apply-template may be reading it: freed at the end */
        g->tmpl = t;
        g->tmpl_src = src;
        g->tmpl_src_len = sl;
    }
    pthread_mutex_unlock(&g->mu);
    return 0;
}

void kv_gw_ring_free(kv_gateway *g) {
    kv_gw_tmpl_free(g->ring_tmpl_old);
    kv_tok_free(g->ring_tok);
    kv_gguf_close(g->ring_gguf);
    free(g->ring_vocab);
    g->ring_tmpl_old = NULL;
    g->ring_tok = NULL;
    g->ring_gguf = NULL;
    g->ring_vocab = NULL;
}

/* /health for a ring: every entry node asked STATUS; healthy when one
 * answers that the ring is whole and the ring's tokenizer is here. */
void kv_gw_ring_poll(kv_gateway *g) {
    for (uint32_t i = 0; i < g->n_ring; i++) {
        kv_ring_status st;
        kv_diag d = {0};
        const int rc = kv_ring_status_get_v(g->ring[i], g->ring_sk, g->has_ring_voucher ? &g->ring_voucher : NULL, 2000,
                                            &st, &d);
        pthread_mutex_lock(&g->mu);
        g->ring_st[i].up = rc == 0;
        if (!rc) g->ring_st[i].st = st;
        /* the prompt must fit the smallest context an entry node holds (the home's check, made here first) */
        if (!rc && st.n_ctx && (!g->n_ctx || st.n_ctx < g->n_ctx)) g->n_ctx = st.n_ctx;
        snprintf(g->ring_st[i].err, sizeof g->ring_st[i].err, "%.250s", rc ? d.msg : "");
        pthread_mutex_unlock(&g->mu);
    }
    char vwhy[512] = "";
    for (uint32_t i = 0; i < g->n_ring && !g->ring_tok; i++) {
        pthread_mutex_lock(&g->mu);
        const bool up = g->ring_st[i].up;
        pthread_mutex_unlock(&g->mu);
        if (up && kv_gw_ring_vocab_load(g, i, vwhy, sizeof vwhy)) fprintf(stderr, "gateway: %s\n", vwhy);
    }
    pthread_mutex_lock(&g->mu);
    g->healthy = false;
    const char *why = NULL;
    for (uint32_t i = 0; i < g->n_ring && !g->healthy; i++) {
        g->healthy = g->ring_st[i].up && (g->ring_st[i].st.flags & KV_RING_STATUS_WHOLE);
        if (!why) why = g->ring_st[i].up ? g->ring_st[i].st.msg : g->ring_st[i].err;
    }
    if (g->healthy && !g->tok) {
        g->healthy = false;
        snprintf(g->health_msg, sizeof g->health_msg, "%.250s", vwhy[0] ? vwhy : "the ring's tokenizer is not here yet");
    } else if (g->healthy) {
        g->health_msg[0] = 0;
    } else {
        snprintf(g->health_msg, sizeof g->health_msg, "the ring is not whole: %s: %.200s", g->ring[0], why ? why : "");
    }
    pthread_mutex_unlock(&g->mu);
}

void *kv_gw_ring_watch_main(void *arg) {
    kv_gateway *g = arg;
    pthread_mutex_lock(&g->mu);
    while (!g->quit) {
        struct timespec ts;
        kv_gw_deadline(&ts, g->o.ring_status_ms);
        pthread_cond_timedwait(&g->ring_cv, &g->mu, &ts);
        if (g->quit) break;
        pthread_mutex_unlock(&g->mu);
        kv_gw_ring_poll(g);
        pthread_mutex_lock(&g->mu);
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

/* The HTTP status of a ring request that failed: the prompt's fault (400),
 * the ring's refusal of this gateway or a bad answer (502), the ring broken,
 * busy or out of reach (503), anything else 500. */
unsigned kv_gw_ring_http_status(int err) {
    switch (err) {
    case KV_ECTXFULL:
    case KV_EINVAL:
    case KV_ERANGE:
    case KV_EUNSUPPORTED: return 400;
    case KV_EAUTH:
    case KV_EPROTO: return 502;
    case KV_EIO:
    case KV_ETIMEOUT:
    case KV_ENOMEM: return 503;
    default: return 500;
    }
}

/* The grammar's text goes with the request (the tail parses it); the
 * logit bias is copied (the request may outlive the connection's body). */
int kv_gw_ring_req_attach(kv_gw_req *r, kv_gw_params *p, bool forced, int format, bool think_open, kv_diag *d) {
    if (forced) {
        const int rc = kv_gw_tools_gbnf(&r->rgrammar, p->tools, p->tool_choice == KV_GW_TOOLS_NAMED ? p->tool_choice_name
                                                                                                   : NULL,
                                        format, p->parallel_calls, think_open, d);
        if (rc) return rc;
    } else if (p->grammar_gbnf) {
        r->rgrammar = p->grammar_gbnf;
        p->grammar_gbnf = NULL;
    }
    if (r->so.sample.n_bias) {
        kv_logit_bias *b = malloc(r->so.sample.n_bias * sizeof *b);
        if (!b) return kv_fail(d, KV_ENOMEM, "out of memory");
        memcpy(b, r->so.sample.bias, r->so.sample.n_bias * sizeof *b);
        r->rbias = b;
        r->so.sample.bias = b;
    }
    return 0;
}
