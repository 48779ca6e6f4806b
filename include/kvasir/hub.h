/* The hub: registry of nodes, piece server and coverage market.
 *
 * A hub serves one sliced model (its manifest.json and the files it names)
 * over HTTP, keeps a registry of nodes (a node is an Ed25519 key) and what
 * each holds, and publishes the coverage market: for every shard (one slab
 * of the manifest: a layer's expert range) the wanted replicas, the live
 * replicas (nodes whose last heartbeat is within the deadline) and a reward
 * rate. The HTTP API is described in docs/HUB.md.
 *
 * Three parts live behind this header:
 *   - the server (kv_hub_open/serve/stop/free): libmicrohttpd, its state
 *     behind one store interface (kv_hub_store_ops; SQLite in WAL mode, or
 *     PostgreSQL shared by several hub processes);
 *   - the client side of node identity, used by nodes and tests alike:
 *     key files, request signing, the storage-challenge answer;
 *   - the parsers the hub adds (Range header, auth headers, announcement,
 *     market JSON), exposed so that they are fuzzed and tested directly.
 *
 * Signed requests. Every state-changing request carries three headers:
 *   X-Kvasir-Key:       the node's public key, 64 lowercase hex digits
 *   X-Kvasir-Counter:   a decimal u64 that must exceed the last one the hub
 *                       accepted from this key (stored, so it survives a
 *                       restart): a captured request cannot be replayed
 *   X-Kvasir-Signature: Ed25519 signature, 128 hex digits, over the SHA-256 of
 *                       "kvasir-hub-v1\n" METHOD "\n" PATH "\n" COUNTER "\n"
 *                       hex(SHA-256(body)) "\n"
 * Registration also carries a single-use hub nonce in its body (GET
 * /v1/nonce), so a node proves it holds the key now. */
#ifndef KVASIR_HUB_H
#define KVASIR_HUB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/link.h" /* kv_node_key, kv_hex */

struct kv_https_cert; /* kvasir/https.h */

#define KV_HUB_SIG_DOMAIN "kvasir-hub-v1"
#define KV_HUB_MAX_BODY (1u << 20)        /* default bound on a request body */
#define KV_HUB_MAX_ADDR 255u              /* bytes in an announced HOST:PORT */
#define KV_HUB_MAX_BACKEND 63u            /* bytes in an announced backend name */
#define KV_HUB_MAX_SITE 31u               /* bytes in a site name */
#define KV_HUB_MAX_SITES 64u              /* sites the placement considers (the rest: per-layer dispatch) */
#define KV_HUB_SITE_NEAR_MS 2.5           /* a node this close to the hub (measured) is in site "auto:hub" */
#define KV_HUB_MAX_SHARDS_PER_NODE 65536u /* shards one announcement may list */
#define KV_HUB_MAX_NONCES 65536u          /* outstanding registration nonces */
#define KV_HUB_NONCE_TTL_MS 60000         /* a registration nonce lives this long */
#define KV_HUB_CHALLENGE_MAX_LEN 65536u   /* bytes hashed by one storage challenge */
#define KV_HUB_KEY_FILE KV_LINK_KEY_FILE  /* in a node's data folder */

/* ---- server ----------------------------------------------------------- */

typedef struct kv_hub kv_hub;

