/* Anthropic's shapes: POST /v1/messages, whole ({"type":"message",
 * "content":[{"type":"text","text"}],"stop_reason","usage"}) and as its
 * event stream (message_start, content_block_start, ping,
 * content_block_delta..., content_block_stop, message_delta, message_stop).
 * "system" is a top-level field (string or text blocks), max_tokens is
 * required, stop strings are "stop_sequences". Tools: "tools" ({name,
 * input_schema}), tool_use blocks in answers (stop_reason "tool_use";
 * streamed as a content_block_start and one input_json_delta), tool_use and
 * tool_result blocks in requests (the template's tool_calls and role "tool"
 * messages); reasoning as thinking blocks ("thinking" in the request sets
 * the template's enable_thinking). Errors:
 * {"type":"error","error":{"type","message"}}. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/gateway_internal.h"
#include "kvasir/chat.h"

int kv_gw_bool(json_t *o, const char *key, bool *out, kv_diag *d);
int kv_gw_sampling(kv_gw_params *p, json_t *o, const char *max_key, kv_diag *d);
int kv_gw_stops(kv_gw_params *p, json_t *o, const char *key, kv_diag *d);
int kv_gw_messages(kv_gw_params *p, json_t *o, bool allow_system, kv_diag *d);
int kv_gw_model(kv_gw_params *p, json_t *o, bool required, kv_diag *d);
int kv_gw_content(kv_gw_params *p, json_t *c, size_t i, kv_diag *d);

/* Anthropic's tools ({name, description?, input_schema}) in OpenAI's shape
 * for the template and the parser. */
static int kv_an_tools(kv_gw_params *p, json_t *o, kv_diag *d) {
    json_t *t = json_object_get(o, "tools");
    if (!t || json_is_null(t)) return 0;
    if (!json_is_array(t)) return kv_fail(d, KV_EFORMAT, "'tools' must be an array");
    if (json_array_size(t) > KV_GW_MAX_TOOLS)
        return kv_fail(d, KV_ERANGE, "'tools' has %zu entries, at most %u", json_array_size(t), KV_GW_MAX_TOOLS);
    if (!json_array_size(t)) return 0;
    if (!(p->tools = json_array())) return kv_fail(d, KV_ENOMEM, "out of memory");
    size_t i;
    json_t *v;
    json_array_foreach(t, i, v) {
        json_t *nm = json_object_get(v, "name"), *ty = json_object_get(v, "type");
        json_t *sc = json_object_get(v, "input_schema"), *de = json_object_get(v, "description");
        if (ty && !json_is_null(ty) && !(json_is_string(ty) && !strcmp(json_string_value(ty), "custom")))
            return kv_fail(d, KV_EUNSUPPORTED, "'tools' entry %zu has type '%.64s'; only custom tools are served", i,
                           json_is_string(ty) ? json_string_value(ty) : "?");
        if (!json_is_string(nm) || !json_string_length(nm) || json_string_length(nm) > KV_CHAT_MAX_NAME)
            return kv_fail(d, KV_EINVAL, "'tools' entry %zu: 'name' must be a string of 1 to %u bytes", i,
                           KV_CHAT_MAX_NAME);
        if (!json_is_object(sc)) return kv_fail(d, KV_EINVAL, "'tools' entry %zu: 'input_schema' must be an object", i);
        if (de && !json_is_string(de))
            return kv_fail(d, KV_EFORMAT, "'tools' entry %zu: 'description' must be a string", i);
        /* OpenAI's order (name, description, parameters): templates print it with tojson */
        json_t *f = json_pack("{s:O}", "name", nm);
        if (f && de) json_object_set(f, "description", de);
        if (f) json_object_set(f, "parameters", sc);
        if (!f || json_array_append_new(p->tools, json_pack("{s:s,s:o}", "type", "function", "function", f)))
            return kv_fail(d, KV_ENOMEM, "out of memory");
    }
    return 0;
}

