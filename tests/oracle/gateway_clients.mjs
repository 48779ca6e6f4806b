#!/usr/bin/env node
// The official OpenAI and Anthropic clients against `kvasir gateway`
// (driven by tests/test_gateway_clients.sh; test-only). For each case the
// reference is `kvasir run --chat --json` with the same parameters: the
// client's text (whole, or the stream's deltas joined) must equal its text,
// the completion token count its token count, the prompt count its prompt
// count. A wrong key must be refused by both clients (401).
import { execFileSync } from 'node:child_process';
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';

const url = process.env.KV_GW_URL, key = process.env.KV_GW_KEY, model = process.env.KV_GW_MODEL;
const file = process.env.KV_GW_FILE, bin = process.env.KV_BIN;
let failures = 0, checks = 0;
function check(ok, what) {
  checks++;
  if (!ok) { failures++; console.error(`FAIL: ${what}`); }
}
function eq(a, b, what) { check(a === b, `${what}: ${JSON.stringify(a)} !== ${JSON.stringify(b)}`); }

function reference(prompt, p) {
  const out = execFileSync(bin, ['run', '-m', file, '--chat', '--json', '--threads', '1', '-p', prompt,
    '-n', String(p.max_tokens), '--temp', String(p.temperature), '--top-k', String(p.top_k),
    '--top-p', String(p.top_p), '--min-p', String(p.min_p), '--seed', String(p.seed)], { encoding: 'utf8' });
  const j = JSON.parse(out);
  return { text: j.text, n_gen: j.tokens.length, n_prompt: j.prompt_tokens.length };
}

const cases = [
  { prompt: 'Hello there', temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, seed: 11, max_tokens: 24 },
  { prompt: 'Tell me about dragons.', temperature: 0, top_k: 40, top_p: 0.95, min_p: 0.05, seed: 1, max_tokens: 40 },
  { prompt: 'Why is the sky blue?', temperature: 1.2, top_k: 10, top_p: 0.9, min_p: 0.0, seed: 77, max_tokens: 33 },
];

const openai = new OpenAI({ baseURL: `${url}/v1`, apiKey: key, maxRetries: 0 });
const anthropic = new Anthropic({ baseURL: url, apiKey: key, maxRetries: 0 });

for (const c of cases) {
  const ref = reference(c.prompt, c);
  const params = { model, messages: [{ role: 'user', content: c.prompt }], max_tokens: c.max_tokens,
    temperature: c.temperature, top_p: c.top_p, seed: c.seed, top_k: c.top_k, min_p: c.min_p };
  // OpenAI, whole
  const r = await openai.chat.completions.create(params);
  eq(r.choices[0].message.content, ref.text, `openai chat '${c.prompt}' text`);
  eq(r.usage.completion_tokens, ref.n_gen, `openai chat '${c.prompt}' completion_tokens`);
  eq(r.usage.prompt_tokens, ref.n_prompt, `openai chat '${c.prompt}' prompt_tokens`);
  // OpenAI, streamed with usage
  const s = await openai.chat.completions.create({ ...params, stream: true, stream_options: { include_usage: true } });
  let text = '', usage = null, finish = null;
  for await (const ch of s) {
    if (ch.choices.length && ch.choices[0].delta.content) text += ch.choices[0].delta.content;
    if (ch.choices.length && ch.choices[0].finish_reason) finish = ch.choices[0].finish_reason;
    if (ch.usage) usage = ch.usage;
  }
  eq(text, ref.text, `openai stream '${c.prompt}' text`);
  check(usage && usage.completion_tokens === ref.n_gen, `openai stream '${c.prompt}' usage`);
  check(finish === 'stop' || finish === 'length', `openai stream finish_reason ${finish}`);
  // Anthropic, whole
  const aparams = { model, max_tokens: c.max_tokens, messages: [{ role: 'user', content: c.prompt }],
    temperature: c.temperature, top_p: c.top_p, top_k: c.top_k, seed: c.seed, min_p: c.min_p };
  const m = await anthropic.messages.create(aparams);
  eq(m.content[0].text, ref.text, `anthropic '${c.prompt}' text`);
  eq(m.usage.output_tokens, ref.n_gen, `anthropic '${c.prompt}' output_tokens`);
  eq(m.usage.input_tokens + (m.usage.cache_read_input_tokens ?? 0), ref.n_prompt, `anthropic '${c.prompt}' input_tokens`);
  // Anthropic, streamed
  const st = anthropic.messages.stream(aparams);
  let atext = '';
  st.on('text', (t) => { atext += t; });
  const fin = await st.finalMessage();
  eq(atext, ref.text, `anthropic stream '${c.prompt}' text`);
  eq(fin.usage.output_tokens, ref.n_gen, `anthropic stream '${c.prompt}' output_tokens`);
}

// a wrong key: both clients see 401
try {
  await new OpenAI({ baseURL: `${url}/v1`, apiKey: 'wrong', maxRetries: 0 }).models.list();
  check(false, 'openai with a wrong key was served');
} catch (e) { eq(e.status, 401, 'openai wrong key status'); }
try {
  await new Anthropic({ baseURL: url, apiKey: 'wrong', maxRetries: 0 }).messages.create(
    { model, max_tokens: 2, messages: [{ role: 'user', content: 'x' }] });
  check(false, 'anthropic with a wrong key was served');
} catch (e) { eq(e.status, 401, 'anthropic wrong key status'); }
// and the model list through the client
const list = await openai.models.list();
eq(list.data[0].id, model, 'openai models.list id');

console.log(`gateway_clients: ${checks} checks, ${failures} failed`);
process.exit(failures ? 1 : 0);
