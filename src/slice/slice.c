/* kv_slice_model: cutting a GGUF into a backbone and expert slabs.
 *
 * Every output file is planned first (metadata, tensor list, and for each
 * tensor the source byte range), then written by a few threads, one file at
 * a time each: the header through kv_gguf_writer, the tensor data by pread
 * into an 8 MiB buffer, SHA-256 of the buffer, pwrite at its final place.
 * The hash is taken in file order (header, each tensor, its padding), so it
 * equals a hash of the finished file without reading it back. Source ranges
 * that are holes (SEEK_DATA/SEEK_HOLE) are neither read nor written, so a
 * skeleton slices in time proportional to its header; such a source yields
 * pieces without hashes (hashing its zeros would cost time proportional to
 * the logical size, and a skeleton holds no weights worth protecting).
 * Before any file is written, the model identity (slice.h) is computed by
 * kv_pieces_model_id over the source, in parallel and skipping holes: every
 * piece's header carries it, so it must be known first (one more read of
 * the source, which leaves it in the page cache for the copy).
 *
 * A split source (gguf.h) slices as one model: each tensor's range is read
 * from the part holding it, through one descriptor per thread reopened when
 * the part changes (tensors are visited in file order, so rarely), and the
 * backbone takes the first part's metadata without the split.* keys (it is
 * one file). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/arch.h"
#include "kvasir/pieces.h"
#include "kvasir/quant.h"
#include "kvasir/slice.h"

#define KV_SLICE_BUF (8u << 20) /* copy buffer per thread */

/* One routed-expert layer of the source. */
typedef struct kv_exp_layer {
    const kv_gguf_tensor *t[3]; /* gate, up, down */
    const kv_gguf_tensor *b[3]; /* their biases (gpt-oss: f32 [rows][n_expert]), all or none */
} kv_exp_layer;

/* One output file. */
typedef struct kv_slice_job {
    kv_manifest_file *file;     /* where size and hash go */
    bool backbone;
    uint32_t layer, first, last; /* slab range */
} kv_slice_job;

typedef struct kv_slicer {
    const kv_gguf *g;
    const char *src_path;
    const char *out_dir;
    char model_id[65];
    kv_str arch;
    uint32_t n_layer, n_expert, n_embd, n_ff, n_used;
    uint32_t n_nextn;            /* <arch>.nextn_predict_layers: MTP blocks at the end */
    kv_exp_layer *layers;        /* [n_layer], t[0] NULL for layers without experts */
    bool sparse;                 /* source has holes in tensor data */
    kv_slice_job *jobs;
    size_t n_jobs;
    atomic_size_t next_job;
    atomic_int failed;           /* first failure wins */
    kv_diag fail_diag;
    pthread_mutex_t mu;
    atomic_uint_fast64_t copied, holes;
} kv_slicer;

static const char *const kv_exp_names[3] = {KV_EXPERT_STEM_GATE, KV_EXPERT_STEM_UP, KV_EXPERT_STEM_DOWN};

/* "blk.<L>.<name>.weight" or "blk.<L>.<name>" -> layer and which of the
 * three expert tensors; -1 if not a routed-expert tensor. */
static int kv_exp_kind(kv_str name, uint32_t *layer) {
    char buf[KV_GGUF_MAX_TENSOR_NAME + 1];
    if (name.len > KV_GGUF_MAX_TENSOR_NAME || name.len < 5) return -1;
    memcpy(buf, name.ptr, name.len);
    buf[name.len] = 0;
    if (strncmp(buf, "blk.", 4) || buf[4] < '0' || buf[4] > '9') return -1;
    char *e;
    unsigned long L = strtoul(buf + 4, &e, 10);
    if (*e != '.' || L >= KV_MAX_LAYERS) return -1;
    for (int k = 0; k < 3; k++) {
        const size_t n = strlen(kv_exp_names[k]);
        if (!strncmp(e + 1, kv_exp_names[k], n) && (!e[1 + n] || !strcmp(e + 1 + n, ".weight"))) {
            *layer = (uint32_t)L;
            return k;
        }
    }
    return -1;
}

/* Whether name is "blk.<L>.<stem>.bias" of a routed-expert matrix (gpt-oss):
 * those rows travel in the slabs, not in the backbone. */
