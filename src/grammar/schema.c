/* JSON schema to GBNF.
 *
 * Each subschema becomes one rule; $ref targets (#, #/$defs/NAME,
 * #/definitions/NAME) are compiled once and may recurse. The subset
 * (docs/GRAMMAR.md) is chosen so that every text the grammar admits
 * validates: a keyword that would constrain the value and that the
 * compiler cannot express is refused with its name and JSON pointer, never
 * dropped. Where a schema allows more than the grammar produces, the
 * grammar produces a valid subset: declared properties come in declared
 * order, and an object that declares properties gets no others (its
 * additionalProperties then only decides whether that is required).
 * Whitespace between tokens is one space, or a newline and up to 8 blanks,
 * so a model cannot spend its budget on blanks. */
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_internal.h"

/* Strings, arrays and integer ranges longer than this are refused: each
 * bounded repetition step is a rule of its own. */
#define SCHEMA_MAX_COUNT 1000

typedef struct sbuf {
    char *s;
    size_t n, cap;
    bool oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap * 2 : 256;
        while (nc < b->n + n + 1) nc *= 2;
        char *ns = realloc(b->s, nc);
        if (!ns) {
            b->oom = true;
            return;
        }
        b->s = ns;
        b->cap = nc;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
}

static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static void sb_fmt(sbuf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    KV_ASSERT((size_t)n < sizeof tmp);
    sb_put(b, tmp, (size_t)n);
}

/* Bytes as a GBNF string literal (quotes included). */
static void sb_lit(sbuf *b, const char *s, size_t n) {
    sb_put(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        uint8_t c = (uint8_t)s[i];
        if (c == '"') sb_put(b, "\\\"", 2);
        else if (c == '\\') sb_put(b, "\\\\", 2);
        else if (c < 0x20) sb_fmt(b, "\\x%02x", c);
        else sb_put(b, (const char *)&c, 1);
    }
    sb_put(b, "\"", 1);
}

typedef struct sc {
    sbuf out;              /* rule definitions */
    uint32_t n_rules;
    json_t *root;
    json_t *refs;          /* ref string -> rule name */
    uint32_t depth;
    const kv_grammar_limits *lim;
    kv_diag *d;
} sc;

typedef char rname[24];

static void new_name(sc *c, rname out) { snprintf(out, sizeof(rname), "s%u", c->n_rules++); }

static void sub_ptr(char *dst, size_t cap, const char *ptr, const char *key) {
    snprintf(dst, cap, "%s/%s", ptr, key);
}

static const char *const k_annotations[] = {"title", "description", "default", "examples", "$schema", "$id",
                                            "$comment", "deprecated", "readOnly", "writeOnly", "$defs",
                                            "definitions", NULL};
static const char *const k_handled[] = {"type", "properties", "required", "additionalProperties", "items",
                                        "minItems", "maxItems", "enum", "const", "minLength", "maxLength",
                                        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "anyOf",
                                        "oneOf", "allOf", "$ref", "nullable", NULL};

static bool in_list(const char *k, const char *const *l) {
    for (; *l; l++)
        if (!strcmp(k, *l)) return true;
    return false;
}

/* The first keyword of s that constrains a value other than those in
 * allowed (NULL-terminated), or NULL. */
static const char *other_keyword(json_t *s, const char *const *allowed) {
    const char *k;
    json_t *v;
    json_object_foreach(s, k, v) {
        if (in_list(k, k_annotations) || in_list(k, allowed)) continue;
        return k;
    }
    return NULL;
}

/* JSON types as bits; an integer is also a number. */
enum { T_NULL = 1, T_BOOL = 2, T_OBJ = 4, T_ARR = 8, T_STR = 16, T_INT = 32, T_NUM = 64, T_ALL = 127 };

static int type_bit(const char *t) {
    if (!strcmp(t, "null")) return T_NULL;
    if (!strcmp(t, "boolean")) return T_BOOL;
    if (!strcmp(t, "object")) return T_OBJ;
    if (!strcmp(t, "array")) return T_ARR;
    if (!strcmp(t, "string")) return T_STR;
    if (!strcmp(t, "integer")) return T_INT;
    if (!strcmp(t, "number")) return T_INT | T_NUM;
    return 0;
}

static int value_bits(json_t *v) {
    switch (json_typeof(v)) {
    case JSON_NULL: return T_NULL;
    case JSON_TRUE: case JSON_FALSE: return T_BOOL;
    case JSON_OBJECT: return T_OBJ;
    case JSON_ARRAY: return T_ARR;
    case JSON_STRING: return T_STR;
    case JSON_INTEGER: return T_INT;
    case JSON_REAL: {
        double x = json_real_value(v);
        return x == floor(x) ? T_INT : T_NUM;
    }
    }
    return 0;
}

static int gen(sc *c, json_t *s, const char *ptr, rname out);

