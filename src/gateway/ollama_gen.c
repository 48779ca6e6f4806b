/* Ollama's POST /api/generate: a prompt (and an optional system prompt)
 * rendered as one user turn by the model's chat template, or with
 * "raw": true completed as it is. Streams by default, as NDJSON: one
 * {"model","created_at","response","done":false} per chunk, then one with
 * "done":true, "done_reason", the counts and the durations (nanoseconds).
 * No prompt (absent or "", no system) asks for the model to be loaded: it
 * is answered at once, "done_reason":"load" (routes.c).
 * Sampler fields under "options" (num_predict, temperature, top_k, top_p,
 * min_p, seed, stop, repeat_penalty, repeat_last_n, presence_penalty,
 * frequency_penalty); "format" ("json" or a schema: gateway/structured.c);
 * any other option, a "template", "suffix", "images", "context" or "think"
 * is a 400 naming it. Errors:
 * {"error":"..."}. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gateway/gateway_internal.h"

int kv_gw_bool(json_t *o, const char *key, bool *out, kv_diag *d);
int kv_gw_sampling(kv_gw_params *p, json_t *o, const char *max_key, kv_diag *d);
int kv_gw_stops(kv_gw_params *p, json_t *o, const char *key, kv_diag *d);
int kv_gw_model(kv_gw_params *p, json_t *o, bool required, kv_diag *d);

static const char *const kv_og_fields[] = {"model", "prompt", "system", "raw", "stream", "options", "keep_alive",
                                           "format" /* structured.c */, NULL};
static const char *const kv_og_options[] = {"num_predict", "temperature", "top_k", "top_p", "min_p", "seed", "stop",
                                            "repeat_penalty", "repeat_last_n", "presence_penalty",
                                            "frequency_penalty", NULL};

/* Ollama's "options" (both endpoints): the sampler's, the penalties (a
 * repeat_last_n of -1 is the whole context, 0 turns the penalty off); any
 * other option not null is a 400 naming it. */
int kv_gw_ollama_options(kv_gw_params *p, json_t *op, kv_diag *d) {
    const char *key;
    json_t *v;
    json_object_foreach(op, key, v) {
        bool known = false;
        for (size_t i = 0; kv_og_options[i] && !known; i++) known = !strcmp(kv_og_options[i], key);
        if (!known && !json_is_null(v))
            return kv_fail(d, KV_EUNSUPPORTED, "option '%.64s' is not supported by this server", key);
    }
    return kv_gw_penalties(p, op, "repeat_penalty", "repeat_last_n", d);
}

static bool kv_og_in(const char *const *list, const char *key) {
    for (size_t i = 0; list[i]; i++)
        if (!strcmp(list[i], key)) return true;
    return false;
}

static int kv_og_parse(kv_gw_params *p, json_t *o, kv_diag *d) {
    int rc;
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v) {
        if (kv_og_in(kv_og_fields, key) || json_is_null(v)) continue;
        if (!strcmp(key, "think") && json_is_false(v)) continue;
        if ((!strcmp(key, "images") || !strcmp(key, "context")) && json_is_array(v) && !json_array_size(v)) continue;
        if (!strcmp(key, "suffix") && json_is_string(v) && !json_string_length(v)) continue;
        return kv_fail(d, KV_EUNSUPPORTED, "'%.64s' is not supported by this server's /api/generate", key);
    }
    if ((rc = kv_gw_model(p, o, false, d))) return rc;
    json_t *pr = json_object_get(o, "prompt"), *sys = json_object_get(o, "system");
    if (pr && !json_is_null(pr) && !json_is_string(pr)) return kv_fail(d, KV_EFORMAT, "'prompt' must be a string");
    if ((!pr || json_is_null(pr) || !json_string_length(pr)) && (!sys || json_is_null(sys))) {
        /* no prompt: Ollama's request to load the model (no message, no raw
           prompt: the server answers it without generating) */
        return 0;
    }
    if (!json_is_string(pr)) return kv_fail(d, KV_EFORMAT, "'prompt' must be a string");
    if (sys && !json_is_null(sys) && !json_is_string(sys)) return kv_fail(d, KV_EFORMAT, "'system' must be a string");
    if (json_is_null(sys)) sys = NULL;
    bool raw = false;
    if ((rc = kv_gw_bool(o, "raw", &raw, d))) return rc;
    if (raw) {
        if (sys) return kv_fail(d, KV_EINVAL, "'system' has no place in a raw prompt ('raw': true)");
        p->prompt = json_string_value(pr);
        p->prompt_len = json_string_length(pr);
    } else {
        if (sys) p->msgs[p->n_msgs++] = (kv_chat_msg){"system", json_string_value(sys), json_string_length(sys)};
        p->msgs[p->n_msgs++] = (kv_chat_msg){"user", json_string_value(pr), json_string_length(pr)};
    }
    p->stream = true;
    if ((rc = kv_gw_bool(o, "stream", &p->stream, d))) return rc;
    json_t *op = json_object_get(o, "options");
    if (op && !json_is_null(op)) {
        if (!json_is_object(op)) return kv_fail(d, KV_EFORMAT, "'options' must be an object");
        if ((rc = kv_gw_ollama_options(p, op, d))) return rc;
        /* num_predict -1 (until the context is full) and -2 (fill it) are Ollama's: no limit but the context */
        json_t *np = json_object_get(op, "num_predict");
        if (json_is_integer(np) && (json_integer_value(np) == -1 || json_integer_value(np) == -2)) {
            p->has_max_tokens = true;
            p->max_tokens = KV_GW_MAX_TOKENS;
            json_object_del(op, "num_predict");
        }
        if ((rc = kv_gw_sampling(p, op, "num_predict", d))) return rc;
        if ((rc = kv_gw_stops(p, op, "stop", d))) return rc;
    }
    return 0;
}

