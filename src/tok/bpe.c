/* Encoding text to token ids, as llama.cpp's llama_tokenize does for a
 * `gpt2` vocabulary (without adding BOS/EOS):
 *
 * 1. Special tokens. Each special token (longest text first) splits every
 *    remaining raw fragment at each of its non-overlapping occurrences, left
 *    to right. Without parse_special, CONTROL and UNKNOWN tokens are skipped
 *    but USER_DEFINED ones still split (as Hugging Face tokenizers do).
 * 2. Each raw fragment on its own: UTF-8 decode, qwen2/qwen35 split into
 *    words, each word re-encoded and mapped byte by byte to its byte-level
 *    characters.
 * 3. BPE per word, starting from one symbol per character: repeatedly merge
 *    the adjacent pair with the lowest merge rank (leftmost on ties). A merge
 *    applies even if its result is not in the vocabulary; at the end each
 *    symbol is looked up, and a symbol that is not a token falls back to its
 *    single bytes, each emitted only if that one byte is itself a token (so,
 *    in a consistent vocabulary, never).
 *
 * Hot path: step 3, a binary heap of candidate pairs per word; merge ranks
 * and token ids come from hash tables. Scratch buffers grow per call and are
 * freed at the end (encode is not on the per-token decode path). */
#include "tok/tok_internal.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    size_t off, len; /* raw text range */
    int32_t tok;     /* special token id, or -1 for raw text */
} kv_frag;

typedef struct {
    uint32_t off, n;   /* bytes of the symbol in the encoded word; n == 0: merged away */
    int32_t prev, next;
} kv_sym;

typedef struct {
    int32_t rank, left, right;
    uint32_t size; /* bytes of left + right when the pair was formed */
} kv_pair;

typedef struct {
    int32_t *ids;
    size_t cap, n;
} kv_ids;

typedef struct {
    char *word;     /* byte-level encoded word */
    size_t word_cap;
    kv_sym *sym;
    size_t sym_cap;
    kv_pair *heap;
    size_t heap_n, heap_cap;
} kv_scratch;

static void kv_emit(kv_ids *o, int32_t id) {
    if (o->n < o->cap) o->ids[o->n] = id;
    o->n++;
}

static int kv_grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = realloc(*p, c * elem);
    if (!q) return KV_ENOMEM;
    *p = q;
    *cap = c;
    return 0;
}

/* heap ordered by (rank, left) ascending */
static bool kv_pair_less(const kv_pair *a, const kv_pair *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static int kv_heap_push(kv_scratch *s, kv_pair p) {
    if (kv_grow((void **)&s->heap, &s->heap_cap, s->heap_n + 1, sizeof *s->heap)) return KV_ENOMEM;
    size_t i = s->heap_n++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!kv_pair_less(&p, &s->heap[up])) break;
        s->heap[i] = s->heap[up];
        i = up;
    }
    s->heap[i] = p;
    return 0;
}

static kv_pair kv_heap_pop(kv_scratch *s) {
    kv_pair top = s->heap[0], last = s->heap[--s->heap_n];
    size_t i = 0, n = s->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && kv_pair_less(&s->heap[c + 1], &s->heap[c])) c++;
        if (!kv_pair_less(&s->heap[c], &last)) break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (n) s->heap[i] = last;
    return top;
}

static int kv_try_pair(const kv_tok *t, kv_scratch *s, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return 0;
    const kv_sym *a = &s->sym[l], *b = &s->sym[r];
    int32_t rank = kv_tok_merge_rank(t, s->word + a->off, a->n, s->word + b->off, b->n);
    if (rank < 0) return 0;
    kv_pair p = {rank, l, r, a->n + b->n};
    return kv_heap_push(s, p);
}

