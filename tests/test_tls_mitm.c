/* kv-test-labels: net attack */
/* A man in the middle on a dispatch link (issue 30, point 1): a process
 * between a coordinator and a real worker that terminates TLS on both sides
 * with valid certificates of its OWN Ed25519 key and relays the dispatch
 * frames it decrypts. It knows nothing secret but its own key.
 *
 *   - pinned: the coordinator dials TLS pinned to the worker's key (the blocking
 *     dial of the hub's prover, kv_link_dial_dispatch): the MITM's certificate
 *     is refused before any frame ("proves another key", the MITM's key named);
 *   - bound: a coordinator that accepts the MITM's certificate (no key listed for
 *     the worker: kv_remote with an all-zero key, so no pin) relays its key
 *     handshake through it; the worker refuses the relayed AUTH, whose
 *     signature covers the exporter of the coordinator's TLS session, not the
 *     MITM's, and the coordinator fails with that clear error; no connection
 *     is established;
 *   - the same relay in plaintext (--insecure-plaintext on both ends) is not
 *     detected at all: the handshake passes, which is why a link that leaves
 *     the machine is TLS and bound;
 *   - a coordinator whose pinned key is wrong for the real worker fails with
 *     "proves another key"; plaintext to a TLS-only server fails with a clear
 *     error; a plaintext coordinator is refused by a worker when it comes from
 *     a non-loopback address (this host's own non-loopback address, when it
 *     has one), with a message naming TLS, while TLS from there is served.
 * The transcript the relay cannot pass is checked independently: the test
 * recomputes the worker's view of the relayed AUTH with libsodium over the
 * two exporters and finds it valid only over the coordinator's. */
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/dispatch_proto.h"
#include "kvasir/dispatch_remote.h"
#include "kvasir/dispatch_worker.h"
#include "kvasir/link.h"
#include "kvasir/pool.h"
#include "kvasir/slice.h"
#include "kvasir/tls.h"
#include "kvasir/transport.h"
#include "kvtest.h"

static char g_dir[256], g_manifest[400];
static kv_manifest *g_m;
static kv_pool *g_pool;

static void seed_key(uint8_t tag, uint8_t pk[32], uint8_t sk[64]) {
    uint8_t seed[32];
    memset(seed, 0x5a, sizeof seed);
    seed[0] = tag;
    crypto_sign_seed_keypair(pk, sk, seed);
}

/* ---- a real worker (key tag 40) serving coordinator key tag 41 and the MITM's (tag 50) ---- */

typedef struct tworker {
    kv_worker *w;
    pthread_t t;
    uint8_t pk[32], sk[64];
    char addr[80]; /* where to dial it */
} tworker;

static void *worker_main(void *a) {
    kv_diag d = {0};
    kv_worker_serve(a, &d);
    return NULL;
}

static int worker_up(tworker *tw, const char *listen) {
    char slabs[400];
    snprintf(slabs, sizeof slabs, "%s/sl", g_dir);
    seed_key(40, tw->pk, tw->sk);
    static uint8_t allow[2][32];
    uint8_t sk[64];
    seed_key(41, allow[0], sk);
    seed_key(50, allow[1], sk); /* even a MITM the worker would serve as itself gains nothing */
    kv_worker_opts o = {.slabs = slabs, .listen = listen, .n_threads = 1, .quiet = true, .key_sk = tw->sk,
                        .allow_keys = (const uint8_t(*)[32])allow, .n_allow_keys = 2};
    kv_diag d = {0};
    if (kv_worker_open(&tw->w, &o, &d)) {
        fprintf(stderr, "worker: %s\n", d.msg);
        return -1;
    }
    snprintf(tw->addr, sizeof tw->addr, "%s", kv_worker_addr(tw->w));
    return pthread_create(&tw->t, NULL, worker_main, tw->w);
}

static void worker_down(tworker *tw) {
    if (!tw->w) return;
    kv_worker_stop(tw->w);
    pthread_join(tw->t, NULL);
    kv_worker_free(tw->w);
    tw->w = NULL;
}

