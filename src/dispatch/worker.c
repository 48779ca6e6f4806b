/* The expert worker: serves COMPUTE requests for the experts held in a set
 * of slab files (or a full model file) over the dispatch protocol.
 *
 * Threads: one accept loop (kv_worker_serve) and one thread per connection,
 * at most max_conns. Connection threads read, decode and answer frames on
 * their own; the computation itself is serialized under one mutex because
 * it runs on one kv_pool (all its threads on one request: a decode step's
 * few experts already fill the machine). A slow or stalled client blocks
 * only its own thread: a frame started must complete within the read
 * timeout, writes have a deadline, and nothing is sent while holding the
 * compute mutex.
 *
 * Memory: a connection's receive buffer grows with the bytes that actually
 * arrived (never to a size announced by a header alone), up to the largest
 * COMPUTE this model admits (<= KV_PROTO_MAX_PAYLOAD); large buffers are
 * dropped after use. The compute scratch is allocated once.
 *
 * Same bits: a COMPUTE's pairs are sorted by (expert, token), gathered into
 * requests of n_used = 1 for the in-process provider, and each output row
 * written at its pair's position; every output element is one whole dot
 * product, so a RESULT equals the in-process computation bit for bit. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/dispatch.h"
#include "kvasir/gguf.h"
#include "kvasir/model.h"
#include "kvasir/pieces.h"
#include "kvasir/quant.h"
#include "kvasir/slice.h"

#define KV_WORKER_CHUNK 512u          /* pairs per provider call */
#define KV_WORKER_MAX_FILES 65536u    /* slab files one worker opens */
#define KV_WORKER_WRITE_MS 60000      /* a frame must be sent within this */
#define KV_WORKER_KEEP_BUF (4u << 20) /* buffers above this are freed after use */

typedef struct kv_conn kv_conn;

struct kv_worker {
    kv_worker_opts opts;
    char addr[300];                  /* "HOST:PORT" bound */
    char model_id[KV_PROTO_MODEL_ID_LEN + 1];
    kv_gguf **files;                 /* [n_files] open slabs / models */
    char **paths;                    /* [n_files] their paths, for messages */
    size_t n_files;
    uint32_t n_layer, n_expert, n_embd, n_ff, n_expert_used;
    kv_expert_weights *tab;          /* [n_layer][n_expert] weights of held experts */
    uint8_t *held;                   /* [n_layer][n_expert] 1 if held */
    kv_held_range *ranges;           /* [n_ranges] sorted, merged runs */
    size_t n_ranges;
    size_t max_payload;              /* largest COMPUTE payload this model admits */
    kv_pool *pool;
    kv_expert_provider prov;
    bool have_prov;
    /* compute scratch, under compute_mu */
    pthread_mutex_t compute_mu;
    uint64_t *keys;                  /* [KV_PROTO_MAX_PAIRS] (expert, token, pair index) */
    float *xs;                       /* [KV_WORKER_CHUNK][n_embd] gathered inputs */
    int32_t *ids;                    /* [KV_WORKER_CHUNK] expert of each gathered row */
    float *ys;                       /* [KV_WORKER_CHUNK][n_embd] outputs */
    /* connections, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;               /* signalled when a connection ends */
    kv_conn **conns;                 /* [max_conns] active, NULL = free slot */
    int n_active;
    int lfd;                         /* listening socket */
    int stop_pipe[2];                /* kv_worker_stop writes, serve polls */
    atomic_int stop;
    /* counters */
    atomic_uint_fast64_t n_compute, n_pairs, n_tokens, n_conns, n_errors;
    int64_t t_start_ms;
};

struct kv_conn {
    kv_worker *w;
    int fd;
    int slot;                        /* index in w->conns */
    uint64_t id;                     /* connection number, for logs */
    char peer[96];                   /* "HOST:PORT" of the client */
    uint8_t *rx;                     /* receive buffer */
    size_t rx_cap;
    uint8_t *tx;                     /* send buffer */
    size_t tx_cap;
    bool hello;                      /* handshake done */
    uint16_t version;                /* negotiated */
    uint32_t enc_mask;               /* negotiated encodings */
};

static int64_t kv_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static void kv_wlog(const kv_worker *w, const char *fmt, ...) {
    if (w->opts.quiet) return;
    char line[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "worker: %s\n", line);
}

/* ---- loading slabs ----------------------------------------------------------- */

