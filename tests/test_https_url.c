/* kv-test-labels: unit
 * The pieces of HTTPS that need no server (include/kvasir/https.h):
 * - the pinned URL split: the path appended after the pin, either case of
 *   hex, a trailing slash, the pin's base64 against a known vector (bytes
 *   0..31), and every malformed fragment refused with a message;
 * - the loopback rule: 127/8, ::1 and v4-mapped 127/8 are loopback; the
 *   wildcards and other addresses are not, and plain HTTP there is refused;
 * - the derived certificate: one seed, one fingerprint; another seed,
 *   another; the fingerprint equals SHA-256 of the public key DER taken from
 *   the private key PEM (another path than the certificate's);
 * - certificate files: a matching pair loads with the same fingerprint; a
 *   key of another certificate, a missing file, a file that is not PEM and
 *   an oversized one are refused, naming the file;
 * - a LAN beacon carries a pinned hub URL unchanged. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/sha.h>
#include <openssl/x509.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "kvasir/beacon.h"
#include "kvasir/https.h"
#include "kvtest.h"

/* 64 hex digits of the bytes 0..31, and their base64 */
static const char HEX32[] = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
static const char B64_32[] = "sha256//AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

static void test_url_split(void) {
    char out[256], pin[KV_HTTPS_PIN_CAP], url[512];
    kv_diag d = {0};
    /* no fragment: unchanged, no pin */
    ASSERT_EQ(kv_https_url_split("http://127.0.0.1:8700/v1/market", out, sizeof out, pin, &d), 0);
    ASSERT_STREQ(out, "http://127.0.0.1:8700/v1/market");
    ASSERT_STREQ(pin, "");
    /* the pin as a hub URL, and with a path appended by a caller */
    snprintf(url, sizeof url, "https://h.example:443#sha256=%s", HEX32);
    ASSERT_EQ(kv_https_url_split(url, out, sizeof out, pin, &d), 0);
    ASSERT_STREQ(out, "https://h.example:443");
    ASSERT_STREQ(pin, B64_32);
    snprintf(url, sizeof url, "https://h.example:443#sha256=%s/v1/pieces/experts/a.gguf", HEX32);
    ASSERT_EQ(kv_https_url_split(url, out, sizeof out, pin, &d), 0);
    ASSERT_STREQ(out, "https://h.example:443/v1/pieces/experts/a.gguf");
    ASSERT_STREQ(pin, B64_32);
    /* upper-case hex and a trailing slash before the fragment */
    char up[65];
    for (int i = 0; i < 64; i++) up[i] = (char)(HEX32[i] >= 'a' ? HEX32[i] - 32 : HEX32[i]);
    up[64] = 0;
    snprintf(url, sizeof url, "https://[::1]:8700/#sha256=%s/v1/manifest", up);
    ASSERT_EQ(kv_https_url_split(url, out, sizeof out, pin, &d), 0);
    ASSERT_STREQ(out, "https://[::1]:8700/v1/manifest");
    ASSERT_STREQ(pin, B64_32);
    /* malformed: each refused with a message, outputs empty */
    static const struct {
        const char *tail, *says;
    } bad[] = {
        {"#sha256=0001", "64 hex digits"},
        {"#sha256=", "64 hex digits"},
        {"#sha1=0001", "only fragment understood"},
        {"#", "only fragment understood"},
        {"#SHA256=00", "only fragment understood"},
    };
    for (size_t i = 0; i < KVT_N(bad); i++) {
        snprintf(url, sizeof url, "https://h:1%s", bad[i].tail);
        d.msg[0] = 0;
        ASSERT_EQ(kv_https_url_split(url, out, sizeof out, pin, &d), KV_EINVAL);
        ASSERT_TRUE(strstr(d.msg, bad[i].says) != NULL);
        ASSERT_STREQ(out, "");
        ASSERT_STREQ(pin, "");
    }
    snprintf(url, sizeof url, "https://h:1#sha256=%sx", HEX32); /* 65 digits */
    ASSERT_EQ(kv_https_url_split(url, out, sizeof out, pin, &d), KV_EINVAL);
    snprintf(url, sizeof url, "https://h:1#sha256=%s/a#b", HEX32);
    ASSERT_EQ(kv_https_url_split(url, out, sizeof out, pin, &d), KV_EINVAL);
    ASSERT_TRUE(strstr(d.msg, "more than one") != NULL);
    snprintf(url, sizeof url, "http://h:1#sha256=%s", HEX32);
    ASSERT_EQ(kv_https_url_split(url, out, sizeof out, pin, &d), KV_EINVAL);
    ASSERT_TRUE(strstr(d.msg, "https://") != NULL);
    /* too long for the caller's buffer */
    snprintf(url, sizeof url, "https://h:1#sha256=%s/v1/manifest", HEX32);
    ASSERT_EQ(kv_https_url_split(url, out, 20, pin, &d), KV_EINVAL);
    ASSERT_EQ(kv_https_url_split("http://a-long-host:1", out, 8, pin, &d), KV_EINVAL);
}

