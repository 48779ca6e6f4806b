/* The node side of the hub protocol (include/kvasir/node.h): the shard
 * choice, bounded downloads into the data folder, the coordinator's fetch,
 * and the node's loop (worker thread, registration, heartbeats, storage
 * challenges, re-choice).
 *
 * Invariants: a slab is given to the worker only after its file's SHA-256
 * equals the manifest's (checked in this process, just before the worker
 * opens it); a download never writes past the manifest's size; every path
 * written is DIR/pieces/ + a manifest path (kv_manifest_parse allows only
 * relative [A-Za-z0-9._-] parts, none "." or ".."); every answer from the
 * hub is bounded in size and parsed by a bounded parser. */
#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <sodium.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "http/https_curl.h"
#include "hub/curl_body.h"
#include "kvasir/dispatch_evidence.h"
#include "kvasir/dispatch_proto.h"
#include "kvasir/dispatch_remote.h"
#include "kvasir/dispatch_worker.h"
#include "kvasir/node.h"
#include "kvasir/pieces.h"
#include "kvasir/quant.h"
#include "kvasir/relay.h"

/* ---- shard choice ------------------------------------------------------------ */

typedef struct kv_choice_key {
    uint32_t idx, cls, held;
    int64_t deficit;
    uint64_t tie;               /* per-node order among equals */
} kv_choice_key;

uint64_t kv_node_tie(uint64_t salt, uint32_t layer, uint32_t first) {
    uint64_t x = salt ^ ((uint64_t)layer << 32 | first);
    x ^= x >> 33; /* splitmix64 finalizer */
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static uint32_t kv_choice_class(const kv_hub_shard_view *s, uint32_t others) {
    if (others == 0) return 0;
    if ((uint64_t)others + 1 <= s->wanted) return 1;
    return 2;
}

static int kv_choice_cmp(const void *a, const void *b) {
    const kv_choice_key *x = a, *y = b;
    if (x->cls != y->cls) return x->cls < y->cls ? -1 : 1;
    if (x->held != y->held) return x->held > y->held ? -1 : 1;
    if (x->deficit != y->deficit) return x->deficit > y->deficit ? -1 : 1;
    if (x->tie != y->tie) return x->tie < y->tie ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

int kv_node_choose(const kv_hub_shard_view *shards, size_t n, uint64_t budget, const uint8_t *held, uint64_t salt,
                   uint8_t *take, uint64_t *bytes, kv_diag *d) {
    memset(take, 0, n);
    *bytes = 0;
    kv_choice_key *k = malloc((n ? n : 1) * sizeof *k);
    if (!k) return kv_fail(d, KV_ENOMEM, "choose: out of memory");
    uint64_t used = 0;
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t h = held && held[i] ? 1 : 0;
        uint32_t others = shards[i].live >= h ? shards[i].live - h : 0;
        if (h && others == 0) { /* the last live replica is never dropped */
            take[i] = 1;
            used += shards[i].bytes;
            continue;
        }
        k[m++] = (kv_choice_key){(uint32_t)i, kv_choice_class(&shards[i], others), h,
                                 (int64_t)shards[i].wanted - (int64_t)others,
                                 kv_node_tie(salt, shards[i].layer, shards[i].first)};
    }
    qsort(k, m, sizeof *k, kv_choice_cmp);
    for (size_t j = 0; j < m; j++) {
        const kv_hub_shard_view *s = &shards[k[j].idx];
        if (used <= budget && s->bytes <= budget - used) {
            take[k[j].idx] = 1;
            used += s->bytes;
        }
    }
    free(k);
    *bytes = used;
    return 0;
}

int kv_node_surplus(const char *json, size_t len, const kv_hub_shard_view *view, size_t n, const uint8_t pk[32],
                    uint8_t *drop, kv_diag *d) {
    memset(drop, 0, n);
    json_error_t je;
    json_t *root = json_loadb(json, len, 0, &je);
    if (!root) return kv_fail(d, KV_EFORMAT, "placement: bad JSON at line %d: %s", je.line, je.text);
    json_t *sh = json_object_get(root, "shards");
    if (!json_is_array(sh)) {
        json_decref(root);
        return kv_fail(d, KV_EFORMAT, "placement: needs {\"shards\": [...]}");
    }
    char me[65];
    kv_hex(pk, 32, me);
    for (size_t k = 0; k < json_array_size(sh); k++) {
        json_t *e = json_array_get(sh, k), *nodes = json_object_get(e, "nodes");
        json_t *L = json_object_get(e, "layer"), *F = json_object_get(e, "first");
        if (!json_is_integer(L) || !json_is_integer(F) || !json_is_array(nodes)) continue;
        size_t i = 0; /* the market view's shard (manifest order) */
        while (i < n && !(view[i].layer == json_integer_value(L) && view[i].first == json_integer_value(F))) i++;
        if (i == n || view[i].live <= view[i].wanted) continue;
        /* rank among the listed holders by key; listed twice counts once */
        bool listed = false;
        uint32_t below = 0;
        for (size_t j = 0; j < json_array_size(nodes); j++) {
            const char *key = json_string_value(json_object_get(json_array_get(nodes, j), "key"));
            if (!key || strlen(key) != 64) continue;
            const int c = strcmp(key, me);
            if (!c) listed = true;
            else if (c < 0) below++;
        }
        if (listed && below >= view[i].wanted) drop[i] = 1;
    }
    json_decref(root);
    return 0;
}

int kv_node_parse_size(const char *s, uint64_t *out, kv_diag *d) {
    *out = 0;
    uint64_t v = 0;
    const char *p = s;
    if (!*p) return kv_fail(d, KV_EINVAL, "size '' is empty");
    for (; *p >= '0' && *p <= '9'; p++) {
        if (v > (UINT64_MAX - 9) / 10) return kv_fail(d, KV_EINVAL, "size '%.40s' overflows", s);
        v = v * 10 + (uint64_t)(*p - '0');
    }
    if (p == s) return kv_fail(d, KV_EINVAL, "size '%.40s' must be digits with an optional K, M, G or T", s);
    unsigned sh = 0;
    if (*p) {
        switch (*p) {
        case 'k': case 'K': sh = 10; break;
        case 'm': case 'M': sh = 20; break;
        case 'g': case 'G': sh = 30; break;
        case 't': case 'T': sh = 40; break;
        default: return kv_fail(d, KV_EINVAL, "size '%.40s' must be digits with an optional K, M, G or T", s);
        }
        p++;
        if (*p == 'i' && p[1] == 'B') p += 2;
        else if (*p == 'B') p++;
        if (*p) return kv_fail(d, KV_EINVAL, "size '%.40s' must be digits with an optional K, M, G or T", s);
    }
    if (sh && v > (UINT64_MAX >> sh)) return kv_fail(d, KV_EINVAL, "size '%.40s' overflows", s);
    *out = v << sh;
    return 0;
}

/* ---- HTTP ------------------------------------------------------------------------ */

/* A signed POST of body to hub_url + path; the answer (at most
 * KV_NODE_MAX_REPLY bytes) in *out (caller frees), status in *status. */
static int kv_node_post(const char *hub_url, kv_node_key *key, const char *path, const char *body, char **out,
                        long *status, kv_diag *d) {
    *out = NULL;
    *status = 0;
    char url[1024], h1[128], h2[64], h3[200];
    if (snprintf(url, sizeof url, "%s%s", hub_url, path) >= (int)sizeof url)
        return kv_fail(d, KV_EINVAL, "hub URL is too long");
    kv_hub_auth a;
    size_t blen = strlen(body);
    kv_hub_sign(key, "POST", path, body, blen, kv_node_next_counter(key), &a);
    snprintf(h1, sizeof h1, "X-Kvasir-Key: %s", a.key);
    snprintf(h2, sizeof h2, "X-Kvasir-Counter: %s", a.counter);
    snprintf(h3, sizeof h3, "X-Kvasir-Signature: %s", a.sig);
    CURL *c = curl_easy_init();
    if (!c) return kv_fail(d, KV_ENOMEM, "http: curl_easy_init failed");
    struct curl_slist *hl = NULL;
    hl = curl_slist_append(hl, h1);
    hl = curl_slist_append(hl, h2);
    hl = curl_slist_append(hl, h3);
    hl = curl_slist_append(hl, "Content-Type: application/json");
    hl = curl_slist_append(hl, "Expect:");
    kv_curl_body b = {.max = KV_NODE_MAX_REPLY};
    char ubuf[2048]; /* url without its #sha256= pin */
    int rc = kv_https_curl_url(c, url, ubuf, sizeof ubuf, d);
    if (rc) {
        curl_easy_cleanup(c);
        curl_slist_free_all(hl);
        return rc;
    }
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, hl);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)blen);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, kv_curl_body_write);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &b);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 10000L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    CURLcode r = curl_easy_perform(c);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, status);
    curl_easy_cleanup(c);
    curl_slist_free_all(hl);
    if (r != CURLE_OK) {
        free(b.p);
        if (b.over) return kv_fail(d, KV_EIO, "http: %s: answer larger than %u bytes", ubuf, KV_NODE_MAX_REPLY);
        return kv_https_curl_fail(r, ubuf, d);
    }
    if (!b.p && !(b.p = calloc(1, 1))) return kv_fail(d, KV_ENOMEM, "http: out of memory");
    *out = b.p;
    return 0;
}

int kv_node_hub_post(const char *hub_url, kv_node_key *key, const char *path, const char *body, char **out,
                     long *status, kv_diag *d) {
    return kv_node_post(hub_url, key, path, body, out, status, d);
}

/* GET hub_url + path, bounded; 200 required. */
static int kv_node_get(const char *hub_url, const char *path, size_t max, char **out, size_t *len, kv_diag *d) {
    char url[1024];
    if (snprintf(url, sizeof url, "%s%s", hub_url, path) >= (int)sizeof url)
        return kv_fail(d, KV_EINVAL, "hub URL is too long");
    long st = 0;
    int rc = kv_hub_http_get(url, max, 30000, out, len, &st, d);
    if (rc) return rc;
    if (st != 200) {
        free(*out);
        *out = NULL;
        return kv_fail(d, KV_EIO, "http: %s: status %ld", url, st);
    }
    return 0;
}