typedef struct kv_hub_opts {
    const char *manifest;      /* path of manifest.json; pieces are served from its folder */
    const char *listen;        /* HOST:PORT; NULL = "127.0.0.1:0" (port 0 picks one) */
    const char *db;            /* store URI: a SQLite file path, or PostgreSQL ("postgresql://...",
                                * "pg:CONNINFO") for several hubs on one state */
    uint32_t wanted;           /* replicas wanted per shard with no demand (the floor); 0 = 2 */
    /* the market following demand (docs/HUB.md "Demand"; src/hub/market.h) */
    uint32_t wanted_max;       /* replicas a hot shard may want; 0 = wanted (a fixed market) */
    double demand_per_replica; /* expert computations/s one replica is wanted for; 0 = 2000 */
    uint32_t demand_half_life_ms; /* of a shard's demand rate; 0 = 60000 */
    uint32_t market_raise_ms;  /* demand above the high watermark this long raises wanted; 0 = 10000 */
    uint32_t market_hold_ms;   /* below the low watermark this long (and since the last change) lowers it; 0 = 120000 */
    double demand_share;       /* share of a shard's driving demand one stranger key may have; 0 = 0.5 */
    uint32_t demand_window_ms; /* accounting window of the demand budgets; 0 = 60000 */
    uint64_t demand_key_tokens; /* tokens one coordinator key may report per window; 0 = 600000 */
    uint64_t demand_net_tokens; /* tokens the keys of one address block may report per window; 0 = 4 x key */
    uint32_t deadline_ms;      /* heartbeat deadline for "live"; 0 = 15000 */
    uint64_t reward_base;      /* micro-KVR per hour for a shard with wanted replicas; 0 = 1000000 */
    uint32_t max_body;         /* request body bound, bytes; 0 = KV_HUB_MAX_BODY */
    uint32_t max_conns;        /* concurrent connections; 0 = 1024 */
    uint32_t per_ip_conns;     /* concurrent connections per client IP (IPv6: per /64); 0 = 16 */
    uint32_t conn_timeout_s;   /* idle connection timeout; 0 = 30 */
    uint32_t request_s;        /* a request's headers and body arrive within this; 0 = 15 */
    uint32_t threads;          /* server threads; 0 = 4 */
    uint32_t challenge_every;  /* heartbeats between storage challenges; 0 = 12 */
    uint32_t challenge_ttl_ms; /* a challenge unanswered this long fails; 0 = 60000 */
    uint32_t refresh_ms;       /* shared store: the view of other hubs' changes is reloaded this often; 0 = 250 */
    bool skip_verify;          /* check piece sizes only, not their SHA-256 */
    bool quiet;                /* no log lines on stderr */
    /* coordinators the hub vouches for (POST /v1/voucher; docs/HUB.md) */
    bool vouch_open;           /* any key that signs a voucher request (a test swarm) */
    const uint8_t (*vouch_keys)[32]; /* [n_vouch_keys] operator-approved coordinator keys (copied) */
    size_t n_vouch_keys;
    uint32_t voucher_ttl_ms;   /* a voucher's lifetime; 0 = 3600000 (one hour) */
    /* per-node earnings for GET /v1/nodes and the status page (the ledger's):
       0 with *micro_kvr set, or nonzero when unknown (the field is left out).
       Called from server threads without the hub's lock; NULL = none */
    int (*earned)(void *arg, const uint8_t pk[32], uint64_t *micro_kvr);
    void *earned_arg;
    /* the layer market of the ring (GET /v1/ring, docs/HUB.md): "A-B,C-D,..."
       consecutive windows covering the trunk layers; NULL = none */
    const char *ring_windows;
    /* proof of service (docs/HUB.md "Proof of service"): a node is listed,
       and its replicas counted, only once the worker at its address proved
       its key and answered compute challenges for its slabs */
    bool trust_announced;       /* list what nodes announce, unproven (tests of the market alone) */
    uint32_t prove_threads;     /* nodes probed at once; 0 = 2 (at most 16) */
    uint32_t prove_connect_ms;  /* connect and handshake deadline of a probe; 0 = 2000 */
    uint32_t prove_deadline_ms; /* compute answers, after the handshake; 0 = 1500 */
    uint32_t prove_every_ms;    /* mean time between challenges of a proven node; 0 = 60000 */
    uint32_t trust_ms;          /* a node proven this long (two challenges passed) is established:
                                   where established nodes hold a shard, newcomers' replicas only
                                   fill what they leave short of wanted; 0 = 600000 */
    uint32_t max_per_host;      /* live nodes registered at one IP; 0 = 32 */
    uint32_t max_per_subnet;    /* live nodes in one IPv4 /24 or IPv6 /48 (loopback exempt); 0 = 128 */
    /* HTTPS (include/kvasir/https.h, docs/HUB.md "HTTPS"): with tls_cert, serve that
       certificate; else with tls, or on an address that is not loopback, a
       self-signed one on a key derived from the hub's key (the same fingerprint at
       every start); else plain HTTP: on loopback, or anywhere with insecure_plaintext */
    const struct kv_https_cert *tls_cert; /* read while the hub lives; NULL = none */
    bool tls;                   /* serve https with the derived certificate, even on loopback */
    bool insecure_plaintext;    /* plain HTTP on a non-loopback address */
    /* the relay (docs/HUB.md "Relay"): on the hub's host at relay_port (0 picks
       one), serving the hub's certificate (the one the API serves; derived from
       the hub's key when the API is plain HTTP), for nodes the hub cannot dial */
    bool relay;
    uint16_t relay_port;
    bool relay_same_port;       /* the relay on the API's port: the hub accepts, and by each TLS
                                   ClientHello's ALPN ("kvasir-relay") hands the connection to the
                                   relay or to the HTTP server (relay_port is then unused) */
    uint32_t relay_max_circuits;          /* circuits in all; 0 = the relay's default (4096) */
    uint32_t relay_max_circuits_per_node; /* 0 = 64 */
    uint64_t relay_rate_per_node;         /* payload bytes/s through one node's circuits; 0 = no limit */
    uint64_t relay_rate;                  /* payload bytes/s through the relay; 0 = no limit */
} kv_hub_opts;

