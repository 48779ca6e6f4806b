/* The expert worker: serves COMPUTE requests for the experts held in a set
 * of slab files (or a full model file) over the dispatch protocol, to many
 * coordinators at once, on a fixed number of threads.
 *
 * Threads: the thread that calls kv_worker_serve runs one event loop
 * (include/kvasir/net.h) for every connection, and the compute pool
 * (--threads) runs the kernels; nothing else, whatever the number of
 * connections. A connection's COMPUTE is its job: up to v5 it is held in
 * the receive buffer (the connection reads nothing more meanwhile); from
 * v6 on it is copied out, so that a CANCEL behind it is read and served at
 * once (the job, if it has not begun its RESULT, is dropped uncomputed and
 * answered CANCELLED; any other id is ignored, at no cost), while any
 * other frame waits in the receive buffer until the job's answer is out
 * (answers keep request order). The loop's tick runs one scheduling round
 * at a time:
 *   - round robin over connections with a job: the first ready job names
 *     the layer, and every ready job of that layer gets a quantum of its
 *     next pairs (KV_WORKER_CHUNK rows per round in all), so requests of
 *     several coordinators for one layer share one kernel call and one
 *     maximum-size request cannot delay a small one by more than a round;
 *   - the rows are computed in (expert, arrival) order by the in-process
 *     provider with n_used = 1, and each job's rows are converted straight
 *     into its connection's send queue in request order (a RESULT is
 *     streamed while it is computed, never buffered whole);
 *   - a job whose peer does not read (send queue above KV_WORKER_TX_HWM)
 *     is skipped until the queue drains, so it holds neither memory nor
 *     compute time; the write deadline then closes it.
 * Every output element is one whole dot product, so a row does not depend
 * on which other rows share its kernel call: a RESULT is bit-identical to
 * the in-process computation whatever the batch composition, thread count
 * or arrival order.
 *
 * Authentication: after HELLO the only frame served is AUTH; nothing is
 * computed or told to a connection before its coordinator has signed this
 * connection's challenge with a key that is allowed (listed, or vouched for
 * by the trusted hub); the allowed set can be replaced while serving
 * (kv_worker_set_auth, under auth_mu).
 *
 * Transport (v5): one port takes TLS 1.3 and plaintext, told by the first
 * byte (kv_link_sniff). Over TLS only v5 is negotiated and the transcript
 * both sides sign ends with the session's exporter, so a proof relayed by
 * a man in the middle that terminates TLS fails here; a plaintext HELLO is
 * served only from loopback or with insecure_plaintext, else answered with
 * an ERROR naming TLS. A refusal to a peer that has sent nothing yet goes
 * out in plaintext (its transport is not known).
 *
 * Slots and deadlines (what no peer may hold without doing real work):
 * max_conns places in all. A connection still in its handshake is
 * pending: it must complete HELLO and AUTH within the handshake timeout,
 * and at most max_pending_per_addr of them come from one address (an IPv4
 * address, or an IPv6 /64), at most max_pending in all. A stranger never
 * takes the place of an authenticated connection; among pending ones:
 *   - the newcomer's address at its cap: the pending connection of that
 *     address that has made the least progress (one closing already, then
 *     one that has sent nothing, then one that has), oldest first, yields
 *     its place to it;
 *   - every place taken: a pending connection of an address that holds at
 *     least two more than the newcomer's yields (least progress, then the
 *     address holding most, then oldest), so shares move towards equal and
 *     a yielded peer that comes straight back finds no one to displace;
 *     when every address holds about as many as the newcomer's, it is
 *     refused (ERANGE: "no room now", which a coordinator retries).
 * An authenticated connection that has gone at least evict_idle_ms without
 * a COMPUTE (and is not being computed for; PING does not count as work)
 * may lose its place, but only to a peer that proves an allowed key: a
 * newcomer may wait for its handshake beyond max_conns while such idle
 * connections exist (at most one newcomer per idle one); when its AUTH
 * succeeds, a pending stranger beyond max_conns yields first, and only
 * when every place is authenticated is the idle one longest without work
 * closed. A newly authenticated peer that finds every place authenticated
 * and doing work is refused (ERANGE) and retries later. A frame started
 * must complete within the read timeout.
 *
 * Memory: every connection's buffers are charged to one budget; a receive
 * buffer grows with the bytes that actually arrived, up to the largest
 * COMPUTE this model admits, and so does a v6 job's copy (kept for the next
 * job up to KV_WORKER_JOB_KEEP); the send queue is bounded by the high-water
 * mark plus one round. The compute scratch is allocated once. */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/arch.h"
#include "kvasir/dispatch_evidence.h"
#include "kvasir/dispatch_proto.h"
#include "kvasir/dispatch_receipt.h"
#include "kvasir/dispatch_worker.h"
#include "kvasir/opencl.h"
#include "kvasir/ledger.h"
#include "kvasir/gguf.h"
#include "kvasir/model.h"
#include "kvasir/net.h"
#include "kvasir/pieces.h"
#include "kvasir/quant.h"
#include "kvasir/slice.h"

#define KV_WORKER_CHUNK 512u             /* rows per scheduling round (one kernel call) */
#define KV_WORKER_MAX_FILES 65536u       /* slab files one worker opens */
#define KV_WORKER_TX_HWM (1u << 20)      /* a job waits while its peer has this much unread */
#define KV_WORKER_HASH_BUF (4u << 20)    /* read size while hashing slabs */
#define KV_WORKER_ERR_FRAME (KV_PROTO_HEADER + KV_PROTO_ERROR_FIXED + KV_PROTO_MAX_TEXT)
#define KV_WORKER_JOB_KEEP (4u << 20)    /* a v6 job copy larger than this is freed when its job ends */

typedef struct kv_wconn kv_wconn;

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
    kv_slab_hash *slabs;             /* [n_slabs] what each file serves, with its SHA-256 */
    size_t n_slabs;
    size_t max_payload;              /* largest COMPUTE payload this model admits */
    uint32_t max_pairs;              /* pairs per COMPUTE (the cost cap) */
    kv_pool *pool;
    kv_expert_provider prov;
    bool have_prov;
    /* round scratch (loop thread only) */
    uint64_t *keys;                  /* [KV_WORKER_CHUNK] (expert << 32) | gathered row */
    kv_wconn **rconn;                /* [KV_WORKER_CHUNK] job of each gathered row */
    uint32_t *rpair;                 /* [KV_WORKER_CHUNK] its pair index in that job */
    float *xs;                       /* [KV_WORKER_CHUNK][n_embd] gathered inputs */
    int32_t *ids;                    /* [KV_WORKER_CHUNK] expert of each gathered row */
    uint64_t n_stall_seen;           /* test stall: COMPUTEs taken so far (loop thread) */
    float *ys;                       /* [KV_WORKER_CHUNK][n_embd] outputs */
    float *gs, *us;                  /* [KV_WORKER_CHUNK][n_ff] gate and up pre-activations */
    float *xprev;                    /* test lie "stale": [KV_WORKER_CHUNK][n_embd] last round's inputs */
    uint32_t n_prev;                 /* rows in xprev */
    uint64_t lie_pairs;              /* test lies: pairs computed so far */
    /* connections (loop thread only) */
    kv_net_loop *loop;
    kv_net_budget budget;
    kv_net_watch lwatch;             /* the listening socket */
    bool listening;                  /* lwatch registered */
    kv_net_timer accept_t;           /* re-arms accepting after EMFILE and the like */
    kv_wconn **conns;                /* [n_slots] every connection, NULL = free */
    int n_slots;                     /* max_conns + max_pending */
    int n_authed, n_pending;         /* connections past / in their handshake */
    kv_wconn *jobs;                  /* ring of connections with a job; the next to serve */
    int lfd;                         /* listening socket */
    atomic_int stop;
    /* authentication (v3): who may be served */
    uint8_t pk[32], sk[64];          /* this worker's identity */
    kv_tls_ctx *tls;                 /* its TLS context (a certificate of pk) */
    pthread_mutex_t auth_mu;         /* guards allow, n_allow, hub_key, have_hub */
    bool have_auth_mu;
    uint8_t (*allow)[32];            /* [n_allow] coordinator keys served, sorted */
    size_t n_allow;
    uint8_t hub_key[32];             /* hub whose vouchers are honored, if have_hub */
    bool have_hub;
    /* counters */
    atomic_uint_fast64_t n_compute, n_pairs, n_tokens, n_conns, n_errors, n_batches, n_merged, compute_us;
    atomic_uint_fast64_t n_cancelled; /* jobs called off by a CANCEL before their RESULT began */
    int64_t t_start_ms;
};

