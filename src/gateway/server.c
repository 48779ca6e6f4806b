/* The gateway server: libmicrohttpd (one thread per connection, bounded in
 * number and per IP, idle timeout) in front of one scheduler thread that
 * owns the engine.
 *
 * A request's life: its connection thread reads the body (at most
 * body_max), checks the key, parses and tokenizes, then queues a kv_gw_req
 * (at most queue_max waiting: beyond that 503 + Retry-After). The scheduler
 * admits queued requests as sessions between steps (at most max_active at
 * once), steps the engine, appends each session's new token to its
 * request's token array (allocated once, never moved: readers take
 * toks[0..n_toks) without the lock), and frees finished sessions. The
 * connection thread turns tokens into text (gateway/text.c) and answers
 * whole or as a stream. A client that goes away (its socket hung up, seen
 * before every wait) or a stop string marks the request cancelled, and the
 * scheduler frees its session before the next step.
 *
 * With ring entry nodes (opts.n_ring) there is no engine: the scheduler
 * gives each admitted request a thread that submits it to a ring node and
 * publishes the tokens (and their text) the home streams back, the same
 * way (section "a ring" below).
 *
 * Locking: one mutex (g->mu) guards every queue, list, counter and the
 * mutable fields of every request; work_cv wakes the scheduler, out_cv the
 * connection threads. A request is freed when its last reference (the
 * connection's, the scheduler's) is dropped. */
#include <arpa/inet.h>
#include <errno.h>
#include <stdarg.h>
#include <math.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "gateway/gateway_internal.h"
#include "gateway/pay.h"
#include "http/http_guard.h"
#include "kvasir/dispatch.h"
#include "kvasir/gateway.h"
#include "kvasir/ledger.h"
#include "kvasir/node.h"
#include "kvasir/ring.h"

#include <sodium.h>

enum { KV_REQ_QUEUED = 0, KV_REQ_ACTIVE, KV_REQ_DONE };

typedef struct kv_gw_req {
    struct kv_gw_req *next;     /* queue or active list (g->mu) */
    uint64_t id;                /* 1, 2, ... */
    uint64_t client;            /* who asked (its API key, or its address when no keys): keyed hash */
    int api;
    kv_session_opts so;
    int32_t *prompt;            /* [n_prompt], freed once prompted */
    uint32_t n_prompt;
    uint32_t max_tokens;
    /* guarded by g->mu */
    int refs;
    int state;                  /* KV_REQ_* */
    bool cancel;                /* client gone or a stop string matched */
    bool displaced;             /* dropped from a full queue for another client's request (503) */
    int32_t *toks;              /* [cap] tokens published; entries below n_toks never change */
    uint32_t n_toks, cap;
    enum kv_stop stop;
    int err;                    /* 0, or why it failed */
    char errmsg[256];
    kv_session *s;              /* the scheduler's */
    enum kv_session_status sst; /* last seen, for /v1/slots */
    bool paid;                  /* its work is recorded below when it finishes */
    uint64_t products;          /* its session's (token, expert) products (kv_session_work), once DONE */
    kv_gw_work_node *work;      /* [n_work] workers that answered some of them, once DONE */
    kv_receipt *rcpts;          /* [n_work] their receipts (work[i].receipt points here) */
    uint32_t n_work;
    uint8_t pay_consumer[32], pay_nonce[16]; /* the authorization it is paid by */
    /* a ring request (g->n_ring): its prompt, copied (the connection may go
       first), and the pieces the home sent with each token */
    struct kv_gateway *g;
    kv_ring_params rp;
    char *rtext;                /* [rtext_len] the raw prompt, or every message's content */
    size_t rtext_len;
    kv_chat_msg *rmsgs;         /* [n_rmsgs] views into rtext (chat APIs) */
    uint32_t n_rmsgs;
    bool accepted;              /* (g->mu) the home took it: n_prompt is its token count */
    uint32_t *poff;             /* [cap + 1] piece of token i: pbuf[poff[i], poff[i + 1]); entries
                                   up to n_toks never change */
    char *pbuf;                 /* (g->mu; may move) the pieces, concatenated */
    size_t pcap;
} kv_gw_req;

#define KV_GW_N_CODES 10
static const unsigned kv_gw_codes[KV_GW_N_CODES] = {200, 400, 401, 402, 404, 405, 413, 500, 503, 502};
#define KV_GW_MISSING_MAX 16 /* uncovered shards named by /health */
#define KV_GW_N_BUCKETS 12
static const double kv_gw_buckets[KV_GW_N_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                      0.1,   0.25,   0.5,   1,    2.5,   10};
static const char *const kv_gw_api_names[KV_GW_API_COUNT + 1] = {"openai_chat", "openai_completions", "anthropic",
                                                                 "ollama", "other"};

struct kv_gateway {
    kv_engine *e;               /* the scheduler's alone */
    const kv_tok *tok;          /* immutable: any thread */
    uint32_t n_ctx;
    kv_gateway_opts o;
    char model[KV_GW_MAX_MODEL_LEN + 1];
    char **keys;                /* [n_keys] copies */
    uint32_t n_keys;
    long long started;          /* unix seconds */
    struct MHD_Daemon *mhd;
    uint16_t port;
    pthread_t sched;
    bool sched_up;
    pthread_mutex_t mu;
    pthread_cond_t work_cv, out_cv;
    /* guarded by mu */
    bool quit, hold, healthy;
    char health_msg[256];
    kv_gw_req *queue, *queue_tail, *active;
    uint32_t n_queued, n_active;
    uint64_t next_id;
    uint64_t req_count[KV_GW_API_COUNT + 1][KV_GW_N_CODES];
    uint64_t completed, cancelled, rejected_full, tokens_prompt, tokens_completion;
    uint64_t steps, steps_failed;
    uint64_t tokens_generated;  /* tokens the engine produced for requests (sent or not) */
    uint32_t max_batch;         /* most sessions one step carried */
    kv_gw_pay *pay;             /* charging (pay.h), NULL when free */
    kv_http_guard *guard;       /* connection limits and request deadlines (http_guard.h) */
    uint8_t client_salt[16];    /* keys the hash that names a client (kv_gw_req.client) */
    size_t parse_live;          /* (mu) bytes parsed JSON holds, or is reserved for a parse */
    uint64_t parse_refused, displaced;
    uint64_t step_bucket[KV_GW_N_BUCKETS + 1];
    double step_sum;
    /* a swarm: the engine's experts on workers */
    const kv_manifest *man;     /* the coordinator's manifest (immutable), NULL without workers */
    kv_gw_watch *watch;         /* the hub's placement reader, or NULL */
    double fail_since;          /* scheduler only: monotonic time steps began failing, 0 if not */
    /* guarded by mu */
    uint32_t cov_total, cov_covered, cov_up, cov_n_missing;
    uint32_t cov_missing[KV_GW_MISSING_MAX]; /* manifest slab indices of uncovered shards */
    uint64_t steps_retried;     /* failed steps kept for a retry */
    uint64_t workers_added;     /* workers added from the hub's placement */
    /* workers caught lying (kv_gateway_caught): never asked for a receipt,
       never paid; guarded by caught_mu (taken from the engine's hook, inside
       a step, and under mu when a session settles: never the other way) */
    pthread_mutex_t caught_mu;
    uint8_t caught[KV_REMOTE_MAX_WORKERS][32];
    uint32_t n_caught;
    /* a ring (o.n_ring): entry nodes and what /health last heard from each */
    char *ring[KV_GATEWAY_MAX_RING];
    uint32_t n_ring;
    uint8_t ring_sk[64];        /* the client key proved to the nodes */
    kv_voucher ring_voucher;    /* the hub's voucher for it */
    bool has_ring_voucher;
    pthread_t ring_watch;
    bool ring_watch_up;
    pthread_cond_t ring_cv;     /* wakes the watcher to stop */
    /* guarded by mu */
    struct {
        bool up;                /* it answered STATUS */
        kv_ring_status st;      /* its answer */
        char err[256];          /* why it did not */
    } ring_st[KV_GATEWAY_MAX_RING];
    uint32_t ring_rr;           /* next entry to try first */
    uint32_t n_ring_threads;    /* request threads alive */
};

static bool kv_gw_is_caught(kv_gateway *g, const uint8_t key[32]) {
    pthread_mutex_lock(&g->caught_mu);
    bool hit = false;
    for (uint32_t i = 0; i < g->n_caught && !hit; i++) hit = !memcmp(g->caught[i], key, 32);
    pthread_mutex_unlock(&g->caught_mu);
    return hit;
}

/* ---- requests --------------------------------------------------------- */

static void kv_req_unref_locked(kv_gw_req *r) {
    if (--r->refs > 0) return;
    free(r->rtext);
    free(r->rmsgs);
    free(r->poff);
    free(r->pbuf);
    free(r->work);
    free(r->rcpts);
    free(r->prompt);
    free(r->toks);
    free(r);
}

/* The scheduler's record of who computed r's session (it owns the engine
 * and the remote): the products, and each worker that answered some, with
 * the key its handshake proved. On no memory the workers' part is booked
 * as the gateway's own (pay.h), never lost. */
static void kv_req_record_work(kv_gateway *g, kv_gw_req *r) {
    kv_remote *rm = kv_engine_remote(g->e);
    const uint32_t nw = rm ? kv_remote_n_workers(rm) : 0;
    uint64_t *ans = nw ? calloc(nw, sizeof *ans) : NULL;
    r->products = kv_session_work(r->s, ans, ans ? nw : 0);
    uint32_t n = 0;
    for (uint32_t i = 0; ans && i < nw; i++) n += ans[i] > 0;
    static const uint8_t zero[32];
    if (n && (r->work = calloc(n, sizeof *r->work)) && (r->rcpts = calloc(n, sizeof *r->rcpts))) {
        for (uint32_t i = 0; i < nw; i++) {
            if (!ans[i]) continue;
            kv_gw_work_node *nd = &r->work[r->n_work];
            *nd = (kv_gw_work_node){.answered = ans[i]};
            kv_remote_worker wi;
            kv_remote_worker_info(rm, i, &wi);
            if (wi.key && memcmp(wi.key, zero, 32)) {
                /* the worker signs for what it computed; without its receipt
                   its share goes back to the consumer (the ledger's rule) */
                nd->has_key = true;
                memcpy(nd->key, wi.key, 32);
                if (wi.caught || kv_gw_is_caught(g, wi.key)) {
                    /* caught lying (docs/VERIFY.md): no receipt asked, so its
                       share of this session returns to the consumer */
                    fprintf(stderr, "gateway: worker %s was caught lying: not paid for this session\n", wi.addr);
                    r->n_work++;
                    continue;
                }
                kv_receipt_req q = {.n_products = ans[i] < KV_LEDGER_MAX_PRODUCTS ? ans[i] : KV_LEDGER_MAX_PRODUCTS};
                snprintf(q.gateway, sizeof q.gateway, "%s", kv_gw_pay_id(g->pay));
                memcpy(q.consumer, r->pay_consumer, 32);
                memcpy(q.auth_nonce, r->pay_nonce, 16);
                kv_gw_pay_log_digest(q.gateway, q.consumer, q.auth_nonce, nd->key, q.n_products, q.log_digest);
                kv_diag d = {0};
                if (kv_remote_receipt(rm, i, &q, &r->rcpts[r->n_work], &d) == 0)
                    nd->receipt = &r->rcpts[r->n_work];
                else
                    fprintf(stderr, "gateway: no receipt from worker %s: %s\n", wi.addr, d.msg);
            }
            r->n_work++;
        }
    }
    free(ans);
}

