/* The remote expert provider: the coordinator's side of dispatch.
 *
 * kv_remote_open loads what a coordinator needs and nothing more: the
 * manifest, the backbone (size, SHA-256 and identity checked against the
 * manifest), and whichever slabs happen to be present in the manifest's
 * folder (verified the same way; they are the local fallback). It then
 * connects to every worker, handshakes (protocol version, model identity
 * equal to the manifest's, dims), and checks that every (layer, expert) of
 * every MoE layer is served by a connected worker or a local slab; if not,
 * it fails naming the first one missing, before any token is computed.
 *
 * compute(req), once per MoE layer and step, runs in rounds:
 *   1. each pending (token, rank) slot is given to a worker that holds its
 *      expert: all slots of one expert go to one worker, and each expert to
 *      the holder expected to answer first (kv_remote_pick: its measured
 *      answer time per pair, the pairs it already has this round, and what
 *      it still has in flight that we no longer wait for), the better of
 *      two drawn at random when more than two hold it; near-equal
 *      expectations are shared by load and a rotation keyed on the expert;
 *   2. one COMPUTE per worker carries the hidden states of the tokens it
 *      needs and its pairs; all are queued at once on the workers'
 *      connections (one event loop, include/kvasir/net.h), slots nobody
 *      serves are computed from local slabs meanwhile, and the answers are
 *      gathered by running the loop under the round's deadline;
 *   3. each RESULT is checked (request id, type, pair count, dims,
 *      encoding) and its vectors copied to their slots. A worker that
 *      closes, errs, stalls past the deadline or answers anything else is
 *      dropped (socket closed, so no late answer can ever be taken) and
 *      its slots stay pending for the next round, on another holder or
 *      locally. A request not answered by its hedge time (below) is also
 *      sent, whole, to a replica; each slot takes the first answer that
 *      passes every check, and the other request is superseded. A round
 *      either finishes slots or drops a worker, so rounds are bounded. When a pending expert has no holder up, every worker
 *      that is down is dialed at once and the handshakes awaited (once per
 *      call: a holder may have restarted, or closed an idle connection);
 *      if still nobody holds it, compute fails with a message naming it
 *      and why each of its holders is gone.
 * A slot's output is always one worker's (or the local provider's) whole
 * answer for that (token, expert), and every one of those is bit-identical
 * to the in-process computation (same kernels, one dot product per output
 * element, independent of which tokens share a message), so the forward
 * pass, which sums in rank order, gets the local run's bits. A request that
 * fails leaves no partial output to be used: the forward pass stops.
 *
 * Slow replicas are demoted: every worker keeps an estimate of its answer
 * time (a moving average of its RESULTs' round trips; a drop for a missed
 * deadline is handled by the backoff below, not measured). A holder whose
 * estimate exceeds KV_REMOTE_SLOW_FACTOR times the fastest holder's plus
 * KV_REMOTE_SLOW_MARGIN_S gets no slots while that faster holder is up:
 * one answer 0.9 s late beside a replica answering in a millisecond is
 * enough. A demoted worker is probed after KV_REMOTE_PROBE_S (doubled per
 * probe that was still slow, up to KV_REMOTE_PROBE_MAX_S): it is sent the
 * slots of one expert that another worker also computes this round; the
 * probe is not waited for, its answer is timed and never used, and one
 * fast answer makes its estimate fast again. Which replica answers a slot
 * never changes the bits (see above).
 *
 * Hedged requests: every worker keeps its last KV_REMOTE_LAT_RING answer
 * times. A request is hedged at KV_REMOTE_HEDGE_FACTOR times its worker's
 * p95, but no later than KV_REMOTE_HEDGE_TAIL times its p50 (a worker that
 * stalls often has the stalls in its p95) and no sooner than
 * KV_REMOTE_HEDGE_FLOOR_S (before the worker's first answer:
 * KV_REMOTE_HEDGE_TAIL times the fastest other worker's estimate, as soon
 * as one has answered, in the same round if need be). The
 * hedge goes to a replica that holds every expert of the request, is up,
 * idle and not demoted, the one expected to answer first; at most one per
 * request, none of a hedge, and no more than hedge_budget per request sent
 * (bursts of KV_REMOTE_HEDGE_BURST; a hedge whose loser was cancelled before
 * it computed anything duplicated no work, and its token is given back).
 * The first answer that passes the
 * checks settles the slots (a lie settles nothing: the other request still
 * counts); the other request is superseded. A worker of protocol v6 is
 * sent a CANCEL for it at once: it answers CANCELLED (it dropped the
 * request before computing it), which is counted (cancelled) but is no
 * latency sample (how soon a worker drops work says nothing of how soon it
 * computes), or the RESULT it had already begun. An older worker has no
 * cancel: its answer is awaited on its connection, timed (a latency
 * sample: a stall is measured) and discarded. Either way the worker is not
 * faulted, only counted (late answers, cancelled), and the answer is told
 * from the current request's by its request id; it is expected busy until
 * then (kv_rw_backlog), so no new work queues behind a stall. Only a
 * superseded request unanswered past timeout_ms drops its worker. Tokens
 * never depend on which request won: both are whole answers of the same
 * pairs.
 *
 * Local experts and demand: slabs held within a budget
 * (kv_remote_local_hold) are computed here for the experts whose fixed key
 * is under the local share (the gateway's policy moves it with its load);
 * those slots are assigned KV_OWN_LOCAL before any worker is picked. Every
 * successful call adds, per manifest slab, the pairs it needed and the time
 * from its start to the slab's last answer (kv_remote_get_demand): what a
 * coordinator reports to the hub's market.
 *
 * A worker that answers the handshake with ERANGE has no room now (its
 * places are working, or strangers hold its handshake places): that is not
 * a fault, so it is dialed again after a short randomized wait (20 ms,
 * doubling, at most 1 s) until the handshake's deadline, and only then
 * counted as unavailable.
 *
 * Dropped workers are reconnected asynchronously: once their backoff has
 * passed, a nonblocking dial and HELLO are started at the next compute
 * call and progressed by the same loop; the worker is used again from
 * the round after its HELLO_ACK passed the same checks as at open. The
 * backoff doubles with every drop or failed dial since the worker's last
 * accepted RESULT (reconnect_ms, 2x, 4x... up to 60 s), so a worker that
 * handshakes and then stalls or lies costs a timeout ever more rarely; one
 * with two or more such failures is quarantined: not dialed early even when
 * its experts have no other holder.
 *
 * Transport: TLS 1.3 pinned to the key the worker is listed with (no pin
 * when none is), v5, the exporter bound into both signatures; plain TCP
 * only with opts->insecure_plaintext. A worker that answers the ClientHello
 * in plaintext is read for its ERROR only (a busy refusal: retried).
 *
 * Handshake (protocol v3 and later): after HELLO_ACK the worker sends its key
 * and a challenge; we sign the transcript with the coordinator key (and
 * attach the hub's voucher when we have one), and the worker's AUTH_OK must
 * verify under the key it announced, which must be the one it is listed
 * with when opts->worker_keys names one (docs/PROTOCOL.md, Authentication).
 * The HELLO_ACK lists every slab the worker
 * serves with its SHA-256; each must be a slab of the manifest with the same
 * experts and hash, and every expert the worker announces must lie in one
 * of them: a worker holding other bytes (a model with the same header and
 * other weights has the same model id) is refused. Every value of a RESULT
 * must be finite and within KV_PROTO_MAX_ABS_OUTPUT; otherwise the whole
 * answer is a lie: the worker is dropped and its slots are redone.
 *
 * Signed results (v4, docs/PROTOCOL.md): every answer's signature is
 * checked against the leaves rebuilt from what we sent (each token's row
 * re-encoded and hashed once) and what came back; one that does not verify
 * is a lie like any other. When a check catches a lie on pair p, the
 * leaves still at hand give p's Merkle proof, and on_caught gets the
 * evidence (rows copied into r's scratch) for the hub.
 *
 * Hot path: every buffer (frames in and out, gathered hidden states, pair
 * lists, local fallback scratch, round-trip samples) is allocated in
 * kv_remote_open for max_tokens tokens per call; compute never allocates.
 * Requests larger than one frame's limits are split by tokens. Not
 * thread-safe: one compute at a time (the forward pass's thread). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/dispatch_evidence.h"
#include "kvasir/dispatch_proto.h"
#include "kvasir/dispatch_receipt.h"
#include "kvasir/dispatch_remote.h"
#include "kvasir/node.h"
#include "kvasir/ledger.h"
#include "kvasir/net.h"
#include "kvasir/pieces.h"
#include "kvasir/quant.h"
#include "kvasir/relay.h"
#include "kvasir/verify.h"

#define KV_REMOTE_RTT_SAMPLES (1u << 16) /* round trips kept for percentiles (ring) */
#define KV_REMOTE_WHY 256u
#define KV_REMOTE_MAX_BACKOFF_S 60.0     /* longest wait between dials of one worker */
#define KV_REMOTE_BUSY_FIRST_S 0.02     /* first redial after a worker had no room for us */
#define KV_REMOTE_BUSY_MAX_S 1.0        /* longest wait between such redials */
#define KV_REMOTE_SLOW_FACTOR 4.0       /* a replica answering this much slower than the best */
#define KV_REMOTE_SLOW_MARGIN_S 0.1     /*   ... plus this, is demoted */
#define KV_REMOTE_LAT_ALPHA 0.25        /* weight of a new answer time in the estimate */
#define KV_REMOTE_SIG_RATE (1.0 / 16)   /* over TLS: answers whose signature is checked on arrival */
#define KV_REMOTE_PROBE_S 1.0           /* a demoted worker is probed this long after, doubled
                                           per probe that was still slow ... */
#define KV_REMOTE_PROBE_MAX_S 60.0      /*   ... up to this */
#define KV_REMOTE_LAT_RING 32u          /* answer times kept per worker for its p50 and p95 */
#define KV_REMOTE_HEDGE_FACTOR 1.5      /* a request is hedged after this times its worker's p95 ... */
#define KV_REMOTE_HEDGE_TAIL 4.0        /*   ... but no later than this times its p50 ... */
#define KV_REMOTE_HEDGE_FLOOR_S 0.01    /*   ... and no sooner than this */
#define KV_REMOTE_HEDGE_BUDGET 0.1      /* hedges per request sent, by default */
#define KV_REMOTE_HEDGE_BURST 4.0       /* hedges that may be sent back to back */
#define KV_REMOTE_MAX_GHOSTS 4u         /* superseded requests awaited per worker */
#define KV_REMOTE_TX_SPARE 4096u        /* a connection's send queue beyond its largest frame (CANCELs) */
#define KV_REMOTE_LAT_STALE_S 0.5       /* an answer time older than this no longer steers the choice */
#define KV_REMOTE_PICK_RATIO 2.0        /* a holder is preferred when expected to answer this many */
#define KV_REMOTE_PICK_SLACK_S 0.002    /*   times sooner, plus this; else load and rotation decide */
#define KV_REMOTE_PROTO_MIN KV_PROTO_AUTH_VERSION /* v1 workers cannot prove their slabs' bytes,
                                                    v2 workers cannot authenticate */

enum kv_rw_state {
    KV_RW_DOWN,       /* no socket; retried at retry_at */
    KV_RW_CONNECTING, /* nonblocking connect in progress; HELLO queued */
    KV_RW_HELLO,      /* connected; HELLO (being) sent, waiting for HELLO_ACK */
    KV_RW_CHALLENGE,  /* HELLO_ACK accepted; waiting for AUTH_CHALLENGE */
    KV_RW_AUTH,       /* AUTH sent; waiting for AUTH_OK (the worker's proof) */
    KV_RW_UP,         /* handshaken; idle or busy with one COMPUTE */
    KV_RW_RETRY,      /* it had no room for us (ERANGE at the handshake): dialed again at
                         retry_at, until hs_deadline */
};

typedef struct kv_rw {
    char addr[280];               /* "HOST:PORT" as given */
    struct sockaddr_storage sa;   /* resolved once at open */
    socklen_t salen;
    kv_net_conn *nc;              /* NULL when DOWN */
    enum kv_rw_state state;
    double retry_at;              /* DOWN: monotonic seconds of the next connect attempt */
    double hs_deadline;           /* CONNECTING..AUTH, RETRY: give up at */
    uint32_t busy_tries;          /* ERANGE answers to handshakes since the last one that passed */
    uint32_t enc;                 /* encoding used with this worker (negotiated) */
    char backend[KV_PROTO_MAX_NAME + 1];
    uint8_t *holds;               /* [n_layer*n_expert] 1 if this worker serves the expert */
    uint32_t n_ranges;            /* ranges announced in the last HELLO_ACK */
    kv_remote *r;                 /* owner (for the connection's callbacks) */
    size_t scap, rcap;            /* largest frame sent / received */
    /* the request in flight (UP and busy) */
    bool busy;                    /* a COMPUTE is in flight */
    uint32_t req_id;              /* id of the last frame sent */
    uint32_t n_pairs;             /* pairs sent */
    int32_t *pair_slot;           /* [max_pairs] request slot of each pair sent */
    kv_proto_pair *pairs;         /* [max_pairs] encode input */
    /* counters */
    uint64_t n_req, n_pairs_done, n_pairs_since, n_drops, n_connects;
    uint32_t fails;               /* drops and failed dials since its last good RESULT */
    uint32_t max_pairs;           /* pairs it accepts per COMPUTE (HELLO_ACK) */
    char why[KV_REMOTE_WHY];      /* last reason it was dropped or refused */
    /* authentication */
    uint8_t expect[32];           /* the key it must prove; all zero = any */
    kv_tls *tls;                  /* the TLS session of nc (owned by it) once open; NULL over plain TCP */
    kv_link_sniff *tp;            /* nc's transport when dialed TLS (owned by nc) */
    bool plain_answer;            /* dialed TLS, answered in plaintext: only an ERROR is read */
    uint8_t key[32];              /* the key it announced in AUTH_CHALLENGE */
    /* a RECEIPT_REQ in flight (kv_remote_receipt) */
    bool rcpt_wait;               /* asked, not answered */
    uint32_t rcpt_id;             /* its request id */
    int rcpt_rc;                  /* 0 signed, KV_LEDGER_RRECEIPT refused */
    kv_receipt_req rcpt_req;      /* what was asked */
    kv_receipt rcpt;              /* the answer, verified */
    uint8_t challenge[32];        /* its challenge on this connection */
    uint8_t nonce[32];            /* ours on this connection */
    uint16_t version;             /* negotiated on this connection */
    bool pre;                     /* it returns pre-activations (verified compute) */
    bool caught;                  /* caught lying: never used again */
    bool sig_seen;                /* a signature of this connection was checked (the first always is) */
    uint64_t n_verified;          /* its pairs that passed the checks */
    /* answer time: slow replicas are demoted (kv_remote_pick) */
    double sent_at;               /* the COMPUTE in flight was queued at (monotonic s) */
    double lat_s;                 /* estimated answer time (EWMA of RESULT round trips); 0 = none yet */
    float lat_ring[KV_REMOTE_LAT_RING]; /* its last answer times (s), for p50 and p95 */
    uint32_t n_lat;               /* answer times taken (the ring holds the last KV_REMOTE_LAT_RING) */
    double lat_t;                 /* when the last one was taken (monotonic s) */
    double avg_pairs;             /* pairs per answered request (EWMA); 0 = none yet */
    /* hedging (kv_remote_hedge) */
    double hedge_at;              /* the COMPUTE in flight is hedged when not answered by then; INFINITY = never */
    int32_t twin;                 /* the worker computing the same slots as the COMPUTE in flight, -1 = none */
    bool is_hedge;                /* the COMPUTE in flight is a hedge of twin's */
    struct kv_rw_ghost {          /* superseded requests (a replica answered first): their answers are */
        uint32_t id, n_pairs;     /*   timed and discarded, the worker is not faulted for them */
        double sent;
        double cancel_at;         /* a CANCEL was sent then (v6): CANCELLED may answer it; 0 = none */
    } ghost[KV_REMOTE_MAX_GHOSTS];
    uint32_t n_ghost;
    uint64_t n_hedged, n_hedges_won, n_late; /* its requests hedged; hedges it won; late answers discarded */
    uint64_t n_cancelled;         /* its superseded requests it dropped on our CANCEL (CANCELLED) */
    bool probing;                 /* a probe is in flight: its answer is timed, never used */
    uint32_t probe_id, probe_pairs; /* its request id and pair count */
    double probe_sent;            /* queued at */
    double probe_at;              /* demoted: next probe due at; 0 = not demoted */
    uint32_t slow_probes;         /* probes since it was last used that were still slow */
    uint32_t probe_e1;            /* this round: 1 + an expert to probe it with; 0 = none */
    uint64_t n_probes;
} kv_rw;

