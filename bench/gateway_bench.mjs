#!/usr/bin/env node
// `make bench-gateway` (bench/gateway.sh): aggregate tokens/s of N
// concurrent clients through `kvasir gateway` against llama.cpp decoding N
// parallel sequences of one context, same model file and thread count.
//
//   node bench/gateway_bench.mjs URL MODEL --threads T [--clients 1,4,16] [-n 32] [--reps 3]
//
// Kvasir: N clients post one OpenAI chat completion each at once (Node's
// fetch, non-streamed; temperature 0, max_tokens n, ignore_eos so every one
// generates n tokens), prompts "Client i: ..." of a few tokens through the
// GGUF's ChatML template. The gateway runs them as one continuous batch.
// Time: first request sent to last answer in; tokens: the completion
// tokens the answers' usage reports (checked = N x n).
//
// llama.cpp (node-llama-cpp 3.21.1, the test oracle's prebuilt CPU
// libllama): one context with N sequences (flash attention off, batch 512,
// threads fixed), each sequence gets the same ChatML prompt text (tokenized
// by llama.cpp) and decodes n greedy tokens; the N sequences evaluate
// concurrently, so node-llama-cpp batches them into one llama_decode per
// step. Same timing: first evaluation to last token.
//
// Both include the prompts (prefill) in the wall time, as a client sees it.
// Rounds alternate (kvasir, llama.cpp) per N after one untimed warm-up of
// each; best and mean of the rounds are reported. Prints one JSON object.
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const oracle = await import(path.join(here, "../tests/oracle/oracle.mjs"));

const argv = process.argv.slice(2);
const [url, modelFile] = argv;
const opt = (k, d) => { const i = argv.indexOf(k); return i < 0 ? d : argv[i + 1]; };
const threads = Number(opt("--threads", 2));
const clientsList = String(opt("--clients", "1,4,16")).split(",").map(Number);
const n = Number(opt("-n", 32));
const reps = Number(opt("--reps", 3));
const maxClients = Math.max(...clientsList);

const prompt = (i) => `Client ${i}: tell the swarm a story`;
const chatml = (p) => `<|im_start|>user\n${p}<|im_end|>\n<|im_start|>assistant\n`;

async function kvasirRound(N) {
  const body = (i) => JSON.stringify({
    model: "bench", messages: [{ role: "user", content: prompt(i) }], max_tokens: n, temperature: 0, seed: 1,
    ignore_eos: true,
  });
  const t0 = performance.now();
  const answers = await Promise.all(Array.from({ length: N }, async (_, i) => {
    const r = await fetch(`${url}/v1/chat/completions`, { method: "POST", headers: { "Content-Type": "application/json" }, body: body(i) });
    if (!r.ok) throw new Error(`gateway: HTTP ${r.status}: ${await r.text()}`);
    return r.json();
  }));
  const wall = (performance.now() - t0) / 1000;
  const gen = answers.reduce((a, j) => a + j.usage.completion_tokens, 0);
  const promptToks = answers.reduce((a, j) => a + j.usage.prompt_tokens, 0);
  if (gen !== N * n) throw new Error(`gateway: ${gen} completion tokens, want ${N * n}`);
  return { wall_s: wall, tok_s: gen / wall, prompt_tokens: promptToks };
}

const llama = await oracle.loadLlama(threads);
const model = await llama.loadModel({ modelPath: path.resolve(modelFile), gpuLayers: 0, useMmap: true, defaultContextFlashAttention: false });
const ctx = await model.createContext({
  contextSize: 512, batchSize: 512, sequences: maxClients, flashAttention: false,
  threads: { ideal: threads, min: threads }, failedCreationRemedy: false,
});
const seqs = Array.from({ length: maxClients }, () => ctx.getSequence());
const gen = { generateNext: { token: true, options: { temperature: 0 } } };

async function llamaRound(N) {
  const prompts = Array.from({ length: N }, (_, i) => model.tokenize(chatml(prompt(i)), true));
  for (let i = 0; i < N; i++) await seqs[i].clearHistory();
  const t0 = performance.now();
  await Promise.all(prompts.map(async (p, i) => {
    const seq = seqs[i];
    const r = await seq.controlledEvaluate(p.map((t, k) => (k === p.length - 1 ? [t, gen] : t)));
    let tok = r[p.length - 1].next.token;
    for (let k = 1; k < n; k++) {
      const o = await seq.controlledEvaluate([[tok, gen]]);
      tok = o[0].next.token;
    }
  }));
  const wall = (performance.now() - t0) / 1000;
  return { wall_s: wall, tok_s: (N * n) / wall, prompt_tokens: prompts.reduce((a, p) => a + p.length, 0) };
}

const rows = [];
await kvasirRound(1); // warm-up: pages in the weights, opens connections
await llamaRound(1);
for (const N of clientsList) {
  const kv = [], ll = [];
  for (let r = 0; r < reps; r++) {
    kv.push(await kvasirRound(N));
    ll.push(await llamaRound(N));
  }
  const best = (xs) => Math.max(...xs.map((x) => x.tok_s));
  const mean = (xs) => xs.reduce((a, x) => a + x.tok_s, 0) / xs.length;
  rows.push({
    clients: N, n_gen_each: n,
    kvasir: { tok_s: best(kv), tok_s_mean: mean(kv), prompt_tokens: kv[0].prompt_tokens, rounds: kv.map((x) => x.tok_s) },
    llama: { tok_s: best(ll), tok_s_mean: mean(ll), prompt_tokens: ll[0].prompt_tokens, rounds: ll.map((x) => x.tok_s) },
    ratio: best(kv) / best(ll), ratio_mean: mean(kv) / mean(ll),
  });
}
await ctx.dispose();
await model.dispose();
const cpu = ((await import("node:fs")).readFileSync("/proc/cpuinfo", "utf8").match(/model name\s*:\s*(.*)/) || [])[1] ?? "?";
console.log(JSON.stringify({
  date: new Date().toISOString(), cpu, nproc: os.cpus().length, loadavg: os.loadavg(), threads, reps, rows,
  settings: "kvasir gateway (continuous batching) vs node-llama-cpp 3.21.1 CPU prebuilt, one context with N sequences; " +
    "flash attention off; batch 512; temperature 0; wall time includes the prompts",
}));
