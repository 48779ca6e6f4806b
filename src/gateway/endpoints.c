/* The endpoints clients probe that are no generation, and the gateway's
 * habits around every request (server_internal.h):
 *   POST /tokenize, POST /detokenize, GET /props     llama-server's shapes;
 *   POST /api/show, GET /api/version, GET /api/ps     Ollama's;
 *   GET /v1/models/{id}                               OpenAI's;
 *   CORS (opts.cors_origins), the request log line, the startup summary,
 *   and the 503 a prompt gets while the model cannot run.
 * Everything here reads what is immutable once the gateway started (the
 * tokenizer, the model's GGUF, the options) or takes g->mu for the rest, so
 * any connection thread may call it. A body is parsed within the request's
 * memory budget (parse_max); every field is type-checked and an unknown
 * one is a 400 naming it. */
#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gateway/server_internal.h"
#include "http/http_guard.h"
#include "kvasir/model.h"
#include "kvasir/quant.h"

/* The Ollama API level /api/version reports: the one whose shapes these
 * endpoints follow (clients compare it before they use /api/chat). */
#define KV_GW_OLLAMA_VERSION "0.6.0"
#define KV_GW_MAX_INFO_ARRAY 64u
#define KV_GW_MAX_DETOKENIZE (4u << 20) /* bytes of text /detokenize gives (a token's text may be long) */ /* GGUF arrays /api/show lists whole; longer ones are null (Ollama's habit) */

double kv_gw_mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- life ------------------------------------------------------------- */

/* An Origin as a browser sends it: "*" or scheme://host[:port], printable
 * ASCII without spaces, commas or quotes. */
static bool kv_origin_ok(const char *s) {
    const size_t n = strlen(s);
    if (!n || n > KV_GATEWAY_MAX_ORIGIN_LEN) return false;
    if (!strcmp(s, "*")) return true;
    for (size_t i = 0; i < n; i++)
        if (s[i] <= ' ' || s[i] >= 0x7f || s[i] == ',' || s[i] == '"') return false;
    return strstr(s, "://") != NULL;
}

int kv_gw_endpoints_start(kv_gateway *g, const kv_gateway_opts *o, kv_diag *d) {
    if (o->n_cors > KV_GATEWAY_MAX_CORS)
        return kv_fail(d, KV_EINVAL, "gateway: %u CORS origins, at most %u", o->n_cors, KV_GATEWAY_MAX_CORS);
    if (o->n_cors && !(g->cors = calloc(o->n_cors, sizeof *g->cors))) return kv_fail(d, KV_ENOMEM, "gateway: out of memory");
    for (uint32_t i = 0; i < o->n_cors; i++) {
        if (!o->cors_origins[i] || !kv_origin_ok(o->cors_origins[i]))
            return kv_fail(d, KV_EINVAL, "gateway: CORS origin '%.64s' is not '*' or SCHEME://HOST[:PORT] (at most %u "
                           "printable bytes, no spaces or commas)", o->cors_origins[i] ? o->cors_origins[i] : "",
                           KV_GATEWAY_MAX_ORIGIN_LEN);
        if (!(g->cors[g->n_cors++] = strdup(o->cors_origins[i]))) return kv_fail(d, KV_ENOMEM, "gateway: out of memory");
    }
    if (o->model_path && !(g->model_path = strdup(o->model_path))) return kv_fail(d, KV_ENOMEM, "gateway: out of memory");
    if (o->chat_template && o->chat_template_len <= KV_GATEWAY_MAX_TEMPLATE) {
        if (!(g->tmpl_own = malloc(o->chat_template_len + 1))) return kv_fail(d, KV_ENOMEM, "gateway: out of memory");
        memcpy(g->tmpl_own, o->chat_template, o->chat_template_len);
        g->tmpl_own[o->chat_template_len] = 0;
        g->tmpl_src = g->tmpl_own;
        g->tmpl_src_len = o->chat_template_len;
    } else if (g->e) { /* the model's own: a view into its mapping, which outlives the gateway */
        kv_str s = {0};
        kv_diag td = {0};
        const kv_gguf *gg = kv_model_gguf(kv_engine_model(g->e));
        if (gg && kv_gguf_find_kv(gg, "tokenizer.chat_template") &&
            !kv_gguf_get_str(gg, "tokenizer.chat_template", &s, &td)) {
            g->tmpl_src = s.ptr;
            g->tmpl_src_len = s.len;
        }
    }
    return 0;
}

