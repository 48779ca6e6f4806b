/* kv-test-labels: unit attack
 *
 * Chat-template interpreter (src/chat/) unit semantics. What each part
 * checks, and against what:
 *
 *  semantics   small templates whose output is worked out by hand from the
 *              reference's rules (@huggingface/jinja 0.5.11: lexer.ts,
 *              parser.ts, runtime.ts; the comments say which rule): whitespace
 *              control, trim_blocks and lstrip_blocks, loops and loop.*,
 *              scoping of set, namespace(), macros with defaults and keyword
 *              arguments, slicing, string methods, filters, tests, `in`,
 *              ternaries, number printing, JSON input conversion.
 *  errors      raise_exception gives KV_EINVAL and exactly its message;
 *              syntax and runtime errors give KV_EFORMAT and a message.
 *  limits      template size, output bytes, loop iterations, depth (source
 *              nesting and macro recursion) and memory: each stops the render
 *              with KV_ERANGE and a message naming the limit.
 *  attack      random mutations of a real-shaped template (bytes flipped,
 *              cut, spliced, duplicated) never crash and always give 0 or an
 *              error code with a message; a render after them still works.
 *              KV_ATTACK_FULL=1 runs 100x more mutations.
 *
 * Byte-for-byte equality with the reference on real models' templates is
 * tests/test_chat_oracle.c. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/chat.h"
#include "kvtest.h"

static int render_lim(const char *tmpl, const char *ctx_json, const kv_chat_limits *lim, char **out, kv_diag *d) {
    kv_chat_tmpl *t = NULL;
    *out = NULL;
    int rc = kv_chat_tmpl_parse(&t, tmpl, strlen(tmpl), lim, d);
    if (rc) return rc;
    json_t *ctx = NULL;
    if (ctx_json) {
        json_error_t je;
        ctx = json_loads(ctx_json, 0, &je);
        if (!ctx) {
            kv_chat_tmpl_free(t);
            return -100;
        }
    }
    size_t n = 0;
    kv_chat_render_opts o = {.now_unix = 1767225600};
    rc = kv_chat_render(t, ctx, &o, out, &n, d);
    if (rc == 0 && strlen(*out) != n) rc = -101;
    json_decref(ctx);
    kv_chat_tmpl_free(t);
    return rc;
}

/* Renders and compares; reports the template on a mismatch. */
static void expect(const char *tmpl, const char *ctx, const char *want, int line) {
    char *out = NULL;
    kv_diag d = {0};
    int rc = render_lim(tmpl, ctx, NULL, &out, &d);
    kvt_checks++;
    if (rc != 0) KVT_FAIL("line %d: %s: rc %d (%s)", line, tmpl, rc, d.msg);
    else if (strcmp(out, want)) KVT_FAIL("line %d: %s: got \"%s\", want \"%s\"", line, tmpl, out, want);
    free(out);
}
#define EXPECT(t, ctx, w) expect((t), (ctx), (w), __LINE__)

static void expect_err(const char *tmpl, const char *ctx, const kv_chat_limits *lim, int code, const char *in_msg,
                       int line) {
    char *out = NULL;
    kv_diag d = {0};
    int rc = render_lim(tmpl, ctx, lim, &out, &d);
    kvt_checks++;
    if (rc != code) KVT_FAIL("line %d: %.80s: rc %d, want %d (%s)", line, tmpl, rc, code, d.msg);
    else if (in_msg && !strstr(d.msg, in_msg)) KVT_FAIL("line %d: message \"%s\" lacks \"%s\"", line, d.msg, in_msg);
    else if (out) KVT_FAIL("line %d: output set on failure", line);
    free(out);
}
#define EXPECT_ERR(t, ctx, lim, code, m) expect_err((t), (ctx), (lim), (code), (m), __LINE__)

