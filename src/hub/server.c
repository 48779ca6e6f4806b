/* The hub server: libmicrohttpd routes over one registry.
 *
 * State. The registry (nodes, what each holds, counters, pending storage
 * challenges) lives in memory under one mutex; every change is written
 * through the store (store.h) before memory changes and before the answer,
 * so an acknowledged change survives a restart and a failed write changes
 * nothing. The market and the placement map are computed from memory; the
 * market's policy (wanted per shard from demand, the reward) is market.c's,
 * its per-shard state written through the store the same way, each write
 * conditional on the version read, so hubs on one store step one state.
 *
 * Shared stores. When the store is shared (PostgreSQL: several hub
 * processes on one database), the store decides every signed write: its
 * counter condition and nonce consumption run inside its transaction, so a
 * request accepted by one hub is refused by every other, and a nonce one hub
 * handed out can be used once at any of them. Memory is then a view of the
 * store that lives about refresh_ms: a refresher thread reloads it from a
 * second connection (outside the state lock, so no request waits for a
 * reload); the market, placement and status answer 503 while the view is
 * older than 4 refresh periods plus a second (the store is unreachable), and
 * a signed request from a key this hub has not seen loads that node from
 * the store. A reloaded record replaces the one in memory only
 * when its counter is higher, so a snapshot taken before this hub's own
 * write cannot undo it. Pending storage challenges stay with the hub that
 * issued them.
 *
 * Requests. A handler runs only once the whole body is in (bounded by
 * max_body: a larger Content-Length, or a chunked body that grows past it,
 * is answered 413 at once). State-changing requests are POSTs whose headers
 * carry a signature (hub.h); the order of checks is: parse, signature,
 * counter (must exceed the node's last), request-specific checks, store
 * write, memory update. Every refusal is a 4xx with {"error", "code"} and
 * leaves state as it was. Pieces are served only under the exact relative
 * paths that the manifest lists, from the manifest's folder, so no request
 * path can name another file.
 *
 * Resources. Connections are bounded in total and per client IP, idle ones
 * time out, a request must arrive whole within request_s, and when full the
 * address holding the most incomplete connections yields one to a newcomer
 * (src/http/http_guard.h); conflicting Content-Length headers are refused;
 * parsing a body may hold at most KV_HUB_PARSE_FACTOR x max_body + 1 MiB
 * (413 beyond); per-connection memory is bounded, and so are outstanding
 * registration nonces (a ring: the oldest is forgotten) and registered
 * nodes (KV_HUB_MAX_NODES). */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netdb.h>
#include <pthread.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "hub/hub_internal.h"
#include "hub/hub_relay.h"
#include "hub/prove.h"
#include "hub/store.h"
#include "http/http_guard.h"
#include "http/https_mhd.h"
#include "kvasir/probe.h"
#include "kvasir/dispatch_evidence.h"
#include "kvasir/dispatch_proto.h"
#include "kvasir/node.h"
#include "kvasir/slice.h"

#define KV_HUB_MAX_NODES (1u << 20)          /* registered nodes */
#define KV_HUB_MAX_PROVERS 16u               /* prover threads */

/* the status page (src/hub/status.html, embedded at build time) */
extern const unsigned char kv_status_page_data[];
extern const size_t kv_status_page_len;

typedef struct kv_hub_node {
    uint8_t pk[32];                       /* identity */
    char addr[KV_HUB_MAX_ADDR + 1];       /* dispatch HOST:PORT */
    char backend[KV_HUB_MAX_BACKEND + 1]; /* kernel backend name */
    uint64_t memory;                      /* announced budget, bytes */
    uint64_t counter;                     /* last accepted request counter */
    int64_t last_seen_ms, registered_ms;  /* Unix ms */
    uint32_t *slabs;                      /* [n_slabs] manifest slab indices held, sorted */
    size_t n_slabs;
    uint32_t beats;                       /* heartbeats since the last challenge */
    bool ch_pending;                      /* a storage challenge awaits its answer */
    uint8_t ch_nonce[32];
    uint32_t ch_slab;                     /* slab index challenged */
    int64_t ch_issued_ms;
    /* what it served, from its heartbeats (memory only: rates restart with the hub) */
    uint64_t served_pairs, served_tokens; /* totals last reported (since the node started) */
    int64_t served_ms;                    /* when; 0 = never reported */
    double pairs_per_s, tokens_per_s;     /* between its last two reports */
    bool reported;                        /* a vouched coordinator caught it lying: unlisted */
    /* proof of service (prove.c): nothing is listed until proven */
    uint8_t *proven;                      /* [n_slabs] 1: that slab answered a compute challenge */
    char host[48], subnet[48];            /* of addr: canonical IP and its /24 or /48 */
    uint32_t gen;                         /* bumped when addr or holdings change */
    int64_t proven_ms;                    /* first proof of the key at addr (Unix ms); 0 = never */
    uint32_t passes;                      /* compute challenges passed at addr */
    uint32_t fails;                       /* probes failed in a row (backoff) */
    int64_t probe_due_ms;                 /* next probe (Unix ms) */
    bool probing;                         /* a prover thread is probing it */
    bool probe_all;                       /* the next probe challenges every slab (a report) */
    char prove_err[160];                  /* why its last probe failed, "" if it passed */
    bool relayed;                         /* the hub could not dial addr (the reachability check): it is
                                             reached, and proven, through the hub's relay (memory only) */
    char site[KV_HUB_MAX_SITE + 1];       /* as announced (--site); "" = grouped by the hub (sites.c) */
    double rtt_ms;                        /* round trip the hub measured to it: the least over its compute
                                             challenges at this host (one round trip plus one expert on
                                             one token: an upper bound); < 0 = not measured (memory only) */
} kv_hub_node;

typedef struct kv_hub_nonce {
    uint8_t nonce[32]; /* bytes 0..3: slot index (LE), rest random */
    int64_t expires_ms;
    bool live;         /* issued and not yet used */
} kv_hub_nonce;

typedef struct kv_hub_path {
    const char *path; /* manifest-relative */
    int64_t slab;     /* slab index, -1 for the backbone */
    uint64_t size;
    const uint8_t *sha256; /* NULL when the manifest has none */
} kv_hub_path;

struct kv_hub {
    kv_hub_opts o;
    kv_manifest *m;
    char *manifest_json;        /* the file as served */
    size_t manifest_len;
    int dir_fd;                 /* the manifest's folder */
    kv_hub_path *paths;         /* [n_paths] sorted by path */
    size_t n_paths;
    kv_mkt_state *mkt;          /* [n_slabs] the market's state per shard (market.h): under mu, written
                                   through the store first (shared: reloaded by the refresher) */
    kv_mkt_policy pol;          /* the market's policy, from the options */
    kv_demand_budget dbud;      /* what demand reports may count (docs/HUB.md "Demand") */
    uint32_t (*rwin)[2];        /* [n_rwin] ring layer windows (first, last), in layer order */
    size_t n_rwin;
    kv_hub_store store;
    bool shared;                /* the store is shared with other hubs (store.h) */
    kv_hub_store rstore;        /* shared only: the connection the view is reloaded from */
    pthread_mutex_t refresh_mu; /* guards rstore and refresh_stop (held during a reload) */
    pthread_cond_t refresh_cv;  /* wakes the refresher to stop */
    pthread_t refresher;        /* reloads the view every refresh_ms */
    bool refresher_on, refresh_stop;
    _Atomic int64_t refreshed_ms; /* wall clock of the last successful reload (the refresher stores) */
    kv_diag refresh_diag;       /* why the last reload failed, if it did (under mu) */
    pthread_mutex_t mu;         /* guards everything below and the store */
    kv_hub_node *nodes;         /* [n_nodes] */
    size_t n_nodes, cap_nodes;
    uint32_t *tab;              /* [tab_size] node index + 1, 0 = empty (open addressing by pk) */
    size_t tab_size;
    kv_hub_nonce *nonces;       /* [KV_HUB_MAX_NONCES] ring */
    uint32_t nonce_next;
    struct MHD_Daemon *mhd;
    kv_http_guard *guard;       /* connection limits and request deadlines */
    char addr[128];
    kv_https_cert tls;          /* the derived certificate (opts.tls without opts.tls_cert) */
    const kv_https_cert *tls_on; /* what MHD serves: opts.tls_cert, &tls, or NULL (plain HTTP) */
    int stop_pipe[2];
    uint8_t hub_pk[32], hub_sk[64]; /* signs vouchers */
    uint8_t (*vouch)[32];       /* [n_vouch] operator-approved coordinator keys, sorted */
    size_t n_vouch;
    /* proof of service: prover threads dial nodes and check their answers */
    pthread_t provers[KV_HUB_MAX_PROVERS];
    uint32_t n_provers;
    pthread_cond_t prove_cv;    /* (with mu) wakes provers: a registration, or stop */
    bool prove_stop;            /* under mu */
    kv_voucher self_voucher;    /* the hub vouches for itself to the workers it probes (under mu) */
    uint64_t probes_ok, probes_failed; /* under mu */
    kv_hub_relay *relay;        /* the relay (opts.relay), NULL when off */
    pthread_mutex_t adopt_mu;   /* guards http_open against kv_hub_http_adopt (--relay-port same) */
    bool http_open;             /* mhd takes connections handed over by the relay */
};

static int64_t kv_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- growable output buffer (JSON rendering) ---------------------------- */

typedef struct kv_sb {
    char *p;
    size_t n, cap;
    int oom;
} kv_sb;

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static void kv_sb_printf(kv_sb *b, const char *fmt, ...) {
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(b->p ? b->p + b->n : NULL, b->p ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (k < 0) {
            b->oom = 1;
            return;
        }
        if (b->p && (size_t)k < b->cap - b->n) {
            b->n += (size_t)k;
            return;
        }
        size_t nc = b->cap ? b->cap * 2 : 65536;
        while (nc < b->n + (size_t)k + 1) nc *= 2;
        char *np = realloc(b->p, nc);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = nc;
    }
}

/* ---- node table --------------------------------------------------------- */

static size_t kv_pk_hash(const uint8_t pk[32], size_t mask) {
    uint64_t x;
    memcpy(&x, pk, 8); /* keys are uniformly random */
    return (size_t)x & mask;
}

static kv_hub_node *kv_node_find(kv_hub *h, const uint8_t pk[32]) {
    if (!h->tab_size) return NULL;
    size_t mask = h->tab_size - 1;
    for (size_t i = kv_pk_hash(pk, mask);; i = (i + 1) & mask) {
        uint32_t e = h->tab[i];
        if (!e) return NULL;
        if (!memcmp(h->nodes[e - 1].pk, pk, 32)) return &h->nodes[e - 1];
    }
}

static int kv_tab_grow(kv_hub *h) {
    size_t ns = h->tab_size ? h->tab_size * 2 : 1024;
    uint32_t *t = calloc(ns, sizeof *t);
    if (!t) return -1;
    for (size_t k = 0; k < h->n_nodes; k++) {
        size_t i = kv_pk_hash(h->nodes[k].pk, ns - 1);
        while (t[i]) i = (i + 1) & (ns - 1);
        t[i] = (uint32_t)k + 1;
    }
    free(h->tab);
    h->tab = t;
    h->tab_size = ns;
    return 0;
}

/* Adds a node with pk (zeroed otherwise), or NULL when out of memory. */
static kv_hub_node *kv_node_add(kv_hub *h, const uint8_t pk[32]) {
    if (h->n_nodes == h->cap_nodes) {
        size_t nc = h->cap_nodes ? h->cap_nodes * 2 : 256;
        kv_hub_node *nn = realloc(h->nodes, nc * sizeof *nn);
        if (!nn) return NULL;
        h->nodes = nn;
        h->cap_nodes = nc;
    }
    if ((h->n_nodes + 1) * 2 > h->tab_size && kv_tab_grow(h)) return NULL;
    kv_hub_node *n = &h->nodes[h->n_nodes];
    memset(n, 0, sizeof *n);
    memcpy(n->pk, pk, 32);
    n->rtt_ms = -1;
    size_t mask = h->tab_size - 1, i = kv_pk_hash(pk, mask);
    while (h->tab[i]) i = (i + 1) & mask;
    h->tab[i] = (uint32_t)++h->n_nodes;
    return n;
}

static bool kv_node_live(const kv_hub *h, const kv_hub_node *n, int64_t now) {
    return n->n_slabs && now - n->last_seen_ms <= (int64_t)h->o.deadline_ms;
}

/* Replaces n's holdings by sl[ns] (sorted manifest indices; n takes them,
 * NULL with 0 for none). A slab it held before keeps its proof when the
 * address is unchanged; the generation moves on so that a probe started
 * before does not judge the new holdings. Caller holds mu. KV_ENOMEM (then
 * nothing changed and sl is still the caller's). */
static int kv_node_take_slabs(kv_hub_node *n, uint32_t *sl, size_t ns, bool same_addr) {
    uint8_t *pv = NULL;
    if (ns && !(pv = calloc(ns, 1))) return KV_ENOMEM;
    if (same_addr && n->proven)
        for (size_t i = 0, j = 0; i < ns; i++) {
            while (j < n->n_slabs && n->slabs[j] < sl[i]) j++;
            if (j < n->n_slabs && n->slabs[j] == sl[i]) pv[i] = n->proven[j];
        }
    free(n->slabs);
    free(n->proven);
    n->slabs = sl;
    n->proven = pv;
    n->n_slabs = ns;
    n->gen++;
    return 0;
}

/* Sets n's address (already checked) with its host and subnet. A new host
 * starts unproven. A new port on the same host keeps the proof of the slabs
 * it keeps: a node that trades shards serves them from a new worker (a new
 * port), and its key signed the move; the caller has the new address
 * challenged at once, and coordinators check the key there themselves, so
 * the map does not lose a node's replicas for each trade. Caller holds mu. */
static void kv_node_set_addr(kv_hub_node *n, const char *addr) {
    if (!strcmp(n->addr, addr) && n->host[0]) return;
    char host[sizeof n->host], subnet[sizeof n->subnet];
    if (kv_hub_addr_subnet(addr, host, sizeof host, subnet, sizeof subnet, NULL)) {
        snprintf(host, sizeof host, "%.47s", addr); /* a record from an older hub: never proven */
        snprintf(subnet, sizeof subnet, "%.47s", addr);
    }
    snprintf(n->addr, sizeof n->addr, "%s", addr);
    n->gen++;
    if (kv_hub_same_host(n->host, host)) return; /* the caller has it proven again at once */
    memcpy(n->host, host, sizeof host);
    memcpy(n->subnet, subnet, sizeof subnet);
    n->rtt_ms = -1; /* another host: measured again */
    n->relayed = false; /* another host: the reachability check is made again */
    if (n->proven) memset(n->proven, 0, n->n_slabs);
    n->proven_ms = 0;
    n->passes = n->fails = 0;
}

/* Whether slab i of n counts: proven, or the hub lists what is announced. */
static bool kv_node_slab_ok(const kv_hub *h, const kv_hub_node *n, size_t i) {
    return h->o.trust_announced || (n->proven && n->proven[i]);
}

/* Slab index of (layer, first, last) in the manifest, or -1. */
static int64_t kv_slab_find(const kv_manifest *m, uint32_t layer, uint32_t first, uint32_t last) {
    size_t lo = 0, hi = m->n_slabs;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        const kv_manifest_slab *s = &m->slabs[mid];
        if (s->layer < layer || (s->layer == layer && s->first < first)) lo = mid + 1;
        else hi = mid;
    }
    if (lo < m->n_slabs && m->slabs[lo].layer == layer && m->slabs[lo].first == first &&
        m->slabs[lo].last == last)
        return (int64_t)lo;
    return -1;
}

/* The store's view of a node: its holdings with the manifest's hashes. */
static int kv_node_store_put(kv_hub *h, const kv_hub_node *n, const uint32_t *slabs, size_t ns,
                             const uint8_t *nonce, int64_t now, kv_diag *d) {
    kv_hub_held *held = calloc(ns ? ns : 1, sizeof *held);
    if (!held) return kv_fail(d, KV_ENOMEM, "out of memory");
    for (size_t i = 0; i < ns; i++) {
        const kv_manifest_slab *s = &h->m->slabs[slabs[i]];
        held[i] = (kv_hub_held){.layer = s->layer, .first = s->first, .last = s->last};
        memcpy(held[i].sha256, s->file.sha256, 32);
    }
    kv_hub_node_rec r = {.memory = n->memory, .counter = n->counter, .last_seen_ms = n->last_seen_ms,
                         .registered_ms = n->registered_ms, .shards = held, .n_shards = ns};
    memcpy(r.pk, n->pk, 32);
    memcpy(r.addr, n->addr, sizeof r.addr);
    memcpy(r.backend, n->backend, sizeof r.backend);
    memcpy(r.site, n->site, sizeof r.site);
    int rc = h->store.ops->node_put(h->store.impl, &r, nonce, now, d);
    free(held);
    return rc;
}

/* ---- the view of a shared store ------------------------------------------- */

static int kv_node_reload(void *arg, const kv_hub_node_rec *r);

/* One node of a reloaded snapshot: taken when memory has never seen it or
 * the snapshot's counter is higher (a newer accepted request, at this hub or
 * another); otherwise memory is as new (it follows this hub's own writes,
 * which the snapshot may predate). Takes mu per node, so requests are not
 * held for the whole reload. */
static int kv_node_merge(void *arg, const kv_hub_node_rec *r) {
    kv_hub *h = arg;
    int rc = 0;
    pthread_mutex_lock(&h->mu);
    kv_hub_node *n = kv_node_find(h, r->pk);
    if (!n) {
        if (h->n_nodes < KV_HUB_MAX_NODES) rc = kv_node_reload(h, r);
    } else if (r->counter > n->counter) {
        bool again = r->registered_ms != n->registered_ms;
        rc = kv_node_reload(h, r);
        /* a registration elsewhere replaced the holdings it was asked about */
        if (!rc && again) n->ch_pending = false;
    }
    pthread_mutex_unlock(&h->mu);
    return rc;
}

static int kv_mkt_merge(void *arg, const kv_mkt_row *r);

