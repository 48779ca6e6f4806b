/* The relay server (include/kvasir/relay.h has the contract, docs/PROTOCOL.md
 * "Relay" the wire view): one event loop on a thread of its own, TLS on
 * every connection, circuits between a coordinator's stream and a node's.
 *
 * Invariants:
 *   - A connection is pending (no role) until its HELLO; pending ones are
 *     capped in all and per address and must say HELLO within the
 *     handshake deadline. A node's HELLO must carry its key's signature over
 *     this connection's TLS exporter; a newer proven connection of the same
 *     key replaces the older one.
 *   - A circuit links (coordinator conn, cid) and (node conn, nid); it is in
 *     both connections' arrays and dies with either. Stream ids only grow on
 *     a connection (the coordinator picks cid, the relay picks nid), so a
 *     frame for an id at or below the highest opened that has no circuit is
 *     late (the circuit closed meanwhile) and dropped, and one above it lies.
 *   - Credit: to_node is what the coordinator may still send on the circuit
 *     (DATA frames counted with their header), to_coord the same the other
 *     way; each starts at the window and never exceeds it, counting credit
 *     withheld. So a connection's send queue holds at most its circuits'
 *     windows of DATA; one that passes the high-water mark (only a peer that
 *     does not read, or floods control frames, can) pauses the connection
 *     that feeds it until it drains, and the write deadline closes a peer
 *     that reads nothing at all.
 *   - Rates: token buckets per node and in all, refilled every tick; DATA
 *     forwarded spends tokens; a CREDIT that would let a node over its rate
 *     (or the relay over its total) send more is held and released when the
 *     bucket is positive again, so an over-budget node is slowed, never
 *     others.
 *
 * Hot path: a DATA frame is checked against its credit and copied once into
 * the other connection's send queue. */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvasir/link_hello.h"
#include "relay_internal.h"

#define KV_RELAY_TICK_MS 10 /* rate buckets are refilled this often */
#define KV_RELAY_PEEK_RETRY_MS 10 /* a partial ClientHello is peeked at again this often */
#define KV_RELAY_PEEK_IDLE_MS 250 /* a silent connection's deadline is checked this often */

typedef struct rconn rconn;

typedef struct circuit {
    rconn *coord, *node;
    uint32_t cid, nid;           /* the stream id on each side */
    int64_t to_node, to_coord;   /* credit: bytes of DATA frames each side may still send */
    uint32_t held_to_node;       /* credit granted by the node, withheld for a rate */
    uint32_t held_to_coord;
    uint64_t n2c_bytes;          /* payload bytes forwarded to the coordinator (tamper_at) */
} circuit;

struct rconn {
    kv_relay_server *s;
    kv_net_conn *nc;
    kv_tls *tls;                 /* the session (owned by nc) */
    int role;                    /* 0 pending, KV_RELAY_ROLE_* */
    uint8_t ipk[16];             /* address key (IPv4, or IPv6 /64) */
    char peer[64];               /* "HOST:PORT" */
    uint8_t pk[32];              /* a node's key */
    kv_net_timer hs_t;           /* the HELLO deadline; then a coordinator's idle deadline */
    circuit **circ;              /* [n_circ] */
    int n_circ, cap_circ;
    uint32_t max_sid;            /* highest stream id opened on this connection */
    int64_t tokens;              /* a node's rate bucket (bytes) */
    bool throttled;              /* a node with credit held */
    bool paused;                 /* reading stopped: a connection it feeds is full */
    rconn *prev, *next;          /* s->conns */
};

/* An accepted connection on a shared port whose first bytes are not yet
 * known (o.other set): peeked at, never read, until its ClientHello says
 * whether it is a relay client. */
typedef struct peek {
    kv_relay_server *s;
    int fd;                      /* owned until adopted or handed over */
    struct sockaddr_storage ss;  /* the peer */
    socklen_t sl;
    uint8_t ipk[16];             /* address key (IPv4, or IPv6 /64) */
    char peer[64];               /* "HOST:PORT" */
    kv_net_watch w;              /* readable: peek again */
    bool watching;
    kv_net_timer t;              /* retry after a partial hello, until deadline_ms */
    int64_t deadline_ms;
    struct peek *prev, *next;    /* s->peeks */
} peek;

struct kv_relay_server {
    kv_relay_server_opts o;
    kv_net_loop *loop;
    pthread_t th;
    bool th_started;
    int lfd;
    kv_net_watch lw;
    char addr[80];
    kv_net_budget budget;
    kv_net_timer tick_t;
    int64_t last_tick_ms;
    int64_t tokens;              /* the total rate bucket */
    rconn *conns;
    peek *peeks;                 /* connections of a shared port not yet classified */
    int n_peeks;
    int n_conns, n_pending, n_circuits;
    size_t tx_max, hwm;          /* per connection: queue limit, pause mark */
    /* counters (kv_relay_stats) */
    atomic_uint_least64_t st_conns, st_nodes, st_circ, st_circ_total, st_to_node, st_to_coord, st_ref_circ,
        st_ref_conns, st_auth, st_proto, st_throttled;
};

