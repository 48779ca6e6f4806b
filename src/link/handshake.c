/* The key handshake's transcript, written once for every protocol that
 * authenticates a connection (include/kvasir/link.h, kv_link_transcript).
 *
 * Each protocol is one row of a table: its domain line, the role byte of
 * each side, and whether the negotiated version is hashed. The bytes hashed
 * are exactly those docs/PROTOCOL.md gives for the dispatch and ring
 * transcripts; a channel binding, when given, is hashed last, and without
 * one the digest is the one those protocols have always signed. */
#include <string.h>

#include "kvasir/link.h"
#include "kvasir/slice.h" /* kv_sha256 */

typedef struct kv_hs_row {
    const char *domain; /* NUL-terminated; hashed without the NUL */
    char role[2];       /* [KV_LINK_CONNECTOR], [KV_LINK_ACCEPTOR] */
    bool version;       /* the u16 LE version follows the model id */
} kv_hs_row;

static const kv_hs_row kv_hs_rows[KV_LINK_HS_COUNT] = {
    [KV_LINK_HS_DISPATCH] = {"kvasir-dispatch-auth-v3\n", {'C', 'W'}, true},
    [KV_LINK_HS_RING] = {"kvasir-ring-auth-v1\n", {'C', 'A'}, false},
};

void kv_link_transcript_digest(const kv_link_transcript *t, int role, uint8_t out[32]) {
    KV_ASSERT(t && t->proto < KV_LINK_HS_COUNT && (role == KV_LINK_CONNECTOR || role == KV_LINK_ACCEPTOR));
    KV_ASSERT(t->model_id && t->acceptor_key && t->challenge && t->connector_key && t->nonce);
    const kv_hs_row *row = &kv_hs_rows[t->proto];
    const uint8_t r = (uint8_t)row->role[role];
    const uint8_t v[2] = {(uint8_t)(t->version & 0xff), (uint8_t)(t->version >> 8)};
    kv_sha256 s;
    kv_sha256_init(&s);
    kv_sha256_update(&s, row->domain, strlen(row->domain));
    kv_sha256_update(&s, &r, 1);
    kv_sha256_update(&s, t->model_id, KV_LINK_MODEL_ID_LEN);
    if (row->version) kv_sha256_update(&s, v, 2);
    kv_sha256_update(&s, t->acceptor_key, 32);
    kv_sha256_update(&s, t->challenge, 32);
    kv_sha256_update(&s, t->connector_key, 32);
    kv_sha256_update(&s, t->nonce, 32);
    if (t->binding) kv_sha256_update(&s, t->binding, 32);
    kv_sha256_final(&s, out);
}

void kv_link_transcript_sign(const kv_link_transcript *t, int role, const uint8_t sk[64], uint8_t sig[64]) {
    uint8_t dg[32];
    kv_link_transcript_digest(t, role, dg);
    kv_link_sign(sk, dg, sig);
}

int kv_link_transcript_verify(const kv_link_transcript *t, int role, const uint8_t pk[32], const uint8_t sig[64]) {
    uint8_t dg[32];
    kv_link_transcript_digest(t, role, dg);
    return kv_link_verify(pk, dg, sig);
}
