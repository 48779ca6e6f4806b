/* Tokenizer tests. What each part checks, and against what:
 *
 *  unicode      classes of sample code points (incl. Unicode 15.1 additions
 *               and a 16.0 one that llama.cpp's 15.1 tables lack); the
 *               UTF-8 decoder on overlong, surrogate, truncated and
 *               out-of-range input, against the rules written out here.
 *  byte map     GPT-2 byte <-> character map: all 256 bytes round-trip, the
 *               printable ones map to themselves, the others to U+0100...
 *  split        qwen2 / qwen35 splits of tricky strings; each expectation is
 *               worked out by hand from the regex (comments say how), and
 *               every split must cover its input exactly.
 *  bpe          a hand-made vocabulary where the ids are worked out by hand:
 *               rank order, leftmost-first ties, a merge whose result is
 *               not a token (llama.cpp falls back to single bytes and drops
 *               the ones that are not tokens), special tokens with and
 *               without parse_special, USER_DEFINED always split out.
 *  vocab        attributes and end-of-generation detection by text, pieces
 *               of control / user-defined / normal tokens, ERANGE contract.
 *  round trip   detokenize(tokenize(x)) == x for random valid UTF-8, and ==
 *               the llama.cpp-sanitised text (invalid byte -> U+FFFD) for
 *               random bytes, with a trained vocabulary.
 *  trainer      exact n_vocab, determinism, consistency (byte tokens, merge
 *               parts and results are tokens, unique texts), a 151936-token
 *               vocabulary in well under a second or two, both pre-tokenizers.
 *  gguf         kv_tok_load from a real file: success, and each malformed or
 *               unsupported input gives the right code and names the problem.
 *  cli          `kvasir tokenize` prints the same ids as the library, with
 *               and without --no-special, and fails cleanly on bad input.
 *
 * Token ids identical to llama.cpp's are checked by the conformance test
 * (tests/test_conformance.sh) against node-llama-cpp itself. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/gguf.h"
#include "kvasir/tok.h"
#include "kvtest.h"
#include "tok/tok_internal.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (uint32_t)(g_rng >> 11);
}

/* ---- unicode ---------------------------------------------------------- */

static void test_unicode(void) {
    ASSERT_EQ(kv_uc_class('a'), KV_UC_LETTER);
    ASSERT_EQ(kv_uc_class('Z'), KV_UC_LETTER);
    ASSERT_EQ(kv_uc_class('7'), KV_UC_NUMBER);
    ASSERT_EQ(kv_uc_class(' '), KV_UC_SPACE);
    ASSERT_EQ(kv_uc_class('\n'), KV_UC_SPACE);
    ASSERT_EQ(kv_uc_class('\v'), KV_UC_SPACE);
    ASSERT_EQ(kv_uc_class('!'), KV_UC_OTHER);
    ASSERT_EQ(kv_uc_class(0), KV_UC_OTHER);
    ASSERT_EQ(kv_uc_class(0x85), KV_UC_SPACE);   /* NEL */
    ASSERT_EQ(kv_uc_class(0xA0), KV_UC_SPACE);   /* NBSP */
    ASSERT_EQ(kv_uc_class(0xAA), KV_UC_LETTER);  /* ª Lo */
    ASSERT_EQ(kv_uc_class(0xB2), KV_UC_NUMBER);  /* ² No */
    ASSERT_EQ(kv_uc_class(0xB5), KV_UC_LETTER);  /* µ Ll */
    ASSERT_EQ(kv_uc_class(0xAD), KV_UC_OTHER);   /* soft hyphen Cf */
    ASSERT_EQ(kv_uc_class(0xE9), KV_UC_LETTER);  /* é */
    ASSERT_EQ(kv_uc_class(0x301), KV_UC_MARK);   /* combining acute */
    ASSERT_EQ(kv_uc_class(0x903), KV_UC_MARK);   /* Devanagari visarga, Mc */
    ASSERT_EQ(kv_uc_class(0x2163), KV_UC_NUMBER);/* Ⅳ Nl */
    ASSERT_EQ(kv_uc_class(0x200B), KV_UC_OTHER); /* zero width space: Cf, not White_Space */
    ASSERT_EQ(kv_uc_class(0x2028), KV_UC_SPACE);
    ASSERT_EQ(kv_uc_class(0x3000), KV_UC_SPACE);
    ASSERT_EQ(kv_uc_class(0x4E2D), KV_UC_LETTER);/* 中 */
    ASSERT_EQ(kv_uc_class(0xFF13), KV_UC_NUMBER);/* fullwidth 3 */
    ASSERT_EQ(kv_uc_class(0xFE0F), KV_UC_MARK);  /* variation selector 16 is Mn */
    ASSERT_EQ(kv_uc_class(0x1F600), KV_UC_OTHER);/* emoji So */
    ASSERT_EQ(kv_uc_class(0x378), KV_UC_OTHER);  /* unassigned */
    ASSERT_EQ(kv_uc_class(0xD800), KV_UC_OTHER); /* surrogate */
    ASSERT_EQ(kv_uc_class(0x10FFFF), KV_UC_OTHER);
    ASSERT_EQ(kv_uc_class(0x110000), KV_UC_OTHER);
    /* Unicode 15.0 / 15.1 additions are in llama.cpp's tables ... */
    ASSERT_EQ(kv_uc_class(0x11F00), KV_UC_MARK);  /* Kawi sign (15.0) */
    ASSERT_EQ(kv_uc_class(0x2EBF0), KV_UC_LETTER);/* CJK Ext. I (15.1) */
    ASSERT_EQ(kv_uc_class(0x2FFC), KV_UC_OTHER);  /* IDC (15.1), So */
    /* ... 16.0 ones are not */
    ASSERT_EQ(kv_uc_class(0x1C89), KV_UC_OTHER);
    /* the run table is sorted and starts at 0 */
    ASSERT_EQ(kv_uc_runs[0] >> 3, 0);
    bool sorted = true;
    for (size_t i = 1; i < kv_uc_n_runs; i++) sorted &= (kv_uc_runs[i] >> 3) > (kv_uc_runs[i - 1] >> 3);
    ASSERT_TRUE(sorted);

    /* decoder: the llama.cpp rules, case by case */
    static const struct {
        const char *in;
        size_t len;
        uint32_t want[6];
        size_t n;
    } dec[] = {
        {"A\xc3\xa9", 3, {'A', 0xE9}, 2},
        {"\xe4\xb8\xad", 3, {0x4E2D}, 1},
        {"\xf0\x9f\x98\x80", 4, {0x1F600}, 1},
        {"\x80", 1, {0xFFFD}, 1},                         /* stray continuation */
        {"\xc3", 1, {0xFFFD}, 1},                         /* truncated */
        {"\xc3(", 2, {0xFFFD, '('}, 2},                   /* bad continuation: one byte consumed */
        {"\xe4\xb8", 2, {0xFFFD, 0xFFFD}, 2},
        {"\xc0\x80", 2, {0}, 1},                          /* overlong NUL is taken as U+0000 */
        {"\xed\xa0\x80", 3, {0xD800}, 1},                 /* surrogate passes through */
        {"\xf4\x90\x80\x80", 4, {0xFFFD, 0xFFFD, 0xFFFD, 0xFFFD}, 4}, /* > U+10FFFF */
        {"\xf8\x88\x80\x80\x80", 5, {0xFFFD, 0xFFFD, 0xFFFD, 0xFFFD, 0xFFFD}, 5},
        {"\xff", 1, {0xFFFD}, 1},
    };
    for (size_t i = 0; i < sizeof dec / sizeof dec[0]; i++) {
        uint32_t got[8];
        size_t n = kv_utf8_decode((const uint8_t *)dec[i].in, dec[i].len, got);
        ASSERT_EQ(n, dec[i].n);
        for (size_t k = 0; k < n && k < dec[i].n; k++) ASSERT_EQ(got[k], dec[i].want[k]);
    }
}

