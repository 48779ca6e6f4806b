/* kvasir run: generate text from a prompt, streaming it as it comes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/cli.h"
#include "kvasir/model.h"
#include "kvasir/sample.h"

static const char *const kv_value_flags[] = {"-m", "--model", "-p", "--prompt", "-f", "--file", "--logits-out", "-n", "--n-predict", "--threads", "-t", "--ctx", "-c", "--batch", "-b", "--temp", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--seed", NULL};

#define CMD "run"

static const char *kv_run_help =
    "usage: kvasir run -m F.gguf -p TEXT [options]\n"
    "  -m, --model F        GGUF model file\n"
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

int kv_cmd_run(int argc, char **argv) {
    const char *model = NULL, *prompt = NULL, *pfile = NULL, *logits_path = NULL;
    long n_predict = 64, threads = 0, n_ctx = 0, n_batch = 256;
    bool chat = false, json = false, seed_set = false;
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
    if ((rc = kv_model_load(&m, model, &d))) { rc = kv_cli_diag(CMD, &d); goto done; }
    const kv_hparams *hp = kv_model_hparams(m);
    const kv_tok *tok = kv_model_tok(m);
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
    if ((rc = kv_pool_new(&pool, (int)threads, &d))) { rc = kv_cli_diag(CMD, &d); goto done; }
    kv_state_opts so = {(uint32_t)n_ctx, (uint32_t)n_batch, NULL};
    if ((rc = kv_state_new(&st, m, pool, &so, &d))) { rc = kv_cli_diag(CMD, &d); goto done; }
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
        printf(",\"timings\":{\"prefill_tok_s\":%.3f,\"decode_tok_s\":%.3f}}\n", pre_tps, dec_tps);
    } else {
        printf("\n");
        fprintf(stderr, "kvasir run: %zu prompt tokens at %.1f tok/s, %zu generated at %.1f tok/s\n",
                n_ids, pre_tps, n_gen, dec_tps);
    }
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
    kv_pool_free(pool);
    kv_model_free(m);
    return rc;
}