void kv_gw_endpoints_free(kv_gateway *g) {
    for (uint32_t i = 0; i < g->n_cors; i++) free(g->cors[i]);
    free(g->cors);
    free(g->model_path);
    free(g->tmpl_own);
}

/* ---- what the model is -------------------------------------------------- */

#define KV_GW_MAX_TYPES 40u

typedef struct kv_gw_facts {
    const kv_hparams *hp;       /* NULL over a ring */
    uint64_t n_params;          /* elements of every weight, the routed experts counted when on workers */
    bool experts_remote;        /* the experts are not in the file served here (workers) */
    struct {
        uint32_t type;
        uint64_t bytes;
    } types[KV_GW_MAX_TYPES];   /* bytes of tensors of each type, most first */
    uint32_t n_types;
    uint64_t bytes;             /* of every tensor here */
} kv_gw_facts;

static void kv_facts(const kv_gateway *g, kv_gw_facts *f) {
    memset(f, 0, sizeof *f);
    if (!g->e) return;
    const kv_model *m = kv_engine_model(g->e);
    const kv_gguf *gg = kv_model_gguf(m);
    f->hp = kv_model_hparams(m);
    for (size_t i = 0; gg && i < kv_gguf_n_tensors(gg); i++) {
        const kv_gguf_tensor *t = kv_gguf_tensor_at(gg, i);
        uint64_t el = 1;
        for (uint32_t k = 0; k < t->n_dims; k++) el *= t->ne[k]; /* the reader bounded each by the file's size */
        f->n_params += el;
        f->bytes += t->nbytes;
        uint32_t k = 0;
        while (k < f->n_types && f->types[k].type != t->type) k++;
        if (k == f->n_types && f->n_types < KV_GW_MAX_TYPES) f->types[f->n_types++].type = t->type;
        if (k < f->n_types) f->types[k].bytes += t->nbytes;
    }
    /* a coordinator's file is the backbone: its routed experts are on the
       workers, three matrices [n_ff_exp][n_embd] per expert per layer */
    if (!kv_model_has_experts(m)) {
        f->experts_remote = true;
        f->n_params += (uint64_t)f->hp->n_layer * f->hp->n_expert * 3u * f->hp->n_embd * f->hp->n_ff_exp;
    }
    for (uint32_t i = 1; i < f->n_types; i++) /* most bytes first (a handful: insertion sort) */
        for (uint32_t j = i; j > 0 && f->types[j].bytes > f->types[j - 1].bytes; j--) {
            const __typeof__(f->types[0]) t = f->types[j];
            f->types[j] = f->types[j - 1];
            f->types[j - 1] = t;
        }
}

/* "30.5B", "1.2M" (Ollama's parameter_size). */
static void kv_params_str(uint64_t n, char *buf, size_t cap) {
    if (n >= 1000000000ull) snprintf(buf, cap, "%.1fB", n / 1e9);
    else if (n >= 1000000ull) snprintf(buf, cap, "%.1fM", n / 1e6);
    else if (n >= 1000ull) snprintf(buf, cap, "%.1fK", n / 1e3);
    else snprintf(buf, cap, "%llu", (unsigned long long)n);
}

static const char *kv_type_str(uint32_t type) {
    const kv_type_info *ti = kv_type_get(type);
    return ti && ti->name ? ti->name : "?";
}

/* Ollama's quantization_level: the type that holds the most bytes, upper case. */
static void kv_quant_level(const kv_gw_facts *f, char *buf, size_t cap) {
    snprintf(buf, cap, "%s", f->n_types ? kv_type_str(f->types[0].type) : "unknown");
    for (char *p = buf; *p; p++) *p = (char)toupper((unsigned char)*p);
}

static const char *kv_tmpl_from(const kv_gateway *g) {
    if (g->tmpl) return kv_gw_tmpl_name(g->tmpl);
    return g->n_ring ? "the ring model's own, once an entry node sent its tokenizer (ChatML if it has none)"
                     : "ChatML (the model has no usable template)";
}