static int resolve_ref(sc *c, const char *ref, const char *ptr, json_t **target) {
    if (!strcmp(ref, "#")) {
        *target = c->root;
        return 0;
    }
    const char *name = NULL;
    json_t *defs = NULL;
    if (!strncmp(ref, "#/$defs/", 8)) {
        name = ref + 8;
        defs = json_object_get(c->root, "$defs");
    } else if (!strncmp(ref, "#/definitions/", 14)) {
        name = ref + 14;
        defs = json_object_get(c->root, "definitions");
    } else {
        return kv_fail(c->d, KV_EUNSUPPORTED,
                       "schema %s: $ref '%.100s' is not supported (only #, #/$defs/NAME, #/definitions/NAME)", ptr, ref);
    }
    /* JSON-pointer unescaping of the one segment: ~1 is /, ~0 is ~ */
    char key[256];
    size_t n = 0;
    for (const char *p = name; *p; p++) {
        if (n + 1 >= sizeof key || *p == '/')
            return kv_fail(c->d, KV_EUNSUPPORTED, "schema %s: $ref '%.100s' is not supported (nested path)", ptr, ref);
        if (p[0] == '~' && (p[1] == '0' || p[1] == '1')) {
            key[n++] = p[1] == '0' ? '~' : '/';
            p++;
        } else {
            key[n++] = *p;
        }
    }
    key[n] = 0;
    json_t *t = json_is_object(defs) ? json_object_get(defs, key) : NULL;
    if (!t) return kv_fail(c->d, KV_EFORMAT, "schema %s: $ref '%.100s' names no definition", ptr, ref);
    *target = t;
    return 0;
}

/* Bits of the JSON types s may produce (for oneOf's disjointness). */
static int schema_bits(sc *c, json_t *s, int depth) {
    if (depth > 32 || !json_is_object(s)) return T_ALL;
    json_t *v;
    if ((v = json_object_get(s, "$ref")) && json_is_string(v)) {
        json_t *t;
        kv_diag dd = {0};
        kv_diag *save = c->d;
        c->d = &dd;
        int rc = resolve_ref(c, json_string_value(v), "", &t);
        c->d = save;
        return rc ? T_ALL : schema_bits(c, t, depth + 1);
    }
    if ((v = json_object_get(s, "const"))) return value_bits(v);
    int bits = 0;
    if ((v = json_object_get(s, "enum")) && json_is_array(v)) {
        size_t i;
        json_t *e;
        json_array_foreach(v, i, e) bits |= value_bits(e);
        return bits;
    }
    json_t *any = json_object_get(s, "anyOf");
    if (!any) any = json_object_get(s, "oneOf");
    if (json_is_array(any)) {
        size_t i;
        json_t *e;
        json_array_foreach(any, i, e) bits |= schema_bits(c, e, depth + 1);
        return bits;
    }
    if ((v = json_object_get(s, "type"))) {
        if (json_is_string(v)) bits = type_bit(json_string_value(v));
        else if (json_is_array(v)) {
            size_t i;
            json_t *e;
            json_array_foreach(v, i, e) if (json_is_string(e)) bits |= type_bit(json_string_value(e));
        }
        if (json_is_true(json_object_get(s, "nullable"))) bits |= T_NULL;
        return bits ? bits : T_ALL;
    }
    return T_ALL;
}

static int emit_rule(sc *c, const rname name, const sbuf *body) {
    if (body->oom) return kv_fail(c->d, KV_ENOMEM, "schema: out of memory");
    sb_fmt(&c->out, "%s ::= ", name);
    sb_put(&c->out, body->s ? body->s : "", body->n);
    sb_put(&c->out, "\n", 1);
    if (c->out.n > c->lim->max_text_bytes)
        return kv_fail(c->d, KV_ERANGE, "schema: grammar over %zu bytes (max_text_bytes)", c->lim->max_text_bytes);
    return 0;
}

static int get_count(sc *c, json_t *s, const char *key, const char *ptr, long long *out, bool *present) {
    json_t *v = json_object_get(s, key);
    *present = v != NULL;
    if (!v) return 0;
    double x;
    if (json_is_integer(v)) x = (double)json_integer_value(v);
    else if (json_is_real(v)) x = json_real_value(v);
    else return kv_fail(c->d, KV_EFORMAT, "schema %s: '%s' is not a number", ptr, key);
    if (x < 0 || x != floor(x)) return kv_fail(c->d, KV_EFORMAT, "schema %s: '%s' is not a non-negative integer", ptr, key);
    if (x > SCHEMA_MAX_COUNT) *out = SCHEMA_MAX_COUNT + 1;
    else *out = (long long)x;
    return 0;
}

/* body: "x{min,max}" of a rule or fragment x, max < 0 meaning unbounded. */
static void sb_rep(sbuf *b, const char *x, long long min, long long max) {
    if (max < 0) {
        if (min == 0) sb_fmt(b, "(%s)*", x);
        else if (min == 1) sb_fmt(b, "(%s)+", x);
        else sb_fmt(b, "(%s){%lld,}", x, min);
    } else if (max == 0) {
        sb_str(b, "\"\"");
    } else {
        sb_fmt(b, "(%s){%lld,%lld}", x, min, max);
    }
}

static int gen_string(sc *c, json_t *s, const char *ptr, sbuf *b) {
    long long min = 0, max = -1;
    bool has_min, has_max;
    int rc = get_count(c, s, "minLength", ptr, &min, &has_min);
    if (!rc) rc = get_count(c, s, "maxLength", ptr, &max, &has_max);
    if (rc) return rc;
    if (!has_max) max = -1;
    if (min > SCHEMA_MAX_COUNT || max > SCHEMA_MAX_COUNT)
        return kv_fail(c->d, KV_EUNSUPPORTED, "schema %s: minLength/maxLength over %d is not supported", ptr,
                       SCHEMA_MAX_COUNT);
    if (max >= 0 && max < min) return kv_fail(c->d, KV_EFORMAT, "schema %s: maxLength < minLength admits no string", ptr);
    if (min == 0 && max < 0) {
        sb_str(b, "string");
        return 0;
    }
    sb_str(b, "\"\\\"\" ");
    sb_rep(b, "char", min, max);
    sb_str(b, " \"\\\"\"");
    return 0;
}

