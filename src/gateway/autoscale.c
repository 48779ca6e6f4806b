/* Local experts: a gateway that is tight when quiet and wide when busy
 * (docs/GATEWAY.md "Local experts").
 *
 * With a local budget (--local-experts SIZE) the coordinator holds the
 * hottest slabs of its manifest's folder that fit (kv_remote_local_hold;
 * chosen again every KV_GW_AS_REHOLD_S by the demand metered since start)
 * and computes the held experts itself while its steps are fast, with no
 * network in their path. The policy moves one level at a time between
 * tight (level 0: local share 1, every held expert computed here) and wide
 * (level KV_GW_AS_LEVELS: share 0, all sent to workers):
 *   - widen (level + 1) when the moving average of the step time is over
 *     the target, two sessions or more are active, a worker is up, and
 *     KV_GW_AS_DWELL_S passed since the last decision: the gateway's core is
 *     the bottleneck, and the workers' cores compute in parallel with the
 *     local part of every layer. A single session is never widened: its
 *     step is one token's, which a round trip per layer only lengthens;
 *     The current level must have been measured at this load first
 *     (KV_GW_AS_JUDGE steps; not with a given target, which tests force);
 *   - but not to a level already measured at this load that cost more per
 *     session than the current one, and back (tighten) from a level that,
 *     after KV_GW_AS_JUDGE steps, costs KV_GW_AS_WORSE times more per
 *     session than the narrower one did: handing work out pays only while
 *     the workers' part runs beside the gateway's own (on a gateway whose
 *     workers are few or slow the best share is in the middle). The step
 *     costs per level are forgotten when the load doubles or halves, or
 *     falls to none, and a level measured at this load whose
 *     narrower neighbour is not is left for that neighbour to be measured
 *     (a probe: the choice climbs towards the cheapest share both ways);
 *   - tighten (level - 1) when the load fell to half of the load when the
 *     current level was entered (or to none), after the same dwell: the
 *     load that made it widen is gone.
 * The load is the most sessions active at once over the last 0.5 to 1 s
 * (KV_GW_AS_LOAD_WIN_S), not the sessions of this step: clients that send
 * back to back all end together now and then, and a gap of a few steps
 * between their requests is not the load gone. A wider level measured
 * dearer is tried again after KV_GW_AS_REPROBE_S, twice as long each time
 * it did not pay again at this load (up to KV_GW_AS_REPROBE_MAX_S). The rules use
 *     different signals, so the step time a wide step costs (a round trip
 *     per layer) never by itself pulls the share back and forth.
 * The target is --step-target-ms, or derived: KV_GW_AS_TARGET_X times the
 * shortest step seen tight, once KV_GW_AS_CALIB tight steps were seen (no
 * decision before). Every pair is computed whole by one side, and every
 * side gives the same bits, so outputs never depend on the level, even
 * when it changes in the middle of a request. All of it runs on the
 * scheduler's thread, between steps, with mu held (the remote is that
 * thread's). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gateway/server_internal.h"

#define KV_GW_AS_DWELL_S 0.5   /* least time between two decisions */
#define KV_GW_AS_ALPHA 0.2     /* weight of a new step time in the average */
#define KV_GW_AS_TARGET_X 2.0  /* derived target: this many times the shortest tight step */
#define KV_GW_AS_CALIB 8u      /* tight steps seen before a derived target is trusted */
#define KV_GW_AS_MIN_TARGET_S 0.001 /* a derived target is never under this */
#define KV_GW_AS_REHOLD_S 10.0 /* the held slabs follow demand this often */
#define KV_GW_AS_JUDGE 8u      /* steps at a level before its cost is compared */
#define KV_GW_AS_WORSE 1.1     /* a wider level costing this much more per session is left */
#define KV_GW_AS_LOAD_WIN_S 0.5 /* the load is the most sessions active at once over two such windows */
#define KV_GW_AS_REPROBE_S 10.0 /* a wider level measured dearer is tried again after this ... */
#define KV_GW_AS_REPROBE_MAX_S 120.0 /* ... doubled each time it did not pay, up to this */

static double kv_as_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double kv_as_share(uint32_t level) { return 1.0 - (double)level / KV_GW_AS_LEVELS; }

