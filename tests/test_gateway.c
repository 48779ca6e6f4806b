/* kv-test-labels: net attack */
/* The gateway over a generated model, on 127.0.0.1 (port 0), driven with
 * libcurl. The reference for every generated text is the engine run alone
 * in this process (a second engine on the same file, one session, the same
 * sampler parameters), its tokens detokenized and cut at the first stop
 * string naively. Cases: each API whole and streamed, usage counts, stop
 * strings, 8 concurrent requests of different lengths each equal to the
 * same request alone, a disconnecting client freeing its session, every
 * error shape and status, keys, a full queue, /metrics as Prometheus text,
 * the chat template over a message list, the incremental text logic, and
 * the sliced model served through a `kvasir worker` (one message per layer
 * per step for the whole batch; a dead worker is a 503 and a 503 health). */
#include <curl/curl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include "gateway/gateway_internal.h"
#include "kvasir/dispatch_remote.h"
#include "kvasir/engine.h"
#include "kvasir/slice.h"
#include "kvasir/gateway.h"
#include "kvasir/gen.h"
#include "kvasir/quant.h"
#include "kvtest.h"
#include "test_auth_support.h"

static char g_dir[200];
static char g_model[300];
static kv_engine *g_eng;      /* the gateway's */
static kv_engine *g_ref;      /* the reference, driven by this thread only */
static kv_gateway *g_gw;
static char g_base[64];
#define N_CTX 2048u

/* ---- HTTP --------------------------------------------------------------- */

typedef struct resp {
    long status;
    char *body;
    size_t n;
    char retry_after[32];
    size_t abort_after;   /* > 0: hang up once this many bytes came */
} resp;

static size_t on_body(char *p, size_t sz, size_t nm, void *u) {
    resp *r = u;
    size_t k = sz * nm;
    char *nb = realloc(r->body, r->n + k + 1);
    if (!nb) return 0;
    r->body = nb;
    memcpy(r->body + r->n, p, k);
    r->n += k;
    r->body[r->n] = 0;
    if (r->abort_after && r->n >= r->abort_after) return 0;
    return k;
}

static size_t on_header(char *p, size_t sz, size_t nm, void *u) {
    resp *r = u;
    size_t k = sz * nm;
    if (k > 13 && !strncasecmp(p, "Retry-After: ", 13)) {
        size_t l = k - 13 < sizeof r->retry_after - 1 ? k - 13 : sizeof r->retry_after - 1;
        memcpy(r->retry_after, p + 13, l);
        r->retry_after[l] = 0;
        char *e = strpbrk(r->retry_after, "\r\n");
        if (e) *e = 0;
    }
    return k;
}

/* method GET when body is NULL; headers: NULL-terminated "Name: value". */
static void http(const char *base, const char *path, const char *body, const char *const *headers, resp *r) {
    char url[256];
    snprintf(url, sizeof url, "%s%s", base, path);
    CURL *c = curl_easy_init();
    struct curl_slist *h = NULL;
    h = curl_slist_append(h, "Content-Type: application/json");
    for (size_t i = 0; headers && headers[i]; i++) h = curl_slist_append(h, headers[i]);
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    if (body) curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, r);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, r);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_perform(c);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r->status);
    curl_slist_free_all(h);
    curl_easy_cleanup(c);
    if (!r->body) r->body = calloc(1, 1);
}

static json_t *parse(const char *s) { return json_loads(s, 0, NULL); }
static const char *jstr(json_t *j, const char *path) {
    /* "a.b.0.c" */
    char buf[128];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *t = strtok(buf, "."); t && j; t = strtok(NULL, "."))
        j = json_is_array(j) ? json_array_get(j, (size_t)atoi(t)) : json_object_get(j, t);
    return json_string_value(j);
}
static long long jint(json_t *j, const char *path) {
    char buf[128];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *t = strtok(buf, "."); t && j; t = strtok(NULL, "."))
        j = json_is_array(j) ? json_array_get(j, (size_t)atoi(t)) : json_object_get(j, t);
    return j ? json_integer_value(j) : -1;
}

/* ---- the reference: the engine alone -------------------------------------- */

typedef struct ref {
    char text[65536];
    uint32_t n_prompt, n_gen;
    bool length;          /* stopped by max_tokens */
} ref;

/* prompt: ChatML of one user message (chat) or raw; sp as the request. */
static void ref_run(const char *user, bool chat, kv_sample_params sp, uint32_t max_tokens, const char *stop, ref *out) {
    memset(out, 0, sizeof *out);
    const kv_tok *tok = kv_model_tok(kv_engine_model(g_ref));
    char *p = chat ? kv_tok_chatml(NULL, user) : strdup(user);
    static int32_t ids[8192];
    size_t n = 0, off = 0;
    if (kv_tok_add_bos(tok) && kv_tok_bos(tok) >= 0) ids[off++] = kv_tok_bos(tok);
    kv_diag d = {0};
    ASSERT_EQ(kv_tok_encode(tok, p, strlen(p), true, ids + off, 8192 - off, &n, &d), 0);
    free(p);
    n += off;
    out->n_prompt = (uint32_t)n;
    kv_session *s = NULL;
    kv_session_opts so = {.sample = sp, .max_tokens = max_tokens};
    ASSERT_EQ(kv_session_new(&s, g_ref, &so, &d), 0);
    ASSERT_EQ(kv_session_prompt(s, ids, (uint32_t)n, &d), 0);
    static char raw[65536];
    size_t rn = 0;
    while (kv_engine_busy(g_ref)) {
        if (kv_engine_step(g_ref, &d) < 0) break;
        int32_t t = kv_session_token(s);
        if (t < 0) continue;
        out->n_gen++;
        if (!kv_tok_is_eog(tok, t)) {
            char pb[4096];
            int pn = kv_tok_piece(tok, t, false, pb, sizeof pb);
            if (pn > 0 && rn + (size_t)pn < sizeof raw) {
                memcpy(raw + rn, pb, (size_t)pn);
                rn += (size_t)pn;
            }
        }
        raw[rn] = 0;
        char *hit = stop && *stop ? strstr(raw, stop) : NULL;
        if (hit) {
            rn = (size_t)(hit - raw);
            break;
        }
    }
    out->length = kv_session_stop_reason(s) == KV_STOP_MAX_TOKENS;
    kv_session_free(s);
    out->text[kv_gw_utf8_clean(raw, rn, out->text)] = 0;
}

static kv_sample_params sp_of(float temp, uint64_t seed) {
    kv_sample_params sp = kv_sample_defaults();
    sp.temp = temp;
    sp.seed = seed;
    return sp;
}

static char *chat_body(const char *user, float temp, uint64_t seed, uint32_t max_tokens, bool stream,
                       const char *extra) {
    json_t *j = json_pack("{s:s,s:[{s:s,s:s}],s:f,s:I,s:I,s:b}", "model", "tiny", "messages", "role", "user",
                          "content", user, "temperature", (double)temp, "seed", (json_int_t)seed, "max_tokens",
                          (json_int_t)max_tokens, "stream", stream);
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    if (extra) { /* splice ,"extra" fields before the closing brace */
        size_t l = strlen(s);
        char *t = malloc(l + strlen(extra) + 2);
        memcpy(t, s, l - 1);
        sprintf(t + l - 1, ",%s}", extra);
        free(s);
        s = t;
    }
    return s;
}

/* Concatenated text of an SSE or NDJSON stream; *usage_completion from the
 * last usage seen; returns whether the stream ended properly. */
