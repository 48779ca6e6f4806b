/* The dispatch protocol codec: frames and messages to and from bytes, and
 * the socket helpers both sides use.
 *
 * Invariants: the decoder reads only through a bounded reader over one
 * complete frame; every count is checked against its named maximum and the
 * exact payload size is computed (with overflow checks) before any array is
 * touched; views point into the caller's frame and nothing is allocated.
 * Integers are little-endian on the wire, read and written byte by byte, so
 * no struct is ever cast onto wire bytes. Hot path: kv_msg_compute_x /
 * kv_msg_result_y (a memcpy for f32 on little-endian hosts). */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/dispatch_proto.h"
#include "kvasir/dispatch_receipt.h"
#include "kvasir/quant.h"

/* ---- little-endian helpers ---------------------------------------------- */

static inline uint16_t kv_rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t kv_rd32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t kv_rd64(const uint8_t *p) {
    return (uint64_t)kv_rd32(p) | ((uint64_t)kv_rd32(p + 4) << 32);
}
static inline void kv_wr16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static inline void kv_wr32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}
static inline void kv_wr64(uint8_t *p, uint64_t v) {
    kv_wr32(p, (uint32_t)v);
    kv_wr32(p + 4, (uint32_t)(v >> 32));
}

static int kv_host_le(void) {
    const uint16_t one = 1;
    uint8_t b;
    memcpy(&b, &one, 1);
    return b == 1;
}

/* Bounded reader over a payload. */
typedef struct kv_rd {
    const uint8_t *p;
    size_t left;
} kv_rd;

static int kv_rd_take(kv_rd *r, size_t n, const uint8_t **out) {
    if (n > r->left) return 0;
    *out = r->p;
    r->p += n;
    r->left -= n;
    return 1;
}
static int kv_rd_u16(kv_rd *r, uint16_t *v) {
    const uint8_t *p;
    if (!kv_rd_take(r, 2, &p)) return 0;
    *v = kv_rd16(p);
    return 1;
}
static int kv_rd_u32(kv_rd *r, uint32_t *v) {
    const uint8_t *p;
    if (!kv_rd_take(r, 4, &p)) return 0;
    *v = kv_rd32(p);
    return 1;
}
static int kv_rd_u64(kv_rd *r, uint64_t *v) {
    const uint8_t *p;
    if (!kv_rd_take(r, 8, &p)) return 0;
    *v = kv_rd64(p);
    return 1;
}

const char *kv_msg_type_name(uint32_t t) {
    static const char *const names[] = {"?", "HELLO", "HELLO_ACK", "COMPUTE", "RESULT", "ERROR",
                                        "PING", "PONG", "STATS", "STATS_ACK", "AUTH_CHALLENGE", "AUTH",
                                        "AUTH_OK", "RESULT_PRE", "RECEIPT_REQ", "RECEIPT", "CANCEL",
                                        "CANCELLED"};
    _Static_assert(sizeof names / sizeof names[0] == KV_MSG_TYPE_COUNT, "a name per type");
    return t < KV_MSG_TYPE_COUNT ? names[t] : "?";
}

/* ---- encodings ------------------------------------------------------------ */

size_t kv_enc_size(uint32_t enc) {
    switch (enc) {
    case KV_ENC_F32: return 4;
    case KV_ENC_F16: return 2;
    case KV_ENC_BF16: return 2;
    default: return 0;
    }
}

const char *kv_enc_name(uint32_t enc) {
    switch (enc) {
    case KV_ENC_F32: return "f32";
    case KV_ENC_F16: return "f16";
    case KV_ENC_BF16: return "bf16";
    default: return "?";
    }
}

int kv_enc_from_name(const char *name) {
    for (uint32_t e = 0; e < KV_ENC_COUNT; e++)
        if (name && !strcmp(name, kv_enc_name(e))) return (int)e;
    return -1;
}

/* n floats to the wire in enc. */
static void kv_enc_write(uint8_t *dst, const float *src, size_t n, uint32_t enc) {
    switch (enc) {
    case KV_ENC_F32:
        if (kv_host_le()) {
            memcpy(dst, src, n * 4);
        } else {
            for (size_t i = 0; i < n; i++) {
                uint32_t u;
                memcpy(&u, &src[i], 4);
                kv_wr32(dst + 4 * i, u);
            }
        }
        break;
    case KV_ENC_F16:
        for (size_t i = 0; i < n; i++) kv_wr16(dst + 2 * i, kv_fp32_to_fp16(src[i]));
        break;
    case KV_ENC_BF16:
        for (size_t i = 0; i < n; i++) kv_wr16(dst + 2 * i, kv_fp32_to_bf16(src[i]));
        break;
    default: KV_ASSERT(0);
    }
}

/* n wire elements in enc to floats. */
static void kv_enc_read(float *dst, const uint8_t *src, size_t n, uint32_t enc) {
    switch (enc) {
    case KV_ENC_F32:
        if (kv_host_le()) {
            memcpy(dst, src, n * 4);
        } else {
            for (size_t i = 0; i < n; i++) {
                uint32_t u = kv_rd32(src + 4 * i);
                memcpy(&dst[i], &u, 4);
            }
        }
        break;
    case KV_ENC_F16:
        for (size_t i = 0; i < n; i++) dst[i] = kv_fp16_to_fp32(kv_rd16(src + 2 * i));
        break;
    case KV_ENC_BF16:
        for (size_t i = 0; i < n; i++) dst[i] = kv_bf16_to_fp32(kv_rd16(src + 2 * i));
        break;
    default: KV_ASSERT(0);
    }
}

/* ---- header ---------------------------------------------------------------- */

void kv_frame_set_version(uint8_t *frame, uint16_t version) { kv_wr16(frame + 4, version); }

void kv_msg_rows_put(uint8_t *dst, uint32_t enc, const float *src, size_t n) {
    kv_enc_write(dst, src, n, enc);
}

void kv_frame_header_encode(uint8_t out[KV_PROTO_HEADER], uint16_t type, uint32_t request_id,
                            uint32_t len) {
    kv_wr32(out, KV_PROTO_MAGIC);
    kv_wr16(out + 4, (uint16_t)KV_PROTO_VERSION);
    kv_wr16(out + 6, type);
    kv_wr32(out + 8, request_id);
    kv_wr32(out + 12, len);
}

int kv_frame_header_decode(const uint8_t *p, size_t n, kv_frame_header *h, kv_diag *d) {
    if (n < KV_PROTO_HEADER)
        return kv_fail(d, KV_EPROTO, "frame: %zu bytes, header needs %u", n, KV_PROTO_HEADER);
    h->magic = kv_rd32(p);
    h->version = kv_rd16(p + 4);
    h->type = kv_rd16(p + 6);
    h->request_id = kv_rd32(p + 8);
    h->len = kv_rd32(p + 12);
    if (h->magic != KV_PROTO_MAGIC)
        return kv_fail(d, KV_EPROTO, "frame: bad magic 0x%08x (want 0x%08x \"KVD1\")", h->magic,
                       KV_PROTO_MAGIC);
    if (h->version == 0) return kv_fail(d, KV_EPROTO, "frame: version 0");
    if (h->type == 0 || h->type >= KV_MSG_TYPE_COUNT)
        return kv_fail(d, KV_EPROTO, "frame: unknown message type %u", h->type);
    if (h->len > KV_PROTO_MAX_PAYLOAD)
        return kv_fail(d, KV_ERANGE, "frame: payload length %u exceeds maximum %u", h->len,
                       KV_PROTO_MAX_PAYLOAD);
    return 0;
}

/* ---- sizes ----------------------------------------------------------------- */

/* Payload sizes (0 = out of bounds). */
static size_t kv_compute_payload(uint32_t enc, uint32_t n_tokens, uint32_t n_embd,
                                 uint32_t n_pairs) {
    size_t es = kv_enc_size(enc), xs, ps, t;
    if (!es || n_tokens == 0 || n_tokens > KV_PROTO_MAX_TOKENS || n_embd == 0 ||
        n_embd > KV_PROTO_MAX_EMBD || n_pairs == 0 || n_pairs > KV_PROTO_MAX_PAIRS)
        return 0;
    if (!kv_mul_ok((size_t)n_tokens * es, n_embd, &xs)) return 0;
    ps = (size_t)n_pairs * 8;
    if (!kv_add_ok(xs, ps, &t) || !kv_add_ok(t, KV_PROTO_COMPUTE_FIXED, &t)) return 0;
    return t <= KV_PROTO_MAX_PAYLOAD ? t : 0;
}

/* sig: the v4 layout, the signature after the rows. */
static size_t kv_result_payload(uint32_t enc, uint32_t n_pairs, uint32_t n_embd, bool sig) {
    size_t es = kv_enc_size(enc), ys, t;
    if (!es || n_pairs == 0 || n_pairs > KV_PROTO_MAX_PAIRS || n_embd == 0 ||
        n_embd > KV_PROTO_MAX_EMBD)
        return 0;
    if (!kv_mul_ok((size_t)n_pairs * es, n_embd, &ys) ||
        !kv_add_ok(ys, KV_PROTO_RESULT_FIXED + (sig ? KV_PROTO_RESULT_SIG : 0), &t))
        return 0;
    return t <= KV_PROTO_MAX_PAYLOAD ? t : 0;
}

