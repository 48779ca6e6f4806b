/* The ring protocol codec (include/kvasir/ring.h, docs/PROTOCOL.md "Ring
 * protocol"): frames to and from bytes.
 *
 * Invariants: the decoder reads one complete frame through a bounded
 * reader; every count is checked against its named maximum, and the exact
 * payload size is computed from the counts (no product overflows: each
 * factor is bounded first) and compared with the bytes present before any
 * array is looked at; floats from the wire must be finite; decoded arrays
 * are views into the frame. Integers are little-endian, read and written
 * byte by byte; the encoding is canonical (what decodes re-encodes to the
 * same bytes, which the fuzz target checks). Nothing here allocates. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kvasir/engine.h" /* KV_STOP_* */
#include "kvasir/link.h"
#include "kvasir/ring.h"


static inline uint32_t kv_rg32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t kv_rg64(const uint8_t *p) { return (uint64_t)kv_rg32(p) | ((uint64_t)kv_rg32(p + 4) << 32); }
static inline void kv_wg16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static inline void kv_wg32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}
static inline void kv_wg64(uint8_t *p, uint64_t v) {
    kv_wg32(p, (uint32_t)v);
    kv_wg32(p + 4, (uint32_t)(v >> 32));
}
static inline float kv_bits_f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint32_t kv_f_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline double kv_bits_d(uint64_t u) {
    double f;
    memcpy(&f, &u, 8);
    return f;
}
static inline uint64_t kv_d_bits(double f) {
    uint64_t u;
    memcpy(&u, &f, 8);
    return u;
}
/* exponent all ones: Inf or NaN */
static inline bool kv_bits_finite(uint32_t u) { return (u & 0x7f800000u) != 0x7f800000u; }

int32_t kv_ring_tokens_get(const uint8_t *tokens, uint32_t i) { return (int32_t)kv_rg32(tokens + 4 * (size_t)i); }

void kv_ring_floats_get(const uint8_t *src, uint32_t n, float *dst) {
    for (uint32_t i = 0; i < n; i++) dst[i] = kv_bits_f(kv_rg32(src + 4 * (size_t)i));
}

static bool kv_floats_finite(const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!kv_bits_finite(kv_rg32(p + 4 * i))) return false;
    return true;
}

/* ---- sizes ------------------------------------------------------------------ */

#define KV_RING_HELLO_SIZE (24u + KV_RING_MODEL_ID_LEN)
#define KV_RING_PARAMS_SIZE 40u
#define KV_RING_HIDDEN_FIXED 24u
#define KV_RING_TOKEN_FIXED 36u
#define KV_RING_START_FIXED (20u + KV_RING_PARAMS_SIZE + 4u) /* v5: n_cached after flags */
#define KV_RING_LOOKUP_FIXED 24u

size_t kv_ring_hidden_size(uint32_t n_tokens, uint32_t n_embd) {
    if (n_tokens < 1 || n_tokens > KV_RING_MAX_TOKENS || n_embd < 1 || n_embd > KV_RING_MAX_EMBD) return 0;
    const uint64_t xb = (uint64_t)n_tokens * n_embd * 4u;
    if (xb > KV_RING_MAX_HIDDEN_BYTES) return 0;
    return KV_RING_HIDDEN_FIXED + (size_t)xb;
}

size_t kv_ring_token_size(uint32_t piece_len, uint32_t n_logits) {
    if (piece_len > KV_RING_MAX_PIECE || n_logits > KV_RING_MAX_VOCAB) return 0;
    return KV_RING_TOKEN_FIXED + piece_len + 4u * (size_t)n_logits;
}

size_t kv_ring_token_size_lp(uint32_t piece_len, uint32_t n_logits, uint32_t n_top) {
    const size_t base = kv_ring_token_size(piece_len, n_logits);
    if (!base || n_top > KV_SAMPLE_MAX_TOP) return 0;
    return base + 12u + 12u * (size_t)n_top;
}

/* ---- header ------------------------------------------------------------------ */

int kv_ring_header_decode(const uint8_t *hdr, size_t n, kv_ring_header *out, kv_diag *d) {
    if (n < KV_RING_HEADER) return kv_fail(d, KV_EPROTO, "ring: frame of %zu bytes is shorter than its header", n);
    out->magic = kv_rg32(hdr);
    out->version = (uint16_t)(hdr[4] | (hdr[5] << 8));
    out->type = (uint16_t)(hdr[6] | (hdr[7] << 8));
    out->len = kv_rg32(hdr + 8);
    if (out->magic != KV_RING_MAGIC) return kv_fail(d, KV_EPROTO, "ring: bad magic 0x%08x (not a ring peer)", out->magic);
    if (out->version != KV_RING_VERSION)
        return kv_fail(d, KV_EUNSUPPORTED, "ring: protocol version %u, this node speaks %u", out->version,
                       KV_RING_VERSION);
    if (out->type < 1 || out->type >= KV_RING_TYPE_COUNT)
        return kv_fail(d, KV_EPROTO, "ring: unknown frame type %u", out->type);
    if (out->len > KV_RING_MAX_PAYLOAD)
        return kv_fail(d, KV_ERANGE, "ring: payload of %u bytes exceeds max %u", out->len, KV_RING_MAX_PAYLOAD);
    return 0;
}

static int kv_hdr_put(uint8_t *out, size_t cap, uint16_t type, size_t len, size_t *n, kv_diag *d) {
    if (len > KV_RING_MAX_PAYLOAD) return kv_fail(d, KV_ERANGE, "ring: payload of %zu bytes exceeds max", len);
    if (cap < KV_RING_HEADER + len)
        return kv_fail(d, KV_ERANGE, "ring: frame of %zu bytes does not fit in %zu", KV_RING_HEADER + len, cap);
    kv_wg32(out, KV_RING_MAGIC);
    kv_wg16(out + 4, KV_RING_VERSION);
    kv_wg16(out + 6, type);
    kv_wg32(out + 8, (uint32_t)len);
    *n = KV_RING_HEADER + len;
    return 0;
}

/* ---- pieces ------------------------------------------------------------------ */

static bool kv_hex_id(const uint8_t *p) {
    uint8_t b[KV_RING_MODEL_ID_LEN / 2];
    return kv_unhex((const char *)p, KV_RING_MODEL_ID_LEN, b, sizeof b, false) == 0;
}

static int kv_params_get(const uint8_t *p, kv_ring_params *o, kv_diag *d) {
    o->flags = kv_rg32(p);
    o->n_predict = kv_rg32(p + 4);
    const uint32_t fb[5] = {kv_rg32(p + 8), kv_rg32(p + 16), kv_rg32(p + 20), kv_rg32(p + 24), 0};
    for (int i = 0; i < 4; i++)
        if (!kv_bits_finite(fb[i])) return kv_fail(d, KV_EPROTO, "ring: a sampling parameter is not finite");
    o->sample.temp = kv_bits_f(fb[0]);
    o->sample.top_k = (int32_t)kv_rg32(p + 12);
    o->sample.top_p = kv_bits_f(fb[1]);
    o->sample.min_p = kv_bits_f(fb[2]);
    o->sample.repeat_penalty = kv_bits_f(fb[3]);
    o->sample.repeat_last_n = (int32_t)kv_rg32(p + 28);
    o->sample.seed = kv_rg64(p + 32);
    if (o->flags & ~(KV_RING_SUBMIT_LOGITS | KV_RING_SUBMIT_IGNORE_EOG | KV_RING_SUBMIT_EXT | KV_RING_SUBMIT_LOGPROBS |
                     KV_RING_SUBMIT_DRAFT))
        return kv_fail(d, KV_EPROTO, "ring: unknown request flags 0x%x", o->flags);
    if ((o->flags & (KV_RING_SUBMIT_LOGPROBS | KV_RING_SUBMIT_DRAFT)) && !(o->flags & KV_RING_SUBMIT_EXT))
        return kv_fail(d, KV_EPROTO, "ring: LOGPROBS or DRAFT without the sampling extension");
    if (o->n_predict < 1 || o->n_predict > (1u << 20))
        return kv_fail(d, KV_ERANGE, "ring: n_predict %u out of range [1, %u]", o->n_predict, 1u << 20);
    const kv_sample_params *s = &o->sample;
    if (!(s->temp >= 0.0f && s->temp <= 100.0f) || !(s->top_p > 0.0f && s->top_p <= 1.0f) ||
        !(s->min_p >= 0.0f && s->min_p <= 1.0f) || !(s->repeat_penalty >= 1e-3f && s->repeat_penalty <= 100.0f) ||
        s->top_k < 0 || s->top_k > (1 << 22) || s->repeat_last_n < 0 || s->repeat_last_n > (1 << 20))
        return kv_fail(d, KV_ERANGE, "ring: sampling parameters out of range");
    return 0;
}

