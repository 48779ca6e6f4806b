/* OpenAI's shapes: POST /v1/chat/completions and /v1/completions, whole
 * and as server-sent events ("data: {chunk}\n\n" ... "data: [DONE]\n\n"),
 * usage in the body or, with stream_options.include_usage, in a last chunk
 * whose choices are empty. Chat: reasoning as message.reasoning_content
 * (delta.reasoning_content streamed), tool calls as message.tool_calls
 * (each streamed as two deltas: id, type and name, then the arguments)
 * with finish_reason "tool_calls". Log-probabilities (logprobs.c) in
 * choices[].logprobs, each chunk's those of the tokens it carries. Errors:
 * {"error":{"message","type","param","code"}}. */
#include <stdlib.h>
#include <string.h>

#include "gateway/gateway_internal.h"

int kv_gw_num(json_t *o, const char *key, double lo, double hi, double *out, bool *has, kv_diag *d);
int kv_gw_bool(json_t *o, const char *key, bool *out, kv_diag *d);
int kv_gw_sampling(kv_gw_params *p, json_t *o, const char *max_key, kv_diag *d);
int kv_gw_stops(kv_gw_params *p, json_t *o, const char *key, kv_diag *d);
int kv_gw_messages(kv_gw_params *p, json_t *o, bool allow_system, kv_diag *d);
int kv_gw_model(kv_gw_params *p, json_t *o, bool required, kv_diag *d);

/* "reasoning_effort" (llama-server's reading): "none" turns the template's
 * thinking off (enable_thinking false); minimal, low, medium or high reach
 * the template as its reasoning_effort variable (gpt-oss's reads it; a
 * template that does not is unchanged), unless chat_template_kwargs sets it. */
static int kv_oa_reasoning_effort(kv_gw_params *p, json_t *o, kv_diag *d) {
    static const char *const levels[] = {"minimal", "low", "medium", "high"};
    json_t *e = json_object_get(o, "reasoning_effort");
    if (!e || json_is_null(e)) return 0;
    const char *v = json_is_string(e) ? json_string_value(e) : "";
    if (!strcmp(v, "none")) return kv_gw_set_thinking(p, false, d);
    bool ok = false;
    for (size_t i = 0; i < sizeof levels / sizeof levels[0]; i++) ok |= !strcmp(v, levels[i]);
    if (!ok) return kv_fail(d, KV_EINVAL, "'reasoning_effort' must be none, minimal, low, medium or high");
    if (p->kwargs && json_object_get(p->kwargs, "reasoning_effort")) return 0;
    if (!p->kwargs && !(p->kwargs = json_object())) return kv_fail(d, KV_ENOMEM, "out of memory");
    if (json_object_set_new(p->kwargs, "reasoning_effort", json_string(v))) return kv_fail(d, KV_ENOMEM, "out of memory");
    return 0;
}

/* "thinking_budget_tokens" (llama-server's): -1 or null none, else the
 * reasoning tokens after which the end of reasoning is forced (0: at once). */
static int kv_oa_thinking_budget(kv_gw_params *p, json_t *o, kv_diag *d) {
    json_t *v = json_object_get(o, "thinking_budget_tokens");
    if (!v || json_is_null(v) || (json_is_integer(v) && json_integer_value(v) == -1)) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > KV_GW_MAX_TOKENS)
        return kv_fail(d, KV_EINVAL, "'thinking_budget_tokens' must be -1 (none) or an integer in [0, %u]",
                       KV_GW_MAX_TOKENS);
    p->has_think_budget = true;
    p->think_budget = (uint32_t)json_integer_value(v);
    return 0;
}

