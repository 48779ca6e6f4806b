#!/usr/bin/env node
// A gateway over a ring against the same gateway over a local engine, with
// the official clients (driven by tests/test_ring_gateway_clients.sh;
// test-only). Both serve the same gen-model file with the real Qwen3.5 chat
// template (from the llama.cpp bundle of node-llama-cpp): its prompt opens
// <think>, so what the random-weight model writes is reasoning, and a
// compulsory tool call is sampled under its grammar (the ring's tail
// samples under the GBNF the gateway sends). For each feature, whole and
// streamed, the ring's answer must equal the local one byte for byte
// (greedy or seeded) and be right on its own: the `openai` client runs a
// two-step tool loop (tool_choice "required", the call's arguments valid for
// the function's schema by ajv, then the tool's result and an answer with
// reasoning_content), structured output (json_schema: parsed and validated
// by ajv), logprobs with top_logprobs, logit_bias, presence and frequency
// penalties and n = 2; the `@anthropic-ai/sdk` client a tool loop
// (tool_choice any, tool_use, tool_result) with thinking blocks.
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';
import Ajv from 'ajv';

const LOCAL = process.env.KV_LOCAL_URL, RING = process.env.KV_RING_URL, KEY = process.env.KV_GW_KEY;
const model = 'tiny';
let failures = 0, checks = 0;
function check(ok, what) {
  checks++;
  if (!ok) { failures++; console.error(`FAIL: ${what}`); }
}
function same(a, b, what) {
  const x = JSON.stringify(a), y = JSON.stringify(b);
  check(x === y, `${what}: ring ${y} !== local ${x}`);
}
const ajv = new Ajv({ strict: false, allErrors: true });
function validates(schema, text, what) {
  let v;
  try { v = JSON.parse(text); } catch (e) {
    check(false, `${what}: not JSON (${e.message}): ${JSON.stringify(text)}`);
    return undefined;
  }
  check(ajv.validate(schema, v), `${what}: ${text} does not validate: ${ajv.errorsText()}`);
  return v;
}

const oa = (url) => new OpenAI({ baseURL: `${url}/v1`, apiKey: KEY, maxRetries: 0 });
const an = (url) => new Anthropic({ baseURL: url, apiKey: KEY, maxRetries: 0 });
const L = { openai: oa(LOCAL), anthropic: an(LOCAL) }, R = { openai: oa(RING), anthropic: an(RING) };

// what must be the same: the choices (no ids, no timestamps) and the token counts
function strip(r) {
  return {
    choices: r.choices.map((c) => ({
      index: c.index, finish_reason: c.finish_reason, logprobs: c.logprobs ?? null,
      message: { role: c.message.role, content: c.message.content, reasoning_content: c.message.reasoning_content,
        tool_calls: (c.message.tool_calls ?? []).map((t) => ({ type: t.type, function: t.function })) },
    })),
    usage: { prompt_tokens: r.usage.prompt_tokens, completion_tokens: r.usage.completion_tokens },
  };
}

// a stream folded into the whole answer's shape
async function fold(stream) {
  const ch = [];
  for await (const chunk of stream) {
    for (const c of chunk.choices ?? []) {
      const o = ch[c.index] ??= { index: c.index, content: '', reasoning: '', calls: [], lp: [], finish: null };
      const d = c.delta ?? {};
      if (d.content) o.content += d.content;
      if (d.reasoning_content) o.reasoning += d.reasoning_content;
      for (const t of d.tool_calls ?? []) {
        const k = o.calls[t.index] ??= { name: '', arguments: '' };
        if (t.function?.name) k.name += t.function.name;
        if (t.function?.arguments) k.arguments += t.function.arguments;
      }
      if (c.logprobs?.content) o.lp.push(...c.logprobs.content);
      if (c.finish_reason) o.finish = c.finish_reason;
    }
  }
  return ch;
}
function foldWhole(r) {
  return r.choices.map((c) => ({
    index: c.index, content: c.message.content ?? '', reasoning: c.message.reasoning_content ?? '',
    calls: (c.message.tool_calls ?? []).map((t) => ({ name: t.function.name, arguments: t.function.arguments })),
    lp: c.logprobs?.content ?? [], finish: c.finish_reason,
  }));
}

