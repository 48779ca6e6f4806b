/* The HTTPS side of the libcurl clients (https_curl.h). */
#include "http/https_curl.h"

#include <string.h>

int kv_https_curl_url(CURL *c, const char *url, char *buf, size_t cap, kv_diag *d) {
    char pin[KV_HTTPS_PIN_CAP];
    int rc = kv_https_url_split(url, buf, cap, pin, d);
    if (rc) return rc;
    curl_easy_setopt(c, CURLOPT_URL, buf);
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    if (pin[0]) {
        /* the pin replaces the authorities: the key is what is trusted */
        if (curl_easy_setopt(c, CURLOPT_PINNEDPUBLICKEY, pin) != CURLE_OK)
            return kv_fail(d, KV_EUNSUPPORTED, "%s: this libcurl cannot pin a public key", buf);
        curl_easy_setopt(c, CURLOPT_SSL_VERIFYPEER, 0L);
        curl_easy_setopt(c, CURLOPT_SSL_VERIFYHOST, 0L);
        curl_easy_setopt(c, CURLOPT_SSLVERSION, (long)CURL_SSLVERSION_TLSv1_3);
    }
    return 0;
}

int kv_https_curl_fail(CURLcode r, const char *url, kv_diag *d) {
    switch (r) {
    case CURLE_OPERATION_TIMEDOUT:
        return kv_fail(d, KV_ETIMEOUT, "http: %s: %s", url, curl_easy_strerror(r));
    case CURLE_PEER_FAILED_VERIFICATION:
        return kv_fail(d, KV_EAUTH,
                       "http: %s: the server's certificate is not signed by an authority this machine trusts; "
                       "for a hub's own certificate give its fingerprint in the URL, https://HOST:PORT#sha256=<64 "
                       "hex digits> (the hub prints it at start as 'tls sha256:...')",
                       url);
    case CURLE_SSL_PINNEDPUBKEYNOTMATCH:
        return kv_fail(d, KV_EAUTH,
                       "http: %s: the server's key does not match the #sha256= fingerprint of the URL; nothing was "
                       "sent (a different server, or the hub's key changed)",
                       url);
    case CURLE_GOT_NOTHING:
    case CURLE_RECV_ERROR:
    case CURLE_WEIRD_SERVER_REPLY:
        if (!strncmp(url, "http://", 7))
            return kv_fail(d, KV_EIO, "http: %s: %s (does the server speak https? then use https://...#sha256=)",
                           url, curl_easy_strerror(r));
        return kv_fail(d, KV_EIO, "http: %s: %s", url, curl_easy_strerror(r));
    case CURLE_SSL_CONNECT_ERROR:
        return kv_fail(d, KV_EIO, "http: %s: TLS handshake failed (%s; is it a TLS 1.3 https server?)", url,
                       curl_easy_strerror(r));
    default:
        return kv_fail(d, KV_EIO, "http: %s: %s", url, curl_easy_strerror(r));
    }
}
