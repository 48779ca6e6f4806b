/* The coordinator's side of the dispatch key handshake, blocking
 * (include/kvasir/link.h, kv_link_dial_dispatch).
 *
 * The sequence is docs/PROTOCOL.md's, v3 and later: HELLO (every version
 * this build speaks), HELLO_ACK (an authenticated version, our model, the
 * expected width), AUTH_CHALLENGE (the worker's key must be the one
 * expected), AUTH (our key over the transcript, with a voucher when given),
 * AUTH_OK (the worker's signature over the same transcript, verified). One
 * deadline covers the connect and every frame, so a worker that stalls at
 * any step costs at most timeout_ms. Frames are read whole into a buffer
 * sized for the largest HELLO_ACK and decoded by the dispatch codec.
 *
 * The link is TLS 1.3 pinned to the worker's key unless the caller asks for
 * plain TCP (--insecure-plaintext); over TLS the HELLO offers v5 only and
 * both signatures cover the session's exporter (the transcript's binding). */
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/dispatch_proto.h"
#include "kvasir/link.h"
#include "kvasir/tls.h"
#include "kvasir/transport.h"

_Static_assert(KV_LINK_MAX_NAME == KV_PROTO_MAX_NAME, "a HELLO_ACK's backend name fits kv_link_dispatch");
_Static_assert(KV_LINK_MODEL_ID_LEN == KV_PROTO_MODEL_ID_LEN, "one model id length");

