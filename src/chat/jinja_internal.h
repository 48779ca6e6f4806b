/* Internals of the chat-template interpreter (include/kvasir/chat.h).
 *
 * Memory: everything lives in arenas. A template's tokens and syntax tree
 * sit in the template's arena; one render allocates its values, scopes and
 * strings in a render arena freed as a whole when the render ends, so an
 * error anywhere needs no unwinding of ownership. Errors and limits are
 * raised with longjmp to the one setjmp of kv_chat_tmpl_parse or
 * kv_chat_render (nothing between them owns a resource but the arena).
 *
 * Strings are UTF-8 byte spans, not NUL-terminated; where the reference
 * counts JavaScript UTF-16 code units (length, indexing) the helpers here
 * count the same way. */
#ifndef KV_CHAT_JINJA_INTERNAL_H
#define KV_CHAT_JINJA_INTERNAL_H

#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/chat.h"

/* ---- arena and failure ---------------------------------------------------- */

typedef struct jj_block jj_block;

typedef struct jj_ctx {
    jmp_buf jmp;           /* where jj_fail lands */
    kv_diag *diag;         /* may be NULL */
    int code;              /* the code of the failure that jumped */
    jj_block *blocks;      /* arena blocks, newest first */
    size_t used;           /* bytes allocated in the arena */
    size_t cap;            /* arena limit, bytes */
    kv_chat_limits lim;    /* limits in force */
    uint64_t iters;        /* loop steps so far (render) */
    uint32_t depth;        /* current nesting (parse or render) */
    int64_t now_unix;      /* strftime_now's time (render) */
} jj_ctx;

#if defined(__GNUC__)
__attribute__((noreturn, format(printf, 3, 4)))
#endif
void jj_fail(jj_ctx *c, int code, const char *fmt, ...);
void *jj_alloc(jj_ctx *c, size_t n);
void jj_arena_free(jj_ctx *c);
void jj_enter(jj_ctx *c);                      /* depth + 1, checked */
static inline void jj_leave(jj_ctx *c) { c->depth--; }
void jj_step(jj_ctx *c, uint64_t n);           /* n loop steps, checked */

typedef struct jstr {
    const char *p;
    size_t n;
} jstr;

static inline bool jstr_eq(jstr a, const char *z) {
    size_t n = 0;
    while (z[n]) n++;
    return a.n == n && (n == 0 || __builtin_memcmp(a.p, z, n) == 0);
}
static inline bool jstr_same(jstr a, jstr b) {
    return a.n == b.n && (a.n == 0 || __builtin_memcmp(a.p, b.p, a.n) == 0);
}

/* A growing string in the arena; its length is bounded by max_output_bytes. */
typedef struct jj_sb {
    char *p;
    size_t n, cap;
} jj_sb;
void jj_sb_put(jj_ctx *c, jj_sb *b, const char *s, size_t n);
static inline void jj_sb_puts(jj_ctx *c, jj_sb *b, const char *z) {
    size_t n = 0;
    while (z[n]) n++;
    jj_sb_put(c, b, z, n);
}
void jj_sb_putc(jj_ctx *c, jj_sb *b, char ch);
jstr jj_sb_str(jj_sb *b);

/* ---- UTF-8 and JavaScript string semantics -------------------------------- */

/* Decodes one code point at s[0..n) (n > 0); *len gets its byte length.
 * Invalid bytes decode as themselves (one byte each, value 0xDC00+byte is
 * never produced: returns the byte value with *len 1). */
uint32_t jj_utf8_dec(const char *s, size_t n, size_t *len);
size_t jj_utf8_enc(uint32_t cp, char out[4]);
bool jj_js_space(uint32_t cp);                  /* JavaScript /\s/ */
jstr jj_js_trim(jstr s, bool left, bool right); /* String.prototype.trim* */
size_t jj_utf16_len(jstr s);                    /* .length */
/* Number to text as JavaScript's String(n). */
void jj_js_num(double v, char out[40]);

/* ---- tokens and syntax tree ----------------------------------------------- */

enum jj_tok_type {
    T_TEXT, T_NUM, T_STR, T_IDENT, T_EQUALS, T_LPAREN, T_RPAREN, T_OPEN_STMT, T_CLOSE_STMT,
    T_OPEN_EXPR, T_CLOSE_EXPR, T_LBRACKET, T_RBRACKET, T_LBRACE, T_RBRACE, T_COMMA, T_DOT,
    T_COLON, T_PIPE, T_ADD, T_MUL, T_POW, T_CMP, T_UNARY, T_COMMENT
};

typedef struct jj_tok {
    uint8_t type; /* enum jj_tok_type */
    jstr v;       /* text, as written (escapes resolved in strings) */
} jj_tok;

enum jj_op {
    OP_NONE, OP_ADD, OP_SUB, OP_CONCAT, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_EQ, OP_NE,
    OP_LT, OP_GT, OP_LE, OP_GE, OP_IN, OP_NOTIN, OP_AND, OP_OR, OP_NOT, OP_NEG, OP_POS
};

