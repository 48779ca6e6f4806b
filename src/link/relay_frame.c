/* The relay's frame codec (include/kvasir/relay.h, docs/PROTOCOL.md
 * "Relay"): a 12-byte header and a payload whose layout is exact for every
 * type. Pure functions; everything read is bounded by the header's length,
 * itself bounded by KV_RELAY_MAX_PAYLOAD before any byte of the payload is
 * buffered. fuzz/fuzz_relay.c drives the decoder. */
#include <string.h>

#include "kvasir/relay.h"
#include "kvasir/slice.h" /* kv_sha256 */

#define KV_RELAY_NODE_DOMAIN "kvasir-relay-node-v1\n"

static uint32_t kv_rd32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void kv_wr32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8), p[2] = (uint8_t)(v >> 16), p[3] = (uint8_t)(v >> 24);
}

void kv_relay_header_put(uint8_t *out, uint8_t type, uint32_t stream, uint32_t len) {
    out[0] = type;
    out[1] = out[2] = out[3] = 0;
    kv_wr32(out + 4, stream);
    kv_wr32(out + 8, len);
}

int kv_relay_header_parse(const uint8_t *hdr, size_t *total, kv_diag *d) {
    const uint8_t type = hdr[0];
    if (type == 0 || type >= KV_RELAY_TYPE_COUNT) return kv_fail(d, KV_EPROTO, "relay frame: unknown type %u", type);
    if (hdr[1] | hdr[2] | hdr[3])
        return kv_fail(d, KV_EPROTO, "relay frame: reserved header bytes are not zero (type %u)", type);
    const uint32_t len = kv_rd32(hdr + 8);
    if (len > KV_RELAY_MAX_PAYLOAD)
        return kv_fail(d, KV_EPROTO, "relay frame: length %u over the %u bytes a payload may have", len,
                       KV_RELAY_MAX_PAYLOAD);
    *total = KV_RELAY_HEADER + len;
    return 0;
}

/* CLOSE and ERROR: i32 code, then a message of at most KV_RELAY_MAX_MSG. */
static int kv_relay_decode_close(kv_relay_frame *f, kv_diag *d) {
    if (f->len < 4 || f->len - 4 > KV_RELAY_MAX_MSG)
        return kv_fail(d, KV_EPROTO, "relay %s: %u bytes (4 + a message of at most %u)",
                       f->type == KV_RELAY_CLOSE ? "CLOSE" : "ERROR", f->len, KV_RELAY_MAX_MSG);
    f->code = (int32_t)kv_rd32(f->payload);
    if (f->code > 0 || f->code <= -1000)
        return kv_fail(d, KV_EPROTO, "relay %s: code %d is not an error code",
                       f->type == KV_RELAY_CLOSE ? "CLOSE" : "ERROR", (int)f->code);
    f->msg = (const char *)f->payload + 4;
    f->msg_len = f->len - 4;
    return 0;
}

