/* Signed results (dispatch v4): the leaves, the Merkle tree and the digest
 * a worker signs over every RESULT, and the check of one pair's evidence
 * (include/kvasir/dispatch_evidence.h; docs/PROTOCOL.md).
 *
 * The tree is the one built level by level with an odd last node carried
 * up; it equals RFC 6962's recursive split at the largest power of two
 * below n, which is how the root and the proofs are computed here (no
 * scratch), and the right-to-left fold of the stack of full subtrees, which
 * is how a worker builds it while its rows stream out. Leaves and inner
 * nodes carry different prefixes, so no leaf can pass for a node.
 *
 * Hot path: a worker hashes each token's x row once per COMPUTE and each y
 * row once (OpenSSL's SHA-256); a coordinator does the same to check the
 * signature. Proofs are built only when a worker is caught. */
#include <sodium.h>
#include <string.h>

#include "kvasir/dispatch_evidence.h"
#include "kvasir/dispatch_proto.h"
#include "kvasir/slice.h"

static const char kv_leaf_tag[] = "kvasir-leaf-v4";
static const char kv_node_tag[] = "kvasir-node-v4";
static const char kv_result_tag[] = "kvasir-result-v4";

static void kv_le32(uint8_t b[4], uint32_t v) {
    b[0] = (uint8_t)v, b[1] = (uint8_t)(v >> 8), b[2] = (uint8_t)(v >> 16), b[3] = (uint8_t)(v >> 24);
}

void kv_result_xhash(const uint8_t *x_row, size_t n, uint8_t out[32]) {
    kv_sha256 s;
    kv_sha256_init(&s);
    kv_sha256_update(&s, x_row, n);
    kv_sha256_final(&s, out);
}

void kv_result_leaf(const uint8_t xhash[32], uint32_t expert, const uint8_t *y_row, size_t y_len, uint8_t out[32]) {
    uint8_t e[4];
    kv_le32(e, expert);
    kv_sha256 s;
    kv_sha256_init(&s);
    kv_sha256_update(&s, kv_leaf_tag, sizeof kv_leaf_tag - 1);
    kv_sha256_update(&s, xhash, 32);
    kv_sha256_update(&s, e, 4);
    kv_sha256_update(&s, y_row, y_len);
    kv_sha256_final(&s, out);
}

static void kv_result_node(const uint8_t l[32], const uint8_t r[32], uint8_t out[32]) {
    kv_sha256 s;
    kv_sha256_init(&s);
    kv_sha256_update(&s, kv_node_tag, sizeof kv_node_tag - 1);
    kv_sha256_update(&s, l, 32);
    kv_sha256_update(&s, r, 32);
    kv_sha256_final(&s, out);
}

void kv_result_digest(const char model_id[KV_PROTO_MODEL_ID_LEN], const uint8_t worker_key[32],
                      const uint8_t coord_key[32], uint32_t layer, uint32_t enc, uint32_t out_enc, uint32_t n_pairs,
                      const uint8_t root[32], uint8_t out[32]) {
    uint8_t f[16];
    kv_le32(f, layer);
    kv_le32(f + 4, enc);
    kv_le32(f + 8, out_enc);
    kv_le32(f + 12, n_pairs);
    kv_sha256 s;
    kv_sha256_init(&s);
    kv_sha256_update(&s, kv_result_tag, sizeof kv_result_tag - 1);
    kv_sha256_update(&s, model_id, KV_PROTO_MODEL_ID_LEN);
    kv_sha256_update(&s, worker_key, 32);
    kv_sha256_update(&s, coord_key, 32);
    kv_sha256_update(&s, f, sizeof f);
    kv_sha256_update(&s, root, 32);
    kv_sha256_final(&s, out);
}

/* The largest power of two below n (n >= 2). */
static uint32_t kv_split(uint32_t n) {
    uint32_t k = 1;
    while (k * 2 < n) k *= 2;
    return k;
}

void kv_result_root(const uint8_t (*leaves)[32], uint32_t n, uint8_t out[32]) {
    KV_ASSERT(n >= 1);
    if (n == 1) {
        memcpy(out, leaves[0], 32);
        return;
    }
    const uint32_t k = kv_split(n);
    uint8_t l[32], r[32];
    kv_result_root(leaves, k, l);
    kv_result_root(leaves + k, n - k, r);
    kv_result_node(l, r, out);
}

/* Appends the proof of leaf p of leaves[n] to proof[*np], deepest first. */
static void kv_result_path(const uint8_t (*leaves)[32], uint32_t n, uint32_t p, uint8_t (*proof)[32], uint32_t *np) {
    if (n == 1) return;
    const uint32_t k = kv_split(n);
    if (p < k) {
        kv_result_path(leaves, k, p, proof, np);
        kv_result_root(leaves + k, n - k, proof[(*np)++]);
    } else {
        kv_result_path(leaves + k, n - k, p - k, proof, np);
        kv_result_root(leaves, k, proof[(*np)++]);
    }
}

uint32_t kv_result_proof(const uint8_t (*leaves)[32], uint32_t n, uint32_t p, uint8_t proof[KV_EVIDENCE_MAX_PROOF][32]) {
    KV_ASSERT(p < n && n <= KV_PROTO_MAX_PAIRS); /* depth <= 16 */
    uint32_t np = 0;
    kv_result_path(leaves, n, p, proof, &np);
    return np;
}