static void kv_params_put(uint8_t *p, const kv_ring_params *o) {
    kv_wg32(p, o->flags);
    kv_wg32(p + 4, o->n_predict);
    kv_wg32(p + 8, kv_f_bits(o->sample.temp));
    kv_wg32(p + 12, (uint32_t)o->sample.top_k);
    kv_wg32(p + 16, kv_f_bits(o->sample.top_p));
    kv_wg32(p + 20, kv_f_bits(o->sample.min_p));
    kv_wg32(p + 24, kv_f_bits(o->sample.repeat_penalty));
    kv_wg32(p + 28, (uint32_t)o->sample.repeat_last_n);
    kv_wg64(p + 32, o->sample.seed);
}


/* ---- the sampling extension ---------------------------------------------------
 * f32 presence_penalty, f32 frequency_penalty, u32 top_logprobs, u32 n_gen,
 * u32 n_bias, u32 grammar_len, {i32 token, f32 bias}[n_bias], grammar; with
 * the DRAFT flag the draft block follows: u32 kind, u32 k, f64 p, u64 seed,
 * u32 n_rec, i32 rec[n_rec]. */
#define KV_RING_EXT_FIXED 24u
#define KV_RING_DRAFT_FIXED 28u

size_t kv_ring_params_size(const kv_ring_params *p) {
    if (!(p->flags & KV_RING_SUBMIT_EXT)) return KV_RING_PARAMS_SIZE;
    const size_t dr = p->flags & KV_RING_SUBMIT_DRAFT ? KV_RING_DRAFT_FIXED + 4u * (size_t)p->n_draft_rec : 0;
    return KV_RING_PARAMS_SIZE + KV_RING_EXT_FIXED + 8u * (size_t)p->sample.n_bias + p->grammar_len + dr;
}

/* The draft block's fields in range (decoded or about to be encoded). */
static int kv_draft_check(const kv_ring_params *o, kv_diag *d) {
    if (o->draft_kind != KV_RING_DRAFT_NGRAM && o->draft_kind != KV_RING_DRAFT_TEST && o->draft_kind != KV_RING_DRAFT_MTP)
        return kv_fail(d, KV_EPROTO, "ring: unknown draft source %u", o->draft_kind);
    if (o->draft_max < 1 || o->draft_max > KV_RING_MAX_DRAFT)
        return kv_fail(d, KV_ERANGE, "ring: draft k %u out of range [1, %u]", o->draft_max, KV_RING_MAX_DRAFT);
    if (o->draft_kind != KV_RING_DRAFT_TEST && (o->n_draft_rec || o->draft_p != 0 || o->draft_seed))
        return kv_fail(d, KV_EPROTO, "ring: an ngram or mtp draft carries no recording");
    if (o->draft_kind == KV_RING_DRAFT_TEST &&
        (!(o->draft_p >= 0.0 && o->draft_p <= 1.0) || o->n_draft_rec < 1 || o->n_draft_rec > KV_RING_MAX_DRAFT_REC))
        return kv_fail(d, KV_ERANGE, "ring: test draft of acceptance %g and %u recorded tokens out of range", o->draft_p,
                       o->n_draft_rec);
    return 0;
}

/* The extension at p[left] into o: it must take exactly left bytes. */
static int kv_ext_get(const uint8_t *p, size_t left, kv_ring_params *o, kv_diag *d) {
    if (left < KV_RING_EXT_FIXED)
        return kv_fail(d, KV_EPROTO, "ring: sampling extension of %zu bytes, needs %u", left, KV_RING_EXT_FIXED);
    const uint32_t pb = kv_rg32(p), fb = kv_rg32(p + 4);
    if (!kv_bits_finite(pb) || !kv_bits_finite(fb)) return kv_fail(d, KV_EPROTO, "ring: a penalty is not finite");
    o->sample.presence_penalty = kv_bits_f(pb);
    o->sample.frequency_penalty = kv_bits_f(fb);
    o->top_logprobs = kv_rg32(p + 8);
    o->n_gen = kv_rg32(p + 12);
    o->sample.n_bias = kv_rg32(p + 16);
    o->grammar_len = kv_rg32(p + 20);
    if (!(o->sample.presence_penalty >= -2.0f && o->sample.presence_penalty <= 2.0f) ||
        !(o->sample.frequency_penalty >= -2.0f && o->sample.frequency_penalty <= 2.0f))
        return kv_fail(d, KV_ERANGE, "ring: presence / frequency penalty out of range [-2, 2]");
    if (o->top_logprobs > KV_SAMPLE_MAX_TOP)
        return kv_fail(d, KV_ERANGE, "ring: top_logprobs %u exceeds max %u", o->top_logprobs, KV_SAMPLE_MAX_TOP);
    if (o->sample.n_bias > KV_SAMPLE_MAX_BIAS)
        return kv_fail(d, KV_ERANGE, "ring: %u logit bias entries exceed max %u", o->sample.n_bias, KV_SAMPLE_MAX_BIAS);
    if (o->grammar_len > KV_RING_MAX_GRAMMAR)
        return kv_fail(d, KV_ERANGE, "ring: grammar of %u bytes exceeds max %u", o->grammar_len, KV_RING_MAX_GRAMMAR);
    size_t want = KV_RING_EXT_FIXED + 8u * (size_t)o->sample.n_bias + o->grammar_len;
    if (o->flags & KV_RING_SUBMIT_DRAFT) {
        if (left < want + KV_RING_DRAFT_FIXED)
            return kv_fail(d, KV_EPROTO, "ring: sampling extension of %zu bytes, needs %zu with its draft block", left,
                           want + KV_RING_DRAFT_FIXED);
        const uint8_t *q = p + want;
        o->draft_kind = kv_rg32(q);
        o->draft_max = kv_rg32(q + 4);
        o->draft_p = kv_bits_d(kv_rg64(q + 8));
        o->draft_seed = kv_rg64(q + 16);
        o->n_draft_rec = kv_rg32(q + 24);
        int rc = kv_draft_check(o, d);
        if (rc) return rc;
        o->draft_rec_wire = o->n_draft_rec ? q + KV_RING_DRAFT_FIXED : NULL;
        o->draft_rec = NULL;
        want += KV_RING_DRAFT_FIXED + 4u * (size_t)o->n_draft_rec;
        if (left != want) return kv_fail(d, KV_EPROTO, "ring: sampling extension of %zu bytes, expected %zu", left, want);
        for (uint32_t i = 0; i < o->n_draft_rec; i++)
            if (kv_ring_tokens_get(o->draft_rec_wire, i) < 0 || (uint32_t)kv_ring_tokens_get(o->draft_rec_wire, i) >= KV_RING_MAX_VOCAB)
                return kv_fail(d, KV_ERANGE, "ring: recorded draft token %u out of range", i);
    }
    if (left != want) return kv_fail(d, KV_EPROTO, "ring: sampling extension of %zu bytes, expected %zu", left, want);
    o->bias_wire = o->sample.n_bias ? p + KV_RING_EXT_FIXED : NULL;
    for (uint32_t i = 0; i < o->sample.n_bias; i++) {
        const int32_t t = (int32_t)kv_rg32(p + KV_RING_EXT_FIXED + 8 * (size_t)i);
        const uint32_t bb = kv_rg32(p + KV_RING_EXT_FIXED + 8 * (size_t)i + 4);
        if (t < 0 || (uint32_t)t >= KV_RING_MAX_VOCAB) return kv_fail(d, KV_ERANGE, "ring: logit bias token %d out of range", t);
        if (!kv_bits_finite(bb) || !(kv_bits_f(bb) >= -100.0f && kv_bits_f(bb) <= 100.0f))
            return kv_fail(d, KV_ERANGE, "ring: logit bias %u is not in [-100, 100]", i);
    }
    o->grammar = o->grammar_len ? (const char *)p + KV_RING_EXT_FIXED + 8 * (size_t)o->sample.n_bias : NULL;
    if (o->grammar_len && memchr(o->grammar, 0, o->grammar_len)) return kv_fail(d, KV_EPROTO, "ring: grammar holds a NUL byte");
    return 0;
}

