/* Authenticated dispatch (protocol v3): the transcript both ends sign, and
 * key lists. Keys, signatures and hub vouchers are the link's
 * (kvasir/link.h).
 *
 * A connection is authenticated once per handshake, never per frame: the
 * worker sends its key and a fresh 32-byte challenge, the coordinator signs
 * the transcript (model, version, both keys, the challenge and its own
 * nonce) with role 'C', the worker signs the same transcript with role 'W'
 * (kv_link_sign over the digest). Everything here is pure apart from
 * kv_key_list_add, which reads a bounded file. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/dispatch.h"
#include "kvasir/slice.h"

#define KV_DISPATCH_AUTH_DOMAIN "kvasir-dispatch-auth-v3\n"
#define KV_KEY_LIST_MAX_FILE (8u << 20) /* bytes of a key list file */

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

static int kv_keys_push(uint8_t (**keys)[32], size_t *n, const uint8_t k[32], kv_diag *d) {
    if (*n >= KV_PROTO_MAX_KEYS) return kv_fail(d, KV_ERANGE, "more than %u allowed keys", KV_PROTO_MAX_KEYS);
    uint8_t(*nk)[32] = realloc(*keys, (*n + 1) * sizeof **keys);
    if (!nk) return kv_fail(d, KV_ENOMEM, "allowed keys: out of memory");
    memcpy(nk[*n], k, 32);
    *keys = nk;
    (*n)++;
    return 0;
}

int kv_key_list_add(const char *value, uint8_t (**keys)[32], size_t *n, kv_diag *d) {
    uint8_t k[32];
    if (value && strnlen(value, 65) == 64 && kv_key_from_hex(value, k, NULL) == 0) return kv_keys_push(keys, n, k, d);
    FILE *f = value ? fopen(value, "rb") : NULL;
    if (!f)
        return kv_fail(d, value && errno == ENOENT ? KV_EINVAL : KV_EIO,
                       "'%.200s' is neither a key (64 lowercase hex digits) nor a readable key file", value ? value : "");
    char line[256];
    size_t lineno = 0, total = 0;
    int rc = 0;
    while (!rc && fgets(line, sizeof line, f)) {
        lineno++;
        size_t len = strlen(line);
        total += len;
        if (total > KV_KEY_LIST_MAX_FILE) {
            rc = kv_fail(d, KV_ERANGE, "%.200s: key file over %u bytes", value, KV_KEY_LIST_MAX_FILE);
            break;
        }
        if (len && line[len - 1] != '\n' && !feof(f)) {
            rc = kv_fail(d, KV_EINVAL, "%.200s:%zu: line too long", value, lineno);
            break;
        }
        while (len && (line[len - 1] == '\n' || line[len - 1] == '\r' || line[len - 1] == ' ')) line[--len] = 0;
        const char *p = line;
        while (*p == ' ' || *p == '\t') p++;
        if (!*p || *p == '#') continue;
        if (kv_key_from_hex(p, k, NULL)) {
            rc = kv_fail(d, KV_EINVAL, "%.200s:%zu: not a key (64 lowercase hex digits)", value, lineno);
            break;
        }
        rc = kv_keys_push(keys, n, k, d);
    }
    fclose(f);
    return rc;
}
