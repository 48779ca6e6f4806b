/* kvasir worker: serve expert computation for the slabs this node holds,
 * over the dispatch protocol (docs/PROTOCOL.md). */
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "kvasir/dispatch_proto.h"
#include "kvasir/dispatch_worker.h"
#include "kvasir/hub.h"
#include "kvasir/pool.h"
#include "kvasir/quant.h"
#include "kvasir/relay.h"

#define CMD "worker"

static const char *const kv_value_flags[] = {"--slabs", "--listen", "--threads", "-t", "--max-conns",
                                             "--read-timeout", "--idle-timeout", "--handshake-timeout",
                                             "--max-pending-per-addr", "--max-pending", "--evict-idle", "--write-timeout",
                                             "--mem-budget-mb", "--max-request-cost", "--allow-key",
                                             "--hub-key", "--key", "--backend", "--relay", NULL};

static const char *kv_worker_help =
    "usage: kvasir worker --slabs DIR_OR_FILES --listen HOST:PORT [--threads N] [--max-conns N]\n"
    "  --slabs S          a folder of slab *.gguf (a slice folder: its experts/), or a\n"
    "                     comma-separated list of slab or full model files, all of one model\n"
    "  --listen HOST:PORT address to serve on; port 0 picks a free one (printed)\n"
    "  --threads N        compute threads (default: all CPUs; same bits for any N)\n"
    "  --max-conns N      concurrent connections (default 64; a newly authenticated peer then\n"
    "                     takes the place of one without work for --evict-idle MS, else it is\n"
    "                     refused; a peer still in its handshake never displaces them)\n"
    "  --read-timeout MS  a frame started must arrive whole within MS (default 10000)\n"
    "  --idle-timeout MS  close connections silent for MS (default: never)\n"
    "  --handshake-timeout MS  HELLO must complete within MS of connecting (default 5000)\n"
    "  --max-pending-per-addr N  connections of one address awaiting their handshake (default 8;\n"
    "                     then its least advanced one yields to the newcomer)\n"
    "  --max-pending N    connections awaiting their handshake in all (default 64; then one of\n"
    "                     an address holding more yields, else the newcomer is refused)\n"
    "  --evict-idle MS    when full, a connection without COMPUTE for MS yields its place to a\n"
    "                     newly authenticated one (default 10000)\n"
    "  --write-timeout MS a peer that reads nothing for MS is closed (default 30000)\n"
    "  --mem-budget-mb N  memory all connections may buffer together (default 1024)\n"
    "  --max-request-cost N  multiply-adds one COMPUTE may ask for (default 2^36)\n"
    "  --backend NAME     expert kernels: scalar, avx2, avxvnni, avx512, neon, neondot (what\n"
    "                     this CPU runs; default the fastest) or opencl (the first OpenCL device)\n"
    "  --quiet            no per-connection log lines\n"
    "  --insecure-plaintext  serve plaintext coordinators from any address (default: plaintext\n"
    "                     only from loopback, TLS 1.3 from everywhere else); prints a warning\n"
    "  --allow-sparse     slabs with holes (a sliced skeleton) are served unhashed; only a\n"
    "                     coordinator run with --allow-sparse on a hashless manifest accepts them\n"
    "  --allow-key K      serve the coordinator whose public key is K (64 hex digits, see\n"
    "                     `kvasir key`), or every key listed in file K (one per line); repeatable\n"
    "  --hub-key K        also serve coordinators holding a voucher of the hub whose key is K\n"
    "                     (GET /v1/status \"hub_key\"); one of --allow-key / --hub-key is required\n"
    "  --key FILE         this worker's own key (proved to coordinators); default: a fresh one\n"
    "  --relay HOST:PORT#sha256=FP  also serve through this relay (docs/PROTOCOL.md, \"Relay\"), over\n"
    "                     one outbound TLS connection (FP: the relay's fingerprint); coordinators\n"
    "                     reach the worker by its key; --listen then defaults to 127.0.0.1:0\n"
    "Prints \"listening on HOST:PORT\" on stdout once ready; stops on SIGINT/SIGTERM and\n"
    "prints how many expert computations it served.\n";

static kv_worker *kv_the_worker;

static void kv_on_signal(int sig) {
    (void)sig;
    if (kv_the_worker) kv_worker_stop(kv_the_worker);
}

