/* The ledger's operations, built on one primitive: kv_ledger_xfer, a journal
 * entry that debits one account and credits another inside the caller's
 * write transaction, checking the id (client-chosen; identical retry =
 * EXISTS, changed retry = RCONFLICT), the debit balance (never below zero;
 * only the mint goes negative, by what it issued) and the 2^62 bound on
 * every balance and on the supply, before anything is written.
 *
 * Each public operation is one write transaction (store begin_write, which
 * serializes all writers in all processes): it verifies signatures first,
 * then reads, checks and writes; any failure rolls the whole transaction
 * back, so a refusal or an error changes nothing. Transfer ids inside
 * escrow/settle/release are derived from the authorization id, so the same
 * step can never be booked twice even if a caller loops.
 *
 * No call creates KVR except kv_ledger_issue, which needs the operator's
 * signature; no call credits a node except kv_ledger_settle, which needs a
 * held authorization, the coordinator's dispatch log and the node's own
 * signed receipt, and records the receipt so it is used once. */
#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvasir/link.h"
#include "ledger/ledger_internal.h"
#include "pg/pq.h"

struct kv_ledger {
    const kv_store_ops *ops; /* backend: SQLite, or PostgreSQL for a store URI (pg/pq.h) */
    kv_store *s;
    uint8_t operator_pk[32]; /* the only key that may issue */
    uint32_t fee_bps;        /* protocol fee, 0..10000 */
};

kv_store *kv_ledger_store(kv_ledger *l) { return l->s; }
const kv_store_ops *kv_ledger_ops(kv_ledger *l) { return l->ops; }
void kv_ledger_set_ops(kv_ledger *l, const kv_store_ops *ops) { l->ops = ops; }

const char *kv_ledger_rc_name(int rc) {
    if (rc == KV_LEDGER_EXISTS) return "EXISTS";
    switch (rc) {
#define KV_LR_NAME(name, val, str) case val: return #name;
        KV_LEDGER_REFUSAL_MAP(KV_LR_NAME)
#undef KV_LR_NAME
    }
    return kv_err_name(rc);
}

const char *kv_ledger_code_name(int code) {
    static const char *const n[] = {"?", "issue", "hold", "fee", "reward", "return"};
    return code > 0 && code < KV_XFER_COUNT ? n[code] : "?";
}

void kv_ledger_account_consumer(const uint8_t pk[32], char out[KV_LEDGER_ACCOUNT_MAX]) {
    char h[65];
    kv_hex(pk, 32, h);
    snprintf(out, KV_LEDGER_ACCOUNT_MAX, "consumer:%s", h);
}
void kv_ledger_account_node(const uint8_t pk[32], char out[KV_LEDGER_ACCOUNT_MAX]) {
    char h[65];
    kv_hex(pk, 32, h);
    snprintf(out, KV_LEDGER_ACCOUNT_MAX, "node:%s", h);
}

int kv_ledger_account_parse(const char *s, char out[KV_LEDGER_ACCOUNT_MAX], kv_diag *d) {
    uint8_t k[32];
    if (!s) return kv_fail(d, KV_EINVAL, "no account");
    if (!strcmp(s, "treasury") || !strcmp(s, "escrow") || !strcmp(s, "mint")) {
        snprintf(out, KV_LEDGER_ACCOUNT_MAX, "%s", s);
        return 0;
    }
    if (!strncmp(s, "consumer:", 9) && !kv_unhex32(s + 9, k, NULL)) {
        kv_ledger_account_consumer(k, out);
        return 0;
    }
    if (!strncmp(s, "node:", 5) && !kv_unhex32(s + 5, k, NULL)) {
        kv_ledger_account_node(k, out);
        return 0;
    }
    if (!kv_unhex32(s, k, NULL)) {
        kv_ledger_account_consumer(k, out);
        return 0;
    }
    return kv_fail(d, KV_EINVAL,
                   "account must be a 64-hex key, consumer:KEY, node:KEY, treasury, escrow or mint");
}

static int kv_account_kind(const char *id) {
    if (!strncmp(id, "consumer:", 9)) return KV_ACCT_CONSUMER;
    if (!strncmp(id, "node:", 5)) return KV_ACCT_NODE;
    if (!strcmp(id, "treasury")) return KV_ACCT_TREASURY;
    if (!strcmp(id, "escrow")) return KV_ACCT_ESCROW;
    if (!strcmp(id, "mint")) return KV_ACCT_MINT;
    return 0;
}

/* ---- open / init ------------------------------------------------------------ */
static int kv_ledger_load_meta(kv_ledger *l, kv_diag *d) {
    uint8_t v[32];
    size_t n = 0;
    int rc = l->ops->meta_get(l->s, "operator", v, 32, &n, d);
    if (rc == KV_ENOTFOUND) return kv_fail(d, KV_ENOTFOUND, "not an initialized ledger (kvasir ledger init)");
    if (rc) return rc;
    if (n != 32) return kv_fail(d, KV_EFORMAT, "ledger: operator key is %zu bytes", n);
    memcpy(l->operator_pk, v, 32);
    uint8_t f[4];
    if ((rc = l->ops->meta_get(l->s, "fee_bps", f, 4, &n, d))) return rc;
    uint32_t fee = (uint32_t)f[0] | (uint32_t)f[1] << 8 | (uint32_t)f[2] << 16 | (uint32_t)f[3] << 24;
    if (n != 4 || fee > 10000) return kv_fail(d, KV_EFORMAT, "ledger: corrupt fee");
    l->fee_bps = fee;
    return 0;
}

