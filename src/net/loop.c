/* The event loop: epoll (level-triggered), a min-heap of caller-owned
 * timers, fd watches, and buffered framed connections (include/kvasir/net.h
 * has the contract).
 *
 * Invariants: everything runs on the loop's thread; a connection that
 * closes is unlinked from epoll at once but freed only when the iteration
 * ends (after on_close), so events already returned for it in the same
 * batch see state DEAD and are ignored. A connection's buffers are charged
 * to its budget before they grow and given back when they shrink or die.
 *
 * A transport with a handshake (TLS) holds the connection in state
 * HANDSHAKE, where only the transport's own readiness is watched, until it
 * is done; a transport holding decoded input (TLS records larger than the
 * room given to read) marks the connection io_ready, and such connections are
 * read once more each iteration, with a zero wait, until they hold none.
 *
 * Hot path: one read per readable connection per iteration (fairness
 * between connections), frames cut in place in the receive buffer, output
 * appended to one linear buffer and flushed on writability; no allocation
 * except when a buffer has to grow (bounded by max_frame and tx_max). */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/net.h"

#define KV_NET_EVENTS 64            /* epoll events taken per wait */
#define KV_NET_RX_MIN 4096u         /* smallest receive buffer */
#define KV_NET_KEEP (4u << 20)      /* buffers above this are freed when empty */
#define KV_NET_LINGER_BYTES (1u << 20) /* input discarded at most while closing */
#define KV_NET_HANDSHAKE_MS 10000   /* default bound of a transport handshake */

enum kv_nc_state { KV_NC_CONNECTING, KV_NC_HANDSHAKE, KV_NC_OPEN, KV_NC_FLUSH, KV_NC_LINGER, KV_NC_DEAD };

struct kv_net_loop {
    int ep;                       /* epoll fd */
    int evfd;                     /* eventfd: wake / stop */
    kv_net_watch wake;            /* watch of evfd */
    atomic_int stop;
    kv_net_timer **heap;          /* [n_heap] min-heap on at_ms */
    size_t n_heap, cap_heap;
    kv_net_tick_fn tick;
    void *tick_data;
    bool busy;                    /* the tick had more work */
    kv_net_conn *conns;           /* every live connection (doubly linked) */
    kv_net_conn *dead;            /* closed this iteration, freed at its end */
    size_t n_io_ready;            /* connections with io_ready set */
};

struct kv_net_conn {
    kv_net_loop *l;
    kv_net_watch w;               /* the socket's registration */
    int fd;                       /* the socket (owned) */
    kv_net_conn_opts o;
    kv_net_conn_cbs cbs;
    void *data;                   /* the owner's */
    enum kv_nc_state state;
    /* input */
    uint8_t *rx;                  /* [rx_cap] */
    size_t rx_cap, rx_have;       /* bytes buffered (the current frame first) */
    size_t rx_need;               /* size of the current frame, 0 until its header is in */
    bool held;                    /* the current frame is held by the owner */
    bool reading;                 /* the owner wants input */
    bool io_ready;                /* the transport holds input no readiness will announce */
    unsigned hs_wants;            /* HANDSHAKE: the readiness the transport waits for */
    size_t discarded;             /* bytes dropped while lingering */
    /* output */
    uint8_t *tx;                  /* [tx_cap] queue: [tx_off, tx_len) unsent */
    size_t tx_cap, tx_off, tx_len;
    /* deadlines */
    kv_net_timer frame_t;         /* frame started, not complete */
    kv_net_timer write_t;         /* output queued, no progress */
    kv_net_timer aux_t;           /* connect deadline, handshake deadline, then linger */
    /* closing */
    int code;
    char why[256];
    kv_net_conn *prev, *next;     /* in l->conns */
    kv_net_conn *next_dead;
};

int64_t kv_net_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- budget ----------------------------------------------------------------- */

void kv_net_budget_init(kv_net_budget *b, size_t limit) {
    atomic_init(&b->used, 0);
    atomic_init(&b->peak, 0);
    b->limit = limit;
}

bool kv_net_budget_take(kv_net_budget *b, size_t n) {
    if (!b) return true;
    size_t cur = atomic_load(&b->used);
    for (;;) {
        if (b->limit && (n > b->limit || cur > b->limit - n)) return false;
        if (atomic_compare_exchange_weak(&b->used, &cur, cur + n)) break;
    }
    size_t pk = atomic_load(&b->peak);
    while (cur + n > pk && !atomic_compare_exchange_weak(&b->peak, &pk, cur + n)) {
    }
    return true;
}

void kv_net_budget_give(kv_net_budget *b, size_t n) {
    if (b) atomic_fetch_sub(&b->used, n);
}

/* ---- timers: a binary min-heap of pointers ------------------------------------ */

void kv_net_timer_init(kv_net_timer *t, kv_net_timer_fn fn, void *data) {
    t->fn = fn;
    t->data = data;
    t->at_ms = 0;
    t->slot = 0;
}

static void kv_heap_set(kv_net_loop *l, size_t i, kv_net_timer *t) {
    l->heap[i] = t;
    t->slot = i + 1;
}

