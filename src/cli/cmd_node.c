/* kvasir node: join a hub's swarm with a memory budget: choose shards from
 * the market, download and verify them, serve them, register, heartbeat
 * (include/kvasir/node.h, docs/HUB.md). */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "kvasir/beacon.h"
#include "kvasir/hub.h"
#include "kvasir/link.h"
#include "kvasir/transport.h"
#include "kvasir/node.h"

#define CMD "node"

static const char *const kv_value_flags[] = {"--hub", "--budget", "--data", "--listen", "--advertise",
                                             "--interval-ms", "--threads", "-t", "--allow-key", "--beacon-port",
                                             "--beacon-wait-ms", "--model-id", "--relay", "--site", "--layers", NULL};

static const char *kv_node_help =
    "usage: kvasir node [--hub URL] --budget SIZE --data DIR [--listen HOST:PORT] [options]\n"
    "  --hub URL           the hub (http://HOST:PORT, or https://HOST:PORT#sha256=<64 hex> for a\n"
    "                      TLS hub pinned by the fingerprint it prints); without it, the first hub\n"
    "                      heard by its LAN beacon (kvasir hub --beacon) whose /v1/status names\n"
    "                      the same model (a TLS hub's beacon carries its pin)\n"
    "  --beacon-port P     UDP port to hear the beacon on (default 47474)\n"
    "  --beacon-wait-ms MS how long to wait for a beacon (default 10000)\n"
    "  --model-id HEX      only join a hub announcing this model id\n"
    "  --budget SIZE       bytes of slabs to hold: digits with K, M, G or T (powers of 1024)\n"
    "  --data DIR          node key (DIR/node.key, created on first start) and pieces (DIR/pieces/)\n"
    "  --listen HOST:PORT  worker address (default 127.0.0.1:0: a free port, printed)\n"
    "  --advertise H:P     address announced to the hub (default: the bound worker address)\n"
    "  --interval-ms MS    heartbeat and market period (default: the hub's deadline / 3)\n"
    "  --relay auto|always|off  the hub's relay (kvasir hub --relay-port): auto (default) connects\n"
    "                      out to it when the hub says it cannot dial this node's address, always\n"
    "                      as soon as the hub names it, off never; the node then serves through\n"
    "                      one outbound TLS connection to the hub's host (docs/HUB.md \"Relay\")\n"
    "  --site NAME         the site this node is in (1-31 bytes of a-z 0-9 . _ -): nodes of one LAN or\n"
    "                      datacentre; without it the hub groups nodes by the round trips it measures\n"
    "                      (docs/HUB.md \"Sites\")\n"
    "  --layers A-B        take only shards of layers A..B from the market (e.g. the window a site\n"
    "                      should hold; default: any)\n"
    "  --threads N         worker compute threads (default: all CPUs)\n"
    "  --quiet             no log lines\n"
    "  --insecure-plaintext  its worker serves plaintext coordinators from any address (default:\n"
    "                      plaintext only from loopback, TLS 1.3 elsewhere); prints a warning\n"
    "  --allow-key K       also serve coordinator key K (hex, or a file of keys) besides those the\n"
    "                      hub vouches for; repeatable\n"
    "Downloads resume where they stopped; a piece whose SHA-256 differs from the manifest's is\n"
    "deleted and never served. Stops on SIGINT/SIGTERM.\n";

static kv_node *kv_the_node;

static void kv_on_signal(int sig) {
    (void)sig;
    if (kv_the_node) kv_node_stop(kv_the_node);
}

/* A bar on a terminal, one line per piece otherwise. */
static void kv_progress(void *arg, const char *path, uint64_t done, uint64_t total) {
    bool tty = *(bool *)arg;
    if (tty) {
        int w = 30, k = total ? (int)(done * (uint64_t)w / total) : w;
        fprintf(stderr, "\r%-40.40s [%.*s%*s] %3d%%", path, k, "##############################", w - k, "",
                total ? (int)(done * 100 / total) : 100);
        if (done == total) fputc('\n', stderr);
    } else if (done == total) {
        fprintf(stderr, "node: fetched %s (%" PRIu64 " bytes)\n", path, total);
    }
    fflush(stderr);
}

