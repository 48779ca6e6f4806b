/* The ledger in one process: the journal (client ids, exactly-once retries,
 * no negative balance, the 2^62 bound), issuance by the operator only, the
 * authorization and receipt formats, escrow/settle/release against a
 * reference kept in plain integers, the exact split against big integers,
 * and the attacks of docs/LEDGER.md, each first shown to work against a
 * naive path kept here and then refused by the real one. Every case ends
 * with kv_ledger_check.
 * kv-test-labels: unit */
#include <pthread.h>
#include <sodium.h>
#include <sqlite3.h>
#include <stdatomic.h>

#include "ledger/ledger_internal.h"
#include "test_ledger_support.h"

/* ---- 1. the journal --------------------------------------------------------- */
static void test_transfer_ids(void) {
    kv_ledger *l = lt_new(NULL);
    kv_wallet c;
    kv_wallet_generate(&c, NULL);
    ASSERT_EQ(lt_issue(l, c.pk, 1000), 0);
    char ca[KV_LEDGER_ACCOUNT_MAX];
    kv_ledger_account_consumer(c.pk, ca);
    const kv_store_ops *ops = kv_ledger_ops(l);
    kv_store *s = kv_ledger_store(l);
    uint8_t id[16] = {1, 2, 3}, ref[16] = {9};
    kv_diag d = {0};
    /* created, then an identical retry answers EXISTS and moves nothing */
    ASSERT_EQ(ops->begin_write(s, &d), 0);
    ASSERT_EQ(kv_ledger_xfer(l, id, ca, "treasury", KV_ACCT_TREASURY, 300, KV_XFER_FEE, ref, 16, &d), 0);
    ASSERT_EQ(kv_ledger_xfer(l, id, ca, "treasury", KV_ACCT_TREASURY, 300, KV_XFER_FEE, ref, 16, &d), KV_LEDGER_EXISTS);
    /* any field changed: rejected */
    ASSERT_EQ(kv_ledger_xfer(l, id, ca, "treasury", KV_ACCT_TREASURY, 301, KV_XFER_FEE, ref, 16, &d), KV_LEDGER_RCONFLICT);
    ASSERT_EQ(kv_ledger_xfer(l, id, ca, "escrow", KV_ACCT_ESCROW, 300, KV_XFER_FEE, ref, 16, &d), KV_LEDGER_RCONFLICT);
    ASSERT_EQ(kv_ledger_xfer(l, id, ca, "treasury", KV_ACCT_TREASURY, 300, KV_XFER_RETURN, ref, 16, &d), KV_LEDGER_RCONFLICT);
    uint8_t ref2[16] = {8};
    ASSERT_EQ(kv_ledger_xfer(l, id, ca, "treasury", KV_ACCT_TREASURY, 300, KV_XFER_FEE, ref2, 16, &d), KV_LEDGER_RCONFLICT);
    /* a balance never goes below zero: 700 left, 701 refused */
    uint8_t id2[16] = {4};
    ASSERT_EQ(kv_ledger_xfer(l, id2, ca, "treasury", KV_ACCT_TREASURY, 701, KV_XFER_FEE, ref, 16, &d), KV_LEDGER_RFUNDS);
    ASSERT_EQ(kv_ledger_xfer(l, id2, ca, "treasury", KV_ACCT_TREASURY, 700, KV_XFER_FEE, ref, 16, &d), 0);
    uint8_t id3[16] = {5};
    ASSERT_EQ(kv_ledger_xfer(l, id3, ca, "treasury", KV_ACCT_TREASURY, 1, KV_XFER_FEE, ref, 16, &d), KV_LEDGER_RFUNDS);
    ASSERT_EQ(kv_ledger_xfer(l, id3, "treasury", "mint", KV_ACCT_MINT, 1, KV_XFER_FEE, ref, 16, &d), KV_LEDGER_RACCOUNT);
    ASSERT_EQ(kv_ledger_xfer(l, id3, ca, "treasury", KV_ACCT_TREASURY, 0, KV_XFER_FEE, ref, 16, &d), KV_LEDGER_RLIMIT);
    ASSERT_EQ(ops->commit(s, &d), 0);
    ASSERT_EQ(lt_bal_c(l, c.pk), 0);
    ASSERT_EQ(lt_bal(l, "treasury"), 1000);
    /* a rolled-back transaction leaves nothing */
    ASSERT_EQ(ops->begin_write(s, &d), 0);
    uint8_t id4[16] = {6};
    ASSERT_EQ(kv_ledger_xfer(l, id4, "treasury", ca, KV_ACCT_CONSUMER, 10, KV_XFER_RETURN, ref, 16, &d), 0);
    ops->rollback(s);
    ASSERT_EQ(lt_bal(l, "treasury"), 1000);
    ASSERT_EQ(lt_bal_c(l, c.pk), 0);
    lt_check(l);
    kv_ledger_free(l);
}

/* The check itself must be able to fail: corrupt each invariant by SQL. */
static void test_check_detects(void) {
    static const char *const breakers[] = {
        "UPDATE accounts SET balance = balance + 1, credits = credits + 1 WHERE id = 'treasury'",
        "UPDATE accounts SET balance = balance - 5 WHERE kind = 1",
        "UPDATE transfers SET amount = amount + 1 WHERE code = 1",
        "DELETE FROM receipts",
        "UPDATE auths SET state = 1",
        "UPDATE auths SET max = max + 7",
    };
    for (size_t b = 0; b < sizeof breakers / sizeof breakers[0]; b++) {
        char path[256];
        kv_ledger *l = lt_new(path);
        kv_wallet c, n;
        kv_wallet_generate(&c, NULL);
        kv_wallet_generate(&n, NULL);
        lt_issue(l, c.pk, 100000);
        kv_auth a = lt_auth(&c, LT_GW, 50000);
        ASSERT_EQ(kv_ledger_escrow(l, &a, LT_GW, (uint64_t)time(NULL), NULL), 0);
        lt_settle s;
        uint64_t cnt = 10;
        lt_mk_settle(&s, &a, &n, &cnt, 1, 1, 10, 20, 100, 200);
        ASSERT_EQ(kv_ledger_settle(l, &s.req, NULL, NULL), 0);
        lt_check(l);
        ASSERT_EQ(lt_sql(path, breakers[b]), 0);
        kv_ledger_report r;
        kv_diag d = {0};
        ASSERT_EQ(kv_ledger_check(l, &r, &d), KV_EINTERNAL);
        ASSERT_TRUE(r.failed[0] != 0);
        kv_ledger_free(l);
    }
}

