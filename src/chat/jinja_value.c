/* Values of the chat-template interpreter: the arena they live in, strings
 * with JavaScript's semantics (whitespace, UTF-16 lengths, number text), and
 * conversion from and to JSON as the reference (@huggingface/jinja) does it.
 * Every allocation is counted against the arena limit; every string built
 * is bounded by max_output_bytes. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat/jinja_internal.h"

/* ---- arena and failure ---------------------------------------------------- */

struct jj_block {
    jj_block *next;
    size_t used, size;
    _Alignas(16) unsigned char data[];
};

void jj_fail(jj_ctx *c, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    kv_vfail(c->diag, code, fmt, ap);
    va_end(ap);
    c->code = code;
    longjmp(c->jmp, 1);
}

void *jj_alloc(jj_ctx *c, size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (n == 0) n = 16;
    jj_block *b = c->blocks;
    if (!b || b->size - b->used < n) {
        size_t want = n > 65536 ? n : 65536;
        if (c->used + want > c->cap || want < n)
            jj_fail(c, KV_ERANGE, "chat template: memory limit of %zu bytes reached", c->cap);
        b = malloc(sizeof *b + want);
        if (!b) jj_fail(c, KV_ENOMEM, "chat template: out of memory");
        b->next = c->blocks;
        b->used = 0;
        b->size = want;
        c->blocks = b;
        c->used += want;
    }
    void *p = b->data + b->used;
    b->used += n;
    return p;
}

void jj_arena_free(jj_ctx *c) {
    jj_block *b = c->blocks;
    while (b) {
        jj_block *n = b->next;
        free(b);
        b = n;
    }
    c->blocks = NULL;
    c->used = 0;
}

void jj_enter(jj_ctx *c) {
    if (++c->depth > c->lim.max_depth)
        jj_fail(c, KV_ERANGE, "chat template: nesting depth limit of %u reached", c->lim.max_depth);
}

void jj_step(jj_ctx *c, uint64_t n) {
    c->iters += n;
    if (c->iters > c->lim.max_loop_iters)
        jj_fail(c, KV_ERANGE, "chat template: loop iteration limit of %llu reached",
                (unsigned long long)c->lim.max_loop_iters);
}

void jj_sb_put(jj_ctx *c, jj_sb *b, const char *s, size_t n) {
    if (n == 0) return;
    if (b->n + n > c->lim.max_output_bytes || b->n + n < n)
        jj_fail(c, KV_ERANGE, "chat template: output limit of %zu bytes reached", c->lim.max_output_bytes);
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 64;
        while (cap < b->n + n) cap *= 2;
        char *p = jj_alloc(c, cap);
        if (b->n) memcpy(p, b->p, b->n);
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
}

void jj_sb_putc(jj_ctx *c, jj_sb *b, char ch) { jj_sb_put(c, b, &ch, 1); }

jstr jj_sb_str(jj_sb *b) { return (jstr){b->p ? b->p : "", b->n}; }

/* ---- UTF-8 and JavaScript strings ----------------------------------------- */

uint32_t jj_utf8_dec(const char *s, size_t n, size_t *len) {
    const unsigned char *u = (const unsigned char *)s;
    uint32_t c0 = u[0];
    *len = 1;
    if (c0 < 0x80) return c0;
    int k = c0 >= 0xF0 ? 3 : c0 >= 0xE0 ? 2 : c0 >= 0xC0 ? 1 : 0;
    if (k == 0 || (size_t)k + 1 > n) return c0;
    uint32_t cp = c0 & (0x3F >> k);
    for (int i = 1; i <= k; i++) {
        if ((u[i] & 0xC0) != 0x80) return c0;
        cp = (cp << 6) | (u[i] & 0x3F);
    }
    *len = (size_t)k + 1;
    return cp;
}

size_t jj_utf8_enc(uint32_t cp, char out[4]) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

bool jj_js_space(uint32_t cp) {
    return (cp >= 9 && cp <= 13) || cp == 0x20 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
           cp == 0x205F || cp == 0x3000 || cp == 0xFEFF;
}

