/* kvasir run: generate text from a prompt, streaming it as it comes: one
 * engine session (kvasir/engine.h), the same path a server takes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/cli.h"
#include "kvasir/dispatch_demand.h"
#include "kvasir/dispatch_proto.h"
#include "kvasir/dispatch_remote.h"
#include "kvasir/engine.h"
#include "kvasir/grammar.h"
#include "kvasir/hub.h"
#include "kvasir/node.h"
#include "kvasir/quant.h"
#include "kvasir/ring.h"
#include "kvasir/slice.h"
#include "kvasir/verify.h"
#include <sys/stat.h>

static const char *const kv_value_flags[] = {"-m", "--model", "-p", "--prompt", "-f", "--file", "--logits-out", "-n", "--n-predict", "--threads", "-t", "--ctx", "-c", "--batch", "-b", "--temp", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--presence-penalty", "--frequency-penalty", "--seed", "--expert-cache-mb", "--worker", "--worker-timeout-ms", "--wire", "--kv-type", "--hub", "--data", "--ring", "--ring-timeout-ms", "--key", "--verify-recompute", "--hub-wait-ms", "--grammar", "--json-schema", "--draft", "--draft-max", NULL};

#define CMD "run"

static const char *kv_run_help =
    "usage: kvasir run -m F.gguf -p TEXT [options]\n"
    "  -m, --model F        GGUF model file, or DIR/manifest.json (or DIR) of a sliced model\n"
    "                       (kvasir slice): the backbone stays resident, experts come from the slabs\n"
    "  --expert-cache-mb N  sliced model: keep experts in a cache of N MiB filled from the slab\n"
    "                       files on demand (LRU); default: map the slabs\n"
    "  --skip-hashes        sliced model: check sizes, headers and model identity but do not\n"
    "                       hash every piece at start (default: verify every SHA-256)\n"
    "  --no-prefault        do not fault the backbone in on a background thread at start (it\n"
    "                       overlaps tokenization and the first layers: a shorter cold start)\n"
    "  --allow-sparse       sliced model: run a sliced skeleton (pieces without hashes: sizes,\n"
    "                       headers and identity are checked); refused without this flag\n"
    "  --worker HOST:PORT   sliced model: compute experts on this worker (kvasir worker); repeat\n"
    "                       for more. Only the backbone need be present; slabs that are present\n"
    "                       serve the experts no worker holds, and every expert must be served\n"
    "  --worker-timeout-ms N  a worker that has not answered a layer within N ms is dropped and\n"
    "                       its experts retried elsewhere (default 10000)\n"
    "  --insecure-plaintext  dial workers over plain TCP, without TLS (default: TLS 1.3 pinned to\n"
    "                       each worker's key); for a network you own; prints a warning\n"
    "  --hub URL            take the model from a hub: its manifest and backbone are fetched into\n"
    "                       --data DIR (resumable, hash checked) and its experts computed by the\n"
    "                       live nodes of the hub's placement map (instead of -m)\n"
    "  --data DIR           with --hub: where the coordinator's pieces are kept (default kvasir-data)\n"
    "  --hub-wait-ms N      with --hub: while some expert is served by no worker (nodes trading\n"
    "                       shards), read the placement map again for up to N ms before giving up,\n"
    "                       at start and when a step fails (default 30000)\n"
    "  --ring HOST:PORT     submit to a ring node (kvasir ring) instead of -m: the ring tokenizes,\n"
    "                       computes and streams the tokens back (--ring-timeout-ms N: longest wait\n"
    "                       for one token, default 60000); it proves --key (below) to the node;\n"
    "                       with --chat the home applies the chat template; with --hub URL the key's\n"
    "                       voucher from that hub is shown too (nodes that trust the hub admit it)\n"
    "  --verify             check every worker answer (Freivalds, docs/VERIFY.md) against the slabs\n"
    "                       present in the manifest's folder; a worker caught lying is dropped for good\n"
    "  --verify-recompute R also recompute a fraction R of the answers in full (with --verify)\n"
    "  --key FILE           the key proved to workers (default DATA/coordinator.key with --hub,\n"
    "                       else ~/.kvasir/coordinator.key; created if absent; see kvasir key)\n"
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
    "  --presence-penalty P subtract P from the logit of every token generated so far, in [-2, 2] (default 0)\n"
    "  --frequency-penalty F subtract F x its count from the logit of every token generated so far, in [-2, 2]\n"
    "                       (default 0)\n"
    "  --seed S             random seed (default: from the clock)\n"
    "  --threads N          worker threads (default: all CPUs)\n"
    "  --ctx N              context length (default: the model's; KV memory follows the tokens held)\n"
    "  --batch N            prompt tokens per forward chunk (default 256)\n"
    "  --kv-type T          KV cache elements: f32 (exact, default) or f16 (half the memory)\n"
    "  --draft SRC          speculative decoding (docs/SPECULATIVE.md; the same tokens, fewer forward\n"
    "                       passes): none (default), ngram (the context's own repeats), mtp (the\n"
    "                       model's MTP block), test:FILE:P[:SEED] (measurement only: the token ids in\n"
    "                       FILE, e.g. a plain run's, each proposed right with probability P)\n"
    "  --draft-max K        tokens drafted per forward pass, 1..15 (default 3)\n"
    "                       (with --ring: ngram, mtp or test:FILE:P, drafted by the ring's last node)\n"
    "  --grammar F          constrain the output to the GBNF grammar in file F (start rule root;\n"
    "                       docs/GRAMMAR.md): it stops where the grammar is complete\n"
    "  --json-schema F      constrain the output to the JSON schema in file F (as the gateway's\n"
    "                       response_format json_schema)\n"
    "  --chat               wrap the prompt in the ChatML chat template\n"
    "  --json               print one JSON object instead of streaming text\n"
    "  --logits-out F       write the logits used for each generated token (f32 LE, n_vocab each)\n";

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

/* --json with workers: which worker (so which backend) computed how many
 * experts in each engine step, from the deltas of each worker's answered
 * pairs and of the pairs computed here (docs/NUMERICS.md). */
