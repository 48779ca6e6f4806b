/* The reasoning budget: Anthropic's thinking.budget_tokens and
 * llama-server's thinking_budget_tokens. A tracker follows the output a
 * token at a time and says when the reasoning has used its budget; the
 * scheduler then forces the family's end-of-reasoning text into the output
 * (kv_session_force: the tokens are appended as if sampled and the model
 * continues after them), so the answer follows.
 *
 * What is counted: the tokens after the opening marker (`<think>`, or
 * gpt-oss's analysis channel header), up to the closing one. A prompt that
 * opened the reasoning itself (kv_chat_prompt_thinks) starts inside it; else
 * the reasoning is the output's opening marker, if the output (whitespace
 * aside) starts with one, and there is none if it does not. Markers are
 * found in the text of the latest tokens, so a marker split over several
 * tokens is seen too. Runs on the scheduler's thread, no allocation. */
#include <stdio.h>
#include <string.h>

#include "gateway/gateway_internal.h"
#include "kvasir/chat.h"

/* A family's markers: the opening, the closing, and the text forced at the
 * budget (the closing, and what the template writes after it). */
typedef struct kv_budget_marks {
    const char *open, *close, *forced;
} kv_budget_marks;

static const kv_budget_marks kv_marks_think = {"<think>", "</think>", "\n</think>\n\n"};
static const kv_budget_marks kv_marks_harmony = {"<|channel|>analysis<|message|>", "<|end|>",
                                                 "<|end|><|start|>assistant<|channel|>final<|message|>"};

int kv_gw_budget_init(kv_gw_budget *b, const kv_tok *tok, int format, bool think, bool think_open, uint32_t budget,
                      kv_diag *d) {
    memset(b, 0, sizeof *b);
    const kv_budget_marks *m = format == KV_CHAT_FMT_HARMONY ? &kv_marks_harmony : think || think_open ? &kv_marks_think
                                                                                                     : NULL;
    if (!m) return 0; /* the family writes no reasoning: the budget is never reached */
    b->on = true;
    b->budget = budget;
    b->state = think_open && format != KV_CHAT_FMT_HARMONY ? KV_GW_BUDGET_IN : KV_GW_BUDGET_WAIT;
    snprintf(b->open, sizeof b->open, "%s", m->open);
    snprintf(b->close, sizeof b->close, "%s", m->close);
    size_t n = 0;
    const int rc = kv_tok_encode(tok, m->forced, strlen(m->forced), true, b->forced, KV_GW_BUDGET_MAX_FORCED, &n, d);
    if (rc || n == 0 || n > KV_GW_BUDGET_MAX_FORCED)
        return kv_fail(d, rc && rc != KV_ERANGE ? rc : KV_EINVAL, "the end of reasoning cannot be forced: its text "
                       "takes %zu tokens in this vocabulary (1 to %u)", n, KV_GW_BUDGET_MAX_FORCED);
    b->n_forced = (uint32_t)n;
    return 0;
}

bool kv_gw_budget_due(const kv_gw_budget *b) {
    return b->on && b->state == KV_GW_BUDGET_IN && b->used >= b->budget;
}

/* Appends s to the tail, keeping its last bytes. */
static void kv_budget_tail(kv_gw_budget *b, const char *s, size_t n) {
    const size_t keep = sizeof b->tail - 1;
    if (n >= keep) {
        memcpy(b->tail, s + n - keep, keep);
        b->n_tail = keep;
    } else {
        if (b->n_tail + n > keep) {
            const size_t drop = b->n_tail + n - keep;
            memmove(b->tail, b->tail + drop, b->n_tail - drop);
            b->n_tail -= drop;
        }
        memcpy(b->tail + b->n_tail, s, n);
        b->n_tail += n;
    }
    b->tail[b->n_tail] = '\0';
}

bool kv_gw_budget_see(kv_gw_budget *b, const kv_tok *tok, int32_t t) {
    if (!b->on || b->state == KV_GW_BUDGET_OVER) return false;
    char pb[256];
    int pn = kv_tok_piece(tok, t, true, pb, sizeof pb);
    if (pn < 0) pn = 0;
    if ((size_t)pn > sizeof pb) pn = (int)sizeof pb; /* a longer piece: its start is what a marker can be */
    if (b->state == KV_GW_BUDGET_WAIT) {
        kv_budget_tail(b, pb, (size_t)pn);
        const char *s = b->tail;
        while (*s == ' ' || *s == '\n' || *s == '\t' || *s == '\r') s++;
        const size_t ol = strlen(b->open), sl = strlen(s);
        if (sl >= ol && !memcmp(s, b->open, ol)) {
            b->state = KV_GW_BUDGET_IN; /* what follows the marker in this token is the reasoning's first text */
            const char *rest = s + ol;
            memmove(b->tail, rest, strlen(rest) + 1);
            b->n_tail = strlen(b->tail);
            if (strstr(b->tail, b->close)) b->state = KV_GW_BUDGET_OVER;
        } else if (sl && memcmp(s, b->open, sl)) {
            b->state = KV_GW_BUDGET_OVER; /* the output is no reasoning: nothing to bound */
        } else if (sl >= sizeof b->tail - 1) {
            b->state = KV_GW_BUDGET_OVER;
        }
        return kv_gw_budget_due(b);
    }
    b->used++;
    kv_budget_tail(b, pb, (size_t)pn);
    if (strstr(b->tail, b->close)) b->state = KV_GW_BUDGET_OVER; /* the model ended it within budget */
    return kv_gw_budget_due(b);
}

void kv_gw_budget_forced(kv_gw_budget *b) { b->state = KV_GW_BUDGET_OVER; }
