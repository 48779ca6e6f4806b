/* Node: a machine that joins a hub's swarm with a memory budget.
 *
 * `kvasir node` reads the hub's coverage market, chooses the shards worth
 * holding within its budget (kv_node_choose, a pure function), downloads
 * them into DATA/pieces/ (resumable, with HTTP Range), verifies each against
 * the manifest's SHA-256 before it is served (a piece that differs is
 * deleted), serves them as an in-process expert worker, registers with the
 * hub (signed by DATA/node.key), heartbeats, answers storage challenges and
 * chooses again when the market changes. A coordinator uses the same
 * download path to fetch the manifest and backbone (kv_node_fetch_coordinator).
 *
 * Everything read from the hub is untrusted: bodies are bounded, JSON is
 * parsed by the bounded parsers of hub.h, piece bytes are never more than
 * the manifest's size and are hashed before use, and every file written
 * lies inside DATA/pieces/ under a path the manifest parser has checked
 * (relative, no '.', '..' or empty parts). */
#ifndef KVASIR_NODE_H
#define KVASIR_NODE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvasir/err.h"
#include "kvasir/hub.h"
#include "kvasir/slice.h"

#define KV_NODE_MAX_MARKET (64u << 20)    /* bytes of a market or placement answer */
#define KV_NODE_MAX_REPLY (1u << 20)      /* bytes of a register/heartbeat answer */
#define KV_NODE_PIECES "pieces"           /* subfolder of the data folder */

/* ---- shard choice ------------------------------------------------------ */

/* Chooses the shards to hold. shards[0..n) is a market (any order; `live`
 * counts every live holder, this node included where held[i]), held[i] is
 * 1 if this node holds shard i and the hub counts it live. Writes take[i]
 * (1 = hold) and returns the bytes taken.
 *
 * Rule, in order: (1) a held shard nobody else holds live (live - held ==
 * 0) is kept, budget or not: a node never drops the last live replica;
 * (2) the rest are visited by class, then held before not held (so a node
 * does not trade a shard for an equal one), then larger remaining deficit
 * (wanted - others), then kv_node_tie(salt, shard), then index, and each is taken if it fits in
 * what is left of the budget. Class 0: nobody else holds it (uncovered);
 * class 1: another replica is still wanted (others + 1 <= wanted); class 2:
 * a replica beyond wanted. So an uncovered shard is taken before a third
 * replica of a covered one, and a held extra replica yields its room to
 * one that is wanted. Pure: no I/O, no allocation beyond a scratch array
 * (KV_ENOMEM then, take zeroed). */
int kv_node_choose(const kv_hub_shard_view *shards, size_t n, uint64_t budget, const uint8_t *held, uint64_t salt,
                   uint8_t *take, uint64_t *bytes, kv_diag *d);
/* Which held replicas are surplus: for every shard of the market view
 * (view[0..n), manifest order) with more live replicas than wanted, the
 * holders listed in the placement map (GET /v1/placement, json) are ranked
 * by key; drop[i] = 1 when pk is listed there and at least `wanted` holders
 * rank below it. So the lowest-keyed holders keep theirs and the last live
 * replica is never dropped. Malformed entries are skipped; KV_EFORMAT when
 * json is not a map. */
int kv_node_surplus(const char *json, size_t len, const kv_hub_shard_view *view, size_t n, const uint8_t pk[32],
                    uint8_t *drop, kv_diag *d);
/* The order among shards equal in class, held and deficit: a hash of salt
 * (the node's, from its key) and the shard, so nodes that start together
 * spread over different shards instead of all taking the same ones. */
uint64_t kv_node_tie(uint64_t salt, uint32_t layer, uint32_t first);

/* "8G", "512M", "100K", "12345" (bytes; K/M/G/T are powers of 1024, upper
 * or lower case). KV_EINVAL for anything else or an overflow. */
int kv_node_parse_size(const char *s, uint64_t *out, kv_diag *d);

/* ---- downloads --------------------------------------------------------- */

/* Progress callback of a download: bytes done of total. */
typedef void (*kv_node_progress_fn)(void *arg, const char *path, uint64_t done, uint64_t total);

/* Fetches GET hub_url/v1/manifest (bounded by KV_MANIFEST_MAX_BYTES),
 * parses it (kv_manifest_parse) and writes it to dir/pieces/manifest.json
 * (temporary file + rename). *out is the parsed manifest (caller frees with
 * kv_manifest_free). */
int kv_node_fetch_manifest(const char *hub_url, const char *dir, kv_manifest **out, kv_diag *d);

