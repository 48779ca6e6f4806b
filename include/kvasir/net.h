/* Net: one event loop (epoll) with first-class timers and buffered, framed
 * connections, shared by every Kvasir server and client (the expert worker
 * today; the coordinator, the HTTP side and the ring on the same layer).
 *
 * Model (redis ae.c, libuv): one loop per thread; everything registered on
 * a loop is called from kv_net_loop_run_once on that loop's thread, never
 * concurrently. Only kv_net_loop_stop and kv_net_loop_wake may be called from
 * other threads (and from signal handlers).
 *
 *   - Timers (kv_net_timer) are caller-owned structs kept in a min-heap;
 *     arming one never allocates except to grow the heap.
 *   - Watches (kv_net_watch) call back on readiness of any fd (a listening
 *     socket, a pipe).
 *   - Connections (kv_net_conn) own a socket and do not care who dialed
 *     whom: an accepted fd and a dialed one (kv_net_conn_dial, nonblocking
 *     connect) behave the same once open. Bytes go through pluggable
 *     kv_net_io_ops (plain TCP by default) so a TLS layer can slot in under
 *     the framing. Input is cut into frames by the owner's frame_len
 *     callback (header first; the buffer grows with bytes that arrived,
 *     never to a size only announced, and never past max_frame); output is
 *     buffered and flushed as the socket allows.
 *   - Memory: every byte a connection buffers (receive and send) is charged
 *     to an optional shared kv_net_budget; a connection whose growth the
 *     budget cannot cover fails with KV_ENOMEM. A connection therefore holds
 *     at most max_frame + tx_max bytes.
 *   - Deadlines: a frame started must complete within frame_timeout_ms;
 *     queued output must make progress within write_timeout_ms; both close
 *     the connection with KV_ETIMEOUT.
 *
 * Closing is deferred: kv_net_conn_close marks the connection, flushes what
 * is queued (bounded by the write deadline), half-closes and discards input
 * for a short linger so a final ERROR frame is not destroyed by a reset, then
 * calls on_close once and frees the connection at the end of that loop
 * iteration. After on_close the owner must not touch the connection. */
#ifndef KVASIR_NET_H
#define KVASIR_NET_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>

#include "kvasir/err.h"

typedef struct kv_net_loop kv_net_loop;
typedef struct kv_net_conn kv_net_conn;

/* Monotonic milliseconds. */
int64_t kv_net_now_ms(void);

/* ---- loop ------------------------------------------------------------------ */

/* Creates a loop (epoll + an eventfd for wake/stop). KV_EIO on failure.
 * Free with kv_net_loop_free (accepts NULL): it closes and frees every
 * connection still open (without calling on_close). */
int kv_net_loop_new(kv_net_loop **out, kv_diag *d);
void kv_net_loop_free(kv_net_loop *l);

/* Called once per iteration after events and timers; returns true if it has
 * more work ready (the next wait then does not block). NULL clears it. */
typedef bool (*kv_net_tick_fn)(kv_net_loop *l, void *data);
void kv_net_loop_set_tick(kv_net_loop *l, kv_net_tick_fn fn, void *data);

/* Waits up to timeout_ms (< 0: until something happens; shortened to the
 * next timer), handles ready fds, expired timers, the tick, and frees
 * connections closed meanwhile. Returns 0, or KV_EIO if epoll failed. */
int kv_net_loop_run_once(kv_net_loop *l, int timeout_ms, kv_diag *d);
/* Runs iterations until kv_net_loop_stop. Returns 0 or KV_EIO. */
int kv_net_loop_run(kv_net_loop *l, kv_diag *d);
/* Makes kv_net_loop_run return after the current iteration. Thread- and
 * async-signal-safe. */
void kv_net_loop_stop(kv_net_loop *l);
bool kv_net_loop_stopping(const kv_net_loop *l);
/* Interrupts a blocking wait (thread- and async-signal-safe). */
void kv_net_loop_wake(kv_net_loop *l);

/* ---- timers ----------------------------------------------------------------- */

typedef struct kv_net_timer kv_net_timer;
typedef void (*kv_net_timer_fn)(kv_net_loop *l, kv_net_timer *t);
struct kv_net_timer {
    kv_net_timer_fn fn; /* called once when due (re-arm from inside to repeat) */
    void *data;         /* the owner's */
    int64_t at_ms;      /* private: due time (kv_net_now_ms) */
    size_t slot;        /* private: heap index + 1, 0 when not armed */
};
void kv_net_timer_init(kv_net_timer *t, kv_net_timer_fn fn, void *data);
/* Arms t to fire delay_ms from now (re-arms if armed). KV_ENOMEM if the
 * heap cannot grow. */
int kv_net_timer_start(kv_net_loop *l, kv_net_timer *t, int64_t delay_ms);
/* Disarms t (no-op if not armed). */
void kv_net_timer_stop(kv_net_loop *l, kv_net_timer *t);
static inline bool kv_net_timer_armed(const kv_net_timer *t) { return t->slot != 0; }

