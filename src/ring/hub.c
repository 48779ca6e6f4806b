/* A ring node in a hub's layer market (kvasir ring --hub URL --budget SIZE):
 * GET /v1/ring lists the hub's layer windows (docs/HUB.md); the node takes
 * the scarcest one that fits its budget, fetches the manifest, the backbone
 * and the slabs of the window's layers (resumable, hash checked, like any
 * node), registers them with backend "ring" and its ring address, and then,
 * on a thread of its own, heartbeats, answers storage challenges, and asks
 * the hub who holds the window after its own: that address becomes its
 * --next (kv_ring_node_set_next), so a ring forms from the market and
 * re-forms when a replacement takes a window that lost its node.
 *
 * The window also reports its demand per shard to the hub's market (the
 * expert computations its layers needed and the time it waited for them,
 * kv_ring_node_get_demand), with the reporter every coordinator shares
 * (kvasir/dispatch_demand.h): every few seconds, signed by the node key.
 *
 * Invariants: every answer from the hub is bounded (KV_RING_HUB_MAX_REPLY)
 * and parsed by kv_ring_parse_market (fuzzed) with each number range
 * checked; the files a challenge names are found from our manifest, never
 * from the challenge's path. */
#include <inttypes.h>
#include <jansson.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvasir/dispatch_demand.h"
#include "kvasir/hub.h" /* the hub's client API: the market, announce, challenges */
#include "kvasir/link.h" /* kv_hex, the node key */
#include "kvasir/node.h"
#include "kvasir/pieces.h"
#include "kvasir/ring.h"
#include "kvasir/slice.h"

_Static_assert(KV_RING_HUB_ADDR >= KV_HUB_MAX_ADDR, "the ring keeps any address the hub lists");

#define KV_RING_HUB_MAX_REPLY (4u << 20)

int kv_ring_parse_market(const char *json, size_t len, kv_ring_window *out, size_t cap, size_t *n, uint32_t *n_layer,
                         kv_diag *d) {
    *n = 0;
    *n_layer = 0;
    json_error_t je;
    json_t *j = json_loadb(json, len, 0, &je);
    if (!j) return kv_fail(d, KV_EFORMAT, "ring market: not JSON (%s)", je.text);
    int rc = 0;
    json_t *nl = json_object_get(j, "n_layer"), *ws = json_object_get(j, "windows");
    if (!json_is_integer(nl) || json_integer_value(nl) < 1 || json_integer_value(nl) > KV_RING_MAX_LAYERS ||
        !json_is_array(ws)) {
        rc = kv_fail(d, KV_EFORMAT, "ring market: needs n_layer in [1, %u] and a windows array", KV_RING_MAX_LAYERS);
        goto done;
    }
    *n_layer = (uint32_t)json_integer_value(nl);
    if (json_array_size(ws) > cap || json_array_size(ws) > *n_layer) {
        rc = kv_fail(d, KV_ERANGE, "ring market: %zu windows, at most %u", json_array_size(ws), *n_layer);
        goto done;
    }
    for (size_t i = 0; i < json_array_size(ws); i++) {
        json_t *w = json_array_get(ws, i);
        json_t *f = json_object_get(w, "first"), *l = json_object_get(w, "last"), *b = json_object_get(w, "bytes");
        json_t *lv = json_object_get(w, "live"), *wa = json_object_get(w, "wanted"), *nodes = json_object_get(w, "nodes");
        if (!json_is_integer(f) || !json_is_integer(l) || !json_is_integer(b) || !json_is_integer(lv) ||
            !json_is_integer(wa) || !json_is_array(nodes) || json_integer_value(f) < 0 ||
            json_integer_value(l) < json_integer_value(f) || json_integer_value(l) >= *n_layer ||
            json_integer_value(b) < 0 || json_integer_value(lv) < 0 || json_integer_value(lv) > (1 << 20) ||
            json_integer_value(wa) < 1 || json_integer_value(wa) > (1 << 20)) {
            rc = kv_fail(d, KV_EFORMAT, "ring market: window %zu is malformed or out of range", i);
            goto done;
        }
        kv_ring_window *o = &out[i];
        memset(o, 0, sizeof *o);
        o->first = (uint32_t)json_integer_value(f);
        o->last = (uint32_t)json_integer_value(l);
        o->bytes = (uint64_t)json_integer_value(b);
        o->live = (uint32_t)json_integer_value(lv);
        o->wanted = (uint32_t)json_integer_value(wa);
        json_t *n0 = json_array_size(nodes) ? json_array_get(nodes, 0) : NULL;
        json_t *ad = n0 ? json_object_get(n0, "addr") : NULL;
        if (n0) {
            const char *a = json_is_string(ad) ? json_string_value(ad) : NULL;
            const size_t al = a ? json_string_length(ad) : 0;
            bool ok = a && al >= 3 && al < sizeof o->addr && strlen(a) == al;
            for (size_t k = 0; ok && k < al; k++) {
                const char c = a[k];
                ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                     c == '-' || c == ':' || c == '[' || c == ']';
            }
            if (!ok) {
                rc = kv_fail(d, KV_EFORMAT, "ring market: window %zu: a node address is malformed", i);
                goto done;
            }
            memcpy(o->addr, a, al + 1);
        }
        *n = i + 1;
    }
done:
    if (rc) *n = 0;
    json_decref(j);
    return rc;
}

