/* Unicode helpers for the tokenizer: character classes (from the generated
 * run table), UTF-8 decoding with llama.cpp's exact handling of invalid
 * input, and the GPT-2 byte-level map between bytes and printable code
 * points. Hot path: kv_uc_class (ASCII answered from a small table, the rest
 * by binary search over ~1900 runs). */
#include "tok/tok_internal.h"

#include <pthread.h>

/* ASCII classes, filled once from the run table. */
static uint8_t kv_uc_ascii[128];
/* byte -> code point and code point (< 0x144) -> byte + 1 (0: none). */
static uint32_t kv_b2cp[256];
static uint16_t kv_cp2b[0x144];
static pthread_once_t kv_uc_once = PTHREAD_ONCE_INIT;

static int kv_uc_class_search(uint32_t cp) {
    size_t lo = 0, hi = kv_uc_n_runs; /* find last run with start <= cp */
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if ((kv_uc_runs[mid] >> 3) <= cp)
            lo = mid;
        else
            hi = mid;
    }
    return (int)(kv_uc_runs[lo] & 7u);
}

static void kv_uc_init(void) {
    for (uint32_t c = 0; c < 128; c++) kv_uc_ascii[c] = (uint8_t)kv_uc_class_search(c);
    /* GPT-2's bytes_to_unicode: '!'..'~', U+00A1..U+00AC and U+00AE..U+00FF
     * stand for themselves; the remaining 68 bytes, in increasing order, take
     * U+0100, U+0101, ... so that every byte has a visible character. */
    uint32_t next = 256;
    for (int b = 0; b < 256; b++) {
        bool self = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        kv_b2cp[b] = self ? (uint32_t)b : next++;
        kv_cp2b[kv_b2cp[b]] = (uint16_t)(b + 1);
    }
}

int kv_uc_class(uint32_t cp) {
    pthread_once(&kv_uc_once, kv_uc_init);
    if (cp < 128) return kv_uc_ascii[cp];
    if (cp >= 0x110000) return KV_UC_OTHER;
    return kv_uc_class_search(cp);
}

size_t kv_utf8_decode(const uint8_t *s, size_t len, uint32_t *cps) {
    size_t i = 0, n = 0;
    while (i < len) {
        uint8_t b = s[i];
        size_t need;
        uint32_t cp;
        if (b < 0x80) {
            cps[n++] = b;
            i++;
            continue;
        } else if ((b & 0xE0) == 0xC0) {
            need = 2;
            cp = b & 0x1Fu;
        } else if ((b & 0xF0) == 0xE0) {
            need = 3;
            cp = b & 0x0Fu;
        } else if ((b & 0xF8) == 0xF0) {
            need = 4;
            cp = b & 0x07u;
        } else {
            need = 0; /* continuation byte or 0xF8..0xFF as a lead */
            cp = 0;
        }
        bool ok = need != 0 && len - i >= need;
        for (size_t k = 1; ok && k < need; k++) {
            if ((s[i + k] & 0xC0) != 0x80)
                ok = false;
            else
                cp = (cp << 6) | (s[i + k] & 0x3Fu);
        }
        if (ok && cp > 0x10FFFF) ok = false;
        if (ok) {
            cps[n++] = cp;
            i += need;
        } else {
            cps[n++] = 0xFFFD;
            i++;
        }
    }
    return n;
}

int kv_utf8_encode(uint32_t cp, uint8_t *out) {
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | (cp >> 6));
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (cp >> 12));
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | ((cp >> 18) & 0x07));
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

uint32_t kv_byte_to_cp(uint8_t b) {
    pthread_once(&kv_uc_once, kv_uc_init);
    return kv_b2cp[b];
}

int kv_cp_to_byte(uint32_t cp) {
    pthread_once(&kv_uc_once, kv_uc_init);
    if (cp >= 0x144 || kv_cp2b[cp] == 0) return -1;
    return kv_cp2b[cp] - 1;
}

int kv_byte_to_utf8(uint8_t b, char *out) {
    uint8_t tmp[4];
    int n = kv_utf8_encode(kv_byte_to_cp(b), tmp);
    for (int i = 0; i < n; i++) out[i] = (char)tmp[i];
    return n;
}