int kv_cmd_worker(int argc, char **argv) {
    kv_worker_opts o = {0};
    long v_l;
    uint8_t(*allow)[32] = NULL, hub_key[32];
    size_t n_allow = 0;
    kv_node_key own;
    kv_diag ad = {0};
    const char *relay = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_worker_help, stdout);
            return 0;
        } else if (!strcmp(a, "--quiet")) {
            o.quiet = true;
        } else if (!strcmp(a, "--insecure-plaintext")) {
            o.insecure_plaintext = true;
            kv_link_warn_plaintext("worker");
        } else if (!strcmp(a, "--allow-sparse")) {
            o.allow_sparse = true;
        } else if (!strncmp(a, "--test-lie=", 11)) {
            /* TEST ONLY, deliberately absent from --help: return wrong numbers (docs/VERIFY.md) */
            const int m = kv_worker_lie_from_name(a + 11);
            if (m < 0) return kv_cli_err(CMD, 1, "--test-lie: '%s' is not noise, swap, stale, later or badsig", a + 11);
            o.test_lie = m;
            fprintf(stderr, "worker: TEST MODE: this worker lies (%s)\n", a + 11);
        } else if (!strncmp(a, "--test-delay=", 13)) {
            /* TEST ONLY, deliberately absent from --help: answer every COMPUTE late */
            char *end = NULL;
            const long ms = strtol(a + 13, &end, 10);
            if (!a[13] || *end || ms < 0 || ms > 3600000) return kv_cli_err(CMD, 1, "--test-delay: '%s' is not MS", a + 13);
            o.test_delay_ms = (int)ms;
            fprintf(stderr, "worker: TEST MODE: every COMPUTE waits %ld ms\n", ms);
        } else if (!strncmp(a, "--test-stall-ms=", 16) || !strncmp(a, "--test-stall-every=", 19)) {
            /* TEST ONLY, deliberately absent from --help: every M-th COMPUTE waits N ms more
               (a replica that stalls now and then; docs/PROTOCOL.md, Replica choice and hedging) */
            const bool is_ms = a[7] == 's' && a[13] == 'm';
            const char *val = a + (is_ms ? 16 : 19);
            char *end = NULL;
            const long n = strtol(val, &end, 10);
            if (!val[0] || *end || n < 1 || n > (is_ms ? 60000 : 1000000))
                return kv_cli_err(CMD, 1, "%s: '%s' is not a number of %s", is_ms ? "--test-stall-ms" : "--test-stall-every",
                                  val, is_ms ? "milliseconds (1-60000)" : "requests (1-1000000)");
            if (is_ms) o.test_stall_ms = (int)n;
            else o.test_stall_every = (int)n;
            fprintf(stderr, "worker: TEST MODE: %s=%ld\n", is_ms ? "--test-stall-ms" : "--test-stall-every", n);
        } else if (!(v = kv_arg_value(CMD, argc, argv, &i, kv_value_flags))) {
            return 1;
        } else if (!strcmp(a, "--allow-key")) {
            if (kv_key_list_add(v, &allow, &n_allow, &ad)) {
                free(allow);
                return kv_cli_err(CMD, 1, "--allow-key: %s", ad.msg);
            }
        } else if (!strcmp(a, "--hub-key")) {
            if (kv_key_from_hex(v, hub_key, &ad)) {
                free(allow);
                return kv_cli_err(CMD, 1, "--hub-key: %s", ad.msg);
            }
            o.hub_key = hub_key;
        } else if (!strcmp(a, "--key")) {
            if (kv_key_file_load(&own, v, true, &ad)) {
                free(allow);
                return kv_cli_diag(CMD, &ad);
            }
            o.key_sk = own.sk;
        } else if (!strcmp(a, "--backend")) {
            if (!strcmp(v, "opencl")) {
                o.opencl = true;
            } else if (kv_quant_set_backend(v)) {
                return kv_cli_err(CMD, 1, "--backend %s: not a backend this CPU runs (scalar, avx2, avxvnni, "
                                  "avx512, neon, neondot, opencl)", v);
            }
        } else if (!strcmp(a, "--slabs")) {
            o.slabs = v;
        } else if (!strcmp(a, "--relay")) {
            relay = v;
        } else if (!strcmp(a, "--listen")) {
            o.listen = v;
        } else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) {
            if (kv_arg_long(CMD, a, v, 1, KV_POOL_MAX_THREADS, &v_l)) return 1;
            o.n_threads = (int)v_l;
        } else if (!strcmp(a, "--max-conns")) {
            if (kv_arg_long(CMD, a, v, 1, 65536, &v_l)) return 1;
            o.max_conns = (int)v_l;
        } else if (!strcmp(a, "--read-timeout")) {
            if (kv_arg_long(CMD, a, v, 1, 3600000, &v_l)) return 1;
            o.read_timeout_ms = (int)v_l;
        } else if (!strcmp(a, "--idle-timeout")) {
            if (kv_arg_long(CMD, a, v, 1, 86400000, &v_l)) return 1;
            o.idle_timeout_ms = (int)v_l;
        } else if (!strcmp(a, "--handshake-timeout")) {
            if (kv_arg_long(CMD, a, v, 1, 3600000, &v_l)) return 1;
            o.handshake_timeout_ms = (int)v_l;
        } else if (!strcmp(a, "--max-pending-per-addr")) {
            if (kv_arg_long(CMD, a, v, 1, 65536, &v_l)) return 1;
            o.max_pending_per_addr = (int)v_l;
        } else if (!strcmp(a, "--max-pending")) {
            if (kv_arg_long(CMD, a, v, 1, 65536, &v_l)) return 1;
            o.max_pending = (int)v_l;
        } else if (!strcmp(a, "--evict-idle")) {
            if (kv_arg_long(CMD, a, v, 1, 86400000, &v_l)) return 1;
            o.evict_idle_ms = (int)v_l;
        } else if (!strcmp(a, "--write-timeout")) {
            if (kv_arg_long(CMD, a, v, 1, 3600000, &v_l)) return 1;
            o.write_timeout_ms = (int)v_l;
        } else if (!strcmp(a, "--mem-budget-mb")) {
            if (kv_arg_long(CMD, a, v, 1, 1L << 30, &v_l)) return 1;
            o.mem_budget = (size_t)v_l << 20;
        } else if (!strcmp(a, "--max-request-cost")) {
            if (kv_arg_long(CMD, a, v, 1, LONG_MAX, &v_l)) return 1;
            o.max_request_cost = (uint64_t)v_l;
        } else {
            return kv_cli_err(CMD, 1, "unknown option '%s' (see kvasir worker --help)", a);
        }
    }
    char relay_addr[256], relay_fp[KV_TLS_FP_HEX + 1];
    if (relay && kv_relay_parse_url(relay, relay_addr, sizeof relay_addr, relay_fp, &ad)) {
        free(allow);
        return kv_cli_err(CMD, 1, "--relay: %s", ad.msg);
    }
    if (relay && !o.listen) o.listen = "127.0.0.1:0";
    if (relay && !o.key_sk) { /* the relay proof needs the secret key: make it here */
        uint8_t seed[32];
        FILE *f = fopen("/dev/urandom", "rb");
        const bool ok = f && fread(seed, 1, 32, f) == 32;
        if (f) fclose(f);
        if (!ok) {
            free(allow);
            return kv_cli_err(CMD, 1, "--relay: cannot read /dev/urandom for a key");
        }
        kv_node_key_from_seed(&own, seed);
        o.key_sk = own.sk;
    }
    if (!o.slabs || !o.listen) {
        free(allow);
        return kv_cli_err(CMD, 1, "needs --slabs and --listen (see kvasir worker --help)");
    }
    if (!n_allow && !o.hub_key) {
        return kv_cli_err(CMD, 1, "needs --allow-key or --hub-key: a worker serves only coordinators that prove "
                                  "a key it allows (see kvasir worker --help)");
    }
    if (o.test_stall_every && !o.test_stall_ms) {
        free(allow);
        return kv_cli_err(CMD, 1, "--test-stall-every needs --test-stall-ms (how long each stall lasts)");
    }
    o.allow_keys = (const uint8_t(*)[32])allow;
    o.n_allow_keys = n_allow;
    kv_diag d = {0};
    kv_worker *w = NULL;
    int orc = kv_worker_open(&w, &o, &d);
    free(allow);
    if (orc) return kv_cli_diag(CMD, &d);
    const kv_held_range *r;
    size_t nr = kv_worker_ranges(w, &r);
    uint64_t n_held = 0;
    for (size_t i = 0; i < nr; i++) n_held += (uint64_t)r[i].last - r[i].first + 1;
    fprintf(stderr, "worker: model %.16s..., %llu experts in %zu ranges\n", kv_worker_model_id(w),
            (unsigned long long)n_held, nr);

    kv_the_worker = w;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = kv_on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    char wk[65];
    kv_hex(kv_worker_key(w), 32, wk);
    fprintf(stderr, "worker: key %s\n", wk);
    kv_tls_ctx *rtls = NULL;
    kv_relay_forward *rfw = NULL;
    kv_relay_client *rcl = NULL;
    if (relay) { /* circuits of the relay go to the worker's own (local) address */
        const kv_relay_client_opts ro = {.relay = relay_addr, .relay_sha256 = relay_fp, .role = KV_RELAY_ROLE_NODE,
                                         .key = &own, .on_circuit = kv_relay_forward_circuit};
        int rrc = kv_tls_ctx_new(&rtls, &own, &d);
        if (!rrc) rrc = kv_relay_forward_new(&rfw, rtls, kv_worker_addr(w), &d);
        kv_relay_client_opts ro2 = ro;
        ro2.tls = rtls, ro2.data = rfw;
        if (!rrc) rrc = kv_relay_client_start(&rcl, &ro2, &d);
        if (rrc) {
            kv_relay_forward_free(rfw);
            kv_tls_ctx_free(rtls);
            kv_worker_free(w);
            return kv_cli_diag(CMD, &d);
        }
        fprintf(stderr, "worker: serving through relay %s\n", relay_addr);
    }
    printf("listening on %s\n", kv_worker_addr(w));
    fflush(stdout);
    int rc = kv_worker_serve(w, &d);
    kv_relay_client_free(rcl);
    kv_relay_forward_free(rfw);
    kv_tls_ctx_free(rtls);
    kv_msg_stats s;
    kv_worker_stats(w, &s);
    fprintf(stderr,
            "worker: served %llu expert computations (%llu requests, %llu tokens) over %llu "
            "connections, %llu errors, %llu requests cancelled\n",
            (unsigned long long)s.n_pairs, (unsigned long long)s.n_compute,
            (unsigned long long)s.n_tokens, (unsigned long long)s.n_conns,
            (unsigned long long)s.n_errors, (unsigned long long)s.n_cancelled);
    kv_the_worker = NULL;
    kv_worker_free(w);
    return rc ? kv_cli_diag(CMD, &d) : 0;
}
