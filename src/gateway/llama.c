/* llama-server's native completion, POST /completion: a prompt (a string,
 * or an array of token ids) completed as is, no chat template. Sampler
 * fields at the top level (n_predict, temperature, top_k, top_p, min_p,
 * seed, stop, ignore_eos, stream, repeat_penalty, repeat_last_n,
 * presence_penalty, frequency_penalty, logit_bias, n_probs:
 * completion_probabilities); a field Kvasir cannot honour is a 400
 * that names it, unless it holds the value that changes nothing (llama.cpp's
 * clients send whole settings objects: "typical_p": 1 is taken, 0.9 is
 * not). The answer: {"content", "stop": true, "tokens_predicted",
 * "tokens_evaluated", "stop_type", "stopping_word", "timings"}; a stream is
 * server-sent events, one {"content": PIECE, "stop": false} per chunk, then
 * the whole answer's fields with "stop": true (no [DONE]). Errors:
 * {"error":{"code","message","type"}}. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gateway/gateway_internal.h"

int kv_gw_bool(json_t *o, const char *key, bool *out, kv_diag *d);
int kv_gw_sampling(kv_gw_params *p, json_t *o, const char *max_key, kv_diag *d);
int kv_gw_stops(kv_gw_params *p, json_t *o, const char *key, kv_diag *d);
int kv_gw_model(kv_gw_params *p, json_t *o, bool required, kv_diag *d);

/* Fields taken as they are (sampling and the rest parsed below). */
static const char *const kv_ll_known[] = {"prompt", "n_predict", "temperature", "top_k", "top_p", "min_p",
                                          "seed", "stop", "stream", "ignore_eos", "model", "cache_prompt",
                                          "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty",
                                          "logit_bias", "n_probs",
                                          "grammar", "json_schema", "response_format" /* structured.c */, NULL};

/* Fields llama-server knows that Kvasir does not honour, with the value
 * that leaves the answer as if they were absent. */
static const struct {
    const char *key;
    double neutral;
} kv_ll_neutral[] = {
    {"typical_p", 1},        {"mirostat", 0},         {"xtc_probability", 0},  {"dry_multiplier", 0},
    {"post_sampling_probs", 0},
    {"dynatemp_range", 0},   {"min_keep", 0},         {"n_keep", 0},           {"n_indent", 0},
    {"t_max_predict_ms", 0},
};

/* The body's fields are all known, or unknown ones hold their neutral value
 * (or are empty: "grammar": "", "logit_bias": [], "samplers" absent). */
static int kv_ll_fields(json_t *o, kv_diag *d) {
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v) {
        bool ok = false;
        for (size_t i = 0; kv_ll_known[i] && !ok; i++) ok = !strcmp(key, kv_ll_known[i]);
        for (size_t i = 0; i < sizeof kv_ll_neutral / sizeof kv_ll_neutral[0] && !ok; i++)
            ok = !strcmp(key, kv_ll_neutral[i].key) && json_is_number(v) &&
                 json_number_value(v) == kv_ll_neutral[i].neutral;
        if (!ok && json_is_null(v)) ok = true;
        if (!ok && !strcmp(key, "post_sampling_probs")) ok = json_is_false(v);
        if (!ok && (!strcmp(key, "grammar") || !strcmp(key, "json_schema")))
            ok = (json_is_string(v) && json_string_length(v) == 0) || (json_is_array(v) && !json_array_size(v)) ||
                 (json_is_object(v) && !json_object_size(v) && strcmp(key, "json_schema"));
        if (!ok && (!strcmp(key, "return_tokens") || !strcmp(key, "timings_per_token") || !strcmp(key, "return_progress")))
            ok = json_is_false(v);
        if (!ok)
            return kv_fail(d, KV_EUNSUPPORTED, "'%.64s' is not supported by this server's /completion (or not with "
                           "this value)", key);
    }
    return 0;
}

