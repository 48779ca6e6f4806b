/* What the relay (include/kvasir/relay.h) costs on loopback (not a test).
 * A relay server, a node behind it and a coordinator, each with its own
 * loop thread; the node serves an echo (or a sink) over a TLS session that
 * the coordinator runs end to end inside the circuit, pinned to the node's
 * key. The same service on a direct TLS connection over loopback is the
 * reference, measured in the same run.
 *   - latency: n round trips of a 64-byte message, one at a time; the
 *     median and 99th percentile of each path and the median difference
 *     (what the relay adds per round trip);
 *   - throughput: mb MiB sent one way in 64 KiB messages, acknowledged at
 *     the end, through each path (Gbit/s of application bytes).
 * Usage: bench_relay [n mb]; defaults 2000 256. */
#define _POSIX_C_SOURCE 200809L
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/link.h"
#include "kvasir/net.h"
#include "kvasir/relay.h"
#include "kvasir/tls.h"

static kv_node_key g_node_key, g_coord_key, g_relay_key;
static kv_tls_ctx *g_node_ctx, *g_coord_ctx, *g_relay_ctx;

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static void die(const char *what, const kv_diag *d) {
    fprintf(stderr, "bench_relay: %s: %s\n", what, d ? d->msg : "");
    exit(1);
}

/* The node's service on fd: a TLS server; then a mode byte: 'E' echoes
 * 64-byte messages until the end, 'S' takes a u64 count of bytes, reads
 * them and answers one byte. */
static void *service(void *p) {
    int fd = (int)(intptr_t)p;
    kv_tls *t = NULL;
    const kv_tls_opts o = {.server = true};
    kv_diag d = {0};
    uint8_t *buf = malloc(1u << 16);
    uint8_t mode = 0;
    if (kv_tls_new(&t, g_node_ctx, &o, &d) || kv_tls_handshake_fd(t, fd, 5000, &d) ||
        kv_tls_read_full(t, &mode, 1, NULL, 5000, &d))
        goto out;
    if (mode == 'E') {
        while (!kv_tls_read_full(t, buf, 64, NULL, 60000, &d) && !kv_tls_write_full(t, buf, 64, 60000, &d)) {
        }
    } else if (mode == 'S') {
        uint64_t n = 0;
        if (kv_tls_read_full(t, &n, 8, NULL, 5000, &d)) goto out;
        while (n) {
            size_t k = n > (1u << 16) ? (1u << 16) : (size_t)n;
            if (kv_tls_read_full(t, buf, k, NULL, 60000, &d)) goto out;
            n -= k;
        }
        (void)kv_tls_write_full(t, "k", 1, 5000, &d);
    }
out:
    kv_tls_free(t);
    close(fd);
    free(buf);
    return NULL;
}

static void on_circuit(void *data, int fd) {
    (void)data;
    pthread_t th;
    if (pthread_create(&th, NULL, service, (void *)(intptr_t)fd)) close(fd);
    else pthread_detach(th);
}

static int g_lfd;
static void *acceptor(void *p) {
    (void)p;
    for (;;) {
        int fd = accept(g_lfd, NULL, NULL);
        if (fd < 0) return NULL;
        on_circuit(NULL, fd);
    }
}

static kv_tls *client_tls(int fd) {
    kv_tls *t = NULL;
    const kv_tls_opts o = {.pin_key = g_node_key.pk};
    kv_diag d = {0};
    if (kv_tls_new(&t, g_coord_ctx, &o, &d) || kv_tls_handshake_fd(t, fd, 5000, &d)) die("inner TLS", &d);
    return t;
}

static int cmp64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* n round trips; sorted times (us) into out[n] */
static void latency(kv_tls *t, int n, int64_t *out) {
    uint8_t m[64] = {'x'}, r[64];
    kv_diag d = {0};
    if (kv_tls_write_full(t, "E", 1, 5000, &d)) die("mode", &d);
    for (int i = -100; i < n; i++) { /* 100 warm-up trips */
        const int64_t t0 = now_us();
        if (kv_tls_write_full(t, m, 64, 5000, &d) || kv_tls_read_full(t, r, 64, NULL, 5000, &d)) die("echo", &d);
        if (i >= 0) out[i] = now_us() - t0;
    }
    qsort(out, (size_t)n, sizeof *out, cmp64);
}

/* mb MiB one way; Gbit/s */
static double throughput(kv_tls *t, uint64_t mb) {
    uint64_t n = mb << 20;
    uint8_t *buf = calloc(1, 1u << 16), ack = 0;
    kv_diag d = {0};
    const int64_t t0 = now_us();
    if (kv_tls_write_full(t, "S", 1, 5000, &d) || kv_tls_write_full(t, &n, 8, 5000, &d)) die("sink", &d);
    for (uint64_t left = n; left;) {
        size_t k = left > (1u << 16) ? (1u << 16) : (size_t)left;
        if (kv_tls_write_full(t, buf, k, 60000, &d)) die("send", &d);
        left -= k;
    }
    if (kv_tls_read_full(t, &ack, 1, NULL, 60000, &d) || ack != 'k') die("ack", &d);
    const double s = (double)(now_us() - t0) / 1e6;
    free(buf);
    return (double)n * 8 / s / 1e9;
}

