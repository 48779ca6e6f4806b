/* Shared flag parsing for the subcommands: every number from the command
 * line is parsed strictly and bounded. */
#include "cli/cli.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kv_cli_err(const char *cmd, int rc, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "kvasir %s: ", cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return rc;
}

int kv_cli_diag(const char *cmd, const kv_diag *d) {
    fprintf(stderr, "kvasir %s: %s\n", cmd, d->msg[0] ? d->msg : kv_err_str(d->code));
    return 2;
}

int kv_arg_long(const char *cmd, const char *flag, const char *s, long lo, long hi, long *out) {
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || !end || end == s || *end)
        return kv_cli_err(cmd, 1, "%s: '%s' is not an integer", flag, s);
    if (v < lo || v > hi)
        return kv_cli_err(cmd, 1, "%s: %ld is out of range [%ld, %ld]", flag, v, lo, hi);
    *out = v;
    return 0;
}

int kv_arg_u64(const char *cmd, const char *flag, const char *s, uint64_t *out) {
    char *end = NULL;
    errno = 0;
    if (s[0] == '-') return kv_cli_err(cmd, 1, "%s: '%s' must not be negative", flag, s);
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || !end || end == s || *end)
        return kv_cli_err(cmd, 1, "%s: '%s' is not an unsigned integer", flag, s);
    *out = (uint64_t)v;
    return 0;
}

int kv_arg_float(const char *cmd, const char *flag, const char *s, double lo, double hi,
                 float *out) {
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || !end || end == s || *end || !isfinite(v))
        return kv_cli_err(cmd, 1, "%s: '%s' is not a number", flag, s);
    if (v < lo || v > hi)
        return kv_cli_err(cmd, 1, "%s: %g is out of range [%g, %g]", flag, v, lo, hi);
    *out = (float)v;
    return 0;
}

const char *kv_arg_value(const char *cmd, int argc, char **argv, int *i, const char *const *known) {
    if (known) {
        bool found = false;
        for (const char *const *k = known; *k && !found; k++) found = !strcmp(*k, argv[*i]);
        if (!found) {
            kv_cli_err(cmd, 1, "unknown option '%s' (see kvasir %s --help)", argv[*i], cmd);
            return NULL;
        }
    }
    if (*i + 1 >= argc) {
        kv_cli_err(cmd, 1, "%s needs a value", argv[*i]);
        return NULL;
    }
    return argv[++*i];
}
