/* Structured output: the request fields that constrain what the model may
 * write, each compiled to one grammar (include/kvasir/grammar.h) that the
 * request's session samples under (kv_session_set_grammar):
 *   OpenAI chat and completions: "response_format" {"type": "text"},
 *     {"type": "json_object"}, {"type": "json_schema", "json_schema":
 *     {"name", "schema", "strict"}};
 *   llama-server's "grammar" (GBNF text; "" is none) and "json_schema" (a
 *     schema), on chat and completions and on its own /completion (which
 *     takes response_format too);
 *   Ollama's "format": "json" or a schema object (/api/chat, /api/generate).
 * At most one of them per request. A field of the wrong shape, a schema
 * outside the compiler's subset or GBNF that does not parse is an error
 * naming the field and carrying the compiler's message (keyword and JSON
 * pointer, or line:column): never ignored.
 *
 * Tool calls: kv_gw_tools_gbnf builds the grammar of a family's tool-call
 * text with each function's arguments following its parameters' schema,
 * for tool_choice "required" (any of the tools) or a named function (that
 * one): a compulsory call is sampled under it (routes.c). Everything here is free of I/O (fuzzed through kv_gw_parse). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/gateway_internal.h"
#include "kvasir/chat.h"
#include "kvasir/grammar.h"

#define KV_GW_STR_(x) #x
#define KV_GW_STR(x) KV_GW_STR_(x)
#define KV_GW_CALLS_MAX_CALLS_1 63 /* calls after the first: KV_CHAT_MAX_CALLS (64) in all */
_Static_assert(KV_GW_CALLS_MAX_CALLS_1 + 1 == KV_CHAT_MAX_CALLS, "a forced output holds what the parser gives");
_Static_assert((int)KV_GW_CALLS_HERMES == (int)KV_CHAT_FMT_HERMES && (int)KV_GW_CALLS_DEEPSEEK == (int)KV_CHAT_FMT_DEEPSEEK &&
                   (int)KV_GW_CALLS_HARMONY == (int)KV_CHAT_FMT_HARMONY,
               "formats are the parser's families");

void kv_gw_grammar_limits(kv_grammar_limits *lim) {
    kv_grammar_limits_default(lim);
    /* one matcher per generating request: its tables are flushed past half
       of this (docs/GRAMMAR.md), so many at once stay bounded */
    lim->max_memory_bytes = KV_GW_GRAMMAR_MEMORY;
    lim->max_text_bytes = KV_GW_GRAMMAR_TEXT;
}

/* A schema value (object or boolean) compiled into p->grammar. */
static int kv_st_schema(kv_gw_params *p, json_t *schema, const char *field, kv_diag *d) {
    if (!json_is_object(schema) && !json_is_boolean(schema))
        return kv_fail(d, KV_EFORMAT, "'%s' must be a JSON schema (an object or a boolean)", field);
    char *text = json_dumps(schema, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!text) return kv_fail(d, KV_ENOMEM, "out of memory");
    kv_grammar_limits lim;
    kv_gw_grammar_limits(&lim);
    kv_diag gd = {0};
    /* kv_grammar_from_schema in two steps: the text is kept for a ring */
    int rc = kv_grammar_schema_to_gbnf(&p->grammar_gbnf, text, strlen(text), &lim, &gd);
    free(text);
    if (!rc) rc = kv_grammar_parse(&p->grammar, p->grammar_gbnf, strlen(p->grammar_gbnf), &lim, &gd);
    if (rc) return kv_fail(d, rc, "'%s': %.400s", field, gd.msg);
    return 0;
}

static int kv_st_gbnf(kv_gw_params *p, json_t *v, const char *field, kv_diag *d) {
    if (!json_is_string(v)) return kv_fail(d, KV_EFORMAT, "'%s' must be a string of GBNF grammar text", field);
    kv_grammar_limits lim;
    kv_gw_grammar_limits(&lim);
    kv_diag gd = {0};
    const int rc = kv_grammar_parse(&p->grammar, json_string_value(v), json_string_length(v), &lim, &gd);
    if (rc) return kv_fail(d, rc, "'%s': %.400s", field, gd.msg);
    if (!(p->grammar_gbnf = strndup(json_string_value(v), json_string_length(v)))) return kv_fail(d, KV_ENOMEM, "out of memory");
    return 0;
}

