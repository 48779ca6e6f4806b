/* The relay's clients (include/kvasir/relay.h): a node that receives
 * circuits over one outbound connection, and a coordinator that opens
 * them. Both run one event loop on a thread of their own, with one TLS
 * connection to the relay (pinned by the relay's fingerprint), and bridge
 * every circuit to a socketpair whose other end the caller holds.
 *
 * Invariants:
 *   - A circuit's bytes from the relay wait in its buffer (at most the
 *     window: the sender never passes the credit we granted) until the
 *     local socket takes them; credit is granted back only for bytes the
 *     local socket took (and the header of each DATA frame), so a local
 *     reader that is slow stops its own stream and nothing else.
 *   - The local socket is read only while the circuit has credit, and at
 *     most the credit (less a header) at a time.
 *   - The relay connection is re-established after it fails or drops, with
 *     a delay doubling from backoff_min_ms to backoff_max_ms and jittered
 *     to [delay/2, delay]; a connection that stayed up 5 s resets it. A
 *     coordinator reconnects only while opens wait (the relay closes its
 *     connection when it has no circuit), at once for the first. Every
 *     circuit ends with the connection that carried it (its socket reads
 *     end of stream), and waiting opens fail.
 *   - An ended circuit leaves c->circ at once but is freed only by the
 *     tick, after the loop's batch of events: a batch may hold an event
 *     for its socket taken before it ended (a CLOSE handled first).
 *
 * Hot path: DATA is read from the local socket straight into the
 * connection's send queue, and from the frame into the circuit buffer. */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/link_hello.h"
#include "relay_internal.h"

#define KV_RELAY_STABLE_MS 5000 /* up this long: the backoff starts over */

typedef struct open_req open_req;
typedef struct lcirc lcirc;

/* A coordinator's open, from kv_relay_client_open's thread to the loop. */
struct open_req {
    uint8_t pk[32];
    int64_t deadline_ms;
    uint32_t sid;        /* the stream, once OPEN was sent; 0 before */
    bool done;           /* set on the loop thread, under mu */
    int rc;
    int fd;              /* the caller's end */
    char msg[KV_RELAY_MAX_MSG + 64];
    open_req *next;
};

struct lcirc {
    kv_relay_client *cl;
    uint32_t sid;
    int fd;                      /* our end of the socketpair */
    kv_net_watch w;
    unsigned wev;                /* events watched (0: not registered) */
    int64_t credit;              /* bytes of DATA frames we may still send */
    uint32_t to_grant;           /* taken by the local socket, not yet granted */
    uint8_t *buf;                /* [window] bytes from the relay */
    size_t head, len;
    bool remote_closed;          /* CLOSE received: end once buf is written */
    bool dead;                   /* ended: on c->grave until the iteration is over */
    open_req *req;               /* a coordinator's open waiting for ACCEPT */
    lcirc *next_dead;            /* c->grave */
};

struct kv_relay_client {
    kv_relay_client_opts o;
    char relay[256], pin[KV_TLS_FP_HEX + 1];
    kv_net_loop *loop;
    pthread_t th;
    bool th_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    open_req *incoming;          /* under mu: opens not yet seen by the loop */
    open_req *waiting;           /* loop: opens before the relay connection is up */
    kv_net_conn *nc;             /* the relay connection, NULL between attempts */
    kv_tls *tls;
    bool up;                     /* WELCOME received */
    int64_t up_since_ms;
    uint32_t window, max_payload;
    uint32_t next_sid;
    lcirc **circ;                /* [n_circ] */
    int n_circ;
    lcirc *grave;                /* ended circuits, freed by the tick (see kv_lc_free) */
    int failures;                /* in a row, for the backoff */
    kv_net_timer retry_t, deadline_t, open_t;
    uint64_t rng;
    atomic_bool st_up;
    atomic_uint_least64_t st_connects, st_attempts, st_failures, st_circ, st_circ_total;
    atomic_int_least64_t st_backoff;
    char last_error[256];        /* under mu */
};