/* ---- byte-level map --------------------------------------------------- */

static void test_byte_map(void) {
    int seen[0x144] = {0};
    bool ok = true;
    uint32_t next = 0x100;
    for (int b = 0; b < 256; b++) {
        uint32_t cp = kv_byte_to_cp((uint8_t)b);
        bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
        if (printable ? cp != (uint32_t)b : cp != next++) ok = false;
        if (cp >= 0x144 || seen[cp]++) ok = false;
        if (kv_cp_to_byte(cp) != b) ok = false;
        char u[4];
        int n = kv_byte_to_utf8((uint8_t)b, u);
        uint32_t back;
        if (kv_utf8_decode((const uint8_t *)u, (size_t)n, &back) != 1 || back != cp) ok = false;
    }
    ASSERT_TRUE(ok);
    ASSERT_EQ(kv_byte_to_cp(' '), 0x120);  /* 'Ġ' */
    ASSERT_EQ(kv_byte_to_cp('\n'), 0x10A); /* 'Ċ' */
    ASSERT_EQ(kv_byte_to_cp(0xAD), 0x143); /* the last one */
    ASSERT_EQ(kv_cp_to_byte('a'), 'a');
    ASSERT_EQ(kv_cp_to_byte(0x20), -1);    /* a raw space is not a byte-level character */
    ASSERT_EQ(kv_cp_to_byte(0x144), -1);
}

/* ---- pre-tokenizer split ---------------------------------------------- */

static int collect_word(void *ctx, const char *w, size_t n) {
    char *out = ctx;
    size_t at = strlen(out);
    if (at) out[at++] = '|';
    memcpy(out + at, w, n);
    out[at + n] = '\0';
    return 0;
}

/* Words of s joined by '|'. */
static void split_str(int pre, const char *s, char *out) {
    out[0] = '\0';
    kv_tok_split_words(pre, s, strlen(s), collect_word, out);
}

static void test_split(void) {
    static const struct {
        int pre;
        const char *in, *want; /* words joined by '|' */
    } cases[] = {
        /* a letter run takes one optional leading non-letter (here a space) */
        {KV_PRE_QWEN2, "Hello world", "Hello| world"},
        /* \s+(?!\S): of two spaces the last is left to prefix the word */
        {KV_PRE_QWEN2, "Hello  world", "Hello| | world"},
        /* contractions, case-insensitive, tried first */
        {KV_PRE_QWEN2, "don't", "don|'t"},
        {KV_PRE_QWEN2, "DON'T", "DON|'T"},
        {KV_PRE_QWEN2, "we'RE I'M you'll", "we|'RE| I|'M| you|'ll"},
        /* not a contraction: the apostrophe is the letter run's prefix */
        {KV_PRE_QWEN2, "'hello", "'hello"},
        /* "''s": no contraction at 0; no letter after the first ', so the
         * punctuation run takes both apostrophes and the s is a word */
        {KV_PRE_QWEN2, "''s", "''|s"},
        {KV_PRE_QWEN2, "'''", "'''"},
        /* \p{N}: one digit per word */
        {KV_PRE_QWEN2, "123abc", "1|2|3|abc"},
        {KV_PRE_QWEN2, "3.14", "3|.|1|4"},
        /* a space before a digit is not a prefix of anything: alone */
        {KV_PRE_QWEN2, " 123", " |1|2|3"},
        /* \s*[\r\n]+ takes the run up to its last newline */
        {KV_PRE_QWEN2, "a\n\nb", "a|\n\n|b"},
        {KV_PRE_QWEN2, "a  \n  b", "a|  \n| | b"},
        {KV_PRE_QWEN2, "a\r\nb", "a|\r\n|b"},
        {KV_PRE_QWEN2, " \n", " \n"},
        /* punctuation runs take one leading space and trailing newlines */
        {KV_PRE_QWEN2, "hello!!!", "hello|!!!"},
        {KV_PRE_QWEN2, "hello !!!\n\nworld", "hello| !!!\n\n|world"},
        {KV_PRE_QWEN2, "??\r\n\r\nX", "??\r\n\r\n|X"},
        {KV_PRE_QWEN2, "(test)", "(test|)"},
        /* a tab run: all but the last white space, then tab + letters */
        {KV_PRE_QWEN2, "x\t\ty", "x|\t|\ty"},
        /* trailing white space at the end of the text stays whole */
        {KV_PRE_QWEN2, "end   ", "end|   "},
        {KV_PRE_QWEN2, "  ", "  "},
        {KV_PRE_QWEN2, " ", " "},
        /* non-ASCII letters, CJK, emoji (symbols: a punctuation run) */
        {KV_PRE_QWEN2, "na\xc3\xafve caf\xc3\xa9", "na\xc3\xafve| caf\xc3\xa9"},
        {KV_PRE_QWEN2, "\xe4\xb8\xad\xe6\x96\x87\xe3\x80\x82", "\xe4\xb8\xad\xe6\x96\x87|\xe3\x80\x82"},
        {KV_PRE_QWEN2, "\xf0\x9f\x98\x80\xf0\x9f\x98\x80 ok", "\xf0\x9f\x98\x80\xf0\x9f\x98\x80| ok"},
        /* NBSP is white space but not CR/LF: a valid prefix of a letter run */
        {KV_PRE_QWEN2, "\xc2\xa0x", "\xc2\xa0x"},
        /* ideographic spaces: the last one prefixes the letter */
        {KV_PRE_QWEN2, "x\xe3\x80\x80\xe3\x80\x80y", "x|\xe3\x80\x80|\xe3\x80\x80y"},
        /* other number categories: Nl, No, No each alone; after a letter too */
        {KV_PRE_QWEN2, "\xe2\x85\xab\xc2\xb2\xc2\xbd", "\xe2\x85\xab|\xc2\xb2|\xc2\xbd"},
        {KV_PRE_QWEN2, "x\xc2\xb2", "x|\xc2\xb2"},
        /* U+1C89 is unassigned in Unicode 15.1 (a letter only from 16.0) */
        {KV_PRE_QWEN2, "a\xe1\xb2\x89", "a|\xe1\xb2\x89"},
        /* qwen2: a combining mark is not a letter: it ends the run, and is
         * a prefix for the next run (or punctuation on its own) */
        {KV_PRE_QWEN2, "e\xcc\x81", "e|\xcc\x81"},
        {KV_PRE_QWEN2, " \xcc\x81x", " \xcc\x81|x"},
        /* हिन्दी = ह ि न ् द ी: letter | mark+letter | mark+letter | mark */
        {KV_PRE_QWEN2, "\xe0\xa4\xb9\xe0\xa4\xbf\xe0\xa4\xa8\xe0\xa5\x8d\xe0\xa4\xa6\xe0\xa5\x80",
         "\xe0\xa4\xb9|\xe0\xa4\xbf\xe0\xa4\xa8|\xe0\xa5\x8d\xe0\xa4\xa6|\xe0\xa5\x80"},
        /* qwen35: marks belong to letter runs and leave punctuation runs */
        {KV_PRE_QWEN35, "e\xcc\x81", "e\xcc\x81"},
        {KV_PRE_QWEN35, " \xcc\x81x", " \xcc\x81x"},
        {KV_PRE_QWEN35, "\xe0\xa4\xb9\xe0\xa4\xbf\xe0\xa4\xa8\xe0\xa5\x8d\xe0\xa4\xa6\xe0\xa5\x80",
         "\xe0\xa4\xb9\xe0\xa4\xbf\xe0\xa4\xa8\xe0\xa5\x8d\xe0\xa4\xa6\xe0\xa5\x80"},
        {KV_PRE_QWEN35, "!\xcc\x81!", "!\xcc\x81|!"},
        {KV_PRE_QWEN35, "Hello  world don't 42", "Hello| | world| don|'t| |4|2"},
        /* invalid UTF-8 reaches BPE as U+FFFD (a symbol) */
        {KV_PRE_QWEN2, "a\xff" "b", "a|\xef\xbf\xbd" "b"},
    };
    char got[512];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        split_str(cases[i].pre, cases[i].in, got);
        kvt_checks++;
        if (strcmp(got, cases[i].want)) KVT_FAIL("split case %zu: got \"%s\" want \"%s\"", i, got, cases[i].want);
    }
    /* the split covers its input exactly (random valid text) */
    static const uint32_t pool[] = {'a', 'Z', '1', ' ', ' ', '\n', '\r', '\t', '\'', 's', '!', '.',
                                    0xE9, 0x301, 0x4E2D, 0x1F600, 0xA0, 0x3000, 0xB2, 0xFE0F};
    bool ok = true;
    for (int it = 0; it < 2000 && ok; it++) {
        uint32_t cps[64], lens[64];
        size_t n = rnd() % 64;
        for (size_t k = 0; k < n; k++) cps[k] = pool[rnd() % (sizeof pool / sizeof pool[0])];
        size_t nw = kv_pretok_split(it & 1 ? KV_PRE_QWEN35 : KV_PRE_QWEN2, cps, n, lens);
        size_t sum = 0;
        for (size_t w = 0; w < nw; w++) {
            if (lens[w] == 0) ok = false;
            sum += lens[w];
        }
        if (sum != n) ok = false;
    }
    ASSERT_TRUE(ok);
    ASSERT_EQ(kv_pre_from_name("qwen2", 5), KV_PRE_QWEN2);
    ASSERT_EQ(kv_pre_from_name("qwen35", 6), KV_PRE_QWEN35);
    ASSERT_EQ(kv_pre_from_name("gpt-2", 5), -1);
    ASSERT_EQ(kv_pre_from_name("qwen", 4), -1);
}