static void kv_rlog(kv_relay_server *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void kv_rlog(kv_relay_server *s, const char *fmt, ...) {
    if (!s->o.log) return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    s->o.log(s->o.log_data, line);
}

/* ---- circuits ------------------------------------------------------------------ */

static circuit *kv_circ_find(const rconn *c, uint32_t sid) {
    for (int i = 0; i < c->n_circ; i++) {
        circuit *k = c->circ[i];
        if ((c->role == KV_RELAY_ROLE_NODE ? k->nid : k->cid) == sid) return k;
    }
    return NULL;
}

static int kv_circ_add(rconn *c, circuit *k) {
    if (c->role == KV_RELAY_ROLE_COORD) kv_net_timer_stop(c->s->loop, &c->hs_t);
    if (c->n_circ == c->cap_circ) {
        int nc = c->cap_circ ? c->cap_circ * 2 : 8;
        circuit **a = realloc(c->circ, (size_t)nc * sizeof *a);
        if (!a) return KV_ENOMEM;
        c->circ = a;
        c->cap_circ = nc;
    }
    c->circ[c->n_circ++] = k;
    return 0;
}

static void kv_circ_unlink(rconn *c, circuit *k) {
    for (int i = 0; i < c->n_circ; i++)
        if (c->circ[i] == k) {
            c->circ[i] = c->circ[--c->n_circ];
            break;
        }
    if (c->role == KV_RELAY_ROLE_COORD && c->n_circ == 0 && !kv_net_conn_closing(c->nc))
        kv_net_timer_start(c->s->loop, &c->hs_t, c->s->o.idle_timeout_ms);
}

/* Ends k: tells the side that did not end it (other, with its stream id)
 * with a CLOSE, unless other is NULL, and frees it. */
static void kv_circ_end(kv_relay_server *s, circuit *k, rconn *other, int code, const char *msg) {
    if (other && !kv_net_conn_closing(other->nc))
        (void)kv_relay_send_close(other->nc, KV_RELAY_CLOSE, other == k->node ? k->nid : k->cid, code, msg);
    kv_circ_unlink(k->coord, k);
    kv_circ_unlink(k->node, k);
    s->n_circuits--;
    atomic_fetch_sub(&s->st_circ, 1);
    free(k);
}

/* ---- connections ----------------------------------------------------------------- */

/* A frame that lies: the connection gets an ERROR and closes. */
static int kv_rconn_lie(rconn *c, int code, const char *why) {
    kv_relay_server *s = c->s;
    atomic_fetch_add(&s->st_proto, 1);
    kv_rlog(s, "relay: %s: %s (closing it)", c->peer, why);
    (void)kv_relay_send_close(c->nc, KV_RELAY_ERROR, 0, code, why);
    kv_net_conn_close(c->nc, code, why);
    return code;
}

static rconn *kv_node_find(kv_relay_server *s, const uint8_t pk[32]) {
    for (rconn *c = s->conns; c; c = c->next)
        if (c->role == KV_RELAY_ROLE_NODE && !kv_net_conn_closing(c->nc) && !memcmp(c->pk, pk, 32)) return c;
    return NULL;
}

/* Queues a DATA frame to dst; pauses src if dst's queue passed its mark. */
static int kv_forward_data(kv_relay_server *s, rconn *src, rconn *dst, uint32_t sid, const uint8_t *p, uint32_t n,
                           uint64_t flip_at) {
    uint8_t *o = kv_net_conn_reserve(dst->nc, KV_RELAY_HEADER + (size_t)n);
    if (!o) return 0; /* dst closed itself (its queue): its on_close ends the circuit */
    kv_relay_header_put(o, KV_RELAY_DATA, sid, n);
    memcpy(o + KV_RELAY_HEADER, p, n);
    if (flip_at) o[KV_RELAY_HEADER + flip_at - 1] ^= 0x01;
    kv_net_conn_commit(dst->nc, KV_RELAY_HEADER + (size_t)n);
    if (kv_net_conn_pending(dst->nc) > s->hwm && !src->paused) {
        src->paused = true;
        kv_net_conn_set_reading(src->nc, false);
    }
    return 0;
}

/* Spends n bytes of the buckets k's node draws on. */
static void kv_rate_spend(kv_relay_server *s, rconn *node, uint32_t n) {
    if (s->o.rate_per_node) node->tokens -= n;
    if (s->o.rate_total) s->tokens -= n;
}

static bool kv_rate_over(const kv_relay_server *s, const rconn *node) {
    return (s->o.rate_per_node && node->tokens < 0) || (s->o.rate_total && s->tokens < 0);
}

static int kv_on_data(rconn *c, const kv_relay_frame *f) {
    kv_relay_server *s = c->s;
    circuit *k = kv_circ_find(c, f->stream);
    char why[200];
    if (!k) {
        if (f->stream <= c->max_sid) return 0; /* late: the circuit closed */
        snprintf(why, sizeof why, "DATA on stream %u, which was never opened (highest %u)", f->stream, c->max_sid);
        return kv_rconn_lie(c, KV_EPROTO, why);
    }
    const bool from_node = c == k->node;
    int64_t *credit = from_node ? &k->to_coord : &k->to_node;
    const int64_t cost = KV_RELAY_HEADER + (int64_t)f->len;
    if (cost > *credit) {
        snprintf(why, sizeof why, "DATA of %u bytes on stream %u past its credit (%lld bytes left)", f->len,
                 f->stream, (long long)*credit);
        return kv_rconn_lie(c, KV_EPROTO, why);
    }
    *credit -= cost;
    kv_rate_spend(s, k->node, f->len);
    uint64_t flip = 0;
    if (from_node) {
        const uint64_t t = s->o.tamper_at;
        if (t && t > k->n2c_bytes && t <= k->n2c_bytes + f->len) flip = t - k->n2c_bytes;
        k->n2c_bytes += f->len;
        atomic_fetch_add(&s->st_to_coord, f->len);
        return kv_forward_data(s, c, k->coord, k->cid, f->payload, f->len, flip);
    }
    atomic_fetch_add(&s->st_to_node, f->len);
    return kv_forward_data(s, c, k->node, k->nid, f->payload, f->len, 0);
}

static int kv_on_credit(rconn *c, const kv_relay_frame *f) {
    kv_relay_server *s = c->s;
    circuit *k = kv_circ_find(c, f->stream);
    char why[200];
    if (!k) {
        if (f->stream <= c->max_sid) return 0;
        snprintf(why, sizeof why, "CREDIT on stream %u, which was never opened (highest %u)", f->stream, c->max_sid);
        return kv_rconn_lie(c, KV_EPROTO, why);
    }
    const bool from_node = c == k->node;
    int64_t *credit = from_node ? &k->to_node : &k->to_coord;
    uint32_t *held = from_node ? &k->held_to_node : &k->held_to_coord;
    if (*credit + *held + (int64_t)f->credit > (int64_t)s->o.window) {
        snprintf(why, sizeof why, "CREDIT of %u bytes on stream %u passes the window of %u (%lld outstanding)",
                 f->credit, f->stream, s->o.window, (long long)(*credit + *held));
        return kv_rconn_lie(c, KV_EPROTO, why);
    }
    if (kv_rate_over(s, k->node)) {
        *held += f->credit;
        if (!k->node->throttled) atomic_fetch_add(&s->st_throttled, 1);
        k->node->throttled = true;
        return 0;
    }
    *credit += f->credit;
    rconn *dst = from_node ? k->coord : k->node;
    (void)kv_relay_send_credit(dst->nc, from_node ? k->cid : k->nid, f->credit);
    return 0;
}

/* Circuits of the coordinator connections from address key k. */
static int kv_circuits_of_addr(const kv_relay_server *s, const uint8_t k[16]) {
    int n = 0;
    for (const rconn *c = s->conns; c; c = c->next)
        if (c->role == KV_RELAY_ROLE_COORD && !memcmp(c->ipk, k, 16)) n += c->n_circ;
    return n;
}

static int kv_on_open(rconn *c, const kv_relay_frame *f) {
    kv_relay_server *s = c->s;
    char why[200], hex[65];
    if (c->role != KV_RELAY_ROLE_COORD || !f->key) return kv_rconn_lie(c, KV_EPROTO, "OPEN from a node, or without a key");
    if (f->stream <= c->max_sid) {
        snprintf(why, sizeof why, "OPEN of stream %u, not above the last opened (%u)", f->stream, c->max_sid);
        return kv_rconn_lie(c, KV_EPROTO, why);
    }
    c->max_sid = f->stream;
    kv_hex(f->key, 32, hex);
    rconn *n = kv_node_find(s, f->key);
    int code = KV_ERANGE;
    if (c->n_circ >= s->o.max_circuits_per_coord)
        snprintf(why, sizeof why, "relay: this connection has %d circuits open, its limit", c->n_circ);
    else if (kv_circuits_of_addr(s, c->ipk) >= s->o.max_circuits_per_addr)
        snprintf(why, sizeof why, "relay: coordinators of this address have %d circuits open, their limit",
                 s->o.max_circuits_per_addr);
    else if (s->n_circuits >= s->o.max_circuits)
        snprintf(why, sizeof why, "relay: %d circuits open, the relay's limit: retry later", s->n_circuits);
    else if (!n)
        code = KV_ENOTFOUND, snprintf(why, sizeof why, "relay: node %.16s... is not connected to this relay", hex);
    else if (n->n_circ >= s->o.max_circuits_per_node)
        snprintf(why, sizeof why, "relay: node %.16s... has %d circuits open, its limit", hex, n->n_circ);
    else
        code = 0;
    if (code) {
        atomic_fetch_add(&s->st_ref_circ, 1);
        (void)kv_relay_send_close(c->nc, KV_RELAY_CLOSE, f->stream, code, why);
        return 0;
    }
    circuit *k = calloc(1, sizeof *k);
    if (!k || kv_circ_add(c, k)) {
        free(k);
        (void)kv_relay_send_close(c->nc, KV_RELAY_CLOSE, f->stream, KV_ENOMEM, "relay: out of memory");
        return 0;
    }
    if (kv_circ_add(n, k)) {
        kv_circ_unlink(c, k);
        free(k);
        (void)kv_relay_send_close(c->nc, KV_RELAY_CLOSE, f->stream, KV_ENOMEM, "relay: out of memory");
        return 0;
    }
    k->coord = c, k->cid = f->stream;
    k->node = n, k->nid = ++n->max_sid;
    k->to_node = k->to_coord = s->o.window;
    s->n_circuits++;
    atomic_fetch_add(&s->st_circ, 1);
    atomic_fetch_add(&s->st_circ_total, 1);
    (void)kv_relay_send(n->nc, KV_RELAY_OPEN, k->nid, NULL, 0);
    return 0;
}

static int kv_on_accept_or_close(rconn *c, const kv_relay_frame *f) {
    kv_relay_server *s = c->s;
    circuit *k = kv_circ_find(c, f->stream);
    char why[200];
    if (!k) {
        if (f->stream <= c->max_sid) return 0;
        snprintf(why, sizeof why, "%s on stream %u, which was never opened (highest %u)",
                 f->type == KV_RELAY_ACCEPT ? "ACCEPT" : "CLOSE", f->stream, c->max_sid);
        return kv_rconn_lie(c, KV_EPROTO, why);
    }
    if (f->type == KV_RELAY_ACCEPT) {
        if (c != k->node) return kv_rconn_lie(c, KV_EPROTO, "ACCEPT from a coordinator");
        (void)kv_relay_send(k->coord->nc, KV_RELAY_ACCEPT, k->cid, NULL, 0);
        return 0;
    }
    char msg[KV_RELAY_MAX_MSG + 1];
    memcpy(msg, f->msg, f->msg_len);
    msg[f->msg_len] = 0;
    kv_circ_end(s, k, c == k->node ? k->coord : k->node, f->code, msg);
    return 0;
}

static void kv_rconn_registered(rconn *c, int role) {
    kv_relay_server *s = c->s;
    c->role = role;
    s->n_pending--;
    kv_net_timer_stop(s->loop, &c->hs_t);
    if (role == KV_RELAY_ROLE_COORD) kv_net_timer_start(s->loop, &c->hs_t, s->o.idle_timeout_ms);
    uint8_t w[KV_RELAY_WELCOME_SIZE] = {KV_RELAY_VERSION, 0, 0, 0};
    const uint32_t win = s->o.window, mp = KV_RELAY_MAX_PAYLOAD;
    w[4] = (uint8_t)win, w[5] = (uint8_t)(win >> 8), w[6] = (uint8_t)(win >> 16), w[7] = (uint8_t)(win >> 24);
    w[8] = (uint8_t)mp, w[9] = (uint8_t)(mp >> 8), w[10] = (uint8_t)(mp >> 16), w[11] = (uint8_t)(mp >> 24);
    (void)kv_relay_send(c->nc, KV_RELAY_WELCOME, 0, w, sizeof w);
}

static int kv_on_hello(rconn *c, const kv_relay_frame *f) {
    kv_relay_server *s = c->s;
    char why[200], hex[65];
    if (c->role) return kv_rconn_lie(c, KV_EPROTO, "a second HELLO");
    if (f->version != KV_RELAY_VERSION) {
        snprintf(why, sizeof why, "relay version %u is not spoken here (this relay speaks %u)", f->version,
                 KV_RELAY_VERSION);
        return kv_rconn_lie(c, KV_EUNSUPPORTED, why);
    }
    if (f->role == KV_RELAY_ROLE_COORD) {
        kv_rconn_registered(c, KV_RELAY_ROLE_COORD);
        return 0;
    }
    uint8_t ex[KV_TLS_EXPORTER_LEN], dg[32];
    kv_hex(f->key, 32, hex);
    if (kv_tls_exporter(c->tls, ex)) return kv_rconn_lie(c, KV_EPROTO, "no TLS session to bind the proof to");
    kv_relay_node_digest(ex, f->key, dg);
    if (kv_link_verify(f->key, dg, f->sig)) {
        atomic_fetch_add(&s->st_auth, 1);
        snprintf(why, sizeof why, "relay HELLO: the signature does not prove key %.16s... on this connection", hex);
        kv_rlog(s, "relay: %s: %s", c->peer, why);
        (void)kv_relay_send_close(c->nc, KV_RELAY_ERROR, 0, KV_EAUTH, why);
        kv_net_conn_close(c->nc, KV_EAUTH, why);
        return KV_EAUTH;
    }
    rconn *old = kv_node_find(s, f->key);
    if (old) { /* the same key, proven again: the newer connection wins */
        kv_rlog(s, "relay: node %.16s... reconnected from %s; closing its connection from %s", hex, c->peer, old->peer);
        (void)kv_relay_send_close(old->nc, KV_RELAY_ERROR, 0, KV_EIO, "relay: replaced by a newer connection of this key");
        kv_net_conn_close(old->nc, KV_EIO, "replaced by a newer connection of this key");
    }
    memcpy(c->pk, f->key, 32);
    c->tokens = (int64_t)(s->o.rate_per_node / 5);
    atomic_fetch_add(&s->st_nodes, 1);
    kv_rconn_registered(c, KV_RELAY_ROLE_NODE);
    kv_rlog(s, "relay: node %.16s... registered from %s", hex, c->peer);
    return 0;
}

static int kv_rc_frame(kv_net_conn *nc, const uint8_t *b, size_t n) {
    rconn *c = kv_net_conn_data(nc);
    kv_relay_frame f;
    kv_diag d = {0};
    if (kv_relay_frame_decode(b, n, &f, &d)) return kv_rconn_lie(c, KV_EPROTO, d.msg);
    if (!c->role && f.type != KV_RELAY_HELLO) return kv_rconn_lie(c, KV_EPROTO, "the first frame must be HELLO");
    switch (f.type) {
    case KV_RELAY_HELLO: return kv_on_hello(c, &f);
    case KV_RELAY_OPEN: return kv_on_open(c, &f);
    case KV_RELAY_ACCEPT:
    case KV_RELAY_CLOSE: return kv_on_accept_or_close(c, &f);
    case KV_RELAY_DATA: return kv_on_data(c, &f);
    case KV_RELAY_CREDIT: return kv_on_credit(c, &f);
    case KV_RELAY_ERROR:
        kv_net_conn_close(nc, 0, "the client sent ERROR");
        return 0;
    default: return kv_rconn_lie(c, KV_EPROTO, "a WELCOME from a client");
    }
}

static void kv_rc_error(kv_net_conn *nc, int code, const char *why) {
    rconn *c = kv_net_conn_data(nc);
    if (code == KV_EPROTO || code == KV_ERANGE) atomic_fetch_add(&c->s->st_proto, 1);
    (void)kv_relay_send_close(nc, KV_RELAY_ERROR, 0, code, why);
}

/* A connection whose queue drained (or that closed) resumes every paused
 * one (rare: only a peer that does not read pauses anyone). */
static void kv_resume_all(kv_relay_server *s) {
    for (rconn *p = s->conns; p; p = p->next)
        if (p->paused && !kv_net_conn_closing(p->nc)) {
            p->paused = false;
            kv_net_conn_set_reading(p->nc, true);
        }
}

static void kv_rc_drain(kv_net_conn *nc) { kv_resume_all(((rconn *)kv_net_conn_data(nc))->s); }

static void kv_rc_close(kv_net_conn *nc, int code, const char *why) {
    rconn *c = kv_net_conn_data(nc);
    kv_relay_server *s = c->s;
    char msg[200];
    snprintf(msg, sizeof msg, "relay: the %s's connection ended (%s)",
             c->role == KV_RELAY_ROLE_NODE ? "node" : "coordinator", why && *why ? why : kv_err_str(code));
    while (c->n_circ) {
        circuit *k = c->circ[c->n_circ - 1];
        kv_circ_end(s, k, c == k->node ? k->coord : k->node, KV_EIO, msg);
    }
    if (!c->role) s->n_pending--;
    else if (c->role == KV_RELAY_ROLE_NODE) atomic_fetch_sub(&s->st_nodes, 1);
    kv_net_timer_stop(s->loop, &c->hs_t);
    if (c->prev) c->prev->next = c->next;
    else s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    s->n_conns--;
    atomic_fetch_sub(&s->st_conns, 1);
    kv_rlog(s, "relay: %s closed: %s", c->peer, why && *why ? why : kv_err_str(code));
    free(c->circ);
    free(c);
    kv_resume_all(s);
}

static const kv_net_conn_cbs kv_rc_cbs = {
    .frame_len = kv_relay_frame_len,
    .on_frame = kv_rc_frame,
    .on_error = kv_rc_error,
    .on_drain = kv_rc_drain,
    .on_close = kv_rc_close,
};

/* The HELLO deadline of a pending connection, or the idle deadline of a
 * coordinator without circuits: either holds a place for no work. */
static void kv_rc_hello_late(kv_net_loop *l, kv_net_timer *t) {
    rconn *c = t->data;
    (void)l;
    char why[120];
    if (c->role == KV_RELAY_ROLE_COORD) {
        snprintf(why, sizeof why, "relay: no circuit open for %d ms", c->s->o.idle_timeout_ms);
        (void)kv_relay_send_close(c->nc, KV_RELAY_ERROR, 0, KV_ETIMEOUT, why);
    } else {
        snprintf(why, sizeof why, "no TLS handshake and HELLO within %d ms", c->s->o.handshake_timeout_ms);
    }
    kv_net_conn_close(c->nc, KV_ETIMEOUT, why);
}

/* ---- accepting ---------------------------------------------------------------------- */

static void kv_addr_key(const struct sockaddr_storage *ss, uint8_t out[16]) {
    memset(out, 0, 16);
    if (ss->ss_family == AF_INET) {
        out[10] = out[11] = 0xff;
        memcpy(out + 12, &((const struct sockaddr_in *)ss)->sin_addr, 4);
    } else if (ss->ss_family == AF_INET6) {
        const uint8_t *a = ((const struct sockaddr_in6 *)ss)->sin6_addr.s6_addr;
        static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        memcpy(out, a, memcmp(a, mapped, 12) ? 8 : 16);
    }
}

static int kv_pending_of(const kv_relay_server *s, const uint8_t k[16]) {
    int n = 0;
    for (const rconn *c = s->conns; c; c = c->next) n += !c->role && !memcmp(c->ipk, k, 16);
    return n;
}

static int kv_pending_all(const kv_relay_server *s, const uint8_t k[16]) {
    int n = kv_pending_of(s, k);
    for (const peek *p = s->peeks; p; p = p->next) n += !memcmp(p->ipk, k, 16);
    return n;
}

/* Makes accepted fd a relay connection (TLS, then HELLO); fd is consumed. */
static void kv_relay_adopt(kv_relay_server *s, kv_net_loop *l, int fd, const uint8_t ipk[16], const char *peer) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    rconn *c = calloc(1, sizeof *c);
    kv_tls *t = NULL;
    kv_diag d = {0};
    const kv_tls_opts to = {.server = true, .alpn = KV_LINK_RELAY_ALPN};
    if (!c || kv_tls_new(&t, s->o.tls, &to, &d)) {
        free(c);
        close(fd);
        return;
    }
    c->s = s;
    c->tls = t;
    memcpy(c->ipk, ipk, 16);
    snprintf(c->peer, sizeof c->peer, "%s", peer);
    kv_net_timer_init(&c->hs_t, kv_rc_hello_late, c);
    const kv_net_conn_opts o = {
        .header = KV_RELAY_HEADER,
        .max_frame = KV_RELAY_HEADER + KV_RELAY_MAX_PAYLOAD,
        .tx_max = s->tx_max,
        .frame_timeout_ms = 30000,
        .write_timeout_ms = s->o.write_timeout_ms,
        .handshake_timeout_ms = s->o.handshake_timeout_ms,
        .linger_ms = 100,
        .budget = &s->budget,
        .io = &kv_tls_net_io,
        .io_ctx = t,
    };
    if (kv_net_conn_new(&c->nc, l, fd, &o, &kv_rc_cbs, c, &d)) { /* fd and t released by it */
        kv_rlog(s, "relay: %s refused: %s", peer, d.msg);
        free(c);
        return;
    }
    c->next = s->conns;
    if (s->conns) s->conns->prev = c;
    s->conns = c;
    s->n_conns++;
    s->n_pending++;
    atomic_fetch_add(&s->st_conns, 1);
    kv_net_timer_start(l, &c->hs_t, s->o.handshake_timeout_ms);
}

