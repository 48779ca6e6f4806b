/* Proof of service: what the hub asks of a node before it lists it, and how
 * it judges the answers (the policy; the prover threads are in server.c).
 *
 * A registration is a claim: "key K serves these slabs at this address". The
 * hub lists none of it until it is proven: it dials the address, the worker
 * there must prove K in the dispatch handshake, and it must answer a compute
 * challenge for each slab, one random hidden state through one random expert
 * of that slab, which the hub recomputes from its own copy (one token
 * through one expert: a few megabytes read, far less than what the node
 * serves between two challenges). The answers must come within a deadline
 * tight enough that a node without the slab cannot fetch it first. Proven
 * nodes are challenged again at random times (one slab each time); one wrong
 * or late answer unlists the node's replicas until it proves them again.
 *
 * Answers are compared with a tolerance, not bit for bit: the node may run
 * other kernels (AVX2, AVX-512, NEON, OpenCL), which differ from ours in the
 * last bits (docs/NUMERICS.md). A relative error of 1e-4 of the row's
 * largest magnitude is far above what summation orders differ by, and far
 * below what a node that does not compute the expert can guess.
 *
 * Addresses and subnets: announced hosts must be numeric IPs, so that limits
 * per address and per subnet (an IPv4 /24, an IPv6 /48) mean something and
 * the hub never resolves a stranger's name. */
#include <arpa/inet.h>
#include <math.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hub/prove.h"
#include "kvasir/gguf.h"
#include "kvasir/link.h"
#include "kvasir/slice.h"

int kv_hub_addr_subnet(const char *addr, char *host, size_t hcap, char *subnet, size_t scap, kv_diag *d) {
    char h[64];
    uint16_t port = 0;
    if (kv_link_parse_addr(addr, h, sizeof h, &port, d)) return KV_EINVAL;
    unsigned char b[16];
    if (inet_pton(AF_INET, h, b) == 1) {
        snprintf(host, hcap, "%u.%u.%u.%u", b[0], b[1], b[2], b[3]);
        snprintf(subnet, scap, "%u.%u.%u.0/24", b[0], b[1], b[2]);
        return 0;
    }
    if (inet_pton(AF_INET6, h, b) == 1) {
        char t[INET6_ADDRSTRLEN];
        inet_ntop(AF_INET6, b, t, sizeof t);
        snprintf(host, hcap, "%s", t);
        snprintf(subnet, scap, "%02x%02x:%02x%02x:%02x%02x::/48", b[0], b[1], b[2], b[3], b[4], b[5]);
        return 0;
    }
    return kv_fail(d, KV_EINVAL, "address '%.80s' must be a numeric IP and a port (the hub resolves no names)", addr);
}

bool kv_hub_same_host(const char *a, const char *b) { return a[0] && !strcmp(a, b); }

bool kv_hub_same_host_addr(const char *host, const char *addr) {
    char h[48], sn[48];
    return !kv_hub_addr_subnet(addr, h, sizeof h, sn, sizeof sn, NULL) && kv_hub_same_host(host, h);
}

bool kv_hub_addr_loopback(const char *host) { return !strncmp(host, "127.", 4) || !strcmp(host, "::1"); }

void kv_hub_prove_input(float *x, uint32_t n) {
    /* Box-Muller over libsodium's CSPRNG: the node cannot predict it */
    for (uint32_t i = 0; i < n; i += 2) {
        uint32_t r[2];
        randombytes_buf(r, sizeof r);
        const double u1 = ((double)r[0] + 1.0) / 4294967297.0, u2 = (double)r[1] / 4294967296.0;
        const double m = sqrt(-2.0 * log(u1));
        x[i] = (float)(m * cos(6.283185307179586 * u2));
        if (i + 1 < n) x[i + 1] = (float)(m * sin(6.283185307179586 * u2));
    }
}

int kv_hub_prove_expect(int dir_fd, const kv_manifest *m, uint32_t slab, uint32_t expert, const float *x, float *y,
                        kv_diag *d) {
    if (slab >= m->n_slabs) return kv_fail(d, KV_ERANGE, "prove: slab %u out of range", slab);
    const kv_manifest_slab *s = &m->slabs[slab];
    if (expert < s->first || expert > s->last)
        return kv_fail(d, KV_ERANGE, "prove: expert %u is not in slab %u-%u", expert, s->first, s->last);
    char path[4200];
    if (snprintf(path, sizeof path, "/proc/self/fd/%d/%s", dir_fd, s->file.path) >= (int)sizeof path)
        return kv_fail(d, KV_EINVAL, "prove: slab path too long");
    kv_gguf *g = NULL;
    int rc = kv_gguf_open_file(&g, path, d); /* a slab is one file: never a split set's siblings */
    if (rc) return rc;
    kv_expert_weights w;
    uint32_t n_embd = 0, n_ff = 0;
    if (!(rc = kv_expert_find(g, s->layer, expert, &w, &n_embd, &n_ff, d))) {
        if (n_embd != m->n_embd) rc = kv_fail(d, KV_EFORMAT, "prove: slab %s has n_embd %u", s->file.path, n_embd);
        else rc = kv_expert_compute_one(&w, n_embd, n_ff, NULL, x, 1, y, d);
    }
    kv_gguf_close(g);
    return rc;
}

bool kv_hub_prove_judge(const float *want, const float *got, uint32_t n, double *err) {
    double mx = 0, e = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!isfinite(got[i])) {
            *err = INFINITY;
            return false;
        }
        mx = fmax(mx, fabs((double)want[i]));
        e = fmax(e, fabs((double)want[i] - (double)got[i]));
    }
    *err = mx > 0 ? e / mx : e;
    return *err <= KV_HUB_PROVE_TOL;
}
