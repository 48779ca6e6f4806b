/* kv-test-labels: net */
/* The network layer (include/kvasir/net.h) on its own: timers fire in
 * order and can be stopped or re-armed; frames are cut exactly whatever
 * the byte boundaries (pipelined in one write, or one byte at a time);
 * a held frame stops input until released; oversized frames, stalled frames
 * and an exhausted budget close the connection with the right code after
 * the owner could queue a last message; a pluggable transport sees every
 * byte; a dialed and an accepted connection behave the same, and a close
 * flushes what was queued. Everything on one loop thread, over socketpairs
 * or 127.0.0.1 with a kernel-chosen port, bounded in time. */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvasir/net.h"
#include "kvtest.h"

/* ---- timers ---------------------------------------------------------------------- */

static int g_order[16], g_n_fired;

static void on_timer(kv_net_loop *l, kv_net_timer *t) {
    (void)l;
    if (g_n_fired < 16) g_order[g_n_fired++] = (int)(intptr_t)t->data;
}

static int g_repeats;
static void on_repeat(kv_net_loop *l, kv_net_timer *t) {
    if (++g_repeats < 3) kv_net_timer_start(l, t, 5);
}

static void test_timers(void) {
    kv_net_loop *l = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_net_loop_new(&l, &d), 0);
    if (!l) return;
    kv_net_timer t[6], rep;
    const int delay[6] = {50, 10, 30, 20, 40, 60};
    for (int i = 0; i < 6; i++) {
        kv_net_timer_init(&t[i], on_timer, (void *)(intptr_t)i);
        ASSERT_EQ(kv_net_timer_start(l, &t[i], delay[i]), 0);
    }
    kv_net_timer_stop(l, &t[4]);                 /* never fires */
    ASSERT_TRUE(!kv_net_timer_armed(&t[4]));
    ASSERT_EQ(kv_net_timer_start(l, &t[5], 5), 0); /* re-armed earlier: fires first */
    kv_net_timer_init(&rep, on_repeat, NULL);
    kv_net_timer_start(l, &rep, 5);
    const int64_t t0 = kv_net_now_ms();
    while (kv_net_now_ms() - t0 < 200) kv_net_loop_run_once(l, 100, &d);
    ASSERT_EQ(g_n_fired, 5);
    const int want[5] = {5, 1, 3, 2, 0};
    for (int i = 0; i < 5; i++) ASSERT_EQ(g_order[i], want[i]);
    ASSERT_EQ(g_repeats, 3);
    kv_net_loop_free(l);
}

/* ---- a framed echo peer: frames are u32 length + bytes ------------------------------- */

typedef struct peer {
    int frames;            /* frames delivered */
    size_t bytes;          /* their total size */
    int hold_first;        /* hold the first frame (KV_NET_HOLD) */
    bool echo;             /* send each frame back */
    int err_code;          /* on_error's code */
    int close_code;        /* on_close's code */
    bool closed;
    char why[256];
    kv_net_conn *c;
} peer;

static uint32_t rd32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

static int pf_len(kv_net_conn *c, const uint8_t *h, size_t *total, kv_diag *d) {
    (void)c;
    uint32_t n = rd32(h);
    if (n == 0xffffffffu) return kv_fail(d, KV_EPROTO, "bad header");
    *total = 4 + (size_t)n;
    return 0;
}

static int pf_frame(kv_net_conn *c, const uint8_t *f, size_t n) {
    peer *p = kv_net_conn_data(c);
    p->frames++;
    p->bytes += n;
    if (p->echo) kv_net_conn_send(c, f, n);
    if (p->hold_first && p->frames == 1) return KV_NET_HOLD;
    return 0;
}

static void pf_error(kv_net_conn *c, int code, const char *why) {
    peer *p = kv_net_conn_data(c);
    p->err_code = code;
    kv_net_conn_send(c, "\x03\x00\x00\x00" "bye", 7); /* the last word still goes out */
    (void)why;
}

static void pf_close(kv_net_conn *c, int code, const char *why) {
    peer *p = kv_net_conn_data(c);
    p->closed = true;
    p->close_code = code;
    snprintf(p->why, sizeof p->why, "%s", why ? why : "");
}

static const kv_net_conn_cbs g_cbs = {.frame_len = pf_len, .on_frame = pf_frame, .on_error = pf_error,
                                      .on_close = pf_close};

