/* The gateway's HTTP side (server_internal.h): libmicrohttpd calls
 * kv_gw_handle on a connection thread for each request (one thread per
 * connection, bounded in number and per IP by http_guard, idle timeout).
 * Routing by method and path, the API key check, the body read (at most
 * body_max) and parsed within a memory budget, the prompt tokenized and
 * queued for the scheduler, then the tokens turned into text and answered
 * whole or as a stream in the API's shapes (its kv_gw_api_ops). */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <sodium.h>

#include "gateway/server_internal.h"
#include "kvasir/chat.h"

/* ---- connections ------------------------------------------------------ */

enum kv_route {
    KV_R_NONE = 0, KV_R_HEALTH, KV_R_METRICS, KV_R_MODELS, KV_R_SLOTS, KV_R_TAGS, KV_R_GEN, KV_R_NOTFOUND,
    KV_R_METHOD, KV_R_PRICES, KV_R_TEMPLATE, KV_R_ENDPOINT, KV_R_PREFLIGHT, KV_R_WEBUI
};

typedef struct kv_gw_conn {
    kv_gateway *g;
    int route;                  /* enum kv_route */
    int api;                    /* error shape (and the generation API for KV_R_GEN) */
    char *body;                 /* [n] received, at most body_max */
    size_t n, cap;
    bool too_big;
    bool answered;              /* refused before its body (the body is not read) */
    size_t parse_charge;        /* bytes of g->parse_live this request's parsed JSON holds */
    int fd;                     /* the client socket, to see it hang up */
    kv_gw_req *r;               /* our reference, or NULL */
    kv_gw_params *p;
    kv_gw_text text;
    kv_gw_buf out;              /* bytes waiting to be sent (stream) */
    size_t out_off;
    kv_gw_buf full;             /* whole text (non-stream) */
    kv_gw_result res;
    kv_gw_stream_state ss;      /* the adapter's, for a stream */
    char id[64];
    /* the chat APIs' output split into content, reasoning and tool calls
       (kvasir/chat.h) when the family writes any of them: NULL otherwise */
    kv_chat_parser *parser;
    bool special;               /* control tokens are text (the format's markers are such tokens) */
    bool think_open;            /* the rendered prompt ended inside <think> */
    kv_gw_buf reason;           /* reasoning (non-stream) */
    kv_gw_call *calls;          /* [n_calls] the calls given */
    uint32_t n_calls;
    uint32_t consumed;          /* tokens of r->toks turned into text */
    uint32_t lp_from;           /* stream: the first token whose log-probability no chunk carried yet */
    bool echo_lp;               /* echo with logprobs: the prompt goes out with its log-probabilities, once
                                   they are known (stream: before the first token's text) */
    kv_token_logprob *lp_all;   /* whole, echo_lp: the prompt's then the completion's (owned) */
    /* OpenAI's "n": every choice's request (reqs[0] == r for the first),
       queued together and read one after another; r is reqs[choice]. A
       whole answer keeps each finished choice's result and text in done[] */
    kv_gw_req *reqs[KV_GW_MAX_N];
    uint32_t n_choices, choice;
    uint32_t tokens_before;     /* completion tokens of the choices before this one */
    struct kv_gw_done_choice {
        kv_gw_result res;
        kv_gw_buf full, reason;
        kv_gw_call *calls;
        uint32_t n_calls;
    } done[KV_GW_MAX_N];
    bool finished;
    bool counted;               /* the request is in req_count */
    kv_gw_charge charge;        /* its payment while held (pay.h) */
    bool paid;                  /* settled: cost below */
    kv_settle_result paid_res;
    /* the request log line (endpoints.c) */
    const char *method;         /* a static string: "GET", "POST", ... or "other" */
    const char *route_name;     /* the route's path as routed (never the client's bytes), or "-" */
    unsigned status;            /* the status answered */
    double t0;                  /* kv_gw_mono() when it arrived */
} kv_gw_conn;

static void kv_count(kv_gw_conn *c, unsigned status) {
    if (c->counted) return;
    c->counted = true;
    c->status = status;
    pthread_mutex_lock(&c->g->mu);
    c->g->req_count[c->api][kv_gw_code_index(status)]++;
    pthread_mutex_unlock(&c->g->mu);
}

static enum MHD_Result kv_reply(kv_gw_conn *cn, struct MHD_Connection *c, unsigned status, const char *type,
                                char *body) {
    if (!body) return MHD_NO;
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type);
    MHD_add_response_header(r, "Cache-Control", "no-store");
    if (status == 503) MHD_add_response_header(r, "Retry-After", "1");
    if (cn->paid) {
        char v[32];
        snprintf(v, sizeof v, "%llu", (unsigned long long)cn->paid_res.cost);
        MHD_add_response_header(r, "X-KVR-Cost", v);
    }
    if (status == 401) MHD_add_response_header(r, "WWW-Authenticate", kv_gw_api(cn->api)->auth_challenge);
    kv_gw_cors_headers(cn->g, c, r);
    kv_count(cn, status);
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result kv_reply_err(kv_gw_conn *cn, struct MHD_Connection *c, unsigned status, const char *fmt,
                                    ...) __attribute__((format(printf, 4, 5)));
static enum MHD_Result kv_reply_err(kv_gw_conn *cn, struct MHD_Connection *c, unsigned status, const char *fmt,
                                    ...) {
    char msg[600], clean[1801];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    clean[kv_gw_utf8_clean(msg, strlen(msg), clean)] = 0;
    return kv_reply(cn, c, status, "application/json", kv_gw_api(cn->api)->error_body(status, clean));
}

