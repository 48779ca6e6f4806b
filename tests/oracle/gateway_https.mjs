#!/usr/bin/env node
// The official `openai` client against `kvasir gateway --tls-cert` (driven by
// tests/test_https.sh; test-only). The gateway's certificate is trusted only
// through NODE_EXTRA_CA_CERTS (the served PEM), so the client does its own
// certificate and host-name checks. KV_GW_EXPECT=refused: the client, started
// without that trust, must fail to connect (the certificate is self-signed).
// Otherwise a whole and a streamed chat completion must equal KV_GW_REF, the
// text of `kvasir run --chat` with the same parameters.
import OpenAI from 'openai';

const url = process.env.KV_GW_URL, ref = process.env.KV_GW_REF, prompt = process.env.KV_GW_PROMPT;
const n = Number(process.env.KV_GW_N);
const openai = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'none', maxRetries: 0, timeout: 60000 });
const params = { model: 'kvasir', messages: [{ role: 'user', content: prompt }], max_tokens: n, temperature: 0,
  seed: 1 };

if (process.env.KV_GW_EXPECT === 'refused') {
  try {
    await openai.chat.completions.create(params);
    console.error('FAIL: the client accepted a certificate it was not told to trust');
    process.exit(1);
  } catch (e) {
    let why = '';
    for (let c = e; c; c = c.cause) why += ` ${c.code ?? ''} ${c.message ?? ''}`; // the fetch error's causes
    if (!/SELF_SIGNED|self.signed|certificate/i.test(why)) {
      console.error(`FAIL: refused, but not for the certificate: ${why}`);
      process.exit(1);
    }
    console.log(`ok: openai client without the certificate refused it (${why.trim()})`);
    process.exit(0);
  }
}
let failures = 0;
const whole = await openai.chat.completions.create(params);
if (whole.choices[0].message.content !== ref) {
  failures++;
  console.error(`FAIL: whole: ${JSON.stringify(whole.choices[0].message.content)} !== ${JSON.stringify(ref)}`);
}
let text = '';
for await (const ch of await openai.chat.completions.create({ ...params, stream: true }))
  text += ch.choices[0]?.delta?.content ?? '';
if (text !== ref) {
  failures++;
  console.error(`FAIL: stream: ${JSON.stringify(text)} !== ${JSON.stringify(ref)}`);
}
if (failures) process.exit(1);
console.log('ok: openai client over https: whole and streamed completions equal kvasir run');
