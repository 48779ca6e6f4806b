#!/usr/bin/env node
// The sampling and response fields of `kvasir gateway` (driven by
// tests/test_gateway_sampling.sh; test-only), through the official `openai`
// client where it has the field and fetch elsewhere. The reference is
// independent of the gateway's own arithmetic: `kvasir run --logits-out`
// dumps the raw f32 logits of every generated token, and this file applies
// the documented formulas to them (logit bias, repetition penalty over the
// last 64 tokens, OpenAI's presence and frequency penalties over the
// generated tokens) and takes the log-softmax in f64; the gateway's reported
// log-probabilities must match within 1e-5 and its top alternatives must be
// the true top-k. Also: n choices equal single requests with seed + i,
// echo, and every refused field a 400 that names it.
import { execFileSync } from 'node:child_process';
import { readFileSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import OpenAI from 'openai';

const url = process.env.KV_GW_URL, model = process.env.KV_GW_MODEL;
const file = process.env.KV_GW_FILE, bin = process.env.KV_BIN;
let failures = 0, checks = 0;
function check(ok, what) {
  checks++;
  if (!ok) { failures++; console.error(`FAIL: ${what}`); }
}
function eq(a, b, what) { check(a === b, `${what}: ${JSON.stringify(a)} !== ${JSON.stringify(b)}`); }
function near(a, b, what, tol = 1e-5) { check(Math.abs(a - b) <= tol, `${what}: ${a} vs ${b}`); }

const tmp = mkdtempSync(join(tmpdir(), 'kv_gws_'));
let nVocab = 0;

// kvasir run, greedy: the tokens and the raw logits of each generated token
function run(prompt, n, extra = [], chat = false) {
  const lf = join(tmp, 'logits.bin');
  const out = execFileSync(bin, ['run', '-m', file, '--json', '--threads', '1', '-p', prompt, '-n', String(n),
    '--temp', '0', '--logits-out', lf, ...(chat ? ['--chat'] : []), ...extra], { encoding: 'utf8' });
  const j = JSON.parse(out);
  const buf = readFileSync(lf);
  const f = new Float32Array(buf.buffer, buf.byteOffset, buf.length / 4);
  nVocab = f.length / j.tokens.length;
  const logits = [];
  for (let i = 0; i < j.tokens.length; i++) logits.push(Float64Array.from(f.subarray(i * nVocab, (i + 1) * nVocab)));
  return { tokens: j.tokens, prompt: j.prompt_tokens, text: j.text, logits };
}

function logSoftmax(l) {
  let max = -Infinity;
  for (const x of l) if (x > max) max = x;
  let sum = 0;
  for (const x of l) sum += Math.exp(x - max);
  const lse = max + Math.log(sum);
  return Float64Array.from(l, (x) => x - lse);
}
// the k best ids (higher first, lower id first on ties)
function topK(ls, k) {
  return [...ls.keys()].sort((a, b) => ls[b] - ls[a] || a - b).slice(0, k);
}
// the documented adjustments of one position's logits: bias, repetition
// penalty over the distinct tokens of the last 64 (prompt and generated),
// presence and frequency over the generated tokens before it
function adjust(l, o, prompt, gen) {
  const x = Float64Array.from(l);
  for (const [t, b] of Object.entries(o.bias || {})) x[Number(t)] += b;
  if (o.repeat && o.repeat !== 1) {
    const hist = [...prompt, ...gen].slice(-64);
    for (const t of new Set(hist)) x[t] = x[t] > 0 ? x[t] / o.repeat : x[t] * o.repeat;
  }
  const counts = new Map();
  for (const t of gen) counts.set(t, (counts.get(t) || 0) + 1);
  for (const [t, c] of counts) x[t] -= c * (o.frequency || 0) + (o.presence || 0);
  return x;
}

const openai = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'none', maxRetries: 0 });
async function post(path, body) {
  const r = await fetch(`${url}${path}`, { method: 'POST', headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body) });
  return { status: r.status, text: await r.text() };
}

const P = 'The quick brown fox jumps over the lazy dog and then';
const N = 12;