static kv_net_conn_opts opts(size_t max_frame) {
    kv_net_conn_opts o = {.header = 4, .max_frame = max_frame, .tx_max = 1 << 20, .frame_timeout_ms = 150,
                          .write_timeout_ms = 1000, .linger_ms = 50};
    return o;
}

static void frame(uint8_t *out, uint32_t n, uint8_t fill) {
    out[0] = (uint8_t)n, out[1] = (uint8_t)(n >> 8), out[2] = (uint8_t)(n >> 16), out[3] = (uint8_t)(n >> 24);
    memset(out + 4, fill, n);
}

static void spin(kv_net_loop *l, int ms) {
    const int64_t t0 = kv_net_now_ms();
    while (kv_net_now_ms() - t0 < ms) kv_net_loop_run_once(l, 10, NULL);
}

/* Reads what the raw end has, up to cap, for a while. */
static size_t drain(int fd, uint8_t *buf, size_t cap, kv_net_loop *l, int ms) {
    size_t got = 0;
    const int64_t t0 = kv_net_now_ms();
    while (kv_net_now_ms() - t0 < ms && got < cap) {
        kv_net_loop_run_once(l, 5, NULL);
        ssize_t k = recv(fd, buf + got, cap - got, MSG_DONTWAIT);
        if (k > 0) got += (size_t)k;
        if (k == 0) break;
    }
    return got;
}

static void test_framing(void) {
    kv_net_loop *l = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_net_loop_new(&l, &d), 0);
    int sv[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    peer p = {.echo = true};
    kv_net_conn_opts o = opts(1 << 20);
    ASSERT_EQ(kv_net_conn_new(&p.c, l, sv[0], &o, &g_cbs, &p, &d), 0);
    /* three frames in one write, then a 70000-byte one a few bytes at a time */
    static uint8_t buf[80000], back[160000];
    frame(buf, 0, 0);
    frame(buf + 4, 10, 'a');
    frame(buf + 18, 3, 'b');
    ASSERT_EQ(write(sv[1], buf, 25), 25);
    spin(l, 20);
    ASSERT_EQ(p.frames, 3);
    ASSERT_EQ(p.bytes, 25);
    frame(buf, 70000, 'c');
    for (size_t off = 0; off < 70004;) {
        size_t k = off < 64 ? 1 : 7000;
        if (off + k > 70004) k = 70004 - off;
        ASSERT_EQ(write(sv[1], buf + off, k), (ssize_t)k);
        off += k;
        kv_net_loop_run_once(l, 0, NULL);
    }
    size_t got = drain(sv[1], back, 25 + 70004, l, 500);
    ASSERT_EQ(p.frames, 4);
    ASSERT_EQ(got, 25 + 70004);
    ASSERT_TRUE(!memcmp(back + 25, buf, 70004)); /* echoed exactly */
    ASSERT_TRUE(kv_net_conn_mem(p.c) <= (1u << 17) + (1u << 18));
    /* a held frame: the next one is not delivered until released */
    p.hold_first = 1;
    p.frames = 0;
    frame(buf, 5, 'x');
    frame(buf + 9, 5, 'y');
    ASSERT_EQ(write(sv[1], buf, 18), 18);
    spin(l, 30);
    ASSERT_EQ(p.frames, 1);
    kv_net_conn_release(p.c);
    spin(l, 30);
    ASSERT_EQ(p.frames, 2);
    ASSERT_EQ(drain(sv[1], back, 18, l, 200), 18);
    /* the peer closes between frames: code 0 */
    close(sv[1]);
    spin(l, 50);
    ASSERT_TRUE(p.closed);
    ASSERT_EQ(p.close_code, 0);
    kv_net_loop_free(l);
}

/* kv_net_conn_commit_now: a frame queued on an idle connection is in the
 * socket before the loop runs; one larger than the socket takes is
 * finished by the loop, and a frame committed behind it waits its turn
 * (the bytes arrive whole and in order). */