static bool kv_hung_up(int fd) {
    if (fd < 0) return false;
    struct pollfd pf = {.fd = fd, .events = POLLRDHUP};
    return poll(&pf, 1, 0) > 0 && (pf.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
}

/* Waits until the scheduler is done with r (its work tally is then final). */
static void kv_wait_done(kv_gateway *g, kv_gw_req *r) {
    pthread_mutex_lock(&g->mu);
    while (r->state != KV_REQ_DONE) {
        pthread_cond_signal(&g->work_cv);
        struct timespec ts;
        kv_gw_deadline(&ts, 250);
        pthread_cond_timedwait(&g->out_cv, &g->mu, &ts);
    }
    pthread_mutex_unlock(&g->mu);
}

/* Settles c's payment for the tokens it was given, or releases it whole
 * (failed: nothing is charged for a completion that errs). */
static void kv_pay_end(kv_gw_conn *c, bool failed) {
    kv_gateway *g = c->g;
    if (!g->pay || !c->charge.held) return;
    kv_diag d = {0};
    int rc;
    if (failed || !c->r) {
        rc = kv_gw_pay_release(g->pay, &c->charge, &d);
    } else {
        kv_wait_done(g, c->r); /* its work record is final then, and the scheduler's no more */
        pthread_mutex_lock(&g->mu);
        const int err = c->r->err;
        pthread_mutex_unlock(&g->mu);
        if (err) { /* it failed (its client may have left too): nothing is charged */
            rc = kv_gw_pay_release(g->pay, &c->charge, &d);
        } else {
            const kv_gw_work w = {c->r->products, c->r->work, c->r->n_work};
            rc = kv_gw_pay_settle(g->pay, &c->charge, c->res.completion_tokens, &w, &c->paid_res, &d);
            if (rc == 0) c->paid = true;
        }
    }
    if (rc) fprintf(stderr, "gateway: payment of %s left held (released at the next start): %s\n", c->id, d.msg);
}

/* A stream's chunk carried the log-probabilities of res.lp: the next
 * chunk's start after them. */
static void kv_lp_sent(kv_gw_conn *c) {
    if (!c->res.n_lp) return;
    c->res.lp_text_off += kv_gw_lp_bytes(c->g->tok, c->res.lp, c->res.n_lp);
    c->lp_from += c->res.n_lp;
    c->res.lp = NULL;
    c->res.n_lp = 0;
}

/* The parser's events into the answer: streamed in the API's shapes, or
 * kept for the whole body. */
static int kv_on_event(void *ud, const kv_chat_ev *ev) {
    kv_gw_conn *c = ud;
    const kv_gw_api_ops *o = kv_gw_api(c->api);
    const bool stream = c->p->stream;
    if (ev->type == KV_CHAT_EV_CONTENT) {
        if (stream) o->stream_delta(&c->res, ev->text, ev->n, &c->out);
        else kv_gw_buf_add(&c->full, ev->text, ev->n);
        if (stream) kv_lp_sent(c);
        return 0;
    }
    if (ev->type == KV_CHAT_EV_REASONING) {
        if (stream) o->stream_reasoning(&c->res, ev->text, ev->n, &c->out);
        else kv_gw_buf_add(&c->reason, ev->text, ev->n);
        if (stream) kv_lp_sent(c);
        return 0;
    }
    const bool inc = stream && o->stream_call_begin; /* calls streamed as they come */
    if (ev->type == KV_CHAT_EV_CALL_BEGIN) {
        if (!inc) return 0;
        kv_gw_call k = {.name = (char *)ev->name};
        snprintf(k.id, sizeof k.id, "%s%s_%u", o->call_prefix, c->id + strlen(o->id_prefix), ev->index);
        o->stream_call_begin(&c->res, ev->index, &k, &c->out);
        return 0;
    }
    if (ev->type == KV_CHAT_EV_CALL_ARGS) {
        if (inc) o->stream_call_args(&c->res, ev->index, ev->text, ev->n, &c->out);
        return 0;
    }
    kv_gw_call *g = realloc(c->calls, (c->n_calls + 1) * sizeof *g); /* at most KV_CHAT_MAX_CALLS */
    if (!g) return KV_ENOMEM;
    c->calls = g;
    kv_gw_call *k = &c->calls[c->n_calls];
    memset(k, 0, sizeof *k);
    snprintf(k->id, sizeof k->id, "%s%s_%u", o->call_prefix, c->id + strlen(o->id_prefix), ev->index);
    k->name = strdup(ev->name);
    k->args = strdup(ev->args);
    k->args_len = ev->args_len;
    if (!k->name || !k->args) {
        free(k->name);
        free(k->args);
        return KV_ENOMEM;
    }
    c->n_calls++;
    if (inc && ev->streamed) o->stream_call_end(&c->res, ev->index, &c->out);
    else if (stream) o->stream_call(&c->res, ev->index, k, &c->out);
    return 0;
}

/* The output parser of a chat request, when its family writes reasoning or
 * the request has tools to call; none otherwise (the text as it comes). */
static int kv_parser_start(kv_gw_conn *c) {
    if (c->api == KV_GW_OPENAI_TEXT || kv_gw_params_raw(c->p)) return 0; /* a raw prompt: its text as it comes */
    const kv_gw_params *p = c->p;
    kv_chat_syntax s;
    if (c->g->tmpl) kv_gw_tmpl_syntax(c->g->tmpl, &s);
    else kv_chat_detect(NULL, 0, &s); /* ChatML: Hermes calls */
    s.tools = p->tools && p->tool_choice != KV_GW_TOOLS_NONE;
    s.tools_json = s.tools ? p->tools : NULL;
    s.think_open = c->think_open;
    s.max_calls = p->parallel_calls ? 0 : 1;
    s.stream_args = kv_gw_tool_call_forced(p); /* sampled under the calls' grammar: well-formed as they come */
    if (!s.tools && !s.think && s.format != KV_CHAT_FMT_HARMONY) return 0;
    c->special = s.format != KV_CHAT_FMT_HERMES;
    return kv_chat_parser_new(&c->parser, &s);
}

/* The current choice ended (OpenAI's "n"): its answer kept (whole) or its
 * last chunk sent (stream), and the next choice's read from its start.
 * Returns 0, or -1 on no memory. */
static int kv_next_choice(kv_gw_conn *c, bool stream) {
    const kv_gw_api_ops *o = kv_gw_api(c->api);
    if (stream) {
        o->stream_choice_end(&c->res, c->p->include_usage, &c->out);
    } else {
        struct kv_gw_done_choice *d = &c->done[c->choice];
        d->res = c->res;
        d->full = c->full;
        d->reason = c->reason;
        d->calls = c->calls;
        d->n_calls = c->n_calls;
        c->full = (kv_gw_buf){0};
        c->reason = (kv_gw_buf){0};
        c->calls = NULL;
        c->n_calls = 0;
    }
    c->tokens_before += c->res.completion_tokens;
    c->choice++;
    c->r = c->reqs[c->choice];
    c->consumed = c->lp_from = 0;
    c->finished = false;
    const kv_gw_result first = c->res;
    c->res = (kv_gw_result){.id = first.id, .index = c->choice, .model = first.model, .created = first.created,
                            .prompt_tokens = first.prompt_tokens, .ss = first.ss, .t_start = first.t_start,
                            .logprobs = first.logprobs, .top_logprobs = first.top_logprobs, .tok = first.tok};
    if (c->res.ss) *c->res.ss = (kv_gw_stream_state){0};
    kv_gw_text_free(&c->text);
    kv_gw_text_init(&c->text, c->p->stop, c->p->stop_len, c->p->n_stop);
    kv_chat_parser_free(c->parser);
    c->parser = NULL;
    if (kv_parser_start(c)) return -1;
    const kv_gw_params *p = c->p;
    if (stream) o->stream_begin(&c->res, &c->out);
    if (p->echo && p->prompt) {
        if (stream) o->stream_delta(&c->res, p->prompt, p->prompt_len, &c->out);
        else kv_gw_buf_add(&c->full, p->prompt, p->prompt_len);
    }
    return 0;
}

/* Choice i (> 0) of r's request: the same prompt and parameters, the seed
 * the next (seed + i), its own token arrays. NULL on no memory. */
static kv_gw_req *kv_req_choice(const kv_gw_req *r, uint32_t i, const kv_gw_params *p) {
    kv_gw_req *q = calloc(1, sizeof *q);
    if (!q) return NULL;
    q->g = r->g;
    q->api = r->api;
    q->client = r->client;
    q->so = r->so;
    q->so.sample.seed = p->has_seed ? p->sp.seed + i : r->so.sample.seed ^ ((uint64_t)(uintptr_t)q << 16);
    q->n_prompt = r->n_prompt;
    q->max_tokens = r->max_tokens;
    q->script = r->script;
    q->budget = r->budget;
    q->cap = r->cap;
    q->prompt = malloc((size_t)r->n_prompt * sizeof *q->prompt);
    q->toks = malloc((size_t)q->cap * sizeof *q->toks);
    if (r->lps) q->lps = malloc((size_t)q->cap * sizeof *q->lps);
    if (!q->prompt || !q->toks || (r->lps && !q->lps)) {
        free(q->prompt);
        free(q->toks);
        free(q->lps);
        free(q);
        return NULL;
    }
    memcpy(q->prompt, r->prompt, (size_t)r->n_prompt * sizeof *q->prompt);
    q->lead = (kv_gw_req *)r;
    q->refs = 2;
    return q;
}

/* Turns new tokens into text, waiting for some if none are new. Returns 0,
 * or -1 when the client went away (the request is cancelled then). */
static int kv_advance(kv_gw_conn *c, bool stream) {
    kv_gateway *g = c->g;
    kv_gw_req *r = c->r;
    pthread_mutex_lock(&g->mu);
    bool look = true; /* a hang-up is looked for once per call, and before every wait */
    while (look || (r->n_toks == c->consumed && r->state != KV_REQ_DONE)) {
        look = false;
        if (r->state != KV_REQ_DONE && kv_hung_up(c->fd)) {
            r->cancel = true;
            pthread_cond_signal(&g->work_cv);
            pthread_mutex_unlock(&g->mu);
            return -1;
        }
        if (r->n_toks != c->consumed || r->state == KV_REQ_DONE) break;
        struct timespec ts;
        kv_gw_deadline(&ts, 250);
        pthread_cond_timedwait(&g->out_cv, &g->mu, &ts);
    }
    const uint32_t n = r->n_toks;
    const bool done = r->state == KV_REQ_DONE;
    const enum kv_stop stop = r->stop;
    const int err = r->err;
    c->res.cached_tokens = r->n_cached < c->res.prompt_tokens ? r->n_cached : c->res.prompt_tokens;
    char errmsg[256];
    memcpy(errmsg, r->errmsg, sizeof errmsg);
    const uint32_t from = c->consumed;
    pthread_mutex_unlock(&g->mu);

    if (n > from && c->res.t_first == 0) c->res.t_first = kv_gw_mono();
    bool stopped = false;
    char pb[KV_TOK_MAX_TOKEN_BYTES];
    while (c->consumed < n && !stopped) {
        const uint32_t i = c->consumed++;
        const int32_t t = r->toks[i];
        c->res.completion_tokens++;
        if (kv_tok_is_eog(g->tok, t)) continue;
        int pn = kv_tok_piece(g->tok, t, c->special, pb, sizeof pb);
        if (pn > (int)sizeof pb) pn = (int)sizeof pb;
        if (pn > 0 && kv_gw_text_push(&c->text, pb, (size_t)pn)) return -1;
        stopped = c->text.stopped;
    }
    if (stopped) {
        c->res.finish = KV_GW_FINISH_STOP;
        c->res.stop_seq = c->text.stop[c->text.stop_index];
        pthread_mutex_lock(&g->mu);
        r->cancel = r->state != KV_REQ_DONE; /* the scheduler frees the session before the next step */
        pthread_cond_signal(&g->work_cv);
        pthread_mutex_unlock(&g->mu);
    } else if (done && c->consumed == n) {
        c->res.finish = stop == KV_STOP_MAX_TOKENS || stop == KV_STOP_CTX_FULL || stop == KV_STOP_NONE
                            ? KV_GW_FINISH_LENGTH : KV_GW_FINISH_STOP;
    }
    const bool final = stopped || (done && c->consumed == n);
    char *chunk = NULL;
    size_t cn = 0;
    if (kv_gw_text_take(&c->text, final, &chunk, &cn)) return -1;
    if (final && !stopped && c->text.stopped) { /* a stop string that ends in the last, incomplete character */
        c->res.finish = KV_GW_FINISH_STOP;
        c->res.stop_seq = c->text.stop[c->text.stop_index];
    }
    if (stream && c->echo_lp && (n > 0 || done)) { /* the prompt evaluated: it goes out first, with its own */
        c->echo_lp = false;
        pthread_mutex_lock(&g->mu);
        const uint32_t skip = r->plp_skip < r->n_plps ? r->plp_skip : r->n_plps;
        kv_gw_result e = c->res;
        e.lp = r->plps + skip;
        e.n_lp = r->n_plps - skip;
        e.lp_text_off = 0;
        pthread_mutex_unlock(&g->mu);
        kv_gw_api(c->api)->stream_delta(&e, c->p->prompt, c->p->prompt_len, &c->out);
    }
    if (stream && c->res.logprobs && r->lps) { /* the next chunk carries the tokens not reported yet */
        c->res.lp = r->lps + c->lp_from;
        c->res.n_lp = c->consumed - c->lp_from;
    }
    if (c->parser) {
        const int prc =
            chunk || final ? kv_chat_parser_push(c->parser, chunk ? chunk : "", cn, final, kv_on_event, c) : 0;
        free(chunk);
        if (prc) return -1;
        if (final && c->n_calls && c->res.finish == KV_GW_FINISH_STOP && !c->res.stop_seq)
            c->res.finish = KV_GW_FINISH_TOOLS;
    } else if (chunk) {
        if (stream) kv_gw_api(c->api)->stream_delta(&c->res, chunk, cn, &c->out);
        else kv_gw_buf_add(&c->full, chunk, cn);
        free(chunk);
        if (stream) kv_lp_sent(c);
    }
    bool lp_left = false; /* tokens whose text never went out (held back): an empty chunk carries them */
    for (uint32_t i = 0; stream && final && i < c->res.n_lp; i++)
        lp_left |= c->res.lp[i].token < 0 || !kv_tok_is_eog(g->tok, c->res.lp[i].token);
    if (lp_left && !(err && !stopped)) kv_gw_api(c->api)->stream_delta(&c->res, "", 0, &c->out);
    if (stream && final) kv_lp_sent(c);
    if (final) {
        c->finished = true;
        pthread_mutex_lock(&g->mu);
        g->tokens_completion += c->res.completion_tokens;
        pthread_mutex_unlock(&g->mu);
        if (err && !stopped) {
            kv_pay_end(c, true);
            if (stream) kv_gw_api(c->api)->stream_error(errmsg[0] ? errmsg : kv_err_str(err), &c->out);
            return 1;
        }
        if (c->choice + 1 < c->n_choices) return kv_next_choice(c, stream);
        kv_pay_end(c, false); /* before the last bytes go out: a client that saw the end sees it settled */
        if (stream && c->n_choices > 1) { /* usage: every choice's tokens */
            kv_gw_result u = c->res;
            u.completion_tokens += c->tokens_before;
            kv_gw_api(c->api)->stream_end(&u, c->p->include_usage, &c->out);
        } else if (stream) {
            kv_gw_api(c->api)->stream_end(&c->res, c->p->include_usage, &c->out);
        }
    }
    return 0;
}

static ssize_t kv_stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    kv_gw_conn *c = cls;
    for (;;) {
        if (c->out.oom) return MHD_CONTENT_READER_END_WITH_ERROR;
        if (c->out_off < c->out.n) {
            size_t k = c->out.n - c->out_off;
            if (k > max) k = max;
            memcpy(buf, c->out.p + c->out_off, k);
            c->out_off += k;
            return (ssize_t)k;
        }
        if (c->finished) return MHD_CONTENT_READER_END_OF_STREAM;
        c->out.n = c->out_off = 0;
        if (kv_advance(c, true) < 0) return MHD_CONTENT_READER_END_WITH_ERROR;
    }
}

