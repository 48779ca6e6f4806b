/* GBNF parser: llama.cpp's grammar text format into the flat form of
 * grammar_internal.h.
 *
 *   rule    ::= name "::=" alternates          (a newline ends a rule, unless
 *   alts    ::= sequence ("|" sequence)*         inside parentheses or the next
 *   item    ::= "literal" | [class] | . | name   line starts with "|")
 *             | "(" alternates ")"
 *   postfix ::= * | + | ? | {m} | {m,} | {m,n}
 *   comment ::= "#" to the end of the line
 *
 * Literals and classes take \n \r \t \\ \" \' \[ \] \- \^ \/ and \xHH, \uHHHH,
 * \UHHHHHHHH escapes; text outside escapes is UTF-8 and must be valid. A
 * group becomes a generated rule; x* becomes R ::= x R | "" (right
 * recursion: the matcher's tail call keeps its stack flat), x{m,n} m copies
 * of x then a chain of n - m nested optional rules. Every input is bounded by
 * kv_grammar_limits (text, rules, elements, nesting, repeat counts); every
 * error names its line:column (1-based, the column in bytes). After parsing,
 * undefined rules and left recursion (including a repetition of something
 * that can match empty text) are refused, which is what lets the matcher
 * expand a stack without a bound on its loop. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_internal.h"

typedef struct u32v {
    uint32_t *v;
    size_t n, cap;
} u32v;

typedef struct prule {
    char *name;
    bool defined;
    bool generated;  /* made for a group or repetition */
    size_t at;       /* offset of its definition, or of its first use */
    u32v *alts;      /* [n_alts] element sequences without GEL_END */
    size_t n_alts, cap_alts;
} prule;

typedef struct parser {
    const char *s;
    size_t n, i;
    const kv_grammar_limits *lim;
    kv_diag *d;
    prule *rules;
    uint32_t n_rules, cap_rules;
    uint32_t *hash;        /* [hash_cap] rule index + 1, 0 empty (named rules only) */
    uint32_t hash_cap;
    kv_gset *sets;
    uint32_t n_sets, cap_sets;
    kv_grange *ranges;
    uint32_t n_ranges, cap_ranges;
    uint32_t ascii_set[128]; /* set index + 1 of single ASCII characters */
    uint32_t nest;
    size_t n_el;           /* elements over all alternatives (END counted) */
} parser;

static void line_col(const char *s, size_t at, uint32_t *line, uint32_t *col) {
    uint32_t l = 1, c = 1;
    for (size_t k = 0; k < at; k++) {
        if (s[k] == '\n') {
            l++;
            c = 1;
        } else {
            c++;
        }
    }
    *line = l;
    *col = c;
}

#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
static int pfail(parser *p, int code, size_t at, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    uint32_t line, col;
    line_col(p->s, at < p->n ? at : p->n, &line, &col);
    return kv_fail(p->d, code, "grammar %u:%u: %s", line, col, msg);
}

static int grow(void **v, size_t elem, size_t need, size_t *cap) {
    if (need <= *cap) return 0;
    size_t nc = *cap ? *cap * 2 : 8;
    while (nc < need) nc *= 2;
    void *nv = realloc(*v, nc * elem);
    if (!nv) return KV_ENOMEM;
    *v = nv;
    *cap = nc;
    return 0;
}

static int u32v_push(parser *p, u32v *a, uint32_t x) {
    if (p->n_el + 1 > p->lim->max_elements)
        return pfail(p, KV_ERANGE, p->i, "more than %u grammar elements (max_elements)",
                     p->lim->max_elements);
    if (grow((void **)&a->v, sizeof *a->v, a->n + 1, &a->cap)) return kv_fail(p->d, KV_ENOMEM, "grammar: out of memory");
    a->v[a->n++] = x;
    p->n_el++;
    return 0;
}

static uint32_t name_hash(const char *s, size_t n) {
    uint32_t h = 2166136261u;
    for (size_t k = 0; k < n; k++) h = (h ^ (uint8_t)s[k]) * 16777619u;
    return h;
}