static void kv_heap_up(kv_net_loop *l, size_t i) {
    kv_net_timer *t = l->heap[i];
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (l->heap[p]->at_ms <= t->at_ms) break;
        kv_heap_set(l, i, l->heap[p]);
        i = p;
    }
    kv_heap_set(l, i, t);
}

static void kv_heap_down(kv_net_loop *l, size_t i) {
    kv_net_timer *t = l->heap[i];
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= l->n_heap) break;
        if (c + 1 < l->n_heap && l->heap[c + 1]->at_ms < l->heap[c]->at_ms) c++;
        if (t->at_ms <= l->heap[c]->at_ms) break;
        kv_heap_set(l, i, l->heap[c]);
        i = c;
    }
    kv_heap_set(l, i, t);
}

void kv_net_timer_stop(kv_net_loop *l, kv_net_timer *t) {
    if (!t->slot) return;
    size_t i = t->slot - 1;
    t->slot = 0;
    l->n_heap--;
    if (i == l->n_heap) return;
    kv_net_timer *m = l->heap[l->n_heap];
    kv_heap_set(l, i, m);
    kv_heap_up(l, i);
    kv_heap_down(l, m->slot - 1);
}

int kv_net_timer_start(kv_net_loop *l, kv_net_timer *t, int64_t delay_ms) {
    kv_net_timer_stop(l, t);
    if (l->n_heap == l->cap_heap) {
        size_t nc = l->cap_heap ? l->cap_heap * 2 : 64;
        kv_net_timer **nh = realloc(l->heap, nc * sizeof *nh);
        if (!nh) return KV_ENOMEM;
        l->heap = nh;
        l->cap_heap = nc;
    }
    t->at_ms = kv_net_now_ms() + (delay_ms > 0 ? delay_ms : 0);
    l->heap[l->n_heap] = t;
    t->slot = ++l->n_heap;
    kv_heap_up(l, l->n_heap - 1);
    return 0;
}

/* ---- loop ----------------------------------------------------------------------- */

static void kv_wake_fn(kv_net_loop *l, kv_net_watch *w, unsigned ev) {
    uint64_t v;
    ssize_t k = read(w->fd, &v, sizeof v);
    (void)k;
    (void)l;
    (void)ev;
}

int kv_net_loop_new(kv_net_loop **out, kv_diag *d) {
    *out = NULL;
    kv_net_loop *l = calloc(1, sizeof *l);
    if (!l) return kv_fail(d, KV_ENOMEM, "net: out of memory");
    l->ep = epoll_create1(EPOLL_CLOEXEC);
    l->evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (l->ep < 0 || l->evfd < 0) {
        int e = errno;
        if (l->ep >= 0) close(l->ep);
        if (l->evfd >= 0) close(l->evfd);
        free(l);
        return kv_fail(d, KV_EIO, "net: epoll/eventfd: %s", strerror(e));
    }
    int rc = kv_net_watch_add(l, &l->wake, l->evfd, KV_NET_READ, kv_wake_fn, NULL, d);
    if (rc) {
        close(l->ep);
        close(l->evfd);
        free(l);
        return rc;
    }
    *out = l;
    return 0;
}

static void kv_conn_release_mem(kv_net_conn *c);
static void kv_conn_run_io_ready(kv_net_loop *l);

void kv_net_loop_free(kv_net_loop *l) {
    if (!l) return;
    for (kv_net_conn *c = l->conns, *n; c; c = n) {
        n = c->next;
        if (c->fd >= 0) close(c->fd);
        if (c->o.io && c->o.io->close) c->o.io->close(c->o.io_ctx);
        kv_conn_release_mem(c);
        free(c);
    }
    for (kv_net_conn *c = l->dead, *n; c; c = n) {
        n = c->next_dead;
        free(c);
    }
    close(l->ep);
    close(l->evfd);
    free(l->heap);
    free(l);
}

void kv_net_loop_set_tick(kv_net_loop *l, kv_net_tick_fn fn, void *data) {
    l->tick = fn;
    l->tick_data = data;
}

void kv_net_loop_wake(kv_net_loop *l) {
    uint64_t one = 1;
    ssize_t k = write(l->evfd, &one, sizeof one);
    (void)k;
}

void kv_net_loop_stop(kv_net_loop *l) {
    atomic_store(&l->stop, 1);
    kv_net_loop_wake(l);
}

bool kv_net_loop_stopping(const kv_net_loop *l) { return atomic_load(&((kv_net_loop *)l)->stop) != 0; }

static void kv_reap(kv_net_loop *l) {
    while (l->dead) {
        kv_net_conn *c = l->dead;
        l->dead = c->next_dead;
        if (c->cbs.on_close) c->cbs.on_close(c, c->code, c->why);
        free(c);
    }
}