/* Key check: constant time in the key's bytes. */
static bool kv_key_ok(kv_gateway *g, struct MHD_Connection *c) {
    if (!g->n_keys) return true;
    const char *k = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "x-api-key");
    const char *a = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (a && !strncasecmp(a, "Bearer ", 7)) k = a + 7;
    if (!k) return false;
    const size_t kl = strlen(k);
    bool ok = false;
    for (uint32_t i = 0; i < g->n_keys; i++) {
        const size_t l = strlen(g->keys[i]);
        unsigned diff = (unsigned)(l ^ kl);
        for (size_t j = 0; j < l; j++) diff |= (unsigned char)g->keys[i][j] ^ (unsigned char)(j < kl ? k[j] : 0);
        ok |= diff == 0;
    }
    return ok;
}

/* Who asks: the API key presented (keys are configured and it passed
 * kv_key_ok), or else the client's address (IPv6: its /64), as a keyed hash. */
static uint64_t kv_client_of(kv_gateway *g, struct MHD_Connection *c) {
    uint8_t id[KV_GATEWAY_MAX_KEY_LEN + 2] = {0};
    size_t n = 0;
    if (g->n_keys) {
        const char *k = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "x-api-key");
        const char *a = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
        if (a && !strncasecmp(a, "Bearer ", 7)) k = a + 7;
        if (k) {
            id[0] = 'k';
            n = strlen(k) < sizeof id - 1 ? strlen(k) : sizeof id - 1; /* keys are at most KV_GATEWAY_MAX_KEY_LEN */
            memcpy(id + 1, k, n);
            n++;
        }
    }
    const union MHD_ConnectionInfo *ci = n ? NULL : MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (ci && ci->client_addr && ci->client_addr->sa_family == AF_INET) {
        id[0] = '4';
        memcpy(id + 1, &((const struct sockaddr_in *)ci->client_addr)->sin_addr, 4);
        n = 5;
    } else if (ci && ci->client_addr && ci->client_addr->sa_family == AF_INET6) {
        id[0] = '6';
        memcpy(id + 1, ((const struct sockaddr_in6 *)ci->client_addr)->sin6_addr.s6_addr, 8);
        n = 9;
    }
    uint8_t h[crypto_shorthash_BYTES];
    crypto_shorthash(h, id, n, g->client_salt);
    uint64_t v = 0;
    memcpy(&v, h, sizeof v);
    return v;
}