static bool kv_exp_bias(kv_str name) {
    static const char suf[] = ".bias";
    const size_t n = sizeof suf - 1;
    if (name.len <= n || memcmp(name.ptr + name.len - n, suf, n)) return false;
    uint32_t L;
    return kv_exp_kind((kv_str){name.ptr, name.len - n}, &L) >= 0;
}

static int kv_slicer_scan(kv_slicer *s, kv_diag *d) {
    const kv_gguf *g = s->g;
    int rc = kv_gguf_get_str(g, "general.architecture", &s->arch, d);
    if (rc) return kv_fail(d, KV_EFORMAT, "slice: the source has no general.architecture");
    if (!s->arch.len || s->arch.len > 63) return kv_fail(d, KV_EFORMAT, "slice: bad general.architecture");
    char key[128];
    uint32_t bc = 0;
    snprintf(key, sizeof key, "%.*s.block_count", (int)s->arch.len, s->arch.ptr);
    if (kv_gguf_get_u32(g, key, &bc, NULL) || bc > KV_MAX_LAYERS) bc = 0;
    snprintf(key, sizeof key, "%.*s.expert_used_count", (int)s->arch.len, s->arch.ptr);
    if (kv_gguf_get_u32(g, key, &s->n_used, NULL)) s->n_used = 0;
    snprintf(key, sizeof key, "%.*s.nextn_predict_layers", (int)s->arch.len, s->arch.ptr);
    if (kv_gguf_get_u32(g, key, &s->n_nextn, NULL) || s->n_nextn >= bc) s->n_nextn = 0;
    s->n_layer = bc;
    if (!(s->layers = calloc(KV_MAX_LAYERS, sizeof *s->layers))) return kv_fail(d, KV_ENOMEM, "slice: out of memory");
    for (size_t i = 0; i < kv_gguf_n_tensors(g); i++) {
        const kv_gguf_tensor *t = kv_gguf_tensor_at(g, i);
        uint32_t L;
        int k = kv_exp_kind(t->name, &L);
        if (k < 0) continue;
        if (t->n_dims != 3 || t->ne[2] == 0)
            return kv_fail(d, KV_EFORMAT, "slice: tensor '%.*s' must be 3-D [in, out, n_expert]", (int)t->name.len,
                           t->name.ptr);
        s->layers[L].t[k] = t;
        if (L + 1 > s->n_layer) s->n_layer = L + 1;
    }
    if (s->n_layer != bc) s->n_nextn = 0; /* experts past block_count: MTP blocks are not the last */
    /* the experts' biases travel with them in the slabs (the backbone has none) */
    for (uint32_t L = 0; L < s->n_layer; L++)
        for (int k = 0; k < 3 && s->layers[L].t[0]; k++) s->layers[L].b[k] = kv_slab_expert_bias(g, L, k);
    uint32_t n_moe = 0;
    for (uint32_t L = 0; L < s->n_layer; L++) {
        const kv_exp_layer *el = &s->layers[L];
        const int have = !!el->t[0] + !!el->t[1] + !!el->t[2];
        if (have == 0) continue;
        if (have != 3)
            return kv_fail(d, KV_EFORMAT, "slice: layer %u has only %d of ffn_gate_exps, ffn_up_exps, ffn_down_exps "
                           "(fused or partial expert tensors are not supported)", L, have);
        const kv_gguf_tensor *gt = el->t[0], *ut = el->t[1], *dt = el->t[2];
        if (gt->ne[0] != ut->ne[0] || gt->ne[1] != ut->ne[1] || dt->ne[0] != gt->ne[1] || dt->ne[1] != gt->ne[0] ||
            gt->ne[2] != ut->ne[2] || gt->ne[2] != dt->ne[2])
            return kv_fail(d, KV_EFORMAT, "slice: layer %u: expert tensor shapes disagree (gate %" PRIu64 "x%" PRIu64
                           "x%" PRIu64 ", down %" PRIu64 "x%" PRIu64 "x%" PRIu64 ")", L, gt->ne[0], gt->ne[1], gt->ne[2],
                           dt->ne[0], dt->ne[1], dt->ne[2]);
        if (gt->ne[0] > KV_MAX_EMBD || gt->ne[1] > KV_MAX_FF || gt->ne[2] > KV_MAX_EXPERTS)
            return kv_fail(d, KV_EFORMAT, "slice: layer %u: expert tensors exceed the supported sizes", L);
        const int nb = !!el->b[0] + !!el->b[1] + !!el->b[2];
        if (nb != 0 && nb != 3) return kv_fail(d, KV_EFORMAT, "slice: layer %u has %d of its 3 expert biases", L, nb);
        for (int k = 0; k < 3 && nb; k++) {
            const kv_gguf_tensor *b = el->b[k];
            const uint64_t rows = k == 2 ? gt->ne[0] : gt->ne[1];
            if (b->type != KV_TYPE_F32 || b->n_dims != 2 || b->ne[0] != rows || b->ne[1] != gt->ne[2])
                return kv_fail(d, KV_EFORMAT, "slice: '%.*s' must be f32 [%" PRIu64 ", %" PRIu64 "]", (int)b->name.len,
                               b->name.ptr, rows, gt->ne[2]);
        }
        if (n_moe == 0) {
            s->n_embd = (uint32_t)gt->ne[0];
            s->n_ff = (uint32_t)gt->ne[1];
            s->n_expert = (uint32_t)gt->ne[2];
        } else if (s->n_embd != gt->ne[0] || s->n_ff != gt->ne[1] || s->n_expert != gt->ne[2]) {
            return kv_fail(d, KV_EFORMAT, "slice: layer %u has other expert shapes than the first MoE layer", L);
        }
        n_moe++;
    }
    if (!n_moe) return kv_fail(d, KV_EFORMAT, "slice: the source has no routed-expert tensors (blk.N.ffn_*_exps)");
    if (s->n_used > s->n_expert) s->n_used = 0;
    return 0;
}

