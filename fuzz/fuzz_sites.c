/* libFuzzer target for the two readers of the hub's GET /v1/sites: the
 * ring's (kv_ring_parse_sites: the window a ring node of a site takes, its
 * workers and its next node) and the plan's (kv_plan_sites_parse: sites,
 * round trips, the placement in force). Whatever parses must satisfy the
 * promised bounds: windows consecutive from layer 0 inside the layers over
 * known, distinct sites, addresses of the allowed characters and
 * NUL-terminated, round trips non-negative or unknown. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/plan.h"
#include "kvasir/ring.h"

#define CHECK(x)                    \
    do {                            \
        if (!(x)) __builtin_trap(); \
    } while (0)

static kv_ring_sites rs;

static void check_addr(const char *a, size_t cap) {
    const size_t al = strnlen(a, cap);
    CHECK(al < cap);
    for (size_t k = 0; k < al; k++) CHECK(strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-:[]", a[k]));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kv_diag d = {0};
    int rc = kv_ring_parse_sites((const char *)data, size, &rs, &d);
    if (rc) {
        CHECK(rc == KV_EFORMAT && !rs.placed && d.msg[0]);
    } else if (rs.placed) {
        uint32_t next = 0;
        CHECK(rs.n_win >= 1 && rs.n_win <= KV_RING_SITE_WINDOWS);
        for (uint32_t i = 0; i < rs.n_win; i++) {
            CHECK(rs.win[i].first == next && rs.win[i].last >= rs.win[i].first && rs.win[i].last < KV_RING_MAX_LAYERS);
            CHECK(rs.win[i].n_workers <= KV_RING_SITE_WORKERS);
            for (uint32_t k = 0; k < rs.win[i].n_workers; k++) check_addr(rs.win[i].workers[k], sizeof rs.win[i].workers[k]);
            check_addr(rs.win[i].ring, sizeof rs.win[i].ring);
            next = rs.win[i].last + 1;
        }
    }
    const uint32_t n_layer = size ? 1 + data[0] % 8 : 4;
    kv_plan_sites *ps = NULL;
    d = (kv_diag){0};
    rc = kv_plan_sites_parse((const char *)data, size, n_layer, &ps, &d);
    if (rc) {
        CHECK(ps == NULL && d.msg[0]);
        return 0;
    }
    CHECK(ps->n_site <= KV_PLAN_MAX_SITES);
    for (uint32_t i = 0; i < ps->n_site; i++) {
        CHECK(ps->name[i][0] && strnlen(ps->name[i], sizeof ps->name[i]) < sizeof ps->name[i]);
        CHECK(ps->rtt_ms[i] == -1 || ps->rtt_ms[i] >= 0);
        for (uint32_t j = 0; j < ps->n_site; j++) CHECK(ps->between_ms[i][j] == -1 || ps->between_ms[i][j] >= 0);
    }
    for (uint32_t k = 0; k < ps->n_node; k++) CHECK(ps->node_site[k] < ps->n_site);
    if (ps->placed) {
        uint32_t next = 0;
        bool used[KV_PLAN_MAX_SITES] = {0};
        for (uint32_t i = 0; i < ps->n_win; i++) {
            CHECK(ps->win[i].site < ps->n_site && !used[ps->win[i].site]);
            used[ps->win[i].site] = true;
            CHECK(ps->win[i].first == next && ps->win[i].last >= next);
            next = ps->win[i].last + 1;
        }
        CHECK(next == n_layer);
    }
    kv_plan_sites_free(ps);
    return 0;
}