/* The extension of o at p (kv_ring_params_size(o) - KV_RING_PARAMS_SIZE bytes). */
static void kv_ext_put(uint8_t *p, const kv_ring_params *o) {
    kv_wg32(p, kv_f_bits(o->sample.presence_penalty));
    kv_wg32(p + 4, kv_f_bits(o->sample.frequency_penalty));
    kv_wg32(p + 8, o->top_logprobs);
    kv_wg32(p + 12, o->n_gen);
    kv_wg32(p + 16, o->sample.n_bias);
    kv_wg32(p + 20, o->grammar_len);
    uint8_t *b = p + KV_RING_EXT_FIXED;
    for (uint32_t i = 0; i < o->sample.n_bias; i++, b += 8) {
        if (o->sample.bias) {
            kv_wg32(b, (uint32_t)o->sample.bias[i].token);
            kv_wg32(b + 4, kv_f_bits(o->sample.bias[i].bias));
        } else {
            memcpy(b, o->bias_wire + 8 * (size_t)i, 8);
        }
    }
    if (o->grammar_len) memcpy(b, o->grammar, o->grammar_len);
    if (!(o->flags & KV_RING_SUBMIT_DRAFT)) return;
    b += o->grammar_len;
    kv_wg32(b, o->draft_kind);
    kv_wg32(b + 4, o->draft_max);
    kv_wg64(b + 8, kv_d_bits(o->draft_p));
    kv_wg64(b + 16, o->draft_seed);
    kv_wg32(b + 24, o->n_draft_rec);
    for (uint32_t i = 0; i < o->n_draft_rec; i++)
        kv_wg32(b + KV_RING_DRAFT_FIXED + 4 * (size_t)i,
                o->draft_rec ? (uint32_t)o->draft_rec[i] : kv_rg32(o->draft_rec_wire + 4 * (size_t)i));
}

/* The extension's fields as the encoder takes them: in range. */
static int kv_ext_check(const kv_ring_params *o, kv_diag *d) {
    if (!(o->flags & KV_RING_SUBMIT_EXT)) { /* what only the extension carries would be lost */
        if ((o->flags & (KV_RING_SUBMIT_LOGPROBS | KV_RING_SUBMIT_DRAFT)) || o->n_gen || o->top_logprobs || o->sample.n_bias || o->grammar_len ||
            o->sample.presence_penalty != 0 || o->sample.frequency_penalty != 0)
            return kv_fail(d, KV_EINVAL, "ring: logprobs, penalties, a logit bias, a grammar or generated tokens "
                           "without the sampling extension");
        return 0;
    }
    if (o->sample.n_bias > KV_SAMPLE_MAX_BIAS || o->grammar_len > KV_RING_MAX_GRAMMAR ||
        o->top_logprobs > KV_SAMPLE_MAX_TOP || (o->sample.n_bias && !o->sample.bias && !o->bias_wire) ||
        (o->grammar_len && !o->grammar))
        return kv_fail(d, KV_ERANGE, "ring: sampling extension out of range (%u bias entries, %u grammar bytes)",
                       o->sample.n_bias, o->grammar_len);
    if (o->flags & KV_RING_SUBMIT_DRAFT) {
        int rc = kv_draft_check(o, d);
        if (rc) return rc;
        if (o->n_draft_rec && !o->draft_rec && !o->draft_rec_wire)
            return kv_fail(d, KV_EINVAL, "ring: a test draft without its recording");
    }
    return 0;
}

static size_t kv_msg_len(const char *msg);

/* A message of len bytes at p: no NUL inside (so it reads back the same). */
static int kv_msg_get(const uint8_t *p, uint32_t len, char *out, kv_diag *d) {
    if (len > KV_RING_MAX_MSG) return kv_fail(d, KV_ERANGE, "ring: message of %u bytes exceeds max %u", len, KV_RING_MAX_MSG);
    if (memchr(p, 0, len)) return kv_fail(d, KV_EPROTO, "ring: message holds a NUL byte");
    memcpy(out, p, len);
    out[len] = 0;
    return 0;
}

/* ---- decode ------------------------------------------------------------------ */

