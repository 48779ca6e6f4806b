/* kvasir gguf-split: rewrite a GGUF model as a split model (the layout
 * llama.cpp's gguf-split writes and every loader reads), by part count or
 * maximum part size. The work is kv_gguf_split_write. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "kvasir/gguf.h"

#define CMD "gguf-split"
#define KV_SPLIT_SIZE_MAX (UINT64_C(1) << 50) /* 1 PiB: any larger is a typo */

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvasir gguf-split (--split N | --split-max-size SIZE) IN.gguf OUT_PREFIX\n"
            "\n"
            "Writes the model IN.gguf (one file, or any part of a split model) as the split\n"
            "model OUT_PREFIX-00001-of-0000N.gguf ... OUT_PREFIX-0000N-of-0000N.gguf, as\n"
            "llama.cpp's gguf-split does: tensors in order, cut into consecutive runs; the\n"
            "first part holds all metadata; every part split.no, split.count and\n"
            "split.tensors.count. Every kvasir command (and llama.cpp) given one part loads\n"
            "the whole model. See docs/ANATOMY.md, \"Split files\".\n"
            "\n"
            "  --split N              N parts of about equal bytes (2..%u, at most one per tensor)\n"
            "  --split-max-size SIZE  parts of at most SIZE bytes of tensor data (suffix K, M or G:\n"
            "                         powers of 1000 as in llama.cpp's tool); a larger tensor gets\n"
            "                         a part of its own\n",
            KV_GGUF_MAX_SPLITS);
}

/* "123", "100K", "2M", "1G" -> bytes (decimal units, as gguf-split). */
static int parse_size(const char *s, uint64_t *out) {
    errno = 0;
    char *e;
    const unsigned long long v = strtoull(s, &e, 10);
    if (errno || e == s || *s == '-') return -1;
    uint64_t mul = 1;
    if (*e == 'K' || *e == 'k') mul = 1000, e++;
    else if (*e == 'M' || *e == 'm') mul = 1000000, e++;
    else if (*e == 'G' || *e == 'g') mul = 1000000000, e++;
    if (*e || v == 0 || v > KV_SPLIT_SIZE_MAX / mul) return -1;
    *out = (uint64_t)v * mul;
    return 0;
}

int kv_cmd_gguf_split(int argc, char **argv) {
    const char *in = NULL, *out = NULL;
    uint32_t n_split = 0;
    uint64_t max_bytes = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--split") || !strcmp(a, "--split-max-size")) {
            if (i + 1 >= argc) return kv_cli_err(CMD, 1, "%s needs a value", a);
            const char *v = argv[++i];
            if (a[7] == 0) {
                char *e;
                errno = 0;
                const unsigned long n = strtoul(v, &e, 10);
                if (errno || e == v || *e || *v == '-' || n < 2 || n > KV_GGUF_MAX_SPLITS)
                    return kv_cli_err(CMD, 1, "--split '%s': give a part count in 2..%u", v, KV_GGUF_MAX_SPLITS);
                n_split = (uint32_t)n;
            } else if (parse_size(v, &max_bytes)) {
                return kv_cli_err(CMD, 1, "--split-max-size '%s': give bytes > 0, optionally with K, M or G", v);
            }
        } else if (a[0] == '-' && a[1]) {
            return kv_cli_err(CMD, 1, "unknown option '%s' (see kvasir gguf-split --help)", a);
        } else if (!in) {
            in = a;
        } else if (!out) {
            out = a;
        } else {
            return kv_cli_err(CMD, 1, "unexpected argument '%s' (see kvasir gguf-split --help)", a);
        }
    }
    if (!in || !out) return kv_cli_err(CMD, 1, "an input file and an output prefix are required (see --help)");
    if (!n_split == !max_bytes) return kv_cli_err(CMD, 1, "give one of --split N and --split-max-size SIZE");
    kv_diag d = {0};
    uint32_t n = 0;
    if (kv_gguf_split_write(in, out, n_split, max_bytes, &n, &d)) return kv_cli_diag(CMD, &d);
    printf("gguf-split: wrote %s-00001-of-%05u.gguf .. %s-%05u-of-%05u.gguf (%u parts)\n", out, n, out, n, n, n);
    return 0;
}
