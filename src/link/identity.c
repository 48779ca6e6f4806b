/* Peer identity (include/kvasir/link.h): hex, Ed25519 keys and key files,
 * signatures over digests, hub vouchers.
 *
 * A key file holds the 32-byte Ed25519 seed as 64 lowercase hex digits and
 * a newline, nothing else; it is read with one bounded read and never
 * overwritten. Signatures are over a SHA-256 digest of fixed length, so no
 * signed text depends on a length read from the wire. Everything here is
 * pure apart from kv_key_file_load and kv_key_list_add (bounded reads of
 * files). */
#include <errno.h>
#include <fcntl.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvasir/link.h"
#include "kvasir/slice.h" /* kv_sha256 */

#define KV_VOUCHER_DOMAIN "kvasir-voucher-v1\n"
#define KV_KEY_LIST_MAX_FILE (8u << 20) /* bytes of a key list file */

/* ---- hex ------------------------------------------------------------------- */

void kv_hex(const uint8_t *b, size_t n, char *out) {
    static const char dig[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = dig[b[i] >> 4];
        out[2 * i + 1] = dig[b[i] & 15];
    }
    out[2 * n] = 0;
}

static int kv_hexval(char c, bool any_case) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (any_case && c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

int kv_unhex(const char *s, size_t slen, uint8_t *out, size_t n, bool any_case) {
    if (!s || n > SIZE_MAX / 2 || slen != 2 * n) return KV_EFORMAT;
    for (size_t i = 0; i < n; i++) {
        const int a = kv_hexval(s[2 * i], any_case), b = kv_hexval(s[2 * i + 1], any_case);
        if (a < 0 || b < 0) return KV_EFORMAT;
        out[i] = (uint8_t)(a << 4 | b);
    }
    return 0;
}

int kv_key_from_hex(const char *hex, uint8_t out[32], kv_diag *d) {
    if (!hex || kv_unhex(hex, strnlen(hex, 65), out, 32, false))
        return kv_fail(d, KV_EINVAL, "a key is 64 lowercase hex digits");
    return 0;
}

/* ---- keys ------------------------------------------------------------------ */

void kv_node_key_from_seed(kv_node_key *k, const uint8_t seed[32]) {
    KV_ASSERT(sodium_init() >= 0);
    crypto_sign_seed_keypair(k->pk, k->sk, seed);
    k->last_counter = 0;
}

/* A new key file at path (its folder made 0700 if missing); a file that
 * appeared meanwhile is kept. */
static int kv_key_file_create(const char *path, kv_diag *d) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) {
        *slash = 0;
        if (mkdir(dir, 0700) && errno != EEXIST)
            return kv_fail(d, KV_EIO, "node key: cannot create '%s': %s", dir, strerror(errno));
    }
    uint8_t seed[32];
    randombytes_buf(seed, sizeof seed);
    char line[66];
    kv_hex(seed, 32, line);
    line[64] = '\n';
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    int w = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (w < 0) return kv_fail(d, KV_EIO, "node key: cannot create '%s': %s", tmp, strerror(errno));
    int bad = write(w, line, 65) != 65 || fsync(w);
    close(w);
    /* link(2) refuses to replace: a key written meanwhile by another
     * process wins and is loaded by the caller */
    int rc = 0;
    if (bad || (link(tmp, path) && errno != EEXIST))
        rc = kv_fail(d, KV_EIO, "node key: cannot write '%s': %s", path, strerror(errno));
    unlink(tmp);
    sodium_memzero(seed, sizeof seed);
    sodium_memzero(line, sizeof line);
    return rc;
}

int kv_key_file_load(kv_node_key *k, const char *path, bool create, kv_diag *d) {
    memset(k, 0, sizeof *k);
    if (sodium_init() < 0) return kv_fail(d, KV_EINTERNAL, "node key: libsodium failed to start");
    if (strlen(path) > 4000) return kv_fail(d, KV_EINVAL, "node key: path is too long");
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT && create) {
        int rc = kv_key_file_create(path, d);
        if (rc) return rc;
        fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    }
    if (fd < 0) return kv_fail(d, errno == ENOENT ? KV_ENOTFOUND : KV_EIO, "node key: cannot open '%s': %s",
                               path, strerror(errno));
    char buf[80];
    ssize_t n = read(fd, buf, sizeof buf);
    close(fd);
    uint8_t seed[32];
    if (n != 65 || buf[64] != '\n' || kv_unhex(buf, 64, seed, 32, false))
        return kv_fail(d, KV_EFORMAT, "node key: '%s' is not 64 lowercase hex digits and a newline", path);
    kv_node_key_from_seed(k, seed);
    sodium_memzero(seed, sizeof seed);
    sodium_memzero(buf, sizeof buf);
    return 0;
}

/* ---- signatures ------------------------------------------------------------ */