jstr jj_js_trim(jstr s, bool left, bool right) {
    size_t i = 0, e = s.n, l;
    if (left)
        while (i < e && jj_js_space(jj_utf8_dec(s.p + i, e - i, &l))) i += l;
    if (right)
        while (e > i) {
            /* step back to the start of the last code point */
            size_t j = e - 1;
            while (j > i && ((unsigned char)s.p[j] & 0xC0) == 0x80 && e - j < 4) j--;
            uint32_t cp = jj_utf8_dec(s.p + j, e - j, &l);
            if (j + l != e) { j = e - 1; cp = (unsigned char)s.p[j]; }
            if (!jj_js_space(cp)) break;
            e = j;
        }
    return (jstr){s.p + i, e - i};
}

size_t jj_utf16_len(jstr s) {
    size_t n = 0, l;
    for (size_t i = 0; i < s.n; i += l) n += jj_utf8_dec(s.p + i, s.n - i, &l) >= 0x10000 ? 2 : 1;
    return n;
}

/* Number::toString (ECMAScript 6.1.6.1.20): the shortest digits that read
 * back as v, placed as plain or exponential notation by the decimal exponent. */
void jj_js_num(double v, char out[40]) {
    if (isnan(v)) { strcpy(out, "NaN"); return; }
    if (isinf(v)) { strcpy(out, v < 0 ? "-Infinity" : "Infinity"); return; }
    if (v == 0) { strcpy(out, "0"); return; }
    char buf[40], digits[24];
    int prec;
    for (prec = 1; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*e", prec - 1, v);
        if (strtod(buf, NULL) == v) break;
    }
    /* buf: [-]d[.ddd]e[+-]xx */
    const char *p = buf;
    char *o = out;
    if (*p == '-') { *o++ = '-'; p++; }
    int k = 0;
    for (; *p && *p != 'e'; p++)
        if (*p != '.') digits[k++] = *p;
    while (k > 1 && digits[k - 1] == '0') k--;
    int e = atoi(p + 1), n = e + 1;
    if (k <= n && n <= 21) {
        memcpy(o, digits, (size_t)k); o += k;
        for (int i = 0; i < n - k; i++) *o++ = '0';
    } else if (0 < n && n <= 21) {
        memcpy(o, digits, (size_t)n); o += n;
        *o++ = '.';
        memcpy(o, digits + n, (size_t)(k - n)); o += k - n;
    } else if (-6 < n && n <= 0) {
        *o++ = '0'; *o++ = '.';
        for (int i = 0; i < -n; i++) *o++ = '0';
        memcpy(o, digits, (size_t)k); o += k;
    } else {
        *o++ = digits[0];
        if (k > 1) { *o++ = '.'; memcpy(o, digits + 1, (size_t)(k - 1)); o += k - 1; }
        o += sprintf(o, "e%c%d", n - 1 < 0 ? '-' : '+', abs(n - 1));
    }
    *o = 0;
}

/* ---- containers ---------------------------------------------------------- */

jv jv_cstr(jj_ctx *c, const char *z) {
    size_t n = strlen(z);
    char *p = jj_alloc(c, n + 1);
    memcpy(p, z, n + 1);
    return jv_str((jstr){p, n});
}

jv jv_arr_new(jj_ctx *c, uint8_t tuple) {
    jv v = {.t = JV_ARR, .tuple = tuple};
    v.u.a = jj_alloc(c, sizeof *v.u.a);
    memset(v.u.a, 0, sizeof *v.u.a);
    return v;
}

jv jv_obj_new(jj_ctx *c, uint8_t type) {
    jv v = {.t = type};
    v.u.o = jj_alloc(c, sizeof *v.u.o);
    memset(v.u.o, 0, sizeof *v.u.o);
    return v;
}

void jj_arr_push(jj_ctx *c, jj_arr *a, jv v) {
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 4;
        jv *nv = jj_alloc(c, cap * sizeof *nv);
        if (a->n) memcpy(nv, a->v, a->n * sizeof *nv);
        a->v = nv;
        a->cap = cap;
    }
    a->v[a->n++] = v;
}

jv *jj_obj_get(jj_obj *o, jstr k) {
    for (size_t i = 0; i < o->n; i++)
        if (jstr_same(o->k[i], k)) return &o->v[i];
    return NULL;
}

