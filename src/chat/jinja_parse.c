/* Lexer and parser of the chat-template interpreter. They follow the
 * reference (@huggingface/jinja's lexer.ts and parser.ts) rule for rule, so
 * that whitespace control, trim_blocks and lstrip_blocks (always on, as
 * transformers renders chat templates), operator precedence and the odd
 * corners (a `-` after `(` starting a number, `}}` inside a dict literal)
 * come out the same. Input is untrusted: every read is bounded by the token
 * count, recursion by max_depth; every failure jumps with KV_EFORMAT. */
#include <stdlib.h>
#include <string.h>

#include "chat/jinja_internal.h"

#define T_EOF 255

/* ---- preprocessing ---------------------------------------------------------- */

static bool line_start(const char *s, size_t i) {
    if (i == 0) return true;
    char p = s[i - 1];
    if (p == '\n' || p == '\r') return true;
    /* U+2028 / U+2029 end a line for a JavaScript multiline regex */
    return i >= 3 && (unsigned char)s[i - 3] == 0xE2 && (unsigned char)s[i - 2] == 0x80 &&
           ((unsigned char)p == 0xA8 || (unsigned char)p == 0xA9);
}

/* The reference's preprocess(): one trailing newline dropped, then
 * lstrip_blocks (/^[ \t]*({[#%-])/gm -> $1) and trim_blocks
 * (/([#%-]})\n/g -> $1). */
static jstr preprocess(jj_ctx *c, const char *src, size_t len) {
    if (len && src[len - 1] == '\n') len--;
    char *a = jj_alloc(c, len + 1);
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        if (line_start(src, i)) {
            size_t j = i;
            while (j < len && (src[j] == ' ' || src[j] == '\t')) j++;
            if (j + 1 < len && src[j] == '{' && (src[j + 1] == '#' || src[j + 1] == '%' || src[j + 1] == '-')) {
                i = j;
            }
        }
        /* copy up to the next line start */
        do a[n++] = src[i++];
        while (i < len && !line_start(src, i));
    }
    char *b = jj_alloc(c, n + 1);
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        b[m++] = a[i];
        if (i + 2 < n && (a[i] == '#' || a[i] == '%' || a[i] == '-') &&
            a[i + 1] == '}' && a[i + 2] == '\n') {
            b[m++] = '}';
            i += 2;
        }
    }
    b[m] = 0;
    /* the transformers-only {% generation %} tag: removed, honouring its
     * whitespace control (/(\s*){%(-?)\s*(?:end)?generation\s*(-?)%}(\s*)/gs) */
    char *g = jj_alloc(c, m + 1);
    size_t k = 0, last = 0;
    for (size_t i = 0; i < m;) {
        size_t j = i, l;
        bool lstrip = false, rstrip = false, hit = false;
        if (j + 1 < m && b[j] == '{' && b[j + 1] == '%') {
            j += 2;
            if (j < m && b[j] == '-') { lstrip = true; j++; }
            while (j < m && jj_js_space(jj_utf8_dec(b + j, m - j, &l))) j += l;
            if (j + 3 <= m && !memcmp(b + j, "end", 3) && j + 13 <= m && !memcmp(b + j + 3, "generation", 10)) j += 3;
            if (j + 10 <= m && !memcmp(b + j, "generation", 10)) {
                j += 10;
                while (j < m && jj_js_space(jj_utf8_dec(b + j, m - j, &l))) j += l;
                if (j < m && b[j] == '-') { rstrip = true; j++; }
                hit = j + 1 < m + 0 && b[j] == '%' && b[j + 1] == '}';
            }
        }
        if (!hit) {
            g[k++] = b[i++];
            continue;
        }
        j += 2;
        if (lstrip) /* drop the whitespace just before, back to the last match */
            while (k > last) {
                size_t q = k - 1;
                while (q > last && ((unsigned char)g[q] & 0xC0) == 0x80) q--;
                if (!jj_js_space(jj_utf8_dec(g + q, k - q, &l)) || q + l != k) break;
                k = q;
            }
        size_t a = j;
        while (j < m && jj_js_space(jj_utf8_dec(b + j, m - j, &l))) j += l;
        if (!rstrip) { memcpy(g + k, b + a, j - a); k += j - a; }
        last = k;
        i = j;
    }
    g[k] = 0;
    b = g;
    m = k;
    return (jstr){b, m};
}

/* ---- lexer ---------------------------------------------------------------- */

typedef struct lexer {
    jj_ctx *c;
    const char *s;
    size_t n, pos;
    jj_tok *t;
    size_t nt, cap;
} lexer;

