/* kv-test-labels: net attack */
/* CANCEL on the wire (protocol v6, docs/PROTOCOL.md "CANCEL / CANCELLED"),
 * against a real `kvasir worker` process whose every COMPUTE stalls
 * STALL_MS (--test-stall-ms/--test-stall-every, test only), over raw
 * sockets:
 *   - a COMPUTE then its CANCEL: CANCELLED comes back long before the stall
 *     would end, and the worker's STATS count one cancelled request and no
 *     computed pair (the stalled compute never ran);
 *   - a flood of CANCELs for ids the worker never saw, sent while a request
 *     runs: no answer to any of them, no ERROR, no close; the request's
 *     RESULT is bit-identical to the engine's own computation, and a PING
 *     sent behind the flood is answered after it (replies keep order);
 *   - a CANCEL of a request queued behind another (still in the receive
 *     buffer): the first is answered, the second called off before it is
 *     computed;
 *   - a CANCEL for the request just answered (it crossed the RESULT): ignored;
 *   - an older peer: a v5 connection never gets CANCEL, and a CANCEL in a v5
 *     frame is a protocol error (ERROR, close) like any unknown frame.
 * Everything on 127.0.0.1, ports chosen by the kernel. */
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/dispatch_proto.h"
#include "kvasir/gguf.h"
#include "kvasir/slice.h"
#include "kvtest.h"
#include "test_auth_support.h"

#define N_EMBD 64
#define N_EXPERT 4
#define STALL_MS 3000
#define N_FLOOD 20000 /* CANCELs of unknown ids sent while a request runs */

static char g_dir[64];
static const char *g_bin;
static char g_model_id[65];
static kv_gguf *g_full;
static pid_t g_pid;
static char g_addr[80];