static bool stream_text(int api, const char *body, char *out, size_t cap, long long *completion, long long *prompt,
                        const char **finish) {
    size_t at = 0;
    bool done = false;
    static char fin[32];
    fin[0] = 0;
    *finish = fin;
    out[0] = 0;
    const char *p = body;
    while (*p) {
        const char *e = strchr(p, '\n');
        size_t l = e ? (size_t)(e - p) : strlen(p);
        char line[70000];
        if (l >= sizeof line) l = sizeof line - 1;
        memcpy(line, p, l);
        line[l] = 0;
        p += l + (e ? 1 : 0);
        const char *data = api == KV_GW_OLLAMA ? line : !strncmp(line, "data: ", 6) ? line + 6 : NULL;
        if (!data || !*data) continue;
        if (!strcmp(data, "[DONE]")) {
            done = true;
            continue;
        }
        json_t *j = parse(data);
        if (!j) return false;
        const char *t = NULL;
        if (api == KV_GW_OPENAI_CHAT) t = jstr(j, "choices.0.delta.content");
        else if (api == KV_GW_OPENAI_TEXT) t = jstr(j, "choices.0.text");
        else if (api == KV_GW_ANTHROPIC) t = jstr(j, "delta.text");
        else t = jstr(j, "message.content");
        if (t && at + strlen(t) < cap) {
            memcpy(out + at, t, strlen(t));
            at += strlen(t);
            out[at] = 0;
        }
        const char *f = api == KV_GW_ANTHROPIC ? jstr(j, "delta.stop_reason") : api == KV_GW_OLLAMA
                                                                                  ? jstr(j, "done_reason")
                                                                                  : jstr(j, "choices.0.finish_reason");
        if (f) snprintf(fin, sizeof fin, "%s", f);
        if (api == KV_GW_ANTHROPIC) {
            const char *ty = jstr(j, "type");
            if (ty && !strcmp(ty, "message_delta")) *completion = jint(j, "usage.output_tokens");
            if (ty && !strcmp(ty, "message_start")) *prompt = jint(j, "message.usage.input_tokens");
            if (ty && !strcmp(ty, "message_stop")) done = true;
        } else if (api == KV_GW_OLLAMA) {
            if (json_is_true(json_object_get(j, "done"))) {
                done = true;
                *completion = jint(j, "eval_count");
                *prompt = jint(j, "prompt_eval_count");
            }
        } else if (json_is_object(json_object_get(j, "usage"))) {
            *completion = jint(j, "usage.completion_tokens");
            *prompt = jint(j, "usage.prompt_tokens");
        }
        json_decref(j);
    }
    return done;
}

/* ---- setup ---------------------------------------------------------------- */

static int setup(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/kvasir-gateway.XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    kv_diag d = {0};
    kv_gen_config c;
    if (kv_gen_preset_get("tiny", &c, &d)) return 1;
    c.n_layer = 2; c.n_embd = 128; c.n_ff_exp = 64; c.n_expert = 8; c.n_expert_used = 2;
    c.n_head = 4; c.n_head_kv = 2; c.head_dim = 32; c.n_vocab = 1024; c.type = KV_TYPE_Q8_0;
    c.n_ctx = N_CTX; c.seed = 7; c.n_threads = 1; c.log = NULL;
    snprintf(g_model, sizeof g_model, "%s/tiny.gguf", g_dir);
    if (kv_gen_model(&c, g_model, &d)) {
        fprintf(stderr, "gen: %s\n", d.msg);
        return 1;
    }
    kv_engine_opts eo = {.n_threads = 2, .max_sessions = 16};
    if (kv_engine_open(&g_eng, g_model, &eo, &d)) return fprintf(stderr, "%s\n", d.msg), 1;
    eo.max_sessions = 1;
    eo.n_threads = 1;
    if (kv_engine_open(&g_ref, g_model, &eo, &d)) return fprintf(stderr, "%s\n", d.msg), 1;
    kv_gateway_opts go = {.port = 0, .model_name = "tiny", .max_active = 16, .queue_max = 64};
    if (kv_gateway_start(&g_gw, g_eng, &go, &d)) return fprintf(stderr, "%s\n", d.msg), 1;
    snprintf(g_base, sizeof g_base, "http://127.0.0.1:%u", kv_gateway_port(g_gw));
    curl_global_init(CURL_GLOBAL_DEFAULT);
    return 0;
}

static void teardown(void) {
    kv_gateway_free(g_gw);
    kv_engine_free(g_eng);
    kv_engine_free(g_ref);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd)) fprintf(stderr, "cannot remove %s\n", g_dir);
}

/* ---- cases ------------------------------------------------------------------ */

static const char *g_prompts[8] = {
    "Hello there", "What is the capital of France?", "Tell me a story about a dragon and a knight.",
    "Write one line.", "Why is the sky blue, and what makes sunsets red?", "List three colors.", "Count to ten.",
    "Translate 'good morning' into German, French and Spanish, please.",
};

static void test_chat_matches_engine(void) {
    ref rf;
    ref_run(g_prompts[1], true, sp_of(0.8f, 42), 40, NULL, &rf);
    char *b = chat_body(g_prompts[1], 0.8f, 42, 40, false, NULL);
    resp r = {0};
    http(g_base, "/v1/chat/completions", b, NULL, &r);
    ASSERT_EQ(r.status, 200);
    json_t *j = parse(r.body);
    ASSERT_TRUE(j != NULL);
    ASSERT_STREQ(jstr(j, "object"), "chat.completion");
    ASSERT_STREQ(jstr(j, "choices.0.message.role"), "assistant");
    ASSERT_STREQ(jstr(j, "choices.0.message.content"), rf.text);
    ASSERT_EQ(jint(j, "usage.prompt_tokens"), rf.n_prompt);
    ASSERT_EQ(jint(j, "usage.completion_tokens"), rf.n_gen);
    ASSERT_EQ(jint(j, "usage.total_tokens"), rf.n_prompt + rf.n_gen);
    ASSERT_STREQ(jstr(j, "choices.0.finish_reason"), rf.length ? "length" : "stop");
    json_decref(j);
    free(b);
    free(r.body);
}

static void test_chat_stream(void) {
    ref rf;
    ref_run(g_prompts[2], true, sp_of(0.9f, 7), 60, NULL, &rf);
    char *b = chat_body(g_prompts[2], 0.9f, 7, 60, true, "\"stream_options\":{\"include_usage\":true}");
    resp r = {0};
    http(g_base, "/v1/chat/completions", b, NULL, &r);
    ASSERT_EQ(r.status, 200);
    static char text[65536];
    long long comp = -1, prompt = -1;
    const char *fin;
    ASSERT_TRUE(stream_text(KV_GW_OPENAI_CHAT, r.body, text, sizeof text, &comp, &prompt, &fin));
    ASSERT_STREQ(text, rf.text);
    ASSERT_EQ(comp, rf.n_gen);
    ASSERT_EQ(prompt, rf.n_prompt);
    ASSERT_STREQ(fin, rf.length ? "length" : "stop");
    ASSERT_TRUE(strstr(r.body, "data: [DONE]\n\n") != NULL);
    free(b);
    free(r.body);
}

static void test_completions(void) {
    ref rf;
    ref_run("Once upon a time", false, sp_of(0.0f, 1), 30, NULL, &rf);
    resp r = {0};
    http(g_base, "/v1/completions",
         "{\"model\":\"tiny\",\"prompt\":\"Once upon a time\",\"temperature\":0,\"max_tokens\":30}", NULL, &r);
    ASSERT_EQ(r.status, 200);
    json_t *j = parse(r.body);
    ASSERT_STREQ(jstr(j, "object"), "text_completion");
    ASSERT_STREQ(jstr(j, "choices.0.text"), rf.text);
    ASSERT_EQ(jint(j, "usage.completion_tokens"), rf.n_gen);
    ASSERT_EQ(jint(j, "usage.prompt_tokens"), rf.n_prompt);
    json_decref(j);
    free(r.body);
    resp s = {0};
    http(g_base, "/v1/completions",
         "{\"model\":\"tiny\",\"prompt\":\"Once upon a time\",\"temperature\":0,\"max_tokens\":30,\"stream\":true}",
         NULL, &s);
    static char text[65536];
    long long comp = -1, prompt = -1;
    const char *fin;
    ASSERT_TRUE(stream_text(KV_GW_OPENAI_TEXT, s.body, text, sizeof text, &comp, &prompt, &fin));
    ASSERT_STREQ(text, rf.text);
    free(s.body);
}

/* A stop string that spans tokens in the reference text: the gateway's text
 * ends just before it, whole and streamed, finish_reason "stop". */
