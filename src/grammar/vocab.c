/* The vocabulary side of constrained sampling: every token's piece copied
 * once, and a byte trie over the pieces laid out in preorder (a subtree is a
 * contiguous range of nodes and of tokens), so kv_grammar_mask walks it
 * with a small explicit stack, drops a whole subtree when its prefix fails,
 * and takes a whole subtree whose bytes cannot change the grammar's state. */
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_internal.h"

void kv_grammar_vocab_free(kv_grammar_vocab *v) {
    if (!v) return;
    free(v->bytes);
    free(v->off);
    free(v->eog);
    free(v->eog_ids);
    free(v->size);
    free(v->sub_ascii);
    free(v->child_n);
    free(v->byte);
    free(v->tok_first);
    free(v->tok_n);
    free(v->tok_ids);
    free(v);
}

int32_t kv_grammar_vocab_n(const kv_grammar_vocab *v) { return v->n_vocab; }

/* Builds the trie: first as first-child/next-sibling lists, then laid out
 * breadth first. */
static int build_trie(kv_grammar_vocab *v, kv_diag *d) {
    size_t total = v->off[v->n_vocab];
    size_t cap = total + 1;
    uint32_t *first = malloc(cap * sizeof *first), *next = malloc(cap * sizeof *next);
    uint8_t *byte = malloc(cap);
    int32_t *tok_head = malloc(cap * sizeof *tok_head), *tok_next = malloc((size_t)v->n_vocab * sizeof *tok_next);
    uint32_t *order = NULL, *stack = NULL;
    int rc = 0;
    if (!first || !next || !byte || !tok_head || !tok_next) {
        rc = kv_fail(d, KV_ENOMEM, "grammar vocab: out of memory");
        goto out;
    }
    uint32_t n = 1;
    first[0] = next[0] = UINT32_MAX;
    byte[0] = 0;
    tok_head[0] = -1;
    for (int32_t t = v->n_vocab - 1; t >= 0; t--) {
        tok_next[t] = -1;
        uint32_t len = v->off[t + 1] - v->off[t];
        if (len == 0) continue; /* never allowed: no progress (eog handled apart) */
        if (v->eog[t]) continue;
        uint32_t cur = 0;
        for (uint32_t k = 0; k < len; k++) {
            uint8_t b = v->bytes[v->off[t] + k];
            uint32_t c = first[cur];
            while (c != UINT32_MAX && byte[c] != b) c = next[c];
            if (c == UINT32_MAX) {
                c = n++;
                byte[c] = b;
                first[c] = UINT32_MAX;
                tok_head[c] = -1;
                next[c] = first[cur];
                first[cur] = c;
            }
            cur = c;
        }
        tok_next[t] = tok_head[cur];
        tok_head[cur] = t;
    }
    /* preorder: an explicit stack of (old node, next child to visit) */
    order = malloc((size_t)n * sizeof *order); /* the old node of each new id */
    stack = malloc((size_t)n * sizeof *stack);  /* old nodes still to visit */
    v->size = malloc((size_t)n * sizeof *v->size);
    v->child_n = malloc((size_t)n * sizeof *v->child_n);
    v->byte = malloc(n);
    v->tok_first = malloc(((size_t)n + 1) * sizeof *v->tok_first);
    v->tok_n = malloc((size_t)n * sizeof *v->tok_n);
    v->tok_ids = malloc(((size_t)v->n_vocab + 1) * sizeof *v->tok_ids);
    v->sub_ascii = calloc(n, sizeof *v->sub_ascii);
    if (!order || !stack || !v->size || !v->child_n || !v->byte || !v->tok_first || !v->tok_n || !v->tok_ids ||
        !v->sub_ascii) {
        rc = kv_fail(d, KV_ENOMEM, "grammar vocab: out of memory");
        goto out;
    }
    uint32_t next_id = 0, n_tok = 0, sp = 0;
    /* visit: give the node the next id, its tokens, then its children */
    stack[sp++] = 0;
    while (sp) {
        uint32_t old = stack[--sp], id = next_id++;
        order[id] = old;
        v->byte[id] = byte[old];
        v->tok_first[id] = n_tok;
        for (int32_t t = tok_head[old]; t >= 0; t = tok_next[t]) v->tok_ids[n_tok++] = t;
        v->tok_n[id] = n_tok - v->tok_first[id];
        uint32_t kids = 0;
        for (uint32_t c = first[old]; c != UINT32_MAX; c = next[c]) kids++;
        KV_ASSERT(kids <= 256);
        v->child_n[id] = (uint16_t)kids;
        /* push children in reverse so the first is visited first */
        uint32_t at = sp + kids;
        KV_ASSERT(at <= n);
        for (uint32_t c = first[old]; c != UINT32_MAX; c = next[c]) stack[--at] = c;
        sp += kids;
    }
    v->tok_first[n] = n_tok;
    /* sizes and subtree bytes, children before parents (reverse preorder) */
    for (uint32_t id = n; id-- > 0;) {
        uint32_t sz = 1, ch = id + 1;
        for (uint32_t k = 0; k < v->child_n[id]; k++) {
            uint8_t b = v->byte[ch];
            if (b < 0x80) v->sub_ascii[id][b >> 6] |= 1ull << (b & 63);
            else v->sub_ascii[id][1] |= 1ull << 63;
            v->sub_ascii[id][0] |= v->sub_ascii[ch][0];
            v->sub_ascii[id][1] |= v->sub_ascii[ch][1];
            sz += v->size[ch];
            ch += v->size[ch];
        }
        v->size[id] = sz;
    }
    v->n_nodes = n;
out:
    free(first);
    free(next);
    free(byte);
    free(tok_head);
    free(tok_next);
    free(order);
    free(stack);
    return rc;
}

