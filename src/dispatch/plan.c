/* The plan (include/kvasir/plan.h): the placement map as the coordinator
 * reads it, and a simulation of the coordinator's expert assignment
 * (src/dispatch/remote.c kv_remote_pick) over the routings of one token.
 * The placement is untrusted: its addresses and keys are what a coordinator
 * keeps of it (kv_node_placement_parse: invalid or conflicting entries
 * skipped, at most KV_PLACEMENT_MAX_REPLICAS holders per shard), and a shard
 * whose layer or expert range lies outside the model is skipped; the
 * simulation visits only each expert's holders, so its cost does not grow
 * with the number of nodes. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/dispatch_proto.h"
#include "kvasir/dispatch_remote.h"
#include "kvasir/hub.h"
#include "kvasir/node.h"
#include "kvasir/plan.h"
#include "kvasir/ring.h"

struct kv_plan {
    const kv_manifest *m;
    uint32_t n_w;        /* workers, in placement order (the addresses a coordinator keeps) */
    char **addr;         /* [n_w] */
    char (*key)[65];     /* [n_w] hex public key ("" if the hub gave none) */
    uint32_t *hoff;      /* [n_layer * n_expert + 1]: holders of (L, e) are hw[hoff[i] .. hoff[i+1]) */
    uint32_t *hw;        /* worker indices, ascending per (L, e) */
};

typedef struct kv_plan_pair {
    uint32_t cell, w;    /* (L * n_expert + e, worker) */
} kv_plan_pair;

static int kv_plan_pair_cmp(const void *a, const void *b) {
    const kv_plan_pair *x = a, *y = b;
    if (x->cell != y->cell) return x->cell < y->cell ? -1 : 1;
    return (x->w > y->w) - (x->w < y->w);
}

/* Whether shard s has integer layer, first, last inside the model (into
 * *L, *F, *T when given). */
static bool kv_plan_shard(json_t *s, const kv_manifest *m, uint32_t *L, uint32_t *F, uint32_t *T) {
    json_t *jl = json_object_get(s, "layer"), *jf = json_object_get(s, "first"), *jt = json_object_get(s, "last");
    if (!json_is_integer(jl) || !json_is_integer(jf) || !json_is_integer(jt)) return false;
    const json_int_t l = json_integer_value(jl), f = json_integer_value(jf), t = json_integer_value(jt);
    if (l < 0 || l >= m->n_layer || f < 0 || f > t || t >= m->n_expert) return false;
    if (L) *L = (uint32_t)l, *F = (uint32_t)f, *T = (uint32_t)t;
    return true;
}

/* Holders of every (layer, expert) from the entries the coordinator keeps
 * (kv_node_placement_parse); a shard outside the model is skipped like any
 * other invalid entry. A cell takes at most KV_PLAN_MAX_HOLDERS holders
 * (shards of the map may overlap; the hub's do not), so the index is
 * bounded by the model, not by the map. */