static double kv_dial_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Reads one frame of `type` before deadline (ms on kv_dial_now_ms's clock);
 * an ERROR frame becomes its code. */
static int kv_dial_expect(kv_frame_rx *rx, const kv_link_chan *ch, double deadline, uint16_t type, const char *addr, kv_msg *m,
                          kv_diag *d) {
    const double left = deadline - kv_dial_now_ms();
    if (left < 1) return kv_fail(d, KV_ETIMEOUT, "%s: no answer in time", addr);
    kv_frame_rx_reset(rx);
    int rc = kv_proto_read_msg_chan(rx, ch, (int)left, NULL, m, d);
    if (rc) return rc;
    if (m->h.type == KV_MSG_ERROR) return kv_fail(d, m->u.error.code, "%s: %s", addr, m->u.error.msg);
    if (m->h.type != type)
        return kv_fail(d, KV_EPROTO, "%s: frame %s where %s was due", addr, kv_msg_type_name(m->h.type),
                       kv_msg_type_name(type));
    return 0;
}

/* Writes n bytes of ob before deadline. */
static int kv_dial_send(const kv_link_chan *ch, const uint8_t *ob, size_t n, double deadline, const char *addr, kv_diag *d) {
    const double left = deadline - kv_dial_now_ms();
    if (left < 1) return kv_fail(d, KV_ETIMEOUT, "%s: no answer in time", addr);
    return kv_proto_write_all_chan(ch, ob, n, (int)left, d);
}

/* Everything after the connect; fd stays open whatever happens. */
static int kv_dial_handshake(const kv_link_dispatch_opts *o, const kv_link_chan *ch, double deadline, kv_link_dispatch *out,
                             uint8_t *buf, size_t cap, kv_diag *d) {
    uint8_t ob[KV_PROTO_HEADER + KV_PROTO_AUTH_SIZE + KV_PROTO_HELLO_SIZE];
    kv_frame_rx rx;
    kv_frame_rx_init(&rx, buf, cap);
    kv_msg m;
    size_t n = 0;
    kv_msg_hello h = {ch->tls ? KV_PROTO_TLS_VERSION : KV_PROTO_AUTH_VERSION, KV_PROTO_VERSION, {0},
                      1u << KV_ENC_F32};
    uint8_t binding[KV_TLS_EXPORTER_LEN];
    if (ch->tls && kv_tls_exporter(ch->tls, binding)) return kv_fail(d, KV_EINTERNAL, "%s: no TLS exporter", o->addr);
    memcpy(h.model_id, o->model_id, KV_PROTO_MODEL_ID_LEN);
    int rc;
    if ((rc = kv_msg_hello_encode(ob, sizeof ob, 1, &h, &n, d)) || (rc = kv_dial_send(ch, ob, n, deadline, o->addr, d)) ||
        (rc = kv_dial_expect(&rx, ch, deadline, KV_MSG_HELLO_ACK, o->addr, &m, d)))
        return rc;
    const uint16_t ver = m.u.ack.version;
    out->version = ver;
    out->n_embd = m.u.ack.n_embd;
    snprintf(out->backend, sizeof out->backend, "%s", m.u.ack.backend);
    if (ver < KV_PROTO_AUTH_VERSION)
        return kv_fail(d, KV_EAUTH, "%s speaks dispatch v%u, without authentication", o->addr, ver);
    if (ch->tls && ver < KV_PROTO_TLS_VERSION)
        return kv_fail(d, KV_EAUTH, "%s chose dispatch v%u over TLS, which binds nothing to it (v%u needed)", o->addr,
                       ver, KV_PROTO_TLS_VERSION);
    if (strcmp(m.u.ack.model_id, o->model_id) || (o->n_embd && m.u.ack.n_embd != o->n_embd))
        return kv_fail(d, KV_EPROTO, "%s serves another model (%.16s, n_embd %u)", o->addr, m.u.ack.model_id,
                       m.u.ack.n_embd);
    if ((rc = kv_dial_expect(&rx, ch, deadline, KV_MSG_AUTH_CHALLENGE, o->addr, &m, d))) return rc;
    if (sodium_memcmp(m.u.challenge.worker_key, o->worker_key, 32))
        return kv_fail(d, KV_EAUTH, "%s proves another key than the one registered for it", o->addr);
    uint8_t challenge[32];
    memcpy(challenge, m.u.challenge.challenge, 32);
    kv_msg_auth a = {0};
    memcpy(a.key, o->sk + 32, 32);
    randombytes_buf(a.nonce, sizeof a.nonce);
    const kv_link_transcript t = {.proto = KV_LINK_HS_DISPATCH, .model_id = o->model_id, .version = ver,
                                  .acceptor_key = o->worker_key, .challenge = challenge, .connector_key = a.key,
                                  .nonce = a.nonce, .binding = ch->tls ? binding : NULL};
    kv_link_transcript_sign(&t, KV_LINK_CONNECTOR, o->sk, a.sig);
    if (o->voucher) {
        a.flags = KV_PROTO_AUTH_VOUCHER;
        a.voucher_expires_ms = o->voucher->expires_ms;
        memcpy(a.voucher_sig, o->voucher->sig, 64);
    }
    if ((rc = kv_msg_auth_encode(ob, sizeof ob, 0, &a, &n, d))) return rc;
    kv_frame_set_version(ob, ver);
    if ((rc = kv_dial_send(ch, ob, n, deadline, o->addr, d)) ||
        (rc = kv_dial_expect(&rx, ch, deadline, KV_MSG_AUTH_OK, o->addr, &m, d)))
        return rc;
    if (kv_link_transcript_verify(&t, KV_LINK_ACCEPTOR, o->worker_key, m.u.auth_ok))
        return kv_fail(d, KV_EAUTH, "%s: its AUTH_OK does not verify%s", o->addr,
                       ch->tls ? " over this TLS session (a relayed proof?)" : "");
    return 0;
}

int kv_link_dial_dispatch(const kv_link_dispatch_opts *o, kv_link_dispatch *out, kv_diag *d) {
    memset(out, 0, sizeof *out);
    out->fd = -1;
    if (!o || !o->addr || !o->model_id || strnlen(o->model_id, KV_PROTO_MODEL_ID_LEN + 1) != KV_PROTO_MODEL_ID_LEN ||
        !o->worker_key || !o->sk || o->n_embd > KV_PROTO_MAX_EMBD)
        return kv_fail(d, KV_EINVAL, "dial: bad arguments");
    if (sodium_init() < 0) return kv_fail(d, KV_EINTERNAL, "dial: libsodium failed to start");
    const int timeout_ms = o->timeout_ms > 0 ? o->timeout_ms : 2000;
    const double deadline = kv_dial_now_ms() + timeout_ms;
    int fd = -1, rc = kv_link_connect(o->addr, timeout_ms, &fd, d);
    if (rc) return rc;
    out->connected = true;
    kv_link_chan ch = {fd, NULL};
    if (!o->plaintext) {
        const kv_tls_opts to = {.server = false, .pin_key = o->worker_key};
        const int left = (int)(deadline - kv_dial_now_ms());
        bool plain = false;
        if (!(rc = kv_link_tls_ctx(&out->tls_ctx, o->sk, d)) && !(rc = kv_tls_new(&out->tls, out->tls_ctx, &to, d)))
            rc = kv_link_tls_client_fd(out->tls, fd, left > 0 ? left : 1, &plain, d);
        if (plain) { /* a refusal written before it knew our transport (a busy worker), or an older peer */
            uint8_t eb[KV_PROTO_HEADER + KV_PROTO_MAX_TEXT + 64];
            kv_frame_rx rx;
            kv_frame_rx_init(&rx, eb, sizeof eb);
            kv_msg m;
            const kv_link_chan pc = {fd, NULL};
            const int l2 = (int)(deadline - kv_dial_now_ms());
            if (!kv_proto_read_msg_chan(&rx, &pc, l2 > 0 ? l2 : 1, NULL, &m, NULL) && m.h.type == KV_MSG_ERROR)
                rc = kv_fail(d, m.u.error.code, "%s", m.u.error.msg);
            else
                rc = kv_fail(d, KV_EPROTO, "answered TLS in plaintext (an older worker, or not a worker)");
        }
        if (rc == KV_EAUTH && !plain) /* the certificate carries another key than the pinned one */
            kv_diag_prefix(d, rc, "%s proves another key than the one registered for it", o->addr);
        else if (rc)
            kv_diag_prefix(d, rc, "%s", o->addr);
        if (rc) {
            close(fd);
            kv_link_dispatch_close(out);
            return rc;
        }
        ch.tls = out->tls;
    }
    /* the largest frame of the handshake is a HELLO_ACK listing every range */
    const size_t cap = KV_PROTO_HEADER + KV_PROTO_HELLO_ACK_FIXED_V2 + KV_PROTO_MAX_NAME +
                       (size_t)KV_PROTO_MAX_RANGES * (12 + KV_PROTO_SLAB_SIZE) + 64;
    uint8_t *buf = malloc(cap);
    rc = buf ? kv_dial_handshake(o, &ch, deadline, out, buf, cap, d) : kv_fail(d, KV_ENOMEM, "dial: out of memory");
    free(buf);
    out->fd = fd;
    if (rc) kv_link_dispatch_close(out);
    return rc;
}

void kv_link_dispatch_close(kv_link_dispatch *c) {
    if (!c) return;
    kv_tls_free(c->tls);
    kv_tls_ctx_free(c->tls_ctx);
    if (c->fd >= 0) close(c->fd);
    c->tls = NULL;
    c->tls_ctx = NULL;
    c->fd = -1;
}
