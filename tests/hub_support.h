/* Scaffolding shared by the tests that run the real `kvasir hub` process
 * (tests/test_hub.c, tests/test_hub_market.c): a tiny model sliced into a
 * temp folder, starting and stopping hubs on 127.0.0.1 port 0, a libcurl
 * HTTP helper with signed POSTs, node keys from fixed seeds, announcements
 * of real manifest slabs, and the store of one case (SQLite, or PostgreSQL
 * when KV_TEST_PG is set).
 * Header-only (static functions): include it once per test executable,
 * after kvtest.h. Define HUBT_DIR_TAG (temp folder kv_<tag>_XXXXXX) and
 * HUBT_DB_TAG (PostgreSQL database <tag>_<case>_<pid>) first so that the
 * tests' leftovers stay apart. */
#ifndef KVASIR_TEST_HUB_SUPPORT_H
#define KVASIR_TEST_HUB_SUPPORT_H

#include <curl/curl.h>
#include <jansson.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvasir/hub.h"
#include "kvasir/node.h"
#include "kvasir/slice.h"
#include "kvtest.h"
#include "proc_support.h"

#ifndef HUBT_DIR_TAG
#error "define HUBT_DIR_TAG before including hub_support.h"
#endif
#ifndef HUBT_DB_TAG
#error "define HUBT_DB_TAG before including hub_support.h"
#endif
#ifndef KVT_UNUSED
#if defined(__GNUC__)
#define KVT_UNUSED __attribute__((unused))
#else
#define KVT_UNUSED
#endif
#endif

static char g_dir[256];      /* temp folder: model, slices, db */
static char g_manifest[512]; /* g_dir/sl/manifest.json */
static kv_manifest *g_m;

/* ---- processes ------------------------------------------------------------ */

typedef struct hub_proc {
    pid_t pid;
    char url[300];
} hub_proc;

static KVT_UNUSED int run_cmd(const char *cmd) {
    int rc = system(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

/* Cases of the registry and market alone register addresses where no
 * worker listens: their hubs list what is announced (--trust-announced);
 * the proof-of-service cases clear this and run real workers. */
static bool g_trust = true;

/* Starts `kvasir hub` with extra args; waits for "listening on". */
static KVT_UNUSED int hub_start(hub_proc *p, const char *db, const char *extra) {
    char cmd[2048], addr[256];
    snprintf(cmd, sizeof cmd, "exec '%s' hub --model '%s' --db '%s' --listen 127.0.0.1:0 --quiet %s %s 2>/dev/null",
             getenv("KV_BIN"), g_manifest, db, g_trust ? "--trust-announced" : "", extra ? extra : "");
    if (kvt_spawn_listening(cmd, 10000, &p->pid, addr, sizeof addr)) {
        fprintf(stderr, "hub did not start: '%s'\n", addr);
        return -1;
    }
    snprintf(p->url, sizeof p->url, "http://%s", addr);
    return 0;
}

static KVT_UNUSED int hub_stop(hub_proc *p) {
    kill(p->pid, SIGTERM);
    int st = 0;
    for (int i = 0; i < 100; i++) {
        if (waitpid(p->pid, &st, WNOHANG) == p->pid) return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        usleep(50000);
    }
    kill(p->pid, SIGKILL);
    waitpid(p->pid, &st, 0);
    return -1;
}

/* ---- HTTP ------------------------------------------------------------------- */

typedef struct resp {
    long status;
    char *body;
    size_t n;
    char range[128]; /* Content-Range */
} resp;

static KVT_UNUSED size_t on_body(char *d, size_t s, size_t m, void *arg) {
    resp *r = arg;
    size_t n = s * m;
    char *p = realloc(r->body, r->n + n + 1);
    if (!p) return 0;
    memcpy(p + r->n, d, n);
    r->body = p;
    r->n += n;
    r->body[r->n] = 0;
    return n;
}

static KVT_UNUSED size_t on_header(char *d, size_t s, size_t m, void *arg) {
    resp *r = arg;
    size_t n = s * m;
    if (n > 15 && !strncasecmp(d, "Content-Range: ", 15)) {
        size_t l = n - 15 < sizeof r->range - 1 ? n - 15 : sizeof r->range - 1;
        memcpy(r->range, d + 15, l);
        while (l && (r->range[l - 1] == '\r' || r->range[l - 1] == '\n')) l--;
        r->range[l] = 0;
    }
    return n;
}

/* method GET/HEAD/POST, or GETBODY (a GET that sends a body); hdrs NULL-terminated list; body may be NULL. */
static KVT_UNUSED resp http(const char *method, const char *url, const char *const *hdrs, const char *body, size_t blen) {
    resp r = {0};
    CURL *c = curl_easy_init();
    struct curl_slist *hl = NULL;
    for (size_t i = 0; hdrs && hdrs[i]; i++) hl = curl_slist_append(hl, hdrs[i]);
    hl = curl_slist_append(hl, "Expect:");
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_PATH_AS_IS, 1L);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hl);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &r);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, &r);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 10000L);
    if (!strcmp(method, "HEAD")) curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
    if (!strcmp(method, "POST") || !strcmp(method, "GETBODY")) {
        if (!strcmp(method, "GETBODY")) curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, "GET");
        curl_easy_setopt(c, CURLOPT_POST, 1L);
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body ? body : "");
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, (long)blen);
    }
    if (curl_easy_perform(c) == CURLE_OK) curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r.status);
    curl_slist_free_all(hl);
    curl_easy_cleanup(c);
    if (!r.body) r.body = calloc(1, 1);
    return r;
}

