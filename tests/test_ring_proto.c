/* kv-test-labels: unit
 * The ring: its frame codec checked against the byte layout written in
 * docs/PROTOCOL.md ("Ring protocol": field offsets read here by hand, not
 * through the decoder), truncated, oversized, non-finite and unknown input
 * refused with the right code; and the layer-window forward pass
 * (kv_state_batch_window) chained over windows in one process giving the
 * bits of kv_state_batch over the whole model, for qwen3moe and qwen35moe. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sodium.h>

#include "kvasir/engine.h"
#include "kvasir/gen.h"
#include "kvasir/link.h"
#include "kvasir/model.h"
#include "kvasir/pool.h"
#include "kvasir/quant.h"
#include "kvasir/ring.h"
#include "kvtest.h"

static uint32_t rd32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static uint64_t rd64(const uint8_t *p) { return rd32(p) | (uint64_t)rd32(p + 4) << 32; }
static void wr32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static uint8_t buf[1 << 20];

static const char *ID = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

/* Every shorter prefix of a valid frame is refused. */
static void check_truncations(const uint8_t *f, size_t n) {
    kv_ring_msg m;
    for (size_t k = 0; k < n; k++) {
        kv_diag d = {0};
        int rc = kv_ring_decode(f, k, &m, &d);
        if (rc == 0) KVT_FAIL("a prefix of %zu of %zu bytes decoded", k, n);
        kvt_checks++;
    }
}

static void test_header_layout(void) {
    kv_ring_probe q = {7, 1, 0x1122334455667788ull};
    size_t n;
    ASSERT_EQ(kv_ring_probe_encode(buf, sizeof buf, &q, &n, NULL), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 16);
    ASSERT_EQ(rd32(buf), 0x4752564bu); /* "KVRG" */
    ASSERT_TRUE(!memcmp(buf, "KVRG", 4));
    ASSERT_EQ(buf[4] | buf[5] << 8, KV_RING_VERSION);
    ASSERT_EQ(buf[6] | buf[7] << 8, KV_RING_PROBE);
    ASSERT_EQ(rd32(buf + 8), 16);
    ASSERT_EQ(rd32(buf + 12), 7);
    ASSERT_EQ(rd32(buf + 16), 1);
    ASSERT_EQ(rd64(buf + 20), 0x1122334455667788ull);
    kv_ring_msg m;
    kv_diag d = {0};
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_EQ(m.u.probe.nonce, q.nonce);
    check_truncations(buf, n);
    /* bad magic, version, type, oversized length */
    uint8_t f[KV_RING_HEADER + 16];
    memcpy(f, buf, sizeof f);
    f[0] ^= 1;
    ASSERT_EQ(kv_ring_decode(f, sizeof f, &m, &d), KV_EPROTO);
    memcpy(f, buf, sizeof f);
    f[4] = 6; /* a later version */
    ASSERT_EQ(kv_ring_decode(f, sizeof f, &m, &d), KV_EUNSUPPORTED);
    f[4] = 1; /* v1: a node of a build before TLS (ring v2) gets a version error */
    ASSERT_EQ(kv_ring_decode(f, sizeof f, &m, &d), KV_EUNSUPPORTED);
    ASSERT_TRUE(strstr(d.msg, "version 1, this node speaks 5") != NULL);
    f[4] = 2; /* v2: a node of a build before SUBMIT_TOKENS (ring v3) gets a version error */
    ASSERT_EQ(kv_ring_decode(f, sizeof f, &m, &d), KV_EUNSUPPORTED);
    ASSERT_TRUE(strstr(d.msg, "version 2, this node speaks 5") != NULL);
    f[4] = 3; /* v3: a node of a build before speculative decoding over the ring (v4) gets a version error */
    ASSERT_EQ(kv_ring_decode(f, sizeof f, &m, &d), KV_EUNSUPPORTED);
    ASSERT_TRUE(strstr(d.msg, "version 3, this node speaks 5") != NULL);
    f[4] = 4; /* v4: a node of a build before the prompt cache over the ring (v5) gets a version error */
    ASSERT_EQ(kv_ring_decode(f, sizeof f, &m, &d), KV_EUNSUPPORTED);
    ASSERT_TRUE(strstr(d.msg, "version 4, this node speaks 5") != NULL);
    memcpy(f, buf, sizeof f);
    f[6] = KV_RING_TYPE_COUNT;
    ASSERT_EQ(kv_ring_decode(f, sizeof f, &m, &d), KV_EPROTO);
    memcpy(f, buf, sizeof f);
    wr32(f + 8, KV_RING_MAX_PAYLOAD + 1);
    ASSERT_EQ(kv_ring_header_decode(f, sizeof f, &m.h, &d), KV_ERANGE);
    memcpy(f, buf, sizeof f);
    wr32(f + 16, 3); /* kind */
    ASSERT_EQ(kv_ring_decode(f, sizeof f, &m, &d), KV_EPROTO);
}

static void test_hello(void) {
    kv_ring_hello h = {KV_RING_ROLE_LINK, 48, 12, 23, 3072, 248320, {0}};
    memcpy(h.model_id, ID, 65);
    size_t n;
    ASSERT_EQ(kv_ring_hello_encode(buf, sizeof buf, KV_RING_HELLO, &h, &n, NULL), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 88);
    const uint8_t *p = buf + KV_RING_HEADER;
    ASSERT_EQ(rd32(p), 1);
    ASSERT_EQ(rd32(p + 4), 48);
    ASSERT_EQ(rd32(p + 8), 12);
    ASSERT_EQ(rd32(p + 12), 23);
    ASSERT_EQ(rd32(p + 16), 3072);
    ASSERT_EQ(rd32(p + 20), 248320);
    ASSERT_TRUE(!memcmp(p + 24, ID, 64));
    kv_ring_msg m;
    kv_diag d = {0};
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_STREQ(m.u.hello.model_id, ID);
    ASSERT_EQ(m.u.hello.last, 23);
    check_truncations(buf, n);
    /* window past the model, upper-case id, unknown role */
    wr32(buf + KV_RING_HEADER + 12, 48);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_ERANGE);
    wr32(buf + KV_RING_HEADER + 12, 23);
    buf[KV_RING_HEADER + 24] = 'A';
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_EPROTO);
    buf[KV_RING_HEADER + 24] = '0';
    wr32(buf + KV_RING_HEADER, 3);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_EPROTO);
    /* a client: all zero beyond the role */
    kv_ring_hello c = {.role = KV_RING_ROLE_CLIENT};
    ASSERT_EQ(kv_ring_hello_encode(buf, sizeof buf, KV_RING_HELLO, &c, &n, NULL), 0);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    buf[KV_RING_HEADER + 8] = 1;
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_EPROTO);
}

