/* Charging completions in KVR: the gateway's side of the ledger (pay.h,
 * docs/LEDGER.md "The gateway").
 *
 * Order per completion: hold (decode and verify the header, check that its
 * max covers the prompt and one completion token, escrow) before the
 * request is queued, so nothing is computed unpaid and a refusal charges
 * nothing; settle (or release) once, when the completion ends, whichever
 * way it ends. The amounts are the ledger's: cost = prompt x price_prompt +
 * completion x price_completion, never above the max (the completion is cut
 * at the tokens the max pays for), fee to the treasury, the rest of the
 * cost to the nodes in proportion to their products, the remainder back.
 *
 * Invariant: a kv_gw_charge with held set is settled or released exactly
 * once by its connection; a gateway killed between hold and settle leaves
 * the hold, and kv_gw_pay_open (the next start) releases it. */
#include "gateway/pay.h"
#include "kvasir/link.h"

#include <inttypes.h>
#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

struct kv_gw_pay {
    pthread_mutex_t mu;       /* the ledger connection and the stats */
    kv_ledger *l;
    kv_wallet key;            /* the gateway's node key */
    char id[KV_GATEWAY_ID_MAX + 1];
    uint64_t pp, pc;          /* micro-KVR per prompt / completion token */
    kv_gw_pay_stats st;
};

int kv_gw_pay_open(kv_gw_pay **out, const char *ledger_path, const char *key_path, const char *id,
                   uint64_t price_prompt, uint64_t price_completion, uint64_t *n_recovered, kv_diag *d) {
    *out = NULL;
    if (n_recovered) *n_recovered = 0;
    if (price_prompt > KV_LEDGER_MAX_AMOUNT || price_completion > KV_LEDGER_MAX_AMOUNT)
        return kv_fail(d, KV_EINVAL, "prices: at most %" PRIu64 " micro-KVR per token", KV_LEDGER_MAX_AMOUNT);
    if (!key_path) return kv_fail(d, KV_EINVAL, "a ledger needs the gateway's node key (--gateway-key FILE)");
    kv_gw_pay *p = calloc(1, sizeof *p);
    if (!p) return kv_fail(d, KV_ENOMEM, "pay: out of memory");
    pthread_mutex_init(&p->mu, NULL);
    p->pp = price_prompt;
    p->pc = price_completion;
    int rc = kv_wallet_load(&p->key, key_path, d);
    if (rc) goto fail;
    if (id) {
        const size_t n = strlen(id);
        bool ok = n >= 1 && n <= KV_GATEWAY_ID_MAX;
        for (size_t i = 0; ok && i < n; i++) {
            const char c = id[i];
            ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                 c == '_' || c == ':' || c == '-';
        }
        if (!ok) {
            rc = kv_fail(d, KV_EINVAL, "gateway id '%.40s': 1 to %d of [A-Za-z0-9._:-]", id, KV_GATEWAY_ID_MAX);
            goto fail;
        }
        snprintf(p->id, sizeof p->id, "%s", id);
    } else {
        char h[65];
        kv_hex(p->key.pk, 32, h);
        snprintf(p->id, sizeof p->id, "gw-%.24s", h);
    }
    if ((rc = kv_ledger_open(&p->l, ledger_path, d))) goto fail;
    /* the previous run's interrupted completions: nothing came of them that
       anyone was charged for, so their holds go back whole */
    if ((rc = kv_ledger_recover(p->l, p->id, n_recovered, d))) goto fail;
    *out = p;
    return 0;
fail:
    kv_gw_pay_free(p);
    return rc;
}

