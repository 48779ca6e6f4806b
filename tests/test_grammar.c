/* Grammars: GBNF parse errors name line:column; the matcher accepts exactly
 * the strings (and the prefixes) that an independent recognizer does (POSIX
 * regular expressions from libc, and a hand-written balanced-parentheses
 * check) over every string of a small alphabet up to a length; UTF-8 split
 * across feeds; pathological grammars are clear errors within their limits;
 * the token mask over a real gen-model vocabulary equals feeding each
 * token's piece to a fresh matcher; and constrained random generation over
 * that vocabulary, for many JSON schemas and seeds, ends in text that
 * jansson parses. The same samples, written to KV_GRAMMAR_EMIT, are
 * validated against their schemas by ajv in test_grammar_schema.sh.
 * kv-test-labels: unit */
#include <jansson.h>
#include <regex.h>
#include <stdbool.h>
#include <stdint.h>
#include <unistd.h>

#include "kvasir/gen.h"
#include "kvasir/grammar.h"
#include "kvasir/sample.h"
#include "kvasir/tok.h"
#include "kvtest.h"

static int parse(kv_grammar **g, const char *text, kv_diag *d) {
    return kv_grammar_parse(g, text, strlen(text), NULL, d);
}

/* 0 when the whole of s feeds and the grammar can end there; 1 when it
 * feeds but cannot end; -1 when the matcher refuses it. */
static int run_text(const kv_grammar *g, const char *s, size_t n) {
    kv_grammar_matcher *m = NULL;
    kv_diag d = {0};
    if (kv_grammar_matcher_new(&m, g, &d)) return -2;
    int rc = kv_grammar_feed(m, s, n, &d);
    int out = rc ? -1 : (kv_grammar_can_end(m) ? 0 : 1);
    kv_grammar_matcher_free(m);
    return out;
}

static void test_parse_errors(void) {
    static const struct {
        const char *text;
        int code;
        const char *where; /* substring of the message */
    } cases[] = {
        {"root ::= \"abc", KV_EFORMAT, "1:10: unterminated string"},
        {"root ::= [a-", KV_EFORMAT, "1:10: unterminated character class"},
        {"root ::= x\n", KV_EFORMAT, "1:10: undefined rule 'x'"},
        {"# c\nroot ::= \"a\"\n  foo\n", KV_EFORMAT, "3:6: expected '::=' after rule name 'foo'"},
        {"root ::= \"a\" )", KV_EFORMAT, "1:14: unexpected ')'"},
        {"root ::= (\"a\" | \"b\"", KV_EFORMAT, "1:10: '(' without a matching ')'"},
        {"root ::= * \"a\"", KV_EFORMAT, "1:10: '*' repeats nothing"},
        {"root ::= \"a\"{3,1}", KV_EFORMAT, "1:13: repetition {3,1} has max < min"},
        {"root ::= \"a\"{2", KV_EFORMAT, "1:13: '{' repetition without '}'"},
        {"root ::= \"\\q\"", KV_EFORMAT, "1:11: unknown escape"},
        {"root ::= [z-a]", KV_EFORMAT, "1:11: character range U+007A-U+0061 is reversed"},
        {"root ::= \"\\uD800\"", KV_EFORMAT, "1:11: escape names no Unicode scalar value"},
        {"root ::= \"a\"\nroot ::= \"b\"\n", KV_EFORMAT, "2:1: rule 'root' defined twice"},
        {"main ::= \"a\"\n", KV_EFORMAT, "no rule named 'root'"},
        {"root ::= []", KV_EFORMAT, "1:10: empty character class"},
        {"root ::= \"\xff\"", KV_EFORMAT, "1:11: invalid UTF-8"},
        {"root ::= root \"a\" | \"a\"", KV_EUNSUPPORTED, "1:1: rule 'root' is left-recursive"},
        {"root ::= x\nx ::= y \"a\"\ny ::= \"\" | x", KV_EUNSUPPORTED, "left-recursive"},
        {"root ::= \"b\" (\"a\"?)*", KV_EUNSUPPORTED, "1:20: this group or repetition can recurse without consuming"},
        {"root ::= \"a\"{5000}", KV_ERANGE, "1:14: repetition count over 4096"},
    };
    for (size_t i = 0; i < KVT_N(cases); i++) {
        kv_grammar *g = NULL;
        kv_diag d = {0};
        int rc = parse(&g, cases[i].text, &d);
        ASSERT_EQ(rc, cases[i].code);
        ASSERT_TRUE(g == NULL);
        if (!strstr(d.msg, cases[i].where)) KVT_FAIL("case %zu: message '%s' lacks '%s'", i, d.msg, cases[i].where);
    }
    /* limits: nesting, text, rules */
    char nest[200];
    size_t nn = (size_t)snprintf(nest, sizeof nest, "root ::= ");
    for (int i = 0; i < 65; i++) nest[nn++] = '(';
    nest[nn++] = '.';
    for (int i = 0; i < 65; i++) nest[nn++] = ')';
    nest[nn] = 0;
    kv_diag dn = {0};
    kv_grammar *gn = NULL;
    ASSERT_EQ(parse(&gn, nest, &dn), KV_ERANGE);
    ASSERT_TRUE(strstr(dn.msg, "1:74: parentheses nested deeper than 64") != NULL);
    nest[9 + 64] = ' ', nest[9 + 65 + 1] = ' '; /* 64 deep: taken */
    ASSERT_EQ(parse(&gn, nest, &dn), 0);
    kv_grammar_free(gn);
    kv_grammar_limits lim;
    kv_grammar_limits_default(&lim);
    lim.max_text_bytes = 8;
    kv_grammar *g = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_grammar_parse(&g, "root ::= \"abc\"", 14, &lim, &d), KV_ERANGE);
    ASSERT_TRUE(strstr(d.msg, "max_text_bytes") != NULL);
    kv_grammar_limits_default(&lim);
    lim.max_rules = 3;
    ASSERT_EQ(kv_grammar_parse(&g, "root ::= \"a\"{0,5}", 17, &lim, &d), KV_ERANGE);
    ASSERT_TRUE(strstr(d.msg, "max_rules") != NULL);
    lim.max_rules = 6; /* root and the 5 nested optionals of {0,5} */
    ASSERT_EQ(kv_grammar_parse(&g, "root ::= \"a\"{0,5}", 17, &lim, &d), 0);
    ASSERT_EQ(kv_grammar_n_rules(g), 6);
    ASSERT_EQ(run_text(g, "aaaaa", 5), 0);
    ASSERT_EQ(run_text(g, "aaaaaa", 6), -1);
    kv_grammar_free(g);
    /* a grammar that parses: comments, CRLF, continuation lines, escapes */
    const char *ok = "# json-ish\r\nroot ::= item (\",\" item)* # tail\r\n"
                     "item ::= \"x\"\n  | [\\x41-\\u0043] \"\\t\"\n  | \"\\\\\" . \n";
    ASSERT_EQ(parse(&g, ok, &d), 0);
    ASSERT_EQ(run_text(g, "x,A\t,\\q", 7), 0);
    ASSERT_EQ(run_text(g, "x,D\t", 4), -1);
    kv_grammar_free(g);
    /* a grammar whose only class is `.` (no ranges at all: found by the fuzzer) */
    ASSERT_EQ(parse(&g, "root ::= . .?", &d), 0);
    ASSERT_EQ(run_text(g, "x", 1), 0);
    ASSERT_EQ(run_text(g, "€\n", 4), 0);
    ASSERT_EQ(run_text(g, "", 0), 1);
    ASSERT_EQ(run_text(g, "abc", 3), -1);
    kv_grammar_free(g);
}