static int kv_has_suffix(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

static int kv_cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void kv_free_paths(char **p, size_t n) {
    for (size_t i = 0; i < n; i++) free(p[i]);
    free(p);
}

/* Lists the files to open: the *.gguf of a folder (DIR/experts/ when DIR is
 * a slice folder), sorted; or the comma-separated files. *folder says which. */
static int kv_list_files(const char *spec, char ***out, size_t *n_out, bool *folder, kv_diag *d) {
    struct stat st;
    char **paths = NULL;
    size_t n = 0, cap = 0;
    *folder = false;
    if (stat(spec, &st) == 0 && S_ISDIR(st.st_mode)) {
        char dir[4096];
        struct stat st2;
        snprintf(dir, sizeof dir, "%s/experts", spec);
        if (!(stat(dir, &st2) == 0 && S_ISDIR(st2.st_mode))) snprintf(dir, sizeof dir, "%s", spec);
        DIR *dp = opendir(dir);
        if (!dp) return kv_fail(d, KV_EIO, "slabs: cannot open folder '%s': %s", dir, strerror(errno));
        struct dirent *de;
        while ((de = readdir(dp))) {
            if (!kv_has_suffix(de->d_name, ".gguf") || de->d_name[0] == '.') continue;
            if (n == KV_WORKER_MAX_FILES) {
                closedir(dp);
                kv_free_paths(paths, n);
                return kv_fail(d, KV_ERANGE, "slabs: more than %u files in '%s'", KV_WORKER_MAX_FILES, dir);
            }
            if (n == cap) {
                size_t nc = cap ? cap * 2 : 16;
                char **np = realloc(paths, nc * sizeof *np);
                if (!np) goto oom_dir;
                paths = np;
                cap = nc;
            }
            size_t len = strlen(dir) + strlen(de->d_name) + 2;
            if (!(paths[n] = malloc(len))) goto oom_dir;
            snprintf(paths[n++], len, "%s/%s", dir, de->d_name);
            continue;
        oom_dir:
            closedir(dp);
            kv_free_paths(paths, n);
            return kv_fail(d, KV_ENOMEM, "slabs: out of memory");
        }
        closedir(dp);
        if (n == 0) return kv_fail(d, KV_ENOTFOUND, "slabs: no *.gguf files in '%s'", dir);
        qsort(paths, n, sizeof *paths, kv_cmp_str);
        *folder = true;
    } else {
        const char *p = spec;
        while (*p) {
            const char *e = strchr(p, ',');
            size_t len = e ? (size_t)(e - p) : strlen(p);
            if (len == 0) {
                kv_free_paths(paths, n);
                return kv_fail(d, KV_EINVAL, "slabs: empty file name in '%s'", spec);
            }
            if (n == KV_WORKER_MAX_FILES) {
                kv_free_paths(paths, n);
                return kv_fail(d, KV_ERANGE, "slabs: more than %u files", KV_WORKER_MAX_FILES);
            }
            if (n == cap) {
                size_t nc = cap ? cap * 2 : 16;
                char **np = realloc(paths, nc * sizeof *np);
                if (!np) {
                    kv_free_paths(paths, n);
                    return kv_fail(d, KV_ENOMEM, "slabs: out of memory");
                }
                paths = np;
                cap = nc;
            }
            if (!(paths[n] = strndup(p, len))) {
                kv_free_paths(paths, n);
                return kv_fail(d, KV_ENOMEM, "slabs: out of memory");
            }
            n++;
            p += len;
            if (*p == ',') p++;
        }
        if (n == 0) return kv_fail(d, KV_EINVAL, "slabs: no files given");
    }
    *out = paths;
    *n_out = n;
    return 0;
}

/* Reads "{arch}.key" as u32 into *v; 0 if present. */
static int kv_arch_u32(const kv_gguf *g, const char *key, uint32_t *v) {
    kv_str arch;
    char k[192];
    if (kv_gguf_get_str(g, "general.architecture", &arch, NULL) || arch.len > 64) return -1;
    snprintf(k, sizeof k, "%.*s.%s", (int)arch.len, arch.ptr, key);
    return kv_gguf_get_u32(g, k, v, NULL);
}

/* The model a file belongs to (pieces.h owns the rule: a slab's
 * kvasir.source.id, or the identity computed over a full model). */
static int kv_file_identity(const kv_gguf *g, const char *path, char id[65], kv_diag *d) {
    return kv_pieces_file_identity(g, path, id, d);
}

static int kv_worker_add_expert(kv_worker *w, const kv_gguf *g, const char *path, uint32_t L,
                                uint32_t e, kv_diag *d) {
    kv_expert_weights ew;
    uint32_t E, F;
    int rc = kv_expert_find(g, L, e, &ew, &E, &F, d);
    if (rc) return kv_diag_prefix(d, rc, "%s", path);
    if (w->n_embd == 0) {
        w->n_embd = E;
        w->n_ff = F;
    } else if (E != w->n_embd || F != w->n_ff) {
        return kv_fail(d, KV_EFORMAT, "%s: layer %u expert %u is %ux%u, other experts %ux%u", path, L, e,
                       E, F, w->n_embd, w->n_ff);
    }
    size_t k = (size_t)L * w->n_expert + e;
    if (w->held[k])
        return kv_fail(d, KV_EFORMAT, "%s: layer %u expert %u is also in another file", path, L, e);
    w->held[k] = 1;
    w->tab[k] = ew;
    return 0;
}

static int kv_worker_load(kv_worker *w, kv_diag *d) {
    char **paths = NULL;
    size_t n = 0;
    bool folder;
    int rc = kv_list_files(w->opts.slabs, &paths, &n, &folder, d);
    if (rc) return rc;
    w->files = calloc(n, sizeof *w->files);
    w->paths = calloc(n, sizeof *w->paths);
    if (!w->files || !w->paths) {
        kv_free_paths(paths, n);
        return kv_fail(d, KV_ENOMEM, "slabs: out of memory");
    }
    /* pass 1: open, identity, dims */
    for (size_t i = 0; i < n && !rc; i++) {
        kv_gguf *g = NULL;
        if ((rc = kv_gguf_open(&g, paths[i], d))) break;
        uint32_t L;
        bool slab = !kv_gguf_get_u32(g, "kvasir.slab.layer", &L, NULL);
        if (folder && !slab) { /* a backbone or other file in the folder */
            kv_gguf_close(g);
            continue;
        }
        w->paths[w->n_files] = paths[i];
        paths[i] = NULL;
        w->files[w->n_files++] = g;
        char id[65];
        if ((rc = kv_file_identity(g, w->paths[w->n_files - 1], id, d))) break;
        uint32_t n_layer = 0, n_expert = 0, n_used = 0;
        if (kv_arch_u32(g, "block_count", &n_layer) || n_layer == 0 || n_layer > KV_MAX_LAYERS) {
            rc = kv_fail(d, KV_EFORMAT, "%s: block_count missing or out of [1, %u]", w->paths[w->n_files - 1], KV_MAX_LAYERS);
            break;
        }
        if (slab) {
            if (kv_gguf_get_u32(g, "kvasir.slab.n_expert", &n_expert, NULL))
                n_expert = 0;
        } else if (kv_arch_u32(g, "expert_count", &n_expert)) {
            n_expert = 0;
        }
        if (n_expert == 0 || n_expert > KV_MAX_EXPERTS) {
            rc = kv_fail(d, KV_EFORMAT, "%s: expert count missing or out of [1, %u]", w->paths[w->n_files - 1], KV_MAX_EXPERTS);
            break;
        }
        if (kv_arch_u32(g, "expert_used_count", &n_used) || n_used > n_expert) n_used = 0;
        if (w->n_files == 1) {
            memcpy(w->model_id, id, sizeof w->model_id);
            w->n_layer = n_layer;
            w->n_expert = n_expert;
            w->n_expert_used = n_used;
        } else if (strcmp(id, w->model_id)) {
            rc = kv_fail(d, KV_EFORMAT, "%s: comes from model %.16s..., the other files from %.16s...",
                         w->paths[w->n_files - 1], id, w->model_id);
        } else if (n_layer != w->n_layer || n_expert != w->n_expert) {
            rc = kv_fail(d, KV_EFORMAT, "%s: %u layers x %u experts, the other files %u x %u", w->paths[w->n_files - 1],
                         n_layer, n_expert, w->n_layer, w->n_expert);
        }
    }
    if (!rc && w->n_files == 0)
        rc = kv_fail(d, KV_ENOTFOUND, "slabs: no expert slabs in '%s'", w->opts.slabs);
    if (!rc) {
        size_t cells = (size_t)w->n_layer * w->n_expert;
        w->tab = calloc(cells, sizeof *w->tab);
        w->held = calloc(cells, 1);
        if (!w->tab || !w->held) rc = kv_fail(d, KV_ENOMEM, "slabs: out of memory");
    }
    /* pass 2: every held expert's weights */
    for (size_t i = 0; i < w->n_files && !rc; i++) {
        kv_gguf *g = w->files[i];
        const char *path = w->paths[i];
        uint32_t L, first, last;
        const int sm = kv_pieces_slab_meta(g, &L, &first, &last, NULL, NULL);
        if (sm != KV_ENOTFOUND) { /* a slab */
            if (sm || last >= w->n_expert || L >= w->n_layer) {
                rc = kv_fail(d, KV_EFORMAT, "%s: kvasir.slab.{layer,first,last} missing or out of range",
                             path);
                break;
            }
            for (uint32_t e = first; e <= last && !rc; e++) rc = kv_worker_add_expert(w, g, path, L, e, d);
        } else {
            /* a full model: every layer that has routed-expert tensors */
            char name[64];
            for (uint32_t l = 0; l < w->n_layer && !rc; l++) {
                snprintf(name, sizeof name, "blk.%u.ffn_gate_exps.weight", l);
                if (!kv_gguf_find_tensor(g, name)) continue;
                for (uint32_t e = 0; e < w->n_expert && !rc; e++)
                    rc = kv_worker_add_expert(w, g, path, l, e, d);
            }
        }
    }
    kv_free_paths(paths, n);
    if (rc) return rc;
    if (w->n_embd == 0) return kv_fail(d, KV_ENOTFOUND, "slabs: the files hold no routed experts");
    if (w->n_embd > KV_PROTO_MAX_EMBD || w->n_ff > KV_PROTO_MAX_FF)
        return kv_fail(d, KV_EUNSUPPORTED, "slabs: dims %ux%u exceed the protocol's", w->n_embd, w->n_ff);
    /* held ranges: maximal runs per layer */
    size_t nr = 0;
    for (int pass = 0; pass < 2; pass++) {
        nr = 0;
        for (uint32_t l = 0; l < w->n_layer; l++)
            for (uint32_t e = 0; e < w->n_expert; e++) {
                if (!w->held[(size_t)l * w->n_expert + e]) continue;
                uint32_t f = e;
                while (e + 1 < w->n_expert && w->held[(size_t)l * w->n_expert + e + 1]) e++;
                if (pass) w->ranges[nr] = (kv_held_range){l, f, e};
                nr++;
            }
        if (!pass) {
            if (nr > KV_PROTO_MAX_RANGES)
                return kv_fail(d, KV_ERANGE, "slabs: %zu expert ranges exceed the protocol's %u", nr,
                               KV_PROTO_MAX_RANGES);
            if (!(w->ranges = calloc(nr, sizeof *w->ranges)))
                return kv_fail(d, KV_ENOMEM, "slabs: out of memory");
        }
    }
    w->n_ranges = nr;
    return 0;
}

/* ---- expert source over the table ------------------------------------------------- */

static int kv_tab_acquire(void *ctx, uint32_t layer, uint32_t e, kv_expert_weights *out, kv_diag *d) {
    kv_worker *w = ctx;
    if (layer >= w->n_layer || e >= w->n_expert || !w->held[(size_t)layer * w->n_expert + e])
        return kv_fail(d, KV_ENOTFOUND, "layer %u expert %u is not held by this worker", layer, e);
    *out = w->tab[(size_t)layer * w->n_expert + e];
    return 0;
}

/* ---- listening ------------------------------------------------------------------------- */

static int kv_worker_listen(kv_worker *w, kv_diag *d) {
    char host[256], port_s[8];
    uint16_t port;
    int rc = kv_proto_parse_addr(w->opts.listen, host, sizeof host, &port, d);
    if (rc) return kv_diag_prefix(d, rc, "--listen");
    snprintf(port_s, sizeof port_s, "%u", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE},
                    *res = NULL;
    int gr = getaddrinfo(host, port_s, &hints, &res);
    if (gr) return kv_fail(d, KV_EINVAL, "--listen %s: %s", w->opts.listen, gai_strerror(gr));
    rc = kv_fail(d, KV_EIO, "--listen %s: no address", w->opts.listen);
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) || listen(fd, 128)) {
            rc = kv_fail(d, KV_EIO, "--listen %s: %s", w->opts.listen, strerror(errno));
            close(fd);
            continue;
        }
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        char hb[INET6_ADDRSTRLEN] = "?", pb[8] = "0";
        if (!getsockname(fd, (struct sockaddr *)&ss, &sl))
            getnameinfo((struct sockaddr *)&ss, sl, hb, sizeof hb, pb, sizeof pb, NI_NUMERICHOST | NI_NUMERICSERV);
        if (ss.ss_family == AF_INET6)
            snprintf(w->addr, sizeof w->addr, "[%s]:%s", hb, pb);
        else
            snprintf(w->addr, sizeof w->addr, "%s:%s", hb, pb);
        w->lfd = fd;
        rc = 0;
        if (d) d->code = 0, d->msg[0] = 0;
        break;
    }
    freeaddrinfo(res);
    return rc;
}

