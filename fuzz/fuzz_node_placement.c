/* libFuzzer target for the placement parser (a coordinator reads GET
 * /v1/placement from a hub: untrusted). Whatever parses must hold only
 * distinct, bounded addresses of the allowed characters; a failure must
 * leave an empty result and a message. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/dispatch.h"
#include "kvasir/node.h"

#define CHECK(x)                    \
    do {                            \
        if (!(x)) __builtin_trap(); \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *buf = malloc(size ? size : 1);
    CHECK(buf);
    memcpy(buf, data, size);
    kv_diag d = {0};
    char **w = NULL;
    uint32_t n = 0;
    int rc = kv_node_parse_placement(buf, size, &w, &n, &d);
    if (!rc) {
        CHECK(n <= KV_REMOTE_MAX_WORKERS);
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
    free(buf);
    return 0;
}