int kv_net_loop_run_once(kv_net_loop *l, int timeout_ms, kv_diag *d) {
    int64_t now = kv_net_now_ms();
    int wait = l->busy || l->n_io_ready ? 0 : timeout_ms;
    if (l->n_heap) {
        int64_t left = l->heap[0]->at_ms - now;
        if (left < 0) left = 0;
        if (wait < 0 || left < wait) wait = (int)(left > 1 << 30 ? 1 << 30 : left);
    }
    struct epoll_event ev[KV_NET_EVENTS];
    int n = epoll_wait(l->ep, ev, KV_NET_EVENTS, wait);
    if (n < 0) {
        if (errno != EINTR) return kv_fail(d, KV_EIO, "net: epoll_wait: %s", strerror(errno));
        n = 0;
    }
    for (int i = 0; i < n; i++) {
        kv_net_watch *w = ev[i].data.ptr;
        unsigned e = 0;
        if (ev[i].events & EPOLLIN) e |= KV_NET_READ;
        if (ev[i].events & EPOLLOUT) e |= KV_NET_WRITE;
        if (ev[i].events & (EPOLLERR | EPOLLHUP)) e |= KV_NET_ERROR | KV_NET_READ;
        w->fn(l, w, e);
    }
    kv_conn_run_io_ready(l);
    now = kv_net_now_ms();
    while (l->n_heap && l->heap[0]->at_ms <= now) {
        kv_net_timer *t = l->heap[0];
        kv_net_timer_stop(l, t);
        t->fn(l, t);
    }
    l->busy = l->tick ? l->tick(l, l->tick_data) : false;
    kv_reap(l);
    return 0;
}

int kv_net_loop_run(kv_net_loop *l, kv_diag *d) {
    while (!kv_net_loop_stopping(l)) {
        int rc = kv_net_loop_run_once(l, -1, d);
        if (rc) return rc;
    }
    return 0;
}

/* ---- watches ------------------------------------------------------------------------ */

static uint32_t kv_epoll_bits(unsigned ev) {
    return (ev & KV_NET_READ ? EPOLLIN : 0u) | (ev & KV_NET_WRITE ? EPOLLOUT : 0u);
}

int kv_net_watch_add(kv_net_loop *l, kv_net_watch *w, int fd, unsigned events, kv_net_watch_fn fn,
                     void *data, kv_diag *d) {
    w->fd = fd;
    w->fn = fn;
    w->data = data;
    w->events = events;
    struct epoll_event e = {.events = kv_epoll_bits(events), .data.ptr = w};
    if (epoll_ctl(l->ep, EPOLL_CTL_ADD, fd, &e))
        return kv_fail(d, KV_EIO, "net: epoll_ctl: %s", strerror(errno));
    return 0;
}

static void kv_watch_mod(kv_net_loop *l, kv_net_watch *w, unsigned events) {
    if (w->events == events) return;
    w->events = events;
    struct epoll_event e = {.events = kv_epoll_bits(events), .data.ptr = w};
    (void)epoll_ctl(l->ep, EPOLL_CTL_MOD, w->fd, &e);
}

void kv_net_watch_del(kv_net_loop *l, kv_net_watch *w) {
    if (w->fd >= 0) (void)epoll_ctl(l->ep, EPOLL_CTL_DEL, w->fd, NULL);
    w->fd = -1;
}

/* ---- connections: buffers ------------------------------------------------------------- */

static void kv_conn_release_mem(kv_net_conn *c) {
    kv_net_budget_give(c->o.budget, c->rx_cap + c->tx_cap);
    free(c->rx);
    free(c->tx);
    c->rx = c->tx = NULL;
    c->rx_cap = c->tx_cap = 0;
}

/* Resizes *buf to nc bytes, charging or refunding the budget. */
static int kv_conn_resize(kv_net_conn *c, uint8_t **buf, size_t *cap, size_t nc) {
    if (nc > *cap && !kv_net_budget_take(c->o.budget, nc - *cap)) return KV_ENOMEM;
    uint8_t *nb = nc ? realloc(*buf, nc) : (free(*buf), NULL);
    if (nc && !nb) {
        kv_net_budget_give(c->o.budget, nc - *cap);
        return KV_ENOMEM;
    }
    if (nc < *cap) kv_net_budget_give(c->o.budget, *cap - nc);
    *buf = nb;
    *cap = nc;
    return 0;
}

/* Marks c io_ready when its transport holds input the owner wants. */
static void kv_conn_check_pending(kv_net_conn *c) {
    if (c->io_ready || c->state != KV_NC_OPEN || !c->reading || c->held) return;
    if (!c->o.io || !c->o.io->pending || c->o.io->pending(c->o.io_ctx) == 0) return;
    c->io_ready = true;
    c->l->n_io_ready++;
}

static void kv_conn_update(kv_net_conn *c) {
    if (c->state == KV_NC_DEAD) return;
    unsigned ev = 0;
    if (c->state == KV_NC_CONNECTING) ev = KV_NET_WRITE;
    else if (c->state == KV_NC_HANDSHAKE) ev = c->hs_wants;
    else {
        if (c->tx_len > c->tx_off) ev |= KV_NET_WRITE;
        if (c->state != KV_NC_OPEN || (c->reading && !c->held)) ev |= KV_NET_READ;
    }
    kv_watch_mod(c->l, &c->w, ev);
    kv_conn_check_pending(c);
}

/* Ends c now: unregisters, closes the fd, frees buffers; on_close and the
 * free happen when the iteration ends. */