static void push(lexer *L, uint8_t type, jstr v) {
    if (L->nt == L->cap) {
        size_t cap = L->cap ? L->cap * 2 : 256;
        jj_tok *t = jj_alloc(L->c, cap * sizeof *t);
        if (L->nt) memcpy(t, L->t, L->nt * sizeof *t);
        L->t = t;
        L->cap = cap;
    }
    L->t[L->nt++] = (jj_tok){type, v};
}

static int last_type(const lexer *L) { return L->nt ? L->t[L->nt - 1].type : -1; }

static bool at(const lexer *L, const char *z) {
    size_t k = strlen(z);
    return L->pos + k <= L->n && !memcmp(L->s + L->pos, z, k);
}

static bool is_digit(int ch) { return ch >= '0' && ch <= '9'; }
static bool is_word(int ch) {
    return is_digit(ch) || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || ch == '_';
}
static bool space_at(const lexer *L, size_t *l) {
    if (L->pos >= L->n) return false;
    return jj_js_space(jj_utf8_dec(L->s + L->pos, L->n - L->pos, l));
}

static void lex_eof(lexer *L) { jj_fail(L->c, KV_EFORMAT, "chat template: unexpected end of input"); }

/* consumeWhile for the simple predicates: every consumed character that
 * reaches the end of input is an error, as in the reference. */
static jstr consume_digits(lexer *L) {
    size_t b = L->pos;
    while (L->pos < L->n && is_digit(L->s[L->pos]))
        if (++L->pos >= L->n) lex_eof(L);
    return (jstr){L->s + b, L->pos - b};
}

static void consume_space(lexer *L) {
    size_t l;
    while (space_at(L, &l)) {
        L->pos += l;
        if (L->pos >= L->n) lex_eof(L);
    }
}

static void skip_space(lexer *L) {
    size_t l;
    while (space_at(L, &l)) L->pos += l;
}

static void strip_trailing(lexer *L) {
    if (last_type(L) != T_TEXT) return;
    jj_tok *t = &L->t[L->nt - 1];
    t->v = jj_js_trim(t->v, false, true);
    if (t->v.n == 0) L->nt--;
}

