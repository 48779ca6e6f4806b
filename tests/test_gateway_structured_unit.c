/* kv-test-labels: unit
 * Structured output's pieces below the HTTP server (the end-to-end test is
 * test_gateway_structured.sh):
 * - kv_sampler_sample_allowed draws what kv_sampler_sample draws from the
 *   same logits with every forbidden one set to -Inf (the reference), never
 *   a forbidden token, and KV_ERANGE when nothing is allowed;
 * - kv_gw_tools_gbnf (tool_choice required / a named function, Qwen's
 *   <tool_call> text): hand-written calls accepted or refused as a reader
 *   of the schemas would; constrained random generation over a small
 *   vocabulary with the real sampler, every sample checked by a separate
 *   hand-written checker (jansson parses it; names and argument types
 *   against the tools' schemas); errors naming the tool and keyword;
 * - the other families' call texts (DeepSeek V3.1 and R1, gpt-oss) as
 *   their templates write them are sentences, the chat parser reads them
 *   back as the call;
 * - kv_gw_parse's fields (response_format, grammar, json_schema, format):
 *   which compile, which are refused and with what message. */
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/gateway_internal.h"
#include "kvasir/chat.h"
#include "kvasir/grammar.h"
#include "kvasir/sample.h"
#include "kvtest.h"

/* ---- the sampler's allow mask against -Inf logits ----------------------- */

static uint64_t g_rng = 0x1234567;
static uint32_t rnd(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 11);
}

static void test_sample_allowed(void) {
    enum { N = 300 };
    const kv_sample_params ps[] = {
        {0.8f, 40, 0.95f, 0.05f, 1.0f, 64, 1, 0.0f, 0.0f, NULL, 0},  /* llama.cpp's defaults */
        {1.0f, 0, 1.0f, 0.0f, 1.0f, 64, 2, 0.0f, 0.0f, NULL, 0},     /* the full distribution, no filter */
        {0.0f, 0, 1.0f, 0.0f, 1.0f, 64, 3, 0.0f, 0.0f, NULL, 0},     /* greedy (the fast path) */
        {0.0f, 0, 1.0f, 0.0f, 1.3f, 16, 4, 0.0f, 0.0f, NULL, 0},     /* greedy with a penalty */
        {1.5f, 5, 0.9f, 0.1f, 1.2f, 8, 5, 0.0f, 0.0f, NULL, 0},      /* everything at once */
    };
    float logits[N], ref[N];
    uint32_t allow[(N + 31) / 32];
    int mismatches = 0, forbidden = 0, draws = 0;
    for (size_t pi = 0; pi < sizeof ps / sizeof ps[0]; pi++) {
        for (int trial = 0; trial < 60; trial++) {
            kv_sample_params p = ps[pi];
            p.seed = p.seed * 1000 + (uint64_t)trial;
            kv_sampler *a = NULL, *b = NULL;
            ASSERT_EQ(kv_sampler_new(&a, N, &p, NULL), 0);
            ASSERT_EQ(kv_sampler_new(&b, N, &p, NULL), 0);
            for (int step = 0; step < 20; step++) {
                const uint32_t keep = 1 + rnd() % 40; /* roughly one token in keep/100 allowed */
                memset(allow, 0, sizeof allow);
                for (int i = 0; i < N; i++) {
                    logits[i] = (float)((int)(rnd() % 2000) - 1000) / 100.0f;
                    if (rnd() % 100 < keep) allow[i / 32] |= 1u << (i % 32);
                    ref[i] = (allow[i / 32] >> (i % 32)) & 1 ? logits[i] : -INFINITY;
                }
                allow[0] |= 1u; /* at least one */
                ref[0] = logits[0];
                const int32_t t = kv_sampler_sample_allowed(a, logits, NULL, allow);
                const int32_t r = kv_sampler_sample(b, ref);
                draws++;
                mismatches += t != r;
                forbidden += t < 0 || !((allow[t / 32] >> (t % 32)) & 1);
                const int32_t h = (int32_t)(rnd() % N); /* the same history for both */
                kv_sampler_accept(a, h);
                kv_sampler_accept(b, h);
            }
            kv_sampler_free(a);
            kv_sampler_free(b);
        }
    }
    ASSERT_EQ(forbidden, 0);
    ASSERT_EQ(mismatches, 0);
    ASSERT_TRUE(draws == 5 * 60 * 20);
    /* nothing allowed: no draw */
    kv_sampler *s = NULL;
    kv_sample_params p = kv_sample_defaults();
    ASSERT_EQ(kv_sampler_new(&s, N, &p, NULL), 0);
    memset(allow, 0, sizeof allow);
    for (int i = 0; i < N; i++) logits[i] = 1.0f;
    ASSERT_EQ(kv_sampler_sample_allowed(s, logits, NULL, allow), KV_ERANGE);
    /* allowed only where the logit is -Inf: nothing can be drawn */
    allow[0] = 1u;
    logits[0] = -INFINITY;
    ASSERT_EQ(kv_sampler_sample_allowed(s, logits, NULL, allow), KV_ERANGE);
    p.temp = 0;
    kv_sampler_free(s);
    ASSERT_EQ(kv_sampler_new(&s, N, &p, NULL), 0);
    ASSERT_EQ(kv_sampler_sample_allowed(s, logits, NULL, allow), KV_ERANGE);
    allow[1] = 1u << 3; /* token 35 */
    ASSERT_EQ(kv_sampler_sample_allowed(s, logits, NULL, allow), 35);
    kv_sampler_free(s);
}