// both gateways, whole and streamed: the ring's equals the local's, and a
// stream tells what the whole answer says
async function both(body, what) {
  const l = await L.openai.chat.completions.create(body);
  const r = await R.openai.chat.completions.create(body);
  same(strip(l), strip(r), `${what}: whole`);
  const ls = await fold(await L.openai.chat.completions.create({ ...body, stream: true }));
  const rs = await fold(await R.openai.chat.completions.create({ ...body, stream: true }));
  same(ls, rs, `${what}: streamed`);
  same(foldWhole(l), rs, `${what}: the ring's stream against the whole answer`);
  return r;
}

const weather = {
  type: 'object',
  properties: { city: { type: 'string', maxLength: 12 }, days: { type: 'integer', minimum: 1, maximum: 7 } },
  required: ['city', 'days'], additionalProperties: false,
};
const tools = [{ type: 'function', function: { name: 'get_weather', description: 'The weather in a city.',
  parameters: weather } }];

// ---- 1. a two-step tool loop (openai) ----
for (const seed of [3, 11]) {
  const msgs = [{ role: 'system', content: 'You call tools.' }, { role: 'user', content: 'Weather in Oslo, two days?' }];
  const s1 = await both({ model, messages: msgs, tools, tool_choice: 'required', parallel_tool_calls: false, seed, temperature: 0.8,
    max_tokens: 200 }, `tool call (seed ${seed})`);
  const call = s1.choices[0].message.tool_calls?.[0];
  check(call && call.function.name === 'get_weather', `seed ${seed}: a get_weather call: ${JSON.stringify(s1.choices[0])}`);
  if (!call) continue;
  validates(weather, call.function.arguments, `seed ${seed}: the call's arguments`);
  check(s1.choices[0].finish_reason === 'tool_calls', `seed ${seed}: finish_reason ${s1.choices[0].finish_reason}: ${JSON.stringify(s1.choices[0].message)} ${JSON.stringify(s1.usage)}`);
  const s2msgs = [...msgs, { role: 'assistant', content: null, tool_calls: [call] },
    { role: 'tool', tool_call_id: call.id, content: '{"temp": -3.5, "sky": "snow"}' }];
  const s2 = await both({ model, messages: s2msgs, tools, seed, temperature: 0.8, max_tokens: 16 },
    `tool result answer (seed ${seed})`);
  check((s2.choices[0].message.reasoning_content ?? '').length > 0,
    `seed ${seed}: the answer's reasoning (a prompt-opened <think>) is empty`);
}
// a named function, greedy
{
  const r = await both({ model, messages: [{ role: 'user', content: 'Oslo?' }], tools,
    tool_choice: { type: 'function', function: { name: 'get_weather' } }, temperature: 0, max_tokens: 200 },
  'named tool call (greedy)');
  const call = r.choices[0].message.tool_calls?.[0];
  check(call?.function.name === 'get_weather', 'named: the call');
  if (call) validates(weather, call.function.arguments, 'named: arguments');
}

// ---- 2. structured output (json_schema, json_object) ----
const nothink = { chat_template_kwargs: { enable_thinking: false } }; /* the JSON is the answer, not reasoning */
const person = {
  type: 'object',
  properties: { name: { type: 'string', minLength: 1, maxLength: 10 }, age: { type: 'integer', minimum: 0, maximum: 99 },
    tags: { type: 'array', items: { enum: ['a', 'b'] }, maxItems: 2 } },
  required: ['name', 'age'], additionalProperties: false,
};
for (const seed of [1, 42]) {
  const r = await both({ model, ...nothink, messages: [{ role: 'user', content: 'A person in JSON.' }], seed, max_tokens: 300,
    response_format: { type: 'json_schema', json_schema: { name: 'person', schema: person, strict: true } } },
  `json_schema (seed ${seed})`);
  const c = r.choices[0].message.content ?? '';
  validates(person, c, `json_schema seed ${seed}`);
}
{
  const r = await both({ model, ...nothink, messages: [{ role: 'user', content: 'JSON please.' }], temperature: 0, max_tokens: 200,
    response_format: { type: 'json_object' } }, 'json_object (greedy)');
  const v = validates({ type: 'object' }, r.choices[0].message.content ?? '', 'json_object');
  check(v !== undefined, 'json_object parses');
}