/* Makes dir/pieces/<f->path> hold the manifest's bytes: an existing file is
 * hashed and kept if it matches; else GET hub_url/v1/pieces/<path> into
 * <path>.part, resuming from the bytes already there (Range), never past
 * f->size, then hashed and renamed into place. A file whose SHA-256 differs
 * is deleted and KV_EHASH returned. A piece without a hash (sparse) is
 * refused (KV_EUNSUPPORTED). progress may be NULL. */
int kv_node_fetch_piece(const char *hub_url, const char *dir, const kv_manifest_file *f, kv_node_progress_fn progress,
                        void *parg, kv_diag *d);

/* A signed POST of body (NUL-terminated JSON) to hub_url + path; the answer
 * (bounded) in *out (caller frees), the HTTP status in *status. For other
 * kinds of node (the ring's) that register with a hub like this one. */
int kv_node_hub_post(const char *hub_url, kv_node_key *key, const char *path, const char *body, char **out,
                     long *status, kv_diag *d);

/* The absolute-or-relative path dir/pieces/<rel> into out[cap]. */
int kv_node_piece_path(const char *dir, const char *rel, char *out, size_t cap, kv_diag *d);

/* ---- coordinator side -------------------------------------------------- */

/* Materializes a coordinator folder from a hub: the manifest and the
 * backbone in dir/pieces/ (fetched, resumable, hash checked), and the
 * workers of GET /v1/placement (every distinct live node address, in the
 * order first seen). manifest_path[cap] gets dir/pieces/manifest.json;
 * *workers is a malloc'd array of malloc'd strings (free with
 * kv_node_workers_free). */
int kv_node_fetch_coordinator(const char *hub_url, const char *dir, char *manifest_path, size_t cap, char ***workers,
                              uint32_t *n_workers, kv_node_progress_fn progress, void *parg, kv_diag *d);
void kv_node_workers_free(char **workers, uint32_t n);

/* ---- the placement map (GET /v1/placement), as a coordinator keeps it ----
 * The map is untrusted (any key can register, and fuzzed:
 * fuzz/fuzz_node_placement.c), so no entry can do more than be skipped:
 *   - an entry is used when its "addr" is 1..KV_HUB_MAX_ADDR bytes of
 *     [A-Za-z0-9.-:[]] that parse as HOST:PORT (port 1..65535); other
 *     entries, and shards without a "nodes" array, are skipped and counted.
 *     Its "key" is 64 lowercase hex digits, else it gives none (the worker
 *     is then asked to prove no particular key);
 *   - an address listed with two keys is dropped entirely (under either
 *     key), counted: the coordinator cannot tell which node owns it;
 *   - of each shard's holders the first KV_PLACEMENT_MAX_REPLICAS usable
 *     ones in the hub's order are kept, the rest counted. So the addresses
 *     kept are at most KV_PLACEMENT_MAX_REPLICAS per shard of the map, and
 *     no fixed ceiling that strangers could fill stands between a swarm's
 *     size and its coordinators (the 122B's 12,544 shards and thousands of
 *     nodes parse).
 * Only a document that is not JSON or has no "shards" array, or a map whose
 * entries were all unusable, is an error as a whole. */
#define KV_PLACEMENT_MAX_REPLICAS 16u  /* holders of one shard a coordinator keeps */

typedef struct kv_placement_entry {
    uint32_t shard, node;  /* shards[shard].nodes[node] of the map */
    uint32_t addr;         /* index into kv_placement.addr */
} kv_placement_entry;

typedef struct kv_placement {
    char **addr;           /* [n_addr] the addresses kept, first seen first (owned) */
    uint8_t (*key)[32];    /* [n_addr] the key each is listed with (zero: none) */
    uint8_t *relayed;      /* [n_addr] 1: an entry says "relayed": reached through the hub's relay */
    uint32_t n_addr;
    kv_placement_entry *entry; /* [n_entry] the holder entries kept, in map order */
    size_t n_entry;
    uint32_t n_skipped;    /* entries (or shards) skipped as invalid */
    uint32_t n_conflicts;  /* addresses dropped for being listed with two keys */
    uint32_t n_over;       /* holders beyond KV_PLACEMENT_MAX_REPLICAS in their shard */
    char note[256];        /* the first skip or drop, "" if none: for a warning line */
    uint16_t relay_port;   /* the hub's relay ("relay": {"port", "sha256"}) on the hub's host; 0 = none */
    char relay_sha256[65]; /* its fingerprint, 64 lowercase hex ("" when relay_port is 0) */
} kv_placement;

/* Parses the map as above into *p (free with kv_node_placement_free, also
 * after an error). KV_EFORMAT (not JSON, no shards array, nothing usable:
 * named in d), KV_ENOMEM; *p is empty then. */