/* The HTTP status of a chat template's failure to render: the request's
 * fault (raise_exception, a limit, a value the template cannot take) 400,
 * no memory 500. */
static unsigned kv_template_status(int rc) { return rc == KV_ENOMEM ? 500 : 400; }

/* Without a chat template (ChatML) a role:"tool" message is refused as it
 * always was; true with d set then. */
static bool kv_tool_role_refused(const kv_gw_params *p, kv_diag *d) {
    if (!p->has_tool_role) return false;
    for (size_t i = 0; i < p->n_msgs; i++)
        if (!strcmp(p->msgs[i].role, "tool")) {
            kv_fail(d, KV_EINVAL, "message %zu has role 'tool'; expected system, user or assistant", i);
            return true;
        }
    return false;
}

/* A prompt given as token ids: copied into ids (room for them), each
 * checked against the vocabulary. */
static int kv_gw_ids_take(const kv_tok *tok, const kv_gw_params *p, int32_t *ids, size_t *n, kv_diag *d) {
    const int32_t n_vocab = kv_tok_n_vocab(tok);
    for (size_t i = 0; i < p->n_prompt_ids; i++)
        if (p->prompt_ids[i] >= n_vocab)
            return kv_fail(d, KV_EINVAL, "'prompt' token %zu is %d, outside the vocabulary [0, %d)", i, p->prompt_ids[i],
                           n_vocab);
    memcpy(ids, p->prompt_ids, p->n_prompt_ids * sizeof *ids);
    *n = p->n_prompt_ids;
    return 0;
}

/* A local request: the prompt tokenized here (the chat template for the
 * chat APIs), paid for when the gateway charges. NULL with *status and d
 * on refusal. */
static kv_gw_req *kv_local_req_new(kv_gw_conn *cn, struct MHD_Connection *c, const kv_gw_params *p, size_t *n_out,
                                   unsigned *status, kv_diag *d) {
    kv_gateway *g = cn->g;
    const bool chat = !kv_gw_params_raw(p);
    char *text = NULL; /* the chat template's rendering */
    size_t text_len = 0;
    *status = 400;
    if (chat && g->tmpl) {
        const int rrc = kv_gw_tmpl_render(g->tmpl, p, &text, &text_len, d);
        if (rrc) {
            *status = kv_template_status(rrc);
            return NULL;
        }
        cn->think_open = kv_chat_prompt_thinks(text, text_len);
    } else if (chat && kv_tool_role_refused(p, d)) {
        return NULL;
    }
    size_t bytes = text ? text_len + 16 : p->prompt_ids ? p->n_prompt_ids + 16 : p->prompt_len + 16;
    for (size_t i = 0; !text && i < p->n_msgs; i++) bytes += p->msgs[i].len + 16;
    const size_t cap = text ? bytes : 3 * bytes + 8; /* a byte-level token holds at least one byte */
    int32_t *ids = malloc(cap * sizeof *ids);
    *status = 500;
    if (!ids) {
        free(text);
        return kv_fail(d, KV_ENOMEM, "out of memory"), NULL;
    }
    size_t off = 0, n = 0;
    /* token ids are the prompt as given (no BOS added: llama-server's rule) */
    if (!p->prompt_ids && kv_tok_add_bos(g->tok) && kv_tok_bos(g->tok) >= 0) ids[off++] = kv_tok_bos(g->tok);
    int rc = kv_gw_bias_check(p, kv_tok_n_vocab(g->tok), d);
    if (!rc && p->suffix_len) /* fill-in-the-middle needs the model's own markers */
        rc = kv_fail(d, KV_EUNSUPPORTED, "'suffix' is not supported by this model (its vocabulary has no "
                     "fill-in-the-middle tokens)%s", kv_tok_find(g->tok, "<|fim_prefix|>") >= 0 ? " (FIM prompts "
                     "are not served yet)" : "");
    if (rc) {
        free(text);
        free(ids);
        *status = 400;
        return NULL;
    }
    rc = p->prompt_ids ? kv_gw_ids_take(g->tok, p, ids, &n, d)
           : !chat ? kv_tok_encode(g->tok, p->prompt, p->prompt_len, true, ids + off, cap - off, &n, d)
           : text  ? kv_gw_tmpl_encode(g->tok, p, text, text_len, ids + off, cap - off, &n, d)
                   : kv_tok_encode_chatml(g->tok, p->msgs, p->n_msgs, p->add_generation_prompt, ids + off, cap - off,
                                          &n, d);
    free(text);
    if (!rc && text && off && n && ids[off] == ids[0]) { /* the template wrote BOS itself: once is enough */
        memmove(ids, ids + 1, n * sizeof *ids);
        off = 0;
    }
    n += off;
    *status = rc == KV_ENOMEM ? 500 : 400;
    if (!rc && n == 0) rc = kv_fail(d, KV_EINVAL, "the prompt is empty");
    if (!rc && n >= g->n_ctx)
        rc = kv_fail(d, KV_ECTXFULL, "the prompt has %zu tokens, more than the context of %u tokens leaves room for "
                     "(at least one must be generated)", n, g->n_ctx);
    if (rc) {
        free(ids);
        return NULL;
    }
    uint32_t max_tokens = p->has_max_tokens ? p->max_tokens : g->o.max_tokens_default;
    if (g->pay) {
        /* paid before any compute: the hold covers the prompt and at least
           one token, and the completion stops at what the max pays for */
        *status = 402;
        const char *hdr = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-KVR-Payment");
        if (kv_gw_pay_hold(g->pay, hdr, n, &max_tokens, &cn->charge, status, d)) {
            free(ids);
            return NULL;
        }
    }
    kv_gw_req *r = calloc(1, sizeof *r);
    const uint32_t room = g->n_ctx - (uint32_t)n;
    if (r) {
        r->cap = (max_tokens < room ? max_tokens : room) + 1;
        r->toks = malloc((size_t)r->cap * sizeof *r->toks);
        if (p->logprobs && !(r->lps = malloc((size_t)r->cap * sizeof *r->lps))) {
            free(r->toks);
            r->toks = NULL;
        }
        r->paid = g->pay != NULL;
        memcpy(r->pay_consumer, cn->charge.a.consumer, 32);
        memcpy(r->pay_nonce, cn->charge.a.nonce, 16);
    }
    if (!r || !r->toks) {
        free(ids);
        if (r) free(r->toks);
        if (r) free(r->lps);
        free(r);
        kv_pay_end(cn, true);
        *status = 500;
        return kv_fail(d, KV_ENOMEM, "out of memory"), NULL;
    }
    r->g = g;
    r->api = cn->api;
    r->prompt = ids;
    r->n_prompt = (uint32_t)n;
    r->max_tokens = max_tokens;
    r->so.sample = p->sp;
    if (!p->has_seed) r->so.sample.seed = (uint64_t)time(NULL) ^ ((uint64_t)(uintptr_t)r << 16);
    r->so.max_tokens = max_tokens;
    r->so.ignore_eog = p->ignore_eos;
    r->so.logprobs = p->logprobs;
    r->so.top_logprobs = p->top_logprobs;
    if (p->echo && p->logprobs && p->prompt) { /* the prompt's log-probabilities come back with it */
        r->so.prompt_logprobs = true;
        r->prompt0 = ids[0];
        r->plp_skip = off; /* a BOS the gateway put first is not the text's */
        if (!(r->plps = malloc(n * sizeof *r->plps))) {
            *status = 500;
            pthread_mutex_lock(&g->mu);
            r->refs = 1;
            kv_gw_req_unref_locked(r);
            pthread_mutex_unlock(&g->mu);
            kv_pay_end(cn, true);
            return kv_fail(d, KV_ENOMEM, "out of memory"), NULL;
        }
    }
    if (r->so.sample.repeat_last_n > (int32_t)g->n_ctx) /* no session holds more: the same window, less memory */
        r->so.sample.repeat_last_n = (int32_t)g->n_ctx;
    if (g->n_script) { /* TEST ONLY (script.c) */
        pthread_mutex_lock(&g->mu);
        r->script = &g->script[g->script_next++ % g->n_script];
        pthread_mutex_unlock(&g->mu);
        r->so.ignore_eog = true; /* the script ends it, not a sampled end-of-generation token */
    }
    *n_out = n;
    return r;
}


