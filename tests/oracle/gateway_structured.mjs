#!/usr/bin/env node
// Structured output through the official OpenAI client against `kvasir
// gateway` (driven by tests/test_gateway_structured.sh; test-only). The
// model has random weights: only the grammar makes its output valid. Every
// answer under response_format json_schema must parse (JSON.parse) and
// validate against its schema by ajv (an independent validator), whole and
// streamed, over several schemas x seeds, and through the client's own
// parse helpers (chat.completions.parse and .stream with a parseable
// response_format, the mechanism zodResponseFormat uses). json_object gives
// an object; a GBNF `grammar` a sentence of it; a schema outside the subset
// a 400 naming the keyword; a request without these fields (or with
// response_format text) the text of `kvasir run --chat --json`.
import { execFileSync } from 'node:child_process';
import OpenAI from 'openai';
import { makeParseableResponseFormat } from 'openai/lib/parser';
import Ajv from 'ajv';

const url = process.env.KV_GW_URL, model = process.env.KV_GW_MODEL;
const file = process.env.KV_GW_FILE, bin = process.env.KV_BIN;
let failures = 0, checks = 0;
function check(ok, what) {
  checks++;
  if (!ok) { failures++; console.error(`FAIL: ${what}`); }
}
function eq(a, b, what) { check(a === b, `${what}: ${JSON.stringify(a)} !== ${JSON.stringify(b)}`); }

const ajv = new Ajv({ strict: false, allErrors: true });
const openai = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'none', maxRetries: 0 });

const schemas = {
  person: { type: 'object', properties: {
    name: { type: 'string', minLength: 1, maxLength: 12 },
    age: { type: 'integer', minimum: 0, maximum: 120 },
    tags: { type: 'array', items: { enum: ['a', 'b', 'c'] }, maxItems: 3 },
    admin: { type: 'boolean' } }, required: ['name', 'age'], additionalProperties: false },
  flags: { type: 'array', items: { type: 'boolean' }, minItems: 1, maxItems: 4 },
  color: { enum: ['red', 'green', 'blue'] },
  maybe: { anyOf: [{ type: 'integer', minimum: -5, maximum: 5 }, { type: 'null' }] },
  point: { type: 'object', properties: {
    x: { type: 'number', minimum: 0 }, y: { type: 'integer' },
    label: { type: ['string', 'null'], maxLength: 6 },
    inner: { type: 'object', properties: { ok: { const: true } }, required: ['ok'] } },
    required: ['x', 'y', 'inner'] },
  shape: { oneOf: [
    { type: 'object', properties: { kind: { const: 'circle' }, r: { type: 'integer', minimum: 1, maximum: 9 } },
      required: ['kind', 'r'] },
    { type: 'object', properties: { kind: { const: 'square' }, side: { type: 'integer', minimum: 1, maximum: 9 } },
      required: ['kind', 'side'] }] },
};
const seeds = [1, 7, 42, 1234];
const base = { model, messages: [{ role: 'user', content: 'Answer in JSON.' }], max_tokens: 400 };

function validates(name, schema, text, what) {
  let v;
  try { v = JSON.parse(text); } catch (e) {
    check(false, `${what}: not JSON (${e.message}): ${JSON.stringify(text)}`);
    return undefined;
  }
  const ok = ajv.validate(schema, v);
  check(ok, `${what}: ${JSON.stringify(text)} does not validate against ${name}: ${ajv.errorsText()}`);
  return v;
}

// every schema x seed, whole and streamed: parses, validates, finish "stop",
// and the stream's text equals the whole answer's (same seed)
let samples = 0;
for (const [name, schema] of Object.entries(schemas)) {
  const response_format = { type: 'json_schema', json_schema: { name, schema, strict: true } };
  for (const seed of seeds) {
    const r = await openai.chat.completions.create({ ...base, seed, response_format });
    const text = r.choices[0].message.content;
    eq(r.choices[0].finish_reason, 'stop', `${name} seed ${seed} finish_reason`);
    validates(name, schema, text, `${name} seed ${seed}`);
    const s = await openai.chat.completions.create({ ...base, seed, response_format, stream: true });
    let st = '', fin = null;
    for await (const ch of s) {
      if (ch.choices.length && ch.choices[0].delta.content) st += ch.choices[0].delta.content;
      if (ch.choices.length && ch.choices[0].finish_reason) fin = ch.choices[0].finish_reason;
    }
    eq(st, text, `${name} seed ${seed} streamed text`);
    eq(fin, 'stop', `${name} seed ${seed} streamed finish_reason`);
    samples += 2;
  }
}