/* The refresher: one reload per refresh_ms until kv_hub_free stops it. */
static void *kv_hub_refresher(void *arg) {
    kv_hub *h = arg;
    pthread_mutex_lock(&h->refresh_mu);
    while (!h->refresh_stop) {
        kv_diag d = {0};
        int rc = h->rstore.ops->node_each(h->rstore.impl, kv_node_merge, h, &d);
        if (!rc) rc = h->rstore.ops->mkt_each(h->rstore.impl, kv_mkt_merge, h, &d);
        if (rc == KV_ENOMEM) kv_fail(&d, rc, "hub: out of memory reloading nodes");
        if (!rc) {
            atomic_store_explicit(&h->refreshed_ms, kv_now_ms(), memory_order_release);
        } else {
            pthread_mutex_lock(&h->mu);
            h->refresh_diag = d;
            pthread_mutex_unlock(&h->mu);
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t ns = (uint64_t)ts.tv_nsec + (uint64_t)h->o.refresh_ms * 1000000u;
        ts.tv_sec += (time_t)(ns / 1000000000u);
        ts.tv_nsec = (long)(ns % 1000000000u);
        if (!h->refresh_stop) pthread_cond_timedwait(&h->refresh_cv, &h->refresh_mu, &ts);
    }
    pthread_mutex_unlock(&h->refresh_mu);
    return NULL;
}

/* Shared store: 0 while the view is fresh, else KV_EIO with the reason (a
 * view older than four refresh periods plus a second is not served). */
static int kv_hub_refresh(kv_hub *h, kv_diag *d) {
    if (!h->shared) return 0;
    int64_t age = kv_now_ms() - atomic_load_explicit(&h->refreshed_ms, memory_order_acquire);
    if (age <= 4 * (int64_t)h->o.refresh_ms + 1000) return 0;
    pthread_mutex_lock(&h->mu);
    int rc = kv_fail(d, KV_EIO, "hub: the view of the shared store is %lld ms old: %s", (long long)age,
                     h->refresh_diag.msg[0] ? h->refresh_diag.msg : "no reload yet");
    pthread_mutex_unlock(&h->mu);
    return rc;
}

/* ---- market and placement ------------------------------------------------ */

size_t kv_hub_n_shards(const kv_hub *h) { return h->m->n_slabs; }

/* One stored market row into memory when it is newer than what memory
 * holds (a higher version: a write by this hub or another); caller holds
 * mu. A row of a slab the manifest does not have is ignored. */
static int kv_mkt_take(void *arg, const kv_mkt_row *r) {
    kv_hub *h = arg;
    size_t lo = 0, hi = h->m->n_slabs;
    while (lo < hi) {
        const size_t mid = (lo + hi) / 2;
        const kv_manifest_slab *s = &h->m->slabs[mid];
        if (s->layer < r->layer || (s->layer == r->layer && s->first < r->first)) lo = mid + 1;
        else hi = mid;
    }
    if (lo < h->m->n_slabs && h->m->slabs[lo].layer == r->layer && h->m->slabs[lo].first == r->first &&
        r->s.version > h->mkt[lo].version)
        h->mkt[lo] = r->s;
    return 0;
}

/* kv_mkt_take under mu (the refresher, outside the lock). */
static int kv_mkt_merge(void *arg, const kv_mkt_row *r) {
    kv_hub *h = arg;
    pthread_mutex_lock(&h->mu);
    const int rc = kv_mkt_take(h, r);
    pthread_mutex_unlock(&h->mu);
    return rc;
}

/* Writes ns as shard i's state: the store first (conditional on the version
 * memory holds), then memory. KV_EPROTO: another hub wrote it first (memory
 * then reloads it from the store). Caller holds mu. */
static int kv_mkt_write(kv_hub *h, size_t i, const kv_mkt_state *ns, kv_diag *d) {
    const kv_manifest_slab *sl = &h->m->slabs[i];
    kv_mkt_row r = {.layer = sl->layer, .first = sl->first, .s = *ns};
    const int64_t prev = h->mkt[i].version;
    r.s.version = prev + 1;
    int rc = h->store.ops->mkt_put(h->store.impl, &r, prev, d);
    if (!rc) h->mkt[i] = r.s;
    else if (rc == KV_EPROTO) h->store.ops->mkt_each(h->store.impl, kv_mkt_take, h, NULL);
    return rc;
}

/* Evaluates the wanted rule of every shard at now and writes what changed
 * (market.h); caller holds mu. A write another hub won is left to that hub
 * (its state is reloaded); other failures are logged and change nothing. */
static void kv_mkt_tick(kv_hub *h, int64_t now) {
    for (size_t i = 0; i < h->m->n_slabs; i++) {
        kv_mkt_state s = h->mkt[i];
        if (!kv_mkt_step(&h->pol, &s, now)) continue;
        kv_diag d = {0};
        const int rc = kv_mkt_write(h, i, &s, &d);
        if (rc && rc != KV_EPROTO && !h->o.quiet) fprintf(stderr, "hub: market: %s\n", d.msg);
    }
}

/* A ring node (backend "ring") holds slabs as parts of a layer window and
 * speaks the ring protocol, not dispatch: it is listed by GET /v1/ring, not
 * counted as an expert worker nor placed. */
static bool kv_node_is_ring(const kv_hub_node *n) { return !strcmp(n->backend, "ring"); }

/* Its site, given or grouped (sites.c); cap >= 48. */
static void kv_node_site(const kv_hub_node *n, char *out, size_t cap) {
    kv_hub_site_name(n->site, n->rtt_ms, n->host, n->subnet, out, cap);
}

/* One proven replica, for the market's count. */
typedef struct kv_mkt_rep {
    uint32_t slab;
    uint32_t est; /* 1: its node is established (proven for trust_ms, two challenges passed) */
    uint64_t net; /* its subnet (loopback: the node itself) */
} kv_mkt_rep;

/* By slab, then subnet, established replicas first within a subnet. */
static int kv_mkt_rep_cmp(const void *a, const void *b) {
    const kv_mkt_rep *x = a, *y = b;
    if (x->slab != y->slab) return x->slab < y->slab ? -1 : 1;
    if (x->net != y->net) return x->net < y->net ? -1 : 1;
    return x->est > y->est ? -1 : x->est < y->est;
}

static uint64_t kv_mkt_net(const kv_hub_node *n) {
    uint64_t x = 1469598103934665603ull; /* FNV-1a */
    if (kv_hub_addr_loopback(n->host)) {
        for (int i = 0; i < 32; i++) x = (x ^ n->pk[i]) * 1099511628211ull;
    } else {
        for (const char *p = n->subnet; *p; p++) x = (x ^ (uint8_t)*p) * 1099511628211ull;
    }
    return x;
}

/* A node is established once it has been proven at its address for
 * trust_ms and passed two challenges; a failed probe starts it over. */
static bool kv_node_established(const kv_hub *h, const kv_hub_node *n, int64_t now) {
    return n->proven_ms && now - n->proven_ms >= (int64_t)h->o.trust_ms && n->passes >= 2;
}

/* live[i] for every slab, as the market counts it; caller holds mu.
 * Only proven replicas count, and two rules keep strangers, whose keys are
 * free, from making an honest holder's shard look over-covered (which sends
 * budget-limited honest nodes elsewhere):
 *  - of one subnet at most half the wanted replicas count (rounded up;
 *    loopback nodes are each their own subnet);
 *  - where established replicas hold a shard, replicas of nodes not yet
 *    established only fill what they leave short of wanted. A shard with
 *    none established counts every replica, so a swarm of newcomers still
 *    sees its over-coverage and rebalances. */
static void kv_mkt_live(kv_hub *h, int64_t now, uint32_t *live) {
    memset(live, 0, h->m->n_slabs * sizeof *live);
    size_t nr = 0;
    for (size_t k = 0; k < h->n_nodes; k++) {
        const kv_hub_node *n = &h->nodes[k];
        if (!kv_node_live(h, n, now) || kv_node_is_ring(n)) continue;
        for (size_t i = 0; i < n->n_slabs; i++)
            if (kv_node_slab_ok(h, n, i)) nr++;
    }
    kv_mkt_rep *r = malloc((nr ? nr : 1) * sizeof *r);
    if (!r) { /* no memory for the rules: plain counts */
        for (size_t k = 0; k < h->n_nodes; k++) {
            const kv_hub_node *n = &h->nodes[k];
            if (!kv_node_live(h, n, now) || kv_node_is_ring(n)) continue;
            for (size_t i = 0; i < n->n_slabs; i++)
                if (kv_node_slab_ok(h, n, i)) live[n->slabs[i]]++;
        }
        return;
    }
    size_t j = 0;
    for (size_t k = 0; k < h->n_nodes; k++) {
        const kv_hub_node *n = &h->nodes[k];
        if (!kv_node_live(h, n, now) || kv_node_is_ring(n)) continue;
        const uint64_t net = kv_mkt_net(n);
        const uint32_t est = !h->o.trust_announced && kv_node_established(h, n, now);
        for (size_t i = 0; i < n->n_slabs; i++)
            if (kv_node_slab_ok(h, n, i)) r[j++] = (kv_mkt_rep){n->slabs[i], est, net};
    }
    qsort(r, nr, sizeof *r, kv_mkt_rep_cmp);
    for (size_t a = 0; a < nr;) {
        const uint32_t sl = r[a].slab, w = h->mkt[sl].wanted, cap = w > 1 ? (w + 1) / 2 : 1;
        uint32_t est = 0, fresh = 0;
        while (a < nr && r[a].slab == sl) {
            size_t b = a;
            uint32_t took = 0;
            for (; b < nr && r[b].slab == sl && r[b].net == r[a].net; b++)
                if (took < cap) {
                    took++;
                    est += r[b].est;
                    fresh += !r[b].est;
                }
            a = b;
        }
        const uint32_t room = w > est ? w - est : 0;
        live[sl] = est + (est && fresh > room ? room : fresh);
    }
    free(r);
}

/* GET /v1/ring: the layer windows as shards of the market, in layer order:
 * bytes (the window's slabs; the backbone comes on top), one replica wanted,
 * the live ring nodes holding every slab of the window (its holder), and the
 * scarcity and reward of the market's formula. */
static int kv_hub_ring_render(kv_hub *h, char **out, size_t *len, kv_diag *d) {
    const int64_t now = kv_now_ms();
    kv_sb b = {0};
    pthread_mutex_lock(&h->mu);
    kv_sb_printf(&b, "{\"model_id\":\"%s\",\"n_layer\":%u,\"deadline_ms\":%u,\"windows\":[", h->m->model_id,
                 h->m->n_layer - h->m->n_layer_nextn, h->o.deadline_ms);
    for (size_t w = 0; w < h->n_rwin; w++) {
        const uint32_t a = h->rwin[w][0], z = h->rwin[w][1];
        uint64_t bytes = 0;
        size_t need = 0;
        for (size_t i = 0; i < h->m->n_slabs; i++)
            if (h->m->slabs[i].layer >= a && h->m->slabs[i].layer <= z) {
                bytes += h->m->slabs[i].file.size;
                need++;
            }
        uint32_t live = 0;
        kv_sb nb = {0};
        for (size_t k = 0; k < h->n_nodes; k++) {
            const kv_hub_node *n = &h->nodes[k];
            if (!kv_node_is_ring(n) || !kv_node_live(h, n, now)) continue;
            size_t got = 0;
            for (size_t i = 0; i < n->n_slabs; i++) {
                const kv_manifest_slab *sl = &h->m->slabs[n->slabs[i]];
                got += sl->layer >= a && sl->layer <= z;
            }
            if (got != need || n->n_slabs != need) continue; /* holds exactly this window */
            char hex[65];
            kv_hex(n->pk, 32, hex);
            kv_sb_printf(&nb, "%s{\"key\":\"%s\",\"addr\":\"%s\",\"last_seen_ms\":%lld}", live ? "," : "", hex, n->addr,
                         (long long)n->last_seen_ms);
            live++;
        }
        const uint32_t wanted = 1;
        kv_sb_printf(&b, "%s{\"first\":%u,\"last\":%u,\"bytes\":%llu,\"wanted\":%u,\"live\":%u,\"scarcity\":%.3f,"
                     "\"reward\":%llu,\"nodes\":[%s]}", w ? "," : "", a, z, (unsigned long long)bytes, wanted, live,
                     live >= wanted ? 0.0 : 1.0, (unsigned long long)kv_mkt_reward(&h->pol, wanted, live, 0),
                     nb.p ? nb.p : "");
        free(nb.p);
    }
    kv_sb_printf(&b, "]}");
    pthread_mutex_unlock(&h->mu);
    if (b.oom || !b.p) {
        free(b.p);
        return kv_fail(d, KV_ENOMEM, "ring: out of memory");
    }
    *out = b.p;
    *len = b.n;
    return 0;
}

/* "A-B,C-D,..." into h->rwin: consecutive, from 0 to the last trunk layer. */
static int kv_hub_parse_windows(kv_hub *h, const char *spec, kv_diag *d) {
    const uint32_t nl = h->m->n_layer - h->m->n_layer_nextn;
    if (!(h->rwin = calloc(nl ? nl : 1, sizeof *h->rwin))) return kv_fail(d, KV_ENOMEM, "hub: out of memory");
    uint32_t next = 0;
    for (const char *p = spec; *p;) {
        char *e1, *e2;
        const unsigned long a = strtoul(p, &e1, 10);
        if (e1 == p || *e1 != '-') return kv_fail(d, KV_EINVAL, "hub: --ring-windows: expected A-B at '%.40s'", p);
        const unsigned long z = strtoul(e1 + 1, &e2, 10);
        if (e2 == e1 + 1 || (*e2 && *e2 != ',') || a != next || z < a || z >= nl || h->n_rwin >= nl)
            return kv_fail(d, KV_EINVAL, "hub: --ring-windows: windows must be consecutive from layer 0 to %u, "
                           "got '%.40s'", nl - 1, p);
        h->rwin[h->n_rwin][0] = (uint32_t)a;
        h->rwin[h->n_rwin++][1] = (uint32_t)z;
        next = (uint32_t)z + 1;
        p = *e2 ? e2 + 1 : e2;
    }
    if (next != nl) return kv_fail(d, KV_EINVAL, "hub: --ring-windows end at layer %u, the model has %u", next, nl);
    return 0;
}

int kv_hub_market_json(kv_hub *h, char **out, size_t *len, kv_diag *d) {
    *out = NULL;
    const size_t ns = h->m->n_slabs;
    uint32_t *live = malloc((ns ? ns : 1) * sizeof *live);
    kv_mkt_sort *ord = malloc((ns ? ns : 1) * sizeof *ord);
    double (*dem)[2] = malloc((ns ? ns : 1) * sizeof *dem); /* demand and wait per shard, at now */
    if (!live || !ord || !dem) {
        free(live);
        free(ord);
        free(dem);
        return kv_fail(d, KV_ENOMEM, "market: out of memory");
    }
    int rc = kv_hub_refresh(h, d);
    if (rc) {
        free(live);
        free(ord);
        free(dem);
        return rc;
    }
    int64_t now = kv_now_ms();
    /* the sites holding a proven live replica of each shard: a bit per site */
    uint64_t *smask = calloc(ns ? ns : 1, sizeof *smask);
    char (*sname)[64] = calloc(KV_HUB_MAX_SITES, sizeof *sname);
    uint32_t n_sname = 0;
    pthread_mutex_lock(&h->mu);
    kv_mkt_tick(h, now);
    kv_mkt_live(h, now, live);
    for (size_t i = 0; i < ns; i++) {
        ord[i] = (kv_mkt_sort){(uint32_t)i, h->mkt[i].wanted, live[i]};
        dem[i][0] = kv_mkt_rate(&h->pol, &h->mkt[i], now);
        dem[i][1] = kv_mkt_wait(&h->pol, &h->mkt[i], now);
    }
    size_t n_nodes = h->n_nodes, n_live = 0;
    for (size_t k = 0; k < h->n_nodes; k++) {
        const kv_hub_node *n = &h->nodes[k];
        const bool lv = kv_node_live(h, n, now);
        n_live += lv;
        if (!lv || !smask || !sname || kv_node_is_ring(n)) continue;
        char site[64];
        kv_node_site(n, site, sizeof site);
        uint32_t si = 0;
        while (si < n_sname && strcmp(sname[si], site)) si++;
        if (si == n_sname && n_sname < KV_HUB_MAX_SITES) memcpy(sname[n_sname++], site, sizeof site);
        if (si == n_sname) continue; /* beyond the sites counted */
        for (size_t i = 0; i < n->n_slabs; i++)
            if (kv_node_slab_ok(h, n, i)) smask[n->slabs[i]] |= 1ull << si;
    }
    pthread_mutex_unlock(&h->mu);
    bool covered = ns > 0;
    for (size_t i = 0; i < ns; i++)
        if (!live[i]) covered = false;
    qsort(ord, ns, sizeof *ord, kv_mkt_cmp);
    kv_sb b = {0};
    kv_sb_printf(&b, "{\"model_id\":\"%s\",\"covered\":%s,\"nodes\":%zu,\"live_nodes\":%zu,\"deadline_ms\":%u,"
                 "\"shards\":[", h->m->model_id, covered ? "true" : "false", n_nodes, n_live, h->o.deadline_ms);
    for (size_t i = 0; i < ns; i++) {
        const kv_manifest_slab *s = &h->m->slabs[ord[i].idx];
        uint32_t w = ord[i].wanted, l = ord[i].live;
        const double rate = dem[ord[i].idx][0], wait = dem[ord[i].idx][1];
        kv_sb_printf(&b, "%s{\"layer\":%u,\"first\":%u,\"last\":%u,\"bytes\":%" PRIu64 ",\"wanted\":%u,\"live\":%u,"
                     "\"scarcity\":%.4f,\"reward\":%" PRIu64 ",\"demand\":%.3f,\"wait_ms\":%.3f,\"sites\":[",
                     i ? "," : "", s->layer, s->first, s->last, s->file.size, w, l, l >= w ? 0.0 : (double)(w - l) / w,
                     kv_mkt_reward(&h->pol, w, l, rate), rate, wait);
        for (uint32_t si = 0, c = 0; smask && si < n_sname; si++)
            if (smask[ord[i].idx] >> si & 1) kv_sb_printf(&b, "%s\"%s\"", c++ ? "," : "", sname[si]);
        kv_sb_printf(&b, "]}");
    }
    kv_sb_printf(&b, "]}\n");
    free(live);
    free(ord);
    free(dem);
    free(smask);
    free(sname);
    if (b.oom) {
        free(b.p);
        return kv_fail(d, KV_ENOMEM, "market: out of memory");
    }
    *out = b.p;
    *len = b.n;
    return 0;
}

/* Placement: for every shard (manifest order) the live nodes holding it.
 * layer_filter < 0 means all layers. */
static int kv_hub_placement_render(kv_hub *h, int64_t layer_filter, char **out, size_t *len, kv_diag *d) {
    *out = NULL;
    const size_t ns = h->m->n_slabs;
    int rc = kv_hub_refresh(h, d);
    if (rc) return rc;
    int64_t now = kv_now_ms();
    kv_sb b = {0};
    pthread_mutex_lock(&h->mu);
    uint32_t *cnt = calloc(ns + 1, sizeof *cnt);
    uint32_t *who = NULL;
    size_t total = 0;
    if (cnt) {
        for (size_t k = 0; k < h->n_nodes; k++)
            if (kv_node_live(h, &h->nodes[k], now) && !kv_node_is_ring(&h->nodes[k]))
                for (size_t i = 0; i < h->nodes[k].n_slabs; i++)
                    if (kv_node_slab_ok(h, &h->nodes[k], i)) cnt[h->nodes[k].slabs[i] + 1]++;
        for (size_t i = 0; i < ns; i++) cnt[i + 1] += cnt[i];
        total = cnt[ns];
        who = malloc((total ? total : 1) * sizeof *who);
    }
    if (!cnt || !who) {
        pthread_mutex_unlock(&h->mu);
        free(cnt);
        return kv_fail(d, KV_ENOMEM, "placement: out of memory");
    }
    {
        uint32_t *fill = calloc(ns ? ns : 1, sizeof *fill);
        if (!fill) {
            pthread_mutex_unlock(&h->mu);
            free(cnt);
            free(who);
            return kv_fail(d, KV_ENOMEM, "placement: out of memory");
        }
        for (size_t k = 0; k < h->n_nodes; k++)
            if (kv_node_live(h, &h->nodes[k], now) && !kv_node_is_ring(&h->nodes[k]))
                for (size_t i = 0; i < h->nodes[k].n_slabs; i++) {
                    if (!kv_node_slab_ok(h, &h->nodes[k], i)) continue;
                    uint32_t s = h->nodes[k].slabs[i];
                    who[cnt[s] + fill[s]++] = (uint32_t)k;
                }
        free(fill);
    }
    kv_sb_printf(&b, "{\"model_id\":\"%s\",\"deadline_ms\":%u,", h->m->model_id, h->o.deadline_ms);
    if (h->relay)
        kv_sb_printf(&b, "\"relay\":{\"port\":%u,\"sha256\":\"%s\"},", kv_hub_relay_port(h->relay),
                     kv_hub_relay_fp(h->relay));
    kv_sb_printf(&b, "\"shards\":[");
    bool first = true;
    for (size_t i = 0; i < ns; i++) {
        const kv_manifest_slab *s = &h->m->slabs[i];
        if (layer_filter >= 0 && s->layer != (uint64_t)layer_filter) continue;
        kv_sb_printf(&b, "%s{\"layer\":%u,\"first\":%u,\"last\":%u,\"nodes\":[", first ? "" : ",", s->layer,
                     s->first, s->last);
        first = false;
        for (uint32_t j = cnt[i]; j < cnt[i + 1]; j++) {
            const kv_hub_node *n = &h->nodes[who[j]];
            char hex[65];
            kv_hex(n->pk, 32, hex);
            /* addr and backend are printable ASCII without '"' or '\\'
             * (kv_hub_parse_announce), so they need no escaping */
            char site[64];
            kv_node_site(n, site, sizeof site);
            kv_sb_printf(&b, "%s{\"key\":\"%s\",\"addr\":\"%s\",\"backend\":\"%s\",\"last_seen_ms\":%" PRId64
                         ",\"relayed\":%s,\"site\":\"%s\"}", j > cnt[i] ? "," : "", hex, n->addr, n->backend,
                         n->last_seen_ms, n->relayed ? "true" : "false", site);
        }
        kv_sb_printf(&b, "]}");
    }
    pthread_mutex_unlock(&h->mu);
    kv_sb_printf(&b, "]}\n");
    free(cnt);
    free(who);
    if (b.oom) {
        free(b.p);
        return kv_fail(d, KV_ENOMEM, "placement: out of memory");
    }
    *out = b.p;
    *len = b.n;
    return 0;
}

int kv_hub_placement_json(kv_hub *h, char **out, size_t *len, kv_diag *d) {
    return kv_hub_placement_render(h, -1, out, len, d);
}

int kv_hub_inject_node(kv_hub *h, const uint8_t pk[32], const char *addr, const uint32_t *slab_idx, size_t n,
                       int64_t last_seen_ms, kv_diag *d) {
    for (size_t i = 0; i < n; i++)
        if (slab_idx[i] >= h->m->n_slabs) return kv_fail(d, KV_ERANGE, "inject: slab %u out of range", slab_idx[i]);
    uint32_t *sl = malloc((n ? n : 1) * sizeof *sl);
    if (!sl) return kv_fail(d, KV_ENOMEM, "inject: out of memory");
    memcpy(sl, slab_idx, n * sizeof *sl);
    pthread_mutex_lock(&h->mu);
    kv_hub_node *nd = kv_node_find(h, pk);
    if (!nd) nd = kv_node_add(h, pk);
    if (!nd) {
        pthread_mutex_unlock(&h->mu);
        free(sl);
        return kv_fail(d, KV_ENOMEM, "inject: out of memory");
    }
    if (kv_node_take_slabs(nd, sl, n, false)) {
        pthread_mutex_unlock(&h->mu);
        free(sl);
        return kv_fail(d, KV_ENOMEM, "inject: out of memory");
    }
    kv_node_set_addr(nd, addr);
    if (n) memset(nd->proven, 1, n); /* injected nodes are the benchmark's own: taken as proven */
    nd->proven_ms = 1;
    nd->passes = 2;
    nd->probe_due_ms = INT64_MAX; /* and never dialed */
    snprintf(nd->backend, sizeof nd->backend, "bench");
    nd->last_seen_ms = last_seen_ms;
    pthread_mutex_unlock(&h->mu);
    return 0;
}

/* ---- HTTP plumbing -------------------------------------------------------- */

typedef struct kv_req {
    char *body;     /* [n] accumulated upload */
    size_t n, cap;
    bool too_big;   /* body over the bound (or a body where none belongs) */
    bool answered;  /* the refusal is queued */
    size_t discarded; /* bytes dropped since too_big */
} kv_req;

/* A body's parse may hold at most this many times max_body, plus 1 MiB: an
 * honest body costs about 3x its size while parsed; 1 MiB of "{}" would cost
 * tens of megabytes. */
#define KV_HUB_PARSE_FACTOR 4u

static size_t kv_parse_budget(const kv_hub *h) { return (size_t)KV_HUB_PARSE_FACTOR * h->o.max_body + (1u << 20); }

/* Whether body[n]'s JSON parses within the budget (a malformed body passes
 * here: its handler names what is wrong). */
static bool kv_parse_fits(const kv_hub *h, const char *body, size_t n) {
    kv_json_budget_begin(kv_parse_budget(h));
    json_t *j = json_loadb(body, n, 0, NULL);
    bool over = false;
    json_decref(j);
    kv_json_budget_end(&over);
    return !over;
}

static enum MHD_Result kv_reply(struct MHD_Connection *c, unsigned status, const char *type, char *body,
                                size_t n) {
    struct MHD_Response *r = MHD_create_response_from_buffer(n, body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type);
    MHD_add_response_header(r, "Cache-Control", "no-store");
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result kv_reply_json(struct MHD_Connection *c, unsigned status, json_t *j) {
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    if (!s) return MHD_NO;
    size_t n = strlen(s);
    return kv_reply(c, status, "application/json", s, n);
}

/* {"error": message, "code": "ENAME"} */
static enum MHD_Result kv_reply_err(struct MHD_Connection *c, unsigned status, int code, const char *msg) {
    json_t *j = json_object();
    json_object_set_new(j, "error", json_string(msg));
    json_object_set_new(j, "code", json_string(kv_err_name(code)));
    json_object_set_new(j, "status", json_integer(status));
    return kv_reply_json(c, status, j);
}

#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
static enum MHD_Result kv_reply_errf(struct MHD_Connection *c, unsigned status, int code, const char *fmt, ...) {
    kv_diag d = {0};
    va_list ap;
    va_start(ap, fmt);
    kv_vfail(&d, code, fmt, ap);
    va_end(ap);
    return kv_reply_err(c, status, code, d.msg);
}

static enum MHD_Result kv_reply_diag(struct MHD_Connection *c, unsigned status, const kv_diag *d) {
    return kv_reply_err(c, status, d->code ? d->code : KV_EINTERNAL, d->msg[0] ? d->msg : "error");
}

/* ---- pieces ---------------------------------------------------------------- */

static int kv_path_cmp(const void *a, const void *b) {
    return strcmp(((const kv_hub_path *)a)->path, ((const kv_hub_path *)b)->path);
}

static const kv_hub_path *kv_path_find(const kv_hub *h, const char *p) {
    kv_hub_path key = {.path = p};
    return bsearch(&key, h->paths, h->n_paths, sizeof key, kv_path_cmp);
}

/* A request path that would leave the folder if taken as a file name. */
static bool kv_path_escapes(const char *p) {
    if (p[0] == '/' || strchr(p, '\\')) return true;
    for (const char *s = p; *s;) {
        const char *e = strchr(s, '/');
        size_t l = e ? (size_t)(e - s) : strlen(s);
        if ((l == 2 && s[0] == '.' && s[1] == '.') || (l == 1 && s[0] == '.') || l == 0) return true;
        s += l + (e ? 1 : 0);
        if (e && !*s) return true;
    }
    return false;
}

static enum MHD_Result kv_serve_piece(kv_hub *h, struct MHD_Connection *c, const char *rel) {
    if (kv_path_escapes(rel))
        return kv_reply_err(c, MHD_HTTP_BAD_REQUEST, KV_EINVAL,
                            "piece path must be relative, without '.', '..', empty components or '\\'");
    const kv_hub_path *p = kv_path_find(h, rel);
    if (!p) return kv_reply_errf(c, MHD_HTTP_NOT_FOUND, KV_ENOTFOUND, "no piece '%.200s' in the manifest", rel);
    const char *range = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_RANGE);
    uint64_t off = 0, len = p->size;
    bool partial = false;
    if (range) {
        kv_diag d = {0};
        int rc = kv_hub_parse_range(range, p->size, &off, &len, &d);
        if (rc == KV_ERANGE) {
            json_t *j = json_object();
            json_object_set_new(j, "error", json_string(d.msg));
            json_object_set_new(j, "code", json_string("ERANGE"));
            char *s = json_dumps(j, JSON_COMPACT);
            json_decref(j);
            if (!s) return MHD_NO;
            struct MHD_Response *r = MHD_create_response_from_buffer(strlen(s), s, MHD_RESPMEM_MUST_FREE);
            if (!r) {
                free(s);
                return MHD_NO;
            }
            char cr[64];
            snprintf(cr, sizeof cr, "bytes */%" PRIu64, p->size);
            MHD_add_response_header(r, "Content-Range", cr);
            MHD_add_response_header(r, "Content-Type", "application/json");
            enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_RANGE_NOT_SATISFIABLE, r);
            MHD_destroy_response(r);
            return ret;
        }
        if (rc) return kv_reply_diag(c, MHD_HTTP_BAD_REQUEST, &d);
        partial = true;
    }
    int fd = openat(h->dir_fd, p->path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) || (uint64_t)st.st_size != p->size) {
        if (fd >= 0) close(fd);
        return kv_reply_errf(c, MHD_HTTP_INTERNAL_SERVER_ERROR, KV_EIO, "piece '%s' is missing or has changed size",
                             p->path);
    }
    struct MHD_Response *r = MHD_create_response_from_fd_at_offset64(len, fd, off);
    if (!r) {
        close(fd);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Accept-Ranges", "bytes");
    MHD_add_response_header(r, "Content-Type", "application/octet-stream");
    if (p->sha256) {
        char et[68];
        et[0] = '"';
        kv_hex(p->sha256, 32, et + 1);
        et[65] = '"';
        et[66] = 0;
        MHD_add_response_header(r, "ETag", et);
    }
    if (partial) {
        char cr[96];
        snprintf(cr, sizeof cr, "bytes %" PRIu64 "-%" PRIu64 "/%" PRIu64, off, off + len - 1, p->size);
        MHD_add_response_header(r, "Content-Range", cr);
    }
    enum MHD_Result ret = MHD_queue_response(c, partial ? MHD_HTTP_PARTIAL_CONTENT : MHD_HTTP_OK, r);
    MHD_destroy_response(r);
    return ret;
}

