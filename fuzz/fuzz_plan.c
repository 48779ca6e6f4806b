/* libFuzzer target for the plan's placement reader (`kvasir plan` reads GET
 * /v1/placement from a hub: untrusted), against a fixed small manifest (2
 * MoE layers of 8 experts, top-2). Whatever opens must give figures that
 * hold together: min <= expected <= max messages, at least one and at most
 * top-k messages per MoE layer, the bytes from the frame sizes; a failure
 * must leave no plan and a message. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/dispatch_proto.h"
#include "kvasir/plan.h"

#define CHECK(x)                    \
    do {                            \
        if (!(x)) __builtin_trap(); \
    } while (0)

static kv_manifest *kv_fuzz_manifest(void) {
    static kv_manifest *m;
    if (m) return m;
    char buf[4096];
    int o = snprintf(buf, sizeof buf,
                     "{\"format\":\"kvasir-slices\",\"version\":1,\"model\":{\"id\":\"%064d\",\"name\":\"f\",\"architecture\":"
                     "\"qwen3moe\"},\"hparams\":{\"n_layer\":2,\"n_embd\":64,\"n_expert\":8,\"n_expert_used\":2,"
                     "\"n_ff_exp\":64},\"layers\":{\"first\":0,\"last\":1,\"moe\":[0,1]},\"sparse\":false,"
                     "\"backbone\":{\"path\":\"backbone.gguf\",\"size\":100,\"sha256\":\"%064d\"},\"slabs\":[", 0, 0);
    for (int L = 0; L < 2; L++)
        o += snprintf(buf + o, sizeof buf - (size_t)o,
                      "%s{\"path\":\"experts/blk.%d.0000-0007.gguf\",\"size\":100,\"sha256\":\"%064d\",\"layer\":%d,"
                      "\"first\":0,\"last\":7}", L ? "," : "", L, 0, L);
    snprintf(buf + o, sizeof buf - (size_t)o, "]}");
    kv_diag d = {0};
    CHECK(!kv_manifest_parse(&m, buf, strlen(buf), &d));
    return m;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const kv_manifest *m = kv_fuzz_manifest();
    char *buf = malloc(size ? size : 1);
    CHECK(buf);
    memcpy(buf, data, size);
    kv_plan *p = NULL;
    kv_diag d = {0};
    int rc = kv_plan_open(&p, m, buf, size, &d);
    if (!rc) {
        kv_plan_figures f;
        CHECK(!kv_plan_figures_get(p, KV_ENC_F32, &f, &d));
        CHECK(f.n_moe_layers == 2 && f.round_trips == 2 && f.expert_pairs == 4);
        if (!f.experts_missing) {
            CHECK(f.messages_min >= 2 && f.messages_min <= f.messages_max && f.messages_max <= 4);
            CHECK(f.messages_expected >= f.messages_min - 1e-9 && f.messages_expected <= f.messages_max + 1e-9);
            CHECK(f.bytes_min == f.messages_min * f.bytes_per_message + 4 * f.bytes_per_pair);
            CHECK(f.bytes_max <= 4 * f.bytes_per_message + 4 * f.bytes_per_pair);
        }
        for (uint32_t i = 0; i < kv_plan_n_nodes(p); i++) {
            const size_t kl = strlen(kv_plan_node_key(p, i));
            CHECK(kl == 0 || kl == 64);
        }
        kv_plan_free(p);
    } else {
        CHECK(rc < 0 && d.msg[0] && !p);
    }
    free(buf);
    return 0;
}
