/* TLS 1.3 over OpenSSL for the link layer (include/kvasir/tls.h has the
 * contract, docs/PROTOCOL.md the wire view).
 *
 * Invariants: every SSL_CTX is TLS 1.3 only, without tickets or a session
 * cache, and authenticates peers by pins alone: chain verification is
 * replaced by kv_tls_verify_cb, which checks the leaf against the session's
 * pins, so a self-signed certificate is the normal case. Sockets are driven
 * through our own BIO, which sends with MSG_NOSIGNAL (a peer that resets
 * never raises SIGPIPE in a process that did not ignore it) and maps
 * EAGAIN to OpenSSL's retry flags. Every OpenSSL error is turned into one
 * line in kv_tls.why, with the cases a user meets (plaintext, an old
 * version, a wrong key) said plainly.
 *
 * After the handshake a write never waits for input (TLS 1.3 has no
 * renegotiation, and we send no KeyUpdate). A read may write: the answer to
 * a KeyUpdate the peer asks for, a few bytes that the socket takes unless
 * the peer stops reading; then that read reports EAGAIN and only that
 * peer's connection waits.
 *
 * Hot path: SSL_read_ex / SSL_write_ex straight into the loop's buffers
 * (partial writes and a moving write buffer allowed, as the loop compacts
 * its queue); nothing here allocates after the handshake. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include "kvasir/tls.h"

#define KV_TLS_CERT_DAYS 36500 /* validity of a self-signed certificate (not what authenticates) */

struct kv_tls_ctx {
    SSL_CTX *ssl;                   /* TLS 1.3 only, pins via kv_tls_verify_cb */
    X509 *cert;                     /* our certificate */
    EVP_PKEY *key;                  /* its private key */
    char fp[KV_TLS_FP_HEX + 1];     /* the certificate's fingerprint */
};

struct kv_tls {
    SSL *ssl;
    int fd;                         /* bound socket (not owned); -1 before the first handshake step */
    bool server;
    bool established;               /* handshake done, pins checked */
    bool pin_failed;                /* the verify callback refused the peer (why says how) */
    bool has_pin_key, has_pin_fp;
    uint8_t pin_key[32];            /* the Ed25519 key the peer must carry */
    char pin_fp[KV_TLS_FP_HEX + 1]; /* the fingerprint the peer must have */
    uint8_t alpn[256];              /* a server's ALPN protocol as a wire list (length byte first); alpn[0] = 0: none */
    char why[256];                  /* the last failure, one line */
    bool read_ahead;                /* set on the first read through the loop (kv_tls_net_io) */
    bool more;                      /* that read filled the caller's buffer: records may be buffered */
    /* the loop's writes: the records of one write gathered and sent at once (kv_tls_io_write) */
    uint8_t *wbuf;                  /* [KV_TLS_WRITE_BUF] records not yet sent, from woff to wlen */
    size_t wlen, woff;
    bool gather;                    /* inside kv_tls_io_write: the BIO appends to wbuf */
    bool owed;                      /* the last write's final plaintext byte is in wbuf already, reported
                                       unwritten: the next write skips it (the loop keeps it queued, so
                                       that it waits for writability until wbuf is out) */
};

/* The record layer's read buffer: room for four full records, so that one
 * recv takes a whole answer of a few tens of KiB (with read-ahead, which
 * the loop's sessions use) instead of two recvs per 16 KiB record. */
#define KV_TLS_READ_BUF (4 * (16384 + 512))
/* The loop's writes: up to four records' plaintext per call, their
 * ciphertext gathered here and sent with one send (a 64 KiB answer was five
 * sends and five loopback segments, one per record). */
#define KV_TLS_WRITE_PLAIN (4 * 16384)
#define KV_TLS_WRITE_BUF (4 * (16384 + 512))

/* ---- the socket BIO: send with MSG_NOSIGNAL ------------------------------------- */

static BIO_METHOD *g_bio_method;
static pthread_once_t g_bio_once = PTHREAD_ONCE_INIT;

static int kv_bio_fd(BIO *b) { return ((kv_tls *)BIO_get_data(b))->fd; }

/* Sends what wbuf holds: 0 when it is all out, -1 with errno (EAGAIN: the
 * socket is full) otherwise. */
static int kv_tls_wflush(kv_tls *t) {
    while (t->woff < t->wlen) {
        ssize_t k = send(t->fd, t->wbuf + t->woff, t->wlen - t->woff, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) return -1;
        t->woff += (size_t)k;
    }
    t->woff = t->wlen = 0;
    return 0;
}

/* Records reach the socket in order: what wbuf holds goes first. Inside
 * kv_tls_io_write they are appended to wbuf and sent at its end. */
static int kv_bio_write(BIO *b, const char *buf, int n) {
    kv_tls *t = BIO_get_data(b);
    BIO_clear_retry_flags(b);
    if (t->gather && t->wlen + (size_t)n <= KV_TLS_WRITE_BUF) {
        memcpy(t->wbuf + t->wlen, buf, (size_t)n);
        t->wlen += (size_t)n;
        return n;
    }
    if (t->woff < t->wlen && kv_tls_wflush(t)) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) BIO_set_retry_write(b);
        return -1;
    }
    ssize_t k = send(t->fd, buf, (size_t)n, MSG_NOSIGNAL);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) BIO_set_retry_write(b);
    return (int)k;
}