/* ---- open / free ---------------------------------------------------------------------- */

int kv_worker_open(kv_worker **out, const kv_worker_opts *opts, kv_diag *d) {
    *out = NULL;
    if (!opts || !opts->slabs || !opts->listen)
        return kv_fail(d, KV_EINVAL, "worker: --slabs and --listen are required");
    kv_worker *w = calloc(1, sizeof *w);
    if (!w) return kv_fail(d, KV_ENOMEM, "worker: out of memory");
    w->opts = *opts;
    if (w->opts.max_conns <= 0) w->opts.max_conns = 64;
    if (w->opts.read_timeout_ms <= 0) w->opts.read_timeout_ms = 10000;
    w->lfd = -1;
    w->stop_pipe[0] = w->stop_pipe[1] = -1;
    pthread_mutex_init(&w->compute_mu, NULL);
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    int rc = kv_worker_load(w, d);
    if (!rc) {
        /* the largest COMPUTE that can be valid for this model */
        size_t mp = kv_msg_compute_size(KV_ENC_F32, KV_PROTO_MAX_TOKENS, w->n_embd, KV_PROTO_MAX_PAIRS);
        w->max_payload = mp ? mp - KV_PROTO_HEADER : KV_PROTO_MAX_PAYLOAD;
        w->keys = malloc(sizeof *w->keys * KV_PROTO_MAX_PAIRS);
        w->xs = malloc(sizeof *w->xs * KV_WORKER_CHUNK * w->n_embd);
        w->ys = malloc(sizeof *w->ys * KV_WORKER_CHUNK * w->n_embd);
        w->ids = malloc(sizeof *w->ids * KV_WORKER_CHUNK);
        w->conns = calloc((size_t)w->opts.max_conns, sizeof *w->conns);
        if (!w->keys || !w->xs || !w->ys || !w->ids || !w->conns)
            rc = kv_fail(d, KV_ENOMEM, "worker: out of memory");
    }
    if (!rc) rc = kv_pool_new(&w->pool, w->opts.n_threads, d);
    if (!rc) {
        kv_expert_source src = {w, kv_tab_acquire, NULL, w->n_layer, w->n_expert, w->n_embd, w->n_ff, 1};
        rc = kv_expert_local_new_src(&w->prov, &src, w->pool, KV_WORKER_CHUNK, d);
        w->have_prov = rc == 0;
    }
    if (!rc && pipe2(w->stop_pipe, O_CLOEXEC | O_NONBLOCK))
        rc = kv_fail(d, KV_EIO, "worker: pipe: %s", strerror(errno));
    if (!rc) rc = kv_worker_listen(w, d);
    if (rc) {
        kv_worker_free(w);
        return rc;
    }
    w->t_start_ms = kv_now_ms();
    *out = w;
    return 0;
}