/* ---- signed requests ------------------------------------------------------ */

typedef struct kv_signed {
    uint8_t pk[32];
    uint64_t counter;
} kv_signed;

/* Parses and verifies the signature headers over (method, url, body). */
static int kv_check_sig(struct MHD_Connection *c, const char *method, const char *url, const kv_req *q,
                        kv_signed *s, kv_diag *d) {
    uint8_t sig[64];
    int rc = kv_hub_parse_auth(MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Kvasir-Key"),
                               MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Kvasir-Counter"),
                               MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Kvasir-Signature"), s->pk,
                               &s->counter, sig, d);
    if (rc) return rc;
    if (kv_hub_verify(s->pk, sig, method, url, q->body, q->n, s->counter))
        return kv_fail(d, KV_EPROTO, "bad signature (not made by X-Kvasir-Key over this method, path, counter "
                                     "and body)");
    return 0;
}

/* Picks a slab the node holds and a fresh nonce; caller holds mu. */
static void kv_challenge_issue(kv_hub_node *n, int64_t now) {
    if (!n->n_slabs) return;
    n->ch_slab = n->slabs[randombytes_uniform((uint32_t)n->n_slabs)];
    randombytes_buf(n->ch_nonce, sizeof n->ch_nonce);
    n->ch_issued_ms = now;
    n->ch_pending = true;
    n->beats = 0;
}

static void kv_challenge_json(const kv_hub *h, const kv_hub_node *n, json_t *out) {
    if (!n->ch_pending) return;
    const kv_manifest_slab *s = &h->m->slabs[n->ch_slab];
    uint64_t off, len;
    kv_hub_challenge_range(n->ch_nonce, s->file.size, &off, &len);
    char hex[65];
    kv_hex(n->ch_nonce, 32, hex);
    json_t *c = json_object();
    json_object_set_new(c, "nonce", json_string(hex));
    json_object_set_new(c, "layer", json_integer(s->layer));
    json_object_set_new(c, "first", json_integer(s->first));
    json_object_set_new(c, "last", json_integer(s->last));
    json_object_set_new(c, "path", json_string(s->file.path));
    json_object_set_new(c, "offset", json_integer((json_int_t)off));
    json_object_set_new(c, "length", json_integer((json_int_t)len));
    json_object_set_new(c, "expires_ms", json_integer(n->ch_issued_ms + h->o.challenge_ttl_ms));
    json_object_set_new(out, "challenge", c);
}

/* Drops a node's holdings (store first), keeping it registered; moves its
 * counter on and, when last_seen_ms >= 0, its last heartbeat. */
static int kv_node_drop(kv_hub *h, kv_hub_node *n, uint64_t counter, int64_t last_seen_ms, kv_diag *d) {
    int rc = h->store.ops->node_drop_shards(h->store.impl, n->pk, counter, last_seen_ms, d);
    if (rc) return rc;
    kv_node_take_slabs(n, NULL, 0, false); /* never fails for none */
    n->counter = counter;
    if (last_seen_ms >= 0) n->last_seen_ms = last_seen_ms;
    n->ch_pending = false;
    return 0;
}

/* HTTP status for a failed conditional store write (store.h codes). */
static unsigned kv_store_http(int rc) {
    return rc == KV_EPROTO ? MHD_HTTP_CONFLICT : rc == KV_ENOTFOUND ? MHD_HTTP_NOT_FOUND
                                                                    : MHD_HTTP_INTERNAL_SERVER_ERROR;
}

/* Shared store: loads node pk from the store into memory; caller holds mu.
 * NULL when the store has no such node (or it could not be loaded: *rc). */
static kv_hub_node *kv_node_fetch(kv_hub *h, const uint8_t pk[32], int *rc, kv_diag *d) {
    *rc = KV_ENOTFOUND;
    if (!h->shared || h->n_nodes >= KV_HUB_MAX_NODES) return NULL;
    *rc = h->store.ops->node_get(h->store.impl, pk, kv_node_reload, h, d);
    return *rc ? NULL : kv_node_find(h, pk);
}

/* Registrations per address and per subnet: other keys that hold shards
 * at the same host (at most max_per_host) or in the same subnet (at most
 * max_per_subnet, loopback exempt: one machine is one host), not counting
 * nodes whose heartbeats stopped. Keys are free; addresses are not. 0, or
 * KV_ERANGE with d saying which limit. Caller holds mu. */
static int kv_register_limits(const kv_hub *h, const kv_hub_node *self, const char *host, const char *subnet,
                              int64_t now, kv_diag *d) {
    uint32_t at_host = 0, in_subnet = 0;
    const bool lo = kv_hub_addr_loopback(host);
    for (size_t k = 0; k < h->n_nodes; k++) {
        const kv_hub_node *o = &h->nodes[k];
        if (o == self || !kv_node_live(h, o, now)) continue;
        at_host += !strcmp(o->host, host);
        in_subnet += !lo && !strcmp(o->subnet, subnet);
    }
    if (at_host >= h->o.max_per_host)
        return kv_fail(d, KV_ERANGE, "address %s already has %u live nodes (at most %u per address)", host, at_host,
                       h->o.max_per_host);
    if (in_subnet >= h->o.max_per_subnet)
        return kv_fail(d, KV_ERANGE, "subnet %s already has %u live nodes (at most %u per subnet)", subnet,
                       in_subnet, h->o.max_per_subnet);
    return 0;
}

