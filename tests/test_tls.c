/* kv-test-labels: net unit */
/* The TLS 1.3 transport of the link layer (include/kvasir/tls.h) under the
 * event loop's framing and in its blocking form, over 127.0.0.1 with a
 * kernel-chosen port: frames (one of several MB among them) cross intact
 * both ways; both ends compute the same exporter, and another session
 * another one; a pinned key or fingerprint that the peer does not carry
 * fails the handshake; plaintext, a TLS 1.2-only client and a silent client
 * each close only their own connection, with a reason that says why, while
 * the server goes on serving; a byte flipped on the way by a relay fails
 * the record and delivers nothing. The independent references are the openssl
 * command-line tool (fingerprint of a PEM written out; the exporter as
 * `s_client -keymatexport` computes it; a `-tls1_2` client) and a byte
 * pattern each side derives on its own. */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvasir/link.h"
#include "kvasir/net.h"
#include "kvasir/tls.h"
#include "kvtest.h"

#define BIG_FRAME (6u << 20) /* a frame of several MB (~400 TLS records) */

/* ---- keys and contexts ------------------------------------------------------------------ */

static kv_node_key g_srv_key, g_cli_key, g_other_key;
static kv_tls_ctx *g_srv, *g_cli;

static int setup(void) {
    uint8_t seed[32];
    memset(seed, 1, 32), kv_node_key_from_seed(&g_srv_key, seed);
    memset(seed, 2, 32), kv_node_key_from_seed(&g_cli_key, seed);
    memset(seed, 3, 32), kv_node_key_from_seed(&g_other_key, seed);
    kv_diag d = {0};
    if (kv_tls_ctx_new(&g_srv, &g_srv_key, &d) || kv_tls_ctx_new(&g_cli, &g_cli_key, &d)) {
        fprintf(stderr, "setup: %s\n", d.msg);
        return 1;
    }
    return 0;
}

static void teardown(void) {
    kv_tls_ctx_free(g_srv);
    kv_tls_ctx_free(g_cli);
}

/* ---- framed peers: u32 LE length + bytes; byte i of a frame is (i * 31 + tag) % 251 --------- */

typedef struct peer {
    kv_tls *tls;             /* the session (owned by the connection) */
    int open_code;           /* on_open's code; 1 until called */
    bool closed;
    int close_code;
    char why[256];
    int frames;              /* frames received */
    int bad;                 /* frames whose bytes were not the pattern */
    size_t bytes;            /* bytes of frames received */
    bool echo;               /* send every frame back */
    bool hold_first;         /* hold the first frame (KV_NET_HOLD) */
    uint8_t exporter[32];    /* at on_open */
    int exporter_rc;
    uint8_t peer_key[32];    /* at on_open */
    int peer_key_rc;
    kv_net_conn *c;
} peer;

static uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void make_frame(uint8_t *out, uint32_t n, uint8_t tag) {
    out[0] = (uint8_t)n, out[1] = (uint8_t)(n >> 8), out[2] = (uint8_t)(n >> 16), out[3] = (uint8_t)(n >> 24);
    if (n) out[4] = tag;
    for (uint32_t i = 1; i < n; i++) out[4 + i] = (uint8_t)((i * 31u + tag) % 251u);
}

static bool frame_ok(const uint8_t *f, size_t n) {
    if (n < 5) return n == 4;
    const uint8_t tag = f[4];
    for (size_t i = 1; i < n - 4; i++)
        if (f[4 + i] != (uint8_t)((i * 31u + tag) % 251u)) return false;
    return true;
}

static int pf_len(kv_net_conn *c, const uint8_t *h, size_t *total, kv_diag *d) {
    (void)c, (void)d;
    *total = 4 + (size_t)rd32(h);
    return 0;
}

static int pf_frame(kv_net_conn *c, const uint8_t *f, size_t n) {
    peer *p = kv_net_conn_data(c);
    p->frames++;
    p->bytes += n;
    if (!frame_ok(f, n)) p->bad++;
    if (p->echo && kv_net_conn_send(c, f, n)) return KV_ENOMEM;
    if (p->hold_first && p->frames == 1) return KV_NET_HOLD;
    return 0;
}

static void pf_open(kv_net_conn *c, int code) {
    peer *p = kv_net_conn_data(c);
    p->open_code = code;
    if (code) return;
    p->exporter_rc = kv_tls_exporter(p->tls, p->exporter);
    p->peer_key_rc = kv_tls_peer_key(p->tls, p->peer_key);
}

static void pf_close(kv_net_conn *c, int code, const char *why) {
    peer *p = kv_net_conn_data(c);
    p->closed = true;
    p->close_code = code;
    p->c = NULL;
    snprintf(p->why, sizeof p->why, "%s", why ? why : "");
}

static const kv_net_conn_cbs g_cbs = {.on_open = pf_open, .frame_len = pf_len, .on_frame = pf_frame,
                                      .on_close = pf_close};

static kv_net_conn_opts conn_opts(kv_tls *t, int handshake_ms) {
    kv_net_conn_opts o = {.header = 4, .max_frame = 8u << 20, .tx_max = 16u << 20, .frame_timeout_ms = 5000,
                          .write_timeout_ms = 5000, .linger_ms = 50, .handshake_timeout_ms = handshake_ms,
                          .io = &kv_tls_net_io, .io_ctx = t};
    return o;
}

