/* Relay: the link-layer transport that lets a node behind NAT serve with
 * one outbound connection. docs/PROTOCOL.md ("Relay") is the wire contract.
 *
 *   - A relay server (run by the hub, `--relay-port`) accepts TLS
 *     connections on its own port and its own event loop thread. A node
 *     connects out, proves its Ed25519 key by signing the TLS exporter of
 *     that very connection (a proof that cannot be replayed on another
 *     connection), and then receives circuits. A coordinator connects,
 *     opens a circuit to a node by key, and gets a byte stream to that
 *     node's worker. The coordinator runs its own end-to-end TLS session,
 *     pinned to the node's key, inside the circuit: the relay forwards
 *     records it can neither read nor change undetected.
 *   - Many circuits share one connection, as streams. Each direction of a
 *     stream has credit (bytes of DATA frames, header included, that the
 *     receiver has room for): a sender never sends past it, so the relay
 *     buffers at most a window per stream and direction, and a stream whose
 *     reader is slow stops only itself.
 *   - Bounds: circuits in all, per node and per coordinator connection;
 *     bytes per second per node and in all (credit is withheld while over);
 *     connections in all, not yet past HELLO in all and per address; a
 *     deadline for TLS and HELLO, and one for a coordinator without a
 *     circuit; bytes buffered in all. A frame that lies
 *     (a length, a stream id, credit never granted) closes that connection
 *     with an ERROR frame that says why; nothing else is affected.
 *   - Clients (kv_relay_client, both roles) run their own loop thread, hand
 *     each circuit to the caller as one end of a socketpair, and reconnect
 *     with bounded exponential backoff and jitter when the relay connection
 *     drops (circuits on it end: their sockets read end of stream); a
 *     coordinator only while it has opens waiting.
 *
 * Thread safety: the server and client functions may be called from any
 * thread; the frame codec is pure. */
#ifndef KVASIR_RELAY_H
#define KVASIR_RELAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/link.h"
#include "kvasir/tls.h"

/* ---- frames (fixed forever) ---------------------------------------------------- */

#define KV_RELAY_VERSION 1u
#define KV_RELAY_MAGIC 0x4c52564bu       /* "KVRL" little-endian */
#define KV_RELAY_HEADER 12u              /* u8 type, u8[3] zero, u32 stream, u32 len */
#define KV_RELAY_MAX_PAYLOAD (64u << 10) /* bytes of one frame's payload at most */
#define KV_RELAY_MAX_MSG 256u            /* bytes of a CLOSE / ERROR message at most */
#define KV_RELAY_HELLO_SIZE 8u           /* magic, version, role, zero */
#define KV_RELAY_HELLO_NODE_SIZE (8u + 32u + 64u) /* ... + key + signature */
#define KV_RELAY_WELCOME_SIZE 12u
#define KV_RELAY_MIN_WINDOW (KV_RELAY_HEADER + KV_RELAY_MAX_PAYLOAD) /* one full DATA frame */
#define KV_RELAY_MAX_WINDOW (16u << 20)

enum kv_relay_type {
    KV_RELAY_HELLO = 1,   /* client -> relay, stream 0: who it is (and, for a node, the proof) */
    KV_RELAY_WELCOME = 2, /* relay -> client, stream 0: version, window, max payload */
    KV_RELAY_OPEN = 3,    /* coordinator -> relay: [32] node key; relay -> node: empty */
    KV_RELAY_ACCEPT = 4,  /* node -> relay, relay -> coordinator: the circuit is up */
    KV_RELAY_DATA = 5,    /* 1..KV_RELAY_MAX_PAYLOAD bytes of the stream */
    KV_RELAY_CREDIT = 6,  /* u32 bytes more the sender may send (> 0) */
    KV_RELAY_CLOSE = 7,   /* i32 code, message: the circuit ends (either side) */
    KV_RELAY_ERROR = 8,   /* stream 0, i32 code, message: the connection ends */
    KV_RELAY_TYPE_COUNT
};

enum kv_relay_role { KV_RELAY_ROLE_NODE = 1, KV_RELAY_ROLE_COORD = 2 };

