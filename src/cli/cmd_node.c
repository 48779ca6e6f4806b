/* kvasir node: join a hub's swarm with a memory budget: choose shards from
 * the market, download and verify them, serve them, register, heartbeat
 * (include/kvasir/node.h, docs/HUB.md). */
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "kvasir/dispatch.h"
#include "kvasir/node.h"

#define CMD "node"

static const char *const kv_value_flags[] = {"--hub", "--budget", "--data", "--listen", "--advertise",
                                             "--interval-ms", "--threads", "-t", "--allow-key", NULL};

static const char *kv_node_help =
    "usage: kvasir node --hub URL --budget SIZE --data DIR [--listen HOST:PORT] [options]\n"
    "  --hub URL           the hub (http://HOST:PORT)\n"
    "  --budget SIZE       bytes of slabs to hold: digits with K, M, G or T (powers of 1024)\n"
    "  --data DIR          node key (DIR/node.key, created on first start) and pieces (DIR/pieces/)\n"
    "  --listen HOST:PORT  worker address (default 127.0.0.1:0: a free port, printed)\n"
    "  --advertise H:P     address announced to the hub (default: the bound worker address)\n"
    "  --interval-ms MS    heartbeat and market period (default: the hub's deadline / 3)\n"
    "  --threads N         worker compute threads (default: all CPUs)\n"
    "  --quiet             no log lines\n"
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
    long v;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *s;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_node_help, stdout);
            return 0;
        } else if (!strcmp(a, "--quiet")) {
            quiet = true;
        } else if (!(s = kv_arg_value(CMD, argc, argv, &i, kv_value_flags))) {
            return 1;
        } else if (!strcmp(a, "--allow-key")) {
            if (kv_key_list_add(s, &ak, &n_ak, &ad)) {
                free(ak);
                return kv_cli_err(CMD, 1, "--allow-key: %s", ad.msg);
            }
        } else if (!strcmp(a, "--hub")) {
            o.hub = s;
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
        } else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) {
            if (kv_arg_long(CMD, a, s, 1, 1024, &v)) return 1;
            o.n_threads = (int)v;
        } else {
            return kv_cli_err(CMD, 1, "unknown option '%s' (see kvasir node --help)", a);
        }
    }
    if (!o.hub || !budget || !o.dir) return kv_cli_err(CMD, 1, "needs --hub, --budget and --data (see kvasir node --help)");
    kv_diag d = {0};
    if (kv_node_parse_size(budget, &o.budget, &d)) return kv_cli_err(CMD, 1, "--budget: %s", d.msg);
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
