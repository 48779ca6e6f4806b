/* kv-test-labels: unit attack
 *
 * The output parser of src/chat/toolcall.c (content, reasoning, tool calls)
 * over recorded texts in each family's format: Qwen3's and Hermes' JSON in
 * `<tool_call>`, Qwen3.5's `<function=...>` XML, DeepSeek V3/R1 and V3.1,
 * gpt-oss harmony, `<think>` reasoning (opened by the text or by the
 * prompt). Each text's events are checked against the result worked out by
 * hand from the family's format (the templates in llama.cpp's
 * models/templates/ write these shapes), and then the same text is pushed
 * split at every byte boundary, byte by byte and in random pieces: the
 * events joined must equal the whole-text parse. Malformed calls (bad JSON,
 * no name, unclosed, too big, too many) come back as content, every byte of
 * them. Family detection runs over the markers of the real templates. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/chat.h"

static int failures, checks;
#define CHECK(c, ...)                                                              \
    do {                                                                           \
        checks++;                                                                  \
        if (!(c)) {                                                                \
            failures++;                                                            \
            fprintf(stderr, "FAIL line %d: ", __LINE__);                          \
            fprintf(stderr, __VA_ARGS__);                                          \
            fputc('\n', stderr);                                                   \
        }                                                                          \
    } while (0)

typedef struct out {
    char content[1 << 19], reasoning[4096], calls[1 << 14];
    size_t nc, nr, nk;
    uint32_t n_calls;
    bool bad_index;
} out;

static void add(char *dst, size_t *n, size_t cap, const char *s, size_t k) {
    if (*n + k >= cap) k = cap - 1 - *n;
    memcpy(dst + *n, s, k);
    *n += k;
    dst[*n] = 0;
}

static int on_ev(void *ud, const kv_chat_ev *ev) {
    out *o = ud;
    if (ev->type == KV_CHAT_EV_CONTENT) add(o->content, &o->nc, sizeof o->content, ev->text, ev->n);
    else if (ev->type == KV_CHAT_EV_REASONING) add(o->reasoning, &o->nr, sizeof o->reasoning, ev->text, ev->n);
    else {
        if (ev->index != o->n_calls) o->bad_index = true;
        o->n_calls++;
        char line[4096];
        int k = snprintf(line, sizeof line, "%s %s;", ev->name, ev->args);
        add(o->calls, &o->nk, sizeof o->calls, line, (size_t)k);
    }
    return 0;
}

/* Pushes text in pieces cut at cuts[0..n_cuts) (increasing). */
static void run(const kv_chat_syntax *s, const char *text, size_t n, const size_t *cuts, size_t n_cuts, out *o) {
    memset(o, 0, sizeof *o);
    kv_chat_parser *p = NULL;
    if (kv_chat_parser_new(&p, s)) {
        failures++;
        return;
    }
    size_t at = 0;
    for (size_t i = 0; i <= n_cuts; i++) {
        const size_t to = i < n_cuts ? cuts[i] : n;
        int rc = kv_chat_parser_push(p, text + at, to - at, i == n_cuts, on_ev, o);
        if (rc) failures++;
        at = to;
    }
    CHECK(kv_chat_parser_calls(p) == o->n_calls, "call count");
    kv_chat_parser_free(p);
}

