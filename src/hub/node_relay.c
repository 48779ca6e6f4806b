/* Nodes and coordinators meet the hub's relay (docs/HUB.md "Relay"): where
 * it is (the hub's host, as the URL names it, and the port the hub
 * advertises), and, for a coordinator, the routes to the relayed nodes a
 * placement map lists (kvasir/relay.h, "routes").
 *
 * The relay's fingerprint comes from the hub's own answers; when the hub
 * URL pins one (`#sha256=`), the relay must be that same certificate (the
 * hub serves one certificate on both ports), so a hub reached over a pinned
 * URL cannot point anyone at another relay. */
#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "kvasir/node.h"
#include "kvasir/relay.h"

int kv_node_relay_addr(const char *hub_url, uint16_t port, const char *fp, char *out, size_t cap, kv_diag *d) {
    const char *p = strstr(hub_url, "://");
    if (!p || !port || !fp || strlen(fp) != KV_TLS_FP_HEX)
        return kv_fail(d, KV_EINVAL, "relay: the hub '%.100s' gives no usable relay", hub_url);
    p += 3;
    const size_t hl = strcspn(p, "/#?");
    char hp[300], host[256];
    uint16_t hport = 0;
    if (hl >= sizeof hp) return kv_fail(d, KV_EINVAL, "relay: the hub URL's host is too long");
    memcpy(hp, p, hl);
    hp[hl] = 0;
    if (kv_link_parse_addr(hp, host, sizeof host, &hport, d))
        return kv_diag_prefix(d, KV_EINVAL, "relay: the hub URL '%.100s'", hub_url);
    const char *pin = strstr(hub_url, "#sha256=");
    if (pin) {
        pin += 8;
        for (size_t i = 0; i < KV_TLS_FP_HEX; i++)
            if (!pin[i] || tolower((unsigned char)pin[i]) != fp[i])
                return kv_fail(d, KV_EAUTH, "relay: the hub advertises a relay certificate %.16s... that is not the "
                                            "one its URL pins", fp);
    }
    const int n = snprintf(out, cap, strchr(host, ':') ? "[%s]:%u" : "%s:%u", host, port);
    if (n < 0 || (size_t)n >= cap) return kv_fail(d, KV_EINVAL, "relay: address too long");
    return 0;
}

int kv_node_relay_routes(const char *hub_url, const kv_placement *p, kv_diag *d) {
    static const uint8_t zero[32];
    bool any = false;
    for (uint32_t i = 0; i < p->n_addr && !any; i++) any = p->relayed[i] && memcmp(p->key[i], zero, 32);
    if (!any) return 0;
    char ra[300];
    int rc = kv_node_relay_addr(hub_url, p->relay_port, p->relay_port ? p->relay_sha256 : NULL, ra, sizeof ra, d);
    if (rc) return rc;
    int routed = 0;
    for (uint32_t i = 0; i < p->n_addr; i++) {
        if (!p->relayed[i] || !memcmp(p->key[i], zero, 32)) continue; /* a circuit is opened to a key */
        kv_diag e = {0};
        const int a = kv_relay_route_add(ra, p->relay_sha256, p->key[i], p->addr[i], &e);
        if (!a) routed++;
        else if (!rc) rc = kv_fail(d, a, "%s", e.msg); /* the first; the others are routed still */
    }
    return rc ? rc : routed;
}