/* ---- tool calls --------------------------------------------------------- */

static const char *TOOLS =
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"the weather\","
    "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":8},"
    "\"unit\":{\"enum\":[\"c\",\"f\"]}},\"required\":[\"city\"]}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"add\",\"parameters\":{\"type\":\"object\",\"properties\":"
    "{\"a\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":99},\"b\":{\"type\":\"integer\",\"minimum\":0,"
    "\"maximum\":99}},\"required\":[\"a\",\"b\"],\"additionalProperties\":false}}},"
    "{\"type\":\"function\",\"function\":{\"name\":\"now\"}}]";

/* 0 when text is a sentence of g (fed whole, can end), else nonzero. */
static int sentence(const kv_grammar *g, const char *text) {
    kv_grammar_matcher *m = NULL;
    kv_diag d = {0};
    if (kv_grammar_matcher_new(&m, g, &d)) return -1;
    int rc = kv_grammar_feed(m, text, strlen(text), &d);
    if (!rc && !kv_grammar_can_end(m)) rc = 1;
    kv_grammar_matcher_free(m);
    return rc;
}

static kv_grammar *tools_grammar(const char *only, bool parallel) {
    json_t *tools = json_loads(TOOLS, 0, NULL);
    kv_grammar *g = NULL;
    kv_diag d = {0};
    const int rc = kv_gw_tools_grammar(&g, tools, only, KV_GW_CALLS_HERMES, parallel, false, &d);
    if (rc) fprintf(stderr, "tools grammar: %s\n", d.msg);
    json_decref(tools);
    return g;
}

#define CALL(s) "<tool_call>\n" s "\n</tool_call>"