/* A register/heartbeat answer tells node n whether the hub reaches it only
 * through the relay ("relayed") and where the relay is ("relay": its port on
 * the hub's host and its fingerprint, the hub's own), so that a node the hub
 * cannot dial connects out to it. Caller holds mu. */
static void kv_relay_json(const kv_hub *h, const kv_hub_node *n, json_t *j) {
    if (!h->relay) return;
    json_object_set_new(j, "relayed", json_boolean(n->relayed));
    json_t *r = json_object();
    json_object_set_new(r, "port", json_integer(kv_hub_relay_port(h->relay)));
    json_object_set_new(r, "sha256", json_string(kv_hub_relay_fp(h->relay)));
    json_object_set_new(j, "relay", r);
}

static enum MHD_Result kv_do_register(kv_hub *h, struct MHD_Connection *c, const kv_signed *s, const kv_req *q) {
    kv_diag d = {0};
    kv_hub_announce a;
    if (kv_hub_parse_announce(&a, q->body ? q->body : "", q->n, &d)) return kv_reply_diag(c, MHD_HTTP_BAD_REQUEST, &d);
    enum MHD_Result ret;
    uint32_t *sl = malloc((a.n_shards ? a.n_shards : 1) * sizeof *sl);
    if (!sl) {
        kv_hub_announce_free(&a);
        return kv_reply_err(c, MHD_HTTP_INTERNAL_SERVER_ERROR, KV_ENOMEM, "out of memory");
    }
    char host[48], subnet[48];
    if (kv_hub_addr_subnet(a.addr, host, sizeof host, subnet, sizeof subnet, &d)) {
        ret = kv_reply_diag(c, MHD_HTTP_UNPROCESSABLE_CONTENT, &d);
        goto out;
    }
    if (!a.n_shards) {
        /* a node that holds nothing has nothing to register for, and an empty
         * registration would let anyone fill the registry for free */
        ret = kv_reply_err(c, MHD_HTTP_UNPROCESSABLE_CONTENT, KV_EINVAL, "announcement lists no shards");
        goto out;
    }
    for (size_t i = 0; i < a.n_shards; i++) {
        const kv_hub_held *e = &a.shards[i];
        int64_t k = kv_slab_find(h->m, e->layer, e->first, e->last);
        if (k < 0) {
            ret = kv_reply_errf(c, MHD_HTTP_UNPROCESSABLE_CONTENT, KV_ENOTFOUND,
                                "shard layer %u experts %u-%u is not a slab of model %.16s", e->layer, e->first,
                                e->last, h->m->model_id);
            goto out;
        }
        const kv_manifest_file *f = &h->m->slabs[k].file;
        if (!f->has_sha256 || memcmp(f->sha256, e->sha256, 32)) {
            ret = kv_reply_errf(c, MHD_HTTP_UNPROCESSABLE_CONTENT, KV_EHASH,
                                "shard layer %u experts %u-%u: sha256 %s the manifest's", e->layer, e->first,
                                e->last, f->has_sha256 ? "differs from" : "cannot be checked: no hash in");
            goto out;
        }
        sl[i] = (uint32_t)k; /* shards are sorted by (layer, first): so are the indices */
    }
    int64_t now = kv_now_ms();
    pthread_mutex_lock(&h->mu);
    uint32_t slot;
    memcpy(&slot, a.nonce, 4);
    kv_hub_nonce *nc = &h->nonces[slot % KV_HUB_MAX_NONCES];
    kv_hub_node *n = kv_node_find(h, s->pk);
    int frc = 0;
    if (!n && !(n = kv_node_fetch(h, s->pk, &frc, &d)) && frc != KV_ENOTFOUND) {
        pthread_mutex_unlock(&h->mu);
        ret = kv_reply_diag(c, MHD_HTTP_INTERNAL_SERVER_ERROR, &d);
        goto out;
    }
    /* a shared store checks and consumes the nonce in node_put */
    if (!h->shared && (!nc->live || memcmp(nc->nonce, a.nonce, 32) || nc->expires_ms < now)) {
        pthread_mutex_unlock(&h->mu);
        ret = kv_reply_err(c, MHD_HTTP_CONFLICT, KV_EPROTO,
                           "registration nonce is unknown, used or expired (GET /v1/nonce for a fresh one)");
        goto out;
    }
    if (n && n->reported) {
        pthread_mutex_unlock(&h->mu);
        ret = kv_reply_err(c, MHD_HTTP_FORBIDDEN, KV_EAUTH, "this node was reported for wrong answers and is unlisted");
        goto out;
    }
    if (n && s->counter <= n->counter) {
        pthread_mutex_unlock(&h->mu);
        ret = kv_reply_errf(c, MHD_HTTP_CONFLICT, KV_EPROTO,
                            "replayed or stale request: counter %" PRIu64 " <= last accepted %" PRIu64, s->counter,
                            n->counter);
        goto out;
    }
    if (!n && h->n_nodes >= KV_HUB_MAX_NODES) {
        pthread_mutex_unlock(&h->mu);
        ret = kv_reply_errf(c, MHD_HTTP_SERVICE_UNAVAILABLE, KV_ERANGE, "hub is full (%u nodes)", KV_HUB_MAX_NODES);
        goto out;
    }
    if (kv_register_limits(h, n, host, subnet, now, &d)) {
        pthread_mutex_unlock(&h->mu);
        ret = kv_reply_diag(c, 429, &d);
        goto out;
    }
    kv_hub_node tmp = {0};
    memcpy(tmp.pk, s->pk, 32);
    memcpy(tmp.addr, a.addr, sizeof tmp.addr);
    memcpy(tmp.backend, a.backend, sizeof tmp.backend);
    memcpy(tmp.site, a.site, sizeof tmp.site);
    tmp.memory = a.memory;
    tmp.counter = s->counter;
    tmp.last_seen_ms = tmp.registered_ms = now;
    int wrc = kv_node_store_put(h, &tmp, sl, a.n_shards, h->shared ? a.nonce : NULL, now, &d);
    if (wrc) {
        pthread_mutex_unlock(&h->mu);
        if (wrc == KV_ENOTFOUND) /* the shared store's nonce check */
            ret = kv_reply_err(c, MHD_HTTP_CONFLICT, KV_EPROTO,
                               "registration nonce is unknown, used or expired (GET /v1/nonce for a fresh one)");
        else
            ret = kv_reply_diag(c, kv_store_http(wrc), &d);
        goto out;
    }
    if (!n && !(n = kv_node_add(h, s->pk))) {
        /* stored but not in memory: reload on restart picks it up */
        pthread_mutex_unlock(&h->mu);
        ret = kv_reply_err(c, MHD_HTTP_INTERNAL_SERVER_ERROR, KV_ENOMEM, "out of memory");
        goto out;
    }
    if (!h->shared) nc->live = false;
    /* the proof of what is kept (same address, same slab) stays */
    const bool same = n->host[0] && kv_hub_same_host_addr(n->host, tmp.addr);
    if (kv_node_take_slabs(n, sl, a.n_shards, same)) {
        pthread_mutex_unlock(&h->mu);
        ret = kv_reply_err(c, MHD_HTTP_INTERNAL_SERVER_ERROR, KV_ENOMEM, "out of memory");
        goto out;
    }
    sl = NULL;
    kv_node_set_addr(n, tmp.addr);
    memcpy(n->backend, tmp.backend, sizeof n->backend);
    memcpy(n->site, tmp.site, sizeof n->site);
    n->memory = tmp.memory;
    n->counter = tmp.counter;
    n->last_seen_ms = tmp.last_seen_ms;
    n->registered_ms = tmp.registered_ms;
    n->ch_pending = false;
    n->beats = 0;
    n->probe_due_ms = now; /* prove what is new at once */
    n->fails = 0;
    pthread_cond_broadcast(&h->prove_cv);
    kv_challenge_issue(n, now);
    json_t *j = json_object();
    json_object_set_new(j, "ok", json_true());
    json_object_set_new(j, "shards", json_integer((json_int_t)n->n_slabs));
    json_object_set_new(j, "deadline_ms", json_integer(h->o.deadline_ms));
    kv_relay_json(h, n, j);
    kv_challenge_json(h, n, j);
    pthread_mutex_unlock(&h->mu);
    ret = kv_reply_json(c, MHD_HTTP_OK, j);
out:
    free(sl);
    kv_hub_announce_free(&a);
    return ret;
}

/* Finds the signer and checks its counter; on success returns with mu held. */
static kv_hub_node *kv_lock_signer(kv_hub *h, struct MHD_Connection *c, const kv_signed *s, enum MHD_Result *ret) {
    pthread_mutex_lock(&h->mu);
    kv_hub_node *n = kv_node_find(h, s->pk);
    int frc = 0;
    kv_diag d = {0};
    if (!n && !(n = kv_node_fetch(h, s->pk, &frc, &d)) && frc != KV_ENOTFOUND) {
        pthread_mutex_unlock(&h->mu);
        *ret = kv_reply_diag(c, MHD_HTTP_INTERNAL_SERVER_ERROR, &d);
        return NULL;
    }
    if (!n) {
        pthread_mutex_unlock(&h->mu);
        *ret = kv_reply_err(c, MHD_HTTP_NOT_FOUND, KV_ENOTFOUND, "unknown node: register first (POST /v1/register)");
        return NULL;
    }
    if (s->counter <= n->counter) {
        uint64_t last = n->counter;
        pthread_mutex_unlock(&h->mu);
        *ret = kv_reply_errf(c, MHD_HTTP_CONFLICT, KV_EPROTO,
                             "replayed or stale request: counter %" PRIu64 " <= last accepted %" PRIu64, s->counter,
                             last);
        return NULL;
    }
    return n;
}

/* A report of served totals: rates from the difference with the last one
 * (a total that went down is a restarted node: no rate this time). */
static void kv_node_served(kv_hub_node *n, const kv_hub_beat *b, int64_t now) {
    if (!b->has) return;
    if (n->served_ms && now > n->served_ms && b->served_pairs >= n->served_pairs &&
        b->served_tokens >= n->served_tokens) {
        const double dt = (double)(now - n->served_ms) / 1000.0;
        n->pairs_per_s = (double)(b->served_pairs - n->served_pairs) / dt;
        n->tokens_per_s = (double)(b->served_tokens - n->served_tokens) / dt;
    } else {
        n->pairs_per_s = n->tokens_per_s = 0;
    }
    n->served_pairs = b->served_pairs;
    n->served_tokens = b->served_tokens;
    n->served_ms = now;
}

static enum MHD_Result kv_do_heartbeat(kv_hub *h, struct MHD_Connection *c, const kv_signed *s, const kv_req *q) {
    enum MHD_Result ret;
    kv_diag d = {0};
    kv_hub_beat beat;
    if (kv_hub_parse_beat(&beat, q->body ? q->body : "", q->n, &d)) return kv_reply_diag(c, MHD_HTTP_BAD_REQUEST, &d);
    kv_hub_node *n = kv_lock_signer(h, c, s, &ret);
    if (!n) return ret;
    int64_t now = kv_now_ms();
    json_t *j = json_object();
    int wrc;
    if (n->ch_pending && now - n->ch_issued_ms > (int64_t)h->o.challenge_ttl_ms) {
        /* an unanswered storage challenge counts as a failed one */
        if ((wrc = kv_node_drop(h, n, s->counter, now, &d))) {
            pthread_mutex_unlock(&h->mu);
            json_decref(j);
            return kv_reply_diag(c, kv_store_http(wrc), &d);
        }
        json_object_set_new(j, "dropped", json_string("storage challenge not answered in time: holdings dropped"));
    } else if ((wrc = h->store.ops->node_touch(h->store.impl, n->pk, s->counter, now, &d))) {
        pthread_mutex_unlock(&h->mu);
        json_decref(j);
        return kv_reply_diag(c, kv_store_http(wrc), &d);
    }
    n->counter = s->counter;
    n->last_seen_ms = now;
    kv_node_served(n, &beat, now);
    if (!n->ch_pending && ++n->beats >= h->o.challenge_every) kv_challenge_issue(n, now);
    json_object_set_new(j, "ok", json_true());
    json_object_set_new(j, "shards", json_integer((json_int_t)n->n_slabs));
    json_object_set_new(j, "live_until_ms", json_integer(now + h->o.deadline_ms));
    kv_relay_json(h, n, j);
    kv_challenge_json(h, n, j);
    pthread_mutex_unlock(&h->mu);
    return kv_reply_json(c, MHD_HTTP_OK, j);
}

static enum MHD_Result kv_do_answer(kv_hub *h, struct MHD_Connection *c, const kv_signed *s, const kv_req *q) {
    kv_diag d = {0};
    uint8_t nonce[32], ans[32], want[32];
    if (kv_hub_parse_answer(q->body ? q->body : "", q->n, nonce, ans, &d)) return kv_reply_diag(c, MHD_HTTP_BAD_REQUEST, &d);
    enum MHD_Result ret;
    kv_hub_node *n = kv_lock_signer(h, c, s, &ret);
    if (!n) return ret;
    if (!n->ch_pending || memcmp(n->ch_nonce, nonce, 32)) {
        pthread_mutex_unlock(&h->mu);
        return kv_reply_err(c, MHD_HTTP_CONFLICT, KV_EPROTO, "no pending storage challenge with this nonce");
    }
    const kv_manifest_slab *sl = &h->m->slabs[n->ch_slab];
    if (kv_hub_challenge_answer_at(h->dir_fd, sl->file.path, sl->file.size, n->ch_nonce, want, &d)) {
        pthread_mutex_unlock(&h->mu);
        return kv_reply_diag(c, MHD_HTTP_INTERNAL_SERVER_ERROR, &d);
    }
    int wrc;
    if (sodium_memcmp(want, ans, 32) == 0) {
        if ((wrc = h->store.ops->node_touch(h->store.impl, n->pk, s->counter, -1, &d))) {
            pthread_mutex_unlock(&h->mu);
            return kv_reply_diag(c, kv_store_http(wrc), &d);
        }
        n->counter = s->counter;
        n->ch_pending = false;
        pthread_mutex_unlock(&h->mu);
        json_t *j = json_object();
        json_object_set_new(j, "ok", json_true());
        return kv_reply_json(c, MHD_HTTP_OK, j);
    }
    uint32_t L = sl->layer, F = sl->first, T = sl->last;
    if ((wrc = kv_node_drop(h, n, s->counter, -1, &d))) {
        pthread_mutex_unlock(&h->mu);
        return kv_reply_diag(c, kv_store_http(wrc), &d);
    }
    pthread_mutex_unlock(&h->mu);
    return kv_reply_errf(c, MHD_HTTP_UNPROCESSABLE_CONTENT, KV_EHASH,
                         "storage challenge failed for layer %u experts %u-%u: holdings dropped", L, F, T);
}

static enum MHD_Result kv_do_nonce(kv_hub *h, struct MHD_Connection *c) {
    uint8_t nonce[32];
    int64_t now = kv_now_ms();
    pthread_mutex_lock(&h->mu);
    if (h->shared) {
        /* every hub on the store can take it: the store keeps the ring */
        kv_diag d = {0};
        randombytes_buf(nonce, 32);
        int rc = h->store.ops->nonce_put(h->store.impl, nonce, now + KV_HUB_NONCE_TTL_MS, &d);
        pthread_mutex_unlock(&h->mu);
        if (rc) return kv_reply_diag(c, MHD_HTTP_INTERNAL_SERVER_ERROR, &d);
    } else {
        uint32_t slot = h->nonce_next++ % KV_HUB_MAX_NONCES;
        memcpy(nonce, &slot, 4);
        randombytes_buf(nonce + 4, 28);
        kv_hub_nonce *e = &h->nonces[slot];
        memcpy(e->nonce, nonce, 32);
        e->expires_ms = now + KV_HUB_NONCE_TTL_MS;
        e->live = true;
        pthread_mutex_unlock(&h->mu);
    }
    char hex[65];
    kv_hex(nonce, 32, hex);
    json_t *j = json_object();
    json_object_set_new(j, "nonce", json_string(hex));
    json_object_set_new(j, "ttl_ms", json_integer(KV_HUB_NONCE_TTL_MS));
    return kv_reply_json(c, MHD_HTTP_OK, j);
}

static enum MHD_Result kv_do_status(kv_hub *h, struct MHD_Connection *c) {
    kv_diag d = {0};
    if (kv_hub_refresh(h, &d)) return kv_reply_diag(c, MHD_HTTP_SERVICE_UNAVAILABLE, &d);
    int64_t now = kv_now_ms();
    pthread_mutex_lock(&h->mu);
    size_t n_live = 0;
    for (size_t k = 0; k < h->n_nodes; k++) n_live += kv_node_live(h, &h->nodes[k], now);
    json_t *j = json_object();
    json_object_set_new(j, "model_id", json_string(h->m->model_id));
    json_object_set_new(j, "shards", json_integer((json_int_t)h->m->n_slabs));
    json_object_set_new(j, "nodes", json_integer((json_int_t)h->n_nodes));
    json_object_set_new(j, "live_nodes", json_integer((json_int_t)n_live));
    json_object_set_new(j, "store", json_string(h->store.ops->name));
    char hk[65];
    kv_hex(h->hub_pk, 32, hk);
    json_object_set_new(j, "hub_key", json_string(hk));
    if (h->relay) {
        size_t n_rel = 0;
        for (size_t k = 0; k < h->n_nodes; k++) n_rel += h->nodes[k].relayed && kv_node_live(h, &h->nodes[k], now);
        json_t *r = json_object();
        json_object_set_new(r, "port", json_integer(kv_hub_relay_port(h->relay)));
        json_object_set_new(r, "sha256", json_string(kv_hub_relay_fp(h->relay)));
        json_object_set_new(r, "relayed_nodes", json_integer((json_int_t)n_rel));
        json_object_set_new(j, "relay", r);
    }
    pthread_mutex_unlock(&h->mu);
    return kv_reply_json(c, MHD_HTTP_OK, j);
}

