/* kv-test-labels: net attack */
/* The remote expert provider against real worker processes on loopback,
 * and against an in-process liar: a greedy decode through workers must give
 * the logits of the in-process run byte for byte, whatever happens to the
 * workers, or fail with a clear error before any token is taken from
 * partial results.
 *
 * Setup: a small synthetic model sliced in three expert groups per layer
 * (G0 = experts 0-3, G1 = 4-7, G2 = 8-11); a coordinator folder holding only
 * backbone.gguf and manifest.json; workers (`kvasir worker`, one thread
 * each) started on free loopback ports with some of the groups.
 *   - disjoint workers: identical output, every worker used;
 *   - replicas (G0+G1, G1+G2, G2+G0): a worker SIGKILLed mid-decode, one
 *     SIGSTOPped past the deadline: identical output, the worker dropped
 *     and its pairs retried; the stalled one, continued, and the killed
 *     one, restarted on its port, are reconnected and serve again (their
 *     own STATS counters agree with the coordinator's);
 *   - disjoint, a worker killed mid-decode: the step fails with
 *     KV_ENOTFOUND naming the expert, the earlier steps were exact;
 *   - a liar that handshakes properly, then answers with a wrong request
 *     id, a short RESULT, garbage, an ERROR frame, a truncated frame or a
 *     PONG: dropped each time, the pairs retried on honest replicas;
 *   - coverage: a missing group is named before the first token; with its
 *     slabs present in the coordinator's folder they are used locally;
 *   - a worker of another model is refused at the handshake;
 *   - f16/bf16 on the wire: the logit error against f32 is measured and
 *     bounded. */
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/dispatch_evidence.h"
#include "kvasir/dispatch_proto.h"
#include "kvasir/dispatch_remote.h"
#include "kvasir/gen.h"
#include "kvasir/quant.h"
#include "kvtest.h"
#include "test_auth_support.h"
#include "test_flood_support.h"
#include "kvasir/verify.h"

#define N_GEN 14
#define N_PROMPT 9
#define TIMEOUT_MS 400
#define RECONNECT_MS 50

static char g_dir[256];
static const char *g_bin;
static kv_pool *g_pool;
static uint32_t g_vocab;
static float *g_ref;      /* [N_GEN + 1][vocab] logits of the in-process run */
static int32_t g_prompt[N_PROMPT];
static char g_group[3][1024]; /* comma-separated slab files of each group */

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) && errno == EINTR) {
    }
}

static int cp(const char *from, const char *to) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "cp '%s' '%s'", from, to);
    return system(cmd);
}

/* ---- worker processes ----------------------------------------------------- */

typedef struct proc {
    pid_t pid;
    uint16_t port;
    char addr[32];
    char slabs[3200];
    char extra[96];     /* more arguments, separated by spaces ("--test-lie=MODE"), or "" */
} proc;

static uint16_t free_port(void) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t l = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || getsockname(fd, (struct sockaddr *)&a, &l)) return 0;
    close(fd);
    return ntohs(a.sin_port);
}

/* Whether a line of the file at path holds what. */
static bool file_has(const char *path, const char *what) {
    char line[512];
    bool found = false;
    FILE *f = fopen(path, "r");
    while (f && !found && fgets(line, sizeof line, f)) found = strstr(line, what) != NULL;
    if (f) fclose(f);
    return found;
}

/* Starts `kvasir worker` on p->port with p->slabs; waits until it says it
 * listens (its own "listening on" line: a dial could meet another process
 * that took the port). */
static bool start_worker(proc *p) {
    char log[300], out[300];
    snprintf(log, sizeof log, "%s/worker-%u.log", g_dir, p->port);
    snprintf(out, sizeof out, "%s/worker-%u.out", g_dir, p->port);
    unlink(out); /* (an earlier worker's on this port said it listened) */
    fflush(stdout);
    fflush(stderr);
    const pid_t pid = fork();
    if (pid == 0) {
        FILE *f = freopen(log, "a", stderr);
        FILE *g = freopen(out, "w", stdout);
        (void)f;
        (void)g;
        char *argv[24] = {(char *)g_bin, "worker", "--slabs", p->slabs, "--listen", p->addr, "--threads", "1",
                          "--allow-key", (char *)kvt_coord_hex()};
        int n = 10;
        for (char *t = strtok(p->extra, " "); t && n < 23; t = strtok(NULL, " ")) argv[n++] = t;
        argv[n] = NULL;
        execv(g_bin, argv);
        _exit(127);
    }
    p->pid = pid;
    for (int i = 0; i < 250; i++) {
        if (file_has(out, "listening on ")) return true;
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            p->pid = 0;
            break;
        }
        sleep_ms(20);
    }
    fprintf(stderr, "worker on %s did not start (see %s)\n", p->addr, log);
    return false;
}

/* Starts a worker with slabs and extra arguments on a free port. A port
 * that free_port found free can be taken before the worker binds it (by a
 * test running in parallel: the machine is shared); the worker then says
 * so and ends, and another port is tried, up to 5. */
static bool new_worker_extra(proc *p, const char *slabs, const char *extra) {
    for (int t = 0; t < 5; t++) {
        memset(p, 0, sizeof *p);
        p->port = free_port();
        snprintf(p->addr, sizeof p->addr, "127.0.0.1:%u", p->port);
        snprintf(p->slabs, sizeof p->slabs, "%s", slabs);
        snprintf(p->extra, sizeof p->extra, "%s", extra);
        if (!p->port) return false;
        if (start_worker(p)) return true;
        char log[300];
        snprintf(log, sizeof log, "%s/worker-%u.log", g_dir, p->port);
        if (p->pid || !file_has(log, "Address already in use")) return false;
        fprintf(stderr, "  (port %u was taken before the worker bound it: another port)\n", p->port);
    }
    return false;
}

static bool new_worker(proc *p, const char *slabs) { return new_worker_extra(p, slabs, ""); }

static void kill_worker(proc *p, int sig) {
    if (p->pid <= 0) return;
    kill(p->pid, sig);
    if (sig == SIGKILL || sig == SIGTERM) {
        waitpid(p->pid, NULL, 0);
        p->pid = 0;
    }
}

/* The worker's own counters, over a fresh connection (HELLO, STATS). */
static bool worker_stats(const proc *p, const char *model_id, kv_msg_stats *out) {
    int fd = -1;
    if (kv_link_connect(p->addr, 1000, &fd, NULL)) return false;
    uint8_t buf[1 << 16];
    size_t n;
    kv_msg_hello h = {KV_PROTO_VERSION_MIN, KV_PROTO_VERSION, {0}, 1u};
    memcpy(h.model_id, model_id, 65);
    kv_frame_rx rx;
    kv_frame_rx_init(&rx, buf, sizeof buf);
    kv_msg m;
    bool ok = !kv_msg_hello_encode(buf, sizeof buf, 1, &h, &n, NULL) && !kv_proto_write_all(fd, buf, n, 1000, NULL) &&
              !kv_proto_read_msg(&rx, fd, 1000, NULL, &m, NULL) && m.h.type == KV_MSG_HELLO_ACK &&
              !kvt_auth(fd, &rx, buf, sizeof buf, model_id, m.u.ack.version, NULL);
    kv_frame_rx_reset(&rx);
    ok = ok && !kv_msg_stats_encode(buf, sizeof buf, 2, &n, NULL) && !kv_proto_write_all(fd, buf, n, 1000, NULL) &&
         !kv_proto_read_msg(&rx, fd, 1000, NULL, &m, NULL) && m.h.type == KV_MSG_STATS_ACK;
    if (ok) *out = m.u.stats;
    close(fd);
    return ok;
}

/* ---- the liar: an honest handshake, then wrong answers -------------------- */

typedef struct liar {
    int lfd;
    uint16_t port;
    char addr[32];
    char model_id[65];
    uint32_t n_layer, n_embd, n_ff, n_expert, n_used;
    kv_slab_hash slabs[64];  /* the manifest's slabs, honestly hashed */
    uint32_t n_slabs;
    int mode;                /* < 0: cycle through the lies; else always this one */
    atomic_int stop;
    atomic_int n_conns, n_lies;
    pthread_t th;
} liar;