static int kv_ledger_open_store_ro(kv_ledger **out, const char *path, bool ro, kv_diag *d) {
    *out = NULL;
    if (kv_sodium_ready(d)) return KV_EINTERNAL;
    kv_ledger *l = calloc(1, sizeof *l);
    if (!l) return kv_fail(d, KV_ENOMEM, "ledger: out of memory");
    l->ops = kv_pq_uri(path) ? &kv_store_pg : &kv_store_sqlite;
    int rc = ro ? l->ops->open_ro(&l->s, path, d) : l->ops->open(&l->s, path, d);
    if (rc) {
        free(l);
        return rc;
    }
    *out = l;
    return 0;
}
static int kv_ledger_open_store(kv_ledger **out, const char *path, kv_diag *d) {
    return kv_ledger_open_store_ro(out, path, false, d);
}

int kv_ledger_init(const char *path, const uint8_t operator_pk[32], uint32_t fee_bps, kv_diag *d) {
    if (fee_bps > 10000) return kv_fail(d, KV_EINVAL, "fee %u bps is over 10000", fee_bps);
    kv_ledger *l;
    int rc = kv_ledger_open_store(&l, path, d);
    if (rc) return rc;
    if ((rc = l->ops->begin_write(l->s, d)) || (rc = l->ops->init_schema(l->s, d))) goto out;
    uint8_t f[4] = {(uint8_t)fee_bps, (uint8_t)(fee_bps >> 8), 0, 0};
    rc = kv_ledger_load_meta(l, NULL);
    if (rc == 0) {
        rc = memcmp(l->operator_pk, operator_pk, 32) || l->fee_bps != fee_bps
                 ? kv_fail(d, KV_LEDGER_RCONFLICT, "ledger '%s' exists with another operator key or fee", path)
                 : KV_LEDGER_EXISTS;
        goto out;
    }
    if ((rc = l->ops->meta_put(l->s, "operator", operator_pk, 32, d)) ||
        (rc = l->ops->meta_put(l->s, "fee_bps", f, 4, d)) ||
        (rc = l->ops->meta_put(l->s, "version", (const uint8_t *)"1", 1, d)))
        goto out;
    static const struct { const char *id; int kind; } sys[] = {
        {"treasury", KV_ACCT_TREASURY}, {"escrow", KV_ACCT_ESCROW}, {"mint", KV_ACCT_MINT}};
    for (size_t i = 0; i < 3; i++) {
        kv_store_account a = {.kind = sys[i].kind};
        snprintf(a.id, sizeof a.id, "%s", sys[i].id);
        if ((rc = l->ops->account_put(l->s, &a, d))) goto out;
    }
    rc = l->ops->commit(l->s, d);
out:
    if (rc && rc != KV_LEDGER_EXISTS) l->ops->rollback(l->s);
    else if (rc == KV_LEDGER_EXISTS) l->ops->rollback(l->s);
    kv_ledger_free(l);
    return rc;
}

static int kv_ledger_open_mode(kv_ledger **out, const char *path, bool ro, kv_diag *d) {
    kv_ledger *l;
    int rc = kv_ledger_open_store_ro(&l, path, ro, d);
    if (rc) return rc;
    if ((rc = kv_ledger_load_meta(l, d))) {
        kv_diag_prefix(d, rc, "'%s'", path);
        kv_ledger_free(l);
        return rc;
    }
    *out = l;
    return 0;
}
int kv_ledger_open(kv_ledger **out, const char *path, kv_diag *d) { return kv_ledger_open_mode(out, path, false, d); }
int kv_ledger_open_readonly(kv_ledger **out, const char *path, kv_diag *d) {
    return kv_ledger_open_mode(out, path, true, d);
}

/* ---- a shared reader (status pages) ------------------------------------------- */
struct kv_ledger_reader {
    pthread_mutex_t mu; /* one connection, many server threads */
    kv_ledger *l;
};

int kv_ledger_reader_open(kv_ledger_reader **out, const char *path, kv_diag *d) {
    *out = NULL;
    kv_ledger_reader *r = calloc(1, sizeof *r);
    if (!r) return kv_fail(d, KV_ENOMEM, "ledger: out of memory");
    int rc = kv_ledger_open_readonly(&r->l, path, d);
    if (rc) {
        free(r);
        return rc;
    }
    pthread_mutex_init(&r->mu, NULL);
    *out = r;
    return 0;
}