static void test_commit_now(void) {
    kv_net_loop *l = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_net_loop_new(&l, &d), 0);
    int sv[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    const int small = 4096;
    ASSERT_EQ(setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof small), 0);
    peer p = {0};
    kv_net_conn_opts o = opts(1 << 20);
    ASSERT_EQ(kv_net_conn_new(&p.c, l, sv[0], &o, &g_cbs, &p, &d), 0);
    spin(l, 5);
    static uint8_t want[300000], back[300000];
    uint8_t *q = kv_net_conn_reserve(p.c, 14);
    ASSERT_TRUE(q != NULL);
    frame(q, 10, 'n');
    memcpy(want, q, 14);
    kv_net_conn_commit_now(p.c, 14);
    ASSERT_EQ(kv_net_conn_pending(p.c), 0); /* written at once */
    ASSERT_EQ(recv(sv[1], back, sizeof back, MSG_DONTWAIT), 14);
    ASSERT_TRUE(!memcmp(back, want, 14));
    /* 200000 bytes into a small socket: the rest is the loop's */
    q = kv_net_conn_reserve(p.c, 200004);
    ASSERT_TRUE(q != NULL);
    frame(q, 200000, 'b');
    memcpy(want, q, 200004);
    kv_net_conn_commit_now(p.c, 200004);
    ASSERT_TRUE(kv_net_conn_pending(p.c) > 0 && kv_net_conn_pending(p.c) < 200004);
    q = kv_net_conn_reserve(p.c, 9); /* behind it: queued, not written ahead */
    ASSERT_TRUE(q != NULL);
    frame(q, 5, 'z');
    memcpy(want + 200004, q, 9);
    kv_net_conn_commit_now(p.c, 9);
    const size_t got = drain(sv[1], back, 200013, l, 2000);
    ASSERT_EQ(got, 200013);
    ASSERT_TRUE(!memcmp(back, want, 200013));
    ASSERT_EQ(kv_net_conn_pending(p.c), 0);
    ASSERT_TRUE(!p.closed);
    close(sv[1]);
    spin(l, 30);
    kv_net_loop_free(l);
}

static void test_limits(void) {
    kv_net_loop *l = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_net_loop_new(&l, &d), 0);
    uint8_t buf[64], back[64];
    /* a header announcing more than max_frame: refused before any payload is buffered */
    {
        int sv[2];
        ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
        peer p = {0};
        kv_net_conn_opts o = opts(1000);
        ASSERT_EQ(kv_net_conn_new(&p.c, l, sv[0], &o, &g_cbs, &p, &d), 0);
        frame(buf, 4, 0);
        buf[0] = 0x88, buf[1] = 0x13; /* announces 5000 bytes */
        ASSERT_EQ(write(sv[1], buf, 8), 8);
        size_t got = drain(sv[1], back, sizeof back, l, 300);
        spin(l, 100); /* the linger ends */
        ASSERT_TRUE(p.closed);
        ASSERT_EQ(p.err_code, KV_ERANGE);
        ASSERT_EQ(p.close_code, KV_ERANGE);
        ASSERT_EQ(got, 7); /* the owner's last frame arrived before the close */
        ASSERT_TRUE(!memcmp(back + 4, "bye", 3));
        close(sv[1]);
    }
    /* a bad header from frame_len */
    {
        int sv[2];
        ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
        peer p = {0};
        kv_net_conn_opts o = opts(1000);
        ASSERT_EQ(kv_net_conn_new(&p.c, l, sv[0], &o, &g_cbs, &p, &d), 0);
        ASSERT_EQ(write(sv[1], "\xff\xff\xff\xff", 4), 4);
        spin(l, 100);
        ASSERT_TRUE(p.closed);
        ASSERT_EQ(p.close_code, KV_EPROTO);
        close(sv[1]);
    }
    /* half a frame, then silence: ETIMEOUT at the frame deadline (150 ms) */
    {
        int sv[2];
        ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
        peer p = {0};
        kv_net_conn_opts o = opts(1000);
        ASSERT_EQ(kv_net_conn_new(&p.c, l, sv[0], &o, &g_cbs, &p, &d), 0);
        frame(buf, 20, 'z');
        ASSERT_EQ(write(sv[1], buf, 12), 12);
        const int64_t t0 = kv_net_now_ms();
        while (!p.closed && kv_net_now_ms() - t0 < 1000) kv_net_loop_run_once(l, 10, NULL);
        const int64_t took = kv_net_now_ms() - t0;
        ASSERT_TRUE(p.closed);
        ASSERT_EQ(p.close_code, KV_ETIMEOUT);
        ASSERT_TRUE(took >= 140 && took < 600);
        close(sv[1]);
    }
    /* the budget: two connections fit, a third does not; a frame that needs
     * more room than is left closes its connection with ENOMEM */
    {
        kv_net_budget b;
        kv_net_budget_init(&b, 3 * 4096);
        int sv[3][2];
        peer p[3] = {{0}};
        kv_net_conn_opts o = opts(1 << 20);
        o.budget = &b;
        for (int i = 0; i < 3; i++) ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv[i]), 0);
        ASSERT_EQ(kv_net_conn_new(&p[0].c, l, sv[0][0], &o, &g_cbs, &p[0], &d), 0);
        ASSERT_EQ(kv_net_conn_new(&p[1].c, l, sv[1][0], &o, &g_cbs, &p[1], &d), 0);
        ASSERT_EQ(atomic_load(&b.used), 2 * 4096);
        static uint8_t big[20000];
        frame(big, 19000, 'q');
        ASSERT_EQ(write(sv[0][1], big, sizeof big), (ssize_t)sizeof big);
        spin(l, 100);
        ASSERT_TRUE(p[0].closed);
        ASSERT_EQ(p[0].close_code, KV_ENOMEM);
        ASSERT_TRUE(atomic_load(&b.peak) <= 3 * 4096);
        ASSERT_EQ(atomic_load(&b.used), 4096); /* the closed one gave everything back */
        ASSERT_EQ(kv_net_conn_new(&p[2].c, l, sv[2][0], &o, &g_cbs, &p[2], &d), 0);
        kv_net_budget lim;
        kv_net_budget_init(&lim, 4096 + 100);
        int sx[2];
        ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sx), 0);
        o.budget = &lim;
        kv_net_conn *c4 = NULL;
        peer p4 = {0};
        ASSERT_EQ(kv_net_conn_new(&c4, l, sx[0], &o, &g_cbs, &p4, &d), 0);
        kv_net_conn *c5 = NULL;
        int sy[2];
        ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sy), 0);
        ASSERT_EQ(kv_net_conn_new(&c5, l, sy[0], &o, &g_cbs, &p4, &d), KV_ENOMEM);
        ASSERT_TRUE(c5 == NULL);
        for (int i = 0; i < 3; i++) close(sv[i][1]);
        close(sx[1]);
        close(sy[1]);
        spin(l, 30);
    }
    /* a peer that reads nothing: the send queue is bounded (tx_max) and the
     * write deadline closes it */
    {
        int sv[2];
        ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
        peer p = {0};
        kv_net_conn_opts o = opts(1000);
        o.tx_max = 1 << 16;
        o.write_timeout_ms = 100;
        ASSERT_EQ(kv_net_conn_new(&p.c, l, sv[0], &o, &g_cbs, &p, &d), 0);
        static uint8_t chunk[1 << 15];
        int queued = 0;
        for (int i = 0; i < 64 && !p.closed; i++) {
            if (kv_net_conn_send(p.c, chunk, sizeof chunk)) break;
            queued++;
            kv_net_loop_run_once(l, 0, NULL);
        }
        ASSERT_TRUE(queued < 64); /* refused once the queue is full */
        spin(l, 300);
        ASSERT_TRUE(p.closed);
        ASSERT_TRUE(p.close_code == KV_ENOMEM || p.close_code == KV_ETIMEOUT);
        close(sv[1]);
    }
    kv_net_loop_free(l);
}

