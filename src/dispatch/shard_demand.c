/* Demand per shard for every coordinator (include/kvasir/dispatch_demand.h):
 * a counting wrapper for in-process expert providers, the report of what
 * grew since the last accepted one, and the reporter thread the gateway and
 * ring windows share.
 *
 * Invariants: the meter counts only calls that succeeded, each (token,
 * expert) pair once, and a slab's wait once per call (the call's duration);
 * expert ids are checked against n_expert before they index anything. The
 * reporter moves its baseline only past a report the hub accepted, and its
 * key copy is used by its thread alone (the request counter is per copy).
 * Hot path: the meter's compute adds a loop over the call's slots. */
#include <pthread.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvasir/dispatch_demand.h"

/* ---- the meter ------------------------------------------------------------ */

struct kv_demand_meter {
    kv_expert_provider inner;     /* the provider counted (borrowed impl) */
    kv_expert_provider self;      /* the counting provider handed out */
    const kv_manifest *m;         /* borrowed */
    uint32_t n_layer, n_expert;
    int32_t *slab_of;             /* [n_layer * n_expert] manifest slab of each expert, -1 none */
    uint64_t *n, *wait_us;        /* [n_slabs] computations / microseconds waited */
    uint64_t *mark;               /* [n_slabs] the call that last counted the slab's wait */
    uint64_t calls;               /* successful compute calls */
};

static double kv_dm_mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int kv_dm_compute(void *impl, const kv_expert_req *req, float *out, kv_diag *d) {
    kv_demand_meter *dm = impl;
    const double t0 = kv_dm_mono();
    const int rc = dm->inner.compute(dm->inner.impl, req, out, d);
    if (rc) return rc; /* a failed call produced nothing */
    const double w = kv_dm_mono() - t0;
    const uint64_t w_us = w > 0 ? (uint64_t)(w * 1e6) : 0;
    dm->calls++;
    if (req->layer >= dm->n_layer) return 0;
    const size_t n_slots = (size_t)req->n_tokens * req->n_used, base = (size_t)req->layer * dm->n_expert;
    for (size_t s = 0; s < n_slots; s++) {
        const int32_t e = req->ids[s];
        if (e < 0 || (uint32_t)e >= dm->n_expert) continue;
        const int32_t sl = dm->slab_of[base + (uint32_t)e];
        if (sl < 0) continue;
        dm->n[sl]++;
        if (dm->mark[sl] != dm->calls) { /* every slab of the call was answered when it returned */
            dm->mark[sl] = dm->calls;
            dm->wait_us[sl] += w_us;
        }
    }
    return 0;
}

static void kv_dm_noop_free(void *impl) { (void)impl; }

int kv_demand_meter_new(kv_demand_meter **out, const kv_expert_provider *inner, const kv_manifest *m, kv_diag *d) {
    *out = NULL;
    kv_demand_meter *dm = calloc(1, sizeof *dm);
    const size_t ns = m->n_slabs ? m->n_slabs : 1, ne = (size_t)m->n_layer * m->n_expert;
    if (!dm) return kv_fail(d, KV_ENOMEM, "demand: out of memory");
    dm->inner = *inner;
    dm->m = m;
    dm->n_layer = m->n_layer;
    dm->n_expert = m->n_expert;
    dm->slab_of = malloc((ne ? ne : 1) * sizeof *dm->slab_of);
    dm->n = calloc(ns, sizeof *dm->n);
    dm->wait_us = calloc(ns, sizeof *dm->wait_us);
    dm->mark = calloc(ns, sizeof *dm->mark);
    if (!dm->slab_of || !dm->n || !dm->wait_us || !dm->mark) {
        kv_demand_meter_free(dm);
        return kv_fail(d, KV_ENOMEM, "demand: out of memory");
    }
    for (size_t i = 0; i < ne; i++) dm->slab_of[i] = -1;
    for (size_t i = 0; i < m->n_slabs; i++) {
        const kv_manifest_slab *s = &m->slabs[i];
        if (s->layer >= m->n_layer) continue;
        for (uint32_t e = s->first; e <= s->last && e < m->n_expert; e++)
            dm->slab_of[(size_t)s->layer * m->n_expert + e] = (int32_t)i;
    }
    dm->self = (kv_expert_provider){dm, kv_dm_compute, kv_dm_noop_free, inner->name};
    *out = dm;
    return 0;
}

void kv_demand_meter_free(kv_demand_meter *dm) {
    if (!dm) return;
    free(dm->slab_of);
    free(dm->n);
    free(dm->wait_us);
    free(dm->mark);
    free(dm);
}

const kv_expert_provider *kv_demand_meter_provider(kv_demand_meter *dm) { return &dm->self; }

size_t kv_demand_meter_get(const kv_demand_meter *dm, kv_remote_demand *out, size_t cap) {
    const size_t n = dm->m->n_slabs < cap ? dm->m->n_slabs : cap;
    for (size_t i = 0; i < n; i++) out[i] = (kv_remote_demand){dm->n[i], dm->wait_us[i]};
    return dm->m->n_slabs;
}

/* ---- reports ------------------------------------------------------------------ */

size_t kv_demand_build(const kv_manifest *m, const kv_remote_demand *now, const kv_remote_demand *base,
                       kv_hub_demand_shard *sh) {
    size_t k = 0;
    for (size_t i = 0; i < m->n_slabs; i++) {
        const uint64_t c = now[i].computations - (base ? base[i].computations : 0);
        if (!c) continue;
        sh[k++] = (kv_hub_demand_shard){m->slabs[i].layer, m->slabs[i].first, m->slabs[i].last, c,
                                        now[i].wait_us - (base ? base[i].wait_us : 0)};
    }
    return k;
}

