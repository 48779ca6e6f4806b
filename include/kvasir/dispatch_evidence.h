/* Signed results (dispatch v4, src/dispatch/evidence.c): the Merkle tree a
 * worker signs over its answers, and the evidence a coordinator shows the
 * hub about one pair. Pure: no I/O, no allocation. */
#ifndef KVASIR_DISPATCH_EVIDENCE_H
#define KVASIR_DISPATCH_EVIDENCE_H

#include <stddef.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/link.h"

/* ---- signed results (v4; src/dispatch/evidence.c) -------------------------
 * A v4 worker signs every RESULT and RESULT_PRE it sends, so that a
 * coordinator that catches it lying can show a third party (the hub) what
 * it said, and nobody can show what it did not say. Per pair p of the
 * COMPUTE:
 *   leaf_p = SHA-256("kvasir-leaf-v4" || SHA-256(x row of p's token, wire
 *            bytes) || u32 expert || y row of p, wire bytes as sent)
 * (RESULT_PRE: only the y part of the row, n_embd f32). The leaves form a
 * binary Merkle tree, node = SHA-256("kvasir-node-v4" || left || right),
 * pairs taken left to right on each level and an odd last node carried up
 * unchanged (the same tree as RFC 6962's split at the largest power of two
 * below n). The signed digest binds the tree to the connection's parties
 * and the request's shape (kv_result_digest); the signature is Ed25519 by
 * the worker's key. A proof of leaf p is the sibling hashes from the leaf
 * up (at most KV_EVIDENCE_MAX_PROOF; a carried level adds none). */
#define KV_EVIDENCE_MAX_PROOF 32u

/* SHA-256 of one x row's wire bytes (hashed once per token of a COMPUTE). */
void kv_result_xhash(const uint8_t *x_row, size_t n, uint8_t out[32]);
void kv_result_leaf(const uint8_t xhash[32], uint32_t expert, const uint8_t *y_row, size_t y_len, uint8_t out[32]);
/* SHA-256 over "kvasir-result-v4", model_id (64 hex), the worker key, the
 * coordinator key, u32 layer, enc, out_enc (as in the COMPUTE, with
 * KV_OUT_PREACT), n_pairs (LE) and the Merkle root. Pure. */
void kv_result_digest(const char model_id[KV_LINK_MODEL_ID_LEN], const uint8_t worker_key[32],
                      const uint8_t coord_key[32], uint32_t layer, uint32_t enc, uint32_t out_enc, uint32_t n_pairs,
                      const uint8_t root[32], uint8_t out[32]);
/* The root of leaves[n] (n >= 1), and the proof of leaf p (< n): writes
 * the sibling hashes, deepest first, and returns how many. Allocate nothing. */
void kv_result_root(const uint8_t (*leaves)[32], uint32_t n, uint8_t out[32]);
uint32_t kv_result_proof(const uint8_t (*leaves)[32], uint32_t n, uint32_t p, uint8_t proof[KV_EVIDENCE_MAX_PROOF][32]);
/* The root from leaf p of n and its proof[n_proof]; KV_EINVAL when the
 * proof has not exactly the length the tree's shape implies. */
int kv_result_root_from_proof(const uint8_t leaf[32], uint32_t p, uint32_t n, const uint8_t (*proof)[32],
                              uint32_t n_proof, uint8_t out[32]);
/* The root built as leaves arrive, in order (a worker streams its rows):
 * the stack of full subtrees, folded right to left at the end. */
typedef struct kv_result_tree {
    uint8_t h[KV_EVIDENCE_MAX_PROOF + 1][32]; /* subtree roots, largest first */
    uint8_t lv[KV_EVIDENCE_MAX_PROOF + 1];    /* their heights */
    uint32_t n_stack, n;                      /* subtrees; leaves pushed */
} kv_result_tree;
void kv_result_tree_init(kv_result_tree *t);
void kv_result_tree_push(kv_result_tree *t, const uint8_t leaf[32]);
/* n >= 1 leaves pushed. */
void kv_result_tree_root(const kv_result_tree *t, uint8_t out[32]);

/* What a coordinator shows the hub about one pair a worker answered: the
 * signed request shape, the pair's x and y rows as they crossed the wire,
 * the Merkle proof of its leaf and the signature. Anyone can check that the
 * worker signed exactly this y for this x and expert (kv_evidence_check). */
typedef struct kv_evidence {
    uint8_t worker_key[32];     /* who signed */
    uint8_t coord_key[32];      /* who asked (the reporter must be this key) */
    uint8_t sig[64];            /* the worker's, over kv_result_digest */
    uint32_t layer, enc, out_enc; /* as in the COMPUTE (out_enc with KV_OUT_PREACT for RESULT_PRE) */
    uint32_t n_pairs, pair;     /* pairs of the COMPUTE; the one shown (< n_pairs) */
    uint32_t expert;            /* the pair's expert */
    uint32_t n_embd;
    const uint8_t *x;           /* [n_embd] in enc: the token's row as sent */
    const uint8_t *y;           /* [n_embd] in out_enc (f32 with KV_OUT_PREACT): as answered */
    uint32_t n_proof;
    uint8_t proof[KV_EVIDENCE_MAX_PROOF][32];
} kv_evidence;
/* Bytes of ev's x and y rows (0 when an encoding or n_embd is out of bounds). */
size_t kv_evidence_x_bytes(const kv_evidence *ev);
size_t kv_evidence_y_bytes(const kv_evidence *ev);
/* Checks that ev's worker key signed ev (model_id: 64 hex): bounds, leaf,
 * proof, digest, signature. 0, KV_EINVAL (malformed: d says which field)
 * or KV_EAUTH (the signature does not cover it). Pure. */
int kv_evidence_check(const kv_evidence *ev, const char model_id[KV_LINK_MODEL_ID_LEN], kv_diag *d);

#endif