/* "prompt": a string (or an array holding one string), or an array of
 * token ids (each in [0, 2^31); the vocabulary bound is checked where it is
 * tokenized). */
static int kv_ll_prompt(kv_gw_params *p, json_t *o, kv_diag *d) {
    json_t *pr = json_object_get(o, "prompt");
    if (json_is_array(pr) && json_array_size(pr) == 1 && json_is_string(json_array_get(pr, 0)))
        pr = json_array_get(pr, 0);
    if (json_is_string(pr)) {
        p->prompt = json_string_value(pr);
        p->prompt_len = json_string_length(pr);
        return 0;
    }
    if (!json_is_array(pr) || !json_array_size(pr))
        return kv_fail(d, KV_EFORMAT, "'prompt' must be a string or a non-empty array of token ids");
    const size_t n = json_array_size(pr);
    if (!(p->prompt_ids = malloc(n * sizeof *p->prompt_ids))) return kv_fail(d, KV_ENOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(pr, i);
        if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) > INT32_MAX)
            return kv_fail(d, KV_EUNSUPPORTED, "'prompt' element %zu is not a token id (several prompts, mixed "
                           "strings and tokens and multimodal objects are not supported)", i);
        p->prompt_ids[i] = (int32_t)json_integer_value(t);
    }
    p->n_prompt_ids = n;
    return 0;
}

static int kv_ll_parse(kv_gw_params *p, json_t *o, kv_diag *d) {
    int rc;
    if ((rc = kv_ll_fields(o, d))) return rc;
    if ((rc = kv_gw_model(p, o, false, d))) return rc;
    if ((rc = kv_ll_prompt(p, o, d))) return rc;
    /* n_predict -1 (llama-server's "until the context is full") and seed -1
       ("random") are its defaults: as if absent */
    json_t *np = json_object_get(o, "n_predict");
    if (np && !json_is_null(np)) {
        if (!json_is_integer(np) || json_integer_value(np) < -1 || json_integer_value(np) == 0 ||
            json_integer_value(np) > KV_GW_MAX_TOKENS)
            return kv_fail(d, KV_ERANGE, "'n_predict' must be -1 or an integer in [1, %u]", KV_GW_MAX_TOKENS);
        p->has_max_tokens = true;
        p->max_tokens = json_integer_value(np) < 0 ? KV_GW_MAX_TOKENS : (uint32_t)json_integer_value(np);
    }
    json_t *seed = json_object_get(o, "seed");
    if (json_is_integer(seed) && json_integer_value(seed) == -1) json_object_del(o, "seed");
    if ((rc = kv_gw_sampling(p, o, NULL, d))) return rc;
    if ((rc = kv_gw_stops(p, o, "stop", d))) return rc;
    if ((rc = kv_gw_bool(o, "stream", &p->stream, d))) return rc;
    if ((rc = kv_gw_logit_bias(p, o, "logit_bias", d)) || (rc = kv_gw_n_probs(p, o, d)) ||
        (rc = kv_gw_penalties(p, o, "repeat_penalty", "repeat_last_n", d)))
        return rc;
    bool cache = true;
    return kv_gw_bool(o, "cache_prompt", &cache, d);
}