/* An address as the hub lists it: 3..KV_RING_HUB_ADDR bytes of [A-Za-z0-9.-:[]]. */
static bool kv_rh_addr_ok(json_t *ad) {
    const char *a = json_is_string(ad) ? json_string_value(ad) : NULL;
    const size_t al = a ? json_string_length(ad) : 0;
    bool ok = a && al >= 3 && al <= KV_RING_HUB_ADDR && strlen(a) == al;
    for (size_t k = 0; ok && k < al; k++) {
        const char c = a[k];
        ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '-' ||
             c == ':' || c == '[' || c == ']';
    }
    return ok;
}

int kv_ring_parse_sites(const char *json, size_t len, kv_ring_sites *out, kv_diag *d) {
    memset(out, 0, sizeof *out);
    json_error_t je;
    json_t *j = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!j) return kv_fail(d, KV_EFORMAT, "sites: not JSON (%s)", je.text);
    int rc = 0;
    json_t *pl = json_object_get(j, "placement"), *nl = json_object_get(j, "n_layer");
    json_t *kind = json_object_get(pl, "kind"), *why = json_object_get(pl, "reason"), *ws = json_object_get(pl, "windows");
    if (!json_is_object(pl) || !json_is_string(kind) || !json_is_integer(nl) || json_integer_value(nl) < 1 ||
        json_integer_value(nl) > KV_RING_MAX_LAYERS) {
        rc = kv_fail(d, KV_EFORMAT, "sites: needs n_layer in [1, %u] and a placement with a kind", KV_RING_MAX_LAYERS);
        goto done;
    }
    if (strcmp(json_string_value(kind), "sites")) {
        snprintf(out->reason, sizeof out->reason, "%.200s", json_is_string(why) ? json_string_value(why) : "none published");
        for (char *c = out->reason; *c; c++)
            if (*c < 0x20 || *c > 0x7e) *c = '?';
        goto done;
    }
    if (!json_is_array(ws) || !json_array_size(ws) || json_array_size(ws) > KV_RING_SITE_WINDOWS) {
        rc = kv_fail(d, KV_EFORMAT, "sites: a placement of sites needs 1 to %u windows", KV_RING_SITE_WINDOWS);
        goto done;
    }
    uint32_t next = 0;
    for (size_t i = 0; i < json_array_size(ws); i++) {
        json_t *w = json_array_get(ws, i), *jsite = json_object_get(w, "site"), *jf = json_object_get(w, "first"),
               *jl = json_object_get(w, "last"), *wk = json_object_get(w, "workers"), *rn = json_object_get(w, "ring");
        kv_ring_site_window *o = &out->win[i];
        if (!json_is_string(jsite) || !json_string_length(jsite) || json_string_length(jsite) >= sizeof o->site ||
            strlen(json_string_value(jsite)) != json_string_length(jsite) || !json_is_integer(jf) ||
            !json_is_integer(jl) || json_integer_value(jf) != next || json_integer_value(jl) < json_integer_value(jf) ||
            json_integer_value(jl) >= json_integer_value(nl) || !json_is_array(wk) || !json_is_array(rn)) {
            rc = kv_fail(d, KV_EFORMAT, "sites: window %zu is malformed or not the next one", i);
            goto done;
        }
        snprintf(o->site, sizeof o->site, "%s", json_string_value(jsite));
        for (char *c = o->site; *c; c++)
            if (*c < 0x21 || *c > 0x7e) *c = '?';
        o->first = next;
        o->last = (uint32_t)json_integer_value(jl);
        next = o->last + 1;
        for (size_t k = 0; k < json_array_size(wk) && o->n_workers < KV_RING_SITE_WORKERS; k++) {
            json_t *ad = json_object_get(json_array_get(wk, k), "addr");
            if (!kv_rh_addr_ok(ad)) {
                rc = kv_fail(d, KV_EFORMAT, "sites: window %zu: a worker address is malformed", i);
                goto done;
            }
            snprintf(o->workers[o->n_workers++], sizeof o->workers[0], "%s", json_string_value(ad));
        }
        if (json_array_size(rn)) {
            json_t *ad = json_object_get(json_array_get(rn, 0), "addr");
            if (!kv_rh_addr_ok(ad)) {
                rc = kv_fail(d, KV_EFORMAT, "sites: window %zu: a ring node address is malformed", i);
                goto done;
            }
            snprintf(o->ring, sizeof o->ring, "%s", json_string_value(ad));
        }
        out->n_win = (uint32_t)i + 1;
    }
    if (next != (uint32_t)json_integer_value(nl)) {
        rc = kv_fail(d, KV_EFORMAT, "sites: the windows end at layer %u of %u", next, (unsigned)json_integer_value(nl));
        goto done;
    }
    out->placed = true;