/* GBNF grammars and the ERE each is equivalent to, over an alphabet. */
static const struct {
    const char *gbnf, *ere, *alpha;
} k_equiv[] = {
    {"root ::= \"a\" (\"b\" | \"cx\")* [x-z]?", "^a(b|cx)*[x-z]?$", "abcxy"},
    {"root ::= (\"ab\" | \"a\") \"c\"{1,3}", "^(ab|a)c{1,3}$", "abc"},
    {"root ::= [^a]+ \"a\"?", "^[^a]+a?$", "abx"},
    {"root ::= x \"x\" | y\nx ::= \"a\"*\ny ::= \"b\" x", "^(a*x|ba*)$", "abx"},
    {"root ::= (\"a\" | \"b\"){2,4} \"c\"?", "^[ab]{2,4}c?$", "abc"},
    {"root ::= \"\" | \"ab\"", "^(ab)?$", "ab"},
    {"root ::= ( ( \"a\" | \"b\" ) \"c\" )+ # trailing comment", "^([ab]c)+$", "abc"},
    {"root ::= \"a\" . \"b\"", "^a.b$", "abc"},
    {"root ::= \"a\"{2,} \"b\"?", "^a{2,}b?$", "ab"},
    {"root ::= (\"ab\" | \"a\" \"b\" | \"a\")+", "^(ab|a)+$", "ab"},
    {"root ::= [a-b]{0,3} | \"c\" root", "^(c*[ab]{0,3})$", "abc"},
    {"root ::= [c-da-bx]+ [^b-ca-a]? [dbc-c]", "^[a-dx]+[^abc]?[bcd]$", "abcdxy"},
};

static bool ere_match(regex_t *re, const char *s) { return regexec(re, s, 0, NULL, 0) == 0; }

/* Every string over alpha up to max_len: the grammar's verdict equals the
 * regex's, and a prefix feeds iff some string up to max_len extends it. */
static void check_equiv(const kv_grammar *g, regex_t *re, bool (*ref)(const char *), bool (*ref_prefix)(const char *),
                        const char *alpha, int max_len) {
    int k = (int)strlen(alpha);
    char s[16];
    long total = 1, pw = 1;
    for (int l = 1; l <= max_len; l++) pw *= k, total += pw;
    bool *acc = calloc((size_t)total, 1); /* index: strings ordered by length then digits */
    long idx = 0;
    int mism = 0;
    for (int len = 0; len <= max_len; len++) {
        long count = 1;
        for (int l = 0; l < len; l++) count *= k;
        for (long c = 0; c < count; c++, idx++) {
            long x = c;
            for (int l = len - 1; l >= 0; l--) s[l] = alpha[x % k], x /= k;
            s[len] = 0;
            bool want = re ? ere_match(re, s) : ref(s);
            int got = run_text(g, s, (size_t)len);
            acc[idx] = want;
            if ((got == 0) != want && mism++ < 5) KVT_FAIL("'%s': grammar %d, reference %d", s, got, want);
            kvt_checks++;
        }
    }
    /* prefixes up to max_len - 3 (every grammar here completes within 3 more) */
    idx = 0;
    long start_of_len[16];
    for (int len = 0, off = 0; len <= max_len; len++) {
        start_of_len[len] = off;
        long count = 1;
        for (int l = 0; l < len; l++) count *= k;
        off += (int)count;
    }
    for (int len = 0; len <= max_len - 3; len++) {
        long count = 1;
        for (int l = 0; l < len; l++) count *= k;
        for (long c = 0; c < count; c++) {
            long x = c;
            for (int l = len - 1; l >= 0; l--) s[l] = alpha[x % k], x /= k;
            s[len] = 0;
            bool viable = ref_prefix && ref_prefix(s);
            for (int ext = 0; ext <= max_len - len && !viable && !ref_prefix; ext++) {
                long ec = 1;
                for (int l = 0; l < ext; l++) ec *= k;
                for (long e = 0; e < ec && !viable; e++) viable = acc[start_of_len[len + ext] + c * ec + e];
            }
            int got = run_text(g, s, (size_t)len);
            if ((got >= 0) != viable && mism++ < 10) KVT_FAIL("prefix '%s': grammar %d, viable %d", s, got, viable);
            kvt_checks++;
        }
    }
    free(acc);
}

