/* libFuzzer target for the dispatch frame/message decoder.
 *
 * Decodes the input (an exact-size copy, so a read past the end is an ASan
 * error) with and without a receiver's limits, and also as a stream of
 * frames (header first, then as many bytes as it announces, as a socket
 * reader would). Whatever decodes must satisfy the promised bounds and must
 * re-encode to the same bytes (the encoding is canonical): a decoder that
 * accepted something the encoder would never produce, or read a field
 * differently than it is written, traps. */
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

static uint8_t out[1 << 22];
static volatile float sink;

/* Re-encodes a decoded message and compares with the input frame. */
static void reencode(const uint8_t *f, size_t n, const kv_msg *m) {
    kv_diag d = {0};
    size_t k = 0;
    int rc = -1;
    switch (m->h.type) {
    case KV_MSG_HELLO: rc = kv_msg_hello_encode(out, sizeof out, m->h.request_id, &m->u.hello, &k, &d); break;
    case KV_MSG_HELLO_ACK: {
        const kv_msg_hello_ack *a = &m->u.ack;
        kv_held_range *r = malloc(sizeof *r * (a->n_ranges ? a->n_ranges : 1));
        CHECK(r);
        for (uint32_t i = 0; i < a->n_ranges; i++) {
            r[i] = kv_msg_hello_ack_range(a, i);
            CHECK(r[i].layer < a->n_layer && r[i].first <= r[i].last && r[i].last < a->n_expert);
            CHECK(kv_msg_hello_ack_holds(a, r[i].layer, r[i].first));
            CHECK(kv_msg_hello_ack_holds(a, r[i].layer, r[i].last));
        }
        kv_slab_hash *sl = malloc(sizeof *sl * (a->n_slabs ? a->n_slabs : 1));
        CHECK(sl);
        CHECK(a->version >= 2 || a->n_slabs == 0);
        for (uint32_t i = 0; i < a->n_slabs; i++) {
            sl[i] = kv_msg_hello_ack_slab(a, i);
            CHECK(sl[i].layer < a->n_layer && sl[i].first <= sl[i].last && sl[i].last < a->n_expert);
            CHECK(kv_msg_hello_ack_holds(a, sl[i].layer, sl[i].first));
        }
        CHECK(a->version < 2 || (a->max_pairs >= 1 && a->max_pairs <= KV_PROTO_MAX_PAIRS));
        kv_msg_hello_ack b = *a;
        b.ranges = r;
        b.slabs = sl;
        rc = kv_msg_hello_ack_encode(out, sizeof out, m->h.request_id, &b, &k, &d);
        free(r);
        free(sl);
        break;
    }
    case KV_MSG_COMPUTE: {
        const kv_msg_compute *c = &m->u.compute;
        CHECK(c->n_tokens >= 1 && c->n_tokens <= KV_PROTO_MAX_TOKENS);
        CHECK(c->n_pairs >= 1 && c->n_pairs <= KV_PROTO_MAX_PAIRS);
        CHECK(kv_msg_compute_size(c->enc, c->n_tokens, c->n_embd, c->n_pairs) == n);
        CHECK(kv_msg_result_size(c->out_enc & ~KV_OUT_PREACT, c->n_pairs, c->n_embd) > 0);
        kv_proto_pair *p = malloc(sizeof *p * c->n_pairs);
        float *x = malloc(sizeof(float) * c->n_tokens * c->n_embd);
        CHECK(p && x);
        for (uint32_t i = 0; i < c->n_pairs; i++) {
            p[i] = kv_msg_compute_pair(c, i);
            CHECK(p[i].token < c->n_tokens);
        }
        kv_msg_compute_x(c, x);
        sink = x[0];
        if (c->enc == KV_ENC_F32) {
            kv_msg_compute e = *c;
            e.x = x, e.pairs = p;
            rc = kv_msg_compute_encode(out, sizeof out, m->h.request_id, &e, &k, &d);
        } else {
            rc = 1; /* f16/bf16 -> f32 -> f16/bf16 may requiet NaNs: no byte compare */
        }
        free(p);
        free(x);
        break;
    }
    case KV_MSG_RESULT: {
        const kv_msg_result *r = &m->u.result;
        CHECK(kv_msg_result_size_v(m->h.version, r->enc, r->n_pairs, r->n_embd) == n);
        CHECK((r->sig != NULL) == (m->h.version >= KV_PROTO_SIG_VERSION));
        if (r->sig) CHECK(r->sig == f + n - KV_PROTO_RESULT_SIG);
        float *y = malloc(sizeof(float) * r->n_pairs * r->n_embd);
        CHECK(y);
        kv_msg_result_y(r, y);
        sink = y[0];
        if (r->enc == KV_ENC_F32) {
            kv_msg_result e = *r;
            e.y = y;
            rc = kv_msg_result_encode(out, sizeof out, m->h.request_id, &e, &k, &d);
        } else {
            rc = 1;
        }
        free(y);
        break;
    }
    case KV_MSG_ERROR:
        CHECK(m->u.error.code < 0 && strlen(m->u.error.msg) <= KV_PROTO_MAX_TEXT);
        rc = kv_msg_error_encode(out, sizeof out, m->h.request_id, m->u.error.code, m->u.error.msg, &k, &d);
        break;
    case KV_MSG_PING:
    case KV_MSG_PONG: rc = kv_msg_ping_encode(out, sizeof out, m->h.type, m->h.request_id, m->u.nonce, &k, &d); break;
    case KV_MSG_STATS: rc = kv_msg_stats_encode(out, sizeof out, m->h.request_id, &k, &d); break;
    case KV_MSG_STATS_ACK: /* the layout is the header version's */
        CHECK(m->h.version >= 1 && m->h.version <= KV_PROTO_VERSION);
        rc = kv_msg_stats_ack_encode_v(out, sizeof out, m->h.request_id, m->h.version, &m->u.stats, &k, &d);
        break;
    case KV_MSG_RESULT_PRE: {
        const kv_msg_result *r = &m->u.result;
        const size_t nf = (size_t)r->n_pairs * ((size_t)r->n_embd + 2 * (size_t)r->n_ff);
        CHECK((r->sig != NULL) == (m->h.version >= KV_PROTO_SIG_VERSION));
        CHECK(r->n_ff > 0 && r->enc == KV_ENC_F32 && 16 + 16 + nf * 4 + (r->sig ? KV_PROTO_RESULT_SIG : 0) == n);
        float *rows = malloc(sizeof(float) * nf), g[4], u[4];
        CHECK(rows);
        for (uint32_t p = 0; p < r->n_pairs; p++) {
            kv_msg_result_row(r, p, rows + p * (r->n_embd + 2 * (size_t)r->n_ff));
            if (r->n_ff <= 4) kv_msg_result_pre_row(r, p, g, u);
        }
        /* y rows only were read back; re-encode from the raw wire rows */
        memcpy(rows, f + 32, nf * 4);
        rc = kv_msg_result_pre_encode(out, sizeof out, m->h.request_id, r->n_pairs, r->n_embd, r->n_ff, rows, r->sig, &k,
                                      &d);
        free(rows);
        break;
    }
    case KV_MSG_AUTH_CHALLENGE:
        CHECK(m->h.version >= KV_PROTO_AUTH_VERSION);
        rc = kv_msg_auth_challenge_encode(out, sizeof out, m->h.request_id, &m->u.challenge, &k, &d);
        break;
    case KV_MSG_AUTH:
        CHECK(m->h.version >= KV_PROTO_AUTH_VERSION && !(m->u.auth.flags & ~KV_PROTO_AUTH_VOUCHER));
        rc = kv_msg_auth_encode(out, sizeof out, m->h.request_id, &m->u.auth, &k, &d);
        break;
    case KV_MSG_AUTH_OK:
        CHECK(m->h.version >= KV_PROTO_AUTH_VERSION);
        rc = kv_msg_auth_ok_encode(out, sizeof out, m->h.request_id, m->u.auth_ok, &k, &d);
        break;
    case KV_MSG_RECEIPT_REQ:
        rc = kv_msg_receipt_req_encode(out, sizeof out, m->h.request_id, &m->u.receipt_req, &k, &d);
        break;
    case KV_MSG_RECEIPT: {
        uint32_t st;
        kv_receipt r;
        CHECK(kv_receipt_ans_from_payload(&st, &r, m->u.receipt, KV_PROTO_RECEIPT_SIZE, NULL) == 0);
        rc = kv_msg_receipt_encode(out, sizeof out, m->h.request_id, st, &r, &k, &d);
        break;
    }
    case KV_MSG_CANCEL:
    case KV_MSG_CANCELLED: /* v6, empty */
        CHECK(m->h.version >= KV_PROTO_CANCEL_VERSION && n == KV_PROTO_HEADER);
        rc = kv_msg_cancel_encode(out, sizeof out, m->h.type, m->h.request_id, &k, &d);
        break;
    default: CHECK(0);
    }
    if (rc == 1) return;
    if (rc == KV_ERANGE && n > sizeof out) return; /* our output buffer, not the codec */
    CHECK(rc == 0);
    CHECK(k == n);
    /* the encoder writes its own version; everything else must match */
    CHECK(!memcmp(out, f, 4) && !memcmp(out + 6, f + 6, n - 6));
}