struct kv_remote {
    kv_remote_opts o;
    uint8_t pk[32], sk[64];       /* the coordinator's identity (o.key_sk copied) */
    kv_tls_ctx *tls;              /* its TLS context; NULL with o.insecure_plaintext */
    kv_voucher voucher;           /* sent in AUTH when has_voucher */
    bool has_voucher;
    kv_manifest *m;
    kv_verify *ver;               /* NULL without verify */
    float *vg, *vu, *vy;          /* [4][n_ff], [4][n_ff], [n_embd] up to four answers of one expert being
                                     checked together (kv_verify_check_batch) */
    uint8_t *vdone;               /* [max_slots] pairs of the answer being checked already grouped */
    /* v4 signed results: checked on every answer, kept for evidence */
    uint8_t (*xh)[32];            /* [chunk_tokens] hash of each token row of the answer being checked */
    uint8_t *xh_ok;               /* [chunk_tokens] 1 once xh[t] is computed for that answer */
    uint8_t (*leaves)[32];        /* [max_slots] its leaves */
    uint8_t *xrow, *yrow;         /* [n_embd * 4] one x row re-encoded as sent, one y row as answered */
    kv_evidence ev;               /* what the worker caught last signed for the pair (rows in xrow, yrow) */
    bool has_ev;                  /* ev is for the catch being handled */
    const kv_expert_req *cur_req; /* the request of the chunk in progress */
    uint32_t cur_t0;              /* its first token */
    uint64_t rng;                 /* sampled recompute */
    uint64_t sig_rng;             /* xorshift state: answers whose signature is checked on arrival over TLS */
    bool sig_done;                /* the answer in hand had its signature checked (r->leaves are its leaves) */
    uint64_t n_sig_checked, n_sig_deferred;
    uint64_t n_verified, n_unverified, n_recomputed, n_caught;
    kv_model *model;              /* the backbone (no routed experts) */
    kv_pool *pool;                /* borrowed */
    kv_expert_provider prov;      /* what the forward pass calls */
    uint32_t n_layer, n_expert, n_embd, n_ff, n_used;
    uint32_t max_tokens;          /* tokens per compute call */
    uint32_t chunk_tokens;        /* tokens per round (frame limits) */
    uint32_t max_slots;           /* chunk_tokens * n_used */
    double timeout_s, reconnect_s;
    /* workers */
    kv_rw *w;                     /* [cap_w], the first n_w in use (never moved: connections
                                     point at their kv_rw) */
    uint32_t n_w, cap_w;
    size_t w_scap, w_rcap;        /* a worker's largest frame sent / received */
    kv_net_loop *loop;            /* every worker connection */
    float *cur_out;               /* where answers of the current poll go (NULL: none expected) */
    int n_done;                   /* requests completed in the current poll */
    /* per-round scratch */
    int32_t *slot_owner;          /* [max_slots] worker, KV_OWN_LOCAL, or KV_OWN_DONE */
    int32_t *exp_owner;           /* [n_expert] worker this round, -1 unassigned */
    uint32_t *load;               /* [n_w] pairs assigned this round */
    int32_t *tok_local;           /* [chunk_tokens] index of a token in the frame being built, -1 */
    float *xg;                    /* [chunk_tokens][n_embd] gathered hidden states */
    /* local fallback: slabs present in the manifest's folder */
    kv_gguf **lg;                 /* [m->n_slabs] open slab, NULL if absent */
    kv_expert_weights *lw;        /* [n_layer*n_expert] views */
    uint8_t *lhas;                /* [n_layer*n_expert] 1 if present locally */
    size_t n_local_slabs;
    kv_expert_provider local;     /* over lw; .compute NULL when no slab is present */
    float *lx, *lout;             /* [max_slots][n_embd] gathered inputs / outputs */
    int32_t *lids, *lslot;        /* [max_slots] expert (n_used = 1) / request slot */
    /* stats */
    uint64_t n_calls, n_rounds, n_retry_pairs, n_pairs_remote, n_pairs_local, bytes_sent, bytes_recv;
    uint64_t n_hedges, n_hedges_won, n_late, n_cancelled;
    uint64_t n_hedge_pairs;     /* (token, expert) slots sent again in hedges */
    double hedge_budget;          /* hedges per request sent; 0 = never */
    double hedge_tokens;          /* hedges that may be sent now (grows by hedge_budget per request) */
    uint64_t pick_rng;            /* xorshift state: the two replicas compared (kv_remote_pick) */
    float *rtt_us;                /* [KV_REMOTE_RTT_SAMPLES] ring */
    uint64_t n_rtt;
    /* per-session work tally (kvasir/dispatch_remote.h): [n_tags][t_stride] each */
    uint32_t n_tags, t_stride;    /* tags; workers per tag row (workers past it are not counted) */
    uint64_t *t_sent, *t_ans;     /* committed */
    uint64_t *ts_sent, *ts_ans;   /* this step */
    const uint32_t *tags;         /* [tag_n] tag of each token of the step's calls, NULL none */
    uint32_t tag_n;
    const uint32_t *tag_rows;     /* this call's row -> the step's token (kv_expert_req.tok), NULL: the same */
    bool tag_on;                  /* the current compute call is counted */
    /* demand metering, per manifest slab (kv_remote_get_demand) */
    int32_t *slab_of;             /* [n_layer*n_expert] manifest slab of each expert, -1 none */
    uint64_t *dm_n, *dm_wait_us;  /* [n_slabs] expert computations needed / microseconds waited */
    double *dm_done;              /* [n_slabs] this call: when the slab's last slot was done */
    uint64_t *dm_mark;            /* [n_slabs] the call (n_calls) that dm_done belongs to */
    /* local experts (kv_remote_local_hold): computed here while their key is under local_share */
    uint8_t *lhold;               /* [n_layer*n_expert] 1 if held (a slab kept within the budget) */
    double local_share;           /* [0, 1]: share of held experts computed here (by kv_share_key) */
    uint64_t n_pairs_held_local;  /* slots computed here from held slabs */
};

enum { KV_OWN_DONE = -1, KV_OWN_LOCAL = -2, KV_OWN_NONE = -3 };

static double kv_mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static void kv_rlog(const kv_remote *r, const char *fmt, ...) {
    if (!r->o.log) return;
    va_list ap;
    va_start(ap, fmt);
    fputs("kvasir remote: ", r->o.log);
    vfprintf(r->o.log, fmt, ap);
    fputc('\n', r->o.log);
    fflush(r->o.log);
    va_end(ap);
}

/* ---- workers: connection state machine ----------------------------------- */

static bool kv_rw_handshaking(const kv_rw *w) {
    return w->state == KV_RW_CONNECTING || w->state == KV_RW_HELLO || w->state == KV_RW_CHALLENGE ||
           w->state == KV_RW_AUTH || w->state == KV_RW_RETRY;
}

/* Seconds to wait before dialing w again: reconnect_ms doubled per failure
 * since its last good RESULT, at most KV_REMOTE_MAX_BACKOFF_S. */
static double kv_rw_backoff(const kv_remote *r, const kv_rw *w) {
    double s = r->reconnect_s;
    for (uint32_t i = 1; i < w->fails && s < KV_REMOTE_MAX_BACKOFF_S; i++) s *= 2;
    return s < KV_REMOTE_MAX_BACKOFF_S ? s : KV_REMOTE_MAX_BACKOFF_S;
}

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
/* Closes w and marks it DOWN with a reason; it is retried after
 * reconnect_ms. Its pairs in flight (if any) stay pending for the caller. */
static void kv_rw_drop(kv_remote *r, kv_rw *w, const char *fmt, ...) {
    char prev[KV_REMOTE_WHY];
    memcpy(prev, w->why, sizeof prev);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(w->why, sizeof w->why, fmt, ap);
    va_end(ap);
    if (w->nc) { /* closed now: no late answer can ever be taken */
        kv_net_conn *c = w->nc;
        w->nc = NULL;
        w->tls = NULL;
        kv_net_conn_close(c, 0, NULL);
    }
    const bool was_up = w->state == KV_RW_UP;
    w->state = KV_RW_DOWN;
    w->busy = false;
    w->probing = false;
    w->n_ghost = 0; /* their answers can no longer come */
    if (w->twin >= 0) r->w[w->twin].twin = -1; /* its twin's request stands alone */
    w->twin = -1;
    w->is_hedge = false;
    w->busy_tries = 0;
    w->fails++;
    w->retry_at = kv_mono() + kv_rw_backoff(r, w);
    if (was_up) w->n_drops++;
    if (was_up) kv_rlog(r, "worker %s dropped: %s", w->addr, w->why);
    else if (strcmp(prev, w->why)) kv_rlog(r, "worker %s: cannot connect: %s", w->addr, w->why);
}

/* Starts a nonblocking connect and queues HELLO. On immediate failure the
 * worker stays DOWN (with a new retry time). */
static const kv_net_conn_cbs kv_rw_cbs;

static void kv_rw_connect(kv_remote *r, kv_rw *w, double now) {
    const bool redial = w->state == KV_RW_RETRY; /* within the first dial's deadline */
    w->retry_at = now + kv_rw_backoff(r, w);
    const kv_net_conn_opts o = {
        .header = KV_PROTO_HEADER,
        .max_frame = w->rcap,
        .tx_max = w->scap + KV_REMOTE_TX_SPARE, /* one COMPUTE (or HELLO) at a time, and room to spare */
        .keep = SIZE_MAX, /* compute never reallocates once the buffers have grown */
    };
    kv_diag d = {0};
    kv_net_conn *c = NULL;
    /* TLS pinned to the key it is listed with (when one is), unless plaintext was asked for */
    static const uint8_t zero[32];
    kv_net_conn_opts oo = o;
    kv_link_sniff *t = NULL;
    if (r->tls) {
        if (kv_link_sniff_new_client(&t, r->tls, memcmp(w->expect, zero, 32) ? w->expect : NULL, &d)) {
            snprintf(w->why, sizeof w->why, "%.200s", d.msg);
            w->fails++;
            return;
        }
        oo.io = &kv_link_sniff_io;
        oo.io_ctx = t;
    }
    if (kv_net_conn_dial(&c, r->loop, (const struct sockaddr *)&w->sa, w->salen, 0, &oo, &kv_rw_cbs, w, &d)) {
        snprintf(w->why, sizeof w->why, "%.200s", d.msg);
        w->fails++;
        return;
    }
    w->tp = t;
    w->tls = NULL;
    w->plain_answer = false;
    kv_msg_hello h = {t ? KV_PROTO_TLS_VERSION : KV_REMOTE_PROTO_MIN, KV_PROTO_VERSION, {0},
                      (1u << KV_ENC_F32) | (1u << r->o.enc) | (r->ver ? KV_PROTO_CAP_PREACT : 0)};
    memcpy(h.model_id, r->m->model_id, sizeof h.model_id);
    size_t n = 0;
    uint8_t *p = kv_net_conn_reserve(c, KV_PROTO_HEADER + KV_PROTO_HELLO_SIZE);
    if (!p || kv_msg_hello_encode(p, KV_PROTO_HEADER + KV_PROTO_HELLO_SIZE, 0, &h, &n, &d)) {
        snprintf(w->why, sizeof w->why, "HELLO: %.200s", d.msg);
        kv_net_conn_close(c, 0, NULL);
        return;
    }
    kv_net_conn_commit(c, n);
    r->bytes_sent += n;
    w->nc = c;
    w->state = KV_RW_CONNECTING;
    if (!redial) w->hs_deadline = now + r->timeout_s;
    w->busy = false;
}

/* w answered our handshake with ERANGE: it has no room now (its places
 * are doing work, or strangers fill its handshake places). Not a fault:
 * dialed again after a short randomized wait, doubling per refusal, until
 * the handshake's deadline. */
static void kv_rw_busy(kv_remote *r, kv_rw *w, const char *msg) {
    snprintf(w->why, sizeof w->why, "no room: %.200s", msg);
    if (w->nc) {
        kv_net_conn *c = w->nc;
        w->nc = NULL;
        w->tls = NULL;
        kv_net_conn_close(c, 0, NULL);
    }
    double s = KV_REMOTE_BUSY_FIRST_S;
    for (uint32_t i = 0; i < w->busy_tries && s < KV_REMOTE_BUSY_MAX_S; i++) s *= 2;
    if (s > KV_REMOTE_BUSY_MAX_S) s = KV_REMOTE_BUSY_MAX_S;
    s *= 0.5 + (double)randombytes_uniform(1000) / 1000.0; /* coordinators behind one address spread out */
    w->busy_tries++;
    w->state = KV_RW_RETRY;
    w->busy = w->probing = false;
    w->retry_at = kv_mono() + s;
    if (w->busy_tries == 1) kv_rlog(r, "worker %s has no room now, dialing again: %s", w->addr, msg);
}

/* Checks a HELLO_ACK against the manifest and records what w holds. */
static int kv_rw_accept_ack(kv_remote *r, kv_rw *w, const kv_msg_hello_ack *a, kv_diag *d) {
    if (a->version < KV_REMOTE_PROTO_MIN || a->version > KV_PROTO_VERSION)
        return kv_fail(d, KV_EUNSUPPORTED, "speaks protocol version %u (we speak %u-%u: v1 cannot prove its slabs, v2 cannot authenticate)",
                       a->version, KV_REMOTE_PROTO_MIN, KV_PROTO_VERSION);
    if (w->tp && a->version < KV_PROTO_TLS_VERSION)
        return kv_fail(d, KV_EUNSUPPORTED, "chose protocol version %u over TLS, which binds nothing to it (v%u needed)",
                       a->version, KV_PROTO_TLS_VERSION);
    if (memcmp(a->model_id, r->m->model_id, KV_PROTO_MODEL_ID_LEN))
        return kv_fail(d, KV_EFORMAT, "serves another model (id %.16s..., the manifest's is %.16s...)", a->model_id,
                       r->m->model_id);
    if (a->n_layer != r->n_layer || a->n_embd != r->n_embd || a->n_ff_exp != r->n_ff ||
        a->n_expert != r->n_expert || a->n_expert_used != r->n_used)
        return kv_fail(d, KV_EFORMAT, "announces dims (%u layers, embd %u, ff %u, %u experts top-%u) other than the "
                       "manifest's (%u, %u, %u, %u top-%u)", a->n_layer, a->n_embd, a->n_ff_exp, a->n_expert,
                       a->n_expert_used, r->n_layer, r->n_embd, r->n_ff, r->n_expert, r->n_used);
    if (!(a->enc_mask & (1u << KV_ENC_F32)))
        return kv_fail(d, KV_EPROTO, "does not accept f32 hidden states");
    if (a->max_pairs < r->max_slots)
        return kv_fail(d, KV_ERANGE, "accepts at most %u pairs per request; this coordinator may send %u",
                       a->max_pairs, r->max_slots);
    const size_t n_keys = (size_t)r->n_layer * r->n_expert;
    /* every slab it serves is one of the manifest's, byte for byte */
    memset(w->holds, 0, n_keys);
    for (uint32_t i = 0; i < a->n_slabs; i++) {
        const kv_slab_hash sh = kv_msg_hello_ack_slab(a, i);
        /* the manifest's slabs are sorted by (layer, first) and disjoint:
         * binary search, so a 12,544-slab handshake stays cheap */
        const kv_manifest_slab *ms = NULL;
        size_t lo = 0, hi = r->m->n_slabs;
        while (lo < hi) {
            const size_t mid = lo + (hi - lo) / 2;
            const kv_manifest_slab *c = &r->m->slabs[mid];
            if (c->layer < sh.layer || (c->layer == sh.layer && c->first < sh.first)) lo = mid + 1;
            else hi = mid;
        }
        if (lo < r->m->n_slabs && r->m->slabs[lo].layer == sh.layer && r->m->slabs[lo].first == sh.first &&
            r->m->slabs[lo].last == sh.last)
            ms = &r->m->slabs[lo];
        if (!ms)
            return kv_fail(d, KV_EHASH, "serves layer %u experts %u-%u, which is no slab of the manifest", sh.layer,
                           sh.first, sh.last);
        /* a sparse manifest (a skeleton, run only when asked) has no hash to
         * compare: its slabs are held to identity, dims and ranges alone */
        if (!ms->file.has_sha256 && r->o.allow_sparse) {
            /* accepted as the manifest describes it */
        } else if (!ms->file.has_sha256 || memcmp(ms->file.sha256, sh.sha256, 32)) {
            char got[65];
            kv_sha256_hex(sh.sha256, got);
            return kv_fail(d, KV_EHASH, "its slab '%s' has SHA-256 %.16s..., not the manifest's: other bytes",
                           ms->file.path, got);
        }
        memset(w->holds + (size_t)sh.layer * r->n_expert + sh.first, 1, (size_t)sh.last - sh.first + 1);
    }
    for (uint32_t i = 0; i < a->n_ranges; i++) {
        const kv_held_range h = kv_msg_hello_ack_range(a, i);
        if (h.layer >= r->n_layer || h.first > h.last || h.last >= r->n_expert)
            return kv_fail(d, KV_ERANGE, "announces layer %u experts %u-%u, outside the model", h.layer, h.first,
                           h.last);
        if (!r->m->moe_layer[h.layer])
            return kv_fail(d, KV_ERANGE, "announces experts of layer %u, which has none", h.layer);
        for (uint32_t e = h.first; e <= h.last; e++)
            if (!w->holds[(size_t)h.layer * r->n_expert + e])
                return kv_fail(d, KV_EHASH, "announces layer %u expert %u without a slab hash for it", h.layer, e);
    }
    w->pre = (a->enc_mask & KV_PROTO_CAP_PREACT) != 0;
    if (r->ver && !w->pre)
        return kv_fail(d, KV_EUNSUPPORTED, "returns no pre-activations: its answers could not be verified");
    w->max_pairs = a->max_pairs;
    w->enc = !r->ver && (a->enc_mask & (1u << r->o.enc)) ? r->o.enc : KV_ENC_F32;
    snprintf(w->backend, sizeof w->backend, "%s", a->backend);
    w->n_ranges = a->n_ranges;
    return 0;
}

