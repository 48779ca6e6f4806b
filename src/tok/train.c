/* Byte-level BPE training for synthetic models.
 *
 * The corpus is split into words by the same pre-tokenizer that will later
 * tokenize with the vocabulary (qwen2 or qwen35), identical words are
 * counted, and merges are learned the classic way: repeatedly the most
 * frequent adjacent pair of symbols (ties: lowest left id, then lowest right
 * id) becomes a new symbol, until the vocabulary is full or no pair occurs
 * twice. Pair counts are kept incrementally (each merge only revisits the
 * words that contain the pair) with a lazily updated max-heap, so training is
 * roughly linear in corpus size times the average word length.
 *
 * Layout of the result (n_vocab tokens exactly):
 *   [0, 256)              the 256 byte tokens, in GPT-2 order ('!' is 0)
 *   [256, 256 + k)        one token per learned merge whose result is new, in
 *                         learned order (a merge whose result already exists,
 *                         e.g. "ab"+"c" after "a"+"bc", adds a merge but no
 *                         token: token texts must be unique for llama.cpp)
 *   next 3                <|endoftext|>, <|im_start|>, <|im_end|> (CONTROL)
 *   rest                  "[PAD<id>]" tokens of type UNUSED
 *
 * Padding: when the corpus runs out of pairs before n_vocab (as it does for
 * a Qwen3-sized vocabulary of 151936), the rest is filled the way
 * convert_hf_to_gguf pads real Qwen vocabularies: "[PAD<id>]" tokens of type
 * UNUSED. llama.cpp loads them without warnings, never produces them when
 * tokenizing (no merge leads to them) and detokenizes them to nothing.
 *
 * Consistency (what llama.cpp needs): all 256 byte tokens exist, every merge's
 * two parts and its result are tokens, no two tokens share a text.
 * Deterministic: the same corpus, pre and n_vocab give the same vocabulary. */
#include "tok/tok_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern const unsigned char kv_corpus_data[];
extern const size_t kv_corpus_len;

const char *kv_bpe_default_corpus(size_t *len) {
    *len = kv_corpus_len;
    return (const char *)kv_corpus_data;
}

/* ---- a growable string -> id map -------------------------------------- */

typedef struct {
    char **text;     /* [n] owned, NUL-terminated */
    uint32_t *len;   /* [n] */
    size_t n, cap;
    int32_t *slot;   /* [mask+1] -1 empty */
    size_t mask;
} kv_strmap;

static int32_t kv_strmap_find(const kv_strmap *m, const char *s, size_t n) {
    if (!m->slot) return -1;
    for (size_t i = (size_t)kv_hash_bytes(KV_HASH_SEED, s, n) & m->mask;; i = (i + 1) & m->mask) {
        int32_t id = m->slot[i];
        if (id < 0) return -1;
        if (m->len[id] == n && !memcmp(m->text[id], s, n)) return id;
    }
}

static void kv_strmap_place(kv_strmap *m, int32_t id) {
    size_t i = (size_t)kv_hash_bytes(KV_HASH_SEED, m->text[id], m->len[id]) & m->mask;
    while (m->slot[i] >= 0) i = (i + 1) & m->mask;
    m->slot[i] = id;
}

/* Adds s (must not be present); returns its id or -1 on OOM. */
static int32_t kv_strmap_add(kv_strmap *m, const char *s, size_t n) {
    if (m->n == m->cap) {
        size_t c = m->cap ? 2 * m->cap : 1024;
        char **t = realloc(m->text, c * sizeof *t);
        if (!t) return -1;
        m->text = t;
        uint32_t *l = realloc(m->len, c * sizeof *l);
        if (!l) return -1;
        m->len = l;
        m->cap = c;
    }
    if (2 * (m->n + 1) > m->mask + 1) {
        size_t sz = m->mask ? 2 * (m->mask + 1) : 2048;
        int32_t *sl = malloc(sz * sizeof *sl);
        if (!sl) return -1;
        free(m->slot);
        m->slot = sl;
        m->mask = sz - 1;
        memset(sl, 0xff, sz * sizeof *sl);
        for (size_t i = 0; i < m->n; i++) kv_strmap_place(m, (int32_t)i);
    }
    char *c = malloc(n + 1);
    if (!c) return -1;
    memcpy(c, s, n);
    c[n] = '\0';
    int32_t id = (int32_t)m->n++;
    m->text[id] = c;
    m->len[id] = (uint32_t)n;
    kv_strmap_place(m, id);
    return id;
}