done:
    if (rc) memset(out, 0, sizeof *out);
    json_decref(j);
    return rc;
}

int kv_ring_choose(const kv_ring_window *w, size_t n, uint64_t budget) {
    int best = -1;
    for (size_t i = 0; i < n; i++) {
        if (w[i].bytes > budget) continue;
        /* scarcest first: fewest live holders for the wanted ones, then the lower layers */
        if (best < 0 || (uint64_t)w[i].live * w[best].wanted < (uint64_t)w[best].live * w[i].wanted) best = (int)i;
    }
    return best;
}

static int kv_rh_get(const char *hub, const char *path, char **out, size_t *len, kv_diag *d) {
    char url[1200];
    if (snprintf(url, sizeof url, "%s%s", hub, path) >= (int)sizeof url) return kv_fail(d, KV_EINVAL, "hub URL is too long");
    long st = 0;
    int rc = kv_hub_http_get(url, KV_RING_HUB_MAX_REPLY, 10000, out, len, &st, d);
    if (rc) return rc;
    if (st != 200) {
        rc = kv_fail(d, KV_EIO, "hub: %s: status %ld: %.200s", url, st, *out ? *out : "");
        free(*out);
        *out = NULL;
    }
    return rc;
}

static int kv_rh_market(const char *hub, kv_ring_window *w, size_t cap, size_t *n, uint32_t *n_layer, kv_diag *d) {
    char *body = NULL;
    size_t len = 0;
    int rc = kv_rh_get(hub, "/v1/ring", &body, &len, d);
    if (!rc) rc = kv_ring_parse_market(body, len, w, cap, n, n_layer, d);
    free(body);
    return rc;
}

