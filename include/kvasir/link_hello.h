/* Link: the first bytes of an accepted connection, classified, so that one
 * public port can carry both the hub's HTTPS API and its relay
 * (docs/HUB.md, "Relay on the API port").
 *
 * A relay client offers the ALPN protocol "kvasir-relay" in its TLS
 * ClientHello; anything else (a browser, curl, plain HTTP on loopback, a
 * truncated or malformed hello) is "other" and goes to the HTTP server. The
 * parser reads only the first TLS record: the record header, the handshake
 * header, the ClientHello's fixed fields, then walks the extensions for
 * application_layer_protocol_negotiation (0x0010, RFC 7301). Every length is
 * checked against what is left; nothing is allocated; any input, of any
 * length, gives one of the three verdicts and never reads past n bytes. */
#ifndef KVASIR_LINK_HELLO_H
#define KVASIR_LINK_HELLO_H

#include <stddef.h>
#include <stdint.h>

#define KV_LINK_RELAY_ALPN "kvasir-relay" /* ALPN a relay client offers */
#define KV_LINK_HELLO_MAX 4096u           /* bytes peeked at most: a hello longer is "other" */

typedef enum {
    KV_HELLO_MORE = 0,  /* a valid prefix of a ClientHello: peek again */
    KV_HELLO_RELAY = 1, /* a complete ClientHello offering `alpn` */
    KV_HELLO_OTHER = 2, /* anything else: hand the connection to HTTP */
} kv_hello_kind;

/* Classifies the first n bytes read from a connection. Returns KV_HELLO_MORE
 * only while the bytes are a consistent prefix of a first TLS record that fits
 * in KV_LINK_HELLO_MAX bytes; KV_HELLO_RELAY when that record holds a whole
 * ClientHello whose ALPN list names `alpn` exactly; KV_HELLO_OTHER otherwise
 * (not TLS, not a ClientHello, malformed, longer than one record or than the
 * cap, no ALPN, other protocols). Pure and thread-safe; p may be NULL when
 * n == 0. */
kv_hello_kind kv_link_hello_classify(const uint8_t *p, size_t n, const char *alpn);

#endif
