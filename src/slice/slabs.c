/* Running from pieces: opening a sliced model (manifest, backbone, slabs),
 * the slab expert source with its bounded cache, the wave provider, and one
 * expert computed alone.
 *
 * Opening is kv_pieces_open (pieces.c), which checks everything before
 * anything is used: each file resolved inside the manifest's folder, its
 * size and SHA-256 (hashed in parallel), its GGUF header, its model
 * identity, and each slab's layer, range, tensor shapes and types. Any
 * failure frees everything and names the file.
 *
 * Two ways to hold experts:
 *  - mmap (default): every slab mapped; acquire returns views, like the
 *    full model file.
 *  - bounded cache (cache_bytes > 0): an arena of n_slots equal slots, each
 *    big enough for the largest expert (gate, up, down back to back). A miss
 *    preads the expert's three ranges from its slab into a free slot or the
 *    least recently used unpinned one. Entries are pinned from acquire to
 *    release (while a layer computes). The arena is allocated once and never
 *    grows, so the cache never exceeds its bound; a step needing more
 *    distinct experts than there are slots is run in waves by the provider.
 * The cache is guarded by one mutex; acquire is called from the thread
 * that runs the provider, never from the kernels. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvasir/arch.h"
#include "kvasir/pieces.h"
#include "kvasir/quant.h"
#include "kvasir/slice.h"

#define KV_SLOT_ALIGN 64u

typedef kv_piece_slab kv_slab; /* path, fd, layer, range, offsets, views, types (pieces.h) */

typedef struct kv_slot {
    int32_t key;            /* layer*n_expert + expert, -1 if free */
    int32_t pin;            /* acquires not yet released */
    int32_t prev, next;     /* LRU list of unpinned entries (head = most recent) */
} kv_slot;

struct kv_slices {
    kv_pieces *p;           /* the verified folder; owns everything below */
    kv_manifest *m;         /* p->m */
    kv_slab *slabs;         /* p->slabs: [m->n_slabs], manifest order */
    int32_t *where;         /* p->where: [n_layer*n_expert] slab index, -1 if none */
    uint64_t expert_bytes;  /* largest gate+up+down of one expert */
    /* cache mode */
    bool cache;
    pthread_mutex_t mu;
    uint8_t *arena;         /* [n_slots][slot_bytes] */
    uint64_t slot_bytes;
    uint32_t n_slots;
    kv_slot *slots;         /* [n_slots] */
    int32_t *slot_of;       /* [n_layer*n_expert] slot, -1 if not cached */
    int32_t lru_head, lru_tail, free_head; /* free list threads through .next */
    kv_slices_stats st;
};

/* ---- opening ---------------------------------------------------------- */

static int kv_read_all(int fd, uint8_t *buf, size_t n, uint64_t at) {
    while (n) {
        ssize_t r = pread(fd, buf, n, (off_t)at);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        buf += r;
        n -= (size_t)r;
        at += (uint64_t)r;
    }
    return 0;
}

static const char *const kv_exp_suffix[3] = {KV_EXPERT_STEM_GATE, KV_EXPERT_STEM_UP, KV_EXPERT_STEM_DOWN};

static const kv_gguf_tensor *kv_find_exp(const kv_gguf *g, uint32_t layer, int k) {
    char n[96];
    snprintf(n, sizeof n, "blk.%u.%s.weight", layer, kv_exp_suffix[k]);
    const kv_gguf_tensor *t = kv_gguf_find_tensor(g, n);
    if (t) return t;
    snprintf(n, sizeof n, "blk.%u.%s", layer, kv_exp_suffix[k]);
    return kv_gguf_find_tensor(g, n);
}

void kv_slices_free(kv_slices *s) {
    if (!s) return;
    if (s->cache) pthread_mutex_destroy(&s->mu);
    free(s->arena);
    free(s->slots);
    free(s->slot_of);
    kv_pieces_free(s->p);
    free(s);
}

