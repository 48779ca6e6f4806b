/* kv-test-labels: unit net
 * The LAN beacon (include/kvasir/beacon.h): the datagram against one built
 * byte by byte from the layout in the header comment; every malformed
 * variant refused with a message; the sender heard by two listeners on one
 * loopback port (127.255.255.255 broadcast); the model filter; a 0.0.0.0
 * host completed with the sender's address; a bounded wait that times out
 * with a clear error. Ports are derived from the pid so that concurrent
 * runs do not hear each other. */
#include <pthread.h>
#include <unistd.h>

#include "kvasir/beacon.h"
#include "kvtest.h"

static const char *ID = "f4a431ce292dbd5945c190c66add1736574a9387e0b2288c2fed91aa9c692d0d";
static const char *ID2 = "0000000000000000000000000000000000000000000000000000000000000001";

static uint16_t kvt_port(int k) { return (uint16_t)(20000 + (getpid() * 7 + k) % 30000); }

/* The datagram written from the documented layout, independently of the encoder. */
static size_t kvt_reference(uint8_t *b, const char *id, const char *url) {
    const size_t ul = strlen(url);
    b[0] = 'K', b[1] = 'V', b[2] = 'B', b[3] = '1'; /* 0x3142564B little-endian */
    b[4] = 1, b[5] = 0;
    b[6] = (uint8_t)ul, b[7] = (uint8_t)(ul >> 8);
    memcpy(b + 8, id, 64);
    memcpy(b + 72, url, ul);
    return 72 + ul;
}

static void test_layout(void) {
    kv_beacon_msg m = {0}, p;
    snprintf(m.model_id, sizeof m.model_id, "%s", ID);
    snprintf(m.url, sizeof m.url, "http://127.0.0.1:8700");
    uint8_t a[KV_BEACON_MAX_SIZE], b[KV_BEACON_MAX_SIZE];
    size_t n = 0;
    kv_diag d = {0};
    ASSERT_EQ(kv_beacon_encode(&m, a, sizeof a, &n, &d), 0);
    const size_t rn = kvt_reference(b, ID, m.url);
    ASSERT_EQ(n, rn);
    ASSERT_TRUE(!memcmp(a, b, n));
    ASSERT_EQ(kv_beacon_parse(b, rn, &p, &d), 0);
    ASSERT_STREQ(p.model_id, ID);
    ASSERT_STREQ(p.url, "http://127.0.0.1:8700");
    /* too small a buffer */
    ASSERT_EQ(kv_beacon_encode(&m, a, 50, &n, &d), KV_ERANGE);
    /* the encoder refuses what the parser would */
    kv_beacon_msg bad = m;
    snprintf(bad.url, sizeof bad.url, "ftp://x");
    ASSERT_EQ(kv_beacon_encode(&bad, a, sizeof a, &n, &d), KV_EINVAL);
    bad = m;
    bad.model_id[3] = 'G';
    ASSERT_EQ(kv_beacon_encode(&bad, a, sizeof a, &n, &d), KV_EINVAL);
}

static void test_malformed(void) {
    uint8_t b[KV_BEACON_MAX_SIZE + 8], c[sizeof b];
    const size_t n = kvt_reference(b, ID, "http://127.0.0.1:8700");
    kv_beacon_msg p;
    kv_diag d = {0};
    /* every truncation */
    for (size_t k = 0; k < n; k++) {
        d.msg[0] = 0;
        ASSERT_TRUE(kv_beacon_parse(b, k, &p, &d) < 0);
        ASSERT_TRUE(d.msg[0] != 0);
        ASSERT_EQ(p.url[0], 0);
    }
    /* one byte more than url_len says */
    memcpy(c, b, n);
    c[n] = 'x';
    ASSERT_EQ(kv_beacon_parse(c, n + 1, &p, &d), KV_EFORMAT);
    /* wrong magic, version, length field, id, URL scheme, URL byte */
    struct { size_t off; uint8_t v; int rc; } muts[] = {
        {0, 'X', KV_EFORMAT}, {4, 2, KV_EUNSUPPORTED}, {5, 1, KV_EUNSUPPORTED}, {6, 0, KV_EFORMAT},
        {7, 1, KV_EFORMAT}, {8, 'A', KV_EFORMAT}, {71, ' ', KV_EFORMAT}, {72, 'f', KV_EFORMAT},
        {80, ' ', KV_EFORMAT}, {80, 0, KV_EFORMAT}, {n - 1, '"', KV_EFORMAT}, {n - 1, 0xff, KV_EFORMAT},
    };
    for (size_t i = 0; i < sizeof muts / sizeof muts[0]; i++) {
        memcpy(c, b, n);
        c[muts[i].off] = muts[i].v;
        d.msg[0] = 0;
        ASSERT_EQ(kv_beacon_parse(c, n, &p, &d), muts[i].rc);
        ASSERT_TRUE(d.msg[0] != 0);
    }
    /* a URL of only a scheme; the longest URL; one longer */
    size_t k = kvt_reference(c, ID, "http://");
    ASSERT_EQ(kv_beacon_parse(c, k, &p, &d), KV_EFORMAT);
    char url[KV_BEACON_MAX_URL + 2];
    memset(url, 'a', sizeof url);
    memcpy(url, "http://", 7);
    url[KV_BEACON_MAX_URL] = 0;
    k = kvt_reference(c, ID, url);
    ASSERT_EQ(kv_beacon_parse(c, k, &p, &d), 0);
    ASSERT_EQ(strlen(p.url), KV_BEACON_MAX_URL);
    url[KV_BEACON_MAX_URL] = 'a';
    url[KV_BEACON_MAX_URL + 1] = 0;
    k = kvt_reference(c, ID, url);
    ASSERT_EQ(kv_beacon_parse(c, k, &p, &d), KV_EFORMAT);
}