/* The wire bytes of w's answer row p and their length: y only (RESULT_PRE
 * rows carry gate and up after it, which the signature does not cover). */
static const uint8_t *kv_rw_yrow(const kv_remote *r, const kv_rw *w, const kv_msg_result *res, uint32_t p, size_t *yb) {
    if (res->n_ff) {
        *yb = (size_t)r->n_embd * 4;
        return res->y_wire + (size_t)p * ((size_t)r->n_embd + 2 * (size_t)res->n_ff) * 4;
    }
    *yb = (size_t)r->n_embd * kv_enc_size(w->enc);
    return res->y_wire + (size_t)p * *yb;
}

/* The hash of the x row of w's pair p as it was sent (the request's f32
 * row re-encoded in w's encoding, into r->xrow), computed once per token. */
static const uint8_t *kv_rw_xhash(kv_remote *r, const kv_rw *w, uint32_t p) {
    const uint32_t tl = w->pairs[p].token, t = r->cur_t0 + (uint32_t)w->pair_slot[p] / r->cur_req->n_used;
    if (!r->xh_ok[tl]) {
        kv_msg_rows_put(r->xrow, w->enc, r->cur_req->x + (size_t)t * r->n_embd, r->n_embd);
        kv_result_xhash(r->xrow, (size_t)r->n_embd * kv_enc_size(w->enc), r->xh[tl]);
        r->xh_ok[tl] = 1;
    }
    return r->xh[tl];
}

/* v4: checks the signature of w's whole answer (the leaves stay in
 * r->leaves for evidence). A bad one is a lie (w caught, KV_EPROTO). */
static int kv_rw_check_sig(kv_remote *r, kv_rw *w, const kv_msg_result *res, kv_diag *d) {
    if (w->version < KV_PROTO_SIG_VERSION) return 0;
    if (!res->sig) return kv_fail(d, KV_EPROTO, "an unsigned answer on a v%u connection", w->version);
    uint32_t nt = 0;
    for (uint32_t p = 0; p < w->n_pairs; p++) nt = w->pairs[p].token + 1 > nt ? w->pairs[p].token + 1 : nt;
    memset(r->xh_ok, 0, nt);
    for (uint32_t p = 0; p < w->n_pairs; p++) {
        size_t yb;
        const uint8_t *y = kv_rw_yrow(r, w, res, p, &yb);
        kv_result_leaf(kv_rw_xhash(r, w, p), w->pairs[p].expert, y, yb, r->leaves[p]);
    }
    uint8_t root[32], dg[32];
    kv_result_root((const uint8_t(*)[32])r->leaves, w->n_pairs, root);
    kv_result_digest(r->m->model_id, w->key, r->pk, r->cur_req->layer, w->enc, w->enc | (r->ver ? KV_OUT_PREACT : 0),
                     w->n_pairs, root, dg);
    r->n_sig_checked++;
    w->sig_seen = true;
    if (kv_link_verify(w->key, dg, res->sig)) {
        w->caught = true;
        return kv_fail(d, KV_EPROTO, "caught lying: the signature of its answer does not verify");
    }
    r->sig_done = true;
    return 0;
}

/* Whether the signature of w's answer is checked on arrival. Over
 * plaintext always: nothing else authenticates the frame. Over a TLS
 * session bound to w's key (v5) the record layer already authenticates
 * every answer as w's; the signature is what a third party can check, and
 * it is checked on w's first answer, on a random sample of the others, and
 * on any answer a lie is caught in (kv_rw_evidence) before it is shown:
 * an answer taken unchecked is w's all the same, and a lie with a bad
 * signature yields no evidence whether it is checked first or last. */
static bool kv_rw_sig_due(kv_remote *r, const kv_rw *w) {
    if (!w->tls || !w->sig_seen) return true;
    const double rate = r->o.sig_check_rate > 0 ? r->o.sig_check_rate : KV_REMOTE_SIG_RATE;
    if (rate >= 1) return true;
    r->sig_rng ^= r->sig_rng << 13, r->sig_rng ^= r->sig_rng >> 7, r->sig_rng ^= r->sig_rng << 17;
    return (double)(r->sig_rng >> 11) * (1.0 / 9007199254740992.0) < rate;
}

/* After w was caught on pair p: what it signed for that pair, in r->ev
 * (its rows copied, so that they outlive the frame). */
static void kv_rw_evidence(kv_remote *r, kv_rw *w, const kv_msg_result *res, uint32_t p) {
    if (w->version < KV_PROTO_SIG_VERSION || !res->sig) return;
    if (!r->sig_done) { /* taken unchecked (kv_rw_sig_due): check it now, show it only if it verifies */
        kv_diag sd = {0};
        if (kv_rw_check_sig(r, w, res, &sd)) {
            kv_rlog(r, "worker %s: the signature of the answer it lied in does not verify either: no evidence",
                    w->addr);
            return;
        }
    }
    kv_evidence *ev = &r->ev;
    memcpy(ev->worker_key, w->key, 32);
    memcpy(ev->coord_key, r->pk, 32);
    memcpy(ev->sig, res->sig, 64);
    ev->layer = r->cur_req->layer;
    ev->enc = w->enc;
    ev->out_enc = w->enc | (r->ver ? KV_OUT_PREACT : 0);
    ev->n_pairs = w->n_pairs;
    ev->pair = p;
    ev->expert = w->pairs[p].expert;
    ev->n_embd = r->n_embd;
    size_t yb;
    const uint8_t *y = kv_rw_yrow(r, w, res, p, &yb);
    memcpy(r->yrow, y, yb);
    r->xh_ok[w->pairs[p].token] = 0; /* re-encode its row into xrow */
    kv_rw_xhash(r, w, p);
    ev->x = r->xrow;
    ev->y = r->yrow;
    ev->n_proof = kv_result_proof((const uint8_t(*)[32])r->leaves, w->n_pairs, p, ev->proof);
    r->has_ev = true;
}

/* Checks every pair of a RESULT_PRE (already copied to its slots in out)
 * against the secret projections of its expert, prepared on first use from
 * the local slab; a sample is also recomputed in full. Any failure marks w
 * caught (KV_EPROTO "caught lying"). */
/* Pair p's token row and expert. */
static void kv_rw_pair(const kv_remote *r, const kv_rw *w, uint32_t p, uint32_t *t, uint32_t *e) {
    const kv_expert_req *req = r->cur_req;
    const uint32_t s = (uint32_t)w->pair_slot[p];
    *t = r->cur_t0 + s / req->n_used;
    *e = (uint32_t)req->ids[(size_t)r->cur_t0 * req->n_used + s];
}

/* Checks every answer of w's RESULT_PRE that has trusted weights: the
 * answers of one expert in groups of up to four (each read of its
 * projections serves the group), then a sampled full recompute of each. */
static int kv_rw_verify(kv_remote *r, kv_rw *w, const kv_msg_result *res, const float *out, kv_diag *d) {
    const kv_expert_req *req = r->cur_req;
    const uint32_t E = r->n_embd, F = r->n_ff;
    uint64_t n_ok = 0, n_rec = 0; /* counted once the whole answer passed */
    uint8_t *done = r->vdone;
    memset(done, 0, w->n_pairs);
    for (uint32_t p = 0; p < w->n_pairs; p++) {
        if (done[p]) continue;
        uint32_t t, e;
        kv_rw_pair(r, w, p, &t, &e);
        const size_t k = (size_t)req->layer * r->n_expert + e;
        if (!r->lhas[k]) { /* no trusted weights to check against */
            r->n_unverified++;
            continue;
        }
        int rc = kv_verify_prepare(r->ver, req->layer, e, &r->lw[k], d);
        if (rc) return kv_diag_prefix(d, KV_EINTERNAL, "remote: verify");
        /* this pair and up to three later ones of the same expert */
        uint32_t grp[4], n = 0;
        const float *xs[4], *gs[4], *us[4], *ys[4];
        for (uint32_t q = p; q < w->n_pairs && n < 4; q++) {
            uint32_t tq, eq;
            kv_rw_pair(r, w, q, &tq, &eq);
            if (done[q] || eq != e) continue;
            done[q] = 1;
            grp[n] = q;
            xs[n] = req->x + (size_t)tq * E;
            ys[n] = out + (size_t)w->pair_slot[q] * E;
            gs[n] = r->vg + (size_t)n * F;
            us[n] = r->vu + (size_t)n * F;
            kv_msg_result_pre_row(res, q, r->vg + (size_t)n * F, r->vu + (size_t)n * F);
            n++;
        }
        kv_verify_report rep;
        uint32_t bad = 0;
        if (kv_verify_check_batch(r->ver, req->layer, e, n, xs, gs, us, ys, &bad, &rep, d)) {
            w->caught = true;
            kv_rw_evidence(r, w, res, grp[bad < n ? bad : 0]);
            return kv_diag_prefix(d, KV_EPROTO, "caught lying: layer %u expert %u (pair %u)", req->layer, e,
                                  grp[bad < n ? bad : 0]);
        }
        n_ok += n;
        /* sampled full recompute from the slab */
        for (uint32_t j = 0; j < n; j++) {
            r->rng ^= r->rng << 13, r->rng ^= r->rng >> 7, r->rng ^= r->rng << 17;
            if (!(r->o.recompute_rate > 0 &&
                  (double)(r->rng >> 11) * (1.0 / 9007199254740992.0) < r->o.recompute_rate))
                continue;
            const float *x = xs[j], *y = ys[j];
            memcpy(r->lx, x, (size_t)E * sizeof(float));
            r->lids[0] = (int32_t)e;
            const kv_expert_req lr = {req->layer, 1, E, 1, r->lx, r->lids, NULL};
            if ((rc = r->local.compute(r->local.impl, &lr, r->vy, d))) return kv_diag_prefix(d, rc, "remote: recompute");
            const bool same = !strcmp(w->backend, kv_quant_backend());
            float mx = 0;
            for (uint32_t i = 0; i < E; i++) mx = fmaxf(mx, fabsf(r->vy[i]));
            for (uint32_t i = 0; i < E; i++) {
                const bool ok = same ? memcmp(&r->vy[i], &y[i], 4) == 0 : fabsf(r->vy[i] - y[i]) <= 1e-4f * mx;
                if (!ok) {
                    w->caught = true;
                    kv_rw_evidence(r, w, res, grp[j]);
                    return kv_fail(d, KV_EPROTO, "caught lying: layer %u expert %u: a full recompute differs at element "
                                   "%u (%g, it said %g)", req->layer, e, i, (double)r->vy[i], (double)y[i]);
                }
            }
            n_rec++;
        }
    }
    r->n_verified += n_ok;
    w->n_verified += n_ok;
    r->n_recomputed += n_rec;
    return 0;
}

/* Marks w caught: dropped for good, counted, reported through the hook. */
static void kv_rw_caught(kv_remote *r, kv_rw *w, const char *why, const kv_evidence *ev) {
    kv_rw_drop(r, w, "%s", why);
    w->caught = true;
    w->retry_at = INFINITY;
    w->fails = 1000000;
    r->n_caught++;
    kv_rlog(r, "worker %s caught lying and dropped for good: %s", w->addr, why);
    if (r->o.on_caught) r->o.on_caught(r->o.caught_arg, (uint32_t)(w - r->w), w->addr, w->key, why, ev);
}

/* Places the vectors of a RESULT that answers w's request at their slots. */
static int kv_rw_take_result(kv_remote *r, kv_rw *w, const kv_msg *msg, float *out, kv_diag *d) {
    const kv_msg_result *res = &msg->u.result;
    if (msg->h.request_id != w->req_id)
        return kv_fail(d, KV_EPROTO, "answered request %u, we asked %u", msg->h.request_id, w->req_id);
    if (res->n_pairs != w->n_pairs || res->n_embd != r->n_embd || res->enc != w->enc)
        return kv_fail(d, KV_EPROTO, "answered %u vectors of %u in %s, we asked %u of %u in %s", res->n_pairs,
                       res->n_embd, kv_enc_name(res->enc), w->n_pairs, r->n_embd, kv_enc_name(w->enc));
    r->has_ev = false;
    r->sig_done = false;
    if (w->version >= KV_PROTO_SIG_VERSION && !res->sig)
        return kv_fail(d, KV_EPROTO, "an unsigned answer on a v%u connection", w->version);
    if (w->version >= KV_PROTO_SIG_VERSION) {
        if (kv_rw_sig_due(r, w)) {
            int src = kv_rw_check_sig(r, w, res, d);
            if (src) return src;
        } else {
            r->n_sig_deferred++;
        }
    }
    /* non-finite or absurd values are a lie: nothing of this answer is used
     * (the slots stay pending and are overwritten by the redo) */
    for (uint32_t p = 0; p < w->n_pairs; p++) {
        float *y = out + (size_t)w->pair_slot[p] * r->n_embd;
        kv_msg_result_row(res, p, y);
        for (uint32_t i = 0; i < r->n_embd; i++)
            if (!isfinite(y[i]) || fabsf(y[i]) > KV_PROTO_MAX_ABS_OUTPUT)
                return kv_fail(d, KV_EPROTO, "answered %g at pair %u element %u (not finite or beyond %g): a lie",
                               (double)y[i], p, i, (double)KV_PROTO_MAX_ABS_OUTPUT);
    }
    if (r->ver) {
        int rc = kv_rw_verify(r, w, res, out, d);
        if (rc) return rc;
    }
    w->fails = 0;
    return 0;
}

/* Takes one answer time of w (seconds): into its ring and its moving
 * average. */
static void kv_rw_lat_add(kv_rw *w, double t) {
    if (!(t > 0)) t = 1e-6;
    w->lat_ring[w->n_lat++ % KV_REMOTE_LAT_RING] = (float)t;
    w->lat_t = kv_mono();
    w->lat_s = w->lat_s > 0 ? w->lat_s + KV_REMOTE_LAT_ALPHA * (t - w->lat_s) : t;
}

/* A request of w was cancelled (v6) t seconds after it was sent,
 * unanswered. Its answer time is unknown, but as kv_rw_backlog has it, a
 * stall that has lasted t is expected to last as long again: the estimate
 * that the replica choice uses rises to at least 2t, so a replica whose
 * requests are called off loses its share (until the estimate is stale,
 * KV_REMOTE_LAT_STALE_S, and it is tried again) as one whose stall was
 * timed would, without a stall's seconds: t is about the hedge time. It is
 * never put in the ring of answer times: the p50 and p95 that the hedge
 * time comes from are answers only (a cancel's age is the hedge time
 * itself; fed back, it would push the hedge time up with every hedge).
 * The estimate is dated now even when it stands (it is above 2t already):
 * a replica tried again because its estimate went stale, whose request is
 * called off once more, must lose its share for another
 * KV_REMOTE_LAT_STALE_S, not be given work each round while a stale
 * estimate counts as unmeasured. A stale estimate is replaced, not kept. */
static void kv_rw_lat_floor(kv_rw *w, double t) {
    const double now = kv_mono();
    if (2 * t > w->lat_s || !(now - w->lat_t < KV_REMOTE_LAT_STALE_S)) w->lat_s = 2 * t;
    w->lat_t = now;
}

/* Quantile q (0..1) of w's last answer times, seconds; 0 when none. The
 * lower of two neighbours below the median and the upper above it: with
 * few samples a stall sets the p95 but not the p50. */
