/* Ledger internals shared by its files and its tests: signature checks of
 * in-memory structs (the ledger never trusts a struct it did not parse), and
 * the one transfer primitive every operation is built from. */
#ifndef KVASIR_LEDGER_INTERNAL_H
#define KVASIR_LEDGER_INTERNAL_H

#include "kvasir/ledger.h"
#include "ledger/store.h"

int kv_sodium_ready(kv_diag *d);
int kv_gateway_id_ok(const char *g, kv_diag *d);
/* Re-encode the body and verify the signature: 0, KV_EINVAL or RSIGNATURE. */
int kv_auth_verify(const kv_auth *a, kv_diag *d);
int kv_receipt_verify(const kv_receipt *r, kv_diag *d);
int kv_issue_verify(const kv_issue *is, const uint8_t op_pk[32], kv_diag *d);

/* One journal entry inside the caller's write transaction: debits dr,
 * credits cr (created on first credit with kind cr_kind). Returns 0,
 * KV_LEDGER_EXISTS (same id, same fields), KV_LEDGER_RCONFLICT (same id,
 * other fields), KV_LEDGER_RFUNDS (dr would go below zero), RLIMIT (a
 * balance or the supply would pass 2^62), or a store error. Tests call it
 * directly (the public API has no unsigned transfer). */
int kv_ledger_xfer(kv_ledger *l, const uint8_t id[16], const char *dr, const char *cr, int cr_kind,
                   uint64_t amount, int code, const uint8_t *ref, size_t ref_len, kv_diag *d);
/* The store and its ops, for tests that need a transaction around xfer. */
kv_store *kv_ledger_store(kv_ledger *l);
const kv_store_ops *kv_ledger_ops(kv_ledger *l);
/* Replaces the ops over the same store: tests wrap one op to land another
 * process's write between two steps of a call. ops must outlive l. */
void kv_ledger_set_ops(kv_ledger *l, const kv_store_ops *ops);

#endif
