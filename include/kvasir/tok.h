/* Tokenizer from GGUF metadata: `gpt2`-type byte-level BPE with the qwen2
 * (and qwen35) pre-tokenizer split, merges by rank, special tokens, and
 * detokenization that round-trips bytes. Behaviour mirrors llama.cpp's
 * llama-vocab so token ids match on the same file.
 *
 * Also the BPE trainer that `gen-model` uses to build a real vocabulary from
 * text bundled in the repository. */
#ifndef KVASIR_TOK_H
#define KVASIR_TOK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/gguf.h"

#define KV_TOK_MAX_VOCAB (1u << 22)   /* tokens accepted from a file */
#define KV_TOK_MAX_TOKEN_BYTES 4096u  /* bytes in one token's text */

/* A tokenizer is immutable once loaded: every function below that takes a
 * const kv_tok * may be called from several threads at once. */
typedef struct kv_tok kv_tok;

/* Token types as stored in tokenizer.ggml.token_type (llama.cpp values). */
enum kv_tok_attr {
    KV_TOK_NORMAL = 1,
    KV_TOK_UNKNOWN = 2,
    KV_TOK_CONTROL = 3,
    KV_TOK_USER_DEFINED = 4,
    KV_TOK_UNUSED = 5,
    KV_TOK_BYTE = 6
};

/* Builds a tokenizer from g's tokenizer.* metadata (copies what it needs; g
 * may be closed afterwards). Errors: KV_EUNSUPPORTED for a tokenizer model or
 * pre-tokenizer we do not implement (named), KV_EFORMAT for malformed
 * vocab/merges/ids. Free with kv_tok_free (accepts NULL). */
int kv_tok_load(kv_tok **out, const kv_gguf *g, kv_diag *d);
void kv_tok_free(kv_tok *t);

int32_t kv_tok_n_vocab(const kv_tok *t);
int32_t kv_tok_bos(const kv_tok *t);   /* -1 if none */
int32_t kv_tok_eos(const kv_tok *t);   /* -1 if none */
bool kv_tok_add_bos(const kv_tok *t);  /* tokenizer.ggml.add_bos_token */
/* End-of-generation: eos, eot, <|im_end|>, <|endoftext|> and the like. */
bool kv_tok_is_eog(const kv_tok *t, int32_t id);
int kv_tok_attr(const kv_tok *t, int32_t id); /* enum kv_tok_attr, 0 if out of range */
/* Id of a token whose text is exactly s, or -1. */
int32_t kv_tok_find(const kv_tok *t, const char *s);

/* Encodes len bytes of text (any bytes; invalid UTF-8 handled as llama.cpp
 * does). With parse_special, control/user-defined token texts in the input
 * become their ids; without, they are tokenized as plain text. Does not add
 * BOS (callers do so when kv_tok_add_bos). Writes up to cap ids; *n gets the
 * full count (if > cap, nothing useful was truncated silently: returns
 * KV_ERANGE with *n the needed size). */
int kv_tok_encode(const kv_tok *t, const char *text, size_t len, bool parse_special,
                  int32_t *ids, size_t cap, size_t *n, kv_diag *d);

/* A byte range of a text. */
typedef struct kv_tok_span {
    size_t off, len;
} kv_tok_span;

/* kv_tok_encode, except that a control or unknown token's text that
 * overlaps one of the n_plain spans of text is not that token but plain
 * text (as without parse_special): a chat template's rendering tokenized
 * with its own special tokens while a client's content, where it appears,
 * cannot inject one. plain may be NULL when n_plain is 0. */
int kv_tok_encode_spans(const kv_tok *t, const char *text, size_t len, bool parse_special, const kv_tok_span *plain,
                        size_t n_plain, int32_t *ids, size_t cap, size_t *n, kv_diag *d);
/* Whether len bytes of text hold the text of a control or unknown token. */
bool kv_tok_has_special(const kv_tok *t, const char *text, size_t len);

