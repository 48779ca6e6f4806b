/* Hub benchmarks (not tests; figures go to docs/BENCHMARKS.md).
 *
 *   bench_hub market MANIFEST [--nodes N] [--reps R]
 *     the market view (GET /v1/market's JSON) and the placement map,
 *     computed in process over N injected nodes (default 2000) that together
 *     hold every shard twice; prints min / median / max milliseconds.
 *     Meant for the 122B skeleton's manifest (12,544 shards).
 *
 *   bench_hub load MANIFEST [--nodes N] [--seconds S] [--interval-ms I]
 *                           [--threads T] [--readers R] [--read-ms P]
 *     a hub on 127.0.0.1 (in this process, on its own threads) driven over
 *     HTTP by N simulated nodes (default 2000) that register (signed, with a
 *     nonce, answering the storage challenge) and then heartbeat every I ms
 *     (default 5000) for S seconds (default 30), spread over T client threads
 *     (default 16), while R coordinators (default 4) read the placement map
 *     every P ms (default 100). Prints throughput and p50/p99/max latency.
 *     The manifest must carry hashes (a real slice, e.g. the tiny preset).
 *
 * Loopback only; every count and duration is bounded. */
#include <curl/curl.h>
#include <inttypes.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "hub/hub_internal.h"
#include "kvasir/hub.h"
#include "kvasir/slice.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static long arg_long(int argc, char **argv, const char *flag, long def, long lo, long hi) {
    for (int i = 3; i + 1 < argc; i++)
        if (!strcmp(argv[i], flag)) {
            char *e;
            long v = strtol(argv[i + 1], &e, 10);
            if (*e || v < lo || v > hi) {
                fprintf(stderr, "bench_hub: %s must be in [%ld, %ld]\n", flag, lo, hi);
                exit(1);
            }
            return v;
        }
    return def;
}

/* --db URI: the store (default a fresh SQLite file in TMPDIR; a PostgreSQL
 * URI measures the shared backend: bench/hub.sh with HUB_PG=1) */
static const char *arg_db(int argc, char **argv) {
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--db")) return argv[i + 1];
    return NULL;
}

static kv_hub *open_hub(const char *manifest, char *dbpath, size_t cap, uint32_t per_ip, const char *uri) {
    if (uri) snprintf(dbpath, cap, "%s", uri);
    else snprintf(dbpath, cap, "%s/kv_bench_hub_%ld.db", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (long)getpid());
    kv_hub_opts o = {.manifest = manifest, .db = dbpath, .listen = "127.0.0.1:0", .quiet = true,
                     .per_ip_conns = per_ip, .max_conns = 4096, .threads = 4};
    kv_diag d = {0};
    kv_hub *h = NULL;
    if (kv_hub_open(&h, &o, &d)) {
        fprintf(stderr, "bench_hub: %s\n", d.msg);
        exit(2);
    }
    return h;
}

static void drop_db(const char *db) {
    if (!strncmp(db, "pg:", 3) || !strncmp(db, "postgres", 8)) return; /* the script drops the server */
    char p[600];
    unlink(db);
    snprintf(p, sizeof p, "%s-wal", db);
    unlink(p);
    snprintf(p, sizeof p, "%s-shm", db);
    unlink(p);
}

static void print_stats(const char *what, double *ms, size_t n) {
    if (!n) {
        printf("%-22s no samples\n", what);
        return;
    }
    qsort(ms, n, sizeof *ms, cmp_d);
    printf("%-22s n=%zu  p50 %.2f ms  p99 %.2f ms  max %.2f ms\n", what, n, ms[n / 2], ms[(size_t)(n * 0.99)],
           ms[n - 1]);
}

/* ---- market ---------------------------------------------------------------- */