/* GET /metrics: Prometheus text: the registry's gauges, the prover's
 * counters and, with a relay, its kvasir_relay_* lines. */
static enum MHD_Result kv_do_metrics(kv_hub *h, struct MHD_Connection *c) {
    const int64_t now = kv_now_ms();
    size_t n_live = 0, n_rel = 0;
    pthread_mutex_lock(&h->mu);
    for (size_t k = 0; k < h->n_nodes; k++) {
        const bool live = kv_node_live(h, &h->nodes[k], now);
        n_live += live;
        n_rel += live && h->nodes[k].relayed;
    }
    const size_t n_nodes = h->n_nodes;
    const uint64_t ok = h->probes_ok, failed = h->probes_failed;
    pthread_mutex_unlock(&h->mu);
    kv_sb b = {0};
    kv_sb_printf(&b, "# HELP kvasir_hub_nodes Nodes registered.\n# TYPE kvasir_hub_nodes gauge\nkvasir_hub_nodes %zu\n"
                 "# HELP kvasir_hub_live_nodes Nodes whose last heartbeat is within the deadline.\n"
                 "# TYPE kvasir_hub_live_nodes gauge\nkvasir_hub_live_nodes %zu\n"
                 "# HELP kvasir_hub_relayed_nodes Live nodes the hub reaches only through its relay.\n"
                 "# TYPE kvasir_hub_relayed_nodes gauge\nkvasir_hub_relayed_nodes %zu\n"
                 "# HELP kvasir_hub_probes_total Proof-of-service probes, by outcome.\n"
                 "# TYPE kvasir_hub_probes_total counter\nkvasir_hub_probes_total{outcome=\"ok\"} %" PRIu64 "\n"
                 "kvasir_hub_probes_total{outcome=\"failed\"} %" PRIu64 "\n",
                 n_nodes, n_live, n_rel, ok, failed);
    if (h->relay && !b.oom) {
        kv_relay_stats rs;
        kv_hub_relay_stats(h->relay, &rs);
        const size_t need = kv_relay_stats_prometheus(&rs, NULL, 0);
        char *t = malloc(need + 1);
        if (t) {
            kv_relay_stats_prometheus(&rs, t, need + 1);
            kv_sb_printf(&b, "%s", t);
            free(t);
        } else {
            b.oom = 1;
        }
    }
    if (b.oom) {
        free(b.p);
        return MHD_NO;
    }
    return kv_reply(c, MHD_HTTP_OK, "text/plain; version=0.0.4", b.p, b.n);
}

static int kv_key_cmp(const void *a, const void *b) { return memcmp(a, b, 32); }

/* POST /v1/voucher, signed by the coordinator key to vouch for: the hub
 * signs (model, key, expiry) if the key is approved (listed by the
 * operator, or any key with vouch_open). Stateless: a replayed request only
 * yields another voucher for the same key, useless without its secret. */
static enum MHD_Result kv_do_voucher(kv_hub *h, struct MHD_Connection *c, const kv_signed *s) {
    char hex[65];
    kv_hex(s->pk, 32, hex);
    if (!h->o.vouch_open && !(h->n_vouch && bsearch(s->pk, h->vouch, h->n_vouch, sizeof *h->vouch, kv_key_cmp)))
        return kv_reply_errf(c, MHD_HTTP_FORBIDDEN, KV_EAUTH,
                             "this hub does not vouch for coordinator key %.16s... (its operator lists the keys it "
                             "vouches for with --vouch-key)", hex);
    const uint64_t exp = (uint64_t)kv_now_ms() + h->o.voucher_ttl_ms;
    uint8_t sig[64];
    kv_voucher_sign(h->hub_sk, h->m->model_id, s->pk, exp, sig);
    char sh[129], hk[65];
    kv_hex(sig, 64, sh);
    kv_hex(h->hub_pk, 32, hk);
    json_t *j = json_object();
    json_object_set_new(j, "key", json_string(hex));
    json_object_set_new(j, "model_id", json_string(h->m->model_id));
    json_object_set_new(j, "expires_ms", json_integer((json_int_t)exp));
    json_object_set_new(j, "sig", json_string(sh));
    json_object_set_new(j, "hub_key", json_string(hk));
    return kv_reply_json(c, MHD_HTTP_OK, j);
}

/* The hub's signing key: its seed in the store (made on first open). */
static int kv_hub_load_key(kv_hub *h, kv_diag *d) {
    char seedhex[80];
    uint8_t seed[32];
    int rc = h->store.ops->meta_get(h->store.impl, "hub_key_seed", seedhex, sizeof seedhex, d);
    if (rc) return rc;
    if (!seedhex[0]) {
        randombytes_buf(seed, 32);
        kv_hex(seed, 32, seedhex);
        /* of hubs starting together on a shared store the first seed wins */
        if ((rc = h->store.ops->meta_put_new(h->store.impl, "hub_key_seed", seedhex, d)) ||
            (rc = h->store.ops->meta_get(h->store.impl, "hub_key_seed", seedhex, sizeof seedhex, d)))
            return rc;
    }
    if (kv_key_from_hex(seedhex, seed, NULL)) {
        return kv_fail(d, KV_EFORMAT, "hub: the store's hub_key_seed is not 64 hex digits");
    }
    crypto_sign_seed_keypair(h->hub_pk, h->hub_sk, seed);
    sodium_memzero(seed, sizeof seed);
    sodium_memzero(seedhex, sizeof seedhex);
    return 0;
}

const uint8_t *kv_hub_key(const kv_hub *h) { return h->hub_pk; }
/* GET /v1/nodes: every registered node, what it holds and serves, and the
 * swarm's rates (docs/HUB.md). Node fields need no escaping (addr and
 * backend are from the announcement's character sets). earned_micro_kvr
 * is present only when opts.earned answers for the node. */
static int kv_hub_nodes_render(kv_hub *h, char **out, size_t *len, kv_diag *d) {
    *out = NULL;
    const kv_manifest *m = h->m;
    uint32_t n_moe = 0;
    for (uint32_t L = 0; L + m->n_layer_nextn < m->n_layer; L++) n_moe += m->moe_layer[L] ? 1 : 0;
    /* earnings come from outside (the ledger): looked up without the
       registry lock, for the nodes known now, matched by key below */
    size_t n_earn = 0;
    uint8_t (*pks)[32] = NULL;
    uint64_t *earn = NULL;
    uint8_t *has = NULL;
    if (h->o.earned) {
        pthread_mutex_lock(&h->mu);
        n_earn = h->n_nodes;
        pks = malloc((n_earn ? n_earn : 1) * 32);
        if (pks)
            for (size_t k = 0; k < n_earn; k++) memcpy(pks[k], h->nodes[k].pk, 32);
        pthread_mutex_unlock(&h->mu);
        earn = calloc(n_earn ? n_earn : 1, sizeof *earn);
        has = calloc(n_earn ? n_earn : 1, 1);
        if (!pks || !earn || !has) {
            free(pks);
            free(earn);
            free(has);
            return kv_fail(d, KV_ENOMEM, "nodes: out of memory");
        }
        for (size_t k = 0; k < n_earn; k++) has[k] = h->o.earned(h->o.earned_arg, pks[k], &earn[k]) == 0;
    }
    const int64_t now = kv_now_ms();
    kv_sb b = {0};
    double pairs_s = 0, rows_s = 0;
    size_t n_live = 0;
    kv_sb_printf(&b, "{\"model_id\":\"%s\",\"now_ms\":%" PRId64 ",\"deadline_ms\":%u,\"n_layer\":%u,"
                 "\"n_expert\":%u,\"n_expert_used\":%u,\"moe_layers\":%u,\"nodes\":[", m->model_id, now,
                 h->o.deadline_ms, m->n_layer, m->n_expert, m->n_expert_used, n_moe);
    pthread_mutex_lock(&h->mu);
    for (size_t k = 0; k < h->n_nodes; k++) {
        const kv_hub_node *n = &h->nodes[k];
        const bool live = kv_node_live(h, n, now);
        /* a node that stopped beating serves nothing now */
        const double ps = live ? n->pairs_per_s : 0, ts = live ? n->tokens_per_s : 0;
        n_live += live;
        pairs_s += ps;
        rows_s += ts;
        char hex[65];
        kv_hex(n->pk, 32, hex);
        kv_sb_printf(&b, "%s{\"key\":\"%s\",\"addr\":\"%s\",\"backend\":\"%s\",\"memory\":%" PRIu64
                     ",\"live\":%s,\"last_seen_ms\":%" PRId64 ",\"registered_ms\":%" PRId64 ",\"served_pairs\":%"
                     PRIu64 ",\"served_tokens\":%" PRIu64 ",\"pairs_per_s\":%.3f,\"tokens_per_s\":%.3f",
                     k ? "," : "", hex, n->addr, n->backend, n->memory, live ? "true" : "false", n->last_seen_ms,
                     n->registered_ms, n->served_pairs, n->served_tokens, ps, ts);
        size_t np = 0;
        for (size_t i = 0; i < n->n_slabs; i++) np += kv_node_slab_ok(h, n, i);
        kv_sb_printf(&b, ",\"proven_shards\":%zu,\"challenges_passed\":%u,\"prove_error\":\"%s\",\"relayed\":%s", np,
                     n->passes, n->prove_err, n->relayed ? "true" : "false");
        char site[64];
        kv_node_site(n, site, sizeof site);
        kv_sb_printf(&b, ",\"site\":\"%s\",\"site_given\":%s", site, n->site[0] ? "true" : "false");
        if (n->rtt_ms >= 0) kv_sb_printf(&b, ",\"rtt_ms\":%.3f", n->rtt_ms);
        if (k < n_earn && has[k] && !memcmp(pks[k], n->pk, 32))
            kv_sb_printf(&b, ",\"earned_micro_kvr\":%" PRIu64, earn[k]);
        kv_sb_printf(&b, ",\"shards\":[");
        for (size_t i = 0; i < n->n_slabs; i++) {
            const kv_manifest_slab *sl = &m->slabs[n->slabs[i]];
            kv_sb_printf(&b, "%s[%u,%u,%u]", i ? "," : "", sl->layer, sl->first, sl->last);
        }
        kv_sb_printf(&b, "]}");
    }
    pthread_mutex_unlock(&h->mu);
    free(pks);
    free(earn);
    free(has);
    /* every token through the swarm (prompt or generated, from any
       coordinator) costs n_expert_used expert computations per MoE layer */
    const double per_tok = (double)n_moe * (m->n_expert_used ? m->n_expert_used : 1);
    kv_sb_printf(&b, "],\"live_nodes\":%zu,\"pairs_per_s\":%.3f,\"rows_per_s\":%.3f,\"tokens_per_s\":%.3f",
                 n_live, pairs_s, rows_s, per_tok > 0 ? pairs_s / per_tok : 0.0);
    if (h->relay) { /* the relay's traffic, for the status page */
        kv_relay_stats rs;
        kv_hub_relay_stats(h->relay, &rs);
        kv_sb_printf(&b, ",\"relay\":{\"port\":%u,\"nodes\":%" PRIu64 ",\"circuits\":%" PRIu64
                     ",\"circuits_total\":%" PRIu64 ",\"bytes_to_node\":%" PRIu64 ",\"bytes_to_coord\":%" PRIu64
                     ",\"refused_circuits\":%" PRIu64 "}", kv_hub_relay_port(h->relay), rs.nodes, rs.circuits,
                     rs.circuits_total, rs.bytes_to_node, rs.bytes_to_coord, rs.refused_circuits);
    }
    kv_sb_printf(&b, "}\n");
    if (b.oom) {
        free(b.p);
        return kv_fail(d, KV_ENOMEM, "nodes: out of memory");
    }
    *out = b.p;
    *len = b.n;
    return 0;
}

int kv_hub_nodes_json(kv_hub *h, char **out, size_t *len, kv_diag *d) { return kv_hub_nodes_render(h, out, len, d); }

/* GET /v1/sites: a snapshot of the live nodes (workers: their proven slabs)
 * taken under the lock, rendered outside it (sites.c). */
int kv_hub_sites_json(kv_hub *h, char **out, size_t *len, kv_diag *d) {
    *out = NULL;
    int rc = kv_hub_refresh(h, d);
    if (rc) return rc;
    const int64_t now = kv_now_ms();
    pthread_mutex_lock(&h->mu);
    size_t ns = 0, nn = 0;
    for (size_t k = 0; k < h->n_nodes; k++)
        if (kv_node_live(h, &h->nodes[k], now)) nn++, ns += h->nodes[k].n_slabs;
    kv_hub_site_node *sn = calloc(nn ? nn : 1, sizeof *sn);
    uint32_t *sl = malloc((ns ? ns : 1) * sizeof *sl);
    if (!sn || !sl) {
        pthread_mutex_unlock(&h->mu);
        free(sn);
        free(sl);
        return kv_fail(d, KV_ENOMEM, "sites: out of memory");
    }
    size_t j = 0, o = 0;
    for (size_t k = 0; k < h->n_nodes; k++) {
        const kv_hub_node *n = &h->nodes[k];
        if (!kv_node_live(h, n, now)) continue;
        kv_hub_site_node *x = &sn[j++];
        kv_node_site(n, x->site, sizeof x->site);
        x->given = n->site[0] != 0;
        x->ring = kv_node_is_ring(n);
        x->rtt_ms = n->rtt_ms;
        memcpy(x->pk, n->pk, 32);
        memcpy(x->addr, n->addr, sizeof x->addr);
        x->slabs = sl + o;
        for (size_t i = 0; i < n->n_slabs; i++)
            if (x->ring || kv_node_slab_ok(h, n, i)) sl[o + x->n_slabs++] = n->slabs[i];
        o += x->n_slabs;
    }
    pthread_mutex_unlock(&h->mu);
    rc = kv_hub_sites_render(h->m, sn, nn, out, len, d);
    free(sn);
    free(sl);
    return rc;
}

/* Judges a report's evidence (its signature already checked): recomputes
 * the expert from the hub's own slab on the signed x and compares with the
 * signed y. Returns 1 when y is wrong beyond the tolerance (a lie), 0 when
 * it is right, or a negative code (d says why: no such expert, the slab
 * cannot be read). A y sent in f16/bf16 is compared with the hub's answer
 * rounded the same way, with one unit in the last place of that encoding
 * added to the tolerance (two honest answers may round apart). */
static int kv_report_judge(kv_hub *h, const kv_evidence *ev, double *err, kv_diag *d) {
    const kv_manifest *m = h->m;
    if (ev->n_embd != m->n_embd)
        return kv_fail(d, KV_EINVAL, "evidence rows of %u values, this model's n_embd is %u", ev->n_embd, m->n_embd);
    uint32_t slab = UINT32_MAX;
    for (uint32_t i = 0; i < m->n_slabs && slab == UINT32_MAX; i++)
        if (m->slabs[i].layer == ev->layer && ev->expert >= m->slabs[i].first && ev->expert <= m->slabs[i].last) slab = i;
    if (slab == UINT32_MAX)
        return kv_fail(d, KV_EINVAL, "evidence names layer %u expert %u, which no slab of this model holds", ev->layer,
                       ev->expert);
    const uint32_t E = ev->n_embd, yenc = (ev->out_enc & KV_OUT_PREACT) ? KV_ENC_F32 : ev->out_enc;
    float *x = malloc(sizeof(float) * E * 3), *want = x + E, *got = want + E;
    if (!x) return kv_fail(d, KV_ENOMEM, "report: out of memory");
    const kv_msg_compute cm = {.enc = ev->enc, .n_tokens = 1, .n_embd = E, .n_pairs = 1, .x_wire = ev->x};
    kv_msg_compute_row(&cm, 0, x);
    const kv_msg_result yr = {.n_pairs = 1, .n_embd = E, .enc = yenc, .y_wire = ev->y};
    kv_msg_result_row(&yr, 0, got);
    int rc = kv_hub_prove_expect(h->dir_fd, m, slab, ev->expert, x, want, d);
    double tol = KV_HUB_PROVE_TOL;
    if (!rc && yenc != KV_ENC_F32) { /* as the worker would have sent it */
        uint8_t *t = malloc((size_t)E * 4);
        if (!t) rc = kv_fail(d, KV_ENOMEM, "report: out of memory");
        else {
            kv_msg_rows_put(t, yenc, want, E);
            const kv_msg_result wr = {.n_pairs = 1, .n_embd = E, .enc = yenc, .y_wire = t};
            kv_msg_result_row(&wr, 0, want);
            free(t);
            tol += yenc == KV_ENC_F16 ? 1.0 / 1024 : 1.0 / 128;
        }
    }
    if (!rc) {
        kv_hub_prove_judge(want, got, E, err);
        rc = !(*err <= tol);
    }
    free(x);
    return rc;
}

/* POST /v1/report, signed by a coordinator the hub vouches for, carrying
 * the worker's signed answer for one pair (docs/HUB.md "Reports"). The hub
 * checks that the worker signed it for this very reporter, recomputes the
 * expert, and only when the signed answer is wrong does the node with that
 * key lose its holdings (stored) and may not register again while this hub
 * runs, so the placement map stops listing it. A report without evidence,
 * with evidence that does not verify, or about a right answer changes
 * nothing. */