static int kv_oa_parse(kv_gw_params *p, json_t *o, bool chat, kv_diag *d) {
    int rc;
    if ((rc = kv_gw_model(p, o, false, d))) return rc;
    if (chat) {
        if ((rc = kv_gw_messages(p, o, true, d))) return rc;
        if ((rc = kv_gw_bool(o, "add_generation_prompt", &p->add_generation_prompt, d))) return rc;
        if ((rc = kv_gw_tools(p, o, d)) || (rc = kv_gw_tool_choice_openai(p, o, d)) || (rc = kv_gw_kwargs(p, o, d)))
            return rc;
        if ((rc = kv_oa_reasoning_effort(p, o, d)) || (rc = kv_oa_thinking_budget(p, o, d))) return rc;
    } else {
        json_t *pr = json_object_get(o, "prompt");
        if (json_is_array(pr) && json_array_size(pr) == 1) pr = json_array_get(pr, 0);
        if (!json_is_string(pr)) return kv_fail(d, KV_EFORMAT, "'prompt' must be a string");
        p->prompt = json_string_value(pr);
        p->prompt_len = json_string_length(pr);
        if ((rc = kv_gw_bool(o, "echo", &p->echo, d))) return rc;
        json_t *sf = json_object_get(o, "suffix");
        if (sf && !json_is_null(sf)) {
            if (!json_is_string(sf)) return kv_fail(d, KV_EFORMAT, "'suffix' must be a string");
            p->suffix = json_string_value(sf);
            p->suffix_len = json_string_length(sf);
        }
    }
    if ((rc = kv_gw_refuse_openai(o, chat, d))) return rc;
    if ((rc = kv_gw_logit_bias(p, o, "logit_bias", d))) return rc;
    if ((rc = kv_gw_penalties(p, o, "repeat_penalty", "repeat_last_n", d))) return rc; /* llama-server's too */
    if ((rc = kv_gw_logprobs_openai(p, o, chat, d))) return rc;
    if ((rc = kv_gw_sampling(p, o, "max_tokens", d))) return rc;
    if (!p->has_max_tokens && (rc = kv_gw_sampling(p, o, "max_completion_tokens", d))) return rc;
    if ((rc = kv_gw_stops(p, o, "stop", d))) return rc;
    if ((rc = kv_gw_bool(o, "stream", &p->stream, d))) return rc;
    json_t *so = json_object_get(o, "stream_options");
    if (so && !json_is_null(so)) {
        if (!json_is_object(so)) return kv_fail(d, KV_EFORMAT, "'stream_options' must be an object");
        if ((rc = kv_gw_bool(so, "include_usage", &p->include_usage, d))) return rc;
    }
    json_t *n = json_object_get(o, "n");
    p->n_choices = 1;
    if (n && !json_is_null(n)) {
        if (!json_is_integer(n) || json_integer_value(n) < 1 || json_integer_value(n) > KV_GW_MAX_N)
            return kv_fail(d, KV_ERANGE, "'n' must be an integer in [1, %u]", KV_GW_MAX_N);
        p->n_choices = (uint32_t)json_integer_value(n);
    }
    if (p->echo && p->logprobs && p->n_choices > 1)
        return kv_fail(d, KV_EUNSUPPORTED, "'echo' with 'logprobs' and 'n' above 1 is not supported: ask for one "
                       "choice (the prompt's log-probabilities are the same in every choice)");
    return 0;
}

static const char *kv_oa_finish(int f) {
    return f == KV_GW_FINISH_LENGTH ? "length" : f == KV_GW_FINISH_TOOLS ? "tool_calls" : "stop";
}

/* [{id, type, function: {name, arguments}}] (arguments: JSON as a string) */
static json_t *kv_oa_calls(const kv_gw_call *c, uint32_t n) {
    json_t *a = json_array();
    for (uint32_t i = 0; a && i < n; i++)
        if (json_array_append_new(a, json_pack("{s:s,s:s,s:{s:s,s:s%}}", "id", c[i].id, "type", "function",
                                               "function", "name", c[i].name, "arguments", c[i].args,
                                               c[i].args_len))) {
            json_decref(a);
            return NULL;
        }
    return a;
}

static json_t *kv_oa_usage(const kv_gw_result *r) {
    return json_pack("{s:I,s:I,s:I,s:{s:I}}", "prompt_tokens", (json_int_t)r->prompt_tokens, "completion_tokens",
                     (json_int_t)r->completion_tokens, "total_tokens",
                     (json_int_t)r->prompt_tokens + (json_int_t)r->completion_tokens, "prompt_tokens_details",
                     "cached_tokens", (json_int_t)r->cached_tokens);
}

