/* Authenticated dispatch in tests: the test coordinator key (from a fixed
 * seed, so a worker started with `--allow-key kvt_coord_hex()` serves it)
 * and the coordinator's half of the v3 handshake over a blocking socket.
 * Header-only (static functions): include it once per test executable. */
#ifndef KVASIR_TEST_AUTH_SUPPORT_H
#define KVASIR_TEST_AUTH_SUPPORT_H

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/dispatch_proto.h"
#include "kvasir/dispatch_worker.h"

#if defined(__GNUC__)
#define KVT_UNUSED __attribute__((unused))
#else
#define KVT_UNUSED
#endif

/* A key from a one-byte seed tag: tag 1 is the coordinator every test
 * worker allows, others are strangers. */
static KVT_UNUSED void kvt_key(uint8_t tag, uint8_t pk[32], uint8_t sk[64]) {
    uint8_t seed[32];
    memset(seed, 0x5a, sizeof seed);
    seed[0] = tag;
    if (sodium_init() < 0) abort();
    crypto_sign_seed_keypair(pk, sk, seed);
}

/* kvt_coord_sk's public half, for kv_worker_opts.allow_keys. */
static KVT_UNUSED const uint8_t (*kvt_coord_allow(void))[32] {
    static uint8_t pk[1][32], sk[64];
    kvt_key(1, pk[0], sk);
    return (const uint8_t(*)[32])pk;
}

static KVT_UNUSED const uint8_t *kvt_coord_sk(void) {
    static uint8_t pk[32], sk[64];
    static int init;
    if (!init) {
        kvt_key(1, pk, sk);
        init = 1;
    }
    return sk;
}

/* Writes the test coordinator's key file (the seed as 64 hex digits and a
 * newline, the format of kv_key_file_load) to path; 0 or -1. */
static KVT_UNUSED int kvt_write_coord_key(const char *path) {
    char line[66];
    static const char dig[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) {
        const uint8_t b = i == 0 ? 1 : 0x5a;
        line[2 * i] = dig[b >> 4];
        line[2 * i + 1] = dig[b & 15];
    }
    line[64] = '\n';
    line[65] = 0;
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    const int ok = fputs(line, f) >= 0;
    return fclose(f) == 0 && ok ? 0 : -1;
}

/* The test coordinator's public key as 64 hex digits (static buffer). */
static KVT_UNUSED const char *kvt_coord_hex(void) {
    static char hex[65];
    const uint8_t *sk = kvt_coord_sk();
    static const char dig[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) {
        hex[2 * i] = dig[sk[32 + i] >> 4];
        hex[2 * i + 1] = dig[sk[32 + i] & 15];
    }
    hex[64] = 0;
    return hex;
}

/* After HELLO_ACK: reads AUTH_CHALLENGE from fd, answers AUTH signed by sk
 * (with voucher v if not NULL), reads AUTH_OK and checks the worker's
 * signature. *auth_out (if not NULL) gets the AUTH sent, challenge_out the
 * challenge. Returns 0; KV_EAUTH with *err_code set when the worker
 * answered ERROR; another code on I/O or a bad worker proof. */
