/* kvasir inspect: the anatomy of a GGUF file (bytes by class, expert slabs,
 * types, per layer) and its quantization mix (general.file_type and the type
 * of every matrix role by block), read from its header only. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "kvasir/anatomy.h"
#include "kvasir/gguf.h"
#include "kvasir/quant.h"

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
            "a per-layer table, and the quantization mix: general.file_type (llama_ftype)\n"
            "and the type of each matrix (the name without blk.N.) by block range.\n"
            "A split model (NAME-00001-of-0000N.gguf ...) is measured\n"
            "whole from any of its parts, and its parts listed. A tensor of a type kvasir\n"
            "cannot compute is named on an 'unsupported' line. See docs/ANATOMY.md.\n"
            "\n"
            "  --json   print a JSON document instead of the tables\n");
}

/* llama_ftype names (llama.h), by value. */
static const char *ftype_name(uint32_t v) {
    static const char *const names[] = {
        [0] = "ALL_F32", [1] = "MOSTLY_F16", [2] = "MOSTLY_Q4_0", [3] = "MOSTLY_Q4_1", [7] = "MOSTLY_Q8_0",
        [8] = "MOSTLY_Q5_0", [9] = "MOSTLY_Q5_1", [10] = "MOSTLY_Q2_K", [11] = "MOSTLY_Q3_K_S",
        [12] = "MOSTLY_Q3_K_M", [13] = "MOSTLY_Q3_K_L", [14] = "MOSTLY_Q4_K_S", [15] = "MOSTLY_Q4_K_M",
        [16] = "MOSTLY_Q5_K_S", [17] = "MOSTLY_Q5_K_M", [18] = "MOSTLY_Q6_K", [19] = "MOSTLY_IQ2_XXS",
        [20] = "MOSTLY_IQ2_XS", [21] = "MOSTLY_Q2_K_S", [22] = "MOSTLY_IQ3_XS", [23] = "MOSTLY_IQ3_XXS",
        [24] = "MOSTLY_IQ1_S", [25] = "MOSTLY_IQ4_NL", [26] = "MOSTLY_IQ3_S", [27] = "MOSTLY_IQ3_M",
        [28] = "MOSTLY_IQ2_S", [29] = "MOSTLY_IQ2_M", [30] = "MOSTLY_IQ4_XS", [31] = "MOSTLY_IQ1_M",
        [32] = "MOSTLY_BF16", [36] = "MOSTLY_TQ1_0", [37] = "MOSTLY_TQ2_0", [38] = "MOSTLY_MXFP4_MOE",
    };
    return v < sizeof names / sizeof names[0] && names[v] ? names[v] : "unknown";
}

#define MIX_MAX_ROLES 64 /* distinct matrix names without blk.N. */
#define MIX_MAX_RUNS 12  /* block runs listed per role, then "..." */

typedef struct mix_role {
    char name[64];
    struct { uint32_t type; int32_t first, last; } run[MIX_MAX_RUNS];
    int n_run, more; /* runs kept; 1 if some were left out */
} mix_role;

/* The type of every matrix (2+ dims) by role and block runs: what a
 * quantization recipe decided. Header only. */
static void print_mix(const char *path, FILE *f) {
    kv_diag d = {0};
    kv_gguf *g = NULL;
    if (kv_gguf_open(&g, path, &d)) return; /* the anatomy already reported the file */
    uint32_t ft = 0;
    if (kv_gguf_find_kv(g, "general.file_type") && kv_gguf_get_u32(g, "general.file_type", &ft, &d) == 0)
        fprintf(f, "\nmix           %s (general.file_type %" PRIu32 ")\n", ftype_name(ft), ft);
    else
        fprintf(f, "\nmix           (no general.file_type)\n");
    static mix_role roles[MIX_MAX_ROLES];
    int n_roles = 0, dropped = 0;
    for (size_t i = 0; i < kv_gguf_n_tensors(g); i++) {
        const kv_gguf_tensor *t = kv_gguf_tensor_at(g, i);
        if (t->n_dims < 2) continue;
        char nm[256];
        const size_t len = t->name.len < sizeof nm - 1 ? t->name.len : sizeof nm - 1;
        memcpy(nm, t->name.ptr, len);
        nm[len] = 0;
        int32_t blk = -1;
        const char *role = nm;
        int used = 0;
        if (sscanf(nm, "blk.%" SCNd32 ".%n", &blk, &used) == 1 && used > 0) role = nm + used;
        mix_role *r = NULL;
        for (int k = 0; k < n_roles && !r; k++)
            if (!strcmp(roles[k].name, role)) r = &roles[k];
        if (!r) {
            if (n_roles == MIX_MAX_ROLES || strlen(role) >= sizeof r->name) {
                dropped++;
                continue;
            }
            r = &roles[n_roles++];
            memset(r, 0, sizeof *r);
            snprintf(r->name, sizeof r->name, "%s", role);
        }
        if (r->n_run && r->run[r->n_run - 1].type == t->type && r->run[r->n_run - 1].last + 1 == blk) {
            r->run[r->n_run - 1].last = blk;
        } else if (r->n_run < MIX_MAX_RUNS) {
            r->run[r->n_run].type = t->type;
            r->run[r->n_run].first = r->run[r->n_run].last = blk;
            r->n_run++;
        } else {
            r->more = 1;
        }
    }
    for (int k = 0; k < n_roles; k++) {
        const mix_role *r = &roles[k];
        fprintf(f, "  %-28s", r->name);
        for (int j = 0; j < r->n_run; j++) {
            const kv_type_info *ti = kv_type_get_ref(r->run[j].type);
            fprintf(f, "%s%s", j ? ", " : "", ti ? ti->name : "?");
            if (r->run[j].first >= 0 && r->run[j].first == r->run[j].last)
                fprintf(f, " (blk %" PRId32 ")", r->run[j].first);
            else if (r->run[j].first >= 0)
                fprintf(f, " (blk %" PRId32 "-%" PRId32 ")", r->run[j].first, r->run[j].last);
        }
        fprintf(f, "%s\n", r->more ? ", ..." : "");
    }
    if (dropped) fprintf(f, "  (%d more matrices of other roles not listed)\n", dropped);
    kv_gguf_close(g);
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
        print_mix(path, stdout);
    }
    kv_anatomy_free(an);
    if (!rc && fflush(stdout) != 0) rc = kv_cli_err(CMD, 2, "cannot write the report");
    return rc;
}
