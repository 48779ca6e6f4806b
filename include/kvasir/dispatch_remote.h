/* Remote expert provider, the coordinator's side of dispatch
 * (src/dispatch/remote.c). It shares the codec (kvasir/dispatch_proto.h) and
 * the event loop (kvasir/net.h) with the worker. See remote.c's opening
 * comment for the rounds, the retry and backoff rules, the slab-hash and
 * output checks, and why the output is bit-identical to a local run. */
#ifndef KVASIR_DISPATCH_REMOTE_H
#define KVASIR_DISPATCH_REMOTE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvasir/dispatch_proto.h"
#include "kvasir/err.h"
#include "kvasir/link.h"
#include "kvasir/model.h"
#include "kvasir/moe.h"
#include "kvasir/pool.h"
#include "kvasir/slice.h"

struct kv_evidence;    /* kvasir/dispatch_evidence.h */
struct kv_verify_opts; /* kvasir/verify.h */

/* Workers one remote provider may know: KV_PLACEMENT_MAX_REPLICAS per
 * slab of its manifest (what a coordinator keeps of a hub's placement map,
 * include/kvasir/node.h), and never fewer than KV_REMOTE_MAX_WORKERS. */
#define KV_REMOTE_MAX_WORKERS 1024u
uint32_t kv_remote_workers_bound(const kv_manifest *m);

typedef struct kv_remote kv_remote;

typedef struct kv_remote_opts {
    const char *const *workers; /* [n_workers] "HOST:PORT" (or "[v6]:PORT") */
    uint32_t n_workers;
    uint32_t timeout_ms;        /* deadline of one request round, and of a handshake; 0 = 10000 */
    uint32_t reconnect_ms;      /* a dropped worker is dialed again after this, doubled per
                                   failure since its last good answer (at most 60 s); 0 = 500 */
    uint32_t enc;               /* KV_ENC_* of hidden states and outputs (F32 = exact); a worker
                                   that does not accept it gets F32 */
    uint32_t max_tokens;        /* tokens per compute call: max(n_batch, n_seq); 0 = 256 */
    bool skip_hashes;           /* backbone and local slabs: check sizes and identity, not SHA-256 */
    FILE *log;                  /* one line per connect, drop, reconnect; NULL = silent */
    bool allow_sparse;          /* accept a sparse manifest (a sliced skeleton; pieces without
                                   hashes checked for size, header, identity) */
    const uint8_t *key_sk;      /* [64] the coordinator's Ed25519 secret key (required) */
    const kv_voucher *voucher;  /* a hub voucher for it, sent in AUTH; NULL = none */
    const uint8_t (*worker_keys)[32]; /* [n_workers] key each worker must prove (mutual
                                   authentication, e.g. from the hub's placement); NULL or an
                                   all-zero entry: any key that signs the transcript */
    uint32_t max_workers;       /* room for workers added later (kv_remote_add_worker), at most
                                   kv_remote_workers_bound; 0 = n_workers (none can be added) */
    bool allow_uncovered;       /* open even when some expert has no holder up (compute fails with
                                   KV_ENOTFOUND for it until a holder comes; kv_remote_coverage) */
    /* verified compute (docs/VERIFY.md) */
    const struct kv_verify_opts *verify; /* check every answer against secret projections of the
                                   experts' slabs present in the manifest's folder (needs workers
                                   that return pre-activations); NULL = no checks */
    double recompute_rate;      /* with verify: fraction of answered pairs also recomputed from the
                                   local slab and compared (bit for bit on the same backend) */
    /* Called once when worker i is caught lying (its answer is discarded and
     * redone, it is never dialed again): the hook for reporting it and
     * forfeiting what it is owed. key: the key it proved. ev: what it signed
     * for the pair it was caught on (valid during the call only), NULL when
     * there is none to show (a v3 worker, a bad signature, a lie in the
     * pre-activations rather than y). May be NULL. */
    void (*on_caught)(void *arg, uint32_t worker, const char *addr, const uint8_t key[32], const char *why,
                      const struct kv_evidence *ev);
    void *caught_arg;
    bool insecure_plaintext; /* --insecure-plaintext: dial workers over plain TCP (v3-v5, no
                                channel binding); off: TLS 1.3 pinned to each worker's listed
                                key, dispatch v5 with the key handshake bound to the session */
    double hedge_budget;     /* hedged requests allowed per request sent (at most 1; bursts of up
                                to 4): a request unanswered past its worker's measured tail
                                also goes to a replica (docs/PROTOCOL.md, Replica choice and
                                hedging); 0 = 0.1; negative = never hedge */
    double sig_check_rate;   /* signed results (v4+) over a TLS-bound link: fraction of answers
                                whose signature is checked on arrival, at random (each
                                connection's first answer always, and every answer a lie is
                                caught in, for its evidence); 0 = 1/16, >= 1 = every answer.
                                Over plaintext every signature is checked (docs/PROTOCOL.md,
                                Signed results) */
} kv_remote_opts;

