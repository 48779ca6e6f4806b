/* kv-test-labels: net attack */
/* Attacks on the two HTTP servers (a `kvasir gateway` and a `kvasir hub`,
 * each its own process on loopback), and what must hold under each: other
 * clients keep being served, and the server's resident memory (VmRSS and
 * VmHWM from /proc/PID/status) stays under the bound docs/GATEWAY.md states.
 *
 *   content_length  two different Content-Length headers: 400 naming them
 *   json_bomb       bodies of 1 MiB of "{}" in an ignored field, in parallel:
 *                   each refused (413, or 503 while the parse memory is all
 *                   reserved), peak RSS growth at most
 *                   n x (2 x body limit + parse budget) + 48 MiB, and RSS back
 *                   within 48 MiB of where it was once they closed
 *   slowloris       sockets from many source addresses (127.0.0.x) sending a
 *                   header byte at a time: an honest client from another
 *                   address is served throughout, and a trickling request is
 *                   closed at the whole-request deadline
 *   fair_share      one API key from two addresses keeps every slot and the
 *                   queue busy with long generations: another key's requests
 *                   are all served (never 503)
 *
 * Short by default (a few seconds each, in `make test`); KV_ATTACK_FULL=1
 * runs them at the sizes the attacks were found at (64 bombs, a byte every
 * 12 s for 40 s, ...), for `make attack`. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/hub.h"
#include "kvtest.h"
#include "proc_support.h"

static char g_dir[256];
static bool g_full;
/* shell words before the server's command (environment), "" for none */
static const char *g_server_env = "";

#if defined(__SANITIZE_ADDRESS__)
#define KV_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KV_TEST_ASAN 1
#endif
#endif

typedef struct server {
    pid_t pid;
    uint16_t port;
} server;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Starts `kvasir ARGS` (listening on 127.0.0.1:0) and reads its port from
 * "listening on HOST:PORT". */
static int server_start(server *s, const char *args) {
    char cmd[2048], addr[256];
    snprintf(cmd, sizeof cmd, "%sexec '%s' %s", g_server_env, getenv("KV_BIN"), args);
    s->pid = 0;
    s->port = 0;
    if (kvt_spawn_listening(cmd, 30000, &s->pid, addr, sizeof addr)) {
        fprintf(stderr, "kvasir %s: no 'listening on' line (got '%s')\n", args, addr);
        return -1;
    }
    const char *colon = strrchr(addr, ':');
    s->port = colon ? (uint16_t)atoi(colon + 1) : 0;
    if (!s->port) {
        fprintf(stderr, "kvasir %s: no port in 'listening on %s'\n", args, addr);
        kill(s->pid, SIGKILL);
        waitpid(s->pid, NULL, 0);
        s->pid = 0;
        return -1;
    }
    return 0;
}

static void server_stop(server *s) {
    if (s->pid <= 0) return;
    kill(s->pid, SIGTERM);
    for (int i = 0; i < 100; i++) {
        if (waitpid(s->pid, NULL, WNOHANG) == s->pid) {
            s->pid = 0;
            return;
        }
        usleep(50000);
    }
    kill(s->pid, SIGKILL);
    waitpid(s->pid, NULL, 0);
    s->pid = 0;
}

/* VmRSS or VmHWM of pid, bytes. */
static size_t proc_mem(pid_t pid, const char *field) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    size_t kb = 0;
    const size_t fl = strlen(field);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, field, fl) && line[fl] == ':') kb = strtoull(line + fl + 1, NULL, 10);
    if (f) fclose(f);
    return kb * 1024;
}

/* A TCP connection to 127.0.0.1:port from source address 127.0.0.src (0: any). */
static int dial(uint16_t port, int src) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    if (src) {
        struct sockaddr_in a = {.sin_family = AF_INET};
        a.sin_addr.s_addr = htonl(0x7f000000u | (uint32_t)src);
        if (bind(fd, (struct sockaddr *)&a, sizeof a)) {
            close(fd);
            return -1;
        }
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(0x7f000001u);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return -1;
    }
    return fd;
}

static bool send_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k <= 0) return false;
        p += k;
        n -= (size_t)k;
    }
    return true;
}

