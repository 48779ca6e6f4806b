/* Persistent thread pool: workers spin briefly on a generation counter and
 * then sleep on a condition variable, so short steps (one per matmul in a
 * decode) cost little and idle pools cost nothing. The caller is thread 0.
 *
 * Every cross-thread wait here reads a C11 atomic, never a plain variable
 * (a plain one may be hoisted out of the loop, and ARM's weak order need
 * not show the store): a step's fn and arg are published by the release
 * increment of gen, which the workers read with acquire; each worker's
 * results are published by its release increment of done, which the
 * caller reads with acquire before it returns. A worker that sleeps tests
 * gen again under mu, which the caller holds while it bumps gen and
 * broadcasts, so no wake-up is lost. */
#include "kvasir/pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KV_PAUSE() _mm_pause()
#elif defined(__aarch64__) || defined(__arm__)
#define KV_PAUSE() __asm__ __volatile__("yield" ::: "memory") /* the spin-wait hint */
#else
#define KV_PAUSE() ((void)0)
#endif

#define KV_POOL_SPIN 20000 /* polls before a worker sleeps */

typedef struct kv_pool_thread {
    struct kv_pool *pool;
    int ith;
} kv_pool_thread;

struct kv_pool {
    int n;                     /* threads including the caller */
    pthread_t *threads;        /* [n-1] */
    kv_pool_thread *workers;        /* [n-1] */
    kv_pool_fn fn;             /* current step */
    void *arg;
    atomic_uint_fast64_t gen;  /* bumped once per step */
    atomic_int done;           /* workers finished with this step */
    atomic_int stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

static void *kv_pool_main(void *p_) {
    kv_pool_thread *w = p_;
    kv_pool *p = w->pool;
    uint64_t seen = 0;
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&p->gen, memory_order_acquire) == seen) {
            if (++spins < KV_POOL_SPIN) {
                KV_PAUSE();
                continue;
            }
            pthread_mutex_lock(&p->mu);
            while (atomic_load_explicit(&p->gen, memory_order_acquire) == seen) pthread_cond_wait(&p->cv, &p->mu);
            pthread_mutex_unlock(&p->mu);
        }
        /* one step at a time: the caller bumps gen again only after every done */
        seen = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) break;
        p->fn(p->arg, w->ith, p->n);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
    }
    return NULL;
}

int kv_pool_new(kv_pool **out, int n_threads, kv_diag *d) {
    *out = NULL;
    if (n_threads == 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = c > 0 ? (int)(c < KV_POOL_MAX_THREADS ? c : KV_POOL_MAX_THREADS) : 1;
    }
    if (n_threads < 1 || n_threads > KV_POOL_MAX_THREADS)
        return kv_fail(d, KV_EINVAL, "threads: %d is out of range [1, %d]", n_threads,
                       KV_POOL_MAX_THREADS);
    kv_pool *p = calloc(1, sizeof *p);
    if (!p) return kv_fail(d, KV_ENOMEM, "thread pool: out of memory");
    p->n = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    if (n_threads > 1) {
        p->threads = calloc((size_t)n_threads - 1, sizeof *p->threads);
        p->workers = calloc((size_t)n_threads - 1, sizeof *p->workers);
        if (!p->threads || !p->workers) {
            kv_pool_free(p);
            return kv_fail(d, KV_ENOMEM, "thread pool: out of memory");
        }
        for (int i = 1; i < n_threads; i++) {
            p->workers[i - 1] = (kv_pool_thread){p, i};
            if (pthread_create(&p->threads[i - 1], NULL, kv_pool_main, &p->workers[i - 1])) {
                p->n = i; /* join only those started */
                kv_pool_free(p);
                return kv_fail(d, KV_ENOMEM, "thread pool: cannot start thread %d", i);
            }
        }
    }
    *out = p;
    return 0;
}

void kv_pool_free(kv_pool *p) {
    if (!p) return;
    if (p->threads) {
        pthread_mutex_lock(&p->mu);
        atomic_store_explicit(&p->stop, 1, memory_order_release);
        atomic_fetch_add_explicit(&p->gen, 1, memory_order_release);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        for (int i = 1; i < p->n; i++) pthread_join(p->threads[i - 1], NULL);
    }
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p->threads);
    free(p->workers);
    free(p);
}

int kv_pool_size(const kv_pool *p) { return p ? p->n : 1; }

void kv_pool_run(kv_pool *p, kv_pool_fn fn, void *arg) {
    if (!p || p->n == 1) {
        fn(arg, 0, 1);
        return;
    }
    p->fn = fn; /* plain: published to the workers by the release bump of gen */
    p->arg = arg;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed); /* ordered before the bump too */
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add_explicit(&p->gen, 1, memory_order_release);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    fn(arg, 0, p->n);
    while (atomic_load_explicit(&p->done, memory_order_acquire) < p->n - 1) KV_PAUSE();
}
