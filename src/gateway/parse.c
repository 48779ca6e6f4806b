/* Request bodies of every API into one kv_gw_params. A body is untrusted:
 * the JSON is parsed with a depth bound by jansson, every field is type- and
 * range-checked, counts are bounded (KV_GW_MAX_*), and a wrong field is an
 * error naming it; nothing is clamped silently. Each API's field names live
 * in its adapter (openai.c, anthropic.c, ollama.c); the shared pieces here. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/gateway_internal.h"
#include "http/http_guard.h"
#include "kvasir/grammar.h"
#include "kvasir/chat.h"

/* A number field in [lo, hi]; absent or null leaves *out. */
int kv_gw_num(json_t *o, const char *key, double lo, double hi, double *out, bool *has, kv_diag *d) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_number(v)) return kv_fail(d, KV_EFORMAT, "'%s' must be a number", key);
    const double x = json_number_value(v);
    if (!(x >= lo && x <= hi)) return kv_fail(d, KV_ERANGE, "'%s' is %g, outside [%g, %g]", key, x, lo, hi);
    *out = x;
    if (has) *has = true;
    return 0;
}

int kv_gw_bool(json_t *o, const char *key, bool *out, kv_diag *d) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_boolean(v)) return kv_fail(d, KV_EFORMAT, "'%s' must be true or false", key);
    *out = json_is_true(v);
    return 0;
}

/* The sampler fields every API shares under its own names. */
int kv_gw_sampling(kv_gw_params *p, json_t *o, const char *max_key, kv_diag *d) {
    double x;
    bool has = false;
    int rc;
    x = p->sp.temp;
    if ((rc = kv_gw_num(o, "temperature", 0, 100, &x, NULL, d))) return rc;
    p->sp.temp = (float)x;
    x = p->sp.top_p;
    if ((rc = kv_gw_num(o, "top_p", 1e-6, 1, &x, NULL, d))) return rc;
    p->sp.top_p = (float)x;
    x = p->sp.min_p;
    if ((rc = kv_gw_num(o, "min_p", 0, 1, &x, NULL, d))) return rc;
    p->sp.min_p = (float)x;
    x = p->sp.top_k;
    if ((rc = kv_gw_num(o, "top_k", 0, 1 << 22, &x, &has, d))) return rc;
    if (has && x != (double)(int32_t)x) return kv_fail(d, KV_EFORMAT, "'top_k' must be an integer");
    p->sp.top_k = (int32_t)x;
    json_t *s = json_object_get(o, "seed");
    if (s && !json_is_null(s)) {
        if (!json_is_integer(s) || json_integer_value(s) < 0)
            return kv_fail(d, KV_EFORMAT, "'seed' must be a non-negative integer");
        p->sp.seed = (uint64_t)json_integer_value(s);
        p->has_seed = true;
    }
    if ((rc = kv_gw_bool(o, "ignore_eos", &p->ignore_eos, d))) return rc;
    if (max_key) {
        json_t *m = json_object_get(o, max_key);
        if (m && !json_is_null(m)) {
            if (!json_is_integer(m) || json_integer_value(m) < 1 || json_integer_value(m) > KV_GW_MAX_TOKENS)
                return kv_fail(d, KV_ERANGE, "'%s' must be an integer in [1, %u]", max_key, KV_GW_MAX_TOKENS);
            p->max_tokens = (uint32_t)json_integer_value(m);
            p->has_max_tokens = true;
        }
    }
    return 0;
}

/* "stop": a string or an array of strings. */
int kv_gw_stops(kv_gw_params *p, json_t *o, const char *key, kv_diag *d) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    json_t *one[1] = {v};
    json_t **items = one;
    size_t n = 1;
    if (json_is_array(v)) {
        n = json_array_size(v);
        if (n > KV_GW_MAX_STOP) return kv_fail(d, KV_ERANGE, "'%s' has %zu strings, at most %u", key, n, KV_GW_MAX_STOP);
        items = NULL;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *s = items ? items[i] : json_array_get(v, i);
        if (!json_is_string(s)) return kv_fail(d, KV_EFORMAT, "'%s' must be a string or an array of strings", key);
        const size_t len = json_string_length(s);
        if (len == 0) continue;
        if (len > KV_GW_MAX_STOP_LEN)
            return kv_fail(d, KV_ERANGE, "'%s' string %zu has %zu bytes, at most %u", key, i, len, KV_GW_MAX_STOP_LEN);
        p->stop[p->n_stop] = json_string_value(s);
        p->stop_len[p->n_stop++] = len;
    }
    return 0;
}

/* Message content: a string, or an array of {"type":"text","text":...}
 * blocks (joined). */
