/* What the gateway tells about itself (server_internal.h): the Prometheus
 * text of GET /metrics, the sessions of GET /v1/slots, the body of GET
 * /health. Read under g->mu, so each answer is one consistent snapshot. */
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

char *kv_gw_metrics_text(kv_gateway *g) {
    kv_gw_buf b = {0};
    char line[256];
#define KV_M(...) kv_gw_buf_add(&b, line, (size_t)snprintf(line, sizeof line, __VA_ARGS__))
    pthread_mutex_lock(&g->mu);
    KV_M("# HELP kvasir_gateway_requests_total HTTP requests answered, by API and status.\n");
    KV_M("# TYPE kvasir_gateway_requests_total counter\n");
    for (int a = 0; a <= KV_GW_API_COUNT; a++)
        for (int k = 0; k < KV_GW_N_CODES; k++)
            if (g->req_count[a][k])
                KV_M("kvasir_gateway_requests_total{api=\"%s\",code=\"%u\"} %llu\n", a < KV_GW_API_COUNT ? kv_gw_api(a)->name : "other",
                     kv_gw_codes[k], (unsigned long long)g->req_count[a][k]);
    KV_M("# HELP kvasir_gateway_prompt_tokens_total Prompt tokens of admitted requests.\n");
    KV_M("# TYPE kvasir_gateway_prompt_tokens_total counter\n");
    KV_M("kvasir_gateway_prompt_tokens_total %llu\n", (unsigned long long)g->tokens_prompt);
    KV_M("# HELP kvasir_gateway_completion_tokens_total Tokens generated for clients.\n");
    KV_M("# TYPE kvasir_gateway_completion_tokens_total counter\n");
    KV_M("kvasir_gateway_completion_tokens_total %llu\n", (unsigned long long)g->tokens_completion);
    KV_M("# HELP kvasir_gateway_generated_tokens_total Tokens the engine generated for requests.\n");
    KV_M("# TYPE kvasir_gateway_generated_tokens_total counter\n");
    KV_M("kvasir_gateway_generated_tokens_total %llu\n", (unsigned long long)g->tokens_generated);
    KV_M("# HELP kvasir_gateway_cancelled_total Sessions freed because the client went away or a stop string matched.\n");
    KV_M("# TYPE kvasir_gateway_cancelled_total counter\n");
    KV_M("kvasir_gateway_cancelled_total %llu\n", (unsigned long long)g->cancelled);
    KV_M("# HELP kvasir_gateway_rejected_total Requests refused with 503 (queue full).\n");
    KV_M("# TYPE kvasir_gateway_rejected_total counter\n");
    KV_M("kvasir_gateway_rejected_total %llu\n", (unsigned long long)g->rejected_full);
    KV_M("# HELP kvasir_gateway_queue_depth Requests waiting for a session.\n");
    KV_M("# TYPE kvasir_gateway_queue_depth gauge\n");
    KV_M("kvasir_gateway_queue_depth %u\n", g->n_queued);
    KV_M("# HELP kvasir_gateway_active_sessions Sessions in the running batch.\n");
    KV_M("# TYPE kvasir_gateway_active_sessions gauge\n");
    KV_M("kvasir_gateway_active_sessions %u\n", g->n_active);
    KV_M("# HELP kvasir_gateway_max_batch_sessions Most sessions one engine step carried.\n");
    KV_M("# TYPE kvasir_gateway_max_batch_sessions gauge\n");
    KV_M("kvasir_gateway_max_batch_sessions %u\n", g->max_batch);
    KV_M("# HELP kvasir_gateway_step_seconds Engine step (one batched forward pass) wall time.\n");
    KV_M("# TYPE kvasir_gateway_step_seconds histogram\n");
    uint64_t cum = 0;
    for (int k = 0; k < KV_GW_N_BUCKETS; k++) {
        cum += g->step_bucket[k];
        KV_M("kvasir_gateway_step_seconds_bucket{le=\"%g\"} %llu\n", kv_gw_buckets[k], (unsigned long long)cum);
    }
    cum += g->step_bucket[KV_GW_N_BUCKETS];
    KV_M("kvasir_gateway_step_seconds_bucket{le=\"+Inf\"} %llu\n", (unsigned long long)cum);
    KV_M("kvasir_gateway_step_seconds_sum %.6f\n", g->step_sum);
    KV_M("kvasir_gateway_step_seconds_count %llu\n", (unsigned long long)g->steps);
    KV_M("# HELP kvasir_gateway_displaced_total Queued requests displaced (503) by another client's, the queue full.\n");
    KV_M("# TYPE kvasir_gateway_displaced_total counter\n");
    KV_M("kvasir_gateway_displaced_total %llu\n", (unsigned long long)g->displaced);
    KV_M("# HELP kvasir_gateway_parse_refused_total Bodies refused for the memory their JSON needed (413, or 503 when all was reserved).\n");
    KV_M("# TYPE kvasir_gateway_parse_refused_total counter\n");
    KV_M("kvasir_gateway_parse_refused_total %llu\n", (unsigned long long)g->parse_refused);
    KV_M("# HELP kvasir_gateway_parse_bytes Memory parsed request bodies hold (or is reserved for parses).\n");
    KV_M("# TYPE kvasir_gateway_parse_bytes gauge\n");
    KV_M("kvasir_gateway_parse_bytes %zu\n", g->parse_live);
    if (g->guard) {
        kv_http_guard_stats gs;
        kv_http_guard_get_stats(g->guard, &gs);
        KV_M("# HELP kvasir_gateway_connections_closed_total Connections the guard closed or refused, by reason.\n");
        KV_M("# TYPE kvasir_gateway_connections_closed_total counter\n");
        KV_M("kvasir_gateway_connections_closed_total{reason=\"deadline\"} %llu\n", (unsigned long long)gs.expired);
        KV_M("kvasir_gateway_connections_closed_total{reason=\"evicted\"} %llu\n", (unsigned long long)gs.evicted);
        KV_M("kvasir_gateway_connections_closed_total{reason=\"per_ip\"} %llu\n", (unsigned long long)gs.refused_ip);
        KV_M("kvasir_gateway_connections_closed_total{reason=\"full\"} %llu\n", (unsigned long long)gs.refused_full);
        KV_M("# HELP kvasir_gateway_connections_open Connections open now.\n");
        KV_M("# TYPE kvasir_gateway_connections_open gauge\n");
        KV_M("kvasir_gateway_connections_open %u\n", gs.open);
    }
    if (g->eng.spec_steps) { /* speculative decoding (--draft) */
        const kv_engine_stats *es = &g->eng;
        KV_M("# HELP kvasir_gateway_spec_verify_steps_total Forward passes that verified drafted tokens, per session.\n");
        KV_M("# TYPE kvasir_gateway_spec_verify_steps_total counter\n");
        KV_M("kvasir_gateway_spec_verify_steps_total %llu\n", (unsigned long long)es->spec_steps);
        KV_M("# HELP kvasir_gateway_spec_drafted_tokens_total Drafted tokens verified.\n");
        KV_M("# TYPE kvasir_gateway_spec_drafted_tokens_total counter\n");
        KV_M("kvasir_gateway_spec_drafted_tokens_total %llu\n", (unsigned long long)es->spec_drafted);
        KV_M("# HELP kvasir_gateway_spec_accepted_tokens_total Drafted tokens equal to the token drawn there.\n");
        KV_M("# TYPE kvasir_gateway_spec_accepted_tokens_total counter\n");
        KV_M("kvasir_gateway_spec_accepted_tokens_total %llu\n", (unsigned long long)es->spec_accepted);
        KV_M("# HELP kvasir_gateway_spec_acceptance Accepted over drafted tokens.\n");
        KV_M("# TYPE kvasir_gateway_spec_acceptance gauge\n");
        KV_M("kvasir_gateway_spec_acceptance %.6f\n",
             es->spec_drafted ? (double)es->spec_accepted / (double)es->spec_drafted : 0.0);
        KV_M("# HELP kvasir_gateway_spec_tokens_per_verify Tokens a verify pass yielded, on average.\n");
        KV_M("# TYPE kvasir_gateway_spec_tokens_per_verify gauge\n");
        KV_M("kvasir_gateway_spec_tokens_per_verify %.6f\n", (double)es->spec_emitted / (double)es->spec_steps);
    }
    if (g->eng.cache_budget || g->eng.cache_lookups) { /* a ring's caches are its nodes': lookups, hits, tokens */
        const kv_engine_stats *es = &g->eng;
        KV_M("# HELP kvasir_gateway_prompt_cache_lookups_total New sessions' prompts looked up in the prompt cache.\n");
        KV_M("# TYPE kvasir_gateway_prompt_cache_lookups_total counter\n");
        KV_M("kvasir_gateway_prompt_cache_lookups_total %llu\n", (unsigned long long)es->cache_lookups);
        KV_M("# HELP kvasir_gateway_prompt_cache_hits_total Lookups that reused a cached prefix.\n");
        KV_M("# TYPE kvasir_gateway_prompt_cache_hits_total counter\n");
        KV_M("kvasir_gateway_prompt_cache_hits_total %llu\n", (unsigned long long)es->cache_hits);
        KV_M("# HELP kvasir_gateway_prompt_cache_tokens_total Prompt tokens taken from the cache, not evaluated.\n");
        KV_M("# TYPE kvasir_gateway_prompt_cache_tokens_total counter\n");
        KV_M("kvasir_gateway_prompt_cache_tokens_total %llu\n", (unsigned long long)es->cache_tokens);
    }
    if (g->eng.cache_budget) {
        const kv_engine_stats *es = &g->eng;
        KV_M("# HELP kvasir_gateway_prompt_cache_evictions_total Cache blocks evicted for room (least recently used).\n");
        KV_M("# TYPE kvasir_gateway_prompt_cache_evictions_total counter\n");
        KV_M("kvasir_gateway_prompt_cache_evictions_total %llu\n", (unsigned long long)es->cache_evictions);
        KV_M("# HELP kvasir_gateway_prompt_cache_bytes Memory the prompt cache holds.\n");
        KV_M("# TYPE kvasir_gateway_prompt_cache_bytes gauge\n");
        KV_M("kvasir_gateway_prompt_cache_bytes %llu\n", (unsigned long long)es->cache_bytes);
        KV_M("# HELP kvasir_gateway_prompt_cache_budget_bytes The prompt cache's memory budget (--prompt-cache).\n");
        KV_M("# TYPE kvasir_gateway_prompt_cache_budget_bytes gauge\n");
        KV_M("kvasir_gateway_prompt_cache_budget_bytes %llu\n", (unsigned long long)es->cache_budget);
        KV_M("# HELP kvasir_gateway_prompt_cache_blocks Blocks (of block_tokens positions) the prompt cache holds.\n");
        KV_M("# TYPE kvasir_gateway_prompt_cache_blocks gauge\n");
        KV_M("kvasir_gateway_prompt_cache_blocks %u\n", es->cache_blocks);
    }
    KV_M("# HELP kvasir_gateway_steps_failed_total Engine steps that failed as a whole.\n");
    KV_M("# TYPE kvasir_gateway_steps_failed_total counter\n");
    KV_M("kvasir_gateway_steps_failed_total %llu\n", (unsigned long long)g->steps_failed);
    if (g->pay) {
        kv_gw_pay_stats ps;
        kv_gw_pay_get_stats(g->pay, &ps);
        KV_M("# HELP kvasir_gateway_kvr_charges_total Paid completions by outcome: held, settled, released, refused (402).\n");
        KV_M("# TYPE kvasir_gateway_kvr_charges_total counter\n");
        KV_M("kvasir_gateway_kvr_charges_total{outcome=\"held\"} %llu\n", (unsigned long long)ps.held);
        KV_M("kvasir_gateway_kvr_charges_total{outcome=\"settled\"} %llu\n", (unsigned long long)ps.settled);
        KV_M("kvasir_gateway_kvr_charges_total{outcome=\"released\"} %llu\n", (unsigned long long)ps.released);
        KV_M("kvasir_gateway_kvr_charges_total{outcome=\"refused\"} %llu\n", (unsigned long long)ps.refused);
        KV_M("# HELP kvasir_gateway_kvr_micro_total micro-KVR settled: cost, of it to nodes and to the treasury.\n");
        KV_M("# TYPE kvasir_gateway_kvr_micro_total counter\n");
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
        KV_M("# HELP kvasir_gateway_ring_nodes_reachable Ring entry nodes that answered the last STATUS.\n");
        KV_M("# TYPE kvasir_gateway_ring_nodes_reachable gauge\n");
        KV_M("kvasir_gateway_ring_nodes_reachable %u\n", up);
        KV_M("# HELP kvasir_gateway_ring_nodes_whole Ring entry nodes that see the ring whole.\n");
        KV_M("# TYPE kvasir_gateway_ring_nodes_whole gauge\n");
        KV_M("kvasir_gateway_ring_nodes_whole %u\n", whole);
    }
    if (g->man) {
        KV_M("# HELP kvasir_gateway_steps_retried_total Failed steps whose sessions were kept for a retry.\n");
        KV_M("# TYPE kvasir_gateway_steps_retried_total counter\n");
        KV_M("kvasir_gateway_steps_retried_total %llu\n", (unsigned long long)g->steps_retried);
        KV_M("# HELP kvasir_gateway_shards_total Shards (expert slabs of MoE layers) the model needs.\n");
        KV_M("# TYPE kvasir_gateway_shards_total gauge\n");
        KV_M("kvasir_gateway_shards_total %u\n", g->cov_total);
        KV_M("# HELP kvasir_gateway_shards_covered Shards whose every expert a worker that is up (or a local slab) serves.\n");
        KV_M("# TYPE kvasir_gateway_shards_covered gauge\n");
        KV_M("kvasir_gateway_shards_covered %u\n", g->cov_covered);
        KV_M("# HELP kvasir_gateway_workers_up Workers handshaken now.\n");
        KV_M("# TYPE kvasir_gateway_workers_up gauge\n");
        KV_M("kvasir_gateway_workers_up %u\n", g->cov_up);
        KV_M("# HELP kvasir_gateway_workers_added_total Workers added from the hub's placement map.\n");
        KV_M("# TYPE kvasir_gateway_workers_added_total counter\n");
        KV_M("kvasir_gateway_workers_added_total %llu\n", (unsigned long long)g->workers_added);
        KV_M("# HELP kvasir_gateway_hedges_total Expert requests also sent to a replica after their worker's hedge time.\n");
        KV_M("# TYPE kvasir_gateway_hedges_total counter\n");
        KV_M("kvasir_gateway_hedges_total %llu\n", (unsigned long long)g->hedges);
        KV_M("# HELP kvasir_gateway_hedges_won_total Hedged requests whose replica answered first.\n");
        KV_M("# TYPE kvasir_gateway_hedges_won_total counter\n");
        KV_M("kvasir_gateway_hedges_won_total %llu\n", (unsigned long long)g->hedges_won);
        KV_M("# HELP kvasir_gateway_hedged_pairs_total (token, expert) slots hedges carried: both replicas computed them.\n");
        KV_M("# TYPE kvasir_gateway_hedged_pairs_total counter\n");
        KV_M("kvasir_gateway_hedged_pairs_total %llu\n", (unsigned long long)g->hedged_pairs);
        KV_M("# HELP kvasir_gateway_late_answers_total Worker answers discarded because a replica had answered first.\n");
        KV_M("# TYPE kvasir_gateway_late_answers_total counter\n");
        KV_M("kvasir_gateway_late_answers_total %llu\n", (unsigned long long)g->late_answers);
        KV_M("# HELP kvasir_gateway_hedges_cancelled_total Superseded requests their worker dropped on a CANCEL, "
             "before computing them.\n");
        KV_M("# TYPE kvasir_gateway_hedges_cancelled_total counter\n");
        KV_M("kvasir_gateway_hedges_cancelled_total %llu\n", (unsigned long long)g->hedges_cancelled);
        const kv_gw_autoscale *a = &g->as;
        KV_M("# HELP kvasir_gateway_expert_pairs_total Expert computations by where they ran: held (a local slab\n"
             "# within --local-experts), local (any local slab, held ones included), remote (a worker).\n");
        KV_M("# TYPE kvasir_gateway_expert_pairs_total counter\n");
        KV_M("kvasir_gateway_expert_pairs_total{where=\"held\"} %llu\n", (unsigned long long)a->pairs_held_local);
        KV_M("kvasir_gateway_expert_pairs_total{where=\"local\"} %llu\n", (unsigned long long)a->pairs_local);
        KV_M("kvasir_gateway_expert_pairs_total{where=\"remote\"} %llu\n", (unsigned long long)a->pairs_remote);
        KV_M("# HELP kvasir_gateway_shard_computations_total Expert computations needed per shard (demand).\n");
        KV_M("# TYPE kvasir_gateway_shard_computations_total counter\n");
        for (size_t i = 0; a->demand && i < a->n_demand; i++)
            KV_M("kvasir_gateway_shard_computations_total{layer=\"%u\",first=\"%u\",last=\"%u\"} %llu\n",
                 g->man->slabs[i].layer, g->man->slabs[i].first, g->man->slabs[i].last,
                 (unsigned long long)a->demand[i].computations);
        KV_M("# HELP kvasir_gateway_shard_wait_seconds_total Time each shard's computations were waited for.\n");
        KV_M("# TYPE kvasir_gateway_shard_wait_seconds_total counter\n");
        for (size_t i = 0; a->demand && i < a->n_demand; i++)
            KV_M("kvasir_gateway_shard_wait_seconds_total{layer=\"%u\",first=\"%u\",last=\"%u\"} %.6f\n",
                 g->man->slabs[i].layer, g->man->slabs[i].first, g->man->slabs[i].last,
                 (double)a->demand[i].wait_us / 1e6);
        if (g->demand) {
            KV_M("# HELP kvasir_gateway_demand_reports_total Demand reports to the hub, by result.\n");
            KV_M("# TYPE kvasir_gateway_demand_reports_total counter\n");
            KV_M("kvasir_gateway_demand_reports_total{result=\"ok\"} %llu\n", (unsigned long long)g->demand_reports);
            KV_M("kvasir_gateway_demand_reports_total{result=\"error\"} %llu\n", (unsigned long long)g->demand_report_errors);
            KV_M("# HELP kvasir_gateway_demand_tokens_accepted_total Tokens the hub counted of the reports (its budget bounds them).\n");
            KV_M("# TYPE kvasir_gateway_demand_tokens_accepted_total counter\n");
            KV_M("kvasir_gateway_demand_tokens_accepted_total %llu\n", (unsigned long long)g->demand_tokens_accepted);
        }
        if (a->on) {
            static const char *const mode[] = {"tight", "mixed", "wide"};
            const int mi = a->level == 0 ? 0 : a->level == KV_GW_AS_LEVELS ? 2 : 1;
            KV_M("# HELP kvasir_gateway_local_mode Local experts: tight (all held computed here), mixed, wide (all to workers).\n");
            KV_M("# TYPE kvasir_gateway_local_mode gauge\n");
            for (int k = 0; k < 3; k++) KV_M("kvasir_gateway_local_mode{mode=\"%s\"} %d\n", mode[k], k == mi);
            KV_M("# HELP kvasir_gateway_local_share Share of the held experts computed here (0..1).\n");
            KV_M("# TYPE kvasir_gateway_local_share gauge\n");
            KV_M("kvasir_gateway_local_share %.4f\n", 1.0 - (double)a->level / KV_GW_AS_LEVELS);
            KV_M("# HELP kvasir_gateway_local_decisions_total Local-share decisions: widen (more to workers), tighten.\n");
            KV_M("# TYPE kvasir_gateway_local_decisions_total counter\n");
            KV_M("kvasir_gateway_local_decisions_total{decision=\"widen\"} %llu\n", (unsigned long long)a->widened);
            KV_M("kvasir_gateway_local_decisions_total{decision=\"tighten\"} %llu\n", (unsigned long long)a->tightened);
            KV_M("# HELP kvasir_gateway_local_unpaid_total Tightenings because the wider share cost more per session.\n");
            KV_M("# TYPE kvasir_gateway_local_unpaid_total counter\n");
            KV_M("kvasir_gateway_local_unpaid_total %llu\n", (unsigned long long)a->unpaid);
            KV_M("# HELP kvasir_gateway_local_probes_total Tightenings to measure the narrower share at this load.\n");
            KV_M("# TYPE kvasir_gateway_local_probes_total counter\n");
            KV_M("kvasir_gateway_local_probes_total %llu\n", (unsigned long long)a->probes);
            KV_M("# HELP kvasir_gateway_local_held_bytes Bytes of slabs held within --local-experts.\n");
            KV_M("# TYPE kvasir_gateway_local_held_bytes gauge\n");
            KV_M("kvasir_gateway_local_held_bytes %llu\n", (unsigned long long)a->held_bytes);
            KV_M("# HELP kvasir_gateway_local_held_slabs Slabs held within --local-experts.\n");
            KV_M("# TYPE kvasir_gateway_local_held_slabs gauge\n");
            KV_M("kvasir_gateway_local_held_slabs %u\n", a->held_slabs);
            KV_M("# HELP kvasir_gateway_step_target_seconds Step time past which the share widens (0: not derived yet).\n");
            KV_M("# TYPE kvasir_gateway_step_target_seconds gauge\n");
            KV_M("kvasir_gateway_step_target_seconds %.6f\n", a->target_s);
            KV_M("# HELP kvasir_gateway_step_average_seconds Moving average of the step time.\n");
            KV_M("# TYPE kvasir_gateway_step_average_seconds gauge\n");
            KV_M("kvasir_gateway_step_average_seconds %.6f\n", a->ewma_s);
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
