// Renders chat templates with the reference Jinja implementation of the
// Hugging Face ecosystem (@huggingface/jinja, pinned in package.json), for
// tests/test_chat_oracle.c to compare byte for byte.
//   node chat_render.mjs CASES.json  ->  stdout: JSON array, one entry per case:
//   {"ok": true, "text": "..."} or {"ok": false, "error": "..."}
// CASES.json: {"now": UNIX_SECONDS, "cases": [{"template": PATH, "context": {...}}]}
// strftime_now() sees the clock fixed at "now" (UTC; run with TZ=UTC).
import { readFileSync } from "node:fs";
import { Template } from "@huggingface/jinja";

const spec = JSON.parse(readFileSync(process.argv[2], "utf8"));
const RealDate = Date;
const fixed = spec.now * 1000;
globalThis.Date = class extends RealDate {
  constructor(...a) { if (a.length === 0) super(fixed); else super(...a); }
  static now() { return fixed; }
};
const cache = new Map();
const out = [];
for (const c of spec.cases) {
  try {
    let t = cache.get(c.template);
    if (!t) {
      t = new Template(readFileSync(c.template, "utf8"));
      cache.set(c.template, t);
    }
    out.push({ ok: true, text: t.render(c.context) });
  } catch (e) {
    out.push({ ok: false, error: String(e && e.message !== undefined ? e.message : e) });
  }
}
process.stdout.write(JSON.stringify(out));