static void kv_peek_unlink(kv_relay_server *s, peek *p) {
    if (p->watching) kv_net_watch_del(s->loop, &p->w);
    p->watching = false;
    kv_net_timer_stop(s->loop, &p->t);
    if (p->prev) p->prev->next = p->next;
    else s->peeks = p->next;
    if (p->next) p->next->prev = p->prev;
    s->n_peeks--;
}

static void kv_peek_watch(kv_net_loop *l, kv_net_watch *w, unsigned ev);

/* Peeks at p's first bytes: a relay hello is adopted, anything else is
 * handed to o.other, a partial hello waits (re-peeked by a timer, since the
 * bytes stay readable), until the deadline, after which it is "other". */
static void kv_peek_step(kv_relay_server *s, peek *p) {
    uint8_t buf[KV_LINK_HELLO_MAX];
    ssize_t n = recv(p->fd, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
    kv_hello_kind k;
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        kv_peek_unlink(s, p); /* gone before saying anything */
        close(p->fd);
        free(p);
        return;
    }
    k = n < 0 ? KV_HELLO_MORE : kv_link_hello_classify(buf, (size_t)n, KV_LINK_RELAY_ALPN);
    if (k == KV_HELLO_MORE && kv_net_now_ms() >= p->deadline_ms) k = KV_HELLO_OTHER;
    if (k == KV_HELLO_MORE) {
        if (n > 0 && p->watching) { /* some bytes, not all: level-triggered readiness would spin */
            kv_net_watch_del(s->loop, &p->w);
            p->watching = false;
        } else if (n < 0 && !p->watching) {
            kv_diag d = {0};
            if (!kv_net_watch_add(s->loop, &p->w, p->fd, KV_NET_READ, kv_peek_watch, p, &d)) p->watching = true;
        }
        kv_net_timer_stop(s->loop, &p->t); /* the timer enforces the deadline either way */
        kv_net_timer_start(s->loop, &p->t, p->watching ? KV_RELAY_PEEK_IDLE_MS : KV_RELAY_PEEK_RETRY_MS);
        return;
    }
    kv_peek_unlink(s, p);
    if (k == KV_HELLO_RELAY) kv_relay_adopt(s, s->loop, p->fd, p->ipk, p->peer);
    else s->o.other(s->o.other_data, p->fd, (const struct sockaddr *)&p->ss, (unsigned)p->sl);
    free(p);
}