void kv_gw_summary(kv_gateway *g, const char *host, bool tls) {
    if (g->o.quiet) return;
    char url[200];
    snprintf(url, sizeof url, strchr(host, ':') ? "%s://[%s]:%u" : "%s://%s:%u", tls ? "https" : "http", host,
             (unsigned)g->port);
    if (!g->e && !g->n_ring) {
        fprintf(stderr, "gateway: model %s cannot run (%s); /health and prompts answer 503; serving %s\n", g->model,
                g->health_msg, url);
        return;
    }
    if (!g->e) {
        fprintf(stderr, "gateway: model %s over a ring of %u entry node%s; prompt template: %s; serving %s\n", g->model,
                g->n_ring, g->n_ring == 1 ? "" : "s", kv_tmpl_from(g), url);
        return;
    }
    kv_gw_facts f;
    kv_facts(g, &f);
    char ps[32], types[400];
    kv_params_str(f.n_params, ps, sizeof ps);
    size_t at = 0;
    types[0] = 0;
    for (uint32_t i = 0; i < f.n_types && at < sizeof types - 40; i++) {
        const double pc = f.bytes ? 100.0 * f.types[i].bytes / f.bytes : 0.0;
        at += (size_t)snprintf(types + at, sizeof types - at, pc < 0.5 ? "%s%s <1%%" : "%s%s %.0f%%", i ? ", " : "",
                               kv_type_str(f.types[i].type), pc);
    }
    fprintf(stderr,
            "gateway: model %s: %s, %s parameters, %u layers, %u experts (%u used per token)%s; types by bytes: %s; "
            "context %u; prompt template: %s; serving %s\n",
            g->model, f.hp->arch_name, ps, f.hp->n_layer, f.hp->n_expert, f.hp->n_expert_used,
            f.experts_remote ? " on workers" : "", types, g->n_ctx, kv_tmpl_from(g), url);
}

/* ---- request habits ------------------------------------------------------ */

void kv_gw_log_request(const kv_gateway *g, const char *method, const char *route, unsigned status,
                       uint32_t prompt_tokens, uint32_t completion_tokens, double ms) {
    if (g->o.quiet) return;
    char ts[32];
    const time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%SZ", &tm);
    /* one write: lines from concurrent requests do not interleave */
    fprintf(stderr, "gateway: %s %.8s %s %u prompt_tokens=%u completion_tokens=%u ms=%.1f\n", ts, method, route, status,
            prompt_tokens, completion_tokens, ms);
}

/* The allowed Origin to echo for c, or NULL. */
static const char *kv_cors_allow(const kv_gateway *g, struct MHD_Connection *c) {
    if (!g->n_cors) return NULL;
    const char *origin = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Origin");
    if (!origin) return NULL;
    for (uint32_t i = 0; i < g->n_cors; i++)
        if (!strcmp(g->cors[i], "*") || !strcmp(g->cors[i], origin)) return !strcmp(g->cors[i], "*") ? "*" : g->cors[i];
    return NULL;
}

void kv_gw_cors_headers(const kv_gateway *g, struct MHD_Connection *c, struct MHD_Response *r) {
    if (!g->n_cors) return;
    MHD_add_response_header(r, "Vary", "Origin");
    const char *allow = kv_cors_allow(g, c);
    if (!allow) return;
    MHD_add_response_header(r, "Access-Control-Allow-Origin", allow);
    MHD_add_response_header(r, "Access-Control-Expose-Headers", "X-KVR-Cost, Retry-After");
}

bool kv_gw_cors_preflight(const kv_gateway *g, struct MHD_Connection *c, kv_gw_reply *a) {
    if (!g->n_cors) return false;
    const bool ok = kv_cors_allow(g, c) != NULL;
    a->status = ok ? 204 : 403;
    a->type = "application/json";
    a->body = strdup(ok ? "" : "{\"error\":{\"message\":\"this Origin is not allowed (--cors)\",\"type\":"
                               "\"invalid_request_error\"}}");
    return true;
}

bool kv_gw_unavailable(kv_gateway *g, char *msg, size_t cap) {
    pthread_mutex_lock(&g->mu);
    const bool down = !g->healthy || g->quit;
    if (down) snprintf(msg, cap, "the model cannot run now: %s", g->health_msg[0] ? g->health_msg : "stopping");
    pthread_mutex_unlock(&g->mu);
    return down;
}

/* ---- the endpoints ----------------------------------------------------- */

enum kv_ep { KV_EP_TOKENIZE = 0, KV_EP_DETOKENIZE, KV_EP_PROPS, KV_EP_SHOW, KV_EP_VERSION, KV_EP_PS, KV_EP_MODEL, KV_EP_COUNT };