static void test_stop_strings(void) {
    ref full;
    ref_run(g_prompts[4], true, sp_of(0.7f, 99), 80, NULL, &full);
    size_t L = strlen(full.text);
    ASSERT_TRUE(L > 20);
    if (L <= 20) return;
    char stop[8];
    memcpy(stop, full.text + L / 2, 3); /* 3 bytes from the middle: crosses a token boundary or not */
    stop[3] = 0;
    /* avoid cutting a UTF-8 sequence: shift to an ASCII start */
    for (size_t k = L / 2; k + 3 < L; k++)
        if ((unsigned char)full.text[k] < 0x80 && (unsigned char)full.text[k + 1] < 0x80 &&
            (unsigned char)full.text[k + 2] < 0x80) {
            memcpy(stop, full.text + k, 3);
            break;
        }
    ref rf;
    ref_run(g_prompts[4], true, sp_of(0.7f, 99), 80, stop, &rf);
    ASSERT_TRUE(strlen(rf.text) < L);
    json_t *sj = json_string(stop);
    char *sd = json_dumps(sj, JSON_ENCODE_ANY);
    json_decref(sj);
    char extra[128];
    snprintf(extra, sizeof extra, "\"stop\":[\"zzzzqq\",%s]", sd);
    for (int stream = 0; stream < 2; stream++) {
        char *b = chat_body(g_prompts[4], 0.7f, 99, 80, stream, extra);
        resp r = {0};
        http(g_base, "/v1/chat/completions", b, NULL, &r);
        ASSERT_EQ(r.status, 200);
        if (stream) {
            static char text[65536];
            long long comp = -1, prompt = -1;
            const char *fin;
            ASSERT_TRUE(stream_text(KV_GW_OPENAI_CHAT, r.body, text, sizeof text, &comp, &prompt, &fin));
            ASSERT_STREQ(text, rf.text);
            ASSERT_STREQ(fin, "stop");
        } else {
            json_t *j = parse(r.body);
            ASSERT_STREQ(jstr(j, "choices.0.message.content"), rf.text);
            ASSERT_STREQ(jstr(j, "choices.0.finish_reason"), "stop");
            ASSERT_EQ(jint(j, "usage.completion_tokens"), rf.n_gen);
            json_decref(j);
        }
        free(b);
        free(r.body);
    }
    free(sd);
}

static long long metric(const char *name);

typedef struct conc {
    int i;
    resp r;
    char *body;
} conc;

static void *conc_main(void *a) {
    conc *c = a;
    http(g_base, "/v1/chat/completions", c->body, NULL, &c->r);
    return NULL;
}

static uint32_t conc_len(int i) { return 8 + 23 * (uint32_t)i; }

/* 8 concurrent requests of different prompts and lengths (half streamed):
 * each text and count equals the same request run alone in the engine. */
static void test_concurrent_8_identical(void) {
    conc c[8];
    pthread_t th[8];
    /* admission held until all 8 wait, so they surely share steps */
    kv_gateway_hold(g_gw, true);
    for (int i = 0; i < 8; i++) {
        c[i] = (conc){.i = i};
        c[i].body = chat_body(g_prompts[i], 0.8f, 1000 + (uint64_t)i, conc_len(i), i % 2,
                              i % 2 ? "\"stream_options\":{\"include_usage\":true}" : NULL);
        pthread_create(&th[i], NULL, conc_main, &c[i]);
    }
    kv_gateway_stats st = {0};
    for (int k = 0; k < 4000; k++) {
        kv_gateway_get_stats(g_gw, &st);
        if (st.queued == 8) break;
        usleep(2000);
    }
    ASSERT_EQ(st.queued, 8);
    kv_gateway_hold(g_gw, false);
    for (int i = 0; i < 8; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 8; i++) {
        ref rf;
        ref_run(g_prompts[i], true, sp_of(0.8f, 1000 + (uint64_t)i), conc_len(i), NULL, &rf);
        ASSERT_EQ(c[i].r.status, 200);
        static char text[65536];
        long long comp = -1, prompt = -1;
        if (i % 2) {
            const char *fin;
            ASSERT_TRUE(stream_text(KV_GW_OPENAI_CHAT, c[i].r.body, text, sizeof text, &comp, &prompt, &fin));
        } else {
            json_t *j = parse(c[i].r.body);
            const char *t = jstr(j, "choices.0.message.content");
            snprintf(text, sizeof text, "%s", t ? t : "(none)");
            comp = jint(j, "usage.completion_tokens");
            json_decref(j);
        }
        if (strcmp(text, rf.text)) KVT_FAIL("request %d: text differs from the engine alone", i);
        kvt_checks++;
        ASSERT_EQ(comp, rf.n_gen);
        free(c[i].body);
        free(c[i].r.body);
    }
    /* and the batch really held them all: some step carried 8 sessions */
    ASSERT_EQ(metric("kvasir_gateway_max_batch_sessions"), 8);
}

static long long metric(const char *name) {
    resp r = {0};
    http(g_base, "/metrics", NULL, NULL, &r);
    long long v = -1;
    char key[128];
    snprintf(key, sizeof key, "\n%s ", name);
    const char *p = strstr(r.body, key);
    if (p) v = atoll(p + strlen(key));
    free(r.body);
    return v;
}

static long long slots_active(void) {
    resp r = {0};
    http(g_base, "/v1/slots", NULL, NULL, &r);
    json_t *j = parse(r.body);
    long long a = jint(j, "active") + jint(j, "queued");
    json_decref(j);
    free(r.body);
    return a;
}

/* A client that hangs up mid-stream: its session is freed (slots empty,
 * cancelled_total counts it) long before its max_tokens would end it. */
static void test_disconnect_frees_session(void) {
    const long long before = metric("kvasir_gateway_cancelled_total");
    const long long toks_before = metric("kvasir_gateway_generated_tokens_total");
    const uint32_t max_tokens = N_CTX - 64; /* ignore_eos: it would run all of them */
    char *b = chat_body(g_prompts[0], 1.0f, 3, max_tokens, true, "\"ignore_eos\":true");
    resp r = {.abort_after = 400};
    http(g_base, "/v1/chat/completions", b, NULL, &r);
    ASSERT_TRUE(r.n >= 400);
    ASSERT_TRUE(strstr(r.body, "[DONE]") == NULL);
    long long a = 1;
    for (int k = 0; k < 2000 && (a = slots_active()) != 0; k++) usleep(5000);
    ASSERT_EQ(a, 0);
    ASSERT_EQ(metric("kvasir_gateway_cancelled_total"), before + 1);
    ASSERT_TRUE(metric("kvasir_gateway_generated_tokens_total") - toks_before < max_tokens);
    free(b);
    free(r.body);
}

/* The same for a request still queued (admission held): deterministic, as
 * nothing can finish it before the hang-up is seen. */
static void test_disconnect_while_queued(void) {
    kv_diag d = {0};
    kv_engine *e = NULL;
    kv_engine_opts eo = {.n_threads = 1, .max_sessions = 1};
    ASSERT_EQ(kv_engine_open(&e, g_model, &eo, &d), 0);
    kv_gateway *g = NULL;
    kv_gateway_opts go = {.model_name = "tiny", .hold = true};
    ASSERT_EQ(kv_gateway_start(&g, e, &go, &d), 0);
    if (!g) return;
    char base[64];
    snprintf(base, sizeof base, "http://127.0.0.1:%u", kv_gateway_port(g));
    resp r = {.abort_after = 10}; /* the role chunk comes before any token */
    http(base, "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stream\":true}",
         NULL, &r);
    ASSERT_TRUE(r.n >= 10);
    kv_gateway_stats st = {0};
    for (int k = 0; k < 4000; k++) {
        kv_gateway_get_stats(g, &st);
        if (st.cancelled == 1 && st.queued == 0) break;
        usleep(2000);
    }
    ASSERT_EQ(st.cancelled, 1);
    ASSERT_EQ(st.queued, 0);
    free(r.body);
    kv_gateway_free(g);
    kv_engine_free(e);
}

static void expect_err(const char *path, const char *body, const char *const *hdr, long status, int api,
                       const char *needle) {
    resp r = {0};
    http(g_base, path, body, hdr, &r);
    if (r.status != status) KVT_FAIL("%s %s: status %ld, expected %ld (%s)", path, body ? body : "", r.status, status, r.body);
    kvt_checks++;
    json_t *j = parse(r.body);
    const char *msg = api == KV_GW_ANTHROPIC ? jstr(j, "error.message") : api == KV_GW_OLLAMA ? jstr(j, "error")
                                                                                               : jstr(j, "error.message");
    if (!msg) KVT_FAIL("%s: no error message in the API's shape: %s", path, r.body);
    kvt_checks++;
    if (api == KV_GW_ANTHROPIC) ASSERT_STREQ(jstr(j, "type"), "error");
    if (needle && msg && !strstr(msg, needle)) KVT_FAIL("%s: '%s' does not name '%s'", path, msg, needle);
    kvt_checks++;
    json_decref(j);
    free(r.body);
}