/* ---- 3. issuance ------------------------------------------------------------------ */
static void test_issue_operator_only(void) {
    kv_ledger *l = lt_new(NULL);
    kv_wallet c, other;
    kv_wallet_generate(&c, NULL);
    kv_wallet_generate(&other, NULL);
    kv_issue is;
    kv_diag d = {0};
    /* signed by a key that is not the operator's: refused, nothing issued */
    ASSERT_EQ(kv_issue_sign(&is, &other, c.pk, 500, NULL, &d), 0);
    ASSERT_EQ(kv_ledger_issue(l, &is, &d), KV_LEDGER_RSIGNATURE);
    /* a real one with its amount changed after signing: refused */
    uint8_t id[16] = {7};
    ASSERT_EQ(kv_issue_sign(&is, &lt_op, c.pk, 500, id, &d), 0);
    kv_issue forged = is;
    forged.amount = 5000000;
    ASSERT_EQ(kv_ledger_issue(l, &forged, &d), KV_LEDGER_RSIGNATURE);
    ASSERT_EQ(kv_ledger_issue(l, &is, &d), 0);
    ASSERT_EQ(kv_ledger_issue(l, &is, &d), KV_LEDGER_EXISTS); /* exactly once */
    kv_issue again;
    ASSERT_EQ(kv_issue_sign(&again, &lt_op, c.pk, 501, id, &d), 0);
    ASSERT_EQ(kv_ledger_issue(l, &again, &d), KV_LEDGER_RCONFLICT);
    ASSERT_EQ(lt_bal_c(l, c.pk), 500);
    /* the supply bound: up to 2^62-1 in all, never past it */
    ASSERT_EQ(lt_issue(l, c.pk, KV_LEDGER_MAX_AMOUNT - 500), 0);
    ASSERT_EQ(lt_issue(l, c.pk, 1), KV_LEDGER_RLIMIT);
    ASSERT_EQ(lt_bal_c(l, c.pk), KV_LEDGER_MAX_AMOUNT);
    ASSERT_EQ(lt_bal(l, "mint"), KV_LEDGER_MAX_AMOUNT);
    ASSERT_EQ(kv_issue_sign(&is, &lt_op, c.pk, KV_LEDGER_MAX_AMOUNT + 1, NULL, &d), KV_EINVAL);
    lt_check(l);
    kv_ledger_free(l);
}

/* ---- 2. formats ------------------------------------------------------------------ */
static void test_auth_format(void) {
    kv_wallet c;
    kv_wallet_generate(&c, NULL);
    kv_auth a = lt_auth(&c, "gateway.example:443", 123456789), b;
    char hdr[KV_AUTH_HEADER_MAX];
    kv_diag d = {0};
    ASSERT_EQ(kv_auth_encode(&a, hdr, sizeof hdr, &d), 0);
    ASSERT_EQ(strlen(hdr), 229);
    ASSERT_EQ(kv_auth_decode(&b, hdr, strlen(hdr), &d), 0);
    ASSERT_TRUE(!memcmp(&a, &b, sizeof a));
    /* the documented offsets (docs/LEDGER.md) */
    uint8_t bytes[KV_AUTH_SIZE];
    ASSERT_EQ(kv_auth_to_bytes(&a, bytes, &d), 0);
    ASSERT_TRUE(!memcmp(bytes, "KVRA\x01\0\0\0", 8));
    ASSERT_TRUE(!memcmp(bytes + 8, c.pk, 32));
    ASSERT_TRUE(!memcmp(bytes + 40, "gateway.example:443", 19) && bytes[59] == 0);
    ASSERT_EQ(bytes[72] | bytes[73] << 8 | bytes[74] << 16 | bytes[75] << 24, 123456789);
    ASSERT_TRUE(!memcmp(bytes + 88, a.nonce, 16));
    /* every single-byte change of the bytes is refused */
    int refused = 0;
    for (size_t i = 0; i < KV_AUTH_SIZE; i++) {
        uint8_t m[KV_AUTH_SIZE];
        memcpy(m, bytes, sizeof m);
        m[i] ^= 0x01;
        refused += kv_auth_from_bytes(&b, m, sizeof m, NULL) != 0;
    }
    ASSERT_EQ(refused, KV_AUTH_SIZE);
    /* every single-character change of the header too */
    refused = 0;
    for (size_t i = 0; i < strlen(hdr); i++) {
        char m[KV_AUTH_HEADER_MAX];
        memcpy(m, hdr, sizeof m);
        m[i] = m[i] == 'A' ? 'B' : 'A';
        refused += kv_auth_decode(&b, m, strlen(m), NULL) != 0;
    }
    ASSERT_EQ(refused, (long long)strlen(hdr));
    ASSERT_EQ(kv_auth_decode(&b, hdr, strlen(hdr) - 1, NULL), KV_EFORMAT);
    ASSERT_EQ(kv_auth_decode(&b, "", 0, NULL), KV_EFORMAT);
    ASSERT_EQ(kv_auth_decode(&b, hdr, 5, NULL), KV_EFORMAT);
    /* a receipt's bytes are never an authorization */
    kv_receipt r;
    uint8_t dig[32] = {0}, rb[KV_RECEIPT_SIZE];
    ASSERT_EQ(kv_receipt_sign(&r, &c, &a, 5, dig, &d), 0);
    ASSERT_EQ(kv_receipt_to_bytes(&r, rb, &d), 0);
    ASSERT_EQ(kv_auth_from_bytes(&b, rb, KV_AUTH_SIZE, NULL), KV_EFORMAT);
    kv_receipt r2;
    ASSERT_EQ(kv_receipt_from_bytes(&r2, rb, sizeof rb, &d), 0);
    ASSERT_TRUE(!memcmp(&r, &r2, sizeof r));
    rb[120] ^= 1;
    ASSERT_EQ(kv_receipt_from_bytes(&r2, rb, sizeof rb, NULL), KV_LEDGER_RSIGNATURE);
    /* bad gateway ids and amounts */
    ASSERT_EQ(kv_auth_sign(&b, &c, "", 5, 10, NULL), KV_EINVAL);
    ASSERT_EQ(kv_auth_sign(&b, &c, "has space", 5, 10, NULL), KV_EINVAL);
    ASSERT_EQ(kv_auth_sign(&b, &c, "123456789012345678901234567890123", 5, 10, NULL), KV_EINVAL);
    ASSERT_EQ(kv_auth_sign(&b, &c, "g", 0, 10, NULL), KV_EINVAL);
    ASSERT_EQ(kv_auth_sign(&b, &c, "g", KV_LEDGER_MAX_AMOUNT + 1, 10, NULL), KV_EINVAL);
}