typedef struct kv_run_steplog {
    uint32_t nw;       /* workers at the start (a run adds none) */
    uint64_t *prev;    /* [nw + 1] totals after the last step (last: local) */
    uint64_t *rows;    /* [n][nw + 1] per step */
    size_t n, cap;
    bool oom;
} kv_run_steplog;

static void kv_run_steplog_take(kv_run_steplog *l, const kv_remote *r) {
    if (l->oom || !l->prev) return;
    if (l->n == l->cap) {
        const size_t cap = l->cap ? l->cap * 2 : 64;
        uint64_t *nr = realloc(l->rows, cap * (l->nw + 1) * sizeof *nr);
        if (!nr) {
            l->oom = true;
            return;
        }
        l->rows = nr;
        l->cap = cap;
    }
    uint64_t *row = l->rows + l->n * (l->nw + 1);
    for (uint32_t i = 0; i < l->nw; i++) {
        kv_remote_worker w;
        kv_remote_worker_info(r, i, &w);
        row[i] = w.pairs - l->prev[i];
        l->prev[i] = w.pairs;
    }
    kv_remote_stats st;
    kv_remote_get_stats(r, &st);
    row[l->nw] = st.pairs_local - l->prev[l->nw];
    l->prev[l->nw] = st.pairs_local;
    l->n++;
}

/* ,"steps":[{"workers":[n per worker],"local":n,"backends":{"name":n,...}}] */
static void kv_run_steplog_json(const kv_run_steplog *l, const kv_remote *r) {
    if (!l->prev || l->oom) return;
    char (*be)[sizeof(((kv_remote_worker *)0)->backend)] = calloc(l->nw ? l->nw : 1, sizeof *be);
    if (!be) return;
    for (uint32_t i = 0; i < l->nw; i++) {
        kv_remote_worker w;
        kv_remote_worker_info(r, i, &w);
        memcpy(be[i], w.backend, sizeof be[i]);
        be[i][sizeof be[i] - 1] = 0;
    }
    printf(",\"steps\":[");
    for (size_t k = 0; k < l->n; k++) {
        const uint64_t *row = l->rows + k * (l->nw + 1);
        printf("%s{\"workers\":[", k ? "," : "");
        for (uint32_t i = 0; i < l->nw; i++) printf("%s%llu", i ? "," : "", (unsigned long long)row[i]);
        printf("],\"local\":%llu,\"backends\":{", (unsigned long long)row[l->nw]);
        bool first = true;
        for (uint32_t i = 0; i < l->nw; i++) {
            bool seen = false; /* one key per backend name: its workers summed */
            for (uint32_t j = 0; j < i && !seen; j++) seen = !strcmp(be[j], be[i]);
            if (seen) continue;
            uint64_t sum = 0;
            for (uint32_t j = i; j < l->nw; j++) sum += strcmp(be[j], be[i]) ? 0 : row[j];
            if (!sum) continue;
            printf("%s", first ? "" : ",");
            kv_json_str(stdout, be[i], strlen(be[i]));
            printf(":%llu", (unsigned long long)sum);
            first = false;
        }
        if (row[l->nw]) {
            printf("%s\"local:%s\":%llu", first ? "" : ",", kv_quant_backend(), (unsigned long long)row[l->nw]);
        }
        printf("}}");
    }
    printf("]");
    free(be);
}