/* Loads the manifest, checks every piece it names (size, and SHA-256
 * unless skip_verify: KV_EHASH), opens (or creates) the store, reloads the
 * registry from it and starts serving on opts->listen. The store must belong to the
 * same model (its model_id) or KV_EINVAL. On error *out is NULL and d says
 * why. Free with kv_hub_free. */
int kv_hub_open(kv_hub **out, const kv_hub_opts *opts, kv_diag *d);
/* "HOST:PORT" actually bound (valid while h lives). */
const char *kv_hub_addr(const kv_hub *h);
/* The fingerprint (64 lowercase hex digits) of the certificate the hub
 * serves, or NULL when it serves plain HTTP. Valid while h lives. */
const char *kv_hub_tls_fingerprint(const kv_hub *h);
/* The relay's bound port, or 0 when the hub runs none. */
uint16_t kv_hub_relay_port_of(const kv_hub *h);
/* Blocks until kv_hub_stop (the server runs on its own threads meanwhile). */
int kv_hub_serve(kv_hub *h, kv_diag *d);
/* Async-signal-safe: makes kv_hub_serve return. */
void kv_hub_stop(kv_hub *h);
/* Stops the server threads and closes the store; accepts NULL. */
void kv_hub_free(kv_hub *h);
/* The hub's own Ed25519 public key (signs vouchers; kept in the store as
 * meta "hub_key_seed", so every hub process on one store shares it). */
const uint8_t *kv_hub_key(const kv_hub *h);

/* ---- market (also computed in process, for benchmarks) ---------------- */

typedef struct kv_hub_shard_view {
    uint32_t layer, first, last; /* the slab's expert range, inclusive */
    uint64_t bytes;              /* slab file size */
    uint32_t wanted, live;       /* replicas */
    uint64_t reward;             /* micro-KVR per hour offered to one more holder */
    double demand;               /* expert computations/s coordinators reported needing (0 if none) */
    double wait_ms;              /* ms per s they reported waiting for it (0 if none) */
} kv_hub_shard_view;

/* Renders GET /v1/market into a malloc'd NUL-terminated JSON string (caller
 * frees) at the hub's current time, after evaluating the wanted rule of
 * every shard (a change is written to the store first: src/hub/market.h).
 * Thread-safe. */
int kv_hub_market_json(kv_hub *h, char **out, size_t *len, kv_diag *d);

/* Renders GET /v1/nodes (every registered node: what it holds, whether it
 * is live, what it served and at what rate; the swarm's rates) into a
 * malloc'd string (caller frees). Thread-safe. */
int kv_hub_nodes_json(kv_hub *h, char **out, size_t *len, kv_diag *d);

/* ---- sites (src/hub/sites.c, docs/HUB.md "Sites") ---------------------- */

/* What the site placement is computed from. */
typedef struct kv_hub_site_layout {
    uint32_t n_layer;      /* trunk layers (the MTP/nextn layers are not placed) */
    uint32_t n_expert;
    const uint8_t *moe;    /* [n_layer] 1: the layer has routed experts */
    uint32_t n_site;       /* at most KV_HUB_MAX_SITES */
    const uint8_t *holds;  /* [n_site][n_layer][n_expert] 1: a live, proven worker of the site holds it */
} kv_hub_site_layout;

typedef struct kv_hub_site_window {
    uint32_t site;         /* index into the layout's sites */
    uint32_t first, last;  /* layers, inclusive */
} kv_hub_site_window;

/* The site-aware placement: a ring of sites, each with a contiguous window
 * of layers whose routed experts its own workers all hold; windows are
 * consecutive from layer 0 to n_layer - 1, each site has at most one, and
 * each runs as far as its site's coverage does (furthest-reaching unused
 * site first, backtracking: a bounded search that finds one whenever one
 * exists, for the site counts it can try). out holds n_site entries; *n_out
 * gets the count. KV_ENOTFOUND when there is none (d names the layer it
 * could not pass and what the first site lacks there): coordinators then
 * dispatch per layer. Pure: no allocation, thread-safe. */
int kv_hub_site_place(const kv_hub_site_layout *in, kv_hub_site_window *out, uint32_t *n_out, kv_diag *d);

/* GET /v1/sites: the sites, their members and measured round trips, the
 * bounds of the round trips between sites, and the placement in force
 * ({"kind": "sites", "windows": [...]} or {"kind": "experts", "reason"}).
 * Malloc'd string, caller frees. Thread-safe. */
