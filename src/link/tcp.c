/* TCP addresses and the blocking dial (include/kvasir/link.h).
 *
 * A dial is bounded by its timeout whatever the peer does: the connect is
 * nonblocking and waited on with poll(); the fd handed back is blocking,
 * CLOEXEC and TCP_NODELAY. Each address getaddrinfo yields is tried in
 * order; the error kept is the last one's. */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
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
