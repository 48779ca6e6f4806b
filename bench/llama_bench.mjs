#!/usr/bin/env node
// llama.cpp side of `make bench` (bench/run.sh), and the weight-bytes model.
//
//   node bench/llama_bench.mjs speed MODEL [--threads N] [-p 128] [-n 64] [--reps 3]
//     llama.cpp (node-llama-cpp 3.21.1, prebuilt CPU libllama, the test
//     oracle's install) on MODEL: prefill of p tokens as one batch, then n
//     greedy decode steps, one token each, timed in node around the calls
//     (performance.now()). Settings: CPU only, `threads` fixed (ideal = min),
//     batch size 512 (>= p, so the prompt is one batch), flash attention OFF
//     (like Kvasir, which has no flash attention), KV cache at llama.cpp's
//     default F16, context 512, mmap. One untimed warm-up pass faults the
//     weights in; the best of `reps` runs is reported. Prints JSON
//     {prefill_tok_s, decode_tok_s, ...}.
//
//   node bench/llama_bench.mjs report OUTDIR THREADS KEY...
//     Table + OUTDIR/results.json (or $KV_BENCH_RESULTS) from the files
//     bench/run.sh wrote; KEY = q8_0, q4_k (qwen3moe), qwen35-q4_k, ...
//
//   node bench/llama_bench.mjs bytes MODEL
//     Bytes of weights read per decoded token, from the GGUF tensor table:
//     every non-expert tensor of every layer (attention, norms, router; for
//     qwen35moe also the linear-attention tensors and the shared expert) in
//     full, n_expert_used/n_expert of each routed-expert tensor, the output
//     norm and LM head (output.weight, or token_embd.weight when tied), and
//     one row of token_embd; MTP blocks (nextn) are left out. KV-cache and
//     recurrent-state reads are reported apart.
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const oracle = await import(path.join(here, "../tests/oracle/oracle.mjs"));

// ggml type -> [block bytes, block elements] (ggml.c type_traits)
const GGML = {
  0: [4, 1, "F32"], 1: [2, 1, "F16"], 2: [18, 32, "Q4_0"], 3: [20, 32, "Q4_1"], 6: [22, 32, "Q5_0"], 7: [24, 32, "Q5_1"],
  8: [34, 32, "Q8_0"], 10: [84, 256, "Q2_K"], 11: [110, 256, "Q3_K"], 12: [144, 256, "Q4_K"], 13: [176, 256, "Q5_K"],
  14: [210, 256, "Q6_K"], 15: [292, 256, "Q8_K"], 23: [136, 256, "IQ4_XS"], 30: [2, 1, "BF16"], 39: [17, 32, "MXFP4"],
};

function tensorBytes(t) {
  const tt = GGML[t.ggmlType];
  if (!tt) throw new Error(`tensor ${t.name}: unknown ggml type ${t.ggmlType}`);
  const n = t.dimensions.reduce((a, b) => a * Number(b), 1);
  return (n / tt[1]) * tt[0];
}