static void test_semantics(void) {
    /* numbers: integers print as integers, a float literal keeps ".0" */
    EXPECT("{{ 1 + 2 }}|{{ 7 // 2 }}|{{ 7 % 3 }}|{{ 2 ** 10 }}|{{ 1 / 2 }}|{{ 3.0 }}|{{ -4 }}", NULL,
           "3|3|1|1024|0.5|3.0|-4");
    /* `~` and string `+` use the JavaScript value's text: 2.0 -> "2" */
    EXPECT("{{ 'a' ~ 1 ~ 2.0 }}|{{ 'n=' + 5 }}", NULL, "a12|n=5");
    /* booleans print as JavaScript does */
    EXPECT("{{ true }} {{ 1 == 1 }} {{ none }}|", NULL, "true true |");
    /* whitespace control strips all whitespace on its side */
    EXPECT("a  {%- if true -%}  b  {%- endif -%}  c", NULL, "abc");
    EXPECT("a {{- 'b' -}} \n c", NULL, "abc");
    /* trim_blocks: the newline after a block tag goes; lstrip_blocks: the indent before it */
    EXPECT("{% if true %}\nx\n{% endif %}\ny", NULL, "x\ny");
    EXPECT("  {% if true %}x{% endif %}\n  {{ 'y' }}", NULL, "x  y");
    /* a single trailing newline of the template is dropped */
    EXPECT("x\n", NULL, "x");
    /* comments, with whitespace control */
    EXPECT("a {#- note -#} b{# c #}", NULL, "ab");
    /* loops and loop.* */
    EXPECT("{% for x in [1,2,3] %}{{ loop.index }}{{ loop.first }}{{ loop.last }},{% endfor %}", NULL,
           "1truefalse,2falsefalse,3falsetrue,");
    EXPECT("{% for x in [1,2,3,4] if x is even %}{{ x }}{{ loop.length }}{% endfor %}", NULL, "2242");
    EXPECT("{% for x in [] %}a{% else %}empty{% endfor %}", NULL, "empty");
    EXPECT("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}", NULL, "a=1;b=2;");
    EXPECT("{% for k in {'a': 1, 'b': 2} %}{{ k }}{% endfor %}", NULL, "ab");
    EXPECT("{% for x in [1,2,3] %}{% if x == 2 %}{% continue %}{% endif %}{{ x }}{% endfor %}", NULL, "13");
    /* a break drops the output of its iteration (the reference's exception does) */
    EXPECT("{% for x in [1,2,3] %}<{{ x }}{% if x == 2 %}{% break %}{% endif %}>{% endfor %}", NULL, "<1>");
    EXPECT("{% for m in messages %}{{ loop.previtem.c if loop.previtem }}{{ m.c }}{% endfor %}",
           "{\"messages\": [{\"c\": \"a\"}, {\"c\": \"b\"}]}", "aab");
    /* set inside a loop stays in the loop; namespace attributes carry out */
    EXPECT("{% set a = 1 %}{% for x in [1] %}{% set a = 2 %}{% endfor %}{{ a }}", NULL, "1");
    EXPECT("{% set ns = namespace(n=0) %}{% for x in range(4) %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}", NULL, "6");
    EXPECT("{% set a, b = [1, 2] %}{{ b }}{{ a }}", NULL, "21");
    EXPECT("{% set s %}in{{ 'side' }}{% endset %}{{ s|upper }}", NULL, "INSIDE");
    /* macros: defaults, keyword arguments, the caller's variables */
    EXPECT("{% macro f(a, b='B') %}{{ a }}{{ b }}{% endmacro %}{{ f(1) }}{{ f(1, b=2) }}{{ f(b=3, a=4) }}", NULL,
           "1B1243");
    EXPECT("{% macro g() %}{{ v }}{% endmacro %}{% set v = 'seen' %}{{ g() }}", NULL, "seen");
    EXPECT("{%- macro r(n) %}{% if n > 0 %}{{ n }}{{ r(n - 1) }}{% endif %}{% endmacro %}{{ r(3) }}", NULL, "321");
    /* indexing and slicing, negative indices, strings by code point */
    EXPECT("{{ [1,2,3,4][1:3] }}|{{ 'hello'[::-1] }}|{{ [1,2,3][-1] }}|{{ 'héllo'[1:3] }}|{{ [1,2,3][5] }}|", NULL,
           "[2, 3]|olleh|3|él||");
    EXPECT("{{ messages[::-1][0].role }}", "{\"messages\": [{\"role\": \"a\"}, {\"role\": \"b\"}]}", "b");
    /* string methods as the templates call them; rstrip ignores its argument */
    EXPECT("{{ ' ab '.strip() }}|{{ 'a,b,c'.split(',')[1] }}|{{ 'x'.upper() }}|{{ 'abc'.startswith('ab') }}|"
           "{{ 'aXbX'.replace('X', '-') }}|{{ 'a b  c'.split()|length }}|{{ 'x \\n'.rstrip('\\n') }}|"
           "{{ 'a</t>b</t>c'.split('</t>', 1)[1] }}|{{ 'abc'.endswith(('x', 'c')) }}|{{ 'hello world'.title() }}",
           NULL, "ab|b|X|true|a-b-|3|x|b</t>c|true|Hello World");
    /* filters */
    EXPECT("{{ {'a': [1, 'é', none, true, 1.5]} | tojson }}", NULL, "{\"a\": [1, \"é\", null, true, 1.5]}");
    EXPECT("{{ 'é\"\\n' | tojson(ensure_ascii=true) }}", NULL, "\"\\u00e9\\\"\\n\"");
    EXPECT("{{ {'a': [1]} | tojson(indent=2) }}", NULL, "{\n  \"a\": [\n    1\n  ]\n}");
    EXPECT("{{ {'a': 1, 'b': 2} | tojson(separators=(',', ':')) }}", NULL, "{\"a\":1,\"b\":2}");
    EXPECT("{{ '  x  '|trim }}|{{ [1,2,3]|length }}|{{ 'AbC'|lower }}|{{ ['a','b']|join(', ') }}|{{ [3,1,2]|first }}"
           "|{{ [3,1,2]|last }}|{{ undefined_var|default('d') }}|{{ '42'|int + 1 }}|{{ 5|string ~ 'x' }}|{{ [2,1]|sort }}",
           NULL, "x|3|abc|a, b|3|2|d|43|5x|[1, 2]");
    EXPECT("{{ tools|selectattr('type', 'equalto', 'function')|map(attribute='name')|join(',') }}",
           "{\"tools\": [{\"type\": \"function\", \"name\": \"f\"}, {\"type\": \"x\", \"name\": \"g\"},"
           " {\"type\": \"function\", \"name\": \"h\"}]}",
           "f,h");
    EXPECT("{% for k, v in d|items %}{{ k }}{{ v }}{% endfor %}|{{ d|length }}", "{\"d\": {\"x\": 1, \"y\": [2]}}",
           "x1y[2]|2");
    EXPECT("{{ 'a\\nb\\n\\nc'|indent(2) }}", NULL, "a\n  b\n\n  c");
    /* tests */
    EXPECT("{{ x is defined }}{{ none is none }}{{ 'a' is string }}{{ {} is mapping }}{{ [1] is iterable }}"
           "{{ {} is iterable }}{{ 3 is number }}{{ 'x' is not string }}",
           NULL, "falsetruetruetruetruefalsetruefalse");
    /* ternary, `in`, `not`, and/or returning operands */
    EXPECT("{{ 'y' if 1 > 2 else 'n' }}|{{ 'a' in 'cat' }}{{ 2 in [1,2] }}{{ 'k' in {'k': 1} }}{{ 'z' not in 'cat' }}"
           "|{{ not [] }}|{{ 0 or 'b' }}|{{ 'a' and 'c' }}",
           NULL, "n|truetruetruetrue|true|b|c");
    /* attribute and item access; an object's missing key falls back to its methods */
    EXPECT("{{ m.role }}{{ m['content'] }}{{ m.missing is defined }}{{ m.get('x', 'dflt') }}",
           "{\"m\": {\"role\": \"user\", \"content\": \"hi\"}}", "userhifalsedflt");
    /* JSON input as JSON.parse gives it: 2.0 is an integer, index-like keys first */
    EXPECT("{{ n }}|{{ o|tojson }}", "{\"n\": 2.0, \"o\": {\"b\": 1, \"10\": 2, \"2\": 3}}",
           "2|{\"2\": 3, \"10\": 2, \"b\": 1}");
    /* loose == as the reference compares underlying values */
    EXPECT("{{ 1 == 1.0 }}{{ '1' == 1 }}{{ none == undefined_var }}{{ 'a' != 'b' }}", NULL, "truetruetruetrue");
    /* strftime_now at the render's fixed time, in UTC */
    EXPECT("{{ strftime_now('%Y-%m-%d %b %B %H:%M %%') }}", NULL, "2026-01-01 Jan January 00:00 %");
    /* non-ASCII passes through byte for byte; length counts UTF-16 units as JavaScript does */
    EXPECT("{{ s }}|{{ s|length }}|{{ s|tojson }}", "{\"s\": \"日本🙂\"}", "日本🙂|4|\"日本🙂\"");
    /* string literal escapes and adjacent literals */
    EXPECT("{{ 'a\\tb' \"c\" '\\u00e9' }}", NULL, "a\tbcé");
    /* the {% generation %} tag of transformers is dropped */
    EXPECT("a {% generation %}b{% endgeneration %} c", NULL, "a b c");
    EXPECT("{% filter upper %}abc{% endfilter %}", NULL, "ABC");
}

