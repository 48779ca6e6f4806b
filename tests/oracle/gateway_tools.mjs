#!/usr/bin/env node
// Tool calling and reasoning end to end (driven by
// tests/test_gateway_tools.sh; test-only). The model has random weights, so
// the gateway runs with the test-only KVASIR_GATEWAY_TEST_SCRIPT: each
// generation request is answered with the next scripted text, tokenized as
// model output, in Qwen3's format (the real Qwen3 template from the
// llama.cpp bundle is the chat template). The official `openai` and
// `@anthropic-ai/sdk` clients then run a two-step tool loop (the model calls
// get_weather, the client sends the result, the model answers), whole and
// streamed, and read reasoning_content / thinking blocks; Ollama's /api/chat
// is driven with curl. The second step's prompt must be the rendering
// @huggingface/jinja gives the same conversation (OpenAI: /apply-template of
// the body the client sent; Anthropic: its prompt token count equal to that
// of the same conversation in OpenAI's shape, whose rendering is checked).
import { execFileSync, spawn } from 'node:child_process';
import { readFileSync, writeFileSync } from 'node:fs';
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';
import { Template } from '@huggingface/jinja';
import { readGgufFileInfo } from 'node-llama-cpp';

const dir = process.env.KV_DIR, bin = process.env.KV_BIN;
let failures = 0, checks = 0;
function check(ok, what) {
  checks++;
  if (!ok) { failures++; console.error(`FAIL: ${what}`); }
}
function eq(a, b, what) {
  const x = JSON.stringify(a), y = JSON.stringify(b);
  check(x === y, `${what}: ${x} !== ${y}`);
}

// ---- the script: the texts the "model" writes, in request order ----
const REASON1 = 'The user wants the weather in Oslo. I will call the tool.';
const REASON2 = 'The tool says -3.5 and snow.';
const ANSWER = 'It is -3.5 °C and snowing in Oslo.';
const ARGS = { city: 'Oslo', days: 2 };
const CALL = `<think>\n${REASON1}\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": ${JSON.stringify(ARGS)}}\n</tool_call>`;
const REPLY = `<think>\n${REASON2}\n</think>\n\n${ANSWER}`;
const BAD = '<tool_call>\n{"name": "get_weather", "arguments": {city: Oslo}}\n</tool_call>';
const script = [CALL, REPLY, CALL, REPLY, CALL, REPLY, CALL, REPLY, CALL, CALL, CALL, BAD, REPLY];
writeFileSync(`${dir}/script.txt`, script.join('\x1e'));

// ---- the gateway ----
const tmpl = readFileSync(`${dir}/Qwen-Qwen3-0.6B.jinja`, 'utf8');
const gw = spawn(bin, ['gateway', '-m', `${dir}/big.gguf`, '--chat-template', `${dir}/Qwen-Qwen3-0.6B.jinja`,
  '--listen', '127.0.0.1:0', '--threads', '2', '--name', 'tiny', '--api-key', 'sk-tools'],
  { env: { ...process.env, KVASIR_GATEWAY_TEST_SCRIPT: `${dir}/script.txt` }, stdio: ['ignore', 'pipe', 'pipe'] });
let stderr = '';
gw.stderr.on('data', (b) => { stderr += b; });
const url = await new Promise((resolve, reject) => {
  let out = '';
  gw.stdout.on('data', (b) => {
    out += b;
    const m = out.match(/^listening on (\S+)/m);
    if (m) resolve('http://' + m[1]);
  });
  gw.on('exit', (c) => reject(new Error(`gateway exited ${c}: ${stderr}`)));
});
check(/TEST ONLY/.test(stderr), 'the gateway says it answers from a script');

