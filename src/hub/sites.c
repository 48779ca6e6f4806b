/* Sites: which nodes are close to each other, and the site-aware placement
 * (docs/HUB.md "Sites"). The hub computes both; this file is the policy and
 * the GET /v1/sites answer, over a snapshot the server takes under its lock
 * (kv_hub_site_node), so nothing here touches the registry.
 *
 * A node's site is the name it gives (kvasir node --site NAME), or, when it
 * gives none, one the hub derives from what it measured itself, never from
 * what the node claims:
 *   - "auto:hub" when the hub's measured round trip to it is at most
 *     KV_HUB_SITE_NEAR_MS, or it is on the hub's loopback: by the triangle
 *     inequality any two such nodes are within 2 x KV_HUB_SITE_NEAR_MS of
 *     each other;
 *   - else "auto:" and its subnet (IPv4 /24, IPv6 /48): one LAN.
 * Round trips between sites are bounded through the hub: for sites A and B
 * whose nodes the hub measured at a and b (the median of each site), the
 * round trip between them lies in [|a - b|, a + b]; the placement and the
 * plan use the upper bound (exact when the hub sits in one of the sites).
 *
 * The placement: a ring of sites, each assigned a contiguous window of the
 * trunk's layers whose routed experts are all held by proven workers of that
 * site, so a token's hidden state crosses each site boundary once per token.
 * Windows are placed from layer 0: the unused site whose coverage runs
 * furthest from the first unplaced layer takes that run, backtracking when a
 * choice leaves a layer that no unused site holds (a bounded search). When
 * no assignment exists, there is no site placement and coordinators
 * dispatch per layer (the "experts" placement), with the reason named. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hub/hub_internal.h"
#include "hub/prove.h"

void kv_hub_site_name(const char *given, double rtt_ms, const char *host, const char *subnet, char *out,
                      size_t cap) {
    if (given && given[0]) snprintf(out, cap, "%s", given);
    else if ((rtt_ms >= 0 && rtt_ms <= KV_HUB_SITE_NEAR_MS) || kv_hub_addr_loopback(host)) snprintf(out, cap, "auto:hub");
    else snprintf(out, cap, "auto:%s", subnet[0] ? subnet : host);
}

/* Whether site s holds every expert of layer L (a layer without routed
 * experts is held anywhere). */
static bool kv_site_covers(const kv_hub_site_layout *in, uint32_t s, uint32_t L, uint32_t *missing) {
    if (!in->moe[L]) return true;
    const uint8_t *h = in->holds + ((size_t)s * in->n_layer + L) * in->n_expert;
    for (uint32_t e = 0; e < in->n_expert; e++)
        if (!h[e]) {
            if (missing) *missing = e;
            return false;
        }
    return true;
}

/* How far site s's coverage runs from layer p (p - 1: not even p). */
static uint32_t kv_site_reach(const kv_hub_site_layout *in, uint32_t s, uint32_t p) {
    uint32_t e = p;
    while (e < in->n_layer && kv_site_covers(in, s, e, NULL)) e++;
    return e; /* one past the last covered layer */
}

typedef struct kv_site_search {
    const kv_hub_site_layout *in;
    bool used[KV_HUB_MAX_SITES];
    kv_hub_site_window *out;
    uint32_t n;
    uint32_t steps;          /* windows tried, bounded by KV_HUB_SITE_STEPS */
    uint32_t stuck;          /* the furthest layer no unused site could take */
} kv_site_search;

#define KV_HUB_SITE_STEPS 100000u /* windows tried before the search gives up */

/* Places windows from layer p on; true when the rest is placed. A window
 * always runs as far as its site's coverage does: stopping short never
 * helps, since a site covering the layers after the short end also covers
 * those after the long one. Sites are tried furthest reach first, and the
 * search backtracks when a choice leaves a layer no unused site holds. */
static bool kv_site_dfs(kv_site_search *x, uint32_t p) {
    const kv_hub_site_layout *in = x->in;
    if (p == in->n_layer) return true;
    uint32_t reach[KV_HUB_MAX_SITES];
    for (uint32_t s = 0; s < in->n_site; s++) reach[s] = x->used[s] ? p : kv_site_reach(in, s, p);
    for (;;) {
        uint32_t best = UINT32_MAX;
        for (uint32_t s = 0; s < in->n_site; s++)
            if (reach[s] > p && (best == UINT32_MAX || reach[s] > reach[best])) best = s;
        if (best == UINT32_MAX) {
            if (p > x->stuck) x->stuck = p;
            return false;
        }
        if (++x->steps > KV_HUB_SITE_STEPS) return false;
        x->used[best] = true;
        x->out[x->n++] = (kv_hub_site_window){best, p, reach[best] - 1};
        if (kv_site_dfs(x, reach[best])) return true;
        x->n--;
        x->used[best] = false;
        reach[best] = p; /* tried */
    }
}