static char *cpu_name(char *out, size_t cap) {
    snprintf(out, cap, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10)) {
            char *c = strchr(line, ':');
            if (c) snprintf(out, cap, "%s", c + 2);
            out[strcspn(out, "\n")] = 0;
            break;
        }
    if (f) fclose(f);
    return out;
}

int main(int argc, char **argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 2000;
    const uint64_t mb = argc > 2 ? (uint64_t)atoll(argv[2]) : 256;
    if (n < 10 || n > 1000000 || mb < 1 || mb > 65536) {
        fprintf(stderr, "usage: bench_relay [n (10..1000000) mb (1..65536)]\n");
        return 2;
    }
    uint8_t seed[32];
    kv_diag d = {0};
    memset(seed, 1, 32), kv_node_key_from_seed(&g_node_key, seed);
    memset(seed, 2, 32), kv_node_key_from_seed(&g_coord_key, seed);
    memset(seed, 3, 32), kv_node_key_from_seed(&g_relay_key, seed);
    if (kv_tls_ctx_new(&g_node_ctx, &g_node_key, &d) || kv_tls_ctx_new(&g_coord_ctx, &g_coord_key, &d) ||
        kv_tls_ctx_new(&g_relay_ctx, &g_relay_key, &d))
        die("TLS contexts", &d);
    char fp[KV_TLS_FP_HEX + 1], daddr[80], cpu[128];
    kv_tls_ctx_fingerprint(g_relay_ctx, fp);
    /* the relay path */
    kv_relay_server *s = NULL;
    const kv_relay_server_opts so = {.listen = "127.0.0.1:0", .tls = g_relay_ctx};
    if (kv_relay_server_start(&s, &so, &d)) die("relay", &d);
    kv_relay_client_opts co = {.relay = kv_relay_server_addr(s), .relay_sha256 = fp, .tls = g_node_ctx,
                               .role = KV_RELAY_ROLE_NODE, .key = &g_node_key, .on_circuit = on_circuit};
    kv_relay_client *node = NULL, *coord = NULL;
    if (kv_relay_client_start(&node, &co, &d)) die("node", &d);
    co.tls = g_coord_ctx, co.role = KV_RELAY_ROLE_COORD;
    if (kv_relay_client_start(&coord, &co, &d)) die("coordinator", &d);
    kv_relay_client_stats cs;
    for (int i = 0; i < 500; i++) {
        kv_relay_client_stats_get(node, &cs);
        if (cs.up) break;
        usleep(10000);
    }
    /* the direct path */
    if (kv_net_listen("127.0.0.1:0", 16, &g_lfd, daddr, sizeof daddr, &d)) die("listen", &d);
    fcntl(g_lfd, F_SETFL, fcntl(g_lfd, F_GETFL) & ~O_NONBLOCK); /* the acceptor blocks */
    pthread_t ath;
    pthread_create(&ath, NULL, acceptor, NULL);
    int64_t *rl = malloc((size_t)n * sizeof *rl), *dl = malloc((size_t)n * sizeof *dl);
    int fd = -1, dfd = -1;
    if (kv_relay_client_open(coord, g_node_key.pk, 5000, &fd, &d)) die("open", &d);
    if (kv_link_connect(daddr, 2000, &dfd, &d)) die("direct connect", &d);
    kv_tls *rt = client_tls(fd), *dt = client_tls(dfd);
    latency(dt, n, dl);
    latency(rt, n, rl);
    kv_tls_free(rt), kv_tls_free(dt), close(fd), close(dfd);
    if (kv_relay_client_open(coord, g_node_key.pk, 5000, &fd, &d)) die("open", &d);
    if (kv_link_connect(daddr, 2000, &dfd, &d)) die("direct connect", &d);
    rt = client_tls(fd), dt = client_tls(dfd);
    const double dg = throughput(dt, mb), rg = throughput(rt, mb);
    kv_tls_free(rt), kv_tls_free(dt), close(fd), close(dfd);
    printf("bench_relay on %s (%ld CPUs online), loopback, TLS 1.3 end to end inside the circuit\n",
           cpu_name(cpu, sizeof cpu), sysconf(_SC_NPROCESSORS_ONLN));
    printf("round trip of 64 bytes, %d trips: direct median %lld us p99 %lld us; relayed median %lld us p99 %lld us;"
           " added median %lld us\n",
           n, (long long)dl[n / 2], (long long)dl[n * 99 / 100], (long long)rl[n / 2], (long long)rl[n * 99 / 100],
           (long long)(rl[n / 2] - dl[n / 2]));
    printf("one way, %llu MiB in 64 KiB writes: direct %.2f Gbit/s; relayed %.2f Gbit/s\n", (unsigned long long)mb, dg,
           rg);
    kv_relay_stats st;
    kv_relay_server_stats(s, &st);
    printf("relay: %llu circuits, %llu bytes to the node, %llu to the coordinator; it buffered %zu bytes at most\n",
           (unsigned long long)st.circuits_total, (unsigned long long)st.bytes_to_node,
           (unsigned long long)st.bytes_to_coord, st.mem_peak);
    kv_relay_client_free(coord);
    kv_relay_client_free(node);
    kv_relay_server_free(s);
    free(rl);
    free(dl);
    return 0;
}