/* ---- files ---------------------------------------------------------------------- */

int kv_node_piece_path(const char *dir, const char *rel, char *out, size_t cap, kv_diag *d) {
    if (!rel[0] || rel[0] == '/' || strstr(rel, ".."))
        return kv_fail(d, KV_EINVAL, "piece path '%.200s' must stay inside the data folder", rel);
    if (snprintf(out, cap, "%s/%s/%s", dir, KV_NODE_PIECES, rel) >= (int)cap)
        return kv_fail(d, KV_EINVAL, "piece path '%.200s' is too long", rel);
    return 0;
}

/* mkdir -p of the folders above path (not path itself). */
static int kv_mkdirs_for(const char *path, kv_diag *d) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s", path);
    for (char *p = tmp + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(tmp, 0700) && errno != EEXIST) return kv_fail(d, KV_EIO, "cannot create '%s': %s", tmp, strerror(errno));
        *p = '/';
    }
    return 0;
}

int kv_node_fetch_manifest(const char *hub_url, const char *dir, kv_manifest **out, kv_diag *d) {
    *out = NULL;
    char *body = NULL;
    size_t len = 0;
    int rc = kv_node_get(hub_url, "/v1/manifest", KV_MANIFEST_MAX_BYTES, &body, &len, d);
    if (rc) return rc;
    if ((rc = kv_manifest_parse(out, body, len, d))) {
        free(body);
        return rc;
    }
    char path[4096], tmp[4200];
    if ((rc = kv_node_piece_path(dir, "manifest.json", path, sizeof path, d)) || (rc = kv_mkdirs_for(path, d))) goto fail;
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f || fwrite(body, 1, len, f) != len || fclose(f)) {
        if (f) unlink(tmp);
        rc = kv_fail(d, KV_EIO, "cannot write '%s': %s", tmp, strerror(errno));
        goto fail;
    }
    if (rename(tmp, path)) {
        rc = kv_fail(d, KV_EIO, "cannot rename '%s': %s", tmp, strerror(errno));
        unlink(tmp);
        goto fail;
    }
    free(body);
    return 0;
fail:
    free(body);
    kv_manifest_free(*out);
    *out = NULL;
    return rc;
}

typedef struct kv_dl {
    int fd;
    uint64_t have, size;        /* bytes in the file; the manifest's size */
    int over;                   /* the server sent more than size */
    int werr;
    kv_node_progress_fn progress;
    void *parg;
    const char *path;
    uint64_t last_report;
} kv_dl;

static size_t kv_dl_write(char *data, size_t sz, size_t nm, void *arg) {
    kv_dl *w = arg;
    size_t n = sz * nm;
    if (n > w->size - w->have) {
        w->over = 1;
        return 0;
    }
    size_t done = 0;
    while (done < n) {
        ssize_t r = write(w->fd, data + done, n - done);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            w->werr = errno ? errno : EIO;
            return 0;
        }
        done += (size_t)r;
    }
    w->have += n;
    if (w->progress && (w->have - w->last_report >= (1u << 20) || w->have == w->size)) {
        w->last_report = w->have;
        w->progress(w->parg, w->path, w->have, w->size);
    }
    return n;
}

/* Range answers must start where we asked: a 200 to a Range request means
 * the server sends the whole file, so the partial file is started over. */
typedef struct kv_hdr {
    long status;
    int range_ok;               /* Content-Range starts at the offset asked */
    uint64_t want_off;
} kv_hdr;

static size_t kv_dl_header(char *data, size_t sz, size_t nm, void *arg) {
    kv_hdr *h = arg;
    size_t n = sz * nm;
    if (n > 21 && !strncasecmp(data, "Content-Range: bytes ", 21)) {
        char tmp[64];
        size_t l = n - 21 < sizeof tmp - 1 ? n - 21 : sizeof tmp - 1;
        memcpy(tmp, data + 21, l);
        tmp[l] = 0;
        char *e;
        errno = 0;
        unsigned long long a = strtoull(tmp, &e, 10);
        h->range_ok = !errno && e != tmp && *e == '-' && a == h->want_off;
    }
    return n;
}

/* One transfer into path.part from its current size. */
static int kv_dl_once(const char *url, const char *part, const kv_manifest_file *f, kv_node_progress_fn progress,
                      void *parg, kv_diag *d) {
    int fd = open(part, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) return kv_fail(d, KV_EIO, "cannot open '%s': %s", part, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
        close(fd);
        return kv_fail(d, KV_EIO, "'%s' is not a regular file", part);
    }
    uint64_t have = (uint64_t)st.st_size;
    if (have > f->size) { /* longer than the piece: start over */
        if (ftruncate(fd, 0)) {
            close(fd);
            return kv_fail(d, KV_EIO, "cannot truncate '%s': %s", part, strerror(errno));
        }
        have = 0;
    }
    if (have == f->size) {
        close(fd);
        return 0;
    }
    CURL *c = curl_easy_init();
    if (!c) {
        close(fd);
        return kv_fail(d, KV_ENOMEM, "http: curl_easy_init failed");
    }
    kv_dl w = {.fd = fd, .have = have, .size = f->size, .progress = progress, .parg = parg, .path = f->path,
               .last_report = have};
    kv_hdr h = {.want_off = have};
    char ubuf[2048]; /* url without its #sha256= pin */
    int urc = kv_https_curl_url(c, url, ubuf, sizeof ubuf, d);
    if (urc) {
        curl_easy_cleanup(c);
        close(fd);
        return urc;
    }
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, kv_dl_write);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &w);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, kv_dl_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, &h);
    curl_easy_setopt(c, CURLOPT_FAILONERROR, 1L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, 10000L);
    /* a stalled transfer (under 1 KiB/s for 30 s) is abandoned and resumed */
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1024L);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, 30L);
    /* Range: bytes=HAVE-; a 200 to it (the whole file again) is
     * CURLE_RANGE_ERROR before any byte is written */
    if (have) curl_easy_setopt(c, CURLOPT_RESUME_FROM_LARGE, (curl_off_t)have);
    CURLcode r = curl_easy_perform(c);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &h.status);
    curl_easy_cleanup(c);
    close(fd);
    if (w.over) return kv_fail(d, KV_EFORMAT, "%s: the hub sent more than the manifest's %" PRIu64 " bytes", url, f->size);
    if (w.werr) return kv_fail(d, KV_EIO, "cannot write '%s': %s", part, strerror(w.werr));
    if (r == CURLE_RANGE_ERROR) return kv_fail(d, KV_EPROTO, "%s: the hub cannot resume at %" PRIu64, url, have);
    if (r != CURLE_OK) return kv_https_curl_fail(r, ubuf, d);
    if (have && (h.status != 206 || !h.range_ok))
        return kv_fail(d, KV_EPROTO, "%s: resume at %" PRIu64 " not answered with that range", url, have);
    if (w.have != f->size) return kv_fail(d, KV_EIO, "%s: transfer ended at %" PRIu64 " of %" PRIu64 " bytes", url, w.have, f->size);
    return 0;
}

int kv_node_fetch_piece(const char *hub_url, const char *dir, const kv_manifest_file *f, kv_node_progress_fn progress,
                        void *parg, kv_diag *d) {
    if (!f->has_sha256)
        return kv_fail(d, KV_EUNSUPPORTED, "piece '%s' has no SHA-256 in the manifest: it cannot be verified", f->path);
    char path[4096], part[4200], url[2048];
    int rc = kv_node_piece_path(dir, f->path, path, sizeof path, d);
    if (rc || (rc = kv_mkdirs_for(path, d))) return rc;
    uint8_t got[32];
    struct stat st;
    if (!lstat(path, &st)) {
        if (S_ISREG(st.st_mode) && (uint64_t)st.st_size == f->size && !kv_pieces_hash_file(path, got, d) &&
            !memcmp(got, f->sha256, 32))
            return 0;
        unlink(path); /* other bytes are never served */
    }
    if (snprintf(url, sizeof url, "%s/v1/pieces/%s", hub_url, f->path) >= (int)sizeof url)
        return kv_fail(d, KV_EINVAL, "piece URL is too long");
    snprintf(part, sizeof part, "%s.part", path);
    rc = kv_dl_once(url, part, f, progress, parg, d);
    if (rc == KV_EPROTO) { /* a server that cannot resume: start over once */
        unlink(part);
        rc = kv_dl_once(url, part, f, progress, parg, d);
    }
    if (rc) return rc;
    if ((rc = kv_pieces_hash_file(part, got, d))) return rc;
    if (memcmp(got, f->sha256, 32)) {
        unlink(part);
        return kv_fail(d, KV_EHASH, "piece '%s' from the hub does not match the manifest's SHA-256: deleted", f->path);
    }
    if (rename(part, path)) return kv_fail(d, KV_EIO, "cannot rename '%s': %s", part, strerror(errno));
    return 0;
}

/* ---- placement ------------------------------------------------------------------- */

#define KV_ADDR_OK "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-:[]"

void kv_node_workers_free(char **workers, uint32_t n) {
    if (!workers) return;
    for (uint32_t i = 0; i < n; i++) free(workers[i]);
    free(workers);
}

/* ---- the placement map, as a coordinator keeps it ----
 * Read in two passes over the parsed document. The first checks every
 * entry (an address of the allowed characters that parses as HOST:PORT with
 * a port 1..65535; a key of 64 lowercase hex digits, or none) and gathers
 * the distinct addresses in a hash table, marking one listed with two keys;
 * the second keeps, per shard and in the hub's order, the first
 * KV_PLACEMENT_MAX_REPLICAS holders whose address is not marked. So no
 * entry can do more than be skipped, and the addresses kept number at most
 * KV_PLACEMENT_MAX_REPLICAS per shard, whatever the map's size. */

static int kv_json_hex(json_t *o, const char *name, uint8_t *out, size_t n);

typedef struct kv_pl_addr {
    const char *s;        /* in the JSON document */
    uint8_t key[32];
    bool has_key;
    bool conflict;        /* listed with two keys */
    bool relayed;         /* an entry says "relayed": true */
    int64_t kept;         /* index among the kept addresses, -1 if none */
} kv_pl_addr;