static int get_bound(sc *c, json_t *s, const char *key, const char *ptr, double *out, bool *present) {
    json_t *v = json_object_get(s, key);
    *present = v != NULL;
    if (!v) return 0;
    if (json_is_integer(v)) *out = (double)json_integer_value(v);
    else if (json_is_real(v)) *out = json_real_value(v);
    else return kv_fail(c->d, KV_EFORMAT, "schema %s: '%s' is not a number", ptr, key);
    if (fabs(*out) > 1e15) return kv_fail(c->d, KV_EUNSUPPORTED, "schema %s: '%s' beyond 1e15 is not supported", ptr, key);
    return 0;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Alternatives of the sorted strings v[0..n) that share their first `at`
 * bytes, as a trie of groups: one stack per alternative would make a long
 * enumeration ambiguous for the matcher (every literal a stack). */
static void sb_trie(sbuf *b, char **v, size_t n, size_t at) {
    size_t i = 0;
    int alts = 0;
    bool empty = false;
    if (n && !v[0][at]) empty = true, i = 1; /* sorted: the one that ends here comes first */
    sb_str(b, "(");
    while (i < n) {
        char c = v[i][at];
        size_t j = i;
        while (j < n && v[j][at] == c) j++;
        sb_fmt(b, "%s\"%c\"", alts++ ? " | " : "", c);
        if (j - i > 1 || v[i][at + 1]) {
            sb_str(b, " ");
            sb_trie(b, v + i, j - i, at + 1);
        }
        i = j;
    }
    sb_str(b, ")");
    if (empty) sb_str(b, "?");
}

/* Decimal integers lo..hi (hi - lo <= SCHEMA_MAX_COUNT) as a digit trie. */
static void sb_int_range(sbuf *b, long long lo, long long hi) {
    size_t n = (size_t)(hi - lo + 1);
    char **v = malloc(n * sizeof *v), *buf = malloc(n * 24);
    if (!v || !buf) {
        b->oom = true;
        free(v);
        free(buf);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        v[i] = buf + i * 24;
        snprintf(v[i], 24, "%lld", lo + (long long)i);
    }
    qsort(v, n, sizeof *v, cmp_str);
    sb_trie(b, v, n, 0);
    free(v);
    free(buf);
}

static int gen_integer(sc *c, json_t *s, const char *ptr, sbuf *b) {
    double lo_d = 0, hi_d = 0, xlo = 0, xhi = 0;
    bool has_lo, has_hi, has_xlo, has_xhi;
    int rc = get_bound(c, s, "minimum", ptr, &lo_d, &has_lo);
    if (!rc) rc = get_bound(c, s, "maximum", ptr, &hi_d, &has_hi);
    if (!rc) rc = get_bound(c, s, "exclusiveMinimum", ptr, &xlo, &has_xlo);
    if (!rc) rc = get_bound(c, s, "exclusiveMaximum", ptr, &xhi, &has_xhi);
    if (rc) return rc;
    /* an integer above x is at least floor(x) + 1; below x, at most ceil(x) - 1 */
    long long lo = has_lo ? (long long)ceil(lo_d) : 0, hi = has_hi ? (long long)floor(hi_d) : 0;
    if (has_xlo && (!has_lo || (long long)floor(xlo) + 1 > lo)) lo = (long long)floor(xlo) + 1, has_lo = true;
    if (has_xhi && (!has_hi || (long long)ceil(xhi) - 1 < hi)) hi = (long long)ceil(xhi) - 1, has_hi = true;
    if (!has_lo && !has_hi) {
        sb_str(b, "integer");
        return 0;
    }
    if (has_lo && has_hi) {
        if (hi < lo) return kv_fail(c->d, KV_EFORMAT, "schema %s: maximum < minimum admits no integer", ptr);
        if (hi - lo <= SCHEMA_MAX_COUNT) {
            sb_str(b, "(");
            sb_int_range(b, lo, hi);
            sb_str(b, ")");
            return 0;
        }
    } else if (has_lo && lo >= -SCHEMA_MAX_COUNT) {
        /* lo..-1 listed, then 0, then any positive */
        sb_str(b, "(");
        if (lo < 0) {
            sb_int_range(b, lo, -1);
            sb_str(b, " | ");
        }
        if (lo <= 0) sb_str(b, "\"0\" | ");
        if (lo <= 1) sb_str(b, "[1-9] [0-9]{0,14})");
        else if (lo <= SCHEMA_MAX_COUNT) {
            /* lo..999 listed, then every integer of 4 or more digits when lo < 1000 */
            sb_int_range(b, lo, 999);
            if (lo < 1000) sb_str(b, " | ");
            sb_str(b, "[1-9] [0-9]{3,14})");
        } else {
            return kv_fail(c->d, KV_EUNSUPPORTED, "schema %s: integer 'minimum' over %d without 'maximum' is not supported",
                           ptr, SCHEMA_MAX_COUNT);
        }
        return 0;
    } else if (has_hi && hi >= -1 && hi <= SCHEMA_MAX_COUNT) {
        sb_str(b, "(\"-\" [1-9] [0-9]{0,14}");
        if (hi >= 0) {
            sb_str(b, " | ");
            sb_int_range(b, 0, hi);
        }
        sb_str(b, ")");
        return 0;
    }
    return kv_fail(c->d, KV_EUNSUPPORTED,
                   "schema %s: this integer 'minimum'/'maximum' is not supported (a span up to %d, a minimum from -%d "
                   "up to %d, or a maximum from -1 up to %d)",
                   ptr, SCHEMA_MAX_COUNT, SCHEMA_MAX_COUNT, SCHEMA_MAX_COUNT, SCHEMA_MAX_COUNT);
}

static int gen_array(sc *c, json_t *s, const char *ptr, sbuf *b) {
    json_t *items = json_object_get(s, "items");
    rname item;
    char sub[256];
    int rc = 0;
    if (!items) snprintf(item, sizeof item, "value");
    else if (json_is_array(items))
        return kv_fail(c->d, KV_EUNSUPPORTED, "schema %s: 'items' as an array (tuple form) is not supported", ptr);
    else {
        sub_ptr(sub, sizeof sub, ptr, "items");
        if ((rc = gen(c, items, sub, item))) return rc;
    }
    long long min = 0, max = -1;
    bool has_min, has_max;
    rc = get_count(c, s, "minItems", ptr, &min, &has_min);
    if (!rc) rc = get_count(c, s, "maxItems", ptr, &max, &has_max);
    if (rc) return rc;
    if (!has_max) max = -1;
    if (min > SCHEMA_MAX_COUNT || max > SCHEMA_MAX_COUNT)
        return kv_fail(c->d, KV_EUNSUPPORTED, "schema %s: minItems/maxItems over %d is not supported", ptr, SCHEMA_MAX_COUNT);
    if (max >= 0 && max < min) return kv_fail(c->d, KV_EFORMAT, "schema %s: maxItems < minItems admits no array", ptr);
    char more[64];
    snprintf(more, sizeof more, "\",\" ws %s ws", item);
    if (max == 0) {
        sb_str(b, "\"[\" ws \"]\"");
    } else if (min == 0) {
        sb_fmt(b, "\"[\" ws (%s ws ", item);
        sb_rep(b, more, 0, max < 0 ? -1 : max - 1);
        sb_str(b, ")? \"]\"");
    } else {
        sb_fmt(b, "\"[\" ws %s ws ", item);
        sb_rep(b, more, min - 1, max < 0 ? -1 : max - 1);
        sb_str(b, " \"]\"");
    }
    return 0;
}

typedef struct prop {
    const char *key;
    rname rule;
    bool required;
} prop;

static int gen_object(sc *c, json_t *s, const char *ptr, sbuf *b) {
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    json_t *addl = json_object_get(s, "additionalProperties");
    char sub[256];
    int rc = 0;
    if (props && !json_is_object(props)) return kv_fail(c->d, KV_EFORMAT, "schema %s: 'properties' is not an object", ptr);
    if (req && !json_is_array(req)) return kv_fail(c->d, KV_EFORMAT, "schema %s: 'required' is not an array", ptr);
    if (addl && !json_is_object(addl) && !json_is_boolean(addl))
        return kv_fail(c->d, KV_EFORMAT, "schema %s: 'additionalProperties' is not a schema", ptr);
    size_t n_req = req ? json_array_size(req) : 0, cap = (props ? json_object_size(props) : 0) + n_req;
    prop *pl = calloc(cap ? cap : 1, sizeof *pl);
    if (!pl) return kv_fail(c->d, KV_ENOMEM, "schema: out of memory");
    size_t n = 0;
    const char *k;
    json_t *v;
    if (props) {
        json_object_foreach(props, k, v) {
            char seg[128];
            snprintf(seg, sizeof seg, "properties/%.100s", k);
            sub_ptr(sub, sizeof sub, ptr, seg);
            pl[n].key = k;
            if ((rc = gen(c, v, sub, pl[n].rule))) goto out;
            n++;
        }
    }
    for (size_t i = 0; i < n_req; i++) {
        json_t *e = json_array_get(req, i);
        if (!json_is_string(e)) {
            rc = kv_fail(c->d, KV_EFORMAT, "schema %s: 'required' holds a non-string", ptr);
            goto out;
        }
        const char *name = json_string_value(e);
        size_t j = 0;
        while (j < n && strcmp(pl[j].key, name)) j++;
        if (j == n) {
            if (json_is_false(addl)) {
                rc = kv_fail(c->d, KV_EFORMAT,
                             "schema %s: required property '%.100s' is not in 'properties' and additionalProperties is "
                             "false: no object validates",
                             ptr, name);
                goto out;
            }
            pl[n].key = name;
            if (json_is_object(addl)) {
                sub_ptr(sub, sizeof sub, ptr, "additionalProperties");
                if ((rc = gen(c, addl, sub, pl[n].rule))) goto out;
            } else {
                snprintf(pl[n].rule, sizeof pl[n].rule, "value");
            }
            n++;
        }
        pl[j].required = true;
    }
    if (n == 0) {
        if (json_is_false(addl)) {
            sb_str(b, "\"{\" ws \"}\"");
        } else if (json_is_object(addl)) {
            rname r;
            sub_ptr(sub, sizeof sub, ptr, "additionalProperties");
            if ((rc = gen(c, addl, sub, r))) goto out;
            sb_fmt(b, "\"{\" ws (string ws \":\" ws %s ws (\",\" ws string ws \":\" ws %s ws)*)? \"}\"", r, r);
        } else {
            sb_str(b, "object-any");
        }
        goto out;
    }
    /* first[i]: members i.. with none before; rest[i]: members i.., each after a comma */
    rname *first = calloc(n + 1, sizeof *first), *rest = calloc(n + 1, sizeof *rest);
    if (!first || !rest) {
        free(first);
        free(rest);
        rc = kv_fail(c->d, KV_ENOMEM, "schema: out of memory");
        goto out;
    }
    for (size_t i = 0; i <= n; i++) {
        new_name(c, first[i]);
        new_name(c, rest[i]);
    }
    for (size_t i = n + 1; i-- > 0 && !rc;) {
        sbuf fb = {0}, rb = {0};
        if (i == n) {
            sb_str(&fb, "\"\"");
            sb_str(&rb, "\"\"");
        } else {
            sbuf kv = {0};
            json_t *ks = json_string(pl[i].key);
            char *kj = ks ? json_dumps(ks, JSON_ENCODE_ANY | JSON_COMPACT) : NULL;
            json_decref(ks);
            if (!kj) kv.oom = true;
            else sb_lit(&kv, kj, strlen(kj));
            free(kj);
            sb_fmt(&kv, " ws \":\" ws %s ws", pl[i].rule);
            if (kv.oom) {
                rc = kv_fail(c->d, KV_ENOMEM, "schema: out of memory");
            } else if (pl[i].required) {
                sb_fmt(&fb, "%s %s", kv.s, rest[i + 1]);
                sb_fmt(&rb, "\",\" ws %s %s", kv.s, rest[i + 1]);
            } else {
                sb_fmt(&fb, "%s %s | %s", kv.s, rest[i + 1], first[i + 1]);
                sb_fmt(&rb, "\",\" ws %s %s | %s", kv.s, rest[i + 1], rest[i + 1]);
            }
            free(kv.s);
        }
        if (!rc) rc = emit_rule(c, first[i], &fb);
        if (!rc) rc = emit_rule(c, rest[i], &rb);
        free(fb.s);
        free(rb.s);
    }
    if (!rc) sb_fmt(b, "\"{\" ws %s \"}\"", first[0]);
    free(first);
    free(rest);
out:
    free(pl);
    return rc;
}

static int gen_literals(sc *c, json_t *s, const char *ptr, sbuf *b) {
    json_t *cv = json_object_get(s, "const"), *ev = json_object_get(s, "enum"), *tv = json_object_get(s, "type");
    static const char *const ok[] = {"const", "enum", "type", "nullable", NULL};
    const char *other = other_keyword(s, ok);
    if (other)
        return kv_fail(c->d, KV_EUNSUPPORTED, "schema %s: '%s' beside '%s' is not supported", ptr, other,
                       cv ? "const" : "enum");
    if (ev && !json_is_array(ev)) return kv_fail(c->d, KV_EFORMAT, "schema %s: 'enum' is not an array", ptr);
    int allowed = T_ALL;
    if (tv) {
        allowed = 0;
        if (json_is_string(tv)) allowed = type_bit(json_string_value(tv));
        else if (json_is_array(tv)) {
            size_t i;
            json_t *e;
            json_array_foreach(tv, i, e) if (json_is_string(e)) allowed |= type_bit(json_string_value(e));
        }
        if (json_is_true(json_object_get(s, "nullable"))) allowed |= T_NULL;
    }
    size_t n = cv ? 1 : json_array_size(ev), kept = 0;
    sb_str(b, "(");
    for (size_t i = 0; i < n; i++) {
        json_t *e = cv ? cv : json_array_get(ev, i);
        if (!(value_bits(e) & allowed)) continue;
        if (ev) {
            size_t j = 0;
            while (j < i && !json_equal(json_array_get(ev, j), e)) j++;
            if (j < i) continue;
        }
        char *txt = json_dumps(e, JSON_ENCODE_ANY | JSON_COMPACT);
        if (!txt) return kv_fail(c->d, KV_ENOMEM, "schema: out of memory");
        if (kept++) sb_str(b, " | ");
        sb_lit(b, txt, strlen(txt));
        free(txt);
    }
    sb_str(b, ")");
    if (!kept) return kv_fail(c->d, KV_EFORMAT, "schema %s: no value of '%s' has an allowed type", ptr, cv ? "const" : "enum");
    return 0;
}

/* The values a const/enum schema admits, as a new array reference; NULL
 * when s is not one. */
static json_t *literal_values(json_t *s) {
    json_t *c = json_is_object(s) ? json_object_get(s, "const") : NULL;
    if (c) return json_pack("[O]", c);
    json_t *e = json_is_object(s) ? json_object_get(s, "enum") : NULL;
    return json_is_array(e) ? json_incref(e) : NULL;
}

/* True when the literal arrays a and b share no value. */
static bool literals_disjoint(json_t *a, json_t *b) {
    size_t x, y;
    json_t *va, *vb;
    json_array_foreach(a, x, va) json_array_foreach(b, y, vb) if (json_equal(va, vb)) return false;
    return true;
}

/* The schema $ref points to (one level), or s. */
static json_t *deref(sc *c, json_t *s) {
    json_t *r = json_is_object(s) ? json_object_get(s, "$ref") : NULL, *t = NULL;
    if (!json_is_string(r)) return s;
    kv_diag dd = {0};
    kv_diag *save = c->d;
    c->d = &dd;
    int rc = resolve_ref(c, json_string_value(r), "", &t);
    c->d = save;
    return rc ? s : t;
}

static bool in_required(json_t *s, const char *name) {
    json_t *req = json_object_get(s, "required"), *e;
    size_t i;
    if (!json_is_array(req)) return false;
    json_array_foreach(req, i, e) if (json_is_string(e) && !strcmp(json_string_value(e), name)) return true;
    return false;
}

/* Two object schemas no value can satisfy both: a property both require,
 * whose const/enum values differ (a discriminated union). */
static bool objects_disjoint(sc *c, json_t *a, json_t *b) {
    a = deref(c, a);
    b = deref(c, b);
    json_t *pa = json_is_object(a) ? json_object_get(a, "properties") : NULL;
    json_t *pb = json_is_object(b) ? json_object_get(b, "properties") : NULL;
    if (!json_is_object(pa) || !json_is_object(pb)) return false;
    const char *k;
    json_t *sa;
    json_object_foreach(pa, k, sa) {
        json_t *sb = json_object_get(pb, k);
        if (!sb || !in_required(a, k) || !in_required(b, k)) continue;
        json_t *la = literal_values(deref(c, sa)), *lb = literal_values(deref(c, sb));
        bool dis = la && lb && literals_disjoint(la, lb);
        json_decref(la);
        json_decref(lb);
        if (dis) return true;
    }
    return false;
}

static int gen_any_of(sc *c, json_t *s, const char *ptr, const char *kw, sbuf *b) {
    json_t *arr = json_object_get(s, kw);
    static const char *const ok[] = {"anyOf", "oneOf", NULL};
    const char *other = other_keyword(s, ok);
    if (other) return kv_fail(c->d, KV_EUNSUPPORTED, "schema %s: '%s' beside '%s' is not supported", ptr, other, kw);
    if (json_object_get(s, "anyOf") && json_object_get(s, "oneOf"))
        return kv_fail(c->d, KV_EUNSUPPORTED, "schema %s: 'anyOf' beside 'oneOf' is not supported", ptr);
    if (!json_is_array(arr) || json_array_size(arr) == 0)
        return kv_fail(c->d, KV_EFORMAT, "schema %s: '%s' is not a non-empty array", ptr, kw);
    size_t n = json_array_size(arr);
    if (!strcmp(kw, "oneOf")) {
        /* exactly one branch must match: refuse branches that may overlap */
        for (size_t i = 0; i < n; i++) {
            for (size_t j = i + 1; j < n; j++) {
                json_t *a = json_array_get(arr, i), *bb = json_array_get(arr, j);
                int ba = schema_bits(c, a, 0), bj = schema_bits(c, bb, 0);
                if (!(ba & bj)) continue;
                json_t *la = literal_values(deref(c, a)), *lb = literal_values(deref(c, bb));
                bool dis = la && lb && literals_disjoint(la, lb);
                json_decref(la);
                json_decref(lb);
                if (dis) continue;
                if ((ba & bj) == T_OBJ && objects_disjoint(c, a, bb)) continue;
                return kv_fail(c->d, KV_EUNSUPPORTED,
                               "schema %s: 'oneOf' branches %zu and %zu may both match (not supported; use anyOf, or "
                               "branches of different types, distinct constants, or objects that require a property "
                               "with distinct constants)",
                               ptr, i, j);
            }
        }
    }
    sb_str(b, "(");
    for (size_t i = 0; i < n; i++) {
        char sub[256], seg[32];
        rname r;
        snprintf(seg, sizeof seg, "%s/%zu", kw, i);
        sub_ptr(sub, sizeof sub, ptr, seg);
        int rc = gen(c, json_array_get(arr, i), sub, r);
        if (rc) return rc;
        sb_fmt(b, "%s%s", i ? " | " : "", r);
    }
    sb_str(b, ")");
    return 0;
}

static int gen_types(sc *c, json_t *s, const char *ptr, sbuf *b) {
    json_t *tv = json_object_get(s, "type"), *nv = json_object_get(s, "nullable");
    int bits = 0;
    if (nv && !json_is_boolean(nv)) return kv_fail(c->d, KV_EFORMAT, "schema %s: 'nullable' is not a boolean", ptr);
    if (json_is_string(tv)) {
        bits = type_bit(json_string_value(tv));
        if (!bits) return kv_fail(c->d, KV_EFORMAT, "schema %s: unknown type '%.60s'", ptr, json_string_value(tv));
    } else if (json_is_array(tv)) {
        size_t i;
        json_t *e;
        json_array_foreach(tv, i, e) {
            int t = json_is_string(e) ? type_bit(json_string_value(e)) : 0;
            if (!t) return kv_fail(c->d, KV_EFORMAT, "schema %s: 'type' holds an unknown type", ptr);
            bits |= t;
        }
        if (!bits) return kv_fail(c->d, KV_EFORMAT, "schema %s: 'type' is an empty array", ptr);
    } else if (tv) {
        return kv_fail(c->d, KV_EFORMAT, "schema %s: 'type' is not a string or array", ptr);
    } else {
        /* no type: the type its keywords describe (other types would be unconstrained) */
        if (json_object_get(s, "properties") || json_object_get(s, "required") || json_object_get(s, "additionalProperties"))
            bits = T_OBJ;
        else if (json_object_get(s, "items") || json_object_get(s, "minItems") || json_object_get(s, "maxItems"))
            bits = T_ARR;
        else if (json_object_get(s, "minLength") || json_object_get(s, "maxLength"))
            bits = T_STR;
        else if (json_object_get(s, "minimum") || json_object_get(s, "maximum") ||
                 json_object_get(s, "exclusiveMinimum") || json_object_get(s, "exclusiveMaximum"))
            bits = T_INT | T_NUM;
    }
    if (json_is_true(nv)) bits |= T_NULL;
    if (!bits) {
        sb_str(b, "value");
        return 0;
    }
    bool nonneg = false; /* number with minimum 0: no minus sign */
    if (bits & T_NUM) {
        json_t *mn = json_object_get(s, "minimum");
        nonneg = mn && json_is_number(mn) && json_number_value(mn) == 0 && !json_object_get(s, "maximum") &&
                 !json_object_get(s, "exclusiveMinimum") && !json_object_get(s, "exclusiveMaximum");
        if (!nonneg && (mn || json_object_get(s, "maximum") || json_object_get(s, "exclusiveMinimum") ||
                        json_object_get(s, "exclusiveMaximum")))
            return kv_fail(c->d, KV_EUNSUPPORTED,
                           "schema %s: bounds on type number are not supported but 'minimum': 0 alone (on integer they are)",
                           ptr);
    }
    int n = 0, rc = 0;
    sb_str(b, "(");
#define ALT() sb_str(b, n++ ? " | " : "")
    if (bits & T_NULL) ALT(), sb_str(b, "null");
    if (bits & T_BOOL) ALT(), sb_str(b, "boolean");
    if (!rc && (bits & T_OBJ)) ALT(), rc = gen_object(c, s, ptr, b);
    if (!rc && (bits & T_ARR)) ALT(), rc = gen_array(c, s, ptr, b);
    if (!rc && (bits & T_STR)) ALT(), rc = gen_string(c, s, ptr, b);
    if (!rc && (bits & T_NUM)) ALT(), sb_str(b, nonneg ? "number-nonneg" : "number");
    else if (!rc && (bits & T_INT)) ALT(), rc = gen_integer(c, s, ptr, b);
#undef ALT
    sb_str(b, ")");
    return rc;
}

/* Compiles s into a rule; *out its name (possibly a shared one). */
static int gen(sc *c, json_t *s, const char *ptr, rname out) {
    if (json_is_true(s)) {
        snprintf(out, sizeof(rname), "value");
        return 0;
    }
    if (json_is_false(s)) return kv_fail(c->d, KV_EFORMAT, "schema %s: the schema false admits no value", ptr);
    if (!json_is_object(s)) return kv_fail(c->d, KV_EFORMAT, "schema %s: not a schema (an object or boolean)", ptr);
    if (c->depth >= c->lim->max_nesting)
        return kv_fail(c->d, KV_ERANGE, "schema %s: nested deeper than %u (max_nesting)", ptr, c->lim->max_nesting);
    const char *k;
    json_t *v;
    json_object_foreach(s, k, v) {
        if (!in_list(k, k_annotations) && !in_list(k, k_handled))
            return kv_fail(c->d, KV_EUNSUPPORTED, "schema %s: keyword '%.60s' is not supported", ptr, k);
    }
    c->depth++;
    int rc = 0;
    json_t *ref = json_object_get(s, "$ref");
    if (ref) {
        static const char *const ok[] = {"$ref", NULL};
        const char *other = other_keyword(s, ok);
        json_t *t = NULL, *known;
        if (!json_is_string(ref)) rc = kv_fail(c->d, KV_EFORMAT, "schema %s: '$ref' is not a string", ptr);
        else if (other) rc = kv_fail(c->d, KV_EUNSUPPORTED, "schema %s: '%s' beside '$ref' is not supported", ptr, other);
        else if ((known = json_object_get(c->refs, json_string_value(ref))))
            snprintf(out, sizeof(rname), "%s", json_string_value(known));
        else if (!(rc = resolve_ref(c, json_string_value(ref), ptr, &t))) {
            /* named before compiling, so a recursive reference finds it */
            rname r;
            new_name(c, r);
            json_object_set_new(c->refs, json_string_value(ref), json_string(r));
            rname inner;
            char sub[256];
            snprintf(sub, sizeof sub, "%.200s", json_string_value(ref) + 1);
            if (!(rc = gen(c, t, sub[0] ? sub : "(root)", inner))) {
                sbuf b = {0};
                sb_str(&b, inner);
                rc = emit_rule(c, r, &b);
                free(b.s);
            }
            snprintf(out, sizeof(rname), "%s", r);
        }
        c->depth--;
        return rc;
    }
    json_t *all = json_object_get(s, "allOf");
    if (all) {
        static const char *const ok[] = {"allOf", NULL};
        const char *other = other_keyword(s, ok);
        if (!json_is_array(all) || json_array_size(all) != 1 || other)
            rc = kv_fail(c->d, KV_EUNSUPPORTED, "schema %s: 'allOf' is supported only with one schema and nothing beside", ptr);
        else {
            char sub[256];
            sub_ptr(sub, sizeof sub, ptr, "allOf/0");
            rc = gen(c, json_array_get(all, 0), sub, out);
        }
        c->depth--;
        return rc;
    }
    rname r;
    new_name(c, r);
    sbuf b = {0};
    if (json_object_get(s, "const") || json_object_get(s, "enum")) rc = gen_literals(c, s, ptr, &b);
    else if (json_object_get(s, "anyOf")) rc = gen_any_of(c, s, ptr, "anyOf", &b);
    else if (json_object_get(s, "oneOf")) rc = gen_any_of(c, s, ptr, "oneOf", &b);
    else rc = gen_types(c, s, ptr, &b);
    if (!rc) rc = emit_rule(c, r, &b);
    free(b.s);
    snprintf(out, sizeof(rname), "%s", r);
    c->depth--;
    return rc;
}

static const char k_base[] =
    "ws ::= (\" \" | \"\\n\" [ \\t]{0,8})?\n"
    "value ::= object-any | array-any | string | number | boolean | null\n"
    "object-any ::= \"{\" ws (string ws \":\" ws value ws (\",\" ws string ws \":\" ws value ws)*)? \"}\"\n"
    "array-any ::= \"[\" ws (value ws (\",\" ws value ws)*)? \"]\"\n"
    "string ::= \"\\\"\" char* \"\\\"\"\n"
    "char ::= [^\"\\\\\\x00-\\x1f] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" hex4)\n"
    "hex4 ::= ([0-9a-cA-Ce-fE-F] [0-9a-fA-F] | [dD] [0-7]) [0-9a-fA-F] [0-9a-fA-F]\n"
    "integer ::= \"-\"? (\"0\" | [1-9] [0-9]{0,14})\n"
    "number ::= \"-\"? number-nonneg\n"
    "number-nonneg ::= (\"0\" | [1-9] [0-9]{0,14}) (\".\" [0-9]{1,15})? ([eE] [-+]? [1-9] [0-9]?)?\n"
    "boolean ::= \"true\" | \"false\"\n"
    "null ::= \"null\"\n";