static void kv_strmap_free(kv_strmap *m) {
    for (size_t i = 0; i < m->n; i++) free(m->text[i]);
    free(m->text);
    free(m->len);
    free(m->slot);
}

/* ---- training state --------------------------------------------------- */

typedef struct {
    int64_t count;   /* occurrences in the corpus */
    int32_t *sym;    /* current symbols (token ids) */
    uint32_t n;      /* number of symbols */
    uint32_t stamp;  /* last merge that visited this word */
} kv_word;

typedef struct {
    int32_t a, b;
    int64_t count;
    int32_t *occ;    /* words that contained (a, b) at some point; may repeat */
    uint32_t n_occ, cap_occ;
} kv_pairrec;

typedef struct {
    int64_t count;
    int32_t a, b;
} kv_heapent;

typedef struct {
    kv_strmap words;     /* unique words (raw bytes) -> index */
    int64_t *wcount;     /* [words.n] */
    size_t wcount_cap;
    kv_word *w;
    kv_pairrec *p;
    size_t np, cap_p;
    int32_t *pslot;      /* (a,b) -> pair index */
    size_t pmask;
    kv_heapent *heap;
    size_t nh, cap_h;
    kv_strmap vocab;     /* token texts (byte-level encoded) -> id */
    char **merges;
    size_t n_merges, cap_merges;
} kv_trainer;

static int kv_collect_word(void *vctx, const char *s, size_t n) {
    kv_trainer *tr = vctx;
    int32_t id = kv_strmap_find(&tr->words, s, n);
    if (id < 0) {
        id = kv_strmap_add(&tr->words, s, n);
        if (id < 0) return KV_ENOMEM;
        if ((size_t)id >= tr->wcount_cap) {
            size_t c = tr->wcount_cap ? 2 * tr->wcount_cap : 1024;
            int64_t *q = realloc(tr->wcount, c * sizeof *q);
            if (!q) return KV_ENOMEM;
            tr->wcount = q;
            tr->wcount_cap = c;
        }
        tr->wcount[id] = 0;
    }
    tr->wcount[id]++;
    return 0;
}

static uint64_t kv_pair_key(int32_t a, int32_t b) { return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b; }

static int32_t kv_pair_get(kv_trainer *tr, int32_t a, int32_t b, bool create) {
    uint64_t key = kv_pair_key(a, b);
    size_t h = (size_t)(key * 0x9E3779B97F4A7C15ull >> 17);
    for (size_t i = h & tr->pmask;; i = (i + 1) & tr->pmask) {
        int32_t k = tr->pslot[i];
        if (k >= 0 && tr->p[k].a == a && tr->p[k].b == b) return k;
        if (k < 0) {
            if (!create) return -1;
            if (tr->np == tr->cap_p) {
                size_t c = 2 * tr->cap_p;
                kv_pairrec *q = realloc(tr->p, c * sizeof *q);
                if (!q) return -2;
                tr->p = q;
                tr->cap_p = c;
            }
            if (2 * (tr->np + 1) > tr->pmask + 1) {
                size_t sz = 2 * (tr->pmask + 1);
                int32_t *sl = malloc(sz * sizeof *sl);
                if (!sl) return -2;
                memset(sl, 0xff, sz * sizeof *sl);
                for (size_t j = 0; j < tr->np; j++) {
                    uint64_t kj = kv_pair_key(tr->p[j].a, tr->p[j].b);
                    size_t x = (size_t)(kj * 0x9E3779B97F4A7C15ull >> 17) & (sz - 1);
                    while (sl[x] >= 0) x = (x + 1) & (sz - 1);
                    sl[x] = (int32_t)j;
                }
                free(tr->pslot);
                tr->pslot = sl;
                tr->pmask = sz - 1;
                return kv_pair_get(tr, a, b, create);
            }
            int32_t id = (int32_t)tr->np++;
            tr->p[id] = (kv_pairrec){a, b, 0, NULL, 0, 0};
            tr->pslot[i] = id;
            return id;
        }
    }
}