/* Reads cn's body as a request of cn->api into cn->p, within the parse
 * memory budget. Returns 0, or the HTTP status of the refusal (413, 503,
 * 400, 500) with d saying why. */
static unsigned kv_parse_body(kv_gw_conn *cn, kv_diag *d) {
    kv_gateway *g = cn->g;
    cn->p = calloc(1, sizeof *cn->p);
    if (!cn->p) return kv_fail(d, KV_ENOMEM, "out of memory"), 500;
    /* the parse's memory: reserved whole from the gateway's total first, the
       unused part given back after; what the parsed body holds stays charged
       until the request ends (kv_gw_done) */
    pthread_mutex_lock(&g->mu);
    const bool room = g->parse_live + g->o.parse_max <= g->o.parse_total;
    if (room) g->parse_live += g->o.parse_max;
    else g->parse_refused++;
    pthread_mutex_unlock(&g->mu);
    if (!room)
        return kv_fail(d, KV_EIO, "the gateway is parsing as many request bodies as its memory allows (%zu bytes); "
                       "retry later", g->o.parse_total), 503;
    bool over = false;
    size_t held = 0;
    const int prc = kv_gw_parse_budget(cn->p, cn->api, cn->body ? cn->body : "", cn->n, g->o.parse_max, &held, &over, d);
    pthread_mutex_lock(&g->mu);
    g->parse_live -= g->o.parse_max - held;
    cn->parse_charge = held;
    if (over) g->parse_refused++;
    pthread_mutex_unlock(&g->mu);
    if (over) return 413;
    if (prc) return 400;
    return 0;
}

/* POST /apply-template (llama-server's): a chat completions body, answered
 * {"prompt": TEXT}, the text the chat template renders for it (the prompt
 * a completion with that body is given, before tokens). */
static enum MHD_Result kv_apply_template(kv_gw_conn *cn, struct MHD_Connection *c) {
    kv_gateway *g = cn->g;
    kv_diag d = {0};
    const unsigned st = kv_parse_body(cn, &d);
    if (st) return kv_reply_err(cn, c, st, "%s", d.msg);
    const kv_gw_params *p = cn->p;
    char *text = NULL;
    size_t n = 0;
    if (g->tmpl) {
        const int rc = kv_gw_tmpl_render(g->tmpl, p, &text, &n, &d);
        if (rc) return kv_reply_err(cn, c, kv_template_status(rc), "%s", d.msg);
    } else { /* ChatML, as the prompt is then built (here, or by a ring's home) */
        if (kv_tool_role_refused(p, &d)) return kv_reply_err(cn, c, 400, "%s", d.msg);
        if (!(text = kv_tok_chatml_msgs(p->msgs, p->n_msgs, p->add_generation_prompt)))
            return kv_reply_err(cn, c, 500, "out of memory");
        n = strlen(text);
    }
    json_t *j = json_pack("{s:s%}", "prompt", text, n);
    free(text);
    char *body = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!body) return kv_reply_err(cn, c, 500, "the rendered prompt is not valid UTF-8, or out of memory");
    return kv_reply(cn, c, 200, "application/json", body);
}