typedef struct kv_pl_reader {
    kv_pl_addr *a;        /* [n_a] distinct addresses, first seen first */
    size_t n_a, cap_a;
    uint32_t *slot;       /* [n_slot] open addressing: index + 1 into a, 0 = empty */
    size_t n_slot;
} kv_pl_reader;

static uint64_t kv_pl_hash(const char *s) { /* FNV-1a */
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

/* The index of address s, added if new (-1: out of memory). */
static int64_t kv_pl_find(kv_pl_reader *r, const char *s, bool add) {
    if (add && 2 * (r->n_a + 1) > r->n_slot) { /* at most half full */
        const size_t ns = r->n_slot ? 2 * r->n_slot : 1024;
        uint32_t *sl = calloc(ns, sizeof *sl);
        if (!sl) return -1;
        for (size_t i = 0; i < r->n_a; i++) {
            size_t h = (size_t)kv_pl_hash(r->a[i].s) & (ns - 1);
            while (sl[h]) h = (h + 1) & (ns - 1);
            sl[h] = (uint32_t)i + 1;
        }
        free(r->slot);
        r->slot = sl;
        r->n_slot = ns;
    }
    if (!r->n_slot) return -2;
    size_t h = (size_t)kv_pl_hash(s) & (r->n_slot - 1);
    for (; r->slot[h]; h = (h + 1) & (r->n_slot - 1))
        if (!strcmp(r->a[r->slot[h] - 1].s, s)) return r->slot[h] - 1;
    if (!add) return -2;
    if (r->n_a == r->cap_a) {
        const size_t nc = r->cap_a ? 2 * r->cap_a : 256;
        kv_pl_addr *na = realloc(r->a, nc * sizeof *na);
        if (!na) return -1;
        r->a = na;
        r->cap_a = nc;
    }
    r->a[r->n_a] = (kv_pl_addr){.s = s, .kept = -1};
    r->slot[h] = (uint32_t)++r->n_a;
    return (int64_t)r->n_a - 1;
}

/* Entry nd of the map: its address (NULL when the entry is invalid, why
 * says what) and its key (*has_key false when it gives none). */
static const char *kv_pl_entry(json_t *nd, uint8_t key[32], bool *has_key, const char **why) {
    json_t *a = json_object_get(nd, "addr");
    const char *s = json_is_string(a) ? json_string_value(a) : NULL;
    const size_t l = s ? json_string_length(a) : 0;
    char host[KV_HUB_MAX_ADDR + 1];
    uint16_t port = 0;
    kv_diag d = {0};
    if (!s || !l || l > KV_HUB_MAX_ADDR || strspn(s, KV_ADDR_OK) != l ||
        kv_link_parse_addr(s, host, sizeof host, &port, &d) || !port) {
        *why = "addr must be HOST:PORT";
        return NULL;
    }
    /* a key that is not 64 hex digits is no key: the worker is then asked
       for none, as for an entry without one (a hub always gives one) */
    *has_key = !kv_json_hex(nd, "key", key, 32);
    return s;
}

__attribute__((format(printf, 2, 3))) static void kv_pl_note(kv_placement *p, const char *fmt, ...) {
    if (p->note[0]) return; /* the first reason only */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->note, sizeof p->note, fmt, ap);
    va_end(ap);
}

void kv_node_placement_free(kv_placement *p) {
    if (!p) return;
    kv_node_workers_free(p->addr, p->n_addr);
    free(p->key);
    free(p->relayed);
    free(p->entry);
    memset(p, 0, sizeof *p);
}

int kv_node_placement_parse(const char *json, size_t len, kv_placement *p, kv_diag *d) {
    memset(p, 0, sizeof *p);
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return kv_fail(d, KV_EFORMAT, "placement: bad JSON at line %d: %s", je.line, je.text);
    json_t *sh = json_object_get(root, "shards");
    if (!json_is_object(root) || !json_is_array(sh)) {
        json_decref(root);
        return kv_fail(d, KV_EFORMAT, "placement: needs {\"shards\": [...]}");
    }
    int rc = 0;
    kv_pl_reader r = {0};
    size_t n_entries = 0, cap_e = 0, cap_a = 0;
    json_t *rl = json_object_get(root, "relay"); /* the hub's relay: ignored unless well-formed */
    json_t *rp = json_object_get(rl, "port"), *rf = json_object_get(rl, "sha256");
    if (json_is_integer(rp) && json_integer_value(rp) > 0 && json_integer_value(rp) <= 65535 && json_is_string(rf) &&
        !kv_tls_fingerprint_parse(json_string_value(rf), json_string_length(rf), p->relay_sha256, NULL))
        p->relay_port = (uint16_t)json_integer_value(rp);
    else
        p->relay_sha256[0] = 0;
    static const uint8_t zero[32];
    /* 1. every entry checked, the addresses gathered, two keys marked */
    for (size_t i = 0; i < json_array_size(sh) && !rc; i++) {
        json_t *nodes = json_object_get(json_array_get(sh, i), "nodes");
        if (!json_is_array(nodes)) {
            p->n_skipped++;
            kv_pl_note(p, "shards[%zu].nodes must be an array", i);
            continue;
        }
        for (size_t j = 0; j < json_array_size(nodes); j++) {
            uint8_t k[32];
            bool has_key = false;
            const char *why = NULL;
            const char *s = kv_pl_entry(json_array_get(nodes, j), k, &has_key, &why);
            if (!s) {
                p->n_skipped++;
                kv_pl_note(p, "shards[%zu].nodes[%zu].%s", i, j, why);
                continue;
            }
            const int64_t ai = kv_pl_find(&r, s, true);
            if (ai < 0) {
                rc = kv_fail(d, KV_ENOMEM, "placement: out of memory");
                break;
            }
            kv_pl_addr *x = &r.a[ai];
            if (json_is_true(json_object_get(json_array_get(nodes, j), "relayed"))) x->relayed = true;
            if (!has_key || !memcmp(k, zero, 32)) continue;
            if (!x->has_key) {
                memcpy(x->key, k, 32);
                x->has_key = true;
            } else if (memcmp(x->key, k, 32) && !x->conflict) {
                x->conflict = true;
                p->n_conflicts++;
                kv_pl_note(p, "address %.200s is listed with two keys (dropped)", s);
            }
        }
    }
    /* 2. per shard, the first holders in the hub's order */
    for (size_t i = 0; i < json_array_size(sh) && !rc; i++) {
        json_t *nodes = json_object_get(json_array_get(sh, i), "nodes");
        uint32_t taken = 0;
        for (size_t j = 0; j < json_array_size(nodes) && !rc; j++) {
            uint8_t k[32];
            bool has_key = false;
            const char *why = NULL;
            const char *s = kv_pl_entry(json_array_get(nodes, j), k, &has_key, &why);
            if (!s) continue;
            kv_pl_addr *x = &r.a[kv_pl_find(&r, s, false)];
            if (x->conflict) continue;
            bool again = false; /* one address twice in a shard counts once */
            for (size_t e = n_entries; e-- > 0 && p->entry[e].shard == i && !again;)
                again = p->entry[e].addr == (uint32_t)x->kept && x->kept >= 0;
            if (again) continue;
            if (taken == KV_PLACEMENT_MAX_REPLICAS) {
                p->n_over++;
                continue;
            }
            if (x->kept < 0) {
                if (p->n_addr == cap_a) {
                    const size_t nc = cap_a ? 2 * cap_a : 64;
                    char **na = realloc(p->addr, nc * sizeof *na);
                    if (na) p->addr = na;
                    uint8_t (*nk)[32] = realloc(p->key, nc * sizeof *nk);
                    if (nk) p->key = nk;
                    uint8_t *nr = realloc(p->relayed, nc);
                    if (nr) p->relayed = nr;
                    if (!na || !nk || !nr) {
                        rc = kv_fail(d, KV_ENOMEM, "placement: out of memory");
                        break;
                    }
                    cap_a = nc;
                }
                if (!(p->addr[p->n_addr] = strdup(s))) {
                    rc = kv_fail(d, KV_ENOMEM, "placement: out of memory");
                    break;
                }
                memcpy(p->key[p->n_addr], x->has_key ? x->key : zero, 32);
                p->relayed[p->n_addr] = x->relayed;
                x->kept = p->n_addr++;
            }
            if (n_entries == cap_e) {
                const size_t nc = cap_e ? 2 * cap_e : 256;
                kv_placement_entry *ne = realloc(p->entry, nc * sizeof *ne);
                if (!ne) {
                    rc = kv_fail(d, KV_ENOMEM, "placement: out of memory");
                    break;
                }
                p->entry = ne;
                cap_e = nc;
            }
            p->entry[n_entries++] = (kv_placement_entry){(uint32_t)i, (uint32_t)j, (uint32_t)x->kept};
            taken++;
        }
    }
    p->n_entry = n_entries;
    if (!rc && !p->n_addr && (p->n_skipped || p->n_conflicts))
        rc = kv_fail(d, KV_EFORMAT, "placement: no usable entry: %s", p->note);
    free(r.a);
    free(r.slot);
    json_decref(root);
    if (rc) kv_node_placement_free(p);
    return rc;
}

int kv_node_parse_placement(const char *json, size_t len, char ***out, uint32_t *n_out, kv_diag *d) {
    *out = NULL;
    *n_out = 0;
    kv_placement p;
    const int rc = kv_node_placement_parse(json, len, &p, d);
    if (rc) return rc;
    *out = p.addr;
    *n_out = p.n_addr;
    p.addr = NULL;
    p.n_addr = 0;
    kv_node_placement_free(&p);
    return 0;
}

/* The relayed nodes of p routed through the hub's relay; a failure is
 * p's note (the nodes it concerns stay unreachable, the others serve). */
static void kv_node_relay_routes_noted(const char *hub_url, kv_placement *p) {
    kv_diag e = {0};
    if (kv_node_relay_routes(hub_url, p, &e) < 0 && !p->note[0]) snprintf(p->note, sizeof p->note, "%.250s", e.msg);
}