int kv_hub_site_place(const kv_hub_site_layout *in, kv_hub_site_window *out, uint32_t *n_out, kv_diag *d) {
    *n_out = 0;
    if (!in->n_site) return kv_fail(d, KV_ENOTFOUND, "no site holds experts");
    if (in->n_site > KV_HUB_MAX_SITES)
        return kv_fail(d, KV_ERANGE, "%u sites, the placement takes at most %u", in->n_site, KV_HUB_MAX_SITES);
    kv_site_search x = {.in = in, .out = out};
    if (kv_site_dfs(&x, 0)) {
        KV_ASSERT(x.n <= in->n_site && x.n > 0);
        *n_out = x.n;
        return 0;
    }
    if (x.steps > KV_HUB_SITE_STEPS)
        return kv_fail(d, KV_ENOTFOUND, "no site placement found within %u tries", KV_HUB_SITE_STEPS);
    /* name the layer the search could not pass, and what the first site lacks there */
    const uint32_t L = x.stuck;
    for (uint32_t s = 0; s < in->n_site; s++) {
        uint32_t e = 0;
        if (!kv_site_covers(in, s, L, &e))
            return kv_fail(d, KV_ENOTFOUND, "layer %u: no site holds all its experts where the windows reach it "
                           "(site %u lacks expert %u)", L, s, e);
    }
    return kv_fail(d, KV_ENOTFOUND, "layer %u: the sites that hold it are needed for earlier windows", L);
}

/* ---- GET /v1/sites --------------------------------------------------------- */

static int kv_dbl_cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct kv_site_acc {
    char name[48];
    uint32_t n_nodes, n_workers, n_ring;
    double rtt;           /* median measured round trip of its nodes; < 0 none */
} kv_site_acc;