static void test_wallet_file(void) {
    char p[300];
    snprintf(p, sizeof p, "%s/w.key", lt_dir);
    kv_wallet w, r;
    kv_diag d = {0};
    ASSERT_EQ(kv_wallet_generate(&w, &d), 0);
    ASSERT_EQ(kv_wallet_save(&w, p, &d), 0);
    ASSERT_EQ(kv_wallet_save(&w, p, &d), KV_EIO); /* never overwrites */
    ASSERT_EQ(kv_wallet_load(&r, p, &d), 0);
    ASSERT_TRUE(!memcmp(&w, &r, sizeof w));
    FILE *f = fopen(p, "r+");
    fseek(f, 20, SEEK_SET);
    fputc('z', f);
    fclose(f);
    ASSERT_EQ(kv_wallet_load(&r, p, &d), KV_EFORMAT);
    snprintf(p, sizeof p, "%s/missing.key", lt_dir);
    ASSERT_EQ(kv_wallet_load(&r, p, &d), KV_EIO);
}

/* ---- 2. escrow, settle, release against a reference ---------------------------------- */
static void test_escrow_settle_release(void) {
    kv_ledger *l = lt_new(NULL);
    kv_wallet c, nodes[3];
    kv_wallet_generate(&c, NULL);
    for (int i = 0; i < 3; i++) kv_wallet_generate(&nodes[i], NULL);
    uint64_t ref_c = 1000000, ref_t = 0, ref_n[3] = {0};
    ASSERT_EQ(lt_issue(l, c.pk, ref_c), 0);
    uint64_t now = (uint64_t)time(NULL);
    kv_diag d = {0};
    kv_settle_result res;

    /* a completion: three nodes, two with receipts; the third's share returns */
    kv_auth a = lt_auth(&c, LT_GW, 100000);
    ASSERT_EQ(kv_ledger_escrow(l, &a, LT_GW, now, &d), 0);
    ASSERT_EQ(lt_bal_c(l, c.pk), ref_c - 100000);
    ASSERT_EQ(lt_bal(l, "escrow"), 100000);
    lt_settle s;
    uint64_t counts[3] = {7, 11, 13};
    lt_mk_settle(&s, &a, nodes, counts, 3, 0x3, 37, 101, 30, 90); /* cost 1110 + 9090 = 10200 */
    lt_expect e = lt_expect_of(&s);
    ASSERT_EQ(e.cost, 10200);
    ASSERT_EQ(kv_ledger_settle(l, &s.req, &res, &d), 0);
    ASSERT_EQ(res.cost, e.cost);
    ASSERT_EQ(res.fee, e.fee);
    ASSERT_EQ(res.to_nodes, e.node[0] + e.node[1]);
    ASSERT_EQ(res.returned, 100000 - e.charged);
    ref_c -= e.charged;
    ref_t += e.fee;
    for (int i = 0; i < 3; i++) ref_n[i] += e.node[i];
    ASSERT_EQ(e.node[2], 0);
    /* identical retry: EXISTS, same figures, nothing moves; changed: refused */
    kv_settle_result res2;
    ASSERT_EQ(kv_ledger_settle(l, &s.req, &res2, &d), KV_LEDGER_EXISTS);
    ASSERT_TRUE(!memcmp(&res, &res2, sizeof res));
    s.req.completion_tokens++;
    ASSERT_EQ(kv_ledger_settle(l, &s.req, &res2, &d), KV_LEDGER_RCONFLICT);
    ASSERT_EQ(kv_ledger_release(l, a.consumer, a.nonce, &d), KV_LEDGER_RSTATE);

    /* a failed completion: released whole, twice is EXISTS, settle after is refused */
    kv_auth b = lt_auth(&c, LT_GW, 5000);
    ASSERT_EQ(kv_ledger_escrow(l, &b, LT_GW, now, &d), 0);
    ASSERT_EQ(kv_ledger_release(l, b.consumer, b.nonce, &d), 0);
    ASSERT_EQ(kv_ledger_release(l, b.consumer, b.nonce, &d), KV_LEDGER_EXISTS);
    lt_mk_settle(&s, &b, nodes, counts, 1, 1, 1, 1, 1, 1);
    ASSERT_EQ(kv_ledger_settle(l, &s.req, &res, &d), KV_LEDGER_RSTATE);

    /* cost above the max: refused, escrow untouched, then released */
    kv_auth m = lt_auth(&c, LT_GW, 1000);
    ASSERT_EQ(kv_ledger_escrow(l, &m, LT_GW, now, &d), 0);
    lt_mk_settle(&s, &m, nodes, counts, 2, 3, 10, 10, 50, 51); /* 1010 > 1000 */
    ASSERT_EQ(kv_ledger_settle(l, &s.req, &res, &d), KV_LEDGER_ROVERMAX);
    ASSERT_EQ(lt_bal(l, "escrow"), 1000);
    lt_mk_settle(&s, &m, nodes, counts, 2, 3, 10, 10, UINT64_MAX / 2, 3); /* overflow */
    ASSERT_EQ(kv_ledger_settle(l, &s.req, &res, &d), KV_LEDGER_ROVERMAX);
    /* exactly the max is fine; no log at all: cost - fee returns to the consumer */
    lt_mk_settle(&s, &m, nodes, counts, 0, 0, 10, 10, 50, 50);
    e = lt_expect_of(&s);
    ASSERT_EQ(kv_ledger_settle(l, &s.req, &res, &d), 0);
    ASSERT_EQ(res.cost, 1000);
    ASSERT_EQ(res.returned, 1000 - e.fee);
    ref_c -= e.fee;
    ref_t += e.fee;

    /* refused authorizations charge nothing */
    kv_auth x = lt_auth(&c, LT_GW, ref_c + 1);
    ASSERT_EQ(kv_ledger_escrow(l, &x, LT_GW, now, &d), KV_LEDGER_RFUNDS);
    kv_auth y = lt_auth(&c, "other-gw", 10);
    ASSERT_EQ(kv_ledger_escrow(l, &y, LT_GW, now, &d), KV_LEDGER_RGATEWAY);
    kv_auth z;
    ASSERT_EQ(kv_auth_sign(&z, &c, LT_GW, 10, now - 1, NULL), 0);
    ASSERT_EQ(kv_ledger_escrow(l, &z, LT_GW, now, &d), KV_LEDGER_REXPIRED);
    ASSERT_EQ(kv_auth_sign(&z, &c, LT_GW, 10, now, NULL), 0);
    ASSERT_EQ(kv_ledger_escrow(l, &z, LT_GW, now, &d), KV_LEDGER_REXPIRED); /* usable while now < expires */
    kv_wallet poor;
    kv_wallet_generate(&poor, NULL);
    kv_auth p = lt_auth(&poor, LT_GW, 1);
    ASSERT_EQ(kv_ledger_escrow(l, &p, LT_GW, now, &d), KV_LEDGER_RFUNDS);
    ASSERT_TRUE(kv_ledger_refused(KV_LEDGER_RFUNDS) && !kv_ledger_refused(KV_EIO) && !kv_ledger_refused(0));

    ASSERT_EQ(lt_bal_c(l, c.pk), ref_c);
    ASSERT_EQ(lt_bal(l, "treasury"), ref_t);
    for (int i = 0; i < 3; i++) ASSERT_EQ(lt_bal_n(l, nodes[i].pk), ref_n[i]);
    ASSERT_EQ(lt_bal(l, "escrow"), 0);
    ASSERT_EQ(ref_c + ref_t + ref_n[0] + ref_n[1] + ref_n[2], 1000000);
    lt_check(l);
    kv_ledger_free(l);
}

