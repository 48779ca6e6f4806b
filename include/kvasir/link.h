/* Link: what every connection between Kvasir processes shares, below the
 * message codecs of dispatch and the ring: who is at the other end and how
 * to reach it.
 *
 *   - Hex: one encoder and one strict decoder (exactly 2n digits; lowercase,
 *     or either case where a format has always accepted both).
 *   - Keys: Ed25519 (libsodium layout, sk = seed || pk); a key file holds the
 *     32-byte seed as 64 lowercase hex digits and a newline, nothing else.
 *   - Signatures: Ed25519 over a 32-byte digest, so the signed text never
 *     depends on a length read from the wire; each protocol hashes its own
 *     domain-separated transcript into that digest.
 *   - Vouchers: a hub's statement that it vouches for a coordinator key for
 *     one model until a time (docs/HUB.md, POST /v1/voucher), honoured by
 *     workers and ring nodes that trust that hub.
 *   - The key handshake's transcript, one for every protocol that
 *     authenticates a connection (dispatch, ring links and clients).
 *   - Addresses: "HOST:PORT" / "[v6]:PORT", a blocking TCP dial, and the
 *     blocking reads and writes of every blocking client, with limits.
 *   - The coordinator's side of the dispatch key handshake (docs/PROTOCOL.md,
 *     v3 and later) as one blocking call: HELLO, HELLO_ACK, AUTH_CHALLENGE
 *     (the worker's key must be the one expected), AUTH (the caller's key
 *     over the transcript, with a voucher when given), AUTH_OK (the worker's
 *     signature over the same transcript, verified).
 *
 * Everything here is thread-safe and keeps no state; every wait is bounded
 * (blocking I/O: unless the caller asks for no limit). */
#ifndef KVASIR_LINK_H
#define KVASIR_LINK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"

#define KV_LINK_MODEL_ID_LEN 64u /* a model identity: 64 lowercase hex digits */
#define KV_LINK_MAX_NAME 64u     /* bytes of a worker's backend name (HELLO_ACK) */

/* ---- hex (src/link/identity.c) -------------------------------------------- */

/* Lowercase hex of b[0, n) into out[2n + 1] (NUL-terminated). */
void kv_hex(const uint8_t *b, size_t n, char *out);
/* Exactly 2n hex digits s[0, slen) into out[n]: lowercase only, or either
 * case when any_case. Returns 0, or KV_EFORMAT (wrong length, another
 * character); out is unspecified then. Never reads past s + slen. */
int kv_unhex(const char *s, size_t slen, uint8_t *out, size_t n, bool any_case);
/* "64 lowercase hex digits" (NUL-terminated) -> 32 bytes; KV_EINVAL
 * otherwise (hex may be NULL). */
int kv_key_from_hex(const char *hex, uint8_t out[32], kv_diag *d);

/* ---- keys ----------------------------------------------------------------- */

typedef struct kv_node_key {
    uint8_t pk[32];        /* Ed25519 public key */
    uint8_t sk[64];        /* secret key (libsodium layout: seed || pk) */
    uint64_t last_counter; /* last hub request counter handed out (kv_node_next_counter) */
} kv_node_key;

/* Deterministic key from a 32-byte seed (tests, load generator). */
void kv_node_key_from_seed(kv_node_key *k, const uint8_t seed[32]);
/* Loads the key file at path, or, when it does not exist and create is true,
 * makes its folder (0700) if missing and a new file (0600, 64 hex digits of
 * a random seed and a newline, written to a temporary name and linked into
 * place, so a key written meanwhile by another process wins). A file of any
 * other size or content is KV_EFORMAT; it is never overwritten. KV_ENOTFOUND
 * when absent and !create, KV_EIO, KV_EINVAL (path too long). */
int kv_key_file_load(kv_node_key *k, const char *path, bool create, kv_diag *d);
/* The key file of a node's (or ring node's) data folder: DIR/node.key,
 * through kv_key_file_load (create makes DIR when missing). KV_EINVAL when
 * the path is too long. */
#define KV_LINK_KEY_FILE "node.key"
int kv_node_key_load(kv_node_key *k, const char *dir, bool create, kv_diag *d);

/* Keys from --allow-key VALUE: 64 hex digits, or a file with one key per
 * line ('#' comments and blank lines skipped; at most KV_LINK_MAX_KEYS).
 * Appends to *keys (realloc'd; caller frees) and *n. KV_EINVAL / KV_EIO /
 * KV_ERANGE. */
#define KV_LINK_MAX_KEYS 65536u
int kv_key_list_add(const char *value, uint8_t (**keys)[32], size_t *n, kv_diag *d);

/* ---- signatures ----------------------------------------------------------- */

/* Ed25519 over a 32-byte digest with a libsodium secret key (seed || pk).
 * Never fails. */
void kv_link_sign(const uint8_t sk[64], const uint8_t digest[32], uint8_t sig[64]);
/* 0 when sig is pk's over digest; KV_EAUTH otherwise. */
int kv_link_verify(const uint8_t pk[32], const uint8_t digest[32], const uint8_t sig[64]);

