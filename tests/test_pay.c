/* kv-test-labels: net */
/* Who computed what, per session, and paying them: the engine's per-session
 * work tally over real `kvasir worker` processes, and the gateway's
 * settlement of it (src/gateway/pay.c) against a ledger.
 *
 * Setup: a small synthetic model (2 layers, 8 experts, 2 used) sliced in two
 * expert groups per layer (G0 = experts 0-3, G1 = 4-7), a coordinator folder
 * with only the backbone and manifest, one worker per group. Each expert has
 * one holder, so which worker computes a (token, expert) depends only on the
 * token's routing, which does not depend on what else shares the batch.
 *   - test_tally_alone_equals_batched: two sessions stepped together get,
 *     worker by worker, the counts each gets alone; every session's products
 *     are ((tokens evaluated) x n_layer - (prompt tokens but the last, which
 *     skip the last block's experts)) x n_used and all were answered by
 *     workers; the sums over sessions are the workers' own pair counters;
 *   - test_settle_nodes: a settlement with keyed nodes, receipts and keyless
 *     work pays each node its exact share (kv_ledger_split of cost - fee),
 *     books keyless and local work to the gateway's node, returns the share
 *     of a node without a valid receipt to the consumer;
 *   - test_receipt_frames: the RECEIPT_REQ / RECEIPT payloads round-trip
 *     and refuse every malformed field; a worker signs only while what it
 *     signed for stays within what it computed;
 *   - test_receipt_wire: a real worker, asked over RECEIPT_REQ, signs with
 *     the key it proved for at most what it computed on that connection
 *     (one more is refused, the budget is used up, a new connection starts
 *     from nothing), and a refusal leaves it up;
 *   - test_tally_failed_step: a worker killed mid-decode fails the step;
 *     what the other worker answered in it is not counted (nothing came of
 *     it), while its own pair counter did move. */
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gateway/pay.h"
#include "kvasir/dispatch_proto.h"
#include "kvasir/dispatch_receipt.h"
#include "kvasir/dispatch_remote.h"
#include "kvasir/engine.h"
#include "kvasir/gen.h"
#include "kvasir/ledger.h"
#include "kvasir/link.h"
#include "kvasir/slice.h"
#include "kvtest.h"

#define N_LAYER 2
#define N_USED 2

static char g_dir[256], g_manifest[400], g_group[2][1024];
static const char *g_bin;

typedef struct proc {
    pid_t pid;
    char addr[32];
} proc;
static proc g_w[2];
static kv_wallet g_coord; /* the coordinator key the workers allow */

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) && errno == EINTR) {
    }
}

static uint16_t free_port(void) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t l = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || getsockname(fd, (struct sockaddr *)&a, &l)) return 0;
    close(fd);
    return ntohs(a.sin_port);
}

static bool start_worker(proc *p, const char *slabs) {
    snprintf(p->addr, sizeof p->addr, "127.0.0.1:%u", free_port());
    fflush(stdout);
    fflush(stderr);
    const pid_t pid = fork();
    if (pid == 0) {
        FILE *f = freopen("/dev/null", "w", stdout);
        (void)f;
        char allow[65];
        kv_hex(g_coord.pk, 32, allow);
        execl(g_bin, g_bin, "worker", "--slabs", slabs, "--listen", p->addr, "--threads", "1", "--quiet",
              "--allow-key", allow, (char *)NULL);
        _exit(127);
    }
    p->pid = pid;
    for (int i = 0; i < 250; i++) {
        int fd = -1;
        if (!kv_link_connect(p->addr, 200, &fd, NULL)) {
            close(fd);
            return true;
        }
        sleep_ms(20);
    }
    return false;
}

static void stop_worker(proc *p) {
    if (p->pid <= 0) return;
    kill(p->pid, SIGKILL);
    waitpid(p->pid, NULL, 0);
    p->pid = 0;
}