struct kv_wconn {
    kv_worker *w;
    kv_net_conn *nc;
    int slot;                        /* index in w->conns, -1 once evicted */
    uint64_t id;                     /* connection number, for logs */
    char peer[96];                   /* "HOST:PORT" of the client */
    char ip[INET6_ADDRSTRLEN];       /* its address, for messages */
    kv_link_sniff *tp;               /* its transport (owned by nc): TLS or plaintext */
    bool loopback;                   /* the peer's address is loopback */
    uint8_t ipk[16];                 /* the per-address key: IPv4 (mapped) or an IPv6 /64 */
    int64_t opened_ms;               /* accepted at (monotonic) */
    bool hello;                      /* HELLO answered (HELLO_ACK and AUTH_CHALLENGE sent) */
    bool authed;                     /* AUTH verified: the handshake is done */
    bool hub;                        /* the peer is the hub itself: its compute challenges are not served work */
    uint8_t challenge[32];           /* sent in AUTH_CHALLENGE */
    uint8_t peer_key[32];            /* the coordinator key proved in AUTH */
    kv_receipt_budget budget;        /* pairs answered here, and those signed for in receipts */
    uint16_t version;                /* negotiated */
    uint32_t enc_mask;               /* negotiated encodings */
    int64_t last_work_ms;            /* handshake or last COMPUTE */
    kv_net_timer hs_t;               /* handshake deadline */
    kv_net_timer idle_t;             /* idle timeout (when configured) */
    kv_net_timer delay_t;            /* test delay: wakes the loop when the job may start */
    int64_t ready_ms;                /* test delay: the job is not started before this */
    /* the job: a COMPUTE held in the receive buffer (v5 and older), or, from
       v6 on, copied into jbuf so that the frames behind it are read: a CANCEL
       of it is served at once, anything else waits in the receive buffer
       (defer) until the job ends, so replies keep request order */
    bool busy;
    uint8_t *jbuf;                   /* v6: [jcap] the job's COMPUTE frame (charged to the budget) */
    size_t jcap;
    const uint8_t *defer;            /* v6: a frame that came while the job ran, held in the receive buffer */
    size_t defer_len;
    uint32_t rid;                    /* its request id */
    kv_msg_compute job;              /* view into the held frame */
    const float *xin;                /* hidden states in place, or NULL (converted per row) */
    uint32_t next;                   /* pairs [0, next) are queued for sending */
    bool pre;                        /* the job answers RESULT_PRE (y, gate, up) */
    uint32_t oenc;                   /* its output encoding (out_enc without KV_OUT_PREACT) */
    uint8_t *wbase;                  /* this round's reserved rows in the send queue */
    uint32_t wq;                     /* rows in this round */
    /* v4: the job's signature (docs/PROTOCOL.md "Signed results") */
    uint8_t (*xh)[32];               /* [xh_cap] SHA-256 of each token's x row (grows, kept) */
    uint32_t xh_cap;
    kv_result_tree tree;             /* leaves of the rows sent so far */
    kv_wconn *jprev, *jnext;         /* in w->jobs */
};

static int64_t kv_now_ms(void) { return kv_net_now_ms(); }

/* Unix ms: voucher expiry is a wall-clock time the hub chose. */
static int64_t kv_wall_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
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
    kv_expert_weights ew = {0};
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
        /* a folder holds slabs, each one file: a file there carrying split.* keys
           must not make the worker open its "siblings"; files named one by one
           may be a split model's parts */
        if ((rc = folder ? kv_gguf_open_file(&g, paths[i], d) : kv_gguf_open(&g, paths[i], d))) break;
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
                snprintf(name, sizeof name, "blk.%u." KV_EXPERT_STEM_GATE ".weight", l);
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

/* ---- slab hashes -------------------------------------------------------------------- */

static int kv_hash_path(const char *path, uint8_t out[32], kv_diag *d) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kv_fail(d, KV_EIO, "%s: %s", path, strerror(errno));
    uint8_t *buf = malloc(KV_WORKER_HASH_BUF);
    if (!buf) {
        close(fd);
        return kv_fail(d, KV_ENOMEM, "slabs: out of memory");
    }
    kv_sha256 h;
    kv_sha256_init(&h);
    int rc = 0;
    for (;;) {
        ssize_t k = read(fd, buf, KV_WORKER_HASH_BUF);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) {
            rc = kv_fail(d, KV_EIO, "%s: %s", path, strerror(errno));
            break;
        }
        if (k == 0) break;
        kv_sha256_update(&h, buf, (size_t)k);
    }
    free(buf);
    close(fd);
    if (rc) kv_sha256_discard(&h);
    else kv_sha256_final(&h, out);
    return rc;
}

static int kv_cmp_slab(const void *a, const void *b) {
    const kv_slab_hash *x = a, *y = b;
    if (x->layer != y->layer) return x->layer < y->layer ? -1 : 1;
    return (x->first > y->first) - (x->first < y->first);
}

/* The SHA-256 of every file served, as (layer, first, last) entries for the
 * HELLO_ACK: a slab is one entry; a full model file is one entry per layer
 * it holds, with the whole file's hash (no manifest lists such a piece, so
 * a coordinator refuses it). */
/* True if the file at path has a hole before its end (SEEK_HOLE): a sparse
 * skeleton's piece, whose zeros are not worth hashing. */
static bool kv_file_has_holes(const char *path) {
    const int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return false;
    struct stat st;
    bool holes = false;
    if (!fstat(fd, &st) && S_ISREG(st.st_mode) && st.st_size > 0) {
        const off_t h = lseek(fd, 0, SEEK_HOLE);
        holes = h >= 0 && h < st.st_size;
    }
    close(fd);
    return holes;
}

static int kv_worker_hash_slabs(kv_worker *w, kv_diag *d) {
    size_t cap = 0;
    for (size_t i = 0; i < w->n_files; i++) {
        uint32_t L;
        cap += kv_gguf_get_u32(w->files[i], "kvasir.slab.layer", &L, NULL) ? w->n_layer : 1;
    }
    if (cap > KV_PROTO_MAX_RANGES) return kv_fail(d, KV_ERANGE, "slabs: %zu pieces exceed the protocol's %u", cap, KV_PROTO_MAX_RANGES);
    w->slabs = calloc(cap ? cap : 1, sizeof *w->slabs);
    if (!w->slabs) return kv_fail(d, KV_ENOMEM, "slabs: out of memory");
    for (size_t i = 0; i < w->n_files; i++) {
        uint8_t h[32] = {0};
        if (!(w->opts.allow_sparse && kv_file_has_holes(w->paths[i]))) {
            int rc = kv_hash_path(w->paths[i], h, d);
            if (rc) return rc;
        }
        uint32_t L, f, l;
        if (!kv_gguf_get_u32(w->files[i], "kvasir.slab.layer", &L, NULL) &&
            !kv_gguf_get_u32(w->files[i], "kvasir.slab.first", &f, NULL) &&
            !kv_gguf_get_u32(w->files[i], "kvasir.slab.last", &l, NULL)) {
            w->slabs[w->n_slabs] = (kv_slab_hash){L, f, l, {0}};
            memcpy(w->slabs[w->n_slabs++].sha256, h, 32);
            continue;
        }
        for (uint32_t layer = 0; layer < w->n_layer; layer++) {
            if (!w->held[(size_t)layer * w->n_expert]) continue;
            w->slabs[w->n_slabs] = (kv_slab_hash){layer, 0, w->n_expert - 1, {0}};
            memcpy(w->slabs[w->n_slabs++].sha256, h, 32);
        }
    }
    qsort(w->slabs, w->n_slabs, sizeof *w->slabs, kv_cmp_slab);
    return 0;
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
    if (w->opts.handshake_timeout_ms <= 0) w->opts.handshake_timeout_ms = 5000;
    if (w->opts.max_pending_per_addr <= 0) w->opts.max_pending_per_addr = 8;
    if (w->opts.max_pending <= 0) w->opts.max_pending = 64;
    if (w->opts.test_delay_ms < 0) w->opts.test_delay_ms = 0;
    if (w->opts.test_stall_ms < 0 || w->opts.test_stall_ms > 60000 || w->opts.test_stall_every < 0 ||
        w->opts.test_stall_every > 1000000) {
        free(w);
        return kv_fail(d, KV_EINVAL, "worker: test stall of %d ms every %d requests is out of range (0-60000 ms, "
                       "every 1-1000000)", opts->test_stall_ms, opts->test_stall_every);
    }
    if (w->opts.test_stall_every == 0) w->opts.test_stall_every = 1;
    if (w->opts.evict_idle_ms <= 0) w->opts.evict_idle_ms = 10000;
    if (w->opts.write_timeout_ms <= 0) w->opts.write_timeout_ms = 30000;
    if (!w->opts.mem_budget) w->opts.mem_budget = (size_t)1 << 30;
    if (!w->opts.max_request_cost) w->opts.max_request_cost = (uint64_t)1 << 36;
    w->lfd = -1;
    if (sodium_init() < 0) {
        free(w);
        return kv_fail(d, KV_EINTERNAL, "worker: libsodium failed to start");
    }
    if (opts->key_sk) {
        memcpy(w->sk, opts->key_sk, 64);
        crypto_sign_ed25519_sk_to_pk(w->pk, w->sk);
    } else {
        crypto_sign_keypair(w->pk, w->sk);
    }
    w->opts.key_sk = NULL;
    w->opts.allow_keys = NULL;
    w->opts.hub_key = NULL;
    pthread_mutex_init(&w->auth_mu, NULL);
    w->have_auth_mu = true;
    int rc = 0;
    if (!opts->n_allow_keys && !opts->hub_key)
        rc = kv_fail(d, KV_EINVAL, "worker: no coordinator could use it: allow coordinator keys (--allow-key) "
                                   "or name a hub whose vouchers it honors");
    if (!rc) rc = kv_worker_set_auth(w, opts->allow_keys, opts->n_allow_keys, opts->hub_key, d);
    if (!rc) rc = kv_worker_load(w, d);
    if (!rc) rc = kv_worker_hash_slabs(w, d);
    if (!rc) {
        /* the largest COMPUTE that can be valid for this model */
        size_t mp = kv_msg_compute_size(KV_ENC_F32, KV_PROTO_MAX_TOKENS, w->n_embd, KV_PROTO_MAX_PAIRS);
        w->max_payload = mp ? mp - KV_PROTO_HEADER : KV_PROTO_MAX_PAYLOAD;
        /* the cost cap: multiply-adds of one pair (gate, up, down) */
        const uint64_t per_pair = 3ull * w->n_embd * w->n_ff;
        uint64_t mpairs = w->opts.max_request_cost / (per_pair ? per_pair : 1);
        w->max_pairs = (uint32_t)(mpairs > KV_PROTO_MAX_PAIRS ? KV_PROTO_MAX_PAIRS : mpairs ? mpairs : 1);
        w->keys = malloc(sizeof *w->keys * KV_WORKER_CHUNK);
        w->rconn = malloc(sizeof *w->rconn * KV_WORKER_CHUNK);
        w->rpair = malloc(sizeof *w->rpair * KV_WORKER_CHUNK);
        w->xs = malloc(sizeof *w->xs * KV_WORKER_CHUNK * w->n_embd);
        w->ys = malloc(sizeof *w->ys * KV_WORKER_CHUNK * w->n_embd);
        w->gs = malloc(sizeof *w->gs * KV_WORKER_CHUNK * w->n_ff);
        w->us = malloc(sizeof *w->us * KV_WORKER_CHUNK * w->n_ff);
        w->xprev = malloc(sizeof *w->xprev * KV_WORKER_CHUNK * w->n_embd);
        w->ids = malloc(sizeof *w->ids * KV_WORKER_CHUNK);
        w->n_slots = w->opts.max_conns + w->opts.max_pending;
        w->conns = calloc((size_t)w->n_slots, sizeof *w->conns);
        if (!w->keys || !w->rconn || !w->rpair || !w->xs || !w->ys || !w->ids || !w->conns || !w->gs || !w->us ||
            !w->xprev)
            rc = kv_fail(d, KV_ENOMEM, "worker: out of memory");
    }
    if (!rc) rc = kv_pool_new(&w->pool, w->opts.n_threads, d);
    if (!rc) {
        kv_expert_source src = {w, kv_tab_acquire, NULL, w->n_layer, w->n_expert, w->n_embd, w->n_ff, 1};
        if (w->opts.opencl) /* the OpenCL expert backend (kvasir/opencl.h) */
            rc = kv_opencl_expert_new(&w->prov, &src, KV_WORKER_CHUNK, d);
        else
            rc = kv_expert_local_new_src(&w->prov, &src, w->pool, KV_WORKER_CHUNK, d);
        w->have_prov = rc == 0;
    }
    if (!rc) rc = kv_link_tls_ctx(&w->tls, w->sk, d);
    if (!rc) rc = kv_net_loop_new(&w->loop, d);
    if (!rc) rc = kv_net_listen(w->opts.listen, 128, &w->lfd, w->addr, sizeof w->addr, d);
    if (rc) {
        kv_worker_free(w);
        return rc;
    }
    kv_net_budget_init(&w->budget, w->opts.mem_budget);
    w->t_start_ms = kv_now_ms();
    *out = w;
    return 0;
}