/* Opens the coordinator's side of a sliced model at manifest_path
 * (DIR/manifest.json): loads and checks the manifest; checks the backbone
 * (inside DIR after symlinks, size, SHA-256, kvasir.source.id) and loads it
 * without experts, checking its hparams against the manifest; opens every
 * slab present in DIR as local fallback (same checks; absent slabs are
 * fine); connects to every worker and handshakes (protocol version, model
 * identity equal to the manifest's model_id, dims), all at once within
 * timeout_ms. A worker unreachable at start is logged and dialed again
 * later. Then every expert of every MoE layer must be served by a worker
 * that is up or by a local slab, else KV_ENOTFOUND naming the first one
 * missing (layer, expert, its slab, why each unreachable worker is).
 * pool (borrowed, must outlive r) runs the local fallback. Errors as the
 * steps say (KV_EHASH, KV_EFORMAT, KV_EIO, KV_EINVAL for a bad address...);
 * *out is NULL then. Free with kv_remote_free (accepts NULL). */
int kv_remote_open(kv_remote **out, const char *manifest_path, kv_pool *pool,
                   const kv_remote_opts *opts, kv_diag *d);
void kv_remote_free(kv_remote *r);
/* The backbone and manifest r loaded (owned by r). */
const kv_model *kv_remote_model(const kv_remote *r);
const kv_manifest *kv_remote_manifest(const kv_remote *r);
/* The provider to give kv_state_new (owned by r; its .free is NULL).
 * compute() returns 0 with every slot filled by a whole answer, or an error
 * (KV_ENOTFOUND: an expert nobody left up can compute, with the reasons;
 * KV_EINVAL / KV_ERANGE: a malformed request) and out must not be used.
 * One call at a time. */
const kv_expert_provider *kv_remote_provider(kv_remote *r);

/* What the coordinator knows about worker i (pointers valid while r lives
 * and until the next compute). */
typedef struct kv_remote_worker {
    const char *addr;           /* as given */
    bool up;                    /* handshaken now */
    const char *backend;        /* from its HELLO_ACK, "" before */
    uint32_t enc;               /* encoding in use with it */
    uint32_t n_ranges;          /* ranges it announced */
    uint64_t requests;          /* COMPUTE frames sent */
    uint64_t pairs;             /* expert computations it answered */
    uint64_t pairs_since_connect; /* ... since its last handshake */
    uint64_t drops;             /* times dropped while up */
    uint64_t connects;          /* successful handshakes (1 + reconnects) */
    const char *last_error;     /* why it was last dropped or refused, "" if never */
    const uint8_t *key;         /* [32] the key it proved at its last handshake (zeros before) */
    bool caught;                /* caught lying: dropped for good */
    uint64_t verified;          /* its pairs that passed the checks */
    double latency_ms;          /* estimated answer time (moving average), 0 = not measured */
    double p95_ms;              /* 95th percentile of its last 32 answer times, 0 = not measured */
    uint64_t hedged;            /* its requests also sent to a replica after their hedge time */
    uint64_t hedges_won;        /* hedges of others' requests it answered first */
    uint64_t late;              /* its answers that came after a replica's and were discarded */
    uint64_t cancelled;         /* its superseded requests it dropped on a CANCEL (v6; no latency sample) */
    bool demoted;               /* slower than a replica: not given work, only probed */
    uint64_t probes;            /* probes sent while demoted (answers timed, never used) */
} kv_remote_worker;
uint32_t kv_remote_n_workers(const kv_remote *r);
void kv_remote_worker_info(const kv_remote *r, uint32_t i, kv_remote_worker *out);

