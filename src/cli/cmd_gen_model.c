/* kvasir gen-model: write a synthetic model (random weights of sane scale,
 * real BPE vocabulary). Flags are applied over a preset (the default preset
 * first, then --preset, then each size flag), validated by the library, and
 * every bad value is reported on one line with exit status 1. */
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "cli/cli.h"
#include "kvasir/anatomy.h"
#include "kvasir/gen.h"
#include "kvasir/pool.h"
#include "kvasir/quant.h"

#define CMD "gen-model"

static void usage(FILE *f) {
    size_t n;
    const kv_gen_preset *p = kv_gen_presets(&n);
    fprintf(f,
            "usage: kvasir gen-model --arch qwen3moe --out F.gguf [--preset NAME] [--layers N]\n"
            "         [--embd N] [--ff-exp N] [--experts N] [--experts-used N] [--heads N]\n"
            "         [--kv-heads N] [--head-dim N] [--vocab N] [--ctx N]\n"
            "         [--type f32|f16|bf16|q8_0|q4_0|q4_1|q5_0|q5_1|iq4_nl|mxfp4|q2_k|q3_k|q4_k|q4_k_m|q5_k|q6_k|iq4_xs]\n"
            "         [--mix q2_k|q3_k_m|q4_k_m|iq4_xs] [--seed S] [--tied|--untied]\n"
            "         [--threads N] [--router-skew S]\n"
            "       qwen35moe also: [--ff-shexp N] [--attn-interval N] [--ssm-conv N] [--ssm-state N]\n"
            "         [--ssm-groups N] [--ssm-heads N] [--rope-dim N] [--rope-sections a,b,c,d] [--nextn 0|1]\n"
            "       deepseek2 also: [--rope-dim N] [--q-lora N] [--kv-lora N] [--head-dim-v N] [--ff N]\n"
            "         [--dense-layers N] [--shared-experts N] [--expert-groups N] [--groups-used N]\n"
            "         [--expert-scale F] [--yarn-factor F] [--yarn-orig-ctx N]\n"
            "       gpt-oss also: [--swa N] [--swa-pattern N] [--yarn-factor F] [--yarn-orig-ctx N]\n"
            "\n"
            "Writes a synthetic Mixture-of-Experts model loadable by llama.cpp: deterministic\n"
            "random weights (same flags and seed, same bytes), a byte-level BPE vocabulary\n"
            "learned from the bundled corpus with special tokens <|endoftext|>, <|im_start|>,\n"
            "<|im_end|>, and a ChatML chat template.\n"
            "\n"
            "  --arch A         architecture: qwen3moe (the default) or qwen35moe (gated delta net\n"
            "                   + gated full attention every --attn-interval blocks (default 4),\n"
            "                   shared expert (--ff-shexp, default ff-exp), delta-net heads\n"
            "                   --ssm-groups key / --ssm-heads value of --ssm-state dims (defaults\n"
            "                   2 / 4 / head-dim), conv --ssm-conv (4), partial rotary --rope-dim\n"
            "                   (head-dim/4) in --rope-sections (t,h,w split of rope-dim/2),\n"
            "                   --nextn MTP blocks (0)), or deepseek2 (MLA: --head-dim is the query head\n"
            "                   (qk_nope + --rope-dim, default head-dim/3), the cache keeps the\n"
            "                   --kv-lora latent (embd/4) and the rope part; queries through\n"
            "                   --q-lora (2*embd/3); values of --head-dim-v (head-dim - rope-dim);\n"
            "                   --dense-layers leading blocks with a dense FFN of --ff (4*ff-exp);\n"
            "                   --shared-experts (1) of ff-exp; sigmoid routing with a selection\n"
            "                   bias in --expert-groups (none) of which --groups-used (half) are\n"
            "                   chosen, weights renormalized and scaled by --expert-scale (2.5);\n"
            "                   --yarn-factor F (0: none) over --yarn-orig-ctx (ctx/4); --kv-heads\n"
            "                   is ignored (one latent KV head)), or gpt-oss (biases on q/k/v/o,\n"
            "                   the router and the experts; attention sinks; a sliding window of\n"
            "                   --swa positions (8) in the blocks il %% --swa-pattern < pattern-1\n"
            "                   (2: even blocks); top-k then softmax routing; clamped SwiGLU; YaRN\n"
            "                   with --yarn-factor F over --yarn-orig-ctx (ctx/4);\n"
            "                   always --untied)\n"
            "  --out F          output file (written as F.part, then renamed)\n"
            "  --preset NAME    starting sizes (default %s); the flags below override them\n"
            "  --layers N       blocks                            (1..%u)\n"
            "  --embd N         hidden size                       (1..%u)\n"
            "  --ff-exp N       hidden size of one expert         (1..%u)\n"
            "  --experts N      routed experts per layer          (1..%u)\n"
            "  --experts-used N experts per token (top-k)         (1..experts)\n"
            "  --heads N        query heads                       (1..%u)\n"
            "  --kv-heads N     key/value heads, divides heads\n"
            "  --head-dim N     per-head size, even               (2..%u)\n"
            "  --vocab N        vocabulary size                   (%u..%u)\n"
            "  --ctx N          context length in the metadata    (1..%u)\n"
            "  --type T         type of the embedding, attention, expert and output matrices\n"
            "                   (also q4_1, q5_0, q5_1, iq4_nl, mxfp4: ggml's 32-value blocks)\n"
            "                   (norms and router stay f32); a matrix whose rows do not fit\n"
            "                   the type's block falls back to q8_0 (k-quants) or f16, with a note;\n"
            "                   q4_k_m: q4_k with ffn_down*, attn_v and output in q6_k (a simple mix;\n"
            "                   --mix q4_k_m is llama-quantize's own)\n"
            "  --mix M          llama-quantize's recipe for file type M (q2_k, q3_k_m, q4_k_m,\n"
            "                   iq4_xs): which matrix gets which type (attn_v, attn_k, attn_output,\n"
            "                   ffn_down by layer, output, token_embd), as in the files people\n"
            "                   download; replaces --type; `kvasir inspect` lists the result\n"
            "  --seed S         weights seed (default 42)\n"
            "  --router-skew S  hot experts, as in real routers (default 0: all alike): in each\n"
            "                   layer the router row of the expert ranked r by a seeded shuffle\n"
            "                   has its spread scaled by 1 + S/(1+r), so it wins top-k more\n"
            "                   often; S in [0, 16]; 0 writes the same bytes as before\n"
            "  --threads N      threads drawing and quantizing (default: all CPUs; the\n"
            "                   file is the same for any N)\n"
            "  --tied           no output.weight: the LM head reuses token_embd\n"
            "  --untied         separate output.weight (default)\n"
            "\npresets:\n",
            p[0].name, KV_GEN_MAX_LAYER, KV_GEN_MAX_EMBD, KV_GEN_MAX_FF, KV_GEN_MAX_EXPERT,
            KV_GEN_MAX_HEAD, KV_GEN_MAX_HEAD_DIM, KV_GEN_MIN_VOCAB, 1u << 22, KV_GEN_MAX_CTX);
    for (size_t i = 0; i < n; i++) fprintf(f, "  %-20s %s\n", p[i].name, p[i].summary);
    const kv_skeleton_preset *s = kv_skeleton_presets(&n);
    fprintf(f, "\nskeleton presets (with --skeleton --out F.gguf: the real model's header, Q4_K_M\n"
               "types; real embeddings, norms and routers, every other tensor a hole; see\n"
               "docs/ANATOMY.md):\n");
    for (size_t i = 0; i < n; i++) fprintf(f, "  %-20s %s\n", s[i].name, s[i].summary);
}