static int bench_market(int argc, char **argv) {
    long n_nodes = arg_long(argc, argv, "--nodes", 2000, 1, 1000000);
    long reps = arg_long(argc, argv, "--reps", 20, 1, 10000);
    char db[512];
    kv_hub *h = open_hub(argv[2], db, sizeof db, 64, arg_db(argc, argv));
    size_t ns = kv_hub_n_shards(h);
    /* every shard held twice, spread round-robin over the nodes; a tenth of
     * the nodes are past the deadline (so liveness is really evaluated) */
    size_t per = (2 * ns + (size_t)n_nodes - 1) / (size_t)n_nodes;
    uint32_t *sl = malloc(per * sizeof *sl);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t now_ms = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    size_t next = 0;
    for (long k = 0; k < n_nodes; k++) {
        uint8_t pk[32] = {0};
        memcpy(pk, &k, sizeof k);
        pk[31] = 0xb7;
        for (size_t i = 0; i < per; i++) sl[i] = (uint32_t)(next++ % ns);
        char addr[64];
        snprintf(addr, sizeof addr, "10.0.%ld.%ld:7000", k / 256, k % 256);
        kv_diag d = {0};
        if (kv_hub_inject_node(h, pk, addr, sl, per, k % 10 ? now_ms : now_ms - 3600 * 1000, &d)) {
            fprintf(stderr, "bench_hub: %s\n", d.msg);
            return 2;
        }
    }
    free(sl);
    double *mk = malloc((size_t)reps * sizeof *mk), *pl = malloc((size_t)reps * sizeof *pl);
    size_t mlen = 0, plen = 0;
    for (long r = 0; r < reps; r++) {
        char *s;
        kv_diag d = {0};
        double t0 = now_s();
        if (kv_hub_market_json(h, &s, &mlen, &d)) return 2;
        mk[r] = (now_s() - t0) * 1e3;
        free(s);
        t0 = now_s();
        if (kv_hub_placement_json(h, &s, &plen, &d)) return 2;
        pl[r] = (now_s() - t0) * 1e3;
        free(s);
    }
    qsort(mk, (size_t)reps, sizeof *mk, cmp_d);
    qsort(pl, (size_t)reps, sizeof *pl, cmp_d);
    printf("market view: %zu shards, %ld nodes (%zu shards each, 10%% stale), %ld reps\n", ns, n_nodes, per, reps);
    printf("  GET /v1/market    JSON %zu bytes: min %.2f ms  median %.2f ms  max %.2f ms\n", mlen, mk[0],
           mk[reps / 2], mk[reps - 1]);
    printf("  GET /v1/placement JSON %zu bytes: min %.2f ms  median %.2f ms  max %.2f ms\n", plen, pl[0],
           pl[reps / 2], pl[reps - 1]);
    free(mk);
    free(pl);
    kv_hub_free(h);
    drop_db(db);
    return 0;
}

/* ---- load --------------------------------------------------------------------- */

typedef struct sim_node {
    kv_node_key key;
    double due; /* next heartbeat, monotonic seconds */
} sim_node;

typedef struct lg {
    const char *url;         /* http://127.0.0.1:PORT */
    const char *dir;         /* manifest's folder (to answer challenges) */
    const kv_manifest *m;
    sim_node *nodes;
    size_t n_nodes;
    double interval, t_end, read_every;
    int n_threads;
    int reg;                 /* register the nodes first */
} lg;

typedef struct worker {
    lg *g;
    int id;
    double *lat;     /* ms */
    size_t n_lat, cap_lat;
    size_t errors;
    CURL *c;
} worker;

static size_t sink_cb(char *d, size_t s, size_t n, void *arg) {
    char **buf = arg;
    size_t k = s * n, have = *buf ? strlen(*buf) : 0;
    if (have + k > (64u << 20)) return 0;
    char *p = realloc(*buf, have + k + 1);
    if (!p) return 0;
    memcpy(p + have, d, k);
    p[have + k] = 0;
    *buf = p;
    return k;
}