static void kv_peek_watch(kv_net_loop *l, kv_net_watch *w, unsigned ev) {
    (void)l, (void)ev;
    peek *p = w->data;
    kv_peek_step(p->s, p);
}

static void kv_peek_timer(kv_net_loop *l, kv_net_timer *t) {
    (void)l;
    peek *p = t->data;
    kv_peek_step(p->s, p);
}

static void kv_relay_accept(kv_net_loop *l, kv_net_watch *w, unsigned ev) {
    kv_relay_server *s = w->data;
    (void)ev;
    for (int burst = 0; burst < 64; burst++) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        int fd = accept4(s->lfd, (struct sockaddr *)&ss, &sl, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) return;
        char hb[INET6_ADDRSTRLEN] = "?", pb[8] = "?", peer[64];
        getnameinfo((struct sockaddr *)&ss, sl, hb, sizeof hb, pb, sizeof pb, NI_NUMERICHOST | NI_NUMERICSERV);
        snprintf(peer, sizeof peer, "%s:%s", hb, pb);
        uint8_t ipk[16];
        kv_addr_key(&ss, ipk);
        const char *refuse = NULL;
        if (s->n_conns >= s->o.max_conns) refuse = "connections at the relay's limit";
        else if (s->n_pending + s->n_peeks >= s->o.max_pending) refuse = "too many connections in their handshake";
        else if (kv_pending_all(s, ipk) >= s->o.max_pending_per_addr) refuse = "too many handshakes from this address";
        if (refuse) {
            atomic_fetch_add(&s->st_ref_conns, 1);
            kv_rlog(s, "relay: %s refused: %s", peer, refuse);
            close(fd);
            continue;
        }
        if (!s->o.other) {
            kv_relay_adopt(s, l, fd, ipk, peer);
            continue;
        }
        peek *p = calloc(1, sizeof *p);
        if (!p) {
            close(fd);
            continue;
        }
        p->s = s;
        p->fd = fd;
        p->ss = ss;
        p->sl = sl;
        memcpy(p->ipk, ipk, 16);
        snprintf(p->peer, sizeof p->peer, "%s", peer);
        p->deadline_ms = kv_net_now_ms() + s->o.handshake_timeout_ms;
        kv_net_timer_init(&p->t, kv_peek_timer, p);
        p->next = s->peeks;
        if (s->peeks) s->peeks->prev = p;
        s->peeks = p;
        s->n_peeks++;
        kv_peek_step(s, p);
    }
}

