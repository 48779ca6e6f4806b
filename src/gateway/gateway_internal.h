/* Gateway internals shared by the server, the scheduler and the API
 * adapters: the request every API is parsed into, the incremental
 * detokenizer with stop strings, and each API's shapes (one table of
 * functions per API). Everything here but the server is free of I/O, so
 * the parsers are fuzzed and the text logic tested directly. */
#ifndef KVASIR_GATEWAY_INTERNAL_H
#define KVASIR_GATEWAY_INTERNAL_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/sample.h"
#include "kvasir/tok.h"

#define KV_GW_MAX_MSGS 512u       /* messages in one request */
#define KV_GW_MAX_STOP 8u         /* stop strings */
#define KV_GW_MAX_STOP_LEN 256u   /* bytes in one stop string */
#define KV_GW_MAX_MODEL_LEN 256u
#define KV_GW_MAX_TOKENS (1u << 20)

enum kv_gw_api {
    KV_GW_OPENAI_CHAT = 0,  /* POST /v1/chat/completions */
    KV_GW_OPENAI_TEXT,      /* POST /v1/completions */
    KV_GW_ANTHROPIC,        /* POST /v1/messages */
    KV_GW_OLLAMA,           /* POST /api/chat */
    KV_GW_API_COUNT
};

/* One request, whatever API it came in. Strings point into json (owned). */
typedef struct kv_gw_params {
    int api;                        /* enum kv_gw_api */
    json_t *json;                   /* the parsed body (owned; strings below live in it) */
    const char *model;              /* NULL if absent */
    kv_chat_msg msgs[KV_GW_MAX_MSGS];
    size_t n_msgs;                  /* chat APIs */
    char *joined[KV_GW_MAX_MSGS];   /* contents joined from content blocks (owned) */
    const char *prompt;             /* completions */
    size_t prompt_len;
    bool has_max_tokens;
    uint32_t max_tokens;
    kv_sample_params sp;            /* kv_sample_defaults() with the request's values */
    bool has_seed;
    bool ignore_eos;                /* llama.cpp's extension: generate past end-of-generation */
    const char *stop[KV_GW_MAX_STOP];
    size_t stop_len[KV_GW_MAX_STOP];
    uint32_t n_stop;
    bool stream;
    bool include_usage;             /* OpenAI stream_options.include_usage */
} kv_gw_params;

/* Parses body (n bytes, any bytes) as a request of api into p (every
 * field bounded and type-checked). Returns 0, or KV_EFORMAT / KV_ERANGE /
 * KV_EINVAL with d naming the field; p then holds nothing to free beyond
 * kv_gw_params_free (which is always safe after the call). */
int kv_gw_parse(kv_gw_params *p, int api, const char *body, size_t n, kv_diag *d);
/* kv_gw_parse within a memory budget: the parsed JSON may hold at most
 * budget bytes (counted per thread, http/http_guard.h), or the parse fails
 * with *over set, KV_ERANGE and d saying so (413). *held: the bytes the
 * parsed body holds on return (what the request keeps until it is freed). */
int kv_gw_parse_budget(kv_gw_params *p, int api, const char *body, size_t n, size_t budget, size_t *held, bool *over,
                       kv_diag *d);
void kv_gw_params_free(kv_gw_params *p);

/* ---- incremental text -------------------------------------------------
 * Tokens go in; text comes out only when it is whole UTF-8 and cannot be
 * the start of a stop string. A stop string found ends the text before it. */
typedef struct kv_gw_text {
    char *buf;           /* every byte generated so far */
    size_t len, cap;
    size_t sent;         /* bytes handed out */
    bool stopped;        /* a stop string matched at buf[len] (cut there) */
    int stop_index;      /* which one, -1 if none */
    const char *const *stop;
    const size_t *stop_len;
    uint32_t n_stop;
} kv_gw_text;

void kv_gw_text_init(kv_gw_text *t, const char *const *stop, const size_t *stop_len, uint32_t n_stop);
void kv_gw_text_free(kv_gw_text *t);
/* Adds piece bytes. Returns 0 or KV_ENOMEM. */
int kv_gw_text_push(kv_gw_text *t, const char *piece, size_t n);
/* The next chunk that is safe to send (valid UTF-8, invalid bytes as
 * U+FFFD), malloc'd into *out (caller frees; NULL when nothing new) with its
 * length. final: the generation ended, so held-back bytes go out too. */
int kv_gw_text_take(kv_gw_text *t, bool final, char **out, size_t *n);
/* Valid-UTF-8 copy of in[0..n) (invalid bytes as U+FFFD) into out (room
 * for 3n bytes); returns its length. */
size_t kv_gw_utf8_clean(const char *in, size_t n, char *out);

/* ---- API shapes ---------------------------------------------------------- */

enum kv_gw_finish { KV_GW_FINISH_STOP = 0, KV_GW_FINISH_LENGTH, KV_GW_FINISH_COUNT };

typedef struct kv_gw_result {
    const char *id;          /* "chatcmpl-..." etc. */
    const char *model;
    long long created;       /* unix seconds */
    uint32_t prompt_tokens, completion_tokens;
    int finish;              /* enum kv_gw_finish */
    const char *stop_seq;    /* the stop string that matched, or NULL */
} kv_gw_result;

/* A growable output buffer of bytes to send. */
typedef struct kv_gw_buf {
    char *p;
    size_t n, cap;
    bool oom;
} kv_gw_buf;
void kv_gw_buf_add(kv_gw_buf *b, const char *s, size_t n);
void kv_gw_buf_json(kv_gw_buf *b, const char *prefix, json_t *j, const char *suffix); /* steals j */

/* Error body in api's shape (malloc'd NUL-terminated, caller frees). */
char *kv_gw_error_body(int api, unsigned status, const char *msg);
/* Whole (non-streamed) response. */
char *kv_gw_full_body(int api, const kv_gw_result *r, const char *text, size_t n);
/* Streaming: content type, the events before the first text, one text
 * delta, and the end (usage when the API reports it there). */
const char *kv_gw_stream_type(int api);
void kv_gw_stream_begin(int api, const kv_gw_result *r, kv_gw_buf *b);
void kv_gw_stream_delta(int api, const kv_gw_result *r, const char *text, size_t n, kv_gw_buf *b);
void kv_gw_stream_end(int api, const kv_gw_result *r, bool include_usage, kv_gw_buf *b);
/* An error after the stream began (the status line is gone). */
void kv_gw_stream_error(int api, const char *msg, kv_gw_buf *b);

/* ---- the hub's placement map (gateway/watch.c) ---------------------------
 * A thread reads HUB/v1/placement every refresh_ms (0 = 2000), or at once
 * after kv_gw_watch_kick; the scheduler takes each new list of live node
 * addresses (kv_node_parse_placement's) between steps. Thread-safe. */
typedef struct kv_gw_watch kv_gw_watch;
int kv_gw_watch_start(kv_gw_watch **out, const char *hub_url, uint32_t refresh_ms, kv_diag *d);
void kv_gw_watch_kick(kv_gw_watch *w);
/* true with the list read since the last take (free with
 * kv_node_workers_free) and the key each address is listed with (zero:
 * none; free()), false with both NULL when nothing new. */
bool kv_gw_watch_take(kv_gw_watch *w, char ***addrs, uint8_t (**keys)[32], uint32_t *n);
/* Reads and failed reads so far, and why the last one failed ("" if it did not). */
void kv_gw_watch_info(kv_gw_watch *w, uint64_t *reads, uint64_t *failures, char *err, size_t cap);
void kv_gw_watch_free(kv_gw_watch *w); /* joins the thread; accepts NULL */

#endif
