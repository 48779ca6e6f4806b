/* Certificates, fingerprints, pinned URLs and the loopback rule of the
 * HTTPS servers (include/kvasir/https.h), on OpenSSL's libcrypto.
 *
 * A derived key: d = (SHA-512("kvasir https p256 v1" || seed) mod (n - 1))
 * + 1 on P-256 (n its group order), so a hub whose identity seed is kept in
 * its store serves the same key, and so the same fingerprint, at every
 * start and from every hub process on one store. The certificate around it
 * is made anew at each start; only its key is pinned. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/core_names.h>
#include <openssl/ec.h>
#include <openssl/evp.h>
#include <openssl/obj_mac.h>
#include <openssl/param_build.h>
#include <openssl/pem.h>
#include <openssl/sha.h>
#include <openssl/x509.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/https.h"
#include "kvasir/link.h" /* kv_unhex */

/* The fingerprint of a parsed certificate (computed where the link layer
 * computes it: kv_tls_fingerprint_der, include/kvasir/tls.h). */
static int kv_https_fp_x509(X509 *x, char hex[KV_HTTPS_FP_HEX + 1], kv_diag *d) {
    unsigned char *der = NULL;
    int n = i2d_X509(x, &der);
    if (n <= 0) return kv_fail(d, KV_EFORMAT, "tls: the certificate cannot be encoded");
    int rc = kv_tls_fingerprint_der(der, (size_t)n, hex, d);
    OPENSSL_free(der);
    return rc;
}

int kv_https_fingerprint(const char *cert_pem, char hex[KV_HTTPS_FP_HEX + 1], kv_diag *d) {
    hex[0] = 0;
    BIO *b = BIO_new_mem_buf(cert_pem, -1);
    if (!b) return kv_fail(d, KV_ENOMEM, "tls: out of memory");
    X509 *x = PEM_read_bio_X509(b, NULL, NULL, NULL);
    BIO_free(b);
    if (!x) return kv_fail(d, KV_EFORMAT, "tls: no PEM certificate found");
    int rc = kv_https_fp_x509(x, hex, d);
    X509_free(x);
    return rc;
}

void kv_https_cert_clear(kv_https_cert *c) {
    if (!c) return;
    free(c->cert_pem);
    if (c->key_pem) {
        OPENSSL_cleanse(c->key_pem, strlen(c->key_pem));
        free(c->key_pem);
    }
    memset(c, 0, sizeof *c);
}

/* A whole file of at most KV_HTTPS_MAX_PEM bytes, NUL-terminated. */
static int kv_https_read_file(const char *path, const char *what, char **out, kv_diag *d) {
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return kv_fail(d, KV_EIO, "%s: cannot open '%s': %s", what, path, strerror(errno));
    char *p = malloc(KV_HTTPS_MAX_PEM + 1);
    if (!p) {
        fclose(f);
        return kv_fail(d, KV_ENOMEM, "%s: out of memory", what);
    }
    size_t n = fread(p, 1, KV_HTTPS_MAX_PEM + 1, f);
    int err = ferror(f);
    fclose(f);
    if (err || n > KV_HTTPS_MAX_PEM || memchr(p, 0, n)) {
        OPENSSL_cleanse(p, n);
        free(p);
        if (err) return kv_fail(d, KV_EIO, "%s: cannot read '%s'", what, path);
        return kv_fail(d, KV_EFORMAT, "%s: '%s' is not a PEM file of at most %u bytes", what, path, KV_HTTPS_MAX_PEM);
    }
    p[n] = 0;
    *out = p;
    return 0;
}

int kv_https_cert_load(kv_https_cert *c, const char *cert_path, const char *key_path, kv_diag *d) {
    memset(c, 0, sizeof *c);
    int rc;
    if ((rc = kv_https_read_file(cert_path, "--tls-cert", &c->cert_pem, d)) ||
        (rc = kv_https_read_file(key_path, "--tls-key", &c->key_pem, d))) {
        kv_https_cert_clear(c);
        return rc;
    }
    BIO *cb = BIO_new_mem_buf(c->cert_pem, -1), *kb = BIO_new_mem_buf(c->key_pem, -1);
    X509 *x = cb ? PEM_read_bio_X509(cb, NULL, NULL, NULL) : NULL;
    EVP_PKEY *k = kb ? PEM_read_bio_PrivateKey(kb, NULL, NULL, NULL) : NULL;
    if (!x)
        rc = kv_fail(d, KV_EFORMAT, "--tls-cert: '%s' holds no PEM certificate", cert_path);
    else if (!k)
        rc = kv_fail(d, KV_EFORMAT, "--tls-key: '%s' holds no unencrypted PEM private key", key_path);
    else if (X509_check_private_key(x, k) != 1)
        rc = kv_fail(d, KV_EINVAL, "--tls-key: '%s' is not the key of the certificate in '%s'", key_path, cert_path);
    else
        rc = kv_https_fp_x509(x, c->fp, d);
    EVP_PKEY_free(k);
    X509_free(x);
    BIO_free(cb);
    BIO_free(kb);
    if (rc) kv_https_cert_clear(c);
    return rc;
}