export async function weightBytes(file) {
  const info = await oracle.readGgufFileInfo(file, { readTensorInfo: true });
  const md = info.metadata;
  const arch = md.general.architecture;
  const a = md[arch];
  const nExpert = Number(a.expert_count), nUsed = Number(a.expert_used_count);
  const nLayerAll = Number(a.block_count), nNextn = Number(a.nextn_predict_layers ?? 0);
  const nLayer = nLayerAll - nNextn; // MTP blocks (qwen35moe) sit at the end and are not run per token
  let perToken = 0, total = 0, experts = 0, attn = 0, linear = 0, shexp = 0, router = 0, head = 0, embdRow = 0, mtp = 0;
  const types = {};
  const byName = new Map(info.tensorInfo.map((t) => [t.name, t]));
  for (const t of info.tensorInfo) {
    const b = tensorBytes(t);
    total += b;
    types[t.name.replace(/^blk\.\d+\./, "blk.*.")] = GGML[t.ggmlType][2];
    const blk = /^blk\.(\d+)\./.exec(t.name);
    if (blk && Number(blk[1]) >= nLayer) { mtp += b; continue; }
    if (/_exps\.weight$/.test(t.name)) { const r = (b * nUsed) / nExpert; perToken += r; experts += r; }
    else if (t.name === "token_embd.weight") {
      const row = b / Number(t.dimensions[1]);
      embdRow = row;
      perToken += row;
      if (!byName.has("output.weight")) { perToken += b; head += b; }
    } else if (t.name === "output.weight") { perToken += b; head += b; }
    // qwen35moe: the shared expert (and its sigmoid gate) is read in full for every token
    else if (/_shexp\.weight$/.test(t.name)) { perToken += b; shexp += b; }
    else if (/ffn_gate_inp/.test(t.name)) { perToken += b; router += b; }
    // qwen35moe linear-attention blocks: fused QKV, gate (z), alpha/beta, conv, dt/A, norm, out
    else if (/\.(ssm_[a-z0-9_]+|attn_qkv|attn_gate)\.(weight|bias)$|\.ssm_(a|dt)$/.test(t.name)) { perToken += b; linear += b; }
    else { perToken += b; if (/attn/.test(t.name)) attn += b; }
  }
  const nKv = Number(a.attention.head_count_kv);
  const hd = Number(a.attention.key_length ?? a.embedding_length / a.attention.head_count);
  // qwen35moe: only every full_attention_interval-th block has a KV cache;
  // the others carry a recurrent state (f32 in Kvasir) read and written per token
  const interval = Number(a.full_attention_interval ?? 1);
  const nFull = arch === "qwen35moe" ? Array.from({ length: nLayer }, (_, i) => (i + 1) % interval === 0).filter(Boolean).length : nLayer;
  const out = {
    arch, n_layer: nLayer, n_embd: Number(a.embedding_length), n_expert: nExpert, n_expert_used: nUsed,
    n_ff_exp: Number(a.expert_feed_forward_length), n_head: Number(a.attention.head_count), n_head_kv: nKv, head_dim: hd,
    n_vocab: md.tokenizer.ggml.tokens.length, tied: !byName.has("output.weight"),
    tensor_types: types,
    file_bytes: fs.statSync(file).size, weight_bytes: total,
    bytes_per_token: Math.round(perToken),
    breakdown: { experts: Math.round(experts), attention: Math.round(attn), router: Math.round(router), lm_head: Math.round(head), embd_row: Math.round(embdRow) },
    // K and V, f32, per position of context, read once per decoded token
    kv_bytes_per_ctx_pos_f32: 2 * nFull * nKv * hd * 4,
  };
  if (arch === "qwen35moe") {
    const sv = Number(a.ssm.state_size), nv = Number(a.ssm.time_step_rank), ng = Number(a.ssm.group_count);
    const conv = Number(a.ssm.conv_kernel), inner = Number(a.ssm.inner_size);
    Object.assign(out.breakdown, { linear_attention: Math.round(linear), shared_expert: Math.round(shexp) });
    Object.assign(out, {
      n_layer_nextn: nNextn, mtp_bytes: mtp, full_attention_interval: interval, n_full_attention: nFull, n_linear_attention: nLayer - nFull,
      ssm: { d_state: sv, v_heads: nv, k_heads: ng, d_conv: conv, d_inner: inner },
      // per linear block: nv heads of d_state x d_state f32, plus (d_conv-1) x conv channels
      recurrent_state_bytes_f32: (nLayer - nFull) * (nv * sv * sv + (conv - 1) * (2 * ng * sv + inner)) * 4,
    });
  }
  return out;
}

function ids(n, nVocab, salt) {
  // deterministic ordinary-token ids (special tokens sit at the end of our vocabularies)
  const out = [];
  for (let i = 0; i < n; i++) out.push(((i + salt) * 7919 + 13) % Math.max(1, nVocab - 16));
  return out;
}