static void test_errors(void) {
    /* a prompt longer than the context: 400 naming both counts */
    size_t big = 3 * N_CTX;
    char *long_prompt = malloc(big * 6 + 200);
    strcpy(long_prompt, "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"");
    for (size_t i = 0; i < big; i++) strcat(long_prompt, " zq7x");
    strcat(long_prompt, "\"}]}");
    resp r = {0};
    http(g_base, "/v1/chat/completions", long_prompt, NULL, &r);
    ASSERT_EQ(r.status, 400);
    json_t *j = parse(r.body);
    const char *msg = jstr(j, "error.message");
    ASSERT_TRUE(msg && strstr(msg, "2048") && strstr(msg, "tokens"));
    long long n_tok = msg ? atoll(strstr(msg, "has ") ? strstr(msg, "has ") + 4 : "0") : 0;
    ASSERT_TRUE(n_tok > N_CTX);
    json_decref(j);
    free(r.body);
    free(long_prompt);
    expect_err("/v1/chat/completions", "{\"model\":\"nope\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", NULL,
               404, KV_GW_OPENAI_CHAT, "nope");
    expect_err("/v1/messages", "{\"model\":\"nope\",\"max_tokens\":5,\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}",
               NULL, 404, KV_GW_ANTHROPIC, "nope");
    expect_err("/api/chat", "{\"model\":\"nope\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", NULL, 404,
               KV_GW_OLLAMA, "nope");
    expect_err("/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",", NULL, 400, KV_GW_OPENAI_CHAT, "JSON");
    expect_err("/v1/messages", "[1,2]", NULL, 400, KV_GW_ANTHROPIC, "object");
    expect_err("/api/chat", "{\"messages\":7}", NULL, 400, KV_GW_OLLAMA, "messages");
    expect_err("/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"temperature\":\"hot\"}",
               NULL, 400, KV_GW_OPENAI_CHAT, "temperature");
    expect_err("/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":0}", NULL,
               400, KV_GW_OPENAI_CHAT, "max_tokens");
    expect_err("/v1/chat/completions", "{\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}", NULL, 400,
               KV_GW_OPENAI_CHAT, "wizard");
    expect_err("/v1/messages", "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", NULL, 400,
               KV_GW_ANTHROPIC, "max_tokens");
    expect_err("/v1/chat/completions", "{\"messages\":[],\"messages\":[]}", NULL, 400, KV_GW_OPENAI_CHAT, NULL);
    expect_err("/v1/nothing", "{}", NULL, 404, KV_GW_OPENAI_CHAT, "nothing");
    /* a body over the limit: 413, and the gateway still serves */
    char *huge = malloc((2u << 20) + 64);
    memset(huge, ' ', 2u << 20);
    strcpy(huge + (2u << 20), "{}");
    expect_err("/v1/chat/completions", huge, NULL, 413, KV_GW_OPENAI_CHAT, "larger");
    free(huge);
    resp h = {0};
    http(g_base, "/health", NULL, NULL, &h);
    ASSERT_EQ(h.status, 200);
    free(h.body);
}

static void test_api_keys(void) {
    kv_diag d = {0};
    const char *keys[] = {"sk-one", "sk-two"};
    kv_gateway *g = NULL;
    kv_gateway_opts go = {.model_name = "tiny", .api_keys = keys, .n_api_keys = 2};
    /* a second gateway over a separate engine: each engine has one owner */
    kv_engine *e = NULL;
    kv_engine_opts eo = {.n_threads = 1, .max_sessions = 2};
    ASSERT_EQ(kv_engine_open(&e, g_model, &eo, &d), 0);
    ASSERT_EQ(kv_gateway_start(&g, e, &go, &d), 0);
    if (!g) return;
    char base[64];
    snprintf(base, sizeof base, "http://127.0.0.1:%u", kv_gateway_port(g));
    const char *body = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":3}";
    const char *an = "{\"model\":\"tiny\",\"max_tokens\":3,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}";
    const char *bad[] = {"Authorization: Bearer sk-three", NULL};
    const char *good[] = {"Authorization: Bearer sk-two", NULL};
    const char *xgood[] = {"x-api-key: sk-one", NULL};
    const char *xbad[] = {"x-api-key: sk-on", NULL};
    struct { const char *path, *body; const char *const *h; long st; } t[] = {
        {"/v1/chat/completions", body, NULL, 401}, {"/v1/chat/completions", body, bad, 401},
        {"/v1/chat/completions", body, good, 200}, {"/v1/messages", an, xgood, 200},
        {"/v1/messages", an, xbad, 401},           {"/v1/models", NULL, NULL, 401},
        {"/v1/models", NULL, good, 200},           {"/health", NULL, NULL, 200},
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        resp r = {0};
        http(base, t[i].path, t[i].body, t[i].h, &r);
        if (r.status != t[i].st) KVT_FAIL("keys case %zu (%s): %ld, expected %ld", i, t[i].path, r.status, t[i].st);
        kvt_checks++;
        if (t[i].st == 401) {
            json_t *j = parse(r.body);
            if (!strcmp(t[i].path, "/v1/messages")) ASSERT_STREQ(jstr(j, "error.type"), "authentication_error");
            else ASSERT_STREQ(jstr(j, "error.code"), "invalid_api_key");
            json_decref(j);
        }
        free(r.body);
    }
    kv_gateway_free(g);
    kv_engine_free(e);
}

typedef struct qreq {
    const char *base;
    resp r;
} qreq;
static void *q_main(void *a) {
    qreq *q = a;
    http(q->base, "/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"queued\"}],\"max_tokens\":4,\"temperature\":0}", NULL, &q->r);
    return NULL;
}

/* Admission held, queue of 2: two requests wait, the third is a 503 with
 * Retry-After in the API's shape; released, both waiting ones complete. */
static void test_queue_full_503(void) {
    kv_diag d = {0};
    kv_engine *e = NULL;
    kv_engine_opts eo = {.n_threads = 1, .max_sessions = 2};
    ASSERT_EQ(kv_engine_open(&e, g_model, &eo, &d), 0);
    kv_gateway *g = NULL;
    kv_gateway_opts go = {.model_name = "tiny", .queue_max = 2, .max_active = 1, .hold = true};
    ASSERT_EQ(kv_gateway_start(&g, e, &go, &d), 0);
    if (!g) return;
    char base[64];
    snprintf(base, sizeof base, "http://127.0.0.1:%u", kv_gateway_port(g));
    qreq q[2] = {{.base = base}, {.base = base}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, q_main, &q[i]);
    kv_gateway_stats st = {0};
    for (int k = 0; k < 4000; k++) {
        kv_gateway_get_stats(g, &st);
        if (st.queued == 2) break;
        usleep(2000);
    }
    ASSERT_EQ(st.queued, 2);
    resp sl = {0};
    http(base, "/v1/slots", NULL, NULL, &sl);
    json_t *sj = parse(sl.body);
    ASSERT_EQ(jint(sj, "queued"), 2);
    ASSERT_EQ(json_array_size(json_object_get(sj, "slots")), 2);
    ASSERT_STREQ(jstr(sj, "slots.0.state"), "queued");
    ASSERT_STREQ(jstr(sj, "slots.1.api"), "openai_chat");
    json_decref(sj);
    free(sl.body);
    const char *paths[3] = {"/v1/chat/completions", "/v1/messages", "/api/chat"};
    const char *bodies[3] = {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}",
                             "{\"model\":\"tiny\",\"max_tokens\":2,\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}",
                             "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}"};
    for (int a = 0; a < 3; a++) {
        resp r = {0};
        http(base, paths[a], bodies[a], NULL, &r);
        ASSERT_EQ(r.status, 503);
        ASSERT_STREQ(r.retry_after, "1");
        json_t *j = parse(r.body);
        if (a == 1) ASSERT_STREQ(jstr(j, "error.type"), "overloaded_error");
        else if (a == 2) ASSERT_TRUE(jstr(j, "error") != NULL);
        else ASSERT_TRUE(jstr(j, "error.message") != NULL);
        json_decref(j);
        free(r.body);
    }
    kv_gateway_hold(g, false);
    for (int i = 0; i < 2; i++) {
        pthread_join(th[i], NULL);
        ASSERT_EQ(q[i].r.status, 200);
        free(q[i].r.body);
    }
    kv_gateway_get_stats(g, &st);
    ASSERT_EQ(st.rejected_full, 3);
    kv_gateway_free(g);
    kv_engine_free(e);
}

