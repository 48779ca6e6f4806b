/* Pieces (kvasir/pieces.h): regular-file opening, file hashes, the model
 * identity, slab metadata, and verifying a slice folder against its
 * manifest. Everything here reads untrusted files: sizes come from fstat,
 * counts from a manifest that kv_manifest_parse already bounded, and every
 * read is checked for a short count (a file that shrinks is an error, never
 * a silent zero). Threads: each verification or identity thread has its own
 * descriptor and buffer; shared state is an atomic work index and a
 * first-failure-wins slot under a mutex. */
#include "kvasir/pieces.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvasir/quant.h"

#define KV_PIECES_BUF (8u << 20)      /* hashing buffer per thread */
#define KV_ID_BATCH 4096u             /* leaves hashed per batch (bounded memory) */
#define KV_PIECES_MAX_THREADS 64

static int kv_nthreads(int want, size_t jobs) {
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int n = want > 0 ? want : (int)(ncpu > 0 ? ncpu : 1);
    if (n > KV_PIECES_MAX_THREADS) n = KV_PIECES_MAX_THREADS;
    if ((size_t)n > jobs) n = (int)(jobs ? jobs : 1);
    return n;
}

/* Runs fn(arg) on n threads (at least once on this one if none start). */
static void kv_run_threads(int n, void *(*fn)(void *), void *arg) {
    pthread_t th[KV_PIECES_MAX_THREADS];
    int started = 0;
    for (int i = 0; i < n; i++)
        if (!pthread_create(&th[i], NULL, fn, arg)) started++;
        else break;
    if (!started) fn(arg);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
}

static int kv_pread_all(int fd, uint8_t *buf, size_t n, uint64_t at) {
    while (n) {
        ssize_t r = pread(fd, buf, n, (off_t)at);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            if (r == 0) errno = 0;
            return -1;
        }
        buf += r;
        n -= (size_t)r;
        at += (uint64_t)r;
    }
    return 0;
}

/* ---- files ------------------------------------------------------------- */

int kv_pieces_open_file(const char *path, bool nofollow, int *fd_out, uint64_t *size, kv_diag *d) {
    *fd_out = -1;
    struct stat st0, st;
    if ((nofollow ? lstat(path, &st0) : stat(path, &st0)) != 0)
        return kv_fail(d, errno == ENOENT ? KV_ENOTFOUND : KV_EIO, "%s: %s", path, strerror(errno));
    if (!S_ISREG(st0.st_mode)) return kv_fail(d, KV_EIO, "%s: not a regular file", path);
    const int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | (nofollow ? O_NOFOLLOW : 0));
    if (fd < 0) return kv_fail(d, errno == ENOENT ? KV_ENOTFOUND : KV_EIO, "%s: %s", path, strerror(errno));
    if (fstat(fd, &st) || !S_ISREG(st.st_mode) || st.st_dev != st0.st_dev || st.st_ino != st0.st_ino) {
        close(fd);
        return kv_fail(d, KV_EIO, "%s: not a regular file", path);
    }
    const int fl = fcntl(fd, F_GETFL);
    if (fl >= 0) fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    *fd_out = fd;
    if (size) *size = (uint64_t)st.st_size;
    return 0;
}

/* Hashes [0, size) of fd into out; buf has KV_PIECES_BUF bytes. stop, if
 * set while hashing, abandons the work (returns 1). */
static int kv_hash_fd(int fd, uint64_t size, uint8_t *buf, uint8_t out[32], atomic_int *stop) {
    kv_sha256 h;
    kv_sha256_init(&h);
    for (uint64_t p = 0; p < size;) {
        const size_t k = size - p > KV_PIECES_BUF ? KV_PIECES_BUF : (size_t)(size - p);
        if (kv_pread_all(fd, buf, k, p)) {
            kv_sha256_discard(&h);
            return -1;
        }
        kv_sha256_update(&h, buf, k);
        p += k;
        if (stop && atomic_load(stop)) {
            kv_sha256_discard(&h);
            return 1;
        }
    }
    kv_sha256_final(&h, out);
    return 0;
}

int kv_pieces_hash_file(const char *path, uint8_t out[32], kv_diag *d) {
    int fd;
    uint64_t size;
    int rc = kv_pieces_open_file(path, false, &fd, &size, d);
    if (rc) return rc;
    uint8_t *buf = malloc(KV_PIECES_BUF);
    if (!buf) {
        close(fd);
        return kv_fail(d, KV_ENOMEM, "%s: out of memory", path);
    }
    rc = kv_hash_fd(fd, size, buf, out, NULL);
    struct stat st;
    if (!rc && (fstat(fd, &st) || (uint64_t)st.st_size != size)) rc = -1, errno = 0;
    if (rc) rc = kv_fail(d, KV_EIO, "%s: %s", path, errno ? strerror(errno) : "the file changed size while hashed");
    free(buf);
    close(fd);
    return rc;
}

