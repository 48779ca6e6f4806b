/* Connection guard for the libmicrohttpd servers (see http_guard.h): who is
 * connected from where, since when, and which connections to close.
 *
 * Invariants: a record exists from MHD's NOTIFY_CONNECTION STARTED to its
 * CLOSED (libmicrohttpd closes the socket only after CLOSED returns), and
 * every shutdown() of a record's socket happens under g->mu while the
 * record is listed, so the guard never touches a descriptor that was closed
 * and reused. The guard only shuts a socket down (the connection's own
 * thread then sees the end and closes it); it never closes one. */
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "http/http_guard.h"

#define KV_GUARD_KEY 17 /* family byte + IPv4 or the /64 of IPv6 */

typedef struct kv_guard_conn {
    struct kv_guard_conn *prev, *next;
    uint8_t key[KV_GUARD_KEY];  /* the client's address, as counted */
    int fd;                     /* its socket (shut down, never closed, here) */
    int64_t start_ms;           /* when its current request began (monotonic) */
    bool busy;                  /* the request is whole: being answered */
    bool closing;               /* shut down by the guard; gone soon */
} kv_guard_conn;

struct kv_http_guard {
    kv_http_guard_opts o;
    pthread_mutex_t mu;
    pthread_cond_t cv;          /* wakes the deadline thread to stop */
    pthread_t th;
    bool th_up, quit;
    /* guarded by mu */
    kv_guard_conn *head;
    uint32_t n_open, n_closing;
    kv_http_guard_stats st;
};

static int64_t kv_mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void kv_guard_key(const struct sockaddr *sa, uint8_t key[KV_GUARD_KEY]) {
    memset(key, 0, KV_GUARD_KEY);
    if (!sa) return;
    if (sa->sa_family == AF_INET) {
        key[0] = 4;
        memcpy(key + 1, &((const struct sockaddr_in *)sa)->sin_addr, 4);
    } else if (sa->sa_family == AF_INET6) {
        const uint8_t *a = ((const struct sockaddr_in6 *)sa)->sin6_addr.s6_addr;
        static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        if (!memcmp(a, mapped, 12)) {
            key[0] = 4;
            memcpy(key + 1, a + 12, 4);
        } else {
            key[0] = 6;
            memcpy(key + 1, a, 8); /* one host is given a /64 */
        }
    }
}

static void kv_guard_shut_locked(kv_http_guard *g, kv_guard_conn *k) {
    if (k->closing) return;
    k->closing = true;
    g->n_closing++;
    if (k->fd >= 0) shutdown(k->fd, SHUT_RDWR);
}

static void *kv_guard_main(void *arg) {
    kv_http_guard *g = arg;
    pthread_mutex_lock(&g->mu);
    while (!g->quit) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 200 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&g->cv, &g->mu, &ts);
        const int64_t now = kv_mono_ms();
        for (kv_guard_conn *k = g->head; k; k = k->next)
            if (!k->busy && !k->closing && now - k->start_ms > (int64_t)g->o.request_ms) {
                kv_guard_shut_locked(g, k);
                g->st.expired++;
            }
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

int kv_http_guard_open(kv_http_guard **out, const kv_http_guard_opts *o, kv_diag *d) {
    *out = NULL;
    if (!o->max_conns || !o->per_ip) return kv_fail(d, KV_EINVAL, "http guard: connection limits must be at least 1");
    kv_http_guard *g = calloc(1, sizeof *g);
    if (!g) return kv_fail(d, KV_ENOMEM, "http guard: out of memory");
    g->o = *o;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    if (o->request_ms) {
        if (pthread_create(&g->th, NULL, kv_guard_main, g)) {
            kv_http_guard_free(g);
            return kv_fail(d, KV_EIO, "http guard: cannot start the deadline thread");
        }
        g->th_up = true;
    }
    *out = g;
    return 0;
}