void kv_gw_pay_free(kv_gw_pay *p) {
    if (!p) return;
    kv_ledger_free(p->l);
    sodium_memzero(&p->key, sizeof p->key);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

const char *kv_gw_pay_id(const kv_gw_pay *p) { return p->id; }
const uint8_t *kv_gw_pay_node_key(const kv_gw_pay *p) { return p->key.pk; }

/* The ledger's one-line meaning of a refusal ("insufficient funds"). */
static const char *kv_gw_refusal_str(int rc) {
    switch (rc) {
#define KV_GW_RSTR(name, val, str) case val: return str;
        KV_LEDGER_REFUSAL_MAP(KV_GW_RSTR)
#undef KV_GW_RSTR
    }
    return kv_ledger_rc_name(rc);
}

static bool kv_mul_add(uint64_t a, uint64_t b, uint64_t c, uint64_t *out) {
    uint64_t m;
    if (__builtin_mul_overflow(a, b, &m) || __builtin_add_overflow(m, c, out)) return false;
    return *out <= KV_LEDGER_MAX_AMOUNT;
}

int kv_gw_pay_hold(kv_gw_pay *p, const char *header, uint64_t n_prompt, uint32_t *max_tokens, kv_gw_charge *ch,
                   unsigned *status, kv_diag *d) {
    memset(ch, 0, sizeof *ch);
    *status = 402;
    int rc;
    if (!header || !*header) {
        rc = kv_fail(d, KV_EINVAL, "payment required: this gateway (%s) charges %" PRIu64 " micro-KVR per prompt "
                     "token and %" PRIu64 " per completion token; send an authorization in the X-KVR-Payment "
                     "header (kvasir wallet pay --gateway %s --max MICRO_KVR)", p->id, p->pp, p->pc, p->id);
        goto refused;
    }
    const size_t hl = strnlen(header, KV_AUTH_HEADER_MAX + 1);
    kv_diag vd = {0};
    if ((rc = kv_auth_decode(&ch->a, header, hl, &vd))) {
        rc = kv_fail(d, rc, "payment refused: X-KVR-Payment: %s", vd.msg);
        goto refused;
    }
    uint64_t prompt_cost, first;
    if (!kv_mul_add(n_prompt, p->pp, 0, &prompt_cost) || !kv_mul_add(1, p->pc, prompt_cost, &first) ||
        first > ch->a.max) {
        rc = kv_fail(d, KV_LEDGER_ROVERMAX, "payment refused: the authorization's max of %" PRIu64 " micro-KVR does "
                     "not cover the prompt (%" PRIu64 " tokens at %" PRIu64 ") and one completion token (%" PRIu64
                     ")", ch->a.max, n_prompt, p->pp, p->pc);
        goto refused;
    }
    if (p->pc) {
        const uint64_t can = (ch->a.max - prompt_cost) / p->pc;
        if (can < *max_tokens) *max_tokens = (uint32_t)can;
    }
    pthread_mutex_lock(&p->mu);
    rc = kv_ledger_escrow(p->l, &ch->a, p->id, (uint64_t)time(NULL), &vd);
    if (rc == 0) p->st.held++;
    else if (kv_ledger_refused(rc)) p->st.refused++;
    pthread_mutex_unlock(&p->mu);
    if (rc == 0) {
        ch->held = true;
        ch->n_prompt = n_prompt;
        return 0;
    }
    if (!kv_ledger_refused(rc)) {
        *status = 500;
        return kv_fail(d, rc, "ledger: %s", vd.msg);
    }
    return kv_fail(d, rc, "payment refused: %s: %s", kv_gw_refusal_str(rc), vd.msg);
refused:
    pthread_mutex_lock(&p->mu);
    p->st.refused++;
    pthread_mutex_unlock(&p->mu);
    return rc;
}

void kv_gw_pay_log_digest(const char *gateway, const uint8_t consumer[32], const uint8_t nonce[16],
                          const uint8_t node[32], uint64_t n_products, uint8_t out[32]) {
    uint8_t g[KV_GATEWAY_ID_MAX] = {0}, n8[8];
    memcpy(g, gateway, strnlen(gateway, KV_GATEWAY_ID_MAX));
    for (int i = 0; i < 8; i++) n8[i] = (uint8_t)(n_products >> (8 * i));
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, 32);
    crypto_generichash_update(&st, (const uint8_t *)"kvr-log-v1", 10);
    crypto_generichash_update(&st, g, sizeof g);
    crypto_generichash_update(&st, consumer, 32);
    crypto_generichash_update(&st, nonce, 16);
    crypto_generichash_update(&st, node, 32);
    crypto_generichash_update(&st, n8, 8);
    crypto_generichash_final(&st, out, 32);
}

int kv_gw_pay_release(kv_gw_pay *p, kv_gw_charge *ch, kv_diag *d) {
    if (!ch->held) return 0;
    pthread_mutex_lock(&p->mu);
    int rc = kv_ledger_release(p->l, ch->a.consumer, ch->a.nonce, d);
    if (rc >= 0) p->st.released++;
    pthread_mutex_unlock(&p->mu);
    if (rc >= 0) ch->held = false;
    return rc < 0 ? rc : 0;
}

