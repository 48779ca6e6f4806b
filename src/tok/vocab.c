/* The vocabulary: building a kv_tok from GGUF metadata (or plain arrays),
 * token attributes, end-of-generation tokens, byte-level detokenization of
 * one token, and the ChatML prompt.
 *
 * What is mirrored from llama.cpp's loader, because it changes token ids or
 * text: the default special ids of a `gpt2` vocabulary (bos = eos = 11 when
 * the file names none), out-of-range ids ignored, empty token texts renamed
 * "[EMPTY_<id>]", tokens whose text marks an end of turn or a FIM role gaining
 * the CONTROL attribute, the end-of-generation set (the ids the file names
 * plus the tokens with well-known texts, with llama.cpp's two exceptions),
 * and the special-token list (CONTROL, USER_DEFINED and UNKNOWN tokens,
 * longest text first). Where llama.cpp would abort (duplicate token texts) or
 * throw while loading, we return KV_EFORMAT. Every count and length is
 * bounded (KV_TOK_MAX_VOCAB, KV_TOK_MAX_MERGES, KV_TOK_MAX_TOKEN_BYTES).
 *
 * Not mirrored: the LSTRIP/RSTRIP attributes llama.cpp sets by model name
 * (phi-3, jina-v2, modern-bert; none uses a qwen2 split), and, when two
 * tokens both look like the same FIM role, which one llama.cpp picks (it
 * walks a hash map; we take the lower id). Scores are not read (BPE ignores
 * them). */
#include "tok/tok_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- hash tables ------------------------------------------------------ */

static size_t kv_table_size(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    return cap;
}

static uint64_t kv_pair_hash(const char *l, size_t ll, const char *r, size_t rl) {
    uint64_t h = kv_hash_bytes(KV_HASH_SEED, l, ll);
    h ^= (uint64_t)ll * 0x9E3779B97F4A7C15ull;
    return kv_hash_bytes(h, r, rl);
}

int32_t kv_tok_lookup(const kv_tok *t, const char *s, size_t n) {
    size_t i = (size_t)kv_hash_bytes(KV_HASH_SEED, s, n) & t->vmask;
    for (;; i = (i + 1) & t->vmask) {
        int32_t id = t->vslot[i];
        if (id < 0) return -1;
        if (t->len[id] == n && !memcmp(t->blob + t->off[id], s, n)) return id;
    }
}

int32_t kv_tok_merge_rank(const kv_tok *t, const char *l, size_t ll, const char *r, size_t rl) {
    size_t i = (size_t)kv_pair_hash(l, ll, r, rl) & t->mmask;
    for (;; i = (i + 1) & t->mmask) {
        int32_t m = t->mslot[i];
        if (m < 0) return -1;
        const char *ml = t->mblob + t->moff[m];
        if (t->mll[m] == ll && t->mrl[m] == rl && !memcmp(ml, l, ll) &&
            !memcmp(ml + ll + 1, r, rl))
            return m;
    }
}

/* ---- small helpers ---------------------------------------------------- */

static bool kv_text_is(const kv_tok *t, int32_t id, const char *s) {
    size_t n = strlen(s);
    return t->len[id] == n && !memcmp(t->blob + t->off[id], s, n);
}

static bool kv_text_in(const kv_tok *t, int32_t id, const char *const *list, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (kv_text_is(t, id, list[i])) return true;
    return false;
}
#define KV_IN(t, id, list) kv_text_in(t, id, list, sizeof list / sizeof list[0])

static uint8_t kv_attr_of_type(int32_t type) {
    switch (type) {
    case KV_TOK_NORMAL: return KV_TA_NORMAL;
    case KV_TOK_UNKNOWN: return KV_TA_UNKNOWN;
    case KV_TOK_CONTROL: return KV_TA_CONTROL;
    case KV_TOK_USER_DEFINED: return KV_TA_USER_DEFINED;
    case KV_TOK_UNUSED: return KV_TA_UNUSED;
    case KV_TOK_BYTE: return KV_TA_BYTE;
    default: return KV_TA_UNDEFINED; /* 0 and unknown values */
    }
}

/* True if some code point of s decodes above U+10FFFF under llama.cpp's
 * decoder (it then throws while building its piece cache). */
static bool kv_has_huge_cp(const char *s, size_t n) {
    const uint8_t *u = (const uint8_t *)s;
    for (size_t i = 0; i + 3 < n; i++) {
        if ((u[i] & 0xF8) == 0xF0 && (u[i + 1] & 0xC0) == 0x80 && (u[i + 2] & 0xC0) == 0x80 &&
            (u[i + 3] & 0xC0) == 0x80) {
            uint32_t cp = ((u[i] & 7u) << 18) | ((u[i + 1] & 0x3Fu) << 12);
            if (cp > 0x10FFFF) return true;
        }
    }
    return false;
}