void jj_obj_set(jj_ctx *c, jj_obj *o, jstr k, jv v) {
    jv *old = jj_obj_get(o, k);
    if (old) { *old = v; return; }
    if (o->n == o->cap) {
        size_t cap = o->cap ? o->cap * 2 : 4;
        jstr *nk = jj_alloc(c, cap * sizeof *nk);
        jv *nv = jj_alloc(c, cap * sizeof *nv);
        if (o->n) {
            memcpy(nk, o->k, o->n * sizeof *nk);
            memcpy(nv, o->v, o->n * sizeof *nv);
        }
        o->k = nk;
        o->v = nv;
        o->cap = cap;
    }
    o->k[o->n] = k;
    o->v[o->n++] = v;
}

/* ---- JSON in ------------------------------------------------------------- */

/* An array index as ECMAScript orders own keys: "0" or [1-9][0-9]* < 2^32-1. */
static bool array_index(const char *k, double *out) {
    size_t n = strlen(k);
    if (n == 0 || n > 10 || (k[0] == '0' && n > 1)) return false;
    double v = 0;
    for (size_t i = 0; i < n; i++) {
        if (k[i] < '0' || k[i] > '9') return false;
        v = v * 10 + (k[i] - '0');
    }
    if (v >= 4294967295.0) return false;
    *out = v;
    return true;
}

jv jj_from_json(jj_ctx *c, const json_t *j) {
    switch (json_typeof(j)) {
    case JSON_NULL: return jv_null();
    case JSON_TRUE: return jv_bool(true);
    case JSON_FALSE: return jv_bool(false);
    case JSON_INTEGER: return jv_int((double)json_integer_value(j));
    case JSON_REAL: {
        double d = json_real_value(j);
        return isfinite(d) && d == floor(d) ? jv_int(d) : jv_float(d);
    }
    case JSON_STRING: {
        size_t n = json_string_length(j);
        char *p = jj_alloc(c, n + 1);
        memcpy(p, json_string_value(j), n + 1);
        return jv_str((jstr){p, n});
    }
    case JSON_ARRAY: {
        jj_enter(c);
        jv a = jv_arr_new(c, 0);
        for (size_t i = 0; i < json_array_size(j); i++)
            jj_arr_push(c, a.u.a, jj_from_json(c, json_array_get(j, i)));
        jj_leave(c);
        return a;
    }
    case JSON_OBJECT: {
        jj_enter(c);
        jv o = jv_obj_new(c, JV_OBJ);
        size_t n = json_object_size(j), ni = 0;
        const char **idx = n ? jj_alloc(c, n * sizeof *idx) : NULL;
        double *idv = n ? jj_alloc(c, n * sizeof *idv) : NULL;
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)j, k, v) {
            double d;
            if (array_index(k, &d)) {
                size_t i = ni++;
                while (i > 0 && idv[i - 1] > d) { idv[i] = idv[i - 1]; idx[i] = idx[i - 1]; i--; }
                idv[i] = d;
                idx[i] = k;
            }
        }
        for (size_t i = 0; i < ni; i++) {
            jv x = jv_cstr(c, idx[i]);
            jj_obj_set(c, o.u.o, x.u.s, jj_from_json(c, json_object_get(j, idx[i])));
        }
        json_object_foreach((json_t *)j, k, v) {
            double d;
            if (array_index(k, &d)) continue;
            jv x = jv_cstr(c, k);
            jj_obj_set(c, o.u.o, x.u.s, jj_from_json(c, v));
        }
        jj_leave(c);
        return o;
    }
    }
    return jv_undef();
}

/* ---- JSON out ------------------------------------------------------------ */

/* JSON.stringify of a string, then (ensure_ascii) every UTF-16 unit from
 * 0x7f up as \uXXXX, as the reference's makeAsciiSafe does. */