static void test_hidden(void) {
    float x[3 * 5];
    for (int i = 0; i < 15; i++) x[i] = (float)i * 0.25f - 1.0f;
    kv_ring_hidden h = {0xdeadbeefcafef00dull, 40, 3, KV_RING_HIDDEN_LOGITS, 5, NULL};
    size_t n;
    ASSERT_EQ(kv_ring_hidden_encode(buf, sizeof buf, &h, x, &n, NULL), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 24 + 60);
    const uint8_t *p = buf + KV_RING_HEADER;
    ASSERT_EQ(rd64(p), h.seq);
    ASSERT_EQ(rd32(p + 8), 40);
    ASSERT_EQ(rd32(p + 12), 3);
    ASSERT_EQ(rd32(p + 16), KV_RING_HIDDEN_LOGITS);
    ASSERT_EQ(rd32(p + 20), 5);
    uint32_t b;
    memcpy(&b, &x[7], 4);
    ASSERT_EQ(rd32(p + 24 + 28), b);
    kv_ring_msg m;
    kv_diag d = {0};
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    float y[15];
    kv_ring_floats_get(m.u.hidden.x, 15, y);
    ASSERT_TRUE(!memcmp(x, y, sizeof x));
    check_truncations(buf, n);
    /* a NaN or an Inf is a lie */
    const uint32_t nan = 0x7fc00000u, inf = 0x7f800000u;
    wr32(buf + KV_RING_HEADER + 24 + 8, nan);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_EPROTO);
    wr32(buf + KV_RING_HEADER + 24 + 8, inf | 0x80000000u);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_EPROTO);
    /* counts past their maxima, or not matching the bytes */
    kv_ring_hidden big = {1, 0, KV_RING_MAX_TOKENS + 1, 0, 5, NULL};
    ASSERT_EQ(kv_ring_hidden_encode(buf, sizeof buf, &big, x, &n, NULL), KV_ERANGE);
    ASSERT_EQ(kv_ring_hidden_size(KV_RING_MAX_TOKENS, KV_RING_MAX_EMBD), 0); /* past the 64 MiB cap */
    ASSERT_EQ(kv_ring_hidden_encode(buf, sizeof buf, &h, x, &n, NULL), 0);
    wr32(buf + KV_RING_HEADER + 12, 4); /* says 4 tokens, carries 3 */
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_EPROTO);
    wr32(buf + KV_RING_HEADER + 12, KV_RING_MAX_TOKENS + 1);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_ERANGE);
    wr32(buf + KV_RING_HEADER + 12, 3);
    wr32(buf + KV_RING_HEADER + 16, 2); /* unknown flag */
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_EPROTO);
}

static void test_start_submit_token(void) {
    kv_ring_params p = {.flags = KV_RING_SUBMIT_LOGITS, .n_predict = 12, .sample = kv_sample_defaults()};
    p.sample.seed = 99;
    const int32_t toks[4] = {5, 0, 599, 42};
    kv_ring_start s = {77, 2, 0, p, 4, NULL, 0};
    size_t n;
    ASSERT_EQ(kv_ring_start_encode(buf, sizeof buf, &s, toks, &n, NULL), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 64 + 16); /* v5: u32 n_cached after flags */
    const uint8_t *q = buf + KV_RING_HEADER;
    ASSERT_EQ(rd64(q), 77);
    ASSERT_EQ(rd32(q + 8), 2);
    ASSERT_EQ(rd32(q + 16), 0);
    ASSERT_EQ(rd32(q + 20), KV_RING_SUBMIT_LOGITS);
    ASSERT_EQ(rd32(q + 24), 12);
    ASSERT_EQ(rd64(q + 52), 99);
    ASSERT_EQ(rd32(q + 60), 4);
    ASSERT_EQ(rd32(q + 64 + 8), 599);
    kv_ring_msg m;
    kv_diag d = {0};
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_EQ(kv_ring_tokens_get(m.u.start.tokens, 3), 42);
    ASSERT_EQ(m.u.start.p.sample.seed, 99);
    check_truncations(buf, n);
    wr32(buf + KV_RING_HEADER + 64 + 4, 0xffffffffu); /* token -1 */
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_ERANGE);
    /* v5: n_cached below the prompt's length (its last token is computed) */
    s.n_cached = 3;
    ASSERT_EQ(kv_ring_start_encode(buf, sizeof buf, &s, toks, &n, NULL), 0);
    ASSERT_EQ(rd32(q + 16), 3);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_EQ(m.u.start.n_cached, 3);
    wr32(buf + KV_RING_HEADER + 16, 4);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_ERANGE);
    s.n_cached = 4;
    ASSERT_EQ(kv_ring_start_encode(buf, sizeof buf, &s, toks, &n, NULL), KV_ERANGE);
    /* SUBMIT: a NaN temperature, an empty prompt */
    kv_ring_submit sb = {p, "hello", 5};
    ASSERT_EQ(kv_ring_submit_encode(buf, sizeof buf, &sb, &n, NULL), 0);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_EQ(m.u.submit.text_len, 5);
    ASSERT_TRUE(!memcmp(m.u.submit.text, "hello", 5));
    check_truncations(buf, n);
    wr32(buf + KV_RING_HEADER + 8, 0x7fc00000u);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_EPROTO);
    sb.text_len = 0;
    ASSERT_EQ(kv_ring_submit_encode(buf, sizeof buf, &sb, &n, NULL), KV_ERANGE);
    sb.text_len = KV_RING_MAX_TEXT + 1;
    ASSERT_EQ(kv_ring_submit_encode(buf, sizeof buf, &sb, &n, NULL), KV_ERANGE);
    /* TOKEN with text and logits */
    float lg[6] = {1, -2, 3.5f, 0, -0.0f, 1e30f};
    kv_ring_token t = {.seq = 9, .pos = 17, .token = 3, .stop = 3, .piece_len = 2, .piece = "ab", .n_logits = 6};
    ASSERT_EQ(kv_ring_token_encode(buf, sizeof buf, &t, lg, &n, NULL), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 36 + 2 + 24); /* v4: u32 spec, u32 n_draft after n_logits */
    q = buf + KV_RING_HEADER;
    ASSERT_EQ(rd32(q + 8), 17);
    ASSERT_EQ(rd32(q + 16), 3);
    ASSERT_EQ(rd32(q + 20), 2);
    ASSERT_EQ(rd32(q + 24), 6);
    ASSERT_TRUE(!memcmp(q + 36, "ab", 2));
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    float back[6];
    kv_ring_floats_get(m.u.token.logits, 6, back);
    ASSERT_TRUE(!memcmp(back, lg, sizeof lg));
    check_truncations(buf, n);
    wr32(buf + KV_RING_HEADER + 30 + 20, 0x7f800000u);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_EPROTO);
    wr32(buf + KV_RING_HEADER + 30 + 20, 0);
    wr32(buf + KV_RING_HEADER + 16, 5); /* stop reason "error" never travels */
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_EPROTO);
    /* ERROR and BROKEN */
    ASSERT_EQ(kv_ring_error_encode(buf, sizeof buf, 9, KV_ETIMEOUT, 3, "ring broken: x", &n, NULL), 0);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_EQ(m.u.error.code, KV_ETIMEOUT);
    ASSERT_EQ(m.u.error.origin, 3);
    ASSERT_STREQ(m.u.error.msg, "ring broken: x");
    check_truncations(buf, n);
    buf[n - 1] = 0; /* a NUL inside the message */
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_EPROTO);
    wr32(buf + KV_RING_HEADER + 8, 1); /* a positive code */
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_EPROTO);
    ASSERT_EQ(kv_ring_broken_encode(buf, sizeof buf, 4, "gone", &n, NULL), 0);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_STREQ(m.u.broken.msg, "gone");
    check_truncations(buf, n);
}