/* ---- a TLS server on the loop ----------------------------------------------------------- */

#define MAX_PEERS 8
typedef struct server {
    kv_net_loop *l;
    int lfd;
    char addr[64];
    kv_net_watch w;
    const uint8_t *pin_key;  /* the client key it requires, or NULL */
    bool hold_first;         /* accepted peers hold their first frame */
    int handshake_ms;
    peer peers[MAX_PEERS];   /* accepted connections, in order */
    int n;
} server;

static void on_accept(kv_net_loop *l, kv_net_watch *w, unsigned ev) {
    server *s = w->data;
    (void)ev;
    int fd = accept(s->lfd, NULL, NULL);
    if (fd < 0) return;
    if (s->n == MAX_PEERS) {
        close(fd);
        return;
    }
    peer *p = &s->peers[s->n++];
    memset(p, 0, sizeof *p);
    p->open_code = 1;
    p->echo = true;
    p->hold_first = s->hold_first;
    kv_diag d = {0};
    kv_tls_opts to = {.server = true, .pin_key = s->pin_key};
    if (kv_tls_new(&p->tls, g_srv, &to, &d)) {
        close(fd);
        return;
    }
    kv_net_conn_opts o = conn_opts(p->tls, s->handshake_ms);
    if (kv_net_conn_new(&p->c, l, fd, &o, &g_cbs, p, &d)) fprintf(stderr, "accept: %s\n", d.msg);
}

static void server_start(server *s, kv_net_loop *l, int handshake_ms) {
    memset(s, 0, sizeof *s);
    s->l = l;
    s->handshake_ms = handshake_ms;
    kv_diag d = {0};
    ASSERT_EQ(kv_net_listen("127.0.0.1:0", 16, &s->lfd, s->addr, sizeof s->addr, &d), 0);
    ASSERT_EQ(kv_net_watch_add(l, &s->w, s->lfd, KV_NET_READ, on_accept, s, &d), 0);
}

static void server_stop(server *s) {
    kv_net_watch_del(s->l, &s->w);
    close(s->lfd);
}

static struct sockaddr_in addr_of(const server *s) {
    struct sockaddr_in a = {.sin_family = AF_INET};
    const char *colon = strrchr(s->addr, ':');
    a.sin_port = htons((uint16_t)atoi(colon + 1));
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    return a;
}

/* Dials s with TLS as a client of g_cli, pinning pin_key (NULL = none). */
static void dial(server *s, peer *p, const uint8_t *pin_key) {
    memset(p, 0, sizeof *p);
    p->open_code = 1;
    kv_diag d = {0};
    kv_tls_opts to = {.pin_key = pin_key};
    ASSERT_EQ(kv_tls_new(&p->tls, g_cli, &to, &d), 0);
    kv_net_conn_opts o = conn_opts(p->tls, 5000);
    struct sockaddr_in a = addr_of(s);
    ASSERT_EQ(kv_net_conn_dial(&p->c, s->l, (struct sockaddr *)&a, sizeof a, 2000, &o, &g_cbs, p, &d), 0);
}

/* Runs the loop until *flag is true or ms pass. */
static void run_until(kv_net_loop *l, const bool *flag, int ms) {
    const int64_t t0 = kv_net_now_ms();
    while (!*flag && kv_net_now_ms() - t0 < ms) kv_net_loop_run_once(l, 10, NULL);
}

static void run_until_frames(kv_net_loop *l, const peer *p, int frames, int ms) {
    const int64_t t0 = kv_net_now_ms();
    while (p->frames < frames && !p->closed && kv_net_now_ms() - t0 < ms) kv_net_loop_run_once(l, 10, NULL);
}

static int tcp_connect(const server *s) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = addr_of(s);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* ---- cases ------------------------------------------------------------------------------ */

/* Frames round-trip both ways (a 6 MB one among them, sent while small ones
 * are queued behind it), the peers see each other's keys, and the two ends
 * of a session share an exporter no other session has. */