void kv_worker_free(kv_worker *w) {
    if (!w) return;
    kv_net_loop_free(w->loop); /* closes connections still open */
    if (w->conns)
        for (int i = 0; i < w->n_slots; i++) {
            if (w->conns[i]) free(w->conns[i]->xh); /* the loop freed its connection without on_close */
            free(w->conns[i]);
        }
    if (w->lfd >= 0) close(w->lfd);
    kv_tls_ctx_free(w->tls);
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
    free(w->slabs);
    free(w->keys);
    free(w->rconn);
    free(w->rpair);
    free(w->xs);
    free(w->ys);
    free(w->gs);
    free(w->us);
    free(w->xprev);
    free(w->ids);
    free(w->conns);
    free(w->allow);
    if (w->have_auth_mu) pthread_mutex_destroy(&w->auth_mu);
    sodium_memzero(w->sk, sizeof w->sk);
    free(w);
}

const uint8_t *kv_worker_key(const kv_worker *w) { return w->pk; }

static int kv_cmp_key(const void *a, const void *b) { return memcmp(a, b, 32); }

int kv_worker_set_auth(kv_worker *w, const uint8_t (*keys)[32], size_t n, const uint8_t *hub_key, kv_diag *d) {
    if (n > KV_PROTO_MAX_KEYS) return kv_fail(d, KV_ERANGE, "worker: more than %u allowed keys", KV_PROTO_MAX_KEYS);
    uint8_t(*copy)[32] = NULL;
    if (n) {
        if (!(copy = malloc(n * sizeof *copy))) return kv_fail(d, KV_ENOMEM, "worker: out of memory");
        memcpy(copy, keys, n * sizeof *copy);
        qsort(copy, n, sizeof *copy, kv_cmp_key);
    }
    pthread_mutex_lock(&w->auth_mu);
    uint8_t(*old)[32] = w->allow;
    w->allow = copy;
    w->n_allow = n;
    if (hub_key) {
        memcpy(w->hub_key, hub_key, 32);
        w->have_hub = true;
    }
    pthread_mutex_unlock(&w->auth_mu);
    free(old);
    return 0;
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
    s->n_batches = atomic_load(&mw->n_batches);
    s->n_merged = atomic_load(&mw->n_merged);
    s->compute_us = atomic_load(&mw->compute_us);
    s->n_cancelled = atomic_load(&mw->n_cancelled);
}

void kv_worker_stop(kv_worker *w) {
    atomic_store(&w->stop, 1);
    if (w->loop) kv_net_loop_stop(w->loop);
}

/* ---- one connection -------------------------------------------------------------------- */

/* Queues a frame just encoded into buf, stamped with the negotiated version. */
static void kv_wc_queue(kv_wconn *c, uint8_t *buf, size_t n) {
    if (c->hello) kv_frame_set_version(buf, c->version);
    (void)kv_net_conn_send(c->nc, buf, n);
}

/* Queues an ERROR frame and counts it. */
static void kv_wc_error(kv_wconn *c, uint32_t rid, int code, const char *msg) {
    uint8_t buf[KV_WORKER_ERR_FRAME];
    size_t n;
    atomic_fetch_add(&c->w->n_errors, 1);
    if (kv_msg_error_encode(buf, sizeof buf, rid, code, msg, &n, NULL)) return;
    if (kv_link_sniff_undecided(c->tp)) {
        /* a peer that has sent nothing yet: its transport is unknown, and the
           connection, still in its handshake phase, would drop a queued frame.
           It is told in plaintext, at once and best effort, as a refusal at
           accept is; a TLS client would have sent its hello already. */
        ssize_t r = send(kv_net_conn_fd(c->nc), buf, n, MSG_DONTWAIT | MSG_NOSIGNAL);
        (void)r;
        return;
    }
    kv_wc_queue(c, buf, n);
}

/* A protocol error: ERROR, then close (after it is flushed). */
static int kv_wc_fatal(kv_wconn *c, uint32_t rid, int code, const char *what, const char *msg) {
    char why[KV_PROTO_MAX_TEXT + 64];
    kv_wc_error(c, rid, code, msg);
    snprintf(why, sizeof why, "%s: %s", what, msg);
    kv_net_conn_close(c->nc, code, why);
    return 0;
}

static void kv_job_add(kv_worker *w, kv_wconn *c) {
    if (!w->jobs) {
        c->jprev = c->jnext = c;
        w->jobs = c;
        return;
    }
    kv_wconn *h = w->jobs; /* at the tail: served after everyone waiting */
    c->jprev = h->jprev;
    c->jnext = h;
    h->jprev->jnext = c;
    h->jprev = c;
}

static void kv_job_remove(kv_worker *w, kv_wconn *c) {
    if (!c->busy) return;
    c->busy = false;
    if (c->jnext == c) w->jobs = NULL;
    else {
        c->jprev->jnext = c->jnext;
        c->jnext->jprev = c->jprev;
        if (w->jobs == c) w->jobs = c->jnext;
    }
    c->jprev = c->jnext = NULL;
}

static int kv_wc_frame_len(kv_net_conn *nc, const uint8_t *hdr, size_t *total, kv_diag *d) {
    kv_wconn *c = kv_net_conn_data(nc);
    kv_frame_header h;
    int rc = kv_frame_header_decode(hdr, KV_PROTO_HEADER, &h, d);
    if (rc) return rc;
    if (h.len > c->w->max_payload)
        return kv_fail(d, KV_ERANGE, "frame: payload length %u exceeds %zu (the largest valid request for this model)",
                       h.len, c->w->max_payload);
    *total = KV_PROTO_HEADER + (size_t)h.len;
    return 0;
}

static void kv_wc_on_error(kv_net_conn *nc, int code, const char *why) {
    kv_wconn *c = kv_net_conn_data(nc);
    if (code != KV_EIO) kv_wc_error(c, 0, code, why);
}

static void kv_wc_handshake_timeout(kv_net_loop *l, kv_net_timer *t) {
    kv_wconn *c = t->data;
    (void)l;
    char msg[96];
    snprintf(msg, sizeof msg, "no HELLO within %d ms", c->w->opts.handshake_timeout_ms);
    kv_wc_fatal(c, 0, KV_ETIMEOUT, "handshake", msg);
}

static void kv_wc_idle_timeout(kv_net_loop *l, kv_net_timer *t) {
    kv_wconn *c = t->data;
    if (c->busy) { /* working for it: not idle */
        kv_net_timer_start(l, t, c->w->opts.idle_timeout_ms);
        return;
    }
    char msg[96];
    snprintf(msg, sizeof msg, "idle for %d ms", c->w->opts.idle_timeout_ms);
    kv_wc_fatal(c, 0, KV_ETIMEOUT, "idle", msg);
}

/* Test delay over: nothing to do, the tick that follows starts the job. */
static void kv_wc_delay_over(kv_net_loop *l, kv_net_timer *t) {
    (void)l;
    (void)t;
}

