/* kvasir plan: a hub's placement (which node serves which layer and expert
 * ranges) and what one decoded token costs on the wire: round trips,
 * expert computations, messages and bytes. The model of the coordinator
 * behind the figures is include/kvasir/plan.h; this file fetches the
 * manifest and the placement map and prints. */
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "kvasir/dispatch_proto.h"
#include "kvasir/hub.h"
#include "kvasir/node.h"
#include "kvasir/plan.h"
#include "kvasir/slice.h"

#define CMD "plan"

static const char *const kv_value_flags[] = {"--hub", "--wire", "--timeout-ms", "--lan-ms", "--bandwidth-mbit",
                                             "--compute-ms", "--from-site", NULL};

static const char *kv_plan_help =
    "usage: kvasir plan --hub URL [--json] [--wire f32|f16|bf16]\n"
    "  --hub URL         the hub, e.g. http://127.0.0.1:8700, or https://HOST:PORT#sha256=<64 hex>\n"
    "                    for a TLS hub pinned by the fingerprint it prints (docs/HUB.md)\n"
    "  --json            one JSON object instead of the table\n"
    "  --wire ENC        encoding of hidden states and outputs on the wire (default f32)\n"
    "  --timeout-ms MS   give up after MS (default 10000)\n"
    "  --lan-ms MS       the cost model's round trip inside a site (default 0.5)\n"
    "  --bandwidth-mbit R  the link between sites, Mbit/s (default 0: unlimited)\n"
    "  --compute-ms MS   compute per token, every layer together (default 0)\n"
    "  --from-site NAME  the coordinator's site for per-layer dispatch (default: the first window's)\n"
    "Prints which node serves which layer and expert ranges, and for one token of one sequence:\n"
    "round trips (one per MoE layer), expert computations, messages and bytes on the wire; the\n"
    "sites, the round trips between them, the placement in force, and the predicted time per\n"
    "token with it and with plain per-layer dispatch (docs/HUB.md \"Sites\").\n";

/* A number of milliseconds or Mbit/s in [0, hi]. */
static int kv_plan_arg_ms(const char *flag, const char *s, double hi, double *out) {
    char *e;
    const double v = strtod(s, &e);
    if (e == s || *e || !(v >= 0 && v <= hi)) return kv_cli_err(CMD, 1, "%s: '%s' is not a number in [0, %g]", flag, s, hi);
    *out = v;
    return 0;
}

/* The sites part of the table: sites, round trips, placement, predictions. */
static void kv_plan_print_sites(const kv_plan_sites *s, const kv_plan_prediction *pr, const kv_plan_net *net) {
    printf("sites (%u; round trips measured by the hub):\n", s->n_site);
    for (uint32_t i = 0; i < s->n_site; i++) {
        uint32_t n = 0;
        for (uint32_t k = 0; k < s->n_node; k++) n += s->node_site[k] == i;
        if (s->rtt_ms[i] >= 0) printf("  %-24s %3u nodes, hub round trip %.2f ms\n", s->name[i], n, s->rtt_ms[i]);
        else printf("  %-24s %3u nodes, hub round trip not measured yet\n", s->name[i], n);
    }
    for (uint32_t i = 0; i < s->n_site; i++)
        for (uint32_t j = i + 1; j < s->n_site; j++) {
            if (s->between_ms[i][j] >= 0)
                printf("  %s <-> %s: at most %.2f ms (through the hub)\n", s->name[i], s->name[j], s->between_ms[i][j]);
            else
                printf("  %s <-> %s: not measured\n", s->name[i], s->name[j]);
        }
    if (s->placed) {
        printf("placement in force: a ring of %u sites\n", s->n_win);
        for (uint32_t w = 0; w < s->n_win; w++)
            printf("  layers %u-%u at %s (%u workers, %u ring nodes)\n", s->win[w].first, s->win[w].last,
                   s->name[s->win[w].site], s->win[w].n_workers, s->win[w].n_ring);
    } else {
        printf("placement in force: per-layer dispatch (no site placement: %s)\n", s->reason);
    }
    printf("predicted time per token (lan %.2f ms, link %s, compute %.2f ms%s):\n", net->lan_ms > 0 ? net->lan_ms : 0.5,
           net->bandwidth_mbit > 0 ? "limited" : "unlimited", net->compute_ms,
           pr->unmeasured ? "; some round trips unmeasured, taken as lan" : "");
    if (pr->sites_ok)
        printf("  ring of sites        %8.2f ms (%u site crossings, %u round trips inside sites, %" PRIu64 " WAN bytes)\n",
               pr->sites_ms, pr->sites.crossings, pr->sites.lan_round_trips, pr->sites.wan_bytes);
    printf("  per-layer dispatch   %8.2f ms (from %s: %u round trips across sites, %u inside, %" PRIu64 " WAN bytes)\n",
           pr->experts_ms, s->n_site ? s->name[pr->from_site] : "-", pr->experts.crossings,
           pr->experts.lan_round_trips, pr->experts.wan_bytes);
}