/* ---- rates ------------------------------------------------------------------------- */

static void kv_bucket_fill(int64_t *tokens, uint64_t rate, int64_t dt_ms) {
    if (!rate) return;
    const int64_t cap = (int64_t)(rate / 5) > (int64_t)KV_RELAY_MIN_WINDOW ? (int64_t)(rate / 5) : KV_RELAY_MIN_WINDOW;
    *tokens += (int64_t)(rate * (uint64_t)dt_ms / 1000u);
    if (*tokens > cap) *tokens = cap;
}

/* Releases the credit held for nodes whose buckets allow it again. */
static void kv_relay_tick(kv_net_loop *l, kv_net_timer *t) {
    kv_relay_server *s = t->data;
    const int64_t now = kv_net_now_ms(), dt = now - s->last_tick_ms;
    s->last_tick_ms = now;
    kv_bucket_fill(&s->tokens, s->o.rate_total, dt);
    for (rconn *c = s->conns; c; c = c->next) {
        if (c->role != KV_RELAY_ROLE_NODE) continue;
        kv_bucket_fill(&c->tokens, s->o.rate_per_node, dt);
        if (!c->throttled || kv_rate_over(s, c) || kv_net_conn_closing(c->nc)) continue;
        c->throttled = false;
        for (int i = 0; i < c->n_circ; i++) {
            circuit *k = c->circ[i];
            if (k->held_to_node) {
                k->to_node += k->held_to_node;
                (void)kv_relay_send_credit(k->coord->nc, k->cid, k->held_to_node);
                k->held_to_node = 0;
            }
            if (k->held_to_coord) {
                k->to_coord += k->held_to_coord;
                (void)kv_relay_send_credit(c->nc, k->nid, k->held_to_coord);
                k->held_to_coord = 0;
            }
        }
    }
    kv_net_timer_start(l, t, KV_RELAY_TICK_MS);
}