static int kv_wc_hello(kv_wconn *c, uint32_t rid, const kv_msg_hello *h) {
    kv_worker *w = c->w;
    kv_diag d = {0};
    /* v3 and later only: an older coordinator cannot authenticate; over TLS
       v5 and later only: an older one would not bind its proof to the session */
    const bool tls = kv_link_sniff_tls(c->tp) != NULL;
    const uint32_t floor = tls ? KV_PROTO_TLS_VERSION : KV_PROTO_AUTH_VERSION;
    uint32_t lo = h->min_version > floor ? h->min_version : floor;
    uint32_t hi = h->max_version < KV_PROTO_VERSION ? h->max_version : KV_PROTO_VERSION;
    int rc = 0;
    if (c->hello) rc = kv_fail(&d, KV_EPROTO, "second HELLO");
    else if (!tls && !c->loopback && !w->opts.insecure_plaintext)
        rc = kv_fail(&d, KV_EUNSUPPORTED, "plaintext dispatch from %s refused: a link that leaves the machine needs "
                     "TLS 1.3 (dispatch v%u, its key handshake bound to the TLS session); this coordinator speaks "
                     "[%u, %u] in plaintext (an older build, or --insecure-plaintext on one side only)", c->ip,
                     KV_PROTO_TLS_VERSION, h->min_version, h->max_version);
    else if (tls && lo > hi)
        rc = kv_fail(&d, KV_EUNSUPPORTED, "no common protocol version over TLS: coordinator speaks [%u, %u], this "
                     "worker [%u, %u] (TLS dispatch needs v%u)", h->min_version, h->max_version, KV_PROTO_TLS_VERSION,
                     KV_PROTO_VERSION, KV_PROTO_TLS_VERSION);
    else if (lo > hi)
        rc = kv_fail(&d, KV_EUNSUPPORTED, "no common protocol version: coordinator speaks [%u, %u], this worker [%u, %u] "
                     "(authenticated dispatch needs v%u)", h->min_version, h->max_version, KV_PROTO_AUTH_VERSION,
                     KV_PROTO_VERSION, KV_PROTO_AUTH_VERSION);
    else if (strcmp(h->model_id, w->model_id)) /* never echo any part of our id */
        rc = kv_fail(&d, KV_EHASH, "this worker does not serve the model requested");
    if (rc) return kv_wc_fatal(c, rid, rc, "handshake refused", d.msg);
    kv_msg_hello_ack ack = {0};
    ack.version = (uint16_t)hi;
    memcpy(ack.model_id, w->model_id, sizeof ack.model_id);
    ack.n_layer = w->n_layer;
    ack.n_embd = w->n_embd;
    ack.n_ff_exp = w->n_ff;
    ack.n_expert = w->n_expert;
    ack.n_expert_used = w->n_expert_used;
    /* pre-activations too, when asked (the CPU and the OpenCL providers both return them) */
    ack.enc_mask = h->enc_mask & KV_ENC_MASK_VALID;
    snprintf(ack.backend, sizeof ack.backend, "%s", w->opts.opencl ? "opencl" : kv_quant_backend());
    ack.n_ranges = (uint32_t)w->n_ranges;
    ack.ranges = w->ranges;
    ack.max_pairs = w->max_pairs;
    ack.n_slabs = (uint32_t)w->n_slabs;
    ack.slabs = w->slabs;
    size_t fs = kv_msg_hello_ack_size_v(ack.version, strlen(ack.backend), ack.n_ranges,
                                        ack.version >= 2 ? ack.n_slabs : 0), n = 0;
    uint8_t *p = fs ? kv_net_conn_reserve(c->nc, fs) : NULL;
    if (!p || kv_msg_hello_ack_encode(p, fs, rid, &ack, &n, &d)) {
        if (kv_net_conn_closing(c->nc)) return 0;
        return kv_wc_fatal(c, rid, KV_EINTERNAL, "internal", "cannot encode HELLO_ACK");
    }
    kv_net_conn_commit(c->nc, n);
    c->hello = true;
    c->version = (uint16_t)hi;
    c->enc_mask = ack.enc_mask;
    /* the challenge: the handshake deadline keeps running until AUTH */
    kv_msg_auth_challenge ch;
    memcpy(ch.worker_key, w->pk, 32);
    randombytes_buf(c->challenge, 32);
    memcpy(ch.challenge, c->challenge, 32);
    uint8_t buf[KV_PROTO_HEADER + KV_PROTO_AUTH_CHALLENGE_SIZE];
    if (kv_msg_auth_challenge_encode(buf, sizeof buf, rid, &ch, &n, &d) == 0) kv_wc_queue(c, buf, n);
    return 0;
}

/* ---- slots: the pending and the authenticated pool ------------------------------ */

/* Frees c's place (a yield, an eviction or a close); idempotent. */
static void kv_wc_unslot(kv_worker *w, kv_wconn *c) {
    if (c->slot < 0) return;
    KV_ASSERT(w->conns[c->slot] == c);
    w->conns[c->slot] = NULL;
    if (c->authed) w->n_authed--;
    else w->n_pending--;
    c->slot = -1;
}

/* Closes v with ERROR code and msg, and frees its place now. */
static void kv_wc_displace(kv_worker *w, kv_wconn *v, int code, const char *what, const char *msg) {
    kv_wc_fatal(v, 0, code, what, msg);
    kv_wc_unslot(w, v);
}

/* How far a pending connection got: 0 closing already (its deadline or an
 * error), 1 nothing sent yet, 2 bytes sent (a HELLO read, a TLS handshake begun, or waiting in the
 * socket: a coordinator sends HELLO at once, and one accepted in the same
 * round as strangers must not lose its place before it is read). */
static int kv_wc_progress(const kv_wconn *c) {
    if (kv_net_conn_closing(c->nc)) return 0;
    if (c->hello) return 2;
    if (!kv_link_sniff_undecided(c->tp)) return 2; /* its first bytes came (a TLS handshake under way) */
    int unread = 0;
    return ioctl(kv_net_conn_fd(c->nc), FIONREAD, &unread) == 0 && unread > 0 ? 2 : 1;
}

/* True if a yields before b: less progress, then older. */
static bool kv_yields_first(const kv_wconn *a, const kv_wconn *b) {
    const int pa = kv_wc_progress(a), pb = kv_wc_progress(b);
    if (pa != pb) return pa < pb;
    return a->opened_ms < b->opened_ms;
}

/* Room among the authenticated for c, which has just proved an allowed
 * key. With every place authenticated, the authenticated connection
 * longest without work (idle at least evict_idle_ms, nothing being
 * computed) gives up its place, else false: all are doing work. Over
 * max_conns (newcomers waited beyond it while idle ones existed), a
 * pending stranger yields first: an idle authenticated connection loses
 * its place only when nothing but authenticated peers is left to yield. */
static bool kv_worker_authed_room(kv_worker *w, const kv_wconn *c) {
    const int64_t now = kv_now_ms();
    kv_wconn *victim = NULL;
    if (w->n_authed >= w->opts.max_conns) {
        for (int i = 0; i < w->n_slots; i++) {
            kv_wconn *o = w->conns[i];
            if (!o || !o->authed || o->busy || kv_net_conn_closing(o->nc)) continue;
            if (now - o->last_work_ms < w->opts.evict_idle_ms) continue;
            if (!victim || o->last_work_ms < victim->last_work_ms) victim = o;
        }
        if (!victim) return false;
        char msg[128];
        snprintf(msg, sizeof msg, "slot taken back: no COMPUTE for %lld ms while another peer waits",
                 (long long)(now - victim->last_work_ms));
        kv_wc_displace(w, victim, KV_ETIMEOUT, "evicted", msg);
    } else if (w->n_authed + w->n_pending > w->opts.max_conns) {
        for (int i = 0; i < w->n_slots; i++) {
            kv_wconn *o = w->conns[i];
            if (o && o != c && !o->authed && (!victim || kv_yields_first(o, victim))) victim = o;
        }
        if (victim) {
            char msg[160];
            snprintf(msg, sizeof msg, "handshake not complete after %lld ms: its place went to an authenticated peer",
                     (long long)(now - victim->opened_ms));
            kv_wc_displace(w, victim, KV_ERANGE, "yielded", msg);
        }
    }
    return true;
}

/* Authenticated connections that a newly authenticated peer could
 * displace now (idle at least evict_idle_ms, nothing being computed). */
static int kv_worker_n_evictable(const kv_worker *w) {
    const int64_t now = kv_now_ms();
    int n = 0;
    for (int i = 0; i < w->n_slots; i++) {
        const kv_wconn *c = w->conns[i];
        n += c && c->authed && !c->busy && !kv_net_conn_closing(c->nc) && now - c->last_work_ms >= w->opts.evict_idle_ms;
    }
    return n;
}

/* True if key may be served: listed, or vouched for by the hub until a time
 * still to come. Takes auth_mu. */
static bool kv_worker_allowed(kv_worker *w, const kv_msg_auth *a, char *why, size_t cap) {
    bool ok = false;
    pthread_mutex_lock(&w->auth_mu);
    if (w->n_allow && bsearch(a->key, w->allow, w->n_allow, sizeof *w->allow, kv_cmp_key)) ok = true;
    else if (!(a->flags & KV_PROTO_AUTH_VOUCHER)) snprintf(why, cap, "coordinator key is not allowed here and carries no hub voucher");
    else if (!w->have_hub) snprintf(why, cap, "coordinator key is not allowed here, and this worker honors no hub's vouchers");
    else if ((int64_t)a->voucher_expires_ms <= kv_wall_ms()) snprintf(why, cap, "hub voucher expired");
    else {
        ok = kv_voucher_verify(w->hub_key, w->model_id, a->key, a->voucher_expires_ms, a->voucher_sig) == 0;
        if (!ok) snprintf(why, cap, "hub voucher is not signed by this worker's hub for this key and model");
    }
    pthread_mutex_unlock(&w->auth_mu);
    return ok;
}

/* Checks AUTH: the signature over this connection's transcript, then the
 * key; answers AUTH_OK, or EAUTH and close. */