void kv_ledger_reader_free(kv_ledger_reader *r) {
    if (!r) return;
    kv_ledger_free(r->l);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

int kv_ledger_reader_earned(void *reader, const uint8_t pk[32], uint64_t *micro_kvr) {
    kv_ledger_reader *r = reader;
    uint64_t products, n;
    pthread_mutex_lock(&r->mu);
    const int rc = kv_ledger_node_earnings(r->l, pk, micro_kvr, &products, &n, NULL);
    pthread_mutex_unlock(&r->mu);
    return rc;
}

void kv_ledger_free(kv_ledger *l) {
    if (!l) return;
    if (l->s) l->ops->close(l->s);
    free(l);
}

/* ---- the transfer primitive ------------------------------------------------- */
static int kv_add_u64(uint64_t a, uint64_t b, uint64_t max, uint64_t *out) {
    uint64_t r;
    if (__builtin_add_overflow(a, b, &r) || r > max) return 0;
    *out = r;
    return 1;
}

int kv_ledger_xfer(kv_ledger *l, const uint8_t id[16], const char *dr, const char *cr, int cr_kind,
                   uint64_t amount, int code, const uint8_t *ref, size_t ref_len, kv_diag *d) {
    KV_ASSERT(ref_len <= KV_REF_MAX && code > 0 && code < KV_XFER_COUNT);
    if (amount == 0 || amount > KV_LEDGER_MAX_AMOUNT)
        return kv_fail(d, KV_LEDGER_RLIMIT, "transfer amount %llu is outside 1..2^62-1", (unsigned long long)amount);
    if (!strcmp(dr, cr)) return kv_fail(d, KV_EINVAL, "transfer debits and credits one account");
    kv_store_transfer t;
    int rc = l->ops->transfer_get(l->s, id, &t, d);
    if (rc == 0) {
        if (strcmp(t.debit, dr) || strcmp(t.credit, cr) || t.amount != amount || t.code != code ||
            t.ref_len != ref_len || memcmp(t.ref, ref, ref_len))
            return kv_fail(d, KV_LEDGER_RCONFLICT, "transfer id already used with other fields");
        return KV_LEDGER_EXISTS;
    }
    if (rc != KV_ENOTFOUND) return rc;

    kv_store_account a, b;
    rc = l->ops->account_get(l->s, dr, &a, d);
    if (rc == KV_ENOTFOUND) return kv_fail(d, KV_LEDGER_RFUNDS, "account %s has no funds", dr);
    if (rc) return rc;
    rc = l->ops->account_get(l->s, cr, &b, d);
    if (rc == KV_ENOTFOUND) {
        memset(&b, 0, sizeof b);
        snprintf(b.id, sizeof b.id, "%s", cr);
        b.kind = cr_kind;
    } else if (rc) {
        return rc;
    }
    if (b.kind != cr_kind) return kv_fail(d, KV_EFORMAT, "account %s has kind %d, want %d", cr, b.kind, cr_kind);
    /* the debit side */
    if (a.kind == KV_ACCT_MINT) {
        uint64_t issued = (uint64_t)(-a.balance), ni;
        if (!kv_add_u64(issued, amount, KV_LEDGER_MAX_AMOUNT, &ni))
            return kv_fail(d, KV_LEDGER_RLIMIT, "issuing %llu would pass the supply limit 2^62-1",
                           (unsigned long long)amount);
        a.balance = -(int64_t)ni;
    } else {
        if (a.balance < 0 || (uint64_t)a.balance < amount)
            return kv_fail(d, KV_LEDGER_RFUNDS, "account %s holds %lld, needs %llu", dr, (long long)a.balance,
                           (unsigned long long)amount);
        a.balance -= (int64_t)amount;
    }
    if (!kv_add_u64(a.debits, amount, INT64_MAX, &a.debits))
        return kv_fail(d, KV_LEDGER_RLIMIT, "account %s: debit total would overflow", dr);
    /* the credit side */
    uint64_t nb;
    if (b.kind == KV_ACCT_MINT) return kv_fail(d, KV_LEDGER_RACCOUNT, "the mint cannot be credited");
    if (b.balance < 0 || !kv_add_u64((uint64_t)b.balance, amount, KV_LEDGER_MAX_AMOUNT, &nb))
        return kv_fail(d, KV_LEDGER_RLIMIT, "account %s would pass 2^62-1", cr);
    b.balance = (int64_t)nb;
    if (!kv_add_u64(b.credits, amount, INT64_MAX, &b.credits))
        return kv_fail(d, KV_LEDGER_RLIMIT, "account %s: credit total would overflow", cr);

    memset(&t, 0, sizeof t);
    memcpy(t.id, id, 16);
    snprintf(t.debit, sizeof t.debit, "%s", dr);
    snprintf(t.credit, sizeof t.credit, "%s", cr);
    t.amount = amount;
    t.code = code;
    memcpy(t.ref, ref, ref_len);
    t.ref_len = ref_len;
    t.ts = (int64_t)time(NULL);
    if ((rc = l->ops->account_put(l->s, &a, d)) || (rc = l->ops->account_put(l->s, &b, d)) ||
        (rc = l->ops->transfer_put(l->s, &t, d)))
        return rc;
    return 0;
}

/* Transfer id of step `code` of an authorization (and node, for rewards). */
static void kv_step_id(const uint8_t key[48], int code, const uint8_t *node, uint8_t out[16]) {
    crypto_generichash_state h;
    uint8_t c = (uint8_t)code, z[32] = {0};
    crypto_generichash_init(&h, NULL, 0, 16);
    crypto_generichash_update(&h, (const uint8_t *)"kvr-step-v1", 11);
    crypto_generichash_update(&h, &c, 1);
    crypto_generichash_update(&h, key, 48);
    crypto_generichash_update(&h, node ? node : z, 32);
    crypto_generichash_final(&h, out, 16);
}

static void kv_auth_key(const uint8_t consumer[32], const uint8_t nonce[16], uint8_t key[48]) {
    memcpy(key, consumer, 32);
    memcpy(key + 32, nonce, 16);
}

/* Runs body inside one write transaction; commits on 0, rolls back otherwise. */
#define KV_TXN_BEGIN(l, d)                          \
    int rc = (l)->ops->begin_write((l)->s, (d));    \
    if (rc) return rc;
#define KV_TXN_END(l, d)                                    \
    if (rc == 0) rc = (l)->ops->commit((l)->s, (d));        \
    else (l)->ops->rollback((l)->s);                        \
    return rc;

/* ---- issuance ---------------------------------------------------------------- */
int kv_ledger_issue(kv_ledger *l, const kv_issue *is, kv_diag *d) {
    int vr = kv_issue_verify(is, l->operator_pk, d);
    if (vr) return vr;
    char to[KV_LEDGER_ACCOUNT_MAX];
    kv_ledger_account_consumer(is->consumer, to);
    KV_TXN_BEGIN(l, d)
    rc = kv_ledger_xfer(l, is->id, "mint", to, KV_ACCT_CONSUMER, is->amount, KV_XFER_ISSUE, is->id, 16, d);
    if (rc == KV_LEDGER_EXISTS) {
        l->ops->rollback(l->s);
        return KV_LEDGER_EXISTS;
    }
    KV_TXN_END(l, d)
}

/* ---- escrow ---------------------------------------------------------------- */
int kv_ledger_escrow(kv_ledger *l, const kv_auth *a, const char *gateway_id, uint64_t now, kv_diag *d) {
    if (kv_gateway_id_ok(gateway_id, d)) return KV_EINVAL;
    int vr = kv_auth_verify(a, d);
    if (vr) return vr;
    if (strcmp(a->gateway, gateway_id))
        return kv_fail(d, KV_LEDGER_RGATEWAY, "authorization is for gateway '%s', not '%s'", a->gateway, gateway_id);
    if (now >= a->expires)
        return kv_fail(d, KV_LEDGER_REXPIRED, "authorization expired at %llu (now %llu)",
                       (unsigned long long)a->expires, (unsigned long long)now);
    uint8_t key[48], id[16];
    kv_auth_key(a->consumer, a->nonce, key);
    kv_step_id(key, KV_XFER_HOLD, NULL, id);
    char from[KV_LEDGER_ACCOUNT_MAX];
    kv_ledger_account_consumer(a->consumer, from);
    KV_TXN_BEGIN(l, d)
    kv_store_auth u;
    rc = l->ops->auth_get(l->s, a->consumer, a->nonce, &u, d);
    if (rc == 0) {
        rc = kv_fail(d, KV_LEDGER_RREPLAY, "authorization was already used (%s)",
                     u.state == KV_AUTH_HELD ? "held" : u.state == KV_AUTH_SETTLED ? "settled" : "released");
    } else if (rc == KV_ENOTFOUND) {
        rc = kv_ledger_xfer(l, id, from, "escrow", KV_ACCT_ESCROW, a->max, KV_XFER_HOLD, key, 48, d);
        if (rc == KV_LEDGER_EXISTS) rc = kv_fail(d, KV_LEDGER_RREPLAY, "authorization was already used");
        if (rc == 0) {
            memset(&u, 0, sizeof u);
            memcpy(u.consumer, a->consumer, 32);
            memcpy(u.nonce, a->nonce, 16);
            snprintf(u.gateway, sizeof u.gateway, "%s", a->gateway);
            u.max = a->max;
            u.expires = a->expires;
            u.state = KV_AUTH_HELD;
            rc = l->ops->auth_put(l->s, &u, d);
        }
    }
    KV_TXN_END(l, d)
}

/* ---- split ------------------------------------------------------------------ */
typedef struct {
    unsigned __int128 rem;
    const uint8_t *id;
    size_t i;
} kv_split_rem;

static int kv_split_cmp(const void *x, const void *y) {
    const kv_split_rem *a = x, *b = y;
    if (a->rem != b->rem) return a->rem > b->rem ? -1 : 1;
    int c = memcmp(a->id, b->id, 32);
    return c ? c : (a->i < b->i ? -1 : a->i > b->i);
}

int kv_ledger_split(uint64_t pool, const uint64_t *counts, const uint8_t (*ids)[32], size_t n,
                    uint64_t *shares, kv_diag *d) {
    if (n == 0 || n > KV_LEDGER_MAX_LOG) return kv_fail(d, KV_EINVAL, "split among %zu nodes (1..%d)", n, KV_LEDGER_MAX_LOG);
    if (pool > KV_LEDGER_MAX_AMOUNT) return kv_fail(d, KV_EINVAL, "split pool over 2^62-1");
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (counts[i] == 0 || counts[i] > KV_LEDGER_MAX_PRODUCTS)
            return kv_fail(d, KV_EINVAL, "split count %llu is outside 1..2^40", (unsigned long long)counts[i]);
        total += counts[i]; /* <= 2^10 * 2^40: no overflow */
    }
    kv_split_rem *r = malloc(n * sizeof *r);
    if (!r) return kv_fail(d, KV_ENOMEM, "split: out of memory");
    uint64_t given = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned __int128 p = (unsigned __int128)pool * counts[i]; /* < 2^102 */
        shares[i] = (uint64_t)(p / total);
        r[i].rem = p % total;
        r[i].id = ids[i];
        r[i].i = i;
        given += shares[i];
    }
    uint64_t left = pool - given; /* < n */
    qsort(r, n, sizeof *r, kv_split_cmp);
    for (size_t k = 0; k < left; k++) shares[r[k].i]++;
    free(r);
    return 0;
}

