#!/usr/bin/env node
// The prompt's log-probabilities (driven by tests/test_gateway_echo.sh;
// test-only): see that file for what is checked.
import { spawn } from 'node:child_process';
import OpenAI from 'openai';

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
const near = (a, b) => Math.abs(a - b) < 1e-5;

const gw = spawn(bin, ['gateway', '-m', `${dir}/m.gguf`, '--listen', '127.0.0.1:0', '--threads', '2', '--name', 'tiny'],
  { stdio: ['ignore', 'pipe', 'pipe'] });
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
const PROMPT = 'The quick brown fox jumps over the lazy dog, again and again.';
const TOP = 5;
const body = { model: 'tiny', prompt: PROMPT, max_tokens: 6, temperature: 0, logprobs: TOP };

const plain = await openai.completions.create(body);
const echo = await openai.completions.create({ ...body, echo: true });
const lp = echo.choices[0].logprobs, pl = plain.choices[0].logprobs;
check(echo.choices[0].text.startsWith(PROMPT), 'the text starts with the prompt');
eq(echo.choices[0].text, PROMPT + plain.choices[0].text, 'echo: prompt + the same completion');
const ids = (await post('/tokenize', { content: PROMPT, add_special: true })).json.tokens;
const bos = (await post('/tokenize', { content: PROMPT, add_special: false })).json.tokens.length < ids.length;
const np = lp.tokens.length - pl.tokens.length;
eq(np, ids.length - (bos ? 1 : 0), 'one entry per prompt token (a BOS left out)');
eq(lp.tokens.slice(0, np).join(''), PROMPT, 'the prompt tokens\' texts are the prompt');
eq(lp.tokens.slice(np), pl.tokens, 'then the completion\'s tokens');
check(lp.token_logprobs.slice(np).every((v, i) => v === pl.token_logprobs[i]), 'the completion\'s logprobs unchanged');
let off = 0;
const offs = lp.tokens.map((t) => { const o = off; off += Buffer.byteLength(t); return o; });
eq(lp.text_offset, offs, 'text_offset counts from the prompt\'s start');
if (!bos) check(lp.token_logprobs[0] === null, 'the first token: null (nothing before it)');
// every prompt position against a plain run over its prefix (token ids);
// then a prompt the model itself wrote (greedy), whose tokens are mostly
// its top choices, so their logprobs are checked exactly too
async function positions(prompt, tag) {
  const e2 = await openai.completions.create({ ...body, prompt, echo: true, max_tokens: 1 });
  const l = e2.choices[0].logprobs;
  const pids = (await post('/tokenize', { content: prompt, add_special: true })).json.tokens;
  let exact = 0;
  for (let k = 1; k < pids.length; k++) {
    const e = k - (bos ? 1 : 0); // its entry
    const r = await post('/completion', { prompt: pids.slice(0, k), n_predict: 1, temperature: 0, n_probs: 20 });
    const top = r.json.completion_probabilities[0].top_logprobs;
    const want = Object.fromEntries(top.slice(0, TOP).map((x) => [x.token, x.logprob]));
    const got = l.top_logprobs[e] || {};
    const same = Object.keys(got).length === Object.keys(want).length &&
      Object.entries(want).every(([t, v]) => got[t] !== undefined && near(got[t], v));
    check(same, `${tag} position ${k}: top_logprobs ${JSON.stringify(got)} vs the plain run's ${JSON.stringify(want)}`);
    const hit = top.find((x) => x.id === pids[k]);
    if (hit) { exact++; check(near(l.token_logprobs[e], hit.logprob), `${tag} position ${k}: logprob ${l.token_logprobs[e]} vs ${hit.logprob}`); }
    else check(l.token_logprobs[e] <= top[top.length - 1].logprob + 1e-9, `${tag} position ${k}: below the plain run's 20th`);
  }
  return exact;
}
let exact = await positions(PROMPT, 'prompt');
const own = (await post('/completion', { prompt: 'The', n_predict: 32, temperature: 0 })).json.content;
exact += await positions('The' + own, 'its own text');
check(exact >= 3, `prompt tokens checked exactly: ${exact}`);
// streamed: the same entries
{
  const st = await openai.completions.create({ ...body, echo: true, stream: true });
  let text = '', toks = [], lps = [], offsS = [];
  for await (const ch of st) {
    const c = ch.choices[0];
    if (!c) continue;
    text += c.text;
    if (c.logprobs) { toks.push(...c.logprobs.tokens); lps.push(...c.logprobs.token_logprobs); offsS.push(...c.logprobs.text_offset); }
  }
  eq(text, echo.choices[0].text, 'stream: the same text');
  eq([toks, lps, offsS], [lp.tokens, lp.token_logprobs, lp.text_offset], 'stream: the same log-probabilities');
}
// refused: with n > 1
{
  const r = await post('/v1/completions', { ...body, echo: true, n: 2 });
  eq(r.status, 400, 'echo + logprobs + n 2: status');
  check(JSON.stringify(r.json).includes("'echo'"), `echo + logprobs + n 2: names echo: ${JSON.stringify(r.json)}`);
}
// over a worker (the experts computed there): the same answer, whole
{
  const w = spawn(bin, ['gateway', '-m', `${dir}/sl/manifest.json`, '--worker', process.env.KV_WORKER, '--key',
    `${dir}/coord.key`, '--listen', '127.0.0.1:0', '--threads', '1', '--name', 'tiny', '--quiet'], { stdio: ['ignore', 'pipe', 'pipe'] });
  let werr = '';
  w.stderr.on('data', (b) => { werr += b; });
  const wurl = await new Promise((resolve, reject) => {
    let out = '';
    w.stdout.on('data', (b) => { out += b; const m = out.match(/^listening on (\S+)/m); if (m) resolve('http://' + m[1]); });
    w.on('exit', (c) => reject(new Error(`worker gateway exited ${c}: ${werr}`)));
  });
  for (let i = 0; i < 50; i++) { const h = await fetch(`${wurl}/health`); if (h.status === 200) break; await new Promise((r) => setTimeout(r, 100)); }
  const wc = new OpenAI({ baseURL: `${wurl}/v1`, apiKey: 'none', maxRetries: 0 });
  const we = await wc.completions.create({ ...body, echo: true });
  eq([we.choices[0].text, we.choices[0].logprobs], [echo.choices[0].text, lp], 'over a worker: the same text and log-probabilities');
  w.kill();
}
gw.kill();
console.log(`gateway_echo: ${checks - failures}/${checks} checks passed (${exact} positions exact)`);
if (failures) { console.error(stderr.slice(-2000)); process.exit(1); }