int kv_gw_content(kv_gw_params *p, json_t *c, size_t i, kv_diag *d) {
    kv_chat_msg *m = &p->msgs[i];
    if (json_is_string(c)) {
        m->content = json_string_value(c);
        m->len = json_string_length(c);
        return 0;
    }
    if (json_is_null(c)) {
        m->content = "";
        m->len = 0;
        return 0;
    }
    if (!json_is_array(c)) return kv_fail(d, KV_EFORMAT, "message %zu: 'content' must be a string or an array", i);
    size_t total = 0, k;
    json_t *b;
    json_array_foreach(c, k, b) {
        json_t *ty = json_object_get(b, "type"), *tx = json_object_get(b, "text");
        if (!json_is_string(ty) || strcmp(json_string_value(ty), "text") || !json_is_string(tx))
            return kv_fail(d, KV_EUNSUPPORTED, "message %zu: content block %zu is not {\"type\":\"text\",\"text\":...}",
                           i, k);
        total += json_string_length(tx);
    }
    char *s = malloc(total + 1);
    if (!s) return kv_fail(d, KV_ENOMEM, "out of memory");
    p->joined[i] = s;
    size_t at = 0;
    json_array_foreach(c, k, b) {
        json_t *tx = json_object_get(b, "text");
        memcpy(s + at, json_string_value(tx), json_string_length(tx));
        at += json_string_length(tx);
    }
    s[at] = 0;
    m->content = s;
    m->len = at;
    return 0;
}

/* "messages": [{role, content}], roles limited to those the API allows. */
int kv_gw_messages(kv_gw_params *p, json_t *o, bool allow_system, kv_diag *d) {
    json_t *a = json_object_get(o, "messages");
    if (!json_is_array(a)) return kv_fail(d, KV_EFORMAT, "'messages' must be an array");
    const size_t n = json_array_size(a);
    if (n == 0) return kv_fail(d, KV_EINVAL, "'messages' is empty");
    if (p->n_msgs + n > KV_GW_MAX_MSGS)
        return kv_fail(d, KV_ERANGE, "%zu messages, at most %u", p->n_msgs + n, KV_GW_MAX_MSGS);
    for (size_t k = 0; k < n; k++) {
        json_t *m = json_array_get(a, k);
        json_t *r = json_object_get(m, "role");
        if (!json_is_object(m) || !json_is_string(r))
            return kv_fail(d, KV_EFORMAT, "message %zu must be an object with a string 'role'", k);
        const char *role = json_string_value(r);
        if (!strcmp(role, "developer")) role = "system";
        /* "tool" (OpenAI's, Ollama's): for a chat template to render; the
           ChatML fallback refuses it as any other role (routes.c) */
        const bool tool = allow_system && !strcmp(role, "tool");
        p->has_tool_role |= tool;
        if (!tool && strcmp(role, "user") && strcmp(role, "assistant") && !(allow_system && !strcmp(role, "system")))
            return kv_fail(d, KV_EINVAL, "message %zu has role '%.32s'; expected %s", k, role,
                           allow_system ? "system, user or assistant" : "user or assistant");
        const size_t i = p->n_msgs++;
        p->msgs[i].role = role;
        json_t *c = json_object_get(m, "content");
        if (!c && json_is_array(json_object_get(m, "tool_calls"))) c = json_null(); /* a call and no text */
        if (!c) return kv_fail(d, KV_EFORMAT, "message %zu has no 'content'", k);
        int rc = kv_gw_content(p, c, i, d);
        if (rc) return rc;
    }
    return 0;
}

/* One tool in OpenAI's shape: {"type":"function","function":{"name",
 * "description"?, "parameters"?}}. */
static int kv_gw_tool_ok(json_t *t, size_t i, kv_diag *d) {
    json_t *ty = json_object_get(t, "type"), *f = json_object_get(t, "function");
    if (!json_is_object(t) || !json_is_string(ty) || strcmp(json_string_value(ty), "function"))
        return kv_fail(d, KV_EINVAL, "'tools' entry %zu must be {\"type\":\"function\",\"function\":{...}}", i);
    json_t *nm = json_object_get(f, "name"), *pa = json_object_get(f, "parameters");
    if (!json_is_object(f) || !json_is_string(nm) || json_string_length(nm) == 0 ||
        json_string_length(nm) > KV_CHAT_MAX_NAME)
        return kv_fail(d, KV_EINVAL, "'tools' entry %zu: 'function.name' must be a string of 1 to %u bytes", i,
                       KV_CHAT_MAX_NAME);
    if (pa && !json_is_null(pa) && !json_is_object(pa))
        return kv_fail(d, KV_EINVAL, "'tools' entry %zu: 'function.parameters' must be an object", i);
    return 0;
}