static size_t kv_result_pre_payload(uint32_t n_pairs, uint32_t n_embd, uint32_t n_ff, bool sig) {
    size_t rw, t;
    if (n_pairs == 0 || n_pairs > KV_PROTO_MAX_PAIRS || n_embd == 0 || n_embd > KV_PROTO_MAX_EMBD || n_ff == 0 ||
        n_ff > KV_PROTO_MAX_FF)
        return 0;
    if (!kv_mul_ok((size_t)n_embd + 2 * (size_t)n_ff, 4 * (size_t)n_pairs, &rw) ||
        !kv_add_ok(rw, KV_PROTO_RESULT_PRE_FIXED + (sig ? KV_PROTO_RESULT_SIG : 0), &t))
        return 0;
    return t <= KV_PROTO_MAX_PAYLOAD ? t : 0;
}

size_t kv_msg_compute_size(uint32_t enc, uint32_t n_tokens, uint32_t n_embd, uint32_t n_pairs) {
    size_t p = kv_compute_payload(enc, n_tokens, n_embd, n_pairs);
    return p ? p + KV_PROTO_HEADER : 0;
}

size_t kv_msg_result_size(uint32_t enc, uint32_t n_pairs, uint32_t n_embd) {
    size_t p = kv_result_payload(enc, n_pairs, n_embd, false);
    return p ? p + KV_PROTO_HEADER : 0;
}

size_t kv_msg_result_size_v(uint16_t version, uint32_t enc, uint32_t n_pairs, uint32_t n_embd) {
    size_t p = kv_result_payload(enc, n_pairs, n_embd, version >= KV_PROTO_SIG_VERSION);
    return p ? p + KV_PROTO_HEADER : 0;
}

size_t kv_msg_hello_ack_size(size_t backend_len, uint32_t n_ranges) {
    return kv_msg_hello_ack_size_v(1, backend_len, n_ranges, 0);
}

size_t kv_msg_hello_ack_size_v(uint16_t version, size_t backend_len, uint32_t n_ranges, uint32_t n_slabs) {
    if (backend_len == 0 || backend_len > KV_PROTO_MAX_NAME || n_ranges > KV_PROTO_MAX_RANGES ||
        n_slabs > KV_PROTO_MAX_RANGES || version == 0 || version > KV_PROTO_VERSION ||
        (version == 1 && n_slabs))
        return 0;
    if (version == 1)
        return KV_PROTO_HEADER + KV_PROTO_HELLO_ACK_FIXED + backend_len + (size_t)n_ranges * 12;
    return KV_PROTO_HEADER + KV_PROTO_HELLO_ACK_FIXED_V2 + backend_len + (size_t)n_ranges * 12 +
           (size_t)n_slabs * KV_PROTO_SLAB_SIZE;
}

/* ---- field checks shared by encoders and the decoder ------------------------ */

static int kv_model_id_ok(const char *id, size_t n) {
    for (size_t i = 0; i < n; i++) {
        char c = id[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return 0;
    }
    return 1;
}

static int kv_name_ok(const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] < 0x21 || s[i] > 0x7e) return 0;
    return 1;
}

static int kv_text_ok(const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] < 0x20 || s[i] == 0x7f) return 0;
    return 1;
}

/* Checks the dims and ranges of a HELLO_ACK (range i read via rg). */
static int kv_ack_check(const kv_msg_hello_ack *m, int code, kv_diag *d) {
    if (m->n_layer == 0 || m->n_layer > KV_PROTO_MAX_LAYERS)
        return kv_fail(d, code, "HELLO_ACK: n_layer %u out of [1, %u]", m->n_layer,
                       KV_PROTO_MAX_LAYERS);
    if (m->n_embd == 0 || m->n_embd > KV_PROTO_MAX_EMBD)
        return kv_fail(d, code, "HELLO_ACK: n_embd %u out of [1, %u]", m->n_embd,
                       KV_PROTO_MAX_EMBD);
    if (m->n_ff_exp == 0 || m->n_ff_exp > KV_PROTO_MAX_FF)
        return kv_fail(d, code, "HELLO_ACK: n_ff_exp %u out of [1, %u]", m->n_ff_exp,
                       KV_PROTO_MAX_FF);
    if (m->n_expert == 0 || m->n_expert > KV_PROTO_MAX_EXPERTS)
        return kv_fail(d, code, "HELLO_ACK: n_expert %u out of [1, %u]", m->n_expert,
                       KV_PROTO_MAX_EXPERTS);
    if (m->n_expert_used > m->n_expert)
        return kv_fail(d, code, "HELLO_ACK: n_expert_used %u > n_expert %u", m->n_expert_used,
                       m->n_expert);
    if (m->n_ranges > KV_PROTO_MAX_RANGES)
        return kv_fail(d, code, "HELLO_ACK: %u ranges exceed maximum %u", m->n_ranges,
                       KV_PROTO_MAX_RANGES);
    kv_held_range prev = {0, 0, 0};
    for (uint32_t i = 0; i < m->n_ranges; i++) {
        kv_held_range r = kv_msg_hello_ack_range(m, i);
        if (r.layer >= m->n_layer)
            return kv_fail(d, code, "HELLO_ACK: range %u: layer %u >= n_layer %u", i, r.layer,
                           m->n_layer);
        if (r.first > r.last || r.last >= m->n_expert)
            return kv_fail(d, code, "HELLO_ACK: range %u: experts [%u, %u] invalid (n_expert %u)",
                           i, r.first, r.last, m->n_expert);
        if (i > 0 && (r.layer < prev.layer || (r.layer == prev.layer && r.first <= prev.last)))
            return kv_fail(d, code, "HELLO_ACK: range %u (layer %u [%u, %u]) not sorted after "
                                    "(layer %u [%u, %u]) or overlaps it",
                           i, r.layer, r.first, r.last, prev.layer, prev.first, prev.last);
        prev = r;
    }
    if (m->version >= 2) {
        if (m->max_pairs == 0 || m->max_pairs > KV_PROTO_MAX_PAIRS)
            return kv_fail(d, code, "HELLO_ACK: max_pairs %u out of [1, %u]", m->max_pairs,
                           KV_PROTO_MAX_PAIRS);
        if (m->n_slabs > KV_PROTO_MAX_RANGES)
            return kv_fail(d, code, "HELLO_ACK: %u slabs exceed maximum %u", m->n_slabs,
                           KV_PROTO_MAX_RANGES);
        kv_slab_hash ps = {0, 0, 0, {0}};
        for (uint32_t i = 0; i < m->n_slabs; i++) {
            kv_slab_hash s = kv_msg_hello_ack_slab(m, i);
            if (s.layer >= m->n_layer || s.first > s.last || s.last >= m->n_expert)
                return kv_fail(d, code, "HELLO_ACK: slab %u: layer %u experts [%u, %u] invalid", i,
                               s.layer, s.first, s.last);
            if (i > 0 && (s.layer < ps.layer || (s.layer == ps.layer && s.first <= ps.last)))
                return kv_fail(d, code, "HELLO_ACK: slab %u not sorted after slab %u or overlaps it",
                               i, i - 1);
            if (!kv_msg_hello_ack_holds(m, s.layer, s.first) || !kv_msg_hello_ack_holds(m, s.layer, s.last))
                return kv_fail(d, code, "HELLO_ACK: slab %u (layer %u [%u, %u]) outside the held ranges",
                               i, s.layer, s.first, s.last);
            ps = s;
        }
    }
    return 0;
}

/* ---- encoders ----------------------------------------------------------------- */

static int kv_enc_begin(uint8_t *buf, size_t cap, size_t payload, const char *what, kv_diag *d) {
    if (payload > KV_PROTO_MAX_PAYLOAD)
        return kv_fail(d, KV_ERANGE, "%s: payload %zu exceeds maximum %u", what, payload,
                       KV_PROTO_MAX_PAYLOAD);
    if (!buf || cap < KV_PROTO_HEADER + payload)
        return kv_fail(d, KV_ERANGE, "%s: buffer of %zu bytes, frame needs %zu", what, cap,
                       (size_t)KV_PROTO_HEADER + payload);
    return 0;
}

int kv_msg_hello_encode(uint8_t *buf, size_t cap, uint32_t request_id, const kv_msg_hello *m,
                        size_t *n, kv_diag *d) {
    int rc = kv_enc_begin(buf, cap, KV_PROTO_HELLO_SIZE, "HELLO", d);
    if (rc) return rc;
    if (m->min_version == 0 || m->min_version > m->max_version)
        return kv_fail(d, KV_EINVAL, "HELLO: version range [%u, %u] invalid", m->min_version,
                       m->max_version);
    if (strlen(m->model_id) != KV_PROTO_MODEL_ID_LEN ||
        !kv_model_id_ok(m->model_id, KV_PROTO_MODEL_ID_LEN))
        return kv_fail(d, KV_EINVAL, "HELLO: model id must be %u lowercase hex digits",
                       KV_PROTO_MODEL_ID_LEN);
    if (!(m->enc_mask & 1u) || (m->enc_mask & ~KV_ENC_MASK_VALID))
        return kv_fail(d, KV_EINVAL, "HELLO: encoding mask 0x%x must include f32 and only known "
                                     "encodings", m->enc_mask);
    uint8_t *p = buf + KV_PROTO_HEADER;
    kv_frame_header_encode(buf, KV_MSG_HELLO, request_id, KV_PROTO_HELLO_SIZE);
    kv_wr16(p, m->min_version);
    kv_wr16(p + 2, m->max_version);
    memcpy(p + 4, m->model_id, KV_PROTO_MODEL_ID_LEN);
    kv_wr32(p + 68, m->enc_mask);
    *n = KV_PROTO_HEADER + KV_PROTO_HELLO_SIZE;
    return 0;
}