static void test_loop_roundtrip(void) {
    kv_net_loop *l = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_net_loop_new(&l, &d), 0);
    server s;
    server_start(&s, l, 5000);
    s.pin_key = g_cli_key.pk; /* mutual: the server requires the client's key */
    peer c;
    dial(&s, &c, g_srv_key.pk);
    /* queued before the handshake ends: sent once it does */
    uint8_t small[4 + 100];
    make_frame(small, 100, 7);
    ASSERT_EQ(kv_net_conn_send(c.c, small, sizeof small), 0);
    uint8_t *big = malloc(4 + BIG_FRAME);
    make_frame(big, BIG_FRAME, 9);
    ASSERT_EQ(kv_net_conn_send(c.c, big, 4 + BIG_FRAME), 0);
    uint8_t empty[4];
    make_frame(empty, 0, 0);
    ASSERT_EQ(kv_net_conn_send(c.c, empty, 4), 0);
    for (int i = 0; i < 20; i++) {
        make_frame(small, 100, (uint8_t)i);
        ASSERT_EQ(kv_net_conn_send(c.c, small, sizeof small), 0);
    }
    run_until_frames(l, &c, 23, 20000);
    ASSERT_EQ(c.open_code, 0);
    ASSERT_EQ(c.frames, 23); /* every frame echoed back */
    ASSERT_EQ(c.bad, 0);
    ASSERT_EQ(c.bytes, (4 + 100) * 21 + 4 + BIG_FRAME + 4);
    ASSERT_EQ(s.n, 1);
    peer *sp = &s.peers[0];
    ASSERT_EQ(sp->open_code, 0);
    ASSERT_EQ(sp->frames, 23);
    ASSERT_EQ(sp->bad, 0);
    /* channel binding: equal on both ends */
    ASSERT_EQ(c.exporter_rc, 0);
    ASSERT_EQ(sp->exporter_rc, 0);
    ASSERT_TRUE(memcmp(c.exporter, sp->exporter, 32) == 0);
    /* each side sees the other's key */
    ASSERT_EQ(c.peer_key_rc, 0);
    ASSERT_TRUE(memcmp(c.peer_key, g_srv_key.pk, 32) == 0);
    ASSERT_EQ(sp->peer_key_rc, 0);
    ASSERT_TRUE(memcmp(sp->peer_key, g_cli_key.pk, 32) == 0);
    char fp[65], fp_ctx[65];
    ASSERT_EQ(kv_tls_peer_fingerprint(c.tls, fp), 0);
    kv_tls_ctx_fingerprint(g_srv, fp_ctx);
    ASSERT_STREQ(fp, fp_ctx);

    /* the server speaks first too: a frame from it reaches the client */
    make_frame(small, 100, 42);
    sp->echo = false;
    ASSERT_EQ(kv_net_conn_send(sp->c, big, 4 + BIG_FRAME), 0);
    run_until_frames(l, &c, 24, 20000);
    ASSERT_EQ(c.frames, 24);
    ASSERT_EQ(c.bad, 0);

    /* a second session: another exporter value */
    peer c2;
    dial(&s, &c2, g_srv_key.pk);
    const int64_t t0 = kv_net_now_ms();
    while ((c2.open_code == 1 || s.n < 2 || s.peers[1].open_code == 1) && kv_net_now_ms() - t0 < 5000)
        kv_net_loop_run_once(l, 10, NULL);
    ASSERT_EQ(c2.open_code, 0);
    ASSERT_EQ(s.n, 2);
    ASSERT_TRUE(memcmp(c2.exporter, s.peers[1].exporter, 32) == 0);
    ASSERT_TRUE(memcmp(c2.exporter, c.exporter, 32) != 0);

    kv_net_conn_close(c.c, 0, NULL);
    kv_net_conn_close(c2.c, 0, NULL);
    run_until(l, &sp->closed, 3000);
    ASSERT_TRUE(sp->closed);
    ASSERT_EQ(sp->close_code, 0); /* a clean close between frames */
    if (sp->close_code) fprintf(stderr, "why: %s\n", sp->why);
    free(big);
    server_stop(&s);
    kv_net_loop_free(l);
}

/* Frames that sit decoded inside the TLS layer, where no socket readiness
 * announces them: a 10 KB frame behind a held 100-byte one, both in one TLS
 * record that is larger than the receive buffer's first size (4 KB), so
 * most of the record waits in the session while the first frame is held;
 * releasing it delivers the rest without any new byte on the socket. */
static void test_hold_with_pending(void) {
    kv_net_loop *l = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_net_loop_new(&l, &d), 0);
    server s;
    server_start(&s, l, 5000);
    s.hold_first = true;
    peer c;
    dial(&s, &c, g_srv_key.pk);
    uint8_t *buf = malloc(4 + 100 + 4 + 10000);
    make_frame(buf, 100, 1);
    make_frame(buf + 104, 10000, 2);
    ASSERT_EQ(kv_net_conn_send(c.c, buf, 4 + 100 + 4 + 10000), 0); /* one write: one record */
    const int64_t t0 = kv_net_now_ms();
    while ((s.n < 1 || s.peers[0].frames < 1) && kv_net_now_ms() - t0 < 5000) kv_net_loop_run_once(l, 10, NULL);
    ASSERT_EQ(s.n, 1);
    peer *sp = &s.peers[0];
    for (int i = 0; i < 20; i++) kv_net_loop_run_once(l, 10, NULL);
    ASSERT_EQ(sp->frames, 1); /* held: nothing more is delivered */
    kv_net_conn_release(sp->c);
    while (sp->frames < 2 && kv_net_now_ms() - t0 < 5000) kv_net_loop_run_once(l, 10, NULL);
    ASSERT_EQ(sp->frames, 2);
    ASSERT_EQ(sp->bad, 0);
    ASSERT_EQ(sp->bytes, 104 + 10004);
    run_until_frames(l, &c, 2, 5000); /* both echoed */
    ASSERT_EQ(c.frames, 2);
    ASSERT_EQ(c.bad, 0);
    free(buf);
    kv_net_conn_close(c.c, 0, NULL);
    run_until(l, &sp->closed, 2000);
    server_stop(&s);
    kv_net_loop_free(l);
}