/* ---- BPE on a hand-made vocabulary ------------------------------------ */

#define S(x) {x, sizeof x - 1}

/* ids:  0 a  1 b  2 c  3 d  4 ab  5 bc  6 abc  7 Ġ  8 Ġa  9 <  10 >  11 s
 *      12 u  13 <s> (CONTROL)  14 <u> (USER_DEFINED)  15 <|im_end|> (NORMAL in
 *      the file: llama.cpp makes it CONTROL and end-of-generation)  16 aa
 * merges by rank: 0 "b c"  1 "a b"  2 "a bc"  3 "Ġ a"  4 "c d" (cd is not a
 *      token)  5 "Ġ d" (Ġd is not a token)  6 "a a"  7 "b c" (duplicate:
 *      keeps rank 0) */
static kv_tok *hand_vocab(void) {
    static const kv_str toks[] = {S("a"), S("b"), S("c"), S("d"), S("ab"), S("bc"), S("abc"),
                                  S("\xc4\xa0"), S("\xc4\xa0" "a"), S("<"), S(">"), S("s"), S("u"),
                                  S("<s>"), S("<u>"), S("<|im_end|>"), S("aa")};
    static const int32_t types[] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3, 4, 1, 1};
    static const kv_str merges[] = {S("b c"), S("a b"), S("a bc"), S("\xc4\xa0 a"), S("c d"),
                                    S("\xc4\xa0 d"), S("a a"), S("b c")};
    kv_tok_spec s;
    kv_tok_spec_init(&s);
    s.tokens = toks;
    s.n_tokens = sizeof toks / sizeof toks[0];
    s.types = types;
    s.merges = merges;
    s.n_merges = sizeof merges / sizeof merges[0];
    s.pre = KV_PRE_QWEN2;
    s.eos = 99; /* out of range: ignored, the gpt2 default 11 stays */
    kv_tok *t = NULL;
    kv_diag d = {0};
    int rc = kv_tok_build(&t, &s, &d);
    ASSERT_EQ(rc, 0);
    return t;
}

/* Encodes s, compares with the expected ids (terminated by -1). */
static void expect_ids(const kv_tok *t, const char *s, bool special, const int32_t *want, int line) {
    int32_t ids[64];
    size_t n = 0;
    kv_diag d = {0};
    int rc = kv_tok_encode(t, s, strlen(s), special, ids, 64, &n, &d);
    size_t nw = 0;
    while (want[nw] >= 0) nw++;
    bool same = rc == 0 && n == nw;
    for (size_t i = 0; same && i < n; i++) same = ids[i] == want[i];
    kvt_checks++;
    if (!same) {
        char buf[512] = "";
        for (size_t i = 0; i < n && i < 64; i++) snprintf(buf + strlen(buf), sizeof buf - strlen(buf), "%d ", ids[i]);
        KVT_FAIL("line %d: encode \"%s\" (special %d): rc %d, got [%s]", line, s, special, rc, buf);
    }
}
#define EXPECT_IDS(t, s, sp, ...)                                          \
    do {                                                                   \
        static const int32_t w_[] = {__VA_ARGS__, -1};                     \
        expect_ids(t, s, sp, w_, __LINE__);                                \
    } while (0)