/* ---- the split against big integers ---------------------------------------------------- */
static uint64_t lt_rand64(void) {
    return (uint64_t)rand() << 42 ^ (uint64_t)rand() << 21 ^ (uint64_t)rand();
}
static void test_split_reference(void) {
    srand(12345);
    uint64_t counts[KV_LEDGER_MAX_LOG], got[KV_LEDGER_MAX_LOG], want[KV_LEDGER_MAX_LOG];
    static uint8_t ids[KV_LEDGER_MAX_LOG][32];
    int mismatches = 0;
    for (int t = 0; t < 400; t++) {
        size_t n = 1 + (size_t)rand() % (t < 390 ? 9 : KV_LEDGER_MAX_LOG);
        int kind = t % 4;
        uint64_t pool = kind == 0 ? (uint64_t)rand() % 100 : kind == 1 ? KV_LEDGER_MAX_AMOUNT - (uint64_t)rand() % 3
                                                                       : lt_rand64() & KV_LEDGER_MAX_AMOUNT;
        for (size_t i = 0; i < n; i++) {
            counts[i] = t % 3 == 0 ? 1 + (uint64_t)rand() % 3 : t % 3 == 1 ? KV_LEDGER_MAX_PRODUCTS - (uint64_t)rand() % 2
                                                                          : 1 + lt_rand64() % KV_LEDGER_MAX_PRODUCTS;
            for (int b = 0; b < 32; b++) ids[i][b] = (uint8_t)rand();
            if (t % 5 == 0) ids[i][0] = 0; /* near ties in id order too */
        }
        ASSERT_EQ(kv_ledger_split(pool, counts, (const uint8_t(*)[32])ids, n, got, NULL), 0);
        lt_ref_split(pool, counts, (const uint8_t(*)[32])ids, n, want);
        uint64_t sum = 0;
        for (size_t i = 0; i < n; i++) {
            mismatches += got[i] != want[i];
            sum += got[i];
        }
        ASSERT_EQ(sum, pool);
    }
    ASSERT_EQ(mismatches, 0);
    /* ties: equal counts, 10 among 3: the smallest id gets the extra one */
    uint8_t tid[3][32] = {{3}, {1}, {2}};
    uint64_t tc[3] = {5, 5, 5};
    ASSERT_EQ(kv_ledger_split(10, tc, (const uint8_t(*)[32])tid, 3, got, NULL), 0);
    ASSERT_EQ(got[0], 3);
    ASSERT_EQ(got[1], 4);
    ASSERT_EQ(got[2], 3);
    tc[1] = 0;
    ASSERT_EQ(kv_ledger_split(10, tc, (const uint8_t(*)[32])tid, 3, got, NULL), KV_EINVAL);
    tc[1] = KV_LEDGER_MAX_PRODUCTS + 1;
    ASSERT_EQ(kv_ledger_split(10, tc, (const uint8_t(*)[32])tid, 3, got, NULL), KV_EINVAL);
}

/* ---- 4a. replaying a signed authorization --------------------------------------------- */
/* The naive gateway: verifies the signature and the balance, holds, forgets. */
typedef struct { uint64_t consumer, escrow; } naive_books;
static int naive_escrow(naive_books *b, const kv_auth *a) {
    if (kv_auth_verify(a, NULL) || b->consumer < a->max) return -1;
    b->consumer -= a->max;
    b->escrow += a->max;
    return 0;
}
static void test_attack_replay(void) {
    kv_wallet c;
    kv_wallet_generate(&c, NULL);
    kv_auth a = lt_auth(&c, LT_GW, 300);
    /* naive: the same header is held three times, at any gateway, after settling */
    naive_books nb = {1000, 0};
    ASSERT_EQ(naive_escrow(&nb, &a), 0);
    nb.escrow -= 300; /* settled */
    ASSERT_EQ(naive_escrow(&nb, &a), 0); /* replay after settlement */
    ASSERT_EQ(naive_escrow(&nb, &a), 0); /* replay at "another gateway" */
    ASSERT_EQ(nb.consumer, 100);          /* charged 900 for one authorization of 300 */

    kv_ledger *l = lt_new(NULL);
    ASSERT_EQ(lt_issue(l, c.pk, 1000), 0);
    uint64_t now = (uint64_t)time(NULL);
    kv_diag d = {0};
    ASSERT_EQ(kv_ledger_escrow(l, &a, LT_GW, now, &d), 0);
    ASSERT_EQ(kv_ledger_escrow(l, &a, LT_GW, now, &d), KV_LEDGER_RREPLAY);      /* same gateway, in flight */
    ASSERT_EQ(kv_ledger_escrow(l, &a, "gw-other", now, &d), KV_LEDGER_RGATEWAY); /* another gateway */
    kv_wallet n;
    kv_wallet_generate(&n, NULL);
    lt_settle s;
    uint64_t cnt = 4;
    lt_mk_settle(&s, &a, &n, &cnt, 1, 1, 10, 10, 5, 5);
    lt_expect e = lt_expect_of(&s);
    ASSERT_EQ(kv_ledger_settle(l, &s.req, NULL, &d), 0);
    ASSERT_EQ(kv_ledger_escrow(l, &a, LT_GW, now, &d), KV_LEDGER_RREPLAY); /* after settlement */
    /* the header re-signed for another gateway with the same nonce is a new
     * signature but the same authorization id: still used */
    kv_auth a2 = a;
    snprintf(a2.gateway, sizeof a2.gateway, "gw-other");
    uint8_t body[KV_AUTH_SIZE];
    ASSERT_EQ(kv_auth_to_bytes(&a2, body, &d), 0);
    crypto_sign_detached(a2.sig, NULL, body, KV_AUTH_BODY_SIZE, c.sk);
    ASSERT_EQ(kv_ledger_escrow(l, &a2, "gw-other", now, &d), KV_LEDGER_RREPLAY);
    ASSERT_EQ(lt_bal_c(l, c.pk), 1000 - e.charged);
    ASSERT_EQ(lt_bal_n(l, n.pk) + lt_bal(l, "treasury"), e.charged);
    lt_check(l);
    kv_ledger_free(l);
}