static const struct {
    const char *method, *url;
    int api;
} kv_eps[KV_EP_COUNT] = {
    [KV_EP_TOKENIZE] = {"POST", "/tokenize", KV_GW_LLAMA},
    [KV_EP_DETOKENIZE] = {"POST", "/detokenize", KV_GW_LLAMA},
    [KV_EP_PROPS] = {"GET", "/props", KV_GW_LLAMA},
    [KV_EP_SHOW] = {"POST", "/api/show", KV_GW_OLLAMA},
    [KV_EP_VERSION] = {"GET", "/api/version", KV_GW_OLLAMA},
    [KV_EP_PS] = {"GET", "/api/ps", KV_GW_OLLAMA},
    [KV_EP_MODEL] = {"GET", "/v1/models/", KV_GW_OPENAI_CHAT}, /* a prefix: /v1/models/{id} */
};

static int kv_ep_find(const char *url) {
    for (int i = 0; i < KV_EP_COUNT; i++)
        if (i == KV_EP_MODEL ? !strncmp(url, kv_eps[i].url, strlen(kv_eps[i].url)) && url[strlen(kv_eps[i].url)]
                             : !strcmp(url, kv_eps[i].url))
            return i;
    return -1;
}

bool kv_gw_endpoint_of(const char *method, const char *url, bool *method_ok, int *api, const char **name) {
    const int i = kv_ep_find(url);
    if (i < 0) return false;
    *method_ok = !strcmp(method, kv_eps[i].method);
    *api = kv_eps[i].api;
    *name = i == KV_EP_MODEL ? "/v1/models/{id}" : kv_eps[i].url;
    return true;
}

static void kv_ans_json(kv_gw_reply *a, unsigned status, json_t *j) {
    a->status = status;
    a->type = "application/json";
    a->body = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
}

static void kv_ans_err(kv_gw_reply *a, int api, unsigned status, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void kv_ans_err(kv_gw_reply *a, int api, unsigned status, const char *fmt, ...) {
    char msg[600], clean[1801];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    clean[kv_gw_utf8_clean(msg, strlen(msg), clean)] = 0;
    a->status = status;
    a->type = "application/json";
    a->body = kv_gw_api(api)->error_body(status, clean);
}

/* The body as a JSON object within the request's memory budget; NULL with
 * a answered (400, 413) when it is not one. */
static json_t *kv_ep_body(kv_gateway *g, const char *body, size_t n, int api, kv_gw_reply *a) {
    json_error_t je;
    bool over = false;
    kv_json_budget_begin(g->o.parse_max);
    json_t *j = json_loadb(body ? body : "", n, JSON_REJECT_DUPLICATES, &je);
    kv_json_budget_end(&over);
    if (over) {
        json_decref(j);
        kv_ans_err(a, api, 413, "the JSON body needs more than %zu bytes of memory to parse", g->o.parse_max);
        return NULL;
    }
    if (!j) {
        kv_ans_err(a, api, 400, "malformed JSON body: %.200s (line %d, column %d)", je.text, je.line, je.column);
        return NULL;
    }
    if (!json_is_object(j)) {
        json_decref(j);
        kv_ans_err(a, api, 400, "the body must be a JSON object");
        return NULL;
    }
    return j;
}

/* Every key of o is in allowed (NULL-terminated); else a is a 400 naming it. */
static bool kv_ep_fields(json_t *o, const char *const *allowed, int api, kv_gw_reply *a) {
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v) {
        bool ok = false;
        for (size_t i = 0; allowed[i] && !ok; i++) ok = !strcmp(key, allowed[i]);
        if (!ok) {
            kv_ans_err(a, api, 400, "'%.64s' is not supported here", key);
            return false;
        }
    }
    return true;
}

/* A boolean field (absent or null: dflt); false with a 400 otherwise. */
static bool kv_ep_bool(json_t *o, const char *key, bool dflt, bool *out, int api, kv_gw_reply *a) {
    json_t *v = json_object_get(o, key);
    *out = dflt;
    if (!v || json_is_null(v)) return true;
    if (!json_is_boolean(v)) {
        kv_ans_err(a, api, 400, "'%s' must be true or false", key);
        return false;
    }
    *out = json_is_true(v);
    return true;
}

/* A token's text as llama-server gives a piece: a string when it is whole
 * UTF-8, else its bytes. */