static void test_bpe(void) {
    kv_tok *t = hand_vocab();
    if (!t) return;
    /* "abc": (b,c) has rank 0 < (a,b) 1 -> a|bc; then (a,bc) rank 2 -> abc */
    EXPECT_IDS(t, "abc", true, 6);
    /* "abab": two (a,b) at rank 1, leftmost first; (ab,ab) is no merge */
    EXPECT_IDS(t, "abab", true, 4, 4);
    /* "aaa": (a,a) at 0 and 1, same rank: the left one wins -> aa|a */
    EXPECT_IDS(t, "aaa", true, 16, 0);
    /* " abc" -> Ġabc: bc (0), then a+bc (2) before Ġ+a (3), no Ġ+abc merge */
    EXPECT_IDS(t, " abc", true, 7, 6);
    /* " a" -> Ġ+a (3) */
    EXPECT_IDS(t, " a", true, 8);
    /* "cd": merged to "cd", not a token: falls back to bytes c, d */
    EXPECT_IDS(t, "cd", true, 2, 3);
    /* " d": merged to "Ġd", not a token: its bytes are C4 A0 64; the lone
     * bytes C4 and A0 are not tokens and vanish (llama.cpp does the same) */
    EXPECT_IDS(t, " d", true, 3);
    /* a character with no token at all vanishes too */
    EXPECT_IDS(t, "axb", true, 0, 1);
    /* special tokens: CONTROL only with parse_special, USER_DEFINED always */
    EXPECT_IDS(t, "a<s>b<u>c", true, 0, 13, 1, 14, 2);
    /* without: "a<s>b" splits as a | <s | >b ("<" prefixes the letter run,
     * then ">" prefixes "b"); <u> is still one token */
    EXPECT_IDS(t, "a<s>b<u>c", false, 0, 9, 11, 10, 1, 14, 2);
    /* adjacent and repeated specials; the text between is split on its own */
    EXPECT_IDS(t, "<s><s>ab<s>", true, 13, 13, 4, 13);
    EXPECT_IDS(t, "<|im_end|>", true, 15);
    /* Ġ is not a character of the input: "Ġ" typed in is bytes C4 A0 whose
     * byte-level form is two other characters, none of them tokens */
    EXPECT_IDS(t, "\xc4\xa0" "a", true, 0);

    /* capacity contract */
    int32_t ids[2];
    size_t n = 0;
    kv_diag d = {0};
    /* "abab ab" is ab ab | Ġ ab: four tokens */
    ASSERT_EQ(kv_tok_encode(t, "abab ab", 7, true, ids, 1, &n, &d), KV_ERANGE);
    ASSERT_EQ(n, 4);
    ASSERT_EQ(kv_tok_encode(t, "", 0, true, ids, 2, &n, &d), 0);
    ASSERT_EQ(n, 0);

    /* merge ranks, duplicates keep the first */
    ASSERT_EQ(kv_tok_merge_rank(t, "b", 1, "c", 1), 0);
    ASSERT_EQ(kv_tok_merge_rank(t, "a", 1, "a", 1), 6);
    ASSERT_EQ(kv_tok_merge_rank(t, "c", 1, "b", 1), -1);

    /* attributes and end of generation */
    ASSERT_EQ(kv_tok_attr(t, 13), KV_TOK_CONTROL);
    ASSERT_EQ(kv_tok_attr(t, 14), KV_TOK_USER_DEFINED);
    ASSERT_EQ(kv_tok_attr(t, 15), KV_TOK_CONTROL); /* promoted by its text */
    ASSERT_EQ(kv_tok_attr(t, 0), KV_TOK_NORMAL);
    ASSERT_EQ(kv_tok_attr(t, 17), 0);
    ASSERT_TRUE(kv_tok_is_eog(t, 15));
    ASSERT_EQ(kv_tok_eos(t), 11); /* gpt2 default; file id 99 out of range */
    ASSERT_EQ(kv_tok_bos(t), 11);
    ASSERT_TRUE(kv_tok_is_eog(t, 11));
    ASSERT_TRUE(!kv_tok_is_eog(t, 13));
    ASSERT_TRUE(!kv_tok_is_eog(t, -1));
    ASSERT_TRUE(!kv_tok_add_bos(t));
    ASSERT_EQ(kv_tok_find(t, "<u>"), 14);
    ASSERT_EQ(kv_tok_find(t, "zz"), -1);
    ASSERT_EQ(kv_tok_n_vocab(t), 17);

    /* pieces */
    char buf[32];
    ASSERT_EQ(kv_tok_piece(t, 8, false, buf, sizeof buf), 2);
    ASSERT_TRUE(!memcmp(buf, " a", 2));
    ASSERT_EQ(kv_tok_piece(t, 13, false, buf, sizeof buf), 0);
    ASSERT_EQ(kv_tok_piece(t, 13, true, buf, sizeof buf), 3);
    ASSERT_TRUE(!memcmp(buf, "<s>", 3));
    ASSERT_EQ(kv_tok_piece(t, 14, false, buf, sizeof buf), 3); /* user-defined: always */
    ASSERT_EQ(kv_tok_piece(t, 15, true, buf, 4), 10);          /* too small: size, prefix */
    ASSERT_TRUE(!memcmp(buf, "<|im", 4));
    ASSERT_EQ(kv_tok_piece(t, 17, true, buf, sizeof buf), -1);
    kv_tok_free(t);
    kv_tok_free(NULL);
}

/* Special-token detection by text, the </s> and <|end|> exceptions, the
 * renamed empty token, UNUSED / BYTE / undefined types, a character outside
 * the byte map (spelled out as llama.cpp does). */
