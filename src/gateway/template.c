/* The chat APIs' prompt: the model's own chat template (kvasir/chat.h)
 * rendered over the request, then tokenized.
 *
 * What the template sees (the variables llama.cpp and transformers give
 * it): `messages`, the request's messages in order, each its JSON object
 * as sent except that content given as text blocks is one string (the
 * blocks joined; content null or absent, as with a tool call and no text,
 * is ""), role "developer" is "system", and a tool call's
 * `function.arguments` given as a string of JSON is that JSON (an object,
 * as templates index it); Anthropic's top-level `system` is a first system
 * message. `tools` when the request has them, `add_generation_prompt`
 * (true unless the body says otherwise), and `bos_token` / `eos_token`,
 * the texts of the model's BOS and EOS tokens ("" when it has none).
 * Anthropic's blocks become OpenAI's shape: a tool_use block an entry of
 * the assistant message's `tool_calls` (its input the arguments object), a
 * thinking block its `reasoning_content`, each tool_result block a message
 * of role "tool" with `tool_call_id`, and Anthropic's tools OpenAI's
 * {"type":"function","function":{name, description, parameters}}. `tools`
 * are left out with tool_choice "none". The request's
 * `chat_template_kwargs` (and `enable_thinking` from Anthropic's thinking
 * or Ollama's think) are top-level variables too.
 *
 * Tokens: the rendering with the template's special tokens as their ids,
 * but a special token's text inside a client's string stays text wherever
 * that string (or it trimmed) appears verbatim in the rendering, as the
 * ChatML path keeps it (kv_tok_encode_spans): a client cannot end a turn
 * or open one by writing its marker. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gateway/gateway_internal.h"
#include "kvasir/chat.h"

struct kv_gw_tmpl {
    kv_chat_tmpl *t;        /* the parsed template */
    kv_chat_syntax syn;     /* its family's output syntax (kv_chat_detect) */
    int calls;              /* its tool-call text (KV_GW_CALLS_*) */
    char *bos, *eos;        /* texts of the model's BOS and EOS tokens ("" if none) */
    char name[128];         /* where it came from, for messages */
};

static char *kv_tok_text_dup(const kv_tok *tok, int32_t id) {
    if (!tok || id < 0) return strdup("");
    char buf[KV_TOK_MAX_TOKEN_BYTES];
    int n = kv_tok_piece(tok, id, true, buf, sizeof buf);
    if (n < 0) n = 0;
    if (n > (int)sizeof buf) n = (int)sizeof buf;
    char *s = malloc((size_t)n + 1);
    if (s) {
        memcpy(s, buf, (size_t)n);
        s[n] = 0;
    }
    return s;
}

int kv_gw_tmpl_open(kv_gw_tmpl **out, const kv_tok *tok, const char *src, size_t len, const char *name, kv_diag *d) {
    *out = NULL;
    kv_gw_tmpl *m = calloc(1, sizeof *m);
    if (!m) return kv_fail(d, KV_ENOMEM, "chat template: out of memory");
    snprintf(m->name, sizeof m->name, "%s", name ? name : "the chat template");
    /* a rendering is a prompt (at most a context of tokens), and renders
       run on every connection thread at once: tighter than the defaults */
    kv_chat_limits lim;
    kv_chat_limits_default(&lim);
    lim.max_output_bytes = KV_GW_TMPL_MAX_OUTPUT;
    lim.max_memory_bytes = KV_GW_TMPL_MAX_MEMORY;
    int rc = kv_chat_tmpl_parse(&m->t, src, len, &lim, d);
    if (rc) {
        kv_diag_prefix(d, rc, "chat template %s", m->name);
        kv_gw_tmpl_free(m);
        return rc;
    }
    kv_chat_detect(src, len, &m->syn);
    m->calls = m->syn.format;
    /* DeepSeek V3 and R1 write `function<｜tool▁sep｜>NAME` and fence the
       arguments (```json), V3.1 and later `NAME<｜tool▁sep｜>ARGS` */
    if (m->calls == KV_GW_CALLS_DEEPSEEK && memmem(src, len, "```json", 7)) m->calls = KV_GW_CALLS_DEEPSEEK_FENCED;
    m->bos = kv_tok_text_dup(tok, tok ? kv_tok_bos(tok) : -1);
    m->eos = kv_tok_text_dup(tok, tok ? kv_tok_eos(tok) : -1);
    if (!m->bos || !m->eos) {
        kv_gw_tmpl_free(m);
        return kv_fail(d, KV_ENOMEM, "chat template: out of memory");
    }
    *out = m;
    return 0;
}