int kv_hub_sites_json(kv_hub *h, char **out, size_t *len, kv_diag *d);

/* ---- node identity (client side) --------------------------------------- */

/* A node's key in its data folder (kv_node_key_load), a key file at any
 * path (a coordinator's --key FILE), and keys from a seed
 * (kv_node_key_from_seed): kvasir/link.h. */
/* Strictly increasing: max(last + 1, wall clock in microseconds), so a node
 * that restarts without state still outruns the counters it used before. */
uint64_t kv_node_next_counter(kv_node_key *k);

typedef struct kv_hub_auth {
    char key[65];       /* X-Kvasir-Key */
    char counter[21];   /* X-Kvasir-Counter */
    char sig[129];      /* X-Kvasir-Signature */
} kv_hub_auth;

/* Signs a request (see the header comment for the signed text). path is the
 * request path without the query. Never fails. */
void kv_hub_sign(const kv_node_key *k, const char *method, const char *path, const void *body,
                 size_t body_len, uint64_t counter, kv_hub_auth *out);
/* Verifies a parsed signature over the same text; 0 or KV_EPROTO. */
int kv_hub_verify(const uint8_t pk[32], const uint8_t sig[64], const char *method, const char *path,
                  const void *body, size_t body_len, uint64_t counter);

/* ---- storage challenge ------------------------------------------------- */

/* The byte range of a file of `size` bytes that a challenge nonce selects:
 * off = H(nonce)[0..8) mod size, len = min(KV_HUB_CHALLENGE_MAX_LEN, size -
 * off). Both sides compute it; size 0 gives 0, 0. */
void kv_hub_challenge_range(const uint8_t nonce[32], uint64_t size, uint64_t *off, uint64_t *len);
/* The answer: SHA-256(nonce || bytes [off, off+len) of the file at path),
 * the range taken from kv_hub_challenge_range over the file's size, which
 * must equal `size` (KV_EHASH otherwise). KV_EIO if unreadable. */
int kv_hub_challenge_answer(const char *path, uint64_t size, const uint8_t nonce[32], uint8_t out[32],
                            kv_diag *d);

/* ---- parsers of untrusted input (fuzzed: fuzz/fuzz_hub_*.c) ------------ */

/* A Range header against a file of `size` bytes: "bytes=A-B", "bytes=A-" or
 * "bytes=-N", one range only. Returns 0 with [*off, *off + *len) inside the
 * file, KV_EFORMAT for a header that is not one such range, KV_ERANGE for
 * a range that does not overlap the file (HTTP 416). */
int kv_hub_parse_range(const char *hdr, uint64_t size, uint64_t *off, uint64_t *len, kv_diag *d);

/* The three auth headers (any may be NULL: KV_EPROTO "unsigned"). */
int kv_hub_parse_auth(const char *key, const char *counter, const char *sig, uint8_t pk[32],
                      uint64_t *ctr, uint8_t sg[64], kv_diag *d);

typedef struct kv_hub_held {
    uint32_t layer, first, last; /* a slab of the manifest */
    uint8_t sha256[32];          /* what the node holds; must equal the manifest's */
} kv_hub_held;

/* A node's announcement (body of POST /v1/register):
 *   {"nonce": HEX64, "addr": "HOST:PORT", "memory": BYTES, "backend": NAME,
 *    "site": NAME (optional),
 *    "shards": [{"layer": L, "first": F, "last": T, "sha256": HEX64}, ...]} */
typedef struct kv_hub_announce {
    uint8_t nonce[32];
    char addr[KV_HUB_MAX_ADDR + 1];
    uint64_t memory;
    char backend[KV_HUB_MAX_BACKEND + 1];
    char site[KV_HUB_MAX_SITE + 1]; /* kv_hub_site_check; "" = none given (the hub groups it) */
    kv_hub_held *shards; /* [n_shards], malloc'd */
    size_t n_shards;
} kv_hub_announce;
/* Parses and bounds-checks an announcement (len bytes, need not be NUL-
 * terminated): addr is HOST:PORT with a port in 1..65535, made of
 * [A-Za-z0-9.-:[]]; backend of [A-Za-z0-9._+-]; no duplicate shard. Checks against the manifest come later.
 * On error a is zeroed. Free with kv_hub_announce_free (accepts NULL). */
int kv_hub_parse_announce(kv_hub_announce *a, const char *json, size_t len, kv_diag *d);
void kv_hub_announce_free(kv_hub_announce *a);
/* A site name as a node gives it (--site): 1..KV_HUB_MAX_SITE bytes of
 * [a-z0-9._-], starting with a letter or a digit (so it needs no escaping,
 * and never collides with the hub's own "auto:..." names). 0 or KV_EINVAL
 * naming the fault. */
