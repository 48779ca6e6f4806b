/* What the gateway tells about itself (server_internal.h): the Prometheus
 * text of GET /metrics, the sessions of GET /v1/slots, the body of GET
 * /health. Read under g->mu, so each answer is one consistent snapshot. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/server_internal.h"

static const unsigned kv_gw_codes[KV_GW_N_CODES] = {200, 400, 401, 402, 404, 405, 413, 500, 503, 502};
static const double kv_gw_buckets[KV_GW_N_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                      0.1,   0.25,   0.5,   1,    2.5,   10};

int kv_gw_code_index(unsigned status) {
    for (int i = 0; i < KV_GW_N_CODES; i++)
        if (kv_gw_codes[i] == status) return i;
    return 7; /* 500 */
}

void kv_gw_metrics_step_locked(kv_gateway *g, double dt) {
    g->steps++;
    g->step_sum += dt;
    int b = 0;
    while (b < KV_GW_N_BUCKETS && dt > kv_gw_buckets[b]) b++;
    g->step_bucket[b]++;
}

/* Appends one printf-formatted line (under 512 bytes) to b. */
__attribute__((format(printf, 2, 3))) static void metric_line(kv_gw_buf *b, const char *fmt, ...) {
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n > 0) kv_gw_buf_add(b, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
}

/* The head of a metric family: its HELP and TYPE lines. */
static void metric_head(kv_gw_buf *b, const char *name, const char *type, const char *help) {
    metric_line(b, "# HELP %s %s\n", name, help);
    metric_line(b, "# TYPE %s %s\n", name, type);
}

/* A metric family of one unlabelled sample: head, then "name value". */
static void metric_u(kv_gw_buf *b, const char *name, const char *type, uint64_t v, const char *help) {
    metric_head(b, name, type, help);
    metric_line(b, "%s %llu\n", name, (unsigned long long)v);
}

static void metric_f(kv_gw_buf *b, const char *name, const char *type, double v, const char *help) {
    metric_head(b, name, type, help);
    metric_line(b, "%s %.6f\n", name, v);
}