void kv_gw_tmpl_free(kv_gw_tmpl *m) {
    if (!m) return;
    kv_chat_tmpl_free(m->t);
    free(m->bos);
    free(m->eos);
    free(m);
}

const char *kv_gw_tmpl_name(const kv_gw_tmpl *m) { return m->name; }

void kv_gw_tmpl_syntax(const kv_gw_tmpl *m, kv_chat_syntax *out) { *out = m->syn; }
int kv_gw_tmpl_calls(const kv_gw_tmpl *m) { return m->calls; }

/* A tool call's arguments as the template indexes them: a string holding
 * JSON becomes that JSON; anything else stays. */
static void kv_args_parsed(json_t *msg) {
    json_t *calls = json_object_get(msg, "tool_calls");
    size_t i;
    json_t *c;
    if (!json_is_array(calls)) return;
    json_array_foreach(calls, i, c) {
        json_t *f = json_object_get(c, "function");
        json_t *a = f ? json_object_get(f, "arguments") : NULL;
        if (!json_is_string(a)) continue;
        json_t *v = json_loadb(json_string_value(a), json_string_length(a), JSON_DECODE_ANY, NULL);
        if (v) json_object_set_new(f, "arguments", v);
    }
}

int kv_gw_tmpl_context(const kv_gw_tmpl *m, const kv_gw_params *p, json_t **out, kv_diag *d) {
    *out = NULL;
    json_t *ctx = json_object(), *msgs = p->tmpl_msgs ? json_deep_copy(p->tmpl_msgs) : json_array();
    if (!ctx || !msgs) goto oom;
    json_t *src = p->json ? json_object_get(p->json, "messages") : NULL;
    const size_t n_src = json_is_array(src) ? json_array_size(src) : 0;
    const size_t skip = p->n_msgs > n_src ? p->n_msgs - n_src : 0; /* Anthropic's system */
    for (size_t i = 0; !p->tmpl_msgs && i < p->n_msgs; i++) {
        json_t *orig = i >= skip ? json_array_get(src, i - skip) : NULL;
        const bool plain = p->api == KV_GW_ANTHROPIC || !json_is_object(orig);
        json_t *o = plain ? json_object() : json_deep_copy(orig);
        if (!o || json_array_append_new(msgs, o)) goto oom;
        if (json_object_set_new(o, "role", json_string(p->msgs[i].role))) goto oom;
        /* blocks joined; null or absent (a call without text) is "", as
           llama-server gives it: templates concatenate it */
        if (plain || !json_is_string(json_object_get(orig, "content")))
            if (json_object_set_new(o, "content", json_stringn(p->msgs[i].content, p->msgs[i].len))) goto oom;
        kv_args_parsed(o);
    }
    if (json_object_set_new(ctx, "messages", msgs)) {
        msgs = NULL;
        goto oom;
    }
    msgs = NULL;
    /* with tool_choice "none" the model is not told of the tools */
    if (p->tools && p->tool_choice != KV_GW_TOOLS_NONE) {
        json_t *tc = json_deep_copy(p->tools);
        if (!tc || json_object_set_new(ctx, "tools", tc)) goto oom;
    }
    if (p->kwargs && json_object_update(ctx, p->kwargs)) goto oom; /* none names the variables below */
    if (json_object_set_new(ctx, "add_generation_prompt", json_boolean(p->add_generation_prompt)) ||
        json_object_set_new(ctx, "bos_token", json_string(m->bos)) ||
        json_object_set_new(ctx, "eos_token", json_string(m->eos)))
        goto oom;
    *out = ctx;
    return 0;
oom:
    json_decref(msgs);
    json_decref(ctx);
    return kv_fail(d, KV_ENOMEM, "chat template: out of memory");
}

