/* Defences shared by the two libmicrohttpd servers (the gateway and the
 * hub) against clients that hold resources without doing work.
 *
 * Connections (guard.c). Every connection is tracked from accept to close
 * with its client's address (IPv4, or the /64 of IPv6: one host is given a
 * whole /64) and the time its current request began. A request that has not
 * arrived whole (headers and body) within request_ms of its start is closed,
 * however steadily its bytes trickle in (libmicrohttpd's own timeout is per
 * idle period only); the wait of a kept-alive connection for its next request
 * counts as part of that request. An address holds at most per_ip
 * connections. When max_conns are open, a newcomer is let in by closing the
 * oldest incomplete connection of the address that holds the most
 * incomplete ones, provided that address holds at least two more than the
 * newcomer's: so a few addresses cannot fill the server, and an honest
 * client with one connection is never the one closed while others hold
 * many. A connection whose request is whole (being answered or streamed)
 * is never closed by the guard.
 *
 * Parse memory (json_budget.c). jansson's allocator is process-global:
 * kv_json_budget_install makes it count, per thread, the bytes a parse
 * holds (malloc_usable_size of each block) while a budget is set on that
 * thread, and refuse an allocation past it; jansson then fails the parse
 * with a clean error. Threads without a budget allocate as before. */
#ifndef KVASIR_HTTP_GUARD_H
#define KVASIR_HTTP_GUARD_H

#include <microhttpd.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "kvasir/err.h"

typedef struct kv_http_guard kv_http_guard;

typedef struct kv_http_guard_opts {
    uint32_t max_conns;   /* connections open at once (libmicrohttpd is given headroom above it
                             for the ones being closed) */
    uint32_t per_ip;      /* connections one address (IPv6: one /64) may hold */
    uint32_t request_ms;  /* a request's headers and body arrive within this; 0 = no deadline */
} kv_http_guard_opts;

typedef struct kv_http_guard_stats {
    uint64_t refused_ip;  /* newcomers refused: their address held per_ip */
    uint64_t refused_full;/* newcomers refused: full, and no address held more than theirs */
    uint64_t evicted;     /* incomplete connections closed to let a newcomer in */
    uint64_t expired;     /* requests closed at their deadline */
    uint32_t open;        /* connections open now */
} kv_http_guard_stats;

/* Starts the guard (and its deadline thread). Returns 0, or KV_EINVAL /
 * KV_ENOMEM / KV_EIO with d. Free with kv_http_guard_free after the daemon
 * that uses it has stopped. */
int kv_http_guard_open(kv_http_guard **out, const kv_http_guard_opts *o, kv_diag *d);
void kv_http_guard_free(kv_http_guard *g); /* accepts NULL */

/* The connection limit to give libmicrohttpd: max_conns plus room for the
 * connections being closed to make way. */
unsigned kv_http_guard_mhd_limit(const kv_http_guard *g);

/* libmicrohttpd hooks: MHD_start_daemon(..., apc = kv_http_guard_accept,
 * apc_cls = g, ..., MHD_OPTION_NOTIFY_CONNECTION, kv_http_guard_notify, g). */
enum MHD_Result kv_http_guard_accept(void *cls, const struct sockaddr *addr, socklen_t len);
void kv_http_guard_notify(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe);

/* The request on c has arrived whole: no deadline until it ends. */
void kv_http_guard_busy(kv_http_guard *g, struct MHD_Connection *c);
/* The request on c ended (MHD_OPTION_NOTIFY_COMPLETED): the next one's
 * deadline starts now. */
void kv_http_guard_idle(kv_http_guard *g, struct MHD_Connection *c);

void kv_http_guard_get_stats(kv_http_guard *g, kv_http_guard_stats *out);

/* The request's Content-Length headers agree (none, one, or several equal
 * ones) and it does not carry both Content-Length and Transfer-Encoding.
 * false with a reason in why[cap] otherwise: answer 400, as two lengths
 * are how one request is smuggled inside another. */
bool kv_http_lengths_ok(struct MHD_Connection *c, char *why, size_t cap);

/* ---- parse memory -------------------------------------------------------- */

/* Installs the counting allocator into jansson (once per process; thread-safe). */
void kv_json_budget_install(void);
/* Sets this thread's budget: from now until kv_json_budget_end, jansson
 * allocations on this thread are counted and refused past limit bytes. */
void kv_json_budget_begin(size_t limit);
/* Ends it. Returns the bytes still held by what was parsed (allocated minus
 * freed since begin, at least 0); *exceeded says whether an allocation was
 * refused. */
size_t kv_json_budget_end(bool *exceeded);

/* Hands freed heap pages back to the system (malloc_trim), at most once per
 * 100 ms, after big=true (a request freed megabytes); thread-safe. */
void kv_http_release_memory(bool big);

/* This process's resident memory in bytes (VmRSS), or 0 if unknown. */
size_t kv_http_rss_bytes(void);

#endif