static bool balanced(const char *s) {
    int depth = 0;
    for (; *s; s++) {
        depth += *s == '(' ? 1 : -1;
        if (depth < 0) return false;
    }
    return depth == 0;
}

/* a prefix of a balanced string: never closes more than it opened */
static bool balanced_prefix(const char *s) {
    int depth = 0;
    for (; *s; s++) {
        depth += *s == '(' ? 1 : -1;
        if (depth < 0) return false;
    }
    return true;
}

static void test_matcher_reference(void) {
    for (size_t i = 0; i < KVT_N(k_equiv); i++) {
        kv_grammar *g = NULL;
        kv_diag d = {0};
        if (parse(&g, k_equiv[i].gbnf, &d)) {
            KVT_FAIL("grammar %zu: %s", i, d.msg);
            continue;
        }
        regex_t re;
        ASSERT_EQ(regcomp(&re, k_equiv[i].ere, REG_EXTENDED | REG_NOSUB), 0);
        check_equiv(g, &re, NULL, NULL, k_equiv[i].alpha, 7);
        regfree(&re);
        kv_grammar_free(g);
    }
    kv_grammar *g = NULL;
    kv_diag d = {0};
    ASSERT_EQ(parse(&g, "root ::= \"(\" root \")\" root | \"\"", &d), 0);
    check_equiv(g, NULL, balanced, balanced_prefix, "()", 12);
    kv_grammar_free(g);
}

static void test_utf8(void) {
    kv_grammar *g = NULL;
    kv_diag d = {0};
    ASSERT_EQ(parse(&g, "root ::= [α-ω]+ \"€\" [\\u4e00-\\u9fff]? \"\\U0001F642\"?", &d), 0);
    const char *ok[] = {"αβ€", "ω€中", "λ€🙂", "αω€中🙂"};
    for (size_t i = 0; i < KVT_N(ok); i++) ASSERT_EQ(run_text(g, ok[i], strlen(ok[i])), 0);
    const char *bad[] = {"a€", "€", "α€a", "α\xe2\x82", "α\xe2\x82\x41", "\xce", "α\xc0\x80"};
    for (size_t i = 0; i < KVT_N(bad); i++) ASSERT_TRUE(run_text(g, bad[i], strlen(bad[i])) != 0);
    /* byte by byte, with a partial code point between calls */
    kv_grammar_matcher *m = NULL;
    ASSERT_EQ(kv_grammar_matcher_new(&m, g, &d), 0);
    const char *s = "αβ€中";
    for (size_t i = 0; s[i]; i++) ASSERT_EQ(kv_grammar_feed(m, s + i, 1, &d), 0);
    ASSERT_TRUE(kv_grammar_can_end(m));
    ASSERT_EQ(kv_grammar_feed(m, "\xf0\x9f", 2, &d), 0); /* first half of 🙂 */
    ASSERT_TRUE(!kv_grammar_can_end(m));
    ASSERT_EQ(kv_grammar_feed(m, "\xf0", 1, &d), KV_EINVAL); /* refused, matcher unchanged */
    ASSERT_EQ(kv_grammar_feed(m, "\x99\x82", 2, &d), 0);
    ASSERT_TRUE(kv_grammar_can_end(m));
    kv_grammar_matcher_free(m);
    /* a prefix that no code point of the class can complete is refused early */
    kv_grammar_free(g);
    ASSERT_EQ(parse(&g, "root ::= [\\u4e00-\\u9fff]", &d), 0);
    ASSERT_EQ(run_text(g, "\xe4", 1), 1);
    ASSERT_EQ(run_text(g, "\xe3", 1), -1);
    kv_grammar_free(g);
}

static void test_limits(void) {
    kv_grammar_limits lim;
    kv_grammar_limits_default(&lim);
    lim.max_stacks = 64;
    kv_grammar *g = NULL;
    kv_diag d = {0};
    /* each "a" doubles the distinct stacks (a "b" or a "c" owed): exponential without the bound */
    const char *amb = "root ::= s\ns ::= \"a\" s \"b\" | \"a\" s \"c\" | \"\"";
    ASSERT_EQ(kv_grammar_parse(&g, amb, strlen(amb), &lim, &d), 0);
    kv_grammar_matcher *m = NULL;
    ASSERT_EQ(kv_grammar_matcher_new(&m, g, &d), 0);
    int rc = 0, i = 0;
    for (; i < 40 && !rc; i++) rc = kv_grammar_feed(m, "a", 1, &d);
    ASSERT_EQ(rc, KV_ERANGE);
    ASSERT_TRUE(i <= 8);
    ASSERT_TRUE(strstr(d.msg, "max_stacks") != NULL);
    kv_grammar_matcher_free(m);
    kv_grammar_free(g);
    /* nesting past the stack depth: a clear error, and the matcher keeps its place */
    kv_grammar_limits_default(&lim);
    lim.max_stack_depth = 20;
    const char *deep = "root ::= \"(\" root \")\" | \"x\"";
    ASSERT_EQ(kv_grammar_parse(&g, deep, strlen(deep), &lim, &d), 0);
    ASSERT_EQ(kv_grammar_matcher_new(&m, g, &d), 0);
    rc = 0;
    for (i = 0; i < 100 && !rc; i++) rc = kv_grammar_feed(m, "(", 1, &d);
    ASSERT_EQ(rc, KV_ERANGE);
    ASSERT_TRUE(strstr(d.msg, "max_stack_depth") != NULL);
    ASSERT_TRUE(i >= 10 && i <= 21);
    d.msg[0] = 0; /* again: now the answer comes from the transition cache, and still names the depth */
    ASSERT_EQ(kv_grammar_feed(m, "(", 1, &d), KV_ERANGE);
    ASSERT_TRUE(strstr(d.msg, "max_stack_depth") != NULL);
    ASSERT_EQ(kv_grammar_feed(m, "x", 1, &d), 0);
    for (int k = 0; k < i - 1; k++) ASSERT_EQ(kv_grammar_feed(m, ")", 1, &d), 0);
    ASSERT_TRUE(kv_grammar_can_end(m));
    kv_grammar_matcher_free(m);
    kv_grammar_free(g);
    /* the tables' budget: a long walk through fresh states stays under it (flushes), */
    kv_grammar_limits_default(&lim);
    lim.max_memory_bytes = 1u << 20;
    const char *cnt = "root ::= [a-z]{0,4000}";
    ASSERT_EQ(kv_grammar_parse(&g, cnt, strlen(cnt), &lim, &d), 0);
    ASSERT_EQ(kv_grammar_matcher_new(&m, g, &d), 0);
    rc = 0;
    for (i = 0; i < 4000 && !rc; i++) rc = kv_grammar_feed(m, "q", 1, &d);
    ASSERT_EQ(rc, 0);
    ASSERT_EQ(kv_grammar_feed(m, "q", 1, &d), KV_EINVAL);
    kv_grammar_stats st;
    kv_grammar_get_stats(m, &st);
    ASSERT_TRUE(st.memory_bytes <= lim.max_memory_bytes);
    kv_grammar_matcher_free(m);
    kv_grammar_free(g);
}