static enum MHD_Result kv_do_report(kv_hub *h, struct MHD_Connection *c, const kv_signed *s, const kv_req *q) {
    kv_diag d = {0};
    kv_hub_report rp;
    if (kv_hub_parse_report(q->body ? q->body : "", q->n, &rp, &d)) return kv_reply_diag(c, MHD_HTTP_BAD_REQUEST, &d);
    const uint8_t *key = rp.key;
    const char *reason = rp.reason;
    char hex[65], by[65];
    kv_hex(key, 32, hex);
    kv_hex(s->pk, 32, by);
    if (!h->o.vouch_open && !(h->n_vouch && bsearch(s->pk, h->vouch, h->n_vouch, sizeof *h->vouch, kv_key_cmp))) {
        kv_hub_report_free(&rp);
        return kv_reply_err(c, MHD_HTTP_FORBIDDEN, KV_EAUTH, "only coordinators this hub vouches for may report nodes");
    }
    pthread_mutex_lock(&h->mu);
    const bool known = kv_node_find(h, key) != NULL;
    pthread_mutex_unlock(&h->mu);
    if (!known) {
        kv_hub_report_free(&rp);
        return kv_reply_err(c, MHD_HTTP_NOT_FOUND, KV_ENOTFOUND, "no node with this key");
    }
    /* evidence: signed by that worker, for this reporter, and wrong */
    int vrc = 0;
    double err = 0;
    if (!rp.has_evidence) {
        vrc = kv_fail(&d, KV_EINVAL, "a report changes nothing without evidence: the worker's signed answer "
                                     "(dispatch v4) for the pair it was caught on");
    } else {
        memcpy(rp.ev->coord_key, s->pk, 32); /* signed for the reporter, or for nobody here */
        if (!(vrc = kv_evidence_check(rp.ev, h->m->model_id, &d))) vrc = kv_report_judge(h, rp.ev, &err, &d);
    }
    if (vrc <= 0) {
        kv_hub_report_free(&rp);
        if (!h->o.quiet)
            fprintf(stderr, "hub: report on node %.16s... by coordinator %.16s...: %s: nothing done\n", hex, by,
                    vrc ? d.msg : "its signed answer is right");
        if (vrc == KV_ENOMEM || vrc == KV_EIO || vrc == KV_EFORMAT || vrc == KV_EINTERNAL)
            return kv_reply_diag(c, MHD_HTTP_INTERNAL_SERVER_ERROR, &d);
        if (vrc) {
            json_t *j = json_object();
            json_object_set_new(j, "error", json_string(d.msg));
            json_object_set_new(j, "code", json_string(kv_err_name(vrc)));
            json_object_set_new(j, "action", json_string("none"));
            return kv_reply_json(c, MHD_HTTP_UNPROCESSABLE_CONTENT, j);
        }
        json_t *j = json_object();
        json_object_set_new(j, "ok", json_true());
        json_object_set_new(j, "action", json_string("none"));
        json_object_set_new(j, "error_rel", json_real(err));
        json_object_set_new(j, "why", json_string("the signed answer is right within the tolerance"));
        return kv_reply_json(c, MHD_HTTP_OK, j);
    }
    kv_hub_report_free(&rp);
    pthread_mutex_lock(&h->mu);
    kv_hub_node *n = kv_node_find(h, key);
    if (!n) {
        pthread_mutex_unlock(&h->mu);
        return kv_reply_err(c, MHD_HTTP_NOT_FOUND, KV_ENOTFOUND, "no node with this key");
    }
    /* the drop moves the node's counter on by one, like a request of its
     * own: the store's condition holds it against a racing heartbeat, and
     * hubs sharing the store take the drop into their views (a higher
     * counter); a node's counters come from its clock, so one step costs it
     * nothing. On a shared store another hub may have accepted a newer
     * request: reload the node and try once more. */
    int wrc = 0;
    for (int tries = 0; n->n_slabs && tries < 2; tries++) {
        if (n->counter >= (uint64_t)INT64_MAX) {
            wrc = kv_fail(&d, KV_ERANGE, "node counter at its maximum");
            break;
        }
        wrc = kv_node_drop(h, n, n->counter + 1, -1, &d);
        if (wrc != KV_EPROTO || !h->shared) break;
        if ((wrc = h->store.ops->node_get(h->store.impl, key, kv_node_reload, h, &d))) break;
        wrc = KV_EPROTO;
    }
    if (wrc) {
        pthread_mutex_unlock(&h->mu);
        return kv_reply_diag(c, MHD_HTTP_INTERNAL_SERVER_ERROR, &d);
    }
    n->reported = true;
    pthread_mutex_unlock(&h->mu);
    if (!h->o.quiet)
        fprintf(stderr, "hub: node %.16s... reported by coordinator %.16s...: %s: its signed answer is off by %.3g: "
                "unlisted\n", hex, by, reason, err);
    json_t *j = json_object();
    json_object_set_new(j, "ok", json_true());
    json_object_set_new(j, "action", json_string("unlisted"));
    json_object_set_new(j, "unlisted", json_string(hex));
    json_object_set_new(j, "error_rel", json_real(err));
    return kv_reply_json(c, MHD_HTTP_OK, j);
}

/* ---- demand -------------------------------------------------------------------- */

/* The address block a request came from (IPv4 /24, IPv6 /48), for the
 * demand budget of all keys behind one block. */
static void kv_client_block(struct MHD_Connection *c, char *out, size_t cap) {
    snprintf(out, cap, "?");
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (!ci || !ci->client_addr) return;
    char ip[INET6_ADDRSTRLEN], addr[INET6_ADDRSTRLEN + 8], host[48];
    const struct sockaddr *sa = ci->client_addr;
    if (sa->sa_family == AF_INET) {
        if (!inet_ntop(AF_INET, &((const struct sockaddr_in *)(const void *)sa)->sin_addr, ip, sizeof ip)) return;
        snprintf(addr, sizeof addr, "%s:1", ip);
    } else if (sa->sa_family == AF_INET6) {
        if (!inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr, ip, sizeof ip)) return;
        snprintf(addr, sizeof addr, "[%s]:1", ip);
    } else {
        return;
    }
    if (kv_hub_addr_subnet(addr, host, sizeof host, out, cap, NULL)) snprintf(out, cap, "%s", ip);
}

/* POST /v1/demand, signed by a coordinator the hub vouches for: the expert
 * computations it needed per shard, the time it waited for them and the
 * tokens they were for, since its last report (docs/HUB.md "Demand"). The
 * bounds, in order: the counter is the reporter's clock, within a window of
 * the hub's, and above its last report's (the store keeps it: a replay at
 * any hub of one store is refused); the tokens are charged to the key's and
 * its address block's budgets per window (granted may be fewer); the
 * computations and waiting are bounded by what the granted tokens can need
 * (kv_mkt_bound); a ring window's count for the shards of its own window
 * only (kv_mkt_keep_held). What is left goes into the shards' rates
 * (market.h), where a stranger key's share is capped. */
static enum MHD_Result kv_do_demand(kv_hub *h, struct MHD_Connection *c, const kv_signed *s, const kv_req *q) {
    kv_diag d = {0};
    const bool listed = h->n_vouch && bsearch(s->pk, h->vouch, h->n_vouch, sizeof *h->vouch, kv_key_cmp);
    if (!h->o.vouch_open && !listed)
        return kv_reply_err(c, MHD_HTTP_FORBIDDEN, KV_EAUTH, "only coordinators this hub vouches for may report "
                                                             "demand");
    kv_hub_demand rp;
    if (kv_hub_parse_demand(&rp, q->body ? q->body : "", q->n, &d)) return kv_reply_diag(c, MHD_HTTP_BAD_REQUEST, &d);
    const int64_t now = kv_now_ms(), at = (int64_t)(s->counter / 1000u);
    if (at < now - h->dbud.window_ms || at > now + h->dbud.window_ms) {
        kv_hub_demand_free(&rp);
        return kv_reply_errf(c, MHD_HTTP_CONFLICT, KV_EPROTO, "demand report: its counter (the reporter's clock, "
                             "microseconds) is more than %lld ms off the hub's clock", (long long)h->dbud.window_ms);
    }
    const size_t ns = h->m->n_slabs;
    double *acc = calloc(ns ? ns : 1, sizeof *acc), *wt = calloc(ns ? ns : 1, sizeof *wt), total = 0;
    int rc = !acc || !wt ? kv_fail(&d, KV_ENOMEM, "out of memory")
                         : kv_mkt_bound(h->m, &rp, 0, acc, wt, &total, &d); /* every shard the model's */
    if (rc) {
        free(acc);
        free(wt);
        kv_hub_demand_free(&rp);
        return kv_reply_diag(c, rc == KV_EINVAL ? MHD_HTTP_BAD_REQUEST : MHD_HTTP_INTERNAL_SERVER_ERROR, &d);
    }
    char block[48];
    kv_client_block(c, block, sizeof block);
    uint64_t granted = 0;
    pthread_mutex_lock(&h->mu);
    rc = h->store.ops->demand_charge(h->store.impl, s->pk, s->counter, block, now, &h->dbud, rp.tokens, &granted, &d);
    if (!rc) rc = kv_mkt_bound(h->m, &rp, granted, acc, wt, &total, &d); /* the check left both at 0 */
    const kv_hub_node *rn = rc ? NULL : kv_node_find(h, s->pk);
    if (rn && kv_node_is_ring(rn)) total = kv_mkt_keep_held(ns, rn->slabs, rn->n_slabs, acc, wt); /* its window only */
    if (rc) {
        pthread_mutex_unlock(&h->mu);
        free(acc);
        free(wt);
        kv_hub_demand_free(&rp);
        return kv_reply_diag(c, rc == KV_EPROTO ? MHD_HTTP_CONFLICT : MHD_HTTP_INTERNAL_SERVER_ERROR, &d);
    }
    int werr = 0;
    for (size_t i = 0; i < ns && !werr; i++) {
        if (acc[i] <= 0 && wt[i] <= 0) continue;
        for (int tries = 0; tries < 3; tries++) { /* a write another hub won: its state, then ours on top */
            kv_mkt_state st = h->mkt[i];
            kv_mkt_add(&h->pol, &st, now, acc[i], wt[i], listed ? NULL : s->pk);
            kv_mkt_step(&h->pol, &st, now);
            if ((rc = kv_mkt_write(h, i, &st, &d)) != KV_EPROTO) break;
        }
        werr = rc;
    }
    pthread_mutex_unlock(&h->mu);
    free(acc);
    free(wt);
    kv_hub_demand_free(&rp);
    if (werr) return kv_reply_diag(c, MHD_HTTP_INTERNAL_SERVER_ERROR, &d);
    json_t *j = json_object();
    json_object_set_new(j, "ok", json_true());
    json_object_set_new(j, "tokens", json_integer((json_int_t)granted));
    json_object_set_new(j, "computations", json_real(total));
    return kv_reply_json(c, MHD_HTTP_OK, j);
}

/* ---- proof of service: the prover threads ------------------------------------ */

/* The voucher the hub shows the workers it probes (it vouches for its own
 * key), renewed when less than half its life is left. Caller holds mu. */
static const kv_voucher *kv_self_voucher(kv_hub *h, int64_t now) {
    kv_voucher *v = &h->self_voucher;
    if (v->expires_ms < (uint64_t)now + h->o.voucher_ttl_ms / 2) {
        memcpy(v->key, h->hub_pk, 32);
        v->expires_ms = (uint64_t)now + h->o.voucher_ttl_ms;
        kv_voucher_sign(h->hub_sk, h->m->model_id, h->hub_pk, v->expires_ms, v->sig);
    }
    return v;
}

/* What one probe asks: up to KV_HUB_PROVE_TASKS slabs, unproven ones first
 * (every one after a report), else one held slab at random. */
typedef struct kv_probe_job {
    uint8_t pk[32];
    char addr[KV_HUB_MAX_ADDR + 1];
    uint32_t gen;
    bool relayed;      /* probed through the relay */
    uint32_t n;
    uint32_t slab[KV_HUB_PROVE_TASKS];
    kv_probe_task task[KV_HUB_PROVE_TASKS];
} kv_probe_job;

/* The node due first, marked probing with its job filled; NULL when none is
 * due (*next_ms: when the next one is). Caller holds mu. */
static kv_hub_node *kv_probe_pick(kv_hub *h, int64_t now, kv_probe_job *job, int64_t *next_ms) {
    kv_hub_node *pick = NULL;
    *next_ms = now + 1000;
    for (size_t k = 0; k < h->n_nodes; k++) {
        kv_hub_node *n = &h->nodes[k];
        if (n->probing || !n->n_slabs || n->reported || kv_node_is_ring(n) || !kv_node_live(h, n, now)) continue;
        if (n->probe_due_ms > now) {
            if (n->probe_due_ms < *next_ms) *next_ms = n->probe_due_ms;
        } else if (!pick || n->probe_due_ms < pick->probe_due_ms) {
            pick = n;
        }
    }
    if (!pick) return NULL;
    memcpy(job->pk, pick->pk, 32);
    memcpy(job->addr, pick->addr, sizeof job->addr);
    job->gen = pick->gen;
    job->relayed = pick->relayed && h->relay;
    job->n = 0;
    const uint32_t off = randombytes_uniform((uint32_t)pick->n_slabs);
    for (size_t t = 0; t < pick->n_slabs && job->n < KV_HUB_PROVE_TASKS; t++) {
        const size_t i = (off + t) % pick->n_slabs;
        if (!pick->proven[i] || pick->probe_all) job->slab[job->n++] = pick->slabs[i];
    }
    if (!job->n) job->slab[job->n++] = pick->slabs[off];
    for (uint32_t t = 0; t < job->n; t++) {
        const kv_manifest_slab *sl = &h->m->slabs[job->slab[t]];
        job->task[t] = (kv_probe_task){sl->layer, sl->first + randombytes_uniform(sl->last - sl->first + 1)};
    }
    pick->probing = true;
    return pick;
}

/* Records a probe's outcome on node pk if its holdings are still those the
 * job was made from: verdict 1 passed, 0 failed (a wrong answer, another
 * key, a bad frame: why), -2 late or unreachable (why), -1 the hub could not
 * make its own answer (nothing is judged; tried again later). unreachable:
 * the dial of the announced address itself failed (no connection). rtt_ms:
 * the probe's time per compute answer (< 0 none), which bounds the round
 * trip to the node from above. Caller holds mu. */
static void kv_probe_apply(kv_hub *h, const kv_probe_job *job, int verdict, bool unreachable, const char *why,
                           double rtt_ms, int64_t now) {
    kv_hub_node *n = kv_node_find(h, job->pk);
    if (!n) return;
    n->probing = false;
    if (n->gen != job->gen) { /* re-registered meanwhile: probe what it holds now */
        n->probe_due_ms = now;
        return;
    }
    if (verdict == -1) {
        if (!h->o.quiet) fprintf(stderr, "hub: %s\n", why);
        n->probe_due_ms = now + 60000;
        return;
    }
    if (verdict == -2 && n->proven_ms && !n->fails) {
        /* a listed node late or unreachable once (a loaded machine, a lost
         * packet) is asked again half a second later; a second miss in a row
         * unlists it, as a wrong answer does at once */
        n->fails = 1;
        n->probe_due_ms = now + 500;
        snprintf(n->prove_err, sizeof n->prove_err, "%s", why);
        for (char *c = n->prove_err; *c; c++)
            if (*c < 0x20 || *c >= 0x7f || *c == '"' || *c == '\\') *c = '?';
        return;
    }
    if (unreachable && h->relay && !n->relayed && !job->relayed) {
        /* the reachability check failed: the node is reached through the
         * relay from now on (it connects out when its next heartbeat's answer
         * says so) and listed once proven there */
        n->relayed = true;
        if (n->proven) memset(n->proven, 0, n->n_slabs);
        n->proven_ms = 0;
        n->passes = n->fails = 0;
        n->probe_due_ms = now + 1000;
        if (!h->o.quiet) {
            char hex[65];
            kv_hex(n->pk, 32, hex);
            fprintf(stderr, "hub: node %.16s... at %s cannot be dialed (%s): relayed\n", hex, n->addr, why);
        }
        snprintf(n->prove_err, sizeof n->prove_err, "not reachable at its address: relayed");
        return;
    }
    const bool ok = verdict > 0;
    if (ok) {
        for (uint32_t t = 0; t < job->n; t++)
            for (size_t i = 0; i < n->n_slabs; i++)
                if (n->slabs[i] == job->slab[t]) n->proven[i] = 1;
        if (!n->proven_ms) n->proven_ms = now;
        if (rtt_ms >= 0 && (n->rtt_ms < 0 || rtt_ms < n->rtt_ms)) n->rtt_ms = rtt_ms; /* the least seen at this host */
        n->passes += job->n;
        n->fails = 0;
        n->probe_all = false;
        n->prove_err[0] = 0;
        bool rest = false;
        for (size_t i = 0; i < n->n_slabs && !rest; i++) rest = !n->proven[i];
        /* the next challenge comes at a random time the node cannot plan for */
        const uint32_t every = h->o.prove_every_ms;
        n->probe_due_ms = rest ? now : now + every / 2 + randombytes_uniform(every ? every : 1);
        h->probes_ok++;
        return;
    }
    /* one wrong or late answer unlists every replica of the node until it
     * proves them again */
    if (n->proven) memset(n->proven, 0, n->n_slabs);
    n->proven_ms = 0;
    n->passes = 0;
    const uint32_t f = n->fails < 6 ? n->fails : 6;
    n->fails++;
    n->probe_due_ms = now + ((int64_t)1000 << f);
    if (!h->o.quiet && strcmp(n->prove_err, why)) {
        char hex[65];
        kv_hex(n->pk, 32, hex);
        fprintf(stderr, "hub: node %.16s... at %s not listed: %s\n", hex, n->addr, why);
    }
    snprintf(n->prove_err, sizeof n->prove_err, "%s", why);
    for (char *c = n->prove_err; *c; c++) /* served in JSON as it is */
        if (*c < 0x20 || *c >= 0x7f || *c == '"' || *c == '\\') *c = '?';
    h->probes_failed++;
}