/* Sends req[n] on a new connection from 127.0.0.src and reads the answer
 * (until the server closes or timeout_ms pass) into out[cap]. Returns the
 * HTTP status, 0 without one (refused, reset, timed out). */
static int http_raw(uint16_t port, int src, const char *req, size_t n, char *out, size_t cap, int timeout_ms) {
    if (cap) out[0] = 0;
    int fd = dial(port, src);
    if (fd < 0) return 0;
    struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    send_all(fd, req, n); /* a server that answers early may stop reading */
    size_t got = 0;
    const double end = now_s() + timeout_ms / 1000.0;
    while (got + 1 < cap && now_s() < end) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, 100) <= 0) continue;
        ssize_t k = recv(fd, out + got, cap - 1 - got, 0);
        if (k <= 0) break;
        got += (size_t)k;
        out[got] = 0;
        /* a whole answer: headers and a body of its Content-Length */
        const char *hend = strstr(out, "\r\n\r\n"), *cl = strcasestr(out, "\r\nContent-Length:");
        if (hend && cl && cl < hend && got >= (size_t)(hend + 4 - out) + strtoull(cl + 17, NULL, 10)) break;
    }
    close(fd);
    int status = 0;
    if (got > 12 && !strncmp(out, "HTTP/1.", 7)) status = atoi(out + 9);
    return status;
}

static int post(uint16_t port, int src, const char *path, const char *hdrs, const char *body, char *out, size_t cap,
                int timeout_ms);

/* body NULL: path is a whole raw request (a GET) */
static int ask(uint16_t port, int src, const char *path, const char *body, char *out, size_t cap, int timeout_ms) {
    return body ? post(port, src, path, NULL, body, out, cap, timeout_ms)
                : http_raw(port, src, path, strlen(path), out, cap, timeout_ms);
}

static int post(uint16_t port, int src, const char *path, const char *hdrs, const char *body, char *out, size_t cap,
                int timeout_ms) {
    size_t bn = strlen(body);
    size_t cap_req = bn + 1024;
    char *req = malloc(cap_req);
    int n = snprintf(req, cap_req,
                     "POST %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n%s"
                     "Content-Length: %zu\r\n\r\n",
                     path, hdrs ? hdrs : "", bn);
    memcpy(req + n, body, bn);
    int st = http_raw(port, src, req, (size_t)n + bn, out, cap, timeout_ms);
    free(req);
    return st;
}

static const char *chat_small = "{\"messages\":[{\"role\":\"user\",\"content\":\"hello\"}],\"max_tokens\":4,\"temperature\":0}";

/* ---- setup ------------------------------------------------------------------ */