int kv_msg_hello_ack_encode(uint8_t *buf, size_t cap, uint32_t request_id,
                            const kv_msg_hello_ack *m, size_t *n, kv_diag *d) {
    size_t bl = strnlen(m->backend, KV_PROTO_MAX_NAME + 1);
    const uint32_t n_slabs = m->version >= 2 ? m->n_slabs : 0;
    size_t fsize = kv_msg_hello_ack_size_v(m->version, bl, m->n_ranges, n_slabs);
    if (!fsize)
        return kv_fail(d, KV_EINVAL, "HELLO_ACK: version %u, backend name of %zu bytes, %u ranges or "
                                     "%u slabs out of bounds", m->version, bl, m->n_ranges, n_slabs);
    int rc = kv_enc_begin(buf, cap, fsize - KV_PROTO_HEADER, "HELLO_ACK", d);
    if (rc) return rc;
    if (m->version == 0) return kv_fail(d, KV_EINVAL, "HELLO_ACK: version 0");
    if (strlen(m->model_id) != KV_PROTO_MODEL_ID_LEN ||
        !kv_model_id_ok(m->model_id, KV_PROTO_MODEL_ID_LEN))
        return kv_fail(d, KV_EINVAL, "HELLO_ACK: model id must be %u lowercase hex digits",
                       KV_PROTO_MODEL_ID_LEN);
    if (!kv_name_ok((const uint8_t *)m->backend, bl))
        return kv_fail(d, KV_EINVAL, "HELLO_ACK: backend name must be printable ASCII");
    if (!(m->enc_mask & 1u) || (m->enc_mask & ~KV_ENC_MASK_VALID))
        return kv_fail(d, KV_EINVAL, "HELLO_ACK: encoding mask 0x%x invalid", m->enc_mask);
    if (m->n_ranges && !m->ranges) return kv_fail(d, KV_EINVAL, "HELLO_ACK: ranges missing");
    if (n_slabs && !m->slabs) return kv_fail(d, KV_EINVAL, "HELLO_ACK: slabs missing");
    kv_msg_hello_ack chk = *m;
    chk.ranges_wire = NULL;
    chk.slabs_wire = NULL;
    chk.n_slabs = n_slabs;
    if ((rc = kv_ack_check(&chk, KV_EINVAL, d))) return rc;
    uint8_t *p = buf + KV_PROTO_HEADER;
    kv_frame_header_encode(buf, KV_MSG_HELLO_ACK, request_id,
                           (uint32_t)(fsize - KV_PROTO_HEADER));
    kv_wr16(p, m->version);
    kv_wr16(p + 2, (uint16_t)bl);
    memcpy(p + 4, m->model_id, KV_PROTO_MODEL_ID_LEN);
    kv_wr32(p + 68, m->n_layer);
    kv_wr32(p + 72, m->n_embd);
    kv_wr32(p + 76, m->n_ff_exp);
    kv_wr32(p + 80, m->n_expert);
    kv_wr32(p + 84, m->n_expert_used);
    kv_wr32(p + 88, m->enc_mask);
    kv_wr32(p + 92, m->n_ranges);
    size_t fixed = KV_PROTO_HELLO_ACK_FIXED;
    if (m->version >= 2) {
        kv_wr32(p + 96, n_slabs);
        kv_wr32(p + 100, m->max_pairs);
        fixed = KV_PROTO_HELLO_ACK_FIXED_V2;
    }
    kv_frame_set_version(buf, m->version);
    memcpy(p + fixed, m->backend, bl);
    uint8_t *r = p + fixed + bl;
    for (uint32_t i = 0; i < m->n_ranges; i++, r += 12) {
        kv_wr32(r, m->ranges[i].layer);
        kv_wr32(r + 4, m->ranges[i].first);
        kv_wr32(r + 8, m->ranges[i].last);
    }
    for (uint32_t i = 0; i < n_slabs; i++, r += KV_PROTO_SLAB_SIZE) {
        kv_wr32(r, m->slabs[i].layer);
        kv_wr32(r + 4, m->slabs[i].first);
        kv_wr32(r + 8, m->slabs[i].last);
        memcpy(r + 12, m->slabs[i].sha256, 32);
    }
    *n = fsize;
    return 0;
}

int kv_msg_compute_encode(uint8_t *buf, size_t cap, uint32_t request_id, const kv_msg_compute *m,
                          size_t *n, kv_diag *d) {
    size_t pl = kv_compute_payload(m->enc, m->n_tokens, m->n_embd, m->n_pairs);
    if (!pl)
        return kv_fail(d, KV_EINVAL, "COMPUTE: enc %u, %u tokens x %u, %u pairs out of bounds",
                       m->enc, m->n_tokens, m->n_embd, m->n_pairs);
    if ((m->out_enc & KV_OUT_PREACT) && (m->out_enc & ~KV_OUT_PREACT) != KV_ENC_F32)
        return kv_fail(d, KV_EINVAL, "COMPUTE: pre-activations are answered in f32 only");
    if (!kv_result_payload(m->out_enc & ~KV_OUT_PREACT, m->n_pairs, m->n_embd, true))
        return kv_fail(d, KV_EINVAL, "COMPUTE: result of %u pairs x %u in enc %u out of bounds",
                       m->n_pairs, m->n_embd, m->out_enc);
    int rc = kv_enc_begin(buf, cap, pl, "COMPUTE", d);
    if (rc) return rc;
    if (!m->x || !m->pairs) return kv_fail(d, KV_EINVAL, "COMPUTE: x or pairs missing");
    for (uint32_t i = 0; i < m->n_pairs; i++)
        if (m->pairs[i].token >= m->n_tokens)
            return kv_fail(d, KV_EINVAL, "COMPUTE: pair %u: token %u >= n_tokens %u", i,
                           m->pairs[i].token, m->n_tokens);
    uint8_t *p = buf + KV_PROTO_HEADER;
    kv_frame_header_encode(buf, KV_MSG_COMPUTE, request_id, (uint32_t)pl);
    kv_wr32(p, m->layer);
    kv_wr16(p + 4, (uint16_t)m->enc);
    kv_wr16(p + 6, (uint16_t)m->out_enc);
    kv_wr32(p + 8, m->n_tokens);
    kv_wr32(p + 12, m->n_embd);
    kv_wr32(p + 16, m->n_pairs);
    size_t nx = (size_t)m->n_tokens * m->n_embd;
    uint8_t *x = p + KV_PROTO_COMPUTE_FIXED;
    kv_enc_write(x, m->x, nx, m->enc);
    uint8_t *pp = x + nx * kv_enc_size(m->enc);
    for (uint32_t i = 0; i < m->n_pairs; i++, pp += 8) {
        kv_wr32(pp, m->pairs[i].token);
        kv_wr32(pp + 4, m->pairs[i].expert);
    }
    *n = KV_PROTO_HEADER + pl;
    return 0;
}

int kv_msg_result_encode(uint8_t *buf, size_t cap, uint32_t request_id, const kv_msg_result *m,
                         size_t *n, kv_diag *d) {
    size_t pl = kv_result_payload(m->enc, m->n_pairs, m->n_embd, m->sig != NULL);
    if (!pl)
        return kv_fail(d, KV_EINVAL, "RESULT: enc %u, %u pairs x %u out of bounds", m->enc,
                       m->n_pairs, m->n_embd);
    int rc = kv_enc_begin(buf, cap, pl, "RESULT", d);
    if (rc) return rc;
    if (!m->y) return kv_fail(d, KV_EINVAL, "RESULT: y missing");
    uint8_t *p = buf + KV_PROTO_HEADER;
    kv_frame_header_encode(buf, KV_MSG_RESULT, request_id, (uint32_t)pl);
    kv_frame_set_version(buf, m->sig ? KV_PROTO_SIG_VERSION : KV_PROTO_AUTH_VERSION);
    kv_wr32(p, m->n_pairs);
    kv_wr32(p + 4, m->n_embd);
    kv_wr32(p + 8, m->enc);
    kv_enc_write(p + KV_PROTO_RESULT_FIXED, m->y, (size_t)m->n_pairs * m->n_embd, m->enc);
    if (m->sig) memcpy(buf + KV_PROTO_HEADER + pl - KV_PROTO_RESULT_SIG, m->sig, KV_PROTO_RESULT_SIG);
    *n = KV_PROTO_HEADER + pl;
    return 0;
}

