/* Evaluator of the chat-template interpreter and the public API of
 * include/kvasir/chat.h. It follows the reference's runtime.ts: scopes (a
 * for-loop opens one scope for all its iterations; an if does not; a macro
 * runs in a child of its caller's scope), values and their JavaScript
 * coercions, the filters, tests and methods the reference has, and nothing
 * it lacks (an unknown filter is an error there, so it is one here).
 * A break or continue drops the output of the iteration it ends, as the
 * reference's exception does. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chat/jinja_internal.h"

typedef struct env {
    struct env *parent;
    jj_obj vars;
} env;

enum fkind { F_NAMESPACE, F_RAISE, F_RANGE, F_STRFTIME, F_MACRO, F_STR, F_OBJ };

struct jj_func {
    uint8_t kind; /* enum fkind */
    uint8_t id;   /* method index for F_STR / F_OBJ */
    jv self;      /* receiver of a method */
    const jj_node *macro;
};

static const char *k_str_methods[] = {"upper", "lower", "strip", "title", "capitalize", "rstrip",
                                      "lstrip", "startswith", "endswith", "split", "replace", NULL};
static const char *k_obj_methods[] = {"get", "items", "keys", "values", "dictsort", NULL};

enum { CTL_NONE, CTL_BREAK, CTL_CONTINUE };

static jv eval(jj_ctx *c, const jj_node *n, env *e);
static int exec_block(jj_ctx *c, const jj_list *l, env *e, jj_sb *out);

#define EFAIL(c, ...) jj_fail((c), KV_EFORMAT, "chat template: " __VA_ARGS__)

/* ---- scopes ----------------------------------------------------------------- */

static env *env_new(jj_ctx *c, env *parent) {
    env *e = jj_alloc(c, sizeof *e);
    memset(e, 0, sizeof *e);
    e->parent = parent;
    return e;
}

static jv lookup(env *e, jstr name) {
    for (; e; e = e->parent) {
        jv *v = jj_obj_get(&e->vars, name);
        if (v) return *v;
    }
    return jv_undef();
}

static jv mkfunc(jj_ctx *c, uint8_t kind, uint8_t id, jv self, const jj_node *macro) {
    jj_func *f = jj_alloc(c, sizeof *f);
    f->kind = kind;
    f->id = id;
    f->self = self;
    f->macro = macro;
    return (jv){.t = JV_FUNC, .u.f = f};
}

/* ---- helpers -------------------------------------------------------------- */

static bool is_num(jv v) { return v.t == JV_INT || v.t == JV_FLOAT; }
static bool is_numlike(jv v) { return is_num(v) || v.t == JV_BOOL; }
static double numval(jv v) { return v.t == JV_BOOL ? (v.u.b ? 1 : 0) : v.u.num; }
static bool is_container(jv v) { return v.t == JV_OBJ || v.t == JV_NS || v.t == JV_KW; }
static bool is_mapping(jv v) { return v.t == JV_OBJ || v.t == JV_KW; }

static jstr str_of(jj_ctx *c, jv v) {
    if (v.t == JV_STR) return v.u.s;
    jj_sb b = {0};
    jj_str_of(c, &b, v);
    return jj_sb_str(&b);
}

static jstr raw_str(jj_ctx *c, jv v) {
    if (v.t == JV_STR) return v.u.s;
    jj_sb b = {0};
    jj_raw_str_of(c, &b, v);
    return jj_sb_str(&b);
}

static jv cat(jj_ctx *c, jstr a, jstr b) {
    jj_sb s = {0};
    jj_sb_put(c, &s, a.p, a.n);
    jj_sb_put(c, &s, b.p, b.n);
    return jv_str(jj_sb_str(&s));
}

static bool contains(jstr hay, jstr needle, size_t *at) {
    if (needle.n == 0) { if (at) *at = 0; return true; }
    for (size_t i = 0; i + needle.n <= hay.n; i++)
        if (!memcmp(hay.p + i, needle.p, needle.n)) { if (at) *at = i; return true; }
    return false;
}

/* JavaScript ToNumber of a string (for loose ==). */
static double str_to_num(jstr s) {
    s = jj_js_trim(s, true, true);
    if (s.n == 0) return 0;
    char buf[64];
    if (s.n >= sizeof buf) return NAN;
    memcpy(buf, s.p, s.n);
    buf[s.n] = 0;
    char *end;
    double v = strtod(buf, &end);
    if (*end) return NAN;
    return v;
}

/* a.value === b.value */
static bool strict_eq(jv a, jv b) {
    if (is_num(a) && is_num(b)) return a.u.num == b.u.num;
    if (a.t != b.t) return false;
    switch (a.t) {
    case JV_UNDEF:
    case JV_NULL: return true;
    case JV_BOOL: return a.u.b == b.u.b;
    case JV_STR: return jstr_same(a.u.s, b.u.s);
    case JV_ARR: return a.u.a == b.u.a;
    case JV_FUNC: return a.u.f == b.u.f;
    default: return a.u.o == b.u.o;
    }
}

/* a.value == b.value (JavaScript loose equality on the underlying values) */
static bool loose_eq(jv a, jv b) {
    bool an = a.t == JV_NULL || a.t == JV_UNDEF, bn = b.t == JV_NULL || b.t == JV_UNDEF;
    if (an || bn) return an && bn;
    if (a.t == JV_STR && b.t == JV_STR) return jstr_same(a.u.s, b.u.s);
    bool ap = is_numlike(a) || a.t == JV_STR, bp = is_numlike(b) || b.t == JV_STR;
    if (ap && bp) {
        double x = a.t == JV_STR ? str_to_num(a.u.s) : numval(a);
        double y = b.t == JV_STR ? str_to_num(b.u.s) : numval(b);
        return x == y;
    }
    if (!ap && !bp) return strict_eq(a, b);
    return false;
}

static int cmp_values(jj_ctx *c, jv a, jv b, bool case_sensitive) {
    if (a.t == JV_NULL && b.t == JV_NULL) return 0;
    if (a.t == JV_NULL || b.t == JV_NULL) EFAIL(c, "cannot compare %s with %s", jj_type_name(a), jj_type_name(b));
    if (a.t == JV_UNDEF && b.t == JV_UNDEF) return 0;
    if (a.t == JV_UNDEF || b.t == JV_UNDEF) EFAIL(c, "cannot compare %s with %s", jj_type_name(a), jj_type_name(b));
    if (is_numlike(a) && is_numlike(b)) {
        double x = numval(a), y = numval(b);
        return x < y ? -1 : x > y ? 1 : 0;
    }
    if (a.t != b.t) EFAIL(c, "cannot compare different types: %s and %s", jj_type_name(a), jj_type_name(b));
    if (a.t != JV_STR) EFAIL(c, "cannot compare type: %s", jj_type_name(a));
    jstr x = a.u.s, y = b.u.s;
    size_t m = x.n < y.n ? x.n : y.n;
    for (size_t i = 0; i < m; i++) {
        int p = (unsigned char)x.p[i], q = (unsigned char)y.p[i];
        if (!case_sensitive) {
            if (p >= 'A' && p <= 'Z') p += 32;
            if (q >= 'A' && q <= 'Z') q += 32;
        }
        if (p != q) return p < q ? -1 : 1;
    }
    return x.n < y.n ? -1 : x.n > y.n ? 1 : 0;
}

static jstr case_map(jj_ctx *c, jstr s, int mode /* 1 upper, 2 lower */) {
    char *p = jj_alloc(c, s.n + 1);
    for (size_t i = 0; i < s.n; i++) {
        char ch = s.p[i];
        if (mode == 1 && ch >= 'a' && ch <= 'z') ch -= 32;
        if (mode == 2 && ch >= 'A' && ch <= 'Z') ch += 32;
        p[i] = ch;
    }
    return (jstr){p, s.n};
}

static bool wordc(char ch) {
    return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || ch == '_';
}

static jstr title_case(jj_ctx *c, jstr s) {
    char *p = jj_alloc(c, s.n + 1);
    for (size_t i = 0; i < s.n; i++) {
        char ch = s.p[i];
        if (wordc(ch) && (i == 0 || !wordc(s.p[i - 1])) && ch >= 'a' && ch <= 'z') ch -= 32;
        p[i] = ch;
    }
    return (jstr){p, s.n};
}

/* The code points of s as an array of strings (Array.from(string)). */
static jj_arr *code_points(jj_ctx *c, jstr s) {
    jv a = jv_arr_new(c, 0);
    size_t l;
    for (size_t i = 0; i < s.n; i += l) {
        jj_utf8_dec(s.p + i, s.n - i, &l);
        jj_step(c, 1);
        jj_arr_push(c, a.u.a, jv_str((jstr){s.p + i, l}));
    }
    return a.u.a;
}

