/* A coordinator's routes to relayed nodes (include/kvasir/relay.h,
 * "routes"): one coordinator client per relay, one loopback proxy per
 * relayed node, kept for the life of the process (a coordinator that reads
 * the placement map again finds the same proxy, so a worker's address
 * resolves once). Bounded by KV_RELAY_MAX_RELAYS and KV_RELAY_MAX_ROUTES. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/relay.h"

typedef struct kv_route_relay {
    char addr[256];
    char fp[KV_TLS_FP_HEX + 1];
    kv_tls_ctx *tls;      /* a key of our own inside circuits */
    kv_relay_client *cl;
} kv_route_relay;

typedef struct kv_route {
    char node_addr[256];
    uint8_t pk[32];
    kv_route_relay *relay;
    kv_relay_proxy *px;
} kv_route;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static kv_route_relay g_relays[KV_RELAY_MAX_RELAYS];
static uint32_t g_n_relays;
static kv_route *g_routes; /* [g_n_routes] */
static uint32_t g_n_routes, g_cap_routes;

/* The client of relay addr (pinned by fp), started if new. Caller holds g_mu. */
static int kv_route_relay_get(const char *addr, const char *fp, kv_route_relay **out, kv_diag *d) {
    for (uint32_t i = 0; i < g_n_relays; i++)
        if (!strcmp(g_relays[i].addr, addr) && !strcmp(g_relays[i].fp, fp)) {
            *out = &g_relays[i];
            return 0;
        }
    if (g_n_relays == KV_RELAY_MAX_RELAYS)
        return kv_fail(d, KV_ERANGE, "relay routes: more than %u relays", KV_RELAY_MAX_RELAYS);
    if (strlen(addr) >= sizeof g_relays[0].addr || strlen(fp) != KV_TLS_FP_HEX)
        return kv_fail(d, KV_EINVAL, "relay routes: bad relay '%.80s'", addr);
    kv_route_relay *r = &g_relays[g_n_relays];
    memset(r, 0, sizeof *r);
    snprintf(r->addr, sizeof r->addr, "%s", addr);
    memcpy(r->fp, fp, sizeof r->fp);
    uint8_t seed[32];
    kv_node_key k;
    FILE *f = fopen("/dev/urandom", "rb");
    const bool ok = f && fread(seed, 1, 32, f) == 32;
    if (f) fclose(f);
    if (!ok) return kv_fail(d, KV_EIO, "relay routes: cannot read /dev/urandom");
    kv_node_key_from_seed(&k, seed);
    memset(seed, 0, sizeof seed);
    int rc = kv_tls_ctx_new(&r->tls, &k, d);
    memset(&k, 0, sizeof k);
    const kv_relay_client_opts o = {.relay = r->addr, .relay_sha256 = r->fp, .tls = r->tls,
                                    .role = KV_RELAY_ROLE_COORD};
    if (!rc) rc = kv_relay_client_start(&r->cl, &o, d);
    if (rc) {
        kv_tls_ctx_free(r->tls);
        memset(r, 0, sizeof *r);
        return rc;
    }
    g_n_relays++;
    *out = r;
    return 0;
}

int kv_relay_route_add(const char *relay_addr, const char *fp, const uint8_t node_pk[32], const char *node_addr,
                       kv_diag *d) {
    if (!relay_addr || !fp || !node_pk || !node_addr || strlen(node_addr) >= sizeof g_routes[0].node_addr)
        return kv_fail(d, KV_EINVAL, "relay routes: bad arguments");
    pthread_mutex_lock(&g_mu);
    kv_route *rt = NULL;
    for (uint32_t i = 0; i < g_n_routes && !rt; i++)
        if (!strcmp(g_routes[i].node_addr, node_addr)) rt = &g_routes[i];
    int rc = 0;
    kv_route_relay *rl = NULL;
    if (rt && !memcmp(rt->pk, node_pk, 32) && !strcmp(rt->relay->addr, relay_addr) && !strcmp(rt->relay->fp, fp))
        goto out; /* known */
    if (rt) { /* its proxy may carry live connections: never swapped under them */
        rc = kv_fail(d, KV_EINVAL, "relay routes: %.80s is already routed to another node key or relay", node_addr);
        goto out;
    }
    if (g_n_routes == KV_RELAY_MAX_ROUTES) {
        rc = kv_fail(d, KV_ERANGE, "relay routes: more than %u relayed nodes", KV_RELAY_MAX_ROUTES);
        goto out;
    }
    if ((rc = kv_route_relay_get(relay_addr, fp, &rl, d))) goto out;
    kv_relay_proxy *px = NULL;
    if ((rc = kv_relay_proxy_start(&px, rl->cl, rl->tls, node_pk, 0, d))) goto out;
    {
        if (g_n_routes == g_cap_routes) {
            const uint32_t nc = g_cap_routes ? 2 * g_cap_routes : 16;
            kv_route *nr = realloc(g_routes, nc * sizeof *nr);
            if (!nr) {
                kv_relay_proxy_free(px);
                rc = kv_fail(d, KV_ENOMEM, "relay routes: out of memory");
                goto out;
            }
            g_routes = nr;
            g_cap_routes = nc;
        }
        rt = &g_routes[g_n_routes++];
        snprintf(rt->node_addr, sizeof rt->node_addr, "%s", node_addr);
    }
    memcpy(rt->pk, node_pk, 32);
    rt->relay = rl;
    rt->px = px;
out:
    pthread_mutex_unlock(&g_mu);
    return rc;
}

bool kv_relay_route_find(const char *node_addr, char *out, size_t cap) {
    bool found = false;
    pthread_mutex_lock(&g_mu);
    for (uint32_t i = 0; i < g_n_routes && !found; i++)
        if (!strcmp(g_routes[i].node_addr, node_addr)) {
            found = (size_t)snprintf(out, cap, "%s", kv_relay_proxy_addr(g_routes[i].px)) < cap;
        }
    pthread_mutex_unlock(&g_mu);
    return found;
}

void kv_relay_routes_free(void) {
    pthread_mutex_lock(&g_mu);
    for (uint32_t i = 0; i < g_n_routes; i++) kv_relay_proxy_free(g_routes[i].px);
    for (uint32_t i = 0; i < g_n_relays; i++) {
        kv_relay_client_free(g_relays[i].cl);
        kv_tls_ctx_free(g_relays[i].tls);
    }
    free(g_routes);
    g_routes = NULL;
    g_n_routes = g_cap_routes = g_n_relays = 0;
    pthread_mutex_unlock(&g_mu);
}
