/* Dispatch codec: the binary protocol between a coordinator and expert
 * workers (frames, their encoders and decoder, the transcript both ends sign,
 * and the stream helpers that read and write whole frames on a socket). The
 * worker (kvasir/dispatch_worker.h), the remote provider
 * (kvasir/dispatch_remote.h), signed results (kvasir/dispatch_evidence.h)
 * and work receipts (kvasir/dispatch_receipt.h) are built on it.
 *
 * Wire format (all integers little-endian; docs/PROTOCOL.md is normative):
 *   frame   = header(16) payload(len)
 *   header  = u32 magic "KVD1" | u16 version | u16 type | u32 request_id | u32 len
 * Every length, count and id read from the wire is bounded by the maxima
 * below and checked against the bytes of the frame before use; a payload's
 * length must equal exactly the size its own counts imply. A malformed,
 * oversized or unknown frame closes that one connection with an ERROR frame
 * (when possible); the worker keeps serving others.
 *
 * Codec functions are pure (no I/O, no allocation): encoders write a whole
 * frame into a caller buffer, decoders take one complete frame and fill a
 * view whose pointers point into that frame (valid while the buffer is), so
 * the decoder can be fuzzed directly. Big arrays (hidden states, pairs,
 * outputs, ranges) stay in wire form and are read through accessors that
 * convert (little-endian, f16/bf16 -> f32 with ggml's rounding).
 *
 * Error codes of the codec: KV_EPROTO (bad magic, unknown type, a length
 * that is not the exact expected size, nonzero reserved bits, bad text),
 * KV_ERANGE (a count or index outside its bound or the peer's dims),
 * KV_EUNSUPPORTED (unknown encoding, no common protocol version). */
#ifndef KVASIR_DISPATCH_PROTO_H
#define KVASIR_DISPATCH_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/link.h"
#include "kvasir/transport.h"

#define KV_PROTO_MAGIC 0x3144564Bu /* "KVD1" little-endian */
#define KV_PROTO_VERSION 6u        /* the newest version this build speaks */
#define KV_PROTO_VERSION_MIN 1u    /* the oldest version this build decodes */
#define KV_PROTO_AUTH_VERSION 3u   /* the first version with authenticated dispatch: workers
                                      and coordinators of this build require it */
#define KV_PROTO_SIG_VERSION 4u    /* the first version whose RESULT and RESULT_PRE end with the
                                      worker's signature (KV_PROTO_RESULT_SIG bytes) */
#define KV_PROTO_TLS_VERSION 5u    /* the first version bound to TLS: over a TLS link both key
                                      handshake signatures cover the session's exporter, and a
                                      TLS link negotiates nothing older (docs/PROTOCOL.md) */
#define KV_PROTO_CANCEL_VERSION 6u /* the first version with CANCEL / CANCELLED (a hedged request's
                                      loser is called off) and the ten-counter STATS_ACK */
#define KV_PROTO_HEADER 16u
#define KV_PROTO_MAX_PAYLOAD (256u << 20) /* bytes in one frame's payload */
#define KV_PROTO_MAX_FRAME (KV_PROTO_HEADER + KV_PROTO_MAX_PAYLOAD)
#define KV_PROTO_MAX_TOKENS 4096u        /* tokens in one COMPUTE */
#define KV_PROTO_MAX_PAIRS (1u << 16)    /* (token, expert) pairs in one COMPUTE */
#define KV_PROTO_MAX_RANGES 65536u       /* held ranges listed in a HELLO_ACK */
#define KV_PROTO_MAX_TEXT 1024u          /* bytes of an error message */
#define KV_PROTO_MAX_NAME 64u            /* bytes of a backend name */
#define KV_PROTO_MAX_LAYERS 4096u        /* n_layer a peer may announce */
#define KV_PROTO_MAX_EXPERTS 65536u      /* n_expert a peer may announce */
#define KV_PROTO_MAX_EMBD 65536u         /* n_embd a peer may announce */
#define KV_PROTO_MAX_FF (1u << 20)       /* n_ff_exp a peer may announce */
#define KV_PROTO_MODEL_ID_LEN 64u        /* model identity: 64 lowercase hex digits */