/* The P-256 key derived from seed (see the file comment). */
static EVP_PKEY *kv_https_p256(const uint8_t seed[32]) {
    static const char label[] = "kvasir https p256 v1";
    uint8_t in[sizeof label - 1 + 32], h[SHA512_DIGEST_LENGTH], pub[65];
    memcpy(in, label, sizeof label - 1);
    memcpy(in + sizeof label - 1, seed, 32);
    SHA512(in, sizeof in, h);
    OPENSSL_cleanse(in, sizeof in);
    EVP_PKEY *pk = NULL;
    EC_GROUP *g = EC_GROUP_new_by_curve_name(NID_X9_62_prime256v1);
    BN_CTX *bc = BN_CTX_new();
    BIGNUM *x = BN_bin2bn(h, sizeof h, NULL), *n1 = g ? BN_dup(EC_GROUP_get0_order(g)) : NULL;
    EC_POINT *P = g ? EC_POINT_new(g) : NULL;
    OSSL_PARAM_BLD *pb = OSSL_PARAM_BLD_new();
    OSSL_PARAM *params = NULL;
    EVP_PKEY_CTX *pc = NULL;
    if (!g || !bc || !x || !n1 || !P || !pb) goto out;
    if (!BN_sub_word(n1, 1) || !BN_mod(x, x, n1, bc) || !BN_add_word(x, 1)) goto out;
    if (!EC_POINT_mul(g, P, x, NULL, NULL, bc) ||
        EC_POINT_point2oct(g, P, POINT_CONVERSION_UNCOMPRESSED, pub, sizeof pub, bc) != sizeof pub)
        goto out;
    if (!OSSL_PARAM_BLD_push_utf8_string(pb, OSSL_PKEY_PARAM_GROUP_NAME, "prime256v1", 0) ||
        !OSSL_PARAM_BLD_push_BN(pb, OSSL_PKEY_PARAM_PRIV_KEY, x) ||
        !OSSL_PARAM_BLD_push_octet_string(pb, OSSL_PKEY_PARAM_PUB_KEY, pub, sizeof pub) ||
        !(params = OSSL_PARAM_BLD_to_param(pb)))
        goto out;
    if (!(pc = EVP_PKEY_CTX_new_from_name(NULL, "EC", NULL)) || EVP_PKEY_fromdata_init(pc) != 1 ||
        EVP_PKEY_fromdata(pc, &pk, EVP_PKEY_KEYPAIR, params) != 1)
        pk = NULL;
out:
    OPENSSL_cleanse(h, sizeof h);
    EVP_PKEY_CTX_free(pc);
    OSSL_PARAM_free(params);
    OSSL_PARAM_BLD_free(pb);
    EC_POINT_free(P);
    BN_clear_free(x);
    BN_free(n1);
    BN_CTX_free(bc);
    EC_GROUP_free(g);
    return pk;
}

/* The bytes a memory BIO holds, as a malloc'd NUL-terminated string. */
static char *kv_https_bio_str(BIO *b) {
    char *p = NULL;
    long n = BIO_get_mem_data(b, &p);
    if (n <= 0) return NULL;
    char *s = malloc((size_t)n + 1);
    if (!s) return NULL;
    memcpy(s, p, (size_t)n);
    s[n] = 0;
    return s;
}

int kv_https_cert_derive(kv_https_cert *c, const uint8_t seed[32], const char *cn, kv_diag *d) {
    memset(c, 0, sizeof *c);
    int rc = KV_EINTERNAL;
    EVP_PKEY *pk = kv_https_p256(seed);
    X509 *x = X509_new();
    BIO *cb = BIO_new(BIO_s_mem()), *kb = BIO_new(BIO_s_mem());
    X509_NAME *nm = x ? X509_get_subject_name(x) : NULL;
    uint8_t serial[16];
    SHA256((const uint8_t *)cn, strlen(cn), serial); /* any positive serial: the pin is on the key */
    serial[0] &= 0x7f;
    serial[0] |= 0x40;
    BIGNUM *sn = BN_bin2bn(serial, sizeof serial, NULL);
    if (!pk || !x || !cb || !kb || !nm || !sn) goto out;
    if (!X509_set_version(x, 2) || !BN_to_ASN1_INTEGER(sn, X509_get_serialNumber(x)) ||
        !X509_gmtime_adj(X509_getm_notBefore(x), -86400L) ||
        !X509_time_adj_ex(X509_getm_notAfter(x), 3650, 0, NULL) ||
        !X509_NAME_add_entry_by_txt(nm, "CN", MBSTRING_ASC, (const unsigned char *)cn, -1, -1, 0) ||
        !X509_set_issuer_name(x, nm) || !X509_set_pubkey(x, pk) || !X509_sign(x, pk, EVP_sha256()))
        goto out;
    if (!PEM_write_bio_X509(cb, x) || !PEM_write_bio_PrivateKey(kb, pk, NULL, NULL, 0, NULL, NULL)) goto out;
    if (!(c->cert_pem = kv_https_bio_str(cb)) || !(c->key_pem = kv_https_bio_str(kb))) goto out;
    rc = kv_https_fp_x509(x, c->fp, d);
out:
    if (rc == KV_EINTERNAL) kv_fail(d, rc, "tls: cannot make a self-signed certificate (OpenSSL failed)");
    if (rc) kv_https_cert_clear(c);
    BN_free(sn);
    BIO_free(cb);
    BIO_free(kb);
    X509_free(x);
    EVP_PKEY_free(pk);
    return rc;
}