/* ---- settle ---------------------------------------------------------------- */
static void kv_settle_digest(const kv_settle_req *r, uint8_t out[32]) {
    crypto_generichash_state h;
    uint8_t b[8];
    crypto_generichash_init(&h, NULL, 0, 32);
    crypto_generichash_update(&h, (const uint8_t *)"kvr-settle-v1", 13);
    crypto_generichash_update(&h, r->consumer, 32);
    crypto_generichash_update(&h, r->nonce, 16);
    const uint64_t v[] = {r->prompt_tokens, r->completion_tokens, r->price_prompt, r->price_completion,
                          (uint64_t)r->n_log, (uint64_t)r->n_receipts};
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        for (int k = 0; k < 8; k++) b[k] = (uint8_t)(v[i] >> (8 * k));
        crypto_generichash_update(&h, b, 8);
    }
    for (size_t i = 0; i < r->n_log; i++) {
        crypto_generichash_update(&h, r->log[i].node, 32);
        for (int k = 0; k < 8; k++) b[k] = (uint8_t)(r->log[i].n_products >> (8 * k));
        crypto_generichash_update(&h, b, 8);
        crypto_generichash_update(&h, r->log[i].log_digest, 32);
    }
    for (size_t i = 0; i < r->n_receipts; i++) {
        uint8_t rb[KV_RECEIPT_SIZE];
        if (kv_receipt_to_bytes(&r->receipts[i], rb, NULL)) memset(rb, 0, sizeof rb);
        crypto_generichash_update(&h, rb, sizeof rb);
    }
    crypto_generichash_final(&h, out, 32);
}