static void *kv_hub_prover(void *arg) {
    kv_hub *h = arg;
    const uint32_t ne = h->m->n_embd;
    float *x = malloc((size_t)KV_HUB_PROVE_TASKS * ne * sizeof *x);
    float *want = malloc((size_t)KV_HUB_PROVE_TASKS * ne * sizeof *want);
    float *got = malloc((size_t)KV_HUB_PROVE_TASKS * ne * sizeof *got);
    kv_probe_job *job = malloc(sizeof *job);
    pthread_mutex_lock(&h->mu);
    while (!h->prove_stop) {
        const int64_t now = kv_now_ms();
        int64_t next = now;
        if (!x || !want || !got || !job || !kv_probe_pick(h, now, job, &next)) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            const int64_t wait = next > now ? next - now : 1000;
            const uint64_t ns = (uint64_t)ts.tv_nsec + (uint64_t)wait * 1000000u;
            ts.tv_sec += (time_t)(ns / 1000000000u);
            ts.tv_nsec = (long)(ns % 1000000000u);
            pthread_cond_timedwait(&h->prove_cv, &h->mu, &ts);
            continue;
        }
        const kv_voucher v = *kv_self_voucher(h, now);
        pthread_mutex_unlock(&h->mu);
        kv_diag d = {0};
        int rc = 0;
        /* the hub's own answers first: the deadline is the node's alone */
        for (uint32_t t = 0; t < job->n && !rc; t++) {
            kv_hub_prove_input(x + (size_t)t * ne, ne);
            rc = kv_hub_prove_expect(h->dir_fd, h->m, job->slab[t], job->task[t].expert, x + (size_t)t * ne,
                                     want + (size_t)t * ne, &d);
        }
        bool ok = false, unreachable = false;
        int verdict = -1;
        double rtt = -1;
        char why[160];
        /* a relayed node is dialed through a circuit of the hub's relay */
        kv_relay_proxy *px = NULL;
        if (!rc && job->relayed && (rc = kv_hub_relay_proxy(h->relay, job->pk, (int)h->o.prove_connect_ms, &px, &d))) {
            verdict = -2;
            snprintf(why, sizeof why, "relay: %.140s", d.msg);
        } else if (rc) { /* our own copy failed: nothing to judge the node by; try later */
            snprintf(why, sizeof why, "the hub cannot compute its challenge: %.120s", d.msg);
        } else {
            const char *paddr = px ? kv_relay_proxy_addr(px) : job->addr;
            kv_probe_opts po = {.addr = paddr, .model_id = h->m->model_id, .worker_key = job->pk,
                                .sk = h->hub_sk, .voucher = &v, .n_embd = ne,
                                .connect_ms = (int)h->o.prove_connect_ms, .answer_ms = (int)h->o.prove_deadline_ms};
            kv_probe_result pr;
            verdict = 0;
            rc = kv_probe_worker(&po, job->task, job->n, x, got, &pr, &d);
            if (rc) {
                snprintf(why, sizeof why, "%s%s: %.110s", px ? "through the relay: " : "",
                         pr.key_proven ? "compute challenge" : "key proof", d.msg);
                if (rc == KV_ETIMEOUT || rc == KV_EIO) verdict = -2;
                unreachable = !pr.connected;
            } else {
                ok = true;
                rtt = pr.task_min_ms > 0 ? pr.task_min_ms : -1;
                for (uint32_t t = 0; t < job->n && ok; t++) {
                    double err = 0;
                    if (!kv_hub_prove_judge(want + (size_t)t * ne, got + (size_t)t * ne, ne, &err)) {
                        ok = false;
                        snprintf(why, sizeof why, "wrong answer for layer %u expert %u (relative error %.3g)",
                                 job->task[t].layer, job->task[t].expert, err);
                    }
                }
            }
        }
        if (verdict == 0 && ok) verdict = 1;
        kv_relay_proxy_free(px); /* the probe's connection is closed: nothing waits */
        pthread_mutex_lock(&h->mu);
        kv_probe_apply(h, job, verdict, unreachable, ok ? "" : why, rtt, kv_now_ms());
    }
    pthread_mutex_unlock(&h->mu);
    free(x);
    free(want);
    free(got);
    free(job);
    return NULL;
}

/* ---- dispatch --------------------------------------------------------------- */

static enum MHD_Result kv_route(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                const char *version, const char *upload_data, size_t *upload_size, void **con_cls) {
    kv_hub *h = cls;
    kv_req *q = *con_cls;
    bool post = !strcmp(method, "POST");
    if (!q) {
        q = calloc(1, sizeof *q);
        if (!q) return MHD_NO;
        *con_cls = q;
        char why[96];
        if (!kv_http_lengths_ok(c, why, sizeof why)) { /* answered now: the body is not read */
            q->too_big = q->answered = true;
            return kv_reply_errf(c, MHD_HTTP_BAD_REQUEST, KV_EINVAL, "the request has %s", why);
        }
        if (post) {
            const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
            if (cl && (strlen(cl) > 12 || strtoull(cl, NULL, 10) > h->o.max_body)) {
                q->too_big = q->answered = true;
                return kv_reply_errf(c, MHD_HTTP_CONTENT_TOO_LARGE, KV_ERANGE, "request body over %u bytes",
                                     h->o.max_body);
            }
        }
        return MHD_YES;
    }
    if (*upload_size) {
        /* libmicrohttpd takes no answer while a body is arriving: an
         * overflowing (chunked) body is discarded until it ends, then
         * answered 413; one that goes on far past the bound closes the
         * connection instead */
        if (q->too_big || !post || *upload_size > h->o.max_body - q->n) {
            q->too_big = true;
            q->discarded += *upload_size;
            *upload_size = 0;
            return q->discarded > 4 * (size_t)h->o.max_body + (1u << 20) ? MHD_NO : MHD_YES;
        }
        if (q->n + *upload_size > q->cap) {
            size_t nc = q->cap ? q->cap : 4096;
            while (nc < q->n + *upload_size) nc *= 2;
            char *np = realloc(q->body, nc);
            if (!np) return MHD_NO;
            q->body = np;
            q->cap = nc;
        }
        memcpy(q->body + q->n, upload_data, *upload_size);
        q->n += *upload_size;
        *upload_size = 0;
        return MHD_YES;
    }
    if (q->too_big && q->answered) return MHD_YES;
    kv_http_guard_busy(h->guard, c); /* whole: no deadline while it is answered */
    if (q->too_big) {
        q->answered = true;
        if (!post) return kv_reply_errf(c, MHD_HTTP_BAD_REQUEST, KV_EINVAL, "a %.16s request takes no body", method);
        return kv_reply_errf(c, MHD_HTTP_CONTENT_TOO_LARGE, KV_ERANGE, "request body over %u bytes", h->o.max_body);
    }
    bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    if (get) {
        if (!strcmp(url, "/v1/manifest")) {
            char *s = malloc(h->manifest_len ? h->manifest_len : 1);
            if (!s) return MHD_NO;
            memcpy(s, h->manifest_json, h->manifest_len);
            return kv_reply(c, MHD_HTTP_OK, "application/json", s, h->manifest_len);
        }
        if (!strncmp(url, "/v1/pieces/", 11)) return kv_serve_piece(h, c, url + 11);
        if (!strcmp(url, "/v1/nonce")) return kv_do_nonce(h, c);
        if (!strcmp(url, "/v1/status")) return kv_do_status(h, c);
        if (!strcmp(url, "/metrics")) return kv_do_metrics(h, c);
        if (!strcmp(url, "/") || !strcmp(url, "/index.html")) {
            char *s = malloc(kv_status_page_len + 1);
            if (!s) return MHD_NO;
            memcpy(s, kv_status_page_data, kv_status_page_len);
            return kv_reply(c, MHD_HTTP_OK, "text/html; charset=utf-8", s, kv_status_page_len);
        }
        if (!strcmp(url, "/v1/nodes")) {
            kv_diag d = {0};
            char *s;
            size_t n;
            if (kv_hub_nodes_render(h, &s, &n, &d)) return kv_reply_diag(c, MHD_HTTP_INTERNAL_SERVER_ERROR, &d);
            return kv_reply(c, MHD_HTTP_OK, "application/json", s, n);
        }
        if (!strcmp(url, "/v1/ring")) {
            kv_diag d = {0};
            char *s = NULL;
            size_t n = 0;
            if (!h->n_rwin) return kv_reply_err(c, MHD_HTTP_NOT_FOUND, KV_ENOTFOUND, "this hub trades no ring windows");
            if (kv_hub_ring_render(h, &s, &n, &d)) return kv_reply_diag(c, MHD_HTTP_INTERNAL_SERVER_ERROR, &d);
            return kv_reply(c, MHD_HTTP_OK, "application/json", s, n);
        }
        if (!strcmp(url, "/v1/market") || !strcmp(url, "/v1/placement")) {
            kv_diag d = {0};
            char *s;
            size_t n;
            int rc;
            if (url[4] == 'm') {
                rc = kv_hub_market_json(h, &s, &n, &d);
            } else {
                int64_t layer = -1;
                const char *ls = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "layer");
                if (ls) {
                    char *e;
                    errno = 0;
                    long v = strtol(ls, &e, 10);
                    if (!*ls || *e || errno || v < 0 || v >= (long)h->m->n_layer)
                        return kv_reply_errf(c, MHD_HTTP_BAD_REQUEST, KV_EINVAL, "layer must be in [0, %u)",
                                             h->m->n_layer);
                    layer = v;
                }
                rc = kv_hub_placement_render(h, layer, &s, &n, &d);
            }
            if (rc) return kv_reply_diag(c, rc == KV_EIO ? MHD_HTTP_SERVICE_UNAVAILABLE : MHD_HTTP_INTERNAL_SERVER_ERROR, &d);
            return kv_reply(c, MHD_HTTP_OK, "application/json", s, n);
        }
        if (!strcmp(url, "/v1/sites")) {
            kv_diag d = {0};
            char *s;
            size_t n;
            const int rc = kv_hub_sites_json(h, &s, &n, &d);
            if (rc) return kv_reply_diag(c, rc == KV_EIO ? MHD_HTTP_SERVICE_UNAVAILABLE : MHD_HTTP_INTERNAL_SERVER_ERROR, &d);
            return kv_reply(c, MHD_HTTP_OK, "application/json", s, n);
        }
        if (!strcmp(url, "/v1/register") || !strcmp(url, "/v1/heartbeat") || !strcmp(url, "/v1/challenge") ||
            !strcmp(url, "/v1/voucher") || !strcmp(url, "/v1/report") || !strcmp(url, "/v1/demand"))
            return kv_reply_errf(c, MHD_HTTP_METHOD_NOT_ALLOWED, KV_EINVAL, "%s needs POST", url);
        return kv_reply_errf(c, MHD_HTTP_NOT_FOUND, KV_ENOTFOUND, "no such endpoint '%.200s'", url);
    }
    if (!post) return kv_reply_errf(c, MHD_HTTP_METHOD_NOT_ALLOWED, KV_EINVAL, "method %.16s not allowed", method);
    int which = !strcmp(url, "/v1/register") ? 1 : !strcmp(url, "/v1/heartbeat") ? 2 : !strcmp(url, "/v1/challenge") ? 3
                : !strcmp(url, "/v1/voucher") ? 4 : !strcmp(url, "/v1/report") ? 5 : !strcmp(url, "/v1/demand") ? 6 : 0;
    if (!which) return kv_reply_errf(c, MHD_HTTP_NOT_FOUND, KV_ENOTFOUND, "no such endpoint '%.200s'", url);
    /* a body that would cost more memory to parse than its budget is refused
       before any handler parses it; the handlers then run under the budget */
    if (q->n > 4096 && !kv_parse_fits(h, q->body, q->n))
        return kv_reply_errf(c, MHD_HTTP_CONTENT_TOO_LARGE, KV_ERANGE,
                             "the JSON body needs more than %zu bytes of memory to parse (too many values or nesting "
                             "for its size)", kv_parse_budget(h));
    kv_diag d = {0};
    kv_signed s;
    if (kv_check_sig(c, method, url, q, &s, &d)) return kv_reply_diag(c, MHD_HTTP_UNAUTHORIZED, &d);
    kv_json_budget_begin(kv_parse_budget(h));
    enum MHD_Result ret;
    if (which == 1) ret = kv_do_register(h, c, &s, q);
    else if (which == 2) ret = kv_do_heartbeat(h, c, &s, q);
    else if (which == 4) ret = kv_do_voucher(h, c, &s);
    else if (which == 5) ret = kv_do_report(h, c, &s, q);
    else if (which == 6) ret = kv_do_demand(h, c, &s, q);
    else ret = kv_do_answer(h, c, &s, q);
    kv_json_budget_end(NULL);
    return ret;
}

static void kv_done(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    kv_hub *h = cls;
    kv_req *q = *con_cls;
    kv_http_guard_idle(h->guard, c); /* a kept-alive connection's next request: its deadline starts */
    const size_t freed = q ? q->cap : 0;
    if (q) {
        free(q->body);
        free(q);
    }
    *con_cls = NULL;
    kv_http_release_memory(freed >= (256u << 10)); /* after a burst of big bodies RSS falls again */
}

/* ---- open / serve / free ------------------------------------------------------ */

static int kv_node_reload(void *arg, const kv_hub_node_rec *r) {
    kv_hub *h = arg;
    kv_hub_node *n = kv_node_find(h, r->pk);
    if (!n && !(n = kv_node_add(h, r->pk))) return KV_ENOMEM;
    uint32_t *sl = malloc((r->n_shards ? r->n_shards : 1) * sizeof *sl);
    if (!sl) return KV_ENOMEM;
    size_t k = 0;
    for (size_t i = 0; i < r->n_shards; i++) {
        int64_t x = kv_slab_find(h->m, r->shards[i].layer, r->shards[i].first, r->shards[i].last);
        /* a holding that no longer matches the manifest's bytes is not served */
        if (x >= 0 && h->m->slabs[x].file.has_sha256 && !memcmp(h->m->slabs[x].file.sha256, r->shards[i].sha256, 32))
            sl[k++] = (uint32_t)x;
    }
    char addr[KV_HUB_MAX_ADDR + 1];
    memcpy(addr, r->addr, sizeof addr);
    addr[KV_HUB_MAX_ADDR] = 0;
    const bool same = n->host[0] && kv_hub_same_host_addr(n->host, addr), moved = strcmp(n->addr, addr) != 0;
    if (kv_node_take_slabs(n, sl, k, same)) {
        free(sl);
        return KV_ENOMEM;
    }
    kv_node_set_addr(n, addr);
    memcpy(n->backend, r->backend, sizeof n->backend);
    memcpy(n->site, r->site, sizeof n->site);
    n->site[KV_HUB_MAX_SITE] = 0;
    n->memory = r->memory;
    n->counter = r->counter;
    n->last_seen_ms = r->last_seen_ms;
    n->registered_ms = r->registered_ms;
    if (moved) n->probe_due_ms = 0; /* prove the new address at once */
    return 0;
}

static int kv_read_file(const char *path, size_t max, char **out, size_t *len, kv_diag *d) {
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return kv_fail(d, KV_EIO, "hub: cannot open '%s': %s", path, strerror(errno));
    char *b = malloc(max + 1);
    if (!b) {
        fclose(f);
        return kv_fail(d, KV_ENOMEM, "hub: out of memory");
    }
    size_t n = fread(b, 1, max + 1, f);
    fclose(f);
    if (n > max) {
        free(b);
        return kv_fail(d, KV_ERANGE, "hub: '%s' is larger than %zu bytes", path, max);
    }
    *out = b;
    *len = n;
    return 0;
}