static char *kv_oa_error(unsigned status, const char *msg) {
    const char *type = status == 401 ? "authentication_error" : status == 404 ? "not_found_error"
                     : status == 503 ? "server_overloaded" : status >= 500 ? "server_error" : "invalid_request_error";
    const char *code = status == 401 ? "invalid_api_key" : status == 404 ? "model_not_found"
                     : status == 402 ? "payment_required"
                     : status == 503 ? "server_overloaded" : status == 413 ? "request_too_large"
                     : status >= 500 ? "internal_error" : "invalid_request";
    json_t *j = json_pack("{s:{s:s,s:s,s:n,s:s}}", "error", "message", msg, "type", type, "param", "code", code);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

/* one choice of a whole answer */
static json_t *kv_oa_choice(bool chat, const kv_gw_result *r, const kv_gw_answer *a) {
    const int ix = (int)r->index; /* the choice */
    const char *text = a->text;
    const size_t n = a->n;
    json_t *choice = chat ? json_pack("{s:i,s:{s:s,s:s%},s:n,s:s}", "index", ix, "message", "role",
                                      "assistant", "content", text, n, "logprobs", "finish_reason",
                                      kv_oa_finish(r->finish))
                          : json_pack("{s:i,s:s%,s:n,s:s}", "index", ix, "text", text, n, "logprobs",
                                      "finish_reason", kv_oa_finish(r->finish));
    if (choice && r->logprobs) {
        json_t *lp = chat ? kv_gw_lp_chat(r) : kv_gw_lp_text(r);
        if (!lp || json_object_set_new(choice, "logprobs", lp)) {
            json_decref(choice);
            return NULL;
        }
    }
    json_t *msg = chat && choice ? json_object_get(choice, "message") : NULL;
    if (msg && a->rn) json_object_set_new(msg, "reasoning_content", json_stringn(a->reasoning, a->rn));
    if (msg && a->n_calls) {
        if (!n) json_object_set_new(msg, "content", json_null()); /* OpenAI's: a call and no text */
        json_t *calls = kv_oa_calls(a->calls, a->n_calls);
        if (!calls || json_object_set_new(msg, "tool_calls", calls)) {
            json_decref(choice);
            return NULL;
        }
    }
    return choice;
}

/* n choices (r[i], a[i]); usage: the prompt once, the completions summed */
static char *kv_oa_full_n(bool chat, const kv_gw_result *r, const kv_gw_answer *a, uint32_t n) {
    json_t *choices = json_array();
    kv_gw_result u = r[0];
    u.completion_tokens = 0;
    for (uint32_t i = 0; choices && i < n; i++) {
        u.completion_tokens += r[i].completion_tokens;
        json_t *c = kv_oa_choice(chat, &r[i], &a[i]);
        if (!c || json_array_append_new(choices, c)) {
            json_decref(choices);
            choices = NULL;
        }
    }
    json_t *j = choices ? json_pack("{s:s,s:s,s:I,s:s,s:o,s:o}", "id", r->id, "object",
                                    chat ? "chat.completion" : "text_completion", "created", (json_int_t)r->created,
                                    "model", r->model, "choices", choices, "usage", kv_oa_usage(&u))
                        : NULL;
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

static char *kv_oa_full(bool chat, const kv_gw_result *r, const kv_gw_answer *a) { return kv_oa_full_n(chat, r, a, 1); }

static json_t *kv_oa_chunk(bool chat, const kv_gw_result *r, json_t *choices) {
    return json_pack("{s:s,s:s,s:I,s:s,s:o}", "id", r->id, "object", chat ? "chat.completion.chunk" : "text_completion",
                     "created", (json_int_t)r->created, "model", r->model, "choices", choices);
}

static void kv_oa_begin(bool chat, const kv_gw_result *r, kv_gw_buf *b) {
    if (!chat) return;
    const int ix = (int)r->index; /* the choice */
    json_t *c = json_pack("[{s:i,s:{s:s,s:s},s:n,s:n}]", "index", ix, "delta", "role", "assistant", "content", "",
                          "logprobs", "finish_reason");
    kv_gw_buf_json(b, "data: ", kv_oa_chunk(chat, r, c), "\n\n");
}

/* a chunk's choices with the log-probabilities of the tokens it carries,
   when asked */
static json_t *kv_oa_with_lp(bool chat, const kv_gw_result *r, json_t *c) {
    if (!c || !r->logprobs) return c;
    json_t *lp = chat ? kv_gw_lp_chat(r) : kv_gw_lp_text(r);
    if (!lp || json_object_set_new(json_array_get(c, 0), "logprobs", lp)) {
        json_decref(c);
        return NULL;
    }
    return c;
}

static void kv_oa_delta(bool chat, const kv_gw_result *r, const char *text, size_t n, kv_gw_buf *b) {
    const int ix = (int)r->index; /* the choice */
    json_t *c = chat ? json_pack("[{s:i,s:{s:s%},s:n,s:n}]", "index", ix, "delta", "content", text, n, "logprobs",
                                 "finish_reason")
                     : json_pack("[{s:i,s:s%,s:n,s:n}]", "index", ix, "text", text, n, "logprobs", "finish_reason");
    if (!(c = kv_oa_with_lp(chat, r, c))) b->oom = true;
    else kv_gw_buf_json(b, "data: ", kv_oa_chunk(chat, r, c), "\n\n");
}

static void kv_oa_reasoning(const kv_gw_result *r, const char *text, size_t n, kv_gw_buf *b) {
    const int ix = (int)r->index; /* the choice */
    json_t *c = json_pack("[{s:i,s:{s:s%},s:n,s:n}]", "index", ix, "delta", "reasoning_content", text, n, "logprobs",
                          "finish_reason");
    if (!(c = kv_oa_with_lp(true, r, c))) b->oom = true;
    else kv_gw_buf_json(b, "data: ", kv_oa_chunk(true, r, c), "\n\n");
}

/* A whole call as OpenAI streams one: its id, type and name first (with
 * empty arguments), then its arguments. */
static void kv_oa_call(const kv_gw_result *r, uint32_t index, const kv_gw_call *call, kv_gw_buf *b) {
    const int ix = (int)r->index; /* the choice */
    json_t *c = json_pack("[{s:i,s:{s:[{s:i,s:s,s:s,s:{s:s,s:s}}]},s:n,s:n}]", "index", ix, "delta", "tool_calls",
                          "index", (int)index, "id", call->id, "type", "function", "function", "name", call->name,
                          "arguments", "", "logprobs", "finish_reason");
    kv_gw_buf_json(b, "data: ", kv_oa_chunk(true, r, c), "\n\n");
    c = json_pack("[{s:i,s:{s:[{s:i,s:{s:s%}}]},s:n,s:n}]", "index", ix, "delta", "tool_calls", "index", (int)index,
                  "function", "arguments", call->args, call->args_len, "logprobs", "finish_reason");
    kv_gw_buf_json(b, "data: ", kv_oa_chunk(true, r, c), "\n\n");
}

/* A call as it comes: its id, type and name (empty arguments), then each
 * fragment of its arguments; nothing ends it. */
static void kv_oa_call_begin(const kv_gw_result *r, uint32_t index, const kv_gw_call *call, kv_gw_buf *b) {
    json_t *c = json_pack("[{s:i,s:{s:[{s:i,s:s,s:s,s:{s:s,s:s}}]},s:n,s:n}]", "index", (int)r->index, "delta",
                          "tool_calls", "index", (int)index, "id", call->id, "type", "function", "function", "name",
                          call->name, "arguments", "", "logprobs", "finish_reason");
    kv_gw_buf_json(b, "data: ", kv_oa_chunk(true, r, c), "\n\n");
}
static void kv_oa_call_args(const kv_gw_result *r, uint32_t index, const char *frag, size_t n, kv_gw_buf *b) {
    json_t *c = json_pack("[{s:i,s:{s:[{s:i,s:{s:s%}}]},s:n,s:n}]", "index", (int)r->index, "delta", "tool_calls",
                          "index", (int)index, "function", "arguments", frag, n, "logprobs", "finish_reason");
    kv_gw_buf_json(b, "data: ", kv_oa_chunk(true, r, c), "\n\n");
}
static void kv_oa_call_end(const kv_gw_result *r, uint32_t index, kv_gw_buf *b) { (void)r, (void)index, (void)b; }

/* the chunk that ends one choice */
static void kv_oa_finish_chunk(bool chat, const kv_gw_result *r, bool include_usage, kv_gw_buf *b) {
    const int ix = (int)r->index; /* the choice */
    json_t *c = chat ? json_pack("[{s:i,s:{},s:n,s:s}]", "index", ix, "delta", "logprobs", "finish_reason",
                                 kv_oa_finish(r->finish))
                     : json_pack("[{s:i,s:s,s:n,s:s}]", "index", ix, "text", "", "logprobs", "finish_reason",
                                 kv_oa_finish(r->finish));
    json_t *ch = kv_oa_chunk(chat, r, c);
    if (ch && include_usage) json_object_set_new(ch, "usage", json_null());
    kv_gw_buf_json(b, "data: ", ch, "\n\n");
}

static void kv_oa_end(bool chat, const kv_gw_result *r, bool include_usage, kv_gw_buf *b) {
    kv_oa_finish_chunk(chat, r, include_usage, b);
    if (include_usage) {
        json_t *u = kv_oa_chunk(chat, r, json_array());
        if (u) json_object_set_new(u, "usage", kv_oa_usage(r));
        kv_gw_buf_json(b, "data: ", u, "\n\n");
    }
    kv_gw_buf_add(b, "data: [DONE]\n\n", 14);
}

static void kv_oa_stream_error(const char *msg, kv_gw_buf *b) {
    char *e = kv_oa_error(500, msg);
    if (!e) {
        b->oom = true;
        return;
    }
    kv_gw_buf_add(b, "data: ", 6);
    kv_gw_buf_add(b, e, strlen(e));
    kv_gw_buf_add(b, "\n\ndata: [DONE]\n\n", 16);
    free(e);
}

/* chat completions and completions: one adapter each over the code above */
static int kv_oa_chat_parse(kv_gw_params *p, json_t *o, kv_diag *d) { return kv_oa_parse(p, o, true, d); }
static int kv_oa_text_parse(kv_gw_params *p, json_t *o, kv_diag *d) { return kv_oa_parse(p, o, false, d); }
static char *kv_oa_chat_full(const kv_gw_result *r, const kv_gw_answer *a) { return kv_oa_full(true, r, a); }
static char *kv_oa_text_full(const kv_gw_result *r, const kv_gw_answer *a) { return kv_oa_full(false, r, a); }
static void kv_oa_chat_begin(const kv_gw_result *r, kv_gw_buf *b) { kv_oa_begin(true, r, b); }
static void kv_oa_text_begin(const kv_gw_result *r, kv_gw_buf *b) { kv_oa_begin(false, r, b); }
static void kv_oa_chat_delta(const kv_gw_result *r, const char *t, size_t n, kv_gw_buf *b) { kv_oa_delta(true, r, t, n, b); }
static void kv_oa_text_delta(const kv_gw_result *r, const char *t, size_t n, kv_gw_buf *b) { kv_oa_delta(false, r, t, n, b); }
static void kv_oa_chat_end(const kv_gw_result *r, bool u, kv_gw_buf *b) { kv_oa_end(true, r, u, b); }
static void kv_oa_text_end(const kv_gw_result *r, bool u, kv_gw_buf *b) { kv_oa_end(false, r, u, b); }
static char *kv_oa_chat_full_n(const kv_gw_result *r, const kv_gw_answer *a, uint32_t n) {
    return kv_oa_full_n(true, r, a, n);
}
static char *kv_oa_text_full_n(const kv_gw_result *r, const kv_gw_answer *a, uint32_t n) {
    return kv_oa_full_n(false, r, a, n);
}
static void kv_oa_chat_choice_end(const kv_gw_result *r, bool u, kv_gw_buf *b) { kv_oa_finish_chunk(true, r, u, b); }
static void kv_oa_text_choice_end(const kv_gw_result *r, bool u, kv_gw_buf *b) { kv_oa_finish_chunk(false, r, u, b); }

const kv_gw_api_ops kv_gw_openai_chat_ops = {
    .name = "openai_chat", .id_prefix = "chatcmpl-", .stream_type = "text/event-stream", .auth_challenge = "Bearer",
    .call_prefix = "call_", .parse = kv_oa_chat_parse, .error_body = kv_oa_error, .full_body = kv_oa_chat_full,
    .stream_begin = kv_oa_chat_begin, .stream_delta = kv_oa_chat_delta, .stream_reasoning = kv_oa_reasoning,
    .stream_call = kv_oa_call, .stream_end = kv_oa_chat_end,
    .stream_call_begin = kv_oa_call_begin, .stream_call_args = kv_oa_call_args, .stream_call_end = kv_oa_call_end,
    .stream_error = kv_oa_stream_error, .full_body_n = kv_oa_chat_full_n, .stream_choice_end = kv_oa_chat_choice_end,
};

const kv_gw_api_ops kv_gw_openai_text_ops = {
    .name = "openai_completions", .id_prefix = "cmpl-", .stream_type = "text/event-stream", .auth_challenge = "Bearer",
    .call_prefix = "call_",
    .parse = kv_oa_text_parse, .error_body = kv_oa_error, .full_body = kv_oa_text_full,
    .stream_begin = kv_oa_text_begin, .stream_delta = kv_oa_text_delta, .stream_end = kv_oa_text_end,
    .stream_error = kv_oa_stream_error, .full_body_n = kv_oa_text_full_n, .stream_choice_end = kv_oa_text_choice_end,
};
