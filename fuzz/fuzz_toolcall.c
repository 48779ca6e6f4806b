/* libFuzzer target for the output parser (src/chat/toolcall.c): the first
 * byte picks the family and switches (think, think_open, tools, one call at
 * most, arguments streamed), the second where the rest is cut in two; the
 * rest is the model's text. Pushed whole and in two pieces, the events must
 * agree (content, reasoning, calls and argument fragments joined), every
 * call's arguments must be a JSON object (a streamed one: exactly its
 * fragments joined), and there must be at most KV_CHAT_MAX_CALLS calls. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/chat.h"

typedef struct acc {
    char *s;             /* every event, tagged, joined */
    size_t n, cap;
    char last;           /* the tag of the last event */
    uint32_t calls;
    char frag[1 << 16];  /* the open streamed call's fragments joined (cut past the size: not compared) */
    size_t n_frag;
    bool frag_over, begun;
} acc;

static void put(acc *a, char tag, const char *s, size_t n) {
    if (a->n + n + 1 > a->cap) {
        size_t nc = (a->cap + n + 1) * 2;
        char *p = realloc(a->s, nc);
        if (!p) abort();
        a->s = p;
        a->cap = nc;
    }
    if (tag != a->last || tag == 'C' || tag == 'A') a->s[a->n++] = tag; /* a run of text is one */
    a->last = tag;
    memcpy(a->s + a->n, s, n);
    a->n += n;
}

static int on_ev(void *ud, const kv_chat_ev *ev) {
    acc *a = ud;
    if (ev->type == KV_CHAT_EV_CALL_BEGIN) {
        if (a->begun || ev->index != a->calls) abort();
        a->begun = true;
        a->n_frag = 0;
        a->frag_over = false;
        put(a, 'b', ev->name, strlen(ev->name));
        return 0;
    }
    if (ev->type == KV_CHAT_EV_CALL_ARGS) {
        if (!a->begun || ev->index != a->calls) abort();
        if (a->n_frag + ev->n <= sizeof a->frag) memcpy(a->frag + a->n_frag, ev->text, ev->n);
        else a->frag_over = true;
        a->n_frag += ev->n;
        put(a, 'f', ev->text, ev->n);
        return 0;
    }
    if (ev->type == KV_CHAT_EV_CALL) {
        if (ev->index != a->calls || ev->streamed != a->begun) abort();
        if (ev->streamed) { /* its arguments: the fragments given */
            if (ev->args_len != a->n_frag || (!a->frag_over && memcmp(ev->args, a->frag, a->n_frag))) abort();
            a->begun = false;
        } else {
            json_t *j = json_loadb(ev->args, ev->args_len, JSON_ALLOW_NUL, NULL);
            if (!json_is_object(j)) abort();
            json_decref(j);
        }
        a->calls++;
        put(a, 'C', ev->name, strlen(ev->name));
        put(a, 'A', ev->args, ev->args_len);
        return 0;
    }
    put(a, ev->type == KV_CHAT_EV_CONTENT ? 'c' : 'r', ev->text, ev->n);
    return 0;
}

static void run(const kv_chat_syntax *s, const uint8_t *d, size_t n, size_t cut, acc *a) {
    kv_chat_parser *p = NULL;
    if (kv_chat_parser_new(&p, s)) abort();
    if (kv_chat_parser_push(p, (const char *)d, cut, false, on_ev, a)) abort();
    if (kv_chat_parser_push(p, (const char *)d + cut, n - cut, true, on_ev, a)) abort();
    if (kv_chat_parser_calls(p) != a->calls || a->calls > KV_CHAT_MAX_CALLS) abort();
    kv_chat_parser_free(p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    const uint8_t f = data[0];
    kv_chat_syntax s = {.format = (f & 3) % KV_CHAT_FMT_COUNT, .think = f & 4, .think_open = f & 8,
                        .tools = f & 16, .max_calls = (f & 32) ? 1 : 0, .stream_args = f & 64};
    const uint8_t *d = data + 2;
    const size_t n = size - 2, cut = n ? data[1] % (n + 1) : 0;
    acc whole = {0}, split = {0};
    run(&s, d, n, n, &whole);
    run(&s, d, n, cut, &split);
    if (whole.n != split.n || (whole.n && memcmp(whole.s, split.s, whole.n))) abort();
    free(whole.s);
    free(split.s);
    return 0;
}