/* Fixed payload sizes (see docs/PROTOCOL.md). */
#define KV_PROTO_HELLO_SIZE 72u          /* u16 min, u16 max, id[64], u32 enc_mask */
#define KV_PROTO_HELLO_ACK_FIXED 96u     /* v1: before backend name and ranges */
#define KV_PROTO_HELLO_ACK_FIXED_V2 104u /* v2: + u32 n_slabs, u32 max_pairs */
#define KV_PROTO_SLAB_SIZE 44u           /* v2 slab entry: u32 layer, first, last, u8[32] sha256 */
#define KV_PROTO_COMPUTE_FIXED 20u       /* before hidden states and pairs */
#define KV_PROTO_RESULT_FIXED 12u        /* before the outputs */
#define KV_PROTO_ERROR_FIXED 8u          /* before the message */
#define KV_PROTO_PING_SIZE 8u            /* u64 nonce (PING and PONG) */
#define KV_PROTO_STATS_ACK_SIZE 48u      /* v1: six u64 counters */
#define KV_PROTO_STATS_ACK_SIZE_V2 72u   /* v2: nine u64 counters */
#define KV_PROTO_STATS_ACK_SIZE_V6 80u   /* v6: ten u64 counters (+ n_cancelled) */
#define KV_PROTO_AUTH_CHALLENGE_SIZE 64u /* v3: u8[32] worker key, u8[32] challenge */
#define KV_PROTO_AUTH_SIZE 204u          /* v3: key, nonce, sig, u32 flags, u64 expiry, voucher sig */
#define KV_PROTO_AUTH_OK_SIZE 64u        /* v3: the worker's signature */
#define KV_PROTO_RESULT_PRE_FIXED 16u    /* v3 RESULT_PRE: n_pairs, n_embd, n_ff, enc */
#define KV_PROTO_RESULT_SIG 64u          /* v4: the Ed25519 signature after RESULT(_PRE)'s rows */
/* v3 verified compute (docs/VERIFY.md): in HELLO's enc_mask, "this
 * coordinator may ask for pre-activations"; in HELLO_ACK's, "this worker
 * returns them". Not an encoding. */
#define KV_PROTO_CAP_PREACT (1u << 31)
/* In COMPUTE's out_enc: answer with RESULT_PRE (y, gate, up per pair; f32 only). */
#define KV_OUT_PREACT 0x8000u
#define KV_PROTO_AUTH_VOUCHER 1u               /* AUTH flags bit 0: a hub voucher is attached */
/* The largest magnitude an expert output may have on the wire: a RESULT
 * with a NaN, an infinity or |y| above this is a lie (see PROTOCOL.md). */
#define KV_PROTO_MAX_ABS_OUTPUT 1e12f

enum kv_msg_type {
    KV_MSG_HELLO = 1,     /* coordinator -> worker: versions, model id, encodings */
    KV_MSG_HELLO_ACK = 2, /* worker -> coordinator: version, model id, dims, backend, ranges */
    KV_MSG_COMPUTE = 3,   /* coordinator -> worker: layer, hidden states, expert pairs */
    KV_MSG_RESULT = 4,    /* worker -> coordinator: one output vector per pair */
    KV_MSG_ERROR = 5,     /* either way: code + message; the sender closes after it */
    KV_MSG_PING = 6,      /* either way: u64 nonce */
    KV_MSG_PONG = 7,      /* answer to PING: the same nonce */
    KV_MSG_STATS = 8,     /* coordinator -> worker: empty; asks for counters */
    KV_MSG_STATS_ACK = 9, /* worker -> coordinator: counters */
    KV_MSG_AUTH_CHALLENGE = 10, /* v3 worker -> coordinator: its key and a fresh challenge */
    KV_MSG_AUTH = 11,     /* v3 coordinator -> worker: key, signature, optional hub voucher */
    KV_MSG_AUTH_OK = 12,  /* v3 worker -> coordinator: its signature over the same transcript */
    KV_MSG_RESULT_PRE = 13, /* v3 worker -> coordinator: per pair y, gate and up pre-activations */
    KV_MSG_RECEIPT_REQ = 14, /* v3 coordinator -> worker: sign a work receipt for this count */
    KV_MSG_RECEIPT = 15,  /* v3 worker -> coordinator: the signed receipt, or a refusal */
    KV_MSG_CANCEL = 16,   /* v6 coordinator -> worker: empty; call off the request named by the header's id */
    KV_MSG_CANCELLED = 17, /* v6 worker -> coordinator: empty; that request was called off, no RESULT follows */
    KV_MSG_TYPE_COUNT
};
_Static_assert(KV_MSG_HELLO == 1 && KV_MSG_HELLO_ACK == 2 && KV_MSG_COMPUTE == 3 &&
                   KV_MSG_RESULT == 4 && KV_MSG_ERROR == 5 && KV_MSG_PING == 6 &&
                   KV_MSG_PONG == 7 && KV_MSG_STATS == 8 && KV_MSG_STATS_ACK == 9 &&
                   KV_MSG_AUTH_CHALLENGE == 10 && KV_MSG_AUTH == 11 && KV_MSG_AUTH_OK == 12 &&
                   KV_MSG_RESULT_PRE == 13 && KV_MSG_RECEIPT_REQ == 14 && KV_MSG_RECEIPT == 15 &&
                   KV_MSG_CANCEL == 16 && KV_MSG_CANCELLED == 17,
               "wire message types never change");