/* Texts llama.cpp recognises (llama-vocab.cpp, load): end of turn, FIM roles,
 * end of generation. */
static const char *const kv_eot_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<\xef\xbd\x9c" "end\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>",
    "<end_of_utterance>"};
static const char *const kv_eom_texts[] = {"<|eom_id|>"};
static const char *const kv_fim_pre_texts[] = {
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\xef\xbd\x9c" "fim\xe2\x96\x81" "begin\xef\xbd\x9c>",
    "<PRE>", "\xe2\x96\x81<PRE>", "<|code_prefix|>", "<|prefix|>"};
static const char *const kv_fim_suf_texts[] = {
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\xef\xbd\x9c" "fim\xe2\x96\x81" "hole\xef\xbd\x9c>",
    "<SUF>", "\xe2\x96\x81<SUF>", "<|code_suffix|>", "<|suffix|>"};
static const char *const kv_fim_mid_texts[] = {
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\xef\xbd\x9c" "fim\xe2\x96\x81" "end\xef\xbd\x9c>",
    "<MID>", "\xe2\x96\x81<MID>", "<|code_middle|>", "<|middle|>"};
static const char *const kv_fim_pad_texts[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"};
static const char *const kv_fim_rep_texts[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
                                               "<reponame>"};
static const char *const kv_fim_sep_texts[] = {"<|file_sep|>"};
static const char *const kv_eog_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\xef\xbd\x9c" "end\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>", "[e~["};
static const char *const kv_user_defined_texts[] = {"<|channel|>", "<|message|>", "<|start|>",
                                                    "<|constrain|>"};

/* If *id is unset, takes the first token (by id) whose text is in the list
 * and marks it CONTROL. (llama.cpp walks a hash map, so with two candidates
 * for one role its pick is unspecified; real vocabularies have one.) */
static void kv_autodetect(kv_tok *t, int32_t *id, const char *const *list, size_t n) {
    if (*id >= 0) return;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        if (kv_text_in(t, i, list, n)) {
            *id = i;
            t->attr[i] |= KV_TA_CONTROL;
            return;
        }
    }
}
#define KV_AUTODETECT(t, id, list) kv_autodetect(t, id, list, sizeof list / sizeof list[0])

static int kv_u64_cmp(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* ---- build ------------------------------------------------------------ */

void kv_tok_spec_init(kv_tok_spec *s) {
    memset(s, 0, sizeof *s);
    s->bos = s->eos = s->eot = s->eom = s->unk = s->pad = -1;
    s->fim_pre = s->fim_suf = s->fim_mid = s->fim_pad = s->fim_rep = s->fim_sep = -1;
    s->add_bos = -1;
}

void kv_tok_free(kv_tok *t) {
    if (!t) return;
    free(t->blob);
    free(t->off);
    free(t->len);
    free(t->attr);
    free(t->eog);
    free(t->vslot);
    free(t->mblob);
    free(t->moff);
    free(t->mll);
    free(t->mrl);
    free(t->mslot);
    free(t->special);
    free(t);
}

/* id from the file if in range, else the default (llama.cpp warns and keeps
 * the default for an out-of-range id). */
static int32_t kv_pick_id(int64_t file_id, int32_t def, int32_t n) {
    if (file_id >= 0 && file_id < n) return (int32_t)file_id;
    return def;
}

int kv_tok_build(kv_tok **out, const kv_tok_spec *s, kv_diag *d) {
    *out = NULL;
    if (s->pre < 0 || s->pre >= KV_PRE_COUNT) return kv_fail(d, KV_EINVAL, "tokenizer: bad pre-tokenizer");
    if (s->n_tokens == 0) return kv_fail(d, KV_EFORMAT, "tokenizer.ggml.tokens is empty");
    if (s->n_tokens > KV_TOK_MAX_VOCAB)
        return kv_fail(d, KV_EFORMAT, "tokenizer.ggml.tokens: %zu tokens, max %u", s->n_tokens,
                       KV_TOK_MAX_VOCAB);
    if (s->n_merges > KV_TOK_MAX_MERGES)
        return kv_fail(d, KV_EFORMAT, "tokenizer.ggml.merges: %zu merges, max %u", s->n_merges,
                       KV_TOK_MAX_MERGES);

    kv_tok *t = calloc(1, sizeof *t);
    if (!t) return kv_fail(d, KV_ENOMEM, "tokenizer: out of memory");
    int rc = KV_ENOMEM;
    const size_t n = s->n_tokens;
    t->pre = s->pre;
    t->n_vocab = (int32_t)n;

    /* token texts: bounded, empty ones renamed as llama.cpp does */
    size_t blob_len = 0;
    for (size_t i = 0; i < n; i++) {
        if (s->tokens[i].len > KV_TOK_MAX_TOKEN_BYTES) {
            rc = kv_fail(d, KV_EFORMAT, "tokenizer.ggml.tokens[%zu]: %zu bytes, max %u", i,
                         s->tokens[i].len, KV_TOK_MAX_TOKEN_BYTES);
            goto fail;
        }
        blob_len += (s->tokens[i].len ? s->tokens[i].len : 24) + 1;
    }
    t->blob = malloc(blob_len);
    t->off = malloc(n * sizeof *t->off);
    t->len = malloc(n * sizeof *t->len);
    t->attr = malloc(n);
    t->eog = calloc(n, 1);
    size_t vcap = kv_table_size(n);
    t->vslot = malloc(vcap * sizeof *t->vslot);
    if (!t->blob || !t->off || !t->len || !t->attr || !t->eog || !t->vslot) goto oom;
    t->vmask = vcap - 1;
    memset(t->vslot, 0xff, vcap * sizeof *t->vslot);
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        t->off[i] = at;
        if (s->tokens[i].len) {
            memcpy(t->blob + at, s->tokens[i].ptr, s->tokens[i].len);
            t->len[i] = (uint32_t)s->tokens[i].len;
        } else {
            t->len[i] = (uint32_t)snprintf(t->blob + at, 25, "[EMPTY_%zu]", i);
        }
        t->blob[at + t->len[i]] = '\0';
        at += t->len[i] + 1;
        t->attr[i] = s->types ? kv_attr_of_type(s->types[i]) : KV_TA_NORMAL;

        const char *txt = t->blob + t->off[i];
        if (kv_tok_lookup(t, txt, t->len[i]) >= 0) {
            rc = kv_fail(d, KV_EFORMAT, "tokenizer.ggml.tokens[%zu]: duplicate of token %d",
                         i, kv_tok_lookup(t, txt, t->len[i]));
            goto fail;
        }
        size_t h = (size_t)kv_hash_bytes(KV_HASH_SEED, txt, t->len[i]) & t->vmask;
        while (t->vslot[h] >= 0) h = (h + 1) & t->vmask;
        t->vslot[h] = (int32_t)i;

        if ((t->attr[i] & KV_TA_NORMAL) && kv_has_huge_cp(txt, t->len[i])) {
            rc = kv_fail(d, KV_EFORMAT, "tokenizer.ggml.tokens[%zu]: code point above U+10FFFF", i);
            goto fail;
        }
        if ((t->attr[i] & KV_TA_BYTE) && t->len[i] < 3) {
            rc = kv_fail(d, KV_EFORMAT, "tokenizer.ggml.tokens[%zu]: byte token '%s' too short", i, txt);
            goto fail;
        }
    }

    /* merges: "left right", split at the first space after the first byte;
     * without one, both halves are empty (as in llama.cpp). The first of
     * duplicate merges keeps its rank. */
    size_t mblob_len = 0;
    for (size_t i = 0; i < s->n_merges; i++) {
        if (s->merges[i].len > 2 * (size_t)KV_TOK_MAX_TOKEN_BYTES + 1) {
            rc = kv_fail(d, KV_EFORMAT, "tokenizer.ggml.merges[%zu]: %zu bytes, max %u", i,
                         s->merges[i].len, 2 * KV_TOK_MAX_TOKEN_BYTES + 1);
            goto fail;
        }
        mblob_len += s->merges[i].len + 2;
    }
    size_t mcap = kv_table_size(s->n_merges);
    t->mblob = malloc(mblob_len ? mblob_len : 1);
    t->moff = malloc((s->n_merges ? s->n_merges : 1) * sizeof *t->moff);
    t->mll = malloc((s->n_merges ? s->n_merges : 1) * sizeof *t->mll);
    t->mrl = malloc((s->n_merges ? s->n_merges : 1) * sizeof *t->mrl);
    t->mslot = malloc(mcap * sizeof *t->mslot);
    if (!t->mblob || !t->moff || !t->mll || !t->mrl || !t->mslot) goto oom;
    t->mmask = mcap - 1;
    memset(t->mslot, 0xff, mcap * sizeof *t->mslot);
    at = 0;
    for (size_t i = 0; i < s->n_merges; i++) {
        const char *m = s->merges[i].ptr;
        size_t ml = s->merges[i].len, sp = 0;
        for (size_t k = 1; k < ml; k++)
            if (m[k] == ' ') {
                sp = k;
                break;
            }
        size_t ll = sp ? sp : 0, rl = sp ? ml - sp - 1 : 0;
        t->moff[i] = at;
        t->mll[i] = (uint32_t)ll;
        t->mrl[i] = (uint32_t)rl;
        memcpy(t->mblob + at, m, ll);
        t->mblob[at + ll] = '\0';
        if (rl) memcpy(t->mblob + at + ll + 1, m + sp + 1, rl);
        t->mblob[at + ll + 1 + rl] = '\0';
        at += ll + rl + 2;
        t->n_merges = i + 1;
        if (kv_tok_merge_rank(t, t->mblob + t->moff[i], ll, t->mblob + t->moff[i] + ll + 1, rl) >= 0)
            continue; /* duplicate: the earlier rank stands */
        size_t h = (size_t)kv_pair_hash(t->mblob + t->moff[i], ll, t->mblob + t->moff[i] + ll + 1, rl) &
                   t->mmask;
        while (t->mslot[h] >= 0) h = (h + 1) & t->mmask;
        t->mslot[h] = (int32_t)i;
    }

    /* special ids: a gpt2 vocabulary defaults to bos = eos = 11 */
    const int32_t nv = t->n_vocab;
    int32_t def11 = nv > 11 ? 11 : -1;
    t->bos = kv_pick_id(s->bos, def11, nv);
    t->eos = kv_pick_id(s->eos, def11, nv);
    t->eot = kv_pick_id(s->eot, -1, nv);
    t->eom = kv_pick_id(s->eom, -1, nv);
    t->unk = kv_pick_id(s->unk, -1, nv);
    t->pad = kv_pick_id(s->pad, -1, nv);
    int32_t fim_pre = kv_pick_id(s->fim_pre, -1, nv), fim_suf = kv_pick_id(s->fim_suf, -1, nv);
    int32_t fim_mid = kv_pick_id(s->fim_mid, -1, nv), fim_pad = kv_pick_id(s->fim_pad, -1, nv);
    int32_t fim_rep = kv_pick_id(s->fim_rep, -1, nv), fim_sep = kv_pick_id(s->fim_sep, -1, nv);
    t->add_bos = s->add_bos > 0; /* gpt2 vocabularies default to no BOS */

    /* tokens recognised by their text */
    KV_AUTODETECT(t, &t->eot, kv_eot_texts);
    KV_AUTODETECT(t, &t->eom, kv_eom_texts);
    KV_AUTODETECT(t, &fim_pre, kv_fim_pre_texts);
    KV_AUTODETECT(t, &fim_suf, kv_fim_suf_texts);
    KV_AUTODETECT(t, &fim_mid, kv_fim_mid_texts);
    KV_AUTODETECT(t, &fim_pad, kv_fim_pad_texts);
    KV_AUTODETECT(t, &fim_rep, kv_fim_rep_texts);
    KV_AUTODETECT(t, &fim_sep, kv_fim_sep_texts);

    /* control tokens named "unused" are unused (as llama.cpp marks them) */
    for (int32_t i = 0; i < nv; i++)
        if ((t->attr[i] & KV_TA_CONTROL) && strstr(t->blob + t->off[i], "unused")) t->attr[i] |= KV_TA_UNUSED;

    /* end of generation */
    if (fim_pad >= 0) t->eog[fim_pad] = 1;
    if (fim_rep >= 0) t->eog[fim_rep] = 1;
    if (fim_sep >= 0) t->eog[fim_sep] = 1;
    for (int32_t i = 0; i < nv; i++) {
        if (KV_IN(t, i, kv_eog_texts)) {
            t->eog[i] = 1;
            t->attr[i] |= KV_TA_CONTROL;
        }
    }
    for (int32_t i = 0; i < nv; i++)
        if (KV_IN(t, i, kv_user_defined_texts)) t->attr[i] = KV_TA_USER_DEFINED;
    if (t->eos >= 0) t->eog[t->eos] = 1;
    if (t->eot >= 0) t->eog[t->eot] = 1;
    if (t->eom >= 0) t->eog[t->eom] = 1;
    {
        /* <|end|> is not an end of generation next to <|return|>/<|call|>
         * (harmony) or <|calls|>/<|flush|> (solar-open); </s> is not one next
         * to <|tool_response>. */
        bool has_return = false, has_call = false, has_flush = false, has_tool_response = false;
        int32_t end_id = -1, s_id = -1;
        for (int32_t i = 0; i < nv; i++) {
            if (!t->eog[i]) continue;
            if (kv_text_is(t, i, "<|return|>")) has_return = true;
            else if (kv_text_is(t, i, "<|call|>") || kv_text_is(t, i, "<|calls|>")) has_call = true;
            else if (kv_text_is(t, i, "<|flush|>")) has_flush = true;
            else if (kv_text_is(t, i, "<|end|>")) end_id = i;
            if (kv_text_is(t, i, "<|tool_response>")) has_tool_response = true;
            else if (kv_text_is(t, i, "</s>")) s_id = i;
        }
        if (end_id >= 0 && ((has_return && has_call) || (has_call && has_flush))) {
            t->eog[end_id] = 0;
            t->attr[end_id] = KV_TA_USER_DEFINED;
        }
        if (has_tool_response && s_id >= 0) {
            t->eog[s_id] = 0;
            t->attr[s_id] = KV_TA_NORMAL;
        }
    }

    /* special tokens, longest text first (ties by id; llama.cpp's sort leaves
     * ties unordered, which only matters for two equally long texts that
     * overlap in the input) */
    size_t ns = 0;
    for (int32_t i = 0; i < nv; i++)
        if (t->attr[i] & (KV_TA_CONTROL | KV_TA_USER_DEFINED | KV_TA_UNKNOWN)) ns++;
    t->special = malloc((ns ? ns : 1) * sizeof *t->special);
    uint64_t *keys = malloc((ns ? ns : 1) * sizeof *keys);
    if (!t->special || !keys) {
        free(keys);
        goto oom;
    }
    for (int32_t i = 0; i < nv; i++) /* key: (longer first, then lower id) */
        if (t->attr[i] & (KV_TA_CONTROL | KV_TA_USER_DEFINED | KV_TA_UNKNOWN))
            keys[t->n_special++] = ((uint64_t)(UINT32_MAX - t->len[i]) << 32) | (uint32_t)i;
    qsort(keys, t->n_special, sizeof *keys, kv_u64_cmp);
    for (size_t i = 0; i < t->n_special; i++) t->special[i] = (int32_t)(keys[i] & 0xffffffffu);
    free(keys);

    *out = t;
    return 0;
oom:
    rc = kv_fail(d, KV_ENOMEM, "tokenizer: out of memory");
fail:
    kv_tok_free(t);
    return rc;
}

/* ---- load from GGUF --------------------------------------------------- */

static int kv_get_id(const kv_gguf *g, const char *key, int64_t *out, kv_diag *d) {
    uint32_t v;
    int rc = kv_gguf_get_u32(g, key, &v, d);
    if (rc == KV_ENOTFOUND) return 0;
    if (rc) return rc;
    *out = v;
    return 0;
}

static int kv_get_str_array(const kv_gguf *g, const char *key, size_t max, kv_str **out, size_t *n,
                            kv_diag *d) {
    *out = NULL;
    *n = 0;
    const kv_gguf_kv *kv = kv_gguf_find_kv(g, key);
    if (!kv) return KV_ENOTFOUND;
    if (kv->val.type != KV_GGUF_ARRAY || kv->val.v.arr.elem_type != KV_GGUF_STRING)
        return kv_fail(d, KV_EFORMAT, "%s: expected an array of strings", key);
    uint64_t cnt = kv->val.v.arr.n;
    if (cnt > max) return kv_fail(d, KV_EFORMAT, "%s: %llu entries, max %zu", key, (unsigned long long)cnt, max);
    kv_str *a = malloc((cnt ? cnt : 1) * sizeof *a);
    if (!a) return kv_fail(d, KV_ENOMEM, "%s: out of memory", key);
    size_t pos = 0;
    for (uint64_t i = 0; i < cnt; i++) {
        if (kv_gguf_arr_str_iter(&kv->val, &pos, &a[i]) != 0) {
            free(a);
            return kv_fail(d, KV_EFORMAT, "%s: entry %llu unreadable", key, (unsigned long long)i);
        }
    }
    *out = a;
    *n = (size_t)cnt;
    return 0;
}

int kv_tok_load(kv_tok **out, const kv_gguf *g, kv_diag *d) {
    *out = NULL;
    kv_tok_spec s;
    kv_tok_spec_init(&s);
    kv_str model, pre;
    int rc = kv_gguf_get_str(g, "tokenizer.ggml.model", &model, d);
    if (rc == KV_ENOTFOUND) return kv_fail(d, KV_EFORMAT, "no tokenizer in file (tokenizer.ggml.model missing)");
    if (rc) return rc;
    if (!kv_str_eq(model, "gpt2"))
        return kv_fail(d, KV_EUNSUPPORTED, "tokenizer model '%.*s' not supported (only gpt2)",
                       (int)(model.len > 64 ? 64 : model.len), model.ptr);
    rc = kv_gguf_get_str(g, "tokenizer.ggml.pre", &pre, d);
    if (rc == KV_ENOTFOUND)
        return kv_fail(d, KV_EUNSUPPORTED, "pre-tokenizer 'default' (tokenizer.ggml.pre missing) not supported "
                                           "(only qwen2, qwen35)");
    if (rc) return rc;
    s.pre = kv_pre_from_name(pre.ptr, pre.len);
    if (s.pre < 0)
        return kv_fail(d, KV_EUNSUPPORTED, "pre-tokenizer '%.*s' not supported (only qwen2, qwen35)",
                       (int)(pre.len > 64 ? 64 : pre.len), pre.ptr);

    kv_str *tokens = NULL, *merges = NULL;
    rc = kv_get_str_array(g, "tokenizer.ggml.tokens", KV_TOK_MAX_VOCAB, &tokens, &s.n_tokens, d);
    if (rc == KV_ENOTFOUND) rc = kv_fail(d, KV_EFORMAT, "tokenizer.ggml.tokens missing");
    if (rc) goto done;
    rc = kv_get_str_array(g, "tokenizer.ggml.merges", KV_TOK_MAX_MERGES, &merges, &s.n_merges, d);
    if (rc == KV_ENOTFOUND) rc = kv_fail(d, KV_EFORMAT, "tokenizer.ggml.merges missing");
    if (rc) goto done;
    s.tokens = tokens;
    s.merges = merges;

    int32_t *types = NULL;
    const kv_gguf_kv *tt = kv_gguf_find_kv(g, "tokenizer.ggml.token_type");
    if (tt) {
        if (tt->val.type != KV_GGUF_ARRAY || tt->val.v.arr.elem_type != KV_GGUF_INT32) {
            rc = kv_fail(d, KV_EFORMAT, "tokenizer.ggml.token_type: expected an array of int32");
            goto done;
        }
        if (tt->val.v.arr.n < s.n_tokens) {
            rc = kv_fail(d, KV_EFORMAT, "tokenizer.ggml.token_type: %llu entries for %zu tokens",
                         (unsigned long long)tt->val.v.arr.n, s.n_tokens);
            goto done;
        }
        types = malloc(s.n_tokens * sizeof *types);
        if (!types) {
            rc = kv_fail(d, KV_ENOMEM, "tokenizer: out of memory");
            goto done;
        }
        const uint8_t *p = tt->val.v.arr.data;
        for (size_t i = 0; i < s.n_tokens; i++)
            types[i] = (int32_t)((uint32_t)p[4 * i] | (uint32_t)p[4 * i + 1] << 8 |
                                 (uint32_t)p[4 * i + 2] << 16 | (uint32_t)p[4 * i + 3] << 24);
        s.types = types;
    }

    static const struct {
        const char *key;
        size_t field;
    } ids[] = {
        {"tokenizer.ggml.bos_token_id", offsetof(kv_tok_spec, bos)},
        {"tokenizer.ggml.eos_token_id", offsetof(kv_tok_spec, eos)},
        {"tokenizer.ggml.eot_token_id", offsetof(kv_tok_spec, eot)},
        {"tokenizer.ggml.eom_token_id", offsetof(kv_tok_spec, eom)},
        {"tokenizer.ggml.unknown_token_id", offsetof(kv_tok_spec, unk)},
        {"tokenizer.ggml.padding_token_id", offsetof(kv_tok_spec, pad)},
        {"tokenizer.ggml.fim_pre_token_id", offsetof(kv_tok_spec, fim_pre)},
        {"tokenizer.ggml.fim_suf_token_id", offsetof(kv_tok_spec, fim_suf)},
        {"tokenizer.ggml.fim_mid_token_id", offsetof(kv_tok_spec, fim_mid)},
        {"tokenizer.ggml.fim_pad_token_id", offsetof(kv_tok_spec, fim_pad)},
        {"tokenizer.ggml.fim_rep_token_id", offsetof(kv_tok_spec, fim_rep)},
        {"tokenizer.ggml.fim_sep_token_id", offsetof(kv_tok_spec, fim_sep)},
        /* deprecated names of the FIM ids, read after (and so over) them */
        {"tokenizer.ggml.prefix_token_id", offsetof(kv_tok_spec, fim_pre)},
        {"tokenizer.ggml.suffix_token_id", offsetof(kv_tok_spec, fim_suf)},
        {"tokenizer.ggml.middle_token_id", offsetof(kv_tok_spec, fim_mid)},
    };
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++) {
        int64_t *field = (int64_t *)((char *)&s + ids[i].field);
        int64_t v = -1;
        rc = kv_get_id(g, ids[i].key, &v, d);
        if (rc) goto done_types;
        /* an out-of-range id leaves the earlier value (llama.cpp warns) */
        if (v >= 0 && (size_t)v < s.n_tokens) *field = v;
    }
    bool add_bos;
    rc = kv_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &add_bos, d);
    if (rc == 0)
        s.add_bos = add_bos;
    else if (rc != KV_ENOTFOUND)
        goto done_types;
    rc = kv_tok_build(out, &s, d);
done_types:
    free(types);
done:
    free(tokens);
    free(merges);
    return rc;
}