static enum MHD_Result kv_generate(kv_gw_conn *cn, struct MHD_Connection *c) {
    kv_gateway *g = cn->g;
    kv_diag d = {0};
    const unsigned st = kv_parse_body(cn, &d);
    if (st) return kv_reply_err(cn, c, st, "%s", d.msg);
    kv_gw_params *p = cn->p;
    if (p->model && strcmp(p->model, g->model))
        return kv_reply_err(cn, c, 404, "model '%.256s' is not served here (this gateway serves '%s')", p->model,
                            g->model);
    if (cn->api == KV_GW_OLLAMA_GEN && !kv_gw_params_raw(p) && !p->n_msgs) /* Ollama's "load the model" */
        return kv_reply(cn, c, 200, "application/json", kv_gw_ollama_load_json(g));
    const bool forced = kv_gw_tool_call_forced(p); /* a compulsory call: sampled under its grammar (below) */
    if (forced && p->grammar)
        return kv_reply_err(cn, c, 400, "'tool_choice' and '%s' both constrain the output; give one", p->grammar_field);
    char why[320];
    if (kv_gw_unavailable(g, why, sizeof why)) return kv_reply_err(cn, c, 503, "%s", why);
    kv_gw_req *r = NULL;
    size_t n = 0;
    const char *budget_field = cn->api == KV_GW_ANTHROPIC ? "thinking.budget_tokens" : "thinking_budget_tokens";
    const char *no_ring = p->has_think_budget ? budget_field /* the ring's last node samples: nothing to force */
                        : p->echo && p->logprobs ? "echo' with 'logprobs" /* the ring computes no prompt rows */
                        : NULL;
    if (g->n_ring && no_ring)
        return kv_reply_err(cn, c, 400, "'%s' is not supported over ring entry nodes yet", no_ring);
    if (p->n_choices > 1 && g->pay)
        return kv_reply_err(cn, c, 400, "'n' above 1 is not served by a paying gateway yet (one payment per choice)");
    const uint32_t n_choices = p->n_choices > 1 ? p->n_choices : 1;
    if (n_choices > g->o.queue_max) /* never room for all of them: not a retry-later */
        return kv_reply_err(cn, c, 400, "'n' is %u, more than this gateway queues at once (%u requests)", n_choices,
                            g->o.queue_max);
    {
        /* the prompt is rendered and tokenized here, over a ring too (its
           nodes take token ids: the same tokens as a local engine's) */
        unsigned status = 0;
        if (!(r = kv_local_req_new(cn, c, p, &n, &status, &d)))
            return kv_reply_err(cn, c, status, "%s", d.msg);
        int grc = 0;
        kv_chat_syntax syn = {0};
        if (forced) { /* the template is rendered now: its family, and whether it opened <think> */
            if (g->tmpl) kv_gw_tmpl_syntax(g->tmpl, &syn);
            else kv_chat_detect(NULL, 0, &syn);
            grc = kv_gw_tool_choice_grammar(&r->grammar, p, g->tmpl ? kv_gw_tmpl_calls(g->tmpl) : syn.format,
                                            cn->think_open, &d);
        } else {
            r->grammar = p->grammar; /* the request's now: its session may outlive the connection */
            p->grammar = NULL;
        }
        /* a reasoning budget: its end forced when spent (a forced call's
           grammar closes any reasoning at once, so it never binds there) */
        if (!grc && p->has_think_budget && !forced && !r->script) {
            kv_chat_syntax bs;
            if (g->tmpl) kv_gw_tmpl_syntax(g->tmpl, &bs);
            else kv_chat_detect(NULL, 0, &bs);
            if (r->grammar)
                grc = kv_fail(&d, KV_EUNSUPPORTED, "'%s' with '%s' is not supported: the grammar leaves no place to "
                              "force the end of reasoning", budget_field, p->grammar_field);
            else if ((grc = kv_gw_budget_init(&r->budget, g->tok, bs.format, bs.think, cn->think_open,
                                              p->think_budget, &d)))
                kv_diag_prefix(&d, grc, "'%s'", budget_field);
        }
        if (!grc && g->n_ring)
            grc = kv_gw_ring_req_attach(r, p, forced, g->tmpl ? kv_gw_tmpl_calls(g->tmpl) : syn.format, cn->think_open,
                                        &d);
        if (grc) {
            pthread_mutex_lock(&g->mu);
            r->refs = 1;
            kv_gw_req_unref_locked(r);
            pthread_mutex_unlock(&g->mu);
            kv_pay_end(cn, true);
            return kv_reply_err(cn, c, grc == KV_ENOMEM ? 500 : 400, "%s", d.msg);
        }
    }
    r->refs = 2;
    r->client = kv_client_of(g, c);
    cn->reqs[0] = r;
    for (uint32_t i = 1; i < n_choices; i++) /* the other choices (local requests only) */
        if (!(cn->reqs[i] = kv_req_choice(r, i, p))) {
            pthread_mutex_lock(&g->mu);
            for (uint32_t k = 0; k < i; k++) {
                cn->reqs[k]->refs = 1;
                kv_gw_req_unref_locked(cn->reqs[k]);
                cn->reqs[k] = NULL;
            }
            pthread_mutex_unlock(&g->mu);
            return kv_reply_err(cn, c, 500, "out of memory");
        }
    pthread_mutex_lock(&g->mu);
    /* n choices are n requests against the queue's bound */
    if (g->quit || (n_choices > 1 && g->n_queued + n_choices > g->o.queue_max) ||
        (g->n_queued >= g->o.queue_max && !kv_gw_queue_displace_locked(g, r))) {
        g->rejected_full++;
        for (uint32_t k = 0; k < n_choices; k++) {
            cn->reqs[k]->refs = 1;
            kv_gw_req_unref_locked(cn->reqs[k]);
            cn->reqs[k] = NULL;
        }
        pthread_mutex_unlock(&g->mu);
        kv_pay_end(cn, true);
        return kv_reply_err(cn, c, 503, "the queue is full (%u requests waiting); retry later", g->o.queue_max);
    }
    for (uint32_t k = 0; k < n_choices; k++) {
        kv_gw_req *q = cn->reqs[k];
        q->id = ++g->next_id;
        q->state = KV_REQ_QUEUED;
        if (g->queue_tail) g->queue_tail->next = q;
        else g->queue = q;
        g->queue_tail = q;
        g->n_queued++;
        g->tokens_prompt += n;
    }
    cn->n_choices = n_choices;
    pthread_cond_signal(&g->work_cv);
    pthread_mutex_unlock(&g->mu);
    if (g->n_ring) { /* the ring tokenizes: wait for its ACCEPT (or its refusal) before the status line */
        pthread_mutex_lock(&g->mu);
        while (!r->accepted && r->state != KV_REQ_DONE) {
            if (kv_hung_up(cn->fd)) {
                r->cancel = true;
                pthread_cond_signal(&g->work_cv);
                pthread_mutex_unlock(&g->mu);
                cn->r = r; /* kv_gw_done drops the reference */
                return MHD_NO;
            }
            struct timespec ts;
            kv_gw_deadline(&ts, 250);
            pthread_cond_timedwait(&g->out_cv, &g->mu, &ts);
        }
        const bool ok = r->accepted;
        const int err = r->err;
        char msg[256];
        memcpy(msg, r->errmsg, sizeof msg);
        n = r->n_prompt;
        pthread_mutex_unlock(&g->mu);
        cn->r = r;
        if (!ok)
            return kv_reply_err(cn, c, kv_gw_ring_http_status(err), "%s", msg[0] ? msg : kv_err_str(err ? err : KV_EIO));
    }
    cn->r = r;

    snprintf(cn->id, sizeof cn->id, "%skv%llx%llu", kv_gw_api(cn->api)->id_prefix, (unsigned long long)g->started,
             (unsigned long long)r->id);
    cn->res = (kv_gw_result){.id = cn->id, .model = g->model, .created = (long long)time(NULL),
                             .prompt_tokens = (uint32_t)n, .ss = &cn->ss, .t_start = cn->t0,
                             .logprobs = p->logprobs, .top_logprobs = p->top_logprobs, .tok = g->tok};
    kv_gw_text_init(&cn->text, p->stop, p->stop_len, p->n_stop);
    if (kv_parser_start(cn)) return kv_reply_err(cn, c, 500, "out of memory");