static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int sh(const char *fmt, ...) {
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    int rc = system(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- a raw client ------------------------------------------------------- */

typedef struct client {
    int fd;
    uint8_t *rxb, *tx;
    kv_frame_rx rx;
    uint16_t version;
} client;

static int client_open(client *c, uint16_t max_version) {
    kv_diag d = {0};
    memset(c, 0, sizeof *c);
    c->rxb = malloc(1u << 20);
    c->tx = malloc(1u << 20);
    kv_frame_rx_init(&c->rx, c->rxb, 1u << 20);
    if (kv_link_connect(g_addr, 2000, &c->fd, &d)) return -1;
    kv_msg_hello h = {KV_PROTO_AUTH_VERSION, max_version, "", KV_ENC_MASK_ALL};
    memcpy(h.model_id, g_model_id, 65);
    size_t n;
    kv_msg m;
    if (kv_msg_hello_encode(c->tx, 1u << 20, 1, &h, &n, &d) || kv_proto_write_all(c->fd, c->tx, n, 2000, &d) ||
        kv_proto_read_msg(&c->rx, c->fd, 5000, NULL, &m, &d) || m.h.type != KV_MSG_HELLO_ACK)
        return -1;
    c->version = m.u.ack.version;
    if (kvt_auth(c->fd, &c->rx, c->tx, 1u << 20, g_model_id, c->version, &d)) {
        fprintf(stderr, "auth: %s\n", d.msg);
        return -1;
    }
    return 0;
}

static void client_close(client *c) {
    if (c->fd > 0) close(c->fd);
    free(c->rxb);
    free(c->tx);
}

/* Reads one message within ms. */
static int client_recv(client *c, kv_msg *m, int ms) {
    kv_diag d = {0};
    kv_frame_rx_reset(&c->rx);
    return kv_proto_read_msg(&c->rx, c->fd, ms, NULL, m, &d);
}

/* Appends one frame built by the caller at c->tx + *off to the pending
 * batch, stamped with the negotiated version. */
static void put_version(client *c, size_t off) { kv_frame_set_version(c->tx + off, c->version); }

static size_t put_compute(client *c, size_t off, uint32_t rid, const float *x, const kv_proto_pair *pairs, uint32_t np) {
    kv_msg_compute cm = {1, KV_ENC_F32, KV_ENC_F32, 1, N_EMBD, np, x, pairs, NULL, NULL};
    size_t n = 0;
    ASSERT_EQ(kv_msg_compute_encode(c->tx + off, (1u << 20) - off, rid, &cm, &n, NULL), 0);
    put_version(c, off);
    return n;
}

static size_t put_cancel(client *c, size_t off, uint32_t rid) {
    size_t n = 0;
    ASSERT_EQ(kv_msg_cancel_encode(c->tx + off, (1u << 20) - off, KV_MSG_CANCEL, rid, &n, NULL), 0);
    put_version(c, off);
    return n;
}

static int send_all(client *c, size_t n) {
    kv_diag d = {0};
    return kv_proto_write_all(c->fd, c->tx, n, 5000, &d);
}

static kv_msg_stats stats(client *c) {
    kv_msg_stats s = {0};
    size_t n = 0;
    kv_msg m;
    ASSERT_EQ(kv_msg_stats_encode(c->tx, 1u << 20, 77, &n, NULL), 0);
    put_version(c, 0);
    ASSERT_EQ(send_all(c, n), 0);
    ASSERT_EQ(client_recv(c, &m, 5000), 0);
    ASSERT_EQ(m.h.type, KV_MSG_STATS_ACK);
    if (m.h.type == KV_MSG_STATS_ACK) s = m.u.stats;
    return s;
}

/* ---- setup ---------------------------------------------------------------- */

static int setup(void) {
    g_bin = getenv("KV_BIN");
    if (!g_bin) g_bin = "./kvasir";
    snprintf(g_dir, sizeof g_dir, "/tmp/kv_hedge_cancel.XXXXXX");
    if (!mkdtemp(g_dir)) return -1;
    if (sh("%s gen-model --arch qwen3moe --out %s/m.gguf --layers 2 --embd %d --ff-exp 32 --experts %d "
           "--experts-used 2 --heads 2 --kv-heads 1 --head-dim 32 --vocab 300 --type q8_0 --seed 3 >/dev/null 2>&1",
           g_bin, g_dir, N_EMBD, N_EXPERT) ||
        sh("%s slice %s/m.gguf --out %s/sl --experts-per-slab 2 >/dev/null 2>&1", g_bin, g_dir, g_dir))
        return -1;
    char p[128];
    kv_diag d = {0};
    snprintf(p, sizeof p, "%s/m.gguf", g_dir);
    if (kv_gguf_open(&g_full, p, &d)) return -1;
    kv_slice_model_id(g_full, g_model_id);
    /* the worker: every COMPUTE it takes stalls STALL_MS */
    int pfd[2];
    if (pipe(pfd)) return -1;
    g_pid = fork();
    if (g_pid == 0) {
        dup2(pfd[1], 1);
        char errlog[128];
        snprintf(errlog, sizeof errlog, "%s/worker.err", g_dir);
        int e = open(errlog, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(e, 2);
        close(pfd[0]);
        char cmd[1024];
        snprintf(cmd, sizeof cmd,
                 "exec %s worker --slabs %s/sl/experts --threads 1 --quiet --allow-key %s --listen 127.0.0.1:0 "
                 "--test-stall-ms=%d --test-stall-every=1",
                 g_bin, g_dir, kvt_coord_hex(), STALL_MS);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    close(pfd[1]);
    char line[80];
    size_t n = 0;
    for (;;) {
        char ch;
        if (read(pfd[0], &ch, 1) <= 0) break;
        if (ch == '\n') {
            line[n] = 0;
            if (!strncmp(line, "listening on ", 13)) {
                snprintf(g_addr, sizeof g_addr, "%s", line + 13);
                break;
            }
            n = 0;
        } else if (n + 1 < sizeof line) {
            line[n++] = ch;
        }
    }
    close(pfd[0]);
    return g_addr[0] ? 0 : -1;
}

/* The worker exits cleanly on SIGTERM (in a sanitizer build, also without
 * a report: those exit non-zero). */
static void teardown(void) {
    if (g_pid > 0) {
        kill(g_pid, SIGTERM);
        int st = 0;
        waitpid(g_pid, &st, 0);
        kvt_checks++;
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
            KVT_FAIL("the worker did not exit cleanly (status 0x%x); its stderr:", st);
            sh("tail -40 %s/worker.err >&2", g_dir);
        }
    }
    kv_gguf_close(g_full);
    sh("rm -rf %s", g_dir);
}

/* ---- cases ------------------------------------------------------------------- */

static float g_x[N_EMBD];
static const kv_proto_pair g_pairs[2] = {{0, 1}, {0, 3}};

/* A COMPUTE and its CANCEL: CANCELLED at once, nothing computed. */
static void test_cancel_stalled(void) {
    client c;
    ASSERT_EQ(client_open(&c, KV_PROTO_VERSION), 0);
    ASSERT_EQ(c.version, KV_PROTO_CANCEL_VERSION);
    for (uint32_t i = 0; i < N_EMBD; i++) g_x[i] = (float)((int)(i * 37 % 19) - 9) / 8.0f;
    size_t n = put_compute(&c, 0, 10, g_x, g_pairs, 2);
    ASSERT_EQ(send_all(&c, n), 0);
    usleep(100 * 1000); /* taken, and stalling */
    const int64_t t0 = now_ms();
    n = put_cancel(&c, 0, 10);
    ASSERT_EQ(send_all(&c, n), 0);
    kv_msg m;
    ASSERT_EQ(client_recv(&c, &m, 5000), 0);
    const int64_t dt = now_ms() - t0;
    ASSERT_EQ(m.h.type, KV_MSG_CANCELLED);
    ASSERT_EQ(m.h.request_id, 10);
    if (dt > STALL_MS / 3) KVT_FAIL("CANCELLED came %lld ms after the CANCEL: the stall was waited for", (long long)dt);
    const kv_msg_stats s = stats(&c);
    printf("cancelled after %lld ms; worker: %llu cancelled, %llu requests and %llu pairs computed\n", (long long)dt,
           (unsigned long long)s.n_cancelled, (unsigned long long)s.n_compute, (unsigned long long)s.n_pairs);
    ASSERT_EQ(s.n_cancelled, 1);
    ASSERT_EQ(s.n_compute, 0);
    ASSERT_EQ(s.n_pairs, 0); /* the stalled request's pairs were never computed */
    ASSERT_EQ(s.n_errors, 0);
    client_close(&c);
}

/* Unknown-id CANCELs, a flood of them, while a request runs: ignored; the
 * request is answered right, and a PING behind them after it. */
static void test_cancel_flood(void) {
    client c;
    ASSERT_EQ(client_open(&c, KV_PROTO_VERSION), 0);
    kv_msg_stats s0 = stats(&c);
    size_t off = put_compute(&c, 0, 20, g_x, g_pairs, 2);
    off += put_cancel(&c, off, 99); /* never sent */
    off += put_cancel(&c, off, 19); /* a past id */
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < N_FLOOD; i++) {
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        uint32_t id = (uint32_t)rng;
        if (id == 20) id = 21;
        off += put_cancel(&c, off, id);
    }
    size_t n = 0;
    ASSERT_EQ(kv_msg_ping_encode(c.tx + off, (1u << 20) - off, KV_MSG_PING, 30, 0xabcdefull, &n, NULL), 0);
    put_version(&c, off);
    off += n;
    ASSERT_EQ(send_all(&c, off), 0);
    kv_msg m;
    ASSERT_EQ(client_recv(&c, &m, STALL_MS + 10000), 0);
    ASSERT_EQ(m.h.type, KV_MSG_RESULT);
    ASSERT_EQ(m.h.request_id, 20);
    if (m.h.type == KV_MSG_RESULT && m.u.result.n_pairs == 2) { /* bit-identical to the engine's computation */
        for (uint32_t p = 0; p < 2; p++) {
            float got[N_EMBD], want[N_EMBD];
            kv_expert_weights w;
            uint32_t E, F;
            kv_diag d = {0};
            kv_msg_result_row(&m.u.result, p, got);
            ASSERT_EQ(kv_expert_find(g_full, 1, g_pairs[p].expert, &w, &E, &F, &d), 0);
            ASSERT_EQ(kv_expert_compute_one(&w, E, F, NULL, g_x, 1, want, &d), 0);
            ASSERT_TRUE(!memcmp(got, want, sizeof got));
        }
    }
    ASSERT_EQ(client_recv(&c, &m, 5000), 0);
    ASSERT_EQ(m.h.type, KV_MSG_PONG); /* and nothing in between: no answer to an unknown id */
    ASSERT_EQ(m.h.request_id, 30);
    const kv_msg_stats s = stats(&c);
    ASSERT_EQ(s.n_cancelled, s0.n_cancelled);
    ASSERT_EQ(s.n_compute, s0.n_compute + 1);
    ASSERT_EQ(s.n_pairs, s0.n_pairs + 2);
    ASSERT_EQ(s.n_errors, s0.n_errors);
    printf("%d CANCELs of unknown ids while a request ran: ignored, connection serving\n", N_FLOOD + 2);
    /* a CANCEL of the request just answered crossed its RESULT: ignored too */
    n = put_cancel(&c, 0, 20);
    ASSERT_EQ(send_all(&c, n), 0);
    const kv_msg_stats s2 = stats(&c);
    ASSERT_EQ(s2.n_cancelled, s.n_cancelled);
    ASSERT_EQ(s2.n_errors, s.n_errors);
    client_close(&c);
}

/* A CANCEL of a request queued behind another: the first is answered, the
 * second called off before it is computed. */
static void test_cancel_queued(void) {
    client c;
    ASSERT_EQ(client_open(&c, KV_PROTO_VERSION), 0);
    kv_msg_stats s0 = stats(&c);
    size_t off = put_compute(&c, 0, 40, g_x, g_pairs, 2);
    off += put_compute(&c, off, 41, g_x, g_pairs, 1);
    off += put_cancel(&c, off, 41);
    ASSERT_EQ(send_all(&c, off), 0);
    kv_msg m;
    ASSERT_EQ(client_recv(&c, &m, STALL_MS + 10000), 0);
    ASSERT_TRUE(m.h.type == KV_MSG_RESULT && m.h.request_id == 40);
    const int64_t t0 = now_ms();
    ASSERT_EQ(client_recv(&c, &m, STALL_MS + 10000), 0);
    ASSERT_TRUE(m.h.type == KV_MSG_CANCELLED && m.h.request_id == 41);
    if (now_ms() - t0 > STALL_MS / 3) KVT_FAIL("the queued request's stall was waited for");
    const kv_msg_stats s = stats(&c);
    ASSERT_EQ(s.n_cancelled, s0.n_cancelled + 1);
    ASSERT_EQ(s.n_pairs, s0.n_pairs + 2); /* request 40's pairs only */
    client_close(&c);
}

/* A v5 peer: negotiates 5, and a CANCEL in a v5 frame is a protocol error. */
static void test_old_peer(void) {
    client c;
    ASSERT_EQ(client_open(&c, KV_PROTO_CANCEL_VERSION - 1), 0);
    ASSERT_EQ(c.version, KV_PROTO_CANCEL_VERSION - 1);
    kv_msg_stats s = stats(&c); /* the nine-counter ack of v5 */
    ASSERT_EQ(s.n_cancelled, 0);
    size_t n = put_cancel(&c, 0, 5);
    ASSERT_EQ(send_all(&c, n), 0);
    kv_msg m;
    ASSERT_EQ(client_recv(&c, &m, 5000), 0);
    ASSERT_TRUE(m.h.type == KV_MSG_ERROR && m.u.error.code == KV_EPROTO);
    ASSERT_EQ(client_recv(&c, &m, 3000), KV_EIO); /* closed */
    client_close(&c);
    /* the worker still serves others */
    ASSERT_EQ(client_open(&c, KV_PROTO_VERSION), 0);
    s = stats(&c);
    ASSERT_TRUE(s.n_cancelled >= 1);
    client_close(&c);
}

static const kvt_case cases[] = {
    KVT_CASE(test_cancel_stalled),
    KVT_CASE(test_cancel_flood),
    KVT_CASE(test_cancel_queued),
    KVT_CASE(test_old_peer),
};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
