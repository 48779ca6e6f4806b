/* The ring's client side (kv_ring_request): one blocking connection to any
 * node, HELLO as a client, one SUBMIT, then ACCEPT and TOKEN frames until
 * the request stops or fails.
 *
 * Invariants: every frame is read whole (header first, then exactly the
 * announced length, bounded by KV_RING_MAX_PAYLOAD), with no wait for the
 * node's next bytes longer than timeout_ms, through the link's blocking I/O
 * (kv_link_chan over TLS 1.3: the node proves its key over a transcript
 * bound to the session), and decoded by the same codec
 * the nodes use; the buffer grows only with bytes that arrived. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h> /* close */

#include "kvasir/link.h"
#include "engine/spec.h" /* the test source's file */
#include "kvasir/ring.h"
#include "kvasir/tls.h"
#include "kvasir/transport.h"

#include <sodium.h>

typedef struct kv_rcl {
    int fd;
    kv_tls *tls;      /* the TLS session on fd (NULL only while a server's plaintext refusal is read) */
    kv_tls_ctx *ctx;  /* tls's context (a certificate of the client's key) */
    uint8_t *buf;
    size_t cap;
    int timeout_ms;
    bool (*cancelled)(void *data); /* asked every KV_LINK_POLL_MS while waiting; NULL = never */
    void *data;
} kv_rcl;

/* Reads n bytes into c->buf + at: each wait for the node's next bytes is
 * bounded by timeout_ms (tokens come as they are made), and the caller's
 * cancellation is asked every KV_LINK_POLL_MS meanwhile. */