/* GET /v1/sites parsed into *s (heap: it is large). */
static int kv_rh_sites(const char *hub, kv_ring_sites **s, kv_diag *d) {
    *s = NULL;
    char *body = NULL;
    size_t len = 0;
    kv_ring_sites *x = malloc(sizeof *x);
    if (!x) return kv_fail(d, KV_ENOMEM, "out of memory");
    int rc = kv_rh_get(hub, "/v1/sites", &body, &len, d);
    if (!rc) rc = kv_ring_parse_sites(body, len, x, d);
    free(body);
    if (rc) free(x);
    else *s = x;
    return rc;
}

/* The window of `site` in s, or -1. */
static int kv_rh_site_window(const kv_ring_sites *s, const char *site) {
    for (uint32_t i = 0; i < s->n_win; i++)
        if (!strcmp(s->win[i].site, site)) return (int)i;
    return -1;
}

int kv_ring_hub_join_site(const char *hub, const char *dir, const char *site, uint32_t *first, uint32_t *last,
                          char *manifest_path, size_t cap, char (*workers)[KV_RING_HUB_ADDR + 1], uint32_t wcap,
                          uint32_t *n_workers, FILE *log, kv_diag *d) {
    *n_workers = 0;
    kv_ring_sites *s = NULL;
    int rc = kv_rh_sites(hub, &s, d);
    if (rc) return rc;
    const int w = s->placed ? kv_rh_site_window(s, site) : -1;
    if (w < 0) {
        rc = s->placed ? kv_fail(d, KV_ENOTFOUND, "ring: the hub's placement gives site '%s' no window", site)
                       : kv_fail(d, KV_ENOTFOUND, "ring: the hub has no site placement: %s", s->reason);
        free(s);
        return rc;
    }
    const kv_ring_site_window *sw = &s->win[w];
    *first = sw->first;
    *last = sw->last;
    for (uint32_t i = 0; i < sw->n_workers && *n_workers < wcap; i++)
        memcpy(workers[(*n_workers)++], sw->workers[i], sizeof workers[0]);
    if (log)
        fprintf(log, "kvasir ring %u-%u: site %s: the hub's placement gives it layers %u-%u, %u site workers\n", *first,
                *last, site, *first, *last, *n_workers);
    free(s);
    kv_manifest *m = NULL;
    if ((rc = kv_node_fetch_manifest(hub, dir, &m, d))) return rc;
    if ((rc = kv_node_fetch_piece(hub, dir, &m->backbone, NULL, NULL, d))) goto done;
    for (size_t i = 0; i < m->n_slabs; i++)
        if (m->slabs[i].layer >= *first && m->slabs[i].layer <= *last &&
            (rc = kv_node_fetch_piece(hub, dir, &m->slabs[i].file, NULL, NULL, d)))
            goto done;
    rc = kv_node_piece_path(dir, "manifest.json", manifest_path, cap, d);
done:
    kv_manifest_free(m);
    return rc;
}

int kv_ring_hub_site_entries(const char *hub, char (*out)[KV_RING_HUB_ADDR + 1], uint32_t cap, uint32_t *n, char *why,
                             size_t why_cap, kv_diag *d) {
    *n = 0;
    why[0] = 0;
    kv_ring_sites *s = NULL;
    int rc = kv_rh_sites(hub, &s, d);
    if (rc) return rc;
    if (!s->placed) {
        snprintf(why, why_cap, "no site placement: %s", s->reason);
    } else {
        for (uint32_t i = 0; i < s->n_win && !why[0]; i++)
            if (!s->win[i].ring[0]) snprintf(why, why_cap, "no ring node runs site %s's window (layers %u-%u)",
                                             s->win[i].site, s->win[i].first, s->win[i].last);
        for (uint32_t i = 0; i < s->n_win && !why[0] && *n < cap; i++) memcpy(out[(*n)++], s->win[i].ring, sizeof out[0]);
    }
    free(s);
    return 0;
}