static int kv_wc_auth(kv_wconn *c, uint32_t rid, const kv_msg_auth *a) {
    kv_worker *w = c->w;
    if (c->authed) return kv_wc_fatal(c, rid, KV_EPROTO, "protocol error", "second AUTH");
    kv_link_transcript t = {.proto = KV_LINK_HS_DISPATCH, .model_id = w->model_id, .version = c->version,
                            .acceptor_key = w->pk, .challenge = c->challenge, .connector_key = a->key,
                            .nonce = a->nonce};
    uint8_t binding[KV_TLS_EXPORTER_LEN];
    kv_tls *tls = kv_link_sniff_tls(c->tp);
    if (tls && kv_tls_exporter(tls, binding))
        return kv_wc_fatal(c, rid, KV_EINTERNAL, "internal", "no TLS exporter for this session");
    t.binding = tls ? binding : NULL;
    if (kv_link_transcript_verify(&t, KV_LINK_CONNECTOR, a->key, a->sig))
        return kv_wc_fatal(c, rid, KV_EAUTH, "authentication refused",
                           tls ? "AUTH signature does not verify over this connection's challenge and TLS session "
                                 "(a proof relayed from another session?)"
                               : "AUTH signature does not verify over this connection's challenge");
    char why[160];
    if (!kv_worker_allowed(w, a, why, sizeof why)) return kv_wc_fatal(c, rid, KV_EAUTH, "authentication refused", why);
    if (c->slot < 0) return 0; /* yielded its place meanwhile: already closing */
    if (!kv_worker_authed_room(w, c))
        return kv_wc_fatal(c, rid, KV_ERANGE, "refused",
                           "too many connections: every authenticated slot is doing work (retry later)");
    uint8_t sig[64], buf[KV_PROTO_HEADER + KV_PROTO_AUTH_OK_SIZE];
    size_t n;
    kv_link_transcript_sign(&t, KV_LINK_ACCEPTOR, w->sk, sig);
    if (kv_msg_auth_ok_encode(buf, sizeof buf, rid, sig, &n, NULL) == 0) kv_wc_queue(c, buf, n);
    w->n_pending--; /* from the pending pool to the authenticated one */
    w->n_authed++;
    c->authed = true;
    memcpy(c->peer_key, a->key, 32);
    pthread_mutex_lock(&w->auth_mu);
    c->hub = w->have_hub && !sodium_memcmp(a->key, w->hub_key, 32);
    pthread_mutex_unlock(&w->auth_mu);
    c->last_work_ms = kv_now_ms();
    kv_net_timer_stop(w->loop, &c->hs_t);
    char hex[17];
    kv_hex(a->key, 8, hex);
    kv_wlog(w, "conn %llu %s: handshake ok (protocol v%u, coordinator %s...)", (unsigned long long)c->id, c->peer,
            c->version, hex);
    return 0;
}

/* Checks a COMPUTE and makes it this connection's job (KV_NET_HOLD), or
 * answers it with a request-level ERROR (0). */
/* v6: copies the job's frame f[len] (decoded as cm) out of the receive
 * buffer into c->jbuf and points c->job's views there. KV_ENOMEM when the
 * budget cannot cover it. */
static int kv_wc_job_copy(kv_wconn *c, const uint8_t *f, size_t len, const kv_msg_compute *cm) {
    kv_worker *w = c->w;
    if (len > c->jcap) {
        if (!kv_net_budget_take(&w->budget, len - c->jcap)) return KV_ENOMEM;
        uint8_t *nb = realloc(c->jbuf, len);
        if (!nb) {
            kv_net_budget_give(&w->budget, len - c->jcap);
            return KV_ENOMEM;
        }
        c->jbuf = nb;
        c->jcap = len;
    }
    memcpy(c->jbuf, f, len);
    c->job = *cm;
    c->job.x_wire = c->jbuf + (cm->x_wire - f);
    c->job.pairs_wire = c->jbuf + (cm->pairs_wire - f);
    return 0;
}

static int kv_wc_compute(kv_wconn *c, uint32_t rid, const kv_msg_compute *cm, const uint8_t *f, size_t len) {
    kv_worker *w = c->w;
    kv_diag d = {0};
    const bool pre = (cm->out_enc & KV_OUT_PREACT) != 0;
    const uint32_t oenc = cm->out_enc & ~KV_OUT_PREACT;
    if (!((c->enc_mask >> cm->enc) & 1u) || !((c->enc_mask >> oenc) & 1u) ||
        (pre && !(c->enc_mask & KV_PROTO_CAP_PREACT))) {
        kv_fail(&d, KV_EPROTO, "COMPUTE uses encoding %s/%s%s, not negotiated", kv_enc_name(cm->enc), kv_enc_name(oenc),
                pre ? " with pre-activations" : "");
        return kv_wc_fatal(c, rid, KV_EPROTO, "protocol error", d.msg);
    }
    int code = 0;
    if (cm->n_pairs > w->max_pairs) {
        code = kv_fail(&d, KV_ERANGE, "request of %u pairs exceeds this worker's cost cap of %u pairs per request",
                       cm->n_pairs, w->max_pairs);
    } else {
        /* experts not held: a request-level error, the connection stays */
        for (uint32_t i = 0; i < cm->n_pairs && !code; i++) {
            kv_proto_pair p = kv_msg_compute_pair(cm, i);
            if (!w->held[(size_t)cm->layer * w->n_expert + p.expert])
                code = kv_fail(&d, KV_ENOTFOUND, "layer %u expert %u (pair %u) is not held by this worker", cm->layer,
                               p.expert, i);
        }
    }
    uint8_t hb[KV_PROTO_HEADER + KV_PROTO_RESULT_PRE_FIXED];
    if (!code && (pre ? !kv_msg_result_pre_head(hb, c->version, 0, cm->n_pairs, cm->n_embd, w->n_ff)
                      : !kv_msg_result_size_v(c->version, oenc, cm->n_pairs, cm->n_embd)))
        code = kv_fail(&d, KV_ERANGE, "the RESULT of %u pairs would exceed the payload maximum", cm->n_pairs);
    if (!code && c->version >= KV_PROTO_SIG_VERSION && cm->n_tokens > c->xh_cap) {
        uint8_t (*nx)[32] = realloc(c->xh, (size_t)cm->n_tokens * sizeof *nx);
        if (!nx) code = kv_fail(&d, KV_ENOMEM, "out of memory for the hashes of %u tokens", cm->n_tokens);
        else c->xh = nx, c->xh_cap = cm->n_tokens;
    }
    if (code) {
        kv_wc_error(c, rid, code, d.msg);
        kv_wlog(w, "conn %llu %s: request %u refused: %s", (unsigned long long)c->id, c->peer, rid, d.msg);
        return 0;
    }
    const bool copy = c->version >= KV_PROTO_CANCEL_VERSION;
    if (copy && kv_wc_job_copy(c, f, len, cm))
        return kv_wc_fatal(c, rid, KV_ENOMEM, "memory", "memory budget exhausted: cannot hold the request");
    if (!copy) c->job = *cm;
    cm = &c->job;
    c->rid = rid;
    if (c->version >= KV_PROTO_SIG_VERSION) { /* each token's row hashed once, as it came */
        const size_t xr = (size_t)cm->n_embd * kv_enc_size(cm->enc);
        for (uint32_t t = 0; t < cm->n_tokens; t++) kv_result_xhash(cm->x_wire + (size_t)t * xr, xr, c->xh[t]);
        kv_result_tree_init(&c->tree);
    }
    c->xin = kv_msg_compute_x_inplace(cm);
    c->pre = pre;
    c->oenc = oenc;
    c->next = 0;
    c->busy = true;
    c->last_work_ms = kv_now_ms();
    int delay_ms = w->opts.test_delay_ms; /* TEST ONLY: a slow worker ... */
    if (w->opts.test_stall_ms > 0 && ++w->n_stall_seen % (uint64_t)w->opts.test_stall_every == 0) {
        delay_ms += w->opts.test_stall_ms; /* ... or one that stalls now and then */
        fprintf(stderr, "worker: TEST MODE: request %u (COMPUTE %llu) stalls %d ms\n", rid,
                (unsigned long long)w->n_stall_seen, w->opts.test_stall_ms);
    }
    if (delay_ms > 0) {
        c->ready_ms = c->last_work_ms + delay_ms;
        kv_net_timer_start(w->loop, &c->delay_t, delay_ms);
    } else {
        c->ready_ms = 0;
    }
    kv_job_add(w, c);
    return copy ? 0 : KV_NET_HOLD;
}

/* v6 CANCEL of request rid: the job, if it is rid's and its RESULT has not
 * begun (still waiting for its turn, its test delay, or its first round),
 * is dropped before any of it is computed and answered with CANCELLED. A
 * RESULT already streaming is finished (a frame cannot be cut); an id that
 * is not the job's (answered already, never sent, a stranger's guess) is
 * ignored. Nothing is allocated: a flood of CANCELs costs a comparison
 * each. */
static void kv_wc_cancel(kv_wconn *c, uint32_t rid) {
    kv_worker *w = c->w;
    if (!c->busy || c->rid != rid || c->next != 0) return;
    kv_job_remove(w, c);
    kv_net_timer_stop(w->loop, &c->delay_t);
    c->ready_ms = 0;
    atomic_fetch_add(&w->n_cancelled, 1);
    uint8_t buf[KV_PROTO_HEADER];
    size_t n = 0;
    if (!kv_msg_cancel_encode(buf, sizeof buf, KV_MSG_CANCELLED, rid, &n, NULL)) kv_wc_queue(c, buf, n);
    if (c->jcap > KV_WORKER_JOB_KEEP) {
        kv_net_budget_give(&w->budget, c->jcap);
        free(c->jbuf);
        c->jbuf = NULL;
        c->jcap = 0;
    }
    kv_wlog(w, "conn %llu %s: request %u cancelled before it was computed", (unsigned long long)c->id, c->peer, rid);
}