/* A client's BIO until its first byte came: a first byte that is no TLS
 * record (types 20..23) is left unread and the read fails (EPROTO), so the
 * server's plaintext answer (a refusal frame written before it knew the
 * transport) stays whole in the socket for the owner to read. Until the
 * peek has seen that byte, the read is the peek's answer (nothing yet, end
 * of stream, an error), never a recv after it: bytes that arrive between
 * the two calls would be read unchecked and the flag left set, so the next
 * read would judge the middle of the first record (a busy machine did:
 * "the server answered in plaintext" on a TLS server). */
#define KV_BIO_FLAG_FIRST 0x40000000

/* What a recv (or the first byte's peek) returned, as a BIO read: the
 * retry flag on EAGAIN, the end-of-stream flag on 0. */
static int kv_bio_read_result(BIO *b, ssize_t k) {
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) BIO_set_retry_read(b);
    if (k == 0) BIO_set_flags(b, BIO_FLAGS_IN_EOF); /* BIO_eof: the record layer's end of stream */
    return (int)k;
}

static int kv_bio_read(BIO *b, char *buf, int n) {
    BIO_clear_retry_flags(b);
    if (BIO_test_flags(b, KV_BIO_FLAG_FIRST)) {
        uint8_t c;
        ssize_t p = recv(kv_bio_fd(b), &c, 1, MSG_PEEK);
        if (p != 1) return kv_bio_read_result(b, p);
        if (c < 0x14 || c > 0x17) {
            errno = EPROTO;
            return -1;
        }
        BIO_clear_flags(b, KV_BIO_FLAG_FIRST);
    }
    return kv_bio_read_result(b, recv(kv_bio_fd(b), buf, (size_t)n, 0));
}

static long kv_bio_ctrl(BIO *b, int cmd, long num, void *ptr) {
    (void)num;
    (void)ptr;
    if (cmd == BIO_CTRL_FLUSH) return 1;
    if (cmd == BIO_CTRL_EOF) return BIO_test_flags(b, BIO_FLAGS_IN_EOF) != 0;
    return 0;
}

static int kv_bio_create(BIO *b) {
    BIO_set_init(b, 1);
    return 1;
}

static void kv_bio_init_method(void) {
    BIO_METHOD *m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "kvasir socket");
    if (m && BIO_meth_set_write(m, kv_bio_write) && BIO_meth_set_read(m, kv_bio_read) &&
        BIO_meth_set_ctrl(m, kv_bio_ctrl) && BIO_meth_set_create(m, kv_bio_create))
        g_bio_method = m;
    else
        BIO_meth_free(m);
}

/* ---- fingerprints ------------------------------------------------------------------ */

/* SHA-256 over the DER of cert's SubjectPublicKeyInfo, as lowercase hex. */
static int kv_tls_cert_fp(X509 *cert, char out[KV_TLS_FP_HEX + 1]) {
    unsigned char *der = NULL;
    int n = i2d_X509_PUBKEY(X509_get_X509_PUBKEY(cert), &der);
    if (n <= 0) return KV_EFORMAT;
    uint8_t h[32];
    unsigned hl = 0;
    int ok = EVP_Digest(der, (size_t)n, h, &hl, EVP_sha256(), NULL);
    OPENSSL_free(der);
    if (!ok || hl != 32) return KV_EINTERNAL;
    kv_hex(h, 32, out);
    return 0;
}

/* The Ed25519 key of cert: 0, or KV_EUNSUPPORTED (another key type). */
static int kv_tls_cert_ed25519(X509 *cert, uint8_t pk[32]) {
    EVP_PKEY *k = X509_get0_pubkey(cert);
    size_t n = 32;
    if (!k || EVP_PKEY_get_id(k) != EVP_PKEY_ED25519 || !EVP_PKEY_get_raw_public_key(k, pk, &n) || n != 32)
        return KV_EUNSUPPORTED;
    return 0;
}

int kv_tls_fingerprint_der(const uint8_t *der, size_t n, char out[KV_TLS_FP_HEX + 1], kv_diag *d) {
    if (!der || n == 0 || n > KV_TLS_MAX_PEM) return kv_fail(d, KV_EFORMAT, "certificate: %zu bytes of DER", n);
    const unsigned char *p = der;
    X509 *c = d2i_X509(NULL, &p, (long)n);
    if (!c || p != der + n) {
        X509_free(c);
        return kv_fail(d, KV_EFORMAT, "certificate: not one DER X.509 certificate (%zu bytes)", n);
    }
    int rc = kv_tls_cert_fp(c, out);
    X509_free(c);
    return rc ? kv_fail(d, rc, "certificate: no public key to fingerprint") : 0;
}

/* Reads the whole file at path (at most KV_TLS_MAX_PEM bytes) into a BIO. */
static int kv_tls_read_pem(const char *path, const char *what, BIO **out, kv_diag *d) {
    *out = NULL;
    if (!path || !*path) return kv_fail(d, KV_EINVAL, "%s: no file given", what);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return kv_fail(d, errno == ENOENT ? KV_ENOTFOUND : KV_EIO, "%s '%s': %s", what, path, strerror(errno));
    char *buf = malloc(KV_TLS_MAX_PEM + 1);
    size_t have = 0;
    ssize_t k = 0;
    while (buf && have <= KV_TLS_MAX_PEM && (k = read(fd, buf + have, KV_TLS_MAX_PEM + 1 - have)) > 0)
        have += (size_t)k;
    int e = errno;
    close(fd);
    int rc = 0;
    if (!buf) rc = kv_fail(d, KV_ENOMEM, "%s '%s': out of memory", what, path);
    else if (k < 0) rc = kv_fail(d, KV_EIO, "%s '%s': %s", what, path, strerror(e));
    else if (have > KV_TLS_MAX_PEM)
        rc = kv_fail(d, KV_EFORMAT, "%s '%s': larger than %u bytes", what, path, KV_TLS_MAX_PEM);
    else if (!(*out = BIO_new(BIO_s_mem())) || BIO_write(*out, buf, (int)have) != (int)have)
        rc = kv_fail(d, KV_ENOMEM, "%s '%s': out of memory", what, path);
    free(buf);
    if (rc) {
        BIO_free(*out);
        *out = NULL;
    }
    return rc;
}

