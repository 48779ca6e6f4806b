/* TCP addresses, the blocking dial and blocking I/O (include/kvasir/link.h).
 *
 * A dial is bounded by its timeout whatever the peer does: the connect is
 * nonblocking and waited on with poll(); the fd handed back is blocking,
 * CLOEXEC and TCP_NODELAY. Each address getaddrinfo yields is tried in
 * order; the error kept is the last one's.
 *
 * Blocking reads and writes wait in poll() and move bytes only once the fd
 * is ready (a read after POLLIN, a send with MSG_DONTWAIT), so no call
 * outlives its limit even on a blocking fd; a send never raises SIGPIPE. */
#include <errno.h>
#include <limits.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvasir/link.h"

int kv_link_parse_addr(const char *host_port, char *host, size_t hcap, uint16_t *port, kv_diag *d) {
    if (!host_port || !*host_port) return kv_fail(d, KV_EINVAL, "empty address");
    const char *colon, *hs = host_port, *he;
    if (host_port[0] == '[') {
        he = strchr(host_port, ']');
        if (!he || he[1] != ':')
            return kv_fail(d, KV_EINVAL, "address '%s': expected [IPv6]:PORT", host_port);
        hs = host_port + 1;
        colon = he + 1;
    } else {
        colon = strrchr(host_port, ':');
        if (!colon) return kv_fail(d, KV_EINVAL, "address '%s': expected HOST:PORT", host_port);
        he = colon;
    }
    size_t hl = (size_t)(he - hs);
    if (hl == 0 || hl >= hcap)
        return kv_fail(d, KV_EINVAL, "address '%s': bad host part", host_port);
    const char *ps = colon + 1;
    if (!*ps || strlen(ps) > 5) return kv_fail(d, KV_EINVAL, "address '%s': bad port", host_port);
    unsigned long v = 0;
    for (const char *c = ps; *c; c++) {
        if (*c < '0' || *c > '9')
            return kv_fail(d, KV_EINVAL, "address '%s': bad port", host_port);
        v = v * 10 + (unsigned long)(*c - '0');
    }
    if (v > 65535) return kv_fail(d, KV_EINVAL, "address '%s': port %lu > 65535", host_port, v);
    memcpy(host, hs, hl);
    host[hl] = 0;
    *port = (uint16_t)v;
    return 0;
}

int kv_link_connect(const char *host_port, int timeout_ms, int *fd_out, kv_diag *d) {
    char host[256], port_s[8];
    uint16_t port;
    int rc = kv_link_parse_addr(host_port, host, sizeof host, &port, d);
    if (rc) return rc;
    snprintf(port_s, sizeof port_s, "%u", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int gr = getaddrinfo(host, port_s, &hints, &res);
    if (gr) return kv_fail(d, KV_EINVAL, "address '%s': %s", host_port, gai_strerror(gr));
    rc = kv_fail(d, KV_EIO, "connect %s: no address", host_port);
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
        if (fd < 0) {
            rc = kv_fail(d, KV_EIO, "socket: %s", strerror(errno));
            continue;
        }
        int r = connect(fd, a->ai_addr, a->ai_addrlen);
        if (r < 0 && errno == EINPROGRESS) {
            struct pollfd pf = {.fd = fd, .events = POLLOUT};
            int pr;
            do pr = poll(&pf, 1, timeout_ms < 0 ? -1 : timeout_ms);
            while (pr < 0 && errno == EINTR);
            if (pr == 0) {
                close(fd);
                rc = kv_fail(d, KV_ETIMEOUT, "connect %s: timed out after %d ms", host_port,
                             timeout_ms);
                continue;
            }
            int err = 0;
            socklen_t el = sizeof err;
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
            r = err ? -1 : 0;
            errno = err;
        }
        if (r < 0) {
            rc = kv_fail(d, KV_EIO, "connect %s: %s", host_port, strerror(errno));
            close(fd);
            continue;
        }
        int fl = fcntl(fd, F_GETFL);
        if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        *fd_out = fd;
        rc = 0;
        if (d) {
            d->code = 0;
            d->msg[0] = 0;
        }
        break;
    }
    freeaddrinfo(res);
    return rc;
}

