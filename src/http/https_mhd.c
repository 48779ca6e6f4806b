/* The HTTPS options of the libmicrohttpd servers (https_mhd.h). GnuTLS
 * priorities: its NORMAL set limited to TLS 1.3, so a client that offers
 * only an older version fails the handshake. */
#include "http/https_mhd.h"

#include <string.h>

int kv_https_mhd_setup(kv_https_mhd *m, const kv_https_cert *tls, const struct sockaddr *sa, bool insecure,
                       const char *who, kv_diag *d) {
    memset(m, 0, sizeof *m);
    m->opts[0].option = MHD_OPTION_END;
    int rc = kv_https_listen_check(sa, tls != NULL, insecure, who, d);
    if (rc || !tls) return rc;
    if (!MHD_is_feature_supported(MHD_FEATURE_TLS))
        return kv_fail(d, KV_EUNSUPPORTED, "%s: this libmicrohttpd was built without TLS", who);
    m->flags = MHD_USE_TLS;
    m->opts[0] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_KEY, 0, tls->key_pem};
    m->opts[1] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_MEM_CERT, 0, tls->cert_pem};
    m->opts[2] = (struct MHD_OptionItem){MHD_OPTION_HTTPS_PRIORITIES, 0, (void *)"NORMAL:-VERS-ALL:+VERS-TLS1.3"};
    m->opts[3] = (struct MHD_OptionItem){MHD_OPTION_END, 0, NULL};
    return 0;
}
