/* The hub's relay: a relay server on the hub's host with the hub's
 * certificate, and the hub's own coordinator client for probing relayed
 * nodes (hub_relay.h). Probes are rare (one per node per minute or so), so
 * each makes its loopback proxy and frees it after. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hub/hub_relay.h"
#include "kvasir/https.h"
#include "kvasir/link.h"

struct kv_hub_relay {
    kv_tls_ctx *tls;         /* the hub's certificate: the relay serves it */
    kv_tls_ctx *coord_tls;   /* the hub's key as a coordinator inside circuits */
    kv_relay_server *srv;
    kv_relay_client *cl;     /* the hub as a coordinator of its own relay */
    uint16_t port;
    char fp[KV_TLS_FP_HEX + 1];
    bool quiet;
};

static void kv_hub_relay_log(void *data, const char *line) {
    (void)data;
    fprintf(stderr, "hub: relay: %s\n", line);
}

int kv_hub_relay_start(kv_hub_relay **out, const char *host_port, const kv_https_cert *cert, const uint8_t hub_sk[64],
                       const kv_relay_server_opts *budgets, bool quiet, kv_diag *d) {
    *out = NULL;
    kv_hub_relay *r = calloc(1, sizeof *r);
    if (!r) return kv_fail(d, KV_ENOMEM, "relay: out of memory");
    r->quiet = quiet;
    kv_node_key hk;
    kv_node_key_from_seed(&hk, hub_sk);
    int rc = kv_tls_ctx_from_pem(&r->tls, cert->cert_pem, cert->key_pem, d);
    if (!rc) rc = kv_tls_ctx_new(&r->coord_tls, &hk, d);
    if (!rc) {
        kv_tls_ctx_fingerprint(r->tls, r->fp);
        kv_relay_server_opts so = {0};
        if (budgets) so = *budgets;
        so.listen = host_port;
        so.tls = r->tls;
        so.log = quiet ? NULL : kv_hub_relay_log;
        so.log_data = NULL;
        rc = kv_relay_server_start(&r->srv, &so, d);
    }
    char host[256], self[300];
    uint16_t port = 0;
    if (!rc) rc = kv_link_parse_addr(kv_relay_server_addr(r->srv), host, sizeof host, &port, d);
    if (!rc) { /* the hub reaches its own relay on loopback when it listens on every address */
        const bool v6 = strchr(host, ':') != NULL;
        const char *h = !strcmp(host, "0.0.0.0") ? "127.0.0.1" : !strcmp(host, "::") ? "::1" : host;
        snprintf(self, sizeof self, v6 ? "[%s]:%u" : "%s:%u", h, port);
        r->port = port;
        const kv_relay_client_opts co = {.relay = self, .relay_sha256 = r->fp, .tls = r->coord_tls,
                                         .role = KV_RELAY_ROLE_COORD, .log = quiet ? NULL : kv_hub_relay_log};
        rc = kv_relay_client_start(&r->cl, &co, d);
    }
    memset(&hk, 0, sizeof hk);
    if (rc) {
        kv_hub_relay_free(r);
        return kv_diag_prefix(d, rc, "relay on %s", host_port);
    }
    *out = r;
    return 0;
}

uint16_t kv_hub_relay_port(const kv_hub_relay *r) { return r->port; }
const char *kv_hub_relay_fp(const kv_hub_relay *r) { return r->fp; }

int kv_hub_relay_proxy(kv_hub_relay *r, const uint8_t pk[32], int timeout_ms, kv_relay_proxy **out, kv_diag *d) {
    return kv_relay_proxy_start(out, r->cl, r->coord_tls, pk, timeout_ms, d);
}

void kv_hub_relay_stats(const kv_hub_relay *r, kv_relay_stats *out) { kv_relay_server_stats(r->srv, out); }

void kv_hub_relay_free(kv_hub_relay *r) {
    if (!r) return;
    kv_relay_client_free(r->cl);
    kv_relay_server_free(r->srv);
    kv_tls_ctx_free(r->coord_tls);
    kv_tls_ctx_free(r->tls);
    free(r);
}