static void kv_conn_finish(kv_net_conn *c, int code, const char *why) {
    if (c->state == KV_NC_DEAD) return;
    kv_net_loop *l = c->l;
    if (c->code == 0 && code) c->code = code;
    if (why && (!c->why[0] || code)) snprintf(c->why, sizeof c->why, "%s", why);
    c->state = KV_NC_DEAD;
    if (c->io_ready) {
        c->io_ready = false;
        l->n_io_ready--;
    }
    kv_net_watch_del(l, &c->w);
    kv_net_timer_stop(l, &c->frame_t);
    kv_net_timer_stop(l, &c->write_t);
    kv_net_timer_stop(l, &c->aux_t);
    close(c->fd);
    c->fd = -1;
    if (c->o.io && c->o.io->close) c->o.io->close(c->o.io_ctx);
    kv_conn_release_mem(c);
    if (c->prev) c->prev->next = c->next;
    else l->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    c->prev = c->next = NULL;
    c->next_dead = l->dead;
    l->dead = c;
}

static ssize_t kv_conn_read(kv_net_conn *c, void *buf, size_t n) {
    if (c->o.io && c->o.io->read) return c->o.io->read(c->o.io_ctx, c->fd, buf, n);
    return recv(c->fd, buf, n, 0);
}

static ssize_t kv_conn_write(kv_net_conn *c, const void *buf, size_t n) {
    if (c->o.io && c->o.io->write) return c->o.io->write(c->o.io_ctx, c->fd, buf, n);
    return send(c->fd, buf, n, MSG_NOSIGNAL);
}

/* The reason for a failed read/write: the transport's, or "op: strerror". */
static const char *kv_conn_io_why(kv_net_conn *c, const char *op, int err, char *buf, size_t cap) {
    const char *w = c->o.io && c->o.io->why ? c->o.io->why(c->o.io_ctx) : NULL;
    if (w && *w) return w;
    snprintf(buf, cap, "%s: %s", op, err ? strerror(err) : "nothing written");
    return buf;
}

/* Half-closes and starts the linger (input discarded until EOF or the
 * linger timer). */
static void kv_conn_linger(kv_net_conn *c) {
    shutdown(c->fd, SHUT_WR);
    c->state = KV_NC_LINGER;
    c->held = false;
    kv_net_timer_stop(c->l, &c->frame_t);
    kv_net_timer_stop(c->l, &c->write_t);
    kv_net_timer_start(c->l, &c->aux_t, c->o.linger_ms);
    kv_conn_update(c);
}

/* Writes what is queued until EAGAIN. */
static void kv_conn_flush(kv_net_conn *c) {
    bool progress = false;
    while (c->tx_off < c->tx_len) {
        ssize_t k = kv_conn_write(c, c->tx + c->tx_off, c->tx_len - c->tx_off);
        if (k > 0) {
            c->tx_off += (size_t)k;
            progress = true;
        } else if (k < 0 && errno == EINTR) {
            continue;
        } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            break;
        } else {
            char why[160];
            kv_conn_finish(c, KV_EIO, kv_conn_io_why(c, "send", k < 0 ? errno : 0, why, sizeof why));
            return;
        }
    }
    if (c->tx_off == c->tx_len) {
        c->tx_off = c->tx_len = 0;
        kv_net_timer_stop(c->l, &c->write_t);
        if (c->tx_cap > c->o.keep) (void)kv_conn_resize(c, &c->tx, &c->tx_cap, 0);
        if (c->state == KV_NC_FLUSH) {
            kv_conn_linger(c);
            return;
        }
        kv_conn_update(c);
        if (progress && c->state == KV_NC_OPEN && c->cbs.on_drain) c->cbs.on_drain(c);
        return;
    }
    if (progress && c->o.write_timeout_ms > 0) kv_net_timer_start(c->l, &c->write_t, c->o.write_timeout_ms);
    kv_conn_update(c);
}

/* Drops the first n bytes of the receive buffer (a consumed frame). */
static void kv_conn_consume(kv_net_conn *c, size_t n) {
    memmove(c->rx, c->rx + n, c->rx_have - n);
    c->rx_have -= n;
    c->rx_need = 0;
    if (c->rx_have == 0 && c->rx_cap > c->o.keep) (void)kv_conn_resize(c, &c->rx, &c->rx_cap, KV_NET_RX_MIN);
}

/* An input-side failure (bad header, frame too big or too slow, no memory):
 * the owner may queue a last frame (on_error), then c closes. */
static void kv_conn_fail_input(kv_net_conn *c, int code, const char *why) {
    if (c->state != KV_NC_OPEN) return;
    if (c->cbs.on_error) c->cbs.on_error(c, code, why);
    kv_net_conn_close(c, code, why);
}