/* ---- 4b. forged, duplicated, invented receipts; crediting without work ------------------- */
/* The naive settle pays each receipt what it claims, from the escrow. */
static uint64_t naive_settle(uint64_t pool, const kv_receipt *r, size_t n, uint64_t *paid) {
    uint64_t claimed = 0;
    for (size_t i = 0; i < n; i++) claimed += r[i].n_products;
    for (size_t i = 0; i < n; i++) paid[i] = claimed ? pool * r[i].n_products / claimed : 0;
    return claimed;
}
static void test_attack_receipts(void) {
    kv_ledger *l = lt_new(NULL);
    kv_wallet c, nodes[3], thief;
    kv_wallet_generate(&c, NULL);
    kv_wallet_generate(&thief, NULL);
    for (int i = 0; i < 3; i++) kv_wallet_generate(&nodes[i], NULL);
    ASSERT_EQ(lt_issue(l, c.pk, 1000000), 0);
    uint64_t now = (uint64_t)time(NULL);
    kv_diag d = {0};
    kv_auth a = lt_auth(&c, LT_GW, 100000);
    ASSERT_EQ(kv_ledger_escrow(l, &a, LT_GW, now, &d), 0);
    uint64_t counts[2] = {10, 30};
    lt_settle s;
    lt_mk_settle(&s, &a, nodes, counts, 2, 3, 100, 100, 100, 100); /* cost 20000 */

    /* naive: a thief's invented receipt for 1000 products takes most of the pool */
    kv_receipt inv[3] = {s.rc[0], s.rc[1]};
    ASSERT_EQ(kv_receipt_sign(&inv[2], &thief, &a, 1000, s.log[0].log_digest, NULL), 0);
    uint64_t paid[3];
    naive_settle(19000, inv, 3, paid);
    ASSERT_TRUE(paid[2] > paid[0] + paid[1]);

    lt_settle bad;
    /* forged: node 0's receipt with the count raised (signature no longer verifies) */
    bad = s;
    bad.req.log = bad.log;
    bad.req.receipts = bad.rc;
    bad.rc[0].n_products = 20;
    bad.log[0].n_products = 20;
    ASSERT_EQ(kv_ledger_settle(l, &bad.req, NULL, &d), KV_LEDGER_RRECEIPT);
    /* a receipt that claims more than the coordinator's log says */
    bad = s;
    bad.req.log = bad.log;
    bad.req.receipts = bad.rc;
    ASSERT_EQ(kv_receipt_sign(&bad.rc[0], &nodes[0], &a, 11, bad.log[0].log_digest, NULL), 0);
    ASSERT_EQ(kv_ledger_settle(l, &bad.req, NULL, &d), KV_LEDGER_RRECEIPT);
    /* invented: a node that is not in the dispatch log */
    bad = s;
    bad.req.log = bad.log;
    bad.req.receipts = bad.rc;
    ASSERT_EQ(kv_receipt_sign(&bad.rc[1], &thief, &a, 30, bad.log[1].log_digest, NULL), 0);
    ASSERT_EQ(kv_ledger_settle(l, &bad.req, NULL, &d), KV_LEDGER_RRECEIPT);
    /* signed by the thief but naming node 1 */
    bad = s;
    bad.req.log = bad.log;
    bad.req.receipts = bad.rc;
    memcpy(bad.rc[1].node, thief.pk, 32);
    ASSERT_EQ(kv_receipt_sign(&bad.rc[1], &thief, &a, 30, bad.log[1].log_digest, NULL), 0);
    memcpy(bad.rc[1].node, nodes[1].pk, 32);
    ASSERT_EQ(kv_ledger_settle(l, &bad.req, NULL, &d), KV_LEDGER_RRECEIPT);
    /* duplicated within one request */
    bad = s;
    bad.req.log = bad.log;
    bad.req.receipts = bad.rc;
    bad.rc[1] = bad.rc[0];
    ASSERT_EQ(kv_ledger_settle(l, &bad.req, NULL, &d), KV_LEDGER_RRECEIPT);
    /* a receipt for another authorization */
    kv_auth other = lt_auth(&c, LT_GW, 10);
    bad = s;
    bad.req.log = bad.log;
    bad.req.receipts = bad.rc;
    ASSERT_EQ(kv_receipt_sign(&bad.rc[0], &nodes[0], &other, 10, bad.log[0].log_digest, NULL), 0);
    ASSERT_EQ(kv_ledger_settle(l, &bad.req, NULL, &d), KV_LEDGER_RRECEIPT);
    /* signed by the right node for this authorization, but via another gateway */
    kv_auth elsewhere = a;
    snprintf(elsewhere.gateway, sizeof elsewhere.gateway, "gw-elsewhere");
    bad = s;
    bad.req.log = bad.log;
    bad.req.receipts = bad.rc;
    ASSERT_EQ(kv_receipt_sign(&bad.rc[0], &nodes[0], &elsewhere, 10, bad.log[0].log_digest, NULL), 0);
    ASSERT_EQ(kv_ledger_settle(l, &bad.req, NULL, &d), KV_LEDGER_RRECEIPT);
    ASSERT_TRUE(strstr(d.msg, "gateway") != NULL);
    /* nothing moved by any of those */
    ASSERT_EQ(lt_bal(l, "escrow"), 100000);
    ASSERT_EQ(lt_bal_n(l, nodes[0].pk) + lt_bal_n(l, nodes[1].pk) + lt_bal_n(l, thief.pk), 0);

    lt_expect e = lt_expect_of(&s);
    ASSERT_EQ(kv_ledger_settle(l, &s.req, NULL, &d), 0);
    ASSERT_EQ(lt_bal_n(l, nodes[0].pk), e.node[0]);
    ASSERT_EQ(lt_bal_n(l, nodes[1].pk), e.node[1]);
    /* duplicated across completions: the same receipts against a new hold */
    kv_auth b = lt_auth(&c, LT_GW, 100000);
    ASSERT_EQ(kv_ledger_escrow(l, &b, LT_GW, now, &d), 0);
    lt_settle s2 = s;
    s2.req.log = s2.log;
    s2.req.receipts = s2.rc;
    memcpy(s2.req.consumer, b.consumer, 32);
    memcpy(s2.req.nonce, b.nonce, 16);
    ASSERT_EQ(kv_ledger_settle(l, &s2.req, NULL, &d), KV_LEDGER_RRECEIPT);
    /* crediting a node without work: no call does it */
    kv_issue is;
    ASSERT_EQ(kv_issue_sign(&is, &thief, thief.pk, 1000, NULL, &d), 0);
    ASSERT_EQ(kv_ledger_issue(l, &is, &d), KV_LEDGER_RSIGNATURE);   /* issuance needs the operator */
    ASSERT_EQ(kv_issue_sign(&is, &lt_op, nodes[2].pk, 1000, NULL, &d), 0);
    ASSERT_EQ(kv_ledger_issue(l, &is, &d), 0);                      /* funds consumer:KEY, never node:KEY */
    lt_settle none;
    uint64_t counts3[3] = {10, 30, 5};
    lt_mk_settle(&none, &b, nodes, counts3, 3, 0, 1, 1, 1000, 1000); /* log but no receipt */
    e = lt_expect_of(&none);
    ASSERT_EQ(kv_ledger_settle(l, &none.req, NULL, &d), 0);
    ASSERT_EQ(lt_bal_n(l, nodes[2].pk), 0);
    ASSERT_EQ(kv_ledger_release(l, b.consumer, b.nonce, &d), KV_LEDGER_RSTATE);
    uint64_t nrel = 9;
    ASSERT_EQ(kv_ledger_recover(l, LT_GW, &nrel, &d), 0);
    ASSERT_EQ(nrel, 0);
    ASSERT_EQ(lt_bal_n(l, nodes[0].pk), lt_expect_of(&s).node[0]);
    ASSERT_EQ(lt_bal_n(l, thief.pk), 0);
    lt_check(l);
    kv_ledger_free(l);
}