static void liar_lie(liar *L, int fd, int mode, const kv_msg *m) {
    static uint8_t out[1 << 22];
    size_t n = 0;
    const uint32_t np = m->u.compute.n_pairs, id = m->h.request_id;
    static float zero[1 << 16];
    const kv_msg_result res = {np - (mode == 1), L->n_embd, m->u.compute.out_enc, zero, NULL, 0, NULL};
    switch (mode) {
    case 0: /* a well-formed RESULT for another request */
        kv_msg_result_encode(out, sizeof out, id + 7, &res, &n, NULL);
        break;
    case 1: /* one vector short */
        if (np > 1) kv_msg_result_encode(out, sizeof out, id, &res, &n, NULL);
        else kv_msg_ping_encode(out, sizeof out, KV_MSG_PONG, id, 1, &n, NULL);
        break;
    case 2: /* garbage */
        for (n = 0; n < 64; n++) out[n] = (uint8_t)(n * 37 + 11);
        break;
    case 3: /* a refusal */
        kv_msg_error_encode(out, sizeof out, id, KV_EINTERNAL, "lying on purpose", &n, NULL);
        break;
    case 4: /* half a RESULT, then close */
        kv_msg_result_encode(out, sizeof out, id, &res, &n, NULL);
        n /= 2;
        break;
    case 6: /* NaN, Inf, 3e38: well-formed, finite-looking frames carrying lies */
    case 7:
    case 8: {
        static float bad[1 << 16];
        const float v = mode == 6 ? NAN : mode == 7 ? INFINITY : 3e38f;
        for (uint32_t i = 0; i < np * L->n_embd && i < (1u << 16); i++) bad[i] = (i % 5 == 3) ? v : 0.25f;
        const kv_msg_result rb = {np, L->n_embd, m->u.compute.out_enc, bad, NULL, 0, NULL};
        kv_msg_result_encode(out, sizeof out, id, &rb, &n, NULL);
        break;
    }
    case 9: { /* stall: never answer, hold the connection until the peer gives up */
        uint8_t sink[256];
        struct timeval tv = {0, 50000};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        while (!atomic_load(&L->stop)) {
            ssize_t k = read(fd, sink, sizeof sink);
            if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) break;
        }
        atomic_fetch_add(&L->n_lies, 1);
        return;
    }
    default: /* an unexpected type */
        kv_msg_ping_encode(out, sizeof out, KV_MSG_PONG, id, 1, &n, NULL);
        break;
    }
    kv_proto_write_all(fd, out, n, 1000, NULL);
    atomic_fetch_add(&L->n_lies, 1);
}

/* The fake worker's key. */
static const uint8_t *kvt_liar_sk(void) {
    static uint8_t pk[32], sk[64];
    static int init;
    if (!init) {
        kvt_key(20, pk, sk);
        init = 1;
    }
    return sk;
}

