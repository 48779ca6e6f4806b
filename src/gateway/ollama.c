/* Ollama's shapes: POST /api/chat (streaming by default, as NDJSON: one
 * {"message":{"role","content"},"done":false} per chunk, then one with
 * "done":true, "done_reason" and the counts), GET /api/tags. Sampler fields
 * sit under "options" (num_predict, temperature, top_k, top_p, min_p, seed,
 * stop, the penalties; any other option a 400 naming it: ollama_gen.c).
 * "tools" as OpenAI's; calls as message.tool_calls (arguments an
 * object), reasoning as message.thinking ("think" sets the template's
 * enable_thinking). Errors: {"error":"..."}. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gateway/gateway_internal.h"

int kv_gw_bool(json_t *o, const char *key, bool *out, kv_diag *d);
int kv_gw_sampling(kv_gw_params *p, json_t *o, const char *max_key, kv_diag *d);
int kv_gw_stops(kv_gw_params *p, json_t *o, const char *key, kv_diag *d);
int kv_gw_messages(kv_gw_params *p, json_t *o, bool allow_system, kv_diag *d);
int kv_gw_model(kv_gw_params *p, json_t *o, bool required, kv_diag *d);
int kv_gw_ollama_options(kv_gw_params *p, json_t *op, kv_diag *d);

static int kv_ol_parse(kv_gw_params *p, json_t *o, kv_diag *d) {
    int rc;
    if ((rc = kv_gw_model(p, o, false, d))) return rc;
    if ((rc = kv_gw_messages(p, o, true, d))) return rc;
    if ((rc = kv_gw_tools(p, o, d)) || (rc = kv_gw_tool_choice_check(p, d)) || (rc = kv_gw_kwargs(p, o, d)))
        return rc;
    json_t *th = json_object_get(o, "think");
    if (th && !json_is_null(th)) {
        if (!json_is_boolean(th))
            return kv_fail(d, KV_EUNSUPPORTED, "'think' must be true or false (reasoning levels are not served)");
        if ((rc = kv_gw_set_thinking(p, json_is_true(th), d))) return rc;
    }
    json_t *lp = json_object_get(o, "logprobs"), *tl = json_object_get(o, "top_logprobs");
    if (lp && !json_is_null(lp) && !json_is_false(lp))
        return kv_fail(d, KV_EUNSUPPORTED, "'logprobs' is not supported by this server's /api/chat (use "
                       "/v1/chat/completions)");
    if (tl && !json_is_null(tl) && !(json_is_integer(tl) && json_integer_value(tl) == 0))
        return kv_fail(d, KV_EUNSUPPORTED, "'top_logprobs' is not supported by this server's /api/chat (use "
                       "/v1/chat/completions)");
    p->stream = true;
    if ((rc = kv_gw_bool(o, "stream", &p->stream, d))) return rc;
    json_t *op = json_object_get(o, "options");
    if (op && !json_is_null(op)) {
        if (!json_is_object(op)) return kv_fail(d, KV_EFORMAT, "'options' must be an object");
        if ((rc = kv_gw_ollama_options(p, op, d))) return rc;
        if ((rc = kv_gw_sampling(p, op, "num_predict", d))) return rc;
        if ((rc = kv_gw_stops(p, op, "stop", d))) return rc;
    }
    return 0;
}

static char *kv_ol_error(unsigned status, const char *msg) {
    json_t *j = json_pack("{s:s}", "error", msg);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

static void kv_ol_time(long long t, char *buf, size_t cap) {
    time_t tt = (time_t)t;
    struct tm tm;
    gmtime_r(&tt, &tm);
    strftime(buf, cap, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

static json_t *kv_ol_obj(const kv_gw_result *r, const char *text, size_t n, bool done) {
    char ts[32];
    kv_ol_time(r->created, ts, sizeof ts);
    json_t *j = json_pack("{s:s,s:s,s:{s:s,s:s%},s:b}", "model", r->model, "created_at", ts, "message", "role",
                          "assistant", "content", text, n, "done", done);
    if (j && done) {
        json_object_set_new(j, "done_reason", json_string(r->finish == KV_GW_FINISH_LENGTH ? "length" : "stop"));
        json_object_set_new(j, "prompt_eval_count", json_integer(r->prompt_tokens));
        json_object_set_new(j, "eval_count", json_integer(r->completion_tokens));
    }
    return j;
}

/* message.tool_calls: [{"function": {"name", "arguments": {...}}}] */
static int kv_ol_calls(json_t *j, const kv_gw_call *c, uint32_t n, uint32_t first) {
    json_t *a = json_array();
    for (uint32_t i = 0; a && i < n; i++) {
        json_t *args = json_loadb(c[i].args, c[i].args_len, 0, NULL);
        if (!args || json_array_append_new(a, json_pack("{s:{s:i,s:s,s:o}}", "function", "index", (int)(first + i),
                                                        "name", c[i].name, "arguments", args))) {
            json_decref(a);
            return -1;
        }
    }
    return a ? json_object_set_new(json_object_get(j, "message"), "tool_calls", a) : -1;
}