/* --skeleton: the header of a real model, data holes but for the small tensors (anatomy.h). */
static int gen_skeleton(int argc, char **argv, const char *preset) {
    const char *out = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--preset") || !strcmp(argv[i], "--skeleton")) {
            i += !strcmp(argv[i], "--preset");
        } else if (!strcmp(argv[i], "--out") || !strcmp(argv[i], "-o")) {
            if (!(out = kv_arg_value(CMD, argc, argv, &i, NULL))) return 1;
            if (!*out) return kv_cli_err(CMD, 1, "--out: empty path");
        } else {
            return kv_cli_err(CMD, 1, "--skeleton takes only --preset and --out ('%s' given)", argv[i]);
        }
    }
    if (!kv_skeleton_has(preset))
        return kv_cli_err(CMD, 1, "--skeleton: '%s' is not a skeleton preset (qwen35-122b-a10b, "
                                  "qwen35-35b-a3b, qwen3-30b-a3b, deepseek-v3, kimi-k2)", preset);
    if (!out) return kv_cli_err(CMD, 1, "--out is required (see kvasir gen-model --help)");
    kv_diag d = {0};
    if (kv_skeleton_write(preset, out, stderr, &d)) return kv_cli_diag(CMD, &d);
    return 0;
}

static int parse_type(const char *s, uint32_t *out) {
    static const char *const ok[] = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k",
                                     "q4_1", "q5_0", "q5_1", "iq4_nl", "mxfp4", "q2_k", "q3_k", "iq4_xs"};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++)
        if (strcasecmp(s, ok[i]) == 0) {
            *out = (uint32_t)kv_type_from_name(ok[i]);
            return 0;
        }
    return kv_cli_err(CMD, 1, "--type: '%s' is not one of f32, f16, bf16, q8_0, q4_0, q4_k, q4_k_m, q5_k, q6_k, "
                              "q4_1, q5_0, q5_1, iq4_nl, mxfp4, q2_k, q3_k, iq4_xs", s);
}