/* ---- fd watches -------------------------------------------------------------- */

enum { KV_NET_READ = 1u, KV_NET_WRITE = 2u, KV_NET_ERROR = 4u };
typedef struct kv_net_watch kv_net_watch;
typedef void (*kv_net_watch_fn)(kv_net_loop *l, kv_net_watch *w, unsigned events);
struct kv_net_watch {
    int fd;
    kv_net_watch_fn fn;
    void *data;
    unsigned events; /* private: KV_NET_READ | KV_NET_WRITE registered */
};
/* Registers fd for events (KV_NET_READ/WRITE); the fd stays the caller's.
 * KV_EIO if epoll refuses it. */
int kv_net_watch_add(kv_net_loop *l, kv_net_watch *w, int fd, unsigned events, kv_net_watch_fn fn,
                     void *data, kv_diag *d);
void kv_net_watch_del(kv_net_loop *l, kv_net_watch *w);

/* ---- memory budget -------------------------------------------------------------- */

/* Bytes buffered by the connections that share it (thread-safe). */
typedef struct kv_net_budget {
    atomic_size_t used; /* bytes charged now */
    size_t limit;       /* 0 = unlimited */
    atomic_size_t peak; /* highest used seen */
} kv_net_budget;
void kv_net_budget_init(kv_net_budget *b, size_t limit);
/* Charges n bytes; false (nothing charged) if that would pass the limit. */
bool kv_net_budget_take(kv_net_budget *b, size_t n);
void kv_net_budget_give(kv_net_budget *b, size_t n);

/* ---- connections ------------------------------------------------------------------ */

/* Transport under the framing: plain TCP (NULL ops) or e.g. TLS. read and
 * write behave like read(2)/send(2) on a nonblocking socket: > 0 bytes,
 * 0 end of stream (read), -1 with errno (EAGAIN: try again on readiness).
 * close releases the transport's state (the loop closes the fd).
 *
 * A transport with an exchange of its own before any data (a TLS handshake)
 * sets handshake: the connection then stays in a handshake phase (after the
 * TCP connect when dialed, from the start when accepted) in which the loop
 * calls only handshake, on the readiness it last asked for, and neither
 * reads nor flushes; queued output waits. handshake returns 0 when done,
 * the readiness it waits for (KV_NET_READ and/or KV_NET_WRITE) while in
 * progress, or a negative code that closes the connection (the reason from
 * why). The phase is bounded by the connection's handshake_timeout_ms; on_open
 * reports its end, for dialed and accepted connections alike.
 *
 * A transport that decodes input in units (TLS records) may hold bytes the
 * caller's buffer had no room for, which no socket readiness will announce:
 * pending returns how many, and the loop reads them on its next iteration.
 * why, when set and non-empty, is the one-line reason for the last failure
 * of read, write or handshake (used instead of strerror(errno)). */
typedef struct kv_net_io_ops {
    ssize_t (*read)(void *ctx, int fd, void *buf, size_t n);
    ssize_t (*write)(void *ctx, int fd, const void *buf, size_t n);
    void (*close)(void *ctx);
    int (*handshake)(void *ctx, int fd); /* optional */
    size_t (*pending)(void *ctx);        /* optional */
    const char *(*why)(void *ctx);       /* optional */
} kv_net_io_ops;

typedef struct kv_net_conn_cbs {
    /* Dialed connections: the connect completed (and the transport's
     * handshake, if it has one); accepted connections whose transport has a
     * handshake: that handshake completed. Or either failed: code < 0, then
     * on_close follows. May be NULL. */
    void (*on_open)(kv_net_conn *c, int code);
    /* Whole frame size from its first `header` bytes, or a negative code
     * (the connection then closes with it: the frame is never buffered). */
    int (*frame_len)(kv_net_conn *c, const uint8_t *hdr, size_t *total, kv_diag *d);
    /* A whole frame f[0, n): valid until the callback returns, or, if it
     * returns KV_NET_HOLD, until kv_net_conn_release (no more input is read
     * meanwhile). Return 0 (consumed), KV_NET_HOLD, or a negative code to
     * close the connection (after calling kv_net_conn_close yourself with
     * the reason if you want one). */
    int (*on_frame)(kv_net_conn *c, const uint8_t *f, size_t n);
    /* Input failed before a frame could be delivered (bad header from
     * frame_len, frame over max_frame, frame timeout, no memory): the owner
     * may queue a last frame (e.g. an ERROR); the connection then closes
     * with code. May be NULL. */
    void (*on_error)(kv_net_conn *c, int code, const char *why);
    /* Queued output fell to zero (e.g. resume producing). May be NULL. */
    void (*on_drain)(kv_net_conn *c);
    /* The connection is gone: code 0 (closed by us after flushing, or the
     * peer closed between frames) or the error that closed it; why is one
     * line. Called once; the connection is freed after it returns. */
    void (*on_close)(kv_net_conn *c, int code, const char *why);
} kv_net_conn_cbs;
#define KV_NET_HOLD 1

