/* Proof of service, the hub's policy (src/hub/prove.c): addresses and
 * subnets, challenge inputs, the expected answers and their judgement. */
#ifndef KVASIR_HUB_PROVE_H
#define KVASIR_HUB_PROVE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/slice.h"

#define KV_HUB_PROVE_TOL 1e-4     /* max |got - want| / max |want| an answer may be off */
#define KV_HUB_PROVE_TASKS 16u    /* slabs proven on one connection */

/* Splits a node's announced "IP:PORT" into its host (canonical text) and its
 * subnet (IPv4 /24 "a.b.c.0/24", IPv6 /48). A name instead of a numeric IP
 * is KV_EINVAL: the hub never resolves a stranger's names. */
int kv_hub_addr_subnet(const char *addr, char *host, size_t hcap, char *subnet, size_t scap, kv_diag *d);
/* Two hosts as kv_hub_addr_subnet writes them are the same (never an
 * empty one); the second form takes an "IP:PORT" (false if it is not one). */
bool kv_hub_same_host(const char *a, const char *b);
bool kv_hub_same_host_addr(const char *host, const char *addr);
/* 127.0.0.0/8 or ::1 (host as kv_hub_addr_subnet writes it). */
bool kv_hub_addr_loopback(const char *host);
/* n standard normal values from the CSPRNG. */
void kv_hub_prove_input(float *x, uint32_t n);
/* The hub's own answer: y[n_embd] = expert `expert` of manifest slab `slab`
 * (read from dir_fd's folder) applied to x[n_embd]. */
int kv_hub_prove_expect(int dir_fd, const kv_manifest *m, uint32_t slab, uint32_t expert, const float *x, float *y,
                        kv_diag *d);
/* True when got is finite and within KV_HUB_PROVE_TOL of want (relative to
 * want's largest magnitude); *err is that relative error. */
bool kv_hub_prove_judge(const float *want, const float *got, uint32_t n, double *err);

#endif