// the client's parse helpers: a parseable response_format whose parser is
// JSON.parse then ajv (as zodResponseFormat's is JSON.parse then zod)
for (const name of ['person', 'shape', 'point']) {
  const schema = schemas[name];
  const check_ = ajv.compile(schema);
  const rf = makeParseableResponseFormat({ type: 'json_schema', json_schema: { name, schema, strict: true } },
    (content) => {
      const v = JSON.parse(content);
      if (!check_(v)) throw new Error(`invalid: ${ajv.errorsText(check_.errors)}`);
      return v;
    });
  for (const seed of [3, 5]) {
    const r = await openai.chat.completions.parse({ ...base, seed, response_format: rf });
    const parsed = r.choices[0].message.parsed;
    check(parsed !== null && parsed !== undefined, `parse ${name} seed ${seed}: no parsed value`);
    eq(JSON.stringify(parsed), JSON.stringify(JSON.parse(r.choices[0].message.content)), `parse ${name} seed ${seed}`);
    const st = openai.chat.completions.stream({ ...base, seed, response_format: rf });
    const fin = await st.finalChatCompletion();
    eq(JSON.stringify(fin.choices[0].message.parsed), JSON.stringify(parsed), `stream helper ${name} seed ${seed}`);
    samples += 2;
  }
}

// json_object: an object, whatever the model. A random model may write one
// string for thousands of tokens (a JSON object's keys are unbounded): a
// sample cut by max_tokens ("length") is a prefix of an object, and most
// seeds must end on their own.
let objects = 0;
for (const seed of seeds) {
  const r = await openai.chat.completions.create({ ...base, max_tokens: 2000, seed,
    response_format: { type: 'json_object' } });
  const text = r.choices[0].message.content;
  if (r.choices[0].finish_reason === 'length') {
    check(text.startsWith('{'), `json_object seed ${seed}: cut, yet not an object's start: ${JSON.stringify(text)}`);
    continue;
  }
  eq(r.choices[0].finish_reason, 'stop', `json_object seed ${seed} finish_reason`);
  let v = null;
  try { v = JSON.parse(text); } catch (e) { /* checked below */ }
  check(v !== null && typeof v === 'object' && !Array.isArray(v), `json_object seed ${seed}: not an object: ${JSON.stringify(text)}`);
  objects++;
}
check(objects * 2 >= seeds.length, `json_object: only ${objects} of ${seeds.length} samples ended`);

// completions: llama-server's json_schema and grammar fields
for (const seed of seeds) {
  const r = await openai.completions.create({ model, prompt: 'JSON:', max_tokens: 400, seed,
    json_schema: schemas.person });
  validates('person', schemas.person, r.choices[0].text, `completions json_schema seed ${seed}`);
  const g = await openai.completions.create({ model, prompt: 'Yes or no?', max_tokens: 50, seed,
    grammar: 'root ::= ("yes" | "no") ("," [ ]? ("yes" | "no")){0,3}' });
  check(/^(yes|no)(, ?(yes|no)){0,3}$/.test(g.choices[0].text), `completions grammar seed ${seed}: ${g.choices[0].text}`);
  eq(g.choices[0].finish_reason, 'stop', `completions grammar seed ${seed} finish_reason`);
}
const gc = await openai.chat.completions.create({ ...base, seed: 9, grammar: 'root ::= "answer: " [0-9]{1,3}' });
check(/^answer: [0-9]{1,3}$/.test(gc.choices[0].message.content), `chat grammar: ${gc.choices[0].message.content}`);

// refusals: 400 naming what is wrong
async function refused(params, re, what) {
  try {
    await openai.chat.completions.create({ ...base, ...params });
    check(false, `${what}: served`);
  } catch (e) {
    eq(e.status, 400, `${what} status`);
    check(re.test(e.message), `${what}: message '${e.message}' does not match ${re}`);
  }
}
await refused({ response_format: { type: 'json_schema', json_schema: { name: 'p', schema: { type: 'string', pattern: 'a+' } } } },
  /response_format\.json_schema\.schema.*'pattern'/, 'schema with pattern');
await refused({ response_format: { type: 'json_schema', json_schema: { name: 'm',
  schema: { type: 'object', properties: { n: { type: 'number', multipleOf: 2 } } } } } },
  /'multipleOf'.*\/properties\/n|\/properties\/n.*'multipleOf'/, 'schema with multipleOf');
await refused({ response_format: { type: 'xml' } }, /response_format\.type.*xml/, 'unknown response_format type');
await refused({ response_format: { type: 'json_schema' } }, /response_format\.json_schema/, 'json_schema without its object');
await refused({ grammar: 'root ::= undefined-rule' }, /'grammar'.*1:10.*undefined rule/, 'GBNF with an undefined rule');
await refused({ grammar: 'root ::= "a"', response_format: { type: 'json_object' } }, /both constrain/, 'two constraints');

