/* Authenticated dispatch (protocol v3): the transcript both ends sign, by
 * the dispatch codec's names. The transcript itself, keys, key lists,
 * signatures and hub vouchers are the link's (kvasir/link.h).
 *
 * A connection is authenticated once per handshake, never per frame: the
 * worker sends its key and a fresh 32-byte challenge, the coordinator signs
 * the transcript (model, version, both keys, the challenge and its own
 * nonce) with role 'C', the worker signs the same transcript with role 'W'
 * (kv_link_sign over the digest). Pure. */
#include "kvasir/dispatch_proto.h"

void kv_dispatch_digest(char role, const char model_id[KV_PROTO_MODEL_ID_LEN], uint16_t version,
                    const uint8_t worker_key[32], const uint8_t challenge[32], const uint8_t coord_key[32],
                    const uint8_t coord_nonce[32], uint8_t out[32]) {
    KV_ASSERT(role == 'C' || role == 'W');
    const kv_link_transcript t = {.proto = KV_LINK_HS_DISPATCH, .model_id = model_id, .version = version,
                                  .acceptor_key = worker_key, .challenge = challenge, .connector_key = coord_key,
                                  .nonce = coord_nonce};
    kv_link_transcript_digest(&t, role == 'C' ? KV_LINK_CONNECTOR : KV_LINK_ACCEPTOR, out);
}