int kv_slices_open(kv_slices **out, const char *manifest_path, const kv_slices_opts *opts, kv_diag *d) {
    *out = NULL;
    const kv_slices_opts o = opts ? *opts : (kv_slices_opts){0};
    kv_slices *s = calloc(1, sizeof *s);
    if (!s) return kv_fail(d, KV_ENOMEM, "slices: out of memory");
    s->cache = o.cache_bytes > 0;
    if (s->cache) pthread_mutex_init(&s->mu, NULL);
    /* every slab must be present; mmap mode keeps each slab mapped, cache
     * mode keeps a descriptor for pread */
    const kv_pieces_opts po = {.who = "slices", .runnable = true, .allow_sparse = o.allow_sparse,
                               .skip_hashes = o.skip_hashes, .keep_gguf = !s->cache, .keep_fd = s->cache,
                               .n_threads = o.n_threads};
    int rc = kv_pieces_open(&s->p, manifest_path, &po, d);
    if (rc) goto fail;
    kv_manifest *m = s->m = s->p->m;
    s->slabs = s->p->slabs;
    s->where = s->p->where;
    const size_t n_keys = (size_t)m->n_layer * m->n_expert;
    for (size_t i = 0; i < m->n_slabs; i++) {
        const kv_slab *sl = &s->slabs[i];
        const uint64_t eb = sl->nb2[0] + sl->nb2[1] + sl->nb2[2] + 3 * KV_SLOT_ALIGN +
                            (sl->has_bias ? sl->b_nb[0] + sl->b_nb[1] + sl->b_nb[2] + 3 * KV_SLOT_ALIGN : 0);
        if (eb > s->expert_bytes) s->expert_bytes = eb;
    }
    if (s->cache) {
        s->slot_bytes = s->expert_bytes;
        uint64_t n = o.cache_bytes / s->slot_bytes;
        if (n == 0) {
            rc = kv_fail(d, KV_EINVAL, "slices: an expert cache of %.1f MiB cannot hold one expert (%.2f MiB)",
                         (double)o.cache_bytes / 1048576.0, (double)s->slot_bytes / 1048576.0);
            goto fail;
        }
        if (n > n_keys) n = n_keys;
        s->n_slots = (uint32_t)n;
        s->arena = aligned_alloc(KV_SLOT_ALIGN, (size_t)(n * s->slot_bytes));
        s->slots = malloc(n * sizeof *s->slots);
        s->slot_of = malloc(n_keys * sizeof *s->slot_of);
        if (!s->arena || !s->slots || !s->slot_of) {
            rc = kv_fail(d, KV_ENOMEM, "slices: out of memory for a %u-slot expert cache", s->n_slots);
            goto fail;
        }
        for (size_t k = 0; k < n_keys; k++) s->slot_of[k] = -1;
        for (uint32_t i = 0; i < s->n_slots; i++)
            s->slots[i] = (kv_slot){-1, 0, -1, i + 1 < s->n_slots ? (int32_t)i + 1 : -1};
        s->free_head = 0;
        s->lru_head = s->lru_tail = -1;
        s->st.cache_slots = s->n_slots;
        s->st.slot_bytes = s->slot_bytes;
    }
    *out = s;
    return 0;
fail:
    kv_slices_free(s);
    return rc;
}

const kv_manifest *kv_slices_manifest(const kv_slices *s) { return s->m; }
const char *kv_slices_backbone_path(const kv_slices *s) { return s->p->backbone; }

int kv_slices_check_model(const kv_slices *s, const kv_model *model, kv_diag *d) {
    /* identity: the backbone's kvasir.source.id was checked at open (its own
     * header differs from the source's by construction) */
    return kv_pieces_check_model(s->m, model, "slices", d);
}