static void *liar_main(void *arg) {
    liar *L = arg;
    static uint8_t buf[1 << 22];
    while (!atomic_load(&L->stop)) {
        struct timeval tv = {0, 50000};
        setsockopt(L->lfd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        const int fd = accept(L->lfd, NULL, NULL);
        if (fd < 0) continue;
        const int conn = atomic_fetch_add(&L->n_conns, 1);
        kv_frame_rx rx;
        kv_frame_rx_init(&rx, buf, sizeof buf);
        kv_msg m;
        const kv_proto_limits lim = {L->n_layer, L->n_embd, L->n_expert, 0};
        if (!kv_proto_read_msg(&rx, fd, 2000, &lim, &m, NULL) && m.h.type == KV_MSG_HELLO) {
            static uint8_t ack[1 << 16];
            kv_held_range rg[64];
            for (uint32_t l = 0; l < L->n_layer; l++) rg[l] = (kv_held_range){l, 0, L->n_expert - 1};
            kv_msg_hello_ack a = {KV_PROTO_VERSION, {0}, L->n_layer, L->n_embd, L->n_ff, L->n_expert, L->n_used,
                                  1u, "liar", L->n_layer, rg, NULL, KV_PROTO_MAX_PAIRS, L->n_slabs, L->slabs, NULL};
            memcpy(a.model_id, L->model_id, 65);
            size_t n;
            kv_frame_rx_reset(&rx);
            if (!kv_msg_hello_ack_encode(ack, sizeof ack, m.h.request_id, &a, &n, NULL) &&
                !kv_proto_write_all(fd, ack, n, 1000, NULL) &&
                !kvt_worker_auth(fd, &rx, L->model_id, KV_PROTO_VERSION, kvt_liar_sk(), NULL) &&
                !kv_proto_read_msg(&rx, fd, 5000, &lim, &m, NULL) && m.h.type == KV_MSG_COMPUTE)
                liar_lie(L, fd, L->mode >= 0 ? L->mode : conn % 6, &m);
        }
        sleep_ms(20); /* let the coordinator read it before the close */
        close(fd);
    }
    return NULL;
}

/* The liar is a plaintext test double: while one runs, coordinators dial
 * plaintext (--insecure-plaintext; served by the real workers, which are on
 * loopback); every other test dials TLS. */
static bool g_plaintext;

static bool liar_start(liar *L, const kv_manifest *m) {
    g_plaintext = true;
    memset(L, 0, sizeof *L);
    memcpy(L->model_id, m->model_id, 65);
    L->n_layer = m->n_layer;
    L->n_embd = m->n_embd;
    L->n_ff = m->n_ff_exp;
    L->n_expert = m->n_expert;
    L->n_used = m->n_expert_used;
    L->mode = -1;
    for (size_t i = 0; i < m->n_slabs && L->n_slabs < 64; i++) {
        kv_slab_hash *h = &L->slabs[L->n_slabs++];
        *h = (kv_slab_hash){m->slabs[i].layer, m->slabs[i].first, m->slabs[i].last, {0}};
        memcpy(h->sha256, m->slabs[i].file.sha256, 32);
    }
    L->lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t l = sizeof a;
    if (L->lfd < 0 || bind(L->lfd, (struct sockaddr *)&a, sizeof a) || listen(L->lfd, 16) ||
        getsockname(L->lfd, (struct sockaddr *)&a, &l))
        return false;
    L->port = ntohs(a.sin_port);
    snprintf(L->addr, sizeof L->addr, "127.0.0.1:%u", L->port);
    return !pthread_create(&L->th, NULL, liar_main, L);
}

static void liar_stop(liar *L) {
    g_plaintext = false;
    atomic_store(&L->stop, 1);
    pthread_join(L->th, NULL);
    close(L->lfd);
}

/* ---- decoding ---------------------------------------------------------------- */

typedef void (*step_hook)(int step, void *arg);

/* Greedy decode of g_prompt: logits[(N_GEN+1)][vocab]. Returns the number
 * of logit rows produced (N_GEN + 1 on success); d holds the error. */
static int decode(const kv_model *m, const kv_expert_provider *p, float *logits, step_hook hook, void *arg,
                  kv_diag *d) {
    kv_state *st = NULL;
    const kv_state_opts so = {.n_ctx = 64, .n_batch = 4, .experts = p};
    if (kv_state_new(&st, m, g_pool, &so, d)) return 0;
    int rows = 0;
    if (!kv_state_eval(st, g_prompt, N_PROMPT, logits, d)) {
        rows = 1;
        for (int i = 0; i < N_GEN; i++) {
            const float *l = logits + (size_t)i * g_vocab;
            int32_t t = 0;
            for (uint32_t v = 1; v < g_vocab; v++)
                if (l[v] > l[t]) t = (int32_t)v;
            if (hook) hook(i, arg);
            if (kv_state_eval(st, &t, 1, logits + (size_t)(i + 1) * g_vocab, d)) break;
            rows++;
        }
    }
    kv_state_free(st);
    return rows;
}

static char g_manifest[400];
static kv_gen_config g_cfg; /* the model's generator settings */
static double g_hedge_budget; /* kv_remote_opts.hedge_budget of the remotes opened (0 = its default) */

static kv_remote *open_remote_t(const char *const *addrs, uint32_t n, uint32_t enc, const char *manifest,
                                 uint32_t timeout_ms, uint32_t reconnect_ms, kv_diag *d) {
    kv_remote *r = NULL;
    const kv_remote_opts o = {addrs, n, timeout_ms, reconnect_ms, enc, 4, false, NULL, false, kvt_coord_sk(), NULL, NULL,
                              0, false, NULL, 0, NULL, NULL, g_plaintext, g_hedge_budget, 0};
    kv_remote_open(&r, manifest ? manifest : g_manifest, g_pool, &o, d);
    return r;
}

static kv_remote *open_remote(const char *const *addrs, uint32_t n, uint32_t enc, const char *manifest, kv_diag *d) {
    return open_remote_t(addrs, n, enc, manifest, TIMEOUT_MS, RECONNECT_MS, d);
}

/* Decodes through r and checks every logit row against the reference. */
static void check_exact(kv_remote *r, step_hook hook, void *arg, const char *what) {
    float *lg = calloc((size_t)(N_GEN + 1) * g_vocab, sizeof *lg);
    kv_diag d = {0};
    const int rows = decode(kv_remote_model(r), kv_remote_provider(r), lg, hook, arg, &d);
    if (rows != N_GEN + 1) KVT_FAIL("%s: decode stopped after %d rows: %s", what, rows, d.msg);
    ASSERT_EQ(rows, N_GEN + 1);
    const bool same = !memcmp(lg, g_ref, (size_t)rows * g_vocab * sizeof *lg);
    if (!same) KVT_FAIL("%s: logits differ from the in-process run", what);
    ASSERT_TRUE(same);
    free(lg);
}

static void print_workers(const kv_remote *r, const char *what) {
    kv_remote_stats st;
    kv_remote_get_stats(r, &st);
    printf("  %s: %llu calls, %llu rounds, %llu retried, rtt p50 %.0f us p99 %.0f us\n", what,
           (unsigned long long)st.calls, (unsigned long long)st.rounds, (unsigned long long)st.retried_pairs,
           st.rtt_p50_us, st.rtt_p99_us);
    for (uint32_t i = 0; i < kv_remote_n_workers(r); i++) {
        kv_remote_worker w;
        kv_remote_worker_info(r, i, &w);
        printf("    %s: %s pairs %llu (since connect %llu) drops %llu connects %llu %s\n", w.addr, w.up ? "up" : "down",
               (unsigned long long)w.pairs, (unsigned long long)w.pairs_since_connect, (unsigned long long)w.drops,
               (unsigned long long)w.connects, w.last_error);
    }
}

/* ---- scenarios ------------------------------------------------------------------ */

static void test_disjoint(void) {
    proc w[3];
    for (int i = 0; i < 3; i++) ASSERT_TRUE(new_worker(&w[i], g_group[i]));
    const char *addrs[3] = {w[0].addr, w[1].addr, w[2].addr};
    kv_diag d = {0};
    kv_remote *r = open_remote(addrs, 3, KV_ENC_F32, NULL, &d);
    if (!r) KVT_FAIL("open: %s", d.msg);
    ASSERT_TRUE(r != NULL);
    if (r) {
        check_exact(r, NULL, NULL, "three disjoint workers");
        kv_remote_stats st;
        kv_remote_get_stats(r, &st);
        ASSERT_EQ(st.retried_pairs, 0);
        ASSERT_EQ(st.pairs_local, 0);
        ASSERT_EQ(st.rounds, st.calls);
        uint64_t sum = 0;
        for (uint32_t i = 0; i < 3; i++) {
            kv_remote_worker wi;
            kv_remote_worker_info(r, i, &wi);
            ASSERT_TRUE(wi.up);
            ASSERT_TRUE(wi.pairs > 0);
            ASSERT_EQ(wi.connects, 1);
            sum += wi.pairs;
        }
        ASSERT_EQ(sum, st.pairs_remote);
        /* every (token, rank) of every MoE layer: prompt + N_GEN tokens, but the
           prompt's tokens without logits skip the last block's experts */
        const kv_hparams *hp = kv_model_hparams(kv_remote_model(r));
        ASSERT_EQ(sum, ((uint64_t)(N_PROMPT + N_GEN) * hp->n_layer - (N_PROMPT - 1)) * hp->n_expert_used);
        print_workers(r, "disjoint");
        /* the workers' own counters agree */
        for (uint32_t i = 0; i < 3; i++) {
            kv_remote_worker wi;
            kv_remote_worker_info(r, i, &wi);
            kv_msg_stats ws = {0};
            ASSERT_TRUE(worker_stats(&w[i], kv_remote_manifest(r)->model_id, &ws));
            ASSERT_EQ(ws.n_pairs, wi.pairs);
        }
    }
    kv_remote_free(r);
    for (int i = 0; i < 3; i++) kill_worker(&w[i], SIGKILL);
}

typedef struct fault_ctx {
    proc *w;
    int kill_at, stop_at, cont_at, restart_at;
} fault_ctx;

static void fault_hook(int step, void *arg) {
    fault_ctx *c = arg;
    if (step == c->kill_at) kill_worker(&c->w[1], SIGKILL);
    if (step == c->stop_at) kill_worker(&c->w[0], SIGSTOP);
    if (step == c->cont_at) kill_worker(&c->w[0], SIGCONT);
    if (step == c->restart_at) {
        if (!start_worker(&c->w[1])) KVT_FAIL("could not restart %s", c->w[1].addr);
    }
    if (step >= c->restart_at) sleep_ms(RECONNECT_MS / 2); /* time for reconnects */
}

static void test_replicas(void) {
    char s[3][2100];
    for (int i = 0; i < 3; i++) snprintf(s[i], sizeof s[i], "%s,%s", g_group[i], g_group[(i + 1) % 3]);
    proc w[3];
    for (int i = 0; i < 3; i++) ASSERT_TRUE(new_worker(&w[i], s[i]));
    const char *addrs[3] = {w[0].addr, w[1].addr, w[2].addr};
    kv_diag d = {0};
    /* without hedging: the stall below is to run past the deadline (a
       replica that could answer in its place: test_hedge.sh) */
    g_hedge_budget = -1;
    kv_remote *r = open_remote(addrs, 3, KV_ENC_F32, NULL, &d);
    g_hedge_budget = 0;
    if (!r) KVT_FAIL("open: %s", d.msg);
    ASSERT_TRUE(r != NULL);
    if (r) {
        /* kill w1 at step 2, restart it at step 4, stall w0 from step 7 (past
         * the deadline; w1 is back by then, so G1 still has a holder),
         * continue it at step 10: the output never changes */
        fault_ctx c = {w, 2, 7, 10, 4};
        check_exact(r, fault_hook, &c, "replicas with a kill, a stall and a restart");
        print_workers(r, "replicas");
        kv_remote_worker w0, w1, w2;
        kv_remote_worker_info(r, 0, &w0);
        kv_remote_worker_info(r, 1, &w1);
        kv_remote_worker_info(r, 2, &w2);
        kv_remote_stats st;
        kv_remote_get_stats(r, &st);
        ASSERT_TRUE(st.retried_pairs > 0);  /* the stall at least forced a retry */
        ASSERT_EQ(w0.drops, 1);             /* stalled past the deadline */
        ASSERT_EQ(w1.drops, 1);             /* killed */
        ASSERT_EQ(w2.drops, 0);
        ASSERT_EQ(w0.connects, 2);          /* continued: reconnected */
        ASSERT_EQ(w1.connects, 2);          /* restarted: reconnected */
        ASSERT_TRUE(w0.up && w1.up && w2.up);
        ASSERT_TRUE(w0.pairs_since_connect > 0);
        ASSERT_TRUE(w1.pairs_since_connect > 0);
        /* the restarted process counts exactly what it served since */
        kv_msg_stats ws = {0};
        ASSERT_TRUE(worker_stats(&w[1], kv_remote_manifest(r)->model_id, &ws));
        ASSERT_EQ(ws.n_pairs, w1.pairs_since_connect);
        printf("  restarted worker %s served %llu expert computations after its restart (its own count: %llu)\n",
               w[1].addr, (unsigned long long)w1.pairs_since_connect, (unsigned long long)ws.n_pairs);
    }
    kv_remote_free(r);
    for (int i = 0; i < 3; i++) {
        kill_worker(&w[i], SIGCONT);
        kill_worker(&w[i], SIGKILL);
    }
}

static void kill_w1_hook(int step, void *arg) {
    if (step == 3) kill_worker(&((proc *)arg)[1], SIGKILL);
}

static void test_no_replica_dies(void) {
    proc w[3];
    for (int i = 0; i < 3; i++) ASSERT_TRUE(new_worker(&w[i], g_group[i]));
    const char *addrs[3] = {w[0].addr, w[1].addr, w[2].addr};
    kv_diag d = {0};
    kv_remote *r = open_remote(addrs, 3, KV_ENC_F32, NULL, &d);
    ASSERT_TRUE(r != NULL);
    if (r) {
        float *lg = calloc((size_t)(N_GEN + 1) * g_vocab, sizeof *lg);
        const int rows = decode(kv_remote_model(r), kv_remote_provider(r), lg, kill_w1_hook, w, &d);
        ASSERT_EQ(rows, 4); /* prefill + 3 steps, then the failing one */
        ASSERT_EQ(d.code, KV_ENOTFOUND);
        ASSERT_TRUE(strstr(d.msg, "no worker can compute it") != NULL);
        ASSERT_TRUE(strstr(d.msg, w[1].addr) != NULL);
        printf("  expected error: %s\n", d.msg);
        ASSERT_TRUE(!memcmp(lg, g_ref, (size_t)rows * g_vocab * sizeof *lg));
        free(lg);
    }
    kv_remote_free(r);
    for (int i = 0; i < 3; i++) kill_worker(&w[i], SIGKILL);
}

static void slow_hook(int step, void *arg) {
    (void)step;
    (void)arg;
    sleep_ms(RECONNECT_MS / 4);
}

static void bounce_w1_hook(int step, void *arg) {
    proc *w = arg;
    if (step == 3) {
        kill_worker(&w[1], SIGKILL);
        if (!start_worker(&w[1])) KVT_FAIL("could not restart %s", w[1].addr);
    }
}

/* No replicas, but the worker is back (restarted) before its experts are
 * needed again: it is dialed at once instead of failing the step. */
static void test_no_replica_back(void) {
    proc w[3];
    for (int i = 0; i < 3; i++) ASSERT_TRUE(new_worker(&w[i], g_group[i]));
    const char *addrs[3] = {w[0].addr, w[1].addr, w[2].addr};
    kv_diag d = {0};
    kv_remote *r = open_remote(addrs, 3, KV_ENC_F32, NULL, &d);
    ASSERT_TRUE(r != NULL);
    if (r) {
        check_exact(r, bounce_w1_hook, w, "no replica, a worker restarted between steps");
        kv_remote_worker w1;
        kv_remote_worker_info(r, 1, &w1);
        ASSERT_EQ(w1.drops, 1);
        ASSERT_EQ(w1.connects, 2);
        ASSERT_TRUE(w1.pairs_since_connect > 0);
        print_workers(r, "bounce");
    }
    kv_remote_free(r);
    for (int i = 0; i < 3; i++) kill_worker(&w[i], SIGKILL);
}

static void test_liar(void) {
    proc w[3];
    for (int i = 0; i < 3; i++) ASSERT_TRUE(new_worker(&w[i], g_group[i]));
    kv_manifest *m = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_manifest_load(&m, g_manifest, &d), 0);
    liar L;
    ASSERT_TRUE(m && liar_start(&L, m));
    const char *addrs[4] = {L.addr, w[0].addr, w[1].addr, w[2].addr};
    kv_remote *r = open_remote(addrs, 4, KV_ENC_F32, NULL, &d);
    if (!r) KVT_FAIL("open: %s", d.msg);
    ASSERT_TRUE(r != NULL);
    if (r) {
        /* the decode slowed a little so the liar is reconnected often */
        kv_remote_worker li;
        /* reconnects back off after each lie: decode until it lied thrice */
        for (int k = 0; k < 12; k++) {
            check_exact(r, slow_hook, NULL, "a liar among honest workers");
            kv_remote_worker_info(r, 0, &li);
            if (k >= 2 && li.drops >= 3) break;
        }
        print_workers(r, "liar");
        kv_remote_worker_info(r, 0, &li);
        ASSERT_TRUE(li.drops >= 3);
        ASSERT_EQ(li.pairs, 0);
        ASSERT_TRUE(atomic_load(&L.n_lies) >= 3);
        printf("  the liar lied %d times over %d connections; dropped %llu times\n", atomic_load(&L.n_lies),
               atomic_load(&L.n_conns), (unsigned long long)li.drops);
    }
    kv_remote_free(r);
    liar_stop(&L);
    /* a worker of another model is refused at the handshake */
    memset(m->model_id, 'a', 64);
    ASSERT_TRUE(liar_start(&L, m));
    const char *one[1] = {L.addr};
    r = open_remote(one, 1, KV_ENC_F32, NULL, &d);
    ASSERT_TRUE(r == NULL);
    ASSERT_EQ(d.code, KV_ENOTFOUND);
    ASSERT_TRUE(strstr(d.msg, "another model") != NULL);
    printf("  expected error: %s\n", d.msg);
    liar_stop(&L);
    kv_manifest_free(m);
    for (int i = 0; i < 3; i++) kill_worker(&w[i], SIGKILL);
}