/* ---- a pluggable transport: bytes XORed on the wire ----------------------------------- */

typedef struct xor_io {
    size_t n_read, n_written;
    bool closed;
} xor_io;

static ssize_t xr(void *ctx, int fd, void *buf, size_t n) {
    xor_io *x = ctx;
    ssize_t k = read(fd, buf, n);
    for (ssize_t i = 0; i < k; i++) ((uint8_t *)buf)[i] ^= 0x5a;
    if (k > 0) x->n_read += (size_t)k;
    return k;
}

static ssize_t xw(void *ctx, int fd, const void *buf, size_t n) {
    xor_io *x = ctx;
    uint8_t tmp[4096];
    if (n > sizeof tmp) n = sizeof tmp;
    for (size_t i = 0; i < n; i++) tmp[i] = ((const uint8_t *)buf)[i] ^ 0x5a;
    ssize_t k = write(fd, tmp, n);
    if (k > 0) x->n_written += (size_t)k;
    return k;
}

static void xc(void *ctx) { ((xor_io *)ctx)->closed = true; }

static void test_pluggable_io(void) {
    kv_net_loop *l = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_net_loop_new(&l, &d), 0);
    int sv[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    static const kv_net_io_ops ops = {.read = xr, .write = xw, .close = xc};
    xor_io x = {0};
    peer p = {.echo = true};
    kv_net_conn_opts o = opts(1 << 16);
    o.io = &ops;
    o.io_ctx = &x;
    ASSERT_EQ(kv_net_conn_new(&p.c, l, sv[0], &o, &g_cbs, &p, &d), 0);
    uint8_t f[104], w[104], back[104];
    frame(f, 100, 'k');
    for (int i = 0; i < 104; i++) w[i] = f[i] ^ 0x5a;
    ASSERT_EQ(write(sv[1], w, 104), 104);
    size_t got = drain(sv[1], back, 104, l, 300);
    ASSERT_EQ(got, 104);
    for (int i = 0; i < 104; i++) back[i] ^= 0x5a;
    ASSERT_TRUE(!memcmp(back, f, 104));
    ASSERT_EQ(p.frames, 1);
    ASSERT_EQ(x.n_read, 104);
    ASSERT_EQ(x.n_written, 104);
    close(sv[1]);
    spin(l, 30);
    ASSERT_TRUE(p.closed);
    ASSERT_TRUE(x.closed);
    kv_net_loop_free(l);
}