int kv_node_fetch_coordinator(const char *hub_url, const char *dir, char *manifest_path, size_t cap, char ***workers,
                              uint32_t *n_workers, kv_node_progress_fn progress, void *parg, kv_diag *d) {
    *workers = NULL;
    *n_workers = 0;
    kv_manifest *m = NULL;
    int rc = kv_node_fetch_manifest(hub_url, dir, &m, d);
    if (rc) return rc;
    rc = kv_node_fetch_piece(hub_url, dir, &m->backbone, progress, parg, d);
    kv_manifest_free(m);
    if (rc) return rc;
    if ((rc = kv_node_piece_path(dir, "manifest.json", manifest_path, cap, d))) return rc;
    char *body = NULL;
    size_t len = 0;
    if ((rc = kv_node_get(hub_url, "/v1/placement", KV_NODE_MAX_MARKET, &body, &len, d))) return rc;
    kv_placement p;
    rc = kv_node_placement_parse(body, len, &p, d);
    free(body);
    if (!rc) {
        kv_node_relay_routes_noted(hub_url, &p);
        *workers = p.addr;
        *n_workers = p.n_addr;
        p.addr = NULL;
        p.n_addr = 0;
        kv_node_placement_free(&p);
    }
    if (!rc && !*n_workers) {
        kv_node_workers_free(*workers, 0);
        *workers = NULL;
        rc = kv_fail(d, KV_ENOTFOUND, "hub %s lists no live node", hub_url);
    }
    return rc;
}

/* ---- a coordinator that follows the map ---------------------------------------- */

static int64_t kv_mono_ms(void);

int kv_node_fetch_placement(const char *hub_url, kv_placement *p, kv_diag *d) {
    memset(p, 0, sizeof *p);
    char *body = NULL;
    size_t len = 0;
    int rc = kv_node_get(hub_url, "/v1/placement", KV_NODE_MAX_MARKET, &body, &len, d);
    if (!rc) rc = kv_node_placement_parse(body, len, p, d);
    free(body);
    if (!rc) kv_node_relay_routes_noted(hub_url, p);
    return rc;
}

int kv_node_placement_follow(const char *hub_url, kv_remote *r, bool require_keys, kv_diag *d) {
    kv_placement p;
    int rc = kv_node_fetch_placement(hub_url, &p, d);
    if (rc) return rc;
    static const uint8_t zero[32];
    int added = 0;
    for (uint32_t i = 0; i < p.n_addr; i++) {
        kv_diag wd = {0};
        /* the node must prove the key the map lists it with */
        const int a = kv_remote_add_worker(r, p.addr[i], require_keys && memcmp(p.key[i], zero, 32) ? p.key[i] : NULL,
                                           &wd);
        if (a > 0) added++;
        else if (a < 0 && !rc) rc = kv_fail(d, a, "%s", wd.msg); /* the first; the others are still added */
    }
    kv_node_placement_free(&p);
    return rc ? rc : added;
}

int kv_node_await_coverage(const char *hub_url, kv_remote *r, bool require_keys, uint32_t wait_ms, FILE *log,
                           kv_diag *d) {
    const int64_t t0 = kv_mono_ms();
    uint32_t backoff = 100;
    for (;;) {
        kv_remote_coverage cov;
        uint32_t miss = 0;
        kv_remote_get_coverage(r, &cov, &miss, 1);
        if (cov.covered == cov.total) return 0;
        const kv_manifest_slab *sl = &kv_remote_manifest(r)->slabs[miss];
        const int64_t spent = kv_mono_ms() - t0;
        if (spent >= (int64_t)wait_ms)
            return kv_fail(d, KV_ENOTFOUND, "remote: layer %u experts %u-%u are served by no worker (%u up; %u of %u "
                           "slabs covered) after reading the placement map again for %" PRId64 " ms", sl->layer,
                           sl->first, sl->last, cov.workers_up, cov.covered, cov.total, spent);
        if (log)
            fprintf(log, "kvasir: layer %u experts %u-%u are served by no worker yet (%u of %u slabs covered): reading "
                    "the placement map again in %u ms\n", sl->layer, sl->first, sl->last, cov.covered, cov.total, backoff);
        /* wait (progressing connections: handshakes of workers added), then read again */
        const int64_t until = kv_mono_ms() + backoff;
        for (int64_t now = kv_mono_ms(); now < until; now = kv_mono_ms()) kv_remote_tend(r, (int)(until - now));
        kv_diag fd = {0};
        const int rc = kv_node_placement_follow(hub_url, r, require_keys, &fd);
        if (rc < 0 && log) fprintf(log, "kvasir: placement: %s\n", fd.msg); /* the hub may be back next time */
        /* the handshakes of those added, within one backoff */
        const int64_t hs = kv_mono_ms() + backoff;
        for (int64_t now = kv_mono_ms(); now < hs; now = kv_mono_ms()) {
            kv_remote_tend(r, (int)(hs - now) < 50 ? (int)(hs - now) : 50);
            kv_remote_get_coverage(r, &cov, &miss, 1);
            if (cov.covered == cov.total) return 0;
        }
        backoff = backoff * 2 > 2000 ? 2000 : backoff * 2;
    }
}

/* ---- authenticated dispatch: the hub's key, vouchers, worker keys ----------------- */

/* A "key"-like member: 2n lowercase hex digits into out[n]. */
static int kv_json_hex(json_t *o, const char *name, uint8_t *out, size_t n) {
    json_t *v = json_object_get(o, name);
    if (!json_is_string(v) || json_string_length(v) != 2 * n) return -1;
    const char *s = json_string_value(v);
    for (size_t i = 0; i < 2 * n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return -1;
    for (size_t i = 0; i < n; i++) {
        int a = s[2 * i] <= '9' ? s[2 * i] - '0' : s[2 * i] - 'a' + 10;
        int b = s[2 * i + 1] <= '9' ? s[2 * i + 1] - '0' : s[2 * i + 1] - 'a' + 10;
        out[i] = (uint8_t)(a << 4 | b);
    }
    return 0;
}

int kv_node_parse_hub_key(const char *json, size_t len, uint8_t out[32], kv_diag *d) {
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return kv_fail(d, KV_EFORMAT, "status: bad JSON at line %d: %s", je.line, je.text);
    int rc = json_is_object(root) && !kv_json_hex(root, "hub_key", out, 32)
                 ? 0
                 : kv_fail(d, KV_EFORMAT, "status: needs \"hub_key\": 64 lowercase hex digits (a hub of protocol v3)");
    json_decref(root);
    return rc;
}

int kv_node_parse_voucher(const char *json, size_t len, kv_voucher *v, uint8_t hub_key[32], kv_diag *d) {
    memset(v, 0, sizeof *v);
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return kv_fail(d, KV_EFORMAT, "voucher: bad JSON at line %d: %s", je.line, je.text);
    int rc = 0;
    kv_voucher t = {{0}, 0, {0}};
    uint8_t hk[32];
    json_t *e = json_object_get(root, "expires_ms");
    if (!json_is_object(root) || kv_json_hex(root, "key", t.key, 32) || kv_json_hex(root, "sig", t.sig, 64) ||
        kv_json_hex(root, "hub_key", hk, 32) || !json_is_integer(e) || json_integer_value(e) <= 0) {
        rc = kv_fail(d, KV_EFORMAT, "voucher: needs key, sig, hub_key (hex) and expires_ms > 0");
    } else { /* nothing is written unless all of it parsed */
        t.expires_ms = (uint64_t)json_integer_value(e);
        *v = t;
        memcpy(hub_key, hk, 32);
    }
    json_decref(root);
    return rc;
}

typedef struct kv_pl_name {
    const char *s;
    uint32_t i;
} kv_pl_name;

static int kv_pl_cmp_name(const void *a, const void *b) {
    return strcmp(((const kv_pl_name *)a)->s, ((const kv_pl_name *)b)->s);
}

int kv_node_parse_placement_keys(const char *json, size_t len, char *const *workers, uint32_t n, uint8_t (*keys)[32],
                                 kv_diag *d) {
    memset(keys, 0, (size_t)n * 32);
    kv_placement p;
    const int rc = kv_node_placement_parse(json, len, &p, d);
    if (rc) return rc;
    /* the kept addresses by name: sorted, then one binary search each */
    kv_pl_name *ord = malloc((p.n_addr ? p.n_addr : 1) * sizeof *ord);
    if (!ord) {
        kv_node_placement_free(&p);
        return kv_fail(d, KV_ENOMEM, "placement: out of memory");
    }
    for (uint32_t i = 0; i < p.n_addr; i++) ord[i] = (kv_pl_name){p.addr[i], i};
    qsort(ord, p.n_addr, sizeof *ord, kv_pl_cmp_name);
    for (uint32_t w = 0; w < n; w++) {
        uint32_t lo = 0, hi = p.n_addr;
        while (lo < hi) {
            const uint32_t mid = lo + (hi - lo) / 2;
            const int c = strcmp(ord[mid].s, workers[w]);
            if (!c) {
                memcpy(keys[w], p.key[ord[mid].i], 32);
                break;
            }
            if (c < 0) lo = mid + 1;
            else hi = mid;
        }
    }
    free(ord);
    kv_node_placement_free(&p);
    return 0;
}

int kv_node_fetch_hub_key(const char *hub_url, uint8_t out[32], kv_diag *d) {
    char *body = NULL;
    size_t len = 0;
    int rc = kv_node_get(hub_url, "/v1/status", KV_NODE_MAX_REPLY, &body, &len, d);
    if (!rc) rc = kv_node_parse_hub_key(body, len, out, d);
    free(body);
    return rc;
}

int kv_node_fetch_auth(const char *hub_url, kv_node_key *key, char *const *workers, uint32_t n, uint8_t (*keys)[32],
                       kv_voucher *v, kv_diag *d) {
    char *body = NULL;
    size_t len = 0;
    long st = 0;
    int rc = kv_node_post(hub_url, key, "/v1/voucher", "{}", &body, &st, d);
    if (!rc && st != 200) rc = kv_fail(d, st == 403 ? KV_EAUTH : KV_EPROTO, "voucher refused (%ld): %.300s", st, body);
    uint8_t hk[32];
    if (!rc) rc = kv_node_parse_voucher(body, strlen(body), v, hk, d);
    if (!rc && memcmp(v->key, key->pk, 32)) rc = kv_fail(d, KV_EPROTO, "voucher: made out for another key");
    free(body);
    body = NULL;
    if (rc || !n) return rc;
    if ((rc = kv_node_get(hub_url, "/v1/placement", KV_NODE_MAX_MARKET, &body, &len, d))) return rc;
    rc = kv_node_parse_placement_keys(body, len, workers, n, keys, d);
    free(body);
    return rc;
}

/* A u32 field of o; false when absent, not an integer or out of range. */
static bool kv_json_u32(json_t *o, const char *name, uint32_t *out) {
    json_t *v = json_object_get(o, name);
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > (json_int_t)UINT32_MAX) return false;
    *out = (uint32_t)json_integer_value(v);
    return true;
}

