/* Circuits to and from unchanged servers and clients (include/kvasir/relay.h,
 * "bridges"): the end-to-end TLS session inside a circuit is terminated in
 * the node's process and in the coordinator's, and its plaintext is carried
 * to a local TCP address (the node's worker) or from a local listener (a
 * coordinator that dials an address). So the dispatch worker and the
 * coordinator's dial serve and speak through the relay without a change,
 * and the relay sees only TLS records.
 *
 * Each bridged circuit is one thread running kv_relay_pump; it ends when
 * either side ends (the circuit closes, the local peer closes) or fails.
 * The bridge objects count their threads and wait for them when freed,
 * after the owner ended the circuits (freeing the relay client does). */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/relay.h"

#define KV_PUMP_BUF (64u << 10) /* bytes buffered each way per bridged circuit */

static int kv_set_nonblock(int fd) {
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* One direction's buffer. */
typedef struct kv_pipe_buf {
    uint8_t *b;
    size_t off, len;
} kv_pipe_buf;

int kv_relay_pump(kv_tls *t, int tls_fd, int plain_fd) {
    if (kv_set_nonblock(tls_fd) || kv_set_nonblock(plain_fd)) return KV_EIO;
    const kv_net_io_ops *io = &kv_tls_net_io;
    kv_pipe_buf in = {malloc(KV_PUMP_BUF), 0, 0}, out = {malloc(KV_PUMP_BUF), 0, 0}; /* in: TLS -> plain */
    int rc = in.b && out.b ? 0 : KV_ENOMEM;
    while (!rc) {
        bool progress = false;
        short tev = 0, pev = 0;
        if (in.len == 0) { /* TLS -> buffer */
            ssize_t k = io->read(t, tls_fd, in.b, KV_PUMP_BUF);
            if (k > 0) in.off = 0, in.len = (size_t)k, progress = true;
            else if (k == 0) rc = 1;
            else if (errno == EAGAIN) tev |= POLLIN;
            else rc = KV_EPROTO;
        }
        if (!rc && in.len) { /* buffer -> plain */
            ssize_t k = send(plain_fd, in.b + in.off, in.len, MSG_NOSIGNAL);
            if (k > 0) in.off += (size_t)k, in.len -= (size_t)k, progress = true;
            else if (k < 0 && (errno == EAGAIN || errno == EINTR)) pev |= POLLOUT;
            else rc = 1;
        }
        if (!rc && out.len == 0) { /* plain -> buffer */
            ssize_t k = recv(plain_fd, out.b, KV_PUMP_BUF, 0);
            if (k > 0) out.off = 0, out.len = (size_t)k, progress = true;
            else if (k == 0) rc = 1;
            else if (errno == EAGAIN || errno == EINTR) pev |= POLLIN;
            else rc = 1;
        }
        if (!rc && out.len) { /* buffer -> TLS */
            ssize_t k = io->write(t, tls_fd, out.b + out.off, out.len);
            if (k > 0) out.off += (size_t)k, out.len -= (size_t)k, progress = true;
            else if (k < 0 && errno == EAGAIN) tev |= POLLOUT;
            else rc = KV_EIO;
        }
        if (rc || progress || (in.len == 0 && io->pending(t))) continue;
        struct pollfd p[2] = {{.fd = tls_fd, .events = tev}, {.fd = plain_fd, .events = pev}};
        if (poll(p, 2, -1) < 0 && errno != EINTR) rc = KV_EIO;
    }
    free(in.b);
    free(out.b);
    return rc == 1 ? 0 : rc;
}

/* ---- the node's side: circuits to a local server ------------------------------------ */

struct kv_relay_forward {
    kv_tls_ctx *tls;      /* the node's certificate (its key) */
    char local[256];      /* "HOST:PORT" of the local server */
    atomic_int live;      /* bridging threads running */
    atomic_uint_least64_t served, failed;
};

typedef struct kv_fwd_job {
    kv_relay_forward *f;
    int fd;
} kv_fwd_job;

static void *kv_fwd_thread(void *p) {
    kv_fwd_job j = *(kv_fwd_job *)p;
    free(p);
    kv_tls *t = NULL;
    int lfd = -1;
    kv_diag d = {0};
    const kv_tls_opts o = {.server = true};
    int rc = kv_tls_new(&t, j.f->tls, &o, &d);
    if (!rc) rc = kv_tls_handshake_fd(t, j.fd, 10000, &d);
    if (!rc) rc = kv_link_connect(j.f->local, 5000, &lfd, &d);
    if (!rc) rc = kv_relay_pump(t, j.fd, lfd);
    atomic_fetch_add(rc ? &j.f->failed : &j.f->served, 1);
    kv_tls_free(t);
    if (lfd >= 0) close(lfd);
    close(j.fd);
    atomic_fetch_sub(&j.f->live, 1);
    return NULL;
}

int kv_relay_forward_new(kv_relay_forward **out, kv_tls_ctx *tls, const char *local, kv_diag *d) {
    *out = NULL;
    if (!tls || !local || strlen(local) >= 256) return kv_fail(d, KV_EINVAL, "relay forward: bad arguments");
    kv_relay_forward *f = calloc(1, sizeof *f);
    if (!f) return kv_fail(d, KV_ENOMEM, "relay forward: out of memory");
    f->tls = tls;
    snprintf(f->local, sizeof f->local, "%s", local);
    *out = f;
    return 0;
}

void kv_relay_forward_circuit(void *data, int fd) {
    kv_relay_forward *f = data;
    kv_fwd_job *j = malloc(sizeof *j);
    pthread_t th;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (j) *j = (kv_fwd_job){f, fd}, atomic_fetch_add(&f->live, 1);
    if (!j || pthread_create(&th, &at, kv_fwd_thread, j)) {
        if (j) atomic_fetch_sub(&f->live, 1);
        free(j);
        close(fd);
        atomic_fetch_add(&f->failed, 1);
    }
    pthread_attr_destroy(&at);
}

void kv_relay_forward_counts(const kv_relay_forward *f, uint64_t *served, uint64_t *failed) {
    kv_relay_forward *m = (kv_relay_forward *)f;
    if (served) *served = atomic_load(&m->served);
    if (failed) *failed = atomic_load(&m->failed);
}

void kv_relay_forward_free(kv_relay_forward *f) {
    if (!f) return;
    while (atomic_load(&f->live) > 0) { /* the circuits ended with the client: their threads end */
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
    }
    free(f);
}

/* ---- the coordinator's side: a local listener whose connections become circuits ----- */

struct kv_relay_proxy {
    kv_relay_client *cl;  /* a coordinator's client (borrowed) */
    kv_tls_ctx *tls;      /* the coordinator's certificate */
    uint8_t node_pk[32];  /* the node every connection goes to */
    int timeout_ms;
    int lfd;
    char addr[80];
    pthread_t th;
    atomic_bool stop;
    atomic_int live;
};

typedef struct kv_proxy_job {
    kv_relay_proxy *p;
    int fd;
} kv_proxy_job;

static void *kv_proxy_conn(void *arg) {
    kv_proxy_job j = *(kv_proxy_job *)arg;
    free(arg);
    int cfd = -1;
    kv_tls *t = NULL;
    kv_diag d = {0};
    const kv_tls_opts o = {.pin_key = j.p->node_pk};
    int rc = kv_relay_client_open(j.p->cl, j.p->node_pk, j.p->timeout_ms, &cfd, &d);
    if (!rc) rc = kv_tls_new(&t, j.p->tls, &o, &d);
    if (!rc) rc = kv_tls_handshake_fd(t, cfd, j.p->timeout_ms, &d);
    if (!rc) (void)kv_relay_pump(t, cfd, j.fd);
    kv_tls_free(t);
    if (cfd >= 0) close(cfd);
    close(j.fd); /* a failed circuit: the local client reads end of stream */
    atomic_fetch_sub(&j.p->live, 1);
    return NULL;
}

static void *kv_proxy_accept(void *arg) {
    kv_relay_proxy *p = arg;
    while (!atomic_load(&p->stop)) {
        struct pollfd pf = {.fd = p->lfd, .events = POLLIN};
        if (poll(&pf, 1, 100) <= 0) continue;
        int fd = accept4(p->lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) continue;
        kv_proxy_job *j = malloc(sizeof *j);
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (j) *j = (kv_proxy_job){p, fd}, atomic_fetch_add(&p->live, 1);
        if (!j || pthread_create(&th, &at, kv_proxy_conn, j)) {
            if (j) atomic_fetch_sub(&p->live, 1);
            free(j);
            close(fd);
        }
        pthread_attr_destroy(&at);
    }
    return NULL;
}

int kv_relay_proxy_start(kv_relay_proxy **out, kv_relay_client *cl, kv_tls_ctx *tls, const uint8_t node_pk[32],
                         int timeout_ms, kv_diag *d) {
    *out = NULL;
    if (!cl || !tls || !node_pk) return kv_fail(d, KV_EINVAL, "relay proxy: bad arguments");
    kv_relay_proxy *p = calloc(1, sizeof *p);
    if (!p) return kv_fail(d, KV_ENOMEM, "relay proxy: out of memory");
    p->cl = cl;
    p->tls = tls;
    memcpy(p->node_pk, node_pk, 32);
    p->timeout_ms = timeout_ms > 0 ? timeout_ms : 5000;
    int rc = kv_net_listen("127.0.0.1:0", 64, &p->lfd, p->addr, sizeof p->addr, d);
    if (!rc && pthread_create(&p->th, NULL, kv_proxy_accept, p)) {
        close(p->lfd);
        rc = kv_fail(d, KV_EIO, "relay proxy: cannot start a thread");
    }
    if (rc) {
        free(p);
        return rc;
    }
    *out = p;
    return 0;
}

const char *kv_relay_proxy_addr(const kv_relay_proxy *p) { return p->addr; }

void kv_relay_proxy_free(kv_relay_proxy *p) {
    if (!p) return;
    atomic_store(&p->stop, true);
    pthread_join(p->th, NULL);
    close(p->lfd);
    while (atomic_load(&p->live) > 0) { /* connections end when their clients or circuits do */
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
    }
    free(p);
}