static json_t *kv_piece_json(const kv_tok *tok, int32_t id) {
    char pb[KV_TOK_MAX_TOKEN_BYTES], clean[3 * KV_TOK_MAX_TOKEN_BYTES + 1];
    int n = kv_tok_piece(tok, id, true, pb, sizeof pb);
    if (n < 0) n = 0;
    if (n > (int)sizeof pb) n = (int)sizeof pb;
    const size_t cn = kv_gw_utf8_clean(pb, (size_t)n, clean);
    if (cn == (size_t)n && !memcmp(clean, pb, cn)) return json_stringn(pb, (size_t)n);
    json_t *arr = json_array();
    for (int i = 0; arr && i < n; i++) json_array_append_new(arr, json_integer((unsigned char)pb[i]));
    return arr;
}

static void kv_ep_tokenize(kv_gateway *g, json_t *o, kv_gw_reply *a) {
    static const char *const allowed[] = {"content", "add_special", "parse_special", "with_pieces", NULL};
    const int api = KV_GW_LLAMA;
    if (!kv_ep_fields(o, allowed, api, a)) return;
    json_t *c = json_object_get(o, "content");
    if (!json_is_string(c)) return kv_ans_err(a, api, 400, "'content' must be a string");
    bool add_special, parse_special, pieces;
    if (!kv_ep_bool(o, "add_special", false, &add_special, api, a) ||
        !kv_ep_bool(o, "parse_special", true, &parse_special, api, a) ||
        !kv_ep_bool(o, "with_pieces", false, &pieces, api, a))
        return;
    const size_t len = json_string_length(c);
    const size_t cap = 3 * len + 8; /* a token holds at least one byte; an invalid one is U+FFFD's three */
    int32_t *ids = malloc(cap * sizeof *ids);
    if (!ids) return kv_ans_err(a, api, 500, "out of memory");
    size_t off = 0, n = 0;
    if (add_special && kv_tok_add_bos(g->tok) && kv_tok_bos(g->tok) >= 0) ids[off++] = kv_tok_bos(g->tok);
    kv_diag d = {0};
    if (kv_tok_encode(g->tok, json_string_value(c), len, parse_special, ids + off, cap - off, &n, &d)) {
        free(ids);
        return kv_ans_err(a, api, 400, "cannot tokenize 'content': %s", d.msg);
    }
    /* written out one token at a time: a tree of a million JSON values
       would hold tens of bytes for every byte of the body */
    kv_gw_buf b = {0};
    kv_gw_buf_add(&b, "{\"tokens\":[", 11);
    for (size_t i = 0; i < off + n && !b.oom; i++) {
        if (pieces) {
            kv_gw_buf_json(&b, i ? "," : "", json_pack("{s:i,s:o}", "id", (int)ids[i], "piece", kv_piece_json(g->tok, ids[i])),
                           "");
            continue;
        }
        char num[24];
        const int k = snprintf(num, sizeof num, "%s%d", i ? "," : "", (int)ids[i]);
        kv_gw_buf_add(&b, num, (size_t)k);
    }
    kv_gw_buf_add(&b, "]}", 2);
    free(ids);
    if (b.oom) {
        free(b.p);
        return kv_ans_err(a, api, 500, "out of memory");
    }
    a->status = 200;
    a->type = "application/json";
    a->body = b.p;
}

static void kv_ep_detokenize(kv_gateway *g, json_t *o, kv_gw_reply *a) {
    static const char *const allowed[] = {"tokens", NULL};
    const int api = KV_GW_LLAMA;
    if (!kv_ep_fields(o, allowed, api, a)) return;
    json_t *t = json_object_get(o, "tokens");
    if (!json_is_array(t)) return kv_ans_err(a, api, 400, "'tokens' must be an array of token ids");
    const int32_t n_vocab = kv_tok_n_vocab(g->tok);
    kv_gw_buf b = {0};
    char pb[KV_TOK_MAX_TOKEN_BYTES];
    size_t i;
    json_t *v;
    json_array_foreach(t, i, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= n_vocab) {
            free(b.p);
            return kv_ans_err(a, api, 400, "'tokens' element %zu is not a token id in [0, %d)", i, n_vocab);
        }
        int pn = kv_tok_piece(g->tok, (int32_t)json_integer_value(v), true, pb, sizeof pb);
        if (pn > (int)sizeof pb) pn = (int)sizeof pb;
        if (pn > 0) kv_gw_buf_add(&b, pb, (size_t)pn);
        if (b.n > KV_GW_MAX_DETOKENIZE) {
            free(b.p);
            return kv_ans_err(a, api, 400, "the text of 'tokens' is over %u bytes", KV_GW_MAX_DETOKENIZE);
        }
    }
    char *clean = b.oom ? NULL : malloc(3 * b.n + 1);
    if (!clean) {
        free(b.p);
        return kv_ans_err(a, api, 500, "out of memory");
    }
    const size_t cn = kv_gw_utf8_clean(b.p ? b.p : "", b.n, clean);
    free(b.p);
    kv_ans_json(a, 200, json_pack("{s:s%}", "content", clean, cn));
    free(clean);
}