static double kv_rw_lat_q(const kv_rw *w, double q) {
    float v[KV_REMOTE_LAT_RING];
    const uint32_t n = w->n_lat < KV_REMOTE_LAT_RING ? w->n_lat : KV_REMOTE_LAT_RING;
    if (!n) return 0;
    for (uint32_t i = 0; i < n; i++) { /* insertion sort: 32 values at most */
        const float x = w->lat_ring[i];
        uint32_t j = i;
        for (; j > 0 && v[j - 1] > x; j--) v[j] = v[j - 1];
        v[j] = x;
    }
    const double x = (double)(n - 1) * q;
    return v[q <= 0.5 ? (uint32_t)x : (uint32_t)ceil(x)];
}

/* Seconds after which a request to w that is still unanswered is hedged:
 * KV_REMOTE_HEDGE_FACTOR times its p95, but no more than
 * KV_REMOTE_HEDGE_TAIL times its p50 (a replica that stalls often has its
 * stalls in its p95), and no less than KV_REMOTE_HEDGE_FLOOR_S. Before its
 * first answer, KV_REMOTE_HEDGE_TAIL times the fastest estimate of the
 * other workers up (a first request can stall too); INFINITY when none is
 * measured. */
static double kv_rw_hedge_delay(const kv_remote *r, const kv_rw *w) {
    double s;
    if (w->n_lat) {
        const double a = KV_REMOTE_HEDGE_FACTOR * kv_rw_lat_q(w, 0.95), b = KV_REMOTE_HEDGE_TAIL * kv_rw_lat_q(w, 0.5);
        s = a < b ? a : b;
    } else {
        double best = INFINITY;
        for (uint32_t i = 0; i < r->n_w; i++)
            if (&r->w[i] != w && r->w[i].state == KV_RW_UP && r->w[i].lat_s > 0 && r->w[i].lat_s < best)
                best = r->w[i].lat_s;
        s = KV_REMOTE_HEDGE_TAIL * best;
    }
    return s > KV_REMOTE_HEDGE_FLOOR_S ? s : KV_REMOTE_HEDGE_FLOOR_S;
}

/* Seconds until w is through what it already has in flight and we no
 * longer wait for (superseded requests, a probe): for each, what its
 * estimate leaves, or, once it is overdue, as long again as it has taken
 * (a stall that has lasted is expected to last). */
static double kv_rw_backlog(const kv_rw *w, double now) {
    double s = 0;
    for (uint32_t g = 0; g < w->n_ghost; g++) {
        const double el = now - w->ghost[g].sent;
        s += w->lat_s - el > el ? w->lat_s - el : el;
    }
    if (w->probing) {
        const double el = now - w->probe_sent;
        s += w->lat_s - el > el ? w->lat_s - el : el;
    }
    return s;
}

/* When w, which already has `load` pairs this round, is expected to have
 * answered one more request, in seconds from now: its backlog, then its
 * estimated answer time, stretched by the pairs it already has over those
 * it usually gets per request (a request's time does not scale with its
 * size below that: a replica that gets small requests must not look slow
 * per pair and lose its share). lat_unmeasured stands in for a worker
 * never timed, or not timed for KV_REMOTE_LAT_STALE_S (given work again,
 * it is measured again). */
static double kv_rw_expect(const kv_rw *w, uint32_t load, double lat_unmeasured, double now) {
    const double lat = w->lat_s > 0 && now - w->lat_t < KV_REMOTE_LAT_STALE_S ? w->lat_s : lat_unmeasured;
    const double per = w->avg_pairs > 1 ? w->avg_pairs : 1;
    return kv_rw_backlog(w, now) + lat * (1.0 + (double)load / per);
}

/* A probe of demoted w was answered after t seconds: the estimate becomes
 * t (one fast answer brings it back), and the next probe, if it is still
 * slow, waits twice as long. */
static void kv_rw_probed(kv_remote *r, kv_rw *w, double t) {
    w->probing = false;
    kv_rw_lat_add(w, t);
    w->lat_s = t > 0 ? t : 1e-6;
    w->slow_probes++;
    w->probe_at = 0; /* set again, later, if it is still the slow one */
    kv_rlog(r, "worker %s answered a probe in %.0f ms", w->addr, t * 1e3);
}

/* Seconds a demoted w waits for its next probe. */
static double kv_rw_probe_wait(const kv_rw *w) {
    double s = KV_REMOTE_PROBE_S;
    for (uint32_t i = 0; i < w->slow_probes && s < KV_REMOTE_PROBE_MAX_S; i++) s *= 2;
    return s < KV_REMOTE_PROBE_MAX_S ? s : KV_REMOTE_PROBE_MAX_S;
}

/* The session tag of the current call's row t. */
static uint32_t kv_remote_tag(const kv_remote *r, uint32_t t) { return r->tags[r->tag_rows ? r->tag_rows[t] : t]; }

/* w's request in flight is superseded (its twin answered first): a v6
 * worker is sent a CANCEL for it; its answer (CANCELLED, or a RESULT it had
 * begun) is discarded when it comes. w must have room for it
 * (kv_remote_hedge makes sure); if not, w is dropped rather than read. */
static void kv_rw_supersede(kv_remote *r, kv_rw *w) {
    w->busy = false;
    w->twin = -1;
    w->is_hedge = false;
    if (w->n_ghost == KV_REMOTE_MAX_GHOSTS) {
        kv_rw_drop(r, w, "%u superseded requests unanswered", w->n_ghost);
        return;
    }
    struct kv_rw_ghost g = {w->req_id, w->n_pairs, w->sent_at, 0};
    /* the connection's send queue has KV_REMOTE_TX_SPARE bytes beyond its
       largest frame: a CANCEL that would not fit is not sent (the request is
       then awaited as from an older worker) rather than overflow it */
    if (w->version >= KV_PROTO_CANCEL_VERSION && w->state == KV_RW_UP && w->nc &&
        kv_net_conn_pending(w->nc) + KV_PROTO_HEADER <= KV_REMOTE_TX_SPARE) {
        uint8_t *p = kv_net_conn_reserve(w->nc, KV_PROTO_HEADER);
        size_t n = 0;
        if (p && !kv_msg_cancel_encode(p, KV_PROTO_HEADER, KV_MSG_CANCEL, w->req_id, &n, NULL)) {
            kv_frame_set_version(p, w->version);
            kv_net_conn_commit(w->nc, n);
            r->bytes_sent += n;
            g.cancel_at = kv_mono();
        }
    }
    w->ghost[w->n_ghost++] = g;
}

/* Demand metering: slab of expert e of the current call's layer was done
 * at now (its wait runs from the call's start to its last slot). */
static void kv_remote_dm_done(kv_remote *r, int32_t e, double now) {
    const int32_t sl = r->slab_of[(size_t)r->cur_req->layer * r->n_expert + (uint32_t)e];
    if (sl < 0) return;
    r->dm_done[sl] = now;
    r->dm_mark[sl] = r->n_calls;
}

/* A held expert (kv_remote_local_hold) is computed here when its key, a
 * fixed hash of (layer, expert) in [0, 1), is under the local share: the
 * share moves experts, never single tokens, so one expert's slots stay on
 * one side, and which side answers never changes the bits. */
static double kv_share_key(uint32_t layer, uint32_t e) {
    uint64_t x = ((uint64_t)layer << 32 | e) * 0x9e3779b97f4a7c15ull;
    x ^= x >> 29;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 32;
    return (double)(x >> 11) * 0x1.0p-53;
}

/* w's answer to the current chunk passed every check (its rows are in
 * place): its slots are done, and a twin computing the same slots is
 * superseded. */
static void kv_rw_settle(kv_remote *r, kv_rw *w) {
    const uint32_t wi = (uint32_t)(w - r->w), nu = r->cur_req->n_used;
    const double now = kv_mono();
    for (uint32_t p = 0; p < w->n_pairs; p++) {
        const int32_t s = w->pair_slot[p];
        KV_ASSERT(r->slot_owner[s] >= 0); /* one valid answer per slot: its twin's is never taken */
        r->slot_owner[s] = KV_OWN_DONE;
        r->n_pairs_remote++;
        kv_remote_dm_done(r, r->cur_req->ids[(size_t)r->cur_t0 * nu + (uint32_t)s], now);
        if (r->tag_on && wi < r->t_stride)
            r->ts_ans[(size_t)kv_remote_tag(r, r->cur_t0 + (uint32_t)s / nu) * r->t_stride + wi]++;
    }
    if (w->is_hedge) {
        r->n_hedges_won++;
        w->n_hedges_won++;
    }
    if (w->twin >= 0) kv_rw_supersede(r, &r->w[w->twin]);
    w->twin = -1;
    w->is_hedge = false;
}

/* Handles one whole frame received from w. Returns 1 if it completed w's
 * request, 0 otherwise; drops w on anything unexpected. */
static int kv_rw_frame(kv_remote *r, kv_rw *w, const uint8_t *f, size_t n, float *out) {
    kv_msg msg;
    kv_diag d = {0};
    const kv_proto_limits lim = {r->n_layer, r->n_embd, r->n_expert, r->n_ff};
    r->bytes_recv += n;
    if (kv_msg_decode(f, n, &lim, &msg, &d)) {
        kv_rw_drop(r, w, "malformed frame: %s", d.msg);
        return 0;
    }
    if (w->plain_answer && msg.h.type != KV_MSG_ERROR) {
        kv_rw_drop(r, w, "answered TLS in plaintext (an older worker, or not a worker): refused, never downgraded");
        return 0;
    }
    if (msg.h.type == KV_MSG_ERROR) {
        if (kv_rw_handshaking(w) && msg.u.error.code == KV_ERANGE && kv_mono() < w->hs_deadline)
            kv_rw_busy(r, w, msg.u.error.msg);
        else
            kv_rw_drop(r, w, "error %s: %s", kv_err_name(msg.u.error.code), msg.u.error.msg);
        return 0;
    }
    if (w->state == KV_RW_HELLO) {
        if (msg.h.type != KV_MSG_HELLO_ACK) {
            kv_rw_drop(r, w, "answered HELLO with a frame of type %u", msg.h.type);
            return 0;
        }
        if (kv_rw_accept_ack(r, w, &msg.u.ack, &d)) {
            kv_rw_drop(r, w, "%s", d.msg);
            return 0;
        }
        w->version = msg.u.ack.version;
        w->state = KV_RW_CHALLENGE;
        return 0;
    }
    if (msg.h.version != w->version) {
        kv_rw_drop(r, w, "frame version %u, negotiated %u", msg.h.version, w->version);
        return 0;
    }
    if (w->state == KV_RW_CHALLENGE) {
        if (msg.h.type != KV_MSG_AUTH_CHALLENGE) {
            kv_rw_drop(r, w, "sent %s where AUTH_CHALLENGE was due", kv_msg_type_name(msg.h.type));
            return 0;
        }
        static const uint8_t zero[32];
        if (memcmp(w->expect, zero, 32) && sodium_memcmp(w->expect, msg.u.challenge.worker_key, 32)) {
            kv_rw_drop(r, w, "proves another key than the one it is listed with: not the worker we meant");
            return 0;
        }
        memcpy(w->key, msg.u.challenge.worker_key, 32);
        memcpy(w->challenge, msg.u.challenge.challenge, 32);
        randombytes_buf(w->nonce, 32);
        kv_msg_auth a = {0};
        memcpy(a.key, r->pk, 32);
        memcpy(a.nonce, w->nonce, 32);
        uint8_t binding[KV_TLS_EXPORTER_LEN];
        if (w->tls && kv_tls_exporter(w->tls, binding)) {
            kv_rw_drop(r, w, "no TLS exporter for this session");
            return 0;
        }
        const kv_link_transcript t = {.proto = KV_LINK_HS_DISPATCH, .model_id = r->m->model_id,
                                      .version = w->version, .acceptor_key = w->key, .challenge = w->challenge,
                                      .connector_key = r->pk, .nonce = w->nonce,
                                      .binding = w->tls ? binding : NULL};
        kv_link_transcript_sign(&t, KV_LINK_CONNECTOR, r->sk, a.sig);
        if (r->has_voucher) {
            a.flags = KV_PROTO_AUTH_VOUCHER;
            a.voucher_expires_ms = r->voucher.expires_ms;
            memcpy(a.voucher_sig, r->voucher.sig, 64);
        }
        uint8_t *p = kv_net_conn_reserve(w->nc, KV_PROTO_HEADER + KV_PROTO_AUTH_SIZE);
        size_t fn = 0;
        if (!p || kv_msg_auth_encode(p, KV_PROTO_HEADER + KV_PROTO_AUTH_SIZE, 0, &a, &fn, &d)) {
            kv_rw_drop(r, w, "AUTH: %s", d.msg[0] ? d.msg : "cannot queue");
            return 0;
        }
        kv_frame_set_version(p, w->version);
        kv_net_conn_commit(w->nc, fn);
        r->bytes_sent += fn;
        w->state = KV_RW_AUTH;
        return 0;
    }
    if (w->state == KV_RW_AUTH) {
        if (msg.h.type != KV_MSG_AUTH_OK) {
            kv_rw_drop(r, w, "sent %s where AUTH_OK was due", kv_msg_type_name(msg.h.type));
            return 0;
        }
        uint8_t binding[KV_TLS_EXPORTER_LEN];
        if (w->tls && kv_tls_exporter(w->tls, binding)) {
            kv_rw_drop(r, w, "no TLS exporter for this session");
            return 0;
        }
        const kv_link_transcript t = {.proto = KV_LINK_HS_DISPATCH, .model_id = r->m->model_id,
                                      .version = w->version, .acceptor_key = w->key, .challenge = w->challenge,
                                      .connector_key = r->pk, .nonce = w->nonce,
                                      .binding = w->tls ? binding : NULL};
        if (kv_link_transcript_verify(&t, KV_LINK_ACCEPTOR, w->key, msg.u.auth_ok)) {
            kv_rw_drop(r, w, w->tls ? "AUTH_OK signature does not verify over this TLS session: not the key it "
                                      "announced, or a proof relayed from another session (a man in the middle)"
                                    : "AUTH_OK signature does not verify: not the key it announced");
            return 0;
        }
        w->state = KV_RW_UP;
        w->busy_tries = 0;
        w->n_connects++;
        w->n_pairs_since = 0;
        w->sig_seen = false;
        w->why[0] = 0;
        kv_rlog(r, "worker %s up: %u ranges, backend %s, wire %s", w->addr, w->n_ranges, w->backend,
                kv_enc_name(w->enc));
        return 0;
    }
    if (msg.h.type == KV_MSG_RECEIPT) {
        if (!w->rcpt_wait || msg.h.request_id != w->rcpt_id) {
            kv_rw_drop(r, w, "sent a RECEIPT nobody asked for");
            return 0;
        }
        uint32_t st = KV_RECEIPT_REFUSED;
        kv_receipt rc;
        const kv_receipt_req *q = &w->rcpt_req;
        if (kv_receipt_ans_from_payload(&st, &rc, msg.u.receipt, KV_PROTO_RECEIPT_SIZE, &d)) {
            kv_rw_drop(r, w, "%s", d.msg);
            return 0;
        }
        if (st == KV_RECEIPT_SIGNED &&
            (sodium_memcmp(rc.node, w->key, 32) || strcmp(rc.gateway, q->gateway) ||
             memcmp(rc.consumer, q->consumer, 32) || memcmp(rc.auth_nonce, q->auth_nonce, 16) ||
             rc.n_products != q->n_products || memcmp(rc.log_digest, q->log_digest, 32))) {
            kv_rw_drop(r, w, "signed a receipt for other figures or with another key than it proved");
            return 0;
        }
        w->rcpt_wait = false;
        w->rcpt_rc = st == KV_RECEIPT_SIGNED ? 0 : KV_LEDGER_RRECEIPT;
        w->rcpt = rc;
        return 0;
    }
    for (uint32_t g = 0; g < w->n_ghost; g++) { /* superseded: timed, never used, no fault */
        if (msg.h.request_id != w->ghost[g].id) continue;
        if (msg.h.type == KV_MSG_CANCELLED && w->ghost[g].cancel_at > 0) { /* dropped on our CANCEL */
            kv_rw_lat_floor(w, w->ghost[g].cancel_at - w->ghost[g].sent);
            /* nothing was computed twice: the hedge's token is given back */
            if (r->hedge_budget > 0 && (r->hedge_tokens += 1) > KV_REMOTE_HEDGE_BURST)
                r->hedge_tokens = KV_REMOTE_HEDGE_BURST;
            memmove(&w->ghost[g], &w->ghost[g + 1], (w->n_ghost - g - 1) * sizeof w->ghost[0]);
            w->n_ghost--;
            w->n_cancelled++;
            r->n_cancelled++;
            return 0;
        }
        if (msg.h.type != (r->ver ? KV_MSG_RESULT_PRE : KV_MSG_RESULT) ||
            msg.u.result.n_pairs != w->ghost[g].n_pairs || msg.u.result.n_embd != r->n_embd) {
            kv_rw_drop(r, w, "answered request %u with a frame of type %u", msg.h.request_id, msg.h.type);
            return 0;
        }
        const double t = kv_mono() - w->ghost[g].sent;
        kv_rw_lat_add(w, t);
        memmove(&w->ghost[g], &w->ghost[g + 1], (w->n_ghost - g - 1) * sizeof w->ghost[0]);
        w->n_ghost--;
        w->n_late++;
        r->n_late++;
        kv_rlog(r, "worker %s answered a request in %.0f ms that a replica had answered: discarded", w->addr, t * 1e3);
        return 0;
    }
    if (w->probing && msg.h.request_id == w->probe_id) { /* timed, never used */
        if (msg.h.type != (r->ver ? KV_MSG_RESULT_PRE : KV_MSG_RESULT) || msg.u.result.n_pairs != w->probe_pairs ||
            msg.u.result.n_embd != r->n_embd) {
            kv_rw_drop(r, w, "answered a probe with a frame of type %u", msg.h.type);
            return 0;
        }
        kv_rw_probed(r, w, kv_mono() - w->probe_sent);
        return 0;
    }
    if (!w->busy || !out) {
        kv_rw_drop(r, w, "sent a frame of type %u while idle", msg.h.type);
        return 0;
    }
    if (msg.h.type != (r->ver ? KV_MSG_RESULT_PRE : KV_MSG_RESULT)) {
        kv_rw_drop(r, w, "answered COMPUTE with a frame of type %u", msg.h.type);
        return 0;
    }
    if (kv_rw_take_result(r, w, &msg, out, &d)) {
        if (w->caught) kv_rw_caught(r, w, d.msg, r->has_ev ? &r->ev : NULL);
        else kv_rw_drop(r, w, "%s", d.msg);
        return 0;
    }
    w->busy = false;
    kv_rw_lat_add(w, kv_mono() - w->sent_at);
    w->avg_pairs = w->avg_pairs > 0 ? w->avg_pairs + KV_REMOTE_LAT_ALPHA * ((double)w->n_pairs - w->avg_pairs)
                                    : (double)w->n_pairs;
    w->n_pairs_done += w->n_pairs;
    w->n_pairs_since += w->n_pairs;
    kv_rw_settle(r, w);
    return 1;
}

