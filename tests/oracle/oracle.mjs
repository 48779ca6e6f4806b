#!/usr/bin/env node
// The llama.cpp oracle for Kvasir's conformance tests (test-only).
//
// Wraps node-llama-cpp 3.21.1 (the npm package pinned in package.json; its
// prebuilt CPU libllama) so that tests can ask llama.cpp, on the same GGUF
// file as Kvasir: how does it tokenize this text, what does it generate
// greedily, and what is its next-token distribution at every position of a
// given token sequence.
//
// Settings, chosen so that llama.cpp's own noise stays far below what we
// measure: CPU only (gpu:false), never build or download anything
// (build:"never", skipDownload), flash attention OFF and an F32 KV cache
// (llama.cpp's defaults, flash attention + F16 cache, add ~1e-3 of logit
// noise), a fixed thread count, one sequence, batch size >= the longest
// sequence we evaluate so a prompt is one batch.
//
// What comes out: node-llama-cpp does not expose raw logits. With a greedy
// sampler its `probabilities` are exactly softmax(raw logits) computed in
// float32 over the whole vocabulary (AddonContext.cpp, SampleToken), so we
// return log-probabilities renormalised in double: log p_i - log(sum p).
// They equal log_softmax(logits) to ~1e-6, and any comparison with our raw
// logits must therefore go through log_softmax (shift-invariant). A
// probability that underflowed float32 (logit more than ~87 below the max)
// comes back as 0 and is reported as -Infinity; callers skip those entries.
//
// Library use:
//   import { openOracle } from "./oracle.mjs";
//   const o = await openOracle(path, { threads: 2 });
//   o.tokenize(text, special)            -> number[]
//   await o.generate(promptIds, n)       -> { tokens, logprobs: Float32Array[] }
//   await o.forced(ids, from = 1, mode)  -> Float32Array[] (one per position from-1 .. ids.length-1;
//                                           mode "decode" (default) or "batch")
//   await o.dispose()
//
// CLI use (JSON on stdout, vectors as little-endian f32, n_vocab per row):
//   node oracle.mjs info     MODEL
//   node oracle.mjs tokenize MODEL [--texts FILE.json | TEXT...]
//   node oracle.mjs generate MODEL --ids 1,2,3 [-n 32] [--out FILE.f32]
//   node oracle.mjs forced   MODEL --ids 1,2,3,... [--from K] [--mode decode|batch] --out FILE.f32
// common options: --threads N (default 2), --ctx N (default 1024)
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { getLlama, LlamaLogLevel } from "node-llama-cpp";

export const ORACLE_SETTINGS = Object.freeze({
  package: "node-llama-cpp@3.21.1 (prebuilt CPU libllama)",
  flashAttention: false,
  kvCache: "F32/F32",
  gpu: false,
});

let llamaPromise = null;

/** Loads the llama.cpp backend once per process (CPU only, never builds). */
export function loadLlama(maxThreads = 2) {
  if (!llamaPromise) {
    llamaPromise = getLlama({
      gpu: false,
      build: "never",
      skipDownload: true,
      usePrebuiltBinaries: true,
      progressLogs: false,
      logLevel: LlamaLogLevel.error,
      maxThreads,
    });
  }
  return llamaPromise;
}

/** Turns node-llama-cpp's probability map into a log-softmax vector (double
 *  renormalisation, stored as f32; -Infinity where p underflowed to 0). */
export function probsToLogSoftmax(probMap, nVocab) {
  const out = new Float32Array(nVocab).fill(-Infinity);
  let sum = 0;
  for (const p of probMap.values()) sum += p;
  const lse = Math.log(sum);
  for (const [tok, p] of probMap) {
    if (tok >= 0 && tok < nVocab && p > 0) out[tok] = Math.log(p) - lse;
  }
  return out;
}

/**
 * Opens MODEL in llama.cpp with the oracle settings.
 * opts: threads (2), ctx (context size, 1024), batch (defaults to ctx).
 * Returns an object with tokenize/generate/forced/dispose; the caller must
 * call dispose() (the process may otherwise keep running).
 */