static char *kv_og_error(unsigned status, const char *msg) {
    json_t *j = json_pack("{s:s}", "error", msg);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

static json_t *kv_og_obj(const kv_gw_result *r, const char *text, size_t n, bool done) {
    char ts[32];
    time_t tt = (time_t)r->created;
    struct tm tm;
    gmtime_r(&tt, &tm);
    strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%SZ", &tm);
    json_t *j = json_pack("{s:s,s:s,s:s%,s:b}", "model", r->model, "created_at", ts, "response", text, n, "done", done);
    if (j && done) {
        /* durations in nanoseconds: the prompt's from the request read to its
           first token, the generation's from there to now */
        const double now = kv_gw_mono(), first = r->t_first > 0 ? r->t_first : now;
        json_object_set_new(j, "done_reason", json_string(r->finish == KV_GW_FINISH_LENGTH ? "length" : "stop"));
        json_object_set_new(j, "total_duration", json_integer((json_int_t)((now - r->t_start) * 1e9)));
        json_object_set_new(j, "load_duration", json_integer(0));
        json_object_set_new(j, "prompt_eval_count", json_integer(r->prompt_tokens));
        json_object_set_new(j, "prompt_eval_duration", json_integer((json_int_t)((first - r->t_start) * 1e9)));
        json_object_set_new(j, "eval_count", json_integer(r->completion_tokens));
        json_object_set_new(j, "eval_duration", json_integer((json_int_t)((now - first) * 1e9)));
    }
    return j;
}

static char *kv_og_full(const kv_gw_result *r, const kv_gw_answer *a) { /* a raw prompt: content only */
    json_t *j = kv_og_obj(r, a->text, a->n, true);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

static void kv_og_begin(const kv_gw_result *r, kv_gw_buf *b) {}

static void kv_og_delta(const kv_gw_result *r, const char *text, size_t n, kv_gw_buf *b) {
    kv_gw_buf_json(b, "", kv_og_obj(r, text, n, false), "\n");
}

static void kv_og_end(const kv_gw_result *r, bool include_usage, kv_gw_buf *b) {
    kv_gw_buf_json(b, "", kv_og_obj(r, "", 0, true), "\n");
}

static void kv_og_stream_error(const char *msg, kv_gw_buf *b) { kv_gw_buf_json(b, "", json_pack("{s:s}", "error", msg), "\n"); }

const kv_gw_api_ops kv_gw_ollama_gen_ops = {
    .name = "ollama_generate", .id_prefix = "ollama-", .stream_type = "application/x-ndjson",
    .auth_challenge = "Bearer", .parse = kv_og_parse, .error_body = kv_og_error, .full_body = kv_og_full,
    .stream_begin = kv_og_begin, .stream_delta = kv_og_delta, .stream_end = kv_og_end,
    .stream_error = kv_og_stream_error,
};
