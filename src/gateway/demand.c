/* The gateway's demand reports to its hub (docs/HUB.md "Demand";
 * docs/GATEWAY.md "Demand per shard"): a thread of its own, because a
 * report is a blocking HTTP request. Every KV_GW_DEMAND_MS it takes what the
 * scheduler copied after its last step (the remote's cumulative counters per
 * manifest slab, and the tokens the engine evaluated), subtracts what the
 * hub last accepted, and posts the difference signed by the coordinator key
 * (kv_hub_report_demand). Only an accepted report moves the baseline, so a
 * report the hub could not take is carried into the next one; the hub
 * bounds what it counts (its budget per key, computations per token). */
#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gateway/server_internal.h"
#include "kvasir/hub.h"

#define KV_GW_DEMAND_MS 5000 /* between two reports */

struct kv_gw_demand {
    kv_gateway *g;                /* borrowed */
    char *hub;                    /* the hub's URL (copied) */
    kv_node_key key;              /* the coordinator key (copied; the counter is ours from now on) */
    pthread_t th;
    bool th_up;
    pthread_mutex_t mu;           /* stop, cv */
    pthread_cond_t cv;
    bool stop;
    size_t n;                     /* manifest slabs */
    kv_remote_demand *now, *base; /* [n] snapshot / accepted so far */
    uint64_t tokens_now, tokens_base;
    kv_hub_demand_shard *sh;      /* [n] the report being built */
    int last_rc;                  /* of the last report (a failure is said once until it changes) */
};

/* One report of what grew since the last accepted one; 0 when nothing did. */
static void kv_gw_demand_report(kv_gw_demand *r) {
    kv_gateway *g = r->g;
    pthread_mutex_lock(&g->mu);
    if (g->as.demand) memcpy(r->now, g->as.demand, r->n * sizeof *r->now);
    r->tokens_now = g->eng.tokens_prefill + g->eng.tokens_decode;
    pthread_mutex_unlock(&g->mu);
    if (r->tokens_now <= r->tokens_base) return;
    const kv_manifest *m = g->man;
    size_t k = 0;
    for (size_t i = 0; i < r->n; i++) {
        const uint64_t c = r->now[i].computations - r->base[i].computations;
        if (!c) continue;
        r->sh[k++] = (kv_hub_demand_shard){m->slabs[i].layer, m->slabs[i].first, m->slabs[i].last, c,
                                           r->now[i].wait_us - r->base[i].wait_us};
    }
    const kv_hub_demand rep = {r->tokens_now - r->tokens_base, r->sh, k};
    kv_diag d = {0};
    uint64_t acc = 0;
    const int rc = kv_hub_report_demand(r->hub, &r->key, &rep, &acc, &d);
    pthread_mutex_lock(&g->mu);
    if (rc == 0) {
        g->demand_reports++;
        g->demand_tokens_accepted += acc;
    } else {
        g->demand_report_errors++;
    }
    pthread_mutex_unlock(&g->mu);
    if (rc == 0) {
        memcpy(r->base, r->now, r->n * sizeof *r->base);
        r->tokens_base = r->tokens_now;
    } else if (rc != r->last_rc && !g->o.quiet) {
        fprintf(stderr, "gateway: demand report to %s: %s (kept for the next one)\n", r->hub, d.msg);
    }
    r->last_rc = rc;
}

static void *kv_gw_demand_main(void *arg) {
    kv_gw_demand *r = arg;
    pthread_mutex_lock(&r->mu);
    while (!r->stop) {
        struct timespec ts;
        kv_gw_deadline(&ts, KV_GW_DEMAND_MS);
        pthread_cond_timedwait(&r->cv, &r->mu, &ts);
        if (r->stop) break;
        pthread_mutex_unlock(&r->mu);
        kv_gw_demand_report(r);
        pthread_mutex_lock(&r->mu);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

int kv_gw_demand_start(kv_gw_demand **out, kv_gateway *g, const char *hub, const kv_node_key *key, kv_diag *d) {
    *out = NULL;
    kv_gw_demand *r = calloc(1, sizeof *r);
    if (!r) return kv_fail(d, KV_ENOMEM, "gateway: out of memory");
    r->g = g;
    r->key = *key;
    r->n = g->man->n_slabs;
    r->hub = strdup(hub);
    r->now = calloc(r->n ? r->n : 1, sizeof *r->now);
    r->base = calloc(r->n ? r->n : 1, sizeof *r->base);
    r->sh = calloc(r->n ? r->n : 1, sizeof *r->sh);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    if (!r->hub || !r->now || !r->base || !r->sh) {
        kv_gw_demand_free(r);
        return kv_fail(d, KV_ENOMEM, "gateway: out of memory");
    }
    if (pthread_create(&r->th, NULL, kv_gw_demand_main, r)) {
        kv_gw_demand_free(r);
        return kv_fail(d, KV_EIO, "gateway: cannot start the demand reporter");
    }
    r->th_up = true;
    *out = r;
    return 0;
}

void kv_gw_demand_free(kv_gw_demand *r) {
    if (!r) return;
    if (r->th_up) {
        pthread_mutex_lock(&r->mu);
        r->stop = true;
        pthread_cond_signal(&r->cv);
        pthread_mutex_unlock(&r->mu);
        pthread_join(r->th, NULL); /* a report in flight ends within its 10 s */
    }
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    sodium_memzero(&r->key, sizeof r->key);
    free(r->hub);
    free(r->now);
    free(r->base);
    free(r->sh);
    free(r);
}
