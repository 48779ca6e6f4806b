/* The gateway's web chat page (GET / and GET /index.html): one
 * self-contained HTML file, src/gateway/chat.html, compiled in by
 * tools/embed.cmake as kv_chat_page_data. It is served whole from that
 * constant (nothing of the request reaches it), with a Content-Security-
 * Policy that lets the page run only its own inline <style> and <script>,
 * named by their SHA-256 (computed here from the embedded bytes, once), and
 * connect only to the gateway itself; no other origin, no framing, no
 * forms, no images. The page puts text from the network into the DOM as
 * text, so a model's output that looks like markup stays text; the policy
 * is the second wall behind that. `--no-web-ui` turns the route off
 * (routes.c answers 404 then). */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include <sodium.h>

#include "gateway/server_internal.h"

extern const unsigned char kv_chat_page_data[];
extern const size_t kv_chat_page_len;

#define KV_CSP_MAX 640

static char kv_csp[KV_CSP_MAX];
static pthread_once_t kv_csp_once = PTHREAD_ONCE_INIT;

/* 'sha256-BASE64' of the text between the page's one OPEN tag and the next
 * CLOSE tag, as CSP hashes an inline element's content. The page is ours:
 * the tags' absence is a build defect, asserted. */
static void kv_csp_hash(const char *open, const char *close, char out[64]) {
    const char *p = (const char *)kv_chat_page_data, *end = p + kv_chat_page_len;
    const char *a = memmem(p, kv_chat_page_len, open, strlen(open));
    KV_ASSERT(a);
    a += strlen(open);
    const char *b = memmem(a, (size_t)(end - a), close, strlen(close));
    KV_ASSERT(b);
    KV_ASSERT(!memmem(b + 1, (size_t)(end - b - 1), open, strlen(open))); /* one element: one hash */
    unsigned char h[crypto_hash_sha256_BYTES];
    crypto_hash_sha256(h, (const unsigned char *)a, (unsigned long long)(b - a));
    char b64[sodium_base64_ENCODED_LEN(crypto_hash_sha256_BYTES, sodium_base64_VARIANT_ORIGINAL)];
    sodium_bin2base64(b64, sizeof b64, h, sizeof h, sodium_base64_VARIANT_ORIGINAL);
    snprintf(out, 64, "'sha256-%s'", b64);
}

static void kv_csp_build(void) {
    char script[64], style[64];
    kv_csp_hash("<script>", "</script>", script);
    kv_csp_hash("<style>", "</style>", style);
    const int n = snprintf(kv_csp, sizeof kv_csp,
                           "default-src 'none'; script-src %s; style-src %s; connect-src 'self'; img-src 'none'; "
                           "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
                           script, style);
    KV_ASSERT(n > 0 && n < KV_CSP_MAX);
}

const char *kv_gw_webui_csp(void) {
    pthread_once(&kv_csp_once, kv_csp_build);
    return kv_csp;
}

struct MHD_Response *kv_gw_webui_response(void) {
    const char *csp = kv_gw_webui_csp();
    struct MHD_Response *r = MHD_create_response_from_buffer(kv_chat_page_len, (void *)kv_chat_page_data,
                                                             MHD_RESPMEM_PERSISTENT);
    if (!r) return NULL;
    MHD_add_response_header(r, "Content-Type", "text/html; charset=utf-8");
    MHD_add_response_header(r, "Content-Security-Policy", csp);
    MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
    MHD_add_response_header(r, "Referrer-Policy", "no-referrer");
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    return r;
}