int kv_demand_report_once(const char *hub, kv_node_key *key, const kv_manifest *m, const kv_remote_demand *now,
                          uint64_t tokens, kv_diag *d) {
    kv_hub_demand_shard *sh = malloc((m->n_slabs ? m->n_slabs : 1) * sizeof *sh);
    if (!sh) return kv_fail(d, KV_ENOMEM, "demand: out of memory");
    const size_t k = kv_demand_build(m, now, NULL, sh);
    const kv_hub_demand rep = {tokens, sh, k};
    const int rc = k && tokens ? kv_hub_report_demand(hub, key, &rep, NULL, d) : 0;
    free(sh);
    return rc;
}

struct kv_demand_reporter {
    kv_demand_reporter_opts o;    /* hub and who point at the copies below */
    char *hub, *who;              /* copies */
    kv_node_key key;              /* a copy: the counter is ours from now on */
    pthread_t th;
    bool th_up;
    pthread_mutex_t mu;           /* stop, cv */
    pthread_cond_t cv;
    bool stop;
    size_t n;                     /* manifest slabs */
    kv_remote_demand *now, *base; /* [n] snapshot / accepted so far */
    uint64_t tokens_base;
    kv_hub_demand_shard *sh;      /* [n] the report being built */
    int last_rc;                  /* of the last report (a failure is said once until it changes) */
};

/* One report of what grew since the last accepted one; none when no token did. */
static void kv_dr_report(kv_demand_reporter *r) {
    uint64_t tokens = 0;
    memset(r->now, 0, r->n * sizeof *r->now);
    r->o.snapshot(r->o.ctx, r->now, &tokens);
    if (tokens <= r->tokens_base) return;
    for (size_t i = 0; i < r->n; i++) /* counters only grow; a snapshot behind the baseline reports nothing of it */
        if (r->now[i].computations < r->base[i].computations || r->now[i].wait_us < r->base[i].wait_us) r->now[i] = r->base[i];
    const size_t k = kv_demand_build(r->o.m, r->now, r->base, r->sh);
    uint64_t comps = 0;
    for (size_t i = 0; i < k; i++) comps += r->sh[i].computations;
    const kv_hub_demand rep = {tokens - r->tokens_base, r->sh, k};
    kv_diag d = {0};
    uint64_t acc = 0;
    const int rc = kv_hub_report_demand(r->hub, &r->key, &rep, &acc, &d);
    if (r->o.done) r->o.done(r->o.ctx, rc, rep.tokens, comps, acc);
    if (rc == 0) {
        memcpy(r->base, r->now, r->n * sizeof *r->base);
        r->tokens_base = tokens;
    } else if (rc != r->last_rc && r->o.log) {
        fprintf(r->o.log, "%s: demand report to %s: %s (kept for the next one)\n", r->who, r->hub, d.msg);
        fflush(r->o.log);
    }
    r->last_rc = rc;
}

static void *kv_dr_main(void *arg) {
    kv_demand_reporter *r = arg;
    pthread_mutex_lock(&r->mu);
    while (!r->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        const uint64_t ns = (uint64_t)ts.tv_nsec + (uint64_t)r->o.period_ms * 1000000u;
        ts.tv_sec += (time_t)(ns / 1000000000u);
        ts.tv_nsec = (long)(ns % 1000000000u);
        pthread_cond_timedwait(&r->cv, &r->mu, &ts);
        if (r->stop) break;
        pthread_mutex_unlock(&r->mu);
        kv_dr_report(r);
        pthread_mutex_lock(&r->mu);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

int kv_demand_reporter_start(kv_demand_reporter **out, const kv_demand_reporter_opts *o, kv_diag *d) {
    *out = NULL;
    if (!o->hub || !o->key || !o->m || !o->snapshot)
        return kv_fail(d, KV_EINVAL, "demand: a reporter needs a hub, a key, a manifest and a snapshot");
    kv_demand_reporter *r = calloc(1, sizeof *r);
    if (!r) return kv_fail(d, KV_ENOMEM, "demand: out of memory");
    r->o = *o;
    if (!r->o.period_ms) r->o.period_ms = KV_DEMAND_REPORT_MS;
    r->key = *o->key;
    r->n = o->m->n_slabs;
    r->hub = strdup(o->hub);
    r->who = strdup(o->who ? o->who : "demand");
    r->now = calloc(r->n ? r->n : 1, sizeof *r->now);
    r->base = calloc(r->n ? r->n : 1, sizeof *r->base);
    r->sh = calloc(r->n ? r->n : 1, sizeof *r->sh);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    if (!r->hub || !r->who || !r->now || !r->base || !r->sh) {
        kv_demand_reporter_free(r);
        return kv_fail(d, KV_ENOMEM, "demand: out of memory");
    }
    r->o.hub = r->hub;
    r->o.who = r->who;
    r->o.key = NULL;
    if (pthread_create(&r->th, NULL, kv_dr_main, r)) {
        kv_demand_reporter_free(r);
        return kv_fail(d, KV_EIO, "%s: cannot start the demand reporter", o->who ? o->who : "demand");
    }
    r->th_up = true;
    *out = r;
    return 0;
}

void kv_demand_reporter_free(kv_demand_reporter *r) {
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
    free(r->who);
    free(r->now);
    free(r->base);
    free(r->sh);
    free(r);
}
