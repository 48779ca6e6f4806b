// The hub's status page in a real browser: headless Chromium (Debian's
// chromium + chromium-driver), driven through chromedriver's WebDriver HTTP
// API with Node's built-in fetch (no npm package). Run by
// tests/test_hub_status.sh, which starts the swarm and passes:
//   KV_HUB_URL      the hub
//   KV_VICTIM_PID   a node to kill with SIGKILL
//   KV_EXPECT_PAIRS expert computations the coordinator's run reported
//   KV_DEADLINE_MS  the hub's heartbeat deadline
// Checks: the page renders from the hub alone (no other origin), its
// coverage map equals what /v1/market says cell by cell, its node table
// equals /v1/nodes (and the served counts add up to the coordinator's
// count), and after the kill the page changes by itself: the node shows
// gone and the map equals the new market.
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import net from 'node:net';
import { createHash, generateKeyPairSync, sign } from 'node:crypto';

const hub = process.env.KV_HUB_URL;
const victim = Number(process.env.KV_VICTIM_PID);
const expectPairs = Number(process.env.KV_EXPECT_PAIRS);
const deadlineMs = Number(process.env.KV_DEADLINE_MS || 1500);
const chromium = process.env.KV_CHROMIUM || '/usr/bin/chromium';
const driverBin = process.env.KV_CHROMEDRIVER || '/usr/bin/chromedriver';
let failures = 0;
function check(ok, what) {
  if (ok) console.log(`ok: ${what}`);
  else { console.log(`FAIL: ${what}`); failures++; }
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

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
const hubJSON = async (p) => (await fetch(hub + p)).json();

// what the page shows, read from its DOM
const readPage = () => js(`
  const cells = [...document.querySelectorAll('#map td')].map((td) =>
    [Number(td.dataset.layer), Number(td.dataset.expert), td.dataset.state, Number(td.dataset.live)]);
  const nodes = [...document.querySelectorAll('#nodes tbody tr')].map((tr) => ({
    key: tr.dataset.key, live: tr.dataset.live === 'true', shards: Number(tr.dataset.shards),
    served: Number(tr.cells[8].textContent.replace(/,/g, '')), relayed: tr.dataset.relayed === 'true',
    reached: tr.cells[9].textContent }));
  const t = (id) => document.getElementById(id).textContent;
  return { polls: Number(document.getElementById('summary').dataset.polls), cells, nodes,
           covered: t('covered'), missing: Number(t('shards-missing')), scarce: Number(t('shards-scarce')),
           total: Number(t('shards-total')), live: Number(t('live-nodes')),
           relayShown: !document.getElementById('relay').hidden, relayNodes: Number(t('relay-nodes')),
           market: [...document.querySelectorAll('#market tbody tr')].map((tr) => ({ layer: Number(tr.dataset.layer),
             first: Number(tr.dataset.first), wanted: Number(tr.dataset.wanted), demand: Number(tr.dataset.demand),
             shown: tr.cells[7].textContent })),
           resources: performance.getEntriesByType('resource').map((e) => e.name) };`);

// the cells /v1/market implies: [layer, expert, state, live]
function expectCells(market) {
  const out = [];
  for (const s of market.shards) {
    const st = s.live === 0 ? 'missing' : s.live < s.wanted ? 'scarce' : 'covered';
    for (let e = s.first; e <= s.last; e++) out.push([s.layer, e, st, s.live]);
  }
  return out.sort((a, b) => a[0] - b[0] || a[1] - b[1]);
}
const key = (cells) => JSON.stringify([...cells].sort((a, b) => a[0] - b[0] || a[1] - b[1]));

// waits (bounded) until the page shows the market as it stands: a market
// read before and after the page read must agree, and the page with them
async function pageMatchesMarket(what, timeoutMs) {
  const t0 = Date.now();
  let last = '';
  while (Date.now() - t0 < timeoutMs) {
    const m1 = await hubJSON('/v1/market');
    const p = await readPage();
    const m2 = await hubJSON('/v1/market');
    const want = key(expectCells(m1));
    if (p.polls > 0 && want === key(expectCells(m2)) && key(p.cells) === want) {
      check(true, `${what}: map equals /v1/market (${p.cells.length} cells, ${p.missing} missing shards, ${p.scarce} scarce)`);
      return { page: p, market: m1 };
    }
    last = `page ${key(p.cells).slice(0, 200)} vs market ${want.slice(0, 200)}`;
    await sleep(300);
  }
  check(false, `${what}: map never equal to /v1/market: ${last}`);
  return null;
}

// A demand report signed here with Node's own Ed25519 (an independent
// client of the hub's request signature, docs/HUB.md): the hub runs with
// --vouch-open, so any key may report. Returns the hub's answer.
async function reportDemand(body) {
  const { publicKey, privateKey } = generateKeyPairSync('ed25519');
  const pk = Buffer.from(publicKey.export({ format: 'jwk' }).x, 'base64url').toString('hex');
  const counter = String(BigInt(Date.now()) * 1000n);
  const digest = createHash('sha256').update(body).digest('hex');
  const text = `kvasir-hub-v1\nPOST\n/v1/demand\n${counter}\n${digest}\n`;
  const sig = sign(null, createHash('sha256').update(text).digest(), privateKey).toString('hex'); // over SHA-256 of the text
  const r = await fetch(hub + '/v1/demand', { method: 'POST', body, headers: {
    'Content-Type': 'application/json', 'X-Kvasir-Key': pk, 'X-Kvasir-Counter': counter, 'X-Kvasir-Signature': sig } });
  return { status: r.status, json: await r.json() };
}

try {
  {
    const m = await hubJSON('/v1/market');
    const s0 = m.shards.find((s) => s.layer === 0 && s.first === 0);
    const rep = await reportDemand(JSON.stringify({ tokens: 100, shards: [
      { layer: 0, first: s0.first, last: s0.last, computations: 150, wait_us: 20000 }] }));
    check(rep.status === 200 && rep.json.tokens === 100 && rep.json.computations === 150,
      `a demand report signed by an independent Ed25519 client is taken (${rep.status} ${JSON.stringify(rep.json)})`);
  }
  for (let i = 0; i < 100; i++) {
    try { await call('GET', '/status'); break; } catch { await sleep(100); }
  }
  session = (await call('POST', '/session', {
    capabilities: { alwaysMatch: { browserName: 'chrome', 'goog:chromeOptions': {
      binary: chromium,
      args: ['--headless=new', '--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', `--user-data-dir=${profile}`],
    } } },
  })).sessionId;
  await call('POST', `/session/${session}/url`, { url: hub + '/' });
  const title = await call('GET', `/session/${session}/title`);
  check(title === 'Kvasir hub', `the page renders (title '${title}')`);

  const a = await pageMatchesMarket('before the kill', 15000);
  if (a) {
    const { page, market } = a;
    const nodes = await hubJSON('/v1/nodes');
    check(page.nodes.length === nodes.nodes.length && page.nodes.every((n) => n.live),
      `node table: ${page.nodes.length} rows, all live, as /v1/nodes`);
    const held = Object.fromEntries(nodes.nodes.map((n) => [n.key, n.shards.length]));
    check(page.nodes.every((n) => held[n.key] === n.shards), 'node table: shards held per node as /v1/nodes');
    const rel = Object.fromEntries(nodes.nodes.map((n) => [n.key, n.relayed === true]));
    check(page.nodes.every((n) => n.relayed === rel[n.key] &&
                                  n.reached === (rel[n.key] ? 'through the relay' : 'direct')) &&
          page.nodes.filter((n) => n.relayed).length === 1,
      'node table: one node reached through the relay, the other direct, as /v1/nodes says');
    check(page.relayShown && page.relayNodes === (nodes.relay ? nodes.relay.nodes : -1),
      `relay traffic shown: ${page.relayNodes} node(s) connected, as /v1/nodes's relay says`);
    const dem = Object.fromEntries(market.shards.map((s) => [`${s.layer}/${s.first}`, s]));
    // the page's poll and the market read here are up to a few seconds apart: the rate decays
    // by about 1.2% a second (a 60 s half-life)
    check(page.market.length === market.shards.length &&
          page.market.every((r) => { const s = dem[`${r.layer}/${r.first}`];
            return s && r.wanted === s.wanted && Math.abs(r.demand - s.demand) <= 0.1 * s.demand + 0.05 &&
                   r.shown === r.demand.toFixed(1); }) &&
          // the coordinator's own run --hub reports its demand too (a little on every shard);
          // the shard this test reported heavily on stands above every other
          page.market.every((r) => (r.layer === 0 && r.first === 0) ||
                                   r.demand < page.market.find((q) => q.layer === 0 && q.first === 0).demand) &&
          page.market.find((r) => r.layer === 0 && r.first === 0).demand > 0,
      `market table: wanted and demand per shard as /v1/market, the reported shard's demand shown ` +
      `(${page.market.map((r) => r.shown).join(' ')})`);
    check(page.covered === (market.covered ? 'complete' : 'incomplete') && page.total === market.shards.length,
      `summary: coverage '${page.covered}', ${page.total} shards`);
    const origin = new URL(hub).origin;
    check(page.resources.length > 0 && page.resources.every((r) => r.startsWith(origin)),
      `every resource the page loaded is the hub's (${[...new Set(page.resources.map((r) => new URL(r).pathname))].join(', ')})`);
  }
  // served counts: wait until the heartbeats after the run reached the hub
  {
    const t0 = Date.now();
    let sum = -1;
    while (Date.now() - t0 < 10000) {
      const p = await readPage();
      sum = p.nodes.reduce((s, n) => s + n.served, 0);
      if (sum === expectPairs) break;
      await sleep(300);
    }
    check(sum === expectPairs, `served computations on the page add up to the coordinator's ${expectPairs} (got ${sum})`);
  }

  const before = await readPage();
  process.kill(victim, 'SIGKILL');
  const t0 = Date.now();
  let gone = false;
  while (Date.now() - t0 < deadlineMs + 10000 && !gone) {
    await sleep(250);
    const p = await readPage();
    gone = p.polls > before.polls && p.nodes.some((n) => !n.live);
  }
  check(gone, `the page updated itself: a node shows gone after SIGKILL (${Date.now() - t0} ms, deadline ${deadlineMs} ms)`);
  const b = await pageMatchesMarket('after the kill', 10000);
  if (b) {
    check(key(b.page.cells) !== key(before.cells), 'the map changed with the kill');
    check(b.page.live === before.live - 1, `live nodes ${before.live} -> ${b.page.live}`);
  }
} catch (e) {
  check(false, `browser: ${e.message}`);
} finally {
  if (session) await call('DELETE', `/session/${session}`).catch(() => {});
  driver.kill('SIGTERM');
  await sleep(200);
  rmSync(profile, { recursive: true, force: true });
}
process.exit(failures ? 1 : 0);
