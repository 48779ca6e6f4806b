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

#endif