static void test_errors(void) {
    char *out = NULL;
    kv_diag d = {0};
    /* raise_exception: KV_EINVAL and exactly the message */
    int rc = render_lim("{% if not messages %}{{ raise_exception('No messages provided.') }}{% endif %}",
                        "{\"messages\": []}", NULL, &out, &d);
    ASSERT_EQ(rc, KV_EINVAL);
    ASSERT_STREQ(d.msg, "No messages provided.");
    ASSERT_TRUE(out == NULL);
    /* syntax errors */
    const char *bad[] = {"{% if %}", "{{", "{{ x", "{% for x in %}{% endfor %}", "{% endfor %}", "{{ 'abc }}",
                         "{% if x %}", "{{ a[ }}", "{{ (1 }}", "{% set %}", "{# open", "{{ 1 + }}", "{% macro %}",
                         "{{ f(a=1, 2) }}", "{% foo %}", "{{ } }}", "{{ 'a' | }}", "{{ x is }}", "{{ $ }}", NULL};
    for (int i = 0; bad[i]; i++) EXPECT_ERR(bad[i], NULL, NULL, KV_EFORMAT, "chat template");
    EXPECT_ERR("{% call f() %}x{% endcall %}", NULL, NULL, KV_EUNSUPPORTED, "call");
    /* runtime errors: a type error, an unknown filter, a bad context */
    EXPECT_ERR("{{ 1 < 'a' }}", NULL, NULL, KV_EFORMAT, "operator");
    EXPECT_ERR("{{ x|nosuchfilter }}", "{\"x\": \"s\"}", NULL, KV_EFORMAT, "nosuchfilter");
    EXPECT_ERR("{{ undefined_var|trim }}", NULL, NULL, KV_EFORMAT, "trim");
    EXPECT_ERR("{{ 1 }}", "{\"true\": 1}", NULL, KV_EFORMAT, "already declared");
    EXPECT_ERR("{% for x in 5 %}{% endfor %}", NULL, NULL, KV_EFORMAT, "for loop");
    EXPECT_ERR("{{ [1](2) }}", NULL, NULL, KV_EFORMAT, "not a function");
    EXPECT_ERR("{% set x.y = 1 %}", "{\"x\": {}}", NULL, KV_EFORMAT, "namespace");
    /* a NUL byte in the source */
    kv_chat_tmpl *t = NULL;
    ASSERT_EQ(kv_chat_tmpl_parse(&t, "a\0b", 3, NULL, &d), KV_EFORMAT);
    ASSERT_TRUE(t == NULL);
    kv_chat_tmpl_free(NULL);
}