/* ---- dial and accept on 127.0.0.1 ------------------------------------------------------ */

typedef struct acceptor {
    int lfd;
    peer srv;
    kv_net_loop *l;
} acceptor;

static void on_accept(kv_net_loop *l, kv_net_watch *w, unsigned ev) {
    acceptor *a = w->data;
    (void)ev;
    int fd = accept(a->lfd, NULL, NULL);
    if (fd < 0) return;
    kv_net_conn_opts o = opts(1 << 16);
    a->srv.echo = true;
    kv_net_conn_new(&a->srv.c, l, fd, &o, &g_cbs, &a->srv, NULL);
}

static int g_open_code = 1;
static void on_open(kv_net_conn *c, int code) {
    (void)c;
    g_open_code = code;
}

static void test_dial(void) {
    kv_net_loop *l = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_net_loop_new(&l, &d), 0);
    acceptor a = {0};
    a.l = l;
    char addr[64];
    ASSERT_EQ(kv_net_listen("127.0.0.1:0", 16, &a.lfd, addr, sizeof addr, &d), 0);
    ASSERT_TRUE(strncmp(addr, "127.0.0.1:", 10) == 0 && strcmp(addr, "127.0.0.1:0") != 0);
    kv_net_watch lw;
    ASSERT_EQ(kv_net_watch_add(l, &lw, a.lfd, KV_NET_READ, on_accept, &a, &d), 0);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    ASSERT_EQ(getsockname(a.lfd, (struct sockaddr *)&ss, &sl), 0);
    peer cli = {0};
    kv_net_conn_cbs cbs = g_cbs;
    cbs.on_open = on_open;
    kv_net_conn_opts o = opts(1 << 16);
    ASSERT_EQ(kv_net_conn_dial(&cli.c, l, (struct sockaddr *)&ss, sl, 1000, &o, &cbs, &cli, &d), 0);
    /* queued before the connect completes: sent once it does */
    uint8_t f[14];
    frame(f, 10, 'd');
    ASSERT_EQ(kv_net_conn_send(cli.c, f, sizeof f), 0);
    spin(l, 100);
    ASSERT_EQ(g_open_code, 0);
    ASSERT_EQ(a.srv.frames, 1); /* the server got it */
    ASSERT_EQ(cli.frames, 1);   /* and its echo came back */
    /* the server closes right after queueing a frame: it still arrives */
    kv_net_conn_send(a.srv.c, f, sizeof f);
    kv_net_conn_close(a.srv.c, 0, "done");
    spin(l, 200);
    ASSERT_EQ(cli.frames, 2);
    ASSERT_TRUE(cli.closed && a.srv.closed);
    ASSERT_EQ(cli.close_code, 0);
    /* dialing a closed port fails through on_open and on_close */
    kv_net_watch_del(l, &lw);
    close(a.lfd);
    peer bad = {0};
    g_open_code = 1;
    ASSERT_EQ(kv_net_conn_dial(&bad.c, l, (struct sockaddr *)&ss, sl, 500, &o, &cbs, &bad, &d), 0);
    spin(l, 100);
    ASSERT_TRUE(g_open_code < 0);
    ASSERT_TRUE(bad.closed);
    ASSERT_TRUE(bad.close_code < 0);
    kv_net_loop_free(l);
}

static const kvt_case cases[] = {
    KVT_CASE(test_timers), KVT_CASE(test_framing), KVT_CASE(test_commit_now), KVT_CASE(test_limits),
    KVT_CASE(test_pluggable_io),
    KVT_CASE(test_dial),
};

int main(int argc, char **argv) { return kvt_run(argc, argv, cases, KVT_N(cases)); }