int kv_gw_autoscale_open(kv_gateway *g, uint64_t budget, double target_ms, kv_diag *d) {
    kv_gw_autoscale *a = &g->as;
    kv_remote *rm = g->e ? kv_engine_remote(g->e) : NULL;
    if (rm) { /* every coordinator meters its demand; /metrics shows it */
        a->n_demand = kv_remote_manifest(rm)->n_slabs;
        a->demand = calloc(a->n_demand ? a->n_demand : 1, sizeof *a->demand);
        if (!a->demand) return kv_fail(d, KV_ENOMEM, "gateway: out of memory");
    }
    if (!budget) {
        if (target_ms > 0) return kv_fail(d, KV_EINVAL, "gateway: --step-target-ms needs --local-experts SIZE");
        return 0;
    }
    if (!rm)
        return kv_fail(d, KV_EINVAL, "gateway: --local-experts needs a sliced model and workers (-m DIR --worker, "
                       "or --hub): a gateway without workers computes every expert itself already");
    int rc = kv_remote_local_hold(rm, budget, &a->held_bytes, &a->held_slabs, d);
    if (rc) return rc;
    if (!a->held_slabs)
        return kv_fail(d, KV_EINVAL, "gateway: --local-experts %llu bytes: no slab in the manifest's folder fits "
                       "(put slab files beside the manifest, or give a larger budget)", (unsigned long long)budget);
    a->on = true;
    a->budget = budget;
    a->target_given = target_ms > 0;
    a->target_s = target_ms / 1000.0;
    a->min_tight_s = -1.0;
    a->reprobe_s = KV_GW_AS_REPROBE_S;
    a->last_change = a->rehold_at = kv_as_now();
    a->rehold_at += KV_GW_AS_REHOLD_S;
    kv_remote_set_local_share(rm, kv_as_share(0));
    return 0;
}

void kv_gw_autoscale_free(kv_gateway *g) {
    free(g->as.demand);
    g->as.demand = NULL;
}

/* The load the rules read: the most sessions active at once over the last
 * 0.5 to 1 s. Clients that send back to back leave the gateway with few
 * sessions, or none, for a few steps whenever their requests end together
 * (the same length, started together); the instantaneous count then read as
 * load gone at every request's end, and the policy tightened and forgot
 * what it had measured each time. */
static void kv_as_load(kv_gw_autoscale *a, uint32_t n_active, double now) {
    if (now - a->load_win >= KV_GW_AS_LOAD_WIN_S) {
        a->load_prev = now - a->load_win < 2 * KV_GW_AS_LOAD_WIN_S ? a->load_cur : 0;
        a->load_cur = 0;
        a->load_win = now;
    }
    if (n_active > a->load_cur) a->load_cur = n_active;
    a->load = a->load_cur > a->load_prev ? a->load_cur : a->load_prev;
}

static void kv_as_set(kv_gateway *g, kv_remote *rm, uint32_t level, double now) {
    kv_gw_autoscale *a = &g->as;
    const bool widen = level > a->level;
    if (widen) {
        a->widened++;
        a->widen_at[level] = a->load;
    } else {
        a->tightened++;
    }
    a->level = level;
    a->last_change = now;
    kv_remote_set_local_share(rm, kv_as_share(level));
    if (!g->o.quiet)
        fprintf(stderr, "gateway: local experts: %s to a local share of %.2f (%u sessions, load %u, step %.1f ms, target %.1f ms)\n",
                widen ? "widen" : "tighten",
                kv_as_share(level), g->n_active, a->load, a->ewma_s * 1e3, a->target_s * 1e3);
}

/* The tighten rule, shared by steps and idle ticks. */
static bool kv_as_tighten(kv_gateway *g, kv_remote *rm, double now) {
    kv_gw_autoscale *a = &g->as;
    if (!a->level || now - a->last_change < KV_GW_AS_DWELL_S) return false;
    if (a->load && (uint64_t)a->load * 2 > a->widen_at[a->level]) return false;
    kv_as_set(g, rm, a->level - 1, now);
    return true;
}

