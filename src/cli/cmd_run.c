/* kvasir run: generate text from a prompt, streaming it as it comes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/cli.h"
#include "kvasir/dispatch.h"
#include "kvasir/model.h"
#include "kvasir/sample.h"
#include "kvasir/slice.h"
#include <sys/stat.h>

static const char *const kv_value_flags[] = {"-m", "--model", "-p", "--prompt", "-f", "--file", "--logits-out", "-n", "--n-predict", "--threads", "-t", "--ctx", "-c", "--batch", "-b", "--temp", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--seed", "--expert-cache-mb", "--worker", "--worker-timeout-ms", "--wire", NULL};

#define CMD "run"

static const char *kv_run_help =
    "usage: kvasir run -m F.gguf -p TEXT [options]\n"
    "  -m, --model F        GGUF model file, or DIR/manifest.json (or DIR) of a sliced model\n"
    "                       (kvasir slice): the backbone stays resident, experts come from the slabs\n"
    "  --expert-cache-mb N  sliced model: keep experts in a cache of N MiB filled from the slab\n"
    "                       files on demand (LRU); default: map the slabs\n"
    "  --skip-hashes        sliced model: check sizes, headers and model identity but do not\n"
    "                       hash every piece at start (default: verify every SHA-256)\n"
    "  --allow-sparse       sliced model: run a sliced skeleton (pieces without hashes: sizes,\n"
    "                       headers and identity are checked); refused without this flag\n"
    "  --worker HOST:PORT   sliced model: compute experts on this worker (kvasir worker); repeat\n"
    "                       for more. Only the backbone need be present; slabs that are present\n"
    "                       serve the experts no worker holds, and every expert must be served\n"
    "  --worker-timeout-ms N  a worker that has not answered a layer within N ms is dropped and\n"
    "                       its experts retried elsewhere (default 10000)\n"
    "  --wire ENC           hidden states to workers as f32 (exact, default), f16 or bf16\n"
    "  --verbose            log worker connects/drops and print dispatch statistics\n"
    "  -p, --prompt TEXT    prompt (special tokens like <|im_start|> are parsed)\n"
    "  -f, --file F         read the prompt from a file instead\n"
    "  -n N                 tokens to generate (default 64; stops early at end-of-generation)\n"
    "  --temp T             temperature, 0 = greedy (default 0.8)\n"
    "  --top-k K            keep the K most likely tokens, 0 = off (default 40)\n"
    "  --top-p P            nucleus sampling, 1 = off (default 0.95)\n"
    "  --min-p P            drop tokens below P x the best one's probability (default 0.05)\n"
    "  --repeat-penalty R   penalize tokens of the last 64 (default 1.0 = off)\n"
    "  --seed S             random seed (default: from the clock)\n"
    "  --threads N          worker threads (default: all CPUs)\n"
    "  --ctx N              context length (default: prompt + N, at most the model's)\n"
    "  --batch N            prompt tokens per forward chunk (default 256)\n"
    "  --chat               wrap the prompt in the ChatML chat template\n"
    "  --json               print one JSON object instead of streaming text\n"
    "  --logits-out F       write the logits used for each generated token (f32 LE, n_vocab each)\n";

static double kv_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void kv_json_str(FILE *f, const char *s, size_t n) {
    fputc('"', f);
    for (size_t i = 0; i < n; i++) {
        const unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c == '\n') fputs("\\n", f);
        else if (c == '\r') fputs("\\r", f);
        else if (c == '\t') fputs("\\t", f);
        else if (c < 0x20 || c == 0x7f) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

/* Appends the valid-UTF-8 rendition of text (invalid bytes as U+FFFD) for
 * JSON output. */
static size_t kv_utf8_clean(const char *in, size_t n, char *out) {
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        const unsigned char c = (unsigned char)in[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        bool ok = len > 0 && i + len <= n;
        for (size_t k = 1; ok && k < len; k++) ok = ((unsigned char)in[i + k] >> 6) == 2;
        if (ok && len == 2 && c < 0xc2) ok = false;
        if (ok) {
            memcpy(out + o, in + i, len);
            o += len;
            i += len;
        } else {
            memcpy(out + o, "\xef\xbf\xbd", 3);
            o += 3;
            i += 1;
        }
    }
    return o;
}