/* The root of a tree of n leaves from leaf p and the last *left entries of
 * the proof that remain (the deepest ones first in the array). */
static int kv_result_climb(const uint8_t leaf[32], uint32_t p, uint32_t n, const uint8_t (*proof)[32], uint32_t *left,
                           uint8_t out[32]) {
    if (n == 1) {
        memcpy(out, leaf, 32);
        return 0;
    }
    if (*left == 0) return KV_EINVAL;
    const uint8_t *sib = proof[--*left]; /* this level's sibling is the last one left */
    const uint32_t k = kv_split(n);
    uint8_t sub[32];
    if (p < k) {
        if (kv_result_climb(leaf, p, k, proof, left, sub)) return KV_EINVAL;
        kv_result_node(sub, sib, out);
    } else {
        if (kv_result_climb(leaf, p - k, n - k, proof, left, sub)) return KV_EINVAL;
        kv_result_node(sib, sub, out);
    }
    return 0;
}

int kv_result_root_from_proof(const uint8_t leaf[32], uint32_t p, uint32_t n, const uint8_t (*proof)[32],
                              uint32_t n_proof, uint8_t out[32]) {
    if (n == 0 || p >= n || n_proof > KV_EVIDENCE_MAX_PROOF) return KV_EINVAL;
    uint32_t left = n_proof;
    if (kv_result_climb(leaf, p, n, proof, &left, out) || left != 0) return KV_EINVAL;
    return 0;
}

void kv_result_tree_init(kv_result_tree *t) { memset(t, 0, sizeof *t); }

void kv_result_tree_push(kv_result_tree *t, const uint8_t leaf[32]) {
    KV_ASSERT(t->n_stack <= KV_EVIDENCE_MAX_PROOF);
    memcpy(t->h[t->n_stack], leaf, 32);
    t->lv[t->n_stack++] = 0;
    t->n++;
    /* two full subtrees of one height make the next one up */
    while (t->n_stack >= 2 && t->lv[t->n_stack - 1] == t->lv[t->n_stack - 2]) {
        kv_result_node(t->h[t->n_stack - 2], t->h[t->n_stack - 1], t->h[t->n_stack - 2]);
        t->lv[t->n_stack - 2]++;
        t->n_stack--;
    }
}

void kv_result_tree_root(const kv_result_tree *t, uint8_t out[32]) {
    KV_ASSERT(t->n_stack >= 1);
    uint8_t acc[32];
    memcpy(acc, t->h[t->n_stack - 1], 32);
    for (uint32_t i = t->n_stack - 1; i-- > 0;) kv_result_node(t->h[i], acc, acc);
    memcpy(out, acc, 32);
}

size_t kv_evidence_x_bytes(const kv_evidence *ev) {
    const size_t es = kv_enc_size(ev->enc);
    return ev->n_embd && ev->n_embd <= KV_PROTO_MAX_EMBD ? es * ev->n_embd : 0;
}

size_t kv_evidence_y_bytes(const kv_evidence *ev) {
    if (ev->out_enc & ~(KV_OUT_PREACT | 0xffu)) return 0;
    const size_t es = (ev->out_enc & KV_OUT_PREACT) ? (ev->out_enc == (KV_OUT_PREACT | KV_ENC_F32) ? 4 : 0)
                                                    : kv_enc_size(ev->out_enc);
    return ev->n_embd && ev->n_embd <= KV_PROTO_MAX_EMBD ? es * ev->n_embd : 0;
}

int kv_evidence_check(const kv_evidence *ev, const char model_id[KV_PROTO_MODEL_ID_LEN], kv_diag *d) {
    const size_t xb = kv_evidence_x_bytes(ev), yb = kv_evidence_y_bytes(ev);
    if (!xb || !yb || !ev->x || !ev->y)
        return kv_fail(d, KV_EINVAL, "evidence: encodings %u/%u or n_embd %u out of bounds", ev->enc, ev->out_enc,
                       ev->n_embd);
    if (ev->n_pairs == 0 || ev->n_pairs > KV_PROTO_MAX_PAIRS || ev->pair >= ev->n_pairs)
        return kv_fail(d, KV_EINVAL, "evidence: pair %u of %u out of bounds", ev->pair, ev->n_pairs);
    uint8_t xh[32], leaf[32], root[32], dg[32];
    kv_result_xhash(ev->x, xb, xh);
    kv_result_leaf(xh, ev->expert, ev->y, yb, leaf);
    if (kv_result_root_from_proof(leaf, ev->pair, ev->n_pairs, (const uint8_t(*)[32])ev->proof, ev->n_proof, root))
        return kv_fail(d, KV_EINVAL, "evidence: a proof of %u hashes does not fit pair %u of %u", ev->n_proof, ev->pair,
                       ev->n_pairs);
    kv_result_digest(model_id, ev->worker_key, ev->coord_key, ev->layer, ev->enc, ev->out_enc, ev->n_pairs, root, dg);
    if (kv_link_verify(ev->worker_key, dg, ev->sig))
        return kv_fail(d, KV_EAUTH, "evidence: the worker's signature does not cover this answer");
    return 0;
}