/* ---- recover while the dead run's last settle lands ------------------------------------------ */
/* kv_ledger_recover lists the held authorizations, then releases each. A
 * settle by another handle can commit between the two (PostgreSQL finishes a
 * COMMIT whose client was killed): the wrapped auth_held below lands one
 * right after the list is read. */
static kv_ledger *lr_other;     /* the dead run's connection */
static lt_settle *lr_late;      /* its settle that commits late */
static const kv_store_ops *lr_real;
static int lr_auth_held(kv_store *s, const char *gateway, kv_store_auth *out, size_t cap, size_t *n, kv_diag *d) {
    int rc = lr_real->auth_held(s, gateway, out, cap, n, d);
    if (rc == 0 && lr_late) {
        ASSERT_EQ(kv_ledger_settle(lr_other, &lr_late->req, NULL, NULL), 0);
        lr_late = NULL;
    }
    return rc;
}
static void test_recover_late_settle(void) {
    char path[256];
    kv_ledger *l = lt_new(path);
    kv_wallet c, nodes[2];
    kv_wallet_generate(&c, NULL);
    for (int i = 0; i < 2; i++) kv_wallet_generate(&nodes[i], NULL);
    ASSERT_EQ(lt_issue(l, c.pk, 1000000), 0);
    uint64_t now = (uint64_t)time(NULL);
    kv_auth a[3];
    for (int i = 0; i < 3; i++) {
        a[i] = lt_auth(&c, LT_GW, 20000);
        ASSERT_EQ(kv_ledger_escrow(l, &a[i], LT_GW, now, NULL), 0);
    }
    lt_settle s;
    uint64_t counts[2] = {7, 3};
    lt_mk_settle(&s, &a[1], nodes, counts, 2, 3, 10, 10, 1000, 1000);
    lt_expect e = lt_expect_of(&s);
    ASSERT_EQ(kv_ledger_open(&lr_other, path, NULL), 0);
    kv_store_ops wrapped = *kv_ledger_ops(l);
    lr_real = kv_ledger_ops(l);
    wrapped.auth_held = lr_auth_held;
    lr_late = &s;
    kv_ledger_set_ops(l, &wrapped);
    uint64_t n = 0;
    kv_diag d = {0};
    int rc = kv_ledger_recover(l, LT_GW, &n, &d);
    kv_ledger_set_ops(l, lr_real);
    ASSERT_EQ(rc, 0);
    if (rc) fprintf(stderr, "recover: %s\n", d.msg);
    ASSERT_TRUE(lr_late == NULL); /* the settle did land inside the call */
    ASSERT_EQ(n, 2);              /* a[0] and a[2]; a[1] stays settled */
    ASSERT_EQ(kv_ledger_release(l, a[1].consumer, a[1].nonce, NULL), KV_LEDGER_RSTATE);
    ASSERT_EQ(kv_ledger_release(l, a[0].consumer, a[0].nonce, NULL), KV_LEDGER_EXISTS);
    ASSERT_EQ(lt_bal(l, "escrow"), 0);
    ASSERT_EQ(lt_bal_c(l, c.pk), 1000000 - e.charged);
    ASSERT_TRUE(e.node[0] > 0 && e.node[1] > 0);
    ASSERT_EQ(lt_bal_n(l, nodes[0].pk), e.node[0]);
    ASSERT_EQ(lt_bal_n(l, nodes[1].pk), e.node[1]);
    lt_check(l);
    kv_ledger_free(lr_other);
    lr_other = NULL;
    kv_ledger_free(l);
}