int kv_node_placement_parse(const char *json, size_t len, kv_placement *p, kv_diag *d);
void kv_node_placement_free(kv_placement *p);
/* The addresses kept (kv_placement.addr, first seen first) in *workers
 * (free with kv_node_workers_free). On error *workers is NULL and *n 0. */
int kv_node_parse_placement(const char *json, size_t len, char ***workers, uint32_t *n, kv_diag *d);

/* ---- the hub's relay (src/hub/node_relay.c) -------------------------------
 * The relay listens on the hub's host (as hub_url names it) at the port the
 * hub advertises, with the hub's certificate. */
/* "HOST:PORT" of the relay into out[cap]: hub_url's host and port. fp (64
 * lowercase hex, from the hub's answer) must equal hub_url's #sha256= pin
 * when it has one (KV_EAUTH). KV_EINVAL for no port or fingerprint. */
int kv_node_relay_addr(const char *hub_url, uint16_t port, const char *fp, char *out, size_t cap, kv_diag *d);
/* Routes every relayed node of p that has a key through the hub's relay
 * (kv_relay_route_add), so that a dispatch client dialing its address
 * reaches it. Returns how many are routed (0 when none is relayed), or the
 * first error (the others are routed still). */
int kv_node_relay_routes(const char *hub_url, const kv_placement *p, kv_diag *d);

/* ---- a coordinator that follows the map ----------------------------------
 * Nodes trade shards all the time (a market), so a coordinator that finds
 * no holder of some expert reads the map again instead of giving up. */
struct kv_remote;
/* GET hub_url/v1/placement parsed into *p (kv_node_placement_parse). */
int kv_node_fetch_placement(const char *hub_url, kv_placement *p, kv_diag *d);
/* Reads the map now and adds every address it keeps to r
 * (kv_remote_add_worker; with require_keys each must prove the key the map
 * lists it with). Same thread as r's compute, never during it. Returns how
 * many were new, or the first error (the read's, or an address that could
 * not be added: the others are added still). */
int kv_node_placement_follow(const char *hub_url, struct kv_remote *r, bool require_keys, kv_diag *d);
/* Returns 0 once every expert the forward pass needs is served by a worker
 * up or a local slab (kv_remote_get_coverage); until then reads the map
 * again (kv_node_placement_follow) with backoff, 100 ms doubled up to 2 s,
 * progressing handshakes in between, for at most wait_ms: then
 * KV_ENOTFOUND naming the first slab still missing. log: a line per retry
 * (NULL = silent). */
int kv_node_await_coverage(const char *hub_url, struct kv_remote *r, bool require_keys, uint32_t wait_ms, FILE *log,
                           kv_diag *d);

/* ---- authenticated dispatch (docs/HUB.md, docs/PROTOCOL.md v3) ---------- */

struct kv_voucher;
/* GET /v1/status's "hub_key": the key whose vouchers a node's worker
 * honors. Parsers of untrusted JSON (fuzzed: fuzz/fuzz_node_auth.c). */
int kv_node_fetch_hub_key(const char *hub_url, uint8_t out[32], kv_diag *d);
int kv_node_parse_hub_key(const char *json, size_t len, uint8_t out[32], kv_diag *d);
/* A coordinator's side: POST /v1/voucher signed by key (KV_EAUTH when the
 * hub does not vouch for it) into *v, then GET /v1/placement for the key
 * each of workers[0..n) is listed with (keys[i] zero when not listed), so
 * that the coordinator checks it talks to the node the hub listed. */
int kv_node_fetch_auth(const char *hub_url, kv_node_key *key, char *const *workers, uint32_t n, uint8_t (*keys)[32],
                       struct kv_voucher *v, kv_diag *d);
int kv_node_parse_voucher(const char *json, size_t len, struct kv_voucher *v, uint8_t hub_key[32], kv_diag *d);
/* keys[i] = the key placement lists for address workers[i]: zero if none,
 * and for an address the map does not keep (one listed with two keys
 * among them: kv_node_parse_placement never returns it). Errors only as
 * kv_node_placement_parse's. */
int kv_node_parse_placement_keys(const char *json, size_t len, char *const *workers, uint32_t n, uint8_t (*keys)[32],
                                 kv_diag *d);

/* A coordinator reports a worker it caught lying: POST /v1/report signed by
 * key, body {"key": HEX64 of the worker's key, "reason": TEXT, "evidence":
 * {...}} (docs/HUB.md). The hub accepts reports only from coordinators it
 * vouches for, and acts only on evidence: the worker's signed answer, which
 * it recomputes (ev NULL: a report the hub refuses with 422, changing
 * nothing). Returns 0 when the hub judged it (*unlisted, when not NULL: the
 * answer was wrong and the worker is unlisted), else KV_EAUTH (403),
 * KV_EINVAL (422: no or bad evidence) or KV_EPROTO / KV_EIO. */