/* SUBMIT_CHAT and STATUS / STATUS_ACK at the offsets docs/PROTOCOL.md gives;
 * a bad role, a message running past the frame, trailing bytes, too many
 * messages or bytes, unknown flags and a window out of range are refused. */
static void test_chat_status(void) {
    kv_ring_params p = {.flags = KV_RING_SUBMIT_IGNORE_EOG, .n_predict = 30, .sample = kv_sample_defaults()};
    const kv_chat_msg msgs[3] = {{"system", "be brief", 8}, {"user", "", 0}, {"assistant", "ok", 2}};
    size_t n;
    ASSERT_EQ(kv_ring_submit_chat_encode(buf, sizeof buf, &p, msgs, 3, &n, NULL), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 44 + (8 + 8) + 8 + (8 + 2));
    ASSERT_EQ(buf[6] | buf[7] << 8, 14);
    const uint8_t *q = buf + KV_RING_HEADER;
    ASSERT_EQ(rd32(q), KV_RING_SUBMIT_IGNORE_EOG);
    ASSERT_EQ(rd32(q + 4), 30);
    ASSERT_EQ(rd32(q + 40), 3);
    ASSERT_EQ(rd32(q + 44), 1);
    ASSERT_EQ(rd32(q + 48), 8);
    ASSERT_TRUE(!memcmp(q + 52, "be brief", 8));
    ASSERT_EQ(rd32(q + 60), 2);
    ASSERT_EQ(rd32(q + 64), 0);
    ASSERT_EQ(rd32(q + 68), 3);
    ASSERT_EQ(rd32(q + 72), 2);
    ASSERT_TRUE(!memcmp(q + 76, "ok", 2));
    kv_ring_msg m;
    kv_diag d = {0};
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_EQ(m.u.chat.n_msgs, 3);
    ASSERT_EQ(m.u.chat.text_bytes, 10);
    ASSERT_EQ(m.u.chat.p.flags, KV_RING_SUBMIT_IGNORE_EOG);
    const uint8_t *at = m.u.chat.msgs;
    for (int i = 0; i < 3; i++) {
        uint32_t role, len;
        const char *content;
        at = kv_ring_chat_next(at, &role, &content, &len);
        ASSERT_STREQ(kv_ring_chat_role_name(role), msgs[i].role);
        ASSERT_EQ(len, msgs[i].len);
        ASSERT_TRUE(!memcmp(content, msgs[i].content, len));
    }
    ASSERT_TRUE(at == buf + n);
    check_truncations(buf, n);
    uint8_t f[256];
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + 68, 4); /* role 4 */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_EPROTO);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + 72, 3); /* runs past the frame */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_EPROTO);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + 40, 2); /* two messages, then 10 stray bytes */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_EPROTO);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + 40, KV_RING_MAX_MSGS + 1);
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_ERANGE);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + 48, KV_RING_MAX_TEXT + 1);
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_ERANGE);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER, 4); /* unknown request flag */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_EPROTO);
    const kv_chat_msg bad = {"tool", "x", 1};
    ASSERT_EQ(kv_ring_submit_chat_encode(buf, sizeof buf, &p, &bad, 1, &n, NULL), KV_EINVAL);
    ASSERT_EQ(kv_ring_submit_chat_encode(buf, sizeof buf, &p, msgs, 0, &n, NULL), KV_ERANGE);
    /* STATUS: no payload; STATUS_ACK */
    ASSERT_EQ(kv_ring_status_encode(buf, sizeof buf, KV_RING_STATUS, NULL, &n, NULL), 0);
    ASSERT_EQ(n, KV_RING_HEADER);
    ASSERT_EQ(buf[6] | buf[7] << 8, 15);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    kv_ring_status st = {KV_RING_STATUS_WHOLE, 4, 2, 3, 512, 16, 5, "not whole: x"};
    ASSERT_EQ(kv_ring_status_encode(buf, sizeof buf, KV_RING_STATUS_ACK, &st, &n, NULL), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 32 + 12);
    ASSERT_EQ(buf[6] | buf[7] << 8, 16);
    q = buf + KV_RING_HEADER;
    ASSERT_EQ(rd32(q), 1);
    ASSERT_EQ(rd32(q + 4), 4);
    ASSERT_EQ(rd32(q + 8), 2);
    ASSERT_EQ(rd32(q + 12), 3);
    ASSERT_EQ(rd32(q + 16), 512);
    ASSERT_EQ(rd32(q + 20), 16);
    ASSERT_EQ(rd32(q + 24), 5);
    ASSERT_EQ(rd32(q + 28), 12);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_STREQ(m.u.status.msg, "not whole: x");
    ASSERT_EQ(m.u.status.n_seqs, 5);
    check_truncations(buf, n);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + 12, 4); /* last = n_layer */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_ERANGE);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + 24, 17); /* more sequences than it may hold */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_ERANGE);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER, 2);
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_EPROTO);
}

/* AUTH frames at their documented offsets; the transcript binds role, model,
 * both keys, challenge and nonce (an independent SHA-256 over the same
 * bytes), and a signature verifies only over its own transcript. */