/* Error codes carried by ERROR frames are the KV_E* numbers of err.h. */
_Static_assert(KV_EINVAL == -1 && KV_ENOMEM == -2 && KV_EIO == -3 && KV_EFORMAT == -4 &&
                   KV_EUNSUPPORTED == -5 && KV_ERANGE == -6 && KV_ENOTFOUND == -7 &&
                   KV_EPROTO == -8 && KV_ETIMEOUT == -9 && KV_EHASH == -10 &&
                   KV_ECTXFULL == -11 && KV_EINTERNAL == -12 && KV_EAUTH == -13,
               "wire error codes never change");

/* Encodings of hidden states / outputs on the wire. */
enum kv_act_enc { KV_ENC_F32 = 0, KV_ENC_F16 = 1, KV_ENC_BF16 = 2, KV_ENC_COUNT };
_Static_assert(KV_ENC_F32 == 0 && KV_ENC_F16 == 1 && KV_ENC_BF16 == 2,
               "wire encodings never change");
#define KV_ENC_MASK_ALL ((1u << KV_ENC_COUNT) - 1u)
#define KV_ENC_MASK_VALID (KV_ENC_MASK_ALL | KV_PROTO_CAP_PREACT) /* bits a mask may carry */

/* "HELLO", "COMPUTE"... of a message type; "?" if unknown. */
const char *kv_msg_type_name(uint32_t type);

/* Bytes per element of an encoding (0 if unknown); its name ("f32"...,
 * "?" if unknown). */
size_t kv_enc_size(uint32_t enc);
const char *kv_enc_name(uint32_t enc);
/* "f32"/"f16"/"bf16" -> enc, or -1. */
int kv_enc_from_name(const char *name);

typedef struct kv_frame_header {
    uint32_t magic, len, request_id;
    uint16_t version, type;
} kv_frame_header;

/* One range of experts a worker holds. */
typedef struct kv_held_range {
    uint32_t layer, first, last; /* inclusive */
} kv_held_range;

/* A slab a worker serves (v2 HELLO_ACK): its experts and its file's SHA-256. */
typedef struct kv_slab_hash {
    uint32_t layer, first, last; /* inclusive */
    uint8_t sha256[32];          /* of the whole slab file */
} kv_slab_hash;

/* A (token, expert) pair of a COMPUTE. */
typedef struct kv_proto_pair {
    uint32_t token;  /* index into the message's hidden states, < n_tokens */
    uint32_t expert; /* global expert id in the layer, < n_expert */
} kv_proto_pair;

/* ---- messages (encode inputs / decoded views) ------------------------- */

typedef struct kv_msg_hello {
    uint16_t min_version, max_version; /* protocol versions the coordinator speaks */
    char model_id[KV_PROTO_MODEL_ID_LEN + 1]; /* 64 lowercase hex + NUL */
    uint32_t enc_mask;                 /* bit e set: coordinator may send encoding e */
} kv_msg_hello;