static char *kv_ol_full(const kv_gw_result *r, const kv_gw_answer *a) {
    json_t *j = kv_ol_obj(r, a->text, a->n, true);
    if (j && a->rn) json_object_set_new(json_object_get(j, "message"), "thinking", json_stringn(a->reasoning, a->rn));
    if (j && a->n_calls && kv_ol_calls(j, a->calls, a->n_calls, 0)) {
        json_decref(j);
        j = NULL;
    }
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

static void kv_ol_delta(const kv_gw_result *r, const char *text, size_t n, kv_gw_buf *b) {
    kv_gw_buf_json(b, "", kv_ol_obj(r, text, n, false), "\n");
}

static void kv_ol_reasoning(const kv_gw_result *r, const char *text, size_t n, kv_gw_buf *b) {
    json_t *j = kv_ol_obj(r, "", 0, false);
    if (j) json_object_set_new(json_object_get(j, "message"), "thinking", json_stringn(text, n));
    kv_gw_buf_json(b, "", j, "\n");
}

static void kv_ol_call(const kv_gw_result *r, uint32_t index, const kv_gw_call *c, kv_gw_buf *b) {
    json_t *j = kv_ol_obj(r, "", 0, false);
    if (j && kv_ol_calls(j, c, 1, index)) {
        json_decref(j);
        j = NULL;
    }
    kv_gw_buf_json(b, "", j, "\n");
}

static void kv_ol_end(const kv_gw_result *r, bool include_usage, kv_gw_buf *b) { kv_gw_buf_json(b, "", kv_ol_obj(r, "", 0, true), "\n"); }

static void kv_ol_stream_error(const char *msg, kv_gw_buf *b) {
    kv_gw_buf_json(b, "", json_pack("{s:s}", "error", msg), "\n");
}

char *kv_gw_ollama_tags(const char *model, long long created, unsigned long long size) {
    char ts[32];
    kv_ol_time(created, ts, sizeof ts);
    json_t *j = json_pack("{s:[{s:s,s:s,s:s,s:I,s:s,s:{s:s}}]}", "models", "name", model, "model", model,
                          "modified_at", ts, "size", (json_int_t)size, "digest", "", "details", "format", "gguf");
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

/* NDJSON has nothing before the first chunk */
static void kv_ol_begin(const kv_gw_result *r, kv_gw_buf *b) {}

const kv_gw_api_ops kv_gw_ollama_ops = {
    .name = "ollama", .id_prefix = "ollama-", .stream_type = "application/x-ndjson", .auth_challenge = "Bearer",
    .call_prefix = "call_", .parse = kv_ol_parse, .error_body = kv_ol_error, .full_body = kv_ol_full,
    .stream_begin = kv_ol_begin, .stream_delta = kv_ol_delta, .stream_reasoning = kv_ol_reasoning,
    .stream_call = kv_ol_call, .stream_end = kv_ol_end, .stream_error = kv_ol_stream_error,
};