/* "dispatch":{...} for --json: per-layer round trip and each worker's work. */
static void kv_run_dispatch_json(const kv_remote *r) {
    kv_remote_stats st;
    kv_remote_get_stats(r, &st);
    printf(",\"dispatch\":{\"calls\":%llu,\"rounds\":%llu,\"retried_pairs\":%llu,\"pairs_remote\":%llu,"
           "\"pairs_local\":%llu,\"bytes_sent\":%llu,\"bytes_recv\":%llu,\"rtt_p50_us\":%.1f,\"rtt_p99_us\":%.1f,"
           "\"workers\":[", (unsigned long long)st.calls, (unsigned long long)st.rounds,
           (unsigned long long)st.retried_pairs, (unsigned long long)st.pairs_remote,
           (unsigned long long)st.pairs_local, (unsigned long long)st.bytes_sent, (unsigned long long)st.bytes_recv,
           st.rtt_p50_us, st.rtt_p99_us);
    for (uint32_t i = 0; i < kv_remote_n_workers(r); i++) {
        kv_remote_worker w;
        kv_remote_worker_info(r, i, &w);
        printf("%s{\"addr\":", i ? "," : "");
        kv_json_str(stdout, w.addr, strlen(w.addr));
        printf(",\"up\":%s,\"wire\":\"%s\",\"requests\":%llu,\"pairs\":%llu,\"pairs_since_connect\":%llu,"
               "\"drops\":%llu,\"connects\":%llu,\"last_error\":", w.up ? "true" : "false", kv_enc_name(w.enc),
               (unsigned long long)w.requests, (unsigned long long)w.pairs, (unsigned long long)w.pairs_since_connect,
               (unsigned long long)w.drops, (unsigned long long)w.connects);
        kv_json_str(stdout, w.last_error, strlen(w.last_error));
        printf("}");
    }
    printf("]}");
}

/* --verbose: the same on stderr, one line per worker. */
static void kv_run_dispatch_log(const kv_remote *r) {
    kv_remote_stats st;
    kv_remote_get_stats(r, &st);
    fprintf(stderr, "kvasir run: dispatch: %llu layer calls, per-layer round trip p50 %.0f us, p99 %.0f us; "
            "%llu expert computations remote, %llu local, %llu retried; %.2f MB sent, %.2f MB received\n",
            (unsigned long long)st.calls, st.rtt_p50_us, st.rtt_p99_us, (unsigned long long)st.pairs_remote,
            (unsigned long long)st.pairs_local, (unsigned long long)st.retried_pairs, (double)st.bytes_sent / 1e6,
            (double)st.bytes_recv / 1e6);
    for (uint32_t i = 0; i < kv_remote_n_workers(r); i++) {
        kv_remote_worker w;
        kv_remote_worker_info(r, i, &w);
        fprintf(stderr, "kvasir run: worker %s: %s, %llu expert computations (%llu since its last connect), "
                "%llu requests, %llu drops, %llu connects%s%s\n", w.addr, w.up ? "up" : "down",
                (unsigned long long)w.pairs, (unsigned long long)w.pairs_since_connect,
                (unsigned long long)w.requests, (unsigned long long)w.drops, (unsigned long long)w.connects,
                w.last_error[0] ? "; last error: " : "", w.last_error);
    }
}