struct kv_evidence;
int kv_node_report(const char *hub_url, kv_node_key *key, const uint8_t worker_key[32], const char *reason,
                   const struct kv_evidence *ev, bool *unlisted, kv_diag *d);
/* A parsed report body (the hub's side; fuzzed). */
#define KV_HUB_MAX_REASON 300u
typedef struct kv_hub_report {
    uint8_t key[32];                    /* the worker reported */
    char reason[KV_HUB_MAX_REASON + 1]; /* printable ASCII, cut */
    bool has_evidence;
    struct kv_evidence *ev;             /* owned, with its rows, when has_evidence: worker_key is key,
                                           coord_key zero (the hub sets the signer's) */
} kv_hub_report;
/* Parses body json[len] into out: the key, the reason cut to
 * KV_HUB_MAX_REASON printable bytes, and the evidence when present (bounded:
 * one x and one y row of at most KV_PROTO_MAX_EMBD values, at most
 * KV_EVIDENCE_MAX_PROOF hashes). KV_EFORMAT / KV_ENOMEM; out is then empty.
 * Free with kv_hub_report_free (accepts a zeroed one). */
int kv_hub_parse_report(const char *json, size_t len, kv_hub_report *out, kv_diag *d);
void kv_hub_report_free(kv_hub_report *r);

/* ---- the node ------------------------------------------------------------ */

typedef struct kv_node kv_node;

typedef struct kv_node_opts {
    const char *hub;           /* hub URL, "http://HOST:PORT" */
    const char *dir;           /* data folder: node.key, pieces/ */
    uint64_t budget;           /* bytes of slabs this node may hold */
    const char *listen;        /* worker address; NULL = "127.0.0.1:0" */
    const char *advertise;     /* address announced; NULL = the worker's bound address */
    uint32_t interval_ms;      /* heartbeat and market period; 0 = the hub's deadline / 3 */
    int n_threads;             /* worker compute threads; 0 = all CPUs */
    int test_delay_ms;         /* TEST ONLY (kvasir node --test-delay=MS): its worker answers every
                                  COMPUTE late (kv_worker_opts.test_delay_ms); 0 in real use */
    FILE *log;                 /* one line per event; NULL = silent */
    kv_node_progress_fn progress; /* download progress; NULL = none */
    void *progress_arg;
    const uint8_t (*allow_keys)[32]; /* [n_allow_keys] coordinators served besides those the hub
                                   vouches for (borrowed while the node runs) */
    size_t n_allow_keys;
    bool insecure_plaintext;   /* its worker serves plaintext coordinators from any address
                                  (--insecure-plaintext); off: TLS beyond loopback */
    bool has_layers;           /* take only shards of layers [layer_first, layer_last] (--layers) */
    uint32_t layer_first, layer_last;
    const char *site;          /* its site (--site; kv_hub_site_check), NULL = the hub groups it
                                  by the round trips it measures (docs/HUB.md "Sites") */
    int relay;                 /* the hub's relay (docs/HUB.md "Relay"): KV_NODE_RELAY_AUTO (0) connects out
                                  once the hub says it cannot dial this node; _ALWAYS as soon as the hub
                                  names its relay; _OFF never */
} kv_node_opts;

enum { KV_NODE_RELAY_AUTO = 0, KV_NODE_RELAY_ALWAYS = 1, KV_NODE_RELAY_OFF = 2 };

/* Loads (or creates) the node key in opts->dir. Nothing else happens until
 * kv_node_run. Free with kv_node_free (accepts NULL). */
int kv_node_open(kv_node **out, const kv_node_opts *opts, kv_diag *d);
/* Runs until kv_node_stop: choose, download, verify, serve, register, then
 * every interval heartbeat (answering challenges, registering again when the
 * hub dropped or forgot the node) and read the market, choosing again when
 * it changed. The worker cannot add slabs while it runs, so a new choice
 * starts a new in-process worker with the new set, registers it, and stops
 * the old one a moment later (make before break; with a fixed --listen
 * port the old one stops first). Transient hub errors are logged and
 * retried; returns 0 after kv_node_stop, or an error that cannot be
 * retried (bad key file, unwritable folder). */
int kv_node_run(kv_node *n, kv_diag *d);
/* Async-signal-safe: makes kv_node_run return soon. */
void kv_node_stop(kv_node *n);
void kv_node_free(kv_node *n);

#endif
