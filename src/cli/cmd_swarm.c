/* kvasir swarm: bring a whole local swarm up with one command, show its
 * state, and bring it down.
 *
 *   swarm up     generates (gen-model --preset) or takes the model, slices
 *                it, starts a hub (with its LAN beacon), N nodes and a
 *                gateway as separate processes of this same binary, waits
 *                until the market shows full coverage and the gateway's
 *                /health is 200, and prints the endpoints;
 *   swarm status reads the hub's market, placement and nodes, the
 *                gateway's /health and every node's worker counters
 *                (dispatch STATS);
 *   swarm down   SIGTERM to each process, SIGKILL after a grace period.
 *
 * State lives in DIR: DIR/swarm.json (each process's pid, its start time
 * from /proc, so a pid reused by another program is never signalled, its
 * log and its URL), DIR/logs/NAME.log, DIR/model/ (the slices), DIR/nodeK/
 * (each node's key and pieces), DIR/hub.db. swarm.json is rewritten (to a
 * temporary name, then renamed) after every process started, so `swarm
 * down` stops whatever an interrupted `swarm up` left running. Children are
 * detached (setsid, stdin from /dev/null, stdout and stderr to their log)
 * and outlive `swarm up`. Everything read back (swarm.json, HTTP answers,
 * worker frames) is bounded and checked. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli.h"
#include "kvasir/beacon.h"
#include "kvasir/dispatch_proto.h"
#include "kvasir/hub.h"
#include "kvasir/node.h"
#include "kvasir/probe.h"
#include "kvasir/slice.h"

#define CMD "swarm"
#define KV_SWARM_MAX_NODES 64
#define KV_SWARM_STATE "swarm.json"
#define KV_SWARM_KEY "coordinator.key"  /* the swarm's coordinator key, in DIR */
#define KV_SWARM_STATE_MAX (1u << 20)  /* bytes of swarm.json */
#define KV_SWARM_HTTP_MAX (64u << 20)  /* bytes of a market or placement answer */
#define KV_SWARM_PATH 1024
#define KV_SWARM_MAX_GW_ARGS 32        /* --gateway-arg, at most */

/* One process of the swarm. */
typedef struct kv_sw_proc {
    char name[32];            /* "hub", "gateway", "node3" */
    pid_t pid;                /* 0: not started */
    unsigned long long start; /* /proc/PID/stat field 22: start time in clock ticks */
    char log[KV_SWARM_PATH];  /* its stdout and stderr */
    char url[320];            /* hub and gateway: http://HOST:PORT, or https://HOST:PORT#sha256=HEX; node: "" */
    char data[KV_SWARM_PATH]; /* node: its data folder */
    uint64_t budget;          /* node: bytes */
} kv_sw_proc;

typedef struct kv_swarm {
    char dir[KV_SWARM_PATH];
    char manifest[KV_SWARM_PATH]; /* DIR/model/manifest.json */
    uint32_t beacon_port;         /* 0: no beacon */
    kv_sw_proc hub, gateway;
    kv_sw_proc nodes[KV_SWARM_MAX_NODES];
    uint32_t n_nodes;
} kv_swarm;

static double kv_sw_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void kv_sw_sleep_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) && errno == EINTR) {
    }
}

/* ---- processes ------------------------------------------------------------ */

/* Start time (clock ticks since boot) and state letter of pid, from
 * /proc/PID/stat; 0 when it does not exist. The command name may hold
 * spaces and parentheses: fields are counted after the last ')'. */