int kv_ring_hub_join(const char *hub, const char *dir, uint64_t budget, uint32_t *first, uint32_t *last,
                     char *manifest_path, size_t cap, FILE *log, kv_diag *d) {
    kv_ring_window w[KV_RING_MAX_LAYERS];
    size_t n = 0;
    uint32_t n_layer = 0;
    int rc = kv_rh_market(hub, w, KV_RING_MAX_LAYERS, &n, &n_layer, d);
    if (rc) return rc;
    const int k = kv_ring_choose(w, n, budget);
    if (k < 0) return kv_fail(d, KV_ENOMEM, "ring: no layer window of the hub's %zu fits a budget of %" PRIu64 " bytes", n, budget);
    *first = w[k].first;
    *last = w[k].last;
    if (log)
        fprintf(log, "kvasir ring %u-%u: took layers %u-%u from the market (%u of %u live, %" PRIu64 " bytes)\n", *first,
                *last, *first, *last, w[k].live, w[k].wanted, w[k].bytes);
    kv_manifest *m = NULL;
    if ((rc = kv_node_fetch_manifest(hub, dir, &m, d))) return rc;
    if ((rc = kv_node_fetch_piece(hub, dir, &m->backbone, NULL, NULL, d))) goto done;
    for (size_t i = 0; i < m->n_slabs; i++)
        if (m->slabs[i].layer >= *first && m->slabs[i].layer <= *last &&
            (rc = kv_node_fetch_piece(hub, dir, &m->slabs[i].file, NULL, NULL, d)))
            goto done;
    rc = kv_node_piece_path(dir, "manifest.json", manifest_path, cap, d);
done:
    kv_manifest_free(m);
    return rc;
}

/* ---- membership --------------------------------------------------------------- */

struct kv_ring_hub {
    char *hub, *dir;
    kv_ring_node *node;
    kv_node_key key;
    kv_manifest *m;
    uint32_t first, last, n_layer;
    uint64_t budget;
    uint32_t interval_ms;
    char site[KV_HUB_MAX_SITE + 1]; /* a node of the ring of sites ("" = of the layer market) */
    FILE *log;
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop, started;
    kv_demand_reporter *demand;   /* the window's demand reports (NULL: not sliced) */
    uint64_t dm_reports, dm_errors; /* its reports: accepted, refused or failed */
    uint64_t dm_tokens, dm_comps;   /* of the accepted ones: tokens the hub counted, computations reported */
};

__attribute__((format(printf, 2, 3))) static void kv_rh_log(kv_ring_hub *h, const char *fmt, ...) {
    if (!h->log) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(h->log, "kvasir ring %u-%u: hub: ", h->first, h->last);
    vfprintf(h->log, fmt, ap);
    fputc('\n', h->log);
    fflush(h->log);
    va_end(ap);
}