/* One decoded frame; payload points into the buffer decoded. */
typedef struct kv_relay_frame {
    uint8_t type;           /* enum kv_relay_type */
    uint32_t stream;        /* 0 for HELLO, WELCOME, ERROR; > 0 otherwise */
    uint32_t len;           /* payload bytes */
    const uint8_t *payload; /* [len] */
    /* decoded fields, by type */
    uint8_t role;           /* HELLO */
    uint16_t version;       /* HELLO, WELCOME */
    const uint8_t *key;     /* HELLO (node), OPEN from a coordinator: [32] */
    const uint8_t *sig;     /* HELLO (node): [64] */
    uint32_t window;        /* WELCOME */
    uint32_t max_payload;   /* WELCOME */
    uint32_t credit;        /* CREDIT */
    int32_t code;           /* CLOSE, ERROR: a KV_E* code (0 for a plain close) */
    const char *msg;        /* CLOSE, ERROR: [msg_len], not NUL-terminated */
    uint32_t msg_len;
} kv_relay_frame;

/* The payload length from a frame header hdr[KV_RELAY_HEADER]: 0 and
 * *total (header + payload), or KV_EPROTO naming what is wrong (a type
 * unknown, reserved bytes not zero, a length over KV_RELAY_MAX_PAYLOAD).
 * Pure; never reads past the header. */
int kv_relay_header_parse(const uint8_t *hdr, size_t *total, kv_diag *d);
/* Decodes the whole frame buf[0, n) (n = what kv_relay_header_parse said):
 * every field checked against its type's exact layout and stream rules.
 * 0, or KV_EPROTO naming the field. Pure; f points into buf. */
int kv_relay_frame_decode(const uint8_t *buf, size_t n, kv_relay_frame *f, kv_diag *d);
/* Writes a header for type, stream and len into out[KV_RELAY_HEADER]. */
void kv_relay_header_put(uint8_t *out, uint8_t type, uint32_t stream, uint32_t len);
/* The digest a node signs in its HELLO: SHA-256 over "kvasir-relay-node-v1\n",
 * the TLS exporter of the connection and the node key. Pure. */
void kv_relay_node_digest(const uint8_t exporter[KV_TLS_EXPORTER_LEN], const uint8_t key[32], uint8_t out[32]);

/* ---- server ------------------------------------------------------------------------ */

struct sockaddr;
typedef struct kv_relay_server kv_relay_server;

typedef struct kv_relay_server_opts {
    const char *listen;            /* "HOST:PORT" (port 0 picks one) */
    kv_tls_ctx *tls;               /* the relay's certificate (borrowed; outlives the server) */
    int max_conns;                 /* connections in all; 0 = 1024 */
    int max_pending;               /* connections not yet past HELLO, in all; 0 = 64 */
    int max_pending_per_addr;      /* ... from one address (IPv4, or IPv6 /64); 0 = 8 */
    int handshake_timeout_ms;      /* TLS and HELLO within this; 0 = 5000 */
    int max_circuits;              /* circuits in all; 0 = 4096 */
    int max_circuits_per_node;     /* 0 = 64 */
    int max_circuits_per_coord;    /* per coordinator connection; 0 = 64 */
    int max_circuits_per_addr;     /* of coordinators from one address, all connections; 0 = 256 */
    uint32_t window;               /* credit per stream and direction; 0 = 256 KiB */
    uint64_t rate_per_node;        /* payload bytes/s through one node's circuits; 0 = no limit */
    uint64_t rate_total;           /* payload bytes/s through the relay; 0 = no limit */
    size_t mem_limit;              /* bytes the connections buffer in all; 0 = 512 MiB */
    int write_timeout_ms;          /* a connection that reads nothing queued this long closes; 0 = 15000 */
    int idle_timeout_ms;           /* a coordinator without a circuit this long closes; 0 = 60000 */
    uint64_t tamper_at;            /* tests only: flips byte tamper_at - 1 of each circuit's
                                      node-to-coordinator stream (0 = never) */
    void (*log)(void *data, const char *line); /* one line per event; NULL = quiet */
    void *log_data;
    /* A shared port (docs/HUB.md, "Relay on the API port"): when set, each
     * accepted connection is peeked at (never read) until its TLS ClientHello
     * is whole; one that offers ALPN KV_LINK_RELAY_ALPN is the relay's, and
     * any other (not TLS, other ALPN, malformed, silent past
     * handshake_timeout_ms) is handed to other, which owns fd from then on
     * (called on the relay's thread; must not block). Peeked connections
     * count against max_pending and max_pending_per_addr. NULL = every
     * connection is the relay's. */
    void (*other)(void *data, int fd, const struct sockaddr *sa, unsigned sa_len);
    void *other_data;
} kv_relay_server_opts;