/* A client that pins another key than the server's fails with KV_EAUTH and
 * says so; a server that requires a client key refuses another client; the
 * server then serves a right client. */
static void test_pin_mismatch(void) {
    kv_net_loop *l = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_net_loop_new(&l, &d), 0);
    server s;
    server_start(&s, l, 5000);
    peer c;
    dial(&s, &c, g_other_key.pk);
    run_until(l, &c.closed, 5000);
    ASSERT_EQ(c.open_code, KV_EAUTH);
    ASSERT_EQ(c.close_code, KV_EAUTH);
    ASSERT_TRUE(strstr(c.why, "not the pinned") != NULL);
    run_until(l, &s.peers[0].closed, 3000);
    ASSERT_TRUE(s.peers[0].closed);
    ASSERT_TRUE(s.peers[0].close_code < 0);
    ASSERT_EQ(s.peers[0].frames, 0);

    /* the server pins a client key this client does not hold */
    s.pin_key = g_other_key.pk;
    peer c2;
    dial(&s, &c2, g_srv_key.pk);
    run_until(l, &s.peers[1].closed, 5000);
    ASSERT_EQ(s.peers[1].close_code, KV_EAUTH);
    ASSERT_TRUE(strstr(s.peers[1].why, "not the pinned") != NULL);
    run_until(l, &c2.closed, 5000);
    ASSERT_TRUE(c2.closed);
    ASSERT_EQ(c2.frames, 0);

    /* and a right pair still works */
    s.pin_key = NULL;
    peer c3;
    dial(&s, &c3, g_srv_key.pk);
    uint8_t f[4 + 50];
    make_frame(f, 50, 3);
    ASSERT_EQ(kv_net_conn_send(c3.c, f, sizeof f), 0);
    run_until_frames(l, &c3, 1, 5000);
    ASSERT_EQ(c3.frames, 1);
    ASSERT_EQ(c3.bad, 0);
    kv_net_conn_close(c3.c, 0, NULL);
    run_until(l, &c3.closed, 1000);
    server_stop(&s);
    kv_net_loop_free(l);
}

/* Plaintext to the TLS port closes that connection with a reason that says
 * it is not TLS; a client that opens TCP and says nothing is closed at the
 * handshake deadline; the server serves the next TLS client meanwhile. */
static void test_plaintext_and_deadline(void) {
    kv_net_loop *l = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_net_loop_new(&l, &d), 0);
    server s;
    server_start(&s, l, 400);
    int silent = tcp_connect(&s); /* never sends a byte */
    ASSERT_TRUE(silent >= 0);
    const int64_t t0 = kv_net_now_ms();
    while (s.n < 1 && kv_net_now_ms() - t0 < 2000) kv_net_loop_run_once(l, 10, NULL);
    int plain = tcp_connect(&s);
    ASSERT_TRUE(plain >= 0);
    uint8_t f[4 + 60];
    make_frame(f, 60, 5); /* a framed message, as a plaintext client would send */
    ASSERT_EQ(send(plain, f, sizeof f, MSG_NOSIGNAL), (ssize_t)sizeof f);
    while (s.n < 2 && kv_net_now_ms() - t0 < 2000) kv_net_loop_run_once(l, 10, NULL);
    run_until(l, &s.peers[1].closed, 2000);
    ASSERT_TRUE(s.peers[1].closed);
    ASSERT_EQ(s.peers[1].close_code, KV_EPROTO);
    ASSERT_TRUE(strstr(s.peers[1].why, "does not speak TLS") != NULL);
    ASSERT_EQ(s.peers[1].open_code, KV_EPROTO);
    ASSERT_EQ(s.peers[1].frames, 0);
    /* the plaintext client sees the connection end */
    uint8_t buf[256];
    ssize_t k;
    do k = recv(plain, buf, sizeof buf, 0);
    while (k > 0);
    ASSERT_TRUE(k <= 0);

    /* a TLS client is served while the silent one still waits */
    peer c;
    dial(&s, &c, g_srv_key.pk);
    ASSERT_EQ(kv_net_conn_send(c.c, f, sizeof f), 0);
    run_until_frames(l, &c, 1, 3000);
    ASSERT_EQ(c.frames, 1);
    ASSERT_TRUE(!s.peers[0].closed || kv_net_now_ms() - t0 >= 350);

    /* the silent one is closed at its deadline (400 ms), not before */
    run_until(l, &s.peers[0].closed, 3000);
    const int64_t waited = kv_net_now_ms() - t0;
    ASSERT_TRUE(s.peers[0].closed);
    ASSERT_EQ(s.peers[0].close_code, KV_ETIMEOUT);
    ASSERT_TRUE(strstr(s.peers[0].why, "handshake not complete within 400 ms") != NULL);
    ASSERT_TRUE(waited >= 390 && waited < 2500);
    do k = recv(silent, buf, sizeof buf, 0);
    while (k > 0);
    ASSERT_EQ(k, 0); /* closed by the server */
    ASSERT_TRUE(!c.closed); /* the served client is untouched */
    close(silent);
    close(plain);
    kv_net_conn_close(c.c, 0, NULL);
    run_until(l, &c.closed, 1000);
    server_stop(&s);
    kv_net_loop_free(l);
}

