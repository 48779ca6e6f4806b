/* libcurl's side of HTTPS (include/kvasir/https.h): one call that gives a
 * handle its URL, taking a "#sha256=" pin out of it, and one that turns a
 * failed transfer into an error that says what to do. */
#ifndef KVASIR_HTTPS_CURL_H
#define KVASIR_HTTPS_CURL_H

#include <curl/curl.h>

#include "kvasir/https.h"

/* Sets CURLOPT_URL to url without its pin (written into buf[cap], which
 * must outlive the transfer) and the allowed protocols (http, https). A
 * pinned URL (kv_https_url_split) also gets CURLOPT_PINNEDPUBLICKEY, TLS
 * 1.3 at least, and no authority check (the pin is the check: a server
 * whose key differs fails the handshake, before any request byte is sent);
 * an https URL without a pin is checked against the system's authorities.
 * KV_EINVAL for a malformed pin. */
int kv_https_curl_url(CURL *c, const char *url, char *buf, size_t cap, kv_diag *d);

/* kv_fail for a transfer to url that ended with r: KV_ETIMEOUT for a
 * timeout, KV_EAUTH for a certificate or pin that does not match, KV_EIO
 * otherwise; the message names url and, where it helps, the remedy. */
int kv_https_curl_fail(CURLcode r, const char *url, kv_diag *d);

#endif
