/* The slot flood in tests: one thread holds silent sockets from several
 * loopback source addresses (127.0.0.N, bound before connect) to a worker
 * and opens a new one as soon as the worker closes one, as a stranger
 * filling a worker's handshake places would. Header-only (static
 * functions): include it once per test executable, after
 * test_auth_support.h (KVT_UNUSED). */
#ifndef KVASIR_TEST_FLOOD_SUPPORT_H
#define KVASIR_TEST_FLOOD_SUPPORT_H

#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define FLOOD_MAX 256

typedef struct flood {
    uint16_t port;          /* the worker's, on 127.0.0.1 */
    int first, n_addr;      /* source addresses 127.0.0.first .. first + n_addr - 1 */
    int per_addr;           /* sockets held from each */
    atomic_int stop;
    atomic_long opened;     /* connections made */
    pthread_t th;
} flood;

/* A nonblocking connect from 127.0.0.src to the worker, or -1. */
static KVT_UNUSED int flood_dial(uint16_t port, int src) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
#ifdef IP_BIND_ADDRESS_NO_PORT
    int one = 1; /* the port is chosen at connect: the 4-tuple stays unique under churn */
    setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one);
#endif
    struct sockaddr_in a = {0}, b = {0};
    a.sin_family = b.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(0x7f000000u | (uint32_t)src);
    b.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    b.sin_port = htons(port);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) || (connect(fd, (struct sockaddr *)&b, sizeof b) && errno != EINPROGRESS)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* One thread holds n_addr x per_addr sockets that never send a byte, and
 * opens a new one as soon as the worker closes one (one process, as a
 * stranger would). */
static KVT_UNUSED void *flood_main(void *arg) {
    flood *f = arg;
    struct pollfd pf[FLOOD_MAX];
    int src[FLOOD_MAX];
    const int n = f->n_addr * f->per_addr;
    for (int i = 0; i < n; i++) {
        src[i] = f->first + i / f->per_addr;
        pf[i].fd = flood_dial(f->port, src[i]);
        pf[i].events = POLLIN;
        if (pf[i].fd >= 0) atomic_fetch_add(&f->opened, 1);
    }
    while (!atomic_load(&f->stop)) {
        (void)poll(pf, (nfds_t)n, 10);
        for (int i = 0; i < n; i++) {
            bool gone = pf[i].fd < 0;
            if (!gone && (pf[i].revents & (POLLIN | POLLHUP | POLLERR))) {
                uint8_t sink[4096];
                for (;;) {
                    const ssize_t k = read(pf[i].fd, sink, sizeof sink);
                    if (k > 0) continue;
                    gone = k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
                    break;
                }
            }
            pf[i].revents = 0;
            if (!gone) continue;
            if (pf[i].fd >= 0) close(pf[i].fd);
            pf[i].fd = flood_dial(f->port, src[i]);
            if (pf[i].fd >= 0) atomic_fetch_add(&f->opened, 1);
        }
    }
    for (int i = 0; i < n; i++)
        if (pf[i].fd >= 0) close(pf[i].fd);
    return NULL;
}

static KVT_UNUSED bool flood_start(flood *f, const char *worker_addr, int first, int n_addr, int per_addr) {
    const char *colon = strrchr(worker_addr, ':');
    memset(f, 0, sizeof *f);
    f->port = colon ? (uint16_t)atoi(colon + 1) : 0;
    f->first = first;
    f->n_addr = n_addr;
    f->per_addr = per_addr;
    return f->port && n_addr * per_addr <= FLOOD_MAX && !pthread_create(&f->th, NULL, flood_main, f);
}

static KVT_UNUSED void flood_stop(flood *f) {
    atomic_store(&f->stop, 1);
    pthread_join(f->th, NULL);
}

#endif
