/* Plan: a hub's placement map (which node serves which layer and expert
 * ranges) and what one decoded token costs on the wire (`kvasir plan`).
 *
 * The figures model the coordinator (src/dispatch/remote.c) and the frame
 * sizes of docs/PROTOCOL.md. For one token of one sequence, per MoE layer:
 *   - one request round: every worker that holds one of the token's top-k
 *     experts gets one COMPUTE, all sent at once, so a token costs one
 *     round trip per MoE layer, whatever the number of workers;
 *   - k expert computations (pairs);
 *   - one COMPUTE (16 + 20 + n_embd s + 8 per pair bytes) and one RESULT
 *     (16 + 12 + n_embd s per pair + a 64-byte v4 signature) per worker contacted, s the bytes per
 *     value of the wire encoding. So a token costs
 *       messages x (128 + n_embd s) + pairs x (8 + n_embd s)
 *     bytes, and only the number of messages depends on the routing.
 * Which worker gets an expert is the coordinator's rule: the live holder
 * with the fewest pairs so far in the round, ties broken by a rotation
 * keyed on (layer, expert) over the workers in placement order (first seen
 * in /v1/placement, the order `run --hub` dials them). The plan runs that
 * rule over every ordered choice of k distinct experts (uniform routing)
 * when n_expert^k is at most KV_PLAN_ENUM, else over KV_PLAN_SAMPLES seeded
 * draws per layer, and reports the least, the most and the mean number of
 * messages. */
#ifndef KVASIR_PLAN_H
#define KVASIR_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/slice.h"

#define KV_PLAN_ENUM 4000000u    /* n_expert^k steps of the enumeration per layer, at most */
#define KV_PLAN_SAMPLES 100000u  /* draws per layer otherwise */
#define KV_PLAN_MAX_K 64u        /* top-k the simulation handles */
#define KV_PLAN_MAX_HOLDERS 64u  /* holders of one (layer, expert) the plan indexes */

typedef struct kv_plan kv_plan;

/* Builds the plan of manifest m (borrowed; must outlive the plan) from a
 * GET /v1/placement answer (len bytes, untrusted; fuzzed:
 * fuzz/fuzz_plan.c): the nodes and holders a coordinator keeps of it
 * (kv_node_placement_parse), keys of 64 hex digits or ignored; a shard
 * whose layer or expert range is not inside the model is skipped, and a
 * (layer, expert) counts at most KV_PLAN_MAX_HOLDERS holders. KV_EFORMAT /
 * KV_ERANGE when nothing usable is left, naming the first bad field; *out
 * is NULL then. Free with kv_plan_free (accepts NULL). */
int kv_plan_open(kv_plan **out, const kv_manifest *m, const char *placement, size_t len, kv_diag *d);
void kv_plan_free(kv_plan *p);

/* Nodes in placement order; their address and key ("" if none given);
 * whether node i holds expert e of layer L (false out of range). */
uint32_t kv_plan_n_nodes(const kv_plan *p);
const char *kv_plan_node_addr(const kv_plan *p, uint32_t i);
const char *kv_plan_node_key(const kv_plan *p, uint32_t i);
bool kv_plan_holds(const kv_plan *p, uint32_t i, uint32_t layer, uint32_t expert);

typedef struct kv_plan_figures {
    uint32_t n_moe_layers, top_k;   /* of the model */
    uint32_t value_bytes;           /* bytes per value on the wire (4 for f32) */
    uint32_t experts_missing;       /* (layer, expert) of MoE layers nobody holds */
    uint32_t missing_layer, missing_expert; /* the first of them */
    /* per token of one sequence; valid when experts_missing == 0 */
    uint32_t round_trips;           /* one per MoE layer */
    uint64_t expert_pairs;          /* top_k x n_moe_layers */
    uint32_t messages_min, messages_max; /* COMPUTE+RESULT exchanges, over the routings */
    double messages_expected;       /* mean under uniform routing */
    bool exact;                     /* every routing enumerated (else sampled) */
    uint64_t routings;              /* routings looked at, over all layers */
    uint64_t bytes_per_message;     /* 128 + n_embd s (a v4 RESULT carries a 64-byte signature) */
    uint64_t bytes_per_pair;        /* 8 + n_embd s */
    uint64_t bytes_min, bytes_max;  /* messages x per message + pairs x per pair */
    double bytes_expected;
} kv_plan_figures;

/* The figures for wire encoding enc (KV_ENC_*). KV_EINVAL for an unknown
 * encoding, KV_EUNSUPPORTED for a top-k above KV_PLAN_MAX_K. Deterministic
 * (the sampling is seeded). */