static int kv_parse_listen(const char *listen, struct sockaddr_storage *ss, socklen_t *sl, kv_diag *d) {
    char host[256];
    const char *colon = strrchr(listen, ':');
    if (!colon || (size_t)(colon - listen) >= sizeof host || colon == listen)
        return kv_fail(d, KV_EINVAL, "hub: --listen '%s' must be HOST:PORT", listen);
    memcpy(host, listen, (size_t)(colon - listen));
    host[colon - listen] = 0;
    char *h = host;
    if (h[0] == '[' && h[strlen(h) - 1] == ']') {
        h[strlen(h) - 1] = 0;
        h++;
    }
    char *e;
    long port = strtol(colon + 1, &e, 10);
    if (!colon[1] || *e || port < 0 || port > 65535)
        return kv_fail(d, KV_EINVAL, "hub: --listen '%s': port must be 0..65535", listen);
    struct addrinfo hints = {.ai_flags = AI_NUMERICSERV | AI_PASSIVE, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    char ps[8];
    snprintf(ps, sizeof ps, "%ld", port);
    int g = getaddrinfo(h, ps, &hints, &ai);
    if (g || !ai) return kv_fail(d, KV_EINVAL, "hub: --listen '%s': %s", listen, gai_strerror(g));
    memcpy(ss, ai->ai_addr, ai->ai_addrlen);
    *sl = ai->ai_addrlen;
    freeaddrinfo(ai);
    return 0;
}

/* Hashes a piece and compares with the manifest: the hub answers storage
 * challenges from these files, so serving other bytes would fail honest
 * nodes. */
static int kv_piece_verify(kv_hub *h, const kv_hub_path *p, kv_diag *d) {
    int fd = openat(h->dir_fd, p->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kv_fail(d, KV_EIO, "hub: cannot open piece '%s': %s", p->path, strerror(errno));
    enum { CHUNK = 1 << 20 };
    uint8_t *buf = malloc(CHUNK), got[32];
    if (!buf) {
        close(fd);
        return kv_fail(d, KV_ENOMEM, "hub: out of memory");
    }
    kv_sha256 s;
    kv_sha256_init(&s);
    uint64_t done = 0;
    int rc = 0;
    while (done < p->size) {
        ssize_t r = pread(fd, buf, CHUNK, (off_t)done);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            rc = kv_fail(d, KV_EIO, "hub: short read of piece '%s'", p->path);
            break;
        }
        kv_sha256_update(&s, buf, (size_t)r);
        done += (uint64_t)r;
    }
    close(fd);
    free(buf);
    if (rc) {
        kv_sha256_discard(&s);
        return rc;
    }
    kv_sha256_final(&s, got);
    if (memcmp(got, p->sha256, 32))
        return kv_fail(d, KV_EHASH, "hub: piece '%s' does not match the manifest's SHA-256 (refusing to serve it)",
                       p->path);
    return 0;
}

/* The relay on the API's port hands each connection that is not a relay
 * client's to the HTTP server (the relay's thread; MHD closes fd on failure,
 * and its accept policy, the guard, still applies). */
static void kv_hub_http_adopt(void *data, int fd, const struct sockaddr *sa, unsigned sa_len) {
    kv_hub *h = data;
    pthread_mutex_lock(&h->adopt_mu);
    if (!h->http_open) close(fd); /* stopping */
    else if (MHD_add_connection(h->mhd, fd, sa, (socklen_t)sa_len) != MHD_YES && !h->o.quiet)
        fprintf(stderr, "hub: the HTTP server refused a connection\n");
    pthread_mutex_unlock(&h->adopt_mu);
}

static unsigned kv_sockaddr_port(const struct sockaddr_storage *ss) {
    return ss->ss_family == AF_INET6 ? ntohs(((const struct sockaddr_in6 *)ss)->sin6_port)
                                     : ntohs(((const struct sockaddr_in *)ss)->sin_port);
}

int kv_hub_open(kv_hub **out, const kv_hub_opts *opts, kv_diag *d) {
    *out = NULL;
    if (!opts->manifest || !opts->db) return kv_fail(d, KV_EINVAL, "hub: needs a manifest and a store");
    if (sodium_init() < 0) return kv_fail(d, KV_EINTERNAL, "hub: libsodium failed to start");
    kv_hub *h = calloc(1, sizeof *h);
    if (!h) return kv_fail(d, KV_ENOMEM, "hub: out of memory");
    h->dir_fd = -1;
    h->stop_pipe[0] = h->stop_pipe[1] = -1;
    pthread_mutex_init(&h->mu, NULL);
    pthread_mutex_init(&h->refresh_mu, NULL);
    pthread_mutex_init(&h->adopt_mu, NULL);
    pthread_cond_init(&h->refresh_cv, NULL);
    h->o = *opts;
    if (!h->o.listen) h->o.listen = "127.0.0.1:0";
    if (!h->o.wanted) h->o.wanted = 2;
    if (!h->o.deadline_ms) h->o.deadline_ms = 15000;
    if (!h->o.reward_base) h->o.reward_base = 1000000;
    if (!h->o.max_body) h->o.max_body = KV_HUB_MAX_BODY;
    if (!h->o.max_conns) h->o.max_conns = 1024;
    if (!h->o.per_ip_conns) h->o.per_ip_conns = 16;
    if (!h->o.conn_timeout_s) h->o.conn_timeout_s = 30;
    if (!h->o.request_s) h->o.request_s = 15;
    if (!h->o.threads) h->o.threads = 4;
    if (!h->o.challenge_every) h->o.challenge_every = 12;
    if (!h->o.challenge_ttl_ms) h->o.challenge_ttl_ms = 60000;
    if (!h->o.refresh_ms) h->o.refresh_ms = 250;
    if (!h->o.max_per_host) h->o.max_per_host = 32;
    if (!h->o.max_per_subnet) h->o.max_per_subnet = 128;
    if (!h->o.prove_threads) h->o.prove_threads = 2;
    if (h->o.prove_threads > KV_HUB_MAX_PROVERS) h->o.prove_threads = KV_HUB_MAX_PROVERS;
    if (!h->o.prove_connect_ms) h->o.prove_connect_ms = 2000;
    if (!h->o.prove_deadline_ms) h->o.prove_deadline_ms = 1500;
    if (!h->o.prove_every_ms) h->o.prove_every_ms = 60000;
    if (!h->o.trust_ms) h->o.trust_ms = 600000;
    pthread_cond_init(&h->prove_cv, NULL);
    int rc;
    kv_mkt_policy_default(&h->pol, h->o.wanted, h->o.reward_base);
    if (h->o.wanted_max) h->pol.ceiling = h->o.wanted_max;
    if (h->o.demand_per_replica != 0) h->pol.per_replica = h->o.demand_per_replica;
    if (h->o.demand_half_life_ms) h->pol.half_life_ms = h->o.demand_half_life_ms;
    if (h->o.market_raise_ms) h->pol.raise_ms = h->o.market_raise_ms;
    if (h->o.market_hold_ms) h->pol.hold_ms = h->o.market_hold_ms;
    if (h->o.demand_share != 0) h->pol.share = h->o.demand_share;
    h->dbud = (kv_demand_budget){.window_ms = h->o.demand_window_ms ? h->o.demand_window_ms : 60000,
                                 .key_tokens = h->o.demand_key_tokens ? h->o.demand_key_tokens : 600000};
    h->dbud.net_tokens = h->o.demand_net_tokens ? h->o.demand_net_tokens
                         : h->dbud.key_tokens > UINT64_MAX / 4 ? UINT64_MAX : 4 * h->dbud.key_tokens;
    if ((rc = kv_mkt_policy_check(&h->pol, d))) goto fail;
    /* the bytes served and the manifest parsed are read from the same path
     * (the parse through the slices module's own loader, so the format keeps
     * one owner); the folder is the hub's, not replaced while it starts */
    if ((rc = kv_read_file(opts->manifest, KV_MANIFEST_MAX_BYTES, &h->manifest_json, &h->manifest_len, d)) ||
        (rc = kv_manifest_load(&h->m, opts->manifest, d)))
        goto fail;
    {
        char dir[4096];
        snprintf(dir, sizeof dir, "%s", opts->manifest);
        char *sl = strrchr(dir, '/');
        if (sl) *sl = 0; else snprintf(dir, sizeof dir, ".");
        if (!dir[0]) snprintf(dir, sizeof dir, "/");
        h->dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (h->dir_fd < 0) {
            rc = kv_fail(d, KV_EIO, "hub: cannot open folder '%s': %s", dir, strerror(errno));
            goto fail;
        }
    }
    h->n_paths = h->m->n_slabs + 1;
    h->paths = calloc(h->n_paths, sizeof *h->paths);
    h->mkt = calloc(h->m->n_slabs ? h->m->n_slabs : 1, sizeof *h->mkt);
    h->nonces = calloc(KV_HUB_MAX_NONCES, sizeof *h->nonces);
    if (!h->paths || !h->mkt || !h->nonces) {
        rc = kv_fail(d, KV_ENOMEM, "hub: out of memory");
        goto fail;
    }
    if (h->o.ring_windows && (rc = kv_hub_parse_windows(h, h->o.ring_windows, d))) goto fail;
    h->paths[0] = (kv_hub_path){h->m->backbone.path, -1, h->m->backbone.size,
                                h->m->backbone.has_sha256 ? h->m->backbone.sha256 : NULL};
    for (size_t i = 0; i < h->m->n_slabs; i++) {
        const kv_manifest_file *f = &h->m->slabs[i].file;
        h->paths[i + 1] = (kv_hub_path){f->path, (int64_t)i, f->size, f->has_sha256 ? f->sha256 : NULL};
        kv_mkt_state_init(&h->pol, &h->mkt[i]);
    }
    qsort(h->paths, h->n_paths, sizeof *h->paths, kv_path_cmp);
    for (size_t i = 0; i < h->n_paths; i++) {
        struct stat st;
        if (fstatat(h->dir_fd, h->paths[i].path, &st, 0) || !S_ISREG(st.st_mode) ||
            (uint64_t)st.st_size != h->paths[i].size) {
            rc = kv_fail(d, KV_ENOTFOUND, "hub: piece '%s' is missing or not %" PRIu64 " bytes", h->paths[i].path,
                         h->paths[i].size);
            goto fail;
        }
        if (h->paths[i].sha256 && !h->o.skip_verify && (rc = kv_piece_verify(h, &h->paths[i], d))) goto fail;
        if (i && !strcmp(h->paths[i - 1].path, h->paths[i].path)) {
            rc = kv_fail(d, KV_EFORMAT, "hub: manifest names '%s' twice", h->paths[i].path);
            goto fail;
        }
    }
    if ((rc = kv_hub_store_open(&h->store, opts->db, d))) goto fail;
    h->shared = h->store.ops->shared;
    if (h->shared && (rc = kv_hub_store_open(&h->rstore, opts->db, d))) goto fail;
    {
        char mid[128];
        if ((rc = h->store.ops->meta_get(h->store.impl, "model_id", mid, sizeof mid, d))) goto fail;
        if (!mid[0]) {
            /* read back: on a shared store another hub may have put its own meanwhile */
            if ((rc = h->store.ops->meta_put_new(h->store.impl, "model_id", h->m->model_id, d)) ||
                (rc = h->store.ops->meta_get(h->store.impl, "model_id", mid, sizeof mid, d)))
                goto fail;
        }
        if (strcmp(mid, h->m->model_id)) {
            rc = kv_fail(d, KV_EINVAL, "hub: store '%s' belongs to model %.16s..., not %.16s...", opts->db, mid,
                         h->m->model_id);
            goto fail;
        }
    }
    if ((rc = kv_hub_load_key(h, d))) goto fail;
    if (opts->n_vouch_keys) {
        if (!(h->vouch = malloc(opts->n_vouch_keys * sizeof *h->vouch))) {
            rc = kv_fail(d, KV_ENOMEM, "hub: out of memory");
            goto fail;
        }
        memcpy(h->vouch, opts->vouch_keys, opts->n_vouch_keys * sizeof *h->vouch);
        qsort(h->vouch, opts->n_vouch_keys, sizeof *h->vouch, kv_key_cmp);
        h->n_vouch = opts->n_vouch_keys;
    }
    h->o.vouch_keys = NULL;
    if (!h->o.voucher_ttl_ms) h->o.voucher_ttl_ms = 3600000;
    if ((rc = h->store.ops->node_each(h->store.impl, kv_node_reload, h, d))) {
        if (rc == KV_ENOMEM) kv_fail(d, rc, "hub: out of memory reloading nodes");
        goto fail;
    }
    if ((rc = h->store.ops->mkt_each(h->store.impl, kv_mkt_take, h, d))) goto fail;
    atomic_init(&h->refreshed_ms, kv_now_ms()); /* before the refresher starts */
    if (h->shared) {
        if (pthread_create(&h->refresher, NULL, kv_hub_refresher, h)) {
            rc = kv_fail(d, KV_EINTERNAL, "hub: cannot start the refresher thread");
            goto fail;
        }
        h->refresher_on = true;
    }
    struct sockaddr_storage ss;
    socklen_t sl;
    if ((rc = kv_parse_listen(h->o.listen, &ss, &sl, d))) goto fail;
    if (pipe(h->stop_pipe)) {
        rc = kv_fail(d, KV_EIO, "hub: pipe: %s", strerror(errno));
        goto fail;
    }
    /* the TLS key is derived from the hub's seed (the first half of hub_sk) */
    h->tls_on = opts->tls_cert;
    if ((opts->tls || opts->tls_cert) && opts->insecure_plaintext) {
        rc = kv_fail(d, KV_EINVAL, "hub: TLS and --insecure-plaintext both asked for");
        goto fail;
    }
    if (!h->tls_on && (opts->tls || (!opts->insecure_plaintext && !kv_https_addr_is_loopback((struct sockaddr *)&ss)))) {
        if ((rc = kv_https_cert_derive(&h->tls, h->hub_sk, "kvasir hub", d))) goto fail;
        h->tls_on = &h->tls;
    }
    kv_https_mhd hm;
    if ((rc = kv_https_mhd_setup(&hm, h->tls_on, (struct sockaddr *)&ss, opts->insecure_plaintext, "hub", d)))
        goto fail;
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | hm.flags;
    /* one public port: the relay accepts, and hands what is not its own to MHD */
    if (opts->relay && opts->relay_same_port) flags |= MHD_USE_NO_LISTEN_SOCKET | MHD_USE_ITC;
    if (ss.ss_family == AF_INET6) flags |= MHD_USE_IPv6;
    if (!h->o.quiet) flags |= MHD_USE_ERROR_LOG;
    const kv_http_guard_opts go = {.max_conns = h->o.max_conns, .per_ip = h->o.per_ip_conns,
                                   .request_ms = h->o.request_s * 1000};
    if ((rc = kv_http_guard_open(&h->guard, &go, d))) goto fail;
    kv_json_budget_install();
    /* per-address limits are the guard's (it counts an IPv6 /64 as one client) */
    h->mhd = MHD_start_daemon(flags, 0, kv_http_guard_accept, h->guard, kv_route, h,
                              MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
                              MHD_OPTION_THREAD_POOL_SIZE, (unsigned)h->o.threads,
                              MHD_OPTION_CONNECTION_LIMIT, kv_http_guard_mhd_limit(h->guard),
                              MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)h->o.conn_timeout_s,
                              MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)(64 * 1024),
                              MHD_OPTION_NOTIFY_COMPLETED, kv_done, h,
                              MHD_OPTION_NOTIFY_CONNECTION, kv_http_guard_notify, h->guard,
                              MHD_OPTION_ARRAY, hm.opts, MHD_OPTION_END);
    if (!h->mhd) {
        rc = kv_fail(d, KV_EIO, "hub: cannot listen on %s (address in use or not local?)", h->o.listen);
        goto fail;
    }
    h->http_open = true; /* before the relay starts: it is the only one that hands connections over */
    const union MHD_DaemonInfo *di = (flags & MHD_USE_NO_LISTEN_SOCKET) ? NULL
                                     : MHD_get_daemon_info(h->mhd, MHD_DAEMON_INFO_BIND_PORT);
    unsigned port = di ? di->port : 0;
    char host[INET6_ADDRSTRLEN] = "?";
    if (ss.ss_family == AF_INET)
        inet_ntop(AF_INET, &((struct sockaddr_in *)&ss)->sin_addr, host, sizeof host);
    else
        inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&ss)->sin6_addr, host, sizeof host);
    snprintf(h->addr, sizeof h->addr, ss.ss_family == AF_INET6 ? "[%s]:%u" : "%s:%u", host, port);
    if (opts->relay) { /* on the hub's host, with the hub's certificate (derived when HTTP is plain) */
        if (!h->tls_on && !h->tls.cert_pem && (rc = kv_https_cert_derive(&h->tls, h->hub_sk, "kvasir hub", d)))
            goto fail;
        char ra[INET6_ADDRSTRLEN + 10];
        const unsigned rport = opts->relay_same_port ? kv_sockaddr_port(&ss) : opts->relay_port;
        snprintf(ra, sizeof ra, ss.ss_family == AF_INET6 ? "[%s]:%u" : "%s:%u", host, rport);
        const kv_relay_server_opts rb = {.max_circuits = (int)opts->relay_max_circuits,
                                         .max_circuits_per_node = (int)opts->relay_max_circuits_per_node,
                                         .rate_per_node = opts->relay_rate_per_node, .rate_total = opts->relay_rate,
                                         .other = opts->relay_same_port ? kv_hub_http_adopt : NULL,
                                         .other_data = h};
        if ((rc = kv_hub_relay_start(&h->relay, ra, h->tls_on ? h->tls_on : &h->tls, h->hub_sk, &rb, h->o.quiet, d)))
            goto fail;
        if (opts->relay_same_port) /* the API's address is the relay's (port 0 picked there) */
            snprintf(h->addr, sizeof h->addr, ss.ss_family == AF_INET6 ? "[%s]:%u" : "%s:%u", host,
                     kv_hub_relay_port(h->relay));
    }
    if (!h->o.trust_announced)
        for (; h->n_provers < h->o.prove_threads; h->n_provers++)
            if (pthread_create(&h->provers[h->n_provers], NULL, kv_hub_prover, h)) {
                rc = kv_fail(d, KV_EINTERNAL, "hub: cannot start a prover thread");
                goto fail;
            }
    *out = h;
    return 0;
fail:
    kv_hub_free(h);
    return rc;
}

const char *kv_hub_addr(const kv_hub *h) { return h->addr; }

uint16_t kv_hub_relay_port_of(const kv_hub *h) { return h->relay ? kv_hub_relay_port(h->relay) : 0; }

const char *kv_hub_tls_fingerprint(const kv_hub *h) { return h->tls_on ? h->tls_on->fp : NULL; }

int kv_hub_serve(kv_hub *h, kv_diag *d) {
    char c;
    for (;;) {
        ssize_t r = read(h->stop_pipe[0], &c, 1);
        if (r == 1 || (r < 0 && errno != EINTR)) break;
    }
    return 0;
}

void kv_hub_stop(kv_hub *h) {
    if (h && h->stop_pipe[1] >= 0) {
        ssize_t r = write(h->stop_pipe[1], "x", 1);
        (void)r;
    }
}

void kv_hub_free(kv_hub *h) {
    if (!h) return;
    pthread_mutex_lock(&h->adopt_mu); /* the relay's thread hands no more connections to mhd */
    h->http_open = false;
    pthread_mutex_unlock(&h->adopt_mu);
    if (h->mhd) MHD_stop_daemon(h->mhd);
    kv_http_guard_free(h->guard);
    if (h->n_provers) {
        pthread_mutex_lock(&h->mu);
        h->prove_stop = true;
        pthread_cond_broadcast(&h->prove_cv);
        pthread_mutex_unlock(&h->mu);
        for (uint32_t i = 0; i < h->n_provers; i++) pthread_join(h->provers[i], NULL);
    }
    kv_hub_relay_free(h->relay);
    if (h->refresher_on) {
        pthread_mutex_lock(&h->refresh_mu);
        h->refresh_stop = true;
        pthread_cond_signal(&h->refresh_cv);
        pthread_mutex_unlock(&h->refresh_mu);
        pthread_join(h->refresher, NULL);
    }
    kv_hub_store_close(&h->store);
    kv_hub_store_close(&h->rstore);
    for (size_t k = 0; k < h->n_nodes; k++) {
        free(h->nodes[k].slabs);
        free(h->nodes[k].proven);
    }
    free(h->nodes);
    free(h->tab);
    free(h->nonces);
    free(h->paths);
    free(h->mkt);
    free(h->rwin);
    kv_manifest_free(h->m);
    free(h->manifest_json);
    if (h->dir_fd >= 0) close(h->dir_fd);
    if (h->stop_pipe[0] >= 0) close(h->stop_pipe[0]);
    if (h->stop_pipe[1] >= 0) close(h->stop_pipe[1]);
    pthread_mutex_destroy(&h->mu);
    pthread_mutex_destroy(&h->refresh_mu);
    pthread_mutex_destroy(&h->adopt_mu);
    pthread_cond_destroy(&h->refresh_cv);
    pthread_cond_destroy(&h->prove_cv);
    free(h->vouch);
    kv_https_cert_clear(&h->tls);
    sodium_memzero(h->hub_sk, sizeof h->hub_sk);
    free(h);
}
