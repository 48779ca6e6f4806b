/* libFuzzer target for the hub's body parsers: a node's announcement
 * (POST /v1/register) and a storage-challenge answer (POST /v1/challenge).
 *
 * Parses the input (an exact-size copy: a read past the end is an ASan
 * error) as both. An announcement that parses must satisfy the bounds
 * kv_hub_parse_announce promises (address HOST:PORT of the allowed bytes,
 * shards sorted without duplicates, last >= first), and must serialize
 * (kv_hub_announce_json) and parse back to the same structure. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/hub.h"
#include "fuzz_support.h"

static void same(const kv_hub_announce *a, const kv_hub_announce *b) {
    CHECK(!memcmp(a->nonce, b->nonce, 32) && !strcmp(a->addr, b->addr) && !strcmp(a->backend, b->backend));
    CHECK(a->memory == b->memory && a->n_shards == b->n_shards);
    for (size_t i = 0; i < a->n_shards; i++)
        CHECK(!memcmp(&a->shards[i], &b->shards[i], sizeof a->shards[i]));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *buf = fuzz_copy(data, size);
    kv_diag d = {0};
    kv_hub_announce a;
    int rc = kv_hub_parse_announce(&a, buf, size, &d);
    if (!rc) {
        size_t al = strlen(a.addr);
        CHECK(al > 2 && al <= KV_HUB_MAX_ADDR && strchr(a.addr, ':'));
        CHECK(strlen(a.backend) >= 1 && strlen(a.backend) <= KV_HUB_MAX_BACKEND);
        CHECK(!strpbrk(a.addr, "\"\\ ") && !strpbrk(a.backend, "\"\\ "));
        CHECK(a.n_shards <= KV_HUB_MAX_SHARDS_PER_NODE);
        for (size_t i = 0; i < a.n_shards; i++) {
            CHECK(a.shards[i].first <= a.shards[i].last);
            if (i) {
                const kv_hub_held *p = &a.shards[i - 1], *q = &a.shards[i];
                CHECK(p->layer < q->layer || (p->layer == q->layer && p->first < q->first));
            }
        }
        char *js = kv_hub_announce_json(&a);
        CHECK(js);
        kv_hub_announce b;
        CHECK(kv_hub_parse_announce(&b, js, strlen(js), &d) == 0);
        same(&a, &b);
        kv_hub_announce_free(&b);
        free(js);
        kv_hub_announce_free(&a);
    } else {
        CHECK(rc < 0 && d.msg[0] && a.shards == NULL && a.n_shards == 0);
    }
    uint8_t n[32], h[32];
    memset(&d, 0, sizeof d);
    rc = kv_hub_parse_answer(buf, size, n, h, &d);
    CHECK(rc == 0 || (rc < 0 && d.msg[0]));
    free(buf);
    return 0;
}