/* ---- a real vocabulary: the BPE gen-model trains, through a GGUF ------- */

static kv_tok *g_tok;
static kv_grammar_vocab *g_vocab;

static int load_vocab(void) {
    kv_bpe_vocab v;
    kv_diag d = {0};
    size_t clen;
    const char *corpus = kv_bpe_default_corpus(&clen);
    if (kv_bpe_train(corpus, clen, "qwen2", 2048, &v, &d)) {
        fprintf(stderr, "train: %s\n", d.msg);
        return 1;
    }
    char path[] = "/tmp/kv_test_grammar_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) return 1;
    close(fd);
    kv_gguf_writer *w = NULL;
    kv_gguf *gg = NULL;
    int rc = kv_gguf_writer_new(&w, &d);
    if (!rc) rc = kv_gguf_writer_set_str(w, "general.architecture", "qwen3moe", &d);
    if (!rc) rc = kv_gen_write_tokenizer(w, &v, "qwen2", &d);
    if (!rc) rc = kv_gguf_writer_begin(w, path, &d);
    if (!rc) rc = kv_gguf_writer_finish(w, &d);
    kv_gguf_writer_free(w);
    kv_bpe_vocab_free(&v);
    if (!rc) rc = kv_gguf_open(&gg, path, &d);
    if (!rc) rc = kv_tok_load(&g_tok, gg, &d);
    kv_gguf_close(gg);
    unlink(path);
    if (!rc) rc = kv_grammar_vocab_from_tok(&g_vocab, g_tok, &d);
    if (rc) fprintf(stderr, "vocab: %s\n", d.msg);
    return rc ? 1 : 0;
}

static void free_vocab(void) {
    kv_grammar_vocab_free(g_vocab);
    kv_tok_free(g_tok);
}

/* The piece of token id, as the vocabulary holds it (NUL-terminated). */
static int piece(int32_t id, char *buf, size_t cap) {
    int attr = kv_tok_attr(g_tok, id);
    if (attr == KV_TOK_CONTROL || attr == KV_TOK_UNUSED) return 0;
    int n = kv_tok_piece(g_tok, id, false, buf, cap);
    if (n < 0 || (size_t)n >= cap) return -1;
    buf[n] = 0;
    return n;
}

/* The mask equals, token by token, a fresh matcher fed text + piece. */
static void check_mask(const kv_grammar *g, kv_grammar_matcher *m, const char *text, size_t tlen) {
    int32_t nv = kv_grammar_vocab_n(g_vocab);
    uint32_t *mask = calloc(((size_t)nv + 31) / 32, 4);
    kv_diag d = {0};
    ASSERT_EQ(kv_grammar_mask(m, g_vocab, mask, &d), 0);
    char *buf = malloc(tlen + 4200);
    memcpy(buf, text, tlen);
    int bad = 0, allowed = 0;
    for (int32_t t = 0; t < nv; t++) {
        bool got = mask[t >> 5] >> (t & 31) & 1;
        bool want;
        if (kv_tok_is_eog(g_tok, t)) {
            want = run_text(g, text, tlen) == 0;
        } else {
            int n = piece(t, buf + tlen, 4100);
            want = n > 0 && run_text(g, buf, tlen + (size_t)n) >= 0;
        }
        allowed += want;
        if (got != want && bad++ < 5) KVT_FAIL("token %d after '%.*s': mask %d, fresh matcher %d", t, (int)tlen, text, got, want);
    }
    kvt_checks++;
    ASSERT_TRUE(allowed > 0);
    free(buf);
    free(mask);
}