static int run(const char *cmd) {
    int rc = system(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static int setup(void) {
    signal(SIGPIPE, SIG_IGN);
    g_full = getenv("KV_ATTACK_FULL") && atoi(getenv("KV_ATTACK_FULL")) > 0;
    if (!getenv("KV_BIN")) return fprintf(stderr, "KV_BIN is not set\n"), 1;
    snprintf(g_dir, sizeof g_dir, "%s/kv_attack_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (!mkdtemp(g_dir)) return 1;
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "'%s' gen-model --preset tiny --out '%s/m.gguf' >/dev/null 2>&1 && "
             "'%s' slice '%s/m.gguf' --out '%s/sl' --experts-per-slab 4 >/dev/null 2>&1 && "
             "printf 'sk-attacker\\nsk-honest\\n' > '%s/keys.txt'",
             getenv("KV_BIN"), g_dir, getenv("KV_BIN"), g_dir, g_dir, g_dir);
    return run(cmd) ? 1 : 0;
}

static void teardown(void) {
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (run(cmd)) fprintf(stderr, "cannot remove %s\n", g_dir);
}

static int gateway_start(server *s, const char *extra) {
    char args[1024];
    snprintf(args, sizeof args, "gateway -m '%s/m.gguf' --listen 127.0.0.1:0 --threads 1 %s 2>/dev/null", g_dir,
             extra ? extra : "");
    return server_start(s, args);
}

static int hub_start(server *s, const char *name, const char *extra) {
    char args[1024];
    snprintf(args, sizeof args, "hub --model '%s/sl/manifest.json' --db '%s/%s.db' --listen 127.0.0.1:0 --quiet %s",
             g_dir, g_dir, name, extra ? extra : "");
    return server_start(s, args);
}

/* ---- conflicting Content-Length ------------------------------------------------ */

static void test_content_length(void) {
    server gw = {0}, hub = {0};
    ASSERT_EQ(gateway_start(&gw, NULL), 0);
    ASSERT_EQ(hub_start(&hub, "cl", NULL), 0);
    if (!gw.port || !hub.port) goto out;
    /* the first length frames a valid request; the second says there is more */
    const char *body = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":1}";
    char req[1024], out[4096];
    const struct { uint16_t port; const char *path; } t[2] = {{gw.port, "/v1/chat/completions"}, {hub.port, "/v1/register"}};
    for (int i = 0; i < 2; i++) {
        int n = snprintf(req, sizeof req,
                         "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                         "Content-Length: %zu\r\nConnection: close\r\n\r\n%s",
                         t[i].path, strlen(body), strlen(body) + 40, body);
        const int st = http_raw(t[i].port, 0, req, (size_t)n, out, sizeof out, 5000);
        ASSERT_EQ(st, 400);
        ASSERT_TRUE(strstr(out, "Content-Length") != NULL);
        /* Content-Length and Transfer-Encoding together */
        n = snprintf(req, sizeof req,
                     "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                     "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n%zx\r\n%s\r\n0\r\n\r\n",
                     t[i].path, strlen(body), strlen(body), body);
        ASSERT_EQ(http_raw(t[i].port, 0, req, (size_t)n, out, sizeof out, 5000), 400);
    }
    /* two equal lengths are one length: served */
    int n = snprintf(req, sizeof req,
                     "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n%s",
                     strlen(body), strlen(body), body);
    ASSERT_EQ(http_raw(gw.port, 0, req, (size_t)n, out, sizeof out, 10000), 200);
out:
    server_stop(&gw);
    server_stop(&hub);
}

/* ---- JSON bombs ------------------------------------------------------------------ */

typedef struct bomb {
    uint16_t port;
    const char *path, *body;
    int src, status;
    int signer;      /* > 0: signed as a hub node whose key is from this seed (free to make) */
} bomb;

static void *bomb_main(void *arg) {
    bomb *b = arg;
    char out[2048], hdrs[512] = "";
    if (b->signer) {
        uint8_t seed[32] = {(uint8_t)b->signer, 0x5a};
        kv_node_key k;
        kv_node_key_from_seed(&k, seed);
        kv_hub_auth a;
        kv_hub_sign(&k, "POST", b->path, b->body, strlen(b->body), 1, &a);
        snprintf(hdrs, sizeof hdrs, "X-Kvasir-Key: %s\r\nX-Kvasir-Counter: %s\r\nX-Kvasir-Signature: %s\r\n", a.key,
                 a.counter, a.sig);
    }
    b->status = post(b->port, b->src, b->path, hdrs, b->body, out, sizeof out, 60000);
    return NULL;
}

/* 1 MiB bodies: a valid request whose ignored field is "[{},{},...]". */
static char *bomb_body(const char *head, size_t size) {
    char *b = malloc(size + 1);
    size_t n = (size_t)sprintf(b, "%s\"x\":[", head);
    while (n + 8 < size) {
        memcpy(b + n, "{},", 3);
        n += 3;
    }
    memcpy(b + n, "{}]}", 5);
    return b;
}

/* n bombs at once (from n/8 + 1 addresses); every one refused with 413 and
 * an honest request served meanwhile; RSS bounded during and after. */
static void bomb_run(server *s, const char *path, const char *head, bool sign, int n, size_t body_max,
                     size_t parse_max, const char *honest_path, const char *honest_body, int honest_status) {
    char *body = bomb_body(head, (1u << 20) - 64);
    char out[8192];
    ASSERT_EQ(ask(s->port, 1, honest_path, honest_body, out, sizeof out, 30000), honest_status); /* warmed up */
    usleep(200000);
    const size_t rss0 = proc_mem(s->pid, "VmRSS");
    bomb *b = calloc((size_t)n, sizeof *b);
    pthread_t *th = calloc((size_t)n, sizeof *th);
    for (int i = 0; i < n; i++) {
        b[i] = (bomb){.port = s->port, .path = path, .body = body, .src = 2 + i / 8, .signer = sign ? i + 1 : 0};
        pthread_create(&th[i], NULL, bomb_main, &b[i]);
    }
    const double t0 = now_s();
    const int hs = ask(s->port, 1, honest_path, honest_body, out, sizeof out, 30000);
    if (hs != honest_status) KVT_FAIL("honest request during the bombs: %d (want %d): %.300s", hs, honest_status, out);
    kvt_checks++;
    size_t peak = 0;
    for (int i = 0; i < n; i++) {
        pthread_join(th[i], NULL);
        const size_t r = proc_mem(s->pid, "VmRSS");
        if (r > peak) peak = r;
        /* 413, or 503 when the bombs parsing at once had reserved all the gateway's parse memory */
        if (b[i].status != 413 && b[i].status != 503) KVT_FAIL("bomb %d: status %d (want 413 or 503)", i, b[i].status);
        kvt_checks++;
    }
    const size_t hwm = proc_mem(s->pid, "VmHWM");
    if (hwm > peak) peak = hwm;
    /* the connections' ends are handled: RSS comes back within a bounded
     * wait (a loaded machine may take its time), or the check fails */
    size_t rss1 = proc_mem(s->pid, "VmRSS");
    for (int i = 0; i < 100 && rss1 > rss0 + (48u << 20); i++) {
        usleep(100000);
        rss1 = proc_mem(s->pid, "VmRSS");
    }
    const size_t bound = (size_t)n * (2 * body_max + parse_max) + (48u << 20);
    printf("  %s: %d bombs in %.1f s: RSS %.1f MiB before, peak %.1f MiB (bound %.1f), %.1f MiB after\n", path, n,
           now_s() - t0, rss0 / 1048576.0, peak / 1048576.0, (rss0 + bound) / 1048576.0, rss1 / 1048576.0);
    if (peak > rss0 + bound)
        KVT_FAIL("%s: peak RSS %.1f MiB over %.1f MiB + the bound %.1f MiB", path, peak / 1048576.0, rss0 / 1048576.0,
                 bound / 1048576.0);
    kvt_checks++;
    if (rss1 > rss0 + (48u << 20))
        KVT_FAIL("%s: RSS %.1f MiB once the bombs closed, over %.1f MiB + 48 MiB", path, rss1 / 1048576.0,
                 rss0 / 1048576.0);
    kvt_checks++;
    /* still serving */
    ASSERT_EQ(ask(s->port, 1, honest_path, honest_body, out, sizeof out, 30000), honest_status);
    free(th);
    free(b);
    free(body);
}

static void test_json_bomb(void) {
    const int n = g_full ? 64 : 8;
#ifdef KV_TEST_ASAN
    /* In the sanitizer build (make asan) the servers are ASan builds too:
     * ASan holds every freed block in its quarantine (256 MB by default) and
     * returns free pages to the system at most every 5 s, so RSS after the
     * bombs measured the sanitizer (151 MiB after, 61 before), not the
     * gateway. A 16 MB quarantine (use after free is still caught in what
     * was freed last) and pages returned at once make RSS mean what it
     * means in a release build. */
    g_server_env = "export ASAN_OPTIONS=\"${ASAN_OPTIONS:+$ASAN_OPTIONS:}quarantine_size_mb=16:"
                   "allocator_release_to_os_interval_ms=0\"; ";
#endif
    server gw = {0}, hub = {0};
    char extra[128];
    snprintf(extra, sizeof extra, "--max-conns 256 --per-ip 16");
    ASSERT_EQ(gateway_start(&gw, extra), 0);
    if (gw.port) {
        /* the gateway's budget: 4 x 1 MiB + 1 MiB */
        bomb_run(&gw, "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":1,",
                 false, n, 1u << 20, 5u << 20, "/v1/chat/completions", chat_small, 200);
    }
    server_stop(&gw);
    ASSERT_EQ(hub_start(&hub, "bomb", NULL), 0);
    if (hub.port) /* signed with fresh keys (free); its manifest is served meanwhile */
        bomb_run(&hub, "/v1/register", "{\"addr\":\"127.0.0.1:1\",", true, n, 1u << 20, 5u << 20,
                 "GET /v1/manifest HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", NULL, 200);
    server_stop(&hub);
    g_server_env = "";
}

/* ---- slowloris -------------------------------------------------------------------- */

typedef struct slow {
    uint16_t port;
    int n_addr, per_addr;     /* sockets: per_addr from each of n_addr addresses */
    double byte_every_s;      /* one header byte per socket this often */
    double until;             /* monotonic end */
    volatile bool stop;
    uint64_t opened, closed_by_server;
} slow;

/* Keeps n_addr x per_addr sockets trickling a request header, reopening
 * each one the server closes. */
static void *slow_main(void *arg) {
    slow *s = arg;
    const int n = s->n_addr * s->per_addr;
    int *fd = calloc((size_t)n, sizeof *fd);
    size_t *sent = calloc((size_t)n, sizeof *sent);
    static const char hdr[] = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              "X-Padding-That-Never-Ends: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
                              "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    for (int i = 0; i < n; i++) fd[i] = -1;
    double next = 0;
    while (!s->stop && now_s() < s->until) {
        for (int i = 0; i < n; i++) {
            if (fd[i] >= 0) {
                char c;
                ssize_t k = recv(fd[i], &c, 1, MSG_DONTWAIT);
                if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
                    close(fd[i]);
                    fd[i] = -1;
                    s->closed_by_server++;
                }
            }
            if (fd[i] < 0) {
                fd[i] = dial(s->port, 2 + i / s->per_addr);
                sent[i] = 0;
                if (fd[i] >= 0) s->opened++;
            }
        }
        if (now_s() >= next) {
            for (int i = 0; i < n; i++)
                if (fd[i] >= 0 && send(fd[i], hdr + sent[i] % (sizeof hdr - 1), 1, MSG_NOSIGNAL) == 1) sent[i]++;
            next = now_s() + s->byte_every_s;
        }
        usleep(50000);
    }
    for (int i = 0; i < n; i++)
        if (fd[i] >= 0) close(fd[i]);
    free(fd);
    free(sent);
    return NULL;
}

/* An honest client (127.0.0.1) asks every 0.5 s while the sockets trickle;
 * every answer must come, within 5 s. */
static void slow_run(server *s, const char *what, int n_addr, int per_addr, double seconds, double byte_every,
                     const char *path, const char *body, int want) {
    slow sl = {.port = s->port, .n_addr = n_addr, .per_addr = per_addr, .byte_every_s = byte_every};
    sl.until = now_s() + seconds + 2;
    pthread_t th;
    pthread_create(&th, NULL, slow_main, &sl);
    usleep(1500000); /* the sockets are open */
    int asked = 0, served = 0;
    char out[8192];
    const double end = now_s() + seconds;
    while (now_s() < end) {
        const double t0 = now_s();
        const int st = ask(s->port, 1, path, body, out, sizeof out, 5000);
        asked++;
        served += st == want && now_s() - t0 < 2.5; /* answered, and not after waiting for a slot */
        usleep(500000);
    }
    sl.stop = true;
    pthread_join(th, NULL);
    printf("  %s: %d x %d trickling sockets (%llu opened, %llu closed by the server): %d of %d honest requests "
           "served\n", what, n_addr, per_addr, (unsigned long long)sl.opened, (unsigned long long)sl.closed_by_server,
           served, asked);
    if (served != asked) KVT_FAIL("%s: %d of %d honest requests served during the slowloris", what, served, asked);
    kvt_checks++;
}

static void trickle_closed(server *s, const char *what);

static void test_slowloris(void) {
    /* the gateway at its defaults: 256 connections, 16 per address; 17
       addresses x 16 sockets is more than it holds */
    const double secs = g_full ? 40 : 4, every = g_full ? 12 : 0.5;
    server gw = {0}, hub = {0};
    ASSERT_EQ(gateway_start(&gw, "--request-timeout 3"), 0);
    if (gw.port)
        slow_run(&gw, "gateway", 17, 16, secs, every, "/v1/chat/completions", chat_small, 200);
    if (gw.port) trickle_closed(&gw, "gateway");
    server_stop(&gw);
    /* the hub with room for 64 connections (16 per address): 5 addresses fill it */
    ASSERT_EQ(hub_start(&hub, "slow", "--max-conns 64 --request-timeout 3"), 0);
    if (hub.port) {
        const char get[] = "GET /v1/manifest HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        slow_run(&hub, "hub", 5, 16, secs, every, get, NULL, 200);
        trickle_closed(&hub, "hub");
    }
    server_stop(&hub);
}

/* A request trickling a byte every 0.2 s is closed at the deadline (3 s). */
static void trickle_closed(server *s, const char *what) {
    {
        int fd = dial(s->port, 200);
        const double t0 = now_s();
        bool closed = false;
        while (fd >= 0 && now_s() - t0 < 8 && !closed) {
            if (send(fd, "P", 1, MSG_NOSIGNAL) != 1) closed = true;
            char c;
            ssize_t k = recv(fd, &c, 1, MSG_DONTWAIT);
            if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) closed = true;
            usleep(200000);
        }
        const double took = now_s() - t0;
        if (fd >= 0) close(fd);
        if (!closed || took < 2.5 || took > 5)
            KVT_FAIL("%s: a trickling request closed after %.1f s (want 3-5 s)", what, took);
        kvt_checks++;
    }
}

