/* kvasir gateway: serve a model over the OpenAI, Anthropic and Ollama HTTP
 * APIs with continuous batching (kvasir/gateway.h). Parses flags, opens the
 * engine from the same model sources `kvasir run` takes, and serves until
 * SIGINT/SIGTERM. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sodium.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/cli.h"
#include "kvasir/transport.h"
#include "kvasir/dispatch_evidence.h"
#include "kvasir/dispatch_remote.h"
#include "kvasir/engine.h"
#include "kvasir/gateway.h"
#include "kvasir/hub.h"
#include "kvasir/https.h"
#include "kvasir/ledger.h"
#include "kvasir/node.h"
#include "kvasir/pool.h"
#include "kvasir/ring.h"
#include "kvasir/verify.h"

#define CMD "gateway"

static const char *const kv_value_flags[] = {"-m", "--model", "--listen", "--worker", "--api-key", "--api-keys",
                                             "--name", "--ctx", "-c", "--threads", "-t", "--batch", "-b",
                                             "--parallel", "--queue", "--max-conns", "--per-ip", "--timeout", "--request-timeout", "--parse-max",
                                             "--body-max", "--max-tokens", "--worker-timeout-ms", "--hub", "--key", "--data",
                                             "--hub-refresh-ms", "--step-retry-ms", "--ledger", "--gateway-key",
                                             "--local-experts", "--step-target-ms",
                                             "--gateway-id", "--prices", "--verify-recompute", "--ring", "--ring-timeout-ms", "--placement",
                                             "--chat-template", "--prompt-cache", "--cors", "--draft", "--draft-max",
                                             "--tls-cert", "--tls-key", NULL};

static const char *kv_gateway_help =
    "usage: kvasir gateway (-m MODEL | --hub URL | --ring HOST:PORT) [--listen HOST:PORT] [options]\n"
    "  -m, --model F        GGUF file, or DIR/manifest.json (or DIR) of a sliced model\n"
    "  --worker HOST:PORT   sliced model: experts on this worker (repeat for more)\n"
    "  --hub URL            take the model from a hub (https://HOST:PORT#sha256=<64 hex> pins a TLS\n"
    "                       hub by its fingerprint): manifest and backbone fetched into --data,\n"
    "                       experts on the live nodes of its placement map, read again every\n"
    "                       --hub-refresh-ms (default 2000) and after a failed step\n"
    "  --data DIR           with --hub: where the coordinator's pieces are kept (default kvasir-data)\n"
    "  --ring HOST:PORT     serve a ring (kvasir ring): every request is submitted to this node, which\n"
    "                       tokenizes it (the same chat template) and streams the tokens back;\n"
    "                       concurrent requests are concurrent ring sequences (at most --parallel);\n"
    "                       repeat for more entry nodes (tried in turn, those that see the ring whole\n"
    "                       first); /health asks each whether the ring is whole every second. The\n"
    "                       client key is --key (with --hub URL: and that hub's voucher for it, for\n"
    "                       nodes started with --hub-key); no -m, --worker, --ledger or --verify\n"
    "  --ring-timeout-ms N  with --ring: longest wait for one frame from the ring (default 60000)\n"
    "  --placement P        with --hub: sites, experts or auto (default). sites serves the hub's ring of\n"
    "                       sites (each site a window of layers on its own workers: one crossing per\n"
    "                       site per token; docs/HUB.md \"Sites\") and fails when the hub publishes\n"
    "                       none; experts dispatches every MoE layer to the workers (one round trip\n"
    "                       per layer); auto takes sites when the hub publishes them at start\n"
    "  --step-retry-ms N    with workers: a step that fails (an expert with no holder up) is\n"
    "                       retried this long before its requests fail (default 30000)\n"
    "  --worker-timeout-ms N  per-layer deadline before a worker is dropped (default 10000)\n"
    "  --local-experts SIZE with workers: hold up to SIZE of the slabs in the manifest's folder (the\n"
    "                       hottest by measured demand, e.g. 64M, 2G) and compute them here while steps\n"
    "                       are fast; a growing share goes to the workers as the load rises, and comes\n"
    "                       back when it falls (docs/GATEWAY.md \"Local experts\"; /metrics)\n"
    "  --step-target-ms MS  with --local-experts: the step time past which work is handed to workers\n"
    "                       (0.01..60000; default: twice the shortest step computed locally)\n"
    "  --key FILE           the coordinator key proved to workers, or to ring nodes (default\n"
    "                       DATA/coordinator.key with --hub, else ~/.kvasir/coordinator.key; created if absent)\n"
    "  --listen HOST:PORT   bind address (default 127.0.0.1:8080; port 0 = any free port,\n"
    "                       printed on stdout as \"listening on HOST:PORT\")\n"
    "  --tls-cert FILE      serve https with this PEM certificate (and --tls-key FILE, its PEM key);\n"
    "                       its fingerprint is printed as \"tls sha256:<64 hex digits>\"\n"
    "  --insecure-plaintext for a network you own (prints a warning): serve plain HTTP on an\n"
    "                       address that is not loopback (without it or --tls-cert such an\n"
    "                       address is refused), and dial workers over plain TCP, without TLS\n"
    "                       (default: TLS 1.3 pinned to each worker's key)\n"
    "  --no-web-ui          no chat page at / (GET / and /index.html answer 404); the page is on\n"
    "                       by default (docs/GATEWAY.md \"The chat page\")\n"
    "  --name NAME          the model id clients use (default: the file name without .gguf)\n"
    "  --api-key KEY        accept this key (Authorization: Bearer KEY or x-api-key); repeatable\n"
    "  --api-keys FILE      accept the keys in FILE (one a line, # comments)\n"
    "  --ctx N              positions per session (default: the model's)\n"
    "  --parallel N         sessions in the running batch (default 16)\n"
    "  --queue N            requests waiting for a slot before 503 (default 64)\n"
    "  --max-conns N        open connections (default 256); --per-ip N per client IP, an IPv6 /64\n"
    "                       counted as one (default 16). When full, the address holding the most\n"
    "                       incomplete requests yields one connection to a newcomer\n"
    "  --timeout S          idle connection timeout in seconds (default 120)\n"
    "  --request-timeout S  a request's headers and body must arrive within S seconds, however slowly\n"
    "                       they trickle in (default 30)\n"
    "  --parse-max BYTES    memory one request's parsed JSON may hold, 413 beyond (default 4 x the body\n"
    "                       limit + 1 MiB); all requests' together at most 4x that or 256 MiB\n"
    "  --body-max BYTES     request body limit (default 1048576)\n"
    "  --max-tokens N       tokens per request when it names none (default 512)\n"
    "  --threads N          compute threads (default: all CPUs); --batch N prompt tokens per step\n"
    "  --prompt-cache SIZE  memory for the prompt cache (prefixes reused across requests: KV blocks\n"
    "                       and recurrent states, least recently used evicted), e.g. 512M, 4G; 0 = off\n"
    "                       (default 1G; at most 1T; docs/GATEWAY.md)\n"
    "  --draft SRC          speculative decoding: none (default), ngram or mtp; the same tokens with\n"
    "                       fewer forward passes (docs/SPECULATIVE.md); --draft-max K drafted tokens\n"
    "                       per pass, 1..15 (default 3); /metrics reports acceptance. With a ring\n"
    "                       (--ring, --placement sites): ngram, mtp or test:FILE:P[:SEED], drafted by\n"
    "                       the ring's last node (k + 1 positions per crossing)\n"
    "  --ledger FILE        charge every completion in KVR (docs/LEDGER.md): requests must carry\n"
    "                       X-KVR-Payment (kvasir wallet pay --gateway ID); GET /v1/prices\n"
    "  --gateway-key FILE   the gateway's node key (kvasir wallet new or kvasir key; default: --key's)\n"
    "  --gateway-id ID      the id authorizations name (default gw- and 24 hex of the key)\n"
    "  --prices P,C         micro-KVR per prompt token and per completion token (default 1,2)\n"
    "  --chat-template FILE render chat prompts with this Jinja template (at most 1 MiB) instead of\n"
    "                       the model's own (tokenizer.chat_template; a model without one gets ChatML);\n"
    "                       with --ring it is rendered here and sent as the prompt\n"
    "  --verify             check every worker answer (Freivalds, docs/VERIFY.md) against the slabs\n"
    "                       in the manifest's folder; a worker caught lying is dropped for good, its\n"
    "                       part redone before any token goes out, reported to --hub, and (with\n"
    "                       --ledger) never paid again: sessions not yet settled ask it for no\n"
    "                       receipt, so its share goes back to the consumer\n"
    "  --verify-recompute R also recompute a fraction R of the answers in full (implies --verify)\n"
    "  --cors ORIGIN        answer browsers from ORIGIN (SCHEME://HOST[:PORT], or * for any) with\n"
    "                       Access-Control-Allow-Origin, and their OPTIONS preflights with 204;\n"
    "                       repeat or give a comma list (at most 32). Without it: no CORS headers\n"
    "  --quiet              no request log lines and no model summary on stderr\n";

/* The engine's on_caught for the gateway: the CLI's line and hub report
 * (kv_cli_caught), then the key recorded in the gateway so that it is not
 * paid. The gateway starts after the engine opens, before any step runs. */
