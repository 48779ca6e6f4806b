/* kv-test-labels: oracle attack
 *
 * Chat templates rendered by src/chat/ against the reference Jinja
 * implementation of the Hugging Face ecosystem (@huggingface/jinja, pinned in
 * tests/oracle/package.json), byte for byte, on real models' templates.
 *
 * The templates come from the llama.cpp source that the test-only
 * node-llama-cpp package bundles (llama/gitRelease.bundle, a git bundle):
 * models/templates/<name>.jinja, read at test time with git, not copied
 * into this repository. The conversations (system prompts, multi-turn,
 * parallel tool calls with object arguments, tool results, reasoning both as
 * reasoning_content and inline <think>, enable_thinking off, non-ASCII text,
 * an empty conversation that makes templates raise) are in
 * tests/data/templates/conversations.json; tools are added where a
 * conversation asks for them. Every (template, conversation) pair is
 * rendered by tests/oracle/chat_render.mjs in one node process, then here;
 *   - where the reference renders, kv_chat_render must give the same bytes;
 *   - where it fails, kv_chat_render must fail too, and a raise_exception
 *     must carry the same message (KV_EINVAL).
 * The required templates (Qwen3, Qwen3.5, DeepSeek-V3.1, gpt-oss, Llama 3.1,
 * GLM-4.6 and 4.7, Kimi K2) must also render most conversations in the
 * reference, so the comparison is not vacuous. With KV_ATTACK_FULL=1 every
 * template in the bundle is compared, not only the required ones.
 *
 * Needs node and tests/oracle/node_modules (make oracle) and git. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvasir/chat.h"
#include "kvtest.h"

static const char *k_required[] = {
    "Qwen-Qwen3-0.6B",   "Qwen3.5-4B",          "Qwen3-Coder",        "deepseek-ai-DeepSeek-V3.1",
    "openai-gpt-oss-120b", "meta-llama-Llama-3.1-8B-Instruct", "GLM-4.6", "GLM-4.7-Flash",
    "Kimi-K2-Instruct",  "moonshotai-Kimi-K2",  "Kimi-K2-Thinking",   NULL};

#define NOW_UNIX 1767225600 /* 2026-01-01 00:00 UTC: strftime_now's fixed clock */

static char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = malloc((size_t)n + 1);
    if (p && fread(p, 1, (size_t)n, f) != (size_t)n) {
        free(p);
        p = NULL;
    }
    fclose(f);
    if (p) p[n] = 0;
    if (len) *len = (size_t)n;
    return p;
}

static void show_diff(const char *name, const char *conv, const char *want, size_t wn, const char *got, size_t gn) {
    size_t i = 0;
    while (i < wn && i < gn && want[i] == got[i]) i++;
    size_t from = i > 60 ? i - 60 : 0;
    fprintf(stderr, "  %s / %s: first difference at byte %zu (reference %zu bytes, ours %zu)\n", name, conv, i, wn, gn);
    fprintf(stderr, "    reference: %.*s|%.*s\n", (int)(i - from), want + from, (int)(wn - i > 60 ? 60 : wn - i), want + i);
    fprintf(stderr, "    ours:      %.*s|%.*s\n", (int)(i - from), got + from, (int)(gn - i > 60 ? 60 : gn - i), got + i);
}

