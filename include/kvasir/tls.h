/* TLS: the encrypted transport of the link layer (OpenSSL), for our own
 * sockets: the event loop's connections (as kv_net_io_ops) and blocking
 * client paths. docs/PROTOCOL.md ("TLS transport") is the wire contract.
 *
 *   - Versions: TLS 1.3 only (minimum = maximum); a peer offering only
 *     older versions, or plaintext sent to a TLS port, fails the handshake
 *     with an error that says so. No session tickets, no resumption: every
 *     session is a full handshake.
 *   - Certificates need no authority. A node's certificate is self-signed
 *     with its own Ed25519 node key, made in memory (kv_tls_ctx_new); a hub
 *     or gateway may load one from PEM files instead (kv_tls_ctx_load). The
 *     peer is authenticated by pinning: the Ed25519 key its certificate
 *     carries (what the hub's placement map says a node is), or the SHA-256
 *     fingerprint of its certificate's public key (how a hub is named in a
 *     URL, `#sha256=<hex>`). TLS 1.3's CertificateVerify proves the peer
 *     holds the private key of the key it presents.
 *   - Fingerprint: SHA-256 over the DER encoding of the certificate's
 *     SubjectPublicKeyInfo, as 64 lowercase hex digits (the same value as
 *     `openssl x509 -pubkey -noout | openssl pkey -pubin -outform der |
 *     sha256sum`, and the digest behind curl's `sha256//` public-key pin).
 *     It names a key, not a certificate: a renewed certificate for the same
 *     key keeps it.
 *   - Channel binding: the exporter (RFC 8446 section 7.5) with label
 *     KV_TLS_EXPORTER_LABEL, an empty context and 32 bytes; both ends of one
 *     session compute the same value, and no other session has it, so a key
 *     handshake that signs it cannot be relayed by a man in the middle that
 *     terminates TLS itself.
 *
 * Thread safety: a kv_tls_ctx is immutable after it is made and may be
 * shared by sessions on any threads; a kv_tls is used by one thread at a
 * time (the loop's, or the blocking caller's). */
#ifndef KVASIR_TLS_H
#define KVASIR_TLS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/link.h"
#include "kvasir/net.h"

#define KV_TLS_EXPORTER_LABEL "EXPORTER-kvasir-link"
#define KV_TLS_EXPORTER_LEN 32u /* bytes of the channel binding */
#define KV_TLS_FP_HEX 64u        /* hex digits of a fingerprint (out buffers hold 65) */
#define KV_TLS_MAX_PEM (64u << 10) /* bytes of a PEM file read at most */

typedef struct kv_tls_ctx kv_tls_ctx; /* a certificate and its key, for both roles */
typedef struct kv_tls kv_tls;         /* one session */

/* ---- contexts ----------------------------------------------------------------- */

/* A context whose certificate is self-signed with the node key k (Ed25519),
 * made in memory: subject and issuer O=kvasir, CN=<64 hex of the key>, a
 * random serial, valid from an hour ago for 100 years (validity is not what
 * authenticates: the pinned key is). Returns 0 and *out (free with
 * kv_tls_ctx_free), or KV_EINTERNAL if OpenSSL refuses (the reason in d). */
int kv_tls_ctx_new(kv_tls_ctx **out, const kv_node_key *k, kv_diag *d);
/* A context from a PEM certificate file and a PEM private-key file (each at
 * most KV_TLS_MAX_PEM bytes); the key must match the certificate. Any key
 * type OpenSSL can use in TLS 1.3. KV_ENOTFOUND / KV_EIO (cannot read),
 * KV_EFORMAT (not PEM, or the key does not match), naming the file. */
int kv_tls_ctx_load(kv_tls_ctx **out, const char *cert_path, const char *key_path, kv_diag *d);
/* The same from PEM text in memory (each NUL-terminated, at most
 * KV_TLS_MAX_PEM bytes): how a hub serves the certificate it holds in
 * memory (kv_https_cert) on its relay port too, so that one fingerprint
 * names both. KV_EINVAL (a PEM missing or too long), KV_EFORMAT. */
int kv_tls_ctx_from_pem(kv_tls_ctx **out, const char *cert_pem, const char *key_pem, kv_diag *d);
void kv_tls_ctx_free(kv_tls_ctx *x); /* accepts NULL */
/* Writes the context's certificate (and, when key_path is not NULL, its
 * private key, mode 0600) as PEM. 0, or KV_EIO naming the file. */
int kv_tls_ctx_write_pem(const kv_tls_ctx *x, const char *cert_path, const char *key_path, kv_diag *d);
/* The fingerprint of the context's own certificate into out[65]. */
void kv_tls_ctx_fingerprint(const kv_tls_ctx *x, char out[KV_TLS_FP_HEX + 1]);

/* ---- fingerprints --------------------------------------------------------------- */

/* The fingerprint (see above) of a DER-encoded X.509 certificate der[0, n).
 * 0, or KV_EFORMAT when it does not parse as exactly one certificate. */
int kv_tls_fingerprint_der(const uint8_t *der, size_t n, char out[KV_TLS_FP_HEX + 1], kv_diag *d);
/* The fingerprint of the first certificate in a PEM file (at most
 * KV_TLS_MAX_PEM bytes). KV_ENOTFOUND / KV_EIO / KV_EFORMAT naming it. */