typedef struct kv_gw_caught_ctx {
    kv_cli_auth *auth;
    _Atomic(kv_gateway *) g;
} kv_gw_caught_ctx;
static void kv_gw_on_caught(void *arg, uint32_t worker, const char *addr, const uint8_t key[32], const char *why,
                            const struct kv_evidence *ev) {
    kv_gw_caught_ctx *c = arg;
    kv_cli_caught(c->auth, worker, addr, key, why, ev);
    kv_gateway_caught(atomic_load(&c->g), key);
}

/* SIGINT/SIGTERM write a byte that the main thread's read() waits for.
 * Not a flag and pause(): the handler may run on any of the gateway's
 * threads (HTTP, scheduler, pool), and a signal taken between testing a
 * flag and pause() would leave the main thread asleep; a byte in a pipe
 * is never lost. */
static int kv_gw_stop_pipe[2] = {-1, -1};
static void kv_gw_on_signal(int sig) {
    (void)sig;
    const int e = errno;
    const ssize_t r = write(kv_gw_stop_pipe[1], "x", 1);
    (void)r;
    errno = e;
}

/* --chat-template FILE: read whole, at most KV_GATEWAY_MAX_TEMPLATE bytes
 * (the gateway parses it at start). 0, or 1 with the error printed. */
static int kv_gw_read_template(const char *path, char **out, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return kv_cli_err(CMD, 1, "--chat-template: cannot open '%s': %s", path, strerror(errno));
    char *b = malloc(KV_GATEWAY_MAX_TEMPLATE + 1);
    size_t n = b ? fread(b, 1, KV_GATEWAY_MAX_TEMPLATE + 1, f) : 0;
    const bool err = ferror(f);
    fclose(f);
    if (!b) return kv_cli_err(CMD, 1, "--chat-template: out of memory");
    if (err || n > KV_GATEWAY_MAX_TEMPLATE) {
        free(b);
        if (err) return kv_cli_err(CMD, 1, "--chat-template: cannot read '%s'", path);
        return kv_cli_err(CMD, 1, "--chat-template: '%s' is over %u bytes", path, KV_GATEWAY_MAX_TEMPLATE);
    }
    if (n == 0) {
        free(b);
        return kv_cli_err(CMD, 1, "--chat-template: '%s' is empty", path);
    }
    b[n] = 0;
    *out = b;
    *len = n;
    return 0;
}