/* Runs argv with stdin from /dev/null and stdout + stderr into out_path,
 * serving the loop meanwhile; returns the exit status (or -1). */
static int run_tool(kv_net_loop *l, char *const argv[], const char *out_path, int ms) {
    pid_t pid = fork();
    if (pid == 0) {
        int in = open("/dev/null", O_RDONLY), out = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(in, 0), dup2(out, 1), dup2(out, 2);
        execvp(argv[0], argv);
        _exit(127);
    }
    if (pid < 0) return -1;
    const int64_t t0 = kv_net_now_ms();
    int st = 0;
    for (;;) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        if (kv_net_now_ms() - t0 > ms) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
            return -1;
        }
        kv_net_loop_run_once(l, 10, NULL);
    }
}

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *b = calloc(1, 1 << 16);
    size_t n = fread(b, 1, (1 << 16) - 1, f);
    b[n] = 0;
    fclose(f);
    return b;
}

/* `openssl s_client -tls1_2` is refused with a reason naming TLS 1.3, and
 * `openssl s_client -tls1_3 -keymatexport` computes the exporter our server
 * computed for that session (an independent implementation of RFC 8446
 * section 7.5 with our label). */
static void test_openssl_clients(void) {
    kv_net_loop *l = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_net_loop_new(&l, &d), 0);
    server s;
    server_start(&s, l, 5000);
    char out[] = "/tmp/kv_test_tls_XXXXXX";
    int ofd = mkstemp(out);
    ASSERT_TRUE(ofd >= 0);
    close(ofd);
    char *old[] = {"openssl", "s_client", "-connect", s.addr, "-tls1_2", NULL};
    int st = run_tool(l, old, out, 15000);
    ASSERT_TRUE(st != 0 && st != 127 && st != -1);
    run_until(l, &s.peers[0].closed, 3000);
    ASSERT_EQ(s.n, 1);
    ASSERT_EQ(s.peers[0].close_code, KV_EPROTO);
    ASSERT_TRUE(strstr(s.peers[0].why, "no TLS 1.3") != NULL);
    if (!strstr(s.peers[0].why, "no TLS 1.3")) fprintf(stderr, "why: %s\n", s.peers[0].why);

    char *cur[] = {"openssl", "s_client", "-connect", s.addr, "-tls1_3", "-keymatexport", KV_TLS_EXPORTER_LABEL,
                   "-keymatexportlen", "32", NULL};
    st = run_tool(l, cur, out, 15000);
    ASSERT_EQ(st, 0);
    run_until(l, &s.peers[1].closed, 3000);
    ASSERT_EQ(s.n, 2);
    ASSERT_EQ(s.peers[1].open_code, 0);
    ASSERT_EQ(s.peers[1].exporter_rc, 0);
    char want[65];
    kv_hex(s.peers[1].exporter, 32, want);
    char *txt = slurp(out);
    const char *km = txt ? strstr(txt, "Keying material: ") : NULL;
    ASSERT_TRUE(km != NULL);
    if (km) {
        char got[65] = {0};
        for (int i = 0; i < 64 && km[17 + i]; i++) got[i] = (char)tolower((unsigned char)km[17 + i]);
        ASSERT_STREQ(got, want);
    }
    ASSERT_EQ(s.peers[1].peer_key_rc, KV_ENOTFOUND); /* s_client sent no certificate */
    free(txt);
    unlink(out);
    server_stop(&s);
    kv_net_loop_free(l);
}

/* The fingerprint of a PEM written out equals the openssl CLI's SHA-256 of
 * the certificate's SubjectPublicKeyInfo; the certificate is Ed25519 with
 * the node key; a context loaded from those files has the same fingerprint,
 * and a key file that is not the certificate's is refused by name. */