const kv_manifest_slab *kv_manifest_find_slab(const kv_manifest *m, uint32_t layer, uint32_t first, uint32_t last) {
    size_t lo = 0, hi = m->n_slabs; /* slabs are sorted by (layer, first) */
    while (lo < hi) {
        const size_t mid = lo + (hi - lo) / 2;
        const kv_manifest_slab *s = &m->slabs[mid];
        if (s->layer < layer || (s->layer == layer && s->first < first)) lo = mid + 1;
        else hi = mid;
    }
    if (lo < m->n_slabs && m->slabs[lo].layer == layer && m->slabs[lo].first == first && m->slabs[lo].last == last)
        return &m->slabs[lo];
    return NULL;
}

/* ---- identity ------------------------------------------------------------ */

typedef struct kv_idjob {
    const char *path;
    uint64_t data_off, data_end;  /* tensor data [data_off, data_end) */
    uint64_t n_leaves;
    atomic_uint_fast64_t next;     /* next leaf to hash (absolute index) */
    uint64_t batch_end;            /* leaves of this batch: [.., batch_end) */
    uint64_t batch_first;
    uint8_t (*leaf)[32];           /* [KV_ID_BATCH] */
    uint8_t zero_leaf[32];         /* SHA-256 of KV_MODEL_ID_CHUNK zero bytes */
    atomic_int failed;
    kv_diag d;
    pthread_mutex_t mu;
    int fd[KV_PIECES_MAX_THREADS];
    atomic_int n_fd;
    uint8_t *bufs[KV_PIECES_MAX_THREADS];
} kv_idjob;

static void kv_id_fail(kv_idjob *j, const kv_diag *d) {
    pthread_mutex_lock(&j->mu);
    if (!atomic_load(&j->failed)) {
        j->d = *d;
        atomic_store(&j->failed, d->code ? d->code : KV_EIO);
    }
    pthread_mutex_unlock(&j->mu);
}

/* One thread's share of a batch. Each thread of a batch takes a distinct
 * slot (n_fd restarts at 0 per batch); a slot's descriptor and buffer are
 * kept for the threads of the next batch. */
static void *kv_id_thread(void *arg) {
    kv_idjob *j = arg;
    const int me = atomic_fetch_add(&j->n_fd, 1);
    kv_diag d = {0};
    if (me >= KV_PIECES_MAX_THREADS) return NULL;
    int fd = j->fd[me];
    uint8_t *buf = j->bufs[me];
    if (fd < 0) {
        if (kv_pieces_open_file(j->path, false, &fd, NULL, &d)) {
            kv_id_fail(j, &d);
            return NULL;
        }
        j->fd[me] = fd;
    }
    if (!buf && !(buf = j->bufs[me] = malloc(KV_MODEL_ID_CHUNK))) {
        kv_fail(&d, KV_ENOMEM, "identity: out of memory");
        kv_id_fail(j, &d);
        return NULL;
    }
    uint64_t hole_to = 0; /* [.., hole_to) known to be a hole from the last SEEK_DATA */
    for (;;) {
        if (atomic_load(&j->failed)) break;
        const uint64_t i = atomic_fetch_add(&j->next, 1);
        if (i >= j->batch_end) break;
        const uint64_t a = j->data_off + i * KV_MODEL_ID_CHUNK;
        const uint64_t b = a + KV_MODEL_ID_CHUNK < j->data_end ? a + KV_MODEL_ID_CHUNK : j->data_end;
        uint8_t *out = j->leaf[i - j->batch_first];
        bool hole = b <= hole_to;
        if (!hole) {
            const off_t nd = lseek(fd, (off_t)a, SEEK_DATA);
            if (nd < 0 && errno == ENXIO) hole_to = UINT64_MAX; /* only holes to the end */
            else if (nd >= 0) hole_to = (uint64_t)nd;
            else hole_to = 0; /* SEEK_DATA unsupported: read everything */
            hole = b <= hole_to;
        }
        if (hole && b - a == KV_MODEL_ID_CHUNK) {
            memcpy(out, j->zero_leaf, 32);
            continue;
        }
        /* a hole reads as zeros, so a chunk partly in a hole needs no care */
        if (kv_pread_all(fd, buf, (size_t)(b - a), a)) {
            kv_fail(&d, KV_EIO, "identity: reading %s at %" PRIu64 ": %s", j->path, a,
                    errno ? strerror(errno) : "unexpected end of file");
            kv_id_fail(j, &d);
            break;
        }
        kv_sha256 h;
        kv_sha256_init(&h);
        kv_sha256_update(&h, buf, (size_t)(b - a));
        kv_sha256_final(&h, out);
    }
    return NULL;
}