static void kv_settle_fill(kv_settle_result *res, const kv_store_auth *u) {
    if (!res) return;
    res->cost = u->cost;
    res->fee = u->fee;
    res->to_nodes = u->to_nodes;
    res->returned = u->returned;
}

int kv_ledger_settle(kv_ledger *l, const kv_settle_req *r, kv_settle_result *res, kv_diag *d) {
    if (res) memset(res, 0, sizeof *res);
    /* everything that needs no store first: bounds, cost, the log, signatures */
    if (r->n_log > KV_LEDGER_MAX_LOG) return kv_fail(d, KV_EINVAL, "dispatch log has %zu nodes, max %d", r->n_log, KV_LEDGER_MAX_LOG);
    if (r->n_receipts > r->n_log)
        return kv_fail(d, KV_LEDGER_RRECEIPT, "%zu receipts for %zu nodes in the dispatch log", r->n_receipts, r->n_log);
    if ((r->n_log && !r->log) || (r->n_receipts && !r->receipts)) return kv_fail(d, KV_EINVAL, "settle: NULL log");
    uint64_t c1, c2, cost;
    if (__builtin_mul_overflow(r->prompt_tokens, r->price_prompt, &c1) ||
        __builtin_mul_overflow(r->completion_tokens, r->price_completion, &c2) ||
        !kv_add_u64(c1, c2, KV_LEDGER_MAX_AMOUNT, &cost))
        return kv_fail(d, KV_LEDGER_ROVERMAX, "cost of the completion overflows 2^62");
    for (size_t i = 0; i < r->n_log; i++) {
        if (r->log[i].n_products == 0 || r->log[i].n_products > KV_LEDGER_MAX_PRODUCTS)
            return kv_fail(d, KV_EINVAL, "dispatch log entry %zu: count %llu outside 1..2^40", i,
                           (unsigned long long)r->log[i].n_products);
        for (size_t j = 0; j < i; j++)
            if (!memcmp(r->log[i].node, r->log[j].node, 32))
                return kv_fail(d, KV_EINVAL, "dispatch log names node %zu twice", i);
    }
    int receipt_of[KV_LEDGER_MAX_LOG]; /* log index -> receipt index, -1 if none */
    for (size_t i = 0; i < r->n_log; i++) receipt_of[i] = -1;
    for (size_t k = 0; k < r->n_receipts; k++) {
        const kv_receipt *rc = &r->receipts[k];
        kv_diag vd = {0};
        if (kv_receipt_verify(rc, &vd))
            return kv_fail(d, KV_LEDGER_RRECEIPT, "receipt %zu: %s", k, vd.msg);
        if (memcmp(rc->consumer, r->consumer, 32) || memcmp(rc->auth_nonce, r->nonce, 16))
            return kv_fail(d, KV_LEDGER_RRECEIPT, "receipt %zu is for another authorization", k);
        size_t j = 0;
        while (j < r->n_log && memcmp(r->log[j].node, rc->node, 32)) j++;
        if (j == r->n_log)
            return kv_fail(d, KV_LEDGER_RRECEIPT, "receipt %zu: its node is not in the dispatch log", k);
        if (receipt_of[j] >= 0) return kv_fail(d, KV_LEDGER_RRECEIPT, "receipt %zu: a second receipt for one node", k);
        if (rc->n_products != r->log[j].n_products || memcmp(rc->log_digest, r->log[j].log_digest, 32))
            return kv_fail(d, KV_LEDGER_RRECEIPT, "receipt %zu claims %llu products, the dispatch log says %llu (or another digest)",
                           k, (unsigned long long)rc->n_products, (unsigned long long)r->log[j].n_products);
        receipt_of[j] = (int)k;
    }
    uint8_t digest[32], key[48], id[16];
    kv_settle_digest(r, digest);
    kv_auth_key(r->consumer, r->nonce, key);
    char consumer[KV_LEDGER_ACCOUNT_MAX];
    kv_ledger_account_consumer(r->consumer, consumer);

    KV_TXN_BEGIN(l, d)
    kv_store_auth u;
    uint64_t *shares = NULL;
    rc = l->ops->auth_get(l->s, r->consumer, r->nonce, &u, d);
    if (rc == KV_ENOTFOUND) {
        rc = kv_fail(d, KV_LEDGER_RSTATE, "no such authorization is held");
        goto done;
    }
    if (rc) goto done;
    if (u.state == KV_AUTH_SETTLED) {
        if (!memcmp(u.settle_digest, digest, 32)) {
            kv_settle_fill(res, &u);
            rc = KV_LEDGER_EXISTS;
        } else {
            rc = kv_fail(d, KV_LEDGER_RCONFLICT, "authorization was already settled with other figures");
        }
        goto done;
    }
    if (u.state != KV_AUTH_HELD) {
        rc = kv_fail(d, KV_LEDGER_RSTATE, "authorization was released, not held");
        goto done;
    }
    if (cost > u.max) {
        rc = kv_fail(d, KV_LEDGER_ROVERMAX, "cost %llu exceeds the authorized %llu", (unsigned long long)cost,
                     (unsigned long long)u.max);
        goto done;
    }
    for (size_t k = 0; k < r->n_receipts; k++) {
        if (strcmp(r->receipts[k].gateway, u.gateway)) {
            rc = kv_fail(d, KV_LEDGER_RRECEIPT, "receipt %zu names gateway '%s', the hold is at '%s'", k,
                         r->receipts[k].gateway, u.gateway);
            goto done;
        }
        kv_store_receipt sr = {0};
        memcpy(sr.node, r->receipts[k].node, 32);
        memcpy(sr.nonce, r->receipts[k].nonce, 16);
        memcpy(sr.consumer, r->consumer, 32);
        memcpy(sr.auth_nonce, r->nonce, 16);
        int used = l->ops->receipt_used(l->s, &sr, d);
        if (used < 0) { rc = used; goto done; }
        if (used) { rc = kv_fail(d, KV_LEDGER_RRECEIPT, "receipt %zu was already used", k); goto done; }
    }
    uint64_t fee = (uint64_t)((unsigned __int128)cost * l->fee_bps / 10000), pool = cost - fee, to_nodes = 0;
    if (r->n_log) {
        shares = calloc(r->n_log, sizeof *shares);
        const uint8_t(*ids)[32] = malloc(r->n_log * 32);
        uint64_t *counts = malloc(r->n_log * sizeof *counts);
        if (!shares || !ids || !counts) {
            free((void *)ids);
            free(counts);
            rc = kv_fail(d, KV_ENOMEM, "settle: out of memory");
            goto done;
        }
        for (size_t i = 0; i < r->n_log; i++) {
            memcpy((void *)ids[i], r->log[i].node, 32);
            counts[i] = r->log[i].n_products;
        }
        rc = kv_ledger_split(pool, counts, ids, r->n_log, shares, d);
        free((void *)ids);
        free(counts);
        if (rc) goto done;
        for (size_t i = 0; i < r->n_log; i++) {
            if (receipt_of[i] < 0 || shares[i] == 0) continue;
            char node[KV_LEDGER_ACCOUNT_MAX];
            kv_ledger_account_node(r->log[i].node, node);
            kv_step_id(key, KV_XFER_REWARD, r->log[i].node, id);
            if ((rc = kv_ledger_xfer(l, id, "escrow", node, KV_ACCT_NODE, shares[i], KV_XFER_REWARD, key, 48, d)))
                goto done;
            kv_store_receipt sr = {0};
            const kv_receipt *rp = &r->receipts[receipt_of[i]];
            memcpy(sr.node, rp->node, 32);
            memcpy(sr.nonce, rp->nonce, 16);
            memcpy(sr.consumer, r->consumer, 32);
            memcpy(sr.auth_nonce, r->nonce, 16);
            sr.n_products = rp->n_products;
            memcpy(sr.transfer_id, id, 16);
            if ((rc = l->ops->receipt_put(l->s, &sr, d))) goto done;
            to_nodes += shares[i];
        }
    }
    if (fee) {
        kv_step_id(key, KV_XFER_FEE, NULL, id);
        if ((rc = kv_ledger_xfer(l, id, "escrow", "treasury", KV_ACCT_TREASURY, fee, KV_XFER_FEE, key, 48, d)))
            goto done;
    }
    uint64_t returned = u.max - fee - to_nodes;
    if (returned) {
        kv_step_id(key, KV_XFER_RETURN, NULL, id);
        if ((rc = kv_ledger_xfer(l, id, "escrow", consumer, KV_ACCT_CONSUMER, returned, KV_XFER_RETURN, key, 48, d)))
            goto done;
    }
    u.state = KV_AUTH_SETTLED;
    memcpy(u.settle_digest, digest, 32);
    u.cost = cost;
    u.fee = fee;
    u.to_nodes = to_nodes;
    u.returned = returned;
    if ((rc = l->ops->auth_put(l->s, &u, d))) goto done;
    kv_settle_fill(res, &u);
done:
    free(shares);
    if (rc == KV_LEDGER_EXISTS) {
        l->ops->rollback(l->s);
        return rc;
    }
    KV_TXN_END(l, d)
}

