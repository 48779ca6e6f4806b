/* The gateway's view of a hub's placement map: a thread that reads
 * GET HUB/v1/placement every refresh_ms (at once when kicked: a step
 * failed, a worker may have been replaced) and keeps the latest list of
 * live node addresses for the scheduler to take between steps.
 *
 * Invariants: an answer is bounded (KV_NODE_MAX_MARKET bytes) and parsed by
 * the fuzzed placement parser (kv_node_placement_parse: each address with
 * the node key it must prove; an invalid or conflicting entry is skipped,
 * said once on stderr, never the whole map); a failed read keeps the last
 * good list and records why. The thread never touches the engine:
 * only the scheduler (the engine's owner) applies a list. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gateway/gateway_internal.h"
#include "kvasir/hub.h"
#include "kvasir/node.h"

struct kv_gw_watch {
    char url[1024];          /* HUB/v1/placement */
    uint32_t refresh_ms;
    pthread_t th;
    bool th_up;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* guarded by mu */
    bool quit, kicked, fresh;
    char **addrs;            /* [n_addrs] latest list (owned) */
    uint8_t (*keys)[32];     /* [n_addrs] the key placement lists for each (zero: none) */
    uint32_t n_addrs;
    uint64_t reads, failures;
    char err[256];           /* why the last read failed, "" after a good one */
    /* the watch thread's own */
    char note[256];          /* the last map's first skipped entry (kv_placement.note) */
};

static void kv_watch_deadline(struct timespec *ts, long ms) {
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

static void *kv_watch_main(void *arg) {
    kv_gw_watch *w = arg;
    pthread_mutex_lock(&w->mu);
    while (!w->quit) {
        w->kicked = false;
        pthread_mutex_unlock(&w->mu);
        kv_diag d = {0};
        char *body = NULL, **addrs = NULL;
        uint8_t (*keys)[32] = NULL;
        size_t len = 0;
        long st = 0;
        uint32_t n = 0;
        int rc = kv_hub_http_get(w->url, KV_NODE_MAX_MARKET, 5000, &body, &len, &st, &d);
        if (!rc && st != 200) rc = kv_fail(&d, KV_EIO, "%s: status %ld", w->url, st);
        kv_placement pl = {0};
        if (!rc) rc = kv_node_placement_parse(body, len, &pl, &d);
        if (!rc) { /* the addresses and their keys, taken from pl */
            kv_diag rd = {0}; /* relayed nodes: dialed through the hub's relay (kvasir/relay.h, "routes") */
            if (kv_node_relay_routes(w->url, &pl, &rd) < 0 && !pl.note[0])
                snprintf(pl.note, sizeof pl.note, "%.250s", rd.msg);
            addrs = pl.addr;
            keys = pl.key;
            n = pl.n_addr;
            pl.addr = NULL;
            pl.key = NULL;
            pl.n_addr = 0;
            if (pl.note[0] && strcmp(pl.note, w->note)) /* a new kind of bad entry: said once */
                fprintf(stderr, "kvasir gateway: placement: %u entries skipped, %u addresses listed with two keys "
                        "dropped, %u holders over %u per shard (first: %s)\n", pl.n_skipped, pl.n_conflicts, pl.n_over,
                        KV_PLACEMENT_MAX_REPLICAS, pl.note);
            snprintf(w->note, sizeof w->note, "%s", pl.note);
        }
        kv_node_placement_free(&pl);
        free(body);
        pthread_mutex_lock(&w->mu);
        w->reads++;
        if (rc) {
            w->failures++;
            snprintf(w->err, sizeof w->err, "%.250s", d.msg);
        } else {
            kv_node_workers_free(w->addrs, w->n_addrs);
            free(w->keys);
            w->addrs = addrs;
            w->keys = keys;
            w->n_addrs = n;
            w->fresh = true;
            w->err[0] = 0;
        }
        if (w->quit) break;
        if (!w->kicked) {
            struct timespec ts;
            kv_watch_deadline(&ts, w->refresh_ms);
            pthread_cond_timedwait(&w->cv, &w->mu, &ts);
        }
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

int kv_gw_watch_start(kv_gw_watch **out, const char *hub_url, uint32_t refresh_ms, kv_diag *d) {
    *out = NULL;
    kv_gw_watch *w = calloc(1, sizeof *w);
    if (!w) return kv_fail(d, KV_ENOMEM, "gateway: out of memory");
    size_t l = strlen(hub_url);
    while (l && hub_url[l - 1] == '/') l--;
    if (!l || l + sizeof "/v1/placement" > sizeof w->url) {
        free(w);
        return kv_fail(d, KV_EINVAL, "gateway: hub URL '%.100s' is empty or too long", hub_url);
    }
    snprintf(w->url, sizeof w->url, "%.*s/v1/placement", (int)l, hub_url);
    w->refresh_ms = refresh_ms ? refresh_ms : 2000;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    if (pthread_create(&w->th, NULL, kv_watch_main, w)) {
        kv_gw_watch_free(w);
        return kv_fail(d, KV_EIO, "gateway: cannot start the placement thread");
    }
    w->th_up = true;
    *out = w;
    return 0;
}

void kv_gw_watch_kick(kv_gw_watch *w) {
    if (!w) return;
    pthread_mutex_lock(&w->mu);
    w->kicked = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

bool kv_gw_watch_take(kv_gw_watch *w, char ***addrs, uint8_t (**keys)[32], uint32_t *n) {
    *addrs = NULL;
    *keys = NULL;
    *n = 0;
    if (!w) return false;
    pthread_mutex_lock(&w->mu);
    const bool fresh = w->fresh;
    if (fresh) {
        *addrs = w->addrs;
        *keys = w->keys;
        *n = w->n_addrs;
        w->addrs = NULL;
        w->keys = NULL;
        w->n_addrs = 0;
        w->fresh = false;
    }
    pthread_mutex_unlock(&w->mu);
    return fresh;
}

void kv_gw_watch_info(kv_gw_watch *w, uint64_t *reads, uint64_t *failures, char *err, size_t cap) {
    pthread_mutex_lock(&w->mu);
    *reads = w->reads;
    *failures = w->failures;
    snprintf(err, cap, "%s", w->err);
    pthread_mutex_unlock(&w->mu);
}

void kv_gw_watch_free(kv_gw_watch *w) {
    if (!w) return;
    if (w->th_up) {
        pthread_mutex_lock(&w->mu);
        w->quit = true;
        pthread_cond_signal(&w->cv);
        pthread_mutex_unlock(&w->mu);
        pthread_join(w->th, NULL);
    }
    kv_node_workers_free(w->addrs, w->n_addrs);
    free(w->keys);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w);
}