/* A thread's descriptor on the source part it reads now. */
typedef struct kv_src_fd {
    int fd;        /* -1 until a part is opened */
    uint32_t part; /* which part fd reads */
} kv_src_fd;

static const char *kv_part_path(const kv_slicer *s, uint32_t part) {
    const kv_gguf *p = kv_gguf_part(s->g, part);
    return p && kv_gguf_path(p) ? kv_gguf_path(p) : s->src_path;
}

/* Points sf at part's file, reopening if it reads another part. */
static int kv_src_part(kv_slicer *s, kv_src_fd *sf, uint32_t part, kv_diag *d) {
    if (sf->fd >= 0 && sf->part == part) return 0;
    if (sf->fd >= 0) close(sf->fd);
    sf->fd = -1;
    int rc = kv_pieces_open_file(kv_part_path(s, part), false, &sf->fd, NULL, d);
    if (rc) return kv_diag_prefix(d, rc, "slice");
    sf->part = part;
    posix_fadvise(sf->fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    return 0;
}

/* Copies src range [off, off+n) to tensor idx at byte `at`, hashing into h
 * (if not NULL); holes are skipped. */
static int kv_copy_range(kv_slicer *s, int fd, const char *src_path, uint8_t *buf, kv_gguf_writer *w, size_t idx,
                         uint64_t at, uint64_t off, uint64_t n, kv_sha256 *h, kv_diag *d) {
    const uint64_t end = off + n;
    uint64_t pos = off;
    while (pos < end) {
        uint64_t data_end = end;
        if (s->sparse) {
            off_t ds = lseek(fd, (off_t)pos, SEEK_DATA);
            if (ds < 0 || (uint64_t)ds >= end) { /* ENXIO: only a hole until EOF */
                s->holes += end - pos;
                return 0;
            }
            s->holes += (uint64_t)ds - pos;
            pos = (uint64_t)ds;
            off_t he = lseek(fd, (off_t)pos, SEEK_HOLE);
            if (he >= 0 && (uint64_t)he < end) data_end = (uint64_t)he;
        }
        while (pos < data_end) {
            size_t k = data_end - pos > KV_SLICE_BUF ? KV_SLICE_BUF : (size_t)(data_end - pos);
            ssize_t r = pread(fd, buf, k, (off_t)pos);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0)
                return kv_fail(d, KV_EIO, "slice: reading %s at %" PRIu64 ": %s", src_path, pos,
                               r < 0 ? strerror(errno) : "unexpected end of file");
            if (h) kv_sha256_update(h, buf, (size_t)r);
            int rc = kv_gguf_writer_write_data(w, idx, at + (pos - off), buf, (size_t)r, d);
            if (rc) return rc;
            pos += (uint64_t)r;
            s->copied += (uint64_t)r;
        }
    }
    return 0;
}

