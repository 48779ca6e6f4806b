/* Canonical byte formats of what the ledger accepts signed (docs/LEDGER.md):
 * payment authorizations, work receipts, issuance orders, and the wallet key
 * file. Each format is fixed-size, little-endian, starts with a 4-byte magic
 * and a version byte (the magic separates the signing domains, so a receipt
 * can never be read as an authorization), and is signed with Ed25519 over
 * its body. Parsers take (pointer, length) from strangers: every length is
 * checked exactly, every reserved byte must be zero, every field within its
 * bounds, before the signature is verified; nothing is read past n. */
#include <errno.h>
#include <fcntl.h>
#include <sodium.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvasir/ledger.h"
#include "kvasir/link.h"
#include "ledger/ledger_internal.h"

#define KV_KEYFILE_TAG "kvasir-ed25519-v1 "
#define KV_AUTH_PREFIX "kvr1."

int kv_sodium_ready(kv_diag *d) {
    if (sodium_init() < 0) return kv_fail(d, KV_EINTERNAL, "libsodium failed to initialize");
    return 0;
}

static void kv_put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint64_t kv_get_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

int kv_unhex32(const char *s, uint8_t out[32], kv_diag *d) {
    if (!s || kv_unhex(s, strnlen(s, 65), out, 32, true))
        return kv_fail(d, KV_EFORMAT, "a key is 64 hex digits");
    return 0;
}

/* ---- gateway ids ---------------------------------------------------------- */
int kv_gateway_id_ok(const char *g, kv_diag *d) {
    size_t n = g ? strnlen(g, KV_GATEWAY_ID_MAX + 1) : 0;
    if (n == 0 || n > KV_GATEWAY_ID_MAX)
        return kv_fail(d, KV_EINVAL, "gateway id must be 1..%d bytes", KV_GATEWAY_ID_MAX);
    for (size_t i = 0; i < n; i++) {
        char c = g[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
              c == '_' || c == '-' || c == ':'))
            return kv_fail(d, KV_EINVAL, "gateway id has a byte 0x%02x outside [A-Za-z0-9._:-]",
                           (unsigned)(unsigned char)c);
    }
    return 0;
}
static int kv_gateway_get(const uint8_t *p, char out[KV_GATEWAY_ID_MAX + 1], kv_diag *d) {
    size_t n = 0;
    while (n < KV_GATEWAY_ID_MAX && p[n]) n++;
    for (size_t i = n; i < KV_GATEWAY_ID_MAX; i++)
        if (p[i]) return kv_fail(d, KV_EFORMAT, "gateway id padding is not zero");
    memcpy(out, p, n);
    out[n] = 0;
    if (kv_gateway_id_ok(out, d)) return KV_EFORMAT;
    return 0;
}

static void kv_header_put(uint8_t *p, const char magic[4]) {
    memcpy(p, magic, 4);
    p[4] = 1;
    p[5] = p[6] = p[7] = 0;
}
static int kv_header_get(const uint8_t *p, const char magic[4], const char *what, kv_diag *d) {
    if (memcmp(p, magic, 4)) return kv_fail(d, KV_EFORMAT, "%s: bad magic", what);
    if (p[4] != 1) return kv_fail(d, KV_EFORMAT, "%s: unsupported version %u", what, p[4]);
    if (p[5] | p[6] | p[7]) return kv_fail(d, KV_EFORMAT, "%s: reserved bytes are not zero", what);
    return 0;
}

/* ---- wallets -------------------------------------------------------------- */
int kv_wallet_generate(kv_wallet *w, kv_diag *d) {
    if (kv_sodium_ready(d)) return KV_EINTERNAL;
    crypto_sign_keypair(w->pk, w->sk);
    return 0;
}