/* ---- accessors -------------------------------------------------------- */

int32_t kv_tok_n_vocab(const kv_tok *t) { return t->n_vocab; }
int32_t kv_tok_bos(const kv_tok *t) { return t->bos; }
int32_t kv_tok_eos(const kv_tok *t) { return t->eos; }
bool kv_tok_add_bos(const kv_tok *t) { return t->add_bos; }
int kv_tok_pre(const kv_tok *t) { return t->pre; }

bool kv_tok_is_eog(const kv_tok *t, int32_t id) {
    return id >= 0 && id < t->n_vocab && t->eog[id];
}

int kv_tok_attr(const kv_tok *t, int32_t id) {
    if (id < 0 || id >= t->n_vocab) return 0;
    uint8_t a = t->attr[id];
    if (a & KV_TA_USER_DEFINED) return KV_TOK_USER_DEFINED;
    if (a & KV_TA_CONTROL) return KV_TOK_CONTROL;
    if (a & KV_TA_UNKNOWN) return KV_TOK_UNKNOWN;
    if (a & KV_TA_BYTE) return KV_TOK_BYTE;
    if (a & KV_TA_UNUSED) return KV_TOK_UNUSED;
    if (a & KV_TA_NORMAL) return KV_TOK_NORMAL;
    return 0;
}