static void test_auth(void) {
    uint8_t pk[32], sk[64], pk2[32], sk2[64];
    ASSERT_TRUE(sodium_init() >= 0);
    crypto_sign_keypair(pk, sk);
    crypto_sign_keypair(pk2, sk2);
    kv_ring_auth a = {0};
    memcpy(a.key, pk, 32);
    for (int i = 0; i < 32; i++) a.nonce[i] = (uint8_t)(i * 7 + 1);
    uint8_t ch[32];
    for (int i = 0; i < 32; i++) ch[i] = (uint8_t)(200 - i);
    uint8_t dg[32], ref[32];
    kv_ring_auth_digest('C', ID, pk2, ch, pk, a.nonce, dg);
    uint8_t text[20 + 1 + 64 + 128];
    memcpy(text, "kvasir-ring-auth-v1\n", 20);
    text[20] = 'C';
    memcpy(text + 21, ID, 64);
    memcpy(text + 85, pk2, 32);
    memcpy(text + 117, ch, 32);
    memcpy(text + 149, pk, 32);
    memcpy(text + 181, a.nonce, 32);
    crypto_hash_sha256(ref, text, sizeof text);
    ASSERT_TRUE(!memcmp(dg, ref, 32));
    kv_ring_auth_digest('A', ID, pk2, ch, pk, a.nonce, ref);
    ASSERT_TRUE(memcmp(dg, ref, 32)); /* the roles sign different texts */
    kv_link_sign(sk, dg, a.sig);
    ASSERT_EQ(kv_link_verify(pk, dg, a.sig), 0);
    ASSERT_EQ(kv_link_verify(pk2, dg, a.sig), KV_EAUTH);
    ASSERT_EQ(kv_link_verify(pk, ref, a.sig), KV_EAUTH);
    size_t n;
    ASSERT_EQ(kv_ring_auth_encode(buf, sizeof buf, KV_RING_AUTH, &a, &n, NULL), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 128);
    ASSERT_EQ(buf[6], KV_RING_AUTH);
    ASSERT_TRUE(!memcmp(buf + KV_RING_HEADER, pk, 32) && !memcmp(buf + KV_RING_HEADER + 64, a.sig, 64));
    kv_ring_msg m;
    kv_diag d = {0};
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_TRUE(!memcmp(m.u.auth.sig, a.sig, 64) && !memcmp(m.u.auth.nonce, a.nonce, 32));
    check_truncations(buf, n);
    ASSERT_EQ(kv_ring_auth_encode(buf, sizeof buf, KV_RING_AUTH_CHALLENGE, &a, &n, NULL), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 64);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_EQ(kv_ring_auth_encode(buf, sizeof buf, KV_RING_AUTH_OK, &a, &n, NULL), 0);
    ASSERT_TRUE(!memcmp(buf + KV_RING_HEADER, a.sig, 64));
    ASSERT_EQ(kv_ring_auth_encode(buf, sizeof buf, KV_RING_PROBE, &a, &n, NULL), KV_EINVAL);
    /* AUTH with a hub voucher: 200 bytes, expiry at 128, the hub's signature at 136 */
    a.voucher_expires_ms = 0x0102030405060708ull;
    for (int i = 0; i < 64; i++) a.voucher_sig[i] = (uint8_t)(i ^ 0x5a);
    ASSERT_EQ(kv_ring_auth_encode(buf, sizeof buf, KV_RING_AUTH, &a, &n, NULL), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 200);
    ASSERT_EQ(rd64(buf + KV_RING_HEADER + 128), 0x0102030405060708ull);
    ASSERT_TRUE(!memcmp(buf + KV_RING_HEADER + 136, a.voucher_sig, 64));
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_EQ(m.u.auth.voucher_expires_ms, a.voucher_expires_ms);
    ASSERT_TRUE(!memcmp(m.u.auth.voucher_sig, a.voucher_sig, 64));
    check_truncations(buf, n);
    memset(buf + KV_RING_HEADER + 128, 0, 8); /* a voucher expiring at 0 is not canonical (no voucher is 128 bytes) */
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_EPROTO);
    wr32(buf + 8, 164); /* neither 128 nor 200 */
    ASSERT_EQ(kv_ring_decode(buf, KV_RING_HEADER + 164, &m, &d), KV_EPROTO);
}

/* ---- the layer-window forward pass ---------------------------------------------- */

static char g_dir[200];