static int kv_wc_on_frame(kv_net_conn *nc, const uint8_t *f, size_t len) {
    kv_wconn *c = kv_net_conn_data(nc);
    kv_worker *w = c->w;
    const kv_proto_limits lim = {w->n_layer, w->n_embd, w->n_expert, w->n_ff};
    kv_diag d = {0};
    kv_msg m;
    if (w->opts.idle_timeout_ms > 0) kv_net_timer_start(w->loop, &c->idle_t, w->opts.idle_timeout_ms);
    /* v6: while the job runs only a CANCEL is served; anything else waits
       (the job's RESULT may be half sent, and answers keep request order) */
    if (c->busy && (uint16_t)(f[6] | f[7] << 8) != KV_MSG_CANCEL) { /* the type: frame_len checked the header */
        c->defer = f;
        c->defer_len = len;
        return KV_NET_HOLD;
    }
    int rc = kv_msg_decode(f, len, &lim, &m, &d);
    if (rc) return kv_wc_fatal(c, 0, rc, "protocol error", d.msg);
    const uint32_t rid = m.h.request_id;
    if (c->hello && m.h.version != c->version) {
        kv_fail(&d, KV_EPROTO, "frame version %u, negotiated %u", m.h.version, c->version);
        return kv_wc_fatal(c, rid, KV_EPROTO, "protocol error", d.msg);
    }
    if (!c->hello && m.h.type != KV_MSG_HELLO) {
        kv_fail(&d, KV_EPROTO, "expected HELLO, got %s", kv_msg_type_name(m.h.type));
        return kv_wc_fatal(c, rid, KV_EPROTO, "protocol error", d.msg);
    }
    /* nothing is computed or told before the coordinator has proved its key */
    if (c->hello && !c->authed && m.h.type != KV_MSG_AUTH && m.h.type != KV_MSG_ERROR) {
        kv_fail(&d, KV_EAUTH, "not authenticated: expected AUTH, got %s", kv_msg_type_name(m.h.type));
        return kv_wc_fatal(c, rid, KV_EAUTH, "authentication refused", d.msg);
    }
    uint8_t buf[KV_PROTO_HEADER + KV_PROTO_STATS_ACK_SIZE_V6];
    size_t n = 0;
    switch (m.h.type) {
    case KV_MSG_HELLO: return kv_wc_hello(c, rid, &m.u.hello);
    case KV_MSG_AUTH: return kv_wc_auth(c, rid, &m.u.auth);
    case KV_MSG_COMPUTE: return kv_wc_compute(c, rid, &m.u.compute, f, len);
    case KV_MSG_CANCEL: /* v6 only (the decoder refuses it in an older frame) */
        kv_wc_cancel(c, rid);
        return 0;
    case KV_MSG_PING:
        if (!kv_msg_ping_encode(buf, sizeof buf, KV_MSG_PONG, rid, m.u.nonce, &n, NULL)) kv_wc_queue(c, buf, n);
        return 0;
    case KV_MSG_STATS: { /* only after a handshake (checked above): never to strangers */
        kv_msg_stats s;
        kv_worker_stats(w, &s);
        if (!kv_msg_stats_ack_encode_v(buf, sizeof buf, rid, c->version, &s, &n, NULL)) kv_wc_queue(c, buf, n);
        return 0;
    }
    case KV_MSG_RECEIPT_REQ: { /* after AUTH only (checked above): sign within what was computed here */
        kv_receipt r;
        uint8_t rb[KV_PROTO_HEADER + KV_PROTO_RECEIPT_SIZE];
        const int g = kv_receipt_grant(&c->budget, &m.u.receipt_req, w->sk, &r, &d);
        if (g) kv_wlog(w, "conn %llu %s: receipt refused: %s", (unsigned long long)c->id, c->peer, d.msg);
        if (!kv_msg_receipt_encode(rb, sizeof rb, rid, g ? KV_RECEIPT_REFUSED : KV_RECEIPT_SIGNED, g ? NULL : &r, &n,
                                   NULL))
            kv_wc_queue(c, rb, n);
        return 0;
    }
    case KV_MSG_ERROR: {
        char why[KV_PROTO_MAX_TEXT + 64];
        snprintf(why, sizeof why, "peer sent ERROR %s: %.300s", kv_err_name(m.u.error.code), m.u.error.msg);
        kv_net_conn_close(nc, 0, why);
        return 0;
    }
    default:
        kv_fail(&d, KV_EPROTO, "unexpected %s from a coordinator", kv_msg_type_name(m.h.type));
        return kv_wc_fatal(c, rid, KV_EPROTO, "protocol error", d.msg);
    }
}

static void kv_wc_on_close(kv_net_conn *nc, int code, const char *why) {
    kv_wconn *c = kv_net_conn_data(nc);
    kv_worker *w = c->w;
    kv_job_remove(w, c);
    kv_net_timer_stop(w->loop, &c->hs_t);
    kv_net_timer_stop(w->loop, &c->idle_t);
    kv_net_timer_stop(w->loop, &c->delay_t);
    kv_wlog(w, "conn %llu %s: closed (%s)", (unsigned long long)c->id, c->peer,
            why && why[0] ? why : code ? kv_err_str(code) : "closed");
    kv_wc_unslot(w, c);
    free(c->xh);
    if (c->jcap) kv_net_budget_give(&w->budget, c->jcap);
    free(c->jbuf);
    free(c);
}

static const kv_net_conn_cbs kv_wc_cbs = {
    .frame_len = kv_wc_frame_len,
    .on_frame = kv_wc_on_frame,
    .on_error = kv_wc_on_error,
    .on_close = kv_wc_on_close,
};

/* ---- scheduling: one round per tick -------------------------------------------------------- */

static int kv_cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static bool kv_job_ready(const kv_wconn *c) {
    return !kv_net_conn_closing(c->nc) && kv_net_conn_pending(c->nc) < KV_WORKER_TX_HWM &&
           (!c->ready_ms || kv_now_ms() >= c->ready_ms);
}

/* c's job has ended (answered, or failed): reading resumes. v5 and older:
 * the held COMPUTE is released. v6: a frame that came meanwhile is served
 * now, then released; a large job copy is freed. */
static void kv_wc_job_end(kv_worker *w, kv_wconn *c) {
    kv_job_remove(w, c);
    if (c->jcap > KV_WORKER_JOB_KEEP) {
        kv_net_budget_give(&w->budget, c->jcap);
        free(c->jbuf);
        c->jbuf = NULL;
        c->jcap = 0;
    }
    if (kv_net_conn_closing(c->nc)) return;
    if (c->defer) {
        const uint8_t *f = c->defer;
        const size_t n = c->defer_len;
        c->defer = NULL;
        const int rc = kv_wc_on_frame(c->nc, f, n); /* not busy now: served as it would have been */
        if (rc < 0 && !kv_net_conn_closing(c->nc)) kv_net_conn_close(c->nc, rc, kv_err_str(rc));
        if (kv_net_conn_closing(c->nc)) return;
        KV_ASSERT(rc != KV_NET_HOLD); /* only v6 defers, and a v6 COMPUTE is copied, never held */
        /* a v6 COMPUTE was copied: its place in the receive buffer is released below */
    }
    kv_net_conn_release(c->nc);
}

/* Finishes c's job: the frame is released and the next one may be read. */
static void kv_job_done(kv_worker *w, kv_wconn *c) {
    if (!c->hub) { /* the hub's challenges prove the worker; they serve no one */
        atomic_fetch_add(&w->n_compute, 1);
        atomic_fetch_add(&w->n_pairs, c->job.n_pairs);
        atomic_fetch_add(&w->n_tokens, c->job.n_tokens);
    }
    c->budget.computed += c->job.n_pairs; /* what receipts on this connection may cover */
    kv_wc_job_end(w, c);
}

/* Bytes of one answer row of c's job, and of its RESULT's head. */
static size_t kv_wc_row_bytes(const kv_wconn *c) {
    return c->pre ? ((size_t)c->w->n_embd + 2 * (size_t)c->w->n_ff) * 4 : (size_t)c->w->n_embd * kv_enc_size(c->oenc);
}
static size_t kv_wc_head_bytes(const kv_wconn *c) {
    return KV_PROTO_HEADER + (c->pre ? KV_PROTO_RESULT_PRE_FIXED : KV_PROTO_RESULT_FIXED);
}
/* Bytes after the rows of a round: the signature when it ends a v4 job. */
static size_t kv_wc_tail_bytes(const kv_wconn *c) {
    return c->version >= KV_PROTO_SIG_VERSION && c->next + c->wq == c->job.n_pairs ? KV_PROTO_RESULT_SIG : 0;
}

/* v4: the leaves of this round's rows (as written at c->wbase), and after
 * the job's last row its signature over the whole RESULT. */
static void kv_wc_sign_round(kv_worker *w, kv_wconn *c) {
    if (c->version < KV_PROTO_SIG_VERSION) return;
    const size_t rb = kv_wc_row_bytes(c), yb = (size_t)w->n_embd * (c->pre ? 4 : kv_enc_size(c->oenc));
    for (uint32_t i = 0; i < c->wq; i++) {
        const kv_proto_pair p = kv_msg_compute_pair(&c->job, c->next + i);
        uint8_t leaf[32];
        kv_result_leaf(c->xh[p.token], p.expert, c->wbase + (size_t)i * rb, yb, leaf);
        kv_result_tree_push(&c->tree, leaf);
    }
    if (!kv_wc_tail_bytes(c)) return;
    uint8_t root[32], dg[32];
    kv_result_tree_root(&c->tree, root);
    kv_result_digest(w->model_id, w->pk, c->peer_key, c->job.layer, c->job.enc, c->job.out_enc, c->job.n_pairs, root,
                     dg);
    kv_link_sign(w->sk, dg, c->wbase + (size_t)c->wq * rb);
    if (w->opts.test_lie == KV_WORKER_LIE_BADSIG) c->wbase[(size_t)c->wq * rb] ^= 1;
}

/* ---- test-only lies (docs/VERIFY.md): the checks' adversary ---------------------------- */

int kv_worker_lie_from_name(const char *name) {
    static const char *const names[KV_WORKER_LIE_COUNT] = {"none", "noise", "swap", "stale", "later", "badsig"};
    for (int i = 1; i < KV_WORKER_LIE_COUNT; i++)
        if (!strcmp(name, names[i])) return i;
    return -1;
}

