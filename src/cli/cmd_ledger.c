/* kvasir ledger: make a ledger, issue KVR with the operator key, read
 * balances and statements, and check every invariant (docs/LEDGER.md). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "kvasir/ledger.h"
#include "kvasir/link.h"

#define CMD "ledger"

static const char *const kv_value_flags[] = {"--db", "--key", "--to", "--amount", "--account", "--fee-bps",
                                             "--id", NULL};

static const char *kv_ledger_help =
    "usage: kvasir ledger init --db FILE --key OPERATOR_KEYFILE [--fee-bps N]\n"
    "       kvasir ledger issue --db FILE --key OPERATOR_KEYFILE --to ACCOUNT --amount MICRO_KVR [--id HEX32]\n"
    "       kvasir ledger balance --db FILE --account ACCOUNT [--json]\n"
    "       kvasir ledger statement --db FILE [--account ACCOUNT] [--json]\n"
    "       kvasir ledger check --db FILE [--json]\n"
    "       kvasir ledger summary --db FILE [--json]\n"
    "  init       creates the ledger; only OPERATOR_KEYFILE's key may issue; fee to the treasury\n"
    "             in basis points of each settled cost (default 500)\n"
    "  issue      funds a consumer account (its wallet's public key); --id makes a retry exact\n"
    "  check      exit 0 only when every invariant holds, with a one-line summary\n"
    "  summary    what each consumer paid, what each node earned (and for how many products),\n"
    "             the fees, and whether the books balance (exit 0 only then)\n"
    "ACCOUNT: a 64-hex public key (a consumer), consumer:KEY, node:KEY, treasury, escrow, mint\n";

static int kv_print_entry(void *ctx, const kv_ledger_entry *e) {
    int *json_first = ctx; /* [0] json, [1] first */
    char id[33];
    kv_hex(e->id, 16, id);
    if (json_first[0]) {
        printf("%s{\"seq\":%lld,\"id\":\"%s\",\"debit\":\"%s\",\"credit\":\"%s\",\"amount\":%llu,\"code\":\"%s\",\"ts\":%lld}",
               json_first[1] ? "" : ",", (long long)e->seq, id, e->debit, e->credit, (unsigned long long)e->amount,
               kv_ledger_code_name(e->code), (long long)e->ts);
        json_first[1] = 0;
    } else {
        printf("%6lld %s %-7s %20llu  %s -> %s\n", (long long)e->seq, id, kv_ledger_code_name(e->code),
               (unsigned long long)e->amount, e->debit, e->credit);
    }
    return 0;
}

/* ---- summary: paid, earned, fees, from the journal ---------------------------- */
#define KV_SUM_MAX 4096 /* accounts listed; more are summed but not named */
typedef struct {
    char id[KV_LEDGER_ACCOUNT_MAX];
    uint64_t in, out; /* consumer: issued, then held - returned; node: rewards */
} kv_sum_acct;
typedef struct {
    kv_sum_acct c[KV_SUM_MAX], n[KV_SUM_MAX];
    size_t n_c, n_n;
    uint64_t holds, returns, rewards, fees, issued;
    bool overflow; /* some account not listed */
} kv_sum;

static kv_sum_acct *kv_sum_find(kv_sum_acct *a, size_t *n, const char *id, bool *overflow) {
    for (size_t i = 0; i < *n; i++)
        if (!strcmp(a[i].id, id)) return &a[i];
    if (*n == KV_SUM_MAX) {
        *overflow = true;
        return NULL;
    }
    kv_sum_acct *x = &a[(*n)++];
    memset(x, 0, sizeof *x);
    snprintf(x->id, sizeof x->id, "%s", id);
    return x;
}