/* ---- blocking I/O ------------------------------------------------------------ */

static int64_t kv_io_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static const char *kv_io_peer(const kv_link_io *io) { return io->peer ? io->peer : "the peer"; }

/* Waits until fd is ready for ev within io's limit: from start (the whole
 * call) or from last (the last progress, when io->idle). 0 when ready. */
static int kv_io_ready(int fd, short ev, kv_link_io *io, int64_t start, int64_t last, const char *verb, kv_diag *d) {
    for (;;) {
        int wait = -1;
        int64_t end = 0;
        if (io->timeout_ms >= 0) {
            end = (io->idle ? last : start) + io->timeout_ms;
            const int64_t left = end - kv_io_now_ms();
            wait = left <= 0 ? 0 : left > INT_MAX ? INT_MAX : (int)left;
        }
        if (io->cancelled && (wait < 0 || wait > KV_LINK_POLL_MS)) wait = KV_LINK_POLL_MS;
        struct pollfd pf = {.fd = fd, .events = ev};
        const int pr = poll(&pf, 1, wait);
        if (pr < 0 && errno == EINTR) continue;
        if (pr < 0) return kv_fail(d, KV_EIO, "%s %s: poll: %s", verb, kv_io_peer(io), strerror(errno));
        if (pr > 0) return 0;
        if (io->cancelled && io->cancelled(io->arg)) {
            io->was_cancelled = true;
            return kv_fail(d, KV_EIO, "cancelled while waiting for %s", kv_io_peer(io));
        }
        if (io->timeout_ms >= 0 && kv_io_now_ms() >= end)
            return kv_fail(d, KV_ETIMEOUT, "%s %s: %s %d ms", verb, kv_io_peer(io),
                           io->idle ? "no progress for" : "not done within", io->timeout_ms);
    }
}

int kv_link_read_full(int fd, void *buf, size_t n, kv_link_io *io, kv_diag *d) {
    kv_link_io none = {.timeout_ms = -1};
    if (!io) io = &none;
    io->got = 0;
    io->closed = io->was_cancelled = false;
    const int64_t start = kv_io_now_ms();
    int64_t last = start;
    uint8_t *p = buf;
    while (io->got < n) {
        int rc = kv_io_ready(fd, POLLIN, io, start, last, "read from", d);
        if (rc) return rc;
        const ssize_t k = read(fd, p + io->got, n - io->got);
        if (k > 0) {
            io->got += (size_t)k;
            if (io->idle) last = kv_io_now_ms();
            continue;
        }
        if (k == 0) {
            io->closed = true;
            return kv_fail(d, KV_EIO, "%s closed the connection", kv_io_peer(io));
        }
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
        return kv_fail(d, KV_EIO, "%s closed the connection: %s", kv_io_peer(io), strerror(errno));
    }
    return 0;
}

int kv_link_write_full(int fd, const void *buf, size_t n, kv_link_io *io, kv_diag *d) {
    kv_link_io none = {.timeout_ms = -1};
    if (!io) io = &none;
    io->got = 0;
    io->closed = io->was_cancelled = false;
    const int64_t start = kv_io_now_ms();
    int64_t last = start;
    const uint8_t *p = buf;
    while (io->got < n) {
        const ssize_t k = send(fd, p + io->got, n - io->got, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
            io->got += (size_t)k;
            if (io->idle) last = kv_io_now_ms();
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            const int rc = kv_io_ready(fd, POLLOUT, io, start, last, "send to", d);
            if (rc) return rc;
            continue;
        }
        return kv_fail(d, KV_EIO, "send to %s: %s", kv_io_peer(io), k < 0 ? strerror(errno) : "no progress");
    }
    return 0;
}