/* A template source as a JSON string ("" when none or not UTF-8). */
static json_t *kv_tmpl_json(const kv_gateway *g) {
    json_t *s = g->tmpl && g->tmpl_src ? json_stringn(g->tmpl_src, g->tmpl_src_len) : NULL;
    return s ? s : json_string("");
}

static json_t *kv_tok_text_json(const kv_tok *tok, int32_t id) {
    if (!tok || id < 0) return json_string("");
    return kv_piece_json(tok, id);
}

static void kv_ep_props(kv_gateway *g, kv_gw_reply *a) {
    const kv_sample_params sp = kv_sample_defaults();
    json_t *params = json_pack("{s:I,s:i,s:f,s:i,s:f,s:f,s:f,s:[],s:b,s:b}", "n_predict",
                               (json_int_t)g->o.max_tokens_default, "seed", -1, "temperature", (double)sp.temp, "top_k",
                               (int)sp.top_k, "top_p", (double)sp.top_p, "min_p", (double)sp.min_p, "repeat_penalty",
                               (double)sp.repeat_penalty, "stop", "ignore_eos", 0, "stream", 0);
    json_t *j = json_pack("{s:{s:i,s:i,s:I,s:b,s:o},s:I,s:s,s:o,s:s,s:o,s:o,s:{s:b,s:b},s:s}", "default_generation_settings",
                          "id", 0, "id_task", -1, "n_ctx", (json_int_t)g->n_ctx, "is_processing", 0, "params", params,
                          "total_slots", (json_int_t)g->o.max_active, "model_alias", g->model, "chat_template",
                          kv_tmpl_json(g), "chat_template_source", kv_tmpl_from(g), "bos_token",
                          kv_tok_text_json(g->tok, g->tok ? kv_tok_bos(g->tok) : -1), "eos_token",
                          kv_tok_text_json(g->tok, g->tok ? kv_tok_eos(g->tok) : -1), "modalities", "vision", 0,
                          "audio", 0, "build_info", "kvasir (built " __DATE__ ")");
    if (j && g->model_path) {
        char clean[3 * 4096 + 1];
        const size_t pl = strnlen(g->model_path, 4096);
        json_object_set_new(j, "model_path", json_stringn(clean, kv_gw_utf8_clean(g->model_path, pl, clean)));
    }
    kv_ans_json(a, 200, j);
}

/* Is name (Ollama's "NAME" or "NAME:latest") the model served? */
static bool kv_is_ours(const kv_gateway *g, const char *name) {
    const size_t l = strlen(g->model);
    return !strncmp(name, g->model, l) && (!name[l] || !strcmp(name + l, ":latest"));
}

/* One GGUF metadata value as JSON (strings cleaned to UTF-8; arrays longer
 * than KV_GW_MAX_INFO_ARRAY null). */
