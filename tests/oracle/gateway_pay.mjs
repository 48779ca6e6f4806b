#!/usr/bin/env node
// Paying for completions with the official clients (driven by
// tests/test_gateway_pay.sh; test-only). Two `kvasir gateway --ledger`
// processes (A and B, other ids and prices) settle into one ledger. Every
// request carries X-KVR-Payment made by `kvasir wallet pay`. The reference
// for every amount is computed here: the usage the client reports times the
// prices GET /v1/prices published, against balances read with `kvasir ledger
// balance`; `kvasir ledger check` must exit 0 after every case.
import { execFileSync } from 'node:child_process';
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';

const env = process.env;
const bin = env.KV_BIN, db = env.KV_DB, model = env.KV_GW_MODEL;
const urlA = env.KV_GW_A, urlB = env.KV_GW_B;
const key = { c1: env.KV_C1, c2: env.KV_C2, c3: env.KV_C3 };
let failures = 0, checks = 0;
function check(ok, what) {
  checks++;
  if (!ok) { failures++; console.error(`FAIL: ${what}`); }
}
function eq(a, b, what) { check(a === b, `${what}: ${JSON.stringify(a)} !== ${JSON.stringify(b)}`); }

const kv = (...args) => execFileSync(bin, args, { encoding: 'utf8' }).trim();
const account = (k) => JSON.parse(kv('wallet', 'show', '--key', k, '--json')).account;
const balance = (acct) => JSON.parse(kv('ledger', 'balance', '--db', db, '--account', acct, '--json')).balance;
const pay = (k, gw, max, expires = 3600) =>
  kv('wallet', 'pay', '--key', k, '--gateway', gw, '--max', String(max), '--expires', String(expires));
function ledgerCheck(what) {
  try { kv('ledger', 'check', '--db', db); check(true, ''); }
  catch (e) { check(false, `ledger check after ${what}: ${e.stdout}${e.stderr}`); }
}

const prices = async (url) => (await fetch(`${url}/v1/prices`)).json();
const pA = await prices(urlA), pB = await prices(urlB);
check(pA.gateway !== pB.gateway, 'the two gateways have other ids');
check(pA.prompt_token > 0 && pA.completion_token > 0 && pA.unit === 'micro-KVR', `prices ${JSON.stringify(pA)}`);
const costOf = (p, prompt, completion) => prompt * p.prompt_token + completion * p.completion_token;
const acct = { c1: account(key.c1), c2: account(key.c2), c3: account(key.c3) };
const earners = [pA.node, pB.node, 'treasury'];
const earned = () => earners.reduce((s, a) => s + balance(a), 0);

const oaA = new OpenAI({ baseURL: `${urlA}/v1`, apiKey: 'none', maxRetries: 0 });
const oaB = new OpenAI({ baseURL: `${urlB}/v1`, apiKey: 'none', maxRetries: 0 });
const anA = new Anthropic({ baseURL: urlA, apiKey: 'none', maxRetries: 0 });
const msgs = [{ role: 'user', content: 'Tell me about the swarm.' }];
const hdr = (h) => ({ headers: { 'X-KVR-Payment': h } });