int kv_ring_decode(const uint8_t *f, size_t n, kv_ring_msg *m, kv_diag *d) {
    memset(m, 0, sizeof *m);
    int rc = kv_ring_header_decode(f, n, &m->h, d);
    if (rc) return rc;
    if ((size_t)m->h.len != n - KV_RING_HEADER)
        return kv_fail(d, KV_EPROTO, "ring: header says %u payload bytes, frame has %zu", m->h.len, n - KV_RING_HEADER);
    const uint8_t *p = f + KV_RING_HEADER;
    const size_t len = m->h.len;
#define NEED(k, what)                                                                                       \
    do {                                                                                                    \
        if (len < (size_t)(k))                                                                              \
            return kv_fail(d, KV_EPROTO, "ring: %s frame of %zu bytes, needs %zu", what, len, (size_t)(k)); \
    } while (0)
#define EXACT(k, what)                                                                                      \
    do {                                                                                                    \
        if (len != (size_t)(k))                                                                             \
            return kv_fail(d, KV_EPROTO, "ring: %s frame of %zu bytes, expected %zu", what, len, (size_t)(k)); \
    } while (0)
    switch (m->h.type) {
    case KV_RING_HELLO:
    case KV_RING_HELLO_ACK: {
        EXACT(KV_RING_HELLO_SIZE, "HELLO");
        kv_ring_hello *h = &m->u.hello;
        h->role = kv_rg32(p);
        h->n_layer = kv_rg32(p + 4);
        h->first = kv_rg32(p + 8);
        h->last = kv_rg32(p + 12);
        h->n_embd = kv_rg32(p + 16);
        h->n_vocab = kv_rg32(p + 20);
        const uint8_t *id = p + 24;
        if (h->role == KV_RING_ROLE_CLIENT) {
            for (uint32_t i = 0; i < 24 - 4; i++)
                if (p[4 + i]) return kv_fail(d, KV_EPROTO, "ring: a client's HELLO carries a window");
            for (uint32_t i = 0; i < KV_RING_MODEL_ID_LEN; i++)
                if (id[i]) return kv_fail(d, KV_EPROTO, "ring: a client's HELLO carries a model id");
            return 0;
        }
        if (h->role != KV_RING_ROLE_LINK) return kv_fail(d, KV_EPROTO, "ring: unknown role %u", h->role);
        if (h->n_layer < 1 || h->n_layer > KV_RING_MAX_LAYERS || h->first > h->last || h->last >= h->n_layer)
            return kv_fail(d, KV_ERANGE, "ring: window %u-%u of %u layers is out of range", h->first, h->last, h->n_layer);
        if (h->n_embd < 1 || h->n_embd > KV_RING_MAX_EMBD || h->n_vocab < 1 || h->n_vocab > KV_RING_MAX_VOCAB)
            return kv_fail(d, KV_ERANGE, "ring: n_embd %u / n_vocab %u out of range", h->n_embd, h->n_vocab);
        if (!kv_hex_id(id)) return kv_fail(d, KV_EPROTO, "ring: model id is not 64 lowercase hex digits");
        memcpy(h->model_id, id, KV_RING_MODEL_ID_LEN);
        h->model_id[KV_RING_MODEL_ID_LEN] = 0;
        return 0;
    }
    case KV_RING_SUBMIT: {
        NEED(KV_RING_PARAMS_SIZE + 4, "SUBMIT");
        kv_ring_submit *s = &m->u.submit;
        if ((rc = kv_params_get(p, &s->p, d))) return rc;
        s->text_len = kv_rg32(p + KV_RING_PARAMS_SIZE);
        if (s->text_len < 1 || s->text_len > KV_RING_MAX_TEXT)
            return kv_fail(d, KV_ERANGE, "ring: prompt of %u bytes out of range [1, %u]", s->text_len, KV_RING_MAX_TEXT);
        const size_t fixed = KV_RING_PARAMS_SIZE + 4 + (size_t)s->text_len;
        if (!(s->p.flags & KV_RING_SUBMIT_EXT)) EXACT(fixed, "SUBMIT");
        NEED(fixed, "SUBMIT"); /* v4: the extension may follow the text */
        if ((s->p.flags & KV_RING_SUBMIT_EXT) && (rc = kv_ext_get(p + fixed, len - fixed, &s->p, d))) return rc;
        if (s->p.n_gen) return kv_fail(d, KV_EPROTO, "ring: SUBMIT says %u tokens were generated", s->p.n_gen);
        s->text = (const char *)p + KV_RING_PARAMS_SIZE + 4;
        return 0;
    }
    case KV_RING_SUBMIT_CHAT: {
        NEED(KV_RING_PARAMS_SIZE + 4, "SUBMIT_CHAT");
        kv_ring_submit_chat *c = &m->u.chat;
        if ((rc = kv_params_get(p, &c->p, d))) return rc;
        c->n_msgs = kv_rg32(p + KV_RING_PARAMS_SIZE);
        if (c->n_msgs < 1 || c->n_msgs > KV_RING_MAX_MSGS)
            return kv_fail(d, KV_ERANGE, "ring: %u chat messages out of range [1, %u]", c->n_msgs, KV_RING_MAX_MSGS);
        size_t at = KV_RING_PARAMS_SIZE + 4;
        uint64_t text = 0;
        for (uint32_t i = 0; i < c->n_msgs; i++) {
            if (len - at < 8) return kv_fail(d, KV_EPROTO, "ring: SUBMIT_CHAT ends inside message %u", i);
            const uint32_t role = kv_rg32(p + at), ml = kv_rg32(p + at + 4);
            if (!kv_ring_chat_role_name(role)) return kv_fail(d, KV_EPROTO, "ring: chat message %u has role %u", i, role);
            if (ml > KV_RING_MAX_TEXT || (text += ml) > KV_RING_MAX_TEXT)
                return kv_fail(d, KV_ERANGE, "ring: chat messages hold more than %u bytes", KV_RING_MAX_TEXT);
            if (len - at - 8 < ml) return kv_fail(d, KV_EPROTO, "ring: chat message %u runs past the frame", i);
            at += 8 + (size_t)ml;
        }
        if (!(c->p.flags & KV_RING_SUBMIT_EXT)) EXACT(at, "SUBMIT_CHAT");
        /* v4: the extension may follow the messages */
        if ((c->p.flags & KV_RING_SUBMIT_EXT) && (rc = kv_ext_get(p + at, len - at, &c->p, d))) return rc;
        if (c->p.n_gen) return kv_fail(d, KV_EPROTO, "ring: SUBMIT_CHAT says %u tokens were generated", c->p.n_gen);
        c->text_bytes = (uint32_t)text;
        c->msgs = p + KV_RING_PARAMS_SIZE + 4;
        return 0;
    }
    case KV_RING_STATUS: EXACT(0, "STATUS"); return 0;
    case KV_RING_STATUS_ACK: {
        NEED(32, "STATUS_ACK");
        kv_ring_status *st = &m->u.status;
        st->flags = kv_rg32(p);
        st->n_layer = kv_rg32(p + 4);
        st->first = kv_rg32(p + 8);
        st->last = kv_rg32(p + 12);
        st->n_ctx = kv_rg32(p + 16);
        st->max_seqs = kv_rg32(p + 20);
        st->n_seqs = kv_rg32(p + 24);
        const uint32_t ml = kv_rg32(p + 28);
        if (st->flags & ~KV_RING_STATUS_WHOLE) return kv_fail(d, KV_EPROTO, "ring: unknown STATUS_ACK flags 0x%x", st->flags);
        if (st->n_layer < 1 || st->n_layer > KV_RING_MAX_LAYERS || st->first > st->last || st->last >= st->n_layer)
            return kv_fail(d, KV_ERANGE, "ring: STATUS_ACK window %u-%u of %u layers", st->first, st->last, st->n_layer);
        if (st->n_ctx > (1u << 20) || st->max_seqs > 4096 || st->n_seqs > st->max_seqs)
            return kv_fail(d, KV_ERANGE, "ring: STATUS_ACK limits out of range");
        if (ml > KV_RING_MAX_MSG) return kv_fail(d, KV_ERANGE, "ring: message of %u bytes exceeds max %u", ml, KV_RING_MAX_MSG);
        EXACT(32 + (size_t)ml, "STATUS_ACK");
        return kv_msg_get(p + 32, ml, st->msg, d);
    }
    case KV_RING_ACCEPT: {
        NEED(12, "ACCEPT");
        kv_ring_accept *a = &m->u.accept;
        a->seq = kv_rg64(p);
        a->n_tokens = kv_rg32(p + 8);
        if (a->n_tokens < 1 || a->n_tokens > KV_RING_MAX_PROMPT)
            return kv_fail(d, KV_ERANGE, "ring: %u prompt tokens out of range [1, %u]", a->n_tokens, KV_RING_MAX_PROMPT);
        EXACT(12 + 4 * (size_t)a->n_tokens, "ACCEPT");
        a->tokens = p + 12;
        for (uint32_t i = 0; i < a->n_tokens; i++)
            if (kv_ring_tokens_get(a->tokens, i) < 0 || (uint32_t)kv_ring_tokens_get(a->tokens, i) >= KV_RING_MAX_VOCAB)
                return kv_fail(d, KV_ERANGE, "ring: prompt token %u out of range", i);
        return 0;
    }
    case KV_RING_START: {
        NEED(KV_RING_START_FIXED, "START");
        kv_ring_start *s = &m->u.start;
        s->seq = kv_rg64(p);
        s->home = kv_rg32(p + 8);
        s->flags = kv_rg32(p + 12);
        s->n_cached = kv_rg32(p + 16);
        if ((rc = kv_params_get(p + 20, &s->p, d))) return rc;
        s->n_tokens = kv_rg32(p + 20 + KV_RING_PARAMS_SIZE);
        if (s->seq == 0) return kv_fail(d, KV_EPROTO, "ring: START of sequence 0");
        if (s->flags & ~KV_RING_START_BEGUN) return kv_fail(d, KV_EPROTO, "ring: unknown START flags 0x%x", s->flags);
        if (s->home >= KV_RING_MAX_LAYERS) return kv_fail(d, KV_ERANGE, "ring: home layer %u out of range", s->home);
        if (s->n_tokens < 1 || s->n_tokens > KV_RING_MAX_PROMPT)
            return kv_fail(d, KV_ERANGE, "ring: %u prompt tokens out of range [1, %u]", s->n_tokens, KV_RING_MAX_PROMPT);
        if (s->n_cached >= s->n_tokens)
            return kv_fail(d, KV_ERANGE, "ring: START of %u tokens takes %u from the prompt cache (the last must be "
                           "computed)", s->n_tokens, s->n_cached);
        const size_t fixed = KV_RING_START_FIXED + 4 * (size_t)s->n_tokens;
        if (!(s->p.flags & KV_RING_SUBMIT_EXT)) EXACT(fixed, "START");
        NEED(fixed, "START");
        if ((s->p.flags & KV_RING_SUBMIT_EXT) && (rc = kv_ext_get(p + fixed, len - fixed, &s->p, d))) return rc;
        if (s->p.n_gen >= s->n_tokens)
            return kv_fail(d, KV_ERANGE, "ring: START of %u tokens says %u were generated", s->n_tokens, s->p.n_gen);
        s->tokens = p + KV_RING_START_FIXED;
        for (uint32_t i = 0; i < s->n_tokens; i++)
            if (kv_ring_tokens_get(s->tokens, i) < 0 || (uint32_t)kv_ring_tokens_get(s->tokens, i) >= KV_RING_MAX_VOCAB)
                return kv_fail(d, KV_ERANGE, "ring: prompt token %u out of range", i);
        return 0;
    }
    case KV_RING_SUBMIT_TOKENS: {
        NEED(KV_RING_PARAMS_SIZE + 4, "SUBMIT_TOKENS");
        kv_ring_submit_tokens *s = &m->u.stok;
        if ((rc = kv_params_get(p, &s->p, d))) return rc;
        s->n_tokens = kv_rg32(p + KV_RING_PARAMS_SIZE);
        if (s->n_tokens < 1 || s->n_tokens > KV_RING_MAX_PROMPT)
            return kv_fail(d, KV_ERANGE, "ring: %u prompt tokens out of range [1, %u]", s->n_tokens, KV_RING_MAX_PROMPT);
        const size_t fixed = KV_RING_PARAMS_SIZE + 4 + 4 * (size_t)s->n_tokens;
        if (!(s->p.flags & KV_RING_SUBMIT_EXT)) EXACT(fixed, "SUBMIT_TOKENS");
        NEED(fixed, "SUBMIT_TOKENS");
        if ((s->p.flags & KV_RING_SUBMIT_EXT) && (rc = kv_ext_get(p + fixed, len - fixed, &s->p, d))) return rc;
        if (s->p.n_gen) return kv_fail(d, KV_EPROTO, "ring: SUBMIT_TOKENS says %u tokens were generated", s->p.n_gen);
        s->tokens = p + KV_RING_PARAMS_SIZE + 4;
        for (uint32_t i = 0; i < s->n_tokens; i++)
            if (kv_ring_tokens_get(s->tokens, i) < 0 || (uint32_t)kv_ring_tokens_get(s->tokens, i) >= KV_RING_MAX_VOCAB)
                return kv_fail(d, KV_ERANGE, "ring: prompt token %u (%d) out of range", i, kv_ring_tokens_get(s->tokens, i));
        return 0;
    }
    case KV_RING_VOCAB: EXACT(0, "VOCAB"); return 0;
    case KV_RING_VOCAB_ACK: {
        NEED(4, "VOCAB_ACK");
        m->u.vocab.len = kv_rg32(p);
        if (m->u.vocab.len < 1 || m->u.vocab.len > KV_RING_MAX_VOCAB_BYTES)
            return kv_fail(d, KV_ERANGE, "ring: tokenizer of %u bytes out of range [1, %u]", m->u.vocab.len,
                           KV_RING_MAX_VOCAB_BYTES);
        EXACT(4 + (size_t)m->u.vocab.len, "VOCAB_ACK");
        m->u.vocab.gguf = p + 4;
        return 0;
    }
    case KV_RING_HIDDEN: {
        NEED(KV_RING_HIDDEN_FIXED, "HIDDEN");
        kv_ring_hidden *h = &m->u.hidden;
        h->seq = kv_rg64(p);
        h->pos = kv_rg32(p + 8);
        h->n_tokens = kv_rg32(p + 12);
        h->flags = kv_rg32(p + 16);
        h->n_embd = kv_rg32(p + 20);
        if (h->seq == 0) return kv_fail(d, KV_EPROTO, "ring: HIDDEN of sequence 0");
        if (h->flags & ~(KV_RING_HIDDEN_LOGITS | KV_RING_HIDDEN_VERIFY))
            return kv_fail(d, KV_EPROTO, "ring: unknown HIDDEN flags 0x%x", h->flags);
        if ((h->flags & KV_RING_HIDDEN_VERIFY) &&
            (!(h->flags & KV_RING_HIDDEN_LOGITS) || h->n_tokens < 2 || h->n_tokens > KV_RING_MAX_DRAFT + 1))
            return kv_fail(d, KV_EPROTO, "ring: a VERIFY HIDDEN of %u tokens (2..%u, with LOGITS)", h->n_tokens,
                           KV_RING_MAX_DRAFT + 1);
        const size_t want = kv_ring_hidden_size(h->n_tokens, h->n_embd);
        if (!want)
            return kv_fail(d, KV_ERANGE, "ring: HIDDEN of %u tokens x %u floats is out of range", h->n_tokens, h->n_embd);
        if ((uint64_t)h->pos + h->n_tokens > (1u << 20))
            return kv_fail(d, KV_ERANGE, "ring: HIDDEN positions %u.. past max context", h->pos);
        EXACT(want, "HIDDEN");
        h->x = p + KV_RING_HIDDEN_FIXED;
        if (!kv_floats_finite(h->x, (size_t)h->n_tokens * h->n_embd))
            return kv_fail(d, KV_EPROTO, "ring: a hidden state holds NaN or Inf (a lie, not a value)");
        return 0;
    }
    case KV_RING_TOKEN: {
        NEED(KV_RING_TOKEN_FIXED, "TOKEN");
        kv_ring_token *t = &m->u.token;
        t->seq = kv_rg64(p);
        t->pos = kv_rg32(p + 8);
        t->token = (int32_t)kv_rg32(p + 12);
        t->stop = kv_rg32(p + 16);
        t->piece_len = kv_rg32(p + 20);
        t->n_logits = kv_rg32(p + 24);
        t->spec = kv_rg32(p + 28);
        t->n_draft = kv_rg32(p + 32);
        if (t->seq == 0) return kv_fail(d, KV_EPROTO, "ring: TOKEN of sequence 0");
        if (t->spec & ~(KV_RING_TOKEN_SPEC(1, 0xff, 0xff)) || KV_RING_TOKEN_VERIFIED(t->spec) > KV_RING_MAX_DRAFT ||
            KV_RING_TOKEN_ACCEPTED(t->spec) > KV_RING_TOKEN_VERIFIED(t->spec))
            return kv_fail(d, KV_EPROTO, "ring: TOKEN spec word 0x%x", t->spec);
        if (t->n_draft > KV_RING_MAX_DRAFT || (t->n_draft && (t->stop || (t->spec & KV_RING_TOKEN_MORE))))
            return kv_fail(d, KV_EPROTO, "ring: TOKEN with %u drafts (at most %u, after the last token of a pass)",
                           t->n_draft, KV_RING_MAX_DRAFT);
        if (t->token < 0 || (uint32_t)t->token >= KV_RING_MAX_VOCAB || t->pos > (1u << 20))
            return kv_fail(d, KV_ERANGE, "ring: token %d at position %u out of range", t->token, t->pos);
        if (t->stop == KV_STOP_ERROR || t->stop >= KV_STOP_COUNT)
            return kv_fail(d, KV_EPROTO, "ring: unknown stop reason %u", t->stop);
        size_t want = kv_ring_token_size(t->piece_len, t->n_logits);
        if (!want) return kv_fail(d, KV_ERANGE, "ring: TOKEN with %u text bytes and %u logits is out of range", t->piece_len, t->n_logits);
        const size_t lg_end = want;
        want += 4u * (size_t)t->n_draft;
        NEED(want, "TOKEN");
        t->piece = (const char *)p + KV_RING_TOKEN_FIXED;
        t->logits = p + KV_RING_TOKEN_FIXED + t->piece_len;
        if (!kv_floats_finite(t->logits, t->n_logits))
            return kv_fail(d, KV_EPROTO, "ring: a logit is NaN or Inf (a lie, not a value)");
        for (uint32_t i = 0; i < t->n_draft; i++) {
            t->drafts[i] = (int32_t)kv_rg32(p + lg_end + 4 * (size_t)i);
            if (t->drafts[i] < 0 || (uint32_t)t->drafts[i] >= KV_RING_MAX_VOCAB)
                return kv_fail(d, KV_ERANGE, "ring: drafted token %d out of range", t->drafts[i]);
        }
        if (len == want) return 0;
        /* the log-probability: u32 n_top, f64 logprob, {i32 id, f64 logprob}[n_top] */
        NEED(want + 12, "TOKEN");
        const uint8_t *q = p + want;
        t->has_lp = true;
        t->lp.token = t->token;
        t->lp.n_top = kv_rg32(q);
        if (t->lp.n_top > KV_SAMPLE_MAX_TOP)
            return kv_fail(d, KV_ERANGE, "ring: %u log-probability alternatives exceed max %u", t->lp.n_top, KV_SAMPLE_MAX_TOP);
        EXACT(kv_ring_token_size_lp(t->piece_len, t->n_logits, t->lp.n_top) + 4u * (size_t)t->n_draft, "TOKEN");
        t->lp.logprob = kv_bits_d(kv_rg64(q + 4));
        bool ok = isfinite(t->lp.logprob);
        for (uint32_t i = 0; i < t->lp.n_top; i++) {
            t->lp.top_id[i] = (int32_t)kv_rg32(q + 12 + 12 * (size_t)i);
            t->lp.top_logprob[i] = kv_bits_d(kv_rg64(q + 16 + 12 * (size_t)i));
            ok = ok && isfinite(t->lp.top_logprob[i]);
            if (t->lp.top_id[i] < 0 || (uint32_t)t->lp.top_id[i] >= KV_RING_MAX_VOCAB)
                return kv_fail(d, KV_ERANGE, "ring: log-probability alternative %u is token %d", i, t->lp.top_id[i]);
        }
        if (!ok) return kv_fail(d, KV_EPROTO, "ring: a log-probability is NaN or Inf (a lie, not a value)");
        return 0;
    }
    case KV_RING_LOOKUP: {
        NEED(KV_RING_LOOKUP_FIXED, "LOOKUP");
        kv_ring_lookup *l = &m->u.lookup;
        l->seq = kv_rg64(p);
        l->origin = kv_rg32(p + 8);
        l->block_tokens = kv_rg32(p + 12);
        l->n_blocks = kv_rg32(p + 16);
        l->n_match = kv_rg32(p + 20);
        if (l->seq == 0) return kv_fail(d, KV_EPROTO, "ring: LOOKUP of sequence 0");
        if (l->origin >= KV_RING_MAX_LAYERS) return kv_fail(d, KV_ERANGE, "ring: origin layer %u out of range", l->origin);
        const size_t want = kv_ring_lookup_size(l->block_tokens, l->n_blocks);
        if (!want)
            return kv_fail(d, KV_ERANGE, "ring: LOOKUP of %u blocks of %u tokens out of range (blocks of 1..%u tokens, "
                           "%u tokens in all)", l->n_blocks, l->block_tokens, KV_RING_MAX_CACHE_BLOCK, KV_RING_MAX_PROMPT);
        if (l->n_match > l->n_blocks)
            return kv_fail(d, KV_ERANGE, "ring: LOOKUP matched %u of %u blocks", l->n_match, l->n_blocks);
        EXACT(want, "LOOKUP");
        l->tokens = p + KV_RING_LOOKUP_FIXED;
        const uint32_t nt = l->n_blocks * l->block_tokens;
        for (uint32_t i = 0; i < nt; i++)
            if (kv_ring_tokens_get(l->tokens, i) < 0 || (uint32_t)kv_ring_tokens_get(l->tokens, i) >= KV_RING_MAX_VOCAB)
                return kv_fail(d, KV_ERANGE, "ring: LOOKUP token %u out of range", i);
        l->state = l->tokens + 4 * (size_t)nt;
        if (l->n_blocks % 8 && (l->state[l->n_blocks / 8] >> (l->n_blocks % 8)))
            return kv_fail(d, KV_EPROTO, "ring: LOOKUP state bits past its %u blocks", l->n_blocks);
        return 0;
    }
    case KV_RING_CACHED:
        EXACT(12, "CACHED");
        m->u.cached.id = kv_rg64(p);
        m->u.cached.n_cached = kv_rg32(p + 8);
        if (m->u.cached.n_cached >= KV_RING_MAX_PROMPT)
            return kv_fail(d, KV_ERANGE, "ring: CACHED of %u tokens out of range", m->u.cached.n_cached);
        return 0;
    case KV_RING_ERROR: {
        NEED(20, "ERROR");
        kv_ring_error *e = &m->u.error;
        e->seq = kv_rg64(p);
        e->code = (int32_t)kv_rg32(p + 8);
        e->origin = kv_rg32(p + 12);
        const uint32_t ml = kv_rg32(p + 16);
        if (e->code >= 0 || e->code <= -KV_ERR_COUNT) return kv_fail(d, KV_EPROTO, "ring: error code %d is not a KV_E* code", e->code);
        if (e->origin >= KV_RING_MAX_LAYERS) return kv_fail(d, KV_ERANGE, "ring: origin layer %u out of range", e->origin);
        if (ml > KV_RING_MAX_MSG) return kv_fail(d, KV_ERANGE, "ring: message of %u bytes exceeds max %u", ml, KV_RING_MAX_MSG);
        EXACT(20 + (size_t)ml, "ERROR");
        return kv_msg_get(p + 20, ml, e->msg, d);
    }
    case KV_RING_BROKEN: {
        NEED(8, "BROKEN");
        kv_ring_broken *b = &m->u.broken;
        b->origin = kv_rg32(p);
        const uint32_t ml = kv_rg32(p + 4);
        if (b->origin >= KV_RING_MAX_LAYERS) return kv_fail(d, KV_ERANGE, "ring: origin layer %u out of range", b->origin);
        if (ml > KV_RING_MAX_MSG) return kv_fail(d, KV_ERANGE, "ring: message of %u bytes exceeds max %u", ml, KV_RING_MAX_MSG);
        EXACT(8 + (size_t)ml, "BROKEN");
        return kv_msg_get(p + 8, ml, b->msg, d);
    }
    case KV_RING_AUTH_CHALLENGE:
        EXACT(64, "AUTH_CHALLENGE");
        memcpy(m->u.auth.key, p, 32);
        memcpy(m->u.auth.nonce, p + 32, 32);
        return 0;
    case KV_RING_AUTH:
        if (len != 128) EXACT(200, "AUTH"); /* 128, or 200 with a hub voucher */
        memcpy(m->u.auth.key, p, 32);
        memcpy(m->u.auth.nonce, p + 32, 32);
        memcpy(m->u.auth.sig, p + 64, 64);
        if (len == 200) {
            m->u.auth.voucher_expires_ms = kv_rg64(p + 128);
            memcpy(m->u.auth.voucher_sig, p + 136, 64);
            if (!m->u.auth.voucher_expires_ms) return kv_fail(d, KV_EPROTO, "ring: AUTH with a voucher that expires at 0");
        }
        return 0;
    case KV_RING_AUTH_OK:
        EXACT(64, "AUTH_OK");
        memcpy(m->u.auth.sig, p, 64);
        return 0;
    case KV_RING_PROBE: {
        EXACT(16, "PROBE");
        kv_ring_probe *q = &m->u.probe;
        q->origin = kv_rg32(p);
        q->kind = kv_rg32(p + 4);
        q->nonce = kv_rg64(p + 8);
        if (q->origin >= KV_RING_MAX_LAYERS || (q->kind != 1 && q->kind != 2))
            return kv_fail(d, KV_EPROTO, "ring: PROBE of origin %u, kind %u", q->origin, q->kind);
        return 0;
    }
    default: return kv_fail(d, KV_EPROTO, "ring: unknown frame type %u", m->h.type);
    }
#undef NEED
#undef EXACT
}