/* A password callback that gives none: an encrypted key fails to load
 * instead of prompting on a terminal. */
static int kv_tls_no_password(char *buf, int size, int rwflag, void *u) {
    (void)buf;
    (void)size;
    (void)rwflag;
    (void)u;
    return 0;
}

int kv_tls_fingerprint_pem_file(const char *path, char out[KV_TLS_FP_HEX + 1], kv_diag *d) {
    BIO *b = NULL;
    int rc = kv_tls_read_pem(path, "certificate", &b, d);
    if (rc) return rc;
    X509 *c = PEM_read_bio_X509(b, NULL, kv_tls_no_password, NULL);
    BIO_free(b);
    ERR_clear_error();
    if (!c) return kv_fail(d, KV_EFORMAT, "certificate '%s': no PEM certificate in it", path);
    rc = kv_tls_cert_fp(c, out);
    X509_free(c);
    return rc ? kv_fail(d, rc, "certificate '%s': no public key to fingerprint", path) : 0;
}

int kv_tls_fingerprint_parse(const char *s, size_t n, char out[KV_TLS_FP_HEX + 1], kv_diag *d) {
    static const char pre[] = "sha256:";
    if (!s) return kv_fail(d, KV_EINVAL, "fingerprint: none given");
    if (n >= sizeof pre - 1 && !strncasecmp(s, pre, sizeof pre - 1)) s += sizeof pre - 1, n -= sizeof pre - 1;
    uint8_t b[32];
    if (n != KV_TLS_FP_HEX || kv_unhex(s, n, b, sizeof b, true))
        return kv_fail(d, KV_EINVAL, "fingerprint: expected sha256:<64 hex digits>, got %zu characters%s", n,
                       n == KV_TLS_FP_HEX ? " that are not all hex" : "");
    kv_hex(b, sizeof b, out);
    return 0;
}

/* ---- contexts ------------------------------------------------------------------------ */

/* The peer's leaf against the session's pins; replaces chain verification. */
static int kv_tls_verify_cb(X509_STORE_CTX *sx, void *arg) {
    (void)arg;
    SSL *ssl = X509_STORE_CTX_get_ex_data(sx, SSL_get_ex_data_X509_STORE_CTX_idx());
    kv_tls *t = ssl ? SSL_get_app_data(ssl) : NULL;
    X509 *cert = X509_STORE_CTX_get0_cert(sx);
    if (!t || !cert) return 0;
    char have[KV_TLS_FP_HEX + 1];
    if (t->has_pin_key) {
        uint8_t pk[32];
        char want[65], got[65];
        kv_hex(t->pin_key, 32, want);
        if (kv_tls_cert_ed25519(cert, pk)) {
            snprintf(t->why, sizeof t->why, "TLS: the peer's certificate key is not Ed25519 (pinned key %.16s...)",
                     want);
            goto refuse;
        }
        if (memcmp(pk, t->pin_key, 32)) {
            kv_hex(pk, 32, got);
            snprintf(t->why, sizeof t->why, "TLS: the peer's certificate carries key %.16s..., not the pinned %.16s...",
                     got, want);
            goto refuse;
        }
    }
    if (t->has_pin_fp) {
        if (kv_tls_cert_fp(cert, have)) {
            snprintf(t->why, sizeof t->why, "TLS: the peer's certificate has no public key to fingerprint");
            goto refuse;
        }
        if (strcmp(have, t->pin_fp)) {
            snprintf(t->why, sizeof t->why,
                     "TLS: the peer's certificate fingerprint sha256:%.16s... is not the pinned sha256:%.16s...", have,
                     t->pin_fp);
            goto refuse;
        }
    }
    return 1;
refuse:
    t->pin_failed = true;
    X509_STORE_CTX_set_error(sx, X509_V_ERR_APPLICATION_VERIFICATION);
    return 0;
}

/* The OpenSSL error queue's first entry as "what: reason", then cleared. */
static int kv_tls_ossl_fail(kv_diag *d, int code, const char *what) {
    unsigned long e = ERR_get_error();
    const char *r = e ? ERR_reason_error_string(e) : NULL;
    ERR_clear_error();
    return kv_fail(d, code, "%s: %s", what, r ? r : "OpenSSL error");
}

/* A server accepts its session's one ALPN protocol when the client offers
 * it, and answers without ALPN otherwise (a client that offers none, or
 * others, still connects: what the connection is for is said inside it). */
static int kv_tls_alpn_cb(SSL *ssl, const unsigned char **out, unsigned char *outlen, const unsigned char *in,
                          unsigned inlen, void *arg) {
    (void)arg;
    const kv_tls *t = SSL_get_app_data(ssl);
    unsigned char *sel = NULL;
    if (!t || !t->alpn[0]) return SSL_TLSEXT_ERR_NOACK;
    if (SSL_select_next_proto(&sel, outlen, t->alpn, (unsigned)t->alpn[0] + 1u, in, inlen) != OPENSSL_NPN_NEGOTIATED)
        return SSL_TLSEXT_ERR_NOACK;
    *out = sel;
    return SSL_TLSEXT_ERR_OK;
}