/* Base64 field name of o into out[cap]: its length in *n; false when absent or malformed. */
static bool kv_json_b64(json_t *o, const char *name, uint8_t *out, size_t cap, size_t *n) {
    json_t *v = json_object_get(o, name);
    if (!json_is_string(v)) return false;
    const char *s = json_string_value(v), *end = NULL;
    const size_t sl = json_string_length(v);
    return sodium_base642bin(out, cap, s, sl, NULL, n, &end, sodium_base64_VARIANT_ORIGINAL) == 0 && end == s + sl;
}

/* The "evidence" object of a report: bounds first, rows into one block. */
static int kv_parse_evidence(json_t *e, const uint8_t key[32], kv_evidence **out, kv_diag *d) {
    const size_t row_max = (size_t)KV_PROTO_MAX_EMBD * 4;
    kv_evidence *ev = calloc(1, sizeof *ev + 2 * row_max);
    if (!ev) return kv_fail(d, KV_ENOMEM, "report: out of memory");
    uint8_t *x = (uint8_t *)(ev + 1), *y = x + row_max;
    size_t xn = 0, yn = 0;
    json_t *pr = json_object_get(e, "proof");
    int rc = 0;
    if (!json_is_object(e) || !kv_json_u32(e, "layer", &ev->layer) || !kv_json_u32(e, "enc", &ev->enc) ||
        !kv_json_u32(e, "out_enc", &ev->out_enc) || !kv_json_u32(e, "n_pairs", &ev->n_pairs) ||
        !kv_json_u32(e, "pair", &ev->pair) || !kv_json_u32(e, "expert", &ev->expert) ||
        kv_json_hex(e, "sig", ev->sig, 64) || !json_is_array(pr) || json_array_size(pr) > KV_EVIDENCE_MAX_PROOF ||
        !kv_json_b64(e, "x", x, row_max, &xn) || !kv_json_b64(e, "y", y, row_max, &yn)) {
        rc = kv_fail(d, KV_EFORMAT, "report: evidence needs layer, enc, out_enc, n_pairs, pair, expert (integers), "
                                    "x and y (base64 rows), proof (at most %u hashes of 64 hex digits), sig (128 hex "
                                    "digits)", KV_EVIDENCE_MAX_PROOF);
        goto fail;
    }
    ev->n_proof = (uint32_t)json_array_size(pr);
    for (uint32_t i = 0; i < ev->n_proof; i++) {
        const char *h = json_string_value(json_array_get(pr, i));
        if (!h || kv_key_from_hex(h, ev->proof[i], NULL)) {
            rc = kv_fail(d, KV_EFORMAT, "report: evidence proof hash %u is not 64 hex digits", i);
            goto fail;
        }
    }
    const size_t es = kv_enc_size(ev->enc);
    if (!es || !xn || xn % es) {
        rc = kv_fail(d, KV_EFORMAT, "report: evidence x of %zu bytes in encoding %u", xn, ev->enc);
        goto fail;
    }
    ev->n_embd = (uint32_t)(xn / es);
    if (kv_evidence_y_bytes(ev) != yn) {
        rc = kv_fail(d, KV_EFORMAT, "report: evidence y of %zu bytes, %u values in encoding %u take %zu", yn,
                     ev->n_embd, ev->out_enc, kv_evidence_y_bytes(ev));
        goto fail;
    }
    memcpy(ev->worker_key, key, 32);
    ev->x = x;
    ev->y = y;
    *out = ev;
    return 0;
fail:
    free(ev);
    return rc;
}

void kv_hub_report_free(kv_hub_report *r) {
    if (!r) return;
    free(r->ev);
    r->ev = NULL;
    r->has_evidence = false;
}

int kv_hub_parse_report(const char *json, size_t len, kv_hub_report *out, kv_diag *d) {
    memset(out, 0, sizeof *out);
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return kv_fail(d, KV_EFORMAT, "report: bad JSON at line %d: %s", je.line, je.text);
    int rc = 0;
    json_t *r = json_object_get(root, "reason"), *e = json_object_get(root, "evidence");
    if (!json_is_object(root) || kv_json_hex(root, "key", out->key, 32) || !json_is_string(r) ||
        json_string_length(r) > KV_HUB_MAX_REASON) {
        rc = kv_fail(d, KV_EFORMAT, "report: needs {\"key\": 64 hex digits, \"reason\": text of at most %u bytes}",
                     KV_HUB_MAX_REASON);
    } else {
        const char *t = json_string_value(r);
        size_t n = 0;
        for (size_t i = 0; t[i] && n < KV_HUB_MAX_REASON; i++) /* printable ASCII only: it is logged and served */
            out->reason[n++] = (t[i] >= 0x20 && t[i] < 0x7f && t[i] != '"' && t[i] != '\\') ? t[i] : '?';
        out->reason[n] = 0;
        if (e && !(rc = kv_parse_evidence(e, out->key, &out->ev, d))) out->has_evidence = true;
    }
    json_decref(root);
    if (rc) memset(out, 0, sizeof *out);
    return rc;
}

/* The "evidence" object of a report body. NULL when out of memory. */
static json_t *kv_evidence_json(const kv_evidence *ev) {
    const size_t xb = kv_evidence_x_bytes(ev), yb = kv_evidence_y_bytes(ev);
    if (!xb || !yb) return NULL;
    const size_t cap = sodium_base64_ENCODED_LEN(xb > yb ? xb : yb, sodium_base64_VARIANT_ORIGINAL);
    char *b = malloc(cap), sig[129], h[65];
    json_t *e = json_object(), *pr = json_array();
    if (!b || !e || !pr) {
        free(b);
        json_decref(e);
        json_decref(pr);
        return NULL;
    }
    json_object_set_new(e, "layer", json_integer(ev->layer));
    json_object_set_new(e, "enc", json_integer(ev->enc));
    json_object_set_new(e, "out_enc", json_integer(ev->out_enc));
    json_object_set_new(e, "n_pairs", json_integer(ev->n_pairs));
    json_object_set_new(e, "pair", json_integer(ev->pair));
    json_object_set_new(e, "expert", json_integer(ev->expert));
    json_object_set_new(e, "x", json_string(sodium_bin2base64(b, cap, ev->x, xb, sodium_base64_VARIANT_ORIGINAL)));
    json_object_set_new(e, "y", json_string(sodium_bin2base64(b, cap, ev->y, yb, sodium_base64_VARIANT_ORIGINAL)));
    for (uint32_t i = 0; i < ev->n_proof && i < KV_EVIDENCE_MAX_PROOF; i++) {
        kv_hex(ev->proof[i], 32, h);
        json_array_append_new(pr, json_string(h));
    }
    json_object_set_new(e, "proof", pr);
    kv_hex(ev->sig, 64, sig);
    json_object_set_new(e, "sig", json_string(sig));
    free(b);
    return e;
}

int kv_node_report(const char *hub_url, kv_node_key *key, const uint8_t worker_key[32], const char *reason,
                   const kv_evidence *ev, bool *unlisted, kv_diag *d) {
    if (unlisted) *unlisted = false;
    json_t *j = json_object();
    char hex[65];
    kv_hex(worker_key, 32, hex);
    char rs[KV_HUB_MAX_REASON + 1];
    snprintf(rs, sizeof rs, "%s", reason ? reason : "");
    json_object_set_new(j, "key", json_string(hex));
    json_object_set_new(j, "reason", json_string(rs));
    if (ev) {
        json_t *e = kv_evidence_json(ev);
        if (!e) {
            json_decref(j);
            return kv_fail(d, KV_ENOMEM, "report: out of memory");
        }
        json_object_set_new(j, "evidence", e);
    }
    char *body = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    if (!body) return kv_fail(d, KV_ENOMEM, "report: out of memory");
    char *reply = NULL;
    long st = 0;
    int rc = kv_node_post(hub_url, key, "/v1/report", body, &reply, &st, d);
    free(body);
    if (!rc && st != 200)
        rc = kv_fail(d, st == 403 ? KV_EAUTH : st == 422 ? KV_EINVAL : KV_EPROTO, "report refused (%ld): %.300s", st,
                     reply);
    if (!rc && unlisted) {
        json_t *a = json_loads(reply ? reply : "", 0, NULL);
        const char *act = json_string_value(json_object_get(a, "action"));
        *unlisted = act && !strcmp(act, "unlisted");
        json_decref(a);
    }
    free(reply);
    return rc;
}

/* ---- the node ----------------------------------------------------------------------- */

#define KV_NODE_GRACE_MS 10000 /* a retired worker serves this long after a switch */

typedef struct kv_node_worker {
    kv_worker *w;
    pthread_t th;
    bool running;
} kv_node_worker;

