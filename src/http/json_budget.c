/* A per-thread memory budget for jansson (see http_guard.h), and handing
 * freed heap back to the system after a burst of big requests.
 *
 * jansson's allocator is process-global, so the budget is kept per thread:
 * a thread that set none allocates exactly as before (plain malloc/free,
 * so strings jansson returns, such as json_dumps's, are still free()d by
 * their callers). Each block is counted at its usable size plus the
 * allocator's per-block overhead, the cost that made 1 MiB of "{}" hold
 * tens of megabytes. */
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__GLIBC__) || defined(__ANDROID__)
#include <malloc.h>
#define KV_HAVE_USABLE_SIZE 1
#endif

#include "http/http_guard.h"

#define KV_JB_OVERHEAD 16 /* bytes of malloc bookkeeping per block (glibc: 8, rounded to 16) */

static _Thread_local struct {
    bool on, exceeded;
    size_t limit;
    size_t live;    /* bytes held by blocks allocated on this thread since begin */
    size_t freed;   /* bytes freed (blocks from before begin may be among them) */
} kv_jb;

static size_t kv_jb_size(void *p, size_t asked) {
#ifdef KV_HAVE_USABLE_SIZE
    (void)asked;
    return malloc_usable_size(p) + KV_JB_OVERHEAD;
#else
    (void)p;
    return asked + KV_JB_OVERHEAD;
#endif
}

static void *kv_jb_malloc(size_t n) {
    if (!kv_jb.on) return malloc(n);
    const size_t held = kv_jb.live > kv_jb.freed ? kv_jb.live - kv_jb.freed : 0;
    if (n > kv_jb.limit || held + n + KV_JB_OVERHEAD > kv_jb.limit) {
        kv_jb.exceeded = true;
        return NULL;
    }
    void *p = malloc(n);
    if (p) kv_jb.live += kv_jb_size(p, n);
    return p;
}

static void kv_jb_free(void *p) {
#ifdef KV_HAVE_USABLE_SIZE
    if (p && kv_jb.on) kv_jb.freed += kv_jb_size(p, 0);
#endif
    free(p);
}

static pthread_once_t kv_jb_once = PTHREAD_ONCE_INIT;
static void kv_jb_install(void) { json_set_alloc_funcs(kv_jb_malloc, kv_jb_free); }

void kv_json_budget_install(void) { pthread_once(&kv_jb_once, kv_jb_install); }

void kv_json_budget_begin(size_t limit) {
    kv_jb.on = true;
    kv_jb.exceeded = false;
    kv_jb.limit = limit;
    kv_jb.live = kv_jb.freed = 0;
}

size_t kv_json_budget_end(bool *exceeded) {
    if (exceeded) *exceeded = kv_jb.exceeded;
    const size_t held = kv_jb.live > kv_jb.freed ? kv_jb.live - kv_jb.freed : 0;
    kv_jb.on = false;
    kv_jb.live = kv_jb.freed = 0;
    return held;
}

void kv_http_release_memory(bool big) {
    if (!big) return;
#ifdef __GLIBC__
    static _Atomic int64_t last_ms;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    const int64_t now = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    int64_t prev = atomic_load(&last_ms);
    if (now - prev < 100 || !atomic_compare_exchange_strong(&last_ms, &prev, now)) return;
    malloc_trim(0); /* every arena: connection threads each use their own */
#endif
}

size_t kv_http_rss_bytes(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    size_t kb = 0;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "VmRSS:", 6)) {
            kb = strtoull(line + 6, NULL, 10);
            break;
        }
    fclose(f);
    return kb * 1024;
}