/* Cuts and delivers the frames buffered, until one is incomplete or held. */
static void kv_conn_process(kv_net_conn *c) {
    while (c->state == KV_NC_OPEN && !c->held && c->reading) {
        if (c->rx_need == 0) {
            if (c->rx_have < c->o.header) break;
            kv_diag d = {0};
            size_t total = 0;
            int rc = c->cbs.frame_len(c, c->rx, &total, &d);
            if (rc == 0 && (total < c->o.header || total > c->o.max_frame)) {
                rc = kv_fail(&d, KV_ERANGE, "frame of %zu bytes exceeds the %zu this connection accepts", total,
                             c->o.max_frame);
            }
            if (rc) {
                kv_conn_fail_input(c, rc, d.msg[0] ? d.msg : kv_err_str(rc));
                return;
            }
            c->rx_need = total;
        }
        if (c->rx_have < c->rx_need) break;
        kv_net_timer_stop(c->l, &c->frame_t);
        const size_t n = c->rx_need;
        int rc = c->cbs.on_frame(c, c->rx, n);
        if (c->state != KV_NC_OPEN) return;
        if (rc == KV_NET_HOLD) {
            c->held = true;
            kv_conn_update(c);
            return;
        }
        if (rc < 0) {
            kv_net_conn_close(c, rc, kv_err_str(rc));
            return;
        }
        kv_conn_consume(c, n);
        if (c->rx_have && c->o.frame_timeout_ms > 0) kv_net_timer_start(c->l, &c->frame_t, c->o.frame_timeout_ms);
    }
}

static void kv_conn_on_read(kv_net_conn *c) {
    if (c->state == KV_NC_LINGER) { /* discard until EOF */
        uint8_t sink[4096];
        ssize_t k = kv_conn_read(c, sink, sizeof sink);
        if (k > 0) c->discarded += (size_t)k;
        if (k == 0 || (k < 0 && errno != EAGAIN && errno != EINTR && errno != EWOULDBLOCK) ||
            c->discarded > KV_NET_LINGER_BYTES)
            kv_conn_finish(c, 0, NULL);
        return;
    }
    if (c->state == KV_NC_FLUSH) { /* still sending: input is dropped */
        uint8_t sink[4096];
        ssize_t k = kv_conn_read(c, sink, sizeof sink);
        if (k == 0) kv_conn_finish(c, 0, NULL); /* peer gone: nothing to flush to */
        return;
    }
    if (c->state != KV_NC_OPEN || c->held || !c->reading) return;
    /* room: grow with what arrives, towards the current frame's size */
    if (c->rx_have == c->rx_cap || (c->rx_need > c->rx_cap && c->rx_cap - c->rx_have < 4096)) {
        size_t target = c->rx_cap * 2;
        if (c->rx_need && target > c->rx_need) target = c->rx_need;
        if (target < c->rx_have + 1) target = c->rx_have + 1;
        if (target > c->o.max_frame && c->o.max_frame > c->rx_cap) target = c->o.max_frame;
        if (target <= c->rx_cap || kv_conn_resize(c, &c->rx, &c->rx_cap, target)) {
            kv_conn_fail_input(c, KV_ENOMEM, "memory budget exhausted: cannot buffer the frame");
            return;
        }
    }
    const bool start = c->rx_have == 0;
    ssize_t k = kv_conn_read(c, c->rx + c->rx_have, c->rx_cap - c->rx_have);
    if (k < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
        char why[160];
        kv_conn_finish(c, KV_EIO, kv_conn_io_why(c, "read", errno, why, sizeof why));
        return;
    }
    if (k == 0) {
        if (c->rx_have == 0) kv_conn_finish(c, 0, "closed by peer");
        else {
            char why[160];
            snprintf(why, sizeof why, "closed inside a frame (%zu of %zu bytes)", c->rx_have,
                     c->rx_need ? c->rx_need : c->o.header);
            kv_conn_finish(c, KV_EIO, why);
        }
        return;
    }
    c->rx_have += (size_t)k;
    if (start && c->o.frame_timeout_ms > 0) kv_net_timer_start(c->l, &c->frame_t, c->o.frame_timeout_ms);
    kv_conn_process(c);
    kv_conn_check_pending(c);
}

/* Reads connections whose transport holds input (kv_conn_check_pending).
 * A connection closed meanwhile is unlinked and ends the walk early; the
 * ones left stay marked and are read on the next iteration. */
static void kv_conn_run_io_ready(kv_net_loop *l) {
    for (kv_net_conn *c = l->conns, *n; c && l->n_io_ready; c = n) {
        n = c->next;
        if (!c->io_ready) continue;
        c->io_ready = false;
        l->n_io_ready--;
        kv_conn_on_read(c);
    }
}

/* Drives the transport's handshake; at its end the connection opens:
 * on_open, then what the owner queued meanwhile is flushed. */
static void kv_conn_handshake(kv_net_conn *c) {
    const int r = c->o.io->handshake(c->o.io_ctx, c->fd);
    if (r < 0) {
        char why[160];
        const char *w = c->o.io->why ? c->o.io->why(c->o.io_ctx) : NULL;
        snprintf(why, sizeof why, "%s", w && *w ? w : kv_err_str(r));
        if (c->cbs.on_open) c->cbs.on_open(c, r);
        kv_conn_finish(c, r, why);
        return;
    }
    if (r > 0) {
        c->hs_wants = (unsigned)r & (KV_NET_READ | KV_NET_WRITE);
        if (!c->hs_wants) c->hs_wants = KV_NET_READ;
        kv_conn_update(c);
        return;
    }
    c->state = KV_NC_OPEN;
    kv_net_timer_stop(c->l, &c->aux_t);
    kv_conn_update(c);
    if (c->cbs.on_open) c->cbs.on_open(c, 0);
    if (c->state != KV_NC_OPEN || c->tx_len == c->tx_off) return;
    if (c->o.write_timeout_ms > 0) kv_net_timer_start(c->l, &c->write_t, c->o.write_timeout_ms);
    kv_conn_flush(c);
}