static unsigned long long kv_sw_proc_start(pid_t pid, char *state) {
    char p[64], buf[1024];
    snprintf(p, sizeof p, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(p, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *s = strrchr(buf, ')');
    if (!s || s[1] != ' ') return 0;
    s += 2; /* field 3: state */
    if (state) *state = *s;
    for (int field = 3; field < 22; field++) {
        s = strchr(s, ' ');
        if (!s) return 0;
        s++;
    }
    return strtoull(s, NULL, 10);
}

/* True while p is the process we started (same pid and start time) and not
 * a zombie. */
static bool kv_sw_alive(const kv_sw_proc *p) {
    if (p->pid <= 0) return false;
    char st = 0;
    unsigned long long s = kv_sw_proc_start(p->pid, &st);
    if (!s || s != p->start || st == 'Z' || st == 'X') return false;
    /* and it runs a kvasir binary: swarm.json names the processes that
     * swarm down signals, so it never names another program */
    char link[64], exe[KV_SWARM_PATH];
    snprintf(link, sizeof link, "/proc/%d/exe", (int)p->pid);
    ssize_t n = readlink(link, exe, sizeof exe - 1);
    if (n <= 0) return false;
    exe[n] = 0;
    const char *b = strrchr(exe, '/');
    return !strncmp(b ? b + 1 : exe, "kvasir", 6);
}

/* Reaps p if it is our child and has exited; returns its wait status in
 * *status (when it did) and true when it has exited. */
static bool kv_sw_exited(const kv_sw_proc *p, int *status) {
    if (p->pid <= 0) return true;
    int st = 0;
    pid_t r = waitpid(p->pid, &st, WNOHANG);
    if (r == p->pid) {
        if (status) *status = st;
        return true;
    }
    return !kv_sw_alive(p);
}

static char kv_sw_self[KV_SWARM_PATH];

/* Starts this binary with argv (argv[0] ignored), detached: its own
 * session, stdin /dev/null, stdout and stderr appended to p->log. */
static int kv_sw_spawn(kv_sw_proc *p, char *const argv[]) {
    int lfd = open(p->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (lfd < 0) return kv_cli_err(CMD, 2, "cannot open %s: %s", p->log, strerror(errno));
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        close(lfd);
        return kv_cli_err(CMD, 2, "fork: %s", strerror(errno));
    }
    if (pid == 0) {
        setsid();
        int nul = open("/dev/null", O_RDONLY);
        if (nul >= 0) dup2(nul, 0);
        dup2(lfd, 1);
        dup2(lfd, 2);
        signal(SIGPIPE, SIG_DFL);
        execv(kv_sw_self, argv);
        dprintf(2, "kvasir swarm: exec %s: %s\n", kv_sw_self, strerror(errno));
        _exit(127);
    }
    close(lfd);
    p->pid = pid;
    /* the start time is readable at once: the child exists from fork on */
    p->start = kv_sw_proc_start(pid, NULL);
    return 0;
}

/* Runs this binary with argv to completion, output to log; 0 if it exited 0. */
static int kv_sw_run_tool(const char *what, const char *log, char *const argv[]) {
    kv_sw_proc p = {0};
    snprintf(p.log, sizeof p.log, "%s", log);
    if (kv_sw_spawn(&p, argv)) return 2;
    int st = 0;
    while (waitpid(p.pid, &st, 0) < 0 && errno == EINTR) {
    }
    if (!WIFEXITED(st) || WEXITSTATUS(st))
        return kv_cli_err(CMD, 2, "%s failed (see %s)", what, log);
    return 0;
}

/* The last non-empty line of a log (for errors), at most cap-1 bytes. */
static void kv_sw_last_line(const char *path, char *out, size_t cap) {
    out[0] = 0;
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        size_t n = strcspn(line, "\r\n");
        line[n] = 0;
        if (n) snprintf(out, cap, "%.290s", line);
    }
    fclose(f);
}

/* Waits (bounded) for "listening on HOST:PORT" in p's log; fills p->url,
 * https and pinned when a "tls sha256:HEX" line came first (docs/HUB.md). */
static int kv_sw_wait_listening(kv_sw_proc *p, double timeout_s) {
    const double end = kv_sw_now() + timeout_s;
    while (kv_sw_now() < end) {
        FILE *f = fopen(p->log, "r");
        char line[512], fp[65] = "";
        while (f && fgets(line, sizeof line, f)) {
            char addr[200];
            if (sscanf(line, "tls sha256:%64[0-9a-f]", fp) == 1) continue;
            if (sscanf(line, "listening on %199s", addr) == 1) {
                fclose(f);
                if (fp[0]) snprintf(p->url, sizeof p->url, "https://%s#sha256=%s", addr, fp);
                else snprintf(p->url, sizeof p->url, "http://%s", addr);
                return 0;
            }
        }
        if (f) fclose(f);
        int st = 0;
        if (kv_sw_exited(p, &st)) {
            char last[300];
            kv_sw_last_line(p->log, last, sizeof last);
            return kv_cli_err(CMD, 2, "%s exited before it served (%s); see %s", p->name, last[0] ? last : "no output",
                              p->log);
        }
        kv_sw_sleep_ms(50);
    }
    return kv_cli_err(CMD, 2, "%s did not print its address within %.0f s; see %s", p->name, timeout_s, p->log);
}

/* ---- swarm.json ------------------------------------------------------------ */

static json_t *kv_sw_proc_json(const kv_sw_proc *p) {
    json_t *o = json_pack("{s:s, s:I, s:I, s:s}", "name", p->name, "pid", (json_int_t)p->pid, "start",
                          (json_int_t)p->start, "log", p->log);
    if (p->url[0]) json_object_set_new(o, "url", json_string(p->url));
    if (p->data[0]) json_object_set_new(o, "data", json_string(p->data));
    if (p->budget) json_object_set_new(o, "budget", json_integer((json_int_t)p->budget));
    return o;
}

static int kv_sw_save(const kv_swarm *s) {
    json_t *nodes = json_array();
    for (uint32_t i = 0; i < s->n_nodes; i++) json_array_append_new(nodes, kv_sw_proc_json(&s->nodes[i]));
    json_t *root = json_pack("{s:i, s:s, s:s, s:i, s:o, s:o}", "version", 1, "dir", s->dir, "manifest", s->manifest,
                             "beacon_port", (int)s->beacon_port, "hub", kv_sw_proc_json(&s->hub), "nodes", nodes);
    if (s->gateway.pid) json_object_set_new(root, "gateway", kv_sw_proc_json(&s->gateway));
    char path[KV_SWARM_PATH + 32], tmp[KV_SWARM_PATH + 40];
    snprintf(path, sizeof path, "%s/%s", s->dir, KV_SWARM_STATE);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int rc = json_dump_file(root, tmp, JSON_INDENT(1)) || rename(tmp, path);
    json_decref(root);
    return rc ? kv_cli_err(CMD, 2, "cannot write %s: %s", path, strerror(errno)) : 0;
}

/* Copies a string member of at most cap-1 bytes; false if absent or too long. */
static bool kv_sw_jstr(json_t *o, const char *key, char *out, size_t cap, bool required) {
    json_t *v = json_object_get(o, key);
    if (!v) {
        out[0] = 0;
        return !required;
    }
    const char *s = json_string_value(v);
    if (!s || strlen(s) >= cap) return false;
    memcpy(out, s, strlen(s) + 1);
    return true;
}

static bool kv_sw_proc_parse(json_t *o, kv_sw_proc *p) {
    memset(p, 0, sizeof *p);
    json_t *pid = json_object_get(o, "pid"), *st = json_object_get(o, "start"), *b = json_object_get(o, "budget");
    if (!json_is_object(o) || !json_is_integer(pid) || !json_is_integer(st)) return false;
    if (json_integer_value(pid) < 0 || json_integer_value(pid) > 0x7fffffff || json_integer_value(st) < 0) return false;
    if (b && (!json_is_integer(b) || json_integer_value(b) < 0)) return false;
    p->pid = (pid_t)json_integer_value(pid);
    p->start = (unsigned long long)json_integer_value(st);
    p->budget = b ? (uint64_t)json_integer_value(b) : 0;
    return kv_sw_jstr(o, "name", p->name, sizeof p->name, true) && kv_sw_jstr(o, "log", p->log, sizeof p->log, true) &&
           kv_sw_jstr(o, "url", p->url, sizeof p->url, false) && kv_sw_jstr(o, "data", p->data, sizeof p->data, false);
}

/* Loads DIR/swarm.json. 1 if there is none (no swarm), 0, or 2 (damaged). */
static int kv_sw_load(kv_swarm *s, const char *dir, bool quiet_absent) {
    memset(s, 0, sizeof *s);
    char path[KV_SWARM_PATH + 32];
    snprintf(path, sizeof path, "%s/%s", dir, KV_SWARM_STATE);
    struct stat sb;
    if (stat(path, &sb)) {
        if (!quiet_absent) kv_cli_err(CMD, 2, "no swarm in %s (no %s; start one with kvasir swarm up --dir %s)", dir, path, dir);
        return 1;
    }
    if (sb.st_size > KV_SWARM_STATE_MAX) return kv_cli_err(CMD, 2, "%s: larger than %u bytes", path, KV_SWARM_STATE_MAX);
    json_error_t je;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!root) return kv_cli_err(CMD, 2, "%s: line %d: %s", path, je.line, je.text);
    int rc = 2;
    json_t *nodes = json_object_get(root, "nodes"), *bp = json_object_get(root, "beacon_port");
    json_t *gw = json_object_get(root, "gateway");
    if (!json_is_array(nodes) || json_array_size(nodes) > KV_SWARM_MAX_NODES || !json_is_integer(bp) ||
        json_integer_value(bp) < 0 || json_integer_value(bp) > 65535 ||
        !kv_sw_jstr(root, "manifest", s->manifest, sizeof s->manifest, true) ||
        !kv_sw_proc_parse(json_object_get(root, "hub"), &s->hub) || (gw && !kv_sw_proc_parse(gw, &s->gateway))) {
        kv_cli_err(CMD, 2, "%s: not a swarm state file of this version", path);
        goto done;
    }
    s->beacon_port = (uint32_t)json_integer_value(bp);
    s->n_nodes = (uint32_t)json_array_size(nodes);
    for (uint32_t i = 0; i < s->n_nodes; i++)
        if (!kv_sw_proc_parse(json_array_get(nodes, i), &s->nodes[i])) {
            kv_cli_err(CMD, 2, "%s: node %u is malformed", path, i + 1);
            goto done;
        }
    snprintf(s->dir, sizeof s->dir, "%s", dir);
    rc = 0;
done:
    json_decref(root);
    return rc;
}

