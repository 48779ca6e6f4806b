/* libFuzzer target for the market JSON parser (`kvasir market` reads what a
 * hub sends: untrusted). Parses an exact-size copy; whatever parses must be
 * within the promised bounds (last >= first, bounded counts), and a failure
 * must leave an empty result and a message. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/hub.h"
#include "fuzz_support.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *buf = fuzz_copy(data, size);
    kv_diag d = {0};
    kv_hub_market m;
    int rc = kv_hub_parse_market(&m, buf, size, &d);
    if (!rc) {
        CHECK(m.n_shards <= (1u << 20));
        for (size_t i = 0; i < m.n_shards; i++) CHECK(m.shards[i].first <= m.shards[i].last);
        kv_hub_market_free(&m);
    } else {
        CHECK(rc < 0 && d.msg[0] && !m.shards && !m.n_shards);
    }
    free(buf);
    return 0;
}