int kv_msg_result_begin(uint8_t *buf, size_t cap, uint32_t request_id, uint32_t enc,
                        uint32_t n_pairs, uint32_t n_embd, size_t *n, kv_diag *d) {
    size_t pl = kv_result_payload(enc, n_pairs, n_embd, false);
    if (!pl)
        return kv_fail(d, KV_EINVAL, "RESULT: enc %u, %u pairs x %u out of bounds", enc, n_pairs,
                       n_embd);
    int rc = kv_enc_begin(buf, cap, pl, "RESULT", d);
    if (rc) return rc;
    uint8_t *p = buf + KV_PROTO_HEADER;
    kv_frame_header_encode(buf, KV_MSG_RESULT, request_id, (uint32_t)pl);
    kv_frame_set_version(buf, KV_PROTO_AUTH_VERSION);
    kv_wr32(p, n_pairs);
    kv_wr32(p + 4, n_embd);
    kv_wr32(p + 8, enc);
    *n = KV_PROTO_HEADER + pl;
    return 0;
}

size_t kv_msg_result_head(uint8_t out[KV_PROTO_HEADER + KV_PROTO_RESULT_FIXED], uint16_t version,
                          uint32_t request_id, uint32_t enc, uint32_t n_pairs, uint32_t n_embd) {
    size_t pl = kv_result_payload(enc, n_pairs, n_embd, version >= KV_PROTO_SIG_VERSION);
    if (!pl) return 0;
    kv_frame_header_encode(out, KV_MSG_RESULT, request_id, (uint32_t)pl);
    kv_frame_set_version(out, version);
    kv_wr32(out + KV_PROTO_HEADER, n_pairs);
    kv_wr32(out + KV_PROTO_HEADER + 4, n_embd);
    kv_wr32(out + KV_PROTO_HEADER + 8, enc);
    return KV_PROTO_HEADER + pl;
}

size_t kv_msg_result_pre_head(uint8_t out[KV_PROTO_HEADER + KV_PROTO_RESULT_PRE_FIXED], uint16_t version,
                              uint32_t request_id, uint32_t n_pairs, uint32_t n_embd, uint32_t n_ff) {
    const size_t pl = kv_result_pre_payload(n_pairs, n_embd, n_ff, version >= KV_PROTO_SIG_VERSION);
    if (!pl) return 0;
    kv_frame_header_encode(out, KV_MSG_RESULT_PRE, request_id, (uint32_t)pl);
    kv_frame_set_version(out, version);
    kv_wr32(out + KV_PROTO_HEADER, n_pairs);
    kv_wr32(out + KV_PROTO_HEADER + 4, n_embd);
    kv_wr32(out + KV_PROTO_HEADER + 8, n_ff);
    kv_wr32(out + KV_PROTO_HEADER + 12, KV_ENC_F32);
    return KV_PROTO_HEADER + pl;
}

int kv_msg_result_pre_encode(uint8_t *buf, size_t cap, uint32_t request_id, uint32_t n_pairs, uint32_t n_embd,
                             uint32_t n_ff, const float *rows, const uint8_t *sig, size_t *n, kv_diag *d) {
    const size_t pl = kv_result_pre_payload(n_pairs, n_embd, n_ff, sig != NULL);
    if (!pl) return kv_fail(d, KV_EINVAL, "RESULT_PRE: %u pairs x (%u + 2 x %u) out of bounds", n_pairs, n_embd, n_ff);
    int rc = kv_enc_begin(buf, cap, pl, "RESULT_PRE", d);
    if (rc) return rc;
    kv_msg_result_pre_head(buf, sig ? KV_PROTO_SIG_VERSION : KV_PROTO_AUTH_VERSION, request_id, n_pairs, n_embd, n_ff);
    kv_msg_rows_put(buf + KV_PROTO_HEADER + KV_PROTO_RESULT_PRE_FIXED, KV_ENC_F32, rows,
                    (size_t)n_pairs * ((size_t)n_embd + 2 * (size_t)n_ff));
    if (sig) memcpy(buf + KV_PROTO_HEADER + pl - KV_PROTO_RESULT_SIG, sig, KV_PROTO_RESULT_SIG);
    *n = KV_PROTO_HEADER + pl;
    return 0;
}

void kv_msg_result_put_row(uint8_t *buf, uint32_t enc, uint32_t n_embd, uint32_t p,
                           const float *row) {
    const size_t es = kv_enc_size(enc);
    KV_ASSERT(es);
    kv_enc_write(buf + KV_PROTO_HEADER + KV_PROTO_RESULT_FIXED + (size_t)p * n_embd * es, row,
                 n_embd, enc);
}

int kv_msg_error_encode(uint8_t *buf, size_t cap, uint32_t request_id, int32_t code,
                        const char *msg, size_t *n, kv_diag *d) {
    if (code >= 0) return kv_fail(d, KV_EINVAL, "ERROR: code %d is not negative", code);
    size_t ml = msg ? strnlen(msg, KV_PROTO_MAX_TEXT) : 0;
    int rc = kv_enc_begin(buf, cap, KV_PROTO_ERROR_FIXED + ml, "ERROR", d);
    if (rc) return rc;
    uint8_t *p = buf + KV_PROTO_HEADER;
    kv_frame_header_encode(buf, KV_MSG_ERROR, request_id, (uint32_t)(KV_PROTO_ERROR_FIXED + ml));
    kv_wr32(p, (uint32_t)code);
    kv_wr32(p + 4, (uint32_t)ml);
    for (size_t i = 0; i < ml; i++) {
        uint8_t c = (uint8_t)msg[i];
        p[8 + i] = (c < 0x20 || c == 0x7f) ? '?' : c;
    }
    *n = KV_PROTO_HEADER + KV_PROTO_ERROR_FIXED + ml;
    return 0;
}

int kv_msg_ping_encode(uint8_t *buf, size_t cap, uint16_t type, uint32_t request_id,
                       uint64_t nonce, size_t *n, kv_diag *d) {
    if (type != KV_MSG_PING && type != KV_MSG_PONG)
        return kv_fail(d, KV_EINVAL, "PING: type %u is neither PING nor PONG", type);
    int rc = kv_enc_begin(buf, cap, KV_PROTO_PING_SIZE, "PING", d);
    if (rc) return rc;
    kv_frame_header_encode(buf, type, request_id, KV_PROTO_PING_SIZE);
    kv_wr64(buf + KV_PROTO_HEADER, nonce);
    *n = KV_PROTO_HEADER + KV_PROTO_PING_SIZE;
    return 0;
}

int kv_msg_stats_encode(uint8_t *buf, size_t cap, uint32_t request_id, size_t *n, kv_diag *d) {
    int rc = kv_enc_begin(buf, cap, 0, "STATS", d);
    if (rc) return rc;
    kv_frame_header_encode(buf, KV_MSG_STATS, request_id, 0);
    *n = KV_PROTO_HEADER;
    return 0;
}

int kv_msg_cancel_encode(uint8_t *buf, size_t cap, uint16_t type, uint32_t request_id, size_t *n, kv_diag *d) {
    if (type != KV_MSG_CANCEL && type != KV_MSG_CANCELLED)
        return kv_fail(d, KV_EINVAL, "CANCEL: type %u is neither CANCEL nor CANCELLED", type);
    int rc = kv_enc_begin(buf, cap, 0, "CANCEL", d);
    if (rc) return rc;
    kv_frame_header_encode(buf, type, request_id, 0);
    *n = KV_PROTO_HEADER;
    return 0;
}

/* The STATS_ACK payload size of a version. */
static uint32_t kv_stats_ack_size(uint16_t version) {
    return version == 1                          ? KV_PROTO_STATS_ACK_SIZE
           : version < KV_PROTO_CANCEL_VERSION ? KV_PROTO_STATS_ACK_SIZE_V2
                                               : KV_PROTO_STATS_ACK_SIZE_V6;
}

int kv_msg_stats_ack_encode(uint8_t *buf, size_t cap, uint32_t request_id, const kv_msg_stats *m,
                            size_t *n, kv_diag *d) {
    return kv_msg_stats_ack_encode_v(buf, cap, request_id, KV_PROTO_VERSION, m, n, d);
}

int kv_msg_stats_ack_encode_v(uint8_t *buf, size_t cap, uint32_t request_id, uint16_t version,
                              const kv_msg_stats *m, size_t *n, kv_diag *d) {
    if (version == 0 || version > KV_PROTO_VERSION)
        return kv_fail(d, KV_EINVAL, "STATS_ACK: version %u unknown", version);
    const uint32_t size = kv_stats_ack_size(version);
    int rc = kv_enc_begin(buf, cap, size, "STATS_ACK", d);
    if (rc) return rc;
    uint8_t *p = buf + KV_PROTO_HEADER;
    kv_frame_header_encode(buf, KV_MSG_STATS_ACK, request_id, size);
    kv_frame_set_version(buf, version);
    if (version >= 2) {
        kv_wr64(p + 48, m->n_batches);
        kv_wr64(p + 56, m->n_merged);
        kv_wr64(p + 64, m->compute_us);
    }
    if (version >= KV_PROTO_CANCEL_VERSION) kv_wr64(p + 72, m->n_cancelled);
    kv_wr64(p, m->n_compute);
    kv_wr64(p + 8, m->n_pairs);
    kv_wr64(p + 16, m->n_tokens);
    kv_wr64(p + 24, m->n_conns);
    kv_wr64(p + 32, m->n_errors);
    kv_wr64(p + 40, m->uptime_ms);
    *n = KV_PROTO_HEADER + size;
    return 0;
}