bool kv_https_addr_is_loopback(const struct sockaddr *sa) {
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *s = (const struct sockaddr_in *)sa;
        return (ntohl(s->sin_addr.s_addr) >> 24) == 127;
    }
    if (sa->sa_family == AF_INET6) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        if (IN6_IS_ADDR_LOOPBACK(a)) return true;
        return IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127;
    }
    return false;
}

int kv_https_url_split(const char *url, char *out, size_t cap, char pin[KV_HTTPS_PIN_CAP], kv_diag *d) {
    static const char tag[] = "#sha256=";
    pin[0] = 0;
    if (cap) out[0] = 0;
    const char *hash = strchr(url, '#');
    size_t ul = strlen(url);
    if (!hash) {
        if (ul >= cap) return kv_fail(d, KV_EINVAL, "URL '%.100s...' is longer than %zu bytes", url, cap - 1);
        memcpy(out, url, ul + 1);
        return 0;
    }
    size_t bl = (size_t)(hash - url);
    if (strncmp(hash, tag, sizeof tag - 1))
        return kv_fail(d, KV_EINVAL, "URL '%.200s': the only fragment understood is #sha256=<64 hex digits>", url);
    const char *hx = hash + sizeof tag - 1;
    uint8_t fp[32];
    if (strnlen(hx, 64) < 64 || kv_unhex(hx, 64, fp, sizeof fp, true))
        return kv_fail(d, KV_EINVAL, "URL '%.200s': #sha256= needs 64 hex digits (the hub's 'tls sha256:' line)", url);
    const char *rest = hx + 64;
    if (*rest && *rest != '/')
        return kv_fail(d, KV_EINVAL, "URL '%.200s': #sha256= needs exactly 64 hex digits", url);
    if (strchr(rest, '#')) return kv_fail(d, KV_EINVAL, "URL '%.200s': more than one '#'", url);
    if (strncmp(url, "https://", 8))
        return kv_fail(d, KV_EINVAL, "URL '%.200s': a #sha256= pin needs an https:// URL", url);
    if (*rest && bl && url[bl - 1] == '/') bl--; /* "https://h:p/#sha256=..." + "/v1/x" */
    size_t rl = strlen(rest);
    if (bl + rl >= cap) return kv_fail(d, KV_EINVAL, "URL '%.100s...' is longer than %zu bytes", url, cap - 1);
    memcpy(out, url, bl);
    memcpy(out + bl, rest, rl + 1);
    memcpy(pin, "sha256//", 8);
    EVP_EncodeBlock((unsigned char *)pin + 8, fp, sizeof fp); /* 44 characters and a NUL */
    return 0;
}

int kv_https_listen_check(const struct sockaddr *sa, bool tls, bool insecure, const char *who, kv_diag *d) {
    if (tls || insecure || kv_https_addr_is_loopback(sa)) return 0;
    char host[INET6_ADDRSTRLEN] = "?";
    if (sa->sa_family == AF_INET)
        inet_ntop(AF_INET, &((const struct sockaddr_in *)sa)->sin_addr, host, sizeof host);
    else if (sa->sa_family == AF_INET6)
        inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)sa)->sin6_addr, host, sizeof host);
    return kv_fail(d, KV_EINVAL,
                   "%s: refusing to serve plain HTTP on %s, which is not a loopback address: give "
                   "--tls-cert FILE --tls-key FILE, or --insecure-plaintext to accept an unencrypted API",
                   who, host);
}

int kv_https_listen_check_host(const char *host, bool tls, bool insecure, const char *who, kv_diag *d) {
    struct sockaddr_storage ss = {0};
    struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
    if (inet_pton(AF_INET, host, &s4->sin_addr) == 1)
        ss.ss_family = AF_INET;
    else if (inet_pton(AF_INET6, host, &s6->sin6_addr) == 1)
        ss.ss_family = AF_INET6;
    else
        return 0;
    return kv_https_listen_check((const struct sockaddr *)&ss, tls, insecure, who, d);
}