/* ---- 4c. concurrent spends from one balance, across threads ------------------------------- */
#define LT_THREADS 8
typedef struct {
    const char *path;
    pthread_barrier_t *bar;
    const kv_auth *auth;
    int rc;
    const char *acct;
} lt_spend;

/* The naive spend: read the balance, then write it back, in two statements. */
static void lt_bar_wait(void *bar) { pthread_barrier_wait(bar); }
static void *naive_spend_thread(void *p) {
    lt_spend *t = p;
    /* every spender has read the same balance before any writes */
    t->rc = lt_naive_spend(t->path, t->acct, t->auth->max, lt_bar_wait, t->bar) == 0 ? 0 : -1;
    return NULL;
}
static void *real_spend_thread(void *p) {
    lt_spend *t = p;
    kv_ledger *l = NULL;
    kv_ledger_open(&l, t->path, NULL);
    pthread_barrier_wait(t->bar);
    t->rc = l ? kv_ledger_escrow(l, t->auth, LT_GW, (uint64_t)time(NULL), NULL) : KV_EIO;
    kv_ledger_free(l);
    return NULL;
}
static void test_attack_concurrent_threads(void) {
    for (int naive = 1; naive >= 0; naive--) {
        char path[256];
        kv_ledger *l = lt_new(path);
        kv_wallet c;
        kv_wallet_generate(&c, NULL);
        ASSERT_EQ(lt_issue(l, c.pk, 1000), 0);
        char acct[KV_LEDGER_ACCOUNT_MAX];
        kv_ledger_account_consumer(c.pk, acct);
        kv_auth auths[LT_THREADS];
        lt_spend t[LT_THREADS];
        pthread_t th[LT_THREADS];
        pthread_barrier_t bar;
        pthread_barrier_init(&bar, NULL, LT_THREADS);
        for (int i = 0; i < LT_THREADS; i++) {
            auths[i] = lt_auth(&c, LT_GW, 300); /* 1000 covers three */
            t[i] = (lt_spend){path, &bar, &auths[i], 0, acct};
            pthread_create(&th[i], NULL, naive ? naive_spend_thread : real_spend_thread, &t[i]);
        }
        int ok = 0, funds = 0;
        for (int i = 0; i < LT_THREADS; i++) {
            pthread_join(th[i], NULL);
            ok += t[i].rc == 0;
            funds += t[i].rc == KV_LEDGER_RFUNDS;
        }
        pthread_barrier_destroy(&bar);
        if (naive) {
            /* every spender saw 1000 and spent 300 of it: 2400 held from 1000 */
            ASSERT_TRUE(ok > 3);
            ASSERT_TRUE(lt_bal(l, "escrow") > 1000);
            ASSERT_EQ(kv_ledger_check(l, NULL, NULL), KV_EINTERNAL);
        } else {
            ASSERT_EQ(ok, 3);
            ASSERT_EQ(funds, LT_THREADS - 3);
            ASSERT_EQ(lt_bal_c(l, c.pk), 100);
            ASSERT_EQ(lt_bal(l, "escrow"), 900);
            lt_check(l);
        }
        kv_ledger_free(l);
    }
}

/* ---- 6. load: 10,000 random operations from 8 clients, invariants throughout -------------- */
#define LT_OPS 10000
#define LT_NODES 4
typedef struct {
    const char *path;
    int idx;
    kv_wallet consumer;
    const kv_wallet *nodes;
    uint64_t ref_consumer, ref_treasury, ref_node[LT_NODES]; /* the reference books */
    uint64_t n_ops, n_bad;                                  /* ops done; unexpected results */
} lt_client;
static atomic_int lt_load_done;