    cn->echo_lp = p->echo && p->prompt && p->logprobs;
    if (cn->echo_lp) cn->res.lp_text_off = p->prompt_len; /* the completion's text offsets come after it */
    if (p->echo && p->prompt && !p->stream) kv_gw_buf_add(&cn->full, p->prompt, p->prompt_len); /* the prompt first */
    if (p->stream) {
        kv_gw_api(cn->api)->stream_begin(&cn->res, &cn->out);
        if (p->echo && p->prompt && !cn->echo_lp)
            kv_gw_api(cn->api)->stream_delta(&cn->res, p->prompt, p->prompt_len, &cn->out);
        struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, kv_stream_read, cn, NULL);
        if (!resp) return MHD_NO;
        MHD_add_response_header(resp, "Content-Type", kv_gw_api(cn->api)->stream_type);
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
        kv_gw_cors_headers(g, c, resp);
        kv_count(cn, 200);
        enum MHD_Result ret = MHD_queue_response(c, 200, resp);
        MHD_destroy_response(resp);
        return ret;
    }
    int a;
    while (!cn->finished)
        if ((a = kv_advance(cn, false)) < 0) return MHD_NO;
        else if (a > 0) {
            r = cn->r; /* the choice that failed */
            pthread_mutex_lock(&g->mu);
            char msg[256];
            memcpy(msg, r->errmsg, sizeof msg);
            const int err = r->err;
            const bool displaced = r->displaced;
            pthread_mutex_unlock(&g->mu);
            if (displaced) return kv_reply_err(cn, c, 503, "%s", msg);
            /* the swarm lost what it needs while this waited (the retries ran out): 503, retry later */
            if (!g->n_ring && kv_gw_unavailable(g, why, sizeof why))
                return kv_reply_err(cn, c, 503, "generation failed: %s; %s", msg, why);
            /* a ring that broke or went out of reach is a 503 (retry later), not a fault here */
            return kv_reply_err(cn, c, g->n_ring ? kv_gw_ring_http_status(err) == 400 ? 500 : kv_gw_ring_http_status(err) : 500,
                                "generation failed: %s", msg);
        }
    if (cn->full.oom || cn->reason.oom) return kv_reply_err(cn, c, 500, "out of memory"); /* settled: it was computed */
    if (p->logprobs) { /* every token's */
        cn->res.lp = cn->r->lps;
        cn->res.n_lp = cn->consumed;
    }
    if (cn->echo_lp) { /* the prompt's first (the text echoed), offsets from 0 */
        const uint32_t skip = cn->r->plp_skip < cn->r->n_plps ? cn->r->plp_skip : cn->r->n_plps;
        const uint32_t np = cn->r->n_plps - skip;
        if (!(cn->lp_all = malloc(((size_t)np + cn->consumed + 1) * sizeof *cn->lp_all)))
            return kv_reply_err(cn, c, 500, "out of memory");
        memcpy(cn->lp_all, cn->r->plps + skip, (size_t)np * sizeof *cn->lp_all);
        memcpy(cn->lp_all + np, cn->r->lps, (size_t)cn->consumed * sizeof *cn->lp_all);
        cn->res.lp = cn->lp_all;
        cn->res.n_lp = np + cn->consumed;
        cn->res.lp_text_off = 0;
    }
    if (cn->n_choices > 1) {
        kv_gw_result rs[KV_GW_MAX_N];
        kv_gw_answer as[KV_GW_MAX_N];
        for (uint32_t i = 0; i < cn->n_choices; i++) {
            const struct kv_gw_done_choice *dc = &cn->done[i];
            const bool last = i == cn->choice;
            const kv_gw_buf *f = last ? &cn->full : &dc->full, *rb = last ? &cn->reason : &dc->reason;
            if (f->oom || rb->oom) return kv_reply_err(cn, c, 500, "out of memory");
            rs[i] = last ? cn->res : dc->res;
            if (p->logprobs) {
                rs[i].lp = cn->reqs[i]->lps;
                rs[i].n_lp = last ? cn->consumed : dc->res.completion_tokens;
            }
            as[i] = (kv_gw_answer){.text = f->p ? f->p : "", .n = f->n, .reasoning = rb->p, .rn = rb->n,
                                   .calls = last ? cn->calls : dc->calls, .n_calls = last ? cn->n_calls : dc->n_calls};
        }
        return kv_reply(cn, c, 200, "application/json", kv_gw_api(cn->api)->full_body_n(rs, as, cn->n_choices));
    }
    const kv_gw_answer ans = {.text = cn->full.p ? cn->full.p : "", .n = cn->full.n, .reasoning = cn->reason.p,
                            .rn = cn->reason.n, .calls = cn->calls, .n_calls = cn->n_calls};
    return kv_reply(cn, c, 200, "application/json", kv_gw_api(cn->api)->full_body(&cn->res, &ans));
}

static void kv_route_of(kv_gw_conn *cn, const char *method, const char *url) {
    static const struct { const char *m, *u; int route, api; } t[] = {
        {"GET", "/health", KV_R_HEALTH, KV_GW_API_COUNT},
        {"GET", "/metrics", KV_R_METRICS, KV_GW_API_COUNT},
        {"GET", "/v1/models", KV_R_MODELS, KV_GW_OPENAI_CHAT},
        {"GET", "/v1/slots", KV_R_SLOTS, KV_GW_API_COUNT},
        {"GET", "/api/tags", KV_R_TAGS, KV_GW_OLLAMA},
        {"GET", "/v1/prices", KV_R_PRICES, KV_GW_OPENAI_CHAT},
        {"POST", "/v1/chat/completions", KV_R_GEN, KV_GW_OPENAI_CHAT},
        {"POST", "/v1/completions", KV_R_GEN, KV_GW_OPENAI_TEXT},
        {"POST", "/v1/messages", KV_R_GEN, KV_GW_ANTHROPIC},
        {"POST", "/api/chat", KV_R_GEN, KV_GW_OLLAMA},
        {"POST", "/apply-template", KV_R_TEMPLATE, KV_GW_OPENAI_CHAT},
        {"POST", "/completion", KV_R_GEN, KV_GW_LLAMA},
        {"POST", "/api/generate", KV_R_GEN, KV_GW_OLLAMA_GEN},
        {"GET", "/", KV_R_WEBUI, KV_GW_API_COUNT}, {"GET", "/index.html", KV_R_WEBUI, KV_GW_API_COUNT},
    };
    static const char *const methods[] = {"GET", "POST", "OPTIONS", "HEAD", "PUT", "DELETE", "PATCH"};
    cn->method = "other";
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++)
        if (!strcmp(method, methods[i])) cn->method = methods[i];
    cn->route = KV_R_NOTFOUND;
    cn->t0 = kv_gw_mono();
    cn->api = !strncmp(url, "/api/", 5) ? KV_GW_OLLAMA : !strcmp(url, "/v1/messages") ? KV_GW_ANTHROPIC
                                                                                       : KV_GW_API_COUNT;
    cn->route_name = "-";
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (!strcmp(url, t[i].u)) {
            cn->api = t[i].api;
            cn->route = strcmp(method, t[i].m) ? KV_R_METHOD : t[i].route;
            cn->route_name = t[i].u;
            break;
        }
    bool method_ok = false;
    int api = 0;
    if (cn->route == KV_R_NOTFOUND && kv_gw_endpoint_of(method, url, &method_ok, &api, &cn->route_name)) {
        cn->api = api;
        cn->route = method_ok ? KV_R_ENDPOINT : KV_R_METHOD;
    }
    /* a CORS preflight (with --cors) of a path served here: before the key check */
    if (cn->route == KV_R_METHOD && !strcmp(method, "OPTIONS") && cn->g->n_cors) cn->route = KV_R_PREFLIGHT;
}