int kv_msg_auth_challenge_encode(uint8_t *buf, size_t cap, uint32_t request_id,
                                 const kv_msg_auth_challenge *m, size_t *n, kv_diag *d) {
    int rc = kv_enc_begin(buf, cap, KV_PROTO_AUTH_CHALLENGE_SIZE, "AUTH_CHALLENGE", d);
    if (rc) return rc;
    kv_frame_header_encode(buf, KV_MSG_AUTH_CHALLENGE, request_id, KV_PROTO_AUTH_CHALLENGE_SIZE);
    kv_frame_set_version(buf, KV_PROTO_AUTH_VERSION);
    memcpy(buf + KV_PROTO_HEADER, m->worker_key, 32);
    memcpy(buf + KV_PROTO_HEADER + 32, m->challenge, 32);
    *n = KV_PROTO_HEADER + KV_PROTO_AUTH_CHALLENGE_SIZE;
    return 0;
}

static bool kv_all_zero(const uint8_t *p, size_t n) {
    uint8_t acc = 0;
    for (size_t i = 0; i < n; i++) acc |= p[i];
    return acc == 0;
}

/* A voucher's fields are all zero exactly when the flag is clear. */
static int kv_auth_check(const kv_msg_auth *m, int code, kv_diag *d) {
    if (m->flags & ~KV_PROTO_AUTH_VOUCHER) return kv_fail(d, code, "AUTH: reserved flag bits 0x%x set", m->flags);
    if (!(m->flags & KV_PROTO_AUTH_VOUCHER) && (m->voucher_expires_ms || !kv_all_zero(m->voucher_sig, 64)))
        return kv_fail(d, code, "AUTH: voucher fields set without the voucher flag");
    if ((m->flags & KV_PROTO_AUTH_VOUCHER) && m->voucher_expires_ms == 0)
        return kv_fail(d, code, "AUTH: a voucher with expiry 0");
    return 0;
}

int kv_msg_auth_encode(uint8_t *buf, size_t cap, uint32_t request_id, const kv_msg_auth *m, size_t *n,
                       kv_diag *d) {
    int rc = kv_enc_begin(buf, cap, KV_PROTO_AUTH_SIZE, "AUTH", d);
    if (rc) return rc;
    if ((rc = kv_auth_check(m, KV_EINVAL, d))) return rc;
    uint8_t *p = buf + KV_PROTO_HEADER;
    kv_frame_header_encode(buf, KV_MSG_AUTH, request_id, KV_PROTO_AUTH_SIZE);
    kv_frame_set_version(buf, KV_PROTO_AUTH_VERSION);
    memcpy(p, m->key, 32);
    memcpy(p + 32, m->nonce, 32);
    memcpy(p + 64, m->sig, 64);
    kv_wr32(p + 128, m->flags);
    kv_wr64(p + 132, m->voucher_expires_ms);
    memcpy(p + 140, m->voucher_sig, 64);
    *n = KV_PROTO_HEADER + KV_PROTO_AUTH_SIZE;
    return 0;
}

int kv_msg_auth_ok_encode(uint8_t *buf, size_t cap, uint32_t request_id, const uint8_t sig[64], size_t *n,
                          kv_diag *d) {
    int rc = kv_enc_begin(buf, cap, KV_PROTO_AUTH_OK_SIZE, "AUTH_OK", d);
    if (rc) return rc;
    kv_frame_header_encode(buf, KV_MSG_AUTH_OK, request_id, KV_PROTO_AUTH_OK_SIZE);
    kv_frame_set_version(buf, KV_PROTO_AUTH_VERSION);
    memcpy(buf + KV_PROTO_HEADER, sig, 64);
    *n = KV_PROTO_HEADER + KV_PROTO_AUTH_OK_SIZE;
    return 0;
}

/* ---- decoder ------------------------------------------------------------------- */

static int kv_exact(const char *what, size_t len, size_t want, kv_diag *d) {
    if (len != want)
        return kv_fail(d, KV_EPROTO, "%s: payload is %zu bytes, expected exactly %zu", what, len,
                       want);
    return 0;
}

static int kv_dec_hello(kv_rd *r, kv_msg_hello *m, kv_diag *d) {
    int rc = kv_exact("HELLO", r->left, KV_PROTO_HELLO_SIZE, d);
    if (rc) return rc;
    const uint8_t *id = NULL;
    kv_rd_u16(r, &m->min_version);
    kv_rd_u16(r, &m->max_version);
    kv_rd_take(r, KV_PROTO_MODEL_ID_LEN, &id);
    kv_rd_u32(r, &m->enc_mask);
    if (m->min_version == 0 || m->min_version > m->max_version)
        return kv_fail(d, KV_EPROTO, "HELLO: version range [%u, %u] invalid", m->min_version,
                       m->max_version);
    if (!kv_model_id_ok((const char *)id, KV_PROTO_MODEL_ID_LEN))
        return kv_fail(d, KV_EPROTO, "HELLO: model id is not %u lowercase hex digits",
                       KV_PROTO_MODEL_ID_LEN);
    memcpy(m->model_id, id, KV_PROTO_MODEL_ID_LEN);
    m->model_id[KV_PROTO_MODEL_ID_LEN] = 0;
    if (m->enc_mask & ~KV_ENC_MASK_VALID)
        return kv_fail(d, KV_EUNSUPPORTED, "HELLO: unknown encodings in mask 0x%x", m->enc_mask);
    if (!(m->enc_mask & 1u))
        return kv_fail(d, KV_EPROTO, "HELLO: encoding mask 0x%x lacks f32", m->enc_mask);
    return 0;
}

static int kv_dec_ack(kv_rd *r, uint16_t hversion, kv_msg_hello_ack *m, kv_diag *d) {
    if (r->left < KV_PROTO_HELLO_ACK_FIXED)
        return kv_fail(d, KV_EPROTO, "HELLO_ACK: payload is %zu bytes, fixed part needs %u",
                       r->left, KV_PROTO_HELLO_ACK_FIXED);
    size_t len = r->left;
    uint16_t bl;
    const uint8_t *id = NULL, *name = NULL;
    kv_rd_u16(r, &m->version);
    kv_rd_u16(r, &bl);
    kv_rd_take(r, KV_PROTO_MODEL_ID_LEN, &id);
    kv_rd_u32(r, &m->n_layer);
    kv_rd_u32(r, &m->n_embd);
    kv_rd_u32(r, &m->n_ff_exp);
    kv_rd_u32(r, &m->n_expert);
    kv_rd_u32(r, &m->n_expert_used);
    kv_rd_u32(r, &m->enc_mask);
    kv_rd_u32(r, &m->n_ranges);
    if (m->version == 0) return kv_fail(d, KV_EPROTO, "HELLO_ACK: version 0");
    if (m->version > KV_PROTO_VERSION)
        return kv_fail(d, KV_EUNSUPPORTED, "HELLO_ACK: version %u unknown (this build speaks up to %u)",
                       m->version, KV_PROTO_VERSION);
    if (hversion != m->version)
        return kv_fail(d, KV_EPROTO, "HELLO_ACK: chose version %u in a frame of version %u", m->version,
                       hversion);
    size_t fixed = KV_PROTO_HELLO_ACK_FIXED;
    m->n_slabs = m->max_pairs = 0;
    m->slabs = NULL;
    m->slabs_wire = NULL;
    if (m->version >= 2) {
        if (len < KV_PROTO_HELLO_ACK_FIXED_V2)
            return kv_fail(d, KV_EPROTO, "HELLO_ACK: payload is %zu bytes, v2 fixed part needs %u", len,
                           KV_PROTO_HELLO_ACK_FIXED_V2);
        kv_rd_u32(r, &m->n_slabs);
        kv_rd_u32(r, &m->max_pairs);
        if (m->n_slabs > KV_PROTO_MAX_RANGES)
            return kv_fail(d, KV_ERANGE, "HELLO_ACK: %u slabs exceed maximum %u", m->n_slabs,
                           KV_PROTO_MAX_RANGES);
        fixed = KV_PROTO_HELLO_ACK_FIXED_V2;
    }
    if (bl == 0 || bl > KV_PROTO_MAX_NAME)
        return kv_fail(d, KV_ERANGE, "HELLO_ACK: backend name length %u out of [1, %u]", bl,
                       KV_PROTO_MAX_NAME);
    if (m->n_ranges > KV_PROTO_MAX_RANGES)
        return kv_fail(d, KV_ERANGE, "HELLO_ACK: %u ranges exceed maximum %u", m->n_ranges,
                       KV_PROTO_MAX_RANGES);
    int rc = kv_exact("HELLO_ACK", len, fixed + (size_t)bl + (size_t)m->n_ranges * 12 +
                                            (size_t)m->n_slabs * KV_PROTO_SLAB_SIZE, d);
    if (rc) return rc;
    if (!kv_model_id_ok((const char *)id, KV_PROTO_MODEL_ID_LEN))
        return kv_fail(d, KV_EPROTO, "HELLO_ACK: model id is not %u lowercase hex digits",
                       KV_PROTO_MODEL_ID_LEN);
    memcpy(m->model_id, id, KV_PROTO_MODEL_ID_LEN);
    m->model_id[KV_PROTO_MODEL_ID_LEN] = 0;
    if (m->enc_mask & ~KV_ENC_MASK_VALID)
        return kv_fail(d, KV_EUNSUPPORTED, "HELLO_ACK: unknown encodings in mask 0x%x",
                       m->enc_mask);
    if (!(m->enc_mask & 1u))
        return kv_fail(d, KV_EPROTO, "HELLO_ACK: encoding mask 0x%x lacks f32", m->enc_mask);
    kv_rd_take(r, bl, &name);
    if (!kv_name_ok(name, bl))
        return kv_fail(d, KV_EPROTO, "HELLO_ACK: backend name is not printable ASCII");
    memcpy(m->backend, name, bl);
    m->backend[bl] = 0;
    m->ranges = NULL;
    kv_rd_take(r, (size_t)m->n_ranges * 12, &m->ranges_wire);
    if (m->n_slabs) kv_rd_take(r, (size_t)m->n_slabs * KV_PROTO_SLAB_SIZE, &m->slabs_wire);
    return kv_ack_check(m, KV_ERANGE, d);
}