int kv_tls_fingerprint_pem_file(const char *path, char out[KV_TLS_FP_HEX + 1], kv_diag *d);

/* A fingerprint as a user writes it: "sha256:<64 hex>" or the 64 hex digits
 * alone, either case, s[0, n) (the part after `#sha256=` in a URL, or the
 * hub's `tls sha256:<hex>` line without "tls "). Writes the 64 lowercase
 * digits into out[65]. 0, or KV_EINVAL naming what is wrong. */
int kv_tls_fingerprint_parse(const char *s, size_t n, char out[KV_TLS_FP_HEX + 1], kv_diag *d);

/* ---- sessions --------------------------------------------------------------------- */

typedef struct kv_tls_opts {
    bool server;             /* accept (true) or connect (false) */
    const uint8_t *pin_key;  /* [32] the Ed25519 key the peer's certificate must carry; NULL = none */
    const char *pin_sha256;  /* 64 hex digits the peer's fingerprint must equal; NULL = none */
    const char *alpn;        /* one ALPN protocol (1..255 bytes): a client offers it, a server
                                accepts it when offered (never requires it); NULL = none */
} kv_tls_opts;

/* A session of context x (x must outlive it). A client always checks the
 * pins it is given; a server asks the client for a certificate, and
 * requires one only when it pins something. A peer that fails a pin fails
 * the handshake with KV_EAUTH. With no pin at all the peer is anyone: the
 * identity must then come from a key handshake bound to kv_tls_exporter.
 * Returns 0 and *out (free with kv_tls_free, or hand it to a connection
 * with kv_tls_net_io, which frees it), KV_EINVAL (a pin that is not 64
 * lowercase hex digits), KV_ENOMEM. */
int kv_tls_new(kv_tls **out, kv_tls_ctx *x, const kv_tls_opts *o, kv_diag *d);
/* Frees the session (accepts NULL); never closes the fd. No close_notify is
 * sent: every protocol on top frames its messages, so a truncation between
 * frames is a closed connection and inside one an error. */
void kv_tls_free(kv_tls *t);

/* The event loop's transport: kv_net_conn_opts.io = &kv_tls_net_io,
 * io_ctx = a kv_tls from kv_tls_new (the connection owns it from then on,
 * also when kv_net_conn_new / _dial fail). Its handshake runs in the
 * loop's handshake phase (net.h), bounded by handshake_timeout_ms;
 * SSL_ERROR_WANT_READ / WANT_WRITE are EAGAIN; a failure's reason is
 * kv_tls_why. */
extern const kv_net_io_ops kv_tls_net_io;

/* True once the handshake completed (pins checked). */
bool kv_tls_established(const kv_tls *t);
/* The one-line reason of the last failure ("" if none). Valid until the
 * next call on t. */
const char *kv_tls_why(const kv_tls *t);
/* The Ed25519 key in the peer's certificate into pk[32]: 0, KV_ENOTFOUND
 * (no handshake yet, or the peer sent no certificate), KV_EUNSUPPORTED
 * (its key is not Ed25519). */
int kv_tls_peer_key(const kv_tls *t, uint8_t pk[32]);
/* The peer certificate's fingerprint into out[65]: 0 or KV_ENOTFOUND. */
int kv_tls_peer_fingerprint(const kv_tls *t, char out[KV_TLS_FP_HEX + 1]);
/* The session's channel binding (see above) into out[32]: 0, or KV_EPROTO
 * before the handshake completed. */
int kv_tls_exporter(const kv_tls *t, uint8_t out[KV_TLS_EXPORTER_LEN]);

/* ---- blocking use -------------------------------------------------------------------- */

/* Runs t's handshake on a connected socket fd (made nonblocking here; the
 * caller still owns it) within timeout_ms (> 0), waiting with poll. 0, or
 * KV_ETIMEOUT, KV_EAUTH (a pin failed), KV_EPROTO (not TLS, no TLS 1.3, a
 * handshake error), KV_EIO (the connection failed); the reason in d. */
int kv_tls_handshake_fd(kv_tls *t, int fd, int timeout_ms, kv_diag *d);
/* kv_link_connect to host_port and a client handshake with o's pins, all
 * within timeout_ms (0 = 5000). Returns 0 with *out (kv_tls_free) and *fd
 * (nonblocking; the caller closes it); on failure both are NULL / -1 and the code is
 * kv_link_connect's or kv_tls_handshake_fd's. */
int kv_tls_dial(kv_tls **out, int *fd, kv_tls_ctx *x, const kv_tls_opts *o, const char *host_port,
                int timeout_ms, kv_diag *d);
/* Writes all n bytes, or reads exactly n bytes, over an established session
 * within timeout_ms (> 0) for the whole call. 0, KV_ETIMEOUT, KV_EIO (the
 * connection closed or failed; for a read, the bytes read so far are in
 * *got when got is not NULL), or KV_EPROTO (a record failed, e.g. one
 * altered on the way: the session is unusable from then on). */
int kv_tls_write_full(kv_tls *t, const void *buf, size_t n, int timeout_ms, kv_diag *d);
int kv_tls_read_full(kv_tls *t, void *buf, size_t n, size_t *got, int timeout_ms, kv_diag *d);

#endif
