/* libFuzzer target for the relay's frame codec (include/kvasir/relay.h):
 * arbitrary bytes are cut into frames as the event loop cuts them (header
 * first, then the length it announces) and each frame is decoded. Every
 * outcome must be a frame whose fields lie inside the bytes given and
 * whose header re-encodes to the same bytes, or KV_EPROTO with a message;
 * never a read past the input. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/relay.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    size_t off = 0;
    while (size - off >= KV_RELAY_HEADER) {
        const uint8_t *p = data + off;
        size_t total = 0;
        kv_diag d = {0};
        if (kv_relay_header_parse(p, &total, &d)) {
            if (d.code != KV_EPROTO || !d.msg[0]) abort();
            return 0;
        }
        if (total < KV_RELAY_HEADER || total > KV_RELAY_HEADER + KV_RELAY_MAX_PAYLOAD) abort();
        if (total > size - off) return 0; /* the rest has not arrived */
        kv_relay_frame f;
        int rc = kv_relay_frame_decode(p, total, &f, &d);
        if (rc) {
            if (rc != KV_EPROTO || !d.msg[0]) abort();
        } else {
            uint8_t h[KV_RELAY_HEADER];
            kv_relay_header_put(h, f.type, f.stream, f.len);
            if (memcmp(h, p, KV_RELAY_HEADER) || KV_RELAY_HEADER + (size_t)f.len != total) abort();
            if (f.payload != p + KV_RELAY_HEADER) abort();
            if (f.msg && (f.msg < (const char *)f.payload || f.msg + f.msg_len > (const char *)p + total ||
                          f.msg_len > KV_RELAY_MAX_MSG))
                abort();
            if (f.key && (f.key < f.payload || f.key + 32 > p + total)) abort();
            if (f.sig && (f.sig < f.payload || f.sig + 64 > p + total)) abort();
            if (f.type == KV_RELAY_CREDIT && (f.credit == 0 || f.credit > KV_RELAY_MAX_WINDOW)) abort();
            volatile uint8_t sink = 0; /* touch every payload byte (ASan checks the bounds) */
            for (uint32_t i = 0; i < f.len; i++) sink ^= f.payload[i];
            (void)sink;
        }
        off += total;
    }
    return 0;
}