static int kv_dec_compute(kv_rd *r, const kv_proto_limits *lim, kv_msg_compute *m, kv_diag *d) {
    if (r->left < KV_PROTO_COMPUTE_FIXED)
        return kv_fail(d, KV_EPROTO, "COMPUTE: payload is %zu bytes, fixed part needs %u",
                       r->left, KV_PROTO_COMPUTE_FIXED);
    size_t len = r->left;
    uint16_t enc, out_enc;
    kv_rd_u32(r, &m->layer);
    kv_rd_u16(r, &enc);
    kv_rd_u16(r, &out_enc);
    kv_rd_u32(r, &m->n_tokens);
    kv_rd_u32(r, &m->n_embd);
    kv_rd_u32(r, &m->n_pairs);
    m->enc = enc;
    m->out_enc = out_enc;
    m->x = NULL;
    m->pairs = NULL;
    if (!kv_enc_size(m->enc))
        return kv_fail(d, KV_EUNSUPPORTED, "COMPUTE: unknown encoding %u", m->enc);
    if (!kv_enc_size(m->out_enc & ~KV_OUT_PREACT))
        return kv_fail(d, KV_EUNSUPPORTED, "COMPUTE: unknown output encoding %u", m->out_enc);
    if ((m->out_enc & KV_OUT_PREACT) && (m->out_enc & ~KV_OUT_PREACT) != KV_ENC_F32)
        return kv_fail(d, KV_EPROTO, "COMPUTE: pre-activations are answered in f32 only");
    if (m->n_tokens == 0 || m->n_tokens > KV_PROTO_MAX_TOKENS)
        return kv_fail(d, KV_ERANGE, "COMPUTE: n_tokens %u out of [1, %u]", m->n_tokens,
                       KV_PROTO_MAX_TOKENS);
    if (m->n_embd == 0 || m->n_embd > KV_PROTO_MAX_EMBD)
        return kv_fail(d, KV_ERANGE, "COMPUTE: n_embd %u out of [1, %u]", m->n_embd,
                       KV_PROTO_MAX_EMBD);
    if (m->n_pairs == 0 || m->n_pairs > KV_PROTO_MAX_PAIRS)
        return kv_fail(d, KV_ERANGE, "COMPUTE: n_pairs %u out of [1, %u]", m->n_pairs,
                       KV_PROTO_MAX_PAIRS);
    if (lim && lim->n_layer && m->layer >= lim->n_layer)
        return kv_fail(d, KV_ERANGE, "COMPUTE: layer %u >= n_layer %u", m->layer, lim->n_layer);
    if (lim && lim->n_embd && m->n_embd != lim->n_embd)
        return kv_fail(d, KV_ERANGE, "COMPUTE: n_embd %u, this model has %u", m->n_embd,
                       lim->n_embd);
    size_t want = kv_compute_payload(m->enc, m->n_tokens, m->n_embd, m->n_pairs);
    if (!want)
        return kv_fail(d, KV_ERANGE, "COMPUTE: %u tokens x %u in %s exceed the payload maximum",
                       m->n_tokens, m->n_embd, kv_enc_name(m->enc));
    if (!kv_result_payload(m->out_enc & ~KV_OUT_PREACT, m->n_pairs, m->n_embd, true))
        return kv_fail(d, KV_ERANGE, "COMPUTE: the result (%u pairs x %u in %s) would exceed "
                                     "the payload maximum", m->n_pairs, m->n_embd,
                       kv_enc_name(m->out_enc));
    int rc = kv_exact("COMPUTE", len, want, d);
    if (rc) return rc;
    kv_rd_take(r, (size_t)m->n_tokens * m->n_embd * kv_enc_size(m->enc), &m->x_wire);
    kv_rd_take(r, (size_t)m->n_pairs * 8, &m->pairs_wire);
    for (uint32_t i = 0; i < m->n_pairs; i++) {
        kv_proto_pair p = kv_msg_compute_pair(m, i);
        if (p.token >= m->n_tokens)
            return kv_fail(d, KV_ERANGE, "COMPUTE: pair %u: token %u >= n_tokens %u", i, p.token,
                           m->n_tokens);
        if (p.expert >= KV_PROTO_MAX_EXPERTS ||
            (lim && lim->n_expert && p.expert >= lim->n_expert))
            return kv_fail(d, KV_ERANGE, "COMPUTE: pair %u: expert %u >= n_expert %u", i,
                           p.expert, lim && lim->n_expert ? lim->n_expert : KV_PROTO_MAX_EXPERTS);
    }
    return 0;
}

static int kv_dec_result(kv_rd *r, uint16_t hversion, const kv_proto_limits *lim, kv_msg_result *m, kv_diag *d) {
    const bool sig = hversion >= KV_PROTO_SIG_VERSION;
    if (r->left < KV_PROTO_RESULT_FIXED)
        return kv_fail(d, KV_EPROTO, "RESULT: payload is %zu bytes, fixed part needs %u", r->left,
                       KV_PROTO_RESULT_FIXED);
    size_t len = r->left;
    kv_rd_u32(r, &m->n_pairs);
    kv_rd_u32(r, &m->n_embd);
    kv_rd_u32(r, &m->enc);
    m->y = NULL;
    m->sig = NULL;
    m->n_ff = 0;
    if (!kv_enc_size(m->enc))
        return kv_fail(d, KV_EUNSUPPORTED, "RESULT: unknown encoding %u", m->enc);
    if (m->n_pairs == 0 || m->n_pairs > KV_PROTO_MAX_PAIRS)
        return kv_fail(d, KV_ERANGE, "RESULT: n_pairs %u out of [1, %u]", m->n_pairs,
                       KV_PROTO_MAX_PAIRS);
    if (m->n_embd == 0 || m->n_embd > KV_PROTO_MAX_EMBD)
        return kv_fail(d, KV_ERANGE, "RESULT: n_embd %u out of [1, %u]", m->n_embd,
                       KV_PROTO_MAX_EMBD);
    if (lim && lim->n_embd && m->n_embd != lim->n_embd)
        return kv_fail(d, KV_ERANGE, "RESULT: n_embd %u, expected %u", m->n_embd, lim->n_embd);
    size_t want = kv_result_payload(m->enc, m->n_pairs, m->n_embd, sig);
    if (!want)
        return kv_fail(d, KV_ERANGE, "RESULT: %u pairs x %u exceed the payload maximum",
                       m->n_pairs, m->n_embd);
    int rc = kv_exact("RESULT", len, want, d);
    if (rc) return rc;
    kv_rd_take(r, want - KV_PROTO_RESULT_FIXED - (sig ? KV_PROTO_RESULT_SIG : 0), &m->y_wire);
    if (sig) kv_rd_take(r, KV_PROTO_RESULT_SIG, &m->sig);
    return 0;
}

