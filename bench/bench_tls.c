/* What TLS 1.3 costs on dispatch links, against plain TCP, on loopback, in
 * one run (not a test). Everything runs in this process: a real worker
 * (kv_worker, its own thread and a 1-thread compute pool) serving the
 * bench model, the `small` preset of `kvasir gen-model` in Q8_0 (4 layers,
 * n_embd 512, 16 experts top-4 of 512), sliced 4 experts per slab into a
 * temporary folder; and coordinators (kv_remote, kv_engine) that reach it
 * over TLS (v5, pinned to the worker's key, the key handshake bound to the
 * session) and with insecure_plaintext (plain TCP, v5 without binding),
 * both connected at once, the calls alternating between them so both see
 * the same machine load.
 *   - dispatch round trip: n_dec COMPUTE calls of 1 token x 4 experts
 *     (decode size) and n_pre of 256 tokens x 4 experts (prefill size)
 *     through the remote provider, f32 on the wire; wall time of each call
 *     (median, p99) and the process CPU time per call (getrusage: both ends
 *     and the worker's compute, which is the same on both paths);
 *   - bulk: mb MiB one way in 1 MiB frames between two kv_net loops (one
 *     thread each), through kv_tls_net_io and through plain TCP; GB/s of
 *     payload and CPU seconds per GB (1e9 bytes) of the sending and the
 *     receiving thread (getrusage RUSAGE_THREAD), reps times each;
 *   - decode: tokens/s of the engine with the remote provider (what
 *     `kvasir bench -m DIR/manifest.json --worker A [--insecure-plaintext]`
 *     runs), a 16-token prompt then n_gen greedy tokens, reps times each.
 * Usage: bench_tls [n_dec n_pre mb reps n_gen]; defaults 2000 40 1024 3 128. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/dispatch_remote.h"
#include "kvasir/dispatch_worker.h"
#include "kvasir/engine.h"
#include "kvasir/gen.h"
#include "kvasir/link.h"
#include "kvasir/net.h"
#include "kvasir/pool.h"
#include "kvasir/quant.h"
#include "kvasir/slice.h"
#include "kvasir/tls.h"

#define PRE_TOKENS 256u         /* tokens of a prefill-size COMPUTE */
#define BULK_FRAME (1u << 20)   /* payload bytes of one bulk frame */
#define BULK_QUEUE (4u << 20)   /* the sender keeps at most this much queued */