/* ---- reading the hub and the gateway ---------------------------------------- */

/* GET base+path as parsed JSON (NULL on any error; *status gets the HTTP
 * status, 0 when unreachable). */
static json_t *kv_sw_get_json(const char *base, const char *path, long timeout_ms, long *status) {
    char url[512], *body = NULL;
    size_t n = 0;
    long st = 0;
    kv_diag d = {0};
    snprintf(url, sizeof url, "%s%s", base, path);
    if (status) *status = 0;
    if (kv_hub_http_get(url, KV_SWARM_HTTP_MAX, timeout_ms, &body, &n, &st, &d)) return NULL;
    if (status) *status = st;
    json_error_t je;
    json_t *j = json_loadb(body, n, 0, &je);
    free(body);
    return j;
}

/* The gateway's /health status (0: unreachable). */
static long kv_sw_health(const char *gw_url) {
    char url[512], *body = NULL;
    size_t n = 0;
    long st = 0;
    kv_diag d = {0};
    snprintf(url, sizeof url, "%s/health", gw_url);
    if (kv_hub_http_get(url, 1u << 16, 2000, &body, &n, &st, &d)) return 0;
    free(body);
    return st;
}

/* Market figures: shards, shards with a live replica, replicas live. */
typedef struct {
    bool ok, covered;
    uint32_t shards, live_shards, replicas, wanted;
} kv_sw_cov;

static kv_sw_cov kv_sw_coverage(const char *hub_url) {
    kv_sw_cov c = {0};
    json_t *m = kv_sw_get_json(hub_url, "/v1/market", 3000, NULL);
    json_t *sh = json_object_get(m, "shards");
    if (json_is_array(sh)) {
        c.ok = true;
        c.covered = json_is_true(json_object_get(m, "covered"));
        size_t i;
        json_t *v;
        json_array_foreach(sh, i, v) {
            json_int_t live = json_integer_value(json_object_get(v, "live"));
            json_int_t want = json_integer_value(json_object_get(v, "wanted"));
            c.shards++;
            c.live_shards += live > 0;
            c.replicas += live > 0 ? (uint32_t)(live < want ? live : want) : 0;
            c.wanted += (uint32_t)(want > 0 ? want : 0);
        }
    }
    json_decref(m);
    return c;
}

/* A fingerprint of the placement map: every (layer, first, last, key,
 * addr), not the heartbeat times; 0 when the hub does not answer. */
static uint64_t kv_sw_placement_sig(const char *hub_url) {
    json_t *p = kv_sw_get_json(hub_url, "/v1/placement", 3000, NULL);
    json_t *sh = json_object_get(p, "shards");
    uint64_t h = 0;
    if (json_is_array(sh)) {
        h = 1469598103934665603ull;
        size_t i, k;
        json_t *e, *nd;
        json_array_foreach(sh, i, e) {
            char t[600];
            snprintf(t, sizeof t, "%" JSON_INTEGER_FORMAT ".%" JSON_INTEGER_FORMAT ".%" JSON_INTEGER_FORMAT ";",
                     json_integer_value(json_object_get(e, "layer")), json_integer_value(json_object_get(e, "first")),
                     json_integer_value(json_object_get(e, "last")));
            for (const char *c = t; *c; c++) h = (h ^ (uint8_t)*c) * 1099511628211ull;
            json_array_foreach(json_object_get(e, "nodes"), k, nd) {
                const char *a = json_string_value(json_object_get(nd, "addr")), *y = json_string_value(json_object_get(nd, "key"));
                snprintf(t, sizeof t, "%.256s@%.256s,", y ? y : "", a ? a : "");
                for (const char *c = t; *c; c++) h = (h ^ (uint8_t)*c) * 1099511628211ull;
            }
        }
    }
    json_decref(p);
    return h;
}

/* Public key (hex) of the node whose data folder is dir; "" if it has none yet. */
static void kv_sw_node_key(const char *dir, char out[65]) {
    kv_node_key k;
    kv_diag d = {0};
    out[0] = 0;
    if (!kv_node_key_load(&k, dir, false, &d)) kv_hex(k.pk, 32, out);
}

/* The swarm's coordinator identity: DIR/coordinator.key (the gateway's
 * key, which the hub vouches for) and, once the hub answers, its voucher. */
typedef struct kv_sw_auth {
    kv_node_key key;
    kv_voucher voucher;
    bool has_voucher;
} kv_sw_auth;

/* A worker's counters (kv_probe_stats): the worker must prove worker_key,
 * the key the node's own key file holds; we prove the swarm's coordinator
 * key with the hub's voucher. */
static int kv_sw_worker_stats(const char *addr, const char *model_id, const uint8_t worker_key[32],
                              const kv_sw_auth *au, kv_msg_stats *out, kv_diag *d) {
    const kv_probe_opts o = {.addr = addr, .model_id = model_id, .worker_key = worker_key, .sk = au->key.sk,
                             .voucher = au->has_voucher ? &au->voucher : NULL, .connect_ms = 2000, .answer_ms = 2000};
    return kv_probe_stats(&o, out, d);
}

/* ---- status ------------------------------------------------------------------ */

static const char *kv_swarm_status_help =
    "usage: kvasir swarm status [--dir DIR] [--json]\n"
    "  --dir DIR   the swarm's folder (default kvasir-swarm)\n"
    "  --json      one JSON object: hub, coverage, nodes (shards, expert computations served), gateway\n";