/* ---- the workers' connections on the event loop ---------------------------- */

static void kv_rw_on_open(kv_net_conn *c, int code) {
    kv_rw *w = kv_net_conn_data(c);
    if (w->nc == c && code == 0 && w->state == KV_RW_CONNECTING) {
        w->state = KV_RW_HELLO;
        w->tls = kv_link_sniff_tls(w->tp);
        w->plain_answer = w->tp && !w->tls; /* kv_link_sniff_plain_answer */
    }
}

static int kv_rw_frame_len(kv_net_conn *c, const uint8_t *hdr, size_t *total, kv_diag *d) {
    (void)c;
    kv_frame_header h;
    int rc = kv_frame_header_decode(hdr, KV_PROTO_HEADER, &h, d);
    if (rc) return rc;
    *total = KV_PROTO_HEADER + (size_t)h.len;
    return 0;
}

static int kv_rw_on_frame(kv_net_conn *c, const uint8_t *f, size_t n) {
    kv_rw *w = kv_net_conn_data(c);
    if (w->nc != c) return 0; /* a connection already dropped */
    kv_remote *r = w->r;
    r->n_done += kv_rw_frame(r, w, f, n, r->cur_out);
    return 0;
}

static void kv_rw_on_close(kv_net_conn *c, int code, const char *why) {
    kv_rw *w = kv_net_conn_data(c);
    if (w->nc != c) return;
    w->nc = NULL;
    w->tls = NULL;
    if (code == KV_EAUTH && w->state == KV_RW_CONNECTING) /* the TLS pin */
        kv_rw_drop(w->r, w, "proves another key than the one it is listed with: not the worker we meant (%s)",
                   why && why[0] ? why : "TLS");
    else
        kv_rw_drop(w->r, w, "%s", why && why[0] ? why : code ? kv_err_str(code) : "closed");
}

static const kv_net_conn_cbs kv_rw_cbs = {
    .on_open = kv_rw_on_open,
    .frame_len = kv_rw_frame_len,
    .on_frame = kv_rw_on_frame,
    .on_close = kv_rw_on_close,
};

/* Starts reconnects that are due, then one loop iteration (timeout_ms, may
 * be 0) over every connected worker; busy workers' answers are placed in
 * out. Handshakes past their deadline are dropped. Returns the number of
 * requests completed. */
static int kv_remote_poll(kv_remote *r, int timeout_ms, float *out) {
    const double now = kv_mono();
    bool any = false;
    double next_dial = INFINITY; /* the earliest redial of a worker that had no room */
    for (uint32_t i = 0; i < r->n_w; i++) {
        kv_rw *w = &r->w[i];
        if ((w->state == KV_RW_DOWN || w->state == KV_RW_RETRY) && now >= w->retry_at) {
            if (w->state == KV_RW_RETRY && now > w->hs_deadline) {
                char why[KV_REMOTE_WHY];
                memcpy(why, w->why, sizeof why);
                kv_rw_drop(r, w, "no handshake within %u ms (%.200s)", r->o.timeout_ms, why);
                continue;
            }
            kv_rw_connect(r, w, now);
        }
        if (kv_rw_handshaking(w) && now > w->hs_deadline) {
            kv_rw_drop(r, w, "no handshake within %u ms", r->o.timeout_ms);
            continue;
        }
        if (w->probing && now > w->probe_sent + r->timeout_s) {
            kv_rw_drop(r, w, "no answer to a probe within %u ms", r->o.timeout_ms);
            continue;
        }
        if (w->n_ghost && now > w->ghost[0].sent + r->timeout_s) {
            kv_rw_drop(r, w, "no answer within %u ms (to a request a replica answered)", r->o.timeout_ms);
            continue;
        }
        if (w->state == KV_RW_RETRY && w->retry_at < next_dial) next_dial = w->retry_at;
        any |= w->nc != NULL;
    }
    if (next_dial < INFINITY) { /* wake for it */
        const double left_ms = ceil((next_dial - now) * 1000.0);
        if (timeout_ms < 0 || left_ms < timeout_ms) timeout_ms = left_ms > 0 ? (int)left_ms : 0;
    }
    if (!any) {
        if (next_dial < INFINITY && timeout_ms > 0) {
            struct timespec ts = {timeout_ms / 1000, (long)(timeout_ms % 1000) * 1000000L};
            nanosleep(&ts, NULL);
        }
        return 0;
    }
    r->cur_out = out;
    r->n_done = 0;
    (void)kv_net_loop_run_once(r->loop, timeout_ms, NULL);
    r->cur_out = NULL;
    return r->n_done;
}

/* ---- local fallback: slabs present in the manifest's folder -------------- */

static int kv_local_acquire(void *ctx, uint32_t layer, uint32_t e, kv_expert_weights *w, kv_diag *d) {
    const kv_remote *r = ctx;
    const size_t k = (size_t)layer * r->n_expert + e;
    if (layer >= r->n_layer || e >= r->n_expert || !r->lhas[k])
        return kv_fail(d, KV_EINTERNAL, "remote: expert %u of layer %u is not present locally", e, layer);
    *w = r->lw[k];
    return 0;
}

/* Takes the slabs that kv_pieces_open found present and verified (same
 * checks as the backbone: pieces.c) as local fallback, and maps their
 * experts. */
static int kv_remote_open_local(kv_remote *r, kv_pieces *pc, kv_diag *d) {
    const kv_manifest *m = r->m;
    for (size_t i = 0; i < m->n_slabs; i++) {
        const kv_manifest_slab *ms = &m->slabs[i];
        if (!pc->slabs[i].g) continue; /* absent */
        r->lg[i] = pc->slabs[i].g;
        pc->slabs[i].g = NULL;
        int rc;
        for (uint32_t e = ms->first; e <= ms->last; e++) {
            const size_t k = (size_t)ms->layer * r->n_expert + e;
            uint32_t ne, nf;
            if ((rc = kv_expert_find(r->lg[i], ms->layer, e, &r->lw[k], &ne, &nf, d)))
                return kv_diag_prefix(d, rc, "remote: '%s'", ms->file.path);
            if (ne != r->n_embd || nf != r->n_ff)
                return kv_fail(d, KV_EFORMAT, "remote: '%s' holds experts of %ux%u, the manifest says %ux%u",
                               ms->file.path, ne, nf, r->n_embd, r->n_ff);
            r->lhas[k] = 1;
        }
        r->n_local_slabs++;
    }
    return 0;
}

/* ---- the provider ------------------------------------------------------ */

/* Builds and queues w's (worker wi's) COMPUTE for the slots that worker
 * owner owns this round: its own (owner == wi), or, as a hedge, another's.
 * probe_e >= 0: a probe of demoted w instead, with the slots of expert
 * probe_e (whoever owns them): its answer is timed and discarded. */
static int kv_rw_queue(kv_remote *r, kv_rw *w, int32_t wi, int32_t owner, const kv_expert_req *req, uint32_t t0,
                       uint32_t n_tok, int32_t probe_e, kv_diag *d) {
    const uint32_t nu = req->n_used, E = r->n_embd;
    const bool probe = probe_e >= 0;
    for (uint32_t t = 0; t < n_tok; t++) r->tok_local[t] = -1;
    uint32_t nt = 0, np = 0;
    bool identity = true; /* the frame's tokens are exactly the chunk's, in order */
    for (uint32_t s = 0; s < n_tok * nu; s++) {
        if (probe ? req->ids[(size_t)t0 * nu + s] != probe_e : r->slot_owner[s] != owner) continue;
        const uint32_t t = s / nu;
        if (r->tok_local[t] < 0) {
            identity &= t == nt;
            r->tok_local[t] = (int32_t)nt++;
        }
        w->pairs[np] = (kv_proto_pair){(uint32_t)r->tok_local[t], (uint32_t)req->ids[(size_t)t0 * nu + s]};
        w->pair_slot[np++] = (int32_t)s;
        if (!probe && r->tag_on && (uint32_t)wi < r->t_stride) r->ts_sent[(size_t)kv_remote_tag(r, t0 + t) * r->t_stride + (uint32_t)wi]++;
    }
    if (!identity) /* gather the rows of the tokens it needs */
        for (uint32_t t = 0; t < n_tok; t++)
            if (r->tok_local[t] >= 0)
                memcpy(r->xg + (size_t)r->tok_local[t] * E, req->x + (size_t)(t0 + t) * E, (size_t)E * sizeof(float));
    const kv_msg_compute c = {req->layer, w->enc, w->enc | (r->ver ? KV_OUT_PREACT : 0), nt, E, np,
                              identity ? req->x + (size_t)t0 * E : r->xg, w->pairs, NULL, NULL};
    uint8_t *p = kv_net_conn_reserve(w->nc, w->scap);
    if (!p) return kv_fail(d, KV_EINTERNAL, "remote: no room to queue a COMPUTE for %s", w->addr);
    size_t len = 0;
    int rc = kv_msg_compute_encode(p, w->scap, ++w->req_id, &c, &len, d);
    if (rc) return kv_diag_prefix(d, rc, "remote: encoding COMPUTE for %s", w->addr);
    kv_net_conn_commit_now(w->nc, len); /* out now: no EPOLLOUT round per layer */
    r->bytes_sent += len;
    if (probe) {
        w->probing = true;
        w->probe_id = w->req_id;
        w->probe_pairs = np;
        w->probe_sent = kv_mono();
        w->n_probes++;
        return 0;
    }
    w->n_pairs = np;
    w->busy = true;
    w->sent_at = kv_mono();
    w->probe_at = 0; /* in use: measured by its answers */
    w->slow_probes = 0;
    w->n_req++;
    w->twin = -1;
    w->is_hedge = false;
    w->hedge_at = owner == wi ? w->sent_at + kv_rw_hedge_delay(r, w) : INFINITY; /* a hedge is not hedged */
    if (owner == wi && r->hedge_budget > 0) {
        r->hedge_tokens += r->hedge_budget;
        if (r->hedge_tokens > KV_REMOTE_HEDGE_BURST) r->hedge_tokens = KV_REMOTE_HEDGE_BURST;
    }
    return 0;
}

/* Chooses the worker for expert e of layer L: among the holders that are
 * up and not demoted, the one expected to answer first (kv_rw_expect: its
 * backlog, its answer time, the pairs it already has this round), compared
 * between two of them drawn at random when there are more than two (the
 * power of two choices: coordinators with stale estimates do not all herd
 * onto the one that looked fastest); a holder that still owes a superseded
 * answer loses to one that owes none; else one is preferred only when expected
 * to answer KV_REMOTE_PICK_RATIO times sooner, else the two count as equal
 * (noise between replicas of one speed must not starve one of work and of
 * measurement) and the one with fewer pairs this round gets it, then by a
 * rotation keyed on e. A holder is demoted while its estimated answer time exceeds
 * KV_REMOTE_SLOW_FACTOR times the fastest holder's plus
 * KV_REMOTE_SLOW_MARGIN_S (an unmeasured one counts as fast, so it gets
 * measured); the fastest is never demoted, so an expert with any holder up
 * gets one. A demoted holder gets a probe once its wait is over (probe_e1,
 * sent by kv_remote_chunk). */
static int32_t kv_remote_pick(kv_remote *r, uint32_t L, uint32_t e, double now) {
    const size_t k = (size_t)L * r->n_expert + e;
    /* demotion compares answer times with the backlog added: a holder stalled
       on a superseded request is not the fast one while the stall lasts */
    double fastest = INFINITY, measured = INFINITY; /* any holder's estimate; a timed holder's */
    for (uint32_t i = 0; i < r->n_w; i++) {
        const kv_rw *w = &r->w[i];
        if (w->state != KV_RW_UP || !w->holds[k]) continue;
        const double eff = w->lat_s + kv_rw_backlog(w, now);
        if (eff < fastest) fastest = eff;
        if (w->lat_s > 0 && w->lat_s < measured) measured = w->lat_s;
    }
    const double slow = KV_REMOTE_SLOW_FACTOR * fastest + KV_REMOTE_SLOW_MARGIN_S;
    const double unmeasured = measured < INFINITY ? measured : 0;
    uint32_t n_cand = 0;
    for (uint32_t j = 0; j < r->n_w; j++) {
        const uint32_t i = (uint32_t)((k + j) % r->n_w);
        kv_rw *w = &r->w[i];
        if (w->state != KV_RW_UP || !w->holds[k]) continue;
        if (w->lat_s + kv_rw_backlog(w, now) > slow) {
            if (w->probe_at == 0) {
                w->probe_at = now + kv_rw_probe_wait(w);
                if (!w->slow_probes)
                    kv_rlog(r, "worker %s demoted: answers in %.0f ms (%.0f ms more in flight), a replica in %.0f ms",
                            w->addr, w->lat_s * 1e3, kv_rw_backlog(w, now) * 1e3, fastest * 1e3);
            } else if (now >= w->probe_at && !w->probing && !w->probe_e1 && !w->n_ghost) {
                /* (not while it owes a superseded answer: the probe would time the stall) */
                w->probe_e1 = e + 1;
            }
            continue;
        }
        n_cand++;
    }
    /* the candidates compared: all of them when two or fewer, else two at random */
    uint32_t c0 = 0, c1 = 1;
    if (n_cand > 2) {
        r->pick_rng ^= r->pick_rng << 13, r->pick_rng ^= r->pick_rng >> 7, r->pick_rng ^= r->pick_rng << 17;
        c0 = (uint32_t)(r->pick_rng % n_cand);
        c1 = (uint32_t)((r->pick_rng >> 32) % (n_cand - 1));
        if (c1 >= c0) c1++;
    }
    int32_t best = -1;
    double best_t = INFINITY;
    for (uint32_t j = 0, c = 0; j < r->n_w; j++) {
        const uint32_t i = (uint32_t)((k + j) % r->n_w);
        const kv_rw *w = &r->w[i];
        if (w->state != KV_RW_UP || !w->holds[k] || w->lat_s + kv_rw_backlog(w, now) > slow) continue;
        const uint32_t ci = c++;
        if (n_cand > 2 && ci != c0 && ci != c1) continue;
        /* a holder still owing a superseded answer (a stall, most likely) loses to
           one that owes none, whatever the estimates: new work would queue behind it */
        const bool owes = w->n_ghost > 0, best_owes = best >= 0 && r->w[best].n_ghost > 0;
        const double t = kv_rw_expect(w, r->load[i], unmeasured, now);
        const bool better = (best_owes && !owes) || (owes == best_owes && KV_REMOTE_PICK_RATIO * t + KV_REMOTE_PICK_SLACK_S < best_t);
        const bool worse = (owes && !best_owes) || (owes == best_owes && KV_REMOTE_PICK_RATIO * best_t + KV_REMOTE_PICK_SLACK_S < t);
        if (best < 0 || better || (!worse && r->load[i] < r->load[best])) {
            best = (int32_t)i;
            best_t = t;
        }
    }
    return best;
}