// ---- 3. logprobs, and the sampling fields ----
{
  const r = await both({ model, messages: [{ role: 'user', content: 'Hello' }], seed: 5, temperature: 0.9,
    max_tokens: 8, logprobs: true, top_logprobs: 3 }, 'logprobs');
  const lp = r.choices[0].logprobs?.content ?? [];
  check(lp.length === r.usage.completion_tokens, `logprobs: ${lp.length} entries for ${r.usage.completion_tokens} tokens`);
  check(lp.every((e) => e.logprob <= 0 && e.top_logprobs.length === 3), 'logprobs: each <= 0 with 3 alternatives');
}
await both({ model, messages: [{ role: 'user', content: 'Count' }], seed: 9, temperature: 1.0, max_tokens: 12,
  presence_penalty: 1.5, frequency_penalty: -0.5, logit_bias: { 5: 8, 17: -100 } }, 'penalties and logit_bias');
{
  const r = await both({ model, messages: [{ role: 'user', content: 'Two answers' }], seed: 21, temperature: 1.0,
    max_tokens: 6, n: 2 }, 'n = 2');
  check(r.choices.length === 2, `n = 2: ${r.choices.length} choices`);
}
{ /* a later choice samples under its lead's grammar */
  const r = await both({ model, ...nothink, messages: [{ role: 'user', content: 'Two people' }], seed: 8, max_tokens: 300,
    n: 2, response_format: { type: 'json_schema', json_schema: { name: 'person', schema: person, strict: true } } },
  'n = 2 under a json_schema');
  for (const c of r.choices) validates(person, c.message.content ?? '', `n = 2 choice ${c.index}`);
}

// ---- 4. Anthropic: a tool loop with thinking blocks ----
for (const stream of [false, true]) {
  const run = async (c, body) => stream ? await c.messages.stream(body).finalMessage() : await c.messages.create(body);
  const body = { model, max_tokens: 200, temperature: 0, thinking: { type: 'enabled', budget_tokens: 200 },
    tools: [{ name: 'get_weather', description: 'The weather in a city.', input_schema: weather }],
    tool_choice: { type: 'any' }, messages: [{ role: 'user', content: 'Weather in Oslo?' }] };
  const l = await run(L.anthropic, body), r = await run(R.anthropic, body);
  const blocks = (m) => m.content.map((b) => ({ type: b.type, text: b.text, thinking: b.thinking, name: b.name, input: b.input }));
  same({ b: blocks(l), s: l.stop_reason, u: l.usage.output_tokens }, { b: blocks(r), s: r.stop_reason, u: r.usage.output_tokens },
    `anthropic tool_use (stream ${stream})`);
  const use = r.content.find((b) => b.type === 'tool_use');
  check(use && use.name === 'get_weather' && ajv.validate(weather, use.input), `anthropic: a valid tool_use: ${JSON.stringify(r.content)}`);
  if (!use) continue;
  const body2 = { ...body, tool_choice: { type: 'auto' }, max_tokens: 16, thinking: { type: 'enabled', budget_tokens: 16 },
    messages: [...body.messages, { role: 'assistant', content: r.content },
      { role: 'user', content: [{ type: 'tool_result', tool_use_id: use.id, content: '-3.5 and snow' }] }] };
  const l2 = await run(L.anthropic, body2), r2 = await run(R.anthropic, body2);
  same({ b: blocks(l2), s: l2.stop_reason }, { b: blocks(r2), s: r2.stop_reason }, `anthropic tool_result (stream ${stream})`);
  check(r2.content.some((b) => b.type === 'thinking' && b.thinking.length > 0), `anthropic: a thinking block: ${JSON.stringify(r2.content)}`);
}

console.log(`ring_gateway_clients: ${checks} checks, ${failures} failed`);
process.exit(failures ? 1 : 0);