/* {"type": "auto" | "any" | "tool" (with "name") | "none"} */
static int kv_an_tool_choice(kv_gw_params *p, json_t *o, kv_diag *d) {
    json_t *c = json_object_get(o, "tool_choice");
    if (c && !json_is_null(c)) {
        json_t *ty = json_object_get(c, "type"), *nm = json_object_get(c, "name"), *dp;
        const char *t = json_is_string(ty) ? json_string_value(ty) : "";
        if (!strcmp(t, "auto")) p->tool_choice = KV_GW_TOOLS_AUTO;
        else if (!strcmp(t, "none")) p->tool_choice = KV_GW_TOOLS_NONE;
        else if (!strcmp(t, "any")) p->tool_choice = KV_GW_TOOLS_REQUIRED;
        else if (!strcmp(t, "tool") && json_is_string(nm)) {
            p->tool_choice = KV_GW_TOOLS_NAMED;
            p->tool_choice_name = json_string_value(nm);
        } else {
            return kv_fail(d, KV_EINVAL, "'tool_choice' must be {\"type\": auto, any, none, or tool with a name}");
        }
        if ((dp = json_object_get(c, "disable_parallel_tool_use")) && json_is_true(dp)) p->parallel_calls = false;
    }
    return kv_gw_tool_choice_check(p, d);
}

/* "thinking": {"type":"enabled","budget_tokens":N} or {"type":"disabled"},
 * the template's enable_thinking. A budget below max_tokens binds: after N
 * reasoning tokens the family's end of reasoning is forced (budget.c); one
 * at or above it never binds. */
static int kv_an_thinking(kv_gw_params *p, json_t *o, kv_diag *d) {
    json_t *t = json_object_get(o, "thinking");
    if (!t || json_is_null(t)) return 0;
    json_t *ty = json_object_get(t, "type"), *bt = json_object_get(t, "budget_tokens");
    const char *s = json_is_string(ty) ? json_string_value(ty) : "";
    if (!strcmp(s, "disabled")) return kv_gw_set_thinking(p, false, d);
    if (strcmp(s, "enabled")) return kv_fail(d, KV_EINVAL, "'thinking.type' must be \"enabled\" or \"disabled\"");
    if (!json_is_integer(bt) || json_integer_value(bt) < 1 || json_integer_value(bt) > KV_GW_MAX_TOKENS)
        return kv_fail(d, KV_EINVAL, "'thinking.budget_tokens' must be an integer in [1, %u]", KV_GW_MAX_TOKENS);
    if ((uint64_t)json_integer_value(bt) < p->max_tokens) {
        p->has_think_budget = true;
        p->think_budget = (uint32_t)json_integer_value(bt);
    }
    return kv_gw_set_thinking(p, true, d);
}

/* A message for the template (OpenAI's shape) and its p->msgs entry (the
 * role, and the content pointing into the template's message). */
static int kv_an_add(kv_gw_params *p, const char *role, json_t *m, kv_diag *d) {
    if (p->n_msgs >= KV_GW_MAX_MSGS) {
        json_decref(m);
        return kv_fail(d, KV_ERANGE, "more than %u messages (tool results count one each)", KV_GW_MAX_MSGS);
    }
    if (!m || json_array_append_new(p->tmpl_msgs, m)) return kv_fail(d, KV_ENOMEM, "out of memory");
    json_t *c = json_object_get(m, "content");
    kv_chat_msg *e = &p->msgs[p->n_msgs++];
    e->role = role;
    e->content = json_string_value(c);
    e->len = json_string_length(c);
    p->has_tool_role |= !strcmp(role, "tool");
    return 0;
}

/* The text of a tool_result's content: a string, or text blocks joined. */
static json_t *kv_an_result_text(json_t *c, size_t k, size_t j, kv_diag *d) {
    if (!c || json_is_null(c)) return json_string("");
    if (json_is_string(c)) return json_incref(c);
    if (!json_is_array(c))
        return kv_fail(d, KV_EFORMAT, "message %zu block %zu: 'content' must be a string or blocks", k, j), NULL;
    json_t *s = json_string("");
    size_t i;
    json_t *b;
    json_array_foreach(c, i, b) {
        json_t *ty = json_object_get(b, "type"), *tx = json_object_get(b, "text");
        if (!json_is_string(ty) || strcmp(json_string_value(ty), "text") || !json_is_string(tx)) {
            json_decref(s);
            return kv_fail(d, KV_EUNSUPPORTED, "message %zu block %zu: a tool result may hold text blocks only", k,
                           j), NULL;
        }
        char *cat = NULL;
        if (asprintf(&cat, "%s%s", json_string_value(s), json_string_value(tx)) < 0) cat = NULL;
        json_decref(s);
        s = cat ? json_string(cat) : NULL;
        free(cat);
        if (!s) return kv_fail(d, KV_ENOMEM, "out of memory"), NULL;
    }
    return s;
}