static kv_engine *open_engine_t(kv_diag *d, uint32_t timeout_ms) {
    const char *w[2] = {g_w[0].addr, g_w[1].addr};
    const kv_engine_opts eo = {.n_threads = 1, .n_ctx = 96, .n_batch = 8, .max_sessions = 4, .workers = w,
                               .n_workers = 2, .worker_timeout_ms = timeout_ms, .key_sk = g_coord.sk};
    kv_engine *e = NULL;
    return kv_engine_open(&e, g_manifest, &eo, d) ? NULL : e;
}
static kv_engine *open_engine(kv_diag *d) { return open_engine_t(d, 5000); }

static kv_session *new_session(kv_engine *e, int seed, uint32_t n_prompt, uint32_t max_tokens) {
    kv_session_opts so = {.sample = kv_sample_defaults(), .max_tokens = max_tokens, .ignore_eog = true};
    so.sample.temp = 0;
    kv_session *s = NULL;
    kv_diag d = {0};
    if (kv_session_new(&s, e, &so, &d)) return NULL;
    int32_t p[32];
    for (uint32_t i = 0; i < n_prompt; i++) p[i] = 100 + seed * 31 + (int32_t)i * 7;
    if (kv_session_prompt(s, p, n_prompt, &d)) {
        kv_session_free(s);
        return NULL;
    }
    return s;
}

typedef struct work {
    uint64_t products, answered[2];
    uint32_t n_eval; /* tokens evaluated: prompt + generated - 1 */
} work;

static void take(const kv_session *s, work *w) {
    w->products = kv_session_work(s, w->answered, 2);
    kv_session_stats st;
    kv_session_get_stats(s, &st);
    w->n_eval = st.n_prompt + st.n_gen_total - 1;
}

static int run_until_done(kv_engine *e, kv_session *const *s, int n) {
    kv_diag d = {0};
    for (int step = 0; step < 200; step++) {
        bool busy = false;
        for (int i = 0; i < n; i++)
            busy |= kv_session_status(s[i]) == KV_SESSION_PREFILL || kv_session_status(s[i]) == KV_SESSION_DECODE;
        if (!busy) return 0;
        int rc = kv_engine_step(e, &d);
        if (rc < 0) return rc;
    }
    return -1;
}

static void test_tally_alone_equals_batched(void) {
    kv_diag d = {0};
    work alone[2], both[2];
    const uint32_t np[2] = {11, 5}, ng[2] = {6, 9};
    for (int i = 0; i < 2; i++) { /* each alone, in an engine of its own */
        kv_engine *e = open_engine(&d);
        ASSERT_TRUE(e != NULL);
        if (!e) return;
        kv_session *s = new_session(e, i, np[i], ng[i]);
        ASSERT_TRUE(s != NULL);
        ASSERT_EQ(run_until_done(e, &s, 1), 0);
        take(s, &alone[i]);
        kv_session_free(s);
        kv_engine_free(e);
    }
    kv_engine *e = open_engine(&d);
    ASSERT_TRUE(e != NULL);
    if (!e) return;
    kv_session *s[2] = {new_session(e, 0, np[0], ng[0]), new_session(e, 1, np[1], ng[1])};
    ASSERT_TRUE(s[0] && s[1]);
    ASSERT_EQ(run_until_done(e, s, 2), 0);
    for (int i = 0; i < 2; i++) take(s[i], &both[i]);
    kv_remote_worker wi[2];
    for (uint32_t w = 0; w < 2; w++) kv_remote_worker_info(kv_engine_remote(e), w, &wi[w]);
    for (int i = 0; i < 2; i++) {
        ASSERT_EQ(both[i].n_eval, np[i] + ng[i] - 1);
        ASSERT_EQ(both[i].products, ((uint64_t)both[i].n_eval * N_LAYER - (np[i] - 1)) * N_USED);
        ASSERT_EQ(both[i].answered[0] + both[i].answered[1], both[i].products); /* no local slabs */
        ASSERT_EQ(both[i].products, alone[i].products);
        for (int w = 0; w < 2; w++) ASSERT_EQ(both[i].answered[w], alone[i].answered[w]);
    }
    for (uint32_t w = 0; w < 2; w++) {
        ASSERT_EQ(wi[w].pairs, both[0].answered[w] + both[1].answered[w]);
        ASSERT_TRUE(wi[w].pairs > 0);
    }
    printf("tally: session 0 %llu+%llu, session 1 %llu+%llu products by worker, alone and batched\n",
           (unsigned long long)both[0].answered[0], (unsigned long long)both[0].answered[1],
           (unsigned long long)both[1].answered[0], (unsigned long long)both[1].answered[1]);
    /* a new session in a freed slot starts from zero */
    kv_session_free(s[0]);
    kv_session *s3 = new_session(e, 2, 3, 1);
    ASSERT_TRUE(s3 != NULL);
    work w3;
    take(s3, &w3);
    ASSERT_EQ(w3.products, 0);
    ASSERT_EQ(w3.answered[0] + w3.answered[1], 0);
    kv_session_free(s3);
    kv_session_free(s[1]);
    kv_engine_free(e);
}