/* "tools" in OpenAI's shape (OpenAI, Ollama) into p->tools. */
int kv_gw_tools(kv_gw_params *p, json_t *o, kv_diag *d) {
    json_t *t = json_object_get(o, "tools");
    if (!t || json_is_null(t)) return 0;
    if (!json_is_array(t)) return kv_fail(d, KV_EFORMAT, "'tools' must be an array");
    const size_t n = json_array_size(t);
    if (n > KV_GW_MAX_TOOLS) return kv_fail(d, KV_ERANGE, "'tools' has %zu entries, at most %u", n, KV_GW_MAX_TOOLS);
    size_t i;
    json_t *v;
    json_array_foreach(t, i, v) {
        const int rc = kv_gw_tool_ok(v, i, d);
        if (rc) return rc;
    }
    if (n) p->tools = json_incref(t);
    return 0;
}

/* Is name one of p->tools? */
static bool kv_gw_has_tool(const kv_gw_params *p, const char *name) {
    size_t i;
    json_t *v;
    json_array_foreach(p->tools, i, v) {
        json_t *nm = json_object_get(json_object_get(v, "function"), "name");
        if (json_is_string(nm) && !strcmp(json_string_value(nm), name)) return true;
    }
    return false;
}

/* The tool_choice p asks for, once its tools are known: "auto" and "none"
 * as they are; a call made compulsory ("required", a named function) is
 * sampled under the grammar of its call (gateway/structured.c, set where
 * the template's family is known: routes.c). A choice its tools cannot
 * meet is refused here. */
int kv_gw_tool_choice_check(kv_gw_params *p, kv_diag *d) {
    if (p->tool_choice == KV_GW_TOOLS_NAMED && (!p->tools || !kv_gw_has_tool(p, p->tool_choice_name)))
        return kv_fail(d, KV_EINVAL, "'tool_choice' names the function '%.256s', which is not in 'tools'",
                       p->tool_choice_name);
    if (p->tool_choice == KV_GW_TOOLS_REQUIRED && !p->tools)
        return kv_fail(d, KV_EINVAL, "'tool_choice' requires a tool call but the request has no 'tools'");
    return 0;
}

/* OpenAI's (and Ollama's) "tool_choice": "auto", "none", "required", or
 * {"type":"function","function":{"name":...}}; "parallel_tool_calls". */
int kv_gw_tool_choice_openai(kv_gw_params *p, json_t *o, kv_diag *d) {
    int rc;
    p->parallel_calls = true;
    if ((rc = kv_gw_bool(o, "parallel_tool_calls", &p->parallel_calls, d))) return rc;
    json_t *c = json_object_get(o, "tool_choice");
    if (!c || json_is_null(c)) return kv_gw_tool_choice_check(p, d);
    if (json_is_string(c)) {
        const char *s = json_string_value(c);
        if (!strcmp(s, "auto")) p->tool_choice = KV_GW_TOOLS_AUTO;
        else if (!strcmp(s, "none")) p->tool_choice = KV_GW_TOOLS_NONE;
        else if (!strcmp(s, "required")) p->tool_choice = KV_GW_TOOLS_REQUIRED;
        else return kv_fail(d, KV_EINVAL, "'tool_choice' is '%.32s'; expected auto, none, required or a function", s);
    } else {
        json_t *ty = json_object_get(c, "type");
        json_t *nm = json_object_get(json_object_get(c, "function"), "name");
        if (!json_is_string(ty) || strcmp(json_string_value(ty), "function") || !json_is_string(nm))
            return kv_fail(d, KV_EFORMAT, "'tool_choice' must be a string or {\"type\":\"function\","
                           "\"function\":{\"name\":...}}");
        p->tool_choice = KV_GW_TOOLS_NAMED;
        p->tool_choice_name = json_string_value(nm);
    }
    return kv_gw_tool_choice_check(p, d);
}

/* "chat_template_kwargs" (llama-server's and vLLM's): an object whose
 * entries are top-level variables of the template (at most
 * KV_GW_MAX_KWARGS, none naming a variable the request sets itself). */
