/* kvasir bench: prefill and decode speed of a model on this machine.
 * Prefill evaluates -p prompt tokens as one batch; decode then evaluates
 * -n tokens one at a time (greedy picks). A short warm-up first touches the
 * weights so page faults are not timed. Repeated --reps times; the best
 * run is reported (as llama-bench does with its mean; we print both). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/cli.h"
#include "kvasir/dispatch.h"
#include "kvasir/model.h"
#include "kvasir/quant.h"

static const char *const kv_value_flags[] = {"-m", "--model", "-p", "-n", "--threads", "-t", "--reps", "--batch", "--parallel", "--worker", "--wire", "--worker-timeout-ms", NULL};

#define CMD "bench"

static const char *kv_bench_help =
    "usage: kvasir bench -m F.gguf [-p 128] [-n 64] [--threads N] [--reps R] [--json]\n"
    "  -m F          GGUF model file\n"
    "  -p N          prompt tokens evaluated as one batch (default 128)\n"
    "  -n N          tokens decoded one at a time (default 64)\n"
    "  --threads N   worker threads (default: all CPUs)\n"
    "  --batch N     prefill chunk size (default: the prompt length, at most 4096)\n"
    "  --reps R      repetitions, mean and best reported (default 3)\n"
    "  --parallel S  decode S sequences in shared steps (one expert call per layer\n"
    "                carries all S tokens); decode tok/s counts all sequences (default 1)\n"
    "  --worker H:P  with -m DIR/manifest.json: compute experts on this worker (repeat for\n"
    "                more; see kvasir run --help); prints the per-layer round trip\n"
    "  --wire ENC    hidden states to workers as f32 (default), f16 or bf16\n"
    "  --worker-timeout-ms N  per-layer deadline before a worker is dropped (default 10000)\n"
    "  --json        one JSON object: {\"prefill_tok_s\":X,\"decode_tok_s\":Y,...}\n";

static double kv_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int32_t kv_argmax(const float *x, uint32_t n) {
    uint32_t b = 0;
    for (uint32_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return (int32_t)b;
}

int kv_cmd_bench(int argc, char **argv) {
    const char *model = NULL;
    long n_prompt = 128, n_gen = 64, threads = 0, reps = 3, n_batch = 0, n_par = 1;
    bool json = false;
    const char *workers[KV_REMOTE_MAX_WORKERS];
    uint32_t n_workers = 0;
    long worker_timeout = 10000;
    int wire = KV_ENC_F32;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_bench_help, stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = true;
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
        } else if (!strcmp(a, "--worker-timeout-ms")) {
            if (kv_arg_long(CMD, a, v, 1, 3600000, &worker_timeout)) return 1;
        } else if (!strcmp(a, "--batch")) {
            if (kv_arg_long(CMD, a, v, 1, 4096, &n_batch)) return 1;
        } else {
            return kv_cli_err(CMD, 1, "unknown option '%s' (see kvasir bench --help)", a);
        }
    }
    if (!model) return kv_cli_err(CMD, 1, "missing -m MODEL (see kvasir bench --help)");
    int rc = 2;
    kv_diag d = {0};
    kv_model *m = NULL;
    const kv_model *mc = NULL; /* m, or the backbone the remote provider owns */
    kv_remote *remote = NULL;
    kv_remote_stats rs = {0};
    kv_pool *pool = NULL;
    kv_state *st = NULL;
    int32_t *toks = NULL, *step_tok = NULL;
    uint32_t *step_seq = NULL;
    float *logits = NULL;
    if (n_workers) {
        /* coordinator: backbone + manifest here, experts on the workers */
        if (!n_batch) n_batch = n_prompt < 4096 ? n_prompt : 4096;
        if (kv_pool_new(&pool, (int)threads, &d)) return kv_cli_diag(CMD, &d);
        const kv_remote_opts ro = {workers, n_workers, (uint32_t)worker_timeout, 0, (uint32_t)wire,
                                   (uint32_t)(n_batch > n_par ? n_batch : n_par), false, NULL, false};
        if (kv_remote_open(&remote, model, pool, &ro, &d)) { rc = kv_cli_diag(CMD, &d); goto done; }
        mc = kv_remote_model(remote);
    } else {
        if (kv_model_load(&m, model, &d)) return kv_cli_diag(CMD, &d);
        mc = m;
    }
    const kv_hparams *hp = kv_model_hparams(mc);
    if ((uint64_t)n_prompt + (uint64_t)n_gen > hp->n_ctx_train) {
        rc = kv_cli_err(CMD, 1, "-p %ld + -n %ld exceeds the model's context (%u)", n_prompt, n_gen, hp->n_ctx_train);
        goto done;
    }
    if (!n_batch) n_batch = n_prompt < 4096 ? n_prompt : 4096;
    if (!pool && kv_pool_new(&pool, (int)threads, &d)) { rc = kv_cli_diag(CMD, &d); goto done; }
    kv_state_opts so = {.n_ctx = (uint32_t)(n_prompt + n_gen), .n_batch = (uint32_t)n_batch,
                        .n_seq = (uint32_t)n_par, .experts = remote ? kv_remote_provider(remote) : NULL};
    if (kv_state_new(&st, mc, pool, &so, &d)) { rc = kv_cli_diag(CMD, &d); goto done; }
    toks = malloc((size_t)n_prompt * sizeof *toks);
    logits = malloc((size_t)n_par * hp->n_vocab * sizeof *logits);
    step_tok = malloc((size_t)n_par * sizeof *step_tok);
    step_seq = malloc((size_t)n_par * sizeof *step_seq);
    if (!toks || !logits || !step_tok || !step_seq) { rc = kv_cli_err(CMD, 2, "out of memory"); goto done; }
    /* deterministic prompt spread over the vocabulary */
    for (long i = 0; i < n_prompt; i++) toks[i] = (int32_t)((1000003ull * (uint64_t)(i + 1)) % hp->n_vocab);
    /* warm-up: touch every weight page once */
    if (kv_state_eval(st, toks, (uint32_t)(n_prompt < 16 ? n_prompt : 16), logits, &d)) { rc = kv_cli_diag(CMD, &d); goto done; }
    double best_pp = 0, best_tg = 0, sum_pp = 0, sum_tg = 0;
    for (long r = 0; r < reps; r++) {
        kv_state_reset(st);
        double t0 = kv_now();
        /* prefill: sequence 0 is timed; the others get the same prompt, untimed */
        if (kv_state_eval(st, toks, (uint32_t)n_prompt, logits, &d)) { rc = kv_cli_diag(CMD, &d); goto done; }
        double t1 = kv_now();
        for (long q = 1; q < n_par; q++)
            if (kv_state_eval_seq(st, (uint32_t)q, toks, (uint32_t)n_prompt, logits + (size_t)q * hp->n_vocab, &d)) {
                rc = kv_cli_diag(CMD, &d);
                goto done;
            }
        for (long q = 0; q < n_par; q++) step_seq[q] = (uint32_t)q;
        if (remote) kv_remote_reset_stats(remote); /* dispatch figures of the decode phase */
        double t1b = kv_now();
        for (long i = 0; i < n_gen; i++) {
            for (long q = 0; q < n_par; q++) step_tok[q] = kv_argmax(logits + (size_t)q * hp->n_vocab, hp->n_vocab);
            if (kv_state_decode(st, step_tok, step_seq, (uint32_t)n_par, logits, &d)) { rc = kv_cli_diag(CMD, &d); goto done; }
        }
        double t2 = kv_now();
        if (remote) kv_remote_get_stats(remote, &rs); /* kept from the last rep */
        const double pp = (double)n_prompt / (t1 - t0), tg = n_gen ? (double)(n_gen * n_par) / (t2 - t1b) : 0;
        sum_pp += pp;
        sum_tg += tg;
        if (pp > best_pp) best_pp = pp;
        if (tg > best_tg) best_tg = tg;
        if (!json) fprintf(stderr, "kvasir bench: rep %ld: prefill %.2f tok/s, decode %.2f tok/s\n", r + 1, pp, tg);
    }
    const uint64_t bpt = kv_model_bytes_per_token(mc);
    if (json) {
        printf("{\"prefill_tok_s\":%.3f,\"decode_tok_s\":%.3f,\"prefill_tok_s_best\":%.3f,"
               "\"decode_tok_s_best\":%.3f,\"n_prompt\":%ld,\"n_gen\":%ld,\"threads\":%d,\"reps\":%ld,"
               "\"backend\":\"%s\",\"bytes_per_token\":%llu,\"n_layer\":%u,\"n_embd\":%u,\"n_expert\":%u,"
               "\"n_expert_used\":%u,\"parallel\":%ld",
               sum_pp / (double)reps, sum_tg / (double)reps, best_pp, best_tg, n_prompt, n_gen,
               kv_pool_size(pool), reps, kv_quant_backend(), (unsigned long long)bpt, hp->n_layer,
               hp->n_embd, hp->n_expert, hp->n_expert_used, n_par);
        if (remote)
            printf(",\"workers\":%u,\"wire\":\"%s\",\"layer_rtt_p50_us\":%.1f,\"layer_rtt_p99_us\":%.1f,"
                   "\"layer_calls\":%llu,\"retried_pairs\":%llu,\"bytes_per_step\":%.0f",
                   n_workers, kv_enc_name((uint32_t)wire), rs.rtt_p50_us, rs.rtt_p99_us, (unsigned long long)rs.calls,
                   (unsigned long long)rs.retried_pairs,
                   n_gen ? (double)(rs.bytes_sent + rs.bytes_recv) / (double)n_gen : 0.0);
        printf("}\n");
    } else {
        printf("model %s: %u layers, embd %u, %u/%u experts, %d threads, kernels %s\n", model, hp->n_layer,
               hp->n_embd, hp->n_expert_used, hp->n_expert, kv_pool_size(pool), kv_quant_backend());
        printf("prefill (%ld tokens): %.2f tok/s (best %.2f)\n", n_prompt, sum_pp / (double)reps, best_pp);
        printf("decode  (%ld tokens x %ld sequences): %.2f tok/s (best %.2f), %.1f MB of weights per token\n", n_gen, n_par,
               sum_tg / (double)reps, best_tg, (double)bpt / 1e6);
        if (remote)
            printf("dispatch (%u workers, %s): per-layer round trip p50 %.0f us, p99 %.0f us over %llu layer calls "
                   "(%.1f us per token at p50); %.1f kB on the wire per step; %llu pairs retried\n", n_workers,
                   kv_enc_name((uint32_t)wire), rs.rtt_p50_us, rs.rtt_p99_us, (unsigned long long)rs.calls,
                   rs.rtt_p50_us / (double)n_par, n_gen ? (double)(rs.bytes_sent + rs.bytes_recv) / 1e3 / (double)n_gen : 0.0,
                   (unsigned long long)rs.retried_pairs);
    }
    rc = 0;
done:
    free(toks);
    free(step_tok);
    free(step_seq);
    free(logits);
    kv_state_free(st);
    kv_remote_free(remote);
    kv_pool_free(pool);
    kv_model_free(m);
    return rc;
}