static int listen_any(char *addr, size_t cap) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 4) ||
        getsockname(fd, (struct sockaddr *)&a, &al))
        return -1;
    snprintf(addr, cap, "127.0.0.1:%u", ntohs(a.sin_port));
    return fd;
}

/* ---- the man in the middle -------------------------------------------------------- */

typedef struct mitm {
    int lfd;
    char addr[64];
    const char *to; /* the real worker */
    bool tls;       /* terminate TLS on both sides (else a plaintext relay) */
    pthread_t t;
    kv_tls_ctx *ctx; /* a certificate of the MITM's own key (tag 50) */
    /* what it saw */
    int frames;                        /* frames relayed */
    bool client_tls_ok;                /* the coordinator finished TLS with it */
    uint8_t exp_c[32], exp_w[32];      /* the two sessions' exporters */
    uint8_t challenge[32], wkey[32];   /* the worker's AUTH_CHALLENGE */
    kv_msg_auth auth;                  /* the coordinator's AUTH as relayed */
    char model[65];
    uint16_t version;
    bool have_auth;
    uint16_t last_type; /* the worker's answer to AUTH */
} mitm;

/* One frame from ch into buf (header decoded by the codec). */
static int read_frame(const kv_link_chan *ch, uint8_t *buf, size_t cap, size_t *n) {
    kv_frame_rx rx;
    kv_frame_rx_init(&rx, buf, cap);
    kv_msg m;
    if (kv_proto_read_msg_chan(&rx, ch, 3000, NULL, &m, NULL)) return -1;
    *n = rx.need;
    return 0;
}

static int relay_one(const kv_link_chan *from, const kv_link_chan *to, uint8_t *buf, size_t cap, kv_msg *m) {
    size_t n = 0;
    if (read_frame(from, buf, cap, &n)) return -1;
    if (kv_msg_decode(buf, n, NULL, m, NULL)) return -1;
    return kv_proto_write_all_chan(to, buf, n, 3000, NULL);
}

static void *mitm_main(void *a) {
    mitm *x = a;
    int c = accept(x->lfd, NULL, NULL);
    if (c < 0) return NULL;
    kv_tls *tc = NULL, *tw = NULL;
    int w = -1;
    kv_link_chan cc = {c, NULL}, cw = {-1, NULL};
    static uint8_t buf[1 << 20];
    if (x->tls) {
        const kv_tls_opts so = {.server = true};
        if (kv_tls_new(&tc, x->ctx, &so, NULL) || kv_tls_handshake_fd(tc, c, 3000, NULL)) goto out;
        x->client_tls_ok = true;
        const kv_tls_opts co = {.server = false}; /* it accepts whatever the worker is */
        if (kv_tls_dial(&tw, &w, x->ctx, &co, x->to, 3000, NULL)) goto out;
        kv_tls_exporter(tc, x->exp_c);
        kv_tls_exporter(tw, x->exp_w);
        cc.tls = tc;
    } else if (kv_link_connect(x->to, 3000, &w, NULL)) {
        goto out;
    }
    cw = (kv_link_chan){w, tw};
    kv_msg m;
    /* HELLO; HELLO_ACK and AUTH_CHALLENGE; AUTH; the worker's answer */
    if (relay_one(&cc, &cw, buf, sizeof buf, &m)) goto out;
    x->frames++;
    if (relay_one(&cw, &cc, buf, sizeof buf, &m) || m.h.type != KV_MSG_HELLO_ACK) goto out;
    x->frames++;
    memcpy(x->model, m.u.ack.model_id, 65);
    x->version = m.u.ack.version;
    if (relay_one(&cw, &cc, buf, sizeof buf, &m) || m.h.type != KV_MSG_AUTH_CHALLENGE) goto out;
    x->frames++;
    memcpy(x->challenge, m.u.challenge.challenge, 32);
    memcpy(x->wkey, m.u.challenge.worker_key, 32);
    if (relay_one(&cc, &cw, buf, sizeof buf, &m) || m.h.type != KV_MSG_AUTH) goto out;
    x->frames++;
    x->auth = m.u.auth;
    x->have_auth = true;
    if (relay_one(&cw, &cc, buf, sizeof buf, &m)) goto out;
    x->frames++;
    x->last_type = m.h.type;
    /* then whatever follows, until either side closes */
    while (!relay_one(&cc, &cw, buf, sizeof buf, &m) && !relay_one(&cw, &cc, buf, sizeof buf, &m)) x->frames += 2;
out:
    kv_tls_free(tc);
    kv_tls_free(tw);
    close(c);
    if (w >= 0) close(w);
    return NULL;
}