static int hexv(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

static jstr lex_string(lexer *L, char q) {
    jj_sb b = {0};
    while (L->pos < L->n && L->s[L->pos] != q) {
        char ch = L->s[L->pos];
        if (ch == '\\') {
            if (++L->pos >= L->n) lex_eof(L);
            char e = L->s[L->pos++];
            if (e == 'x' || e == 'u') {
                size_t k = e == 'x' ? 2 : 4;
                uint32_t v = 0;
                for (size_t i = 0; i < k; i++) {
                    int h = L->pos + i < L->n ? hexv(L->s[L->pos + i]) : -1;
                    if (h < 0) jj_fail(L->c, KV_EFORMAT, "chat template: invalid hexadecimal escape sequence");
                    v = v * 16 + (uint32_t)h;
                }
                char u[4];
                jj_sb_put(L->c, &b, u, jj_utf8_enc(v, u));
                L->pos += k;
                continue;
            }
            const char *from = "ntrbfv'\"\\", *to = "\n\t\r\b\f\v'\"\\";
            const char *f = e ? strchr(from, e) : NULL;
            if (!f) jj_fail(L->c, KV_EFORMAT, "chat template: unexpected escaped character '%c'", e);
            jj_sb_putc(L->c, &b, to[f - from]);
            continue;
        }
        jj_sb_putc(L->c, &b, ch);
        if (++L->pos >= L->n) lex_eof(L);
    }
    if (L->pos >= L->n) lex_eof(L);
    L->pos++; /* closing quote */
    return jj_sb_str(&b);
}

static const struct { const char *seq; uint8_t type; } k_table[] = {
    {"{%", T_OPEN_STMT}, {"%}", T_CLOSE_STMT}, {"{{", T_OPEN_EXPR}, {"}}", T_CLOSE_EXPR},
    {"(", T_LPAREN}, {")", T_RPAREN}, {"{", T_LBRACE}, {"}", T_RBRACE}, {"[", T_LBRACKET},
    {"]", T_RBRACKET}, {",", T_COMMA}, {".", T_DOT}, {":", T_COLON}, {"|", T_PIPE},
    {"<=", T_CMP}, {">=", T_CMP}, {"==", T_CMP}, {"!=", T_CMP}, {"<", T_CMP}, {">", T_CMP},
    {"+", T_ADD}, {"-", T_ADD}, {"~", T_ADD}, {"**", T_POW}, {"*", T_MUL}, {"//", T_MUL},
    {"/", T_MUL}, {"%", T_MUL}, {"=", T_EQUALS},
};

static void tokenize(lexer *L) {
    int curly = 0;
    while (L->pos < L->n) {
        int lt = last_type(L);
        if (lt == -1 || lt == T_CLOSE_STMT || lt == T_CLOSE_EXPR || lt == T_COMMENT) {
            size_t b = L->pos;
            while (L->pos < L->n &&
                   !(L->s[L->pos] == '{' && L->pos + 1 < L->n &&
                     (L->s[L->pos + 1] == '%' || L->s[L->pos + 1] == '{' || L->s[L->pos + 1] == '#')))
                L->pos++;
            if (L->pos > b) {
                push(L, T_TEXT, (jstr){L->s + b, L->pos - b});
                continue;
            }
        }
        if (at(L, "{#")) {
            L->pos += 2;
            bool strip_before = L->pos < L->n && L->s[L->pos] == '-';
            if (strip_before) L->pos++;
            size_t b = L->pos;
            while (!(L->pos + 1 < L->n && L->s[L->pos] == '#' && L->s[L->pos + 1] == '}')) {
                if (L->pos + 2 >= L->n)
                    jj_fail(L->c, KV_EFORMAT, "chat template: missing end of comment tag");
                L->pos++;
            }
            jstr com = {L->s + b, L->pos - b};
            bool strip_after = com.n && com.p[com.n - 1] == '-';
            if (strip_after) com.n--;
            if (strip_before) strip_trailing(L);
            push(L, T_COMMENT, com);
            L->pos += 2;
            if (strip_after) skip_space(L);
            continue;
        }
        if (at(L, "{%-")) {
            strip_trailing(L);
            push(L, T_OPEN_STMT, (jstr){"{%", 2});
            L->pos += 3;
            continue;
        }
        if (at(L, "{{-")) {
            strip_trailing(L);
            push(L, T_OPEN_EXPR, (jstr){"{{", 2});
            curly = 0;
            L->pos += 3;
            continue;
        }
        consume_space(L);
        if (at(L, "-%}")) {
            push(L, T_CLOSE_STMT, (jstr){"%}", 2});
            L->pos += 3;
            skip_space(L);
            continue;
        }
        if (at(L, "-}}")) {
            push(L, T_CLOSE_EXPR, (jstr){"}}", 2});
            L->pos += 3;
            skip_space(L);
            continue;
        }
        char ch = L->s[L->pos];
        if (ch == '-' || ch == '+') {
            lt = last_type(L);
            if (lt == T_TEXT || lt == -1)
                jj_fail(L->c, KV_EFORMAT, "chat template: unexpected character '%c'", ch);
            if (!(lt == T_IDENT || lt == T_NUM || lt == T_STR || lt == T_RPAREN || lt == T_RBRACKET)) {
                size_t b = L->pos++;
                jstr num = consume_digits(L);
                if (num.n > 0 && L->pos + 1 < L->n && L->s[L->pos] == '.' && is_digit(L->s[L->pos + 1])) {
                    L->pos++;
                    consume_digits(L);
                }
                push(L, num.n ? T_NUM : T_UNARY, (jstr){L->s + b, L->pos - b});
                continue;
            }
        }
        bool matched = false;
        for (size_t i = 0; i < sizeof k_table / sizeof k_table[0]; i++) {
            if (k_table[i].type == T_CLOSE_EXPR && curly > 0) continue;
            if (!at(L, k_table[i].seq)) continue;
            size_t k = strlen(k_table[i].seq);
            push(L, k_table[i].type, (jstr){L->s + L->pos, k});
            if (k_table[i].type == T_OPEN_EXPR) curly = 0;
            else if (k_table[i].type == T_LBRACE) curly++;
            else if (k_table[i].type == T_RBRACE) curly--;
            L->pos += k;
            matched = true;
            break;
        }
        if (matched) continue;
        if (ch == '\'' || ch == '"') {
            L->pos++;
            push(L, T_STR, lex_string(L, ch));
            continue;
        }
        if (is_digit(ch)) {
            size_t b = L->pos;
            consume_digits(L);
            if (last_type(L) != T_DOT && L->pos + 1 < L->n && L->s[L->pos] == '.' && is_digit(L->s[L->pos + 1])) {
                L->pos++;
                consume_digits(L);
            }
            push(L, T_NUM, (jstr){L->s + b, L->pos - b});
            continue;
        }
        if (is_word((unsigned char)ch)) {
            size_t b = L->pos;
            while (L->pos < L->n && is_word((unsigned char)L->s[L->pos]))
                if (++L->pos >= L->n) lex_eof(L);
            push(L, T_IDENT, (jstr){L->s + b, L->pos - b});
            continue;
        }
        jj_fail(L->c, KV_EFORMAT, "chat template: unexpected character '%c' at byte %zu", ch, L->pos);
    }
}

/* ---- parser ----------------------------------------------------------------- */

typedef struct parser {
    jj_ctx *c;
    const jj_tok *t;
    size_t n, cur;
} parser;

static const jj_tok k_eof = {T_EOF, {"", 0}};

static const jj_tok *tk(const parser *P, size_t off) {
    return P->cur + off < P->n ? &P->t[P->cur + off] : &k_eof;
}
static bool is(const parser *P, uint8_t type) { return tk(P, 0)->type == type; }
static bool is_ident(const parser *P, size_t off, const char *name) {
    const jj_tok *t = tk(P, off);
    return t->type == T_IDENT && jstr_eq(t->v, name);
}
static bool is_stmt(const parser *P, const char *a, const char *b, const char *c3) {
    if (tk(P, 0)->type != T_OPEN_STMT || tk(P, 1)->type != T_IDENT) return false;
    jstr v = tk(P, 1)->v;
    return jstr_eq(v, a) || (b && jstr_eq(v, b)) || (c3 && jstr_eq(v, c3));
}

#if defined(__GNUC__)
__attribute__((noreturn))
#endif
static void perr(parser *P, const char *what) {
    const jj_tok *t = tk(P, 0);
    if (t->type == T_EOF) jj_fail(P->c, KV_EFORMAT, "chat template: %s, at the end of the template", what);
    jj_fail(P->c, KV_EFORMAT, "chat template: %s, near '%.*s' (token %zu)", what,
            (int)(t->v.n > 40 ? 40 : t->v.n), t->v.p, P->cur);
}

static const jj_tok *expect(parser *P, uint8_t type, const char *what) {
    if (!is(P, type)) perr(P, what);
    return &P->t[P->cur++];
}
static void expect_ident(parser *P, const char *name) {
    if (!is_ident(P, 0, name)) {
        char m[64];
        snprintf(m, sizeof m, "expected %s", name);
        perr(P, m);
    }
    P->cur++;
}

static jj_node *mk(parser *P, uint8_t kind) {
    jj_node *n = jj_alloc(P->c, sizeof *n);
    memset(n, 0, sizeof *n);
    n->kind = kind;
    return n;
}

static void lpush(jj_ctx *c, jj_list *l, jj_node *n) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 4;
        jj_node **v = jj_alloc(c, cap * sizeof *v);
        if (l->n) memcpy(v, l->v, l->n * sizeof *v);
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = n;
}