static KVT_UNUSED int kvt_auth_v(int fd, kv_frame_rx *rx, uint8_t *tx, size_t txcap, const char *model_id, uint16_t version,
                      const uint8_t sk[64], const kv_voucher *v, kv_msg_auth *auth_out, int *err_code, kv_diag *d) {
    kv_msg m;
    kv_frame_rx_reset(rx);
    int rc = kv_proto_read_msg(rx, fd, 5000, NULL, &m, d);
    if (rc) return rc;
    if (m.h.type != KV_MSG_AUTH_CHALLENGE) return kv_fail(d, KV_EPROTO, "expected AUTH_CHALLENGE, got %u", m.h.type);
    kv_msg_auth_challenge ch = m.u.challenge;
    kv_msg_auth a = {0};
    memcpy(a.key, sk + 32, 32);
    randombytes_buf(a.nonce, 32);
    uint8_t dg[32];
    kv_dispatch_digest('C', model_id, version, ch.worker_key, ch.challenge, a.key, a.nonce, dg);
    kv_link_sign(sk, dg, a.sig);
    if (v) {
        a.flags = KV_PROTO_AUTH_VOUCHER;
        a.voucher_expires_ms = v->expires_ms;
        memcpy(a.voucher_sig, v->sig, 64);
    }
    if (auth_out) *auth_out = a;
    size_t n;
    if ((rc = kv_msg_auth_encode(tx, txcap, 2, &a, &n, d))) return rc;
    kv_frame_set_version(tx, version);
    if ((rc = kv_proto_write_all(fd, tx, n, 2000, d))) return rc;
    kv_frame_rx_reset(rx);
    if ((rc = kv_proto_read_msg(rx, fd, 5000, NULL, &m, d))) return rc;
    if (m.h.type == KV_MSG_ERROR) {
        if (err_code) *err_code = m.u.error.code;
        return kv_fail(d, KV_EAUTH, "worker refused AUTH: %s", m.u.error.msg);
    }
    if (m.h.type != KV_MSG_AUTH_OK) return kv_fail(d, KV_EPROTO, "expected AUTH_OK, got %u", m.h.type);
    kv_dispatch_digest('W', model_id, version, ch.worker_key, ch.challenge, a.key, a.nonce, dg);
    if (kv_link_verify(ch.worker_key, dg, m.u.auth_ok)) return kv_fail(d, KV_EAUTH, "AUTH_OK does not verify");
    return 0;
}

/* The worker's half, for fake workers in tests: after its HELLO_ACK, sends
 * AUTH_CHALLENGE for key sk, reads AUTH (the coordinator's signature is
 * checked) and answers AUTH_OK. Returns 0 or an error code. */
static KVT_UNUSED int kvt_worker_auth(int fd, kv_frame_rx *rx, const char *model_id, uint16_t version, const uint8_t sk[64],
                           kv_diag *d) {
    uint8_t buf[KV_PROTO_HEADER + KV_PROTO_AUTH_SIZE];
    kv_msg_auth_challenge ch;
    memcpy(ch.worker_key, sk + 32, 32);
    randombytes_buf(ch.challenge, 32);
    size_t n;
    int rc = kv_msg_auth_challenge_encode(buf, sizeof buf, 1, &ch, &n, d);
    if (!rc) {
        kv_frame_set_version(buf, version);
        rc = kv_proto_write_all(fd, buf, n, 2000, d);
    }
    kv_msg m;
    kv_frame_rx_reset(rx);
    if (!rc) rc = kv_proto_read_msg(rx, fd, 5000, NULL, &m, d);
    if (!rc && m.h.type != KV_MSG_AUTH) rc = kv_fail(d, KV_EPROTO, "expected AUTH, got %u", m.h.type);
    if (rc) return rc;
    uint8_t dg[32], sig[64];
    kv_dispatch_digest('C', model_id, version, ch.worker_key, ch.challenge, m.u.auth.key, m.u.auth.nonce, dg);
    if (kv_link_verify(m.u.auth.key, dg, m.u.auth.sig)) return kv_fail(d, KV_EAUTH, "AUTH does not verify");
    kv_dispatch_digest('W', model_id, version, ch.worker_key, ch.challenge, m.u.auth.key, m.u.auth.nonce, dg);
    kv_link_sign(sk, dg, sig);
    kv_frame_rx_reset(rx);
    if ((rc = kv_msg_auth_ok_encode(buf, sizeof buf, m.h.request_id, sig, &n, d))) return rc;
    kv_frame_set_version(buf, version);
    return kv_proto_write_all(fd, buf, n, 2000, d);
}

/* The usual case: the test coordinator, no voucher. */
static KVT_UNUSED int kvt_auth(int fd, kv_frame_rx *rx, uint8_t *tx, size_t txcap, const char *model_id, uint16_t version,
                    kv_diag *d) {
    return kvt_auth_v(fd, rx, tx, txcap, model_id, version, kvt_coord_sk(), NULL, NULL, NULL, d);
}

#endif
