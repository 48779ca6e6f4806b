/* The HTTP client side of the hub (libcurl): bounded GETs for `kvasir
 * market` and for nodes, and the coordinators' demand report. A body larger
 * than the caller's bound aborts the transfer instead of growing without
 * limit. */
#include <curl/curl.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "http/https_curl.h"
#include "hub/curl_body.h"
#include "kvasir/hub.h"
#include "kvasir/node.h"

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

int kv_hub_report_demand(const char *hub_url, kv_node_key *key, const kv_hub_demand *r, uint64_t *accepted_tokens,
                         kv_diag *d) {
    if (accepted_tokens) *accepted_tokens = 0;
    char *body = kv_hub_demand_json(r), *reply = NULL;
    if (!body) return kv_fail(d, KV_ENOMEM, "demand: out of memory");
    long st = 0;
    int rc = kv_node_hub_post(hub_url, key, "/v1/demand", body, &reply, &st, d);
    free(body);
    if (rc) return rc;
    json_t *j = json_loads(reply, 0, NULL);
    const char *err = json_string_value(json_object_get(j, "error"));
    if (st != 200) {
        rc = kv_fail(d, st == 403 ? KV_EAUTH : st == 409 ? KV_EPROTO : st == 400 ? KV_EINVAL : KV_EIO,
                     "demand report: hub answered %ld: %.300s", st, err ? err : "(no reason given)");
    } else {
        json_t *t = json_object_get(j, "tokens");
        if (!json_is_integer(t) || json_integer_value(t) < 0)
            rc = kv_fail(d, KV_EIO, "demand report: the hub's answer has no 'tokens'");
        else if (accepted_tokens)
            *accepted_tokens = (uint64_t)json_integer_value(t);
    }
    json_decref(j);
    free(reply);
    return rc;
}