static int mitm_start(mitm *x, const char *to, bool tls) {
    memset(x, 0, sizeof *x);
    x->to = to;
    x->tls = tls;
    uint8_t pk[32], sk[64];
    seed_key(50, pk, sk);
    if (kv_link_tls_ctx(&x->ctx, sk, NULL)) return -1;
    x->lfd = listen_any(x->addr, sizeof x->addr);
    if (x->lfd < 0) return -1;
    return pthread_create(&x->t, NULL, mitm_main, x);
}

static void mitm_stop(mitm *x) {
    shutdown(x->lfd, SHUT_RDWR); /* a MITM never dialed ends its accept */
    pthread_join(x->t, NULL);
    close(x->lfd);
    kv_tls_ctx_free(x->ctx);
}

/* ---- the cases ---------------------------------------------------------------------- */

/* The coordinator pinned to the worker's key: the MITM's certificate fails the pin. */
static void test_pinned_refuses_mitm_cert(void) {
    tworker tw = {0};
    ASSERT_EQ(worker_up(&tw, "127.0.0.1:0"), 0);
    if (!tw.w) return;
    mitm x;
    ASSERT_EQ(mitm_start(&x, tw.addr, true), 0);
    uint8_t cpk[32], csk[64], mpk[32], msk[64];
    seed_key(41, cpk, csk);
    seed_key(50, mpk, msk);
    const kv_link_dispatch_opts o = {.addr = x.addr, .model_id = g_m->model_id, .worker_key = tw.pk, .sk = csk,
                                     .timeout_ms = 3000};
    kv_link_dispatch ln;
    kv_diag d = {0};
    ASSERT_EQ(kv_link_dial_dispatch(&o, &ln, &d), KV_EAUTH);
    printf("  expected error: %s\n", d.msg);
    ASSERT_TRUE(strstr(d.msg, "proves another key") != NULL);
    char mhex[65];
    kv_hex(mpk, 32, mhex);
    ASSERT_TRUE(strstr(d.msg, "carries key") != NULL && strstr(d.msg, "not the pinned") != NULL);
    char m16[17];
    memcpy(m16, mhex, 16);
    m16[16] = 0;
    ASSERT_TRUE(strstr(d.msg, m16) != NULL);
    ASSERT_EQ(ln.fd, -1);
    ASSERT_EQ(x.frames, 0); /* not one dispatch frame reached it */
    mitm_stop(&x);
    kv_link_dispatch_close(&ln);
    /* the real worker with another key pinned: the same refusal */
    uint8_t other[32], osk[64];
    seed_key(43, other, osk);
    const kv_link_dispatch_opts o2 = {.addr = tw.addr, .model_id = g_m->model_id, .worker_key = other, .sk = csk,
                                      .timeout_ms = 3000};
    ASSERT_EQ(kv_link_dial_dispatch(&o2, &ln, &d), KV_EAUTH);
    ASSERT_TRUE(strstr(d.msg, "proves another key") != NULL);
    /* and the right key passes, over TLS, at the newest version (v5 or later) */
    const kv_link_dispatch_opts o3 = {.addr = tw.addr, .model_id = g_m->model_id, .worker_key = tw.pk, .sk = csk,
                                      .timeout_ms = 3000};
    ASSERT_EQ(kv_link_dial_dispatch(&o3, &ln, &d), 0);
    ASSERT_TRUE(ln.tls != NULL);
    ASSERT_EQ(ln.version, KV_PROTO_VERSION); /* the newest, which TLS requires to be at least v5 */
    ASSERT_TRUE(ln.version >= KV_PROTO_TLS_VERSION);
    kv_link_dispatch_close(&ln);
    worker_down(&tw);
}