/* Takes x->cert and x->key and builds the SSL_CTX around them. */
static int kv_tls_ctx_finish(kv_tls_ctx *x, kv_diag *d) {
    SSL_CTX *s = SSL_CTX_new(TLS_method());
    x->ssl = s;
    if (!s) return kv_tls_ossl_fail(d, KV_EINTERNAL, "TLS context");
    if (!SSL_CTX_set_min_proto_version(s, TLS1_3_VERSION) || !SSL_CTX_set_max_proto_version(s, TLS1_3_VERSION))
        return kv_tls_ossl_fail(d, KV_EINTERNAL, "TLS context: versions");
    /* no tickets, no cache: every session is a full handshake, and nothing
     * arrives after it that the reader has not asked for */
    SSL_CTX_set_num_tickets(s, 0);
    SSL_CTX_set_session_cache_mode(s, SSL_SESS_CACHE_OFF);
    /* a TCP close without close_notify reads as end of stream: the
     * protocols on top frame every message */
    SSL_CTX_set_options(s, SSL_OP_NO_TICKET | SSL_OP_IGNORE_UNEXPECTED_EOF);
    SSL_CTX_set_mode(s, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    SSL_CTX_set_cert_verify_callback(s, kv_tls_verify_cb, NULL);
    SSL_CTX_set_alpn_select_cb(s, kv_tls_alpn_cb, NULL);
    if (SSL_CTX_use_certificate(s, x->cert) != 1 || SSL_CTX_use_PrivateKey(s, x->key) != 1)
        return kv_tls_ossl_fail(d, KV_EINTERNAL, "TLS context: certificate");
    if (SSL_CTX_check_private_key(s) != 1)
        return kv_tls_ossl_fail(d, KV_EFORMAT, "TLS context: the private key does not match the certificate");
    if (kv_tls_cert_fp(x->cert, x->fp)) return kv_fail(d, KV_EFORMAT, "TLS context: certificate without a key");
    return 0;
}

void kv_tls_ctx_free(kv_tls_ctx *x) {
    if (!x) return;
    SSL_CTX_free(x->ssl);
    X509_free(x->cert);
    EVP_PKEY_free(x->key);
    free(x);
}

int kv_tls_ctx_new(kv_tls_ctx **out, const kv_node_key *k, kv_diag *d) {
    *out = NULL;
    kv_tls_ctx *x = calloc(1, sizeof *x);
    if (!x) return kv_fail(d, KV_ENOMEM, "TLS context: out of memory");
    int rc = KV_EINTERNAL;
    uint8_t pk[32], serial[16];
    size_t pl = sizeof pk;
    char cn[65];
    BIGNUM *bn = NULL;
    x->key = EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, NULL, k->sk, 32); /* the seed */
    if (!x->key || !EVP_PKEY_get_raw_public_key(x->key, pk, &pl) || pl != 32) {
        rc = kv_tls_ossl_fail(d, KV_EINTERNAL, "TLS certificate: Ed25519 key");
        goto out;
    }
    KV_ASSERT(memcmp(pk, k->pk, 32) == 0); /* a kv_node_key's pk is its seed's */
    x->cert = X509_new();
    if (!x->cert || RAND_bytes(serial, sizeof serial) != 1) goto ossl;
    serial[0] &= 0x7f; /* a positive serial */
    serial[0] |= 0x01; /* of full length */
    bn = BN_bin2bn(serial, sizeof serial, NULL);
    kv_hex(k->pk, 32, cn);
    X509_NAME *name = X509_get_subject_name(x->cert);
    if (!bn || !X509_set_version(x->cert, 2) || !BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(x->cert)) ||
        !X509_gmtime_adj(X509_getm_notBefore(x->cert), -3600) ||
        !X509_time_adj_ex(X509_getm_notAfter(x->cert), KV_TLS_CERT_DAYS, 0, NULL) ||
        !X509_set_pubkey(x->cert, x->key) ||
        !X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC, (const unsigned char *)"kvasir", -1, -1, 0) ||
        !X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, (const unsigned char *)cn, -1, -1, 0) ||
        !X509_set_issuer_name(x->cert, name) || X509_sign(x->cert, x->key, NULL) <= 0)
        goto ossl;
    rc = kv_tls_ctx_finish(x, d);
    goto out;
ossl:
    rc = kv_tls_ossl_fail(d, KV_EINTERNAL, "TLS certificate");
out:
    BN_free(bn);
    if (rc) kv_tls_ctx_free(x);
    else *out = x;
    return rc;
}

/* A context from two memory BIOs of PEM; cert_name and key_name name them in
 * errors. */
static int kv_tls_ctx_from_bios(kv_tls_ctx **out, BIO *cb, BIO *kb, const char *cert_name, const char *key_name,
                                kv_diag *d) {
    kv_tls_ctx *x = calloc(1, sizeof *x);
    int rc = 0;
    if (!x) rc = kv_fail(d, KV_ENOMEM, "TLS context: out of memory");
    if (!rc && !(x->cert = PEM_read_bio_X509(cb, NULL, kv_tls_no_password, NULL)))
        rc = kv_fail(d, KV_EFORMAT, "%s: no PEM certificate in it", cert_name);
    if (!rc && !(x->key = PEM_read_bio_PrivateKey(kb, NULL, kv_tls_no_password, NULL)))
        rc = kv_fail(d, KV_EFORMAT, "%s: no unencrypted PEM private key in it", key_name);
    ERR_clear_error();
    if (!rc && X509_check_private_key(x->cert, x->key) != 1) {
        ERR_clear_error();
        rc = kv_fail(d, KV_EFORMAT, "%s is not the key of %s", key_name, cert_name);
    }
    if (!rc) rc = kv_tls_ctx_finish(x, d);
    if (rc) kv_tls_ctx_free(x);
    else *out = x;
    return rc;
}