/* ---- encode ------------------------------------------------------------------ */

int kv_ring_hello_encode(uint8_t *out, size_t cap, uint16_t type, const kv_ring_hello *h, size_t *n, kv_diag *d) {
    if (type != KV_RING_HELLO && type != KV_RING_HELLO_ACK) return kv_fail(d, KV_EINVAL, "ring: HELLO of type %u", type);
    int rc = kv_hdr_put(out, cap, type, KV_RING_HELLO_SIZE, n, d);
    if (rc) return rc;
    uint8_t *p = out + KV_RING_HEADER;
    memset(p, 0, KV_RING_HELLO_SIZE);
    kv_wg32(p, h->role);
    if (h->role == KV_RING_ROLE_CLIENT) return 0;
    kv_wg32(p + 4, h->n_layer);
    kv_wg32(p + 8, h->first);
    kv_wg32(p + 12, h->last);
    kv_wg32(p + 16, h->n_embd);
    kv_wg32(p + 20, h->n_vocab);
    if (strlen(h->model_id) != KV_RING_MODEL_ID_LEN) return kv_fail(d, KV_EINVAL, "ring: model id of %zu characters", strlen(h->model_id));
    memcpy(p + 24, h->model_id, KV_RING_MODEL_ID_LEN);
    return 0;
}