static void one(const uint8_t *f, size_t n) {
    kv_msg m;
    kv_diag d = {0};
    int rc = kv_msg_decode(f, n, NULL, &m, &d);
    if (rc) {
        CHECK(rc == KV_EPROTO || rc == KV_ERANGE || rc == KV_EUNSUPPORTED);
        CHECK(d.code == rc && d.msg[0]);
    } else {
        CHECK(m.h.magic == KV_PROTO_MAGIC && m.h.type >= 1 && m.h.type < KV_MSG_TYPE_COUNT);
        CHECK(m.h.len == n - KV_PROTO_HEADER && m.h.len <= KV_PROTO_MAX_PAYLOAD);
        reencode(f, n, &m);
    }
    /* with a small model's limits: never accepts more than without */
    const kv_proto_limits lim = {4, 16, 8, 0};
    int rc2 = kv_msg_decode(f, n, &lim, &m, &d);
    if (rc) CHECK(rc2 != 0);
    if (!rc2 && m.h.type == KV_MSG_COMPUTE) {
        CHECK(m.u.compute.layer < 4 && m.u.compute.n_embd == 16);
        for (uint32_t i = 0; i < m.u.compute.n_pairs; i++) CHECK(kv_msg_compute_pair(&m.u.compute, i).expert < 8);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy) return 0;
    if (size) memcpy(copy, data, size);
    one(copy, size);
    /* as a stream: consecutive frames, each sized by its header */
    size_t at = 0;
    while (size - at >= KV_PROTO_HEADER) {
        kv_frame_header h;
        kv_diag d = {0};
        if (kv_frame_header_decode(copy + at, size - at, &h, &d)) break;
        size_t fl = KV_PROTO_HEADER + (size_t)h.len;
        if (fl > size - at) break;
        uint8_t *f = malloc(fl);
        if (!f) break;
        memcpy(f, copy + at, fl);
        one(f, fl);
        free(f);
        at += fl;
    }
    free(copy);
    return 0;
}