/* Dials every worker that is down, whatever its retry time, and waits
 * until no handshake is in progress (each has its own deadline). Returns
 * true if a worker came up. */
static bool kv_remote_revive(kv_remote *r) {
    const double now = kv_mono();
    uint32_t n_up = 0, n_up2 = 0;
    for (uint32_t i = 0; i < r->n_w; i++) {
        kv_rw *w = &r->w[i];
        n_up += w->state == KV_RW_UP;
        /* quarantined workers (failed twice since their last good answer)
         * wait for their backoff even here */
        if (w->state == KV_RW_DOWN && (w->fails < 2 || now >= w->retry_at)) kv_rw_connect(r, w, now);
    }
    for (;;) {
        bool hs = false;
        for (uint32_t i = 0; i < r->n_w; i++) hs |= kv_rw_handshaking(&r->w[i]);
        if (!hs) break;
        kv_remote_poll(r, 20, NULL);
    }
    for (uint32_t i = 0; i < r->n_w; i++) n_up2 += r->w[i].state == KV_RW_UP;
    return n_up2 > n_up;
}

/* Names why nobody could compute expert e of layer L (for the error). */
static void kv_remote_why(const kv_remote *r, uint32_t L, uint32_t e, char *buf, size_t cap) {
    const size_t k = (size_t)L * r->n_expert + e;
    size_t o = 0;
    buf[0] = 0;
    for (uint32_t i = 0; i < r->n_w && o + 1 < cap; i++) {
        const kv_rw *w = &r->w[i];
        if (!w->holds[k]) continue;
        int n = snprintf(buf + o, cap - o, "%s%s: %s", o ? "; " : "", w->addr, w->why[0] ? w->why : "not connected");
        if (n < 0) break;
        o += (size_t)n;
    }
    if (!o) snprintf(buf, cap, "no connected worker announced it");
}

/* Hedges the requests in flight that are past their hedge time: each goes
 * once more, whole, to a replica that holds every expert of it, is up,
 * idle, not demoted and has nothing superseded in flight, the one
 * expected to answer first; while the hedge budget lasts (r->hedge_tokens), and
 * only when the hedged worker has room for one more superseded request.
 * *wake is lowered to the earliest hedge time still ahead. Returns 0, or
 * an error from queuing. */
static int kv_remote_hedge(kv_remote *r, const kv_expert_req *req, uint32_t t0, uint32_t n_tok, double now,
                           double *wake, kv_diag *d) {
    if (r->hedge_budget <= 0) return 0;
    for (uint32_t i = 0; i < r->n_w; i++) {
        kv_rw *w = &r->w[i];
        if (!w->busy || w->twin >= 0 || w->is_hedge) continue;
        /* a worker's first request: a replica that has answered since gives it a hedge time */
        if (w->hedge_at == INFINITY && !w->n_lat) w->hedge_at = w->sent_at + kv_rw_hedge_delay(r, w);
        if (w->hedge_at == INFINITY) continue;
        if (now < w->hedge_at) {
            if (w->hedge_at - now < *wake) *wake = w->hedge_at - now;
            continue;
        }
        /* past its hedge time: hedged now if a replica can take it, else
           looked at again when the next frame comes */
        if (r->hedge_tokens < 1 || w->n_ghost >= KV_REMOTE_MAX_GHOSTS) continue;
        int32_t best = -1;
        double best_t = INFINITY;
        for (uint32_t j = 0; j < r->n_w; j++) {
            const kv_rw *o = &r->w[j];
            if (j == i || o->state != KV_RW_UP || o->busy || o->probing || o->n_ghost || o->caught || o->probe_at > 0)
                continue;
            bool all = true;
            for (uint32_t p = 0; p < w->n_pairs && all; p++)
                all = o->holds[(size_t)req->layer * r->n_expert + w->pairs[p].expert];
            if (!all) continue;
            const double t = kv_rw_expect(o, 0, w->lat_s, now);
            if (best < 0 || t < best_t) {
                best = (int32_t)j;
                best_t = t;
            }
        }
        if (best < 0) continue;
        kv_rw *o = &r->w[best];
        int rc = kv_rw_queue(r, o, best, (int32_t)i, req, t0, n_tok, -1, d);
        if (rc) return rc;
        o->is_hedge = true;
        o->twin = (int32_t)i;
        w->twin = best;
        r->hedge_tokens -= 1;
        r->n_hedges++;
        r->n_hedge_pairs += w->n_pairs;
        w->n_hedged++;
        kv_rlog(r, "worker %s has not answered in %.0f ms (its p95 %.0f ms): request hedged to %s", w->addr,
                (now - w->sent_at) * 1e3, kv_rw_lat_q(w, 0.95) * 1e3, o->addr);
    }
    return 0;
}

/* One chunk of tokens [t0, t0 + n_tok) of req into out (chunk-relative). */
static int kv_remote_chunk(kv_remote *r, const kv_expert_req *req, uint32_t t0, uint32_t n_tok, float *out,
                           kv_diag *d) {
    const uint32_t nu = req->n_used, E = r->n_embd, n_slots = n_tok * nu;
    const int32_t *ids = req->ids + (size_t)t0 * nu;
    r->cur_req = req;
    r->cur_t0 = t0;
    for (uint32_t s = 0; s < n_slots; s++) r->slot_owner[s] = KV_OWN_NONE;
    uint32_t pending = n_slots;
    bool revived = false;
    /* a round finishes slots or drops a worker; reconnects need reconnect_ms */
    const uint32_t max_rounds = 2 * r->n_w + 2;
    for (uint32_t round = 0; pending; round++) {
        if (round == max_rounds)
            return kv_fail(d, KV_EINTERNAL, "remote: layer %u: experts still pending after %u rounds", req->layer, round);
        if (round) r->n_retry_pairs += pending;
        r->n_rounds++;
        /* 1. assign every pending slot */
    assign:
        for (uint32_t e = 0; e < r->n_expert; e++) r->exp_owner[e] = -1;
        for (uint32_t i = 0; i < r->n_w; i++) r->w[i].probe_e1 = 0;
        const double t_pick = kv_mono();
        memset(r->load, 0, r->n_w * sizeof *r->load);
        uint32_t n_local = 0;
        for (uint32_t s = 0; s < n_slots; s++) {
            if (r->slot_owner[s] == KV_OWN_DONE) continue;
            const int32_t e = ids[s];
            if (e < 0 || (uint32_t)e >= r->n_expert)
                return kv_fail(d, KV_ERANGE, "remote: expert id %d out of range (%u experts)", e, r->n_expert);
            if (r->exp_owner[e] == -1) {
                const size_t k = (size_t)req->layer * r->n_expert + (uint32_t)e;
                const bool here = r->lhold[k] && kv_share_key(req->layer, (uint32_t)e) < r->local_share;
                int32_t wi = here ? KV_OWN_LOCAL : kv_remote_pick(r, req->layer, (uint32_t)e, t_pick);
                if (wi < 0 && r->lhas[(size_t)req->layer * r->n_expert + (uint32_t)e]) wi = KV_OWN_LOCAL;
                if (wi == -1 && !revived) {
                    /* its holders may be back (restarted, or closed an idle
                     * connection): dial every worker that is down now and
                     * wait for the handshakes, once per chunk */
                    revived = true;
                    if (kv_remote_revive(r)) goto assign;
                }
                if (wi == -1) {
                    char why[384];
                    kv_remote_why(r, req->layer, (uint32_t)e, why, sizeof why);
                    return kv_fail(d, KV_ENOTFOUND, "remote: layer %u expert %d: no worker can compute it and its slab "
                                   "is not present locally (%s)", req->layer, e, why);
                }
                r->exp_owner[e] = wi;
            }
            const int32_t wi = r->exp_owner[e];
            r->slot_owner[s] = wi;
            if (wi >= 0) r->load[wi]++;
            else n_local++;
        }
        /* 2. one COMPUTE per worker, all queued and sent at once */
        const double t_send = kv_mono();
        int n_busy = 0;
        for (uint32_t i = 0; i < r->n_w; i++) {
            if (!r->load[i]) continue;
            int rc = kv_rw_queue(r, &r->w[i], (int32_t)i, (int32_t)i, req, t0, n_tok, -1, d);
            if (rc) return rc;
            n_busy++;
        }
        for (uint32_t i = 0; i < r->n_w; i++) { /* probes: answers timed, not waited for, not used */
            kv_rw *w = &r->w[i];
            if (!w->probe_e1 || r->load[i] || w->busy || w->probing || w->n_ghost || w->state != KV_RW_UP) continue;
            int rc = kv_rw_queue(r, w, (int32_t)i, (int32_t)i, req, t0, n_tok, (int32_t)w->probe_e1 - 1, d);
            if (rc) return rc;
        }
        if (n_busy) kv_remote_poll(r, 0, out); /* gets the frames going before local work */
        /* slots nobody serves: from local slabs, gathered one row per slot */
        if (n_local) {
            uint32_t n = 0;
            for (uint32_t s = 0; s < n_slots; s++) {
                if (r->slot_owner[s] != KV_OWN_LOCAL) continue;
                memcpy(r->lx + (size_t)n * E, req->x + (size_t)(t0 + s / nu) * E, (size_t)E * sizeof(float));
                r->lids[n] = ids[s];
                r->lslot[n++] = (int32_t)s;
            }
            const kv_expert_req lr = {req->layer, n, E, 1, r->lx, r->lids, NULL};
            int rc = r->local.compute(r->local.impl, &lr, r->lout, d);
            if (rc) return kv_diag_prefix(d, rc, "remote: local fallback");
            const double t_local = kv_mono();
            for (uint32_t j = 0; j < n; j++) {
                kv_remote_dm_done(r, r->lids[j], t_local);
                if (r->lhold[(size_t)req->layer * r->n_expert + (uint32_t)r->lids[j]]) r->n_pairs_held_local++;
                memcpy(out + (size_t)r->lslot[j] * E, r->lout + (size_t)j * E, (size_t)E * sizeof(float));
                r->slot_owner[r->lslot[j]] = KV_OWN_DONE;
            }
            pending -= n;
            r->n_pairs_local += n;
        }
        /* 3. gather answers under the round's deadline (from now: local
         * work above must not count against the workers); a request still
         * unanswered at its hedge time also goes to a replica, and each
         * slot takes the first answer that passes the checks (settled as
         * it comes, kv_rw_settle) */
        const double deadline = kv_mono() + r->timeout_s;
        for (;;) {
            int busy = 0;
            for (uint32_t i = 0; i < r->n_w; i++) busy += r->w[i].busy;
            if (!busy) break;
            const double now = kv_mono(), left = deadline - now;
            if (left <= 0) {
                for (uint32_t i = 0; i < r->n_w; i++)
                    if (r->w[i].busy) kv_rw_drop(r, &r->w[i], "no answer within %u ms", r->o.timeout_ms);
                break;
            }
            double wake = left;
            int rc = kv_remote_hedge(r, req, t0, n_tok, now, &wake, d);
            if (rc) return rc;
            kv_remote_poll(r, (int)ceil(wake * 1000.0), out);
        }
        if (n_busy) {
            const double us = (kv_mono() - t_send) * 1e6;
            r->rtt_us[r->n_rtt++ % KV_REMOTE_RTT_SAMPLES] = (float)us;
        }
        /* 4. slots answered are done (kv_rw_settle); the others stay pending */
        pending = 0;
        for (uint32_t s = 0; s < n_slots; s++) {
            if (r->slot_owner[s] == KV_OWN_DONE) continue;
            r->slot_owner[s] = KV_OWN_NONE;
            pending++;
        }
    }
    return 0;
}

static int kv_remote_compute(void *impl, const kv_expert_req *req, float *out, kv_diag *d) {
    kv_remote *r = impl;
    if (req->layer >= r->n_layer || !r->m->moe_layer[req->layer])
        return kv_fail(d, KV_ERANGE, "remote: layer %u has no routed experts", req->layer);
    if (req->n_embd != r->n_embd || req->n_used != r->n_used || req->n_tokens == 0 || req->n_tokens > r->max_tokens)
        return kv_fail(d, KV_EINVAL, "remote: request shape (%u tokens x %u experts, embd %u) exceeds the provider's "
                       "(%u tokens x %u, embd %u)", req->n_tokens, req->n_used, req->n_embd, r->max_tokens, r->n_used,
                       r->n_embd);
    r->n_calls++;
    r->tag_rows = req->tok; /* the rows' tokens when the step's last block carries only some */
    r->tag_on = r->tags && (req->tok ? true : req->n_tokens == r->tag_n);
    for (uint32_t t = 0; r->tag_on && req->tok && t < req->n_tokens; t++) r->tag_on = req->tok[t] < r->tag_n;
    const double t_call = kv_mono();
    kv_remote_poll(r, 0, out); /* notice closed peers, progress reconnects */
    for (uint32_t t0 = 0; t0 < req->n_tokens; t0 += r->chunk_tokens) {
        const uint32_t n = req->n_tokens - t0 < r->chunk_tokens ? req->n_tokens - t0 : r->chunk_tokens;
        int rc = kv_remote_chunk(r, req, t0, n, out + (size_t)t0 * r->n_used * r->n_embd, d);
        if (rc) return rc;
    }
    /* demand: every slot counts once for its slab (retries and hedges do
     * not add computations: the coordinator needed each pair once), and
     * each slab of the call waited from the call's start to its last slot */
    const size_t n_slots = (size_t)req->n_tokens * req->n_used, base = (size_t)req->layer * r->n_expert;
    for (size_t s = 0; s < n_slots; s++) {
        const int32_t sl = r->slab_of[base + (uint32_t)req->ids[s]]; /* ids checked by kv_remote_chunk */
        if (sl < 0) continue;
        r->dm_n[sl]++;
        if (r->dm_mark[sl] == r->n_calls) {
            const double w = r->dm_done[sl] - t_call;
            r->dm_wait_us[sl] += w > 0 ? (uint64_t)(w * 1e6) : 0;
            r->dm_mark[sl] = 0; /* its wait is counted once per call */
        }
    }
    return 0;
}

/* ---- open / free -------------------------------------------------------- */

static int kv_remote_resolve(kv_rw *w, kv_diag *d) {
    char host[256], via[256];
    uint16_t port;
    /* a relayed node (the placement map says so) is dialed at the local
       proxy of its relay route, which carries the connection through a
       circuit with TLS pinned to the node's key (kvasir/relay.h, "routes") */
    const bool relayed = kv_relay_route_find(w->addr, via, sizeof via);
    int rc = kv_link_parse_addr(relayed ? via : w->addr, host, sizeof host, &port, d);
    if (rc) return rc;
    char ps[8];
    snprintf(ps, sizeof ps, "%u", port);
    struct addrinfo hints = {0}, *ai = NULL;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    const int g = getaddrinfo(host, ps, &hints, &ai);
    if (g || !ai) return kv_fail(d, KV_EINVAL, "remote: worker '%s': cannot resolve '%s': %s", w->addr, host, gai_strerror(g));
    memcpy(&w->sa, ai->ai_addr, ai->ai_addrlen);
    w->salen = ai->ai_addrlen;
    freeaddrinfo(ai);
    return 0;
}

/* Sets up w (a zeroed entry of r->w) for addr: resolved, DOWN with no
 * backoff (dialed at the next poll), buffers for the largest frames, the
 * key it must prove (NULL = any). */
static int kv_rw_init(kv_remote *r, kv_rw *w, const char *addr, const uint8_t *expect, kv_diag *d) {
    const size_t n_keys = (size_t)r->n_layer * r->n_expert, S = r->max_slots;
    w->nc = NULL;
    w->tls = NULL;
    w->r = r;
    w->state = KV_RW_DOWN;
    w->twin = -1;
    w->hedge_at = INFINITY;
    if (snprintf(w->addr, sizeof w->addr, "%s", addr) >= (int)sizeof w->addr)
        return kv_fail(d, KV_EINVAL, "remote: worker address '%.64s...' is too long", addr);
    if (expect) memcpy(w->expect, expect, 32);
    int rc = kv_remote_resolve(w, d);
    if (rc) return rc;
    w->holds = calloc(n_keys, 1);
    w->scap = r->w_scap;
    w->rcap = r->w_rcap;
    w->pair_slot = malloc(S * sizeof *w->pair_slot);
    w->pairs = malloc(S * sizeof *w->pairs);
    if (!w->holds || !w->pair_slot || !w->pairs) return kv_fail(d, KV_ENOMEM, "remote: out of memory");
    return 0;
}

