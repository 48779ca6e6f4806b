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
#define KV_GW_MAX_TOOLS 128u       /* tools in one request */
#define KV_GW_MAX_KWARGS 32u       /* chat_template_kwargs entries */
#define KV_GW_MAX_N 8u             /* choices of one request (OpenAI's "n") */

/* tool_choice: what the model may do with the tools */
enum kv_gw_tool_choice {
    KV_GW_TOOLS_AUTO = 0,  /* call any or none ("auto"; the default) */
    KV_GW_TOOLS_NONE,      /* no calls: the template is not given the tools, calls are not parsed */
    KV_GW_TOOLS_REQUIRED,  /* at least one call ("required", Anthropic "any"): needs constrained decoding */
    KV_GW_TOOLS_NAMED,     /* this one function (tool_choice_name): needs constrained decoding */
    KV_GW_TOOLS_COUNT
};

enum kv_gw_api {
    KV_GW_OPENAI_CHAT = 0,  /* POST /v1/chat/completions */
    KV_GW_OPENAI_TEXT,      /* POST /v1/completions */
    KV_GW_ANTHROPIC,        /* POST /v1/messages */
    KV_GW_OLLAMA,           /* POST /api/chat */
    KV_GW_LLAMA,            /* POST /completion (llama-server's native completion) */
    KV_GW_OLLAMA_GEN,       /* POST /api/generate */
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
    const char *prompt;             /* completions: the text as given (no chat template), or NULL */
    size_t prompt_len;
    int32_t *prompt_ids;            /* [n_prompt_ids] /completion's prompt as token ids (owned; checked
                                       against the vocabulary where it is tokenized), or NULL */
    size_t n_prompt_ids;
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
    bool add_generation_prompt;     /* the chat template ends with the assistant's turn opened (default) */
    bool has_tool_role;             /* a message has role "tool" (only a chat template renders it) */
    struct kv_grammar *grammar;     /* structured output (gateway/structured.c): owned, NULL none */
    const char *grammar_field;      /* the field that asked for it ("response_format", "format", ...) */
    char *grammar_gbnf;             /* its GBNF text (owned; a ring's tail parses the same text), NULL none */
    /* tools and reasoning (docs/GATEWAY.md "Tool calling", "Reasoning") */
    json_t *tools;                  /* [n <= KV_GW_MAX_TOOLS] OpenAI's shape (owned), NULL: none */
    int tool_choice;                /* enum kv_gw_tool_choice */
    const char *tool_choice_name;   /* KV_GW_TOOLS_NAMED: the function (in json) */
    bool parallel_calls;            /* more than one call per answer (default true) */
    json_t *tmpl_msgs;              /* messages in OpenAI's shape for the template (owned; Anthropic's
                                       blocks converted), NULL: the body's messages */
    json_t *kwargs;                 /* extra top-level template variables (owned object): the body's
                                       chat_template_kwargs, and enable_thinking from a thinking switch */
    /* sampling and response fields (samplefields.c; docs/GATEWAY.md "Sampling fields") */
    kv_logit_bias *bias;            /* [n_bias] logit_bias (owned; sp.bias points here) */
    uint32_t n_bias;
    bool logprobs;                  /* each token's log-probability in the answer */
    uint32_t top_logprobs;          /* ... with this many alternatives (<= KV_SAMPLE_MAX_TOP) */
    bool echo;                      /* completions: the prompt's text before the completion */
    const char *suffix;             /* completions: text after the completion (fill-in-the-middle), or NULL */
    size_t suffix_len;
    uint32_t n_choices;             /* OpenAI's "n": choices, each its own session with seed + i (0: 1) */
    bool has_think_budget;          /* a reasoning budget: Anthropic's thinking.budget_tokens below
                                       max_tokens, llama-server's thinking_budget_tokens (budget.c) */
    uint32_t think_budget;          /* ... reasoning tokens before its end is forced */
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
/* The shared field parsers the adapters call (parse.c): each 0, or an
 * error naming the field. */
int kv_gw_tools(kv_gw_params *p, json_t *o, kv_diag *d);             /* "tools", OpenAI's shape */
int kv_gw_tool_choice_openai(kv_gw_params *p, json_t *o, kv_diag *d); /* "tool_choice", "parallel_tool_calls" */
int kv_gw_tool_choice_check(kv_gw_params *p, kv_diag *d);            /* the choice against the tools */
int kv_gw_kwargs(kv_gw_params *p, json_t *o, kv_diag *d);            /* "chat_template_kwargs" */
int kv_gw_set_thinking(kv_gw_params *p, bool on, kv_diag *d);        /* enable_thinking for the template */
/* samplefields.c: key's logit bias (OpenAI's object or llama-server's
 * array); presence/frequency penalties and the repetition penalty under
 * the API's names (NULL: none); OpenAI's logprobs/top_logprobs (chat) or
 * logprobs: N (completions); llama-server's n_probs; OpenAI's fields that
 * are refused by name; the bias's ids against the vocabulary. */
int kv_gw_logit_bias(kv_gw_params *p, json_t *o, const char *key, kv_diag *d);
int kv_gw_penalties(kv_gw_params *p, json_t *o, const char *repeat_key, const char *last_key, kv_diag *d);
int kv_gw_logprobs_openai(kv_gw_params *p, json_t *o, bool chat, kv_diag *d);
int kv_gw_n_probs(kv_gw_params *p, json_t *o, kv_diag *d);
int kv_gw_refuse_openai(json_t *o, bool chat, kv_diag *d);
int kv_gw_bias_check(const kv_gw_params *p, int32_t n_vocab, kv_diag *d);

/* ---- structured output (gateway/structured.c) ----------------------------
 * The fields that constrain the output, compiled to one grammar. */
#define KV_GW_GRAMMAR_MEMORY (64u << 20) /* bytes of one request's matcher tables (flushed past half) */
#define KV_GW_GRAMMAR_TEXT (1u << 20)    /* bytes of GBNF text, given or compiled from a schema */
struct kv_grammar_limits;
/* The grammar limits of a request (kv_grammar_limits_default, with the
 * memory and text bounds above). */
void kv_gw_grammar_limits(struct kv_grammar_limits *lim);
/* Reads o's output-constraining field for p->api (see structured.c) into
 * p->grammar and p->grammar_field. Returns 0 (p->grammar NULL when none),
 * or KV_EFORMAT / KV_EINVAL / KV_EUNSUPPORTED / KV_ERANGE with d naming the
 * field and the compiler's message (a 400). */
int kv_gw_structured_parse(kv_gw_params *p, json_t *o, kv_diag *d);

/* A family's tool-call text: the values of enum kv_chat_format (the
 * tool-call parser's), and DeepSeek's older variant (which the parser reads
 * as DEEPSEEK). */
enum {
    KV_GW_CALLS_HERMES = 0,         /* Qwen's: <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call> */
    KV_GW_CALLS_DEEPSEEK,           /* DeepSeek V3.1: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜> */
    KV_GW_CALLS_HARMONY,            /* gpt-oss: <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS */
    KV_GW_CALLS_DEEPSEEK_FENCED,    /* DeepSeek V3/R1: ...>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<... */
    KV_GW_CALLS_COUNT
};
#define KV_GW_CALLS_MAX_TOOLS 128u /* functions a tool-call grammar chooses from */
/* GBNF for the tool calls of tools (OpenAI's array of {"type":"function",
 * "function":{"name","parameters"}}) in format: one call (parallel: one to
 * KV_CHAT_MAX_CALLS, "\n" between), of any function (only NULL: tool_choice "required")
 * or of function only (a named tool_choice), its arguments following that
 * function's parameters schema (none: exactly {}). malloc'd into *gbnf
 * (caller frees). Errors: KV_EFORMAT / KV_EINVAL naming the tool and field,
 * the schema compiler's (KV_EUNSUPPORTED naming the keyword), KV_ERANGE,
 * KV_ENOMEM; KV_EUNSUPPORTED for an unknown format. close_think: the
 * prompt opened <think> (kv_chat_prompt_thinks), so the text starts by
 * closing it ("</think>\n\n") and the call is not taken for reasoning. */
int kv_gw_tools_gbnf(char **gbnf, json_t *tools, const char *only, int format, bool parallel, bool close_think,
                     kv_diag *d);
/* The same, parsed (kv_grammar_free). */
int kv_gw_tools_grammar(struct kv_grammar **out, json_t *tools, const char *only, int format, bool parallel,
                        bool close_think, kv_diag *d);
/* True when p's tool_choice makes a call compulsory ("required", Anthropic
 * "any", a named function) over its tools. */
bool kv_gw_tool_call_forced(const kv_gw_params *p);
/* The grammar of p's compulsory call (kv_gw_tools_grammar over p's tools,
 * the named function alone, p's parallel_calls), d prefixed with
 * 'tool_choice' on error (a 400, 500 for KV_ENOMEM). */
int kv_gw_tool_choice_grammar(struct kv_grammar **out, const kv_gw_params *p, int format, bool think_open,
                              kv_diag *d);

/* ---- the reasoning budget (gateway/budget.c) ------------------------------
 * Follows a request's output and says when its reasoning has used
 * budget tokens, for the scheduler to force the family's end of reasoning
 * (kv_session_force). One request's, on the scheduler's thread. */
#define KV_GW_BUDGET_MAX_FORCED 32u /* tokens of a forced end of reasoning */
enum { KV_GW_BUDGET_WAIT = 0, KV_GW_BUDGET_IN, KV_GW_BUDGET_OVER };
typedef struct kv_gw_budget {
    bool on;                 /* the family writes reasoning (else the budget is never reached) */
    uint32_t budget;         /* reasoning tokens allowed */
    uint32_t used;           /* reasoning tokens so far (after the opening marker) */
    int state;               /* WAIT: no output text yet; IN: reasoning; OVER: ended, forced, or none */
    char open[40], close[16]; /* the family's markers */
    char tail[64];           /* the latest output text, NUL-terminated (markers are found in it) */
    size_t n_tail;
    int32_t forced[KV_GW_BUDGET_MAX_FORCED]; /* [n_forced] the end of reasoning, tokenized */
    uint32_t n_forced;
} kv_gw_budget;
/* A tracker of budget reasoning tokens for output in format (enum
 * kv_chat_format) of a family that thinks (think) after a prompt that
 * opened the reasoning or not (think_open). Returns 0, or KV_EINVAL when
 * the forced text does not tokenize within KV_GW_BUDGET_MAX_FORCED tokens
 * (d says so). */
int kv_gw_budget_init(kv_gw_budget *b, const kv_tok *tok, int format, bool think, bool think_open, uint32_t budget,
                      kv_diag *d);
/* One more output token t: true when the end of reasoning is due now. */
bool kv_gw_budget_see(kv_gw_budget *b, const kv_tok *tok, int32_t t);
/* Whether it is due (a budget of 0 is, before any output, after a prompt
 * that opened the reasoning). */
bool kv_gw_budget_due(const kv_gw_budget *b);
/* The end was forced: nothing more to follow. */
void kv_gw_budget_forced(kv_gw_budget *b);

/* ---- incremental text -------------------------------------------------
 * Tokens go in; text comes out only when it is whole UTF-8 and cannot be
 * the start of a stop string. Stop strings are matched on the text as the
 * client sees it (invalid bytes as U+FFFD); one found ends the text before
 * it. */
typedef struct kv_gw_text {
    char *buf;           /* the text so far: the generated bytes cleaned (kv_gw_utf8_clean) */
    size_t len, cap;
    size_t sent;         /* bytes of buf handed out */
    char hold[3];        /* generated bytes that start an incomplete UTF-8 sequence */
    size_t n_hold;
    char *raw;           /* scratch: hold + the piece being pushed */
    size_t raw_cap;
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
 * length. final: the generation ended, so held-back bytes go out too (an
 * incomplete UTF-8 sequence as U+FFFD), and a stop string that ends in them
 * still matches: t->stopped may become true in this call. Returns 0 or
 * KV_ENOMEM. */
int kv_gw_text_take(kv_gw_text *t, bool final, char **out, size_t *n);
/* Valid-UTF-8 copy of in[0..n) (invalid bytes as U+FFFD) into out (room
 * for 3n bytes); returns its length. */
size_t kv_gw_utf8_clean(const char *in, size_t n, char *out);

/* ---- API shapes ---------------------------------------------------------- */

enum kv_gw_finish { KV_GW_FINISH_STOP = 0, KV_GW_FINISH_LENGTH, KV_GW_FINISH_TOOLS, KV_GW_FINISH_COUNT };

/* A stream's own state the adapters keep between events (Anthropic's
 * content blocks). */
typedef struct kv_gw_stream_state {
    int open;                /* the block open now: 0 none, 1 text, 2 thinking, 3 a tool_use streamed as it comes */
    uint32_t n_blocks;       /* blocks opened so far */
} kv_gw_stream_state;

typedef struct kv_gw_result {
    const char *id;          /* "chatcmpl-..." etc. */
    uint32_t index;          /* the choice (OpenAI's "n"): 0, 1, ... */
    const char *model;
    long long created;       /* unix seconds */
    uint32_t prompt_tokens, completion_tokens;
    uint32_t cached_tokens;  /* of prompt_tokens, those the prompt cache held (not evaluated) */
    int finish;              /* enum kv_gw_finish */
    const char *stop_seq;    /* the stop string that matched, or NULL */
    kv_gw_stream_state *ss;  /* the stream's (mutable), NULL when whole */
    double t_start;          /* monotonic seconds (kv_gw_mono): the request was read */
    double t_first;          /* its first token was seen (0: none yet) */
    /* log-probabilities, when the request asked (logprobs): those of the
       tokens this delta carries (stream) or of the whole answer; lp[i].token
       -1: unknown (null). Adapters turn them into their API's shapes with
       the helpers of logprobs.c. */
    bool logprobs;
    uint32_t top_logprobs;
    const kv_tok *tok;       /* the tokens' texts */
    const kv_token_logprob *lp; /* [n_lp] */
    uint32_t n_lp;
    size_t lp_text_off;      /* completions: bytes of the text before lp[0] */
} kv_gw_result;

/* One tool call the model made (kvasir/chat.h's parser gave it whole). */
typedef struct kv_gw_call {
    char id[96];             /* the API's call id: its call_prefix, the response id, the index */
    char *name;              /* malloc'd */
    char *args;              /* the arguments: a JSON object's compact text, malloc'd */
    size_t args_len;
} kv_gw_call;

/* A whole answer: content, reasoning, calls. */
typedef struct kv_gw_answer {
    const char *text;        /* content [n] */
    size_t n;
    const char *reasoning;   /* [rn]; rn 0: none */
    size_t rn;
    const kv_gw_call *calls; /* [n_calls] */
    uint32_t n_calls;
} kv_gw_answer;

/* logprobs.c: r's log-probabilities in OpenAI's chat shape ({"content":
 * [{token, logprob, bytes, top_logprobs}]}) and completions' ({tokens,
 * token_logprobs, top_logprobs, text_offset}), llama-server's
 * completion_probabilities ([{id, token, logprob, bytes, top_logprobs}]);
 * NULL on no memory. kv_gw_lp_bytes: the bytes of text lp[0..n) spans. */
json_t *kv_gw_lp_chat(const kv_gw_result *r);
json_t *kv_gw_lp_text(const kv_gw_result *r);
json_t *kv_gw_lp_llama(const kv_gw_result *r);
size_t kv_gw_lp_bytes(const kv_tok *tok, const kv_token_logprob *lp, uint32_t n);

/* CLOCK_MONOTONIC in seconds. */
double kv_gw_mono(void);

/* A request whose prompt is taken as given (no chat template): a text
 * prompt or token ids. */
static inline bool kv_gw_params_raw(const kv_gw_params *p) { return p->prompt || p->prompt_ids; }

/* A growable output buffer of bytes to send. */
typedef struct kv_gw_buf {
    char *p;
    size_t n, cap;
    bool oom;
} kv_gw_buf;
void kv_gw_buf_add(kv_gw_buf *b, const char *s, size_t n);
void kv_gw_buf_json(kv_gw_buf *b, const char *prefix, json_t *j, const char *suffix); /* steals j */

/* ---- each API's adapter --------------------------------------------------
 * One table of handlers per API: its request parser and every shape of its
 * answer. The server calls only these, never a switch on the API, so a new
 * kind of output (a tool call, a reasoning delta) is one function per
 * adapter and one field here. Strings returned are malloc'd and
 * NUL-terminated (caller frees; NULL on no memory); writers append to b
 * (b->oom set on no memory). */
typedef struct kv_gw_api_ops {
    const char *name;           /* its label in /metrics and /v1/slots */
    const char *id_prefix;      /* of a response id: "chatcmpl-", "msg_", ... */
    const char *stream_type;    /* Content-Type of a stream */
    const char *auth_challenge; /* WWW-Authenticate of a 401 */
    const char *call_prefix;    /* of a tool call's id: "call_", "toolu_" */
    /* the body's fields into p (p->json is o); 0, or an error naming the field */
    int (*parse)(kv_gw_params *p, json_t *o, kv_diag *d);
    /* an error body for status */
    char *(*error_body)(unsigned status, const char *msg);
    /* a whole (non-streamed) response */
    char *(*full_body)(const kv_gw_result *r, const kv_gw_answer *a);
    /* a stream: the events before the first text, one text delta, the end
       (usage where the API reports it there), an error after the status
       line went out */
    void (*stream_begin)(const kv_gw_result *r, kv_gw_buf *b);
    void (*stream_delta)(const kv_gw_result *r, const char *text, size_t n, kv_gw_buf *b);
    /* reasoning text, and one whole tool call (chat APIs; NULL: none) */
    void (*stream_reasoning)(const kv_gw_result *r, const char *text, size_t n, kv_gw_buf *b);
    void (*stream_call)(const kv_gw_result *r, uint32_t index, const kv_gw_call *c, kv_gw_buf *b);
    /* a call as it comes (NULL: the API streams calls whole): its start
       (c's id and name; no arguments yet), a fragment of its arguments'
       JSON text, its end */
    void (*stream_call_begin)(const kv_gw_result *r, uint32_t index, const kv_gw_call *c, kv_gw_buf *b);
    void (*stream_call_args)(const kv_gw_result *r, uint32_t index, const char *frag, size_t n, kv_gw_buf *b);
    void (*stream_call_end)(const kv_gw_result *r, uint32_t index, kv_gw_buf *b);
    void (*stream_end)(const kv_gw_result *r, bool include_usage, kv_gw_buf *b);
    void (*stream_error)(const char *msg, kv_gw_buf *b);
    /* several choices (OpenAI's "n"; NULL: the API has none): a whole
       answer of n (r[i], a[i]), and the chunk that ends a choice of a
       stream before the next one's (stream_end ends the last) */
    char *(*full_body_n)(const kv_gw_result *r, const kv_gw_answer *a, uint32_t n);
    void (*stream_choice_end)(const kv_gw_result *r, bool include_usage, kv_gw_buf *b);
} kv_gw_api_ops;

extern const kv_gw_api_ops kv_gw_openai_chat_ops, kv_gw_openai_text_ops, kv_gw_anthropic_ops, kv_gw_ollama_ops;
extern const kv_gw_api_ops kv_gw_llama_ops, kv_gw_ollama_gen_ops; /* llama.c, ollama_gen.c */

/* The adapter of api (enum kv_gw_api); any other value (a route that is no
 * API's) gets OpenAI's shapes. Never NULL. */
const kv_gw_api_ops *kv_gw_api(int api);

/* GET /api/tags: the one model served (Ollama's shape). */
char *kv_gw_ollama_tags(const char *model, long long created, unsigned long long size);

/* ---- the chat template (gateway/template.c) -------------------------------
 * The model's own template rendered over a chat request (what it sees is
 * described at the top of template.c). Immutable once open: any thread. */
typedef struct kv_gw_tmpl kv_gw_tmpl;
#define KV_GW_TMPL_MAX_OUTPUT (4u << 20)  /* bytes of a rendering (and of any string it builds) */
#define KV_GW_TMPL_MAX_MEMORY (64u << 20) /* bytes one render may allocate */
/* Parses src (len bytes; name says where it came from, in messages); the
 * BOS and EOS texts from tok (NULL: both ""). Errors: kv_chat_tmpl_parse's,
 * d prefixed with the name. */
int kv_gw_tmpl_open(kv_gw_tmpl **out, const kv_tok *tok, const char *src, size_t len, const char *name, kv_diag *d);
void kv_gw_tmpl_free(kv_gw_tmpl *m); /* accepts NULL */
const char *kv_gw_tmpl_name(const kv_gw_tmpl *m);
/* The output syntax of the template's family (kv_chat_detect over its
 * source); tools and think_open unset. */
struct kv_chat_syntax;
void kv_gw_tmpl_syntax(const kv_gw_tmpl *m, struct kv_chat_syntax *out);
/* The template's tool-call text (KV_GW_CALLS_*: its family's, and for
 * DeepSeek which of its variants the template writes). */
int kv_gw_tmpl_calls(const kv_gw_tmpl *m);
/* The template's variables for p (a new object, caller decrefs). */
int kv_gw_tmpl_context(const kv_gw_tmpl *m, const kv_gw_params *p, json_t **out, kv_diag *d);
/* The rendered prompt (malloc'd, NUL-terminated, *n bytes). Errors as
 * kv_chat_render's: KV_EINVAL for the template's raise_exception (d->msg
 * its message), KV_ERANGE a render limit (named), KV_EFORMAT, KV_ENOMEM. */
int kv_gw_tmpl_render(const kv_gw_tmpl *m, const kv_gw_params *p, char **out, size_t *n, kv_diag *d);
/* Tokens of a rendering of p: special token texts as their ids, except
 * inside the client's strings where they appear verbatim (they stay text).
 * As kv_tok_encode: up to cap ids, *n_ids the full count. */
int kv_gw_tmpl_encode(const kv_tok *tok, const kv_gw_params *p, const char *text, size_t n, int32_t *ids,
                      size_t cap, size_t *n_ids, kv_diag *d);

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
