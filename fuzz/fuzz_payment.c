/* libFuzzer target for the payment authorization parsers: the X-KVR-Payment
 * header text (kv_auth_decode) and its canonical bytes (kv_auth_from_bytes),
 * each over an exact-size copy (a read past the end is an ASan error). On
 * success the result must be in bounds and re-encode to the very input (one
 * encoding per authorization); on failure a negative code and a one-line
 * message. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/ledger.h"

#define CHECK(x)                    \
    do {                            \
        if (!(x)) __builtin_trap(); \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *s = malloc(size ? size : 1);
    if (!s) return 0;
    memcpy(s, data, size);
    kv_auth a;
    kv_diag d = {0};
    int rc = kv_auth_decode(&a, s, size, &d);
    if (rc == 0) {
        char out[KV_AUTH_HEADER_MAX];
        CHECK(a.max >= 1 && a.max <= KV_LEDGER_MAX_AMOUNT && a.gateway[0]);
        CHECK(kv_auth_encode(&a, out, sizeof out, NULL) == 0);
        CHECK(strlen(out) == size && !memcmp(out, s, size));
    } else {
        CHECK(rc < 0 && d.msg[0] && !strchr(d.msg, '\n'));
    }
    free(s);
    uint8_t *b = malloc(size ? size : 1);
    if (!b) return 0;
    memcpy(b, data, size);
    memset(&d, 0, sizeof d);
    rc = kv_auth_from_bytes(&a, b, size, &d);
    if (rc == 0) {
        uint8_t out[KV_AUTH_SIZE];
        CHECK(size == KV_AUTH_SIZE && kv_auth_to_bytes(&a, out, NULL) == 0 && !memcmp(out, b, size));
    } else {
        CHECK(rc < 0 && d.msg[0] && !strchr(d.msg, '\n'));
    }
    free(b);
    return 0;
}