int32_t kv_tok_find(const kv_tok *t, const char *s) { return kv_tok_lookup(t, s, strlen(s)); }

const char *kv_tok_text(const kv_tok *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->n_vocab) return NULL;
    if (len) *len = t->len[id];
    return t->blob + t->off[id];
}

/* ---- detokenize ------------------------------------------------------- */

/* Appends to buf while room remains, always counting. */
typedef struct {
    char *buf;
    size_t cap, n;
} kv_out;

static void kv_put(kv_out *o, const void *p, size_t n) {
    if (o->n < o->cap) {
        size_t room = o->cap - o->n;
        memcpy(o->buf + o->n, p, n < room ? n : room);
    }
    o->n += n;
}

int kv_tok_piece(const kv_tok *t, int32_t id, bool special, char *buf, size_t cap) {
    if (id < 0 || id >= t->n_vocab) return -1;
    const uint8_t a = t->attr[id];
    const char *txt = t->blob + t->off[id];
    const size_t len = t->len[id];
    kv_out o = {buf, cap, 0};
    if (a & (KV_TA_UNKNOWN | KV_TA_CONTROL)) {
        if (special) kv_put(&o, txt, len);
    } else if (a & KV_TA_USER_DEFINED) {
        kv_put(&o, txt, len);
    } else if (a & KV_TA_NORMAL) {
        /* byte-level decode: each character stands for one byte; a character
         * outside the map is spelled out the way llama.cpp does */
        uint32_t cps[KV_TOK_MAX_TOKEN_BYTES];
        size_t ncp = kv_utf8_decode((const uint8_t *)txt, len, cps);
        for (size_t i = 0; i < ncp; i++) {
            int b = kv_cp_to_byte(cps[i]);
            if (b >= 0) {
                char c = (char)b;
                kv_put(&o, &c, 1);
            } else {
                uint8_t u[4];
                int un = kv_utf8_encode(cps[i], u);
                char hex[16];
                kv_put(&o, "[UNK_BYTE_0x", 12);
                for (int k = 0; k < un; k++) {
                    snprintf(hex, sizeof hex, "%02x", u[k]);
                    kv_put(&o, hex, 2);
                }
                kv_put(&o, txt, len);
                kv_put(&o, "]", 1);
            }
        }
    } else if (a & KV_TA_BYTE) {
        /* "<0xAB>": hex digits at 3..4 */
        char hex[3] = {0, 0, 0};
        memcpy(hex, txt + 3, len - 3 < 2 ? len - 3 : 2);
        char c = (char)strtol(hex, NULL, 16);
        kv_put(&o, &c, 1);
    }
    /* UNUSED and UNDEFINED tokens have no text */
    if (o.n > (size_t)0x7fffffff) return 0x7fffffff;
    return (int)o.n;
}