static void test_anthropic(void) {
    ref rf;
    ref_run(g_prompts[5], true, sp_of(0.6f, 5), 25, NULL, &rf);
    const char *body = "{\"model\":\"tiny\",\"max_tokens\":25,\"temperature\":0.6,\"seed\":5,"
                       "\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"List three colors.\"}]}]";
    char b[512];
    snprintf(b, sizeof b, "%s}", body);
    resp r = {0};
    http(g_base, "/v1/messages", b, NULL, &r);
    ASSERT_EQ(r.status, 200);
    json_t *j = parse(r.body);
    ASSERT_STREQ(jstr(j, "type"), "message");
    ASSERT_STREQ(jstr(j, "content.0.type"), "text");
    ASSERT_STREQ(jstr(j, "content.0.text"), rf.text);
    ASSERT_STREQ(jstr(j, "stop_reason"), rf.length ? "max_tokens" : "end_turn");
    ASSERT_EQ(jint(j, "usage.input_tokens"), rf.n_prompt);
    ASSERT_EQ(jint(j, "usage.output_tokens"), rf.n_gen);
    json_decref(j);
    free(r.body);
    snprintf(b, sizeof b, "%s,\"stream\":true}", body);
    resp s = {0};
    http(g_base, "/v1/messages", b, NULL, &s);
    ASSERT_EQ(s.status, 200);
    static char text[65536];
    long long comp = -1, prompt = -1;
    const char *fin;
    ASSERT_TRUE(stream_text(KV_GW_ANTHROPIC, s.body, text, sizeof text, &comp, &prompt, &fin));
    ASSERT_STREQ(text, rf.text);
    ASSERT_EQ(comp, rf.n_gen);
    ASSERT_EQ(prompt, rf.n_prompt);
    ASSERT_TRUE(strstr(s.body, "event: message_start\n") && strstr(s.body, "event: content_block_start\n") &&
                strstr(s.body, "event: content_block_stop\n") && strstr(s.body, "event: message_stop\n"));
    free(s.body);
}

static void test_ollama(void) {
    ref rf;
    ref_run(g_prompts[6], true, sp_of(0.5f, 11), 30, NULL, &rf);
    const char *body = "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"Count to ten.\"}],"
                       "\"options\":{\"temperature\":0.5,\"seed\":11,\"num_predict\":30}";
    char b[512];
    snprintf(b, sizeof b, "%s,\"stream\":false}", body);
    resp r = {0};
    http(g_base, "/api/chat", b, NULL, &r);
    ASSERT_EQ(r.status, 200);
    json_t *j = parse(r.body);
    ASSERT_STREQ(jstr(j, "message.content"), rf.text);
    ASSERT_TRUE(json_is_true(json_object_get(j, "done")));
    ASSERT_EQ(jint(j, "eval_count"), rf.n_gen);
    ASSERT_EQ(jint(j, "prompt_eval_count"), rf.n_prompt);
    json_decref(j);
    free(r.body);
    snprintf(b, sizeof b, "%s}", body); /* streams by default */
    resp s = {0};
    http(g_base, "/api/chat", b, NULL, &s);
    ASSERT_EQ(s.status, 200);
    static char text[65536];
    long long comp = -1, prompt = -1;
    const char *fin;
    ASSERT_TRUE(stream_text(KV_GW_OLLAMA, s.body, text, sizeof text, &comp, &prompt, &fin));
    ASSERT_STREQ(text, rf.text);
    ASSERT_EQ(comp, rf.n_gen);
    free(s.body);
    resp t = {0};
    http(g_base, "/api/tags", NULL, NULL, &t);
    ASSERT_EQ(t.status, 200);
    j = parse(t.body);
    ASSERT_STREQ(jstr(j, "models.0.name"), "tiny");
    json_decref(j);
    free(t.body);
}

/* /health, /v1/models, /v1/slots, and /metrics as Prometheus text: every
 * sample line "name{labels} value" of a family declared by # TYPE, histogram
 * buckets cumulative and ending at +Inf = _count. */
static void test_health_models_metrics(void) {
    resp h = {0}, m = {0}, s = {0}, x = {0};
    http(g_base, "/health", NULL, NULL, &h);
    ASSERT_EQ(h.status, 200);
    http(g_base, "/v1/models", NULL, NULL, &m);
    json_t *j = parse(m.body);
    ASSERT_STREQ(jstr(j, "data.0.id"), "tiny");
    ASSERT_STREQ(jstr(j, "object"), "list");
    json_decref(j);
    http(g_base, "/v1/slots", NULL, NULL, &s);
    j = parse(s.body);
    ASSERT_TRUE(json_is_array(json_object_get(j, "slots")));
    ASSERT_EQ(jint(j, "max_active"), 16);
    json_decref(j);
    http(g_base, "/metrics", NULL, NULL, &x);
    ASSERT_EQ(x.status, 200);
    char types[64][96];
    int n_types = 0, n_samples = 0, bad = 0;
    long long last_bucket = -1, inf = -1, count = -2;
    for (char *line = strtok(x.body, "\n"); line; line = strtok(NULL, "\n")) {
        if (!strncmp(line, "# TYPE ", 7)) {
            char name[96], ty[32];
            if (sscanf(line + 7, "%95s %31s", name, ty) != 2) bad++;
            else if (n_types < 64) snprintf(types[n_types++], 96, "%s", name);
            if (strcmp(ty, "counter") && strcmp(ty, "gauge") && strcmp(ty, "histogram")) bad++;
            continue;
        }
        if (!strncmp(line, "# HELP ", 7)) continue;
        if (line[0] == '#') { bad++; continue; }
        char name[128];
        size_t k = strspn(line, "abcdefghijklmnopqrstuvwxyz_0123456789");
        if (k == 0 || k >= sizeof name) { bad++; continue; }
        memcpy(name, line, k);
        name[k] = 0;
        const char *rest = line + k;
        if (*rest == '{') {
            const char *e = strchr(rest, '}');
            if (!e) { bad++; continue; }
            rest = e + 1;
        }
        char *end;
        if (*rest != ' ') { bad++; continue; }
        double v = strtod(rest + 1, &end);
        if (*end) { bad++; continue; }
        int fam = 0;
        for (int t = 0; t < n_types; t++) {
            size_t tl = strlen(types[t]);
            if (!strncmp(name, types[t], tl) && (!name[tl] || !strcmp(name + tl, "_bucket") ||
                                                 !strcmp(name + tl, "_sum") || !strcmp(name + tl, "_count")))
                fam = 1;
        }
        if (!fam) bad++;
        n_samples++;
        if (!strcmp(name, "kvasir_gateway_step_seconds_bucket")) {
            if ((long long)v < last_bucket) bad++;
            last_bucket = (long long)v;
            if (strstr(line, "le=\"+Inf\"")) inf = (long long)v;
        }
        if (!strcmp(name, "kvasir_gateway_step_seconds_count")) count = (long long)v;
    }
    ASSERT_EQ(bad, 0);
    ASSERT_TRUE(n_samples >= 10);
    ASSERT_EQ(inf, count);
    ASSERT_TRUE(count > 0);
    free(h.body);
    free(m.body);
    free(s.body);
    free(x.body);
}

/* The chat template over a message list: ids equal the rendered string
 * tokenized with special tokens parsed; two messages equal kv_tok_chatml. */