static void test_tools_accept(void) {
    kv_grammar *any = tools_grammar(NULL, false), *add = tools_grammar("add", false), *par = tools_grammar(NULL, true);
    ASSERT_TRUE(any && add && par);
    if (!any || !add || !par) return;
    const char *w = CALL("{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"unit\": \"c\"}}");
    const char *w2 = CALL("{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Rome\"}}");
    const char *a = CALL("{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 40}}");
    const char *n = CALL("{\"name\": \"now\", \"arguments\": {}}");
    ASSERT_EQ(sentence(any, w), 0);
    ASSERT_EQ(sentence(any, w2), 0);
    ASSERT_EQ(sentence(any, a), 0);
    ASSERT_EQ(sentence(any, n), 0);
    /* refused as a reader of the schemas would */
    ASSERT_NE(sentence(any, CALL("{\"name\": \"sub\", \"arguments\": {\"a\": 2, \"b\": 40}}")), 0);     /* no such tool */
    ASSERT_NE(sentence(any, CALL("{\"name\": \"add\", \"arguments\": {\"a\": 2}}")), 0);                /* b required */
    ASSERT_NE(sentence(any, CALL("{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 100}}")), 0);    /* maximum */
    ASSERT_NE(sentence(any, CALL("{\"name\": \"add\", \"arguments\": {\"a\": \"2\", \"b\": 4}}")), 0);  /* type */
    ASSERT_NE(sentence(any, CALL("{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Amsterdam\"}}")), 0); /* maxLength */
    ASSERT_NE(sentence(any, CALL("{\"name\": \"get_weather\", \"arguments\": {\"unit\": \"k\", \"city\": \"x\"}}")), 0);
    ASSERT_NE(sentence(any, CALL("{\"name\": \"now\", \"arguments\": {\"x\": 1}}")), 0);  /* no parameters */
    ASSERT_NE(sentence(any, "{\"name\": \"now\", \"arguments\": {}}"), 0);                /* no wrapper */
    ASSERT_NE(sentence(any, ""), 0);                                                       /* required: a call */
    /* a named function: that one only */
    ASSERT_EQ(sentence(add, a), 0);
    ASSERT_NE(sentence(add, w), 0);
    ASSERT_NE(sentence(add, n), 0);
    /* parallel calls, newline between, only when asked */
    char two[512];
    snprintf(two, sizeof two, "%s\n%s", w, a);
    ASSERT_EQ(sentence(par, two), 0);
    ASSERT_EQ(sentence(par, n), 0);
    ASSERT_NE(sentence(any, two), 0);
    kv_grammar_free(any);
    kv_grammar_free(add);
    kv_grammar_free(par);
}

/* The independent check of one generated call: wrapper, then jansson's
 * parse, then the tools' schemas by hand. */
static bool call_ok(const char *text, const char *only) {
    const char *pre = "<tool_call>\n", *suf = "\n</tool_call>";
    const size_t n = strlen(text), np = strlen(pre), ns = strlen(suf);
    if (n < np + ns || strncmp(text, pre, np) || strcmp(text + n - ns, suf)) return false;
    json_error_t je;
    json_t *j = json_loadb(text + np, n - np - ns, 0, &je);
    if (!json_is_object(j) || json_object_size(j) != 2) return json_decref(j), false;
    const char *name = json_string_value(json_object_get(j, "name"));
    json_t *args = json_object_get(j, "arguments");
    bool ok = name && json_is_object(args) && (!only || !strcmp(name, only));
    if (ok && !strcmp(name, "get_weather")) {
        json_t *city = json_object_get(args, "city"), *unit = json_object_get(args, "unit");
        ok = json_is_string(city) && json_string_length(city) <= 8; /* ASCII vocabulary: bytes are characters */
        ok = ok && (!unit || (json_is_string(unit) && (!strcmp(json_string_value(unit), "c") ||
                                                     !strcmp(json_string_value(unit), "f"))));
        ok = ok && json_object_size(args) <= 2;
    } else if (ok && !strcmp(name, "add")) {
        json_t *a = json_object_get(args, "a"), *b = json_object_get(args, "b");
        ok = json_object_size(args) == 2 && json_is_integer(a) && json_is_integer(b) && json_integer_value(a) >= 0 &&
             json_integer_value(a) <= 99 && json_integer_value(b) >= 0 && json_integer_value(b) <= 99;
    } else if (ok && !strcmp(name, "now")) {
        ok = json_object_size(args) == 0;
    } else {
        ok = false;
    }
    json_decref(j);
    return ok;
}

/* A small vocabulary: printable ASCII and newline one byte each, some
 * longer pieces, and one end-of-generation token (the last). */
static const char *const MULTI[] = {"<tool_call>", "</tool_call>", "\"name\"", "\"arguments\"", "get_", "weather",
                                    "add", "now", ": ", "{\"", "\"}", "12", "city", "unit", "\"c\"", ", \""};
#define N_MULTI (sizeof MULTI / sizeof MULTI[0])