/* ---- release / recover --------------------------------------------------------- */
int kv_ledger_release(kv_ledger *l, const uint8_t consumer[32], const uint8_t nonce[16], kv_diag *d) {
    uint8_t key[48], id[16];
    kv_auth_key(consumer, nonce, key);
    kv_step_id(key, KV_XFER_RETURN, NULL, id);
    char to[KV_LEDGER_ACCOUNT_MAX];
    kv_ledger_account_consumer(consumer, to);
    KV_TXN_BEGIN(l, d)
    kv_store_auth u;
    rc = l->ops->auth_get(l->s, consumer, nonce, &u, d);
    if (rc == KV_ENOTFOUND) rc = kv_fail(d, KV_LEDGER_RSTATE, "no such authorization is held");
    if (rc == 0 && u.state == KV_AUTH_RELEASED) {
        l->ops->rollback(l->s);
        return KV_LEDGER_EXISTS;
    }
    if (rc == 0 && u.state == KV_AUTH_SETTLED) rc = kv_fail(d, KV_LEDGER_RSTATE, "authorization was settled");
    if (rc == 0) rc = kv_ledger_xfer(l, id, "escrow", to, KV_ACCT_CONSUMER, u.max, KV_XFER_RETURN, key, 48, d);
    if (rc == 0) {
        u.state = KV_AUTH_RELEASED;
        u.returned = u.max;
        rc = l->ops->auth_put(l->s, &u, d);
    }
    KV_TXN_END(l, d)
}