static void test_chatml_messages(void) {
    const kv_tok *tok = kv_model_tok(kv_engine_model(g_ref));
    const kv_chat_msg m[4] = {{"system", "Be brief.", 9}, {"user", "Hi there", 8}, {"assistant", "Hello!", 6},
                              {"user", "How are you?", 12}};
    char *s = kv_tok_chatml_msgs(m, 4, true);
    ASSERT_STREQ(s, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n"
                    "<|im_start|>assistant\n");
    int32_t a[512], b[512];
    size_t na = 0, nb = 0;
    kv_diag d = {0};
    ASSERT_EQ(kv_tok_encode(tok, s, strlen(s), true, a, 512, &na, &d), 0);
    ASSERT_EQ(kv_tok_encode_chatml(tok, m, 4, true, b, 512, &nb, &d), 0);
    ASSERT_EQ(na, nb);
    ASSERT_TRUE(na == nb && !memcmp(a, b, na * sizeof *a));
    free(s);
    char *one = kv_tok_chatml("Be brief.", "Hi there"), *two = kv_tok_chatml_msgs(m, 2, true);
    ASSERT_STREQ(one, two);
    free(one);
    free(two);
    /* special texts inside content stay text */
    const kv_chat_msg inj = {"user", "<|im_end|>", 10};
    ASSERT_EQ(kv_tok_encode_chatml(tok, &inj, 1, false, b, 512, &nb, &d), 0);
    int n_end = 0;
    for (size_t i = 0; i < nb; i++) n_end += b[i] == kv_tok_find(tok, "<|im_end|>");
    ASSERT_EQ(n_end, 1);
    const kv_chat_msg badrole = {"root", "x", 1};
    ASSERT_EQ(kv_tok_encode_chatml(tok, &badrole, 1, true, b, 512, &nb, &d), KV_EINVAL);
}

/* Incremental text against the naive reference: any split of the bytes
 * into pieces gives, concatenated, the whole text cut at the first stop
 * string, and no chunk ends inside a UTF-8 character. */
static void test_text_incremental(void) {
    const char *full = "ab\xc3\xa9 caf\xe2\x82\xac STOPx more \xf0\x9f\x98\x80 end";
    const char *stops[2] = {"OPx", "zz"};
    const size_t sl[2] = {3, 2};
    const size_t L = strlen(full);
    const char *cut = strstr(full, "OPx");
    char want[128];
    want[kv_gw_utf8_clean(full, (size_t)(cut - full), want)] = 0;
    for (size_t step = 1; step <= 5; step++) {
        kv_gw_text t;
        kv_gw_text_init(&t, stops, sl, 2);
        char got[256] = "";
        size_t gn = 0;
        bool partial = false;
        for (size_t i = 0; i < L && !t.stopped; i += step) {
            size_t k = i + step <= L ? step : L - i;
            ASSERT_EQ(kv_gw_text_push(&t, full + i, k), 0);
            char *c;
            size_t n;
            kv_gw_text_take(&t, false, &c, &n);
            if (c) {
                const unsigned char last = (unsigned char)c[n - 1];
                if (last >= 0xc0) partial = true;
                memcpy(got + gn, c, n);
                gn += n;
                free(c);
            }
        }
        char *c;
        size_t n;
        kv_gw_text_take(&t, true, &c, &n);
        if (c) {
            memcpy(got + gn, c, n);
            gn += n;
            free(c);
        }
        got[gn] = 0;
        ASSERT_STREQ(got, want);
        ASSERT_TRUE(!partial);
        ASSERT_TRUE(t.stopped);
        ASSERT_EQ(t.stop_index, 0);
        kv_gw_text_free(&t);
    }
    /* a body parser bound: too many stop strings */
    kv_gw_params p;
    kv_diag d = {0};
    const char *b = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\",\"f\",\"g\",\"h\",\"i\"]}";
    ASSERT_EQ(kv_gw_parse(&p, KV_GW_OPENAI_CHAT, b, strlen(b), &d), KV_ERANGE);
    kv_gw_params_free(&p);
}


/* Feeds full[0..L) to a fresh kv_gw_text in pieces of the lengths that
 * next_len yields, taking a chunk after each piece and the rest at the end,
 * and returns the concatenation (NUL-terminated, in got of room cap); every
 * chunk must already be valid UTF-8 (cleaning it changes nothing). */
static size_t text_feed(const char *full, size_t L, const char *const *stops, const size_t *sl, uint32_t n_stop,
                        uint64_t *rng, size_t max_piece, char *got, size_t cap, bool *stopped, int *stop_index) {
    kv_gw_text t;
    kv_gw_text_init(&t, stops, sl, n_stop);
    size_t gn = 0;
    bool ok = true;
    for (size_t i = 0; i <= L; ) {
        const bool end = i == L;
        size_t k = 0;
        if (!end) {
            *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
            k = 1 + (size_t)(*rng >> 33) % max_piece;
            if (k > L - i) k = L - i;
            ASSERT_EQ(kv_gw_text_push(&t, full + i, k), 0);
        }
        char *c = NULL;
        size_t n = 0;
        ASSERT_EQ(kv_gw_text_take(&t, end || t.stopped, &c, &n), 0);
        if (c) {
            char *cc = malloc(3 * n + 1);
            ok &= kv_gw_utf8_clean(c, n, cc) == n && !memcmp(cc, c, n);
            free(cc);
            if (gn + n < cap) memcpy(got + gn, c, n);
            gn += n;
            free(c);
        }
        if (end || t.stopped) break;
        i += k;
    }
    ASSERT_TRUE(ok);
    ASSERT_TRUE(gn < cap);
    got[gn < cap ? gn : cap - 1] = 0;
    *stopped = t.stopped;
    *stop_index = t.stop_index;
    kv_gw_text_free(&t);
    return gn;
}

/* Stop strings match on the text as the client sees it: the generated bytes
 * with every invalid byte, and an incomplete sequence at the end, shown as
 * U+FFFD. Before, they were matched on the raw bytes, so a stop string
 * holding U+FFFD never matched where a byte-level token stream showed one.
 * Fixed cases, then random byte strings of UTF-8 fragments cut into random
 * pieces against the reference (clean the whole text once, find the stop
 * string in it, cut there). KV_ATTACK_FULL=1 runs many more. */
static void test_text_stop_fffd(void) {
    static const struct { const char *full, *stop, *want; } fx[] = {
        {"ab\xe2\x82Xyz", "\xef\xbf\xbdX", "ab\xef\xbf\xbd"},   /* a character cut short, then more text */
        {"a\xff" "b c", "\xef\xbf\xbd" "b", "a"},                 /* an invalid byte */
        {"hi \xf0\x9f\x98", " \xef\xbf\xbd", "hi"},               /* the generation ends inside a character */
        {"x\xe2\x82\xac y", "\xe2\x82\xac y", "x"},               /* whole characters still match */
        {"x\xef\xbf\xbd!", "\xef\xbf\xbd!", "x"},                 /* a real U+FFFD too */
        {"caf\xc3", "\xef\xbf\xbd", "caf"},                       /* only at the end */
    };
    for (size_t f = 0; f < sizeof fx / sizeof fx[0]; f++)
        for (size_t step = 1; step <= 6; step++) {
            const char *stops[2] = {"zzq", fx[f].stop};
            const size_t sl[2] = {3, strlen(fx[f].stop)};
            uint64_t rng = step;
            char got[256];
            bool stopped = false;
            int si = -1;
            text_feed(fx[f].full, strlen(fx[f].full), stops, sl, 2, &rng, step, got, sizeof got, &stopped, &si);
            if (strcmp(got, fx[f].want)) KVT_FAIL("case %zu step %zu: got \"%s\", want \"%s\"", f, step, got, fx[f].want);
            ASSERT_TRUE(stopped);
            ASSERT_EQ(si, 1);
        }
    /* random: fragments of characters, invalid bytes, ASCII */
    static const char *const frag[] = {"a", "b", " ", "\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x98\x80", "\xe2\x82",
                                       "\xf0\x9f", "\xc3", "\x80", "\xff", "\xed\xa0\x80", "\xef\xbf\xbd", "\xc0\xaf"};
    const int rounds = getenv("KV_ATTACK_FULL") ? 200000 : 3000;
    uint64_t rng = 12345;
    int mismatched = 0, with_fffd = 0;
    for (int r = 0; r < rounds; r++) {
        char full[256];
        size_t L = 0;
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        const int nf = 1 + (int)((rng >> 33) % 24);
        for (int i = 0; i < nf; i++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            const char *x = frag[(rng >> 33) % (sizeof frag / sizeof frag[0])];
            memcpy(full + L, x, strlen(x));
            L += strlen(x);
        }
        char clean[800];
        const size_t cn = kv_gw_utf8_clean(full, L, clean);
        clean[cn] = 0;
        /* the stop string: a run of whole characters of the clean text,
           around a U+FFFD when there is one */
        const char *fffd = strstr(clean, "\xef\xbf\xbd");
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        size_t a = fffd ? (size_t)(fffd - clean) : (size_t)((rng >> 33) % cn);
        while (a > 0 && ((unsigned char)clean[a] & 0xc0) == 0x80) a--;
        if (a > 0 && (rng >> 40) % 2) /* maybe one character earlier */
            for (a--; a > 0 && ((unsigned char)clean[a] & 0xc0) == 0x80;) a--;
        size_t b = a + 1 + (size_t)((rng >> 20) % 6);
        if (b > cn) b = cn;
        while (b < cn && ((unsigned char)clean[b] & 0xc0) == 0x80) b++;
        char stop[64];
        if (b - a >= sizeof stop) b = a + 1;
        memcpy(stop, clean + a, b - a);
        stop[b - a] = 0;
        with_fffd += strstr(stop, "\xef\xbf\xbd") != NULL;
        const char *stops[2] = {"\x01\x02", stop};
        const size_t sl[2] = {2, b - a};
        char want[800];
        const char *hit = strstr(clean, stop);
        KV_ASSERT(hit);
        memcpy(want, clean, (size_t)(hit - clean));
        want[hit - clean] = 0;
        char got[800];
        bool stopped = false;
        int si = -1;
        uint64_t split = rng ^ (uint64_t)r;
        text_feed(full, L, stops, sl, 2, &split, 1 + (size_t)r % 7, got, sizeof got, &stopped, &si);
        if (strcmp(got, want) || !stopped || si != 1) {
            if (mismatched++ < 5) KVT_FAIL("round %d: got \"%s\", want \"%s\" (stop \"%s\")", r, got, want, stop);
        }
    }
    ASSERT_EQ(mismatched, 0);
    ASSERT_TRUE(with_fffd > rounds / 4); /* the case at issue is well represented */
}

