/* Dispatch protocol codec: every message type round-trips; every
 * truncation, extension and out-of-bounds field of a valid frame is
 * rejected with its documented code; encoders refuse what decoders would;
 * the stream reader assembles frames from dribbled bytes and refuses an
 * oversized header before buffering anything. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sodium.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvasir/dispatch_evidence.h"
#include "kvasir/dispatch_proto.h"
#include "kvasir/quant.h"
#include "kvasir/slice.h"
#include "kvtest.h"

#define ID_A "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

static _Alignas(16) uint8_t buf[1 << 20];
static uint8_t buf2[1 << 20];

static void wr32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8), p[2] = (uint8_t)(v >> 16), p[3] = (uint8_t)(v >> 24);
}
static void wr16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8); }

/* Decodes a patched copy of frame[n]; returns the code. */
static int dec(const uint8_t *frame, size_t n, const kv_proto_limits *lim) {
    kv_msg m;
    kv_diag d = {0};
    int rc = kv_msg_decode(frame, n, lim, &m, &d);
    if (rc) {
        /* every rejection names what was wrong */
        if (d.code != rc || !d.msg[0]) KVT_FAIL("rc %d without a diag message", rc);
    }
    return rc;
}

/* Every strict prefix of a valid frame fails; so does the header claiming
 * a shorter or longer payload than what follows, and one byte more. */
static void check_truncations(const uint8_t *frame, size_t n, const kv_proto_limits *lim, const char *what) {
    int bad = 0;
    for (size_t k = 0; k < n; k++) {
        int rc = dec(frame, k, lim);
        if (rc != KV_EPROTO) bad++;
        /* a consistent header over a short payload */
        if (k >= KV_PROTO_HEADER) {
            memcpy(buf2, frame, k);
            wr32(buf2 + 12, (uint32_t)(k - KV_PROTO_HEADER));
            rc = dec(buf2, k, lim);
            if (rc != KV_EPROTO && rc != KV_ERANGE) bad++;
        }
    }
    memcpy(buf2, frame, n);
    buf2[n] = 0;
    if (dec(buf2, n + 1, lim) != KV_EPROTO) bad++;          /* header len != bytes */
    wr32(buf2 + 12, (uint32_t)(n + 1 - KV_PROTO_HEADER));
    int rc = dec(buf2, n + 1, lim);
    if (rc != KV_EPROTO && rc != KV_ERANGE) bad++;          /* one trailing byte */
    if (bad) KVT_FAIL("%s: %d truncations/extensions accepted or wrongly coded", what, bad);
    ASSERT_EQ(bad, 0);
}

/* Patches one u32/u16 at payload offset off of a valid frame and expects code. */
static void expect_patch32(const uint8_t *frame, size_t n, size_t off, uint32_t v, const kv_proto_limits *lim,
                           int want, const char *what) {
    memcpy(buf2, frame, n);
    wr32(buf2 + KV_PROTO_HEADER + off, v);
    int rc = dec(buf2, n, lim);
    if (rc != want) KVT_FAIL("%s: got %s, want %s", what, kv_err_name(rc), kv_err_name(want));
    kvt_checks++;
}
static void expect_patch16(const uint8_t *frame, size_t n, size_t off, uint16_t v, const kv_proto_limits *lim,
                           int want, const char *what) {
    memcpy(buf2, frame, n);
    wr16(buf2 + KV_PROTO_HEADER + off, v);
    int rc = dec(buf2, n, lim);
    if (rc != want) KVT_FAIL("%s: got %s, want %s", what, kv_err_name(rc), kv_err_name(want));
    kvt_checks++;
}
static void expect_patch8(const uint8_t *frame, size_t n, size_t off, uint8_t v, const kv_proto_limits *lim,
                          int want, const char *what) {
    memcpy(buf2, frame, n);
    buf2[KV_PROTO_HEADER + off] = v;
    int rc = dec(buf2, n, lim);
    if (rc != want) KVT_FAIL("%s: got %s, want %s", what, kv_err_name(rc), kv_err_name(want));
    kvt_checks++;
}

static float frand(uint32_t *s) {
    *s = *s * 1664525u + 1013904223u;
    return ((float)(*s >> 8) / 16777216.0f - 0.5f) * 8.0f;
}

static void test_header(void) {
    kv_diag d = {0};
    kv_frame_header h;
    size_t n;
    ASSERT_EQ(kv_msg_ping_encode(buf, sizeof buf, KV_MSG_PING, 7, 99, &n, &d), 0);
    ASSERT_EQ(kv_frame_header_decode(buf, n, &h, &d), 0);
    ASSERT_EQ(h.magic, KV_PROTO_MAGIC);
    ASSERT_EQ(h.version, KV_PROTO_VERSION);
    ASSERT_EQ(h.type, KV_MSG_PING);
    ASSERT_EQ(h.request_id, 7);
    ASSERT_EQ(h.len, 8);
    ASSERT_TRUE(!memcmp(buf, "KVD1", 4));
    memcpy(buf2, buf, n);
    buf2[0] = 'X';
    ASSERT_EQ(kv_frame_header_decode(buf2, n, &h, &d), KV_EPROTO);
    memcpy(buf2, buf, n);
    wr16(buf2 + 4, 0);
    ASSERT_EQ(kv_frame_header_decode(buf2, n, &h, &d), KV_EPROTO);
    uint16_t types[] = {0, KV_MSG_TYPE_COUNT, 77, 0xffff};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        memcpy(buf2, buf, n);
        wr16(buf2 + 6, types[i]);
        ASSERT_EQ(kv_frame_header_decode(buf2, n, &h, &d), KV_EPROTO);
        ASSERT_EQ(dec(buf2, n, NULL), KV_EPROTO);
    }
    memcpy(buf2, buf, n);
    wr32(buf2 + 12, KV_PROTO_MAX_PAYLOAD + 1);
    ASSERT_EQ(kv_frame_header_decode(buf2, n, &h, &d), KV_ERANGE);
    wr32(buf2 + 12, 0xffffffffu);
    ASSERT_EQ(kv_frame_header_decode(buf2, n, &h, &d), KV_ERANGE);
    ASSERT_EQ(kv_frame_header_decode(buf, 15, &h, &d), KV_EPROTO);
    /* a future version's header is still a header; the connection decides */
    memcpy(buf2, buf, n);
    wr16(buf2 + 4, 2);
    ASSERT_EQ(kv_frame_header_decode(buf2, n, &h, &d), 0);
    ASSERT_EQ(h.version, 2);
    ASSERT_STREQ(kv_msg_type_name(KV_MSG_COMPUTE), "COMPUTE");
    ASSERT_STREQ(kv_msg_type_name(999), "?");
}

static void test_hello(void) {
    kv_diag d = {0};
    size_t n;
    kv_msg_hello h = {1, 3, ID_A, (1u << KV_ENC_F32) | (1u << KV_ENC_BF16)};
    ASSERT_EQ(kv_msg_hello_encode(buf, sizeof buf, 1, &h, &n, &d), 0);
    ASSERT_EQ(n, KV_PROTO_HEADER + KV_PROTO_HELLO_SIZE);
    kv_msg m;
    ASSERT_EQ(kv_msg_decode(buf, n, NULL, &m, &d), 0);
    ASSERT_EQ(m.h.type, KV_MSG_HELLO);
    ASSERT_EQ(m.u.hello.min_version, 1);
    ASSERT_EQ(m.u.hello.max_version, 3);
    ASSERT_STREQ(m.u.hello.model_id, ID_A);
    ASSERT_EQ(m.u.hello.enc_mask, h.enc_mask);
    check_truncations(buf, n, NULL, "HELLO");
    expect_patch16(buf, n, 0, 0, NULL, KV_EPROTO, "HELLO min version 0");
    expect_patch16(buf, n, 0, 4, NULL, KV_EPROTO, "HELLO min > max");
    expect_patch8(buf, n, 4, 'A', NULL, KV_EPROTO, "HELLO uppercase id");
    expect_patch8(buf, n, 67, 0, NULL, KV_EPROTO, "HELLO NUL in id");
    expect_patch32(buf, n, 68, 0x9, NULL, KV_EUNSUPPORTED, "HELLO unknown encoding");
    expect_patch32(buf, n, 68, 0x2, NULL, KV_EPROTO, "HELLO without f32");
    /* encoder refuses the same */
    kv_msg_hello bad = h;
    bad.min_version = 5;
    ASSERT_EQ(kv_msg_hello_encode(buf2, sizeof buf2, 1, &bad, &n, &d), KV_EINVAL);
    bad = h;
    memcpy(bad.model_id, "xyz", 4);
    ASSERT_EQ(kv_msg_hello_encode(buf2, sizeof buf2, 1, &bad, &n, &d), KV_EINVAL);
    bad = h;
    bad.enc_mask = 0x10;
    ASSERT_EQ(kv_msg_hello_encode(buf2, sizeof buf2, 1, &bad, &n, &d), KV_EINVAL);
    ASSERT_EQ(kv_msg_hello_encode(buf2, 40, 1, &h, &n, &d), KV_ERANGE);
}