int kv_ledger_recover(kv_ledger *l, const char *gateway_id, uint64_t *n_released, kv_diag *d) {
    if (n_released) *n_released = 0;
    if (kv_gateway_id_ok(gateway_id, d)) return KV_EINVAL;
    for (;;) {
        kv_store_auth held[64];
        size_t n = 0;
        int rc = l->ops->auth_held(l->s, gateway_id, held, 64, &n, d);
        if (rc) return rc;
        if (n == 0) return 0;
        for (size_t i = 0; i < n; i++) {
            rc = kv_ledger_release(l, held[i].consumer, held[i].nonce, d);
            /* Settled after the list was read: the previous run's last commit
             * can land late (PostgreSQL finishes a COMMIT whose client was
             * killed), and the hold it settled is no longer ours to release.
             * The next list no longer holds it, so the loop still ends. */
            if (rc == KV_LEDGER_RSTATE) continue;
            if (rc < 0) return rc;
            if (rc == 0 && n_released) (*n_released)++;
        }
    }
}

/* ---- reading ------------------------------------------------------------------ */
int kv_ledger_balance(kv_ledger *l, const char *account, uint64_t *out, kv_diag *d) {
    *out = 0;
    if (!kv_account_kind(account)) return kv_fail(d, KV_EINVAL, "'%s' is not an account id", account);
    kv_store_account a;
    int rc = l->ops->account_get(l->s, account, &a, d);
    if (rc == KV_ENOTFOUND) return 0;
    if (rc) return rc;
    if (a.kind == KV_ACCT_MINT) *out = a.balance <= 0 ? (uint64_t)(-a.balance) : 0;
    else *out = a.balance >= 0 ? (uint64_t)a.balance : 0;
    return 0;
}