/* A liar that answers NaN, Inf or 3e38 in well-formed RESULTs: its answers
 * are never used (the output stays exact) and it is dropped each time. */
static void test_liar_nonfinite(void) {
    proc w[3];
    for (int i = 0; i < 3; i++) ASSERT_TRUE(new_worker(&w[i], g_group[i]));
    kv_manifest *m = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_manifest_load(&m, g_manifest, &d), 0);
    const char *names[3] = {"NaN", "Inf", "3e38"};
    for (int mode = 6; mode <= 8 && m; mode++) {
        liar L;
        ASSERT_TRUE(liar_start(&L, m));
        L.mode = mode;
        const char *addrs[4] = {L.addr, w[0].addr, w[1].addr, w[2].addr};
        kv_remote *r = open_remote(addrs, 4, KV_ENC_F32, NULL, &d);
        if (!r) KVT_FAIL("open: %s", d.msg);
        if (r) {
            char what[64];
            snprintf(what, sizeof what, "a liar answering %s", names[mode - 6]);
            check_exact(r, slow_hook, NULL, what);
            kv_remote_worker li;
            kv_remote_worker_info(r, 0, &li);
            ASSERT_TRUE(li.drops >= 1);
            ASSERT_EQ(li.pairs, 0);
            ASSERT_TRUE(atomic_load(&L.n_lies) >= 1);
            printf("  %s: lied %d times, dropped %llu times (%s)\n", names[mode - 6], atomic_load(&L.n_lies),
                   (unsigned long long)li.drops, li.last_error);
        }
        kv_remote_free(r);
        liar_stop(&L);
    }
    kv_manifest_free(m);
    for (int i = 0; i < 3; i++) kill_worker(&w[i], SIGKILL);
}

/* A worker that handshakes and then never answers: with an honest replica
 * the output stays exact, and the staller is dialed with exponential
 * backoff (a fixed 100 ms redial would hand it work about ten times in
 * three seconds, each costing the 200 ms timeout). */
static void test_stall_backoff(void) {
    proc w[3];
    for (int i = 0; i < 3; i++) ASSERT_TRUE(new_worker(&w[i], g_group[i]));
    kv_manifest *m = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_manifest_load(&m, g_manifest, &d), 0);
    liar L;
    ASSERT_TRUE(m && liar_start(&L, m));
    L.mode = 9;
    const char *addrs[4] = {L.addr, w[0].addr, w[1].addr, w[2].addr};
    kv_remote *r = open_remote_t(addrs, 4, KV_ENC_F32, NULL, 200, 100, &d);
    if (!r) KVT_FAIL("open: %s", d.msg);
    if (r) {
        const int64_t t0 = (int64_t)time(NULL);
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        int runs = 0;
        do {
            check_exact(r, NULL, NULL, "a worker that stalls after its handshake");
            runs++;
            clock_gettime(CLOCK_MONOTONIC, &b);
        } while ((b.tv_sec - a.tv_sec) * 1000 + (b.tv_nsec - a.tv_nsec) / 1000000 < 3000 && runs < 1000);
        (void)t0;
        kv_remote_worker li;
        kv_remote_worker_info(r, 0, &li);
        print_workers(r, "staller");
        printf("  the staller was handed work %d times in %d decodes over 3 s\n", atomic_load(&L.n_lies), runs);
        ASSERT_TRUE(atomic_load(&L.n_lies) >= 2);
        ASSERT_TRUE(atomic_load(&L.n_lies) <= 6);
        ASSERT_EQ(li.pairs, 0);
    }
    kv_remote_free(r);
    liar_stop(&L);
    kv_manifest_free(m);
    for (int i = 0; i < 3; i++) kill_worker(&w[i], SIGKILL);
}

/* ---- places and slow replicas ------------------------------------------------ */

/* A worker holding every group, started with extra arguments. */
static bool new_worker_all(proc *p, const char *extra) {
    char slabs[sizeof p->slabs];
    snprintf(slabs, sizeof slabs, "%s,%s,%s", g_group[0], g_group[1], g_group[2]);
    return new_worker_extra(p, slabs, extra);
}

typedef struct slow_ctx {
    const proc *slow;
    const char *model_id;
    kv_remote *r;
    bool got;              /* the snapshot was taken */
    uint64_t n_compute;    /* the slow worker's own count of COMPUTEs at step 3 */
    uint64_t requests;     /* the coordinator's count of COMPUTEs sent to it at step 3 */
} slow_ctx;

static void slow_snapshot_hook(int step, void *arg) {
    slow_ctx *c = arg;
    if (step != 3) return;
    kv_msg_stats ws = {0};
    kv_remote_worker wi;
    c->got = worker_stats(c->slow, c->model_id, &ws);
    c->n_compute = ws.n_compute;
    kv_remote_worker_info(c->r, 1, &wi);
    c->requests = wi.requests;
}