/* ---- through a worker ------------------------------------------------------ */

static uint16_t free_port(void) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t l = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || getsockname(fd, (struct sockaddr *)&a, &l)) return 0;
    close(fd);
    return ntohs(a.sin_port);
}

/* The model sliced, its experts on one `kvasir worker`: 8 concurrent
 * requests equal the full model run alone in-process (same bits wherever
 * computed), and the worker got exactly one message per MoE layer per step
 * for all of them. Then the worker dies: a request fails with a 500 in
 * the API's shape (never a token from partial results) and /health is 503. */
static void test_worker_batched(void) {
    const char *bin = getenv("KV_BIN");
    ASSERT_TRUE(bin != NULL);
    if (!bin) return;
    kv_diag d = {0};
    char sl[260], co[260], cmd[1200], slabs[2048];
    snprintf(sl, sizeof sl, "%s/sl", g_dir);
    snprintf(co, sizeof co, "%s/coord", g_dir);
    const kv_slice_opts so = {4, -1, -1, 1};
    ASSERT_EQ(kv_slice_model(g_model, sl, &so, NULL, &d), 0);
    mkdir(co, 0755);
    snprintf(cmd, sizeof cmd, "cp '%s/backbone.gguf' '%s/manifest.json' '%s/'", sl, sl, co);
    ASSERT_EQ(system(cmd), 0);
    const kv_hparams *hp = kv_model_hparams(kv_engine_model(g_ref));
    size_t o = 0;
    for (uint32_t l = 0; l < hp->n_layer; l++)
        for (uint32_t h = 0; h < 2; h++)
            o += (size_t)snprintf(slabs + o, sizeof slabs - o, "%s%s/experts/blk.%u.%04u-%04u.gguf", o ? "," : "", sl,
                                  l, 4 * h, 4 * h + 3);
    char addr[32];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", free_port());
    fflush(stdout);
    fflush(stderr);
    const pid_t pid = fork();
    if (pid == 0) {
        FILE *f = freopen("/dev/null", "w", stdout);
        (void)f;
        execl(bin, bin, "worker", "--slabs", slabs, "--listen", addr, "--threads", "1", "--quiet", "--allow-key",
              kvt_coord_hex(), (char *)NULL);
        _exit(127);
    }
    bool up = false;
    for (int i = 0; i < 500 && !up; i++) {
        int fd = -1;
        if (!kv_link_connect(addr, 200, &fd, NULL)) {
            close(fd);
            up = true;
        } else {
            usleep(20000);
        }
    }
    ASSERT_TRUE(up);
    char manifest[300];
    snprintf(manifest, sizeof manifest, "%s/manifest.json", co);
    {
        /* a coordinator with no worker yet (as `gateway --hub` before any
           node): it opens, /health is 503 naming every shard, and the worker
           added later covers them (coverage against the slabs the worker
           serves: every one of the manifest's) */
        kv_engine *e0 = NULL;
        kv_engine_opts eo0 = {.n_threads = 1, .max_sessions = 2, .max_workers = 4, .allow_uncovered = true,
                              .worker_timeout_ms = 5000, .key_sk = kvt_coord_sk()};
        ASSERT_EQ(kv_engine_open(&e0, manifest, &eo0, &d), 0);
        kv_remote *rm = e0 ? kv_engine_remote(e0) : NULL;
        ASSERT_TRUE(rm != NULL);
        if (rm) {
            const uint32_t n_slabs = (uint32_t)kv_remote_manifest(rm)->n_slabs;
            kv_remote_coverage cv;
            uint32_t miss[64];
            kv_remote_get_coverage(rm, &cv, miss, 64);
            ASSERT_EQ(cv.total, n_slabs);
            ASSERT_EQ(cv.covered, 0);
            ASSERT_EQ(cv.n_missing, n_slabs);
            kv_gateway *g0 = NULL;
            kv_gateway_opts go0 = {.model_name = "tiny"};
            ASSERT_EQ(kv_gateway_start(&g0, e0, &go0, &d), 0);
            char b0[64];
            snprintf(b0, sizeof b0, "http://127.0.0.1:%u", g0 ? kv_gateway_port(g0) : 0);
            resp h0 = {0};
            http(b0, "/health", NULL, NULL, &h0);
            ASSERT_EQ(h0.status, 503);
            json_t *hj = parse(h0.body);
            ASSERT_EQ(jint(hj, "shards_covered"), 0);
            ASSERT_EQ(jint(hj, "shards_total"), n_slabs);
            ASSERT_EQ(json_array_size(json_object_get(hj, "missing")), n_slabs);
            json_decref(hj);
            free(h0.body);
            kv_gateway_free(g0); /* the engine is ours again */
            ASSERT_EQ(kv_remote_add_worker(rm, addr, NULL, &d), 1);
            ASSERT_EQ(kv_remote_add_worker(rm, addr, NULL, &d), 0); /* known */
            ASSERT_TRUE(kv_remote_add_worker(rm, "no-such-host.invalid:1", NULL, &d) < 0);
            for (int k = 0; k < 500; k++) {
                kv_remote_tend(rm, 10);
                kv_remote_get_coverage(rm, &cv, miss, 64);
                if (cv.workers_up == 1) break;
            }
            ASSERT_EQ(cv.workers_up, 1);
            ASSERT_EQ(cv.covered, n_slabs);
            ASSERT_EQ(cv.n_missing, 0);
        }
        kv_engine_free(e0);
    }
    const char *workers[1] = {addr};
    kv_engine *e = NULL;
    kv_engine_opts eo = {.n_threads = 1, .max_sessions = 8, .workers = workers, .n_workers = 1,
                         .worker_timeout_ms = 5000, .key_sk = kvt_coord_sk()};
    ASSERT_EQ(kv_engine_open(&e, manifest, &eo, &d), 0);
    kv_gateway *g = NULL;
    kv_gateway_opts go = {.model_name = "tiny", .max_active = 8, .step_retry_ms = 300};
    if (e) ASSERT_EQ(kv_gateway_start(&g, e, &go, &d), 0);
    if (!g) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        kv_engine_free(e);
        return;
    }
    char base[64];
    snprintf(base, sizeof base, "http://127.0.0.1:%u", kv_gateway_port(g));
    resp h = {0};
    http(base, "/health", NULL, NULL, &h);
    ASSERT_EQ(h.status, 200);
    free(h.body);
    conc c[8];
    pthread_t th[8];
    char *saved = strdup(g_base);
    snprintf(g_base, sizeof g_base, "%s", base); /* conc_main posts to g_base */
    kv_gateway_hold(g, true); /* all 8 join the batch together */
    for (int i = 0; i < 8; i++) {
        c[i] = (conc){.i = i};
        c[i].body = chat_body(g_prompts[i], 0.8f, 500 + (uint64_t)i, conc_len(i), i % 2,
                              i % 2 ? "\"stream_options\":{\"include_usage\":true}" : NULL);
        pthread_create(&th[i], NULL, conc_main, &c[i]);
    }
    kv_gateway_stats gst = {0};
    for (int k = 0; k < 4000; k++) {
        kv_gateway_get_stats(g, &gst);
        if (gst.queued == 8) break;
        usleep(2000);
    }
    ASSERT_EQ(gst.queued, 8);
    kv_gateway_hold(g, false);
    for (int i = 0; i < 8; i++) pthread_join(th[i], NULL);
    ASSERT_EQ(metric("kvasir_gateway_max_batch_sessions"), 8);
    for (int i = 0; i < 8; i++) {
        ref rf;
        ref_run(g_prompts[i], true, sp_of(0.8f, 500 + (uint64_t)i), conc_len(i), NULL, &rf);
        ASSERT_EQ(c[i].r.status, 200);
        static char text[65536];
        long long comp = -1, prompt = -1;
        if (i % 2) {
            const char *fin;
            ASSERT_TRUE(stream_text(KV_GW_OPENAI_CHAT, c[i].r.body, text, sizeof text, &comp, &prompt, &fin));
        } else {
            json_t *j = parse(c[i].r.body);
            const char *t = jstr(j, "choices.0.message.content");
            snprintf(text, sizeof text, "%s", t ? t : "(none)");
            comp = jint(j, "usage.completion_tokens");
            json_decref(j);
        }
        if (strcmp(text, rf.text)) KVT_FAIL("worker request %d: text differs from the engine alone", i);
        kvt_checks++;
        ASSERT_EQ(comp, rf.n_gen);
        free(c[i].body);
        free(c[i].r.body);
    }
    /* the worker dies: the next request fails whole, and health says so; a
       model that cannot run is a 503 (retry later), whether the gateway saw
       the worker go before the request (at once) or in its failed step */
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    resp f = {0};
    http(base, "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":4}", NULL, &f);
    ASSERT_EQ(f.status, 503);
    json_t *fj = parse(f.body);
    ASSERT_TRUE(jstr(fj, "error.message") != NULL);
    json_decref(fj);
    free(f.body);
    resp h2 = {0};
    http(base, "/health", NULL, NULL, &h2);
    ASSERT_EQ(h2.status, 503);
    free(h2.body);
    snprintf(g_base, sizeof g_base, "%s", saved);
    free(saved);
    kv_gateway_free(g); /* the engine is ours again: its counters are stable */
    kv_engine_stats es;
    kv_engine_get_stats(e, &es);
    kv_remote_stats rs;
    kv_remote_get_stats(kv_engine_remote(e), &rs);
    kv_remote_worker w;
    kv_remote_worker_info(kv_engine_remote(e), 0, &w);
    /* every successful step: one compute call per MoE layer, each one message
       to the worker for every session in the step (the failed step and its
       retries inside the coordinator, and the gateway's retries of the
       failed step, may add a few per failed step; a gateway stepping sessions one by one would send about
       8 times as many) */
    const uint64_t ok_calls = (es.steps - es.steps_failed) * hp->n_layer - es.steps_headless;
    ASSERT_TRUE(es.max_step_tokens > 1);
    const uint64_t slack = (es.steps_failed + 1) * 2 * hp->n_layer; /* failed steps (retried for step_retry_ms) */
    if (!(rs.calls >= ok_calls && rs.calls <= ok_calls + slack))
        KVT_FAIL("calls %llu, steps %llu (failed %llu), layers %u, worker requests %llu", (unsigned long long)rs.calls, (unsigned long long)es.steps, (unsigned long long)es.steps_failed, hp->n_layer, (unsigned long long)w.requests);
    kvt_checks++;
    ASSERT_TRUE(w.requests >= ok_calls && w.requests <= ok_calls + slack);
    kv_engine_free(e);
}

