/* The gateway server's life (server_internal.h says which file holds
 * what): kv_gateway_start checks the options, starts the scheduler (and a
 * ring's watcher), the payments and the HTTP daemon; kv_gateway_free stops
 * them in the reverse order. Also the API keys file. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <sodium.h>

#include "gateway/server_internal.h"
#include "http/https_mhd.h"

/* ---- life ------------------------------------------------------------- */

/* The chat template: o's, or the model's own (tokenizer.chat_template);
 * none, or one this interpreter cannot parse, is ChatML, said once here. A
 * ring's home applies ChatML itself unless a template is given here. */
static int kv_gw_template_start(kv_gateway *g, const kv_gateway_opts *o, kv_diag *d) {
    if (o->chat_template) {
        if (o->chat_template_len > KV_GATEWAY_MAX_TEMPLATE)
            return kv_fail(d, KV_ERANGE, "gateway: the chat template %s has %zu bytes, at most %u",
                           o->chat_template_name ? o->chat_template_name : "--chat-template", o->chat_template_len,
                           KV_GATEWAY_MAX_TEMPLATE);
        const int rc = kv_gw_tmpl_open(&g->tmpl, g->tok, o->chat_template, o->chat_template_len,
                                       o->chat_template_name ? o->chat_template_name : "--chat-template", d);
        if (rc) kv_diag_prefix(d, rc, "gateway");
        return rc;
    }
    if (!g->e) return 0;
    const kv_gguf *gg = kv_model_gguf(kv_engine_model(g->e));
    kv_str src = {0};
    kv_diag td = {0};
    if (!gg || !kv_gguf_find_kv(gg, "tokenizer.chat_template") ||
        kv_gguf_get_str(gg, "tokenizer.chat_template", &src, &td)) {
        fprintf(stderr, "gateway: the model has no chat template (tokenizer.chat_template): prompts are ChatML "
                "(--chat-template FILE gives one)\n");
        return 0;
    }
    if (src.len > KV_GATEWAY_MAX_TEMPLATE) {
        fprintf(stderr, "gateway: the model's chat template has %zu bytes, over %u: prompts are ChatML "
                "(--chat-template FILE gives one)\n", src.len, KV_GATEWAY_MAX_TEMPLATE);
        return 0;
    }
    if (kv_gw_tmpl_open(&g->tmpl, g->tok, src.ptr, src.len, "tokenizer.chat_template", &td)) {
        if (td.code == KV_ENOMEM) return kv_fail(d, KV_ENOMEM, "gateway: out of memory");
        fprintf(stderr, "gateway: the model's chat template cannot be used (%s): prompts are ChatML "
                "(--chat-template FILE gives one)\n", td.msg);
    }
    return 0;
}