int kv_gw_pay_settle(kv_gw_pay *p, kv_gw_charge *ch, uint64_t completion_tokens, const kv_gw_work *w,
                     kv_settle_result *res, kv_diag *d) {
    if (res) memset(res, 0, sizeof *res);
    if (!ch->held) return 0;
    if (completion_tokens == 0 && (!w || w->products == 0)) return kv_gw_pay_release(p, ch, d);
    /* the dispatch log: keyed workers by their answers, the rest (this
       process, and workers that proved no key) under the gateway's key */
    const uint32_t n_nodes = w ? w->n_nodes : 0;
    kv_dispatch_entry *log = calloc((size_t)n_nodes + 1, sizeof *log);
    kv_receipt *rcp = calloc((size_t)n_nodes + 1, sizeof *rcp);
    size_t n_log = 0, n_rcp = 0;
    int rc = 0;
    if (!log || !rcp) {
        rc = kv_fail(d, KV_ENOMEM, "pay: out of memory");
        goto out;
    }
    uint64_t own = w ? w->products : 0;
    for (uint32_t i = 0; i < n_nodes; i++) {
        const kv_gw_work_node *nd = &w->nodes[i];
        if (!nd->answered) continue;
        own = own >= nd->answered ? own - nd->answered : 0;
        if (!nd->has_key || !memcmp(nd->key, p->key.pk, 32)) {
            own += nd->answered;
            continue;
        }
        size_t j = 0;
        while (j < n_log && memcmp(log[j].node, nd->key, 32)) j++;
        if (j < n_log) { /* one key behind two addresses: one entry; its receipt covers the sum */
            log[j].n_products += nd->answered;
        } else {
            memcpy(log[n_log].node, nd->key, 32);
            log[n_log++].n_products = nd->answered;
        }
    }
    for (size_t j = 0; j < n_log; j++) {
        kv_gw_pay_log_digest(p->id, ch->a.consumer, ch->a.nonce, log[j].node, log[j].n_products, log[j].log_digest);
        for (uint32_t i = 0; i < n_nodes; i++) {
            const kv_receipt *r = w->nodes[i].receipt;
            if (r && !memcmp(r->node, log[j].node, 32) && r->n_products == log[j].n_products &&
                !memcmp(r->log_digest, log[j].log_digest, 32)) {
                rcp[n_rcp++] = *r;
                break;
            }
        }
    }
    if (own > KV_LEDGER_MAX_PRODUCTS) own = KV_LEDGER_MAX_PRODUCTS;
    if (own) {
        kv_dispatch_entry *e = &log[n_log++];
        memcpy(e->node, p->key.pk, 32);
        e->n_products = own;
        kv_gw_pay_log_digest(p->id, ch->a.consumer, ch->a.nonce, e->node, own, e->log_digest);
        if ((rc = kv_receipt_sign(&rcp[n_rcp], &p->key, &ch->a, own, e->log_digest, d))) goto out;
        n_rcp++;
    }
    for (size_t j = 0; j < n_log; j++)
        if (log[j].n_products > KV_LEDGER_MAX_PRODUCTS) log[j].n_products = KV_LEDGER_MAX_PRODUCTS;
    kv_settle_req req = {.prompt_tokens = ch->n_prompt, .completion_tokens = completion_tokens,
                               .price_prompt = p->pp, .price_completion = p->pc, .log = log, .n_log = n_log,
                               .receipts = rcp, .n_receipts = n_rcp};
    memcpy(req.consumer, ch->a.consumer, 32);
    memcpy(req.nonce, ch->a.nonce, 16);
    kv_settle_result r = {0};
    pthread_mutex_lock(&p->mu);
    rc = kv_ledger_settle(p->l, &req, &r, d);
    if (rc >= 0) {
        p->st.settled++;
        p->st.charged += r.cost;
        p->st.to_nodes += r.to_nodes;
        p->st.fees += r.fee;
    }
    pthread_mutex_unlock(&p->mu);
    if (rc >= 0) {
        ch->held = false;
        if (res) *res = r;
        rc = 0;
    }
out:
    free(log);
    free(rcp);
    return rc;
}

char *kv_gw_pay_prices_json(const kv_gw_pay *p) {
    char node[KV_LEDGER_ACCOUNT_MAX];
    kv_ledger_account_node(p->key.pk, node);
    json_t *j = json_pack("{s:s,s:s,s:s,s:I,s:I,s:s}", "gateway", p->id, "currency", "KVR", "unit", "micro-KVR",
                          "prompt_token", (json_int_t)p->pp, "completion_token", (json_int_t)p->pc, "node", node);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

void kv_gw_pay_get_stats(kv_gw_pay *p, kv_gw_pay_stats *out) {
    pthread_mutex_lock(&p->mu);
    *out = p->st;
    pthread_mutex_unlock(&p->mu);
}
