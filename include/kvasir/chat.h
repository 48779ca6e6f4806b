/* Chat templates: a bounded interpreter for the Jinja subset that models'
 * own chat templates (tokenizer.chat_template) are written in.
 *
 * The reference is the Jinja implementation the Hugging Face ecosystem uses
 * in JavaScript (@huggingface/jinja 0.5.11, as transformers.js and
 * llama.cpp's tests run it): a template rendered here gives the same bytes
 * it gives there, including its quirks (the lexer's trim_blocks and
 * lstrip_blocks, `{% set %}` scoping by loop, macros that see the caller's
 * variables, `x.rstrip('\n')` trimming all whitespace, a JSON number with an
 * integral value being an integer, tojson's `", "` and `": "` separators,
 * `~` and `+` printing numbers as JavaScript does). tests/test_chat_oracle.c
 * checks it byte for byte against that package on real templates.
 *
 * Known differences from the reference, none used by the shipped templates:
 * upper/lower/title change ASCII letters only; tojson(sort_keys=true)
 * orders keys by bytes, not by locale; `{% call %}` blocks are refused at
 * parse time.
 *
 * Bounded: the template size, the nesting depth of the source and of the
 * evaluation (macro recursion), the loop iterations of one render (every
 * for-loop step, range() element and filter step), the bytes of any string
 * built (so the output) and the memory of one render each have a limit; a
 * render that reaches one stops with KV_ERANGE and a message naming it. Any
 * input, however malformed, gives an error, never an abort.
 *
 * Thread safety: a parsed template is read-only while rendering, so many
 * threads may render one template at once. */
#ifndef KVASIR_CHAT_H
#define KVASIR_CHAT_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"

/* Limits of one template and of its renders. */
typedef struct kv_chat_limits {
    size_t max_template_bytes; /* source size, bytes */
    size_t max_output_bytes;   /* any string a render builds, the output included, bytes */
    size_t max_memory_bytes;   /* everything one render allocates, bytes */
    uint64_t max_loop_iters;   /* loop steps of one render, all loops together */
    uint32_t max_depth;        /* nesting of the source and of evaluation (macro calls) */
} kv_chat_limits;

/* The defaults: 1 MiB template, 16 MiB strings, 256 MiB memory, 10^6
 * iterations, depth 200. */
void kv_chat_limits_default(kv_chat_limits *l);

typedef struct kv_chat_tmpl kv_chat_tmpl;

/* Parses a template. lim NULL means the defaults (they are copied and
 * apply to every render of the template). Returns 0 and sets *out (free
 * with kv_chat_tmpl_free), or KV_EFORMAT for a syntax error, KV_ERANGE for
 * a limit, KV_EUNSUPPORTED for a construct the interpreter refuses,
 * KV_ENOMEM; d names the problem. */
int kv_chat_tmpl_parse(kv_chat_tmpl **out, const char *src, size_t len, const kv_chat_limits *lim,
                       kv_diag *d);

/* Frees a template; NULL is fine. */
void kv_chat_tmpl_free(kv_chat_tmpl *t);

/* Options of one render. */
typedef struct kv_chat_render_opts {
    int64_t now_unix; /* the time strftime_now() formats, seconds since the epoch, in UTC */
} kv_chat_render_opts;

/* Renders a template with the variables of the JSON object ctx (messages,
 * tools, add_generation_prompt, bos_token, ...; NULL for none). On success
 * returns 0 and sets *out to a malloc'd NUL-terminated text of *out_len
 * bytes, which the caller frees. On failure *out is NULL and the return is:
 *   KV_EINVAL    the template called raise_exception(msg): d->msg is msg
 *                exactly (truncated to fit), for the caller to pass on;
 *   KV_ERANGE    a limit was reached: d names it and its value;
 *   KV_EFORMAT   a runtime error of the template (a type error, an unknown
 *                filter, a bad argument): d says which;
 *   KV_ENOMEM.
 * opts NULL means now_unix = 0. Thread-safe for one template. */
int kv_chat_render(const kv_chat_tmpl *t, const json_t *ctx, const kv_chat_render_opts *opts,
                   char **out, size_t *out_len, kv_diag *d);

/* ---- the model's output: reasoning and tool calls (src/chat/toolcall.c) ----
 * A model writes its reasoning and its tool calls as text between markers
 * that its family defines; the parser splits generated text into content,
 * reasoning and whole tool calls, fed a piece at a time as it is generated.
 *
 * Formats (chosen from the template's text by kv_chat_detect):
 *   HERMES    Qwen2.5/Qwen3/Qwen3.5, Hermes, ChatML: `<tool_call>` BODY
 *             `</tool_call>`, BODY either JSON {"name", "arguments"} or
 *             Qwen3.5's `<function=NAME>` with `<parameter=K>V</parameter>`;
 *   DEEPSEEK  DeepSeek V3/R1 (`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`
 *             and a fenced JSON block) and V3.1 (`NAME<｜tool▁sep｜>JSON`),
 *             inside `<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>`;
 *   HARMONY   gpt-oss: messages `<|channel|>CH[ to=functions.NAME]...
 *             <|message|>BODY` ended by `<|end|>`, `<|call|>` or
 *             `<|return|>`; channel analysis is reasoning, a message to
 *             functions.NAME a call with BODY its JSON arguments.
 * Reasoning (HERMES, DEEPSEEK with think): `<think>` ... `</think>`.
 *
 * What comes out: text outside markers is content, text inside reasoning
 * markers reasoning; whitespace right after a marker and right before one
 * is dropped (so a text without markers comes out unchanged). A tool call
 * is held until its closing marker and then given whole (its name and its
 * arguments as compact JSON text), so a call is never retracted: a block
 * whose body does not parse (bad JSON, no name), or that grows past
 * KV_CHAT_MAX_CALL_BYTES, or past KV_CHAT_MAX_CALLS calls, is content,
 * markers and all, as is a block still open at the end (except HARMONY,
 * whose `<|call|>` is an end-of-generation token the text never holds).
 * Text that may be the start of a marker is held back until it is known;
 * pushing a text whole or byte by byte gives the same events joined. */