int kv_cmd_run(int argc, char **argv) {
    const char *model = NULL, *prompt = NULL, *pfile = NULL, *logits_path = NULL;
    long n_predict = 64, threads = 0, n_ctx = 0, n_batch = 256, cache_mb = -1;
    bool chat = false, json = false, seed_set = false, verbose = false, skip_hashes = false, allow_sparse = false;
    const char *workers[KV_REMOTE_MAX_WORKERS];
    uint32_t n_workers = 0;
    long worker_timeout = 10000;
    int wire = KV_ENC_F32;
    kv_sample_params sp = kv_sample_defaults();
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        long lv;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(kv_run_help, stdout);
            return 0;
        } else if (!strcmp(a, "--chat")) {
            chat = true;
        } else if (!strcmp(a, "--json")) {
            json = true;
        } else if (!strcmp(a, "--skip-hashes")) {
            skip_hashes = true;
        } else if (!strcmp(a, "--allow-sparse")) { /* run a sliced skeleton (pieces without hashes) */
            allow_sparse = true;
        } else if (!strcmp(a, "--verbose")) {
            verbose = true;
        } else if (!(v = kv_arg_value(CMD, argc, argv, &i, kv_value_flags))) {
            return 1;
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            model = v;
        } else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) {
            prompt = v;
        } else if (!strcmp(a, "-f") || !strcmp(a, "--file")) {
            pfile = v;
        } else if (!strcmp(a, "--logits-out")) {
            logits_path = v;
        } else if (!strcmp(a, "-n") || !strcmp(a, "--n-predict")) {
            if (kv_arg_long(CMD, a, v, 0, 1 << 20, &n_predict)) return 1;
        } else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) {
            if (kv_arg_long(CMD, a, v, 1, KV_POOL_MAX_THREADS, &threads)) return 1;
        } else if (!strcmp(a, "--ctx") || !strcmp(a, "-c")) {
            if (kv_arg_long(CMD, a, v, 1, KV_MAX_CTX, &n_ctx)) return 1;
        } else if (!strcmp(a, "--batch") || !strcmp(a, "-b")) {
            if (kv_arg_long(CMD, a, v, 1, 4096, &n_batch)) return 1;
        } else if (!strcmp(a, "--temp")) {
            if (kv_arg_float(CMD, a, v, 0, 100, &sp.temp)) return 1;
        } else if (!strcmp(a, "--top-k")) {
            if (kv_arg_long(CMD, a, v, 0, 1 << 22, &lv)) return 1;
            sp.top_k = (int32_t)lv;
        } else if (!strcmp(a, "--top-p")) {
            if (kv_arg_float(CMD, a, v, 1e-6, 1, &sp.top_p)) return 1;
        } else if (!strcmp(a, "--min-p")) {
            if (kv_arg_float(CMD, a, v, 0, 1, &sp.min_p)) return 1;
        } else if (!strcmp(a, "--repeat-penalty")) {
            if (kv_arg_float(CMD, a, v, 1e-3, 100, &sp.repeat_penalty)) return 1;
        } else if (!strcmp(a, "--expert-cache-mb")) {
            if (kv_arg_long(CMD, a, v, 1, 1l << 30, &cache_mb)) return 1;
        } else if (!strcmp(a, "--worker")) {
            if (n_workers == KV_REMOTE_MAX_WORKERS)
                return kv_cli_err(CMD, 1, "--worker: at most %u workers", KV_REMOTE_MAX_WORKERS);
            workers[n_workers++] = v;
        } else if (!strcmp(a, "--worker-timeout-ms")) {
            if (kv_arg_long(CMD, a, v, 1, 3600000, &worker_timeout)) return 1;
        } else if (!strcmp(a, "--wire")) {
            if ((wire = kv_enc_from_name(v)) < 0)
                return kv_cli_err(CMD, 1, "--wire: '%s' is not one of f32, f16, bf16", v);
        } else if (!strcmp(a, "--seed")) {
            if (kv_arg_u64(CMD, a, v, &sp.seed)) return 1;
            seed_set = true;
        } else {
            return kv_cli_err(CMD, 1, "unknown option '%s' (see kvasir run --help)", a);
        }
    }
    if (!model) return kv_cli_err(CMD, 1, "missing -m MODEL (see kvasir run --help)");
    if (!prompt && !pfile) return kv_cli_err(CMD, 1, "missing -p PROMPT or -f FILE");
    if (prompt && pfile) return kv_cli_err(CMD, 1, "give either -p or -f, not both");
    if (!seed_set) sp.seed = (uint64_t)time(NULL) ^ ((uint64_t)clock() << 32);

    int rc = 2;
    kv_diag d = {0};
    kv_model *m = NULL;
    const kv_model *mc = NULL; /* the model in use: m, or the backbone the remote provider owns */
    kv_remote *remote = NULL;
    kv_slices *slices = NULL;
    kv_expert_provider prov = {0};
    char *manifest = NULL;
    kv_pool *pool = NULL;
    kv_state *st = NULL;
    kv_sampler *smp = NULL;
    char *ptext = NULL, *chat_text = NULL, *out_text = NULL, *clean = NULL;
    int32_t *ids = NULL;
    float *logits = NULL;
    FILE *lf = NULL;
    size_t n_ids = 0, out_len = 0, out_cap = 0;

    if (pfile) {
        FILE *f = fopen(pfile, "rb");
        if (!f) { kv_cli_err(CMD, 2, "cannot open prompt file '%s'", pfile); goto done; }
        fseek(f, 0, SEEK_END);
        long sz = ftell(f);
        fseek(f, 0, SEEK_SET);
        if (sz < 0 || sz > (64l << 20)) { fclose(f); kv_cli_err(CMD, 2, "prompt file '%s' is too large (max 64 MiB)", pfile); goto done; }
        ptext = malloc((size_t)sz + 1);
        if (!ptext || fread(ptext, 1, (size_t)sz, f) != (size_t)sz) { fclose(f); kv_cli_err(CMD, 2, "cannot read '%s'", pfile); goto done; }
        ptext[sz] = 0;
        fclose(f);
        prompt = ptext;
    }
    {   /* a sliced model: DIR/manifest.json, or DIR */
        struct stat mst;
        const size_t ml = strlen(model);
        if (!stat(model, &mst) && S_ISDIR(mst.st_mode)) {
            if (!(manifest = malloc(ml + 16))) { rc = kv_cli_err(CMD, 2, "out of memory"); goto done; }
            snprintf(manifest, ml + 16, "%s/manifest.json", model);
        } else if (ml >= 5 && !strcmp(model + ml - 5, ".json")) {
            manifest = strdup(model);
        }
    }
    if (!manifest && (cache_mb > 0 || skip_hashes)) { rc = kv_cli_err(CMD, 1, "--expert-cache-mb and --skip-hashes need a sliced model (-m DIR/manifest.json)"); goto done; }
    if (!n_workers && (wire != KV_ENC_F32 || worker_timeout != 10000)) { rc = kv_cli_err(CMD, 1, "--wire and --worker-timeout-ms need --worker"); goto done; }
    if (!manifest && n_workers) { rc = kv_cli_err(CMD, 1, "--worker needs a sliced model (-m DIR/manifest.json)"); goto done; }
    if (n_workers && cache_mb > 0) { rc = kv_cli_err(CMD, 1, "--expert-cache-mb and --worker cannot be combined"); goto done; }
    if (n_workers) {
        /* the coordinator: backbone + manifest here, experts on the workers */
        if ((rc = kv_pool_new(&pool, (int)threads, &d))) { rc = kv_cli_diag(CMD, &d); goto done; }
        const kv_remote_opts ro = {workers, n_workers, (uint32_t)worker_timeout, 0, (uint32_t)wire, (uint32_t)n_batch,
                                   false, verbose ? stderr : NULL, allow_sparse};
        if ((rc = kv_remote_open(&remote, manifest, pool, &ro, &d))) { rc = kv_cli_diag(CMD, &d); goto done; }
        mc = kv_remote_model(remote);
    } else if (manifest) {
        const kv_slices_opts so = {cache_mb > 0 ? (uint64_t)cache_mb << 20 : 0, skip_hashes, (int)threads, allow_sparse};
        if ((rc = kv_slices_open(&slices, manifest, &so, &d))) { rc = kv_cli_diag(CMD, &d); goto done; }
        if ((rc = kv_model_load_ex(&m, kv_slices_backbone_path(slices), &(kv_model_opts){.no_experts = true}, &d)) ||
            (rc = kv_slices_check_model(slices, m, &d))) { rc = kv_cli_diag(CMD, &d); goto done; }
    } else if ((rc = kv_model_load(&m, model, &d))) { rc = kv_cli_diag(CMD, &d); goto done; }
    if (!mc) mc = m;
    const kv_hparams *hp = kv_model_hparams(mc);
    const kv_tok *tok = kv_model_tok(mc);
    if (chat) {
        chat_text = kv_tok_chatml(NULL, prompt);
        if (!chat_text) { rc = kv_cli_err(CMD, 2, "out of memory"); goto done; }
        prompt = chat_text;
    }
    const size_t plen = strlen(prompt);
    size_t cap = 3 * plen + 2; /* invalid bytes become U+FFFD (3 bytes) before BPE */
    ids = malloc(cap * sizeof *ids);
    if (!ids) { rc = kv_cli_err(CMD, 2, "out of memory"); goto done; }
    size_t off = 0;
    if (kv_tok_add_bos(tok) && kv_tok_bos(tok) >= 0) ids[off++] = kv_tok_bos(tok);
    if ((rc = kv_tok_encode(tok, prompt, plen, true, ids + off, cap - off, &n_ids, &d))) { rc = kv_cli_diag(CMD, &d); goto done; }
    n_ids += off;
    if (n_ids == 0) { rc = kv_cli_err(CMD, 1, "the prompt is empty"); goto done; }
    if (n_ids > hp->n_ctx_train || (n_ctx && n_ids > (size_t)n_ctx)) {
        rc = kv_cli_err(CMD, 2, "prompt has %zu tokens, longer than the context (%ld)", n_ids,
                        n_ctx ? n_ctx : (long)hp->n_ctx_train);
        goto done;
    }
    if (!n_ctx) {
        uint64_t want = (uint64_t)n_ids + (uint64_t)n_predict;
        n_ctx = (long)(want < hp->n_ctx_train ? want : hp->n_ctx_train);
    }
    if (!pool && (rc = kv_pool_new(&pool, (int)threads, &d))) { rc = kv_cli_diag(CMD, &d); goto done; }
    if (slices && (rc = kv_slices_provider_new(&prov, slices, pool, (uint32_t)n_batch, &d))) { rc = kv_cli_diag(CMD, &d); goto done; }
    kv_state_opts so = {.n_ctx = (uint32_t)n_ctx, .n_batch = (uint32_t)n_batch, .experts = remote ? kv_remote_provider(remote) : slices ? &prov : NULL};
    if ((rc = kv_state_new(&st, mc, pool, &so, &d))) { rc = kv_cli_diag(CMD, &d); goto done; }
    if ((rc = kv_sampler_new(&smp, (int32_t)hp->n_vocab, &sp, &d))) { rc = kv_cli_diag(CMD, &d); goto done; }
    logits = malloc((size_t)hp->n_vocab * sizeof(float));
    out_cap = 4096;
    out_text = malloc(out_cap);
    if (!logits || !out_text) { rc = kv_cli_err(CMD, 2, "out of memory"); goto done; }
    if (logits_path && !(lf = fopen(logits_path, "wb"))) { rc = kv_cli_err(CMD, 2, "cannot write '%s'", logits_path); goto done; }
    for (size_t i = 0; i < n_ids; i++) kv_sampler_accept(smp, ids[i]);

    int32_t *gen = malloc(((size_t)n_predict + 1) * sizeof *gen);
    if (!gen) { rc = kv_cli_err(CMD, 2, "out of memory"); goto done; }
    size_t n_gen = 0;
    double t0 = kv_now();
    if ((rc = kv_state_eval(st, ids, (uint32_t)n_ids, logits, &d))) { free(gen); rc = kv_cli_diag(CMD, &d); goto done; }
    double t1 = kv_now(), t_dec = 0;
    bool ctx_full = false;
    while ((long)n_gen < n_predict) {
        if (lf && fwrite(logits, sizeof(float), hp->n_vocab, lf) != hp->n_vocab) {
            free(gen);
            rc = kv_cli_err(CMD, 2, "write error on '%s'", logits_path);
            goto done;
        }
        const int32_t t = kv_sampler_sample(smp, logits);
        kv_sampler_accept(smp, t);
        gen[n_gen++] = t;
        if (kv_tok_is_eog(tok, t)) break;
        char piece[512];
        int pn = kv_tok_piece(tok, t, false, piece, sizeof piece);
        if (pn > (int)sizeof piece) pn = (int)sizeof piece;
        if (pn > 0) {
            if (out_len + (size_t)pn + 1 > out_cap) {
                char *nb = realloc(out_text, out_cap * 2 + (size_t)pn);
                if (!nb) { free(gen); rc = kv_cli_err(CMD, 2, "out of memory"); goto done; }
                out_text = nb;
                out_cap = out_cap * 2 + (size_t)pn;
            }
            memcpy(out_text + out_len, piece, (size_t)pn);
            out_len += (size_t)pn;
            if (!json) {
                fwrite(piece, 1, (size_t)pn, stdout);
                fflush(stdout);
            }
        }
        if ((long)n_gen == n_predict) break;
        if (kv_state_pos(st) >= kv_state_n_ctx(st)) {
            ctx_full = true;
            break;
        }
        double a = kv_now();
        if ((rc = kv_state_eval(st, &t, 1, logits, &d))) { free(gen); rc = kv_cli_diag(CMD, &d); goto done; }
        t_dec += kv_now() - a;
    }
    const size_t n_dec = n_gen > 0 ? n_gen - 1 : 0;
    const double pre_tps = (double)n_ids / (t1 - t0 > 0 ? t1 - t0 : 1e-9);
    const double dec_tps = n_dec && t_dec > 0 ? (double)n_dec / t_dec : 0.0;
    if (json) {
        printf("{\"prompt_tokens\":[");
        for (size_t i = 0; i < n_ids; i++) printf("%s%d", i ? "," : "", ids[i]);
        printf("],\"tokens\":[");
        for (size_t i = 0; i < n_gen; i++) printf("%s%d", i ? "," : "", gen[i]);
        printf("],\"text\":");
        clean = malloc(out_len * 3 + 1);
        if (!clean) { free(gen); rc = kv_cli_err(CMD, 2, "out of memory"); goto done; }
        kv_json_str(stdout, clean, kv_utf8_clean(out_text, out_len, clean));
        printf(",\"timings\":{\"prefill_tok_s\":%.3f,\"decode_tok_s\":%.3f}", pre_tps, dec_tps);
        if (remote) kv_run_dispatch_json(remote);
        printf("}\n");
    } else {
        printf("\n");
        fflush(stdout);
        fprintf(stderr, "kvasir run: %zu prompt tokens at %.1f tok/s, %zu generated at %.1f tok/s\n",
                n_ids, pre_tps, n_gen, dec_tps);
    }
    if (slices && cache_mb > 0 && !json) {
        kv_slices_stats cs;
        kv_slices_get_stats(slices, &cs);
        fprintf(stderr, "kvasir run: expert cache %u slots x %.2f MiB: %llu hits, %llu misses, %llu evictions, %.1f MB read, "
                "%llu extra waves\n", cs.cache_slots, (double)cs.slot_bytes / 1048576.0, (unsigned long long)cs.hits,
                (unsigned long long)cs.misses, (unsigned long long)cs.evictions, (double)cs.bytes_read / 1e6,
                (unsigned long long)cs.waves);
    }
    if (remote && verbose) kv_run_dispatch_log(remote);
    if (ctx_full) fprintf(stderr, "kvasir run: stopped at the end of the context (%ld tokens)\n", n_ctx);
    free(gen);
    rc = 0;
done:
    if (lf && fclose(lf) && rc == 0) rc = kv_cli_err(CMD, 2, "write error on '%s'", logits_path);
    free(clean);
    free(logits);
    free(out_text);
    free(ids);
    free(chat_text);
    free(ptext);
    kv_sampler_free(smp);
    kv_state_free(st);
    if (prov.free) prov.free(prov.impl);
    kv_remote_free(remote);
    kv_pool_free(pool);
    kv_model_free(m);
    kv_slices_free(slices);
    free(manifest);
    return rc;
}
