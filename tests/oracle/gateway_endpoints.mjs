// GET /props and POST /api/show of a gateway against the GGUF itself, read
// by node-llama-cpp's own GGUF reader (test-only, independent of Kvasir's):
// model_info holds every metadata value (arrays longer than 64 as null, the
// template as "template"), general.parameter_count is the sum of every
// tensor's elements, details.family the architecture, the template, BOS and
// EOS texts the GGUF's. Usage: node gateway_endpoints.mjs MODEL.gguf GW_URL NAME
import {readGgufFileInfo} from "node-llama-cpp";

const [file, gw, name] = process.argv.slice(2);
const fail = (m) => { console.error(`gateway_endpoints.mjs: FAIL: ${m}`); process.exit(1); };
const info = await readGgufFileInfo(file, {readTensorInfo: true});

// the nested metadata as dotted keys ("qwen3moe.attention.head_count")
const flat = {};
const walk = (o, p) => {
  for (const [k, v] of Object.entries(o)) {
    const key = p ? `${p}.${k}` : k;
    if (v && typeof v === "object" && !Array.isArray(v)) walk(v, key);
    else flat[key] = v;
  }
};
walk(info.metadata, "");

const post = async (path, body) => {
  const r = await fetch(gw + path, {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
  return [r.status, await r.json()];
};
const [st, show] = await post("/api/show", {model: name});
if (st !== 200) fail(`/api/show ${st}: ${JSON.stringify(show)}`);
const mi = show.model_info;
let n = 0;
for (const [k, v] of Object.entries(flat)) {
  if (k === "tokenizer.chat_template") continue;
  if (!(k in mi)) fail(`model_info lacks ${k}`);
  const want = Array.isArray(v) ? (v.length > 64 ? null : v) : typeof v === "bigint" ? Number(v) : v;
  if (JSON.stringify(mi[k]) !== JSON.stringify(want)) fail(`model_info.${k} = ${JSON.stringify(mi[k])}, the GGUF has ${JSON.stringify(want)}`);
  n++;
}
for (const k of Object.keys(mi))
  if (!(k in flat) && k !== "general.parameter_count") fail(`model_info has ${k}, which the GGUF does not`);
let params = 0;
for (const t of info.tensorInfo) params += t.dimensions.reduce((a, b) => a * Number(b), 1);
if (mi["general.parameter_count"] !== params) fail(`parameter_count ${mi["general.parameter_count"]}, tensors hold ${params}`);
if (show.details.family !== flat["general.architecture"]) fail(`details.family ${show.details.family}`);
if (show.template !== flat["tokenizer.chat_template"]) fail("/api/show template differs from the GGUF's");

const props = await (await fetch(gw + "/props")).json();
if (props.chat_template !== flat["tokenizer.chat_template"]) fail("/props chat_template differs from the GGUF's");
const toks = flat["tokenizer.ggml.tokens"];
if (props.bos_token !== toks[flat["tokenizer.ggml.bos_token_id"]]) fail(`bos_token ${props.bos_token}`);
if (props.eos_token !== toks[flat["tokenizer.ggml.eos_token_id"]]) fail(`eos_token ${props.eos_token}`);
const arch = flat["general.architecture"];
if (props.default_generation_settings.n_ctx !== flat[`${arch}.context_length`]) fail(`n_ctx ${props.default_generation_settings.n_ctx}`);
console.log(`ok: /api/show's ${n} model_info values, parameter_count ${params}, family, template; /props template, BOS, EOS, n_ctx equal the GGUF (node-llama-cpp's reader)`);