/* BPE over one byte-level encoded word of wl bytes in s->word. */
static int kv_bpe_word(const kv_tok *t, kv_scratch *s, size_t wl, kv_ids *o) {
    if (kv_grow((void **)&s->sym, &s->sym_cap, wl, sizeof *s->sym)) return KV_ENOMEM;
    int32_t ns = 0;
    for (size_t at = 0; at < wl;) {
        size_t cl = kv_utf8_len((uint8_t)s->word[at]);
        if (cl > wl - at) cl = wl - at;
        s->sym[ns] = (kv_sym){(uint32_t)at, (uint32_t)cl, ns - 1, -1};
        if (ns > 0) s->sym[ns - 1].next = ns;
        ns++;
        at += cl;
    }
    s->heap_n = 0;
    for (int32_t i = 1; i < ns; i++)
        if (kv_try_pair(t, s, i - 1, i)) return KV_ENOMEM;
    while (s->heap_n) {
        kv_pair p = kv_heap_pop(s);
        kv_sym *a = &s->sym[p.left], *b = &s->sym[p.right];
        /* stale if either side was merged away or has grown since */
        if (a->n == 0 || b->n == 0 || a->n + b->n != p.size) continue;
        a->n += b->n;
        b->n = 0;
        a->next = b->next;
        if (b->next >= 0) s->sym[b->next].prev = p.left;
        if (kv_try_pair(t, s, a->prev, p.left) || kv_try_pair(t, s, p.left, a->next)) return KV_ENOMEM;
    }
    for (int32_t i = 0; i < ns; i++) {
        const kv_sym *y = &s->sym[i];
        if (y->n == 0) continue;
        int32_t id = kv_tok_lookup(t, s->word + y->off, y->n);
        if (id >= 0) {
            kv_emit(o, id);
            continue;
        }
        for (uint32_t k = 0; k < y->n; k++) {
            int32_t bid = kv_tok_lookup(t, s->word + y->off + k, 1);
            if (bid >= 0) kv_emit(o, bid);
        }
    }
    return 0;
}

typedef struct {
    const kv_tok *t;
    kv_scratch *s;
    kv_ids *o;
} kv_bpe_ctx;

static int kv_bpe_on_word(void *vctx, const char *w, size_t n) {
    kv_bpe_ctx *c = vctx;
    kv_scratch *s = c->s;
    if (kv_grow((void **)&s->word, &s->word_cap, 2 * n, 1)) return KV_ENOMEM;
    size_t wl = 0;
    for (size_t i = 0; i < n; i++) wl += (size_t)kv_byte_to_utf8((uint8_t)w[i], s->word + wl);
    return kv_bpe_word(c->t, s, wl, c->o);
}

int kv_tok_split_words(int pre, const char *text, size_t len, kv_word_fn fn, void *ctx) {
    if (len == 0) return 0;
    int rc = 0;
    uint32_t *cps = malloc(len * sizeof *cps);
    uint32_t *lens = malloc(len * sizeof *lens);
    uint8_t *buf = NULL;
    size_t buf_cap = 0;
    if (!cps || !lens) {
        rc = KV_ENOMEM;
        goto done;
    }
    size_t ncp = kv_utf8_decode((const uint8_t *)text, len, cps);
    size_t nw = kv_pretok_split(pre, cps, ncp, lens);
    size_t at = 0;
    for (size_t w = 0; w < nw; w++) {
        if (kv_grow((void **)&buf, &buf_cap, 4 * (size_t)lens[w], 1)) {
            rc = KV_ENOMEM;
            goto done;
        }
        size_t bl = 0;
        for (uint32_t k = 0; k < lens[w]; k++) bl += (size_t)kv_utf8_encode(cps[at + k], buf + bl);
        at += lens[w];
        rc = fn(ctx, (const char *)buf, bl);
        if (rc) goto done;
    }
done:
    free(cps);
    free(lens);
    free(buf);
    return rc;
}

static bool kv_in_plain(const kv_tok_span *plain, size_t n_plain, size_t off, size_t len) {
    for (size_t i = 0; i < n_plain; i++)
        if (off < plain[i].off + plain[i].len && plain[i].off < off + len) return true;
    return false;
}

/* Splits the raw fragments of *fr by every occurrence of special token id,
 * except occurrences that overlap one of the n_plain spans (they stay text;
 * the search goes on from the next byte). */