static KVT_UNUSED resp get(const hub_proc *p, const char *path) {
    char url[1024];
    snprintf(url, sizeof url, "%s%s", p->url, path);
    return http("GET", url, NULL, NULL, 0);
}

/* POST signed by k with counter ctr over exactly (path, body). */
static KVT_UNUSED resp post_signed(const hub_proc *p, const kv_node_key *k, const char *path, const char *body, uint64_t ctr) {
    kv_hub_auth a;
    size_t bl = body ? strlen(body) : 0;
    kv_hub_sign(k, "POST", path, body, bl, ctr, &a);
    char h1[128], h2[64], h3[192], url[1024];
    snprintf(h1, sizeof h1, "X-Kvasir-Key: %s", a.key);
    snprintf(h2, sizeof h2, "X-Kvasir-Counter: %s", a.counter);
    snprintf(h3, sizeof h3, "X-Kvasir-Signature: %s", a.sig);
    const char *hs[] = {h1, h2, h3, "Content-Type: application/json", NULL};
    snprintf(url, sizeof url, "%s%s", p->url, path);
    return http("POST", url, hs, body, bl);
}

static KVT_UNUSED void resp_free(resp *r) {
    free(r->body);
    r->body = NULL;
}

/* True when the body is {"error": string, "code": string}. */
static KVT_UNUSED int is_json_error(const resp *r) {
    json_t *j = json_loads(r->body, 0, NULL);
    int ok = j && json_is_string(json_object_get(j, "error")) && json_is_string(json_object_get(j, "code"));
    json_decref(j);
    return ok;
}

/* ---- fixtures ------------------------------------------------------------- */

static KVT_UNUSED void test_key(kv_node_key *k, int i) {
    uint8_t seed[32] = {0};
    seed[0] = (uint8_t)i;
    seed[1] = (uint8_t)(i >> 8);
    seed[31] = 0x5a;
    kv_node_key_from_seed(k, seed);
}

static KVT_UNUSED char *fresh_nonce(const hub_proc *p) {
    resp r = get(p, "/v1/nonce");
    json_t *j = json_loads(r.body, 0, NULL);
    const char *s = json_string_value(json_object_get(j, "nonce"));
    char *out = s ? strdup(s) : NULL;
    json_decref(j);
    resp_free(&r);
    return out;
}

/* An announcement of the manifest slabs idx[0..n) with their real hashes
 * (or a corrupted hash for slab `bad`, -1 for none). */