static void test_vocab_rules(void) {
    static const kv_str toks[] = {S("x"), S(""), S("<|endoftext|>"), S("<|fim_pad|>"), S("</s>"),
                                  S("<|tool_response>"), S("<|end|>"), S("<|return|>"), S("<|call|>"),
                                  S("<|channel|>"), S("<0x41>"), S("[PAD9]"), S("q\x01"), S("und"),
                                  S("<unk>")};
    static const int32_t types[] = {1, 1, 3, 1, 3, 3, 3, 3, 3, 3, 6, 5, 1, 9, 2};
    kv_tok_spec s;
    kv_tok_spec_init(&s);
    s.tokens = toks;
    s.n_tokens = sizeof toks / sizeof toks[0];
    s.types = types;
    s.pre = KV_PRE_QWEN2;
    s.eos = 2;
    s.add_bos = 1;
    kv_tok *t = NULL;
    kv_diag d = {0};
    ASSERT_EQ(kv_tok_build(&t, &s, &d), 0);
    if (!t) return;
    size_t len;
    ASSERT_STREQ(kv_tok_text(t, 1, &len), "[EMPTY_1]");
    ASSERT_TRUE(kv_tok_is_eog(t, 2));                /* eos and by text */
    ASSERT_TRUE(kv_tok_is_eog(t, 3));                /* FIM pad, detected by text */
    ASSERT_EQ(kv_tok_attr(t, 3), KV_TOK_CONTROL);
    ASSERT_TRUE(!kv_tok_is_eog(t, 4));               /* </s> dropped next to <|tool_response> */
    ASSERT_EQ(kv_tok_attr(t, 4), KV_TOK_NORMAL);
    ASSERT_TRUE(kv_tok_is_eog(t, 5));
    ASSERT_TRUE(!kv_tok_is_eog(t, 6));               /* <|end|> dropped next to <|return|>+<|call|> */
    ASSERT_EQ(kv_tok_attr(t, 6), KV_TOK_USER_DEFINED);
    ASSERT_EQ(kv_tok_attr(t, 9), KV_TOK_USER_DEFINED);/* <|channel|> always rendered */
    ASSERT_TRUE(kv_tok_add_bos(t));
    ASSERT_EQ(kv_tok_bos(t), 11);
    char buf[128];
    ASSERT_EQ(kv_tok_piece(t, 10, false, buf, sizeof buf), 1); /* BYTE <0x41> */
    ASSERT_EQ(buf[0], 'A');
    ASSERT_EQ(kv_tok_piece(t, 11, true, buf, sizeof buf), 0);  /* UNUSED: no text */
    ASSERT_EQ(kv_tok_piece(t, 13, true, buf, sizeof buf), 0);  /* undefined type */
    ASSERT_EQ(kv_tok_piece(t, 14, false, buf, sizeof buf), 0); /* UNKNOWN is special */
    int n = kv_tok_piece(t, 12, true, buf, sizeof buf);
    const char *want = "q[UNK_BYTE_0x01q\x01]";
    ASSERT_EQ(n, (int)strlen(want));
    ASSERT_TRUE(n == (int)strlen(want) && !memcmp(buf, want, (size_t)n));
    /* parse_special off: <unk> (UNKNOWN) and CONTROL stay text, while the
     * USER_DEFINED <|channel|> is still split out */
    int32_t ids[32];
    size_t k = 0;
    ASSERT_EQ(kv_tok_encode(t, "<|channel|>x<unk>", 17, false, ids, 32, &k, &d), 0);
    ASSERT_TRUE(k >= 2 && ids[0] == 9 && ids[1] == 0);
    ASSERT_EQ(kv_tok_encode(t, "<|channel|>x<unk>", 17, true, ids, 32, &k, &d), 0);
    ASSERT_EQ(k, 3);
    ASSERT_EQ(ids[2], 14);
    kv_tok_free(t);

    /* malformed vocabularies */
    static const kv_str dup[] = {S("a"), S("b"), S("a")};
    kv_tok_spec_init(&s);
    s.tokens = dup;
    s.n_tokens = 3;
    s.pre = KV_PRE_QWEN2;
    t = NULL;
    ASSERT_EQ(kv_tok_build(&t, &s, &d), KV_EFORMAT);
    ASSERT_TRUE(strstr(d.msg, "duplicate") != NULL);
    ASSERT_TRUE(t == NULL);
    static const kv_str huge[] = {S("\xf5\x80\x80\x80")};
    s.tokens = huge;
    s.n_tokens = 1;
    ASSERT_EQ(kv_tok_build(&t, &s, &d), KV_EFORMAT);
    s.n_tokens = 0;
    ASSERT_EQ(kv_tok_build(&t, &s, &d), KV_EFORMAT);
    char *longtok = malloc(KV_TOK_MAX_TOKEN_BYTES + 2);
    memset(longtok, 'a', KV_TOK_MAX_TOKEN_BYTES + 1);
    kv_str lt = {longtok, KV_TOK_MAX_TOKEN_BYTES + 1};
    s.tokens = &lt;
    s.n_tokens = 1;
    ASSERT_EQ(kv_tok_build(&t, &s, &d), KV_EFORMAT);
    free(longtok);
}

/* ---- round trip with a trained vocabulary ----------------------------- */

/* What llama.cpp's tokenizer preserves of arbitrary bytes: each byte
 * sequence is read with the lead-byte rules (overlongs and surrogates kept,
 * re-encoded as their code point), anything else becomes U+FFFD. Written
 * independently of kv_utf8_decode. */
static size_t sanitize(const uint8_t *s, size_t n, uint8_t *out) {
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        uint8_t b = s[i];
        size_t need = b < 0x80 ? 1 : b < 0xC0 ? 0 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : b < 0xF8 ? 4 : 0;
        uint32_t cp = need == 1 ? b : need == 2 ? (b & 31u) : need == 3 ? (b & 15u) : (b & 7u);
        bool ok = need > 0 && i + need <= n;
        for (size_t k = 1; ok && k < need; k++) {
            ok = (s[i + k] >> 6) == 2;
            cp = (cp << 6) | (s[i + k] & 63u);
        }
        if (ok && cp <= 0x10FFFF) {
            uint8_t u[4];
            int un = kv_utf8_encode(cp, u);
            memcpy(out + o, u, (size_t)un);
            o += (size_t)un;
            i += need;
        } else {
            memcpy(out + o, "\xef\xbf\xbd", 3);
            o += 3;
            i++;
        }
    }
    return o;
}

static size_t detok(const kv_tok *t, const int32_t *ids, size_t n, bool special, char *out, size_t cap) {
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        int k = kv_tok_piece(t, ids[i], special, out + o, cap - o);
        if (k < 0 || (size_t)k > cap - o) return (size_t)-1;
        o += (size_t)k;
    }
    return o;
}

static void test_round_trip(const kv_tok *t) {
    enum { N = 400 };
    static uint8_t text[N], want[3 * N];
    static char got[8 * N];
    static int32_t ids[4 * N];
    static const uint32_t cps[] = {'a', 'e', ' ', '\n', '\'', '1', 0xE9, 0x301, 0x4E2D, 0xAC00,
                                   0x1F600, 0x3000, 0x10FFFF, 0xFFFD, 0x7F, 0x80};
    bool ok_valid = true, ok_bytes = true, ok_special = true;
    kv_diag d = {0};
    for (int it = 0; it < 600; it++) {
        /* valid UTF-8 from a mixed pool */
        size_t n = 0, m = rnd() % 60;
        for (size_t k = 0; k < m; k++) {
            uint32_t cp = (rnd() & 3) ? cps[rnd() % (sizeof cps / sizeof cps[0])] : 0x20 + rnd() % 0x2FFE0;
            if (cp >= 0xD800 && cp < 0xE000) cp = 'z';
            n += (size_t)kv_utf8_encode(cp, text + n);
        }
        size_t nid = 0;
        if (kv_tok_encode(t, (const char *)text, n, false, ids, sizeof ids / sizeof ids[0], &nid, &d)) ok_valid = false;
        size_t gl = detok(t, ids, nid, false, got, sizeof got);
        if (gl != n || memcmp(got, text, n)) ok_valid = false;

        /* random bytes, invalid UTF-8 included */
        n = rnd() % 200;
        static const uint8_t frag[] = " ae\n\xc3\xa9\xe4\xb8\xad\xf0\x9f\x98\x80";
        for (size_t k = 0; k < n; k++) text[k] = (rnd() & 1) ? (uint8_t)rnd() : frag[rnd() % 14];
        size_t wl = sanitize(text, n, want);
        if (kv_tok_encode(t, (const char *)text, n, false, ids, sizeof ids / sizeof ids[0], &nid, &d)) ok_bytes = false;
        gl = detok(t, ids, nid, false, got, sizeof got);
        if (gl != wl || memcmp(got, want, wl)) ok_bytes = false;
    }
    ASSERT_TRUE(ok_valid);
    ASSERT_TRUE(ok_bytes);
    /* with special tokens parsed, they come back when detokenized as special */
    const char *chat = "<|im_start|>user\nHi <|im_end|>x<|endoftext|>";
    size_t nid = 0;
    ASSERT_EQ(kv_tok_encode(t, chat, strlen(chat), true, ids, 64, &nid, &d), 0);
    ASSERT_EQ(ids[0], kv_tok_find(t, "<|im_start|>"));
    size_t gl = detok(t, ids, nid, true, got, sizeof got);
    ok_special = gl == strlen(chat) && !memcmp(got, chat, gl);
    ASSERT_TRUE(ok_special);
    gl = detok(t, ids, nid, false, got, sizeof got); /* without: control text vanishes */
    ASSERT_TRUE(gl == strlen("user\nHi x") && !memcmp(got, "user\nHi x", gl));
    /* and without parse_special they are plain text, never the control id */
    ASSERT_EQ(kv_tok_encode(t, chat, strlen(chat), false, ids, 256, &nid, &d), 0);
    bool none = true;
    for (size_t i = 0; i < nid; i++) none &= kv_tok_attr(t, ids[i]) == KV_TOK_NORMAL;
    ASSERT_TRUE(none);
    gl = detok(t, ids, nid, false, got, sizeof got);
    ASSERT_TRUE(gl == strlen(chat) && !memcmp(got, chat, gl));
    ASSERT_TRUE(kv_tok_is_eog(t, kv_tok_find(t, "<|im_end|>")));
    ASSERT_TRUE(kv_tok_is_eog(t, kv_tok_find(t, "<|endoftext|>")));
    ASSERT_TRUE(!kv_tok_is_eog(t, kv_tok_find(t, "<|im_start|>")));
}