int kv_tls_ctx_load(kv_tls_ctx **out, const char *cert_path, const char *key_path, kv_diag *d) {
    *out = NULL;
    BIO *cb = NULL, *kb = NULL;
    int rc = kv_tls_read_pem(cert_path, "--tls-cert", &cb, d);
    if (!rc) rc = kv_tls_read_pem(key_path, "--tls-key", &kb, d);
    char cn[300], kn[300];
    snprintf(cn, sizeof cn, "--tls-cert '%.280s'", cert_path);
    snprintf(kn, sizeof kn, "--tls-key '%.280s'", key_path);
    if (!rc) rc = kv_tls_ctx_from_bios(out, cb, kb, cn, kn, d);
    BIO_free(cb);
    BIO_free(kb);
    return rc;
}

int kv_tls_ctx_from_pem(kv_tls_ctx **out, const char *cert_pem, const char *key_pem, kv_diag *d) {
    *out = NULL;
    if (!cert_pem || !key_pem) return kv_fail(d, KV_EINVAL, "TLS context: needs a PEM certificate and key");
    const size_t cl = strlen(cert_pem), kl = strlen(key_pem);
    if (cl > KV_TLS_MAX_PEM || kl > KV_TLS_MAX_PEM)
        return kv_fail(d, KV_EINVAL, "TLS context: PEM over %u bytes", KV_TLS_MAX_PEM);
    BIO *cb = BIO_new_mem_buf(cert_pem, (int)cl), *kb = BIO_new_mem_buf(key_pem, (int)kl);
    int rc = cb && kb ? kv_tls_ctx_from_bios(out, cb, kb, "the PEM certificate", "the PEM key", d)
                      : kv_fail(d, KV_ENOMEM, "TLS context: out of memory");
    BIO_free(cb);
    BIO_free(kb);
    return rc;
}

int kv_tls_ctx_write_pem(const kv_tls_ctx *x, const char *cert_path, const char *key_path, kv_diag *d) {
    FILE *f = fopen(cert_path, "w");
    if (!f) return kv_fail(d, KV_EIO, "certificate '%s': %s", cert_path, strerror(errno));
    int ok = PEM_write_X509(f, x->cert);
    ok = fclose(f) == 0 && ok;
    if (!ok) return kv_fail(d, KV_EIO, "certificate '%s': write failed", cert_path);
    if (!key_path) return 0;
    int fd = open(key_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || !(f = fdopen(fd, "w"))) {
        int e = errno;
        if (fd >= 0) close(fd);
        return kv_fail(d, KV_EIO, "key '%s': %s", key_path, strerror(e));
    }
    ok = PEM_write_PrivateKey(f, x->key, NULL, NULL, 0, NULL, NULL);
    ok = fclose(f) == 0 && ok;
    return ok ? 0 : kv_fail(d, KV_EIO, "key '%s': write failed", key_path);
}

void kv_tls_ctx_fingerprint(const kv_tls_ctx *x, char out[KV_TLS_FP_HEX + 1]) { memcpy(out, x->fp, sizeof x->fp); }

/* ---- sessions ----------------------------------------------------------------------------- */

static bool kv_tls_is_hex64(const char *s) {
    if (strlen(s) != KV_TLS_FP_HEX) return false;
    for (const char *p = s; *p; p++)
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f'))) return false;
    return true;
}

int kv_tls_new(kv_tls **out, kv_tls_ctx *x, const kv_tls_opts *o, kv_diag *d) {
    *out = NULL;
    if (o->pin_sha256 && !kv_tls_is_hex64(o->pin_sha256))
        return kv_fail(d, KV_EINVAL, "TLS pin: a sha256 fingerprint is 64 lowercase hex digits");
    const size_t alen = o->alpn ? strlen(o->alpn) : 0;
    if (o->alpn && (alen == 0 || alen > 255)) return kv_fail(d, KV_EINVAL, "TLS ALPN: a protocol name is 1 to 255 bytes");
    pthread_once(&g_bio_once, kv_bio_init_method);
    if (!g_bio_method) return kv_fail(d, KV_EINTERNAL, "TLS: cannot make the socket BIO");
    kv_tls *t = calloc(1, sizeof *t);
    if (!t || !(t->ssl = SSL_new(x->ssl))) {
        free(t);
        ERR_clear_error();
        return kv_fail(d, KV_ENOMEM, "TLS session: out of memory");
    }
    t->fd = -1;
    t->server = o->server;
    if (o->pin_key) {
        t->has_pin_key = true;
        memcpy(t->pin_key, o->pin_key, 32);
    }
    if (o->pin_sha256) {
        t->has_pin_fp = true;
        memcpy(t->pin_fp, o->pin_sha256, sizeof t->pin_fp);
    }
    SSL_set_app_data(t->ssl, t);
    SSL_set_default_read_buffer_len(t->ssl, KV_TLS_READ_BUF);
    if (alen) {
        t->alpn[0] = (uint8_t)alen;
        memcpy(t->alpn + 1, o->alpn, alen);
        if (!o->server && SSL_set_alpn_protos(t->ssl, t->alpn, (unsigned)alen + 1u)) {
            kv_tls_free(t);
            ERR_clear_error();
            return kv_fail(d, KV_ENOMEM, "TLS session: out of memory (ALPN)");
        }
    }
    if (o->server) {
        const bool pinned = t->has_pin_key || t->has_pin_fp;
        SSL_set_verify(t->ssl, SSL_VERIFY_PEER | (pinned ? SSL_VERIFY_FAIL_IF_NO_PEER_CERT : 0), NULL);
        SSL_set_accept_state(t->ssl);
    } else {
        SSL_set_verify(t->ssl, SSL_VERIFY_PEER, NULL);
        SSL_set_connect_state(t->ssl);
    }
    *out = t;
    return 0;
}

