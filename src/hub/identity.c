/* Request signatures and storage challenges: the code both sides of the
 * hub protocol share (the hub verifies with it, nodes and tests sign and
 * answer with it). Keys, key files and hex are the link's (kvasir/link.h).
 *
 * The signed text binds method, path, counter and the body's SHA-256, so a
 * signature cannot be moved to another request, and the counter makes each
 * signature usable once. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "hub/hub_internal.h"
#include "kvasir/hub.h"
#include "kvasir/slice.h"

uint64_t kv_node_next_counter(kv_node_key *k) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t now = (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
    k->last_counter = now > k->last_counter ? now : k->last_counter + 1;
    return k->last_counter;
}

/* The signed text, "kvasir-hub-v1\nMETHOD\nPATH\nCOUNTER\nHEX(SHA256(body))\n",
 * hashed once more so that its length is fixed whatever the path. */
static void kv_hub_signed_digest(const char *method, const char *path, const void *body, size_t body_len,
                                 uint64_t counter, uint8_t out[32]) {
    uint8_t bh[32];
    char bhex[65], ctr[24];
    kv_sha256 s;
    kv_sha256_init(&s);
    if (body_len) kv_sha256_update(&s, body, body_len);
    kv_sha256_final(&s, bh);
    kv_hex(bh, 32, bhex);
    snprintf(ctr, sizeof ctr, "%" PRIu64, counter);
    kv_sha256_init(&s);
    kv_sha256_update(&s, KV_HUB_SIG_DOMAIN "\n", sizeof KV_HUB_SIG_DOMAIN);
    kv_sha256_update(&s, method, strlen(method));
    kv_sha256_update(&s, "\n", 1);
    kv_sha256_update(&s, path, strlen(path));
    kv_sha256_update(&s, "\n", 1);
    kv_sha256_update(&s, ctr, strlen(ctr));
    kv_sha256_update(&s, "\n", 1);
    kv_sha256_update(&s, bhex, 64);
    kv_sha256_update(&s, "\n", 1);
    kv_sha256_final(&s, out);
}

void kv_hub_sign(const kv_node_key *k, const char *method, const char *path, const void *body,
                 size_t body_len, uint64_t counter, kv_hub_auth *out) {
    uint8_t dg[32], sig[64];
    kv_hub_signed_digest(method, path, body, body_len, counter, dg);
    crypto_sign_detached(sig, NULL, dg, sizeof dg, k->sk);
    kv_hex(k->pk, 32, out->key);
    snprintf(out->counter, sizeof out->counter, "%" PRIu64, counter);
    kv_hex(sig, 64, out->sig);
}

int kv_hub_verify(const uint8_t pk[32], const uint8_t sig[64], const char *method, const char *path,
                  const void *body, size_t body_len, uint64_t counter) {
    uint8_t dg[32];
    kv_hub_signed_digest(method, path, body, body_len, counter, dg);
    return crypto_sign_verify_detached(sig, dg, sizeof dg, pk) == 0 ? 0 : KV_EPROTO;
}

int kv_hub_parse_auth(const char *key, const char *counter, const char *sig, uint8_t pk[32], uint64_t *ctr,
                      uint8_t sg[64], kv_diag *d) {
    if (!key || !counter || !sig)
        return kv_fail(d, KV_EPROTO, "unsigned request: needs X-Kvasir-Key, X-Kvasir-Counter and "
                                     "X-Kvasir-Signature");
    if (kv_unhex(key, strnlen(key, 65), pk, 32, false))
        return kv_fail(d, KV_EPROTO, "X-Kvasir-Key must be 64 lowercase hex digits");
    if (kv_unhex(sig, strnlen(sig, 129), sg, 64, false))
        return kv_fail(d, KV_EPROTO, "X-Kvasir-Signature must be 128 lowercase hex digits");
    size_t n = strnlen(counter, 21);
    if (n == 0 || n > 20 || (n > 1 && counter[0] == '0'))
        return kv_fail(d, KV_EPROTO, "X-Kvasir-Counter must be a decimal u64 without leading zeros");
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) {
        if (counter[i] < '0' || counter[i] > '9')
            return kv_fail(d, KV_EPROTO, "X-Kvasir-Counter must be a decimal u64");
        unsigned dg = (unsigned)(counter[i] - '0');
        if (v > (UINT64_MAX - dg) / 10) return kv_fail(d, KV_EPROTO, "X-Kvasir-Counter overflows u64");
        v = v * 10 + dg;
    }
    if (v == 0 || v > (uint64_t)INT64_MAX)
        return kv_fail(d, KV_EPROTO, "X-Kvasir-Counter must be in [1, 2^63-1]");
    *ctr = v;
    return 0;
}

void kv_hub_challenge_range(const uint8_t nonce[32], uint64_t size, uint64_t *off, uint64_t *len) {
    *off = *len = 0;
    if (!size) return;
    uint8_t h[32];
    kv_sha256 s;
    kv_sha256_init(&s);
    kv_sha256_update(&s, "kvasir-challenge-range", 22);
    kv_sha256_update(&s, nonce, 32);
    kv_sha256_final(&s, h);
    uint64_t x = 0;
    for (int i = 0; i < 8; i++) x |= (uint64_t)h[i] << (8 * i);
    *off = x % size;
    *len = size - *off < KV_HUB_CHALLENGE_MAX_LEN ? size - *off : KV_HUB_CHALLENGE_MAX_LEN;
}

/* The answer over an open file; closes fd. */
static int kv_challenge_fd(int fd, const char *name, uint64_t size, const uint8_t nonce[32], uint8_t out[32],
                           kv_diag *d) {
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode) || (uint64_t)st.st_size != size) {
        close(fd);
        return kv_fail(d, KV_EHASH, "challenge: '%s' is not a regular file of %" PRIu64 " bytes", name, size);
    }
    uint64_t off, len;
    kv_hub_challenge_range(nonce, size, &off, &len);
    uint8_t *buf = malloc(KV_HUB_CHALLENGE_MAX_LEN);
    if (!buf) {
        close(fd);
        return kv_fail(d, KV_ENOMEM, "challenge: out of memory");
    }
    size_t got = 0;
    while (got < len) {
        ssize_t r = pread(fd, buf + got, (size_t)len - got, (off_t)(off + got));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            close(fd);
            free(buf);
            return kv_fail(d, KV_EIO, "challenge: short read of '%s'", name);
        }
        got += (size_t)r;
    }
    close(fd);
    kv_sha256 s;
    kv_sha256_init(&s);
    kv_sha256_update(&s, nonce, 32);
    if (len) kv_sha256_update(&s, buf, (size_t)len);
    kv_sha256_final(&s, out);
    free(buf);
    return 0;
}

int kv_hub_challenge_answer(const char *path, uint64_t size, const uint8_t nonce[32], uint8_t out[32],
                            kv_diag *d) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kv_fail(d, KV_EIO, "challenge: cannot open '%s': %s", path, strerror(errno));
    return kv_challenge_fd(fd, path, size, nonce, out, d);
}

int kv_hub_challenge_answer_at(int dir_fd, const char *rel, uint64_t size, const uint8_t nonce[32],
                               uint8_t out[32], kv_diag *d) {
    int fd = openat(dir_fd, rel, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kv_fail(d, KV_EIO, "challenge: cannot open '%s': %s", rel, strerror(errno));
    return kv_challenge_fd(fd, rel, size, nonce, out, d);
}