int kv_wallet_save(const kv_wallet *w, const char *path, kv_diag *d) {
    char buf[128], hex[65];
    kv_hex(w->sk, 32, hex); /* the first 32 bytes of a libsodium secret key are the seed */
    int n = snprintf(buf, sizeof buf, "%s%s\n", KV_KEYFILE_TAG, hex);
    sodium_memzero(hex, sizeof hex);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        sodium_memzero(buf, sizeof buf);
        return kv_fail(d, KV_EIO, "key file '%s': %s", path, strerror(errno));
    }
    ssize_t wr = write(fd, buf, (size_t)n);
    sodium_memzero(buf, sizeof buf);
    int ok = wr == n && fsync(fd) == 0;
    int e = errno;
    close(fd);
    if (!ok) {
        unlink(path);
        return kv_fail(d, KV_EIO, "key file '%s': write failed: %s", path, strerror(e));
    }
    return 0;
}

int kv_wallet_parse(kv_wallet *w, const uint8_t *b, size_t n, kv_diag *d) {
    if (kv_sodium_ready(d)) return KV_EINTERNAL;
    size_t tag = strlen(KV_KEYFILE_TAG), want = tag + 64;
    if (n == want + 1 && b[want] == '\n') n = want;
    uint8_t seed[32];
    if (n != want || memcmp(b, KV_KEYFILE_TAG, tag) || kv_unhex((const char *)b + tag, 64, seed, 32, true))
        return kv_fail(d, KV_EFORMAT, "not a kvasir-ed25519-v1 key");
    crypto_sign_seed_keypair(w->pk, w->sk, seed);
    sodium_memzero(seed, sizeof seed);
    return 0;
}

int kv_wallet_parse_node_key(kv_wallet *w, const uint8_t *b, size_t n, kv_diag *d) {
    if (kv_sodium_ready(d)) return KV_EINTERNAL;
    uint8_t seed[32];
    if (n != 65 || b[64] != '\n' || kv_unhex((const char *)b, 64, seed, 32, false))
        return kv_fail(d, KV_EFORMAT, "not a node key (64 lowercase hex digits and a newline)");
    crypto_sign_seed_keypair(w->pk, w->sk, seed);
    sodium_memzero(seed, sizeof seed);
    return 0;
}

int kv_wallet_load(kv_wallet *w, const char *path, kv_diag *d) {
    uint8_t buf[130];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kv_fail(d, KV_EIO, "key file '%s': %s", path, strerror(errno));
    ssize_t n = read(fd, buf, sizeof buf);
    close(fd);
    if (n < 0) return kv_fail(d, KV_EIO, "key file '%s': %s", path, strerror(errno));
    int rc = kv_wallet_parse(w, buf, (size_t)n, d);
    if (rc == KV_EFORMAT && kv_wallet_parse_node_key(w, buf, (size_t)n, NULL) == 0) rc = 0; /* `kvasir key`'s */
    sodium_memzero(buf, sizeof buf);
    if (rc) kv_diag_prefix(d, rc, "key file '%s'", path);
    return rc;
}

/* ---- authorizations ---------------------------------------------------------- */
static int kv_auth_body(const kv_auth *a, uint8_t b[KV_AUTH_BODY_SIZE], kv_diag *d) {
    if (kv_gateway_id_ok(a->gateway, d)) return KV_EINVAL;
    if (a->max == 0 || a->max > KV_LEDGER_MAX_AMOUNT)
        return kv_fail(d, KV_EINVAL, "authorization max %llu is outside 1..2^62-1",
                       (unsigned long long)a->max);
    if (a->expires > INT64_MAX) return kv_fail(d, KV_EINVAL, "authorization expiry out of range");
    memset(b, 0, KV_AUTH_BODY_SIZE);
    kv_header_put(b, "KVRA");
    memcpy(b + 8, a->consumer, 32);
    memcpy(b + 40, a->gateway, strlen(a->gateway));
    kv_put_u64(b + 72, a->max);
    kv_put_u64(b + 80, a->expires);
    memcpy(b + 88, a->nonce, 16);
    return 0;
}

