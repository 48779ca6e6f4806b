/* Ledger throughput (not a test): C clients, each with its own connection to
 * one SQLite ledger file (WAL, synchronous=FULL), each doing N completions:
 * sign an authorization, escrow it, settle it with a 3-node dispatch log and
 * 3 node-signed receipts (5 journal entries per completion: hold, fee, 3
 * rewards, return). Prints completions/s and journal entries/s, then checks
 * every invariant.
 *   build/bench_ledger [clients=8] [completions per client=250] [dir=/tmp | store URI]
 * A PostgreSQL store URI ("pg:..." or "postgresql://...", an empty database)
 * in place of dir measures the PostgreSQL backend. */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvasir/ledger.h"

typedef struct {
    const char *path;
    const kv_wallet *op, *nodes;
    int n;
    int failed;
} bench_client;

static void *bench_run(void *p) {
    bench_client *c = p;
    kv_ledger *l = NULL;
    kv_diag d = {0};
    kv_wallet w;
    kv_issue is;
    if (kv_ledger_open(&l, c->path, &d) || kv_wallet_generate(&w, &d) ||
        kv_issue_sign(&is, c->op, w.pk, 1000000000, NULL, &d) || kv_ledger_issue(l, &is, &d)) {
        fprintf(stderr, "bench: %s\n", d.msg);
        c->failed = 1;
        kv_ledger_free(l);
        return NULL;
    }
    for (int i = 0; i < c->n && !c->failed; i++) {
        kv_auth a;
        kv_auth_sign(&a, &w, "gw-bench", 100000, (uint64_t)time(NULL) + 3600, NULL);
        kv_dispatch_entry log[3];
        kv_receipt rc[3];
        for (int k = 0; k < 3; k++) {
            memcpy(log[k].node, c->nodes[k].pk, 32);
            log[k].n_products = 100 + (uint64_t)k * 7 + (uint64_t)i % 13;
            memset(log[k].log_digest, k + 1, 32);
            kv_receipt_sign(&rc[k], &c->nodes[k], &a, log[k].n_products, log[k].log_digest, NULL);
        }
        kv_settle_req r = {.prompt_tokens = 200, .completion_tokens = 300, .price_prompt = 10,
                           .price_completion = 30, .log = log, .n_log = 3, .receipts = rc, .n_receipts = 3};
        memcpy(r.consumer, a.consumer, 32);
        memcpy(r.nonce, a.nonce, 16);
        if (kv_ledger_escrow(l, &a, "gw-bench", (uint64_t)time(NULL), &d) || kv_ledger_settle(l, &r, NULL, &d)) {
            fprintf(stderr, "bench: %s\n", d.msg);
            c->failed = 1;
        }
    }
    kv_ledger_free(l);
    return NULL;
}

int main(int argc, char **argv) {
    int clients = argc > 1 ? atoi(argv[1]) : 8, n = argc > 2 ? atoi(argv[2]) : 250;
    const char *dir = argc > 3 ? argv[3] : "/tmp";
    if (clients < 1 || clients > 256 || n < 1 || n > 1000000) {
        fprintf(stderr, "usage: bench_ledger [clients 1..256] [completions per client] [dir]\n");
        return 1;
    }
    char path[512];
    bool pg = !strncmp(dir, "pg:", 3) || !strncmp(dir, "postgres", 8);
    if (pg) snprintf(path, sizeof path, "%s", dir);
    else snprintf(path, sizeof path, "%s/kv_bench_ledger_%d.db", dir, (int)getpid());
    kv_wallet op, nodes[3];
    kv_diag d = {0};
    kv_wallet_generate(&op, NULL);
    for (int k = 0; k < 3; k++) kv_wallet_generate(&nodes[k], NULL);
    if (kv_ledger_init(path, op.pk, 500, &d)) {
        fprintf(stderr, "bench: %s\n", d.msg);
        return 2;
    }
    bench_client *c = calloc((size_t)clients, sizeof *c);
    pthread_t *th = calloc((size_t)clients, sizeof *th);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < clients; i++) {
        c[i] = (bench_client){path, &op, nodes, n, 0};
        pthread_create(&th[i], NULL, bench_run, &c[i]);
    }
    int failed = 0;
    for (int i = 0; i < clients; i++) {
        pthread_join(th[i], NULL);
        failed |= c[i].failed;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    kv_ledger *l = NULL;
    kv_ledger_report rep;
    int rc = kv_ledger_open(&l, path, &d) || kv_ledger_check(l, &rep, &d);
    double done = (double)clients * n;
    printf("ledger: %d clients x %d completions in %.2f s: %.0f completions/s, %.0f journal entries/s, %s\n",
           clients, n, s, done / s, (double)rep.n_transfers / s, rc ? d.msg : "invariants hold");
    kv_ledger_free(l);
    char p2[600];
    if (pg) path[0] = 0; /* the database is the caller's to drop */
    unlink(path);
    snprintf(p2, sizeof p2, "%s-wal", path);
    unlink(p2);
    snprintf(p2, sizeof p2, "%s-shm", path);
    unlink(p2);
    free(c);
    free(th);
    return failed || rc ? 2 : 0;
}