typedef struct kv_net_conn_opts {
    size_t header;            /* bytes of a frame header (>= 1) */
    size_t max_frame;         /* the largest frame accepted (KV_ERANGE beyond) */
    size_t tx_max;            /* bytes queued for sending at most (KV_ENOMEM beyond) */
    int frame_timeout_ms;     /* a frame started must complete within this; 0 = none */
    int write_timeout_ms;     /* queued output must progress within this; 0 = none */
    int linger_ms;            /* after a close: drain input this long; 0 = 250 */
    int handshake_timeout_ms; /* the transport's handshake must end within this;
                                 0 = 10000 (never unbounded) */
    size_t keep;              /* an emptied buffer larger than this is freed; 0 = 4 MiB,
                                 SIZE_MAX = never (a hot path that must not reallocate) */
    kv_net_budget *budget;    /* charged for every buffered byte; NULL = none */
    const kv_net_io_ops *io;  /* NULL = plain TCP */
    void *io_ctx;             /* passed to io; the connection owns it from kv_net_conn_new /
                                 _dial on (io->close releases it, also when they fail) */
} kv_net_conn_opts;

/* Takes ownership of a connected (or connecting, if dialing) socket fd,
 * made nonblocking here. data is the owner's (kv_net_conn_data). On error
 * the fd is closed and *out is NULL. KV_ENOMEM / KV_EIO / KV_EINVAL. */
int kv_net_conn_new(kv_net_conn **out, kv_net_loop *l, int fd, const kv_net_conn_opts *o,
                    const kv_net_conn_cbs *cbs, void *data, kv_diag *d);
/* Starts a nonblocking TCP connect to addr (TCP_NODELAY) and returns the
 * connection at once; cbs->on_open reports the outcome (within
 * connect_timeout_ms, 0 = none: KV_ETIMEOUT). */
int kv_net_conn_dial(kv_net_conn **out, kv_net_loop *l, const struct sockaddr *addr, socklen_t alen,
                     int connect_timeout_ms, const kv_net_conn_opts *o, const kv_net_conn_cbs *cbs,
                     void *data, kv_diag *d);
void *kv_net_conn_data(const kv_net_conn *c);
int kv_net_conn_fd(const kv_net_conn *c);
/* Ends a KV_NET_HOLD: reading resumes (on the next iteration). */
void kv_net_conn_release(kv_net_conn *c);
/* Stops (false) or resumes (true) reading input, e.g. while the owner has
 * no room for another request. Deadlines of a frame in progress still run. */
void kv_net_conn_set_reading(kv_net_conn *c, bool on);

/* Output. _reserve returns room for n more bytes at the end of the queue
 * (valid until the next call on c), or NULL with KV_ENOMEM if tx_max or the
 * budget refuses (the connection is then closed); _commit appends the n
 * bytes written there. _send copies. Flushing happens in the loop. */
uint8_t *kv_net_conn_reserve(kv_net_conn *c, size_t n);
void kv_net_conn_commit(kv_net_conn *c, size_t n);
/* _commit, then writes the queue at once when the loop is not already
 * writing it (an open connection with nothing queued before): a frame that
 * should leave now costs no EPOLLOUT round trip (two epoll_ctl and a wake).
 * What the socket does not take is flushed by the loop; an error closes c
 * as a failed write in the loop would (its on_close when the iteration
 * ends). */
void kv_net_conn_commit_now(kv_net_conn *c, size_t n);
int kv_net_conn_send(kv_net_conn *c, const void *buf, size_t n);
/* Bytes queued and not yet written to the socket. */
size_t kv_net_conn_pending(const kv_net_conn *c);
/* Bytes this connection holds in buffers (charged to the budget). */
size_t kv_net_conn_mem(const kv_net_conn *c);

/* Closes c as described above (code/why are passed to on_close). Safe to
 * call more than once and from the connection's own callbacks. Before the
 * connection is open (connecting, or in the transport's handshake) it ends
 * at once and discards what was queued. */
void kv_net_conn_close(kv_net_conn *c, int code, const char *why);
bool kv_net_conn_closing(const kv_net_conn *c);

/* ---- listening --------------------------------------------------------------------- */

/* Binds and listens on "HOST:PORT" (port 0 picks one), nonblocking,
 * SO_REUSEADDR; writes the bound address ("HOST:PORT", "[v6]:PORT") into
 * addr[cap]. Returns 0 and the fd, or KV_EINVAL / KV_EIO. */
int kv_net_listen(const char *host_port, int backlog, int *fd, char *addr, size_t cap, kv_diag *d);

#endif