void kv_link_sign(const uint8_t sk[64], const uint8_t digest[32], uint8_t sig[64]) {
    KV_ASSERT(sodium_init() >= 0);
    crypto_sign_detached(sig, NULL, digest, 32, sk);
}

int kv_link_verify(const uint8_t pk[32], const uint8_t digest[32], const uint8_t sig[64]) {
    if (sodium_init() < 0) return KV_EINTERNAL;
    return crypto_sign_verify_detached(sig, digest, 32, pk) == 0 ? 0 : KV_EAUTH;
}

/* ---- vouchers -------------------------------------------------------------- */

void kv_voucher_digest(const char model_id[KV_LINK_MODEL_ID_LEN], const uint8_t key[32], uint64_t expires_ms,
                       uint8_t out[32]) {
    uint8_t e[8];
    for (int i = 0; i < 8; i++) e[i] = (uint8_t)(expires_ms >> (8 * i));
    kv_sha256 s;
    kv_sha256_init(&s);
    kv_sha256_update(&s, KV_VOUCHER_DOMAIN, sizeof KV_VOUCHER_DOMAIN - 1);
    kv_sha256_update(&s, model_id, KV_LINK_MODEL_ID_LEN);
    kv_sha256_update(&s, key, 32);
    kv_sha256_update(&s, e, 8);
    kv_sha256_final(&s, out);
}

void kv_voucher_sign(const uint8_t hub_sk[64], const char model_id[KV_LINK_MODEL_ID_LEN], const uint8_t key[32],
                     uint64_t expires_ms, uint8_t sig[64]) {
    uint8_t dg[32];
    kv_voucher_digest(model_id, key, expires_ms, dg);
    kv_link_sign(hub_sk, dg, sig);
}

int kv_voucher_verify(const uint8_t hub_pk[32], const char model_id[KV_LINK_MODEL_ID_LEN], const uint8_t key[32],
                      uint64_t expires_ms, const uint8_t sig[64]) {
    uint8_t dg[32];
    kv_voucher_digest(model_id, key, expires_ms, dg);
    return kv_link_verify(hub_pk, dg, sig);
}

int kv_node_key_load(kv_node_key *k, const char *dir, bool create, kv_diag *d) {
    char path[4096];
    memset(k, 0, sizeof *k);
    if (snprintf(path, sizeof path, "%s/%s", dir, KV_LINK_KEY_FILE) >= (int)sizeof path)
        return kv_fail(d, KV_EINVAL, "node key: folder path is too long");
    return kv_key_file_load(k, path, create, d);
}

/* ---- key lists ------------------------------------------------------------- */

static int kv_keys_push(uint8_t (**keys)[32], size_t *n, const uint8_t k[32], kv_diag *d) {
    if (*n >= KV_LINK_MAX_KEYS) return kv_fail(d, KV_ERANGE, "more than %u allowed keys", KV_LINK_MAX_KEYS);
    uint8_t(*nk)[32] = realloc(*keys, (*n + 1) * sizeof **keys);
    if (!nk) return kv_fail(d, KV_ENOMEM, "allowed keys: out of memory");
    memcpy(nk[*n], k, 32);
    *keys = nk;
    (*n)++;
    return 0;
}

int kv_key_list_add(const char *value, uint8_t (**keys)[32], size_t *n, kv_diag *d) {
    uint8_t k[32];
    if (value && strnlen(value, 65) == 64 && kv_key_from_hex(value, k, NULL) == 0) return kv_keys_push(keys, n, k, d);
    FILE *f = value ? fopen(value, "rb") : NULL;
    if (!f)
        return kv_fail(d, value && errno == ENOENT ? KV_EINVAL : KV_EIO,
                       "'%.200s' is neither a key (64 lowercase hex digits) nor a readable key file", value ? value : "");
    char line[256];
    size_t lineno = 0, total = 0;
    int rc = 0;
    while (!rc && fgets(line, sizeof line, f)) {
        lineno++;
        size_t len = strlen(line);
        total += len;
        if (total > KV_KEY_LIST_MAX_FILE) {
            rc = kv_fail(d, KV_ERANGE, "%.200s: key file over %u bytes", value, KV_KEY_LIST_MAX_FILE);
            break;
        }
        if (len && line[len - 1] != '\n' && !feof(f)) {
            rc = kv_fail(d, KV_EINVAL, "%.200s:%zu: line too long", value, lineno);
            break;
        }
        while (len && (line[len - 1] == '\n' || line[len - 1] == '\r' || line[len - 1] == ' ')) line[--len] = 0;
        const char *p = line;
        while (*p == ' ' || *p == '\t') p++;
        if (!*p || *p == '#') continue;
        if (kv_key_from_hex(p, k, NULL)) {
            rc = kv_fail(d, KV_EINVAL, "%.200s:%zu: not a key (64 lowercase hex digits)", value, lineno);
            break;
        }
        rc = kv_keys_push(keys, n, k, d);
    }
    fclose(f);
    return rc;
}