static bool kv_is_split_key(kv_str key) { return key.len > 6 && !memcmp(key.ptr, "split.", 6); }

static int kv_slice_job_run(kv_slicer *s, const kv_slice_job *j, kv_src_fd *sf, uint8_t *buf, kv_diag *d) {
    const kv_gguf *g = s->g;
    kv_gguf_writer *w = NULL;
    char path[4096], part[4200];
    kv_sha256 h = {NULL}; /* the file's hash, started once the header is written */
    int rc = kv_gguf_writer_new(&w, d);
    if (rc) return rc;
    /* tensors: (source offset, bytes) in declaration order */
    typedef struct { uint64_t off, n; uint32_t part; } kv_rng;
    kv_rng *rng = malloc((j->backbone ? kv_gguf_n_tensors(g) : 6) * sizeof *rng);
    size_t n_t = 0;
    if (!rng) {
        kv_gguf_writer_free(w);
        return kv_fail(d, KV_ENOMEM, "slice: out of memory");
    }
    if (j->backbone) {
        for (size_t i = 0; i < kv_gguf_n_kv(g) && !rc; i++)
            if (!kv_is_split_key(kv_gguf_kv_at(g, i)->key)) rc = kv_gguf_writer_copy_kv(w, kv_gguf_kv_at(g, i), d);
        for (size_t i = 0; i < kv_gguf_n_tensors(g) && !rc; i++) {
            const kv_gguf_tensor *t = kv_gguf_tensor_at(g, i);
            uint32_t L;
            if (kv_exp_kind(t->name, &L) >= 0 || kv_exp_bias(t->name)) continue;
            char name[KV_GGUF_MAX_TENSOR_NAME + 1];
            memcpy(name, t->name.ptr, t->name.len);
            name[t->name.len] = 0;
            rc = kv_gguf_writer_add_tensor(w, name, t->n_dims, t->ne, t->type, NULL, d);
            rng[n_t++] = (kv_rng){t->file_offset, t->nbytes, t->part};
        }
        snprintf(path, sizeof path, "%s/%s", s->out_dir, j->file->path);
    } else {
        static const char *const copy_keys[] = {"general.architecture", "general.name", "general.alignment"};
        static const char *const hp_keys[] = {"block_count", "embedding_length", "expert_count",
                                              "expert_used_count", "expert_feed_forward_length",
                                              "nextn_predict_layers"};
        for (size_t i = 0; i < 3 && !rc; i++) {
            const kv_gguf_kv *kv = kv_gguf_find_kv(g, copy_keys[i]);
            if (kv) rc = kv_gguf_writer_copy_kv(w, kv, d);
        }
        for (size_t i = 0; i < sizeof hp_keys / sizeof hp_keys[0] && !rc; i++) {
            char key[128];
            snprintf(key, sizeof key, "%.*s.%s", (int)s->arch.len, s->arch.ptr, hp_keys[i]);
            const kv_gguf_kv *kv = kv_gguf_find_kv(g, key);
            if (kv) rc = kv_gguf_writer_copy_kv(w, kv, d);
        }
        if (!rc) rc = kv_gguf_writer_set_u32(w, "kvasir.slab.layer", j->layer, d);
        if (!rc) rc = kv_gguf_writer_set_u32(w, "kvasir.slab.first", j->first, d);
        if (!rc) rc = kv_gguf_writer_set_u32(w, "kvasir.slab.last", j->last, d);
        if (!rc) rc = kv_gguf_writer_set_u32(w, "kvasir.slab.n_expert", s->n_expert, d);
        const uint64_t cnt = (uint64_t)j->last - j->first + 1;
        for (int k = 0; k < 3 && !rc; k++) {
            const kv_gguf_tensor *t = s->layers[j->layer].t[k];
            char name[KV_GGUF_MAX_TENSOR_NAME + 1];
            memcpy(name, t->name.ptr, t->name.len);
            name[t->name.len] = 0;
            const uint64_t ne[3] = {t->ne[0], t->ne[1], cnt}, nb2 = t->nbytes / t->ne[2];
            rc = kv_gguf_writer_add_tensor(w, name, 3, ne, t->type, NULL, d);
            rng[n_t++] = (kv_rng){t->file_offset + j->first * nb2, cnt * nb2, t->part};
        }
        for (int k = 0; k < 3 && !rc && s->layers[j->layer].b[k]; k++) { /* the range's bias rows */
            const kv_gguf_tensor *t = s->layers[j->layer].b[k];
            char name[KV_GGUF_MAX_TENSOR_NAME + 1];
            memcpy(name, t->name.ptr, t->name.len);
            name[t->name.len] = 0;
            const uint64_t ne[2] = {t->ne[0], cnt}, nb1 = t->ne[0] * sizeof(float);
            rc = kv_gguf_writer_add_tensor(w, name, 2, ne, t->type, NULL, d);
            rng[n_t++] = (kv_rng){t->file_offset + j->first * nb1, cnt * nb1, t->part};
        }
        snprintf(path, sizeof path, "%s/%s", s->out_dir, j->file->path);
    }
    if (!rc) rc = kv_gguf_writer_set_u32(w, "kvasir.slice.version", KV_SLICE_VERSION, d);
    if (!rc) rc = kv_gguf_writer_set_str(w, "kvasir.source.id", s->model_id, d);
    snprintf(part, sizeof part, "%s.part", path);
    if (!rc) rc = kv_gguf_writer_begin(w, part, d);
    if (rc) goto done;
    /* the header as written, for the hash */
    kv_sha256_init(&h);
    uint64_t data_off;
    {
        int hf = open(part, O_RDONLY | O_CLOEXEC);
        struct stat st;
        if (hf < 0 || fstat(hf, &st)) {
            if (hf >= 0) close(hf);
            rc = kv_fail(d, KV_EIO, "slice: cannot reopen '%s'", part);
            goto done;
        }
        data_off = (uint64_t)st.st_size;
        for (uint64_t p = 0; p < data_off;) {
            size_t k = data_off - p > KV_SLICE_BUF ? KV_SLICE_BUF : (size_t)(data_off - p);
            ssize_t r = pread(hf, buf, k, (off_t)p);
            if (r <= 0) {
                close(hf);
                rc = kv_fail(d, KV_EIO, "slice: cannot read back the header of '%s'", part);
                goto done;
            }
            kv_sha256_update(&h, buf, (size_t)r);
            p += (uint64_t)r;
        }
        close(hf);
    }
    const uint64_t align = kv_gguf_alignment(g);
    static const uint8_t zeros[KV_GGUF_MAX_ALIGNMENT];
    uint64_t size = data_off;
    for (size_t i = 0; i < n_t && !rc; i++) {
        rc = kv_src_part(s, sf, rng[i].part, d);
        if (!rc)
            rc = kv_copy_range(s, sf->fd, kv_part_path(s, rng[i].part), buf, w, i, 0, rng[i].off, rng[i].n,
                               s->sparse ? NULL : &h, d);
        const uint64_t pad = (align - rng[i].n % align) % align;
        if (!s->sparse) kv_sha256_update(&h, zeros, (size_t)pad);
        size += rng[i].n + pad;
    }
    if (!rc) rc = kv_gguf_writer_finish(w, d);
    if (!rc) {
        struct stat st;
        if (stat(part, &st) || (uint64_t)st.st_size != size) {
            rc = kv_fail(d, KV_EINTERNAL, "slice: '%s' has %lld bytes, expected %" PRIu64, part,
                         (long long)st.st_size, size);
        } else if (rename(part, path)) {
            rc = kv_fail(d, KV_EIO, "slice: cannot rename '%s': %s", part, strerror(errno));
        }
    }
    if (!rc) {
        j->file->size = size;
        j->file->has_sha256 = !s->sparse;
        if (!s->sparse) kv_sha256_final(&h, j->file->sha256);
    }
done:
    if (h.ctx) kv_sha256_discard(&h);
    kv_gguf_writer_free(w);
    free(rng);
    if (rc) unlink(part);
    return rc;
}