int kv_gw_kwargs(kv_gw_params *p, json_t *o, kv_diag *d) {
    static const char *const reserved[] = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"};
    json_t *k = json_object_get(o, "chat_template_kwargs");
    if (!k || json_is_null(k)) return 0;
    if (!json_is_object(k)) return kv_fail(d, KV_EFORMAT, "'chat_template_kwargs' must be an object");
    if (json_object_size(k) > KV_GW_MAX_KWARGS)
        return kv_fail(d, KV_ERANGE, "'chat_template_kwargs' has %zu entries, at most %u", json_object_size(k),
                       KV_GW_MAX_KWARGS);
    for (size_t i = 0; i < sizeof reserved / sizeof reserved[0]; i++)
        if (json_object_get(k, reserved[i]))
            return kv_fail(d, KV_EINVAL, "'chat_template_kwargs' may not set '%s' (the request's own field does)",
                           reserved[i]);
    if (!(p->kwargs = json_copy(k))) return kv_fail(d, KV_ENOMEM, "out of memory");
    return 0;
}

/* A thinking switch (Anthropic's thinking, Ollama's think): the template's
 * enable_thinking. */
int kv_gw_set_thinking(kv_gw_params *p, bool on, kv_diag *d) {
    if (!p->kwargs && !(p->kwargs = json_object())) return kv_fail(d, KV_ENOMEM, "out of memory");
    if (json_object_set_new(p->kwargs, "enable_thinking", json_boolean(on)))
        return kv_fail(d, KV_ENOMEM, "out of memory");
    return 0;
}

int kv_gw_model(kv_gw_params *p, json_t *o, bool required, kv_diag *d) {
    json_t *m = json_object_get(o, "model");
    if (!m || json_is_null(m)) {
        if (required) return kv_fail(d, KV_EINVAL, "'model' is required");
        return 0;
    }
    if (!json_is_string(m) || json_string_length(m) > KV_GW_MAX_MODEL_LEN)
        return kv_fail(d, KV_EFORMAT, "'model' must be a string of at most %u bytes", KV_GW_MAX_MODEL_LEN);
    p->model = json_string_value(m);
    return 0;
}

int kv_gw_parse(kv_gw_params *p, int api, const char *body, size_t n, kv_diag *d) {
    memset(p, 0, sizeof *p);
    p->api = api;
    p->sp = kv_sample_defaults();
    p->add_generation_prompt = true;
    p->parallel_calls = true;
    json_error_t je;
    /* JSON_REJECT_DUPLICATES: one field, one meaning */
    p->json = json_loadb(body, n, JSON_REJECT_DUPLICATES, &je);
    if (!p->json) return kv_fail(d, KV_EFORMAT, "malformed JSON body: %.200s (line %d, column %d)", je.text, je.line,
                                 je.column);
    if (!json_is_object(p->json)) return kv_fail(d, KV_EFORMAT, "the body must be a JSON object");
    if (api < 0 || api >= KV_GW_API_COUNT) return kv_fail(d, KV_EINVAL, "unknown API %d", api);
    const int rc = kv_gw_api(api)->parse(p, p->json, d);
    return rc ? rc : kv_gw_structured_parse(p, p->json, d);
}

int kv_gw_parse_budget(kv_gw_params *p, int api, const char *body, size_t n, size_t budget, size_t *held, bool *over,
                       kv_diag *d) {
    kv_json_budget_install();
    kv_json_budget_begin(budget);
    int rc = kv_gw_parse(p, api, body, n, d);
    *held = kv_json_budget_end(over);
    if (*over) {
        /* what failed was an allocation past the budget, whatever jansson said */
        if (d) *d = (kv_diag){0};
        rc = kv_fail(d, KV_ERANGE, "the JSON body needs more than %zu bytes of memory to parse (too many values or "
                     "nesting for its size); at most %zu", budget, budget);
    }
    return rc;
}

void kv_gw_params_free(kv_gw_params *p) {
    if (!p) return;
    for (size_t i = 0; i < KV_GW_MAX_MSGS; i++) free(p->joined[i]);
    kv_grammar_free(p->grammar);
    free(p->grammar_gbnf);
    json_decref(p->tools);
    json_decref(p->tmpl_msgs);
    json_decref(p->kwargs);
    free(p->prompt_ids);
    free(p->bias);
    if (p->json) json_decref(p->json);
    memset(p, 0, sizeof *p);
}

/* ---- output buffer ---------------------------------------------------- */

void kv_gw_buf_add(kv_gw_buf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t nc = (b->cap ? b->cap * 2 : 1024) + n;
        char *np = realloc(b->p, nc);
        if (!np) {
            b->oom = true;
            return;
        }
        b->p = np;
        b->cap = nc;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void kv_gw_buf_json(kv_gw_buf *b, const char *prefix, json_t *j, const char *suffix) {
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    if (j) json_decref(j);
    if (!s) {
        b->oom = true;
        return;
    }
    kv_gw_buf_add(b, prefix, strlen(prefix));
    kv_gw_buf_add(b, s, strlen(s));
    kv_gw_buf_add(b, suffix, strlen(suffix));
    free(s);
}