static int kv_st_json_object(kv_gw_params *p, const char *field, kv_diag *d) {
    kv_grammar_limits lim;
    kv_gw_grammar_limits(&lim);
    kv_diag gd = {0};
    /* kv_grammar_json_object (the schema {"type": "object"}), the text kept for a ring */
    static const char obj[] = "{\"type\": \"object\"}";
    int rc = kv_grammar_schema_to_gbnf(&p->grammar_gbnf, obj, sizeof obj - 1, &lim, &gd);
    if (!rc) rc = kv_grammar_parse(&p->grammar, p->grammar_gbnf, strlen(p->grammar_gbnf), &lim, &gd);
    if (rc) return kv_fail(d, rc, "'%s': %.400s", field, gd.msg);
    return 0;
}

/* OpenAI's response_format. */
static int kv_st_response_format(kv_gw_params *p, json_t *rf, kv_diag *d) {
    if (!json_is_object(rf)) return kv_fail(d, KV_EFORMAT, "'response_format' must be an object");
    json_t *ty = json_object_get(rf, "type");
    if (!json_is_string(ty)) return kv_fail(d, KV_EFORMAT, "'response_format.type' must be a string");
    const char *t = json_string_value(ty);
    if (!strcmp(t, "text")) return 0;
    if (!strcmp(t, "json_object")) return kv_st_json_object(p, "response_format", d);
    if (strcmp(t, "json_schema"))
        return kv_fail(d, KV_EINVAL, "'response_format.type' is '%.64s'; expected text, json_object or json_schema", t);
    json_t *js = json_object_get(rf, "json_schema");
    if (!json_is_object(js)) return kv_fail(d, KV_EFORMAT, "'response_format.json_schema' must be an object");
    json_t *name = json_object_get(js, "name"), *strict = json_object_get(js, "strict");
    if (name && !json_is_null(name) && (!json_is_string(name) || json_string_length(name) > 256))
        return kv_fail(d, KV_EFORMAT, "'response_format.json_schema.name' must be a string of at most 256 bytes");
    /* strict false or true: the schema is enforced either way */
    if (strict && !json_is_null(strict) && !json_is_boolean(strict))
        return kv_fail(d, KV_EFORMAT, "'response_format.json_schema.strict' must be true or false");
    json_t *schema = json_object_get(js, "schema");
    if (!schema) return kv_fail(d, KV_EINVAL, "'response_format.json_schema.schema' is required");
    return kv_st_schema(p, schema, "response_format.json_schema.schema", d);
}

/* The field of o that constrains the output under api, or NULL; two of
 * them is an error. */
static int kv_st_pick(json_t *o, int api, const char **field, json_t **val, kv_diag *d) {
    static const char *const openai[] = {"response_format", "grammar", "json_schema", NULL};
    static const char *const ollama[] = {"format", NULL};
    static const char *const none[] = {NULL};
    const char *const *keys = api == KV_GW_OPENAI_CHAT || api == KV_GW_OPENAI_TEXT || api == KV_GW_LLAMA ? openai
                            : api == KV_GW_OLLAMA || api == KV_GW_OLLAMA_GEN                         ? ollama
                                                                                                     : none;
    *field = NULL;
    *val = NULL;
    for (size_t i = 0; keys[i]; i++) {
        json_t *v = json_object_get(o, keys[i]);
        /* null, and llama-server's "grammar": "" default, ask for nothing */
        if (!v || json_is_null(v) || (!strcmp(keys[i], "grammar") && json_is_string(v) && !json_string_length(v)))
            continue;
        if (*field)
            return kv_fail(d, KV_EINVAL, "'%s' and '%s' both constrain the output; give one", *field, keys[i]);
        *field = keys[i];
        *val = v;
    }
    return 0;
}