static void test_limits(void) {
    kv_chat_limits lim;
    kv_chat_limits_default(&lim);
    ASSERT_TRUE(lim.max_template_bytes >= 65536 && lim.max_output_bytes >= (1u << 20) && lim.max_depth >= 64);
    /* template size */
    kv_chat_limits small = lim;
    small.max_template_bytes = 16;
    EXPECT_ERR("{{ 'this template is longer than sixteen bytes' }}", NULL, &small, KV_ERANGE, "16 bytes");
    /* output bytes */
    small = lim;
    small.max_output_bytes = 100;
    EXPECT_ERR("{% for i in range(1000) %}xxxxxxxxxx{% endfor %}", NULL, &small, KV_ERANGE, "output limit of 100");
    /* one string growing without output: doubling by ~ */
    EXPECT_ERR("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", NULL,
               NULL, KV_ERANGE, "output limit");
    /* loop iterations, across nested loops */
    EXPECT_ERR("{% for i in range(10000000) %}{% endfor %}", NULL, NULL, KV_ERANGE, "loop iteration limit");
    EXPECT_ERR("{% for i in range(2000) %}{% for j in range(2000) %}{% endfor %}{% endfor %}", NULL, NULL, KV_ERANGE,
               "loop iteration limit");
    /* depth: the source's nesting and a macro's recursion */
    size_t n = 20000;
    char *deep = malloc(2 * n + 16);
    strcpy(deep, "{{ ");
    for (size_t i = 0; i < n; i++) strcat(deep + 3 + i, "(");
    size_t k = strlen(deep);
    deep[k++] = '1';
    for (size_t i = 0; i < n; i++) deep[k++] = ')';
    strcpy(deep + k, " }}");
    EXPECT_ERR(deep, NULL, NULL, KV_ERANGE, "nesting depth limit");
    free(deep);
    EXPECT_ERR("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", NULL, NULL, KV_ERANGE, "nesting depth limit");
    /* deep JSON input is bounded by the same depth */
    char *js = malloc(2 * n + 32);
    strcpy(js, "{\"x\": ");
    k = strlen(js);
    for (size_t i = 0; i < 300; i++) js[k++] = '[';
    for (size_t i = 0; i < 300; i++) js[k++] = ']';
    strcpy(js + k, "}");
    EXPECT_ERR("{{ x }}", js, NULL, KV_ERANGE, "nesting depth limit");
    free(js);
    /* memory */
    small = lim;
    small.max_memory_bytes = 1u << 20;
    EXPECT_ERR("{% set ns = namespace(a=[]) %}{% for i in range(100000) %}{% set ns.a = ns.a + [i] %}{% endfor %}", NULL,
               &small, KV_ERANGE, NULL);
    /* after all that, a render still works */
    EXPECT("{{ 'ok' }}", NULL, "ok");
}

