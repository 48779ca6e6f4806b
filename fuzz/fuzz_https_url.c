/* libFuzzer target for the pinned-URL split (include/kvasir/https.h): a
 * --hub URL comes from the command line or from a LAN beacon (untrusted).
 * On success the URL given to libcurl holds no fragment, and a pin is
 * "sha256//" and the base64 of the 32 bytes the 64 hex digits spell, on an
 * https:// URL; on failure both outputs are empty and a message says why. */
#include <openssl/evp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/https.h"

#define CHECK(x)                    \
    do {                            \
        if (!(x)) __builtin_trap(); \
    } while (0)

static int kvf_unhex(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 4096) return 0;
    char *url = malloc(size + 1), out[1024], pin[KV_HTTPS_PIN_CAP];
    if (!url) return 0;
    memcpy(url, data, size);
    url[size] = 0;
    kv_diag d = {0};
    int rc = kv_https_url_split(url, out, sizeof out, pin, &d);
    if (rc) {
        CHECK(rc < 0 && d.msg[0] && !out[0] && !pin[0]);
    } else if (!pin[0]) {
        CHECK(!strchr(url, '#') && !strcmp(out, url));
    } else {
        CHECK(!strchr(out, '#') && !strncmp(out, "https://", 8) && strlen(pin) == 8 + 44);
        const char *hx = strstr(url, "#sha256=") + 8;
        uint8_t want[32], got[33];
        for (int i = 0; i < 32; i++) want[i] = (uint8_t)(kvf_unhex(hx[2 * i]) << 4 | kvf_unhex(hx[2 * i + 1]));
        CHECK(EVP_DecodeBlock(got, (const unsigned char *)pin + 8, 44) == 33 && !memcmp(got, want, 32));
    }
    free(url);
    return 0;
}