void kv_worker_free(kv_worker *w) {
    if (!w) return;
    if (w->lfd >= 0) close(w->lfd);
    for (int i = 0; i < 2; i++)
        if (w->stop_pipe[i] >= 0) close(w->stop_pipe[i]);
    if (w->have_prov) w->prov.free(w->prov.impl);
    kv_pool_free(w->pool);
    for (size_t i = 0; i < w->n_files; i++) {
        kv_gguf_close(w->files[i]);
        free(w->paths[i]);
    }
    free(w->files);
    free(w->paths);
    free(w->tab);
    free(w->held);
    free(w->ranges);
    free(w->keys);
    free(w->xs);
    free(w->ys);
    free(w->ids);
    free(w->conns);
    pthread_mutex_destroy(&w->compute_mu);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w);
}

const char *kv_worker_addr(const kv_worker *w) { return w->addr; }
const char *kv_worker_model_id(const kv_worker *w) { return w->model_id; }
size_t kv_worker_ranges(const kv_worker *w, const kv_held_range **out) {
    *out = w->ranges;
    return w->n_ranges;
}

void kv_worker_stats(const kv_worker *w, kv_msg_stats *s) {
    kv_worker *mw = (kv_worker *)w;
    s->n_compute = atomic_load(&mw->n_compute);
    s->n_pairs = atomic_load(&mw->n_pairs);
    s->n_tokens = atomic_load(&mw->n_tokens);
    s->n_conns = atomic_load(&mw->n_conns);
    s->n_errors = atomic_load(&mw->n_errors);
    s->uptime_ms = (uint64_t)(kv_now_ms() - w->t_start_ms);
}