static void test_tools_generate(void) {
    static char bytes[128][2];
    const char *pieces[128 + N_MULTI + 1];
    uint32_t lens[128 + N_MULTI + 1];
    bool eog[128 + N_MULTI + 1];
    int32_t nv = 0;
    for (int c = 0; c < 128; c++) {
        bytes[c][0] = (char)c;
        pieces[nv] = bytes[c];
        lens[nv] = (c >= 32 && c < 127) || c == '\n' ? 1 : 0; /* others: empty, never allowed */
        eog[nv++] = false;
    }
    for (size_t i = 0; i < N_MULTI; i++) {
        pieces[nv] = MULTI[i];
        lens[nv] = (uint32_t)strlen(MULTI[i]);
        eog[nv++] = false;
    }
    pieces[nv] = "";
    lens[nv] = 0;
    eog[nv++] = true;
    kv_grammar_vocab *v = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_grammar_vocab_new(&v, pieces, lens, eog, nv, &d), 0);
    if (!v) return;
    const char *onlys[] = {NULL, "add", "get_weather"};
    int good = 0, total = 0;
    for (size_t oi = 0; oi < 3; oi++) {
        kv_grammar *g = tools_grammar(onlys[oi], false);
        ASSERT_TRUE(g != NULL);
        if (!g) continue;
        for (uint64_t seed = 1; seed <= 40; seed++) {
            kv_sample_params p = kv_sample_defaults();
            p.seed = seed;
            p.top_k = 0;
            p.min_p = 0;
            p.top_p = 1;
            kv_sampler *s = NULL;
            kv_grammar_matcher *m = NULL;
            ASSERT_EQ(kv_sampler_new(&s, nv, &p, NULL), 0);
            ASSERT_EQ(kv_grammar_matcher_new(&m, g, &d), 0);
            char text[4096];
            size_t tl = 0;
            float logits[128 + N_MULTI + 1];
            uint32_t mask[(128 + N_MULTI + 1 + 31) / 32];
            bool ended = false;
            for (int step = 0; step < 600 && !ended; step++) {
                for (int32_t i = 0; i < nv; i++) logits[i] = (float)(rnd() % 1000) / 250.0f;
                if (kv_grammar_mask(m, v, mask, &d)) break;
                const int32_t t = kv_sampler_sample_allowed(s, logits, NULL, mask);
                if (t < 0 || kv_grammar_accept(m, v, t, &d)) break;
                kv_sampler_accept(s, t);
                if (eog[t]) ended = true;
                else if (tl + lens[t] < sizeof text) {
                    memcpy(text + tl, pieces[t], lens[t]);
                    tl += lens[t];
                }
            }
            text[tl] = 0;
            total++;
            if (ended && call_ok(text, onlys[oi])) good++;
            else fprintf(stderr, "tool call (only %s, seed %llu, ended %d) fails its check: %s\n",
                         onlys[oi] ? onlys[oi] : "-", (unsigned long long)seed, ended, text);
            kv_grammar_matcher_free(m);
            kv_sampler_free(s);
        }
        kv_grammar_free(g);
    }
    ASSERT_EQ(good, total);
    ASSERT_EQ(total, 120);
    kv_grammar_vocab_free(v);
}

/* The other families' call texts, as their templates write a call
 * (DeepSeek V3.1, R1's fenced form, gpt-oss's commentary message): each is
 * a sentence of its grammar, the wrong ones are not, and the chat parser of
 * the family reads each sentence back as the very call. */
typedef struct { char name[64]; char args[256]; uint32_t n; } calls_seen;
static int on_call(void *ud, const kv_chat_ev *ev) {
    calls_seen *c = ud;
    if (ev->type == KV_CHAT_EV_CALL) {
        snprintf(c->name, sizeof c->name, "%s", ev->name);
        snprintf(c->args, sizeof c->args, "%s", ev->args);
        c->n++;
    } else if (ev->type == KV_CHAT_EV_CONTENT && ev->n) {
        c->n += 100; /* content: not a call */
    }
    return 0;
}