const info = await readGgufFileInfo(`${dir}/big.gguf`, { readTensorInfo: false });
const tk = info.metadata.tokenizer;
const bos = tk.ggml.tokens[tk.ggml.bos_token_id], eos = tk.ggml.tokens[tk.ggml.eos_token_id];
function context(body) { // as docs/GATEWAY.md says the gateway builds it (gateway_template.mjs's rules)
  const messages = body.messages.map((m) => {
    const o = structuredClone(m);
    if (o.role === 'developer') o.role = 'system';
    if (Array.isArray(o.content)) o.content = o.content.map((b) => b.text).join('');
    if (o.content == null) o.content = ''; // a call without text
    for (const c of o.tool_calls || []) {
      if (c.function && typeof c.function.arguments === 'string') {
        try { c.function.arguments = JSON.parse(c.function.arguments); } catch { /* stays a string */ }
      }
    }
    return o;
  });
  const ctx = { ...(body.chat_template_kwargs || {}), messages,
    add_generation_prompt: body.add_generation_prompt ?? true, bos_token: bos, eos_token: eos };
  if (body.tools != null && body.tool_choice !== 'none') ctx.tools = body.tools;
  return ctx;
}
const render = (body) => new Template(tmpl).render(context(body));
const headers = { 'content-type': 'application/json', authorization: 'Bearer sk-tools' };
async function post(path, body) {
  const r = await fetch(url + path, { method: 'POST', headers, body: JSON.stringify(body) });
  return { status: r.status, json: await r.json() };
}
async function renderedBy(body) { return (await post('/apply-template', body)).json.prompt; }

const weather = { type: 'function', function: { name: 'get_weather', description: 'The weather in a city',
  parameters: { type: 'object', properties: { city: { type: 'string' }, days: { type: 'integer' } },
    required: ['city'] } } };
const sent = []; // request bodies the clients sent
const recording = async (u, init) => { if (init && init.body) sent.push(JSON.parse(init.body)); return fetch(u, init); };
const openai = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'sk-tools', maxRetries: 0, fetch: recording });
const anthropic = new Anthropic({ baseURL: url, apiKey: 'sk-tools', maxRetries: 0, fetch: recording });
const model = 'tiny';

// ---- OpenAI: whole, then streamed ----
for (const stream of [false, true]) {
  const tag = `openai ${stream ? 'stream' : 'whole'}`;
  const messages = [{ role: 'user', content: 'What is the weather in Oslo for two days?' }];
  let msg, finish, reasoning = '';
  if (!stream) {
    const r = await openai.chat.completions.create({ model, messages, tools: [weather], max_tokens: 1000 });
    msg = r.choices[0].message;
    finish = r.choices[0].finish_reason;
    reasoning = msg.reasoning_content;
  } else {
    const s = openai.chat.completions.stream({ model, messages, tools: [weather], max_tokens: 1000 });
    s.on('chunk', (ch) => { if (ch.choices.length && ch.choices[0].delta.reasoning_content) reasoning += ch.choices[0].delta.reasoning_content; });
    const r = await s.finalChatCompletion();
    msg = r.choices[0].message;
    finish = r.choices[0].finish_reason;
  }
  eq(finish, 'tool_calls', `${tag}: finish_reason`);
  eq(reasoning, REASON1, `${tag}: reasoning_content`);
  check(msg.content === null || msg.content === '', `${tag}: no content beside the call (${JSON.stringify(msg.content)})`);
  check(msg.tool_calls && msg.tool_calls.length === 1, `${tag}: one tool call`);
  const call = msg.tool_calls[0];
  eq(call.type, 'function', `${tag}: call type`);
  eq(call.function.name, 'get_weather', `${tag}: call name`);
  eq(JSON.parse(call.function.arguments), ARGS, `${tag}: call arguments`);
  check(typeof call.id === 'string' && call.id.startsWith('call_'), `${tag}: call id ${call.id}`);
  // step 2: the tool's result goes back
  const history = [...messages, { role: 'assistant', content: msg.content, tool_calls: msg.tool_calls,
    reasoning_content: reasoning }, { role: 'tool', tool_call_id: call.id, content: '{"temp": -3.5, "sky": "snow"}' }];
  sent.length = 0;
  let content = '', reasoning2 = '', finish2;
  if (!stream) {
    const r = await openai.chat.completions.create({ model, messages: history, tools: [weather], max_tokens: 1000 });
    content = r.choices[0].message.content;
    reasoning2 = r.choices[0].message.reasoning_content;
    finish2 = r.choices[0].finish_reason;
    check(!r.choices[0].message.tool_calls, `${tag} step 2: no tool calls`);
  } else {
    const s = await openai.chat.completions.create({ model, messages: history, tools: [weather], max_tokens: 1000,
      stream: true });
    for await (const ch of s) {
      const d = ch.choices.length ? ch.choices[0].delta : {};
      if (d.content) content += d.content;
      if (d.reasoning_content) reasoning2 += d.reasoning_content;
      check(!d.tool_calls, `${tag} step 2: no tool call delta`);
      if (ch.choices.length && ch.choices[0].finish_reason) finish2 = ch.choices[0].finish_reason;
    }
  }
  eq(content, ANSWER, `${tag} step 2: content`);
  eq(reasoning2, REASON2, `${tag} step 2: reasoning_content`);
  eq(finish2, 'stop', `${tag} step 2: finish_reason`);
  // the second step's prompt is the reference rendering of what the client sent
  eq(sent.length, 1, `${tag}: one request recorded`);
  const body = sent[0];
  check(body.messages[1].tool_calls[0].id === call.id && body.messages[2].role === 'tool', `${tag}: the client sent the loop`);
  eq(await renderedBy(body), render(body), `${tag} step 2: the prompt equals @huggingface/jinja's rendering`);
}