/* Text without tags renders as itself. */
static void test_plain(void) {
    char *out = NULL;
    kv_diag d = {0};
    ASSERT_EQ(render_lim("[[[ plain ]]] text", NULL, NULL, &out, &d), 0);
    ASSERT_STREQ(out, "[[[ plain ]]] text");
    free(out);
}

static uint64_t g_rng = 0x243F6A8885A308D3ull;
static uint32_t rnd(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 11);
}

static const char *k_seed =
    "{%- set ns = namespace(last=-1, sys='') -%}\n"
    "{%- macro text(c) -%}{%- if c is string -%}{{ c }}{%- else -%}{% for p in c %}{{ p.text }}{% endfor %}{%- endif -%}{%- endmacro -%}\n"
    "{%- for m in messages[::-1] %}{% if m.role == 'user' and ns.last < 0 %}{% set ns.last = loop.index0 %}{% endif %}{% endfor -%}\n"
    "{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>{% endif -%}\n"
    "{%- for m in messages -%}\n"
    "  {%- if m.role == 'assistant' and m.tool_calls -%}\n"
    "    {%- for tc in m.tool_calls -%}<call>{{ tc.function.name }}:{{ tc.function.arguments | tojson(indent=2) }}</call>{%- endfor -%}\n"
    "  {%- elif m.role == 'tool' -%}<r>{{ text(m.content)|trim }}</r>\n"
    "  {%- else -%}<|{{ m.role }}|>{{ text(m.content).split('</think>')[-1].lstrip() ~ (loop.index ** 2) }}{{ '\\n' if not loop.last else '' }}\n"
    "  {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt %}<|assistant|>{{ raise_exception('x') if messages|length > 99 else '' }}{% endif %}";

static const char *k_ctx =
    "{\"add_generation_prompt\": true, \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\","
    " \"parameters\": {\"type\": \"object\"}}}], \"messages\": [{\"role\": \"system\", \"content\": \"s\"},"
    " {\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"héllo\"}]},"
    " {\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"function\": {\"name\": \"f\", \"arguments\": {\"a\": [1, 2.5]}}}]},"
    " {\"role\": \"tool\", \"content\": \" 42 \"}, {\"role\": \"user\", \"content\": \"<think>x</think> y\"}]}";