/* "messages": user and assistant turns, content a string or blocks: text,
 * thinking (the template's reasoning_content), tool_use (an assistant's
 * call: its tool_calls), tool_result (a user's: one role "tool" message
 * each, before the user's text). */
static int kv_an_messages(kv_gw_params *p, json_t *o, kv_diag *d) {
    json_t *a = json_object_get(o, "messages");
    if (!json_is_array(a)) return kv_fail(d, KV_EFORMAT, "'messages' must be an array");
    if (!json_array_size(a)) return kv_fail(d, KV_EINVAL, "'messages' is empty");
    size_t k, j;
    json_t *m, *b;
    int rc0;
    json_array_foreach(a, k, m) {
        json_t *r = json_object_get(m, "role"), *c = json_object_get(m, "content");
        const char *role = json_is_string(r) ? json_string_value(r) : "";
        if (!json_is_object(m) || (strcmp(role, "user") && strcmp(role, "assistant")))
            return kv_fail(d, KV_EINVAL, "message %zu must have role user or assistant", k);
        role = !strcmp(role, "user") ? "user" : "assistant";
        if (json_is_string(c)) {
            if ((rc0 = kv_an_add(p, role, json_pack("{s:s,s:O}", "role", role, "content", c), d))) return rc0;
            continue;
        }
        if (!json_is_array(c)) return kv_fail(d, KV_EFORMAT, "message %zu: 'content' must be a string or an array", k);
        json_t *text = json_string(""), *calls = json_array(), *think = NULL;
        int rc = text && calls ? 0 : kv_fail(d, KV_ENOMEM, "out of memory");
        json_array_foreach(c, j, b) {
            if (rc) break;
            json_t *ty = json_object_get(b, "type");
            const char *t = json_is_string(ty) ? json_string_value(ty) : "";
            if (!strcmp(t, "text") && json_is_string(json_object_get(b, "text"))) {
                char *cat = NULL;
                if (asprintf(&cat, "%s%s", json_string_value(text), json_string_value(json_object_get(b, "text"))) < 0)
                    cat = NULL;
                json_decref(text);
                text = cat ? json_string(cat) : NULL;
                free(cat);
                if (!text) rc = kv_fail(d, KV_ENOMEM, "out of memory");
            } else if (!strcmp(t, "thinking") && !strcmp(role, "assistant") &&
                       json_is_string(json_object_get(b, "thinking"))) {
                json_decref(think);
                think = json_incref(json_object_get(b, "thinking"));
            } else if (!strcmp(t, "redacted_thinking") && !strcmp(role, "assistant")) {
                /* opaque to anyone but its issuer: nothing to render */
            } else if (!strcmp(t, "tool_use") && !strcmp(role, "assistant")) {
                json_t *id = json_object_get(b, "id"), *nm = json_object_get(b, "name");
                json_t *in = json_object_get(b, "input");
                if (!json_is_string(id) || !json_is_string(nm) || !json_is_object(in))
                    rc = kv_fail(d, KV_EFORMAT, "message %zu block %zu: tool_use needs a string 'id', 'name' and an "
                                 "object 'input'", k, j);
                else if (json_array_append_new(calls, json_pack("{s:O,s:s,s:{s:O,s:O}}", "id", id, "type", "function",
                                                                "function", "name", nm, "arguments", in)))
                    rc = kv_fail(d, KV_ENOMEM, "out of memory");
            } else if (!strcmp(t, "tool_result") && !strcmp(role, "user")) {
                json_t *id = json_object_get(b, "tool_use_id");
                if (!json_is_string(id)) {
                    rc = kv_fail(d, KV_EFORMAT, "message %zu block %zu: tool_result needs a string 'tool_use_id'", k,
                                 j);
                    break;
                }
                json_t *rt = kv_an_result_text(json_object_get(b, "content"), k, j, d);
                if (!rt) rc = d->code ? d->code : KV_ENOMEM;
                else rc = kv_an_add(p, "tool", json_pack("{s:s,s:O,s:o}", "role", "tool", "tool_call_id", id,
                                                         "content", rt), d);
            } else {
                rc = kv_fail(d, KV_EUNSUPPORTED, "message %zu: content block %zu of type '%.32s' is not served in a "
                             "%s message", k, j, t, role);
            }
        }
        if (!rc && (json_string_length(text) || json_array_size(calls) || think || !strcmp(role, "assistant") ||
                    !json_array_size(c))) {
            json_t *msg = json_pack("{s:s,s:O}", "role", role, "content", text);
            if (msg && json_array_size(calls)) json_object_set(msg, "tool_calls", calls);
            if (msg && think) json_object_set(msg, "reasoning_content", think);
            rc = kv_an_add(p, role, msg, d);
        }
        json_decref(text);
        json_decref(calls);
        json_decref(think);
        if (rc) return rc;
    }
    return 0;
}