// ---- completions: logprobs of the plain distribution ---------------------
// (an end-of-generation token ends both and is not listed by the gateway)
function listed(ref, n, what) {
  check(n === ref.tokens.length || n === ref.tokens.length - 1, `${what}: ${n} entries for ${ref.tokens.length} tokens`);
  return Math.min(n, ref.tokens.length);
}
{
  const ref = run(P, N);
  const r = await openai.completions.create({ model, prompt: P, max_tokens: N, temperature: 0, logprobs: 5 });
  eq(r.choices[0].text, ref.text, 'completions text');
  const lp = r.choices[0].logprobs;
  const n = listed(ref, lp.token_logprobs.length, 'completions logprobs');
  for (let i = 0; i < n; i++) {
    const ls = logSoftmax(ref.logits[i]);
    near(lp.token_logprobs[i], ls[ref.tokens[i]], `completions token ${i} logprob`);
    const want = topK(ls, 5).map((t) => ls[t]);
    const got = Object.values(lp.top_logprobs[i]).sort((a, b) => b - a);
    // texts of different ids may coincide (a dictionary): the values present are among the true top 5
    for (const v of got) check(want.some((w) => Math.abs(w - v) <= 1e-5), `completions token ${i} top value ${v}`);
    near(got[0], want[0], `completions token ${i} best alternative`);
  }
  // llama-server's n_probs: ids, the true top-k in order
  const c = JSON.parse((await post('/completion', { prompt: P, n_predict: N, temperature: 0, n_probs: 7 })).text);
  const nc = listed(ref, c.completion_probabilities.length, '/completion n_probs');
  let off = 0;
  for (let i = 0; i < nc; i++) {
    const e = c.completion_probabilities[i];
    const ls = logSoftmax(ref.logits[i]);
    eq(e.id, ref.tokens[i], `/completion token ${i} id`);
    near(e.logprob, ls[e.id], `/completion token ${i} logprob`);
    eq(JSON.stringify(e.top_logprobs.map((t) => t.id)), JSON.stringify(topK(ls, 7)), `/completion token ${i} top ids`);
    e.top_logprobs.forEach((t) => near(t.logprob, ls[t.id], `/completion token ${i} alt ${t.id}`));
    // completions' text_offset: the bytes of the tokens before (the same tokens)
    eq(lp.text_offset[i], off, `completions token ${i} text_offset`);
    off += e.bytes.length;
  }
  // streamed: the same entries, split over the chunks
  const s = await openai.completions.create({ model, prompt: P, max_tokens: N, temperature: 0, logprobs: 5,
    stream: true });
  const st = [];
  for await (const ch of s) if (ch.choices[0]?.logprobs) st.push(...ch.choices[0].logprobs.token_logprobs);
  eq(JSON.stringify(st), JSON.stringify(lp.token_logprobs), 'completions streamed logprobs');
  console.log(`ok: completions and /completion logprobs equal the f64 log-softmax of kvasir run's logits`);
}

// ---- chat: logprobs and top_logprobs through the client -------------------
{
  const Q = 'Tell me about dragons.';
  const ref = run(Q, N, [], true);
  const params = { model, messages: [{ role: 'user', content: Q }], max_tokens: N, temperature: 0, logprobs: true,
    top_logprobs: 4 };
  const r = await openai.chat.completions.create(params);
  eq(r.choices[0].message.content, ref.text, 'chat text');
  const content = r.choices[0].logprobs.content;
  const gen = ref.tokens.slice(0, listed(ref, content.length, 'chat logprobs'));
  content.forEach((e, i) => {
    const ls = logSoftmax(ref.logits[i]);
    near(e.logprob, ls[gen[i]], `chat token ${i} logprob`);
    eq(e.top_logprobs.length, 4, `chat token ${i} top count`);
    const want = topK(ls, 4);
    e.top_logprobs.forEach((t, k) => near(t.logprob, ls[want[k]], `chat token ${i} alt ${k}`));
  });
  // a token's text is its bytes (where they are whole UTF-8; U+FFFD for the rest)
  for (const e of content)
    if (!e.token.includes('\ufffd')) eq(JSON.stringify([...Buffer.from(e.token)]), JSON.stringify(e.bytes), 'bytes');
  const s = await openai.chat.completions.create({ ...params, stream: true });
  const st = [];
  for await (const ch of s) if (ch.choices[0]?.logprobs?.content) st.push(...ch.choices[0].logprobs.content);
  eq(JSON.stringify(st), JSON.stringify(content), 'chat streamed logprobs equal the whole answer\'s');
  console.log('ok: chat logprobs/top_logprobs, whole and streamed, through the openai client');
}

