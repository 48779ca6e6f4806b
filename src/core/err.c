/* Error names, descriptions and the diagnostic buffer helpers. */
#include "kvasir/err.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *kv_err_name(int code) {
    switch (code) {
#define KV_ERR_NAME(name, val, str) case val: return #name;
        KV_ERR_MAP(KV_ERR_NAME)
#undef KV_ERR_NAME
    default: return "EUNKNOWN";
    }
}

const char *kv_err_str(int code) {
    switch (code) {
#define KV_ERR_STR(name, val, str) case val: return str;
        KV_ERR_MAP(KV_ERR_STR)
#undef KV_ERR_STR
    default: return "unknown error";
    }
}

/* Messages are one line by contract, and often quote untrusted input (a
 * name from a file, a JSON fragment): control bytes become '?'. */
static void kv_msg_clean(char *m) {
    for (; *m; m++)
        if ((unsigned char)*m < 0x20 || *m == 0x7f) *m = '?';
}

int kv_vfail(kv_diag *d, int code, const char *fmt, va_list ap) {
    if (d) {
        d->code = code;
        vsnprintf(d->msg, sizeof d->msg, fmt, ap);
        kv_msg_clean(d->msg);
    }
    return code;
}

int kv_fail(kv_diag *d, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    kv_vfail(d, code, fmt, ap);
    va_end(ap);
    return code;
}

int kv_diag_prefix(kv_diag *d, int code, const char *fmt, ...) {
    if (!d) return code;
    char pre[256], old[sizeof d->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pre, sizeof pre, fmt, ap);
    va_end(ap);
    memcpy(old, d->msg, sizeof old);
    /* truncation of very long messages is acceptable: they stay NUL-terminated */
    size_t n = strlen(pre);
    if (n > sizeof d->msg - 3) n = sizeof d->msg - 3;
    memcpy(d->msg, pre, n);
    d->msg[n++] = ':';
    d->msg[n++] = ' ';
    const char *rest = old[0] ? old : kv_err_str(code);
    size_t r = strlen(rest);
    if (r > sizeof d->msg - 1 - n) r = sizeof d->msg - 1 - n;
    memcpy(d->msg + n, rest, r);
    d->msg[n + r] = 0;
    kv_msg_clean(d->msg);
    if (d->code == 0) d->code = code;
    return d->code;
}

void kv_assert_fail(const char *expr, const char *file, int line) {
    fprintf(stderr, "kvasir: internal assertion failed: %s (%s:%d)\n", expr, file, line);
    abort();
}