/* max-heap by count, then lowest a, then lowest b */
static bool kv_heap_above(const kv_heapent *x, const kv_heapent *y) {
    if (x->count != y->count) return x->count > y->count;
    if (x->a != y->a) return x->a < y->a;
    return x->b < y->b;
}

static int kv_hpush(kv_trainer *tr, kv_heapent e) {
    if (tr->nh == tr->cap_h) {
        size_t c = tr->cap_h ? 2 * tr->cap_h : 4096;
        kv_heapent *q = realloc(tr->heap, c * sizeof *q);
        if (!q) return KV_ENOMEM;
        tr->heap = q;
        tr->cap_h = c;
    }
    size_t i = tr->nh++;
    while (i > 0 && kv_heap_above(&e, &tr->heap[(i - 1) / 2])) {
        tr->heap[i] = tr->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    tr->heap[i] = e;
    return 0;
}

static kv_heapent kv_hpop(kv_trainer *tr) {
    kv_heapent top = tr->heap[0], last = tr->heap[--tr->nh];
    size_t i = 0, n = tr->nh;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && kv_heap_above(&tr->heap[c + 1], &tr->heap[c])) c++;
        if (!kv_heap_above(&tr->heap[c], &last)) break;
        tr->heap[i] = tr->heap[c];
        i = c;
    }
    if (n) tr->heap[i] = last;
    return top;
}

/* Adds delta occurrences of (a, b) seen in word wi; records wi if asked. */
static int kv_pair_add(kv_trainer *tr, int32_t a, int32_t b, int64_t delta, int32_t wi, bool record) {
    int32_t k = kv_pair_get(tr, a, b, true);
    if (k < 0) return KV_ENOMEM;
    kv_pairrec *p = &tr->p[k];
    p->count += delta;
    if (record) {
        if (p->n_occ == p->cap_occ) {
            uint32_t c = p->cap_occ ? 2 * p->cap_occ : 4;
            int32_t *q = realloc(p->occ, c * sizeof *q);
            if (!q) return KV_ENOMEM;
            p->occ = q;
            p->cap_occ = c;
        }
        p->occ[p->n_occ++] = wi;
    }
    return 0;
}

static int kv_add_merge(kv_trainer *tr, int32_t a, int32_t b) {
    if (tr->n_merges == tr->cap_merges) {
        size_t c = tr->cap_merges ? 2 * tr->cap_merges : 1024;
        char **q = realloc(tr->merges, c * sizeof *q);
        if (!q) return KV_ENOMEM;
        tr->merges = q;
        tr->cap_merges = c;
    }
    size_t la = tr->vocab.len[a], lb = tr->vocab.len[b];
    char *m = malloc(la + lb + 2);
    if (!m) return KV_ENOMEM;
    memcpy(m, tr->vocab.text[a], la);
    m[la] = ' ';
    memcpy(m + la + 1, tr->vocab.text[b], lb);
    m[la + lb + 1] = '\0';
    tr->merges[tr->n_merges++] = m;
    return 0;
}

/* Merges every (a, b) into c in the words that contain it, keeping pair
 * counts exact. */
static int kv_apply_merge(kv_trainer *tr, int32_t pk, int32_t c, uint32_t stamp) {
    const int32_t a = tr->p[pk].a, b = tr->p[pk].b;
    for (uint32_t oi = 0; oi < tr->p[pk].n_occ; oi++) {
        int32_t wi = tr->p[pk].occ[oi];
        kv_word *w = &tr->w[wi];
        if (w->stamp == stamp) continue;
        w->stamp = stamp;
        bool has = false;
        for (uint32_t i = 0; i + 1 < w->n && !has; i++) has = w->sym[i] == a && w->sym[i + 1] == b;
        if (!has) continue;
        for (uint32_t i = 0; i + 1 < w->n; i++)
            if (kv_pair_add(tr, w->sym[i], w->sym[i + 1], -w->count, wi, false)) return KV_ENOMEM;
        uint32_t o = 0;
        for (uint32_t i = 0; i < w->n;) {
            if (i + 1 < w->n && w->sym[i] == a && w->sym[i + 1] == b) {
                w->sym[o++] = c;
                i += 2;
            } else {
                w->sym[o++] = w->sym[i++];
            }
        }
        w->n = o;
        for (uint32_t i = 0; i + 1 < w->n; i++) {
            int32_t x = w->sym[i], y = w->sym[i + 1];
            bool fresh = x == c || y == c; /* only pairs with c can be new here */
            if (kv_pair_add(tr, x, y, w->count, wi, fresh)) return KV_ENOMEM;
            if (fresh) {
                int32_t k = kv_pair_get(tr, x, y, false);
                if (kv_hpush(tr, (kv_heapent){tr->p[k].count, x, y})) return KV_ENOMEM;
            }
        }
    }
    return 0;
}

