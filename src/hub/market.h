/* The coverage market's policy (src/hub/market.c): how many replicas each
 * shard wants, from its measured demand, and what one more holder earns.
 *
 * Demand. Coordinators report the expert computations they needed per shard
 * (POST /v1/demand, docs/HUB.md "Demand"). A shard's demand is a decaying
 * rate in computations per second: a report of c computations at time t adds
 * c * ln2 / half_life to it, and the rate halves every half_life, so a steady
 * flow of R computations/s converges to a rate of R. The rate is stored with
 * the time it was taken at; reading it later decays it to the reader's time,
 * so every hub that reads one stored state sees the same figure at the same
 * time.
 *
 * One key alone. The reporter whose contribution to a shard is largest is
 * tracked (one slot, replaced by a larger single contribution: a space-saving
 * estimate). With a share cap s < 1 the rate that drives wanted is
 * min(rate, (rate - top) / (1 - s)): one stranger key alone cannot raise a
 * shard above its floor, and a key's own contribution counts for at most s
 * of what drives it. Operator-listed coordinators never take the slot.
 *
 * Wanted, with hysteresis. With per = per_replica computations/s:
 *   raise: rate > high * per * wanted, held raise_ms, below the ceiling:
 *          wanted + 1 (the timer starts again for the next step);
 *   lower: rate < low * per * (wanted - 1) (the load per replica after the
 *          drop would still be under the low watermark), held hold_ms, and
 *          hold_ms since the last change, above the floor: wanted - 1.
 * low < high, so right after a raise the lowering condition is false: a
 * demand that wobbles around one threshold moves wanted at most once.
 * The rule is evaluated when the hub serves the market or takes a report
 * (nodes poll the market every few seconds), one step per evaluation.
 *
 * Reward (micro-KVR per hour offered to one more holder):
 *   base * wanted / (live + 1) * (1 + u),  u = min(1, rate / (per * max(live, 1)))
 * With no demand (u = 0) it is exactly the fixed market's base * wanted /
 * (live + 1); demand beyond what the live replicas serve at per doubles it
 * at most. Pure functions, no allocation, thread-safe. */
#ifndef KVASIR_HUB_MARKET_H
#define KVASIR_HUB_MARKET_H

#include <stdbool.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/hub.h"
#include "kvasir/slice.h"

#define KV_MKT_MAX_WANTED 1024u           /* replicas one shard may want */
#define KV_MKT_MAX_RATE 1e15              /* computations/s: a stored rate beyond is malformed */

typedef struct kv_mkt_policy {
    uint32_t floor;          /* wanted with no demand (>= 1) */
    uint32_t ceiling;        /* wanted at most (>= floor; == floor: the fixed market) */
    double per_replica;      /* computations/s one replica is wanted for (> 0) */
    double high, low;        /* watermarks, fractions of per_replica, 0 < low < high */
    uint32_t raise_ms;       /* the raise condition holds this long before a raise */
    uint32_t hold_ms;        /* the lower condition holds this long, and as long since the last change */
    uint32_t half_life_ms;   /* of the demand rate (> 0) */
    double share;            /* largest share of the driving rate one stranger key may have; 1 = no cap */
    uint64_t reward_base;    /* micro-KVR per hour */
} kv_mkt_policy;

/* One shard's market state, as stored (store.h, table market). */
typedef struct kv_mkt_state {
    double rate;             /* demand, computations/s, at rate_ms */
    double wait;             /* what coordinators waited for it, ms per s, at rate_ms */
    double top_rate;         /* the largest single reporter's part of rate, at rate_ms */
    uint8_t top_pk[32];      /* that reporter (all zero: none) */
    int64_t rate_ms;         /* Unix ms the rates were taken at; 0 = no demand ever */
    uint32_t wanted;         /* replicas wanted now */
    int64_t changed_ms;      /* last change of wanted (Unix ms); 0 = never */
    int64_t above_ms;        /* since when the raise condition holds; 0 = it does not */
    int64_t below_ms;        /* since when the lower condition holds; 0 = it does not */
    int64_t version;         /* bumped by every write (optimistic concurrency between hubs) */
} kv_mkt_state;

/* The policy's defaults for a floor and a reward base (ceiling = floor: a
 * fixed market unless raised). */
void kv_mkt_policy_default(kv_mkt_policy *p, uint32_t floor, uint64_t reward_base);
/* 0, or KV_EINVAL naming the first setting out of range. */
int kv_mkt_policy_check(const kv_mkt_policy *p, kv_diag *d);
/* A fresh shard: no demand, wanted = floor. */
void kv_mkt_state_init(const kv_mkt_policy *p, kv_mkt_state *s);

/* The stored rates decayed to now (now before rate_ms: no decay). */
double kv_mkt_rate(const kv_mkt_policy *p, const kv_mkt_state *s, int64_t now);
double kv_mkt_wait(const kv_mkt_policy *p, const kv_mkt_state *s, int64_t now);
/* The rate that drives wanted at now (the share cap applied). */
double kv_mkt_driving_rate(const kv_mkt_policy *p, const kv_mkt_state *s, int64_t now);

/* Adds one report at now: computations (>= 0, finite) and wait_ms waited
 * for them; pk is the reporter, NULL for an operator-listed one (never
 * tracked as the top reporter). Rates are decayed to now first and rate_ms
 * becomes now (a report older than rate_ms counts at rate_ms). */
void kv_mkt_add(const kv_mkt_policy *p, kv_mkt_state *s, int64_t now, double computations, double wait_ms,
                const uint8_t pk[32]);

/* Evaluates the wanted rule at now (above), clamping wanted into [floor,
 * ceiling] first. Returns true when the state changed (wanted or a timer):
 * the caller writes it. */
bool kv_mkt_step(const kv_mkt_policy *p, kv_mkt_state *s, int64_t now);

/* Reward offered to one more holder (above); rate is the shard's demand at
 * the time. Saturates at UINT64_MAX. */
uint64_t kv_mkt_reward(const kv_mkt_policy *p, uint32_t wanted, uint32_t live, double rate);

/* What one demand report may count (docs/HUB.md "Demand", rule 3), with
 * `granted` the tokens its budgets allowed: for every shard listed, its
 * computations up to granted x min(n_expert_used, its experts) (its
 * experts alone when the manifest has no n_expert_used), then a layer's
 * shards together up to granted x n_expert_used, scaled down evenly when
 * over; waiting up to 1000 ms per computation counted. acc[] and wait_ms[]
 * (n_slabs each, manifest order) are added to. Returns 0 with *total the
 * computations counted, or KV_EINVAL (d names it) for a shard that is not
 * a slab of m (nothing added). Pure. */
int kv_mkt_bound(const kv_manifest *m, const kv_hub_demand *r, uint64_t granted, double *acc, double *wait_ms,
                 double *total, kv_diag *d);

/* What a ring window's report may count (docs/HUB.md "Demand", rule 5): a
 * window computes its own layers only, so of what kv_mkt_bound left in
 * acc[] and wait_ms[] (n_slabs each) only the slabs it holds stay
 * (held[0..n_held): manifest indices, sorted); the others are zeroed.
 * Returns the computations left. Pure. */
double kv_mkt_keep_held(size_t n_slabs, const uint32_t *held, size_t n_held, double *acc, double *wait_ms);

/* Order of the market: scarcest first (smallest live/wanted, then the larger
 * deficit, then idx), total and stable. */
typedef struct kv_mkt_sort {
    uint32_t idx, wanted, live;
} kv_mkt_sort;
int kv_mkt_cmp(const void *a, const void *b);

#endif