/* Over the wire: a real worker signs what it computed for this connection
 * and nothing more, with the key it proved at the handshake. */
static void test_receipt_wire(void) {
    kv_diag d = {0};
    kv_engine *e = open_engine(&d);
    ASSERT_TRUE(e != NULL);
    if (!e) return;
    kv_session *s = new_session(e, 4, 6, 5);
    ASSERT_TRUE(s != NULL);
    ASSERT_EQ(run_until_done(e, &s, 1), 0);
    work wk;
    take(s, &wk);
    kv_remote *rm = kv_engine_remote(e);
    kv_remote_worker wi;
    kv_remote_worker_info(rm, 0, &wi);
    ASSERT_TRUE(wk.answered[0] > 0 && wi.pairs == wk.answered[0]);
    kv_receipt_req q = {.n_products = wk.answered[0] + 1};
    snprintf(q.gateway, sizeof q.gateway, "gw-wire");
    memset(q.consumer, 7, 32);
    memset(q.auth_nonce, 9, 16);
    memset(q.log_digest, 5, 32);
    kv_receipt r;
    ASSERT_EQ(kv_remote_receipt(rm, 0, &q, &r, &d), KV_LEDGER_RRECEIPT); /* one more than it computed */
    q.n_products = wk.answered[0] - 1;
    ASSERT_EQ(kv_remote_receipt(rm, 0, &q, &r, &d), 0);
    ASSERT_TRUE(!memcmp(r.node, wi.key, 32) && r.n_products == wk.answered[0] - 1 && !strcmp(r.gateway, "gw-wire"));
    uint8_t b[KV_RECEIPT_SIZE];
    kv_receipt r2;
    ASSERT_EQ(kv_receipt_to_bytes(&r, b, &d), 0);
    ASSERT_EQ(kv_receipt_from_bytes(&r2, b, sizeof b, &d), 0); /* the signature verifies */
    q.n_products = 2;
    ASSERT_EQ(kv_remote_receipt(rm, 0, &q, &r, &d), KV_LEDGER_RRECEIPT); /* 1 left of its budget */
    q.n_products = 1;
    ASSERT_EQ(kv_remote_receipt(rm, 0, &q, &r, &d), 0);
    ASSERT_EQ(kv_remote_receipt(rm, 0, &q, &r, &d), KV_LEDGER_RRECEIPT);
    kv_remote_worker_info(rm, 0, &wi);
    ASSERT_TRUE(wi.up); /* a refusal is an answer, not a fault */
    kv_session_free(s);
    kv_engine_free(e);
    /* a new connection has computed nothing yet */
    e = open_engine(&d);
    ASSERT_TRUE(e != NULL);
    if (!e) return;
    ASSERT_EQ(kv_remote_receipt(kv_engine_remote(e), 1, &q, &r, &d), KV_LEDGER_RRECEIPT);
    kv_engine_free(e);
}

