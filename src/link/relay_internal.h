/* What the relay server (relay.c) and its clients (relay_client.c) share:
 * queueing a frame on a connection of the event loop. */
#ifndef KVASIR_RELAY_INTERNAL_H
#define KVASIR_RELAY_INTERNAL_H

#include <stdio.h>
#include <string.h>

#include "kvasir/net.h"
#include "kvasir/relay.h"

/* Queues a frame: the header and payload p[0, n). KV_ENOMEM when the
 * connection's queue refuses it (the connection then closes). */
static inline int kv_relay_send(kv_net_conn *c, uint8_t type, uint32_t stream, const void *p, uint32_t n) {
    uint8_t *o = kv_net_conn_reserve(c, KV_RELAY_HEADER + (size_t)n);
    if (!o) return KV_ENOMEM;
    kv_relay_header_put(o, type, stream, n);
    if (n) memcpy(o + KV_RELAY_HEADER, p, n);
    kv_net_conn_commit(c, KV_RELAY_HEADER + (size_t)n);
    return 0;
}

static inline int kv_relay_send_credit(kv_net_conn *c, uint32_t stream, uint32_t credit) {
    const uint8_t b[4] = {(uint8_t)credit, (uint8_t)(credit >> 8), (uint8_t)(credit >> 16), (uint8_t)(credit >> 24)};
    return kv_relay_send(c, KV_RELAY_CREDIT, stream, b, 4);
}

/* CLOSE (stream > 0) or ERROR (stream 0) with code and a message cut to
 * KV_RELAY_MAX_MSG. */
static inline int kv_relay_send_close(kv_net_conn *c, uint8_t type, uint32_t stream, int code, const char *msg) {
    uint8_t b[4 + KV_RELAY_MAX_MSG];
    const uint32_t v = (uint32_t)(int32_t)code;
    b[0] = (uint8_t)v, b[1] = (uint8_t)(v >> 8), b[2] = (uint8_t)(v >> 16), b[3] = (uint8_t)(v >> 24);
    size_t m = msg ? strlen(msg) : 0;
    if (m > KV_RELAY_MAX_MSG) m = KV_RELAY_MAX_MSG;
    if (m) memcpy(b + 4, msg, m);
    return kv_relay_send(c, type, stream, b, (uint32_t)(4 + m));
}

/* The frame length callback shared by both ends. */
static inline int kv_relay_frame_len(kv_net_conn *c, const uint8_t *hdr, size_t *total, kv_diag *d) {
    (void)c;
    return kv_relay_header_parse(hdr, total, d);
}

#endif
