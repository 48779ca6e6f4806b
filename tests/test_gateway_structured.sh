#!/usr/bin/env bash
# kv-test-labels: oracle net
# Structured output end to end on a random-weight model (only the grammar
# makes its output valid): the official `openai` client with
# response_format json_schema over several schemas x seeds, whole,
# streamed and through its parse helpers, each answer validated by ajv;
# json_object, GBNF `grammar`, `json_schema` on completions, refusals (400
# naming the keyword or position), and requests without these fields equal
# to `kvasir run` (tests/oracle/gateway_structured.mjs). Then Ollama's
# `format` with curl ("json" and a schema, validated by ajv through
# tests/oracle/grammar_validate.mjs), and a ring gateway's 400. A missing
# package is a FAILURE, not a skip (tools/install-oracle.sh installs them).
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_gateway_structured: FAIL: $*" >&2; exit 1; }
command -v node >/dev/null 2>&1 || fail "node not found"
command -v curl >/dev/null 2>&1 || fail "curl not found"
for p in openai ajv; do
  [ -f "$SRC/tests/oracle/node_modules/$p/package.json" ] || fail "package missing: $p (run tools/install-oracle.sh)"
done
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
DIR=$(mktemp -d "${TMPDIR:-/tmp}/kv_gws.XXXXXX")
GW= RG=
cleanup() {
  [ -n "$GW" ] && kill "$GW" 2>/dev/null
  [ -n "$RG" ] && kill "$RG" 2>/dev/null
  wait 2>/dev/null; rm -rf "$DIR"
}
trap cleanup EXIT
"$BIN" gen-model --preset tiny --out "$DIR/tiny.gguf" >/dev/null 2>&1 || fail "gen-model"

# $1 pid, $2 stdout file: the address it listens on
wait_addr() {
  for _ in $(seq 1 600); do
    grep -q "^listening on " "$2" 2>/dev/null && break
    kill -0 "$1" 2>/dev/null || fail "gateway exited: $(cat "$2".err 2>/dev/null)"
    sleep 0.1
  done
  sed -n 's/^listening on //p' "$2"
}

"$BIN" gateway -m "$DIR/tiny.gguf" --listen 127.0.0.1:0 --threads 2 >"$DIR/gw.out" 2>"$DIR/gw.out.err" &
GW=$!
ADDR=$(wait_addr "$GW" "$DIR/gw.out")
[ -n "$ADDR" ] || fail "gateway did not print its address"
KV_GW_URL="http://$ADDR" KV_GW_MODEL=tiny KV_GW_FILE="$DIR/tiny.gguf" KV_BIN="$BIN" \
  node "$SRC/tests/oracle/gateway_structured.mjs" || fail "gateway_structured.mjs"

# Ollama's format, with curl: "json" gives an object, a schema a valid value
SCHEMA='{"type":"object","properties":{"city":{"type":"string","maxLength":10},"temp":{"type":"integer","minimum":-30,"maximum":50},"sunny":{"type":"boolean"}},"required":["city","temp","sunny"]}'
: >"$DIR/samples.jsonl"
for seed in 1 2 3 4 5; do
  for stream in false true; do
    curl -sf "http://$ADDR/api/chat" -d "{\"messages\":[{\"role\":\"user\",\"content\":\"weather?\"}],\"stream\":$stream,\"format\":$SCHEMA,\"options\":{\"seed\":$seed,\"num_predict\":300}}" \
      >"$DIR/ol.out" || fail "ollama format schema seed $seed stream $stream: $(cat "$DIR/ol.out")"
    # one object (whole) or one per line (NDJSON): the content joined
    node -e '
      const fs = require("fs");
      const lines = fs.readFileSync(process.argv[1], "utf8").split("\n").filter((l) => l);
      let text = "", reason = null;
      for (const l of lines) { const j = JSON.parse(l); text += j.message.content; if (j.done) reason = j.done_reason; }
      if (reason !== "stop") { console.error("done_reason " + reason); process.exit(1); }
      process.stdout.write(JSON.stringify({ schema: JSON.parse(process.argv[2]), text, valid: true }) + "\n");
    ' "$DIR/ol.out" "$SCHEMA" >>"$DIR/samples.jsonl" || fail "ollama format schema seed $seed stream $stream"
  done
  curl -sf "http://$ADDR/api/chat" -d "{\"messages\":[{\"role\":\"user\",\"content\":\"json?\"}],\"stream\":false,\"format\":\"json\",\"options\":{\"seed\":$seed,\"num_predict\":2000}}" \
    >"$DIR/oj.out" || fail "ollama format json seed $seed"
  node -e '
    const j = JSON.parse(require("fs").readFileSync(process.argv[1], "utf8"));
    if (j.done_reason === "length") process.exit(j.message.content.startsWith("{") ? 0 : 1); /* a string past num_predict */
    const v = JSON.parse(j.message.content);
    process.exit(v !== null && typeof v === "object" && !Array.isArray(v) ? 0 : 1);
  ' "$DIR/oj.out" || fail "ollama format json seed $seed: not an object: $(cat "$DIR/oj.out")"
done
# controls ajv must refuse (a validator that passes everything fails them)
echo "{\"schema\":$SCHEMA,\"text\":\"{\\\"city\\\":\\\"x\\\",\\\"temp\\\":99,\\\"sunny\\\":true}\",\"valid\":false}" >>"$DIR/samples.jsonl"
echo "{\"schema\":$SCHEMA,\"text\":\"{\\\"city\\\":\\\"x\\\",\\\"temp\\\":9}\",\"valid\":false}" >>"$DIR/samples.jsonl"
node "$SRC/tests/oracle/grammar_validate.mjs" "$DIR/samples.jsonl" || fail "ollama format samples do not validate"
code=$(curl -s -o "$DIR/bad.out" -w '%{http_code}' "http://$ADDR/api/chat" \
  -d '{"messages":[{"role":"user","content":"x"}],"format":{"type":"object","patternProperties":{"a":{}}}}')
[ "$code" = 400 ] || fail "ollama bad schema: status $code"
grep -q "patternProperties" "$DIR/bad.out" || fail "ollama bad schema: $(cat "$DIR/bad.out")"
code=$(curl -s -o "$DIR/bad.out" -w '%{http_code}' "http://$ADDR/api/chat" \
  -d '{"messages":[{"role":"user","content":"x"}],"format":"yaml"}')
[ "$code" = 400 ] || fail "ollama format yaml: status $code"

# a ring gateway refuses them (its last node samples; the grammar does not
# travel yet): a 400 before any node is asked
"$BIN" gateway --ring 127.0.0.1:9 --key "$DIR/ck.key" --listen 127.0.0.1:0 >"$DIR/rg.out" 2>"$DIR/rg.out.err" &
RG=$!
RADDR=$(wait_addr "$RG" "$DIR/rg.out")
for body in '{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_object"}}' \
            '{"messages":[{"role":"user","content":"x"}],"grammar":"root ::= \"a\""}'; do
  code=$(curl -s -o "$DIR/rg.body" -w '%{http_code}' "http://$RADDR/v1/chat/completions" -d "$body")
  [ "$code" = 400 ] || fail "ring gateway: status $code for $body"
  grep -q "not supported over the ring (not yet)" "$DIR/rg.body" || fail "ring gateway: $(cat "$DIR/rg.body")"
done
echo "test_gateway_structured: ok"