void kv_http_guard_free(kv_http_guard *g) {
    if (!g) return;
    if (g->th_up) {
        pthread_mutex_lock(&g->mu);
        g->quit = true;
        pthread_cond_signal(&g->cv);
        pthread_mutex_unlock(&g->mu);
        pthread_join(g->th, NULL);
    }
    while (g->head) { /* the daemon stopped first: none should be left */
        kv_guard_conn *k = g->head;
        g->head = k->next;
        free(k);
    }
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

unsigned kv_http_guard_mhd_limit(const kv_http_guard *g) { return g->o.max_conns + g->o.max_conns / 4 + 8; }

static int kv_key_cmp(const void *a, const void *b) { return memcmp(a, b, KV_GUARD_KEY); }

/* The oldest incomplete connection of the address that holds the most
 * incomplete ones, and how many that is. Called with mu held. */
static kv_guard_conn *kv_guard_victim_locked(kv_http_guard *g, uint32_t *count) {
    *count = 0;
    uint8_t(*keys)[KV_GUARD_KEY] = malloc((size_t)(g->n_open ? g->n_open : 1) * KV_GUARD_KEY);
    if (!keys) return NULL;
    size_t n = 0;
    for (kv_guard_conn *k = g->head; k; k = k->next)
        if (!k->busy && !k->closing) memcpy(keys[n++], k->key, KV_GUARD_KEY);
    qsort(keys, n, KV_GUARD_KEY, kv_key_cmp);
    size_t best = 0, best_n = 0;
    for (size_t i = 0; i < n;) {
        size_t j = i;
        while (j < n && !memcmp(keys[j], keys[i], KV_GUARD_KEY)) j++;
        if (j - i > best_n) {
            best_n = j - i;
            best = i;
        }
        i = j;
    }
    kv_guard_conn *v = NULL;
    for (kv_guard_conn *k = g->head; best_n && k; k = k->next)
        if (!k->busy && !k->closing && !memcmp(k->key, keys[best], KV_GUARD_KEY) && (!v || k->start_ms < v->start_ms))
            v = k;
    free(keys);
    *count = (uint32_t)best_n;
    return v;
}

enum MHD_Result kv_http_guard_accept(void *cls, const struct sockaddr *addr, socklen_t len) {
    (void)len;
    kv_http_guard *g = cls;
    uint8_t key[KV_GUARD_KEY];
    kv_guard_key(addr, key);
    pthread_mutex_lock(&g->mu);
    uint32_t mine = 0;
    for (kv_guard_conn *k = g->head; k; k = k->next) mine += !k->closing && !memcmp(k->key, key, KV_GUARD_KEY);
    enum MHD_Result ok = MHD_YES;
    if (mine >= g->o.per_ip) {
        g->st.refused_ip++;
        ok = MHD_NO;
    } else if (g->n_open - g->n_closing >= g->o.max_conns) {
        uint32_t most = 0;
        kv_guard_conn *v = kv_guard_victim_locked(g, &most);
        if (v && most >= mine + 2) {
            kv_guard_shut_locked(g, v);
            g->st.evicted++;
        } else {
            g->st.refused_full++;
            ok = MHD_NO;
        }
    }
    pthread_mutex_unlock(&g->mu);
    return ok;
}

void kv_http_guard_notify(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe) {
    kv_http_guard *g = cls;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        kv_guard_conn *k = calloc(1, sizeof *k);
        *socket_context = k;
        if (!k) return; /* untracked: it still has libmicrohttpd's idle timeout */
        const union MHD_ConnectionInfo *ai = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
        kv_guard_key(ai ? ai->client_addr : NULL, k->key);
        const union MHD_ConnectionInfo *fi = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        k->fd = fi ? fi->connect_fd : -1;
        k->start_ms = kv_mono_ms();
        pthread_mutex_lock(&g->mu);
        k->next = g->head;
        if (g->head) g->head->prev = k;
        g->head = k;
        g->n_open++;
        pthread_mutex_unlock(&g->mu);
        return;
    }
    kv_guard_conn *k = *socket_context;
    *socket_context = NULL;
    if (!k) return;
    pthread_mutex_lock(&g->mu);
    if (k->prev) k->prev->next = k->next;
    else g->head = k->next;
    if (k->next) k->next->prev = k->prev;
    g->n_open--;
    if (k->closing) g->n_closing--;
    pthread_mutex_unlock(&g->mu);
    free(k);
}

static kv_guard_conn *kv_guard_of(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *i = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return i ? i->socket_context : NULL;
}

void kv_http_guard_busy(kv_http_guard *g, struct MHD_Connection *c) {
    kv_guard_conn *k = g ? kv_guard_of(c) : NULL;
    if (!k) return;
    pthread_mutex_lock(&g->mu);
    k->busy = true;
    pthread_mutex_unlock(&g->mu);
}

void kv_http_guard_idle(kv_http_guard *g, struct MHD_Connection *c) {
    kv_guard_conn *k = g ? kv_guard_of(c) : NULL;
    if (!k) return;
    pthread_mutex_lock(&g->mu);
    k->busy = false;
    k->start_ms = kv_mono_ms();
    pthread_mutex_unlock(&g->mu);
}

void kv_http_guard_get_stats(kv_http_guard *g, kv_http_guard_stats *out) {
    pthread_mutex_lock(&g->mu);
    *out = g->st;
    out->open = g->n_open;
    pthread_mutex_unlock(&g->mu);
}

/* ---- request framing -------------------------------------------------------- */

typedef struct {
    uint32_t n_len;       /* Content-Length headers */
    bool len_bad;         /* one is not a plain decimal number */
    bool len_differ;      /* two of them differ */
    unsigned long long len;
    bool te;              /* Transfer-Encoding present */
} kv_len_scan;

static enum MHD_Result kv_len_it(void *cls, enum MHD_ValueKind kind, const char *key, const char *value) {
    (void)kind;
    kv_len_scan *s = cls;
    if (!strcasecmp(key, MHD_HTTP_HEADER_TRANSFER_ENCODING)) s->te = true;
    if (strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH)) return MHD_YES;
    unsigned long long v = 0;
    size_t digits = 0;
    for (const char *p = value ? value : ""; *p; p++, digits++) {
        if (*p < '0' || *p > '9' || digits >= 19) {
            s->len_bad = true;
            return MHD_YES;
        }
        v = v * 10 + (unsigned)(*p - '0');
    }
    if (!digits) s->len_bad = true;
    if (s->n_len++ && v != s->len) s->len_differ = true;
    s->len = v;
    return MHD_YES;
}

bool kv_http_lengths_ok(struct MHD_Connection *c, char *why, size_t cap) {
    kv_len_scan s = {0};
    MHD_get_connection_values(c, MHD_HEADER_KIND, kv_len_it, &s);
    if (s.len_bad) return snprintf(why, cap, "a Content-Length header is not a decimal number"), false;
    if (s.len_differ) return snprintf(why, cap, "%u Content-Length headers that differ", s.n_len), false;
    if (s.n_len && s.te) return snprintf(why, cap, "both Content-Length and Transfer-Encoding"), false;
    return true;
}