enum kv_chat_format { KV_CHAT_FMT_HERMES = 0, KV_CHAT_FMT_DEEPSEEK, KV_CHAT_FMT_HARMONY, KV_CHAT_FMT_COUNT };

#define KV_CHAT_MAX_CALLS 64u              /* tool calls in one output */
#define KV_CHAT_MAX_CALL_BYTES (256u << 10) /* bytes of one call's block */
#define KV_CHAT_MAX_NAME 256u              /* bytes of a function's name */

typedef struct kv_chat_syntax {
    int format;            /* enum kv_chat_format */
    bool think;            /* the family writes `<think>` reasoning (HARMONY: always analysis) */
    bool think_open;       /* the output starts inside reasoning (the prompt ended with `<think>`) */
    bool tools;            /* parse tool calls (else their markers are content) */
    uint32_t max_calls;    /* calls given at most (later ones are content); 0 = KV_CHAT_MAX_CALLS */
    const json_t *tools_json; /* the tools, OpenAI's shape, or NULL: a `<parameter=K>` whose schema
                                 type is "string" stays a string (copied by the parser) */
    bool stream_args;      /* calls are well-formed (the caller samples them under their grammar): a
                              call's JSON arguments are given as they come (CALL_BEGIN, CALL_ARGS) */
} kv_chat_syntax;

/* The syntax of a template's family from its source (markers as llama.cpp's
 * common/chat.cpp detects them); a template with no known markers (ChatML)
 * is HERMES without think. think_open and tools are the caller's. */
void kv_chat_detect(const char *tmpl, size_t n, kv_chat_syntax *out);
/* true when a rendered prompt ends (whitespace aside) inside an open
 * `<think>` (Qwen3.5's and DeepSeek-R1's generation prompts do). */
bool kv_chat_prompt_thinks(const char *prompt, size_t n);

/* With stream_args, a call whose arguments are a JSON object (Qwen's JSON
 * body, DeepSeek's, harmony's) is also given as it comes: CALL_BEGIN once
 * its name is known, then CALL_ARGS fragments of its arguments (whitespace
 * outside strings left out: the fragments joined are the CALL's args,
 * which is then that text, not jansson's re-encoding), then the CALL whole
 * with streamed set. A streamed call the output ends inside (cut by a
 * limit) is given as far as it went: a CALL whose args are the fragments
 * given (not a whole JSON object then), never content. */
enum kv_chat_ev_type { KV_CHAT_EV_CONTENT = 0, KV_CHAT_EV_REASONING, KV_CHAT_EV_CALL, KV_CHAT_EV_CALL_BEGIN,
                       KV_CHAT_EV_CALL_ARGS };

typedef struct kv_chat_ev {
    int type;              /* enum kv_chat_ev_type */
    const char *text;      /* CONTENT, REASONING, CALL_ARGS: text[0..n), whole UTF-8 if the input was */
    size_t n;
    uint32_t index;        /* CALL, CALL_BEGIN, CALL_ARGS: 0, 1, ... in order */
    const char *name;      /* CALL, CALL_BEGIN: NUL-terminated */
    const char *args;      /* CALL: arguments, a JSON object as compact text, NUL-terminated */
    size_t args_len;
    bool streamed;         /* CALL: its CALL_BEGIN and CALL_ARGS were given */
} kv_chat_ev;
/* Receives events (pointers valid during the call); non-zero stops the push
 * and is returned by it. */
typedef int (*kv_chat_ev_fn)(void *ud, const kv_chat_ev *ev);

typedef struct kv_chat_parser kv_chat_parser;
/* A parser for s (copied). Returns 0 or KV_ENOMEM. Free with
 * kv_chat_parser_free (NULL is fine). One thread at a time. */
int kv_chat_parser_new(kv_chat_parser **out, const kv_chat_syntax *s);
void kv_chat_parser_free(kv_chat_parser *p);
/* Feeds text[0..n) and calls fn for every event now known; final: the
 * output ended (everything held comes out). Returns 0, KV_ENOMEM, or fn's
 * non-zero return. No push after a final one. */
int kv_chat_parser_push(kv_chat_parser *p, const char *text, size_t n, bool final, kv_chat_ev_fn fn, void *ud);
/* Tool calls given so far. */
uint32_t kv_chat_parser_calls(const kv_chat_parser *p);

#endif