static void test_mask_reference(void) {
    static const char *const gbnf[] = {
        "root ::= \"{\" ws (\"\\\"name\\\"\" ws \":\" ws str ws)? \"}\"\nws ::= [ \\n]{0,2}\nstr ::= \"\\\"\" [^\"\\\\]{0,12} \"\\\"\"",
        "root ::= [α-ω €]+ (\"the\" | \" of\" | [0-9])*",
        "root ::= (\"Hello\" | \"help\" | \" world\")+ \"!\"?",
        /* a state that loops on most bytes: whole subtrees are taken at once */
        "root ::= \"\\\"\" [^\"\\\\\\n]* \"\\\"\" [ ]?",
    };
    static const char *const walks[][4] = {
        {"", "{", "{\"na", "{\"name\": \"ab"},
        {"", "α", "αβ \xe2\x82", "α€the1"},
        {"", "Hel", "help world", "Hello!"},
        {"", "\"", "\"ab c", "\"x\""},
    };
    for (size_t i = 0; i < KVT_N(gbnf); i++) {
        kv_grammar *g = NULL;
        kv_diag d = {0};
        if (parse(&g, gbnf[i], &d)) {
            KVT_FAIL("grammar %zu: %s", i, d.msg);
            continue;
        }
        for (size_t w = 0; w < 4; w++) {
            kv_grammar_matcher *m = NULL;
            ASSERT_EQ(kv_grammar_matcher_new(&m, g, &d), 0);
            ASSERT_EQ(kv_grammar_feed(m, walks[i][w], strlen(walks[i][w]), &d), 0);
            check_mask(g, m, walks[i][w], strlen(walks[i][w]));
            check_mask(g, m, walks[i][w], strlen(walks[i][w])); /* the cached mask too */
            kv_grammar_matcher_free(m);
        }
        kv_grammar_free(g);
    }
}

/* Accepting what the mask forbids is refused and changes nothing; an end
 * token only where the grammar can end; vocabularies are checked. */
static void test_accept_errors(void) {
    kv_grammar *g = NULL;
    kv_diag d = {0};
    ASSERT_EQ(parse(&g, "root ::= \"ab\" \"c\"?", &d), 0);
    kv_grammar_matcher *m = NULL;
    ASSERT_EQ(kv_grammar_matcher_new(&m, g, &d), 0);
    int32_t ta = kv_tok_find(g_tok, "a"), tb = kv_tok_find(g_tok, "b"), tx = kv_tok_find(g_tok, "x");
    int32_t eos = kv_tok_eos(g_tok);
    ASSERT_TRUE(ta >= 0 && tb >= 0 && tx >= 0 && eos >= 0 && kv_tok_is_eog(g_tok, eos));
    ASSERT_EQ(kv_grammar_accept(m, g_vocab, tx, &d), KV_EINVAL);
    ASSERT_EQ(kv_grammar_accept(m, g_vocab, eos, &d), KV_EINVAL);
    ASSERT_TRUE(strstr(d.msg, "before the grammar is complete") != NULL);
    ASSERT_EQ(kv_grammar_accept(m, g_vocab, -1, &d), KV_EINVAL);
    ASSERT_EQ(kv_grammar_accept(m, g_vocab, kv_grammar_vocab_n(g_vocab), &d), KV_EINVAL);
    ASSERT_EQ(kv_grammar_accept(m, g_vocab, ta, &d), 0);
    ASSERT_EQ(kv_grammar_accept(m, g_vocab, ta, &d), KV_EINVAL);
    ASSERT_EQ(kv_grammar_accept(m, g_vocab, tb, &d), 0);
    ASSERT_TRUE(kv_grammar_can_end(m));
    ASSERT_EQ(kv_grammar_accept(m, g_vocab, eos, &d), 0);
    kv_grammar_matcher_free(m);
    kv_grammar_free(g);
    kv_grammar_vocab *v = NULL;
    const char *pieces[2] = {"a", "b"};
    uint32_t lens[2] = {1, KV_TOK_MAX_TOKEN_BYTES + 1};
    ASSERT_EQ(kv_grammar_vocab_new(&v, pieces, lens, NULL, 0, &d), KV_EINVAL);
    ASSERT_EQ(kv_grammar_vocab_new(&v, pieces, lens, NULL, 2, &d), KV_EINVAL);
    ASSERT_TRUE(strstr(d.msg, "token 1 has") != NULL);
    ASSERT_TRUE(v == NULL);
}

/* ---- JSON schemas --------------------------------------------------------- */