static jj_node *parse_any(parser *P);
static jj_node *parse_expr(parser *P);
static jj_node *parse_primary(parser *P);
static jj_node *parse_call(parser *P, jj_node *callee);
static jj_node *parse_member(parser *P, jj_node *obj);

static jj_node *parse_if_stmt(parser *P) {
    jj_node *n = mk(P, N_IF);
    n->a = parse_expr(P);
    expect(P, T_CLOSE_STMT, "expected closing statement token");
    while (!is_stmt(P, "elif", "else", "endif")) lpush(P->c, &n->l1, parse_any(P));
    if (is_stmt(P, "elif", NULL, NULL)) {
        P->cur += 2;
        jj_enter(P->c);
        lpush(P->c, &n->l2, parse_if_stmt(P));
        jj_leave(P->c);
    } else if (is_stmt(P, "else", NULL, NULL)) {
        P->cur += 2;
        expect(P, T_CLOSE_STMT, "expected closing statement token");
        while (!is_stmt(P, "endif", NULL, NULL)) lpush(P->c, &n->l2, parse_any(P));
    }
    return n;
}

static jj_node *parse_seq(parser *P, bool primary) {
    jj_node *first = primary ? parse_primary(P) : parse_expr(P);
    if (!is(P, T_COMMA)) return first;
    jj_node *t = mk(P, N_TUPLE);
    lpush(P->c, &t->l1, first);
    while (is(P, T_COMMA)) {
        P->cur++;
        lpush(P->c, &t->l1, primary ? parse_primary(P) : parse_expr(P));
    }
    return t;
}