int kv_cmd_gen_model(int argc, char **argv) {
    kv_gen_config cfg;
    kv_diag d = {0};
    size_t np;
    const char *preset = kv_gen_presets(&np)[0].name, *out = NULL;
    int skeleton = 0;

    /* pass 1: help and preset, so size flags override the preset wherever
     * they appear */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(argv[i], "--preset")) {
            if (!(preset = kv_arg_value(CMD, argc, argv, &i, NULL))) return 1;
        }
        if (!strcmp(argv[i], "--skeleton")) skeleton = 1;
    }
    if (skeleton) return gen_skeleton(argc, argv, preset);
    if (kv_skeleton_has(preset))
        return kv_cli_err(CMD, 1, "--preset %s is a skeleton preset: add --skeleton", preset);
    if (kv_gen_preset_get(preset, &cfg, &d)) return kv_cli_err(CMD, 1, "--preset: %s", d.msg);
    cfg.log = stderr;

    /* pass 2: everything else */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        long n;
        struct {
            const char *flag;
            uint32_t *dst;
            long lo, hi;
        } nums[] = {
            {"--layers", &cfg.n_layer, 1, KV_GEN_MAX_LAYER},
            {"--embd", &cfg.n_embd, 1, KV_GEN_MAX_EMBD},
            {"--ff-exp", &cfg.n_ff_exp, 1, KV_GEN_MAX_FF},
            {"--experts", &cfg.n_expert, 1, KV_GEN_MAX_EXPERT},
            {"--experts-used", &cfg.n_expert_used, 1, KV_GEN_MAX_EXPERT},
            {"--heads", &cfg.n_head, 1, KV_GEN_MAX_HEAD},
            {"--kv-heads", &cfg.n_head_kv, 1, KV_GEN_MAX_HEAD},
            {"--head-dim", &cfg.head_dim, 2, KV_GEN_MAX_HEAD_DIM},
            {"--vocab", &cfg.n_vocab, KV_GEN_MIN_VOCAB, 1L << 22},
            {"--ctx", &cfg.n_ctx, 1, KV_GEN_MAX_CTX},
            {"--ff-shexp", &cfg.n_ff_shexp, 1, KV_GEN_MAX_FF},
            {"--attn-interval", &cfg.full_attn_interval, 1, KV_GEN_MAX_LAYER},
            {"--ssm-conv", &cfg.ssm_d_conv, 2, 64},
            {"--ssm-state", &cfg.ssm_d_state, 1, KV_GEN_MAX_HEAD_DIM},
            {"--ssm-groups", &cfg.ssm_n_group, 1, KV_GEN_MAX_HEAD},
            {"--ssm-heads", &cfg.ssm_dt_rank, 1, KV_GEN_MAX_HEAD},
            {"--rope-dim", &cfg.n_rot, 2, KV_GEN_MAX_HEAD_DIM},
            {"--nextn", &cfg.n_nextn, 0, 1},
            /* deepseek2's sizes */
            {"--q-lora", &cfg.q_lora_rank, 1, KV_GEN_MAX_EMBD},
            {"--kv-lora", &cfg.kv_lora_rank, 1, KV_GEN_MAX_HEAD_DIM},
            {"--head-dim-v", &cfg.head_dim_v, 1, KV_GEN_MAX_HEAD_DIM},
            {"--ff", &cfg.n_ff, 1, KV_GEN_MAX_FF},
            {"--dense-layers", &cfg.n_dense_lead, 0, KV_GEN_MAX_LAYER},
            {"--shared-experts", &cfg.n_expert_shared, 1, 64},
            {"--expert-groups", &cfg.n_expert_groups, 0, KV_GEN_MAX_EXPERT},
            {"--groups-used", &cfg.n_group_used, 1, KV_GEN_MAX_EXPERT},
            {"--yarn-orig-ctx", &cfg.yarn_orig_ctx, 1, KV_GEN_MAX_CTX},
            {"--swa", &cfg.n_swa, 1, KV_GEN_MAX_CTX},             /* gpt-oss */
            {"--swa-pattern", &cfg.swa_pattern, 1, KV_GEN_MAX_LAYER},
        };
        int matched = 0;
        for (size_t k = 0; k < sizeof nums / sizeof nums[0]; k++) {
            if (strcmp(a, nums[k].flag)) continue;
            matched = 1;
            if (!(v = kv_arg_value(CMD, argc, argv, &i, NULL))) return 1;
            if (kv_arg_long(CMD, a, v, nums[k].lo, nums[k].hi, &n)) return 1;
            *nums[k].dst = (uint32_t)n;
        }
        if (matched) continue;
        if (!strcmp(a, "--expert-scale") || !strcmp(a, "--yarn-factor")) {
            if (!(v = kv_arg_value(CMD, argc, argv, &i, NULL))) return 1;
            const bool scale = !strcmp(a, "--expert-scale");
            if (kv_arg_float(CMD, a, v, scale ? 0.001 : 0.0, scale ? 100.0 : 1024.0,
                             scale ? &cfg.expert_weights_scale : &cfg.yarn_factor))
                return 1;
            continue;
        }
        if (!strcmp(a, "--preset")) {
            i++; /* handled in pass 1 */
        } else if (!strcmp(a, "--arch")) {
            if (!(v = kv_arg_value(CMD, argc, argv, &i, NULL))) return 1;
            if (strcmp(v, "qwen3moe") && strcmp(v, "qwen35moe") && strcmp(v, "deepseek2") && strcmp(v, "gpt-oss"))
                return kv_cli_err(CMD, 1, "--arch: unknown architecture '%s' (supported: qwen3moe, qwen35moe, "
                                  "deepseek2, gpt-oss)", v);
            cfg.arch = v;
        } else if (!strcmp(a, "--rope-sections")) {
            if (!(v = kv_arg_value(CMD, argc, argv, &i, NULL))) return 1;
            int32_t sec[4] = {0};
            int k = 0, used = 0;
            if (sscanf(v, "%d,%d,%d,%d%n", &sec[0], &sec[1], &sec[2], &sec[3], &used) != 4 || v[used] != 0)
                return kv_cli_err(CMD, 1, "--rope-sections: '%s' is not four integers a,b,c,d", v);
            for (k = 0; k < 4; k++) {
                if (sec[k] < 0 || sec[k] > (int32_t)KV_GEN_MAX_HEAD_DIM)
                    return kv_cli_err(CMD, 1, "--rope-sections: %d out of range", sec[k]);
                cfg.rope_sections[k] = sec[k];
            }
        } else if (!strcmp(a, "--out") || !strcmp(a, "-o")) {
            if (!(out = kv_arg_value(CMD, argc, argv, &i, NULL))) return 1;
            if (!*out) return kv_cli_err(CMD, 1, "--out: empty path");
        } else if (!strcmp(a, "--type")) {
            if (!(v = kv_arg_value(CMD, argc, argv, &i, NULL))) return 1;
            cfg.q6_mix = !strcasecmp(v, "q4_k_m");
            cfg.mix = KV_GEN_MIX_NONE;
            if (parse_type(cfg.q6_mix ? "q4_k" : v, &cfg.type)) return 1;
        } else if (!strcmp(a, "--mix")) {
            if (!(v = kv_arg_value(CMD, argc, argv, &i, NULL))) return 1;
            const int m = kv_gen_mix_from_name(v);
            if (m < 0) return kv_cli_err(CMD, 1, "--mix: '%s' is not one of q2_k, q3_k_m, q4_k_m, iq4_xs", v);
            cfg.mix = (uint32_t)m;
            cfg.q6_mix = false;
            cfg.type = KV_TYPE_F16; /* not used: the mix gives every matrix its type */
        } else if (!strcmp(a, "--seed")) {
            if (!(v = kv_arg_value(CMD, argc, argv, &i, NULL))) return 1;
            if (kv_arg_u64(CMD, a, v, &cfg.seed)) return 1;
        } else if (!strcmp(a, "--router-skew")) {
            if (!(v = kv_arg_value(CMD, argc, argv, &i, NULL))) return 1;
            if (kv_arg_float(CMD, a, v, 0.0, KV_GEN_MAX_ROUTER_SKEW, &cfg.router_skew)) return 1;
        } else if (!strcmp(a, "--threads")) {
            if (!(v = kv_arg_value(CMD, argc, argv, &i, NULL))) return 1;
            if (kv_arg_long(CMD, a, v, 1, KV_POOL_MAX_THREADS, &n)) return 1;
            cfg.n_threads = (int)n;
        } else if (!strcmp(a, "--tied")) {
            cfg.tied = true;
        } else if (!strcmp(a, "--untied")) {
            cfg.tied = false;
        } else {
            return kv_cli_err(CMD, 1, "unknown option '%s' (see kvasir gen-model --help)", a);
        }
    }
    if (!out) return kv_cli_err(CMD, 1, "--out is required (see kvasir gen-model --help)");
    kv_gen_fill_defaults(&cfg);
    if (kv_gen_validate(&cfg, &d)) return kv_cli_err(CMD, 1, "%s", d.msg);
    char name[96];
    snprintf(name, sizeof name, "kvasir-synthetic-%s", preset);
    cfg.name = name;
    int rc = kv_gen_model(&cfg, out, &d);
    if (rc) return kv_cli_diag(CMD, &d);
    fprintf(stderr,
            "gen-model: wrote %s: %s, %u layers, embd %u, %u experts (top-%u) of %u, "
            "%u/%u heads x %u, vocab %u, %s%s, seed %llu\n",
            out, cfg.arch, cfg.n_layer, cfg.n_embd, cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_head,
            cfg.n_head_kv, cfg.head_dim, cfg.n_vocab,
            cfg.mix ? kv_gen_mix_name(cfg.mix) : kv_type_get_ref(cfg.type)->name,
            cfg.tied ? ", tied" : "", (unsigned long long)cfg.seed);
    return 0;
}