/* The reference's slice() over n items; writes the chosen indices. */
static size_t slice_idx(jj_ctx *c, size_t n, jv start, jv stop, jv step, long long **out) {
    double st = step.t == JV_UNDEF ? 1 : step.u.num;
    double N = (double)n, a, b;
    int dir = st > 0 ? 1 : st < 0 ? -1 : 0;
    if (dir >= 0) {
        a = start.t == JV_UNDEF ? 0 : start.u.num;
        a = a < 0 ? fmax(N + a, 0) : fmin(a, N);
        b = stop.t == JV_UNDEF ? N : stop.u.num;
        b = b < 0 ? fmax(N + b, 0) : fmin(b, N);
    } else {
        a = start.t == JV_UNDEF ? N - 1 : start.u.num;
        a = a < 0 ? fmax(N + a, -1) : fmin(a, N - 1);
        b = stop.t == JV_UNDEF ? -1 : stop.u.num;
        b = b < -1 ? fmax(N + b, -1) : fmin(b, N - 1);
    }
    if (dir == 0) EFAIL(c, "slice step cannot be zero");
    size_t k = 0, cap = 16;
    long long *idx = jj_alloc(c, cap * sizeof *idx);
    for (double i = a; dir * i < dir * b; i += st) {
        jj_step(c, 1);
        if (k == cap) {
            long long *ni = jj_alloc(c, cap * 2 * sizeof *ni);
            memcpy(ni, idx, k * sizeof *ni);
            idx = ni;
            cap *= 2;
        }
        idx[k++] = (long long)i;
    }
    *out = idx;
    return k;
}

/* String.prototype.at over UTF-16 units. */
static jv str_at(jj_ctx *c, jstr s, double i) {
    double n = (double)jj_utf16_len(s);
    if (i < 0) i += n;
    if (i < 0 || i >= n) return jv_undef();
    size_t u = 0, l;
    for (size_t b = 0; b < s.n; b += l) {
        uint32_t cp = jj_utf8_dec(s.p + b, s.n - b, &l);
        size_t w = cp >= 0x10000 ? 2 : 1;
        if ((double)u == i && w == 1) return jv_str((jstr){s.p + b, l});
        if (i < (double)(u + w)) {
            /* half of a surrogate pair: the reference yields a lone surrogate */
            uint32_t half = (double)u == i ? 0xD800 + ((cp - 0x10000) >> 10) : 0xDC00 + ((cp - 0x10000) & 0x3FF);
            char *p = jj_alloc(c, 4);
            size_t k = jj_utf8_enc(half, p);
            return jv_str((jstr){p, k});
        }
        u += w;
    }
    return jv_undef();
}

/* ---- strftime_now ----------------------------------------------------------- */

