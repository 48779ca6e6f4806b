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
 * SUBMIT or SUBMIT_CHAT) and publishes what comes back exactly as the local
 * scheduler publishes a session's tokens: the prompt's token count from
 * ACCEPT, then each token with the text the home decoded for it. The ring
 * computes the concurrent requests as concurrent sequences (pipelined). A
 * request whose node could not be reached is tried at the next entry; once
 * sent it is the ring's (its home replays it across a break or fails it
 * with a clear error), never retried here, so no token comes twice. */

static int kv_ring_on_accept(void *data, const int32_t *prompt, uint32_t n_prompt) {
    (void)prompt;
    kv_gw_req *r = data;
    kv_gateway *g = r->g;
    pthread_mutex_lock(&g->mu);
    r->n_prompt = n_prompt;
    r->accepted = true;
    g->tokens_prompt += n_prompt;
    const bool stop = r->cancel;
    pthread_cond_broadcast(&g->out_cv);
    pthread_mutex_unlock(&g->mu);
    return stop;
}

static int kv_ring_on_token(void *data, int32_t token, const char *piece, size_t pn, const float *logits,
                            uint32_t n_vocab) {
    (void)logits;
    (void)n_vocab;
    kv_gw_req *r = data;
    kv_gateway *g = r->g;
    pthread_mutex_lock(&g->mu);
    int stop = r->cancel || r->n_toks >= r->cap;
    const size_t at = r->poff[r->n_toks];
    if (!stop && at + pn > r->pcap) {
        const size_t nc = 2 * r->pcap + pn + 256;
        char *nb = realloc(r->pbuf, nc);
        if (nb) {
            r->pbuf = nb;
            r->pcap = nc;
        } else {
            r->err = KV_ENOMEM;
            snprintf(r->errmsg, sizeof r->errmsg, "out of memory for the text");
            stop = 1;
        }
    }
    if (!stop) {
        if (pn) memcpy(r->pbuf + at, piece, pn);
        r->poff[r->n_toks + 1] = (uint32_t)(at + pn);
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

static void *kv_ring_thread(void *arg) {
    kv_gw_req *r = arg;
    kv_gateway *g = r->g;
    const kv_ring_req q = {.text = r->rtext, .text_len = r->rtext_len, .msgs = r->rmsgs, .n_msgs = r->n_rmsgs,
                           .p = r->rp, .key_sk = g->ring_sk, .voucher = g->has_ring_voucher ? &g->ring_voucher : NULL,
                           .timeout_ms = (int)g->o.ring_timeout_ms,
                           .on_accept = kv_ring_on_accept, .on_token = kv_ring_on_token,
                           .cancelled = kv_ring_cancelled, .data = r};
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
    kv_ring_result_free(&res);
    pthread_mutex_lock(&g->mu);
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

/* /health for a ring: every entry node asked STATUS; healthy when one
 * answers that the ring is whole. */
void kv_gw_ring_poll(kv_gateway *g) {
    for (uint32_t i = 0; i < g->n_ring; i++) {
        kv_ring_status st;
        kv_diag d = {0};
        const int rc = kv_ring_status_get_v(g->ring[i], g->ring_sk, g->has_ring_voucher ? &g->ring_voucher : NULL, 2000,
                                            &st, &d);
        pthread_mutex_lock(&g->mu);
        g->ring_st[i].up = rc == 0;
        if (!rc) g->ring_st[i].st = st;
        snprintf(g->ring_st[i].err, sizeof g->ring_st[i].err, "%.250s", rc ? d.msg : "");
        pthread_mutex_unlock(&g->mu);
    }
    pthread_mutex_lock(&g->mu);
    g->healthy = false;
    const char *why = NULL;
    for (uint32_t i = 0; i < g->n_ring && !g->healthy; i++) {
        g->healthy = g->ring_st[i].up && (g->ring_st[i].st.flags & KV_RING_STATUS_WHOLE);
        if (!why) why = g->ring_st[i].up ? g->ring_st[i].st.msg : g->ring_st[i].err;
    }
    if (g->healthy) g->health_msg[0] = 0;
    else snprintf(g->health_msg, sizeof g->health_msg, "the ring is not whole: %s: %.200s", g->ring[0], why ? why : "");
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

/* A ring request: the prompt copied (the raw text, a chat template's
 * rendering when text is given, or every message's role and content) for
 * the home to tokenize. NULL on no memory. */
kv_gw_req *kv_gw_ring_req_new(kv_gateway *g, int api, const kv_gw_params *p, const char *text, size_t text_len) {
    const uint32_t max_tokens = p->has_max_tokens ? p->max_tokens : g->o.max_tokens_default;
    kv_gw_req *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->g = g;
    r->api = api;
    r->max_tokens = max_tokens;
    r->cap = max_tokens + 1;
    const bool raw = text || p->prompt; /* SUBMIT: a prompt, or a template's rendering */
    const char *rt = text ? text : p->prompt;
    const size_t rl = text ? text_len : p->prompt_len;
    size_t bytes = raw ? rl : 0;
    for (size_t i = 0; !raw && i < p->n_msgs; i++) bytes += p->msgs[i].len;
    r->toks = malloc((size_t)r->cap * sizeof *r->toks);
    r->poff = calloc((size_t)r->cap + 1, sizeof *r->poff);
    r->rtext = malloc(bytes + 1);
    if (!raw && p->n_msgs) r->rmsgs = malloc(p->n_msgs * sizeof *r->rmsgs);
    if (!r->toks || !r->poff || !r->rtext || (!raw && p->n_msgs && !r->rmsgs)) {
        free(r->toks);
        free(r->poff);
        free(r->rtext);
        free(r->rmsgs);
        free(r);
        return NULL;
    }
    if (raw) {
        memcpy(r->rtext, rt, rl);
        r->rtext_len = rl;
    } else {
        static const char *const roles[] = {"system", "user", "assistant"};
        size_t at = 0;
        for (size_t i = 0; i < p->n_msgs; i++) {
            const char *role = NULL; /* parse checked it is one of the three (a static copy: the body may go) */
            for (int k = 0; k < 3; k++)
                if (p->msgs[i].role && !strcmp(p->msgs[i].role, roles[k])) role = roles[k];
            memcpy(r->rtext + at, p->msgs[i].content, p->msgs[i].len);
            r->rmsgs[i] = (kv_chat_msg){role, r->rtext + at, p->msgs[i].len};
            at += p->msgs[i].len;
        }
        r->n_rmsgs = (uint32_t)p->n_msgs;
        r->rtext_len = at;
    }
    r->rp.flags = p->ignore_eos ? KV_RING_SUBMIT_IGNORE_EOG : 0;
    r->rp.n_predict = max_tokens;
    r->rp.sample = p->sp;
    if (!p->has_seed) r->rp.sample.seed = (uint64_t)time(NULL) ^ ((uint64_t)(uintptr_t)r << 16);
    return r;
}