static const char *const k_schemas[] = {
    "{\"type\": \"object\"}",
    "{\"type\": \"object\", \"properties\": {\"name\": {\"type\": \"string\", \"maxLength\": 12},"
    " \"age\": {\"type\": \"integer\", \"minimum\": 0, \"maximum\": 150}}, \"required\": [\"name\", \"age\"],"
    " \"additionalProperties\": false}",
    "{\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"boolean\"}, \"b\": {\"type\": \"null\"},"
    " \"c\": {\"type\": \"number\"}, \"d\": {\"enum\": [\"x\", 2, null, {\"k\": [1]}]}}, \"required\": [\"c\"]}",
    "{\"type\": \"array\", \"items\": {\"type\": \"integer\", \"minimum\": -5, \"maximum\": 5}, \"minItems\": 2, \"maxItems\": 4}",
    "{\"type\": \"array\", \"items\": {\"type\": \"string\", \"minLength\": 2, \"maxLength\": 3}, \"maxItems\": 3}",
    "{\"type\": [\"string\", \"null\"], \"maxLength\": 5}",
    "{\"anyOf\": [{\"type\": \"integer\", \"minimum\": 1}, {\"const\": \"none\"}, {\"type\": \"array\", \"maxItems\": 2,"
    " \"items\": {\"type\": \"boolean\"}}]}",
    "{\"oneOf\": [{\"type\": \"string\", \"maxLength\": 4}, {\"type\": \"integer\"}, {\"type\": \"null\"}]}",
    "{\"$defs\": {\"node\": {\"type\": \"object\", \"properties\": {\"v\": {\"type\": \"integer\", \"maximum\": 9},"
    " \"next\": {\"anyOf\": [{\"$ref\": \"#/$defs/node\"}, {\"type\": \"null\"}]}}, \"required\": [\"v\", \"next\"],"
    " \"additionalProperties\": false}}, \"$ref\": \"#/$defs/node\"}",
    "{\"definitions\": {\"color\": {\"enum\": [\"red\", \"green\", \"blue\"]}}, \"type\": \"object\","
    " \"properties\": {\"fg\": {\"$ref\": \"#/definitions/color\"}, \"bg\": {\"$ref\": \"#/definitions/color\"},"
    " \"tags\": {\"type\": \"array\", \"items\": {\"type\": \"string\", \"maxLength\": 6}, \"maxItems\": 2}},"
    " \"required\": [\"bg\"], \"additionalProperties\": false}",
    "{\"type\": \"object\", \"properties\": {\"id\": {\"type\": \"string\", \"nullable\": true, \"maxLength\": 4},"
    " \"ok\": {\"const\": true}}, \"required\": [\"id\", \"ok\"], \"additionalProperties\": false}",
    "{\"type\": \"object\", \"additionalProperties\": {\"type\": \"integer\", \"maximum\": 3}}",
    "{\"type\": \"object\", \"properties\": {\"q\": {\"type\": \"string\", \"maxLength\": 8}}, \"required\": [\"q\", \"extra\"]}",
    "{\"type\": \"object\", \"properties\": {\"ünï\": {\"const\": \"çødé \\\"q\\\" \\\\ \\n\"}, \"n\": {\"type\": \"integer\","
    " \"minimum\": 7}}, \"required\": [\"ünï\"], \"additionalProperties\": false}",
    "{\"allOf\": [{\"type\": \"boolean\"}]}",
    "true",
    "{\"type\": \"array\", \"items\": {\"type\": \"integer\", \"exclusiveMinimum\": -3, \"exclusiveMaximum\": 4.5},"
    " \"minItems\": 1, \"maxItems\": 3}",
    "{\"type\": \"array\", \"items\": {\"type\": \"number\", \"minimum\": 0}, \"maxItems\": 3}",
    "{\"oneOf\": [{\"type\": \"object\", \"properties\": {\"kind\": {\"const\": \"a\"}, \"x\": {\"type\": \"integer\","
    " \"maximum\": 5}}, \"required\": [\"kind\", \"x\"], \"additionalProperties\": false}, {\"$ref\": \"#/$defs/b\"}],"
    " \"$defs\": {\"b\": {\"type\": \"object\", \"properties\": {\"kind\": {\"enum\": [\"b\", \"c\"]}, \"y\":"
    " {\"type\": \"boolean\"}}, \"required\": [\"kind\"], \"additionalProperties\": false}}}",
};

/* Generates one constrained sample: random logits, the mask, the real
 * sampler, accept, until an eog token or the bound. Returns the text
 * (malloc'd) and *done = ended by eog. */
static uint64_t g_flushes; /* flushes seen by generate() */

static char *generate(const kv_grammar *g, uint64_t seed, int max_tokens, bool *done, int *n_tok) {
    int32_t nv = kv_grammar_vocab_n(g_vocab);
    float *logits = malloc((size_t)nv * sizeof *logits);
    size_t cap = 1 << 16, len = 0;
    char *text = malloc(cap);
    kv_sample_params sp = kv_sample_defaults();
    sp.temp = 1.0f, sp.top_k = 0, sp.top_p = 1.0f, sp.min_p = 0.0f, sp.seed = seed;
    kv_sampler *smp = NULL;
    kv_grammar_matcher *m = NULL;
    kv_diag d = {0};
    *done = false;
    *n_tok = 0;
    if (kv_sampler_new(&smp, nv, &sp, &d) || kv_grammar_matcher_new(&m, g, &d)) {
        KVT_FAIL("setup: %s", d.msg);
        goto out;
    }
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    char pc[4200];
    for (int step = 0; step < max_tokens; step++) {
        for (int32_t t = 0; t < nv; t++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            logits[t] = (float)((double)(x >> 11) / 9007199254740992.0 * 6.0);
            /* late in a sample, favour what closes: quotes, brackets, digits, eog */
            if (step > max_tokens / 3) {
                int n = piece(t, pc, sizeof pc);
                bool closes = kv_tok_is_eog(g_tok, t) || (n > 0 && n <= 2 && strpbrk(pc, "\"]}0123456789"));
                if (closes) logits[t] += (float)(step - max_tokens / 3) * 0.2f;
            }
        }
        if (kv_grammar_apply(m, g_vocab, logits, &d)) {
            KVT_FAIL("apply: %s", d.msg);
            break;
        }
        int32_t tok = kv_sampler_sample(smp, logits);
        if (tok < 0) {
            char hex[200] = "";
            for (size_t k = len > 24 ? len - 24 : 0, o = 0; k < len; k++) o += (size_t)snprintf(hex + o, sizeof hex - o, "%02x ", (uint8_t)text[k]);
            KVT_FAIL("seed %llu: dead end after '%.*s' (every token masked; last bytes %s)", (unsigned long long)seed,
                     (int)len, text, hex);
            break;
        }
        if (kv_grammar_accept(m, g_vocab, tok, &d)) {
            KVT_FAIL("accept of a masked-in token %d: %s", tok, d.msg);
            break;
        }
        kv_sampler_accept(smp, tok);
        (*n_tok)++;
        if (kv_tok_is_eog(g_tok, tok)) {
            *done = true;
            break;
        }
        int n = piece(tok, pc, sizeof pc);
        if (n > 0 && len + (size_t)n < cap) memcpy(text + len, pc, (size_t)n), len += (size_t)n;
    }
out:
    text[len] = 0;
    if (m) {
        kv_grammar_stats st;
        kv_grammar_get_stats(m, &st);
        g_flushes += st.flushes;
    }
    kv_grammar_matcher_free(m);
    kv_sampler_free(smp);
    free(logits);
    return text;
}

