/* libFuzzer target for the hub's header parsers: the Range header and the
 * three signature headers (X-Kvasir-Key, -Counter, -Signature).
 *
 * The input is split at NUL bytes into up to four strings (a NUL-terminated
 * copy each, as libmicrohttpd hands headers over), and its first 8 bytes
 * give a file size. A parsed range must lie inside the file and be non-
 * empty; a parsed counter must print back to the same digits; a parsed key
 * and signature must print back as the same hex. Failures must leave the
 * outputs zero and a message. */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/hub.h"
#include "fuzz_support.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint64_t fsize = 0;
    for (size_t i = 0; i < 8 && i < size; i++) fsize |= (uint64_t)data[i] << (8 * i);
    fsize &= (1ull << 50) - 1;
    if (size > 8 && (data[8] & 1)) fsize &= 0xffff; /* small files too */
    char *parts[4] = {0};
    size_t at = size > 9 ? 9 : size;
    for (int k = 0; k < 4; k++) {
        const uint8_t *e = at < size ? memchr(data + at, 0, size - at) : NULL;
        size_t l = at < size ? (e ? (size_t)(e - (data + at)) : size - at) : 0;
        parts[k] = malloc(l + 1);
        CHECK(parts[k]);
        memcpy(parts[k], data + at, l);
        parts[k][l] = 0;
        at += l + (e ? 1 : 0);
    }
    kv_diag d = {0};
    uint64_t off = 1, len = 1;
    int rc = kv_hub_parse_range(parts[0], fsize, &off, &len, &d);
    if (!rc) {
        CHECK(len > 0 && off < fsize && len <= fsize - off);
    } else {
        CHECK((rc == KV_EFORMAT || rc == KV_ERANGE) && off == 0 && len == 0 && d.msg[0]);
    }
    uint8_t pk[32], sg[64];
    uint64_t ctr = 0;
    memset(&d, 0, sizeof d);
    rc = kv_hub_parse_auth(parts[1], parts[2], parts[3], pk, &ctr, sg, &d);
    if (!rc) {
        char hex[129], dec[24];
        kv_hex(pk, 32, hex);
        CHECK(!strcmp(hex, parts[1]));
        kv_hex(sg, 64, hex);
        CHECK(!strcmp(hex, parts[3]));
        snprintf(dec, sizeof dec, "%" PRIu64, ctr);
        CHECK(!strcmp(dec, parts[2]) && ctr > 0);
    } else {
        CHECK(rc == KV_EPROTO && d.msg[0]);
    }
    for (int k = 0; k < 4; k++) free(parts[k]);
    return 0;
}
