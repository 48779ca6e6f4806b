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

static const char *const kv_value_flags[] = {"--hub", "--wire", "--timeout-ms", NULL};

static const char *kv_plan_help =
    "usage: kvasir plan --hub URL [--json] [--wire f32|f16|bf16]\n"
    "  --hub URL         the hub, e.g. http://127.0.0.1:8700, or https://HOST:PORT#sha256=<64 hex>\n"
    "                    for a TLS hub pinned by the fingerprint it prints (docs/HUB.md)\n"
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
    }
    rc = f.experts_missing ? 2 : 0;
done:
    kv_plan_free(p);
    kv_manifest_free(m);
    free(body);
    free(pbody);
    return rc;
}
