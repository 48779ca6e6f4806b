/* Work receipts over dispatch (src/dispatch/receipt.c, docs/PROTOCOL.md
 * "RECEIPT"): the RECEIPT_REQ and RECEIPT payload codecs, the coordinator's
 * request and the worker's rule for signing.
 *
 * After a completion the coordinator asks a worker that computed some of
 * its experts for a receipt (kvasir/ledger.h kv_receipt) over the count in
 * its own dispatch log; the worker signs only while what it signed for on
 * the connection stays within what it computed there. */
#ifndef KVASIR_DISPATCH_RECEIPT_H
#define KVASIR_DISPATCH_RECEIPT_H

#include <stddef.h>
#include <stdint.h>

#include "kvasir/dispatch_proto.h"
#include "kvasir/err.h"

struct kv_receipt; /* kvasir/ledger.h */

/* Payload codecs: exact sizes, every field checked (KV_EPROTO, KV_ERANGE);
 * an answer's receipt is parsed and its signature verified. */
int kv_receipt_req_to_payload(const kv_receipt_req *q, uint8_t out[KV_PROTO_RECEIPT_REQ_SIZE], kv_diag *d);
int kv_receipt_req_from_payload(kv_receipt_req *q, const uint8_t *p, size_t n, kv_diag *d);
int kv_receipt_ans_to_payload(uint32_t status, const struct kv_receipt *r, uint8_t out[KV_PROTO_RECEIPT_SIZE],
                              kv_diag *d);
int kv_receipt_ans_from_payload(uint32_t *status, struct kv_receipt *r, const uint8_t *p, size_t n, kv_diag *d);
/* Whole frames (header + payload; version KV_PROTO_VERSION, set the
 * negotiated one with kv_frame_set_version). cap >= KV_PROTO_HEADER + the
 * payload size, else KV_ERANGE. */
int kv_msg_receipt_req_encode(uint8_t *buf, size_t cap, uint32_t request_id, const kv_receipt_req *q, size_t *len,
                              kv_diag *d);
int kv_msg_receipt_encode(uint8_t *buf, size_t cap, uint32_t request_id, uint32_t status,
                          const struct kv_receipt *r, size_t *len, kv_diag *d);
/* The coordinator's side, between computes (same thread): asks worker i
 * of r (up and idle) to sign q and waits up to the round deadline. Returns
 * 0 with out a receipt that verifies, by the key the worker proved, for
 * exactly q's figures; KV_LEDGER_RRECEIPT when the worker refused (it did
 * not compute that much for this connection); KV_ENOTFOUND when it is not
 * up; KV_EIO when it was dropped meanwhile (an answer for other figures, a
 * bad signature, a stall: the same rules as a RESULT). */
struct kv_remote;
int kv_remote_receipt(struct kv_remote *r, uint32_t i, const kv_receipt_req *q, struct kv_receipt *out, kv_diag *d);
/* The worker's side: signs q with sk (libsodium seed || pk) when
 * b->signed_for + q->n_products <= b->computed, and counts it; otherwise
 * KV_LEDGER_RRECEIPT and nothing is signed. */
int kv_receipt_grant(kv_receipt_budget *b, const kv_receipt_req *q, const uint8_t sk[64], struct kv_receipt *out,
                     kv_diag *d);

#endif
