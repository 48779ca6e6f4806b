/* libFuzzer target for the ring frame decoder (src/ring/proto.c).
 *
 * Decodes the input (an exact-size copy, so a read past the end is an ASan
 * error), alone and as a stream of frames sized by their headers as a node
 * reads them. Whatever decodes must satisfy the promised bounds (counts
 * within their maxima, sizes exact, floats finite) and must re-encode to
 * the same bytes: the encoding is canonical, so a decoder that accepted
 * something the encoder would never write, or read a field differently
 * than it is written, traps. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/ring.h"

#define CHECK(x)                    \
    do {                            \
        if (!(x)) __builtin_trap(); \
    } while (0)

static uint8_t out[KV_RING_HEADER + KV_RING_MAX_PAYLOAD];

static void reencode(const uint8_t *f, size_t n, const kv_ring_msg *m) {
    kv_diag d = {0};
    size_t k = 0;
    int rc = -1;
    switch (m->h.type) {
    case KV_RING_HELLO:
    case KV_RING_HELLO_ACK: rc = kv_ring_hello_encode(out, sizeof out, m->h.type, &m->u.hello, &k, &d); break;
    case KV_RING_SUBMIT:
        CHECK(m->u.submit.text_len >= 1 && m->u.submit.text_len <= KV_RING_MAX_TEXT);
        rc = kv_ring_submit_encode(out, sizeof out, &m->u.submit, &k, &d);
        break;
    case KV_RING_SUBMIT_CHAT: {
        const kv_ring_submit_chat *c = &m->u.chat;
        CHECK(c->n_msgs >= 1 && c->n_msgs <= KV_RING_MAX_MSGS && c->text_bytes <= KV_RING_MAX_TEXT);
        kv_chat_msg *cm = malloc(c->n_msgs * sizeof *cm);
        CHECK(cm);
        const uint8_t *at = c->msgs;
        uint64_t total = 0;
        for (uint32_t i = 0; i < c->n_msgs; i++) {
            uint32_t role, ml;
            const char *content;
            at = kv_ring_chat_next(at, &role, &content, &ml);
            CHECK(at <= f + n && content >= (const char *)c->msgs && content + ml <= (const char *)f + n);
            cm[i] = (kv_chat_msg){kv_ring_chat_role_name(role), content, ml};
            CHECK(cm[i].role);
            total += ml;
        }
        CHECK(at == f + n && total == c->text_bytes);
        rc = kv_ring_submit_chat_encode(out, sizeof out, &c->p, cm, c->n_msgs, &k, &d);
        free(cm);
        break;
    }
    case KV_RING_STATUS:
    case KV_RING_STATUS_ACK:
        if (m->h.type == KV_RING_STATUS_ACK)
            CHECK(m->u.status.first <= m->u.status.last && m->u.status.last < m->u.status.n_layer &&
                  strlen(m->u.status.msg) <= KV_RING_MAX_MSG);
        rc = kv_ring_status_encode(out, sizeof out, m->h.type, &m->u.status, &k, &d);
        break;
    case KV_RING_SUBMIT_TOKENS: {
        const kv_ring_submit_tokens *st = &m->u.stok;
        CHECK(st->n_tokens >= 1 && st->n_tokens <= KV_RING_MAX_PROMPT && st->p.n_gen == 0);
        CHECK(st->p.sample.n_bias <= KV_SAMPLE_MAX_BIAS && st->p.grammar_len <= KV_RING_MAX_GRAMMAR);
        int32_t *t = malloc(st->n_tokens * sizeof *t);
        CHECK(t);
        for (uint32_t i = 0; i < st->n_tokens; i++) t[i] = kv_ring_tokens_get(st->tokens, i);
        rc = kv_ring_submit_tokens_encode(out, sizeof out, &st->p, t, st->n_tokens, &k, &d);
        free(t);
        break;
    }
    case KV_RING_VOCAB:
    case KV_RING_VOCAB_ACK:
        CHECK(m->h.type == KV_RING_VOCAB || (m->u.vocab.len >= 1 && m->u.vocab.len <= KV_RING_MAX_VOCAB_BYTES));
        rc = kv_ring_vocab_encode(out, sizeof out, m->h.type, m->u.vocab.gguf, m->u.vocab.len, &k, &d);
        break;
    case KV_RING_ACCEPT:
    case KV_RING_START: {
        const uint32_t nt = m->h.type == KV_RING_START ? m->u.start.n_tokens : m->u.accept.n_tokens;
        const uint8_t *tp = m->h.type == KV_RING_START ? m->u.start.tokens : m->u.accept.tokens;
        CHECK(nt >= 1 && nt <= KV_RING_MAX_PROMPT);
        int32_t *t = malloc(nt * sizeof *t);
        CHECK(t);
        for (uint32_t i = 0; i < nt; i++) {
            t[i] = kv_ring_tokens_get(tp, i);
            CHECK(t[i] >= 0 && (uint32_t)t[i] < KV_RING_MAX_VOCAB);
        }
        if (m->h.type == KV_RING_START) {
            CHECK(m->u.start.seq != 0);
            rc = kv_ring_start_encode(out, sizeof out, &m->u.start, t, &k, &d);
        } else {
            rc = kv_ring_accept_encode(out, sizeof out, m->u.accept.seq, t, nt, &k, &d);
        }
        free(t);
        break;
    }
    case KV_RING_HIDDEN: {
        const kv_ring_hidden *h = &m->u.hidden;
        CHECK(kv_ring_hidden_size(h->n_tokens, h->n_embd) == n - KV_RING_HEADER);
        const size_t nf = (size_t)h->n_tokens * h->n_embd;
        float *x = malloc(nf * sizeof *x);
        CHECK(x);
        kv_ring_floats_get(h->x, (uint32_t)nf, x);
        for (size_t i = 0; i < nf; i++) CHECK(isfinite(x[i]));
        rc = kv_ring_hidden_encode(out, sizeof out, h, x, &k, &d);
        free(x);
        break;
    }
    case KV_RING_TOKEN: {
        const kv_ring_token *t = &m->u.token;
        CHECK((t->has_lp ? kv_ring_token_size_lp(t->piece_len, t->n_logits, t->lp.n_top)
                         : kv_ring_token_size(t->piece_len, t->n_logits)) + 4u * t->n_draft == n - KV_RING_HEADER);
        CHECK(!t->has_lp || (t->lp.token == t->token && isfinite(t->lp.logprob)));
        float *lg = malloc((t->n_logits ? t->n_logits : 1) * sizeof *lg);
        CHECK(lg);
        kv_ring_floats_get(t->logits, t->n_logits, lg);
        for (uint32_t i = 0; i < t->n_logits; i++) CHECK(isfinite(lg[i]));
        rc = kv_ring_token_encode(out, sizeof out, t, lg, &k, &d);
        free(lg);
        break;
    }
    case KV_RING_ERROR:
        CHECK(m->u.error.code < 0 && strlen(m->u.error.msg) <= KV_RING_MAX_MSG);
        rc = kv_ring_error_encode(out, sizeof out, m->u.error.seq, m->u.error.code, m->u.error.origin, m->u.error.msg,
                                  &k, &d);
        break;
    case KV_RING_BROKEN:
        rc = kv_ring_broken_encode(out, sizeof out, m->u.broken.origin, m->u.broken.msg, &k, &d);
        break;
    case KV_RING_PROBE: rc = kv_ring_probe_encode(out, sizeof out, &m->u.probe, &k, &d); break;
    case KV_RING_AUTH_CHALLENGE:
    case KV_RING_AUTH:
    case KV_RING_AUTH_OK: rc = kv_ring_auth_encode(out, sizeof out, m->h.type, &m->u.auth, &k, &d); break;
    case KV_RING_LOOKUP: {
        const kv_ring_lookup *l = &m->u.lookup;
        CHECK(l->seq && l->n_match <= l->n_blocks && kv_ring_lookup_size(l->block_tokens, l->n_blocks));
        const uint32_t nt = l->n_blocks * l->block_tokens;
        int32_t *t = malloc(nt * sizeof *t);
        CHECK(t);
        for (uint32_t i = 0; i < nt; i++) t[i] = kv_ring_tokens_get(l->tokens, i);
        rc = kv_ring_lookup_encode(out, sizeof out, l, t, l->state, &k, &d);
        free(t);
        break;
    }
    case KV_RING_CACHED:
        rc = kv_ring_cached_encode(out, sizeof out, m->u.cached.id, m->u.cached.n_cached, &k, &d);
        break;
    default: CHECK(0);
    }
    CHECK(rc == 0);
    CHECK(k == n);
    CHECK(!memcmp(out, f, n));
}

static void one(const uint8_t *f, size_t n) {
    kv_ring_msg m;
    kv_diag d = {0};
    int rc = kv_ring_decode(f, n, &m, &d);
    if (rc) {
        CHECK(rc == KV_EPROTO || rc == KV_ERANGE || rc == KV_EUNSUPPORTED);
        CHECK(d.code == rc && d.msg[0]);
        return;
    }
    CHECK(m.h.magic == KV_RING_MAGIC && m.h.type >= 1 && m.h.type < KV_RING_TYPE_COUNT);
    CHECK(m.h.len == n - KV_RING_HEADER && m.h.len <= KV_RING_MAX_PAYLOAD);
    reencode(f, n, &m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy) return 0;
    if (size) memcpy(copy, data, size);
    one(copy, size);
    size_t at = 0;
    while (size - at >= KV_RING_HEADER) {
        kv_ring_header h;
        kv_diag d = {0};
        if (kv_ring_header_decode(copy + at, size - at, &h, &d)) break;
        const size_t fl = KV_RING_HEADER + (size_t)h.len;
        if (fl > size - at) break;
        uint8_t *f = malloc(fl);
        if (!f) break;
        memcpy(f, copy + at, fl);
        one(f, fl);
        free(f);
        at += fl;
    }
    free(copy);
    return 0;
}