int kv_cmd_gateway(int argc, char **argv) {
    const char *model = NULL, *listen = "127.0.0.1:8080", *name = NULL, *keyfile = NULL, *coord_key = NULL;
    kv_cli_auth auth = {0};
    const char *workers[KV_REMOTE_MAX_WORKERS];
    const char *rings[KV_GATEWAY_MAX_RING];
    uint32_t n_rings = 0;
    const char *placement = "auto";
    static char site_rings[KV_GATEWAY_MAX_RING][KV_RING_HUB_ADDR + 1];
    long ring_timeout = 60000;
    const char *tmpl_path = NULL;
    char *tmpl = NULL;
    size_t tmpl_len = 0;
    const char *keys[KV_GATEWAY_MAX_KEYS];
    uint32_t n_workers = 0, n_keys = 0;
    long n_ctx = 0, threads = 0, n_batch = 256, parallel = 16, queue = 64, max_conns = 256, per_ip = 16;
    long request_s = 30, parse_max = 0;
    uint64_t prompt_cache = (uint64_t)1 << 30;
    bool prompt_cache_given = false;
    const char *draft = NULL;
    long draft_max = 0;
    long timeout = 120, body_max = 1 << 20, max_tokens = 512, worker_timeout = 10000;
    const char *ledger = NULL, *gw_key = NULL, *gw_id = NULL;
    uint64_t price_p = 1, price_c = 2;
    long hub_refresh = 2000, step_retry = 30000;
    uint64_t local_experts = 0; /* --local-experts: bytes of slabs held here */
    double step_target = 0;     /* --step-target-ms */
    const char *hub = NULL, *data_dir = "kvasir-data";
    const char *tls_cert = NULL, *tls_key = NULL;
    bool insecure = false, no_web_ui = false;
    static kv_https_cert tls; /* served while the gateway runs */
    char hub_manifest[4200];
    char **hub_workers = NULL;
    uint32_t n_hub_workers = 0;
    bool verify = false, quiet = false;
    bool insecure_plaintext = false;
    double verify_rate = 0;
    const char *cors[KV_GATEWAY_MAX_CORS];
    uint32_t n_cors = 0;
    char cors_buf[KV_GATEWAY_MAX_CORS * (KV_GATEWAY_MAX_ORIGIN_LEN + 1)];
    size_t cors_used = 0;
    const kv_verify_opts vopts = {0};
    kv_gw_caught_ctx caught = {.auth = &auth};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_gateway_help, stdout);
            return 0;
        } else if (!strcmp(a, "--insecure-plaintext")) { /* both: the API and the links to workers */
            insecure_plaintext = insecure = true;
            kv_link_warn_plaintext("gateway");
        } else if (!strcmp(a, "--verify")) {
            verify = true;
        } else if (!strcmp(a, "--quiet")) {
            quiet = true;
        } else if (!strcmp(a, "--no-web-ui")) {
            no_web_ui = true;
        } else if (!(v = kv_arg_value(CMD, argc, argv, &i, kv_value_flags))) {
            return 1;
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            model = v;
        } else if (!strcmp(a, "--hub")) {
            hub = v;
        } else if (!strcmp(a, "--tls-cert")) {
            tls_cert = v;
        } else if (!strcmp(a, "--tls-key")) {
            tls_key = v;
        } else if (!strcmp(a, "--placement")) {
            if (strcmp(v, "sites") && strcmp(v, "experts") && strcmp(v, "auto"))
                return kv_cli_err(CMD, 1, "--placement: '%s' is not sites, experts or auto", v);
            placement = v;
        } else if (!strcmp(a, "--ring")) {
            if (n_rings == KV_GATEWAY_MAX_RING)
                return kv_cli_err(CMD, 1, "--ring: at most %u entry nodes", KV_GATEWAY_MAX_RING);
            rings[n_rings++] = v;
        } else if (!strcmp(a, "--chat-template")) {
            tmpl_path = v;
        } else if (!strcmp(a, "--cors")) {
            /* ORIGIN or a comma list: each copied apart (the library checks its form) */
            for (const char *p = v; *p;) {
                const char *e = strchr(p, ',');
                const size_t l = e ? (size_t)(e - p) : strlen(p);
                if (!l || l > KV_GATEWAY_MAX_ORIGIN_LEN)
                    return kv_cli_err(CMD, 1, "--cors: '%.64s' holds an empty origin or one over %u bytes", v,
                                      KV_GATEWAY_MAX_ORIGIN_LEN);
                if (n_cors == KV_GATEWAY_MAX_CORS) return kv_cli_err(CMD, 1, "--cors: at most %u origins", KV_GATEWAY_MAX_CORS);
                memcpy(cors_buf + cors_used, p, l);
                cors_buf[cors_used + l] = 0;
                cors[n_cors++] = cors_buf + cors_used;
                cors_used += l + 1;
                p += l + (e ? 1 : 0);
                if (e && !*p) return kv_cli_err(CMD, 1, "--cors: '%.64s' ends with a comma", v);
            }
        } else if (!strcmp(a, "--ring-timeout-ms")) {
            if (kv_arg_long(CMD, a, v, 1, 3600000, &ring_timeout)) return 1;
        } else if (!strcmp(a, "--verify-recompute")) {
            float f;
            if (kv_arg_float(CMD, a, v, 0, 1, &f)) return 1;
            verify_rate = f;
            verify = true;
        } else if (!strcmp(a, "--ledger")) {
            ledger = v;
        } else if (!strcmp(a, "--gateway-key")) {
            gw_key = v;
        } else if (!strcmp(a, "--gateway-id")) {
            gw_id = v;
        } else if (!strcmp(a, "--prices")) {
            char *end = NULL;
            const char *comma = strchr(v, ',');
            if (!comma || kv_arg_u64(CMD, a, comma + 1, &price_c))
                return kv_cli_err(CMD, 1, "--prices: '%s' is not PROMPT,COMPLETION (micro-KVR per token)", v);
            errno = 0;
            const unsigned long long pp = strtoull(v, &end, 10);
            if (end != comma || v[0] < '0' || v[0] > '9' || errno)
                return kv_cli_err(CMD, 1, "--prices: '%s' is not PROMPT,COMPLETION (micro-KVR per token)", v);
            price_p = pp;
            if (price_p > KV_LEDGER_MAX_AMOUNT || price_c > KV_LEDGER_MAX_AMOUNT)
                return kv_cli_err(CMD, 1, "--prices: at most %llu micro-KVR per token",
                                  (unsigned long long)KV_LEDGER_MAX_AMOUNT);
        } else if (!strcmp(a, "--key")) {
            coord_key = v;
        } else if (!strcmp(a, "--data")) {
            data_dir = v;
        } else if (!strcmp(a, "--hub-refresh-ms")) {
            if (kv_arg_long(CMD, a, v, 10, 3600000, &hub_refresh)) return 1;
        } else if (!strcmp(a, "--local-experts")) {
            kv_diag sd = {0};
            if (kv_node_parse_size(v, &local_experts, &sd) || !local_experts || local_experts > ((uint64_t)1 << 50))
                return kv_cli_err(CMD, 1, "--local-experts: '%s' is not a size from 1 byte to 1P (e.g. 64M, 2G)", v);
        } else if (!strcmp(a, "--step-target-ms")) {
            float st;
            if (kv_arg_float(CMD, a, v, 0.01, 60000, &st)) return 1;
            step_target = st;
        } else if (!strcmp(a, "--step-retry-ms")) {
            if (kv_arg_long(CMD, a, v, 1, 3600000, &step_retry)) return 1;
        } else if (!strcmp(a, "--listen")) {
            listen = v;
        } else if (!strcmp(a, "--name")) {
            name = v;
        } else if (!strcmp(a, "--worker")) {
            if (n_workers == KV_REMOTE_MAX_WORKERS)
                return kv_cli_err(CMD, 1, "--worker: at most %u workers", KV_REMOTE_MAX_WORKERS);
            workers[n_workers++] = v;
        } else if (!strcmp(a, "--api-key")) {
            if (n_keys == KV_GATEWAY_MAX_KEYS) return kv_cli_err(CMD, 1, "--api-key: at most %u keys", KV_GATEWAY_MAX_KEYS);
            if (!*v || strlen(v) > KV_GATEWAY_MAX_KEY_LEN)
                return kv_cli_err(CMD, 1, "--api-key: a key is 1 to %u bytes", KV_GATEWAY_MAX_KEY_LEN);
            keys[n_keys++] = v;
        } else if (!strcmp(a, "--api-keys")) {
            keyfile = v;
        } else if (!strcmp(a, "--ctx") || !strcmp(a, "-c")) {
            if (kv_arg_long(CMD, a, v, 1, KV_MAX_CTX, &n_ctx)) return 1;
        } else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) {
            if (kv_arg_long(CMD, a, v, 1, KV_POOL_MAX_THREADS, &threads)) return 1;
        } else if (!strcmp(a, "--batch") || !strcmp(a, "-b")) {
            if (kv_arg_long(CMD, a, v, 1, 4096, &n_batch)) return 1;
        } else if (!strcmp(a, "--prompt-cache")) {
            kv_diag sd = {0};
            if (kv_node_parse_size(v, &prompt_cache, &sd) || prompt_cache > ((uint64_t)1 << 40))
                return kv_cli_err(CMD, 1, "--prompt-cache: '%s' is not a size up to 1T (e.g. 512M, 4G, 0 = off)", v);
            prompt_cache_given = true;
        } else if (!strcmp(a, "--draft")) {
            if (strlen(v) > 4096) return kv_cli_err(CMD, 1, "--draft: longer than 4096 bytes");
            draft = v;
        } else if (!strcmp(a, "--draft-max")) {
            if (kv_arg_long(CMD, a, v, 1, 15, &draft_max)) return 1;
        } else if (!strcmp(a, "--parallel")) {
            if (kv_arg_long(CMD, a, v, 1, KV_ENGINE_MAX_SESSIONS, &parallel)) return 1;
        } else if (!strcmp(a, "--queue")) {
            if (kv_arg_long(CMD, a, v, 1, 1 << 16, &queue)) return 1;
        } else if (!strcmp(a, "--max-conns")) {
            if (kv_arg_long(CMD, a, v, 1, 1 << 16, &max_conns)) return 1;
        } else if (!strcmp(a, "--per-ip")) {
            if (kv_arg_long(CMD, a, v, 1, 1 << 16, &per_ip)) return 1;
        } else if (!strcmp(a, "--timeout")) {
            if (kv_arg_long(CMD, a, v, 1, 86400, &timeout)) return 1;
        } else if (!strcmp(a, "--request-timeout")) {
            if (kv_arg_long(CMD, a, v, 1, 86400, &request_s)) return 1;
        } else if (!strcmp(a, "--parse-max")) {
            if (kv_arg_long(CMD, a, v, 64L << 10, 1L << 32, &parse_max)) return 1;
        } else if (!strcmp(a, "--body-max")) {
            if (kv_arg_long(CMD, a, v, 1024, KV_GATEWAY_MAX_BODY, &body_max)) return 1;
        } else if (!strcmp(a, "--max-tokens")) {
            if (kv_arg_long(CMD, a, v, 1, 1 << 20, &max_tokens)) return 1;
        } else if (!strcmp(a, "--worker-timeout-ms")) {
            if (kv_arg_long(CMD, a, v, 1, 3600000, &worker_timeout)) return 1;
        } else {
            return kv_cli_err(CMD, 1, "unknown option '%s' (see kvasir gateway --help)", a);
        }
    }
    if (hub && (model || n_workers)) return kv_cli_err(CMD, 1, "--hub replaces -m and --worker: give one or the other");
    if (strcmp(placement, "auto") && (!hub || n_rings))
        return kv_cli_err(CMD, 1, "--placement %s needs --hub URL and no --ring", placement);
    if (hub && !n_rings && strcmp(placement, "experts")) { /* the hub's ring of sites, when it publishes one */
        kv_diag sd = {0};
        char why[300];
        uint32_t ns = 0;
        bool unreached = false; /* auto: the hub's own error comes next, from the manifest */
        if (kv_ring_hub_site_entries(hub, site_rings, KV_GATEWAY_MAX_RING, &ns, why, sizeof why, &sd)) {
            if (!strcmp(placement, "sites")) return kv_cli_err(CMD, 2, "--placement sites: %s", sd.msg);
            snprintf(why, sizeof why, "%.250s", sd.msg);
            unreached = true;
        }
        if (ns && ledger && !strcmp(placement, "auto")) {
            snprintf(why, sizeof why, "--ledger is not served over a ring");
            ns = 0;
        }
        if (!ns && !strcmp(placement, "sites")) return kv_cli_err(CMD, 2, "--placement sites: the hub's %s", why);
        for (uint32_t k = 0; k < ns; k++) rings[n_rings++] = site_rings[k];
        if (!quiet && ns) fprintf(stderr, "gateway: placement sites: the hub's ring of %u sites\n", ns);
        else if (!quiet && !unreached) fprintf(stderr, "gateway: placement experts: per-layer dispatch (%s)\n", why);
    }
    if (step_target > 0 && !local_experts) return kv_cli_err(CMD, 1, "--step-target-ms needs --local-experts SIZE");
    if (local_experts && (n_rings || !(n_workers || hub)))
        return kv_cli_err(CMD, 1, "--local-experts needs a sliced model and workers (-m DIR --worker HOST:PORT, or --hub URL)");
    if (n_rings && (model || n_workers || verify))
        return kv_cli_err(CMD, 1, "--ring replaces -m, --worker and --verify: the ring holds the model");
    if (n_rings && prompt_cache_given && prompt_cache)
        return kv_cli_err(CMD, 1, "--prompt-cache with --ring: a ring's prompt cache is on its nodes (kvasir ring "
                          "--prompt-cache SIZE on each; docs/GATEWAY.md \"Prompt cache\"), which hold the KV of their "
                          "windows; the gateway reports what they reuse");
    if (draft_max && !draft) return kv_cli_err(CMD, 1, "--draft-max needs --draft");
    if (n_rings && draft) { /* over a ring the tail drafts: ngram, or a test recording sent with each request */
        kv_ring_params tp = {0};
        int32_t *trec = NULL;
        kv_diag dd = {0};
        const int drc = kv_ring_draft_params(draft, (uint32_t)draft_max, &tp, &trec, &dd);
        free(trec);
        if (drc) return kv_cli_err(CMD, 1, "%s", dd.msg);
    }
    if (n_rings && ledger)
        return kv_cli_err(CMD, 1, "--ledger with --ring is not supported yet (docs/GATEWAY.md \"A ring\"): the gateway "
                          "must hold a payment before compute, and only the ring knows the prompt's token count");
    if (!model && !hub && !n_rings)
        return kv_cli_err(CMD, 1, "missing -m MODEL, --hub URL or --ring HOST:PORT (see kvasir gateway --help)");
    if (!ledger && (gw_key || gw_id))
        return kv_cli_err(CMD, 1, "--gateway-key and --gateway-id need --ledger FILE");
    char def_key[4200];
    if (ledger && !gw_key) {
        /* the gateway's node account defaults to its coordinator key */
        kv_node_key k;
        if (kv_cli_key(CMD, coord_key, hub ? data_dir : NULL, &k)) return 1; /* creates the default one */
        sodium_memzero(&k, sizeof k);
        const char *home = getenv("HOME");
        if (hub) snprintf(def_key, sizeof def_key, "%s/coordinator.key", data_dir);
        else snprintf(def_key, sizeof def_key, "%s/.kvasir/coordinator.key", home ? home : "");
        gw_key = coord_key ? coord_key : def_key;
    }
    /* HOST:PORT, [v6]:PORT */
    char host[128];
    long port;
    {
        const char *colon = strrchr(listen, ':');
        if (!colon || colon == listen) return kv_cli_err(CMD, 1, "--listen: '%s' is not HOST:PORT", listen);
        size_t hl = (size_t)(colon - listen);
        const char *h = listen;
        if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') {
            h++;
            hl -= 2;
        }
        if (hl >= sizeof host) return kv_cli_err(CMD, 1, "--listen: host too long");
        memcpy(host, h, hl);
        host[hl] = 0;
        if (kv_arg_long(CMD, "--listen", colon + 1, 0, 65535, &port)) return 1;
    }
    char **fkeys = NULL;
    uint32_t n_fkeys = 0;
    kv_diag d = {0};
    if (!tls_cert != !tls_key) return kv_cli_err(CMD, 1, "--tls-cert and --tls-key go together");
    if (insecure && tls_cert) return kv_cli_err(CMD, 1, "--insecure-plaintext contradicts --tls-cert");
    /* before any model is loaded: a plain API on a public address is refused at once */
    if (kv_https_listen_check_host(host, tls_cert != NULL, insecure, "gateway", &d)) return kv_cli_diag(CMD, &d);
    if (tls_cert && kv_https_cert_load(&tls, tls_cert, tls_key, &d)) return kv_cli_diag(CMD, &d);
    if (insecure)
        fprintf(stderr, "gateway: WARNING: --insecure-plaintext: the API (prompts, answers, API keys) is served "
                        "unencrypted on %s\n", listen);
    if (keyfile) {
        if (kv_gateway_keys_load(keyfile, &fkeys, &n_fkeys, &d)) return kv_cli_diag(CMD, &d);
        for (uint32_t i = 0; i < n_fkeys; i++) {
            if (n_keys == KV_GATEWAY_MAX_KEYS) {
                kv_gateway_keys_free(fkeys, n_fkeys);
                return kv_cli_err(CMD, 1, "--api-keys: at most %u keys in all", KV_GATEWAY_MAX_KEYS);
            }
            keys[n_keys++] = fkeys[i];
        }
        if (!n_fkeys) {
            kv_gateway_keys_free(fkeys, n_fkeys);
            return kv_cli_err(CMD, 1, "--api-keys: '%s' holds no key", keyfile);
        }
    }
    char mname[256];
    if (name) {
        snprintf(mname, sizeof mname, "%s", name);
    } else if (!model) { /* --hub, --ring */
        snprintf(mname, sizeof mname, "kvasir");
    } else {
        const char *b = strrchr(model, '/');
        b = b ? b + 1 : model;
        snprintf(mname, sizeof mname, "%s", b);
        size_t l = strlen(mname);
        if (l > 5 && !strcmp(mname + l - 5, ".gguf")) mname[l -= 5] = 0;
        unsigned a, b2; /* a split model: its name, whichever part was given */
        int at = -1;
        if (l > 15 && sscanf(mname + l - 15, "-%5u-of-%5u%n", &a, &b2, &at) == 2 && at == 15) mname[l - 15] = 0;
        if (!strcmp(mname, "manifest.json") || !mname[0]) snprintf(mname, sizeof mname, "kvasir");
    }
    kv_engine *e = NULL;
    kv_gateway *g = NULL;
    int rc = 0;
    if (tmpl_path && kv_gw_read_template(tmpl_path, &tmpl, &tmpl_len)) {
        kv_gateway_keys_free(fkeys, n_fkeys);
        return 1;
    }
    kv_node_key ring_key;
    if (n_rings) { /* no engine: the ring computes; the gateway proves its key to the entry nodes */
        if (kv_cli_key(CMD, coord_key, NULL, &ring_key)) {
            rc = 1;
            goto done;
        }
        kv_voucher rv; /* --hub with --ring: the hub's voucher for the key, for nodes that trust it */
        if (hub && kv_node_fetch_auth(hub, &ring_key, NULL, 0, NULL, &rv, &d)) {
            sodium_memzero(&ring_key, sizeof ring_key);
            rc = kv_cli_diag(CMD, &d);
            goto done;
        }
        const kv_gateway_opts ro = {.host = host, .port = (uint16_t)port, .model_name = mname, .api_keys = keys,
                                    .n_api_keys = n_keys, .max_active = (uint32_t)parallel,
                                    .queue_max = (uint32_t)queue, .max_conns = (uint32_t)max_conns,
                                    .per_ip_conns = (uint32_t)per_ip, .timeout_s = (uint32_t)timeout,
                                    .request_s = (uint32_t)request_s, .parse_max = (size_t)parse_max,
                                    .body_max = (size_t)body_max, .max_tokens_default = (uint32_t)max_tokens,
                                    .ring_addrs = rings, .n_ring = n_rings, .ring_key_sk = ring_key.sk,
                                    .ring_voucher = hub ? &rv : NULL,
                                    .ring_timeout_ms = (uint32_t)ring_timeout, .chat_template = tmpl,
                                    .ring_draft = n_rings ? draft : NULL, .ring_draft_max = (uint32_t)draft_max,
                                    .chat_template_len = tmpl_len, .chat_template_name = tmpl_path,
                                    .tls = tls_cert ? &tls : NULL, .insecure_plaintext = insecure,
                                    .cors_origins = cors, .n_cors = n_cors, .quiet = quiet,
                                    .no_web_ui = no_web_ui};
        rc = kv_gateway_start(&g, NULL, &ro, &d);
        sodium_memzero(&ring_key, sizeof ring_key);
        if (rc) {
            rc = kv_cli_diag(CMD, &d);
            goto done;
        }
        goto serve;
    }
    if (hub) {
        /* the coordinator folder from the hub; the workers from its placement
           map now, and later ones as they come (so none yet is fine) */
        hub_manifest[0] = 0;
        rc = kv_node_fetch_coordinator(hub, data_dir, hub_manifest, sizeof hub_manifest, &hub_workers,
                                       &n_hub_workers, NULL, NULL, &d);
        if (rc == KV_ENOTFOUND && hub_manifest[0]) {
            fprintf(stderr, "kvasir gateway: %s; waiting for nodes (/health is 503 until every shard is covered)\n",
                    d.msg);
            rc = 0;
        }
        if (rc) {
            rc = kv_cli_diag(CMD, &d);
            goto done;
        }
        n_workers = n_hub_workers; /* as many as the map keeps: the list is hub_workers */
        model = hub_manifest;
    }
    if ((n_workers || hub) &&
        (rc = kv_cli_auth_setup(CMD, coord_key, hub, data_dir, hub_workers, n_hub_workers, &auth)))
        goto done;
    const kv_engine_opts eo = {.n_threads = (int)threads, .n_ctx = (uint32_t)n_ctx, .n_batch = (uint32_t)n_batch,
                               .max_sessions = (uint32_t)parallel, .n_workers = n_workers,
                               .workers = hub ? (const char *const *)hub_workers : workers, /* hub: all the map keeps */
                               .worker_timeout_ms = (uint32_t)worker_timeout, .log = stderr,
                               .max_workers = hub ? KV_REMOTE_MAX_WORKERS : 0, .allow_uncovered = hub != NULL,
                               .key_sk = auth.key.sk, .voucher = auth.has_voucher ? &auth.voucher : NULL,
                               .insecure_plaintext = insecure_plaintext,
                               .worker_keys = (const uint8_t(*)[32])auth.worker_keys,
                               .verify = verify ? &vopts : NULL, .recompute_rate = verify_rate,
                               .on_caught = kv_gw_on_caught, .caught_arg = &caught, .prefault = true,
                               .prompt_cache_bytes = prompt_cache, .draft = draft,
                               .draft_max = (uint32_t)draft_max};
    char down[sizeof d.msg] = "";
    const int erc = kv_engine_open(&e, model, &eo, &d);
    if (erc == KV_EUNSUPPORTED && strncmp(d.msg, "mtp:", 4)) { /* a type no backend computes: the gateway says
                                                                  so (503), not a dead port; a --draft it cannot
                                                                  run is a flag error */
        snprintf(down, sizeof down, "%s", d.msg);
        fprintf(stderr, "kvasir gateway: %s: /health and every prompt answer 503\n", down);
    } else if (erc) {
        rc = kv_cli_diag(CMD, &d);
        goto done;
    }
    const kv_gateway_opts go = {.host = host, .port = (uint16_t)port, .model_name = mname, .api_keys = keys,
                                .n_api_keys = n_keys, .max_active = (uint32_t)parallel, .queue_max = (uint32_t)queue,
                                .max_conns = (uint32_t)max_conns, .per_ip_conns = (uint32_t)per_ip,
                                .timeout_s = (uint32_t)timeout, .body_max = (size_t)body_max,
                                .request_s = (uint32_t)request_s, .parse_max = (size_t)parse_max,
                                .max_tokens_default = (uint32_t)max_tokens, .hub_url = hub,
                                .hub_refresh_ms = (uint32_t)hub_refresh, .step_retry_ms = (uint32_t)step_retry,
                                .local_experts = local_experts, .step_target_ms = step_target,
                                .demand_key = hub ? &auth.key : NULL,
                                .ledger_path = ledger, .gateway_key_path = gw_key, .gateway_id = gw_id,
                                .price_prompt = price_p, .price_completion = price_c, .chat_template = tmpl,
                                .chat_template_len = tmpl_len, .chat_template_name = tmpl_path,
                                .tls = tls_cert ? &tls : NULL, .insecure_plaintext = insecure,
                                .cors_origins = cors, .n_cors = n_cors, .quiet = quiet, .model_path = model,
                                .no_web_ui = no_web_ui, .down_msg = down[0] ? down : NULL};
    if (kv_gateway_start(&g, e, &go, &d)) {
        rc = kv_cli_diag(CMD, &d);
        goto done;
    }
    atomic_store(&caught.g, g);