static bool kvt_loop(const char *host) {
    struct sockaddr_storage ss = {0};
    if (inet_pton(AF_INET, host, &((struct sockaddr_in *)&ss)->sin_addr) == 1)
        ss.ss_family = AF_INET;
    else if (inet_pton(AF_INET6, host, &((struct sockaddr_in6 *)&ss)->sin6_addr) == 1)
        ss.ss_family = AF_INET6;
    else
        KVT_FAIL("bad test address %s", host);
    return kv_https_addr_is_loopback((struct sockaddr *)&ss);
}

static void test_loopback(void) {
    ASSERT_TRUE(kvt_loop("127.0.0.1"));
    ASSERT_TRUE(kvt_loop("127.255.3.4"));
    ASSERT_TRUE(kvt_loop("::1"));
    ASSERT_TRUE(kvt_loop("::ffff:127.0.0.1"));
    ASSERT_TRUE(!kvt_loop("0.0.0.0"));
    ASSERT_TRUE(!kvt_loop("::"));
    ASSERT_TRUE(!kvt_loop("10.0.0.1"));
    ASSERT_TRUE(!kvt_loop("128.0.0.1"));
    ASSERT_TRUE(!kvt_loop("::ffff:10.0.0.1"));
    ASSERT_TRUE(!kvt_loop("::2"));
    kv_diag d = {0};
    ASSERT_EQ(kv_https_listen_check_host("127.0.0.1", false, false, "gateway", &d), 0);
    ASSERT_EQ(kv_https_listen_check_host("0.0.0.0", true, false, "gateway", &d), 0);
    ASSERT_EQ(kv_https_listen_check_host("0.0.0.0", false, true, "gateway", &d), 0);
    ASSERT_EQ(kv_https_listen_check_host("0.0.0.0", false, false, "gateway", &d), KV_EINVAL);
    ASSERT_TRUE(strstr(d.msg, "gateway: refusing to serve plain HTTP on 0.0.0.0") != NULL);
    ASSERT_TRUE(strstr(d.msg, "--insecure-plaintext") != NULL && strstr(d.msg, "--tls-cert") != NULL);
    ASSERT_EQ(kv_https_listen_check_host("2001:db8::1", false, false, "hub", &d), KV_EINVAL);
    ASSERT_TRUE(strstr(d.msg, "2001:db8::1") != NULL);
}

/* SHA-256 of the public key DER, taken from the private key PEM. */
static void kvt_fp_from_key(const char *key_pem, char hex[65]) {
    BIO *b = BIO_new_mem_buf(key_pem, -1);
    EVP_PKEY *k = PEM_read_bio_PrivateKey(b, NULL, NULL, NULL);
    unsigned char *der = NULL;
    int n = k ? i2d_PUBKEY(k, &der) : -1;
    hex[0] = 0;
    if (n > 0) {
        uint8_t h[32];
        SHA256(der, (size_t)n, h);
        for (int i = 0; i < 32; i++) snprintf(hex + 2 * i, 3, "%02x", h[i]);
    }
    OPENSSL_free(der);
    EVP_PKEY_free(k);
    BIO_free(b);
}

static void test_derive(void) {
    uint8_t s1[32] = {1}, s2[32] = {2};
    kv_https_cert a, b, c;
    kv_diag d = {0};
    ASSERT_EQ(kv_https_cert_derive(&a, s1, "kvasir hub", &d), 0);
    ASSERT_EQ(kv_https_cert_derive(&b, s1, "kvasir hub", &d), 0);
    ASSERT_EQ(kv_https_cert_derive(&c, s2, "kvasir hub", &d), 0);
    ASSERT_EQ(strlen(a.fp), 64);
    ASSERT_STREQ(a.fp, b.fp); /* one seed, one key */
    ASSERT_TRUE(strcmp(a.fp, c.fp) != 0);
    char ref[65];
    kvt_fp_from_key(a.key_pem, ref);
    ASSERT_STREQ(a.fp, ref);
    char again[65];
    ASSERT_EQ(kv_https_fingerprint(a.cert_pem, again, &d), 0);
    ASSERT_STREQ(again, a.fp);
    ASSERT_EQ(kv_https_fingerprint("not a certificate", again, &d), KV_EFORMAT);
    ASSERT_TRUE(strstr(a.key_pem, "PRIVATE KEY") != NULL);
    kv_https_cert_clear(&a);
    ASSERT_TRUE(a.cert_pem == NULL && a.key_pem == NULL && !a.fp[0]);
    kv_https_cert_clear(&a); /* twice is fine */
    kv_https_cert_clear(NULL);
    kv_https_cert_clear(&b);
    kv_https_cert_clear(&c);
}