static void test_fingerprint_cli(void) {
    char dir[] = "/tmp/kv_test_tls_fp_XXXXXX";
    ASSERT_TRUE(mkdtemp(dir) != NULL);
    char cert[128], key[128], key2[128], der[128], cmd[1024];
    snprintf(cert, sizeof cert, "%s/cert.pem", dir);
    snprintf(key, sizeof key, "%s/key.pem", dir);
    snprintf(key2, sizeof key2, "%s/other.pem", dir);
    snprintf(der, sizeof der, "%s/cert.der", dir);
    kv_diag d = {0};
    ASSERT_EQ(kv_tls_ctx_write_pem(g_srv, cert, key, &d), 0);
    char fp[65], fp_file[65];
    kv_tls_ctx_fingerprint(g_srv, fp);
    ASSERT_EQ(kv_tls_fingerprint_pem_file(cert, fp_file, &d), 0);
    ASSERT_STREQ(fp_file, fp);

    snprintf(cmd, sizeof cmd,
             "openssl x509 -pubkey -noout -in %s | openssl pkey -pubin -outform der | sha256sum | cut -c1-64", cert);
    FILE *p = popen(cmd, "r");
    char ref[128] = {0};
    ASSERT_TRUE(p && fgets(ref, sizeof ref, p));
    if (p) pclose(p);
    ref[strcspn(ref, "\n")] = 0;
    ASSERT_EQ(strlen(ref), 64);
    ASSERT_STREQ(fp, ref);

    /* the certificate as the CLI reads it: Ed25519, our key, self-issued */
    char hex[65];
    kv_hex(g_srv_key.pk, 32, hex);
    snprintf(cmd, sizeof cmd, "openssl x509 -noout -text -in %s", cert);
    p = popen(cmd, "r");
    char *txt = calloc(1, 1 << 16);
    size_t n = p ? fread(txt, 1, (1 << 16) - 1, p) : 0;
    if (p) pclose(p);
    txt[n] = 0;
    ASSERT_TRUE(strstr(txt, "Public Key Algorithm: ED25519") != NULL);
    ASSERT_TRUE(strstr(txt, "Signature Algorithm: ED25519") != NULL);
    ASSERT_TRUE(strstr(txt, hex) != NULL); /* CN */
    free(txt);
    snprintf(cmd, sizeof cmd, "openssl verify -CAfile %s %s >/dev/null 2>&1", cert, cert);
    ASSERT_EQ(system(cmd), 0); /* a valid self-signature */

    /* DER: the same fingerprint; trailing bytes or garbage are refused */
    snprintf(cmd, sizeof cmd, "openssl x509 -in %s -outform der -out %s", cert, der);
    ASSERT_EQ(system(cmd), 0);
    FILE *f = fopen(der, "rb");
    uint8_t buf[4096];
    size_t dn = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    char fp_der[65];
    ASSERT_EQ(kv_tls_fingerprint_der(buf, dn, fp_der, &d), 0);
    ASSERT_STREQ(fp_der, fp);
    ASSERT_EQ(kv_tls_fingerprint_der(buf, dn - 1, fp_der, &d), KV_EFORMAT);
    buf[dn] = 0;
    ASSERT_EQ(kv_tls_fingerprint_der(buf, dn + 1, fp_der, &d), KV_EFORMAT);

    /* loading the files back */
    kv_tls_ctx *x = NULL;
    ASSERT_EQ(kv_tls_ctx_load(&x, cert, key, &d), 0);
    char fp_load[65] = {0};
    if (x) kv_tls_ctx_fingerprint(x, fp_load);
    ASSERT_STREQ(fp_load, fp);
    kv_tls_ctx_free(x);
    ASSERT_EQ(kv_tls_ctx_write_pem(g_cli, der, key2, &d), 0); /* another key */
    x = NULL;
    ASSERT_EQ(kv_tls_ctx_load(&x, cert, key2, &d), KV_EFORMAT);
    ASSERT_TRUE(strstr(d.msg, "is not the key of") != NULL);
    ASSERT_EQ(kv_tls_ctx_load(&x, key2, key2, &d), KV_EFORMAT); /* a key is no certificate */
    ASSERT_TRUE(strstr(d.msg, "--tls-cert") != NULL);
    snprintf(cmd, sizeof cmd, "%s/missing.pem", dir);
    ASSERT_EQ(kv_tls_ctx_load(&x, cmd, key, &d), KV_ENOTFOUND);
    ASSERT_EQ(kv_tls_fingerprint_pem_file(cmd, fp_file, &d), KV_ENOTFOUND);
    ASSERT_TRUE(x == NULL);
    /* the same from PEM in memory (a hub's certificate on its relay port):
       the fingerprint openssl computed above; a key that is not the
       certificate's, a key for a certificate, no PEM and an oversized one refused */
    char *pc = calloc(1, KV_TLS_MAX_PEM + 2), *pk = calloc(1, KV_TLS_MAX_PEM + 2), *pk2 = calloc(1, 8192);
    FILE *fc = fopen(cert, "rb"), *fk = fopen(key, "rb"), *fk2 = fopen(key2, "rb");
    ASSERT_TRUE(fc && fk && fk2 && pc && pk && pk2);
    if (fc) {
        ASSERT_TRUE(fread(pc, 1, 8000, fc) > 0);
        fclose(fc);
    }
    if (fk) {
        ASSERT_TRUE(fread(pk, 1, 8000, fk) > 0);
        fclose(fk);
    }
    if (fk2) {
        ASSERT_TRUE(fread(pk2, 1, 8000, fk2) > 0);
        fclose(fk2);
    }
    x = NULL;
    ASSERT_EQ(kv_tls_ctx_from_pem(&x, pc, pk, &d), 0);
    char fp_mem[65] = {0};
    if (x) kv_tls_ctx_fingerprint(x, fp_mem);
    ASSERT_STREQ(fp_mem, ref);
    kv_tls_ctx_free(x);
    x = NULL;
    ASSERT_EQ(kv_tls_ctx_from_pem(&x, pc, pk2, &d), KV_EFORMAT);
    ASSERT_TRUE(strstr(d.msg, "is not the key of") != NULL);
    ASSERT_EQ(kv_tls_ctx_from_pem(&x, pk2, pk2, &d), KV_EFORMAT);
    ASSERT_TRUE(strstr(d.msg, "no PEM certificate") != NULL);
    ASSERT_EQ(kv_tls_ctx_from_pem(&x, "garbage", pk, &d), KV_EFORMAT);
    ASSERT_EQ(kv_tls_ctx_from_pem(&x, NULL, pk, &d), KV_EINVAL);
    memset(pk, 'A', KV_TLS_MAX_PEM + 1);
    ASSERT_EQ(kv_tls_ctx_from_pem(&x, pc, pk, &d), KV_EINVAL);
    ASSERT_TRUE(x == NULL);
    free(pc);
    free(pk);
    free(pk2);
    /* as a user writes it */
    char up[160], parsed[65];
    snprintf(up, sizeof up, "SHA256:%s", ref);
    for (char *q = up + 7; *q; q++) *q = (char)toupper((unsigned char)*q);
    ASSERT_EQ(kv_tls_fingerprint_parse(up, strlen(up), parsed, &d), 0);
    ASSERT_STREQ(parsed, fp);
    ASSERT_EQ(kv_tls_fingerprint_parse(ref, 64, parsed, &d), 0);
    ASSERT_STREQ(parsed, fp);
    ASSERT_EQ(kv_tls_fingerprint_parse(ref, 63, parsed, &d), KV_EINVAL);
    ASSERT_TRUE(strstr(d.msg, "63 characters") != NULL);
    up[20] = 'g';
    ASSERT_EQ(kv_tls_fingerprint_parse(up, strlen(up), parsed, &d), KV_EINVAL);
    ASSERT_EQ(kv_tls_fingerprint_parse("sha1:00", 7, parsed, &d), KV_EINVAL);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    ASSERT_EQ(system(cmd), 0);
}

