/* kvasir ring: serve one layer window of a model as a node of a ring
 * (include/kvasir/ring.h, docs/PROTOCOL.md "Ring protocol"). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "kvasir/link.h"
#include "kvasir/transport.h"
#include "kvasir/hub.h"
#include "kvasir/ledger.h" /* kv_unhex32 */
#include "kvasir/node.h"
#include "kvasir/pool.h"
#include "kvasir/ring.h"

#define CMD "ring"

static const char *const kv_value_flags[] = {"-m", "--model", "--layers", "--listen", "--next", "--threads", "-t",
                                             "--ctx", "--batch", "--max-seqs", "--replay-timeout-ms", "--die-after-frames", "--link-delay-ms", "--key", "--allow-key", "--hub", "--budget", "--data", "--worker", "--hub-key", "--worker-wait-ms", "--site", "--prompt-cache", "--prompt-cache-block", "--test-cache-drop", NULL};

static const char *kv_ring_help =
    "usage: kvasir ring --model MODEL --layers A-B --listen HOST:PORT --next HOST:PORT [options]\n"
    "       kvasir ring --hub URL --budget SIZE [--data DIR] --listen HOST:PORT [options]\n"
    "  --hub URL           take the scarcest layer window of the hub's market that fits --budget\n"
    "                      (e.g. 512M, 8G), fetch its pieces into --data DIR (default kvasir-data;\n"
    "                      resumable, hash checked), register it, and learn the next node from the\n"
    "                      hub (instead of --model, --layers and --next); the window reports its\n"
    "                      demand per shard to the hub every 5 s, signed by DIR/node.key (the hub\n"
    "                      must vouch for it: docs/HUB.md \"Demand\")\n"
    "  --site NAME         with --hub: run the window the hub's site placement gives site NAME, its\n"
    "                      experts on that site's workers (docs/HUB.md \"Sites\"); --budget is then\n"
    "                      only announced\n"
    "  -m, --model MODEL   GGUF file, or DIR/manifest.json (or DIR) of a sliced model; only the\n"
    "                      tensors of layers A..B are touched (the token embedding only when A is 0,\n"
    "                      the final norm and LM head only when B is the last layer)\n"
    "  --layers A-B        the window of consecutive layers this node computes\n"
    "  --listen HOST:PORT  where the node before it and clients connect (port 0 picks one; printed)\n"
    "  --next HOST:PORT    the node holding layer B+1 (the node with layer 0 after the last);\n"
    "                      dialed, and redialed whenever the link drops\n"
    "  --threads N         compute threads (default: all CPUs; same bits for any N)\n"
    "  --ctx N             positions per sequence (default: min(model, 4096))\n"
    "  --batch N           prompt tokens per hidden-state frame (default 256)\n"
    "  --max-seqs N        sequences in flight at once (default 16)\n"
    "  --prompt-cache SIZE memory for this node's prompt cache (e.g. 512M; default 0 = none): the\n"
    "                      K/V rows of its window (and recurrent states) of prompt blocks, reused by\n"
    "                      a later prompt with the same prefix when every node of the ring holds it\n"
    "                      (docs/PROTOCOL.md \"Prompt cache over the ring\")\n"
    "  --prompt-cache-block N  tokens per cache block, a multiple of 16 up to 4096, the same on every\n"
    "                      node (default 64)\n"
    "  --replay-timeout-ms N  after a break, requests wait N ms for the ring to re-form and are\n"
    "                      then replayed from their tokens, else they fail (default 30000)\n"
    "  --skip-hashes       sliced model: check sizes and identity, not every SHA-256\n"
    "  --allow-sparse      sliced model: serve a window of a sliced skeleton (gen-model --skeleton,\n"
    "                      sliced: pieces without hashes, holes read as zeros; sizes, headers and\n"
    "                      identity are checked) and take unhashed slabs from --worker (kvasir\n"
    "                      worker --allow-sparse); refused without this flag\n"
    "  --worker HOST:PORT  sliced model: compute this window's routed experts on expert workers\n"
    "                      (kvasir worker; repeat for more; they must admit this node's --key):\n"
    "                      only the backbone and the manifest need be here\n"
    "  --worker-wait-ms MS with --worker: wait this long at start for a worker up for every expert of\n"
    "                      the window (workers still starting, or refusing for room) (default 30000)\n"
    "  --key FILE          this node's Ed25519 key (created if absent, 0600; kvasir key prints its\n"
    "                      public half); default: a fresh key for this process\n"
    "  --allow-key K       admit key K (64 hex digits, or a file of keys, one a line): the other\n"
    "                      nodes of the ring and the clients; repeatable. Every connection proves\n"
    "                      its key (challenge and signature); a node links only to a next it admits\n"
    "  --open              admit every key that proves itself (instead of --allow-key)\n"
    "  --hub-key K         also admit a client whose key brings a voucher of the hub with key K\n"
    "                      (64 hex digits; docs/HUB.md \"Vouching\"); with --hub, that hub's key is\n"
    "                      trusted on its own. The ring's nodes still admit each other by --allow-key\n"
    "  --quiet             no log lines (links, breaks, replays) on stderr\n"
    "  --insecure-plaintext  link to the next node (and dial --worker) over plain TCP, and serve\n"
    "                      plaintext peers from any address (default: TLS 1.3, plaintext only\n"
    "                      from loopback); prints a warning\n"
    "  --link-delay-ms N   hold every frame to the next node N ms (emulated latency, for benchmarks\n"
    "                      where tc netem is not available)\n"
    "  --die-after-frames N  test hook: exit abruptly after computing N hidden-state frames\n"
    "  --test-cache-drop N test hook: empty the prompt cache just before the Nth sequence that\n"
    "                      begins from it here (a miss: its home begins it again from position 0)\n"
    "Prints \"listening on HOST:PORT\" on stdout once ready; stops on SIGINT/SIGTERM.\n"
    "Submit requests with: kvasir run --ring HOST:PORT -p TEXT ...\n";