void kv_gw_autoscale_step_locked(kv_gateway *g, double dt) {
    kv_gw_autoscale *a = &g->as;
    kv_remote *rm = g->e ? kv_engine_remote(g->e) : NULL;
    if (!rm) return;
    kv_remote_get_demand(rm, a->demand, a->n_demand);
    kv_remote_get_pairs(rm, &a->pairs_remote, &a->pairs_local, &a->pairs_held_local);
    if (!a->on) return;
    const double now = kv_as_now();
    kv_as_load(a, g->n_active, now);
    a->ewma_s = a->ewma_s > 0 ? a->ewma_s + KV_GW_AS_ALPHA * (dt - a->ewma_s) : dt;
    if (a->level == 0) {
        if (a->min_tight_s < 0 || dt < a->min_tight_s) a->min_tight_s = dt;
        a->n_tight++;
        if (!a->target_given && a->n_tight >= KV_GW_AS_CALIB) {
            const double t = KV_GW_AS_TARGET_X * a->min_tight_s;
            a->target_s = t > KV_GW_AS_MIN_TARGET_S ? t : KV_GW_AS_MIN_TARGET_S;
        }
    }
    if (now >= a->rehold_at) { /* the held slabs follow what is hot now */
        kv_diag d = {0};
        if (kv_remote_local_hold(rm, a->budget, &a->held_bytes, &a->held_slabs, &d) == 0) a->rehold++;
        a->rehold_at = now + KV_GW_AS_REHOLD_S;
    }
    /* the cost per session of this level, at this load */
    if (g->n_active) {
        if (a->load > 2 * a->cost_conc || 2 * a->load < a->cost_conc) {
            memset(a->cost_n, 0, sizeof a->cost_n);
            a->cost_conc = a->load;
            a->reprobe_s = KV_GW_AS_REPROBE_S;
            a->unpaid_here = 0;
            memset(a->unpaid_at, 0, sizeof a->unpaid_at);
        }
        const double c = dt / g->n_active;
        a->cost[a->level] = a->cost_n[a->level]++ ? a->cost[a->level] + KV_GW_AS_ALPHA * (c - a->cost[a->level]) : c;
        a->cost_at[a->level] = now;
    }
    if (kv_as_tighten(g, rm, now)) return;
    const uint32_t L = a->level;
    if (L && a->cost_n[L] >= KV_GW_AS_JUDGE && a->cost_n[L - 1] >= KV_GW_AS_JUDGE &&
        a->cost[L] > KV_GW_AS_WORSE * a->cost[L - 1] && now - a->last_change >= KV_GW_AS_DWELL_S) {
        a->unpaid++;
        if (a->unpaid_here++) /* did not pay again at this load */
            a->reprobe_s = 2 * a->reprobe_s < KV_GW_AS_REPROBE_MAX_S ? 2 * a->reprobe_s : KV_GW_AS_REPROBE_MAX_S;
        a->unpaid_at[L] = now;
        kv_as_set(g, rm, L - 1, now);
        return;
    }
    if (L && a->cost_n[L] >= KV_GW_AS_JUDGE && !a->cost_n[L - 1] && now - a->last_change >= KV_GW_AS_DWELL_S) {
        kv_as_set(g, rm, L - 1, now); /* the narrower share is not measured at this load: try it */
        a->probes++;
        return;
    }
    /* a wider level that did not pay at this load is not tried again until
     * reprobe_s passed, nor one measured dearer in that time (the costs
     * drift: contexts grow, the workers' load changes, a step's time is
     * noisy); each time it did not pay again, twice as long */
    const bool next_worse = L < KV_GW_AS_LEVELS &&
                            ((a->unpaid_at[L + 1] > 0 && now - a->unpaid_at[L + 1] < a->reprobe_s) ||
                             (a->cost_n[L + 1] >= KV_GW_AS_JUDGE && a->cost_n[L] >= KV_GW_AS_JUDGE &&
                              a->cost[L + 1] > a->cost[L] && now - a->cost_at[L + 1] < a->reprobe_s));
    /* a level is measured (KV_GW_AS_JUDGE steps) before the next is tried,
     * so that the cost rules can compare the two */
    if (!next_worse && (a->cost_n[L] >= KV_GW_AS_JUDGE || a->target_given) && a->target_s > 0 && a->ewma_s > a->target_s && a->level < KV_GW_AS_LEVELS && g->n_active >= 2 &&
        g->cov_up > 0 && now - a->last_change >= KV_GW_AS_DWELL_S)
        kv_as_set(g, rm, a->level + 1, now);
}

void kv_gw_autoscale_idle_locked(kv_gateway *g) {
    kv_remote *rm = g->e ? kv_engine_remote(g->e) : NULL;
    if (!rm || !g->as.on) return;
    kv_gw_autoscale *a = &g->as;
    const double now = kv_as_now();
    kv_as_load(a, 0, now);
    if (a->load) return; /* a gap between requests, not the load gone */
    a->ewma_s = 0; /* a new burst is judged by its own steps */
    memset(a->cost_n, 0, sizeof a->cost_n);
    a->cost_conc = 0;
    a->reprobe_s = KV_GW_AS_REPROBE_S;
    a->unpaid_here = 0;
    memset(a->unpaid_at, 0, sizeof a->unpaid_at);
    kv_as_tighten(g, rm, now);
}