static void test_hello_ack(void) {
    kv_diag d = {0};
    size_t n;
    kv_held_range r[3] = {{0, 0, 3}, {0, 8, 15}, {2, 4, 4}};
    kv_msg_hello_ack a = {0};
    a.version = 1;
    memcpy(a.model_id, ID_A, 65);
    a.n_layer = 3, a.n_embd = 64, a.n_ff_exp = 32, a.n_expert = 16, a.n_expert_used = 2;
    a.enc_mask = 0x7;
    strcpy(a.backend, "avx512");
    a.n_ranges = 3;
    a.ranges = r;
    ASSERT_EQ(kv_msg_hello_ack_encode(buf, sizeof buf, 2, &a, &n, &d), 0);
    ASSERT_EQ(n, kv_msg_hello_ack_size(6, 3));
    ASSERT_EQ(n, KV_PROTO_HEADER + KV_PROTO_HELLO_ACK_FIXED + 6 + 36);
    kv_msg m;
    ASSERT_EQ(kv_msg_decode(buf, n, NULL, &m, &d), 0);
    const kv_msg_hello_ack *b = &m.u.ack;
    ASSERT_EQ(m.h.request_id, 2);
    ASSERT_EQ(b->version, 1);
    ASSERT_STREQ(b->model_id, ID_A);
    ASSERT_EQ(b->n_layer, 3);
    ASSERT_EQ(b->n_embd, 64);
    ASSERT_EQ(b->n_ff_exp, 32);
    ASSERT_EQ(b->n_expert, 16);
    ASSERT_EQ(b->n_expert_used, 2);
    ASSERT_EQ(b->enc_mask, 7);
    ASSERT_STREQ(b->backend, "avx512");
    ASSERT_EQ(b->n_ranges, 3);
    for (uint32_t i = 0; i < 3; i++) {
        kv_held_range x = kv_msg_hello_ack_range(b, i);
        ASSERT_TRUE(x.layer == r[i].layer && x.first == r[i].first && x.last == r[i].last);
    }
    /* holds() against a naive scan, on both the decoded and the input form */
    int mism = 0;
    for (uint32_t l = 0; l < 3; l++)
        for (uint32_t e = 0; e < 16; e++) {
            bool want = false;
            for (int i = 0; i < 3; i++) want |= r[i].layer == l && r[i].first <= e && e <= r[i].last;
            mism += kv_msg_hello_ack_holds(b, l, e) != want;
            mism += kv_msg_hello_ack_holds(&a, l, e) != want;
        }
    ASSERT_EQ(mism, 0);
    check_truncations(buf, n, NULL, "HELLO_ACK");
    expect_patch16(buf, n, 0, 0, NULL, KV_EPROTO, "ACK version 0");
    expect_patch16(buf, n, 2, 0, NULL, KV_ERANGE, "ACK backend length 0");
    expect_patch16(buf, n, 2, KV_PROTO_MAX_NAME + 1, NULL, KV_ERANGE, "ACK backend length over max");
    expect_patch16(buf, n, 2, 5, NULL, KV_EPROTO, "ACK backend length inconsistent");
    expect_patch8(buf, n, 96, '\n', NULL, KV_EPROTO, "ACK backend control char");
    expect_patch32(buf, n, 68, 0, NULL, KV_ERANGE, "ACK n_layer 0");
    expect_patch32(buf, n, 68, KV_PROTO_MAX_LAYERS + 1, NULL, KV_ERANGE, "ACK n_layer over max");
    expect_patch32(buf, n, 68, 2, NULL, KV_ERANGE, "ACK range layer >= n_layer");
    expect_patch32(buf, n, 72, 0, NULL, KV_ERANGE, "ACK n_embd 0");
    expect_patch32(buf, n, 72, KV_PROTO_MAX_EMBD + 1, NULL, KV_ERANGE, "ACK n_embd over max");
    expect_patch32(buf, n, 76, 0, NULL, KV_ERANGE, "ACK n_ff 0");
    expect_patch32(buf, n, 80, 15, NULL, KV_ERANGE, "ACK range last >= n_expert");
    expect_patch32(buf, n, 80, KV_PROTO_MAX_EXPERTS + 1, NULL, KV_ERANGE, "ACK n_expert over max");
    expect_patch32(buf, n, 84, 17, NULL, KV_ERANGE, "ACK n_used > n_expert");
    expect_patch32(buf, n, 88, 0x6, NULL, KV_EPROTO, "ACK mask without f32");
    expect_patch32(buf, n, 88, 0xf, NULL, KV_EUNSUPPORTED, "ACK unknown encoding");
    expect_patch32(buf, n, 92, 2, NULL, KV_EPROTO, "ACK n_ranges inconsistent");
    expect_patch32(buf, n, 92, KV_PROTO_MAX_RANGES + 1, NULL, KV_ERANGE, "ACK n_ranges over max");
    const size_t r0 = 96 + 6;
    expect_patch32(buf, n, r0 + 4, 4, NULL, KV_ERANGE, "ACK range first > last");
    expect_patch32(buf, n, r0 + 12 + 4, 3, NULL, KV_ERANGE, "ACK ranges overlap");
    expect_patch32(buf, n, r0 + 24, 0, NULL, KV_ERANGE, "ACK ranges overlap across layer order");
    expect_patch32(buf, n, r0 + 12, 3, NULL, KV_ERANGE, "ACK ranges unsorted / layer out of range");
    /* encoder refuses bad ranges and names */
    kv_msg_hello_ack bad = a;
    kv_held_range rb[2] = {{0, 4, 7}, {0, 0, 3}};
    bad.ranges = rb, bad.n_ranges = 2;
    ASSERT_EQ(kv_msg_hello_ack_encode(buf2, sizeof buf2, 2, &bad, &n, &d), KV_EINVAL);
    bad = a;
    strcpy(bad.backend, "has space");
    ASSERT_EQ(kv_msg_hello_ack_encode(buf2, sizeof buf2, 2, &bad, &n, &d), KV_EINVAL);
    bad = a;
    bad.backend[0] = 0;
    ASSERT_EQ(kv_msg_hello_ack_encode(buf2, sizeof buf2, 2, &bad, &n, &d), KV_EINVAL);
    /* no ranges is valid (a worker holding nothing of interest) */
    bad = a;
    bad.n_ranges = 0, bad.ranges = NULL;
    ASSERT_EQ(kv_msg_hello_ack_encode(buf2, sizeof buf2, 2, &bad, &n, &d), 0);
    ASSERT_EQ(kv_msg_decode(buf2, n, NULL, &m, &d), 0);
    ASSERT_TRUE(!kv_msg_hello_ack_holds(&m.u.ack, 0, 0));
}

