/* kvasir slice: cut a GGUF into a backbone, expert slabs and a manifest. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "kvasir/slice.h"

#define CMD "slice"

static const char *const kv_value_flags[] = {"--out", "-o", "--experts-per-slab", "--layers", "--threads", "-t", NULL};

static const char *kv_slice_help =
    "usage: kvasir slice F.gguf --out DIR [--experts-per-slab K] [--layers A-B]\n"
    "  --out DIR              output folder: DIR/backbone.gguf, DIR/experts/*.gguf, DIR/manifest.json\n"
    "  --experts-per-slab K   experts per slab file (default: all of a layer's)\n"
    "  --layers A-B           write slabs for layers A..B only (the manifest says so)\n"
    "  --threads N            files written in parallel (default: all CPUs)\n"
    "Tensor data is copied byte for byte; holes in a sparse source (a skeleton)\n"
    "stay holes, and its pieces get no SHA-256.\n";

int kv_cmd_slice(int argc, char **argv) {
    const char *src = NULL, *out = NULL;
    kv_slice_opts o = {0, -1, -1, 0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        long lv;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_slice_help, stdout);
            return 0;
        } else if (a[0] != '-') {
            if (src) return kv_cli_err(CMD, 1, "more than one input file ('%s' and '%s')", src, a);
            src = a;
        } else if (!(v = kv_arg_value(CMD, argc, argv, &i, kv_value_flags))) {
            return 1;
        } else if (!strcmp(a, "--out") || !strcmp(a, "-o")) {
            out = v;
        } else if (!strcmp(a, "--experts-per-slab")) {
            if (kv_arg_long(CMD, a, v, 1, KV_MAX_EXPERTS, &lv)) return 1;
            o.experts_per_slab = (uint32_t)lv;
        } else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) {
            if (kv_arg_long(CMD, a, v, 1, 64, &lv)) return 1;
            o.n_threads = (int)lv;
        } else if (!strcmp(a, "--layers")) {
            char *e;
            long x = strtol(v, &e, 10), y = x;
            if (e != v && *e == '-') y = strtol(e + 1, &e, 10);
            if (e == v || *e || x < 0 || y < x || y >= KV_MAX_LAYERS)
                return kv_cli_err(CMD, 1, "--layers wants A-B (or A) with 0 <= A <= B < %d, got '%s'", KV_MAX_LAYERS, v);
            o.layer_first = x;
            o.layer_last = y;
        } else {
            return kv_cli_err(CMD, 1, "unknown option '%s' (see kvasir slice --help)", a);
        }
    }
    if (!src) return kv_cli_err(CMD, 1, "missing the input F.gguf (see kvasir slice --help)");
    if (!out) return kv_cli_err(CMD, 1, "missing --out DIR");
    kv_diag d = {0};
    kv_slice_stats st;
    if (kv_slice_model(src, out, &o, &st, &d)) return kv_cli_diag(CMD, &d);
    const double mb = (double)st.bytes_logical / 1e6, cmb = (double)st.bytes_copied / 1e6;
    fprintf(stderr, "kvasir slice: %s -> %s: backbone + %u slabs (%u MoE layers), %.1f MB written in %.2f s", src, out,
            st.n_slabs, st.n_moe_layers, mb, st.seconds);
    if (st.sparse)
        fprintf(stderr, "; sparse source: %.1f MB copied, %.1f MB of holes kept as holes, no hashes (run it with "
                "--allow-sparse)\n", cmb,
                (double)st.bytes_holes / 1e6);
    else
        fprintf(stderr, " (%.0f MB/s, SHA-256 %s)\n", st.seconds > 0 ? cmb / st.seconds : 0.0, kv_sha256_backend());
    return 0;
}