// ---- paid requests in every API, whole and streamed: exact amounts ---------
// run(h) does one request with header h and returns {prompt, completion}
// from what the client itself reports.
const apis = {
  'openai chat': async (h) => {
    const { data, response } = await oaA.chat.completions.create(
      { model, messages: msgs, max_tokens: 17, temperature: 0 }, hdr(h)).withResponse();
    const r = { prompt: data.usage.prompt_tokens, completion: data.usage.completion_tokens };
    eq(Number(response.headers.get('x-kvr-cost')), costOf(pA, r.prompt, r.completion), 'X-KVR-Cost header');
    return r;
  },
  'openai chat stream': async (h) => {
    const s = await oaA.chat.completions.create({ model, messages: msgs, max_tokens: 13, temperature: 0.7, seed: 3,
      stream: true, stream_options: { include_usage: true } }, hdr(h));
    let usage = null;
    for await (const ch of s) if (ch.usage) usage = ch.usage;
    return { prompt: usage.prompt_tokens, completion: usage.completion_tokens };
  },
  'openai completions': async (h) => {
    const c = await oaA.completions.create({ model, prompt: 'Once upon a time', max_tokens: 9, temperature: 0 }, hdr(h));
    return { prompt: c.usage.prompt_tokens, completion: c.usage.completion_tokens };
  },
  'anthropic': async (h) => {
    const m = await anA.messages.create({ model, max_tokens: 11, messages: msgs, temperature: 0 }, hdr(h));
    return { prompt: m.usage.input_tokens + (m.usage.cache_read_input_tokens ?? 0), completion: m.usage.output_tokens };
  },
  'anthropic stream': async (h) => {
    const st = anA.messages.stream({ model, max_tokens: 15, messages: msgs, temperature: 0.5, top_k: 20 }, hdr(h));
    const m = await st.finalMessage();
    return { prompt: m.usage.input_tokens + (m.usage.cache_read_input_tokens ?? 0), completion: m.usage.output_tokens };
  },
  'ollama': async (h) => {
    const r = await fetch(`${urlA}/api/chat`, { method: 'POST', headers: { 'X-KVR-Payment': h },
      body: JSON.stringify({ model, messages: msgs, stream: false, options: { num_predict: 8, temperature: 0 } }) });
    eq(r.status, 200, 'ollama status');
    const j = await r.json();
    return { prompt: j.prompt_eval_count, completion: j.eval_count };
  },
  'ollama stream': async (h) => {
    const r = await fetch(`${urlA}/api/chat`, { method: 'POST', headers: { 'X-KVR-Payment': h },
      body: JSON.stringify({ model, messages: msgs, options: { num_predict: 10, temperature: 0 } }) });
    const lines = (await r.text()).trim().split('\n').map((l) => JSON.parse(l));
    const last = lines[lines.length - 1];
    check(last.done === true, 'ollama stream ends done');
    return { prompt: last.prompt_eval_count, completion: last.eval_count };
  },
};
const used = []; // authorizations already settled, for the replays below
let promptTokens = 0;
for (const [name, run] of Object.entries(apis)) {
  const h = pay(key.c1, pA.gateway, 100000);
  const b0 = balance(acct.c1), e0 = earned();
  const u = await run(h);
  const want = costOf(pA, u.prompt, u.completion);
  check(u.completion > 0 && u.prompt > 0, `${name}: usage ${JSON.stringify(u)}`);
  eq(b0 - balance(acct.c1), want, `${name}: the consumer paid prompt x price + completion x price`);
  eq(earned() - e0, want, `${name}: nodes and treasury got exactly the cost`);
  if (name === 'openai chat') promptTokens = u.prompt;
  used.push(h);
  ledgerCheck(name);
}

// ---- the max cuts the completion: finish_reason "length" at what it pays --
{
  const max = costOf(pA, promptTokens, 3);
  const b0 = balance(acct.c1);
  const r = await oaA.chat.completions.create({ model, messages: msgs, max_tokens: 50, temperature: 0,
    ignore_eos: true }, hdr(pay(key.c1, pA.gateway, max)));
  eq(r.usage.completion_tokens, 3, 'a max paying for 3 tokens gives 3');
  eq(r.choices[0].finish_reason, 'length', 'cut by the max: finish_reason');
  eq(b0 - balance(acct.c1), max, 'cut by the max: the whole max is the cost');
  ledgerCheck('max cut');
}

// ---- 402 in each API's shape, nothing charged -----------------------------
const total = () => balance(acct.c1) + balance(acct.c2) + earned();
const before402 = { c1: balance(acct.c1), c2: balance(acct.c2), all: total() };
const expired = pay(key.c1, pA.gateway, 1000, 1);
await new Promise((r) => setTimeout(r, 1100));
const refusals = {
  'missing': null,
  'malformed': 'kvr1.not-an-authorization',
  'expired': expired,
  'another gateway': pay(key.c1, pB.gateway, 1000),
  'replayed': used[0],
  'uncoverable': pay(key.c2, pA.gateway, 1000), // c2 holds less than 1000
  'max below the prompt': pay(key.c1, pA.gateway, costOf(pA, promptTokens, 1) - 1),
};
for (const [why, h] of Object.entries(refusals)) {
  const opts = h ? hdr(h) : {};
  try {
    await oaA.chat.completions.create({ model, messages: msgs, max_tokens: 5 }, opts);
    check(false, `openai ${why}: served`);
  } catch (e) {
    eq(e.status, 402, `openai ${why}: status`);
    eq(e.error && e.error.code, 'payment_required', `openai ${why}: error.code`);
    check(typeof (e.error && e.error.message) === 'string' && e.error.message.length > 0, `openai ${why}: message`);
  }
  try {
    await anA.messages.create({ model, max_tokens: 5, messages: msgs }, opts);
    check(false, `anthropic ${why}: served`);
  } catch (e) {
    eq(e.status, 402, `anthropic ${why}: status`);
    eq(e.error && e.error.type, 'error', `anthropic ${why}: body type`);
    eq(e.error && e.error.error && e.error.error.type, 'billing_error', `anthropic ${why}: error.type`);
  }
  const r = await fetch(`${urlA}/api/chat`, { method: 'POST', headers: h ? { 'X-KVR-Payment': h } : {},
    body: JSON.stringify({ model, messages: msgs, stream: false }) });
  eq(r.status, 402, `ollama ${why}: status`);
  const j = await r.json();
  check(typeof j.error === 'string' && Object.keys(j).length === 1, `ollama ${why}: shape ${JSON.stringify(j)}`);
}
eq(balance(acct.c1), before402.c1, '402s: consumer 1 charged nothing');
eq(balance(acct.c2), before402.c2, '402s: consumer 2 charged nothing');
eq(total(), before402.all, '402s: nothing moved');
ledgerCheck('402s');

