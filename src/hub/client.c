/* The HTTP client side of the hub (libcurl): bounded GETs for `kvasir
 * market` and for nodes. A body larger than the caller's bound aborts the
 * transfer instead of growing without limit. */
#include <curl/curl.h>
#include <stdlib.h>
#include <string.h>

#include "http/https_curl.h"
#include "hub/curl_body.h"
#include "kvasir/hub.h"

size_t kv_curl_body_write(char *data, size_t sz, size_t nm, void *arg) {
    kv_curl_body *b = arg;
    size_t n = sz * nm;
    if (n > b->max - b->n) {
        b->over = 1;
        return 0;
    }
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 4096;
        while (nc < b->n + n + 1) nc *= 2;
        char *np = realloc(b->p, nc);
        if (!np) return 0;
        b->p = np;
        b->cap = nc;
    }
    memcpy(b->p + b->n, data, n);
    b->n += n;
    b->p[b->n] = 0;
    return n;
}

int kv_hub_http_get(const char *url, size_t max, long timeout_ms, char **body, size_t *len, long *status,
                    kv_diag *d) {
    *body = NULL;
    *len = 0;
    *status = 0;
    CURL *c = curl_easy_init();
    if (!c) return kv_fail(d, KV_ENOMEM, "http: curl_easy_init failed");
    kv_curl_body b = {.max = max};
    char ubuf[2048]; /* url without its #sha256= pin */
    int rc = kv_https_curl_url(c, url, ubuf, sizeof ubuf, d);
    if (rc) {
        curl_easy_cleanup(c);
        return rc;
    }
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, kv_curl_body_write);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &b);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, timeout_ms);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    CURLcode r = curl_easy_perform(c);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, status);
    curl_easy_cleanup(c);
    if (r != CURLE_OK) {
        free(b.p);
        if (b.over) return kv_fail(d, KV_EIO, "http: %s: body larger than %zu bytes", ubuf, max);
        return kv_https_curl_fail(r, ubuf, d);
    }
    if (!b.p) {
        b.p = calloc(1, 1);
        if (!b.p) return kv_fail(d, KV_ENOMEM, "http: out of memory");
    }
    *body = b.p;
    *len = b.n;
    return 0;
}