typedef struct kv_msg_hello_ack {
    uint16_t version;                  /* chosen protocol version */
    char model_id[KV_PROTO_MODEL_ID_LEN + 1];
    uint32_t n_layer, n_embd, n_ff_exp, n_expert, n_expert_used; /* model dims */
    uint32_t enc_mask;                 /* encodings accepted (subset of HELLO's, F32 always) */
    char backend[KV_PROTO_MAX_NAME + 1]; /* kernel backend, e.g. "avx2"; printable ASCII */
    uint32_t n_ranges;                 /* held ranges, sorted by (layer, first), disjoint */
    const kv_held_range *ranges;       /* encode: [n_ranges]; decode: NULL, use accessor */
    const uint8_t *ranges_wire;        /* decode: [n_ranges][12] in the frame */
    /* v2 only (version >= 2; absent from a v1 ack: 0 / NULL) */
    uint32_t max_pairs;                /* pairs the worker accepts in one COMPUTE, 1..65536 */
    uint32_t n_slabs;                  /* slabs served, sorted by (layer, first), disjoint */
    const kv_slab_hash *slabs;         /* encode: [n_slabs]; decode: NULL, use accessor */
    const uint8_t *slabs_wire;         /* decode: [n_slabs][44] in the frame */
} kv_msg_hello_ack;

typedef struct kv_msg_compute {
    uint32_t layer;
    uint32_t enc;        /* encoding of the hidden states */
    uint32_t out_enc;    /* encoding the RESULT must use */
    uint32_t n_tokens;   /* hidden-state rows, 1..KV_PROTO_MAX_TOKENS */
    uint32_t n_embd;
    uint32_t n_pairs;    /* 1..KV_PROTO_MAX_PAIRS */
    const float *x;              /* encode: [n_tokens][n_embd] (converted to enc) */
    const kv_proto_pair *pairs;  /* encode: [n_pairs] */
    const uint8_t *x_wire;       /* decode: [n_tokens][n_embd] in enc, in the frame */
    const uint8_t *pairs_wire;   /* decode: [n_pairs][8] in the frame */
} kv_msg_compute;

typedef struct kv_msg_result {
    uint32_t n_pairs, n_embd, enc;
    const float *y;              /* encode: [n_pairs][n_embd] (converted to enc) */
    const uint8_t *y_wire;       /* decode: [n_pairs][n_embd] in enc, in the frame (RESULT_PRE:
                                    [n_pairs][n_embd + 2 n_ff] f32: y, gate, up) */
    uint32_t n_ff;               /* RESULT_PRE: gate and up per pair follow y; 0 in RESULT */
    const uint8_t *sig;          /* v4: [64] the worker's signature over kv_result_digest (decode:
                                    in the frame; encode: NULL writes the v3 layout, stamped 3) */
} kv_msg_result;

typedef struct kv_msg_error {
    int32_t code;                         /* a negative KV_E* code */
    char msg[KV_PROTO_MAX_TEXT + 1];      /* NUL-terminated; no control characters */
} kv_msg_error;

typedef struct kv_msg_stats {
    uint64_t n_compute;  /* COMPUTE messages answered with RESULT */
    uint64_t n_pairs;    /* expert computations ((token, expert) pairs) served */
    uint64_t n_tokens;   /* hidden-state rows received */
    uint64_t n_conns;    /* connections accepted */
    uint64_t n_errors;   /* ERROR frames sent */
    uint64_t uptime_ms;  /* since the worker started serving */
    /* v2 only (0 from a v1 peer) */
    uint64_t n_batches;  /* kernel calls (one batch may serve several requests) */
    uint64_t n_merged;   /* kernel calls that served rows of two or more connections */
    uint64_t compute_us; /* microseconds spent in kernel calls */
    /* v6 only (0 from an older peer) */
    uint64_t n_cancelled; /* requests called off by a CANCEL before their RESULT began (not in n_compute,
                             their pairs not in n_pairs) */
} kv_msg_stats;

/* v3 AUTH_CHALLENGE: sent by the worker right after its HELLO_ACK. */
typedef struct kv_msg_auth_challenge {
    uint8_t worker_key[32]; /* the worker's Ed25519 public key */
    uint8_t challenge[32];  /* random, fresh for this connection */
} kv_msg_auth_challenge;

/* v3 AUTH: the coordinator proves its key over this connection's
 * transcript (kv_dispatch_digest, role 'C') and may attach a hub voucher. */
typedef struct kv_msg_auth {
    uint8_t key[32];             /* the coordinator's Ed25519 public key */
    uint8_t nonce[32];           /* random, fresh: the worker signs it back in AUTH_OK */
    uint8_t sig[64];             /* over kv_dispatch_digest('C', ...) */
    uint32_t flags;              /* KV_PROTO_AUTH_VOUCHER or 0; other bits reserved (0) */
    uint64_t voucher_expires_ms; /* Unix ms; 0 without a voucher */
    uint8_t voucher_sig[64];     /* hub's signature over kv_voucher_digest; zeros without */
} kv_msg_auth;

