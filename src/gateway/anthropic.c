/* Anthropic's shapes: POST /v1/messages, whole ({"type":"message",
 * "content":[{"type":"text","text"}],"stop_reason","usage"}) and as its
 * event stream (message_start, content_block_start, ping,
 * content_block_delta..., content_block_stop, message_delta, message_stop).
 * "system" is a top-level field (string or text blocks), max_tokens is
 * required, stop strings are "stop_sequences". Errors:
 * {"type":"error","error":{"type","message"}}. */
#include <stdlib.h>
#include <string.h>

#include "gateway/gateway_internal.h"

int kv_gw_bool(json_t *o, const char *key, bool *out, kv_diag *d);
int kv_gw_sampling(kv_gw_params *p, json_t *o, const char *max_key, kv_diag *d);
int kv_gw_stops(kv_gw_params *p, json_t *o, const char *key, kv_diag *d);
int kv_gw_messages(kv_gw_params *p, json_t *o, bool allow_system, kv_diag *d);
int kv_gw_model(kv_gw_params *p, json_t *o, bool required, kv_diag *d);
int kv_gw_content(kv_gw_params *p, json_t *c, size_t i, kv_diag *d);

static int kv_an_parse(kv_gw_params *p, json_t *o, kv_diag *d) {
    int rc;
    if ((rc = kv_gw_model(p, o, true, d))) return rc;
    json_t *sys = json_object_get(o, "system");
    if (sys && !json_is_null(sys)) {
        p->msgs[0].role = "system";
        p->n_msgs = 1;
        if ((rc = kv_gw_content(p, sys, 0, d))) return rc;
    }
    if ((rc = kv_gw_messages(p, o, false, d))) return rc;
    if ((rc = kv_gw_sampling(p, o, "max_tokens", d))) return rc;
    if (!p->has_max_tokens) return kv_fail(d, KV_EINVAL, "'max_tokens' is required");
    if ((rc = kv_gw_stops(p, o, "stop_sequences", d))) return rc;
    if ((rc = kv_gw_bool(o, "stream", &p->stream, d))) return rc;
    return 0;
}

static const char *kv_an_stop(const kv_gw_result *r) {
    return r->stop_seq ? "stop_sequence" : r->finish == KV_GW_FINISH_LENGTH ? "max_tokens" : "end_turn";
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

static char *kv_an_full(const kv_gw_result *r, const char *text, size_t n) {
    json_t *j = kv_an_message(r, json_pack("[{s:s,s:s%}]", "type", "text", "text", text, n), true);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

static void kv_an_event(kv_gw_buf *b, const char *name, json_t *j) {
    kv_gw_buf_add(b, "event: ", 7);
    kv_gw_buf_add(b, name, strlen(name));
    kv_gw_buf_json(b, "\ndata: ", j, "\n\n");
}

static void kv_an_begin(const kv_gw_result *r, kv_gw_buf *b) {
    kv_an_event(b, "message_start", json_pack("{s:s,s:o}", "type", "message_start", "message",
                                              kv_an_message(r, json_array(), false)));
    kv_an_event(b, "content_block_start", json_pack("{s:s,s:i,s:{s:s,s:s}}", "type", "content_block_start", "index",
                                                    0, "content_block", "type", "text", "text", ""));
    kv_an_event(b, "ping", json_pack("{s:s}", "type", "ping"));
}

static void kv_an_delta(const kv_gw_result *r, const char *text, size_t n, kv_gw_buf *b) {
    kv_an_event(b, "content_block_delta", json_pack("{s:s,s:i,s:{s:s,s:s%}}", "type", "content_block_delta", "index",
                                                    0, "delta", "type", "text_delta", "text", text, n));
}

static void kv_an_end(const kv_gw_result *r, bool include_usage, kv_gw_buf *b) {
    kv_an_event(b, "content_block_stop", json_pack("{s:s,s:i}", "type", "content_block_stop", "index", 0));
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
    .parse = kv_an_parse, .error_body = kv_an_error, .full_body = kv_an_full, .stream_begin = kv_an_begin,
    .stream_delta = kv_an_delta, .stream_end = kv_an_end, .stream_error = kv_an_stream_error,
};