serve:
    if (kv_gw_stop_pipe[0] < 0 && pipe2(kv_gw_stop_pipe, O_CLOEXEC)) {
        rc = kv_cli_err(CMD, 1, "cannot make a pipe: %s", strerror(errno));
        goto done;
    }
    signal(SIGINT, kv_gw_on_signal);
    signal(SIGTERM, kv_gw_on_signal);
    signal(SIGPIPE, SIG_IGN);
    if (tls_cert) printf("tls sha256:%s\n", tls.fp);
    printf(strchr(host, ':') ? "listening on [%s]:%u\n" : "listening on %s:%u\n", host, kv_gateway_port(g));
    fflush(stdout);
    if (!no_web_ui && !quiet)
        fprintf(stderr, strchr(host, ':') ? "gateway: chat page at %s://[%s]:%u/\n"
                                          : "gateway: chat page at %s://%s:%u/\n",
                tls_cert ? "https" : "http", host, kv_gateway_port(g));
    char stop_byte;
    while (read(kv_gw_stop_pipe[0], &stop_byte, 1) < 0 && errno == EINTR) {
    }
done:
    atomic_store(&caught.g, NULL);
    kv_gateway_free(g);
    kv_https_cert_clear(&tls);
    kv_engine_free(e);
    kv_gateway_keys_free(fkeys, n_fkeys);
    kv_node_workers_free(hub_workers, n_hub_workers);
    kv_cli_auth_free(&auth);
    free(tmpl);
    return rc;
}