int kv_gw_structured_parse(kv_gw_params *p, json_t *o, kv_diag *d) {
    const char *field;
    json_t *v;
    int rc = kv_st_pick(o, p->api, &field, &v, d);
    if (rc || !field) return rc;
    if (!strcmp(field, "response_format")) rc = kv_st_response_format(p, v, d);
    else if (!strcmp(field, "grammar")) rc = kv_st_gbnf(p, v, field, d);
    else if (!strcmp(field, "json_schema")) rc = kv_st_schema(p, v, field, d);
    else if (json_is_string(v) && !strcmp(json_string_value(v), "json")) rc = kv_st_json_object(p, field, d);
    else if (json_is_string(v) && json_string_length(v) == 0) rc = 0; /* Ollama's "no format" */
    else if (json_is_object(v)) rc = kv_st_schema(p, v, field, d);
    else rc = kv_fail(d, KV_EFORMAT, "'format' must be \"json\" or a JSON schema object");
    if (!rc && p->grammar) p->grammar_field = field;
    return rc;
}

/* ---- tool calls ---------------------------------------------------------- */

/* A function name as OpenAI allows it: 1-64 of [A-Za-z0-9_-] (so it sits in
 * a GBNF literal and a JSON string without escapes). */
static bool kv_st_name_ok(const char *s, size_t n) {
    if (n == 0 || n > 64) return false;
    for (size_t i = 0; i < n; i++) {
        const char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-'))
            return false;
    }
    return true;
}

static int kv_st_cat(char **buf, size_t *len, size_t *cap, const char *s, size_t max, kv_diag *d) {
    const size_t n = strlen(s);
    if (*len + n + 1 > max) return kv_fail(d, KV_ERANGE, "tools: the grammar exceeds %zu bytes", max);
    if (*len + n + 1 > *cap) {
        size_t nc = *cap ? *cap : 1024;
        while (nc < *len + n + 1) nc *= 2;
        char *nb = realloc(*buf, nc);
        if (!nb) return kv_fail(d, KV_ENOMEM, "out of memory");
        *buf = nb;
        *cap = nc;
    }
    memcpy(*buf + *len, s, n + 1);
    *len += n;
    return 0;
}

/* Each format's call text as GBNF pieces: the list of calls opens and
 * closes with list_open/list_close and its calls are separated by sep (no
 * list: one call, parallel or not); a call is call_open, one function's
 * alternative (alt_pre, its name, alt_mid, the rule of its arguments, alt_post), then
 * call_close. The markers are the texts the family's templates write. */
typedef struct kv_st_calls {
    const char *list_open, *list_close, *sep; /* NULL sep: one call only */
    const char *call_open, *call_close;
    const char *alt_pre, *alt_mid, *alt_post; /* a function's alternative: pre NAME mid RULE post */
} kv_st_calls;

