/* The LAN beacon (include/kvasir/beacon.h): the datagram codec, the hub's
 * sender thread and the node's bounded wait.
 *
 * The parser reads through explicit little-endian loads and checks the
 * datagram's size against its own url_len before looking at the URL; the
 * sender and the listener never allocate per datagram. The sender thread
 * sleeps in poll() on a pipe, so kv_beacon_free stops it at once. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>
#include <stdio.h>

#include "kvasir/beacon.h"
#include "kvasir/hub.h"

static uint32_t kv_le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint16_t kv_le16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static bool kv_beacon_hex64(const char *s, size_t n) {
    if (n != 64) return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return false;
    return true;
}

/* "http://" or "https://" and then at least one byte of the URL set ('#'
 * and '=' for a hub's "#sha256=" pin, include/kvasir/https.h). */
static int kv_beacon_check_url(const char *u, size_t n, kv_diag *d) {
    static const char ok[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.:/[]_-#=";
    if (n < 1 || n > KV_BEACON_MAX_URL) return kv_fail(d, KV_EFORMAT, "beacon: URL of %zu bytes (1..%u)", n, KV_BEACON_MAX_URL);
    for (size_t i = 0; i < n; i++)
        if (!u[i] || !memchr(ok, u[i], sizeof ok - 1))
            return kv_fail(d, KV_EFORMAT, "beacon: URL byte %zu (0x%02x) is not allowed", i, (unsigned char)u[i]);
    size_t p = n >= 7 && !memcmp(u, "http://", 7) ? 7 : n >= 8 && !memcmp(u, "https://", 8) ? 8 : 0;
    if (!p) return kv_fail(d, KV_EFORMAT, "beacon: URL does not start with http:// or https://");
    if (p == n) return kv_fail(d, KV_EFORMAT, "beacon: URL has no host");
    return 0;
}

int kv_beacon_encode(const kv_beacon_msg *m, uint8_t *buf, size_t cap, size_t *n, kv_diag *d) {
    const size_t ul = strnlen(m->url, sizeof m->url);
    if (!kv_beacon_hex64(m->model_id, strnlen(m->model_id, sizeof m->model_id)))
        return kv_fail(d, KV_EINVAL, "beacon: model id is not 64 lowercase hex digits");
    int rc = kv_beacon_check_url(m->url, ul, d);
    if (rc) return kv_fail(d, KV_EINVAL, "%s", d->msg);
    if (cap < KV_BEACON_HEADER + ul) return kv_fail(d, KV_ERANGE, "beacon: %zu bytes of room, %zu needed", cap, KV_BEACON_HEADER + ul);
    const uint32_t magic = KV_BEACON_MAGIC;
    for (int i = 0; i < 4; i++) buf[i] = (uint8_t)(magic >> (8 * i));
    buf[4] = (uint8_t)KV_BEACON_VERSION;
    buf[5] = 0;
    buf[6] = (uint8_t)ul;
    buf[7] = (uint8_t)(ul >> 8);
    memcpy(buf + 8, m->model_id, 64);
    memcpy(buf + KV_BEACON_HEADER, m->url, ul);
    *n = KV_BEACON_HEADER + ul;
    return 0;
}

int kv_beacon_parse(const uint8_t *buf, size_t n, kv_beacon_msg *out, kv_diag *d) {
    memset(out, 0, sizeof *out);
    if (n < KV_BEACON_HEADER) return kv_fail(d, KV_EFORMAT, "beacon: %zu bytes, at least %u needed", n, KV_BEACON_HEADER);
    if (n > KV_BEACON_MAX_SIZE) return kv_fail(d, KV_EFORMAT, "beacon: %zu bytes, at most %u", n, KV_BEACON_MAX_SIZE);
    if (kv_le32(buf) != KV_BEACON_MAGIC) return kv_fail(d, KV_EFORMAT, "beacon: wrong magic 0x%08x", kv_le32(buf));
    const uint16_t ver = kv_le16(buf + 4), ul = kv_le16(buf + 6);
    if (ver != KV_BEACON_VERSION) return kv_fail(d, KV_EUNSUPPORTED, "beacon: version %u (this build reads %u)", ver, KV_BEACON_VERSION);
    if ((size_t)ul + KV_BEACON_HEADER != n)
        return kv_fail(d, KV_EFORMAT, "beacon: url_len %u disagrees with the datagram's %zu bytes", ul, n);
    if (!kv_beacon_hex64((const char *)buf + 8, 64))
        return kv_fail(d, KV_EFORMAT, "beacon: model id is not 64 lowercase hex digits");
    int rc = kv_beacon_check_url((const char *)buf + KV_BEACON_HEADER, ul, d);
    if (rc) return rc;
    memcpy(out->model_id, buf + 8, 64);
    memcpy(out->url, buf + KV_BEACON_HEADER, ul);
    return 0;
}

/* ---- sender ------------------------------------------------------------- */

struct kv_beacon {
    int fd;                          /* UDP socket, SO_BROADCAST */
    int wake[2];                     /* pipe: a byte in [1] stops the thread */
    pthread_t th;
    struct sockaddr_in to;
    uint32_t interval_ms;
    uint8_t dgram[KV_BEACON_MAX_SIZE];
    size_t len;
    atomic_uint_fast64_t sent, failed;
};

static void *kv_beacon_thread(void *arg) {
    kv_beacon *b = arg;
    for (;;) {
        ssize_t k = sendto(b->fd, b->dgram, b->len, 0, (const struct sockaddr *)&b->to, sizeof b->to);
        if (k == (ssize_t)b->len) atomic_fetch_add(&b->sent, 1);
        else atomic_fetch_add(&b->failed, 1);
        struct pollfd p = {b->wake[0], POLLIN, 0};
        int r = poll(&p, 1, (int)b->interval_ms);
        if (r > 0) break;
        if (r < 0 && errno != EINTR) break;
    }
    return NULL;
}

int kv_beacon_start(kv_beacon **out, const kv_beacon_opts *o, kv_diag *d) {
    *out = NULL;
    kv_beacon *b = calloc(1, sizeof *b);
    if (!b) return kv_fail(d, KV_ENOMEM, "beacon: out of memory");
    b->fd = b->wake[0] = b->wake[1] = -1;
    int rc = kv_beacon_encode(&o->msg, b->dgram, sizeof b->dgram, &b->len, d);
    if (rc) goto fail;
    b->to.sin_family = AF_INET;
    b->to.sin_port = htons(o->port ? o->port : KV_BEACON_PORT);
    const char *to = o->to ? o->to : "127.255.255.255";
    if (inet_pton(AF_INET, to, &b->to.sin_addr) != 1) {
        rc = kv_fail(d, KV_EINVAL, "beacon: '%s' is not an IPv4 address", to);
        goto fail;
    }
    b->interval_ms = o->interval_ms ? o->interval_ms : KV_BEACON_INTERVAL_MS;
    int one = 1;
    if ((b->fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0)) < 0 ||
        setsockopt(b->fd, SOL_SOCKET, SO_BROADCAST, &one, sizeof one) || pipe2(b->wake, O_CLOEXEC)) {
        rc = kv_fail(d, KV_EIO, "beacon: socket: %s", strerror(errno));
        goto fail;
    }
    if (pthread_create(&b->th, NULL, kv_beacon_thread, b)) {
        rc = kv_fail(d, KV_EIO, "beacon: cannot start its thread");
        goto fail;
    }
    *out = b;
    return 0;
fail:
    if (b->fd >= 0) close(b->fd);
    if (b->wake[0] >= 0) close(b->wake[0]);
    if (b->wake[1] >= 0) close(b->wake[1]);
    free(b);
    return rc;
}