/* One request on w's keep-alive handle; returns status, body in *out. */
static long request(worker *w, const char *method, const char *path, kv_node_key *k, const char *body, char **out) {
    char url[512];
    snprintf(url, sizeof url, "%s%s", w->g->url, path);
    struct curl_slist *hl = NULL;
    char h1[128], h2[64], h3[192];
    if (k) {
        kv_hub_auth a;
        kv_hub_sign(k, method, path, body, strlen(body), kv_node_next_counter(k), &a);
        snprintf(h1, sizeof h1, "X-Kvasir-Key: %s", a.key);
        snprintf(h2, sizeof h2, "X-Kvasir-Counter: %s", a.counter);
        snprintf(h3, sizeof h3, "X-Kvasir-Signature: %s", a.sig);
        hl = curl_slist_append(hl, h1);
        hl = curl_slist_append(hl, h2);
        hl = curl_slist_append(hl, h3);
    }
    hl = curl_slist_append(hl, "Expect:");
    *out = NULL;
    curl_easy_setopt(w->c, CURLOPT_URL, url);
    curl_easy_setopt(w->c, CURLOPT_HTTPHEADER, hl);
    curl_easy_setopt(w->c, CURLOPT_WRITEFUNCTION, sink_cb);
    curl_easy_setopt(w->c, CURLOPT_WRITEDATA, out);
    curl_easy_setopt(w->c, CURLOPT_TIMEOUT_MS, 10000L);
    if (!strcmp(method, "POST")) {
        curl_easy_setopt(w->c, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(w->c, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    } else {
        curl_easy_setopt(w->c, CURLOPT_HTTPGET, 1L);
    }
    long st = 0;
    if (curl_easy_perform(w->c) == CURLE_OK) curl_easy_getinfo(w->c, CURLINFO_RESPONSE_CODE, &st);
    curl_slist_free_all(hl);
    return st;
}

static void add_lat(worker *w, double ms) {
    if (w->n_lat == w->cap_lat) {
        w->cap_lat = w->cap_lat ? w->cap_lat * 2 : 4096;
        w->lat = realloc(w->lat, w->cap_lat * sizeof *w->lat);
    }
    w->lat[w->n_lat++] = ms;
}

static int unhex32(const char *s, uint8_t out[32]) {
    if (!s || strlen(s) != 64) return -1;
    for (int i = 0; i < 32; i++) {
        unsigned x;
        if (sscanf(s + 2 * i, "%2x", &x) != 1) return -1;
        out[i] = (uint8_t)x;
    }
    return 0;
}

/* Registers node i holding two slabs (i and i + n/2 mod n_slabs) and answers
 * the challenge from the files. */
static int sim_register(worker *w, size_t i) {
    lg *g = w->g;
    sim_node *sn = &g->nodes[i];
    char *body = NULL;
    if (request(w, "GET", "/v1/nonce", NULL, "", &body) != 200) return -1;
    json_t *j = json_loads(body, 0, NULL);
    free(body);
    kv_hub_announce a = {0};
    int bad = unhex32(json_string_value(json_object_get(j, "nonce")), a.nonce);
    json_decref(j);
    if (bad) return -1;
    snprintf(a.addr, sizeof a.addr, "127.0.0.1:%zu", 10000 + i);
    snprintf(a.backend, sizeof a.backend, "scalar");
    a.memory = 1ull << 30;
    kv_hub_held held[2];
    size_t ns = g->m->n_slabs, s0 = i % ns, s1 = (i + ns / 2) % ns;
    size_t idx[2] = {s0 < s1 ? s0 : s1, s0 < s1 ? s1 : s0};
    a.n_shards = s0 == s1 ? 1 : 2;
    for (size_t k = 0; k < a.n_shards; k++) {
        const kv_manifest_slab *s = &g->m->slabs[idx[k]];
        held[k] = (kv_hub_held){.layer = s->layer, .first = s->first, .last = s->last};
        memcpy(held[k].sha256, s->file.sha256, 32);
    }
    a.shards = held;
    char *js = kv_hub_announce_json(&a);
    long st = request(w, "POST", "/v1/register", &sn->key, js, &body);
    free(js);
    if (st != 200) {
        fprintf(stderr, "register: HTTP %ld %s\n", st, body ? body : "");
        free(body);
        return -1;
    }
    j = json_loads(body, 0, NULL);
    free(body);
    json_t *ch = json_object_get(j, "challenge");
    uint8_t nonce[32];
    const char *rel = json_string_value(json_object_get(ch, "path"));
    int rc = -1;
    if (ch && rel && !unhex32(json_string_value(json_object_get(ch, "nonce")), nonce)) {
        for (size_t k = 0; k < ns; k++)
            if (!strcmp(g->m->slabs[k].file.path, rel)) {
                char path[1024], ah[65], ab[200];
                uint8_t ans[32];
                kv_diag d = {0};
                snprintf(path, sizeof path, "%s/%s", g->dir, rel);
                if (kv_hub_challenge_answer(path, g->m->slabs[k].file.size, nonce, ans, &d)) break;
                kv_hex(ans, 32, ah);
                snprintf(ab, sizeof ab, "{\"nonce\":\"%s\",\"sha256\":\"%s\"}",
                         json_string_value(json_object_get(ch, "nonce")), ah);
                st = request(w, "POST", "/v1/challenge", &sn->key, ab, &body);
                free(body);
                rc = st == 200 ? 0 : -1;
                break;
            }
    }
    json_decref(j);
    return rc;
}

static void *hb_thread(void *arg) {
    worker *w = arg;
    lg *g = w->g;
    w->c = curl_easy_init();
    curl_easy_setopt(w->c, CURLOPT_NOSIGNAL, 1L);
    for (size_t i = (size_t)w->id; g->reg && i < g->n_nodes; i += (size_t)g->n_threads)
        if (sim_register(w, i)) w->errors++;
    /* heartbeats: node i at phase i/n of the interval */
    double t0 = now_s();
    for (size_t i = (size_t)w->id; i < g->n_nodes; i += (size_t)g->n_threads)
        g->nodes[i].due = t0 + g->interval * (double)i / (double)g->n_nodes;
    while (now_s() < g->t_end) {
        size_t best = (size_t)-1;
        for (size_t i = (size_t)w->id; i < g->n_nodes; i += (size_t)g->n_threads)
            if (best == (size_t)-1 || g->nodes[i].due < g->nodes[best].due) best = i;
        if (best == (size_t)-1) break;
        double wait = g->nodes[best].due - now_s();
        if (wait > 0) usleep((useconds_t)(wait * 1e6));
        if (now_s() >= g->t_end) break;
        char *body = NULL;
        double t = now_s();
        long st = request(w, "POST", "/v1/heartbeat", &g->nodes[best].key, "{}", &body);
        add_lat(w, (now_s() - t) * 1e3);
        if (st != 200) w->errors++;
        free(body);
        g->nodes[best].due += g->interval;
    }
    curl_easy_cleanup(w->c);
    return NULL;
}

static void *rd_thread(void *arg) {
    worker *w = arg;
    lg *g = w->g;
    w->c = curl_easy_init();
    curl_easy_setopt(w->c, CURLOPT_NOSIGNAL, 1L);
    double next = now_s();
    while (now_s() < g->t_end) {
        char *body = NULL;
        double t = now_s();
        long st = request(w, "GET", "/v1/placement", NULL, "", &body);
        add_lat(w, (now_s() - t) * 1e3);
        if (st != 200) w->errors++;
        free(body);
        next += g->read_every;
        double wait = next - now_s();
        if (wait > 0) usleep((useconds_t)(wait * 1e6));
    }
    curl_easy_cleanup(w->c);
    return NULL;
}

static int bench_load(int argc, char **argv) {
    long n_nodes = arg_long(argc, argv, "--nodes", 2000, 1, 100000);
    long secs = arg_long(argc, argv, "--seconds", 30, 1, 600);
    long interval = arg_long(argc, argv, "--interval-ms", 5000, 10, 600000);
    long n_thr = arg_long(argc, argv, "--threads", 16, 1, 256);
    long n_rd = arg_long(argc, argv, "--readers", 4, 0, 256);
    long read_ms = arg_long(argc, argv, "--read-ms", 100, 1, 60000);
    kv_manifest *m = NULL;
    kv_diag d = {0};
    if (kv_manifest_load(&m, argv[2], &d)) {
        fprintf(stderr, "bench_hub: %s\n", d.msg);
        return 2;
    }
    if (m->sparse) {
        fprintf(stderr, "bench_hub: load needs a manifest with hashes (not a skeleton)\n");
        return 2;
    }
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", argv[2]);
    char *sl = strrchr(dir, '/');
    if (sl) *sl = 0; else snprintf(dir, sizeof dir, ".");
    char db[512];
    kv_hub *h = open_hub(argv[2], db, sizeof db, (uint32_t)(n_thr + n_rd + 8), arg_db(argc, argv));
    char url[200];
    snprintf(url, sizeof url, "http://%s", kv_hub_addr(h));
    lg g = {.url = url, .dir = dir, .m = m, .n_nodes = (size_t)n_nodes, .interval = interval / 1e3,
            .read_every = read_ms / 1e3, .n_threads = (int)n_thr};
    g.nodes = calloc((size_t)n_nodes, sizeof *g.nodes);
    for (long i = 0; i < n_nodes; i++) {
        uint8_t seed[32] = {0};
        memcpy(seed, &i, sizeof i);
        seed[31] = 0x77;
        kv_node_key_from_seed(&g.nodes[i].key, seed);
    }
    worker *hw = calloc((size_t)n_thr, sizeof *hw), *rw = calloc((size_t)(n_rd ? n_rd : 1), sizeof *rw);
    pthread_t *ht = calloc((size_t)n_thr, sizeof *ht), *rt = calloc((size_t)(n_rd ? n_rd : 1), sizeof *rt);
    for (long t = 0; t < n_thr; t++) hw[t] = (worker){.g = &g, .id = (int)t};
    /* phase 1: register everyone (timed separately) */
    double r0 = now_s();
    {
        lg g1 = g;
        g1.t_end = 0; /* the heartbeat loop exits at once */
        g1.reg = 1;
        for (long t = 0; t < n_thr; t++) {
            hw[t].g = &g1;
            pthread_create(&ht[t], NULL, hb_thread, &hw[t]);
        }
        for (long t = 0; t < n_thr; t++) pthread_join(ht[t], NULL);
    }
    double reg_s = now_s() - r0;
    size_t reg_err = 0;
    for (long t = 0; t < n_thr; t++) reg_err += hw[t].errors;
    printf("registered %ld nodes (nonce, signed register, storage challenge) in %.2f s, %zu errors\n", n_nodes,
           reg_s, reg_err);
    /* phase 2: heartbeats and placement readers for secs seconds */
    for (long t = 0; t < n_thr; t++) {
        free(hw[t].lat);
        hw[t] = (worker){.g = &g, .id = (int)t};
    }
    g.t_end = now_s() + (double)secs;
    for (long t = 0; t < n_thr; t++) pthread_create(&ht[t], NULL, hb_thread, &hw[t]);
    for (long t = 0; t < n_rd; t++) {
        rw[t] = (worker){.g = &g, .id = (int)t};
        pthread_create(&rt[t], NULL, rd_thread, &rw[t]);
    }
    for (long t = 0; t < n_thr; t++) pthread_join(ht[t], NULL);
    for (long t = 0; t < n_rd; t++) pthread_join(rt[t], NULL);
    size_t nh = 0, nr = 0, eh = 0, er = 0;
    for (long t = 0; t < n_thr; t++) nh += hw[t].n_lat, eh += hw[t].errors;
    for (long t = 0; t < n_rd; t++) nr += rw[t].n_lat, er += rw[t].errors;
    double *all_h = malloc((nh ? nh : 1) * sizeof *all_h), *all_r = malloc((nr ? nr : 1) * sizeof *all_r);
    size_t k = 0;
    for (long t = 0; t < n_thr; t++) memcpy(all_h + k, hw[t].lat, hw[t].n_lat * sizeof *all_h), k += hw[t].n_lat;
    k = 0;
    for (long t = 0; t < n_rd; t++) memcpy(all_r + k, rw[t].lat, rw[t].n_lat * sizeof *all_r), k += rw[t].n_lat;
    printf("load: %ld nodes heartbeating every %ld ms over %ld client threads, %ld placement readers every %ld ms, "
           "%ld s\n", n_nodes, interval, n_thr, n_rd, read_ms, secs);
    printf("  throughput: %.1f heartbeats/s + %.1f placement reads/s; errors: %zu heartbeat, %zu read\n",
           (double)nh / (double)secs, (double)nr / (double)secs, eh, er);
    print_stats("  POST /v1/heartbeat", all_h, nh);
    print_stats("  GET /v1/placement", all_r, nr);
    char *mj;
    size_t ml;
    if (!kv_hub_market_json(h, &mj, &ml, &d)) {
        json_t *j = json_loadb(mj, ml, 0, NULL);
        printf("  market after the run: covered=%s live_nodes=%lld\n",
               json_is_true(json_object_get(j, "covered")) ? "true" : "false",
               (long long)json_integer_value(json_object_get(j, "live_nodes")));
        json_decref(j);
        free(mj);
    }
    for (long t = 0; t < n_thr; t++) free(hw[t].lat);
    for (long t = 0; t < n_rd; t++) free(rw[t].lat);
    free(all_h);
    free(all_r);
    free(hw);
    free(rw);
    free(ht);
    free(rt);
    free(g.nodes);
    kv_hub_free(h);
    kv_manifest_free(m);
    drop_db(db);
    return (eh || er || reg_err) ? 1 : 0;
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN);
    curl_global_init(CURL_GLOBAL_DEFAULT);
    int rc;
    if (argc >= 3 && !strcmp(argv[1], "market")) rc = bench_market(argc, argv);
    else if (argc >= 3 && !strcmp(argv[1], "load")) rc = bench_load(argc, argv);
    else {
        fprintf(stderr, "usage: bench_hub market MANIFEST [--nodes N] [--reps R]\n"
                        "       bench_hub load MANIFEST [--nodes N] [--seconds S] [--interval-ms I] [--threads T]\n"
                        "                               [--readers R] [--read-ms P]\n");
        rc = 1;
    }
    curl_global_cleanup();
    return rc;
}