static void kv_trainer_free(kv_trainer *tr) {
    kv_strmap_free(&tr->words);
    free(tr->wcount);
    if (tr->w)
        for (size_t i = 0; i < tr->words.n; i++) free(tr->w[i].sym);
    free(tr->w);
    if (tr->p)
        for (size_t i = 0; i < tr->np; i++) free(tr->p[i].occ);
    free(tr->p);
    free(tr->pslot);
    free(tr->heap);
}

void kv_bpe_vocab_free(kv_bpe_vocab *v) {
    if (!v) return;
    if (v->tokens)
        for (size_t i = 0; i < v->n_tokens; i++) free(v->tokens[i]);
    free(v->tokens);
    free(v->types);
    if (v->merges)
        for (size_t i = 0; i < v->n_merges; i++) free(v->merges[i]);
    free(v->merges);
    memset(v, 0, sizeof *v);
}

int kv_bpe_train(const char *corpus, size_t len, const char *pre, size_t n_vocab, kv_bpe_vocab *out,
                 kv_diag *d) {
    static const char *const specials[3] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
    memset(out, 0, sizeof *out);
    int pre_id = pre ? kv_pre_from_name(pre, strlen(pre)) : -1;
    if (pre_id < 0) return kv_fail(d, KV_EUNSUPPORTED, "bpe train: pre-tokenizer '%s' not supported", pre ? pre : "(null)");
    if (n_vocab < 256 + 3 || n_vocab > KV_TOK_MAX_VOCAB)
        return kv_fail(d, KV_EINVAL, "bpe train: n_vocab %zu out of range [259, %u]", n_vocab, KV_TOK_MAX_VOCAB);
    const size_t n_learn = n_vocab - 3; /* byte tokens + merged tokens */

    kv_trainer tr;
    memset(&tr, 0, sizeof tr);
    int rc = KV_ENOMEM;
    char tmp[64];

    /* byte tokens in GPT-2 order: by their byte-level code point */
    int order[256], k = 0;
    for (uint32_t cp = 0; cp < 0x144; cp++) {
        int b = kv_cp_to_byte(cp);
        if (b >= 0) order[k++] = b;
    }
    int32_t byte_tok[256];
    for (int i = 0; i < 256; i++) {
        int n = kv_byte_to_utf8((uint8_t)order[i], tmp);
        int32_t id = kv_strmap_add(&tr.vocab, tmp, (size_t)n);
        if (id < 0) goto fail;
        byte_tok[order[i]] = id;
    }

    /* words and their counts */
    rc = kv_tok_split_words(pre_id, corpus, len, kv_collect_word, &tr);
    if (rc) goto fail;
    rc = KV_ENOMEM;
    tr.w = calloc(tr.words.n ? tr.words.n : 1, sizeof *tr.w);
    tr.cap_p = 1024;
    tr.p = malloc(tr.cap_p * sizeof *tr.p);
    tr.pmask = 2047;
    tr.pslot = malloc((tr.pmask + 1) * sizeof *tr.pslot);
    if (!tr.w || !tr.p || !tr.pslot) goto fail;
    memset(tr.pslot, 0xff, (tr.pmask + 1) * sizeof *tr.pslot);
    for (size_t i = 0; i < tr.words.n; i++) {
        kv_word *w = &tr.w[i];
        w->count = tr.wcount[i];
        w->n = tr.words.len[i];
        w->sym = malloc((w->n ? w->n : 1) * sizeof *w->sym);
        if (!w->sym) goto fail;
        for (uint32_t j = 0; j < w->n; j++) w->sym[j] = byte_tok[(uint8_t)tr.words.text[i][j]];
        for (uint32_t j = 0; j + 1 < w->n; j++)
            if (kv_pair_add(&tr, w->sym[j], w->sym[j + 1], w->count, (int32_t)i, true)) goto fail;
    }
    for (size_t i = 0; i < tr.np; i++)
        if (kv_hpush(&tr, (kv_heapent){tr.p[i].count, tr.p[i].a, tr.p[i].b})) goto fail;

    /* learn */
    uint32_t stamp = 0;
    while (tr.vocab.n < n_learn && tr.nh) {
        kv_heapent e = kv_hpop(&tr);
        int32_t pk = kv_pair_get(&tr, e.a, e.b, false);
        int64_t cur = tr.p[pk].count;
        if (cur != e.count) { /* stale entry: requeue at the current count */
            if (cur >= 2 && kv_hpush(&tr, (kv_heapent){cur, e.a, e.b})) goto fail;
            continue;
        }
        if (cur < 2) break; /* nothing left that occurs twice */
        size_t la = tr.vocab.len[e.a], lb = tr.vocab.len[e.b];
        if (la + lb > KV_TOK_MAX_TOKEN_BYTES) { /* never lengthen past the loader's bound */
            tr.p[pk].count = 0;
            continue;
        }
        char *joined = malloc(la + lb);
        if (!joined) goto fail;
        memcpy(joined, tr.vocab.text[e.a], la);
        memcpy(joined + la, tr.vocab.text[e.b], lb);
        int32_t c = kv_strmap_find(&tr.vocab, joined, la + lb);
        if (c < 0) c = kv_strmap_add(&tr.vocab, joined, la + lb);
        free(joined);
        if (c < 0 || kv_add_merge(&tr, e.a, e.b)) goto fail;
        if (kv_apply_merge(&tr, pk, c, ++stamp)) goto fail;
    }

    /* specials, then padding. The split never lets a learned token span
     * "<|", letters and "|>", nor "[", letters and digits, so these names
     * cannot clash with learned ones; checked all the same, because
     * llama.cpp aborts on duplicate token texts. */
    out->tokens = calloc(n_vocab, sizeof *out->tokens);
    out->types = malloc(n_vocab * sizeof *out->types);
    if (!out->tokens || !out->types) goto fail;
    out->n_tokens = n_vocab;
    size_t at = tr.vocab.n;
    for (; at < n_vocab; at++) {
        const char *name = tmp;
        if (at < tr.vocab.n + 3)
            name = specials[at - tr.vocab.n];
        else
            snprintf(tmp, sizeof tmp, "[PAD%zu]", at);
        if (kv_strmap_find(&tr.vocab, name, strlen(name)) >= 0) {
            rc = kv_fail(d, KV_EINTERNAL, "bpe train: learned a token equal to %s", name);
            goto fail_quiet;
        }
        out->tokens[at] = strdup(name);
        if (!out->tokens[at]) goto fail;
        out->types[at] = at < tr.vocab.n + 3 ? KV_TOK_CONTROL : KV_TOK_UNUSED;
    }
    out->eos_id = (int32_t)tr.vocab.n;
    out->im_start_id = (int32_t)tr.vocab.n + 1;
    out->im_end_id = (int32_t)tr.vocab.n + 2;
    for (size_t i = 0; i < tr.vocab.n; i++) { /* learned texts change hands last */
        out->tokens[i] = tr.vocab.text[i];
        tr.vocab.text[i] = NULL;
        out->types[i] = KV_TOK_NORMAL;
    }
    out->merges = tr.merges;
    out->n_merges = tr.n_merges;
    tr.merges = NULL;
    tr.n_merges = 0;
    rc = 0;
    goto done;
fail:
    rc = kv_fail(d, KV_ENOMEM, "bpe train: out of memory");
fail_quiet:
    kv_bpe_vocab_free(out);
done:
    for (size_t i = 0; i < tr.n_merges; i++) free(tr.merges[i]);
    free(tr.merges);
    kv_strmap_free(&tr.vocab);
    kv_trainer_free(&tr);
    return rc;
}
