/* The gateway's scheduler (server_internal.h): one thread that owns the
 * engine. It admits queued requests as sessions between steps, fairly
 * between clients (the one with the fewest sessions running first), steps
 * the engine, publishes each session's new token to its request, frees the
 * sessions whose client left or whose stop string matched, adds the workers
 * of the hub's placement map between steps, and keeps /health's view of the
 * workers' coverage. A step that fails as a whole is retried for a while
 * (its sessions kept) when the engine's experts are on workers. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/server_internal.h"
#include "kvasir/dispatch_receipt.h"
#include "kvasir/grammar.h"

static bool kv_gw_is_caught(kv_gateway *g, const uint8_t key[32]) {
    pthread_mutex_lock(&g->caught_mu);
    bool hit = false;
    for (uint32_t i = 0; i < g->n_caught && !hit; i++) hit = !memcmp(g->caught[i], key, 32);
    pthread_mutex_unlock(&g->caught_mu);
    return hit;
}

/* ---- requests --------------------------------------------------------- */

void kv_gw_req_unref_locked(kv_gw_req *r) {
    if (--r->refs > 0) return;
    free(r->rgrammar);
    free(r->rbias);
    free(r->work);
    free(r->rcpts);
    free(r->prompt);
    free(r->toks);
    kv_grammar_free(r->grammar);
    free(r->lps);
    free(r->plps);
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

void kv_gw_req_finish_locked(kv_gateway *g, kv_gw_req *r, int err, const char *msg) {
    if (r->s) {
        if (r->paid && !err) kv_req_record_work(g, r); /* who to pay (a failed one is released) */
        r->stop = r->script && r->n_toks >= r->script->n ? KV_STOP_EOG : kv_session_stop_reason(r->s);
        kv_session_free(r->s);
        r->s = NULL;
    }
    if (err) {
        r->err = err;
        snprintf(r->errmsg, sizeof r->errmsg, "%.*s", (int)sizeof r->errmsg - 1, msg); /* a diag's: cut to fit */
    } else {
        g->completed++;
    }
    r->state = KV_REQ_DONE;
    kv_gw_req_unref_locked(r);
}

static double kv_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

void kv_gw_deadline(struct timespec *ts, long ms) {
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

/* The remote set's hedge counters into g (for /metrics). Read after every
 * step as well as with the health: a completion's hedges are counted by the
 * time its last token is out, not only once the scheduler next idles. */
static void kv_sched_hedges_locked(kv_gateway *g, kv_remote *rm) {
    kv_remote_get_hedges(rm, &g->hedges, &g->hedges_won, &g->late_answers);
    g->hedged_pairs = kv_remote_hedged_pairs(rm);
    g->hedges_cancelled = kv_remote_hedges_cancelled(rm);
    kv_remote_get_sigs(rm, &g->sigs_checked, &g->sigs_deferred);
}

/* Health as the scheduler sees it: with workers, every shard (slab of a
 * MoE layer) must have each of its experts served by a worker that is up
 * (handshaken, its slabs' hashes checked) or by a local slab. */
void kv_gw_sched_health_locked(kv_gateway *g) {
    if (g->n_ring || !g->e) return; /* the ring's watcher keeps it; without either the model cannot run */
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
    kv_sched_hedges_locked(g, rm);
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
kv_gw_req *kv_gw_queue_pick_locked(kv_gateway *g) {
    kv_gw_req *best = NULL, *best_prev = NULL;
    uint32_t best_active = UINT32_MAX;
    for (kv_gw_req *r = g->queue, *prev = NULL; r && best_active; prev = r, r = r->next) {
        if (r->lead && r->lead->state != KV_REQ_DONE &&
            (r->lead->state != KV_REQ_ACTIVE || r->lead->sst == KV_SESSION_IDLE || r->lead->sst == KV_SESSION_PREFILL))
            continue; /* its first choice's prompt is not in the cache yet */
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
bool kv_gw_queue_displace_locked(kv_gateway *g, const kv_gw_req *r) {
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
    kv_gw_req_unref_locked(victim);
    pthread_cond_broadcast(&g->out_cv);
    return true;
}

/* Publishes token t (and its log-probability when asked: lp NULL unknown). */
static void kv_req_publish_locked(kv_gateway *g, kv_gw_req *r, int32_t t, const kv_token_logprob *lp) {
    if (r->lps) { /* before n_toks shows it: readers take [0, n_toks) unlocked */
        if (lp) r->lps[r->n_toks] = *lp;
        else r->lps[r->n_toks] = (kv_token_logprob){.token = -1};
    }
    r->toks[r->n_toks++] = t;
    g->tokens_generated++;
}

/* r's reasoning used its budget: its family's end of reasoning goes into
 * the output as if sampled (kv_session_force) and is published, as much of
 * it as max_tokens leaves room for (the rest cut: the request then ends
 * there, r->cut). Their log-probabilities are NaN (no draw: null in the
 * APIs' shapes). Returns 0 or
 * the session's error (d). */
static int kv_req_force_locked(kv_gateway *g, kv_gw_req *r, kv_diag *d) {
    kv_gw_budget *b = &r->budget;
    kv_gw_budget_forced(b);
    const uint32_t limit = r->cap - 1; /* max_tokens, or what the context leaves */
    const uint32_t room = limit > r->n_toks ? limit - r->n_toks : 0;
    const uint32_t n = b->n_forced < room ? b->n_forced : room;
    if (n < b->n_forced) {
        r->cut = true;
    } else {
        const int rc = kv_session_force(r->s, b->forced, n, d);
        if (rc) return rc;
    }
    for (uint32_t i = 0; i < n; i++)
        kv_req_publish_locked(g, r, b->forced[i], &(kv_token_logprob){.token = b->forced[i], .logprob = NAN});
    return 0;
}

static void kv_sched_admit_locked(kv_gateway *g, kv_gw_req *r) {
    kv_diag d = {0};
    kv_session *s = NULL;
    int rc = kv_session_new(&s, g->e, &r->so, &d);
    /* structured output; a later choice samples under its lead's grammar (the lead outlives it) */
    const struct kv_grammar *gram = r->grammar ? r->grammar : r->lead ? r->lead->grammar : NULL;
    if (!rc && gram) rc = kv_session_set_grammar(s, gram, &d);
    if (!rc) rc = kv_session_prompt(s, r->prompt, r->n_prompt, &d);
    free(r->prompt);
    r->prompt = NULL;
    r->s = s;
    if (!rc && kv_gw_budget_due(&r->budget)) rc = kv_req_force_locked(g, r, &d); /* a budget of 0 */
    if (rc) {
        kv_session_free(s);
        r->s = NULL;
        kv_gw_req_finish_locked(g, r, rc, d.msg);
        return;
    }
    r->state = KV_REQ_ACTIVE;
    r->sst = kv_session_status(s);
    r->next = NULL;
    kv_gw_req **pp = &g->active;
    while (*pp) pp = &(*pp)->next;
    *pp = r;
    g->n_active++;
}

void *kv_gw_sched_main(void *arg) {
    kv_gateway *g = arg;
    if (g->n_ring) return kv_gw_sched_ring(g);
    if (!g->e) { /* the model cannot run: every prompt is refused before it queues; wait to stop */
        pthread_mutex_lock(&g->mu);
        while (!g->quit) pthread_cond_wait(&g->work_cv, &g->mu);
        pthread_mutex_unlock(&g->mu);
        return NULL;
    }
    kv_engine_stats es0;
    kv_engine_get_stats(g->e, &es0);
    pthread_mutex_lock(&g->mu);
    g->eng = es0;
    kv_gw_sched_health_locked(g);
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
            kv_gw_req_unref_locked(r);
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
            kv_gw_req_finish_locked(g, r, 0, NULL);
            g->completed--; /* it did not run to its end */
        }
        /* join: queued requests, oldest first, while there is room */
        for (kv_gw_req *q; !g->hold && g->queue && g->n_active < g->o.max_active && (q = kv_gw_queue_pick_locked(g));)
            kv_sched_admit_locked(g, q);
        pthread_cond_broadcast(&g->out_cv);
        kv_sched_placement_locked(g);
        if (!g->active) {
            struct timespec ts;
            kv_remote *rm = kv_engine_remote(g->e);
            kv_gw_deadline(&ts, rm ? 100 : 1000);
            pthread_cond_timedwait(&g->work_cv, &g->mu, &ts);
            if (rm) { /* idle: reconnects and handshakes go on, closed peers are seen */
                pthread_mutex_unlock(&g->mu);
                kv_remote_tend(rm, 10);
                pthread_mutex_lock(&g->mu);
            }
            kv_gw_sched_health_locked(g);
            kv_gw_autoscale_idle_locked(g);
            continue;
        }
        if (g->n_active > g->max_batch) g->max_batch = g->n_active;
        pthread_mutex_unlock(&g->mu);
        kv_diag d = {0};
        const double t0 = kv_now();
        const int rc = kv_engine_step(g->e, &d);
        const double dt = kv_now() - t0;
        kv_engine_stats es;
        kv_engine_get_stats(g->e, &es); /* the engine is this thread's: /metrics reads the copy */
        pthread_mutex_lock(&g->mu);
        g->eng = es;
        kv_gw_metrics_step_locked(g, dt);
        if (rc >= 0) kv_gw_autoscale_step_locked(g, dt);
        kv_remote *rm = kv_engine_remote(g->e);
        if (rm) kv_sched_hedges_locked(g, rm); /* before any request of the step finishes */
        if (rc < 0 && rm && (g->fail_since == 0 || kv_now() - g->fail_since < g->o.step_retry_ms / 1000.0)) {
            /* the step failed as a whole (no session advanced): an expert
               whose holders are all gone. Keep the sessions and retry once
               the placement is read again: a replacement, or a holder back */
            g->steps_failed++;
            g->steps_retried++;
            if (g->fail_since == 0) g->fail_since = kv_now();
            kv_gw_watch_kick(g->watch);
            kv_gw_sched_health_locked(g);
            pthread_mutex_unlock(&g->mu);
            kv_remote_tend(rm, 0);
            pthread_mutex_lock(&g->mu);
            struct timespec ts;
            kv_gw_deadline(&ts, 200);
            pthread_cond_timedwait(&g->work_cv, &g->mu, &ts);
            continue;
        }
        if (rc >= 0 && g->fail_since != 0) {
            g->fail_since = 0;
            kv_gw_sched_health_locked(g);
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
                kv_gw_req_finish_locked(g, r, rc, d.msg);
            }
            kv_gw_sched_health_locked(g);
            continue;
        }
        for (kv_gw_req **pp = &g->active; *pp;) {
            kv_gw_req *r = *pp;
            int32_t t = kv_session_token(r->s);
            if (r->script) t = t >= 0 && r->n_toks < r->script->n ? r->script->toks[r->n_toks] : -1; /* TEST ONLY */
            kv_diag fd = {0};
            int frc = 0;
            if (t >= 0 && r->plps && !r->n_plps) { /* the prompt is evaluated: its log-probabilities */
                uint32_t np = 0;
                const kv_token_logprob *pl = kv_session_prompt_logprobs(r->s, &np);
                if (np > r->n_prompt) np = r->n_prompt;
                if (pl && np) memcpy(r->plps, pl, (size_t)np * sizeof *pl);
                if (np) r->plps[0] = (kv_token_logprob){.token = r->prompt0, .logprob = NAN}; /* nothing before it */
                r->n_plps = np;
            }
            if (t >= 0 && r->n_toks < r->cap) {
                kv_req_publish_locked(g, r, t, r->script ? NULL : kv_session_logprob(r->s));
                if (kv_gw_budget_see(&r->budget, g->tok, t) && kv_session_status(r->s) == KV_SESSION_DECODE)
                    frc = kv_req_force_locked(g, r, &fd); /* the reasoning's budget is spent */
            }
            const enum kv_session_status st = kv_session_status(r->s);
            r->sst = st;
            kv_session_stats ss;
            kv_session_get_stats(r->s, &ss);
            r->n_cached = ss.n_cached;
            if (st == KV_SESSION_DONE || st == KV_SESSION_FAILED || r->n_toks >= r->cap || r->cut || frc ||
                (r->script && r->n_toks >= r->script->n)) {
                kv_diag sd = {0};
                const int err = frc ? frc : st == KV_SESSION_FAILED ? kv_session_error(r->s, &sd) : 0;
                if (frc) sd = fd;
                *pp = r->next;
                g->n_active--;
                kv_gw_req_finish_locked(g, r, err ? err : 0, sd.msg);
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
        kv_gw_req_unref_locked(r);
    }
    g->queue_tail = NULL;
    g->n_queued = 0;
    while (g->active) {
        kv_gw_req *r = g->active;
        g->active = r->next;
        kv_gw_req_finish_locked(g, r, KV_EIO, "the gateway is shutting down");
    }
    g->n_active = 0;
    pthread_cond_broadcast(&g->out_cv);
    pthread_mutex_unlock(&g->mu);
    return NULL;
}