int kv_gateway_start(kv_gateway **out, kv_engine *e, const kv_gateway_opts *opts, kv_diag *d) {
    *out = NULL;
    kv_gateway_opts o = opts ? *opts : (kv_gateway_opts){0};
    if (!o.host) o.host = "127.0.0.1";
    if (!o.model_name) o.model_name = "kvasir";
    if (!o.max_active) o.max_active = 16;
    if (!o.queue_max) o.queue_max = 64;
    if (!o.max_conns) o.max_conns = 256;
    if (!o.per_ip_conns) o.per_ip_conns = 16;
    if (!o.timeout_s) o.timeout_s = 120;
    if (!o.request_s) o.request_s = 30;
    if (!o.body_max) o.body_max = 1u << 20;
    if (!o.parse_max) o.parse_max = 4 * o.body_max + (1u << 20);
    if (!o.parse_total) o.parse_total = o.parse_max * 4 > (256u << 20) ? o.parse_max * 4 : (256u << 20);
    if (!o.max_tokens_default) o.max_tokens_default = 512;
    if (!o.step_retry_ms) o.step_retry_ms = 30000;
    if (!o.ring_timeout_ms) o.ring_timeout_ms = 60000;
    if (!o.ring_status_ms) o.ring_status_ms = 1000;
    if (o.n_ring) {
        if (e) return kv_fail(d, KV_EINVAL, "gateway: a ring gateway has no engine of its own");
        if (o.n_ring > KV_GATEWAY_MAX_RING)
            return kv_fail(d, KV_EINVAL, "gateway: %u ring entry nodes, at most %u", o.n_ring, KV_GATEWAY_MAX_RING);
        if (o.hub_url) return kv_fail(d, KV_EINVAL, "gateway: a ring and a hub's placement map are two ways to serve: give one");
        if (o.ledger_path)
            return kv_fail(d, KV_EUNSUPPORTED, "gateway: charging (a ledger) is not supported with a ring yet: the hold "
                           "needs the prompt's token count before the request is sent, and ring nodes sign no receipts");
        for (uint32_t i = 0; i < o.n_ring; i++)
            if (!o.ring_addrs[i] || !*o.ring_addrs[i] || strlen(o.ring_addrs[i]) > 255)
                return kv_fail(d, KV_EINVAL, "gateway: ring entry %u is empty or too long", i);
    } else if (!e && !o.down_msg) {
        return kv_fail(d, KV_EINVAL, "gateway: an engine or a ring is needed");
    } else if (e && o.down_msg) {
        return kv_fail(d, KV_EINVAL, "gateway: a model that cannot run has no engine");
    }
    if (o.hub_url && (!e || !kv_engine_remote(e)))
        return kv_fail(d, KV_EINVAL, "gateway: a hub URL needs an engine whose experts are on workers");
    if (o.body_max > KV_GATEWAY_MAX_BODY) return kv_fail(d, KV_EINVAL, "gateway: body limit %zu is over %u", o.body_max, KV_GATEWAY_MAX_BODY);
    if (o.parse_max > o.parse_total)
        return kv_fail(d, KV_EINVAL, "gateway: parse memory per request (%zu) is over the total (%zu)", o.parse_max, o.parse_total);
    if (o.request_s > 86400) return kv_fail(d, KV_EINVAL, "gateway: request deadline %u s is over a day", o.request_s);
    if (o.n_api_keys > KV_GATEWAY_MAX_KEYS) return kv_fail(d, KV_EINVAL, "gateway: %u keys, at most %u", o.n_api_keys, KV_GATEWAY_MAX_KEYS);
    if (strlen(o.model_name) > KV_GW_MAX_MODEL_LEN) return kv_fail(d, KV_EINVAL, "gateway: model name too long");
    struct sockaddr_storage ss = {0};
    struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
    if (inet_pton(AF_INET, o.host, &s4->sin_addr) == 1) {
        s4->sin_family = AF_INET;
        s4->sin_port = htons(o.port);
    } else if (inet_pton(AF_INET6, o.host, &s6->sin6_addr) == 1) {
        s6->sin6_family = AF_INET6;
        s6->sin6_port = htons(o.port);
    } else {
        return kv_fail(d, KV_EINVAL, "gateway: '%.100s' is not an IPv4 or IPv6 address", o.host);
    }
    kv_gateway *g = calloc(1, sizeof *g);
    if (!g) return kv_fail(d, KV_ENOMEM, "gateway: out of memory");
    g->e = e;
    g->tok = e ? kv_model_tok(kv_engine_model(e)) : NULL;
    g->n_ctx = e ? kv_engine_n_ctx(e) : 0;
    snprintf(g->model, sizeof g->model, "%s", o.model_name);
    g->started = (long long)time(NULL);
    pthread_mutex_init(&g->mu, NULL);
    pthread_mutex_init(&g->caught_mu, NULL);
    pthread_cond_init(&g->work_cv, NULL);
    pthread_cond_init(&g->out_cv, NULL);
    pthread_cond_init(&g->ring_cv, NULL);
    g->hold = o.hold;
    for (uint32_t i = 0; i < o.n_ring; i++)
        if (!(g->ring[g->n_ring++] = strdup(o.ring_addrs[i]))) {
            kv_gateway_free(g);
            return kv_fail(d, KV_ENOMEM, "gateway: out of memory");
        }
    if (sodium_init() < 0) {
        kv_gateway_free(g);
        return kv_fail(d, KV_EINTERNAL, "gateway: libsodium did not initialize");
    }
    randombytes_buf(g->client_salt, sizeof g->client_salt);
    kv_json_budget_install();
    if (o.ring_key_sk) {
        memcpy(g->ring_sk, o.ring_key_sk, 64);
    } else if (o.n_ring) {
        uint8_t pk[32];
        crypto_sign_keypair(pk, g->ring_sk);
    }
    if (o.ring_voucher) {
        g->ring_voucher = *o.ring_voucher;
        g->has_ring_voucher = true;
    }
    o.ring_addrs = NULL;
    o.ring_key_sk = NULL;
    o.ring_voucher = NULL;
    int rc = 0;
    if (o.n_api_keys) {
        if (!(g->keys = calloc(o.n_api_keys, sizeof *g->keys))) { rc = kv_fail(d, KV_ENOMEM, "gateway: out of memory"); goto fail; }
        for (uint32_t i = 0; i < o.n_api_keys; i++) {
            const size_t l = o.api_keys[i] ? strlen(o.api_keys[i]) : 0;
            if (l == 0 || l > KV_GATEWAY_MAX_KEY_LEN) { rc = kv_fail(d, KV_EINVAL, "gateway: API key %u is empty or over %u bytes", i, KV_GATEWAY_MAX_KEY_LEN); goto fail; }
            if (!(g->keys[i] = strdup(o.api_keys[i]))) { rc = kv_fail(d, KV_ENOMEM, "gateway: out of memory"); goto fail; }
            g->n_keys++;
        }
    }
    o.api_keys = NULL;
    o.model_name = g->model;
    o.host = NULL;
    if (e && kv_engine_remote(e)) g->man = kv_remote_manifest(kv_engine_remote(e));
    if (o.hub_url && (rc = kv_gw_watch_start(&g->watch, o.hub_url, o.hub_refresh_ms, d))) goto fail;
    const char *demand_hub = o.hub_url; /* the caller's, read before the start returns */
    o.hub_url = NULL;
    g->o = o;
    if (o.ledger_path) {
        uint64_t n_rec = 0;
        if ((rc = kv_gw_pay_open(&g->pay, o.ledger_path, o.gateway_key_path, o.gateway_id, o.price_prompt,
                                 o.price_completion, &n_rec, d))) {
            kv_diag_prefix(d, rc, "gateway: ledger");
            goto fail;
        }
        if (n_rec) fprintf(stderr, "gateway: released %llu holds a previous run of %s left\n",
                           (unsigned long long)n_rec, kv_gw_pay_id(g->pay));
    }
    g->o.ledger_path = g->o.gateway_key_path = g->o.gateway_id = NULL; /* the caller's strings */
    if ((rc = kv_gw_endpoints_start(g, &o, d))) goto fail;
    g->o.cors_origins = NULL;
    g->o.model_path = NULL;
    g->o.chat_template = g->o.chat_template_name = NULL;
    g->o.chat_template_len = 0;
    if ((rc = kv_gw_template_start(g, &o, d))) goto fail;
    if ((rc = kv_gw_script_load(g, d))) goto fail;
    kv_gw_sched_health_locked(g); /* before the engine changes hands: /health is right from the start */
    if ((rc = kv_gw_autoscale_open(g, o.local_experts, o.step_target_ms, d))) goto fail;
    if (demand_hub && o.demand_key && g->man && (rc = kv_gw_demand_start(&g->demand, g, demand_hub, o.demand_key, d)))
        goto fail;
    g->o.demand_key = NULL;
    if (o.down_msg) { /* for good: nothing here can run the model */
        g->healthy = false;
        snprintf(g->health_msg, sizeof g->health_msg, "%.200s", o.down_msg);
    }
    g->o.down_msg = NULL;
    if (g->n_ring) kv_gw_ring_poll(g); /* the same for a ring: the entry nodes asked once now */
    if (pthread_create(&g->sched, NULL, kv_gw_sched_main, g)) { rc = kv_fail(d, KV_EIO, "gateway: cannot start the scheduler"); goto fail; }
    g->sched_up = true;
    if (g->n_ring) {
        if (pthread_create(&g->ring_watch, NULL, kv_gw_ring_watch_main, g)) { rc = kv_fail(d, KV_EIO, "gateway: cannot start the ring watcher"); goto fail; }
        g->ring_watch_up = true;
    }
    const kv_http_guard_opts go = {.max_conns = o.max_conns, .per_ip = o.per_ip_conns, .request_ms = o.request_s * 1000};
    if ((rc = kv_http_guard_open(&g->guard, &go, d))) goto fail;
    kv_https_mhd hm; /* TLS, or plain HTTP where the loopback rule allows it */
    if ((rc = kv_https_mhd_setup(&hm, o.tls, (struct sockaddr *)&ss, o.insecure_plaintext, "gateway", d))) goto fail;
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL_INTERNAL_THREAD | hm.flags;
    if (ss.ss_family == AF_INET6) flags |= MHD_USE_IPv6;
    /* per-address limits are the guard's (it counts an IPv6 /64 as one client) */
    g->mhd = MHD_start_daemon(flags, 0, kv_http_guard_accept, g->guard, kv_gw_handle, g,
                              MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
                              MHD_OPTION_CONNECTION_LIMIT, kv_http_guard_mhd_limit(g->guard),
                              MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)o.timeout_s,
                              MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)(64 * 1024),
                              MHD_OPTION_NOTIFY_COMPLETED, kv_gw_done, g,
                              MHD_OPTION_NOTIFY_CONNECTION, kv_http_guard_notify, g->guard,
                              MHD_OPTION_ARRAY, hm.opts, MHD_OPTION_END);
    if (!g->mhd) { rc = kv_fail(d, KV_EIO, "gateway: cannot listen on %.100s port %u (in use, or not a local address?)", opts && opts->host ? opts->host : "127.0.0.1", o.port); goto fail; }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(g->mhd, MHD_DAEMON_INFO_BIND_PORT);
    g->port = di ? di->port : o.port;
    kv_gw_summary(g, opts && opts->host ? opts->host : "127.0.0.1", o.tls != NULL);
    *out = g;
    return 0;