/* `kvasir gateway` with bad flags: one line on stderr naming the problem,
 * exit 1 for usage and 2 for a failure, and nothing left listening. */
static void test_cli_flags(void) {
    const char *bin = getenv("KV_BIN");
    ASSERT_TRUE(bin != NULL);
    if (!bin) return;
    char keys[300], empty[300];
    snprintf(keys, sizeof keys, "%s/keys.txt", g_dir);
    snprintf(empty, sizeof empty, "%s/empty.txt", g_dir);
    FILE *f = fopen(keys, "w");
    fprintf(f, "# comment\nsk-ok\nbad key with spaces\n");
    fclose(f);
    f = fopen(empty, "w");
    fprintf(f, "# nothing\n\n");
    fclose(f);
    struct { const char *args; int rc; const char *needle; } t[] = {
        {"", 1, "missing -m"},
        {"-m M --listen nonsense", 1, "HOST:PORT"},
        {"-m M --listen 127.0.0.1:99999", 1, "--listen"},
        {"-m M --hub http://x", 1, "--hub"},
        {"--hub http://127.0.0.1:1 --listen 127.0.0.1:0 --data DATA", 2, "127.0.0.1:1"},
        {"-m M --parallel 0", 1, "--parallel"},
        {"-m M --frobnicate", 1, "frobnicate"},
        {"-m /nonexistent.gguf --listen 127.0.0.1:0", 2, "nonexistent"},
        {"-m M --api-keys KEYS", 2, "space"},
        {"-m M --api-keys EMPTY", 1, "no key"},
        {"-m M --listen 999.1.1.1:0", 2, "999.1.1.1"},
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        char args[600], cmd[1600], ef[300];
        /* M, KEYS and EMPTY stand for the paths */
        char *o = args;
        for (const char *a = t[i].args; *a;) {
            if (!strncmp(a, "KEYS", 4)) { o += sprintf(o, "%s", keys); a += 4; }
            else if (!strncmp(a, "DATA", 4)) { o += sprintf(o, "%s/hubdata", g_dir); a += 4; }
            else if (!strncmp(a, "EMPTY", 5)) { o += sprintf(o, "%s", empty); a += 5; }
            else if (a[0] == 'M' && (a[1] == ' ' || !a[1])) { o += sprintf(o, "%s", g_model); a += 1; }
            else *o++ = *a++;
        }
        *o = 0;
        snprintf(ef, sizeof ef, "%s/cli.err", g_dir);
        snprintf(cmd, sizeof cmd, "%s gateway %s >/dev/null 2>%s </dev/null", bin, args, ef);
        int st = system(cmd);
        int rc = WIFEXITED(st) ? WEXITSTATUS(st) : 1000;
        char err[2048] = "";
        FILE *e = fopen(ef, "r");
        if (e) {
            size_t n = fread(err, 1, sizeof err - 1, e);
            err[n] = 0;
            fclose(e);
        }
        int lines = 0;
        for (const char *p = err; *p; p++) lines += *p == '\n';
        if (rc != t[i].rc || lines != 1 || !strstr(err, t[i].needle))
            KVT_FAIL("gateway %s: rc %d (want %d), %d lines: %s", t[i].args, rc, t[i].rc, lines, err);
        kvt_checks++;
    }
}

static const kvt_case cases[] = {
    KVT_CASE(test_chatml_messages),       KVT_CASE(test_text_incremental), KVT_CASE(test_text_stop_fffd), KVT_CASE(test_chat_matches_engine),
    KVT_CASE(test_chat_stream),           KVT_CASE(test_completions),      KVT_CASE(test_stop_strings),
    KVT_CASE(test_concurrent_8_identical), KVT_CASE(test_disconnect_frees_session), KVT_CASE(test_disconnect_while_queued), KVT_CASE(test_errors),
    KVT_CASE(test_api_keys),              KVT_CASE(test_queue_full_503),   KVT_CASE(test_anthropic),
    KVT_CASE(test_ollama),                KVT_CASE(test_health_models_metrics), KVT_CASE(test_worker_batched), KVT_CASE(test_cli_flags),
};

int main(int argc, char **argv) { return kvt_run_with(argc, argv, cases, KVT_N(cases), setup, teardown); }
