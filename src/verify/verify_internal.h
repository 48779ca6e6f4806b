/* What tests of the verifier may see that no caller should: the secret
 * vectors themselves. tests/test_verify.c plays an attacker who learned
 * the vectors of an earlier generation (a leak, or a lie that passed once
 * by luck) and shows that the next generation catches what was aimed at
 * them. Nothing outside tests includes this file. */
#ifndef KVASIR_VERIFY_INTERNAL_H
#define KVASIR_VERIFY_INTERNAL_H

#include "kvasir/verify.h"

/* Copies vector p of stage (0 gate, 1 up, 2 down) of expert (layer, e)
 * into r [out rows of that matrix: n_ff for gate and up, n_embd for down]
 * and its generation into *gen. KV_ENOTFOUND if the expert is not
 * prepared, KV_ERANGE for a bad stage or p. */
int kv_verify_peek(const kv_verify *v, uint32_t layer, uint32_t e, int stage, uint32_t p, float *r, uint64_t *gen);

#endif