static int new_rule(parser *p, const char *name, size_t nlen, bool generated, size_t at, uint32_t *out) {
    if (p->n_rules >= p->lim->max_rules)
        return pfail(p, KV_ERANGE, at, "more than %u rules (max_rules; groups and repetitions count)",
                     p->lim->max_rules);
    size_t cap = p->cap_rules;
    if (grow((void **)&p->rules, sizeof *p->rules, p->n_rules + 1, &cap)) return kv_fail(p->d, KV_ENOMEM, "grammar: out of memory");
    p->cap_rules = (uint32_t)cap;
    prule *r = &p->rules[p->n_rules];
    memset(r, 0, sizeof *r);
    r->name = malloc(nlen + 1);
    if (!r->name) return kv_fail(p->d, KV_ENOMEM, "grammar: out of memory");
    memcpy(r->name, name, nlen);
    r->name[nlen] = 0;
    r->generated = generated;
    r->at = at;
    *out = p->n_rules++;
    if (!generated) {
        /* the table is kept at most half full */
        if ((p->n_rules + 1) * 2 > p->hash_cap) {
            uint32_t nc = p->hash_cap ? p->hash_cap * 2 : 64;
            uint32_t *nh = calloc(nc, sizeof *nh);
            if (!nh) return kv_fail(p->d, KV_ENOMEM, "grammar: out of memory");
            for (uint32_t k = 0; k < p->hash_cap; k++) {
                if (!p->hash[k]) continue;
                const char *nm = p->rules[p->hash[k] - 1].name;
                uint32_t h = name_hash(nm, strlen(nm)) & (nc - 1);
                while (nh[h]) h = (h + 1) & (nc - 1);
                nh[h] = p->hash[k];
            }
            free(p->hash);
            p->hash = nh;
            p->hash_cap = nc;
        }
        uint32_t h = name_hash(name, nlen) & (p->hash_cap - 1);
        while (p->hash[h]) h = (h + 1) & (p->hash_cap - 1);
        p->hash[h] = *out + 1;
    }
    return 0;
}

/* The rule named name[0..nlen), created (undefined) at its first use. */
static int get_rule(parser *p, const char *name, size_t nlen, size_t at, uint32_t *out) {
    if (p->hash_cap) {
        uint32_t h = name_hash(name, nlen) & (p->hash_cap - 1);
        while (p->hash[h]) {
            const char *nm = p->rules[p->hash[h] - 1].name;
            if (strlen(nm) == nlen && !memcmp(nm, name, nlen)) {
                *out = p->hash[h] - 1;
                return 0;
            }
            h = (h + 1) & (p->hash_cap - 1);
        }
    }
    return new_rule(p, name, nlen, false, at, out);
}

static int gen_rule(parser *p, uint32_t parent, size_t at, uint32_t *out) {
    char nm[96];
    int k = snprintf(nm, sizeof nm, "%.60s~%u", p->rules[parent].name, p->n_rules);
    return new_rule(p, nm, (size_t)k, true, at, out);
}

static int rule_new_alt(parser *p, uint32_t r, u32v **out) {
    prule *R = &p->rules[r];
    if (grow((void **)&R->alts, sizeof *R->alts, R->n_alts + 1, &R->cap_alts)) return kv_fail(p->d, KV_ENOMEM, "grammar: out of memory");
    memset(&R->alts[R->n_alts], 0, sizeof(u32v));
    if (p->n_el + 1 > p->lim->max_elements) /* its GEL_END */
        return pfail(p, KV_ERANGE, p->i, "more than %u grammar elements (max_elements)", p->lim->max_elements);
    p->n_el++;
    *out = &R->alts[R->n_alts++];
    return 0;
}