int kv_plan_figures_get(const kv_plan *p, uint32_t enc, kv_plan_figures *out, kv_diag *d);

/* ---- sites and the predicted time per token ----------------------------
 * The sites come from the hub's GET /v1/sites (docs/HUB.md "Sites"): each
 * site's median round trip as the hub measured it, the upper bound of the
 * round trip between two sites (through the hub), and the placement in force
 * (a ring of sites with a window of layers each, or per-layer dispatch). */

#define KV_PLAN_MAX_SITES 64u

typedef struct kv_plan_window {
    uint32_t site, first, last;   /* site index; layers, inclusive */
    uint32_t n_workers, n_ring;   /* site-local expert workers and ring nodes listed for it */
} kv_plan_window;

typedef struct kv_plan_sites {
    uint32_t n_site;
    char name[KV_PLAN_MAX_SITES][48];
    double rtt_ms[KV_PLAN_MAX_SITES];                    /* hub to the site (median); < 0 unknown */
    double between_ms[KV_PLAN_MAX_SITES][KV_PLAN_MAX_SITES]; /* upper bound between two sites; < 0 unknown */
    bool placed;                  /* a site placement is in force */
    char reason[256];             /* why not, when !placed */
    uint32_t n_win;
    kv_plan_window win[KV_PLAN_MAX_SITES];
    uint32_t n_node;              /* members: key (hex) and site */
    char (*node_key)[65];         /* [n_node] */
    uint32_t *node_site;          /* [n_node] */
} kv_plan_sites;

/* Parses a GET /v1/sites answer (untrusted: every field checked; windows
 * must be consecutive from layer 0 to n_layer - 1 over distinct known
 * sites, or the placement counts as absent with the reason saying why).
 * KV_EFORMAT for what is not such an answer. Free with kv_plan_sites_free
 * (accepts NULL). */
int kv_plan_sites_parse(const char *json, size_t len, uint32_t n_layer, kv_plan_sites **out, kv_diag *d);
void kv_plan_sites_free(kv_plan_sites *s);

/* The cost model, in one place: a token waits for `wait_ms` of round trips
 * and one-way delays (its crossings), for its WAN bytes to serialize at the
 * link's rate, and for its compute:
 *     t = wait_ms + max(wan_bytes x 8 / (bandwidth_mbit x 10^6) s, crossings x line_ms) + compute_ms
 * (bandwidth 0: unlimited; line_ms: the path's own time to carry one
 * crossing's bytes, a forwarder's per-packet cost as measured on the WAN test
 * bed (docs/WAN.md), 0 for none: a crossing goes at the slower of the link's
 * rate and the path's own pace). Returns milliseconds. */
typedef struct kv_plan_cost {
    uint32_t crossings;           /* site boundaries crossed (WAN) per token */
    uint32_t lan_round_trips;     /* round trips inside a site per token */
    double wait_ms;               /* their summed delays */
    uint64_t wan_bytes;           /* bytes over the WAN per token */
    double bandwidth_mbit;        /* of the WAN link; 0 = unlimited */
    double compute_ms;            /* per token, all layers */
    double line_ms;               /* the path's own time per crossing (0 = none) */
} kv_plan_cost;
double kv_plan_cost_ms(const kv_plan_cost *c);

typedef struct kv_plan_net {
    double lan_ms;                /* a round trip inside a site (0 = 0.5) */
    double bandwidth_mbit;        /* between sites; 0 = unlimited */
    double compute_ms;            /* compute per token */
    int32_t from_site;            /* the coordinator's site for per-layer dispatch; -1 = the first window's
                                     site (or the first site) */
} kv_plan_net;

typedef struct kv_plan_prediction {
    uint32_t from_site;           /* the coordinator's site used for per-layer dispatch */
    kv_plan_cost experts;         /* plain per-layer dispatch: one round trip per MoE layer, to the farthest
                                     site holding one of that layer's experts */
    double experts_ms;
    bool sites_ok;                /* a site placement is in force */
    kv_plan_cost sites;           /* the ring of sites: one one-way crossing per window boundary (the ring
                                     closes back to the first), one LAN round trip per MoE layer */
    double sites_ms;
    bool unmeasured;              /* a round trip the hub has not measured was taken as lan_ms */
} kv_plan_prediction;

/* Both predictions for one token of one sequence, wire encoding enc.
 * Per-layer dispatch needs the placement covered (KV_ENOTFOUND otherwise). */
int kv_plan_predict(const kv_plan *p, const kv_plan_sites *s, uint32_t enc, const kv_plan_net *net,
                    kv_plan_prediction *out, kv_diag *d);

#endif
