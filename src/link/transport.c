/* Transport policy and the acceptor's TLS-or-plaintext transport
 * (include/kvasir/transport.h).
 *
 * The sniffing transport peeks one byte in the loop's handshake phase: a
 * TLS ClientHello starts with a handshake record (0x16), a dispatch or ring
 * frame with its magic ('K'). Nothing is consumed, so a plaintext peer's
 * first frame reaches the owner whole, and the owner (who knows the peer's
 * address and its own flags) decides whether to serve it. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "kvasir/transport.h"

bool kv_link_sockaddr_loopback(const struct sockaddr *sa) {
    if (!sa) return false;
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *s4 = (const struct sockaddr_in *)sa;
        return (ntohl(s4->sin_addr.s_addr) >> 24) == 127;
    }
    if (sa->sa_family == AF_INET6) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        if (IN6_IS_ADDR_LOOPBACK(a)) return true;
        return IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127;
    }
    return false;
}

bool kv_link_addr_loopback(const char *host_port) {
    char host[256];
    uint16_t port;
    if (kv_link_parse_addr(host_port, host, sizeof host, &port, NULL)) return false;
    struct sockaddr_in s4 = {.sin_family = AF_INET};
    struct sockaddr_in6 s6 = {.sin6_family = AF_INET6};
    if (inet_pton(AF_INET, host, &s4.sin_addr) == 1) return kv_link_sockaddr_loopback((struct sockaddr *)&s4);
    if (inet_pton(AF_INET6, host, &s6.sin6_addr) == 1) return kv_link_sockaddr_loopback((struct sockaddr *)&s6);
    return false;
}

int kv_link_tls_ctx(kv_tls_ctx **out, const uint8_t sk[64], kv_diag *d) {
    kv_node_key k = {0};
    memcpy(k.sk, sk, 64);
    memcpy(k.pk, sk + 32, 32);
    const int rc = kv_tls_ctx_new(out, &k, d);
    memset(&k, 0, sizeof k);
    return rc;
}

void kv_link_warn_plaintext(const char *what) {
    fprintf(stderr,
            "WARNING: %s: --insecure-plaintext: links run over plain TCP, without TLS; anyone on the path can read "
            "and change every frame after the key handshake. Use it only on a network you own.\n",
            what);
}

/* ---- sniffing acceptor ------------------------------------------------------------ */

enum { KV_SNIFF_UNDECIDED = 0, KV_SNIFF_TLS, KV_SNIFF_PLAIN };

struct kv_link_sniff {
    bool client;  /* a connector: TLS first, the server's plaintext answer only read as a refusal */
    bool started; /* client: the first handshake step ran (the ClientHello went out) */
    int last;     /* client: what the last step waited for */
    int mode;
    kv_tls *tls; /* owned; used once mode is KV_SNIFF_TLS */
    char why[160];
};

int kv_link_sniff_new(kv_link_sniff **out, kv_tls_ctx *x, kv_diag *d) {
    *out = NULL;
    kv_link_sniff *s = calloc(1, sizeof *s);
    if (!s) return kv_fail(d, KV_ENOMEM, "transport: out of memory");
    const kv_tls_opts o = {.server = true};
    const int rc = kv_tls_new(&s->tls, x, &o, d);
    if (rc) {
        free(s);
        return rc;
    }
    *out = s;
    return 0;
}

int kv_link_sniff_new_client(kv_link_sniff **out, kv_tls_ctx *x, const uint8_t *pin_key, kv_diag *d) {
    *out = NULL;
    kv_link_sniff *s = calloc(1, sizeof *s);
    if (!s) return kv_fail(d, KV_ENOMEM, "transport: out of memory");
    const kv_tls_opts o = {.server = false, .pin_key = pin_key};
    const int rc = kv_tls_new(&s->tls, x, &o, d);
    if (rc) {
        free(s);
        return rc;
    }
    s->client = true;
    *out = s;
    return 0;
}

bool kv_link_sniff_plain_answer(const kv_link_sniff *s) { return s && s->client && s->mode == KV_SNIFF_PLAIN; }

/* The first byte a TLS server sends is a record of type 20..23 (a
 * handshake, or an alert). */
static bool kv_tls_record_byte(uint8_t b) { return b >= 0x14 && b <= 0x17; }

/* A client's step: the TLS handshake, unless the server's first byte shows
 * it answered in plaintext (a refusal frame). */