/* Limits a decoder checks besides the protocol maxima: the receiver's model
 * dims (0 = unknown, not checked). */
typedef struct kv_proto_limits {
    uint32_t n_layer, n_embd, n_expert;
    uint32_t n_ff;  /* RESULT_PRE's n_ff must equal it (0 = not checked) */
} kv_proto_limits;

/* A decoded frame: the header and, per type, a view into the frame. */
/* RECEIPT_REQ / RECEIPT (v3; the codecs and the worker's rule are below) */
#define KV_PROTO_RECEIPT_REQ_SIZE 120u /* gateway[32], consumer[32], nonce[16], u64 n, digest[32] */
#define KV_PROTO_RECEIPT_SIZE 248u     /* u32 status, u32 zero, receipt[240] */
enum { KV_RECEIPT_SIGNED = 0, KV_RECEIPT_REFUSED = 1 };
struct kv_receipt;
typedef struct kv_receipt_req {
    char gateway[33];       /* gateway id, 1..32 of [A-Za-z0-9._:-] */
    uint8_t consumer[32];   /* the completion's authorization ... */
    uint8_t auth_nonce[16]; /* ... (consumer, nonce) */
    uint64_t n_products;    /* 1..2^40: the coordinator's count for this worker */
    uint8_t log_digest[32]; /* the coordinator's digest of that entry */
} kv_receipt_req;
/* What a worker computed for one connection and what it signed for. */
typedef struct kv_receipt_budget {
    uint64_t computed;   /* (token, expert) pairs answered on the connection */
    uint64_t signed_for; /* products of the receipts it signed there */
} kv_receipt_budget;

typedef struct kv_msg {
    kv_frame_header h;
    union {
        kv_msg_hello hello;
        kv_msg_hello_ack ack;
        kv_msg_compute compute;
        kv_msg_result result;
        kv_msg_error error;
        uint64_t nonce;         /* PING, PONG (CANCEL, CANCELLED: empty, the header's request_id) */
        kv_msg_stats stats;     /* STATS_ACK */
        kv_msg_auth_challenge challenge; /* AUTH_CHALLENGE */
        kv_msg_auth auth;       /* AUTH */
        uint8_t auth_ok[64];    /* AUTH_OK: the worker's signature */
        kv_receipt_req receipt_req; /* RECEIPT_REQ */
        const uint8_t *receipt; /* RECEIPT: its payload (KV_PROTO_RECEIPT_SIZE bytes, checked and its
                                   receipt's signature verified; kv_receipt_ans_from_payload reads it) */
    } u;
} kv_msg;

/* ---- frame header ------------------------------------------------------ */

/* Parses the 16-byte header at p (n >= 16 required, else KV_EPROTO): magic,
 * version != 0, known type, len <= KV_PROTO_MAX_PAYLOAD (else KV_ERANGE).
 * Does not compare the version with a negotiated one (the caller does). */
int kv_frame_header_decode(const uint8_t *p, size_t n, kv_frame_header *h, kv_diag *d);
void kv_frame_header_encode(uint8_t out[KV_PROTO_HEADER], uint16_t type, uint32_t request_id,
                            uint32_t len);

/* ---- sizes -------------------------------------------------------------- */

/* Whole-frame sizes (header included) for given counts; 0 if a count or
 * encoding is out of bounds or the payload would exceed the maximum. Use
 * them to size buffers before encoding. */
size_t kv_msg_compute_size(uint32_t enc, uint32_t n_tokens, uint32_t n_embd, uint32_t n_pairs);
size_t kv_msg_result_size(uint32_t enc, uint32_t n_pairs, uint32_t n_embd);
/* The same in version v's layout (v >= KV_PROTO_SIG_VERSION: the signature too). */
size_t kv_msg_result_size_v(uint16_t version, uint32_t enc, uint32_t n_pairs, uint32_t n_embd);
/* v1 layout (n_slabs 0); _v: the layout of version v (1 or 2). */
size_t kv_msg_hello_ack_size(size_t backend_len, uint32_t n_ranges);
size_t kv_msg_hello_ack_size_v(uint16_t version, size_t backend_len, uint32_t n_ranges, uint32_t n_slabs);