static float rdf(const uint8_t *p) {
    const uint32_t u = rd32(p);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* v3: SUBMIT_TOKENS with the sampling extension, START carrying it (and
 * n_gen), TOKEN with a log-probability, VOCAB / VOCAB_ACK, at the offsets
 * docs/PROTOCOL.md gives; malformed ones refused. */
static void test_v3_frames(void) {
    kv_diag d = {0};
    const kv_logit_bias bias[2] = {{7, -100.0f}, {300, 2.5f}};
    const char *gram = "root ::= \"a\" [b-c]*";
    kv_ring_params p = {.flags = KV_RING_SUBMIT_EXT | KV_RING_SUBMIT_LOGPROBS, .n_predict = 9,
                        .sample = kv_sample_defaults(), .top_logprobs = 3, .grammar = gram,
                        .grammar_len = (uint32_t)strlen(gram)};
    p.sample.presence_penalty = 0.5f;
    p.sample.frequency_penalty = -0.25f;
    p.sample.bias = bias;
    p.sample.n_bias = 2;
    const int32_t toks[3] = {1, 2, 511};
    size_t n;
    ASSERT_EQ(kv_ring_submit_tokens_encode(buf, sizeof buf, &p, toks, 3, &n, &d), 0);
    const size_t ext = 40 + 4 + 12;
    ASSERT_EQ(n, KV_RING_HEADER + ext + 24 + 16 + strlen(gram));
    ASSERT_EQ(kv_ring_params_size(&p), 40 + 24 + 16 + strlen(gram));
    const uint8_t *q = buf + KV_RING_HEADER;
    ASSERT_EQ(buf[6], KV_RING_SUBMIT_TOKENS);
    ASSERT_EQ(rd32(q), KV_RING_SUBMIT_EXT | KV_RING_SUBMIT_LOGPROBS);
    ASSERT_EQ(rd32(q + 40), 3);
    ASSERT_EQ(rd32(q + 52), 511);
    ASSERT_TRUE(rdf(q + ext) == 0.5f && rdf(q + ext + 4) == -0.25f);
    ASSERT_EQ(rd32(q + ext + 8), 3);  /* top_logprobs */
    ASSERT_EQ(rd32(q + ext + 12), 0); /* n_gen */
    ASSERT_EQ(rd32(q + ext + 16), 2); /* n_bias */
    ASSERT_EQ(rd32(q + ext + 20), strlen(gram));
    ASSERT_EQ(rd32(q + ext + 32), 300);
    ASSERT_TRUE(rdf(q + ext + 36) == 2.5f);
    ASSERT_TRUE(!memcmp(q + ext + 40, gram, strlen(gram)));
    kv_ring_msg m;
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_EQ(m.u.stok.n_tokens, 3);
    ASSERT_EQ(m.u.stok.p.top_logprobs, 3);
    ASSERT_EQ(m.u.stok.p.sample.n_bias, 2);
    ASSERT_TRUE(m.u.stok.p.sample.presence_penalty == 0.5f && m.u.stok.p.sample.frequency_penalty == -0.25f);
    ASSERT_EQ(m.u.stok.p.grammar_len, strlen(gram));
    ASSERT_TRUE(!memcmp(m.u.stok.p.grammar, gram, strlen(gram)));
    check_truncations(buf, n);
    uint8_t f[4096];
    memcpy(f, buf, n);
    f[n] = 0; /* a byte past the extension */
    wr32(f + 8, (uint32_t)(n + 1 - KV_RING_HEADER));
    ASSERT_EQ(kv_ring_decode(f, n + 1, &m, &d), KV_EPROTO);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + ext, 0x7fc00000u); /* NaN presence penalty */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_EPROTO);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + ext, 0x40400000u); /* 3.0: out of [-2, 2] */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_ERANGE);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + ext + 24, 0xffffffffu); /* bias token -1 */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_ERANGE);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + ext + 28, 0x43480000u); /* bias 200 */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_ERANGE);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + ext + 8, 21); /* top_logprobs over 20 */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_ERANGE);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + ext + 12, 1); /* n_gen in a SUBMIT_TOKENS */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_EPROTO);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER, KV_RING_SUBMIT_LOGPROBS); /* LOGPROBS without EXT */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_EPROTO);
    /* a SUBMIT (text) does not carry the extension */
    kv_ring_params tp = {.n_predict = 4, .sample = kv_sample_defaults()};
    const kv_ring_submit sb = {tp, "hello", 5};
    size_t sn;
    ASSERT_EQ(kv_ring_submit_encode(f, sizeof f, &sb, &sn, &d), 0);
    wr32(f + KV_RING_HEADER, KV_RING_SUBMIT_EXT);
    ASSERT_EQ(kv_ring_decode(f, sn, &m, &d), KV_EPROTO);

    /* START: the extension after the tokens, n_gen below n */
    p.n_gen = 2;
    kv_ring_start st = {.seq = 5, .home = 0, .p = p, .n_tokens = 3};
    ASSERT_EQ(kv_ring_start_encode(buf, sizeof buf, &st, toks, &n, &d), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 64 + 12 + 24 + 16 + strlen(gram));
    ASSERT_EQ(rd32(buf + KV_RING_HEADER + 76 + 12), 2);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_EQ(m.u.start.p.n_gen, 2);
    ASSERT_EQ(m.u.start.n_tokens, 3);
    wr32(buf + KV_RING_HEADER + 76 + 12, 3); /* n_gen = n */
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_ERANGE);
    st.p.flags = 0; /* without the extension: v2's layout */
    ASSERT_EQ(kv_ring_start_encode(buf, sizeof buf, &st, toks, &n, &d), KV_EINVAL); /* n_gen needs EXT */
    st.p.n_gen = 0;
    ASSERT_EQ(kv_ring_start_encode(buf, sizeof buf, &st, toks, &n, &d), KV_EINVAL); /* so do bias, grammar, ... */
    st.p = (kv_ring_params){.n_predict = 9, .sample = kv_sample_defaults()};
    ASSERT_EQ(kv_ring_start_encode(buf, sizeof buf, &st, toks, &n, &d), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 64 + 12);

    /* TOKEN with a log-probability: u32 n_top, f64 logprob, {i32, f64}[n_top] after the logits */
    kv_ring_token t = {.seq = 9, .pos = 4, .token = 33, .stop = KV_STOP_GRAMMAR, .piece_len = 2, .piece = "ab",
                       .has_lp = true, .lp = {.token = 33, .logprob = -0.125, .n_top = 2}};
    t.lp.top_id[0] = 33;
    t.lp.top_logprob[0] = -0.125;
    t.lp.top_id[1] = 8;
    t.lp.top_logprob[1] = -3.5;
    ASSERT_EQ(kv_ring_token_encode(buf, sizeof buf, &t, NULL, &n, &d), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 36 + 2 + 12 + 24);
    q = buf + KV_RING_HEADER + 38;
    ASSERT_EQ(rd32(q), 2);
    double lp;
    const uint64_t lb = rd64(q + 4);
    memcpy(&lp, &lb, 8);
    ASSERT_TRUE(lp == -0.125);
    ASSERT_EQ(rd32(q + 24), 8);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_TRUE(m.u.token.has_lp && m.u.token.lp.n_top == 2 && m.u.token.lp.top_logprob[1] == -3.5);
    ASSERT_EQ(m.u.token.stop, KV_STOP_GRAMMAR);
    check_truncations(buf, n);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + 38 + 8, 0x7ff80000u); /* the logprob's high word: NaN */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_EPROTO);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + 38, 21);
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_ERANGE);
    t.has_lp = false;
    ASSERT_EQ(kv_ring_token_encode(buf, sizeof buf, &t, NULL, &n, &d), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 38);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_TRUE(!m.u.token.has_lp);

    /* VOCAB: no payload; VOCAB_ACK: u32 len, bytes */
    ASSERT_EQ(kv_ring_vocab_encode(buf, sizeof buf, KV_RING_VOCAB, NULL, 0, &n, &d), 0);
    ASSERT_EQ(n, KV_RING_HEADER);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_EQ(kv_ring_vocab_encode(buf, sizeof buf, KV_RING_VOCAB_ACK, (const uint8_t *)"GGUF", 4, &n, &d), 0);
    ASSERT_EQ(rd32(buf + KV_RING_HEADER), 4);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_TRUE(m.u.vocab.len == 4 && !memcmp(m.u.vocab.gguf, "GGUF", 4));
    wr32(buf + KV_RING_HEADER, 0);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_ERANGE);
}

/* The VOCAB_ACK payload of a generated model loads as a tokenizer that
 * tokenizes as the model's own, with its chat template, and nothing else. */