/* A coordinator that accepts the MITM's certificate (no key listed: no pin):
 * the relayed AUTH is bound to the coordinator's session and fails at the
 * worker; the coordinator fails with that error. */
static void test_bound_handshake_not_relayed(void) {
    tworker tw = {0};
    ASSERT_EQ(worker_up(&tw, "127.0.0.1:0"), 0);
    if (!tw.w) return;
    mitm x;
    ASSERT_EQ(mitm_start(&x, tw.addr, true), 0);
    uint8_t cpk[32], csk[64];
    seed_key(41, cpk, csk);
    const char *addrs[1] = {x.addr};
    kv_remote_opts ro = {.workers = addrs, .n_workers = 1, .timeout_ms = 3000, .key_sk = csk};
    kv_remote *r = NULL;
    kv_diag d = {0};
    /* the slabs are present here too, so the open itself succeeds (it would
       compute locally); the worker through the MITM never comes up */
    ASSERT_EQ(kv_remote_open(&r, g_manifest, g_pool, &ro, &d), 0);
    if (r) {
        kv_remote_worker wi;
        kv_remote_worker_info(r, 0, &wi);
        printf("  expected error: %s\n", wi.last_error);
        ASSERT_TRUE(!wi.up && wi.connects == 0);
        ASSERT_TRUE(strstr(wi.last_error, "EAUTH") != NULL);
        ASSERT_TRUE(strstr(wi.last_error, "TLS session") != NULL && strstr(wi.last_error, "relayed") != NULL);
    }
    kv_remote_free(r);
    mitm_stop(&x);
    ASSERT_TRUE(x.client_tls_ok);
    ASSERT_TRUE(x.have_auth);
    ASSERT_EQ(x.last_type, KV_MSG_ERROR); /* the worker never sent AUTH_OK */
    /* independently (libsodium over the transcript as PROTOCOL.md defines it):
       the relayed AUTH is valid over the coordinator's exporter only */
    ASSERT_TRUE(memcmp(x.exp_c, x.exp_w, 32) != 0);
    for (int k = 0; k < 2 && x.have_auth; k++) {
        const uint8_t *bind = k ? x.exp_w : x.exp_c;
        crypto_hash_sha256_state s;
        uint8_t dg[32], v[2] = {(uint8_t)x.version, (uint8_t)(x.version >> 8)}, role = 'C';
        crypto_hash_sha256_init(&s);
        crypto_hash_sha256_update(&s, (const uint8_t *)"kvasir-dispatch-auth-v3\n", 24);
        crypto_hash_sha256_update(&s, &role, 1);
        crypto_hash_sha256_update(&s, (const uint8_t *)x.model, 64);
        crypto_hash_sha256_update(&s, v, 2);
        crypto_hash_sha256_update(&s, x.wkey, 32);
        crypto_hash_sha256_update(&s, x.challenge, 32);
        crypto_hash_sha256_update(&s, x.auth.key, 32);
        crypto_hash_sha256_update(&s, x.auth.nonce, 32);
        crypto_hash_sha256_update(&s, bind, 32);
        crypto_hash_sha256_final(&s, dg);
        const int ok = crypto_sign_verify_detached(x.auth.sig, dg, 32, x.auth.key);
        if (k == 0) ASSERT_EQ(ok, 0);  /* the coordinator signed its own session */
        else ASSERT_NE(ok, 0);         /* which is not the one the worker is on */
    }
    ASSERT_EQ(x.version, KV_PROTO_VERSION);
    ASSERT_TRUE(x.version >= KV_PROTO_TLS_VERSION);
    worker_down(&tw);
}

