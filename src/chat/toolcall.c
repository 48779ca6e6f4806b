/* The model's output split into content, reasoning and tool calls
 * (kvasir/chat.h says what comes out). One state machine for every family:
 * a family is its table of markers, what each does in each mode, and the
 * parser of a call's body.
 *
 * Invariants: `buf` holds the text not yet given out; in CONTENT and
 * REASONING it is at most a marker's length plus a run of whitespace (the
 * rest went out), in CALL at most KV_CHAT_MAX_CALL_BYTES plus the piece
 * being pushed, in HEADER at most KV_CHAT_MAX_HEADER. Whether text goes out
 * depends only on the text after it up to the next marker, never on where
 * the pushes were cut, so pieces give the events of the whole. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/chat.h"

#define KV_CHAT_MAX_HEADER 512u /* bytes of a harmony message header */

enum { M_CONTENT = 0, M_REASON, M_CALL, M_HEADER };
enum { A_THINK_OPEN = 1, A_THINK_CLOSE, A_CALL_OPEN, A_CALL_CLOSE, A_DROP, A_HEADER, A_H_END, A_H_BODY };

typedef struct kv_marker {
    const char *text;
    int action;            /* A_* */
    unsigned modes;        /* 1 << M_* where it acts */
    int need;              /* 0 always, 1 with think, 2 with tools */
} kv_marker;

#define MC (1u << M_CONTENT)
#define MR (1u << M_REASON)
#define ML (1u << M_CALL)
#define MH (1u << M_HEADER)