// ---- logit_bias ----------------------------------------------------------
{
  const ref = run(P, 1);
  const ls0 = logSoftmax(ref.logits[0]);
  const order = topK(ls0, 10);
  const g0 = order[0], t = order[5];
  // +100 forces a token (greedy), every time
  let c = JSON.parse((await post('/completion', { prompt: P, n_predict: 6, temperature: 0, n_probs: 1,
    logit_bias: [[t, 100]], ignore_eos: true })).text);
  check(c.completion_probabilities.every((e) => e.id === t), `logit_bias +100 forces ${t}: ` +
    JSON.stringify(c.completion_probabilities.map((e) => e.id)));
  // -100 bans the greedy token (OpenAI's object form, through the client)
  const r = await openai.completions.create({ model, prompt: P, max_tokens: 6, temperature: 0, logprobs: 1,
    logit_bias: { [g0]: -100 }, ignore_eos: true });
  c = JSON.parse((await post('/completion', { prompt: P, n_predict: 6, temperature: 0, n_probs: 1,
    logit_bias: { [g0]: -100 }, ignore_eos: true })).text);
  check(c.completion_probabilities.every((e) => e.id !== g0), `logit_bias -100 bans ${g0}`);
  eq(c.completion_probabilities[0].id, order[1], 'the banned token\'s runner-up comes first');
  near(r.choices[0].logprobs.token_logprobs[0], logSoftmax(adjust(ref.logits[0], { bias: { [g0]: -100 } }, [], []))[order[1]],
    'logprob after a -100 bias');
  // small biases: the reported distribution is the biased one
  const bias = { [order[3]]: 2.5, [g0]: -1.25, [order[7]]: 0.5 };
  const b = await openai.completions.create({ model, prompt: P, max_tokens: 1, temperature: 0, logprobs: 3,
    logit_bias: bias });
  const lb = logSoftmax(adjust(ref.logits[0], { bias }, [], []));
  const best = topK(lb, 3);
  near(b.choices[0].logprobs.token_logprobs[0], lb[best[0]], 'biased first token: its logprob');
  const got = Object.values(b.choices[0].logprobs.top_logprobs[0]).sort((x, y) => y - x);
  got.forEach((v, k) => near(v, lb[best[k]], `biased alternative ${k}`));
  console.log('ok: logit_bias +100 forces, -100 bans, and the reported distribution is the biased one');
}

// ---- penalties: the formula over kvasir run's raw logits ------------------
let changed = 0;
for (const o of [{ repeat: 1.3 }, { presence: 0.8, frequency: 0.6 }, { repeat: 1.15, presence: -0.5, frequency: 1.1 },
  { presence: 2, frequency: 2 }]) {
  const flags = [];
  if (o.repeat) flags.push('--repeat-penalty', String(o.repeat));
  if (o.presence) flags.push('--presence-penalty', String(o.presence));
  if (o.frequency) flags.push('--frequency-penalty', String(o.frequency));
  const ref = run(P, 24, flags);
  const body = { model, prompt: P, max_tokens: 24, temperature: 0, logprobs: 5 };
  if (o.repeat) body.repeat_penalty = o.repeat;
  if (o.presence) body.presence_penalty = o.presence;
  if (o.frequency) body.frequency_penalty = o.frequency;
  const r = await openai.completions.create(body);
  const what = JSON.stringify(o);
  eq(r.choices[0].text, ref.text, `${what}: text equals kvasir run's`);
  const lp = r.choices[0].logprobs;
  const n = listed(ref, lp.token_logprobs.length, `${what} logprobs`);
  for (let i = 0; i < n; i++) {
    const la = logSoftmax(adjust(ref.logits[i], o, ref.prompt, ref.tokens.slice(0, i)));
    near(lp.token_logprobs[i], la[ref.tokens[i]], `${what} token ${i} logprob`);
    eq(ref.tokens[i], topK(la, 1)[0], `${what} token ${i} is the penalized argmax`);
    const want = topK(la, 5).map((t) => la[t]);
    near(Math.max(...Object.values(lp.top_logprobs[i])), want[0], `${what} token ${i} best alternative`);
  }
  if (run(P, 24).text !== ref.text) changed++;
}
check(changed > 0, 'some penalty changed the text');
// Ollama's options, the same penalties
{
  const ref = run(P, 16, ['--repeat-penalty', '1.3', '--presence-penalty', '0.5']);
  const r = JSON.parse((await post('/api/generate', { model, prompt: P, raw: true, stream: false,
    options: { num_predict: 16, temperature: 0, repeat_penalty: 1.3, presence_penalty: 0.5, seed: 1 } })).text);
  eq(r.response, ref.text, 'Ollama options repeat_penalty + presence_penalty');
  console.log('ok: repetition, presence and frequency penalties follow the documented formula');
}

