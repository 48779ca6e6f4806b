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
# tests/oracle/grammar_validate.mjs), a gateway over a worker answering what
# a local one answers, and a ring gateway's 503 with no ring to reach. A missing
# package is a FAILURE, not a skip (tools/install-oracle.sh installs them).
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_gateway_structured: FAIL: $*" >&2; exit 1; }
command -v node >/dev/null 2>&1 || fail "node not found"
command -v curl >/dev/null 2>&1 || fail "curl not found"
command -v jq >/dev/null 2>&1 || fail "jq not found"
for p in openai ajv; do
  [ -f "$SRC/tests/oracle/node_modules/$p/package.json" ] || fail "package missing: $p (run tools/install-oracle.sh)"
done
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
DIR=$(mktemp -d "${TMPDIR:-/tmp}/kv_gws.XXXXXX")
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
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
PIDS+=("$GW")
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
  [ "$seed" -le 3 ] || continue
  curl -sf "http://$ADDR/api/chat" -d "{\"messages\":[{\"role\":\"user\",\"content\":\"json?\"}],\"stream\":false,\"format\":\"json\",\"options\":{\"seed\":$seed,\"num_predict\":1000}}" \
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

# the engine's own: kvasir run --json-schema / --grammar gives the text the
# gateway gives (the same session under the same grammar, same seed)
echo "$SCHEMA" >"$DIR/schema.json"
printf 'root ::= "id-" [0-9]{2,4} ("," [a-z]{1,5}){0,3}\n' >"$DIR/g.gbnf"
for seed in 4 5 6; do
  r=$("$BIN" run -m "$DIR/tiny.gguf" -p "Weather:" --json-schema "$DIR/schema.json" --seed "$seed" -n 300 \
      --temp 0.7 --top-k 50 --top-p 0.9 --min-p 0.02 --threads 1 --json | jq -c '[.text, .stop]') || fail "run --json-schema"
  g=$(curl -sf "http://$ADDR/v1/completions" -d "{\"prompt\":\"Weather:\",\"max_tokens\":300,\"seed\":$seed,\"temperature\":0.7,\"top_k\":50,\"top_p\":0.9,\"min_p\":0.02,\"json_schema\":$SCHEMA}" |
      jq -c '[.choices[0].text, "grammar"]') || fail "completions json_schema seed $seed"
  [ "$r" = "$g" ] || fail "seed $seed: kvasir run --json-schema gives $r, the gateway $g"
  r=$("$BIN" run -m "$DIR/tiny.gguf" -p "Id:" --grammar "$DIR/g.gbnf" --seed "$seed" -n 50 --threads 1 --json |
      jq -r .text) || fail "run --grammar"
  echo "$r" | grep -Eq '^id-[0-9]{2,4}(,[a-z]{1,5}){0,3}$' || fail "run --grammar seed $seed: '$r'"
  g=$(curl -sf "http://$ADDR/v1/completions" -d "$(jq -nc --arg g "$(cat "$DIR/g.gbnf")" --argjson s "$seed" \
      '{prompt: "Id:", max_tokens: 50, seed: $s, grammar: $g}')" | jq -r '.choices[0].text') || fail "completions grammar"
  [ "$r" = "$g" ] || fail "seed $seed: kvasir run --grammar gives '$r', the gateway '$g'"
done
"$BIN" run -m "$DIR/tiny.gguf" -p x --grammar "$DIR/schema.json" -n 5 2>"$DIR/run.err" && fail "run --grammar with a schema"
grep -q "grammar 1:1" "$DIR/run.err" || fail "run --grammar error: $(cat "$DIR/run.err")"

# over workers: sampling stays the coordinator's, so a constrained answer
# is the local one's, bit for bit (and valid)
M2="$DIR/m2.gguf"
"$BIN" gen-model --preset tiny --layers 2 --experts 8 --experts-used 2 --out "$M2" >/dev/null 2>&1 || fail "gen-model m2"
"$BIN" slice "$M2" --out "$DIR/sl" --experts-per-slab 8 >/dev/null 2>&1 || fail "slice"
"$BIN" key --key "$DIR/coord.key" >/dev/null
"$BIN" worker --slabs "$DIR/sl/experts/blk.0.0000-0007.gguf,$DIR/sl/experts/blk.1.0000-0007.gguf" \
  --listen 127.0.0.1:0 --threads 1 --quiet --allow-key "$("$BIN" key --key "$DIR/coord.key")" --key "$DIR/w.key" \
  >"$DIR/w.out" 2>"$DIR/w.out.err" &
WK=$!
PIDS+=("$WK")
WADDR=$(wait_addr "$WK" "$DIR/w.out")
"$BIN" gateway -m "$DIR/sl/manifest.json" --worker "$WADDR" --key "$DIR/coord.key" --listen 127.0.0.1:0 --threads 1 \
  >"$DIR/gww.out" 2>"$DIR/gww.out.err" &
GWW=$!
PIDS+=("$GWW")
WGW=$(wait_addr "$GWW" "$DIR/gww.out")
"$BIN" gateway -m "$M2" --listen 127.0.0.1:0 --threads 1 >"$DIR/gwl.out" 2>"$DIR/gwl.out.err" &
GWL=$!
PIDS+=("$GWL")
LGW=$(wait_addr "$GWL" "$DIR/gwl.out")
: >"$DIR/w.jsonl"
for seed in 1 2 3; do
  body="{\"messages\":[{\"role\":\"user\",\"content\":\"weather?\"}],\"seed\":$seed,\"max_tokens\":300,\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"w\",\"schema\":$SCHEMA}}}"
  a=$(curl -sf "http://$WGW/v1/chat/completions" -d "$body" | jq -c '.choices[0] | [.message.content, .finish_reason]') ||
    fail "over workers seed $seed: $(cat "$DIR/gww.out.err")"
  b=$(curl -sf "http://$LGW/v1/chat/completions" -d "$body" | jq -c '.choices[0] | [.message.content, .finish_reason]') ||
    fail "local seed $seed"
  [ "$a" = "$b" ] || fail "over workers seed $seed: $a, locally $b"
  echo "$a" | jq -c --argjson s "$SCHEMA" '{schema: $s, text: .[0], valid: true}' >>"$DIR/w.jsonl"