/* The swarm's state as JSON (what --json prints, and what the table shows). */
static json_t *kv_sw_status_json(const kv_swarm *s) {
    kv_manifest *man = NULL;
    kv_diag d = {0};
    kv_manifest_load(&man, s->manifest, &d);
    const bool hub_up = kv_sw_alive(&s->hub);
    kv_sw_cov c = hub_up ? kv_sw_coverage(s->hub.url) : (kv_sw_cov){0};
    /* the swarm's coordinator key and a voucher for it: what a worker asks
     * before it answers STATS */
    kv_sw_auth au = {0};
    char kp[KV_SWARM_PATH + 32];
    snprintf(kp, sizeof kp, "%s/%s", s->dir, KV_SWARM_KEY);
    kv_diag kd = {0};
    if (!kv_key_file_load(&au.key, kp, false, &kd) && hub_up)
        au.has_voucher = !kv_node_fetch_auth(s->hub.url, &au.key, NULL, 0, NULL, &au.voucher, &kd);
    json_t *placement = hub_up ? kv_sw_get_json(s->hub.url, "/v1/placement", 3000, NULL) : NULL;
    json_t *hub_nodes = hub_up ? kv_sw_get_json(s->hub.url, "/v1/nodes", 3000, NULL) : NULL;
    json_t *root = json_object();
    json_object_set_new(root, "dir", json_string(s->dir));
    json_object_set_new(root, "model_id", json_string(man ? man->model_id : ""));
    json_object_set_new(root, "hub", json_pack("{s:s, s:I, s:b, s:s}", "url", s->hub.url, "pid", (json_int_t)s->hub.pid,
                                               "alive", hub_up, "status_page", s->hub.url));
    json_object_set_new(root, "coverage", json_pack("{s:b, s:b, s:i, s:i, s:i, s:i}", "known", c.ok, "covered", c.covered,
                                                    "shards", (int)c.shards, "shards_live", (int)c.live_shards,
                                                    "replicas", (int)c.replicas, "replicas_wanted", (int)c.wanted));
    json_t *nodes = json_array();
    uint64_t total = 0;
    for (uint32_t i = 0; i < s->n_nodes; i++) {
        const kv_sw_proc *p = &s->nodes[i];
        char key[65], addr[KV_HUB_MAX_ADDR + 1] = "";
        kv_sw_node_key(p->data, key);
        json_t *shards = json_array();
        /* this node's shards and address, from the placement map */
        size_t k;
        json_t *e;
        json_array_foreach(json_object_get(placement, "shards"), k, e) {
            size_t q;
            json_t *nd;
            json_array_foreach(json_object_get(e, "nodes"), q, nd) {
                const char *nk = json_string_value(json_object_get(nd, "key"));
                const char *na = json_string_value(json_object_get(nd, "addr"));
                if (!nk || !key[0] || strcmp(nk, key)) continue;
                if (na && strlen(na) <= KV_HUB_MAX_ADDR) snprintf(addr, sizeof addr, "%s", na);
                json_array_append_new(shards, json_pack("{s:O, s:O, s:O}", "layer", json_object_get(e, "layer"), "first",
                                                        json_object_get(e, "first"), "last", json_object_get(e, "last")));
            }
        }
        json_t *n = json_pack("{s:s, s:I, s:b, s:s, s:I, s:s, s:s, s:o}", "name", p->name, "pid", (json_int_t)p->pid,
                              "alive", kv_sw_alive(p), "key", key, "budget", (json_int_t)p->budget, "addr", addr, "log",
                              p->log, "shards", shards);
        /* the hub's view of the node: registered and live, and what every
         * worker it ran served, as of its last heartbeat */
        json_array_foreach(json_object_get(hub_nodes, "nodes"), k, e) {
            const char *nk = json_string_value(json_object_get(e, "key"));
            if (!nk || !key[0] || strcmp(nk, key)) continue;
            json_t *live = json_object_get(e, "live"), *sp = json_object_get(e, "served_pairs");
            json_t *pps = json_object_get(e, "pairs_per_s");
            if (json_is_boolean(live)) json_object_set(n, "hub_live", live);
            if (json_is_integer(sp) && json_integer_value(sp) >= 0) json_object_set(n, "served_pairs", sp);
            if (json_is_number(pps)) json_object_set(n, "pairs_per_s", pps);
        }
        kv_msg_stats st = {0};
        kv_diag sd = {0};
        uint8_t wk[32];
        if (addr[0] && man && key[0] && !kv_key_from_hex(key, wk, &sd) &&
            !kv_sw_worker_stats(addr, man->model_id, wk, &au, &st, &sd)) {
            json_object_set_new(n, "experts_computed", json_integer((json_int_t)st.n_pairs));
            json_object_set_new(n, "requests", json_integer((json_int_t)st.n_compute));
            total += st.n_pairs;
        } else {
            json_object_set_new(n, "experts_computed", json_null());
            json_object_set_new(n, "stats_error", json_string(addr[0] ? sd.msg : "not placed"));
        }
        json_array_append_new(nodes, n);
    }
    json_object_set_new(root, "nodes", nodes);
    json_object_set_new(root, "experts_computed", json_integer((json_int_t)total));
    json_t *tps = json_object_get(hub_nodes, "tokens_per_s");
    if (json_is_number(tps)) json_object_set(root, "tokens_per_s", tps);
    if (s->gateway.pid) {
        const bool up = kv_sw_alive(&s->gateway);
        json_object_set_new(root, "gateway", json_pack("{s:s, s:I, s:b, s:i}", "url", s->gateway.url, "pid",
                                                       (json_int_t)s->gateway.pid, "alive", up, "health",
                                                       up ? (int)kv_sw_health(s->gateway.url) : 0));
    }
    json_decref(placement);
    json_decref(hub_nodes);
    kv_manifest_free(man);
    return root;
}

