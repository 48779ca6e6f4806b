/* Authenticated dispatch (protocol v3): the transcript both ends sign. Keys,
 * key lists, signatures and hub vouchers are the link's (kvasir/link.h).
 *
 * A connection is authenticated once per handshake, never per frame: the
 * worker sends its key and a fresh 32-byte challenge, the coordinator signs
 * the transcript (model, version, both keys, the challenge and its own
 * nonce) with role 'C', the worker signs the same transcript with role 'W'
 * (kv_link_sign over the digest). Pure. */
#include <string.h>

#include "kvasir/dispatch_proto.h"
#include "kvasir/slice.h"

#define KV_DISPATCH_AUTH_DOMAIN "kvasir-dispatch-auth-v3\n"

void kv_dispatch_digest(char role, const char model_id[KV_PROTO_MODEL_ID_LEN], uint16_t version,
                    const uint8_t worker_key[32], const uint8_t challenge[32], const uint8_t coord_key[32],
                    const uint8_t coord_nonce[32], uint8_t out[32]) {
    const uint8_t r = (uint8_t)role, v[2] = {(uint8_t)(version & 0xff), (uint8_t)(version >> 8)};
    kv_sha256 s;
    kv_sha256_init(&s);
    kv_sha256_update(&s, KV_DISPATCH_AUTH_DOMAIN, sizeof KV_DISPATCH_AUTH_DOMAIN - 1);
    kv_sha256_update(&s, &r, 1);
    kv_sha256_update(&s, model_id, KV_PROTO_MODEL_ID_LEN);
    kv_sha256_update(&s, v, 2);
    kv_sha256_update(&s, worker_key, 32);
    kv_sha256_update(&s, challenge, 32);
    kv_sha256_update(&s, coord_key, 32);
    kv_sha256_update(&s, coord_nonce, 32);
    kv_sha256_final(&s, out);
}