void kv_slices_get_stats(const kv_slices *s, kv_slices_stats *out) {
    if (s->cache) pthread_mutex_lock((pthread_mutex_t *)&s->mu);
    *out = s->st;
    if (s->cache) pthread_mutex_unlock((pthread_mutex_t *)&s->mu);
}

/* ---- the expert source ------------------------------------------------ */

static void kv_lru_unlink(kv_slices *s, int32_t i) {
    kv_slot *x = &s->slots[i];
    if (x->prev >= 0) s->slots[x->prev].next = x->next;
    else s->lru_head = x->next;
    if (x->next >= 0) s->slots[x->next].prev = x->prev;
    else s->lru_tail = x->prev;
    x->prev = x->next = -1;
}

static void kv_lru_push(kv_slices *s, int32_t i) {
    kv_slot *x = &s->slots[i];
    x->prev = -1;
    x->next = s->lru_head;
    if (s->lru_head >= 0) s->slots[s->lru_head].prev = i;
    s->lru_head = i;
    if (s->lru_tail < 0) s->lru_tail = i;
}

static void kv_slot_views(const kv_slices *s, const kv_slab *sl, int32_t slot, kv_expert_weights *w) {
    const uint8_t *p = s->arena + (size_t)slot * s->slot_bytes;
    const size_t a0 = (sl->nb2[0] + KV_SLOT_ALIGN - 1) / KV_SLOT_ALIGN * KV_SLOT_ALIGN;
    const size_t a1 = (sl->nb2[1] + KV_SLOT_ALIGN - 1) / KV_SLOT_ALIGN * KV_SLOT_ALIGN;
    const size_t a2 = (sl->nb2[2] + KV_SLOT_ALIGN - 1) / KV_SLOT_ALIGN * KV_SLOT_ALIGN;
    w->gate = p;
    w->up = p + a0;
    w->down = p + a0 + a1;
    /* then the biases (gpt-oss), each row KV_SLOT_ALIGN-aligned */
    const uint8_t *b = p + a0 + a1 + a2;
    const float **bd[3] = {&w->gate_b, &w->up_b, &w->down_b};
    for (int j = 0; j < 3; j++) {
        *bd[j] = sl->has_bias ? (const float *)(const void *)b : NULL;
        b += sl->has_bias ? (sl->b_nb[j] + KV_SLOT_ALIGN - 1) / KV_SLOT_ALIGN * KV_SLOT_ALIGN : 0;
    }
}