/* ---- trainer ---------------------------------------------------------- */

/* Builds a tokenizer from a trained vocabulary. */
static kv_tok *tok_from_vocab(const kv_bpe_vocab *v, int pre) {
    kv_str *ts = malloc(v->n_tokens * sizeof *ts), *ms = malloc((v->n_merges + 1) * sizeof *ms);
    for (size_t i = 0; i < v->n_tokens; i++) ts[i] = (kv_str){v->tokens[i], strlen(v->tokens[i])};
    for (size_t i = 0; i < v->n_merges; i++) ms[i] = (kv_str){v->merges[i], strlen(v->merges[i])};
    kv_tok_spec s;
    kv_tok_spec_init(&s);
    s.tokens = ts;
    s.n_tokens = v->n_tokens;
    s.types = v->types;
    s.merges = ms;
    s.n_merges = v->n_merges;
    s.pre = pre;
    s.eos = v->eos_id;
    s.bos = v->eos_id;
    kv_tok *t = NULL;
    kv_diag d = {0};
    int rc = kv_tok_build(&t, &s, &d);
    if (rc) KVT_FAIL("build from trained vocab: %s", d.msg);
    free(ts);
    free(ms);
    return t;
}

/* Every byte token, every merge part and result a token; unique texts. */
static bool vocab_consistent(const kv_bpe_vocab *v, const kv_tok *t) {
    for (int b = 0; b < 256; b++) {
        char u[4];
        int n = kv_byte_to_utf8((uint8_t)b, u);
        if (kv_tok_lookup(t, u, (size_t)n) < 0) return false;
    }
    for (size_t i = 0; i < v->n_merges; i++) {
        const char *m = v->merges[i], *sp = strchr(m + 1, ' ');
        if (!sp || strchr(sp + 1, ' ')) return false;
        size_t ll = (size_t)(sp - m), rl = strlen(sp + 1);
        char joined[2 * KV_TOK_MAX_TOKEN_BYTES + 2];
        memcpy(joined, m, ll);
        memcpy(joined + ll, sp + 1, rl);
        if (kv_tok_lookup(t, m, ll) < 0 || kv_tok_lookup(t, sp + 1, rl) < 0 ||
            kv_tok_lookup(t, joined, ll + rl) < 0)
            return false;
        if (kv_tok_merge_rank(t, m, ll, sp + 1, rl) != (int32_t)i) return false; /* no duplicates */
    }
    return true; /* unique texts: kv_tok_build refuses duplicates */
}

static bool same_vocab(const kv_bpe_vocab *a, const kv_bpe_vocab *b) {
    if (a->n_tokens != b->n_tokens || a->n_merges != b->n_merges || a->eos_id != b->eos_id) return false;
    for (size_t i = 0; i < a->n_tokens; i++)
        if (strcmp(a->tokens[i], b->tokens[i]) || a->types[i] != b->types[i]) return false;
    for (size_t i = 0; i < a->n_merges; i++)
        if (strcmp(a->merges[i], b->merges[i])) return false;
    return true;
}