/* ---- encoders ---------------------------------------------------------- */
/* Each writes one whole frame (header + payload, header version
 * KV_PROTO_VERSION) into buf[cap] and sets *n to its size. Inputs are
 * validated like the decoder would (so a peer of this build never rejects
 * what we send). Errors: KV_EINVAL (bad input: out-of-bound counts, bad
 * model id, unknown encoding), KV_ERANGE (cap too small or payload too big);
 * nothing useful is in buf then. Thread-safe (no state). */
int kv_msg_hello_encode(uint8_t *buf, size_t cap, uint32_t request_id, const kv_msg_hello *m,
                        size_t *n, kv_diag *d);
/* The layout (and the header version) is m->version's: 1 or 2. */
int kv_msg_hello_ack_encode(uint8_t *buf, size_t cap, uint32_t request_id,
                            const kv_msg_hello_ack *m, size_t *n, kv_diag *d);
int kv_msg_compute_encode(uint8_t *buf, size_t cap, uint32_t request_id, const kv_msg_compute *m,
                          size_t *n, kv_diag *d);
int kv_msg_result_encode(uint8_t *buf, size_t cap, uint32_t request_id, const kv_msg_result *m,
                         size_t *n, kv_diag *d);
/* RESULT in pieces, for a worker that computes rows out of order:
 * _begin writes the header and fixed fields (checks like the encoder) and
 * sets *n to the whole frame size; _put_row then writes output row p (of
 * n_embd floats, converted to enc) into that frame. Every row must be put
 * before the frame is sent. */
int kv_msg_result_begin(uint8_t *buf, size_t cap, uint32_t request_id, uint32_t enc,
                        uint32_t n_pairs, uint32_t n_embd, size_t *n, kv_diag *d);
void kv_msg_result_put_row(uint8_t *buf, uint32_t enc, uint32_t n_embd, uint32_t p,
                           const float *row);
/* RESULT streamed: _head writes the first KV_PROTO_HEADER +
 * KV_PROTO_RESULT_FIXED bytes (header version `version`) into out and
 * returns the whole frame size, or 0 if the counts are out of bounds; the
 * rows then follow in order, each written by kv_msg_rows_put, and from
 * version KV_PROTO_SIG_VERSION on the KV_PROTO_RESULT_SIG bytes of the
 * signature after them (the size returned counts them). */
size_t kv_msg_result_head(uint8_t out[KV_PROTO_HEADER + KV_PROTO_RESULT_FIXED], uint16_t version,
                          uint32_t request_id, uint32_t enc, uint32_t n_pairs, uint32_t n_embd);
/* RESULT_PRE streamed: the first KV_PROTO_HEADER + KV_PROTO_RESULT_PRE_FIXED
 * bytes; returns the whole frame size (0 if out of bounds). Rows follow in
 * order, each n_embd + 2 n_ff f32: y, then gate, then up. */
size_t kv_msg_result_pre_head(uint8_t out[KV_PROTO_HEADER + KV_PROTO_RESULT_PRE_FIXED], uint16_t version,
                              uint32_t request_id, uint32_t n_pairs, uint32_t n_embd, uint32_t n_ff);
/* The whole frame from rows[n_pairs][n_embd + 2 n_ff]: with sig (64
 * bytes) the v4 layout stamped 4, without (NULL) the v3 one stamped 3. */
int kv_msg_result_pre_encode(uint8_t *buf, size_t cap, uint32_t request_id, uint32_t n_pairs, uint32_t n_embd,
                             uint32_t n_ff, const float *rows, const uint8_t *sig, size_t *n, kv_diag *d);
/* n floats to the wire in enc at dst (n * kv_enc_size(enc) bytes). */
void kv_msg_rows_put(uint8_t *dst, uint32_t enc, const float *src, size_t n);
/* Rewrites the version field of an encoded frame's header (a peer that
 * negotiated an older version gets frames stamped with it). */
void kv_frame_set_version(uint8_t *frame, uint16_t version);
/* code must be negative; msg may be NULL; it is cut to KV_PROTO_MAX_TEXT
 * bytes and control characters become '?'. */
int kv_msg_error_encode(uint8_t *buf, size_t cap, uint32_t request_id, int32_t code,
                        const char *msg, size_t *n, kv_diag *d);