#define KV_DS(x) "<\xef\xbd\x9c" x "\xef\xbd\x9c>" /* DeepSeek's <｜x｜>, x with ▁ */
#define KV_US "\xe2\x96\x81"
static const kv_st_calls kv_st_calls_of[KV_GW_CALLS_COUNT] = {
    /* Qwen: <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>, "\n" between */
    [KV_GW_CALLS_HERMES] = {"", "", "\"\\n\"", "\"<tool_call>\\n{\\\"name\\\": \"", "\"}\\n</tool_call>\"",
                            "\"\\\"", "\\\", \\\"arguments\\\": \"", ""},
    /* DeepSeek V3.1: NAME<｜tool▁sep｜>ARGS, calls side by side */
    [KV_GW_CALLS_DEEPSEEK] = {"\"" KV_DS("tool" KV_US "calls" KV_US "begin") "\"",
                              "\"" KV_DS("tool" KV_US "calls" KV_US "end") "\"", "",
                              "\"" KV_DS("tool" KV_US "call" KV_US "begin") "\"",
                              "\"" KV_DS("tool" KV_US "call" KV_US "end") "\"",
                              "\"", KV_DS("tool" KV_US "sep") "\"", ""},
    /* gpt-oss: a commentary message to functions.NAME; its <|call|> ends the turn (one call) */
    [KV_GW_CALLS_HARMONY] = {"", "", NULL, "\"<|channel|>commentary to=functions.\"", "",
                             "\"", " <|constrain|>json<|message|>\"", ""},
    /* DeepSeek V3 and R1: function<｜tool▁sep｜>NAME and the arguments fenced, "\n" between */
    [KV_GW_CALLS_DEEPSEEK_FENCED] = {"\"" KV_DS("tool" KV_US "calls" KV_US "begin") "\"",
                                     "\"" KV_DS("tool" KV_US "calls" KV_US "end") "\"", "\"\\n\"",
                                     "\"" KV_DS("tool" KV_US "call" KV_US "begin") "\"",
                                     "\"" KV_DS("tool" KV_US "call" KV_US "end") "\"",
                                     "\"function" KV_DS("tool" KV_US "sep"), "\\n```json\\n\"", "\"\\n```\""},
};

int kv_gw_tools_gbnf(char **gbnf, json_t *tools, const char *only, int format, bool parallel, bool close_think,
                     kv_diag *d) {
    *gbnf = NULL;
    if (format < 0 || format >= KV_GW_CALLS_COUNT)
        return kv_fail(d, KV_EUNSUPPORTED, "tools: tool-call format %d is not known", format);
    const kv_st_calls *cf = &kv_st_calls_of[format];
    if (!json_is_array(tools) || json_array_size(tools) == 0)
        return kv_fail(d, KV_EINVAL, "'tools' must be a non-empty array");
    if (json_array_size(tools) > KV_GW_CALLS_MAX_TOOLS)
        return kv_fail(d, KV_ERANGE, "'tools' has %zu functions, at most %u", json_array_size(tools), KV_GW_CALLS_MAX_TOOLS);
    kv_grammar_limits lim;
    kv_gw_grammar_limits(&lim);
    char *buf = NULL, *alts = NULL;
    size_t len = 0, cap = 0, alen = 0, acap = 0;
    int rc = 0, n_alt = 0;
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        json_t *fn = json_object_get(t, "function"), *ty = json_object_get(t, "type");
        if (!json_is_object(t) || !json_is_object(fn) || (ty && !(json_is_string(ty) &&
                                                                 !strcmp(json_string_value(ty), "function")))) {
            rc = kv_fail(d, KV_EFORMAT, "tools[%zu] must be {\"type\": \"function\", \"function\": {...}}", i);
            break;
        }
        json_t *nm = json_object_get(fn, "name");
        if (!json_is_string(nm) || !kv_st_name_ok(json_string_value(nm), json_string_length(nm))) {
            rc = kv_fail(d, KV_EFORMAT, "tools[%zu].function.name must be 1-64 letters, digits, '_' or '-'", i);
            break;
        }
        const char *name = json_string_value(nm);
        if (only && strcmp(only, name)) continue;
        json_t *params = json_object_get(fn, "parameters");
        json_t *empty = NULL;
        if (!params || json_is_null(params)) /* no parameters: an empty argument object */
            params = empty = json_pack("{s:s,s:b}", "type", "object", "additionalProperties", 0);
        char *text = params ? json_dumps(params, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
        json_decref(empty);
        if (!text) {
            rc = kv_fail(d, KV_ENOMEM, "out of memory");
            break;
        }
        char rule[32], *args = NULL;
        snprintf(rule, sizeof rule, "tool%zu", i);
        kv_diag gd = {0};
        rc = kv_grammar_schema_to_gbnf_named(&args, text, strlen(text), rule, &lim, &gd);
        free(text);
        if (rc) {
            rc = kv_fail(d, rc, "tools[%zu].function.parameters (%s): %.400s", i, name, gd.msg);
            break;
        }
        /* the name: 1-64 of [A-Za-z0-9_-] (kv_st_name_ok), nothing to escape */
        char alt[256];
        snprintf(alt, sizeof alt, "%s%s%s%s %s %s", n_alt ? "\n    | " : "", cf->alt_pre, name, cf->alt_mid, rule,
                 cf->alt_post);
        n_alt++;
        rc = kv_st_cat(&buf, &len, &cap, args, lim.max_text_bytes, d);
        free(args);
        if (!rc) rc = kv_st_cat(&buf, &len, &cap, "\n", lim.max_text_bytes, d);
        if (!rc) rc = kv_st_cat(&alts, &alen, &acap, alt, lim.max_text_bytes, d);
        if (rc) break;
    }
    if (!rc && only && !n_alt) rc = kv_fail(d, KV_EINVAL, "tool_choice names function '%.64s', which is not in 'tools'", only);
    char head[256];
    /* parallel: at most KV_GW_CALLS_MAX_CALLS, as many as the output parser gives */
    snprintf(head, sizeof head, "root ::= %s%s call%s%s%s %s\n", close_think ? "\"</think>\\n\\n\" " : "",
             *cf->list_open ? cf->list_open : "", parallel && cf->sep ? " (" : "", parallel && cf->sep ? cf->sep : "",
             parallel && cf->sep ? " call){0," KV_GW_STR(KV_GW_CALLS_MAX_CALLS_1) "}" : "", cf->list_close);
    if (!rc) rc = kv_st_cat(&buf, &len, &cap, head, lim.max_text_bytes, d);
    if (!rc) rc = kv_st_cat(&buf, &len, &cap, "call ::= ", lim.max_text_bytes, d);
    if (!rc) rc = kv_st_cat(&buf, &len, &cap, cf->call_open, lim.max_text_bytes, d);
    if (!rc) rc = kv_st_cat(&buf, &len, &cap, " (\n      ", lim.max_text_bytes, d);
    if (!rc) rc = kv_st_cat(&buf, &len, &cap, alts, lim.max_text_bytes, d);
    if (!rc) rc = kv_st_cat(&buf, &len, &cap, ") ", lim.max_text_bytes, d);
    if (!rc) rc = kv_st_cat(&buf, &len, &cap, cf->call_close, lim.max_text_bytes, d);
    if (!rc) rc = kv_st_cat(&buf, &len, &cap, "\n", lim.max_text_bytes, d);
    free(alts);
    if (rc) {
        free(buf);
        return rc;
    }
    *gbnf = buf;
    return 0;
}