int kv_auth_sign(kv_auth *a, const kv_wallet *w, const char *gateway, uint64_t max, uint64_t expires,
                 kv_diag *d) {
    if (kv_sodium_ready(d)) return KV_EINTERNAL;
    memset(a, 0, sizeof *a);
    memcpy(a->consumer, w->pk, 32);
    if (kv_gateway_id_ok(gateway, d)) return KV_EINVAL;
    snprintf(a->gateway, sizeof a->gateway, "%s", gateway);
    a->max = max;
    a->expires = expires;
    randombytes_buf(a->nonce, sizeof a->nonce);
    uint8_t b[KV_AUTH_BODY_SIZE];
    int rc = kv_auth_body(a, b, d);
    if (rc) return rc;
    crypto_sign_detached(a->sig, NULL, b, sizeof b, w->sk);
    return 0;
}

int kv_auth_to_bytes(const kv_auth *a, uint8_t out[KV_AUTH_SIZE], kv_diag *d) {
    int rc = kv_auth_body(a, out, d);
    if (rc) return rc;
    memcpy(out + KV_AUTH_BODY_SIZE, a->sig, 64);
    return 0;
}

int kv_auth_verify(const kv_auth *a, kv_diag *d) {
    if (kv_sodium_ready(d)) return KV_EINTERNAL;
    uint8_t b[KV_AUTH_BODY_SIZE];
    int rc = kv_auth_body(a, b, d);
    if (rc) return rc;
    if (crypto_sign_verify_detached(a->sig, b, sizeof b, a->consumer))
        return kv_fail(d, KV_LEDGER_RSIGNATURE, "authorization signature does not verify");
    return 0;
}

int kv_auth_from_bytes(kv_auth *a, const uint8_t *b, size_t n, kv_diag *d) {
    if (n != KV_AUTH_SIZE)
        return kv_fail(d, KV_EFORMAT, "authorization is %zu bytes, want %d", n, KV_AUTH_SIZE);
    int rc = kv_header_get(b, "KVRA", "authorization", d);
    if (rc) return rc;
    memset(a, 0, sizeof *a);
    memcpy(a->consumer, b + 8, 32);
    if ((rc = kv_gateway_get(b + 40, a->gateway, d))) return kv_diag_prefix(d, rc, "authorization");
    a->max = kv_get_u64(b + 72);
    a->expires = kv_get_u64(b + 80);
    if (a->max == 0 || a->max > KV_LEDGER_MAX_AMOUNT)
        return kv_fail(d, KV_EFORMAT, "authorization max %llu is outside 1..2^62-1",
                       (unsigned long long)a->max);
    if (a->expires > INT64_MAX) return kv_fail(d, KV_EFORMAT, "authorization expiry out of range");
    memcpy(a->nonce, b + 88, 16);
    memcpy(a->sig, b + KV_AUTH_BODY_SIZE, 64);
    return kv_auth_verify(a, d);
}

int kv_auth_encode(const kv_auth *a, char *out, size_t cap, kv_diag *d) {
    uint8_t b[KV_AUTH_SIZE];
    int rc = kv_auth_to_bytes(a, b, d);
    if (rc) return rc;
    size_t pl = strlen(KV_AUTH_PREFIX);
    size_t need = pl + sodium_base64_ENCODED_LEN(KV_AUTH_SIZE, sodium_base64_VARIANT_URLSAFE_NO_PADDING);
    if (cap < need || need > KV_AUTH_HEADER_MAX) return kv_fail(d, KV_EINVAL, "header buffer too small");
    memcpy(out, KV_AUTH_PREFIX, pl);
    sodium_bin2base64(out + pl, cap - pl, b, sizeof b, sodium_base64_VARIANT_URLSAFE_NO_PADDING);
    return 0;
}