// ---- Anthropic: whole, then streamed ----
const aTools = [{ name: 'get_weather', description: 'The weather in a city', input_schema: weather.function.parameters }];
for (const stream of [false, true]) {
  const tag = `anthropic ${stream ? 'stream' : 'whole'}`;
  const messages = [{ role: 'user', content: 'What is the weather in Oslo for two days?' }];
  const params = { model, max_tokens: 1000, messages, tools: aTools, thinking: { type: 'enabled', budget_tokens: 1000 } };
  const m = stream ? await anthropic.messages.stream(params).finalMessage() : await anthropic.messages.create(params);
  eq(m.stop_reason, 'tool_use', `${tag}: stop_reason`);
  eq(m.content.map((b) => b.type), ['thinking', 'tool_use'], `${tag}: blocks`);
  eq(m.content[0].thinking, REASON1, `${tag}: thinking`);
  const use = m.content[1];
  eq([use.name, use.input], ['get_weather', ARGS], `${tag}: tool_use`);
  check(typeof use.id === 'string' && use.id.startsWith('toolu_'), `${tag}: tool_use id ${use.id}`);
  const history = [...messages, { role: 'assistant', content: m.content },
    { role: 'user', content: [{ type: 'tool_result', tool_use_id: use.id, content: '{"temp": -3.5, "sky": "snow"}' }] }];
  const p2 = { model, max_tokens: 1000, messages: history, tools: aTools, thinking: { type: 'enabled', budget_tokens: 1000 } };
  const m2 = stream ? await anthropic.messages.stream(p2).finalMessage() : await anthropic.messages.create(p2);
  eq(m2.stop_reason, 'end_turn', `${tag} step 2: stop_reason`);
  eq(m2.content.map((b) => b.type), ['thinking', 'text'], `${tag} step 2: blocks`);
  eq([m2.content[0].thinking, m2.content[1].text], [REASON2, ANSWER], `${tag} step 2: thinking and text`);
  if (!stream) { // the same conversation in OpenAI's shape: its rendering is the reference's, and the
    // Anthropic prompt has exactly its tokens
    const oa = { messages: [messages[0], { role: 'assistant', content: '', reasoning_content: REASON1,
      tool_calls: [{ id: use.id, type: 'function', function: { name: 'get_weather', arguments: ARGS } }] },
    { role: 'tool', tool_call_id: use.id, content: '{"temp": -3.5, "sky": "snow"}' }], tools: [weather],
    chat_template_kwargs: { enable_thinking: true } };
    eq(await renderedBy(oa), render(oa), `${tag} step 2 in OpenAI's shape: the prompt equals @huggingface/jinja's`);
    // Anthropic counts prompt tokens read from the prompt cache apart (cache_read_input_tokens)
    globalThis.anthropicStep2 = { oa, input_tokens: m2.usage.input_tokens + (m2.usage.cache_read_input_tokens ?? 0) };
  }
}