static void test_schema_generate(void) {
    const char *emit = getenv("KV_GRAMMAR_EMIT");
    FILE *ef = emit ? fopen(emit, "w") : NULL;
    if (emit && !ef) KVT_FAIL("cannot write %s", emit);
    int seeds = getenv("KV_GRAMMAR_SEEDS") ? atoi(getenv("KV_GRAMMAR_SEEDS")) : 12;
    int done_total = 0, total = 0;
    for (size_t i = 0; i < KVT_N(k_schemas); i++) {
        kv_grammar *g = NULL;
        kv_diag d = {0};
        if (kv_grammar_from_schema(&g, k_schemas[i], strlen(k_schemas[i]), NULL, &d)) {
            KVT_FAIL("schema %zu: %s", i, d.msg);
            continue;
        }
        json_error_t je;
        json_t *schema = json_loads(k_schemas[i], JSON_DECODE_ANY, &je);
        for (int s = 0; s < seeds; s++) {
            bool done;
            int n_tok;
            char *text = generate(g, (uint64_t)(i * 1000 + (size_t)s + 1), 300, &done, &n_tok);
            total++;
            if (done) {
                done_total++;
                json_t *v = json_loads(text, JSON_DECODE_ANY, &je);
                if (!v) KVT_FAIL("schema %zu seed %d: not JSON (%s): %s", i, s, je.text, text);
                kvt_checks++;
                json_decref(v);
                if (ef) {
                    json_t *line = json_pack("{s:O, s:s, s:b}", "schema", schema, "text", text, "valid", 1);
                    char *l = json_dumps(line, JSON_COMPACT);
                    fprintf(ef, "%s\n", l);
                    free(l);
                    json_decref(line);
                }
            }
            free(text);
        }
        json_decref(schema);
        kv_grammar_free(g);
    }
    printf("schema samples: %d of %d ended by the model (eog) within 300 tokens\n", done_total, total);
    ASSERT_TRUE(done_total * 10 >= total * 9);
    if (ef) {
        /* controls: texts the validator must refuse, so a validator that passes everything fails the test */
        fprintf(ef, "{\"schema\": %s, \"text\": \"{\\\"name\\\": \\\"x\\\", \\\"age\\\": 151}\", \"valid\": false}\n", k_schemas[1]);
        fprintf(ef, "{\"schema\": %s, \"text\": \"[1]\", \"valid\": false}\n", k_schemas[3]);
        fprintf(ef, "{\"schema\": %s, \"text\": \"{\\\"v\\\": 1, \\\"next\\\": {\\\"v\\\": 10, \\\"next\\\": null}}\", \"valid\": false}\n", k_schemas[8]);
        fclose(ef);
    }
}

/* A matcher whose table budget is small rebuilds its tables from the
 * current state many times in one generation, and the samples still parse. */
static void test_flush_generate(void) {
    kv_grammar_limits lim;
    kv_grammar_limits_default(&lim);
    lim.max_memory_bytes = 72u << 10;
    const char *schema = k_schemas[8]; /* recursive: stacks of several frames */
    kv_grammar *g = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_grammar_from_schema(&g, schema, strlen(schema), &lim, &d), 0);
    g_flushes = 0;
    int ended = 0;
    for (int s = 0; s < 6; s++) {
        bool done;
        int n_tok;
        char *text = generate(g, (uint64_t)(77 + s), 300, &done, &n_tok);
        json_error_t je;
        json_t *v = done ? json_loads(text, JSON_DECODE_ANY, &je) : NULL;
        if (done && !v) KVT_FAIL("not JSON: %s", text);
        ended += done;
        json_decref(v);
        free(text);
    }
    printf("flush: %llu flushes over 6 samples, %d ended\n", (unsigned long long)g_flushes, ended);
    ASSERT_TRUE(g_flushes >= 6);
    ASSERT_TRUE(ended >= 5);
    kv_grammar_free(g);
}

/* Two schemas' rules under their own names inside one grammar. */
static void test_schema_named(void) {
    char *a = NULL, *b = NULL;
    kv_diag d = {0};
    const char *sa = k_schemas[1], *sb = k_schemas[3];
    ASSERT_EQ(kv_grammar_schema_to_gbnf_named(&a, sa, strlen(sa), "args", NULL, &d), 0);
    ASSERT_EQ(kv_grammar_schema_to_gbnf_named(&b, sb, strlen(sb), "list_2", NULL, &d), 0);
    size_t n = strlen(a) + strlen(b) + 200;
    char *all = malloc(n);
    snprintf(all, n, "root ::= \"<call>\" args \"</call>\" (\"#\" list_2)?\n%s%s", a, b);
    kv_grammar *g = NULL;
    ASSERT_EQ(parse(&g, all, &d), 0);
    if (g) {
        const char *ok[] = {"<call>{\"name\": \"x\", \"age\": 7}</call>", "<call>{\"name\":\"\",\"age\":150}</call>#[1, -5]"};
        const char *bad[] = {"<call>{\"name\": \"x\"}</call>", "<call>{\"name\": \"x\", \"age\": 7}</call>#[1]",
                             "{\"name\": \"x\", \"age\": 7}"};
        for (size_t i = 0; i < KVT_N(ok); i++) ASSERT_EQ(run_text(g, ok[i], strlen(ok[i])), 0);
        for (size_t i = 0; i < KVT_N(bad); i++) ASSERT_TRUE(run_text(g, bad[i], strlen(bad[i])) != 0);
    }
    /* literals, classes and counts keep their text: only rule names change */
    ASSERT_TRUE(strstr(a, "args-ws ::= (\" \" | \"\\n\" [ \\t]{0,8})?") != NULL);
    ASSERT_TRUE(strstr(a, "root") == NULL);
    kv_grammar_free(g);
    free(all);
    free(a);
    free(b);
    ASSERT_EQ(kv_grammar_schema_to_gbnf_named(&b, sb, strlen(sb), "bad name", NULL, &d), KV_EINVAL);
    ASSERT_TRUE(b == NULL);
}