done
tail -n 2 "$DIR/samples.jsonl" >>"$DIR/w.jsonl" # the controls
node "$SRC/tests/oracle/grammar_validate.mjs" "$DIR/w.jsonl" || fail "answers over workers do not validate"
kill "$GWW" "$GWL" "$WK" 2>/dev/null || true

# a forced tool call over real templates (from the llama.cpp source bundled
# in node-llama-cpp), each family's call text under its grammar: Qwen3.5's
# prompt opens <think>, so the forced text closes it first and the call is a
# call, not reasoning; DeepSeek V3.1 (NAME<｜tool▁sep｜>ARGS), R1 (fenced
# arguments) and gpt-oss (a commentary message to functions.NAME); then a
# named function with parallel calls allowed (gpt-oss: one call per turn)
git clone -q --no-checkout "$SRC/tests/oracle/node_modules/node-llama-cpp/llama/gitRelease.bundle" "$DIR/llama" \
  >/dev/null 2>&1 || fail "cannot clone the llama.cpp bundle of node-llama-cpp"
FAMILIES="Qwen3.5-4B deepseek-ai-DeepSeek-V3.1 deepseek-ai-DeepSeek-R1-Distill-Qwen-32B openai-gpt-oss-120b"
for t in $FAMILIES; do
  git -C "$DIR/llama" show "HEAD:models/templates/$t.jinja" >"$DIR/$t.jinja" || fail "no template $t in the bundle"
done
"$BIN" gen-model --preset tiny --ctx 4096 --out "$DIR/big.gguf" >/dev/null 2>&1 || fail "gen-model big"
TOOLS='[{"type":"function","function":{"name":"get_weather","description":"The weather","parameters":{"type":"object","properties":{"city":{"type":"string","maxLength":8}},"required":["city"]}}},{"type":"function","function":{"name":"add","description":"Adds","parameters":{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"],"additionalProperties":false}}}]'
for t in $FAMILIES; do
  "$BIN" gateway -m "$DIR/big.gguf" --chat-template "$DIR/$t.jinja" --listen 127.0.0.1:0 --threads 1 \
    >"$DIR/t.out" 2>"$DIR/t.out.err" &
  TG=$!
  PIDS+=("$TG")
  TADDR=$(wait_addr "$TG" "$DIR/t.out")
  for seed in 1 2 3 4 5; do
    if [ "$seed" -le 3 ]; then
      choice='"required","parallel_tool_calls":false'
      want='(.message.tool_calls | length) == 1 and ([.message.tool_calls[].function.name] - ["get_weather","add"]) == []'
    else
      choice='{"type":"function","function":{"name":"get_weather"}}'
      want='(.message.tool_calls | length) >= 1 and ([.message.tool_calls[].function.name] | unique) == ["get_weather"]'
    fi
    body="{\"messages\":[{\"role\":\"user\",\"content\":\"weather?\"}],\"seed\":$seed,\"max_tokens\":400,\"tools\":$TOOLS,\"tool_choice\":$choice}"
    code=$(curl -s -o "$DIR/t.body" -w '%{http_code}' "http://$TADDR/v1/chat/completions" -d "$body")
    [ "$code" = 200 ] || fail "$t seed $seed: status $code: $(cat "$DIR/t.body")"
    jq -e ".choices[0] | .finish_reason == \"tool_calls\" and $want and
      .message.reasoning_content == null and .message.content == null and
      all(.message.tool_calls[]; (.function.arguments | fromjson) as \$a |
        if .function.name == \"add\" then (\$a | keys) == [\"a\"] and (\$a.a | type) == \"number\"
        else (\$a.city | type) == \"string\" and (\$a.city | length) <= 8 end)" "$DIR/t.body" >/dev/null ||
      fail "$t seed $seed: $(cat "$DIR/t.body")"
  done
  kill "$TG" 2>/dev/null || true
done

# a ring gateway takes them (the GBNF travels to the ring's tail: served and
# checked against a local gateway in tests/test_ring_gateway_clients.sh);
# with no ring to reach it answers 503 for them, as for any request, never a
# 400 about the field
"$BIN" gateway --ring 127.0.0.1:9 --key "$DIR/ck.key" --listen 127.0.0.1:0 >"$DIR/rg.out" 2>"$DIR/rg.out.err" &
RG=$!
PIDS+=("$RG")
RADDR=$(wait_addr "$RG" "$DIR/rg.out")
for body in '{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_object"}}' \
            '{"messages":[{"role":"user","content":"x"}],"grammar":"root ::= \"a\""}' \
            '{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"required"}'; do
  code=$(curl -s -o "$DIR/rg.body" -w '%{http_code}' "http://$RADDR/v1/chat/completions" -d "$body")
  [ "$code" = 503 ] || fail "ring gateway: status $code for $body"
  grep -q "the ring is not whole" "$DIR/rg.body" || fail "ring gateway: $(cat "$DIR/rg.body")"
done
echo "test_gateway_structured: ok"