typedef struct {
    uint16_t port;
    const char *want;
    int rc;
    kv_beacon_msg m;
} kvt_listener;

static void *kvt_listen(void *arg) {
    kvt_listener *l = arg;
    kv_diag d = {0};
    l->rc = kv_beacon_wait(l->port, 5000, l->want, &l->m, NULL, &d);
    return NULL;
}

static void test_send_and_hear(void) {
    const uint16_t port = kvt_port(0);
    kvt_listener ls[3] = {{.port = port, .rc = -99}, {.port = port, .rc = -99}, {.port = port, .want = ID2, .rc = -99}};
    pthread_t th[3];
    for (int i = 0; i < 3; i++) pthread_create(&th[i], NULL, kvt_listen, &ls[i]);
    usleep(100000); /* the listeners bind first; the sender repeats anyway */
    kv_beacon_opts o = {.to = "127.255.255.255", .port = port, .interval_ms = 50};
    snprintf(o.msg.model_id, sizeof o.msg.model_id, "%s", ID);
    snprintf(o.msg.url, sizeof o.msg.url, "http://0.0.0.0:8700");
    kv_beacon *b = NULL, *b2 = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_beacon_start(&b, &o, &d), 0);
    /* a second hub of another model, for the filtering listener */
    kv_beacon_opts o2 = o;
    snprintf(o2.msg.model_id, sizeof o2.msg.model_id, "%s", ID2);
    snprintf(o2.msg.url, sizeof o2.msg.url, "http://127.0.0.1:9999");
    usleep(300000);
    ASSERT_EQ(kv_beacon_start(&b2, &o2, &d), 0);
    for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++) {
        ASSERT_EQ(ls[i].rc, 0);
        ASSERT_STREQ(ls[i].m.model_id, ID);
        ASSERT_STREQ(ls[i].m.url, "http://127.0.0.1:8700"); /* 0.0.0.0 -> the sender's address */
    }
    ASSERT_EQ(ls[2].rc, 0);
    ASSERT_STREQ(ls[2].m.model_id, ID2);
    ASSERT_STREQ(ls[2].m.url, "http://127.0.0.1:9999");
    ASSERT_TRUE(kv_beacon_sent(b) >= 2);
    kv_beacon_free(b);
    kv_beacon_free(b2);
    kv_beacon_free(NULL);
    /* a bad destination is an error at start */
    o.to = "not-an-ip";
    ASSERT_EQ(kv_beacon_start(&b, &o, &d), KV_EINVAL);
    ASSERT_TRUE(b == NULL);
}

static void test_timeout(void) {
    kv_beacon_msg m;
    kv_diag d = {0};
    ASSERT_EQ(kv_beacon_wait(kvt_port(1), 200, NULL, &m, NULL, &d), KV_ETIMEOUT);
    ASSERT_TRUE(strstr(d.msg, "no hub beacon") != NULL);
    ASSERT_TRUE(strstr(d.msg, "--hub") != NULL);
    char url[256];
    ASSERT_EQ(kv_beacon_find_hub(kvt_port(1), 200, ID, url, sizeof url, &d), KV_ETIMEOUT);
    ASSERT_TRUE(strstr(d.msg, "200 ms") != NULL);
}

static const kvt_case cases[] = {KVT_CASE(test_layout), KVT_CASE(test_malformed), KVT_CASE(test_send_and_hear),
                                 KVT_CASE(test_timeout)};
int main(int argc, char **argv) { return kvt_run(argc, argv, cases, KVT_N(cases)); }