/* ---- fair shares ------------------------------------------------------------------- */

typedef struct hog {
    uint16_t port;
    int src;
    volatile bool *stop;
    int n_200, n_503;
} hog;

/* The attacker: long generations back to back with its one key. */
static void *hog_main(void *arg) {
    hog *h = arg;
    const char *body = "{\"messages\":[{\"role\":\"user\",\"content\":\"go on\"}],\"max_tokens\":400,\"ignore_eos\":true}";
    char out[8192];
    while (!*h->stop) {
        const int st = post(h->port, h->src, "/v1/chat/completions", "Authorization: Bearer sk-attacker\r\n", body, out,
                            sizeof out, 60000);
        h->n_200 += st == 200;
        h->n_503 += st == 503;
        if (st != 200) usleep(20000);
    }
    return NULL;
}

static void test_fair_share(void) {
    server gw = {0};
    char extra[512];
    snprintf(extra, sizeof extra, "--parallel 2 --queue 4 --api-keys '%s/keys.txt'", g_dir);
    ASSERT_EQ(gateway_start(&gw, extra), 0);
    if (!gw.port) return;
    volatile bool stop = false;
    enum { N_HOG = 8 };
    hog h[N_HOG];
    pthread_t th[N_HOG];
    for (int i = 0; i < N_HOG; i++) {
        h[i] = (hog){.port = gw.port, .src = 2 + i % 2, .stop = &stop}; /* one key, two addresses */
        pthread_create(&th[i], NULL, hog_main, &h[i]);
    }
    usleep(1500000); /* slots and queue full */
    const int n = g_full ? 20 : 4;
    int served = 0;
    double worst = 0;
    char out[8192];
    for (int i = 0; i < n; i++) {
        const double t0 = now_s();
        const int st = post(gw.port, 4, "/v1/chat/completions", "Authorization: Bearer sk-honest\r\n", chat_small, out,
                            sizeof out, 60000);
        const double dt = now_s() - t0;
        if (dt > worst) worst = dt;
        if (st == 200) served++;
        else fprintf(stderr, "  honest request %d: %d %.200s\n", i, st, out);
    }
    stop = true;
    int a200 = 0, a503 = 0;
    for (int i = 0; i < N_HOG; i++) {
        pthread_join(th[i], NULL);
        a200 += h[i].n_200;
        a503 += h[i].n_503;
    }
    printf("  fair share: %d of %d honest requests served (slowest %.1f s); the attacker: %d served, %d refused\n",
           served, n, worst, a200, a503);
    ASSERT_EQ(served, n);
    ASSERT_TRUE(a200 > 0); /* the attacker was served too: its share, not nothing */
    server_stop(&gw);
}

static const kvt_case cases[] = {
    KVT_CASE(test_content_length),
    KVT_CASE(test_json_bomb),
    KVT_CASE(test_slowloris),
    KVT_CASE(test_fair_share),
};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