fail:
    kv_gateway_free(g);
    return rc;
}

uint16_t kv_gateway_port(const kv_gateway *g) { return g->port; }

void kv_gateway_hold(kv_gateway *g, bool hold) {
    pthread_mutex_lock(&g->mu);
    g->hold = hold;
    pthread_cond_signal(&g->work_cv);
    pthread_mutex_unlock(&g->mu);
}

void kv_gateway_caught(kv_gateway *g, const uint8_t key[32]) {
    static const uint8_t zero[32];
    if (!g || !key || !memcmp(key, zero, 32)) return;
    pthread_mutex_lock(&g->caught_mu);
    bool known = false;
    for (uint32_t i = 0; i < g->n_caught && !known; i++) known = !memcmp(g->caught[i], key, 32);
    if (!known && g->n_caught < KV_REMOTE_MAX_WORKERS) memcpy(g->caught[g->n_caught++], key, 32);
    pthread_mutex_unlock(&g->caught_mu);
}

void kv_gateway_get_stats(kv_gateway *g, kv_gateway_stats *out) {
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&g->mu);
    for (int a = 0; a <= KV_GW_API_COUNT; a++)
        for (int k = 0; k < KV_GW_N_CODES; k++) out->requests += g->req_count[a][k];
    out->completed = g->completed;
    out->cancelled = g->cancelled;
    out->rejected_full = g->rejected_full;
    out->tokens_prompt = g->tokens_prompt;
    out->tokens_completion = g->tokens_completion;
    out->queued = g->n_queued;
    out->active = g->n_active;
    out->displaced = g->displaced;
    out->parse_refused = g->parse_refused;
    out->parse_live = g->parse_live;
    pthread_mutex_unlock(&g->mu);
    if (g->guard) {
        kv_http_guard_stats gs;
        kv_http_guard_get_stats(g->guard, &gs);
        out->conns_evicted = gs.evicted;
        out->conns_expired = gs.expired;
        out->conns_refused = gs.refused_ip + gs.refused_full;
        out->conns_open = gs.open;
    }
}