static bool same(const out *a, const out *b) {
    return !strcmp(a->content, b->content) && !strcmp(a->reasoning, b->reasoning) && !strcmp(a->calls, b->calls) &&
           a->n_calls == b->n_calls && !a->bad_index && !b->bad_index;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint64_t next(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return rng;
}

static out whole, piece;

/* The whole text's events must be (content, reasoning, calls); every split
 * must give the same. */
static void expect(int line, const kv_chat_syntax *s, const char *text, const char *content, const char *reasoning,
                   const char *calls) {
    const size_t n = strlen(text);
    run(s, text, n, NULL, 0, &whole);
    CHECK(!strcmp(whole.content, content), "(case at line %d) content '%s', expected '%s'", line, whole.content,
          content);
    CHECK(!strcmp(whole.reasoning, reasoning), "(case at line %d) reasoning '%s', expected '%s'", line,
          whole.reasoning, reasoning);
    CHECK(!strcmp(whole.calls, calls), "(case at line %d) calls '%s', expected '%s'", line, whole.calls, calls);
    if (n > 4096) return; /* every split of a big text: quadratic */
    for (size_t k = 0; k <= n; k++) {
        run(s, text, n, &k, 1, &piece);
        CHECK(same(&whole, &piece), "(case at line %d) split at %zu: content '%s' reasoning '%s' calls '%s'", line,
              k, piece.content, piece.reasoning, piece.calls);
    }
    size_t *cuts = malloc(n * sizeof *cuts);
    for (size_t k = 0; k + 1 < n; k++) cuts[k] = k + 1;
    run(s, text, n, cuts, n ? n - 1 : 0, &piece);
    CHECK(same(&whole, &piece), "(case at line %d) byte by byte: content '%s' reasoning '%s' calls '%s'", line,
          piece.content, piece.reasoning, piece.calls);
    for (int t = 0; t < 50; t++) {
        size_t nc = 0;
        for (size_t k = 1; k < n; k++)
            if (next() % 5 == 0) cuts[nc++] = k;
        run(s, text, n, cuts, nc, &piece);
        CHECK(same(&whole, &piece), "(case at line %d) random pieces", line);
    }
    free(cuts);
}
#define EXPECT(s, text, c, r, k) expect(__LINE__, (s), (text), (c), (r), (k))

#define DS_CALLS_BEGIN "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c>"
#define DS_CALLS_END "<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "end\xef\xbd\x9c>"
#define DS_CALL_BEGIN "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "begin\xef\xbd\x9c>"
#define DS_CALL_END "<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "end\xef\xbd\x9c>"
#define DS_SEP "<\xef\xbd\x9ctool\xe2\x96\x81" "sep\xef\xbd\x9c>"

static void test_hermes(void) {
    kv_chat_syntax s = {.format = KV_CHAT_FMT_HERMES, .think = true, .tools = true};
    /* Qwen3: reasoning, then a call */
    EXPECT(&s, "<think>\nI should look it up.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
               "{\"city\": \"Oslo\", \"days\": 3}}\n</tool_call>",
           "", "I should look it up.", "get_weather {\"city\":\"Oslo\",\"days\":3};");
    /* text, then two parallel calls (Hermes writes arguments as a string sometimes) */
    EXPECT(&s, "Let me check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n"
               "</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Bergen\\\"}\"}"
               "\n</tool_call>",
           "Let me check both.", "", "get_weather {\"city\":\"Oslo\"};get_weather {\"city\":\"Bergen\"};");
    /* a plain answer after reasoning; non-ASCII kept */
    EXPECT(&s, "<think>\n\n</think>\n\nIt is −3 °C in Tromsø ❄", "It is −3 °C in Tromsø ❄", "", "");
    /* no arguments: {} */
    EXPECT(&s, "<tool_call>\n{\"name\": \"now\"}\n</tool_call>", "", "", "now {};");
    /* malformed calls are content, every byte */
    EXPECT(&s, "<tool_call>\n{\"name\": \"x\", \"arguments\": {bad}}\n</tool_call>",
           "<tool_call>\n{\"name\": \"x\", \"arguments\": {bad}}\n</tool_call>", "", "");
    EXPECT(&s, "<tool_call>\n{\"arguments\": {}}\n</tool_call>", "<tool_call>\n{\"arguments\": {}}\n</tool_call>", "",
           "");
    EXPECT(&s, "<tool_call>\n{\"name\": \"a b\"}\n</tool_call>", "<tool_call>\n{\"name\": \"a b\"}\n</tool_call>", "",
           "");
    EXPECT(&s, "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"argu", "Sure.<tool_call>\n{\"name\": \"get_weather\", \"argu",
           "", "");
    /* a marker's prefix at the end is text */
    EXPECT(&s, "a < b and <tool_ca", "a < b and <tool_ca", "", "");
    /* reasoning still open at the end */
    EXPECT(&s, "<think>\nstill going  \n", "", "still going", "");
    /* Qwen3.5: the prompt opened <think>; XML call with a string and a number */
    kv_chat_syntax q35 = s;
    q35.think_open = true;
    json_t *tools = json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{"
                               "\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"},\"days\":{\"type\":"
                               "\"integer\"}}}}}]", 0, NULL);
    q35.tools_json = tools;
    EXPECT(&q35, "\nThe user wants weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n1984"
                 "\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
           "", "The user wants weather.", "get_weather {\"city\":\"1984\",\"days\":3};");
    EXPECT(&q35, "ok</think>x<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</function>\n</tool_call>",
           "x<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</function>\n</tool_call>", "ok", "");
    json_decref(tools);
    /* tools off: calls are text; think off: <think> is text */
    kv_chat_syntax plain = {.format = KV_CHAT_FMT_HERMES};
    EXPECT(&plain, "<think>x</think> <tool_call>\n{\"name\": \"a\"}\n</tool_call>  \n",
           "<think>x</think> <tool_call>\n{\"name\": \"a\"}\n</tool_call>  \n", "", "");
    EXPECT(&plain, " Hello,  world \n\n", " Hello,  world \n\n", "", "");
}

static void test_limits(void) {
    kv_chat_syntax s = {.format = KV_CHAT_FMT_HERMES, .tools = true};
    /* KV_CHAT_MAX_CALLS calls, then the next is content */
    static char text[1 << 16];
    static char calls[1 << 14];
    size_t n = 0, k = 0;
    for (uint32_t i = 0; i <= KV_CHAT_MAX_CALLS; i++) {
        n += (size_t)sprintf(text + n, "<tool_call>\n{\"name\": \"f%u\", \"arguments\": {}}\n</tool_call>\n", i);
        if (i < KV_CHAT_MAX_CALLS) k += (size_t)sprintf(calls + k, "f%u {};", i);
    }
    char last[128];
    sprintf(last, "<tool_call>\n{\"name\": \"f%u\", \"arguments\": {}}\n</tool_call>\n", KV_CHAT_MAX_CALLS);
    run(&s, text, n, NULL, 0, &whole);
    CHECK(whole.n_calls == KV_CHAT_MAX_CALLS && !strcmp(whole.calls, calls), "%u calls", whole.n_calls);
    CHECK(!strcmp(whole.content, last), "the call past the limit is content: '%s'", whole.content);
    /* a block past KV_CHAT_MAX_CALL_BYTES is content, whole or in pieces */
    const size_t big = KV_CHAT_MAX_CALL_BYTES + 100;
    char *b = malloc(big + 64);
    n = (size_t)sprintf(b, "<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": \"");
    memset(b + n, 'y', big - n);
    n = big;
    n += (size_t)sprintf(b + n, "\"}}</tool_call>");
    run(&s, b, n, NULL, 0, &whole);
    CHECK(whole.n_calls == 0 && whole.nc == n && !memcmp(whole.content, b, n), "a huge call is content");
    size_t cuts[64];
    for (int i = 0; i < 64; i++) cuts[i] = (size_t)(i + 1) * (n / 65);
    run(&s, b, n, cuts, 64, &piece);
    CHECK(piece.n_calls == 0 && piece.nc == n && !memcmp(piece.content, b, n), "a huge call in pieces is content");
    free(b);
}

static void test_deepseek(void) {
    kv_chat_syntax s = {.format = KV_CHAT_FMT_DEEPSEEK, .think = true, .tools = true};
    /* V3 / R1 */
    EXPECT(&s, "<think>\nNeed the weather.\n</think>\n\n" DS_CALLS_BEGIN DS_CALL_BEGIN "function" DS_SEP
               "get_weather\n```json\n{\"city\": \"Oslo\"}\n```" DS_CALL_END "\n" DS_CALL_BEGIN "function" DS_SEP
               "get_time\n```json\n{}\n```" DS_CALL_END DS_CALLS_END,
           "", "Need the weather.", "get_weather {\"city\":\"Oslo\"};get_time {};");
    /* V3.1 */
    EXPECT(&s, "Checking." DS_CALLS_BEGIN DS_CALL_BEGIN "get_weather" DS_SEP "{\"city\": \"Oslo\"}" DS_CALL_END
               DS_CALLS_END,
           "Checking.", "", "get_weather {\"city\":\"Oslo\"};");
    /* bad JSON: content */
    EXPECT(&s, DS_CALLS_BEGIN DS_CALL_BEGIN "get_weather" DS_SEP "{city}" DS_CALL_END DS_CALLS_END,
           DS_CALL_BEGIN "get_weather" DS_SEP "{city}" DS_CALL_END, "", "");
    EXPECT(&s, "<think>\nhmm\n</think>\n\nHi there.", "Hi there.", "hmm", "");
}

static void test_harmony(void) {
    kv_chat_syntax s = {.format = KV_CHAT_FMT_HARMONY, .think = true, .tools = true};
    /* analysis, then a call (its <|call|> is end-of-generation: not in the text) */
    EXPECT(&s, "<|channel|>analysis<|message|>Need the weather for Oslo.<|end|><|start|>assistant<|channel|>"
               "commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Oslo\"}",
           "", "Need the weather for Oslo.", "get_weather {\"city\":\"Oslo\"};");
    /* the recipient before the channel, and <|call|> present */
    EXPECT(&s, "<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.get_time<|channel|>commentary "
               "json<|message|>{}<|call|>",
           "", "x", "get_time {};");
    /* analysis then final */
    EXPECT(&s, "<|channel|>analysis<|message|>Simple sum.<|end|><|start|>assistant<|channel|>final<|message|>Four.",
           "Four.", "Simple sum.", "");
    /* a preamble on commentary is content */
    EXPECT(&s, "<|channel|>commentary<|message|>Looking it up.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
           "Looking it up.Done.", "", "");
    /* bad arguments: content */
    EXPECT(&s, "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops",
           "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops", "", "");
    /* no markers at all: content as it is */
    EXPECT(&s, "just text", "just text", "", "");
    /* tools off: a call's arguments are content */
    kv_chat_syntax nt = {.format = KV_CHAT_FMT_HARMONY, .think = true};
    EXPECT(&nt, "<|channel|>commentary to=functions.f<|message|>{}", "{}", "", "");
}

static void test_detect(void) {
    kv_chat_syntax s;
    const char *qwen3 = "{%- if tools %}<tools></tools> <tool_call>\\n{\"name\": <function-name>}</tool_call>"
                        "{% endif %}{{ '<think>\\n' + reasoning_content + '\\n</think>' }}";
    kv_chat_detect(qwen3, strlen(qwen3), &s);
    CHECK(s.format == KV_CHAT_FMT_HERMES && s.think, "qwen3 detected");
    const char *ds = "{{'<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c><\xef\xbd\x9ctool\xe2\x96\x81"
                     "call\xe2\x96\x81" "begin\xef\xbd\x9c>'}}<think>";
    kv_chat_detect(ds, strlen(ds), &s);
    CHECK(s.format == KV_CHAT_FMT_DEEPSEEK && s.think, "deepseek detected");
    const char *oss = "{{- '<|start|>assistant<|channel|>analysis<|message|>' }}";
    kv_chat_detect(oss, strlen(oss), &s);
    CHECK(s.format == KV_CHAT_FMT_HARMONY && s.think, "gpt-oss detected");
    const char *chatml = "{{ '<|im_start|>' + m.role }}";
    kv_chat_detect(chatml, strlen(chatml), &s);
    CHECK(s.format == KV_CHAT_FMT_HERMES && !s.think, "chatml is hermes without think");
    CHECK(kv_chat_prompt_thinks("<|im_start|>assistant\n<think>\n", 30), "an open think");
    CHECK(!kv_chat_prompt_thinks("<|im_start|>assistant\n<think>\n\n</think>\n\n", 40), "a closed think");
}

/* Random bytes and marker soup: never a crash, and pieces equal the whole. */
static void test_attack(void) {
    static const char *bits[] = {"<tool_call>", "</tool_call>", "<think>", "</think>", "{\"name\": \"f\"}", "{", "}",
                                 "\n", " ", "<", "<|channel|>", "<|message|>", "<|end|>", "analysis", "to=functions.g",
                                 DS_CALL_BEGIN, DS_CALL_END, DS_SEP, "x", "<function=f>", "</function>"};
    const int iters = getenv("KV_ATTACK_FULL") ? 20000 : 600;
    char text[512];
    for (int it = 0; it < iters; it++) {
        size_t n = 0;
        while (n < 300) {
            const char *b = bits[next() % (sizeof bits / sizeof bits[0])];
            const size_t k = strlen(b);
            memcpy(text + n, b, k);
            n += k;
            if (next() % 7 == 0) text[n++] = (char)(next() & 0xff);
        }
        kv_chat_syntax s = {.format = (int)(next() % KV_CHAT_FMT_COUNT), .think = next() & 1, .tools = next() & 1,
                            .think_open = next() & 1};
        run(&s, text, n, NULL, 0, &whole);
        size_t cuts[64], nc = 0;
        for (size_t k = 1; k < n && nc < 64; k++)
            if (next() % 8 == 0) cuts[nc++] = k;
        run(&s, text, n, cuts, nc, &piece);
        CHECK(same(&whole, &piece), "attack %d: pieces differ from the whole", it);
    }
}

int main(void) {
    test_hermes();
    test_limits();
    test_deepseek();
    test_harmony();
    test_detect();
    test_attack();
    if (failures) {
        fprintf(stderr, "test_toolcall: %d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("test_toolcall: %d checks passed\n", checks);
    return 0;
}