/* type: KV_MSG_PING or KV_MSG_PONG. */
int kv_msg_ping_encode(uint8_t *buf, size_t cap, uint16_t type, uint32_t request_id,
                       uint64_t nonce, size_t *n, kv_diag *d);
int kv_msg_stats_encode(uint8_t *buf, size_t cap, uint32_t request_id, size_t *n, kv_diag *d);
/* v6 CANCEL (type KV_MSG_CANCEL) or CANCELLED (KV_MSG_CANCELLED): an empty
 * payload; request_id names the request called off. Stamped
 * KV_PROTO_VERSION; never send one on a connection of an older version. */
int kv_msg_cancel_encode(uint8_t *buf, size_t cap, uint16_t type, uint32_t request_id, size_t *n, kv_diag *d);
/* STATS_ACK in KV_PROTO_VERSION's layout; _v: in version's (1: six
 * counters, 2 to 5: nine, 6: ten), header stamped with it. */
int kv_msg_stats_ack_encode(uint8_t *buf, size_t cap, uint32_t request_id, const kv_msg_stats *m,
                            size_t *n, kv_diag *d);
int kv_msg_stats_ack_encode_v(uint8_t *buf, size_t cap, uint32_t request_id, uint16_t version,
                              const kv_msg_stats *m, size_t *n, kv_diag *d);

/* v3 authentication frames (header stamped version 3). AUTH checks its
 * flags (unknown bits, or voucher fields set without the flag: KV_EINVAL). */
int kv_msg_auth_challenge_encode(uint8_t *buf, size_t cap, uint32_t request_id,
                                 const kv_msg_auth_challenge *m, size_t *n, kv_diag *d);
int kv_msg_auth_encode(uint8_t *buf, size_t cap, uint32_t request_id, const kv_msg_auth *m, size_t *n,
                       kv_diag *d);
int kv_msg_auth_ok_encode(uint8_t *buf, size_t cap, uint32_t request_id, const uint8_t sig[64], size_t *n,
                          kv_diag *d);

/* ---- authentication (src/dispatch/auth.c) ----------------------------------- */

/* The transcript both ends sign on one connection: SHA-256 over
 * "kvasir-dispatch-auth-v3\n", the role ('C' coordinator, 'W' worker), the
 * model id (64 hex), the version (u16 LE), the worker's key, its challenge,
 * the coordinator's key and its nonce. The challenge makes every
 * connection's transcript different (an AUTH cannot be replayed on another
 * connection); the worker key binds the coordinator's proof to the worker
 * it meant (a worker cannot relay it to another); the role keeps the two
 * signatures apart. Pure. The link's handshake transcript
 * (kv_link_transcript, kvasir/link.h) with proto KV_LINK_HS_DISPATCH. */
void kv_dispatch_digest(char role, const char model_id[KV_PROTO_MODEL_ID_LEN], uint16_t version,
                    const uint8_t worker_key[32], const uint8_t challenge[32], const uint8_t coord_key[32],
                    const uint8_t coord_nonce[32], uint8_t out[32]);
/* Keys, hex, signatures, hub vouchers and key lists (kv_voucher,
 * kv_link_sign, kv_link_verify, kv_voucher_digest, kv_key_from_hex,
 * kv_key_list_add): kvasir/link.h. */
#define KV_PROTO_MAX_KEYS KV_LINK_MAX_KEYS

/* ---- decoder ------------------------------------------------------------ */

/* Decodes one complete frame frame[n] (n must equal 16 + header len) into
 * out: header checks as above, then the payload of its type, every field
 * bounded and the length equal to the exact size implied by the counts.
 * lim (may be NULL) adds the receiver's dims: COMPUTE layer < n_layer,
 * n_embd == n_embd, expert < n_expert; RESULT n_embd == n_embd. Views in out
 * point into frame. Returns 0, or KV_EPROTO / KV_ERANGE / KV_EUNSUPPORTED
 * with d naming the field; out is then unspecified. Pure and thread-safe. */
int kv_msg_decode(const uint8_t *frame, size_t n, const kv_proto_limits *lim, kv_msg *out,
                  kv_diag *d);

/* ---- accessors of decoded views (bounds are the caller's: i < count) ---- */

