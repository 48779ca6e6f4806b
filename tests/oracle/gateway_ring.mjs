#!/usr/bin/env node
// The official `openai` (and `@anthropic-ai/sdk`) clients against `kvasir
// gateway --ring` (driven by tests/test_gateway_ring.sh; test-only). The
// reference for every answer is `kvasir run -m FILE` in one process with
// the same parameters (--chat for the chat APIs): the text (whole, or the
// stream's deltas joined), the completion token count and the prompt count
// must equal its own, greedy and with temperature > 0 (the sampler's draw is
// a function of seed and position, the same on the ring's tail). Then two
// requests at once (two ring sequences in flight) each equal their reference.
// KV_GW_PHASE=fault: the ring loses a node during the request; the client
// must get an error (503 whole; an error in the stream), and whatever text it
// was given before must be a prefix of the reference's: never wrong text.
import { execFileSync } from 'node:child_process';
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';

const url = process.env.KV_GW_URL, key = process.env.KV_GW_KEY, model = process.env.KV_GW_MODEL;
const file = process.env.KV_GW_FILE, bin = process.env.KV_BIN, phase = process.env.KV_GW_PHASE || 'exact';
let failures = 0, checks = 0;
function check(ok, what) {
  checks++;
  if (!ok) { failures++; console.error(`FAIL: ${what}`); }
}
function eq(a, b, what) { check(a === b, `${what}: ${JSON.stringify(a)} !== ${JSON.stringify(b)}`); }

function reference(prompt, p, chat) {
  const args = ['run', '-m', file, '--json', '--threads', '1', '-p', prompt, '-n', String(p.max_tokens),
    '--temp', String(p.temperature), '--top-k', String(p.top_k), '--top-p', String(p.top_p),
    '--min-p', String(p.min_p), '--seed', String(p.seed)];
  if (chat) args.push('--chat');
  const j = JSON.parse(execFileSync(bin, args, { encoding: 'utf8' }));
  return { text: j.text, n_gen: j.tokens.length, n_prompt: j.prompt_tokens.length };
}

const openai = new OpenAI({ baseURL: `${url}/v1`, apiKey: key, maxRetries: 0 });
const anthropic = new Anthropic({ baseURL: url, apiKey: key, maxRetries: 0 });
const chatParams = (c) => ({ model, messages: [{ role: 'user', content: c.prompt }], max_tokens: c.max_tokens,
  temperature: c.temperature, top_p: c.top_p, seed: c.seed, top_k: c.top_k, min_p: c.min_p });

async function streamText(params) {
  const s = await openai.chat.completions.create({ ...params, stream: true, stream_options: { include_usage: true } });
  let text = '', usage = null, finish = null;
  for await (const ch of s) {
    if (ch.choices.length && ch.choices[0].delta.content) text += ch.choices[0].delta.content;
    if (ch.choices.length && ch.choices[0].finish_reason) finish = ch.choices[0].finish_reason;
    if (ch.usage) usage = ch.usage;
  }
  return { text, usage, finish };
}