static json_t *kv_gguf_json(const kv_gguf_value *v) {
    switch (v->type) {
    case KV_GGUF_UINT8: case KV_GGUF_UINT16: case KV_GGUF_UINT32: case KV_GGUF_UINT64:
        return json_integer(v->v.u64 > (uint64_t)INT64_MAX ? INT64_MAX : (json_int_t)v->v.u64);
    case KV_GGUF_INT8: case KV_GGUF_INT16: case KV_GGUF_INT32: case KV_GGUF_INT64: return json_integer(v->v.i64);
    case KV_GGUF_FLOAT32: case KV_GGUF_FLOAT64: return json_real(v->v.f64);
    case KV_GGUF_BOOL: return json_boolean(v->v.u64 != 0);
    case KV_GGUF_STRING: {
        char *clean = malloc(3 * v->v.str.len + 1);
        json_t *s = clean ? json_stringn(clean, kv_gw_utf8_clean(v->v.str.ptr, v->v.str.len, clean)) : NULL;
        free(clean);
        return s;
    }
    case KV_GGUF_ARRAY: {
        if (v->v.arr.n > KV_GW_MAX_INFO_ARRAY) return json_null();
        json_t *arr = json_array();
        const size_t es = kv_gguf_type_size(v->v.arr.elem_type);
        for (uint64_t i = 0; arr && i < v->v.arr.n; i++) {
            kv_gguf_value e = {.type = v->v.arr.elem_type};
            if (e.type == KV_GGUF_STRING) {
                if (kv_gguf_arr_str(v, i, &e.v.str)) break;
            } else if (e.type == KV_GGUF_ARRAY || !es || es > 8) {
                break; /* nested arrays: not listed */
            } else {
                uint8_t raw[8] = {0};
                memcpy(raw, v->v.arr.data + i * es, es);
                uint64_t u = 0;
                for (size_t k = 0; k < es; k++) u |= (uint64_t)raw[k] << (8 * k);
                if (e.type == KV_GGUF_FLOAT32) {
                    float f;
                    uint32_t u32 = (uint32_t)u;
                    memcpy(&f, &u32, 4);
                    e.v.f64 = f;
                } else if (e.type == KV_GGUF_FLOAT64) {
                    memcpy(&e.v.f64, &u, 8);
                } else if (e.type == KV_GGUF_INT8 || e.type == KV_GGUF_INT16 || e.type == KV_GGUF_INT32 ||
                           e.type == KV_GGUF_INT64) {
                    const unsigned sh = 64 - 8 * (unsigned)es; /* sign-extend */
                    e.v.i64 = (int64_t)(u << sh) >> sh;
                } else {
                    e.v.u64 = u;
                }
            }
            json_array_append_new(arr, kv_gguf_json(&e));
        }
        return arr;
    }
    default: return json_null();
    }
}

static json_t *kv_details(const kv_gateway *g, const kv_gw_facts *f) {
    char ps[32], ql[32];
    kv_params_str(f->n_params, ps, sizeof ps);
    kv_quant_level(f, ql, sizeof ql);
    const char *arch = f->hp ? f->hp->arch_name : "unknown";
    return json_pack("{s:s,s:s,s:s,s:[s],s:s,s:s}", "parent_model", "", "format", "gguf", "family", arch, "families", arch,
                     "parameter_size", ps, "quantization_level", ql);
}

static void kv_ep_show(kv_gateway *g, json_t *o, kv_gw_reply *a) {
    static const char *const allowed[] = {"model", "name", "verbose", NULL};
    const int api = KV_GW_OLLAMA;
    if (!kv_ep_fields(o, allowed, api, a)) return;
    json_t *m = json_object_get(o, "model");
    if (!m || json_is_null(m)) m = json_object_get(o, "name");
    if (!json_is_string(m)) return kv_ans_err(a, api, 400, "'model' must be a string");
    bool verbose;
    if (!kv_ep_bool(o, "verbose", false, &verbose, api, a)) return;
    if (verbose) return kv_ans_err(a, api, 400, "'verbose' is not supported here (long arrays are listed as null)");
    if (!kv_is_ours(g, json_string_value(m)))
        return kv_ans_err(a, api, 404, "model '%.256s' not found (this gateway serves '%s')", json_string_value(m),
                          g->model);
    if (!g->e) return kv_ans_err(a, api, 501, "a ring gateway does not hold the model's file: ask a ring node");
    kv_gw_facts f;
    kv_facts(g, &f);
    const kv_gguf *gg = kv_model_gguf(kv_engine_model(g->e));
    json_t *info = json_object();
    for (size_t i = 0; info && i < kv_gguf_n_kv(gg); i++) {
        const kv_gguf_kv *kv = kv_gguf_kv_at(gg, i);
        char key[256];
        if (kv->key.len >= sizeof key) continue;
        memcpy(key, kv->key.ptr, kv->key.len);
        key[kv->key.len] = 0;
        if (!strcmp(key, "tokenizer.chat_template")) continue; /* it is "template" */
        char clean[3 * sizeof key];
        clean[kv_gw_utf8_clean(key, kv->key.len, clean)] = 0;
        json_object_set_new(info, clean, kv_gguf_json(&kv->val));
    }
    if (info && !json_object_get(info, "general.parameter_count"))
        json_object_set_new(info, "general.parameter_count", json_integer((json_int_t)f.n_params));
    char ts[32];
    const time_t t = (time_t)g->started;
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%SZ", &tm);
    kv_ans_json(a, 200, json_pack("{s:s,s:s,s:s,s:o,s:o,s:o,s:[s],s:s}", "license", "", "modelfile", "", "parameters", "",
                                  "template", kv_tmpl_json(g), "details", kv_details(g, &f), "model_info", info,
                                  "capabilities", "completion", "modified_at", ts));
}

