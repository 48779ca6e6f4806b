/* libFuzzer target for the parsers of authenticated dispatch that read a
 * hub's answers (untrusted): GET /v1/status's hub_key, a POST /v1/voucher
 * answer, the worker keys of GET /v1/placement, and a POST /v1/report body. Whatever parses must be
 * well formed (a positive expiry; keys only for listed addresses); a
 * failure must leave a message and, for the voucher, a zeroed result. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/dispatch_evidence.h"
#include "kvasir/dispatch_proto.h"
#include "kvasir/node.h"
#include "fuzz_support.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *buf = fuzz_copy(data, size);
    kv_diag d = {0};
    uint8_t hk[32];
    int rc = kv_node_parse_hub_key(buf, size, hk, &d);
    CHECK(rc == 0 || (rc < 0 && d.msg[0]));
    kv_voucher v;
    d = (kv_diag){0};
    rc = kv_node_parse_voucher(buf, size, &v, hk, &d);
    if (rc) {
        static const kv_voucher zero;
        CHECK(rc < 0 && d.msg[0] && !memcmp(&v, &zero, sizeof v));
    } else {
        CHECK(v.expires_ms > 0);
    }
    /* the keys of two addresses, one of them absent from most inputs */
    char a0[] = "127.0.0.1:9000", a1[] = "h:1";
    char *const workers[2] = {a0, a1};
    uint8_t keys[2][32];
    d = (kv_diag){0};
    rc = kv_node_parse_placement_keys(buf, size, workers, 2, keys, &d);
    CHECK(rc == 0 || (rc < 0 && d.msg[0]));
    /* a report body (the hub's side): the reason printable and bounded */
    kv_hub_report rp;
    d = (kv_diag){0};
    rc = kv_hub_parse_report(buf, size, &rp, &d);
    const char *reason = rp.reason;
    if (!rc) {
        CHECK(strlen(reason) <= KV_HUB_MAX_REASON);
        for (size_t i = 0; reason[i]; i++) CHECK(reason[i] >= 0x20 && reason[i] < 0x7f && reason[i] != '"');
        /* evidence: bounded, and its check reads only what it holds (a forged one never verifies) */
        CHECK(rp.has_evidence == (rp.ev != NULL));
        if (rp.has_evidence) {
            CHECK(rp.ev->n_proof <= KV_EVIDENCE_MAX_PROOF && !memcmp(rp.ev->worker_key, rp.key, 32));
            CHECK(kv_evidence_x_bytes(rp.ev) > 0 && kv_evidence_y_bytes(rp.ev) > 0);
            char mid[KV_PROTO_MODEL_ID_LEN];
            memset(mid, 'a', sizeof mid);
            CHECK(kv_evidence_check(rp.ev, mid, NULL) != 0);
        }
    } else {
        CHECK(rc < 0 && d.msg[0] && reason[0] == 0 && !rp.has_evidence);
    }
    kv_hub_report_free(&rp);
    free(buf);
    return 0;
}