/* Held range i of a decoded (or encoder-input) HELLO_ACK. */
kv_held_range kv_msg_hello_ack_range(const kv_msg_hello_ack *m, uint32_t i);
/* Slab i of a decoded (or encoder-input) v2 HELLO_ACK. */
kv_slab_hash kv_msg_hello_ack_slab(const kv_msg_hello_ack *m, uint32_t i);
/* True if the ack's ranges hold expert e of layer l. */
bool kv_msg_hello_ack_holds(const kv_msg_hello_ack *m, uint32_t layer, uint32_t expert);
/* Pair i of a decoded COMPUTE. */
kv_proto_pair kv_msg_compute_pair(const kv_msg_compute *m, uint32_t i);
/* Hidden-state row t as f32 into out[n_embd]. */
void kv_msg_compute_row(const kv_msg_compute *m, uint32_t t, float *out);
/* All rows as f32 into out[n_tokens][n_embd]. */
void kv_msg_compute_x(const kv_msg_compute *m, float *out);
/* The hidden states in place as f32 when that is possible without a copy
 * (enc F32, little-endian host, 4-byte aligned); else NULL. */
const float *kv_msg_compute_x_inplace(const kv_msg_compute *m);
/* Output row p of a decoded RESULT as f32 into out[n_embd]. */
void kv_msg_result_row(const kv_msg_result *m, uint32_t p, float *out);
/* RESULT_PRE: pair p's gate and up pre-activations into gate/up[n_ff]. */
void kv_msg_result_pre_row(const kv_msg_result *m, uint32_t p, float *gate, float *up);
/* All outputs as f32 into out[n_pairs][n_embd]. */
void kv_msg_result_y(const kv_msg_result *m, float *out);

/* ---- stream I/O (blocking or nonblocking sockets) ------------------------ */

/* Incremental reader of one frame from a socket into a caller buffer. */
typedef struct kv_frame_rx {
    uint8_t *buf;      /* caller-owned, cap bytes (>= KV_PROTO_HEADER) */
    size_t cap;        /* frames longer than this are refused (KV_ERANGE) */
    size_t have;       /* bytes of the current frame received */
    size_t need;       /* bytes of the current frame: 16, then 16 + len */
    kv_frame_header h; /* valid once have >= 16 */
} kv_frame_rx;

void kv_frame_rx_init(kv_frame_rx *rx, uint8_t *buf, size_t cap);
/* Makes rx ready for the next frame (after one was consumed). */
void kv_frame_rx_reset(kv_frame_rx *rx);
/* Reads what fd has (one read() call at most per invocation when fd is
 * nonblocking; loops on EINTR). Returns 1 when buf[0, need) holds a whole
 * frame (decode it with kv_msg_decode(rx->buf, rx->need, ...), then reset),
 * 0 when more bytes are needed (EAGAIN), or a negative code: KV_EIO (peer
 * closed: d says "closed" if cleanly between frames, or a read error),
 * KV_EPROTO / KV_ERANGE (bad header; the frame is never buffered). */
int kv_frame_rx_read(kv_frame_rx *rx, int fd, kv_diag *d);

/* Writes all n bytes to the socket fd within timeout_ms in total (< 0: no
 * limit), blocking or not (kv_link_write_full). KV_EIO or KV_ETIMEOUT.
 * Never raises SIGPIPE. */
int kv_proto_write_all(int fd, const void *buf, size_t n, int timeout_ms, kv_diag *d);

/* Reads one whole frame from a blocking or nonblocking fd into rx within
 * timeout_ms (< 0: no limit; kv_link_read_full, so a frame cut by the
 * deadline is kept in rx and completed by the next call), then decodes it into out (views into rx->buf;
 * the caller resets rx afterwards). Returns 0, KV_ETIMEOUT, KV_EIO, or a
 * decode error. An ERROR frame decodes successfully (out->h.type). */
int kv_proto_read_msg(kv_frame_rx *rx, int fd, int timeout_ms, const kv_proto_limits *lim,
                      kv_msg *out, kv_diag *d);
/* The same over a blocking channel (plain TCP, or TLS when c->tls is set):
 * the fd calls above are these with no TLS session. */
int kv_proto_write_all_chan(const kv_link_chan *c, const void *buf, size_t n, int timeout_ms, kv_diag *d);
int kv_proto_read_msg_chan(kv_frame_rx *rx, const kv_link_chan *c, int timeout_ms, const kv_proto_limits *lim,
                           kv_msg *out, kv_diag *d);

#endif
