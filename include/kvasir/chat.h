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

#endif