void kv_worker_stop(kv_worker *w) {
    atomic_store(&w->stop, 1);
    if (w->stop_pipe[1] >= 0) {
        ssize_t k = write(w->stop_pipe[1], "x", 1);
        (void)k;
    }
}

/* ---- one connection -------------------------------------------------------------------- */

/* Grows a buffer to at least want bytes (keeping contents). */
static int kv_grow(uint8_t **buf, size_t *cap, size_t want) {
    if (*cap >= want) return 0;
    size_t nc = *cap ? *cap : 4096;
    while (nc < want) nc = nc > SIZE_MAX / 2 ? want : nc * 2;
    uint8_t *nb = realloc(*buf, nc);
    if (!nb) return -1;
    *buf = nb;
    *cap = nc;
    return 0;
}

static void kv_shrink(uint8_t **buf, size_t *cap) {
    if (*cap > KV_WORKER_KEEP_BUF) {
        free(*buf);
        *buf = NULL;
        *cap = 0;
    }
}

/* Sends an ERROR frame (best effort) and counts it. */
static void kv_conn_send_error(kv_conn *c, uint32_t rid, int code, const char *msg) {
    uint8_t buf[KV_PROTO_HEADER + KV_PROTO_ERROR_FIXED + KV_PROTO_MAX_TEXT];
    size_t n;
    atomic_fetch_add(&c->w->n_errors, 1);
    if (kv_msg_error_encode(buf, sizeof buf, rid, code, msg, &n, NULL) == 0)
        (void)kv_proto_write_all(c->fd, buf, n, 2000, NULL);
}

/* Waits until fd is readable, the deadline passes, or the worker stops.
 * Returns 1 readable, 0 timeout, -1 stop/error. */
static int kv_conn_wait(kv_conn *c, int64_t deadline) {
    for (;;) {
        if (atomic_load(&c->w->stop)) return -1;
        int wait = 500; /* re-check stop at least twice a second */
        if (deadline >= 0) {
            int64_t left = deadline - kv_now_ms();
            if (left <= 0) return 0;
            if (left < wait) wait = (int)left;
        }
        struct pollfd pf = {.fd = c->fd, .events = POLLIN};
        int pr = poll(&pf, 1, wait);
        if (pr < 0 && errno != EINTR) return -1;
        if (pr > 0) return 1;
    }
}

/* Reads one frame into c->rx. Returns 0 with *len set, or a negative code
 * with msg filled; *quiet set for a clean close between frames or a stop. */
static int kv_conn_read_frame(kv_conn *c, size_t *len, bool *quiet, kv_diag *d) {
    kv_worker *w = c->w;
    size_t have = 0, need = KV_PROTO_HEADER;
    int64_t deadline = w->opts.idle_timeout_ms > 0 ? kv_now_ms() + w->opts.idle_timeout_ms : -1;
    bool started = false;
    *quiet = false;
    if (kv_grow(&c->rx, &c->rx_cap, KV_PROTO_HEADER)) return kv_fail(d, KV_ENOMEM, "out of memory");
    while (have < need) {
        int wr = kv_conn_wait(c, deadline);
        if (wr < 0) {
            *quiet = true;
            return kv_fail(d, KV_EIO, "stopping");
        }
        if (wr == 0)
            return kv_fail(d, KV_ETIMEOUT, started ? "frame not complete within %d ms (%zu of %zu bytes)"
                                                   : "idle for %d ms",
                           started ? w->opts.read_timeout_ms : w->opts.idle_timeout_ms, have, need);
        /* grow with what arrives, never to a size only announced */
        size_t want = need - have;
        if (c->rx_cap - have < want && c->rx_cap < need) {
            size_t target = c->rx_cap * 2 < need ? c->rx_cap * 2 : need;
            if (kv_grow(&c->rx, &c->rx_cap, target)) return kv_fail(d, KV_ENOMEM, "out of memory");
        }
        if (want > c->rx_cap - have) want = c->rx_cap - have;
        ssize_t k = read(c->fd, c->rx + have, want);
        if (k < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
            return kv_fail(d, KV_EIO, "read: %s", strerror(errno));
        }
        if (k == 0) {
            if (!started) {
                *quiet = true;
                return kv_fail(d, KV_EIO, "closed by peer");
            }
            return kv_fail(d, KV_EIO, "closed inside a frame (%zu of %zu bytes)", have, need);
        }
        if (!started) {
            started = true;
            deadline = kv_now_ms() + w->opts.read_timeout_ms;
        }
        have += (size_t)k;
        if (have == KV_PROTO_HEADER && need == KV_PROTO_HEADER) {
            kv_frame_header h;
            int rc = kv_frame_header_decode(c->rx, KV_PROTO_HEADER, &h, d);
            if (rc) return rc;
            if (h.len > w->max_payload)
                return kv_fail(d, KV_ERANGE, "frame: payload length %u exceeds %zu (the largest "
                                             "valid request for this model)", h.len, w->max_payload);
            need = KV_PROTO_HEADER + (size_t)h.len;
        }
    }
    *len = need;
    return 0;
}