static int kv_partition(const kv_tok *t, int32_t id, const char *text, kv_frag **fr, size_t *nfr,
                        size_t *cap_fr, kv_frag **tmp, size_t *cap_tmp, const kv_tok_span *plain, size_t n_plain) {
    size_t tl;
    const char *tt = kv_tok_text(t, id, &tl);
    size_t nout = 0;
    for (size_t i = 0; i < *nfr; i++) {
        kv_frag f = (*fr)[i];
        if (f.tok >= 0) {
            if (kv_grow((void **)tmp, cap_tmp, nout + 1, sizeof **tmp)) return KV_ENOMEM;
            (*tmp)[nout++] = f;
            continue;
        }
        size_t at = f.off, end = f.off + f.len, from = at;
        for (;;) {
            const char *m = end - from >= tl ? memmem(text + from, end - from, tt, tl) : NULL;
            if (kv_grow((void **)tmp, cap_tmp, nout + 2, sizeof **tmp)) return KV_ENOMEM;
            if (!m) {
                if (end > at) (*tmp)[nout++] = (kv_frag){at, end - at, -1};
                break;
            }
            size_t mo = (size_t)(m - text);
            if (n_plain && kv_in_plain(plain, n_plain, mo, tl)) {
                from = mo + 1;
                continue;
            }
            if (mo > at) (*tmp)[nout++] = (kv_frag){at, mo - at, -1};
            (*tmp)[nout++] = (kv_frag){mo, tl, id};
            at = from = mo + tl;
        }
    }
    kv_frag *sw = *fr;
    size_t swc = *cap_fr;
    *fr = *tmp;
    *cap_fr = *cap_tmp;
    *tmp = sw;
    *cap_tmp = swc;
    *nfr = nout;
    return 0;
}

int kv_tok_encode(const kv_tok *t, const char *text, size_t len, bool parse_special, int32_t *ids,
                  size_t cap, size_t *n, kv_diag *d) {
    return kv_tok_encode_spans(t, text, len, parse_special, NULL, 0, ids, cap, n, d);
}

bool kv_tok_has_special(const kv_tok *t, const char *text, size_t len) {
    for (size_t i = 0; i < t->n_special; i++) {
        const int32_t id = t->special[i];
        if (!(t->attr[id] & (KV_TA_CONTROL | KV_TA_UNKNOWN))) continue;
        size_t tl;
        const char *tt = kv_tok_text(t, id, &tl);
        if (tl && tl <= len && memmem(text, len, tt, tl)) return true;
    }
    return false;
}

int kv_tok_encode_spans(const kv_tok *t, const char *text, size_t len, bool parse_special, const kv_tok_span *plain,
                        size_t n_plain, int32_t *ids, size_t cap, size_t *n, kv_diag *d) {
    kv_ids o = {ids, ids ? cap : 0, 0};
    kv_scratch s = {0};
    kv_frag *fr = NULL, *tmp = NULL;
    size_t nfr = 0, cap_fr = 0, cap_tmp = 0;
    int rc = 0;
    *n = 0;
    if (len == 0) return 0;
    if (kv_grow((void **)&fr, &cap_fr, 1, sizeof *fr)) goto oom;
    fr[nfr++] = (kv_frag){0, len, -1};
    for (size_t i = 0; i < t->n_special; i++) {
        int32_t id = t->special[i];
        const bool ctl = (t->attr[id] & (KV_TA_CONTROL | KV_TA_UNKNOWN)) != 0;
        if (!parse_special && ctl) continue;
        if (kv_partition(t, id, text, &fr, &nfr, &cap_fr, &tmp, &cap_tmp, plain, ctl ? n_plain : 0)) goto oom;
    }
    kv_bpe_ctx ctx = {t, &s, &o};
    for (size_t i = 0; i < nfr; i++) {
        if (fr[i].tok >= 0) {
            kv_emit(&o, fr[i].tok);
            continue;
        }
        rc = kv_tok_split_words(t->pre, text + fr[i].off, fr[i].len, kv_bpe_on_word, &ctx);
        if (rc) goto oom;
    }
    *n = o.n;
    if (o.n > o.cap) rc = kv_fail(d, KV_ERANGE, "tokenize: %zu tokens, room for %zu", o.n, o.cap);
    goto done;
oom:
    rc = kv_fail(d, KV_ENOMEM, "tokenize: out of memory");
done:
    free(fr);
    free(tmp);
    free(s.word);
    free(s.sym);
    free(s.heap);
    return rc;
}