enum jj_node_kind {
    N_TEXT, N_INT, N_FLOAT, N_STR, N_IDENT, N_ARRAY, N_TUPLE, N_OBJECT, N_MEMBER, N_CALL, N_UNARY,
    N_BINARY, N_FILTER, N_TEST, N_SELECT, N_TERNARY, N_SLICE, N_KWARG, N_SPREAD, N_KWSPREAD,
    N_IF, N_FOR, N_SET, N_MACRO, N_BREAK, N_CONTINUE, N_COMMENT, N_FILTERSTMT
};

typedef struct jj_node jj_node;
typedef struct jj_list {
    jj_node **v;
    size_t n, cap;
} jj_list;

/* One node; which fields mean what, per kind:
 *   TEXT/STR s; INT/FLOAT num; IDENT s; ARRAY/TUPLE l1; OBJECT l1 keys, l2 values;
 *   MEMBER a object, b property, flag computed; CALL a callee, l1 args;
 *   UNARY op a; BINARY op a b; FILTER a operand, b filter (IDENT or CALL);
 *   TEST a operand, s name, flag negate; SELECT a value, b condition;
 *   TERNARY a condition, b then, c else; SLICE a b c (each may be NULL);
 *   KWARG s key, a value; SPREAD/KWSPREAD a;
 *   IF a test, l1 body, l2 else; FOR a target, b iterable, l1 body, l2 else;
 *   SET a target, b value (NULL: l1 is a block); MACRO s name, l1 params, l2
 *   body, flag bit 1 uses kwargs, bit 2 uses varargs; FILTERSTMT b filter, l1 body. */
struct jj_node {
    uint8_t kind; /* enum jj_node_kind */
    uint8_t op;   /* enum jj_op */
    uint8_t flag;
    double num;
    jstr s;
    jj_node *a, *b, *c;
    jj_list l1, l2;
};

struct kv_chat_tmpl {
    jj_ctx c;      /* its arena holds the tree; limits */
    jj_list body;  /* the program */
};

/* Tokenizes and parses src into t->body (failures jump). */
void jj_parse(jj_ctx *c, const char *src, size_t len, jj_list *body);

/* ---- values ---------------------------------------------------------------- */

enum jv_type { JV_UNDEF, JV_NULL, JV_BOOL, JV_INT, JV_FLOAT, JV_STR, JV_ARR, JV_OBJ, JV_NS, JV_KW, JV_FUNC };

typedef struct jj_arr jj_arr;
typedef struct jj_obj jj_obj;
typedef struct jj_func jj_func;

typedef struct jv {
    uint8_t t;     /* enum jv_type */
    uint8_t tuple; /* an array made by a tuple literal */
    union {
        double num; /* INT (integral) and FLOAT: JavaScript numbers */
        bool b;
        jstr s;
        jj_arr *a;
        jj_obj *o; /* OBJ, NS, KW */
        jj_func *f;
    } u;
} jv;

struct jj_arr {
    jv *v;
    size_t n, cap;
};
struct jj_obj {
    jstr *k;
    jv *v;
    size_t n, cap;
};

static inline jv jv_undef(void) { return (jv){.t = JV_UNDEF}; }
static inline jv jv_null(void) { return (jv){.t = JV_NULL}; }
static inline jv jv_bool(bool b) { return (jv){.t = JV_BOOL, .u.b = b}; }
static inline jv jv_int(double n) { return (jv){.t = JV_INT, .u.num = n}; }
static inline jv jv_float(double n) { return (jv){.t = JV_FLOAT, .u.num = n}; }
static inline jv jv_str(jstr s) { return (jv){.t = JV_STR, .u.s = s}; }
jv jv_cstr(jj_ctx *c, const char *z);
jv jv_arr_new(jj_ctx *c, uint8_t t_tuple);
jv jv_obj_new(jj_ctx *c, uint8_t type);
void jj_arr_push(jj_ctx *c, jj_arr *a, jv v);
jv *jj_obj_get(jj_obj *o, jstr k);
void jj_obj_set(jj_ctx *c, jj_obj *o, jstr k, jv v);

/* JSON (jansson) to a value, as JSON.parse then the reference's conversion
 * would give it: integral numbers are integers; object keys that are array
 * indices come first, ascending, as Object.entries orders them. */
jv jj_from_json(jj_ctx *c, const json_t *j);

typedef struct jj_json_opts {
    int indent;             /* 0: none */
    bool ensure_ascii;
    bool sort_keys;
    const char *item_sep;   /* NULL: by indent */
    const char *key_sep;
    bool undef_as_null;
} jj_json_opts;
void jj_to_json(jj_ctx *c, jj_sb *b, jv v, const jj_json_opts *o, int depth);

bool jj_truthy(jv v);
void jj_str_of(jj_ctx *c, jj_sb *b, jv v);     /* RuntimeValue.toString() */
void jj_raw_str_of(jj_ctx *c, jj_sb *b, jv v); /* value.toString() on the JS value */
const char *jj_type_name(jv v);

#endif
