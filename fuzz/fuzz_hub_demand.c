/* libFuzzer target for the demand report parser (the hub reads what any
 * vouched coordinator sends: untrusted). Parses an exact-size copy; what
 * parses must be within the promised bounds (counts, shard count, no shard
 * twice, last >= first) and serialize back to a report that parses to the
 * same values; a failure must leave a zeroed result and a message. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/hub.h"
#include "fuzz_support.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *buf = fuzz_copy(data, size);
    kv_diag d = {0};
    kv_hub_demand r;
    int rc = kv_hub_parse_demand(&r, buf, size, &d);
    if (!rc) {
        CHECK(r.tokens <= KV_HUB_DEMAND_MAX && r.n_shards <= KV_HUB_MAX_DEMAND_SHARDS);
        for (size_t i = 0; i < r.n_shards; i++) {
            const kv_hub_demand_shard *s = &r.shards[i];
            CHECK(s->last >= s->first && s->computations <= KV_HUB_DEMAND_MAX && s->wait_us <= KV_HUB_DEMAND_MAX);
            for (size_t j = 0; j < i && j < 64; j++)
                CHECK(r.shards[j].layer != s->layer || r.shards[j].first != s->first);
        }
        char *js = kv_hub_demand_json(&r);
        if (js) {
            kv_hub_demand again;
            CHECK(kv_hub_parse_demand(&again, js, strlen(js), &d) == 0);
            CHECK(again.tokens == r.tokens && again.n_shards == r.n_shards);
            for (size_t i = 0; i < r.n_shards; i++) {
                const kv_hub_demand_shard *a = &again.shards[i], *b = &r.shards[i];
                CHECK(a->layer == b->layer && a->first == b->first && a->last == b->last &&
                      a->computations == b->computations && a->wait_us == b->wait_us);
            }
            kv_hub_demand_free(&again);
            free(js);
        }
        kv_hub_demand_free(&r);
    } else {
        CHECK(rc < 0 && d.msg[0] && !r.shards && !r.n_shards && !r.tokens);
    }
    free(buf);
    return 0;
}