static int kv_plan_parse(kv_plan *p, const kv_placement *pl, const char *body, size_t len, kv_diag *d) {
    const kv_manifest *m = p->m;
    const size_t cells = (size_t)m->n_layer * m->n_expert;
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return kv_fail(d, KV_EFORMAT, "placement: bad JSON at line %d: %s", je.line, je.text);
    json_t *sh = json_object_get(root, "shards");
    int rc = 0;
    uint32_t *cnt = calloc(cells ? cells : 1, sizeof *cnt);
    kv_plan_pair *pr = NULL;
    size_t n_pr = 0, cap_pr = 0;
    if (!cnt) rc = kv_fail(d, KV_ENOMEM, "plan: out of memory");
    /* the shards outside the model: skipped, the first named */
    size_t n_bad = 0;
    char bad[200] = "";
    for (size_t i = 0; i < json_array_size(sh) && !rc; i++) {
        if (kv_plan_shard(json_array_get(sh, i), m, NULL, NULL, NULL)) continue;
        if (!n_bad++) snprintf(bad, sizeof bad, "shards[%zu] needs integer layer, first, last inside the model (%u "
                               "layers, %u experts)", i, m->n_layer, m->n_expert);
    }
    for (size_t x = 0; x < pl->n_entry && !rc; x++) {
        const kv_placement_entry *en = &pl->entry[x];
        uint32_t L, F, T;
        if (!kv_plan_shard(json_array_get(sh, en->shard), m, &L, &F, &T)) continue;
        for (uint32_t e = F; e <= T; e++) {
            const size_t c = (size_t)L * m->n_expert + e;
            if (cnt[c] == KV_PLAN_MAX_HOLDERS) continue;
            cnt[c]++;
            if (n_pr == cap_pr) {
                const size_t nc = cap_pr ? 2 * cap_pr : 1024;
                kv_plan_pair *np = realloc(pr, nc * sizeof *np);
                if (!np) {
                    rc = kv_fail(d, KV_ENOMEM, "plan: out of memory");
                    break;
                }
                pr = np;
                cap_pr = nc;
            }
            pr[n_pr++] = (kv_plan_pair){(uint32_t)c, en->addr};
        }
    }
    json_decref(root);
    free(cnt);
    if (!rc && n_bad && !n_pr) rc = kv_fail(d, KV_ERANGE, "placement: no usable shard: %s", bad);
    if (!rc) {
        qsort(pr, n_pr, sizeof *pr, kv_plan_pair_cmp);
        p->hoff = calloc(cells + 1, sizeof *p->hoff);
        p->hw = malloc((n_pr ? n_pr : 1) * sizeof *p->hw);
        if (!p->hoff || !p->hw) rc = kv_fail(d, KV_ENOMEM, "plan: out of memory");
    }
    if (!rc) {
        size_t o = 0, x = 0;
        for (size_t c = 0; c < cells; c++) {
            p->hoff[c] = (uint32_t)o;
            for (; x < n_pr && pr[x].cell == c; x++)
                if (o == p->hoff[c] || p->hw[o - 1] != pr[x].w) p->hw[o++] = pr[x].w; /* each holder once */
        }
        p->hoff[cells] = (uint32_t)o;
    }
    free(pr);
    return rc;
}

/* Messages for one token whose experts are ids[0..k) in rank order: the
 * coordinator's assignment (remote.c kv_remote_pick) over live holders:
 * the holder with the fewest pairs so far; among equals the first met
 * when the workers are visited from (L * n_expert + e) mod n_w on. */
static uint32_t kv_plan_messages(const kv_plan *p, uint32_t L, const uint32_t *ids, uint32_t k, uint32_t *load) {
    uint32_t msgs = 0;
    for (uint32_t s = 0; s < k; s++) {
        const size_t key = (size_t)L * p->m->n_expert + ids[s];
        const uint32_t start = (uint32_t)(key % p->n_w);
        int64_t best = -1;
        uint32_t best_rank = 0;
        for (uint32_t h = p->hoff[key]; h < p->hoff[key + 1]; h++) {
            const uint32_t i = p->hw[h], rank = (i + p->n_w - start) % p->n_w;
            if (best < 0 || load[i] < load[best] || (load[i] == load[best] && rank < best_rank)) best = i, best_rank = rank;
        }
        if (best < 0) continue; /* uncovered: reported before */
        msgs += load[best] == 0;
        load[best]++;
    }
    for (uint32_t s = 0; s < k; s++) /* clear only what was touched */
        for (uint32_t h = p->hoff[(size_t)L * p->m->n_expert + ids[s]]; h < p->hoff[(size_t)L * p->m->n_expert + ids[s] + 1]; h++)
            load[p->hw[h]] = 0;
    return msgs;
}

typedef struct {
    uint32_t min, max;
    double mean;
    bool exact;      /* every ordered choice enumerated */
    uint64_t cases;  /* choices looked at */
} kv_plan_layer;