static int kv_sniff_client_step(kv_link_sniff *s, int fd) {
    if (s->mode == KV_SNIFF_UNDECIDED) {
        /* whatever the server sent first decides, before OpenSSL reads it
           (a refusal may be waiting already when the connect completes) */
        uint8_t b;
        ssize_t r;
        do r = recv(fd, &b, 1, MSG_PEEK);
        while (r < 0 && errno == EINTR);
        if (r == 1 && !kv_tls_record_byte(b)) {
            s->mode = KV_SNIFF_PLAIN;
            return 0;
        }
        if (r == 1) s->mode = KV_SNIFF_TLS;
        else if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && s->started && s->last != KV_NET_WRITE)
            return KV_NET_READ; /* the ClientHello is out: wait for the answer's first byte */
    }
    s->started = true;
    s->last = kv_tls_net_io.handshake(s->tls, fd);
    if (s->last == 0) s->mode = KV_SNIFF_TLS;
    if (s->last < 0 && s->mode == KV_SNIFF_UNDECIDED) {
        /* the ClientHello failed to go out (a reset): a refusal the server
           wrote before it closed may still be waiting, ahead of the reset */
        uint8_t b;
        ssize_t r;
        do r = recv(fd, &b, 1, MSG_PEEK);
        while (r < 0 && errno == EINTR);
        if (r == 1 && !kv_tls_record_byte(b)) {
            s->mode = KV_SNIFF_PLAIN;
            return 0;
        }
    }
    return s->last;
}

kv_tls *kv_link_sniff_tls(const kv_link_sniff *s) {
    return s && s->mode == KV_SNIFF_TLS && kv_tls_established(s->tls) ? s->tls : NULL;
}

bool kv_link_sniff_undecided(const kv_link_sniff *s) { return s && s->mode == KV_SNIFF_UNDECIDED; }

static ssize_t kv_sniff_read(void *ctx, int fd, void *buf, size_t n) {
    kv_link_sniff *s = ctx;
    if (s->mode == KV_SNIFF_TLS) return kv_tls_net_io.read(s->tls, fd, buf, n);
    ssize_t r;
    do r = recv(fd, buf, n, 0);
    while (r < 0 && errno == EINTR);
    return r;
}

static ssize_t kv_sniff_write(void *ctx, int fd, const void *buf, size_t n) {
    kv_link_sniff *s = ctx;
    if (s->mode == KV_SNIFF_TLS) return kv_tls_net_io.write(s->tls, fd, buf, n);
    if (s->client) return (ssize_t)n; /* a server that answered TLS in plaintext is sent nothing */
    ssize_t r;
    do r = send(fd, buf, n, MSG_NOSIGNAL);
    while (r < 0 && errno == EINTR);
    return r;
}

static void kv_sniff_close(void *ctx) {
    kv_link_sniff *s = ctx;
    if (!s) return;
    kv_tls_free(s->tls);
    free(s);
}

static int kv_sniff_handshake(void *ctx, int fd) {
    kv_link_sniff *s = ctx;
    if (s->client) return kv_sniff_client_step(s, fd);
    if (s->mode == KV_SNIFF_TLS) return kv_tls_net_io.handshake(s->tls, fd);
    if (s->mode == KV_SNIFF_PLAIN) return 0;
    uint8_t b;
    ssize_t r;
    do r = recv(fd, &b, 1, MSG_PEEK);
    while (r < 0 && errno == EINTR);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return KV_NET_READ;
    if (r < 0) {
        snprintf(s->why, sizeof s->why, "transport: %s", strerror(errno));
        return KV_EIO;
    }
    if (r == 0) {
        snprintf(s->why, sizeof s->why, "transport: the peer closed before sending anything");
        return KV_EIO;
    }
    if (b != KV_LINK_TLS_RECORD_HANDSHAKE) {
        s->mode = KV_SNIFF_PLAIN;
        return 0;
    }
    s->mode = KV_SNIFF_TLS;
    return kv_tls_net_io.handshake(s->tls, fd);
}

static size_t kv_sniff_pending(void *ctx) {
    kv_link_sniff *s = ctx;
    return s->mode == KV_SNIFF_TLS ? kv_tls_net_io.pending(s->tls) : 0;
}

static const char *kv_sniff_why(void *ctx) {
    kv_link_sniff *s = ctx;
    if (s->mode == KV_SNIFF_TLS || (s->client && s->mode == KV_SNIFF_UNDECIDED)) return kv_tls_net_io.why(s->tls);
    return s->why;
}

