/* kvasir plan: a hub's placement (which node serves which layer and expert
 * ranges) and what one decoded token costs on the wire.
 *
 * The figures follow the coordinator (src/dispatch/remote.c) and the frame
 * sizes of docs/PROTOCOL.md. One token of one sequence, per MoE layer:
 *   - one request round: every worker that holds one of the token's top-k
 *     experts gets one COMPUTE, all sent at once, so a token costs one
 *     round trip per MoE layer, whatever the number of workers;
 *   - k expert computations (pairs);
 *   - one COMPUTE (16 + 20 + n_embd s + 8 per pair bytes) and one RESULT
 *     (16 + 12 + n_embd s per pair) per worker contacted, s the bytes per
 *     value of the wire encoding. So a token costs
 *       messages x (64 + n_embd s) + pairs x (8 + n_embd s)
 *     bytes, and only the number of messages depends on the routing.
 * Which worker gets an expert is the coordinator's rule: the live holder
 * with the fewest pairs so far in the round, ties broken by a rotation
 * keyed on (layer, expert) over the workers in placement order (first seen
 * in /v1/placement, the order `run --hub` dials them). The plan runs that
 * rule over every ordered choice of k distinct experts (uniform routing)
 * when n_expert^k is at most KV_PLAN_ENUM, else over
 * KV_PLAN_SAMPLES seeded draws, and reports the least, the most and the
 * mean number of messages. Everything read from the hub is bounded and
 * checked before use. */
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "kvasir/dispatch.h"
#include "kvasir/hub.h"
#include "kvasir/node.h"
#include "kvasir/slice.h"

#define CMD "plan"
#define KV_PLAN_ENUM 4000000u    /* n_expert^k steps of the enumeration per layer, at most */
#define KV_PLAN_SAMPLES 100000u  /* draws per layer otherwise */
#define KV_PLAN_MAX_K 64u        /* top-k the simulation handles */

static const char *const kv_value_flags[] = {"--hub", "--wire", "--timeout-ms", NULL};

static const char *kv_plan_help =
    "usage: kvasir plan --hub URL [--json] [--wire f32|f16|bf16]\n"
    "  --hub URL         the hub, e.g. http://127.0.0.1:8700\n"
    "  --json            one JSON object instead of the table\n"
    "  --wire ENC        encoding of hidden states and outputs on the wire (default f32)\n"
    "  --timeout-ms MS   give up after MS (default 10000)\n"
    "Prints which node serves which layer and expert ranges, and for one token of one sequence:\n"
    "round trips (one per MoE layer), expert computations, messages and bytes on the wire.\n";

/* The placement, as the coordinator would use it. */
typedef struct kv_plan {
    const kv_manifest *m;
    uint32_t n_w;        /* workers, in placement order */
    char **addr;         /* [n_w] */
    char (*key)[65];     /* [n_w] hex public key ("" if the hub gave none) */
    uint8_t *holds;      /* [n_w][n_layer][n_expert] */
    uint32_t *hoff;      /* [n_layer * n_expert + 1]: holders of (L, e) are hw[hoff[i] .. hoff[i+1]) */
    uint32_t *hw;        /* worker indices, ascending per (L, e) */
} kv_plan;