int kv_gw_tmpl_render(const kv_gw_tmpl *m, const kv_gw_params *p, char **out, size_t *n, kv_diag *d) {
    *out = NULL;
    *n = 0;
    json_t *ctx = NULL;
    int rc = kv_gw_tmpl_context(m, p, &ctx, d);
    if (rc) return rc;
    const kv_chat_render_opts ro = {.now_unix = (int64_t)time(NULL)};
    rc = kv_chat_render(m->t, ctx, &ro, out, n, d);
    json_decref(ctx);
    return rc;
}

/* Adds the spans where s (and s trimmed of ASCII whitespace) occurs in
 * text[0..n). Returns 0 or KV_ENOMEM. */
static int kv_spans_of(const char *text, size_t n, const char *s, size_t sl, kv_tok_span **sp, size_t *ns,
                       size_t *cap) {
    for (int pass = 0; pass < 2; pass++) {
        const char *a = s;
        size_t al = sl;
        if (pass == 1) {
            while (al && strchr(" \t\r\n", *a)) a++, al--;
            while (al && strchr(" \t\r\n", a[al - 1])) al--;
            if (al == sl) break;
        }
        if (!al) continue;
        for (const char *at = text; (size_t)(at - text) + al <= n;) {
            const char *hit = memmem(at, n - (size_t)(at - text), a, al);
            if (!hit) break;
            if (*ns == *cap) {
                const size_t nc = *cap ? 2 * *cap : 16;
                kv_tok_span *g = realloc(*sp, nc * sizeof *g);
                if (!g) return KV_ENOMEM;
                *sp = g;
                *cap = nc;
            }
            (*sp)[(*ns)++] = (kv_tok_span){(size_t)(hit - text), al};
            at = hit + al;
        }
    }
    return 0;
}

/* Every string inside j (keys too) that holds a special token's text. */
static int kv_spans_json(const kv_tok *tok, const char *text, size_t n, json_t *j, kv_tok_span **sp, size_t *ns,
                         size_t *cap, int depth) {
    if (depth > 64) return 0; /* jansson bounds the depth of a body already */
    if (json_is_string(j)) {
        const char *s = json_string_value(j);
        const size_t sl = json_string_length(j);
        return kv_tok_has_special(tok, s, sl) ? kv_spans_of(text, n, s, sl, sp, ns, cap) : 0;
    }
    int rc = 0;
    if (json_is_array(j)) {
        size_t i;
        json_t *v;
        json_array_foreach(j, i, v) if (!rc) rc = kv_spans_json(tok, text, n, v, sp, ns, cap, depth + 1);
    } else if (json_is_object(j)) {
        const char *k;
        json_t *v;
        json_object_foreach(j, k, v) {
            if (!rc && kv_tok_has_special(tok, k, strlen(k))) rc = kv_spans_of(text, n, k, strlen(k), sp, ns, cap);
            if (!rc) rc = kv_spans_json(tok, text, n, v, sp, ns, cap, depth + 1);
        }
    }
    return rc;
}

int kv_gw_tmpl_encode(const kv_tok *tok, const kv_gw_params *p, const char *text, size_t n, int32_t *ids,
                      size_t cap, size_t *n_ids, kv_diag *d) {
    kv_tok_span *sp = NULL;
    size_t ns = 0, scap = 0;
    int rc = 0;
    /* the client's strings: the body's (what the template may print), and
       the joined contents (text blocks) */
    if (p->json) rc = kv_spans_json(tok, text, n, p->json, &sp, &ns, &scap, 0);
    for (size_t i = 0; !rc && i < p->n_msgs; i++)
        if (p->joined[i] && kv_tok_has_special(tok, p->msgs[i].content, p->msgs[i].len))
            rc = kv_spans_of(text, n, p->msgs[i].content, p->msgs[i].len, &sp, &ns, &scap);
    if (rc) {
        free(sp);
        return kv_fail(d, KV_ENOMEM, "chat template: out of memory");
    }
    rc = kv_tok_encode_spans(tok, text, n, true, sp, ns, ids, cap, n_ids, d);
    free(sp);
    return rc;
}