int kv_grammar_schema_to_gbnf(char **gbnf, const char *schema, size_t len, const kv_grammar_limits *lim, kv_diag *d) {
    *gbnf = NULL;
    kv_grammar_limits dl;
    if (!lim) {
        kv_grammar_limits_default(&dl);
        lim = &dl;
    }
    if (len > lim->max_text_bytes)
        return kv_fail(d, KV_ERANGE, "schema: %zu bytes, max %zu (max_text_bytes)", len, lim->max_text_bytes);
    json_error_t je;
    json_t *root = json_loadb(schema ? schema : "", len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &je);
    if (!root) return kv_fail(d, KV_EFORMAT, "schema: not JSON (line %d column %d: %s)", je.line, je.column, je.text);
    sc c = {.root = root, .refs = json_object(), .lim = lim, .d = d};
    int rc = c.refs ? 0 : kv_fail(d, KV_ENOMEM, "schema: out of memory");
    rname top;
    if (!rc) rc = gen(&c, root, "#", top);
    sbuf all = {0};
    if (!rc) {
        sb_fmt(&all, "root ::= %s\n", top);
        sb_str(&all, k_base);
        sb_put(&all, c.out.s ? c.out.s : "", c.out.n);
        if (all.oom || c.out.oom) rc = kv_fail(d, KV_ENOMEM, "schema: out of memory");
    }
    free(c.out.s);
    json_decref(c.refs);
    json_decref(root);
    if (rc) {
        free(all.s);
        return rc;
    }
    *gbnf = all.s;
    return 0;
}