/* Before the kernel: "swap" computes another held expert of the layer,
 * "stale" the previous round's inputs (the inputs of an earlier step). */
static void kv_worker_lie_inputs(kv_worker *w, uint32_t L, uint32_t n) {
    const uint32_t E = w->n_embd;
    if (w->opts.test_lie == KV_WORKER_LIE_SWAP) {
        for (uint32_t k = 0; k < n; k++) {
            uint32_t e = (uint32_t)w->ids[k];
            for (uint32_t s = 1; s < w->n_expert; s++) {
                const uint32_t o = (e + s) % w->n_expert;
                if (w->held[(size_t)L * w->n_expert + o]) {
                    w->ids[k] = (int32_t)o;
                    break;
                }
            }
        }
    } else if (w->opts.test_lie == KV_WORKER_LIE_STALE) {
        const uint32_t m = n < w->n_prev ? n : w->n_prev;
        for (uint32_t k = 0; k < n; k++) { /* swap this round's rows with the last round's */
            if (k < m)
                for (uint32_t i = 0; i < E; i++) {
                    const float t = w->xs[(size_t)k * E + i];
                    w->xs[(size_t)k * E + i] = w->xprev[(size_t)k * E + i];
                    w->xprev[(size_t)k * E + i] = t;
                }
            else
                memcpy(w->xprev + (size_t)k * E, w->xs + (size_t)k * E, sizeof(float) * E);
        }
        if (n > w->n_prev) w->n_prev = n;
    }
}

/* After the kernel: "noise" moves one element of about 1% of the pairs
 * (pair 7, 107, 207... of this worker) by 1e-3 of its row's max; "later"
 * does so on every pair once 64 pairs were answered honestly. */
static void kv_worker_lie_outputs(kv_worker *w, uint32_t n) {
    const uint32_t E = w->n_embd;
    for (uint32_t k = 0; k < n; k++, w->lie_pairs++) {
        const bool hit = (w->opts.test_lie == KV_WORKER_LIE_NOISE && w->lie_pairs % 100 == 7) ||
                         (w->opts.test_lie == KV_WORKER_LIE_LATER && w->lie_pairs >= 64);
        if (!hit) continue;
        float *y = w->ys + (size_t)k * E, mx = 0;
        for (uint32_t i = 0; i < E; i++) mx = fabsf(y[i]) > mx ? fabsf(y[i]) : mx;
        y[w->lie_pairs % E] += 1e-3f * (mx > 0 ? mx : 1.0f);
    }
}

static bool kv_worker_tick(kv_net_loop *l, void *data) {
    kv_worker *w = data;
    (void)l;
    if (!w->jobs) return false;
    /* the first ready job, in round-robin order, names the layer */
    kv_wconn *first = NULL, *c = w->jobs;
    do {
        if (kv_job_ready(c)) first = c;
        c = c->jnext;
    } while (!first && c != w->jobs);
    if (!first) return false; /* every peer with a job is slow to read: wait for drains */
    const uint32_t L = first->job.layer, E = w->n_embd;
    uint32_t n_ready = 0;
    c = first;
    do {
        n_ready += c->job.layer == L && kv_job_ready(c);
        c = c->jnext;
    } while (c != first);
    uint32_t quantum = KV_WORKER_CHUNK / n_ready;
    if (quantum == 0) quantum = 1;
    /* gather each ready job's next pairs, in ring order */
    uint32_t n = 0, n_jobs = 0;
    c = first;
    do {
        c->wq = 0;
        if (c->job.layer == L && kv_job_ready(c) && n < KV_WORKER_CHUNK) {
            uint32_t q = c->job.n_pairs - c->next;
            if (q > quantum) q = quantum;
            if (q > KV_WORKER_CHUNK - n) q = KV_WORKER_CHUNK - n;
            for (uint32_t i = 0; i < q; i++) {
                kv_proto_pair p = kv_msg_compute_pair(&c->job, c->next + i);
                w->keys[n] = ((uint64_t)p.expert << 32) | n;
                w->rconn[n] = c;
                w->rpair[n++] = c->next + i;
            }
            c->wq = q;
            n_jobs++;
        }
        c = c->jnext;
    } while (c != first);
    /* rows of one expert together: the kernel streams each expert's weights once */
    qsort(w->keys, n, sizeof *w->keys, kv_cmp_u64);
    for (uint32_t k = 0; k < n; k++) {
        const uint32_t j = (uint32_t)(w->keys[k] & 0xffffffffu);
        const kv_wconn *jc = w->rconn[j];
        kv_proto_pair p = kv_msg_compute_pair(&jc->job, w->rpair[j]);
        float *row = w->xs + (size_t)k * E;
        if (jc->xin) memcpy(row, jc->xin + (size_t)p.token * E, sizeof(float) * E);
        else kv_msg_compute_row(&jc->job, p.token, row);
        w->ids[k] = (int32_t)p.expert;
    }
    kv_diag d = {0};
    bool want_pre = false;
    c = first;
    do {
        want_pre |= c->wq && c->pre;
        c = c->jnext;
    } while (c != first);
    if (w->opts.test_lie) kv_worker_lie_inputs(w, L, n);
    const kv_expert_req req = {L, n, E, 1, w->xs, w->ids, NULL};
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    int rc = !want_pre       ? w->prov.compute(w->prov.impl, &req, w->ys, &d)
             : w->opts.opencl ? kv_opencl_expert_compute_pre(&w->prov, &req, w->ys, w->gs, w->us, &d)
                              : kv_expert_local_compute_pre(&w->prov, &req, w->ys, w->gs, w->us, &d);
    clock_gettime(CLOCK_MONOTONIC, &b);
    if (!rc && w->opts.test_lie) kv_worker_lie_outputs(w, n);
    atomic_fetch_add(&w->compute_us, (uint64_t)((b.tv_sec - a.tv_sec) * 1000000 + (b.tv_nsec - a.tv_nsec) / 1000));
    atomic_fetch_add(&w->n_batches, 1);
    if (n_jobs > 1) atomic_fetch_add(&w->n_merged, 1);
    /* reserve each job's rows in its send queue (the RESULT head first) */
    c = first;
    do {
        kv_wconn *nx = c->jnext;
        if (c->wq) {
            const size_t rb = kv_wc_row_bytes(c);
            const size_t head = c->next == 0 ? kv_wc_head_bytes(c) : 0;
            c->wbase = rc ? NULL : kv_net_conn_reserve(c->nc, head + (size_t)c->wq * rb + kv_wc_tail_bytes(c));
            if (c->wbase && head) {
                if (c->pre) kv_msg_result_pre_head(c->wbase, c->version, c->rid, c->job.n_pairs, E, w->n_ff);
                else kv_msg_result_head(c->wbase, c->version, c->rid, c->oenc, c->job.n_pairs, E);
                c->wbase += head;
            }
        }
        c = nx;
    } while (c != first);
    if (!rc)
        for (uint32_t k = 0; k < n; k++) {
            const uint32_t j = (uint32_t)(w->keys[k] & 0xffffffffu);
            kv_wconn *jc = w->rconn[j];
            if (!jc->wbase) continue;
            const size_t rb = kv_wc_row_bytes(jc);
            uint8_t *dst = jc->wbase + (size_t)(w->rpair[j] - jc->next) * rb;
            kv_msg_rows_put(dst, jc->oenc, w->ys + (size_t)k * E, E);
            if (jc->pre) { /* f32: y, gate, up */
                kv_msg_rows_put(dst + (size_t)E * 4, KV_ENC_F32, w->gs + (size_t)k * w->n_ff, w->n_ff);
                kv_msg_rows_put(dst + ((size_t)E + w->n_ff) * 4, KV_ENC_F32, w->us + (size_t)k * w->n_ff, w->n_ff);
            }
        }
    /* commit, finish the jobs that are complete, move the ring on */
    kv_wconn *done[KV_WORKER_CHUNK];
    uint32_t n_done = 0;
    c = first;
    do {
        if (c->wq) {
            if (rc) {
                if (c->next == 0) { /* nothing sent yet: a request-level ERROR */
                    kv_wc_error(c, c->rid, rc, d.msg);
                } else { /* half a RESULT is out: the frame cannot be ended */
                    kv_net_conn_close(c->nc, rc, d.msg);
                }
                done[n_done++] = c;
            } else if (c->wbase) {
                const size_t rb = kv_wc_row_bytes(c);
                kv_wc_sign_round(w, c);
                /* written at once: no EPOLLOUT round per answer */
                kv_net_conn_commit_now(c->nc, (c->next == 0 ? kv_wc_head_bytes(c) : 0) + c->wq * rb + kv_wc_tail_bytes(c));
                c->next += c->wq;
                if (c->next == c->job.n_pairs) done[n_done++] = c;
            }
            c->wq = 0;
            c->wbase = NULL;
        }
        c = c->jnext;
    } while (c != first);
    w->jobs = first->jnext == first ? first : first->jnext;
    for (uint32_t i = 0; i < n_done; i++) {
        if (rc) {
            kv_wc_job_end(w, done[i]);
        } else {
            kv_job_done(w, done[i]);
        }
    }
    if (rc) kv_wlog(w, "round of %u rows at layer %u failed: %s", n, L, d.msg);
    if (!w->jobs) return false;
    c = w->jobs;
    do {
        if (kv_job_ready(c)) return true;
        c = c->jnext;
    } while (c != w->jobs);
    return false;
}

/* ---- accepting ---------------------------------------------------------------------------- */

