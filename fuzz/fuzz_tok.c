/* libFuzzer target for the tokenizer: arbitrary bytes (any UTF-8 validity,
 * special-token texts, long runs) are encoded with and without special
 * parsing under both pre-tokenizers, every id is checked to be in range,
 * and every piece is decoded. The vocabulary is trained once from the
 * bundled corpus with a few special tokens. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/tok.h"
#include "tok/tok_internal.h"

static kv_tok *g_tok[2];

static kv_tok *kv_fuzz_build(const char *pre_name, int pre) {
    size_t clen;
    const char *corpus = kv_bpe_default_corpus(&clen);
    kv_bpe_vocab v;
    kv_diag d = {0};
    if (kv_bpe_train(corpus, clen, pre_name, 1200, &v, &d)) abort();
    kv_str *toks = calloc(v.n_tokens, sizeof *toks), *merges = calloc(v.n_merges, sizeof *merges);
    for (size_t i = 0; i < v.n_tokens; i++) toks[i] = (kv_str){v.tokens[i], strlen(v.tokens[i])};
    for (size_t i = 0; i < v.n_merges; i++) merges[i] = (kv_str){v.merges[i], strlen(v.merges[i])};
    kv_tok_spec s;
    kv_tok_spec_init(&s);
    s.tokens = toks;
    s.n_tokens = v.n_tokens;
    s.types = v.types;
    s.merges = merges;
    s.n_merges = v.n_merges;
    s.pre = pre;
    s.eos = v.im_end_id;
    s.bos = v.eos_id;
    kv_tok *t = NULL;
    if (kv_tok_build(&t, &s, &d)) abort();
    free(toks);
    free(merges);
    kv_bpe_vocab_free(&v);
    return t;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_tok[0]) {
        g_tok[0] = kv_fuzz_build("qwen2", KV_PRE_QWEN2);
        g_tok[1] = kv_fuzz_build("qwen35", KV_PRE_QWEN35);
    }
    if (size > 1 << 16) return 0;
    /* an invalid byte becomes U+FFFD (3 bytes) before BPE, as in llama.cpp */
    const size_t cap = 3 * size + 1;
    int32_t *ids = malloc(cap * sizeof *ids);
    if (!ids) return 0;
    for (int k = 0; k < 2; k++) {
        const kv_tok *t = g_tok[k];
        for (int special = 0; special < 2; special++) {
            size_t n = 0;
            kv_diag d = {0};
            if (kv_tok_encode(t, (const char *)data, size, special, ids, cap, &n, &d)) abort();
            if (n > 3 * size) abort(); /* every token covers at least one byte of the cleaned text */
            for (size_t i = 0; i < n; i++) {
                if (ids[i] < 0 || ids[i] >= kv_tok_n_vocab(t)) abort();
                char buf[64];
                if (kv_tok_piece(t, ids[i], true, buf, sizeof buf) < 0) abort();
            }
        }
    }
    free(ids);
    return 0;
}