static void test_attack(void) {
    bool full = getenv("KV_ATTACK_FULL") && atoi(getenv("KV_ATTACK_FULL")) > 0;
    size_t iters = full ? 200000 : 2000;
    json_error_t je;
    json_t *ctx = json_loads(k_ctx, 0, &je);
    ASSERT_TRUE(ctx != NULL);
    kv_chat_limits lim;
    kv_chat_limits_default(&lim);
    lim.max_loop_iters = 20000;
    lim.max_output_bytes = 1u << 16;
    lim.max_memory_bytes = 8u << 20;
    /* the seed itself renders */
    kv_chat_tmpl *t = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_chat_tmpl_parse(&t, k_seed, strlen(k_seed), &lim, &d), 0);
    char *out = NULL;
    size_t on = 0;
    ASSERT_EQ(kv_chat_render(t, ctx, NULL, &out, &on, &d), 0);
    ASSERT_TRUE(out && strstr(out, "<call>f:{\n  \"a\": [\n    1,\n    2.5\n  ]\n}</call>") != NULL);
    ASSERT_TRUE(out && strstr(out, "<r>42</r>") != NULL && strstr(out, "<|user|>héllo4") != NULL);
    free(out);
    kv_chat_tmpl_free(t);
    size_t slen = strlen(k_seed), n_ok = 0, n_err = 0, bad = 0;
    char *buf = malloc(4 * slen + 64);
    for (size_t it = 0; it < iters; it++) {
        size_t n = slen;
        memcpy(buf, k_seed, n);
        int edits = 1 + (int)(rnd() % 4);
        for (int e = 0; e < edits; e++) {
            size_t p = n ? rnd() % n : 0;
            switch (rnd() % 5) {
            case 0: if (n) buf[p] = (char)(rnd() & 0xFF); break;                  /* flip a byte */
            case 1: n = p; break;                                                 /* cut */
            case 2: if (n) { memmove(buf + p, buf + p + 1, n - p - 1); n--; } break; /* delete */
            case 3: {                                                             /* duplicate a span */
                size_t q = n ? rnd() % n : 0, l = rnd() % 40;
                if (q + l > n) l = n - q;
                if (n + l < 4 * slen) { memmove(buf + p + l, buf + p, n - p); memmove(buf + p, buf + q + (q >= p ? l : 0), l); n += l; }
                break;
            }
            default: {                                                            /* insert a token */
                static const char *toks[] = {"{%", "%}", "{{", "}}", "-", "(", ")", "[", "]", "'", "\"", "|", "~",
                                             "{% for x in range(99) %}", "{% endfor %}", "**", ".", ",", "\\"};
                const char *tk = toks[rnd() % (sizeof toks / sizeof toks[0])];
                size_t l = strlen(tk);
                if (n + l < 4 * slen) { memmove(buf + p + l, buf + p, n - p); memcpy(buf + p, tk, l); n += l; }
            }
            }
        }
        kv_diag dd = {0};
        t = NULL;
        int rc = kv_chat_tmpl_parse(&t, buf, n, &lim, &dd);
        if (rc == 0) {
            out = NULL;
            rc = kv_chat_render(t, ctx, NULL, &out, &on, &dd);
            if (rc == 0 && (!out || strlen(out) > on)) bad++;
            free(out);
            kv_chat_tmpl_free(t);
        }
        if (rc == 0) n_ok++;
        else {
            n_err++;
            if (rc >= 0 || (rc != KV_EINVAL && dd.msg[0] == 0)) bad++;
        }
    }
    free(buf);
    printf("attack: %zu mutated templates: %zu rendered, %zu refused with an error\n", iters, n_ok, n_err);
    ASSERT_EQ(bad, 0);
    ASSERT_TRUE(n_err > 0 && n_ok > 0);
    json_decref(ctx);
}

int main(void) {
    test_semantics();
    test_errors();
    test_limits();
    test_plain();
    test_attack();
    KV_TEST_END();
}