static char *kv_ll_error(unsigned status, const char *msg) {
    const char *type = status == 400 || status == 413 ? "invalid_request_error"
                     : status == 401 ? "authentication_error"
                     : status == 404 ? "not_found_error"
                     : status == 503 ? "unavailable_error"
                     : status == 501 ? "not_supported_error" : "server_error";
    json_t *j = json_pack("{s:{s:i,s:s,s:s}}", "error", "code", (int)status, "message", msg, "type", type);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

/* llama-server's timings: prompt (from the request read to its first
 * token) and prediction (from the first token to now). */
static json_t *kv_ll_timings(const kv_gw_result *r) {
    const double now = kv_gw_mono(), first = r->t_first > 0 ? r->t_first : now;
    const double pms = (first - r->t_start) * 1e3, gms = (now - first) * 1e3;
    const double pn = r->prompt_tokens, gn = r->completion_tokens;
    return json_pack("{s:I,s:f,s:f,s:f,s:I,s:f,s:f,s:f}", "prompt_n", (json_int_t)r->prompt_tokens, "prompt_ms", pms,
                     "prompt_per_token_ms", pn > 0 ? pms / pn : 0.0, "prompt_per_second", pms > 0 ? pn * 1e3 / pms : 0.0,
                     "predicted_n", (json_int_t)r->completion_tokens, "predicted_ms", gms, "predicted_per_token_ms",
                     gn > 0 ? gms / gn : 0.0, "predicted_per_second", gms > 0 ? gn * 1e3 / gms : 0.0);
}

/* The final object: the whole text (or "" at a stream's end) and the counts. */
static json_t *kv_ll_final(const kv_gw_result *r, const char *text, size_t n) {
    const char *type = r->stop_seq ? "word" : r->finish == KV_GW_FINISH_LENGTH ? "limit" : "eos";
    return json_pack("{s:i,s:s%,s:[],s:i,s:b,s:s,s:I,s:I,s:s,s:s,s:o}", "index", 0, "content", text, n, "tokens",
                     "id_slot", -1, "stop", 1, "model", r->model, "tokens_predicted", (json_int_t)r->completion_tokens,
                     "tokens_evaluated", (json_int_t)r->prompt_tokens, "stop_type", type, "stopping_word",
                     r->stop_seq ? r->stop_seq : "", "timings", kv_ll_timings(r));
}

/* n_probs: the tokens' completion_probabilities (logprobs.c) */
static json_t *kv_ll_probs(const kv_gw_result *r, json_t *j) {
    if (!j || !r->logprobs) return j;
    json_t *lp = kv_gw_lp_llama(r);
    if (!lp || json_object_set_new(j, "completion_probabilities", lp)) {
        json_decref(j);
        return NULL;
    }
    return j;
}

static char *kv_ll_full(const kv_gw_result *r, const kv_gw_answer *a) { /* a raw prompt: content only */
    json_t *j = kv_ll_probs(r, kv_ll_final(r, a->text, a->n));
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

static void kv_ll_begin(const kv_gw_result *r, kv_gw_buf *b) {}

static void kv_ll_delta(const kv_gw_result *r, const char *text, size_t n, kv_gw_buf *b) {
    json_t *j = kv_ll_probs(r, json_pack("{s:i,s:s%,s:[],s:b,s:i,s:I,s:I}", "index", 0, "content", text, n, "tokens",
                                         "stop", 0, "id_slot", -1, "tokens_predicted",
                                         (json_int_t)r->completion_tokens, "tokens_evaluated",
                                         (json_int_t)r->prompt_tokens));
    if (!j) b->oom = true;
    else kv_gw_buf_json(b, "data: ", j, "\n\n");
}

static void kv_ll_end(const kv_gw_result *r, bool include_usage, kv_gw_buf *b) {
    kv_gw_buf_json(b, "data: ", kv_ll_final(r, "", 0), "\n\n");
}

static void kv_ll_stream_error(const char *msg, kv_gw_buf *b) {
    char *e = kv_ll_error(500, msg);
    if (!e) {
        b->oom = true;
        return;
    }
    kv_gw_buf_add(b, "data: ", 6);
    kv_gw_buf_add(b, e, strlen(e));
    kv_gw_buf_add(b, "\n\n", 2);
    free(e);
}

const kv_gw_api_ops kv_gw_llama_ops = {
    .name = "llama", .id_prefix = "cmpl-", .stream_type = "text/event-stream", .auth_challenge = "Bearer",
    .parse = kv_ll_parse, .error_body = kv_ll_error, .full_body = kv_ll_full, .stream_begin = kv_ll_begin,
    .stream_delta = kv_ll_delta, .stream_end = kv_ll_end, .stream_error = kv_ll_stream_error,
};
