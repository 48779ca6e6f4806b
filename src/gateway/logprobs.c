/* Log-probabilities in each API's shape (gateway_internal.h). What is
 * reported is the engine's (kv_sampler_logprobs): the f64 log-softmax of
 * the logits the token was drawn from, after logit bias and penalties,
 * before temperature, top-k, top-p and min-p. An end-of-generation token
 * is no text of the answer and is not listed. A token's text is its piece
 * (control tokens as their text), as valid UTF-8 (invalid bytes as
 * U+FFFD); "bytes" are its raw bytes. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gateway/gateway_internal.h"

typedef struct kv_lp_piece {
    char raw[KV_TOK_MAX_TOKEN_BYTES];
    size_t n;
    char clean[3 * KV_TOK_MAX_TOKEN_BYTES + 1];
} kv_lp_piece;

static void kv_lp_piece_of(const kv_tok *tok, int32_t id, kv_lp_piece *pc) {
    int n = id >= 0 ? kv_tok_piece(tok, id, true, pc->raw, sizeof pc->raw) : 0;
    if (n < 0) n = 0;
    if (n > (int)sizeof pc->raw) n = (int)sizeof pc->raw;
    pc->n = (size_t)n;
    pc->clean[kv_gw_utf8_clean(pc->raw, pc->n, pc->clean)] = 0;
}

static json_t *kv_lp_bytes_json(const kv_lp_piece *pc) {
    json_t *a = json_array();
    for (size_t i = 0; a && i < pc->n; i++)
        if (json_array_append_new(a, json_integer((unsigned char)pc->raw[i]))) {
            json_decref(a);
            return NULL;
        }
    return a;
}

/* a log-probability (null: unknown, a scripted token, or NaN: a token
 * forced into the output, not drawn) */
static json_t *kv_lp_num(const kv_token_logprob *l, double v) {
    return l->token < 0 || isnan(v) ? json_null() : json_real(v);
}

static bool kv_lp_skip(const kv_gw_result *r, const kv_token_logprob *l) {
    return l->token >= 0 && kv_tok_is_eog(r->tok, l->token);
}

size_t kv_gw_lp_bytes(const kv_tok *tok, const kv_token_logprob *lp, uint32_t n) {
    char buf[KV_TOK_MAX_TOKEN_BYTES];
    size_t total = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (lp[i].token < 0 || kv_tok_is_eog(tok, lp[i].token)) continue;
        const int k = kv_tok_piece(tok, lp[i].token, true, buf, sizeof buf);
        if (k > 0) total += (size_t)k < sizeof buf ? (size_t)k : sizeof buf;
    }
    return total;
}

/* {token, logprob, bytes} (and id with llama-server's shape) */
static json_t *kv_lp_entry(const kv_token_logprob *l, int32_t id, double v, bool with_id, kv_lp_piece *pc,
                           const kv_tok *tok) {
    kv_lp_piece_of(tok, id, pc);
    json_t *e = json_pack("{s:s,s:o,s:o}", "token", pc->clean, "logprob", kv_lp_num(l, v), "bytes",
                          kv_lp_bytes_json(pc));
    if (e && with_id && json_object_set_new(e, "id", json_integer(id))) {
        json_decref(e);
        return NULL;
    }
    return e;
}

static json_t *kv_lp_list(const kv_gw_result *r, bool with_id) {
    kv_lp_piece *pc = malloc(sizeof *pc);
    json_t *a = pc ? json_array() : NULL;
    for (uint32_t i = 0; a && i < r->n_lp; i++) {
        const kv_token_logprob *l = &r->lp[i];
        if (kv_lp_skip(r, l)) continue;
        json_t *top = json_array();
        for (uint32_t k = 0; top && l->token >= 0 && k < l->n_top && k < r->top_logprobs; k++)
            if (json_array_append_new(top, kv_lp_entry(l, l->top_id[k], l->top_logprob[k], with_id, pc, r->tok))) {
                json_decref(top);
                top = NULL;
            }
        json_t *e = top ? kv_lp_entry(l, l->token, l->logprob, with_id, pc, r->tok) : NULL;
        if (!e || json_object_set_new(e, "top_logprobs", top) || json_array_append_new(a, e)) {
            if (!e) json_decref(top);
            json_decref(a);
            a = NULL;
        }
    }
    free(pc);
    return a;
}

json_t *kv_gw_lp_chat(const kv_gw_result *r) {
    json_t *a = kv_lp_list(r, false);
    return a ? json_pack("{s:o,s:n}", "content", a, "refusal") : NULL;
}

json_t *kv_gw_lp_llama(const kv_gw_result *r) { return kv_lp_list(r, true); }

json_t *kv_gw_lp_text(const kv_gw_result *r) {
    kv_lp_piece *pc = malloc(sizeof *pc);
    json_t *toks = json_array(), *lps = json_array(), *tops = json_array(), *offs = json_array();
    bool ok = pc && toks && lps && tops && offs;
    size_t off = r->lp_text_off;
    for (uint32_t i = 0; ok && i < r->n_lp; i++) {
        const kv_token_logprob *l = &r->lp[i];
        if (kv_lp_skip(r, l)) continue;
        json_t *top = json_object();
        for (uint32_t k = 0; top && l->token >= 0 && k < l->n_top && k < r->top_logprobs; k++) {
            kv_lp_piece_of(r->tok, l->top_id[k], pc);
            if (json_object_get(top, pc->clean)) continue; /* two tokens of one text: the likelier is listed */
            if (json_object_set_new(top, pc->clean, json_real(l->top_logprob[k]))) {
                json_decref(top);
                top = NULL;
            }
        }
        kv_lp_piece_of(r->tok, l->token, pc);
        ok = top && !json_array_append_new(tops, top) && !json_array_append_new(toks, json_string(pc->clean)) &&
             !json_array_append_new(lps, kv_lp_num(l, l->logprob)) &&
             !json_array_append_new(offs, json_integer((json_int_t)off));
        off += pc->n;
    }
    free(pc);
    if (!ok) {
        json_decref(toks);
        json_decref(lps);
        json_decref(tops);
        json_decref(offs);
        return NULL;
    }
    return json_pack("{s:o,s:o,s:o,s:o}", "tokens", toks, "token_logprobs", lps, "top_logprobs", tops, "text_offset",
                     offs);
}