struct kv_node {
    kv_node_opts o;
    kv_node_key key;
    kv_manifest *m;
    uint8_t *held;              /* [m->n_slabs] verified, served and announced */
    uint8_t *live;              /* [m->n_slabs] the hub counts us for it (registered, not dropped) */
    uint32_t *peak;             /* [m->n_slabs] the most replicas the market has wanted of it while we ran */
    kv_node_worker cur, old;    /* the serving worker, and the one being retired */
    int64_t old_until_ms;       /* when the retired worker stops */
    char addr[KV_HUB_MAX_ADDR + 1]; /* announced */
    bool registered;
    uint32_t interval_ms;
    int64_t last_beat_ms;       /* monotonic ms of the last heartbeat sent */
    uint64_t salt;              /* from the public key: this node's order among equal shards */
    uint8_t hub_key[32];        /* the hub's key: its vouchers admit coordinators to our worker */
    bool have_hub_key;
    atomic_int stop;
    int stop_pipe[2];
    uint64_t retired_pairs, retired_tokens; /* served by workers already stopped */
    /* the hub's relay, once this node serves through it (docs/HUB.md "Relay") */
    kv_tls_ctx *rtls;           /* the node key's certificate: circuits' end-to-end TLS */
    kv_relay_forward *rfw;      /* circuits to the current worker */
    kv_relay_client *rcl;       /* the one outbound connection */
    char relay_err[512];        /* why the relay could not be used (a kv_diag message), said once */
};

static int64_t kv_mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static void kv_node_log(const kv_node *n, const char *fmt, ...) {
    if (!n->o.log) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(n->o.log, "node: ");
    vfprintf(n->o.log, fmt, ap);
    fputc('\n', n->o.log);
    fflush(n->o.log);
    va_end(ap);
}

int kv_node_open(kv_node **out, const kv_node_opts *opts, kv_diag *d) {
    *out = NULL;
    if (!opts->hub || !opts->dir) return kv_fail(d, KV_EINVAL, "node: needs a hub URL and a data folder");
    if (opts->site && kv_hub_site_check(opts->site, d)) return kv_diag_prefix(d, KV_EINVAL, "node: --site");
    if (opts->has_layers && opts->layer_first > opts->layer_last)
        return kv_fail(d, KV_EINVAL, "node: --layers %u-%u is empty", opts->layer_first, opts->layer_last);
    kv_node *n = calloc(1, sizeof *n);
    if (!n) return kv_fail(d, KV_ENOMEM, "node: out of memory");
    n->o = *opts;
    n->stop_pipe[0] = n->stop_pipe[1] = -1;
    if (!n->o.listen) n->o.listen = "127.0.0.1:0";
    int rc = kv_node_key_load(&n->key, opts->dir, true, d);
    if (rc || pipe(n->stop_pipe)) {
        if (!rc) rc = kv_fail(d, KV_EIO, "node: pipe: %s", strerror(errno));
        kv_node_free(n);
        return rc;
    }
    memcpy(&n->salt, n->key.pk, sizeof n->salt);
    srand((unsigned)n->salt ^ (unsigned)getpid());
    fcntl(n->stop_pipe[0], F_SETFL, O_NONBLOCK);
    fcntl(n->stop_pipe[1], F_SETFL, O_NONBLOCK);
    *out = n;
    return 0;
}

void kv_node_stop(kv_node *n) {
    if (!n) return;
    atomic_store(&n->stop, 1);
    if (n->stop_pipe[1] >= 0) {
        ssize_t r = write(n->stop_pipe[1], "x", 1);
        (void)r;
    }
}

static void *kv_worker_thread(void *arg) {
    kv_diag d = {0};
    kv_worker_serve(arg, &d);
    return NULL;
}

static void kv_nw_stop(kv_node_worker *w) {
    if (!w->w) return;
    if (w->running) {
        kv_worker_stop(w->w);
        pthread_join(w->th, NULL);
    }
    kv_worker_free(w->w);
    memset(w, 0, sizeof *w);
}

/* Stops w, keeping what it served in the node's totals (reported in heartbeats). */
static void kv_node_retire(kv_node *n, kv_node_worker *w) {
    if (w->w) {
        kv_msg_stats st;
        kv_worker_stats(w->w, &st);
        n->retired_pairs += st.n_pairs;
        n->retired_tokens += st.n_tokens;
    }
    kv_nw_stop(w);
}

void kv_node_free(kv_node *n) {
    if (!n) return;
    kv_relay_client_free(n->rcl); /* ends the circuits: then their threads end */
    kv_relay_forward_free(n->rfw);
    kv_tls_ctx_free(n->rtls);
    kv_nw_stop(&n->old);
    kv_nw_stop(&n->cur);
    kv_manifest_free(n->m);
    free(n->held);
    free(n->live);
    free(n->peak);
    if (n->stop_pipe[0] >= 0) close(n->stop_pipe[0]);
    if (n->stop_pipe[1] >= 0) close(n->stop_pipe[1]);
    free(n);
}

/* Sleeps up to ms, or until kv_node_stop. */
static void kv_node_sleep(kv_node *n, int64_t ms) {
    if (ms <= 0 || atomic_load(&n->stop)) return;
    struct pollfd pf = {.fd = n->stop_pipe[0], .events = POLLIN};
    poll(&pf, 1, (int)(ms > 3600000 ? 3600000 : ms));
}

/* Starts a worker over the held slabs (each hashed again right here, so a
 * file changed on disk since it was fetched is deleted, not served). */
static int kv_node_start_worker(kv_node *n, const uint8_t *set, kv_node_worker *out, kv_diag *d) {
    memset(out, 0, sizeof *out);
    size_t cap = 1, cnt = 0;
    for (size_t i = 0; i < n->m->n_slabs; i++)
        if (set[i]) cap += 4200;
    char *list = malloc(cap);
    if (!list) return kv_fail(d, KV_ENOMEM, "node: out of memory");
    list[0] = 0;
    size_t off = 0;
    for (size_t i = 0; i < n->m->n_slabs; i++) {
        if (!set[i]) continue;
        const kv_manifest_file *f = &n->m->slabs[i].file;
        char path[4096];
        uint8_t got[32];
        int rc = kv_node_piece_path(n->o.dir, f->path, path, sizeof path, d);
        if (!rc) rc = kv_pieces_hash_file(path, got, d);
        if (!rc && memcmp(got, f->sha256, 32)) {
            unlink(path);
            rc = kv_fail(d, KV_EHASH, "node: '%s' changed on disk (SHA-256 differs): deleted", f->path);
        }
        if (rc) {
            free(list);
            return rc;
        }
        off += (size_t)snprintf(list + off, cap - off, "%s%s", cnt ? "," : "", path);
        cnt++;
    }
    /* the worker proves the node's key (the one the placement lists), and
     * serves the coordinators the hub vouches for, plus any --allow-key */
    int rc = 0;
    if (!n->have_hub_key && (rc = kv_node_fetch_hub_key(n->o.hub, n->hub_key, d)) == 0) n->have_hub_key = true;
    if (rc) {
        free(list);
        return rc;
    }
    kv_worker_opts wo = {.slabs = list, .listen = n->o.listen, .n_threads = n->o.n_threads, .quiet = true,
                         .key_sk = n->key.sk, .hub_key = n->hub_key, .allow_keys = n->o.allow_keys,
                         .n_allow_keys = n->o.n_allow_keys, .insecure_plaintext = n->o.insecure_plaintext,
                         .test_delay_ms = n->o.test_delay_ms};
    rc = kv_worker_open(&out->w, &wo, d);
    free(list);
    if (rc) return rc;
    if (pthread_create(&out->th, NULL, kv_worker_thread, out->w)) {
        kv_worker_free(out->w);
        out->w = NULL;
        return kv_fail(d, KV_EIO, "node: cannot start the worker thread");
    }
    out->running = true;
    return 0;
}

/* The worker's address as the relay forward dials it (a wildcard host is
 * reached on loopback) into out[cap]. */
static void kv_node_local_addr(const kv_node *n, char *out, size_t cap) {
    const char *a = kv_worker_addr(n->cur.w);
    if (!strncmp(a, "0.0.0.0:", 8)) snprintf(out, cap, "127.0.0.1:%s", a + 8);
    else if (!strncmp(a, "[::]:", 5)) snprintf(out, cap, "[::1]:%s", a + 5);
    else snprintf(out, cap, "%s", a);
}

/* A register/heartbeat answer's "relayed" and "relay": a node the hub
 * cannot dial (relayed; or any, with --relay always) connects out to the
 * hub's relay once and serves its circuits with the current worker; the
 * client reconnects by itself with backoff from then on. */
static void kv_node_relay_json(kv_node *n, json_t *j) {
    if (n->o.relay == KV_NODE_RELAY_OFF || !n->cur.w) return;
    char local[KV_HUB_MAX_ADDR + 16];
    kv_node_local_addr(n, local, sizeof local);
    kv_diag d = {0};
    if (n->rfw) { /* serving already: follow the worker */
        if (kv_relay_forward_set_local(n->rfw, local, &d)) kv_node_log(n, "relay: %s", d.msg);
        return;
    }
    json_t *rl = json_object_get(j, "relay"), *rp = json_object_get(rl, "port"), *rf = json_object_get(rl, "sha256");
    const bool relayed = json_is_true(json_object_get(j, "relayed"));
    if (!json_is_object(rl) || (n->o.relay == KV_NODE_RELAY_AUTO && !relayed)) return;
    char fp[KV_TLS_FP_HEX + 1], ra[300];
    if (!json_is_integer(rp) || json_integer_value(rp) < 1 || json_integer_value(rp) > 65535 || !json_is_string(rf) ||
        kv_tls_fingerprint_parse(json_string_value(rf), json_string_length(rf), fp, &d)) {
        if (strcmp(n->relay_err, "no usable relay")) kv_node_log(n, "relay: the hub's answer names no usable relay");
        snprintf(n->relay_err, sizeof n->relay_err, "no usable relay");
        return;
    }
    int rc = kv_node_relay_addr(n->o.hub, (uint16_t)json_integer_value(rp), fp, ra, sizeof ra, &d);
    if (!rc) rc = kv_tls_ctx_new(&n->rtls, &n->key, &d);
    if (!rc) rc = kv_relay_forward_new(&n->rfw, n->rtls, local, &d);
    const kv_relay_client_opts o = {.relay = ra, .relay_sha256 = fp, .tls = n->rtls, .role = KV_RELAY_ROLE_NODE,
                                    .key = &n->key, .on_circuit = kv_relay_forward_circuit, .data = n->rfw};
    if (!rc) rc = kv_relay_client_start(&n->rcl, &o, &d);
    if (rc) { /* tried again at the next answer; said once */
        if (strcmp(n->relay_err, d.msg)) kv_node_log(n, "relay: %s", d.msg);
        snprintf(n->relay_err, sizeof n->relay_err, "%s", d.msg);
        kv_relay_forward_free(n->rfw);
        kv_tls_ctx_free(n->rtls);
        n->rfw = NULL;
        n->rtls = NULL;
        return;
    }
    kv_node_log(n, "%s: serving through the hub's relay %s (one outbound connection)",
                relayed ? "the hub cannot dial this node" : "--relay always", ra);
}

