/* libFuzzer target for the chat-template interpreter: arbitrary bytes are
 * parsed as a template and, when they parse, rendered with a conversation
 * that has a system prompt, tools, a tool call with object arguments, a
 * tool result and non-ASCII text. Every outcome must be 0 with a
 * NUL-terminated output of the stated length, or a negative code with a
 * message; the limits are small so a slow input is a limit, not a timeout. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvasir/chat.h"

static json_t *g_ctx;

static const char k_ctx[] =
    "{\"add_generation_prompt\": true, \"bos_token\": \"<s>\", \"eos_token\": \"</s>\","
    " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"d\","
    " \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}],"
    " \"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"},"
    " {\"role\": \"user\", \"content\": \"Wetter in Zürich? 🙂\"},"
    " {\"role\": \"assistant\", \"content\": \"<think>ok</think>\", \"tool_calls\": [{\"id\": \"c1\", \"type\": \"function\","
    " \"function\": {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"n\": [1, 2.5, null, true]}}}]},"
    " {\"role\": \"tool\", \"tool_call_id\": \"c1\", \"content\": \"12°C\"},"
    " {\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"danke\"}]}]}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!g_ctx) {
        json_error_t je;
        g_ctx = json_loads(k_ctx, 0, &je);
        if (!g_ctx) abort();
    }
    kv_chat_limits lim;
    kv_chat_limits_default(&lim);
    lim.max_template_bytes = 1 << 16;
    lim.max_output_bytes = 1 << 16;
    lim.max_memory_bytes = 16u << 20;
    lim.max_loop_iters = 20000;
    lim.max_depth = 100;
    kv_chat_tmpl *t = NULL;
    kv_diag d = {0};
    int rc = kv_chat_tmpl_parse(&t, (const char *)data, size, &lim, &d);
    if (rc > 0) abort();
    if (rc < 0) {
        if (t || d.msg[0] == 0) abort();
        return 0;
    }
    char *out = NULL;
    size_t n = 0;
    kv_chat_render_opts o = {.now_unix = 1767225600};
    rc = kv_chat_render(t, g_ctx, &o, &out, &n, &d);
    if (rc > 0) abort();
    if (rc == 0 && (!out || out[n] != 0 || n > lim.max_output_bytes)) abort();
    if (rc < 0 && out) abort();
    free(out);
    kv_chat_tmpl_free(t);
    return 0;
}