static void parse_args(parser *P, jj_list *out, bool params) {
    expect(P, T_LPAREN, "expected opening parenthesis for arguments list");
    bool saw_kw = false, saw_spread = false;
    while (!is(P, T_RPAREN)) {
        if (is(P, T_EOF)) perr(P, "expected closing parenthesis");
        bool kwspread = is(P, T_POW);
        bool spread = is(P, T_MUL) && jstr_eq(tk(P, 0)->v, "*");
        if (params && (kwspread || spread)) perr(P, "argument unpacking is not allowed in parameter declarations");
        if (kwspread) {
            P->cur++;
            jj_node *s = mk(P, N_KWSPREAD);
            s->a = parse_expr(P);
            lpush(P->c, out, s);
            if (is(P, T_COMMA)) P->cur++;
            if (!is(P, T_RPAREN)) perr(P, "`**` must be applied to the final argument");
            break;
        }
        jj_node *arg;
        if (spread) {
            if (saw_spread) perr(P, "only one `*` argument unpacking is allowed");
            saw_spread = true;
            P->cur++;
            arg = mk(P, N_SPREAD);
            arg->a = parse_expr(P);
        } else {
            arg = parse_expr(P);
            if (is(P, T_EQUALS)) {
                P->cur++;
                if (arg->kind != N_IDENT) perr(P, "expected identifier for keyword argument");
                jj_node *kw = mk(P, N_KWARG);
                kw->s = arg->s;
                kw->a = parse_expr(P);
                arg = kw;
            }
            if (params) {
                if (arg->kind != N_IDENT && arg->kind != N_KWARG) perr(P, "expected identifier for parameter declaration");
                for (size_t i = 0; i < out->n; i++)
                    if (jstr_same(out->v[i]->s, arg->s)) perr(P, "duplicate parameter name");
            }
            if (arg->kind == N_KWARG) saw_kw = true;
            else if (saw_kw) perr(P, "positional arguments must come before keyword arguments");
            else if (saw_spread) perr(P, "positional arguments must not follow `*` argument unpacking");
        }
        lpush(P->c, out, arg);
        if (is(P, T_COMMA)) P->cur++;
    }
    expect(P, T_RPAREN, "expected closing parenthesis for arguments list");
}

/* kwargs / varargs used in a macro body and not declared as parameters. */
static void find_special(const jj_node *n, uint8_t *flag) {
    if (!n) return;
    if (n->kind == N_IDENT) {
        if (jstr_eq(n->s, "kwargs")) *flag |= 1;
        if (jstr_eq(n->s, "varargs")) *flag |= 2;
        return;
    }
    find_special(n->a, flag);
    find_special(n->b, flag);
    find_special(n->c, flag);
    for (size_t i = 0; i < n->l1.n; i++) find_special(n->l1.v[i], flag);
    for (size_t i = 0; i < n->l2.n; i++) find_special(n->l2.v[i], flag);
}

