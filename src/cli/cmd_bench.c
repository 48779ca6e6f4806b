/* kvasir bench: prefill and decode speed of a model on this machine.
 * Prefill evaluates -p prompt tokens as one batch; decode then evaluates
 * -n tokens one at a time (greedy picks). A short warm-up first touches the
 * weights so page faults are not timed. Repeated --reps times; the best
 * run is reported (as llama-bench does with its mean; we print both).
 * Everything runs through engine sessions (kvasir/engine.h): prefill steps
 * carry one session's prompt alone (the others paused), decode steps carry
 * every session's token. Memory figures: KV blocks and recurrent state
 * held with every session full, and the process's peak RSS. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>

#include "cli/cli.h"
#include "kvasir/dispatch_proto.h"
#include "kvasir/dispatch_remote.h"
#include "kvasir/engine.h"
#include "kvasir/node.h"
#include "kvasir/quant.h"

static const char *const kv_value_flags[] = {"-m", "--model", "-p", "-n", "--threads", "-t", "--reps", "--batch", "--parallel", "--worker", "--wire", "--worker-timeout-ms", "--kv-type", "--hub", "--data", "--key", "--hub-wait-ms", "--local-share", NULL};

#define CMD "bench"

static const char *kv_bench_help =
    "usage: kvasir bench -m F.gguf [-p 128] [-n 64] [--threads N] [--reps R] [--json]\n"
    "  -m F          GGUF model file, or DIR/manifest.json of a sliced model\n"
    "  -p N          prompt tokens evaluated as one batch (default 128)\n"
    "  -n N          tokens decoded one at a time (default 64)\n"
    "  --threads N   worker threads (default: all CPUs)\n"
    "  --batch N     prefill chunk size (default: the prompt length, at most 4096)\n"
    "  --reps R      repetitions, mean and best reported (default 3)\n"
    "  --kv-type T   KV cache elements: f32 (default) or f16\n"
    "  --parallel S  decode S sequences in shared steps (one expert call per layer\n"
    "                carries all S tokens); decode tok/s counts all sequences (default 1)\n"
    "  --hub URL     instead of -m: fetch the manifest and backbone from a hub into --data DIR\n"
    "                (default kvasir-data; resumable, hash checked) and use its live nodes\n"
    "  --hub-wait-ms N  with --hub: while some expert is served by no worker (nodes trading\n"
    "                shards), read the placement map again for up to N ms (default 30000)\n"
    "  --key FILE    the key proved to workers (default DATA/coordinator.key with --hub, else\n"
    "                ~/.kvasir/coordinator.key; created if absent)\n"
    "  --worker H:P  with -m DIR/manifest.json: compute experts on this worker (repeat for\n"
    "                more; see kvasir run --help); prints the per-layer round trip\n"
    "  --wire ENC    hidden states to workers as f32 (default), f16 or bf16\n"
    "  --local-share S  with workers: hold every slab present in the manifest's folder and compute\n"
    "                the share S (0..1) of their experts here, the rest on the workers, fixed (a\n"
    "                gateway's --local-experts moves it with the load); pairs here and sent out\n"
    "                are reported (docs/GATEWAY.md \"Local experts\")\n"
    "  --worker-timeout-ms N  per-layer deadline before a worker is dropped (default 10000)\n"
    "  --insecure-plaintext  dial workers over plain TCP, without TLS (default: TLS 1.3 pinned to\n"
    "                each worker's key); prints a warning\n"
    "  --skip-hashes with a sliced model: check sizes and identity, not every SHA-256\n"
    "  --allow-sparse with a sliced skeleton (gen-model --skeleton, then slice): run it,\n"
    "                its holes reading as zeros (figures of the real shape, not of real weights)\n"
    "  --profile     per-stage wall time of the timed prefill and decode (embed, norms, attention\n"
    "                projections, attention, delta-net projections and rule, router, experts,\n"
    "                shared expert, LM head), summed over the reps, and each stage's share\n"
    "  --all-rows    also time each rep's prefill with every prompt token through the whole last\n"
    "                block (by default only the token whose logits are wanted runs its attention\n"
    "                output and experts, the others only its K/V: the same logits); what a block\n"
    "                costs per token, for comparisons that should not count that saving\n"
    "  --json        one JSON object: {\"prefill_tok_s\":X,\"decode_tok_s\":Y,...}\n";

static double kv_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Steps until session s reaches status want (or stops); a failed step or
 * session is an error in d. */
