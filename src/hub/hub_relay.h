/* The hub's relay (docs/HUB.md "Relay"): the relay server of the link layer
 * (include/kvasir/relay.h) started beside the hub's HTTP API, serving the
 * hub's own certificate so that the one fingerprint a node pins
 * (`#sha256=`) names both; and the hub's own coordinator client of it, with
 * which the prover reaches a relayed node through a circuit (the node must
 * prove its key end to end there as anywhere). Internal to the hub. */
#ifndef KVASIR_HUB_RELAY_H
#define KVASIR_HUB_RELAY_H

#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/relay.h"

struct kv_https_cert;
typedef struct kv_hub_relay kv_hub_relay;

/* Starts the relay on host_port ("HOST:PORT"; the hub's host) with the
 * certificate cert (copied into a TLS context), the bounds of budgets (its
 * listen, tls and log are set here; NULL = the relay's defaults) and the
 * hub's coordinator
 * client, whose key is the hub's (hub_sk: seed || pk). 0 and *out
 * (kv_hub_relay_free), or the relay's error (a port in use: KV_EIO). */
int kv_hub_relay_start(kv_hub_relay **out, const char *host_port, const struct kv_https_cert *cert,
                       const uint8_t hub_sk[64], const kv_relay_server_opts *budgets, bool quiet, kv_diag *d);
/* The bound port. */
uint16_t kv_hub_relay_port(const kv_hub_relay *r);
/* The certificate's fingerprint (64 hex digits). */
const char *kv_hub_relay_fp(const kv_hub_relay *r);
/* A loopback listener whose connections are circuits to node pk (for one
 * probe: free it after the probe's connection closed). */
int kv_hub_relay_proxy(kv_hub_relay *r, const uint8_t pk[32], int timeout_ms, kv_relay_proxy **out, kv_diag *d);
void kv_hub_relay_stats(const kv_hub_relay *r, kv_relay_stats *out);
void kv_hub_relay_free(kv_hub_relay *r); /* accepts NULL */

#endif