int kv_grammar_vocab_new(kv_grammar_vocab **out, const char *const *pieces, const uint32_t *lens,
                         const bool *eog, int32_t n_vocab, kv_diag *d) {
    *out = NULL;
    if (n_vocab <= 0 || (uint32_t)n_vocab > KV_TOK_MAX_VOCAB)
        return kv_fail(d, KV_EINVAL, "grammar vocab: n_vocab %d out of range 1..%u", n_vocab, KV_TOK_MAX_VOCAB);
    size_t total = 0;
    for (int32_t i = 0; i < n_vocab; i++) {
        if (lens[i] > KV_TOK_MAX_TOKEN_BYTES)
            return kv_fail(d, KV_EINVAL, "grammar vocab: token %d has %u bytes, max %u", i, lens[i], KV_TOK_MAX_TOKEN_BYTES);
        total += lens[i];
    }
    if (total > UINT32_MAX - 1) return kv_fail(d, KV_EINVAL, "grammar vocab: %zu bytes of pieces", total);
    kv_grammar_vocab *v = calloc(1, sizeof *v);
    if (!v) return kv_fail(d, KV_ENOMEM, "grammar vocab: out of memory");
    v->n_vocab = n_vocab;
    v->bytes = malloc(total + 1);
    v->off = malloc(((size_t)n_vocab + 1) * sizeof *v->off);
    v->eog = calloc((size_t)n_vocab, sizeof *v->eog);
    v->eog_ids = malloc((size_t)n_vocab * sizeof *v->eog_ids);
    if (!v->bytes || !v->off || !v->eog || !v->eog_ids) {
        kv_grammar_vocab_free(v);
        return kv_fail(d, KV_ENOMEM, "grammar vocab: out of memory");
    }
    uint32_t at = 0;
    for (int32_t i = 0; i < n_vocab; i++) {
        v->off[i] = at;
        if (lens[i]) memcpy(v->bytes + at, pieces[i], lens[i]);
        at += lens[i];
        if (lens[i] > v->max_len) v->max_len = lens[i];
        v->eog[i] = eog && eog[i];
        if (v->eog[i]) v->eog_ids[v->n_eog++] = i;
    }
    v->off[n_vocab] = at;
    int rc = build_trie(v, d);
    if (rc) {
        kv_grammar_vocab_free(v);
        return rc;
    }
    *out = v;
    return 0;
}

int kv_grammar_vocab_from_tok(kv_grammar_vocab **out, const kv_tok *t, kv_diag *d) {
    *out = NULL;
    int32_t n = kv_tok_n_vocab(t);
    if (n <= 0) return kv_fail(d, KV_EINVAL, "grammar vocab: tokenizer has no tokens");
    char **pieces = calloc((size_t)n, sizeof *pieces);
    uint32_t *lens = calloc((size_t)n, sizeof *lens);
    bool *eog = calloc((size_t)n, sizeof *eog);
    char *buf = malloc(KV_TOK_MAX_TOKEN_BYTES + 1);
    int rc = (pieces && lens && eog && buf) ? 0 : kv_fail(d, KV_ENOMEM, "grammar vocab: out of memory");
    for (int32_t i = 0; i < n && !rc; i++) {
        eog[i] = kv_tok_is_eog(t, i);
        int attr = kv_tok_attr(t, i);
        if (attr == KV_TOK_CONTROL || attr == KV_TOK_UNUSED) continue; /* never generated text */
        int len = kv_tok_piece(t, i, false, buf, KV_TOK_MAX_TOKEN_BYTES + 1);
        if (len < 0 || len > (int)KV_TOK_MAX_TOKEN_BYTES) {
            rc = kv_fail(d, KV_EINVAL, "grammar vocab: token %d has no usable piece", i);
            break;
        }
        pieces[i] = malloc((size_t)len + 1);
        if (!pieces[i]) {
            rc = kv_fail(d, KV_ENOMEM, "grammar vocab: out of memory");
            break;
        }
        memcpy(pieces[i], buf, (size_t)len);
        lens[i] = (uint32_t)len;
    }
    if (!rc) rc = kv_grammar_vocab_new(out, (const char *const *)pieces, lens, eog, n, d);
    if (pieces)
        for (int32_t i = 0; i < n; i++) free(pieces[i]);
    free(pieces);
    free(lens);
    free(eog);
    free(buf);
    return rc;
}