typedef struct { uint32_t begun, n_frags; char joined[256], args[256]; bool streamed; } frags_seen;
static int on_frag(void *ud, const kv_chat_ev *ev) {
    frags_seen *f = ud;
    if (ev->type == KV_CHAT_EV_CALL_BEGIN) f->begun++;
    if (ev->type == KV_CHAT_EV_CALL_ARGS) {
        f->n_frags++;
        const size_t l = strlen(f->joined);
        snprintf(f->joined + l, sizeof f->joined - l, "%.*s", (int)ev->n, ev->text);
    }
    if (ev->type == KV_CHAT_EV_CALL) {
        snprintf(f->args, sizeof f->args, "%s", ev->args);
        f->streamed = ev->streamed;
    }
    return 0;
}

#define DS(x) "<\xef\xbd\x9c" x "\xef\xbd\x9c>"
#define US "\xe2\x96\x81"
static void test_tools_families(void) {
    struct { int fmt, parser; const char *good, *good2, *bad; } cs[] = {
        {KV_GW_CALLS_HERMES, KV_CHAT_FMT_HERMES, CALL("{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}"),
         CALL("{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}") "\n" CALL("{\"name\": \"now\", \"arguments\": {}}"),
         CALL("{\"name\": \"add\", \"arguments\": {\"a\": 2}}")},
        {KV_GW_CALLS_DEEPSEEK, KV_CHAT_FMT_DEEPSEEK,
         DS("tool" US "calls" US "begin") DS("tool" US "call" US "begin") "add" DS("tool" US "sep")
             "{\"a\": 2, \"b\": 3}" DS("tool" US "call" US "end") DS("tool" US "calls" US "end"),
         DS("tool" US "calls" US "begin") DS("tool" US "call" US "begin") "add" DS("tool" US "sep")
             "{\"a\": 2, \"b\": 3}" DS("tool" US "call" US "end") DS("tool" US "call" US "begin") "now"
             DS("tool" US "sep") "{}" DS("tool" US "call" US "end") DS("tool" US "calls" US "end"),
         DS("tool" US "calls" US "begin") DS("tool" US "call" US "begin") "add" DS("tool" US "sep")
             "{\"a\": 200, \"b\": 3}" DS("tool" US "call" US "end") DS("tool" US "calls" US "end")},
        {KV_GW_CALLS_DEEPSEEK_FENCED, KV_CHAT_FMT_DEEPSEEK,
         DS("tool" US "calls" US "begin") DS("tool" US "call" US "begin") "function" DS("tool" US "sep")
             "add\n```json\n{\"a\": 2, \"b\": 3}\n```" DS("tool" US "call" US "end") DS("tool" US "calls" US "end"),
         DS("tool" US "calls" US "begin") DS("tool" US "call" US "begin") "function" DS("tool" US "sep")
             "add\n```json\n{\"a\": 2, \"b\": 3}\n```" DS("tool" US "call" US "end") "\n" DS("tool" US "call" US "begin")
             "function" DS("tool" US "sep") "now\n```json\n{}\n```" DS("tool" US "call" US "end")
             DS("tool" US "calls" US "end"),
         DS("tool" US "calls" US "begin") DS("tool" US "call" US "begin") "add" DS("tool" US "sep")
             "{\"a\": 2, \"b\": 3}" DS("tool" US "call" US "end") DS("tool" US "calls" US "end")},
        {KV_GW_CALLS_HARMONY, KV_CHAT_FMT_HARMONY,
         "<|channel|>commentary to=functions.add <|constrain|>json<|message|>{\"a\": 2, \"b\": 3}", NULL,
         "<|channel|>commentary to=functions.add<|message|>{\"a\": 2, \"b\": 3}"},
    };
    json_t *tools = json_loads(TOOLS, 0, NULL);
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        kv_grammar *one = NULL, *par = NULL;
        kv_diag d = {0};
        ASSERT_EQ(kv_gw_tools_grammar(&one, tools, NULL, cs[i].fmt, false, false, &d), 0);
        ASSERT_EQ(kv_gw_tools_grammar(&par, tools, NULL, cs[i].fmt, true, false, &d), 0);
        if (!one || !par) {
            KVT_FAIL("format %d: %s", cs[i].fmt, d.msg);
            continue;
        }
        if (sentence(one, cs[i].good)) KVT_FAIL("format %d: the template's call is refused", cs[i].fmt);
        if (!sentence(one, cs[i].bad)) KVT_FAIL("format %d: a wrong call is accepted", cs[i].fmt);
        if (cs[i].good2 && !sentence(one, cs[i].good2)) KVT_FAIL("format %d: two calls, not parallel", cs[i].fmt);
        if (cs[i].good2 && sentence(par, cs[i].good2)) KVT_FAIL("format %d: two parallel calls refused", cs[i].fmt);
        /* named: that one only */
        kv_grammar *now = NULL;
        ASSERT_EQ(kv_gw_tools_grammar(&now, tools, "now", cs[i].fmt, false, false, &d), 0);
        if (now && !sentence(now, cs[i].good)) KVT_FAIL("format %d: the named grammar takes another", cs[i].fmt);
        kv_grammar_free(now);
        /* the parser reads the sentence as the call */
        kv_chat_syntax syn = {.format = cs[i].parser, .tools = true};
        kv_chat_parser *cp = NULL;
        ASSERT_EQ(kv_chat_parser_new(&cp, &syn), 0);
        calls_seen seen = {0};
        if (cp) ASSERT_EQ(kv_chat_parser_push(cp, cs[i].good, strlen(cs[i].good), true, on_call, &seen), 0);
        kv_chat_parser_free(cp);
        ASSERT_EQ(seen.n, 1u);
        /* streamed (stream_args), a byte at a time: begun once, the arguments in
           fragments whose join is the call's arguments */
        syn.stream_args = true;
        ASSERT_EQ(kv_chat_parser_new(&cp, &syn), 0);
        frags_seen fs = {0};
        for (size_t k = 0; cp && cs[i].good[k]; k++)
            ASSERT_EQ(kv_chat_parser_push(cp, cs[i].good + k, 1, false, on_frag, &fs), 0);
        if (cp) ASSERT_EQ(kv_chat_parser_push(cp, "", 0, true, on_frag, &fs), 0);
        kv_chat_parser_free(cp);
        ASSERT_EQ(fs.begun, 1u);
        ASSERT_TRUE(fs.n_frags > 1);
        ASSERT_STREQ(fs.joined, fs.args);
        ASSERT_STREQ(fs.args, "{\"a\":2,\"b\":3}");
        ASSERT_TRUE(fs.streamed);
        ASSERT_STREQ(seen.name, "add");
        ASSERT_STREQ(seen.args, "{\"a\":2,\"b\":3}");
        kv_grammar_free(one);
        kv_grammar_free(par);
    }
    json_decref(tools);
}

