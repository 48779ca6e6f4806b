#!/usr/bin/env node
// The reasoning budget end to end (driven by tests/test_gateway_reasoning.sh;
// test-only): see that file for what is checked.
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

const gw = spawn(bin, ['gateway', '-m', `${dir}/big.gguf`, '--chat-template', `${dir}/qwen35.jinja`,
  '--listen', '127.0.0.1:0', '--threads', '2', '--name', 'tiny'], { stdio: ['ignore', 'pipe', 'pipe'] });
let stderr = '';
gw.stderr.on('data', (b) => { stderr += b; });
const url = await new Promise((resolve, reject) => {
  let out = '';
  gw.stdout.on('data', (b) => { out += b; const m = out.match(/^listening on (\S+)/m); if (m) resolve('http://' + m[1]); });
  gw.on('exit', (c) => reject(new Error(`gateway exited ${c}: ${stderr}`)));
});
async function post(path, body) {
  const r = await fetch(url + path, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
  return { status: r.status, json: await r.json() };
}
const openai = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'none', maxRetries: 0 });
const anthropic = new Anthropic({ baseURL: url, apiKey: 'none', maxRetries: 0 });
const model = 'tiny', MAX = 24, B = 6;
const messages = [{ role: 'user', content: 'Why is the sky blue? Think first.' }];
const base = { model, messages, max_tokens: MAX, temperature: 0, logprobs: true };
const text = (entries) => Buffer.from(entries.flatMap((e) => e.bytes)).toString('utf8');

// ---- OpenAI chat: a run without a budget, then with one ----
const full = await openai.chat.completions.create(base);
const cut = await openai.chat.completions.create({ ...base, thinking_budget_tokens: B });
const fl = full.choices[0].logprobs.content, cl = cut.choices[0].logprobs.content;
check(fl.length > B && !text(fl).includes('</think>'), `the run without a budget reasons past ${B} tokens: ${JSON.stringify(text(fl))}`);
eq(cl.slice(0, B), fl.slice(0, B), 'the first budget tokens are those of the run without a budget');
const forcedIds = (await post('/tokenize', { content: '\n</think>\n\n', parse_special: true })).json.tokens;
const F = forcedIds.length;
eq(text(cl.slice(B, B + F)), '\n</think>\n\n', 'then the forced end of reasoning');
check(cl.slice(B, B + F).every((e) => e.logprob === null && e.top_logprobs.length === 0), 'forced tokens: logprob null');
check(cl.slice(B + F).every((e) => typeof e.logprob === 'number'), 'then sampled tokens again');
eq(cut.usage.completion_tokens, cl.length + (cut.choices[0].finish_reason === 'stop' ? 1 : 0), 'usage counts the forced tokens');
check(cut.usage.completion_tokens <= MAX, `max_tokens holds: ${cut.usage.completion_tokens}`);
const reasoning = cut.choices[0].message.reasoning_content || '';
eq(reasoning, text(cl.slice(0, B)).trim(), 'reasoning_content: the budget tokens');
check(full.choices[0].message.reasoning_content.startsWith(reasoning), 'reasoning: a prefix of the unbounded one');
eq(cut.choices[0].message.content || '', text(cl.slice(B + F)).trim(), 'content: what follows the forced end');

// ---- what follows is the model's own continuation of prompt + B tokens + forced (token ids, /completion) ----
{
  const prompt = (await post('/apply-template', { messages })).json.prompt;
  const pids = (await post('/tokenize', { content: prompt, parse_special: true, add_special: true })).json.tokens;
  const head = await post('/completion', { prompt: pids, n_predict: B, temperature: 0, n_probs: 1 });
  const hid = head.json.completion_probabilities.map((e) => e.id);
  eq(head.json.completion_probabilities.map((e) => e.logprob), fl.slice(0, B).map((e) => e.logprob),
    '/completion over the rendered prompt: the same first tokens');
  const rest = cl.length - B - F;
  const tail = await post('/completion', { prompt: [...pids, ...hid, ...forcedIds], n_predict: MAX - B - F,
    temperature: 0, n_probs: 1 });
  const tl = tail.json.completion_probabilities;
  eq(tl.slice(0, rest).map((e) => e.token), cl.slice(B + F).map((e) => e.token), 'the answer: a plain continuation (tokens)');
  const close = tl.slice(0, rest).every((e, i) => Math.abs(e.logprob - cl[B + F + i].logprob) < 1e-4);
  check(close, 'the answer: a plain continuation (logprobs)');
}

// ---- a budget of 0: the end is forced before anything is sampled ----
{
  const z = await openai.chat.completions.create({ ...base, thinking_budget_tokens: 0 });
  const zl = z.choices[0].logprobs.content;
  eq(text(zl.slice(0, F)), '\n</think>\n\n', 'budget 0: the output opens with the forced end');
  check(!z.choices[0].message.reasoning_content, 'budget 0: no reasoning');
}
// ---- streamed: the same deltas accumulated ----
{
  const st = openai.chat.completions.stream({ ...base, thinking_budget_tokens: B });
  let r = '';
  st.on('chunk', (ch) => { if (ch.choices.length && ch.choices[0].delta.reasoning_content) r += ch.choices[0].delta.reasoning_content; });
  const fin = await st.finalChatCompletion();
  eq([r, fin.choices[0].message.content], [reasoning, cut.choices[0].message.content], 'streamed: reasoning and content');
}

// ---- Anthropic: thinking.budget_tokens below max_tokens, whole and streamed ----
{
  const p = { model, max_tokens: MAX, temperature: 0, messages, thinking: { type: 'enabled', budget_tokens: B } };
  const m = await anthropic.messages.create(p);
  eq(m.content.map((b) => b.type), ['thinking', 'text'], 'anthropic: blocks');
  eq(m.content[0].thinking, reasoning, 'anthropic: thinking is the budget tokens');
  eq(m.content[1].text, cut.choices[0].message.content, 'anthropic: text follows the forced end');
  eq(m.usage.output_tokens, cut.usage.completion_tokens, 'anthropic: output tokens');
  const s = await anthropic.messages.stream(p).finalMessage();
  eq(s.content.map((b) => [b.type, b.thinking ?? b.text]), m.content.map((b) => [b.type, b.thinking ?? b.text]),
    'anthropic stream: the same blocks');
  // at or above max_tokens it never binds
  const u = await anthropic.messages.create({ ...p, thinking: { type: 'enabled', budget_tokens: MAX } });
  eq(u.content.map((b) => b.type), ['thinking'], 'anthropic: a budget at max_tokens does not bind');
}
// ---- refused: a budget with a grammar; a bad value ----
for (const [body, want] of [
  [{ thinking_budget_tokens: 4, response_format: { type: 'json_object' } }, 'thinking_budget_tokens'],
  [{ thinking_budget_tokens: -2 }, 'thinking_budget_tokens'],
  [{ thinking_budget_tokens: 'x' }, 'thinking_budget_tokens'],
]) {
  const r = await post('/v1/chat/completions', { ...base, ...body });
  eq(r.status, 400, `refused ${JSON.stringify(body)}: status`);
  check(JSON.stringify(r.json).includes(want), `refused ${JSON.stringify(body)}: says '${want}': ${JSON.stringify(r.json)}`);
}

gw.kill();
console.log(`gateway_reasoning: ${checks - failures}/${checks} checks passed`);
if (failures) { console.error(stderr.slice(-2000)); process.exit(1); }