static void test_vocab_pack(void) {
    char path[300];
    snprintf(path, sizeof path, "%s/vocab.gguf", g_dir);
    kv_diag d = {0};
    kv_gen_config c;
    ASSERT_EQ(kv_gen_preset_get("tiny", &c, &d), 0);
    c.n_layer = 1;
    c.n_threads = 1;
    c.log = NULL;
    ASSERT_EQ(kv_gen_model(&c, path, &d), 0);
    kv_gguf *g = NULL, *v = NULL;
    ASSERT_EQ(kv_gguf_open(&g, path, &d), 0);
    uint8_t *pack = NULL;
    size_t len = 0;
    ASSERT_EQ(kv_ring_vocab_pack(g, &pack, &len, &d), 0);
    ASSERT_EQ(kv_gguf_open_mem(&v, pack, len, &d), 0);
    ASSERT_EQ(kv_gguf_n_tensors(v), 0);
    for (size_t i = 0; i < kv_gguf_n_kv(v); i++) ASSERT_TRUE(!strncmp(kv_gguf_kv_at(v, i)->key.ptr, "tokenizer.", 10));
    kv_tok *a = NULL, *b = NULL;
    ASSERT_EQ(kv_tok_load(&a, g, &d), 0);
    ASSERT_EQ(kv_tok_load(&b, v, &d), 0);
    ASSERT_EQ(kv_tok_n_vocab(a), kv_tok_n_vocab(b));
    ASSERT_EQ(kv_tok_bos(a), kv_tok_bos(b));
    ASSERT_EQ(kv_tok_eos(a), kv_tok_eos(b));
    const char *text = "<|im_start|>user\nHello, wörld! 12345 <think> \xe6\x97\xa5\xe6\x9c\xac<|im_end|>";
    int32_t ia[256], ib[256];
    size_t na = 0, nb = 0;
    ASSERT_EQ(kv_tok_encode(a, text, strlen(text), true, ia, 256, &na, &d), 0);
    ASSERT_EQ(kv_tok_encode(b, text, strlen(text), true, ib, 256, &nb, &d), 0);
    ASSERT_EQ(na, nb);
    ASSERT_TRUE(!memcmp(ia, ib, na * sizeof *ia));
    kv_str ta = {0}, tb = {0};
    if (kv_gguf_find_kv(g, "tokenizer.chat_template")) {
        ASSERT_EQ(kv_gguf_get_str(g, "tokenizer.chat_template", &ta, &d), 0);
        ASSERT_EQ(kv_gguf_get_str(v, "tokenizer.chat_template", &tb, &d), 0);
        ASSERT_TRUE(ta.len == tb.len && !memcmp(ta.ptr, tb.ptr, ta.len));
    }
    kv_tok_free(a);
    kv_tok_free(b);
    kv_gguf_close(v);
    kv_gguf_close(g);
    free(pack);
    unlink(path);
}

static void window_case(const char *arch) {
    char path[300];
    snprintf(path, sizeof path, "%s/%s.gguf", g_dir, arch);
    kv_diag d = {0};
    kv_gen_config c;
    if (!strcmp(arch, "qwen3moe")) {
        ASSERT_EQ(kv_gen_preset_get("tiny", &c, &d), 0);
        c.n_layer = 4; c.n_embd = 64; c.n_ff_exp = 32; c.n_expert = 8; c.n_expert_used = 2;
        c.n_head = 4; c.n_head_kv = 2; c.head_dim = 16; c.n_vocab = 512; c.type = KV_TYPE_Q8_0;
        c.n_ctx = 128; c.seed = 3;
    } else {
        c = (kv_gen_config){.arch = "qwen35moe", .n_layer = 4, .n_embd = 64, .n_ff_exp = 32, .n_expert = 8,
                            .n_expert_used = 2, .n_head = 4, .n_head_kv = 2, .head_dim = 16, .n_vocab = 512,
                            .n_ctx = 128, .type = KV_TYPE_F32, .seed = 5, .full_attn_interval = 2,
                            .ssm_d_state = 8, .ssm_n_group = 2, .ssm_dt_rank = 4, .n_rot = 8,
                            .rope_sections = {2, 1, 1, 0}, .n_nextn = 1, .n_ff_shexp = 24};
        kv_gen_fill_defaults(&c);
    }
    c.n_threads = 1;
    c.log = NULL;
    if (kv_gen_model(&c, path, &d)) {
        KVT_FAIL("gen %s: %s", arch, d.msg);
        return;
    }
    kv_pool *pool = NULL;
    ASSERT_EQ(kv_pool_new(&pool, 1, &d), 0);
    kv_model *full = NULL, *w[3] = {NULL, NULL, NULL};
    const uint32_t win[3][2] = {{0, 0}, {1, 2}, {3, 3}};
    ASSERT_EQ(kv_model_load(&full, path, &d), 0);
    for (int i = 0; i < 3; i++) {
        kv_model_opts o = {.window = true, .layer_first = win[i][0], .layer_last = win[i][1]};
        ASSERT_EQ(kv_model_load_ex(&w[i], path, &o, &d), 0);
    }
    kv_model_opts bad = {.window = true, .layer_first = 2, .layer_last = 4};
    kv_model *wb = NULL;
    ASSERT_EQ(kv_model_load_ex(&wb, path, &bad, &d), KV_EINVAL);
    if (!full || !w[0] || !w[1] || !w[2]) goto out;
    /* the windows together hold the model's trunk, the middle one neither embedding nor head */
    ASSERT_TRUE(kv_model_weight_bytes(w[1]) < kv_model_weight_bytes(full));
    ASSERT_TRUE(kv_model_weight_bytes(w[0]) + kv_model_weight_bytes(w[1]) + kv_model_weight_bytes(w[2]) <=
                kv_model_weight_bytes(full) + (uint64_t)c.n_vocab * c.n_embd * 4 /* a tied head counted twice */);
    kv_state *sf = NULL, *sw[3] = {NULL, NULL, NULL};
    const kv_state_opts so = {.n_ctx = 64, .n_batch = 8, .n_seq = 2};
    ASSERT_EQ(kv_state_new(&sf, full, pool, &so, &d), 0);
    for (int i = 0; i < 3; i++) ASSERT_EQ(kv_state_new(&sw[i], w[i], pool, &so, &d), 0);
    /* a middle window cannot embed, a first one has no head */
    const int32_t t0 = 1;
    const uint32_t s0 = 0, o0 = 0;
    float *lg = malloc(c.n_vocab * sizeof(float) * 2), *lw = malloc(c.n_vocab * sizeof(float) * 2);
    float *x1 = malloc(8 * c.n_embd * sizeof(float)), *x2 = malloc(8 * c.n_embd * sizeof(float));
    ASSERT_EQ(kv_state_batch_window(sw[1], &t0, NULL, &s0, 1, &o0, 0, NULL, x1, &d), KV_EINVAL);
    ASSERT_EQ(kv_state_batch_window(sw[0], &t0, NULL, &s0, 1, &o0, 1, lg, NULL, &d), KV_EINVAL);
    /* a prompt chunk of sequence 0 beside a decode token of sequence 1, then steps */
    int32_t tok[6] = {3, 17, 101, 7, 256, 9};
    uint32_t seq[6] = {0, 0, 0, 0, 0, 1};
    for (int step = 0; step < 5; step++) {
        const uint32_t nt = step == 0 ? 6 : 2;
        uint32_t out[2] = {nt == 6 ? 4u : 0u, nt == 6 ? 5u : 1u};
        if (step) {
            seq[0] = 0;
            seq[1] = 1;
        }
        ASSERT_EQ(kv_state_batch(sf, tok, seq, nt, out, 2, lg, &d), 0);
        ASSERT_EQ(kv_state_batch_window(sw[0], tok, NULL, seq, nt, out, 0, NULL, x1, &d), 0);
        ASSERT_EQ(kv_state_batch_window(sw[1], NULL, x1, seq, nt, out, 0, NULL, x2, &d), 0);
        ASSERT_EQ(kv_state_batch_window(sw[2], NULL, x2, seq, nt, out, 2, lw, NULL, &d), 0);
        ASSERT_TRUE(!memcmp(lg, lw, 2 * c.n_vocab * sizeof(float)));
        /* greedy next tokens */
        for (int k = 0; k < 2; k++) {
            int best = 0;
            for (uint32_t v = 1; v < c.n_vocab; v++)
                if (lg[k * c.n_vocab + v] > lg[k * c.n_vocab + best]) best = (int)v;
            tok[k] = best;
        }
    }
    ASSERT_EQ(kv_state_pos_seq(sw[1], 0), kv_state_pos_seq(sf, 0));
    kv_state_mem mf, mm;
    kv_state_get_mem(sf, &mf);
    kv_state_get_mem(sw[1], &mm);
    ASSERT_TRUE(mm.n_attn_layers < mf.n_attn_layers || mf.n_attn_layers == 0); /* caches for its own layers only */
    free(lg);
    free(lw);
    free(x1);
    free(x2);
    kv_state_free(sf);
    for (int i = 0; i < 3; i++) kv_state_free(sw[i]);
out:
    kv_model_free(full);
    for (int i = 0; i < 3; i++) kv_model_free(w[i]);
    kv_pool_free(pool);
    unlink(path);
}

