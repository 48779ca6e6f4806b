/* libFuzzer target for the placement parser (a coordinator reads GET
 * /v1/placement from a hub: untrusted). Whatever parses must hold only
 * distinct, bounded addresses of the allowed characters, at most
 * KV_PLACEMENT_MAX_REPLICAS holders per shard; a failure must leave an
 * empty result and a message. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/node.h"
#include "fuzz_support.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *buf = fuzz_copy(data, size);
    kv_diag d = {0};
    char **w = NULL;
    uint32_t n = 0;
    int rc = kv_node_parse_placement(buf, size, &w, &n, &d);
    if (!rc) {
        for (uint32_t i = 0; i < n; i++) {
            size_t l = strlen(w[i]);
            CHECK(l >= 1 && l <= KV_HUB_MAX_ADDR);
            CHECK(strspn(w[i], "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-:[]") == l);
            for (uint32_t j = 0; j < i; j++) CHECK(strcmp(w[i], w[j]));
        }
        kv_node_workers_free(w, n);
    } else {
        CHECK(rc < 0 && d.msg[0] && !w && !n);
    }
    /* the full reading: at most KV_PLACEMENT_MAX_REPLICAS holders kept per
       shard, each kept entry naming a kept address, in map order */
    kv_placement pl;
    d = (kv_diag){0};
    rc = kv_node_placement_parse(buf, size, &pl, &d);
    if (!rc) {
        uint32_t run = 0;
        for (size_t e = 0; e < pl.n_entry; e++) {
            CHECK(pl.entry[e].addr < pl.n_addr);
            if (e && pl.entry[e].shard == pl.entry[e - 1].shard) {
                CHECK(pl.entry[e].node > pl.entry[e - 1].node);
                run++;
            } else {
                CHECK(!e || pl.entry[e].shard > pl.entry[e - 1].shard);
                run = 1;
            }
            CHECK(run <= KV_PLACEMENT_MAX_REPLICAS);
        }
        CHECK(pl.n_addr == n); /* the same addresses as above */
    } else {
        CHECK(rc < 0 && d.msg[0] && !pl.addr && !pl.n_addr && !pl.entry);
    }
    kv_node_placement_free(&pl);
    free(buf);
    return 0;
}
