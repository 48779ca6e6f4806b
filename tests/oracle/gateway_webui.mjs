// The gateway's chat page in a real browser (driven by
// tests/test_gateway_webui.sh; test-only): headless Chromium through
// chromedriver's WebDriver HTTP API with Node's built-in fetch (no npm
// package), as hub_status.mjs does. The references are independent of the
// page: curl's answer from /v1/chat/completions for the very body the page
// sent (recorded by wrapping window.fetch from the test), the gateway's
// /metrics, its error JSON, and the SHA-256 of the page's inline code
// computed here. The model has random weights, so the first gateway answers
// from the test-only KVASIR_GATEWAY_TEST_SCRIPT (each generation request
// takes the next text); a second one without it checks the model's own text.
import { execFileSync, spawn } from 'node:child_process';
import { createHash } from 'node:crypto';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import net from 'node:net';

const dir = process.env.KV_DIR, bin = process.env.KV_BIN;
const chromium = process.env.KV_CHROMIUM || '/usr/bin/chromium';
const driverBin = process.env.KV_CHROMEDRIVER || '/usr/bin/chromedriver';
let failures = 0;
function check(ok, what) {
  if (ok) console.log(`ok: ${what}`);
  else { console.log(`FAIL: ${what}`); failures++; }
}
// JSON with object keys sorted (WebDriver hands objects back with their keys reordered)
const canon = (v) => JSON.stringify(v, (k, x) => (x && typeof x === 'object' && !Array.isArray(x)
  ? Object.fromEntries(Object.keys(x).sort().map((q) => [q, x[q]])) : x));