/* One replica answers every COMPUTE 0.9 s late, inside a 1 s deadline,
 * beside a fast one holding the same experts: after its first late answer
 * it is demoted, and from step 3 on it gets no request at all (its own
 * counter says so), so the decode keeps the fast replica's pace with the
 * same bits. Restarted without the delay, it is probed and used again. */
static void test_slow_replica(void) {
    proc w[2];
    ASSERT_TRUE(new_worker_all(&w[0], ""));
    ASSERT_TRUE(new_worker_all(&w[1], "--test-delay=900"));
    const char *addrs[2] = {w[0].addr, w[1].addr};
    kv_diag d = {0};
    /* without hedging: its first request is waited for and demotes it (with
       hedging it would be superseded and never waited for: test_hedge.sh) */
    g_hedge_budget = -1;
    kv_remote *r = open_remote_t(addrs, 2, KV_ENC_F32, NULL, 1000, RECONNECT_MS, &d);
    g_hedge_budget = 0;
    if (!r) KVT_FAIL("open: %s", d.msg);
    ASSERT_TRUE(r != NULL);
    if (r) {
        slow_ctx c = {&w[1], kv_remote_manifest(r)->model_id, r, false, 0, 0};
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        check_exact(r, slow_snapshot_hook, &c, "a replica answering in 0.9 s beside a fast one");
        clock_gettime(CLOCK_MONOTONIC, &b);
        const double secs = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) * 1e-9;
        kv_remote_worker fast, slow;
        kv_remote_worker_info(r, 0, &fast);
        kv_remote_worker_info(r, 1, &slow);
        kv_msg_stats ws = {0};
        ASSERT_TRUE(worker_stats(&w[1], kv_remote_manifest(r)->model_id, &ws));
        printf("  prefill + %d tokens in %.2f s; the slow replica (%.0f ms) got %llu requests (%llu by step 3, its own "
               "count %llu then, %llu at the end), the fast one (%.1f ms) %llu\n", N_GEN, secs, slow.latency_ms,
               (unsigned long long)slow.requests, (unsigned long long)c.requests, (unsigned long long)c.n_compute,
               (unsigned long long)ws.n_compute, fast.latency_ms, (unsigned long long)fast.requests);
        ASSERT_TRUE(c.got);
        ASSERT_TRUE(slow.requests >= 1);           /* it was tried ... */
        ASSERT_EQ(slow.requests, c.requests);      /* ... and after step 3 never again */
        ASSERT_EQ(ws.n_compute, c.n_compute);      /* by its own count too */
        ASSERT_TRUE(slow.demoted && !fast.demoted);
        ASSERT_EQ(slow.drops, 0);                  /* late, not past the deadline */
        ASSERT_TRUE(fast.pairs > 10 * slow.pairs);
        /* restarted without the delay: probed once its wait is over, then used */
        kill_worker(&w[1], SIGKILL);
        w[1].extra[0] = 0;
        ASSERT_TRUE(start_worker(&w[1]));
        sleep_ms(1300); /* past the first probe's wait */
        for (int k = 0; k < 20; k++) { /* noticed closed, dialed again after its backoff, probed, used */
            check_exact(r, NULL, NULL, "the slow replica restarted fast");
            kv_remote_worker_info(r, 1, &slow);
            if (slow.connects >= 2 && slow.pairs_since_connect > 0) break;
            sleep_ms(50);
        }
        printf("  restarted fast: %llu probes, %.1f ms, %llu pairs since\n", (unsigned long long)slow.probes,
               slow.latency_ms, (unsigned long long)slow.pairs_since_connect);
        print_workers(r, "slow replica");
        ASSERT_TRUE(slow.probes >= 1);
        ASSERT_EQ(slow.connects, 2);
        ASSERT_TRUE(slow.pairs_since_connect > 0);
        ASSERT_TRUE(!slow.demoted);
    }
    kv_remote_free(r);
    for (int i = 0; i < 2; i++) kill_worker(&w[i], SIGKILL);
}

/* A fresh connection to p that proves the test coordinator's key and
 * stays open (holding a place); the fd, or -1. */
static int hold_place(const proc *p, const char *model_id) {
    int fd = -1;
    if (kv_link_connect(p->addr, 1000, &fd, NULL)) return -1;
    static uint8_t buf[1 << 16];
    size_t n;
    kv_msg_hello h = {KV_PROTO_VERSION_MIN, KV_PROTO_VERSION, {0}, 1u};
    memcpy(h.model_id, model_id, 65);
    kv_frame_rx rx;
    kv_frame_rx_init(&rx, buf, sizeof buf);
    kv_msg m;
    const bool ok = !kv_msg_hello_encode(buf, sizeof buf, 1, &h, &n, NULL) && !kv_proto_write_all(fd, buf, n, 1000, NULL) &&
                    !kv_proto_read_msg(&rx, fd, 1000, NULL, &m, NULL) && m.h.type == KV_MSG_HELLO_ACK &&
                    !kvt_auth(fd, &rx, buf, sizeof buf, model_id, m.u.ack.version, NULL);
    if (!ok) {
        close(fd);
        return -1;
    }
    return fd;
}

typedef struct closer {
    int fd, ms;
} closer;

static void *close_later(void *arg) {
    closer *c = arg;
    sleep_ms(c->ms);
    close(c->fd);
    return NULL;
}

/* A worker whose only place is held by an authenticated peer (not idle
 * long enough to be displaced) answers the coordinator's handshake with
 * ERANGE; the coordinator dials again with backoff within its deadline and
 * is served once the place frees, 300 ms later. */
static void test_busy_retry(void) {
    proc w;
    ASSERT_TRUE(new_worker_all(&w, "--max-conns 1 --evict-idle 600000"));
    kv_manifest *m = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_manifest_load(&m, g_manifest, &d), 0);
    int fd = -1; /* (start_worker's probe of the port may still hold the place a moment) */
    for (int t = 0; t < 40 && m && fd < 0; t++)
        if ((fd = hold_place(&w, m->model_id)) < 0) sleep_ms(25);
    ASSERT_TRUE(fd >= 0);
    closer c = {fd, 300};
    pthread_t th;
    ASSERT_EQ(pthread_create(&th, NULL, close_later, &c), 0);
    const char *addrs[1] = {w.addr};
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    kv_remote *r = open_remote_t(addrs, 1, KV_ENC_F32, NULL, 3000, RECONNECT_MS, &d);
    clock_gettime(CLOCK_MONOTONIC, &b);
    pthread_join(th, NULL);
    const long ms = (long)((b.tv_sec - a.tv_sec) * 1000 + (b.tv_nsec - a.tv_nsec) / 1000000);
    if (!r) KVT_FAIL("open: %s", d.msg);
    ASSERT_TRUE(r != NULL);
    if (r) {
        printf("  a worker with no room: the coordinator got in after %ld ms of retries\n", ms);
        ASSERT_TRUE(ms >= 250); /* it was refused first, and waited */
        check_exact(r, NULL, NULL, "after retrying a full worker");
        kv_remote_worker wi;
        kv_remote_worker_info(r, 0, &wi);
        ASSERT_EQ(wi.connects, 1);
    }
    kv_remote_free(r);
    kv_manifest_free(m);
    kill_worker(&w, SIGKILL);
}

/* 8 silent sockets from the coordinator's own address (127.0.0.1, a shared
 * NAT), reopened as they close: the coordinator still opens and decodes
 * exactly, each time (KV_ATTACK_FULL=1: 30 times). */
static void test_flood_own_address(void) {
    const int n = getenv("KV_ATTACK_FULL") ? 30 : 5;
    proc w;
    ASSERT_TRUE(new_worker_all(&w, "--quiet"));
    flood f;
    ASSERT_TRUE(flood_start(&f, w.addr, 1, 1, 8));
    for (int t = 0; t < 100 && atomic_load(&f.opened) < 8; t++) sleep_ms(10);
    sleep_ms(100);
    const char *addrs[1] = {w.addr};
    int ok = 0;
    for (int i = 0; i < n; i++) {
        kv_diag d = {0};
        kv_remote *r = open_remote_t(addrs, 1, KV_ENC_F32, NULL, 3000, RECONNECT_MS, &d);
        if (!r) KVT_FAIL("open %d under the flood: %s", i, d.msg);
        if (r) {
            check_exact(r, NULL, NULL, "under a flood from the coordinator's own address");
            ok++;
        }
        kv_remote_free(r);
    }
    const long opened = atomic_load(&f.opened);
    flood_stop(&f);
    printf("  8 silent sockets from 127.0.0.1 (%ld opened): the coordinator opened and decoded %d of %d times\n",
           opened, ok, n);
    ASSERT_EQ(ok, n);
    kill_worker(&w, SIGKILL);
}

