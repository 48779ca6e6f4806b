/* Each API's shapes behind one set of calls (see gateway_internal.h). */
#include <string.h>

#include "gateway/gateway_internal.h"

char *kv_gw_openai_error(unsigned status, const char *msg);
char *kv_gw_openai_full(bool chat, const kv_gw_result *r, const char *text, size_t n);
void kv_gw_openai_begin(bool chat, const kv_gw_result *r, kv_gw_buf *b);
void kv_gw_openai_delta(bool chat, const kv_gw_result *r, const char *text, size_t n, kv_gw_buf *b);
void kv_gw_openai_end(bool chat, const kv_gw_result *r, bool include_usage, kv_gw_buf *b);
void kv_gw_openai_stream_error(const char *msg, kv_gw_buf *b);
char *kv_gw_anthropic_error(unsigned status, const char *msg);
char *kv_gw_anthropic_full(const kv_gw_result *r, const char *text, size_t n);
void kv_gw_anthropic_begin(const kv_gw_result *r, kv_gw_buf *b);
void kv_gw_anthropic_delta(const char *text, size_t n, kv_gw_buf *b);
void kv_gw_anthropic_end(const kv_gw_result *r, kv_gw_buf *b);
void kv_gw_anthropic_stream_error(const char *msg, kv_gw_buf *b);
char *kv_gw_ollama_error(unsigned status, const char *msg);
char *kv_gw_ollama_full(const kv_gw_result *r, const char *text, size_t n);
void kv_gw_ollama_delta(const kv_gw_result *r, const char *text, size_t n, kv_gw_buf *b);
void kv_gw_ollama_end(const kv_gw_result *r, kv_gw_buf *b);
void kv_gw_ollama_stream_error(const char *msg, kv_gw_buf *b);

char *kv_gw_error_body(int api, unsigned status, const char *msg) {
    switch (api) {
    case KV_GW_ANTHROPIC: return kv_gw_anthropic_error(status, msg);
    case KV_GW_OLLAMA: return kv_gw_ollama_error(status, msg);
    default: return kv_gw_openai_error(status, msg);
    }
}

char *kv_gw_full_body(int api, const kv_gw_result *r, const char *text, size_t n) {
    switch (api) {
    case KV_GW_ANTHROPIC: return kv_gw_anthropic_full(r, text, n);
    case KV_GW_OLLAMA: return kv_gw_ollama_full(r, text, n);
    default: return kv_gw_openai_full(api == KV_GW_OPENAI_CHAT, r, text, n);
    }
}

const char *kv_gw_stream_type(int api) {
    return api == KV_GW_OLLAMA ? "application/x-ndjson" : "text/event-stream";
}

void kv_gw_stream_begin(int api, const kv_gw_result *r, kv_gw_buf *b) {
    if (api == KV_GW_ANTHROPIC) kv_gw_anthropic_begin(r, b);
    else if (api != KV_GW_OLLAMA) kv_gw_openai_begin(api == KV_GW_OPENAI_CHAT, r, b);
}

void kv_gw_stream_delta(int api, const kv_gw_result *r, const char *text, size_t n, kv_gw_buf *b) {
    if (api == KV_GW_ANTHROPIC) kv_gw_anthropic_delta(text, n, b);
    else if (api == KV_GW_OLLAMA) kv_gw_ollama_delta(r, text, n, b);
    else kv_gw_openai_delta(api == KV_GW_OPENAI_CHAT, r, text, n, b);
}

void kv_gw_stream_end(int api, const kv_gw_result *r, bool include_usage, kv_gw_buf *b) {
    if (api == KV_GW_ANTHROPIC) kv_gw_anthropic_end(r, b);
    else if (api == KV_GW_OLLAMA) kv_gw_ollama_end(r, b);
    else kv_gw_openai_end(api == KV_GW_OPENAI_CHAT, r, include_usage, b);
}

void kv_gw_stream_error(int api, const char *msg, kv_gw_buf *b) {
    if (api == KV_GW_ANTHROPIC) kv_gw_anthropic_stream_error(msg, b);
    else if (api == KV_GW_OLLAMA) kv_gw_ollama_stream_error(msg, b);
    else kv_gw_openai_stream_error(msg, b);
}