/* Answers a storage challenge object from a register/heartbeat answer. */
static void kv_node_challenge(kv_node *n, json_t *ch) {
    if (!json_is_object(ch)) return;
    json_t *jn = json_object_get(ch, "nonce");
    json_t *jl = json_object_get(ch, "layer"), *jf = json_object_get(ch, "first"), *jt = json_object_get(ch, "last");
    const char *hex = json_is_string(jn) ? json_string_value(jn) : NULL;
    uint8_t nonce[32];
    if (!hex || json_string_length(jn) != 64 || !json_is_integer(jl) || !json_is_integer(jf) || !json_is_integer(jt)) {
        kv_node_log(n, "challenge: malformed, ignored");
        return;
    }
    for (int i = 0; i < 32; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1) {
            kv_node_log(n, "challenge: malformed nonce, ignored");
            return;
        }
        nonce[i] = (uint8_t)v;
    }
    json_int_t L = json_integer_value(jl), F = json_integer_value(jf), T = json_integer_value(jt);
    if (L < 0 || F < 0 || T < 0 || L > UINT32_MAX || F > UINT32_MAX || T > UINT32_MAX) return;
    /* the file is ours, found from the manifest: the path in the challenge is not trusted */
    const kv_manifest_slab *s = kv_manifest_find_slab(n->m, (uint32_t)L, (uint32_t)F, (uint32_t)T);
    kv_diag d = {0};
    char path[4096];
    uint8_t ans[32];
    if (!s || !n->held[s - n->m->slabs]) {
        kv_node_log(n, "challenge for a shard this node does not hold (layer %" PRId64 ")", (int64_t)L);
        return;
    }
    if (kv_node_piece_path(n->o.dir, s->file.path, path, sizeof path, &d) ||
        kv_hub_challenge_answer(path, s->file.size, nonce, ans, &d)) {
        kv_node_log(n, "challenge: %s", d.msg);
        return;
    }
    char ah[65], body[200], *reply = NULL;
    kv_hex(ans, 32, ah);
    snprintf(body, sizeof body, "{\"nonce\":\"%.64s\",\"sha256\":\"%s\"}", hex, ah);
    long st = 0;
    if (kv_node_post(n->o.hub, &n->key, "/v1/challenge", body, &reply, &st, &d)) kv_node_log(n, "challenge: %s", d.msg);
    else if (st != 200) kv_node_log(n, "challenge answer refused (%ld): %.200s", st, reply);
    else kv_node_log(n, "challenge answered (layer %u experts %u-%u)", s->layer, s->first, s->last);
    free(reply);
}

static int kv_node_register(kv_node *n, kv_diag *d) {
    char *body = NULL, *reply = NULL;
    size_t len = 0;
    int rc = kv_node_get(n->o.hub, "/v1/nonce", 4096, &body, &len, d);
    if (rc) return rc;
    json_error_t je;
    json_t *j = json_loadb(body, len, 0, &je);
    free(body);
    json_t *jn = j ? json_object_get(j, "nonce") : NULL;
    kv_hub_announce a = {0};
    const char *hex = json_is_string(jn) ? json_string_value(jn) : NULL;
    bool ok = hex && json_string_length(jn) == 64;
    for (int i = 0; ok && i < 32; i++) {
        unsigned v;
        ok = sscanf(hex + 2 * i, "%2x", &v) == 1;
        a.nonce[i] = (uint8_t)v;
    }
    json_decref(j);
    if (!ok) return kv_fail(d, KV_EFORMAT, "hub: /v1/nonce answer is not {\"nonce\": HEX64}");
    snprintf(a.addr, sizeof a.addr, "%s", n->addr);
    snprintf(a.backend, sizeof a.backend, "%s", kv_quant_backend());
    a.memory = n->o.budget;
    if (n->o.site) snprintf(a.site, sizeof a.site, "%s", n->o.site); /* checked by kv_node_open */
    size_t cnt = 0;
    for (size_t i = 0; i < n->m->n_slabs; i++) cnt += n->held[i];
    a.shards = calloc(cnt ? cnt : 1, sizeof *a.shards);
    if (!a.shards) return kv_fail(d, KV_ENOMEM, "node: out of memory");
    for (size_t i = 0; i < n->m->n_slabs; i++) {
        if (!n->held[i]) continue;
        const kv_manifest_slab *s = &n->m->slabs[i];
        a.shards[a.n_shards] = (kv_hub_held){.layer = s->layer, .first = s->first, .last = s->last};
        memcpy(a.shards[a.n_shards++].sha256, s->file.sha256, 32);
    }
    char *js = kv_hub_announce_json(&a);
    free(a.shards);
    if (!js) return kv_fail(d, KV_ENOMEM, "node: out of memory");
    long st = 0;
    rc = kv_node_post(n->o.hub, &n->key, "/v1/register", js, &reply, &st, d);
    free(js);
    if (rc) return rc;
    if (st != 200) {
        rc = kv_fail(d, KV_EPROTO, "hub refused the registration (%ld): %.300s", st, reply);
        free(reply);
        return rc;
    }
    j = json_loads(reply, 0, &je);
    free(reply);
    json_t *dl = j ? json_object_get(j, "deadline_ms") : NULL;
    if (!n->o.interval_ms && json_is_integer(dl) && json_integer_value(dl) > 0)
        n->interval_ms = (uint32_t)(json_integer_value(dl) / 3 > 0 ? json_integer_value(dl) / 3 : 1);
    if (n->interval_ms > 60000) n->interval_ms = 60000;
    n->registered = true;
    memcpy(n->live, n->held, n->m->n_slabs);
    kv_node_log(n, "registered %zu shards at %s", cnt, n->addr);
    if (j) kv_node_relay_json(n, j);
    if (j) kv_node_challenge(n, json_object_get(j, "challenge"));
    json_decref(j);
    return 0;
}

static int kv_node_heartbeat(kv_node *n, kv_diag *d) {
    n->last_beat_ms = kv_mono_ms();
    char *reply = NULL;
    long st = 0;
    /* what this node served since it started (every worker it ran): the
       hub turns the difference between beats into rates (docs/HUB.md) */
    uint64_t pairs = n->retired_pairs, tokens = n->retired_tokens;
    for (int k = 0; k < 2; k++) {
        const kv_node_worker *w = k ? &n->old : &n->cur;
        if (!w->w) continue;
        kv_msg_stats ms;
        kv_worker_stats(w->w, &ms);
        pairs += ms.n_pairs;
        tokens += ms.n_tokens;
    }
    char body[96];
    snprintf(body, sizeof body, "{\"served_pairs\":%" PRIu64 ",\"served_tokens\":%" PRIu64 "}", pairs, tokens);
    int rc = kv_node_post(n->o.hub, &n->key, "/v1/heartbeat", body, &reply, &st, d);
    if (rc) return rc;
    if (st == 404) { /* the hub forgot us (a new store): register again */
        free(reply);
        n->registered = false;
        memset(n->live, 0, n->m->n_slabs);
        return 0;
    }
    if (st != 200) {
        rc = kv_fail(d, KV_EPROTO, "heartbeat refused (%ld): %.300s", st, reply);
        free(reply);
        return rc;
    }
    json_error_t je;
    json_t *j = json_loads(reply, 0, &je);
    free(reply);
    if (!json_is_object(j)) {
        json_decref(j);
        return kv_fail(d, KV_EFORMAT, "heartbeat answer is not a JSON object");
    }
    if (json_object_get(j, "dropped")) {
        kv_node_log(n, "the hub dropped our holdings; registering again");
        n->registered = false;
        memset(n->live, 0, n->m->n_slabs);
    }
    kv_node_relay_json(n, j);
    kv_node_challenge(n, json_object_get(j, "challenge"));
    json_decref(j);
    return 0;
}

/* Reads the market and maps it onto manifest order; view[i] for slab i. */
static int kv_node_market(kv_node *n, kv_hub_shard_view *view, kv_diag *d) {
    char *body = NULL;
    size_t len = 0;
    int rc = kv_node_get(n->o.hub, "/v1/market", KV_NODE_MAX_MARKET, &body, &len, d);
    if (rc) return rc;
    kv_hub_market mk;
    rc = kv_hub_parse_market(&mk, body, len, d);
    free(body);
    if (rc) return rc;
    for (size_t i = 0; i < n->m->n_slabs; i++) {
        const kv_manifest_slab *s = &n->m->slabs[i];
        view[i] = (kv_hub_shard_view){s->layer, s->first, s->last, s->file.size, 1, 0, 0, 0, 0};
    }
    for (size_t k = 0; k < mk.n_shards; k++) {
        const kv_hub_shard_view *v = &mk.shards[k];
        const kv_manifest_slab *s = kv_manifest_find_slab(n->m, v->layer, v->first, v->last);
        if (!s) continue;
        size_t i = (size_t)(s - n->m->slabs);
        view[i].wanted = v->wanted;
        view[i].live = v->live;
        view[i].reward = v->reward;
    }
    if (n->o.has_layers) /* --layers: a shard of another layer never fits */
        for (size_t i = 0; i < n->m->n_slabs; i++)
            if (view[i].layer < n->o.layer_first || view[i].layer > n->o.layer_last) view[i].bytes = UINT64_MAX;
    kv_hub_market_free(&mk);
    return 0;
}

static int kv_node_heartbeat(kv_node *n, kv_diag *d);

