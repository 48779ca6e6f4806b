/* libFuzzer target for the gateway's request-body parsers and its
 * incremental text.
 *
 * The first input byte picks the API (OpenAI chat, completions, Anthropic,
 * Ollama); the rest is the body (an exact-size copy, so a read past the end
 * is an ASan error). Whatever parses must satisfy the promised bounds (counts
 * within KV_GW_MAX_*, roles among the three or "tool", sampler values in
 * range), and the ChatML prompt and a chat template's rendering must hold
 * every message's role. The body bytes are
 * also fed, in pieces, to the incremental text with the parsed stop strings:
 * the chunks must be valid UTF-8 and together equal the kept text cleaned
 * as a whole (no boundary splits a character). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/gateway_internal.h"

#define CHECK(x)                    \
    do {                            \
        if (!(x)) __builtin_trap(); \
    } while (0)

static bool utf8_valid(const char *s, size_t n) {
    char *c = malloc(n * 3 + 1);
    size_t k = kv_gw_utf8_clean(s, n, c);
    bool ok = k == n && !memcmp(c, s, n);
    free(c);
    return ok;
}

/* A role-printing template (gen-model's ChatML, as Jinja), parsed once. */
static kv_gw_tmpl *kv_fuzz_tmpl(void) {
    static kv_gw_tmpl *t;
    static const char src[] =
        "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + "
        "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";
    if (!t) kv_gw_tmpl_open(&t, NULL, src, sizeof src - 1, "fuzz", NULL);
    return t;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const int api = data[0] % KV_GW_API_COUNT;
    char *body = malloc(size - 1 ? size - 1 : 1);
    memcpy(body, data + 1, size - 1);
    kv_gw_params *p = calloc(1, sizeof *p);
    kv_diag d = {0};
    if (!kv_gw_parse(p, api, body, size - 1, &d)) {
        CHECK(p->n_msgs <= KV_GW_MAX_MSGS && p->n_stop <= KV_GW_MAX_STOP);
        CHECK(!p->has_max_tokens || (p->max_tokens >= 1 && p->max_tokens <= KV_GW_MAX_TOKENS));
        CHECK(p->sp.temp >= 0 && p->sp.top_p > 0 && p->sp.top_p <= 1 && p->sp.min_p >= 0 && p->sp.min_p <= 1);
        CHECK(p->sp.top_k >= 0);
        /* the sampling fields (samplefields.c) */
        CHECK(p->n_bias <= KV_SAMPLE_MAX_BIAS && p->sp.n_bias == p->n_bias && (!p->n_bias || p->sp.bias == p->bias));
        for (uint32_t i = 0; i < p->n_bias; i++)
            CHECK(p->bias[i].token >= 0 && p->bias[i].bias >= -100.0f && p->bias[i].bias <= 100.0f);
        CHECK(p->sp.presence_penalty >= -2 && p->sp.presence_penalty <= 2);
        CHECK(p->sp.frequency_penalty >= -2 && p->sp.frequency_penalty <= 2);
        CHECK(p->sp.repeat_penalty > 0 && p->sp.repeat_penalty <= 100 && p->sp.repeat_last_n >= 0);
        CHECK(p->top_logprobs <= KV_SAMPLE_MAX_TOP && (p->logprobs || p->top_logprobs == 0));
        CHECK(p->n_choices <= KV_GW_MAX_N &&
              (p->n_choices <= 1 || api == KV_GW_OPENAI_CHAT || api == KV_GW_OPENAI_TEXT));
        CHECK(!p->echo || (api == KV_GW_OPENAI_TEXT && !p->logprobs));
        { /* what parses, the sampler takes (the ids once checked against a vocabulary) */
            bool in_vocab = true;
            for (uint32_t i = 0; i < p->n_bias; i++) in_vocab &= p->bias[i].token < 4096;
            kv_diag sd = {0};
            CHECK((kv_gw_bias_check(p, 4096, &sd) == 0) == in_vocab);
            kv_sampler *smp = NULL;
            if (in_vocab) CHECK(kv_sampler_new_ex(&smp, 4096, &p->sp, false, &sd) == 0);
            kv_sampler_free(smp);
        }
        /* a raw prompt (text or token ids, never both) or messages, never neither */
        if (api == KV_GW_OPENAI_TEXT || api == KV_GW_LLAMA) CHECK(kv_gw_params_raw(p));
        if (kv_gw_params_raw(p)) CHECK(p->n_msgs == 0 && (p->prompt != NULL) != (p->prompt_ids != NULL));
        else CHECK(p->n_msgs >= 1 || api == KV_GW_OLLAMA_GEN); /* /api/generate without a prompt: a load */
        CHECK(!p->prompt_ids || p->n_prompt_ids >= 1);
        for (uint32_t i = 0; i < p->n_stop; i++) CHECK(p->stop_len[i] >= 1 && p->stop_len[i] <= KV_GW_MAX_STOP_LEN);
        if (p->n_msgs && !p->has_tool_role) { /* "tool" is for a chat template; ChatML refuses it */
            char *t = kv_tok_chatml_msgs(p->msgs, p->n_msgs, true);
            CHECK(t != NULL);
            for (size_t i = 0; i < p->n_msgs; i++) CHECK(strstr(t, p->msgs[i].role) != NULL);
            free(t);
        }
        if (p->n_msgs && kv_fuzz_tmpl()) { /* the chat template over the request's context */
            char *t = NULL;
            size_t tn = 0;
            kv_diag td = {0};
            const int rc = kv_gw_tmpl_render(kv_fuzz_tmpl(), p, &t, &tn, &td);
            CHECK(rc == 0 || rc == KV_EFORMAT || rc == KV_ERANGE || rc == KV_ENOMEM);
            if (!rc)
                for (size_t i = 0; i < p->n_msgs; i++) CHECK(memmem(t, tn, p->msgs[i].role, strlen(p->msgs[i].role)));
            free(t);
        }
        /* incremental text over the body bytes, in pieces of 1..7 */
        kv_gw_text tx;
        kv_gw_text_init(&tx, p->stop, p->stop_len, p->n_stop);
        char *got = malloc((size - 1) * 3 + 1);
        size_t gn = 0, step = 1 + (size % 7);
        for (size_t i = 0; i < size - 1 && !tx.stopped; i += step) {
            size_t k = i + step <= size - 1 ? step : size - 1 - i;
            CHECK(kv_gw_text_push(&tx, body + i, k) == 0);
            char *c;
            size_t n;
            CHECK(kv_gw_text_take(&tx, false, &c, &n) == 0);
            if (c) {
                CHECK(utf8_valid(c, n));
                memcpy(got + gn, c, n);
                gn += n;
                free(c);
            }
        }
        char *c;
        size_t n;
        CHECK(kv_gw_text_take(&tx, true, &c, &n) == 0);
        if (c) {
            memcpy(got + gn, c, n);
            gn += n;
            free(c);
        }
        /* the chunks together are the kept text, cleaned as a whole: no
           boundary split a character and nothing was lost or repeated */
        got[gn] = 0;
        char *whole = malloc(tx.len * 3 + 1);
        const size_t wn = kv_gw_utf8_clean(tx.buf ? tx.buf : "", tx.len, whole);
        CHECK(wn == gn && !memcmp(whole, got, gn));
        free(whole);
        /* and a prefix of all the bytes cleaned at once (stop strings are
           matched on that text), all of it when no stop string matched */
        char *all = malloc((size - 1) * 3 + 1);
        const size_t an = kv_gw_utf8_clean(body, size - 1, all);
        CHECK(gn <= an && !memcmp(all, got, gn));
        if (!tx.stopped) CHECK(gn == an);
        free(all);
        if (tx.stopped) CHECK(tx.stop_index >= 0 && (uint32_t)tx.stop_index < p->n_stop);
        free(got);
        kv_gw_text_free(&tx);
    }
    kv_gw_params_free(p);
    free(p);
    free(body);
    return 0;
}