static int kv_dec_result_pre(kv_rd *r, uint16_t hversion, const kv_proto_limits *lim, kv_msg_result *m,
                             kv_diag *d) {
    if (hversion < KV_PROTO_AUTH_VERSION)
        return kv_fail(d, KV_EPROTO, "RESULT_PRE in a frame of version %u (needs %u)", hversion, KV_PROTO_AUTH_VERSION);
    if (r->left < KV_PROTO_RESULT_PRE_FIXED)
        return kv_fail(d, KV_EPROTO, "RESULT_PRE: payload is %zu bytes, fixed part needs %u", r->left,
                       KV_PROTO_RESULT_PRE_FIXED);
    const size_t len = r->left;
    kv_rd_u32(r, &m->n_pairs);
    kv_rd_u32(r, &m->n_embd);
    kv_rd_u32(r, &m->n_ff);
    kv_rd_u32(r, &m->enc);
    m->y = NULL;
    m->sig = NULL;
    const bool sig = hversion >= KV_PROTO_SIG_VERSION;
    if (m->enc != KV_ENC_F32) return kv_fail(d, KV_EPROTO, "RESULT_PRE: encoding %u, must be f32", m->enc);
    if (m->n_pairs == 0 || m->n_pairs > KV_PROTO_MAX_PAIRS)
        return kv_fail(d, KV_ERANGE, "RESULT_PRE: n_pairs %u out of [1, %u]", m->n_pairs, KV_PROTO_MAX_PAIRS);
    if (m->n_embd == 0 || m->n_embd > KV_PROTO_MAX_EMBD || m->n_ff == 0 || m->n_ff > KV_PROTO_MAX_FF)
        return kv_fail(d, KV_ERANGE, "RESULT_PRE: dims %u x %u out of bounds", m->n_embd, m->n_ff);
    if (lim && lim->n_embd && m->n_embd != lim->n_embd)
        return kv_fail(d, KV_ERANGE, "RESULT_PRE: n_embd %u, expected %u", m->n_embd, lim->n_embd);
    if (lim && lim->n_ff && m->n_ff != lim->n_ff)
        return kv_fail(d, KV_ERANGE, "RESULT_PRE: n_ff %u, expected %u", m->n_ff, lim->n_ff);
    const size_t want = kv_result_pre_payload(m->n_pairs, m->n_embd, m->n_ff, sig);
    if (!want) return kv_fail(d, KV_ERANGE, "RESULT_PRE: exceeds the payload maximum");
    int rc = kv_exact("RESULT_PRE", len, want, d);
    if (rc) return rc;
    kv_rd_take(r, want - KV_PROTO_RESULT_PRE_FIXED - (sig ? KV_PROTO_RESULT_SIG : 0), &m->y_wire);
    if (sig) kv_rd_take(r, KV_PROTO_RESULT_SIG, &m->sig);
    return 0;
}

static int kv_dec_error(kv_rd *r, kv_msg_error *m, kv_diag *d) {
    if (r->left < KV_PROTO_ERROR_FIXED)
        return kv_fail(d, KV_EPROTO, "ERROR: payload is %zu bytes, fixed part needs %u", r->left,
                       KV_PROTO_ERROR_FIXED);
    size_t len = r->left;
    uint32_t code, ml;
    const uint8_t *s = NULL;
    kv_rd_u32(r, &code);
    kv_rd_u32(r, &ml);
    m->code = (int32_t)code;
    if (m->code >= 0 || m->code < -32768)
        return kv_fail(d, KV_ERANGE, "ERROR: code %d out of [-32768, -1]", m->code);
    if (ml > KV_PROTO_MAX_TEXT)
        return kv_fail(d, KV_ERANGE, "ERROR: message length %u exceeds maximum %u", ml,
                       KV_PROTO_MAX_TEXT);
    int rc = kv_exact("ERROR", len, KV_PROTO_ERROR_FIXED + (size_t)ml, d);
    if (rc) return rc;
    kv_rd_take(r, ml, &s);
    if (!kv_text_ok(s, ml))
        return kv_fail(d, KV_EPROTO, "ERROR: message contains control characters");
    memcpy(m->msg, s, ml);
    m->msg[ml] = 0;
    return 0;
}

int kv_msg_decode(const uint8_t *frame, size_t n, const kv_proto_limits *lim, kv_msg *out,
                  kv_diag *d) {
    int rc = kv_frame_header_decode(frame, n, &out->h, d);
    if (rc) return rc;
    if (n - KV_PROTO_HEADER != out->h.len)
        return kv_fail(d, KV_EPROTO, "frame: header says %u payload bytes, frame has %zu",
                       out->h.len, n - KV_PROTO_HEADER);
    kv_rd r = {frame + KV_PROTO_HEADER, out->h.len};
    switch (out->h.type) {
    case KV_MSG_HELLO: return kv_dec_hello(&r, &out->u.hello, d);
    case KV_MSG_HELLO_ACK: return kv_dec_ack(&r, out->h.version, &out->u.ack, d);
    case KV_MSG_COMPUTE: return kv_dec_compute(&r, lim, &out->u.compute, d);
    case KV_MSG_RESULT: return kv_dec_result(&r, out->h.version, lim, &out->u.result, d);
    case KV_MSG_RESULT_PRE: return kv_dec_result_pre(&r, out->h.version, lim, &out->u.result, d);
    case KV_MSG_ERROR: return kv_dec_error(&r, &out->u.error, d);
    case KV_MSG_PING:
    case KV_MSG_PONG:
        if ((rc = kv_exact(out->h.type == KV_MSG_PING ? "PING" : "PONG", r.left,
                           KV_PROTO_PING_SIZE, d)))
            return rc;
        kv_rd_u64(&r, &out->u.nonce);
        return 0;
    case KV_MSG_STATS: return kv_exact("STATS", r.left, 0, d);
    case KV_MSG_STATS_ACK: {
        if (out->h.version > KV_PROTO_VERSION)
            return kv_fail(d, KV_EUNSUPPORTED, "STATS_ACK: version %u unknown", out->h.version);
        const bool v2 = out->h.version >= 2;
        if ((rc = kv_exact("STATS_ACK", r.left, kv_stats_ack_size(out->h.version), d))) return rc;
        kv_msg_stats *s = &out->u.stats;
        memset(s, 0, sizeof *s);
        kv_rd_u64(&r, &s->n_compute);
        kv_rd_u64(&r, &s->n_pairs);
        kv_rd_u64(&r, &s->n_tokens);
        kv_rd_u64(&r, &s->n_conns);
        kv_rd_u64(&r, &s->n_errors);
        kv_rd_u64(&r, &s->uptime_ms);
        if (v2) {
            kv_rd_u64(&r, &s->n_batches);
            kv_rd_u64(&r, &s->n_merged);
            kv_rd_u64(&r, &s->compute_us);
        }
        if (out->h.version >= KV_PROTO_CANCEL_VERSION) kv_rd_u64(&r, &s->n_cancelled);
        return 0;
    }
    case KV_MSG_CANCEL:
    case KV_MSG_CANCELLED:
        /* only in v6 and later: an older peer never sends them, nor is sent them */
        if (out->h.version < KV_PROTO_CANCEL_VERSION)
            return kv_fail(d, KV_EPROTO, "%s in a frame of version %u (needs %u)", kv_msg_type_name(out->h.type),
                           out->h.version, KV_PROTO_CANCEL_VERSION);
        return kv_exact(kv_msg_type_name(out->h.type), r.left, 0, d);
    case KV_MSG_AUTH_CHALLENGE:
    case KV_MSG_AUTH:
    case KV_MSG_AUTH_OK: {
        /* only in v3 and later: a v2 peer never sends them */
        if (out->h.version < KV_PROTO_AUTH_VERSION)
            return kv_fail(d, KV_EPROTO, "%s in a frame of version %u (needs %u)", kv_msg_type_name(out->h.type),
                           out->h.version, KV_PROTO_AUTH_VERSION);
        const uint8_t *p = NULL;
        if (out->h.type == KV_MSG_AUTH_CHALLENGE) {
            if ((rc = kv_exact("AUTH_CHALLENGE", r.left, KV_PROTO_AUTH_CHALLENGE_SIZE, d))) return rc;
            kv_rd_take(&r, 32, &p);
            memcpy(out->u.challenge.worker_key, p, 32);
            kv_rd_take(&r, 32, &p);
            memcpy(out->u.challenge.challenge, p, 32);
            return 0;
        }
        if (out->h.type == KV_MSG_AUTH_OK) {
            if ((rc = kv_exact("AUTH_OK", r.left, KV_PROTO_AUTH_OK_SIZE, d))) return rc;
            kv_rd_take(&r, 64, &p);
            memcpy(out->u.auth_ok, p, 64);
            return 0;
        }
        if ((rc = kv_exact("AUTH", r.left, KV_PROTO_AUTH_SIZE, d))) return rc;
        kv_msg_auth *a = &out->u.auth;
        kv_rd_take(&r, 32, &p);
        memcpy(a->key, p, 32);
        kv_rd_take(&r, 32, &p);
        memcpy(a->nonce, p, 32);
        kv_rd_take(&r, 64, &p);
        memcpy(a->sig, p, 64);
        kv_rd_u32(&r, &a->flags);
        kv_rd_u64(&r, &a->voucher_expires_ms);
        kv_rd_take(&r, 64, &p);
        memcpy(a->voucher_sig, p, 64);
        return kv_auth_check(a, KV_EPROTO, d);
    }
    case KV_MSG_RECEIPT_REQ:
    case KV_MSG_RECEIPT: {
        int kv_msg_receipt_decode(const uint8_t *p, size_t n, uint16_t type, kv_msg *out, kv_diag *d);
        if (out->h.version < KV_PROTO_AUTH_VERSION) /* receipts name the keys of authenticated dispatch */
            return kv_fail(d, KV_EPROTO, "%s in a frame of version %u (needs %u)", kv_msg_type_name(out->h.type),
                           out->h.version, KV_PROTO_AUTH_VERSION);
        return kv_msg_receipt_decode(r.p, r.left, out->h.type, out, d);
    }
    default: return kv_fail(d, KV_EPROTO, "frame: unknown message type %u", out->h.type);
    }
}

/* ---- accessors --------------------------------------------------------------------- */

kv_held_range kv_msg_hello_ack_range(const kv_msg_hello_ack *m, uint32_t i) {
    KV_ASSERT(i < m->n_ranges);
    if (m->ranges) return m->ranges[i];
    const uint8_t *p = m->ranges_wire + (size_t)i * 12;
    kv_held_range r = {kv_rd32(p), kv_rd32(p + 4), kv_rd32(p + 8)};
    return r;
}