enum MHD_Result kv_gw_handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                 const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    kv_gateway *g = cls;
    kv_gw_conn *cn = *con_cls;
    if (!cn) {
        if (!(cn = calloc(1, sizeof *cn))) return MHD_NO;
        cn->g = g;
        cn->fd = -1;
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        if (ci) cn->fd = ci->connect_fd;
        kv_route_of(cn, method, url);
        *con_cls = cn;
        char why[96];
        if (!kv_http_lengths_ok(c, why, sizeof why)) { /* answered now: the body is not read */
            cn->answered = true;
            return kv_reply_err(cn, c, 400, "the request has %s", why);
        }
        return MHD_YES;
    }
    if (cn->answered) {
        *upload_size = 0;
        return MHD_YES;
    }
    if (*upload_size) {
        if (!cn->too_big && cn->n + *upload_size > g->o.body_max) cn->too_big = true;
        if (!cn->too_big) {
            if (cn->n + *upload_size + 1 > cn->cap) {
                size_t nc = cn->cap * 2 + *upload_size + 1;
                if (nc > g->o.body_max + 1) nc = g->o.body_max + 1;
                char *nb = realloc(cn->body, nc);
                if (!nb) return MHD_NO;
                cn->body = nb;
                cn->cap = nc;
            }
            memcpy(cn->body + cn->n, upload, *upload_size);
            cn->n += *upload_size;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    kv_http_guard_busy(g->guard, c); /* whole: no deadline while it is answered */
    if (cn->route == KV_R_PREFLIGHT) {
        kv_gw_reply a;
        kv_gw_cors_preflight(g, c, &a);
        if (!a.body) return MHD_NO;
        struct MHD_Response *r = MHD_create_response_from_buffer(strlen(a.body), a.body, MHD_RESPMEM_MUST_FREE);
        if (!r) {
            free(a.body);
            return MHD_NO;
        }
        if (a.status == 204) {
            MHD_add_response_header(r, "Access-Control-Allow-Methods", "GET, POST, OPTIONS");
            MHD_add_response_header(r, "Access-Control-Allow-Headers",
                                    "Authorization, Content-Type, x-api-key, anthropic-version, X-KVR-Payment");
            MHD_add_response_header(r, "Access-Control-Max-Age", "600");
        } else {
            MHD_add_response_header(r, "Content-Type", a.type);
        }
        kv_gw_cors_headers(g, c, r);
        kv_count(cn, a.status);
        enum MHD_Result ret = MHD_queue_response(c, a.status, r);
        MHD_destroy_response(r);
        return ret;
    }
    if (cn->route == KV_R_NOTFOUND) return kv_reply_err(cn, c, 404, "no route %.8s %.200s", method, url);
    if (cn->route == KV_R_METHOD) return kv_reply_err(cn, c, 405, "%.8s is not allowed on %.200s", method, url);
    if (cn->too_big)
        return kv_reply_err(cn, c, 413, "the request body is larger than %zu bytes", g->o.body_max);
    if (cn->route == KV_R_WEBUI && g->o.no_web_ui)
        return kv_reply_err(cn, c, 404, "the chat page is off (--no-web-ui)");
    const bool open = cn->route == KV_R_HEALTH || cn->route == KV_R_METRICS || cn->route == KV_R_PRICES ||
                      cn->route == KV_R_WEBUI || /* the page holds no data: it asks for the key itself */
                      (cn->route == KV_R_ENDPOINT && !strcmp(cn->route_name, "/api/version")); /* says nothing of the model */
    if (!open && !kv_key_ok(g, c)) return kv_reply_err(cn, c, 401, "missing or invalid API key");
    switch (cn->route) {
    case KV_R_HEALTH: {
        bool ok = false;
        char *s = kv_gw_health_json(g, &ok);
        return kv_reply(cn, c, ok ? 200 : 503, "application/json", s);
    }
    case KV_R_METRICS: return kv_reply(cn, c, 200, "text/plain; version=0.0.4", kv_gw_metrics_text(g));
    case KV_R_SLOTS: return kv_reply(cn, c, 200, "application/json", kv_gw_slots_json(g));
    case KV_R_PRICES:
        if (!g->pay) return kv_reply_err(cn, c, 404, "this gateway does not charge (started without --ledger)");
        return kv_reply(cn, c, 200, "application/json", kv_gw_pay_prices_json(g->pay));
    case KV_R_MODELS: {
        json_t *j = json_pack("{s:s,s:[{s:s,s:s,s:I,s:s}]}", "object", "list", "data", "id", g->model, "object",
                              "model", "created", (json_int_t)g->started, "owned_by", "kvasir");
        char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
        json_decref(j);
        return kv_reply(cn, c, 200, "application/json", s);
    }
    case KV_R_TAGS: {
        return kv_reply(cn, c, 200, "application/json", kv_gw_ollama_tags(g->model, g->started, 0));
    }
    case KV_R_TEMPLATE: return kv_apply_template(cn, c);
    case KV_R_ENDPOINT: {
        kv_gw_reply a;
        kv_gw_endpoint(g, url, cn->body, cn->n, cn->api, &a);
        return kv_reply(cn, c, a.status, a.type, a.body);
    }
    case KV_R_WEBUI: {
        struct MHD_Response *r = kv_gw_webui_response();
        if (!r) return MHD_NO;
        kv_count(cn, 200);
        const enum MHD_Result ret = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        return ret;
    }
    default: return kv_generate(cn, c);
    }
}

void kv_gw_done(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    kv_gateway *g = cls;
    kv_gw_conn *cn = *con_cls;
    kv_http_guard_idle(g->guard, c); /* a kept-alive connection's next request: its deadline starts */
    if (!cn) return;
    if (cn->n_choices > 1) { /* every choice: the unfinished cancelled first (the later ones' lead is the first) */
        pthread_mutex_lock(&g->mu);
        for (uint32_t i = 0; i < cn->n_choices; i++)
            if (cn->reqs[i]->state != KV_REQ_DONE) cn->reqs[i]->cancel = true;
        pthread_cond_signal(&g->work_cv);
        for (uint32_t i = cn->n_choices; i-- > 0;) kv_gw_req_unref_locked(cn->reqs[i]);
        pthread_mutex_unlock(&g->mu);
        cn->r = NULL;
    }
    if (cn->r) {
        pthread_mutex_lock(&g->mu);
        if (cn->r->state != KV_REQ_DONE) {
            cn->r->cancel = true;
            pthread_cond_signal(&g->work_cv);
        }
        pthread_mutex_unlock(&g->mu);
        kv_pay_end(cn, false); /* the client left: it pays for what it was given */
        pthread_mutex_lock(&g->mu);
        kv_gw_req_unref_locked(cn->r);
        pthread_mutex_unlock(&g->mu);
    }
    kv_pay_end(cn, true); /* held without a request (cannot happen): back whole */
    if (cn->counted)
        kv_gw_log_request(g, cn->method, cn->route_name, cn->status, cn->res.prompt_tokens,
                          cn->res.completion_tokens + cn->tokens_before,
                          (kv_gw_mono() - cn->t0) * 1e3);
    kv_gw_text_free(&cn->text);
    free(cn->lp_all);
    kv_chat_parser_free(cn->parser);
    for (uint32_t i = 0; i < cn->n_calls; i++) {
        free(cn->calls[i].name);
        free(cn->calls[i].args);
    }
    free(cn->calls);
    free(cn->reason.p);
    for (uint32_t i = 0; i < KV_GW_MAX_N; i++) {
        struct kv_gw_done_choice *dc = &cn->done[i];
        for (uint32_t k = 0; k < dc->n_calls; k++) {
            free(dc->calls[k].name);
            free(dc->calls[k].args);
        }
        free(dc->calls);
        free(dc->full.p);
        free(dc->reason.p);
    }
    kv_gw_params_free(cn->p);
    free(cn->p);
    free(cn->out.p);
    free(cn->full.p);
    free(cn->body);
    const size_t freed = cn->parse_charge + cn->cap;
    if (cn->parse_charge) {
        pthread_mutex_lock(&g->mu);
        g->parse_live -= cn->parse_charge;
        pthread_mutex_unlock(&g->mu);
    }
    free(cn);
    *con_cls = NULL;
    kv_http_release_memory(freed >= (1u << 20)); /* after a burst of big bodies RSS falls again */
}