static void test_tally_failed_step(void) {
    kv_diag d = {0};
    kv_engine *e = open_engine_t(&d, 300);
    ASSERT_TRUE(e != NULL);
    if (!e) return;
    kv_session *s = new_session(e, 3, 4, 30);
    ASSERT_TRUE(s != NULL);
    for (int i = 0; i < 3; i++) ASSERT_TRUE(kv_engine_step(e, &d) >= 0);
    work before, after;
    take(s, &before);
    kv_remote_worker w0a, w0b;
    kv_remote_worker_info(kv_engine_remote(e), 0, &w0a);
    /* worker 1 stalls past the deadline with the step's COMPUTE in hand:
       worker 0 answers its part, worker 1 is dropped and, without a
       replica, the step fails */
    kill(g_w[1].pid, SIGSTOP);
    ASSERT_TRUE(kv_engine_step(e, &d) < 0);
    take(s, &after);
    kv_remote_worker_info(kv_engine_remote(e), 0, &w0b);
    ASSERT_EQ(after.products, before.products);
    ASSERT_EQ(after.answered[0], before.answered[0]);
    ASSERT_EQ(after.answered[1], before.answered[1]);
    ASSERT_TRUE(w0b.pairs > w0a.pairs); /* worker 0 did answer in the failed step */
    stop_worker(&g_w[1]);
    kv_session_free(s);
    kv_engine_free(e);
}

/* ---- settlement ---------------------------------------------------------- */