typedef struct kv_remote_stats {
    uint64_t calls;             /* compute() calls (one per MoE layer and step) */
    uint64_t rounds;            /* request rounds (> calls when retries happened or frames split) */
    uint64_t retried_pairs;     /* (token, expert) slots sent again after a drop */
    uint64_t pairs_remote, pairs_local; /* slots answered by workers / by local slabs */
    uint64_t bytes_sent, bytes_recv;    /* frames, headers included */
    uint64_t n_rtt;             /* rounds timed */
    uint64_t pairs_verified;    /* answers checked and passed (verify) */
    uint64_t pairs_unverified;  /* answers of experts without a local slab to check against */
    uint64_t pairs_recomputed;  /* sampled full recomputes that matched */
    uint64_t caught;            /* workers caught lying */
    uint64_t sigs_checked;      /* signed answers whose signature was checked (all over plaintext) */
    uint64_t sigs_deferred;     /* signed answers over TLS taken unchecked (sig_check_rate): checked
                                   only if a lie is caught in them */
    uint64_t hedges;            /* requests also sent to a replica (hedged) */
    uint64_t pairs_hedged;      /* (token, expert) slots those hedges carried: computed twice */
    uint64_t hedges_won;        /* ... whose replica answered first */
    uint64_t late_answers;      /* answers discarded because a replica had answered first (not a fault) */
    uint64_t hedges_cancelled;  /* superseded requests a v6 worker dropped on a CANCEL, before computing them */
    uint64_t pairs_held_local;  /* of pairs_local: experts of held slabs (kv_remote_local_hold) */
    double rtt_p50_us, rtt_p99_us, rtt_max_us; /* round trip: first byte sent to last
                                   answer in, over the last 65536 rounds that had workers */
} kv_remote_stats;
/* Counters since open (or the last reset). Allocates briefly to sort the
 * samples: not for the hot path. */
void kv_remote_get_stats(const kv_remote *r, kv_remote_stats *out);
void kv_remote_reset_stats(kv_remote *r);
/* The pair counters of kv_remote_stats alone (cheap: for every step's
 * metrics). NULL pointers are skipped. */
void kv_remote_get_pairs(const kv_remote *r, uint64_t *remote, uint64_t *local, uint64_t *held_local);
/* The hedge counters of kv_remote_stats alone (cheap: for every step's
 * metrics). NULL pointers are skipped. */
void kv_remote_get_hedges(const kv_remote *r, uint64_t *sent, uint64_t *won, uint64_t *late);
/* (token, expert) slots carried by hedges since open: both replicas computed them. */
uint64_t kv_remote_hedged_pairs(const kv_remote *r);
/* Superseded requests that their (v6) worker dropped on a CANCEL, since open
 * or the last reset (cheap: for every step's metrics). */
uint64_t kv_remote_hedges_cancelled(const kv_remote *r);
/* The signature counters of kv_remote_stats alone (sigs_checked, sigs_deferred). */
void kv_remote_get_sigs(const kv_remote *r, uint64_t *checked, uint64_t *deferred);

/* ---- demand metering ------------------------------------------------------
 * What the coordinator needed of each shard (a slab of the manifest: one
 * layer's expert range, the unit the hub's market trades), whoever computed
 * it: a worker, a replica that answered a hedge, or a local slab. */
typedef struct kv_remote_demand {
    uint64_t computations;      /* (token, expert) pairs of the slab the forward pass needed: each
                                   once, however many requests (retries, hedges) it took */
    uint64_t wait_us;           /* per compute call that needed the slab, the time from the call's
                                   start to its last pair's answer, summed (microseconds) */
} kv_remote_demand;
/* Counters since open, per manifest slab (kv_remote_manifest(r)->slabs[i]),
 * into out[0..min(cap, n_slabs)); returns n_slabs. Successful compute calls
 * only (a failed one produced nothing). Same thread as compute. */
size_t kv_remote_get_demand(const kv_remote *r, kv_remote_demand *out, size_t cap);

/* ---- local experts: tight when quiet, wide when busy -----------------------
 * A coordinator with slabs in the manifest's folder can compute some experts
 * itself instead of sending them out. Held slabs are chosen within a memory
 * budget, hottest first (by the demand metered so far; with none yet one
 * slab of every layer before a second of any); of the held experts, those
 * whose fixed key (a hash of layer and expert, uniform in [0, 1)) is under
 * the local share are computed here, the others go to workers (or here when
 * no worker that holds them is up). Slabs not held stay the fallback they
 * always were. Bits never depend on where a pair was computed. Same thread
 * as compute, never during it. */