if (phase === 'exact') {
  const cases = [
    { prompt: 'Tell me about dragons.', temperature: 0, top_k: 40, top_p: 0.95, min_p: 0.05, seed: 1, max_tokens: 40 },
    { prompt: 'Hello there', temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, seed: 11, max_tokens: 24 },
    { prompt: 'Why is the sky blue?', temperature: 1.2, top_k: 10, top_p: 0.9, min_p: 0.0, seed: 77, max_tokens: 33 },
  ];
  for (const c of cases) {
    const ref = reference(c.prompt, c, true);
    const params = chatParams(c);
    const r = await openai.chat.completions.create(params);
    eq(r.choices[0].message.content, ref.text, `openai chat '${c.prompt}' (temp ${c.temperature}) text`);
    eq(r.usage.completion_tokens, ref.n_gen, `openai chat '${c.prompt}' completion_tokens`);
    eq(r.usage.prompt_tokens, ref.n_prompt, `openai chat '${c.prompt}' prompt_tokens`);
    const s = await streamText(params);
    eq(s.text, ref.text, `openai stream '${c.prompt}' (temp ${c.temperature}) text`);
    check(s.usage && s.usage.completion_tokens === ref.n_gen && s.usage.prompt_tokens === ref.n_prompt,
      `openai stream '${c.prompt}' usage ${JSON.stringify(s.usage)}`);
    check(s.finish === 'stop' || s.finish === 'length', `openai stream finish_reason ${s.finish}`);
  }
  // text completions: the raw prompt, as kvasir run -p takes it
  {
    const c = { prompt: 'Once upon a time', temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, seed: 5, max_tokens: 30 };
    const ref = reference(c.prompt, c, false);
    const r = await openai.completions.create({ model, prompt: c.prompt, max_tokens: c.max_tokens,
      temperature: c.temperature, top_p: c.top_p, seed: c.seed, top_k: c.top_k, min_p: c.min_p });
    eq(r.choices[0].text, ref.text, 'openai completions text');
    eq(r.usage.completion_tokens, ref.n_gen, 'openai completions completion_tokens');
    eq(r.usage.prompt_tokens, ref.n_prompt, 'openai completions prompt_tokens');
  }
  // Anthropic, whole
  {
    const c = { prompt: 'Hello there', temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, seed: 11, max_tokens: 24 };
    const ref = reference(c.prompt, c, true);
    const m = await anthropic.messages.create({ model, max_tokens: c.max_tokens,
      messages: [{ role: 'user', content: c.prompt }], temperature: c.temperature, top_p: c.top_p, top_k: c.top_k,
      seed: c.seed, min_p: c.min_p });
    eq(m.content[0].text, ref.text, 'anthropic text');
    eq(m.usage.input_tokens, ref.n_prompt, 'anthropic input_tokens');
    eq(m.usage.output_tokens, ref.n_gen, 'anthropic output_tokens');
  }
  // two at once: two sequences in the ring at the same time, each its own reference
  {
    const cs = [
      { prompt: 'The first of two', temperature: 0.9, top_k: 40, top_p: 0.95, min_p: 0.05, seed: 21, max_tokens: 48 },
      { prompt: 'and the second one', temperature: 0, top_k: 40, top_p: 0.95, min_p: 0.05, seed: 1, max_tokens: 48 },
    ];
    const refs = cs.map((c) => reference(c.prompt, c, true));
    const [a, b] = await Promise.all([openai.chat.completions.create(chatParams(cs[0])), streamText(chatParams(cs[1]))]);
    eq(a.choices[0].message.content, refs[0].text, 'concurrent whole text');
    eq(a.usage.completion_tokens, refs[0].n_gen, 'concurrent whole completion_tokens');
    eq(b.text, refs[1].text, 'concurrent stream text');
    check(b.usage && b.usage.completion_tokens === refs[1].n_gen, 'concurrent stream usage');
  }
} else {
  // fault: a node of the ring dies during the request (its --die-after-frames hook)
  const c = { prompt: 'A node dies in the middle of this', temperature: 0, top_k: 40, top_p: 0.95, min_p: 0.05,
    seed: 1, max_tokens: 60 };
  const ref = reference(c.prompt, c, true);
  const stream = phase === 'fault-stream';
  try {
    if (stream) {
      const s = await openai.chat.completions.create({ ...chatParams(c), stream: true });
      let text = '';
      try {
        for await (const ch of s) if (ch.choices.length && ch.choices[0].delta.content) text += ch.choices[0].delta.content;
        check(false, `a stream across a dead node ended without an error (text ${JSON.stringify(text)})`);
      } catch (e) {
        check(ref.text.startsWith(text), `the text streamed before the error is not the reference's prefix: ${JSON.stringify(text)}`);
        check(text.length < ref.text.length, 'the whole text came although a node died');
        check(/ring/.test(String(e.message)), `the stream's error does not name the ring: ${e.message}`);
        console.log(`stream error after ${text.length} of ${ref.text.length} bytes: ${String(e.message).slice(0, 160)}`);
      }
    } else {
      const r = await openai.chat.completions.create(chatParams(c));
      check(false, `a request across a dead node was answered: ${JSON.stringify(r.choices[0].message.content)}`);
    }
  } catch (e) {
    eq(e.status, 503, `status of a request across a dead node (${e.message})`);
    check(/ring/.test(String(e.message)), `the error does not name the ring: ${e.message}`);
    console.log(`error: ${e.status} ${String(e.message).slice(0, 200)}`);
  }
}

console.log(`gateway_ring (${phase}): ${checks} checks, ${failures} failed`);
process.exit(failures ? 1 : 0);