/* ---- blocking clients against a loop server on its own thread --------------------------------- */

static atomic_int g_stop;
static void *loop_thread(void *arg) {
    kv_net_loop *l = arg;
    while (!atomic_load(&g_stop)) kv_net_loop_run_once(l, 10, NULL);
    return NULL;
}

/* kv_tls_dial pinning the server's fingerprint, a 3 MB frame written and
 * read back whole, the exporter equal to the server's; a wrong fingerprint
 * fails with KV_EAUTH; a read with nothing coming times out. */
static void test_blocking(void) {
    kv_net_loop *l = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_net_loop_new(&l, &d), 0);
    server s;
    server_start(&s, l, 5000);
    atomic_store(&g_stop, 0);
    pthread_t th;
    ASSERT_EQ(pthread_create(&th, NULL, loop_thread, l), 0);

    char fp[65];
    kv_tls_ctx_fingerprint(g_srv, fp);
    kv_tls_opts o = {.pin_sha256 = fp};
    kv_tls *t = NULL;
    int fd = -1;
    ASSERT_EQ(kv_tls_dial(&t, &fd, g_cli, &o, s.addr, 3000, &d), 0);
    const size_t n = 3u << 20;
    uint8_t *out = malloc(4 + n), *in = malloc(4 + n);
    make_frame(out, (uint32_t)n, 11);
    ASSERT_EQ(kv_tls_write_full(t, out, 4 + n, 10000, &d), 0);
    size_t got = 0;
    ASSERT_EQ(kv_tls_read_full(t, in, 4 + n, &got, 10000, &d), 0);
    ASSERT_EQ(got, 4 + n);
    ASSERT_TRUE(memcmp(in, out, 4 + n) == 0);
    uint8_t ex[32];
    ASSERT_EQ(kv_tls_exporter(t, ex), 0);
    /* nothing more comes: the read ends at its deadline */
    const int64_t t0 = kv_net_now_ms();
    ASSERT_EQ(kv_tls_read_full(t, in, 4, &got, 200, &d), KV_ETIMEOUT);
    ASSERT_TRUE(kv_net_now_ms() - t0 >= 190);
    ASSERT_EQ(got, 0);
    uint8_t srv_key[32];
    ASSERT_EQ(kv_tls_peer_key(t, srv_key), 0);
    ASSERT_TRUE(memcmp(srv_key, g_srv_key.pk, 32) == 0);
    kv_tls_free(t);
    close(fd);

    /* a wrong fingerprint */
    char bad[65];
    kv_tls_ctx_fingerprint(g_cli, bad);
    o.pin_sha256 = bad;
    ASSERT_EQ(kv_tls_dial(&t, &fd, g_cli, &o, s.addr, 3000, &d), KV_EAUTH);
    ASSERT_TRUE(strstr(d.msg, "fingerprint") != NULL);
    ASSERT_TRUE(t == NULL && fd == -1);
    o.pin_sha256 = "ABCD";
    ASSERT_EQ(kv_tls_dial(&t, &fd, g_cli, &o, s.addr, 3000, &d), KV_EINVAL);

    atomic_store(&g_stop, 1);
    pthread_join(th, NULL);
    ASSERT_TRUE(s.n >= 1);
    ASSERT_TRUE(memcmp(s.peers[0].exporter, ex, 32) == 0);
    ASSERT_EQ(s.peers[0].frames, 1);
    free(out);
    free(in);
    server_stop(&s);
    kv_net_loop_free(l);
}

/* ---- a man in the middle that flips one byte ---------------------------------------------------- */

typedef struct flipper {
    int lfd;                 /* listening (blocking) */
    char addr[64];
    const char *target;      /* the server */
    size_t flip_at;          /* offset in the client-to-server stream whose byte is flipped */
    size_t forwarded;        /* client-to-server bytes forwarded */
} flipper;