static void test_compute_result(void) {
    kv_diag d = {0};
    size_t n;
    enum { T = 5, E = 48, P = 9 };
    static float x[T * E], y[P * E], got[P * E];
    uint32_t s = 1;
    for (int i = 0; i < T * E; i++) x[i] = frand(&s);
    x[3] = -0.0f, x[4] = 1e-40f, x[5] = 65504.0f * 4; /* signed zero, subnormal, f16 overflow */
    kv_proto_pair pairs[P];
    for (int i = 0; i < P; i++) pairs[i] = (kv_proto_pair){(uint32_t)(i * 7 % T), (uint32_t)(i * 5 % 16)};
    const kv_proto_limits lim = {4, E, 16, 0};
    for (uint32_t enc = 0; enc < KV_ENC_COUNT; enc++) {
        kv_msg_compute c = {2, enc, enc, T, E, P, x, pairs, NULL, NULL};
        ASSERT_EQ(kv_msg_compute_encode(buf, sizeof buf, 77, &c, &n, &d), 0);
        ASSERT_EQ(n, kv_msg_compute_size(enc, T, E, P));
        ASSERT_EQ(n, KV_PROTO_HEADER + KV_PROTO_COMPUTE_FIXED + (size_t)T * E * kv_enc_size(enc) + 8 * P);
        kv_msg m;
        ASSERT_EQ(kv_msg_decode(buf, n, &lim, &m, &d), 0);
        const kv_msg_compute *v = &m.u.compute;
        ASSERT_EQ(m.h.request_id, 77);
        ASSERT_TRUE(v->layer == 2 && v->enc == enc && v->out_enc == enc && v->n_tokens == T && v->n_embd == E &&
                    v->n_pairs == P);
        int pm = 0;
        for (uint32_t i = 0; i < P; i++) {
            kv_proto_pair q = kv_msg_compute_pair(v, i);
            pm += q.token != pairs[i].token || q.expert != pairs[i].expert;
        }
        ASSERT_EQ(pm, 0);
        static float xr[T * E], row[E];
        kv_msg_compute_x(v, xr);
        int xm = 0;
        for (int i = 0; i < T * E; i++) {
            float want = enc == KV_ENC_F32   ? x[i]
                         : enc == KV_ENC_F16 ? kv_fp16_to_fp32(kv_fp32_to_fp16(x[i]))
                                             : kv_bf16_to_fp32(kv_fp32_to_bf16(x[i]));
            xm += memcmp(&want, &xr[i], 4) != 0;
        }
        ASSERT_EQ(xm, 0);
        kv_msg_compute_row(v, 3, row);
        ASSERT_TRUE(!memcmp(row, xr + 3 * E, sizeof row));
        if (enc == KV_ENC_F32) {
            /* in place when aligned (the frame starts 16-aligned here) */
            const float *ip = kv_msg_compute_x_inplace(v);
            ASSERT_TRUE(ip != NULL && !memcmp(ip, x, sizeof x));
        } else {
            ASSERT_TRUE(kv_msg_compute_x_inplace(v) == NULL);
        }
        check_truncations(buf, n, &lim, "COMPUTE");
        const size_t po = KV_PROTO_COMPUTE_FIXED + (size_t)T * E * kv_enc_size(enc);
        expect_patch16(buf, n, 4, 3, &lim, KV_EUNSUPPORTED, "COMPUTE unknown encoding");
        expect_patch16(buf, n, 6, 9, &lim, KV_EUNSUPPORTED, "COMPUTE unknown output encoding");
        expect_patch32(buf, n, 0, 4, &lim, KV_ERANGE, "COMPUTE layer >= n_layer");
        expect_patch32(buf, n, 0, 4, NULL, 0, "COMPUTE layer unchecked without limits");
        expect_patch32(buf, n, 8, 0, &lim, KV_ERANGE, "COMPUTE n_tokens 0");
        expect_patch32(buf, n, 8, KV_PROTO_MAX_TOKENS + 1, &lim, KV_ERANGE, "COMPUTE n_tokens over max");
        expect_patch32(buf, n, 8, T + 1, &lim, KV_EPROTO, "COMPUTE n_tokens inconsistent with length");
        expect_patch32(buf, n, 8, 0xffffffffu, &lim, KV_ERANGE, "COMPUTE n_tokens huge");
        expect_patch32(buf, n, 12, E + 1, &lim, KV_ERANGE, "COMPUTE n_embd != model's");
        expect_patch32(buf, n, 12, E + 1, NULL, KV_EPROTO, "COMPUTE n_embd inconsistent");
        expect_patch32(buf, n, 12, 0, NULL, KV_ERANGE, "COMPUTE n_embd 0");
        expect_patch32(buf, n, 12, KV_PROTO_MAX_EMBD + 1, NULL, KV_ERANGE, "COMPUTE n_embd over max");
        expect_patch32(buf, n, 16, 0, &lim, KV_ERANGE, "COMPUTE n_pairs 0");
        expect_patch32(buf, n, 16, KV_PROTO_MAX_PAIRS + 1, &lim, KV_ERANGE, "COMPUTE n_pairs over max");
        expect_patch32(buf, n, 16, P - 1, &lim, KV_EPROTO, "COMPUTE n_pairs inconsistent");
        expect_patch32(buf, n, po + 8 * 4, T, &lim, KV_ERANGE, "COMPUTE token >= n_tokens");
        expect_patch32(buf, n, po + 8 * 8 + 4, 16, &lim, KV_ERANGE, "COMPUTE expert >= n_expert");
        expect_patch32(buf, n, po + 4, KV_PROTO_MAX_EXPERTS, NULL, KV_ERANGE, "COMPUTE expert over max");
        expect_patch32(buf, n, po + 4, 1000, NULL, 0, "COMPUTE expert unchecked without limits");

        /* RESULT: encode, and begin/put_row in any order, give the same bytes */
        for (int i = 0; i < P * E; i++) y[i] = frand(&s);
        kv_msg_result res = {P, E, enc, y, NULL, 0, NULL};
        ASSERT_EQ(kv_msg_result_encode(buf, sizeof buf, 77, &res, &n, &d), 0);
        ASSERT_EQ(n, kv_msg_result_size(enc, P, E));
        size_t n2;
        ASSERT_EQ(kv_msg_result_begin(buf2, sizeof buf2, 77, enc, P, E, &n2, &d), 0);
        for (int i = P - 1; i >= 0; i--) kv_msg_result_put_row(buf2, enc, E, (uint32_t)i, y + i * E);
        ASSERT_EQ(n2, n);
        ASSERT_TRUE(!memcmp(buf, buf2, n));
        ASSERT_EQ(kv_msg_decode(buf, n, &lim, &m, &d), 0);
        ASSERT_EQ(m.h.type, KV_MSG_RESULT);
        ASSERT_TRUE(m.u.result.n_pairs == P && m.u.result.n_embd == E && m.u.result.enc == enc);
        kv_msg_result_y(&m.u.result, got);
        int ym = 0;
        for (int i = 0; i < P * E; i++) {
            float want = enc == KV_ENC_F32   ? y[i]
                         : enc == KV_ENC_F16 ? kv_fp16_to_fp32(kv_fp32_to_fp16(y[i]))
                                             : kv_bf16_to_fp32(kv_fp32_to_bf16(y[i]));
            ym += memcmp(&want, &got[i], 4) != 0;
        }
        ASSERT_EQ(ym, 0);
        kv_msg_result_row(&m.u.result, P - 1, row);
        ASSERT_TRUE(!memcmp(row, got + (P - 1) * E, sizeof row));
        check_truncations(buf, n, &lim, "RESULT");
        expect_patch32(buf, n, 0, 0, &lim, KV_ERANGE, "RESULT n_pairs 0");
        expect_patch32(buf, n, 0, P + 1, &lim, KV_EPROTO, "RESULT n_pairs inconsistent");
        expect_patch32(buf, n, 0, KV_PROTO_MAX_PAIRS + 1, &lim, KV_ERANGE, "RESULT n_pairs over max");
        expect_patch32(buf, n, 4, E - 1, &lim, KV_ERANGE, "RESULT n_embd != expected");
        expect_patch32(buf, n, 4, 0, NULL, KV_ERANGE, "RESULT n_embd 0");
        expect_patch32(buf, n, 8, 3, &lim, KV_EUNSUPPORTED, "RESULT unknown encoding");
    }
    /* encoder refuses out-of-bounds input */
    kv_msg_compute c = {0, KV_ENC_F32, KV_ENC_F32, T, E, P, x, pairs, NULL, NULL};
    kv_proto_pair badp[P];
    memcpy(badp, pairs, sizeof badp);
    badp[2].token = T;
    c.pairs = badp;
    ASSERT_EQ(kv_msg_compute_encode(buf2, sizeof buf2, 1, &c, &n, &d), KV_EINVAL);
    c.pairs = pairs;
    c.enc = 3;
    ASSERT_EQ(kv_msg_compute_encode(buf2, sizeof buf2, 1, &c, &n, &d), KV_EINVAL);
    c.enc = KV_ENC_F32;
    c.n_tokens = 0;
    ASSERT_EQ(kv_msg_compute_encode(buf2, sizeof buf2, 1, &c, &n, &d), KV_EINVAL);
    c.n_tokens = T;
    ASSERT_EQ(kv_msg_compute_encode(buf2, 100, 1, &c, &n, &d), KV_ERANGE);
    /* sizes: the largest valid request, and one beyond the payload maximum */
    ASSERT_TRUE(kv_msg_compute_size(KV_ENC_F32, KV_PROTO_MAX_TOKENS, 4096, KV_PROTO_MAX_PAIRS) > 0);
    ASSERT_EQ(kv_msg_compute_size(KV_ENC_F32, KV_PROTO_MAX_TOKENS, 65536, 1), 0);
    ASSERT_EQ(kv_msg_compute_size(KV_ENC_F32, KV_PROTO_MAX_TOKENS + 1, 16, 1), 0);
    ASSERT_EQ(kv_msg_compute_size(3, 1, 16, 1), 0);
    ASSERT_EQ(kv_msg_result_size(KV_ENC_F32, KV_PROTO_MAX_PAIRS, 4096), 0); /* 1 GiB */
    ASSERT_TRUE(kv_msg_result_size(KV_ENC_BF16, KV_PROTO_MAX_PAIRS, 2047) > 0);
    /* a COMPUTE whose RESULT could not be sent is refused by both sides */
    static float one_row[8192];
    kv_proto_pair many[1] = {{0, 0}};
    kv_msg_compute big = {0, KV_ENC_F32, KV_ENC_F32, 1, 8192, 1, one_row, many, NULL, NULL};
    ASSERT_EQ(kv_msg_compute_encode(buf, sizeof buf, 1, &big, &n, &d), 0);
    /* patch n_pairs to 16384 with matching length: result 512 MiB > max */
    {
        size_t pl = KV_PROTO_COMPUTE_FIXED + 8192 * 4 + 8 * 16384;
        uint8_t *f = calloc(1, KV_PROTO_HEADER + pl);
        memcpy(f, buf, n);
        wr32(f + 12, (uint32_t)pl);
        wr32(f + KV_PROTO_HEADER + 16, 16384);
        ASSERT_EQ(dec(f, KV_PROTO_HEADER + pl, NULL), KV_ERANGE);
        free(f);
        big.n_pairs = 16384;
        kv_proto_pair *mp = calloc(16384, sizeof *mp);
        big.pairs = mp;
        ASSERT_EQ(kv_msg_compute_encode(buf, sizeof buf, 1, &big, &n, &d), KV_EINVAL);
        free(mp);
    }
}

