/* libFuzzer target for grammars: the first byte chooses GBNF text or a JSON
 * schema, the rest is that text. When it compiles, a matcher walks up to 48
 * tokens of a small fixed vocabulary (bytes, JSON-ish pieces, split UTF-8,
 * an end token), each picked among the tokens its mask allows; every token
 * the mask allows must be accepted, and the text the walk built must feed a
 * fresh matcher. Then the raw input is fed too. A schema is also compiled
 * under a prefix inside a larger grammar, which must parse as well. Every outcome is 0 or a
 * negative code with a message; the limits are small so a slow input is a
 * limit, not a timeout. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/grammar.h"

static kv_grammar_vocab *g_vocab;
static int32_t g_n;
static const char *g_pieces[300];
static uint32_t g_lens[300];

static void init_vocab(void) {
    static char bytes[256];
    static const char *const extra[] = {"{\"", "\":", "\"", "true", "false", "null", ", ", "[", "]", "{", "}", "ab",
                                        "abc", " a", "12", "-3", ".5", "e+", "αβ", "€", "\xe2\x82", "\xac", "\xf0\x9f",
                                        "\x99\x82", "\\n", "\\u00e9", "()", "((", "))", "x*", "\n  "};
    int32_t n = 0;
    for (int b = 0; b < 256; b++) {
        bytes[b] = (char)b;
        g_pieces[n] = bytes + b;
        g_lens[n++] = 1;
    }
    for (size_t i = 0; i < sizeof extra / sizeof extra[0]; i++) {
        g_pieces[n] = extra[i];
        g_lens[n++] = (uint32_t)strlen(extra[i]);
    }
    g_pieces[n] = "";
    g_lens[n++] = 0; /* the end token */
    bool eog[300] = {false};
    eog[n - 1] = true;
    g_n = n;
    kv_diag d = {0};
    if (kv_grammar_vocab_new(&g_vocab, g_pieces, g_lens, eog, n, &d)) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_vocab) init_vocab();
    if (size < 1) return 0;
    kv_grammar_limits lim;
    kv_grammar_limits_default(&lim);
    lim.max_text_bytes = 1 << 14;
    lim.max_rules = 512;
    lim.max_elements = 1 << 14;
    lim.max_repeat = 64;
    lim.max_stacks = 64;
    lim.max_stack_depth = 64;
    lim.max_memory_bytes = 8u << 20;
    kv_grammar *g = NULL;
    kv_diag d = {0};
    const char *text = (const char *)data + 1;
    int rc = (data[0] & 1) ? kv_grammar_from_schema(&g, text, size - 1, &lim, &d)
                           : kv_grammar_parse(&g, text, size - 1, &lim, &d);
    if (rc > 0) abort();
    if (rc < 0) {
        if (g || d.msg[0] == 0) abort();
        return 0;
    }
    if (data[0] & 1) {
        /* the same schema under a prefix, inside a larger grammar, must parse too */
        char *named = NULL;
        rc = kv_grammar_schema_to_gbnf_named(&named, text, size - 1, "f_1", &lim, &d);
        if (rc && (rc != KV_ERANGE || named)) abort(); /* only a longer text may pass a limit */
        if (!rc) {
            size_t nn = strlen(named) + 64;
            char *all = malloc(nn);
            if (!all) abort();
            int k = snprintf(all, nn, "root ::= \"<\" f_1 \">\"\n%s", named);
            kv_grammar *g2 = NULL;
            kv_grammar_limits l2 = lim;
            l2.max_text_bytes = (size_t)k;
            rc = kv_grammar_parse(&g2, all, (size_t)k, &l2, &d);
            if (rc == KV_EFORMAT || rc == KV_EUNSUPPORTED) abort(); /* the plain one parsed */
            kv_grammar_free(g2);
            free(all);
            free(named);
        }
    }
    kv_grammar_matcher *m = NULL;
    if (kv_grammar_matcher_new(&m, g, &d)) {
        if (d.msg[0] == 0) abort();
        kv_grammar_free(g);
        return 0;
    }
    uint32_t mask[(300 + 31) / 32];
    char built[48 * 8];
    size_t blen = 0;
    uint32_t pick = 2166136261u;
    for (size_t i = 0; i < size; i++) pick = (pick ^ data[i]) * 16777619u;
    for (int step = 0; step < 48; step++) {
        rc = kv_grammar_mask(m, g_vocab, mask, &d);
        if (rc) {
            if (rc > 0 || d.msg[0] == 0) abort();
            break;
        }
        int32_t allowed[300], na = 0;
        for (int32_t t = 0; t < g_n; t++)
            if (mask[t >> 5] >> (t & 31) & 1) allowed[na++] = t;
        if (na == 0) break;
        pick = pick * 1103515245u + 12345u;
        int32_t t = allowed[(pick >> 8) % (uint32_t)na];
        rc = kv_grammar_accept(m, g_vocab, t, &d);
        if (rc == KV_EINVAL) abort(); /* the mask allowed it */
        if (rc) break;
        if (g_lens[t] == 0) break;
        memcpy(built + blen, g_pieces[t], g_lens[t]);
        blen += g_lens[t];
    }
    kv_grammar_matcher_free(m);
    /* the same text into a fresh matcher, byte by byte */
    if (kv_grammar_matcher_new(&m, g, &d) == 0) {
        for (size_t i = 0; i < blen; i++) {
            rc = kv_grammar_feed(m, built + i, 1, &d);
            if (rc == KV_EINVAL) abort();
            if (rc) break;
        }
        kv_grammar_matcher_free(m);
    }
    if (kv_grammar_matcher_new(&m, g, &d) == 0) {
        rc = kv_grammar_feed(m, text, size - 1, &d);
        if (rc > 0) abort();
        (void)kv_grammar_can_end(m);
        kv_grammar_matcher_free(m);
    }
    kv_grammar_free(g);
    return 0;
}