/* End of the tensor data (the last tensor's end; trailing bytes are not
 * weights), and the identity's hash started over everything but the leaves. */
static uint64_t kv_id_begin(const kv_gguf *g, kv_sha256 *top) {
    const uint64_t data_off = kv_gguf_data_offset(g);
    uint64_t data_end = data_off;
    for (size_t i = 0; i < kv_gguf_n_tensors(g); i++) {
        const kv_gguf_tensor *t = kv_gguf_tensor_at(g, i);
        if (t->file_offset + t->nbytes > data_end) data_end = t->file_offset + t->nbytes;
    }
    /* id = SHA-256(tag NUL || SHA-256(header) || u64le(data bytes) || leaf hashes) */
    uint8_t hh[32], len8[8];
    kv_sha256 h;
    kv_sha256_init(&h);
    kv_sha256_update(&h, kv_gguf_base(g), (size_t)data_off);
    kv_sha256_final(&h, hh);
    const uint64_t n_data = data_end - data_off;
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)(n_data >> (8 * i));
    kv_sha256_init(top);
    kv_sha256_update(top, KV_MODEL_ID_TAG, sizeof KV_MODEL_ID_TAG);
    kv_sha256_update(top, hh, 32);
    kv_sha256_update(top, len8, 8);
    return data_end;
}

/* A split model's identity from its parts' (slice.h):
 * SHA-256("kvasir-model-id-split-v1" NUL || u32le(N) || hex id of part 1 || ...). */
static void kv_split_id(const char (*part_ids)[65], size_t n, char out[65]) {
    kv_sha256 h;
    uint8_t n4[4], id[32];
    for (int i = 0; i < 4; i++) n4[i] = (uint8_t)(n >> (8 * i));
    kv_sha256_init(&h);
    kv_sha256_update(&h, KV_MODEL_ID_SPLIT_TAG, sizeof KV_MODEL_ID_SPLIT_TAG);
    kv_sha256_update(&h, n4, 4);
    for (size_t i = 0; i < n; i++) kv_sha256_update(&h, part_ids[i], 64);
    kv_sha256_final(&h, id);
    kv_sha256_hex(id, out);
}

static void kv_file_model_id_mem(const kv_gguf *g, char out[65]);

void kv_slice_model_id(const kv_gguf *g, char out[65]) {
    const size_t n = kv_gguf_n_parts(g);
    if (n <= 1) {
        kv_file_model_id_mem(g, out);
        return;
    }
    char (*ids)[65] = malloc(n * sizeof *ids);
    KV_ASSERT(ids != NULL);
    for (size_t i = 0; i < n; i++) kv_file_model_id_mem(kv_gguf_part(g, i), ids[i]);
    kv_split_id((const char (*)[65])ids, n, out);
    free(ids);
}

static void kv_file_model_id_mem(const kv_gguf *g, char out[65]) {
    kv_sha256 top;
    const uint64_t end = kv_id_begin(g, &top);
    const uint8_t *base = kv_gguf_base(g);
    for (uint64_t a = kv_gguf_data_offset(g); a < end; a += KV_MODEL_ID_CHUNK) {
        const uint64_t b = a + KV_MODEL_ID_CHUNK < end ? a + KV_MODEL_ID_CHUNK : end;
        uint8_t leaf[32];
        kv_sha256 h;
        kv_sha256_init(&h);
        kv_sha256_update(&h, base + a, (size_t)(b - a));
        kv_sha256_final(&h, leaf);
        kv_sha256_update(&top, leaf, 32);
    }
    uint8_t id[32];
    kv_sha256_final(&top, id);
    kv_sha256_hex(id, out);
}

static int kv_file_model_id(const kv_gguf *g, const char *path, int n_threads, char out[65], kv_diag *d);