/* ---- chat template ---------------------------------------------------- */

char *kv_tok_chatml(const char *system, const char *user) {
    const char *u = user ? user : "";
    size_t n = strlen(u) + 64 + (system ? strlen(system) + 40 : 0);
    char *s = malloc(n);
    if (!s) return NULL;
    size_t at = 0;
    if (system)
        at += (size_t)snprintf(s + at, n - at, "<|im_start|>system\n%s<|im_end|>\n", system);
    snprintf(s + at, n - at, "<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n", u);
    return s;
}

static bool kv_chat_role_ok(const char *r) {
    return r && (!strcmp(r, "system") || !strcmp(r, "user") || !strcmp(r, "assistant"));
}

char *kv_tok_chatml_msgs(const kv_chat_msg *m, size_t n, bool add_assistant) {
    size_t cap = 32;
    for (size_t i = 0; i < n; i++) {
        if (!kv_chat_role_ok(m[i].role)) return NULL;
        if (m[i].len > SIZE_MAX / 2 - cap) return NULL;
        cap += m[i].len + 48;
    }
    char *s = malloc(cap);
    if (!s) return NULL;
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        at += (size_t)snprintf(s + at, cap - at, "<|im_start|>%s\n", m[i].role);
        if (m[i].len) memcpy(s + at, m[i].content, m[i].len);
        at += m[i].len;
        at += (size_t)snprintf(s + at, cap - at, "<|im_end|>\n");
    }
    if (add_assistant) at += (size_t)snprintf(s + at, cap - at, "<|im_start|>assistant\n");
    s[at] = 0;
    return s;
}