// ---- Ollama (curl) ----
const curl = (body) => execFileSync('curl', ['-sS', '-H', 'content-type: application/json', '-H',
  'authorization: Bearer sk-tools', '-d', JSON.stringify(body), `${url}/api/chat`], { encoding: 'utf8' });
{
  const base = { model, messages: [{ role: 'user', content: 'Weather in Oslo?' }], tools: [weather],
    options: { num_predict: 1000 } };
  const w = JSON.parse(curl({ ...base, stream: false }));
  eq(w.message.thinking, REASON1, 'ollama whole: message.thinking');
  eq(w.message.tool_calls && w.message.tool_calls.map((c) => [c.function.name, c.function.arguments]),
    [['get_weather', ARGS]], 'ollama whole: message.tool_calls');
  eq(w.done_reason, 'stop', 'ollama whole: done_reason');
  const lines = curl({ ...base, stream: true }).trim().split('\n').map((l) => JSON.parse(l));
  eq(lines.map((l) => l.message.thinking || '').join(''), REASON1, 'ollama stream: thinking');
  eq(lines.flatMap((l) => l.message.tool_calls || []).map((c) => [c.function.name, c.function.arguments]),
    [['get_weather', ARGS]], 'ollama stream: tool_calls');
  check(lines[lines.length - 1].done === true, 'ollama stream: ends done');
}

// ---- tool_choice none: the template is not given the tools, calls are text ----
{
  const body = { model, messages: [{ role: 'user', content: 'Weather in Oslo?' }], tools: [weather],
    tool_choice: 'none', max_tokens: 1000 };
  const withTools = { ...body, tool_choice: 'auto' };
  eq(await renderedBy(body), render(body), 'tool_choice none: the prompt equals the reference without tools');
  check(render(body) !== render(withTools), 'tool_choice none: the prompt differs from one with tools');
  const r = await post('/v1/chat/completions', body);
  eq(r.status, 200, 'tool_choice none: 200');
  const m = r.json.choices[0].message;
  check(!m.tool_calls && m.content.includes('<tool_call>'), `tool_choice none: the call is text (${JSON.stringify(m)})`);
  eq(m.reasoning_content, REASON1, 'tool_choice none: reasoning still split');
}

// ---- a call whose JSON is bad is content, every byte ----
{
  const r = await post('/v1/chat/completions', { model, messages: [{ role: 'user', content: 'x' }], tools: [weather],
    max_tokens: 1000 });
  eq(r.status, 200, 'bad call: 200');
  eq(r.json.choices[0].message.content, BAD, 'bad call: content');
  check(!r.json.choices[0].message.tool_calls, 'bad call: no tool_calls');
  eq(r.json.choices[0].finish_reason, 'stop', 'bad call: finish_reason');
}

// ---- the Anthropic step 2 prompt had the OpenAI-shaped conversation's tokens ----
{
  const { oa, input_tokens } = globalThis.anthropicStep2;
  const r = await post('/v1/chat/completions', { model, ...oa, max_tokens: 1000 });
  eq(r.json.usage.prompt_tokens, input_tokens, 'anthropic step 2: prompt tokens of the same conversation');
}

// ---- refused: what cannot be honoured yet (tool_choice required and named: test_gateway_structured) ----
for (const [path, body, want] of [
  ['/v1/chat/completions', { tool_choice: { type: 'function', function: { name: 'nope' } } }, 'not in'],
  ['/v1/chat/completions', { chat_template_kwargs: { messages: [] } }, 'chat_template_kwargs'],
  ['/v1/chat/completions', { tools: [{ type: 'function', function: {} }] }, 'function.name'],
  ['/v1/messages', { thinking: { type: 'enabled', budget_tokens: 0 }, max_tokens: 100 }, 'budget_tokens'],
  ['/api/chat', { think: 'high' }, 'think'],
]) {
  const b = { model, messages: [{ role: 'user', content: 'hi' }], tools: [weather], ...body };
  if (path === '/v1/messages') b.tools = aTools;
  if (body.tools) b.tools = body.tools;
  const r = await post(path, b);
  eq(r.status, 400, `refused ${JSON.stringify(body)}: status`);
  check(JSON.stringify(r.json).includes(want), `refused ${JSON.stringify(body)}: says '${want}': ${JSON.stringify(r.json)}`);
}
// chat_template_kwargs reach the template
{
  const body = { messages: [{ role: 'user', content: 'hi' }], chat_template_kwargs: { enable_thinking: false } };
  const got = await renderedBy(body);
  eq(got, render(body), 'chat_template_kwargs: the prompt equals the reference');
  check(got.endsWith('<think>\n\n</think>\n\n'), 'chat_template_kwargs: enable_thinking false reached the template');
}