int kv_auth_decode(kv_auth *a, const char *s, size_t n, kv_diag *d) {
    if (kv_sodium_ready(d)) return KV_EINTERNAL;
    size_t pl = strlen(KV_AUTH_PREFIX);
    size_t want = pl + sodium_base64_ENCODED_LEN(KV_AUTH_SIZE, sodium_base64_VARIANT_URLSAFE_NO_PADDING) - 1;
    if (n != want) return kv_fail(d, KV_EFORMAT, "payment header is %zu bytes, want %zu", n, want);
    if (memcmp(s, KV_AUTH_PREFIX, pl)) return kv_fail(d, KV_EFORMAT, "payment header does not start with kvr1.");
    for (size_t i = pl; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_'))
            return kv_fail(d, KV_EFORMAT, "payment header has a byte outside base64url");
    }
    uint8_t b[KV_AUTH_SIZE];
    size_t bl = 0;
    const char *end = NULL;
    if (sodium_base642bin(b, sizeof b, s + pl, n - pl, NULL, &bl, &end,
                          sodium_base64_VARIANT_URLSAFE_NO_PADDING) ||
        bl != KV_AUTH_SIZE || end != s + n)
        return kv_fail(d, KV_EFORMAT, "payment header is not base64url of %d bytes", KV_AUTH_SIZE);
    return kv_auth_from_bytes(a, b, bl, d);
}

/* ---- receipts ---------------------------------------------------------------- */
static int kv_receipt_body(const kv_receipt *r, uint8_t b[KV_RECEIPT_BODY_SIZE], kv_diag *d) {
    if (kv_gateway_id_ok(r->gateway, d)) return KV_EINVAL;
    if (r->n_products == 0 || r->n_products > KV_LEDGER_MAX_PRODUCTS)
        return kv_fail(d, KV_EINVAL, "receipt count %llu is outside 1..2^40", (unsigned long long)r->n_products);
    memset(b, 0, KV_RECEIPT_BODY_SIZE);
    kv_header_put(b, "KVRR");
    memcpy(b + 8, r->node, 32);
    memcpy(b + 40, r->gateway, strlen(r->gateway));
    memcpy(b + 72, r->consumer, 32);
    memcpy(b + 104, r->auth_nonce, 16);
    kv_put_u64(b + 120, r->n_products);
    memcpy(b + 128, r->log_digest, 32);
    memcpy(b + 160, r->nonce, 16);
    return 0;
}

int kv_receipt_sign(kv_receipt *r, const kv_wallet *node, const kv_auth *a, uint64_t n_products,
                    const uint8_t log_digest[32], kv_diag *d) {
    if (kv_sodium_ready(d)) return KV_EINTERNAL;
    memset(r, 0, sizeof *r);
    memcpy(r->node, node->pk, 32);
    memcpy(r->gateway, a->gateway, sizeof r->gateway);
    memcpy(r->consumer, a->consumer, 32);
    memcpy(r->auth_nonce, a->nonce, 16);
    r->n_products = n_products;
    memcpy(r->log_digest, log_digest, 32);
    randombytes_buf(r->nonce, sizeof r->nonce);
    uint8_t b[KV_RECEIPT_BODY_SIZE];
    int rc = kv_receipt_body(r, b, d);
    if (rc) return rc;
    crypto_sign_detached(r->sig, NULL, b, sizeof b, node->sk);
    return 0;
}

int kv_receipt_to_bytes(const kv_receipt *r, uint8_t out[KV_RECEIPT_SIZE], kv_diag *d) {
    int rc = kv_receipt_body(r, out, d);
    if (rc) return rc;
    memcpy(out + KV_RECEIPT_BODY_SIZE, r->sig, 64);
    return 0;
}

int kv_receipt_verify(const kv_receipt *r, kv_diag *d) {
    if (kv_sodium_ready(d)) return KV_EINTERNAL;
    uint8_t b[KV_RECEIPT_BODY_SIZE];
    int rc = kv_receipt_body(r, b, d);
    if (rc) return rc;
    if (crypto_sign_verify_detached(r->sig, b, sizeof b, r->node))
        return kv_fail(d, KV_LEDGER_RSIGNATURE, "receipt signature does not verify");
    return 0;
}