/* n^k (the odometer's steps over k digits of base n), if at most cap; else 0. */
static uint64_t kv_plan_n_pow(uint32_t n, uint32_t k, uint64_t cap) {
    uint64_t c = 1;
    for (uint32_t i = 0; i < k; i++) {
        c *= (uint64_t)n;
        if (c > cap) return 0;
    }
    return c;
}

static uint64_t kv_plan_rng(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void kv_plan_layer_stats(const kv_plan *p, uint32_t L, uint32_t k, uint32_t *ids, uint32_t *load, kv_plan_layer *out) {
    const uint32_t n = p->m->n_expert;
    *out = (kv_plan_layer){UINT32_MAX, 0, 0, false, 0};
    double sum = 0;
    if (kv_plan_n_pow(n, k, KV_PLAN_ENUM)) { /* every ordered k-tuple of distinct experts, by an odometer */
        uint32_t idx[KV_PLAN_MAX_K] = {0};
        for (;;) {
            bool distinct = true;
            for (uint32_t a = 0; a < k && distinct; a++)
                for (uint32_t b = 0; b < a && distinct; b++) distinct = idx[a] != idx[b];
            if (distinct) {
                memcpy(ids, idx, k * sizeof *ids);
                const uint32_t m = kv_plan_messages(p, L, ids, k, load);
                sum += m;
                out->cases++;
                if (m < out->min) out->min = m;
                if (m > out->max) out->max = m;
            }
            uint32_t a = 0;
            while (a < k && ++idx[a] == n) idx[a++] = 0;
            if (a == k) break;
        }
        out->exact = true;
    } else {
        uint64_t seed = 0x6b76706c616eull ^ L;
        for (uint32_t t = 0; t < KV_PLAN_SAMPLES; t++) {
            for (uint32_t a = 0; a < k; a++) { /* k distinct experts, in order */
                uint32_t e;
                bool dup;
                do {
                    e = (uint32_t)(kv_plan_rng(&seed) % n);
                    dup = false;
                    for (uint32_t b = 0; b < a; b++) dup |= ids[b] == e;
                } while (dup);
                ids[a] = e;
            }
            const uint32_t m = kv_plan_messages(p, L, ids, k, load);
            sum += m;
            out->cases++;
            if (m < out->min) out->min = m;
            if (m > out->max) out->max = m;
        }
    }
    out->mean = out->cases ? sum / (double)out->cases : 0;
    if (!out->cases) out->min = 0;
}

void kv_plan_free(kv_plan *p) {
    if (!p) return;
    kv_node_workers_free(p->addr, p->n_w);
    free(p->key);
    free(p->hoff);
    free(p->hw);
    free(p);
}

int kv_plan_open(kv_plan **out, const kv_manifest *m, const char *placement, size_t len, kv_diag *d) {
    *out = NULL;
    kv_plan *p = calloc(1, sizeof *p);
    if (!p) return kv_fail(d, KV_ENOMEM, "plan: out of memory");
    p->m = m;
    kv_placement pl;
    int rc = kv_node_placement_parse(placement, len, &pl, d);
    if (rc) goto fail;
    p->key = calloc(pl.n_addr ? pl.n_addr : 1, sizeof *p->key);
    if (!p->key) {
        rc = kv_fail(d, KV_ENOMEM, "plan: out of memory");
        goto fail;
    }
    static const uint8_t zero[32];
    for (uint32_t i = 0; i < pl.n_addr; i++)
        if (memcmp(pl.key[i], zero, 32)) kv_hex(pl.key[i], 32, p->key[i]);
    if ((rc = kv_plan_parse(p, &pl, placement, len, d))) goto fail;
    p->addr = pl.addr; /* the coordinator's workers, in its order */
    p->n_w = pl.n_addr;
    pl.addr = NULL;
    pl.n_addr = 0;
    kv_node_placement_free(&pl);
    *out = p;
    return 0;
fail:
    kv_node_placement_free(&pl);
    kv_plan_free(p);
    return rc;
}

uint32_t kv_plan_n_nodes(const kv_plan *p) { return p->n_w; }
const char *kv_plan_node_addr(const kv_plan *p, uint32_t i) { return i < p->n_w ? p->addr[i] : ""; }
const char *kv_plan_node_key(const kv_plan *p, uint32_t i) { return i < p->n_w ? p->key[i] : ""; }
bool kv_plan_holds(const kv_plan *p, uint32_t i, uint32_t L, uint32_t e) {
    if (i >= p->n_w || L >= p->m->n_layer || e >= p->m->n_expert) return false;
    const size_t c = (size_t)L * p->m->n_expert + e;
    uint32_t lo = p->hoff[c], hi = p->hoff[c + 1]; /* ascending: a binary search */
    while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2;
        if (p->hw[mid] == i) return true;
        if (p->hw[mid] < i) lo = mid + 1;
        else hi = mid;
    }
    return false;
}

