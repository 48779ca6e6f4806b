/* Transport policy of the link layer: which links run over TLS, how an
 * acceptor tells a TLS peer from a plaintext one, and one blocking channel
 * (plain TCP or TLS) under every blocking client. docs/PROTOCOL.md ("TLS
 * transport of the link layer", "Transport policy") is the contract.
 *
 *   - A connector (coordinator, ring node to its successor, ring client)
 *     always dials TLS, pinned to the key it expects at the other end, and
 *     signs the session's exporter into the key handshake (the transcript's
 *     binding). Only an explicit --insecure-plaintext makes it dial plain
 *     TCP, and the command says so at start.
 *   - An acceptor (worker, ring node) takes both on one port: the first byte
 *     of a TLS connection is a handshake record (0x16), which no dispatch or
 *     ring frame starts with. A plaintext peer is served only when its
 *     address is loopback (127.0.0.0/8, ::1, ::ffff:127.0.0.0/104) or the
 *     acceptor runs with --insecure-plaintext; any other plaintext peer is
 *     answered with a clear error frame of its own protocol and closed.
 *
 * Thread safety: as kv_tls (one session per thread at a time). */
#ifndef KVASIR_TRANSPORT_H
#define KVASIR_TRANSPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/socket.h>

#include "kvasir/err.h"
#include "kvasir/link.h"
#include "kvasir/net.h"
#include "kvasir/tls.h"

#define KV_LINK_TLS_RECORD_HANDSHAKE 0x16u /* the first byte a TLS client sends */

/* True when sa is a loopback address (IPv4 127/8, IPv6 ::1, or IPv4-mapped
 * 127/8). */
bool kv_link_sockaddr_loopback(const struct sockaddr *sa);
/* The same for a numeric "HOST:PORT" / "[v6]:PORT"; false for a name or a
 * malformed address (a name may resolve anywhere). */
bool kv_link_addr_loopback(const char *host_port);

/* ---- the acceptor's transport: TLS or plaintext, told by the first byte ---- */

/* A connection context for kv_net_conn_opts.io = &kv_link_sniff_io: its
 * handshake waits for the peer's first byte (peeked, not consumed); 0x16
 * starts a TLS 1.3 server session of x (no pin: the peer's identity comes
 * from the key handshake bound to the exporter), anything else makes the
 * connection plain TCP. The connection owns it (io->close frees it). */
typedef struct kv_link_sniff kv_link_sniff;
extern const kv_net_io_ops kv_link_sniff_io;
int kv_link_sniff_new(kv_link_sniff **out, kv_tls_ctx *x, kv_diag *d);
/* The TLS session once the handshake phase chose TLS (and completed), else
 * NULL (plaintext, or undecided). */
kv_tls *kv_link_sniff_tls(const kv_link_sniff *s);
/* The connector's transport: a TLS 1.3 client session of x pinned to
 * pin_key ([32], or NULL), which also recognizes a server that answers in
 * plaintext (its first byte is no TLS record: a refusal frame such as a
 * busy worker's ERROR, written before it knew the transport). Such a
 * connection opens without TLS; nothing more is sent on it, and its owner
 * must read it only for that refusal (kv_link_sniff_plain_answer), never
 * as a downgrade. */
int kv_link_sniff_new_client(kv_link_sniff **out, kv_tls_ctx *x, const uint8_t *pin_key, kv_diag *d);
bool kv_link_sniff_plain_answer(const kv_link_sniff *s);
/* The same for a blocking dial: runs t's client handshake on fd (made
 * nonblocking) within timeout_ms. 0; or, when the server answered in
 * plaintext, KV_EPROTO with *plain set and its bytes left unread in fd (read
 * them only as a refusal); or kv_tls_handshake_fd's codes. */
int kv_link_tls_client_fd(kv_tls *t, int fd, int timeout_ms, bool *plain, kv_diag *d);
/* True while the peer has sent nothing (the transport is not yet known). */
bool kv_link_sniff_undecided(const kv_link_sniff *s);

/* ---- a blocking channel: plain TCP or TLS ------------------------------------- */

/* A connected socket and, when tls is not NULL, the established TLS session
 * on it; bytes go through the session then. Reads and writes keep
 * kv_link_io's contract (limits, cancellation every KV_LINK_POLL_MS for
 * reads, closed). */
typedef struct kv_link_chan {
    int fd;
    kv_tls *tls;
} kv_link_chan;
int kv_link_chan_read_full(const kv_link_chan *c, void *buf, size_t n, kv_link_io *io, kv_diag *d);
int kv_link_chan_write_full(const kv_link_chan *c, const void *buf, size_t n, kv_link_io *io, kv_diag *d);

/* A node's TLS context from its Ed25519 secret key (seed || pk). */
int kv_link_tls_ctx(kv_tls_ctx **out, const uint8_t sk[64], kv_diag *d);

/* The warning a command prints at start when --insecure-plaintext is given
 * (what: "worker", "ring node", ...), on stderr. */
void kv_link_warn_plaintext(const char *what);

#endif
