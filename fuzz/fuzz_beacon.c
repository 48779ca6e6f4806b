/* libFuzzer target for the LAN beacon parser (a node reads UDP datagrams
 * from anyone on the network: untrusted). Whatever parses must re-encode
 * to the same bytes (the format has one spelling), hold a 64-digit id and
 * a bounded URL of the allowed characters; a failure must leave a zeroed
 * result and a message. */
#include <stdint.h>
#include <string.h>

#include "kvasir/beacon.h"

#define CHECK(x)                    \
    do {                            \
        if (!(x)) __builtin_trap(); \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kv_beacon_msg m;
    kv_diag d = {0};
    int rc = kv_beacon_parse(data, size, &m, &d);
    if (!rc) {
        CHECK(strlen(m.model_id) == 64);
        const size_t ul = strlen(m.url);
        CHECK(ul >= 8 && ul <= KV_BEACON_MAX_URL);
        CHECK(strspn(m.url, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.:/[]_-#=") == ul);
        uint8_t buf[KV_BEACON_MAX_SIZE];
        size_t n = 0;
        CHECK(!kv_beacon_encode(&m, buf, sizeof buf, &n, &d));
        CHECK(n == size && !memcmp(buf, data, n));
    } else {
        CHECK(rc < 0 && d.msg[0] && !m.url[0] && !m.model_id[0]);
    }
    return 0;
}