void kv_tls_free(kv_tls *t) {
    if (!t) return;
    SSL_free(t->ssl);
    free(t->wbuf);
    free(t);
}

bool kv_tls_established(const kv_tls *t) { return t->established; }
const char *kv_tls_why(const kv_tls *t) { return t->why; }

/* Binds fd to the session through our BIO (once). */
static int kv_tls_bind(kv_tls *t, int fd) {
    if (t->fd >= 0) return 0;
    BIO *b = BIO_new(g_bio_method);
    if (!b) {
        snprintf(t->why, sizeof t->why, "TLS: out of memory");
        return KV_ENOMEM;
    }
    BIO_set_data(b, t);
    if (!t->server) BIO_set_flags(b, KV_BIO_FLAG_FIRST);
    SSL_set_bio(t->ssl, b, b);
    t->fd = fd;
    return 0;
}

/* A failed handshake step: its reason in t->why, and the code. */
static int kv_tls_handshake_fail(kv_tls *t, int sslerr) {
    const int sys = errno;
    unsigned long e = ERR_get_error();
    const char *r = e ? ERR_reason_error_string(e) : NULL;
    const int reason = e ? ERR_GET_REASON(e) : 0;
    ERR_clear_error();
    if (t->pin_failed) return KV_EAUTH; /* why set by the verify callback */
    if (!e && sslerr == SSL_ERROR_SYSCALL && sys == EPROTO && !t->server) {
        snprintf(t->why, sizeof t->why, "TLS handshake: the server answered in plaintext, not TLS");
        return KV_EPROTO;
    }
    if (!e && (sslerr == SSL_ERROR_ZERO_RETURN || sslerr == SSL_ERROR_SYSCALL)) {
        snprintf(t->why, sizeof t->why, "TLS handshake: %s",
                 sslerr == SSL_ERROR_SYSCALL && sys ? strerror(sys) : "the peer closed the connection");
        return KV_EIO;
    }
    if (!r) r = "OpenSSL error";
    switch (reason) {
    case SSL_R_WRONG_VERSION_NUMBER:
    case SSL_R_HTTP_REQUEST:
    case SSL_R_HTTPS_PROXY_REQUEST:
    case SSL_R_PACKET_LENGTH_TOO_LONG:
    case SSL_R_RECORD_LENGTH_MISMATCH:
        snprintf(t->why, sizeof t->why, "TLS handshake: the peer does not speak TLS (plaintext to a TLS port?): %s", r);
        return KV_EPROTO;
    case SSL_R_UNSUPPORTED_PROTOCOL:
    case SSL_R_NO_PROTOCOLS_AVAILABLE:
    case SSL_R_TLSV1_ALERT_PROTOCOL_VERSION:
        snprintf(t->why, sizeof t->why, "TLS handshake: the peer offers no TLS 1.3, which is required (%s)", r);
        return KV_EPROTO;
    case SSL_R_PEER_DID_NOT_RETURN_A_CERTIFICATE:
        snprintf(t->why, sizeof t->why, "TLS handshake: the peer presented no certificate, and its key is pinned");
        return KV_EAUTH;
    default:
        snprintf(t->why, sizeof t->why, "TLS handshake failed: %s", r);
        return KV_EPROTO;
    }
}

/* One nonblocking handshake step: 0 done, KV_NET_READ / KV_NET_WRITE while
 * waiting, or a negative code (why set). */
static int kv_tls_step(kv_tls *t, int fd) {
    if (t->established) return 0;
    int rc = kv_tls_bind(t, fd);
    if (rc) return rc;
    ERR_clear_error();
    errno = 0;
    int r = SSL_do_handshake(t->ssl);
    if (r == 1) {
        t->established = true;
        return 0;
    }
    int e = SSL_get_error(t->ssl, r);
    if (e == SSL_ERROR_WANT_READ) return KV_NET_READ;
    if (e == SSL_ERROR_WANT_WRITE) return KV_NET_WRITE;
    return kv_tls_handshake_fail(t, e);
}

/* After SSL_read_ex / SSL_write_ex returned 0: -1 with errno EAGAIN (retry
 * on readiness) or another errno (why set), or 0 for the end of stream. */
static ssize_t kv_tls_io_fail(kv_tls *t, int r, const char *op) {
    const int sys = errno;
    int e = SSL_get_error(t->ssl, r);
    if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
        errno = EAGAIN;
        return -1;
    }
    if (e == SSL_ERROR_ZERO_RETURN) return 0;
    unsigned long q = ERR_get_error();
    const char *rs = q ? ERR_reason_error_string(q) : NULL;
    ERR_clear_error();
    if (e == SSL_ERROR_SYSCALL && !q && !sys && op[0] == 'r') return 0; /* end of stream */
    if (e == SSL_ERROR_SYSCALL && !q) {
        snprintf(t->why, sizeof t->why, "TLS %s: %s", op, sys ? strerror(sys) : "connection closed");
        errno = sys ? sys : EPIPE;
        return -1;
    }
    snprintf(t->why, sizeof t->why, "TLS %s: %s", op, rs ? rs : "OpenSSL error");
    errno = EPROTO;
    return -1;
}

