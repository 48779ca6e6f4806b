/* kvasir market: print a hub's coverage market (GET /v1/market) as a table,
 * scarcest shard first, or as the hub's JSON. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "kvasir/hub.h"

#define CMD "market"
#define KV_MARKET_MAX_BYTES (256u << 20)

static const char *const kv_value_flags[] = {"--hub", "--limit", "--timeout-ms", NULL};

static const char *kv_market_help =
    "usage: kvasir market --hub URL [--json] [--limit N]\n"
    "  --hub URL         the hub, e.g. http://127.0.0.1:8700, or https://HOST:PORT#sha256=<64 hex>\n"
    "                    for a TLS hub pinned by the fingerprint it prints (docs/HUB.md)\n"
    "  --json            print the hub's JSON as received (after checking it parses)\n"
    "  --limit N         print only the N scarcest shards (default: all)\n"
    "  --timeout-ms MS   give up after MS (default 10000)\n";

int kv_cmd_market(int argc, char **argv) {
    const char *hub = NULL;
    bool json = false;
    long limit = -1, timeout = 10000;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *s;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_market_help, stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = true;
        } else if (!(s = kv_arg_value(CMD, argc, argv, &i, kv_value_flags))) {
            return 1;
        } else if (!strcmp(a, "--hub")) {
            hub = s;
        } else if (!strcmp(a, "--limit")) {
            if (kv_arg_long(CMD, a, s, 0, 1L << 30, &limit)) return 1;
        } else if (!strcmp(a, "--timeout-ms")) {
            if (kv_arg_long(CMD, a, s, 1, 3600000, &timeout)) return 1;
        } else {
            return kv_cli_err(CMD, 1, "unknown option '%s' (see kvasir market --help)", a);
        }
    }
    if (!hub) return kv_cli_err(CMD, 1, "needs --hub URL (see kvasir market --help)");
    size_t hl = strlen(hub);
    if (hl > 2000) return kv_cli_err(CMD, 1, "--hub URL is too long");
    char url[2100];
    snprintf(url, sizeof url, "%.*s/v1/market", (int)(hl && hub[hl - 1] == '/' ? hl - 1 : hl), hub);
    kv_diag d = {0};
    char *body;
    size_t n;
    long status;
    if (kv_hub_http_get(url, KV_MARKET_MAX_BYTES, timeout, &body, &n, &status, &d)) return kv_cli_diag(CMD, &d);
    if (status != 200) {
        int rc = kv_cli_err(CMD, 2, "%s: HTTP %ld: %.300s", url, status, body);
        free(body);
        return rc;
    }
    kv_hub_market m;
    if (kv_hub_parse_market(&m, body, n, &d)) {
        free(body);
        return kv_cli_diag(CMD, &d);
    }
    if (json) {
        fwrite(body, 1, n, stdout);
    } else {
        size_t show = limit < 0 || (size_t)limit > m.n_shards ? m.n_shards : (size_t)limit;
        printf("covered: %s   shards: %zu\n", m.covered ? "yes" : "no", m.n_shards);
        printf("%6s %11s %12s %6s %6s %14s %12s %10s\n", "layer", "experts", "bytes", "wanted", "live", "reward/h",
               "demand/s", "wait ms/s");
        for (size_t i = 0; i < show; i++) {
            const kv_hub_shard_view *s = &m.shards[i];
            char ex[32];
            snprintf(ex, sizeof ex, "%u-%u", s->first, s->last);
            printf("%6u %11s %12" PRIu64 " %6u %6u %14" PRIu64 " %12.1f %10.1f\n", s->layer, ex, s->bytes, s->wanted, s->live,
                   s->reward, s->demand, s->wait_ms);
        }
        if (show < m.n_shards) printf("... %zu more\n", m.n_shards - show);
    }
    kv_hub_market_free(&m);
    free(body);
    return 0;
}