/* A market that wants fewer replicas of a shard than at its peak (demand
 * fell: docs/HUB.md "Demand") is not over-filled: no new replica beyond
 * wanted is taken, and the replicas beyond it are given up by the holders
 * that rank past wanted by key (kv_node_surplus), so the lowest-keyed
 * holder always keeps its own: never the last live one, and holders that
 * see the same placement do not all drop at once. A market that never came
 * down keeps today's rule: spare budget holds extra replicas. The shards
 * given up or not to be taken are marked unaffordable in view (bytes =
 * UINT64_MAX); returns true when want changed, so the caller chooses again
 * with the room they leave. */
static bool kv_node_drop_surplus(kv_node *n, kv_hub_shard_view *view, uint8_t *want) {
    const size_t ns = n->m->n_slabs;
    bool any = false, changed = false;
    for (size_t i = 0; i < ns; i++) {
        if (view[i].wanted > n->peak[i]) n->peak[i] = view[i].wanted;
        if (view[i].wanted >= n->peak[i]) continue;
        if (!n->held[i] && view[i].live >= view[i].wanted) {
            changed |= want[i];
            want[i] = 0;
            view[i].bytes = UINT64_MAX;
        }
        any |= want[i] && n->held[i] && n->live[i] && view[i].live > view[i].wanted;
    }
    if (!any) return changed;
    char *body = NULL;
    size_t len = 0;
    uint8_t *drop = malloc(ns ? ns : 1);
    kv_diag e = {0};
    if (drop && !kv_node_get(n->o.hub, "/v1/placement", KV_NODE_MAX_MARKET, &body, &len, &e) &&
        !kv_node_surplus(body, len, view, ns, n->key.pk, drop, &e)) {
        for (size_t i = 0; i < ns; i++)
            if (drop[i] && want[i] && n->held[i] && view[i].wanted < n->peak[i]) {
                want[i] = 0;
                view[i].bytes = UINT64_MAX;
                changed = true;
                kv_node_log(n, "layer %u experts %u-%u: %u live, %u wanted: giving up our replica",
                            view[i].layer, view[i].first, view[i].last, view[i].live, view[i].wanted);
            }
    } else if (e.msg[0]) {
        kv_node_log(n, "%s", e.msg);
    }
    free(body);
    free(drop);
    return changed;
}

/* Progress of a slab download: reported, and the heartbeat kept going
 * meanwhile (a long download must not make the node look dead for what
 * it already serves). */
static void kv_node_fetch_progress(void *arg, const char *path, uint64_t done, uint64_t total) {
    kv_node *n = arg;
    if (n->o.progress) n->o.progress(n->o.progress_arg, path, done, total);
    else if (done == total) kv_node_log(n, "fetched %s (%" PRIu64 " bytes)", path, total);
    if (n->registered && kv_mono_ms() - n->last_beat_ms >= (int64_t)n->interval_ms) {
        kv_diag e = {0};
        if (kv_node_heartbeat(n, &e)) kv_node_log(n, "%s", e.msg);
    }
}

/* Fetches and verifies every slab of want not yet held; a failed one is
 * cleared from want (logged). */
static void kv_node_fetch_set(kv_node *n, uint8_t *want) {
    for (size_t i = 0; i < n->m->n_slabs && !atomic_load(&n->stop); i++) {
        if (!want[i]) continue;
        kv_diag d = {0};
        char path[4096];
        struct stat st;
        /* a served slab is fetched again only if its file went away (one
         * found changed when a worker opened it was deleted) */
        if (n->held[i] && !kv_node_piece_path(n->o.dir, n->m->slabs[i].file.path, path, sizeof path, &d) &&
            !lstat(path, &st))
            continue;
        if (kv_node_fetch_piece(n->o.hub, n->o.dir, &n->m->slabs[i].file, kv_node_fetch_progress, n, &d)) {
            kv_node_log(n, "%s", d.msg);
            want[i] = 0;
        }
    }
}

/* Serves and announces `want`: a new worker first, registered, then the old
 * one retired after a grace period (or first, when the port is fixed). */
static int kv_node_switch(kv_node *n, const uint8_t *want, kv_diag *d) {
    kv_node_worker nw;
    int rc = kv_node_start_worker(n, want, &nw, d);
    if (rc == KV_EIO && n->cur.w) { /* a fixed port: break before make */
        kv_node_retire(n, &n->cur);
        rc = kv_node_start_worker(n, want, &nw, d);
    }
    if (rc) return rc;
    kv_node_retire(n, &n->old);
    n->old = n->cur;
    /* coordinators that read the placement map before the switch still
     * reach the old address for a while */
    n->old_until_ms = kv_mono_ms() + (2 * (int64_t)n->interval_ms > KV_NODE_GRACE_MS ? 2 * (int64_t)n->interval_ms
                                                                                      : KV_NODE_GRACE_MS);
    n->cur = nw;
    memcpy(n->held, want, n->m->n_slabs);
    snprintf(n->addr, sizeof n->addr, "%s", n->o.advertise ? n->o.advertise : kv_worker_addr(n->cur.w));
    n->registered = false;
    memset(n->live, 0, n->m->n_slabs);
    size_t cnt = 0;
    uint64_t bytes = 0;
    for (size_t i = 0; i < n->m->n_slabs; i++)
        if (want[i]) {
            cnt++;
            bytes += n->m->slabs[i].file.size;
        }
    kv_node_log(n, "serving %zu shards (%" PRIu64 " bytes) on %s", cnt, bytes, kv_worker_addr(n->cur.w));
    if (n->rfw) { /* relayed circuits go to the new worker from now on */
        char local[KV_HUB_MAX_ADDR + 16];
        kv_node_local_addr(n, local, sizeof local);
        kv_diag e = {0};
        if (kv_relay_forward_set_local(n->rfw, local, &e)) kv_node_log(n, "relay: %s", e.msg);
    }
    return 0;
}

int kv_node_run(kv_node *n, kv_diag *d) {
    int rc = 0;
    kv_hub_shard_view *view = NULL;
    uint8_t *want = NULL;
    n->interval_ms = n->o.interval_ms ? n->o.interval_ms : 1000;
    /* the manifest, until it can be read */
    while (!atomic_load(&n->stop) && !n->m) {
        kv_diag e = {0};
        if (kv_node_fetch_manifest(n->o.hub, n->o.dir, &n->m, &e)) {
            kv_node_log(n, "%s (retrying)", e.msg);
            kv_node_sleep(n, 1000);
        }
    }
    if (!n->m) return 0;
    size_t ns = n->m->n_slabs;
    n->held = calloc(ns ? ns : 1, 1);
    n->live = calloc(ns ? ns : 1, 1);
    n->peak = calloc(ns ? ns : 1, sizeof *n->peak);
    view = calloc(ns ? ns : 1, sizeof *view);
    want = calloc(ns ? ns : 1, 1);
    if (!n->held || !n->live || !n->peak || !view || !want) {
        rc = kv_fail(d, KV_ENOMEM, "node: out of memory");
        goto out;
    }
    kv_node_log(n, "model %.16s: %zu shards, budget %" PRIu64 " bytes", n->m->model_id, ns, n->o.budget);
    /* slabs left from an earlier run are checked now: other bytes (a
     * damaged disk, another model) are deleted, never kept for later */
    for (size_t i = 0; i < ns && !atomic_load(&n->stop); i++) {
        const kv_manifest_file *f = &n->m->slabs[i].file;
        char path[4096];
        uint8_t got[32];
        struct stat st;
        kv_diag e = {0};
        if (kv_node_piece_path(n->o.dir, f->path, path, sizeof path, &e) || lstat(path, &st)) continue;
        if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size != f->size || !f->has_sha256 ||
            kv_pieces_hash_file(path, got, &e) || memcmp(got, f->sha256, 32)) {
            kv_node_log(n, "%s: not the manifest's bytes, deleted", f->path);
            unlink(path);
        }
    }
    while (!atomic_load(&n->stop)) {
        kv_diag e = {0};
        int64_t t0 = kv_mono_ms();
        if (n->registered && kv_node_heartbeat(n, &e)) kv_node_log(n, "%s", e.msg);
        if (!kv_node_market(n, view, &e)) {
            uint64_t bytes;
            if (kv_node_choose(view, ns, n->o.budget, n->live, n->salt, want, &bytes, &e)) {
                rc = e.code;
                *d = e;
                goto out;
            }
            /* Giving up a replica that is still wanted (for an uncovered
             * shard) is done only every other round on average: nodes that
             * see the same market at once would otherwise all trade the
             * same way and swap shards back and forth. */
            bool gives_wanted = false;
            for (size_t i = 0; i < ns; i++)
                if (n->held[i] && !want[i] && view[i].live >= 1 && view[i].live <= view[i].wanted) gives_wanted = true;
            if (gives_wanted && (rand() & 1)) memcpy(want, n->held, ns);
            if (kv_node_drop_surplus(n, view, want) &&
                kv_node_choose(view, ns, n->o.budget, n->live, n->salt, want, &bytes, &e)) {
                rc = e.code;
                *d = e;
                goto out;
            }
            if (memcmp(want, n->held, ns)) {
                kv_node_fetch_set(n, want);
                bool any = false;
                for (size_t i = 0; i < ns; i++) any |= want[i];
                if (any && memcmp(want, n->held, ns) && kv_node_switch(n, want, &e))
                    kv_node_log(n, "cannot serve the new set: %s", e.msg);
            }
        } else {
            kv_node_log(n, "%s", e.msg);
        }
        bool any = false;
        for (size_t i = 0; i < ns; i++) any |= n->held[i];
        if (any && !n->registered && kv_node_register(n, &e)) kv_node_log(n, "%s", e.msg);
        if (n->old.w && kv_mono_ms() >= n->old_until_ms) kv_node_retire(n, &n->old);
        /* jitter keeps nodes that started together from choosing in lockstep */
        int64_t wait = (int64_t)n->interval_ms + (int64_t)(rand() % (n->interval_ms / 4 + 1));
        kv_node_sleep(n, wait - (kv_mono_ms() - t0));
    }
out:
    free(view);
    free(want);
    return rc;
}
