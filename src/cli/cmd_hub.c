/* kvasir hub: serve a sliced model's pieces, the node registry and the
 * coverage market over HTTP (docs/HUB.md). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "kvasir/beacon.h"
#include "kvasir/link.h"
#include "kvasir/hub.h"
#include "kvasir/https.h"
#include "kvasir/slice.h"
#include "kvasir/ledger.h"

#define CMD "hub"

static const char *const kv_value_flags[] = {"--model", "--listen", "--db", "--wanted", "--deadline-ms",
                                             "--reward", "--max-body", "--max-conns", "--per-ip-conns",
                                             "--timeout", "--request-timeout", "--threads", "--challenge-every",
                                             "--challenge-ttl-ms", "--vouch-key", "--voucher-ttl-ms", "--pg", "--refresh-ms",
                                             "--ring-windows", "--beacon-to", "--beacon-interval-ms", "--ledger",
                                             "--prove-deadline-ms", "--prove-every-ms", "--prove-threads", "--trust-ms",
                                             "--max-per-host", "--max-per-subnet", "--tls-cert", "--tls-key",
                                             "--relay-port", "--relay-max-circuits", "--relay-max-circuits-per-node",
                                             "--relay-rate-per-node", "--relay-rate", "--wanted-max",
                                             "--demand-per-replica", "--demand-half-life-ms", "--market-raise-ms",
                                             "--market-hold-ms", "--demand-share", "--demand-window-ms",
                                             "--demand-key-tokens", "--demand-net-tokens", NULL};

static const char *kv_hub_help =
    "usage: kvasir hub --model DIR/manifest.json (--db FILE|URI | --pg CONNINFO) [--listen HOST:PORT] [options]\n"
    "  --model PATH        the manifest of a sliced model; its pieces are served from its folder\n"
    "  --db FILE           SQLite store (created if absent; WAL mode); the registry survives restarts\n"
    "  --db postgresql://USER@HOST/DB?host=SOCKETDIR\n"
    "                      PostgreSQL store, shared by every hub started on it (also postgres://)\n"
    "  --pg CONNINFO       the same with a libpq conninfo, e.g. 'host=/run/pg dbname=kvasir'\n"
    "  --refresh-ms MS     shared store: the market/placement view is at most MS old (default 250)\n"
    "  --listen HOST:PORT  address to serve on (default 127.0.0.1:0; port 0 picks one, printed)\n"
    "  HTTPS: a hub on a loopback address serves plain HTTP unless --tls or --tls-cert; on any\n"
    "  other address (0.0.0.0 included) it serves https, by default with a self-signed\n"
    "  certificate on a key derived from the hub's key (the same at every start). Its fingerprint\n"
    "  is printed as \"tls sha256:<64 hex digits>\"; clients pin it: --hub https://HOST:PORT#sha256=<hex>\n"
    "  --tls               serve https on a loopback address too (self-signed, as above)\n"
    "  --tls-cert FILE     serve this PEM certificate (with --tls-key FILE, its PEM key)\n"
    "  --insecure-plaintext  serve plain HTTP on a non-loopback address (prints a warning):\n"
    "                      only behind a TLS-terminating proxy or on a network you own\n"
    "  --relay-port N|same also run the relay on port N of the hub's host (0: a free port), or,\n"
    "                      with \"same\", on the API's own port (a relay client says so in its\n"
    "                      TLS hello; everything else is the API), with\n"
    "                      the hub's certificate (one fingerprint for both): a node the hub cannot\n"
    "                      dial at its announced address is marked relayed, connects out to the\n"
    "                      relay and is proven and reached through it (docs/HUB.md \"Relay\");\n"
    "                      prints \"relay on port N\"\n"
    "  --relay-max-circuits N  circuits through the relay at once (default 4096)\n"
    "  --relay-max-circuits-per-node N  ... to one node (default 64)\n"
    "  --relay-rate-per-node BYTES  bytes/s through one node's circuits: over it, its credit is\n"
    "                      withheld, so it slows and nobody else does (default: no limit)\n"
    "  --relay-rate BYTES  bytes/s through the relay in all (default: no limit)\n"
    "  --wanted N          replicas wanted per shard with no demand: the floor (1..1024, default 2)\n"
    "  --wanted-max N      replicas a shard in demand may want (default: --wanted, a fixed market);\n"
    "                      coordinators report demand (POST /v1/demand, docs/HUB.md \"Demand\")\n"
    "  --demand-per-replica R  expert computations/s one replica is wanted for (default 2000)\n"
    "  --demand-half-life-ms MS  a shard's demand rate halves in MS without reports (default 60000)\n"
    "  --market-raise-ms MS  demand per replica above R this long raises wanted by one (default 10000)\n"
    "  --market-hold-ms MS   below R/2 per replica (one fewer) this long, and as long since the last\n"
    "                      change, lowers it by one (default 120000)\n"
    "  --demand-share S    share (0..1] of a shard's driving demand one key not listed by --vouch-key\n"
    "                      may have (default 0.5; 1 = no cap)\n"
    "  --demand-window-ms MS  accounting window of the demand budgets (default 60000)\n"
    "  --demand-key-tokens N  tokens one coordinator key may report per window (default 600000)\n"
    "  --demand-net-tokens N  tokens all keys of one /24 (IPv6 /48) may report per window (default 4x)\n"
    "  --ring-windows A-B,C-D,...  also trade these consecutive layer windows to ring nodes\n"
    "                      (kvasir ring --hub; GET /v1/ring)\n"
    "  --deadline-ms MS    a node is live while its last heartbeat is this recent (default 15000)\n"
    "  --reward MICRO      micro-KVR per hour offered for a shard at its wanted count (default 1000000)\n"
    "  --max-body BYTES    request body bound (default 1048576)\n"
    "  --max-conns N       concurrent connections (default 1024)\n"
    "  --per-ip-conns N    concurrent connections per client IP, an IPv6 /64 counted as one (default 16)\n"
    "  --timeout S         idle connection timeout, seconds (default 30)\n"
    "  --request-timeout S a request's headers and body must arrive within S seconds, however\n"
    "                      slowly they trickle in (default 15)\n"
    "  --threads N         server threads (default 4)\n"
    "  --challenge-every N storage challenge every N heartbeats of a node (default 12)\n"
    "  --challenge-ttl-ms MS  an unanswered challenge fails after MS (default 60000)\n"
    "  --no-verify         check piece sizes at start, not their SHA-256 (default: hash every piece)\n"
    "  proof of service: a node is listed only once the worker at its address proved its key\n"
    "  and answered a compute challenge for each slab it claims (docs/HUB.md)\n"
    "  --prove-deadline-ms MS  compute answers due within MS of the handshake (default 1500)\n"
    "  --prove-every-ms MS mean time between challenges of a listed node (default 60000)\n"
    "  --prove-threads N   nodes probed at once (default 2, at most 16)\n"
    "  --trust-ms MS       a node proven this long is established; where established nodes hold a\n"
    "                      shard, newcomers' replicas only fill what they leave short (default 600000)\n"
    "  --max-per-host N    live nodes registered at one IP address (default 32)\n"
    "  --max-per-subnet N  live nodes in one IPv4 /24 or IPv6 /48, loopback exempt (default 128)\n"
    "  --trust-announced   list nodes as they announce themselves, unproven: tests of the market\n"
    "                      alone, never a swarm of strangers (prints a warning)\n"
    "  --beacon [PORT]     announce the hub by UDP broadcast on PORT (default 47474) so that\n"
    "                      `kvasir node` without --hub finds it (include/kvasir/beacon.h)\n"
    "  --beacon-to ADDR    broadcast address (default 127.255.255.255 for a loopback hub,\n"
    "                      255.255.255.255 otherwise)\n"
    "  --beacon-interval-ms MS  period of the beacon (default 1000)\n"
    "  --quiet             no log lines\n"
    "  --vouch-key K       vouch for coordinator key K (64 hex digits, or a file of keys, one a\n"
    "                      line): POST /v1/voucher signed by it gets a voucher workers honor; repeatable\n"
    "  --vouch-open        vouch for any coordinator key that asks (a test swarm only)\n"
    "  --voucher-ttl-ms MS a voucher's lifetime (default 3600000)\n"
    "  --ledger FILE|URI   the KVR ledger the gateways settle into, opened read-only: each node's\n"
    "                      earned_micro_kvr on /v1/nodes and the status page (docs/LEDGER.md)\n"
    "Prints \"listening on HOST:PORT\" on stdout once ready; stops on SIGINT/SIGTERM.\n";

static kv_hub *kv_the_hub;

static void kv_on_signal(int sig) {
    (void)sig;
    if (kv_the_hub) kv_hub_stop(kv_the_hub);
}

/* The beacon's message: the hub's URL and its model id (from the manifest). */
static int kv_hub_beacon_start(kv_beacon **out, const kv_hub_opts *o, const char *addr, const char *fp,
                               const char *to, long port, long interval_ms, kv_diag *d) {
    kv_manifest *m = NULL;
    int rc = kv_manifest_load(&m, o->manifest, d);
    if (rc) return rc;
    kv_beacon_opts bo = {.to = to, .port = (uint16_t)port, .interval_ms = (uint32_t)interval_ms};
    snprintf(bo.msg.model_id, sizeof bo.msg.model_id, "%s", m->model_id);
    kv_manifest_free(m);
    if (!to) bo.to = !strncmp(addr, "127.", 4) || !strncmp(addr, "localhost:", 10) ? "127.255.255.255" : "255.255.255.255";
    int n = fp ? snprintf(bo.msg.url, sizeof bo.msg.url, "https://%s#sha256=%s", addr, fp)
               : snprintf(bo.msg.url, sizeof bo.msg.url, "http://%s", addr);
    if (n < 0 || (size_t)n >= sizeof bo.msg.url)
        return kv_fail(d, KV_EINVAL, "beacon: the hub address '%s' is too long to announce", addr);
    return kv_beacon_start(out, &bo, d);
}

