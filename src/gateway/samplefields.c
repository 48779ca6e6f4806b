/* The sampling and response fields beyond the basic sampler (parse.c has
 * temperature, top-k, top-p, min-p, seed): logit bias, presence, frequency
 * and repetition penalties, log-probabilities, echo, suffix, and the
 * refusal of every field the gateway knows it cannot honour (a 400 that
 * names it, never a silent 200). Each API's adapter calls the ones it
 * has, under its own names. docs/GATEWAY.md "Sampling fields". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/gateway_internal.h"

int kv_gw_num(json_t *o, const char *key, double lo, double hi, double *out, bool *has, kv_diag *d);
int kv_gw_bool(json_t *o, const char *key, bool *out, kv_diag *d);

/* A token id as OpenAI's logit_bias keys write it: decimal digits, no
 * sign, no leading zero (but "0"), below 2^31. */
static bool kv_sf_id(const char *s, int32_t *out) {
    const size_t n = strlen(s);
    if (n == 0 || n > 10 || (n > 1 && s[0] == '0')) return false;
    long long v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return false;
        v = v * 10 + (s[i] - '0');
    }
    if (v > INT32_MAX) return false;
    *out = (int32_t)v;
    return true;
}

static int kv_sf_bias_add(kv_gw_params *p, int32_t id, json_t *b, const char *key, kv_diag *d) {
    double x;
    if (json_is_false(b)) {
        x = -100.0; /* llama-server's [id, false]: never this token */
    } else {
        if (!json_is_number(b)) return kv_fail(d, KV_EFORMAT, "'%s' of token %d must be a number", key, id);
        x = json_number_value(b);
        if (!(x >= -100.0 && x <= 100.0))
            return kv_fail(d, KV_ERANGE, "'%s' of token %d is %g, outside [-100, 100]", key, id, x);
    }
    p->bias[p->n_bias++] = (kv_logit_bias){id, (float)x};
    return 0;
}

/* "logit_bias": OpenAI's {"TOKEN_ID": bias, ...}, or llama-server's
 * [[TOKEN_ID, bias|false], ...]; at most KV_SAMPLE_MAX_BIAS entries, each
 * bias in [-100, 100] (false: -100). Ids are checked against the
 * vocabulary where the prompt is tokenized (kv_gw_bias_check). llama-server
 * also takes a string in place of an id (every token of its text): not
 * here (a 400). */
int kv_gw_logit_bias(kv_gw_params *p, json_t *o, const char *key, kv_diag *d) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    const size_t n = json_is_object(v) ? json_object_size(v) : json_is_array(v) ? json_array_size(v) : 0;
    if (!json_is_object(v) && !json_is_array(v))
        return kv_fail(d, KV_EFORMAT, "'%s' must be an object {\"token id\": bias} or an array [[token id, bias]]",
                       key);
    if (n > KV_SAMPLE_MAX_BIAS)
        return kv_fail(d, KV_ERANGE, "'%s' has %zu entries, at most %u", key, n, KV_SAMPLE_MAX_BIAS);
    if (!n) return 0;
    if (!(p->bias = malloc(n * sizeof *p->bias))) return kv_fail(d, KV_ENOMEM, "out of memory");
    int rc;
    if (json_is_object(v)) {
        const char *k;
        json_t *b;
        json_object_foreach(v, k, b) {
            int32_t id;
            if (!kv_sf_id(k, &id))
                return kv_fail(d, KV_EFORMAT, "'%s' key '%.32s' is not a token id (a non-negative integer)", key, k);
            if ((rc = kv_sf_bias_add(p, id, b, key, d))) return rc;
        }
    } else {
        size_t i;
        json_t *e;
        json_array_foreach(v, i, e) {
            json_t *t = json_array_get(e, 0);
            if (!json_is_array(e) || json_array_size(e) != 2 || !json_is_integer(t) || json_integer_value(t) < 0 ||
                json_integer_value(t) > INT32_MAX)
                return kv_fail(d, KV_EFORMAT, "'%s' entry %zu must be [token id, bias] (a token's text is not "
                               "served)", key, i);
            if ((rc = kv_sf_bias_add(p, (int32_t)json_integer_value(t), json_array_get(e, 1), key, d))) return rc;
        }
    }
    p->sp.bias = p->bias;
    p->sp.n_bias = p->n_bias;
    return 0;
}

int kv_gw_bias_check(const kv_gw_params *p, int32_t n_vocab, kv_diag *d) {
    for (uint32_t i = 0; i < p->n_bias; i++)
        if (p->bias[i].token >= n_vocab)
            return kv_fail(d, KV_EINVAL, "'logit_bias' token %d is outside the vocabulary [0, %d)", p->bias[i].token,
                           n_vocab);
    return 0;
}

/* Presence and frequency penalties (OpenAI's names and range), and the
 * repetition penalty under repeat_key with its window under last_key
 * (llama-server's and Ollama's; NULL: not this API's). */