/* Two models that differ only in their weights (another --seed: the same
 * header): their identities differ (identity covers the weights), so a
 * worker serving the other model's slabs is refused at the handshake. And a
 * slab whose weight bytes were changed after slicing (its header, and so
 * its kvasir.source.id, untouched) is refused by its SHA-256, which the
 * worker reports and the coordinator compares with its manifest. */
static void test_other_weights(void) {
    kv_diag d = {0};
    char other[300], om[400];
    snprintf(other, sizeof other, "%s/other", g_dir);
    snprintf(om, sizeof om, "%s/o.gguf", g_dir);
    kv_gen_config c = g_cfg;
    c.seed = g_cfg.seed + 1; /* the same flags, another seed */
    ASSERT_EQ(kv_gen_model(&c, om, &d), 0);
    const kv_slice_opts so = {4, -1, -1, 1};
    ASSERT_EQ(kv_slice_model(om, other, &so, NULL, &d), 0);
    snprintf(om, sizeof om, "%s/manifest.json", other);
    kv_manifest *mine = NULL, *theirs = NULL;
    ASSERT_EQ(kv_manifest_load(&mine, g_manifest, &d), 0);
    ASSERT_EQ(kv_manifest_load(&theirs, om, &d), 0);
    if (!mine || !theirs) return;
    /* the premise: other bytes, and so another identity */
    ASSERT_TRUE(strcmp(mine->model_id, theirs->model_id) != 0);
    ASSERT_TRUE(memcmp(mine->slabs[0].file.sha256, theirs->slabs[0].file.sha256, 32) != 0);
    char slabs[3200];
    size_t o = 0;
    for (uint32_t l = 0; l < 3; l++)
        for (uint32_t g = 0; g < 3; g++)
            o += (size_t)snprintf(slabs + o, sizeof slabs - o, "%s%s/experts/blk.%u.%04u-%04u.gguf", o ? "," : "", other,
                                  l, 4u * g, 4u * g + 3);
    proc w;
    ASSERT_TRUE(new_worker(&w, slabs));
    const char *addrs[1] = {w.addr};
    kv_remote *r = open_remote(addrs, 1, KV_ENC_F32, NULL, &d);
    ASSERT_TRUE(r == NULL);
    ASSERT_EQ(d.code, KV_ENOTFOUND);
    printf("  expected error (other model): %s\n", d.msg);
    kv_remote_free(r);
    kill_worker(&w, SIGKILL);

    /* our own slabs, one of them with a weight byte changed in place */
    char forged[300];
    snprintf(forged, sizeof forged, "%s/forged", g_dir);
    mkdir(forged, 0755);
    o = 0;
    for (uint32_t l = 0; l < 3; l++)
        for (uint32_t g = 0; g < 3; g++) {
            char from[600], to[600];
            snprintf(from, sizeof from, "%s/slices/experts/blk.%u.%04u-%04u.gguf", g_dir, l, 4u * g, 4u * g + 3);
            snprintf(to, sizeof to, "%s/blk.%u.%04u-%04u.gguf", forged, l, 4u * g, 4u * g + 3);
            ASSERT_EQ(cp(from, to), 0);
            if (l == 1 && g == 2) {
                kv_gguf *gg = NULL;
                ASSERT_EQ(kv_gguf_open(&gg, to, &d), 0);
                uint64_t off = gg ? kv_gguf_data_offset(gg) + 40 : 0;
                kv_gguf_close(gg);
                FILE *f = fopen(to, "r+b");
                ASSERT_TRUE(f != NULL);
                if (f) {
                    fseek(f, (long)off, SEEK_SET);
                    int ch = fgetc(f);
                    fseek(f, (long)off, SEEK_SET);
                    fputc(ch ^ 0x10, f);
                    fclose(f);
                }
            }
            o += (size_t)snprintf(slabs + o, sizeof slabs - o, "%s%s", o ? "," : "", to);
        }
    ASSERT_TRUE(new_worker(&w, slabs));
    addrs[0] = w.addr;
    r = open_remote(addrs, 1, KV_ENC_F32, NULL, &d);
    ASSERT_TRUE(r == NULL);
    ASSERT_EQ(d.code, KV_ENOTFOUND);
    ASSERT_TRUE(strstr(d.msg, "SHA-256") != NULL);
    printf("  expected error (forged slab): %s\n", d.msg);
    kv_remote_free(r);
    kill_worker(&w, SIGKILL);
    kv_manifest_free(mine);
    kv_manifest_free(theirs);
}

static void test_coverage_and_local(void) {
    proc w[2];
    for (int i = 0; i < 2; i++) ASSERT_TRUE(new_worker(&w[i], g_group[i]));
    const char *addrs[3] = {w[0].addr, w[1].addr, "127.0.0.1:1"};
    kv_diag d = {0};
    kv_remote *r = open_remote(addrs, 3, KV_ENC_F32, NULL, &d);
    ASSERT_TRUE(r == NULL);
    ASSERT_EQ(d.code, KV_ENOTFOUND);
    ASSERT_TRUE(strstr(d.msg, "layer 0 expert 8 is served by no worker") != NULL);
    ASSERT_TRUE(strstr(d.msg, "127.0.0.1:1") != NULL);
    printf("  expected error: %s\n", d.msg);
    /* G2's slabs present in a coordinator folder: computed locally */
    char dir[300], man[400], cmd[2400];
    snprintf(dir, sizeof dir, "%s/coord-g2", g_dir);
    snprintf(cmd, sizeof cmd, "mkdir -p '%s/experts' && cp '%s/slices/manifest.json' '%s/slices/backbone.gguf' '%s/' && "
             "cp %s/slices/experts/blk.*.0008-0011.gguf '%s/experts/'", dir, g_dir, g_dir, dir, g_dir, dir);
    ASSERT_EQ(system(cmd), 0);
    snprintf(man, sizeof man, "%s/manifest.json", dir);
    r = open_remote(addrs, 3, KV_ENC_F32, man, &d);
    if (!r) KVT_FAIL("open: %s", d.msg);
    ASSERT_TRUE(r != NULL);
    if (r) {
        check_exact(r, NULL, NULL, "two workers and local slabs");
        kv_remote_stats st;
        kv_remote_get_stats(r, &st);
        ASSERT_TRUE(st.pairs_local > 0);
        ASSERT_TRUE(st.pairs_remote > 0);
        print_workers(r, "local fallback");
    }
    kv_remote_free(r);
    /* a corrupt local slab is an error, not a silent fallback */
    snprintf(cmd, sizeof cmd, "printf 'X' | dd of='%s/experts/blk.1.0008-0011.gguf' bs=1 seek=5000 conv=notrunc 2>/dev/null",
             dir);
    ASSERT_EQ(system(cmd), 0);
    r = open_remote(addrs, 3, KV_ENC_F32, man, &d);
    ASSERT_TRUE(r == NULL);
    ASSERT_EQ(d.code, KV_EHASH);
    printf("  expected error: %s\n", d.msg);
    for (int i = 0; i < 2; i++) kill_worker(&w[i], SIGKILL);
}

/* The key a worker printed at start ("worker: key HEX" in its log). */
static bool worker_key_of(const proc *p, uint8_t out[32]) {
    char log[300], line[256];
    snprintf(log, sizeof log, "%s/worker-%u.log", g_dir, p->port);
    for (int t = 0; t < 100; t++) {
        FILE *f = fopen(log, "r");
        bool ok = false;
        while (f && fgets(line, sizeof line, f))
            if (!strncmp(line, "worker: key ", 12)) {
                line[12 + 64] = 0;
                ok = kv_key_from_hex(line + 12, out, NULL) == 0;
            }
        if (f) fclose(f);
        if (ok) return true;
        sleep_ms(20);
    }
    return false;
}

/* Mutual authentication: with the keys the workers announced the decode
 * is exact and each worker's proved key is reported; a worker expected
 * under another key (a listing that names someone else) is refused before
 * use, and so is a coordinator key the workers do not allow. */