static const kv_marker kv_hermes[] = {
    {"<think>", A_THINK_OPEN, MC, 1},
    {"</think>", A_THINK_CLOSE, MR, 1},
    {"<tool_call>", A_CALL_OPEN, MC, 2},
    {"</tool_call>", A_CALL_CLOSE, ML, 2},
    {NULL, 0, 0, 0},
};
static const kv_marker kv_deepseek[] = {
    {"<think>", A_THINK_OPEN, MC, 1},
    {"</think>", A_THINK_CLOSE, MR, 1},
    {"<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "begin\xef\xbd\x9c>", A_DROP, MC, 2},
    {"<\xef\xbd\x9ctool\xe2\x96\x81" "calls\xe2\x96\x81" "end\xef\xbd\x9c>", A_DROP, MC, 2},
    {"<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "begin\xef\xbd\x9c>", A_CALL_OPEN, MC, 2},
    {"<\xef\xbd\x9ctool\xe2\x96\x81" "call\xe2\x96\x81" "end\xef\xbd\x9c>", A_CALL_CLOSE, ML, 2},
    {NULL, 0, 0, 0},
};
static const kv_marker kv_harmony[] = {
    {"<|channel|>", A_HEADER, MC | MR, 0},
    {"<|start|>", A_HEADER, MC | MR, 0},
    {"<|end|>", A_H_END, MC | MR | ML, 0},
    {"<|return|>", A_H_END, MC | MR | ML, 0},
    {"<|call|>", A_H_END, MC | MR | ML, 0},
    {"<|message|>", A_H_BODY, MH, 0},
    {NULL, 0, 0, 0},
};
static const kv_marker *const kv_markers[KV_CHAT_FMT_COUNT] = {kv_hermes, kv_deepseek, kv_harmony};

struct kv_chat_parser {
    kv_chat_syntax s;      /* tools_json: our reference */
    int mode;              /* M_* */
    bool skip_ws;          /* drop whitespace before the next text (a marker just went) */
    bool ended;            /* a final push was made */
    char *buf;             /* [len] text not given out yet */
    size_t len, cap;
    char opener[KV_CHAT_MAX_HEADER + 64]; /* what opened the CALL or HEADER being read (a marker, or
                                             a harmony header and its <|message|>), for a block
                                             that is not a call */
    char hname[KV_CHAT_MAX_NAME + 1]; /* harmony: the function the open message is to */
    uint32_t n_calls;
    /* stream_args: the open call's arguments as they come */
    struct {
        int phase;          /* 0: looking for the name and the arguments' start; 1: in them; 2: done */
        size_t at;          /* next byte of buf to scan */
        char name[KV_CHAT_MAX_NAME + 1];
        char *args;         /* [len] the arguments so far, whitespace outside strings left out */
        size_t len, cap;
        uint32_t depth;     /* open objects and arrays */
        bool in_str, esc;
        bool begun;         /* CALL_BEGIN was given */
    } as;
    kv_chat_ev_fn fn;      /* the push's */
    void *ud;
};

static bool kv_is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static bool kv_active(const kv_chat_parser *p, const kv_marker *m) {
    if (!(m->modes & (1u << p->mode))) return false;
    if (m->need == 1 && !p->s.think) return false;
    if (m->need == 2 && !p->s.tools) return false;
    return true;
}

void kv_chat_detect(const char *t, size_t n, kv_chat_syntax *out) {
    memset(out, 0, sizeof *out);
    out->format = KV_CHAT_FMT_HERMES;
    if (!t) return;
    if (memmem(t, n, "<|channel|>", 11)) {
        out->format = KV_CHAT_FMT_HARMONY;
        out->think = true;
        return;
    }
    if (memmem(t, n, "tool\xe2\x96\x81" "call\xe2\x96\x81" "begin", 16)) out->format = KV_CHAT_FMT_DEEPSEEK;
    out->think = memmem(t, n, "<think>", 7) != NULL;
}

bool kv_chat_prompt_thinks(const char *s, size_t n) {
    while (n && kv_is_ws(s[n - 1])) n--;
    return n >= 7 && !memcmp(s + n - 7, "<think>", 7);
}

int kv_chat_parser_new(kv_chat_parser **out, const kv_chat_syntax *s) {
    *out = NULL;
    kv_chat_parser *p = calloc(1, sizeof *p);
    if (!p) return KV_ENOMEM;
    p->s = *s;
    if (p->s.format < 0 || p->s.format >= KV_CHAT_FMT_COUNT) p->s.format = KV_CHAT_FMT_HERMES;
    p->s.tools_json = s->tools_json ? json_deep_copy(s->tools_json) : NULL;
    if (s->tools_json && !p->s.tools_json) {
        free(p);
        return KV_ENOMEM;
    }
    p->mode = s->think_open && (s->think || s->format == KV_CHAT_FMT_HARMONY) ? M_REASON : M_CONTENT;
    p->skip_ws = p->mode == M_REASON;
    *out = p;
    return 0;
}

void kv_chat_parser_free(kv_chat_parser *p) {
    if (!p) return;
    json_decref((json_t *)p->s.tools_json);
    free(p->as.args);
    free(p->buf);
    free(p);
}

uint32_t kv_chat_parser_calls(const kv_chat_parser *p) { return p->n_calls; }

static int kv_emit(kv_chat_parser *p, int type, const char *s, size_t n) {
    if (!n) return 0;
    const kv_chat_ev ev = {.type = type, .text = s, .n = n};
    return p->fn(p->ud, &ev);
}

static void kv_consume(kv_chat_parser *p, size_t k) {
    memmove(p->buf, p->buf + k, p->len - k);
    p->len -= k;
}

/* ---- a call's body -------------------------------------------------------- */

static bool kv_name_ok(const char *s, size_t n) {
    if (!n || n > KV_CHAT_MAX_NAME) return false;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 || s[i] == '<' || s[i] == '>' || kv_is_ws(s[i])) return false;
    return true;
}

static void kv_trim(const char **s, size_t *n) {
    while (*n && kv_is_ws(**s)) (*s)++, (*n)--;
    while (*n && kv_is_ws((*s)[*n - 1])) (*n)--;
}

/* v as an object (v itself, or the object a string of JSON holds); NULL if
 * it is neither. New reference. */
static json_t *kv_args_of(json_t *v) {
    if (json_is_object(v)) return json_incref(v);
    if (json_is_string(v)) {
        json_t *o = json_loadb(json_string_value(v), json_string_length(v), JSON_REJECT_DUPLICATES, NULL);
        if (json_is_object(o)) return o;
        json_decref(o);
    }
    return NULL;
}

/* The declared JSON-schema type of parameter key of function name, or NULL. */
static const char *kv_param_type(const kv_chat_parser *p, const char *name, size_t nl, const char *key, size_t kl) {
    size_t i;
    json_t *t;
    if (!json_is_array(p->s.tools_json)) return NULL;
    json_array_foreach((json_t *)p->s.tools_json, i, t) {
        json_t *f = json_object_get(t, "function");
        json_t *fn = json_object_get(f, "name");
        if (!json_is_string(fn) || json_string_length(fn) != nl || memcmp(json_string_value(fn), name, nl)) continue;
        json_t *props = json_object_get(json_object_get(f, "parameters"), "properties");
        json_t *pr = props ? json_object_getn(props, key, kl) : NULL;
        json_t *ty = json_object_get(pr, "type");
        return json_is_string(ty) ? json_string_value(ty) : NULL;
    }
    return NULL;
}

/* Qwen3.5's `<function=NAME>` (`<parameter=K>\nV\n</parameter>`)* `</function>`:
 * a value is JSON when it parses as such and its schema type is not
 * "string", else the text. */
static int kv_body_xml(const kv_chat_parser *p, const char *s, size_t n, char *name, json_t **args) {
    if (n < 10 || memcmp(s, "<function=", 10)) return -1;
    s += 10, n -= 10;
    const char *gt = memchr(s, '>', n);
    if (!gt || !kv_name_ok(s, (size_t)(gt - s))) return -1;
    const size_t nl = (size_t)(gt - s);
    memcpy(name, s, nl);
    name[nl] = 0;
    n -= nl + 1, s = gt + 1;
    json_t *o = json_object();
    if (!o) return KV_ENOMEM;
    for (;;) {
        kv_trim(&s, &n);
        if (n == 11 && !memcmp(s, "</function>", 11)) break;
        if (n < 11 || memcmp(s, "<parameter=", 11)) goto bad;
        s += 11, n -= 11;
        const char *kg = memchr(s, '>', n);
        if (!kg || kg == s) goto bad;
        const char *key = s;
        const size_t kl = (size_t)(kg - s);
        for (size_t i = 0; i < kl; i++) /* a key is one line of text: NUL or a control byte is no call */
            if ((unsigned char)key[i] < 0x20) goto bad;
        s = kg + 1, n -= kl + 1;
        const char *end = memmem(s, n, "</parameter>", 12);
        if (!end) goto bad;
        const char *v = s;
        size_t vl = (size_t)(end - s);
        if (vl && v[0] == '\n') v++, vl--;
        if (vl && v[vl - 1] == '\n') vl--;
        const char *ty = kv_param_type(p, name, nl, key, kl);
        json_t *jv = ty && !strcmp(ty, "string") ? NULL
                   : json_loadb(v, vl, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, NULL);
        if (!jv) jv = json_stringn(v, vl);
        if (!jv || json_object_setn_new(o, key, kl, jv)) goto bad;
        n -= (size_t)(end - s) + 12, s = end + 12;
    }
    *args = o;
    return 0;
bad:
    json_decref(o);
    return -1;
}

/* {"name": NAME, "arguments": {...}} (arguments may be a string of JSON). */
static int kv_body_json(const char *s, size_t n, char *name, json_t **args) {
    json_t *j = json_loadb(s, n, JSON_REJECT_DUPLICATES, NULL);
    json_t *nm = json_object_get(j, "name");
    json_t *a = json_object_get(j, "arguments");
    int rc = -1;
    if (json_is_string(nm) && kv_name_ok(json_string_value(nm), json_string_length(nm))) {
        *args = a ? kv_args_of(a) : json_object();
        if (*args) {
            memcpy(name, json_string_value(nm), json_string_length(nm) + 1);
            rc = 0;
        }
    }
    json_decref(j);
    return rc;
}

/* DeepSeek V3/R1: `function<｜tool▁sep｜>NAME\n```json\nARGS\n```` and
 * V3.1: `NAME<｜tool▁sep｜>ARGS`. */
static int kv_body_deepseek(const char *s, size_t n, char *name, json_t **args) {
    static const char sep[] = "<\xef\xbd\x9ctool\xe2\x96\x81sep\xef\xbd\x9c>";
    const size_t sl = sizeof sep - 1;
    const char *at = memmem(s, n, sep, sl);
    if (!at) return -1;
    const char *a;
    size_t al;
    if (at - s == 8 && !memcmp(s, "function", 8)) {
        const char *nm = at + sl;
        const char *nl = memchr(nm, '\n', n - (size_t)(nm - s));
        if (!nl || !kv_name_ok(nm, (size_t)(nl - nm))) return -1;
        memcpy(name, nm, (size_t)(nl - nm));
        name[nl - nm] = 0;
        a = nl + 1;
        al = n - (size_t)(a - s);
        kv_trim(&a, &al);
        if (al >= 7 && !memcmp(a, "```json", 7)) a += 7, al -= 7;
        else if (al >= 3 && !memcmp(a, "```", 3)) a += 3, al -= 3;
        if (al >= 3 && !memcmp(a + al - 3, "```", 3)) al -= 3;
    } else {
        const char *nm = s;
        size_t nml = (size_t)(at - s);
        kv_trim(&nm, &nml);
        if (!kv_name_ok(nm, nml)) return -1;
        memcpy(name, nm, nml);
        name[nml] = 0;
        a = at + sl;
        al = n - (size_t)(a - s);
    }
    json_t *j = json_loadb(a, al, JSON_REJECT_DUPLICATES, NULL);
    *args = json_is_object(j) ? j : NULL;
    if (!*args) json_decref(j);
    return *args ? 0 : -1;
}

/* The call in body[0..n): *ok and emitted, or !*ok when it is not a call
 * (the caller gives the block as content). Returns 0, KV_ENOMEM or fn's. */
static int kv_call(kv_chat_parser *p, const char *body, size_t n, bool *ok) {
    *ok = false;
    if (p->n_calls >= (p->s.max_calls && p->s.max_calls < KV_CHAT_MAX_CALLS ? p->s.max_calls : KV_CHAT_MAX_CALLS))
        return 0;
    char name[KV_CHAT_MAX_NAME + 1];
    json_t *args = NULL;
    const char *b = body;
    size_t bl = n;
    kv_trim(&b, &bl);
    int rc;
    if (p->s.format == KV_CHAT_FMT_HARMONY) {
        memcpy(name, p->hname, sizeof name);
        json_t *j = json_loadb(b, bl, JSON_REJECT_DUPLICATES, NULL);
        args = json_is_object(j) ? j : NULL;
        if (!args) json_decref(j);
        rc = args ? 0 : -1;
    } else if (p->s.format == KV_CHAT_FMT_DEEPSEEK) {
        rc = kv_body_deepseek(b, bl, name, &args);
    } else {
        rc = bl && b[0] == '<' ? kv_body_xml(p, b, bl, name, &args) : kv_body_json(b, bl, name, &args);
    }
    if (rc) return 0;
    /* a streamed call: its arguments are the text given (they parse: args did) */
    const bool streamed = p->as.begun && p->as.phase == 2 && !strcmp(name, p->as.name);
    if (p->as.begun && !streamed) {
        json_decref(args);
        return 0; /* given as streamed (the caller's kv_step_block), not as another reading */
    }
    char *txt = streamed ? strdup(p->as.args) : json_dumps(args, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(args);
    if (!txt) return KV_ENOMEM;
    const kv_chat_ev ev = {.type = KV_CHAT_EV_CALL, .index = p->n_calls, .name = name, .args = txt,
                           .args_len = strlen(txt), .streamed = streamed};
    p->n_calls++;
    *ok = true;
    rc = p->fn(p->ud, &ev);
    free(txt);
    return rc;
}

/* A block that is not a call: its opener, its text (and closer) as content. */
static int kv_not_call(kv_chat_parser *p, const char *body, size_t n, const char *closer) {
    int rc = kv_emit(p, KV_CHAT_EV_CONTENT, p->opener, strlen(p->opener));
    if (!rc) rc = kv_emit(p, KV_CHAT_EV_CONTENT, body, n);
    if (!rc && closer) rc = kv_emit(p, KV_CHAT_EV_CONTENT, closer, strlen(closer));
    return rc;
}

/* ---- harmony headers -------------------------------------------------------- */

/* The header (opener + h[0..n)) of a message decides what its body is. */
static void kv_header(kv_chat_parser *p, const char *h, size_t n) {
    char hb[KV_CHAT_MAX_HEADER + 64];
    size_t ol = strlen(p->opener);
    memcpy(hb, p->opener, ol);
    memcpy(hb + ol, h, n);
    hb[ol + n] = 0;
    memcpy(p->opener, hb, ol + n);
    memcpy(p->opener + ol + n, "<|message|>", 12);
    const char *ch = NULL;
    for (const char *c = hb; (c = strstr(c, "<|channel|>")); c += 11) ch = c + 11;
    const char *to = strstr(hb, "to=functions.");
    p->hname[0] = 0;
    if (to) {
        to += 13;
        size_t k = 0;
        while (to[k] && !kv_is_ws(to[k]) && to[k] != '<' && k < KV_CHAT_MAX_NAME) k++;
        if (kv_name_ok(to, k)) {
            memcpy(p->hname, to, k);
            p->hname[k] = 0;
        }
    }
    p->mode = M_CONTENT;
    if (p->hname[0] && p->s.tools) p->mode = M_CALL;
    else if (ch && !strncmp(ch, "analysis", 8)) p->mode = M_REASON;
    p->skip_ws = p->mode == M_REASON;
}

/* ---- the machine ------------------------------------------------------------ */

/* The earliest active marker in buf, or NULL; *at its offset. */
static const kv_marker *kv_find(const kv_chat_parser *p, size_t *at) {
    const kv_marker *best = NULL;
    for (const kv_marker *m = kv_markers[p->s.format]; m->text; m++) {
        if (!kv_active(p, m)) continue;
        const char *h = memmem(p->buf, p->len, m->text, strlen(m->text));
        if (h && (!best || (size_t)(h - p->buf) < *at)) {
            best = m;
            *at = (size_t)(h - p->buf);
        }
    }
    return best;
}

/* Bytes at the end of buf that may start an active marker. */
static size_t kv_partial(const kv_chat_parser *p) {
    size_t keep = 0;
    for (const kv_marker *m = kv_markers[p->s.format]; m->text; m++) {
        if (!kv_active(p, m)) continue;
        const size_t ml = strlen(m->text);
        for (size_t k = ml - 1 < p->len ? ml - 1 : p->len; k > keep; k--)
            if (!memcmp(p->buf + p->len - k, m->text, k)) {
                keep = k;
                break;
            }
    }
    return keep;
}

static int kv_step_text(kv_chat_parser *p, bool *more) {
    const int type = p->mode == M_REASON ? KV_CHAT_EV_REASONING : KV_CHAT_EV_CONTENT;
    if (p->skip_ws) {
        size_t k = 0;
        while (k < p->len && kv_is_ws(p->buf[k])) k++;
        kv_consume(p, k);
        if (!p->len) return 0;
        p->skip_ws = false;
    }
    size_t at = 0;
    const kv_marker *m = kv_find(p, &at);
    if (!m) {
        size_t safe = p->len - (p->ended ? 0 : kv_partial(p));
        /* whitespace before a marker is dropped: held until known */
        if (!p->ended || p->mode == M_REASON)
            while (safe && kv_is_ws(p->buf[safe - 1])) safe--;
        int rc = kv_emit(p, type, p->buf, safe);
        if (p->ended) p->len = 0;
        else kv_consume(p, safe);
        return rc;
    }
    size_t tl = at;
    while (tl && kv_is_ws(p->buf[tl - 1])) tl--;
    int rc = kv_emit(p, type, p->buf, tl);
    if (rc) return rc;
    kv_consume(p, at + strlen(m->text));
    *more = true;
    p->skip_ws = true;
    switch (m->action) {
    case A_THINK_OPEN: p->mode = M_REASON; break;
    case A_THINK_CLOSE: p->mode = M_CONTENT; break;
    case A_CALL_OPEN:
    case A_HEADER:
        p->mode = m->action == A_CALL_OPEN ? M_CALL : M_HEADER;
        snprintf(p->opener, sizeof p->opener, "%s", m->text);
        p->skip_ws = false;
        break;
    case A_H_END: p->mode = M_CONTENT; break;
    default: break; /* A_DROP */
    }
    return 0;
}

/* ---- a call's arguments as they come (stream_args) ------------------------- */

/* pat starting at an offset in [from, from + w) of b[0..len): 1 with *hit,
 * 0 while that window is not all there, -1 when it is and pat is not in it
 * (so the answer never depends on how the text came in pieces). */
static int kv_win(const char *b, size_t len, size_t from, size_t w, const char *pat, const char **hit) {
    const size_t pl = strlen(pat), need = from + w - 1 + pl;
    const size_t have = len < need ? len : need;
    const char *h = have > from ? memmem(b + from, have - from, pat, pl) : NULL;
    if (h) {
        *hit = h;
        return 1;
    }
    return len >= need ? -1 : 0;
}

/* Where the open call's name and arguments are in buf[0..len) as the
 * family writes them: 1 with the name copied and *start the offset of the
 * arguments' '{', 0 while not known yet, -1 when the body is not of that
 * shape (then nothing is streamed). Each step looks in a bounded window
 * only, so a body that is not of the shape is known soon. */
static int kv_args_start(kv_chat_parser *p, size_t *start) {
    const char *b = p->buf, *end = p->buf + p->len;
    const size_t len = p->len;
    const char *nm = NULL, *a = NULL, *h = NULL;
    size_t nl = 0;
    int r;
    if (p->s.format == KV_CHAT_FMT_HARMONY) {
        nm = p->hname;
        nl = strlen(p->hname);
        a = b;
    } else if (p->s.format == KV_CHAT_FMT_DEEPSEEK) {
        static const char sep[] = "<\xef\xbd\x9ctool\xe2\x96\x81sep\xef\xbd\x9c>";
        if ((r = kv_win(b, len, 0, KV_CHAT_MAX_NAME + 9, sep, &h)) <= 0) return r;
        if (h - b == 8 && !memcmp(b, "function", 8)) { /* V3/R1: NAME, then the arguments fenced */
            nm = h + sizeof sep - 1;
            const char *nlp = NULL;
            if ((r = kv_win(b, len, (size_t)(nm - b), KV_CHAT_MAX_NAME + 1, "\n", &nlp)) <= 0) return r;
            nl = (size_t)(nlp - nm);
            const char *f = NULL;
            if ((r = kv_win(b, len, (size_t)(nlp - b), 16, "```json", &f)) <= 0) return r;
            a = f + 7;
        } else {
            nm = b;
            nl = (size_t)(h - b);
            a = h + sizeof sep - 1;
        }
    } else { /* Qwen's JSON: {"name": "NAME", "arguments": ARGS} */
        const char *k = NULL, *q = NULL, *qe = NULL, *ak = NULL;
        if ((r = kv_win(b, len, 0, 16, "\"name\"", &k)) <= 0) return r;
        if ((r = kv_win(b, len, (size_t)(k - b) + 6, 8, "\"", &q)) <= 0) return r;
        nm = q + 1;
        if ((r = kv_win(b, len, (size_t)(nm - b), KV_CHAT_MAX_NAME + 1, "\"", &qe)) <= 0) return r;
        nl = (size_t)(qe - nm);
        if ((r = kv_win(b, len, (size_t)(qe - b) + 1, 16, "\"arguments\"", &ak)) <= 0) return r;
        if ((r = kv_win(b, len, (size_t)(ak - b) + 11, 8, ":", &a)) <= 0) return r;
        a++;
    }
    while (a < end && kv_is_ws(*a)) a++;
    if (a == end) return 0;
    if (*a != '{' || !kv_name_ok(nm, nl)) return -1;
    memcpy(p->as.name, nm, nl);
    p->as.name[nl] = 0;
    *start = (size_t)(a - b);
    return 1;
}

/* Scans buf[as.at..n) of the open call: gives CALL_BEGIN once its name is
 * known and CALL_ARGS for what the arguments grew by. Returns 0, KV_ENOMEM
 * or fn's. */
static int kv_args_scan(kv_chat_parser *p, size_t n) {
    const uint32_t max = p->s.max_calls && p->s.max_calls < KV_CHAT_MAX_CALLS ? p->s.max_calls : KV_CHAT_MAX_CALLS;
    if (p->as.phase == 0 && p->n_calls >= max) p->as.phase = 2; /* past the calls given: content, not streamed */
    if (p->as.phase == 0) {
        size_t start = 0;
        const int r = kv_args_start(p, &start);
        if (r < 0) p->as.phase = 2;
        if (r <= 0) return 0;
        p->as.phase = 1;
        p->as.at = start;
        p->as.begun = true;
        const kv_chat_ev ev = {.type = KV_CHAT_EV_CALL_BEGIN, .index = p->n_calls, .name = p->as.name};
        const int rc = p->fn(p->ud, &ev);
        if (rc) return rc;
    }
    if (p->as.phase != 1 || p->as.at >= n) return 0;
    if (p->as.len + (n - p->as.at) + 1 > p->as.cap) {
        size_t nc = p->as.cap ? p->as.cap : 256;
        while (nc < p->as.len + (n - p->as.at) + 1) nc *= 2;
        char *na = realloc(p->as.args, nc);
        if (!na) return KV_ENOMEM;
        p->as.args = na;
        p->as.cap = nc;
    }
    const size_t from = p->as.len;
    for (; p->as.at < n && p->as.phase == 1; p->as.at++) {
        const char c = p->buf[p->as.at];
        if (p->as.in_str) {
            if (p->as.esc) p->as.esc = false;
            else if (c == '\\') p->as.esc = true;
            else if (c == '"') p->as.in_str = false;
        } else if (kv_is_ws(c)) {
            continue;
        } else if (c == '"') {
            p->as.in_str = true;
        } else if (c == '{' || c == '[') {
            p->as.depth++;
        } else if ((c == '}' || c == ']') && p->as.depth) {
            if (--p->as.depth == 0) p->as.phase = 2; /* the arguments' object is whole */
        }
        p->as.args[p->as.len++] = c;
    }
    p->as.args[p->as.len] = 0;
    if (p->as.len == from) return 0;
    const kv_chat_ev ev = {.type = KV_CHAT_EV_CALL_ARGS, .index = p->n_calls, .text = p->as.args + from,
                           .n = p->as.len - from};
    return p->fn(p->ud, &ev);
}

static int kv_step_block(kv_chat_parser *p, bool *more) {
    size_t at = 0;
    const kv_marker *m = kv_find(p, &at);
    if (p->mode == M_HEADER) {
        if (m && at <= KV_CHAT_MAX_HEADER) { /* (a longer one is no header, as when it came in pieces) */
            kv_header(p, p->buf, at);
            kv_consume(p, at + strlen(m->text));
            *more = true;
            return 0;
        }
        if (p->len > KV_CHAT_MAX_HEADER || p->ended) { /* not a header after all */
            int rc = kv_not_call(p, p->buf, p->len, NULL);
            p->len = 0;
            p->mode = M_CONTENT;
            return rc;
        }
        return 0;
    }
    const bool closed = m != NULL || (p->ended && p->s.format == KV_CHAT_FMT_HARMONY);
    const size_t n = m ? at : p->len;
    if (p->s.stream_args && p->s.tools && n <= KV_CHAT_MAX_CALL_BYTES) {
        const int src = kv_args_scan(p, n);
        if (src) return src;
    }
    if (!closed && !p->ended && p->len <= KV_CHAT_MAX_CALL_BYTES) return 0;
    bool ok = false;
    int rc = closed && n <= KV_CHAT_MAX_CALL_BYTES ? kv_call(p, p->buf, n, &ok) : 0;
    if (!rc && !ok && p->as.begun) { /* cut inside a streamed call: given as far as it went, as it was streamed */
        const kv_chat_ev ev = {.type = KV_CHAT_EV_CALL, .index = p->n_calls++, .name = p->as.name,
                               .args = p->as.args ? p->as.args : "", .args_len = p->as.len, .streamed = true};
        rc = p->fn(p->ud, &ev);
    } else if (!rc && !ok) {
        rc = kv_not_call(p, p->buf, n, m ? m->text : NULL);
    }
    free(p->as.args);
    memset(&p->as, 0, sizeof p->as);
    kv_consume(p, m ? at + strlen(m->text) : n);
    p->mode = M_CONTENT;
    p->skip_ws = ok; /* a block given as content keeps the text after it as it is */
    *more = true;
    return rc;
}

int kv_chat_parser_push(kv_chat_parser *p, const char *text, size_t n, bool final, kv_chat_ev_fn fn, void *ud) {
    if (p->ended) return 0;
    if (p->len + n + 1 > p->cap) {
        size_t nc = p->cap ? p->cap : 256;
        while (nc < p->len + n + 1) nc *= 2;
        char *nb = realloc(p->buf, nc);
        if (!nb) return KV_ENOMEM;
        p->buf = nb;
        p->cap = nc;
    }
    memcpy(p->buf + p->len, text, n);
    p->len += n;
    p->ended = final;
    p->fn = fn;
    p->ud = ud;
    bool more = true;
    int rc = 0;
    while (more && !rc) {
        more = false;
        rc = p->mode == M_CALL || p->mode == M_HEADER ? kv_step_block(p, &more) : kv_step_text(p, &more);
        if (p->ended && !p->len && p->mode != M_CALL && p->mode != M_HEADER) break;
    }
    return rc;
}