void kv_gateway_free(kv_gateway *g) {
    if (!g) return;
    if (g->sched_up) {
        pthread_mutex_lock(&g->mu);
        g->quit = true;
        pthread_cond_signal(&g->work_cv);
        pthread_cond_signal(&g->ring_cv);
        pthread_mutex_unlock(&g->mu);
        pthread_join(g->sched, NULL);
    }
    if (g->ring_watch_up) {
        pthread_mutex_lock(&g->mu);
        g->quit = true;
        pthread_cond_signal(&g->ring_cv);
        pthread_mutex_unlock(&g->mu);
        pthread_join(g->ring_watch, NULL);
    }
    for (uint32_t i = 0; i < g->n_ring; i++) free(g->ring[i]);
    sodium_memzero(g->ring_sk, sizeof g->ring_sk);
    if (g->mhd) MHD_stop_daemon(g->mhd); /* every connection ends: their payments are settled or released */
    kv_http_guard_free(g->guard);
    kv_gw_demand_free(g->demand); /* before the counters it reads go */
    kv_gw_watch_free(g->watch);
    kv_gw_pay_free(g->pay);
    kv_gw_autoscale_free(g);
    kv_gw_tmpl_free(g->tmpl);
    kv_gw_ring_free(g);
    kv_gw_script_free(g);
    kv_gw_endpoints_free(g);
    for (uint32_t i = 0; i < g->n_keys; i++) free(g->keys[i]);
    free(g->keys);
    pthread_cond_destroy(&g->work_cv);
    pthread_cond_destroy(&g->out_cv);
    pthread_cond_destroy(&g->ring_cv);
    pthread_mutex_destroy(&g->mu);
    pthread_mutex_destroy(&g->caught_mu);
    free(g);
}

