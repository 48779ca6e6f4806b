/* Work receipts over the dispatch protocol (docs/PROTOCOL.md "RECEIPT"):
 * after a completion, the coordinator asks each worker that computed some
 * of its experts to sign a receipt (docs/LEDGER.md "Work receipt") for the
 * count its own dispatch log holds; the worker signs only what it really
 * computed for that coordinator.
 *
 *   RECEIPT_REQ payload (120 bytes): gateway id [32, zero-padded],
 *     consumer [32], authorization nonce [16], n_products u64,
 *     log digest [32]
 *   RECEIPT payload (248 bytes): u32 status (0 signed, 1 refused),
 *     u32 zero, the 240 receipt bytes (all zero when refused)
 *
 * The worker's rule (kv_receipt_grant): it keeps, per connection, the pairs
 * it computed and answered and the pairs it already signed for; a request
 * is signed only while signed + n_products <= computed. So a coordinator
 * can never hold receipts for more products than the worker computed for
 * it, however it splits them among completions (the split is the
 * coordinator's own log, and the ledger pays each completion's pool by it).
 *
 * Parsers take exact lengths and check every field (gateway id syntax and
 * padding, count bounds, status, reserved bytes, the receipt's own
 * signature) before anything is used; they are fuzzed (fuzz_receipt_frame). */
#include <string.h>

#include "kvasir/dispatch_proto.h"
#include "kvasir/dispatch_receipt.h"
#include "kvasir/ledger.h"

static void kv_put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void kv_put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t kv_get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t kv_get_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static bool kv_gw_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == ':' || c == '-';
}

int kv_receipt_req_to_payload(const kv_receipt_req *q, uint8_t out[KV_PROTO_RECEIPT_REQ_SIZE], kv_diag *d) {
    const size_t gl = strnlen(q->gateway, sizeof q->gateway);
    if (gl == 0 || gl > KV_GATEWAY_ID_MAX) return kv_fail(d, KV_EINVAL, "RECEIPT_REQ: gateway id of %zu bytes", gl);
    for (size_t i = 0; i < gl; i++)
        if (!kv_gw_char(q->gateway[i])) return kv_fail(d, KV_EINVAL, "RECEIPT_REQ: bad gateway id");
    if (q->n_products == 0 || q->n_products > KV_LEDGER_MAX_PRODUCTS)
        return kv_fail(d, KV_EINVAL, "RECEIPT_REQ: %llu products outside 1..2^40", (unsigned long long)q->n_products);
    memset(out, 0, KV_PROTO_RECEIPT_REQ_SIZE);
    memcpy(out, q->gateway, gl);
    memcpy(out + 32, q->consumer, 32);
    memcpy(out + 64, q->auth_nonce, 16);
    kv_put_u64(out + 80, q->n_products);
    memcpy(out + 88, q->log_digest, 32);
    return 0;
}

int kv_receipt_req_from_payload(kv_receipt_req *q, const uint8_t *p, size_t n, kv_diag *d) {
    memset(q, 0, sizeof *q);
    if (n != KV_PROTO_RECEIPT_REQ_SIZE)
        return kv_fail(d, KV_EPROTO, "RECEIPT_REQ: %zu payload bytes, want %u", n, KV_PROTO_RECEIPT_REQ_SIZE);
    size_t gl = 0;
    while (gl < KV_GATEWAY_ID_MAX && p[gl]) gl++;
    if (gl == 0) return kv_fail(d, KV_EPROTO, "RECEIPT_REQ: empty gateway id");
    for (size_t i = 0; i < gl; i++)
        if (!kv_gw_char((char)p[i])) return kv_fail(d, KV_EPROTO, "RECEIPT_REQ: bad byte in the gateway id");
    for (size_t i = gl; i < KV_GATEWAY_ID_MAX; i++)
        if (p[i]) return kv_fail(d, KV_EPROTO, "RECEIPT_REQ: nonzero gateway id padding");
    memcpy(q->gateway, p, gl);
    memcpy(q->consumer, p + 32, 32);
    memcpy(q->auth_nonce, p + 64, 16);
    q->n_products = kv_get_u64(p + 80);
    if (q->n_products == 0 || q->n_products > KV_LEDGER_MAX_PRODUCTS)
        return kv_fail(d, KV_ERANGE, "RECEIPT_REQ: %llu products outside 1..2^40", (unsigned long long)q->n_products);
    memcpy(q->log_digest, p + 88, 32);
    return 0;
}

int kv_receipt_ans_to_payload(uint32_t status, const kv_receipt *r, uint8_t out[KV_PROTO_RECEIPT_SIZE], kv_diag *d) {
    memset(out, 0, KV_PROTO_RECEIPT_SIZE);
    if (status > KV_RECEIPT_REFUSED) return kv_fail(d, KV_EINVAL, "RECEIPT: status %u", status);
    kv_put_u32(out, status);
    if (status == KV_RECEIPT_SIGNED) return kv_receipt_to_bytes(r, out + 8, d);
    return 0;
}