/* Enters the handshake phase (bounded by handshake_timeout_ms); the first
 * call to the transport happens on the loop, on either readiness. */
static void kv_conn_begin_handshake(kv_net_conn *c) {
    c->state = KV_NC_HANDSHAKE;
    c->hs_wants = KV_NET_READ | KV_NET_WRITE;
    kv_net_timer_start(c->l, &c->aux_t, c->o.handshake_timeout_ms);
    kv_conn_update(c);
}

static void kv_conn_io(kv_net_loop *l, kv_net_watch *w, unsigned ev) {
    kv_net_conn *c = w->data;
    (void)l;
    if (c->state == KV_NC_DEAD) return;
    if (c->state == KV_NC_CONNECTING) {
        if (!(ev & (KV_NET_WRITE | KV_NET_ERROR))) return;
        int err = 0;
        socklen_t el = sizeof err;
        if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &el) || err) {
            char why[160];
            snprintf(why, sizeof why, "connect: %s", strerror(err ? err : errno));
            if (c->cbs.on_open) c->cbs.on_open(c, KV_EIO);
            kv_conn_finish(c, KV_EIO, why);
            return;
        }
        kv_net_timer_stop(c->l, &c->aux_t);
        if (c->o.io && c->o.io->handshake) {
            kv_conn_begin_handshake(c);
            return;
        }
        c->state = KV_NC_OPEN;
        kv_conn_update(c);
        if (c->cbs.on_open) c->cbs.on_open(c, 0);
        if (c->state == KV_NC_DEAD) return;
    }
    if (c->state == KV_NC_HANDSHAKE) {
        kv_conn_handshake(c);
        return;
    }
    if (ev & KV_NET_WRITE) kv_conn_flush(c);
    if (c->state == KV_NC_DEAD) return;
    if (ev & KV_NET_READ) kv_conn_on_read(c);
}

static void kv_frame_timeout(kv_net_loop *l, kv_net_timer *t) {
    kv_net_conn *c = t->data;
    (void)l;
    char why[160];
    snprintf(why, sizeof why, "frame not complete within %d ms (%zu of %zu bytes)", c->o.frame_timeout_ms,
             c->rx_have, c->rx_need ? c->rx_need : c->o.header);
    kv_conn_fail_input(c, KV_ETIMEOUT, why);
}

static void kv_write_timeout(kv_net_loop *l, kv_net_timer *t) {
    kv_net_conn *c = t->data;
    (void)l;
    char why[160];
    snprintf(why, sizeof why, "peer read nothing for %d ms (%zu bytes queued)", c->o.write_timeout_ms,
             c->tx_len - c->tx_off);
    kv_conn_finish(c, KV_ETIMEOUT, why);
}

static void kv_aux_timeout(kv_net_loop *l, kv_net_timer *t) {
    kv_net_conn *c = t->data;
    (void)l;
    if (c->state == KV_NC_CONNECTING) {
        if (c->cbs.on_open) c->cbs.on_open(c, KV_ETIMEOUT);
        kv_conn_finish(c, KV_ETIMEOUT, "connect timed out");
    } else if (c->state == KV_NC_HANDSHAKE) {
        char why[160];
        snprintf(why, sizeof why, "handshake not complete within %d ms", c->o.handshake_timeout_ms);
        if (c->cbs.on_open) c->cbs.on_open(c, KV_ETIMEOUT);
        kv_conn_finish(c, KV_ETIMEOUT, why);
    } else {
        kv_conn_finish(c, 0, NULL); /* linger over */
    }
}

/* A connection that could not be made releases its transport's state. */
static void kv_conn_drop_io(const kv_net_conn_opts *o) {
    if (o && o->io && o->io->close) o->io->close(o->io_ctx);
}