static void *kv_slice_thread(void *arg) {
    kv_slicer *s = arg;
    uint8_t *buf = malloc(KV_SLICE_BUF);
    kv_diag d = {0};
    kv_src_fd sf = {-1, 0};
    int rc = kv_src_part(s, &sf, 0, &d);
    if (!rc && !buf) rc = kv_fail(&d, KV_ENOMEM, "slice: cannot allocate a copy buffer");
    while (!rc && !atomic_load(&s->failed)) {
        size_t i = atomic_fetch_add(&s->next_job, 1);
        if (i >= s->n_jobs) break;
        rc = kv_slice_job_run(s, &s->jobs[i], &sf, buf, &d);
    }
    if (rc) {
        pthread_mutex_lock(&s->mu);
        if (!atomic_load(&s->failed)) {
            s->fail_diag = d;
            atomic_store(&s->failed, rc);
        }
        pthread_mutex_unlock(&s->mu);
    }
    if (sf.fd >= 0) close(sf.fd);
    free(buf);
    return NULL;
}

static int kv_mkdir(const char *p, kv_diag *d) {
    if (mkdir(p, 0755) && errno != EEXIST) return kv_fail(d, KV_EIO, "slice: cannot create '%s': %s", p, strerror(errno));
    struct stat st;
    if (stat(p, &st) || !S_ISDIR(st.st_mode)) return kv_fail(d, KV_EIO, "slice: '%s' is not a folder", p);
    return 0;
}