static void *lt_load_thread(void *p) {
    lt_client *c = p;
    kv_ledger *l = NULL;
    kv_diag d = {0};
    if (kv_ledger_open(&l, c->path, &d)) { c->n_bad++; return NULL; }
    unsigned seed = 1000u + (unsigned)c->idx;
    kv_auth old[32];
    lt_settle old_s[32];
    int n_old = 0;
    for (int op = 0; op < LT_OPS / LT_THREADS; op++, c->n_ops++) {
        int r = rand_r(&seed) % 100;
        uint64_t now = (uint64_t)time(NULL);
        if (r < 10 || c->ref_consumer < 1000) { /* issue */
            uint64_t amt = 1 + (uint64_t)(rand_r(&seed) % 100000);
            if (lt_issue(l, c->consumer.pk, amt) != 0) c->n_bad++;
            else c->ref_consumer += amt;
        } else if (r < 55) { /* a completion: escrow, settle */
            uint64_t max = 1 + (uint64_t)(rand_r(&seed) % (int)(c->ref_consumer < 20000 ? c->ref_consumer : 20000));
            kv_auth a = lt_auth(&c->consumer, LT_GW, max);
            if (kv_ledger_escrow(l, &a, LT_GW, now, &d) != 0) { c->n_bad++; continue; }
            size_t n = 1 + (size_t)(rand_r(&seed) % LT_NODES);
            uint64_t counts[LT_NODES];
            for (size_t i = 0; i < n; i++) counts[i] = 1 + (uint64_t)(rand_r(&seed) % 500);
            unsigned mask = (unsigned)rand_r(&seed) % (1u << n);
            lt_settle s;
            uint64_t pt = (uint64_t)(rand_r(&seed) % 100), ct = (uint64_t)(rand_r(&seed) % 100);
            lt_mk_settle(&s, &a, c->nodes, counts, n, mask, pt, ct, 1 + (uint64_t)(rand_r(&seed) % 3),
                         1 + (uint64_t)(rand_r(&seed) % 5));
            lt_expect e = lt_expect_of(&s);
            int rc = kv_ledger_settle(l, &s.req, NULL, &d);
            if (e.cost > max) {
                if (rc != KV_LEDGER_ROVERMAX || kv_ledger_release(l, a.consumer, a.nonce, &d) != 0) c->n_bad++;
                continue;
            }
            if (rc != 0) { c->n_bad++; continue; }
            c->ref_consumer -= e.charged;
            c->ref_treasury += e.fee;
            for (size_t i = 0; i < n; i++) c->ref_node[i] += e.node[i];
            if (n_old < 32) { old[n_old] = a; old_s[n_old] = s; n_old++; }
        } else if (r < 70) { /* a failed completion: escrow, release */
            uint64_t max = 1 + (uint64_t)(rand_r(&seed) % (int)(c->ref_consumer < 5000 ? c->ref_consumer : 5000));
            kv_auth a = lt_auth(&c->consumer, LT_GW, max);
            if (kv_ledger_escrow(l, &a, LT_GW, now, &d) != 0 || kv_ledger_release(l, a.consumer, a.nonce, &d) != 0)
                c->n_bad++;
        } else if (r < 80) { /* overdraft */
            kv_auth a = lt_auth(&c->consumer, LT_GW, c->ref_consumer + 1 + (uint64_t)(rand_r(&seed) % 1000));
            if (kv_ledger_escrow(l, &a, LT_GW, now, &d) != KV_LEDGER_RFUNDS) c->n_bad++;
        } else if (n_old > 0) { /* replay an old authorization, or retry its settlement */
            int k = rand_r(&seed) % n_old;
            if (r < 90) {
                if (kv_ledger_escrow(l, &old[k], LT_GW, now, &d) != KV_LEDGER_RREPLAY) c->n_bad++;
            } else {
                old_s[k].req.log = old_s[k].log;
                old_s[k].req.receipts = old_s[k].rc;
                if (kv_ledger_settle(l, &old_s[k].req, NULL, &d) != KV_LEDGER_EXISTS) c->n_bad++;
            }
        }
    }
    kv_ledger_free(l);
    return NULL;
}
static void *lt_checker_thread(void *p) {
    uint64_t *res = p; /* [0] checks, [1] failures */
    kv_ledger *l = NULL;
    if (kv_ledger_open(&l, (const char *)(uintptr_t)res[2], NULL)) { res[1]++; return NULL; }
    while (!atomic_load(&lt_load_done)) {
        kv_diag d = {0};
        if (kv_ledger_check(l, NULL, &d)) { res[1]++; fprintf(stderr, "during load: %s\n", d.msg); }
        res[0]++;
        usleep(20000);
    }
    kv_ledger_free(l);
    return NULL;
}
static void test_load_concurrent(void) {
    char path[256];
    kv_ledger *l = lt_new(path);
    kv_wallet nodes[LT_NODES];
    for (int i = 0; i < LT_NODES; i++) kv_wallet_generate(&nodes[i], NULL);
    lt_client cl[LT_THREADS];
    pthread_t th[LT_THREADS], chk;
    uint64_t cres[3] = {0, 0, (uint64_t)(uintptr_t)path};
    atomic_store(&lt_load_done, 0);
    pthread_create(&chk, NULL, lt_checker_thread, cres);
    for (int i = 0; i < LT_THREADS; i++) {
        memset(&cl[i], 0, sizeof cl[i]);
        cl[i].path = path;
        cl[i].idx = i;
        cl[i].nodes = nodes;
        kv_wallet_generate(&cl[i].consumer, NULL);
        pthread_create(&th[i], NULL, lt_load_thread, &cl[i]);
    }
    uint64_t ops = 0, bad = 0, tre = 0, nodes_ref[LT_NODES] = {0};
    for (int i = 0; i < LT_THREADS; i++) {
        pthread_join(th[i], NULL);
        ops += cl[i].n_ops;
        bad += cl[i].n_bad;
        tre += cl[i].ref_treasury;
        for (int k = 0; k < LT_NODES; k++) nodes_ref[k] += cl[i].ref_node[k];
        ASSERT_EQ(lt_bal_c(l, cl[i].consumer.pk), cl[i].ref_consumer);
    }
    atomic_store(&lt_load_done, 1);
    pthread_join(chk, NULL);
    ASSERT_EQ(ops, LT_OPS);
    ASSERT_EQ(bad, 0);
    ASSERT_TRUE(cres[0] > 0);
    ASSERT_EQ(cres[1], 0);
    ASSERT_EQ(lt_bal(l, "treasury"), tre);
    for (int k = 0; k < LT_NODES; k++) ASSERT_EQ(lt_bal_n(l, nodes[k].pk), nodes_ref[k]);
    ASSERT_EQ(lt_bal(l, "escrow"), 0);
    printf("load: %llu ops from %d clients, %llu invariant checks during the run\n", (unsigned long long)ops,
           LT_THREADS, (unsigned long long)cres[0]);
    lt_check(l);
    kv_ledger_free(l);
}

static void test_store_rows_checked(void) {
    char path[256];
    kv_ledger *l = lt_new(path);
    kv_wallet c;
    kv_wallet_generate(&c, NULL);
    ASSERT_EQ(lt_issue(l, c.pk, 100), 0);
    /* SQLite takes a string; PostgreSQL's types refuse one, but not a
     * balance past 2^62 */
    ASSERT_EQ(lt_sql(path, lt_pg ? "UPDATE accounts SET balance = 5000000000000000000 WHERE kind = 1"
                                 : "UPDATE accounts SET balance = 'lots' WHERE kind = 1"),
              0);
    uint64_t b;
    kv_diag d = {0};
    ASSERT_EQ(kv_ledger_balance(l, "treasury", &b, &d), 0);
    char a[KV_LEDGER_ACCOUNT_MAX];
    kv_ledger_account_consumer(c.pk, a);
    ASSERT_EQ(kv_ledger_balance(l, a, &b, &d), KV_EFORMAT);
    ASSERT_EQ(lt_issue(l, c.pk, 1), KV_EFORMAT);
    kv_ledger_free(l);
    /* an uninitialized file is refused by open */
    char p2[256];
    lt_fresh(p2, "empty");
    ASSERT_EQ(kv_ledger_open(&l, p2, &d), KV_ENOTFOUND);
    /* re-init: same key EXISTS, another key refused */
    ASSERT_EQ(kv_ledger_init(path, lt_op.pk, LT_FEE_BPS, &d), KV_LEDGER_EXISTS);
    ASSERT_EQ(kv_ledger_init(path, c.pk, LT_FEE_BPS, &d), KV_LEDGER_RCONFLICT);
}

static const kvt_case cases[] = {
    KVT_CASE(test_transfer_ids),
    KVT_CASE(test_check_detects),
    KVT_CASE(test_issue_operator_only),
    KVT_CASE(test_auth_format),
    KVT_CASE(test_wallet_file),
    KVT_CASE(test_escrow_settle_release),
    KVT_CASE(test_split_reference),
    KVT_CASE(test_attack_replay),
    KVT_CASE(test_attack_receipts),
    KVT_CASE(test_recover_late_settle),
    KVT_CASE(test_attack_concurrent_threads),
    KVT_CASE(test_load_concurrent),
    KVT_CASE(test_store_rows_checked),
};
int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), lt_setup, lt_teardown); }