int kv_cmd_hub(int argc, char **argv) {
    kv_hub_opts o = {0};
    static char pg_uri[2048];
    long v, beacon_port = -1, beacon_interval = KV_BEACON_INTERVAL_MS;
    const char *beacon_to = NULL;
    uint8_t(*vk)[32] = NULL;
    size_t n_vk = 0;
    kv_diag ad = {0};
    const char *ledger = NULL, *tls_cert = NULL, *tls_key = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *s;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_hub_help, stdout);
            return 0;
        } else if (!strcmp(a, "--quiet")) {
            o.quiet = true;
        } else if (!strcmp(a, "--no-verify")) {
            o.skip_verify = true;
        } else if (!strcmp(a, "--beacon")) { /* an optional PORT: the next word if it is all digits */
            beacon_port = KV_BEACON_PORT;
            if (i + 1 < argc && argv[i + 1][0] >= '0' && argv[i + 1][0] <= '9') {
                if (kv_arg_long(CMD, a, argv[++i], 1, 65535, &beacon_port)) return 1;
            }
        } else if (!strcmp(a, "--vouch-open")) {
            o.vouch_open = true;
        } else if (!strcmp(a, "--trust-announced")) {
            o.trust_announced = true;
        } else if (!strcmp(a, "--tls")) {
            o.tls = true;
        } else if (!strcmp(a, "--insecure-plaintext")) {
            o.insecure_plaintext = true;
        } else if (!(s = kv_arg_value(CMD, argc, argv, &i, kv_value_flags))) {
            return 1;
        } else if (!strcmp(a, "--ring-windows")) {
            o.ring_windows = s;
        } else if (!strcmp(a, "--vouch-key")) {
            if (kv_key_list_add(s, &vk, &n_vk, &ad)) {
                free(vk);
                return kv_cli_err(CMD, 1, "--vouch-key: %s", ad.msg);
            }
        } else if (!strcmp(a, "--voucher-ttl-ms")) {
            if (kv_arg_long(CMD, a, s, 1000, 30L * 86400000, &v)) return 1;
            o.voucher_ttl_ms = (uint32_t)v;
        } else if (!strcmp(a, "--ledger")) {
            ledger = s;
        } else if (!strcmp(a, "--tls-cert")) {
            tls_cert = s;
        } else if (!strcmp(a, "--tls-key")) {
            tls_key = s;
        } else if (!strcmp(a, "--model")) {
            o.manifest = s;
        } else if (!strcmp(a, "--listen")) {
            o.listen = s;
        } else if (!strcmp(a, "--db")) {
            o.db = s;
        } else if (!strcmp(a, "--pg")) {
            if (strlen(s) > sizeof pg_uri - 4) return kv_cli_err(CMD, 1, "--pg: conninfo longer than %zu bytes", sizeof pg_uri - 4);
            snprintf(pg_uri, sizeof pg_uri, "pg:%s", s);
            o.db = pg_uri;
        } else if (!strcmp(a, "--refresh-ms")) {
            if (kv_arg_long(CMD, a, s, 10, 60000, &v)) return 1;
            o.refresh_ms = (uint32_t)v;
        } else if (!strcmp(a, "--relay-port")) {
            o.relay = true;
            if (s && !strcmp(s, "same")) {
                o.relay_same_port = true;
            } else {
                if (kv_arg_long(CMD, a, s, 0, 65535, &v)) return 1;
                o.relay_port = (uint16_t)v;
            }
        } else if (!strcmp(a, "--relay-max-circuits")) {
            if (kv_arg_long(CMD, a, s, 1, 1000000, &v)) return 1;
            o.relay_max_circuits = (uint32_t)v;
        } else if (!strcmp(a, "--relay-max-circuits-per-node")) {
            if (kv_arg_long(CMD, a, s, 1, 1000000, &v)) return 1;
            o.relay_max_circuits_per_node = (uint32_t)v;
        } else if (!strcmp(a, "--relay-rate-per-node")) {
            if (kv_arg_long(CMD, a, s, 1024, 1L << 40, &v)) return 1;
            o.relay_rate_per_node = (uint64_t)v;
        } else if (!strcmp(a, "--relay-rate")) {
            if (kv_arg_long(CMD, a, s, 1024, 1L << 40, &v)) return 1;
            o.relay_rate = (uint64_t)v;
        } else if (!strcmp(a, "--wanted")) {
            if (kv_arg_long(CMD, a, s, 1, 1024, &v)) return 1;
            o.wanted = (uint32_t)v;
        } else if (!strcmp(a, "--wanted-max")) {
            if (kv_arg_long(CMD, a, s, 1, 1024, &v)) return 1;
            o.wanted_max = (uint32_t)v;
        } else if (!strcmp(a, "--demand-per-replica")) {
            float f;
            if (kv_arg_float(CMD, a, s, 1e-3, 1e12, &f)) return 1;
            o.demand_per_replica = f;
        } else if (!strcmp(a, "--demand-half-life-ms")) {
            if (kv_arg_long(CMD, a, s, 100, 86400000, &v)) return 1;
            o.demand_half_life_ms = (uint32_t)v;
        } else if (!strcmp(a, "--market-raise-ms")) {
            if (kv_arg_long(CMD, a, s, 1, 86400000, &v)) return 1;
            o.market_raise_ms = (uint32_t)v;
        } else if (!strcmp(a, "--market-hold-ms")) {
            if (kv_arg_long(CMD, a, s, 1, 86400000, &v)) return 1;
            o.market_hold_ms = (uint32_t)v;
        } else if (!strcmp(a, "--demand-share")) {
            float f;
            if (kv_arg_float(CMD, a, s, 0.01, 1, &f)) return 1;
            o.demand_share = f;
        } else if (!strcmp(a, "--demand-window-ms")) {
            if (kv_arg_long(CMD, a, s, 1000, 86400000, &v)) return 1;
            o.demand_window_ms = (uint32_t)v;
        } else if (!strcmp(a, "--demand-key-tokens")) {
            if (kv_arg_long(CMD, a, s, 1, 1L << 40, &v)) return 1;
            o.demand_key_tokens = (uint64_t)v;
        } else if (!strcmp(a, "--demand-net-tokens")) {
            if (kv_arg_long(CMD, a, s, 1, 1L << 40, &v)) return 1;
            o.demand_net_tokens = (uint64_t)v;
        } else if (!strcmp(a, "--deadline-ms")) {
            if (kv_arg_long(CMD, a, s, 1, 86400000, &v)) return 1;
            o.deadline_ms = (uint32_t)v;
        } else if (!strcmp(a, "--reward")) {
            if (kv_arg_long(CMD, a, s, 1, 1000000000000L, &v)) return 1;
            o.reward_base = (uint64_t)v;
        } else if (!strcmp(a, "--max-body")) {
            if (kv_arg_long(CMD, a, s, 1024, 64L << 20, &v)) return 1;
            o.max_body = (uint32_t)v;
        } else if (!strcmp(a, "--max-conns")) {
            if (kv_arg_long(CMD, a, s, 1, 65536, &v)) return 1;
            o.max_conns = (uint32_t)v;
        } else if (!strcmp(a, "--per-ip-conns")) {
            if (kv_arg_long(CMD, a, s, 1, 65536, &v)) return 1;
            o.per_ip_conns = (uint32_t)v;
        } else if (!strcmp(a, "--timeout")) {
            if (kv_arg_long(CMD, a, s, 1, 3600, &v)) return 1;
            o.conn_timeout_s = (uint32_t)v;
        } else if (!strcmp(a, "--request-timeout")) {
            if (kv_arg_long(CMD, a, s, 1, 3600, &v)) return 1;
            o.request_s = (uint32_t)v;
        } else if (!strcmp(a, "--threads")) {
            if (kv_arg_long(CMD, a, s, 1, 256, &v)) return 1;
            o.threads = (uint32_t)v;
        } else if (!strcmp(a, "--challenge-every")) {
            if (kv_arg_long(CMD, a, s, 1, 1000000, &v)) return 1;
            o.challenge_every = (uint32_t)v;
        } else if (!strcmp(a, "--beacon-to")) {
            beacon_to = s;
        } else if (!strcmp(a, "--beacon-interval-ms")) {
            if (kv_arg_long(CMD, a, s, 10, 3600000, &beacon_interval)) return 1;
        } else if (!strcmp(a, "--prove-deadline-ms")) {
            if (kv_arg_long(CMD, a, s, 10, 600000, &v)) return 1;
            o.prove_deadline_ms = (uint32_t)v;
        } else if (!strcmp(a, "--prove-every-ms")) {
            if (kv_arg_long(CMD, a, s, 100, 86400000, &v)) return 1;
            o.prove_every_ms = (uint32_t)v;
        } else if (!strcmp(a, "--prove-threads")) {
            if (kv_arg_long(CMD, a, s, 1, 16, &v)) return 1;
            o.prove_threads = (uint32_t)v;
        } else if (!strcmp(a, "--trust-ms")) {
            if (kv_arg_long(CMD, a, s, 1, 30L * 86400000, &v)) return 1;
            o.trust_ms = (uint32_t)v;
        } else if (!strcmp(a, "--max-per-host")) {
            if (kv_arg_long(CMD, a, s, 1, 1000000, &v)) return 1;
            o.max_per_host = (uint32_t)v;
        } else if (!strcmp(a, "--max-per-subnet")) {
            if (kv_arg_long(CMD, a, s, 1, 1000000, &v)) return 1;
            o.max_per_subnet = (uint32_t)v;
        } else if (!strcmp(a, "--challenge-ttl-ms")) {
            if (kv_arg_long(CMD, a, s, 100, 86400000, &v)) return 1;
            o.challenge_ttl_ms = (uint32_t)v;
        } else {
            return kv_cli_err(CMD, 1, "unknown option '%s' (see kvasir hub --help)", a);
        }
    }
    if (!o.manifest || !o.db) return kv_cli_err(CMD, 1, "needs --model and --db (see kvasir hub --help)");
    if (!tls_cert != !tls_key) return kv_cli_err(CMD, 1, "--tls-cert and --tls-key go together");
    if (!o.relay && (o.relay_max_circuits || o.relay_max_circuits_per_node || o.relay_rate_per_node || o.relay_rate))
        return kv_cli_err(CMD, 1, "the --relay-* budgets need --relay-port");
    if (o.insecure_plaintext && (tls_cert || o.tls))
        return kv_cli_err(CMD, 1, "--insecure-plaintext contradicts %s", o.tls ? "--tls" : "--tls-cert");
    signal(SIGPIPE, SIG_IGN);
    kv_diag d = {0};
    static kv_https_cert tc; /* served while the hub runs */
    if (tls_cert) {
        if (kv_https_cert_load(&tc, tls_cert, tls_key, &d)) return kv_cli_diag(CMD, &d);
        o.tls_cert = &tc;
    }
    kv_hub *h = NULL;
    o.vouch_keys = (const uint8_t(*)[32])vk;
    o.n_vouch_keys = n_vk;
    kv_ledger_reader *lr = NULL; /* read-only: the hub can show earnings, never move them */
    if (ledger && kv_ledger_reader_open(&lr, ledger, &d)) {
        free(vk);
        return kv_cli_diag(CMD, &d);
    }
    o.earned = lr ? kv_ledger_reader_earned : NULL;
    o.earned_arg = lr;
    int orc = kv_hub_open(&h, &o, &d);
    free(vk);
    if (orc) {
        kv_ledger_reader_free(lr);
        kv_https_cert_clear(&tc);
        return kv_cli_diag(CMD, &d);
    }
    if (o.insecure_plaintext)
        fprintf(stderr, "hub: WARNING: --insecure-plaintext: the API is served unencrypted on %s; anyone on the "
                        "path can read and change what nodes and clients exchange with the hub\n",
                kv_hub_addr(h));
    if (o.trust_announced)
        fprintf(stderr, "hub: WARNING: --trust-announced: nodes are listed as they announce themselves, without "
                        "proof of their address or slabs; never use it with strangers\n");
    if (!o.quiet) {
        char hk[65];
        kv_hex(kv_hub_key(h), 32, hk);
        fprintf(stderr, "hub: key %s (vouches for %s)\n", hk, o.vouch_open ? "any coordinator" : "listed coordinators");
    }
    kv_the_hub = h;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = kv_on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    kv_beacon *b = NULL;
    if (beacon_port > 0 && kv_hub_beacon_start(&b, &o, kv_hub_addr(h), kv_hub_tls_fingerprint(h), beacon_to, beacon_port, beacon_interval, &d)) {
        kv_the_hub = NULL;
        kv_hub_free(h);
        return kv_cli_diag(CMD, &d);
    }
    const char *fp = kv_hub_tls_fingerprint(h);
    if (fp) {
        printf("tls sha256:%s\n", fp);
        if (!o.quiet) fprintf(stderr, "hub: serving https; clients use --hub https://%s#sha256=%s\n", kv_hub_addr(h), fp);
    }
    if (o.relay) printf("relay on port %u\n", kv_hub_relay_port_of(h));
    printf("listening on %s\n", kv_hub_addr(h));
    if (b) printf("beacon on UDP port %ld\n", beacon_port);
    fflush(stdout);
    int rc = kv_hub_serve(h, &d);
    kv_the_hub = NULL;
    kv_beacon_free(b);
    kv_hub_free(h);
    kv_ledger_reader_free(lr);
    kv_https_cert_clear(&tc);
    if (!o.quiet) fprintf(stderr, "hub: stopped\n");
    return rc ? kv_cli_diag(CMD, &d) : 0;
}