static int kv_rcl_read(kv_rcl *c, size_t at, size_t n, kv_diag *d) {
    kv_link_io io = {.timeout_ms = c->timeout_ms, .idle = true, .cancelled = c->cancelled, .arg = c->data,
                     .peer = "the node"};
    const kv_link_chan ch = {c->fd, c->tls};
    const int rc = kv_link_chan_read_full(&ch, c->buf + at, n, &io, d);
    if (!rc) return 0;
    if (io.was_cancelled) return kv_fail(d, KV_EIO, "ring: the request was cancelled");
    if (rc == KV_ETIMEOUT) return kv_fail(d, rc, "ring: no frame from the node within %d ms", c->timeout_ms);
    return kv_diag_prefix(d, rc, "ring");
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

/* Sends n bytes: the node must take them with no wait longer than timeout_ms. */
static int kv_rcl_send(const kv_rcl *c, const uint8_t *p, size_t n, kv_diag *d) {
    kv_link_io io = {.timeout_ms = c->timeout_ms, .idle = true, .peer = "the node"};
    const kv_link_chan ch = {c->fd, c->tls};
    const int rc = kv_link_chan_write_full(&ch, p, n, &io, d);
    return rc ? kv_diag_prefix(d, rc, "ring") : 0;
}

int kv_ring_request(const char *addr, const char *text, size_t text_len, const kv_ring_params *p, int timeout_ms,
                    kv_ring_token_fn fn, void *data, kv_ring_result *res, kv_diag *d) {
    return kv_ring_request_key(addr, NULL, text, text_len, p, timeout_ms, fn, data, res, d);
}

int kv_ring_request_key(const char *addr, const uint8_t *key_sk, const char *text, size_t text_len,
                        const kv_ring_params *p, int timeout_ms, kv_ring_token_fn fn, void *data, kv_ring_result *res,
                        kv_diag *d) {
    const kv_ring_req q = {.text = text, .text_len = text_len, .p = *p, .key_sk = key_sk, .timeout_ms = timeout_ms,
                           .on_token = fn, .data = data};
    return kv_ring_request_ex(addr, &q, res, d);
}

/* Connects to addr and runs the client handshake (HELLO as a client, then
 * AUTH proving key_sk, and the node's AUTH_OK checked). On success c is
 * open and *n_vocab is the node's. */
static int kv_rcl_open(kv_rcl *c, const char *addr, const uint8_t *key_sk, const kv_voucher *voucher, size_t cap,
                       uint32_t *n_vocab, kv_diag *d) {
    const int cto = c->timeout_ms < 5000 ? c->timeout_ms : 5000;
    int rc = kv_link_connect(addr, cto, &c->fd, d);
    if (rc) return kv_diag_prefix(d, rc, "ring: node %s", addr);
    c->cap = cap < KV_RING_HEADER + 200 ? KV_RING_HEADER + 200 : cap; /* HELLO (88), AUTH (128 or 200) */
    if (!(c->buf = malloc(c->cap))) return kv_fail(d, KV_ENOMEM, "ring: out of memory");
    if (sodium_init() < 0) return kv_fail(d, KV_EINTERNAL, "ring: libsodium did not initialize");
    uint8_t sk[64], node_key[32], challenge[32], nonce[32], binding[KV_TLS_EXPORTER_LEN];
    if (key_sk) {
        memcpy(sk, key_sk, 64);
    } else {
        uint8_t pk[32];
        crypto_sign_keypair(pk, sk);
    }
    /* TLS 1.3 (the node's key is learned in its AUTH_CHALLENGE and bound to this session) */
    const kv_tls_opts to = {.server = false};
    bool plain = false;
    if ((rc = kv_link_tls_ctx(&c->ctx, sk, d)) || (rc = kv_tls_new(&c->tls, c->ctx, &to, d)))
        return rc;
    if ((rc = kv_link_tls_client_fd(c->tls, c->fd, cto, &plain, d))) {
        kv_ring_msg em;
        kv_tls_free(c->tls);
        c->tls = NULL; /* a plaintext answer is read as a refusal only */
        if (plain && !kv_rcl_frame(c, &em, NULL) && em.h.type == KV_RING_ERROR)
            return kv_fail(d, em.u.error.code, "%s", em.u.error.msg);
        if (plain) return kv_fail(d, KV_EPROTO, "ring: node %s answered TLS in plaintext (an older node?)", addr);
        return kv_diag_prefix(d, rc, "ring: node %s", addr);
    }
    if (kv_tls_exporter(c->tls, binding)) return kv_fail(d, KV_EINTERNAL, "ring: no TLS exporter");
    size_t n;
    const kv_ring_hello me = {.role = KV_RING_ROLE_CLIENT};
    if ((rc = kv_ring_hello_encode(c->buf, c->cap, KV_RING_HELLO, &me, &n, d)) || (rc = kv_rcl_send(c, c->buf, n, d)))
        return rc;
    kv_ring_msg m;
    char model_id[KV_RING_MODEL_ID_LEN + 1] = "";
    /* the transcript's fields fill in as the frames come */
    const kv_link_transcript t = {.proto = KV_LINK_HS_RING, .model_id = model_id, .acceptor_key = node_key,
                                  .challenge = challenge, .connector_key = sk + 32, .nonce = nonce,
                                  .binding = binding};
    for (int stage = 0; stage < 3 && !rc;) { /* 0 HELLO_ACK, 1 AUTH_CHALLENGE, 2 AUTH_OK */
        if ((rc = kv_rcl_frame(c, &m, d))) break;
        if (m.h.type == KV_RING_ERROR) {
            rc = kv_fail(d, m.u.error.code, "%s", m.u.error.msg);
            break;
        }
        if (m.h.type != (stage == 0 ? KV_RING_HELLO_ACK : stage == 1 ? KV_RING_AUTH_CHALLENGE : KV_RING_AUTH_OK)) {
            rc = kv_fail(d, KV_EPROTO, "ring: frame type %u from the node during the handshake", m.h.type);
            break;
        }
        if (stage == 0) {
            if (m.u.hello.role != KV_RING_ROLE_LINK) {
                rc = kv_fail(d, KV_EPROTO, "ring: the peer at %s is not a ring node", addr);
                break;
            }
            *n_vocab = m.u.hello.n_vocab;
            memcpy(model_id, m.u.hello.model_id, sizeof model_id);
        } else if (stage == 1) {
            memcpy(node_key, m.u.auth.key, 32);
            memcpy(challenge, m.u.auth.nonce, 32);
            randombytes_buf(nonce, sizeof nonce);
            kv_ring_auth a = {0};
            memcpy(a.key, sk + 32, 32);
            memcpy(a.nonce, nonce, 32);
            if (voucher) {
                a.voucher_expires_ms = voucher->expires_ms;
                memcpy(a.voucher_sig, voucher->sig, 64);
            }
            kv_link_transcript_sign(&t, KV_LINK_CONNECTOR, sk, a.sig);
            if ((rc = kv_ring_auth_encode(c->buf, c->cap, KV_RING_AUTH, &a, &n, d)) ||
                (rc = kv_rcl_send(c, c->buf, n, d)))
                break;
        } else {
            if (kv_link_transcript_verify(&t, KV_LINK_ACCEPTOR, node_key, m.u.auth.sig))
                rc = kv_fail(d, KV_EAUTH, "ring: the node at %s did not prove its key", addr);
        }
        stage++;
    }
    sodium_memzero(sk, sizeof sk);
    return rc;
}

static void kv_rcl_close(kv_rcl *c) {
    free(c->buf);
    kv_tls_free(c->tls);
    kv_tls_ctx_free(c->ctx);
    c->tls = NULL;
    c->ctx = NULL;
    c->buf = NULL;
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
}

int kv_ring_request_ex(const char *addr, const kv_ring_req *q, kv_ring_result *res, kv_diag *d) {
    memset(res, 0, sizeof *res);
    const bool chat = q->n_msgs > 0, toks = q->n_tokens > 0;
    size_t body = 0;
    if (toks) {
        if (q->n_tokens > KV_RING_MAX_PROMPT)
            return kv_fail(d, KV_EINVAL, "ring: a prompt of %u tokens, at most %u", q->n_tokens, KV_RING_MAX_PROMPT);
        body = 4 * (size_t)q->n_tokens + kv_ring_params_size(&q->p);
    } else if (chat) {
        if (q->n_msgs > KV_RING_MAX_MSGS)
            return kv_fail(d, KV_EINVAL, "ring: %u chat messages, at most %u", q->n_msgs, KV_RING_MAX_MSGS);
        for (uint32_t i = 0; i < q->n_msgs; i++) body += 8 + q->msgs[i].len;
        if (body > KV_RING_MAX_TEXT + 8u * KV_RING_MAX_MSGS)
            return kv_fail(d, KV_EINVAL, "ring: chat messages of more than %u bytes", KV_RING_MAX_TEXT);
    } else if (q->text_len < 1 || q->text_len > KV_RING_MAX_TEXT) {
        return kv_fail(d, KV_EINVAL, "ring: prompt of %zu bytes out of range [1, %u]", q->text_len, KV_RING_MAX_TEXT);
    } else {
        body = q->text_len;
    }
    kv_rcl c = {.fd = -1, .timeout_ms = q->timeout_ms > 0 ? q->timeout_ms : 60000, .cancelled = q->cancelled,
                .data = q->data};
    float *lg = NULL;
    uint32_t n_vocab = 0;
    if (!toks) body += kv_ring_params_size(&q->p); /* the extension (v4: after the text or messages too) */
    int rc = kv_rcl_open(&c, addr, q->key_sk, q->voucher, KV_RING_HEADER + 64 + body, &n_vocab, d);
    if (rc) goto done;
    if (toks) /* checked before anything is sent: a refusal here is the client's, not the ring's */
        for (uint32_t i = 0; i < q->n_tokens && !rc; i++)
            if (q->tokens[i] < 0 || (uint32_t)q->tokens[i] >= n_vocab)
                rc = kv_fail(d, KV_EINVAL, "ring: prompt token %u is %d, outside the vocabulary [0, %u)", i, q->tokens[i],
                             n_vocab);
    if (rc) goto done;
    size_t n;
    if (toks) {
        rc = kv_ring_submit_tokens_encode(c.buf, c.cap, &q->p, q->tokens, q->n_tokens, &n, d);
    } else if (chat) {
        rc = kv_ring_submit_chat_encode(c.buf, c.cap, &q->p, q->msgs, q->n_msgs, &n, d);
    } else {
        const kv_ring_submit sb = {q->p, q->text, (uint32_t)q->text_len};
        rc = kv_ring_submit_encode(c.buf, c.cap, &sb, &n, d);
    }
    if (rc || (rc = kv_rcl_send(&c, c.buf, n, d))) goto done;
    res->submitted = true;
    kv_ring_msg m;
    for (;;) {
        if ((rc = kv_rcl_frame(&c, &m, d))) goto done;
        switch (m.h.type) {
        case KV_RING_ACCEPT:
            free(res->prompt);
            if (!(res->prompt = malloc(m.u.accept.n_tokens * sizeof *res->prompt))) {
                rc = kv_fail(d, KV_ENOMEM, "ring: out of memory");
                goto done;
            }
            for (uint32_t i = 0; i < m.u.accept.n_tokens; i++) res->prompt[i] = kv_ring_tokens_get(m.u.accept.tokens, i);
            res->n_prompt = m.u.accept.n_tokens;
            res->accepted = true;
            if (q->on_accept && q->on_accept(q->data, res->prompt, res->n_prompt)) goto done;
            break;
        case KV_RING_TOKEN: {
            const kv_ring_token *t = &m.u.token;
            if (!res->accepted) {
                rc = kv_fail(d, KV_EPROTO, "ring: a token before the request was accepted");
                goto done;
            }
            if (t->n_logits && t->n_logits != n_vocab) {
                rc = kv_fail(d, KV_EPROTO, "ring: a token with %u logits, the model has %u", t->n_logits, n_vocab);
                goto done;
            }
            if ((uint32_t)t->token >= n_vocab) {
                rc = kv_fail(d, KV_EPROTO, "ring: token %d outside the vocabulary of %u", t->token, n_vocab);
                goto done;
            }
            if (t->n_logits && !lg && !(lg = malloc((size_t)n_vocab * sizeof *lg))) {
                rc = kv_fail(d, KV_ENOMEM, "ring: out of memory");
                goto done;
            }
            if (t->n_logits) kv_ring_floats_get(t->logits, t->n_logits, lg);
            if (t->has_lp && (t->lp.token != t->token || (uint32_t)t->lp.token >= n_vocab)) {
                rc = kv_fail(d, KV_EPROTO, "ring: a log-probability of another token");
                goto done;
            }
            for (uint32_t i = 0; t->has_lp && i < t->lp.n_top; i++)
                if ((uint32_t)t->lp.top_id[i] >= n_vocab) {
                    rc = kv_fail(d, KV_EPROTO, "ring: a log-probability alternative outside the vocabulary");
                    goto done;
                }
            if (q->on_logprob && (q->p.flags & KV_RING_SUBMIT_LOGPROBS)) q->on_logprob(q->data, t->has_lp ? &t->lp : NULL);
            res->n_tokens++;
            res->stop = t->stop;
            if (!(t->spec & KV_RING_TOKEN_MORE)) res->spec_passes++;
            res->spec_drafted += KV_RING_TOKEN_VERIFIED(t->spec);
            res->spec_accepted += KV_RING_TOKEN_ACCEPTED(t->spec);
            if (q->on_token && q->on_token(q->data, t->token, t->piece, t->piece_len, t->n_logits ? lg : NULL, t->n_logits))
                goto done;
            if (t->stop) goto done;
            break;
        }
        case KV_RING_CACHED: /* v5: before the first token, the prompt tokens the nodes' caches gave */
            if (!res->accepted || res->n_tokens || m.u.cached.n_cached >= res->n_prompt) {
                rc = kv_fail(d, KV_EPROTO, "ring: CACHED of %u tokens out of place (prompt of %u, %u tokens streamed)",
                             m.u.cached.n_cached, res->n_prompt, res->n_tokens);
                goto done;
            }
            res->cache_looked = true;
            res->n_cached = m.u.cached.n_cached;
            break;
        case KV_RING_ERROR:
            rc = kv_fail(d, m.u.error.code, "%s", m.u.error.msg);
            goto done;
        default:
            rc = kv_fail(d, KV_EPROTO, "ring: unexpected frame type %u from the node", m.h.type);
            goto done;
        }
    }
done:
    free(lg);
    kv_rcl_close(&c);
    return rc;
}

int kv_ring_status_get(const char *addr, const uint8_t *key_sk, int timeout_ms, kv_ring_status *out, kv_diag *d) {
    return kv_ring_status_get_v(addr, key_sk, NULL, timeout_ms, out, d);
}

int kv_ring_status_get_v(const char *addr, const uint8_t *key_sk, const kv_voucher *voucher, int timeout_ms,
                         kv_ring_status *out, kv_diag *d) {
    memset(out, 0, sizeof *out);
    kv_rcl c = {.fd = -1, .timeout_ms = timeout_ms > 0 ? timeout_ms : 5000};
    uint32_t n_vocab = 0;
    int rc = kv_rcl_open(&c, addr, key_sk, voucher, 0, &n_vocab, d);
    size_t n;
    kv_ring_msg m;
    if (!rc && !(rc = kv_ring_status_encode(c.buf, c.cap, KV_RING_STATUS, NULL, &n, d)) &&
        !(rc = kv_rcl_send(&c, c.buf, n, d)) && !(rc = kv_rcl_frame(&c, &m, d))) {
        if (m.h.type == KV_RING_STATUS_ACK) *out = m.u.status;
        else if (m.h.type == KV_RING_ERROR) rc = kv_fail(d, m.u.error.code, "%s", m.u.error.msg);
        else rc = kv_fail(d, KV_EPROTO, "ring: frame type %u in answer to STATUS", m.h.type);
    }
    kv_rcl_close(&c);
    return rc;
}

int kv_ring_vocab_get(const char *addr, const uint8_t *key_sk, const kv_voucher *voucher, int timeout_ms,
                      uint8_t **gguf, size_t *len, kv_diag *d) {
    *gguf = NULL;
    *len = 0;
    kv_rcl c = {.fd = -1, .timeout_ms = timeout_ms > 0 ? timeout_ms : 5000};
    uint32_t n_vocab = 0;
    int rc = kv_rcl_open(&c, addr, key_sk, voucher, 0, &n_vocab, d);
    size_t n;
    kv_ring_msg m;
    if (!rc && !(rc = kv_ring_vocab_encode(c.buf, c.cap, KV_RING_VOCAB, NULL, 0, &n, d)) &&
        !(rc = kv_rcl_send(&c, c.buf, n, d)) && !(rc = kv_rcl_frame(&c, &m, d))) {
        if (m.h.type == KV_RING_VOCAB_ACK) {
            if (!(*gguf = malloc(m.u.vocab.len))) rc = kv_fail(d, KV_ENOMEM, "ring: out of memory");
            else memcpy(*gguf, m.u.vocab.gguf, *len = m.u.vocab.len);
        } else if (m.h.type == KV_RING_ERROR) {
            rc = kv_fail(d, m.u.error.code, "%s", m.u.error.msg);
        } else {
            rc = kv_fail(d, KV_EPROTO, "ring: frame type %u in answer to VOCAB", m.h.type);
        }
    }
    kv_rcl_close(&c);
    return rc;
}

void kv_ring_result_free(kv_ring_result *r) {
    if (!r) return;
    free(r->prompt);
    r->prompt = NULL;
}

int kv_ring_draft_params(const char *spec, uint32_t k, kv_ring_params *p, int32_t **rec, kv_diag *d) {
    *rec = NULL;
    if (!spec || !spec[0] || !strcmp(spec, "none")) return 0;
    if (k > KV_RING_MAX_DRAFT) return kv_fail(d, KV_EINVAL, "--draft-max: %u exceeds %u", k, KV_RING_MAX_DRAFT);
    p->draft_max = k ? k : 3;
    if (!strcmp(spec, "ngram")) {
        p->draft_kind = KV_RING_DRAFT_NGRAM;
    } else if (!strcmp(spec, "mtp")) { /* the tail runs the model's MTP block (docs/SPECULATIVE.md) */
        p->draft_kind = KV_RING_DRAFT_MTP;
    } else if (!strncmp(spec, "test:", 5)) {
        uint32_t n_rec = 0;
        int rc = kv_draft_test_load(spec + 5, KV_RING_MAX_VOCAB, rec, &n_rec, &p->draft_p, &p->draft_seed, d);
        if (rc) return rc;
        if (n_rec > KV_RING_MAX_DRAFT_REC) {
            free(*rec);
            *rec = NULL;
            return kv_fail(d, KV_ERANGE, "--draft test: %u recorded tokens exceed the %u a ring request carries", n_rec,
                           KV_RING_MAX_DRAFT_REC);
        }
        p->draft_kind = KV_RING_DRAFT_TEST;
        p->n_draft_rec = n_rec;
        p->draft_rec = *rec;
    } else {
        return kv_fail(d, KV_EINVAL, "--draft: unknown source '%.64s' (ngram, mtp, none or test:FILE:P over a ring)", spec);
    }
    p->flags |= KV_RING_SUBMIT_EXT | KV_RING_SUBMIT_DRAFT;
    return 0;
}
