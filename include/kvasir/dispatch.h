/* Dispatch: the binary protocol between a coordinator and expert workers,
 * the worker server, and the remote expert provider.
 *
 * Wire format (all integers little-endian, docs/PROTOCOL.md is normative):
 *   frame   = header(16) payload(len)
 *   header  = u32 magic "KVD1" | u16 version | u16 type | u32 request_id | u32 len
 * Every length, count and id read from the wire is bounded by the maxima
 * below and checked against the bytes of the frame before use. A malformed,
 * oversized or unknown frame closes that one connection with an ERROR frame
 * (when possible); the worker keeps serving others.
 *
 * Codec functions are pure (no I/O, no allocation beyond what the caller
 * gives them) so the decoder can be fuzzed directly. */
#ifndef KVASIR_DISPATCH_H
#define KVASIR_DISPATCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/moe.h"
#include "kvasir/pool.h"

#define KV_PROTO_MAGIC 0x3144564Bu /* "KVD1" little-endian */
#define KV_PROTO_VERSION 1u
#define KV_PROTO_HEADER 16u
#define KV_PROTO_MAX_PAYLOAD (256u << 20) /* bytes in one frame's payload */
#define KV_PROTO_MAX_TOKENS 4096u        /* tokens in one COMPUTE */
#define KV_PROTO_MAX_PAIRS (1u << 16)    /* (token, expert) pairs in one COMPUTE */
#define KV_PROTO_MAX_RANGES 65536u       /* held ranges listed in a HELLO_ACK */
#define KV_PROTO_MAX_TEXT 1024u          /* bytes of an error message / backend name */

enum kv_msg_type {
    KV_MSG_HELLO = 1,     /* coordinator -> worker: versions, model id */
    KV_MSG_HELLO_ACK = 2, /* worker -> coordinator: model id, dims, held ranges, backend */
    KV_MSG_COMPUTE = 3,   /* coordinator -> worker: layer, hidden states, expert pairs */
    KV_MSG_RESULT = 4,    /* worker -> coordinator: one output vector per pair */
    KV_MSG_ERROR = 5,     /* either way: code + message; the sender closes after it */
    KV_MSG_PING = 6,
    KV_MSG_PONG = 7,
    KV_MSG_TYPE_COUNT
};
_Static_assert(KV_MSG_COMPUTE == 3 && KV_MSG_ERROR == 5, "wire message types never change");

/* Encodings of hidden states / outputs on the wire. */
enum kv_act_enc { KV_ENC_F32 = 0, KV_ENC_F16 = 1, KV_ENC_BF16 = 2, KV_ENC_COUNT };

typedef struct kv_frame_header {
    uint32_t magic, len, request_id;
    uint16_t version, type;
} kv_frame_header;

/* One range of experts a worker holds. */
typedef struct kv_held_range {
    uint32_t layer, first, last; /* inclusive */
} kv_held_range;

#endif