static int kv_swarm_status(int argc, char **argv) {
    static const char *const vf[] = {"--dir", NULL};
    const char *dir = "kvasir-swarm";
    bool js = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_swarm_status_help, stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            js = true;
        } else if (!(v = kv_arg_value(CMD, argc, argv, &i, vf))) {
            return 1;
        } else {
            dir = v;
        }
    }
    kv_swarm s;
    int rc = kv_sw_load(&s, dir, false);
    if (rc) return 2;
    json_t *j = kv_sw_status_json(&s);
    if (js) {
        char *t = json_dumps(j, JSON_COMPACT);
        puts(t ? t : "{}");
        free(t);
    } else {
        json_t *c = json_object_get(j, "coverage"), *g = json_object_get(j, "gateway");
        printf("hub      %s  %s  (status page %s/)\n", s.hub.url, kv_sw_alive(&s.hub) ? "up" : "DOWN", s.hub.url);
        if (json_is_true(json_object_get(c, "known")))
            printf("shards   %d of %d live (%s), replicas %d of %d wanted\n",
                   (int)json_integer_value(json_object_get(c, "shards_live")),
                   (int)json_integer_value(json_object_get(c, "shards")),
                   json_is_true(json_object_get(c, "covered")) ? "covered" : "NOT covered",
                   (int)json_integer_value(json_object_get(c, "replicas")),
                   (int)json_integer_value(json_object_get(c, "replicas_wanted")));
        else
            printf("shards   unknown (the hub does not answer)\n");
        if (g)
            printf("gateway  %s  %s  /health %d\n", s.gateway.url,
                   json_is_true(json_object_get(g, "alive")) ? "up" : "DOWN",
                   (int)json_integer_value(json_object_get(g, "health")));
        printf("%-8s %8s %-5s %-22s %7s %9s  %s\n", "node", "pid", "state", "worker", "shards", "experts", "key");
        size_t i;
        json_t *n;
        json_array_foreach(json_object_get(j, "nodes"), i, n) {
            json_t *ec = json_object_get(n, "experts_computed");
            char exp[24];
            if (json_is_integer(ec)) snprintf(exp, sizeof exp, "%" JSON_INTEGER_FORMAT, json_integer_value(ec));
            else snprintf(exp, sizeof exp, "-");
            const char *key = json_string_value(json_object_get(n, "key"));
            printf("%-8s %8d %-5s %-22s %7zu %9s  %.16s\n", json_string_value(json_object_get(n, "name")),
                   (int)json_integer_value(json_object_get(n, "pid")),
                   json_is_true(json_object_get(n, "alive")) ? "up" : "DOWN",
                   json_string_value(json_object_get(n, "addr"))[0] ? json_string_value(json_object_get(n, "addr")) : "-",
                   json_array_size(json_object_get(n, "shards")), exp, key && key[0] ? key : "-");
        }
    }
    json_decref(j);
    return 0;
}

/* ---- down -------------------------------------------------------------------- */

static const char *kv_swarm_down_help =
    "usage: kvasir swarm down [--dir DIR] [--grace-ms MS]\n"
    "  --dir DIR      the swarm's folder (default kvasir-swarm)\n"
    "  --grace-ms MS  time between SIGTERM and SIGKILL (default 10000)\n"
    "Stops the gateway, the nodes and the hub; the logs stay in DIR/logs.\n";

/* SIGTERM to every live process, SIGKILL to those still alive after grace.
 * Counts into *n_term (stopped by SIGTERM), *n_kill, *n_gone (not running). */
static void kv_sw_stop_all(kv_swarm *s, long grace_ms, int *n_term, int *n_kill, int *n_gone) {
    kv_sw_proc *all[KV_SWARM_MAX_NODES + 2];
    int n = 0;
    /* signalled in this order: the gateway (a client of the nodes), the
     * nodes, the hub */
    if (s->gateway.pid) all[n++] = &s->gateway;
    for (uint32_t i = 0; i < s->n_nodes; i++) all[n++] = &s->nodes[i];
    if (s->hub.pid) all[n++] = &s->hub;
    bool sent[KV_SWARM_MAX_NODES + 2] = {0};
    *n_term = *n_kill = *n_gone = 0;
    for (int i = 0; i < n; i++) {
        if (kv_sw_alive(all[i]) && !kill(all[i]->pid, SIGTERM)) sent[i] = true;
        else (*n_gone)++;
    }
    const double end = kv_sw_now() + (double)grace_ms / 1e3;
    for (;;) {
        bool any = false;
        for (int i = 0; i < n; i++)
            if (sent[i] && !kv_sw_exited(all[i], NULL)) any = true;
        if (!any || kv_sw_now() >= end) break;
        kv_sw_sleep_ms(50);
    }
    for (int i = 0; i < n; i++) {
        if (!sent[i]) continue;
        if (kv_sw_exited(all[i], NULL)) {
            (*n_term)++;
            continue;
        }
        if (kv_sw_alive(all[i])) kill(all[i]->pid, SIGKILL);
        for (int k = 0; k < 100 && !kv_sw_exited(all[i], NULL); k++) kv_sw_sleep_ms(20);
        (*n_kill)++;
        fprintf(stderr, "swarm: %s (pid %d) did not stop within %ld ms: killed\n", all[i]->name, (int)all[i]->pid, grace_ms);
    }
}

static int kv_swarm_down(int argc, char **argv) {
    static const char *const vf[] = {"--dir", "--grace-ms", NULL};
    const char *dir = "kvasir-swarm";
    long grace = 10000;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_swarm_down_help, stdout);
            return 0;
        } else if (!(v = kv_arg_value(CMD, argc, argv, &i, vf))) {
            return 1;
        } else if (!strcmp(a, "--dir")) {
            dir = v;
        } else if (kv_arg_long(CMD, a, v, 0, 600000, &grace)) {
            return 1;
        }
    }
    kv_swarm s;
    if (kv_sw_load(&s, dir, false)) return 2;
    int t, k, g;
    kv_sw_stop_all(&s, grace, &t, &k, &g);
    char path[KV_SWARM_PATH + 32], last[KV_SWARM_PATH + 40];
    snprintf(path, sizeof path, "%s/%s", dir, KV_SWARM_STATE);
    snprintf(last, sizeof last, "%s/swarm.last.json", dir);
    if (rename(path, last)) return kv_cli_err(CMD, 2, "cannot rename %s: %s", path, strerror(errno));
    printf("swarm down: %d processes stopped (%d by SIGTERM, %d by SIGKILL), %d were not running; logs in %s/logs\n",
           t + k, t, k, g, dir);
    return 0;
}

/* ---- up ---------------------------------------------------------------------- */