static kv_node_key g_wkey, g_ckey;
static char g_dir[64];

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* CPU seconds (user + system) of the process or of the calling thread. */
static double cpu_s(int who) {
    struct rusage ru;
    getrusage(who, &ru);
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) + (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

static int rm_entry(const char *p, const struct stat *st, int flag, struct FTW *f) {
    (void)st, (void)flag, (void)f;
    return remove(p);
}
static void cleanup(void) {
    if (g_dir[0]) nftw(g_dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static void die(const char *what, const kv_diag *d) {
    fprintf(stderr, "bench_tls: %s: %s\n", what, d ? d->msg : "");
    cleanup();
    exit(1);
}

static int cmp_dbl(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int copy_file(const char *from, const char *to) {
    FILE *in = fopen(from, "rb"), *out = in ? fopen(to, "wb") : NULL;
    char buf[1 << 16];
    size_t n;
    int rc = in && out ? 0 : -1;
    while (!rc && (n = fread(buf, 1, sizeof buf, in)) > 0)
        if (fwrite(buf, 1, n, out) != n) rc = -1;
    if (in) fclose(in);
    if (out && fclose(out)) rc = -1;
    return rc;
}

/* ---- the model and the worker --------------------------------------------------- */

static kv_gen_config g_cfg;
static char g_manifest[128], g_slices[96];

/* The small preset in Q8_0, sliced; the coordinator's folder (backbone and
 * manifest only, so every expert is the worker's) at g_manifest. */
static void make_model(void) {
    kv_diag d = {0};
    snprintf(g_dir, sizeof g_dir, "/tmp/kvasir-bench-tls.XXXXXX");
    if (!mkdtemp(g_dir)) die("mkdtemp", NULL);
    if (kv_gen_preset_get("small", &g_cfg, &d)) die("preset", &d);
    g_cfg.type = KV_TYPE_Q8_0;
    g_cfg.n_threads = 1;
    char model[96], coord[96], f1[160], f2[160];
    snprintf(model, sizeof model, "%s/m.gguf", g_dir);
    snprintf(g_slices, sizeof g_slices, "%s/slices", g_dir);
    snprintf(coord, sizeof coord, "%s/coord", g_dir);
    if (kv_gen_model(&g_cfg, model, &d)) die("gen-model", &d);
    const kv_slice_opts so = {4, -1, -1, 1};
    if (kv_slice_model(model, g_slices, &so, NULL, &d)) die("slice", &d);
    if (mkdir(coord, 0755)) die("mkdir", NULL);
    const char *files[] = {"backbone.gguf", "manifest.json"};
    for (int i = 0; i < 2; i++) {
        snprintf(f1, sizeof f1, "%s/%s", g_slices, files[i]);
        snprintf(f2, sizeof f2, "%s/%s", coord, files[i]);
        if (copy_file(f1, f2)) die("copying the coordinator's folder", NULL);
    }
    snprintf(g_manifest, sizeof g_manifest, "%s/manifest.json", coord);
}

static void *worker_main(void *p) {
    kv_diag d = {0};
    if (kv_worker_serve(p, &d)) fprintf(stderr, "bench_tls: worker: %s\n", d.msg);
    return NULL;
}

/* ---- dispatch round trips -------------------------------------------------------- */

typedef struct trips {
    double *wall_us, *cpu_us; /* [n] per call, sorted after the run */
    int n;
} trips;

/* One compute of n_tok tokens on layer `layer` through p; wall and CPU. */
static void one_call(const kv_expert_provider *p, kv_expert_req *rq, float *out, double *wall_us, double *cpu_us) {
    kv_diag d = {0};
    const double c0 = cpu_s(RUSAGE_SELF);
    const int64_t t0 = now_ns();
    if (p->compute(p->impl, rq, out, &d)) die("compute", &d);
    *wall_us = (double)(now_ns() - t0) / 1e3;
    *cpu_us = (cpu_s(RUSAGE_SELF) - c0) * 1e6;
}

/* n calls of n_tok tokens on each provider, alternating which goes first. */
static void round_trips(const kv_expert_provider *pt, const kv_expert_provider *pp, uint32_t n_tok, int n,
                        trips *tt, trips *tp) {
    const uint32_t E = g_cfg.n_embd, K = g_cfg.n_expert_used;
    float *x = malloc((size_t)n_tok * E * sizeof *x), *out = malloc((size_t)n_tok * K * E * sizeof *out);
    int32_t *ids = malloc((size_t)n_tok * K * sizeof *ids);
    if (!x || !out || !ids) die("out of memory", NULL);
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < (size_t)n_tok * E; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)((int)(s >> 40) % 2001 - 1000) / 1000.0f;
    }
    for (uint32_t t = 0; t < n_tok; t++) /* K distinct experts per token, spread over all of them */
        for (uint32_t k = 0; k < K; k++) ids[t * K + k] = (int32_t)((t * 7 + k * (g_cfg.n_expert / K)) % g_cfg.n_expert);
    kv_expert_req rq = {.n_tokens = n_tok, .n_embd = E, .n_used = K, .x = x, .ids = ids};
    double w, c;
    for (int i = -10; i < n; i++) { /* 10 warm-up calls each */
        rq.layer = (uint32_t)(i + 10) % g_cfg.n_layer;
        for (int j = 0; j < 2; j++) {
            const bool tls = (j == 0) == (i % 2 == 0);
            one_call(tls ? pt : pp, &rq, out, &w, &c);
            if (i < 0) continue;
            trips *r = tls ? tt : tp;
            r->wall_us[i] = w, r->cpu_us[i] = c;
        }
    }
    tt->n = tp->n = n;
    qsort(tt->wall_us, (size_t)n, sizeof(double), cmp_dbl);
    qsort(tp->wall_us, (size_t)n, sizeof(double), cmp_dbl);
    free(x), free(out), free(ids);
}

static double mean(const double *v, int n) {
    double s = 0;
    for (int i = 0; i < n; i++) s += v[i];
    return n ? s / n : 0;
}

/* ---- bulk transfer through kv_net ---------------------------------------------- */

typedef struct bulk {
    bool tls;
    uint64_t total;           /* payload bytes to send */
    int lfd;                  /* the receiver's listening socket */
    uint16_t port;
    kv_tls_ctx *rctx, *sctx;  /* receiver's and sender's certificates */
    kv_net_loop *rl, *sl;
    uint64_t sent, got;       /* payload bytes */
    bool ended;               /* the end frame is queued */
    int64_t t0, t1;           /* ns: the sender's handshake done, the ack in */
    double cpu_send, cpu_recv; /* CPU seconds of each loop thread */
    kv_net_watch lw;
    kv_net_budget budget;
} bulk;

static uint8_t g_payload[BULK_FRAME];

static int frame_len(kv_net_conn *c, const uint8_t *h, size_t *total, kv_diag *d) {
    (void)c, (void)d;
    *total = 4 + ((size_t)h[0] | (size_t)h[1] << 8 | (size_t)h[2] << 16 | (size_t)h[3] << 24);
    return 0;
}

static void put_frame(kv_net_conn *c, size_t n) {
    uint8_t *p = kv_net_conn_reserve(c, 4 + n);
    if (!p) return; /* closed with KV_ENOMEM: on_close reports it */
    p[0] = (uint8_t)n, p[1] = (uint8_t)(n >> 8), p[2] = (uint8_t)(n >> 16), p[3] = (uint8_t)(n >> 24);
    memcpy(p + 4, g_payload, n);
    kv_net_conn_commit(c, 4 + n);
}

static int recv_frame(kv_net_conn *c, const uint8_t *f, size_t n) {
    bulk *b = kv_net_conn_data(c);
    b->got += n - 4;
    if (n == 4) put_frame(c, 0); /* the end: acknowledge it */
    return 0;
}

static void recv_close(kv_net_conn *c, int code, const char *why) {
    bulk *b = kv_net_conn_data(c);
    if (code) fprintf(stderr, "bench_tls: bulk receiver: %s\n", why);
    kv_net_loop_stop(b->rl);
}

static void on_accept(kv_net_loop *l, kv_net_watch *w, unsigned ev) {
    (void)ev;
    bulk *b = w->data;
    const int fd = accept4(b->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    kv_net_watch_del(l, w);
    kv_diag d = {0};
    kv_tls *t = NULL;
    const kv_tls_opts to = {.server = true};
    if (b->tls && kv_tls_new(&t, b->rctx, &to, &d)) die("TLS session", &d);
    const kv_net_conn_opts o = {.header = 4, .max_frame = 4 + BULK_FRAME, .tx_max = 1u << 16, .keep = SIZE_MAX,
                                .budget = &b->budget, .io = b->tls ? &kv_tls_net_io : NULL, .io_ctx = t};
    const kv_net_conn_cbs cbs = {.frame_len = frame_len, .on_frame = recv_frame, .on_close = recv_close};
    kv_net_conn *c = NULL;
    if (kv_net_conn_new(&c, l, fd, &o, &cbs, b, &d)) die("accepted connection", &d);
}

static void pump(kv_net_conn *c) {
    bulk *b = kv_net_conn_data(c);
    while (b->sent < b->total && kv_net_conn_pending(c) < BULK_QUEUE && !kv_net_conn_closing(c)) {
        const uint64_t left = b->total - b->sent;
        const size_t k = left < BULK_FRAME ? (size_t)left : BULK_FRAME;
        put_frame(c, k);
        b->sent += k;
    }
    if (b->sent == b->total && !b->ended) put_frame(c, 0), b->ended = true;
}

static void send_open(kv_net_conn *c, int code) {
    bulk *b = kv_net_conn_data(c);
    if (code) return; /* on_close says why */
    b->t0 = now_ns();
    pump(c);
}

static int send_ack(kv_net_conn *c, const uint8_t *f, size_t n) {
    bulk *b = kv_net_conn_data(c);
    b->t1 = now_ns();
    kv_net_conn_close(c, 0, "done");
    return 0;
}

static void send_close(kv_net_conn *c, int code, const char *why) {
    bulk *b = kv_net_conn_data(c);
    if (code) fprintf(stderr, "bench_tls: bulk sender: %s\n", why);
    kv_net_loop_stop(b->sl);
}

static void *recv_main(void *p) {
    bulk *b = p;
    kv_diag d = {0};
    const double c0 = cpu_s(RUSAGE_THREAD);
    if (kv_net_loop_run(b->rl, &d)) die("receiver loop", &d);
    b->cpu_recv = cpu_s(RUSAGE_THREAD) - c0;
    return NULL;
}

static void *send_main(void *p) {
    bulk *b = p;
    kv_diag d = {0};
    const double c0 = cpu_s(RUSAGE_THREAD);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(b->port), .sin_addr.s_addr = htonl(0x7f000001)};
    kv_tls *t = NULL;
    const kv_tls_opts to = {.pin_key = g_wkey.pk};
    if (b->tls && kv_tls_new(&t, b->sctx, &to, &d)) die("TLS session", &d);
    const kv_net_conn_opts o = {.header = 4, .max_frame = 4, .tx_max = BULK_QUEUE + 2 * (4 + BULK_FRAME),
                                .keep = SIZE_MAX, .budget = &b->budget, .io = b->tls ? &kv_tls_net_io : NULL,
                                .io_ctx = t};
    const kv_net_conn_cbs cbs = {.on_open = send_open, .frame_len = frame_len, .on_frame = send_ack,
                                 .on_drain = pump, .on_close = send_close};
    kv_net_conn *c = NULL;
    if (kv_net_conn_dial(&c, b->sl, (const struct sockaddr *)&sa, sizeof sa, 5000, &o, &cbs, b, &d)) die("dial", &d);
    if (kv_net_loop_run(b->sl, &d)) die("sender loop", &d);
    b->cpu_send = cpu_s(RUSAGE_THREAD) - c0;
    return NULL;
}

/* One transfer of mb MiB; fills the figures of b. */
static void bulk_run(bulk *b, bool tls, uint64_t mb, kv_tls_ctx *rctx, kv_tls_ctx *sctx) {
    memset(b, 0, sizeof *b);
    b->tls = tls, b->total = mb << 20, b->rctx = rctx, b->sctx = sctx;
    kv_net_budget_init(&b->budget, 0);
    kv_diag d = {0};
    char addr[80];
    if (kv_net_listen("127.0.0.1:0", 4, &b->lfd, addr, sizeof addr, &d)) die("listen", &d);
    b->port = (uint16_t)atoi(strrchr(addr, ':') + 1);
    if (kv_net_loop_new(&b->rl, &d) || kv_net_loop_new(&b->sl, &d)) die("loop", &d);
    if (kv_net_watch_add(b->rl, &b->lw, b->lfd, KV_NET_READ, on_accept, b, &d)) die("watch", &d);
    pthread_t rt, st;
    pthread_create(&rt, NULL, recv_main, b);
    pthread_create(&st, NULL, send_main, b);
    pthread_join(st, NULL);
    pthread_join(rt, NULL);
    kv_net_loop_free(b->sl);
    kv_net_loop_free(b->rl);
    close(b->lfd);
    if (!b->t1 || b->got != b->total) die(tls ? "TLS transfer incomplete" : "plain transfer incomplete", NULL);
}

/* ---- decode through the engine --------------------------------------------------- */

static double decode_tps(kv_engine *e, uint32_t n_gen) {
    kv_diag d = {0};
    kv_session *s = NULL;
    kv_session_opts so = {.sample = kv_sample_defaults(), .max_tokens = n_gen + 2, .ignore_eog = true};
    so.sample.temp = 0;
    int32_t prompt[16];
    for (int i = 0; i < 16; i++) prompt[i] = (int32_t)((1000003u * (uint32_t)(i + 1)) % g_cfg.n_vocab);
    if (kv_session_new(&s, e, &so, &d) || kv_session_prompt(s, prompt, 16, &d)) die("session", &d);
    while (kv_session_status(s) == KV_SESSION_PREFILL)
        if (kv_engine_step(e, &d) < 0) die("prefill", &d);
    if (kv_session_status(s) != KV_SESSION_DECODE) die("prefill did not reach decode", NULL);
    const int64_t t0 = now_ns();
    for (uint32_t i = 0; i < n_gen; i++)
        if (kv_engine_step(e, &d) < 0 || kv_session_status(s) == KV_SESSION_FAILED) die("decode", &d);
    const double tps = (double)n_gen / ((double)(now_ns() - t0) / 1e9);
    kv_session_free(s);
    return tps;
}

/* ---- report ------------------------------------------------------------------------ */

static void cpu_name(char *out, size_t cap) {
    snprintf(out, cap, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10)) {
            const char *c = strchr(line, ':');
            if (c) snprintf(out, cap, "%s", c + 2);
            out[strcspn(out, "\n")] = 0;
            break;
        }
    if (f) fclose(f);
}

static void loadavg(char *out, size_t cap) {
    FILE *f = fopen("/proc/loadavg", "r");
    double a = 0, b = 0, c = 0;
    if (f && fscanf(f, "%lf %lf %lf", &a, &b, &c) == 3) snprintf(out, cap, "%.2f %.2f %.2f", a, b, c);
    else snprintf(out, cap, "?");
    if (f) fclose(f);
}

/* bytes: COMPUTE + RESULT frames of one call, as the coordinator counted them */
static void print_trips(const char *what, double bytes, const trips *t, const trips *p) {
    const int n = t->n;
    const double tm = t->wall_us[n / 2], pm = p->wall_us[n / 2];
    const double tc = mean(t->cpu_us, n), pc = mean(p->cpu_us, n);
    printf("| %s | %.1f KB | %d | %.0f / %.0f us | %.0f / %.0f us | %+.0f us (%.2fx) | %.0f / %.0f us (%+.0f) |\n", what,
           bytes / 1e3, n, tm, t->wall_us[n * 99 / 100], pm, p->wall_us[n * 99 / 100], tm - pm, tm / pm, tc, pc,
           tc - pc);
}

int main(int argc, char **argv) {
    const long n_dec = argc > 1 ? atol(argv[1]) : 2000, n_pre = argc > 2 ? atol(argv[2]) : 40;
    const long mb = argc > 3 ? atol(argv[3]) : 1024, reps = argc > 4 ? atol(argv[4]) : 3;
    const long n_gen = argc > 5 ? atol(argv[5]) : 128;
    if (n_dec < 10 || n_dec > 1000000 || n_pre < 10 || n_pre > 100000 || mb < 1 || mb > 65536 || reps < 1 ||
        reps > 100 || n_gen < 1 || n_gen > 800) {
        fprintf(stderr, "usage: bench_tls [n_dec (10..1000000) n_pre (10..100000) mb (1..65536) reps (1..100) "
                        "n_gen (1..800)]\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    char cpu[128], load0[64], load1[64];
    cpu_name(cpu, sizeof cpu);
    loadavg(load0, sizeof load0);
    uint8_t seed[32];
    memset(seed, 7, 32), kv_node_key_from_seed(&g_wkey, seed);
    memset(seed, 8, 32), kv_node_key_from_seed(&g_ckey, seed);
    make_model();
    kv_diag d = {0};

    /* the worker */
    kv_worker *w = NULL;
    const uint8_t(*allow)[32] = (const uint8_t(*)[32])g_ckey.pk;
    const kv_worker_opts wo = {.slabs = g_slices, .listen = "127.0.0.1:0", .n_threads = 1, .quiet = true,
                               .key_sk = g_wkey.sk, .allow_keys = allow, .n_allow_keys = 1};
    if (kv_worker_open(&w, &wo, &d)) die("worker", &d);
    pthread_t wth;
    pthread_create(&wth, NULL, worker_main, w);
    const char *addr = kv_worker_addr(w);

    /* round trips: one kv_remote per transport, both connected to the worker */
    kv_pool *pool = NULL;
    if (kv_pool_new(&pool, 1, &d)) die("pool", &d);
    const uint8_t(*pin)[32] = (const uint8_t(*)[32])g_wkey.pk;
    kv_remote_opts ro = {.workers = &addr, .n_workers = 1, .timeout_ms = 60000, .max_tokens = PRE_TOKENS,
                         .key_sk = g_ckey.sk, .worker_keys = pin};
    kv_remote *rt = NULL, *rp = NULL;
    if (kv_remote_open(&rt, g_manifest, pool, &ro, &d)) die("remote over TLS", &d);
    ro.insecure_plaintext = true, ro.worker_keys = NULL;
    if (kv_remote_open(&rp, g_manifest, pool, &ro, &d)) die("remote over plain TCP", &d);
    const long nmax = n_dec > n_pre ? n_dec : n_pre;
    trips tt = {malloc(nmax * sizeof(double)), malloc(nmax * sizeof(double)), 0};
    trips tp = {malloc(nmax * sizeof(double)), malloc(nmax * sizeof(double)), 0};
    if (!tt.wall_us || !tt.cpu_us || !tp.wall_us || !tp.cpu_us) die("out of memory", NULL);
    printf("bench_tls on %s (%ld CPUs online), loopback, load average %s at the start\n", cpu,
           sysconf(_SC_NPROCESSORS_ONLN), load0);
    printf("model: the small preset in Q8_0 (%u layers, n_embd %u, %u experts top-%u of %u); one worker, 1 compute "
           "thread; f32 on the wire\n\n",
           g_cfg.n_layer, g_cfg.n_embd, g_cfg.n_expert, g_cfg.n_expert_used, g_cfg.n_ff_exp);
    printf("dispatch round trip (one kv_remote compute call = one COMPUTE and its RESULT; CPU = whole process per "
           "call, both ends and the worker's compute)\n\n");
    printf("| batch | COMPUTE + RESULT | calls each | TLS median / p99 | plaintext median / p99 | TLS adds (ratio) | "
           "CPU per call TLS / plain (added) |\n|---|---:|---:|---:|---:|---:|---:|\n");
    kv_msg_stats ws0, ws1;
    kv_remote_stats rs;
    kv_worker_stats(w, &ws0);
    round_trips(kv_remote_provider(rt), kv_remote_provider(rp), 1, (int)n_dec, &tt, &tp);
    kv_remote_get_stats(rt, &rs);
    print_trips("1 token x 4 experts", (double)(rs.bytes_sent + rs.bytes_recv) / (double)rs.rounds, &tt, &tp);
    kv_worker_stats(w, &ws1);
    kv_remote_reset_stats(rt);
    const double comp_dec = (double)(ws1.compute_us - ws0.compute_us) / (double)(ws1.n_compute - ws0.n_compute);
    round_trips(kv_remote_provider(rt), kv_remote_provider(rp), PRE_TOKENS, (int)n_pre, &tt, &tp);
    kv_remote_get_stats(rt, &rs);
    print_trips("256 tokens x 4 experts", (double)(rs.bytes_sent + rs.bytes_recv) / (double)rs.rounds, &tt, &tp);
    kv_worker_stats(w, &ws0);
    const double comp_pre = (double)(ws0.compute_us - ws1.compute_us) / (double)(ws0.n_compute - ws1.n_compute);
    printf("\nthe worker's own compute per COMPUTE (its counter, the same on both paths): %.0f us (1 token), %.0f us "
           "(256 tokens)\n\n",
           comp_dec, comp_pre);
    kv_remote_free(rt);
    kv_remote_free(rp);

    /* bulk */
    kv_tls_ctx *rctx = NULL, *sctx = NULL;
    if (kv_tls_ctx_new(&rctx, &g_wkey, &d) || kv_tls_ctx_new(&sctx, &g_ckey, &d)) die("TLS contexts", &d);
    printf("bulk, one way, %ld MiB in 1 MiB frames between two kv_net loops (a thread each); CPU per GB (1e9 bytes) "
           "of payload\n\n| run | path | GB/s | CPU s/GB sender | receiver | both |\n|---|---|---:|---:|---:|---:|\n",
           mb);
    double sum_gbs[2] = {0, 0}, sum_cpu[2] = {0, 0};
    for (long r = 0; r < reps; r++)
        for (int j = 0; j < 2; j++) {
            const bool tls = (j == 0) == (r % 2 == 0);
            bulk b;
            bulk_run(&b, tls, (uint64_t)mb, rctx, sctx);
            const double gb = (double)b.total / 1e9, s = (double)(b.t1 - b.t0) / 1e9;
            printf("| %ld | %s | %.2f | %.3f | %.3f | %.3f |\n", r + 1, tls ? "TLS 1.3" : "plain TCP", gb / s,
                   b.cpu_send / gb, b.cpu_recv / gb, (b.cpu_send + b.cpu_recv) / gb);
            sum_gbs[tls] += gb / s, sum_cpu[tls] += (b.cpu_send + b.cpu_recv) / gb;
        }
    printf("\nmean: TLS %.2f GB/s, %.3f CPU s/GB; plain %.2f GB/s, %.3f CPU s/GB; TLS adds %.3f CPU s/GB; "
           "throughput ratio plain/TLS %.2f\n\n",
           sum_gbs[1] / reps, sum_cpu[1] / reps, sum_gbs[0] / reps, sum_cpu[0] / reps,
           (sum_cpu[1] - sum_cpu[0]) / reps, sum_gbs[0] / sum_gbs[1]);
    kv_tls_ctx_free(rctx);
    kv_tls_ctx_free(sctx);

    /* decode through the engine */
    kv_engine_opts eo = {.n_threads = 1, .n_ctx = (uint32_t)n_gen + 32, .n_batch = 16, .max_sessions = 1,
                         .workers = &addr, .n_workers = 1, .worker_timeout_ms = 60000, .key_sk = g_ckey.sk,
                         .worker_keys = pin};
    kv_engine *et = NULL, *ep = NULL;
    if (kv_engine_open(&et, g_manifest, &eo, &d)) die("engine over TLS", &d);
    eo.insecure_plaintext = true, eo.worker_keys = NULL;
    if (kv_engine_open(&ep, g_manifest, &eo, &d)) die("engine over plain TCP", &d);
    (void)decode_tps(et, 8), (void)decode_tps(ep, 8); /* warm-up */
    printf("decode through the engine with the remote provider (kvasir bench's path), 16-token prompt, %ld tokens, "
           "1 engine thread\n\n| run | TLS tok/s | plaintext tok/s | ratio |\n|---|---:|---:|---:|\n",
           n_gen);
    double vt[100], vp[100];
    for (long r = 0; r < reps; r++) {
        double a, b;
        if (r % 2 == 0) a = decode_tps(et, (uint32_t)n_gen), b = decode_tps(ep, (uint32_t)n_gen);
        else b = decode_tps(ep, (uint32_t)n_gen), a = decode_tps(et, (uint32_t)n_gen);
        printf("| %ld | %.1f | %.1f | %.3f |\n", r + 1, a, b, a / b);
        vt[r] = a, vp[r] = b;
    }
    const double mt = mean(vt, (int)reps), mp = mean(vp, (int)reps);
    qsort(vt, (size_t)reps, sizeof(double), cmp_dbl);
    qsort(vp, (size_t)reps, sizeof(double), cmp_dbl);
    printf("\nmean: TLS %.1f tok/s, plaintext %.1f tok/s, ratio %.3f; median: TLS %.1f, plaintext %.1f, ratio %.3f\n",
           mt, mp, mt / mp, vt[reps / 2], vp[reps / 2], vt[reps / 2] / vp[reps / 2]);
    kv_engine_free(et);
    kv_engine_free(ep);
    loadavg(load1, sizeof load1);
    printf("load average at the end %s\n", load1);

    kv_worker_stop(w);
    pthread_join(wth, NULL);
    kv_worker_free(w);
    kv_pool_free(pool);
    free(tt.wall_us), free(tt.cpu_us), free(tp.wall_us), free(tp.cpu_us);
    cleanup();
    return 0;
}