static uint8_t *kv_plan_at(const kv_plan *p, uint32_t w, uint32_t L, uint32_t e) {
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

int kv_cmd_plan(int argc, char **argv) {
    const char *hub = NULL;
    bool js = false;
    long timeout = 10000;
    int wire = KV_ENC_F32;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *s;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_plan_help, stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            js = true;
        } else if (!(s = kv_arg_value(CMD, argc, argv, &i, kv_value_flags))) {
            return 1;
        } else if (!strcmp(a, "--hub")) {
            hub = s;
        } else if (!strcmp(a, "--wire")) {
            if ((wire = kv_enc_from_name(s)) < 0) return kv_cli_err(CMD, 1, "--wire: '%s' is not one of f32, f16, bf16", s);
        } else if (kv_arg_long(CMD, a, s, 1, 3600000, &timeout)) {
            return 1;
        }
    }
    if (!hub) return kv_cli_err(CMD, 1, "needs --hub URL (see kvasir plan --help)");
    size_t hl = strlen(hub);
    if (hl > 1000) return kv_cli_err(CMD, 1, "--hub URL is too long");
    if (hl && hub[hl - 1] == '/') hl--;
    char url[1100], *body = NULL, *pbody = NULL;
    size_t n = 0, pn = 0;
    long st = 0;
    kv_diag d = {0};
    kv_manifest *m = NULL;
    kv_plan p = {0};
    int rc = 2;
    uint32_t *ids = NULL, *load = NULL;
    snprintf(url, sizeof url, "%.*s/v1/manifest", (int)hl, hub);
    if (kv_hub_http_get(url, KV_MANIFEST_MAX_BYTES, timeout, &body, &n, &st, &d)) return kv_cli_diag(CMD, &d);
    if (st != 200) {
        rc = kv_cli_err(CMD, 2, "%s: HTTP %ld", url, st);
        goto done;
    }
    if (kv_manifest_parse(&m, body, n, &d)) {
        rc = kv_cli_diag(CMD, &d);
        goto done;
    }
    snprintf(url, sizeof url, "%.*s/v1/placement", (int)hl, hub);
    if (kv_hub_http_get(url, KV_NODE_MAX_MARKET, timeout, &pbody, &pn, &st, &d)) {
        rc = kv_cli_diag(CMD, &d);
        goto done;
    }
    if (st != 200) {
        rc = kv_cli_err(CMD, 2, "%s: HTTP %ld", url, st);
        goto done;
    }
    p.m = m;
    if (kv_node_parse_placement(pbody, pn, &p.addr, &p.n_w, &d)) {
        rc = kv_cli_diag(CMD, &d);
        goto done;
    }
    const uint32_t k = m->n_expert_used ? m->n_expert_used : 1;
    if (k > KV_PLAN_MAX_K || k > m->n_expert) {
        rc = kv_cli_err(CMD, 2, "top-k %u is more than this plan handles (%u)", k, KV_PLAN_MAX_K);
        goto done;
    }
    p.key = calloc(p.n_w ? p.n_w : 1, sizeof *p.key);
    p.holds = calloc((size_t)(p.n_w ? p.n_w : 1) * m->n_layer * m->n_expert, 1);
    ids = calloc(k, sizeof *ids);
    load = calloc(p.n_w ? p.n_w : 1, sizeof *load);
    if (!p.key || !p.holds || !ids || !load) {
        rc = kv_cli_err(CMD, 2, "out of memory");
        goto done;
    }
    if (kv_plan_parse(&p, pbody, pn, &d)) {
        rc = kv_cli_diag(CMD, &d);
        goto done;
    }
    if (kv_plan_index(&p)) {
        rc = kv_cli_err(CMD, 2, "out of memory");
        goto done;
    }
    /* coverage: every expert of every MoE layer has a holder */
    uint32_t n_moe = 0, missing = 0, miss_L = 0, miss_e = 0;
    for (uint32_t L = 0; L < m->n_layer; L++) {
        if (!m->moe_layer[L]) continue;
        n_moe++;
        for (uint32_t e = 0; e < m->n_expert; e++) {
            bool held = false;
            for (uint32_t w = 0; w < p.n_w && !held; w++) held = *kv_plan_at(&p, w, L, e);
            if (!held && !missing++) miss_L = L, miss_e = e;
        }
    }
    /* per layer: messages over the routings */
    uint32_t mmin = 0, mmax = 0;
    double mmean = 0;
    bool exact = true;
    uint64_t cases = 0;
    for (uint32_t L = 0; L < m->n_layer && !missing; L++) {
        if (!m->moe_layer[L]) continue;
        kv_plan_layer ls;
        kv_plan_layer_stats(&p, L, k, ids, load, &ls);
        mmin += ls.min, mmax += ls.max, mmean += ls.mean;
        exact &= ls.exact;
        cases += ls.cases;
    }
    const uint64_t s = kv_enc_size((uint32_t)wire), E = m->n_embd;
    const uint64_t per_msg = 2 * KV_PROTO_HEADER + 20 + 12 + E * s; /* COMPUTE + RESULT, one token */
    const uint64_t per_pair = 8 + E * s;
    const uint64_t pairs = (uint64_t)n_moe * k;
    if (js) {
        json_t *nodes = json_array();
        for (uint32_t w = 0; w < p.n_w; w++) {
            json_t *ranges = json_array();
            uint64_t ex = 0;
            for (uint32_t L = 0; L < m->n_layer; L++)
                for (uint32_t e = 0; e < m->n_expert; e++) {
                    if (!*kv_plan_at(&p, w, L, e)) continue;
                    uint32_t f = e;
                    while (e + 1 < m->n_expert && *kv_plan_at(&p, w, L, e + 1)) e++;
                    json_array_append_new(ranges, json_pack("{s:i, s:i, s:i}", "layer", (int)L, "first", (int)f, "last", (int)e));
                    ex += e - f + 1;
                }
            json_array_append_new(nodes, json_pack("{s:s, s:s, s:I, s:o}", "addr", p.addr[w], "key", p.key[w], "experts",
                                                   (json_int_t)ex, "ranges", ranges));
        }
        json_t *root = json_pack("{s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:s, s:i, s:b, s:i, s:o}", "model_id", m->model_id,
                                 "arch", m->arch, "n_layer", (int)m->n_layer, "n_moe_layers", (int)n_moe, "n_embd",
                                 (int)m->n_embd, "n_expert", (int)m->n_expert, "n_expert_used", (int)k, "wire",
                                 kv_enc_name((uint32_t)wire), "wire_value_bytes", (int)s, "covered", !missing,
                                 "experts_missing", (int)missing, "nodes", nodes);
        if (!missing)
            json_object_set_new(root, "per_token", json_pack("{s:i, s:I, s:i, s:i, s:f, s:b, s:I, s:I, s:I, s:I, s:I, s:f}",
                "round_trips", (int)n_moe, "expert_pairs", (json_int_t)pairs, "messages_min", (int)mmin,
                "messages_max", (int)mmax, "messages_expected", mmean, "exact", exact, "routings", (json_int_t)cases,
                "bytes_per_message", (json_int_t)per_msg, "bytes_per_pair", (json_int_t)per_pair,
                "bytes_min", (json_int_t)(mmin * per_msg + pairs * per_pair),
                "bytes_max", (json_int_t)(mmax * per_msg + pairs * per_pair),
                "bytes_expected", mmean * (double)per_msg + (double)(pairs * per_pair)));
        char *t = json_dumps(root, JSON_COMPACT);
        puts(t ? t : "{}");
        free(t);
        json_decref(root);
    } else {
        printf("model %.16s (%s): %u layers (%u MoE), embd %u, %u experts (top-%u), wire %s\n", m->model_id, m->arch,
               m->n_layer, n_moe, m->n_embd, m->n_expert, k, kv_enc_name((uint32_t)wire));
        printf("placement (%u nodes, in the order a coordinator dials them):\n", p.n_w);
        for (uint32_t w = 0; w < p.n_w; w++) {
            printf("  %-22s %.16s ", p.addr[w], p.key[w][0] ? p.key[w] : "-");
            int32_t lastL = -1;
            for (uint32_t L = 0; L < m->n_layer; L++)
                for (uint32_t e = 0; e < m->n_expert; e++) {
                    if (!*kv_plan_at(&p, w, L, e)) continue;
                    uint32_t f = e;
                    while (e + 1 < m->n_expert && *kv_plan_at(&p, w, L, e + 1)) e++;
                    if ((int32_t)L != lastL) printf("%s L%u:", lastL < 0 ? "" : ";", L);
                    else printf(",");
                    if (f == e) printf("%u", f);
                    else printf("%u-%u", f, e);
                    lastL = (int32_t)L;
                }
            printf("\n");
        }
        if (missing) {
            printf("NOT covered: %u experts have no live holder (first: layer %u expert %u); a decode would fail\n",
                   missing, miss_L, miss_e);
        } else {
            printf("per token (one sequence decoding):\n");
            printf("  round trips          %u (one per MoE layer: each layer's messages go out at once)\n", n_moe);
            printf("  expert computations  %" PRIu64 " (top-%u x %u MoE layers)\n", pairs, k, n_moe);
            printf("  messages             %u to %u, %.2f expected (%s over %" PRIu64 " routings)\n", mmin, mmax, mmean,
                   exact ? "exact, uniform routing" : "sampled, uniform routing", cases);
            printf("  bytes on the wire    %" PRIu64 " to %" PRIu64 ", %.0f expected (%" PRIu64 " per message + %" PRIu64
                   " per expert computation)\n", mmin * per_msg + pairs * per_pair, mmax * per_msg + pairs * per_pair,
                   mmean * (double)per_msg + (double)(pairs * per_pair), per_msg, per_pair);
        }
    }
    rc = missing ? 2 : 0;
done:
    free(ids);
    free(load);
    free(p.key);
    free(p.holds);
    free(p.hoff);
    free(p.hw);
    kv_node_workers_free(p.addr, p.n_w);
    kv_manifest_free(m);
    free(body);
    free(pbody);
    return rc;
}
