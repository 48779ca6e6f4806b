/* kvasir: one binary, git-style subcommands. */
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"

static const struct {
    const char *name;
    kv_cmd_fn fn;
    const char *summary;
} kv_cmds[] = {
    {"gen-model", kv_cmd_gen_model, "write a synthetic model (random weights, real BPE vocab)"},
    {"tokenize", kv_cmd_tokenize, "print the token ids of a text as a JSON array"},
    {"run", kv_cmd_run, "generate text from a prompt"},
    {"bench", kv_cmd_bench, "measure prefill and decode tokens/s"},
    {"inspect", kv_cmd_inspect, "show the anatomy of a GGUF file (bytes by class, expert slabs)"},
    {"gguf-split", kv_cmd_gguf_split, "rewrite a GGUF model as a split model (llama.cpp's gguf-split layout)"},
    {"slice", kv_cmd_slice, "cut a model into a backbone, expert slabs and a manifest"},
    {"expert", kv_cmd_expert, "compute one expert's FFN for given hidden states"},
    {"worker", kv_cmd_worker, "serve expert computation for held slabs over TCP"},
    {"xcheck", kv_cmd_xcheck, "compare sampled experts across every backend this machine runs"},
    {"key", kv_cmd_key, "print (creating if absent) a coordinator key's public half"},
    {"hub", kv_cmd_hub, "serve a model's pieces, the node registry and the coverage market"},
    {"market", kv_cmd_market, "print a hub's coverage market (scarcest shards first)"},
    {"node", kv_cmd_node, "join a hub's swarm: hold, verify and serve the shards its market needs"},
    {"wallet", kv_cmd_wallet, "make a KVR key, show its account, sign a payment authorization"},
    {"ledger", kv_cmd_ledger, "KVR ledger: init, issue, balance, statement, check"},
    {"gateway", kv_cmd_gateway, "serve a model over the OpenAI, Anthropic and Ollama HTTP APIs"},
    {"swarm", kv_cmd_swarm, "bring a local swarm (hub, nodes, gateway) up, show its status, bring it down"},
    {"plan", kv_cmd_plan, "print a hub's placement and the expected bytes and round trips per token"},
    {"ring", kv_cmd_ring, "serve a layer window as a node of a ring (pipeline, no master)"},
};

static void kv_usage(FILE *f) {
    fprintf(f, "usage: kvasir <command> [options]   (kvasir <command> --help for its options)\n\n"
               "Kvasir runs Mixture-of-Experts language models from GGUF files.\n\ncommands:\n");
    for (size_t i = 0; i < sizeof kv_cmds / sizeof kv_cmds[0]; i++)
        fprintf(f, "  %-10s %s\n", kv_cmds[i].name, kv_cmds[i].summary);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        kv_usage(stderr);
        return 1;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        kv_usage(stdout);
        return 0;
    }
    for (size_t i = 0; i < sizeof kv_cmds / sizeof kv_cmds[0]; i++)
        if (!strcmp(argv[1], kv_cmds[i].name)) return kv_cmds[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "kvasir: unknown command '%s' (try kvasir --help)\n", argv[1]);
    return 1;
}