static void test_error_ping_stats(void) {
    kv_diag d = {0};
    size_t n;
    kv_msg m;
    ASSERT_EQ(kv_msg_error_encode(buf, sizeof buf, 9, KV_ENOTFOUND, "layer 3 expert 7 not held", &n, &d), 0);
    ASSERT_EQ(kv_msg_decode(buf, n, NULL, &m, &d), 0);
    ASSERT_EQ(m.h.type, KV_MSG_ERROR);
    ASSERT_EQ(m.h.request_id, 9);
    ASSERT_EQ(m.u.error.code, KV_ENOTFOUND);
    ASSERT_STREQ(m.u.error.msg, "layer 3 expert 7 not held");
    check_truncations(buf, n, NULL, "ERROR");
    expect_patch32(buf, n, 0, 0, NULL, KV_ERANGE, "ERROR code 0");
    expect_patch32(buf, n, 0, 5, NULL, KV_ERANGE, "ERROR positive code");
    expect_patch32(buf, n, 4, KV_PROTO_MAX_TEXT + 1, NULL, KV_ERANGE, "ERROR message over max");
    expect_patch32(buf, n, 4, 3, NULL, KV_EPROTO, "ERROR message length inconsistent");
    expect_patch8(buf, n, 8, 0x1b, NULL, KV_EPROTO, "ERROR escape char");
    expect_patch8(buf, n, 9, 0, NULL, KV_EPROTO, "ERROR NUL");
    /* sanitized and cut on encode */
    static char longmsg[3000];
    memset(longmsg, 'a', sizeof longmsg - 1);
    longmsg[5] = '\n';
    ASSERT_EQ(kv_msg_error_encode(buf, sizeof buf, 0, KV_EPROTO, longmsg, &n, &d), 0);
    ASSERT_EQ(n, KV_PROTO_HEADER + KV_PROTO_ERROR_FIXED + KV_PROTO_MAX_TEXT);
    ASSERT_EQ(kv_msg_decode(buf, n, NULL, &m, &d), 0);
    ASSERT_EQ(m.u.error.msg[5], '?');
    ASSERT_EQ(strlen(m.u.error.msg), KV_PROTO_MAX_TEXT);
    ASSERT_EQ(kv_msg_error_encode(buf, sizeof buf, 0, 0, "x", &n, &d), KV_EINVAL);
    ASSERT_EQ(kv_msg_error_encode(buf, sizeof buf, 0, KV_EIO, NULL, &n, &d), 0);
    ASSERT_EQ(kv_msg_decode(buf, n, NULL, &m, &d), 0);
    ASSERT_STREQ(m.u.error.msg, "");

    for (uint16_t t = KV_MSG_PING; t <= KV_MSG_PONG; t++) {
        ASSERT_EQ(kv_msg_ping_encode(buf, sizeof buf, t, 3, 0x0102030405060708ull, &n, &d), 0);
        ASSERT_EQ(kv_msg_decode(buf, n, NULL, &m, &d), 0);
        ASSERT_EQ(m.h.type, t);
        ASSERT_TRUE(m.u.nonce == 0x0102030405060708ull);
        ASSERT_EQ(buf[KV_PROTO_HEADER], 0x08); /* little-endian */
        check_truncations(buf, n, NULL, "PING");
    }
    ASSERT_EQ(kv_msg_ping_encode(buf, sizeof buf, KV_MSG_ERROR, 3, 1, &n, &d), KV_EINVAL);

    ASSERT_EQ(kv_msg_stats_encode(buf, sizeof buf, 4, &n, &d), 0);
    ASSERT_EQ(n, KV_PROTO_HEADER);
    ASSERT_EQ(kv_msg_decode(buf, n, NULL, &m, &d), 0);
    ASSERT_EQ(m.h.type, KV_MSG_STATS);
    check_truncations(buf, n, NULL, "STATS");
    kv_msg_stats st = {1, 2, 3, 4, 5, 1ull << 40, 6, 7, 8, 9};
    ASSERT_EQ(kv_msg_stats_ack_encode(buf, sizeof buf, 4, &st, &n, &d), 0);
    ASSERT_EQ(kv_msg_decode(buf, n, NULL, &m, &d), 0);
    ASSERT_EQ(m.h.type, KV_MSG_STATS_ACK);
    ASSERT_TRUE(!memcmp(&m.u.stats, &st, sizeof st));
    check_truncations(buf, n, NULL, "STATS_ACK");
}

/* v3 authentication frames: the offsets of docs/PROTOCOL.md, the flag
 * rules, version 3 only, truncations; and the transcript: every field it
 * binds changes the digest, and a signature verifies only over its own. */
static void test_auth_frames(void) {
    kv_diag d = {0};
    size_t n;
    kv_msg m;
    kv_msg_auth_challenge ch;
    for (int i = 0; i < 32; i++) ch.worker_key[i] = (uint8_t)i, ch.challenge[i] = (uint8_t)(0x80 + i);
    ASSERT_EQ(kv_msg_auth_challenge_encode(buf, sizeof buf, 5, &ch, &n, &d), 0);
    ASSERT_EQ(n, KV_PROTO_HEADER + 64);
    ASSERT_TRUE(buf[4] == 3 && buf[5] == 0 && buf[6] == KV_MSG_AUTH_CHALLENGE);
    ASSERT_TRUE(buf[KV_PROTO_HEADER + 1] == 1 && buf[KV_PROTO_HEADER + 32] == 0x80); /* key at 0, challenge at 32 */
    ASSERT_EQ(kv_msg_decode(buf, n, NULL, &m, &d), 0);
    ASSERT_TRUE(m.h.type == KV_MSG_AUTH_CHALLENGE && !memcmp(&m.u.challenge, &ch, sizeof ch));
    check_truncations(buf, n, NULL, "AUTH_CHALLENGE");
    wr16(buf + 4, 2); /* in a v2 frame: refused */
    ASSERT_EQ(dec(buf, n, NULL), KV_EPROTO);

    kv_msg_auth a = {0};
    for (int i = 0; i < 32; i++) a.key[i] = (uint8_t)(i + 1), a.nonce[i] = (uint8_t)(0x40 + i);
    for (int i = 0; i < 64; i++) a.sig[i] = (uint8_t)(0xc0 + (i & 31)), a.voucher_sig[i] = (uint8_t)(i + 7);
    a.flags = KV_PROTO_AUTH_VOUCHER;
    a.voucher_expires_ms = 0x0102030405060708ull;
    ASSERT_EQ(kv_msg_auth_encode(buf, sizeof buf, 6, &a, &n, &d), 0);
    ASSERT_EQ(n, KV_PROTO_HEADER + KV_PROTO_AUTH_SIZE);
    const uint8_t *p = buf + KV_PROTO_HEADER;
    ASSERT_TRUE(p[0] == 1 && p[32] == 0x40 && p[64] == 0xc0 && p[128] == 1 && p[132] == 0x08 && p[139] == 0x01 &&
                p[140] == 7);
    ASSERT_EQ(kv_msg_decode(buf, n, NULL, &m, &d), 0);
    ASSERT_TRUE(m.h.type == KV_MSG_AUTH && !memcmp(m.u.auth.key, a.key, 32) && !memcmp(m.u.auth.nonce, a.nonce, 32) &&
                !memcmp(m.u.auth.sig, a.sig, 64) && m.u.auth.flags == a.flags &&
                m.u.auth.voucher_expires_ms == a.voucher_expires_ms && !memcmp(m.u.auth.voucher_sig, a.voucher_sig, 64));
    check_truncations(buf, n, NULL, "AUTH");
    expect_patch32(buf, n, 128, 2, NULL, KV_EPROTO, "AUTH reserved flag");
    expect_patch32(buf, n, 128, 0, NULL, KV_EPROTO, "AUTH voucher fields without the flag");
    memcpy(buf2, buf, n);
    memset(buf2 + KV_PROTO_HEADER + 132, 0, 8);
    ASSERT_EQ(dec(buf2, n, NULL), KV_EPROTO);
    kv_msg_auth z = a;
    z.flags = 0;
    ASSERT_EQ(kv_msg_auth_encode(buf, sizeof buf, 6, &z, &n, &d), KV_EINVAL);
    z.voucher_expires_ms = 0;
    memset(z.voucher_sig, 0, 64);
    ASSERT_EQ(kv_msg_auth_encode(buf, sizeof buf, 6, &z, &n, &d), 0);
    ASSERT_EQ(kv_msg_decode(buf, n, NULL, &m, &d), 0);
    ASSERT_EQ(m.u.auth.flags, 0);

    uint8_t sig[64];
    memset(sig, 0x33, sizeof sig);
    ASSERT_EQ(kv_msg_auth_ok_encode(buf, sizeof buf, 7, sig, &n, &d), 0);
    ASSERT_EQ(n, KV_PROTO_HEADER + 64);
    ASSERT_EQ(kv_msg_decode(buf, n, NULL, &m, &d), 0);
    ASSERT_TRUE(m.h.type == KV_MSG_AUTH_OK && !memcmp(m.u.auth_ok, sig, 64));
    check_truncations(buf, n, NULL, "AUTH_OK");

    /* the transcript binds each field */
    const char *mid = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    uint8_t f[4][32], base[32], dg[32];
    for (int k = 0; k < 4; k++) memset(f[k], 0x10 * (k + 1), 32);
    kv_dispatch_digest('C', mid, 3, f[0], f[1], f[2], f[3], base);
    kv_dispatch_digest('W', mid, 3, f[0], f[1], f[2], f[3], dg);
    ASSERT_TRUE(memcmp(base, dg, 32) != 0);
    kv_dispatch_digest('C', mid, 4, f[0], f[1], f[2], f[3], dg);
    ASSERT_TRUE(memcmp(base, dg, 32) != 0);
    for (int k = 0; k < 4; k++) {
        f[k][31] ^= 1;
        kv_dispatch_digest('C', mid, 3, f[0], f[1], f[2], f[3], dg);
        ASSERT_TRUE(memcmp(base, dg, 32) != 0);
        f[k][31] ^= 1;
    }
    char mid2[65];
    memcpy(mid2, mid, 65);
    mid2[0] = '1';
    kv_dispatch_digest('C', mid2, 3, f[0], f[1], f[2], f[3], dg);
    ASSERT_TRUE(memcmp(base, dg, 32) != 0);
    /* sign / verify, against libsodium directly */
    uint8_t pk[32], sk[64], s2[64];
    crypto_sign_keypair(pk, sk);
    kv_link_sign(sk, base, s2);
    ASSERT_EQ(crypto_sign_verify_detached(s2, base, 32, pk), 0);
    ASSERT_EQ(kv_link_verify(pk, base, s2), 0);
    s2[0] ^= 1;
    ASSERT_EQ(kv_link_verify(pk, base, s2), KV_EAUTH);
    /* voucher digest: key and expiry bound */
    uint8_t v1[32], v2[32];
    kv_voucher_digest(mid, f[0], 1000, v1);
    kv_voucher_digest(mid, f[0], 1001, v2);
    ASSERT_TRUE(memcmp(v1, v2, 32) != 0);
    kv_voucher_digest(mid, f[1], 1000, v2);
    ASSERT_TRUE(memcmp(v1, v2, 32) != 0);
    /* key lists */
    uint8_t(*keys)[32] = NULL;
    size_t nk = 0;
    char hex[65];
    for (int i = 0; i < 64; i++) hex[i] = "0123456789abcdef"[i % 16];
    hex[64] = 0;
    ASSERT_EQ(kv_key_list_add(hex, &keys, &nk, &d), 0);
    ASSERT_TRUE(nk == 1 && keys[0][0] == 0x01 && keys[0][31] == 0xef);
    hex[3] = 'G';
    ASSERT_EQ(kv_key_list_add(hex, &keys, &nk, &d), KV_EINVAL);
    ASSERT_EQ(nk, 1);
    free(keys);
}