// ---- n choices: each the single request with seed + i ---------------------
{
  const base = { model, prompt: P, max_tokens: 10, temperature: 0.9, seed: 42 };
  const r = await openai.completions.create({ ...base, n: 3 });
  eq(r.choices.length, 3, 'n=3 choices');
  let total = 0;
  for (let i = 0; i < 3; i++) {
    const one = await openai.completions.create({ ...base, seed: 42 + i });
    eq(r.choices[i].index, i, `choice ${i} index`);
    eq(r.choices[i].text, one.choices[0].text, `choice ${i} equals seed ${42 + i}`);
    total += one.usage.completion_tokens;
  }
  eq(r.usage.completion_tokens, total, 'n=3 usage sums the choices');
  const msgs = [{ role: 'user', content: 'Why is the sky blue?' }];
  const cr = await openai.chat.completions.create({ model, messages: msgs, max_tokens: 8, temperature: 1, seed: 7,
    n: 3 });
  const s = await openai.chat.completions.create({ model, messages: msgs, max_tokens: 8, temperature: 1, seed: 7,
    n: 3, stream: true });
  const texts = ['', '', ''], fins = [null, null, null];
  for await (const ch of s)
    for (const c of ch.choices) {
      if (c.delta?.content) texts[c.index] += c.delta.content;
      if (c.finish_reason) fins[c.index] = c.finish_reason;
    }
  for (let i = 0; i < 3; i++) {
    const one = await openai.chat.completions.create({ model, messages: msgs, max_tokens: 8, temperature: 1,
      seed: 7 + i });
    eq(cr.choices[i].message.content, one.choices[0].message.content, `chat choice ${i} equals seed ${7 + i}`);
    eq(texts[i], one.choices[0].message.content, `streamed chat choice ${i} equals seed ${7 + i}`);
    check(fins[i] !== null, `streamed choice ${i} has its finish_reason`);
  }
  check(new Set(texts).size > 1, 'the choices differ');
  // the later choices take the first one's prompt from the prompt cache
  const cached = async () => Number((await (await fetch(`${url}/metrics`)).text())
    .match(/^kvasir_gateway_prompt_cache_tokens_total (\d+)/m)[1]);
  const long = Array.from({ length: 120 }, (_, i) => `w${i}`).join(' ');
  const before = await cached();
  const lr = await openai.completions.create({ model, prompt: long, max_tokens: 3, n: 3, seed: 1 });
  const after = await cached();
  check(after - before >= 2 * 64, `n=3 over a ${lr.usage.prompt_tokens}-token prompt: ${after - before} cached tokens ` +
    'taken (the two later choices share the first one\'s prefill)');
  console.log('ok: n choices equal single requests with seed, seed+1, seed+2 (whole and streamed)');
}

// ---- echo -------------------------------------------------------------
{
  const a = await openai.completions.create({ model, prompt: P, max_tokens: 6, temperature: 0 });
  const e = await openai.completions.create({ model, prompt: P, max_tokens: 6, temperature: 0, echo: true });
  eq(e.choices[0].text, P + a.choices[0].text, 'echo: the prompt, then the completion');
  console.log('ok: echo');
}