static void test_settle_nodes(void) {
    kv_diag d = {0};
    char db[300], gwkey[300];
    snprintf(db, sizeof db, "%s/l.db", g_dir);
    snprintf(gwkey, sizeof gwkey, "%s/gw.key", g_dir);
    kv_wallet op, gw, c, n1, n2, n3;
    ASSERT_EQ(kv_wallet_generate(&op, &d) | kv_wallet_generate(&gw, &d) | kv_wallet_generate(&c, &d) |
                  kv_wallet_generate(&n1, &d) | kv_wallet_generate(&n2, &d) | kv_wallet_generate(&n3, &d),
              0);
    ASSERT_EQ(kv_wallet_save(&gw, gwkey, &d), 0);
    ASSERT_EQ(kv_ledger_init(db, op.pk, 1000, &d), 0); /* 10 % fee */
    kv_ledger *l = NULL;
    ASSERT_EQ(kv_ledger_open(&l, db, &d), 0);
    kv_issue is;
    ASSERT_EQ(kv_issue_sign(&is, &op, c.pk, 1000000, NULL, &d), 0);
    ASSERT_EQ(kv_ledger_issue(l, &is, &d), 0);
    kv_gw_pay *p = NULL;
    ASSERT_EQ(kv_gw_pay_open(&p, db, gwkey, "gw-test", 3, 7, NULL, &d), 0);
    if (!p) return;
    kv_auth a;
    char hdr[KV_AUTH_HEADER_MAX];
    ASSERT_EQ(kv_auth_sign(&a, &c, "gw-test", 50000, (uint64_t)time(NULL) + 60, &d), 0);
    ASSERT_EQ(kv_auth_encode(&a, hdr, sizeof hdr, &d), 0);
    kv_gw_charge ch;
    unsigned status = 0;
    uint32_t max_tokens = 100000;
    ASSERT_EQ(kv_gw_pay_hold(p, hdr, 40, &max_tokens, &ch, &status, &d), 0);
    ASSERT_EQ(max_tokens, (50000 - 40 * 3) / 7); /* what the max pays for */
    /* work: n1 600 with a receipt, n2 300 with a receipt for another count
       (invalid, so left out: its share goes back), n3 100 keyless, 200 local */
    uint8_t dg[32];
    kv_receipt r1, r2;
    kv_gw_pay_log_digest("gw-test", c.pk, a.nonce, n1.pk, 600, dg);
    ASSERT_EQ(kv_receipt_sign(&r1, &n1, &a, 600, dg, &d), 0);
    kv_gw_pay_log_digest("gw-test", c.pk, a.nonce, n2.pk, 299, dg);
    ASSERT_EQ(kv_receipt_sign(&r2, &n2, &a, 299, dg, &d), 0);
    kv_gw_work_node nodes[3] = {{true, {0}, 600, &r1}, {true, {0}, 300, &r2}, {false, {0}, 100, NULL}};
    memcpy(nodes[0].key, n1.pk, 32);
    memcpy(nodes[1].key, n2.pk, 32);
    const kv_gw_work w = {1200, nodes, 3};
    kv_settle_result res;
    ASSERT_EQ(kv_gw_pay_settle(p, &ch, 25, &w, &res, &d), 0);
    const uint64_t cost = 40 * 3 + 25 * 7, fee = cost / 10, pool = cost - fee;
    ASSERT_EQ(res.cost, cost);
    ASSERT_EQ(res.fee, fee);
    /* the split, independently: n1 600, n2 300, gateway 300 of 1200 */
    const uint64_t counts[3] = {600, 300, 300};
    uint8_t ids[3][32];
    memcpy(ids[0], n1.pk, 32);
    memcpy(ids[1], n2.pk, 32);
    memcpy(ids[2], gw.pk, 32);
    uint64_t shares[3];
    ASSERT_EQ(kv_ledger_split(pool, counts, (const uint8_t(*)[32])ids, 3, shares, &d), 0);
    ASSERT_EQ(shares[0] + shares[1] + shares[2], pool);
    char acct[KV_LEDGER_ACCOUNT_MAX];
    uint64_t b;
    kv_ledger_account_node(n1.pk, acct);
    ASSERT_EQ(kv_ledger_balance(l, acct, &b, &d), 0);
    ASSERT_EQ(b, shares[0]);
    kv_ledger_account_node(n2.pk, acct);
    ASSERT_EQ(kv_ledger_balance(l, acct, &b, &d), 0);
    ASSERT_EQ(b, 0);
    kv_ledger_account_node(gw.pk, acct);
    ASSERT_EQ(kv_ledger_balance(l, acct, &b, &d), 0);
    ASSERT_EQ(b, shares[2]);
    kv_ledger_account_consumer(c.pk, acct);
    ASSERT_EQ(kv_ledger_balance(l, acct, &b, &d), 0);
    ASSERT_EQ(b, 1000000 - fee - shares[0] - shares[2]);
    ASSERT_EQ(res.to_nodes, shares[0] + shares[2]);
    uint64_t earned, products, n_rcpt;
    ASSERT_EQ(kv_ledger_node_earnings(l, n1.pk, &earned, &products, &n_rcpt, &d), 0);
    ASSERT_EQ(earned, shares[0]);
    ASSERT_EQ(products, 600);
    ASSERT_EQ(n_rcpt, 1);
    /* settled once: the charge is spent, a second settle is a no-op */
    ASSERT_TRUE(!ch.held);
    ASSERT_EQ(kv_gw_pay_settle(p, &ch, 25, &w, &res, &d), 0);
    ASSERT_EQ(res.cost, 0);
    /* a header replayed is a 402 */
    ASSERT_TRUE(kv_gw_pay_hold(p, hdr, 40, &max_tokens, &ch, &status, &d) != 0);
    ASSERT_EQ(status, 402);
    kv_ledger_report rep;
    ASSERT_EQ(kv_ledger_check(l, &rep, &d), 0);
    /* the status page's view: read-only, the same figures, no writes */
    kv_ledger_reader *rd = NULL;
    ASSERT_EQ(kv_ledger_reader_open(&rd, db, &d), 0);
    uint64_t e1 = 1, e3 = 1;
    ASSERT_EQ(kv_ledger_reader_earned(rd, n1.pk, &e1), 0);
    ASSERT_EQ(e1, shares[0]);
    ASSERT_EQ(kv_ledger_reader_earned(rd, n3.pk, &e3), 0);
    ASSERT_EQ(e3, 0); /* never paid */
    kv_ledger_reader_free(rd);
    kv_ledger *ro = NULL;
    ASSERT_EQ(kv_ledger_open_readonly(&ro, db, &d), 0);
    ASSERT_EQ(kv_issue_sign(&is, &op, c.pk, 5, NULL, &d), 0);
    ASSERT_TRUE(kv_ledger_issue(ro, &is, &d) < 0);
    kv_ledger_account_consumer(c.pk, acct);
    ASSERT_EQ(kv_ledger_balance(ro, acct, &b, &d), 0);
    ASSERT_EQ(b, 1000000 - fee - shares[0] - shares[2]);
    kv_ledger_free(ro);
    kv_gw_pay_free(p);
    kv_ledger_free(l);
}