int kv_relay_frame_decode(const uint8_t *buf, size_t n, kv_relay_frame *f, kv_diag *d) {
    memset(f, 0, sizeof *f);
    size_t total = 0;
    if (n < KV_RELAY_HEADER) return kv_fail(d, KV_EPROTO, "relay frame: %zu bytes, shorter than a header", n);
    int rc = kv_relay_header_parse(buf, &total, d);
    if (rc) return rc;
    if (total != n) return kv_fail(d, KV_EPROTO, "relay frame: %zu bytes, the header says %zu", n, total);
    f->type = buf[0];
    f->stream = kv_rd32(buf + 4);
    f->len = kv_rd32(buf + 8);
    f->payload = buf + KV_RELAY_HEADER;
    const bool conn_level = f->type == KV_RELAY_HELLO || f->type == KV_RELAY_WELCOME || f->type == KV_RELAY_ERROR;
    if (conn_level && f->stream != 0)
        return kv_fail(d, KV_EPROTO, "relay frame type %u on stream %u (it belongs to stream 0)", f->type, f->stream);
    if (!conn_level && f->stream == 0)
        return kv_fail(d, KV_EPROTO, "relay frame type %u on stream 0 (it needs a stream)", f->type);
    const uint8_t *p = f->payload;
    switch (f->type) {
    case KV_RELAY_HELLO:
        if (f->len != KV_RELAY_HELLO_SIZE && f->len != KV_RELAY_HELLO_NODE_SIZE)
            return kv_fail(d, KV_EPROTO, "relay HELLO: %u bytes (%u or %u)", f->len, KV_RELAY_HELLO_SIZE,
                           KV_RELAY_HELLO_NODE_SIZE);
        if (kv_rd32(p) != KV_RELAY_MAGIC) return kv_fail(d, KV_EPROTO, "relay HELLO: bad magic (not a relay client)");
        f->version = (uint16_t)(p[4] | p[5] << 8);
        f->role = p[6];
        if (p[7]) return kv_fail(d, KV_EPROTO, "relay HELLO: reserved byte not zero");
        if (f->role == KV_RELAY_ROLE_NODE && f->len == KV_RELAY_HELLO_NODE_SIZE) {
            f->key = p + 8;
            f->sig = p + 40;
        } else if (!(f->role == KV_RELAY_ROLE_COORD && f->len == KV_RELAY_HELLO_SIZE)) {
            return kv_fail(d, KV_EPROTO, "relay HELLO: role %u with %u bytes (a node sends %u, a coordinator %u)",
                           f->role, f->len, KV_RELAY_HELLO_NODE_SIZE, KV_RELAY_HELLO_SIZE);
        }
        return 0;
    case KV_RELAY_WELCOME:
        if (f->len != KV_RELAY_WELCOME_SIZE) return kv_fail(d, KV_EPROTO, "relay WELCOME: %u bytes", f->len);
        f->version = (uint16_t)(p[0] | p[1] << 8);
        if (p[2] | p[3]) return kv_fail(d, KV_EPROTO, "relay WELCOME: reserved bytes not zero");
        f->window = kv_rd32(p + 4);
        f->max_payload = kv_rd32(p + 8);
        if (f->window < KV_RELAY_MIN_WINDOW || f->window > KV_RELAY_MAX_WINDOW || f->max_payload == 0 ||
            f->max_payload > KV_RELAY_MAX_PAYLOAD)
            return kv_fail(d, KV_EPROTO, "relay WELCOME: window %u / max payload %u out of range", f->window,
                           f->max_payload);
        return 0;
    case KV_RELAY_OPEN:
        if (f->len != 0 && f->len != 32) return kv_fail(d, KV_EPROTO, "relay OPEN: %u bytes (0 or 32)", f->len);
        if (f->len) f->key = p;
        return 0;
    case KV_RELAY_ACCEPT:
        return f->len ? kv_fail(d, KV_EPROTO, "relay ACCEPT: %u bytes (0)", f->len) : 0;
    case KV_RELAY_DATA:
        return f->len ? 0 : kv_fail(d, KV_EPROTO, "relay DATA on stream %u is empty", f->stream);
    case KV_RELAY_CREDIT:
        if (f->len != 4) return kv_fail(d, KV_EPROTO, "relay CREDIT: %u bytes (4)", f->len);
        f->credit = kv_rd32(p);
        if (f->credit == 0 || f->credit > KV_RELAY_MAX_WINDOW)
            return kv_fail(d, KV_EPROTO, "relay CREDIT of %u bytes on stream %u", f->credit, f->stream);
        return 0;
    case KV_RELAY_CLOSE:
    case KV_RELAY_ERROR:
        return kv_relay_decode_close(f, d);
    default:
        return kv_fail(d, KV_EPROTO, "relay frame: unknown type %u", f->type);
    }
}

void kv_relay_node_digest(const uint8_t exporter[KV_TLS_EXPORTER_LEN], const uint8_t key[32], uint8_t out[32]) {
    kv_sha256 s;
    kv_sha256_init(&s);
    kv_sha256_update(&s, KV_RELAY_NODE_DOMAIN, sizeof KV_RELAY_NODE_DOMAIN - 1);
    kv_sha256_update(&s, exporter, KV_TLS_EXPORTER_LEN);
    kv_sha256_update(&s, key, 32);
    kv_sha256_final(&s, out);
}