int kv_receipt_ans_from_payload(uint32_t *status, kv_receipt *r, const uint8_t *p, size_t n, kv_diag *d) {
    *status = KV_RECEIPT_REFUSED;
    memset(r, 0, sizeof *r);
    if (n != KV_PROTO_RECEIPT_SIZE)
        return kv_fail(d, KV_EPROTO, "RECEIPT: %zu payload bytes, want %u", n, KV_PROTO_RECEIPT_SIZE);
    const uint32_t st = kv_get_u32(p);
    if (st > KV_RECEIPT_REFUSED || kv_get_u32(p + 4))
        return kv_fail(d, KV_EPROTO, "RECEIPT: status %u / reserved %u", st, kv_get_u32(p + 4));
    if (st == KV_RECEIPT_REFUSED) {
        for (size_t i = 8; i < n; i++)
            if (p[i]) return kv_fail(d, KV_EPROTO, "RECEIPT: a refusal carries receipt bytes");
        *status = st;
        return 0;
    }
    kv_diag vd = {0};
    int rc = kv_receipt_from_bytes(r, p + 8, KV_RECEIPT_SIZE, &vd);
    if (rc) return kv_fail(d, rc == KV_EFORMAT ? KV_EPROTO : rc, "RECEIPT: %s", vd.msg);
    *status = st;
    return 0;
}

int kv_receipt_grant(kv_receipt_budget *b, const kv_receipt_req *q, const uint8_t sk[64], kv_receipt *out,
                     kv_diag *d) {
    if (q->n_products == 0 || q->n_products > KV_LEDGER_MAX_PRODUCTS)
        return kv_fail(d, KV_ERANGE, "receipt: %llu products outside 1..2^40", (unsigned long long)q->n_products);
    if (b->signed_for > b->computed || q->n_products > b->computed - b->signed_for)
        return kv_fail(d, KV_LEDGER_RRECEIPT, "receipt: %llu products asked, %llu computed on this connection, "
                       "%llu already signed for", (unsigned long long)q->n_products,
                       (unsigned long long)b->computed, (unsigned long long)b->signed_for);
    kv_wallet w;
    memcpy(w.sk, sk, 64);
    memcpy(w.pk, sk + 32, 32); /* libsodium's secret key is seed || public key */
    kv_auth a;
    memset(&a, 0, sizeof a);
    memcpy(a.gateway, q->gateway, sizeof a.gateway);
    memcpy(a.consumer, q->consumer, 32);
    memcpy(a.nonce, q->auth_nonce, 16);
    int rc = kv_receipt_sign(out, &w, &a, q->n_products, q->log_digest, d);
    memset(&w, 0, sizeof w);
    if (rc) return rc;
    b->signed_for += q->n_products;
    return 0;
}

int kv_msg_receipt_req_encode(uint8_t *buf, size_t cap, uint32_t request_id, const kv_receipt_req *q, size_t *len,
                              kv_diag *d) {
    *len = 0;
    if (cap < KV_PROTO_HEADER + KV_PROTO_RECEIPT_REQ_SIZE) return kv_fail(d, KV_ERANGE, "RECEIPT_REQ: buffer too small");
    int rc = kv_receipt_req_to_payload(q, buf + KV_PROTO_HEADER, d);
    if (rc) return rc;
    kv_frame_header_encode(buf, KV_MSG_RECEIPT_REQ, request_id, KV_PROTO_RECEIPT_REQ_SIZE);
    *len = KV_PROTO_HEADER + KV_PROTO_RECEIPT_REQ_SIZE;
    return 0;
}

int kv_msg_receipt_encode(uint8_t *buf, size_t cap, uint32_t request_id, uint32_t status, const kv_receipt *r,
                          size_t *len, kv_diag *d) {
    *len = 0;
    if (cap < KV_PROTO_HEADER + KV_PROTO_RECEIPT_SIZE) return kv_fail(d, KV_ERANGE, "RECEIPT: buffer too small");
    int rc = kv_receipt_ans_to_payload(status, r, buf + KV_PROTO_HEADER, d);
    if (rc) return rc;
    kv_frame_header_encode(buf, KV_MSG_RECEIPT, request_id, KV_PROTO_RECEIPT_SIZE);
    *len = KV_PROTO_HEADER + KV_PROTO_RECEIPT_SIZE;
    return 0;
}

int kv_msg_receipt_decode(const uint8_t *p, size_t n, uint16_t type, kv_msg *out, kv_diag *d) {
    kv_diag vd = {0};
    int rc;
    if (type == KV_MSG_RECEIPT_REQ) {
        rc = kv_receipt_req_from_payload(&out->u.receipt_req, p, n, &vd);
    } else {
        uint32_t st;
        kv_receipt r;
        rc = kv_receipt_ans_from_payload(&st, &r, p, n, &vd);
        out->u.receipt = p;
    }
    /* the wire's codes: a bad receipt is a protocol error of the frame */
    if (rc) return kv_fail(d, rc == KV_ERANGE ? KV_ERANGE : KV_EPROTO, "%s", vd.msg);
    return 0;
}