/* ---- the server ----------------------------------------------------------------------- */

static void *kv_relay_thread(void *arg) {
    kv_relay_server *s = arg;
    while (!kv_net_loop_stopping(s->loop))
        if (kv_net_loop_run_once(s->loop, 1000, NULL)) break;
    return NULL;
}

static void kv_relay_defaults(kv_relay_server_opts *o) {
    if (o->max_conns <= 0) o->max_conns = 1024;
    if (o->max_pending <= 0) o->max_pending = 64;
    if (o->max_pending_per_addr <= 0) o->max_pending_per_addr = 8;
    if (o->handshake_timeout_ms <= 0) o->handshake_timeout_ms = 5000;
    if (o->max_circuits <= 0) o->max_circuits = 4096;
    if (o->max_circuits_per_node <= 0) o->max_circuits_per_node = 64;
    if (o->max_circuits_per_coord <= 0) o->max_circuits_per_coord = 64;
    if (o->max_circuits_per_addr <= 0) o->max_circuits_per_addr = 256;
    if (o->window == 0) o->window = 256u << 10;
    if (o->mem_limit == 0) o->mem_limit = (size_t)512 << 20;
    if (o->write_timeout_ms <= 0) o->write_timeout_ms = 15000;
    if (o->idle_timeout_ms <= 0) o->idle_timeout_ms = 60000;
}