static void kvt_write(const char *path, const char *s, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) KVT_FAIL("cannot write %s", path);
    fwrite(s, 1, n, f);
    fclose(f);
}

static void test_load(void) {
    char dir[] = "/tmp/kvt_https.XXXXXX";
    if (!mkdtemp(dir)) KVT_FAIL("mkdtemp");
    char cert[300], key[300], key2[300], junk[300], big[300], none[300];
    snprintf(cert, sizeof cert, "%s/c.pem", dir);
    snprintf(key, sizeof key, "%s/k.pem", dir);
    snprintf(key2, sizeof key2, "%s/k2.pem", dir);
    snprintf(junk, sizeof junk, "%s/junk.pem", dir);
    snprintf(big, sizeof big, "%s/big.pem", dir);
    snprintf(none, sizeof none, "%s/none.pem", dir);
    uint8_t s1[32] = {7}, s2[32] = {8};
    kv_https_cert a, b, l;
    kv_diag d = {0};
    ASSERT_EQ(kv_https_cert_derive(&a, s1, "one", &d), 0);
    ASSERT_EQ(kv_https_cert_derive(&b, s2, "two", &d), 0);
    kvt_write(cert, a.cert_pem, strlen(a.cert_pem));
    kvt_write(key, a.key_pem, strlen(a.key_pem));
    kvt_write(key2, b.key_pem, strlen(b.key_pem));
    kvt_write(junk, "hello\n", 6);
    char *pad = calloc(1, KV_HTTPS_MAX_PEM + 10);
    memset(pad, 'A', KV_HTTPS_MAX_PEM + 9);
    kvt_write(big, pad, KV_HTTPS_MAX_PEM + 9);
    free(pad);
    ASSERT_EQ(kv_https_cert_load(&l, cert, key, &d), 0);
    ASSERT_STREQ(l.fp, a.fp);
    kv_https_cert_clear(&l);
    ASSERT_EQ(kv_https_cert_load(&l, cert, key2, &d), KV_EINVAL);
    ASSERT_TRUE(strstr(d.msg, "is not the key of the certificate") != NULL && strstr(d.msg, key2) != NULL);
    ASSERT_TRUE(l.cert_pem == NULL && l.key_pem == NULL);
    ASSERT_EQ(kv_https_cert_load(&l, none, key, &d), KV_EIO);
    ASSERT_TRUE(strstr(d.msg, "--tls-cert") != NULL && strstr(d.msg, none) != NULL);
    ASSERT_EQ(kv_https_cert_load(&l, junk, key, &d), KV_EFORMAT);
    ASSERT_TRUE(strstr(d.msg, "no PEM certificate") != NULL);
    ASSERT_EQ(kv_https_cert_load(&l, cert, junk, &d), KV_EFORMAT);
    ASSERT_TRUE(strstr(d.msg, "--tls-key") != NULL);
    ASSERT_EQ(kv_https_cert_load(&l, big, key, &d), KV_EFORMAT);
    ASSERT_TRUE(strstr(d.msg, "at most") != NULL);
    kv_https_cert_clear(&a);
    kv_https_cert_clear(&b);
    const char *files[] = {cert, key, key2, junk, big};
    for (size_t i = 0; i < KVT_N(files); i++) unlink(files[i]);
    rmdir(dir);
}

static void test_beacon_pinned(void) {
    kv_beacon_msg m = {0}, p;
    snprintf(m.model_id, sizeof m.model_id, "%s", HEX32);
    snprintf(m.url, sizeof m.url, "https://0.0.0.0:8700#sha256=%s", HEX32);
    uint8_t buf[KV_BEACON_MAX_SIZE];
    size_t n = 0;
    kv_diag d = {0};
    ASSERT_EQ(kv_beacon_encode(&m, buf, sizeof buf, &n, &d), 0);
    ASSERT_EQ(kv_beacon_parse(buf, n, &p, &d), 0);
    ASSERT_STREQ(p.url, m.url);
}

static const kvt_case cases[] = {KVT_CASE(test_url_split), KVT_CASE(test_loopback), KVT_CASE(test_derive),
                                 KVT_CASE(test_load), KVT_CASE(test_beacon_pinned)};
int main(int argc, char **argv) { return kvt_run(argc, argv, cases, KVT_N(cases)); }