/* The loop's reads: read-ahead on (the record layer takes what the socket
 * holds, up to KV_TLS_READ_BUF, in one recv), and as many records as fit
 * buf in one call. What it stopped short of, when buf was full, is reported
 * by kv_tls_io_pending; when it stopped for want of input, the socket is
 * empty and its next bytes wake the loop. */
static ssize_t kv_tls_io_read(void *ctx, int fd, void *buf, size_t n) {
    kv_tls *t = ctx;
    (void)fd;
    if (!t->read_ahead) {
        SSL_set_read_ahead(t->ssl, 1);
        t->read_ahead = true;
    }
    t->more = false;
    size_t off = 0;
    while (off < n) {
        size_t got = 0;
        ERR_clear_error();
        int r = SSL_read_ex(t->ssl, (uint8_t *)buf + off, n - off, &got);
        if (r == 1) {
            off += got;
            continue;
        }
        if (off) { /* what was read first; a failure repeats on the next call */
            ERR_clear_error();
            return (ssize_t)off;
        }
        return kv_tls_io_fail(t, r, "read");
    }
    t->more = true;
    return (ssize_t)off;
}

/* The loop's writes: the records of up to KV_TLS_WRITE_PLAIN bytes are
 * gathered in wbuf and sent with one send. What the socket does not take
 * stays in wbuf, sent before anything else; so that the loop keeps waiting
 * for writability meanwhile, the last byte of such a write is reported
 * unwritten (it is in wbuf already: the next call skips it, t->owed). */
static ssize_t kv_tls_io_write(void *ctx, int fd, const void *buf, size_t n) {
    kv_tls *t = ctx;
    (void)fd;
    if (t->woff < t->wlen && kv_tls_wflush(t)) {
        if (errno != EAGAIN && errno != EWOULDBLOCK) snprintf(t->why, sizeof t->why, "TLS write: %s", strerror(errno));
        return -1;
    }
    size_t skip = 0;
    if (t->owed) { /* that byte was taken with the write before */
        t->owed = false;
        if (n == 1) return 1;
        skip = 1;
    }
    /* one byte cannot be split into a byte taken and one kept queued: it is
     * written as before gathering (a send per record, SSL's own retry) */
    if (n - skip < 2 || (!t->wbuf && !(t->wbuf = malloc(KV_TLS_WRITE_BUF)))) {
        size_t put = 0;
        ERR_clear_error();
        int r = SSL_write_ex(t->ssl, (const uint8_t *)buf + skip, n - skip, &put);
        return r == 1 ? (ssize_t)(put + skip) : skip ? (ssize_t)skip : kv_tls_io_fail(t, r, "write");
    }
    const size_t m = n - skip < KV_TLS_WRITE_PLAIN ? n - skip : KV_TLS_WRITE_PLAIN;
    size_t put = 0;
    ERR_clear_error();
    t->gather = true;
    int r = SSL_write_ex(t->ssl, (const uint8_t *)buf + skip, m, &put);
    t->gather = false;
    if (r != 1) { /* nothing taken: wbuf was empty and kept none of it */
        if (skip) {
            ERR_clear_error();
            return (ssize_t)skip;
        }
        return kv_tls_io_fail(t, r, "write");
    }
    put += skip;
    if (kv_tls_wflush(t)) {
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            snprintf(t->why, sizeof t->why, "TLS write: %s", strerror(errno));
            return -1;
        }
        t->owed = true; /* the rest waits in wbuf: keep one byte queued in the loop */
        put--;          /* >= 1: at least two bytes were taken (above) */
    }
    return (ssize_t)put;
}

static void kv_tls_io_close(void *ctx) { kv_tls_free(ctx); }
static int kv_tls_io_handshake(void *ctx, int fd) { return kv_tls_step(ctx, fd); }
static size_t kv_tls_io_pending(void *ctx) {
    kv_tls *t = ctx;
    int n = SSL_pending(t->ssl);
    if (n > 0) return (size_t)n;
    return t->more && SSL_has_pending(t->ssl) ? 1 : 0; /* buffered records not yet decrypted */
}
static const char *kv_tls_io_why(void *ctx) { return ((kv_tls *)ctx)->why; }

const kv_net_io_ops kv_tls_net_io = {
    .read = kv_tls_io_read,
    .write = kv_tls_io_write,
    .close = kv_tls_io_close,
    .handshake = kv_tls_io_handshake,
    .pending = kv_tls_io_pending,
    .why = kv_tls_io_why,
};

int kv_tls_peer_key(const kv_tls *t, uint8_t pk[32]) {
    X509 *c = t->established ? SSL_get0_peer_certificate(t->ssl) : NULL;
    if (!c) return KV_ENOTFOUND;
    return kv_tls_cert_ed25519(c, pk);
}

int kv_tls_peer_fingerprint(const kv_tls *t, char out[KV_TLS_FP_HEX + 1]) {
    X509 *c = t->established ? SSL_get0_peer_certificate(t->ssl) : NULL;
    if (!c) return KV_ENOTFOUND;
    return kv_tls_cert_fp(c, out) ? KV_ENOTFOUND : 0;
}

