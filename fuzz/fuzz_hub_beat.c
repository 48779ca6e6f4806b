/* libFuzzer target for the heartbeat body parser (the hub reads what any
 * signed node sends: untrusted). Parses an exact-size copy; what parses
 * must be within the promised bounds, and a failure must leave a zeroed
 * result and a message. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/hub.h"
#include "fuzz_support.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *buf = fuzz_copy(data, size);
    kv_diag d = {0};
    kv_hub_beat b;
    int rc = kv_hub_parse_beat(&b, buf, size, &d);
    if (!rc) {
        CHECK(b.served_pairs <= ((uint64_t)1 << 53) && b.served_tokens <= ((uint64_t)1 << 53));
        CHECK(b.has || (!b.served_pairs && !b.served_tokens));
    } else {
        CHECK(rc < 0 && d.msg[0] && !b.has && !b.served_pairs && !b.served_tokens);
    }
    free(buf);
    return 0;
}