static int kv_slabs_acquire(void *ctx, uint32_t layer, uint32_t e, kv_expert_weights *w, kv_diag *d) {
    kv_slices *s = ctx;
    const kv_manifest *m = s->m;
    if (layer >= m->n_layer || e >= m->n_expert)
        return kv_fail(d, KV_ERANGE, "slices: layer %u expert %u out of range", layer, e);
    const size_t key = (size_t)layer * m->n_expert + e;
    const int32_t si = s->where[key];
    if (si < 0) return kv_fail(d, KV_ENOTFOUND, "slices: no slab holds layer %u expert %u", layer, e);
    const kv_slab *sl = &s->slabs[si];
    w->gate_type = sl->type[0];
    w->up_type = sl->type[1];
    w->down_type = sl->type[2];
    const uint64_t le = e - sl->first;
    w->act = sl->act;
    if (!s->cache) {
        kv_piece_slab_weights(sl, e, w);
        return 0;
    }
    pthread_mutex_lock(&s->mu);
    int32_t slot = s->slot_of[key];
    if (slot >= 0) {
        s->st.hits++;
        if (s->slots[slot].pin++ == 0) kv_lru_unlink(s, slot);
        kv_slot_views(s, sl, slot, w);
        pthread_mutex_unlock(&s->mu);
        return 0;
    }
    if (s->free_head >= 0) {
        slot = s->free_head;
        s->free_head = s->slots[slot].next;
    } else if (s->lru_tail >= 0) {
        slot = s->lru_tail;
        kv_lru_unlink(s, slot);
        s->slot_of[s->slots[slot].key] = -1;
        s->st.evictions++;
    } else {
        pthread_mutex_unlock(&s->mu);
        return kv_fail(d, KV_ERANGE, "slices: expert cache full: all %u slots pinned (layer %u expert %u)", s->n_slots,
                       layer, e);
    }
    s->st.misses++;
    kv_slot_views(s, sl, slot, w);
    const void *dst[6] = {w->gate, w->up, w->down, w->gate_b, w->up_b, w->down_b};
    for (int j = 0; j < (sl->has_bias ? 6 : 3); j++) {
        const uint64_t nb = j < 3 ? sl->nb2[j] : sl->b_nb[j - 3], off = j < 3 ? sl->off[j] : sl->b_off[j - 3];
        if (kv_read_all(sl->fd, (uint8_t *)dst[j], (size_t)nb, off + le * nb)) {
            s->slots[slot] = (kv_slot){-1, 0, -1, s->free_head};
            s->free_head = slot;
            pthread_mutex_unlock(&s->mu);
            return kv_fail(d, KV_EIO, "slices: reading layer %u expert %u from '%s': %s", layer, e, sl->path,
                           errno ? strerror(errno) : "file shrank");
        }
        s->st.bytes_read += nb;
    }
    s->slots[slot] = (kv_slot){(int32_t)key, 1, -1, -1};
    s->slot_of[key] = slot;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

static void kv_slabs_release(void *ctx, uint32_t layer, uint32_t e) {
    kv_slices *s = ctx;
    if (!s->cache) return;
    const size_t key = (size_t)layer * s->m->n_expert + e;
    pthread_mutex_lock(&s->mu);
    const int32_t slot = s->slot_of[key];
    KV_ASSERT(slot >= 0 && s->slots[slot].pin > 0);
    if (--s->slots[slot].pin == 0) kv_lru_push(s, slot);
    pthread_mutex_unlock(&s->mu);
}

kv_expert_source kv_slices_expert_source(kv_slices *s) {
    const kv_manifest *m = s->m;
    return (kv_expert_source){s, kv_slabs_acquire, kv_slabs_release, m->n_layer, m->n_expert, m->n_embd, m->n_ff_exp,
                              m->n_expert_used};
}

/* ---- the wave provider ------------------------------------------------ */

typedef struct kv_wave {
    kv_expert_provider inner; /* local provider over the slab source */
    kv_slices *s;
    uint32_t max_slots;       /* max_tokens * n_expert_used */
    float *xs;                /* [max_slots][n_embd] gathered inputs of one wave */
    float *ys;                /* [max_slots][n_embd] their outputs */
    int32_t *ids;             /* [max_slots] expert of each gathered slot */
    int32_t *from;            /* [max_slots] original (token, rank) slot */
    int32_t *wave_of;         /* [n_expert] wave of each active expert, -1 inactive */
} kv_wave;

static int kv_wave_compute(void *impl, const kv_expert_req *req, float *out, kv_diag *d) {
    kv_wave *v = impl;
    kv_slices *s = v->s;
    const uint32_t n_slots = req->n_tokens * req->n_used, NE = s->m->n_expert;
    if (!s->cache || req->n_embd != s->m->n_embd || (uint64_t)req->n_tokens * req->n_used > v->max_slots)
        return v->inner.compute(v->inner.impl, req, out, d); /* it checks and reports the shape */
    for (uint32_t e = 0; e < NE; e++) v->wave_of[e] = -1;
    uint32_t n_active = 0;
    for (uint32_t i = 0; i < n_slots; i++) {
        const int32_t e = req->ids[i];
        if (e < 0 || (uint32_t)e >= NE) return kv_fail(d, KV_ERANGE, "experts: expert id %d out of range", e);
        if (v->wave_of[e] < 0) v->wave_of[e] = 0, n_active++;
    }
    if (n_active <= s->n_slots) return v->inner.compute(v->inner.impl, req, out, d);
    /* waves of at most n_slots experts, in expert order */
    uint32_t k = 0;
    for (uint32_t e = 0; e < NE; e++)
        if (v->wave_of[e] >= 0) v->wave_of[e] = (int32_t)(k++ / s->n_slots);
    const uint32_t n_waves = (n_active + s->n_slots - 1) / s->n_slots;
    const size_t E = req->n_embd;
    for (uint32_t w = 0; w < n_waves; w++) {
        uint32_t n = 0;
        for (uint32_t i = 0; i < n_slots; i++) {
            if (v->wave_of[req->ids[i]] != (int32_t)w) continue;
            memcpy(v->xs + (size_t)n * E, req->x + (size_t)(i / req->n_used) * E, E * sizeof(float));
            v->ids[n] = req->ids[i];
            v->from[n++] = (int32_t)i;
        }
        const kv_expert_req sub = {req->layer, n, req->n_embd, 1, v->xs, v->ids, NULL};
        int rc = v->inner.compute(v->inner.impl, &sub, v->ys, d);
        if (rc) return rc;
        for (uint32_t j = 0; j < n; j++) memcpy(out + (size_t)v->from[j] * E, v->ys + (size_t)j * E, E * sizeof(float));
    }
    pthread_mutex_lock(&s->mu);
    s->st.waves += n_waves - 1;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

static void kv_wave_free(void *impl) {
    kv_wave *v = impl;
    if (!v) return;
    if (v->inner.free) v->inner.free(v->inner.impl);
    free(v->xs);
    free(v->ys);
    free(v->ids);
    free(v->from);
    free(v->wave_of);
    free(v);
}

int kv_slices_provider_new(kv_expert_provider *out, kv_slices *s, kv_pool *pool, uint32_t max_tokens, kv_diag *d) {
    memset(out, 0, sizeof *out);
    kv_wave *v = calloc(1, sizeof *v);
    if (!v) return kv_fail(d, KV_ENOMEM, "slices: out of memory");
    v->s = s;
    kv_expert_source src = kv_slices_expert_source(s);
    int rc = kv_expert_local_new_src(&v->inner, &src, pool, max_tokens, d);
    if (rc) {
        free(v);
        return rc;
    }
    v->max_slots = max_tokens * s->m->n_expert_used;
    if (s->cache) {
        const size_t E = s->m->n_embd;
        v->xs = malloc((size_t)v->max_slots * E * sizeof(float));
        v->ys = malloc((size_t)v->max_slots * E * sizeof(float));
        v->ids = malloc(v->max_slots * sizeof(int32_t));
        v->from = malloc(v->max_slots * sizeof(int32_t));
        v->wave_of = malloc(s->m->n_expert * sizeof(int32_t));
        if (!v->xs || !v->ys || !v->ids || !v->from || !v->wave_of) {
            kv_wave_free(v);
            return kv_fail(d, KV_ENOMEM, "slices: out of memory for %u tokens", max_tokens);
        }
    }
    out->impl = v;
    out->compute = kv_wave_compute;
    out->free = kv_wave_free;
    out->name = s->cache ? "slabs-cache" : "slabs";
    return 0;
}

/* ---- one expert alone ------------------------------------------------- */

int kv_expert_find(const kv_gguf *g, uint32_t layer, uint32_t expert, kv_expert_weights *w, uint32_t *n_embd,
                   uint32_t *n_ff, kv_diag *d) {
    uint32_t first = 0, last = UINT32_MAX, L;
    const bool slab = !kv_gguf_get_u32(g, "kvasir.slab.first", &first, NULL);
    if (slab) {
        if (kv_gguf_get_u32(g, "kvasir.slab.last", &last, NULL) || kv_gguf_get_u32(g, "kvasir.slab.layer", &L, NULL) ||
            last < first)
            return kv_fail(d, KV_EFORMAT, "expert: slab metadata kvasir.slab.{layer,last} missing or inconsistent");
        if (L != layer) return kv_fail(d, KV_ENOTFOUND, "expert: this slab holds layer %u, not %u", L, layer);
        if (expert < first || expert > last)
            return kv_fail(d, KV_ENOTFOUND, "expert: this slab holds experts %u-%u, not %u", first, last, expert);
    }
    const kv_gguf_tensor *t[3];
    for (int j = 0; j < 3; j++)
        if (!(t[j] = kv_find_exp(g, layer, j)))
            return kv_fail(d, KV_ENOTFOUND, "expert: no tensor blk.%u.%s", layer, kv_exp_suffix[j]);
    const uint64_t E = t[0]->ne[0], F = t[0]->ne[1], cnt = t[0]->ne[2];
    for (int j = 0; j < 3; j++) {
        const uint64_t in = j == 2 ? F : E, o = j == 2 ? E : F;
        if (t[j]->n_dims != 3 || t[j]->ne[0] != in || t[j]->ne[1] != o || t[j]->ne[2] != cnt)
            return kv_fail(d, KV_EFORMAT, "expert: blk.%u.%s has an inconsistent shape", layer, kv_exp_suffix[j]);
        const kv_type_info *ti = kv_type_get(t[j]->type);
        if (!ti || !ti->compute)
            return kv_fail(d, KV_EUNSUPPORTED, "expert: tensor 'blk.%u.%s.weight' has type %s (%u), which kvasir "
                           "cannot compute", layer, kv_exp_suffix[j], ti && ti->name ? ti->name : "unknown",
                           t[j]->type);
    }
    if (E == 0 || E > KV_MAX_EMBD || F == 0 || F > KV_MAX_FF)
        return kv_fail(d, KV_EFORMAT, "expert: dims %" PRIu64 "x%" PRIu64 " out of range", E, F);
    if (slab && cnt != (uint64_t)last - first + 1)
        return kv_fail(d, KV_EFORMAT, "expert: slab holds %" PRIu64 " experts, metadata says %u", cnt, last - first + 1);
    const uint64_t le = expert - first;
    if (le >= cnt) return kv_fail(d, KV_ERANGE, "expert: expert %u out of range (%" PRIu64 " experts)", expert, cnt);
    const void **dst[3] = {&w->gate, &w->up, &w->down};
    uint32_t *ty[3] = {&w->gate_type, &w->up_type, &w->down_type};
    for (int j = 0; j < 3; j++) {
        *dst[j] = (const uint8_t *)t[j]->data + le * (t[j]->nbytes / cnt);
        *ty[j] = t[j]->type;
    }
    /* the biases (gpt-oss): all three f32 [rows][cnt], or none */
    const kv_gguf_tensor *b[3];
    const float **bd[3] = {&w->gate_b, &w->up_b, &w->down_b};
    int nb = 0;
    for (int j = 0; j < 3; j++) nb += (b[j] = kv_slab_expert_bias(g, layer, j)) != NULL;
    if (nb != 0 && nb != 3) return kv_fail(d, KV_EFORMAT, "expert: layer %u has %d of its 3 expert biases", layer, nb);
    for (int j = 0; j < 3; j++) {
        *bd[j] = NULL;
        if (!nb) continue;
        const uint64_t rows = j == 2 ? E : F;
        if (b[j]->type != KV_TYPE_F32 || b[j]->n_dims != 2 || b[j]->ne[0] != rows || b[j]->ne[1] != cnt)
            return kv_fail(d, KV_EFORMAT, "expert: blk.%u.%s.bias must be f32 [%" PRIu64 ", %" PRIu64 "]", layer,
                           kv_exp_suffix[j], rows, cnt);
        *bd[j] = (const float *)(const void *)((const uint8_t *)b[j]->data + le * rows * sizeof(float));
    }
    bool need;
    w->act = kv_slab_expert_act(g, &need);
    if (need && !nb)
        return kv_fail(d, KV_EFORMAT, "expert: layer %u: the architecture's experts have biases and this file has "
                       "none (sliced by an older kvasir? slice the model again)", layer);
    *n_embd = (uint32_t)E;
    *n_ff = (uint32_t)F;
    return 0;
}

typedef struct kv_one_src {
    const kv_expert_weights *w;
} kv_one_src;

static int kv_one_acquire(void *ctx, uint32_t layer, uint32_t e, kv_expert_weights *w, kv_diag *d) {
    (void)layer;
    (void)e;
    (void)d;
    *w = *((kv_one_src *)ctx)->w;
    return 0;
}

int kv_expert_compute_one(const kv_expert_weights *w, uint32_t n_embd, uint32_t n_ff, kv_pool *pool, const float *x,
                          uint32_t n_tokens, float *y, kv_diag *d) {
    enum { CHUNK = 256 };
    kv_one_src ctx = {w};
    const kv_expert_source src = {&ctx, kv_one_acquire, NULL, 1, 1, n_embd, n_ff, 1};
    kv_expert_provider p;
    const uint32_t mt = n_tokens < CHUNK ? n_tokens : CHUNK;
    int rc = kv_expert_local_new_src(&p, &src, pool, mt ? mt : 1, d);
    if (rc) return rc;
    int32_t ids[CHUNK] = {0};
    for (uint32_t t = 0; t < n_tokens && !rc; t += CHUNK) {
        const uint32_t n = n_tokens - t < CHUNK ? n_tokens - t : CHUNK;
        const kv_expert_req req = {0, n, n_embd, 1, x + (size_t)t * n_embd, ids, NULL};
        rc = p.compute(p.impl, &req, y + (size_t)t * n_embd, d);
    }
    p.free(p.impl);
    return rc;
}

const kv_gguf_tensor *kv_slab_expert_tensor(const kv_gguf *g, uint32_t layer, int k) {
    return k >= 0 && k < 3 ? kv_find_exp(g, layer, k) : NULL;
}

const kv_gguf_tensor *kv_slab_expert_bias(const kv_gguf *g, uint32_t layer, int k) {
    if (k < 0 || k > 2) return NULL;
    char n[96];
    snprintf(n, sizeof n, "blk.%u.%s.bias", layer, kv_exp_suffix[k]);
    return kv_gguf_find_tensor(g, n);
}

uint32_t kv_slab_expert_act(const kv_gguf *g, bool *needs_bias) {
    kv_str s;
    char name[64];
    *needs_bias = false;
    if (kv_gguf_get_str(g, "general.architecture", &s, NULL) || s.len >= sizeof name) return 0;
    memcpy(name, s.ptr, s.len);
    name[s.len] = 0;
    const kv_arch_table *a = strlen(name) == s.len ? kv_arch_find(name) : NULL;
    *needs_bias = a && (a->hooks.flags & KV_AH_EXPERT_BIAS);
    return a ? (uint32_t)a->hooks.act : 0;
}

void kv_piece_slab_weights(const kv_piece_slab *sl, uint32_t e, kv_expert_weights *w) {
    const uint64_t le = e - sl->first;
    w->gate = sl->base[0] + le * sl->nb2[0];
    w->up = sl->base[1] + le * sl->nb2[1];
    w->down = sl->base[2] + le * sl->nb2[2];
    w->gate_type = sl->type[0];
    w->up_type = sl->type[1];
    w->down_type = sl->type[2];
    const float **b[3] = {&w->gate_b, &w->up_b, &w->down_b};
    for (int j = 0; j < 3; j++)
        *b[j] = sl->has_bias ? (const float *)(const void *)(sl->b_base[j] + le * sl->b_nb[j]) : NULL;
    w->act = sl->act;
}
