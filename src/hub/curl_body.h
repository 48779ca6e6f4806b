/* A bounded body buffer for libcurl answers, shared by the hub's HTTP
 * clients (src/hub/client.c, src/hub/node.c). Private to the hub module. */
#ifndef KVASIR_HUB_CURL_BODY_H
#define KVASIR_HUB_CURL_BODY_H

#include <stddef.h>

/* What a peer sent, NUL-terminated, at most max bytes: a longer answer
 * sets over and makes the write callback fail, so the transfer stops
 * there instead of growing memory. p is malloc'd; the caller frees it. */
typedef struct kv_curl_body {
    char *p;
    size_t n, cap, max;
    int over;
} kv_curl_body;

/* CURLOPT_WRITEFUNCTION for a kv_curl_body given as CURLOPT_WRITEDATA. */
size_t kv_curl_body_write(char *data, size_t sz, size_t nm, void *arg);

#endif