function eq(a, b, what) {
  const x = canon(a), y = canon(b);
  check(x === y, x === y ? `${what}: ${x.slice(0, 100)}` : `${what}: ${x.slice(0, 300)} vs ${y.slice(0, 300)}`);
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// ---- the script: what the "model" writes, in request order ----
const REASON = 'The user asks for the weather; I will call the tool.';
const XSS = 'Here is <img src=x onerror="window.__xss=1"> & <script>window.__xss=2</script> <b>not bold</b>';
const ARGS = { city: 'Oslo', days: 2 };
const T1 = `<think>\n${REASON}\n</think>\n\n${XSS}\n<tool_call>\n{"name": "get_weather", "arguments": ${JSON.stringify(ARGS)}}\n</tool_call>`;
const LONG = Array.from({ length: 3000 }, (_, i) => `word${i}`).join(' ');
// the page's request (T1), curl's same request (T1), the stopped one (LONG), then round again (T1)
writeFileSync(`${dir}/script.txt`, [T1, T1, LONG].join('\x1e'));
// ChatML with `<think>` in it: the gateway then splits reasoning (docs/GATEWAY.md "Tool calling and reasoning")
writeFileSync(`${dir}/think.jinja`, "{#- the model may write <think> reasoning -#}\n" +
  "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor -%}\n" +
  "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}");

async function gateway(args, env) {
  const gw = spawn(bin, ['gateway', '-m', `${dir}/m.gguf`, '--listen', '127.0.0.1:0', '--threads', '1', ...args],
    { env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
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
  return { gw, url, log: () => stderr };
}
// curl: status, headers and body
function curl(url, { key, body, head } = {}) {
  const a = ['-s', '-D', '-', url];
  if (key) a.push('-H', `Authorization: Bearer ${key}`);
  if (body) a.push('-H', 'Content-Type: application/json', '--data-binary', JSON.stringify(body));
  const out = execFileSync('curl', a, { encoding: 'utf8', maxBuffer: 64 << 20 });
  const at = out.indexOf('\r\n\r\n');
  const lines = out.slice(0, at).split('\r\n');
  const headers = {};
  for (const l of lines.slice(1)) {
    const i = l.indexOf(':');
    headers[l.slice(0, i).toLowerCase()] = l.slice(i + 1).trim();
  }
  return { status: Number(lines[0].split(' ')[1]), headers, body: head ? '' : out.slice(at + 4) };
}
const metric = (url, name) => Number((curl(`${url}/metrics`).body.match(new RegExp(`^${name} (\\d+)`, 'm')) || [])[1]);

// ---- WebDriver ----
function freePort() {
  return new Promise((res, rej) => {
    const s = net.createServer();
    s.listen(0, '127.0.0.1', () => { const p = s.address().port; s.close(() => res(p)); });
    s.on('error', rej);
  });
}
const profile = mkdtempSync(join(tmpdir(), 'kv-chromium-'));
const port = await freePort();
const driver = spawn(driverBin, [`--port=${port}`, '--allowed-ips=127.0.0.1'], { stdio: ['ignore', 'ignore', 'inherit'] });
const wd = `http://127.0.0.1:${port}`;
let session = null;
async function call(method, path, body) {
  const r = await fetch(wd + path, {
    method, headers: { 'Content-Type': 'application/json' }, body: body ? JSON.stringify(body) : undefined,
  });
  const j = await r.json();
  if (!r.ok) throw new Error(`${method} ${path}: ${r.status} ${JSON.stringify(j.value).slice(0, 400)}`);
  return j.value;
}
const js = (script, ...args) => call('POST', `/session/${session}/execute/sync`, { script, args });
const ELEM = 'element-6066-11e4-a52e-4f735466cecf'; // W3C WebDriver's element reference key
async function find(css) {
  const v = await call('POST', `/session/${session}/element`, { using: 'css selector', value: css });
  if (!v || !v[ELEM]) throw new Error(`no element ${css}: ${JSON.stringify(v)}`);
  return v[ELEM];
}
const click = async (css) => call('POST', `/session/${session}/element/${await find(css)}/click`, {});
const type = async (css, text) => call('POST', `/session/${session}/element/${await find(css)}/value`, { text });
// sets a settings field as a user would: the settings unfolded, the field cleared, typed, then left
async function setField(css, text) {
  if (!(await js(`return document.getElementById('settings').open;`))) await click('#settings summary');
  const e = await find(css);
  await call('POST', `/session/${session}/element/${e}/clear`, {});
  if (text !== '') await call('POST', `/session/${session}/element/${e}/value`, { text });
  await js(`document.querySelector(arguments[0]).dispatchEvent(new Event('change')); return 0;`, css);
}
async function waitFor(script, timeoutMs, what) {
  const t0 = Date.now();
  let v;
  while (Date.now() - t0 < timeoutMs) {
    if ((v = await js(script))) return v;
    await sleep(50);
  }
  check(false, `${what}: not within ${timeoutMs} ms`);
  return v;
}
// records the bodies the page POSTs (the page itself has no test hook)
const RECORD = `if (!window.__sent) { window.__sent = []; const f = window.fetch;
  window.fetch = (u, o) => { if (o && o.body) window.__sent.push(o.body); return f(u, o); }; } return 0;`;
// the last assistant bubble, read from the DOM
const LAST = `const m = [...document.querySelectorAll('.msg.assistant')].pop(); if (!m) return null;
  const d = m.querySelector('details.reasoning');
  return { state: m.dataset.state, finish: m.dataset.finish || null, content: m.querySelector('.content').textContent,
    contentElems: m.querySelector('.content').children.length,
    reasoning: d.querySelector('.reasoning-text').textContent, detailsOpen: d.open, detailsHidden: d.hidden,
    calls: [...m.querySelectorAll('.call')].map((c) => ({ name: c.querySelector('.call-name').textContent,
      args: c.querySelector('.call-args').textContent })),
    status: m.querySelector('.status').textContent, n: document.querySelectorAll('.msg.assistant').length };`;
async function sendMessage(text) {
  await js(RECORD);
  const before = await js(`return document.querySelectorAll('.msg.assistant').length;`);
  await type('#input', text);
  await click('#send');
  await waitFor(`return document.querySelectorAll('.msg.assistant').length > ${before};`, 5000, 'a bubble appears');
}
const doneState = `const m = [...document.querySelectorAll('.msg.assistant')].pop();
  return m && m.dataset.state !== 'streaming' ? m.dataset.state : null;`;
const lastSent = async () => JSON.parse(await js(`return window.__sent[window.__sent.length - 1];`));

const procs = [];
try {
  // ---- gateway A: keyed, scripted, a template that writes <think> ----
  const A = await gateway(['--name', 'tiny', '--api-key', 'sk-web', '--chat-template', `${dir}/think.jinja`],
    { KVASIR_GATEWAY_TEST_SCRIPT: `${dir}/script.txt` });
  procs.push(A.gw);
  check(/TEST ONLY/.test(A.log()), 'gateway A answers from the script');

  // the page over HTTP: open (no key), HTML, its CSP naming its own inline code
  const page = curl(`${A.url}/`);
  check(page.status === 200 && /^text\/html/.test(page.headers['content-type']), `GET / is 200 text/html (${page.status})`);
  check(/<title>Kvasir chat<\/title>/.test(page.body), 'GET / is the chat page');
  check(!/(src|href)\s*=\s*["']?(https?:)?\/\//i.test(page.body) && !/@import|url\(/i.test(page.body),
    'the page loads nothing from elsewhere');
  eq(curl(`${A.url}/index.html`).body, page.body, '/index.html is the same page');
  check(curl(`${A.url}/v1/models`).status === 401, '/v1/models wants the key (the page does not)');
  const csp = page.headers['content-security-policy'] || '';
  const sha = (re) => { const m = page.body.match(re); return m && `'sha256-${createHash('sha256').update(m[1]).digest('base64')}'`; };
  const scriptHash = sha(/<script>([\s\S]*?)<\/script>/), styleHash = sha(/<style>([\s\S]*?)<\/style>/);
  const dirs = Object.fromEntries(csp.split(';').map((d) => d.trim().split(/\s+/)).map(([k, ...v]) => [k, v]));
  eq(dirs['default-src'], ["'none'"], 'CSP default-src');
  eq(dirs['script-src'], [scriptHash], 'CSP script-src is the hash of the page\'s script');
  eq(dirs['style-src'], [styleHash], 'CSP style-src is the hash of the page\'s style');
  eq(dirs['connect-src'], ["'self'"], 'CSP connect-src');
  check(!/unsafe/.test(csp), `CSP allows nothing unsafe (${csp})`);
  check(page.headers['x-content-type-options'] === 'nosniff', 'nosniff');

  for (let i = 0; i < 100; i++) {
    try { await call('GET', '/status'); break; } catch { await sleep(100); }
  }
  session = (await call('POST', '/session', {
    capabilities: { alwaysMatch: { browserName: 'chrome', 'goog:chromeOptions': {
      binary: chromium,
      args: ['--headless=new', '--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', `--user-data-dir=${profile}`],
    } } },
  })).sessionId;
  await call('POST', `/session/${session}/url`, { url: A.url + '/' });
  eq(await call('GET', `/session/${session}/title`), 'Kvasir chat', 'the page renders');

  // no key yet: the page shows the gateway's 401 message for /v1/models
  const e401 = JSON.parse(curl(`${A.url}/v1/models`).body).error.message;
  const shown = await waitFor(`const e = document.getElementById('model-error'); return !e.hidden && e.textContent;`,
    5000, 'the missing key is shown');
  eq(shown, e401, 'without a key the page shows the gateway\'s error message');
  // the key: typed, kept in localStorage over a reload, the model id from /v1/models
  await setField('#api-key', 'sk-web');
  eq(await waitFor(`const t = document.getElementById('model').textContent; return t !== '…' && t !== '?' && t;`,
    5000, 'the model id'), 'tiny', 'the model id is /v1/models\'s');
  await call('POST', `/session/${session}/refresh`, {});
  eq(await js(`return document.getElementById('api-key').value;`), 'sk-web', 'the key survives a reload (localStorage)');
  eq(await waitFor(`const t = document.getElementById('model').textContent; return t !== '…' && t !== '?' && t;`,
    5000, 'the model id after the reload'), 'tiny', 'the model id after the reload');

  // the CSP holds in the browser: markup injected from outside the page's script does not run
  const blocked = await js(`return new Promise((done) => {
    let v = 0; document.addEventListener('securitypolicyviolation', () => { v++; });
    const d = document.createElement('div'); d.innerHTML = '<img src="x" onerror="window.__inj = 1">';
    document.body.append(d); setTimeout(() => { d.remove(); done({ inj: window.__inj || 0, v }); }, 500); });`);
  check(blocked.inj === 0 && blocked.v > 0, `the CSP blocks an injected handler (ran: ${blocked.inj}, violations: ${blocked.v})`);

  // ---- a turn with reasoning, a tool call and markup in the text ----
  const weather = [{ type: 'function', function: { name: 'get_weather', description: 'The weather in a city',
    parameters: { type: 'object', properties: { city: { type: 'string' }, days: { type: 'integer' } } } } }];
  await setField('#tools', JSON.stringify(weather));
  await setField('#temperature', '0');
  await setField('#max-tokens', '300');
  await setField('#system', 'You are terse.');
  const t0 = Date.now();
  await sendMessage('What is the weather in Oslo?');
  eq(await waitFor(doneState, 20000, 'the first answer'), 'done', 'the first answer ends');
  const a1 = await js(LAST);
  const body1 = await lastSent();
  check(body1.stream === true && body1.model === 'tiny' && body1.temperature === 0 && body1.max_tokens === 300,
    `the page's request: stream, model, settings (${JSON.stringify({ ...body1, messages: undefined, tools: undefined })})`);
  eq(body1.messages, [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: 'What is the weather in Oslo?' }],
    'the page\'s messages');
  eq(body1.tools, weather, 'the page sends its tools');
  const ref = JSON.parse(curl(`${A.url}/v1/chat/completions`, { key: 'sk-web', body: { ...body1, stream: false } }).body);
  const msg = ref.choices[0].message;
  eq(a1.content, msg.content, 'the streamed answer equals curl\'s whole answer');
  eq(a1.content, XSS, 'the answer is the scripted text, markup as text');
  eq(a1.contentElems, 0, 'the answer made no element');
  eq(a1.reasoning, msg.reasoning_content, 'the reasoning equals curl\'s reasoning_content');
  eq(a1.reasoning, REASON, 'the reasoning is the scripted one');
  check(!a1.detailsHidden && !a1.detailsOpen, 'the reasoning is in a shown, closed <details>');
  eq(a1.calls, msg.tool_calls.map((c) => ({ name: c.function.name, args: c.function.arguments })),
    'the tool call shown equals curl\'s');
  eq(JSON.parse(a1.calls[0].args), ARGS, 'the tool call\'s arguments');
  eq(a1.finish, ref.choices[0].finish_reason, 'finish_reason');
  const inj = await js(`return { xss: window.__xss || 0, img: document.querySelectorAll('#log img').length,
    script: document.querySelectorAll('#log script').length, b: document.querySelectorAll('#log b').length };`);
  eq(inj, { xss: 0, img: 0, script: 0, b: 0 }, 'no element injected, no handler run');
  console.log(`(first answer in ${Date.now() - t0} ms)`);
  if (process.env.KV_WEBUI_SHOT) { // a picture of the page for a reader of the test (PNG)
    await call('POST', `/session/${session}/window/rect`, { width: 1000, height: 800 });
    await js(`document.querySelector('details.reasoning').open = true; document.getElementById('settings').open = false;
      return 0;`);
    writeFileSync(process.env.KV_WEBUI_SHOT, Buffer.from(await call('GET', `/session/${session}/screenshot`), 'base64'));
    await js(`document.querySelector('details.reasoning').open = false; return 0;`);
  }

  // ---- Stop aborts a long stream; the gateway counts the cancellation ----
  await setField('#tools', '');
  await setField('#max-tokens', '7000');
  const cancelled = metric(A.url, 'kvasir_gateway_cancelled_total');
  await sendMessage('Write a long text.');
  await waitFor(`const m = [...document.querySelectorAll('.msg.assistant')].pop();
    return m.querySelector('.content').textContent.length > 0;`, 20000, 'the long answer starts');
  const tStop = Date.now();
  const atStop = await js(`return [...document.querySelectorAll('.msg.assistant')].pop().querySelector('.content').textContent.length;`);
  await click('#stop');
  console.log(`(stop: ${atStop} bytes shown when clicked, the click took ${Date.now() - tStop} ms)`);
  eq(await waitFor(doneState, 5000, 'the stop'), 'stopped', 'Stop ends the stream');
  const a2 = await js(LAST);
  check(a2.content.length > 0 && a2.content.length < LONG.length && LONG.startsWith(a2.content),
    `the stopped answer is a strict prefix of the text (${a2.content.length} of ${LONG.length} bytes)`);
  let c2 = cancelled;
  for (let i = 0; i < 100 && c2 === cancelled; i++) { await sleep(50); c2 = metric(A.url, 'kvasir_gateway_cancelled_total'); }
  eq(c2, cancelled + 1, 'the gateway\'s /metrics counts the cancellation');
  await sleep(300);
  eq((await js(LAST)).content, a2.content, 'nothing arrives after Stop');

  // ---- a wrong key: the gateway's error message is shown ----
  await setField('#api-key', 'sk-wrong');
  await sendMessage('Hello?');
  eq(await waitFor(doneState, 5000, 'the refusal'), 'error', 'a refused request ends in error');
  const wrong = curl(`${A.url}/v1/chat/completions`, { key: 'sk-wrong', body: await lastSent() });
  check(wrong.status === 401, `curl with the wrong key: ${wrong.status}`);
  eq((await js(LAST)).status, JSON.parse(wrong.body).error.message, 'the page shows the gateway\'s error message');
  // the refused message is not part of the conversation: the next turn, with the key again, leaves it out
  await setField('#api-key', 'sk-web');
  await sendMessage('Again');
  eq(await waitFor(doneState, 20000, 'the turn after the refusal'), 'done', 'the turn after the refusal ends');
  const again = await lastSent();
  eq(again.messages.filter((m) => m.role === 'user').map((m) => m.content),
    ['What is the weather in Oslo?', 'Write a long text.', 'Again'], 'the conversation sent leaves the refused message out');
  const back = again.messages[2] || {};
  check(back.role === 'assistant' && back.content === XSS && back.tool_calls && back.tool_calls.length === 1 &&
    back.tool_calls[0].type === 'function' && /^call_/.test(back.tool_calls[0].id) &&
    canon(back.tool_calls[0].function) === canon({ name: a1.calls[0].name, arguments: a1.calls[0].args }),
    `the first answer goes back with its call (${JSON.stringify(back).slice(0, 300)})`);
  await setField('#api-key', '');
  await js(`localStorage.clear(); return 0;`);

  // ---- gateway B: the model's own text (no script), multi-turn ----
  const B = await gateway(['--name', 'plain'], {});
  procs.push(B.gw);
  await call('POST', `/session/${session}/url`, { url: B.url + '/' });
  eq(await waitFor(`const t = document.getElementById('model').textContent; return t !== '…' && t !== '?' && t;`,
    5000, 'gateway B\'s model id'), 'plain', 'gateway B\'s model id');
  await setField('#temperature', '0');
  await setField('#max-tokens', '24');
  await setField('#seed', '7');
  for (const [turn, text] of [[1, 'Hello there'], [2, 'And then?']]) {
    await sendMessage(text);
    eq(await waitFor(doneState, 20000, `plain turn ${turn}`), 'done', `plain turn ${turn} ends`);
    const a = await js(LAST);
    const body = await lastSent();
    eq(body.messages.length, 2 * turn - 1, `plain turn ${turn}: the page sends the conversation`);
    const r = JSON.parse(curl(`${B.url}/v1/chat/completions`, { body: { ...body, stream: false } }).body);
    check(a.content.length > 0, `plain turn ${turn}: the model wrote text (${JSON.stringify(a.content).slice(0, 80)})`);
    eq(a.content, r.choices[0].message.content, `plain turn ${turn}: the page's text equals curl's at temperature 0`);
    eq(a.contentElems, 0, `plain turn ${turn}: no element`);
    if (turn === 2) eq(body.messages[1], { role: 'assistant', content: (await js(`return document.querySelectorAll(
      '.msg.assistant .content')[0].textContent;`)) }, 'plain turn 2: the first answer is in the history');
  }

  // ---- gateway C: --no-web-ui ----
  const C = await gateway(['--no-web-ui'], {});
  procs.push(C.gw);
  for (const p of ['/', '/index.html']) {
    const r = curl(`${C.url}${p}`);
    check(r.status === 404 && /--no-web-ui/.test(r.body), `--no-web-ui: GET ${p} is 404 (${r.status} ${r.body})`);
  }
  check(curl(`${C.url}/health`).status === 200, '--no-web-ui: the API still serves');
} catch (e) {
  check(false, `browser: ${e.stack || e.message}`);
} finally {
  if (session) await call('DELETE', `/session/${session}`).catch(() => {});
  driver.kill('SIGTERM');
  for (const p of procs) p.kill('SIGTERM');
  await sleep(200);
  rmSync(profile, { recursive: true, force: true });
}
console.log(failures ? `${failures} check(s) failed` : 'all checks passed');
process.exit(failures ? 1 : 0);