/* The worker's side of a receipt: it signs only within what it computed,
 * the codecs round-trip, and every malformed payload is refused. */
static void test_receipt_frames(void) {
    kv_diag d = {0};
    kv_wallet node;
    ASSERT_EQ(kv_wallet_generate(&node, &d), 0);
    kv_receipt_req q = {.n_products = 700};
    snprintf(q.gateway, sizeof q.gateway, "gw-test");
    for (int i = 0; i < 32; i++) q.consumer[i] = (uint8_t)i, q.log_digest[i] = (uint8_t)(200 - i);
    for (int i = 0; i < 16; i++) q.auth_nonce[i] = (uint8_t)(9 * i);
    uint8_t pl[KV_PROTO_RECEIPT_REQ_SIZE];
    ASSERT_EQ(kv_receipt_req_to_payload(&q, pl, &d), 0);
    kv_receipt_req q2;
    ASSERT_EQ(kv_receipt_req_from_payload(&q2, pl, sizeof pl, &d), 0);
    ASSERT_STREQ(q2.gateway, "gw-test");
    ASSERT_EQ(q2.n_products, 700);
    ASSERT_TRUE(!memcmp(q2.consumer, q.consumer, 32) && !memcmp(q2.auth_nonce, q.auth_nonce, 16) &&
                !memcmp(q2.log_digest, q.log_digest, 32));
    /* truncated, padded, zero count, bad padding, bad gateway byte */
    ASSERT_EQ(kv_receipt_req_from_payload(&q2, pl, sizeof pl - 1, &d), KV_EPROTO);
    uint8_t bad[KV_PROTO_RECEIPT_REQ_SIZE];
    memcpy(bad, pl, sizeof bad);
    memset(bad + 80, 0, 8);
    ASSERT_EQ(kv_receipt_req_from_payload(&q2, bad, sizeof bad, &d), KV_ERANGE);
    memcpy(bad, pl, sizeof bad);
    bad[20] = 'x';
    ASSERT_EQ(kv_receipt_req_from_payload(&q2, bad, sizeof bad, &d), KV_EPROTO);
    memcpy(bad, pl, sizeof bad);
    bad[2] = ' ';
    ASSERT_EQ(kv_receipt_req_from_payload(&q2, bad, sizeof bad, &d), KV_EPROTO);
    /* the budget: 1000 computed; 700 signed, then 301 refused, 300 signed, 1 refused */
    kv_receipt_budget b = {.computed = 1000};
    kv_receipt r;
    ASSERT_EQ(kv_receipt_grant(&b, &q, node.sk, &r, &d), 0);
    ASSERT_EQ(b.signed_for, 700);
    ASSERT_TRUE(!memcmp(r.node, node.pk, 32) && r.n_products == 700 && !strcmp(r.gateway, "gw-test"));
    q.n_products = 301;
    ASSERT_EQ(kv_receipt_grant(&b, &q, node.sk, &r, &d), KV_LEDGER_RRECEIPT);
    ASSERT_EQ(b.signed_for, 700);
    q.n_products = 300;
    ASSERT_EQ(kv_receipt_grant(&b, &q, node.sk, &r, &d), 0);
    q.n_products = 1;
    ASSERT_EQ(kv_receipt_grant(&b, &q, node.sk, &r, &d), KV_LEDGER_RRECEIPT);
    ASSERT_EQ(b.signed_for, 1000);
    /* the answer carries a receipt that verifies; a flipped bit is refused */
    q.n_products = 300;
    uint8_t ans[KV_PROTO_RECEIPT_SIZE];
    kv_receipt_budget b2 = {.computed = 300};
    ASSERT_EQ(kv_receipt_grant(&b2, &q, node.sk, &r, &d), 0);
    ASSERT_EQ(kv_receipt_ans_to_payload(KV_RECEIPT_SIGNED, &r, ans, &d), 0);
    uint32_t st = 9;
    kv_receipt r2;
    ASSERT_EQ(kv_receipt_ans_from_payload(&st, &r2, ans, sizeof ans, &d), 0);
    ASSERT_EQ(st, KV_RECEIPT_SIGNED);
    ASSERT_TRUE(!memcmp(&r2.sig, &r.sig, 64) && r2.n_products == 300);
    ans[8 + 130] ^= 1;
    ASSERT_TRUE(kv_receipt_ans_from_payload(&st, &r2, ans, sizeof ans, &d) < 0);
    ASSERT_EQ(kv_receipt_ans_to_payload(KV_RECEIPT_REFUSED, NULL, ans, &d), 0);
    ASSERT_EQ(kv_receipt_ans_from_payload(&st, &r2, ans, sizeof ans, &d), 0);
    ASSERT_EQ(st, KV_RECEIPT_REFUSED);
    ans[100] = 1;
    ASSERT_EQ(kv_receipt_ans_from_payload(&st, &r2, ans, sizeof ans, &d), KV_EPROTO);
}

