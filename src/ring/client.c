/* The ring's client side (kv_ring_request): one blocking connection to any
 * node, HELLO as a client, one SUBMIT, then ACCEPT and TOKEN frames until
 * the request stops or fails.
 *
 * Invariants: every frame is read whole (header first, then exactly the
 * announced length, bounded by KV_RING_MAX_PAYLOAD) within timeout_ms and
 * decoded by the same codec the nodes use; the buffer grows only with
 * bytes that arrived. */
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvasir/dispatch.h" /* kv_proto_connect */
#include "kvasir/ring.h"

#include <sodium.h>

typedef struct kv_rcl {
    int fd;
    uint8_t *buf;
    size_t cap;
    int timeout_ms;
} kv_rcl;

static int kv_rcl_read(kv_rcl *c, size_t at, size_t n, kv_diag *d) {
    while (n) {
        struct pollfd pf = {.fd = c->fd, .events = POLLIN};
        int pr = poll(&pf, 1, c->timeout_ms);
        if (pr < 0 && errno == EINTR) continue;
        if (pr == 0) return kv_fail(d, KV_ETIMEOUT, "ring: no frame from the node within %d ms", c->timeout_ms);
        ssize_t r = read(c->fd, c->buf + at, n);
        if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (r <= 0) return kv_fail(d, KV_EIO, "ring: the node closed the connection%s%s", r < 0 ? ": " : "",
                                   r < 0 ? strerror(errno) : "");
        at += (size_t)r;
        n -= (size_t)r;
    }
    return 0;
}

/* One whole frame into c->buf, decoded into m. */
static int kv_rcl_frame(kv_rcl *c, kv_ring_msg *m, kv_diag *d) {
    int rc = kv_rcl_read(c, 0, KV_RING_HEADER, d);
    if (rc) return rc;
    kv_ring_header h;
    if ((rc = kv_ring_header_decode(c->buf, KV_RING_HEADER, &h, d))) return rc;
    const size_t total = KV_RING_HEADER + (size_t)h.len;
    if (total > c->cap) {
        uint8_t *nb = realloc(c->buf, total);
        if (!nb) return kv_fail(d, KV_ENOMEM, "ring: out of memory for a frame of %zu bytes", total);
        c->buf = nb;
        c->cap = total;
    }
    if ((rc = kv_rcl_read(c, KV_RING_HEADER, h.len, d))) return rc;
    return kv_ring_decode(c->buf, total, m, d);
}

static int kv_rcl_send(int fd, const uint8_t *p, size_t n, kv_diag *d) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return kv_fail(d, KV_EIO, "ring: send: %s", strerror(errno));
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

int kv_ring_request(const char *addr, const char *text, size_t text_len, const kv_ring_params *p, int timeout_ms,
                    kv_ring_token_fn fn, void *data, kv_ring_result *res, kv_diag *d) {
    return kv_ring_request_key(addr, NULL, text, text_len, p, timeout_ms, fn, data, res, d);
}