static int kv_cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Computes a decoded COMPUTE into c->tx as a RESULT frame; *n its size. */
static int kv_conn_compute(kv_conn *c, uint32_t rid, const kv_msg_compute *m, size_t *n, kv_diag *d) {
    kv_worker *w = c->w;
    size_t fsize = kv_msg_result_size(m->out_enc, m->n_pairs, m->n_embd);
    if (!fsize || kv_grow(&c->tx, &c->tx_cap, fsize))
        return kv_fail(d, KV_ENOMEM, "no memory for a result of %u pairs", m->n_pairs);
    int rc = kv_msg_result_begin(c->tx, c->tx_cap, rid, m->out_enc, m->n_pairs, m->n_embd, n, d);
    if (rc) return rc;
    const float *xin = kv_msg_compute_x_inplace(m);
    pthread_mutex_lock(&w->compute_mu);
    /* pairs by (expert, token, index): each chunk holds few experts, many tokens */
    for (uint32_t i = 0; i < m->n_pairs; i++) {
        kv_proto_pair p = kv_msg_compute_pair(m, i);
        w->keys[i] = ((uint64_t)p.expert << 32) | ((uint64_t)p.token << 16) | i;
    }
    qsort(w->keys, m->n_pairs, sizeof *w->keys, kv_cmp_u64);
    for (uint32_t s = 0; s < m->n_pairs && !rc; s += KV_WORKER_CHUNK) {
        uint32_t cn = m->n_pairs - s < KV_WORKER_CHUNK ? m->n_pairs - s : KV_WORKER_CHUNK;
        for (uint32_t j = 0; j < cn; j++) {
            uint64_t k = w->keys[s + j];
            uint32_t tok = (uint32_t)(k >> 16) & 0xffffu;
            float *row = w->xs + (size_t)j * w->n_embd;
            if (xin)
                memcpy(row, xin + (size_t)tok * w->n_embd, sizeof(float) * w->n_embd);
            else
                kv_msg_compute_row(m, tok, row);
            w->ids[j] = (int32_t)(k >> 32);
        }
        kv_expert_req req = {m->layer, cn, w->n_embd, 1, w->xs, w->ids};
        rc = w->prov.compute(w->prov.impl, &req, w->ys, d);
        for (uint32_t j = 0; j < cn && !rc; j++)
            kv_msg_result_put_row(c->tx, m->out_enc, w->n_embd, (uint32_t)(w->keys[s + j] & 0xffffu),
                                  w->ys + (size_t)j * w->n_embd);
    }
    pthread_mutex_unlock(&w->compute_mu);
    return rc;
}


/* Serves one connection until it closes or breaks the protocol. Returns a
 * short reason for the log. */