int kv_relay_server_start(kv_relay_server **out, const kv_relay_server_opts *o, kv_diag *d) {
    *out = NULL;
    if (!o || !o->listen || !o->tls) return kv_fail(d, KV_EINVAL, "relay: a listen address and a TLS context are required");
    kv_relay_server_opts oo = *o;
    kv_relay_defaults(&oo);
    if (oo.window < KV_RELAY_MIN_WINDOW || oo.window > KV_RELAY_MAX_WINDOW)
        return kv_fail(d, KV_EINVAL, "relay: window %u outside [%u, %u]", oo.window, KV_RELAY_MIN_WINDOW,
                       KV_RELAY_MAX_WINDOW);
    kv_relay_server *s = calloc(1, sizeof *s);
    if (!s) return kv_fail(d, KV_ENOMEM, "relay: out of memory");
    s->o = oo;
    s->lfd = -1;
    const int per = oo.max_circuits_per_node > oo.max_circuits_per_coord ? oo.max_circuits_per_node
                                                                          : oo.max_circuits_per_coord;
    s->hwm = (size_t)per * oo.window + (1u << 20);
    s->tx_max = s->hwm + (2u << 20);
    kv_net_budget_init(&s->budget, oo.mem_limit);
    int rc = kv_net_loop_new(&s->loop, d);
    if (!rc) rc = kv_net_listen(oo.listen, 256, &s->lfd, s->addr, sizeof s->addr, d);
    if (!rc) rc = kv_net_watch_add(s->loop, &s->lw, s->lfd, KV_NET_READ, kv_relay_accept, s, d);
    if (!rc) {
        kv_net_timer_init(&s->tick_t, kv_relay_tick, s);
        s->last_tick_ms = kv_net_now_ms();
        s->tokens = (int64_t)(oo.rate_total / 5);
        if (oo.rate_total || oo.rate_per_node) rc = kv_net_timer_start(s->loop, &s->tick_t, KV_RELAY_TICK_MS);
    }
    if (!rc && pthread_create(&s->th, NULL, kv_relay_thread, s)) rc = kv_fail(d, KV_EIO, "relay: cannot start a thread");
    if (rc) {
        kv_relay_server_free(s);
        return rc;
    }
    s->th_started = true;
    *out = s;
    return 0;
}