/* v3 verified compute: RESULT_PRE offsets and bounds, the COMPUTE flag, the
 * capability bit of the encoding masks. */
static void test_result_pre(void) {
    kv_diag d = {0};
    size_t n;
    kv_msg m;
    float rows[2 * (3 + 2 * 2)];
    for (int i = 0; i < 14; i++) rows[i] = (float)i + 0.5f;
    ASSERT_EQ(kv_msg_result_pre_encode(buf, sizeof buf, 8, 2, 3, 2, rows, NULL, &n, &d), 0);
    ASSERT_EQ(n, KV_PROTO_HEADER + 16 + 14 * 4);
    const uint8_t *p = buf + KV_PROTO_HEADER;
    ASSERT_TRUE(buf[6] == KV_MSG_RESULT_PRE && buf[4] == 3 && p[0] == 2 && p[4] == 3 && p[8] == 2 && p[12] == 0);
    ASSERT_EQ(kv_msg_decode(buf, n, NULL, &m, &d), 0);
    ASSERT_TRUE(m.h.type == KV_MSG_RESULT_PRE && m.u.result.n_ff == 2 && m.u.result.n_pairs == 2);
    float y[3], g[2], u[2];
    kv_msg_result_row(&m.u.result, 1, y);
    kv_msg_result_pre_row(&m.u.result, 1, g, u);
    ASSERT_TRUE(y[0] == 7.5f && y[2] == 9.5f && g[0] == 10.5f && g[1] == 11.5f && u[0] == 12.5f && u[1] == 13.5f);
    check_truncations(buf, n, NULL, "RESULT_PRE");
    expect_patch32(buf, n, 12, KV_ENC_F16, NULL, KV_EPROTO, "RESULT_PRE not f32");
    expect_patch32(buf, n, 8, 0, NULL, KV_ERANGE, "RESULT_PRE n_ff 0");
    expect_patch32(buf, n, 8, 3, NULL, KV_EPROTO, "RESULT_PRE n_ff inconsistent with the length");
    const kv_proto_limits lim = {0, 3, 0, 4};
    ASSERT_EQ(dec(buf, n, &lim), KV_ERANGE);
    memcpy(buf2, buf, n);
    wr16(buf2 + 4, 2);
    ASSERT_EQ(dec(buf2, n, NULL), KV_EPROTO);
    /* COMPUTE asking for pre-activations: f32 only */
    const float x[4] = {1, 2, 3, 4};
    const kv_proto_pair pr[1] = {{0, 1}};
    kv_msg_compute cm = {0, KV_ENC_F32, KV_ENC_F32 | KV_OUT_PREACT, 1, 4, 1, x, pr, NULL, NULL};
    ASSERT_EQ(kv_msg_compute_encode(buf, sizeof buf, 9, &cm, &n, &d), 0);
    ASSERT_EQ(kv_msg_decode(buf, n, NULL, &m, &d), 0);
    ASSERT_EQ(m.u.compute.out_enc, KV_ENC_F32 | KV_OUT_PREACT);
    expect_patch16(buf, n, 6, KV_ENC_F16 | KV_OUT_PREACT, NULL, KV_EPROTO, "COMPUTE pre-activations in f16");
    cm.out_enc = KV_ENC_BF16 | KV_OUT_PREACT;
    ASSERT_EQ(kv_msg_compute_encode(buf, sizeof buf, 9, &cm, &n, &d), KV_EINVAL);
    /* the capability bit is a valid mask bit; other unknown bits are not */
    kv_msg_hello h = {3, 3, "", 1u | KV_PROTO_CAP_PREACT};
    memset(h.model_id, 'a', 64);
    ASSERT_EQ(kv_msg_hello_encode(buf, sizeof buf, 1, &h, &n, &d), 0);
    ASSERT_EQ(kv_msg_decode(buf, n, NULL, &m, &d), 0);
    ASSERT_EQ(m.u.hello.enc_mask, 1u | KV_PROTO_CAP_PREACT);
    expect_patch32(buf, n, 68, 1u | (1u << 30), NULL, KV_EUNSUPPORTED, "HELLO unknown mask bit");
}

static void test_enc_names(void) {
    ASSERT_EQ(kv_enc_size(KV_ENC_F32), 4);
    ASSERT_EQ(kv_enc_size(KV_ENC_BF16), 2);
    ASSERT_EQ(kv_enc_size(KV_ENC_COUNT), 0);
    ASSERT_EQ(kv_enc_from_name("bf16"), KV_ENC_BF16);
    ASSERT_EQ(kv_enc_from_name("f8"), -1);
    ASSERT_STREQ(kv_enc_name(KV_ENC_F16), "f16");
}

/* The stream reader: frames dribbled a byte at a time, two back to back,
 * an oversized header refused at once, EOF inside a frame, a timeout. */