int main(void) {
    const char *src = getenv("KV_SRC") ? getenv("KV_SRC") : ".";
    bool full = getenv("KV_ATTACK_FULL") && atoi(getenv("KV_ATTACK_FULL")) > 0;
    char path[4096], cmd[8192];
    snprintf(path, sizeof path, "%s/tests/oracle/node_modules/@huggingface/jinja/package.json", src);
    if (access(path, R_OK) != 0) {
        fprintf(stderr, "FAIL: %s is missing; run `make oracle` (tools/install-oracle.sh)\n", path);
        return 1;
    }
    char tmp[] = "/tmp/kv_chat_oracle.XXXXXX";
    if (!mkdtemp(tmp)) { perror("mkdtemp"); return 1; }
    snprintf(cmd, sizeof cmd,
             "git clone -q --no-checkout %s/tests/oracle/node_modules/node-llama-cpp/llama/gitRelease.bundle %s/llama "
             ">/dev/null 2>&1",
             src, tmp);
    if (system(cmd) != 0) {
        fprintf(stderr, "FAIL: cannot clone the llama.cpp bundle of node-llama-cpp (%s)\n", cmd);
        return 1;
    }
    /* the template names */
    const char *names[256];
    size_t nn = 0;
    if (full) {
        snprintf(cmd, sizeof cmd, "git -C %s/llama ls-tree --name-only HEAD models/templates/ | grep '\\.jinja$'", tmp);
        FILE *p = popen(cmd, "r");
        char line[512];
        while (p && nn < 256 && fgets(line, sizeof line, p)) {
            line[strcspn(line, "\n")] = 0;
            char *b = strrchr(line, '/');
            b = b ? b + 1 : line;
            b[strlen(b) - 6] = 0; /* .jinja */
            names[nn++] = strdup(b);
        }
        if (p) pclose(p);
    } else {
        for (size_t i = 0; k_required[i]; i++) names[nn++] = k_required[i];
    }
    for (size_t i = 0; i < nn; i++) {
        snprintf(cmd, sizeof cmd, "git -C %s/llama show HEAD:models/templates/%s.jinja > %s/%s.jinja", tmp, names[i],
                 tmp, names[i]);
        ASSERT_EQ(system(cmd), 0);
    }
    /* the cases */
    snprintf(path, sizeof path, "%s/tests/data/templates/conversations.json", src);
    json_error_t je;
    json_t *spec = json_load_file(path, 0, &je);
    ASSERT_TRUE(spec != NULL);
    if (!spec) return 1;
    json_t *convs = json_object_get(spec, "conversations"), *tools = json_object_get(spec, "tools");
    size_t nc = json_array_size(convs);
    json_t *cases = json_array();
    for (size_t i = 0; i < nn; i++)
        for (size_t k = 0; k < nc; k++) {
            json_t *cv = json_array_get(convs, k);
            json_t *ctx = json_deep_copy(json_object_get(cv, "context"));
            json_object_set_new(ctx, "bos_token", json_string("<s>"));
            json_object_set_new(ctx, "eos_token", json_string("</s>"));
            if (json_is_true(json_object_get(cv, "tools"))) json_object_set(ctx, "tools", tools);
            snprintf(path, sizeof path, "%s/%s.jinja", tmp, names[i]);
            json_array_append_new(cases, json_pack("{s:s, s:o}", "template", path, "context", ctx));
        }
    json_t *req = json_pack("{s:I, s:O}", "now", (json_int_t)NOW_UNIX, "cases", cases);
    snprintf(path, sizeof path, "%s/cases.json", tmp);
    ASSERT_EQ(json_dump_file(req, path, 0), 0);
    snprintf(cmd, sizeof cmd, "cd %s/tests/oracle && TZ=UTC node chat_render.mjs %s/cases.json > %s/out.json", src, tmp, tmp);
    ASSERT_EQ(system(cmd), 0);
    snprintf(path, sizeof path, "%s/out.json", tmp);
    json_t *res = json_load_file(path, 0, &je);
    ASSERT_TRUE(json_is_array(res) && json_array_size(res) == json_array_size(cases));
    if (!res) return 1;

    size_t n_same = 0, n_both_err = 0, n_bad = 0;
    kv_chat_render_opts ro = {.now_unix = NOW_UNIX};
    for (size_t i = 0; i < nn; i++) {
        snprintf(path, sizeof path, "%s/%s.jinja", tmp, names[i]);
        size_t len;
        char *text = read_all(path, &len);
        ASSERT_TRUE(text != NULL);
        kv_chat_tmpl *t = NULL;
        kv_diag d = {0};
        int prc = text ? kv_chat_tmpl_parse(&t, text, len, NULL, &d) : -1;
        size_t ok_ref = 0;
        for (size_t k = 0; k < nc; k++) {
            const char *cname = json_string_value(json_object_get(json_array_get(convs, k), "name"));
            json_t *r = json_array_get(res, i * nc + k);
            json_t *ctx = json_object_get(json_array_get(cases, i * nc + k), "context");
            bool ref_ok = json_is_true(json_object_get(r, "ok"));
            char *out = NULL;
            size_t on = 0;
            kv_diag rd = {0};
            int rc = prc == 0 ? kv_chat_render(t, ctx, &ro, &out, &on, &rd) : prc;
            if (ref_ok) {
                ok_ref++;
                const char *want = json_string_value(json_object_get(r, "text"));
                size_t wn = json_string_length(json_object_get(r, "text"));
                if (rc != 0) {
                    fprintf(stderr, "  %s / %s: reference renders, ours fails: %s\n", names[i], cname,
                            prc ? d.msg : rd.msg);
                    n_bad++;
                } else if (wn != on || memcmp(want, out, on)) {
                    show_diff(names[i], cname, want, wn, out, on);
                    n_bad++;
                } else {
                    n_same++;
                }
            } else {
                const char *err = json_string_value(json_object_get(r, "error"));
                if (rc == 0) {
                    fprintf(stderr, "  %s / %s: reference fails (%s), ours renders\n", names[i], cname, err);
                    n_bad++;
                } else if (rc == KV_EINVAL && strcmp(rd.msg, err)) {
                    fprintf(stderr, "  %s / %s: raise_exception message differs: reference \"%s\", ours \"%s\"\n",
                            names[i], cname, err, rd.msg);
                    n_bad++;
                } else {
                    n_both_err++;
                }
            }
            free(out);
        }
        if (!full) {
            /* a required template renders most conversations in the reference */
            if (ok_ref * 2 < nc) KVT_FAIL("%s renders only %zu of %zu conversations in the reference", names[i], ok_ref, nc);
        }
        kv_chat_tmpl_free(t);
        free(text);
    }
    printf("chat templates: %zu templates x %zu conversations: %zu identical, %zu failing in both, %zu differ\n", nn,
           nc, n_same, n_both_err, n_bad);
    ASSERT_EQ(n_bad, 0);
    ASSERT_TRUE(n_same >= nn * nc / 2);
    json_decref(res);
    json_decref(req);
    json_decref(cases); /* req took its own reference ("O") */
    json_decref(spec);
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp);
    if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", tmp);
    KV_TEST_END();
}
