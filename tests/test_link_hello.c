/* kv-test-labels: net attack */
/* The ClientHello classifier (include/kvasir/link_hello.h) against hellos
 * written by OpenSSL itself, the reference: a client offering "kvasir-relay"
 * (alone, first or last among others, TLS 1.3 only and 1.2-capable) is
 * RELAY; without ALPN or with other protocols (h2, http/1.1, a name that
 * only shares a prefix) it is OTHER; every strict prefix of a relay hello is
 * MORE and never RELAY; plain HTTP, SSLv2-style and random bytes are OTHER;
 * every one-byte change and every cut of a hello gives a verdict without
 * reading past its input (ASan build: no overread). */
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/link_hello.h"
#include "kvtest.h"

/* Writes into out the first flight of an OpenSSL client offering the ALPN
 * wire-format list `alpn` (NULL: none); returns its length. */
static size_t make_hello(const unsigned char *alpn, unsigned alpn_len, int max_version, uint8_t *out,
                         size_t cap) {
    SSL_CTX *c = SSL_CTX_new(TLS_client_method());
    SSL_CTX_set_max_proto_version(c, max_version);
    SSL *s = SSL_new(c);
    BIO *rb = BIO_new(BIO_s_mem()), *wb = BIO_new(BIO_s_mem());
    SSL_set_bio(s, rb, wb);
    SSL_set_tlsext_host_name(s, "hub.example");
    if (alpn) SSL_set_alpn_protos(s, alpn, alpn_len);
    SSL_set_connect_state(s);
    (void)SSL_do_handshake(s); /* wants to read: the hello sits in wb */
    int n = BIO_read(wb, out, (int)cap);
    SSL_free(s);
    SSL_CTX_free(c);
    return n > 0 ? (size_t)n : 0;
}

#define RELAY "\x0ckvasir-relay"
#define H2 "\x02h2"
#define H11 "\x08http/1.1"

static void test_openssl_hellos(void) {
    static const struct {
        const char *alpn; /* wire list, NULL: no ALPN */
        unsigned len;
        int want;
    } cases[] = {
        {RELAY, sizeof RELAY - 1, KV_HELLO_RELAY},
        {H2 RELAY, sizeof H2 RELAY - 1, KV_HELLO_RELAY},
        {RELAY H11, sizeof RELAY H11 - 1, KV_HELLO_RELAY},
        {NULL, 0, KV_HELLO_OTHER},
        {H2 H11, sizeof H2 H11 - 1, KV_HELLO_OTHER},
        {"\x0bkvasir-rela", 12, KV_HELLO_OTHER},
        {"\x0dkvasir-relayx", 14, KV_HELLO_OTHER},
    };
    int versions[] = {TLS1_3_VERSION, TLS1_2_VERSION};
    for (size_t vi = 0; vi < 2; vi++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            uint8_t buf[8192];
            size_t n = make_hello((const unsigned char *)cases[i].alpn, cases[i].len, versions[vi], buf, sizeof buf);
            ASSERT_TRUE(n > 100 && n <= KV_LINK_HELLO_MAX);
            ASSERT_EQ((int)kv_link_hello_classify(buf, n, KV_LINK_RELAY_ALPN), cases[i].want);
            /* bytes after the first record (none from a real client) change nothing */
            memset(buf + n, 0xab, 16);
            ASSERT_EQ((int)kv_link_hello_classify(buf, n + 16, KV_LINK_RELAY_ALPN), cases[i].want);
            /* each strict prefix: a valid prefix, so MORE (never a verdict on half a hello) */
            int bad = 0;
            for (size_t k = 0; k < n; k++)
                if (kv_link_hello_classify(buf, k, KV_LINK_RELAY_ALPN) != KV_HELLO_MORE) bad++;
            ASSERT_EQ(bad, 0);
        }
}