int kv_ledger_node_earnings(kv_ledger *l, const uint8_t node[32], uint64_t *earned, uint64_t *products,
                            uint64_t *n_receipts, kv_diag *d) {
    *earned = *products = *n_receipts = 0;
    char id[KV_LEDGER_ACCOUNT_MAX];
    kv_ledger_account_node(node, id);
    int rc = l->ops->begin_read(l->s, d);
    if (rc) return rc;
    kv_store_account a;
    rc = l->ops->account_get(l->s, id, &a, d);
    if (rc == KV_ENOTFOUND) rc = 0;
    else if (rc == 0) *earned = a.credits;
    if (rc == 0) rc = l->ops->node_receipts(l->s, node, n_receipts, products, d);
    l->ops->rollback(l->s);
    return rc;
}

typedef struct {
    int (*fn)(void *ctx, const kv_ledger_entry *e);
    void *ctx;
} kv_stmt_ctx;
static int kv_stmt_cb(void *ctx, const kv_store_transfer *t) {
    kv_stmt_ctx *c = ctx;
    kv_ledger_entry e;
    memset(&e, 0, sizeof e);
    e.seq = t->seq;
    memcpy(e.id, t->id, 16);
    memcpy(e.debit, t->debit, sizeof e.debit);
    memcpy(e.credit, t->credit, sizeof e.credit);
    e.amount = t->amount;
    e.code = t->code;
    e.ts = t->ts;
    return c->fn(c->ctx, &e);
}
int kv_ledger_statement(kv_ledger *l, const char *account, int (*fn)(void *ctx, const kv_ledger_entry *e),
                        void *ctx, kv_diag *d) {
    if (account && !kv_account_kind(account)) return kv_fail(d, KV_EINVAL, "'%s' is not an account id", account);
    kv_stmt_ctx c = {fn, ctx};
    int rc = l->ops->begin_read(l->s, d);
    if (rc) return rc;
    rc = l->ops->each_transfer(l->s, account, kv_stmt_cb, &c, d);
    l->ops->rollback(l->s);
    return rc;
}

int kv_ledger_check(kv_ledger *l, kv_ledger_report *rep, kv_diag *d) {
    kv_ledger_report tmp;
    if (!rep) rep = &tmp;
    memset(rep, 0, sizeof *rep);
    kv_store_check c;
    int rc = l->ops->begin_read(l->s, d);
    if (rc) return rc;
    rc = l->ops->check(l->s, &c, d);
    l->ops->rollback(l->s);
    if (rc) return rc;
    rep->n_accounts = c.n_accounts;
    rep->n_transfers = c.n_transfers;
    rep->n_receipts = c.n_receipts;
    rep->supply = c.supply;
    rep->issued = c.issued;
    rep->escrow_held = c.escrow_balance;
    rep->n_held = c.n_held;
    rep->n_settled = c.n_settled;
    rep->n_released = c.n_released;
    char *f = rep->failed;
    size_t fs = sizeof rep->failed;
    if (c.sum_debits != c.sum_credits || c.sum_debits != c.sum_amount)
        snprintf(f, fs, "debits %llu != credits %llu (journal %llu)", (unsigned long long)c.sum_debits,
                 (unsigned long long)c.sum_credits, (unsigned long long)c.sum_amount);
    else if (c.n_bad_account)
        snprintf(f, fs, "%llu accounts' balances differ from their journal sums (first: %s)",
                 (unsigned long long)c.n_bad_account, c.bad_account);
    else if (c.n_negative)
        snprintf(f, fs, "%llu balances are negative", (unsigned long long)c.n_negative);
    else if (c.supply != c.issued || c.mint_balance != -(int64_t)c.issued)
        snprintf(f, fs, "supply %llu != issued %llu (mint %lld)", (unsigned long long)c.supply,
                 (unsigned long long)c.issued, (long long)c.mint_balance);
    else if (c.supply > KV_LEDGER_MAX_AMOUNT)
        snprintf(f, fs, "supply %llu passes 2^62-1", (unsigned long long)c.supply);
    else if (c.escrow_balance != c.held_sum)
        snprintf(f, fs, "escrow holds %llu, open authorizations %llu", (unsigned long long)c.escrow_balance,
                 (unsigned long long)c.held_sum);
    else if (c.n_untraced_reward || c.n_bad_node_credit)
        snprintf(f, fs, "%llu node credits do not trace to exactly one receipt",
                 (unsigned long long)(c.n_untraced_reward + c.n_bad_node_credit));
    else if (c.n_bad_auth)
        snprintf(f, fs, "%llu authorizations were held or settled other than once",
                 (unsigned long long)c.n_bad_auth);
    if (f[0]) return kv_fail(d, KV_EINTERNAL, "ledger invariant broken: %s", f);
    return 0;
}