static int kv_an_parse(kv_gw_params *p, json_t *o, kv_diag *d) {
    int rc;
    if ((rc = kv_gw_model(p, o, true, d))) return rc;
    if (!(p->tmpl_msgs = json_array())) return kv_fail(d, KV_ENOMEM, "out of memory");
    json_t *sys = json_object_get(o, "system");
    if (sys && !json_is_null(sys)) {
        p->msgs[0].role = "system";
        p->n_msgs = 1;
        if ((rc = kv_gw_content(p, sys, 0, d))) return rc;
        if (json_array_append_new(p->tmpl_msgs, json_pack("{s:s,s:s%}", "role", "system", "content",
                                                          p->msgs[0].content, p->msgs[0].len)))
            return kv_fail(d, KV_ENOMEM, "out of memory");
    }
    if ((rc = kv_an_messages(p, o, d))) return rc;
    if ((rc = kv_gw_sampling(p, o, "max_tokens", d))) return rc;
    if (!p->has_max_tokens) return kv_fail(d, KV_EINVAL, "'max_tokens' is required");
    if ((rc = kv_gw_stops(p, o, "stop_sequences", d))) return rc;
    if ((rc = kv_gw_bool(o, "stream", &p->stream, d))) return rc;
    if ((rc = kv_an_tools(p, o, d)) || (rc = kv_an_tool_choice(p, o, d)) || (rc = kv_an_thinking(p, o, d)))
        return rc;
    /* fields that change the answer and are not served: refused by name */
    json_t *v = json_object_get(o, "mcp_servers");
    if (v && !json_is_null(v) && !(json_is_array(v) && !json_array_size(v)))
        return kv_fail(d, KV_EUNSUPPORTED, "'mcp_servers' is not supported by this server");
    if ((v = json_object_get(o, "container")) && !json_is_null(v))
        return kv_fail(d, KV_EUNSUPPORTED, "'container' is not supported by this server");
    return 0;
}

static const char *kv_an_stop(const kv_gw_result *r) {
    return r->stop_seq ? "stop_sequence" : r->finish == KV_GW_FINISH_LENGTH ? "max_tokens"
         : r->finish == KV_GW_FINISH_TOOLS ? "tool_use" : "end_turn";
}