static int cmp_range(const void *a, const void *b) {
    const kv_grange *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* Adds a set; its ranges (rg, reordered in place) are sorted and merged
 * so that matching is a binary search. */
static int add_set(parser *p, kv_grange *rg, uint32_t n, bool negated, uint32_t *out) {
    if (n > 1) {
        qsort(rg, n, sizeof *rg, cmp_range);
        uint32_t u = 0;
        for (uint32_t i = 1; i < n; i++) {
            if (rg[i].lo <= rg[u].hi || rg[i].lo == rg[u].hi + 1) {
                if (rg[i].hi > rg[u].hi) rg[u].hi = rg[i].hi;
            } else {
                rg[++u] = rg[i];
            }
        }
        n = u + 1;
    }
    if (!negated && n == 1 && rg[0].lo == rg[0].hi && rg[0].lo < 128 && p->ascii_set[rg[0].lo]) {
        *out = p->ascii_set[rg[0].lo] - 1;
        return 0;
    }
    size_t cs = p->cap_sets, cr = p->cap_ranges;
    if (p->n_sets >= p->lim->max_elements || p->n_ranges + n > p->lim->max_elements)
        return pfail(p, KV_ERANGE, p->i, "more than %u character ranges (max_elements)", p->lim->max_elements);
    if (grow((void **)&p->sets, sizeof *p->sets, p->n_sets + 1, &cs) ||
        grow((void **)&p->ranges, sizeof *p->ranges, p->n_ranges + n, &cr))
        return kv_fail(p->d, KV_ENOMEM, "grammar: out of memory");
    p->cap_sets = (uint32_t)cs;
    p->cap_ranges = (uint32_t)cr;
    p->sets[p->n_sets] = (kv_gset){.first = p->n_ranges, .n = n, .negated = negated};
    if (n) memcpy(p->ranges + p->n_ranges, rg, n * sizeof *rg);
    p->n_ranges += n;
    *out = p->n_sets++;
    if (!negated && n == 1 && rg[0].lo == rg[0].hi && rg[0].lo < 128) p->ascii_set[rg[0].lo] = *out + 1;
    return 0;
}

static bool is_word(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

/* Skips blanks and comments; newlines too when nl. */
static void skip_ws(parser *p, bool nl) {
    while (p->i < p->n) {
        char c = p->s[p->i];
        if (c == ' ' || c == '\t') {
            p->i++;
        } else if (c == '#') {
            while (p->i < p->n && p->s[p->i] != '\n') p->i++;
        } else if (nl && (c == '\n' || c == '\r')) {
            p->i++;
        } else if (c == '\r' && p->i + 1 < p->n && p->s[p->i + 1] == '\n') {
            p->i++; /* CRLF: the \n ends the line */
        } else {
            break;
        }
    }
}

/* Decodes one UTF-8 code point at p->i (advancing), refusing invalid UTF-8. */
static int utf8_cp(parser *p, uint32_t *cp) {
    const uint8_t *s = (const uint8_t *)p->s;
    size_t at = p->i;
    uint8_t b = s[at];
    uint32_t need, v, min;
    if (b < 0x80) {
        *cp = b;
        p->i++;
        return 0;
    } else if (b >= 0xC2 && b <= 0xDF) {
        need = 1, v = b & 0x1F, min = 0x80;
    } else if (b >= 0xE0 && b <= 0xEF) {
        need = 2, v = b & 0x0F, min = 0x800;
    } else if (b >= 0xF0 && b <= 0xF4) {
        need = 3, v = b & 0x07, min = 0x10000;
    } else {
        return pfail(p, KV_EFORMAT, at, "invalid UTF-8 byte 0x%02x", b);
    }
    for (uint32_t k = 1; k <= need; k++) {
        if (at + k >= p->n || (s[at + k] & 0xC0) != 0x80) return pfail(p, KV_EFORMAT, at, "invalid UTF-8 sequence");
        v = (v << 6) | (s[at + k] & 0x3F);
    }
    if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
        return pfail(p, KV_EFORMAT, at, "invalid UTF-8 sequence (code point U+%04X)", v);
    *cp = v;
    p->i = at + 1 + need;
    return 0;
}

static int hex_digits(parser *p, int n, uint32_t *out) {
    uint32_t v = 0;
    for (int k = 0; k < n; k++) {
        if (p->i >= p->n) return pfail(p, KV_EFORMAT, p->i, "expected %d hex digits in an escape", n);
        char c = p->s[p->i];
        uint32_t dgt;
        if (c >= '0' && c <= '9') dgt = (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f') dgt = (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') dgt = (uint32_t)(c - 'A' + 10);
        else return pfail(p, KV_EFORMAT, p->i, "expected %d hex digits in an escape, got '%c'", n, c);
        v = (v << 4) | dgt;
        p->i++;
    }
    *out = v;
    return 0;
}

/* One character of a literal or class: an escape or a UTF-8 code point. */
static int parse_char(parser *p, uint32_t *cp) {
    if (p->i >= p->n) return pfail(p, KV_EFORMAT, p->i, "unexpected end of text");
    if (p->s[p->i] != '\\') return utf8_cp(p, cp);
    size_t at = p->i++;
    if (p->i >= p->n) return pfail(p, KV_EFORMAT, at, "unfinished escape");
    char c = p->s[p->i++];
    int rc = 0;
    switch (c) {
    case 'n': *cp = '\n'; break;
    case 'r': *cp = '\r'; break;
    case 't': *cp = '\t'; break;
    case '\\': case '"': case '\'': case '[': case ']': case '-': case '^': case '/': *cp = (uint8_t)c; break;
    case 'x': rc = hex_digits(p, 2, cp); break;
    case 'u': rc = hex_digits(p, 4, cp); break;
    case 'U': rc = hex_digits(p, 8, cp); break;
    default: return pfail(p, KV_EFORMAT, at, "unknown escape '\\%c'", c);
    }
    if (rc) return rc;
    if (*cp > 0x10FFFF || (*cp >= 0xD800 && *cp <= 0xDFFF))
        return pfail(p, KV_EFORMAT, at, "escape names no Unicode scalar value (U+%X)", *cp);
    return 0;
}

static int parse_literal(parser *p, u32v *alt) {
    size_t at = p->i++;
    for (;;) {
        if (p->i >= p->n || p->s[p->i] == '\n') return pfail(p, KV_EFORMAT, at, "unterminated string literal");
        if (p->s[p->i] == '"') {
            p->i++;
            return 0;
        }
        uint32_t cp, set;
        int rc = parse_char(p, &cp);
        if (!rc) rc = add_set(p, &(kv_grange){cp, cp}, 1, false, &set);
        if (!rc) rc = u32v_push(p, alt, GEL(GEL_SET, set));
        if (rc) return rc;
    }
}

static int parse_class(parser *p, u32v *alt) {
    size_t at = p->i++;
    bool neg = false;
    if (p->i < p->n && p->s[p->i] == '^') {
        neg = true;
        p->i++;
    }
    kv_grange buf[64], *rg = buf;
    size_t n = 0, cap = 64;
    int rc = 0;
    for (;;) {
        if (p->i >= p->n || p->s[p->i] == '\n') {
            rc = pfail(p, KV_EFORMAT, at, "unterminated character class");
            break;
        }
        if (p->s[p->i] == ']') {
            p->i++;
            break;
        }
        uint32_t lo, hi;
        size_t cat = p->i;
        if ((rc = parse_char(p, &lo))) break;
        hi = lo;
        if (p->i + 1 < p->n && p->s[p->i] == '-' && p->s[p->i + 1] != ']') {
            p->i++;
            if ((rc = parse_char(p, &hi))) break;
            if (hi < lo) {
                rc = pfail(p, KV_EFORMAT, cat, "character range U+%04X-U+%04X is reversed", lo, hi);
                break;
            }
        }
        if (n == cap) {
            if (cap >= p->lim->max_elements) {
                rc = pfail(p, KV_ERANGE, at, "character class over %u ranges (max_elements)", p->lim->max_elements);
                break;
            }
            kv_grange *nr = malloc(cap * 2 * sizeof *nr);
            if (!nr) {
                rc = kv_fail(p->d, KV_ENOMEM, "grammar: out of memory");
                break;
            }
            memcpy(nr, rg, n * sizeof *rg);
            if (rg != buf) free(rg);
            rg = nr;
            cap *= 2;
        }
        rg[n++] = (kv_grange){lo, hi};
    }
    if (!rc && n == 0 && !neg) rc = pfail(p, KV_EFORMAT, at, "empty character class matches nothing");
    uint32_t set;
    if (!rc) rc = add_set(p, rg, (uint32_t)n, neg, &set);
    if (!rc) rc = u32v_push(p, alt, GEL(GEL_SET, set));
    if (rg != buf) free(rg);
    return rc;
}

static int parse_uint(parser *p, uint32_t *out) {
    size_t at = p->i;
    uint64_t v = 0;
    if (p->i >= p->n || p->s[p->i] < '0' || p->s[p->i] > '9') return pfail(p, KV_EFORMAT, at, "expected a number");
    while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') {
        v = v * 10 + (uint64_t)(p->s[p->i++] - '0');
        if (v > p->lim->max_repeat)
            return pfail(p, KV_ERANGE, at, "repetition count over %u (max_repeat)", p->lim->max_repeat);
    }
    *out = (uint32_t)v;
    return 0;
}

#define REP_INF UINT32_MAX

/* Replaces alt[last..] (the item just parsed) by its repetition min..max. */
static int apply_rep(parser *p, uint32_t rule, uint32_t *alt_idx, size_t last, uint32_t min, uint32_t max, size_t at) {
    u32v *alt = &p->rules[rule].alts[*alt_idx];
    size_t len = alt->n - last;
    uint32_t *item = malloc((len ? len : 1) * sizeof *item);
    if (!item) return kv_fail(p->d, KV_ENOMEM, "grammar: out of memory");
    if (len) memcpy(item, alt->v + last, len * sizeof *item);
    alt->n = last;
    p->n_el -= len;
    int rc = 0;
    for (uint32_t k = 0; k < min && !rc; k++)
        for (size_t j = 0; j < len && !rc; j++) rc = u32v_push(p, &p->rules[rule].alts[*alt_idx], item[j]);
    if (!rc && max == REP_INF) {
        /* R ::= item R | "" */
        uint32_t r;
        u32v *a;
        rc = gen_rule(p, rule, at, &r);
        if (!rc) rc = rule_new_alt(p, r, &a);
        for (size_t j = 0; j < len && !rc; j++) rc = u32v_push(p, a, item[j]);
        if (!rc) rc = u32v_push(p, a, GEL(GEL_REF, r));
        if (!rc) rc = rule_new_alt(p, r, &a);
        if (!rc) rc = u32v_push(p, &p->rules[rule].alts[*alt_idx], GEL(GEL_REF, r));
    } else if (!rc && max > min) {
        /* R1 ::= item R2 | "" ... Rk ::= item | "", built from the inside */
        uint32_t prev = UINT32_MAX;
        for (uint32_t k = max - min; k >= 1 && !rc; k--) {
            uint32_t r;
            u32v *a;
            rc = gen_rule(p, rule, at, &r);
            if (!rc) rc = rule_new_alt(p, r, &a);
            for (size_t j = 0; j < len && !rc; j++) rc = u32v_push(p, a, item[j]);
            if (!rc && prev != UINT32_MAX) rc = u32v_push(p, a, GEL(GEL_REF, prev));
            if (!rc) rc = rule_new_alt(p, r, &a);
            prev = r;
        }
        if (!rc) rc = u32v_push(p, &p->rules[rule].alts[*alt_idx], GEL(GEL_REF, prev));
    }
    free(item);
    return rc;
}

static int parse_alternates(parser *p, uint32_t rule, bool nested);

static int parse_sequence(parser *p, uint32_t rule, bool nested) {
    uint32_t ai;
    u32v *alt;
    int rc = rule_new_alt(p, rule, &alt);
    if (rc) return rc;
    ai = (uint32_t)(p->rules[rule].n_alts - 1);
    size_t last = SIZE_MAX; /* where the last item's elements start */
    for (;;) {
        skip_ws(p, nested);
        if (p->i >= p->n) return 0;
        alt = &p->rules[rule].alts[ai];
        char c = p->s[p->i];
        size_t at = p->i;
        if (c == '"') {
            last = alt->n;
            rc = parse_literal(p, alt);
        } else if (c == '[') {
            last = alt->n;
            rc = parse_class(p, alt);
        } else if (c == '.') {
            uint32_t set;
            p->i++;
            last = alt->n;
            rc = add_set(p, NULL, 0, true, &set);
            if (!rc) rc = u32v_push(p, alt, GEL(GEL_SET, set));
        } else if (is_word(c)) {
            while (p->i < p->n && is_word(p->s[p->i])) p->i++;
            uint32_t r;
            last = alt->n;
            rc = get_rule(p, p->s + at, p->i - at, at, &r);
            if (!rc) rc = u32v_push(p, &p->rules[rule].alts[ai], GEL(GEL_REF, r));
        } else if (c == '(') {
            if (p->nest >= p->lim->max_nesting)
                return pfail(p, KV_ERANGE, at, "parentheses nested deeper than %u (max_nesting)", p->lim->max_nesting);
            p->i++;
            p->nest++;
            uint32_t g;
            rc = gen_rule(p, rule, at, &g);
            if (!rc) rc = parse_alternates(p, g, true);
            if (rc) return rc;
            skip_ws(p, true);
            if (p->i >= p->n || p->s[p->i] != ')') return pfail(p, KV_EFORMAT, at, "'(' without a matching ')'");
            p->i++;
            p->nest--;
            last = p->rules[rule].alts[ai].n;
            rc = u32v_push(p, &p->rules[rule].alts[ai], GEL(GEL_REF, g));
        } else if (c == '*' || c == '+' || c == '?' || c == '{') {
            if (last == SIZE_MAX) return pfail(p, KV_EFORMAT, at, "'%c' repeats nothing", c);
            uint32_t min = 0, max = REP_INF;
            p->i++;
            if (c == '+') min = 1;
            if (c == '?') max = 1;
            if (c == '{') {
                skip_ws(p, false);
                if ((rc = parse_uint(p, &min))) return rc;
                skip_ws(p, false);
                max = min;
                if (p->i < p->n && p->s[p->i] == ',') {
                    p->i++;
                    skip_ws(p, false);
                    max = REP_INF;
                    if (p->i < p->n && p->s[p->i] != '}' && (rc = parse_uint(p, &max))) return rc;
                    skip_ws(p, false);
                }
                if (p->i >= p->n || p->s[p->i] != '}') return pfail(p, KV_EFORMAT, at, "'{' repetition without '}'");
                p->i++;
                if (max < min) return pfail(p, KV_EFORMAT, at, "repetition {%u,%u} has max < min", min, max);
            }
            rc = apply_rep(p, rule, &ai, last, min, max, at);
            /* a following postfix applies to the generated repetition */
            if (!rc && p->rules[rule].alts[ai].n) last = p->rules[rule].alts[ai].n - 1;
            if (!rc && min == max && max != REP_INF) last = SIZE_MAX;
        } else {
            return 0;
        }
        if (rc) return rc;
    }
}

static int parse_alternates(parser *p, uint32_t rule, bool nested) {
    for (;;) {
        int rc = parse_sequence(p, rule, nested);
        if (rc) return rc;
        if (nested) {
            skip_ws(p, true);
        } else {
            skip_ws(p, false);
            if (p->i < p->n && p->s[p->i] != '\n' && p->s[p->i] != '\r' && p->s[p->i] != '|')
                return pfail(p, KV_EFORMAT, p->i, "unexpected '%c'", p->s[p->i]);
            size_t save = p->i;
            skip_ws(p, true);
            if (p->i >= p->n || p->s[p->i] != '|') {
                p->i = save;
                return 0;
            }
        }
        if (p->i >= p->n || p->s[p->i] != '|') return 0;
        p->i++;
        skip_ws(p, true);
    }
}

/* nullable[r]: rule r can match empty text. */
static int compute_nullable(parser *p, bool *nullable) {
    bool changed = true;
    while (changed) {
        changed = false;
        for (uint32_t r = 0; r < p->n_rules; r++) {
            if (nullable[r]) continue;
            for (size_t a = 0; a < p->rules[r].n_alts && !nullable[r]; a++) {
                const u32v *al = &p->rules[r].alts[a];
                bool all = true;
                for (size_t k = 0; k < al->n && all; k++)
                    all = GEL_KIND(al->v[k]) == GEL_REF && nullable[GEL_ARG(al->v[k])];
                if (all) nullable[r] = changed = true;
            }
        }
    }
    return 0;
}

/* Refuses a cycle of rules through left edges (after nullable prefixes). */
static int check_left_recursion(parser *p, const bool *nullable) {
    uint8_t *color = calloc(p->n_rules, 1);       /* 0 new, 1 on the path, 2 done */
    uint32_t *st_r = malloc(p->n_rules * sizeof *st_r), *st_a = malloc(p->n_rules * sizeof *st_a);
    uint32_t *st_k = malloc(p->n_rules * sizeof *st_k);
    int rc = 0;
    if (!color || !st_r || !st_a || !st_k) rc = kv_fail(p->d, KV_ENOMEM, "grammar: out of memory");
    for (uint32_t s = 0; s < p->n_rules && !rc; s++) {
        if (color[s]) continue;
        uint32_t top = 0;
        st_r[0] = s, st_a[0] = 0, st_k[0] = 0;
        color[s] = 1;
        while (!rc) {
            uint32_t r = st_r[top];
            const prule *R = &p->rules[r];
            uint32_t next = UINT32_MAX;
            /* the next left-edge reference of r not yet followed */
            while (st_a[top] < R->n_alts) {
                const u32v *al = &R->alts[st_a[top]];
                if (st_k[top] < al->n && GEL_KIND(al->v[st_k[top]]) == GEL_REF) {
                    uint32_t t = GEL_ARG(al->v[st_k[top]]);
                    bool go_on = nullable[t];
                    if (go_on) st_k[top]++;
                    else st_a[top]++, st_k[top] = 0;
                    next = t;
                    break;
                }
                st_a[top]++, st_k[top] = 0;
            }
            if (next == UINT32_MAX) {
                color[r] = 2;
                if (top == 0) break;
                top--;
                continue;
            }
            if (color[next] == 1) {
                const prule *N = &p->rules[next];
                if (N->generated)
                    rc = pfail(p, KV_EUNSUPPORTED, N->at,
                               "this group or repetition can recurse without consuming text (a repetition of "
                               "something that can match empty text, or left recursion through rule '%s')",
                               R->name);
                else
                    rc = pfail(p, KV_EUNSUPPORTED, N->at, "rule '%s' is left-recursive (not supported)", N->name);
            } else if (color[next] == 0) {
                color[next] = 1;
                top++;
                st_r[top] = next, st_a[top] = 0, st_k[top] = 0;
            }
        }
    }
    free(color);
    free(st_r);
    free(st_a);
    free(st_k);
    return rc;
}

static int flatten(parser *p, kv_grammar *g) {
    size_t n_alt = 0;
    for (uint32_t r = 0; r < p->n_rules; r++) n_alt += p->rules[r].n_alts;
    g->el = malloc((p->n_el + 1) * sizeof *g->el);
    g->alt = malloc((n_alt + 1) * sizeof *g->alt);
    g->rule_alt = malloc((p->n_rules + 1) * sizeof *g->rule_alt);
    if (!g->el || !g->alt || !g->rule_alt) return kv_fail(p->d, KV_ENOMEM, "grammar: out of memory");
    uint32_t ne = 0, na = 0;
    for (uint32_t r = 0; r < p->n_rules; r++) {
        g->rule_alt[r] = na;
        for (size_t a = 0; a < p->rules[r].n_alts; a++) {
            const u32v *al = &p->rules[r].alts[a];
            g->alt[na++] = ne;
            if (al->n) memcpy(g->el + ne, al->v, al->n * sizeof *al->v);
            ne += (uint32_t)al->n;
            g->el[ne++] = GEL(GEL_END, 0);
        }
    }
    g->rule_alt[p->n_rules] = na;
    KV_ASSERT(ne <= p->n_el);
    g->n_el = ne;
    g->n_alt = na;
    g->n_rules = p->n_rules;
    g->sets = p->sets, g->n_sets = p->n_sets, p->sets = NULL;
    g->ranges = p->ranges, g->n_ranges = p->n_ranges, p->ranges = NULL;
    if (!g->sets) g->sets = calloc(1, sizeof *g->sets);       /* a grammar of empty alternatives only */
    if (!g->ranges) g->ranges = calloc(1, sizeof *g->ranges); /* of `.` only */
    if (!g->sets || !g->ranges) return kv_fail(p->d, KV_ENOMEM, "grammar: out of memory");
    return 0;
}

void kv_grammar_limits_default(kv_grammar_limits *l) {
    *l = (kv_grammar_limits){
        .max_text_bytes = 1u << 20,
        .max_rules = 4096,
        .max_elements = 1u << 20,
        .max_nesting = 64,
        .max_repeat = 4096,
        .max_stacks = 512,
        .max_stack_depth = 512,
        .max_memory_bytes = 256u << 20,
    };
}

void kv_grammar_free(kv_grammar *g) {
    if (!g) return;
    free(g->el);
    free(g->sets);
    free(g->ranges);
    free(g->alt);
    free(g->rule_alt);
    free(g);
}

uint32_t kv_grammar_n_rules(const kv_grammar *g) { return g->n_rules; }

bool kv_gset_overlaps(const kv_grammar *g, uint32_t set, uint32_t lo, uint32_t hi) {
    const kv_gset *s = &g->sets[set];
    if (!s->negated) {
        if (s->n == 0) return false;
        /* the first range ending at or after lo */
        const kv_grange *r = g->ranges + s->first;
        uint32_t a = 0, b = s->n;
        while (a < b) {
            uint32_t mid = (a + b) / 2;
            if (r[mid].hi < lo) a = mid + 1;
            else b = mid;
        }
        return a < s->n && r[a].lo <= hi;
    }
    /* some cp in [lo, hi] outside every range: ranges are merged, so the
     * one holding lo (if any) ends before a gap */
    const kv_grange *in = kv_gset_find(g, set, lo);
    return !in || in->hi < hi;
}

int kv_grammar_parse(kv_grammar **out, const char *text, size_t len, const kv_grammar_limits *lim,
                     kv_diag *d) {
    *out = NULL;
    kv_grammar_limits dl;
    if (!lim) {
        kv_grammar_limits_default(&dl);
        lim = &dl;
    }
    if (!text && len) return kv_fail(d, KV_EINVAL, "grammar: no text");
    if (len > lim->max_text_bytes)
        return kv_fail(d, KV_ERANGE, "grammar: %zu bytes of text, max %zu (max_text_bytes)", len, lim->max_text_bytes);
    if (lim->max_rules == 0 || lim->max_rules > (1u << 29) || lim->max_elements > (1u << 29))
        return kv_fail(d, KV_EINVAL, "grammar: limits out of range");
    parser p = {.s = text ? text : "", .n = len, .lim = lim, .d = d};
    kv_grammar *g = calloc(1, sizeof *g);
    bool *nullable = NULL;
    int rc = g ? 0 : kv_fail(d, KV_ENOMEM, "grammar: out of memory");
    if (!rc) skip_ws(&p, true);
    while (!rc && p.i < p.n) {
        size_t at = p.i;
        while (p.i < p.n && is_word(p.s[p.i])) p.i++;
        if (p.i == at) {
            rc = pfail(&p, KV_EFORMAT, at, "expected a rule name, got '%c'", p.s[at]);
            break;
        }
        size_t nlen = p.i - at;
        skip_ws(&p, false);
        if (p.n - p.i < 3 || memcmp(p.s + p.i, "::=", 3)) {
            rc = pfail(&p, KV_EFORMAT, p.i, "expected '::=' after rule name '%.*s'", (int)(nlen > 64 ? 64 : nlen), p.s + at);
            break;
        }
        p.i += 3;
        uint32_t r;
        if ((rc = get_rule(&p, p.s + at, nlen, at, &r))) break;
        if (p.rules[r].defined) {
            rc = pfail(&p, KV_EFORMAT, at, "rule '%s' defined twice", p.rules[r].name);
            break;
        }
        p.rules[r].defined = true;
        p.rules[r].at = at;
        skip_ws(&p, true);
        if ((rc = parse_alternates(&p, r, false))) break;
        skip_ws(&p, true);
    }
    for (uint32_t r = 0; r < p.n_rules && !rc; r++)
        if (!p.rules[r].defined && !p.rules[r].generated)
            rc = pfail(&p, KV_EFORMAT, p.rules[r].at, "undefined rule '%s'", p.rules[r].name);
    if (!rc) {
        uint32_t root = UINT32_MAX;
        for (uint32_t r = 0; r < p.n_rules; r++)
            if (!p.rules[r].generated && !strcmp(p.rules[r].name, "root")) root = r;
        if (root == UINT32_MAX) rc = kv_fail(d, KV_EFORMAT, "grammar: no rule named 'root' (the start rule)");
        else g->root = root;
    }
    if (!rc) {
        nullable = calloc(p.n_rules, sizeof *nullable);
        rc = nullable ? compute_nullable(&p, nullable) : kv_fail(d, KV_ENOMEM, "grammar: out of memory");
    }
    if (!rc) rc = check_left_recursion(&p, nullable);
    if (!rc) rc = flatten(&p, g);
    if (!rc) g->lim = *lim;
    for (uint32_t r = 0; r < p.n_rules; r++) {
        for (size_t a = 0; a < p.rules[r].n_alts; a++) free(p.rules[r].alts[a].v);
        free(p.rules[r].alts);
        free(p.rules[r].name);
    }
    free(p.rules);
    free(p.hash);
    free(p.sets);
    free(p.ranges);
    free(nullable);
    if (rc) {
        kv_grammar_free(g);
        return rc;
    }
    *out = g;
    return 0;
}
