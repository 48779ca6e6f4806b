/* libmicrohttpd's side of HTTPS (include/kvasir/https.h): the flags and
 * options a server adds to MHD_start_daemon to serve a certificate, and the
 * loopback rule checked before it listens. TLS 1.3 only. */
#ifndef KVASIR_HTTPS_MHD_H
#define KVASIR_HTTPS_MHD_H

#include <microhttpd.h>

#include "kvasir/https.h"

typedef struct kv_https_mhd {
    unsigned flags;                /* MHD_USE_TLS, or 0 for plain HTTP */
    struct MHD_OptionItem opts[4]; /* for MHD_OPTION_ARRAY; ends with MHD_OPTION_END */
} kv_https_mhd;

/* Fills *m for a server (who: "hub", "gateway") about to listen on sa: with
 * tls non-NULL, TLS 1.3 serving tls's certificate (m->opts point into *tls,
 * which must outlive the daemon); with tls NULL, plain HTTP, refused
 * (KV_EINVAL) unless sa is loopback or insecure. */
int kv_https_mhd_setup(kv_https_mhd *m, const kv_https_cert *tls, const struct sockaddr *sa, bool insecure,
                       const char *who, kv_diag *d);

#endif