static char *kv_an_error(unsigned status, const char *msg) {
    const char *type = status == 401 ? "authentication_error" : status == 402 ? "billing_error"
                     : status == 404 ? "not_found_error"
                     : status == 413 ? "request_too_large" : status == 503 ? "overloaded_error"
                     : status >= 500 ? "api_error" : "invalid_request_error";
    json_t *j = json_pack("{s:s,s:{s:s,s:s}}", "type", "error", "error", "type", type, "message", msg);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

static json_t *kv_an_message(const kv_gw_result *r, json_t *content, bool done) {
    json_t *m = json_pack("{s:s,s:s,s:s,s:s,s:o,s:o,s:o,s:{s:I,s:I,s:I,s:I}}", "id", r->id, "type", "message", "role",
                          "assistant", "model", r->model, "content", content, "stop_reason",
                          done ? json_string(kv_an_stop(r)) : json_null(), "stop_sequence",
                          done && r->stop_seq ? json_string(r->stop_seq) : json_null(), "usage", "input_tokens",
                          (json_int_t)(r->prompt_tokens - r->cached_tokens), "cache_creation_input_tokens",
                          (json_int_t)0, "cache_read_input_tokens", (json_int_t)r->cached_tokens, "output_tokens",
                          (json_int_t)(done ? r->completion_tokens : 0));
    return m;
}

/* A tool_use block: the call's arguments as its input (an object); in a
 * stream, input is {} and the arguments follow as input_json_delta. */
static json_t *kv_an_tool_use(const kv_gw_call *c, bool whole) {
    json_t *in = whole ? json_loadb(c->args, c->args_len, 0, NULL) : json_object();
    return in ? json_pack("{s:s,s:s,s:s,s:o}", "type", "tool_use", "id", c->id, "name", c->name, "input", in) : NULL;
}

static char *kv_an_full(const kv_gw_result *r, const kv_gw_answer *a) {
    json_t *content = json_array();
    if (content && a->rn)
        json_array_append_new(content, json_pack("{s:s,s:s%,s:s}", "type", "thinking", "thinking", a->reasoning,
                                                 a->rn, "signature", ""));
    if (content && (a->n || (!a->n_calls && !a->rn)))
        json_array_append_new(content, json_pack("{s:s,s:s%}", "type", "text", "text", a->text, a->n));
    for (uint32_t i = 0; content && i < a->n_calls; i++)
        if (json_array_append_new(content, kv_an_tool_use(&a->calls[i], true))) {
            json_decref(content);
            content = NULL;
        }
    json_t *j = content ? kv_an_message(r, content, true) : NULL;
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

static void kv_an_event(kv_gw_buf *b, const char *name, json_t *j) {
    kv_gw_buf_add(b, "event: ", 7);
    kv_gw_buf_add(b, name, strlen(name));
    kv_gw_buf_json(b, "\ndata: ", j, "\n\n");
}

/* A stream's content blocks open as their first event comes: thinking,
 * text, tool_use; the one open is closed before the next opens. */
static void kv_an_begin(const kv_gw_result *r, kv_gw_buf *b) {
    kv_an_event(b, "message_start", json_pack("{s:s,s:o}", "type", "message_start", "message",
                                              kv_an_message(r, json_array(), false)));
}

static void kv_an_close(const kv_gw_result *r, kv_gw_buf *b) {
    if (!r->ss->open) return;
    kv_an_event(b, "content_block_stop", json_pack("{s:s,s:i}", "type", "content_block_stop", "index",
                                                   (int)r->ss->n_blocks - 1));
    r->ss->open = 0;
}

/* Opens block content (1 text, 2 thinking, 3 tool_use: block the JSON of its start) */
static void kv_an_open(const kv_gw_result *r, int kind, json_t *block, kv_gw_buf *b) {
    kv_an_close(r, b);
    if (!block) block = kind == 2 ? json_pack("{s:s,s:s,s:s}", "type", "thinking", "thinking", "", "signature", "")
                                  : json_pack("{s:s,s:s}", "type", "text", "text", "");
    kv_an_event(b, "content_block_start", json_pack("{s:s,s:i,s:o}", "type", "content_block_start", "index",
                                                    (int)r->ss->n_blocks, "content_block", block));
    if (r->ss->n_blocks++ == 0) kv_an_event(b, "ping", json_pack("{s:s}", "type", "ping"));
    r->ss->open = kind == 3 ? 0 : kind;
}

static void kv_an_delta(const kv_gw_result *r, const char *text, size_t n, kv_gw_buf *b) {
    if (r->ss->open != 1) kv_an_open(r, 1, NULL, b);
    kv_an_event(b, "content_block_delta", json_pack("{s:s,s:i,s:{s:s,s:s%}}", "type", "content_block_delta", "index",
                                                    (int)r->ss->n_blocks - 1, "delta", "type", "text_delta", "text",
                                                    text, n));
}

static void kv_an_reasoning(const kv_gw_result *r, const char *text, size_t n, kv_gw_buf *b) {
    if (r->ss->open != 2) kv_an_open(r, 2, NULL, b);
    kv_an_event(b, "content_block_delta", json_pack("{s:s,s:i,s:{s:s,s:s%}}", "type", "content_block_delta", "index",
                                                    (int)r->ss->n_blocks - 1, "delta", "type", "thinking_delta",
                                                    "thinking", text, n));
}

static void kv_an_call(const kv_gw_result *r, uint32_t index, const kv_gw_call *c, kv_gw_buf *b) {
    json_t *blk = kv_an_tool_use(c, false);
    if (!blk) {
        b->oom = true;
        return;
    }
    kv_an_open(r, 3, blk, b);
    const int at = (int)r->ss->n_blocks - 1;
    kv_an_event(b, "content_block_delta", json_pack("{s:s,s:i,s:{s:s,s:s%}}", "type", "content_block_delta", "index",
                                                    at, "delta", "type", "input_json_delta", "partial_json", c->args,
                                                    c->args_len));
    kv_an_event(b, "content_block_stop", json_pack("{s:s,s:i}", "type", "content_block_stop", "index", at));
}

/* A call as it comes: its tool_use block opened (input {}), an
 * input_json_delta per fragment, the block closed. */
static void kv_an_call_begin(const kv_gw_result *r, uint32_t index, const kv_gw_call *c, kv_gw_buf *b) {
    (void)index;
    json_t *blk = kv_an_tool_use(c, false);
    if (!blk) {
        b->oom = true;
        return;
    }
    kv_an_open(r, 3, blk, b);
    r->ss->open = 3; /* until its last fragment */
}
static void kv_an_call_args(const kv_gw_result *r, uint32_t index, const char *frag, size_t n, kv_gw_buf *b) {
    (void)index;
    kv_an_event(b, "content_block_delta", json_pack("{s:s,s:i,s:{s:s,s:s%}}", "type", "content_block_delta", "index",
                                                    (int)r->ss->n_blocks - 1, "delta", "type", "input_json_delta",
                                                    "partial_json", frag, n));
}
static void kv_an_call_end(const kv_gw_result *r, uint32_t index, kv_gw_buf *b) {
    (void)index;
    kv_an_close(r, b);
}

static void kv_an_end(const kv_gw_result *r, bool include_usage, kv_gw_buf *b) {
    if (!r->ss->n_blocks) kv_an_open(r, 1, NULL, b); /* an empty answer: one empty text block */
    kv_an_close(r, b);
    kv_an_event(b, "message_delta",
                json_pack("{s:s,s:{s:s,s:o},s:{s:I,s:I,s:I,s:I}}", "type", "message_delta", "delta", "stop_reason",
                          kv_an_stop(r), "stop_sequence", r->stop_seq ? json_string(r->stop_seq) : json_null(),
                          "usage", "input_tokens", (json_int_t)(r->prompt_tokens - r->cached_tokens),
                          "cache_creation_input_tokens", (json_int_t)0, "cache_read_input_tokens",
                          (json_int_t)r->cached_tokens, "output_tokens", (json_int_t)r->completion_tokens));
    kv_an_event(b, "message_stop", json_pack("{s:s}", "type", "message_stop"));
}

static void kv_an_stream_error(const char *msg, kv_gw_buf *b) {
    kv_an_event(b, "error", json_pack("{s:s,s:{s:s,s:s}}", "type", "error", "error", "type", "api_error", "message",
                                      msg));
}

const kv_gw_api_ops kv_gw_anthropic_ops = {
    .name = "anthropic", .id_prefix = "msg_", .stream_type = "text/event-stream", .auth_challenge = "x-api-key",
    .call_prefix = "toolu_", .parse = kv_an_parse, .error_body = kv_an_error, .full_body = kv_an_full,
    .stream_begin = kv_an_begin, .stream_delta = kv_an_delta, .stream_reasoning = kv_an_reasoning,
    .stream_call = kv_an_call, .stream_end = kv_an_end, .stream_error = kv_an_stream_error,
    .stream_call_begin = kv_an_call_begin, .stream_call_args = kv_an_call_args, .stream_call_end = kv_an_call_end,
};