/* Answers a storage challenge from our own copy of the named slab. */
static void kv_rh_challenge(kv_ring_hub *h, json_t *ch) {
    if (!json_is_object(ch)) return;
    json_t *jn = json_object_get(ch, "nonce"), *jl = json_object_get(ch, "layer"), *jf = json_object_get(ch, "first"),
           *jt = json_object_get(ch, "last");
    uint8_t nonce[32];
    if (!json_is_string(jn) || kv_unhex(json_string_value(jn), json_string_length(jn), nonce, 32, true) ||
        !json_is_integer(jl) || !json_is_integer(jf) || !json_is_integer(jt) || json_integer_value(jl) < h->first ||
        json_integer_value(jl) > h->last || json_integer_value(jf) < 0 || json_integer_value(jt) < 0 ||
        json_integer_value(jf) > UINT32_MAX || json_integer_value(jt) > UINT32_MAX) {
        kv_rh_log(h, "a malformed storage challenge, ignored");
        return;
    }
    const kv_manifest_slab *s = kv_manifest_find_slab(h->m, (uint32_t)json_integer_value(jl), (uint32_t)json_integer_value(jf),
                                                      (uint32_t)json_integer_value(jt));
    kv_diag d = {0};
    char path[4096], ah[65], body[200], *reply = NULL;
    uint8_t ans[32];
    if (!s || kv_node_piece_path(h->dir, s->file.path, path, sizeof path, &d) ||
        kv_hub_challenge_answer(path, s->file.size, nonce, ans, &d)) {
        kv_rh_log(h, "challenge: %s", s ? d.msg : "not a slab of this window");
        return;
    }
    kv_hex(ans, 32, ah);
    snprintf(body, sizeof body, "{\"nonce\":\"%.64s\",\"sha256\":\"%s\"}", json_string_value(jn), ah);
    long st = 0;
    if (kv_node_hub_post(h->hub, &h->key, "/v1/challenge", body, &reply, &st, &d)) kv_rh_log(h, "challenge: %s", d.msg);
    else if (st != 200) kv_rh_log(h, "challenge answer refused (%ld): %.200s", st, reply);
    free(reply);
}

static int kv_rh_register(kv_ring_hub *h, kv_diag *d) {
    char *body = NULL, *reply = NULL;
    size_t len = 0;
    int rc = kv_rh_get(h->hub, "/v1/nonce", &body, &len, d);
    if (rc) return rc;
    json_error_t je;
    json_t *j = json_loadb(body, len, 0, &je);
    free(body);
    kv_hub_announce a = {0};
    json_t *jn = j ? json_object_get(j, "nonce") : NULL;
    const bool ok = json_is_string(jn) && !kv_unhex(json_string_value(jn), json_string_length(jn), a.nonce, 32, true);
    json_decref(j);
    if (!ok) return kv_fail(d, KV_EFORMAT, "hub: /v1/nonce answer is not {\"nonce\": HEX64}");
    snprintf(a.addr, sizeof a.addr, "%s", kv_ring_node_addr(h->node));
    snprintf(a.backend, sizeof a.backend, "ring");
    snprintf(a.site, sizeof a.site, "%s", h->site);
    a.memory = h->budget;
    if (!(a.shards = calloc(h->m->n_slabs ? h->m->n_slabs : 1, sizeof *a.shards))) return kv_fail(d, KV_ENOMEM, "out of memory");
    for (size_t i = 0; i < h->m->n_slabs; i++) {
        const kv_manifest_slab *s = &h->m->slabs[i];
        if (s->layer < h->first || s->layer > h->last) continue;
        a.shards[a.n_shards] = (kv_hub_held){.layer = s->layer, .first = s->first, .last = s->last};
        memcpy(a.shards[a.n_shards++].sha256, s->file.sha256, 32);
    }
    char *js = kv_hub_announce_json(&a);
    free(a.shards);
    if (!js) return kv_fail(d, KV_ENOMEM, "out of memory");
    long st = 0;
    rc = kv_node_hub_post(h->hub, &h->key, "/v1/register", js, &reply, &st, d);
    free(js);
    if (rc) return rc;
    if (st != 200) {
        rc = kv_fail(d, KV_EPROTO, "hub refused the registration (%ld): %.300s", st, reply);
        free(reply);
        return rc;
    }
    j = json_loads(reply, 0, &je);
    free(reply);
    json_t *dl = j ? json_object_get(j, "deadline_ms") : NULL;
    if (json_is_integer(dl) && json_integer_value(dl) >= 3 && json_integer_value(dl) <= 180000)
        h->interval_ms = (uint32_t)(json_integer_value(dl) / 3);
    kv_rh_log(h, "registered layers %u-%u at %s", h->first, h->last, kv_ring_node_addr(h->node));
    if (j) kv_rh_challenge(h, json_object_get(j, "challenge"));
    json_decref(j);
    return 0;
}

