/* Test support for the engine tests that run two small generated models
 * side by side (tests/test_prefix_cache.c, tests/test_spec_engine.c): a
 * qwen3moe Q8_0 model (no recurrent state) and a qwen35moe F32 one (delta
 * net + gated attention), n_ctx 512, written into a temp folder and loaded.
 * Each test picks its own weight seeds and whether qwen35moe carries an MTP
 * block. Header-only (static functions): include it once per test
 * executable, after kvtest.h; g_dir and g_fx are the test's globals. */
#ifndef KVASIR_TEST_ENGINE_FIXTURE_H
#define KVASIR_TEST_ENGINE_FIXTURE_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/gen.h"
#include "kvasir/model.h"
#include "kvasir/quant.h"
#include "kvtest.h"

static char g_dir[200]; /* temp folder holding the models */

typedef struct fixture {
    char model[300]; /* g_dir/<arch>.gguf */
    kv_model *m;
    uint32_t n_vocab;
} fixture;
static fixture g_fx[2]; /* qwen3moe, qwen35moe */

/* Writes and loads the model of arch ("qwen3moe" or "qwen35moe") with
 * weights from seed (qwen35moe with n_nextn MTP blocks); false with a line
 * on stderr on failure. */
static bool fixture_make(fixture *f, const char *arch, uint64_t seed, uint32_t n_nextn) {
    kv_diag d = {0};
    kv_gen_config c;
    if (!strcmp(arch, "qwen3moe")) {
        if (kv_gen_preset_get("tiny", &c, &d)) return false;
        c.n_layer = 3; c.n_embd = 64; c.n_ff_exp = 32; c.n_expert = 8; c.n_expert_used = 3;
        c.n_head = 4; c.n_head_kv = 2; c.head_dim = 16; c.n_vocab = 400; c.type = KV_TYPE_Q8_0;
        c.seed = seed;
    } else {
        c = (kv_gen_config){.arch = "qwen35moe", .n_layer = 4, .n_embd = 64, .n_ff_exp = 32, .n_expert = 8,
                            .n_expert_used = 2, .n_head = 4, .n_head_kv = 2, .head_dim = 16, .n_vocab = 400,
                            .type = KV_TYPE_F32, .seed = seed, .full_attn_interval = 2,
                            .ssm_d_state = 16, .ssm_n_group = 2, .ssm_dt_rank = 4, .n_rot = 8,
                            .rope_sections = {2, 1, 1, 0}, .n_nextn = n_nextn, .n_ff_shexp = 32};
        kv_gen_fill_defaults(&c);
    }
    c.n_ctx = 512;
    c.n_threads = 1;
    c.log = NULL;
    snprintf(f->model, sizeof f->model, "%s/%s.gguf", g_dir, arch);
    if (kv_gen_model(&c, f->model, &d) || kv_model_load(&f->m, f->model, &d)) {
        fprintf(stderr, "fixture %s: %s\n", arch, d.msg);
        return false;
    }
    f->n_vocab = kv_model_hparams(f->m)->n_vocab;
    return true;
}

/* The kvt setup: makes g_dir from dir_template (mkdtemp) and both models;
 * 0 on success. */
static int fixtures_open(const char *dir_template, uint64_t seed3, uint64_t seed35, uint32_t n_nextn) {
    snprintf(g_dir, sizeof g_dir, "%s", dir_template);
    if (!mkdtemp(g_dir)) return 1;
    return !fixture_make(&g_fx[0], "qwen3moe", seed3, 0) || !fixture_make(&g_fx[1], "qwen35moe", seed35, n_nextn);
}

/* The kvt teardown: frees the models; removes g_dir unless a check failed
 * (its files are then left to look at). */
static void fixtures_close(void) {
    for (int i = 0; i < 2; i++) kv_model_free(g_fx[i].m);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (!kvt_failures) (void)!system(cmd);
}

#endif