static int kv_sum_entry(void *ctx, const kv_ledger_entry *e) {
    kv_sum *s = ctx;
    kv_sum_acct *a;
    switch (e->code) {
    case KV_XFER_ISSUE:
        s->issued += e->amount;
        if ((a = kv_sum_find(s->c, &s->n_c, e->credit, &s->overflow))) a->in += e->amount;
        break;
    case KV_XFER_HOLD:
        s->holds += e->amount;
        if ((a = kv_sum_find(s->c, &s->n_c, e->debit, &s->overflow))) a->out += e->amount;
        break;
    case KV_XFER_RETURN:
        s->returns += e->amount;
        if ((a = kv_sum_find(s->c, &s->n_c, e->credit, &s->overflow))) a->out -= e->amount;
        break;
    case KV_XFER_REWARD:
        s->rewards += e->amount;
        if ((a = kv_sum_find(s->n, &s->n_n, e->credit, &s->overflow))) a->in += e->amount;
        break;
    case KV_XFER_FEE: s->fees += e->amount; break;
    default: break;
    }
    return 0;
}

/* Paid (held - returned, less what is still held) must equal earned +
 * fees, and every invariant of kv_ledger_check must hold: exit 0 only then. */
static int kv_ledger_summary(kv_ledger *l, bool json, kv_diag *d) {
    kv_sum *s = calloc(1, sizeof *s);
    if (!s) return kv_cli_err(CMD, 2, "out of memory");
    kv_ledger_report rep;
    int ret = 0;
    if (kv_ledger_statement(l, NULL, kv_sum_entry, s, d)) {
        ret = kv_cli_diag(CMD, d);
        goto out;
    }
    const int crc = kv_ledger_check(l, &rep, d);
    if (crc && !rep.failed[0]) {
        ret = kv_cli_diag(CMD, d);
        goto out;
    }
    const uint64_t paid = s->holds - s->returns - rep.escrow_held;
    const bool balanced = !crc && paid == s->rewards + s->fees;
    if (json) printf("{\"consumers\":[");
    for (size_t i = 0; i < s->n_c; i++) {
        uint64_t bal = 0;
        kv_ledger_balance(l, s->c[i].id, &bal, NULL);
        if (json) printf("%s{\"account\":\"%s\",\"issued\":%llu,\"paid\":%llu,\"balance\":%llu}", i ? "," : "",
                         s->c[i].id, (unsigned long long)s->c[i].in, (unsigned long long)s->c[i].out,
                         (unsigned long long)bal);
        else printf("consumer %s paid %llu micro-KVR (issued %llu, balance %llu)\n", s->c[i].id,
                    (unsigned long long)s->c[i].out, (unsigned long long)s->c[i].in, (unsigned long long)bal);
    }
    if (json) printf("],\"nodes\":[");
    for (size_t i = 0; i < s->n_n; i++) {
        uint8_t pk[32];
        uint64_t earned = 0, products = 0, n_rcpt = 0;
        if (!kv_unhex32(s->n[i].id + 5, pk, NULL)) kv_ledger_node_earnings(l, pk, &earned, &products, &n_rcpt, NULL);
        if (json) printf("%s{\"account\":\"%s\",\"earned\":%llu,\"products\":%llu,\"receipts\":%llu}", i ? "," : "",
                         s->n[i].id, (unsigned long long)s->n[i].in, (unsigned long long)products,
                         (unsigned long long)n_rcpt);
        else printf("node %s earned %llu micro-KVR for %llu expert products (%llu receipts)\n", s->n[i].id,
                    (unsigned long long)s->n[i].in, (unsigned long long)products, (unsigned long long)n_rcpt);
    }
    if (json)
        printf("],\"paid\":%llu,\"earned\":%llu,\"fees\":%llu,\"held\":%llu,\"issued\":%llu,\"balanced\":%s,"
               "\"check\":\"%s\",\"complete\":%s}\n",
               (unsigned long long)paid, (unsigned long long)s->rewards, (unsigned long long)s->fees,
               (unsigned long long)rep.escrow_held, (unsigned long long)s->issued, balanced ? "true" : "false",
               crc ? rep.failed : "ok", s->overflow ? "false" : "true");
    else
        printf("books %s: consumers paid %llu = nodes earned %llu + fees %llu%s (held in escrow %llu; %s)\n",
               balanced ? "balance" : "DO NOT balance", (unsigned long long)paid, (unsigned long long)s->rewards,
               (unsigned long long)s->fees, s->overflow ? " (accounts past 4096 not listed)" : "",
               (unsigned long long)rep.escrow_held, crc ? rep.failed : "ledger check ok");
    ret = balanced ? 0 : 2;
out:
    free(s);
    return ret;
}

