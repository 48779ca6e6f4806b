// Validates grammar-constrained samples against their JSON schemas with an
// independent validator, ajv (pinned in package.json). Input: a JSON-lines
// file from test_grammar (KV_GRAMMAR_EMIT), each line {schema, text, valid}:
// the text must parse as JSON (JSON.parse) and ajv's verdict must equal
// `valid` (the lines with valid false are controls: a validator that passes
// everything fails them). Prints "N passed, M failed"; exits 1 on a failure.
import { readFileSync } from "node:fs";
import Ajv from "ajv";

const file = process.argv[2];
if (!file) {
  console.error("usage: node grammar_validate.mjs SAMPLES.jsonl");
  process.exit(2);
}
const ajv = new Ajv({ strict: false, allErrors: true });
const compiled = new Map();
let passed = 0, failed = 0, controls = 0;
const lines = readFileSync(file, "utf8").split("\n").filter((l) => l.length > 0);
for (const [i, line] of lines.entries()) {
  const { schema, text, valid } = JSON.parse(line);
  let value;
  try {
    value = JSON.parse(text);
  } catch (e) {
    failed++;
    console.error(`sample ${i}: not JSON (${e.message}): ${JSON.stringify(text)}`);
    continue;
  }
  const key = JSON.stringify(schema);
  if (!compiled.has(key)) compiled.set(key, ajv.compile(schema));
  const check = compiled.get(key);
  const ok = check(value);
  if (ok === valid) {
    passed++;
    if (!valid) controls++;
  } else {
    failed++;
    console.error(`sample ${i}: ajv says ${ok ? "valid" : "invalid"}, expected ${valid ? "valid" : "invalid"}: ` +
      `${JSON.stringify(text)} against ${key}` + (check.errors ? ` (${ajv.errorsText(check.errors)})` : ""));
  }
}
if (lines.length === 0 || controls === 0) {
  console.error("no samples or no controls: nothing was checked");
  failed++;
}
console.log(`grammar_validate: ${compiled.size} schemas, ${controls} controls refused`);
console.log(`${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