static int kv_conn_setup(kv_net_conn **out, kv_net_loop *l, int fd, bool connecting, const kv_net_conn_opts *o,
                         const kv_net_conn_cbs *cbs, void *data, kv_diag *d) {
    *out = NULL;
    if (!o || !cbs || !cbs->frame_len || !cbs->on_frame || o->header == 0 || o->max_frame < o->header) {
        close(fd);
        kv_conn_drop_io(o);
        return kv_fail(d, KV_EINVAL, "net: bad connection options");
    }
    kv_net_conn *c = calloc(1, sizeof *c);
    if (!c) {
        close(fd);
        kv_conn_drop_io(o);
        return kv_fail(d, KV_ENOMEM, "net: out of memory");
    }
    c->l = l;
    c->fd = fd;
    c->o = *o;
    if (c->o.linger_ms <= 0) c->o.linger_ms = 250;
    if (c->o.keep == 0) c->o.keep = KV_NET_KEEP;
    if (c->o.handshake_timeout_ms <= 0) c->o.handshake_timeout_ms = KV_NET_HANDSHAKE_MS;
    c->cbs = *cbs;
    c->data = data;
    c->reading = true;
    c->state = connecting ? KV_NC_CONNECTING : KV_NC_OPEN;
    kv_net_timer_init(&c->frame_t, kv_frame_timeout, c);
    kv_net_timer_init(&c->write_t, kv_write_timeout, c);
    kv_net_timer_init(&c->aux_t, kv_aux_timeout, c);
    size_t first = KV_NET_RX_MIN > c->o.max_frame ? c->o.max_frame : KV_NET_RX_MIN;
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) || kv_conn_resize(c, &c->rx, &c->rx_cap, first)) {
        close(fd);
        kv_conn_release_mem(c);
        free(c);
        kv_conn_drop_io(o);
        return kv_fail(d, KV_ENOMEM, "net: cannot set up a connection (memory budget or fcntl)");
    }
    int rc = kv_net_watch_add(l, &c->w, fd, connecting ? KV_NET_WRITE : KV_NET_READ, kv_conn_io, c, d);
    if (rc) {
        close(fd);
        kv_conn_release_mem(c);
        free(c);
        kv_conn_drop_io(o);
        return rc;
    }
    c->next = l->conns;
    if (l->conns) l->conns->prev = c;
    l->conns = c;
    if (!connecting && c->o.io && c->o.io->handshake) kv_conn_begin_handshake(c);
    *out = c;
    return 0;
}

int kv_net_conn_new(kv_net_conn **out, kv_net_loop *l, int fd, const kv_net_conn_opts *o,
                    const kv_net_conn_cbs *cbs, void *data, kv_diag *d) {
    return kv_conn_setup(out, l, fd, false, o, cbs, data, d);
}

int kv_net_conn_dial(kv_net_conn **out, kv_net_loop *l, const struct sockaddr *addr, socklen_t alen,
                     int connect_timeout_ms, const kv_net_conn_opts *o, const kv_net_conn_cbs *cbs, void *data,
                     kv_diag *d) {
    *out = NULL;
    int fd = socket(addr->sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, IPPROTO_TCP);
    if (fd < 0) {
        int e = errno;
        kv_conn_drop_io(o);
        return kv_fail(d, KV_EIO, "net: socket: %s", strerror(e));
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, addr, alen) && errno != EINPROGRESS) {
        int e = errno;
        close(fd);
        kv_conn_drop_io(o);
        return kv_fail(d, KV_EIO, "net: connect: %s", strerror(e));
    }
    int rc = kv_conn_setup(out, l, fd, true, o, cbs, data, d);
    if (!rc && connect_timeout_ms > 0) kv_net_timer_start(l, &(*out)->aux_t, connect_timeout_ms);
    return rc;
}

void *kv_net_conn_data(const kv_net_conn *c) { return c->data; }
int kv_net_conn_fd(const kv_net_conn *c) { return c->fd; }
bool kv_net_conn_closing(const kv_net_conn *c) {
    return c->state != KV_NC_OPEN && c->state != KV_NC_CONNECTING && c->state != KV_NC_HANDSHAKE;
}
size_t kv_net_conn_pending(const kv_net_conn *c) { return c->tx_len - c->tx_off; }
size_t kv_net_conn_mem(const kv_net_conn *c) { return c->rx_cap + c->tx_cap; }

void kv_net_conn_release(kv_net_conn *c) {
    if (!c->held || c->state != KV_NC_OPEN) return;
    c->held = false;
    kv_conn_consume(c, c->rx_need ? c->rx_need : 0);
    if (c->rx_have && c->o.frame_timeout_ms > 0) kv_net_timer_start(c->l, &c->frame_t, c->o.frame_timeout_ms);
    kv_conn_update(c);
    kv_conn_process(c);
}

void kv_net_conn_set_reading(kv_net_conn *c, bool on) {
    if (c->reading == on || (c->state != KV_NC_OPEN && c->state != KV_NC_HANDSHAKE)) return;
    c->reading = on;
    kv_conn_update(c);
    if (on) kv_conn_process(c);
}

uint8_t *kv_net_conn_reserve(kv_net_conn *c, size_t n) {
    if (c->state != KV_NC_OPEN && c->state != KV_NC_CONNECTING && c->state != KV_NC_HANDSHAKE) return NULL;
    const size_t queued = c->tx_len - c->tx_off;
    if (n > c->o.tx_max || queued > c->o.tx_max - n) {
        kv_conn_finish(c, KV_ENOMEM, "output queue over its limit");
        return NULL;
    }
    if (c->tx_cap - c->tx_len < n && c->tx_off) {
        memmove(c->tx, c->tx + c->tx_off, queued);
        c->tx_off = 0;
        c->tx_len = queued;
    }
    if (c->tx_cap - c->tx_len < n) {
        size_t nc = c->tx_cap ? c->tx_cap : 4096;
        while (nc < c->tx_len + n) nc *= 2;
        if (nc > c->o.tx_max && c->o.tx_max >= c->tx_len + n) nc = c->o.tx_max;
        if (kv_conn_resize(c, &c->tx, &c->tx_cap, nc)) {
            kv_conn_finish(c, KV_ENOMEM, "memory budget exhausted: cannot queue output");
            return NULL;
        }
    }
    return c->tx + c->tx_len;
}

