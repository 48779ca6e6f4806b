/* HTTPS for the hub's and the gateway's HTTP APIs (docs/HUB.md "HTTPS").
 *
 * Certificates need no authority. A server's certificate is known by its
 * fingerprint (the link layer's, include/kvasir/tls.h, one for every TLS
 * peer): SHA-256 over the DER encoding of the certificate's
 * SubjectPublicKeyInfo, written as 64 lowercase hex digits (what
 * `openssl x509 -pubkey | openssl pkey -pubin -outform der | sha256sum`
 * prints, and what libcurl's "sha256//" pin is, in base64). Since it covers
 * the key only, a certificate renewed on the same key keeps its fingerprint.
 *
 * A client pins a server by its URL: `https://HOST:PORT#sha256=<64 hex>`.
 * A fragment is never sent on the wire, so the pin travels with the hub URL
 * through every place that builds request URLs by appending a path to it
 * ("https://h:p#sha256=FP" + "/v1/manifest"); kv_https_url_split, called
 * by the HTTP client right before a request, takes the pin back out.
 *
 * Plain HTTP is served only on a loopback address (127.0.0.0/8, ::1,
 * ::ffff:127.0.0.0/104), or when the operator says --insecure-plaintext.
 * A wildcard address (0.0.0.0, ::) listens on every interface and is not
 * loopback. */
#ifndef KVASIR_HTTPS_H
#define KVASIR_HTTPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "kvasir/err.h"
#include "kvasir/tls.h"

#define KV_HTTPS_FP_HEX KV_TLS_FP_HEX   /* hex digits of a fingerprint */
#define KV_HTTPS_MAX_PEM KV_TLS_MAX_PEM /* bytes of a certificate or key file */
#define KV_HTTPS_PIN_CAP 64u         /* "sha256//" + 44 base64 + NUL fits */

/* A server's certificate and key, PEM in memory (libmicrohttpd reads them
 * from memory and keeps the pointers while it runs). */
typedef struct kv_https_cert {
    char *cert_pem; /* NUL-terminated PEM certificate (malloc'd) */
    char *key_pem;  /* NUL-terminated PEM private key (malloc'd) */
    char fp[KV_HTTPS_FP_HEX + 1]; /* the certificate's fingerprint, lowercase hex */
} kv_https_cert;

/* Reads a PEM certificate and its PEM private key from files (each at most
 * KV_HTTPS_MAX_PEM bytes), checks that the key is the certificate's, and
 * computes the fingerprint. On error *c is left empty and d names the file
 * and what is wrong. Free with kv_https_cert_clear. */
int kv_https_cert_load(kv_https_cert *c, const char *cert_path, const char *key_path, kv_diag *d);

/* A self-signed certificate on an ECDSA P-256 key derived from seed (32
 * secret bytes; the same seed gives the same key, hence the same
 * fingerprint, at every start), common name cn, valid from a day ago for
 * ten years. Free with kv_https_cert_clear. */
int kv_https_cert_derive(kv_https_cert *c, const uint8_t seed[32], const char *cn, kv_diag *d);

/* Frees what a kv_https_cert holds (the key bytes are wiped) and empties
 * it; accepts an empty or NULL one. */
void kv_https_cert_clear(kv_https_cert *c);

/* The fingerprint of a PEM certificate (see the header comment) into
 * hex[65]. KV_EFORMAT when pem holds no certificate. */
int kv_https_fingerprint(const char *cert_pem, char hex[KV_HTTPS_FP_HEX + 1], kv_diag *d);

/* True for a loopback address; false for any other, wildcards included. */
bool kv_https_addr_is_loopback(const struct sockaddr *sa);

/* Splits a URL that may carry a pin, "BASE#sha256=HEX" followed by
 * nothing or by a path that starts with '/', into out = BASE + path
 * (without the fragment) and pin = "sha256//<base64 of the 32 bytes>", or
 * pin = "" when the URL has no '#'. The hex may be of either case. Errors
 * (KV_EINVAL, naming the URL): a fragment other than sha256= and 64 hex
 * digits, a pin on a URL that is not https://, out too small. */
int kv_https_url_split(const char *url, char *out, size_t cap, char pin[KV_HTTPS_PIN_CAP], kv_diag *d);

/* Checks a server's choice before it listens: TLS when tls, else plain
 * HTTP, allowed only on loopback or with insecure (KV_EINVAL naming who,
 * the address and the flags that would allow it). */
int kv_https_listen_check(const struct sockaddr *sa, bool tls, bool insecure, const char *who, kv_diag *d);
/* The same for a numeric host (IPv4 or IPv6, without brackets), so that a
 * command can refuse before it loads anything; 0 for a host that is not
 * numeric (the server's own parse of it decides). */
int kv_https_listen_check_host(const char *host, bool tls, bool insecure, const char *who, kv_diag *d);

#endif