/* The same relay in plaintext goes unnoticed: what --insecure-plaintext gives up. */
static void test_plaintext_relay_unnoticed(void) {
    tworker tw = {0};
    ASSERT_EQ(worker_up(&tw, "127.0.0.1:0"), 0);
    if (!tw.w) return;
    mitm x;
    ASSERT_EQ(mitm_start(&x, tw.addr, false), 0);
    uint8_t cpk[32], csk[64];
    seed_key(41, cpk, csk);
    const kv_link_dispatch_opts o = {.addr = x.addr, .model_id = g_m->model_id, .worker_key = tw.pk, .sk = csk,
                                     .timeout_ms = 3000, .plaintext = true};
    kv_link_dispatch ln;
    kv_diag d = {0};
    ASSERT_EQ(kv_link_dial_dispatch(&o, &ln, &d), 0);
    ASSERT_TRUE(ln.tls == NULL);
    kv_link_dispatch_close(&ln);
    mitm_stop(&x);
    ASSERT_EQ(x.last_type, KV_MSG_AUTH_OK);
    worker_down(&tw);
}

/* Plaintext to a TLS-only server (the MITM's TLS listener stands in for one). */
static void *tls_only_main(void *a) {
    mitm *x = a;
    int c = accept(x->lfd, NULL, NULL);
    if (c < 0) return NULL;
    kv_tls *t = NULL;
    const kv_tls_opts so = {.server = true};
    kv_diag d = {0};
    if (!kv_tls_new(&t, x->ctx, &so, NULL) && kv_tls_handshake_fd(t, c, 3000, &d)) {
        x->frames = d.code;
        snprintf(x->model, sizeof x->model, "%.64s", d.msg);
    }
    kv_tls_free(t);
    close(c);
    return NULL;
}

static void test_plaintext_to_tls_port(void) {
    mitm x;
    memset(&x, 0, sizeof x);
    uint8_t pk[32], sk[64];
    seed_key(50, pk, sk);
    ASSERT_EQ(kv_link_tls_ctx(&x.ctx, sk, NULL), 0);
    x.lfd = listen_any(x.addr, sizeof x.addr);
    ASSERT_EQ(pthread_create(&x.t, NULL, tls_only_main, &x), 0);
    uint8_t cpk[32], csk[64];
    seed_key(41, cpk, csk);
    const kv_link_dispatch_opts o = {.addr = x.addr, .model_id = g_m->model_id, .worker_key = pk, .sk = csk,
                                     .timeout_ms = 2000, .plaintext = true};
    kv_link_dispatch ln;
    kv_diag d = {0};
    ASSERT_NE(kv_link_dial_dispatch(&o, &ln, &d), 0);
    pthread_join(x.t, NULL);
    printf("  the TLS server says: %s\n", x.model);
    ASSERT_EQ(x.frames, KV_EPROTO);
    ASSERT_TRUE(strstr(x.model, "does not speak TLS") != NULL);
    close(x.lfd);
    kv_tls_ctx_free(x.ctx);
}

/* A non-loopback IPv4 address of this host, or false. */
static bool own_address(char *out, size_t cap) {
    struct ifaddrs *ifa = NULL, *i;
    bool found = false;
    if (getifaddrs(&ifa)) return false;
    for (i = ifa; i && !found; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || kv_link_sockaddr_loopback(i->ifa_addr)) continue;
        found = inet_ntop(AF_INET, &((struct sockaddr_in *)i->ifa_addr)->sin_addr, out, (socklen_t)cap) != NULL;
    }
    freeifaddrs(ifa);
    return found;
}

/* A plaintext coordinator from an address that is not loopback is refused
 * with an error naming TLS; TLS from there is served; loopback plaintext is. */
