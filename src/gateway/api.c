/* The table of API adapters (gateway_internal.h): enum kv_gw_api to its
 * handlers. Each adapter's file defines its own kv_gw_*_ops. */
#include "gateway/gateway_internal.h"

static const kv_gw_api_ops *const kv_gw_apis[KV_GW_API_COUNT] = {
    [KV_GW_OPENAI_CHAT] = &kv_gw_openai_chat_ops,
    [KV_GW_OPENAI_TEXT] = &kv_gw_openai_text_ops,
    [KV_GW_ANTHROPIC] = &kv_gw_anthropic_ops,
    [KV_GW_OLLAMA] = &kv_gw_ollama_ops,
    [KV_GW_LLAMA] = &kv_gw_llama_ops,
    [KV_GW_OLLAMA_GEN] = &kv_gw_ollama_gen_ops,
};

const kv_gw_api_ops *kv_gw_api(int api) {
    return api >= 0 && api < KV_GW_API_COUNT ? kv_gw_apis[api] : &kv_gw_openai_chat_ops;
}