static void json_str(jj_ctx *c, jj_sb *b, jstr s, bool ascii) {
    static const char hx[] = "0123456789abcdef";
    jj_sb_putc(c, b, '"');
    size_t l;
    for (size_t i = 0; i < s.n; i += l) {
        uint32_t cp = jj_utf8_dec(s.p + i, s.n - i, &l);
        char e[16];
        switch (cp) {
        case '"': jj_sb_put(c, b, "\\\"", 2); continue;
        case '\\': jj_sb_put(c, b, "\\\\", 2); continue;
        case '\b': jj_sb_put(c, b, "\\b", 2); continue;
        case '\f': jj_sb_put(c, b, "\\f", 2); continue;
        case '\n': jj_sb_put(c, b, "\\n", 2); continue;
        case '\r': jj_sb_put(c, b, "\\r", 2); continue;
        case '\t': jj_sb_put(c, b, "\\t", 2); continue;
        default: break;
        }
        if (cp < 0x20 || (ascii && cp >= 0x7f) || (cp >= 0xD800 && cp <= 0xDFFF)) {
            uint32_t u[2] = {cp, 0};
            int nu = 1;
            if (cp >= 0x10000) {
                u[0] = 0xD800 + ((cp - 0x10000) >> 10);
                u[1] = 0xDC00 + ((cp - 0x10000) & 0x3FF);
                nu = 2;
            }
            for (int k = 0; k < nu; k++) {
                e[0] = '\\'; e[1] = 'u';
                for (int d = 0; d < 4; d++) e[2 + d] = hx[(u[k] >> (12 - 4 * d)) & 15];
                jj_sb_put(c, b, e, 6);
            }
            continue;
        }
        jj_sb_put(c, b, s.p + i, l);
    }
    jj_sb_putc(c, b, '"');
}

static void pad(jj_ctx *c, jj_sb *b, int indent, int depth) {
    jj_sb_putc(c, b, '\n');
    for (int i = 0; i < indent * depth; i++) jj_sb_putc(c, b, ' ');
}

void jj_to_json(jj_ctx *c, jj_sb *b, jv v, const jj_json_opts *o, int depth) {
    const char *isep = o->item_sep ? o->item_sep : o->indent ? "," : ", ";
    const char *ksep = o->key_sep ? o->key_sep : ": ";
    char num[40];
    switch (v.t) {
    case JV_NULL: jj_sb_puts(c, b, "null"); return;
    case JV_UNDEF: jj_sb_puts(c, b, o->undef_as_null ? "null" : "undefined"); return;
    case JV_BOOL: jj_sb_puts(c, b, v.u.b ? "true" : "false"); return;
    case JV_INT:
    case JV_FLOAT:
        if (!isfinite(v.u.num)) { jj_sb_puts(c, b, "null"); return; }
        jj_js_num(v.u.num, num);
        jj_sb_puts(c, b, num);
        return;
    case JV_STR: json_str(c, b, v.u.s, o->ensure_ascii); return;
    case JV_ARR: {
        jj_enter(c);
        jj_sb_putc(c, b, '[');
        for (size_t i = 0; i < v.u.a->n; i++) {
            if (i) jj_sb_puts(c, b, isep);
            if (o->indent) pad(c, b, o->indent, depth + 1);
            jj_to_json(c, b, v.u.a->v[i], o, depth + 1);
        }
        if (o->indent && v.u.a->n) pad(c, b, o->indent, depth);
        jj_sb_putc(c, b, ']');
        jj_leave(c);
        return;
    }
    case JV_OBJ:
    case JV_NS:
    case JV_KW: {
        jj_enter(c);
        jj_obj *ob = v.u.o;
        size_t n = ob->n, *ord = n ? jj_alloc(c, n * sizeof *ord) : NULL;
        for (size_t i = 0; i < n; i++) ord[i] = i;
        if (o->sort_keys)
            for (size_t i = 1; i < n; i++)
                for (size_t j = i; j > 0; j--) {
                    jstr x = ob->k[ord[j - 1]], y = ob->k[ord[j]];
                    size_t m = x.n < y.n ? x.n : y.n;
                    int r = m ? memcmp(x.p, y.p, m) : 0;
                    if (r < 0 || (r == 0 && x.n <= y.n)) break;
                    size_t t = ord[j]; ord[j] = ord[j - 1]; ord[j - 1] = t;
                }
        jj_sb_putc(c, b, '{');
        for (size_t i = 0; i < n; i++) {
            if (i) jj_sb_puts(c, b, isep);
            if (o->indent) pad(c, b, o->indent, depth + 1);
            json_str(c, b, ob->k[ord[i]], o->ensure_ascii);
            jj_sb_puts(c, b, ksep);
            jj_to_json(c, b, ob->v[ord[i]], o, depth + 1);
        }
        if (o->indent && n) pad(c, b, o->indent, depth);
        jj_sb_putc(c, b, '}');
        jj_leave(c);
        return;
    }
    case JV_FUNC: jj_fail(c, KV_EFORMAT, "chat template: cannot convert to JSON: FunctionValue");
    }
}