char *kv_gw_metrics_text(kv_gateway *g) {
    kv_gw_buf b = {0};
#define KV_M(...) metric_line(&b, __VA_ARGS__)
    pthread_mutex_lock(&g->mu);
    metric_head(&b, "kvasir_gateway_requests_total", "counter", "HTTP requests answered, by API and status.");
    for (int a = 0; a <= KV_GW_API_COUNT; a++)
        for (int k = 0; k < KV_GW_N_CODES; k++)
            if (g->req_count[a][k])
                KV_M("kvasir_gateway_requests_total{api=\"%s\",code=\"%u\"} %llu\n", a < KV_GW_API_COUNT ? kv_gw_api(a)->name : "other",
                     kv_gw_codes[k], (unsigned long long)g->req_count[a][k]);
    metric_u(&b, "kvasir_gateway_prompt_tokens_total", "counter", g->tokens_prompt,
             "Prompt tokens of admitted requests.");
    metric_u(&b, "kvasir_gateway_completion_tokens_total", "counter", g->tokens_completion,
             "Tokens generated for clients.");
    metric_u(&b, "kvasir_gateway_generated_tokens_total", "counter", g->tokens_generated,
             "Tokens the engine generated for requests.");
    metric_u(&b, "kvasir_gateway_cancelled_total", "counter", g->cancelled,
             "Sessions freed because the client went away or a stop string matched.");
    metric_u(&b, "kvasir_gateway_rejected_total", "counter", g->rejected_full,
             "Requests refused with 503 (queue full).");
    metric_u(&b, "kvasir_gateway_queue_depth", "gauge", g->n_queued, "Requests waiting for a session.");
    metric_u(&b, "kvasir_gateway_active_sessions", "gauge", g->n_active, "Sessions in the running batch.");
    metric_u(&b, "kvasir_gateway_max_batch_sessions", "gauge", g->max_batch, "Most sessions one engine step carried.");
    metric_head(&b, "kvasir_gateway_step_seconds", "histogram", "Engine step (one batched forward pass) wall time.");
    uint64_t cum = 0;
    for (int k = 0; k < KV_GW_N_BUCKETS; k++) {
        cum += g->step_bucket[k];
        KV_M("kvasir_gateway_step_seconds_bucket{le=\"%g\"} %llu\n", kv_gw_buckets[k], (unsigned long long)cum);
    }
    cum += g->step_bucket[KV_GW_N_BUCKETS];
    KV_M("kvasir_gateway_step_seconds_bucket{le=\"+Inf\"} %llu\n", (unsigned long long)cum);
    KV_M("kvasir_gateway_step_seconds_sum %.6f\n", g->step_sum);
    KV_M("kvasir_gateway_step_seconds_count %llu\n", (unsigned long long)g->steps);
    metric_u(&b, "kvasir_gateway_displaced_total", "counter", g->displaced,
             "Queued requests displaced (503) by another client's, the queue full.");
    metric_u(&b, "kvasir_gateway_parse_refused_total", "counter", g->parse_refused,
             "Bodies refused for the memory their JSON needed (413, or 503 when all was reserved).");
    metric_u(&b, "kvasir_gateway_parse_bytes", "gauge", g->parse_live,
             "Memory parsed request bodies hold (or is reserved for parses).");
    if (g->guard) {
        kv_http_guard_stats gs;
        kv_http_guard_get_stats(g->guard, &gs);
        metric_head(&b, "kvasir_gateway_connections_closed_total", "counter",
                    "Connections the guard closed or refused, by reason.");
        KV_M("kvasir_gateway_connections_closed_total{reason=\"deadline\"} %llu\n", (unsigned long long)gs.expired);
        KV_M("kvasir_gateway_connections_closed_total{reason=\"evicted\"} %llu\n", (unsigned long long)gs.evicted);
        KV_M("kvasir_gateway_connections_closed_total{reason=\"per_ip\"} %llu\n", (unsigned long long)gs.refused_ip);
        KV_M("kvasir_gateway_connections_closed_total{reason=\"full\"} %llu\n", (unsigned long long)gs.refused_full);
        metric_u(&b, "kvasir_gateway_connections_open", "gauge", gs.open, "Connections open now.");
    }
    if (g->eng.spec_steps) { /* speculative decoding (--draft) */
        const kv_engine_stats *es = &g->eng;
        metric_u(&b, "kvasir_gateway_spec_verify_steps_total", "counter", es->spec_steps,
                 "Forward passes that verified drafted tokens, per session.");
        metric_u(&b, "kvasir_gateway_spec_drafted_tokens_total", "counter", es->spec_drafted,
                 "Drafted tokens verified.");
        metric_u(&b, "kvasir_gateway_spec_accepted_tokens_total", "counter", es->spec_accepted,
                 "Drafted tokens equal to the token drawn there.");
        metric_f(&b, "kvasir_gateway_spec_acceptance", "gauge", es->spec_drafted ? (double)es->spec_accepted / (double)es->spec_drafted : 0.0,
                 "Accepted over drafted tokens.");
        metric_f(&b, "kvasir_gateway_spec_tokens_per_verify", "gauge", (double)es->spec_emitted / (double)es->spec_steps,
                 "Tokens a verify pass yielded, on average.");
    }
    if (g->eng.cache_budget || g->eng.cache_lookups) { /* a ring's caches are its nodes': lookups, hits, tokens */
        const kv_engine_stats *es = &g->eng;
        metric_u(&b, "kvasir_gateway_prompt_cache_lookups_total", "counter", es->cache_lookups,
                 "New sessions' prompts looked up in the prompt cache.");
        metric_u(&b, "kvasir_gateway_prompt_cache_hits_total", "counter", es->cache_hits,
                 "Lookups that reused a cached prefix.");
        metric_u(&b, "kvasir_gateway_prompt_cache_tokens_total", "counter", es->cache_tokens,
                 "Prompt tokens taken from the cache, not evaluated.");
    }
    if (g->eng.cache_budget) {
        const kv_engine_stats *es = &g->eng;
        metric_u(&b, "kvasir_gateway_prompt_cache_evictions_total", "counter", es->cache_evictions,
                 "Cache blocks evicted for room (least recently used).");
        metric_u(&b, "kvasir_gateway_prompt_cache_bytes", "gauge", es->cache_bytes, "Memory the prompt cache holds.");
        metric_u(&b, "kvasir_gateway_prompt_cache_budget_bytes", "gauge", es->cache_budget,
                 "The prompt cache's memory budget (--prompt-cache).");
        metric_u(&b, "kvasir_gateway_prompt_cache_blocks", "gauge", es->cache_blocks,
                 "Blocks (of block_tokens positions) the prompt cache holds.");
    }
    metric_u(&b, "kvasir_gateway_steps_failed_total", "counter", g->steps_failed,
             "Engine steps that failed as a whole.");
    if (g->pay) {
        kv_gw_pay_stats ps;
        kv_gw_pay_get_stats(g->pay, &ps);
        metric_head(&b, "kvasir_gateway_kvr_charges_total", "counter",
                    "Paid completions by outcome: held, settled, released, refused (402).");
        KV_M("kvasir_gateway_kvr_charges_total{outcome=\"held\"} %llu\n", (unsigned long long)ps.held);
        KV_M("kvasir_gateway_kvr_charges_total{outcome=\"settled\"} %llu\n", (unsigned long long)ps.settled);
        KV_M("kvasir_gateway_kvr_charges_total{outcome=\"released\"} %llu\n", (unsigned long long)ps.released);
        KV_M("kvasir_gateway_kvr_charges_total{outcome=\"refused\"} %llu\n", (unsigned long long)ps.refused);
        metric_head(&b, "kvasir_gateway_kvr_micro_total", "counter",
                    "micro-KVR settled: cost, of it to nodes and to the treasury.");
        KV_M("kvasir_gateway_kvr_micro_total{to=\"cost\"} %llu\n", (unsigned long long)ps.charged);
        KV_M("kvasir_gateway_kvr_micro_total{to=\"nodes\"} %llu\n", (unsigned long long)ps.to_nodes);
        KV_M("kvasir_gateway_kvr_micro_total{to=\"treasury\"} %llu\n", (unsigned long long)ps.fees);
    }
    if (g->n_ring) {
        uint32_t up = 0, whole = 0;
        for (uint32_t i = 0; i < g->n_ring; i++) {
            up += g->ring_st[i].up;
            whole += g->ring_st[i].up && (g->ring_st[i].st.flags & KV_RING_STATUS_WHOLE);
        }
        metric_u(&b, "kvasir_gateway_ring_nodes_reachable", "gauge", up,
                 "Ring entry nodes that answered the last STATUS.");
        metric_u(&b, "kvasir_gateway_ring_nodes_whole", "gauge", whole, "Ring entry nodes that see the ring whole.");
    }
    if (g->man) {
        metric_u(&b, "kvasir_gateway_steps_retried_total", "counter", g->steps_retried,
                 "Failed steps whose sessions were kept for a retry.");
        metric_u(&b, "kvasir_gateway_shards_total", "gauge", g->cov_total,
                 "Shards (expert slabs of MoE layers) the model needs.");
        metric_u(&b, "kvasir_gateway_shards_covered", "gauge", g->cov_covered,
                 "Shards whose every expert a worker that is up (or a local slab) serves.");
        metric_u(&b, "kvasir_gateway_workers_up", "gauge", g->cov_up, "Workers handshaken now.");
        metric_u(&b, "kvasir_gateway_workers_added_total", "counter", g->workers_added,
                 "Workers added from the hub's placement map.");
        metric_u(&b, "kvasir_gateway_hedges_total", "counter", g->hedges,
                 "Expert requests also sent to a replica after their worker's hedge time.");
        metric_u(&b, "kvasir_gateway_hedges_won_total", "counter", g->hedges_won,
                 "Hedged requests whose replica answered first.");
        metric_u(&b, "kvasir_gateway_hedged_pairs_total", "counter", g->hedged_pairs,
                 "(token, expert) slots hedges carried: computed twice unless the loser was cancelled.");
        metric_u(&b, "kvasir_gateway_late_answers_total", "counter", g->late_answers,
                 "Worker answers discarded because a replica had answered first.");
        metric_u(&b, "kvasir_gateway_hedges_cancelled_total", "counter", g->hedges_cancelled,
                 "Superseded requests their worker dropped on a CANCEL, before computing them.");
        metric_head(&b, "kvasir_gateway_answer_signatures_total", "counter",
                    "Signed worker answers: checked on arrival, or taken unchecked over a TLS link bound to the "
                    "worker's key (checked later only if a lie is caught in them; docs/PROTOCOL.md \"Signed results\").");
        KV_M("kvasir_gateway_answer_signatures_total{check=\"checked\"} %llu\n", (unsigned long long)g->sigs_checked);
        KV_M("kvasir_gateway_answer_signatures_total{check=\"deferred\"} %llu\n", (unsigned long long)g->sigs_deferred);
        const kv_gw_autoscale *a = &g->as;
        metric_head(&b, "kvasir_gateway_expert_pairs_total", "counter",
                    "Expert computations by where they ran: held (a local slab\n"
                    "# within --local-experts), local (any local slab, held ones included), remote (a worker).");
        KV_M("kvasir_gateway_expert_pairs_total{where=\"held\"} %llu\n", (unsigned long long)a->pairs_held_local);
        KV_M("kvasir_gateway_expert_pairs_total{where=\"local\"} %llu\n", (unsigned long long)a->pairs_local);
        KV_M("kvasir_gateway_expert_pairs_total{where=\"remote\"} %llu\n", (unsigned long long)a->pairs_remote);
        metric_head(&b, "kvasir_gateway_shard_computations_total", "counter",
                    "Expert computations needed per shard (demand).");
        for (size_t i = 0; a->demand && i < a->n_demand; i++)
            KV_M("kvasir_gateway_shard_computations_total{layer=\"%u\",first=\"%u\",last=\"%u\"} %llu\n",
                 g->man->slabs[i].layer, g->man->slabs[i].first, g->man->slabs[i].last,
                 (unsigned long long)a->demand[i].computations);
        metric_head(&b, "kvasir_gateway_shard_wait_seconds_total", "counter",
                    "Time each shard's computations were waited for.");
        for (size_t i = 0; a->demand && i < a->n_demand; i++)
            KV_M("kvasir_gateway_shard_wait_seconds_total{layer=\"%u\",first=\"%u\",last=\"%u\"} %.6f\n",
                 g->man->slabs[i].layer, g->man->slabs[i].first, g->man->slabs[i].last,
                 (double)a->demand[i].wait_us / 1e6);
        if (g->demand) {
            metric_head(&b, "kvasir_gateway_demand_reports_total", "counter", "Demand reports to the hub, by result.");
            KV_M("kvasir_gateway_demand_reports_total{result=\"ok\"} %llu\n", (unsigned long long)g->demand_reports);
            KV_M("kvasir_gateway_demand_reports_total{result=\"error\"} %llu\n", (unsigned long long)g->demand_report_errors);
            metric_u(&b, "kvasir_gateway_demand_tokens_accepted_total", "counter", g->demand_tokens_accepted,
                     "Tokens the hub counted of the reports (its budget bounds them).");
        }
        if (a->on) {
            static const char *const mode[] = {"tight", "mixed", "wide"};
            const int mi = a->level == 0 ? 0 : a->level == KV_GW_AS_LEVELS ? 2 : 1;
            metric_head(&b, "kvasir_gateway_local_mode", "gauge",
                        "Local experts: tight (all held computed here), mixed, wide (all to workers).");
            for (int k = 0; k < 3; k++) KV_M("kvasir_gateway_local_mode{mode=\"%s\"} %d\n", mode[k], k == mi);
            metric_head(&b, "kvasir_gateway_local_share", "gauge", "Share of the held experts computed here (0..1).");
            KV_M("kvasir_gateway_local_share %.4f\n", 1.0 - (double)a->level / KV_GW_AS_LEVELS);
            metric_head(&b, "kvasir_gateway_local_decisions_total", "counter",
                        "Local-share decisions: widen (more to workers), tighten.");
            KV_M("kvasir_gateway_local_decisions_total{decision=\"widen\"} %llu\n", (unsigned long long)a->widened);
            KV_M("kvasir_gateway_local_decisions_total{decision=\"tighten\"} %llu\n", (unsigned long long)a->tightened);
            metric_u(&b, "kvasir_gateway_local_unpaid_total", "counter", a->unpaid,
                     "Tightenings because the wider share cost more per session.");
            metric_u(&b, "kvasir_gateway_local_probes_total", "counter", a->probes,
                     "Tightenings to measure the narrower share at this load.");
            metric_u(&b, "kvasir_gateway_local_held_bytes", "gauge", a->held_bytes,
                     "Bytes of slabs held within --local-experts.");
            metric_u(&b, "kvasir_gateway_local_held_slabs", "gauge", a->held_slabs,
                     "Slabs held within --local-experts.");
            metric_f(&b, "kvasir_gateway_step_target_seconds", "gauge", a->target_s,
                     "Step time past which the share widens (0: not derived yet).");
            metric_f(&b, "kvasir_gateway_step_average_seconds", "gauge", a->ewma_s, "Moving average of the step time.");
        }
    }
    pthread_mutex_unlock(&g->mu);
#undef KV_M
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    return b.p ? b.p : strdup("");
}