/* v4: the draft block of a request, TOKEN's spec word and drafts, HIDDEN's
 * VERIFY flag, the extension after SUBMIT's text; each against the layout
 * written out byte by byte here. */
static void test_v4_spec_frames(void) {
    static uint8_t buf[1 << 16], f[1 << 16];
    size_t n;
    kv_ring_msg m;
    kv_diag d = {0};
    const int32_t rec[3] = {5, 7, 599};
    kv_ring_params p = {.flags = KV_RING_SUBMIT_EXT | KV_RING_SUBMIT_DRAFT, .n_predict = 9, .sample = kv_sample_defaults(),
                        .draft_kind = KV_RING_DRAFT_TEST, .draft_max = 3, .draft_p = 0.7, .draft_seed = 42,
                        .n_draft_rec = 3, .draft_rec = rec};
    const int32_t toks[2] = {1, 2};
    ASSERT_EQ(kv_ring_submit_tokens_encode(buf, sizeof buf, &p, toks, 2, &n, &d), 0);
    /* params 40, u32 n, 2 tokens, the extension's 24 fixed bytes, the draft block 28 + 3 x 4 */
    ASSERT_EQ(n, KV_RING_HEADER + 40 + 4 + 8 + 24 + 28 + 12);
    const uint8_t *q = buf + KV_RING_HEADER + 40 + 4 + 8 + 24;
    ASSERT_EQ(rd32(q), KV_RING_DRAFT_TEST);
    ASSERT_EQ(rd32(q + 4), 3);
    double dp;
    const uint64_t db = rd64(q + 8);
    memcpy(&dp, &db, 8);
    ASSERT_TRUE(dp == 0.7);
    ASSERT_EQ(rd64(q + 16), 42);
    ASSERT_EQ(rd32(q + 24), 3);
    ASSERT_EQ(rd32(q + 28 + 8), 599);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_EQ(m.u.stok.p.draft_kind, KV_RING_DRAFT_TEST);
    ASSERT_EQ(m.u.stok.p.n_draft_rec, 3);
    ASSERT_EQ(kv_ring_tokens_get(m.u.stok.p.draft_rec_wire, 1), 7);
    check_truncations(buf, n);
    memcpy(f, buf, n); /* k out of range */
    wr32(f + (q - buf) + 4, 16);
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_ERANGE);
    memcpy(f, buf, n); /* an unknown source */
    wr32(f + (q - buf), 9);
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_EPROTO);
    memcpy(f, buf, n); /* DRAFT without EXT */
    wr32(f + KV_RING_HEADER, KV_RING_SUBMIT_DRAFT);
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_EPROTO);
    /* an ngram draft carries no recording; the encoder refuses k = 0 */
    p.draft_kind = KV_RING_DRAFT_NGRAM;
    p.n_draft_rec = 0;
    p.draft_p = 0;
    p.draft_seed = 0;
    ASSERT_EQ(kv_ring_submit_tokens_encode(buf, sizeof buf, &p, toks, 2, &n, &d), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 40 + 4 + 8 + 24 + 28);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    /* an mtp draft (kind 3, the tail's MTP block): the same block, no recording either */
    p.draft_kind = KV_RING_DRAFT_MTP;
    ASSERT_EQ(kv_ring_submit_tokens_encode(buf, sizeof buf, &p, toks, 2, &n, &d), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 40 + 4 + 8 + 24 + 28);
    ASSERT_EQ(rd32(q), 3);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_EQ(m.u.stok.p.draft_kind, KV_RING_DRAFT_MTP);
    memcpy(f, buf, n); /* a seed (a test source's field) with it */
    wr32(f + (q - buf) + 16, 1);
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_EPROTO);
    memcpy(f, buf, n); /* kind 4 is no source */
    wr32(f + (q - buf), 4);
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_EPROTO);
    p.draft_max = 0;
    ASSERT_EQ(kv_ring_submit_tokens_encode(buf, sizeof buf, &p, toks, 2, &n, &d), KV_ERANGE);
    p.draft_max = 2;
    /* SUBMIT (text) with the extension after the text (v4) */
    const kv_ring_submit sb = {p, "hi", 2};
    ASSERT_EQ(kv_ring_submit_encode(buf, sizeof buf, &sb, &n, &d), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 40 + 4 + 2 + 24 + 28);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_EQ(m.u.submit.text_len, 2);
    ASSERT_EQ(m.u.submit.p.draft_max, 2);
    check_truncations(buf, n);
    /* TOKEN: spec word and drafts after the logits, before the log-probability */
    kv_ring_token t = {.seq = 3, .pos = 8, .token = 4, .n_draft = 2, .spec = KV_RING_TOKEN_SPEC(0, 3, 2)};
    t.drafts[0] = 11;
    t.drafts[1] = 12;
    ASSERT_EQ(kv_ring_token_encode(buf, sizeof buf, &t, NULL, &n, &d), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 36 + 8);
    q = buf + KV_RING_HEADER;
    ASSERT_EQ(rd32(q + 28), (3u << 8) | (2u << 16));
    ASSERT_EQ(rd32(q + 32), 2);
    ASSERT_EQ(rd32(q + 36 + 4), 12);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_EQ(m.u.token.n_draft, 2);
    ASSERT_EQ(m.u.token.drafts[1], 12);
    ASSERT_EQ(KV_RING_TOKEN_ACCEPTED(m.u.token.spec), 2);
    check_truncations(buf, n);
    memcpy(f, buf, n); /* more accepted than verified */
    wr32(f + KV_RING_HEADER + 28, (1u << 8) | (2u << 16));
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_EPROTO);
    memcpy(f, buf, n); /* drafts after a token that is not the pass's last */
    wr32(f + KV_RING_HEADER + 28, KV_RING_TOKEN_MORE);
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_EPROTO);
    t.n_draft = 16;
    ASSERT_EQ(kv_ring_token_encode(buf, sizeof buf, &t, NULL, &n, &d), KV_ERANGE);
    /* HIDDEN VERIFY: with LOGITS, 2..16 tokens */
    float x[17 * 2] = {0};
    kv_ring_hidden h = {.seq = 1, .pos = 5, .n_tokens = 4, .flags = KV_RING_HIDDEN_LOGITS | KV_RING_HIDDEN_VERIFY, .n_embd = 2};
    ASSERT_EQ(kv_ring_hidden_encode(buf, sizeof buf, &h, x, &n, &d), 0);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_EQ(m.u.hidden.flags, KV_RING_HIDDEN_LOGITS | KV_RING_HIDDEN_VERIFY);
    h.flags = KV_RING_HIDDEN_VERIFY;
    ASSERT_EQ(kv_ring_hidden_encode(buf, sizeof buf, &h, x, &n, &d), 0);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_EPROTO);
    h.flags = KV_RING_HIDDEN_LOGITS | KV_RING_HIDDEN_VERIFY;
    h.n_tokens = 17;
    ASSERT_EQ(kv_ring_hidden_encode(buf, sizeof buf, &h, x, &n, &d), 0);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_EPROTO);
}