int kv_slice_model(const char *src, const char *out_dir, const kv_slice_opts *opts, kv_slice_stats *stats,
                   kv_diag *d) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    kv_slice_opts o = opts ? *opts : (kv_slice_opts){0, -1, -1, 0};
    kv_slicer s = {.src_path = src, .out_dir = out_dir};
    kv_gguf *g = NULL;
    kv_manifest *m = NULL;
    int rc = kv_gguf_open(&g, src, d);
    if (rc) return rc;
    s.g = g;
    pthread_mutex_init(&s.mu, NULL);
    if ((rc = kv_slicer_scan(&s, d))) goto done;
    /* the identity first: every piece's header carries it */
    if ((rc = kv_pieces_model_id(g, src, o.n_threads, s.model_id, d))) goto done;
    const int64_t lf = o.layer_first < 0 ? 0 : o.layer_first, ll = o.layer_last < 0 ? (int64_t)s.n_layer - 1 : o.layer_last;
    if (lf > ll || ll >= (int64_t)s.n_layer) {
        rc = kv_fail(d, KV_ERANGE, "slice: layer range %" PRId64 "-%" PRId64 " is not within 0-%u", lf, ll, s.n_layer - 1);
        goto done;
    }
    const uint32_t per = o.experts_per_slab == 0 || o.experts_per_slab > s.n_expert ? s.n_expert : o.experts_per_slab;
    for (uint32_t p = 0; p < kv_gguf_n_parts(g); p++) { /* holes in tensor data? */
        const kv_gguf *pg = kv_gguf_part(g, p);
        int fd = -1;
        if ((rc = kv_pieces_open_file(kv_part_path(&s, p), false, &fd, NULL, d))) {
            kv_diag_prefix(d, rc, "slice");
            goto done;
        }
        off_t hole = lseek(fd, (off_t)kv_gguf_data_offset(pg), SEEK_HOLE);
        s.sparse |= hole >= 0 && (uint64_t)hole < kv_gguf_file_size(pg);
        close(fd);
    }
    /* the manifest, filled in as files are written */
    if (!(m = calloc(1, sizeof *m)) || !(m->moe_layer = calloc(s.n_layer, 1))) {
        rc = kv_fail(d, KV_ENOMEM, "slice: out of memory");
        goto done;
    }
    m->version = KV_SLICE_VERSION;
    memcpy(m->model_id, s.model_id, sizeof m->model_id);
    snprintf(m->arch, sizeof m->arch, "%.*s", (int)s.arch.len, s.arch.ptr);
    kv_str nm;
    if (!kv_gguf_get_str(g, "general.name", &nm, NULL))
        snprintf(m->name, sizeof m->name, "%.*s", (int)(nm.len < 255 ? nm.len : 255), nm.ptr);
    m->n_layer = s.n_layer;
    m->n_layer_nextn = s.n_nextn;
    m->n_embd = s.n_embd;
    m->n_expert = s.n_expert;
    m->n_expert_used = s.n_used;
    m->n_ff_exp = s.n_ff;
    m->layer_first = (uint32_t)lf;
    m->layer_last = (uint32_t)ll;
    m->sparse = s.sparse;
    size_t n_slabs = 0;
    for (uint32_t L = 0; L < s.n_layer; L++) {
        m->moe_layer[L] = s.layers[L].t[0] != NULL;
        if (m->moe_layer[L] && L >= lf && L <= ll) n_slabs += (s.n_expert + per - 1) / per;
    }
    m->n_slabs = n_slabs;
    if (!(m->slabs = calloc(n_slabs ? n_slabs : 1, sizeof *m->slabs)) || !(s.jobs = calloc(n_slabs + 1, sizeof *s.jobs))) {
        rc = kv_fail(d, KV_ENOMEM, "slice: out of memory");
        goto done;
    }
    snprintf(m->backbone.path, sizeof m->backbone.path, "backbone.gguf");
    s.jobs[s.n_jobs++] = (kv_slice_job){&m->backbone, true, 0, 0, 0};
    size_t k = 0;
    for (uint32_t L = (uint32_t)lf; L <= ll; L++) {
        if (!m->moe_layer[L]) continue;
        for (uint32_t f = 0; f < s.n_expert; f += per, k++) {
            kv_manifest_slab *sl = &m->slabs[k];
            sl->layer = L;
            sl->first = f;
            sl->last = f + per - 1 < s.n_expert ? f + per - 1 : s.n_expert - 1;
            snprintf(sl->file.path, sizeof sl->file.path, "experts/blk.%u.%04u-%04u.gguf", L, sl->first, sl->last);
            s.jobs[s.n_jobs++] = (kv_slice_job){&sl->file, false, L, sl->first, sl->last};
        }
    }
    char sub[4096];
    if (snprintf(sub, sizeof sub, "%s/experts", out_dir) >= (int)sizeof sub) {
        rc = kv_fail(d, KV_EINVAL, "slice: output path too long");
        goto done;
    }
    if ((rc = kv_mkdir(out_dir, d)) || (rc = kv_mkdir(sub, d))) goto done;
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int nth = o.n_threads > 0 ? o.n_threads : (int)(ncpu > 0 ? ncpu : 1);
    if (nth > 64) nth = 64;
    if ((size_t)nth > s.n_jobs) nth = (int)s.n_jobs;
    pthread_t th[64];
    int started = 0;
    for (int i = 0; i < nth; i++)
        if (!pthread_create(&th[i], NULL, kv_slice_thread, &s)) started++;
        else break;
    if (!started) kv_slice_thread(&s);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    if ((rc = atomic_load(&s.failed))) {
        if (d) *d = s.fail_diag;
        goto done;
    }
    snprintf(sub, sizeof sub, "%s/manifest.json", out_dir);
    if ((rc = kv_manifest_write(m, sub, d))) goto done;
    if (stats) {
        memset(stats, 0, sizeof *stats);
        stats->n_slabs = (uint32_t)n_slabs;
        for (uint32_t L = 0; L < s.n_layer; L++) stats->n_moe_layers += m->moe_layer[L];
        stats->bytes_logical = m->backbone.size;
        for (size_t i = 0; i < n_slabs; i++) stats->bytes_logical += m->slabs[i].file.size;
        stats->bytes_copied = s.copied;
        stats->bytes_holes = s.holes;
        stats->sparse = s.sparse;
        clock_gettime(CLOCK_MONOTONIC, &t1);
        stats->seconds = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    }
done:
    pthread_mutex_destroy(&s.mu);
    kv_manifest_free(m);
    free(s.jobs);
    free(s.layers);
    kv_gguf_close(g);
    return rc;
}
