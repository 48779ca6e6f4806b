/* The ledger across processes: concurrent spends from one balance by forked
 * processes (a naive read-then-write path first, which overspends, then the
 * real one), a process doing settlements killed with SIGKILL again and again
 * and restarted (nothing lost, nothing doubled, interrupted holds released by
 * kv_ledger_recover), and the kvasir wallet / kvasir ledger command line.
 * kv-test-labels: net unit */
#include <signal.h>
#include <stdarg.h>
#include <sqlite3.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <pthread.h>

#include "test_ledger_support.h"

#define LP_PROCS 8

/* ---- 4c. concurrent spends across processes ------------------------------------------------ */
static void lp_bar_wait(void *bar) { pthread_barrier_wait(bar); }
static int lp_naive_child(const char *path, const char *acct, uint64_t amount, pthread_barrier_t *bar) {
    return lt_naive_spend(path, acct, amount, lp_bar_wait, bar);
}
static int lp_real_child(const char *path, const kv_auth *a, pthread_barrier_t *bar) {
    kv_ledger *l = NULL;
    if (kv_ledger_open(&l, path, NULL)) return 2;
    pthread_barrier_wait(bar);
    int rc = kv_ledger_escrow(l, a, LT_GW, (uint64_t)time(NULL), NULL);
    kv_ledger_free(l);
    return rc == 0 ? 0 : rc == KV_LEDGER_RFUNDS ? 1 : 2;
}
static void test_attack_concurrent_processes(void) {
    pthread_barrier_t *bar = mmap(NULL, sizeof *bar, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    ASSERT_TRUE(bar != MAP_FAILED);
    for (int naive = 1; naive >= 0; naive--) {
        pthread_barrierattr_t at;
        pthread_barrierattr_init(&at);
        pthread_barrierattr_setpshared(&at, PTHREAD_PROCESS_SHARED);
        pthread_barrier_init(bar, &at, LP_PROCS);
        char path[256];
        kv_ledger *l = lt_new(path);
        kv_wallet c;
        kv_wallet_generate(&c, NULL);
        ASSERT_EQ(lt_issue(l, c.pk, 1000), 0);
        char acct[KV_LEDGER_ACCOUNT_MAX];
        kv_ledger_account_consumer(c.pk, acct);
        kv_auth auths[LP_PROCS];
        pid_t pid[LP_PROCS];
        for (int i = 0; i < LP_PROCS; i++) auths[i] = lt_auth(&c, LT_GW, 300);
        for (int i = 0; i < LP_PROCS; i++) {
            pid[i] = fork();
            if (pid[i] == 0) _exit(naive ? lp_naive_child(path, acct, 300, bar) : lp_real_child(path, &auths[i], bar));
        }
        int ok = 0, funds = 0;
        for (int i = 0; i < LP_PROCS; i++) {
            int st = 0;
            waitpid(pid[i], &st, 0);
            int code = WIFEXITED(st) ? WEXITSTATUS(st) : 3;
            ok += code == 0;
            funds += code == 1;
        }
        if (naive) {
            ASSERT_TRUE(ok > 3); /* more holds than the balance covers: KVR created */
            ASSERT_TRUE(lt_bal(l, "escrow") > 1000);
            ASSERT_EQ(kv_ledger_check(l, NULL, NULL), KV_EINTERNAL);
        } else {
            ASSERT_EQ(ok, 3);
            ASSERT_EQ(funds, LP_PROCS - 3);
            ASSERT_EQ(lt_bal_c(l, c.pk), 100);
            ASSERT_EQ(lt_bal(l, "escrow"), 900);
            lt_check(l);
        }
        pthread_barrier_destroy(bar);
        kv_ledger_free(l);
    }
    munmap(bar, sizeof *bar);
}

/* ---- 6. a settling process killed with SIGKILL, restarted ------------------------------------- */
#define LP_N 120
#define LP_GW "gw-crash"
/* Writes one byte to progress_fd after each completion, so the parent can
 * kill it part-way at a point it chooses, on any machine speed. */
static int lp_settler(const char *path, kv_auth *auths, lt_settle *ss, int progress_fd) {
    kv_ledger *l = NULL;
    if (kv_ledger_open(&l, path, NULL)) return 2;
    uint64_t now = (uint64_t)time(NULL);
    for (int i = 0; i < LP_N; i++) {
        int rc = kv_ledger_escrow(l, &auths[i], LP_GW, now, NULL);
        if (rc != 0 && rc != KV_LEDGER_RREPLAY) return 3;
        if (i % 5 == 4) rc = kv_ledger_release(l, auths[i].consumer, auths[i].nonce, NULL);
        else rc = kv_ledger_settle(l, &ss[i].req, NULL, NULL);
        if (rc != 0 && rc != KV_LEDGER_EXISTS && rc != KV_LEDGER_RSTATE) return 4;
        if (write(progress_fd, "", 1) != 1) return 5;
    }
    kv_ledger_free(l);
    return 0;
}
static void test_crash_sigkill(void) {
    char path[256];
    kv_ledger *l = lt_new(path);
    kv_wallet c, nodes[3];
    kv_wallet_generate(&c, NULL);
    for (int i = 0; i < 3; i++) kv_wallet_generate(&nodes[i], NULL);
    const uint64_t funded = 100000000;
    ASSERT_EQ(lt_issue(l, c.pk, funded), 0);
    kv_auth *auths = calloc(LP_N, sizeof *auths);
    lt_settle *ss = calloc(LP_N, sizeof *ss);
    srand(777);
    for (int i = 0; i < LP_N; i++) {
        auths[i] = lt_auth(&c, LP_GW, 1000 + (uint64_t)(rand() % 5000));
        uint64_t counts[3] = {1 + (uint64_t)(rand() % 50), 1 + (uint64_t)(rand() % 50), 1 + (uint64_t)(rand() % 50)};
        lt_mk_settle(&ss[i], &auths[i], nodes, counts, 3, (unsigned)(1 + rand() % 7), (uint64_t)(rand() % 40),
                     (uint64_t)(rand() % 40), 3, 7);
    }
    int killed = 0;
    uint64_t recovered = 0;
    /* one crash at a known point: a process holds auths[0] and dies before settling it */
    pid_t p0 = fork();
    if (p0 == 0) {
        kv_ledger *cl = NULL;
        if (kv_ledger_open(&cl, path, NULL) || kv_ledger_escrow(cl, &auths[0], LP_GW, (uint64_t)time(NULL), NULL))
            _exit(1);
        raise(SIGKILL);
    }
    int st0 = 0;
    waitpid(p0, &st0, 0);
    ASSERT_TRUE(WIFSIGNALED(st0));
    ASSERT_EQ(lt_bal(l, "escrow"), auths[0].max);
    for (int round = 0; round < 8; round++) {
        int pfd[2];
        ASSERT_EQ(pipe(pfd), 0);
        pid_t p = fork();
        if (p == 0) {
            close(pfd[0]);
            _exit(lp_settler(path, auths, ss, pfd[1]));
        }
        close(pfd[1]);
        int last = round == 7;
        if (!last) {
            /* let it get past what earlier runs did, then kill it inside its next steps */
            int want = 12 * (round + 1) + rand() % 10, got = 0;
            char b;
            while (got < want && read(pfd[0], &b, 1) == 1) got++;
            usleep((useconds_t)(rand() % 15000));
            kill(p, SIGKILL);
        } else {
            char b;
            while (read(pfd[0], &b, 1) == 1) {}
        }
        close(pfd[0]);
        int st = 0;
        waitpid(p, &st, 0);
        if (WIFSIGNALED(st)) killed++;
        else ASSERT_EQ(WEXITSTATUS(st), 0);
        /* the restart: release what the killed run left held, then check */
        kv_ledger *r = NULL;
        ASSERT_EQ(kv_ledger_open(&r, path, NULL), 0);
        uint64_t n = 0;
        ASSERT_EQ(kv_ledger_recover(r, LP_GW, &n, NULL), 0);
        recovered += n;
        lt_check(r);
        kv_ledger_free(r);
    }
    ASSERT_EQ(killed, 7);
    ASSERT_TRUE(recovered >= 1);
    /* the reference: each authorization settled once (exact figures) or released */
    uint64_t ref_c = funded, ref_t = 0, ref_n[3] = {0}, n_settled = 0, n_released = 0;
    for (int i = 0; i < LP_N; i++) {
        kv_settle_result res;
        int rc = kv_ledger_settle(l, &ss[i].req, &res, NULL);
        if (rc == KV_LEDGER_EXISTS) {
            ASSERT_TRUE(i % 5 != 4);
            lt_expect e = lt_expect_of(&ss[i]);
            ASSERT_EQ(res.fee, e.fee);
            ref_c -= e.charged;
            ref_t += e.fee;
            for (int k = 0; k < 3; k++) ref_n[k] += e.node[k];
            n_settled++;
        } else {
            ASSERT_EQ(rc, KV_LEDGER_RSTATE);
            ASSERT_EQ(kv_ledger_release(l, auths[i].consumer, auths[i].nonce, NULL), KV_LEDGER_EXISTS);
            n_released++;
        }
    }
    ASSERT_EQ(n_settled + n_released, LP_N);
    ASSERT_TRUE(n_settled >= (LP_N / 5) * 4 - recovered);
    ASSERT_EQ(lt_bal_c(l, c.pk), ref_c);
    ASSERT_EQ(lt_bal(l, "treasury"), ref_t);
    for (int k = 0; k < 3; k++) ASSERT_EQ(lt_bal_n(l, nodes[k].pk), ref_n[k]);
    ASSERT_EQ(lt_bal(l, "escrow"), 0);
    kv_ledger_report rep;
    ASSERT_EQ(kv_ledger_check(l, &rep, NULL), 0);
    ASSERT_EQ(rep.n_settled, n_settled);
    ASSERT_EQ(rep.n_released, n_released);
    printf("crash: %d runs killed, %llu interrupted holds released on restart, %llu settled, %llu released\n",
           killed, (unsigned long long)recovered, (unsigned long long)n_settled, (unsigned long long)n_released);
    free(auths);
    free(ss);
    kv_ledger_free(l);
}

/* ---- the command line ------------------------------------------------------------------------ */
/* Runs a shell command, its stdout into out (cap); returns the exit status. */
static int lp_sh(char *out, size_t cap, const char *fmt, ...) {
    char cmd[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = 0;
    while (n && out[n - 1] == '\n') out[--n] = 0;
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}
static void test_cli(void) {
    const char *bin = getenv("KV_BIN");
    ASSERT_TRUE(bin != NULL);
    if (!bin) return;
    char o[4096], c_hex[128], db[300], op[300], ck[300], bad[300];
    lt_fresh(db, "cli");
    snprintf(op, sizeof op, "%s/op.key", lt_dir);
    snprintf(ck, sizeof ck, "%s/c.key", lt_dir);
    snprintf(bad, sizeof bad, "%s/bad.key", lt_dir);
    ASSERT_EQ(lp_sh(o, sizeof o, "%s wallet new --out %s", bin, op), 0);
    ASSERT_EQ(strlen(o), 64);
    ASSERT_EQ(lp_sh(c_hex, sizeof c_hex, "%s wallet new --out %s", bin, ck), 0);
    ASSERT_EQ(lp_sh(o, sizeof o, "%s wallet new --out %s 2>&1", bin, ck), 2); /* never overwrites */
    ASSERT_EQ(lp_sh(o, sizeof o, "%s wallet show --key %s", bin, ck), 0);
    ASSERT_STREQ(o, c_hex);
    ASSERT_EQ(lp_sh(o, sizeof o, "%s wallet new --out %s", bin, bad), 0);
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger init --db '%s' --key %s", bin, db, op), 0);
    ASSERT_STREQ(o, "created");
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger init --db '%s' --key %s", bin, db, op), 0);
    ASSERT_STREQ(o, "exists");
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger init --db '%s' --key %s 2>&1", bin, db, bad), 2);
    /* issuance: exactly once by id; a changed retry, another key, a node: refused */
    const char *id = "0123456789abcdef0123456789abcdef";
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger issue --db '%s' --key %s --to %s --amount 5000000 --id %s", bin, db, op, c_hex, id), 0);
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger issue --db '%s' --key %s --to %s --amount 5000000 --id %s --json", bin, db, op, c_hex, id), 0);
    ASSERT_TRUE(strstr(o, "\"result\":\"exists\"") != NULL);
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger issue --db '%s' --key %s --to %s --amount 5000001 --id %s 2>&1", bin, db, op, c_hex, id), 2);
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger issue --db '%s' --key %s --to %s --amount 5 2>&1", bin, db, bad, c_hex), 2);
    ASSERT_TRUE(strstr(o, "operator") != NULL);
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger issue --db '%s' --key %s --to node:%s --amount 5 2>&1", bin, db, op, c_hex), 2);
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger issue --db '%s' --key %s --to %s --amount -5 2>&1", bin, db, op, c_hex), 1);
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger issue --db '%s' --key %s --to %s --amount 4611686018427387904 2>&1", bin, db, op, c_hex), 1);
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger issue --db '%s' --key %s --to zz --amount 5 2>&1", bin, db, op), 2);
    ASSERT_TRUE(strchr(o, '\n') == NULL); /* one line */
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger balance --db '%s' --account %s", bin, db, c_hex), 0);
    ASSERT_STREQ(o, "5000000");
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger balance --db '%s' --account mint --json", bin, db), 0);
    ASSERT_TRUE(strstr(o, "\"balance\":5000000}") != NULL);
    /* a payment header from the CLI, held by the library like a gateway would */
    char hdr[512];
    ASSERT_EQ(lp_sh(hdr, sizeof hdr, "%s wallet pay --key %s --gateway %s --max 250000", bin, ck, LT_GW), 0);
    kv_auth a;
    kv_diag d = {0};
    ASSERT_EQ(kv_auth_decode(&a, hdr, strlen(hdr), &d), 0);
    ASSERT_EQ(a.max, 250000);
    ASSERT_STREQ(a.gateway, LT_GW);
    ASSERT_TRUE(a.expires >= (uint64_t)time(NULL) + 3590 && a.expires <= (uint64_t)time(NULL) + 3600);
    kv_ledger *l = NULL;
    ASSERT_EQ(kv_ledger_open(&l, db, &d), 0);
    ASSERT_EQ(kv_ledger_escrow(l, &a, LT_GW, (uint64_t)time(NULL), &d), 0);
    ASSERT_EQ(kv_ledger_escrow(l, &a, LT_GW, (uint64_t)time(NULL), &d), KV_LEDGER_RREPLAY);
    kv_ledger_free(l);
    ASSERT_EQ(lp_sh(o, sizeof o, "%s wallet pay --key %s --gateway %s --max 0 2>&1", bin, ck, LT_GW), 1);
    ASSERT_EQ(lp_sh(o, sizeof o, "%s wallet pay --key %s --gateway 'a b' --max 5 2>&1", bin, ck), 2);
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger statement --db '%s' --json", bin, db), 0);
    ASSERT_TRUE(strstr(o, "\"code\":\"issue\"") && strstr(o, "\"code\":\"hold\""));
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger check --db '%s'", bin, db), 0);
    ASSERT_TRUE(!strncmp(o, "ledger ok: ", 11));
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger check --db '%s' --json", bin, db), 0);
    ASSERT_TRUE(strstr(o, "\"ok\":true") && strstr(o, "\"escrow\":250000"));
    /* a tampered file fails the check with one line naming the invariant */
    ASSERT_EQ(lt_sql(db, "UPDATE accounts SET balance = balance + 1, credits = credits + 1 WHERE id = 'treasury'"), 0);
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger check --db '%s' 2>&1", bin, db), 2);
    ASSERT_TRUE(strstr(o, "invariant") != NULL && strchr(o, '\n') == NULL);
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger check --db '%s'/none.db 2>&1", bin, lt_dir), 2);
    ASSERT_EQ(lp_sh(o, sizeof o, "%s ledger frobnicate --db '%s' 2>&1", bin, db), 1);
}

static const kvt_case cases[] = {
    KVT_CASE(test_attack_concurrent_processes),
    KVT_CASE(test_crash_sigkill),
    KVT_CASE(test_cli),
};
int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), lt_setup, lt_teardown); }
