/* The plan (include/kvasir/plan.h): the placement map as the coordinator
 * reads it, and a simulation of the coordinator's expert assignment
 * (src/dispatch/remote.c kv_remote_pick) over the routings of one token.
 * The placement is untrusted: every layer, expert range, address and key is
 * checked before it is stored; the simulation visits only each expert's
 * holders, so its cost does not grow with the number of nodes. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/dispatch.h"
#include "kvasir/node.h"
#include "kvasir/plan.h"

struct kv_plan {
    const kv_manifest *m;
    uint32_t n_w;        /* workers, in placement order */
    char **addr;         /* [n_w] */
    char (*key)[65];     /* [n_w] hex public key ("" if the hub gave none) */
    uint8_t *holds;      /* [n_w][n_layer][n_expert] */
    uint32_t *hoff;      /* [n_layer * n_expert + 1]: holders of (L, e) are hw[hoff[i] .. hoff[i+1]) */
    uint32_t *hw;        /* worker indices, ascending per (L, e) */
};

static inline uint8_t *kv_plan_at(const kv_plan *p, uint32_t w, uint32_t L, uint32_t e) {
    return &p->holds[((size_t)w * p->m->n_layer + L) * p->m->n_expert + e];
}

/* Reads the holdings of every worker from the placement JSON. */
static int kv_plan_parse(kv_plan *p, const char *body, size_t len, kv_diag *d) {
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return kv_fail(d, KV_EFORMAT, "placement: bad JSON at line %d: %s", je.line, je.text);
    int rc = 0;
    json_t *sh = json_object_get(root, "shards");
    for (size_t i = 0; i < json_array_size(sh); i++) {
        json_t *s = json_array_get(sh, i);
        json_t *jl = json_object_get(s, "layer"), *jf = json_object_get(s, "first"), *jt = json_object_get(s, "last");
        if (!json_is_integer(jl) || !json_is_integer(jf) || !json_is_integer(jt)) {
            rc = kv_fail(d, KV_EFORMAT, "placement: shards[%zu] needs integer layer, first, last", i);
            break;
        }
        const json_int_t L = json_integer_value(jl), F = json_integer_value(jf), T = json_integer_value(jt);
        if (L < 0 || L >= p->m->n_layer || F < 0 || F > T || T >= p->m->n_expert) {
            rc = kv_fail(d, KV_ERANGE, "placement: shards[%zu]: layer %" JSON_INTEGER_FORMAT " experts %" JSON_INTEGER_FORMAT
                         "-%" JSON_INTEGER_FORMAT " outside the model (%u layers, %u experts)", i, L, F, T,
                         p->m->n_layer, p->m->n_expert);
            break;
        }
        json_t *nodes = json_object_get(s, "nodes");
        for (size_t j = 0; j < json_array_size(nodes); j++) {
            json_t *nd = json_array_get(nodes, j);
            const char *a = json_string_value(json_object_get(nd, "addr"));
            const char *k = json_string_value(json_object_get(nd, "key"));
            uint32_t w = 0;
            while (w < p->n_w && (!a || strcmp(p->addr[w], a))) w++;
            if (w == p->n_w) { /* the placement parser accepted every address: cannot happen */
                rc = kv_fail(d, KV_EFORMAT, "placement: shards[%zu].nodes[%zu]: unknown address", i, j);
                break;
            }
            if (k && strlen(k) == 64 && strspn(k, "0123456789abcdef") == 64) memcpy(p->key[w], k, 65);
            for (json_int_t e = F; e <= T; e++) *kv_plan_at(p, w, (uint32_t)L, (uint32_t)e) = 1;
        }
        if (rc) break;
    }
    json_decref(root);
    return rc;
}

/* Holder lists from the bitmap (the simulation visits only holders). */
static int kv_plan_index(kv_plan *p) {
    const size_t n = (size_t)p->m->n_layer * p->m->n_expert;
    size_t total = 0;
    if (!(p->hoff = calloc(n + 1, sizeof *p->hoff))) return KV_ENOMEM;
    for (size_t i = 0; i < n; i++) {
        p->hoff[i] = (uint32_t)total;
        for (uint32_t w = 0; w < p->n_w; w++) total += p->holds[(size_t)w * n + i];
    }
    p->hoff[n] = (uint32_t)total;
    if (!(p->hw = calloc(total ? total : 1, sizeof *p->hw))) return KV_ENOMEM;
    for (size_t i = 0, o = 0; i < n; i++)
        for (uint32_t w = 0; w < p->n_w; w++)
            if (p->holds[(size_t)w * n + i]) p->hw[o++] = w;
    return 0;
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
    free(p->holds);
    free(p->hoff);
    free(p->hw);
    free(p);
}

int kv_plan_open(kv_plan **out, const kv_manifest *m, const char *placement, size_t len, kv_diag *d) {
    *out = NULL;
    kv_plan *p = calloc(1, sizeof *p);
    if (!p) return kv_fail(d, KV_ENOMEM, "plan: out of memory");
    p->m = m;
    int rc = kv_node_parse_placement(placement, len, &p->addr, &p->n_w, d);
    if (rc) goto fail;
    const size_t cells = (size_t)m->n_layer * m->n_expert;
    p->key = calloc(p->n_w ? p->n_w : 1, sizeof *p->key);
    p->holds = calloc((size_t)(p->n_w ? p->n_w : 1) * cells, 1);
    if (!p->key || !p->holds) {
        rc = kv_fail(d, KV_ENOMEM, "plan: out of memory");
        goto fail;
    }
    if ((rc = kv_plan_parse(p, placement, len, d))) goto fail;
    if ((rc = kv_plan_index(p))) {
        rc = kv_fail(d, KV_ENOMEM, "plan: out of memory");
        goto fail;
    }
    *out = p;
    return 0;
fail:
    kv_plan_free(p);
    return rc;
}

uint32_t kv_plan_n_nodes(const kv_plan *p) { return p->n_w; }
const char *kv_plan_node_addr(const kv_plan *p, uint32_t i) { return i < p->n_w ? p->addr[i] : ""; }
const char *kv_plan_node_key(const kv_plan *p, uint32_t i) { return i < p->n_w ? p->key[i] : ""; }
bool kv_plan_holds(const kv_plan *p, uint32_t i, uint32_t L, uint32_t e) {
    return i < p->n_w && L < p->m->n_layer && e < p->m->n_expert && *kv_plan_at(p, i, L, e);
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
    f->bytes_per_message = 2 * KV_PROTO_HEADER + 20 + 12 + E * s; /* COMPUTE + RESULT, one token */
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
