/* Demand per shard, one implementation for every coordinator (the gateway,
 * `kvasir run --hub`, a ring window with --hub): what it needed of each
 * shard of the market and how long it waited, counted the same way, and
 * reported to the hub the same way (docs/HUB.md "Demand", docs/GATEWAY.md
 * "Demand per shard"; src/dispatch/shard_demand.c).
 *
 * Counting. A shard is a slab of the manifest (one layer's expert range).
 * Each (token, expert) pair of a successful compute call counts once for its
 * slab; the wait of a slab is, per call that needed it, the time from the
 * call's start to the answer of its last pair. kv_remote counts so itself
 * (kv_remote_get_demand: workers, hedges and held slabs alike); an
 * in-process provider is counted by wrapping it in a meter (below), for
 * which every slab of a call is answered when the call returns: its wait is
 * the coordinator's own compute time.
 *
 * Reporting. A reporter thread takes, every KV_DEMAND_REPORT_MS, the
 * coordinator's cumulative counters (a snapshot callback), subtracts what
 * the hub last accepted, and posts the difference signed by the
 * coordinator's key (kv_hub_report_demand). Only an accepted report moves
 * the baseline, so a report the hub could not take is carried into the next
 * one; the hub bounds what it counts. */
#ifndef KVASIR_DISPATCH_DEMAND_H
#define KVASIR_DISPATCH_DEMAND_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvasir/dispatch_remote.h" /* kv_remote_demand */
#include "kvasir/err.h"
#include "kvasir/hub.h"      /* kv_hub_demand_shard, kv_hub_report_demand */
#include "kvasir/link.h"
#include "kvasir/moe.h"
#include "kvasir/slice.h"

#define KV_DEMAND_REPORT_MS 5000u /* between two reports */

/* ---- a meter around an in-process expert provider ---------------------- */

typedef struct kv_demand_meter kv_demand_meter;
/* Wraps inner (borrowed: it must outlive the meter) so that every call
 * through kv_demand_meter_provider(dm) is counted per slab of m (borrowed,
 * likewise). Experts of no slab of m are not counted. 0, or KV_ENOMEM.
 * Free with kv_demand_meter_free (accepts NULL; does not free inner). */
int kv_demand_meter_new(kv_demand_meter **out, const kv_expert_provider *inner, const kv_manifest *m, kv_diag *d);
void kv_demand_meter_free(kv_demand_meter *dm);
/* The counting provider (owned by dm: its free is a no-op). */
const kv_expert_provider *kv_demand_meter_provider(kv_demand_meter *dm);
/* Counters since open, per manifest slab, into out[0..min(cap, n_slabs));
 * returns n_slabs. Same thread as compute (as kv_remote_get_demand). */
size_t kv_demand_meter_get(const kv_demand_meter *dm, kv_remote_demand *out, size_t cap);

/* ---- reports to the hub -------------------------------------------------- */

/* The coordinator's counters since it started: now[m->n_slabs] per manifest
 * slab and *tokens, the tokens it evaluated (prompt and generated). Called
 * on the reporter's thread: it must take its own lock. */
typedef void (*kv_demand_snapshot_fn)(void *ctx, kv_remote_demand *now, uint64_t *tokens);
/* After each report attempt, on the reporter's thread: rc (0: accepted),
 * the tokens and computations it reported and the tokens the hub counted. */
typedef void (*kv_demand_done_fn)(void *ctx, int rc, uint64_t tokens, uint64_t computations, uint64_t accepted);

typedef struct kv_demand_reporter_opts {
    const char *hub;                /* the hub's URL (copied) */
    const kv_node_key *key;         /* the coordinator key (copied: its counter is the reporter's from then on) */
    const kv_manifest *m;           /* borrowed; outlives the reporter; the snapshot's slab order */
    kv_demand_snapshot_fn snapshot; /* required */
    kv_demand_done_fn done;         /* may be NULL */
    void *ctx;                      /* for both */
    uint32_t period_ms;             /* between reports; 0 = KV_DEMAND_REPORT_MS */
    const char *who;                /* log prefix ("gateway", "kvasir ring 0-1"); NULL = "demand" */
    FILE *log;                      /* a failure is said here once until its kind changes; NULL: silent */
} kv_demand_reporter_opts;

typedef struct kv_demand_reporter kv_demand_reporter;
/* Starts the reporter's thread. 0, KV_ENOMEM, KV_EINVAL (no snapshot or
 * manifest), KV_EIO (no thread). Free with kv_demand_reporter_free. */
int kv_demand_reporter_start(kv_demand_reporter **out, const kv_demand_reporter_opts *o, kv_diag *d);
/* Stops the thread (a report in flight ends within its 10 s) and frees;
 * accepts NULL. The key copy is wiped. */
void kv_demand_reporter_free(kv_demand_reporter *r);

/* The shards of the report of what grew from base to now (per manifest
 * slab; base NULL: from zero; each now[i] >= base[i]): those with
 * computations, in manifest order, into sh[0..m->n_slabs). Returns their
 * number. */
size_t kv_demand_build(const kv_manifest *m, const kv_remote_demand *now, const kv_remote_demand *base,
                       kv_hub_demand_shard *sh);
/* One report of everything counted (`kvasir run --hub` at its end): 0
 * without a request when there is nothing to report (no tokens or no
 * computations), else kv_hub_report_demand's result. */
int kv_demand_report_once(const char *hub, kv_node_key *key, const kv_manifest *m, const kv_remote_demand *now,
                          uint64_t tokens, kv_diag *d);

#endif
