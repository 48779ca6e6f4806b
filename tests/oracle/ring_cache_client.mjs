#!/usr/bin/env node
// The prompt cache over a ring, seen by the official `openai` client
// (driven by tests/test_ring_cache.sh; test-only): the same long chat sent
// three times to a gateway over a ring whose nodes run --prompt-cache. The
// first reports usage.prompt_tokens_details.cached_tokens 0, the second and
// third (streamed, usage in the last chunk) whole cache blocks > 0 and below
// the prompt's tokens, and all three the same text (temperature 0): a
// reused prefix changes no byte of the answer.
import OpenAI from 'openai';

const [url, base] = process.argv.slice(2);
const client = new OpenAI({ baseURL: url, apiKey: 'sk-rc' });
let failures = 0;
function check(ok, what) {
  if (!ok) { failures++; console.error(`FAIL: ${what}`); }
}
const req = { model: 'tiny', messages: [{ role: 'user', content: `${base} Which river is the longest?` }],
              max_tokens: 8, temperature: 0 };
const a = await client.chat.completions.create(req);
const b = await client.chat.completions.create(req);
check(a.usage.prompt_tokens > 64, `a long prompt: ${a.usage.prompt_tokens} tokens`);
check((a.usage.prompt_tokens_details?.cached_tokens ?? -1) === 0,
      `the first request: cached_tokens ${JSON.stringify(a.usage.prompt_tokens_details)}`);
const cb = b.usage.prompt_tokens_details?.cached_tokens ?? 0;
check(cb > 0 && cb % 64 === 0 && cb < b.usage.prompt_tokens,
      `the second request: cached_tokens ${cb} of ${b.usage.prompt_tokens}`);
check(a.choices[0].message.content === b.choices[0].message.content,
      `the same text with a cache hit: ${JSON.stringify(a.choices[0].message.content)} vs ${JSON.stringify(b.choices[0].message.content)}`);
const stream = await client.chat.completions.create({ ...req, stream: true, stream_options: { include_usage: true } });
let text = '', usage = null;
for await (const chunk of stream) {
  if (chunk.choices?.[0]?.delta?.content) text += chunk.choices[0].delta.content;
  if (chunk.usage) usage = chunk.usage;
}
check(text === a.choices[0].message.content, `streamed: ${JSON.stringify(text)}`);
check((usage?.prompt_tokens_details?.cached_tokens ?? 0) > 0, `streamed usage: ${JSON.stringify(usage)}`);
if (failures) process.exit(1);
console.log(`ok: openai over the ring: cached_tokens 0, then ${cb} of ${b.usage.prompt_tokens}, streamed ` +
            `${usage.prompt_tokens_details.cached_tokens}; the same text`);