int kv_plan_figures_get(const kv_plan *p, uint32_t enc, kv_plan_figures *f, kv_diag *d) {
    const kv_manifest *m = p->m;
    memset(f, 0, sizeof *f);
    const size_t s = kv_enc_size(enc);
    if (!s) return kv_fail(d, KV_EINVAL, "plan: unknown wire encoding %u", enc);
    const uint32_t k = m->n_expert_used ? m->n_expert_used : 1;
    if (k > KV_PLAN_MAX_K || k > m->n_expert)
        return kv_fail(d, KV_EUNSUPPORTED, "plan: top-k %u is more than the plan handles (%u)", k, KV_PLAN_MAX_K);
    f->top_k = k;
    f->value_bytes = (uint32_t)s;
    for (uint32_t L = 0; L < m->n_layer; L++) {
        if (!m->moe_layer[L]) continue;
        f->n_moe_layers++;
        for (uint32_t e = 0; e < m->n_expert; e++) {
            const size_t c = (size_t)L * m->n_expert + e;
            if (p->hoff[c] == p->hoff[c + 1] && !f->experts_missing++) f->missing_layer = L, f->missing_expert = e;
        }
    }
    const uint64_t E = m->n_embd;
    f->round_trips = f->n_moe_layers;
    f->expert_pairs = (uint64_t)f->n_moe_layers * k;
    /* COMPUTE + RESULT for one token; a v4 RESULT ends with the worker's signature */
    f->bytes_per_message = 2 * KV_PROTO_HEADER + KV_PROTO_COMPUTE_FIXED + KV_PROTO_RESULT_FIXED + KV_PROTO_RESULT_SIG + E * s;
    f->bytes_per_pair = 8 + E * s;
    if (f->experts_missing) return 0;
    uint32_t *ids = calloc(k, sizeof *ids), *load = calloc(p->n_w ? p->n_w : 1, sizeof *load);
    if (!ids || !load) {
        free(ids);
        free(load);
        return kv_fail(d, KV_ENOMEM, "plan: out of memory");
    }
    f->exact = true;
    for (uint32_t L = 0; L < m->n_layer; L++) {
        if (!m->moe_layer[L]) continue;
        kv_plan_layer ls;
        kv_plan_layer_stats(p, L, k, ids, load, &ls);
        f->messages_min += ls.min, f->messages_max += ls.max, f->messages_expected += ls.mean;
        f->exact &= ls.exact;
        f->routings += ls.cases;
    }
    free(ids);
    free(load);
    f->bytes_min = f->messages_min * f->bytes_per_message + f->expert_pairs * f->bytes_per_pair;
    f->bytes_max = f->messages_max * f->bytes_per_message + f->expert_pairs * f->bytes_per_pair;
    f->bytes_expected = f->messages_expected * (double)f->bytes_per_message + (double)(f->expert_pairs * f->bytes_per_pair);
    return 0;
}

/* ---- sites and the predicted time per token --------------------------------- */

void kv_plan_sites_free(kv_plan_sites *s) {
    if (!s) return;
    free(s->node_key);
    free(s->node_site);
    free(s);
}

