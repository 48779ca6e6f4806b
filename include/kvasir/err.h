/* Kvasir error codes and diagnostics.
 *
 * Every fallible function returns 0 on success or a negative KV_E* code, and
 * fills an optional kv_diag with one line of printf-style detail naming what
 * was wrong. Codes are generated from one X-macro; their numbers are fixed
 * forever because some of them cross the wire (dispatch protocol). */
#ifndef KVASIR_ERR_H
#define KVASIR_ERR_H

#include <stdarg.h>
#include <stddef.h>

#define KV_ERR_MAP(X)                                        \
    X(OK,          0,   "success")                           \
    X(EINVAL,      -1,  "invalid argument")                  \
    X(ENOMEM,      -2,  "out of memory")                     \
    X(EIO,         -3,  "I/O error")                         \
    X(EFORMAT,     -4,  "malformed input")                   \
    X(EUNSUPPORTED,-5,  "unsupported")                       \
    X(ERANGE,      -6,  "value out of range")                \
    X(ENOTFOUND,   -7,  "not found")                         \
    X(EPROTO,      -8,  "protocol error")                    \
    X(ETIMEOUT,    -9,  "timed out")                         \
    X(EHASH,       -10, "hash mismatch")                     \
    X(ECTXFULL,    -11, "context full")                      \
    X(EINTERNAL,   -12, "internal error")                    \
    X(EAUTH,       -13, "not authorized")

enum kv_err {
#define KV_ERR_ENUM(name, val, str) KV_##name = (val),
    KV_ERR_MAP(KV_ERR_ENUM)
#undef KV_ERR_ENUM
    KV_ERR_COUNT = 14
};

_Static_assert(KV_EPROTO == -8, "wire error codes never change");
_Static_assert(KV_ETIMEOUT == -9, "wire error codes never change");

/* One diagnostic line. Callers own it (usually on the stack); functions that
 * take a kv_diag * accept NULL. */
typedef struct kv_diag {
    int code;       /* last error code set, 0 if none */
    char msg[512];  /* NUL-terminated detail, "" if none */
} kv_diag;

/* Symbolic name ("EFORMAT") and description of an error code; never NULL. */
const char *kv_err_name(int code);
const char *kv_err_str(int code);

/* Formats a message into d (if not NULL) and returns code, so callers write
 * `return kv_fail(d, KV_EFORMAT, "tensor '%s': ...", name);`. */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
int kv_fail(kv_diag *d, int code, const char *fmt, ...);
#if defined(__GNUC__)
__attribute__((format(printf, 3, 0)))
#endif
int kv_vfail(kv_diag *d, int code, const char *fmt, va_list ap);

/* Prefixes the existing message in d with "prefix: " (context added while an
 * error travels up). Returns d->code (or code when d is NULL). */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
int kv_diag_prefix(kv_diag *d, int code, const char *fmt, ...);

/* Always-on invariant check for our own logic and API misuse only; never
 * for anything that came from a file, socket or user. */
void kv_assert_fail(const char *expr, const char *file, int line);
#define KV_ASSERT(x) ((x) ? (void)0 : kv_assert_fail(#x, __FILE__, __LINE__))

/* Overflow-checked size arithmetic: return 0 on overflow, 1 on success. */
static inline int kv_mul_ok(size_t a, size_t b, size_t *out) {
    if (a != 0 && b > (size_t)-1 / a) return 0;
    *out = a * b;
    return 1;
}
static inline int kv_add_ok(size_t a, size_t b, size_t *out) {
    if (b > (size_t)-1 - a) return 0;
    *out = a + b;
    return 1;
}

#endif
