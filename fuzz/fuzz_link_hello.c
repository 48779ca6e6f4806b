/* libFuzzer target for the ClientHello classifier (include/kvasir/link_hello.h):
 * the first bytes of any connection to the hub's public port are untrusted.
 * Any input gives one of the three verdicts, a verdict on n bytes does not
 * change when more bytes follow unless it was MORE, and RELAY needs a TLS
 * handshake record. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/link_hello.h"

#define CHECK(x)                    \
    do {                            \
        if (!(x)) __builtin_trap(); \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 2 * KV_LINK_HELLO_MAX) return 0;
    uint8_t *c = malloc(size ? size : 1);
    if (!c) return 0;
    memcpy(c, data, size);
    kv_hello_kind k = kv_link_hello_classify(c, size, KV_LINK_RELAY_ALPN);
    CHECK(k == KV_HELLO_MORE || k == KV_HELLO_RELAY || k == KV_HELLO_OTHER);
    if (k == KV_HELLO_RELAY) CHECK(size >= 5 && c[0] == 0x16);
    for (size_t cut = 0; cut < size && cut < 64; cut++) {
        kv_hello_kind p = kv_link_hello_classify(c, cut, KV_LINK_RELAY_ALPN);
        CHECK(p == KV_HELLO_MORE || p == k);
    }
    free(c);
    return 0;
}