static void kv_clog(kv_relay_client *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void kv_clog(kv_relay_client *c, const char *fmt, ...) {
    if (!c->o.log) return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    c->o.log(c->o.log_data, line);
}

static void kv_req_finish(kv_relay_client *c, open_req *r, int rc, int fd, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void kv_req_finish(kv_relay_client *c, open_req *r, int rc, int fd, const char *fmt, ...) {
    pthread_mutex_lock(&c->mu);
    r->rc = rc;
    r->fd = fd;
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(r->msg, sizeof r->msg, fmt, ap);
        va_end(ap);
    }
    r->done = true;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

/* ---- circuits ---------------------------------------------------------------------- */

static lcirc *kv_lc_find(kv_relay_client *c, uint32_t sid) {
    for (int i = 0; i < c->n_circ; i++)
        if (c->circ[i]->sid == sid) return c->circ[i];
    return NULL;
}

/* Ends k: unwatches and closes our end; tells the relay with a CLOSE
 * when notify (code, msg). A waiting open fails with the same. k leaves
 * c->circ at once but its memory lives until the loop's iteration is over
 * (kv_lc_reap, from the tick): an epoll batch may still hold an event for
 * its watch, taken before the watch was deleted, which must find k (dead)
 * and not freed memory. */
static void kv_lc_free(lcirc *k, bool notify, int code, const char *msg) {
    kv_relay_client *c = k->cl;
    if (k->dead) return;
    if (notify && c->nc && !kv_net_conn_closing(c->nc)) (void)kv_relay_send_close(c->nc, KV_RELAY_CLOSE, k->sid, code, msg);
    if (k->wev) kv_net_watch_del(c->loop, &k->w);
    k->wev = 0;
    if (k->fd >= 0) close(k->fd);
    k->fd = -1;
    if (k->req) kv_req_finish(c, k->req, code ? code : KV_EIO, -1, "relay: %s", msg && *msg ? msg : "circuit closed");
    k->req = NULL;
    for (int i = 0; i < c->n_circ; i++)
        if (c->circ[i] == k) {
            c->circ[i] = c->circ[--c->n_circ];
            break;
        }
    atomic_fetch_sub(&c->st_circ, 1);
    free(k->buf);
    k->buf = NULL;
    k->dead = true;
    k->next_dead = c->grave;
    c->grave = k;
}

/* Frees the circuits ended before: called where no event of this
 * iteration can still name them (the tick, and after the loop stopped). */
static void kv_lc_reap(kv_relay_client *c) {
    while (c->grave) {
        lcirc *k = c->grave;
        c->grave = k->next_dead;
        free(k);
    }
}

static void kv_lc_io(kv_net_loop *l, kv_net_watch *w, unsigned ev);

/* Watches what k can use: its socket's input while it has credit, its
 * writability while bytes wait. */
static void kv_lc_update(lcirc *k) {
    kv_relay_client *c = k->cl;
    unsigned ev = 0;
    if (k->fd < 0) return;
    if (!k->remote_closed && !k->req && k->credit > (int64_t)KV_RELAY_HEADER) ev |= KV_NET_READ;
    if (k->len) ev |= KV_NET_WRITE;
    if (ev == k->wev) return;
    if (k->wev) kv_net_watch_del(c->loop, &k->w);
    k->wev = 0;
    if (ev && !kv_net_watch_add(c->loop, &k->w, k->fd, ev, kv_lc_io, k, NULL)) k->wev = ev;
}

/* Writes what waits to the local socket; grants credit for it. */
static void kv_lc_write(lcirc *k) {
    kv_relay_client *c = k->cl;
    while (k->len) {
        ssize_t n = send(k->fd, k->buf + k->head, k->len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        if (n <= 0) {
            kv_lc_free(k, true, 0, "the local end closed");
            return;
        }
        k->head += (size_t)n;
        k->len -= (size_t)n;
        k->to_grant += (uint32_t)n;
    }
    if (k->len == 0) k->head = 0;
    if (k->to_grant >= c->window / 8 || (k->len == 0 && k->to_grant > 0)) {
        if (c->nc) (void)kv_relay_send_credit(c->nc, k->sid, k->to_grant);
        k->to_grant = 0;
    }
    if (k->remote_closed && k->len == 0) {
        kv_lc_free(k, false, 0, NULL);
        return;
    }
    kv_lc_update(k);
}

/* Reads the local socket into DATA frames while credit lasts. */
static void kv_lc_read(lcirc *k) {
    kv_relay_client *c = k->cl;
    while (c->nc && k->credit > (int64_t)KV_RELAY_HEADER) {
        size_t n = (size_t)(k->credit - KV_RELAY_HEADER);
        if (n > c->max_payload) n = c->max_payload;
        uint8_t *o = kv_net_conn_reserve(c->nc, KV_RELAY_HEADER + n);
        if (!o) return; /* the connection closed: its on_close ends k */
        ssize_t r = recv(k->fd, o + KV_RELAY_HEADER, n, MSG_DONTWAIT);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        if (r <= 0) {
            kv_lc_free(k, true, 0, r == 0 ? "the local end closed" : "the local end failed");
            return;
        }
        kv_relay_header_put(o, KV_RELAY_DATA, k->sid, (uint32_t)r);
        kv_net_conn_commit(c->nc, KV_RELAY_HEADER + (size_t)r);
        k->credit -= KV_RELAY_HEADER + r;
        if ((size_t)r < n) break;
    }
    kv_lc_update(k);
}

static void kv_lc_io(kv_net_loop *l, kv_net_watch *w, unsigned ev) {
    lcirc *k = w->data;
    (void)l;
    if (k->dead) return; /* ended earlier in this batch of events */
    if (ev & KV_NET_WRITE) {
        kv_lc_write(k);
        if (k->dead) return;
    }
    if (ev & (KV_NET_READ | KV_NET_ERROR)) kv_lc_read(k);
}

/* A new circuit on stream sid. With peer_fd, a fresh socketpair whose
 * other end goes to *peer_fd; without (a coordinator's circuit before its
 * ACCEPT), no socket yet. NULL when out of memory or descriptors. */
static lcirc *kv_lc_new(kv_relay_client *c, uint32_t sid, int *peer_fd) {
    int sp[2] = {-1, -1};
    if (peer_fd && socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp)) return NULL;
    lcirc *k = calloc(1, sizeof *k);
    lcirc **a = k ? realloc(c->circ, (size_t)(c->n_circ + 1) * sizeof *a) : NULL;
    if (a) c->circ = a;
    if (!a || !(k->buf = malloc(c->window))) {
        free(k);
        if (sp[0] >= 0) close(sp[0]), close(sp[1]);
        return NULL;
    }
    if (sp[0] >= 0) fcntl(sp[0], F_SETFL, fcntl(sp[0], F_GETFL) | O_NONBLOCK);
    k->cl = c;
    k->sid = sid;
    k->fd = sp[0];
    k->credit = c->window;
    c->circ[c->n_circ++] = k;
    atomic_fetch_add(&c->st_circ, 1);
    atomic_fetch_add(&c->st_circ_total, 1);
    if (peer_fd) *peer_fd = sp[1];
    return k;
}

/* ---- frames from the relay ------------------------------------------------------------- */

static int kv_cl_lie(kv_relay_client *c, const char *why) {
    kv_clog(c, "relay client: %s (closing the connection)", why);
    (void)kv_relay_send_close(c->nc, KV_RELAY_ERROR, 0, KV_EPROTO, why);
    kv_net_conn_close(c->nc, KV_EPROTO, why);
    return KV_EPROTO;
}

static void kv_cl_send_open(kv_relay_client *c, open_req *r) {
    lcirc *k = kv_lc_new(c, ++c->next_sid, NULL);
    if (!k) {
        kv_req_finish(c, r, KV_ENOMEM, -1, "relay: cannot make a circuit (out of memory)");
        return;
    }
    k->req = r;
    r->sid = k->sid;
    (void)kv_relay_send(c->nc, KV_RELAY_OPEN, k->sid, r->pk, 32);
}

static int kv_cl_on_open(kv_relay_client *c, const kv_relay_frame *f) {
    if (c->o.role != KV_RELAY_ROLE_NODE || f->len) return kv_cl_lie(c, "an OPEN a coordinator cannot take");
    if (f->stream <= c->next_sid) return kv_cl_lie(c, "OPEN of a stream id not above the last");
    c->next_sid = f->stream;
    char why[96];
    if (c->n_circ >= c->o.max_circuits) {
        snprintf(why, sizeof why, "node: %d circuits open, its limit", c->n_circ);
        (void)kv_relay_send_close(c->nc, KV_RELAY_CLOSE, f->stream, KV_ERANGE, why);
        return 0;
    }
    int fd = -1;
    lcirc *k = kv_lc_new(c, f->stream, &fd);
    if (!k) {
        (void)kv_relay_send_close(c->nc, KV_RELAY_CLOSE, f->stream, KV_ENOMEM, "node: out of memory or descriptors");
        return 0;
    }
    (void)kv_relay_send(c->nc, KV_RELAY_ACCEPT, f->stream, NULL, 0);
    kv_lc_update(k);
    c->o.on_circuit(c->o.data, fd);
    return 0;
}

static int kv_cl_on_accept(kv_relay_client *c, lcirc *k) {
    if (!k->req) return kv_cl_lie(c, "ACCEPT of a circuit not waiting for one");
    int sp[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp)) {
        kv_lc_free(k, true, KV_EIO, "coordinator: out of descriptors");
        return 0;
    }
    fcntl(sp[0], F_SETFL, fcntl(sp[0], F_GETFL) | O_NONBLOCK);
    k->fd = sp[0];
    open_req *r = k->req;
    k->req = NULL;
    kv_req_finish(c, r, 0, sp[1], NULL);
    kv_lc_update(k);
    return 0;
}

static int kv_cl_on_welcome(kv_relay_client *c, const kv_relay_frame *f) {
    if (c->up) return kv_cl_lie(c, "a second WELCOME");
    if (f->version != KV_RELAY_VERSION) return kv_cl_lie(c, "the relay speaks another version");
    c->up = true;
    c->up_since_ms = kv_net_now_ms();
    c->window = f->window;
    c->max_payload = f->max_payload;
    kv_net_timer_stop(c->loop, &c->deadline_t);
    atomic_store(&c->st_up, true);
    atomic_fetch_add(&c->st_connects, 1);
    kv_clog(c, "relay client: connected to %s", c->relay);
    while (c->waiting) {
        open_req *r = c->waiting;
        c->waiting = r->next;
        kv_cl_send_open(c, r);
    }
    return 0;
}

static int kv_cl_frame(kv_net_conn *nc, const uint8_t *b, size_t n) {
    kv_relay_client *c = kv_net_conn_data(nc);
    kv_relay_frame f;
    kv_diag d = {0};
    if (kv_relay_frame_decode(b, n, &f, &d)) return kv_cl_lie(c, d.msg);
    if (f.type == KV_RELAY_WELCOME) return kv_cl_on_welcome(c, &f);
    if (f.type == KV_RELAY_ERROR) {
        char why[KV_RELAY_MAX_MSG + 32];
        snprintf(why, sizeof why, "relay: %.*s", (int)f.msg_len, f.msg);
        kv_net_conn_close(nc, f.code ? f.code : KV_EIO, why);
        return 0;
    }
    if (!c->up || f.type == KV_RELAY_HELLO) return kv_cl_lie(c, "a frame before WELCOME, or a HELLO");
    if (f.type == KV_RELAY_OPEN) return kv_cl_on_open(c, &f);
    lcirc *k = kv_lc_find(c, f.stream);
    if (!k) {
        if (f.stream <= c->next_sid) return 0; /* late: the circuit ended here */
        return kv_cl_lie(c, "a frame on a stream never opened");
    }
    switch (f.type) {
    case KV_RELAY_ACCEPT: return kv_cl_on_accept(c, k);
    case KV_RELAY_CREDIT:
        if (k->credit + f.credit > (int64_t)c->window) return kv_cl_lie(c, "CREDIT past the window");
        k->credit += f.credit;
        kv_lc_update(k);
        return 0;
    case KV_RELAY_DATA:
        if (k->req || f.len > c->window - k->len) return kv_cl_lie(c, "DATA past the credit we granted");
        if (k->head + k->len + f.len > c->window) {
            memmove(k->buf, k->buf + k->head, k->len);
            k->head = 0;
        }
        memcpy(k->buf + k->head + k->len, f.payload, f.len);
        k->len += f.len;
        k->to_grant += KV_RELAY_HEADER;
        kv_lc_write(k);
        return 0;
    case KV_RELAY_CLOSE: {
        char msg[KV_RELAY_MAX_MSG + 1];
        memcpy(msg, f.msg, f.msg_len);
        msg[f.msg_len] = 0;
        if (k->req || k->len == 0) {
            kv_lc_free(k, false, f.code ? f.code : KV_EIO, msg);
            return 0;
        }
        k->remote_closed = true; /* the bytes before the CLOSE are delivered first */
        kv_lc_update(k);
        return 0;
    }
    default: return kv_cl_lie(c, "an unexpected frame");
    }
}

/* ---- the connection and its backoff ------------------------------------------------------------ */

static void kv_cl_connect(kv_relay_client *c);

/* A coordinator connects only while it has opens waiting (the relay closes
 * a coordinator's idle connection); a node always. */
static bool kv_cl_wanted(const kv_relay_client *c) { return c->o.role == KV_RELAY_ROLE_NODE || c->waiting; }

static void kv_cl_retry(kv_net_loop *l, kv_net_timer *t) {
    kv_relay_client *c = t->data;
    (void)l;
    if (kv_cl_wanted(c)) kv_cl_connect(c);
}

static uint64_t kv_cl_rand(kv_relay_client *c) { /* xorshift64: jitter needs no more */
    c->rng ^= c->rng << 13;
    c->rng ^= c->rng >> 7;
    c->rng ^= c->rng << 17;
    return c->rng;
}

static void kv_cl_schedule(kv_relay_client *c, const char *why) {
    c->failures++;
    atomic_fetch_add(&c->st_failures, 1);
    int64_t delay = c->o.backoff_min_ms;
    for (int i = 1; i < c->failures && delay < c->o.backoff_max_ms; i++) delay *= 2;
    if (delay > c->o.backoff_max_ms) delay = c->o.backoff_max_ms;
    delay = delay / 2 + (int64_t)(kv_cl_rand(c) % (uint64_t)(delay / 2 + 1));
    atomic_store(&c->st_backoff, delay);
    pthread_mutex_lock(&c->mu);
    snprintf(c->last_error, sizeof c->last_error, "%s", why);
    pthread_mutex_unlock(&c->mu);
    kv_clog(c, "relay client: %s; retrying in %lld ms", why, (long long)delay);
    kv_net_timer_start(c->loop, &c->retry_t, delay);
}

static void kv_cl_open_cb(kv_net_conn *nc, int code) {
    kv_relay_client *c = kv_net_conn_data(nc);
    if (code) return; /* on_close follows */
    uint8_t h[KV_RELAY_HELLO_NODE_SIZE] = {(uint8_t)KV_RELAY_MAGIC, (uint8_t)(KV_RELAY_MAGIC >> 8),
                                           (uint8_t)(KV_RELAY_MAGIC >> 16), (uint8_t)(KV_RELAY_MAGIC >> 24),
                                           (uint8_t)KV_RELAY_VERSION, 0, (uint8_t)c->o.role, 0};
    uint32_t n = KV_RELAY_HELLO_SIZE;
    if (c->o.role == KV_RELAY_ROLE_NODE) {
        uint8_t ex[KV_TLS_EXPORTER_LEN], dg[32];
        if (kv_tls_exporter(c->tls, ex)) {
            kv_net_conn_close(nc, KV_EPROTO, "no TLS exporter");
            return;
        }
        kv_relay_node_digest(ex, c->o.key->pk, dg);
        memcpy(h + 8, c->o.key->pk, 32);
        kv_link_sign(c->o.key->sk, dg, h + 40);
        n = KV_RELAY_HELLO_NODE_SIZE;
    }
    (void)kv_relay_send(nc, KV_RELAY_HELLO, 0, h, n);
}

static void kv_cl_close_cb(kv_net_conn *nc, int code, const char *why) {
    kv_relay_client *c = kv_net_conn_data(nc);
    const bool stable = c->up && kv_net_now_ms() - c->up_since_ms >= KV_RELAY_STABLE_MS;
    char msg[256];
    snprintf(msg, sizeof msg, "relay %.100s: %.140s", c->relay, why && *why ? why : kv_err_str(code));
    c->nc = NULL;
    c->tls = NULL;
    c->up = false;
    atomic_store(&c->st_up, false);
    kv_net_timer_stop(c->loop, &c->deadline_t);
    while (c->n_circ) kv_lc_free(c->circ[c->n_circ - 1], false, KV_EIO, "the relay connection ended");
    if (stable) c->failures = 0;
    if (kv_net_loop_stopping(c->loop)) return;
    if (kv_cl_wanted(c)) {
        kv_cl_schedule(c, msg);
        return;
    }
    pthread_mutex_lock(&c->mu); /* an idle coordinator: the next open connects again */
    snprintf(c->last_error, sizeof c->last_error, "%s", msg);
    pthread_mutex_unlock(&c->mu);
    kv_clog(c, "relay client: %s; idle until the next open", msg);
}

static void kv_cl_deadline(kv_net_loop *l, kv_net_timer *t) {
    kv_relay_client *c = t->data;
    (void)l;
    char why[96];
    snprintf(why, sizeof why, "no WELCOME within %d ms", c->o.connect_timeout_ms);
    if (c->nc) kv_net_conn_close(c->nc, KV_ETIMEOUT, why);
}

static const kv_net_conn_cbs kv_cl_cbs = {
    .on_open = kv_cl_open_cb,
    .frame_len = kv_relay_frame_len,
    .on_frame = kv_cl_frame,
    .on_close = kv_cl_close_cb,
};

static void kv_cl_connect(kv_relay_client *c) {
    char host[256], ps[8], why[300];
    uint16_t port = 0;
    kv_diag d = {0};
    atomic_fetch_add(&c->st_attempts, 1);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    if (kv_link_parse_addr(c->relay, host, sizeof host, &port, &d)) {
        kv_cl_schedule(c, d.msg);
        return;
    }
    snprintf(ps, sizeof ps, "%u", port);
    int gr = getaddrinfo(host, ps, &hints, &res);
    if (gr) {
        snprintf(why, sizeof why, "relay %s: %s", c->relay, gai_strerror(gr));
        kv_cl_schedule(c, why);
        return;
    }
    kv_tls *t = NULL;
    const kv_tls_opts to = {.server = false, .pin_sha256 = c->pin, .alpn = KV_LINK_RELAY_ALPN};
    int rc = kv_tls_new(&t, c->o.tls, &to, &d);
    const size_t tx = (size_t)c->o.max_circuits * KV_RELAY_MAX_WINDOW + (4u << 20); /* a cap: credit bounds use */
    const kv_net_conn_opts o = {
        .header = KV_RELAY_HEADER,
        .max_frame = KV_RELAY_HEADER + KV_RELAY_MAX_PAYLOAD,
        .tx_max = tx,
        .frame_timeout_ms = 30000,
        .write_timeout_ms = 30000,
        .handshake_timeout_ms = c->o.connect_timeout_ms,
        .linger_ms = 50,
        .io = &kv_tls_net_io,
        .io_ctx = t,
    };
    if (!rc) rc = kv_net_conn_dial(&c->nc, c->loop, res->ai_addr, res->ai_addrlen, c->o.connect_timeout_ms, &o,
                                   &kv_cl_cbs, c, &d);
    freeaddrinfo(res);
    if (rc) {
        c->nc = NULL;
        kv_cl_schedule(c, d.msg);
        return;
    }
    c->tls = t;
    c->next_sid = 0;
    kv_net_timer_start(c->loop, &c->deadline_t, c->o.connect_timeout_ms);
}

/* ---- opens (coordinator) ------------------------------------------------------------------------- */

/* Takes new opens from other threads; fails the ones past their deadline. */
static bool kv_cl_tick(kv_net_loop *l, void *data) {
    kv_relay_client *c = data;
    (void)l;
    pthread_mutex_lock(&c->mu);
    open_req *in = c->incoming;
    c->incoming = NULL;
    pthread_mutex_unlock(&c->mu);
    while (in) {
        open_req *r = in;
        in = r->next;
        r->next = NULL;
        if (c->up) kv_cl_send_open(c, r);
        else r->next = c->waiting, c->waiting = r;
    }
    if (c->waiting && !c->nc && !kv_net_timer_armed(&c->retry_t)) kv_cl_connect(c);
    const int64_t now = kv_net_now_ms();
    for (open_req **p = &c->waiting; *p;) {
        open_req *r = *p;
        if (r->deadline_ms > now) {
            p = &r->next;
            continue;
        }
        *p = r->next;
        char le[256];
        pthread_mutex_lock(&c->mu);
        snprintf(le, sizeof le, "%s", c->last_error[0] ? c->last_error : "connecting");
        pthread_mutex_unlock(&c->mu);
        kv_req_finish(c, r, KV_ETIMEOUT, -1, "relay %s: not connected (%s)", c->relay, le);
    }
    for (int i = 0; i < c->n_circ; i++) {
        lcirc *k = c->circ[i];
        if (k->req && k->req->deadline_ms <= now) {
            kv_lc_free(k, true, KV_ETIMEOUT, "no ACCEPT from the node in time");
            i = -1;
        }
    }
    kv_lc_reap(c); /* the iteration's events are over: no watch names them any more */
    return false;
}

static void kv_cl_open_timer(kv_net_loop *l, kv_net_timer *t) { /* runs the tick's deadlines every 50 ms */
    kv_net_timer_start(l, t, 50);
}

int kv_relay_client_open(kv_relay_client *c, const uint8_t node_pk[32], int timeout_ms, int *fd, kv_diag *d) {
    *fd = -1;
    if (c->o.role != KV_RELAY_ROLE_COORD) return kv_fail(d, KV_EINVAL, "relay: only a coordinator opens circuits");
    if (timeout_ms <= 0) timeout_ms = 5000;
    open_req r = {.deadline_ms = kv_net_now_ms() + timeout_ms, .fd = -1};
    memcpy(r.pk, node_pk, 32);
    pthread_mutex_lock(&c->mu);
    r.next = c->incoming;
    c->incoming = &r;
    pthread_mutex_unlock(&c->mu);
    kv_net_loop_wake(c->loop);
    pthread_mutex_lock(&c->mu);
    while (!r.done) pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    if (r.rc) return kv_fail(d, r.rc, "%s", r.msg);
    int fl = fcntl(r.fd, F_GETFL);
    if (fl >= 0) fcntl(r.fd, F_SETFL, fl & ~O_NONBLOCK);
    *fd = r.fd;
    return 0;
}

int kv_relay_parse_url(const char *s, char *addr, size_t cap, char fp[KV_TLS_FP_HEX + 1], kv_diag *d) {
    static const char tag[] = "#sha256=";
    const char *h = s ? strstr(s, tag) : NULL;
    if (!h)
        return kv_fail(d, KV_EINVAL, "relay '%s': expected HOST:PORT#sha256=<64 hex digits> (the hub's tls line)",
                       s ? s : "");
    const size_t n = (size_t)(h - s);
    if (n == 0 || n >= cap) return kv_fail(d, KV_EINVAL, "relay: address of %zu characters", n);
    memcpy(addr, s, n);
    addr[n] = 0;
    char host[256];
    uint16_t port = 0;
    int rc = kv_link_parse_addr(addr, host, sizeof host, &port, d);
    if (!rc) rc = kv_tls_fingerprint_parse(h + sizeof tag - 1, strlen(h + sizeof tag - 1), fp, d);
    return rc ? kv_diag_prefix(d, rc, "relay '%s'", s) : 0;
}

/* ---- life ------------------------------------------------------------------------------------------- */

static void *kv_cl_thread(void *arg) {
    kv_relay_client *c = arg;
    kv_cl_connect(c);
    while (!kv_net_loop_stopping(c->loop))
        if (kv_net_loop_run_once(c->loop, 1000, NULL)) break;
    return NULL;
}

int kv_relay_client_start(kv_relay_client **out, const kv_relay_client_opts *o, kv_diag *d) {
    *out = NULL;
    if (!o || !o->relay || !o->tls) return kv_fail(d, KV_EINVAL, "relay client: a relay address and TLS context are required");
    if (o->role != KV_RELAY_ROLE_NODE && o->role != KV_RELAY_ROLE_COORD)
        return kv_fail(d, KV_EINVAL, "relay client: role %d is neither node nor coordinator", o->role);
    if (o->role == KV_RELAY_ROLE_NODE && (!o->key || !o->on_circuit))
        return kv_fail(d, KV_EINVAL, "relay client: a node needs its key and a circuit callback");
    if (strlen(o->relay) >= 256) return kv_fail(d, KV_EINVAL, "relay client: relay address too long");
    kv_relay_client *c = calloc(1, sizeof *c);
    if (!c) return kv_fail(d, KV_ENOMEM, "relay client: out of memory");
    int rc = o->relay_sha256 ? kv_tls_fingerprint_parse(o->relay_sha256, strlen(o->relay_sha256), c->pin, d)
                             : kv_fail(d, KV_EINVAL, "relay client: the relay's fingerprint (#sha256=...) is required");
    if (rc) {
        free(c);
        return rc;
    }
    c->o = *o;
    snprintf(c->relay, sizeof c->relay, "%s", o->relay);
    if (c->o.max_circuits <= 0) c->o.max_circuits = 64;
    if (c->o.backoff_min_ms <= 0) c->o.backoff_min_ms = 250;
    if (c->o.backoff_max_ms <= 0) c->o.backoff_max_ms = 30000;
    if (c->o.backoff_max_ms < c->o.backoff_min_ms) c->o.backoff_max_ms = c->o.backoff_min_ms;
    if (c->o.connect_timeout_ms <= 0) c->o.connect_timeout_ms = 5000;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    c->rng = ((uint64_t)ts.tv_nsec << 20) ^ (uint64_t)ts.tv_sec ^ (uint64_t)(uintptr_t)c ^ 0x9e3779b97f4a7c15ull;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    rc = kv_net_loop_new(&c->loop, d);
    if (rc) {
        kv_relay_client_free(c);
        return rc;
    }
    kv_net_timer_init(&c->retry_t, kv_cl_retry, c);
    kv_net_timer_init(&c->deadline_t, kv_cl_deadline, c);
    kv_net_timer_init(&c->open_t, kv_cl_open_timer, c);
    kv_net_timer_start(c->loop, &c->open_t, 50);
    kv_net_loop_set_tick(c->loop, kv_cl_tick, c);
    if (pthread_create(&c->th, NULL, kv_cl_thread, c)) {
        kv_relay_client_free(c);
        return kv_fail(d, KV_EIO, "relay client: cannot start a thread");
    }
    c->th_started = true;
    *out = c;
    return 0;
}

void kv_relay_client_stats_get(kv_relay_client *c, kv_relay_client_stats *out) {
    memset(out, 0, sizeof *out);
    out->up = atomic_load(&c->st_up);
    out->connects = atomic_load(&c->st_connects);
    out->attempts = atomic_load(&c->st_attempts);
    out->failures = atomic_load(&c->st_failures);
    out->last_backoff_ms = atomic_load(&c->st_backoff);
    out->circuits = atomic_load(&c->st_circ);
    out->circuits_total = atomic_load(&c->st_circ_total);
    pthread_mutex_lock(&c->mu);
    snprintf(out->last_error, sizeof out->last_error, "%s", c->last_error);
    pthread_mutex_unlock(&c->mu);
}

void kv_relay_client_free(kv_relay_client *c) {
    if (!c) return;
    if (c->th_started) {
        kv_net_loop_stop(c->loop);
        pthread_join(c->th, NULL);
    }
    while (c->n_circ) {
        lcirc *k = c->circ[c->n_circ - 1];
        if (k->wev && c->loop) kv_net_watch_del(c->loop, &k->w);
        k->wev = 0;
        kv_lc_free(k, false, KV_EIO, "the relay client stopped");
    }
    kv_lc_reap(c);
    for (open_req *r = c->waiting, *n; r; r = n) {
        n = r->next;
        kv_req_finish(c, r, KV_EIO, -1, "relay client stopped");
    }
    pthread_mutex_lock(&c->mu);
    open_req *in = c->incoming;
    c->incoming = NULL;
    pthread_mutex_unlock(&c->mu);
    for (open_req *r = in, *n; r; r = n) {
        n = r->next;
        kv_req_finish(c, r, KV_EIO, -1, "relay client stopped");
    }
    kv_net_loop_free(c->loop);
    free(c->circ);
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
    free(c);
}
