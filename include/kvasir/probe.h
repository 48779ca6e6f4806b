/* Probe: a short, blocking dispatch client that proves who serves an address
 * and that it computes what it claims, or reads its counters
 * (src/dispatch/probe.c; the handshake is kv_link_dial_dispatch's).
 *
 * The hub dials every node it would list: the worker at the announced
 * address must prove the node's key in the v3 handshake (so a stranger's key
 * cannot claim an honest node's address), and must answer compute
 * challenges, one random hidden state through one expert of each slab it
 * claims, within a deadline; the hub checks the answers against its own copy
 * of the slab (a hash of public bytes proves nothing: anyone can fetch them
 * from the hub). The probe proves the caller's key with a voucher (the hub
 * vouches for itself), so a worker that honours the hub's vouchers serves it.
 *
 * Every wait is bounded (connect, each frame); every frame is decoded by the
 * dispatch codec with the model's dims. Thread-safe: no shared state. */
#ifndef KVASIR_PROBE_H
#define KVASIR_PROBE_H

#include <stddef.h>
#include <stdint.h>

#include "kvasir/dispatch_proto.h"
#include "kvasir/err.h"

#define KV_PROBE_MAX_TASKS 256u /* compute challenges on one connection */

/* One compute challenge: token x through expert `expert` of layer `layer`. */
typedef struct kv_probe_task {
    uint32_t layer, expert;
} kv_probe_task;

typedef struct kv_probe_opts {
    const char *addr;                 /* "HOST:PORT" of the worker */
    const char *model_id;             /* 64 hex digits: the HELLO names it */
    const uint8_t *worker_key;        /* [32] the key the worker must prove */
    const uint8_t *sk;                /* [64] the prober's secret key (seed || pk) */
    const kv_voucher *voucher;        /* for the prober's key; NULL = none */
    uint32_t n_embd;                  /* model width: COMPUTE rows and RESULT rows */
    int connect_ms;                   /* connect and handshake deadline; 0 = 2000 */
    int answer_ms;                    /* all compute answers, after the handshake; 0 = 1500 */
} kv_probe_opts;

/* What a probe saw (filled as far as it got). */
typedef struct kv_probe_result {
    bool connected;                   /* TCP connected */
    bool key_proven;                  /* the worker proved worker_key on this connection */
    uint32_t answered;                /* tasks answered with a RESULT of the right shape */
    double handshake_ms, answer_ms;   /* time of each phase */
    double task_min_ms;               /* the quickest single compute answer (one round trip plus one
                                         expert on one token): bounds the round trip from above; 0 = none */
    char backend[KV_PROTO_MAX_NAME + 1]; /* from HELLO_ACK */
} kv_probe_result;

/* Dials o->addr, handshakes (the worker must prove o->worker_key; the
 * prober proves its key), then sends one COMPUTE per task (x[t] of n_embd
 * floats, f32 on the wire) and reads y[t][n_embd]. Returns 0 when every task
 * was answered within o->answer_ms in total; KV_EAUTH when the worker proved
 * another key or a bad signature; KV_ETIMEOUT past a deadline; KV_EIO when
 * the peer is unreachable or closed; KV_EPROTO / KV_ERANGE for a bad frame;
 * the worker's own code when it answered an ERROR (e.g. KV_ENOTFOUND for an
 * expert it does not hold). res says how far it got. Non-finite outputs are
 * returned as they came (the caller judges them). */
int kv_probe_worker(const kv_probe_opts *o, const kv_probe_task *tasks, uint32_t n_tasks, const float *x, float *y,
                    kv_probe_result *res, kv_diag *d);

/* A worker's counters: the same handshake, then STATS, which a worker
 * answers only on an authenticated connection. o->n_embd may be 0 (not
 * checked); o->answer_ms bounds the STATS answer (0 = 2000). Returns 0 and
 * *out, or the handshake's errors, or the worker's ERROR code. */
int kv_probe_stats(const kv_probe_opts *o, kv_msg_stats *out, kv_diag *d);

#endif