static void kv_ep_ps(kv_gateway *g, kv_gw_reply *a) {
    json_t *models = json_array();
    if (g->e) {
        kv_gw_facts f;
        kv_facts(g, &f);
        json_array_append_new(models, json_pack("{s:s,s:s,s:I,s:s,s:o,s:s,s:I,s:I}", "name", g->model, "model", g->model,
                                                "size", (json_int_t)f.bytes, "digest", "", "details", kv_details(g, &f),
                                                "expires_at", "2318-01-01T00:00:00Z", "size_vram", (json_int_t)0,
                                                "context_length", (json_int_t)g->n_ctx));
    }
    kv_ans_json(a, 200, json_pack("{s:o}", "models", models));
}

void kv_gw_endpoint(kv_gateway *g, const char *url, const char *body, size_t n, int api, kv_gw_reply *a) {
    memset(a, 0, sizeof *a);
    const int ep = kv_ep_find(url);
    switch (ep) {
    case KV_EP_VERSION: return kv_ans_json(a, 200, json_pack("{s:s}", "version", KV_GW_OLLAMA_VERSION));
    case KV_EP_PS: return kv_ep_ps(g, a);
    case KV_EP_PROPS: return kv_ep_props(g, a);
    case KV_EP_MODEL: {
        const char *id = url + strlen(kv_eps[KV_EP_MODEL].url);
        if (strcmp(id, g->model)) {
            char clean[3 * 256 + 1], msg[1200];
            clean[kv_gw_utf8_clean(id, strnlen(id, 256), clean)] = 0;
            snprintf(msg, sizeof msg, "The model '%s' does not exist (this gateway serves '%s')", clean, g->model);
            json_t *j = json_pack("{s:{s:s,s:s,s:s,s:s}}", "error", "message", msg, "type", "invalid_request_error",
                                  "param", "model", "code", "model_not_found");
            return kv_ans_json(a, 404, j);
        }
        return kv_ans_json(a, 200, json_pack("{s:s,s:s,s:I,s:s}", "id", g->model, "object", "model", "created",
                                             (json_int_t)g->started, "owned_by", "kvasir"));
    }
    default: break;
    }
    if ((ep == KV_EP_TOKENIZE || ep == KV_EP_DETOKENIZE) && !g->tok)
        return g->n_ring ? kv_ans_err(a, api, 501, "the ring's tokenizer is not here yet (no entry node has sent it)")
                         : kv_ans_err(a, api, 503, "the model cannot run here: %s", g->health_msg);
    /* the parse's memory is reserved whole from the gateway's total, as a
       generation's is (routes.c), and given back once answered */
    pthread_mutex_lock(&g->mu);
    const bool room = g->parse_live + g->o.parse_max <= g->o.parse_total;
    if (room) g->parse_live += g->o.parse_max;
    else g->parse_refused++;
    pthread_mutex_unlock(&g->mu);
    if (!room)
        return kv_ans_err(a, api, 503, "the gateway is parsing as many request bodies as its memory allows (%zu bytes); "
                          "retry later", g->o.parse_total);
    json_t *o = kv_ep_body(g, body, n, api, a);
    if (o) {
        if (ep == KV_EP_TOKENIZE) kv_ep_tokenize(g, o, a);
        else if (ep == KV_EP_DETOKENIZE) kv_ep_detokenize(g, o, a);
        else if (ep == KV_EP_SHOW) kv_ep_show(g, o, a);
        else kv_ans_err(a, api, 404, "no route %.200s", url);
        json_decref(o);
    }
    pthread_mutex_lock(&g->mu);
    g->parse_live -= g->o.parse_max;
    pthread_mutex_unlock(&g->mu);
}

char *kv_gw_ollama_load_json(const kv_gateway *g) {
    char ts[32];
    const time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%SZ", &tm);
    json_t *j = json_pack("{s:s,s:s,s:s,s:b,s:s}", "model", g->model, "created_at", ts, "response", "", "done", 1,
                          "done_reason", "load");
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}