static bool name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

int kv_grammar_schema_to_gbnf_named(char **gbnf, const char *schema, size_t len, const char *name,
                                    const kv_grammar_limits *lim, kv_diag *d) {
    *gbnf = NULL;
    size_t nl = name ? strlen(name) : 0;
    if (nl == 0 || nl > 64) return kv_fail(d, KV_EINVAL, "schema: rule name of %zu bytes (1-64)", nl);
    for (size_t i = 0; i < nl; i++)
        if (!name_char(name[i])) return kv_fail(d, KV_EINVAL, "schema: rule name '%.64s' has a character outside [A-Za-z0-9_-]", name);
    char *txt = NULL;
    int rc = kv_grammar_schema_to_gbnf(&txt, schema, len, lim, d);
    if (rc) return rc;
    /* prefix every rule name: words outside literals, classes, {m,n} and comments */
    sbuf out = {0};
    const char *p = txt;
    if (!strncmp(p, "root ::= ", 9)) { /* the entry rule becomes `name` */
        sb_fmt(&out, "%s ::= ", name);
        p += 9;
    }
    kv_grammar_limits dl;
    if (!lim) {
        kv_grammar_limits_default(&dl);
        lim = &dl;
    }
    while (*p && out.n <= lim->max_text_bytes) {
        char c = *p;
        if (c == '"' || c == '[') {
            char close = c == '"' ? '"' : ']';
            const char *q = p + 1;
            while (*q && *q != close) q += (*q == '\\' && q[1]) ? 2 : 1;
            if (*q) q++;
            sb_put(&out, p, (size_t)(q - p));
            p = q;
        } else if (c == '{' || c == '#') {
            const char *q = p;
            while (*q && *q != (c == '{' ? '}' : '\n')) q++;
            if (*q && c == '{') q++;
            sb_put(&out, p, (size_t)(q - p));
            p = q;
        } else if (name_char(c)) {
            const char *q = p;
            while (name_char(*q)) q++;
            sb_fmt(&out, "%s-", name);
            sb_put(&out, p, (size_t)(q - p));
            p = q;
        } else {
            sb_put(&out, p, 1);
            p++;
        }
    }
    free(txt);
    if (out.oom || out.n > lim->max_text_bytes) {
        free(out.s);
        if (out.oom) return kv_fail(d, KV_ENOMEM, "schema: out of memory");
        return kv_fail(d, KV_ERANGE, "schema: grammar under '%s' over %zu bytes (max_text_bytes)", name, lim->max_text_bytes);
    }
    *gbnf = out.s;
    return 0;
}

int kv_grammar_from_schema(kv_grammar **out, const char *schema, size_t len, const kv_grammar_limits *lim, kv_diag *d) {
    *out = NULL;
    char *txt = NULL;
    int rc = kv_grammar_schema_to_gbnf(&txt, schema, len, lim, d);
    if (!rc) {
        rc = kv_grammar_parse(out, txt, strlen(txt), lim, d);
        if (rc) kv_diag_prefix(d, rc, "the grammar compiled from the schema");
    }
    free(txt);
    return rc;
}

int kv_grammar_json_object(kv_grammar **out, const kv_grammar_limits *lim, kv_diag *d) {
    static const char s[] = "{\"type\": \"object\"}";
    return kv_grammar_from_schema(out, s, sizeof s - 1, lim, d);
}