/* ---- the key handshake's transcript (src/link/handshake.c) ---------------
 * Every authenticated connection (dispatch v3 and later, ring links and ring
 * clients) opens the same way: the accepting side sends its key and a fresh
 * 32-byte challenge, the connecting side answers with its key, a fresh
 * 32-byte nonce and its signature over the transcript, and the acceptor
 * signs the same transcript back. The transcript is SHA-256 over, in order:
 *   the protocol's domain line    "kvasir-dispatch-auth-v3\n" or
 *                                 "kvasir-ring-auth-v1\n"
 *   the signer's role (1 byte)    dispatch 'C' / 'W', ring 'C' / 'A'
 *   the model id                  64 hex digits as on the wire
 *   the version (u16 LE)          dispatch only: the one negotiated
 *   the acceptor's key, its challenge, the connector's key, its nonce
 *   the channel binding (32)      only when one is given
 * (docs/PROTOCOL.md is normative, dispatch and ring sections). The challenge makes
 * every connection's transcript different, so a signature cannot be
 * replayed on another; the acceptor's key binds the connector's proof to
 * the peer it meant, so that peer cannot relay it elsewhere; the role keeps
 * the two signatures apart. A channel binding (a value both ends derive from
 * their secure channel) ties the proof to that one channel; without one
 * (NULL) nothing is hashed for it. Pure and thread-safe. */

enum kv_link_hs_proto {
    KV_LINK_HS_DISPATCH = 0, /* coordinator (connector) and worker (acceptor) */
    KV_LINK_HS_RING = 1,     /* a ring node or client (connector) and a ring node (acceptor) */
    KV_LINK_HS_COUNT
};
enum kv_link_hs_role { KV_LINK_CONNECTOR = 0, KV_LINK_ACCEPTOR = 1 };

typedef struct kv_link_transcript {
    uint32_t proto;               /* KV_LINK_HS_*: the domain, roles and fields hashed */
    const char *model_id;         /* [64] hex digits: the model both ends serve */
    uint16_t version;             /* dispatch: the negotiated protocol version; ring: not hashed */
    const uint8_t *acceptor_key;  /* [32] */
    const uint8_t *challenge;     /* [32] the acceptor's, fresh per connection */
    const uint8_t *connector_key; /* [32] */
    const uint8_t *nonce;         /* [32] the connector's, fresh per connection */
    const uint8_t *binding;       /* [32] channel binding; NULL = none */
} kv_link_transcript;

/* The digest `role` (KV_LINK_CONNECTOR or KV_LINK_ACCEPTOR) signs over t.
 * KV_ASSERTs a known proto and role and non-NULL fields (our own calls). */
void kv_link_transcript_digest(const kv_link_transcript *t, int role, uint8_t out[32]);
/* role's signature over t with sk (seed || pk). Never fails. */
void kv_link_transcript_sign(const kv_link_transcript *t, int role, const uint8_t sk[64], uint8_t sig[64]);
/* 0 when sig is pk's signature over t as role; KV_EAUTH otherwise. */
int kv_link_transcript_verify(const kv_link_transcript *t, int role, const uint8_t pk[32], const uint8_t sig[64]);

/* ---- vouchers ------------------------------------------------------------- */

typedef struct kv_voucher {
    uint8_t key[32];     /* the coordinator key vouched for */
    uint64_t expires_ms; /* Unix ms */
    uint8_t sig[64];     /* by the hub's key over kv_voucher_digest(model, key, expires) */
} kv_voucher;

/* The text a hub signs in a voucher: SHA-256 over "kvasir-voucher-v1\n",
 * the model id, the coordinator key and expires_ms (u64 LE). Pure. */
void kv_voucher_digest(const char model_id[KV_LINK_MODEL_ID_LEN], const uint8_t key[32], uint64_t expires_ms,
                       uint8_t out[32]);
/* The hub's signature over kv_voucher_digest(model_id, key, expires_ms). */
void kv_voucher_sign(const uint8_t hub_sk[64], const char model_id[KV_LINK_MODEL_ID_LEN], const uint8_t key[32],
                     uint64_t expires_ms, uint8_t sig[64]);
/* 0 when sig is hub_pk's voucher for key, model_id and expires_ms; KV_EAUTH
 * otherwise. Expiry is the caller's policy: this checks the signature only. */
int kv_voucher_verify(const uint8_t hub_pk[32], const char model_id[KV_LINK_MODEL_ID_LEN], const uint8_t key[32],
                      uint64_t expires_ms, const uint8_t sig[64]);

/* ---- addresses and dials (src/link/tcp.c) --------------------------------- */

/* Splits "HOST:PORT" / "[v6]:PORT" into host[hcap] and port; KV_EINVAL. */
int kv_link_parse_addr(const char *host_port, char *host, size_t hcap, uint16_t *port, kv_diag *d);
/* Connects a TCP socket to "HOST:PORT" (numeric IPv4/IPv6 or a name),
 * blocking, within timeout_ms; sets TCP_NODELAY and CLOEXEC. Returns 0 and
 * the fd (blocking; the caller closes it), or KV_EIO / KV_ETIMEOUT /
 * KV_EINVAL (bad address). */