// tool_choice "required" and a named function: the call is sampled under
// the grammar of Qwen's <tool_call> text with the arguments following the
// function's schema, so even random weights give a valid call (ajv)
{
  const tools = [
    { type: 'function', function: { name: 'get_weather', parameters: { type: 'object', properties: {
      city: { type: 'string', maxLength: 10 }, unit: { enum: ['c', 'f'] } }, required: ['city', 'unit'] } } },
    { type: 'function', function: { name: 'add', parameters: { type: 'object', properties: {
      a: { type: 'integer', minimum: 0, maximum: 99 }, b: { type: 'integer' } }, required: ['a', 'b'] } } },
  ];
  for (const choice of ['required', { type: 'function', function: { name: 'add' } }]) {
    for (const stream of [false, true]) {
      for (const seed of [1, 2, 3, 4]) {
        const params = { model, messages: [{ role: 'user', content: 'weather in Oslo?' }], tools, tool_choice: choice,
          seed, max_tokens: 300, parallel_tool_calls: false };
        const r = stream ? await openai.chat.completions.stream(params).finalChatCompletion()
                         : await openai.chat.completions.create(params);
        const what = `tool_choice ${JSON.stringify(choice)} stream ${stream} seed ${seed}`;
        const calls = r.choices[0].message.tool_calls;
        eq(r.choices[0].finish_reason, 'tool_calls', `${what}: finish_reason`);
        check(calls && calls.length === 1, `${what}: one call: ${JSON.stringify(r.choices[0].message)}`);
        if (!calls || !calls.length) continue;
        const t = tools.find((x) => x.function.name === calls[0].function.name);
        check(t && (choice === 'required' || t.function.name === 'add'), `${what}: function ${calls[0].function.name}`);
        if (t) validates(t.function.name, t.function.parameters, calls[0].function.arguments, `${what}: arguments`);
        samples++;
      }
    }
  }
  await refused({ tools, tool_choice: 'required', response_format: { type: 'json_object' } }, /both constrain/,
    'tool_choice with response_format');
}

// llama-server's /completion and Ollama's /api/generate take the same fields
async function postJSON(path, body) {
  const r = await fetch(`${url}${path}`, { method: 'POST', body: JSON.stringify(body) });
  return { status: r.status, json: await r.json() };
}
for (const seed of [1, 2]) {
  const a = await postJSON('/completion', { prompt: 'JSON:', n_predict: 400, seed, json_schema: schemas.person });
  eq(a.status, 200, `/completion json_schema seed ${seed}: status`);
  validates('person', schemas.person, a.json.content, `/completion json_schema seed ${seed}`);
  const b = await postJSON('/completion', { prompt: 'Yes?', n_predict: 20, seed, grammar: 'root ::= "yes" | "no"' });
  check(b.json.content === 'yes' || b.json.content === 'no', `/completion grammar seed ${seed}: ${b.json.content}`);
  const c = await postJSON('/api/generate', { prompt: 'Shape?', stream: false, format: schemas.shape,
    options: { seed, num_predict: 300 } });
  eq(c.status, 200, `/api/generate format seed ${seed}: status`);
  validates('shape', schemas.shape, c.json.response, `/api/generate format seed ${seed}`);
}
{
  const a = await postJSON('/completion', { prompt: 'x', json_schema: { type: 'string', format: 'email' } });
  eq(a.status, 400, '/completion bad schema: status');
  check(JSON.stringify(a.json).includes("'format'"), `/completion bad schema: ${JSON.stringify(a.json)}`);
}

// no constraint (or response_format text): the text of kvasir run, bit for bit
function reference(prompt, p) {
  const out = execFileSync(bin, ['run', '-m', file, '--chat', '--json', '--threads', '1', '-p', prompt,
    '-n', String(p.max_tokens), '--temp', String(p.temperature), '--top-k', String(p.top_k),
    '--top-p', String(p.top_p), '--min-p', String(p.min_p), '--seed', String(p.seed)], { encoding: 'utf8' });
  return JSON.parse(out).text;
}
for (const [i, extra] of [{}, { response_format: { type: 'text' } }].entries()) {
  const p = { max_tokens: 30, seed: 21 + i, temperature: 0.9, top_k: 30, top_p: 0.95, min_p: 0.02 };
  const ref = reference('Tell me a story.', p);
  const r = await openai.chat.completions.create({ model, messages: [{ role: 'user', content: 'Tell me a story.' }],
    ...p, ...extra });
  eq(r.choices[0].message.content, ref, `unconstrained ${JSON.stringify(extra)} equals kvasir run`);
}

console.log(`gateway_structured: ${samples} constrained samples validated by ajv; ${checks} checks, ${failures} failed`);
process.exit(failures ? 1 : 0);
