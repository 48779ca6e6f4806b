/* libFuzzer target for the RECEIPT_REQ and RECEIPT payload parsers
 * (src/dispatch/receipt.c), each over an exact-size copy (a read past the
 * end is an ASan error). On success the parsed fields are in bounds and
 * re-encode to the very input; on failure a negative code and a one-line
 * message. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/dispatch_proto.h"
#include "kvasir/dispatch_receipt.h"
#include "kvasir/ledger.h"

#define CHECK(x)                    \
    do {                            \
        if (!(x)) __builtin_trap(); \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *b = malloc(size ? size : 1);
    if (!b) return 0;
    memcpy(b, data, size);
    kv_diag d = {0};
    kv_receipt_req q;
    int rc = kv_receipt_req_from_payload(&q, b, size, &d);
    if (rc == 0) {
        uint8_t out[KV_PROTO_RECEIPT_REQ_SIZE];
        CHECK(q.n_products >= 1 && q.n_products <= KV_LEDGER_MAX_PRODUCTS && q.gateway[0]);
        CHECK(kv_receipt_req_to_payload(&q, out, NULL) == 0 && size == sizeof out && !memcmp(out, b, size));
    } else {
        CHECK(rc < 0 && d.msg[0] && !strchr(d.msg, '\n'));
    }
    memset(&d, 0, sizeof d);
    uint32_t st;
    kv_receipt r;
    rc = kv_receipt_ans_from_payload(&st, &r, b, size, &d);
    if (rc == 0) {
        uint8_t out[KV_PROTO_RECEIPT_SIZE];
        CHECK(st == KV_RECEIPT_SIGNED || st == KV_RECEIPT_REFUSED);
        CHECK(kv_receipt_ans_to_payload(st, &r, out, NULL) == 0 && size == sizeof out && !memcmp(out, b, size));
    } else {
        CHECK(rc < 0 && d.msg[0] && !strchr(d.msg, '\n'));
    }
    free(b);
    return 0;
}