void kv_remote_free(kv_remote *r) {
    if (!r) return;
    for (uint32_t i = 0; r->w && i < r->n_w; i++) {
        kv_rw *w = &r->w[i];
        free(w->holds);
        free(w->pair_slot);
        free(w->pairs);
    }
    kv_net_loop_free(r->loop); /* closes every worker connection */
    kv_tls_ctx_free(r->tls);
    free(r->w);
    free(r->slot_owner);
    free(r->exp_owner);
    free(r->load);
    free(r->tok_local);
    free(r->xg);
    free(r->xh);
    free(r->xh_ok);
    free(r->leaves);
    free(r->xrow);
    free(r->yrow);
    if (r->local.free) r->local.free(r->local.impl);
    for (size_t i = 0; r->lg && i < r->m->n_slabs; i++) kv_gguf_close(r->lg[i]);
    free(r->lg);
    free(r->lw);
    free(r->lhold);
    free(r->slab_of);
    free(r->dm_n);
    free(r->dm_wait_us);
    free(r->dm_done);
    free(r->dm_mark);
    free(r->lhas);
    free(r->lx);
    free(r->lout);
    free(r->lids);
    free(r->lslot);
    free(r->rtt_us);
    free(r->t_sent);
    free(r->t_ans);
    free(r->ts_sent);
    free(r->ts_ans);
    kv_model_free(r->model);
    kv_manifest_free(r->m);
    kv_verify_free(r->ver);
    free(r->vg);
    free(r->vdone);
    free(r->vu);
    free(r->vy);
    sodium_memzero(r->sk, sizeof r->sk);
    free(r);
}

/* Loads the backbone that kv_pieces_open verified, and checks it against
 * the manifest. */
static int kv_remote_load_backbone(kv_remote *r, const char *path, kv_diag *d) {
    int rc = kv_model_load_ex(&r->model, path, &(kv_model_opts){.no_experts = true}, d);
    if (rc) return rc;
    return kv_pieces_check_model(r->m, r->model, "remote", d);
}

uint32_t kv_remote_workers_bound(const kv_manifest *m) {
    const uint64_t b = (uint64_t)KV_PLACEMENT_MAX_REPLICAS * m->n_slabs;
    return b < KV_REMOTE_MAX_WORKERS ? KV_REMOTE_MAX_WORKERS : b > UINT32_MAX ? UINT32_MAX : (uint32_t)b;
}

int kv_remote_open(kv_remote **out, const char *manifest_path, kv_pool *pool, const kv_remote_opts *opts,
                   kv_diag *d) {
    *out = NULL;
    if (!opts || opts->enc >= KV_ENC_COUNT || (opts->n_workers && !opts->workers))
        return kv_fail(d, KV_EINVAL, "remote: bad options (encoding, or no worker list)");
    if (!opts->key_sk)
        return kv_fail(d, KV_EINVAL, "remote: a coordinator key is required (workers serve only coordinators "
                                     "that prove a key they allow)");
    if (sodium_init() < 0) return kv_fail(d, KV_EINTERNAL, "remote: libsodium failed to start");
    kv_remote *r = calloc(1, sizeof *r);
    if (!r) return kv_fail(d, KV_ENOMEM, "remote: out of memory");
    r->o = *opts;
    memcpy(r->sk, opts->key_sk, 64);
    crypto_sign_ed25519_sk_to_pk(r->pk, r->sk);
    if (opts->voucher) {
        r->voucher = *opts->voucher;
        r->has_voucher = true;
    }
    r->o.key_sk = NULL;
    r->o.voucher = NULL;
    if (!r->o.timeout_ms) r->o.timeout_ms = 10000;
    if (!r->o.reconnect_ms) r->o.reconnect_ms = 500;
    if (!r->o.max_tokens) r->o.max_tokens = 256;
    r->timeout_s = r->o.timeout_ms / 1000.0;
    r->reconnect_s = r->o.reconnect_ms / 1000.0;
    r->hedge_budget = r->o.hedge_budget < 0 ? 0 : r->o.hedge_budget > 0 ? r->o.hedge_budget : KV_REMOTE_HEDGE_BUDGET;
    if (r->hedge_budget > 1) r->hedge_budget = 1;
    r->hedge_tokens = 1; /* the first stall can be hedged */
    randombytes_buf(&r->pick_rng, sizeof r->pick_rng);
    r->pick_rng |= 1;
    randombytes_buf(&r->sig_rng, sizeof r->sig_rng);
    r->sig_rng |= 1;
    r->pool = pool;
    /* the pieces: manifest, backbone, and whichever slabs are present */
    kv_pieces *pc = NULL;
    const kv_pieces_opts po = {.who = "remote", .runnable = true, .slabs_may_be_missing = true,
                               .allow_sparse = r->o.allow_sparse, .skip_hashes = r->o.skip_hashes,
                               .keep_gguf = true};
    int rc = kv_pieces_open(&pc, manifest_path, &po, d);
    if (rc) goto fail;
    r->m = kv_pieces_take_manifest(pc);
    const kv_manifest *m = r->m;
    r->n_layer = m->n_layer;
    r->n_expert = m->n_expert;
    r->n_embd = m->n_embd;
    r->n_ff = m->n_ff_exp;
    r->n_used = m->n_expert_used;
    r->max_tokens = r->o.max_tokens;
    if ((rc = kv_remote_load_backbone(r, pc->backbone, d))) goto fail;

    /* frame limits: tokens per round so that COMPUTE and RESULT fit */
    {
        const uint64_t E = r->n_embd, nu = r->n_used;
        uint64_t ct = r->max_tokens;
        if (ct > KV_PROTO_MAX_TOKENS) ct = KV_PROTO_MAX_TOKENS;
        if (ct > KV_PROTO_MAX_PAIRS / nu) ct = KV_PROTO_MAX_PAIRS / nu;
        const uint64_t per_tok = nu * E * 4 + E * 4 + nu * 8, room = KV_PROTO_MAX_PAYLOAD - 4096;
        if (ct > room / per_tok) ct = room / per_tok;
        if (ct == 0) {
            rc = kv_fail(d, KV_EUNSUPPORTED, "remote: one token's experts (%" PRIu64 " x %" PRIu64 ") exceed a frame",
                         nu, E);
            goto fail;
        }
        r->chunk_tokens = (uint32_t)ct;
        r->max_slots = r->chunk_tokens * r->n_used;
    }
    const size_t n_keys = (size_t)r->n_layer * r->n_expert, E = r->n_embd, S = r->max_slots;
    r->slot_owner = malloc(S * sizeof *r->slot_owner);
    r->exp_owner = malloc(r->n_expert * sizeof *r->exp_owner);
    r->n_w = r->o.n_workers;
    {   /* as many workers as a placement map of this model can name */
        const uint32_t bound = kv_remote_workers_bound(m);
        if (r->n_w > bound) {
            rc = kv_fail(d, KV_EINVAL, "remote: %u workers, more than this model's %u (%u per shard)", r->n_w, bound,
                         KV_PLACEMENT_MAX_REPLICAS);
            goto fail;
        }
        r->cap_w = r->o.max_workers > r->n_w ? r->o.max_workers : r->n_w;
        if (r->cap_w > bound) r->cap_w = bound;
    }
    r->load = calloc(r->cap_w ? r->cap_w : 1, sizeof *r->load);
    r->tok_local = malloc(r->chunk_tokens * sizeof *r->tok_local);
    r->xg = malloc((size_t)r->chunk_tokens * E * sizeof *r->xg);
    r->xh = malloc((size_t)r->chunk_tokens * sizeof *r->xh);
    r->xh_ok = malloc(r->chunk_tokens);
    r->leaves = malloc(S * sizeof *r->leaves);
    r->xrow = malloc(E * 4);
    r->yrow = malloc(E * 4);
    r->lg = calloc(m->n_slabs ? m->n_slabs : 1, sizeof *r->lg);
    r->lw = calloc(n_keys, sizeof *r->lw);
    r->lhas = calloc(n_keys, 1);
    r->lhold = calloc(n_keys, 1);
    r->slab_of = malloc(n_keys * sizeof *r->slab_of);
    const size_t n_sl = m->n_slabs ? m->n_slabs : 1;
    r->dm_n = calloc(n_sl, sizeof *r->dm_n);
    r->dm_wait_us = calloc(n_sl, sizeof *r->dm_wait_us);
    r->dm_done = calloc(n_sl, sizeof *r->dm_done);
    r->dm_mark = calloc(n_sl, sizeof *r->dm_mark);
    r->rtt_us = malloc(KV_REMOTE_RTT_SAMPLES * sizeof *r->rtt_us);
    r->w = calloc(r->cap_w ? r->cap_w : 1, sizeof *r->w);
    if (kv_net_loop_new(&r->loop, d)) {
        rc = KV_EIO;
        goto fail;
    }
    if (!opts->insecure_plaintext && (rc = kv_link_tls_ctx(&r->tls, r->sk, d))) goto fail;
    if (!r->slot_owner || !r->exp_owner || !r->load || !r->tok_local || !r->xg || !r->lg || !r->lw ||
        !r->lhas || !r->rtt_us || !r->w || !r->xh || !r->xh_ok || !r->leaves || !r->xrow || !r->yrow ||
        !r->lhold || !r->slab_of || !r->dm_n || !r->dm_wait_us || !r->dm_done || !r->dm_mark) {
        rc = kv_fail(d, KV_ENOMEM, "remote: out of memory");
        goto fail;
    }
    for (size_t k = 0; k < n_keys; k++) r->slab_of[k] = -1;
    for (size_t i = 0; i < m->n_slabs; i++) /* the manifest checked layers and ranges against the dims */
        for (uint32_t e = m->slabs[i].first; m->slabs[i].layer < r->n_layer && e <= m->slabs[i].last && e < r->n_expert; e++)
            r->slab_of[(size_t)m->slabs[i].layer * r->n_expert + e] = (int32_t)i;
    /* local fallback */
    if ((rc = kv_remote_open_local(r, pc, d))) goto fail;
    kv_pieces_free(pc);
    pc = NULL;
    if (r->n_local_slabs) {
        const kv_expert_source src = {r, kv_local_acquire, NULL, r->n_layer, r->n_expert, r->n_embd, r->n_ff, 1};
        if ((rc = kv_expert_local_new_src(&r->local, &src, pool, r->max_slots, d))) goto fail;
        r->lx = malloc(S * E * sizeof *r->lx);
        r->lout = malloc(S * E * sizeof *r->lout);
        r->lids = malloc(S * sizeof *r->lids);
        r->lslot = malloc(S * sizeof *r->lslot);
        if (!r->lx || !r->lout || !r->lids || !r->lslot) {
            rc = kv_fail(d, KV_ENOMEM, "remote: out of memory");
            goto fail;
        }
    }
    /* workers: buffers for the largest frames either way */
    const size_t s_max = kv_msg_compute_size(KV_ENC_F32, r->chunk_tokens, r->n_embd, r->max_slots);
    size_t r_max = kv_msg_result_size_v(KV_PROTO_VERSION, KV_ENC_F32, r->max_slots, r->n_embd);
    if (opts->verify) { /* answers carry gate and up beside y */
        uint8_t hb[KV_PROTO_HEADER + KV_PROTO_RESULT_PRE_FIXED];
        const size_t pre = kv_msg_result_pre_head(hb, KV_PROTO_VERSION, 0, r->max_slots, r->n_embd, r->n_ff);
        if (!pre) {
            rc = kv_fail(d, KV_ERANGE, "remote: answers with pre-activations would exceed a frame");
            goto fail;
        }
        if (pre > r_max) r_max = pre;
        if ((rc = kv_verify_new(&r->ver, r->n_layer, r->n_expert, r->n_embd, r->n_ff, opts->verify, d))) goto fail;
        /* what the checks will meet, refused now rather than at the first answer */
        for (size_t k = 0; k < (size_t)r->n_layer * r->n_expert; k++)
            if (r->lhas[k] && (rc = kv_verify_supported(&r->lw[k], (uint32_t)(k / r->n_expert), r->n_embd, r->n_ff, d)))
                goto fail;
        r->vdone = malloc(S ? S : 1);
        r->vg = malloc(4 * (size_t)r->n_ff * sizeof *r->vg);
        r->vu = malloc(4 * (size_t)r->n_ff * sizeof *r->vu);
        r->vy = malloc(r->n_embd * sizeof *r->vy);
        if (!r->vdone || !r->vg || !r->vu || !r->vy) {
            rc = kv_fail(d, KV_ENOMEM, "remote: out of memory");
            goto fail;
        }
        randombytes_buf(&r->rng, sizeof r->rng);
        r->rng |= 1;
        if (!r->n_local_slabs)
            kv_rlog(r, "verify: no slab in the manifest's folder: answers cannot be checked (counted unverified)");
    }
    /* a HELLO_ACK lists at most every slab of the manifest (and as many ranges) */
    const uint32_t n_pieces = m->n_slabs < KV_PROTO_MAX_RANGES ? (uint32_t)m->n_slabs : KV_PROTO_MAX_RANGES;
    const size_t ack_max = kv_msg_hello_ack_size_v(KV_PROTO_VERSION, KV_PROTO_MAX_NAME, n_pieces, n_pieces);
    if (ack_max > r_max) r_max = ack_max;
    if (!s_max || !r_max) {
        rc = kv_fail(d, KV_EINTERNAL, "remote: frame sizes out of bounds");
        goto fail;
    }
    r->w_scap = s_max;
    r->w_rcap = r_max;
    for (uint32_t i = 0; i < r->n_w; i++)
        if ((rc = kv_rw_init(r, &r->w[i], r->o.workers[i], r->o.worker_keys ? r->o.worker_keys[i] : NULL, d)))
            goto fail;
    /* connect and handshake with everyone at once */
    for (;;) {
        kv_remote_poll(r, 50, NULL);
        bool pending = false;
        for (uint32_t i = 0; i < r->n_w; i++) pending |= kv_rw_handshaking(&r->w[i]);
        if (!pending) break;
    }
    uint32_t n_up = 0;
    for (uint32_t i = 0; i < r->n_w; i++) {
        if (r->w[i].state == KV_RW_UP) n_up++;
        else kv_rlog(r, "worker %s unavailable at start: %s", r->w[i].addr, r->w[i].why);
    }
    /* every expert of every MoE layer the forward pass runs (the trunk, not
     * the MTP blocks) must be served by someone */
    for (uint32_t L = 0; L < r->n_layer - m->n_layer_nextn; L++) {
        if (!m->moe_layer[L]) continue;
        for (uint32_t e = 0; e < r->n_expert; e++) {
            const size_t k = (size_t)L * r->n_expert + e;
            bool ok = r->lhas[k];
            for (uint32_t i = 0; i < r->n_w && !ok; i++) ok = r->w[i].state == KV_RW_UP && r->w[i].holds[k];
            if (ok) continue;
            const char *slab = "?";
            for (size_t s = 0; s < m->n_slabs; s++)
                if (m->slabs[s].layer == L && m->slabs[s].first <= e && e <= m->slabs[s].last) slab = m->slabs[s].file.path;
            char why[384] = "";
            size_t o = 0;
            for (uint32_t i = 0; i < r->n_w && o + 1 < sizeof why; i++) {
                if (r->w[i].state == KV_RW_UP) continue;
                int n = snprintf(why + o, sizeof why - o, "%s%s: %s", o ? "; " : "; unreachable: ", r->w[i].addr,
                                 r->w[i].why);
                if (n > 0) o += (size_t)n;
            }
            if (r->o.allow_uncovered) {
                kv_rlog(r, "layer %u expert %u is served by no worker yet (%u of %u up; slab '%s')", L, e, n_up,
                        r->n_w, slab);
                goto covered_enough;
            }
            rc = kv_fail(d, KV_ENOTFOUND, "remote: layer %u expert %u is served by no worker (%u of %u up) and its "
                         "slab '%s' is not present locally%s", L, e, n_up, r->n_w, slab, why);
            goto fail;
        }
    }
covered_enough:
    r->prov = (kv_expert_provider){r, kv_remote_compute, NULL, "remote"};
    *out = r;
    return 0;
fail:
    kv_pieces_free(pc);
    kv_remote_free(r);
    return rc;
}