gw.kill();

// ---- the other families, chosen from their real templates: Qwen3.5 (the
// prompt opens <think>; XML calls), DeepSeek V3.1 (thinking on by
// chat_template_kwargs), gpt-oss (harmony channels); whole and streamed ----
const DS = (s) => `<｜${s}｜>`;
const families = [
  { name: 'Qwen3.5-4B', kwargs: {}, text: `${REASON1}\n</think>\n\n<tool_call>\n<function=get_weather>\n` +
    '<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>' },
  { name: 'deepseek-ai-DeepSeek-V3.1', kwargs: { thinking: true }, text: `${REASON1}</think>` +
    `${DS('tool▁calls▁begin')}${DS('tool▁call▁begin')}get_weather${DS('tool▁sep')}${JSON.stringify(ARGS)}` +
    `${DS('tool▁call▁end')}${DS('tool▁calls▁end')}` },
  { name: 'openai-gpt-oss-120b', kwargs: {}, text: `<|channel|>analysis<|message|>${REASON1}<|end|>` +
    `<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>${JSON.stringify(ARGS)}` },
];
for (const f of families) {
  writeFileSync(`${dir}/script-${f.name}.txt`, [f.text, f.text].join('\x1e'));
  const g = spawn(bin, ['gateway', '-m', `${dir}/big.gguf`, '--chat-template', `${dir}/${f.name}.jinja`,
    '--listen', '127.0.0.1:0', '--threads', '1', '--name', 'tiny'],
    { env: { ...process.env, KVASIR_GATEWAY_TEST_SCRIPT: `${dir}/script-${f.name}.txt` }, stdio: ['ignore', 'pipe', 'pipe'] });
  let err = '';
  g.stderr.on('data', (b) => { err += b; });
  const u = await new Promise((resolve, reject) => {
    let out = '';
    g.stdout.on('data', (b) => { out += b; const m = out.match(/^listening on (\S+)/m); if (m) resolve('http://' + m[1]); });
    g.on('exit', (c) => reject(new Error(`gateway ${f.name} exited ${c}: ${err}`)));
  });
  const client = new OpenAI({ baseURL: `${u}/v1`, apiKey: 'none', maxRetries: 0 });
  const params = { model, messages: [{ role: 'user', content: 'Weather in Oslo for two days?' }], tools: [weather],
    max_tokens: 1000, chat_template_kwargs: f.kwargs };
  for (const stream of [false, true]) {
    const tag = `${f.name} ${stream ? 'stream' : 'whole'}`;
    let msg, reasoning = '';
    try {
      if (stream) {
        const st = client.chat.completions.stream(params);
        st.on('chunk', (ch) => { if (ch.choices.length && ch.choices[0].delta.reasoning_content) reasoning += ch.choices[0].delta.reasoning_content; });
        msg = (await st.finalChatCompletion()).choices[0];
      } else {
        msg = (await client.chat.completions.create(params)).choices[0];
        reasoning = msg.message.reasoning_content;
      }
    } catch (e) { check(false, `${tag}: ${e.message}`); continue; }
    eq(msg.finish_reason, 'tool_calls', `${tag}: finish_reason`);
    eq(reasoning, REASON1, `${tag}: reasoning`);
    eq((msg.message.tool_calls || []).map((c) => [c.function.name, JSON.parse(c.function.arguments)]),
      [['get_weather', ARGS]], `${tag}: tool_calls`);
    check(!msg.message.content, `${tag}: no content (${JSON.stringify(msg.message.content)})`);
  }
  g.kill();
}

console.log(`gateway_tools: ${checks - failures}/${checks} checks passed`);
if (failures) { console.error(stderr.slice(-2000)); process.exit(1); }