static jj_node *parse_stmt(parser *P) {
    expect(P, T_OPEN_STMT, "expected opening statement token");
    if (!is(P, T_IDENT)) perr(P, "unknown statement");
    jstr name = tk(P, 0)->v;
    jj_node *n;
    P->cur++;
    if (jstr_eq(name, "set")) {
        n = mk(P, N_SET);
        n->a = parse_seq(P, false);
        if (is(P, T_EQUALS)) {
            P->cur++;
            n->b = parse_seq(P, false);
        } else {
            expect(P, T_CLOSE_STMT, "expected %} token");
            while (!is_stmt(P, "endset", NULL, NULL)) lpush(P->c, &n->l1, parse_any(P));
            expect(P, T_OPEN_STMT, "expected {% token");
            expect_ident(P, "endset");
        }
        expect(P, T_CLOSE_STMT, "expected closing statement token");
    } else if (jstr_eq(name, "if")) {
        n = parse_if_stmt(P);
        expect(P, T_OPEN_STMT, "expected {% token");
        expect_ident(P, "endif");
        expect(P, T_CLOSE_STMT, "expected %} token");
    } else if (jstr_eq(name, "macro")) {
        n = mk(P, N_MACRO);
        jj_node *id = parse_primary(P);
        if (id->kind != N_IDENT) perr(P, "expected identifier following macro statement");
        n->s = id->s;
        parse_args(P, &n->l1, true);
        expect(P, T_CLOSE_STMT, "expected closing statement token");
        while (!is_stmt(P, "endmacro", NULL, NULL)) lpush(P->c, &n->l2, parse_any(P));
        expect(P, T_OPEN_STMT, "expected {% token");
        expect_ident(P, "endmacro");
        expect(P, T_CLOSE_STMT, "expected %} token");
        uint8_t f = 0;
        for (size_t i = 0; i < n->l1.n; i++) find_special(n->l1.v[i]->kind == N_KWARG ? n->l1.v[i]->a : NULL, &f);
        for (size_t i = 0; i < n->l2.n; i++) find_special(n->l2.v[i], &f);
        for (size_t i = 0; i < n->l1.n; i++) {
            if (jstr_eq(n->l1.v[i]->s, "kwargs")) f &= (uint8_t)~1;
            if (jstr_eq(n->l1.v[i]->s, "varargs")) f &= (uint8_t)~2;
        }
        n->flag = f;
    } else if (jstr_eq(name, "for")) {
        n = mk(P, N_FOR);
        n->a = parse_seq(P, true);
        if (n->a->kind != N_IDENT && n->a->kind != N_TUPLE) perr(P, "expected identifier/tuple for the loop variable");
        if (!is_ident(P, 0, "in")) perr(P, "expected `in` keyword following loop variable");
        P->cur++;
        n->b = parse_expr(P);
        expect(P, T_CLOSE_STMT, "expected closing statement token");
        while (!is_stmt(P, "endfor", "else", NULL)) lpush(P->c, &n->l1, parse_any(P));
        if (is_stmt(P, "else", NULL, NULL)) {
            P->cur += 2;
            expect(P, T_CLOSE_STMT, "expected closing statement token");
            while (!is_stmt(P, "endfor", NULL, NULL)) lpush(P->c, &n->l2, parse_any(P));
        }
        expect(P, T_OPEN_STMT, "expected {% token");
        expect_ident(P, "endfor");
        expect(P, T_CLOSE_STMT, "expected %} token");
    } else if (jstr_eq(name, "break") || jstr_eq(name, "continue")) {
        n = mk(P, jstr_eq(name, "break") ? N_BREAK : N_CONTINUE);
        expect(P, T_CLOSE_STMT, "expected closing statement token");
    } else if (jstr_eq(name, "filter")) {
        n = mk(P, N_FILTERSTMT);
        jj_node *f = parse_primary(P);
        if (f->kind == N_IDENT && is(P, T_LPAREN)) f = parse_call(P, f);
        n->b = f;
        expect(P, T_CLOSE_STMT, "expected closing statement token");
        while (!is_stmt(P, "endfilter", NULL, NULL)) lpush(P->c, &n->l1, parse_any(P));
        expect(P, T_OPEN_STMT, "expected {% token");
        expect_ident(P, "endfilter");
        expect(P, T_CLOSE_STMT, "expected %} token");
    } else if (jstr_eq(name, "call")) {
        jj_fail(P->c, KV_EUNSUPPORTED, "chat template: {%% call %%} blocks are not supported");
    } else {
        P->cur--;
        perr(P, "unknown statement type");
    }
    return n;
}

static jj_node *parse_any(parser *P) {
    jj_enter(P->c);
    jj_node *n;
    switch (tk(P, 0)->type) {
    case T_COMMENT:
        n = mk(P, N_COMMENT);
        P->cur++;
        break;
    case T_TEXT:
        n = mk(P, N_TEXT);
        n->s = tk(P, 0)->v;
        P->cur++;
        break;
    case T_OPEN_STMT: n = parse_stmt(P); break;
    case T_OPEN_EXPR:
        P->cur++;
        n = parse_expr(P);
        expect(P, T_CLOSE_EXPR, "expected closing expression token");
        break;
    default: perr(P, "unexpected token");
    }
    jj_leave(P->c);
    return n;
}