export async function speed(file, { threads = 2, p = 128, n = 64, reps = 3 } = {}) {
  const llama = await oracle.loadLlama(threads);
  // the weights resident before the timed rounds when they fit in half the
  // RAM (useMlock faults every page in), as kvasir bench's warm-up does
  const useMlock = fs.statSync(file).size < os.totalmem() / 2;
  const model = await llama.loadModel({ modelPath: path.resolve(file), gpuLayers: 0, useMmap: true, useMlock, defaultContextFlashAttention: false });
  const ctx = await model.createContext({
    contextSize: Math.max(512, p + n + 16), batchSize: 512, sequences: 1, flashAttention: false,
    threads: { ideal: threads, min: threads }, failedCreationRemedy: false,
  });
  const seq = ctx.getSequence();
  const nVocab = model.fileInfo.metadata.tokenizer.ggml.tokens.length;
  const gen = { generateNext: { token: true, options: { temperature: 0 } } };
  async function once(np, nd, salt) {
    await seq.clearHistory();
    const prompt = ids(np, nVocab, salt);
    const t0 = performance.now();
    const r = await seq.controlledEvaluate(prompt.map((t, i) => (i === np - 1 ? [t, gen] : t)));
    const t1 = performance.now();
    let tok = r[np - 1].next.token;
    for (let i = 0; i < nd; i++) {
      const o = await seq.controlledEvaluate([[tok, gen]]);
      tok = o[0].next.token;
    }
    const t2 = performance.now();
    return { prefill_s: (t1 - t0) / 1000, decode_s: (t2 - t1) / 1000 };
  }
  await once(Math.min(p, 16), 4, 99); // warm-up: fault the mmap in
  const runs = [];
  for (let r = 0; r < reps; r++) runs.push(await once(p, n, r));
  const bestP = Math.min(...runs.map((x) => x.prefill_s)), bestD = Math.min(...runs.map((x) => x.decode_s));
  await ctx.dispose();
  await model.dispose();
  return {
    prefill_tok_s: p / bestP, decode_tok_s: n / bestD,
    prefill_tok_s_mean: runs.reduce((a, x) => a + p / x.prefill_s, 0) / runs.length,
    decode_tok_s_mean: runs.reduce((a, x) => a + n / x.decode_s, 0) / runs.length,
    n_prompt: p, n_gen: n, threads, reps,
    runs: runs.map((x) => ({ prefill_tok_s: p / x.prefill_s, decode_tok_s: n / x.decode_s })),
    settings: `node-llama-cpp 3.21.1 CPU prebuilt; flash attention off; KV cache F16 (default); batch 512; ctx max(512, prompt + generated + 16); mmap${useMlock ? " + mlock (every page resident)" : ""}; best and mean of reps after warm-up`,
  };
}

/** Reads bench/out/*.json written by bench/run.sh, prints the table and
 *  writes results.json. */
