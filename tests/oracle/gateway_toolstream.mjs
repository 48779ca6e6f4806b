#!/usr/bin/env node
// Tool-call arguments streamed as they come (driven by
// tests/test_gateway_toolstream.sh; test-only): see that file.
import { spawn } from 'node:child_process';
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';

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
const weather = { type: 'function', function: { name: 'get_weather', description: 'The weather in a city',
  parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 12 }, days: { type: 'integer' },
    units: { enum: ['c', 'f'] } }, required: ['city', 'days'] } } };
const add = { type: 'function', function: { name: 'add', description: 'Adds',
  parameters: { type: 'object', properties: { a: { type: 'integer' }, b: { type: 'integer' } }, required: ['a', 'b'] } } };
const messages = [{ role: 'user', content: 'Weather in Oslo for two days?' }];
// how many fragments a call's arguments come in depends on how many tokens
// the connection finds at once (a loaded machine: several); over all runs,
// more fragments than calls (the parser's own test pushes byte by byte)
let totalFrags = 0, totalCalls = 0;

for (const t of ['Qwen3.5-4B', 'deepseek-ai-DeepSeek-V3.1', 'deepseek-ai-DeepSeek-R1-Distill-Qwen-32B', 'openai-gpt-oss-120b']) {
  const gw = spawn(bin, ['gateway', '-m', `${dir}/big.gguf`, '--chat-template', `${dir}/${t}.jinja`,
    '--listen', '127.0.0.1:0', '--threads', '2', '--name', 'tiny', '--quiet'], { stdio: ['ignore', 'pipe', 'pipe'] });
  let stderr = '';
  gw.stderr.on('data', (b) => { stderr += b; });
  const url = await new Promise((resolve, reject) => {
    let out = '';
    gw.stdout.on('data', (b) => { out += b; const m = out.match(/^listening on (\S+)/m); if (m) resolve('http://' + m[1]); });
    gw.on('exit', (c) => reject(new Error(`gateway exited ${c}: ${stderr}`)));
  });
  const openai = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'none', maxRetries: 0 });
  for (const [seed, choice] of [[1, 'required'], [2, 'required'], [3, { type: 'function', function: { name: 'get_weather' } }]]) {
    const tag = `${t} seed ${seed}`;
    const params = { model: 'tiny', messages, tools: [weather, add], tool_choice: choice, seed, max_tokens: 400,
      parallel_tool_calls: false }; // one call: a parallel run would end cut by max_tokens
    const whole = (await openai.chat.completions.create(params)).choices[0];
    const st = openai.chat.completions.stream(params);
    let frags = 0;
    st.on('chunk', (ch) => {
      for (const c of (ch.choices[0] && ch.choices[0].delta.tool_calls) || [])
        if (c.function && c.function.arguments) frags++;
    });
    const s = (await st.finalChatCompletion()).choices[0];
    const calls = (m) => (m.message.tool_calls || []).map((c) => [c.function.name, c.function.arguments]);
    check(whole.finish_reason === 'tool_calls' && calls(whole).length >= 1, `${tag}: whole: a call (${JSON.stringify(whole)})`);
    eq(calls(s), calls(whole), `${tag}: the streamed calls accumulated are the whole ones`);
    eq(s.finish_reason, whole.finish_reason, `${tag}: finish_reason`);
    check(frags >= calls(whole).length, `${tag}: arguments came in ${frags} fragments for ${calls(whole).length} calls`);
    totalFrags += frags; totalCalls += calls(whole).length;
    for (const [, a] of calls(whole)) check(typeof JSON.parse(a) === 'object', `${tag}: arguments parse`);
  }
  // cut by max_tokens inside the call: the same, whole and streamed (the call as far as it went, or content)
  for (const max of [16, 24, 32]) {
    const params = { model: 'tiny', messages, tools: [weather, add], tool_choice: 'required', seed: 5,
      max_tokens: max, parallel_tool_calls: false };
    const whole = (await openai.chat.completions.create(params)).choices[0];
    const s = (await openai.chat.completions.stream(params).finalChatCompletion()).choices[0];
    const calls = (m) => (m.message.tool_calls || []).map((c) => [c.function.name, c.function.arguments]);
    eq([s.finish_reason, s.message.content || '', calls(s)], [whole.finish_reason, whole.message.content || '', calls(whole)],
      `${t} max_tokens ${max}: streamed as whole`);
  }
  if (t === 'Qwen3.5-4B') { // Anthropic: input_json_delta as it comes
    const anthropic = new Anthropic({ baseURL: url, apiKey: 'none', maxRetries: 0 });
    const aTools = [weather, add].map((x) => ({ name: x.function.name, description: x.function.description,
      input_schema: x.function.parameters }));
    const p = { model: 'tiny', max_tokens: 400, temperature: 0, messages, tools: aTools,
      tool_choice: { type: 'any', disable_parallel_tool_use: true } };
    const m = await anthropic.messages.create(p);
    const stream = anthropic.messages.stream(p);
    let deltas = 0;
    stream.on('streamEvent', (e) => { if (e.type === 'content_block_delta' && e.delta.type === 'input_json_delta') deltas++; });
    const sm = await stream.finalMessage();
    const uses = (x) => x.content.filter((b) => b.type === 'tool_use').map((b) => [b.name, b.input]);
    check(uses(m).length >= 1, `anthropic: a tool_use (${JSON.stringify(m.content)})`);
    eq(uses(sm), uses(m), 'anthropic: the streamed tool_use input is the whole one');
    check(deltas >= uses(m).length, `anthropic: ${deltas} input_json_delta events for ${uses(m).length} calls`);
  }
  gw.kill();
}
check(totalFrags > totalCalls, `arguments in ${totalFrags} fragments for ${totalCalls} calls over all runs`);
console.log(`gateway_toolstream: ${checks - failures}/${checks} checks passed`);
if (failures) process.exit(1);
