/* The gateway's demand reports to its hub (docs/HUB.md "Demand";
 * docs/GATEWAY.md "Demand per shard"): the shared reporter
 * (kvasir/dispatch_demand.h, a thread of its own, every
 * KV_DEMAND_REPORT_MS) fed with what the scheduler copied after its last
 * step (the remote's cumulative counters per manifest slab, and the tokens
 * the engine evaluated); its results go to the gateway's /metrics counters. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/server_internal.h"
#include "kvasir/dispatch_demand.h"

struct kv_gw_demand {
    kv_demand_reporter *rep;
};

/* The snapshot, under the gateway's lock (the scheduler writes both). */
static void kv_gw_demand_snapshot(void *ctx, kv_remote_demand *now, uint64_t *tokens) {
    kv_gateway *g = ctx;
    pthread_mutex_lock(&g->mu);
    if (g->as.demand) memcpy(now, g->as.demand, g->man->n_slabs * sizeof *now);
    *tokens = g->eng.tokens_prefill + g->eng.tokens_decode;
    pthread_mutex_unlock(&g->mu);
}

static void kv_gw_demand_done(void *ctx, int rc, uint64_t tokens, uint64_t computations, uint64_t accepted) {
    kv_gateway *g = ctx;
    (void)tokens;
    (void)computations;
    pthread_mutex_lock(&g->mu);
    if (rc == 0) {
        g->demand_reports++;
        g->demand_tokens_accepted += accepted;
    } else {
        g->demand_report_errors++;
    }
    pthread_mutex_unlock(&g->mu);
}

int kv_gw_demand_start(kv_gw_demand **out, kv_gateway *g, const char *hub, const kv_node_key *key, kv_diag *d) {
    *out = NULL;
    kv_gw_demand *r = calloc(1, sizeof *r);
    if (!r) return kv_fail(d, KV_ENOMEM, "gateway: out of memory");
    const kv_demand_reporter_opts o = {.hub = hub, .key = key, .m = g->man, .snapshot = kv_gw_demand_snapshot,
                                       .done = kv_gw_demand_done, .ctx = g, .who = "gateway",
                                       .log = g->o.quiet ? NULL : stderr};
    const int rc = kv_demand_reporter_start(&r->rep, &o, d);
    if (rc) {
        free(r);
        return rc;
    }
    *out = r;
    return 0;
}

void kv_gw_demand_free(kv_gw_demand *r) {
    if (!r) return;
    kv_demand_reporter_free(r->rep);
    free(r);
}