static jj_node *binary(parser *P, uint8_t op, jj_node *a, jj_node *b) {
    jj_node *n = mk(P, N_BINARY);
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

static uint8_t op_of(jstr v) {
    static const struct { const char *s; uint8_t op; } m[] = {
        {"+", OP_ADD}, {"-", OP_SUB}, {"~", OP_CONCAT}, {"*", OP_MUL}, {"/", OP_DIV},
        {"//", OP_FLOORDIV}, {"%", OP_MOD}, {"**", OP_POW}, {"==", OP_EQ}, {"!=", OP_NE},
        {"<", OP_LT}, {">", OP_GT}, {"<=", OP_LE}, {">=", OP_GE}};
    for (size_t i = 0; i < sizeof m / sizeof m[0]; i++)
        if (jstr_eq(v, m[i].s)) return m[i].op;
    return OP_NONE;
}

static jj_node *parse_unary_sign(parser *P) {
    const jj_tok *t = tk(P, 0);
    if ((t->type == T_UNARY || t->type == T_ADD) && (jstr_eq(t->v, "-") || jstr_eq(t->v, "+"))) {
        P->cur++;
        jj_enter(P->c);
        jj_node *n = mk(P, N_UNARY);
        n->op = jstr_eq(t->v, "-") ? OP_NEG : OP_POS;
        n->a = parse_unary_sign(P);
        jj_leave(P->c);
        return n;
    }
    jj_node *m = parse_member(P, parse_primary(P));
    if (is(P, T_LPAREN)) return parse_call(P, m);
    return m;
}

static jj_node *parse_filter(parser *P) {
    jj_node *operand = parse_unary_sign(P);
    while (is(P, T_PIPE)) {
        P->cur++;
        jj_node *f = parse_primary(P);
        if (f->kind != N_IDENT) perr(P, "expected identifier for the filter");
        if (is(P, T_LPAREN)) f = parse_call(P, f);
        jj_node *n = mk(P, N_FILTER);
        n->a = operand;
        n->b = f;
        operand = n;
    }
    return operand;
}

static jj_node *parse_test(parser *P) {
    jj_node *operand = parse_filter(P);
    while (is_ident(P, 0, "is")) {
        P->cur++;
        bool neg = is_ident(P, 0, "not");
        if (neg) P->cur++;
        jj_node *f = parse_primary(P);
        if (f->kind != N_IDENT) perr(P, "expected identifier for the test");
        jj_node *n = mk(P, N_TEST);
        n->a = operand;
        n->s = f->s;
        n->flag = neg;
        operand = n;
    }
    return operand;
}

static jj_node *parse_pow(parser *P) {
    jj_node *l = parse_test(P);
    while (is(P, T_POW)) {
        P->cur++;
        l = binary(P, OP_POW, l, parse_test(P));
    }
    return l;
}

static jj_node *parse_mul(parser *P) {
    jj_node *l = parse_pow(P);
    while (is(P, T_MUL)) {
        uint8_t op = op_of(tk(P, 0)->v);
        P->cur++;
        l = binary(P, op, l, parse_pow(P));
    }
    return l;
}

static jj_node *parse_add(parser *P) {
    jj_node *l = parse_mul(P);
    while (is(P, T_ADD)) {
        uint8_t op = op_of(tk(P, 0)->v);
        P->cur++;
        l = binary(P, op, l, parse_mul(P));
    }
    return l;
}

static jj_node *parse_cmp(parser *P) {
    jj_node *l = parse_add(P);
    for (;;) {
        uint8_t op;
        if (is_ident(P, 0, "not") && is_ident(P, 1, "in")) {
            op = OP_NOTIN;
            P->cur += 2;
        } else if (is_ident(P, 0, "in")) {
            op = OP_IN;
            P->cur++;
        } else if (is(P, T_CMP)) {
            op = op_of(tk(P, 0)->v);
            P->cur++;
        } else {
            break;
        }
        l = binary(P, op, l, parse_add(P));
    }
    return l;
}

static jj_node *parse_not(parser *P) {
    jj_node *r = NULL;
    while (is_ident(P, 0, "not")) {
        P->cur++;
        jj_enter(P->c);
        jj_node *arg = parse_not(P);
        jj_leave(P->c);
        r = mk(P, N_UNARY);
        r->op = OP_NOT;
        r->a = arg;
    }
    return r ? r : parse_cmp(P);
}

static jj_node *parse_and(parser *P) {
    jj_node *l = parse_not(P);
    while (is_ident(P, 0, "and")) {
        P->cur++;
        l = binary(P, OP_AND, l, parse_not(P));
    }
    return l;
}

static jj_node *parse_or(parser *P) {
    jj_node *l = parse_and(P);
    while (is_ident(P, 0, "or")) {
        P->cur++;
        l = binary(P, OP_OR, l, parse_and(P));
    }
    return l;
}

static jj_node *parse_expr(parser *P) {
    jj_enter(P->c);
    jj_node *a = parse_or(P);
    if (is_ident(P, 0, "if")) {
        P->cur++;
        jj_node *test = parse_or(P);
        if (is_ident(P, 0, "else")) {
            P->cur++;
            jj_node *n = mk(P, N_TERNARY);
            n->a = test;
            n->b = a;
            n->c = parse_expr(P);
            a = n;
        } else {
            jj_node *n = mk(P, N_SELECT);
            n->a = a;
            n->b = test;
            a = n;
        }
    }
    jj_leave(P->c);
    return a;
}

static jj_node *parse_call(parser *P, jj_node *callee) {
    jj_enter(P->c);
    jj_node *n = mk(P, N_CALL);
    n->a = callee;
    parse_args(P, &n->l1, false);
    n = parse_member(P, n);
    if (is(P, T_LPAREN)) n = parse_call(P, n);
    jj_leave(P->c);
    return n;
}

static jj_node *parse_subscript(parser *P) {
    jj_node *sl[4] = {0};
    size_t ns = 0;
    bool slice = false;
    while (!is(P, T_RBRACKET)) {
        if (is(P, T_EOF)) perr(P, "expected closing square bracket");
        if (ns == 4) perr(P, "expected 0-3 arguments for slice expression");
        if (is(P, T_COLON)) {
            sl[ns++] = NULL;
            P->cur++;
            slice = true;
        } else {
            sl[ns++] = parse_expr(P);
            if (is(P, T_COLON)) {
                P->cur++;
                slice = true;
            }
        }
    }
    if (ns == 0) perr(P, "expected at least one argument for member/slice expression");
    if (!slice) return sl[0];
    if (ns > 3) perr(P, "expected 0-3 arguments for slice expression");
    jj_node *n = mk(P, N_SLICE);
    n->a = sl[0];
    n->b = sl[1];
    n->c = sl[2];
    return n;
}

static jj_node *parse_member(parser *P, jj_node *obj) {
    while (is(P, T_DOT) || is(P, T_LBRACKET)) {
        bool computed = is(P, T_LBRACKET);
        P->cur++;
        jj_node *prop;
        if (computed) {
            prop = parse_subscript(P);
            expect(P, T_RBRACKET, "expected closing square bracket");
        } else {
            prop = parse_primary(P);
            if (prop->kind != N_IDENT && prop->kind != N_INT)
                perr(P, "expected identifier or integer following dot operator");
        }
        jj_node *n = mk(P, N_MEMBER);
        n->a = obj;
        n->b = prop;
        n->flag = computed;
        obj = n;
    }
    return obj;
}

static jj_node *parse_primary(parser *P) {
    const jj_tok *t = tk(P, 0);
    if (t->type == T_EOF) perr(P, "unexpected end of template");
    P->cur++;
    jj_node *n;
    switch (t->type) {
    case T_NUM: {
        bool fl = memchr(t->v.p, '.', t->v.n) != NULL;
        n = mk(P, fl ? N_FLOAT : N_INT);
        char buf[64];
        size_t k = t->v.n < sizeof buf - 1 ? t->v.n : sizeof buf - 1;
        memcpy(buf, t->v.p, k);
        buf[k] = 0;
        n->num = strtod(buf, NULL);
        if (t->v.n >= sizeof buf - 1) {
            /* a long digit run: Number() of it, without the buffer's cut */
            double v = 0;
            size_t i = t->v.p[0] == '-' || t->v.p[0] == '+' ? 1 : 0;
            for (; i < t->v.n && t->v.p[i] != '.'; i++) v = v * 10 + (t->v.p[i] - '0');
            n->num = t->v.p[0] == '-' ? -v : v;
        }
        return n;
    }
    case T_STR: {
        n = mk(P, N_STR);
        n->s = t->v;
        if (is(P, T_STR)) {
            jj_sb b = {0};
            jj_sb_put(P->c, &b, t->v.p, t->v.n);
            while (is(P, T_STR)) {
                jj_sb_put(P->c, &b, tk(P, 0)->v.p, tk(P, 0)->v.n);
                P->cur++;
            }
            n->s = jj_sb_str(&b);
        }
        return n;
    }
    case T_IDENT:
        n = mk(P, N_IDENT);
        n->s = t->v;
        return n;
    case T_LPAREN:
        jj_enter(P->c);
        n = parse_seq(P, false);
        expect(P, T_RPAREN, "expected closing parenthesis");
        jj_leave(P->c);
        return n;
    case T_LBRACKET:
        jj_enter(P->c);
        n = mk(P, N_ARRAY);
        while (!is(P, T_RBRACKET)) {
            if (is(P, T_EOF)) perr(P, "expected closing square bracket");
            lpush(P->c, &n->l1, parse_expr(P));
            if (is(P, T_COMMA)) P->cur++;
        }
        P->cur++;
        jj_leave(P->c);
        return n;
    case T_LBRACE:
        jj_enter(P->c);
        n = mk(P, N_OBJECT);
        while (!is(P, T_RBRACE)) {
            if (is(P, T_EOF)) perr(P, "expected closing curly bracket");
            lpush(P->c, &n->l1, parse_expr(P));
            expect(P, T_COLON, "expected colon between key and value in object literal");
            lpush(P->c, &n->l2, parse_expr(P));
            if (is(P, T_COMMA)) P->cur++;
        }
        P->cur++;
        jj_leave(P->c);
        return n;
    default:
        P->cur--;
        perr(P, "unexpected token");
    }
}

void jj_parse(jj_ctx *c, const char *src, size_t len, jj_list *body) {
    lexer L = {.c = c};
    jstr s = preprocess(c, src, len);
    L.s = s.p;
    L.n = s.n;
    tokenize(&L);
    parser P = {.c = c, .t = L.t, .n = L.nt};
    while (P.cur < P.n) lpush(c, body, parse_any(&P));
}