static void test_not_tls(void) {
    const char *http = "GET /v1/nodes HTTP/1.1\r\nHost: x\r\n\r\n";
    ASSERT_EQ((int)kv_link_hello_classify((const uint8_t *)http, strlen(http), KV_LINK_RELAY_ALPN), KV_HELLO_OTHER);
    ASSERT_EQ((int)kv_link_hello_classify((const uint8_t *)"G", 1, KV_LINK_RELAY_ALPN), KV_HELLO_OTHER);
    ASSERT_EQ((int)kv_link_hello_classify(NULL, 0, KV_LINK_RELAY_ALPN), KV_HELLO_MORE);
    /* SSLv2-style record, an alert record, a record too long for the cap */
    const uint8_t v2[] = {0x80, 0x2e, 0x01, 0x03, 0x01};
    const uint8_t alert[] = {0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x28};
    const uint8_t big[] = {0x16, 0x03, 0x01, 0x40, 0x00, 0x01};
    const uint8_t tiny[] = {0x16, 0x03, 0x01, 0x00, 0x00};
    const uint8_t server[] = {0x16, 0x03, 0x03, 0x00, 0x30, 0x02};
    ASSERT_EQ((int)kv_link_hello_classify(v2, sizeof v2, KV_LINK_RELAY_ALPN), KV_HELLO_OTHER);
    ASSERT_EQ((int)kv_link_hello_classify(alert, sizeof alert, KV_LINK_RELAY_ALPN), KV_HELLO_OTHER);
    ASSERT_EQ((int)kv_link_hello_classify(big, sizeof big, KV_LINK_RELAY_ALPN), KV_HELLO_OTHER);
    ASSERT_EQ((int)kv_link_hello_classify(tiny, sizeof tiny, KV_LINK_RELAY_ALPN), KV_HELLO_OTHER);
    ASSERT_EQ((int)kv_link_hello_classify(server, sizeof server, KV_LINK_RELAY_ALPN), KV_HELLO_OTHER);
    /* random bytes: a verdict, and RELAY essentially never */
    srand(7);
    int relay = 0;
    for (int t = 0; t < 20000; t++) {
        uint8_t b[64];
        size_t n = (size_t)(rand() % (int)sizeof b);
        for (size_t i = 0; i < n; i++) b[i] = (uint8_t)rand();
        if (t % 2 && n >= 3) b[0] = 0x16, b[1] = 0x03, b[2] = 0x01;
        int k = (int)kv_link_hello_classify(b, n, KV_LINK_RELAY_ALPN);
        ASSERT_TRUE(k == KV_HELLO_MORE || k == KV_HELLO_RELAY || k == KV_HELLO_OTHER);
        relay += k == KV_HELLO_RELAY;
    }
    ASSERT_EQ(relay, 0);
}

/* Every one-byte change of a relay hello, and every cut with a corrupted
 * length, gives a verdict; copies sit in exact-size heap blocks so ASan
 * catches a read past n. */
static void test_mutations(void) {
    uint8_t buf[8192];
    size_t n = make_hello((const unsigned char *)H2 RELAY, sizeof H2 RELAY - 1, TLS1_3_VERSION, buf, sizeof buf);
    ASSERT_TRUE(n > 100);
    int verdicts[3] = {0};
    for (size_t i = 0; i < n; i++)
        for (int x = 0; x < 256; x += 17) {
            uint8_t *c = malloc(n);
            memcpy(c, buf, n);
            c[i] = (uint8_t)x;
            int k = (int)kv_link_hello_classify(c, n, KV_LINK_RELAY_ALPN);
            ASSERT_TRUE(k >= 0 && k <= 2);
            verdicts[k]++;
            free(c);
        }
    ASSERT_TRUE(verdicts[KV_HELLO_OTHER] > 0 && verdicts[KV_HELLO_RELAY] > 0);
    for (size_t cut = 0; cut <= n; cut++) {
        uint8_t *c = malloc(cut ? cut : 1);
        memcpy(c, buf, cut);
        if (cut > 8) c[4] = (uint8_t)(cut - 5), c[3] = (uint8_t)((cut - 5) >> 8); /* record claims the cut */
        int k = (int)kv_link_hello_classify(c, cut, KV_LINK_RELAY_ALPN);
        ASSERT_TRUE(k >= 0 && k <= 2);
        if (cut > 8 && cut < n) ASSERT_TRUE(k == KV_HELLO_OTHER); /* the hello claims more than the record */
        free(c);
    }
}

int main(void) {
    test_openssl_hellos();
    test_not_tls();
    test_mutations();
    KV_TEST_END();
}