static int setup(void) {
    g_bin = getenv("KV_BIN");
    if (!g_bin) {
        fprintf(stderr, "test_pay: KV_BIN (the kvasir binary) is not set\n");
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    snprintf(g_dir, sizeof g_dir, "/tmp/kvasir-pay.XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    kv_diag d = {0};
    ASSERT_EQ(kv_wallet_generate(&g_coord, &d), 0);
    kv_gen_config c;
    ASSERT_EQ(kv_gen_preset_get("tiny", &c, &d), 0);
    c.n_layer = N_LAYER;
    c.n_expert = 8;
    c.n_expert_used = N_USED;
    c.n_embd = 64;
    c.n_ff_exp = 32;
    c.n_vocab = 400;
    c.n_threads = 1;
    c.seed = 5;
    c.log = NULL;
    char model[300], slices[300], coord[300], f1[400], f2[400];
    snprintf(model, sizeof model, "%s/m.gguf", g_dir);
    snprintf(slices, sizeof slices, "%s/slices", g_dir);
    ASSERT_EQ(kv_gen_model(&c, model, &d), 0);
    const kv_slice_opts so = {4, -1, -1, 1};
    ASSERT_EQ(kv_slice_model(model, slices, &so, NULL, &d), 0);
    snprintf(coord, sizeof coord, "%s/coord", g_dir);
    mkdir(coord, 0755);
    for (int i = 0; i < 2; i++) {
        const char *f = i ? "manifest.json" : "backbone.gguf";
        snprintf(f1, sizeof f1, "%s/%s", slices, f);
        snprintf(f2, sizeof f2, "%s/%s", coord, f);
        char cmd[1000];
        snprintf(cmd, sizeof cmd, "cp '%s' '%s'", f1, f2);
        ASSERT_EQ(system(cmd), 0);
    }
    snprintf(g_manifest, sizeof g_manifest, "%s/manifest.json", coord);
    for (int gi = 0; gi < 2; gi++) {
        size_t o = 0;
        for (uint32_t l = 0; l < N_LAYER; l++)
            o += (size_t)snprintf(g_group[gi] + o, sizeof g_group[gi] - o, "%s%s/experts/blk.%u.%04u-%04u.gguf",
                                  l ? "," : "", slices, l, 4u * gi, 4u * gi + 3);
        ASSERT_TRUE(start_worker(&g_w[gi], g_group[gi]));
    }
    return kvt_failures ? 1 : 0;
}

static void teardown(void) {
    for (int i = 0; i < 2; i++) stop_worker(&g_w[i]);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd)) fprintf(stderr, "could not remove %s\n", g_dir);
}

static const kvt_case cases[] = {
    KVT_CASE(test_tally_alone_equals_batched),
    KVT_CASE(test_settle_nodes),
    KVT_CASE(test_receipt_frames),
    KVT_CASE(test_receipt_wire),
    KVT_CASE(test_tally_failed_step), /* last: it kills a worker */
};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