/* ---- truth and text -------------------------------------------------------- */

bool jj_truthy(jv v) {
    switch (v.t) {
    case JV_UNDEF:
    case JV_NULL: return false;
    case JV_BOOL: return v.u.b;
    case JV_INT:
    case JV_FLOAT: return v.u.num != 0 && !isnan(v.u.num);
    case JV_STR: return v.u.s.n > 0;
    case JV_ARR: return v.u.a->n > 0;
    case JV_OBJ:
    case JV_KW: return v.u.o->n > 0;
    default: return true; /* a namespace or a function: a JS object */
    }
}

const char *jj_type_name(jv v) {
    static const char *names[] = {"UndefinedValue", "NullValue", "BooleanValue", "IntegerValue",
                                  "FloatValue", "StringValue", "ArrayValue", "ObjectValue",
                                  "NamespaceValue", "KeywordArgumentsValue", "FunctionValue"};
    if (v.t == JV_ARR && v.tuple) return "TupleValue";
    return names[v.t];
}

/* RuntimeValue.toString(): what {{ v }} prints. */
void jj_str_of(jj_ctx *c, jj_sb *b, jv v) {
    char num[48];
    switch (v.t) {
    case JV_UNDEF: jj_sb_puts(c, b, "undefined"); return;
    case JV_NULL: jj_sb_puts(c, b, "null"); return;
    case JV_BOOL: jj_sb_puts(c, b, v.u.b ? "true" : "false"); return;
    case JV_INT: jj_js_num(v.u.num, num); jj_sb_puts(c, b, num); return;
    case JV_FLOAT:
        if (v.u.num == 0 && signbit(v.u.num)) { jj_sb_puts(c, b, "-0.0"); return; }
        if (isfinite(v.u.num) && v.u.num == floor(v.u.num) && fabs(v.u.num) < 1e21) {
            snprintf(num, sizeof num, "%.1f", v.u.num); /* toFixed(1) */
            jj_sb_puts(c, b, num);
            return;
        }
        jj_js_num(v.u.num, num);
        jj_sb_puts(c, b, num);
        return;
    case JV_STR: jj_sb_put(c, b, v.u.s.p, v.u.s.n); return;
    case JV_ARR:
    case JV_OBJ:
    case JV_NS:
    case JV_KW: {
        jj_json_opts o = {0};
        jj_to_json(c, b, v, &o, 0);
        return;
    }
    case JV_FUNC: jj_fail(c, KV_EFORMAT, "chat template: cannot print a function");
    }
}

/* value.toString() on the underlying JavaScript value, as `~` and string `+`
 * use it: a number without FloatValue's ".0", an array joined by commas of
 * its elements' RuntimeValue text, a map as "[object Map]". */
void jj_raw_str_of(jj_ctx *c, jj_sb *b, jv v) {
    char num[40];
    switch (v.t) {
    case JV_INT:
    case JV_FLOAT: jj_js_num(v.u.num, num); jj_sb_puts(c, b, num); return;
    case JV_ARR:
        jj_enter(c);
        for (size_t i = 0; i < v.u.a->n; i++) {
            if (i) jj_sb_putc(c, b, ',');
            jj_str_of(c, b, v.u.a->v[i]);
        }
        jj_leave(c);
        return;
    case JV_OBJ:
    case JV_NS:
    case JV_KW: jj_sb_puts(c, b, "[object Map]"); return;
    default: jj_str_of(c, b, v); return;
    }
}
