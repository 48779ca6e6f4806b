/* A persistent thread pool with one barrier per parallel step.
 *
 * kv_pool_run(p, fn, arg) calls fn(arg, ith, nth) once on each of the nth
 * threads (the caller is thread 0) and returns when all have finished. Work
 * is split by the callee, by output rows, never inside one reduction, so
 * results never depend on nth. No allocation per step. */
#ifndef KVASIR_POOL_H
#define KVASIR_POOL_H

#include "kvasir/err.h"

#define KV_POOL_MAX_THREADS 256

typedef struct kv_pool kv_pool;
typedef void (*kv_pool_fn)(void *arg, int ith, int nth);

/* n_threads in [1, KV_POOL_MAX_THREADS]; 0 means the number of online CPUs. */
int kv_pool_new(kv_pool **out, int n_threads, kv_diag *d);
void kv_pool_free(kv_pool *p); /* accepts NULL; joins the workers */
int kv_pool_size(const kv_pool *p);
/* Not reentrant: one run at a time per pool (fn must not call kv_pool_run). */
void kv_pool_run(kv_pool *p, kv_pool_fn fn, void *arg);

/* [*lo, *hi) of n items for thread ith of nth (contiguous, balanced). */
static inline void kv_pool_split(long n, int ith, int nth, long *lo, long *hi) {
    long per = n / nth, rem = n % nth;
    *lo = ith * per + (ith < rem ? ith : rem);
    *hi = *lo + per + (ith < rem ? 1 : 0);
}

#endif