int kv_ring_submit_encode(uint8_t *out, size_t cap, const kv_ring_submit *s, size_t *n, kv_diag *d) {
    if (s->text_len < 1 || s->text_len > KV_RING_MAX_TEXT)
        return kv_fail(d, KV_ERANGE, "ring: prompt of %u bytes out of range [1, %u]", s->text_len, KV_RING_MAX_TEXT);
    int rc = kv_ext_check(&s->p, d);
    if (rc) return rc;
    if (s->p.n_gen) return kv_fail(d, KV_EINVAL, "ring: SUBMIT with generated tokens");
    const size_t fixed = KV_RING_PARAMS_SIZE + 4 + (size_t)s->text_len;
    rc = kv_hdr_put(out, cap, KV_RING_SUBMIT, fixed + kv_ring_params_size(&s->p) - KV_RING_PARAMS_SIZE, n, d);
    if (rc) return rc;
    uint8_t *p = out + KV_RING_HEADER;
    kv_params_put(p, &s->p);
    kv_wg32(p + KV_RING_PARAMS_SIZE, s->text_len);
    memcpy(p + KV_RING_PARAMS_SIZE + 4, s->text, s->text_len);
    if (s->p.flags & KV_RING_SUBMIT_EXT) kv_ext_put(p + fixed, &s->p);
    return 0;
}

const char *kv_ring_chat_role_name(uint32_t role) {
    static const char *const names[] = {NULL, "system", "user", "assistant"};
    return role >= KV_RING_CHAT_SYSTEM && role <= KV_RING_CHAT_ASSISTANT ? names[role] : NULL;
}

const uint8_t *kv_ring_chat_next(const uint8_t *at, uint32_t *role, const char **content, uint32_t *len) {
    *role = kv_rg32(at);
    *len = kv_rg32(at + 4);
    *content = (const char *)at + 8;
    return at + 8 + *len;
}

int kv_ring_submit_chat_encode(uint8_t *out, size_t cap, const kv_ring_params *prm, const kv_chat_msg *msgs,
                               uint32_t n_msgs, size_t *n, kv_diag *d) {
    if (n_msgs < 1 || n_msgs > KV_RING_MAX_MSGS)
        return kv_fail(d, KV_ERANGE, "ring: %u chat messages out of range [1, %u]", n_msgs, KV_RING_MAX_MSGS);
    size_t len = KV_RING_PARAMS_SIZE + 4, text = 0;
    uint32_t roles[KV_RING_MAX_MSGS];
    for (uint32_t i = 0; i < n_msgs; i++) {
        roles[i] = 0;
        for (uint32_t r = KV_RING_CHAT_SYSTEM; r <= KV_RING_CHAT_ASSISTANT && msgs[i].role; r++)
            if (!strcmp(msgs[i].role, kv_ring_chat_role_name(r))) roles[i] = r;
        if (!roles[i]) return kv_fail(d, KV_EINVAL, "ring: chat message %u has role '%.32s'", i, msgs[i].role ? msgs[i].role : "");
        if (msgs[i].len > KV_RING_MAX_TEXT || (text += msgs[i].len) > KV_RING_MAX_TEXT)
            return kv_fail(d, KV_ERANGE, "ring: chat messages hold more than %u bytes", KV_RING_MAX_TEXT);
        len += 8 + msgs[i].len;
    }
    int rc = kv_ext_check(prm, d);
    if (rc) return rc;
    if (prm->n_gen) return kv_fail(d, KV_EINVAL, "ring: SUBMIT_CHAT with generated tokens");
    const size_t fixed = len;
    len += kv_ring_params_size(prm) - KV_RING_PARAMS_SIZE;
    rc = kv_hdr_put(out, cap, KV_RING_SUBMIT_CHAT, len, n, d);
    if (rc) return rc;
    uint8_t *p = out + KV_RING_HEADER;
    kv_params_put(p, prm);
    kv_wg32(p + KV_RING_PARAMS_SIZE, n_msgs);
    size_t at = KV_RING_PARAMS_SIZE + 4;
    for (uint32_t i = 0; i < n_msgs; i++) {
        kv_wg32(p + at, roles[i]);
        kv_wg32(p + at + 4, (uint32_t)msgs[i].len);
        if (msgs[i].len) memcpy(p + at + 8, msgs[i].content, msgs[i].len);
        at += 8 + msgs[i].len;
    }
    if (prm->flags & KV_RING_SUBMIT_EXT) kv_ext_put(p + fixed, prm);
    return 0;
}

