/* kvasir inspect: the anatomy of a GGUF file (bytes by class, expert slabs,
 * types, per layer), read from its header only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "kvasir/anatomy.h"

#define CMD "inspect"

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvasir inspect F.gguf [--json]\n"
            "\n"
            "Shows what the bytes of a GGUF model are, from its header alone (no tensor\n"
            "data is read: instant on a 70 GB file, works on sparse skeletons):\n"
            "bytes and share per class (routed experts, shared experts, attention, linear\n"
            "attention, router, dense FFN, norms, embeddings, LM head, MTP, other), the\n"
            "expert slabs (MoE layers x experts) and bytes per expert, the types used, and\n"
            "a per-layer table. A split model (NAME-00001-of-0000N.gguf ...) is measured\n"
            "whole from any of its parts, and its parts listed. A tensor of a type kvasir\n"
            "cannot compute is named on an 'unsupported' line. See docs/ANATOMY.md.\n"
            "\n"
            "  --json   print a JSON document instead of the tables\n");
}

int kv_cmd_inspect(int argc, char **argv) {
    const char *path = NULL;
    int json = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (a[0] == '-' && a[1]) {
            return kv_cli_err(CMD, 1, "unknown option '%s' (see kvasir inspect --help)", a);
        } else if (path) {
            return kv_cli_err(CMD, 1, "one file at a time ('%s' and '%s' given)", path, a);
        } else {
            path = a;
        }
    }
    if (!path) return kv_cli_err(CMD, 1, "a GGUF file is required (see kvasir inspect --help)");

    kv_diag d = {0};
    kv_anatomy *an = NULL;
    if (kv_anatomy_open(&an, path, &d)) return kv_cli_diag(CMD, &d);
    int rc = 0;
    if (json) {
        char *s = kv_anatomy_to_json(an);
        if (!s) {
            rc = kv_cli_err(CMD, 2, "out of memory writing JSON");
        } else {
            printf("%s\n", s);
            free(s);
        }
    } else {
        printf("file          %s\n", path);
        kv_anatomy_print(an, stdout);
    }
    kv_anatomy_free(an);
    if (!rc && fflush(stdout) != 0) rc = kv_cli_err(CMD, 2, "cannot write the report");
    return rc;
}