int kv_tls_exporter(const kv_tls *t, uint8_t out[KV_TLS_EXPORTER_LEN]) {
    if (!t->established) return KV_EPROTO;
    static const char label[] = KV_TLS_EXPORTER_LABEL;
    if (SSL_export_keying_material(t->ssl, out, KV_TLS_EXPORTER_LEN, label, sizeof label - 1,
                                   (const unsigned char *)"", 0, 1) != 1) {
        ERR_clear_error();
        return KV_EPROTO;
    }
    return 0;
}

/* ---- blocking use ------------------------------------------------------------------------------ */

/* Waits for readiness wants until deadline (kv_net_now_ms): 0 or KV_ETIMEOUT. */
static int kv_tls_wait(const kv_tls *t, unsigned wants, int64_t deadline) {
    for (;;) {
        int64_t left = deadline - kv_net_now_ms();
        if (left <= 0) return KV_ETIMEOUT;
        const short ev = (short)((wants & KV_NET_READ ? POLLIN : 0) | (wants & KV_NET_WRITE ? POLLOUT : 0));
        struct pollfd pf = {.fd = t->fd, .events = ev};
        int pr = poll(&pf, 1, left > 1 << 30 ? 1 << 30 : (int)left);
        if (pr > 0) return 0;
        if (pr < 0 && errno != EINTR) return 0; /* the next I/O call reports it */
    }
}

int kv_tls_handshake_fd(kv_tls *t, int fd, int timeout_ms, kv_diag *d) {
    if (timeout_ms <= 0) return kv_fail(d, KV_EINVAL, "TLS handshake: no timeout");
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK))
        return kv_fail(d, KV_EIO, "TLS handshake: fcntl: %s", strerror(errno));
    const int64_t deadline = kv_net_now_ms() + timeout_ms;
    for (;;) {
        int r = kv_tls_step(t, fd);
        if (r == 0) return 0;
        if (r < 0) return kv_fail(d, r, "%s", t->why);
        if (kv_tls_wait(t, (unsigned)r, deadline))
            return kv_fail(d, KV_ETIMEOUT, "TLS handshake not complete within %d ms", timeout_ms);
    }
}

int kv_tls_dial(kv_tls **out, int *fd, kv_tls_ctx *x, const kv_tls_opts *o, const char *host_port,
                int timeout_ms, kv_diag *d) {
    *out = NULL;
    *fd = -1;
    if (timeout_ms <= 0) timeout_ms = 5000;
    const int64_t t0 = kv_net_now_ms();
    kv_tls_opts co = *o;
    co.server = false;
    int s = -1;
    int rc = kv_link_connect(host_port, timeout_ms, &s, d);
    if (rc) return rc;
    kv_tls *t = NULL;
    rc = kv_tls_new(&t, x, &co, d);
    int left = timeout_ms - (int)(kv_net_now_ms() - t0);
    if (!rc) rc = kv_tls_handshake_fd(t, s, left > 0 ? left : 1, d);
    if (rc) {
        kv_diag_prefix(d, rc, "%s", host_port);
        kv_tls_free(t);
        close(s);
        return rc;
    }
    *out = t;
    *fd = s;
    return 0;
}

int kv_tls_write_full(kv_tls *t, const void *buf, size_t n, int timeout_ms, kv_diag *d) {
    if (!t->established) return kv_fail(d, KV_EPROTO, "TLS write: no session");
    const int64_t deadline = kv_net_now_ms() + (timeout_ms > 0 ? timeout_ms : 0);
    size_t off = 0;
    while (off < n) {
        size_t put = 0;
        ERR_clear_error();
        int r = SSL_write_ex(t->ssl, (const uint8_t *)buf + off, n - off, &put);
        if (r == 1) {
            off += put;
            continue;
        }
        const int e = SSL_get_error(t->ssl, r);
        if (kv_tls_io_fail(t, r, "write") < 0 && errno == EAGAIN) {
            if (kv_tls_wait(t, e == SSL_ERROR_WANT_READ ? KV_NET_READ : KV_NET_WRITE, deadline))
                return kv_fail(d, KV_ETIMEOUT, "TLS write: %zu of %zu bytes sent within %d ms", off, n, timeout_ms);
            continue;
        }
        return kv_fail(d, errno == EPROTO ? KV_EPROTO : KV_EIO, "%s", t->why[0] ? t->why : "TLS write: closed");
    }
    return 0;
}

int kv_tls_read_full(kv_tls *t, void *buf, size_t n, size_t *got, int timeout_ms, kv_diag *d) {
    if (got) *got = 0;
    if (!t->established) return kv_fail(d, KV_EPROTO, "TLS read: no session");
    const int64_t deadline = kv_net_now_ms() + (timeout_ms > 0 ? timeout_ms : 0);
    size_t off = 0;
    while (off < n) {
        size_t k = 0;
        ERR_clear_error();
        int r = SSL_read_ex(t->ssl, (uint8_t *)buf + off, n - off, &k);
        if (r == 1) {
            off += k;
            if (got) *got = off;
            continue;
        }
        const int e = SSL_get_error(t->ssl, r);
        ssize_t f = kv_tls_io_fail(t, r, "read");
        if (f < 0 && errno == EAGAIN) {
            if (kv_tls_wait(t, e == SSL_ERROR_WANT_WRITE ? KV_NET_WRITE : KV_NET_READ, deadline))
                return kv_fail(d, KV_ETIMEOUT, "TLS read: %zu of %zu bytes within %d ms", off, n, timeout_ms);
            continue;
        }
        if (f == 0) return kv_fail(d, KV_EIO, "TLS read: closed by the peer after %zu of %zu bytes", off, n);
        return kv_fail(d, errno == EPROTO ? KV_EPROTO : KV_EIO, "%s", t->why);
    }
    return 0;
}