int kv_ring_status_encode(uint8_t *out, size_t cap, uint16_t type, const kv_ring_status *st, size_t *n, kv_diag *d) {
    if (type == KV_RING_STATUS) return kv_hdr_put(out, cap, KV_RING_STATUS, 0, n, d);
    if (type != KV_RING_STATUS_ACK) return kv_fail(d, KV_EINVAL, "ring: STATUS frame of type %u", type);
    const size_t ml = kv_msg_len(st->msg);
    int rc = kv_hdr_put(out, cap, KV_RING_STATUS_ACK, 32 + ml, n, d);
    if (rc) return rc;
    uint8_t *p = out + KV_RING_HEADER;
    const uint32_t v[8] = {st->flags, st->n_layer, st->first, st->last, st->n_ctx, st->max_seqs, st->n_seqs, (uint32_t)ml};
    for (int i = 0; i < 8; i++) kv_wg32(p + 4 * i, v[i]);
    if (ml) memcpy(p + 32, st->msg, ml);
    return 0;
}

int kv_ring_accept_encode(uint8_t *out, size_t cap, uint64_t seq, const int32_t *tokens, uint32_t n_tokens,
                          size_t *n, kv_diag *d) {
    if (n_tokens < 1 || n_tokens > KV_RING_MAX_PROMPT) return kv_fail(d, KV_ERANGE, "ring: %u prompt tokens out of range", n_tokens);
    int rc = kv_hdr_put(out, cap, KV_RING_ACCEPT, 12 + 4 * (size_t)n_tokens, n, d);
    if (rc) return rc;
    uint8_t *p = out + KV_RING_HEADER;
    kv_wg64(p, seq);
    kv_wg32(p + 8, n_tokens);
    for (uint32_t i = 0; i < n_tokens; i++) kv_wg32(p + 12 + 4 * (size_t)i, (uint32_t)tokens[i]);
    return 0;
}

int kv_ring_start_encode(uint8_t *out, size_t cap, const kv_ring_start *s, const int32_t *tokens, size_t *n,
                         kv_diag *d) {
    if (s->n_tokens < 1 || s->n_tokens > KV_RING_MAX_PROMPT)
        return kv_fail(d, KV_ERANGE, "ring: %u prompt tokens out of range", s->n_tokens);
    int rc = kv_ext_check(&s->p, d);
    if (rc) return rc;
    if (s->p.n_gen >= s->n_tokens) return kv_fail(d, KV_ERANGE, "ring: START of %u tokens, %u generated", s->n_tokens, s->p.n_gen);
    if (s->n_cached >= s->n_tokens)
        return kv_fail(d, KV_ERANGE, "ring: START of %u tokens, %u from the prompt cache", s->n_tokens, s->n_cached);
    const size_t fixed = KV_RING_START_FIXED + 4 * (size_t)s->n_tokens;
    rc = kv_hdr_put(out, cap, KV_RING_START, fixed + kv_ring_params_size(&s->p) - KV_RING_PARAMS_SIZE, n, d);
    if (rc) return rc;
    uint8_t *p = out + KV_RING_HEADER;
    kv_wg64(p, s->seq);
    kv_wg32(p + 8, s->home);
    kv_wg32(p + 12, s->flags);
    kv_wg32(p + 16, s->n_cached);
    kv_params_put(p + 20, &s->p);
    kv_wg32(p + 20 + KV_RING_PARAMS_SIZE, s->n_tokens);
    for (uint32_t i = 0; i < s->n_tokens; i++) kv_wg32(p + KV_RING_START_FIXED + 4 * (size_t)i, (uint32_t)tokens[i]);
    if (s->p.flags & KV_RING_SUBMIT_EXT) kv_ext_put(p + fixed, &s->p);
    return 0;
}

size_t kv_ring_lookup_size(uint32_t block_tokens, uint32_t n_blocks) {
    if (block_tokens < 1 || block_tokens > KV_RING_MAX_CACHE_BLOCK || n_blocks < 1 ||
        (uint64_t)n_blocks * block_tokens > KV_RING_MAX_PROMPT)
        return 0;
    return KV_RING_LOOKUP_FIXED + 4 * (size_t)n_blocks * block_tokens + ((size_t)n_blocks + 7) / 8;
}

int kv_ring_lookup_encode(uint8_t *out, size_t cap, const kv_ring_lookup *l, const int32_t *tokens,
                          const uint8_t *state, size_t *n, kv_diag *d) {
    const size_t sz = kv_ring_lookup_size(l->block_tokens, l->n_blocks);
    if (!sz || l->n_match > l->n_blocks || !l->seq || l->origin >= KV_RING_MAX_LAYERS)
        return kv_fail(d, KV_ERANGE, "ring: LOOKUP of %u blocks of %u tokens (%u matched) out of range", l->n_blocks,
                       l->block_tokens, l->n_match);
    if (l->n_blocks % 8 && (state[l->n_blocks / 8] >> (l->n_blocks % 8)))
        return kv_fail(d, KV_EINVAL, "ring: LOOKUP state bits past its %u blocks", l->n_blocks);
    const uint32_t nt = l->n_blocks * l->block_tokens;
    for (uint32_t i = 0; i < nt; i++)
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= KV_RING_MAX_VOCAB)
            return kv_fail(d, KV_ERANGE, "ring: LOOKUP token %u is %d", i, tokens[i]);
    int rc = kv_hdr_put(out, cap, KV_RING_LOOKUP, sz, n, d);
    if (rc) return rc;
    uint8_t *p = out + KV_RING_HEADER;
    kv_wg64(p, l->seq);
    kv_wg32(p + 8, l->origin);
    kv_wg32(p + 12, l->block_tokens);
    kv_wg32(p + 16, l->n_blocks);
    kv_wg32(p + 20, l->n_match);
    for (uint32_t i = 0; i < nt; i++) kv_wg32(p + KV_RING_LOOKUP_FIXED + 4 * (size_t)i, (uint32_t)tokens[i]);
    memcpy(p + KV_RING_LOOKUP_FIXED + 4 * (size_t)nt, state, ((size_t)l->n_blocks + 7) / 8);
    return 0;
}

int kv_ring_cached_encode(uint8_t *out, size_t cap, uint64_t id, uint32_t n_cached, size_t *n, kv_diag *d) {
    if (n_cached >= KV_RING_MAX_PROMPT) return kv_fail(d, KV_ERANGE, "ring: CACHED of %u tokens out of range", n_cached);
    int rc = kv_hdr_put(out, cap, KV_RING_CACHED, 12, n, d);
    if (rc) return rc;
    kv_wg64(out + KV_RING_HEADER, id);
    kv_wg32(out + KV_RING_HEADER + 8, n_cached);
    return 0;
}

int kv_ring_submit_tokens_encode(uint8_t *out, size_t cap, const kv_ring_params *prm, const int32_t *tokens,
                                 uint32_t n_tokens, size_t *n, kv_diag *d) {
    if (n_tokens < 1 || n_tokens > KV_RING_MAX_PROMPT)
        return kv_fail(d, KV_ERANGE, "ring: %u prompt tokens out of range [1, %u]", n_tokens, KV_RING_MAX_PROMPT);
    for (uint32_t i = 0; i < n_tokens; i++)
        if (tokens[i] < 0 || (uint32_t)tokens[i] >= KV_RING_MAX_VOCAB)
            return kv_fail(d, KV_ERANGE, "ring: prompt token %u (%d) out of range", i, tokens[i]);
    int rc = kv_ext_check(prm, d);
    if (rc) return rc;
    if (prm->n_gen) return kv_fail(d, KV_EINVAL, "ring: SUBMIT_TOKENS with generated tokens");
    const size_t fixed = KV_RING_PARAMS_SIZE + 4 + 4 * (size_t)n_tokens;
    rc = kv_hdr_put(out, cap, KV_RING_SUBMIT_TOKENS, fixed + kv_ring_params_size(prm) - KV_RING_PARAMS_SIZE, n, d);
    if (rc) return rc;
    uint8_t *p = out + KV_RING_HEADER;
    kv_params_put(p, prm);
    kv_wg32(p + KV_RING_PARAMS_SIZE, n_tokens);
    for (uint32_t i = 0; i < n_tokens; i++) kv_wg32(p + KV_RING_PARAMS_SIZE + 4 + 4 * (size_t)i, (uint32_t)tokens[i]);
    if (prm->flags & KV_RING_SUBMIT_EXT) kv_ext_put(p + fixed, prm);
    return 0;
}