static void test_plaintext_beyond_loopback(void) {
    ASSERT_TRUE(kv_link_addr_loopback("127.0.0.1:1") && kv_link_addr_loopback("127.9.8.7:1") &&
                kv_link_addr_loopback("[::1]:1") && kv_link_addr_loopback("[::ffff:127.0.0.1]:1"));
    ASSERT_TRUE(!kv_link_addr_loopback("10.77.0.1:1") && !kv_link_addr_loopback("[::2]:1") &&
                !kv_link_addr_loopback("localhost:1") && !kv_link_addr_loopback("128.0.0.1:1"));
    char ip[64];
    if (!own_address(ip, sizeof ip)) {
        printf("  (no non-loopback IPv4 address on this host: the refusal is shown by the netns tests)\n");
        return;
    }
    tworker tw = {0};
    ASSERT_EQ(worker_up(&tw, "0.0.0.0:0"), 0);
    if (!tw.w) return;
    const char *colon = strrchr(tw.addr, ':');
    char to[96];
    snprintf(to, sizeof to, "%s%s", ip, colon);
    uint8_t cpk[32], csk[64];
    seed_key(41, cpk, csk);
    kv_link_dispatch_opts o = {.addr = to, .model_id = g_m->model_id, .worker_key = tw.pk, .sk = csk,
                               .timeout_ms = 3000, .plaintext = true};
    kv_link_dispatch ln;
    kv_diag d = {0};
    ASSERT_EQ(kv_link_dial_dispatch(&o, &ln, &d), KV_EUNSUPPORTED);
    printf("  expected error (%s): %s\n", to, d.msg);
    ASSERT_TRUE(strstr(d.msg, "plaintext dispatch from") != NULL && strstr(d.msg, "TLS") != NULL);
    o.plaintext = false;
    ASSERT_EQ(kv_link_dial_dispatch(&o, &ln, &d), 0);
    kv_link_dispatch_close(&ln);
    snprintf(to, sizeof to, "127.0.0.1%s", colon);
    o.plaintext = true;
    ASSERT_EQ(kv_link_dial_dispatch(&o, &ln, &d), 0);
    kv_link_dispatch_close(&ln);
    worker_down(&tw);
}

/* --insecure-plaintext on every command that listens or dials: in its help, and a warning at start. */
static void test_cli_flag(void) {
    const char *cmds[] = {"worker", "node", "ring", "run", "bench", "gateway"};
    for (size_t i = 0; i < sizeof cmds / sizeof *cmds; i++) {
        char cmd[600];
        snprintf(cmd, sizeof cmd, "'%s' %s --help 2>&1 | grep -q -- --insecure-plaintext", getenv("KV_BIN"), cmds[i]);
        ASSERT_EQ(system(cmd), 0);
        snprintf(cmd, sizeof cmd,
                 "'%s' %s --insecure-plaintext --help 2>&1 >/dev/null | grep -q 'WARNING: %s: --insecure-plaintext'",
                 getenv("KV_BIN"), cmds[i], cmds[i]);
        if (system(cmd)) KVT_FAIL("%s --insecure-plaintext printed no warning", cmds[i]);
    }
}

static int setup(void) {
    signal(SIGPIPE, SIG_IGN);
    if (sodium_init() < 0) return 1;
    const char *bin = getenv("KV_BIN");
    if (!bin) {
        fprintf(stderr, "KV_BIN is not set\n");
        return 1;
    }
    snprintf(g_dir, sizeof g_dir, "%s/kv_mitm_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(g_dir)) return 1;
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "'%s' gen-model --preset tiny --out '%s/m.gguf' >/dev/null 2>&1 && "
             "'%s' slice '%s/m.gguf' --out '%s/sl' --experts-per-slab 4 >/dev/null 2>&1",
             bin, g_dir, bin, g_dir, g_dir);
    if (system(cmd)) return 1;
    snprintf(g_manifest, sizeof g_manifest, "%s/sl/manifest.json", g_dir);
    kv_diag d = {0};
    if (kv_manifest_load(&g_m, g_manifest, &d) || kv_pool_new(&g_pool, 1, &d)) {
        fprintf(stderr, "%s\n", d.msg);
        return 1;
    }
    return 0;
}

static void teardown(void) {
    kv_manifest_free(g_m);
    kv_pool_free(g_pool);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd)) fprintf(stderr, "cleanup failed\n");
}

static const kvt_case cases[] = {
    KVT_CASE(test_pinned_refuses_mitm_cert),
    KVT_CASE(test_bound_handshake_not_relayed),
    KVT_CASE(test_plaintext_relay_unnoticed),
    KVT_CASE(test_plaintext_to_tls_port),
    KVT_CASE(test_plaintext_beyond_loopback),
    KVT_CASE(test_cli_flag),
};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