int kv_hub_sites_render(const kv_manifest *m, const kv_hub_site_node *nodes, size_t n_nodes, char **out, size_t *len,
                        kv_diag *d) {
    *out = NULL;
    const uint32_t nl = m->n_layer - m->n_layer_nextn, ne = m->n_expert;
    kv_site_acc *site = calloc(KV_HUB_MAX_SITES, sizeof *site);
    int64_t *of = malloc((n_nodes ? n_nodes : 1) * sizeof *of); /* node -> site index, -1 beyond the cap */
    double *rt = malloc((n_nodes ? n_nodes : 1) * sizeof *rt);
    uint8_t *moe = calloc(nl ? nl : 1, 1);
    uint8_t *holds = NULL;
    kv_hub_site_window win[KV_HUB_MAX_SITES];
    uint32_t n_site = 0, n_win = 0;
    json_t *root = NULL;
    int rc = 0;
    if (!site || !of || !rt || !moe) {
        rc = kv_fail(d, KV_ENOMEM, "sites: out of memory");
        goto done;
    }
    for (size_t i = 0; i < n_nodes; i++) {
        uint32_t s = 0;
        while (s < n_site && strcmp(site[s].name, nodes[i].site)) s++;
        if (s == n_site && n_site < KV_HUB_MAX_SITES) snprintf(site[n_site++].name, sizeof site[0].name, "%s", nodes[i].site);
        of[i] = s < n_site ? (int64_t)s : -1;
        if (of[i] < 0) continue;
        site[s].n_nodes++;
        site[s].n_ring += nodes[i].ring;
        site[s].n_workers += !nodes[i].ring;
    }
    for (uint32_t s = 0; s < n_site; s++) { /* the median of its measured nodes */
        size_t k = 0;
        for (size_t i = 0; i < n_nodes; i++)
            if (of[i] == s && nodes[i].rtt_ms >= 0) rt[k++] = nodes[i].rtt_ms;
        qsort(rt, k, sizeof *rt, kv_dbl_cmp);
        site[s].rtt = k ? (k % 2 ? rt[k / 2] : (rt[k / 2 - 1] + rt[k / 2]) / 2) : -1;
    }
    for (uint32_t L = 0; L < nl; L++) moe[L] = m->moe_layer[L] ? 1 : 0;
    holds = calloc((size_t)(n_site ? n_site : 1) * (nl ? nl : 1) * (ne ? ne : 1), 1);
    if (!holds) {
        rc = kv_fail(d, KV_ENOMEM, "sites: out of memory");
        goto done;
    }
    for (size_t i = 0; i < n_nodes; i++) {
        if (of[i] < 0 || nodes[i].ring) continue;
        for (size_t k = 0; k < nodes[i].n_slabs; k++) {
            const kv_manifest_slab *sl = &m->slabs[nodes[i].slabs[k]];
            if (sl->layer >= nl) continue;
            for (uint32_t e = sl->first; e <= sl->last && e < ne; e++)
                holds[((size_t)of[i] * nl + sl->layer) * ne + e] = 1;
        }
    }
    const kv_hub_site_layout lay = {.n_layer = nl, .n_expert = ne, .moe = moe, .n_site = n_site, .holds = holds};
    kv_diag pd = {0};
    const int prc = kv_hub_site_place(&lay, win, &n_win, &pd);
    root = json_object();
    json_object_set_new(root, "model_id", json_string(m->model_id));
    json_object_set_new(root, "n_layer", json_integer(nl));
    json_object_set_new(root, "near_ms", json_real(KV_HUB_SITE_NEAR_MS));
    json_t *js = json_array(), *jr = json_array();
    for (uint32_t s = 0; s < n_site; s++) {
        json_t *mem = json_array();
        for (size_t i = 0; i < n_nodes; i++) {
            if (of[i] != s) continue;
            char hex[65];
            kv_hex(nodes[i].pk, 32, hex);
            json_t *o = json_pack("{s:s, s:s, s:s, s:b}", "key", hex, "addr", nodes[i].addr, "role",
                                  nodes[i].ring ? "ring" : "worker", "given", nodes[i].given);
            json_object_set_new(o, "rtt_ms", nodes[i].rtt_ms >= 0 ? json_real(nodes[i].rtt_ms) : json_null());
            json_array_append_new(mem, o);
        }
        json_t *o = json_pack("{s:s, s:b, s:i, s:i, s:o}", "name", site[s].name, "auto", !strncmp(site[s].name, "auto:", 5),
                              "workers", (int)site[s].n_workers, "ring_nodes", (int)site[s].n_ring, "nodes", mem);
        json_object_set_new(o, "rtt_ms", site[s].rtt >= 0 ? json_real(site[s].rtt) : json_null());
        json_array_append_new(js, o);
        for (uint32_t t = s + 1; t < n_site; t++) {
            json_t *p = json_pack("{s:s, s:s}", "a", site[s].name, "b", site[t].name);
            const bool known = site[s].rtt >= 0 && site[t].rtt >= 0;
            json_object_set_new(p, "rtt_ms_max", known ? json_real(site[s].rtt + site[t].rtt) : json_null());
            json_object_set_new(p, "rtt_ms_min", known ? json_real(fabs(site[s].rtt - site[t].rtt)) : json_null());
            json_array_append_new(jr, p);
        }
    }
    json_object_set_new(root, "sites", js);
    json_object_set_new(root, "round_trips", jr);
    json_t *pl = json_object();
    if (prc) {
        json_object_set_new(pl, "kind", json_string("experts"));
        json_object_set_new(pl, "reason", json_string(pd.msg));
    } else {
        json_object_set_new(pl, "kind", json_string("sites"));
        json_t *ws = json_array();
        for (uint32_t w = 0; w < n_win; w++) {
            json_t *wk = json_array(), *rn = json_array();
            for (size_t i = 0; i < n_nodes; i++) {
                if (of[i] != win[w].site) continue;
                /* a worker that holds a slab of the window; a ring node that
                 * registered exactly the window's slabs (it runs that window) */
                bool in = false;
                size_t got = 0, need = 0;
                for (size_t k = 0; k < m->n_slabs; k++) need += m->slabs[k].layer >= win[w].first && m->slabs[k].layer <= win[w].last;
                for (size_t k = 0; k < nodes[i].n_slabs; k++) {
                    const uint32_t L = m->slabs[nodes[i].slabs[k]].layer;
                    got += L >= win[w].first && L <= win[w].last;
                }
                in = nodes[i].ring ? got == need && got == nodes[i].n_slabs : got > 0;
                if (!in) continue;
                char hex[65];
                kv_hex(nodes[i].pk, 32, hex);
                json_array_append_new(nodes[i].ring ? rn : wk, json_pack("{s:s, s:s}", "key", hex, "addr", nodes[i].addr));
            }
            json_array_append_new(ws, json_pack("{s:s, s:i, s:i, s:o, s:o}", "site", site[win[w].site].name, "first",
                                                (int)win[w].first, "last", (int)win[w].last, "workers", wk, "ring", rn));
        }
        json_object_set_new(pl, "windows", ws);
    }
    json_object_set_new(root, "placement", pl);
    char *t = json_dumps(root, JSON_COMPACT);
    if (!t) {
        rc = kv_fail(d, KV_ENOMEM, "sites: out of memory");
        goto done;
    }
    *out = t;
    *len = strlen(t);
done:
    json_decref(root);
    free(site);
    free(of);
    free(rt);
    free(moe);
    free(holds);
    return rc;
}