int kv_ring_vocab_encode(uint8_t *out, size_t cap, uint16_t type, const uint8_t *gguf, uint32_t len, size_t *n,
                         kv_diag *d) {
    if (type == KV_RING_VOCAB) return kv_hdr_put(out, cap, KV_RING_VOCAB, 0, n, d);
    if (type != KV_RING_VOCAB_ACK) return kv_fail(d, KV_EINVAL, "ring: VOCAB frame of type %u", type);
    if (len < 1 || len > KV_RING_MAX_VOCAB_BYTES)
        return kv_fail(d, KV_ERANGE, "ring: tokenizer of %u bytes out of range [1, %u]", len, KV_RING_MAX_VOCAB_BYTES);
    int rc = kv_hdr_put(out, cap, KV_RING_VOCAB_ACK, 4 + (size_t)len, n, d);
    if (rc) return rc;
    kv_wg32(out + KV_RING_HEADER, len);
    memcpy(out + KV_RING_HEADER + 4, gguf, len);
    return 0;
}

int kv_ring_hidden_encode(uint8_t *out, size_t cap, const kv_ring_hidden *h, const float *x, size_t *n, kv_diag *d) {
    const size_t sz = kv_ring_hidden_size(h->n_tokens, h->n_embd);
    if (!sz) return kv_fail(d, KV_ERANGE, "ring: HIDDEN of %u tokens x %u floats is out of range", h->n_tokens, h->n_embd);
    int rc = kv_hdr_put(out, cap, KV_RING_HIDDEN, sz, n, d);
    if (rc) return rc;
    uint8_t *p = out + KV_RING_HEADER;
    kv_wg64(p, h->seq);
    kv_wg32(p + 8, h->pos);
    kv_wg32(p + 12, h->n_tokens);
    kv_wg32(p + 16, h->flags);
    kv_wg32(p + 20, h->n_embd);
    const size_t nf = (size_t)h->n_tokens * h->n_embd;
    for (size_t i = 0; i < nf; i++) kv_wg32(p + KV_RING_HIDDEN_FIXED + 4 * i, kv_f_bits(x[i]));
    return 0;
}

int kv_ring_token_encode(uint8_t *out, size_t cap, const kv_ring_token *t, const float *logits, size_t *n,
                         kv_diag *d) {
    const size_t lg_end = kv_ring_token_size(t->piece_len, t->n_logits);
    const size_t base = lg_end + 4u * (size_t)t->n_draft;
    size_t sz = t->has_lp ? kv_ring_token_size_lp(t->piece_len, t->n_logits, t->lp.n_top) : lg_end;
    if (!sz || t->n_draft > KV_RING_MAX_DRAFT)
        return kv_fail(d, KV_ERANGE, "ring: TOKEN with %u text bytes, %u logits and %u drafts is out of range",
                       t->piece_len, t->n_logits, t->n_draft);
    sz += 4u * (size_t)t->n_draft;
    int rc = kv_hdr_put(out, cap, KV_RING_TOKEN, sz, n, d);
    if (rc) return rc;
    uint8_t *p = out + KV_RING_HEADER;
    kv_wg64(p, t->seq);
    kv_wg32(p + 8, t->pos);
    kv_wg32(p + 12, (uint32_t)t->token);
    kv_wg32(p + 16, t->stop);
    kv_wg32(p + 20, t->piece_len);
    kv_wg32(p + 24, t->n_logits);
    kv_wg32(p + 28, t->spec);
    kv_wg32(p + 32, t->n_draft);
    if (t->piece_len) memcpy(p + KV_RING_TOKEN_FIXED, t->piece, t->piece_len);
    for (uint32_t i = 0; i < t->n_logits; i++)
        kv_wg32(p + KV_RING_TOKEN_FIXED + t->piece_len + 4 * (size_t)i, kv_f_bits(logits[i]));
    for (uint32_t i = 0; i < t->n_draft; i++) kv_wg32(p + lg_end + 4 * (size_t)i, (uint32_t)t->drafts[i]);
    if (t->has_lp) {
        uint8_t *q = p + base;
        kv_wg32(q, t->lp.n_top);
        kv_wg64(q + 4, kv_d_bits(t->lp.logprob));
        for (uint32_t i = 0; i < t->lp.n_top; i++) {
            kv_wg32(q + 12 + 12 * (size_t)i, (uint32_t)t->lp.top_id[i]);
            kv_wg64(q + 16 + 12 * (size_t)i, kv_d_bits(t->lp.top_logprob[i]));
        }
    }
    return 0;
}

/* msg cut to KV_RING_MAX_MSG bytes */
static size_t kv_msg_len(const char *msg) {
    const size_t ml = msg ? strlen(msg) : 0;
    return ml > KV_RING_MAX_MSG ? KV_RING_MAX_MSG : ml;
}

int kv_ring_error_encode(uint8_t *out, size_t cap, uint64_t seq, int32_t code, uint32_t origin, const char *msg,
                         size_t *n, kv_diag *d) {
    if (code >= 0 || code <= -KV_ERR_COUNT) code = KV_EINTERNAL;
    if (origin >= KV_RING_MAX_LAYERS) return kv_fail(d, KV_ERANGE, "ring: origin layer %u out of range", origin);
    const size_t ml = kv_msg_len(msg);
    int rc = kv_hdr_put(out, cap, KV_RING_ERROR, 20 + ml, n, d);
    if (rc) return rc;
    uint8_t *p = out + KV_RING_HEADER;
    kv_wg64(p, seq);
    kv_wg32(p + 8, (uint32_t)code);
    kv_wg32(p + 12, origin);
    kv_wg32(p + 16, (uint32_t)ml);
    if (ml) memcpy(p + 20, msg, ml);
    return 0;
}

int kv_ring_broken_encode(uint8_t *out, size_t cap, uint32_t origin, const char *msg, size_t *n, kv_diag *d) {
    const size_t ml = kv_msg_len(msg);
    int rc = kv_hdr_put(out, cap, KV_RING_BROKEN, 8 + ml, n, d);
    if (rc) return rc;
    uint8_t *p = out + KV_RING_HEADER;
    kv_wg32(p, origin);
    kv_wg32(p + 4, (uint32_t)ml);
    if (ml) memcpy(p + 8, msg, ml);
    return 0;
}

int kv_ring_probe_encode(uint8_t *out, size_t cap, const kv_ring_probe *q, size_t *n, kv_diag *d) {
    int rc = kv_hdr_put(out, cap, KV_RING_PROBE, 16, n, d);
    if (rc) return rc;
    uint8_t *p = out + KV_RING_HEADER;
    kv_wg32(p, q->origin);
    kv_wg32(p + 4, q->kind);
    kv_wg64(p + 8, q->nonce);
    return 0;
}

int kv_ring_auth_encode(uint8_t *out, size_t cap, uint16_t type, const kv_ring_auth *a, size_t *n, kv_diag *d) {
    const size_t len = type == KV_RING_AUTH ? (a->voucher_expires_ms ? 200 : 128)
                       : type == KV_RING_AUTH_CHALLENGE || type == KV_RING_AUTH_OK ? 64 : 0;
    if (!len) return kv_fail(d, KV_EINVAL, "ring: AUTH frame of type %u", type);
    int rc = kv_hdr_put(out, cap, type, len, n, d);
    if (rc) return rc;
    uint8_t *p = out + KV_RING_HEADER;
    if (type == KV_RING_AUTH_OK) {
        memcpy(p, a->sig, 64);
        return 0;
    }
    memcpy(p, a->key, 32);
    memcpy(p + 32, a->nonce, 32);
    if (type == KV_RING_AUTH) memcpy(p + 64, a->sig, 64);
    if (len == 200) {
        kv_wg64(p + 128, a->voucher_expires_ms);
        memcpy(p + 136, a->voucher_sig, 64);
    }
    return 0;
}

void kv_ring_auth_digest(char role, const char model_id[KV_RING_MODEL_ID_LEN], const uint8_t acceptor_key[32],
                         const uint8_t challenge[32], const uint8_t connector_key[32], const uint8_t nonce[32],
                         uint8_t out[32]) {
    KV_ASSERT(role == 'C' || role == 'A');
    const kv_link_transcript t = {.proto = KV_LINK_HS_RING, .model_id = model_id, .acceptor_key = acceptor_key,
                                  .challenge = challenge, .connector_key = connector_key, .nonce = nonce};
    kv_link_transcript_digest(&t, role == 'C' ? KV_LINK_CONNECTOR : KV_LINK_ACCEPTOR, out);
}