/* A node of the ring of sites: the ring node of the window after ours. */
static void kv_rh_next_site(kv_ring_hub *h) {
    kv_ring_sites *s = NULL;
    kv_diag d = {0};
    if (kv_rh_sites(h->hub, &s, &d)) {
        kv_rh_log(h, "%s", d.msg);
        return;
    }
    const int w = s->placed ? kv_rh_site_window(s, h->site) : -1;
    if (w < 0 || s->win[w].first != h->first || s->win[w].last != h->last)
        kv_rh_log(h, "the hub's placement no longer gives site %s layers %u-%u (restart to take the new window)",
                  h->site, h->first, h->last);
    else if (s->win[(w + 1) % s->n_win].ring[0])
        kv_ring_node_set_next(h->node, s->win[(w + 1) % s->n_win].ring);
    free(s);
}

/* Who holds the window after ours: that node is our next. */
static void kv_rh_next(kv_ring_hub *h) {
    if (h->site[0]) {
        kv_rh_next_site(h);
        return;
    }
    kv_ring_window w[KV_RING_MAX_LAYERS];
    size_t n = 0;
    uint32_t nl = 0;
    kv_diag d = {0};
    if (kv_rh_market(h->hub, w, KV_RING_MAX_LAYERS, &n, &nl, &d)) {
        kv_rh_log(h, "%s", d.msg);
        return;
    }
    const uint32_t want = (h->last + 1) % (nl ? nl : 1);
    for (size_t i = 0; i < n; i++)
        if (w[i].first == want && w[i].addr[0]) kv_ring_node_set_next(h->node, w[i].addr);
}

static void *kv_rh_thread(void *arg) {
    kv_ring_hub *h = arg;
    pthread_mutex_lock(&h->mu);
    while (!h->stop) {
        pthread_mutex_unlock(&h->mu);
        kv_diag d = {0};
        char *reply = NULL;
        long st = 0;
        if (kv_node_hub_post(h->hub, &h->key, "/v1/heartbeat", "{}", &reply, &st, &d)) {
            kv_rh_log(h, "heartbeat: %s", d.msg);
        } else if (st != 200) { /* unknown to the hub (restarted, or dropped us): register again */
            kv_rh_log(h, "heartbeat refused (%ld); registering again", st);
            if (kv_rh_register(h, &d)) kv_rh_log(h, "%s", d.msg);
        } else {
            json_error_t je;
            json_t *j = json_loads(reply, 0, &je);
            if (j && json_object_get(j, "dropped")) {
                kv_rh_log(h, "the hub dropped our holdings; registering again");
                if (kv_rh_register(h, &d)) kv_rh_log(h, "%s", d.msg);
            } else if (j) {
                kv_rh_challenge(h, json_object_get(j, "challenge"));
            }
            json_decref(j);
        }
        free(reply);
        kv_rh_next(h);
        pthread_mutex_lock(&h->mu);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        const uint64_t ns = (uint64_t)ts.tv_nsec + (uint64_t)h->interval_ms * 1000000u;
        ts.tv_sec += (time_t)(ns / 1000000000u);
        ts.tv_nsec = (long)(ns % 1000000000u);
        if (!h->stop) pthread_cond_timedwait(&h->cv, &h->mu, &ts);
    }
    pthread_mutex_unlock(&h->mu);
    return NULL;
}

static void kv_rh_demand_snapshot(void *ctx, kv_remote_demand *now, uint64_t *tokens) {
    kv_ring_hub *h = ctx;
    const kv_manifest *m = kv_ring_node_manifest(h->node);
    kv_ring_node_get_demand(h->node, now, m ? m->n_slabs : 0, tokens);
}