export function report(outDir, threads, types) {
  const rd = (f) => JSON.parse(fs.readFileSync(path.join(outDir, f), "utf8"));
  const bws = {};
  for (const th of String(threads).split(/\s+/).filter(Boolean)) bws[th] = rd(`membw-t${th}.json`);
  const bw1 = bws["1"];
  const cpu = (fs.readFileSync("/proc/cpuinfo", "utf8").match(/model name\s*:\s*(.*)/) || [])[1] ?? "?";
  const rows = [];
  for (const key of types) {
    // key: MODEL.tTHREADS (bench/run.sh)
    const t = key.replace(/\.t\d+$/, ""), th = Number(key.match(/\.t(\d+)$/)?.[1] ?? threads);
    const bw = bws[String(th)];
    const bytes = rd(`${t}.bytes.json`);
    const rdl = (f) => fs.readFileSync(path.join(outDir, f), "utf8").split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l));
    // one JSON object per round; best and mean over rounds
    const summarize = (runs) => ({
      prefill_tok_s: Math.max(...runs.map((r) => r.prefill_tok_s)),
      decode_tok_s: Math.max(...runs.map((r) => r.decode_tok_s)),
      prefill_tok_s_mean: runs.reduce((a, r) => a + r.prefill_tok_s, 0) / runs.length,
      decode_tok_s_mean: runs.reduce((a, r) => a + r.decode_tok_s, 0) / runs.length,
      // kvasir bench --all-rows: the prefill with every row through the last block
      prefill_all_rows_tok_s: runs.every((r) => r.prefill_all_rows_tok_s) ? Math.max(...runs.map((r) => r.prefill_all_rows_tok_s)) : null,
      rounds: runs.map((r) => ({ prefill_tok_s: r.prefill_tok_s, decode_tok_s: r.decode_tok_s, prefill_all_rows_tok_s: r.prefill_all_rows_tok_s })),
    });
    const kvRuns = rdl(`${key}.kvasir.jsonl`), llRuns = rdl(`${key}.llama.jsonl`);
    const ex = (f) => fs.existsSync(path.join(outDir, f));
    let ttft = null;
    if (ex(`${key}.ttft.kvasir.json`) && ex(`${key}.ttft.llama.json`)) {
      const a = rd(`${key}.ttft.kvasir.json`), b = rd(`${key}.ttft.llama.json`);
      // prompt evaluated and the first token picked (no tokenization: both get ids)
      ttft = { n_prompt: b.n_prompt, kvasir_s: b.n_prompt / a.prefill_tok_s, llama_s: b.n_prompt / b.prefill_tok_s };
      ttft.ratio = ttft.llama_s / ttft.kvasir_s;
    }
    const kvasir = { ...summarize(kvRuns), backend: kvRuns[0]?.backend, bytes_per_token_reported: kvRuns[0]?.bytes_per_token };
    const llama = { ...summarize(llRuns), settings: llRuns[0]?.settings };
    const boundTokS = (bw.read_gb_s * 1e9) / bytes.bytes_per_token;
    // each round's own probe (bench/run.sh reads it before the round): decode
    // against the bound of the minute it ran in, best over rounds
    const roundBw = ex(`${key}.membw.jsonl`) ? rdl(`${key}.membw.jsonl`).map((b) => b.read_gb_s) : [];
    const ofRound = (runs) => roundBw.length === runs.length && runs.length
      ? Math.max(...runs.map((r, i) => (r.decode_tok_s * bytes.bytes_per_token) / (roundBw[i] * 1e9))) : null;
    rows.push({
      type: t, threads: th, ttft, read_gb_s: bw.read_gb_s, arch: bytes.arch, quant: t.replace(/^.*-/, ""), model: bytes, kvasir, llama,
      prefill_ratio: kvasir.prefill_tok_s / llama.prefill_tok_s,
      prefill_all_rows_ratio: kvasir.prefill_all_rows_tok_s ? kvasir.prefill_all_rows_tok_s / llama.prefill_tok_s : null,
      decode_ratio: kvasir.decode_tok_s / llama.decode_tok_s,
      decode_bound_tok_s: boundTokS,
      kvasir_decode_of_bound: kvasir.decode_tok_s / boundTokS,
      llama_decode_of_bound: llama.decode_tok_s / boundTokS,
      round_read_gb_s: roundBw,
      kvasir_decode_of_round_bound: ofRound(kvRuns),
      llama_decode_of_round_bound: ofRound(llRuns),
    });
  }
  const res = {
    date: new Date().toISOString(), cpu, nproc: os.cpus().length, loadavg: os.loadavg(), threads: String(threads),
    isa: process.env.KV_BENCH_ISA || "native",
    n_prompt: 128, n_gen: 64, bandwidth: bws, bandwidth_1thread: bw1, models: rows,
  };
  const resultsFile = path.join(outDir, process.env.KV_BENCH_RESULTS || "results.json");
  fs.writeFileSync(resultsFile, JSON.stringify(res, null, 1));
  const f1 = (x) => x.toFixed(1), f2 = (x) => x.toFixed(2);
  const head = ["model", "threads", "backend", "layers", "file GB", "MB/token", "prefill kvasir", "prefill llama", "ratio", "every-row ratio", "decode kvasir", "decode llama", "ratio", "decode bound", "kvasir/bound", "llama/bound", "kvasir/round bound", "mean ratio p/d", "TTFT kvasir s", "TTFT llama s", "TTFT ratio"];
  const lines = rows.map((r) => [
    r.type, String(r.threads), String(r.kvasir.backend), String(r.model.n_layer), f2(r.model.file_bytes / 1e9), f1(r.model.bytes_per_token / 1e6),
    f1(r.kvasir.prefill_tok_s), f1(r.llama.prefill_tok_s), f2(r.prefill_ratio),
    r.prefill_all_rows_ratio == null ? "-" : f2(r.prefill_all_rows_ratio),
    f1(r.kvasir.decode_tok_s), f1(r.llama.decode_tok_s), f2(r.decode_ratio),
    f1(r.decode_bound_tok_s), (100 * r.kvasir_decode_of_bound).toFixed(0) + "%", (100 * r.llama_decode_of_bound).toFixed(0) + "%",
    r.kvasir_decode_of_round_bound == null ? "-" : (100 * r.kvasir_decode_of_round_bound).toFixed(0) + "%",
    `${f2(r.kvasir.prefill_tok_s_mean / r.llama.prefill_tok_s_mean)}/${f2(r.kvasir.decode_tok_s_mean / r.llama.decode_tok_s_mean)}`,
    r.ttft ? f2(r.ttft.kvasir_s) : "-", r.ttft ? f2(r.ttft.llama_s) : "-", r.ttft ? f2(r.ttft.ratio) : "-",
  ]);
  const w = head.map((h, i) => Math.max(h.length, ...lines.map((x) => x[i].length)));
  const line = (x) => x.map((c, i) => c.padStart(w[i])).join("  ");
  const bwTxt = Object.values(bws).map((b) => `${b.read_gb_s} GB/s (${b.threads} threads)`).join(", ");
  console.log(`\n${cpu}, ${res.nproc} cpus, load ${res.loadavg.map((x) => x.toFixed(2)).join(" ")}; threads ${threads}; llama.cpp ISA ${res.isa}; read bandwidth ${bwTxt}`);
  console.log(`tokens/s (best of ${rows[0]?.kvasir.rounds.length ?? "?"} alternating rounds), prefill ${res.n_prompt} tokens, decode ${res.n_gen}; ratio = kvasir / llama.cpp (best; last column: of the means);`);
  console.log("every-row ratio = Kvasir's prefill with every prompt token through its whole last block (kvasir bench --all-rows) / llama.cpp's prefill (which for qwen3moe skips the last block's experts for those tokens, for qwen35moe does not);");
  console.log("decode bound = read bandwidth / bytes of weights per token; kvasir/round bound = each round's decode against the probe read just before that round, best round; TTFT: a " + (rows.find((r) => r.ttft)?.ttft.n_prompt ?? "-") + "-token prompt evaluated and the first token picked, one round; TTFT ratio = llama.cpp / kvasir");
  console.log(line(head));
  for (const x of lines) console.log(line(x));
  // the 122B skeleton: decode against its bound, its profile, its cold start
  const s122 = [];
  for (const th of String(threads).split(/\s+/).filter(Boolean)) {
    // KV_BENCH_122B_REPS warm rounds, each one process after its own probe;
    // the row is the best round against its own probe, every round kept
    const f = path.join(outDir, `s122.t${th}.jsonl`), fr = path.join(outDir, `s122.t${th}.membw.jsonl`);
    if (!fs.existsSync(f)) continue;
    const jl = (p) => fs.readFileSync(p, "utf8").split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l));
    const runs = jl(f), rbws = fs.existsSync(fr) ? jl(fr).map((b) => b.read_gb_s) : [];
    if (!runs.length) continue;
    const bw = bws[th];
    const rounds = runs.map((k, i) => {
      const dec = k.profile?.decode, tot = dec ? Object.values(dec.stages_ms).reduce((a, b) => a + b, 0) : 0;
      const rbw = rbws.length === runs.length ? rbws[i] : null;
      const bound = (bw.read_gb_s * 1e9) / k.bytes_per_token;
      return { threads: Number(th), prefill_tok_s: k.prefill_tok_s, decode_tok_s: k.decode_tok_s, bytes_per_token: k.bytes_per_token,
        read_gb_s: bw.read_gb_s, decode_bound_tok_s: bound, of_bound: k.decode_tok_s / bound, peak_rss_kb: k.peak_rss_kb,
        round_read_gb_s: rbw, of_round_bound: rbw ? (k.decode_tok_s * k.bytes_per_token) / (rbw * 1e9) : null,
        // the delta-net state is read and written back every token as well
        // (recurrent_bytes each way): the bound with those bytes counted
        recurrent_bytes: k.recurrent_bytes ?? 0,
        of_round_bound_with_state: rbw ? (k.decode_tok_s * (k.bytes_per_token + 2 * (k.recurrent_bytes ?? 0))) / (rbw * 1e9) : null,
        decode_profile_ms: dec?.stages_ms, decode_wall_ms: dec?.wall_ms, decode_stages_ms: tot };
    });
    const key = (r) => r.of_round_bound ?? r.of_bound;
    const best = rounds.reduce((a, r) => (key(r) > key(a) ? r : a));
    s122.push({ ...best, rounds: rounds.map((r) => ({ decode_tok_s: r.decode_tok_s, round_read_gb_s: r.round_read_gb_s, of_round_bound: r.of_round_bound })) });
  }
  const coldF = path.join(outDir, "s122.cold.json");
  const cold = fs.existsSync(coldF) ? fs.readFileSync(coldF, "utf8").split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l)) : [];
  res.skeleton_122b = { rows: s122, cold };
  fs.writeFileSync(resultsFile, JSON.stringify(res, null, 1));
  if (s122.length) {
    console.log("\nQwen3.5-122B-A10B skeleton (Q4_K/Q6_K, holes read as zeros; llama.cpp cannot load it here), warm, -p 16 -n 24:");
    for (const r of s122) {
      const top = Object.entries(r.decode_profile_ms || {}).sort((a, b) => b[1] - a[1]).slice(0, 4)
        .map(([n, ms]) => `${n} ${(100 * ms / r.decode_wall_ms).toFixed(0)}%`).join(", ");
      console.log(`  threads ${r.threads}, best of ${r.rounds.length} rounds (of own probe: ${r.rounds.map((x) => x.of_round_bound == null ? "-" : (100 * x.of_round_bound).toFixed(0) + "%").join(", ")}): decode ${f2(r.decode_tok_s)} tok/s, bound ${f2(r.decode_bound_tok_s)} (${r.read_gb_s} GB/s / ${f1(r.bytes_per_token / 1e6)} MB per token) = ${(100 * r.of_bound).toFixed(0)}% of bound${r.round_read_gb_s ? ` (${(100 * r.of_round_bound).toFixed(0)}% of its own probe, ${r.round_read_gb_s} GB/s just before; ${(100 * r.of_round_bound_with_state).toFixed(0)}% counting the ${f1(r.recurrent_bytes / 1e6)} MB delta-net state read and written)` : ""}; prefill ${f2(r.prefill_tok_s)} tok/s; peak RSS ${f1(r.peak_rss_kb / 1048576)} GB; decode stages: ${top}`);
    }
  }
  if (cold.length) {
    const by = (m) => cold.filter((c) => c.mode === m);
    const best = (rs, k) => Math.min(...rs.map((c) => c[k]));
    console.log("  cold start (page cache dropped), kvasir run -n 1: " + ["prefault", "no-prefault"].filter((m) => by(m).length)
      .map((m) => `${m}: process ${f2(best(by(m), "wall_s"))} s, prompt ${f2(best(by(m), "prefill_s"))} s (best of ${by(m).length})`).join("; "));
  }
  console.log(`bench: wrote ${resultsFile}`);
  return res;
}

async function main() {
  const argv = process.argv.slice(2);
  const [cmd, file] = argv;
  const opt = (k, d) => { const i = argv.indexOf(k); return i < 0 ? d : Number(argv[i + 1]); };
  if (cmd === "bytes") console.log(JSON.stringify(await weightBytes(file)));
  else if (cmd === "speed") {
    const r = await speed(file, { threads: opt("--threads", 2), p: opt("-p", 128), n: opt("-n", 64), reps: opt("--reps", 3) });
    console.log(JSON.stringify(r));
    (await oracle.loadLlama()).dispose();
  } else if (cmd === "report") {
    report(file, argv[2], argv.slice(3));
  } else {
    process.stderr.write("usage: llama_bench.mjs speed|bytes MODEL [--threads N] [-p 128] [-n 64] [--reps 3]\n");
    process.exit(2);
  }
}

if (process.argv[1] && path.resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  main().catch((e) => { process.stderr.write(`llama_bench: ${e?.stack ?? e}\n`); process.exit(1); });
}