static void kv_req_finish_locked(kv_gateway *g, kv_gw_req *r, int err, const char *msg) {
    if (r->s) {
        if (r->paid && !err) kv_req_record_work(g, r); /* who to pay (a failed one is released) */
        r->stop = kv_session_stop_reason(r->s);
        kv_session_free(r->s);
        r->s = NULL;
    }
    if (err) {
        r->err = err;
        snprintf(r->errmsg, sizeof r->errmsg, "%s", msg);
    } else {
        g->completed++;
    }
    r->state = KV_REQ_DONE;
    kv_req_unref_locked(r);
}

static double kv_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void kv_deadline(struct timespec *ts, long ms) {
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

/* Health as the scheduler sees it: with workers, every shard (slab of a
 * MoE layer) must have each of its experts served by a worker that is up
 * (handshaken, its slabs' hashes checked) or by a local slab. */
static void kv_sched_health_locked(kv_gateway *g) {
    if (g->n_ring) return; /* the ring's watcher keeps it */
    kv_remote *rm = kv_engine_remote(g->e);
    g->healthy = true;
    g->health_msg[0] = 0;
    if (!rm) return;
    kv_remote_coverage cv;
    kv_remote_get_coverage(rm, &cv, g->cov_missing, KV_GW_MISSING_MAX);
    g->cov_total = cv.total;
    g->cov_covered = cv.covered;
    g->cov_up = cv.workers_up;
    g->cov_n_missing = cv.n_missing;
    if (cv.covered < cv.total) {
        const kv_manifest_slab *sl = &g->man->slabs[g->cov_missing[0]];
        g->healthy = false;
        snprintf(g->health_msg, sizeof g->health_msg,
                 "%u of %u shards covered by the %u workers up (first missing: layer %u experts %u-%u)", cv.covered,
                 cv.total, cv.workers_up, sl->layer, sl->first, sl->last);
    }
}

/* Between steps: adds the nodes of a new placement map to the engine's
 * workers (dialed at once; used from their handshake on). Called with mu
 * held; drops it while the remote set changes. */
static void kv_sched_placement_locked(kv_gateway *g) {
    char **addrs = NULL;
    uint8_t (*keys)[32] = NULL;
    uint32_t n = 0;
    kv_remote *rm = kv_engine_remote(g->e);
    if (!rm || !kv_gw_watch_take(g->watch, &addrs, &keys, &n)) return;
    pthread_mutex_unlock(&g->mu);
    uint64_t added = 0;
    static const uint8_t zero[32];
    for (uint32_t i = 0; i < n; i++) {
        kv_diag d = {0};
        /* the node must prove the key the hub lists it with */
        const int rc = kv_remote_add_worker(rm, addrs[i], memcmp(keys[i], zero, 32) ? keys[i] : NULL, &d);
        if (rc > 0) added++;
        else if (rc < 0) fprintf(stderr, "kvasir gateway: placement: %s\n", d.msg);
    }
    kv_node_workers_free(addrs, n);
    free(keys);
    if (added) kv_remote_tend(rm, 0);
    pthread_mutex_lock(&g->mu);
    g->workers_added += added;
}

/* Unlinks and returns the queued request to admit next: of the clients with
 * a request waiting, the one with the fewest sessions running; among its
 * requests, and between clients tied, the one waiting longest. So a client
 * that holds every slot gets the next one only when nobody else waits. */
static kv_gw_req *kv_queue_pick_locked(kv_gateway *g) {
    kv_gw_req *best = NULL, *best_prev = NULL;
    uint32_t best_active = UINT32_MAX;
    for (kv_gw_req *r = g->queue, *prev = NULL; r && best_active; prev = r, r = r->next) {
        uint32_t act = 0;
        for (kv_gw_req *a = g->active; a; a = a->next) act += a->client == r->client;
        if (act < best_active) {
            best = r;
            best_prev = prev;
            best_active = act;
        }
    }
    if (!best) return NULL;
    if (best_prev) best_prev->next = best->next;
    else g->queue = best->next;
    if (g->queue_tail == best) g->queue_tail = best_prev;
    best->next = NULL;
    g->n_queued--;
    return best;
}

/* The queue is full and r's client wants a place: the newest queued request
 * of the client holding the most places yields it (ends 503) when that
 * client holds at least two more than r's; otherwise r is refused. Returns
 * whether a place was made. */
static bool kv_queue_displace_locked(kv_gateway *g, const kv_gw_req *r) {
    uint32_t mine = 0, most = 0;
    kv_gw_req *victim = NULL;
    for (kv_gw_req *q = g->queue; q; q = q->next) {
        mine += q->client == r->client;
        uint32_t same = 0;
        kv_gw_req *newest = NULL;
        for (kv_gw_req *x = q; x; x = x->next) /* counted from its first request on */
            if (x->client == q->client) {
                same++;
                newest = x;
            }
        if (same > most) {
            most = same;
            victim = newest;
        }
    }
    if (!victim || most < mine + 2) return false;
    kv_gw_req *prev = NULL;
    for (kv_gw_req *q = g->queue; q != victim; q = q->next) prev = q;
    if (prev) prev->next = victim->next;
    else g->queue = victim->next;
    if (g->queue_tail == victim) g->queue_tail = prev;
    g->n_queued--;
    g->displaced++;
    g->rejected_full++;
    victim->displaced = true;
    victim->err = KV_EIO;
    snprintf(victim->errmsg, sizeof victim->errmsg,
             "the queue is full and this client held more of it than others (%u places); retry later", most);
    victim->state = KV_REQ_DONE;
    kv_req_unref_locked(victim);
    pthread_cond_broadcast(&g->out_cv);
    return true;
}

static void kv_sched_admit_locked(kv_gateway *g, kv_gw_req *r) {
    kv_diag d = {0};
    kv_session *s = NULL;
    int rc = kv_session_new(&s, g->e, &r->so, &d);
    if (!rc) rc = kv_session_prompt(s, r->prompt, r->n_prompt, &d);
    free(r->prompt);
    r->prompt = NULL;
    if (rc) {
        kv_session_free(s);
        kv_req_finish_locked(g, r, rc, d.msg);
        return;
    }
    r->s = s;
    r->state = KV_REQ_ACTIVE;
    r->sst = kv_session_status(s);
    r->next = NULL;
    kv_gw_req **pp = &g->active;
    while (*pp) pp = &(*pp)->next;
    *pp = r;
    g->n_active++;
}

static void *kv_sched_ring(kv_gateway *g);

static void *kv_sched_main(void *arg) {
    kv_gateway *g = arg;
    if (g->n_ring) return kv_sched_ring(g);
    pthread_mutex_lock(&g->mu);
    kv_sched_health_locked(g);
    while (!g->quit) {
        /* leave: queued or active requests whose client went away */
        for (kv_gw_req **pp = &g->queue, *prev = NULL; *pp;) {
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
            kv_req_unref_locked(r);
        }
        for (kv_gw_req **pp = &g->active; *pp;) {
            kv_gw_req *r = *pp;
            if (!r->cancel) {
                pp = &r->next;
                continue;
            }
            *pp = r->next;
            g->n_active--;
            g->cancelled++;
            kv_req_finish_locked(g, r, 0, NULL);
            g->completed--; /* it did not run to its end */
        }
        /* join: queued requests, oldest first, while there is room */
        while (!g->hold && g->queue && g->n_active < g->o.max_active) kv_sched_admit_locked(g, kv_queue_pick_locked(g));
        pthread_cond_broadcast(&g->out_cv);
        kv_sched_placement_locked(g);
        if (!g->active) {
            struct timespec ts;
            kv_remote *rm = kv_engine_remote(g->e);
            kv_deadline(&ts, rm ? 100 : 1000);
            pthread_cond_timedwait(&g->work_cv, &g->mu, &ts);
            if (rm) { /* idle: reconnects and handshakes go on, closed peers are seen */
                pthread_mutex_unlock(&g->mu);
                kv_remote_tend(rm, 10);
                pthread_mutex_lock(&g->mu);
            }
            kv_sched_health_locked(g);
            continue;
        }
        if (g->n_active > g->max_batch) g->max_batch = g->n_active;
        pthread_mutex_unlock(&g->mu);
        kv_diag d = {0};
        const double t0 = kv_now();
        const int rc = kv_engine_step(g->e, &d);
        const double dt = kv_now() - t0;
        pthread_mutex_lock(&g->mu);
        g->steps++;
        g->step_sum += dt;
        int b = 0;
        while (b < KV_GW_N_BUCKETS && dt > kv_gw_buckets[b]) b++;
        g->step_bucket[b]++;
        kv_remote *rm = kv_engine_remote(g->e);
        if (rc < 0 && rm && (g->fail_since == 0 || kv_now() - g->fail_since < g->o.step_retry_ms / 1000.0)) {
            /* the step failed as a whole (no session advanced): an expert
               whose holders are all gone. Keep the sessions and retry once
               the placement is read again: a replacement, or a holder back */
            g->steps_failed++;
            g->steps_retried++;
            if (g->fail_since == 0) g->fail_since = kv_now();
            kv_gw_watch_kick(g->watch);
            kv_sched_health_locked(g);
            pthread_mutex_unlock(&g->mu);
            kv_remote_tend(rm, 0);
            pthread_mutex_lock(&g->mu);
            struct timespec ts;
            kv_deadline(&ts, 200);
            pthread_cond_timedwait(&g->work_cv, &g->mu, &ts);
            continue;
        }
        if (rc >= 0 && g->fail_since != 0) {
            g->fail_since = 0;
            kv_sched_health_locked(g);
        }
        if (rc < 0) {
            /* the step failed as a whole: no token came from partial results; its
               requests end with the error rather than wait on a broken swarm */
            g->fail_since = 0;
            g->steps_failed++;
            while (g->active) {
                kv_gw_req *r = g->active;
                g->active = r->next;
                g->n_active--;
                kv_req_finish_locked(g, r, rc, d.msg);
            }
            kv_sched_health_locked(g);
            continue;
        }
        for (kv_gw_req **pp = &g->active; *pp;) {
            kv_gw_req *r = *pp;
            const int32_t t = kv_session_token(r->s);
            if (t >= 0 && r->n_toks < r->cap) {
                r->toks[r->n_toks++] = t;
                g->tokens_generated++;
            }
            const enum kv_session_status st = kv_session_status(r->s);
            r->sst = st;
            if (st == KV_SESSION_DONE || st == KV_SESSION_FAILED || r->n_toks >= r->cap) {
                kv_diag sd = {0};
                const int err = st == KV_SESSION_FAILED ? kv_session_error(r->s, &sd) : 0;
                *pp = r->next;
                g->n_active--;
                kv_req_finish_locked(g, r, err ? err : 0, sd.msg);
                continue;
            }
            pp = &r->next;
        }
    }
    /* stopping: every request ends with an error */
    while (g->queue) {
        kv_gw_req *r = g->queue;
        g->queue = r->next;
        r->err = KV_EIO;
        snprintf(r->errmsg, sizeof r->errmsg, "the gateway is shutting down");
        r->state = KV_REQ_DONE;
        kv_req_unref_locked(r);
    }
    g->queue_tail = NULL;
    g->n_queued = 0;
    while (g->active) {
        kv_gw_req *r = g->active;
        g->active = r->next;
        kv_req_finish_locked(g, r, KV_EIO, "the gateway is shutting down");
    }
    g->n_active = 0;
    pthread_cond_broadcast(&g->out_cv);
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

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
    kv_req_unref_locked(r);
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

static void *kv_sched_ring(kv_gateway *g) {
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
            kv_req_unref_locked(r);
        }
        while (!g->hold && g->queue && g->n_active < g->o.max_active) {
            kv_gw_req *r = kv_queue_pick_locked(g);
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
                kv_req_finish_locked(g, r, KV_ENOMEM, "cannot start a thread for the request");
            }
        }
        pthread_cond_broadcast(&g->out_cv);
        struct timespec ts;
        kv_deadline(&ts, 1000);
        pthread_cond_timedwait(&g->work_cv, &g->mu, &ts);
    }
    while (g->queue) { /* stopping: queued requests fail, running ones see quit within 100 ms */
        kv_gw_req *r = g->queue;
        g->queue = r->next;
        r->err = KV_EIO;
        snprintf(r->errmsg, sizeof r->errmsg, "the gateway is shutting down");
        r->state = KV_REQ_DONE;
        kv_req_unref_locked(r);
    }
    g->queue_tail = NULL;
    g->n_queued = 0;
    while (g->n_ring_threads) {
        for (kv_gw_req *r = g->active; r; r = r->next) {
            r->err = KV_EIO;
            snprintf(r->errmsg, sizeof r->errmsg, "the gateway is shutting down");
        }
        struct timespec ts;
        kv_deadline(&ts, 100);
        pthread_cond_timedwait(&g->work_cv, &g->mu, &ts);
    }
    pthread_cond_broadcast(&g->out_cv);
    pthread_mutex_unlock(&g->mu);
    pthread_attr_destroy(&at);
    return NULL;
}