int kv_gw_penalties(kv_gw_params *p, json_t *o, const char *repeat_key, const char *last_key, kv_diag *d) {
    int rc;
    double x = 0;
    if ((rc = kv_gw_num(o, "presence_penalty", -2, 2, &x, NULL, d))) return rc;
    p->sp.presence_penalty = (float)x;
    x = 0;
    if ((rc = kv_gw_num(o, "frequency_penalty", -2, 2, &x, NULL, d))) return rc;
    p->sp.frequency_penalty = (float)x;
    if (repeat_key) {
        x = p->sp.repeat_penalty;
        if ((rc = kv_gw_num(o, repeat_key, 0.01, 100, &x, NULL, d))) return rc; /* 0: llama.cpp's "off" is 1 */
        p->sp.repeat_penalty = (float)x;
    }
    if (last_key) {
        bool has = false;
        x = p->sp.repeat_last_n;
        /* -1: the whole context (llama.cpp's); capped at the sampler's bound */
        if ((rc = kv_gw_num(o, last_key, -1, 1 << 20, &x, &has, d))) return rc;
        if (has && x != (double)(int32_t)x) return kv_fail(d, KV_EFORMAT, "'%s' must be an integer", last_key);
        p->sp.repeat_last_n = x < 0 ? 1 << 20 : (int32_t)x;
        if (x == 0) p->sp.repeat_penalty = 1.0f; /* nothing to look at: off */
    }
    return 0;
}

/* OpenAI's log-probabilities: chat "logprobs": true with "top_logprobs"
 * 0..20; completions "logprobs": N (0..5 in OpenAI's API; up to 20 here)
 * for the top N. */
int kv_gw_logprobs_openai(kv_gw_params *p, json_t *o, bool chat, kv_diag *d) {
    json_t *l = json_object_get(o, "logprobs"), *t = json_object_get(o, "top_logprobs");
    if (chat) {
        int rc;
        if ((rc = kv_gw_bool(o, "logprobs", &p->logprobs, d))) return rc;
        if (t && !json_is_null(t)) {
            if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) > KV_SAMPLE_MAX_TOP)
                return kv_fail(d, KV_ERANGE, "'top_logprobs' must be an integer in [0, %u]", KV_SAMPLE_MAX_TOP);
            if (!p->logprobs) return kv_fail(d, KV_EINVAL, "'top_logprobs' needs 'logprobs': true");
            p->top_logprobs = (uint32_t)json_integer_value(t);
        }
        return 0;
    }
    if (t && !json_is_null(t)) return kv_fail(d, KV_EINVAL, "'top_logprobs' is chat's; completions take 'logprobs': N");
    if (!l || json_is_null(l)) return 0;
    if (!json_is_integer(l) || json_integer_value(l) < 0 || json_integer_value(l) > KV_SAMPLE_MAX_TOP)
        return kv_fail(d, KV_ERANGE, "'logprobs' must be an integer in [0, %u]", KV_SAMPLE_MAX_TOP);
    p->logprobs = true;
    p->top_logprobs = (uint32_t)json_integer_value(l);
    return 0;
}

/* llama-server's "n_probs" on /completion: the top N of each token
 * (completion_probabilities). */
int kv_gw_n_probs(kv_gw_params *p, json_t *o, kv_diag *d) {
    json_t *n = json_object_get(o, "n_probs");
    if (!n || json_is_null(n)) return 0;
    if (!json_is_integer(n) || json_integer_value(n) < 0 || json_integer_value(n) > KV_SAMPLE_MAX_TOP)
        return kv_fail(d, KV_ERANGE, "'n_probs' must be an integer in [0, %u]", KV_SAMPLE_MAX_TOP);
    p->logprobs = json_integer_value(n) > 0; /* 0: llama-server's "none" */
    p->top_logprobs = (uint32_t)json_integer_value(n);
    return 0;
}

/* Fields of OpenAI's API (and llama.cpp's extensions to it) that change the
 * answer and that Kvasir does not honour: refused by name unless they hold
 * the value that changes nothing. (response_format and grammar are
 * structured output's, structured.c.) */
int kv_gw_refuse_openai(json_t *o, bool chat, kv_diag *d) {
    static const char *const never[] = {"functions", "function_call", "audio", "prediction", "web_search_options",
                                        "mirostat", NULL};
    json_t *v;
    for (size_t i = 0; never[i]; i++)
        if ((v = json_object_get(o, never[i])) && !json_is_null(v) &&
            !(json_is_array(v) && !json_array_size(v)) && !(json_is_integer(v) && !json_integer_value(v)) &&
            !(json_is_string(v) && !json_string_length(v)))
            return kv_fail(d, KV_EUNSUPPORTED, "'%s' is not supported by this server", never[i]);
    if ((v = json_object_get(o, "best_of")) && !json_is_null(v) && !(json_is_integer(v) && json_integer_value(v) == 1))
        return kv_fail(d, KV_EUNSUPPORTED, "'best_of' must be 1 (not supported: ask for 'n' answers and choose)");
    if ((v = json_object_get(o, "modalities")) && !json_is_null(v)) {
        size_t i;
        json_t *m;
        if (!json_is_array(v)) return kv_fail(d, KV_EFORMAT, "'modalities' must be an array");
        json_array_foreach(v, i, m) if (!json_is_string(m) || strcmp(json_string_value(m), "text"))
            return kv_fail(d, KV_EUNSUPPORTED, "'modalities' other than \"text\" are not supported by this server");
    }
    if ((v = json_object_get(o, "typical_p")) && !json_is_null(v) && !(json_is_number(v) && json_number_value(v) == 1))
        return kv_fail(d, KV_EUNSUPPORTED, "'typical_p' is not supported by this server (or not with this value)");
    if (!chat && (v = json_object_get(o, "suffix")) && !json_is_null(v) &&
        !(json_is_string(v) && !json_string_length(v)))
        return kv_fail(d, KV_EUNSUPPORTED, "'suffix' is not supported by this model (its vocabulary has no "
                       "fill-in-the-middle tokens)");
    return 0;
}
