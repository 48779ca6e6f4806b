/* libFuzzer target for the wallet key file parser (kv_wallet_parse), over an
 * exact-size copy. A parsed key must re-encode (kv_wallet_save's format) to
 * the input, with or without its trailing newline, and its public key must
 * be the one its seed derives; failures give a negative code and one line.
 * The same for the node key format (kv_wallet_parse_node_key). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/ledger.h"
#include "kvasir/link.h"

#define CHECK(x)                    \
    do {                            \
        if (!(x)) __builtin_trap(); \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *b = malloc(size ? size : 1);
    if (!b) return 0;
    memcpy(b, data, size);
    kv_wallet w;
    kv_diag d = {0};
    int rc = kv_wallet_parse(&w, b, size, &d);
    if (rc == 0) {
        char hex[65], line[128];
        kv_hex(w.sk, 32, hex);
        int n = snprintf(line, sizeof line, "kvasir-ed25519-v1 %s\n", hex);
        CHECK((size == (size_t)n || size == (size_t)n - 1) && !memcmp(w.sk + 32, w.pk, 32));
        for (size_t i = 0; i < size; i++) {
            char c = (char)b[i];
            if (c >= 'A' && c <= 'F') c = (char)(c - 'A' + 'a');
            CHECK(c == line[i]);
        }
    } else {
        CHECK(rc < 0 && d.msg[0] && !strchr(d.msg, '\n'));
    }
    memset(&d, 0, sizeof d);
    rc = kv_wallet_parse_node_key(&w, b, size, &d);
    if (rc == 0) {
        char hex[65];
        kv_hex(w.sk, 32, hex);
        CHECK(size == 65 && !memcmp(b, hex, 64) && b[64] == '\n' && !memcmp(w.sk + 32, w.pk, 32));
    } else {
        CHECK(rc < 0 && d.msg[0] && !strchr(d.msg, '\n'));
    }
    free(b);
    return 0;
}
