/* kvasir tokenize: prints the token ids of a text as a JSON array, exactly
 * as llama.cpp's llama_tokenize(add_special = false) gives them. Special
 * token texts (e.g. <|im_start|>) become their ids unless --no-special. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "kvasir/gguf.h"
#include "kvasir/tok.h"

#define KV_TOKENIZE_MAX_INPUT (64u << 20) /* bytes read from -f */

static void kv_tokenize_usage(FILE *f) {
    fprintf(f,
            "usage: kvasir tokenize -m F.gguf [--no-special] [--] TEXT\n"
            "       kvasir tokenize -m F.gguf [--no-special] -f FILE   (FILE '-' reads stdin)\n\n"
            "Prints the token ids of TEXT as a JSON array, as llama.cpp's llama_tokenize\n"
            "gives them (no BOS is added). Special token texts such as <|im_start|> become\n"
            "their ids unless --no-special. Put TEXT after -- if it looks like an option.\n\n"
            "  -m, --model F.gguf   model whose tokenizer to use\n"
            "  --no-special         treat special token texts as plain text\n"
            "  -f, --file FILE      read the text from FILE instead of the command line\n"
            "  -h, --help           this help\n");
}

/* Reads a whole file (or stdin for "-"); returns 0 or 1/2 after printing. */
static int kv_read_input(const char *path, char **out, size_t *len) {
    FILE *f = strcmp(path, "-") ? fopen(path, "rb") : stdin;
    if (!f) return kv_cli_err("tokenize", 2, "cannot open '%s'", path);
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    int rc = 0;
    while (buf) {
        if (n == cap) {
            if (cap >= KV_TOKENIZE_MAX_INPUT) {
                rc = kv_cli_err("tokenize", 2, "'%s' is larger than %u bytes", path, KV_TOKENIZE_MAX_INPUT);
                break;
            }
            char *q = realloc(buf, cap * 2);
            if (!q) break;
            buf = q;
            cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0) {
            if (ferror(f)) rc = kv_cli_err("tokenize", 2, "cannot read '%s'", path);
            break;
        }
    }
    if (f != stdin) fclose(f);
    if (!buf) return kv_cli_err("tokenize", 2, "out of memory");
    if (rc) {
        free(buf);
        return rc;
    }
    *out = buf;
    *len = n;
    return 0;
}

/* "-x", "--word-word": an option we do not know. Anything else that starts
 * with '-' ("- item", "-5 degrees", "-") is taken as TEXT. */
static bool kv_looks_like_flag(const char *a) {
    if (a[0] != '-') return false;
    const char *p = a + 1 + (a[1] == '-');
    if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z'))) return false;
    for (; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '-'))
            return false;
    return true;
}

int kv_cmd_tokenize(int argc, char **argv) {
    const char *model = NULL, *text = NULL, *file = NULL;
    bool special = true;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            kv_tokenize_usage(stdout);
            return 0;
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            if (!(model = kv_arg_value("tokenize", argc, argv, &i, NULL))) return 1;
        } else if (!strcmp(a, "-f") || !strcmp(a, "--file")) {
            if (!(file = kv_arg_value("tokenize", argc, argv, &i, NULL))) return 1;
        } else if (!strcmp(a, "--no-special")) {
            special = false;
        } else if (!strcmp(a, "--")) {
            if (i + 1 < argc) text = argv[++i];
            if (i + 1 < argc) return kv_cli_err("tokenize", 1, "more than one TEXT given");
        } else if (kv_looks_like_flag(a)) {
            return kv_cli_err("tokenize", 1, "unknown option '%s' (put TEXT after --; try --help)", a);
        } else if (text) {
            return kv_cli_err("tokenize", 1, "more than one TEXT given (quote it)");
        } else {
            text = a;
        }
    }
    if (!model) return kv_cli_err("tokenize", 1, "missing -m F.gguf (try --help)");
    if (!text && !file) return kv_cli_err("tokenize", 1, "missing TEXT (try --help)");
    if (text && file) return kv_cli_err("tokenize", 1, "give TEXT or -f FILE, not both");

    char *buf = NULL;
    size_t len = 0;
    if (file) {
        int rc = kv_read_input(file, &buf, &len);
        if (rc) return rc;
        text = buf;
    } else {
        len = strlen(text);
    }

    kv_diag d = {0};
    kv_gguf *g = NULL;
    kv_tok *t = NULL;
    int32_t *ids = NULL;
    int ret = 2;
    if (kv_gguf_open(&g, model, &d) || kv_tok_load(&t, g, &d)) {
        ret = kv_cli_diag("tokenize", &d);
        goto done;
    }
    kv_gguf_close(g);
    g = NULL;
    /* usually fewer tokens than bytes; an invalid byte can give up to three
     * (U+FFFD), so retry once with the exact count */
    size_t n = 0, cap = len + 16;
    for (int pass = 0; pass < 2; pass++) {
        free(ids);
        ids = malloc(cap * sizeof *ids);
        if (!ids) {
            ret = kv_cli_err("tokenize", 2, "out of memory");
            goto done;
        }
        int rc = kv_tok_encode(t, text, len, special, ids, cap, &n, &d);
        if (rc == KV_ERANGE && pass == 0) {
            cap = n;
            continue;
        }
        if (rc) {
            ret = kv_cli_diag("tokenize", &d);
            goto done;
        }
        break;
    }
    putchar('[');
    for (size_t i = 0; i < n; i++) printf(i ? ",%d" : "%d", ids[i]);
    fputs("]\n", stdout);
    ret = fflush(stdout) ? kv_cli_err("tokenize", 2, "cannot write output") : 0;
done:
    free(ids);
    kv_tok_free(t);
    kv_gguf_close(g);
    free(buf);
    return ret;
}