static void test_stream(void) {
    kv_diag d = {0};
    int sv[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    fcntl(sv[1], F_SETFL, fcntl(sv[1], F_GETFL) | O_NONBLOCK);
    static uint8_t rxbuf[4096];
    kv_frame_rx rx;
    kv_frame_rx_init(&rx, rxbuf, sizeof rxbuf);
    size_t n1, n2;
    ASSERT_EQ(kv_msg_ping_encode(buf, sizeof buf, KV_MSG_PING, 1, 11, &n1, &d), 0);
    ASSERT_EQ(kv_msg_stats_encode(buf + n1, sizeof buf - n1, 2, &n2, &d), 0);
    int frames = 0, zeros = 0;
    for (size_t i = 0; i < n1 + n2; i++) {
        ASSERT_EQ(write(sv[0], buf + i, 1), 1);
        int rc = kv_frame_rx_read(&rx, sv[1], &d);
        if (rc == 1) {
            kv_msg m;
            ASSERT_EQ(kv_msg_decode(rx.buf, rx.need, NULL, &m, &d), 0);
            ASSERT_EQ(m.h.request_id, (uint32_t)frames + 1);
            frames++;
            kv_frame_rx_reset(&rx);
        } else {
            ASSERT_EQ(rc, 0);
            zeros++;
        }
    }
    ASSERT_EQ(frames, 2);
    ASSERT_EQ(zeros, (int)(n1 + n2) - 2);
    /* kv_proto_read_msg with a deadline on a partial frame */
    ASSERT_EQ(write(sv[0], buf, 10), 10);
    kv_msg m;
    ASSERT_EQ(kv_proto_read_msg(&rx, sv[1], 50, NULL, &m, &d), KV_ETIMEOUT);
    ASSERT_EQ(write(sv[0], buf + 10, n1 - 10), (ssize_t)(n1 - 10));
    ASSERT_EQ(kv_proto_read_msg(&rx, sv[1], 1000, NULL, &m, &d), 0);
    ASSERT_TRUE(m.h.type == KV_MSG_PING && m.u.nonce == 11);
    kv_frame_rx_reset(&rx);
    /* a header announcing more than the buffer: refused without reading on */
    uint8_t hdr[KV_PROTO_HEADER];
    kv_frame_header_encode(hdr, KV_MSG_COMPUTE, 5, 100000);
    ASSERT_EQ(write(sv[0], hdr, sizeof hdr), (ssize_t)sizeof hdr);
    ASSERT_EQ(kv_proto_read_msg(&rx, sv[1], 1000, NULL, &m, &d), KV_ERANGE);
    kv_frame_rx_reset(&rx);
    /* garbage header */
    ASSERT_EQ(write(sv[0], "GET / HTTP/1.1\r\n", 16), 16);
    ASSERT_EQ(kv_proto_read_msg(&rx, sv[1], 1000, NULL, &m, &d), KV_EPROTO);
    kv_frame_rx_reset(&rx);
    /* EOF inside a frame, then a clean EOF */
    ASSERT_EQ(write(sv[0], buf, 5), 5);
    close(sv[0]);
    ASSERT_EQ(kv_proto_read_msg(&rx, sv[1], 1000, NULL, &m, &d), KV_EIO);
    ASSERT_TRUE(strstr(d.msg, "inside a frame") != NULL);
    kv_frame_rx_reset(&rx);
    ASSERT_EQ(kv_proto_read_msg(&rx, sv[1], 1000, NULL, &m, &d), KV_EIO);
    ASSERT_STREQ(d.msg, "closed");
    close(sv[1]);
    /* addresses */
    char host[64];
    uint16_t port;
    ASSERT_EQ(kv_link_parse_addr("127.0.0.1:8080", host, sizeof host, &port, &d), 0);
    ASSERT_TRUE(!strcmp(host, "127.0.0.1") && port == 8080);
    ASSERT_EQ(kv_link_parse_addr("[::1]:0", host, sizeof host, &port, &d), 0);
    ASSERT_TRUE(!strcmp(host, "::1") && port == 0);
    ASSERT_EQ(kv_link_parse_addr("127.0.0.1", host, sizeof host, &port, &d), KV_EINVAL);
    ASSERT_EQ(kv_link_parse_addr("h:70000", host, sizeof host, &port, &d), KV_EINVAL);
    ASSERT_EQ(kv_link_parse_addr("h:12a", host, sizeof host, &port, &d), KV_EINVAL);
    ASSERT_EQ(kv_link_parse_addr(":80", host, sizeof host, &port, &d), KV_EINVAL);
}

/* ---- golden frames ----------------------------------------------------------------
 * Written out by hand from docs/PROTOCOL.md (not produced by the encoder),
 * so that a bug shared by encoder and decoder cannot pass: each is decoded
 * and its fields compared, then encoded from those fields and compared byte
 * for byte. */

#define HDR(ver, type, rid, len)                                                      \
    0x4B, 0x56, 0x44, 0x31, (ver), 0x00, (type), 0x00, (rid), 0x00, 0x00, 0x00, (len), \
        0x00, 0x00, 0x00
#define ID64                                                                           \
    '0', '1', '2', '3', '4', '5', '6', '7', '8', '9', 'a', 'b', 'c', 'd', 'e', 'f', '0', '1', '2', '3', \
        '4', '5', '6', '7', '8', '9', 'a', 'b', 'c', 'd', 'e', 'f', '0', '1', '2', '3', '4', '5', '6', \
        '7', '8', '9', 'a', 'b', 'c', 'd', 'e', 'f', '0', '1', '2', '3', '4', '5', '6', '7', '8', '9', \
        'a', 'b', 'c', 'd', 'e', 'f'
#define U32(v) (uint8_t)(v), (uint8_t)((v) >> 8), (uint8_t)((v) >> 16), (uint8_t)((v) >> 24)
#define U64(v) U32(v), 0, 0, 0, 0

/* frames of the current version carry 6 in their header (v6: CANCEL, CANCELLED and the
   ten-counter STATS_ACK; v5: the TLS-bound handshake; the v4 layouts otherwise unchanged) */
static const uint8_t g_hello[] = {HDR(6, 1, 7, 72), 0x02, 0x00, 0x02, 0x00, ID64, U32(3)};
static const uint8_t g_ack[] = {HDR(2, 2, 7, 164), 0x02, 0x00, 0x04, 0x00, ID64,
                                U32(2), U32(64), U32(32), U32(8), U32(2), U32(1), U32(1) /* n_ranges */,
                                U32(1) /* n_slabs */, U32(512) /* max_pairs */, 'a', 'v', 'x', '2',
                                U32(1), U32(0), U32(7),                       /* range */
                                U32(1), U32(0), U32(7),                       /* slab */
                                0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab,
                                0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab, 0xab,
                                0xab, 0xab, 0xab, 0xab, 0xab, 0x01};
static const uint8_t g_compute[] = {HDR(6, 3, 9, 44), U32(1), 0x00, 0x00, 0x01, 0x00 /* enc f32, out f16 */,
                                    U32(1), U32(2), U32(2), 0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0xC0,
                                    U32(0), U32(3), U32(0), U32(5)};
static const uint8_t g_result[] = {HDR(3, 4, 9, 20), U32(2), U32(2), U32(1),
                                   0x00, 0x3C, 0x00, 0x38, 0x00, 0xC0, 0xFF, 0x7B};
/* v4: the same answer signed (the signature's bytes are arbitrary here) */
#define SIG16 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0x5a, 0xa5
static const uint8_t g_result_v4[] = {HDR(4, 4, 9, 84), U32(2), U32(2), U32(1),
                                      0x00, 0x3C, 0x00, 0x38, 0x00, 0xC0, 0xFF, 0x7B, SIG16, SIG16, SIG16, SIG16};
static const uint8_t g_error[] = {HDR(6, 5, 9, 11), 0xF9, 0xFF, 0xFF, 0xFF, U32(3), 'a', 'b', 'c'};
static const uint8_t g_ping[] = {HDR(6, 6, 4, 8), 0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01};
static const uint8_t g_stats_ack[] = {HDR(5, 9, 5, 72), U64(1), U64(2), U64(3), U64(4), U64(5), U64(6),
                                      U64(7), U64(8), U64(9)};
static const uint8_t g_stats_ack_v1[] = {HDR(1, 9, 5, 48), U64(1), U64(2), U64(3), U64(4), U64(5), U64(6)};
static const uint8_t g_stats_ack_v6[] = {HDR(6, 9, 5, 80), U64(1), U64(2), U64(3), U64(4), U64(5), U64(6),
                                         U64(7), U64(8), U64(9), U64(10)};
/* v6: CANCEL of request 9, and the worker's CANCELLED of it: empty payloads */
static const uint8_t g_cancel[] = {HDR(6, 16, 9, 0)};
static const uint8_t g_cancelled[] = {HDR(6, 17, 9, 0)};

static void check_bytes(const uint8_t *got, size_t n, const uint8_t *want, size_t wn, const char *what) {
    kvt_checks++;
    if (n != wn || memcmp(got, want, wn)) {
        size_t i = 0;
        while (i < n && i < wn && got[i] == want[i]) i++;
        KVT_FAIL("%s: encoded %zu bytes, golden %zu; first difference at byte %zu", what, n, wn, i);
    }
}

static void test_golden(void) {
    kv_diag d = {0};
    kv_msg m;
    size_t n;
    /* HELLO */
    ASSERT_EQ(kv_msg_decode(g_hello, sizeof g_hello, NULL, &m, &d), 0);
    ASSERT_TRUE(m.h.type == KV_MSG_HELLO && m.h.version == 6 && m.h.request_id == 7);
    ASSERT_TRUE(m.u.hello.min_version == 2 && m.u.hello.max_version == 2 && m.u.hello.enc_mask == 3);
    ASSERT_STREQ(m.u.hello.model_id, ID_A);
    ASSERT_EQ(kv_msg_hello_encode(buf, sizeof buf, 7, &m.u.hello, &n, &d), 0);
    check_bytes(buf, n, g_hello, sizeof g_hello, "HELLO");
    /* HELLO_ACK v2 */
    ASSERT_EQ(kv_msg_decode(g_ack, sizeof g_ack, NULL, &m, &d), 0);
    const kv_msg_hello_ack *a = &m.u.ack;
    ASSERT_TRUE(a->version == 2 && a->n_layer == 2 && a->n_embd == 64 && a->n_ff_exp == 32 && a->n_expert == 8);
    ASSERT_TRUE(a->n_expert_used == 2 && a->enc_mask == 1 && a->n_ranges == 1 && a->n_slabs == 1);
    ASSERT_EQ(a->max_pairs, 512);
    ASSERT_STREQ(a->backend, "avx2");
    kv_held_range r = kv_msg_hello_ack_range(a, 0);
    ASSERT_TRUE(r.layer == 1 && r.first == 0 && r.last == 7);
    kv_slab_hash sh = kv_msg_hello_ack_slab(a, 0);
    ASSERT_TRUE(sh.layer == 1 && sh.first == 0 && sh.last == 7 && sh.sha256[0] == 0xab && sh.sha256[31] == 0x01);
    kv_msg_hello_ack e = *a;
    e.ranges = &r;
    e.slabs = &sh;
    ASSERT_EQ(kv_msg_hello_ack_encode(buf, sizeof buf, 7, &e, &n, &d), 0);
    check_bytes(buf, n, g_ack, sizeof g_ack, "HELLO_ACK v2");
    /* COMPUTE: f32 in, f16 out */
    ASSERT_EQ(kv_msg_decode(g_compute, sizeof g_compute, NULL, &m, &d), 0);
    const kv_msg_compute *c = &m.u.compute;
    ASSERT_TRUE(c->layer == 1 && c->enc == KV_ENC_F32 && c->out_enc == KV_ENC_F16 && c->n_tokens == 1);
    ASSERT_TRUE(c->n_embd == 2 && c->n_pairs == 2);
    float x[2];
    kv_msg_compute_x(c, x);
    ASSERT_TRUE(x[0] == 1.0f && x[1] == -2.0f);
    kv_proto_pair pp[2] = {kv_msg_compute_pair(c, 0), kv_msg_compute_pair(c, 1)};
    ASSERT_TRUE(pp[0].token == 0 && pp[0].expert == 3 && pp[1].token == 0 && pp[1].expert == 5);
    kv_msg_compute ce = *c;
    ce.x = x;
    ce.pairs = pp;
    ASSERT_EQ(kv_msg_compute_encode(buf, sizeof buf, 9, &ce, &n, &d), 0);
    check_bytes(buf, n, g_compute, sizeof g_compute, "COMPUTE");
    /* RESULT in f16: 1, 0.5, -2, 65504 */
    ASSERT_EQ(kv_msg_decode(g_result, sizeof g_result, NULL, &m, &d), 0);
    float y[4];
    kv_msg_result_y(&m.u.result, y);
    ASSERT_TRUE(m.u.result.n_pairs == 2 && m.u.result.n_embd == 2 && m.u.result.enc == KV_ENC_F16);
    ASSERT_TRUE(y[0] == 1.0f && y[1] == 0.5f && y[2] == -2.0f && y[3] == 65504.0f);
    kv_msg_result re = m.u.result;
    re.y = y;
    ASSERT_EQ(kv_msg_result_encode(buf, sizeof buf, 9, &re, &n, &d), 0);
    check_bytes(buf, n, g_result, sizeof g_result, "RESULT");
    /* the streamed RESULT writes the same bytes */
    ASSERT_EQ(kv_msg_result_head(buf, 3, 9, KV_ENC_F16, 2, 2), sizeof g_result);
    kv_msg_rows_put(buf + KV_PROTO_HEADER + KV_PROTO_RESULT_FIXED, KV_ENC_F16, y, 4);
    check_bytes(buf, sizeof g_result, g_result, sizeof g_result, "streamed RESULT");
    /* v4: the signature after the rows; a v3 frame of the v4 length and the reverse are refused */
    ASSERT_EQ(kv_msg_decode(g_result_v4, sizeof g_result_v4, NULL, &m, &d), 0);
    ASSERT_TRUE(m.u.result.sig == g_result_v4 + sizeof g_result_v4 - 64 && m.u.result.sig[63] == 0xa5);
    kv_msg_result_y(&m.u.result, y);
    ASSERT_TRUE(y[0] == 1.0f && y[3] == 65504.0f);
    re = m.u.result;
    re.y = y;
    ASSERT_EQ(kv_msg_result_encode(buf, sizeof buf, 9, &re, &n, &d), 0);
    check_bytes(buf, n, g_result_v4, sizeof g_result_v4, "RESULT v4");
    ASSERT_EQ(kv_msg_result_head(buf, 4, 9, KV_ENC_F16, 2, 2), sizeof g_result_v4);
    ASSERT_EQ(kv_msg_result_size_v(4, KV_ENC_F16, 2, 2), sizeof g_result_v4);
    memcpy(buf, g_result_v4, sizeof g_result_v4);
    buf[4] = 3;
    ASSERT_EQ(dec(buf, sizeof g_result_v4, NULL), KV_EPROTO);
    memcpy(buf, g_result, sizeof g_result);
    buf[4] = 4;
    ASSERT_EQ(dec(buf, sizeof g_result, NULL), KV_EPROTO);
    check_truncations(g_result_v4, sizeof g_result_v4, NULL, "RESULT v4");
    /* ERROR ENOTFOUND "abc" */
    ASSERT_EQ(kv_msg_decode(g_error, sizeof g_error, NULL, &m, &d), 0);
    ASSERT_TRUE(m.u.error.code == KV_ENOTFOUND);
    ASSERT_STREQ(m.u.error.msg, "abc");
    ASSERT_EQ(kv_msg_error_encode(buf, sizeof buf, 9, KV_ENOTFOUND, "abc", &n, &d), 0);
    check_bytes(buf, n, g_error, sizeof g_error, "ERROR");
    /* PING */
    ASSERT_EQ(kv_msg_decode(g_ping, sizeof g_ping, NULL, &m, &d), 0);
    ASSERT_TRUE(m.h.type == KV_MSG_PING && m.u.nonce == 0x0102030405060708ull);
    ASSERT_EQ(kv_msg_ping_encode(buf, sizeof buf, KV_MSG_PING, 4, 0x0102030405060708ull, &n, &d), 0);
    check_bytes(buf, n, g_ping, sizeof g_ping, "PING");
    /* STATS_ACK v2 and v1 */
    ASSERT_EQ(kv_msg_decode(g_stats_ack, sizeof g_stats_ack, NULL, &m, &d), 0);
    const kv_msg_stats *st = &m.u.stats;
    ASSERT_TRUE(st->n_compute == 1 && st->n_pairs == 2 && st->n_tokens == 3 && st->n_conns == 4 && st->n_errors == 5);
    ASSERT_TRUE(st->uptime_ms == 6 && st->n_batches == 7 && st->n_merged == 8 && st->compute_us == 9);
    kv_msg_stats s2 = *st;
    ASSERT_EQ(kv_msg_stats_ack_encode_v(buf, sizeof buf, 5, 5, &s2, &n, &d), 0);
    check_bytes(buf, n, g_stats_ack, sizeof g_stats_ack, "STATS_ACK v2 layout (v5 header)");
    ASSERT_EQ(st->n_cancelled, 0); /* not in a v5 ack */
    /* STATS_ACK v6: the tenth counter, n_cancelled */
    ASSERT_EQ(kv_msg_decode(g_stats_ack_v6, sizeof g_stats_ack_v6, NULL, &m, &d), 0);
    ASSERT_TRUE(m.u.stats.compute_us == 9 && m.u.stats.n_cancelled == 10);
    s2 = m.u.stats;
    ASSERT_EQ(kv_msg_stats_ack_encode(buf, sizeof buf, 5, &s2, &n, &d), 0);
    check_bytes(buf, n, g_stats_ack_v6, sizeof g_stats_ack_v6, "STATS_ACK v6");
    check_truncations(g_stats_ack_v6, sizeof g_stats_ack_v6, NULL, "STATS_ACK v6");
    memcpy(buf, g_stats_ack, sizeof g_stats_ack); /* a nine-counter ack in a v6 frame: refused */
    buf[4] = 6;
    ASSERT_EQ(dec(buf, sizeof g_stats_ack, NULL), KV_EPROTO);
    /* CANCEL / CANCELLED (v6): empty, the header names the request */
    ASSERT_EQ(kv_msg_decode(g_cancel, sizeof g_cancel, NULL, &m, &d), 0);
    ASSERT_TRUE(m.h.type == KV_MSG_CANCEL && m.h.request_id == 9 && m.h.len == 0);
    ASSERT_EQ(kv_msg_cancel_encode(buf, sizeof buf, KV_MSG_CANCEL, 9, &n, &d), 0);
    check_bytes(buf, n, g_cancel, sizeof g_cancel, "CANCEL");
    ASSERT_EQ(kv_msg_decode(g_cancelled, sizeof g_cancelled, NULL, &m, &d), 0);
    ASSERT_TRUE(m.h.type == KV_MSG_CANCELLED && m.h.request_id == 9);
    ASSERT_EQ(kv_msg_cancel_encode(buf, sizeof buf, KV_MSG_CANCELLED, 9, &n, &d), 0);
    check_bytes(buf, n, g_cancelled, sizeof g_cancelled, "CANCELLED");
    ASSERT_STREQ(kv_msg_type_name(KV_MSG_CANCEL), "CANCEL");
    ASSERT_STREQ(kv_msg_type_name(KV_MSG_CANCELLED), "CANCELLED");
    ASSERT_EQ(kv_msg_cancel_encode(buf, sizeof buf, KV_MSG_PING, 9, &n, &d), KV_EINVAL);
    ASSERT_EQ(kv_msg_cancel_encode(buf, KV_PROTO_HEADER - 1, KV_MSG_CANCEL, 9, &n, &d), KV_ERANGE);
    for (uint16_t v = 1; v < KV_PROTO_CANCEL_VERSION; v++) { /* an older frame cannot carry them */
        memcpy(buf, g_cancel, sizeof g_cancel);
        buf[4] = (uint8_t)v;
        ASSERT_EQ(dec(buf, sizeof g_cancel, NULL), KV_EPROTO);
        buf[6] = KV_MSG_CANCELLED;
        ASSERT_EQ(dec(buf, sizeof g_cancel, NULL), KV_EPROTO);
    }
    uint8_t cx[KV_PROTO_HEADER + 4]; /* a payload where none belongs */
    memcpy(cx, g_cancel, sizeof g_cancel);
    cx[12] = 4;
    memset(cx + KV_PROTO_HEADER, 0, 4);
    ASSERT_EQ(dec(cx, sizeof cx, NULL), KV_EPROTO);
    memcpy(buf, g_cancel, sizeof g_cancel); /* a type past CANCELLED is still unknown */
    buf[6] = KV_MSG_TYPE_COUNT;
    ASSERT_EQ(dec(buf, sizeof g_cancel, NULL), KV_EPROTO);
    ASSERT_EQ(kv_msg_decode(g_stats_ack_v1, sizeof g_stats_ack_v1, NULL, &m, &d), 0);
    ASSERT_TRUE(m.u.stats.uptime_ms == 6 && m.u.stats.n_batches == 0);
    ASSERT_EQ(kv_msg_stats_ack_encode_v(buf, sizeof buf, 5, 1, &m.u.stats, &n, &d), 0);
    check_bytes(buf, n, g_stats_ack_v1, sizeof g_stats_ack_v1, "STATS_ACK v1");
    /* a v2 ack in a v1 frame, and a v1-length STATS_ACK in a v2 frame: refused */
    memcpy(buf, g_ack, sizeof g_ack);
    buf[4] = 1;
    ASSERT_EQ(dec(buf, sizeof g_ack, NULL), KV_EPROTO);
    memcpy(buf, g_stats_ack_v1, sizeof g_stats_ack_v1);
    buf[4] = 2;
    ASSERT_EQ(dec(buf, sizeof g_stats_ack_v1, NULL), KV_EPROTO);
    /* an unknown ack version (one past KV_PROTO_VERSION, 6) */
    memcpy(buf, g_ack, sizeof g_ack);
    buf[4] = 7, buf[16] = 7;
    ASSERT_EQ(dec(buf, sizeof g_ack, NULL), KV_EUNSUPPORTED);
    /* v2 fields bounded: max_pairs 0, a slab outside the ranges */
    memcpy(buf, g_ack, sizeof g_ack);
    wr32(buf + 16 + 100, 0);
    ASSERT_EQ(dec(buf, sizeof g_ack, NULL), KV_ERANGE);
    memcpy(buf, g_ack, sizeof g_ack);
    wr32(buf + 16 + 104 + 4 + 12, 0); /* slab layer 0: not held */
    ASSERT_EQ(dec(buf, sizeof g_ack, NULL), KV_ERANGE);
    memcpy(buf, g_ack, sizeof g_ack);
    wr32(buf + 16 + 96, 2); /* n_slabs inconsistent with the length */
    ASSERT_EQ(dec(buf, sizeof g_ack, NULL), KV_EPROTO);
    check_truncations(g_ack, sizeof g_ack, NULL, "HELLO_ACK v2");
}

/* ---- signed results (v4) ---- */

/* The reference tree, as docs/PROTOCOL.md states it: level by level, pairs
 * left to right, an odd last node carried up unchanged. */
static void ref_node(const uint8_t l[32], const uint8_t r[32], uint8_t out[32]) {
    kv_sha256 s;
    kv_sha256_init(&s);
    kv_sha256_update(&s, "kvasir-node-v4", 14);
    kv_sha256_update(&s, l, 32);
    kv_sha256_update(&s, r, 32);
    kv_sha256_final(&s, out);
}
static void ref_root(const uint8_t (*leaves)[32], uint32_t n, uint8_t out[32]) {
    uint8_t(*lv)[32] = malloc((size_t)n * 32);
    memcpy(lv, leaves, (size_t)n * 32);
    while (n > 1) {
        uint32_t m = 0;
        for (uint32_t i = 0; i < n; i += 2, m++) {
            if (i + 1 < n) ref_node(lv[i], lv[i + 1], lv[m]);
            else memcpy(lv[m], lv[i], 32);
        }
        n = m;
    }
    memcpy(out, lv[0], 32);
    free(lv);
}

/* The Merkle root three ways (level by level here, recursive, streamed)
 * agrees for every size up to 300 and a few large ones; every proof leads
 * to the root and a proof with one bit, one hash or one position changed
 * does not; a leaf is SHA-256 over its documented bytes. */
static void test_result_tree(void) {
    enum { N = 1100 };
    static uint8_t leaves[N][32];
    randombytes_buf(leaves, sizeof leaves);
    const uint32_t sizes_big[] = {511, 512, 513, 1023, 1024, 1025, 1100};
    for (uint32_t k = 0; k < 300 + KVT_N(sizes_big); k++) {
        const uint32_t n = k < 300 ? k + 1 : sizes_big[k - 300];
        uint8_t want[32], got[32], streamed[32];
        ref_root((const uint8_t(*)[32])leaves, n, want);
        kv_result_root((const uint8_t(*)[32])leaves, n, got);
        kv_result_tree t;
        kv_result_tree_init(&t);
        for (uint32_t i = 0; i < n; i++) kv_result_tree_push(&t, leaves[i]);
        kv_result_tree_root(&t, streamed);
        ASSERT_TRUE(!memcmp(want, got, 32) && !memcmp(want, streamed, 32));
        if (n > 40 && n < 300 && n % 17) continue;
        for (uint32_t p = 0; p < n; p++) {
            uint8_t pr[KV_EVIDENCE_MAX_PROOF][32], r2[32];
            const uint32_t np = kv_result_proof((const uint8_t(*)[32])leaves, n, p, pr);
            ASSERT_TRUE(np <= 11 && (n > 1 || np == 0));
            ASSERT_EQ(kv_result_root_from_proof(leaves[p], p, n, (const uint8_t(*)[32])pr, np, r2), 0);
            ASSERT_TRUE(!memcmp(r2, want, 32));
            if (n == 1) continue;
            ASSERT_EQ(kv_result_root_from_proof(leaves[p], p, n, (const uint8_t(*)[32])pr, np - 1, r2), KV_EINVAL);
            if (np < KV_EVIDENCE_MAX_PROOF)
                ASSERT_EQ(kv_result_root_from_proof(leaves[p], p, n, (const uint8_t(*)[32])pr, np + 1, r2), KV_EINVAL);
            pr[p % np][p % 32] ^= 1;
            ASSERT_TRUE(kv_result_root_from_proof(leaves[p], p, n, (const uint8_t(*)[32])pr, np, r2) != 0 ||
                        memcmp(r2, want, 32));
            pr[p % np][p % 32] ^= 1;
            const uint32_t q = (p + 1) % n; /* another position: the same leaf is not there */
            ASSERT_TRUE(kv_result_root_from_proof(leaves[p], q, n, (const uint8_t(*)[32])pr, np, r2) != 0 ||
                        memcmp(r2, want, 32));
        }
    }
    /* a leaf: SHA-256("kvasir-leaf-v4" || xhash || u32 expert || y) */
    const uint8_t xh[32] = {1, 2, 3}, y[6] = {9, 8, 7, 6, 5, 4};
    uint8_t pre[14 + 32 + 4 + 6], want[32], got[32];
    memcpy(pre, "kvasir-leaf-v4", 14);
    memcpy(pre + 14, xh, 32);
    memcpy(pre + 46, (const uint8_t[4]){0x07, 0x01, 0, 0}, 4);
    memcpy(pre + 50, y, 6);
    kv_sha256 s;
    kv_sha256_init(&s);
    kv_sha256_update(&s, pre, sizeof pre);
    kv_sha256_final(&s, want);
    kv_result_leaf(xh, 0x107, y, sizeof y, got);
    ASSERT_TRUE(!memcmp(want, got, 32));
}

/* Evidence: a worker's signature over a 5-pair answer checks for every pair
 * with its proof, and not with a y, x, expert, pair, layer, reporter or
 * signature changed, nor in another model. */
static void test_evidence(void) {
    uint8_t wpk[32], wsk[64], cpk[32], csk[64];
    crypto_sign_keypair(wpk, wsk);
    crypto_sign_keypair(cpk, csk);
    const char *mid = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    enum { P = 5, E = 4, T = 2 };
    float x[T][E], y[P][E];
    for (int i = 0; i < T * E; i++) x[i / E][i % E] = (float)i - 3.5f;
    for (int i = 0; i < P * E; i++) y[i / E][i % E] = 0.25f * (float)i;
    const uint32_t tok[P] = {0, 1, 1, 0, 1}, ex[P] = {3, 3, 5, 6, 0};
    uint8_t xw[T][E * 2], yw[P][E * 2], xh[T][32], leaves[P][32], root[32], dg[32], sig[64];
    for (int t = 0; t < T; t++) {
        kv_msg_rows_put(xw[t], KV_ENC_F16, x[t], E);
        kv_result_xhash(xw[t], sizeof xw[t], xh[t]);
    }
    for (int p = 0; p < P; p++) {
        kv_msg_rows_put(yw[p], KV_ENC_BF16, y[p], E);
        kv_result_leaf(xh[tok[p]], ex[p], yw[p], sizeof yw[p], leaves[p]);
    }
    kv_result_root((const uint8_t(*)[32])leaves, P, root);
    kv_result_digest(mid, wpk, cpk, 7, KV_ENC_F16, KV_ENC_BF16, P, root, dg);
    kv_link_sign(wsk, dg, sig);
    kv_diag d = {0};
    for (uint32_t p = 0; p < P; p++) {
        kv_evidence ev = {.layer = 7, .enc = KV_ENC_F16, .out_enc = KV_ENC_BF16, .n_pairs = P, .pair = p,
                          .expert = ex[p], .n_embd = E, .x = xw[tok[p]], .y = yw[p]};
        memcpy(ev.worker_key, wpk, 32);
        memcpy(ev.coord_key, cpk, 32);
        memcpy(ev.sig, sig, 64);
        ev.n_proof = kv_result_proof((const uint8_t(*)[32])leaves, P, p, ev.proof);
        ASSERT_EQ(kv_evidence_check(&ev, mid, &d), 0);
        kv_evidence b = ev;
        uint8_t yb[E * 2];
        memcpy(yb, yw[p], sizeof yb);
        yb[1] ^= 0x40;
        b.y = yb;
        ASSERT_EQ(kv_evidence_check(&b, mid, &d), KV_EAUTH);
        b = ev, b.x = xw[1 - tok[p]];
        ASSERT_EQ(kv_evidence_check(&b, mid, &d), KV_EAUTH);
        b = ev, b.expert ^= 1;
        ASSERT_EQ(kv_evidence_check(&b, mid, &d), KV_EAUTH);
        b = ev, b.layer = 8;
        ASSERT_EQ(kv_evidence_check(&b, mid, &d), KV_EAUTH);
        b = ev, b.pair = (p + 1) % P;
        ASSERT_TRUE(kv_evidence_check(&b, mid, &d) != 0);
        b = ev, b.coord_key[0] ^= 1; /* another reporter than the one it answered */
        ASSERT_EQ(kv_evidence_check(&b, mid, &d), KV_EAUTH);
        b = ev, b.sig[5] ^= 1;
        ASSERT_EQ(kv_evidence_check(&b, mid, &d), KV_EAUTH);
        b = ev, b.out_enc = KV_ENC_F16;
        ASSERT_EQ(kv_evidence_check(&b, mid, &d), KV_EAUTH);
        b = ev, b.pair = P;
        ASSERT_EQ(kv_evidence_check(&b, mid, &d), KV_EINVAL);
        b = ev, b.enc = 9;
        ASSERT_EQ(kv_evidence_check(&b, mid, &d), KV_EINVAL);
        ASSERT_EQ(kv_evidence_check(&ev, "1123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", &d),
                  KV_EAUTH);
    }
}

static const kvt_case cases[] = {
    KVT_CASE(test_header),           KVT_CASE(test_hello),     KVT_CASE(test_hello_ack),
    KVT_CASE(test_compute_result),   KVT_CASE(test_error_ping_stats), KVT_CASE(test_enc_names),
    KVT_CASE(test_stream),           KVT_CASE(test_golden),    KVT_CASE(test_auth_frames), KVT_CASE(test_result_pre),
    KVT_CASE(test_result_tree),      KVT_CASE(test_evidence),
};

int main(int argc, char **argv) { return kvt_run(argc, argv, cases, KVT_N(cases)); }