// ---- refusals: a 400 naming the field ---------------------------------
const refused = [
  ['/v1/completions', { prompt: P, suffix: 'end' }, 'suffix'],
  ['/v1/completions', { prompt: P, echo: true, logprobs: 1, n: 2 }, 'echo'],
  ['/v1/completions', { prompt: P, best_of: 2 }, 'best_of'],
  ['/v1/completions', { prompt: P, logprobs: 21 }, 'logprobs'],
  ['/v1/completions', { prompt: P, n: 9 }, "'n'"],
  ['/v1/completions', { prompt: P, logit_bias: { 99999999: 1 } }, 'logit_bias'],
  ['/v1/completions', { prompt: P, logit_bias: { '12': 101 } }, 'logit_bias'],
  ['/v1/completions', { prompt: P, logit_bias: { abc: 1 } }, 'logit_bias'],
  ['/v1/completions', { prompt: P, presence_penalty: 2.5 }, 'presence_penalty'],
  ['/v1/completions', { prompt: P, frequency_penalty: -3 }, 'frequency_penalty'],
  ['/v1/chat/completions', { messages: [{ role: 'user', content: 'x' }], top_logprobs: 3 }, 'top_logprobs'],
  ['/v1/chat/completions', { messages: [{ role: 'user', content: 'x' }], logprobs: true, top_logprobs: 21 },
    'top_logprobs'],
  ['/v1/chat/completions', { messages: [{ role: 'user', content: 'x' }], functions: [{ name: 'f' }] }, 'functions'],
  ['/v1/chat/completions', { messages: [{ role: 'user', content: 'x' }], modalities: ['audio'] }, 'modalities'],
  ['/v1/chat/completions', { messages: [{ role: 'user', content: 'x' }], audio: { voice: 'x' } }, 'audio'],
  ['/v1/chat/completions', { messages: [{ role: 'user', content: 'x' }], prediction: { type: 'content' } },
    'prediction'],
  ['/completion', { prompt: P, mirostat: 2 }, 'mirostat'],
  ['/completion', { prompt: P, n_probs: 50 }, 'n_probs'],
  ['/completion', { prompt: P, logit_bias: [['hello', 1]] }, 'logit_bias'],
  ['/api/generate', { model, prompt: P, options: { mirostat: 1 } }, 'mirostat'],
  ['/api/chat', { model, messages: [{ role: 'user', content: 'x' }], options: { typical_p: 0.5 } }, 'typical_p'],
  ['/api/chat', { model, messages: [{ role: 'user', content: 'x' }], logprobs: true }, 'logprobs'],
  ['/api/chat', { model, messages: [{ role: 'user', content: 'x' }], top_logprobs: 3 }, 'top_logprobs'],
  ['/api/generate', { model, prompt: P, logprobs: true }, 'logprobs'],
  ['/v1/messages', { model, max_tokens: 2, messages: [{ role: 'user', content: 'x' }],
    mcp_servers: [{ type: 'url', url: 'http://x', name: 'x' }] }, 'mcp_servers'],
];
for (const [path, body, name] of refused) {
  const r = await post(path, path.startsWith('/v1/') ? { max_tokens: 2, ...body } : body);
  check(r.status === 400 && r.text.includes(name), `${path} ${JSON.stringify(body).slice(0, 80)}: ${r.status} ` +
    `${r.text.slice(0, 200)} (expected a 400 naming ${name})`);
}
// the neutral values change nothing and are taken
for (const body of [{ best_of: 1 }, { n: 1 }, { logit_bias: {} }, { presence_penalty: 0 }, { modalities: ['text'] }]) {
  const r = await post('/v1/completions', { prompt: P, max_tokens: 2, ...body });
  eq(r.status, 200, `neutral ${JSON.stringify(body)}`);
}
console.log('ok: refused fields are 400s naming them');

rmSync(tmp, { recursive: true, force: true });
console.log(`${checks} checks, ${failures} failures`);
process.exit(failures ? 1 : 0);