static void test_tools_errors(void) {
    struct { const char *tools, *only, *want; int rc; } cs[] = {
        {"{}", NULL, "'tools' must be a non-empty array", KV_EINVAL},
        {"[]", NULL, "'tools' must be a non-empty array", KV_EINVAL},
        {"[{\"type\":\"function\",\"function\":{\"name\":\"a.b\"}}]", NULL, "tools[0].function.name", KV_EFORMAT},
        {"[{\"type\":\"web\",\"function\":{\"name\":\"a\"}}]", NULL, "tools[0] must be", KV_EFORMAT},
        {"[{\"type\":\"function\",\"function\":{\"name\":\"a\"}}]", "b", "'b', which is not in 'tools'", KV_EINVAL},
        {"[{\"type\":\"function\",\"function\":{\"name\":\"a\"}},{\"type\":\"function\",\"function\":{\"name\":\"b\","
         "\"parameters\":{\"type\":\"object\",\"properties\":{\"s\":{\"type\":\"string\",\"pattern\":\"x\"}}}}}]",
         NULL, "tools[1].function.parameters (b)", KV_EUNSUPPORTED},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        json_t *t = json_loads(cs[i].tools, 0, NULL);
        char *gbnf = NULL;
        kv_diag d = {0};
        const int rc = kv_gw_tools_gbnf(&gbnf, t, cs[i].only, KV_GW_CALLS_HERMES, false, false, &d);
        ASSERT_EQ(rc, cs[i].rc);
        ASSERT_TRUE(gbnf == NULL);
        if (!strstr(d.msg, cs[i].want)) KVT_FAIL("case %zu: '%s' lacks '%s'", i, d.msg, cs[i].want);
        json_decref(t);
    }
    /* the pattern case names the keyword too */
}