uint64_t kv_beacon_sent(const kv_beacon *b) { return atomic_load(&((kv_beacon *)b)->sent); }

void kv_beacon_free(kv_beacon *b) {
    if (!b) return;
    const char c = 1;
    while (write(b->wake[1], &c, 1) < 0 && errno == EINTR) {
    }
    pthread_join(b->th, NULL);
    close(b->fd);
    close(b->wake[0]);
    close(b->wake[1]);
    free(b);
}

/* ---- listener ------------------------------------------------------------ */

static double kv_beacon_now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

/* "http://0.0.0.0:P/..." -> "http://SENDER:P/..." when it fits. */
static void kv_beacon_fill_host(kv_beacon_msg *m, const struct sockaddr_in *from) {
    char *h = strstr(m->url, "://");
    if (!h || strncmp(h + 3, "0.0.0.0", 7) || (h[10] && h[10] != ':' && h[10] != '/')) return;
    char ip[INET_ADDRSTRLEN], u[sizeof m->url];
    if (!inet_ntop(AF_INET, &from->sin_addr, ip, sizeof ip)) return;
    int k = snprintf(u, sizeof u, "%.*s%s%s", (int)(h + 3 - m->url), m->url, ip, h + 10);
    if (k > 0 && (size_t)k < sizeof u) memcpy(m->url, u, (size_t)k + 1);
}