static int kv_bench_until(kv_engine *e, kv_session *s, enum kv_session_status want, kv_diag *d) {
    while (kv_session_status(s) != want && kv_session_status(s) != KV_SESSION_DONE) {
        const int rc = kv_engine_step(e, d);
        if (rc < 0) return rc;
        if (kv_session_status(s) == KV_SESSION_FAILED) return kv_session_error(s, d);
        if (rc == 0 && !kv_engine_busy(e)) return kv_fail(d, KV_EINTERNAL, "bench: session stalled");
    }
    return 0;
}

static int kv_bench_cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Peak resident memory of this process (VmHWM), KiB; -1 if unknown. */
static long kv_bench_peak_rss_kb(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long kb = -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "VmHWM:", 6)) kb = strtol(line + 6, NULL, 10);
    fclose(f);
    return kb;
}

int kv_cmd_bench(int argc, char **argv) {
    const char *model = NULL;
    long n_prompt = 128, n_gen = 64, threads = 0, reps = 3, n_batch = 0, n_par = 1;
    bool json = false, skip_hashes = false, allow_sparse = false, profile = false, all_rows = false;
    bool insecure_plaintext = false;
    kv_profile prof[2]; /* [0] prefill, [1] decode */
    memset(prof, 0, sizeof prof);
    const char *workers[KV_REMOTE_MAX_WORKERS];
    uint32_t n_workers = 0;
    const char *hub = NULL, *data_dir = "kvasir-data", *key_path = NULL;
    kv_cli_auth auth = {0};
    char hub_manifest[4200];
    char **hub_workers = NULL;
    uint32_t n_hub_workers = 0;
    long worker_timeout = 10000, hub_wait = 30000;
    double local_share = -1; /* --local-share: < 0 unset */
    int wire = KV_ENC_F32, kv_type = KV_TYPE_F32;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_bench_help, stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = true;
        } else if (!strcmp(a, "--profile")) {
            profile = true;
        } else if (!strcmp(a, "--all-rows")) {
            all_rows = true;
        } else if (!strcmp(a, "--skip-hashes")) {
            skip_hashes = true;
        } else if (!strcmp(a, "--allow-sparse")) {
            allow_sparse = true;
        } else if (!strcmp(a, "--insecure-plaintext")) {
            insecure_plaintext = true;
            kv_link_warn_plaintext("bench");
        } else if (!(v = kv_arg_value(CMD, argc, argv, &i, kv_value_flags))) {
            return 1;
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            model = v;
        } else if (!strcmp(a, "-p")) {
            if (kv_arg_long(CMD, a, v, 1, 1 << 16, &n_prompt)) return 1;
        } else if (!strcmp(a, "-n")) {
            if (kv_arg_long(CMD, a, v, 0, 1 << 16, &n_gen)) return 1;
        } else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) {
            if (kv_arg_long(CMD, a, v, 1, KV_POOL_MAX_THREADS, &threads)) return 1;
        } else if (!strcmp(a, "--reps")) {
            if (kv_arg_long(CMD, a, v, 1, 100, &reps)) return 1;
        } else if (!strcmp(a, "--parallel")) {
            if (kv_arg_long(CMD, a, v, 1, 256, &n_par)) return 1;
        } else if (!strcmp(a, "--worker")) {
            if (n_workers == KV_REMOTE_MAX_WORKERS)
                return kv_cli_err(CMD, 1, "--worker: at most %u workers", KV_REMOTE_MAX_WORKERS);
            workers[n_workers++] = v;
        } else if (!strcmp(a, "--wire")) {
            if ((wire = kv_enc_from_name(v)) < 0)
                return kv_cli_err(CMD, 1, "--wire: '%s' is not one of f32, f16, bf16", v);
        } else if (!strcmp(a, "--hub")) {
            hub = v;
        } else if (!strcmp(a, "--key")) {
            key_path = v;
        } else if (!strcmp(a, "--data")) {
            data_dir = v;
        } else if (!strcmp(a, "--worker-timeout-ms")) {
            if (kv_arg_long(CMD, a, v, 1, 3600000, &worker_timeout)) return 1;
        } else if (!strcmp(a, "--kv-type")) {
            if (!strcmp(v, "f32")) kv_type = KV_TYPE_F32;
            else if (!strcmp(v, "f16")) kv_type = KV_TYPE_F16;
            else return kv_cli_err(CMD, 1, "--kv-type: '%s' is not one of f32, f16", v);
        } else if (!strcmp(a, "--batch")) {
            if (kv_arg_long(CMD, a, v, 1, 4096, &n_batch)) return 1;
        } else if (!strcmp(a, "--hub-wait-ms")) {
            if (kv_arg_long(CMD, a, v, 0, 86400000, &hub_wait)) return 1;
        } else if (!strcmp(a, "--local-share")) {
            char *end = NULL;
            local_share = strtod(v, &end);
            if (!*v || *end || !(local_share >= 0 && local_share <= 1))
                return kv_cli_err(CMD, 1, "--local-share: '%s' is not a number from 0 to 1", v);
        } else {
            return kv_cli_err(CMD, 1, "unknown option '%s' (see kvasir bench --help)", a);
        }
    }
    if (hub && (model || n_workers)) return kv_cli_err(CMD, 1, "--hub replaces -m and --worker: give one or the other");
    if (hub) { /* the coordinator folder from the hub, the workers from its placement map */
        kv_diag hd = {0};
        if (kv_node_fetch_coordinator(hub, data_dir, hub_manifest, sizeof hub_manifest, &hub_workers, &n_hub_workers,
                                      NULL, NULL, &hd))
            return kv_cli_diag(CMD, &hd);
        n_workers = n_hub_workers; /* as many as the map keeps: the list is hub_workers */
        model = hub_manifest;
    }
    if (!model) return kv_cli_err(CMD, 1, "missing -m MODEL or --hub URL (see kvasir bench --help)");
    if (local_share >= 0 && !n_workers)
        return kv_cli_err(CMD, 1, "--local-share needs workers (--worker or --hub): without them every expert is "
                          "computed here");
    if (n_workers && kv_cli_auth_setup(CMD, key_path, hub, data_dir, hub_workers, n_hub_workers, &auth)) {
        kv_node_workers_free(hub_workers, n_hub_workers);
        return 2;
    }
    int rc = 2;
    kv_diag d = {0};
    kv_engine *eng = NULL;
    kv_session **ss = NULL;
    int32_t *toks = NULL;
    double *step_s = NULL; /* [reps * n_gen] wall time of every timed decode step */
    size_t n_steps = 0;
    kv_remote_stats rs = {0};
    if (!n_batch) n_batch = n_prompt < 4096 ? n_prompt : 4096;
    /* the model source (file, slices, slices + workers) is the engine's business */
    const kv_engine_opts eo = {.n_threads = (int)threads, .n_ctx = (uint32_t)(n_prompt + n_gen + 1),
                               .n_batch = (uint32_t)n_batch, .max_sessions = (uint32_t)n_par,
                               .kv_type = (uint32_t)kv_type,
                               .workers = hub ? (const char *const *)hub_workers : workers, .n_workers = n_workers,
                               /* from a hub: open even when some expert has no holder up yet, and
                                  take the holders the map names later (kv_node_await_coverage) */
                               .allow_uncovered = hub != NULL, .max_workers = hub ? UINT32_MAX : 0,
                               .worker_timeout_ms = (uint32_t)worker_timeout, .wire = (uint32_t)wire,
                               .skip_hashes = skip_hashes, .allow_sparse = allow_sparse, .key_sk = auth.key.sk,
                               .voucher = auth.has_voucher ? &auth.voucher : NULL, .worker_keys = auth.worker_keys,
                               .insecure_plaintext = insecure_plaintext};
    if (kv_engine_open(&eng, model, &eo, &d)) {
        kv_node_workers_free(hub_workers, n_hub_workers);
        kv_cli_auth_free(&auth);
        return kv_cli_diag(CMD, &d);
    }
    const kv_model *mc = kv_engine_model(eng);
    kv_remote *remote = kv_engine_remote(eng);
    if (hub && remote && kv_node_await_coverage(hub, remote, auth.has_voucher, (uint32_t)hub_wait, stderr, &d)) {
        rc = kv_cli_diag(CMD, &d);
        goto done;
    }
    uint64_t held_bytes = 0;
    uint32_t held_slabs = 0;
    if (local_share >= 0 && remote) {
        if (kv_remote_local_hold(remote, UINT64_MAX, &held_bytes, &held_slabs, &d)) {
            rc = kv_cli_diag(CMD, &d);
            goto done;
        }
        if (!held_slabs) {
            rc = kv_cli_err(CMD, 1, "--local-share: no slab of %s is in its folder (experts/): nothing to compute here",
                            model);
            goto done;
        }
        kv_remote_set_local_share(remote, local_share);
        if (!json)
            fprintf(stderr, "kvasir bench: %u slabs held here (%.1f MB), local share %.3f\n", held_slabs,
                    (double)held_bytes / 1e6, local_share);
    }
    const kv_hparams *hp = kv_model_hparams(mc);
    if ((uint64_t)n_prompt + (uint64_t)n_gen > hp->n_ctx_train) {
        rc = kv_cli_err(CMD, 1, "-p %ld + -n %ld exceeds the model's context (%u)", n_prompt, n_gen, hp->n_ctx_train);
        goto done;
    }
    toks = malloc((size_t)n_prompt * sizeof *toks);
    ss = calloc((size_t)n_par, sizeof *ss);
    step_s = malloc((size_t)(reps * n_gen > 0 ? reps * n_gen : 1) * sizeof *step_s);
    if (!toks || !ss || !step_s) { rc = kv_cli_err(CMD, 2, "out of memory"); goto done; }
    /* deterministic prompt spread over the vocabulary */
    for (long i = 0; i < n_prompt; i++) toks[i] = (int32_t)((1000003ull * (uint64_t)(i + 1)) % hp->n_vocab);
    /* greedy sessions that never stop early */
    kv_session_opts so = {.sample = kv_sample_defaults(), .max_tokens = (uint32_t)n_gen + 1, .ignore_eog = true};
    so.sample.temp = 0;
    so.sample.repeat_penalty = 1.0f;
    /* warm-up: every weight page faulted in once when the weights fit in
     * half the RAM (a skeleton of a model larger than memory keeps only what
     * its tokens touch), then a short prompt and one decoded token */
    const long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    if (pages > 0 && psz > 0 && kv_model_weight_bytes(mc) < (uint64_t)pages * (uint64_t)psz / 2)
        (void)kv_model_fault_in(mc);
    if (kv_session_new(&ss[0], eng, &so, &d) ||
        kv_session_prompt(ss[0], toks, (uint32_t)(n_prompt < 16 ? n_prompt : 16), &d) ||
        kv_bench_until(eng, ss[0], KV_SESSION_DECODE, &d)) { rc = kv_cli_diag(CMD, &d); goto done; }
    for (int i = 0; i < 3 && kv_session_status(ss[0]) == KV_SESSION_DECODE; i++) /* and a few decode steps */
        if (kv_engine_step(eng, &d) < 0) { rc = kv_cli_diag(CMD, &d); goto done; }
    kv_session_free(ss[0]);
    ss[0] = NULL;
    double best_pp = 0, best_tg = 0, sum_pp = 0, sum_tg = 0, prof_wall[2] = {0, 0}, best_ar = 0, sum_ar = 0;
    kv_engine_stats es = {0};
    for (long r = 0; r < reps; r++) {
        for (long q = 0; q < n_par; q++) {
            if (kv_session_new(&ss[q], eng, &so, &d) || kv_session_prompt(ss[q], toks, (uint32_t)n_prompt, &d)) {
                rc = kv_cli_diag(CMD, &d);
                goto done;
            }
            kv_session_pause(ss[q], q > 0);
        }
        /* prefill: session 0 alone is timed; the others get the same prompt, untimed */
        if (profile) kv_engine_set_profile(eng, &prof[0]);
        double t0 = kv_now();
        if (kv_bench_until(eng, ss[0], KV_SESSION_DECODE, &d)) { rc = kv_cli_diag(CMD, &d); goto done; }
        double t1 = kv_now();
        kv_engine_set_profile(eng, NULL);
        kv_session_pause(ss[0], true);
        for (long q = 1; q < n_par; q++) {
            kv_session_pause(ss[q], false);
            if (kv_bench_until(eng, ss[q], KV_SESSION_DECODE, &d)) { rc = kv_cli_diag(CMD, &d); goto done; }
            kv_session_pause(ss[q], true);
        }
        for (long q = 0; q < n_par; q++) kv_session_pause(ss[q], false);
        if (remote) kv_remote_reset_stats(remote); /* dispatch figures of the decode phase */
        /* decode: every session feeds one token per step, all in one forward pass */
        if (profile) kv_engine_set_profile(eng, &prof[1]);
        double t1b = kv_now();
        for (long i = 0; i < n_gen; i++) {
            const double ts = kv_now();
            int k = kv_engine_step(eng, &d);
            if (k < 0) { rc = kv_cli_diag(CMD, &d); goto done; }
            step_s[n_steps++] = kv_now() - ts;
            for (long q = 0; q < n_par; q++)
                if (kv_session_status(ss[q]) == KV_SESSION_FAILED) {
                    kv_session_error(ss[q], &d);
                    rc = kv_cli_diag(CMD, &d);
                    goto done;
                }
        }
        double t2 = kv_now();
        kv_engine_set_profile(eng, NULL);
        if (profile) {
            prof_wall[0] += t1 - t0;
            prof_wall[1] += t2 - t1b;
        }
        if (remote) kv_remote_get_stats(remote, &rs); /* kept from the last rep */
        kv_engine_get_stats(eng, &es);                 /* memory with every session full */
        for (long q = 0; q < n_par; q++) {
            kv_session_free(ss[q]);
            ss[q] = NULL;
        }
        const double pp = (double)n_prompt / (t1 - t0), tg = n_gen ? (double)(n_gen * n_par) / (t2 - t1b) : 0;
        sum_pp += pp;
        sum_tg += tg;
        if (pp > best_pp) best_pp = pp;
        if (tg > best_tg) best_tg = tg;
        if (!json) fprintf(stderr, "kvasir bench: rep %ld: prefill %.2f tok/s, decode %.2f tok/s\n", r + 1, pp, tg);
        if (all_rows) { /* the same prompt with every row through the last block, in a session of its own,
                         * after the timed rep (which runs as it would without --all-rows) */
            kv_engine_set_all_rows(eng, true);
            const double ta = kv_now();
            if (kv_session_new(&ss[0], eng, &so, &d) || kv_session_prompt(ss[0], toks, (uint32_t)n_prompt, &d) ||
                kv_bench_until(eng, ss[0], KV_SESSION_DECODE, &d)) {
                rc = kv_cli_diag(CMD, &d);
                goto done;
            }
            const double ar = (double)n_prompt / (kv_now() - ta);
            kv_engine_set_all_rows(eng, false);
            kv_session_free(ss[0]);
            ss[0] = NULL;
            sum_ar += ar;
            if (ar > best_ar) best_ar = ar;
            if (!json) fprintf(stderr, "kvasir bench: rep %ld: prefill with every row %.2f tok/s\n", r + 1, ar);
        }
    }
    const uint64_t bpt = kv_model_bytes_per_token(mc);
    const long rss_kb = kv_bench_peak_rss_kb();
    /* decode step time percentiles over every rep (a stalled worker shows in the tail) */
    double step_p50 = 0, step_p99 = 0, step_max = 0;
    if (n_steps) {
        qsort(step_s, n_steps, sizeof *step_s, kv_bench_cmp_double);
        step_p50 = step_s[(n_steps - 1) / 2] * 1e3;
        step_p99 = step_s[(size_t)((double)(n_steps - 1) * 0.99)] * 1e3;
        step_max = step_s[n_steps - 1] * 1e3;
    }
    if (json) {
        printf("{\"prefill_tok_s\":%.3f,\"decode_tok_s\":%.3f,\"prefill_tok_s_best\":%.3f,"
               "\"decode_tok_s_best\":%.3f,\"n_prompt\":%ld,\"n_gen\":%ld,\"threads\":%d,\"reps\":%ld,"
               "\"backend\":\"%s\",\"bytes_per_token\":%llu,\"n_layer\":%u,\"n_embd\":%u,\"n_expert\":%u,"
               "\"n_expert_used\":%u,\"parallel\":%ld",
               sum_pp / (double)reps, sum_tg / (double)reps, best_pp, best_tg, n_prompt, n_gen,
               kv_engine_n_threads(eng), reps, kv_quant_backend(), (unsigned long long)bpt, hp->n_layer,
               hp->n_embd, hp->n_expert, hp->n_expert_used, n_par);
        printf(",\"decode_step_p50_ms\":%.3f,\"decode_step_p99_ms\":%.3f,\"decode_step_max_ms\":%.3f", step_p50,
               step_p99, step_max);
        if (all_rows)
            printf(",\"prefill_all_rows_tok_s\":%.3f,\"prefill_all_rows_tok_s_best\":%.3f", sum_ar / (double)reps, best_ar);
        printf(",\"kv_type\":\"%s\",\"kv_bytes\":%llu,\"kv_blocks_held\":%u,\"recurrent_bytes\":%llu,\"peak_rss_kb\":%ld",
               kv_type == KV_TYPE_F16 ? "f16" : "f32", (unsigned long long)es.mem.kv_bytes, es.mem.blocks_held,
               (unsigned long long)es.mem.recurrent_bytes, rss_kb);
        if (remote)
            printf(",\"workers\":%u,\"wire\":\"%s\",\"layer_rtt_p50_us\":%.1f,\"layer_rtt_p99_us\":%.1f,"
                   "\"layer_calls\":%llu,\"retried_pairs\":%llu,\"bytes_per_step\":%.0f,\"rounds_per_step\":%.2f,"
                   "\"bytes_sent_per_round\":%.1f,\"bytes_recv_per_round\":%.1f",
                   n_workers, kv_enc_name((uint32_t)wire), rs.rtt_p50_us, rs.rtt_p99_us, (unsigned long long)rs.calls,
                   (unsigned long long)rs.retried_pairs,
                   n_gen ? (double)(rs.bytes_sent + rs.bytes_recv) / (double)n_gen : 0.0,
                   n_gen ? (double)rs.rounds / (double)n_gen : 0.0,
                   rs.rounds ? (double)rs.bytes_sent / (double)rs.rounds : 0.0,
                   rs.rounds ? (double)rs.bytes_recv / (double)rs.rounds : 0.0);
        if (remote)
            printf(",\"hedges\":%llu,\"hedges_won\":%llu,\"late_answers\":%llu,\"hedges_cancelled\":%llu"
                   ",\"sigs_checked\":%llu,\"sigs_deferred\":%llu",
                   (unsigned long long)rs.hedges, (unsigned long long)rs.hedges_won,
                   (unsigned long long)rs.late_answers, (unsigned long long)rs.hedges_cancelled,
                   (unsigned long long)rs.sigs_checked, (unsigned long long)rs.sigs_deferred);
        if (remote)
            printf(",\"pairs_remote\":%llu,\"pairs_local\":%llu,\"pairs_held_local\":%llu",
                   (unsigned long long)rs.pairs_remote, (unsigned long long)rs.pairs_local,
                   (unsigned long long)rs.pairs_held_local);
        if (local_share >= 0 && remote)
            printf(",\"local_share\":%.4f,\"held_slabs\":%u,\"held_bytes\":%llu", local_share, held_slabs,
                   (unsigned long long)held_bytes);
        if (profile) {
            static const char *const phase[2] = {"prefill", "decode"};
            printf(",\"profile\":{");
            for (int ph = 0; ph < 2; ph++) {
                printf("%s\"%s\":{\"wall_ms\":%.3f,\"forward_calls\":%llu,\"tokens\":%llu,\"stages_ms\":{", ph ? "," : "",
                       phase[ph], prof_wall[ph] * 1e3, (unsigned long long)prof[ph].chunks,
                       (unsigned long long)prof[ph].tokens);
                for (int st = 0; st < KV_PROF_COUNT; st++)
                    printf("%s\"%s\":%.3f", st ? "," : "", kv_profile_stage_name(st), (double)prof[ph].ns[st] / 1e6);
                printf("}}");
            }
            printf("}");
        }
        printf("}\n");
    } else {
        printf("model %s: %u layers, embd %u, %u/%u experts, %d threads, kernels %s\n", model, hp->n_layer,
               hp->n_embd, hp->n_expert_used, hp->n_expert, kv_engine_n_threads(eng), kv_quant_backend());
        printf("prefill (%ld tokens): %.2f tok/s (best %.2f)\n", n_prompt, sum_pp / (double)reps, best_pp);
        if (all_rows)
            printf("prefill, every row through the last block: %.2f tok/s (best %.2f)\n", sum_ar / (double)reps, best_ar);
        printf("decode  (%ld tokens x %ld sequences): %.2f tok/s (best %.2f), %.1f MB of weights per token\n", n_gen, n_par,
               sum_tg / (double)reps, best_tg, (double)bpt / 1e6);
        printf("decode step: p50 %.2f ms, p99 %.2f ms, max %.2f ms over %zu steps\n", step_p50, step_p99, step_max, n_steps);
        printf("memory: KV cache %.2f MiB (%s, %u blocks held), recurrent state %.2f MiB, peak RSS %.1f MiB\n",
               (double)es.mem.kv_bytes / 1048576.0, kv_type == KV_TYPE_F16 ? "f16" : "f32", es.mem.blocks_held,
               (double)es.mem.recurrent_bytes / 1048576.0, (double)rss_kb / 1024.0);
        if (remote)
            printf("dispatch (%u workers, %s): per-layer round trip p50 %.0f us, p99 %.0f us over %llu layer calls "
                   "(%.1f us per token at p50); %.2f request rounds and %.1f kB on the wire per step; %llu pairs retried\n", n_workers,
                   kv_enc_name((uint32_t)wire), rs.rtt_p50_us, rs.rtt_p99_us, (unsigned long long)rs.calls,
                   rs.rtt_p50_us / (double)n_par, n_gen ? (double)rs.rounds / (double)n_gen : 0.0,
                   n_gen ? (double)(rs.bytes_sent + rs.bytes_recv) / 1e3 / (double)n_gen : 0.0,
                   (unsigned long long)rs.retried_pairs);
        if (remote)
            printf("hedged requests: %llu sent, %llu won by the replica; %llu late answers discarded, %llu "
                   "cancelled\n"
                   "answer signatures: %llu checked on arrival, %llu taken unchecked over TLS (sampled)\n",
                   (unsigned long long)rs.hedges, (unsigned long long)rs.hedges_won,
                   (unsigned long long)rs.late_answers, (unsigned long long)rs.hedges_cancelled,
                   (unsigned long long)rs.sigs_checked, (unsigned long long)rs.sigs_deferred);
    }
    if (profile && !json) {
        static const char *const phase[2] = {"prefill", "decode"};
        printf("profile (wall time summed over %ld reps; the rest of each phase is scheduling and sampling):\n", reps);
        printf("  %-14s %12s %7s %12s %7s\n", "stage", "prefill ms", "share", "decode ms", "share");
        uint64_t tot[2] = {0, 0};
        for (int ph = 0; ph < 2; ph++)
            for (int st = 0; st < KV_PROF_COUNT; st++) tot[ph] += prof[ph].ns[st];
        for (int st = 0; st < KV_PROF_COUNT; st++) {
            if (!prof[0].ns[st] && !prof[1].ns[st]) continue;
            printf("  %-14s", kv_profile_stage_name(st));
            for (int ph = 0; ph < 2; ph++)
                printf(" %12.2f %6.1f%%", (double)prof[ph].ns[st] / 1e6,
                       prof_wall[ph] > 0 ? 100.0 * (double)prof[ph].ns[st] / 1e9 / prof_wall[ph] : 0.0);
            printf("\n");
        }
        for (int ph = 0; ph < 2; ph++)
            printf("  %s: stages %.2f ms of %.2f ms wall (%llu forward calls, %llu tokens)\n", phase[ph],
                   (double)tot[ph] / 1e6, prof_wall[ph] * 1e3, (unsigned long long)prof[ph].chunks,
                   (unsigned long long)prof[ph].tokens);
    }
    rc = 0;
done:
    if (ss)
        for (long q = 0; q < n_par; q++) kv_session_free(ss[q]);
    free(ss);
    free(toks);
    free(step_s);
    kv_engine_free(eng);
    kv_node_workers_free(hub_workers, n_hub_workers);
    kv_cli_auth_free(&auth);
    return rc;
}