/* Appends the plain-text ids of len bytes at ids[*at...]; counts past cap. */
static int kv_chat_frag(const kv_tok *t, const char *txt, size_t len, int32_t *ids, size_t cap, size_t *at,
                        kv_diag *d) {
    if (!len) return 0;
    size_t n = 0, room = *at < cap ? cap - *at : 0;
    int rc = kv_tok_encode(t, txt, len, false, room ? ids + *at : NULL, room, &n, d);
    if (rc && rc != KV_ERANGE) return rc;
    *at += n;
    return 0;
}

int kv_tok_encode_chatml(const kv_tok *t, const kv_chat_msg *m, size_t n, bool add_assistant,
                         int32_t *ids, size_t cap, size_t *n_out, kv_diag *d) {
    *n_out = 0;
    const int32_t im_start = kv_tok_find(t, "<|im_start|>"), im_end = kv_tok_find(t, "<|im_end|>");
    if (im_start < 0 || im_end < 0)
        return kv_fail(d, KV_EUNSUPPORTED, "chat template: the vocabulary has no <|im_start|>/<|im_end|>");
    size_t at = 0;
    int rc;
    for (size_t i = 0; i <= n; i++) {
        if (i == n && !add_assistant) break;
        const char *role = i < n ? m[i].role : "assistant";
        if (!kv_chat_role_ok(role))
            return kv_fail(d, KV_EINVAL, "chat template: message %zu has role '%.32s', not system, user or assistant",
                           i, role ? role : "(none)");
        if (at < cap) ids[at] = im_start;
        at++;
        /* "ROLE\nCONTENT" is one fragment between specials, as parse_special splits it */
        const size_t rl = strlen(role), cl = i < n ? m[i].len : 0;
        char *frag = malloc(rl + 1 + cl);
        if (!frag) return kv_fail(d, KV_ENOMEM, "chat template: out of memory");
        memcpy(frag, role, rl);
        frag[rl] = '\n';
        if (cl) memcpy(frag + rl + 1, m[i].content, cl);
        rc = kv_chat_frag(t, frag, rl + 1 + cl, ids, cap, &at, d);
        free(frag);
        if (rc) return rc;
        if (i == n) break;
        if (at < cap) ids[at] = im_end;
        at++;
        if ((rc = kv_chat_frag(t, "\n", 1, ids, cap, &at, d))) return rc;
    }
    *n_out = at;
    if (at > cap) return kv_fail(d, KV_ERANGE, "chat template: %zu tokens, room for %zu", at, cap);
    return 0;
}