/* "dispatch":{...} for --json: per-layer round trip and each worker's work. */
static void kv_run_dispatch_json(const kv_remote *r, const kv_run_steplog *sl) {
    kv_remote_stats st;
    kv_remote_get_stats(r, &st);
    printf(",\"dispatch\":{\"calls\":%llu,\"rounds\":%llu,\"retried_pairs\":%llu,\"pairs_remote\":%llu,"
           "\"pairs_local\":%llu,\"bytes_sent\":%llu,\"bytes_recv\":%llu,\"rtt_p50_us\":%.1f,\"rtt_p99_us\":%.1f,"
           "\"verified\":%llu,\"unverified\":%llu,\"recomputed\":%llu,\"caught\":%llu,"
           "\"hedges\":%llu,\"hedges_won\":%llu,\"late_answers\":%llu,\"hedges_cancelled\":%llu,\"pairs_hedged\":%llu,\"sigs_checked\":%llu,\"sigs_deferred\":%llu,\"workers\":[", (unsigned long long)st.calls, (unsigned long long)st.rounds,
           (unsigned long long)st.retried_pairs, (unsigned long long)st.pairs_remote,
           (unsigned long long)st.pairs_local, (unsigned long long)st.bytes_sent, (unsigned long long)st.bytes_recv,
           st.rtt_p50_us, st.rtt_p99_us, (unsigned long long)st.pairs_verified,
           (unsigned long long)st.pairs_unverified, (unsigned long long)st.pairs_recomputed,
           (unsigned long long)st.caught, (unsigned long long)st.hedges, (unsigned long long)st.hedges_won,
           (unsigned long long)st.late_answers, (unsigned long long)st.hedges_cancelled,
           (unsigned long long)st.pairs_hedged, (unsigned long long)st.sigs_checked,
           (unsigned long long)st.sigs_deferred);
    for (uint32_t i = 0; i < kv_remote_n_workers(r); i++) {
        kv_remote_worker w;
        kv_remote_worker_info(r, i, &w);
        printf("%s{\"addr\":", i ? "," : "");
        kv_json_str(stdout, w.addr, strlen(w.addr));
        printf(",\"backend\":"); /* the kernel backend it announced (HELLO_ACK) */
        kv_json_str(stdout, w.backend, strlen(w.backend));
        printf(",\"caught\":%s,\"verified\":%llu", w.caught ? "true" : "false", (unsigned long long)w.verified);
        printf(",\"latency_ms\":%.3f,\"p95_ms\":%.3f,\"hedged\":%llu,\"hedges_won\":%llu,\"late\":%llu,\"cancelled\":%llu,\"probes\":%llu",
               w.latency_ms, w.p95_ms, (unsigned long long)w.hedged, (unsigned long long)w.hedges_won,
               (unsigned long long)w.late, (unsigned long long)w.cancelled, (unsigned long long)w.probes);
        printf(",\"up\":%s,\"wire\":\"%s\",\"requests\":%llu,\"pairs\":%llu,\"pairs_since_connect\":%llu,"
               "\"drops\":%llu,\"connects\":%llu,\"last_error\":", w.up ? "true" : "false", kv_enc_name(w.enc),
               (unsigned long long)w.requests, (unsigned long long)w.pairs, (unsigned long long)w.pairs_since_connect,
               (unsigned long long)w.drops, (unsigned long long)w.connects);
        kv_json_str(stdout, w.last_error, strlen(w.last_error));
        printf("}");
    }
    printf("],\"demand\":["); /* per shard: what the hub's market is told (kv_remote_get_demand) */
    const kv_manifest *m = kv_remote_manifest(r);
    kv_remote_demand *dm = malloc((m->n_slabs ? m->n_slabs : 1) * sizeof *dm);
    if (dm) kv_remote_get_demand(r, dm, m->n_slabs);
    for (size_t i = 0; dm && i < m->n_slabs; i++)
        printf("%s{\"layer\":%u,\"first\":%u,\"last\":%u,\"computations\":%llu,\"wait_us\":%llu}", i ? "," : "",
               m->slabs[i].layer, m->slabs[i].first, m->slabs[i].last, (unsigned long long)dm[i].computations,
               (unsigned long long)dm[i].wait_us);
    free(dm);
    printf("]");
    kv_run_steplog_json(sl, r);
    printf("}");
}

/* --hub: what the run needed per shard, reported to the hub's market once at
 * its end (docs/HUB.md "Demand"); a refusal is a warning, the run's output
 * stands. */