/* On the reporter's thread; the counters are read after it stopped. */
static void kv_rh_demand_done(void *ctx, int rc, uint64_t tokens, uint64_t computations, uint64_t accepted) {
    kv_ring_hub *h = ctx;
    if (rc) {
        h->dm_errors++;
        return;
    }
    if (!h->dm_reports++)
        kv_rh_log(h, "demand: first report accepted (%" PRIu64 " tokens, %" PRIu64 " expert computations; the hub "
                  "counted %" PRIu64 " tokens)", tokens, computations, accepted);
    h->dm_tokens += accepted;
    h->dm_comps += computations;
}

int kv_ring_hub_start(kv_ring_hub **out, const char *hub, const char *dir, kv_ring_node *node, uint64_t budget,
                      FILE *log, kv_diag *d) {
    return kv_ring_hub_start_site(out, hub, dir, node, budget, NULL, log, d);
}

int kv_ring_hub_start_site(kv_ring_hub **out, const char *hub, const char *dir, kv_ring_node *node, uint64_t budget,
                           const char *site, FILE *log, kv_diag *d) {
    *out = NULL;
    if (site && kv_hub_site_check(site, d)) return kv_diag_prefix(d, KV_EINVAL, "ring: --site");
    kv_ring_hub *h = calloc(1, sizeof *h);
    if (!h) return kv_fail(d, KV_ENOMEM, "out of memory");
    if (site) snprintf(h->site, sizeof h->site, "%s", site);
    h->hub = strdup(hub);
    h->dir = strdup(dir);
    h->node = node;
    h->budget = budget;
    h->log = log;
    h->interval_ms = 1000;
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    kv_ring_node_window(node, &h->first, &h->last, &h->n_layer);
    char mp[4200];
    int rc;
    if (!h->hub || !h->dir) rc = kv_fail(d, KV_ENOMEM, "out of memory");
    else if (!(rc = kv_node_key_load(&h->key, dir, true, d)) && !(rc = kv_node_piece_path(dir, "manifest.json", mp, sizeof mp, d)))
        rc = kv_manifest_load(&h->m, mp, d);
    if (!rc) rc = kv_rh_register(h, d);
    if (!rc) kv_rh_next(h);
    if (!rc && pthread_create(&h->th, NULL, kv_rh_thread, h)) rc = kv_fail(d, KV_ENOMEM, "ring: cannot start the hub thread");
    else if (!rc) h->started = true;
    if (!rc && kv_ring_node_manifest(node)) {
        char who[64];
        snprintf(who, sizeof who, "kvasir ring %u-%u", h->first, h->last);
        const kv_demand_reporter_opts ro = {.hub = h->hub, .key = &h->key, .m = kv_ring_node_manifest(node),
                                            .snapshot = kv_rh_demand_snapshot, .done = kv_rh_demand_done, .ctx = h,
                                            .who = who, .log = log};
        rc = kv_demand_reporter_start(&h->demand, &ro, d);
    }
    if (rc) {
        kv_ring_hub_stop(h);
        return rc;
    }
    *out = h;
    return 0;
}

void kv_ring_hub_stop(kv_ring_hub *h) {
    if (!h) return;
    if (h->demand) {
        kv_demand_reporter_free(h->demand);
        kv_rh_log(h, "demand: %" PRIu64 " reports accepted (%" PRIu64 " expert computations reported, %" PRIu64
                  " tokens counted), %" PRIu64 " refused or failed", h->dm_reports, h->dm_comps, h->dm_tokens,
                  h->dm_errors);
    }
    if (h->started) {
        pthread_mutex_lock(&h->mu);
        h->stop = true;
        pthread_cond_signal(&h->cv);
        pthread_mutex_unlock(&h->mu);
        pthread_join(h->th, NULL);
    }
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv);
    kv_manifest_free(h->m);
    free(h->hub);
    free(h->dir);
    free(h);
}