const char *kv_relay_server_addr(const kv_relay_server *s) { return s->addr; }

void kv_relay_server_stats(const kv_relay_server *s, kv_relay_stats *out) {
    kv_relay_server *m = (kv_relay_server *)s;
    out->conns = atomic_load(&m->st_conns);
    out->nodes = atomic_load(&m->st_nodes);
    out->circuits = atomic_load(&m->st_circ);
    out->circuits_total = atomic_load(&m->st_circ_total);
    out->bytes_to_node = atomic_load(&m->st_to_node);
    out->bytes_to_coord = atomic_load(&m->st_to_coord);
    out->refused_circuits = atomic_load(&m->st_ref_circ);
    out->refused_conns = atomic_load(&m->st_ref_conns);
    out->auth_failures = atomic_load(&m->st_auth);
    out->protocol_errors = atomic_load(&m->st_proto);
    out->throttled = atomic_load(&m->st_throttled);
    out->mem = atomic_load(&m->budget.used);
    out->mem_peak = atomic_load(&m->budget.peak);
}

size_t kv_relay_stats_prometheus(const kv_relay_stats *st, char *out, size_t cap) {
    static const struct {
        const char *name, *type, *help;
        size_t off;
    } m[] = {
#define KV_RM(f, t, h) {"kvasir_relay_" #f, t, h, offsetof(kv_relay_stats, f)}
        KV_RM(conns, "gauge", "Connections open (nodes, coordinators, handshakes)."),
        KV_RM(nodes, "gauge", "Nodes registered (proven keys)."),
        KV_RM(circuits, "gauge", "Circuits open."),
        KV_RM(circuits_total, "counter", "Circuits opened."),
        KV_RM(bytes_to_node, "counter", "DATA payload bytes forwarded to nodes."),
        KV_RM(bytes_to_coord, "counter", "DATA payload bytes forwarded to coordinators."),
        KV_RM(refused_circuits, "counter", "Circuits refused (a budget, or no such node)."),
        KV_RM(refused_conns, "counter", "Connections refused at accept (a cap)."),
        KV_RM(auth_failures, "counter", "Node HELLOs whose key proof failed."),
        KV_RM(protocol_errors, "counter", "Connections closed for a frame that lied."),
        KV_RM(throttled, "counter", "Times a node's credit was withheld for a rate."),
#undef KV_RM
    };
    size_t need = 0;
    for (size_t i = 0; i < sizeof m / sizeof m[0]; i++) {
        const uint64_t v = *(const uint64_t *)((const char *)st + m[i].off);
        int k = snprintf(need < cap ? out + need : NULL, need < cap ? cap - need : 0,
                         "# HELP %s %s\n# TYPE %s %s\n%s %llu\n", m[i].name, m[i].help, m[i].name, m[i].type,
                         m[i].name, (unsigned long long)v);
        need += k > 0 ? (size_t)k : 0;
    }
    int k = snprintf(need < cap ? out + need : NULL, need < cap ? cap - need : 0,
                     "# HELP kvasir_relay_mem_bytes Bytes the relay's connections buffer.\n"
                     "# TYPE kvasir_relay_mem_bytes gauge\nkvasir_relay_mem_bytes %zu\n",
                     st->mem);
    need += k > 0 ? (size_t)k : 0;
    if (cap && need >= cap) out[cap - 1] = 0;
    return need;
}

void kv_relay_server_free(kv_relay_server *s) {
    if (!s) return;
    if (s->th_started) {
        kv_net_loop_stop(s->loop);
        pthread_join(s->th, NULL);
    }
    for (peek *p = s->peeks, *n; p; p = n) { /* the loop is stopped: its watches and timers go with it */
        n = p->next;
        close(p->fd);
        free(p);
    }
    for (rconn *c = s->conns, *n; c; c = n) { /* the loop frees the connections; the rest is ours */
        n = c->next;
        while (c->n_circ) {
            circuit *k = c->circ[c->n_circ - 1];
            kv_circ_unlink(k->coord, k);
            kv_circ_unlink(k->node, k);
            free(k);
        }
        free(c->circ);
        free(c);
    }
    if (s->lfd >= 0) close(s->lfd);
    kv_net_loop_free(s->loop);
    free(s);
}