/* /health for a ring: every entry node asked STATUS; healthy when one
 * answers that the ring is whole. */
static void kv_ring_poll(kv_gateway *g) {
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

static void *kv_ring_watch_main(void *arg) {
    kv_gateway *g = arg;
    pthread_mutex_lock(&g->mu);
    while (!g->quit) {
        struct timespec ts;
        kv_deadline(&ts, g->o.ring_status_ms);
        pthread_cond_timedwait(&g->ring_cv, &g->mu, &ts);
        if (g->quit) break;
        pthread_mutex_unlock(&g->mu);
        kv_ring_poll(g);
        pthread_mutex_lock(&g->mu);
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

/* The HTTP status of a ring request that failed: the prompt's fault (400),
 * the ring's refusal of this gateway or a bad answer (502), the ring broken,
 * busy or out of reach (503), anything else 500. */
static unsigned kv_ring_http_status(int err) {
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

/* ---- connections ------------------------------------------------------ */

enum kv_route {
    KV_R_NONE = 0, KV_R_HEALTH, KV_R_METRICS, KV_R_MODELS, KV_R_SLOTS, KV_R_TAGS, KV_R_GEN, KV_R_NOTFOUND,
    KV_R_METHOD, KV_R_PRICES
};

typedef struct kv_gw_conn {
    kv_gateway *g;
    int route;                  /* enum kv_route */
    int api;                    /* error shape (and the generation API for KV_R_GEN) */
    char *body;                 /* [n] received, at most body_max */
    size_t n, cap;
    bool too_big;
    bool answered;              /* refused before its body (the body is not read) */
    size_t parse_charge;        /* bytes of g->parse_live this request's parsed JSON holds */
    int fd;                     /* the client socket, to see it hang up */
    kv_gw_req *r;               /* our reference, or NULL */
    kv_gw_params *p;
    kv_gw_text text;
    kv_gw_buf out;              /* bytes waiting to be sent (stream) */
    size_t out_off;
    kv_gw_buf full;             /* whole text (non-stream) */
    kv_gw_result res;
    char id[64];
    uint32_t consumed;          /* tokens of r->toks turned into text */
    bool finished;
    bool counted;               /* the request is in req_count */
    kv_gw_charge charge;        /* its payment while held (pay.h) */
    bool paid;                  /* settled: cost below */
    kv_settle_result paid_res;
} kv_gw_conn;

static int kv_code_index(unsigned status) {
    for (int i = 0; i < KV_GW_N_CODES; i++)
        if (kv_gw_codes[i] == status) return i;
    return 7; /* 500 */
}

static void kv_count(kv_gw_conn *c, unsigned status) {
    if (c->counted) return;
    c->counted = true;
    pthread_mutex_lock(&c->g->mu);
    c->g->req_count[c->api][kv_code_index(status)]++;
    pthread_mutex_unlock(&c->g->mu);
}

static enum MHD_Result kv_reply(kv_gw_conn *cn, struct MHD_Connection *c, unsigned status, const char *type,
                                char *body) {
    if (!body) return MHD_NO;
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type);
    MHD_add_response_header(r, "Cache-Control", "no-store");
    if (status == 503) MHD_add_response_header(r, "Retry-After", "1");
    if (cn->paid) {
        char v[32];
        snprintf(v, sizeof v, "%llu", (unsigned long long)cn->paid_res.cost);
        MHD_add_response_header(r, "X-KVR-Cost", v);
    }
    if (status == 401 && cn->api == KV_GW_ANTHROPIC) MHD_add_response_header(r, "WWW-Authenticate", "x-api-key");
    else if (status == 401) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    kv_count(cn, status);
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result kv_reply_err(kv_gw_conn *cn, struct MHD_Connection *c, unsigned status, const char *fmt,
                                    ...) __attribute__((format(printf, 4, 5)));
static enum MHD_Result kv_reply_err(kv_gw_conn *cn, struct MHD_Connection *c, unsigned status, const char *fmt,
                                    ...) {
    char msg[600], clean[1801];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    clean[kv_gw_utf8_clean(msg, strlen(msg), clean)] = 0;
    return kv_reply(cn, c, status, "application/json", kv_gw_error_body(cn->api, status, clean));
}

static bool kv_hung_up(int fd) {
    if (fd < 0) return false;
    struct pollfd pf = {.fd = fd, .events = POLLRDHUP};
    return poll(&pf, 1, 0) > 0 && (pf.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
}

/* Waits until the scheduler is done with r (its work tally is then final). */
static void kv_wait_done(kv_gateway *g, kv_gw_req *r) {
    pthread_mutex_lock(&g->mu);
    while (r->state != KV_REQ_DONE) {
        pthread_cond_signal(&g->work_cv);
        struct timespec ts;
        kv_deadline(&ts, 250);
        pthread_cond_timedwait(&g->out_cv, &g->mu, &ts);
    }
    pthread_mutex_unlock(&g->mu);
}

/* Settles c's payment for the tokens it was given, or releases it whole
 * (failed: nothing is charged for a completion that errs). */
static void kv_pay_end(kv_gw_conn *c, bool failed) {
    kv_gateway *g = c->g;
    if (!g->pay || !c->charge.held) return;
    kv_diag d = {0};
    int rc;
    if (failed || !c->r) {
        rc = kv_gw_pay_release(g->pay, &c->charge, &d);
    } else {
        kv_wait_done(g, c->r); /* its work record is final then, and the scheduler's no more */
        pthread_mutex_lock(&g->mu);
        const int err = c->r->err;
        pthread_mutex_unlock(&g->mu);
        if (err) { /* it failed (its client may have left too): nothing is charged */
            rc = kv_gw_pay_release(g->pay, &c->charge, &d);
        } else {
            const kv_gw_work w = {c->r->products, c->r->work, c->r->n_work};
            rc = kv_gw_pay_settle(g->pay, &c->charge, c->res.completion_tokens, &w, &c->paid_res, &d);
            if (rc == 0) c->paid = true;
        }
    }
    if (rc) fprintf(stderr, "gateway: payment of %s left held (released at the next start): %s\n", c->id, d.msg);
}

/* Turns new tokens into text, waiting for some if none are new. Returns 0,
 * or -1 when the client went away (the request is cancelled then). */
static int kv_advance(kv_gw_conn *c, bool stream) {
    kv_gateway *g = c->g;
    kv_gw_req *r = c->r;
    pthread_mutex_lock(&g->mu);
    bool look = true; /* a hang-up is looked for once per call, and before every wait */
    while (look || (r->n_toks == c->consumed && r->state != KV_REQ_DONE)) {
        look = false;
        if (r->state != KV_REQ_DONE && kv_hung_up(c->fd)) {
            r->cancel = true;
            pthread_cond_signal(&g->work_cv);
            pthread_mutex_unlock(&g->mu);
            return -1;
        }
        if (r->n_toks != c->consumed || r->state == KV_REQ_DONE) break;
        struct timespec ts;
        kv_deadline(&ts, 250);
        pthread_cond_timedwait(&g->out_cv, &g->mu, &ts);
    }
    const uint32_t n = r->n_toks;
    const bool done = r->state == KV_REQ_DONE;
    const enum kv_stop stop = r->stop;
    const int err = r->err;
    char errmsg[256];
    memcpy(errmsg, r->errmsg, sizeof errmsg);
    /* a ring's tokens come with their text (the home decoded them, an
       end-of-generation token as nothing, as below): copied while held */
    char *rp = NULL;
    const uint32_t from = c->consumed;
    if (g->n_ring && n > from && !(rp = malloc(r->poff[n] - r->poff[from] + 1))) {
        pthread_mutex_unlock(&g->mu);
        return -1;
    }
    if (rp) memcpy(rp, r->pbuf + r->poff[from], r->poff[n] - r->poff[from]);
    pthread_mutex_unlock(&g->mu);

    bool stopped = false;
    char pb[KV_TOK_MAX_TOKEN_BYTES];
    while (c->consumed < n && !stopped) {
        const uint32_t i = c->consumed++;
        const int32_t t = r->toks[i];
        c->res.completion_tokens++;
        if (g->n_ring) {
            const uint32_t pn = r->poff[i + 1] - r->poff[i];
            if (pn && kv_gw_text_push(&c->text, rp + (r->poff[i] - r->poff[from]), pn)) {
                free(rp);
                return -1;
            }
            stopped = c->text.stopped;
            continue;
        }
        if (kv_tok_is_eog(g->tok, t)) continue;
        int pn = kv_tok_piece(g->tok, t, false, pb, sizeof pb);
        if (pn > (int)sizeof pb) pn = (int)sizeof pb;
        if (pn > 0 && kv_gw_text_push(&c->text, pb, (size_t)pn)) return -1;
        stopped = c->text.stopped;
    }
    free(rp);
    if (stopped) {
        c->res.finish = KV_GW_FINISH_STOP;
        c->res.stop_seq = c->text.stop[c->text.stop_index];
        pthread_mutex_lock(&g->mu);
        r->cancel = r->state != KV_REQ_DONE; /* the scheduler frees the session before the next step */
        pthread_cond_signal(&g->work_cv);
        pthread_mutex_unlock(&g->mu);
    } else if (done && c->consumed == n) {
        c->res.finish = stop == KV_STOP_MAX_TOKENS || stop == KV_STOP_CTX_FULL || stop == KV_STOP_NONE
                            ? KV_GW_FINISH_LENGTH : KV_GW_FINISH_STOP;
    }
    const bool final = stopped || (done && c->consumed == n);
    char *chunk = NULL;
    size_t cn = 0;
    if (kv_gw_text_take(&c->text, final, &chunk, &cn)) return -1;
    if (final && !stopped && c->text.stopped) { /* a stop string that ends in the last, incomplete character */
        c->res.finish = KV_GW_FINISH_STOP;
        c->res.stop_seq = c->text.stop[c->text.stop_index];
    }
    if (chunk) {
        if (stream) kv_gw_stream_delta(c->api, &c->res, chunk, cn, &c->out);
        else kv_gw_buf_add(&c->full, chunk, cn);
        free(chunk);
    }
    if (final) {
        c->finished = true;
        pthread_mutex_lock(&g->mu);
        g->tokens_completion += c->res.completion_tokens;
        pthread_mutex_unlock(&g->mu);
        if (err && !stopped) {
            kv_pay_end(c, true);
            if (stream) kv_gw_stream_error(c->api, errmsg[0] ? errmsg : kv_err_str(err), &c->out);
            return 1;
        }
        kv_pay_end(c, false); /* before the last bytes go out: a client that saw the end sees it settled */
        if (stream) kv_gw_stream_end(c->api, &c->res, c->p->include_usage, &c->out);
    }
    return 0;
}

static ssize_t kv_stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    kv_gw_conn *c = cls;
    for (;;) {
        if (c->out.oom) return MHD_CONTENT_READER_END_WITH_ERROR;
        if (c->out_off < c->out.n) {
            size_t k = c->out.n - c->out_off;
            if (k > max) k = max;
            memcpy(buf, c->out.p + c->out_off, k);
            c->out_off += k;
            return (ssize_t)k;
        }
        if (c->finished) return MHD_CONTENT_READER_END_OF_STREAM;
        c->out.n = c->out_off = 0;
        if (kv_advance(c, true) < 0) return MHD_CONTENT_READER_END_WITH_ERROR;
    }
}

/* Key check: constant time in the key's bytes. */
static bool kv_key_ok(kv_gateway *g, struct MHD_Connection *c) {
    if (!g->n_keys) return true;
    const char *k = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "x-api-key");
    const char *a = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (a && !strncasecmp(a, "Bearer ", 7)) k = a + 7;
    if (!k) return false;
    const size_t kl = strlen(k);
    bool ok = false;
    for (uint32_t i = 0; i < g->n_keys; i++) {
        const size_t l = strlen(g->keys[i]);
        unsigned diff = (unsigned)(l ^ kl);
        for (size_t j = 0; j < l; j++) diff |= (unsigned char)g->keys[i][j] ^ (unsigned char)(j < kl ? k[j] : 0);
        ok |= diff == 0;
    }
    return ok;
}

/* Who asks: the API key presented (keys are configured and it passed
 * kv_key_ok), or else the client's address (IPv6: its /64), as a keyed hash. */
static uint64_t kv_client_of(kv_gateway *g, struct MHD_Connection *c) {
    uint8_t id[KV_GATEWAY_MAX_KEY_LEN + 2] = {0};
    size_t n = 0;
    if (g->n_keys) {
        const char *k = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "x-api-key");
        const char *a = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
        if (a && !strncasecmp(a, "Bearer ", 7)) k = a + 7;
        if (k) {
            id[0] = 'k';
            n = strlen(k) < sizeof id - 1 ? strlen(k) : sizeof id - 1; /* keys are at most KV_GATEWAY_MAX_KEY_LEN */
            memcpy(id + 1, k, n);
            n++;
        }
    }
    const union MHD_ConnectionInfo *ci = n ? NULL : MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (ci && ci->client_addr && ci->client_addr->sa_family == AF_INET) {
        id[0] = '4';
        memcpy(id + 1, &((const struct sockaddr_in *)ci->client_addr)->sin_addr, 4);
        n = 5;
    } else if (ci && ci->client_addr && ci->client_addr->sa_family == AF_INET6) {
        id[0] = '6';
        memcpy(id + 1, ((const struct sockaddr_in6 *)ci->client_addr)->sin6_addr.s6_addr, 8);
        n = 9;
    }
    uint8_t h[crypto_shorthash_BYTES];
    crypto_shorthash(h, id, n, g->client_salt);
    uint64_t v = 0;
    memcpy(&v, h, sizeof v);
    return v;
}

/* A local request: the prompt tokenized here (the chat template for the
 * chat APIs), paid for when the gateway charges. NULL with *status and d
 * on refusal. */
static kv_gw_req *kv_local_req_new(kv_gw_conn *cn, struct MHD_Connection *c, const kv_gw_params *p, size_t *n_out,
                                   unsigned *status, kv_diag *d) {
    kv_gateway *g = cn->g;
    size_t bytes = p->prompt_len + 16;
    for (size_t i = 0; i < p->n_msgs; i++) bytes += p->msgs[i].len + 16;
    const size_t cap = 3 * bytes + 8;
    int32_t *ids = malloc(cap * sizeof *ids);
    *status = 500;
    if (!ids) return kv_fail(d, KV_ENOMEM, "out of memory"), NULL;
    size_t off = 0, n = 0;
    if (kv_tok_add_bos(g->tok) && kv_tok_bos(g->tok) >= 0) ids[off++] = kv_tok_bos(g->tok);
    int rc = cn->api == KV_GW_OPENAI_TEXT
                 ? kv_tok_encode(g->tok, p->prompt, p->prompt_len, true, ids + off, cap - off, &n, d)
                 : kv_tok_encode_chatml(g->tok, p->msgs, p->n_msgs, true, ids + off, cap - off, &n, d);
    n += off;
    *status = rc == KV_ENOMEM ? 500 : 400;
    if (!rc && n == 0) rc = kv_fail(d, KV_EINVAL, "the prompt is empty");
    if (!rc && n >= g->n_ctx)
        rc = kv_fail(d, KV_ECTXFULL, "the prompt has %zu tokens, more than the context of %u tokens leaves room for "
                     "(at least one must be generated)", n, g->n_ctx);
    if (rc) {
        free(ids);
        return NULL;
    }
    uint32_t max_tokens = p->has_max_tokens ? p->max_tokens : g->o.max_tokens_default;
    if (g->pay) {
        /* paid before any compute: the hold covers the prompt and at least
           one token, and the completion stops at what the max pays for */
        *status = 402;
        const char *hdr = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-KVR-Payment");
        if (kv_gw_pay_hold(g->pay, hdr, n, &max_tokens, &cn->charge, status, d)) {
            free(ids);
            return NULL;
        }
    }
    kv_gw_req *r = calloc(1, sizeof *r);
    const uint32_t room = g->n_ctx - (uint32_t)n;
    if (r) {
        r->cap = (max_tokens < room ? max_tokens : room) + 1;
        r->toks = malloc((size_t)r->cap * sizeof *r->toks);
        r->paid = g->pay != NULL;
        memcpy(r->pay_consumer, cn->charge.a.consumer, 32);
        memcpy(r->pay_nonce, cn->charge.a.nonce, 16);
    }
    if (!r || !r->toks) {
        free(ids);
        if (r) free(r->toks);
        free(r);
        kv_pay_end(cn, true);
        *status = 500;
        return kv_fail(d, KV_ENOMEM, "out of memory"), NULL;
    }
    r->g = g;
    r->api = cn->api;
    r->prompt = ids;
    r->n_prompt = (uint32_t)n;
    r->max_tokens = max_tokens;
    r->so.sample = p->sp;
    if (!p->has_seed) r->so.sample.seed = (uint64_t)time(NULL) ^ ((uint64_t)(uintptr_t)r << 16);
    r->so.max_tokens = max_tokens;
    r->so.ignore_eog = p->ignore_eos;
    *n_out = n;
    return r;
}

/* A ring request: the prompt copied (the raw text, or every message's role
 * and content) for the home to tokenize. NULL on no memory. */
static kv_gw_req *kv_ring_req_new(kv_gateway *g, int api, const kv_gw_params *p) {
    const uint32_t max_tokens = p->has_max_tokens ? p->max_tokens : g->o.max_tokens_default;
    kv_gw_req *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->g = g;
    r->api = api;
    r->max_tokens = max_tokens;
    r->cap = max_tokens + 1;
    size_t bytes = api == KV_GW_OPENAI_TEXT ? p->prompt_len : 0;
    for (size_t i = 0; api != KV_GW_OPENAI_TEXT && i < p->n_msgs; i++) bytes += p->msgs[i].len;
    r->toks = malloc((size_t)r->cap * sizeof *r->toks);
    r->poff = calloc((size_t)r->cap + 1, sizeof *r->poff);
    r->rtext = malloc(bytes + 1);
    if (api != KV_GW_OPENAI_TEXT && p->n_msgs) r->rmsgs = malloc(p->n_msgs * sizeof *r->rmsgs);
    if (!r->toks || !r->poff || !r->rtext || (api != KV_GW_OPENAI_TEXT && p->n_msgs && !r->rmsgs)) {
        free(r->toks);
        free(r->poff);
        free(r->rtext);
        free(r->rmsgs);
        free(r);
        return NULL;
    }
    if (api == KV_GW_OPENAI_TEXT) {
        memcpy(r->rtext, p->prompt, p->prompt_len);
        r->rtext_len = p->prompt_len;
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

static enum MHD_Result kv_generate(kv_gw_conn *cn, struct MHD_Connection *c) {
    kv_gateway *g = cn->g;
    kv_diag d = {0};
    cn->p = calloc(1, sizeof *cn->p);
    if (!cn->p) return kv_reply_err(cn, c, 500, "out of memory");
    /* the parse's memory: reserved whole from the gateway's total first, the
       unused part given back after; what the parsed body holds stays charged
       until the request ends (kv_done) */
    pthread_mutex_lock(&g->mu);
    const bool room = g->parse_live + g->o.parse_max <= g->o.parse_total;
    if (room) g->parse_live += g->o.parse_max;
    else g->parse_refused++;
    pthread_mutex_unlock(&g->mu);
    if (!room)
        return kv_reply_err(cn, c, 503, "the gateway is parsing as many request bodies as its memory allows (%zu bytes); "
                            "retry later", g->o.parse_total);
    bool over = false;
    size_t held = 0;
    const int prc = kv_gw_parse_budget(cn->p, cn->api, cn->body ? cn->body : "", cn->n, g->o.parse_max, &held, &over, &d);
    pthread_mutex_lock(&g->mu);
    g->parse_live -= g->o.parse_max - held;
    cn->parse_charge = held;
    if (over) g->parse_refused++;
    pthread_mutex_unlock(&g->mu);
    if (over) return kv_reply_err(cn, c, 413, "%s", d.msg);
    if (prc) return kv_reply_err(cn, c, 400, "%s", d.msg);
    kv_gw_params *p = cn->p;
    if (p->model && strcmp(p->model, g->model))
        return kv_reply_err(cn, c, 404, "model '%.256s' is not served here (this gateway serves '%s')", p->model,
                            g->model);
    kv_gw_req *r = NULL;
    size_t n = 0;
    if (g->n_ring) {
        if (!(r = kv_ring_req_new(g, cn->api, p))) return kv_reply_err(cn, c, 500, "out of memory");
    } else {
        unsigned status = 0;
        if (!(r = kv_local_req_new(cn, c, p, &n, &status, &d)))
            return kv_reply_err(cn, c, status, "%s", d.msg);
    }
    r->refs = 2;
    r->client = kv_client_of(g, c);
    pthread_mutex_lock(&g->mu);
    if (g->quit || (g->n_queued >= g->o.queue_max && !kv_queue_displace_locked(g, r))) {
        g->rejected_full++;
        r->refs = 1;
        kv_req_unref_locked(r);
        pthread_mutex_unlock(&g->mu);
        kv_pay_end(cn, true);
        return kv_reply_err(cn, c, 503, "the queue is full (%u requests waiting); retry later", g->o.queue_max);
    }
    r->id = ++g->next_id;
    r->state = KV_REQ_QUEUED;
    if (g->queue_tail) g->queue_tail->next = r;
    else g->queue = r;
    g->queue_tail = r;
    g->n_queued++;
    g->tokens_prompt += n;
    pthread_cond_signal(&g->work_cv);
    pthread_mutex_unlock(&g->mu);
    if (g->n_ring) { /* the ring tokenizes: wait for its ACCEPT (or its refusal) before the status line */
        pthread_mutex_lock(&g->mu);
        while (!r->accepted && r->state != KV_REQ_DONE) {
            if (kv_hung_up(cn->fd)) {
                r->cancel = true;
                pthread_cond_signal(&g->work_cv);
                pthread_mutex_unlock(&g->mu);
                cn->r = r; /* kv_done drops the reference */
                return MHD_NO;
            }
            struct timespec ts;
            kv_deadline(&ts, 250);
            pthread_cond_timedwait(&g->out_cv, &g->mu, &ts);
        }
        const bool ok = r->accepted;
        const int err = r->err;
        char msg[256];
        memcpy(msg, r->errmsg, sizeof msg);
        n = r->n_prompt;
        pthread_mutex_unlock(&g->mu);
        cn->r = r;
        if (!ok)
            return kv_reply_err(cn, c, kv_ring_http_status(err), "%s", msg[0] ? msg : kv_err_str(err ? err : KV_EIO));
    }
    cn->r = r;

    static const char *const prefix[KV_GW_API_COUNT] = {"chatcmpl-", "cmpl-", "msg_", "ollama-"};
    snprintf(cn->id, sizeof cn->id, "%skv%llx%llu", prefix[cn->api], (unsigned long long)g->started,
             (unsigned long long)r->id);
    cn->res = (kv_gw_result){.id = cn->id, .model = g->model, .created = (long long)time(NULL),
                             .prompt_tokens = (uint32_t)n};
    kv_gw_text_init(&cn->text, p->stop, p->stop_len, p->n_stop);

    if (p->stream) {
        kv_gw_stream_begin(cn->api, &cn->res, &cn->out);
        struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, kv_stream_read, cn, NULL);
        if (!resp) return MHD_NO;
        MHD_add_response_header(resp, "Content-Type", kv_gw_stream_type(cn->api));
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
        kv_count(cn, 200);
        enum MHD_Result ret = MHD_queue_response(c, 200, resp);
        MHD_destroy_response(resp);
        return ret;
    }
    int a;
    while (!cn->finished)
        if ((a = kv_advance(cn, false)) < 0) return MHD_NO;
        else if (a > 0) {
            pthread_mutex_lock(&g->mu);
            char msg[256];
            memcpy(msg, r->errmsg, sizeof msg);
            const int err = r->err;
            const bool displaced = r->displaced;
            pthread_mutex_unlock(&g->mu);
            if (displaced) return kv_reply_err(cn, c, 503, "%s", msg);
            /* a ring that broke or went out of reach is a 503 (retry later), not a fault here */
            return kv_reply_err(cn, c, g->n_ring ? kv_ring_http_status(err) == 400 ? 500 : kv_ring_http_status(err) : 500,
                                "generation failed: %s", msg);
        }
    if (cn->full.oom) return kv_reply_err(cn, c, 500, "out of memory"); /* settled: it was computed */
    return kv_reply(cn, c, 200, "application/json",
                    kv_gw_full_body(cn->api, &cn->res, cn->full.p ? cn->full.p : "", cn->full.n));
}

static char *kv_metrics_text(kv_gateway *g) {
    kv_gw_buf b = {0};
    char line[256];
#define KV_M(...) kv_gw_buf_add(&b, line, (size_t)snprintf(line, sizeof line, __VA_ARGS__))
    pthread_mutex_lock(&g->mu);
    KV_M("# HELP kvasir_gateway_requests_total HTTP requests answered, by API and status.\n");
    KV_M("# TYPE kvasir_gateway_requests_total counter\n");
    for (int a = 0; a <= KV_GW_API_COUNT; a++)
        for (int k = 0; k < KV_GW_N_CODES; k++)
            if (g->req_count[a][k])
                KV_M("kvasir_gateway_requests_total{api=\"%s\",code=\"%u\"} %llu\n", kv_gw_api_names[a],
                     kv_gw_codes[k], (unsigned long long)g->req_count[a][k]);
    KV_M("# HELP kvasir_gateway_prompt_tokens_total Prompt tokens of admitted requests.\n");
    KV_M("# TYPE kvasir_gateway_prompt_tokens_total counter\n");
    KV_M("kvasir_gateway_prompt_tokens_total %llu\n", (unsigned long long)g->tokens_prompt);
    KV_M("# HELP kvasir_gateway_completion_tokens_total Tokens generated for clients.\n");
    KV_M("# TYPE kvasir_gateway_completion_tokens_total counter\n");
    KV_M("kvasir_gateway_completion_tokens_total %llu\n", (unsigned long long)g->tokens_completion);
    KV_M("# HELP kvasir_gateway_generated_tokens_total Tokens the engine generated for requests.\n");
    KV_M("# TYPE kvasir_gateway_generated_tokens_total counter\n");
    KV_M("kvasir_gateway_generated_tokens_total %llu\n", (unsigned long long)g->tokens_generated);
    KV_M("# HELP kvasir_gateway_cancelled_total Sessions freed because the client went away or a stop string matched.\n");
    KV_M("# TYPE kvasir_gateway_cancelled_total counter\n");
    KV_M("kvasir_gateway_cancelled_total %llu\n", (unsigned long long)g->cancelled);
    KV_M("# HELP kvasir_gateway_rejected_total Requests refused with 503 (queue full).\n");
    KV_M("# TYPE kvasir_gateway_rejected_total counter\n");
    KV_M("kvasir_gateway_rejected_total %llu\n", (unsigned long long)g->rejected_full);
    KV_M("# HELP kvasir_gateway_queue_depth Requests waiting for a session.\n");
    KV_M("# TYPE kvasir_gateway_queue_depth gauge\n");
    KV_M("kvasir_gateway_queue_depth %u\n", g->n_queued);
    KV_M("# HELP kvasir_gateway_active_sessions Sessions in the running batch.\n");
    KV_M("# TYPE kvasir_gateway_active_sessions gauge\n");
    KV_M("kvasir_gateway_active_sessions %u\n", g->n_active);
    KV_M("# HELP kvasir_gateway_max_batch_sessions Most sessions one engine step carried.\n");
    KV_M("# TYPE kvasir_gateway_max_batch_sessions gauge\n");
    KV_M("kvasir_gateway_max_batch_sessions %u\n", g->max_batch);
    KV_M("# HELP kvasir_gateway_step_seconds Engine step (one batched forward pass) wall time.\n");
    KV_M("# TYPE kvasir_gateway_step_seconds histogram\n");
    uint64_t cum = 0;
    for (int k = 0; k < KV_GW_N_BUCKETS; k++) {
        cum += g->step_bucket[k];
        KV_M("kvasir_gateway_step_seconds_bucket{le=\"%g\"} %llu\n", kv_gw_buckets[k], (unsigned long long)cum);
    }
    cum += g->step_bucket[KV_GW_N_BUCKETS];
    KV_M("kvasir_gateway_step_seconds_bucket{le=\"+Inf\"} %llu\n", (unsigned long long)cum);
    KV_M("kvasir_gateway_step_seconds_sum %.6f\n", g->step_sum);
    KV_M("kvasir_gateway_step_seconds_count %llu\n", (unsigned long long)g->steps);
    KV_M("# HELP kvasir_gateway_displaced_total Queued requests displaced (503) by another client's, the queue full.\n");
    KV_M("# TYPE kvasir_gateway_displaced_total counter\n");
    KV_M("kvasir_gateway_displaced_total %llu\n", (unsigned long long)g->displaced);
    KV_M("# HELP kvasir_gateway_parse_refused_total Bodies refused for the memory their JSON needed (413, or 503 when all was reserved).\n");
    KV_M("# TYPE kvasir_gateway_parse_refused_total counter\n");
    KV_M("kvasir_gateway_parse_refused_total %llu\n", (unsigned long long)g->parse_refused);
    KV_M("# HELP kvasir_gateway_parse_bytes Memory parsed request bodies hold (or is reserved for parses).\n");
    KV_M("# TYPE kvasir_gateway_parse_bytes gauge\n");
    KV_M("kvasir_gateway_parse_bytes %zu\n", g->parse_live);
    if (g->guard) {
        kv_http_guard_stats gs;
        kv_http_guard_get_stats(g->guard, &gs);
        KV_M("# HELP kvasir_gateway_connections_closed_total Connections the guard closed or refused, by reason.\n");
        KV_M("# TYPE kvasir_gateway_connections_closed_total counter\n");
        KV_M("kvasir_gateway_connections_closed_total{reason=\"deadline\"} %llu\n", (unsigned long long)gs.expired);
        KV_M("kvasir_gateway_connections_closed_total{reason=\"evicted\"} %llu\n", (unsigned long long)gs.evicted);
        KV_M("kvasir_gateway_connections_closed_total{reason=\"per_ip\"} %llu\n", (unsigned long long)gs.refused_ip);
        KV_M("kvasir_gateway_connections_closed_total{reason=\"full\"} %llu\n", (unsigned long long)gs.refused_full);
        KV_M("# HELP kvasir_gateway_connections_open Connections open now.\n");
        KV_M("# TYPE kvasir_gateway_connections_open gauge\n");
        KV_M("kvasir_gateway_connections_open %u\n", gs.open);
    }
    KV_M("# HELP kvasir_gateway_steps_failed_total Engine steps that failed as a whole.\n");
    KV_M("# TYPE kvasir_gateway_steps_failed_total counter\n");
    KV_M("kvasir_gateway_steps_failed_total %llu\n", (unsigned long long)g->steps_failed);
    if (g->pay) {
        kv_gw_pay_stats ps;
        kv_gw_pay_get_stats(g->pay, &ps);
        KV_M("# HELP kvasir_gateway_kvr_charges_total Paid completions by outcome: held, settled, released, refused (402).\n");
        KV_M("# TYPE kvasir_gateway_kvr_charges_total counter\n");
        KV_M("kvasir_gateway_kvr_charges_total{outcome=\"held\"} %llu\n", (unsigned long long)ps.held);
        KV_M("kvasir_gateway_kvr_charges_total{outcome=\"settled\"} %llu\n", (unsigned long long)ps.settled);
        KV_M("kvasir_gateway_kvr_charges_total{outcome=\"released\"} %llu\n", (unsigned long long)ps.released);
        KV_M("kvasir_gateway_kvr_charges_total{outcome=\"refused\"} %llu\n", (unsigned long long)ps.refused);
        KV_M("# HELP kvasir_gateway_kvr_micro_total micro-KVR settled: cost, of it to nodes and to the treasury.\n");
        KV_M("# TYPE kvasir_gateway_kvr_micro_total counter\n");
        KV_M("kvasir_gateway_kvr_micro_total{to=\"cost\"} %llu\n", (unsigned long long)ps.charged);
        KV_M("kvasir_gateway_kvr_micro_total{to=\"nodes\"} %llu\n", (unsigned long long)ps.to_nodes);
        KV_M("kvasir_gateway_kvr_micro_total{to=\"treasury\"} %llu\n", (unsigned long long)ps.fees);
    }
    if (g->n_ring) {
        uint32_t up = 0, whole = 0;
        for (uint32_t i = 0; i < g->n_ring; i++) {
            up += g->ring_st[i].up;
            whole += g->ring_st[i].up && (g->ring_st[i].st.flags & KV_RING_STATUS_WHOLE);
        }
        KV_M("# HELP kvasir_gateway_ring_nodes_reachable Ring entry nodes that answered the last STATUS.\n");
        KV_M("# TYPE kvasir_gateway_ring_nodes_reachable gauge\n");
        KV_M("kvasir_gateway_ring_nodes_reachable %u\n", up);
        KV_M("# HELP kvasir_gateway_ring_nodes_whole Ring entry nodes that see the ring whole.\n");
        KV_M("# TYPE kvasir_gateway_ring_nodes_whole gauge\n");
        KV_M("kvasir_gateway_ring_nodes_whole %u\n", whole);
    }
    if (g->man) {
        KV_M("# HELP kvasir_gateway_steps_retried_total Failed steps whose sessions were kept for a retry.\n");
        KV_M("# TYPE kvasir_gateway_steps_retried_total counter\n");
        KV_M("kvasir_gateway_steps_retried_total %llu\n", (unsigned long long)g->steps_retried);
        KV_M("# HELP kvasir_gateway_shards_total Shards (expert slabs of MoE layers) the model needs.\n");
        KV_M("# TYPE kvasir_gateway_shards_total gauge\n");
        KV_M("kvasir_gateway_shards_total %u\n", g->cov_total);
        KV_M("# HELP kvasir_gateway_shards_covered Shards whose every expert a worker that is up (or a local slab) serves.\n");
        KV_M("# TYPE kvasir_gateway_shards_covered gauge\n");
        KV_M("kvasir_gateway_shards_covered %u\n", g->cov_covered);
        KV_M("# HELP kvasir_gateway_workers_up Workers handshaken now.\n");
        KV_M("# TYPE kvasir_gateway_workers_up gauge\n");
        KV_M("kvasir_gateway_workers_up %u\n", g->cov_up);
        KV_M("# HELP kvasir_gateway_workers_added_total Workers added from the hub's placement map.\n");
        KV_M("# TYPE kvasir_gateway_workers_added_total counter\n");
        KV_M("kvasir_gateway_workers_added_total %llu\n", (unsigned long long)g->workers_added);
    }
    pthread_mutex_unlock(&g->mu);
#undef KV_M
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    return b.p ? b.p : strdup("");
}

static char *kv_slots_json(kv_gateway *g) {
    json_t *a = json_array();
    pthread_mutex_lock(&g->mu);
    for (int pass = 0; pass < 2; pass++)
        for (kv_gw_req *r = pass ? g->queue : g->active; r; r = r->next) {
            const char *state = pass ? "queued" : r->sst == KV_SESSION_PREFILL ? "prefill" : "decode";
            json_array_append_new(a, json_pack("{s:I,s:s,s:s,s:I,s:I,s:I,s:b}", "id", (json_int_t)r->id, "api",
                                               kv_gw_api_names[r->api], "state", state, "prompt_tokens",
                                               (json_int_t)r->n_prompt, "completion_tokens", (json_int_t)r->n_toks,
                                               "max_tokens", (json_int_t)r->max_tokens, "cancelled", r->cancel));
        }
    json_t *j = json_pack("{s:o,s:I,s:I,s:I}", "slots", a, "active", (json_int_t)g->n_active, "queued",
                          (json_int_t)g->n_queued, "max_active", (json_int_t)g->o.max_active);
    pthread_mutex_unlock(&g->mu);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

/* GET /health: 200 {"status":"ok"} when the model is loaded and, with
 * workers, every shard covered; 503 {"status":"unavailable","reason"}
 * otherwise. With workers both carry the coverage: shards covered / total,
 * workers up, and the first uncovered shards. */
static enum MHD_Result kv_health(kv_gw_conn *cn, struct MHD_Connection *c) {
    kv_gateway *g = cn->g;
    pthread_mutex_lock(&g->mu);
    const bool ok = g->healthy && !g->quit;
    char msg[300];
    snprintf(msg, sizeof msg, "%s", g->health_msg);
    json_t *j = ok ? json_pack("{s:s,s:s}", "status", "ok", "model", g->model)
                   : json_pack("{s:s,s:s,s:s}", "status", "unavailable", "model", g->model, "reason",
                               msg[0] ? msg : "stopping");
    if (j && g->n_ring) { /* what each entry node said last */
        json_t *nodes = json_array();
        for (uint32_t i = 0; i < g->n_ring; i++) {
            const kv_ring_status *st = &g->ring_st[i].st;
            json_t *e = g->ring_st[i].up
                            ? json_pack("{s:s,s:b,s:b,s:I,s:I,s:I,s:I,s:I}", "addr", g->ring[i], "reachable", 1, "whole",
                                        (st->flags & KV_RING_STATUS_WHOLE) != 0, "first", (json_int_t)st->first,
                                        "last", (json_int_t)st->last, "n_layer", (json_int_t)st->n_layer, "n_ctx",
                                        (json_int_t)st->n_ctx, "sequences", (json_int_t)st->n_seqs)
                            : json_pack("{s:s,s:b,s:b}", "addr", g->ring[i], "reachable", 0, "whole", 0);
            const char *why = g->ring_st[i].up ? st->msg : g->ring_st[i].err;
            if (e && why[0]) {
                char clean[3 * sizeof g->ring_st[i].err + 3 * KV_RING_MAX_MSG + 1];
                clean[kv_gw_utf8_clean(why, strlen(why), clean)] = 0;
                json_object_set_new(e, "reason", json_string(clean));
            }
            json_array_append_new(nodes, e);
        }
        json_object_set_new(j, "ring", nodes);
    }
    if (j && g->man) {
        json_t *miss = json_array();
        for (uint32_t i = 0; i < g->cov_n_missing; i++) {
            const kv_manifest_slab *sl = &g->man->slabs[g->cov_missing[i]];
            json_array_append_new(miss, json_pack("{s:I,s:I,s:I}", "layer", (json_int_t)sl->layer, "first",
                                                  (json_int_t)sl->first, "last", (json_int_t)sl->last));
        }
        json_object_set_new(j, "shards_total", json_integer(g->cov_total));
        json_object_set_new(j, "shards_covered", json_integer(g->cov_covered));
        json_object_set_new(j, "workers_up", json_integer(g->cov_up));
        json_object_set_new(j, "missing", miss);
        if (g->cov_total - g->cov_covered > g->cov_n_missing) json_object_set_new(j, "missing_truncated", json_true());
    }
    pthread_mutex_unlock(&g->mu);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return kv_reply(cn, c, ok ? 200 : 503, "application/json", s);
}

static void kv_route_of(kv_gw_conn *cn, const char *method, const char *url) {
    static const struct { const char *m, *u; int route, api; } t[] = {
        {"GET", "/health", KV_R_HEALTH, KV_GW_API_COUNT},
        {"GET", "/metrics", KV_R_METRICS, KV_GW_API_COUNT},
        {"GET", "/v1/models", KV_R_MODELS, KV_GW_OPENAI_CHAT},
        {"GET", "/v1/slots", KV_R_SLOTS, KV_GW_API_COUNT},
        {"GET", "/api/tags", KV_R_TAGS, KV_GW_OLLAMA},
        {"GET", "/v1/prices", KV_R_PRICES, KV_GW_OPENAI_CHAT},
        {"POST", "/v1/chat/completions", KV_R_GEN, KV_GW_OPENAI_CHAT},
        {"POST", "/v1/completions", KV_R_GEN, KV_GW_OPENAI_TEXT},
        {"POST", "/v1/messages", KV_R_GEN, KV_GW_ANTHROPIC},
        {"POST", "/api/chat", KV_R_GEN, KV_GW_OLLAMA},
    };
    cn->route = KV_R_NOTFOUND;
    cn->api = !strncmp(url, "/api/", 5) ? KV_GW_OLLAMA : !strcmp(url, "/v1/messages") ? KV_GW_ANTHROPIC
                                                                                       : KV_GW_API_COUNT;
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (!strcmp(url, t[i].u)) {
            cn->api = t[i].api;
            cn->route = strcmp(method, t[i].m) ? KV_R_METHOD : t[i].route;
            return;
        }
}

static enum MHD_Result kv_handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                 const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    kv_gateway *g = cls;
    kv_gw_conn *cn = *con_cls;
    if (!cn) {
        if (!(cn = calloc(1, sizeof *cn))) return MHD_NO;
        cn->g = g;
        cn->fd = -1;
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        if (ci) cn->fd = ci->connect_fd;
        kv_route_of(cn, method, url);
        *con_cls = cn;
        char why[96];
        if (!kv_http_lengths_ok(c, why, sizeof why)) { /* answered now: the body is not read */
            cn->answered = true;
            return kv_reply_err(cn, c, 400, "the request has %s", why);
        }
        return MHD_YES;
    }
    if (cn->answered) {
        *upload_size = 0;
        return MHD_YES;
    }
    if (*upload_size) {
        if (!cn->too_big && cn->n + *upload_size > g->o.body_max) cn->too_big = true;
        if (!cn->too_big) {
            if (cn->n + *upload_size + 1 > cn->cap) {
                size_t nc = cn->cap * 2 + *upload_size + 1;
                if (nc > g->o.body_max + 1) nc = g->o.body_max + 1;
                char *nb = realloc(cn->body, nc);
                if (!nb) return MHD_NO;
                cn->body = nb;
                cn->cap = nc;
            }
            memcpy(cn->body + cn->n, upload, *upload_size);
            cn->n += *upload_size;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    kv_http_guard_busy(g->guard, c); /* whole: no deadline while it is answered */
    if (cn->route == KV_R_NOTFOUND) return kv_reply_err(cn, c, 404, "no route %.8s %.200s", method, url);
    if (cn->route == KV_R_METHOD) return kv_reply_err(cn, c, 405, "%.8s is not allowed on %.200s", method, url);
    if (cn->too_big)
        return kv_reply_err(cn, c, 413, "the request body is larger than %zu bytes", g->o.body_max);
    const bool open = cn->route == KV_R_HEALTH || cn->route == KV_R_METRICS || cn->route == KV_R_PRICES;
    if (!open && !kv_key_ok(g, c)) return kv_reply_err(cn, c, 401, "missing or invalid API key");
    switch (cn->route) {
    case KV_R_HEALTH: return kv_health(cn, c);
    case KV_R_METRICS: return kv_reply(cn, c, 200, "text/plain; version=0.0.4", kv_metrics_text(g));
    case KV_R_SLOTS: return kv_reply(cn, c, 200, "application/json", kv_slots_json(g));
    case KV_R_PRICES:
        if (!g->pay) return kv_reply_err(cn, c, 404, "this gateway does not charge (started without --ledger)");
        return kv_reply(cn, c, 200, "application/json", kv_gw_pay_prices_json(g->pay));
    case KV_R_MODELS: {
        json_t *j = json_pack("{s:s,s:[{s:s,s:s,s:I,s:s}]}", "object", "list", "data", "id", g->model, "object",
                              "model", "created", (json_int_t)g->started, "owned_by", "kvasir");
        char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
        json_decref(j);
        return kv_reply(cn, c, 200, "application/json", s);
    }
    case KV_R_TAGS: {
        char *kv_gw_ollama_tags(const char *model, long long created, unsigned long long size);
        return kv_reply(cn, c, 200, "application/json", kv_gw_ollama_tags(g->model, g->started, 0));
    }
    default: return kv_generate(cn, c);
    }
}

static void kv_done(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    kv_gateway *g = cls;
    kv_gw_conn *cn = *con_cls;
    kv_http_guard_idle(g->guard, c); /* a kept-alive connection's next request: its deadline starts */
    if (!cn) return;
    if (cn->r) {
        pthread_mutex_lock(&g->mu);
        if (cn->r->state != KV_REQ_DONE) {
            cn->r->cancel = true;
            pthread_cond_signal(&g->work_cv);
        }
        pthread_mutex_unlock(&g->mu);
        kv_pay_end(cn, false); /* the client left: it pays for what it was given */
        pthread_mutex_lock(&g->mu);
        kv_req_unref_locked(cn->r);
        pthread_mutex_unlock(&g->mu);
    }
    kv_pay_end(cn, true); /* held without a request (cannot happen): back whole */
    kv_gw_text_free(&cn->text);
    kv_gw_params_free(cn->p);
    free(cn->p);
    free(cn->out.p);
    free(cn->full.p);
    free(cn->body);
    const size_t freed = cn->parse_charge + cn->cap;
    if (cn->parse_charge) {
        pthread_mutex_lock(&g->mu);
        g->parse_live -= cn->parse_charge;
        pthread_mutex_unlock(&g->mu);
    }
    free(cn);
    *con_cls = NULL;
    kv_http_release_memory(freed >= (1u << 20)); /* after a burst of big bodies RSS falls again */
}

/* ---- life ------------------------------------------------------------- */

int kv_gateway_start(kv_gateway **out, kv_engine *e, const kv_gateway_opts *opts, kv_diag *d) {
    *out = NULL;
    kv_gateway_opts o = opts ? *opts : (kv_gateway_opts){0};
    if (!o.host) o.host = "127.0.0.1";
    if (!o.model_name) o.model_name = "kvasir";
    if (!o.max_active) o.max_active = 16;
    if (!o.queue_max) o.queue_max = 64;
    if (!o.max_conns) o.max_conns = 256;
    if (!o.per_ip_conns) o.per_ip_conns = 16;
    if (!o.timeout_s) o.timeout_s = 120;
    if (!o.request_s) o.request_s = 30;
    if (!o.body_max) o.body_max = 1u << 20;
    if (!o.parse_max) o.parse_max = 4 * o.body_max + (1u << 20);
    if (!o.parse_total) o.parse_total = o.parse_max * 4 > (256u << 20) ? o.parse_max * 4 : (256u << 20);
    if (!o.max_tokens_default) o.max_tokens_default = 512;
    if (!o.step_retry_ms) o.step_retry_ms = 30000;
    if (!o.ring_timeout_ms) o.ring_timeout_ms = 60000;
    if (!o.ring_status_ms) o.ring_status_ms = 1000;
    if (o.n_ring) {
        if (e) return kv_fail(d, KV_EINVAL, "gateway: a ring gateway has no engine of its own");
        if (o.n_ring > KV_GATEWAY_MAX_RING)
            return kv_fail(d, KV_EINVAL, "gateway: %u ring entry nodes, at most %u", o.n_ring, KV_GATEWAY_MAX_RING);
        if (o.hub_url) return kv_fail(d, KV_EINVAL, "gateway: a ring and a hub's placement map are two ways to serve: give one");
        if (o.ledger_path)
            return kv_fail(d, KV_EUNSUPPORTED, "gateway: charging (a ledger) is not supported with a ring yet: the hold "
                           "needs the prompt's token count before the request is sent, and ring nodes sign no receipts");
        for (uint32_t i = 0; i < o.n_ring; i++)
            if (!o.ring_addrs[i] || !*o.ring_addrs[i] || strlen(o.ring_addrs[i]) > 255)
                return kv_fail(d, KV_EINVAL, "gateway: ring entry %u is empty or too long", i);
    } else if (!e) {
        return kv_fail(d, KV_EINVAL, "gateway: an engine or a ring is needed");
    }
    if (o.hub_url && !kv_engine_remote(e))
        return kv_fail(d, KV_EINVAL, "gateway: a hub URL needs an engine whose experts are on workers");
    if (o.body_max > KV_GATEWAY_MAX_BODY) return kv_fail(d, KV_EINVAL, "gateway: body limit %zu is over %u", o.body_max, KV_GATEWAY_MAX_BODY);
    if (o.parse_max > o.parse_total)
        return kv_fail(d, KV_EINVAL, "gateway: parse memory per request (%zu) is over the total (%zu)", o.parse_max, o.parse_total);
    if (o.request_s > 86400) return kv_fail(d, KV_EINVAL, "gateway: request deadline %u s is over a day", o.request_s);
    if (o.n_api_keys > KV_GATEWAY_MAX_KEYS) return kv_fail(d, KV_EINVAL, "gateway: %u keys, at most %u", o.n_api_keys, KV_GATEWAY_MAX_KEYS);
    if (strlen(o.model_name) > KV_GW_MAX_MODEL_LEN) return kv_fail(d, KV_EINVAL, "gateway: model name too long");
    struct sockaddr_storage ss = {0};
    struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
    if (inet_pton(AF_INET, o.host, &s4->sin_addr) == 1) {
        s4->sin_family = AF_INET;
        s4->sin_port = htons(o.port);
    } else if (inet_pton(AF_INET6, o.host, &s6->sin6_addr) == 1) {
        s6->sin6_family = AF_INET6;
        s6->sin6_port = htons(o.port);
    } else {
        return kv_fail(d, KV_EINVAL, "gateway: '%.100s' is not an IPv4 or IPv6 address", o.host);
    }
    kv_gateway *g = calloc(1, sizeof *g);
    if (!g) return kv_fail(d, KV_ENOMEM, "gateway: out of memory");
    g->e = e;
    g->tok = e ? kv_model_tok(kv_engine_model(e)) : NULL;
    g->n_ctx = e ? kv_engine_n_ctx(e) : 0;
    snprintf(g->model, sizeof g->model, "%s", o.model_name);
    g->started = (long long)time(NULL);
    pthread_mutex_init(&g->mu, NULL);
    pthread_mutex_init(&g->caught_mu, NULL);
    pthread_cond_init(&g->work_cv, NULL);
    pthread_cond_init(&g->out_cv, NULL);
    pthread_cond_init(&g->ring_cv, NULL);
    g->hold = o.hold;
    for (uint32_t i = 0; i < o.n_ring; i++)
        if (!(g->ring[g->n_ring++] = strdup(o.ring_addrs[i]))) {
            kv_gateway_free(g);
            return kv_fail(d, KV_ENOMEM, "gateway: out of memory");
        }
    if (sodium_init() < 0) {
        kv_gateway_free(g);
        return kv_fail(d, KV_EINTERNAL, "gateway: libsodium did not initialize");
    }
    randombytes_buf(g->client_salt, sizeof g->client_salt);
    kv_json_budget_install();
    if (o.ring_key_sk) {
        memcpy(g->ring_sk, o.ring_key_sk, 64);
    } else if (o.n_ring) {
        uint8_t pk[32];
        crypto_sign_keypair(pk, g->ring_sk);
    }
    if (o.ring_voucher) {
        g->ring_voucher = *o.ring_voucher;
        g->has_ring_voucher = true;
    }
    o.ring_addrs = NULL;
    o.ring_key_sk = NULL;
    o.ring_voucher = NULL;
    int rc = 0;
    if (o.n_api_keys) {
        if (!(g->keys = calloc(o.n_api_keys, sizeof *g->keys))) { rc = kv_fail(d, KV_ENOMEM, "gateway: out of memory"); goto fail; }
        for (uint32_t i = 0; i < o.n_api_keys; i++) {
            const size_t l = o.api_keys[i] ? strlen(o.api_keys[i]) : 0;
            if (l == 0 || l > KV_GATEWAY_MAX_KEY_LEN) { rc = kv_fail(d, KV_EINVAL, "gateway: API key %u is empty or over %u bytes", i, KV_GATEWAY_MAX_KEY_LEN); goto fail; }
            if (!(g->keys[i] = strdup(o.api_keys[i]))) { rc = kv_fail(d, KV_ENOMEM, "gateway: out of memory"); goto fail; }
            g->n_keys++;
        }
    }
    o.api_keys = NULL;
    o.model_name = g->model;
    o.host = NULL;
    if (e && kv_engine_remote(e)) g->man = kv_remote_manifest(kv_engine_remote(e));
    if (o.hub_url && (rc = kv_gw_watch_start(&g->watch, o.hub_url, o.hub_refresh_ms, d))) goto fail;
    o.hub_url = NULL;
    g->o = o;
    if (o.ledger_path) {
        uint64_t n_rec = 0;
        if ((rc = kv_gw_pay_open(&g->pay, o.ledger_path, o.gateway_key_path, o.gateway_id, o.price_prompt,
                                 o.price_completion, &n_rec, d))) {
            kv_diag_prefix(d, rc, "gateway: ledger");
            goto fail;
        }
        if (n_rec) fprintf(stderr, "gateway: released %llu holds a previous run of %s left\n",
                           (unsigned long long)n_rec, kv_gw_pay_id(g->pay));
    }
    g->o.ledger_path = g->o.gateway_key_path = g->o.gateway_id = NULL; /* the caller's strings */
    kv_sched_health_locked(g); /* before the engine changes hands: /health is right from the start */
    if (g->n_ring) kv_ring_poll(g); /* the same for a ring: the entry nodes asked once now */
    if (pthread_create(&g->sched, NULL, kv_sched_main, g)) { rc = kv_fail(d, KV_EIO, "gateway: cannot start the scheduler"); goto fail; }
    g->sched_up = true;
    if (g->n_ring) {
        if (pthread_create(&g->ring_watch, NULL, kv_ring_watch_main, g)) { rc = kv_fail(d, KV_EIO, "gateway: cannot start the ring watcher"); goto fail; }
        g->ring_watch_up = true;
    }
    const kv_http_guard_opts go = {.max_conns = o.max_conns, .per_ip = o.per_ip_conns, .request_ms = o.request_s * 1000};
    if ((rc = kv_http_guard_open(&g->guard, &go, d))) goto fail;
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL_INTERNAL_THREAD;
    if (ss.ss_family == AF_INET6) flags |= MHD_USE_IPv6;
    /* per-address limits are the guard's (it counts an IPv6 /64 as one client) */
    g->mhd = MHD_start_daemon(flags, 0, kv_http_guard_accept, g->guard, kv_handle, g,
                              MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
                              MHD_OPTION_CONNECTION_LIMIT, kv_http_guard_mhd_limit(g->guard),
                              MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)o.timeout_s,
                              MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)(64 * 1024),
                              MHD_OPTION_NOTIFY_COMPLETED, kv_done, g,
                              MHD_OPTION_NOTIFY_CONNECTION, kv_http_guard_notify, g->guard, MHD_OPTION_END);
    if (!g->mhd) { rc = kv_fail(d, KV_EIO, "gateway: cannot listen on %.100s port %u (in use, or not a local address?)", opts && opts->host ? opts->host : "127.0.0.1", o.port); goto fail; }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(g->mhd, MHD_DAEMON_INFO_BIND_PORT);
    g->port = di ? di->port : o.port;
    *out = g;
    return 0;
fail:
    kv_gateway_free(g);
    return rc;
}

uint16_t kv_gateway_port(const kv_gateway *g) { return g->port; }

void kv_gateway_hold(kv_gateway *g, bool hold) {
    pthread_mutex_lock(&g->mu);
    g->hold = hold;
    pthread_cond_signal(&g->work_cv);
    pthread_mutex_unlock(&g->mu);
}

void kv_gateway_caught(kv_gateway *g, const uint8_t key[32]) {
    static const uint8_t zero[32];
    if (!g || !key || !memcmp(key, zero, 32)) return;
    pthread_mutex_lock(&g->caught_mu);
    bool known = false;
    for (uint32_t i = 0; i < g->n_caught && !known; i++) known = !memcmp(g->caught[i], key, 32);
    if (!known && g->n_caught < KV_REMOTE_MAX_WORKERS) memcpy(g->caught[g->n_caught++], key, 32);
    pthread_mutex_unlock(&g->caught_mu);
}

void kv_gateway_get_stats(kv_gateway *g, kv_gateway_stats *out) {
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&g->mu);
    for (int a = 0; a <= KV_GW_API_COUNT; a++)
        for (int k = 0; k < KV_GW_N_CODES; k++) out->requests += g->req_count[a][k];
    out->completed = g->completed;
    out->cancelled = g->cancelled;
    out->rejected_full = g->rejected_full;
    out->tokens_prompt = g->tokens_prompt;
    out->tokens_completion = g->tokens_completion;
    out->queued = g->n_queued;
    out->active = g->n_active;
    out->displaced = g->displaced;
    out->parse_refused = g->parse_refused;
    out->parse_live = g->parse_live;
    pthread_mutex_unlock(&g->mu);
    if (g->guard) {
        kv_http_guard_stats gs;
        kv_http_guard_get_stats(g->guard, &gs);
        out->conns_evicted = gs.evicted;
        out->conns_expired = gs.expired;
        out->conns_refused = gs.refused_ip + gs.refused_full;
        out->conns_open = gs.open;
    }
}

void kv_gateway_free(kv_gateway *g) {
    if (!g) return;
    if (g->sched_up) {
        pthread_mutex_lock(&g->mu);
        g->quit = true;
        pthread_cond_signal(&g->work_cv);
        pthread_cond_signal(&g->ring_cv);
        pthread_mutex_unlock(&g->mu);
        pthread_join(g->sched, NULL);
    }
    if (g->ring_watch_up) {
        pthread_mutex_lock(&g->mu);
        g->quit = true;
        pthread_cond_signal(&g->ring_cv);
        pthread_mutex_unlock(&g->mu);
        pthread_join(g->ring_watch, NULL);
    }
    for (uint32_t i = 0; i < g->n_ring; i++) free(g->ring[i]);
    sodium_memzero(g->ring_sk, sizeof g->ring_sk);
    if (g->mhd) MHD_stop_daemon(g->mhd); /* every connection ends: their payments are settled or released */
    kv_http_guard_free(g->guard);
    kv_gw_watch_free(g->watch);
    kv_gw_pay_free(g->pay);
    for (uint32_t i = 0; i < g->n_keys; i++) free(g->keys[i]);
    free(g->keys);
    pthread_cond_destroy(&g->work_cv);
    pthread_cond_destroy(&g->out_cv);
    pthread_cond_destroy(&g->ring_cv);
    pthread_mutex_destroy(&g->mu);
    pthread_mutex_destroy(&g->caught_mu);
    free(g);
}

/* ---- keys file -------------------------------------------------------- */

void kv_gateway_keys_free(char **keys, uint32_t n) {
    if (!keys) return;
    for (uint32_t i = 0; i < n; i++) free(keys[i]);
    free(keys);
}

int kv_gateway_keys_load(const char *path, char ***keys, uint32_t *n_keys, kv_diag *d) {
    *keys = NULL;
    *n_keys = 0;
    FILE *f = fopen(path, "r");
    if (!f) return kv_fail(d, KV_EIO, "cannot open API key file '%s': %s", path, strerror(errno));
    char line[KV_GATEWAY_MAX_KEY_LEN + 64];
    char **k = calloc(KV_GATEWAY_MAX_KEYS, sizeof *k);
    uint32_t n = 0, lineno = 0;
    int rc = k ? 0 : kv_fail(d, KV_ENOMEM, "out of memory");
    while (!rc && fgets(line, sizeof line, f)) {
        lineno++;
        size_t l = strlen(line);
        if (l == sizeof line - 1 && line[l - 1] != '\n') { rc = kv_fail(d, KV_EFORMAT, "%s:%u: key over %u bytes", path, lineno, KV_GATEWAY_MAX_KEY_LEN); break; }
        while (l && (line[l - 1] == '\n' || line[l - 1] == '\r' || line[l - 1] == ' ' || line[l - 1] == '\t')) line[--l] = 0;
        char *s = line;
        while (*s == ' ' || *s == '\t') s++;
        if (!*s || *s == '#') continue;
        for (char *q = s; *q; q++)
            if ((unsigned char)*q < 0x21 || (unsigned char)*q == 0x7f) { rc = kv_fail(d, KV_EFORMAT, "%s:%u: a key has a space or control byte", path, lineno); break; }
        if (rc) break;
        if (strlen(s) > KV_GATEWAY_MAX_KEY_LEN) { rc = kv_fail(d, KV_EFORMAT, "%s:%u: key over %u bytes", path, lineno, KV_GATEWAY_MAX_KEY_LEN); break; }
        if (n == KV_GATEWAY_MAX_KEYS) { rc = kv_fail(d, KV_ERANGE, "%s: more than %u keys", path, KV_GATEWAY_MAX_KEYS); break; }
        if (!(k[n] = strdup(s))) { rc = kv_fail(d, KV_ENOMEM, "out of memory"); break; }
        n++;
    }
    fclose(f);
    if (rc) {
        kv_gateway_keys_free(k, n);
        return rc;
    }
    *keys = k;
    *n_keys = n;
    return 0;
}