int kv_pieces_model_id(const kv_gguf *g, const char *path, int n_threads, char out[65], kv_diag *d) {
    const size_t n = kv_gguf_n_parts(g);
    if (n <= 1) return kv_file_model_id(g, path, n_threads, out, d);
    char (*ids)[65] = malloc(n * sizeof *ids);
    if (!ids) return kv_fail(d, KV_ENOMEM, "identity: out of memory");
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        const kv_gguf *p = kv_gguf_part(g, i);
        rc = kv_file_model_id(p, kv_gguf_path(p), n_threads, ids[i], d);
    }
    if (!rc) kv_split_id((const char (*)[65])ids, n, out);
    free(ids);
    return rc;
}

static int kv_file_model_id(const kv_gguf *g, const char *path, int n_threads, char out[65], kv_diag *d) {
    kv_sha256 top;
    const uint64_t data_end = kv_id_begin(g, &top);
    int fd;
    uint64_t size;
    int rc = kv_pieces_open_file(path, false, &fd, &size, d);
    if (rc) return kv_diag_prefix(d, rc, "identity");
    close(fd);
    if (size != kv_gguf_file_size(g) || data_end > size) {
        kv_sha256_discard(&top);
        return kv_fail(d, KV_EIO, "identity: %s changed since it was opened", path);
    }
    kv_idjob *j = calloc(1, sizeof *j);
    uint8_t *zeros = calloc(1, KV_MODEL_ID_CHUNK);
    if (j) j->leaf = malloc(KV_ID_BATCH * sizeof *j->leaf);
    if (!j || !zeros || !j->leaf) {
        if (j) free(j->leaf);
        free(j);
        free(zeros);
        kv_sha256_discard(&top);
        return kv_fail(d, KV_ENOMEM, "identity: out of memory");
    }
    j->path = path;
    j->data_off = kv_gguf_data_offset(g);
    j->data_end = data_end;
    j->n_leaves = (data_end - j->data_off + KV_MODEL_ID_CHUNK - 1) / KV_MODEL_ID_CHUNK;
    for (int i = 0; i < KV_PIECES_MAX_THREADS; i++) j->fd[i] = -1;
    pthread_mutex_init(&j->mu, NULL);
    kv_sha256 h;
    kv_sha256_init(&h);
    kv_sha256_update(&h, zeros, KV_MODEL_ID_CHUNK);
    kv_sha256_final(&h, j->zero_leaf);
    free(zeros);
    const int nth = kv_nthreads(n_threads, (size_t)(j->n_leaves < 1024 ? 1 + j->n_leaves / 64 : 1024));
    for (uint64_t first = 0; first < j->n_leaves && !atomic_load(&j->failed); first += KV_ID_BATCH) {
        j->batch_first = first;
        j->batch_end = first + KV_ID_BATCH < j->n_leaves ? first + KV_ID_BATCH : j->n_leaves;
        atomic_store(&j->next, first);
        atomic_store(&j->n_fd, 0);
        kv_run_threads(nth, kv_id_thread, j);
        if (!atomic_load(&j->failed)) kv_sha256_update(&top, j->leaf, (size_t)(j->batch_end - first) * 32);
    }
    rc = atomic_load(&j->failed);
    uint8_t id[32];
    kv_sha256_final(&top, id);
    if (rc) {
        if (d) *d = j->d;
    } else {
        kv_sha256_hex(id, out);
    }
    for (int i = 0; i < KV_PIECES_MAX_THREADS; i++) {
        if (j->fd[i] >= 0) close(j->fd[i]);
        free(j->bufs[i]);
    }
    pthread_mutex_destroy(&j->mu);
    free(j->leaf);
    free(j);
    return rc;
}