/* Refuses a connection that got no slot: one ERROR, best effort, then close. */
static void kv_worker_refuse(kv_worker *w, int fd, uint64_t id, const char *peer, int code, const char *msg) {
    uint8_t buf[KV_WORKER_ERR_FRAME];
    size_t n;
    atomic_fetch_add(&w->n_errors, 1);
    if (kv_msg_error_encode(buf, sizeof buf, 0, code, msg, &n, NULL) == 0) {
        ssize_t k = send(fd, buf, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        (void)k;
    }
    kv_wlog(w, "conn %llu %s: refused (%s)", (unsigned long long)id, peer, msg);
    close(fd);
}

/* The per-address key of a peer: an IPv4 address (as ::ffff:a.b.c.d, so a
 * v4-mapped IPv6 peer is the same address), or the /64 of an IPv6 one (a
 * single host is usually given a whole /64). */
static void kv_addr_key(const struct sockaddr_storage *ss, uint8_t out[16]) {
    memset(out, 0, 16);
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
        out[10] = out[11] = 0xff;
        memcpy(out + 12, &a->sin_addr, 4);
    } else if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
        static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        if (!memcmp(a->sin6_addr.s6_addr, mapped, 12)) memcpy(out, a->sin6_addr.s6_addr, 16);
        else memcpy(out, a->sin6_addr.s6_addr, 8);
    }
}

/* Pending connections whose address key is k. */
static int kv_worker_pending_of(const kv_worker *w, const uint8_t k[16]) {
    int n = 0;
    for (int i = 0; i < w->n_slots; i++) {
        const kv_wconn *c = w->conns[i];
        n += c && !c->authed && !memcmp(c->ipk, k, 16);
    }
    return n;
}

/* Makes room in the pending pool for a newcomer from address key k (the
 * rules of the opening comment): true if there is room now (a pending
 * connection may have yielded its place), false with msg filled if the
 * newcomer is to be refused. */
static bool kv_worker_pending_room(kv_worker *w, const uint8_t k[16], const char *ip, char *msg, size_t cap) {
    const int mine = kv_worker_pending_of(w, k), total = w->n_authed + w->n_pending;
    kv_wconn *victim = NULL;
    if (mine >= w->opts.max_pending_per_addr) { /* its own address at its cap: one of them yields */
        for (int i = 0; i < w->n_slots; i++) {
            kv_wconn *c = w->conns[i];
            if (c && !c->authed && !memcmp(c->ipk, k, 16) && (!victim || kv_yields_first(c, victim))) victim = c;
        }
    } else if (w->n_pending >= w->opts.max_pending ||
               (total >= w->opts.max_conns && total - w->opts.max_conns >= kv_worker_n_evictable(w))) {
        /* full: a pending connection of an address holding more yields */
        int vn = 0;
        for (int i = 0; i < w->n_slots; i++) {
            kv_wconn *c = w->conns[i];
            if (!c || c->authed) continue;
            const int n = kv_worker_pending_of(w, c->ipk);
            if (n < mine + 2) continue;
            const int pc = kv_wc_progress(c), pv = victim ? kv_wc_progress(victim) : 0;
            if (!victim || pc < pv || (pc == pv && (n > vn || (n == vn && c->opened_ms < victim->opened_ms)))) {
                victim = c;
                vn = n;
            }
        }
        if (!victim) {
            snprintf(msg, cap, "too many connections (%d, %d of them waiting for their handshake, %d from %s): "
                     "retry later", total, w->n_pending, mine, ip);
            return false;
        }
    } else {
        return true;
    }
    KV_ASSERT(victim != NULL);
    char why[160];
    snprintf(why, sizeof why, "handshake not complete after %lld ms: its place went to a newer connection",
             (long long)(kv_now_ms() - victim->opened_ms));
    kv_wc_displace(w, victim, KV_ERANGE, "yielded", why);
    return true;
}

/* A free place in w->conns; the pools' limits guarantee one. */
static int kv_worker_free_slot(const kv_worker *w) {
    for (int i = 0; i < w->n_slots; i++)
        if (!w->conns[i]) return i;
    return -1;
}

static void kv_worker_accept(kv_net_loop *l, kv_net_watch *lw, unsigned ev);

static void kv_worker_resume_accept(kv_net_loop *l, kv_net_timer *t) {
    kv_worker *w = t->data;
    if (!w->listening && !kv_net_watch_add(l, &w->lwatch, w->lfd, KV_NET_READ, kv_worker_accept, w, NULL))
        w->listening = true;
}

static void kv_worker_accept(kv_net_loop *l, kv_net_watch *lw, unsigned ev) {
    kv_worker *w = lw->data;
    (void)ev;
    for (int burst = 0; burst < 64; burst++) {
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        int fd = accept4(w->lfd, (struct sockaddr *)&ss, &sl, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                /* the pending connection stays readable: stop watching for
                 * 100 ms instead of spinning on it */
                kv_wlog(w, "accept: %s (backing off)", strerror(errno));
                kv_net_watch_del(l, &w->lwatch);
                w->listening = false;
                kv_net_timer_start(l, &w->accept_t, 100);
            }
            return; /* EAGAIN, or retried on the next readiness */
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        char hb[INET6_ADDRSTRLEN] = "?", pb[8] = "?", peer[96];
        getnameinfo((struct sockaddr *)&ss, sl, hb, sizeof hb, pb, sizeof pb, NI_NUMERICHOST | NI_NUMERICSERV);
        snprintf(peer, sizeof peer, "%s:%s", hb, pb);
        uint64_t id = atomic_fetch_add(&w->n_conns, 1) + 1;
        uint8_t ipk[16];
        kv_addr_key(&ss, ipk);
        char msg[200];
        if (!kv_worker_pending_room(w, ipk, hb, msg, sizeof msg)) {
            kv_worker_refuse(w, fd, id, peer, KV_ERANGE, msg);
            continue;
        }
        const int slot = kv_worker_free_slot(w);
        KV_ASSERT(slot >= 0 && w->n_pending < w->opts.max_pending);
        kv_wconn *c = calloc(1, sizeof *c);
        if (!c) {
            kv_worker_refuse(w, fd, id, peer, KV_ENOMEM, "out of memory");
            continue;
        }
        c->w = w;
        c->slot = slot;
        c->id = id;
        snprintf(c->peer, sizeof c->peer, "%s", peer);
        snprintf(c->ip, sizeof c->ip, "%s", hb);
        memcpy(c->ipk, ipk, 16);
        c->loopback = kv_link_sockaddr_loopback((struct sockaddr *)&ss);
        c->last_work_ms = c->opened_ms = kv_now_ms();
        kv_net_timer_init(&c->hs_t, kv_wc_handshake_timeout, c);
        kv_net_timer_init(&c->idle_t, kv_wc_idle_timeout, c);
        kv_net_timer_init(&c->delay_t, kv_wc_delay_over, c);
        const size_t rb_max = (size_t)KV_WORKER_CHUNK * ((size_t)w->n_embd + 2 * (size_t)w->n_ff) * 4 +
                              KV_PROTO_HEADER + KV_PROTO_RESULT_PRE_FIXED +
                              KV_PROTO_RESULT_SIG; /* one round of RESULT_PRE rows, and the signature */
        const kv_net_conn_opts o = {
            .header = KV_PROTO_HEADER,
            .max_frame = KV_PROTO_HEADER + w->max_payload,
            .tx_max = KV_WORKER_TX_HWM + rb_max + kv_msg_hello_ack_size_v(KV_PROTO_VERSION, KV_PROTO_MAX_NAME,
                                                                          (uint32_t)w->n_ranges, (uint32_t)w->n_slabs) +
                      KV_PROTO_HEADER + KV_PROTO_AUTH_CHALLENGE_SIZE + KV_PROTO_HEADER + KV_PROTO_AUTH_OK_SIZE +
                      4 * KV_WORKER_ERR_FRAME,
            .frame_timeout_ms = w->opts.read_timeout_ms,
            .write_timeout_ms = w->opts.write_timeout_ms,
            .budget = &w->budget,
            /* the worker's own deadline (hs_t, with an ERROR) fires first */
            .handshake_timeout_ms = w->opts.handshake_timeout_ms + 1000,
            .io = &kv_link_sniff_io,
        };
        kv_diag d = {0};
        if (kv_link_sniff_new(&c->tp, w->tls, &d)) {
            kv_worker_refuse(w, fd, id, peer, KV_ENOMEM, "out of memory");
            free(c);
            continue;
        }
        kv_net_conn_opts oo = o;
        oo.io_ctx = c->tp;
        if (kv_net_conn_new(&c->nc, l, fd, &oo, &kv_wc_cbs, c, &d)) { /* fd and c->tp freed by it */
            kv_wlog(w, "conn %llu %s: refused (%s)", (unsigned long long)id, peer, d.msg);
            free(c);
            continue;
        }
        w->conns[slot] = c;
        w->n_pending++;
        kv_net_timer_start(l, &c->hs_t, w->opts.handshake_timeout_ms);
        if (w->opts.idle_timeout_ms > 0) kv_net_timer_start(l, &c->idle_t, w->opts.idle_timeout_ms);
        kv_wlog(w, "conn %llu %s: opened", (unsigned long long)id, peer);
    }
}

int kv_worker_serve(kv_worker *w, kv_diag *d) {
    int rc = kv_net_watch_add(w->loop, &w->lwatch, w->lfd, KV_NET_READ, kv_worker_accept, w, d);
    if (rc) return rc;
    w->listening = true;
    kv_net_timer_init(&w->accept_t, kv_worker_resume_accept, w);
    kv_net_loop_set_tick(w->loop, kv_worker_tick, w);
    while (!atomic_load(&w->stop) && !rc) rc = kv_net_loop_run_once(w->loop, 1000, d);
    kv_net_timer_stop(w->loop, &w->accept_t);
    if (w->listening) kv_net_watch_del(w->loop, &w->lwatch);
    w->listening = false;
    kv_net_loop_set_tick(w->loop, NULL, NULL);
    return rc;
}

/* kv_worker_mem: bytes the connections buffer now and at most so far. */
void kv_worker_mem(const kv_worker *w, size_t *now, size_t *peak) {
    kv_worker *mw = (kv_worker *)w;
    if (now) *now = atomic_load(&mw->budget.used);
    if (peak) *peak = atomic_load(&mw->budget.peak);
}