static const char *kv_swarm_up_help =
    "usage: kvasir swarm up [-m MODEL | --preset NAME] [--nodes N] [--dir DIR] [options]\n"
    "  -m MODEL            a GGUF file (sliced into DIR/model), or DIR/manifest.json of a sliced model\n"
    "  --preset NAME       generate the model with kvasir gen-model --preset NAME (default tiny)\n"
    "  --nodes N           nodes to start (default 3)\n"
    "  --dir DIR           the swarm's folder: state, logs, slices, node data (default kvasir-swarm)\n"
    "  --listen HOST:PORT  the gateway (default 127.0.0.1:8080; port 0 picks a free one)\n"
    "  --hub-listen H:P    the hub (default 127.0.0.1:8700; port 0 picks a free one)\n"
    "  --budget SIZE       per node (K/M/G/T); default: what lets the nodes hold the model twice\n"
    "  --experts-per-slab K  slicing granularity (default 2)\n"
    "  --threads N         compute threads of each node and of the gateway (default: CPUs / nodes)\n"
    "  --beacon-port P     the hub's LAN beacon port (default 47474); --no-beacon: none\n"
    "  --interval-ms MS    node heartbeat period (default 1000)\n"
    "  --timeout-ms MS     give up waiting for coverage and health after MS (default 120000)\n"
    "  --gateway-arg ARG   one more argument for `kvasir gateway` (repeatable; e.g. its ledger flags)\n"
    "  --vouch-open        the hub vouches for any coordinator key (default: only the swarm's own,\n"
    "                      DIR/coordinator.key, which the gateway uses)\n"
    "Prints the gateway and hub URLs once the market is covered and the gateway's /health is 200.\n"
    "On a timeout it stops what it started and names the logs (DIR/logs).\n";

/* mkdir -p */
static int kv_sw_mkdir(const char *p) {
    char t[KV_SWARM_PATH];
    snprintf(t, sizeof t, "%s", p);
    for (char *c = t + 1; *c; c++) {
        if (*c != '/') continue;
        *c = 0;
        if (mkdir(t, 0755) && errno != EEXIST) return kv_cli_err(CMD, 2, "cannot create %s: %s", t, strerror(errno));
        *c = '/';
    }
    if (mkdir(t, 0755) && errno != EEXIST) return kv_cli_err(CMD, 2, "cannot create %s: %s", t, strerror(errno));
    return 0;
}