int kv_gw_tools_grammar(kv_grammar **out, json_t *tools, const char *only, int format, bool parallel, bool close_think,
                        kv_diag *d) {
    *out = NULL;
    char *gbnf = NULL;
    int rc = kv_gw_tools_gbnf(&gbnf, tools, only, format, parallel, close_think, d);
    if (rc) return rc;
    kv_grammar_limits lim;
    kv_gw_grammar_limits(&lim);
    kv_diag gd = {0};
    rc = kv_grammar_parse(out, gbnf, strlen(gbnf), &lim, &gd);
    free(gbnf);
    if (rc) return kv_fail(d, rc, "tools: %.400s", gd.msg);
    return 0;
}

bool kv_gw_tool_call_forced(const kv_gw_params *p) {
    return p->tools && (p->tool_choice == KV_GW_TOOLS_REQUIRED || p->tool_choice == KV_GW_TOOLS_NAMED);
}

int kv_gw_tool_choice_grammar(kv_grammar **out, const kv_gw_params *p, int format, bool think_open, kv_diag *d) {
    *out = NULL;
    const int rc = kv_gw_tools_grammar(out, p->tools, p->tool_choice == KV_GW_TOOLS_NAMED ? p->tool_choice_name : NULL,
                                       format, p->parallel_calls, think_open, d);
    if (rc) {
        char msg[sizeof d->msg];
        snprintf(msg, sizeof msg, "%s", d->msg);
        return kv_fail(d, rc, "'tool_choice': %.400s", msg);
    }
    return 0;
}
