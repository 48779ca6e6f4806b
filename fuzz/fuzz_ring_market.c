/* libFuzzer target for the ring's parser of the hub's layer market
 * (kv_ring_parse_market, GET /v1/ring), the untrusted answer a ring node
 * chooses its window and its next node from. Whatever parses must satisfy
 * the promised bounds: windows inside the layers, counts bounded, node
 * addresses of the allowed characters and NUL-terminated; and the choice
 * over it must be a window that fits or none. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/ring.h"

#define CHECK(x)                    \
    do {                            \
        if (!(x)) __builtin_trap(); \
    } while (0)

static kv_ring_window w[KV_RING_MAX_LAYERS];

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    size_t n = 7;
    uint32_t nl = 7;
    kv_diag d = {0};
    int rc = kv_ring_parse_market((const char *)data, size, w, KV_RING_MAX_LAYERS, &n, &nl, &d);
    if (rc) {
        CHECK(rc == KV_EFORMAT || rc == KV_ERANGE);
        CHECK(n == 0 && d.msg[0]);
        return 0;
    }
    CHECK(nl >= 1 && nl <= KV_RING_MAX_LAYERS && n <= nl);
    for (size_t i = 0; i < n; i++) {
        CHECK(w[i].first <= w[i].last && w[i].last < nl && w[i].wanted >= 1);
        const size_t al = strnlen(w[i].addr, sizeof w[i].addr);
        CHECK(al < sizeof w[i].addr);
        for (size_t k = 0; k < al; k++) CHECK(strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-:[]", w[i].addr[k]));
    }
    const uint64_t budget = size ? (uint64_t)data[0] << 20 : 0;
    const int k = kv_ring_choose(w, n, budget);
    CHECK(k < (int)n);
    if (k >= 0) CHECK(w[k].bytes <= budget);
    return 0;
}