static int kv_swarm_up(int argc, char **argv) {
    static const char *const vf[] = {"-m", "--model", "--preset", "--nodes", "--dir", "--listen", "--hub-listen",
                                     "--budget", "--experts-per-slab", "--threads", "--beacon-port", "--interval-ms",
                                     "--timeout-ms", "--gateway-arg", NULL};
    const char *gw_extra[KV_SWARM_MAX_GW_ARGS];
    int n_gw_extra = 0;
    const char *model = NULL, *preset = NULL, *dir = "kvasir-swarm", *listen = "127.0.0.1:8080";
    const char *hub_listen = "127.0.0.1:8700", *budget_s = NULL;
    bool vouch_open = false;
    long n_nodes = 3, eps = 2, threads = 0, beacon_port = KV_BEACON_PORT, interval = 1000, timeout = 120000;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_swarm_up_help, stdout);
            return 0;
        } else if (!strcmp(a, "--no-beacon")) {
            beacon_port = 0;
        } else if (!strcmp(a, "--vouch-open")) {
            vouch_open = true;
        } else if (!(v = kv_arg_value(CMD, argc, argv, &i, vf))) {
            return 1;
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            model = v;
        } else if (!strcmp(a, "--preset")) {
            preset = v;
        } else if (!strcmp(a, "--nodes")) {
            if (kv_arg_long(CMD, a, v, 1, KV_SWARM_MAX_NODES, &n_nodes)) return 1;
        } else if (!strcmp(a, "--dir")) {
            dir = v;
        } else if (!strcmp(a, "--listen")) {
            listen = v;
        } else if (!strcmp(a, "--hub-listen")) {
            hub_listen = v;
        } else if (!strcmp(a, "--budget")) {
            budget_s = v;
        } else if (!strcmp(a, "--experts-per-slab")) {
            if (kv_arg_long(CMD, a, v, 1, 65536, &eps)) return 1;
        } else if (!strcmp(a, "--threads")) {
            if (kv_arg_long(CMD, a, v, 1, 1024, &threads)) return 1;
        } else if (!strcmp(a, "--beacon-port")) {
            if (kv_arg_long(CMD, a, v, 1, 65535, &beacon_port)) return 1;
        } else if (!strcmp(a, "--interval-ms")) {
            if (kv_arg_long(CMD, a, v, 10, 600000, &interval)) return 1;
        } else if (!strcmp(a, "--timeout-ms")) {
            if (kv_arg_long(CMD, a, v, 100, 86400000, &timeout)) return 1;
        } else if (!strcmp(a, "--gateway-arg")) {
            if (n_gw_extra == KV_SWARM_MAX_GW_ARGS)
                return kv_cli_err(CMD, 1, "--gateway-arg: at most %d", KV_SWARM_MAX_GW_ARGS);
            gw_extra[n_gw_extra++] = v;
        }
    }
    if (model && preset) return kv_cli_err(CMD, 1, "give -m MODEL or --preset NAME, not both");
    if (!model && !preset) preset = "tiny";
    if (strlen(dir) > 400) return kv_cli_err(CMD, 1, "--dir: path too long");
    if (strpbrk(listen, " '\"") || strpbrk(hub_listen, " '\"")) return kv_cli_err(CMD, 1, "--listen: not HOST:PORT");
    uint64_t budget = 0;
    kv_diag d = {0};
    if (budget_s && kv_node_parse_size(budget_s, &budget, &d)) return kv_cli_err(CMD, 1, "--budget: %s", d.msg);
    if (!threads) {
        long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
        threads = ncpu > n_nodes ? ncpu / n_nodes : 1;
    }
    ssize_t sl = readlink("/proc/self/exe", kv_sw_self, sizeof kv_sw_self - 1);
    if (sl <= 0) return kv_cli_err(CMD, 2, "cannot find this program (/proc/self/exe)");
    kv_sw_self[sl] = 0;

    kv_swarm s = {0};
    {
        kv_swarm old;
        if (!kv_sw_load(&old, dir, true)) {
            bool any = kv_sw_alive(&old.hub) || kv_sw_alive(&old.gateway);
            for (uint32_t i = 0; i < old.n_nodes; i++) any |= kv_sw_alive(&old.nodes[i]);
            if (any) return kv_cli_err(CMD, 2, "a swarm is already up in %s (kvasir swarm down --dir %s)", dir, dir);
        }
    }
    char logs[480], path[KV_SWARM_PATH], model_dir[480];
    snprintf(s.dir, sizeof s.dir, "%s", dir);
    snprintf(logs, sizeof logs, "%s/logs", dir);
    snprintf(model_dir, sizeof model_dir, "%s/model", dir);
    if (kv_sw_mkdir(dir) || kv_sw_mkdir(logs)) return 2;
    signal(SIGPIPE, SIG_IGN);

    /* 1. the model: generated, or given; then sliced */
    char gguf[KV_SWARM_PATH];
    if (preset) {
        snprintf(gguf, sizeof gguf, "%s/model.gguf", dir);
        snprintf(path, sizeof path, "%s/gen-model.log", logs);
        char *av[] = {"kvasir", "gen-model", "--preset", (char *)preset, "--out", gguf, NULL};
        printf("swarm: generating the model (gen-model --preset %s)\n", preset);
        if (kv_sw_run_tool("gen-model", path, av)) return 2;
        model = gguf;
    }
    const size_t ml = strlen(model);
    if (ml >= 14 && !strcmp(model + ml - 13, "manifest.json")) {
        snprintf(s.manifest, sizeof s.manifest, "%s", model);
    } else {
        char epss[24];
        snprintf(epss, sizeof epss, "%ld", eps);
        snprintf(path, sizeof path, "%s/slice.log", logs);
        char *av[] = {"kvasir", "slice", (char *)model, "--out", model_dir, "--experts-per-slab", epss, NULL};
        printf("swarm: slicing %s into %s\n", model, model_dir);
        if (kv_sw_run_tool("slice", path, av)) return 2;
        snprintf(s.manifest, sizeof s.manifest, "%s/manifest.json", model_dir);
    }
    kv_manifest *man = NULL;
    if (kv_manifest_load(&man, s.manifest, &d)) return kv_cli_diag(CMD, &d);
    uint64_t experts = 0, largest = 0;
    for (size_t i = 0; i < man->n_slabs; i++) {
        experts += man->slabs[i].file.size;
        if (man->slabs[i].file.size > largest) largest = man->slabs[i].file.size;
    }
    const size_t n_slabs = man->n_slabs;
    kv_manifest_free(man);
    if (!budget) { /* twice the experts over the nodes, in whole slabs of the largest size */
        const uint64_t per = (2 * experts + (uint64_t)n_nodes - 1) / (uint64_t)n_nodes;
        budget = largest ? (per + largest - 1) / largest * largest : per;
        if (budget < largest) budget = largest;
    }

    /* 2. the hub (a fresh registry each time; the pieces on the nodes stay) */
    char db[KV_SWARM_PATH + 16], bps[24], ivs[24], ths[24], dls[24];
    snprintf(db, sizeof db, "%s/hub.db", dir);
    unlink(db);
    const size_t dbl = strlen(db);
    snprintf(db + dbl, 8, "-wal");
    unlink(db);
    snprintf(db + dbl, 8, "-shm");
    unlink(db);
    db[dbl] = 0;
    snprintf(bps, sizeof bps, "%ld", beacon_port);
    snprintf(ivs, sizeof ivs, "%ld", interval);
    snprintf(ths, sizeof ths, "%ld", threads);
    snprintf(dls, sizeof dls, "%ld", interval * 5 > 3000 ? interval * 5 : 3000);
    snprintf(s.hub.name, sizeof s.hub.name, "hub");
    snprintf(s.hub.log, sizeof s.hub.log, "%s/hub.log", logs);
    s.beacon_port = (uint32_t)beacon_port;
    /* the swarm's coordinator key (the gateway proves it to the nodes'
     * workers; swarm status too): the hub vouches for it, and for any key
     * with --vouch-open */
    char keyf[KV_SWARM_PATH + 32], keyhex[65];
    snprintf(keyf, sizeof keyf, "%s/%s", dir, KV_SWARM_KEY);
    {
        kv_node_key ck;
        if (kv_key_file_load(&ck, keyf, true, &d)) return kv_cli_diag(CMD, &d);
        kv_hex(ck.pk, 32, keyhex);
    }
    {
        char *av[16] = {"kvasir", "hub", "--model", s.manifest, "--db", db, "--listen", (char *)hub_listen,
                        "--deadline-ms", dls, "--vouch-key", keyhex};
        int a = 12;
        if (vouch_open) av[a++] = "--vouch-open";
        if (beacon_port) av[a++] = "--beacon", av[a++] = bps;
        av[a] = NULL;
        if (kv_sw_spawn(&s.hub, av)) return 2;
    }
    int rc = 2;
    const double t0 = kv_sw_now(), end = t0 + (double)timeout / 1e3;
    /* the hub hashes every piece before it serves: within the overall timeout */
    if (kv_sw_save(&s) || kv_sw_wait_listening(&s.hub, end - kv_sw_now())) goto fail;
    if (kv_sw_save(&s)) goto fail;

    /* 3. the nodes */
    char bud[32];
    snprintf(bud, sizeof bud, "%" PRIu64, budget);
    for (long k = 0; k < n_nodes; k++) {
        kv_sw_proc *p = &s.nodes[s.n_nodes];
        char name[32];
        snprintf(name, sizeof name, "node%ld", k + 1);
        snprintf(p->name, sizeof p->name, "%s", name);
        snprintf(p->log, sizeof p->log, "%s/%s.log", logs, name);
        snprintf(p->data, sizeof p->data, "%s/%s", dir, name);
        p->budget = budget;
        char *av[] = {"kvasir", "node", "--hub", s.hub.url, "--budget", bud, "--data", p->data, "--interval-ms", ivs,
                      "--threads", ths, NULL};
        if (kv_sw_spawn(p, av)) goto fail;
        s.n_nodes++;
        if (kv_sw_save(&s)) goto fail;
    }
    printf("swarm: hub %s, %ld nodes with %.1f MiB each (%zu shards, %.1f MiB of experts)\n", s.hub.url, n_nodes,
           (double)budget / 1048576.0, n_slabs, (double)experts / 1048576.0);

    /* 4. full coverage; 5. the gateway; 6. its /health */
    const bool tty = isatty(1);
    kv_sw_cov c = {0};
    long health = 0;
    char last_line[200] = "";
    /* the nodes settle: full coverage, then a placement map unchanged for
     * three heartbeat periods (nodes trade shards for a few rounds after the
     * first coverage, to fill the replicas still wanted) */
    uint64_t sig = 0;
    double sig_since = 0;
    bool settled = false;
    for (;;) {
        for (uint32_t i = 0; i < s.n_nodes; i++) {
            int st = 0;
            if (kv_sw_exited(&s.nodes[i], &st)) {
                char last[300];
                kv_sw_last_line(s.nodes[i].log, last, sizeof last);
                kv_cli_err(CMD, 2, "%s exited (%s); see %s", s.nodes[i].name, last[0] ? last : "no output", s.nodes[i].log);
                goto fail;
            }
        }
        if (kv_sw_exited(&s.hub, NULL)) {
            kv_cli_err(CMD, 2, "the hub exited; see %s", s.hub.log);
            goto fail;
        }
        c = kv_sw_coverage(s.hub.url);
        if (c.covered && !settled) {
            const uint64_t now_sig = kv_sw_placement_sig(s.hub.url);
            if (now_sig != sig) {
                sig = now_sig;
                sig_since = kv_sw_now();
            } else if (kv_sw_now() - sig_since >= 3.0 * (double)interval / 1e3) {
                settled = true;
            }
        }
        if (c.covered && settled && !s.gateway.pid) {
            snprintf(s.gateway.name, sizeof s.gateway.name, "gateway");
            snprintf(s.gateway.log, sizeof s.gateway.log, "%s/gateway.log", logs);
            snprintf(path, sizeof path, "%s/gateway", dir);
            /* the gateway reads the model and its workers from the hub and
             * follows the placement map as nodes come, go and trade shards */
            char *av[14 + KV_SWARM_MAX_GW_ARGS] = {"kvasir", "gateway", "--hub", s.hub.url, "--data", path,
                                                   "--listen", (char *)listen, "--threads", ths, "--key", keyf};
            for (int k = 0; k < n_gw_extra; k++) av[12 + k] = (char *)gw_extra[k];
            av[12 + n_gw_extra] = NULL;
            if (kv_sw_spawn(&s.gateway, av)) goto fail;
            if (kv_sw_save(&s) || kv_sw_wait_listening(&s.gateway, end - kv_sw_now() > 5 ? end - kv_sw_now() : 5) || kv_sw_save(&s)) goto fail;
        }
        if (s.gateway.pid) {
            if (kv_sw_exited(&s.gateway, NULL)) {
                char last[300];
                kv_sw_last_line(s.gateway.log, last, sizeof last);
                kv_cli_err(CMD, 2, "the gateway exited (%s); see %s", last[0] ? last : "no output", s.gateway.log);
                goto fail;
            }
            health = kv_sw_health(s.gateway.url);
            if (health == 200 && c.covered) break;
        }
        char line[200];
        if (!settled && c.covered) {
            snprintf(line, sizeof line, "swarm: covered (%u of %u shards live, replicas %u of %u); nodes settling",
                     c.live_shards, c.shards, c.replicas, c.wanted);
        } else if (s.gateway.pid) {
            snprintf(line, sizeof line, "swarm: waiting: %u of %u shards live, replicas %u of %u, gateway /health %ld",
                     c.live_shards, c.shards, c.replicas, c.wanted, health);
        } else {
            snprintf(line, sizeof line, "swarm: waiting: %u of %u shards live, replicas %u of %u, gateway not started",
                     c.live_shards, c.shards, c.replicas, c.wanted);
        }
        if (tty) {
            printf("\r%-100s (%.0f s)", line, kv_sw_now() - t0);
            fflush(stdout);
        } else if (strcmp(line, last_line)) { /* one line per change, not per poll */
            printf("%s (%.1f s)\n", line, kv_sw_now() - t0);
            fflush(stdout);
            snprintf(last_line, sizeof last_line, "%s", line);
        }
        if (kv_sw_now() >= end) {
            if (tty) printf("\n");
            kv_cli_err(CMD, 2, "%s within %ld ms (%u of %u shards live, gateway /health %ld); see the logs in %s "
                       "(hub.log, node1.log ... gateway.log)",
                       !c.covered ? "no full coverage" : "the gateway is not healthy", timeout, c.live_shards, c.shards,
                       health, logs);
            goto fail;
        }
        kv_sw_sleep_ms(200);
    }
    if (tty) printf("\n");
    printf("swarm up: %u nodes, %u of %u shards live, %u replicas (%.1f s)\n", s.n_nodes, c.live_shards, c.shards, c.replicas,
           kv_sw_now() - t0);
    printf("gateway  %s  (OpenAI %s/v1/chat/completions, Anthropic /v1/messages, Ollama /api/chat)\n", s.gateway.url,
           s.gateway.url);
    { /* the id requests name ("model"): the gateway's own, as its /health says it */
        json_t *h = kv_sw_get_json(s.gateway.url, "/health", 2000, NULL);
        const char *id = json_string_value(json_object_get(h, "model"));
        if (id && strlen(id) <= 256 && !strpbrk(id, "'\"\\")) /* one a shell line can carry as it is */
            printf("model    %s  (curl %s/v1/chat/completions -H 'Content-Type: application/json' -d "
                   "'{\"model\":\"%s\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}]}')\n",
                   id, s.gateway.url, id);
        else if (id && strlen(id) <= 256)
            printf("model    %s\n", id);
        json_decref(h);
    }
    printf("hub      %s  (status page %s/, market %s/v1/market)\n", s.hub.url, s.hub.url, s.hub.url);
    if (beacon_port) printf("beacon   UDP port %ld (kvasir node --budget SIZE --data DIR joins without --hub)\n", beacon_port);
    printf("key      %s (the coordinator key the hub vouches for: kvasir run --hub %s --key %s)\n", keyf, s.hub.url, keyf);
    printf("state    %s/%s (kvasir swarm status --dir %s; kvasir swarm down --dir %s)\n", dir, KV_SWARM_STATE, dir, dir);
    return 0;