static bool kv_hex64(const char *s, size_t n) {
    if (n != 64) return false;
    for (size_t i = 0; i < 64; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return false;
    return true;
}

int kv_pieces_file_identity(const kv_gguf *g, const char *path, char id[65], kv_diag *d) {
    kv_str s;
    if (kv_gguf_get_str(g, "kvasir.source.id", &s, NULL)) return kv_pieces_model_id(g, path, 0, id, d);
    if (!kv_hex64(s.ptr, s.len))
        return kv_fail(d, KV_EFORMAT, "%s: kvasir.source.id is not 64 lowercase hex digits", path);
    memcpy(id, s.ptr, 64);
    id[64] = 0;
    return 0;
}

int kv_pieces_slab_meta(const kv_gguf *g, uint32_t *layer, uint32_t *first, uint32_t *last, uint32_t *n_expert,
                        kv_diag *d) {
    uint32_t L, f, l, ne;
    if (kv_gguf_get_u32(g, "kvasir.slab.layer", &L, NULL))
        return kv_fail(d, KV_ENOTFOUND, "not a slab (no kvasir.slab.layer)");
    if (kv_gguf_get_u32(g, "kvasir.slab.first", &f, NULL) || kv_gguf_get_u32(g, "kvasir.slab.last", &l, NULL) ||
        kv_gguf_get_u32(g, "kvasir.slab.n_expert", &ne, NULL))
        return kv_fail(d, KV_EFORMAT, "lacks kvasir.slab.{layer,first,last,n_expert}");
    if (L >= KV_MAX_LAYERS || ne == 0 || ne > KV_MAX_EXPERTS || f > l || l >= ne)
        return kv_fail(d, KV_EFORMAT, "kvasir.slab.{layer,first,last,n_expert} = %u, %u, %u, %u out of range", L, f,
                       l, ne);
    if (layer) *layer = L;
    if (first) *first = f;
    if (last) *last = l;
    if (n_expert) *n_expert = ne;
    return 0;
}

/* ---- a slice folder -------------------------------------------------------- */

typedef struct kv_verify {
    kv_pieces *p;
    const kv_pieces_opts *o;
    const char *who;
    atomic_size_t next;
    size_t n;               /* files: 0 = backbone, 1.. = slabs */
    atomic_int failed;
    kv_diag d;
    pthread_mutex_t mu;
} kv_verify;

static int kv_check_id(const kv_gguf *g, const kv_manifest *m, const char *who, const char *rel, kv_diag *d) {
    kv_str id;
    if (kv_gguf_get_str(g, "kvasir.source.id", &id, NULL))
        return kv_fail(d, KV_EFORMAT, "%s: '%s' has no kvasir.source.id (not a Kvasir slice)", who, rel);
    if (id.len != 64 || memcmp(id.ptr, m->model_id, 64))
        return kv_fail(d, KV_EFORMAT, "%s: '%s' belongs to another model (id %.16s..., manifest %.16s...)", who, rel,
                       id.len >= 16 ? id.ptr : "?", m->model_id);
    return 0;
}

static const char *const kv_mat_name[3] = {"gate", "up", "down"};

/* Checks slab k's header against the manifest and records its layout. */
static int kv_check_slab(kv_pieces *p, const char *who, size_t k, kv_gguf *g, kv_diag *d) {
    const kv_manifest *m = p->m;
    const kv_manifest_slab *ms = &m->slabs[k];
    kv_piece_slab *sl = &p->slabs[k];
    const char *rel = ms->file.path;
    int rc = kv_check_id(g, m, who, rel, d);
    if (rc) return rc;
    uint32_t L, f, l, ne;
    if ((rc = kv_pieces_slab_meta(g, &L, &f, &l, &ne, d)))
        return kv_diag_prefix(d, KV_EFORMAT, "%s: '%s'", who, rel);
    if (L != ms->layer || f != ms->first || l != ms->last || ne != m->n_expert)
        return kv_fail(d, KV_EFORMAT, "%s: '%s' holds layer %u experts %u-%u of %u, the manifest says layer %u "
                       "experts %u-%u of %u", who, rel, L, f, l, ne, ms->layer, ms->first, ms->last, m->n_expert);
    const uint64_t cnt = (uint64_t)l - f + 1;
    for (int j = 0; j < 3; j++) {
        const kv_gguf_tensor *t = kv_slab_expert_tensor(g, L, j);
        const uint64_t in = j == 2 ? m->n_ff_exp : m->n_embd, out = j == 2 ? m->n_embd : m->n_ff_exp;
        if (!t) return kv_fail(d, KV_EFORMAT, "%s: '%s' has no %s experts tensor of layer %u", who, rel, kv_mat_name[j], L);
        if (t->n_dims != 3 || t->ne[0] != in || t->ne[1] != out || t->ne[2] != cnt)
            return kv_fail(d, KV_EFORMAT, "%s: '%s': %.*s is %" PRIu64 "x%" PRIu64 "x%" PRIu64 ", expected %" PRIu64
                           "x%" PRIu64 "x%" PRIu64, who, rel, (int)t->name.len, t->name.ptr, t->ne[0], t->ne[1],
                           t->ne[2], in, out, cnt);
        const kv_type_info *ti = kv_type_get(t->type);
        if (!ti || !ti->compute)
            return kv_fail(d, KV_EUNSUPPORTED, "%s: '%s': %.*s has type %s, which we cannot compute", who, rel,
                           (int)t->name.len, t->name.ptr, ti ? ti->name : "unknown");
        sl->type[j] = t->type;
        sl->nb2[j] = t->nbytes / cnt;
        sl->off[j] = t->file_offset;
        sl->base[j] = t->data;
    }
    sl->layer = L;
    sl->first = f;
    sl->last = l;
    return 0;
}

/* Resolves rel inside dir; the result must stay inside dir after symlinks. */
static int kv_resolve(const char *dir, const char *who, const char *rel, char **out, kv_diag *d) {
    char full[PATH_MAX + 300], res[PATH_MAX];
    *out = NULL;
    snprintf(full, sizeof full, "%s/%s", dir, rel);
    if (!realpath(full, res)) {
        if (errno == ENOENT) return kv_fail(d, KV_ENOTFOUND, "%s: '%s' is missing", who, rel);
        return kv_fail(d, KV_EIO, "%s: '%s': %s", who, rel, strerror(errno));
    }
    const size_t n = strlen(dir);
    if (strncmp(res, dir, n) || res[n] != '/')
        return kv_fail(d, KV_EFORMAT, "%s: '%s' resolves to '%s', outside the manifest's folder '%s'", who, rel, res,
                       dir);
    if (!(*out = strdup(res))) return kv_fail(d, KV_ENOMEM, "%s: out of memory", who);
    return 0;
}

/* Verifies file i (0 = backbone, else slab i-1): size, hash, header. */
static int kv_verify_one(kv_verify *v, size_t i, uint8_t *buf, kv_diag *d) {
    kv_pieces *p = v->p;
    const char *who = v->who;
    const kv_manifest_file *mf = i == 0 ? &p->m->backbone : &p->m->slabs[i - 1].file;
    char *path = NULL;
    int rc = kv_resolve(p->dir, who, mf->path, &path, d);
    if (rc == KV_ENOTFOUND && i > 0 && v->o->slabs_may_be_missing) return 0;
    if (rc) return rc;
    if (i == 0) p->backbone = path;
    else p->slabs[i - 1].path = path;
    int fd;
    uint64_t size;
    /* resolved: no symlink left to follow */
    if ((rc = kv_pieces_open_file(path, true, &fd, &size, d)))
        return kv_fail(d, rc, "%s: '%s' is %s", who, mf->path, rc == KV_ENOTFOUND ? "missing" : "not a regular file");
    if (size != mf->size) {
        close(fd);
        return kv_fail(d, KV_EFORMAT, "%s: '%s' has %" PRIu64 " bytes, the manifest says %" PRIu64, who, mf->path,
                       size, mf->size);
    }
    if (!v->o->skip_hashes && mf->has_sha256) {
        uint8_t got[32];
        const int hr = kv_hash_fd(fd, mf->size, buf, got, &v->failed);
        if (hr < 0) {
            rc = kv_fail(d, KV_EIO, "%s: reading '%s': %s", who, mf->path, errno ? strerror(errno) : "short file");
            close(fd);
            return rc;
        }
        if (hr == 0 && memcmp(got, mf->sha256, 32)) {
            char a[65], b[65];
            kv_sha256_hex(got, a);
            kv_sha256_hex(mf->sha256, b);
            close(fd);
            return kv_fail(d, KV_EHASH, "%s: '%s' is corrupt: SHA-256 %.16s... but the manifest says %.16s...", who,
                           mf->path, a, b);
        }
        if (v->o->keep_fd) posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    } else if (!v->o->skip_hashes && !(v->o->allow_sparse && p->m->sparse)) {
        close(fd);
        return kv_fail(d, KV_EFORMAT, "%s: '%s' has no SHA-256 in the manifest", who, mf->path);
    }
    kv_gguf *g = NULL;
    /* a piece is one file: never a door to its folder's other files */
    if ((rc = kv_gguf_open_file(&g, path, d))) {
        close(fd);
        return kv_diag_prefix(d, rc, "%s: '%s'", who, mf->path);
    }
    if (kv_gguf_find_kv(g, "split.count"))
        rc = kv_fail(d, KV_EFORMAT, "%s: '%s' carries split.* keys, but a piece is one file", who, mf->path);
    else
        rc = i == 0 ? kv_check_id(g, p->m, who, mf->path, d) : kv_check_slab(p, who, i - 1, g, d);
    if (rc || i == 0 || !v->o->keep_gguf) {
        kv_gguf_close(g);
        g = NULL;
    }
    if (i > 0 && !rc) {
        p->slabs[i - 1].g = g;
        if (v->o->keep_fd) {
            p->slabs[i - 1].fd = fd;
            fd = -1;
        }
    }
    if (fd >= 0) close(fd);
    return rc;
}

static void *kv_verify_thread(void *arg) {
    kv_verify *v = arg;
    uint8_t *buf = v->o->skip_hashes ? NULL : malloc(KV_PIECES_BUF);
    kv_diag d = {0};
    int rc = 0;
    if (!v->o->skip_hashes && !buf) rc = kv_fail(&d, KV_ENOMEM, "%s: out of memory", v->who);
    while (!rc && !atomic_load(&v->failed)) {
        const size_t i = atomic_fetch_add(&v->next, 1);
        if (i >= v->n) break;
        rc = kv_verify_one(v, i, buf, &d);
    }
    if (rc) {
        pthread_mutex_lock(&v->mu);
        if (!atomic_load(&v->failed)) {
            v->d = d;
            atomic_store(&v->failed, rc);
        }
        pthread_mutex_unlock(&v->mu);
    }
    free(buf);
    return NULL;
}

void kv_pieces_free(kv_pieces *p) {
    if (!p) return;
    for (size_t i = 0; p->slabs && i < p->n_slabs; i++) {
        kv_gguf_close(p->slabs[i].g);
        if (p->slabs[i].fd >= 0) close(p->slabs[i].fd);
        free(p->slabs[i].path);
    }
    free(p->slabs);
    free(p->where);
    free(p->dir);
    free(p->backbone);
    kv_manifest_free(p->m);
    free(p);
}

kv_manifest *kv_pieces_take_manifest(kv_pieces *p) {
    kv_manifest *m = p->m;
    p->m = NULL;
    return m;
}

int kv_pieces_open(kv_pieces **out, const char *manifest_path, const kv_pieces_opts *opts, kv_diag *d) {
    *out = NULL;
    const kv_pieces_opts o = opts ? *opts : (kv_pieces_opts){0};
    const char *who = o.who ? o.who : "pieces";
    kv_pieces *p = calloc(1, sizeof *p);
    if (!p) return kv_fail(d, KV_ENOMEM, "%s: out of memory", who);
    int rc = kv_manifest_load(&p->m, manifest_path, d);
    if (rc) goto fail;
    kv_manifest *m = p->m;
    if (m->sparse && !o.allow_sparse) {
        rc = kv_fail(d, KV_EUNSUPPORTED, "%s: %s describes a sparse skeleton (no hashes, no weights); it runs only "
                     "when asked (--allow-sparse)", who, manifest_path);
        goto fail;
    }
    if (o.runnable && (rc = kv_pieces_check_runnable(m, who, manifest_path, d))) goto fail;
    if (o.keep_fd) { /* every slab keeps a descriptor open */
        struct rlimit rl;
        if (!getrlimit(RLIMIT_NOFILE, &rl) && rl.rlim_cur < m->n_slabs + 64) {
            rl.rlim_cur = rl.rlim_max < m->n_slabs + 64 ? rl.rlim_max : m->n_slabs + 64;
            setrlimit(RLIMIT_NOFILE, &rl);
            if (rl.rlim_cur < m->n_slabs + 64) {
                rc = kv_fail(d, KV_EUNSUPPORTED, "%s: %zu slabs need more open files than the limit (%llu); raise "
                             "ulimit -n or slice with more experts per slab", who, m->n_slabs,
                             (unsigned long long)rl.rlim_cur);
                goto fail;
            }
        }
    }
    {
        char tmp[PATH_MAX + 1], res[PATH_MAX];
        if (snprintf(tmp, sizeof tmp, "%s", manifest_path) >= (int)sizeof tmp) {
            rc = kv_fail(d, KV_EINVAL, "%s: manifest path too long", who);
            goto fail;
        }
        char *slash = strrchr(tmp, '/');
        const char *dir = slash ? (slash == tmp ? "/" : (*slash = 0, tmp)) : ".";
        if (!realpath(dir, res) || !(p->dir = strdup(res))) {
            rc = kv_fail(d, KV_EIO, "%s: cannot resolve the folder of %s", who, manifest_path);
            goto fail;
        }
    }
    if (!(p->slabs = calloc(m->n_slabs ? m->n_slabs : 1, sizeof *p->slabs))) {
        rc = kv_fail(d, KV_ENOMEM, "%s: out of memory", who);
        goto fail;
    }
    p->n_slabs = m->n_slabs;
    for (size_t i = 0; i < m->n_slabs; i++) p->slabs[i].fd = -1;
    {
        kv_verify v = {.p = p, .o = &o, .who = who, .n = m->n_slabs + 1};
        pthread_mutex_init(&v.mu, NULL);
        kv_run_threads(kv_nthreads(o.n_threads, v.n), kv_verify_thread, &v);
        pthread_mutex_destroy(&v.mu);
        if ((rc = atomic_load(&v.failed))) {
            if (d) *d = v.d;
            goto fail;
        }
    }
    /* the index, and one set of types per layer */
    const size_t n_keys = (size_t)m->n_layer * m->n_expert;
    if (!(p->where = malloc(n_keys * sizeof *p->where))) {
        rc = kv_fail(d, KV_ENOMEM, "%s: out of memory", who);
        goto fail;
    }
    for (size_t k = 0; k < n_keys; k++) p->where[k] = -1;
    int32_t *first_of = calloc(m->n_layer, sizeof *first_of); /* 1 + first present slab of each layer */
    if (!first_of) {
        rc = kv_fail(d, KV_ENOMEM, "%s: out of memory", who);
        goto fail;
    }
    for (size_t i = 0; i < m->n_slabs && !rc; i++) {
        const kv_piece_slab *sl = &p->slabs[i];
        if (!sl->path) continue;
        p->n_present++;
        for (uint32_t e = sl->first; e <= sl->last; e++) p->where[(size_t)sl->layer * m->n_expert + e] = (int32_t)i;
        if (!first_of[sl->layer]) first_of[sl->layer] = (int32_t)i + 1;
        const kv_piece_slab *r = &p->slabs[first_of[sl->layer] - 1];
        if (memcmp(r->type, sl->type, sizeof r->type))
            rc = kv_fail(d, KV_EFORMAT, "%s: '%s' has other tensor types than '%s' of the same layer", who,
                         m->slabs[i].file.path, m->slabs[first_of[sl->layer] - 1].file.path);
    }
    free(first_of);
    if (rc) goto fail;
    *out = p;
    return 0;
fail:
    kv_pieces_free(p);
    return rc;
}

int kv_pieces_check_runnable(const kv_manifest *m, const char *who, const char *manifest_path, kv_diag *d) {
    if (m->layer_first != 0 || m->layer_last + 1 < m->n_layer - m->n_layer_nextn)
        return kv_fail(d, KV_EFORMAT, "%s: %s covers layers %u-%u only; running needs layers 0-%u", who, manifest_path,
                       m->layer_first, m->layer_last, m->n_layer - m->n_layer_nextn - 1);
    if (m->n_expert_used == 0 || m->n_expert_used > m->n_expert || m->n_expert_used > KV_MAX_EXPERTS_USED)
        return kv_fail(d, KV_EFORMAT, "%s: %s: hparams.n_expert_used is %u (must be 1-%u)", who, manifest_path,
                       m->n_expert_used, m->n_expert < KV_MAX_EXPERTS_USED ? m->n_expert : KV_MAX_EXPERTS_USED);
    return 0;
}

int kv_pieces_check_model(const kv_manifest *m, const kv_model *model, const char *who, kv_diag *d) {
    const kv_hparams *hp = kv_model_hparams(model);
    /* hp->n_layer counts trunk blocks, the manifest every block (MTP too) */
    if (hp->n_layer + hp->n_layer_nextn != m->n_layer || hp->n_layer_nextn != m->n_layer_nextn ||
        hp->n_embd != m->n_embd || hp->n_expert != m->n_expert ||
        hp->n_expert_used != m->n_expert_used || hp->n_ff_exp != m->n_ff_exp || strcmp(hp->arch_name, m->arch))
        return kv_fail(d, KV_EFORMAT, "%s: the backbone (%s, %u+%u layers, embd %u, %u experts top-%u of %u) "
                       "disagrees with the manifest (%s, %u (%u MTP), %u, %u top-%u of %u)", who, hp->arch_name,
                       hp->n_layer, hp->n_layer_nextn, hp->n_embd, hp->n_expert, hp->n_expert_used, hp->n_ff_exp,
                       m->arch, m->n_layer, m->n_layer_nextn, m->n_embd, m->n_expert, m->n_expert_used, m->n_ff_exp);
    /* every block whose kind carries routed experts (not deepseek2's leading dense blocks) */
    const kv_arch_table *a = kv_arch_get(hp->arch);
    const kv_tensor_desc *ex = kv_arch_tensor(a, KV_T_FFN_GATE_EXPS);
    for (uint32_t L = 0; L < hp->n_layer; L++) {
        const bool moe = ex && kv_tensor_in_block(a, ex, hp, L);
        if (moe && !m->moe_layer[L]) return kv_fail(d, KV_EFORMAT, "%s: layer %u has no experts in the manifest", who, L);
        if (!moe && m->moe_layer[L])
            return kv_fail(d, KV_EFORMAT, "%s: layer %u is a dense block but the manifest lists experts for it", who, L);
    }
    return 0;
}