static void test_trainer(void) {
    size_t clen;
    const char *corpus = kv_bpe_default_corpus(&clen);
    ASSERT_TRUE(clen > 40000);
    kv_diag d = {0};

    static const size_t sizes[] = {259, 300, 1000, 4096};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        kv_bpe_vocab v, v2;
        ASSERT_EQ(kv_bpe_train(corpus, clen, "qwen2", sizes[si], &v, &d), 0);
        ASSERT_EQ(v.n_tokens, sizes[si]);
        ASSERT_STREQ(v.tokens[v.eos_id], "<|endoftext|>");
        ASSERT_STREQ(v.tokens[v.im_start_id], "<|im_start|>");
        ASSERT_STREQ(v.tokens[v.im_end_id], "<|im_end|>");
        ASSERT_EQ(v.types[v.eos_id], KV_TOK_CONTROL);
        ASSERT_EQ(v.types[v.im_end_id], KV_TOK_CONTROL);
        ASSERT_STREQ(v.tokens[0], "!"); /* GPT-2 byte order */
        ASSERT_EQ(kv_bpe_train(corpus, clen, "qwen2", sizes[si], &v2, &d), 0);
        ASSERT_TRUE(same_vocab(&v, &v2));
        kv_tok *t = tok_from_vocab(&v, KV_PRE_QWEN2);
        if (t) {
            ASSERT_TRUE(vocab_consistent(&v, t));
            if (sizes[si] == 4096) test_round_trip(t);
            /* compression: the corpus encodes to far fewer tokens than bytes
             * once there are merges, and decodes back exactly */
            int32_t *ids = malloc(clen * sizeof *ids);
            char *back = malloc(clen + 1);
            size_t n = 0;
            ASSERT_EQ(kv_tok_encode(t, corpus, clen, false, ids, clen, &n, &d), 0);
            if (sizes[si] >= 1000) ASSERT_TRUE(n < clen / 2);
            ASSERT_EQ(detok(t, ids, n, false, back, clen + 1), clen);
            ASSERT_TRUE(!memcmp(back, corpus, clen));
            free(ids);
            free(back);
            kv_tok_free(t);
        }
        kv_bpe_vocab_free(&v);
        kv_bpe_vocab_free(&v2);
    }

    /* Qwen3-sized: padded with UNUSED tokens, quickly */
    kv_bpe_vocab big;
    double t0 = now_s();
    ASSERT_EQ(kv_bpe_train(corpus, clen, "qwen2", 151936, &big, &d), 0);
    double dt = now_s() - t0;
    printf("trained n_vocab 151936 in %.3f s (%zu merges)\n", dt, big.n_merges);
    ASSERT_TRUE(dt < 5.0);
    ASSERT_EQ(big.n_tokens, 151936);
    ASSERT_EQ(big.types[151935], KV_TOK_UNUSED);
    ASSERT_STREQ(big.tokens[151935], "[PAD151935]");
    ASSERT_EQ(big.types[big.im_end_id + 1], KV_TOK_UNUSED);
    kv_tok *tb = tok_from_vocab(&big, KV_PRE_QWEN2);
    if (tb) {
        ASSERT_TRUE(vocab_consistent(&big, tb));
        char buf[8];
        ASSERT_EQ(kv_tok_piece(tb, 151935, true, buf, sizeof buf), 0);
        kv_tok_free(tb);
    }
    kv_bpe_vocab_free(&big);

    /* qwen35 too; a different split gives a different vocabulary */
    kv_bpe_vocab q35;
    ASSERT_EQ(kv_bpe_train(corpus, clen, "qwen35", 2000, &q35, &d), 0);
    ASSERT_EQ(q35.n_tokens, 2000);
    kv_tok *t35 = tok_from_vocab(&q35, KV_PRE_QWEN35);
    if (t35) {
        ASSERT_TRUE(vocab_consistent(&q35, t35));
        kv_tok_free(t35);
    }
    kv_bpe_vocab_free(&q35);

    /* a tiny corpus runs out of pairs early and still gives exactly n_vocab */
    kv_bpe_vocab tiny;
    ASSERT_EQ(kv_bpe_train("aaaa bbbb", 9, "qwen2", 400, &tiny, &d), 0);
    ASSERT_EQ(tiny.n_tokens, 400);
    ASSERT_TRUE(tiny.n_merges >= 2);
    ASSERT_EQ(tiny.eos_id, (int32_t)(256 + tiny.n_merges));
    kv_bpe_vocab_free(&tiny);

    kv_bpe_vocab bad;
    ASSERT_EQ(kv_bpe_train(corpus, clen, "gpt-2", 1000, &bad, &d), KV_EUNSUPPORTED);
    ASSERT_EQ(kv_bpe_train(corpus, clen, "qwen2", 258, &bad, &d), KV_EINVAL);
    kv_bpe_vocab_free(&bad);
}

/* ---- GGUF loading and the CLI ----------------------------------------- */

static char g_dir[] = "/tmp/kvasir_test_tok_XXXXXX";

typedef enum { GV_OK, GV_MODEL, GV_PRE, GV_NO_PRE, GV_NO_MERGES, GV_TYPES_F32, GV_DUP, GV_NO_TOKENS } gv_kind;

/* Writes a vocab-only GGUF (from a trained vocabulary) with one defect. */
static int write_vocab_gguf(const char *path, const kv_bpe_vocab *v, gv_kind kind) {
    kv_diag d = {0};
    kv_gguf_writer *w = NULL;
    if (kv_gguf_writer_new(&w, &d)) return -1;
    kv_str *ts = malloc(v->n_tokens * sizeof *ts), *ms = malloc((v->n_merges + 1) * sizeof *ms);
    for (size_t i = 0; i < v->n_tokens; i++) ts[i] = (kv_str){v->tokens[i], strlen(v->tokens[i])};
    for (size_t i = 0; i < v->n_merges; i++) ms[i] = (kv_str){v->merges[i], strlen(v->merges[i])};
    if (kind == GV_DUP) ts[300] = ts[299];
    int rc = 0;
    rc |= kv_gguf_writer_set_str(w, "general.architecture", "qwen3moe", &d);
    rc |= kv_gguf_writer_set_str(w, "tokenizer.ggml.model", kind == GV_MODEL ? "llama" : "gpt2", &d);
    if (kind != GV_NO_PRE)
        rc |= kv_gguf_writer_set_str(w, "tokenizer.ggml.pre", kind == GV_PRE ? "gpt-2" : "qwen2", &d);
    if (kind != GV_NO_TOKENS) rc |= kv_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", ts, v->n_tokens, &d);
    if (kind == GV_TYPES_F32) {
        float *f = calloc(v->n_tokens, sizeof *f);
        rc |= kv_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", KV_GGUF_FLOAT32, f, v->n_tokens, &d);
        free(f);
    } else {
        rc |= kv_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", KV_GGUF_INT32, v->types, v->n_tokens, &d);
    }
    if (kind != GV_NO_MERGES) rc |= kv_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", ms, v->n_merges, &d);
    rc |= kv_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)v->im_end_id, &d);
    rc |= kv_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)v->eos_id, &d);
    rc |= kv_gguf_writer_set_u32(w, "tokenizer.ggml.padding_token_id", (uint32_t)v->eos_id, &d);
    rc |= kv_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", false, &d);
    if (!rc) rc = kv_gguf_writer_begin(w, path, &d);
    if (!rc) rc = kv_gguf_writer_finish(w, &d);
    if (rc) KVT_FAIL("writing %s: %s", path, d.msg);
    kv_gguf_writer_free(w);
    free(ts);
    free(ms);
    return rc;
}

static int load_file(const char *path, kv_tok **t, kv_diag *d) {
    kv_gguf *g = NULL;
    *t = NULL;
    int rc = kv_gguf_open(&g, path, d);
    if (!rc) rc = kv_tok_load(t, g, d);
    kv_gguf_close(g);
    return rc;
}

/* Runs a command; stdout into out (NUL-terminated), returns exit status. */
static int run_capture(const char *cmd, char *out, size_t cap, char *err, size_t ecap) {
    char full[4096], ef[128];
    snprintf(ef, sizeof ef, "%s/stderr.txt", g_dir);
    snprintf(full, sizeof full, "%s 2>%s", cmd, ef);
    FILE *p = popen(full, "r");
    if (!p) return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    FILE *f = fopen(ef, "rb");
    n = f ? fread(err, 1, ecap - 1, f) : 0;
    err[n] = '\0';
    if (f) fclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 1000;
}

static void ids_json(const int32_t *ids, size_t n, char *out, size_t cap) {
    size_t at = (size_t)snprintf(out, cap, "[");
    for (size_t i = 0; i < n && at < cap; i++) at += (size_t)snprintf(out + at, cap - at, i ? ",%d" : "%d", ids[i]);
    snprintf(out + at, cap - at, "]\n");
}