static void test_schema_errors(void) {
    static const struct {
        const char *schema;
        int code;
        const char *msg;
    } cases[] = {
        {"{\"type\": \"string\", \"pattern\": \"^a\"}", KV_EUNSUPPORTED, "schema #: keyword 'pattern' is not supported"},
        {"{\"type\": \"string\", \"format\": \"date\"}", KV_EUNSUPPORTED, "keyword 'format'"},
        {"{\"type\": \"array\", \"uniqueItems\": true}", KV_EUNSUPPORTED, "keyword 'uniqueItems'"},
        {"{\"properties\": {\"a\": {\"type\": \"number\", \"multipleOf\": 2}}}", KV_EUNSUPPORTED,
         "schema #/properties/a: keyword 'multipleOf'"},
        {"{\"type\": \"number\", \"minimum\": 1.5}", KV_EUNSUPPORTED, "schema #: bounds on type number are not supported"},
        {"{\"type\": \"number\", \"minimum\": 0, \"maximum\": 1}", KV_EUNSUPPORTED, "bounds on type number"},
        {"{\"oneOf\": [{\"type\": \"object\", \"properties\": {\"k\": {\"const\": 1}}}, {\"type\": \"object\","
         " \"properties\": {\"k\": {\"const\": 2}}}]}", KV_EUNSUPPORTED, "'oneOf' branches 0 and 1 may both match"},
        {"{\"type\": \"integer\", \"minimum\": 0, \"maximum\": 100000}", KV_EUNSUPPORTED, "integer 'minimum'/'maximum'"},
        {"{\"type\": \"string\", \"maxLength\": 100000}", KV_EUNSUPPORTED, "maxLength over 1000"},
        {"{\"$ref\": \"#/$defs/missing\"}", KV_EFORMAT, "names no definition"},
        {"{\"$ref\": \"http://example.com/s.json\"}", KV_EUNSUPPORTED, "$ref 'http://example.com/s.json' is not supported"},
        {"{\"oneOf\": [{\"type\": \"integer\"}, {\"type\": \"number\"}]}", KV_EUNSUPPORTED, "'oneOf' branches 0 and 1 may both match"},
        {"{\"allOf\": [{\"type\": \"integer\"}, {\"minimum\": 1}]}", KV_EUNSUPPORTED, "'allOf'"},
        {"{\"type\": \"object\", \"required\": [\"x\"], \"additionalProperties\": false}", KV_EFORMAT, "required property 'x'"},
        {"{\"type\": \"string\", \"minLength\": 3, \"maxLength\": 2}", KV_EFORMAT, "maxLength < minLength"},
        {"{\"enum\": [1, 2], \"minimum\": 0}", KV_EUNSUPPORTED, "'minimum' beside 'enum'"},
        {"{\"type\": \"integer\", \"enum\": [\"a\"]}", KV_EFORMAT, "no value of 'enum' has an allowed type"},
        {"{\"type\": \"strng\"}", KV_EFORMAT, "unknown type 'strng'"},
        {"{\"type\": \"array\", \"items\": [{\"type\": \"string\"}]}", KV_EUNSUPPORTED, "tuple form"},
        {"false", KV_EFORMAT, "admits no value"},
        {"{\"type\": ", KV_EFORMAT, "not JSON"},
        {"{\"if\": {}, \"then\": {}}", KV_EUNSUPPORTED, "keyword 'if'"},
    };
    for (size_t i = 0; i < KVT_N(cases); i++) {
        kv_grammar *g = NULL;
        kv_diag d = {0};
        int rc = kv_grammar_from_schema(&g, cases[i].schema, strlen(cases[i].schema), NULL, &d);
        ASSERT_EQ(rc, cases[i].code);
        ASSERT_TRUE(g == NULL);
        if (!strstr(d.msg, cases[i].msg)) KVT_FAIL("case %zu: message '%s' lacks '%s'", i, d.msg, cases[i].msg);
    }
    /* nesting past max_nesting */
    char deep[2000];
    size_t n = 0;
    for (int i = 0; i < 70; i++) n += (size_t)snprintf(deep + n, sizeof deep - n, "{\"items\": ");
    n += (size_t)snprintf(deep + n, sizeof deep - n, "true");
    for (int i = 0; i < 70; i++) deep[n++] = '}';
    kv_grammar *g = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_grammar_from_schema(&g, deep, n, NULL, &d), KV_ERANGE);
    ASSERT_TRUE(strstr(d.msg, "max_nesting") != NULL);
    /* whitespace is bounded: 9 newline-indent blanks are refused, 8 taken */
    ASSERT_EQ(kv_grammar_json_object(&g, NULL, &d), 0);
    static const char *const ws_ok[] = {"{\n        \"a\": 1}", "{ \"a\" : 1 }", "{}"};
    static const char *const ws_bad[] = {"{\n         \"a\": 1}", "{  \"a\": 1}", "{\"a\": 1}\n", "[1]"};
    for (size_t i = 0; i < KVT_N(ws_ok); i++) ASSERT_EQ(run_text(g, ws_ok[i], strlen(ws_ok[i])), 0);
    for (size_t i = 0; i < KVT_N(ws_bad); i++) ASSERT_TRUE(run_text(g, ws_bad[i], strlen(ws_bad[i])) != 0);
    kv_grammar_free(g);
}

static const kvt_case cases[] = {
    KVT_CASE(test_parse_errors),   KVT_CASE(test_matcher_reference), KVT_CASE(test_utf8),
    KVT_CASE(test_limits),         KVT_CASE(test_mask_reference),    KVT_CASE(test_schema_generate),
    KVT_CASE(test_schema_errors),  KVT_CASE(test_accept_errors),     KVT_CASE(test_flush_generate),
    KVT_CASE(test_schema_named),
};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), load_vocab, free_vocab); }
