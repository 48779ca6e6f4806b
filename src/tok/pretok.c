/* The qwen2 / qwen35 pre-tokenizer split: a hand-written matcher for
 *
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d) | [^\r\n\p{L}\p{N}]?\p{L}+ | \p{N}
 *   | ?[^\s\p{L}\p{N}]+[\r\n]* | \s*[\r\n]+ | \s+(?!\S) | \s+
 *
 * (qwen35: letters are [\p{L}\p{M}]+ and marks leave the punctuation run),
 * tried left to right at each position, first alternative that matches wins,
 * each alternative greedy. It behaves as llama.cpp's own fast path for these
 * two expressions (which is what the oracle runs), including its edge cases:
 * lookahead stops at the end of the fragment, and the contraction test folds
 * case only for ASCII letters (the only code points whose lowercase is one of
 * s t m d r v e l).
 *
 * Invariant: the returned word lengths are all > 0 and sum to n. Cost: O(n). */
#include "tok/tok_internal.h"

#include <string.h>

#define KV_NONE (-1) /* class of a position past the end */

int kv_pre_from_name(const char *name, size_t len) {
    /* Names llama.cpp maps to the same split and merge rules. */
    static const char *const qwen2[] = {"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"};
    for (size_t i = 0; i < sizeof qwen2 / sizeof qwen2[0]; i++)
        if (strlen(qwen2[i]) == len && !memcmp(qwen2[i], name, len)) return KV_PRE_QWEN2;
    if (len == 6 && !memcmp(name, "qwen35", 6)) return KV_PRE_QWEN35;
    return -1;
}

static uint32_t kv_ascii_lower(uint32_t c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

size_t kv_pretok_split(int pre, const uint32_t *cps, size_t n, uint32_t *lens) {
    const bool marks_are_letters = pre == KV_PRE_QWEN35;
    size_t nw = 0, pos = 0;
#define CLS(p) ((p) < n ? kv_uc_class(cps[p]) : KV_NONE)
#define CP(p) ((p) < n ? cps[p] : 0xFFFFFFFFu)
#define IS_WORDCH(k) ((k) == KV_UC_LETTER || (marks_are_letters && (k) == KV_UC_MARK))
    /* [^\s\p{L}\p{N}] (qwen35: also not \p{M}), and inside the fragment */
#define IS_PUNCT(k)                                                                      \
    ((k) != KV_NONE && (k) != KV_UC_SPACE && (k) != KV_UC_LETTER && (k) != KV_UC_NUMBER && \
     !(marks_are_letters && (k) == KV_UC_MARK))
    while (pos < n) {
        const size_t start = pos;
        const uint32_t c = cps[pos];
        const int k = kv_uc_class(c);

        /* 's 't 'm 'd 're 've 'll, either case */
        if (c == '\'' && pos + 1 < n) {
            uint32_t c1 = kv_ascii_lower(cps[pos + 1]);
            if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
                pos += 2;
                goto emit;
            }
            if (pos + 2 < n) {
                uint32_t c2 = kv_ascii_lower(cps[pos + 2]);
                if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
                    pos += 3;
                    goto emit;
                }
            }
        }

        /* [^\r\n\p{L}\p{N}]?\p{L}+ : one optional leading non-letter (anything
         * but CR, LF or a number) directly before a run of letters */
        if (c != '\r' && c != '\n' && k != KV_UC_NUMBER && (IS_WORDCH(k) || IS_WORDCH(CLS(pos + 1)))) {
            pos++;
            while (IS_WORDCH(CLS(pos))) pos++;
            goto emit;
        }

        /* \p{N} : one digit at a time */
        if (k == KV_UC_NUMBER) {
            pos++;
            goto emit;
        }

        /* ' ?[^\s\p{L}\p{N}]+[\r\n]*' ; a space at the very end also lands
         * here (and becomes a word of its own, as \s+ would make it) */
        {
            int k2 = c == ' ' ? CLS(pos + 1) : k;
            if (k2 == KV_NONE || IS_PUNCT(k2)) {
                if (c == ' ') pos++;
                while (IS_PUNCT(CLS(pos))) pos++;
                while (CP(pos) == '\r' || CP(pos) == '\n') pos++;
                goto emit;
            }
        }

        /* white space: \s*[\r\n]+ | \s+(?!\S) | \s+ */
        {
            size_t nsp = 0, end_rn = 0;
            while (CLS(pos + nsp) == KV_UC_SPACE) {
                if (cps[pos + nsp] == '\r' || cps[pos + nsp] == '\n') end_rn = pos + nsp + 1;
                nsp++;
            }
            if (end_rn) {
                pos = end_rn; /* up to the last CR/LF of the run */
            } else if (nsp > 1 && pos + nsp < n) {
                pos += nsp - 1; /* leave the last space to prefix the next word */
            } else if (nsp > 0) {
                pos += nsp;
            } else {
                pos++; /* nothing matched: the character alone */
            }
        }
    emit:
        lens[nw++] = (uint32_t)(pos - start);
    }
#undef CLS
#undef CP
#undef IS_WORDCH
#undef IS_PUNCT
    return nw;
}