static KVT_UNUSED char *announce_json(const char *nonce_hex, const char *addr, const int *idx, size_t n, int bad) {
    kv_hub_announce a = {0};
    for (int i = 0; i < 32; i++) {
        unsigned x;
        sscanf(nonce_hex + 2 * i, "%2x", &x);
        a.nonce[i] = (uint8_t)x;
    }
    snprintf(a.addr, sizeof a.addr, "%s", addr);
    snprintf(a.backend, sizeof a.backend, "scalar");
    a.memory = 1u << 30;
    a.shards = calloc(n ? n : 1, sizeof *a.shards);
    a.n_shards = n;
    for (size_t i = 0; i < n; i++) {
        const kv_manifest_slab *s = &g_m->slabs[idx[i]];
        a.shards[i] = (kv_hub_held){.layer = s->layer, .first = s->first, .last = s->last};
        memcpy(a.shards[i].sha256, s->file.sha256, 32);
        if (idx[i] == bad) a.shards[i].sha256[5] ^= 1;
    }
    char *js = kv_hub_announce_json(&a);
    free(a.shards);
    return js;
}

/* Registers key k holding slabs idx; returns the HTTP status; *reply gets
 * the reply body when not NULL (caller frees). */
static KVT_UNUSED long do_register(const hub_proc *p, kv_node_key *k, const char *addr, const int *idx, size_t n,
                        char **reply) {
    char *nonce = fresh_nonce(p);
    if (!nonce) return -1;
    char *body = announce_json(nonce, addr, idx, n, -1);
    resp r = post_signed(p, k, "/v1/register", body, kv_node_next_counter(k));
    free(nonce);
    free(body);
    if (reply) *reply = r.body;
    else resp_free(&r);
    return r.status;
}

static KVT_UNUSED int setup(void) {
    curl_global_init(CURL_GLOBAL_DEFAULT);
    signal(SIGPIPE, SIG_IGN);
    if (!getenv("KV_BIN")) {
        fprintf(stderr, "KV_BIN is not set\n");
        return 1;
    }
    snprintf(g_dir, sizeof g_dir, "%s/kv_" HUBT_DIR_TAG "_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(g_dir)) return 1;
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "'%s' gen-model --preset tiny --out '%s/m.gguf' >/dev/null 2>&1 && "
             "'%s' slice '%s/m.gguf' --out '%s/sl' --experts-per-slab 4 >/dev/null 2>&1",
             getenv("KV_BIN"), g_dir, getenv("KV_BIN"), g_dir, g_dir);
    if (run_cmd(cmd)) return 1;
    snprintf(g_manifest, sizeof g_manifest, "%s/sl/manifest.json", g_dir);
    kv_diag d = {0};
    if (kv_manifest_load(&g_m, g_manifest, &d)) {
        fprintf(stderr, "%s\n", d.msg);
        return 1;
    }
    return g_m->n_slabs >= 4 ? 0 : 1;
}

static KVT_UNUSED void teardown(void) {
    kv_manifest_free(g_m);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    run_cmd(cmd);
    curl_global_cleanup();
}

/* The store of one case: a SQLite file, or (KV_TEST_PG names a PostgreSQL
 * server: tests/test_pg_store.sh) a fresh database on it, so every case
 * runs against both backends. */
static KVT_UNUSED void db_path(char *out, size_t cap, const char *name) {
    const char *pg = getenv("KV_TEST_PG");
    if (!pg || !*pg) {
        snprintf(out, cap, "%s/%s.db", g_dir, name);
        return;
    }
    char cmd[1024];
    snprintf(out, cap, "pg:%s dbname=" HUBT_DB_TAG "_%s_%ld", pg, name, (long)getpid());
    snprintf(cmd, sizeof cmd, "psql -X -q -v ON_ERROR_STOP=1 '%s dbname=postgres' -c 'CREATE DATABASE " HUBT_DB_TAG "_%s_%ld' >/dev/null",
             pg, name, (long)getpid());
    ASSERT_EQ(run_cmd(cmd), 0);
}

#endif