export async function openOracle(modelPath, opts = {}) {
  const threads = opts.threads ?? 2;
  const ctxSize = opts.ctx ?? 1024;
  const llama = await loadLlama(Math.max(threads, 1));
  const model = await llama.loadModel({
    modelPath: path.resolve(modelPath),
    gpuLayers: 0,
    useMmap: true,
    defaultContextFlashAttention: false,
  });
  const context = await model.createContext({
    contextSize: ctxSize,
    batchSize: opts.batch ?? ctxSize,
    sequences: 1,
    flashAttention: false,
    threads: { ideal: threads, min: threads },
    experimentalKvCacheKeyType: "F32",
    experimentalKvCacheValueType: "F32",
    failedCreationRemedy: false,
  });
  const sequence = context.getSequence();
  // llama.cpp's n_vocab is the length of tokenizer.ggml.tokens.
  const nVocab = model.fileInfo.metadata?.tokenizer?.ggml?.tokens?.length;
  if (!Number.isInteger(nVocab) || nVocab <= 0) throw new Error(`${modelPath}: no tokenizer.ggml.tokens`);
  const greedy = { probabilities: true, token: true, options: { temperature: 0 } };

  const o = {
    llama, model, context, sequence, nVocab,
    contextSize: context.contextSize,
    flashAttention: context.flashAttention,

    /** Token ids of text; special=true parses <|im_start|> etc. No BOS added. */
    tokenize(text, special) {
      if (text === "") return [];
      return Array.from(model.tokenize(text, special));
    },

    /** Text of ids (special tokens rendered). */
    detokenize(ids) {
      return model.detokenize(ids, true);
    },

    /**
     * Greedy continuation of promptIds, n tokens: the prompt as one batch,
     * then one token per decode, exactly like `kvasir run --temp 0`.
     * Returns { tokens, logprobs } with logprobs[i] the log-softmax from
     * which tokens[i] was picked. EOS does not stop it.
     */
    async generate(promptIds, n) {
      if (promptIds.length === 0) throw new Error("generate: empty prompt");
      await sequence.clearHistory();
      const tokens = [], logprobs = [];
      let input = promptIds.map((t, i) => (i === promptIds.length - 1 ? [t, { generateNext: greedy }] : t));
      for (let i = 0; i < n; i++) {
        const res = await sequence.controlledEvaluate(input);
        const next = res[input.length - 1]?.next;
        if (!next || next.token == null || !next.probabilities) throw new Error(`generate: no output at step ${i}`);
        tokens.push(next.token);
        logprobs.push(probsToLogSoftmax(next.probabilities, nVocab));
        input = [[next.token, { generateNext: greedy }]];
      }
      return { tokens, logprobs };
    },

    /**
     * Teacher-forced: the next-token log-softmax after ids[0..p] for every
     * position p in [from-1, ids.length-1] (from defaults to 1).
     * mode "decode" (default) evaluates ids[0..from-1] as one batch and then
     * feeds the remaining ids one per decode, exactly the computation
     * `kvasir run` does for its prompt and generated tokens; mode "batch"
     * evaluates the whole sequence as one batch (llama.cpp's F16 matmuls
     * differ between the two by up to ~1e-2; quantized ones agree exactly).
     */
    async forced(ids, from = 1, mode = "decode") {
      if (ids.length === 0) throw new Error("forced: empty sequence");
      if (from < 1 || from > ids.length) throw new Error(`forced: from=${from} out of [1, ${ids.length}]`);
      await sequence.clearHistory();
      const out = [];
      if (mode === "batch") {
        const input = ids.map((t, i) => (i >= from - 1 ? [t, { generateNext: greedy }] : t));
        const res = await sequence.controlledEvaluate(input);
        for (let p = from - 1; p < ids.length; p++) {
          const next = res[p]?.next;
          if (!next || !next.probabilities) throw new Error(`forced: no output at position ${p}`);
          out.push(probsToLogSoftmax(next.probabilities, nVocab));
        }
        return out;
      }
      if (mode !== "decode") throw new Error(`forced: unknown mode ${mode}`);
      let input = ids.slice(0, from).map((t, i) => (i === from - 1 ? [t, { generateNext: greedy }] : t));
      for (let p = from - 1; p < ids.length; p++) {
        const res = await sequence.controlledEvaluate(input);
        const next = res[input.length - 1]?.next;
        if (!next || !next.probabilities) throw new Error(`forced: no output at position ${p}`);
        out.push(probsToLogSoftmax(next.probabilities, nVocab));
        if (p + 1 < ids.length) input = [[ids[p + 1], { generateNext: greedy }]];
      }
      return out;
    },

    async dispose() {
      await context.dispose();
      await model.dispose();
    },
  };
  return o;
}