/* ---- keys file -------------------------------------------------------- */

void kv_gateway_keys_free(char **keys, uint32_t n) {
    if (!keys) return;
    for (uint32_t i = 0; i < n; i++) free(keys[i]);
    free(keys);
}

int kv_gateway_keys_load(const char *path, char ***keys, uint32_t *n_keys, kv_diag *d) {
    *keys = NULL;
    *n_keys = 0;
    FILE *f = fopen(path, "r");
    if (!f) return kv_fail(d, KV_EIO, "cannot open API key file '%s': %s", path, strerror(errno));
    char line[KV_GATEWAY_MAX_KEY_LEN + 64];
    char **k = calloc(KV_GATEWAY_MAX_KEYS, sizeof *k);
    uint32_t n = 0, lineno = 0;
    int rc = k ? 0 : kv_fail(d, KV_ENOMEM, "out of memory");
    while (!rc && fgets(line, sizeof line, f)) {
        lineno++;
        size_t l = strlen(line);
        if (l == sizeof line - 1 && line[l - 1] != '\n') { rc = kv_fail(d, KV_EFORMAT, "%s:%u: key over %u bytes", path, lineno, KV_GATEWAY_MAX_KEY_LEN); break; }
        while (l && (line[l - 1] == '\n' || line[l - 1] == '\r' || line[l - 1] == ' ' || line[l - 1] == '\t')) line[--l] = 0;
        char *s = line;
        while (*s == ' ' || *s == '\t') s++;
        if (!*s || *s == '#') continue;
        for (char *q = s; *q; q++)
            if ((unsigned char)*q < 0x21 || (unsigned char)*q == 0x7f) { rc = kv_fail(d, KV_EFORMAT, "%s:%u: a key has a space or control byte", path, lineno); break; }
        if (rc) break;
        if (strlen(s) > KV_GATEWAY_MAX_KEY_LEN) { rc = kv_fail(d, KV_EFORMAT, "%s:%u: key over %u bytes", path, lineno, KV_GATEWAY_MAX_KEY_LEN); break; }
        if (n == KV_GATEWAY_MAX_KEYS) { rc = kv_fail(d, KV_ERANGE, "%s: more than %u keys", path, KV_GATEWAY_MAX_KEYS); break; }
        if (!(k[n] = strdup(s))) { rc = kv_fail(d, KV_ENOMEM, "out of memory"); break; }
        n++;
    }
    fclose(f);
    if (rc) {
        kv_gateway_keys_free(k, n);
        return rc;
    }
    *keys = k;
    *n_keys = n;
    return 0;
}