int kv_cmd_plan(int argc, char **argv) {
    const char *hub = NULL;
    bool js = false;
    long timeout = 10000;
    int wire = KV_ENC_F32;
    kv_plan_net net = {.from_site = -1};
    const char *from_site = NULL;
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
        } else if (!strcmp(a, "--lan-ms")) {
            if (kv_plan_arg_ms(a, s, 60000, &net.lan_ms)) return 1;
        } else if (!strcmp(a, "--compute-ms")) {
            if (kv_plan_arg_ms(a, s, 3600000, &net.compute_ms)) return 1;
        } else if (!strcmp(a, "--bandwidth-mbit")) {
            if (kv_plan_arg_ms(a, s, 1e7, &net.bandwidth_mbit)) return 1;
        } else if (!strcmp(a, "--from-site")) {
            if (strlen(s) > 47) return kv_cli_err(CMD, 1, "--from-site: a site name is at most 47 bytes");
            from_site = s;
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
    char url[1100], *body = NULL, *pbody = NULL, *sbody = NULL;
    size_t n = 0, pn = 0, sn = 0;
    kv_plan_sites *sites = NULL;
    kv_plan_prediction pr = {0};
    long st = 0;
    kv_diag d = {0};
    kv_manifest *m = NULL;
    kv_plan *p = NULL;
    kv_plan_figures f;
    int rc = 2;
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
    if (kv_plan_open(&p, m, pbody, pn, &d) || kv_plan_figures_get(p, (uint32_t)wire, &f, &d)) {
        rc = kv_cli_diag(CMD, &d);
        goto done;
    }
    /* the sites (a hub before sites answers 404: none) */
    snprintf(url, sizeof url, "%.*s/v1/sites", (int)hl, hub);
    if (kv_hub_http_get(url, KV_NODE_MAX_MARKET, timeout, &sbody, &sn, &st, &d)) {
        rc = kv_cli_diag(CMD, &d);
        goto done;
    }
    if (st == 200 && kv_plan_sites_parse(sbody, sn, m->n_layer - m->n_layer_nextn, &sites, &d)) {
        rc = kv_cli_diag(CMD, &d);
        goto done;
    }
    if (sites && from_site) {
        for (uint32_t i = 0; i < sites->n_site; i++)
            if (!strcmp(sites->name[i], from_site)) net.from_site = (int32_t)i;
        if (net.from_site < 0) {
            rc = kv_cli_err(CMD, 1, "--from-site: no site '%s' at the hub", from_site);
            goto done;
        }
    }
    if (sites && !f.experts_missing && kv_plan_predict(p, sites, (uint32_t)wire, &net, &pr, &d)) {
        rc = kv_cli_diag(CMD, &d);
        goto done;
    }
    const uint32_t n_w = kv_plan_n_nodes(p);
    if (js) {
        json_t *nodes = json_array();
        for (uint32_t w = 0; w < n_w; w++) {
            json_t *ranges = json_array();
            uint64_t ex = 0;
            for (uint32_t L = 0; L < m->n_layer; L++)
                for (uint32_t e = 0; e < m->n_expert; e++) {
                    if (!kv_plan_holds(p, w, L, e)) continue;
                    uint32_t first = e;
                    while (kv_plan_holds(p, w, L, e + 1)) e++;
                    json_array_append_new(ranges, json_pack("{s:i, s:i, s:i}", "layer", (int)L, "first", (int)first, "last", (int)e));
                    ex += e - first + 1;
                }
            json_array_append_new(nodes, json_pack("{s:s, s:s, s:I, s:o}", "addr", kv_plan_node_addr(p, w), "key",
                                                   kv_plan_node_key(p, w), "experts", (json_int_t)ex, "ranges", ranges));
        }
        json_t *root = json_pack("{s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:s, s:i, s:b, s:i, s:o}", "model_id", m->model_id,
                                 "arch", m->arch, "n_layer", (int)m->n_layer, "n_moe_layers", (int)f.n_moe_layers, "n_embd",
                                 (int)m->n_embd, "n_expert", (int)m->n_expert, "n_expert_used", (int)f.top_k, "wire",
                                 kv_enc_name((uint32_t)wire), "wire_value_bytes", (int)f.value_bytes, "covered",
                                 !f.experts_missing, "experts_missing", (int)f.experts_missing, "nodes", nodes);
        if (!f.experts_missing)
            json_object_set_new(root, "per_token", json_pack("{s:i, s:I, s:i, s:i, s:f, s:b, s:I, s:I, s:I, s:I, s:I, s:f}",
                "round_trips", (int)f.round_trips, "expert_pairs", (json_int_t)f.expert_pairs, "messages_min",
                (int)f.messages_min, "messages_max", (int)f.messages_max, "messages_expected", f.messages_expected,
                "exact", f.exact, "routings", (json_int_t)f.routings, "bytes_per_message", (json_int_t)f.bytes_per_message,
                "bytes_per_pair", (json_int_t)f.bytes_per_pair, "bytes_min", (json_int_t)f.bytes_min,
                "bytes_max", (json_int_t)f.bytes_max, "bytes_expected", f.bytes_expected));
        if (sites) {
            json_t *js = json_array(), *jw = json_array();
            for (uint32_t i = 0; i < sites->n_site; i++) {
                json_t *o = json_pack("{s:s}", "name", sites->name[i]);
                json_object_set_new(o, "rtt_ms", sites->rtt_ms[i] >= 0 ? json_real(sites->rtt_ms[i]) : json_null());
                json_array_append_new(js, o);
            }
            for (uint32_t w = 0; w < sites->n_win; w++)
                json_array_append_new(jw, json_pack("{s:s, s:i, s:i}", "site", sites->name[sites->win[w].site], "first",
                                                    (int)sites->win[w].first, "last", (int)sites->win[w].last));
            json_object_set_new(root, "sites", js);
            json_object_set_new(root, "placement", json_pack("{s:s, s:o, s:s}", "kind", sites->placed ? "sites" : "experts",
                                                             "windows", jw, "reason", sites->reason));
            if (!f.experts_missing) {
                json_t *o = json_pack("{s:f, s:i, s:f, s:I, s:b}", "experts_ms", pr.experts_ms, "experts_crossings",
                                      (int)pr.experts.crossings, "experts_wait_ms", pr.experts.wait_ms,
                                      "experts_wan_bytes", (json_int_t)pr.experts.wan_bytes, "unmeasured", pr.unmeasured);
                if (pr.sites_ok) {
                    json_object_set_new(o, "sites_ms", json_real(pr.sites_ms));
                    json_object_set_new(o, "sites_crossings", json_integer(pr.sites.crossings));
                    json_object_set_new(o, "sites_wan_bytes", json_integer((json_int_t)pr.sites.wan_bytes));
                }
                json_object_set_new(root, "predicted", o);
            }
        }
        char *t = json_dumps(root, JSON_COMPACT);
        puts(t ? t : "{}");
        free(t);
        json_decref(root);
    } else {
        printf("model %.16s (%s): %u layers (%u MoE), embd %u, %u experts (top-%u), wire %s\n", m->model_id, m->arch,
               m->n_layer, f.n_moe_layers, m->n_embd, m->n_expert, f.top_k, kv_enc_name((uint32_t)wire));
        printf("placement (%u nodes, in the order a coordinator dials them):\n", n_w);
        for (uint32_t w = 0; w < n_w; w++) {
            const char *key = kv_plan_node_key(p, w);
            printf("  %-22s %.16s ", kv_plan_node_addr(p, w), key[0] ? key : "-");
            int64_t lastL = -1;
            for (uint32_t L = 0; L < m->n_layer; L++)
                for (uint32_t e = 0; e < m->n_expert; e++) {
                    if (!kv_plan_holds(p, w, L, e)) continue;
                    uint32_t first = e;
                    while (kv_plan_holds(p, w, L, e + 1)) e++;
                    if ((int64_t)L != lastL) printf("%s L%u:", lastL < 0 ? "" : ";", L);
                    else printf(",");
                    if (first == e) printf("%u", first);
                    else printf("%u-%u", first, e);
                    lastL = L;
                }
            printf("\n");
        }
        if (f.experts_missing) {
            printf("NOT covered: %u experts have no live holder (first: layer %u expert %u); a decode would fail\n",
                   f.experts_missing, f.missing_layer, f.missing_expert);
        } else {
            printf("per token (one sequence decoding):\n");
            printf("  round trips          %u (one per MoE layer: each layer's messages go out at once)\n", f.round_trips);
            printf("  expert computations  %" PRIu64 " (top-%u x %u MoE layers)\n", f.expert_pairs, f.top_k, f.n_moe_layers);
            printf("  messages             %u to %u, %.2f expected (%s over %" PRIu64 " routings)\n", f.messages_min,
                   f.messages_max, f.messages_expected, f.exact ? "exact, uniform routing" : "sampled, uniform routing",
                   f.routings);
            printf("  bytes on the wire    %" PRIu64 " to %" PRIu64 ", %.0f expected (%" PRIu64 " per message + %" PRIu64
                   " per expert computation)\n", f.bytes_min, f.bytes_max, f.bytes_expected, f.bytes_per_message,
                   f.bytes_per_pair);
        }
        if (sites && !f.experts_missing) kv_plan_print_sites(sites, &pr, &net);
        else if (!sites) printf("sites: the hub publishes none (GET /v1/sites: HTTP %ld)\n", st);
    }
    rc = f.experts_missing ? 2 : 0;
done:
    kv_plan_free(p);
    kv_plan_sites_free(sites);
    kv_manifest_free(m);
    free(body);
    free(pbody);
    free(sbody);
    return rc;
}