static void kv_conn_serve(kv_conn *c, char *why, size_t why_cap) {
    kv_worker *w = c->w;
    const kv_proto_limits lim = {w->n_layer, w->n_embd, w->n_expert};
    kv_diag d = {0};
    for (;;) {
        size_t len = 0;
        bool quiet;
        int rc = kv_conn_read_frame(c, &len, &quiet, &d);
        if (rc) {
            if (!quiet && rc != KV_EIO) kv_conn_send_error(c, 0, rc, d.msg);
            snprintf(why, why_cap, "%s", d.msg);
            return;
        }
        kv_msg m;
        rc = kv_msg_decode(c->rx, len, &lim, &m, &d);
        const uint32_t rid = rc ? 0 : m.h.request_id;
        if (rc) {
            kv_conn_send_error(c, 0, rc, d.msg);
            snprintf(why, why_cap, "protocol error: %s", d.msg);
            return;
        }
        if (c->hello && m.h.version != c->version) {
            kv_fail(&d, KV_EPROTO, "frame version %u, negotiated %u", m.h.version, c->version);
            kv_conn_send_error(c, rid, KV_EPROTO, d.msg);
            snprintf(why, why_cap, "protocol error: %s", d.msg);
            return;
        }
        if (!c->hello && m.h.type != KV_MSG_HELLO) {
            kv_fail(&d, KV_EPROTO, "expected HELLO, got %s", kv_msg_type_name(m.h.type));
            kv_conn_send_error(c, rid, KV_EPROTO, d.msg);
            snprintf(why, why_cap, "protocol error: %s", d.msg);
            return;
        }
        size_t n = 0;
        switch (m.h.type) {
        case KV_MSG_HELLO: {
            const kv_msg_hello *h = &m.u.hello;
            uint32_t lo = h->min_version > KV_PROTO_VERSION_MIN ? h->min_version : KV_PROTO_VERSION_MIN;
            uint32_t hi = h->max_version < KV_PROTO_VERSION ? h->max_version : KV_PROTO_VERSION;
            if (c->hello) rc = kv_fail(&d, KV_EPROTO, "second HELLO");
            else if (lo > hi)
                rc = kv_fail(&d, KV_EUNSUPPORTED, "no common protocol version: coordinator speaks "
                                                  "[%u, %u], this worker [%u, %u]",
                             h->min_version, h->max_version, KV_PROTO_VERSION_MIN, KV_PROTO_VERSION);
            else if (strcmp(h->model_id, w->model_id))
                rc = kv_fail(&d, KV_EHASH, "model %.16s... requested, this worker serves %.16s...",
                             h->model_id, w->model_id);
            if (rc) {
                kv_conn_send_error(c, rid, rc, d.msg);
                snprintf(why, why_cap, "handshake refused: %s", d.msg);
                return;
            }
            kv_msg_hello_ack ack = {0};
            ack.version = (uint16_t)hi;
            memcpy(ack.model_id, w->model_id, sizeof ack.model_id);
            ack.n_layer = w->n_layer;
            ack.n_embd = w->n_embd;
            ack.n_ff_exp = w->n_ff;
            ack.n_expert = w->n_expert;
            ack.n_expert_used = w->n_expert_used;
            ack.enc_mask = h->enc_mask & KV_ENC_MASK_ALL;
            snprintf(ack.backend, sizeof ack.backend, "%s", kv_quant_backend());
            ack.n_ranges = (uint32_t)w->n_ranges;
            ack.ranges = w->ranges;
            size_t fs = kv_msg_hello_ack_size(strlen(ack.backend), ack.n_ranges);
            if (!fs || kv_grow(&c->tx, &c->tx_cap, fs) ||
                (rc = kv_msg_hello_ack_encode(c->tx, c->tx_cap, rid, &ack, &n, &d))) {
                kv_conn_send_error(c, rid, KV_EINTERNAL, "cannot encode HELLO_ACK");
                snprintf(why, why_cap, "internal: cannot encode HELLO_ACK: %s", d.msg);
                return;
            }
            c->hello = true;
            c->version = (uint16_t)hi;
            c->enc_mask = ack.enc_mask;
            kv_wlog(w, "conn %llu %s: handshake ok (protocol v%u)", (unsigned long long)c->id, c->peer, hi);
            break;
        }
        case KV_MSG_COMPUTE: {
            const kv_msg_compute *cm = &m.u.compute;
            if (!((c->enc_mask >> cm->enc) & 1u) || !((c->enc_mask >> cm->out_enc) & 1u)) {
                kv_fail(&d, KV_EPROTO, "COMPUTE uses encoding %s/%s, not negotiated", kv_enc_name(cm->enc),
                        kv_enc_name(cm->out_enc));
                kv_conn_send_error(c, rid, KV_EPROTO, d.msg);
                snprintf(why, why_cap, "protocol error: %s", d.msg);
                return;
            }
            /* experts not held: a request-level error, the connection stays */
            uint32_t bad = UINT32_MAX;
            for (uint32_t i = 0; i < cm->n_pairs && bad == UINT32_MAX; i++) {
                kv_proto_pair p = kv_msg_compute_pair(cm, i);
                if (!w->held[(size_t)cm->layer * w->n_expert + p.expert]) bad = i;
            }
            if (bad != UINT32_MAX) {
                kv_proto_pair p = kv_msg_compute_pair(cm, bad);
                kv_fail(&d, KV_ENOTFOUND, "layer %u expert %u (pair %u) is not held by this worker", cm->layer,
                        p.expert, bad);
                kv_conn_send_error(c, rid, KV_ENOTFOUND, d.msg);
                kv_wlog(w, "conn %llu %s: request %u refused: %s", (unsigned long long)c->id, c->peer, rid, d.msg);
                continue;
            }
            rc = kv_conn_compute(c, rid, cm, &n, &d);
            if (rc) {
                kv_conn_send_error(c, rid, rc, d.msg);
                kv_wlog(w, "conn %llu %s: request %u failed: %s", (unsigned long long)c->id, c->peer, rid, d.msg);
                continue;
            }
            atomic_fetch_add(&w->n_compute, 1);
            atomic_fetch_add(&w->n_pairs, cm->n_pairs);
            atomic_fetch_add(&w->n_tokens, cm->n_tokens);
            break;
        }
        case KV_MSG_PING:
            if (kv_grow(&c->tx, &c->tx_cap, KV_PROTO_HEADER + KV_PROTO_PING_SIZE)) return;
            kv_msg_ping_encode(c->tx, c->tx_cap, KV_MSG_PONG, rid, m.u.nonce, &n, NULL);
            break;
        case KV_MSG_STATS: {
            kv_msg_stats s;
            kv_worker_stats(w, &s);
            if (kv_grow(&c->tx, &c->tx_cap, KV_PROTO_HEADER + KV_PROTO_STATS_ACK_SIZE)) return;
            kv_msg_stats_ack_encode(c->tx, c->tx_cap, rid, &s, &n, NULL);
            break;
        }
        case KV_MSG_ERROR:
            snprintf(why, why_cap, "peer sent ERROR %s: %.300s", kv_err_name(m.u.error.code), m.u.error.msg);
            return;
        default:
            kv_fail(&d, KV_EPROTO, "unexpected %s from a coordinator", kv_msg_type_name(m.h.type));
            kv_conn_send_error(c, rid, KV_EPROTO, d.msg);
            snprintf(why, why_cap, "protocol error: %s", d.msg);
            return;
        }
        if ((rc = kv_proto_write_all(c->fd, c->tx, n, KV_WORKER_WRITE_MS, &d))) {
            snprintf(why, why_cap, "send: %s", d.msg);
            return;
        }
        kv_shrink(&c->tx, &c->tx_cap);
        kv_shrink(&c->rx, &c->rx_cap);
    }
}