/* Accepts one client, connects to the target and forwards both ways until
 * either side closes, flipping one bit of the byte at flip_at. */
static void *flipper_thread(void *arg) {
    flipper *f = arg;
    int a = accept(f->lfd, NULL, NULL), b = -1;
    if (a < 0 || kv_link_connect(f->target, 2000, &b, NULL)) goto out;
    uint8_t buf[16384];
    const int64_t t0 = kv_net_now_ms();
    while (kv_net_now_ms() - t0 < 10000) {
        struct pollfd pf[2] = {{.fd = a, .events = POLLIN}, {.fd = b, .events = POLLIN}};
        if (poll(pf, 2, 100) <= 0) continue;
        if (pf[0].revents) {
            ssize_t k = recv(a, buf, sizeof buf, 0);
            if (k <= 0) break;
            if (f->flip_at >= f->forwarded && f->flip_at < f->forwarded + (size_t)k)
                buf[f->flip_at - f->forwarded] ^= 1;
            f->forwarded += (size_t)k;
            if (send(b, buf, (size_t)k, MSG_NOSIGNAL) != k) break;
        }
        if (pf[1].revents) {
            ssize_t k = recv(b, buf, sizeof buf, 0);
            if (k <= 0 || send(a, buf, (size_t)k, MSG_NOSIGNAL) != k) break;
        }
    }
out:
    if (a >= 0) close(a);
    if (b >= 0) close(b);
    return NULL;
}

/* One byte of application data altered on the way: the server's read fails
 * its record authentication and closes that connection with a reason that
 * says TLS, delivering no frame; nothing altered reaches the owner. And a
 * blocking dial to a port that accepts TCP but never speaks TLS ends at its
 * deadline. */
static void test_tampered_and_silent_server(void) {
    kv_net_loop *l = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_net_loop_new(&l, &d), 0);
    server s;
    server_start(&s, l, 5000);
    flipper f = {.target = s.addr, .flip_at = 3000};
    ASSERT_EQ(kv_net_listen("127.0.0.1:0", 4, &f.lfd, f.addr, sizeof f.addr, &d), 0);
    int fl = fcntl(f.lfd, F_GETFL);
    fcntl(f.lfd, F_SETFL, fl & ~O_NONBLOCK);
    atomic_store(&g_stop, 0);
    pthread_t th, fth;
    ASSERT_EQ(pthread_create(&th, NULL, loop_thread, l), 0);
    ASSERT_EQ(pthread_create(&fth, NULL, flipper_thread, &f), 0);

    kv_tls_opts o = {.pin_key = g_srv_key.pk};
    kv_tls *t = NULL;
    int fd = -1;
    ASSERT_EQ(kv_tls_dial(&t, &fd, g_cli, &o, f.addr, 3000, &d), 0);
    const size_t n = 64u << 10;
    uint8_t *out = malloc(4 + n);
    make_frame(out, (uint32_t)n, 13);
    ASSERT_EQ(kv_tls_write_full(t, out, 4 + n, 5000, &d), 0);
    size_t got = 0;
    ASSERT_TRUE(kv_tls_read_full(t, out, 4 + n, &got, 5000, &d) != 0); /* no echo: closed */
    ASSERT_EQ(got, 0);
    kv_tls_free(t);
    close(fd);
    pthread_join(fth, NULL);
    ASSERT_TRUE(f.forwarded > f.flip_at); /* the flip happened, inside application data */

    /* a listener that never accepts: TCP connects (backlog), TLS never answers */
    int mute = -1;
    char mute_addr[64];
    ASSERT_EQ(kv_net_listen("127.0.0.1:0", 4, &mute, mute_addr, sizeof mute_addr, &d), 0);
    const int64_t t0 = kv_net_now_ms();
    ASSERT_EQ(kv_tls_dial(&t, &fd, g_cli, &o, mute_addr, 300, &d), KV_ETIMEOUT);
    ASSERT_TRUE(strstr(d.msg, "TLS handshake not complete") != NULL);
    ASSERT_TRUE(kv_net_now_ms() - t0 >= 290 && kv_net_now_ms() - t0 < 2000);
    close(mute);

    atomic_store(&g_stop, 1);
    pthread_join(th, NULL);
    ASSERT_EQ(s.n, 1);
    ASSERT_TRUE(s.peers[0].closed);
    ASSERT_EQ(s.peers[0].open_code, 0); /* the handshake itself was untouched */
    ASSERT_EQ(s.peers[0].frames, 0);
    ASSERT_EQ(s.peers[0].close_code, KV_EIO);
    ASSERT_TRUE(strstr(s.peers[0].why, "TLS read") != NULL);
    fprintf(stderr, "tampered: %s\n", s.peers[0].why);
    free(out);
    close(f.lfd);
    server_stop(&s);
    kv_net_loop_free(l);
}

static const kvt_case cases[] = {
    KVT_CASE(test_loop_roundtrip), KVT_CASE(test_hold_with_pending), KVT_CASE(test_pin_mismatch),
    KVT_CASE(test_plaintext_and_deadline),
    KVT_CASE(test_openssl_clients), KVT_CASE(test_fingerprint_cli), KVT_CASE(test_blocking),
    KVT_CASE(test_tampered_and_silent_server),
};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