static int64_t kv_plan_site_find(const kv_plan_sites *s, const char *name) {
    for (uint32_t i = 0; i < s->n_site; i++)
        if (!strcmp(s->name[i], name)) return i;
    return -1;
}

/* A non-negative finite number, or null (-1); anything else is malformed. */
static bool kv_plan_ms(json_t *v, double *out) {
    if (!v || json_is_null(v)) return *out = -1, true;
    if (!json_is_number(v)) return false;
    const double x = json_number_value(v);
    if (!(x >= 0 && x < 1e7)) return false;
    *out = x;
    return true;
}

/* The windows of a "sites" placement: consecutive from 0 to n_layer - 1,
 * over distinct known sites; else s->placed stays false with the reason. */
static void kv_plan_sites_windows(kv_plan_sites *s, json_t *ws, uint32_t n_layer) {
    bool used[KV_PLAN_MAX_SITES] = {0};
    uint32_t next = 0;
    if (!json_is_array(ws) || !json_array_size(ws) || json_array_size(ws) > s->n_site) {
        snprintf(s->reason, sizeof s->reason, "the hub's windows are not 1 to %u entries", s->n_site);
        return;
    }
    for (size_t i = 0; i < json_array_size(ws); i++) {
        json_t *w = json_array_get(ws, i), *js = json_object_get(w, "site"), *jf = json_object_get(w, "first"),
               *jl = json_object_get(w, "last");
        const int64_t si = json_is_string(js) ? kv_plan_site_find(s, json_string_value(js)) : -1;
        if (si < 0 || used[si] || !json_is_integer(jf) || !json_is_integer(jl) || json_integer_value(jf) != next ||
            json_integer_value(jl) < json_integer_value(jf) || json_integer_value(jl) >= n_layer) {
            snprintf(s->reason, sizeof s->reason, "the hub's window %zu is not the next window of a known site", i);
            s->n_win = 0;
            return;
        }
        used[si] = true;
        kv_plan_window *o = &s->win[s->n_win++];
        o->site = (uint32_t)si;
        o->first = next;
        o->last = (uint32_t)json_integer_value(jl);
        o->n_workers = (uint32_t)json_array_size(json_object_get(w, "workers"));
        o->n_ring = (uint32_t)json_array_size(json_object_get(w, "ring"));
        next = o->last + 1;
    }
    if (next != n_layer) {
        snprintf(s->reason, sizeof s->reason, "the hub's windows end at layer %u of %u", next, n_layer);
        s->n_win = 0;
        return;
    }
    s->placed = true;
}

