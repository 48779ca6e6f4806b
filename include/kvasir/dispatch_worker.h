/* Dispatch worker (src/dispatch/worker.c): serves expert slabs to
 * coordinators over the dispatch protocol (kvasir/dispatch_proto.h) on one
 * event loop (kvasir/net.h) and a compute pool, with a memory budget,
 * handshake deadlines and per-address caps on strangers. */
#ifndef KVASIR_DISPATCH_WORKER_H
#define KVASIR_DISPATCH_WORKER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/dispatch_proto.h"
#include "kvasir/err.h"


typedef struct kv_worker kv_worker;

typedef struct kv_worker_opts {
    const char *slabs;     /* a folder of slab *.gguf (or a slice folder with experts/),
                              or a comma-separated list of slab files */
    const char *listen;    /* "HOST:PORT"; port 0 picks a free one */
    int n_threads;         /* compute pool; 0 = all CPUs */
    int max_conns;         /* concurrent connections; 0 = 64 (newcomers wait for their
                              handshake beyond it only while idle authenticated ones exist,
                              which a successful AUTH then displaces) */
    int read_timeout_ms;   /* a frame started must complete within this; 0 = 10000 */
    int idle_timeout_ms;   /* a connection with no frame for this long is closed; 0 = none */
    bool quiet;            /* no per-connection log lines */
    int handshake_timeout_ms; /* HELLO must complete within this after accept; 0 = 5000 */
    int max_pending_per_addr; /* connections of one address (IPv4, or IPv6 /64) awaiting
                              their handshake; 0 = 8 (then the least advanced yields) */
    int max_pending;       /* connections awaiting their handshake, all addresses; 0 = 64
                              (when full, one of an address holding more yields, else the
                              newcomer is refused) */
    int evict_idle_ms;     /* when full, an authenticated connection without COMPUTE for this
                              long yields its place to a newly authenticated peer (never to
                              a stranger); 0 = 10000 */
    int write_timeout_ms;  /* queued output must make progress within this; 0 = 30000 */
    size_t mem_budget;     /* bytes all connections may buffer together; 0 = 1 GiB */
    uint64_t max_request_cost; /* multiply-adds one COMPUTE may ask for (3 n_embd n_ff per
                              pair, announced as max_pairs); 0 = 2^36 */
    bool allow_sparse;     /* a slab file with holes (a sliced skeleton) is not hashed: its
                              hash is announced as 32 zero bytes, which only a coordinator
                              whose manifest has no hash for it (and that allows sparse
                              pieces) accepts; off: every file is hashed */
    /* Authenticated dispatch (v3): a coordinator is served only once it has
     * proved a key in allow_keys, or one that the hub with hub_key vouches
     * for. One of the two must be given. */
    const uint8_t *key_sk;          /* [64] this worker's Ed25519 secret key (seed || pk); NULL =
                                       a fresh random key for this process */
    const uint8_t (*allow_keys)[32]; /* [n_allow_keys] coordinator keys served (copied) */
    size_t n_allow_keys;
    const uint8_t *hub_key;         /* [32] hub whose vouchers are honored, NULL = none */
    int test_lie;                   /* TEST ONLY (kvasir worker --test-lie=MODE): a KV_WORKER_LIE_*
                                       that makes this worker return wrong numbers, so that the
                                       coordinator's checks can be tested; 0 = honest */
    bool opencl;           /* compute experts with the OpenCL backend (kvasir/opencl.h) and
                              announce "opencl"; off: the CPU kernels kv_quant_backend() names */
    int test_delay_ms;     /* TEST ONLY (kvasir worker --test-delay=MS): every COMPUTE waits
                              this long before it is computed (a slow worker); 0 = none */
    int test_stall_ms;     /* TEST ONLY (kvasir worker --test-stall-ms=N --test-stall-every=M):
                              every M-th COMPUTE this worker takes (counted over all its
                              connections) waits N ms more before it is computed (a replica
                              that stalls now and then; hedged requests are tested with it);
                              each stall is logged on stderr; 0 = none. At most 60000 */
    int test_stall_every;  /* M above, 1..1000000; 0 with test_stall_ms > 0 = every COMPUTE */
    bool insecure_plaintext; /* --insecure-plaintext: serve plaintext coordinators from any
                              address; off: TLS (v5, the key handshake bound to the session)
                              is required of every peer that is not on loopback, and a
                              plaintext peer elsewhere gets an ERROR saying so. A TLS peer is
                              always served (the transport is told by its first byte). */
} kv_worker_opts;

/* Lies a test worker tells (docs/VERIFY.md); never use outside tests. */
enum kv_worker_lie {
    KV_WORKER_LIE_NONE = 0,
    KV_WORKER_LIE_NOISE,  /* about 1% of pairs: one output element moved by 1e-3 of the row's max */
    KV_WORKER_LIE_SWAP,   /* every pair: another held expert's answer */
    KV_WORKER_LIE_STALE,  /* every pair after the first round: computed on the previous round's inputs */
    KV_WORKER_LIE_LATER,  /* honest for its first 64 pairs, then NOISE on every pair */
    KV_WORKER_LIE_BADSIG, /* honest numbers, every signature (v4+) wrong: caught on its first answer */
    KV_WORKER_LIE_COUNT
};
/* "noise", "swap", "stale", "later" -> KV_WORKER_LIE_*, or -1. */
int kv_worker_lie_from_name(const char *name);

/* Opens the slabs (all from one model: same kvasir.source.id and dims;
 * no two holding the same expert), builds the compute provider and binds
 * the listening socket. Errors: KV_EIO, KV_EFORMAT, KV_EINVAL, KV_ENOTFOUND
 * (no slabs). Free with kv_worker_free (accepts NULL). */
int kv_worker_open(kv_worker **out, const kv_worker_opts *opts, kv_diag *d);
void kv_worker_free(kv_worker *w);
/* The bound address, "HOST:PORT" with the actual port. */
const char *kv_worker_addr(const kv_worker *w);
/* Model identity the slabs carry, and what they hold. */
const char *kv_worker_model_id(const kv_worker *w);
size_t kv_worker_ranges(const kv_worker *w, const kv_held_range **out);
/* Serves until kv_worker_stop is called (from another thread or a signal
 * handler: async-signal-safe), on this thread (one event loop for every
 * connection) and the compute pool: the thread count does not depend on
 * the number of connections. Returns 0 or KV_EIO. */
int kv_worker_serve(kv_worker *w, kv_diag *d);
void kv_worker_stop(kv_worker *w);
/* The worker's public key (announced in AUTH_CHALLENGE). */
const uint8_t *kv_worker_key(const kv_worker *w);
/* Replaces the allowed keys and the hub key (hub_key NULL = keep the
 * current one). Thread-safe (the node refreshes them while the worker
 * serves); takes effect for handshakes that complete afterwards. KV_ENOMEM. */
int kv_worker_set_auth(kv_worker *w, const uint8_t (*keys)[32], size_t n, const uint8_t *hub_key, kv_diag *d);
/* Counters (thread-safe snapshot). */
void kv_worker_stats(const kv_worker *w, kv_msg_stats *out);
/* Bytes the connections buffer now and the most so far (thread-safe; NULL
 * pointers are skipped). */
void kv_worker_mem(const kv_worker *w, size_t *now, size_t *peak);

#endif