int kv_link_connect(const char *host_port, int timeout_ms, int *fd, kv_diag *d);

/* ---- blocking I/O on a connected socket (src/link/tcp.c) -------------------
 * The one place a blocking client reads and writes its socket (the dispatch
 * dial and probe, the dispatch codec's blocking frame reader, the ring's
 * client), so that a secure transport goes under all of them at once. Each
 * call waits with poll() and never blocks past its limit, whether the fd is
 * blocking or not; sends never raise SIGPIPE. */

#define KV_LINK_POLL_MS 100 /* how often `cancelled` is asked while waiting */

/* One blocking transfer: its limits (set by the caller) and what happened
 * (set by the call, whatever it returns). */
typedef struct kv_link_io {
    int timeout_ms;               /* < 0: no limit */
    bool idle;                    /* timeout_ms bounds each wait for the next bytes (a stream whose
                                     frames come as they are made); false: the whole call */
    bool (*cancelled)(void *arg); /* asked every KV_LINK_POLL_MS while waiting; true ends the call;
                                     NULL = never */
    void *arg;
    const char *peer;             /* who is at the other end, for messages; NULL = "the peer" */
    /* out */
    size_t got;                   /* bytes moved before the call returned */
    bool closed;                  /* read: the peer closed the connection (end of stream) */
    bool was_cancelled;           /* `cancelled` said true */
} kv_link_io;

/* Reads exactly n bytes into buf. Returns 0; KV_ETIMEOUT past the limit;
 * KV_EIO when the peer closed (io->closed), on a read error, or when
 * cancelled (io->was_cancelled). io->got says how much of buf is filled. */
int kv_link_read_full(int fd, void *buf, size_t n, kv_link_io *io, kv_diag *d);
/* Writes all n bytes of buf. Returns 0; KV_ETIMEOUT past the limit; KV_EIO
 * on a send error (the peer gone) or when cancelled. */
int kv_link_write_full(int fd, const void *buf, size_t n, kv_link_io *io, kv_diag *d);

/* ---- the dispatch handshake, coordinator side (src/link/dial.c) ----------- */

typedef struct kv_link_dispatch_opts {
    const char *addr;          /* "HOST:PORT" of the worker */
    const char *model_id;      /* 64 hex digits: the HELLO names it, the HELLO_ACK must echo it */
    const uint8_t *worker_key; /* [32] the key the worker must prove */
    const uint8_t *sk;         /* [64] the caller's secret key (seed || pk) */
    const kv_voucher *voucher; /* a hub voucher for the caller's key; NULL = none */
    uint32_t n_embd;           /* the width the worker must serve; 0 = not checked */
    int timeout_ms;            /* connect, and the whole handshake after it; 0 = 2000 */
    bool plaintext;            /* --insecure-plaintext: plain TCP, no TLS, no channel binding;
                                  false: TLS 1.3 pinned to worker_key, the exporter bound into
                                  the transcript, dispatch v5 (docs/PROTOCOL.md) */
} kv_link_dispatch_opts;

/* An authenticated dispatch connection, filled as far as the dial got. */
typedef struct kv_tls kv_tls;
typedef struct kv_tls_ctx kv_tls_ctx;
typedef struct kv_link_dispatch {
    int fd;                            /* the socket; -1 unless the handshake passed */
    kv_tls *tls;                       /* its TLS session (frames go through it: kv_link_chan
                                          {fd, tls}); NULL over plain TCP */
    kv_tls_ctx *tls_ctx;               /* the context tls was made from (owned) */
    bool connected;                    /* TCP connected */
    uint16_t version;                  /* the version the worker chose (HELLO_ACK); frames use it */
    uint32_t n_embd;                   /* the worker's model width (HELLO_ACK) */
    char backend[KV_LINK_MAX_NAME + 1]; /* the worker's backend name (HELLO_ACK) */
} kv_link_dispatch;

/* Dials o->addr and runs the coordinator's side of the dispatch handshake.
 * Returns 0 with out->fd open and authenticated both ways (the caller
 * closes it with kv_link_dispatch_close, and writes its frames through
 * kv_link_chan {out->fd, out->tls} at out->version); otherwise out->fd is
 * -1 and: KV_EAUTH when the worker's TLS certificate carries another key
 * than o->worker_key, it speaks no authenticated version, proves another
 * key or signs an AUTH_OK that does not verify (over this TLS session's
 * exporter: a relayed proof fails here); KV_EPROTO when the peer does not
 * speak TLS (an older worker, or not a worker);
 * the worker's own code when it answered an ERROR (KV_EAUTH for a key or
 * voucher it refuses); KV_EPROTO for another model or an unexpected frame;
 * KV_ETIMEOUT past the deadline; KV_EIO when unreachable or closed; KV_EINVAL
 * for bad arguments. Every frame is decoded by the dispatch codec; the
 * receive buffer is bounded by the largest HELLO_ACK. */
int kv_link_dial_dispatch(const kv_link_dispatch_opts *o, kv_link_dispatch *out, kv_diag *d);
/* Frees the session and closes the fd of a dial (accepts one that failed). */
void kv_link_dispatch_close(kv_link_dispatch *c);

#endif