int kv_hub_site_check(const char *name, kv_diag *d);
/* Serializes an announcement (client side); malloc'd string, caller frees. */
char *kv_hub_announce_json(const kv_hub_announce *a);

/* Body of POST /v1/heartbeat: {} (nothing reported) or {"served_pairs": N,
 * "served_tokens": M}: what the node's workers served since it started
 * (expert computations and hidden-state rows), both or neither, each at
 * most 2^53. Unknown keys are ignored (later versions may report more).
 * An empty body (len 0) is {}. *has is false when nothing was reported. */
typedef struct kv_hub_beat {
    bool has;
    uint64_t served_pairs, served_tokens;
} kv_hub_beat;
int kv_hub_parse_beat(kv_hub_beat *b, const char *json, size_t len, kv_diag *d);

/* Body of POST /v1/challenge: {"nonce": HEX64, "sha256": HEX64}. */
int kv_hub_parse_answer(const char *json, size_t len, uint8_t nonce[32], uint8_t hash[32], kv_diag *d);

typedef struct kv_hub_market {
    bool covered;               /* every shard has a live replica */
    kv_hub_shard_view *shards;  /* [n_shards] in the hub's order (scarcest first) */
    size_t n_shards;
} kv_hub_market;
/* Parses GET /v1/market (client side: `kvasir market`). Free with
 * kv_hub_market_free (accepts NULL). */
int kv_hub_parse_market(kv_hub_market *m, const char *json, size_t len, kv_diag *d);
void kv_hub_market_free(kv_hub_market *m);

/* Body of POST /v1/demand (signed by a coordinator key the hub vouches for;
 * docs/HUB.md "Demand"): what the coordinator needed since its last report,
 *   {"tokens": T, "shards": [{"layer": L, "first": F, "last": Z,
 *                             "computations": C, "wait_us": W}, ...]}
 * T: tokens decoded in the interval; C: expert computations (token x expert
 * pairs) it needed of that shard; W: microseconds it waited for them. Each
 * count at most KV_HUB_DEMAND_MAX, at most KV_HUB_MAX_DEMAND_SHARDS entries,
 * no shard twice. Unknown keys are ignored. */
#define KV_HUB_MAX_DEMAND_SHARDS 65536u
#define KV_HUB_DEMAND_MAX (1ull << 53)
typedef struct kv_hub_demand_shard {
    uint32_t layer, first, last;   /* a shard of the market */
    uint64_t computations;         /* token x expert pairs needed */
    uint64_t wait_us;              /* waited for them, microseconds */
} kv_hub_demand_shard;
typedef struct kv_hub_demand {
    uint64_t tokens;               /* tokens decoded in the interval */
    kv_hub_demand_shard *shards;   /* [n_shards], malloc'd */
    size_t n_shards;
} kv_hub_demand;
/* Parses and bounds-checks a report; on error r is zeroed. Free with
 * kv_hub_demand_free (accepts NULL). */
int kv_hub_parse_demand(kv_hub_demand *r, const char *json, size_t len, kv_diag *d);
void kv_hub_demand_free(kv_hub_demand *r);
/* Serializes a report (client side); malloc'd string, caller frees; NULL
 * when out of memory. */
char *kv_hub_demand_json(const kv_hub_demand *r);

/* ---- HTTP client helper (libcurl) -------------------------------------- */

/* GET url into a malloc'd NUL-terminated buffer of at most max bytes (caller
 * frees); *status gets the HTTP status. KV_EIO on transport errors or a
 * larger body, KV_ETIMEOUT after timeout_ms. */
int kv_hub_http_get(const char *url, size_t max, long timeout_ms, char **body, size_t *len, long *status,
                    kv_diag *d);

/* Reports demand to the hub at hub_url (POST /v1/demand signed by key with
 * its next counter). A coordinator calls it every few seconds with what it
 * counted since its last report that the hub accepted. 0 with
 * *accepted_tokens (may be NULL) set to the tokens the hub counted (fewer
 * than reported when over its budget); KV_EAUTH (403: not vouched for),
 * KV_EPROTO (409: a stale counter or clock), KV_EINVAL (400, d says why),
 * KV_EIO. Blocking (at most 10 s); thread-safe for distinct keys. */
int kv_hub_report_demand(const char *hub_url, kv_node_key *key, const kv_hub_demand *r, uint64_t *accepted_tokens,
                         kv_diag *d);

#endif