const kv_net_io_ops kv_link_sniff_io = {
    .read = kv_sniff_read,
    .write = kv_sniff_write,
    .close = kv_sniff_close,
    .handshake = kv_sniff_handshake,
    .pending = kv_sniff_pending,
    .why = kv_sniff_why,
};

int kv_link_tls_client_fd(kv_tls *t, int fd, int timeout_ms, bool *plain, kv_diag *d) {
    *plain = false;
    kv_link_sniff s = {.client = true, .tls = t};
    const int64_t deadline = kv_net_now_ms() + (timeout_ms > 0 ? timeout_ms : 1);
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK)) return kv_fail(d, KV_EIO, "TLS handshake: fcntl: %s", strerror(errno));
    for (;;) {
        const int r = kv_sniff_client_step(&s, fd);
        if (r == 0 && s.mode == KV_SNIFF_PLAIN) {
            *plain = true;
            return kv_fail(d, KV_EPROTO, "answered TLS in plaintext");
        }
        if (r == 0) return 0;
        if (r < 0) return kv_fail(d, r, "%s", kv_tls_why(t));
        const int64_t left = deadline - kv_net_now_ms();
        if (left <= 0) return kv_fail(d, KV_ETIMEOUT, "TLS handshake not complete within %d ms", timeout_ms);
        struct pollfd pf = {.fd = fd, .events = (short)((r & KV_NET_READ ? POLLIN : 0) | (r & KV_NET_WRITE ? POLLOUT : 0))};
        if (poll(&pf, 1, (int)left) < 0 && errno != EINTR)
            return kv_fail(d, KV_EIO, "TLS handshake: poll: %s", strerror(errno));
    }
}

/* ---- blocking channel ------------------------------------------------------------- */

int kv_link_chan_write_full(const kv_link_chan *c, const void *buf, size_t n, kv_link_io *io, kv_diag *d) {
    if (!c->tls) return kv_link_write_full(c->fd, buf, n, io, d);
    io->got = 0;
    io->closed = io->was_cancelled = false;
    /* a TLS write cannot be cut at a poll slice without losing track of a
       record half sent: one call for the whole limit */
    const int t = io->timeout_ms < 0 ? (1 << 30) : (io->timeout_ms > 0 ? io->timeout_ms : 1);
    const int rc = kv_tls_write_full(c->tls, buf, n, t, d);
    if (!rc) io->got = n;
    if (rc) kv_diag_prefix(d, rc, "%s", io->peer ? io->peer : "the peer");
    return rc;
}

int kv_link_chan_read_full(const kv_link_chan *c, void *buf, size_t n, kv_link_io *io, kv_diag *d) {
    if (!c->tls) return kv_link_read_full(c->fd, buf, n, io, d);
    io->got = 0;
    io->closed = io->was_cancelled = false;
    const int64_t t0 = kv_net_now_ms();
    int64_t last = t0; /* last progress, for an idle limit */
    const char *peer = io->peer ? io->peer : "the peer";
    while (io->got < n) {
        if (io->cancelled && io->cancelled(io->arg)) {
            io->was_cancelled = true;
            return kv_fail(d, KV_EIO, "%s: cancelled", peer);
        }
        int64_t left = 1 << 30;
        if (io->timeout_ms >= 0) {
            left = (io->idle ? last : t0) + io->timeout_ms - kv_net_now_ms();
            if (left <= 0) return kv_fail(d, KV_ETIMEOUT, "%s: no data within %d ms", peer, io->timeout_ms);
        }
        int slice = left < KV_LINK_POLL_MS ? (int)left : KV_LINK_POLL_MS;
        if (slice < 1) slice = 1;
        size_t got = 0;
        kv_diag ld = {0};
        const int rc = kv_tls_read_full(c->tls, (uint8_t *)buf + io->got, n - io->got, &got, slice, &ld);
        if (got) last = kv_net_now_ms();
        io->got += got;
        if (!rc) break;
        if (rc == KV_ETIMEOUT) continue;
        if (rc == KV_EIO && strstr(ld.msg, "closed by the peer")) {
            io->closed = true;
            return kv_fail(d, KV_EIO, "%s closed the connection", peer);
        }
        return kv_fail(d, rc, "%s: %s", peer, ld.msg);
    }
    return 0;
}