static jv strftime_now(jj_ctx *c, jstr fmt) {
    static const char *mon_s[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
    static const char *mon_l[] = {"January", "February", "March", "April", "May", "June", "July",
                                  "August", "September", "October", "November", "December"};
    time_t t = (time_t)c->now_unix;
    struct tm tm;
    gmtime_r(&t, &tm);
    jj_sb b = {0};
    char tmp[32];
    for (size_t i = 0; i < fmt.n; i++) {
        if (fmt.p[i] == '%' && i + 1 < fmt.n && strchr("YmdbBHM%", fmt.p[i + 1])) {
            switch (fmt.p[++i]) {
            case 'Y': snprintf(tmp, sizeof tmp, "%d", tm.tm_year + 1900); break;
            case 'm': snprintf(tmp, sizeof tmp, "%02d", tm.tm_mon + 1); break;
            case 'd': snprintf(tmp, sizeof tmp, "%02d", tm.tm_mday); break;
            case 'b': snprintf(tmp, sizeof tmp, "%s", mon_s[tm.tm_mon]); break;
            case 'B': snprintf(tmp, sizeof tmp, "%s", mon_l[tm.tm_mon]); break;
            case 'H': snprintf(tmp, sizeof tmp, "%02d", tm.tm_hour); break;
            case 'M': snprintf(tmp, sizeof tmp, "%02d", tm.tm_min); break;
            default: snprintf(tmp, sizeof tmp, "%%"); break;
            }
            jj_sb_puts(c, &b, tmp);
        } else {
            jj_sb_putc(c, &b, fmt.p[i]);
        }
    }
    return jv_str(jj_sb_str(&b));
}

/* ---- string methods --------------------------------------------------------- */

static jv split_str(jj_ctx *c, jstr s, jv sep, jv maxsplit) {
    if (sep.t != JV_STR && sep.t != JV_NULL) EFAIL(c, "sep argument must be a string or null");
    if (maxsplit.t != JV_INT) EFAIL(c, "maxsplit argument must be a number");
    double max = maxsplit.u.num;
    jv r = jv_arr_new(c, 0);
    if (sep.t == JV_NULL) {
        jstr t = jj_js_trim(s, true, false);
        size_t i = 0, l;
        while (i < t.n) {
            while (i < t.n && jj_js_space(jj_utf8_dec(t.p + i, t.n - i, &l))) i += l;
            if (i >= t.n) break;
            size_t b = i;
            while (i < t.n && !jj_js_space(jj_utf8_dec(t.p + i, t.n - i, &l))) i += l;
            jj_step(c, 1);
            if (max != -1 && (double)r.u.a->n >= max) {
                jj_arr_push(c, r.u.a, jv_str((jstr){t.p + b, t.n - b}));
                break;
            }
            jj_arr_push(c, r.u.a, jv_str((jstr){t.p + b, i - b}));
        }
        return r;
    }
    jstr p = sep.u.s;
    if (p.n == 0) EFAIL(c, "empty separator");
    size_t i = 0, at;
    for (;;) {
        jj_step(c, 1);
        jstr rest = {s.p + i, s.n - i};
        bool more = (max == -1 || (double)r.u.a->n < max) && contains(rest, p, &at);
        if (!more) {
            jj_arr_push(c, r.u.a, jv_str(rest));
            break;
        }
        jj_arr_push(c, r.u.a, jv_str((jstr){s.p + i, at}));
        i += at + p.n;
    }
    return r;
}

static jv replace_str(jj_ctx *c, jstr s, jstr old, jstr neu, double count /* < 0: all */) {
    if (count == 0) return jv_str(s);
    jj_sb b = {0};
    double left = count < 0 ? INFINITY : count;
    if (old.n == 0) {
        /* (?=) with the u flag: a match before every code point and at the end */
        size_t l;
        for (size_t i = 0; i <= s.n; i += l) {
            jj_step(c, 1);
            if (left > 0) { jj_sb_put(c, &b, neu.p, neu.n); left--; }
            if (i == s.n) break;
            jj_utf8_dec(s.p + i, s.n - i, &l);
            jj_sb_put(c, &b, s.p + i, l);
        }
        return jv_str(jj_sb_str(&b));
    }
    size_t i = 0, at;
    while (left > 0 && contains((jstr){s.p + i, s.n - i}, old, &at)) {
        jj_step(c, 1);
        jj_sb_put(c, &b, s.p + i, at);
        jj_sb_put(c, &b, neu.p, neu.n);
        i += at + old.n;
        left--;
    }
    jj_sb_put(c, &b, s.p + i, s.n - i);
    return jv_str(jj_sb_str(&b));
}

static bool starts_ends(jj_ctx *c, jstr s, jv pat, bool ends, const char *name) {
    if (pat.t == JV_STR) {
        jstr p = pat.u.s;
        return p.n <= s.n && (p.n == 0 || !memcmp(ends ? s.p + s.n - p.n : s.p, p.p, p.n));
    }
    if (pat.t == JV_ARR) {
        for (size_t i = 0; i < pat.u.a->n; i++) {
            if (pat.u.a->v[i].t != JV_STR) EFAIL(c, "%s() tuple elements must be strings", name);
            if (starts_ends(c, s, pat.u.a->v[i], ends, name)) return true;
        }
        return false;
    }
    EFAIL(c, "%s() argument must be a string or tuple of strings", name);
}

static jv call_str_method(jj_ctx *c, int id, jstr s, jv *a, size_t na) {
    jv undef = jv_undef();
    switch (id) {
    case 0: return jv_str(case_map(c, s, 1));
    case 1: return jv_str(case_map(c, s, 2));
    case 2: return jv_str(jj_js_trim(s, true, true));
    case 3: return jv_str(title_case(c, s));
    case 4: {
        if (s.n == 0) return jv_str(s);
        size_t l;
        jj_utf8_dec(s.p, s.n, &l);
        return jv_str(cat(c, case_map(c, (jstr){s.p, l}, 1), (jstr){s.p + l, s.n - l}).u.s);
    }
    case 5: return jv_str(jj_js_trim(s, false, true));
    case 6: return jv_str(jj_js_trim(s, true, false));
    case 7:
    case 8:
        if (na == 0) EFAIL(c, "%s() requires at least one argument", k_str_methods[id]);
        return jv_bool(starts_ends(c, s, a[0], id == 8, k_str_methods[id]));
    case 9: return split_str(c, s, na > 0 ? a[0] : jv_null(), na > 1 ? a[1] : jv_int(-1));
    case 10: {
        if (na < 2) EFAIL(c, "replace() requires at least two arguments");
        if (a[0].t != JV_STR || a[1].t != JV_STR) EFAIL(c, "replace() arguments must be strings");
        jv count = jv_null();
        if (na > 2) {
            if (a[2].t == JV_KW) {
                jv *k = jj_obj_get(a[2].u.o, (jstr){"count", 5});
                count = k ? *k : jv_null();
            } else {
                count = a[2];
            }
        }
        if (count.t != JV_INT && count.t != JV_NULL) EFAIL(c, "replace() count argument must be a number or null");
        return replace_str(c, s, a[0].u.s, a[1].u.s, count.t == JV_NULL ? -1 : count.u.num);
    }
    }
    (void)undef;
    return jv_undef();
}

/* ---- object methods --------------------------------------------------------- */

static jv obj_items(jj_ctx *c, jj_obj *o) {
    jv r = jv_arr_new(c, 0);
    for (size_t i = 0; i < o->n; i++) {
        jj_step(c, 1);
        jv p = jv_arr_new(c, 0);
        jj_arr_push(c, p.u.a, jv_str(o->k[i]));
        jj_arr_push(c, p.u.a, o->v[i]);
        jj_arr_push(c, r.u.a, p);
    }
    return r;
}

static jv obj_keys(jj_ctx *c, jj_obj *o) {
    jv r = jv_arr_new(c, 0);
    for (size_t i = 0; i < o->n; i++) jj_arr_push(c, r.u.a, jv_str(o->k[i]));
    return r;
}

/* Stable insertion sort by cmp_values (the reference's Array.sort is
 * stable too); bounded by the loop limit, n^2 steps. */
typedef struct sort_key {
    jv key, item;
} sort_key;

static void sort_keys(jj_ctx *c, sort_key *v, size_t n, bool reverse, bool cs) {
    for (size_t i = 1; i < n; i++) {
        for (size_t j = i; j > 0; j--) {
            jj_step(c, 1);
            int r = cmp_values(c, v[j - 1].key, v[j].key, cs);
            if (reverse) r = -r;
            if (r <= 0) break;
            sort_key t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    }
}

static jv kwget(jv *a, size_t na, const char *k) {
    if (na && a[na - 1].t == JV_KW) {
        jv *v = jj_obj_get(a[na - 1].u.o, (jstr){k, strlen(k)});
        if (v) return *v;
    }
    return (jv){.t = 255};
}
static bool given(jv v) { return v.t != 255; }

static jv call_obj_method(jj_ctx *c, int id, jj_obj *o, jv *a, size_t na) {
    switch (id) {
    case 0: {
        jv key = na > 0 ? a[0] : jv_undef();
        if (key.t != JV_STR) EFAIL(c, "object key must be a string: got %s", jj_type_name(key));
        jv *v = jj_obj_get(o, key.u.s);
        if (v) return *v;
        return na > 1 ? a[1] : jv_null();
    }
    case 1: return obj_items(c, o);
    case 2: return obj_keys(c, o);
    case 3: {
        jv r = jv_arr_new(c, 0);
        for (size_t i = 0; i < o->n; i++) jj_arr_push(c, r.u.a, o->v[i]);
        return r;
    }
    case 4: {
        size_t np = na && a[na - 1].t == JV_KW ? na - 1 : na;
        jv cs = np > 0 ? a[0] : kwget(a, na, "case_sensitive");
        if (!given(cs)) cs = jv_bool(false);
        if (cs.t != JV_BOOL) EFAIL(c, "case_sensitive must be a boolean");
        jv by = np > 1 ? a[1] : kwget(a, na, "by");
        if (!given(by)) by = jv_cstr(c, "key");
        if (by.t != JV_STR) EFAIL(c, "by must be a string");
        bool by_key = jstr_eq(by.u.s, "key");
        if (!by_key && !jstr_eq(by.u.s, "value")) EFAIL(c, "by must be either 'key' or 'value'");
        jv rev = np > 2 ? a[2] : kwget(a, na, "reverse");
        if (!given(rev)) rev = jv_bool(false);
        if (rev.t != JV_BOOL) EFAIL(c, "reverse must be a boolean");
        jv items = obj_items(c, o);
        size_t n = items.u.a->n;
        sort_key *k = jj_alloc(c, (n ? n : 1) * sizeof *k);
        for (size_t i = 0; i < n; i++) {
            k[i].item = items.u.a->v[i];
            k[i].key = items.u.a->v[i].u.a->v[by_key ? 0 : 1];
        }
        sort_keys(c, k, n, rev.u.b, cs.u.b);
        for (size_t i = 0; i < n; i++) items.u.a->v[i] = k[i].item;
        return items;
    }
    }
    return jv_undef();
}

/* ---- calls -------------------------------------------------------------------- */

typedef struct args {
    jv *v;
    size_t n;
} args;

/* Evaluates a call's arguments as the reference does: positional ones
 * (spreads expanded), then keywords gathered into one KeywordArgumentsValue
 * appended last when there are any. */
static args eval_args(jj_ctx *c, const jj_list *l, env *e, jj_obj **kw_out) {
    jv pos = jv_arr_new(c, 0), kw = jv_obj_new(c, JV_KW);
    for (size_t i = 0; i < l->n; i++) {
        const jj_node *a = l->v[i];
        if (a->kind == N_SPREAD) {
            jv v = eval(c, a->a, e);
            if (v.t != JV_ARR) EFAIL(c, "cannot unpack non-iterable type: %s", jj_type_name(v));
            for (size_t k = 0; k < v.u.a->n; k++) jj_arr_push(c, pos.u.a, v.u.a->v[k]);
        } else if (a->kind != N_KWARG && a->kind != N_KWSPREAD) {
            jj_arr_push(c, pos.u.a, eval(c, a, e));
        }
    }
    for (size_t i = 0; i < l->n; i++) {
        const jj_node *a = l->v[i];
        if (a->kind == N_KWARG) {
            if (jj_obj_get(kw.u.o, a->s)) EFAIL(c, "got multiple values for keyword argument '%.*s'", (int)a->s.n, a->s.p);
            jj_obj_set(c, kw.u.o, a->s, eval(c, a->a, e));
        } else if (a->kind == N_KWSPREAD) {
            jv v = eval(c, a->a, e);
            if (!is_mapping(v)) EFAIL(c, "argument after ** must be a mapping, not %s", jj_type_name(v));
            for (size_t k = 0; k < v.u.o->n; k++) {
                if (jj_obj_get(kw.u.o, v.u.o->k[k])) EFAIL(c, "got multiple values for a keyword argument");
                jj_obj_set(c, kw.u.o, v.u.o->k[k], v.u.o->v[k]);
            }
        }
    }
    if (kw_out) *kw_out = kw.u.o;
    return (args){pos.u.a->v, pos.u.a->n};
}

static args with_kw(jj_ctx *c, args a, jj_obj *kw) {
    if (kw->n == 0) return a;
    jv *v = jj_alloc(c, (a.n + 1) * sizeof *v);
    if (a.n) memcpy(v, a.v, a.n * sizeof *v);
    v[a.n] = (jv){.t = JV_KW, .u.o = kw};
    return (args){v, a.n + 1};
}

static jv call_macro(jj_ctx *c, const jj_node *m, args a, env *caller) {
    env *s = env_new(c, caller);
    size_t np = a.n;
    jj_obj *kw = NULL;
    if (np && a.v[np - 1].t == JV_KW) {
        /* a copy: binding removes what it uses */
        jj_obj *src = a.v[--np].u.o;
        kw = jv_obj_new(c, JV_KW).u.o;
        for (size_t i = 0; i < src->n; i++) jj_obj_set(c, kw, src->k[i], src->v[i]);
    }
    bool *pending = jj_alloc(c, (m->l1.n + 1) * sizeof *pending);
    for (size_t i = 0; i < m->l1.n; i++) {
        const jj_node *p = m->l1.v[i];
        jv v = jv_undef();
        bool have = false;
        if (i < np) { v = a.v[i]; have = true; }
        if (!have && kw) {
            jv *k = jj_obj_get(kw, p->s);
            if (k) {
                v = *k;
                have = true;
                /* remove it */
                size_t at = (size_t)(k - kw->v);
                for (size_t j = at + 1; j < kw->n; j++) { kw->k[j - 1] = kw->k[j]; kw->v[j - 1] = kw->v[j]; }
                kw->n--;
            }
        }
        pending[i] = !have && p->kind == N_KWARG;
        jj_obj_set(c, &s->vars, p->s, v);
    }
    if (m->flag & 1) {
        jv k = jv_obj_new(c, JV_OBJ);
        if (kw) k.u.o = kw, k.t = JV_OBJ;
        jj_obj_set(c, &s->vars, (jstr){"kwargs", 6}, k);
    } else if (kw && kw->n) {
        EFAIL(c, "macro '%.*s' takes no keyword argument '%.*s'", (int)m->s.n, m->s.p, (int)kw->k[0].n, kw->k[0].p);
    }
    if (m->flag & 2) {
        jv va = jv_arr_new(c, 0);
        for (size_t i = m->l1.n; i < np; i++) jj_arr_push(c, va.u.a, a.v[i]);
        jj_obj_set(c, &s->vars, (jstr){"varargs", 7}, va);
    } else if (np > m->l1.n) {
        EFAIL(c, "macro '%.*s' takes not more than %zu argument(s)", (int)m->s.n, m->s.p, m->l1.n);
    }
    for (size_t i = 0; i < m->l1.n; i++)
        if (pending[i]) jj_obj_set(c, &s->vars, m->l1.v[i]->s, eval(c, m->l1.v[i]->a, s));
    jj_sb out = {0};
    jj_enter(c);
    int ctl = exec_block(c, &m->l2, s, &out);
    jj_leave(c);
    if (ctl != CTL_NONE) EFAIL(c, "break or continue outside a loop");
    return jv_str(jj_sb_str(&out));
}

static jv call_value(jj_ctx *c, jv fn, args a, env *e) {
    if (fn.t != JV_FUNC) EFAIL(c, "cannot call something that is not a function: got %s", jj_type_name(fn));
    jj_func *f = fn.u.f;
    switch (f->kind) {
    case F_MACRO: return call_macro(c, f->macro, a, e);
    case F_STR: return call_str_method(c, f->id, f->self.u.s, a.v, a.n);
    case F_OBJ: return call_obj_method(c, f->id, f->self.u.o, a.v, a.n);
    case F_RAISE: {
        jstr m = {"", 0};
        if (a.n > 0) m = a.v[0].t == JV_UNDEF ? (jstr){"", 0} : raw_str(c, a.v[0]);
        c->code = KV_EINVAL;
        if (c->diag) {
            size_t k = m.n < sizeof c->diag->msg - 1 ? m.n : sizeof c->diag->msg - 1;
            memcpy(c->diag->msg, m.p, k);
            c->diag->msg[k] = 0;
            c->diag->code = KV_EINVAL;
        }
        longjmp(c->jmp, 1);
    }
    case F_RANGE: {
        for (size_t i = 0; i < a.n && i < 3; i++)
            if (!is_num(a.v[i])) EFAIL(c, "range() arguments must be numbers");
        if (a.n == 0) EFAIL(c, "range() expects at least one argument");
        double start = 0, stop, step = 1;
        if (a.n == 1) stop = a.v[0].u.num;
        else {
            start = a.v[0].u.num;
            stop = a.v[1].u.num;
            if (a.n > 2) step = a.v[2].u.num;
        }
        if (step == 0) EFAIL(c, "range() step must not be zero");
        jv r = jv_arr_new(c, 0);
        for (double i = start; step > 0 ? i < stop : i > stop; i += step) {
            jj_step(c, 1);
            jj_arr_push(c, r.u.a, i == floor(i) ? jv_int(i) : jv_float(i));
        }
        return r;
    }
    case F_STRFTIME: {
        if (a.n == 0 || a.v[0].t != JV_STR) EFAIL(c, "strftime_now() expects a format string");
        return strftime_now(c, a.v[0].u.s);
    }
    case F_NAMESPACE: {
        size_t np = a.n;
        jj_obj *kw = NULL;
        if (np && a.v[np - 1].t == JV_KW) kw = a.v[--np].u.o;
        if (np > 1) EFAIL(c, "namespace expected at most 1 argument, got %zu", np);
        jv ns = jv_obj_new(c, JV_NS);
        if (np == 1) {
            jv src = a.v[0];
            if (is_mapping(src)) {
                for (size_t i = 0; i < src.u.o->n; i++) jj_obj_set(c, ns.u.o, src.u.o->k[i], src.u.o->v[i]);
            } else if (src.t == JV_ARR) {
                for (size_t i = 0; i < src.u.a->n; i++) {
                    jv p = src.u.a->v[i];
                    if (p.t != JV_ARR || p.u.a->n != 2)
                        EFAIL(c, "namespace expected an object or an iterable of [key, value] pairs");
                    if (p.u.a->v[0].t != JV_STR) EFAIL(c, "namespace keys must be strings");
                    jj_obj_set(c, ns.u.o, p.u.a->v[0].u.s, p.u.a->v[1]);
                }
            } else {
                EFAIL(c, "'%s' object is not iterable", jj_type_name(src));
            }
        }
        if (kw)
            for (size_t i = 0; i < kw->n; i++) jj_obj_set(c, ns.u.o, kw->k[i], kw->v[i]);
        return ns;
    }
    }
    return jv_undef();
}

/* ---- member access ---------------------------------------------------------- */

static jv builtin_of(jj_ctx *c, jv obj, jstr name) {
    if (obj.t == JV_STR) {
        if (jstr_eq(name, "length")) return jv_int((double)jj_utf16_len(obj.u.s));
        for (int i = 0; k_str_methods[i]; i++)
            if (jstr_eq(name, k_str_methods[i])) return mkfunc(c, F_STR, (uint8_t)i, obj, NULL);
    } else if (obj.t == JV_ARR) {
        if (jstr_eq(name, "length")) return jv_int((double)obj.u.a->n);
    } else if (obj.t == JV_OBJ || obj.t == JV_KW) {
        for (int i = 0; k_obj_methods[i]; i++)
            if (jstr_eq(name, k_obj_methods[i])) return mkfunc(c, F_OBJ, (uint8_t)i, obj, NULL);
    }
    return jv_undef();
}

static jv member(jj_ctx *c, jv obj, jv prop) {
    if (is_container(obj)) {
        if (prop.t != JV_STR) EFAIL(c, "cannot access property with non-string: got %s", jj_type_name(prop));
        jv *v = jj_obj_get(obj.u.o, prop.u.s);
        if (v) return *v;
        return obj.t == JV_NS ? jv_undef() : builtin_of(c, obj, prop.u.s);
    }
    if (obj.t == JV_ARR || obj.t == JV_STR) {
        if (prop.t == JV_INT) {
            if (obj.t == JV_STR) return str_at(c, obj.u.s, prop.u.num);
            double i = prop.u.num, n = (double)obj.u.a->n;
            if (i < 0) i += n;
            if (i < 0 || i >= n) return jv_undef();
            return obj.u.a->v[(size_t)i];
        }
        if (prop.t == JV_STR) return builtin_of(c, obj, prop.u.s);
        EFAIL(c, "cannot access property with non-string/non-number: got %s", jj_type_name(prop));
    }
    if (prop.t != JV_STR) EFAIL(c, "cannot access property with non-string: got %s", jj_type_name(prop));
    return jv_undef();
}

static jv eval_slice(jj_ctx *c, jv obj, const jj_node *s, env *e) {
    if (obj.t != JV_ARR && obj.t != JV_STR) EFAIL(c, "slice object must be an array or string");
    jv a = s->a ? eval(c, s->a, e) : jv_undef();
    jv b = s->b ? eval(c, s->b, e) : jv_undef();
    jv st = s->c ? eval(c, s->c, e) : jv_undef();
    if ((a.t != JV_INT && a.t != JV_UNDEF) || (b.t != JV_INT && b.t != JV_UNDEF) || (st.t != JV_INT && st.t != JV_UNDEF))
        EFAIL(c, "slice indices must be integers or undefined");
    jj_arr *src = obj.t == JV_ARR ? obj.u.a : code_points(c, obj.u.s);
    long long *idx;
    size_t k = slice_idx(c, src->n, a, b, st, &idx);
    if (obj.t == JV_ARR) {
        jv r = jv_arr_new(c, 0);
        for (size_t i = 0; i < k; i++)
            jj_arr_push(c, r.u.a, idx[i] >= 0 && (size_t)idx[i] < src->n ? src->v[idx[i]] : jv_undef());
        return r;
    }
    jj_sb sb = {0};
    for (size_t i = 0; i < k; i++)
        if (idx[i] >= 0 && (size_t)idx[i] < src->n) jj_sb_put(c, &sb, src->v[idx[i]].u.s.p, src->v[idx[i]].u.s.n);
    return jv_str(jj_sb_str(&sb));
}

/* ---- tests ---------------------------------------------------------------------- */

static int run_test(jj_ctx *c, jstr name, jv v, jv arg, bool has_arg) {
    if (jstr_eq(name, "boolean")) return v.t == JV_BOOL;
    if (jstr_eq(name, "callable")) return v.t == JV_FUNC;
    if (jstr_eq(name, "odd") || jstr_eq(name, "even")) {
        if (v.t != JV_INT) EFAIL(c, "cannot %.*s on %s", (int)name.n, name.p, jj_type_name(v));
        bool odd = fmod(v.u.num, 2) != 0;
        return jstr_eq(name, "odd") ? odd : !odd;
    }
    if (jstr_eq(name, "false")) return v.t == JV_BOOL && !v.u.b;
    if (jstr_eq(name, "true")) return v.t == JV_BOOL && v.u.b;
    if (jstr_eq(name, "none")) return v.t == JV_NULL;
    if (jstr_eq(name, "string")) return v.t == JV_STR;
    if (jstr_eq(name, "number")) return is_num(v);
    if (jstr_eq(name, "integer")) return v.t == JV_INT;
    if (jstr_eq(name, "iterable")) return v.t == JV_ARR || v.t == JV_STR;
    if (jstr_eq(name, "mapping")) return is_mapping(v);
    if (jstr_eq(name, "sequence")) return v.t == JV_ARR || is_mapping(v) || v.t == JV_STR;
    if (jstr_eq(name, "lower") || jstr_eq(name, "upper")) {
        if (v.t != JV_STR) return false;
        jstr m = case_map(c, v.u.s, jstr_eq(name, "lower") ? 2 : 1);
        return jstr_same(m, v.u.s);
    }
    if (jstr_eq(name, "defined")) return v.t != JV_UNDEF;
    if (jstr_eq(name, "undefined")) return v.t == JV_UNDEF;
    if (jstr_eq(name, "equalto") || jstr_eq(name, "eq")) {
        if (!has_arg) EFAIL(c, "the %.*s test needs a value", (int)name.n, name.p);
        return strict_eq(v, arg);
    }
    return -1;
}

/* ---- filters ------------------------------------------------------------------ */

static jv to_json_str(jj_ctx *c, jv v, const jj_json_opts *o) {
    jj_sb b = {0};
    jj_to_json(c, &b, v, o, 0);
    return jv_str(jj_sb_str(&b));
}

/* Array.prototype.join on the underlying values: null and undefined as "". */
static jv join_values(jj_ctx *c, jj_arr *a, jstr sep) {
    jj_sb b = {0};
    for (size_t i = 0; i < a->n; i++) {
        jj_step(c, 1);
        if (i) jj_sb_put(c, &b, sep.p, sep.n);
        jv x = a->v[i];
        if (x.t == JV_NULL || x.t == JV_UNDEF) continue;
        jj_raw_str_of(c, &b, x);
    }
    return jv_str(jj_sb_str(&b));
}

static double parse_int_js(jstr s, bool *nan) {
    s = jj_js_trim(s, true, false);
    size_t i = 0;
    bool neg = false;
    if (i < s.n && (s.p[i] == '+' || s.p[i] == '-')) neg = s.p[i++] == '-';
    double v = 0;
    size_t d0 = i;
    while (i < s.n && s.p[i] >= '0' && s.p[i] <= '9') v = v * 10 + (s.p[i++] - '0');
    *nan = i == d0;
    return neg ? -v : v;
}

static double parse_float_js(jstr s, bool *nan) {
    s = jj_js_trim(s, true, false);
    char buf[128];
    size_t k = s.n < sizeof buf - 1 ? s.n : sizeof buf - 1;
    memcpy(buf, s.p, k);
    buf[k] = 0;
    /* strtod also reads hex and "inf"/"nan"; parseFloat reads only decimal and Infinity */
    size_t i = (buf[0] == '+' || buf[0] == '-') ? 1 : 0;
    if (!strncmp(buf + i, "Infinity", 8)) { *nan = false; return buf[0] == '-' ? -INFINITY : INFINITY; }
    if (!((buf[i] >= '0' && buf[i] <= '9') || (buf[i] == '.' && buf[i + 1] >= '0' && buf[i + 1] <= '9'))) {
        *nan = true;
        return 0;
    }
    if (buf[i] == '0' && (buf[i + 1] == 'x' || buf[i + 1] == 'X')) { *nan = false; return 0; }
    *nan = false;
    return strtod(buf, NULL);
}

static jv filter_plain(jj_ctx *c, jv v, jstr name) {
#define IS(z) jstr_eq(name, z)
    if (IS("safe")) return v;
    if (IS("tojson")) {
        jj_json_opts o = {.undef_as_null = true};
        return to_json_str(c, v, &o);
    }
    if (v.t == JV_ARR) {
        jj_arr *a = v.u.a;
        if (IS("list")) return v;
        if (IS("first") || IS("last")) {
            if (a->n == 0) EFAIL(c, "%.*s of an empty array", (int)name.n, name.p);
            return a->v[IS("first") ? 0 : a->n - 1];
        }
        if (IS("length")) return jv_int((double)a->n);
        if (IS("reverse")) {
            jv r = jv_arr_new(c, 0);
            for (size_t i = a->n; i > 0; i--) jj_arr_push(c, r.u.a, a->v[i - 1]);
            return r;
        }
        if (IS("sort")) {
            sort_key *k = jj_alloc(c, (a->n ? a->n : 1) * sizeof *k);
            for (size_t i = 0; i < a->n; i++) k[i] = (sort_key){a->v[i], a->v[i]};
            sort_keys(c, k, a->n, false, false);
            jv r = jv_arr_new(c, 0);
            for (size_t i = 0; i < a->n; i++) jj_arr_push(c, r.u.a, k[i].item);
            return r;
        }
        if (IS("join")) return join_values(c, a, (jstr){"", 0});
        if (IS("string")) {
            jj_json_opts o = {0};
            return to_json_str(c, v, &o);
        }
        if (IS("unique")) {
            jv r = jv_arr_new(c, 0);
            for (size_t i = 0; i < a->n; i++) {
                bool seen = false;
                for (size_t j = 0; j < r.u.a->n && !seen; j++) {
                    jj_step(c, 1);
                    jv x = a->v[i], y = r.u.a->v[j];
                    seen = strict_eq(x, y) || (is_num(x) && is_num(y) && isnan(x.u.num) && isnan(y.u.num));
                }
                if (!seen) jj_arr_push(c, r.u.a, a->v[i]);
            }
            return r;
        }
        EFAIL(c, "unknown ArrayValue filter: %.*s", (int)name.n, name.p);
    }
    if (v.t == JV_STR) {
        jstr s = v.u.s;
        if (IS("length")) return jv_int((double)jj_utf16_len(s));
        if (IS("upper")) return jv_str(case_map(c, s, 1));
        if (IS("lower")) return jv_str(case_map(c, s, 2));
        if (IS("title")) return jv_str(title_case(c, s));
        if (IS("capitalize")) return call_str_method(c, 4, s, NULL, 0);
        if (IS("trim")) return jv_str(jj_js_trim(s, true, true));
        if (IS("indent")) {
            jj_sb b = {0};
            size_t i = 0, ln = 0;
            for (;;) {
                size_t e = i;
                while (e < s.n && s.p[e] != '\n') e++;
                if (ln > 0 && e > i) jj_sb_puts(c, &b, "    ");
                jj_sb_put(c, &b, s.p + i, e - i);
                if (e >= s.n) break;
                jj_sb_putc(c, &b, '\n');
                i = e + 1;
                ln++;
            }
            return jv_str(jj_sb_str(&b));
        }
        if (IS("join") || IS("string")) return v;
        if (IS("int")) {
            bool nan;
            double d = parse_int_js(s, &nan);
            return jv_int(nan ? 0 : d);
        }
        if (IS("float")) {
            bool nan;
            double d = parse_float_js(s, &nan);
            return jv_float(nan ? 0 : d);
        }
        EFAIL(c, "unknown StringValue filter: %.*s", (int)name.n, name.p);
    }
    if (is_num(v)) {
        if (IS("abs")) return v.t == JV_INT ? jv_int(fabs(v.u.num)) : jv_float(fabs(v.u.num));
        if (IS("int")) return jv_int(floor(v.u.num));
        if (IS("float")) return jv_float(v.u.num);
        if (IS("string")) return jv_str(str_of(c, v));
        EFAIL(c, "unknown NumericValue filter: %.*s", (int)name.n, name.p);
    }
    if (is_mapping(v)) {
        if (IS("items")) return obj_items(c, v.u.o);
        if (IS("length")) return jv_int((double)v.u.o->n);
        for (int i = 0; k_obj_methods[i]; i++)
            if (IS(k_obj_methods[i])) return call_obj_method(c, i, v.u.o, NULL, 0);
        EFAIL(c, "unknown ObjectValue filter: %.*s", (int)name.n, name.p);
    }
    if (v.t == JV_BOOL) {
        if (IS("bool")) return v;
        if (IS("int")) return jv_int(v.u.b ? 1 : 0);
        if (IS("float")) return jv_float(v.u.b ? 1 : 0);
        if (IS("string")) return jv_cstr(c, v.u.b ? "true" : "false");
        EFAIL(c, "unknown BooleanValue filter: %.*s", (int)name.n, name.p);
    }
    EFAIL(c, "cannot apply filter \"%.*s\" to type: %s", (int)name.n, name.p, jj_type_name(v));
#undef IS
}

static jv attr_path(jv item, jstr path) {
    jv v = item;
    size_t i = 0;
    for (;;) {
        size_t e = i;
        while (e < path.n && path.p[e] != '.') e++;
        jstr part = {path.p + i, e - i};
        if (is_container(v)) {
            jv *x = jj_obj_get(v.u.o, part);
            v = x ? *x : jv_undef();
        } else if (v.t == JV_ARR) {
            bool nan;
            double k = parse_int_js(part, &nan);
            if (nan || k < 0 || k >= (double)v.u.a->n) return jv_undef();
            v = v.u.a->v[(size_t)k];
        } else {
            return jv_undef();
        }
        if (e >= path.n) return v;
        i = e + 1;
    }
}

static jv filter_call(jj_ctx *c, jv v, const jj_node *f, env *e) {
    if (f->a->kind != N_IDENT) EFAIL(c, "unknown filter");
    jstr name = f->a->s;
#define IS(z) jstr_eq(name, z)
    jj_obj *kw;
    if (IS("tojson")) {
        eval_args(c, &f->l1, e, &kw);
        jj_json_opts o = {.undef_as_null = true};
        jv *x;
        if ((x = jj_obj_get(kw, (jstr){"indent", 6})) && x->t != JV_NULL) {
            if (x->t != JV_INT) EFAIL(c, "if set, indent must be a number");
            o.indent = x->u.num > 0 ? (x->u.num > 64 ? 64 : (int)x->u.num) : 0;
        }
        if ((x = jj_obj_get(kw, (jstr){"ensure_ascii", 12}))) {
            if (x->t != JV_BOOL) EFAIL(c, "if set, ensure_ascii must be a boolean");
            o.ensure_ascii = x->u.b;
        }
        if ((x = jj_obj_get(kw, (jstr){"sort_keys", 9}))) {
            if (x->t != JV_BOOL) EFAIL(c, "if set, sort_keys must be a boolean");
            o.sort_keys = x->u.b;
        }
        if ((x = jj_obj_get(kw, (jstr){"separators", 10})) && x->t != JV_NULL) {
            if (x->t != JV_ARR || x->u.a->n != 2 || x->u.a->v[0].t != JV_STR || x->u.a->v[1].t != JV_STR)
                EFAIL(c, "separators must be a tuple of two strings");
            jstr a = x->u.a->v[0].u.s, b = x->u.a->v[1].u.s;
            char *pa = jj_alloc(c, a.n + 1), *pb = jj_alloc(c, b.n + 1);
            memcpy(pa, a.p, a.n); pa[a.n] = 0;
            memcpy(pb, b.p, b.n); pb[b.n] = 0;
            o.item_sep = pa;
            o.key_sep = pb;
        }
        return to_json_str(c, v, &o);
    }
    if (IS("join")) {
        jj_arr *items;
        if (v.t == JV_STR) items = code_points(c, v.u.s);
        else if (v.t == JV_ARR) items = v.u.a;
        else EFAIL(c, "cannot apply filter \"join\" to type: %s", jj_type_name(v));
        args a = eval_args(c, &f->l1, e, &kw);
        jv *s = jj_obj_get(kw, (jstr){"separator", 9});
        jv sep = a.n ? a.v[0] : s ? *s : jv_str((jstr){"", 0});
        if (sep.t != JV_STR) EFAIL(c, "separator must be a string");
        return join_values(c, items, sep.u.s);
    }
    if (IS("int") || IS("float")) {
        args a = eval_args(c, &f->l1, e, &kw);
        jv *d = jj_obj_get(kw, (jstr){"default", 7});
        jv def = a.n ? a.v[0] : d ? *d : IS("int") ? jv_int(0) : jv_float(0);
        if (v.t == JV_STR) {
            bool nan;
            double x = IS("int") ? parse_int_js(v.u.s, &nan) : parse_float_js(v.u.s, &nan);
            return nan ? def : IS("int") ? jv_int(x) : jv_float(x);
        }
        if (is_num(v)) return v;
        if (v.t == JV_BOOL) return IS("int") ? jv_int(v.u.b) : jv_float(v.u.b);
        EFAIL(c, "cannot apply filter \"%.*s\" to type: %s", (int)name.n, name.p, jj_type_name(v));
    }
    if (IS("default")) {
        args a = eval_args(c, &f->l1, e, &kw);
        jv def = a.n ? a.v[0] : jv_str((jstr){"", 0});
        jv *bk = jj_obj_get(kw, (jstr){"boolean", 7});
        jv bo = a.n > 1 ? a.v[1] : bk ? *bk : jv_bool(false);
        if (bo.t != JV_BOOL) EFAIL(c, "`default` filter flag must be a boolean");
        if (v.t == JV_UNDEF || (bo.u.b && !jj_truthy(v))) return def;
        return v;
    }
    if (v.t == JV_ARR) {
        jj_arr *arr = v.u.a;
        if (IS("sort")) {
            args a = eval_args(c, &f->l1, e, &kw);
            a = with_kw(c, a, kw);
            size_t np = a.n && a.v[a.n - 1].t == JV_KW ? a.n - 1 : a.n;
            jv rev = np > 0 ? a.v[0] : kwget(a.v, a.n, "reverse");
            if (!given(rev)) rev = jv_bool(false);
            if (rev.t != JV_BOOL) EFAIL(c, "reverse must be a boolean");
            jv cs = np > 1 ? a.v[1] : kwget(a.v, a.n, "case_sensitive");
            if (!given(cs)) cs = jv_bool(false);
            if (cs.t != JV_BOOL) EFAIL(c, "case_sensitive must be a boolean");
            jv at = np > 2 ? a.v[2] : kwget(a.v, a.n, "attribute");
            if (!given(at)) at = jv_null();
            if (at.t != JV_STR && at.t != JV_INT && at.t != JV_NULL) EFAIL(c, "attribute must be a string, integer, or null");
            jstr path = at.t == JV_STR ? at.u.s : at.t == JV_INT ? str_of(c, at) : (jstr){"", 0};
            sort_key *k = jj_alloc(c, (arr->n ? arr->n : 1) * sizeof *k);
            for (size_t i = 0; i < arr->n; i++)
                k[i] = (sort_key){at.t == JV_NULL ? arr->v[i] : attr_path(arr->v[i], path), arr->v[i]};
            sort_keys(c, k, arr->n, rev.u.b, cs.u.b);
            jv r = jv_arr_new(c, 0);
            for (size_t i = 0; i < arr->n; i++) jj_arr_push(c, r.u.a, k[i].item);
            return r;
        }
        if (IS("selectattr") || IS("rejectattr")) {
            bool sel = IS("selectattr");
            for (size_t i = 0; i < arr->n; i++)
                if (!is_container(arr->v[i])) EFAIL(c, "`%.*s` can only be applied to array of objects", (int)name.n, name.p);
            for (size_t i = 0; i < f->l1.n; i++)
                if (f->l1.v[i]->kind != N_STR) EFAIL(c, "arguments of `%.*s` must be strings", (int)name.n, name.p);
            if (f->l1.n == 0) EFAIL(c, "`%.*s` needs an attribute", (int)name.n, name.p);
            jstr attr = f->l1.v[0]->s;
            jstr test = f->l1.n > 1 ? f->l1.v[1]->s : (jstr){NULL, 0};
            jv arg = f->l1.n > 2 ? jv_str(f->l1.v[2]->s) : jv_undef();
            jv r = jv_arr_new(c, 0);
            for (size_t i = 0; i < arr->n; i++) {
                jj_step(c, 1);
                jv *x = jj_obj_get(arr->v[i].u.o, attr);
                bool res = false;
                if (x) {
                    if (test.p) {
                        int t = run_test(c, test, *x, arg, f->l1.n > 2);
                        if (t < 0) EFAIL(c, "unknown test: %.*s", (int)test.n, test.p);
                        res = t;
                    } else {
                        res = jj_truthy(*x);
                    }
                }
                if (sel ? res : !res) jj_arr_push(c, r.u.a, arr->v[i]);
            }
            return r;
        }
        if (IS("map")) {
            eval_args(c, &f->l1, e, &kw);
            jv *at = jj_obj_get(kw, (jstr){"attribute", 9});
            if (!at) EFAIL(c, "`map` expressions without `attribute` set are not currently supported");
            if (at->t != JV_STR) EFAIL(c, "attribute must be a string");
            jv *def = jj_obj_get(kw, (jstr){"default", 7});
            jv r = jv_arr_new(c, 0);
            for (size_t i = 0; i < arr->n; i++) {
                jj_step(c, 1);
                if (!is_container(arr->v[i])) EFAIL(c, "items in map must be an object");
                jv x = attr_path(arr->v[i], at->u.s);
                jj_arr_push(c, r.u.a, x.t == JV_UNDEF ? (def ? *def : jv_undef()) : x);
            }
            return r;
        }
        EFAIL(c, "unknown ArrayValue filter: %.*s", (int)name.n, name.p);
    }
    if (v.t == JV_STR) {
        if (IS("indent")) {
            args a = eval_args(c, &f->l1, e, &kw);
            jv *x;
            jv width = a.n > 0 ? a.v[0] : (x = jj_obj_get(kw, (jstr){"width", 5})) ? *x : jv_int(4);
            if (width.t != JV_INT) EFAIL(c, "width must be a number");
            jv first = a.n > 1 ? a.v[1] : (x = jj_obj_get(kw, (jstr){"first", 5})) ? *x : jv_bool(false);
            jv blank = a.n > 2 ? a.v[2] : (x = jj_obj_get(kw, (jstr){"blank", 5})) ? *x : jv_bool(false);
            double w = width.u.num < 0 ? 0 : width.u.num;
            if (w > (double)c->lim.max_output_bytes) EFAIL(c, "indent width too large");
            jj_sb b = {0};
            jstr s = v.u.s;
            size_t i = 0, ln = 0;
            for (;;) {
                size_t end = i;
                while (end < s.n && s.p[end] != '\n') end++;
                bool skip = (!jj_truthy(first) && ln == 0) || (!jj_truthy(blank) && end == i);
                if (!skip)
                    for (double k = 0; k < w; k++) jj_sb_putc(c, &b, ' ');
                jj_sb_put(c, &b, s.p + i, end - i);
                if (end >= s.n) break;
                jj_sb_putc(c, &b, '\n');
                i = end + 1;
                ln++;
            }
            return jv_str(jj_sb_str(&b));
        }
        if (IS("replace")) {
            args a = eval_args(c, &f->l1, e, &kw);
            jv *v2 = jj_alloc(c, (a.n + 1) * sizeof *v2);
            if (a.n) memcpy(v2, a.v, a.n * sizeof *v2);
            v2[a.n] = (jv){.t = JV_KW, .u.o = kw};
            return call_str_method(c, 10, v.u.s, v2, a.n + 1);
        }
        EFAIL(c, "unknown StringValue filter: %.*s", (int)name.n, name.p);
    }
    if (is_mapping(v)) {
        for (int i = 0; k_obj_methods[i]; i++)
            if (IS(k_obj_methods[i])) {
                args a = eval_args(c, &f->l1, e, &kw);
                a = with_kw(c, a, kw);
                return call_obj_method(c, i, v.u.o, a.v, a.n);
            }
        EFAIL(c, "unknown ObjectValue filter: %.*s", (int)name.n, name.p);
    }
    EFAIL(c, "cannot apply filter \"%.*s\" to type: %s", (int)name.n, name.p, jj_type_name(v));
#undef IS
}

static jv apply_filter(jj_ctx *c, jv v, const jj_node *f, env *e) {
    if (f->kind == N_IDENT) return filter_plain(c, v, f->s);
    if (f->kind == N_CALL) return filter_call(c, v, f, e);
    EFAIL(c, "unknown filter");
}

/* ---- operators ------------------------------------------------------------------ */

static jv binary(jj_ctx *c, const jj_node *n, env *e) {
    jv l = eval(c, n->a, e);
    if (n->op == OP_AND) return jj_truthy(l) ? eval(c, n->b, e) : l;
    if (n->op == OP_OR) return jj_truthy(l) ? l : eval(c, n->b, e);
    jv r = eval(c, n->b, e);
    if (n->op == OP_EQ) return jv_bool(loose_eq(l, r));
    if (n->op == OP_NE) return jv_bool(!loose_eq(l, r));
    if (l.t == JV_UNDEF || r.t == JV_UNDEF) {
        if (r.t == JV_UNDEF && (n->op == OP_IN || n->op == OP_NOTIN)) return jv_bool(n->op == OP_NOTIN);
        EFAIL(c, "cannot perform an operation on undefined values");
    }
    if (l.t == JV_NULL || r.t == JV_NULL) EFAIL(c, "cannot perform operation on null values");
    if (n->op == OP_CONCAT) return cat(c, raw_str(c, l), raw_str(c, r));
    if (n->op == OP_POW && is_numlike(l) && is_numlike(r)) {
        double a = numval(l), b = numval(r);
        if (a == 0 && b < 0) EFAIL(c, "0.0 cannot be raised to a negative power");
        double x = pow(a, b);
        if (!isfinite(x)) EFAIL(c, "exponentiation result is not a finite real number");
        return l.t == JV_FLOAT || r.t == JV_FLOAT || b < 0 ? jv_float(x) : jv_int(x);
    }
    if (is_num(l) && is_num(r)) {
        double a = l.u.num, b = r.u.num;
        bool fl = l.t == JV_FLOAT || r.t == JV_FLOAT;
        switch (n->op) {
        case OP_ADD: return fl ? jv_float(a + b) : jv_int(a + b);
        case OP_SUB: return fl ? jv_float(a - b) : jv_int(a - b);
        case OP_MUL: return fl ? jv_float(a * b) : jv_int(a * b);
        case OP_DIV: return jv_float(a / b);
        case OP_FLOORDIV: return fl ? jv_float(floor(a / b)) : jv_int(floor(a / b));
        case OP_MOD: return fl ? jv_float(fmod(a, b)) : jv_int(fmod(a, b));
        case OP_LT: return jv_bool(a < b);
        case OP_GT: return jv_bool(a > b);
        case OP_GE: return jv_bool(a >= b);
        case OP_LE: return jv_bool(a <= b);
        default: break;
        }
    } else if (l.t == JV_ARR && r.t == JV_ARR) {
        if (n->op == OP_ADD) {
            jv x = jv_arr_new(c, 0);
            for (size_t i = 0; i < l.u.a->n; i++) jj_arr_push(c, x.u.a, l.u.a->v[i]);
            for (size_t i = 0; i < r.u.a->n; i++) jj_arr_push(c, x.u.a, r.u.a->v[i]);
            jj_step(c, x.u.a->n);
            return x;
        }
    } else if (r.t == JV_ARR) {
        bool found = false;
        for (size_t i = 0; i < r.u.a->n && !found; i++) found = strict_eq(r.u.a->v[i], l);
        jj_step(c, r.u.a->n);
        if (n->op == OP_IN) return jv_bool(found);
        if (n->op == OP_NOTIN) return jv_bool(!found);
    }
    if ((l.t == JV_STR || r.t == JV_STR) && n->op == OP_ADD) return cat(c, raw_str(c, l), raw_str(c, r));
    if (l.t == JV_STR && r.t == JV_STR) {
        if (n->op == OP_IN) return jv_bool(contains(r.u.s, l.u.s, NULL));
        if (n->op == OP_NOTIN) return jv_bool(!contains(r.u.s, l.u.s, NULL));
    }
    if (l.t == JV_STR && is_mapping(r)) {
        if (n->op == OP_IN) return jv_bool(jj_obj_get(r.u.o, l.u.s) != NULL);
        if (n->op == OP_NOTIN) return jv_bool(jj_obj_get(r.u.o, l.u.s) == NULL);
    }
    EFAIL(c, "unknown operator between %s and %s", jj_type_name(l), jj_type_name(r));
}

/* ---- expressions ---------------------------------------------------------------- */

static jv eval_inner(jj_ctx *c, const jj_node *n, env *e) {
    switch (n->kind) {
    case N_INT: return jv_int(n->num);
    case N_FLOAT: return jv_float(n->num);
    case N_STR:
    case N_TEXT: return jv_str(n->s);
    case N_IDENT: return lookup(e, n->s);
    case N_ARRAY:
    case N_TUPLE: {
        jv a = jv_arr_new(c, n->kind == N_TUPLE);
        for (size_t i = 0; i < n->l1.n; i++) jj_arr_push(c, a.u.a, eval(c, n->l1.v[i], e));
        return a;
    }
    case N_OBJECT: {
        jv o = jv_obj_new(c, JV_OBJ);
        for (size_t i = 0; i < n->l1.n; i++) {
            jv k = eval(c, n->l1.v[i], e);
            if (k.t != JV_STR) EFAIL(c, "object keys must be strings: got %s", jj_type_name(k));
            jj_obj_set(c, o.u.o, k.u.s, eval(c, n->l2.v[i], e));
        }
        return o;
    }
    case N_MEMBER: {
        jv obj = eval(c, n->a, e);
        jv prop;
        if (n->flag) {
            if (n->b->kind == N_SLICE) return eval_slice(c, obj, n->b, e);
            prop = eval(c, n->b, e);
        } else if (n->b->kind == N_INT) {
            prop = jv_int(n->b->num);
        } else {
            prop = jv_str(n->b->s);
        }
        return member(c, obj, prop);
    }
    case N_CALL: {
        jj_obj *kw;
        args a = eval_args(c, &n->l1, e, &kw);
        a = with_kw(c, a, kw);
        jv fn = eval(c, n->a, e);
        return call_value(c, fn, a, e);
    }
    case N_UNARY: {
        jv v = eval(c, n->a, e);
        if (n->op == OP_NOT) return jv_bool(!jj_truthy(v));
        if (!is_numlike(v)) EFAIL(c, "unknown unary operator for %s", jj_type_name(v));
        double x = (n->op == OP_NEG ? -1 : 1) * numval(v);
        return v.t == JV_FLOAT ? jv_float(x) : jv_int(x);
    }
    case N_BINARY: return binary(c, n, e);
    case N_FILTER: return apply_filter(c, eval(c, n->a, e), n->b, e);
    case N_TEST: {
        jv v = eval(c, n->a, e);
        int r = run_test(c, n->s, v, jv_undef(), false);
        if (r < 0) EFAIL(c, "unknown test: %.*s", (int)n->s.n, n->s.p);
        return jv_bool(n->flag ? !r : r);
    }
    case N_SELECT: return jj_truthy(eval(c, n->b, e)) ? eval(c, n->a, e) : jv_undef();
    case N_TERNARY: return jj_truthy(eval(c, n->a, e)) ? eval(c, n->b, e) : eval(c, n->c, e);
    case N_COMMENT: return jv_null();
    default: EFAIL(c, "unexpected node in an expression");
    }
}

static jv eval(jj_ctx *c, const jj_node *n, env *e) {
    jj_enter(c);
    jv v = eval_inner(c, n, e);
    jj_leave(c);
    return v;
}

/* ---- statements ----------------------------------------------------------------- */

static void assign(jj_ctx *c, const jj_node *target, jv v, env *scope) {
    if (target->kind == N_IDENT) {
        jj_obj_set(c, &scope->vars, target->s, v);
    } else if (target->kind == N_TUPLE) {
        if (v.t != JV_ARR) EFAIL(c, "cannot unpack non-iterable type in set: %s", jj_type_name(v));
        if (v.u.a->n != target->l1.n) EFAIL(c, "too %s items to unpack in set", target->l1.n > v.u.a->n ? "few" : "many");
        for (size_t i = 0; i < target->l1.n; i++) {
            if (target->l1.v[i]->kind != N_IDENT) EFAIL(c, "cannot unpack to non-identifier in set");
            jj_obj_set(c, &scope->vars, target->l1.v[i]->s, v.u.a->v[i]);
        }
    } else if (target->kind == N_MEMBER) {
        jv obj = eval(c, target->a, scope);
        if (obj.t != JV_NS) EFAIL(c, "cannot assign attribute on non-namespace object");
        if (target->b->kind != N_IDENT || target->flag) EFAIL(c, "cannot assign to member with non-identifier property");
        jj_obj_set(c, obj.u.o, target->b->s, v);
    } else {
        EFAIL(c, "invalid left-hand side of an assignment");
    }
}

static int exec_for(jj_ctx *c, const jj_node *n, env *e, jj_sb *out) {
    env *scope = env_new(c, e);
    const jj_node *test = NULL;
    jv it;
    if (n->b->kind == N_SELECT) {
        it = eval(c, n->b->a, scope);
        test = n->b->b;
    } else {
        it = eval(c, n->b, scope);
    }
    if (is_mapping(it)) it = obj_keys(c, it.u.o);
    if (it.t != JV_ARR) EFAIL(c, "expected iterable or object type in for loop: got %s", jj_type_name(it));
    const jj_node *lv = n->a;
    jj_arr *src = it.u.a;
    /* check the targets and apply the filter first, as the reference does */
    jv *items = jj_alloc(c, (src->n ? src->n : 1) * sizeof *items);
    size_t ni = 0;
    for (size_t i = 0; i < src->n; i++) {
        jj_step(c, 1);
        jv cur = src->v[i];
        if (lv->kind == N_TUPLE) {
            if (cur.t != JV_ARR || cur.tuple) EFAIL(c, "cannot unpack non-iterable type: %s", jj_type_name(cur));
            if (cur.u.a->n != lv->l1.n) EFAIL(c, "too %s items to unpack", lv->l1.n > cur.u.a->n ? "few" : "many");
        }
        if (test) {
            env *ls = env_new(c, scope);
            assign(c, lv, cur, ls);
            if (!jj_truthy(eval(c, test, ls))) continue;
        }
        items[ni++] = cur;
    }
    bool none = true;
    for (size_t i = 0; i < ni; i++) {
        jj_step(c, 1);
        jv loop = jv_obj_new(c, JV_OBJ);
        jj_obj *lo = loop.u.o;
        lo->cap = 9; /* the nine fields below, in one allocation each */
        lo->k = jj_alloc(c, 9 * sizeof *lo->k);
        lo->v = jj_alloc(c, 9 * sizeof *lo->v);
        jj_obj_set(c, lo, (jstr){"index", 5}, jv_int((double)i + 1));
        jj_obj_set(c, lo, (jstr){"index0", 6}, jv_int((double)i));
        jj_obj_set(c, lo, (jstr){"revindex", 8}, jv_int((double)(ni - i)));
        jj_obj_set(c, lo, (jstr){"revindex0", 9}, jv_int((double)(ni - i - 1)));
        jj_obj_set(c, lo, (jstr){"first", 5}, jv_bool(i == 0));
        jj_obj_set(c, lo, (jstr){"last", 4}, jv_bool(i == ni - 1));
        jj_obj_set(c, lo, (jstr){"length", 6}, jv_int((double)ni));
        jj_obj_set(c, lo, (jstr){"previtem", 8}, i > 0 ? items[i - 1] : jv_undef());
        jj_obj_set(c, lo, (jstr){"nextitem", 8}, i + 1 < ni ? items[i + 1] : jv_undef());
        jj_obj_set(c, &scope->vars, (jstr){"loop", 4}, loop);
        assign(c, lv, items[i], scope);
        size_t mark = out->n;
        int ctl = exec_block(c, &n->l1, scope, out);
        if (ctl != CTL_NONE) {
            out->n = mark; /* the iteration's output is lost with the exception */
            if (ctl == CTL_BREAK) break;
            continue;
        }
        none = false;
    }
    if (none) return exec_block(c, &n->l2, scope, out);
    return CTL_NONE;
}

static int exec_stmt(jj_ctx *c, const jj_node *n, env *e, jj_sb *out) {
    switch (n->kind) {
    case N_TEXT: jj_sb_put(c, out, n->s.p, n->s.n); return CTL_NONE;
    case N_COMMENT: return CTL_NONE;
    case N_BREAK: return CTL_BREAK;
    case N_CONTINUE: return CTL_CONTINUE;
    case N_IF: return exec_block(c, jj_truthy(eval(c, n->a, e)) ? &n->l1 : &n->l2, e, out);
    case N_FOR: return exec_for(c, n, e, out);
    case N_SET: {
        jv v;
        if (n->b) {
            v = eval(c, n->b, e);
        } else {
            jj_sb b = {0};
            if (exec_block(c, &n->l1, e, &b) != CTL_NONE) return CTL_BREAK; /* reference: the exception */
            v = jv_str(jj_sb_str(&b));
        }
        assign(c, n->a, v, e);
        return CTL_NONE;
    }
    case N_MACRO:
        jj_obj_set(c, &e->vars, n->s, mkfunc(c, F_MACRO, 0, jv_undef(), n));
        return CTL_NONE;
    case N_FILTERSTMT: {
        jj_sb b = {0};
        int ctl = exec_block(c, &n->l1, e, &b);
        if (ctl != CTL_NONE) return ctl;
        jv v = apply_filter(c, jv_str(jj_sb_str(&b)), n->b, e);
        if (v.t != JV_NULL && v.t != JV_UNDEF) jj_str_of(c, out, v);
        return CTL_NONE;
    }
    default: {
        jv v = eval(c, n, e);
        if (v.t != JV_NULL && v.t != JV_UNDEF) jj_str_of(c, out, v);
        return CTL_NONE;
    }
    }
}

static int exec_block(jj_ctx *c, const jj_list *l, env *e, jj_sb *out) {
    jj_enter(c);
    for (size_t i = 0; i < l->n; i++) {
        int ctl = exec_stmt(c, l->v[i], e, out);
        if (ctl != CTL_NONE) {
            jj_leave(c);
            return ctl;
        }
    }
    jj_leave(c);
    return CTL_NONE;
}

/* ---- API ------------------------------------------------------------------------- */

void kv_chat_limits_default(kv_chat_limits *l) {
    l->max_template_bytes = 1u << 20;
    l->max_output_bytes = 16u << 20;
    l->max_memory_bytes = 256u << 20;
    l->max_loop_iters = 1000000;
    l->max_depth = 200;
}

int kv_chat_tmpl_parse(kv_chat_tmpl **out, const char *src, size_t len, const kv_chat_limits *lim, kv_diag *d) {
    *out = NULL;
    kv_chat_tmpl *t = calloc(1, sizeof *t);
    if (!t) return kv_fail(d, KV_ENOMEM, "chat template: out of memory");
    if (lim) t->c.lim = *lim;
    else kv_chat_limits_default(&t->c.lim);
    if (len > t->c.lim.max_template_bytes) {
        int rc = kv_fail(d, KV_ERANGE, "chat template: template of %zu bytes is over the limit of %zu bytes", len,
                         t->c.lim.max_template_bytes);
        free(t);
        return rc;
    }
    if (memchr(src, 0, len)) {
        free(t);
        return kv_fail(d, KV_EFORMAT, "chat template: template contains a NUL byte");
    }
    t->c.diag = d;
    /* the tree takes a small multiple of the source; its own bound */
    t->c.cap = t->c.lim.max_memory_bytes;
    if (setjmp(t->c.jmp)) {
        int rc = t->c.code;
        jj_arena_free(&t->c);
        free(t);
        return rc;
    }
    jj_parse(&t->c, src, len, &t->body);
    t->c.diag = NULL;
    t->c.depth = 0;
    *out = t;
    return 0;
}

void kv_chat_tmpl_free(kv_chat_tmpl *t) {
    if (!t) return;
    jj_arena_free(&t->c);
    free(t);
}

static void set_global(jj_ctx *c, env *g, const char *name, jv v) {
    jv k = jv_cstr(c, name);
    jj_obj_set(c, &g->vars, k.u.s, v);
}

int kv_chat_render(const kv_chat_tmpl *t, const json_t *ctx, const kv_chat_render_opts *opts, char **out,
                   size_t *out_len, kv_diag *d) {
    *out = NULL;
    if (out_len) *out_len = 0;
    if (ctx && !json_is_object(ctx)) return kv_fail(d, KV_EINVAL, "chat template: the context must be a JSON object");
    jj_ctx c;
    memset(&c, 0, sizeof c);
    c.lim = t->c.lim;
    c.cap = c.lim.max_memory_bytes;
    c.diag = d;
    c.now_unix = opts ? opts->now_unix : 0;
    if (setjmp(c.jmp)) {
        int rc = c.code;
        jj_arena_free(&c);
        return rc;
    }
    env *g = env_new(&c, NULL);
    set_global(&c, g, "namespace", mkfunc(&c, F_NAMESPACE, 0, jv_undef(), NULL));
    set_global(&c, g, "false", jv_bool(false));
    set_global(&c, g, "true", jv_bool(true));
    set_global(&c, g, "none", jv_null());
    set_global(&c, g, "raise_exception", mkfunc(&c, F_RAISE, 0, jv_undef(), NULL));
    set_global(&c, g, "range", mkfunc(&c, F_RANGE, 0, jv_undef(), NULL));
    set_global(&c, g, "strftime_now", mkfunc(&c, F_STRFTIME, 0, jv_undef(), NULL));
    set_global(&c, g, "True", jv_bool(true));
    set_global(&c, g, "False", jv_bool(false));
    set_global(&c, g, "None", jv_null());
    if (ctx) {
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)ctx, k, v) {
            jv key = jv_cstr(&c, k);
            if (jj_obj_get(&g->vars, key.u.s)) EFAIL(&c, "variable already declared: %s", k);
            jj_obj_set(&c, &g->vars, key.u.s, jj_from_json(&c, v));
        }
    }
    jj_sb b = {0};
    if (exec_block(&c, &t->body, g, &b) != CTL_NONE) EFAIL(&c, "break or continue outside a loop");
    char *r = malloc(b.n + 1);
    if (!r) jj_fail(&c, KV_ENOMEM, "chat template: out of memory");
    if (b.n) memcpy(r, b.p, b.n);
    r[b.n] = 0;
    *out = r;
    if (out_len) *out_len = b.n;
    jj_arena_free(&c);
    return 0;
}