int kv_cmd_node(int argc, char **argv) {
    kv_node_opts o = {0};
    const char *budget = NULL;
    uint8_t(*ak)[32] = NULL;
    size_t n_ak = 0;
    kv_diag ad = {0};
    bool quiet = false;
    long v, beacon_port = KV_BEACON_PORT, beacon_wait = 10000;
    const char *model_id = NULL;
    char beacon_url[KV_BEACON_MAX_URL + 1];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *s;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_node_help, stdout);
            return 0;
        } else if (!strcmp(a, "--quiet")) {
            quiet = true;
        } else if (!strcmp(a, "--insecure-plaintext")) {
            o.insecure_plaintext = true;
            kv_link_warn_plaintext("node");
        } else if (!strncmp(a, "--test-delay=", 13)) {
            /* TEST ONLY, deliberately absent from --help: the node's worker answers every
               COMPUTE late (a slower replica, so that replica choice prefers another) */
            char *end = NULL;
            const long ms = strtol(a + 13, &end, 10);
            if (!a[13] || *end || ms < 0 || ms > 60000) return kv_cli_err(CMD, 1, "--test-delay: '%s' is not MS (0-60000)", a + 13);
            o.test_delay_ms = (int)ms;
            fprintf(stderr, "node: TEST MODE: every COMPUTE waits %ld ms\n", ms);
        } else if (!(s = kv_arg_value(CMD, argc, argv, &i, kv_value_flags))) {
            return 1;
        } else if (!strcmp(a, "--allow-key")) {
            if (kv_key_list_add(s, &ak, &n_ak, &ad)) {
                free(ak);
                return kv_cli_err(CMD, 1, "--allow-key: %s", ad.msg);
            }
        } else if (!strcmp(a, "--hub")) {
            o.hub = s;
        } else if (!strcmp(a, "--relay")) {
            if (!strcmp(s, "auto")) o.relay = KV_NODE_RELAY_AUTO;
            else if (!strcmp(s, "always")) o.relay = KV_NODE_RELAY_ALWAYS;
            else if (!strcmp(s, "off")) o.relay = KV_NODE_RELAY_OFF;
            else return kv_cli_err(CMD, 1, "--relay: '%s' is not auto, always or off", s);
        } else if (!strcmp(a, "--layers")) {
            char *e1, *e2;
            errno = 0;
            const unsigned long lf = strtoul(s, &e1, 10);
            const unsigned long ll = *e1 == '-' ? strtoul(e1 + 1, &e2, 10) : 0;
            if (errno || e1 == s || *e1 != '-' || e2 == e1 + 1 || *e2 || lf > ll || ll > 65535)
                return kv_cli_err(CMD, 1, "--layers: '%s' is not A-B with A <= B <= 65535", s);
            o.has_layers = true;
            o.layer_first = (uint32_t)lf;
            o.layer_last = (uint32_t)ll;
        } else if (!strcmp(a, "--site")) {
            kv_diag sd = {0};
            if (kv_hub_site_check(s, &sd)) return kv_cli_err(CMD, 1, "--site: %s", sd.msg);
            o.site = s;
        } else if (!strcmp(a, "--budget")) {
            budget = s;
        } else if (!strcmp(a, "--data")) {
            o.dir = s;
        } else if (!strcmp(a, "--listen")) {
            o.listen = s;
        } else if (!strcmp(a, "--advertise")) {
            o.advertise = s;
        } else if (!strcmp(a, "--interval-ms")) {
            if (kv_arg_long(CMD, a, s, 10, 600000, &v)) return 1;
            o.interval_ms = (uint32_t)v;
        } else if (!strcmp(a, "--beacon-port")) {
            if (kv_arg_long(CMD, a, s, 1, 65535, &beacon_port)) return 1;
        } else if (!strcmp(a, "--beacon-wait-ms")) {
            if (kv_arg_long(CMD, a, s, 1, 3600000, &beacon_wait)) return 1;
        } else if (!strcmp(a, "--model-id")) {
            if (strlen(s) != 64 || strspn(s, "0123456789abcdef") != 64)
                return kv_cli_err(CMD, 1, "--model-id: '%s' is not 64 lowercase hex digits", s);
            model_id = s;
        } else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) {
            if (kv_arg_long(CMD, a, s, 1, 1024, &v)) return 1;
            o.n_threads = (int)v;
        } else {
            return kv_cli_err(CMD, 1, "unknown option '%s' (see kvasir node --help)", a);
        }
    }
    if (!budget || !o.dir) return kv_cli_err(CMD, 1, "needs --budget and --data (see kvasir node --help)");
    kv_diag d = {0};
    if (kv_node_parse_size(budget, &o.budget, &d)) return kv_cli_err(CMD, 1, "--budget: %s", d.msg);
    if (!o.hub) { /* find one by its LAN beacon */
        if (!quiet) fprintf(stderr, "node: no --hub: listening for a hub beacon on UDP port %ld\n", beacon_port);
        if (kv_beacon_find_hub((uint16_t)beacon_port, (uint32_t)beacon_wait, model_id, beacon_url, sizeof beacon_url, &d))
            return kv_cli_diag(CMD, &d);
        o.hub = beacon_url;
        if (!quiet) fprintf(stderr, "node: joining the hub %s (heard by its beacon)\n", o.hub);
    }
    bool tty = isatty(2);
    o.log = quiet ? NULL : stderr;
    o.progress = quiet ? NULL : kv_progress;
    o.progress_arg = &tty;
    signal(SIGPIPE, SIG_IGN);
    kv_node *n = NULL;
    o.allow_keys = (const uint8_t(*)[32])ak;
    o.n_allow_keys = n_ak;
    if (kv_node_open(&n, &o, &d)) {
        free(ak);
        return kv_cli_diag(CMD, &d);
    }
    kv_the_node = n;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = kv_on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    int rc = kv_node_run(n, &d);
    kv_the_node = NULL;
    kv_node_free(n);
    free(ak);
    return rc ? kv_cli_diag(CMD, &d) : 0;
}