kv_slab_hash kv_msg_hello_ack_slab(const kv_msg_hello_ack *m, uint32_t i) {
    KV_ASSERT(i < m->n_slabs);
    if (m->slabs) return m->slabs[i];
    const uint8_t *p = m->slabs_wire + (size_t)i * KV_PROTO_SLAB_SIZE;
    kv_slab_hash s = {kv_rd32(p), kv_rd32(p + 4), kv_rd32(p + 8), {0}};
    memcpy(s.sha256, p + 12, 32);
    return s;
}

bool kv_msg_hello_ack_holds(const kv_msg_hello_ack *m, uint32_t layer, uint32_t expert) {
    /* ranges are sorted by (layer, first) and disjoint: binary search */
    uint32_t lo = 0, hi = m->n_ranges;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        kv_held_range r = kv_msg_hello_ack_range(m, mid);
        if (r.layer < layer || (r.layer == layer && r.last < expert))
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == m->n_ranges) return false;
    kv_held_range r = kv_msg_hello_ack_range(m, lo);
    return r.layer == layer && r.first <= expert && expert <= r.last;
}

kv_proto_pair kv_msg_compute_pair(const kv_msg_compute *m, uint32_t i) {
    KV_ASSERT(i < m->n_pairs);
    if (m->pairs) return m->pairs[i];
    const uint8_t *p = m->pairs_wire + (size_t)i * 8;
    kv_proto_pair r = {kv_rd32(p), kv_rd32(p + 4)};
    return r;
}

void kv_msg_compute_row(const kv_msg_compute *m, uint32_t t, float *out) {
    KV_ASSERT(t < m->n_tokens);
    if (m->x) {
        memcpy(out, m->x + (size_t)t * m->n_embd, (size_t)m->n_embd * sizeof(float));
        return;
    }
    size_t es = kv_enc_size(m->enc);
    kv_enc_read(out, m->x_wire + (size_t)t * m->n_embd * es, m->n_embd, m->enc);
}

void kv_msg_compute_x(const kv_msg_compute *m, float *out) {
    size_t nx = (size_t)m->n_tokens * m->n_embd;
    if (m->x)
        memcpy(out, m->x, nx * sizeof(float));
    else
        kv_enc_read(out, m->x_wire, nx, m->enc);
}

const float *kv_msg_compute_x_inplace(const kv_msg_compute *m) {
    if (m->x) return m->x;
    if (m->enc != KV_ENC_F32 || !kv_host_le() || ((uintptr_t)m->x_wire & 3u)) return NULL;
    return (const float *)(const void *)m->x_wire;
}

void kv_msg_result_row(const kv_msg_result *m, uint32_t p, float *out) {
    KV_ASSERT(p < m->n_pairs);
    if (m->n_ff) { /* RESULT_PRE: rows of y, gate, up in f32 */
        kv_enc_read(out, m->y_wire + (size_t)p * ((size_t)m->n_embd + 2 * (size_t)m->n_ff) * 4, m->n_embd, KV_ENC_F32);
        return;
    }
    if (m->y) {
        memcpy(out, m->y + (size_t)p * m->n_embd, (size_t)m->n_embd * sizeof(float));
        return;
    }
    size_t es = kv_enc_size(m->enc);
    kv_enc_read(out, m->y_wire + (size_t)p * m->n_embd * es, m->n_embd, m->enc);
}

void kv_msg_result_pre_row(const kv_msg_result *m, uint32_t p, float *gate, float *up) {
    KV_ASSERT(p < m->n_pairs && m->n_ff);
    const uint8_t *row = m->y_wire + (size_t)p * ((size_t)m->n_embd + 2 * (size_t)m->n_ff) * 4 + (size_t)m->n_embd * 4;
    kv_enc_read(gate, row, m->n_ff, KV_ENC_F32);
    kv_enc_read(up, row + (size_t)m->n_ff * 4, m->n_ff, KV_ENC_F32);
}

void kv_msg_result_y(const kv_msg_result *m, float *out) {
    if (m->n_ff) {
        for (uint32_t p = 0; p < m->n_pairs; p++) kv_msg_result_row(m, p, out + (size_t)p * m->n_embd);
        return;
    }
    size_t ny = (size_t)m->n_pairs * m->n_embd;
    if (m->y)
        memcpy(out, m->y, ny * sizeof(float));
    else
        kv_enc_read(out, m->y_wire, ny, m->enc);
}

/* ---- stream I/O ----------------------------------------------------------------- */

static int64_t kv_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void kv_frame_rx_init(kv_frame_rx *rx, uint8_t *buf, size_t cap) {
    KV_ASSERT(buf && cap >= KV_PROTO_HEADER);
    rx->buf = buf;
    rx->cap = cap;
    kv_frame_rx_reset(rx);
}

void kv_frame_rx_reset(kv_frame_rx *rx) {
    rx->have = 0;
    rx->need = KV_PROTO_HEADER;
    memset(&rx->h, 0, sizeof rx->h);
}

int kv_frame_rx_read(kv_frame_rx *rx, int fd, kv_diag *d) {
    /* h.magic is set (reset zeroes it) once the header has been accepted */
    if (rx->h.magic == KV_PROTO_MAGIC && rx->have == rx->need) return 1;
    for (;;) {
        ssize_t k = read(fd, rx->buf + rx->have, rx->need - rx->have);
        if (k < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            return kv_fail(d, KV_EIO, "read: %s", strerror(errno));
        }
        if (k == 0) {
            if (rx->have == 0) return kv_fail(d, KV_EIO, "closed");
            return kv_fail(d, KV_EIO, "connection closed inside a frame (%zu of %zu bytes)",
                           rx->have, rx->need);
        }
        rx->have += (size_t)k;
        if (rx->have == KV_PROTO_HEADER && rx->need == KV_PROTO_HEADER) {
            int rc = kv_frame_header_decode(rx->buf, KV_PROTO_HEADER, &rx->h, d);
            if (rc) return rc;
            if ((size_t)rx->h.len > rx->cap - KV_PROTO_HEADER)
                return kv_fail(d, KV_ERANGE, "frame: payload length %u exceeds this buffer (%zu)",
                               rx->h.len, rx->cap - KV_PROTO_HEADER);
            rx->need = KV_PROTO_HEADER + (size_t)rx->h.len;
        }
        if (rx->have == rx->need) return 1;
        /* for a nonblocking fd keep reading until EAGAIN; a blocking fd
         * simply blocks in read() for the rest */
    }
}

int kv_proto_write_all(int fd, const void *buf, size_t n, int timeout_ms, kv_diag *d) {
    const kv_link_chan c = {fd, NULL};
    return kv_proto_write_all_chan(&c, buf, n, timeout_ms, d);
}

int kv_proto_write_all_chan(const kv_link_chan *c, const void *buf, size_t n, int timeout_ms, kv_diag *d) {
    kv_link_io io = {.timeout_ms = timeout_ms};
    return kv_link_chan_write_full(c, buf, n, &io, d);
}

int kv_proto_read_msg(kv_frame_rx *rx, int fd, int timeout_ms, const kv_proto_limits *lim,
                      kv_msg *out, kv_diag *d) {
    const kv_link_chan c = {fd, NULL};
    return kv_proto_read_msg_chan(rx, &c, timeout_ms, lim, out, d);
}

int kv_proto_read_msg_chan(kv_frame_rx *rx, const kv_link_chan *c, int timeout_ms, const kv_proto_limits *lim,
                           kv_msg *out, kv_diag *d) {
    const int64_t deadline = timeout_ms >= 0 ? kv_now_ms() + timeout_ms : -1;
    /* h.magic is set (reset zeroes it) once the header has been accepted */
    while (!(rx->h.magic == KV_PROTO_MAGIC && rx->have == rx->need)) {
        kv_link_io io = {.timeout_ms = -1};
        if (deadline >= 0) {
            const int64_t left = deadline - kv_now_ms();
            io.timeout_ms = left < 0 ? 0 : (int)left;
        }
        const int rc = kv_link_chan_read_full(c, rx->buf + rx->have, rx->need - rx->have, &io, d);
        rx->have += io.got;
        if (rc == KV_ETIMEOUT) return kv_fail(d, rc, "read: no whole frame within %d ms", timeout_ms);
        if (rc && io.closed && rx->have == 0) return kv_fail(d, KV_EIO, "closed");
        if (rc && io.closed)
            return kv_fail(d, KV_EIO, "connection closed inside a frame (%zu of %zu bytes)", rx->have, rx->need);
        if (rc) return rc;
        if (rx->need == KV_PROTO_HEADER) {
            const int hr = kv_frame_header_decode(rx->buf, KV_PROTO_HEADER, &rx->h, d);
            if (hr) return hr;
            if ((size_t)rx->h.len > rx->cap - KV_PROTO_HEADER)
                return kv_fail(d, KV_ERANGE, "frame: payload length %u exceeds this buffer (%zu)", rx->h.len,
                               rx->cap - KV_PROTO_HEADER);
            rx->need = KV_PROTO_HEADER + (size_t)rx->h.len;
        }
    }
    return kv_msg_decode(rx->buf, rx->need, lim, out, d);
}