fail:
    {
        int t, k, g;
        kv_sw_stop_all(&s, 5000, &t, &k, &g);
        char p2[KV_SWARM_PATH + 32], last[KV_SWARM_PATH + 40];
        snprintf(p2, sizeof p2, "%s/%s", dir, KV_SWARM_STATE);
        snprintf(last, sizeof last, "%s/swarm.last.json", dir);
        rename(p2, last);
        fprintf(stderr, "swarm: stopped the %d processes it had started; logs in %s\n", t + k, logs);
    }
    return rc;
}

static const char *kv_swarm_help =
    "usage: kvasir swarm up|status|down [options]   (kvasir swarm up --help for each)\n"
    "  up      generate or take a model, slice it, start a hub, N nodes and a gateway, wait until covered\n"
    "  status  nodes, shards, health and expert computations of the swarm in --dir\n"
    "  down    stop every process of the swarm in --dir\n";

int kv_cmd_swarm(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        fputs(kv_swarm_help, argc < 2 ? stderr : stdout);
        return argc < 2 ? 1 : 0;
    }
    if (!strcmp(argv[1], "up")) return kv_swarm_up(argc - 1, argv + 1);
    if (!strcmp(argv[1], "status")) return kv_swarm_status(argc - 1, argv + 1);
    if (!strcmp(argv[1], "down")) return kv_swarm_down(argc - 1, argv + 1);
    return kv_cli_err(CMD, 1, "unknown subcommand '%s' (up, status, down)", argv[1]);
}