/** Writes rows of Float32Array as one little-endian f32 file. */
export function writeF32(file, rows) {
  const buf = Buffer.alloc(rows.reduce((a, r) => a + r.byteLength, 0));
  let off = 0;
  for (const r of rows) {
    for (let i = 0; i < r.length; i++, off += 4) buf.writeFloatLE(r[i], off);
  }
  fs.writeFileSync(file, buf);
}

function parseArgs(argv) {
  const a = { _: [] };
  for (let i = 0; i < argv.length; i++) {
    const k = argv[i];
    if (k === "-n") a.n = Number(argv[++i]);
    else if (k.startsWith("--")) a[k.slice(2)] = argv[++i];
    else a._.push(k);
  }
  return a;
}

function parseIds(s) {
  if (s == null) throw new Error("--ids is required");
  const t = s.trim();
  const ids = t.startsWith("[") ? JSON.parse(t) : t.split(",").filter(Boolean).map(Number);
  if (!ids.every(Number.isInteger)) throw new Error(`bad --ids: ${s}`);
  return ids;
}

async function main() {
  const a = parseArgs(process.argv.slice(2));
  const [cmd, modelPath, ...rest] = a._;
  if (!cmd || !modelPath) {
    process.stderr.write("usage: oracle.mjs info|tokenize|generate|forced MODEL [options] (see file header)\n");
    process.exit(2);
  }
  const o = await openOracle(modelPath, { threads: Number(a.threads ?? 2), ctx: Number(a.ctx ?? 1024) });
  try {
    if (cmd === "info") {
      console.log(JSON.stringify({ n_vocab: o.nVocab, context_size: o.contextSize, flash_attention: o.flashAttention, ...ORACLE_SETTINGS }));
    } else if (cmd === "tokenize") {
      const texts = a.texts ? JSON.parse(fs.readFileSync(a.texts, "utf8")) : rest;
      console.log(JSON.stringify(texts.map((text) => ({ text, special: o.tokenize(text, true), nospecial: o.tokenize(text, false) }))));
    } else if (cmd === "generate") {
      const r = await o.generate(parseIds(a.ids), a.n ?? 32);
      if (a.out) writeF32(a.out, r.logprobs);
      console.log(JSON.stringify({ tokens: r.tokens, text: o.detokenize(r.tokens), n_vocab: o.nVocab }));
    } else if (cmd === "forced") {
      const ids = parseIds(a.ids);
      const rows = await o.forced(ids, Number(a.from ?? 1), a.mode ?? "decode");
      if (!a.out) throw new Error("forced needs --out FILE");
      writeF32(a.out, rows);
      const argmax = rows.map((r) => { let b = 0; for (let i = 1; i < r.length; i++) if (r[i] > r[b]) b = i; return b; });
      console.log(JSON.stringify({ rows: rows.length, n_vocab: o.nVocab, argmax }));
    } else {
      throw new Error(`unknown command ${cmd}`);
    }
  } finally {
    await o.dispose();
    await o.llama.dispose();
  }
}

if (process.argv[1] && path.resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  main().catch((e) => {
    process.stderr.write(`oracle: ${e?.message ?? e}\n`);
    process.exit(1);
  });
}

// Re-exported for bench/llama_bench.mjs (which lives outside this package).
export { readGgufFileInfo } from "node-llama-cpp";