/* Bytes of one token as generated text (byte-level decoded; control tokens
 * give their text only if `special`). Writes up to cap bytes; returns the
 * byte count, or -1 for an id out of range. If the result exceeds cap, the
 * return value is the needed size and buf holds a prefix. */
int kv_tok_piece(const kv_tok *t, int32_t id, bool special, char *buf, size_t cap);

/* ChatML prompt for one user message (and optional system message):
 * "<|im_start|>system\n...<|im_end|>\n<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n".
 * Returns a malloc'd NUL-terminated string (caller frees) or NULL on OOM. */
char *kv_tok_chatml(const char *system, const char *user);

/* One message of a conversation: role is "system", "user" or "assistant". */
typedef struct kv_chat_msg {
    const char *role;
    const char *content;   /* len bytes (need not be NUL-terminated) */
    size_t len;
} kv_chat_msg;

/* ChatML for a list of messages, in order: each as
 * "<|im_start|>ROLE\nCONTENT<|im_end|>\n", then "<|im_start|>assistant\n"
 * when add_assistant (the generation prompt). kv_tok_chatml(s, u) is this
 * for {system s (if any), user u}. Returns a malloc'd NUL-terminated string
 * (caller frees), or NULL on OOM or a role outside the three. */
char *kv_tok_chatml_msgs(const kv_chat_msg *m, size_t n, bool add_assistant);
/* Token ids of the same template, with <|im_start|> and <|im_end|> as their
 * special ids and every role and content encoded as plain text (special
 * token texts inside a message stay text: a client cannot inject control
 * tokens). For content free of special token texts the ids equal
 * kv_tok_encode(kv_tok_chatml_msgs(...), parse_special = true). Does not add
 * BOS. Writes up to cap ids; *n_out gets the full count. Errors: KV_EINVAL
 * (a role outside the three), KV_EUNSUPPORTED (the vocabulary has no
 * <|im_start|>/<|im_end|>), KV_ERANGE (*n_out > cap), KV_ENOMEM. */
int kv_tok_encode_chatml(const kv_tok *t, const kv_chat_msg *m, size_t n, bool add_assistant,
                         int32_t *ids, size_t cap, size_t *n_out, kv_diag *d);

/* ---- BPE training (for synthetic models) ---------------------------- */

/* A trained byte-level BPE vocabulary, in GGUF form. */
typedef struct kv_bpe_vocab {
    char **tokens;     /* [n_tokens] NUL-terminated, byte-level-unicode encoded */
    int32_t *types;    /* [n_tokens] enum kv_tok_attr */
    size_t n_tokens;
    char **merges;     /* [n_merges] "left right" in the same encoding */
    size_t n_merges;
    int32_t eos_id;    /* <|endoftext|> */
    int32_t im_start_id, im_end_id;
} kv_bpe_vocab;

/* Learns a vocabulary of exactly n_vocab tokens from corpus text, split by
 * the pre-tokenizer `pre` ("qwen2" or "qwen35"): 256 byte tokens, merges
 * in learned order (pairs occurring at least twice), then the special tokens
 * <|endoftext|>, <|im_start|>, <|im_end|> (CONTROL). If the corpus cannot
 * yield enough merges, the rest is padded, as real Qwen GGUFs are, with
 * "[PAD<id>]" tokens of type UNUSED (never produced by tokenizing, empty when
 * detokenized, loaded by llama.cpp without warnings), so the count is exact.
 * Every merge's parts and result are tokens; token texts are unique.
 * Deterministic. Errors: KV_EUNSUPPORTED (pre), KV_EINVAL (n_vocab < 259 or
 * > KV_TOK_MAX_VOCAB), KV_ENOMEM. On success the caller frees *out with
 * kv_bpe_vocab_free (also safe after an error). */
int kv_bpe_train(const char *corpus, size_t len, const char *pre, size_t n_vocab,
                 kv_bpe_vocab *out, kv_diag *d);
void kv_bpe_vocab_free(kv_bpe_vocab *v);

/* The corpus bundled with Kvasir (data/corpus.txt compiled in). */
const char *kv_bpe_default_corpus(size_t *len);

#endif