// ---- replay across the two gateways ---------------------------------------
{
  const hA = pay(key.c1, pA.gateway, 50000), hB = pay(key.c1, pB.gateway, 50000);
  const b0 = balance(acct.c1);
  const r = await oaA.chat.completions.create({ model, messages: msgs, max_tokens: 6, temperature: 0 }, hdr(hA));
  const paidA = costOf(pA, r.usage.prompt_tokens, r.usage.completion_tokens);
  for (const [h, c, what] of [[hA, oaB, 'A\'s settled authorization at B'], [hB, oaA, 'B\'s authorization at A']]) {
    try {
      await c.chat.completions.create({ model, messages: msgs, max_tokens: 6 }, hdr(h));
      check(false, `${what}: served`);
    } catch (e) { eq(e.status, 402, `${what}: status`); }
  }
  const rb = await oaB.chat.completions.create({ model, messages: msgs, max_tokens: 6, temperature: 0 }, hdr(hB));
  const paidB = costOf(pB, rb.usage.prompt_tokens, rb.usage.completion_tokens);
  check(paidA !== paidB || pA.prompt_token !== pB.prompt_token, 'the gateways charge their own prices');
  try {
    await oaB.chat.completions.create({ model, messages: msgs, max_tokens: 6 }, hdr(hB));
    check(false, 'B\'s authorization used twice at B: served');
  } catch (e) { eq(e.status, 402, 'B\'s authorization twice: status'); }
  eq(b0 - balance(acct.c1), paidA + paidB, 'replays: paid once at A, once at B, at their prices');
  ledgerCheck('replays');
}

// ---- concurrent spends of one balance, across two gateway processes -------
{
  const M = 4000, start = balance(acct.c3); // c3 covers two holds of M, not three
  check(start >= 2 * M && start < 3 * M, `consumer 3 starts with ${start}`);
  const e0 = earned();
  const jobs = [];
  for (let i = 0; i < 8; i++) {
    const c = i % 2 ? oaB : oaA, p = i % 2 ? pB : pA;
    const h = pay(key.c3, p.gateway, M);
    jobs.push(c.chat.completions.create({ model, messages: msgs, max_tokens: 24, temperature: 0, ignore_eos: true },
      hdr(h)).then((r) => ({ ok: true, cost: costOf(p, r.usage.prompt_tokens, r.usage.completion_tokens) }),
      (e) => ({ ok: false, status: e.status, msg: e.error && e.error.message })));
  }
  const res = await Promise.all(jobs);
  const ok = res.filter((r) => r.ok), refused = res.filter((r) => !r.ok);
  for (const r of refused) {
    eq(r.status, 402, 'concurrent: a refusal is a 402');
    check(/insufficient funds/.test(r.msg || ''), `concurrent: refused for funds (${r.msg})`);
  }
  check(ok.length >= 2, `concurrent: the two holds the balance covers were served (${ok.length})`);
  const spent = ok.reduce((s, r) => s + r.cost, 0);
  eq(start - balance(acct.c3), spent, 'concurrent: the balance fell by exactly the served costs');
  eq(earned() - e0, spent, 'concurrent: nodes and treasury got exactly that');
  check(balance(acct.c3) >= 0 && spent <= start, 'concurrent: never overspent');
  console.log(`concurrent: 8 requests from one balance of ${start} (holds of ${M}) on 2 gateways: ` +
              `${ok.length} served, ${refused.length} refused (402 funds), ${spent} spent`);
  ledgerCheck('concurrent');
}

console.log(`gateway_pay: ${checks} checks, ${failures} failed`);
process.exit(failures ? 1 : 0);