/* Chooses the held slabs among those present locally, at most budget bytes
 * of slab files in all; replaces the previous choice. *held_bytes and
 * *held_slabs (may be NULL) get what was chosen. 0, or KV_ENOMEM. */
int kv_remote_local_hold(kv_remote *r, uint64_t budget, uint64_t *held_bytes, uint32_t *held_slabs, kv_diag *d);
/* The share of held experts computed here, clamped to [0, 1] (NaN: 0);
 * 0 at open. */
void kv_remote_set_local_share(kv_remote *r, double share);
double kv_remote_local_share(const kv_remote *r);

/* ---- per-session work tally ---------------------------------------------
 * What the coordinator dispatched to, and took back from, each worker, per
 * session (a tag: the engine's sequence slot), for paying nodes: batches mix
 * sessions, so each (token, expert) pair is counted under its token's tag.
 * A step's counts are kept apart until the step ends: kv_remote_tally_end
 * (commit) adds them to the totals, (!commit) drops them (a failed step
 * produced nothing anyone pays for). Not thread-safe (the forward pass's
 * thread, like compute). */
/* Allocates the counters for tags 0..n_tags-1 and every worker (zero).
 * Returns 0 or KV_ENOMEM. Not for the hot path. */
int kv_remote_tally_open(kv_remote *r, uint32_t n_tags, kv_diag *d);
/* The coming compute calls carry n_tokens tokens, token t under tags[t]
 * (borrowed until kv_remote_tally_end). A call of another size is not
 * counted. No-op before kv_remote_tally_open. */
void kv_remote_tally_begin(kv_remote *r, const uint32_t *tags, uint32_t n_tokens);
void kv_remote_tally_end(kv_remote *r, bool commit);
/* Pairs sent to and answered (accepted) by worker w for tag, since the
 * tag's last reset. Zero for a tag or worker out of range. */
void kv_remote_tally_get(const kv_remote *r, uint32_t tag, uint32_t w, uint64_t *sent, uint64_t *answered);
void kv_remote_tally_reset(kv_remote *r, uint32_t tag);

/* ---- a worker set that changes (coordinators fed by a hub's placement) ----
 * Same thread as compute, never during it. */

/* Adds worker addr (dialed at the next compute or kv_remote_tend, and used
 * from the round after its handshake passed the checks of kv_remote_open),
 * which must prove key[32] (NULL: any key; a known address named with
 * another key must prove the new one from now on, its connection redone).
 * Returns 1 if added, 0 if it was already known (a known one that is down
 * is dialed again at once), KV_ERANGE when max_workers are known, KV_EINVAL
 * for an address that does not resolve. Allocates. */
int kv_remote_add_worker(kv_remote *r, const char *addr, const uint8_t *key, kv_diag *d);
/* Progresses connections while no compute runs: dials workers whose
 * backoff passed, completes handshakes, notices peers that closed. Waits
 * at most timeout_ms (0 = just look). */
void kv_remote_tend(kv_remote *r, int timeout_ms);

/* Coverage of the slabs the forward pass needs (every slab of a MoE trunk
 * layer): a slab is covered when each of its experts is served by a worker
 * that is up now or present locally. missing gets the first cap uncovered
 * slabs (manifest indices). */
typedef struct kv_remote_coverage {
    uint32_t total, covered;    /* slabs */
    uint32_t workers_up;        /* workers handshaken now */
    uint32_t n_missing;         /* entries written to missing (at most cap) */
} kv_remote_coverage;
void kv_remote_get_coverage(const kv_remote *r, kv_remote_coverage *out, uint32_t *missing, uint32_t cap);
/* 0 when every expert of layer (a MoE layer of the manifest, the MTP
 * block's n_layer included) is served now by a worker that is up or held
 * locally; else KV_ENOTFOUND naming the layer, how many experts lack a
 * holder and the first of them (KV_ERANGE: not a MoE layer). */
int kv_remote_check_layer(const kv_remote *r, uint32_t layer, kv_diag *d);

#endif