static void test_window_qwen3moe(void) { window_case("qwen3moe"); }
static void test_window_qwen35moe(void) { window_case("qwen35moe"); }

/* v5: LOOKUP (the prefix every node's prompt cache holds) and CACHED, byte
 * for byte as docs/PROTOCOL.md lays them out; bounds and canonical bits. */
static void test_v5_cache_frames(void) {
    int32_t toks[2 * 16];
    for (int i = 0; i < 32; i++) toks[i] = 7 * i + 1;
    const uint8_t bits[1] = {0x02}; /* block 1 resumable, block 0 not */
    kv_ring_lookup l = {.seq = 0x0102030405060708ull, .origin = 3, .block_tokens = 16, .n_blocks = 2, .n_match = 1};
    size_t n;
    kv_diag d = {0};
    ASSERT_EQ(kv_ring_lookup_encode(buf, sizeof buf, &l, toks, bits, &n, &d), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 24 + 4 * 32 + 1);
    ASSERT_EQ(kv_ring_lookup_size(16, 2), 24 + 4 * 32 + 1);
    ASSERT_EQ(buf[6] | buf[7] << 8, 20); /* type 20 */
    const uint8_t *q = buf + KV_RING_HEADER;
    ASSERT_EQ(rd64(q), 0x0102030405060708ull);
    ASSERT_EQ(rd32(q + 8), 3);
    ASSERT_EQ(rd32(q + 12), 16);
    ASSERT_EQ(rd32(q + 16), 2);
    ASSERT_EQ(rd32(q + 20), 1);
    ASSERT_EQ(rd32(q + 24 + 4 * 31), (uint32_t)toks[31]);
    ASSERT_EQ(q[24 + 128], 0x02);
    kv_ring_msg m;
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_EQ(m.u.lookup.n_blocks, 2);
    ASSERT_EQ(m.u.lookup.n_match, 1);
    ASSERT_EQ(kv_ring_tokens_get(m.u.lookup.tokens, 5), toks[5]);
    ASSERT_EQ(m.u.lookup.state[0], 0x02);
    check_truncations(buf, n);
    uint8_t f[KV_RING_HEADER + 24 + 4 * 32 + 1];
    memcpy(f, buf, n);
    f[KV_RING_HEADER + 24 + 128] = 0x06; /* a bit past the blocks: not canonical */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_EPROTO);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + 20, 3); /* more matched than looked up */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_ERANGE);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + 12, 4097); /* a block over the bound */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_ERANGE);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + 16, KV_RING_MAX_PROMPT); /* blocks x tokens over the prompt bound */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_ERANGE);
    memcpy(f, buf, n);
    wr32(f + KV_RING_HEADER + 24, 0xffffffffu); /* token -1 */
    ASSERT_EQ(kv_ring_decode(f, n, &m, &d), KV_ERANGE);
    l.n_match = 3;
    ASSERT_EQ(kv_ring_lookup_encode(buf, sizeof buf, &l, toks, bits, &n, &d), KV_ERANGE);
    l.n_match = 0;
    l.block_tokens = 0;
    ASSERT_EQ(kv_ring_lookup_encode(buf, sizeof buf, &l, toks, bits, &n, &d), KV_ERANGE);
    /* CACHED: u64 id, u32 n_cached */
    ASSERT_EQ(kv_ring_cached_encode(buf, sizeof buf, 0xabcdef, 64, &n, &d), 0);
    ASSERT_EQ(n, KV_RING_HEADER + 12);
    ASSERT_EQ(buf[6] | buf[7] << 8, 21);
    ASSERT_EQ(rd64(buf + KV_RING_HEADER), 0xabcdef);
    ASSERT_EQ(rd32(buf + KV_RING_HEADER + 8), 64);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), 0);
    ASSERT_EQ(m.u.cached.n_cached, 64);
    check_truncations(buf, n);
    wr32(buf + KV_RING_HEADER + 8, KV_RING_MAX_PROMPT);
    ASSERT_EQ(kv_ring_decode(buf, n, &m, &d), KV_ERANGE);
}

static const kvt_case cases[] = {
    KVT_CASE(test_header_layout), KVT_CASE(test_hello), KVT_CASE(test_hidden), KVT_CASE(test_start_submit_token),
    KVT_CASE(test_auth), KVT_CASE(test_chat_status), KVT_CASE(test_v3_frames), KVT_CASE(test_vocab_pack),
    KVT_CASE(test_v4_spec_frames), KVT_CASE(test_v5_cache_frames), KVT_CASE(test_window_qwen3moe), KVT_CASE(test_window_qwen35moe),
};

int main(int argc, char **argv) {
    snprintf(g_dir, sizeof g_dir, "%s/kv_ring_test_%d", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (int)getpid());
    mkdir(g_dir, 0755);
    int rc = kvt_run(argc, argv, cases, KVT_N(cases));
    rmdir(g_dir);
    return rc;
}