/* ---- the request fields ------------------------------------------------- */

static void test_parse_fields(void) {
    struct { int api; const char *body, *want; bool grammar; } cs[] = {
        {KV_GW_OPENAI_CHAT, "{\"response_format\":{\"type\":\"text\"}}", NULL, false},
        {KV_GW_OPENAI_CHAT, "{\"response_format\":{\"type\":\"json_object\"}}", NULL, true},
        {KV_GW_OPENAI_CHAT, "{\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"strict\":"
                            "true,\"schema\":{\"type\":\"integer\"}}}}", NULL, true},
        {KV_GW_OPENAI_TEXT, "{\"json_schema\":{\"type\":\"boolean\"}}", NULL, true},
        {KV_GW_OPENAI_TEXT, "{\"grammar\":\"root ::= [a-z]+\"}", NULL, true},
        {KV_GW_OLLAMA, "{\"format\":\"json\"}", NULL, true},
        {KV_GW_OLLAMA, "{\"format\":\"\"}", NULL, false},
        {KV_GW_OLLAMA, "{\"format\":{\"type\":\"array\"}}", NULL, true},
        {KV_GW_OPENAI_CHAT, "{\"response_format\":\"json\"}", "'response_format' must be an object", false},
        {KV_GW_OPENAI_CHAT, "{\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\"}}}",
         "'response_format.json_schema.schema' is required", false},
        {KV_GW_OPENAI_CHAT, "{\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"schema\":"
                            "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\",\"format\":\"email\"}}}}}}",
         "'format'", false},
        {KV_GW_OPENAI_CHAT, "{\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{\"type\":3}}}}",
         "response_format.json_schema.schema", false},
        {KV_GW_OPENAI_CHAT, "{\"grammar\":\"root ::= (\"}", "'grammar': grammar 1:", false},
        {KV_GW_OPENAI_CHAT, "{\"grammar\":5}", "'grammar' must be a string", false},
        {KV_GW_OPENAI_CHAT, "{\"json_schema\":{\"type\":\"string\"},\"grammar\":\"root ::= \\\"a\\\"\"}",
         "both constrain", false},
        {KV_GW_OLLAMA, "{\"format\":\"yaml\"}", "'format' must be \"json\" or a JSON schema object", false},
        {KV_GW_OLLAMA, "{\"format\":{\"not\":{}}}", "'not'", false},
        /* Anthropic's Messages API has none of these: not read there */
        {KV_GW_ANTHROPIC, "{\"model\":\"m\",\"max_tokens\":5,\"response_format\":{\"type\":\"json_object\"}}", NULL, false},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        /* the message list every chat API needs, then the case's fields */
        json_t *o = json_loads(cs[i].body, 0, NULL);
        ASSERT_TRUE(o != NULL);
        if (!o) continue;
        if (cs[i].api == KV_GW_OPENAI_TEXT) json_object_set_new(o, "prompt", json_string("p"));
        else json_object_set_new(o, "messages", json_pack("[{s:s,s:s}]", "role", "user", "content", "hi"));
        char *body = json_dumps(o, JSON_COMPACT);
        json_decref(o);
        kv_gw_params p;
        kv_diag d = {0};
        const int rc = kv_gw_parse(&p, cs[i].api, body, strlen(body), &d);
        if (cs[i].want) {
            ASSERT_NE(rc, 0);
            if (!strstr(d.msg, cs[i].want)) KVT_FAIL("case %zu: '%s' lacks '%s'", i, d.msg, cs[i].want);
        } else {
            if (rc) KVT_FAIL("case %zu: %s", i, d.msg);
            ASSERT_EQ(p.grammar != NULL, cs[i].grammar);
        }
        kv_gw_params_free(&p);
        free(body);
    }
}

int main(void) {
    test_sample_allowed();
    test_tools_accept();
    test_tools_generate();
    test_tools_families();
    test_tools_errors();
    test_parse_fields();
    KV_TEST_END();
}