/* Counters since start (and what is open now), for /metrics. */
typedef struct kv_relay_stats {
    uint64_t conns;            /* connections open now */
    uint64_t nodes;            /* nodes registered now */
    uint64_t circuits;         /* circuits open now */
    uint64_t circuits_total;   /* circuits opened */
    uint64_t bytes_to_node;    /* DATA payload bytes forwarded to nodes */
    uint64_t bytes_to_coord;   /* ... to coordinators */
    uint64_t refused_circuits; /* OPENs refused: over a budget, no such node */
    uint64_t refused_conns;    /* connections refused: over a cap */
    uint64_t auth_failures;    /* node HELLOs whose proof failed */
    uint64_t protocol_errors;  /* connections closed for a frame that lied */
    uint64_t throttled;        /* credits withheld for a rate */
    size_t mem;                /* bytes buffered now */
    size_t mem_peak;           /* the most buffered at once */
} kv_relay_stats;

/* Listens on o->listen and serves on a thread of its own. 0 and *out
 * (kv_relay_server_free), or KV_EINVAL / KV_EIO / KV_ENOMEM. */
int kv_relay_server_start(kv_relay_server **out, const kv_relay_server_opts *o, kv_diag *d);
/* The bound address ("HOST:PORT"). */
const char *kv_relay_server_addr(const kv_relay_server *s);
void kv_relay_server_stats(const kv_relay_server *s, kv_relay_stats *out);
/* The counters as Prometheus text (kvasir_relay_* gauges and counters, with
 * HELP and TYPE lines) into out[cap], NUL-terminated. Returns the length it
 * needs (without the NUL), like snprintf: out holds all of it when that is
 * below cap. Pure. */
size_t kv_relay_stats_prometheus(const kv_relay_stats *st, char *out, size_t cap);
/* Stops the thread and closes every connection (accepts NULL). */
void kv_relay_server_free(kv_relay_server *s);

/* ---- clients --------------------------------------------------------------------------- */

typedef struct kv_relay_client kv_relay_client;

/* A node's new circuit: fd is one end of a socketpair (the caller owns it
 * and closes it); bytes written to it reach the coordinator, and the
 * coordinator's bytes are read from it; end of stream when the circuit
 * ends. Called on the client's thread; must not block. */
typedef void (*kv_relay_circuit_fn)(void *data, int fd);

typedef struct kv_relay_client_opts {
    const char *relay;             /* "HOST:PORT" of the relay */
    const char *relay_sha256;      /* the relay certificate's fingerprint (64 hex); required */
    kv_tls_ctx *tls;               /* our certificate (borrowed) */
    int role;                      /* KV_RELAY_ROLE_NODE or _COORD */
    const kv_node_key *key;        /* a node: the key it proves (borrowed) */
    kv_relay_circuit_fn on_circuit; /* a node: where circuits go */
    void *data;
    int max_circuits;              /* circuits at once; 0 = 64 */
    int backoff_min_ms;            /* first reconnect delay; 0 = 250 */
    int backoff_max_ms;            /* largest; 0 = 30000 */
    int connect_timeout_ms;        /* TCP + TLS + WELCOME; 0 = 5000 */
    void (*log)(void *data, const char *line);
    void *log_data;
} kv_relay_client_opts;

typedef struct kv_relay_client_stats {
    bool up;                  /* connected and welcomed now */
    uint64_t connects;        /* times welcomed */
    uint64_t attempts;        /* connection attempts */
    uint64_t failures;        /* attempts that failed, and connections lost */
    int64_t last_backoff_ms;  /* the delay before the latest attempt */
    uint64_t circuits;        /* open now */
    uint64_t circuits_total;
    char last_error[256];     /* why the last connection failed or ended */
} kv_relay_client_stats;

/* Starts the client's thread, which connects at once and keeps
 * reconnecting. 0 and *out (kv_relay_client_free), or KV_EINVAL naming the
 * option, KV_ENOMEM, KV_EIO. */
int kv_relay_client_start(kv_relay_client **out, const kv_relay_client_opts *o, kv_diag *d);
/* Splits a relay as a user writes it, "HOST:PORT#sha256=<64 hex>", into
 * addr[cap] and the fingerprint fp[65] (lowercase). 0, or KV_EINVAL naming
 * what is missing or wrong. */
int kv_relay_parse_url(const char *s, char *addr, size_t cap, char fp[KV_TLS_FP_HEX + 1], kv_diag *d);
/* A coordinator: opens a circuit to the node with key node_pk, waiting up
 * to timeout_ms (0 = 5000) for the relay connection and the node's ACCEPT.
 * 0 and *fd (one end of a socketpair, blocking; the caller closes it), or
 * the relay's or node's refusal (KV_ENOTFOUND: no such node; KV_ERANGE: a
 * budget), KV_ETIMEOUT, KV_EIO; d says which. */