void kv_net_conn_commit(kv_net_conn *c, size_t n) {
    if (c->state == KV_NC_DEAD) return;
    const bool was_empty = c->tx_len == c->tx_off;
    c->tx_len += n;
    /* in the handshake, the write deadline starts when the connection opens */
    if (was_empty && c->o.write_timeout_ms > 0 && c->state != KV_NC_HANDSHAKE)
        kv_net_timer_start(c->l, &c->write_t, c->o.write_timeout_ms);
    kv_conn_update(c);
}

void kv_net_conn_commit_now(kv_net_conn *c, size_t n) {
    if (c->state != KV_NC_OPEN || c->tx_len != c->tx_off) { /* the loop's writer owns the queue */
        kv_net_conn_commit(c, n);
        return;
    }
    c->tx_len += n;
    kv_conn_flush(c); /* all taken: no interest changed; some left: EPOLLOUT armed for it */
    if (c->state != KV_NC_DEAD && c->tx_len > c->tx_off && c->o.write_timeout_ms > 0 &&
        !kv_net_timer_armed(&c->write_t))
        kv_net_timer_start(c->l, &c->write_t, c->o.write_timeout_ms);
}

int kv_net_conn_send(kv_net_conn *c, const void *buf, size_t n) {
    uint8_t *p = kv_net_conn_reserve(c, n);
    if (!p) return KV_ENOMEM;
    memcpy(p, buf, n);
    kv_net_conn_commit(c, n);
    return 0;
}

void kv_net_conn_close(kv_net_conn *c, int code, const char *why) {
    if (c->state == KV_NC_DEAD || c->state == KV_NC_FLUSH || c->state == KV_NC_LINGER) return;
    c->code = code;
    snprintf(c->why, sizeof c->why, "%s", why ? why : "");
    if (c->state == KV_NC_CONNECTING || c->state == KV_NC_HANDSHAKE) {
        kv_conn_finish(c, code, why);
        return;
    }
    c->held = false;
    kv_net_timer_stop(c->l, &c->frame_t);
    if (c->tx_len > c->tx_off) {
        c->state = KV_NC_FLUSH;
        if (!kv_net_timer_armed(&c->write_t))
            kv_net_timer_start(c->l, &c->write_t, c->o.write_timeout_ms > 0 ? c->o.write_timeout_ms : 2000);
        kv_conn_update(c);
    } else {
        kv_conn_linger(c);
    }
}

/* ---- listening ----------------------------------------------------------------------- */

int kv_net_listen(const char *host_port, int backlog, int *out_fd, char *addr, size_t cap, kv_diag *d) {
    char host[256];
    const char *colon;
    size_t hl;
    *out_fd = -1;
    if (!host_port) return kv_fail(d, KV_EINVAL, "listen: no address");
    if (host_port[0] == '[') {
        const char *rb = strchr(host_port, ']');
        if (!rb || rb[1] != ':') return kv_fail(d, KV_EINVAL, "listen: '%s' is not [HOST]:PORT", host_port);
        hl = (size_t)(rb - host_port - 1);
        colon = rb + 1;
        if (hl >= sizeof host) return kv_fail(d, KV_EINVAL, "listen: host too long");
        memcpy(host, host_port + 1, hl);
    } else {
        colon = strrchr(host_port, ':');
        if (!colon) return kv_fail(d, KV_EINVAL, "listen: '%s' is not HOST:PORT", host_port);
        hl = (size_t)(colon - host_port);
        if (hl >= sizeof host) return kv_fail(d, KV_EINVAL, "listen: host too long");
        memcpy(host, host_port, hl);
    }
    host[hl] = 0;
    char *end = NULL;
    long port = strtol(colon + 1, &end, 10);
    if (!colon[1] || *end || port < 0 || port > 65535)
        return kv_fail(d, KV_EINVAL, "listen: bad port in '%s'", host_port);
    char ps[8];
    snprintf(ps, sizeof ps, "%ld", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *res = NULL;
    int gr = getaddrinfo(host[0] ? host : NULL, ps, &hints, &res);
    if (gr) return kv_fail(d, KV_EINVAL, "listen %s: %s", host_port, gai_strerror(gr));
    int rc = kv_fail(d, KV_EIO, "listen %s: no address", host_port);
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) || listen(fd, backlog > 0 ? backlog : 128)) {
            rc = kv_fail(d, KV_EIO, "listen %s: %s", host_port, strerror(errno));
            close(fd);
            continue;
        }
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        char hb[INET6_ADDRSTRLEN] = "?", pb[8] = "0";
        if (!getsockname(fd, (struct sockaddr *)&ss, &sl))
            getnameinfo((struct sockaddr *)&ss, sl, hb, sizeof hb, pb, sizeof pb, NI_NUMERICHOST | NI_NUMERICSERV);
        if (ss.ss_family == AF_INET6) snprintf(addr, cap, "[%s]:%s", hb, pb);
        else snprintf(addr, cap, "%s:%s", hb, pb);
        *out_fd = fd;
        rc = 0;
        if (d) d->code = 0, d->msg[0] = 0;
        break;
    }
    freeaddrinfo(res);
    return rc;
}