static void kv_run_report_demand(const char *hub, kv_node_key *key, const kv_remote *r, uint64_t tokens) {
    const kv_manifest *m = kv_remote_manifest(r);
    kv_remote_demand *dm = malloc((m->n_slabs ? m->n_slabs : 1) * sizeof *dm);
    kv_diag d = {0};
    int rc = KV_ENOMEM;
    if (dm) {
        kv_remote_get_demand(r, dm, m->n_slabs);
        rc = kv_demand_report_once(hub, key, m, dm, tokens, &d);
    }
    if (rc) fprintf(stderr, "kvasir run: warning: demand report to %s: %s\n", hub, d.msg[0] ? d.msg : "out of memory");
    free(dm);
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

/* --ring: the request goes to a ring node; tokens (and logits) stream back. */
typedef struct kv_run_ring_out {
    FILE *lf;                /* --logits-out */
    bool json, werr;
    int32_t *gen;            /* [cap] tokens */
    size_t n_gen, cap;
    char *text;              /* [text_cap] */
    size_t text_len, text_cap;
    double t_first, t_last;  /* wall clock (s) of the first and last token's arrival */
} kv_run_ring_out;

static double kv_wall_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int kv_run_ring_tok(void *data, int32_t token, const char *piece, size_t pn, const float *logits, uint32_t nv) {
    kv_run_ring_out *o = data;
    o->t_last = kv_wall_s();
    if (!o->n_gen) o->t_first = o->t_last;
    if (o->lf && logits && fwrite(logits, sizeof(float), nv, o->lf) != nv) o->werr = true;
    if (o->n_gen == o->cap) {
        size_t nc = o->cap ? 2 * o->cap : 64;
        int32_t *ng = realloc(o->gen, nc * sizeof *ng);
        if (!ng) return 1;
        o->gen = ng;
        o->cap = nc;
    }
    o->gen[o->n_gen++] = token;
    if (o->text_len + pn + 1 > o->text_cap) {
        size_t nc = 2 * o->text_cap + pn + 64;
        char *nt = realloc(o->text, nc);
        if (!nt) return 1;
        o->text = nt;
        o->text_cap = nc;
    }
    memcpy(o->text + o->text_len, piece, pn);
    o->text_len += pn;
    if (!o->json && pn) {
        fwrite(piece, 1, pn, stdout);
        fflush(stdout);
    }
    return 0;
}

static int kv_run_ring(const char *addr, const char *hub, const char *key_path, const char *prompt, bool chat,
                       long n_predict, const kv_sample_params *sp, bool json, const char *logits_path, long timeout_ms,
                       const char *draft, uint32_t draft_max) {
    kv_run_ring_out o = {.json = json};
    kv_ring_result res = {0};
    kv_diag d = {0};
    int rc = 0;
    const double t0 = kv_wall_s();
    kv_node_key key;
    if ((rc = kv_cli_key(CMD, key_path, NULL, &key))) return rc;
    kv_voucher v; /* --hub: the hub's voucher for the key, which nodes trusting that hub admit */
    if (hub && kv_node_fetch_auth(hub, &key, NULL, 0, NULL, &v, &d)) {
        memset(&key, 0, sizeof key);
        return kv_cli_diag(CMD, &d);
    }
    if (logits_path && !(o.lf = fopen(logits_path, "wb"))) return kv_cli_err(CMD, 2, "cannot write '%s'", logits_path);
    kv_ring_params p = {.flags = logits_path ? KV_RING_SUBMIT_LOGITS : 0,
                        .n_predict = n_predict > 0 ? (uint32_t)n_predict : 1, .sample = *sp};
    int32_t *rec = NULL; /* --draft: the tail drafts (docs/SPECULATIVE.md "Over the ring") */
    if (kv_ring_draft_params(draft, draft_max, &p, &rec, &d)) {
        memset(&key, 0, sizeof key);
        if (o.lf) fclose(o.lf);
        return kv_cli_diag(CMD, &d);
    }
    /* --chat: one user message, templated by the home (SUBMIT_CHAT) */
    const kv_chat_msg um = {"user", prompt, strlen(prompt)};
    const kv_ring_req q = {.text = prompt, .text_len = strlen(prompt), .msgs = chat ? &um : NULL, .n_msgs = chat,
                           .p = p, .key_sk = key.sk, .voucher = hub ? &v : NULL, .timeout_ms = (int)timeout_ms,
                           .on_token = kv_run_ring_tok,
                           .data = &o};
    rc = kv_ring_request_ex(addr, &q, &res, &d);
    free(rec);
    memset(&key, 0, sizeof key);
    if (o.lf && fclose(o.lf)) o.werr = true;
    if (rc) {
        if (!json && o.n_gen) printf("\n");
        rc = kv_cli_diag(CMD, &d);
    } else if (o.werr) {
        rc = kv_cli_err(CMD, 2, "write error on '%s'", logits_path);
    } else if (json) {
        printf("{\"prompt_tokens\":[");
        for (uint32_t i = 0; i < res.n_prompt; i++) printf("%s%d", i ? "," : "", res.prompt[i]);
        printf("],\"tokens\":[");
        for (size_t i = 0; i < o.n_gen; i++) printf("%s%d", i ? "," : "", o.gen[i]);
        printf("],\"text\":");
        char *clean = malloc(o.text_len * 3 + 1);
        if (clean) kv_json_str(stdout, clean, kv_utf8_clean(o.text ? o.text : "", o.text_len, clean));
        else printf("\"\"");
        free(clean);
        /* wall-clock stamps, so that several clients' decode phases can be combined */
        printf(",\"timings\":{\"first_token_s\":%.6f,\"decode_tok_s\":%.3f,\"t_first\":%.6f,\"t_last\":%.6f}",
               o.n_gen ? o.t_first - t0 : 0.0, o.n_gen > 1 && o.t_last > o.t_first ? (double)(o.n_gen - 1) / (o.t_last - o.t_first) : 0.0,
               o.t_first, o.t_last);
        if (draft) /* verify steps: the passes that verified drafts; emitted: every token */
            printf(",\"spec\":{\"passes\":%u,\"drafted\":%u,\"accepted\":%u,\"emitted\":%zu}", res.spec_passes,
                   res.spec_drafted, res.spec_accepted, o.n_gen);
        printf(",\"cached_tokens\":%u", res.n_cached); /* prompt tokens the nodes' prompt caches gave */
        printf(",\"stop\":\"%s\",\"ring\":\"", kv_stop_name((enum kv_stop)res.stop));
        printf("%s\"}\n", addr);
    } else {
        printf("\n");
        fprintf(stderr, "kvasir run: %u prompt tokens, %zu generated through the ring at %s\n", res.n_prompt, o.n_gen, addr);
    }
    kv_ring_result_free(&res);
    free(o.gen);
    free(o.text);
    return rc;
}

static double kv_run_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* --grammar F (GBNF) or --json-schema F compiled into *out (the gateway's
 * limits); nonzero after printing why. */
static int kv_run_grammar(const char *gpath, const char *spath, kv_grammar **out) {
    const char *path = gpath ? gpath : spath, *flag = gpath ? "--grammar" : "--json-schema";
    FILE *f = fopen(path, "rb");
    if (!f) return kv_cli_err(CMD, 1, "%s: cannot open '%s'", flag, path);
    char *text = malloc((1u << 20) + 1);
    const size_t n = text ? fread(text, 1, (1u << 20) + 1, f) : 0;
    const bool err = ferror(f);
    fclose(f);
    if (!text || err) {
        free(text);
        return kv_cli_err(CMD, 2, "%s: cannot read '%s'", flag, path);
    }
    if (n > (1u << 20)) {
        free(text);
        return kv_cli_err(CMD, 1, "%s: '%s' is over 1 MiB", flag, path);
    }
    kv_grammar_limits lim;
    kv_grammar_limits_default(&lim);
    lim.max_memory_bytes = 64u << 20;
    kv_diag d = {0};
    const int rc = gpath ? kv_grammar_parse(out, text, n, &lim, &d) : kv_grammar_from_schema(out, text, n, &lim, &d);
    free(text);
    if (rc) return kv_cli_err(CMD, 1, "%s '%s': %s", flag, path, d.msg);
    return 0;
}

int kv_cmd_run(int argc, char **argv) {
    const char *model = NULL, *prompt = NULL, *pfile = NULL, *logits_path = NULL;
    const char *grammar_path = NULL, *schema_path = NULL;
    kv_grammar *grammar = NULL;
    long n_predict = 64, threads = 0, n_ctx = 0, n_batch = 256, cache_mb = -1;
    bool chat = false, json = false, seed_set = false, verbose = false, skip_hashes = false, allow_sparse = false, prefault = true;
    bool insecure_plaintext = false;
    const char *workers[KV_REMOTE_MAX_WORKERS];
    uint32_t n_workers = 0;
    const char *hub = NULL, *data_dir = "kvasir-data", *key_path = NULL, *ring = NULL;
    long ring_timeout = 60000;
    kv_cli_auth auth = {0};
    bool verify = false;
    double verify_rate = 0;
    const kv_verify_opts vopts = {0};
    char hub_manifest[4200];
    char **hub_workers = NULL;
    uint32_t n_hub_workers = 0;
    long worker_timeout = 10000, hub_wait = 30000;
    int wire = KV_ENC_F32, kv_type = KV_TYPE_F32;
    const char *draft = NULL;
    long draft_max = 0;
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
        } else if (!strcmp(a, "--verify")) {
            verify = true;
        } else if (!strcmp(a, "--skip-hashes")) {
            skip_hashes = true;
        } else if (!strcmp(a, "--no-prefault")) {
            prefault = false;
        } else if (!strcmp(a, "--allow-sparse")) { /* run a sliced skeleton (pieces without hashes) */
            allow_sparse = true;
        } else if (!strcmp(a, "--insecure-plaintext")) {
            insecure_plaintext = true;
            kv_link_warn_plaintext("run");
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
        } else if (!strcmp(a, "--grammar")) {
            grammar_path = v;
        } else if (!strcmp(a, "--json-schema")) {
            schema_path = v;
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
        } else if (!strcmp(a, "--presence-penalty")) {
            if (kv_arg_float(CMD, a, v, -2, 2, &sp.presence_penalty)) return 1;
        } else if (!strcmp(a, "--frequency-penalty")) {
            if (kv_arg_float(CMD, a, v, -2, 2, &sp.frequency_penalty)) return 1;
        } else if (!strcmp(a, "--expert-cache-mb")) {
            if (kv_arg_long(CMD, a, v, 1, 1l << 30, &cache_mb)) return 1;
        } else if (!strcmp(a, "--worker")) {
            if (n_workers == KV_REMOTE_MAX_WORKERS)
                return kv_cli_err(CMD, 1, "--worker: at most %u workers", KV_REMOTE_MAX_WORKERS);
            workers[n_workers++] = v;
        } else if (!strcmp(a, "--hub")) {
            hub = v;
        } else if (!strcmp(a, "--hub-wait-ms")) {
            if (kv_arg_long(CMD, a, v, 0, 86400000, &hub_wait)) return 1;
        } else if (!strcmp(a, "--verify-recompute")) {
            float f;
            if (kv_arg_float(CMD, a, v, 0, 1, &f)) return 1;
            verify_rate = f;
            verify = true;
        } else if (!strcmp(a, "--key")) {
            key_path = v;
        } else if (!strcmp(a, "--data")) {
            data_dir = v;
        } else if (!strcmp(a, "--ring")) {
            ring = v;
        } else if (!strcmp(a, "--ring-timeout-ms")) {
            if (kv_arg_long(CMD, a, v, 1, 3600000, &ring_timeout)) return 1;
        } else if (!strcmp(a, "--worker-timeout-ms")) {
            if (kv_arg_long(CMD, a, v, 1, 3600000, &worker_timeout)) return 1;
        } else if (!strcmp(a, "--wire")) {
            if ((wire = kv_enc_from_name(v)) < 0)
                return kv_cli_err(CMD, 1, "--wire: '%s' is not one of f32, f16, bf16", v);
        } else if (!strcmp(a, "--draft")) {
            if (strlen(v) > 4096) return kv_cli_err(CMD, 1, "--draft: longer than 4096 bytes");
            draft = v;
        } else if (!strcmp(a, "--draft-max")) {
            if (kv_arg_long(CMD, a, v, 1, 15, &draft_max)) return 1;
        } else if (!strcmp(a, "--kv-type")) {
            if (!strcmp(v, "f32")) kv_type = KV_TYPE_F32;
            else if (!strcmp(v, "f16")) kv_type = KV_TYPE_F16;
            else return kv_cli_err(CMD, 1, "--kv-type: '%s' is not one of f32, f16", v);
        } else if (!strcmp(a, "--seed")) {
            if (kv_arg_u64(CMD, a, v, &sp.seed)) return 1;
            seed_set = true;
        } else {
            return kv_cli_err(CMD, 1, "unknown option '%s' (see kvasir run --help)", a);
        }
    }
    if (hub && (model || n_workers)) return kv_cli_err(CMD, 1, "--hub replaces -m and --worker: give one or the other");
    if (ring && (model || n_workers || pfile))
        return kv_cli_err(CMD, 1, "--ring replaces -m and --worker, and takes -p TEXT (no -f)");
    if (ring && !prompt) return kv_cli_err(CMD, 1, "missing -p PROMPT");
    if (ring && (sp.presence_penalty != 0 || sp.frequency_penalty != 0))
        return kv_cli_err(CMD, 1, "--presence-penalty and --frequency-penalty are not carried to a ring (yet)");
    if (grammar_path && schema_path) return kv_cli_err(CMD, 1, "give either --grammar or --json-schema, not both");
    if (ring && (grammar_path || schema_path))
        return kv_cli_err(CMD, 1, "--grammar and --json-schema are not supported with --ring (not yet): the ring's "
                          "last node samples");
    if (draft_max && !draft) return kv_cli_err(CMD, 1, "--draft-max needs --draft");
    if ((grammar_path || schema_path) && kv_run_grammar(grammar_path, schema_path, &grammar)) return 1;
    if (ring) {
        if (!seed_set) sp.seed = (uint64_t)time(NULL) ^ ((uint64_t)clock() << 32);
        return kv_run_ring(ring, hub, key_path, prompt, chat, n_predict, &sp, json, logits_path, ring_timeout, draft,
                           (uint32_t)draft_max);
    }
    if (!model && !hub) return kv_cli_err(CMD, 1, "missing -m MODEL or --hub URL (see kvasir run --help)");
    if (!prompt && !pfile) return kv_cli_err(CMD, 1, "missing -p PROMPT or -f FILE");
    if (prompt && pfile) return kv_cli_err(CMD, 1, "give either -p or -f, not both");
    if (hub) { /* the coordinator folder from the hub, the workers from its placement map */
        kv_diag hd = {0};
        if (kv_node_fetch_coordinator(hub, data_dir, hub_manifest, sizeof hub_manifest, &hub_workers, &n_hub_workers,
                                      NULL, NULL, &hd))
            return kv_cli_diag(CMD, &hd);
        n_workers = n_hub_workers; /* as many as the map keeps: the list is hub_workers */
        model = hub_manifest;
    }
    if (n_workers && kv_cli_auth_setup(CMD, key_path, hub, data_dir, hub_workers, n_hub_workers, &auth)) {
        kv_node_workers_free(hub_workers, n_hub_workers);
        return 2;
    }
    if (!seed_set) sp.seed = (uint64_t)time(NULL) ^ ((uint64_t)clock() << 32);

    int rc = 2;
    kv_diag d = {0};
    kv_engine *eng = NULL;
    kv_session *ses = NULL;
    char *ptext = NULL, *chat_text = NULL, *out_text = NULL, *clean = NULL;
    int32_t *ids = NULL, *gen = NULL;
    FILE *lf = NULL;
    kv_run_steplog steplog = {0};
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
    bool sliced;
    {   /* a sliced model: DIR/manifest.json, or DIR */
        struct stat mst;
        const size_t ml = strlen(model);
        sliced = (!stat(model, &mst) && S_ISDIR(mst.st_mode)) || (ml >= 5 && !strcmp(model + ml - 5, ".json"));
    }
    if (!sliced && (cache_mb > 0 || skip_hashes)) { rc = kv_cli_err(CMD, 1, "--expert-cache-mb and --skip-hashes need a sliced model (-m DIR/manifest.json)"); goto done; }
    if (!n_workers && (wire != KV_ENC_F32 || worker_timeout != 10000)) { rc = kv_cli_err(CMD, 1, "--wire and --worker-timeout-ms need --worker"); goto done; }
    if (!sliced && n_workers) { rc = kv_cli_err(CMD, 1, "--worker needs a sliced model (-m DIR/manifest.json)"); goto done; }
    if (n_workers && cache_mb > 0) { rc = kv_cli_err(CMD, 1, "--expert-cache-mb and --worker cannot be combined"); goto done; }
    /* one engine, one session: the same path a server takes */
    const kv_engine_opts eo = {.n_threads = (int)threads, .n_ctx = (uint32_t)n_ctx, .n_batch = (uint32_t)n_batch,
                               .max_sessions = 1, .kv_type = (uint32_t)kv_type,
                               .expert_cache_bytes = cache_mb > 0 ? (uint64_t)cache_mb << 20 : 0,
                               .skip_hashes = skip_hashes, .allow_sparse = allow_sparse, .prefault = prefault,
                               .insecure_plaintext = insecure_plaintext,
                               .workers = hub ? (const char *const *)hub_workers : workers, .n_workers = n_workers,
                               /* from a hub: open even when some expert has no holder up yet, and
                                  take the holders the map names later (kv_node_await_coverage) */
                               .allow_uncovered = hub != NULL, .max_workers = hub ? UINT32_MAX : 0,
                               .worker_timeout_ms = (uint32_t)worker_timeout, .wire = (uint32_t)wire,
                               .log = verbose ? stderr : NULL, .key_sk = auth.key.sk,
                               .voucher = auth.has_voucher ? &auth.voucher : NULL, .worker_keys = auth.worker_keys,
                               .verify = verify ? &vopts : NULL, .recompute_rate = verify_rate,
                               .on_caught = kv_cli_caught, .caught_arg = &auth,
                               .draft = draft, .draft_max = (uint32_t)draft_max};
    if ((rc = kv_engine_open(&eng, model, &eo, &d))) { rc = kv_cli_diag(CMD, &d); goto done; }
    const kv_model *mc = kv_engine_model(eng);
    kv_remote *remote = kv_engine_remote(eng);
    if (hub && remote && (rc = kv_node_await_coverage(hub, remote, auth.has_voucher, (uint32_t)hub_wait, stderr, &d))) {
        rc = kv_cli_diag(CMD, &d);
        goto done;
    }
    kv_slices *slices = kv_engine_slices(eng);
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
    if (n_ids > kv_engine_n_ctx(eng)) {
        rc = kv_cli_err(CMD, 2, "prompt has %zu tokens, longer than the context (%u)", n_ids, kv_engine_n_ctx(eng));
        goto done;
    }
    kv_session_opts so = {.sample = sp, .max_tokens = n_predict > 0 ? (uint32_t)n_predict : 1};
    if ((rc = kv_session_new(&ses, eng, &so, &d)) || (grammar && (rc = kv_session_set_grammar(ses, grammar, &d))) ||
        (rc = kv_session_prompt(ses, ids, (uint32_t)n_ids, &d))) {
        rc = kv_cli_diag(CMD, &d);
        goto done;
    }
    out_cap = 4096;
    out_text = malloc(out_cap);
    gen = malloc(((size_t)n_predict + 1) * sizeof *gen);
    if (!out_text || !gen) { rc = kv_cli_err(CMD, 2, "out of memory"); goto done; }
    if (logits_path && !(lf = fopen(logits_path, "wb"))) { rc = kv_cli_err(CMD, 2, "cannot write '%s'", logits_path); goto done; }
    size_t n_gen = 0;
    if (json && remote) {
        steplog.nw = kv_remote_n_workers(remote);
        steplog.prev = calloc(steplog.nw + 1, sizeof *steplog.prev);
        if (steplog.prev) kv_run_steplog_take(&steplog, remote); /* the totals before the first step */
        steplog.n = 0;
    }
    double fail_since = 0;
    while (kv_engine_busy(eng)) {
        if ((rc = kv_engine_step(eng, &d)) < 0) {
            /* a step fails as a whole (no token from partial results): from a
               hub, its experts' holders may have moved; read the map again and
               retry the step while --hub-wait-ms lasts */
            const double now = kv_run_now();
            if (!fail_since) fail_since = now;
            if (hub && remote && now - fail_since < hub_wait / 1000.0) {
                fprintf(stderr, "kvasir %s: %s: reading the placement map again\n", CMD, d.msg);
                kv_diag cd = {0};
                const double left_ms = hub_wait - (now - fail_since) * 1000.0;
                if (kv_node_await_coverage(hub, remote, auth.has_voucher, left_ms > 0 ? (uint32_t)left_ms : 0, stderr, &cd))
                    fprintf(stderr, "kvasir %s: %s\n", CMD, cd.msg);
                kv_diag fd = {0}; /* covered or not: the step's workers may be others now */
                kv_node_placement_follow(hub, remote, auth.has_voucher, &fd);
                kv_remote_tend(remote, 200);
                d = (kv_diag){0};
                continue;
            }
            rc = kv_cli_diag(CMD, &d);
            goto done;
        }
        fail_since = 0;
        if (json && remote) kv_run_steplog_take(&steplog, remote);
        if (kv_session_status(ses) == KV_SESSION_FAILED) {
            kv_session_error(ses, &d);
            rc = kv_cli_diag(CMD, &d);
            goto done;
        }
        const int32_t t = kv_session_token(ses);
        if (t < 0 || n_predict == 0) continue;
        if (lf && fwrite(kv_session_logits(ses), sizeof(float), hp->n_vocab, lf) != hp->n_vocab) {
            rc = kv_cli_err(CMD, 2, "write error on '%s'", logits_path);
            goto done;
        }
        gen[n_gen++] = t;
        if (kv_tok_is_eog(tok, t)) continue;
        char piece[512];
        int pn = kv_tok_piece(tok, t, false, piece, sizeof piece);
        if (pn > (int)sizeof piece) pn = (int)sizeof piece;
        if (pn > 0) {
            if (out_len + (size_t)pn + 1 > out_cap) {
                char *nb = realloc(out_text, out_cap * 2 + (size_t)pn);
                if (!nb) { rc = kv_cli_err(CMD, 2, "out of memory"); goto done; }
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
    }
    kv_session_stats ss;
    kv_session_get_stats(ses, &ss);
    kv_engine_stats es;
    kv_engine_get_stats(eng, &es);
    const size_t n_dec = n_gen > 0 ? n_gen - 1 : 0;
    const double pre_tps = (double)n_ids / (ss.t_prefill_s > 0 ? ss.t_prefill_s : 1e-9);
    const double dec_tps = n_dec && ss.t_decode_s > 0 ? (double)n_dec / ss.t_decode_s : 0.0;
    if (json) {
        printf("{\"prompt_tokens\":[");
        for (size_t i = 0; i < n_ids; i++) printf("%s%d", i ? "," : "", ids[i]);
        printf("],\"tokens\":[");
        for (size_t i = 0; i < n_gen; i++) printf("%s%d", i ? "," : "", gen[i]);
        printf("],\"text\":");
        clean = malloc(out_len * 3 + 1);
        if (!clean) { rc = kv_cli_err(CMD, 2, "out of memory"); goto done; }
        kv_json_str(stdout, clean, kv_utf8_clean(out_text, out_len, clean));
        printf(",\"timings\":{\"prefill_tok_s\":%.3f,\"decode_tok_s\":%.3f}", pre_tps, dec_tps);
        printf(",\"stop\":\"%s\",\"engine\":{\"steps\":%llu,\"prefill_tokens\":%llu,\"decode_tokens\":%llu,"
               "\"prefill_s\":%.6f,\"decode_s\":%.6f,\"kv_type\":\"%s\",\"kv_bytes\":%llu,\"recurrent_bytes\":%llu}",
               kv_stop_name(kv_session_stop_reason(ses)), (unsigned long long)es.steps,
               (unsigned long long)es.tokens_prefill, (unsigned long long)es.tokens_decode, es.t_prefill_s, es.t_decode_s,
               kv_type == KV_TYPE_F16 ? "f16" : "f32", (unsigned long long)es.mem.kv_bytes,
               (unsigned long long)es.mem.recurrent_bytes);
        if (draft)
            printf(",\"spec\":{\"verify_steps\":%llu,\"drafted\":%llu,\"accepted\":%llu,\"emitted\":%llu,"
                   "\"digest\":\"%016llx\"}",
                   (unsigned long long)es.spec_steps, (unsigned long long)es.spec_drafted,
                   (unsigned long long)es.spec_accepted, (unsigned long long)es.spec_emitted,
                   (unsigned long long)es.spec_digest);
        if (remote) kv_run_dispatch_json(remote, &steplog);
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
    static const uint8_t no_key[32];
    if (remote && hub && memcmp(auth.key.pk, no_key, 32)) /* the coordinator key the hub vouched for */
        kv_run_report_demand(hub, &auth.key, remote, es.tokens_prefill + es.tokens_decode);
    if (kv_session_stop_reason(ses) == KV_STOP_CTX_FULL)
        fprintf(stderr, "kvasir run: stopped at the end of the context (%u tokens)\n", kv_engine_n_ctx(eng));
    rc = 0;
done:
    if (lf && fclose(lf) && rc == 0) rc = kv_cli_err(CMD, 2, "write error on '%s'", logits_path);
    free(clean);
    free(gen);
    free(out_text);
    free(ids);
    free(chat_text);
    free(ptext);
    kv_session_free(ses);
    kv_grammar_free(grammar);
    kv_engine_free(eng);
    kv_node_workers_free(hub_workers, n_hub_workers);
    kv_cli_auth_free(&auth);
    free(steplog.prev);
    free(steplog.rows);
    return rc;
}
