/* libFuzzer target for the work receipt and issuance parsers
 * (kv_receipt_from_bytes, kv_issue_from_bytes), over exact-size copies. A
 * parsed receipt must be in bounds, signature-verified, and re-encode to the
 * input; a parsed issuance (its signature is checked by the ledger against
 * the operator key, not here) must re-encode to the input. Failures return a
 * negative code and a one-line message. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/ledger.h"

#define CHECK(x)                    \
    do {                            \
        if (!(x)) __builtin_trap(); \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *b = malloc(size ? size : 1);
    if (!b) return 0;
    memcpy(b, data, size);
    kv_receipt r;
    kv_diag d = {0};
    int rc = kv_receipt_from_bytes(&r, b, size, &d);
    if (rc == 0) {
        uint8_t out[KV_RECEIPT_SIZE];
        CHECK(r.n_products >= 1 && r.n_products <= KV_LEDGER_MAX_PRODUCTS && r.gateway[0]);
        CHECK(size == KV_RECEIPT_SIZE && kv_receipt_to_bytes(&r, out, NULL) == 0 && !memcmp(out, b, size));
    } else {
        CHECK(rc < 0 && d.msg[0] && !strchr(d.msg, '\n'));
    }
    kv_issue is;
    memset(&d, 0, sizeof d);
    rc = kv_issue_from_bytes(&is, b, size, &d);
    if (rc == 0) {
        uint8_t out[KV_ISSUE_SIZE];
        CHECK(is.amount >= 1 && is.amount <= KV_LEDGER_MAX_AMOUNT);
        CHECK(size == KV_ISSUE_SIZE && kv_issue_to_bytes(&is, out, NULL) == 0 && !memcmp(out, b, size));
    } else {
        CHECK(rc < 0 && d.msg[0] && !strchr(d.msg, '\n'));
    }
    free(b);
    return 0;
}