int kv_plan_sites_parse(const char *json, size_t len, uint32_t n_layer, kv_plan_sites **out, kv_diag *d) {
    *out = NULL;
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return kv_fail(d, KV_EFORMAT, "sites: bad JSON at line %d: %s", je.line, je.text);
    kv_plan_sites *s = calloc(1, sizeof *s);
    json_t *js = json_object_get(root, "sites"), *jr = json_object_get(root, "round_trips"),
           *pl = json_object_get(root, "placement");
    int rc = 0;
    if (!s) {
        rc = kv_fail(d, KV_ENOMEM, "sites: out of memory");
        goto done;
    }
    if (!json_is_array(js) || json_array_size(js) > KV_PLAN_MAX_SITES || !json_is_array(jr) || !json_is_object(pl)) {
        rc = kv_fail(d, KV_EFORMAT, "sites: needs 'sites' (at most %u), 'round_trips' and 'placement'", KV_PLAN_MAX_SITES);
        goto done;
    }
    size_t n_node = 0;
    for (size_t i = 0; i < json_array_size(js); i++) {
        json_t *nodes = json_object_get(json_array_get(js, i), "nodes");
        if (json_array_size(nodes) > (1u << 20)) {
            rc = kv_fail(d, KV_ERANGE, "sites: site %zu lists too many nodes", i);
            goto done;
        }
        n_node += json_array_size(nodes);
    }
    s->node_key = calloc(n_node ? n_node : 1, sizeof *s->node_key);
    s->node_site = calloc(n_node ? n_node : 1, sizeof *s->node_site);
    if (!s->node_key || !s->node_site) {
        rc = kv_fail(d, KV_ENOMEM, "sites: out of memory");
        goto done;
    }
    for (uint32_t i = 0; i < KV_PLAN_MAX_SITES; i++)
        for (uint32_t j = 0; j < KV_PLAN_MAX_SITES; j++) s->between_ms[i][j] = -1;
    for (size_t i = 0; i < json_array_size(js); i++) {
        json_t *e = json_array_get(js, i), *jn = json_object_get(e, "name");
        const char *nm = json_is_string(jn) ? json_string_value(jn) : NULL;
        if (!nm || !json_string_length(jn) || json_string_length(jn) >= sizeof s->name[0] ||
            strlen(nm) != json_string_length(jn) || kv_plan_site_find(s, nm) >= 0 ||
            !kv_plan_ms(json_object_get(e, "rtt_ms"), &s->rtt_ms[s->n_site])) {
            rc = kv_fail(d, KV_EFORMAT, "sites: site %zu needs a new name of 1 to %zu bytes and rtt_ms", i,
                         sizeof s->name[0] - 1);
            goto done;
        }
        for (const char *c = nm; *c; c++)
            if (*c < 0x21 || *c > 0x7e) {
                rc = kv_fail(d, KV_EFORMAT, "sites: site %zu's name is not printable", i);
                goto done;
            }
        memcpy(s->name[s->n_site], nm, strlen(nm) + 1);
        json_t *nodes = json_object_get(e, "nodes");
        for (size_t k = 0; k < json_array_size(nodes); k++) {
            json_t *jk = json_object_get(json_array_get(nodes, k), "key");
            if (!json_is_string(jk) || json_string_length(jk) != 64) continue;
            memcpy(s->node_key[s->n_node], json_string_value(jk), 65);
            s->node_site[s->n_node++] = s->n_site;
        }
        s->n_site++;
    }
    for (size_t i = 0; i < json_array_size(jr); i++) {
        json_t *e = json_array_get(jr, i), *ja = json_object_get(e, "a"), *jb = json_object_get(e, "b");
        const int64_t a = json_is_string(ja) ? kv_plan_site_find(s, json_string_value(ja)) : -1;
        const int64_t b = json_is_string(jb) ? kv_plan_site_find(s, json_string_value(jb)) : -1;
        double ms;
        if (a < 0 || b < 0 || a == b || !kv_plan_ms(json_object_get(e, "rtt_ms_max"), &ms)) {
            rc = kv_fail(d, KV_EFORMAT, "sites: round_trips[%zu] needs two known sites and rtt_ms_max", i);
            goto done;
        }
        s->between_ms[a][b] = s->between_ms[b][a] = ms;
    }
    json_t *kind = json_object_get(pl, "kind"), *why = json_object_get(pl, "reason");
    if (json_is_string(kind) && !strcmp(json_string_value(kind), "sites"))
        kv_plan_sites_windows(s, json_object_get(pl, "windows"), n_layer);
    else
        snprintf(s->reason, sizeof s->reason, "%.200s", json_is_string(why) ? json_string_value(why) : "none published");
    for (char *c = s->reason; *c; c++) /* printed as it is */
        if (*c < 0x20 || *c > 0x7e) *c = '?';
done:
    json_decref(root);
    if (rc) kv_plan_sites_free(s);
    else *out = s;
    return rc;
}

double kv_plan_cost_ms(const kv_plan_cost *c) {
    double ser = c->bandwidth_mbit > 0 ? (double)c->wan_bytes * 8.0 / (c->bandwidth_mbit * 1e6) * 1e3 : 0;
    const double line = c->line_ms > 0 ? c->crossings * c->line_ms : 0; /* the path's own pace */
    if (line > ser) ser = line;
    return c->wait_ms + ser + c->compute_ms;
}

