/* The ClientHello classifier of include/kvasir/link_hello.h: a bounded reader
 * over the first TLS record (RFC 8446 section 5.1 and 4.1.2, ALPN per RFC
 * 7301). Each length is checked against what is left before it is used; the
 * only outcome of bad input is KV_HELLO_OTHER. */
#include "kvasir/link_hello.h"

#include <string.h>

typedef struct {
    const uint8_t *p; /* next unread byte */
    size_t left;      /* bytes after p */
} rd;

static int take(rd *r, size_t n, const uint8_t **out) {
    if (n > r->left) return -1;
    *out = r->p;
    r->p += n;
    r->left -= n;
    return 0;
}

static int u8(rd *r, size_t *v) {
    const uint8_t *b;
    if (take(r, 1, &b)) return -1;
    *v = b[0];
    return 0;
}

static int u16(rd *r, size_t *v) {
    const uint8_t *b;
    if (take(r, 2, &b)) return -1;
    *v = (size_t)b[0] << 8 | b[1];
    return 0;
}

/* A sub-reader over the next n bytes of r (a length-prefixed vector). */
static int sub(rd *r, size_t n, rd *out) {
    const uint8_t *b;
    if (take(r, n, &b)) return -1;
    out->p = b;
    out->left = n;
    return 0;
}

/* ALPN extension body: ProtocolNameList, each name 1..255 bytes. */
static kv_hello_kind alpn_list(rd e, const char *alpn) {
    size_t len, want = strlen(alpn);
    rd l;
    if (u16(&e, &len) || len < 2 || sub(&e, len, &l) || e.left) return KV_HELLO_OTHER;
    int found = 0;
    while (l.left) {
        size_t nl;
        const uint8_t *name;
        if (u8(&l, &nl) || nl == 0 || take(&l, nl, &name)) return KV_HELLO_OTHER;
        if (nl == want && !memcmp(name, alpn, want)) found = 1;
    }
    return found ? KV_HELLO_RELAY : KV_HELLO_OTHER;
}

kv_hello_kind kv_link_hello_classify(const uint8_t *p, size_t n, const char *alpn) {
    if (!alpn || !alpn[0] || strlen(alpn) > 255) return KV_HELLO_OTHER;
    /* record header: handshake (22), legacy_record_version 0x0301..0x0304, length */
    static const uint8_t lead[2] = {0x16, 0x03};
    for (size_t i = 0; i < n && i < 2; i++)
        if (p[i] != lead[i]) return KV_HELLO_OTHER;
    if (n >= 3 && (p[2] < 0x01 || p[2] > 0x04)) return KV_HELLO_OTHER;
    if (n < 5) return KV_HELLO_MORE;
    size_t reclen = (size_t)p[3] << 8 | p[4];
    if (reclen < 4 || reclen > 16384 || 5 + reclen > KV_LINK_HELLO_MAX) return KV_HELLO_OTHER;
    if (n >= 6 && p[5] != 0x01) return KV_HELLO_OTHER; /* not client_hello */
    if (n < 5 + reclen) return KV_HELLO_MORE;

    rd r = {p + 5, reclen}, h, v;
    size_t hlen, x;
    const uint8_t *skip;
    if (u8(&r, &x) || x != 0x01) return KV_HELLO_OTHER;
    if (take(&r, 3, &skip)) return KV_HELLO_OTHER;
    hlen = (size_t)skip[0] << 16 | (size_t)skip[1] << 8 | skip[2];
    /* the whole hello must sit in this record: our relay client's always does */
    if (sub(&r, hlen, &h)) return KV_HELLO_OTHER;
    if (take(&h, 2 + 32, &skip)) return KV_HELLO_OTHER;                     /* version, random */
    if (u8(&h, &x) || x > 32 || take(&h, x, &skip)) return KV_HELLO_OTHER; /* session id */
    if (u16(&h, &x) || x < 2 || x % 2 || take(&h, x, &skip)) return KV_HELLO_OTHER; /* suites */
    if (u8(&h, &x) || x < 1 || take(&h, x, &skip)) return KV_HELLO_OTHER; /* compression */
    if (u16(&h, &x) || sub(&h, x, &v) || h.left) return KV_HELLO_OTHER;  /* extensions */
    while (v.left) {
        size_t type, elen;
        rd e;
        if (u16(&v, &type) || u16(&v, &elen) || sub(&v, elen, &e)) return KV_HELLO_OTHER;
        if (type == 0x0010) return alpn_list(e, alpn);
    }
    return KV_HELLO_OTHER;
}