static void test_gguf_and_cli(void) {
    if (!mkdtemp(g_dir)) {
        KVT_FAIL("mkdtemp");
        return;
    }
    size_t clen;
    const char *corpus = kv_bpe_default_corpus(&clen);
    kv_bpe_vocab v;
    kv_diag d = {0};
    ASSERT_EQ(kv_bpe_train(corpus, clen, "qwen2", 1200, &v, &d), 0);
    char path[256];
    snprintf(path, sizeof path, "%s/vocab.gguf", g_dir);
    ASSERT_EQ(write_vocab_gguf(path, &v, GV_OK), 0);
    kv_tok *t = NULL;
    ASSERT_EQ(load_file(path, &t, &d), 0);
    if (t) {
        ASSERT_EQ(kv_tok_n_vocab(t), 1200);
        ASSERT_EQ(kv_tok_eos(t), v.im_end_id);
        ASSERT_EQ(kv_tok_bos(t), v.eos_id);
        ASSERT_TRUE(!kv_tok_add_bos(t));
        ASSERT_TRUE(kv_tok_is_eog(t, v.im_end_id));
        ASSERT_TRUE(kv_tok_is_eog(t, v.eos_id));
        ASSERT_EQ(kv_tok_attr(t, v.im_start_id), KV_TOK_CONTROL);
    }

    static const struct {
        gv_kind kind;
        int code;
        const char *needle;
    } bad[] = {
        {GV_MODEL, KV_EUNSUPPORTED, "'llama'"},
        {GV_PRE, KV_EUNSUPPORTED, "'gpt-2'"},
        {GV_NO_PRE, KV_EUNSUPPORTED, "tokenizer.ggml.pre"},
        {GV_NO_MERGES, KV_EFORMAT, "tokenizer.ggml.merges"},
        {GV_NO_TOKENS, KV_EFORMAT, "tokenizer.ggml.tokens"},
        {GV_TYPES_F32, KV_EFORMAT, "token_type"},
        {GV_DUP, KV_EFORMAT, "duplicate"},
    };
    char bpath[256];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(bpath, sizeof bpath, "%s/bad%zu.gguf", g_dir, i);
        ASSERT_EQ(write_vocab_gguf(bpath, &v, bad[i].kind), 0);
        kv_tok *bt = NULL;
        memset(&d, 0, sizeof d);
        ASSERT_EQ(load_file(bpath, &bt, &d), bad[i].code);
        kvt_checks++;
        if (!strstr(d.msg, bad[i].needle)) KVT_FAIL("bad vocab %zu: message lacks '%s': %s", i, bad[i].needle, d.msg);
        ASSERT_TRUE(bt == NULL);
    }

    /* the CLI prints what the library computes */
    const char *bin = getenv("KV_BIN");
    if (!bin || access(bin, X_OK) != 0 || !t) {
        printf("skipping CLI checks (KV_BIN not set)\n");
    } else {
        static const char *texts[] = {"Hello, world! It's 2024.", "<|im_start|>user\nhi<|im_end|>\n",
                                      "  caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80\n\n\n  x"};
        char cmd[1024], out[8192], err[2048], want[8192];
        int32_t ids[512];
        for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
            for (int sp = 0; sp < 2; sp++) {
                char tf[256];
                snprintf(tf, sizeof tf, "%s/text%zu.txt", g_dir, i);
                FILE *f = fopen(tf, "wb");
                fwrite(texts[i], 1, strlen(texts[i]), f);
                fclose(f);
                size_t n = 0;
                ASSERT_EQ(kv_tok_encode(t, texts[i], strlen(texts[i]), sp, ids, 512, &n, &d), 0);
                ids_json(ids, n, want, sizeof want);
                /* the text from a file, from stdin, and (when the shell
                 * keeps it intact: no trailing newline) as TEXT */
                snprintf(cmd, sizeof cmd, "%s tokenize -m %s %s -f %s", bin, path, sp ? "" : "--no-special", tf);
                ASSERT_EQ(run_capture(cmd, out, sizeof out, err, sizeof err), 0);
                ASSERT_STREQ(out, want);
                if (texts[i][strlen(texts[i]) - 1] != '\n') {
                    snprintf(cmd, sizeof cmd, "%s tokenize -m %s %s \"$(cat %s)\"", bin, path,
                             sp ? "" : "--no-special", tf);
                    ASSERT_EQ(run_capture(cmd, out, sizeof out, err, sizeof err), 0);
                    ASSERT_STREQ(out, want);
                }
                snprintf(cmd, sizeof cmd, "%s tokenize %s -m %s -f - < %s", bin, sp ? "" : "--no-special", path, tf);
                ASSERT_EQ(run_capture(cmd, out, sizeof out, err, sizeof err), 0);
                ASSERT_STREQ(out, want);
            }
        }
        /* errors: one line, non-zero */
        static const struct {
            const char *args, *needle;
        } errs[] = {
            {"tokenize -m /nonexistent/model.gguf hi", "nonexistent"},
            {"tokenize hi", "-m"},
            {"tokenize -m X", "TEXT"},
            {"tokenize -m X --bogus hi", "--bogus"},
        };
        for (size_t i = 0; i < sizeof errs / sizeof errs[0]; i++) {
            snprintf(cmd, sizeof cmd, "%s %s", bin, errs[i].args);
            int st = run_capture(cmd, out, sizeof out, err, sizeof err);
            ASSERT_TRUE(st != 0 && st < 128);
            ASSERT_TRUE(strstr(err, errs[i].needle) != NULL);
            ASSERT_TRUE(strchr(err, '\n') == err + strlen(err) - 1);
        }
        snprintf(bpath, sizeof bpath, "%s/bad1.gguf", g_dir); /* pre gpt-2 */
        snprintf(cmd, sizeof cmd, "%s tokenize -m %s hi", bin, bpath);
        ASSERT_EQ(run_capture(cmd, out, sizeof out, err, sizeof err), 2);
        ASSERT_TRUE(strstr(err, "pre-tokenizer 'gpt-2' not supported") != NULL);
        snprintf(cmd, sizeof cmd, "%s tokenize --help", bin);
        ASSERT_EQ(run_capture(cmd, out, sizeof out, err, sizeof err), 0);
        ASSERT_TRUE(strstr(out, "--no-special") != NULL);
    }
    kv_tok_free(t);
    kv_bpe_vocab_free(&v);
    char rm[300];
    snprintf(rm, sizeof rm, "rm -rf %s", g_dir);
    if (system(rm) != 0) KVT_FAIL("cleanup");
}

static void test_chatml(void) {
    char *s = kv_tok_chatml("Be brief.", "Hi");
    ASSERT_STREQ(s, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    free(s);
    s = kv_tok_chatml(NULL, "Hi");
    ASSERT_STREQ(s, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    free(s);
}

static const kvt_case cases[] = {
    KVT_CASE(test_unicode),     KVT_CASE(test_byte_map), KVT_CASE(test_split),
    KVT_CASE(test_bpe),         KVT_CASE(test_vocab_rules), KVT_CASE(test_chatml),
    KVT_CASE(test_trainer),     KVT_CASE(test_gguf_and_cli),
};

int main(int argc, char **argv) { return kvt_run(argc, argv, cases, KVT_N(cases)); }