/* The round trip between sites a and b as the plan takes it. */
static double kv_plan_between(const kv_plan_sites *s, uint32_t a, uint32_t b, double lan, bool *unmeasured) {
    if (a == b) return lan;
    const double x = s->between_ms[a][b];
    if (x < 0) {
        *unmeasured = true;
        return lan;
    }
    return x;
}

int kv_plan_predict(const kv_plan *p, const kv_plan_sites *s, uint32_t enc, const kv_plan_net *net,
                    kv_plan_prediction *out, kv_diag *d) {
    memset(out, 0, sizeof *out);
    kv_plan_figures f;
    int rc = kv_plan_figures_get(p, enc, &f, d);
    if (rc) return rc;
    if (f.experts_missing)
        return kv_fail(d, KV_ENOTFOUND, "plan: layer %u expert %u has no live holder", f.missing_layer, f.missing_expert);
    const kv_manifest *m = p->m;
    const double lan = net->lan_ms > 0 ? net->lan_ms : 0.5;
    uint32_t from = 0;
    if (net->from_site >= 0 && (uint32_t)net->from_site < s->n_site) from = (uint32_t)net->from_site;
    else if (s->placed && s->n_win) from = s->win[0].site;
    out->from_site = from;
    /* the site of every worker of the plan (by key); UINT32_MAX unknown */
    uint32_t *ws = malloc((p->n_w ? p->n_w : 1) * sizeof *ws);
    if (!ws) return kv_fail(d, KV_ENOMEM, "plan: out of memory");
    for (uint32_t w = 0; w < p->n_w; w++) {
        ws[w] = UINT32_MAX;
        for (uint32_t k = 0; k < s->n_node && p->key[w][0]; k++)
            if (!strcmp(s->node_key[k], p->key[w])) ws[w] = s->node_site[k];
    }
    /* per-layer dispatch: each MoE layer waits for its farthest holder's site */
    const double per_layer_bytes = f.n_moe_layers ? f.bytes_expected / f.n_moe_layers : 0;
    double wan_bytes = 0;
    kv_plan_cost *e = &out->experts;
    for (uint32_t L = 0; L < m->n_layer; L++) {
        if (!m->moe_layer[L]) continue;
        double far = lan;
        bool wan = false;
        for (uint32_t x = 0; x < m->n_expert; x++) {
            const size_t c = (size_t)L * m->n_expert + x;
            for (uint32_t h = p->hoff[c]; h < p->hoff[c + 1]; h++) {
                const uint32_t site = ws[p->hw[h]];
                if (site == UINT32_MAX) {
                    out->unmeasured = true;
                    continue;
                }
                const double r = kv_plan_between(s, from, site, lan, &out->unmeasured);
                if (site != from) wan = true;
                if (r > far) far = r;
            }
        }
        if (wan) e->crossings++, wan_bytes += per_layer_bytes;
        else e->lan_round_trips++;
        e->wait_ms += far;
    }
    free(ws);
    e->wan_bytes = (uint64_t)(wan_bytes + 0.5);
    e->bandwidth_mbit = net->bandwidth_mbit;
    e->compute_ms = net->compute_ms;
    out->experts_ms = kv_plan_cost_ms(e);
    /* the ring of sites: the hidden state goes one way round, once per token */
    if (s->placed && s->n_win) {
        kv_plan_cost *c = &out->sites;
        out->sites_ok = true;
        const size_t hidden = KV_RING_HEADER + kv_ring_hidden_size(1, m->n_embd);
        for (uint32_t w = 0; w < s->n_win && s->n_win > 1; w++) {
            const uint32_t a = s->win[w].site, b = s->win[(w + 1) % s->n_win].site;
            c->crossings++;
            c->wait_ms += kv_plan_between(s, a, b, lan, &out->unmeasured) / 2;
            c->wan_bytes += hidden;
        }
        c->lan_round_trips = f.n_moe_layers;
        c->wait_ms += f.n_moe_layers * lan;
        c->bandwidth_mbit = net->bandwidth_mbit;
        c->compute_ms = net->compute_ms;
        out->sites_ms = kv_plan_cost_ms(c);
    }
    return 0;
}