char *kv_gw_slots_json(kv_gateway *g) {
    json_t *a = json_array();
    pthread_mutex_lock(&g->mu);
    for (int pass = 0; pass < 2; pass++)
        for (kv_gw_req *r = pass ? g->queue : g->active; r; r = r->next) {
            const char *state = pass ? "queued" : r->sst == KV_SESSION_PREFILL ? "prefill" : "decode";
            json_array_append_new(a, json_pack("{s:I,s:s,s:s,s:I,s:I,s:I,s:b}", "id", (json_int_t)r->id, "api",
                                               kv_gw_api(r->api)->name, "state", state, "prompt_tokens",
                                               (json_int_t)r->n_prompt, "completion_tokens", (json_int_t)r->n_toks,
                                               "max_tokens", (json_int_t)r->max_tokens, "cancelled", r->cancel));
        }
    json_t *j = json_pack("{s:o,s:I,s:I,s:I}", "slots", a, "active", (json_int_t)g->n_active, "queued",
                          (json_int_t)g->n_queued, "max_active", (json_int_t)g->o.max_active);
    pthread_mutex_unlock(&g->mu);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

/* GET /health: 200 {"status":"ok"} when the model is loaded and, with
 * workers, every shard covered; 503 {"status":"unavailable","reason"}
 * otherwise. With workers both carry the coverage: shards covered / total,
 * workers up, and the first uncovered shards. */
char *kv_gw_health_json(kv_gateway *g, bool *okp) {
    pthread_mutex_lock(&g->mu);
    const bool ok = g->healthy && !g->quit;
    *okp = ok;
    char msg[300];
    snprintf(msg, sizeof msg, "%s", g->health_msg);
    json_t *j = ok ? json_pack("{s:s,s:s}", "status", "ok", "model", g->model)
                   : json_pack("{s:s,s:s,s:s}", "status", "unavailable", "model", g->model, "reason",
                               msg[0] ? msg : "stopping");
    if (j && g->n_ring) { /* what each entry node said last */
        json_t *nodes = json_array();
        for (uint32_t i = 0; i < g->n_ring; i++) {
            const kv_ring_status *st = &g->ring_st[i].st;
            json_t *e = g->ring_st[i].up
                            ? json_pack("{s:s,s:b,s:b,s:I,s:I,s:I,s:I,s:I}", "addr", g->ring[i], "reachable", 1, "whole",
                                        (st->flags & KV_RING_STATUS_WHOLE) != 0, "first", (json_int_t)st->first,
                                        "last", (json_int_t)st->last, "n_layer", (json_int_t)st->n_layer, "n_ctx",
                                        (json_int_t)st->n_ctx, "sequences", (json_int_t)st->n_seqs)
                            : json_pack("{s:s,s:b,s:b}", "addr", g->ring[i], "reachable", 0, "whole", 0);
            const char *why = g->ring_st[i].up ? st->msg : g->ring_st[i].err;
            if (e && why[0]) {
                char clean[3 * sizeof g->ring_st[i].err + 3 * KV_RING_MAX_MSG + 1];
                clean[kv_gw_utf8_clean(why, strlen(why), clean)] = 0;
                json_object_set_new(e, "reason", json_string(clean));
            }
            json_array_append_new(nodes, e);
        }
        json_object_set_new(j, "ring", nodes);
    }
    if (j && g->man) {
        json_t *miss = json_array();
        for (uint32_t i = 0; i < g->cov_n_missing; i++) {
            const kv_manifest_slab *sl = &g->man->slabs[g->cov_missing[i]];
            json_array_append_new(miss, json_pack("{s:I,s:I,s:I}", "layer", (json_int_t)sl->layer, "first",
                                                  (json_int_t)sl->first, "last", (json_int_t)sl->last));
        }
        json_object_set_new(j, "shards_total", json_integer(g->cov_total));
        json_object_set_new(j, "shards_covered", json_integer(g->cov_covered));
        json_object_set_new(j, "workers_up", json_integer(g->cov_up));
        json_object_set_new(j, "missing", miss);
        if (g->cov_total - g->cov_covered > g->cov_n_missing) json_object_set_new(j, "missing_truncated", json_true());
    }
    pthread_mutex_unlock(&g->mu);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}