int kv_beacon_wait(uint16_t port, uint32_t timeout_ms, const char *model_id, kv_beacon_msg *out, uint32_t *n_bad,
                   kv_diag *d) {
    memset(out, 0, sizeof *out);
    if (n_bad) *n_bad = 0;
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0), one = 1;
    if (fd < 0) return kv_fail(d, KV_EIO, "beacon: socket: %s", strerror(errno));
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port ? port : KV_BEACON_PORT)};
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) || bind(fd, (struct sockaddr *)&sa, sizeof sa)) {
        int e = errno;
        close(fd);
        return kv_fail(d, KV_EIO, "beacon: cannot listen on UDP port %u: %s", ntohs(sa.sin_port), strerror(e));
    }
    const double end = kv_beacon_now_ms() + timeout_ms;
    uint8_t buf[KV_BEACON_MAX_SIZE + 1]; /* one more: an oversized datagram is seen as such */
    int rc = KV_ETIMEOUT;
    for (;;) {
        const double left = end - kv_beacon_now_ms();
        if (left <= 0) break;
        struct pollfd p = {fd, POLLIN, 0};
        int r = poll(&p, 1, (int)left + 1);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) continue;
        struct sockaddr_in from;
        socklen_t fl = sizeof from;
        ssize_t k = recvfrom(fd, buf, sizeof buf, MSG_TRUNC, (struct sockaddr *)&from, &fl);
        if (k < 0) continue;
        kv_diag pd = {0};
        kv_beacon_msg m;
        if (kv_beacon_parse(buf, (size_t)k, &m, &pd) || (model_id && strcmp(m.model_id, model_id))) {
            if (n_bad) (*n_bad)++;
            continue;
        }
        kv_beacon_fill_host(&m, &from);
        *out = m;
        rc = 0;
        break;
    }
    close(fd);
    if (rc)
        return kv_fail(d, KV_ETIMEOUT, "no hub beacon%s%s heard on UDP port %u within %u ms (start a hub with --beacon, "
                       "or give --hub URL)", model_id ? " for model " : "", model_id ? model_id : "",
                       ntohs(sa.sin_port), timeout_ms);
    return 0;
}

/* The model id of GET url/v1/status into id[65]. */
static int kv_beacon_status_id(const char *url, char id[65], kv_diag *d) {
    char u[KV_BEACON_MAX_URL + 16], *body = NULL;
    size_t n = 0;
    long st = 0;
    snprintf(u, sizeof u, "%s/v1/status", url);
    int rc = kv_hub_http_get(u, 1u << 16, 3000, &body, &n, &st, d);
    if (rc) return rc;
    rc = KV_EPROTO;
    json_error_t je;
    json_t *j = st == 200 ? json_loadb(body, n, 0, &je) : NULL;
    const char *s = json_string_value(json_object_get(j, "model_id"));
    if (s && kv_beacon_hex64(s, strlen(s))) {
        memcpy(id, s, 65);
        rc = 0;
    } else {
        kv_fail(d, KV_EPROTO, "%s answered HTTP %ld without a model id", u, st);
    }
    json_decref(j);
    free(body);
    return rc;
}

int kv_beacon_find_hub(uint16_t port, uint32_t timeout_ms, const char *model_id, char *url, size_t cap, kv_diag *d) {
    const double end = kv_beacon_now_ms() + timeout_ms;
    int rc = KV_ETIMEOUT;
    char why[300] = "";
    for (;;) {
        const double left = end - kv_beacon_now_ms();
        if (left < 1) break;
        kv_beacon_msg m;
        rc = kv_beacon_wait(port, (uint32_t)left, model_id, &m, NULL, d);
        if (rc == KV_ETIMEOUT && !why[0])
            return kv_fail(d, KV_ETIMEOUT, "no hub beacon%s%s heard on UDP port %u within %u ms (start a hub with "
                           "--beacon, or give --hub URL)", model_id ? " for model " : "", model_id ? model_id : "",
                           port ? port : KV_BEACON_PORT, timeout_ms);
        if (rc) break;
        char id[65];
        kv_diag sd = {0};
        if (kv_beacon_status_id(m.url, id, &sd)) {
            snprintf(why, sizeof why, "%.250s", sd.msg);
            continue;
        }
        if (strcmp(id, m.model_id)) {
            snprintf(why, sizeof why, "%s serves another model than its beacon names", m.url);
            rc = KV_EHASH;
            continue;
        }
        if (strlen(m.url) >= cap) return kv_fail(d, KV_ERANGE, "beacon: URL too long");
        memcpy(url, m.url, strlen(m.url) + 1);
        return 0;
    }
    if (why[0]) return kv_fail(d, rc == KV_EHASH ? KV_EHASH : KV_ETIMEOUT, "no usable hub beacon on UDP port %u within %u ms; last: %s",
                               port ? port : KV_BEACON_PORT, timeout_ms, why);
    return rc;
}