static kv_ring_node *kv_the_node;

static void kv_on_signal(int sig) {
    (void)sig;
    if (kv_the_node) kv_ring_node_stop(kv_the_node);
}

static int kv_parse_layers(const char *v, uint32_t *a, uint32_t *b) {
    char *e1, *e2;
    const unsigned long x = strtoul(v, &e1, 10);
    if (e1 == v || *e1 != '-') return -1;
    const unsigned long y = strtoul(e1 + 1, &e2, 10);
    if (e2 == e1 + 1 || *e2 || x > y || y >= KV_RING_MAX_LAYERS) return -1;
    *a = (uint32_t)x;
    *b = (uint32_t)y;
    return 0;
}

int kv_cmd_ring(int argc, char **argv) {
    kv_ring_node_opts o = {.log = stderr};
    bool layers = false;
    const char *key_path = NULL;
    uint8_t (*allow)[32] = NULL;
    size_t n_allow = 0;
    kv_diag d = {0};
    const char *hub = NULL, *data_dir = "kvasir-data";
    uint64_t budget = 0;
    uint8_t hub_key[32];
    bool has_hub_key = false;
    const char *workers[64];
    uint32_t n_workers = 0, worker_wait_ms = 0;
    const char *site = NULL;
    static char site_workers[KV_RING_SITE_WORKERS][KV_RING_HUB_ADDR + 1];
    long lv;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_ring_help, stdout);
            return 0;
        } else if (!strcmp(a, "--quiet")) {
            o.log = NULL;
        } else if (!strcmp(a, "--insecure-plaintext")) {
            o.insecure_plaintext = true;
            kv_link_warn_plaintext("ring");
        } else if (!strcmp(a, "--skip-hashes")) {
            o.skip_hashes = true;
        } else if (!strcmp(a, "--allow-sparse")) { /* a sliced skeleton (pieces without hashes) */
            o.allow_sparse = true;
        } else if (!strcmp(a, "--open")) {
            o.allow_any = true;
        } else if (!(v = kv_arg_value(CMD, argc, argv, &i, kv_value_flags))) {
            return 1;
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            o.model = v;
        } else if (!strcmp(a, "--key")) {
            key_path = v;
        } else if (!strcmp(a, "--hub")) {
            hub = v;
        } else if (!strcmp(a, "--site")) {
            if (kv_hub_site_check(v, &d)) {
                free(allow);
                return kv_cli_err(CMD, 1, "--site: %s", d.msg);
            }
            site = v;
        } else if (!strcmp(a, "--hub-key")) {
            if (kv_unhex32(v, hub_key, &d)) {
                free(allow);
                return kv_cli_err(CMD, 1, "--hub-key: %s", d.msg);
            }
            has_hub_key = true;
        } else if (!strcmp(a, "--worker-wait-ms")) {
            long w;
            if (kv_arg_long(CMD, a, v, 0, 3600000, &w)) {
                free(allow);
                return 1;
            }
            worker_wait_ms = (uint32_t)w;
        } else if (!strcmp(a, "--worker")) {
            if (n_workers == 64) {
                free(allow);
                return kv_cli_err(CMD, 1, "--worker: at most 64 workers");
            }
            workers[n_workers++] = v;
        } else if (!strcmp(a, "--data")) {
            data_dir = v;
        } else if (!strcmp(a, "--prompt-cache")) {
            if (kv_node_parse_size(v, &o.prompt_cache_bytes, &d) || o.prompt_cache_bytes > ((uint64_t)1 << 40)) {
                free(allow);
                return kv_cli_err(CMD, 1, "--prompt-cache: '%s' is not a size up to 1T (e.g. 512M, 4G, 0 = none)", v);
            }
        } else if (!strcmp(a, "--prompt-cache-block")) {
            if (kv_arg_long(CMD, a, v, 16, KV_RING_MAX_CACHE_BLOCK, &lv)) {
                free(allow);
                return 1;
            }
            if (lv % 16) {
                free(allow);
                return kv_cli_err(CMD, 1, "--prompt-cache-block: '%s' is not a multiple of 16 in [16, %u]", v,
                                  KV_RING_MAX_CACHE_BLOCK);
            }
            o.prompt_cache_block = (uint32_t)lv;
        } else if (!strcmp(a, "--budget")) {
            if (kv_node_parse_size(v, &budget, &d)) {
                free(allow);
                return kv_cli_err(CMD, 1, "--budget: %s", d.msg);
            }
        } else if (!strcmp(a, "--allow-key")) {
            if (kv_key_list_add(v, &allow, &n_allow, &d)) {
                free(allow);
                return kv_cli_err(CMD, 1, "--allow-key: %s", d.msg);
            }
        } else if (!strcmp(a, "--layers")) {
            if (kv_parse_layers(v, &o.first, &o.last))
                return kv_cli_err(CMD, 1, "--layers: '%s' is not A-B with A <= B < %u", v, KV_RING_MAX_LAYERS);
            layers = true;
        } else if (!strcmp(a, "--listen")) {
            o.listen = v;
        } else if (!strcmp(a, "--next")) {
            o.next = v;
        } else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) {
            if (kv_arg_long(CMD, a, v, 1, KV_POOL_MAX_THREADS, &lv)) return 1;
            o.n_threads = (int)lv;
        } else if (!strcmp(a, "--ctx")) {
            if (kv_arg_long(CMD, a, v, 1, 1 << 20, &lv)) return 1;
            o.n_ctx = (uint32_t)lv;
        } else if (!strcmp(a, "--batch")) {
            if (kv_arg_long(CMD, a, v, 1, KV_RING_MAX_TOKENS, &lv)) return 1;
            o.n_batch = (uint32_t)lv;
        } else if (!strcmp(a, "--max-seqs")) {
            if (kv_arg_long(CMD, a, v, 1, 4096, &lv)) return 1;
            o.max_seqs = (uint32_t)lv;
        } else if (!strcmp(a, "--die-after-frames")) { /* test hook (fault tests): a crash at a known point */
            if (kv_arg_long(CMD, a, v, 1, 1L << 30, &lv)) return 1;
            o.die_after_frames = (uint32_t)lv;
        } else if (!strcmp(a, "--test-cache-drop")) { /* test hook (test_ring_cache.sh): a miss at a known START */
            if (kv_arg_long(CMD, a, v, 1, 1L << 30, &lv)) return 1;
            o.test_cache_drop = (uint32_t)lv;
        } else if (!strcmp(a, "--link-delay-ms")) {
            if (kv_arg_long(CMD, a, v, 1, 60000, &lv)) return 1;
            o.link_delay_ms = (uint32_t)lv;
        } else if (!strcmp(a, "--replay-timeout-ms")) {
            if (kv_arg_long(CMD, a, v, 1, 3600000, &lv)) return 1;
            o.replay_timeout_ms = (uint32_t)lv;
        } else {
            return kv_cli_err(CMD, 1, "unknown option '%s' (see kvasir ring --help)", a);
        }
    }
    char manifest[4200];
    if (hub) {
        if (o.model || layers || o.next || !o.listen || !budget) {
            free(allow);
            return kv_cli_err(CMD, 1, "--hub takes --budget and --listen, and replaces --model, --layers and --next");
        }
        if (site) { /* the ring of sites: our site's window, on our site's workers */
            uint32_t nsw = 0;
            if (n_workers) {
                free(allow);
                return kv_cli_err(CMD, 1, "--site takes its workers from the hub's placement, not --worker");
            }
            if (kv_ring_hub_join_site(hub, data_dir, site, &o.first, &o.last, manifest, sizeof manifest, site_workers,
                                      KV_RING_SITE_WORKERS, &nsw, o.log, &d)) {
                free(allow);
                return kv_cli_diag(CMD, &d);
            }
            for (uint32_t k = 0; k < nsw; k++) workers[n_workers++] = site_workers[k];
        } else if (kv_ring_hub_join(hub, data_dir, budget, &o.first, &o.last, manifest, sizeof manifest, o.log, &d)) {
            free(allow);
            return kv_cli_diag(CMD, &d);
        }
        o.model = manifest;
        layers = true;
        if (!has_hub_key) { /* the hub it joined vouches for clients */
            if (kv_node_fetch_hub_key(hub, hub_key, &d)) {
                free(allow);
                return kv_cli_diag(CMD, &d);
            }
            has_hub_key = true;
        }
    }
    if (site && !hub) {
        free(allow);
        return kv_cli_err(CMD, 1, "--site needs --hub URL (the hub's placement gives the site its window)");
    }
    o.hub_key = has_hub_key ? hub_key : NULL;
    if (!o.model || !layers || !o.listen || (!o.next && !hub)) {
        free(allow);
        return kv_cli_err(CMD, 1, "needs --model, --layers, --listen and --next (see kvasir ring --help)");
    }
    kv_node_key key;
    if (key_path) {
        if (kv_key_file_load(&key, key_path, true, &d)) {
            free(allow);
            return kv_cli_diag(CMD, &d);
        }
        o.key_sk = key.sk;
    }
    o.workers = workers;
    o.n_workers = n_workers;
    o.worker_wait_ms = worker_wait_ms;
    o.allow_keys = (const uint8_t(*)[32])allow;
    o.n_allow = n_allow;
    kv_ring_node *n = NULL;
    int nrc = kv_ring_node_new(&n, &o, &d);
    free(allow);
    memset(&key, 0, sizeof key);
    if (nrc) return kv_cli_diag(CMD, &d);
    kv_ring_node_stats st;
    kv_ring_node_get_stats(n, &st);
    if (o.log)
        fprintf(stderr, "kvasir ring %u-%u: window of %llu bytes of weights (%.2f MiB), next %s\n", o.first, o.last,
                (unsigned long long)st.weight_bytes, (double)st.weight_bytes / 1048576.0, o.next ? o.next : "from the hub");
    kv_ring_hub *rh = NULL;
    if (hub && kv_ring_hub_start_site(&rh, hub, data_dir, n, budget, site, o.log, &d)) {
        kv_ring_node_free(n);
        return kv_cli_diag(CMD, &d);
    }
    kv_the_node = n;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = kv_on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    printf("listening on %s\n", kv_ring_node_addr(n));
    fflush(stdout);
    int rc = kv_ring_node_run(n, &d);
    kv_ring_node_get_stats(n, &st);
    if (o.log)
        fprintf(stderr, "kvasir ring %u-%u: %llu tokens computed in %llu frames, %llu passes (%.3f s busy), %llu sampled, "
                "%llu requests, %llu replays, %llu breaks\n", o.first, o.last, (unsigned long long)st.tokens_computed,
                (unsigned long long)st.frames_hidden, (unsigned long long)st.batches, st.busy_s, (unsigned long long)st.tokens_sampled,
                (unsigned long long)st.requests, (unsigned long long)st.replays, (unsigned long long)st.breaks);
    if (o.log && o.prompt_cache_bytes)
        fprintf(stderr, "kvasir ring %u-%u: prompt cache: %llu lookups, %llu hits, %llu positions reused, %llu misses, "
                "%llu blocks held (%llu bytes), %llu evicted\n", o.first, o.last, (unsigned long long)st.cache_lookups,
                (unsigned long long)st.cache_hits, (unsigned long long)st.cache_tokens, (unsigned long long)st.cache_misses,
                (unsigned long long)st.cache_blocks, (unsigned long long)st.cache_bytes,
                (unsigned long long)st.cache_evictions);
    kv_the_node = NULL;
    kv_ring_hub_stop(rh);
    kv_ring_node_free(n);
    return rc ? kv_cli_diag(CMD, &d) : 0;
}