static void test_mutual_keys(void) {
    proc w[3];
    uint8_t keys[3][32];
    for (int i = 0; i < 3; i++) {
        ASSERT_TRUE(new_worker(&w[i], g_group[i]));
        ASSERT_TRUE(worker_key_of(&w[i], keys[i]));
    }
    const char *addrs[3] = {w[0].addr, w[1].addr, w[2].addr};
    kv_diag d = {0};
    kv_remote *r = NULL;
    kv_remote_opts o = {addrs, 3, TIMEOUT_MS, RECONNECT_MS, KV_ENC_F32, 4, false, NULL, false, kvt_coord_sk(), NULL,
                        (const uint8_t(*)[32])keys, 0, false, NULL, 0, NULL, NULL, false, 0, 0};
    ASSERT_EQ(kv_remote_open(&r, g_manifest, g_pool, &o, &d), 0);
    if (r) {
        check_exact(r, NULL, NULL, "workers under the keys they are listed with");
        for (uint32_t i = 0; i < 3; i++) {
            kv_remote_worker wi;
            kv_remote_worker_info(r, i, &wi);
            ASSERT_TRUE(wi.up && !memcmp(wi.key, keys[i], 32));
        }
    }
    kv_remote_free(r);
    uint8_t wrong[3][32];
    memcpy(wrong, keys, sizeof wrong);
    memcpy(wrong[0], keys[1], 32); /* worker 0 listed under worker 1's key */
    o.worker_keys = (const uint8_t(*)[32])wrong;
    r = NULL;
    ASSERT_EQ(kv_remote_open(&r, g_manifest, g_pool, &o, &d), KV_ENOTFOUND);
    ASSERT_TRUE(r == NULL && strstr(d.msg, "another key than the one it is listed with"));
    printf("  expected error: %.300s\n", d.msg);
    /* a coordinator key nobody allows */
    uint8_t spk[32], ssk[64];
    kvt_key(33, spk, ssk);
    o.worker_keys = NULL;
    o.key_sk = ssk;
    ASSERT_EQ(kv_remote_open(&r, g_manifest, g_pool, &o, &d), KV_ENOTFOUND);
    ASSERT_TRUE(r == NULL && strstr(d.msg, "EAUTH"));
    /* no key at all: refused at once */
    o.key_sk = NULL;
    ASSERT_EQ(kv_remote_open(&r, g_manifest, g_pool, &o, &d), KV_EINVAL);
    for (int i = 0; i < 3; i++) kill_worker(&w[i], SIGKILL);
}

typedef struct caught_log {
    int n;
    uint32_t worker;
    uint8_t key[32];
    char why[256];
    const char *model_id;   /* set before open: evidence is checked against it */
    bool had_ev, ev_ok;     /* the hook got evidence; it verifies under the worker's key */
} caught_log;

static void on_caught(void *arg, uint32_t worker, const char *addr, const uint8_t key[32], const char *why,
                      const kv_evidence *ev) {
    caught_log *c = arg;
    (void)addr;
    c->had_ev = ev != NULL;
    c->ev_ok = ev && c->model_id && !memcmp(ev->worker_key, key, 32) && kv_evidence_check(ev, c->model_id, NULL) == 0;
    c->n++;
    c->worker = worker;
    memcpy(c->key, key, 32);
    snprintf(c->why, sizeof c->why, "%s", why);
}

/* Verified compute against real workers, one of them lying in each of the
 * test modes of `kvasir worker --test-lie`: the liar is caught (the hook
 * fires once, with its key), never used again, its part is redone by a
 * replica or the local slab, and the decode's logits equal the in-process
 * run's bit for bit. With three honest workers nothing is caught, every
 * answer is verified, and a sample is recomputed in full. */
static void test_verified(void) {
    char slices_man[400], s[3][sizeof((proc *)0)->slabs];
    snprintf(slices_man, sizeof slices_man, "%s/slices/manifest.json", g_dir); /* the coordinator holds the slabs */
    for (int i = 0; i < 3; i++) snprintf(s[i], sizeof s[i], "%.1500s,%.1500s", g_group[i], g_group[(i + 1) % 3]);
    const char *modes[5] = {NULL, "noise", "swap", "stale", "later"};
    const kv_verify_opts vo = {.seed = 99};
    for (int mi = 0; mi < 5; mi++) {
        proc w[3];
        for (int i = 0; i < 3; i++) {
            memset(&w[i], 0, sizeof w[i]);
            w[i].port = free_port();
            snprintf(w[i].addr, sizeof w[i].addr, "127.0.0.1:%u", w[i].port);
            memcpy(w[i].slabs, s[i], sizeof w[i].slabs);
            if (i == 1 && modes[mi]) snprintf(w[i].extra, sizeof w[i].extra, "--test-lie=%s", modes[mi]);
            ASSERT_TRUE(start_worker(&w[i]));
        }
        const char *addrs[3] = {w[0].addr, w[1].addr, w[2].addr};
        caught_log cl = {0};
        char mid[KV_PROTO_MODEL_ID_LEN + 1];
        cl.model_id = mid;
        /* without hedging: every answer is waited for and checked (a superseded
           one is discarded unchecked, so a lie in it would go unseen here); over
           TLS only each connection's first signature is checked on arrival
           (sig_check_rate all but 0): a lie in a later answer gets its
           signature checked when it is caught, and its evidence must verify */
        kv_remote_opts o = {addrs, 3, TIMEOUT_MS, RECONNECT_MS, KV_ENC_F32, 4, false, NULL, false, kvt_coord_sk(), NULL,
                            NULL, 0, false, &vo, 0.05, on_caught, &cl, false, -1, 1e-12};
        kv_diag d = {0};
        kv_remote *r = NULL;
        ASSERT_EQ(kv_remote_open(&r, slices_man, g_pool, &o, &d), 0);
        if (!r) {
            KVT_FAIL("open: %s", d.msg);
            for (int i = 0; i < 3; i++) kill_worker(&w[i], SIGKILL);
            continue;
        }
        snprintf(mid, sizeof mid, "%s", kv_remote_manifest(r)->model_id);
        char what[64];
        snprintf(what, sizeof what, "verified, liar %s", modes[mi] ? modes[mi] : "none");
        check_exact(r, NULL, NULL, what);
        kv_remote_stats st;
        kv_remote_get_stats(r, &st);
        kv_remote_worker wi;
        kv_remote_worker_info(r, 1, &wi);
        ASSERT_EQ(st.pairs_unverified, 0);
        ASSERT_EQ(st.pairs_verified, st.pairs_remote); /* a discarded answer counts for nothing */
        ASSERT_TRUE(st.pairs_verified > 0);
        ASSERT_TRUE(st.sigs_checked >= 3 && st.sigs_deferred > 0);
        if (!modes[mi]) {
            ASSERT_EQ(cl.n, 0);
            ASSERT_EQ(st.caught, 0);
            ASSERT_TRUE(st.pairs_recomputed > 0);
        } else {
            ASSERT_EQ(cl.n, 1);
            ASSERT_EQ(st.caught, 1);
            ASSERT_TRUE(cl.worker == 1 && wi.caught && !wi.up && !memcmp(cl.key, wi.key, 32));
            ASSERT_TRUE(strstr(cl.why, "caught lying") != NULL);
            /* v4 workers sign their answers: the hook gets evidence that verifies under the liar's key */
            ASSERT_TRUE(cl.had_ev && cl.ev_ok);
            /* the pairs it answered before it lied were verified, none after */
            printf("  liar %-5s caught after %llu verified pairs: %s\n", modes[mi], (unsigned long long)wi.verified,
                   cl.why);
            /* it answered honestly at first: those answers were verified (the one it lied in is discarded whole) */
            if (!strcmp(modes[mi], "later")) ASSERT_TRUE(wi.verified > 0 && wi.verified <= 64);
        }
        printf("  %s: %llu verified, %llu recomputed, %llu remote, %llu local, %llu retried\n", what,
               (unsigned long long)st.pairs_verified, (unsigned long long)st.pairs_recomputed,
               (unsigned long long)st.pairs_remote, (unsigned long long)st.pairs_local,
               (unsigned long long)st.retried_pairs);
        kv_remote_free(r);
        for (int i = 0; i < 3; i++) kill_worker(&w[i], SIGKILL);
    }
}

/* Signatures over TLS (docs/PROTOCOL.md, Signed results): honest workers
 * have most signatures taken unchecked at the default rate (each
 * connection's first checked), and the logits stay exact; a worker whose
 * every signature is wrong (--test-lie=badsig, honest numbers) is caught on
 * its first answer, without evidence, and its part redone. */