/* Before closing: half-close and discard what the peer still sends for a
 * moment, so a pending ERROR frame is not destroyed by a reset (closing with
 * unread input makes TCP send RST). Bounded in time and bytes. */
static void kv_conn_linger(kv_conn *c) {
    shutdown(c->fd, SHUT_WR);
    uint8_t sink[4096];
    size_t total = 0;
    int64_t deadline = kv_now_ms() + 250;
    while (total < (1u << 20) && !atomic_load(&c->w->stop)) {
        int64_t left = deadline - kv_now_ms();
        if (left <= 0) break;
        struct pollfd pf = {.fd = c->fd, .events = POLLIN};
        int pr = poll(&pf, 1, (int)left);
        if (pr < 0 && errno == EINTR) continue;
        if (pr <= 0) break;
        ssize_t k = read(c->fd, sink, sizeof sink);
        if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (k <= 0) break;
        total += (size_t)k;
    }
}

static void *kv_conn_main(void *arg) {
    kv_conn *c = arg;
    kv_worker *w = c->w;
    char why[600] = "closed";
    kv_conn_serve(c, why, sizeof why);
    kv_wlog(w, "conn %llu %s: closed (%s)", (unsigned long long)c->id, c->peer, why);
    kv_conn_linger(c);
    pthread_mutex_lock(&w->mu);
    w->conns[c->slot] = NULL;
    w->n_active--;
    close(c->fd);
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    free(c->rx);
    free(c->tx);
    free(c);
    return NULL;
}

/* ---- accept loop -------------------------------------------------------------------------- */

int kv_worker_serve(kv_worker *w, kv_diag *d) {
    int rc = 0;
    while (!atomic_load(&w->stop)) {
        struct pollfd pf[2] = {{.fd = w->lfd, .events = POLLIN}, {.fd = w->stop_pipe[0], .events = POLLIN}};
        int pr = poll(pf, 2, 1000);
        if (pr < 0) {
            if (errno == EINTR) continue;
            rc = kv_fail(d, KV_EIO, "worker: poll: %s", strerror(errno));
            break;
        }
        if (pf[1].revents) break;
        if (!(pf[0].revents & POLLIN)) continue;
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        int fd = accept4(w->lfd, (struct sockaddr *)&ss, &sl, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                kv_wlog(w, "accept: %s (backing off)", strerror(errno));
                usleep(100000);
                continue;
            }
            rc = kv_fail(d, KV_EIO, "worker: accept: %s", strerror(errno));
            break;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        char hb[INET6_ADDRSTRLEN] = "?", pb[8] = "?";
        getnameinfo((struct sockaddr *)&ss, sl, hb, sizeof hb, pb, sizeof pb, NI_NUMERICHOST | NI_NUMERICSERV);
        uint64_t id = atomic_fetch_add(&w->n_conns, 1) + 1;
        kv_conn *c = calloc(1, sizeof *c);
        pthread_mutex_lock(&w->mu);
        int slot = -1;
        for (int i = 0; i < w->opts.max_conns && c; i++)
            if (!w->conns[i]) {
                slot = i;
                break;
            }
        if (slot < 0) {
            pthread_mutex_unlock(&w->mu);
            kv_conn tmp = {.w = w, .fd = fd};
            kv_conn_send_error(&tmp, 0, KV_ERANGE, c ? "too many connections" : "out of memory");
            kv_wlog(w, "conn %llu %s:%s: refused (%s)", (unsigned long long)id, hb, pb,
                    c ? "too many connections" : "out of memory");
            close(fd);
            free(c);
            continue;
        }
        c->w = w;
        c->fd = fd;
        c->slot = slot;
        c->id = id;
        snprintf(c->peer, sizeof c->peer, "%s:%s", hb, pb);
        w->conns[slot] = c;
        w->n_active++;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        pthread_t th;
        int pe = pthread_create(&th, &at, kv_conn_main, c);
        pthread_attr_destroy(&at);
        if (pe) {
            w->conns[slot] = NULL;
            w->n_active--;
            pthread_mutex_unlock(&w->mu);
            kv_wlog(w, "conn %llu %s: refused (no thread: %s)", (unsigned long long)id, c->peer, strerror(pe));
            close(fd);
            free(c);
            continue;
        }
        pthread_mutex_unlock(&w->mu);
        kv_wlog(w, "conn %llu %s: opened", (unsigned long long)id, c->peer);
    }
    /* stop: wake every connection thread and wait for them */
    atomic_store(&w->stop, 1);
    pthread_mutex_lock(&w->mu);
    for (int i = 0; i < w->opts.max_conns; i++)
        if (w->conns[i]) shutdown(w->conns[i]->fd, SHUT_RDWR);
    while (w->n_active > 0) pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
    return rc;
}