int kv_cmd_ledger(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        fputs(kv_ledger_help, argc < 2 ? stderr : stdout);
        return argc < 2 ? 1 : 0;
    }
    const char *sub = argv[1], *db = NULL, *key = NULL, *to = NULL, *account = NULL, *idhex = NULL;
    uint64_t amount = 0;
    long fee = 500;
    bool json = false, have_amount = false;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_ledger_help, stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = true;
        } else if (!(v = kv_arg_value(CMD, argc, argv, &i, kv_value_flags))) {
            return 1;
        } else if (!strcmp(a, "--db")) {
            db = v;
        } else if (!strcmp(a, "--key")) {
            key = v;
        } else if (!strcmp(a, "--to")) {
            to = v;
        } else if (!strcmp(a, "--account")) {
            account = v;
        } else if (!strcmp(a, "--id")) {
            idhex = v;
        } else if (!strcmp(a, "--fee-bps")) {
            if (kv_arg_long(CMD, a, v, 0, 10000, &fee)) return 1;
        } else if (!strcmp(a, "--amount")) {
            if (kv_arg_u64(CMD, a, v, &amount)) return 1;
            if (amount == 0 || amount > KV_LEDGER_MAX_AMOUNT)
                return kv_cli_err(CMD, 1, "--amount: %llu is outside 1..%llu", (unsigned long long)amount,
                                  (unsigned long long)KV_LEDGER_MAX_AMOUNT);
            have_amount = true;
        }
    }
    if (!db) return kv_cli_err(CMD, 1, "%s needs --db FILE", sub);
    kv_diag d = {0};
    kv_wallet w;
    char acct[KV_LEDGER_ACCOUNT_MAX];
    if (!strcmp(sub, "init")) {
        if (!key) return kv_cli_err(CMD, 1, "init needs --key OPERATOR_KEYFILE");
        if (kv_wallet_load(&w, key, &d)) return kv_cli_diag(CMD, &d);
        int rc = kv_ledger_init(db, w.pk, (uint32_t)fee, &d);
        if (rc < 0) return kv_cli_diag(CMD, &d);
        printf("%s\n", rc == KV_LEDGER_EXISTS ? "exists" : "created");
        return 0;
    }
    kv_ledger *l = NULL;
    int rc = 0, ret = 0;
    if (!strcmp(sub, "issue")) {
        uint8_t consumer[32], id[16];
        if (!key || !to || !have_amount) return kv_cli_err(CMD, 1, "issue needs --key, --to and --amount");
        if (kv_ledger_account_parse(to, acct, &d)) return kv_cli_diag(CMD, &d);
        if (strncmp(acct, "consumer:", 9))
            return kv_cli_err(CMD, 2, "issuance funds consumer accounts only, not %s", acct);
        kv_unhex32(acct + 9, consumer, NULL);
        if (idhex) {
            uint8_t k32[32];
            char pad[65];
            if (strlen(idhex) != 32) return kv_cli_err(CMD, 1, "--id: 32 hex digits");
            snprintf(pad, sizeof pad, "%s%032d", idhex, 0);
            if (kv_unhex32(pad, k32, NULL)) return kv_cli_err(CMD, 1, "--id: 32 hex digits");
            memcpy(id, k32, 16);
        }
        if (kv_wallet_load(&w, key, &d)) return kv_cli_diag(CMD, &d);
        kv_issue is;
        if (kv_issue_sign(&is, &w, consumer, amount, idhex ? id : NULL, &d)) return kv_cli_diag(CMD, &d);
        if (kv_ledger_open(&l, db, &d)) return kv_cli_diag(CMD, &d);
        rc = kv_ledger_issue(l, &is, &d);
        if (rc < 0) ret = kv_cli_diag(CMD, &d);
        else if (json) printf("{\"result\":\"%s\",\"account\":\"%s\",\"amount\":%llu}\n", rc ? "exists" : "created",
                              acct, (unsigned long long)amount);
        else printf("%s %s %llu\n", rc ? "exists" : "issued", acct, (unsigned long long)amount);
    } else if (!strcmp(sub, "balance")) {
        if (!account) return kv_cli_err(CMD, 1, "balance needs --account");
        if (kv_ledger_account_parse(account, acct, &d)) return kv_cli_diag(CMD, &d);
        uint64_t bal;
        if (kv_ledger_open(&l, db, &d) || kv_ledger_balance(l, acct, &bal, &d)) ret = kv_cli_diag(CMD, &d);
        else if (json) printf("{\"account\":\"%s\",\"balance\":%llu}\n", acct, (unsigned long long)bal);
        else printf("%llu\n", (unsigned long long)bal);
    } else if (!strcmp(sub, "statement")) {
        if (account && kv_ledger_account_parse(account, acct, &d)) return kv_cli_diag(CMD, &d);
        int ctx[2] = {json, 1};
        if (kv_ledger_open(&l, db, &d)) {
            ret = kv_cli_diag(CMD, &d);
        } else {
            if (json) printf("[");
            if (kv_ledger_statement(l, account ? acct : NULL, kv_print_entry, ctx, &d)) ret = kv_cli_diag(CMD, &d);
            if (json) printf("]\n");
        }
    } else if (!strcmp(sub, "check")) {
        kv_ledger_report r;
        if (kv_ledger_open(&l, db, &d)) {
            ret = kv_cli_diag(CMD, &d);
        } else {
            rc = kv_ledger_check(l, &r, &d);
            if (rc && !r.failed[0]) {
                ret = kv_cli_diag(CMD, &d);
            } else if (json) {
                printf("{\"ok\":%s,\"failed\":\"%s\",\"accounts\":%llu,\"transfers\":%llu,\"receipts\":%llu,"
                       "\"supply\":%llu,\"issued\":%llu,\"escrow\":%llu,\"held\":%llu,\"settled\":%llu,\"released\":%llu}\n",
                       rc ? "false" : "true", r.failed, (unsigned long long)r.n_accounts,
                       (unsigned long long)r.n_transfers, (unsigned long long)r.n_receipts,
                       (unsigned long long)r.supply, (unsigned long long)r.issued, (unsigned long long)r.escrow_held,
                       (unsigned long long)r.n_held, (unsigned long long)r.n_settled, (unsigned long long)r.n_released);
                ret = rc ? 2 : 0;
            } else if (rc) {
                ret = kv_cli_diag(CMD, &d);
            } else {
                printf("ledger ok: %llu accounts, %llu transfers, %llu receipts, supply %llu = issued %llu, "
                       "escrow %llu held by %llu authorizations, %llu settled, %llu released\n",
                       (unsigned long long)r.n_accounts, (unsigned long long)r.n_transfers,
                       (unsigned long long)r.n_receipts, (unsigned long long)r.supply, (unsigned long long)r.issued,
                       (unsigned long long)r.escrow_held, (unsigned long long)r.n_held,
                       (unsigned long long)r.n_settled, (unsigned long long)r.n_released);
            }
        }
    } else if (!strcmp(sub, "summary")) {
        if (kv_ledger_open(&l, db, &d)) ret = kv_cli_diag(CMD, &d);
        else ret = kv_ledger_summary(l, json, &d);
    } else {
        return kv_cli_err(CMD, 1, "unknown subcommand '%s' (init, issue, balance, statement, check, summary)", sub);
    }
    kv_ledger_free(l);
    return ret;
}