static void test_badsig(void) {
    for (int liar = 0; liar < 2; liar++) {
        proc w[3];
        for (int i = 0; i < 3; i++) {
            memset(&w[i], 0, sizeof w[i]);
            w[i].port = free_port();
            snprintf(w[i].addr, sizeof w[i].addr, "127.0.0.1:%u", w[i].port);
            snprintf(w[i].slabs, sizeof w[i].slabs, "%.1500s,%.1500s", g_group[i], g_group[(i + 1) % 3]);
            if (i == 1 && liar) snprintf(w[i].extra, sizeof w[i].extra, "--test-lie=badsig");
            ASSERT_TRUE(start_worker(&w[i]));
        }
        const char *addrs[3] = {w[0].addr, w[1].addr, w[2].addr};
        caught_log cl = {0};
        char mid[KV_PROTO_MODEL_ID_LEN + 1];
        cl.model_id = mid;
        kv_remote_opts o = {addrs, 3, TIMEOUT_MS, RECONNECT_MS, KV_ENC_F32, 4, false, NULL, false, kvt_coord_sk(), NULL,
                            NULL, 0, false, NULL, 0, on_caught, &cl, false, -1, 0};
        kv_diag d = {0};
        kv_remote *r = NULL;
        ASSERT_EQ(kv_remote_open(&r, g_manifest, g_pool, &o, &d), 0);
        if (!r) {
            KVT_FAIL("open: %s", d.msg);
            for (int i = 0; i < 3; i++) kill_worker(&w[i], SIGKILL);
            continue;
        }
        snprintf(mid, sizeof mid, "%s", kv_remote_manifest(r)->model_id);
        check_exact(r, NULL, NULL, liar ? "a worker signing wrong" : "signatures sampled");
        kv_remote_stats st;
        kv_remote_get_stats(r, &st);
        printf("  %s: %llu signatures checked, %llu taken unchecked, %llu caught\n", liar ? "badsig" : "honest",
               (unsigned long long)st.sigs_checked, (unsigned long long)st.sigs_deferred,
               (unsigned long long)st.caught);
        if (!liar) {
            ASSERT_EQ(st.caught, 0);
            ASSERT_TRUE(st.sigs_checked >= 3);
            ASSERT_TRUE(st.sigs_deferred > st.sigs_checked); /* about 15 in 16 */
        } else {
            kv_remote_worker wi;
            kv_remote_worker_info(r, 1, &wi);
            ASSERT_EQ(cl.n, 1);
            ASSERT_EQ(st.caught, 1);
            ASSERT_TRUE(cl.worker == 1 && wi.caught && !wi.up);
            ASSERT_TRUE(strstr(cl.why, "signature") != NULL);
            ASSERT_TRUE(!cl.had_ev);
            ASSERT_EQ(wi.pairs, 0); /* caught on its first answer: nothing of it was taken */
        }
        kv_remote_free(r);
        for (int i = 0; i < 3; i++) kill_worker(&w[i], SIGKILL);
    }
}

static void test_wire(void) {
    proc w[3];
    for (int i = 0; i < 3; i++) ASSERT_TRUE(new_worker(&w[i], g_group[i]));
    const char *addrs[3] = {w[0].addr, w[1].addr, w[2].addr};
    for (uint32_t enc = KV_ENC_F16; enc <= KV_ENC_BF16; enc++) {
        kv_diag d = {0};
        kv_remote *r = open_remote(addrs, 3, enc, NULL, &d);
        ASSERT_TRUE(r != NULL);
        if (!r) continue;
        float *lg = calloc((size_t)(N_GEN + 1) * g_vocab, sizeof *lg);
        /* teacher-forced: the prompt's prefill logits, the most comparable */
        const int rows = decode(kv_remote_model(r), kv_remote_provider(r), lg, NULL, NULL, &d);
        ASSERT_EQ(rows, N_GEN + 1);
        double maxerr = 0, maxabs = 0, sumerr = 0;
        for (size_t i = 0; i < g_vocab; i++) {
            const double e = fabs((double)lg[i] - g_ref[i]);
            if (e > maxerr) maxerr = e;
            sumerr += e;
            if (fabs(g_ref[i]) > maxabs) maxabs = fabs(g_ref[i]);
        }
        kv_remote_worker wi;
        kv_remote_worker_info(r, 0, &wi);
        ASSERT_EQ(wi.enc, enc);
        kv_remote_stats st;
        kv_remote_get_stats(r, &st);
        printf("  wire %s: |logit error| after prefill: max %.3g, mean %.3g (max |logit| %.3g, relative %.3g); "
               "%.1f kB sent, %.1f kB received\n", kv_enc_name(enc), maxerr, sumerr / g_vocab, maxabs, maxerr / maxabs,
               st.bytes_sent / 1e3, st.bytes_recv / 1e3);
        ASSERT_TRUE(maxerr > 0);                             /* it is lossy */
        ASSERT_TRUE(maxerr <= 0.1 * maxabs); /* and bounded */
        free(lg);
        kv_remote_free(r);
    }
    for (int i = 0; i < 3; i++) kill_worker(&w[i], SIGKILL);
}

static int setup(void) {
    g_bin = getenv("KV_BIN");
    if (!g_bin) {
        fprintf(stderr, "test_remote: KV_BIN (the kvasir binary) is not set\n");
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    snprintf(g_dir, sizeof g_dir, "/tmp/kvasir-remote.XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    kv_diag d = {0};
    kv_gen_config c;
    ASSERT_EQ(kv_gen_preset_get("tiny", &c, &d), 0);
    c.n_layer = 3;
    c.n_embd = 128;
    c.n_ff_exp = 64;
    c.n_expert = 12;
    c.n_expert_used = 4;
    c.n_head = 4;
    c.n_head_kv = 2;
    c.head_dim = 32;
    c.n_vocab = 512;
    c.type = KV_TYPE_Q8_0;
    c.n_threads = 1;
    c.seed = 11;
    c.log = NULL;
    g_cfg = c;
    char model[300], slices[300];
    snprintf(model, sizeof model, "%s/m.gguf", g_dir);
    snprintf(slices, sizeof slices, "%s/slices", g_dir);
    ASSERT_EQ(kv_gen_model(&c, model, &d), 0);
    const kv_slice_opts so = {4, -1, -1, 1};
    ASSERT_EQ(kv_slice_model(model, slices, &so, NULL, &d), 0);
    /* the coordinator's folder: backbone and manifest only */
    char coord[300], f1[400], f2[400];
    snprintf(coord, sizeof coord, "%s/coord", g_dir);
    mkdir(coord, 0755);
    snprintf(f1, sizeof f1, "%s/backbone.gguf", slices);
    snprintf(f2, sizeof f2, "%s/backbone.gguf", coord);
    ASSERT_EQ(cp(f1, f2), 0);
    snprintf(f1, sizeof f1, "%s/manifest.json", slices);
    snprintf(f2, sizeof f2, "%s/manifest.json", coord);
    ASSERT_EQ(cp(f1, f2), 0);
    snprintf(g_manifest, sizeof g_manifest, "%s", f2);
    for (int gi = 0; gi < 3; gi++) {
        size_t o = 0;
        for (uint32_t l = 0; l < c.n_layer; l++)
            o += (size_t)snprintf(g_group[gi] + o, sizeof g_group[gi] - o, "%s%s/experts/blk.%u.%04u-%04u.gguf",
                                  l ? "," : "", slices, l, 4u * gi, 4u * gi + 3);
    }
    if (kvt_failures) return 1;

    /* the reference: in-process from the full model file */
    ASSERT_EQ(kv_pool_new(&g_pool, 2, &d), 0);
    kv_model *full = NULL;
    ASSERT_EQ(kv_model_load(&full, model, &d), 0);
    g_vocab = kv_model_hparams(full)->n_vocab;
    for (int i = 0; i < N_PROMPT; i++) g_prompt[i] = 300 + 17 * i;
    g_ref = calloc((size_t)(N_GEN + 1) * g_vocab, sizeof *g_ref);
    ASSERT_EQ(decode(full, NULL, g_ref, NULL, NULL, &d), N_GEN + 1);
    kv_model_free(full);
    if (kvt_failures) return 1;

    return 0;
}

static void teardown(void) {
    free(g_ref);
    kv_pool_free(g_pool);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (!kvt_failures) (void)!system(cmd);
    else fprintf(stderr, "test_remote: files kept in %s\n", g_dir);
}

static const kvt_case cases[] = {
    KVT_CASE(test_disjoint),       KVT_CASE(test_replicas),       KVT_CASE(test_no_replica_dies),
    KVT_CASE(test_no_replica_back), KVT_CASE(test_liar),          KVT_CASE(test_liar_nonfinite),
    KVT_CASE(test_stall_backoff),  KVT_CASE(test_other_weights),  KVT_CASE(test_coverage_and_local),
    KVT_CASE(test_wire),           KVT_CASE(test_mutual_keys),    KVT_CASE(test_verified),  KVT_CASE(test_badsig),
    KVT_CASE(test_slow_replica),   KVT_CASE(test_busy_retry),     KVT_CASE(test_flood_own_address),
};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