int kv_ring_request_key(const char *addr, const uint8_t *key_sk, const char *text, size_t text_len,
                        const kv_ring_params *p, int timeout_ms, kv_ring_token_fn fn, void *data, kv_ring_result *res,
                        kv_diag *d) {
    memset(res, 0, sizeof *res);
    if (text_len < 1 || text_len > KV_RING_MAX_TEXT)
        return kv_fail(d, KV_EINVAL, "ring: prompt of %zu bytes out of range [1, %u]", text_len, KV_RING_MAX_TEXT);
    kv_rcl c = {.fd = -1, .timeout_ms = timeout_ms > 0 ? timeout_ms : 60000};
    float *lg = NULL;
    int rc = kv_proto_connect(addr, c.timeout_ms, &c.fd, d);
    if (rc) return kv_diag_prefix(d, rc, "ring: node %s", addr);
    c.cap = KV_RING_HEADER + 128 + text_len; /* HELLO (88) or SUBMIT (44 + text) */
    if (!(c.buf = malloc(c.cap))) {
        rc = kv_fail(d, KV_ENOMEM, "ring: out of memory");
        goto done;
    }
    size_t n;
    const kv_ring_hello me = {.role = KV_RING_ROLE_CLIENT};
    if ((rc = kv_ring_hello_encode(c.buf, c.cap, KV_RING_HELLO, &me, &n, d)) || (rc = kv_rcl_send(c.fd, c.buf, n, d)))
        goto done;
    if (sodium_init() < 0) {
        rc = kv_fail(d, KV_EINTERNAL, "ring: libsodium did not initialize");
        goto done;
    }
    uint8_t sk[64], node_key[32], challenge[32], nonce[32];
    if (key_sk) {
        memcpy(sk, key_sk, 64);
    } else {
        uint8_t pk[32];
        crypto_sign_keypair(pk, sk);
    }
    kv_ring_msg m;
    uint32_t n_vocab = 0;
    char model_id[KV_RING_MODEL_ID_LEN + 1] = "";
    int stage = 0; /* 0 HELLO_ACK, 1 AUTH_CHALLENGE, 2 AUTH_OK, 3 the request */
    for (;;) {
        if ((rc = kv_rcl_frame(&c, &m, d))) goto done;
        if (stage < 3 && m.h.type != KV_RING_ERROR &&
            m.h.type != (stage == 0 ? KV_RING_HELLO_ACK : stage == 1 ? KV_RING_AUTH_CHALLENGE : KV_RING_AUTH_OK)) {
            rc = kv_fail(d, KV_EPROTO, "ring: frame type %u from the node during the handshake", m.h.type);
            goto done;
        }
        switch (m.h.type) {
        case KV_RING_HELLO_ACK:
            if (m.u.hello.role != KV_RING_ROLE_LINK) {
                rc = kv_fail(d, KV_EPROTO, "ring: the peer at %s is not a ring node", addr);
                goto done;
            }
            n_vocab = m.u.hello.n_vocab;
            memcpy(model_id, m.u.hello.model_id, sizeof model_id);
            stage = 1;
            break;
        case KV_RING_AUTH_CHALLENGE: {
            memcpy(node_key, m.u.auth.key, 32);
            memcpy(challenge, m.u.auth.nonce, 32);
            randombytes_buf(nonce, sizeof nonce);
            kv_ring_auth a;
            memcpy(a.key, sk + 32, 32);
            memcpy(a.nonce, nonce, 32);
            uint8_t dg[32];
            kv_ring_auth_digest('C', model_id, node_key, challenge, a.key, nonce, dg);
            kv_dispatch_sign(sk, dg, a.sig);
            if ((rc = kv_ring_auth_encode(c.buf, c.cap, KV_RING_AUTH, &a, &n, d)) || (rc = kv_rcl_send(c.fd, c.buf, n, d)))
                goto done;
            stage = 2;
            break;
        }
        case KV_RING_AUTH_OK: {
            uint8_t dg[32];
            kv_ring_auth_digest('A', model_id, node_key, challenge, sk + 32, nonce, dg);
            if (kv_dispatch_verify(node_key, dg, m.u.auth.sig)) {
                rc = kv_fail(d, KV_EAUTH, "ring: the node at %s did not prove its key", addr);
                goto done;
            }
            const kv_ring_submit sb = {*p, text, (uint32_t)text_len};
            if ((rc = kv_ring_submit_encode(c.buf, c.cap, &sb, &n, d)) || (rc = kv_rcl_send(c.fd, c.buf, n, d))) goto done;
            stage = 3;
            break;
        }
        case KV_RING_ACCEPT:
            free(res->prompt);
            if (!(res->prompt = malloc(m.u.accept.n_tokens * sizeof *res->prompt))) {
                rc = kv_fail(d, KV_ENOMEM, "ring: out of memory");
                goto done;
            }
            for (uint32_t i = 0; i < m.u.accept.n_tokens; i++) res->prompt[i] = kv_ring_tokens_get(m.u.accept.tokens, i);
            res->n_prompt = m.u.accept.n_tokens;
            break;
        case KV_RING_TOKEN: {
            const kv_ring_token *t = &m.u.token;
            if (t->n_logits && t->n_logits != n_vocab) {
                rc = kv_fail(d, KV_EPROTO, "ring: a token with %u logits, the model has %u", t->n_logits, n_vocab);
                goto done;
            }
            if (t->n_logits && !lg && !(lg = malloc((size_t)n_vocab * sizeof *lg))) {
                rc = kv_fail(d, KV_ENOMEM, "ring: out of memory");
                goto done;
            }
            if (t->n_logits) kv_ring_floats_get(t->logits, t->n_logits, lg);
            res->n_tokens++;
            res->stop = t->stop;
            if (fn && fn(data, t->token, t->piece, t->piece_len, t->n_logits ? lg : NULL, t->n_logits)) goto done;
            if (t->stop) goto done;
            break;
        }
        case KV_RING_ERROR:
            rc = kv_fail(d, m.u.error.code, "%s", m.u.error.msg);
            goto done;
        default:
            rc = kv_fail(d, KV_EPROTO, "ring: unexpected frame type %u from the node", m.h.type);
            goto done;
        }
    }
done:
    sodium_memzero(sk, sizeof sk);
    free(lg);
    free(c.buf);
    if (c.fd >= 0) close(c.fd);
    return rc;
}

void kv_ring_result_free(kv_ring_result *r) {
    if (!r) return;
    free(r->prompt);
    r->prompt = NULL;
}
