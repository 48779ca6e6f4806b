/* SHA-256 for manifests and model identity, through OpenSSL's libcrypto
 * (which uses the CPU's SHA extensions when present: slicing hashes every
 * byte it copies, so the hash must keep up with the disk). */
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <stdio.h>

#include "kvasir/link.h" /* kv_hex */
#include "kvasir/slice.h"

void kv_sha256_init(kv_sha256 *s) {
    EVP_MD_CTX *c = EVP_MD_CTX_new();
    KV_ASSERT(c != NULL);
    KV_ASSERT(EVP_DigestInit_ex(c, EVP_sha256(), NULL) == 1);
    s->ctx = c;
}

void kv_sha256_update(kv_sha256 *s, const void *data, size_t n) {
    if (n) KV_ASSERT(EVP_DigestUpdate((EVP_MD_CTX *)s->ctx, data, n) == 1);
}

void kv_sha256_final(kv_sha256 *s, uint8_t out[32]) {
    unsigned int len = 0;
    KV_ASSERT(EVP_DigestFinal_ex((EVP_MD_CTX *)s->ctx, out, &len) == 1 && len == 32);
    kv_sha256_discard(s);
}

void kv_sha256_discard(kv_sha256 *s) {
    EVP_MD_CTX_free((EVP_MD_CTX *)s->ctx);
    s->ctx = NULL;
}

const char *kv_sha256_backend(void) { return OpenSSL_version(OPENSSL_VERSION); }

void kv_sha256_hex(const uint8_t h[32], char out[65]) { kv_hex(h, 32, out); }