const kv_expert_provider *kv_remote_provider(kv_remote *r) { return &r->prov; }
const kv_model *kv_remote_model(const kv_remote *r) { return r->model; }
const kv_manifest *kv_remote_manifest(const kv_remote *r) { return r->m; }
uint32_t kv_remote_n_workers(const kv_remote *r) { return r->n_w; }

void kv_remote_worker_info(const kv_remote *r, uint32_t i, kv_remote_worker *out) {
    memset(out, 0, sizeof *out);
    if (i >= r->n_w) return;
    const kv_rw *w = &r->w[i];
    out->addr = w->addr;
    out->up = w->state == KV_RW_UP;
    out->backend = w->backend;
    out->enc = w->enc;
    out->n_ranges = w->n_ranges;
    out->requests = w->n_req;
    out->pairs = w->n_pairs_done;
    out->pairs_since_connect = w->n_pairs_since;
    out->drops = w->n_drops;
    out->connects = w->n_connects;
    out->last_error = w->why;
    out->key = w->key;
    out->caught = w->caught;
    out->verified = w->n_verified;
    out->latency_ms = w->lat_s * 1e3;
    out->p95_ms = kv_rw_lat_q(w, 0.95) * 1e3;
    out->hedged = w->n_hedged;
    out->hedges_won = w->n_hedges_won;
    out->late = w->n_late;
    out->cancelled = w->n_cancelled;
    out->demoted = w->probe_at > 0;
    out->probes = w->n_probes;
}

static int kv_cmp_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

void kv_remote_get_stats(const kv_remote *r, kv_remote_stats *out) {
    memset(out, 0, sizeof *out);
    out->calls = r->n_calls;
    out->rounds = r->n_rounds;
    out->retried_pairs = r->n_retry_pairs;
    out->pairs_remote = r->n_pairs_remote;
    out->pairs_local = r->n_pairs_local;
    out->bytes_sent = r->bytes_sent;
    out->bytes_recv = r->bytes_recv;
    out->n_rtt = r->n_rtt;
    out->pairs_verified = r->n_verified;
    out->pairs_unverified = r->n_unverified;
    out->pairs_recomputed = r->n_recomputed;
    out->caught = r->n_caught;
    out->sigs_checked = r->n_sig_checked;
    out->sigs_deferred = r->n_sig_deferred;
    out->hedges = r->n_hedges;
    out->pairs_hedged = r->n_hedge_pairs;
    out->hedges_won = r->n_hedges_won;
    out->late_answers = r->n_late;
    out->hedges_cancelled = r->n_cancelled;
    out->pairs_held_local = r->n_pairs_held_local;
    const size_t n = r->n_rtt < KV_REMOTE_RTT_SAMPLES ? (size_t)r->n_rtt : KV_REMOTE_RTT_SAMPLES;
    if (!n) return;
    float *tmp = malloc(n * sizeof *tmp); /* reporting, not the hot path */
    if (!tmp) return;
    memcpy(tmp, r->rtt_us, n * sizeof *tmp);
    qsort(tmp, n, sizeof *tmp, kv_cmp_float);
    out->rtt_p50_us = tmp[(n - 1) / 2];
    out->rtt_p99_us = tmp[(size_t)((double)(n - 1) * 0.99)];
    out->rtt_max_us = tmp[n - 1];
    free(tmp);
}

void kv_remote_get_pairs(const kv_remote *r, uint64_t *remote, uint64_t *local, uint64_t *held_local) {
    if (remote) *remote = r->n_pairs_remote;
    if (local) *local = r->n_pairs_local;
    if (held_local) *held_local = r->n_pairs_held_local;
}

void kv_remote_get_hedges(const kv_remote *r, uint64_t *sent, uint64_t *won, uint64_t *late) {
    if (sent) *sent = r->n_hedges;
    if (won) *won = r->n_hedges_won;
    if (late) *late = r->n_late;
}

uint64_t kv_remote_hedged_pairs(const kv_remote *r) { return r->n_hedge_pairs; }

uint64_t kv_remote_hedges_cancelled(const kv_remote *r) { return r->n_cancelled; }

void kv_remote_get_sigs(const kv_remote *r, uint64_t *checked, uint64_t *deferred) {
    *checked = r->n_sig_checked;
    *deferred = r->n_sig_deferred;
}

void kv_remote_reset_stats(kv_remote *r) {
    r->n_calls = r->n_rounds = r->n_retry_pairs = r->n_pairs_remote = r->n_pairs_local = 0;
    r->bytes_sent = r->bytes_recv = r->n_rtt = 0;
    r->n_hedges = r->n_hedges_won = r->n_late = r->n_cancelled = r->n_hedge_pairs = r->n_pairs_held_local = 0;
    r->n_verified = r->n_unverified = r->n_recomputed = 0; /* caught workers stay counted */
    r->n_sig_checked = r->n_sig_deferred = 0;
}

/* ---- per-session work tally ---------------------------------------------- */

int kv_remote_tally_open(kv_remote *r, uint32_t n_tags, kv_diag *d) {
    const uint32_t stride = r->cap_w; /* every worker this remote can have, added ones included */
    const size_t n = (size_t)n_tags * stride;
    free(r->t_sent);
    free(r->t_ans);
    free(r->ts_sent);
    free(r->ts_ans);
    r->t_sent = calloc(n ? n : 1, sizeof(uint64_t));
    r->t_ans = calloc(n ? n : 1, sizeof(uint64_t));
    r->ts_sent = calloc(n ? n : 1, sizeof(uint64_t));
    r->ts_ans = calloc(n ? n : 1, sizeof(uint64_t));
    r->tags = NULL;
    r->tag_on = false;
    if (!r->t_sent || !r->t_ans || !r->ts_sent || !r->ts_ans) {
        r->n_tags = r->t_stride = 0;
        return kv_fail(d, KV_ENOMEM, "remote: out of memory for the work tally (%u sessions x %u workers)", n_tags,
                       stride);
    }
    r->n_tags = n_tags;
    r->t_stride = stride;
    return 0;
}

void kv_remote_tally_begin(kv_remote *r, const uint32_t *tags, uint32_t n_tokens) {
    r->tags = NULL;
    r->tag_n = 0;
    if (!r->n_tags || !tags) return;
    for (uint32_t t = 0; t < n_tokens; t++)
        if (tags[t] >= r->n_tags) return; /* not ours to count */
    for (uint32_t t = 0; t < n_tokens; t++) {
        memset(r->ts_sent + (size_t)tags[t] * r->t_stride, 0, r->t_stride * sizeof(uint64_t));
        memset(r->ts_ans + (size_t)tags[t] * r->t_stride, 0, r->t_stride * sizeof(uint64_t));
    }
    r->tags = tags;
    r->tag_n = n_tokens;
}

void kv_remote_tally_end(kv_remote *r, bool commit) {
    if (r->tags && commit) {
        for (uint32_t t = 0; t < r->tag_n; t++) {
            const size_t row = (size_t)r->tags[t] * r->t_stride;
            for (uint32_t w = 0; w < r->t_stride; w++) {
                r->t_sent[row + w] += r->ts_sent[row + w];
                r->t_ans[row + w] += r->ts_ans[row + w];
                r->ts_sent[row + w] = r->ts_ans[row + w] = 0; /* a tag's row is added once */
            }
        }
    }
    r->tags = NULL;
    r->tag_n = 0;
    r->tag_on = false;
}

void kv_remote_tally_get(const kv_remote *r, uint32_t tag, uint32_t w, uint64_t *sent, uint64_t *answered) {
    const bool in = tag < r->n_tags && w < r->t_stride;
    if (sent) *sent = in ? r->t_sent[(size_t)tag * r->t_stride + w] : 0;
    if (answered) *answered = in ? r->t_ans[(size_t)tag * r->t_stride + w] : 0;
}

void kv_remote_tally_reset(kv_remote *r, uint32_t tag) {
    if (tag >= r->n_tags) return;
    memset(r->t_sent + (size_t)tag * r->t_stride, 0, r->t_stride * sizeof(uint64_t));
    memset(r->t_ans + (size_t)tag * r->t_stride, 0, r->t_stride * sizeof(uint64_t));
}

/* ---- work receipts ------------------------------------------------------------ */

int kv_remote_receipt(kv_remote *r, uint32_t i, const kv_receipt_req *q, struct kv_receipt *out, kv_diag *d) {
    if (i >= r->n_w) return kv_fail(d, KV_EINVAL, "remote: no worker %u", i);
    kv_rw *w = &r->w[i];
    if (w->state != KV_RW_UP || w->busy)
        return kv_fail(d, KV_ENOTFOUND, "remote: worker %s is not up for a receipt", w->addr);
    const size_t cap = KV_PROTO_HEADER + KV_PROTO_RECEIPT_REQ_SIZE;
    uint8_t *p = kv_net_conn_reserve(w->nc, cap);
    if (!p) return kv_fail(d, KV_EINTERNAL, "remote: no room to queue a RECEIPT_REQ for %s", w->addr);
    size_t len = 0;
    int rc = kv_msg_receipt_req_encode(p, cap, ++w->req_id, q, &len, d);
    if (rc) return rc;
    kv_frame_set_version(p, w->version);
    kv_net_conn_commit(w->nc, len);
    r->bytes_sent += len;
    w->rcpt_wait = true;
    w->rcpt_id = w->req_id;
    w->rcpt_req = *q;
    const double deadline = kv_mono() + r->timeout_s;
    while (w->rcpt_wait && w->state == KV_RW_UP) {
        const double left = deadline - kv_mono();
        if (left <= 0) {
            kv_rw_drop(r, w, "no RECEIPT within %u ms", r->o.timeout_ms);
            break;
        }
        kv_remote_poll(r, (int)ceil(left * 1000.0), NULL);
    }
    if (w->rcpt_wait) {
        w->rcpt_wait = false;
        return kv_fail(d, KV_EIO, "remote: worker %s gave no receipt: %s", w->addr, w->why);
    }
    if (w->rcpt_rc) return kv_fail(d, w->rcpt_rc, "remote: worker %s refused the receipt", w->addr);
    *out = w->rcpt;
    return 0;
}

/* ---- a worker set that changes ---------------------------------------------- */

int kv_remote_add_worker(kv_remote *r, const char *addr, const uint8_t *key, kv_diag *d) {
    for (uint32_t i = 0; i < r->n_w; i++) {
        kv_rw *w = &r->w[i];
        if (strcmp(w->addr, addr)) continue;
        if (key && memcmp(w->expect, key, 32)) {
            /* the address now belongs to another node (a replacement): it
               must prove the new key; a connection to the old one goes */
            memcpy(w->expect, key, 32);
            w->fails = 0;
            if (w->state != KV_RW_DOWN) kv_rw_drop(r, w, "the hub lists another node at this address");
            w->fails = 0;
            w->retry_at = 0;
            return 0;
        }
        /* named again by the placement: it may have restarted; quarantined
         * ones still wait for their backoff */
        if (w->state == KV_RW_DOWN && w->fails < 2) w->retry_at = 0;
        return 0;
    }
    if (r->n_w >= r->cap_w)
        return kv_fail(d, KV_ERANGE, "remote: cannot add worker %.64s: room for %u workers", addr, r->cap_w);
    kv_rw *w = &r->w[r->n_w];
    int rc = kv_rw_init(r, w, addr, key, d);
    if (rc) {
        free(w->holds);
        free(w->pair_slot);
        free(w->pairs);
        memset(w, 0, sizeof *w);
        return rc;
    }
    r->n_w++;
    kv_rlog(r, "worker %s added", w->addr);
    return 1;
}

void kv_remote_tend(kv_remote *r, int timeout_ms) { kv_remote_poll(r, timeout_ms, NULL); }

int kv_remote_check_layer(const kv_remote *r, uint32_t layer, kv_diag *d) {
    if (layer >= r->n_layer || !r->m->moe_layer[layer])
        return kv_fail(d, KV_ERANGE, "remote: layer %u is not a MoE layer of the manifest (%u layers)", layer,
                       r->n_layer);
    uint32_t n_up = 0, n_miss = 0, first = 0;
    for (uint32_t i = 0; i < r->n_w; i++) n_up += r->w[i].state == KV_RW_UP;
    for (uint32_t e = 0; e < r->n_expert; e++) {
        const size_t k = (size_t)layer * r->n_expert + e;
        bool held = r->lhas[k];
        for (uint32_t i = 0; i < r->n_w && !held; i++) held = r->w[i].state == KV_RW_UP && r->w[i].holds[k];
        if (!held && !n_miss++) first = e;
    }
    if (!n_miss) return 0;
    return kv_fail(d, KV_ENOTFOUND, "remote: layer %u: %u of its %u experts (expert %u first) are served by no "
                   "worker (%u of %u up) and not present locally", layer, n_miss, r->n_expert, first, n_up, r->n_w);
}

void kv_remote_get_coverage(const kv_remote *r, kv_remote_coverage *out, uint32_t *missing, uint32_t cap) {
    memset(out, 0, sizeof *out);
    for (uint32_t i = 0; i < r->n_w; i++) out->workers_up += r->w[i].state == KV_RW_UP;
    const kv_manifest *m = r->m;
    for (size_t s = 0; s < m->n_slabs; s++) {
        const kv_manifest_slab *sl = &m->slabs[s];
        if (sl->layer >= r->n_layer - m->n_layer_nextn || !m->moe_layer[sl->layer]) continue;
        out->total++;
        bool ok = true;
        for (uint32_t e = sl->first; e <= sl->last && e < r->n_expert && ok; e++) {
            const size_t k = (size_t)sl->layer * r->n_expert + e;
            bool held = r->lhas[k];
            for (uint32_t i = 0; i < r->n_w && !held; i++) held = r->w[i].state == KV_RW_UP && r->w[i].holds[k];
            ok = held;
        }
        if (ok) out->covered++;
        else if (out->n_missing < cap) missing[out->n_missing++] = (uint32_t)s;
    }
}

/* ---- demand metering and local experts ------------------------------------ */

size_t kv_remote_get_demand(const kv_remote *r, kv_remote_demand *out, size_t cap) {
    const size_t n = r->m->n_slabs < cap ? r->m->n_slabs : cap;
    for (size_t i = 0; i < n; i++) out[i] = (kv_remote_demand){r->dm_n[i], r->dm_wait_us[i]};
    return r->m->n_slabs;
}

typedef struct kv_hold_cand {
    uint64_t demand;   /* computations metered so far */
    uint32_t pos;      /* the slab's place within its layer (0, 1, ...) */
    uint32_t slab;     /* manifest index */
} kv_hold_cand;

/* hottest first; with equal demand one slab of every layer before the
 * second of any, so that a budget without measurements spreads evenly */
static int kv_hold_cmp(const void *a, const void *b) {
    const kv_hold_cand *x = a, *y = b;
    if (x->demand != y->demand) return x->demand > y->demand ? -1 : 1;
    if (x->pos != y->pos) return x->pos < y->pos ? -1 : 1;
    return (x->slab > y->slab) - (x->slab < y->slab);
}

int kv_remote_local_hold(kv_remote *r, uint64_t budget, uint64_t *held_bytes, uint32_t *held_slabs, kv_diag *d) {
    const kv_manifest *m = r->m;
    kv_hold_cand *c = malloc((m->n_slabs ? m->n_slabs : 1) * sizeof *c);
    if (!c) return kv_fail(d, KV_ENOMEM, "remote: out of memory choosing local experts");
    size_t n = 0;
    uint32_t pos = 0;
    for (size_t i = 0; i < m->n_slabs; i++) {
        pos = i && m->slabs[i].layer == m->slabs[i - 1].layer ? pos + 1 : 0;
        if (r->lg[i] && m->moe_layer[m->slabs[i].layer]) c[n++] = (kv_hold_cand){r->dm_n[i], pos, (uint32_t)i};
    }
    qsort(c, n, sizeof *c, kv_hold_cmp);
    memset(r->lhold, 0, (size_t)r->n_layer * r->n_expert);
    uint64_t used = 0;
    uint32_t k = 0;
    for (size_t j = 0; j < n; j++) {
        const kv_manifest_slab *ms = &m->slabs[c[j].slab];
        if (ms->file.size > budget - used) continue; /* a smaller, colder one may still fit */
        used += ms->file.size;
        k++;
        memset(r->lhold + (size_t)ms->layer * r->n_expert + ms->first, 1, ms->last - ms->first + 1u);
    }
    free(c);
    if (held_bytes) *held_bytes = used;
    if (held_slabs) *held_slabs = k;
    return 0;
}

void kv_remote_set_local_share(kv_remote *r, double share) {
    r->local_share = !(share > 0.0) ? 0.0 : share > 1.0 ? 1.0 : share;
}
double kv_remote_local_share(const kv_remote *r) { return r->local_share; }