int kv_receipt_from_bytes(kv_receipt *r, const uint8_t *b, size_t n, kv_diag *d) {
    if (n != KV_RECEIPT_SIZE) return kv_fail(d, KV_EFORMAT, "receipt is %zu bytes, want %d", n, KV_RECEIPT_SIZE);
    int rc = kv_header_get(b, "KVRR", "receipt", d);
    if (rc) return rc;
    memset(r, 0, sizeof *r);
    memcpy(r->node, b + 8, 32);
    if ((rc = kv_gateway_get(b + 40, r->gateway, d))) return kv_diag_prefix(d, rc, "receipt");
    memcpy(r->consumer, b + 72, 32);
    memcpy(r->auth_nonce, b + 104, 16);
    r->n_products = kv_get_u64(b + 120);
    if (r->n_products == 0 || r->n_products > KV_LEDGER_MAX_PRODUCTS)
        return kv_fail(d, KV_EFORMAT, "receipt count %llu is outside 1..2^40", (unsigned long long)r->n_products);
    memcpy(r->log_digest, b + 128, 32);
    memcpy(r->nonce, b + 160, 16);
    memcpy(r->sig, b + KV_RECEIPT_BODY_SIZE, 64);
    return kv_receipt_verify(r, d);
}

/* ---- issuance ------------------------------------------------------------------ */
static int kv_issue_body(const kv_issue *is, uint8_t b[KV_ISSUE_BODY_SIZE], kv_diag *d) {
    if (is->amount == 0 || is->amount > KV_LEDGER_MAX_AMOUNT)
        return kv_fail(d, KV_EINVAL, "issue amount %llu is outside 1..2^62-1", (unsigned long long)is->amount);
    memset(b, 0, KV_ISSUE_BODY_SIZE);
    kv_header_put(b, "KVRI");
    memcpy(b + 8, is->consumer, 32);
    kv_put_u64(b + 40, is->amount);
    memcpy(b + 48, is->id, 16);
    return 0;
}

int kv_issue_sign(kv_issue *is, const kv_wallet *op, const uint8_t consumer[32], uint64_t amount,
                  const uint8_t *id, kv_diag *d) {
    if (kv_sodium_ready(d)) return KV_EINTERNAL;
    memset(is, 0, sizeof *is);
    memcpy(is->consumer, consumer, 32);
    is->amount = amount;
    if (id) memcpy(is->id, id, 16);
    else randombytes_buf(is->id, 16);
    uint8_t b[KV_ISSUE_BODY_SIZE];
    int rc = kv_issue_body(is, b, d);
    if (rc) return rc;
    crypto_sign_detached(is->sig, NULL, b, sizeof b, op->sk);
    return 0;
}

int kv_issue_to_bytes(const kv_issue *is, uint8_t out[KV_ISSUE_SIZE], kv_diag *d) {
    int rc = kv_issue_body(is, out, d);
    if (rc) return rc;
    memcpy(out + KV_ISSUE_BODY_SIZE, is->sig, 64);
    return 0;
}

int kv_issue_verify(const kv_issue *is, const uint8_t op_pk[32], kv_diag *d) {
    if (kv_sodium_ready(d)) return KV_EINTERNAL;
    uint8_t b[KV_ISSUE_BODY_SIZE];
    int rc = kv_issue_body(is, b, d);
    if (rc) return rc;
    if (crypto_sign_verify_detached(is->sig, b, sizeof b, op_pk))
        return kv_fail(d, KV_LEDGER_RSIGNATURE, "issuance is not signed by this ledger's operator key");
    return 0;
}

int kv_issue_from_bytes(kv_issue *is, const uint8_t *b, size_t n, kv_diag *d) {
    if (n != KV_ISSUE_SIZE) return kv_fail(d, KV_EFORMAT, "issuance is %zu bytes, want %d", n, KV_ISSUE_SIZE);
    int rc = kv_header_get(b, "KVRI", "issuance", d);
    if (rc) return rc;
    memset(is, 0, sizeof *is);
    memcpy(is->consumer, b + 8, 32);
    is->amount = kv_get_u64(b + 40);
    if (is->amount == 0 || is->amount > KV_LEDGER_MAX_AMOUNT)
        return kv_fail(d, KV_EFORMAT, "issue amount %llu is outside 1..2^62-1", (unsigned long long)is->amount);
    memcpy(is->id, b + 48, 16);
    memcpy(is->sig, b + KV_ISSUE_BODY_SIZE, 64);
    return 0;
}