int kv_relay_client_open(kv_relay_client *c, const uint8_t node_pk[32], int timeout_ms, int *fd, kv_diag *d);
void kv_relay_client_stats_get(kv_relay_client *c, kv_relay_client_stats *out);
/* Stops the thread and ends every circuit (accepts NULL). */
void kv_relay_client_free(kv_relay_client *c);

/* ---- bridges (src/link/relay_bridge.c) ----------------------------------------------------- */

/* Carries bytes both ways between an established TLS session t over
 * tls_fd and a plain socket plain_fd (both made nonblocking here), until
 * either ends: 0 at an end of stream, KV_EPROTO when a TLS record fails
 * (altered on the way), KV_EIO, KV_ENOMEM. Blocks the calling thread; the
 * caller closes both fds. */
int kv_relay_pump(kv_tls *t, int tls_fd, int plain_fd);

/* The node's side: every circuit (use kv_relay_forward_circuit as the
 * client's on_circuit, the forward as its data) gets a thread that answers
 * the coordinator's TLS session with the node's certificate tls and
 * carries its plaintext to a TCP connection to local ("HOST:PORT": the
 * worker this node runs), so the worker serves relayed coordinators
 * unchanged. Free it after the client (whose end closes the circuits):
 * kv_relay_forward_free waits for the threads. */
typedef struct kv_relay_forward kv_relay_forward;
int kv_relay_forward_new(kv_relay_forward **out, kv_tls_ctx *tls, const char *local, kv_diag *d);
void kv_relay_forward_circuit(void *forward, int fd);
/* Points the forward's new circuits at another local address (a node whose
 * worker moved to a new port); circuits already bridged keep theirs.
 * KV_EINVAL when local is too long. */
int kv_relay_forward_set_local(kv_relay_forward *f, const char *local, kv_diag *d);
/* Circuits bridged to the end, and ones that failed (TLS, local connect). */
void kv_relay_forward_counts(const kv_relay_forward *f, uint64_t *served, uint64_t *failed);
void kv_relay_forward_free(kv_relay_forward *f); /* accepts NULL */

/* The coordinator's side: a listener on 127.0.0.1 (kernel-chosen port)
 * whose every connection becomes a circuit to node_pk through the
 * coordinator's client cl, with a TLS session inside pinned to node_pk, so
 * a client that dials an address (kv_link_dial_dispatch) reaches a relayed
 * node unchanged. A connection whose circuit or TLS session fails is
 * closed (the client reads end of stream). Free it before cl, after closing
 * the connections made through it: kv_relay_proxy_free waits for them. */
typedef struct kv_relay_proxy kv_relay_proxy;
int kv_relay_proxy_start(kv_relay_proxy **out, kv_relay_client *cl, kv_tls_ctx *tls, const uint8_t node_pk[32],
                         int timeout_ms, kv_diag *d);
const char *kv_relay_proxy_addr(const kv_relay_proxy *p);
void kv_relay_proxy_free(kv_relay_proxy *p); /* accepts NULL */

/* ---- routes (src/link/relay_route.c): how a coordinator reaches relayed nodes ----------- */

/* A process-wide table from a relayed node's announced address to a local
 * kv_relay_proxy for its key, through one coordinator client per relay
 * (made on first use, with a key of its own kept in memory: the dispatch
 * handshake inside proves the coordinator's key). Whoever reads a placement
 * map adds the relayed nodes it lists; the dispatch client dials what
 * kv_relay_route_find returns instead of the address. Thread-safe. */
#define KV_RELAY_MAX_ROUTES 4096u /* relayed nodes one coordinator process keeps */
#define KV_RELAY_MAX_RELAYS 16u   /* relays it connects to */
/* Adds the route of node_pk at node_addr through relay relay_addr pinned
 * by fp (64 hex); a route already there for the same node and relay is
 * kept. 0, KV_EINVAL (the address is routed to another key or relay: a
 * proxy is never swapped under live connections), KV_ERANGE past a bound,
 * or the client's or proxy's error. */
int kv_relay_route_add(const char *relay_addr, const char *fp, const uint8_t node_pk[32], const char *node_addr,
                       kv_diag *d);
/* True, with the proxy's "HOST:PORT" in out[cap], when node_addr is routed. */
bool kv_relay_route_find(const char *node_addr, char *out, size_t cap);
/* Ends every route and client (at exit, or in tests). */
void kv_relay_routes_free(void);

#endif
