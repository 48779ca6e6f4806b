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
