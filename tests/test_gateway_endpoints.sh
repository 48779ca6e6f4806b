#!/usr/bin/env bash
# kv-test-labels: oracle net
# The endpoints and habits clients probe, each against an independent
# reference, on a gen-model q8_0 model:
#   - POST /tokenize equals `kvasir tokenize` (with and without special
#     tokens; pieces joined give the text back); POST /detokenize turns them
#     back into the text; an id out of the vocabulary is a 400;
#   - POST /completion (llama-server's) equals `kvasir run` with the same
#     prompt, seed and sampler, whole and streamed (SSE), from text or from
#     token ids; a field it cannot honour is a 400 naming it;
#   - POST /api/generate (Ollama's) equals `kvasir run` (raw: the prompt as
#     is) and `kvasir run --chat` (the template), streamed (NDJSON) and not;
#     no prompt is a load ("done_reason": "load"); "template" is a 400;
#   - GET /props and POST /api/show against the GGUF read by node-llama-cpp
#     (tests/oracle/gateway_endpoints.mjs) and `kvasir inspect --json`;
#     /api/version, /api/ps, /v1/models/{id} (another id: 404 in OpenAI's shape);
#   - CORS with curl: a preflight 204 with the methods and headers, the
#     allowed Origin echoed, another Origin not; without --cors none, and
#     OPTIONS a 405;
#   - the request log line's fields (no prompt text, no key), the startup
#     summary, and --quiet;
#   - a gateway whose only worker is killed: /health 503 with the reason,
#     and a prompt a 503 at once (not a wait).
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
KV=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_gateway_endpoints: FAIL: $*" >&2; exit 1; }
command -v node >/dev/null 2>&1 || fail "node not found"
[ -f "$SRC/tests/oracle/node_modules/node-llama-cpp/package.json" ] || fail "package missing: node-llama-cpp (run tools/install-oracle.sh)"
dir=$(mktemp -d "${TMPDIR:-/tmp}/kv_gwe.XXXXXX")
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; rm -rf "$dir"; }
trap cleanup EXIT
wait_until() { # SECONDS CMD...: polls CMD every 0.1 s (a bound, not a timing assertion)
  local t=$1; shift
  for _ in $(seq $((t * 10))); do "$@" && return 0; sleep 0.1; done
  return 1
}

"$KV" gen-model --preset tiny --type q8_0 --out "$dir/m.gguf" >/dev/null 2>&1 || fail "gen-model"

start() { # NAME ARGS...: a gateway; its URL in $URL
  local name=$1; shift
  "$KV" gateway "$@" --listen 127.0.0.1:0 --threads 1 >"$dir/$name.out" 2>"$dir/$name.err" &
  pids+=($!)
  local pid=$!
  for _ in $(seq 1 600); do
    grep -q "^listening on " "$dir/$name.out" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || fail "gateway $name exited: $(cat "$dir/$name.err")"
    sleep 0.1
  done
  URL="http://$(sed -n 's/^listening on //p' "$dir/$name.out")"
  [ "$URL" != "http://" ] || fail "gateway $name did not print its address"
}
start a -m "$dir/m.gguf" --name tiny --parallel 3 --cors http://app.example --cors 'http://b.example,http://c.example' \
  --api-key sekrit-key-123
A=$URL
start b -m "$dir/m.gguf" --name tiny --quiet
B=$URL
AUTH=(-H "Authorization: Bearer sekrit-key-123")
post() { curl -s "${AUTH[@]}" -H 'Content-Type: application/json' "$A$1" -d "$2"; }
code() { curl -s -o "$dir/body" -w '%{http_code}' "${AUTH[@]}" -H 'Content-Type: application/json' "$A$1" -d "$2"; }

# ---- the startup summary --------------------------------------------------
arch=$("$KV" inspect "$dir/m.gguf" --json | jq -r .architecture)
top=$("$KV" inspect "$dir/m.gguf" --json | jq -r '.types | max_by(.bytes) | .type')
grep -q "^gateway: model tiny: $arch, .* parameters, 2 layers, 8 experts (2 used per token); types by bytes: $top .*; context 512; prompt template: tokenizer.chat_template; serving $A$" "$dir/a.err" ||
  fail "startup summary: $(head -3 "$dir/a.err")"
echo "ok: the startup summary names $arch, $top, the context, the template and $A"

# ---- /tokenize and /detokenize against kvasir tokenize ----------------------
texts=("Hello world, this is Kvasir." "Grüße aus Köln — 東京 🚀" "<|im_start|>user
hi<|im_end|>")
for t in "${texts[@]}"; do
  want=$("$KV" tokenize -m "$dir/m.gguf" -- "$t" | tr -d ' \n')
  got=$(post /tokenize "$(jq -nc --arg c "$t" '{content: $c}')" | jq -c .tokens)
  [ "$got" = "$want" ] || fail "/tokenize '$t': $got, kvasir tokenize: $want"
  want_ns=$("$KV" tokenize -m "$dir/m.gguf" --no-special -- "$t" | tr -d ' \n')
  got_ns=$(post /tokenize "$(jq -nc --arg c "$t" '{content: $c, parse_special: false}')" | jq -c .tokens)
  [ "$got_ns" = "$want_ns" ] || fail "/tokenize parse_special false '$t': $got_ns, --no-special: $want_ns"
  ids=$(post /tokenize "$(jq -nc --arg c "$t" '{content: $c, with_pieces: true}')" | jq -c '[.tokens[].id]')
  [ "$ids" = "$want" ] || fail "/tokenize with_pieces ids: $ids"
  back=$(post /detokenize "{\"tokens\": $want}" | jq -r .content)
  [ "$back" = "$t" ] || fail "/detokenize of '$t' gave '$back'"
done
# pieces: strings when whole UTF-8, else bytes; joined they are the text's bytes
t="${texts[1]}"
post /tokenize "$(jq -nc --arg c "$t" '{content: $c, with_pieces: true}')" >"$dir/pieces.json"
node -e '
  const j = JSON.parse(require("fs").readFileSync(process.argv[1]));
  const bytes = Buffer.concat(j.tokens.map(t => typeof t.piece === "string" ? Buffer.from(t.piece) : Buffer.from(t.piece)));
  if (bytes.toString() !== process.argv[2]) { console.error("pieces joined:", bytes.toString()); process.exit(1); }
  if (!j.tokens.some(t => Array.isArray(t.piece))) { console.error("no byte piece in a split character"); process.exit(1); }
' "$dir/pieces.json" "$t" || fail "/tokenize pieces do not join to the text"
[ "$(code /detokenize '{"tokens":[1,2,999999]}')" = 400 ] && jq -e '.error.message | test("element 2")' "$dir/body" >/dev/null ||
  fail "/detokenize out of range: $(cat "$dir/body")"
[ "$(code /tokenize '{"content":"x","bogus":1}')" = 400 ] && grep -q "'bogus'" "$dir/body" || fail "/tokenize unknown field: $(cat "$dir/body")"
echo "ok: /tokenize equals kvasir tokenize (special and not, pieces), /detokenize gives the text back, bad ids 400"

# ---- /completion against kvasir run ------------------------------------------
PROMPT="The swarm answers through the gateway"
run_ref() { # N TEMP TOPK TOPP SEED [--chat] -> the run's JSON
  "$KV" run -m "$dir/m.gguf" --json --threads 1 -p "$PROMPT" -n "$1" --temp "$2" --top-k "$3" --top-p "$4" --min-p 0.05 \
    --seed "$5" ${6:-} 2>/dev/null
}
for spec in "12 0 40 0.95 1" "16 0.9 20 0.9 77"; do
  read -r n temp k p seed <<<"$spec"
  run_ref "$n" "$temp" "$k" "$p" "$seed" >"$dir/ref.json"
  body=$(jq -nc --arg p "$PROMPT" --argjson n "$n" --argjson t "$temp" --argjson k "$k" --argjson tp "$p" --argjson s "$seed" \
    '{prompt: $p, n_predict: $n, temperature: $t, top_k: $k, top_p: $tp, min_p: 0.05, seed: $s}')
  post /completion "$body" >"$dir/c.json"
  [ "$(jq -r .content "$dir/c.json")" = "$(jq -r .text "$dir/ref.json")" ] ||
    fail "/completion '$(jq -r .content "$dir/c.json")' != run '$(jq -r .text "$dir/ref.json")'"
  jq -e --slurpfile r "$dir/ref.json" '.stop == true and .tokens_predicted == ($r[0].tokens | length) and
    .tokens_evaluated == ($r[0].prompt_tokens | length) and .timings.predicted_n == .tokens_predicted and
    .timings.prompt_ms >= 0 and (.stop_type == "limit" or .stop_type == "eos")' "$dir/c.json" >/dev/null ||
    fail "/completion fields: $(cat "$dir/c.json")"
  # streamed: the contents joined are the same text; the last event carries stop and the counts
  post /completion "$(jq -c '. + {stream: true}' <<<"$body")" >"$dir/c.sse"
  text=$(sed -n 's/^data: //p' "$dir/c.sse" | jq -rj .content)
  [ "$text" = "$(jq -r .text "$dir/ref.json")" ] || fail "/completion streamed '$text'"
  sed -n 's/^data: //p' "$dir/c.sse" | tail -1 | jq -e --slurpfile r "$dir/ref.json" \
    '.stop == true and .tokens_predicted == ($r[0].tokens | length)' >/dev/null || fail "/completion stream end: $(tail -2 "$dir/c.sse")"
  [ "$(sed -n 's/^data: //p' "$dir/c.sse" | jq -s '[.[] | select(.stop == false)] | length')" -ge 1 ] || fail "no chunk before the end"
  # the prompt as token ids (the run's own prompt tokens) gives the same text
  post /completion "$(jq -c --slurpfile r "$dir/ref.json" '. + {prompt: $r[0].prompt_tokens}' <<<"$body")" >"$dir/ci.json"
  [ "$(jq -r .content "$dir/ci.json")" = "$(jq -r .text "$dir/ref.json")" ] || fail "/completion from token ids: $(cat "$dir/ci.json")"
done
[ "$(code /completion '{"prompt":"x","mirostat":2}')" = 400 ] && grep -q "'mirostat'" "$dir/body" || fail "mirostat 2: $(cat "$dir/body")"
# n_probs is served (test_gateway_sampling checks the values): 5 alternatives per token
[ "$(code /completion '{"prompt":"x","n_probs":5,"n_predict":2}')" = 200 ] &&
  jq -e '(.completion_probabilities | length) >= 1 and ([.completion_probabilities[].top_logprobs | length] | all(. == 5))' \
    "$dir/body" >/dev/null || fail "n_probs 5: $(head -c 600 "$dir/body")"
[ "$(code /completion '{"prompt":"x","n_probs":0,"typical_p":1,"n_predict":1}')" = 200 ] || fail "neutral fields refused: $(cat "$dir/body")"
[ "$(code /completion '{"prompt":[1,2,999999]}')" = 400 ] && grep -q "outside the vocabulary" "$dir/body" || fail "token id out of range: $(cat "$dir/body")"
[ "$(code /completion '{"prompt":["a","b"]}')" = 400 ] || fail "several prompts: $(cat "$dir/body")"
echo "ok: /completion equals kvasir run (whole, streamed, from token ids); unhonoured fields 400"

# ---- /api/generate against kvasir run (raw) and run --chat (template) --------
run_ref 10 0 40 0.95 3 >"$dir/raw.json"
run_ref 10 0 40 0.95 3 --chat >"$dir/chat.json"
for raw in true false; do
  want=$(jq -r .text "$dir/$([ $raw = true ] && echo raw || echo chat).json")
  body=$(jq -nc --arg p "$PROMPT" --argjson raw $raw \
    '{model: "tiny", prompt: $p, raw: $raw, stream: false, options: {num_predict: 10, temperature: 0, seed: 3}}')
  post /api/generate "$body" >"$dir/g.json"
  [ "$(jq -r .response "$dir/g.json")" = "$want" ] || fail "/api/generate raw=$raw '$(jq -r .response "$dir/g.json")' != '$want'"
  jq -e '.done == true and (.done_reason == "length" or .done_reason == "stop") and .eval_count > 0 and
    .prompt_eval_count > 0 and .total_duration >= .eval_duration' "$dir/g.json" >/dev/null || fail "/api/generate fields: $(cat "$dir/g.json")"
  post /api/generate "$(jq -c 'del(.stream)' <<<"$body")" >"$dir/g.ndjson" # streams by default
  [ "$(jq -rj .response "$dir/g.ndjson")" = "$want" ] || fail "/api/generate streamed raw=$raw"
  [ "$(jq -s '[.[] | select(.done == false)] | length' "$dir/g.ndjson")" -ge 1 ] && tail -1 "$dir/g.ndjson" | jq -e .done >/dev/null ||
    fail "/api/generate stream shape: $(cat "$dir/g.ndjson")"
done
[ "$(code /api/generate '{"model":"tiny","prompt":"x","template":"{{ .Prompt }}"}')" = 400 ] && jq -e '.error | test("template")' "$dir/body" >/dev/null ||
  fail "template: $(cat "$dir/body")"
post /api/generate '{"model":"tiny"}' | jq -e '.done == true and .done_reason == "load" and .response == ""' >/dev/null ||
  fail "/api/generate without a prompt (a load): $(post /api/generate '{"model":"tiny"}')"
[ "$(code /api/generate '{"model":"other"}')" = 404 ] || fail "/api/generate of another model: $(cat "$dir/body")"
[ "$(code /api/generate '{"model":"tiny","prompt":"x","options":{"mirostat":2}}')" = 400 ] && grep -q mirostat "$dir/body" || fail "mirostat: $(cat "$dir/body")"
echo "ok: /api/generate equals kvasir run (raw) and run --chat, streamed and not; a load; template and unknown options 400"

# ---- /props, /api/show against the GGUF; the small ones --------------------
(cd "$SRC/tests/oracle" && node gateway_endpoints.mjs "$dir/m.gguf" "$B" tiny) || fail "/props or /api/show against the GGUF"
post /api/show '{"model":"tiny"}' >"$dir/show.json"
jq -e --arg a "$arch" --arg q "$(tr a-z A-Z <<<"$top")" '.details.family == $a and .details.quantization_level == $q and
  .details.format == "gguf"' "$dir/show.json" >/dev/null || fail "/api/show details: $(jq -c .details "$dir/show.json")"
[ "$(code /api/show '{"model":"other"}')" = 404 ] || fail "/api/show other model"
curl -s "${AUTH[@]}" "$A/props" | jq -e '.total_slots == 3 and .model_alias == "tiny" and (.model_path | endswith("m.gguf"))' >/dev/null ||
  fail "/props: $(curl -s "${AUTH[@]}" "$A/props" | head -c 400)"
curl -s "$A/api/version" | jq -e '.version | test("^[0-9]+\\.[0-9]+\\.[0-9]+$")' >/dev/null || fail "/api/version"
curl -s "${AUTH[@]}" "$A/api/ps" | jq -e '.models | length == 1 and .[0].name == "tiny" and .[0].context_length == 512' >/dev/null ||
  fail "/api/ps: $(curl -s "${AUTH[@]}" "$A/api/ps")"
curl -s "${AUTH[@]}" "$A/v1/models/tiny" | jq -e '.id == "tiny" and .object == "model"' >/dev/null || fail "/v1/models/tiny"
[ "$(curl -s -o "$dir/body" -w '%{http_code}' "${AUTH[@]}" "$A/v1/models/gpt-4")" = 404 ] &&
  jq -e '.error.code == "model_not_found" and .error.type == "invalid_request_error"' "$dir/body" >/dev/null ||
  fail "/v1/models/gpt-4: $(cat "$dir/body")"
[ "$(curl -s -o /dev/null -w '%{http_code}' "$A/v1/models/tiny")" = 401 ] || fail "/v1/models/{id} without the key"
echo "ok: /props and /api/show equal the GGUF; /api/version, /api/ps, /v1/models/{id} (404 for another id)"

# ---- CORS -----------------------------------------------------------------
pre=$(curl -s -i -X OPTIONS "$A/v1/chat/completions" -H 'Origin: http://b.example' \
  -H 'Access-Control-Request-Method: POST' -H 'Access-Control-Request-Headers: authorization, content-type' | tr -d '\r')
grep -q "^HTTP/1.1 204" <<<"$pre" && grep -qi "^Access-Control-Allow-Origin: http://b.example$" <<<"$pre" &&
  grep -qi "^Access-Control-Allow-Methods: .*POST" <<<"$pre" &&
  grep -qi "^Access-Control-Allow-Headers: .*Authorization.*Content-Type.*x-api-key.*anthropic-version" <<<"$pre" ||
  fail "preflight: $pre"
hdr=$(curl -s -D - -o /dev/null "${AUTH[@]}" -H 'Origin: http://app.example' "$A/v1/models" | tr -d '\r')
grep -qi "^Access-Control-Allow-Origin: http://app.example$" <<<"$hdr" || fail "simple request: $hdr"
hdr=$(curl -s -D - -o /dev/null "${AUTH[@]}" -H 'Origin: http://evil.example' "$A/v1/models" | tr -d '\r')
grep -qi "^Access-Control-Allow-Origin" <<<"$hdr" && fail "another Origin was allowed: $hdr"
[ "$(curl -s -o /dev/null -w '%{http_code}' -X OPTIONS -H 'Origin: http://evil.example' "$A/v1/models")" = 403 ] ||
  fail "preflight from another Origin"
hdr=$(curl -s -D - -N -o /dev/null "${AUTH[@]}" -H 'Origin: http://c.example' -H 'Content-Type: application/json' \
  "$A/completion" -d '{"prompt":"x","n_predict":2,"stream":true}' | tr -d '\r')
grep -qi "^Access-Control-Allow-Origin: http://c.example$" <<<"$hdr" || fail "stream without CORS header: $hdr"
hdr=$(curl -s -D - -o /dev/null -H 'Origin: http://app.example' "$B/v1/models" | tr -d '\r')
grep -qi "^Access-Control" <<<"$hdr" && fail "CORS headers without --cors: $hdr"
[ "$(curl -s -o /dev/null -w '%{http_code}' -X OPTIONS -H 'Origin: http://app.example' "$B/v1/models")" = 405 ] ||
  fail "OPTIONS without --cors"
set +e
"$KV" gateway -m "$dir/m.gguf" --cors 'not an origin' --listen 127.0.0.1:0 >/dev/null 2>"$dir/cors.err"
rc=$?
set -e
[ $rc != 0 ] && grep -q "CORS origin 'not an origin'" "$dir/cors.err" || fail "a bad --cors: $(cat "$dir/cors.err")"
echo "ok: CORS: preflight 204, allowed Origins echoed (streams too), others not; none without --cors; bad origins refused"

# ---- the request log line -------------------------------------------------
SECRET_PROMPT="zebra-unicorn-prompt-7781"
post /completion "$(jq -nc --arg p "$SECRET_PROMPT" '{prompt: $p, n_predict: 5, temperature: 0}')" >"$dir/l.json"
pt=$(jq .tokens_evaluated "$dir/l.json")
ct=$(jq .tokens_predicted "$dir/l.json")
wait_until 5 grep -q "POST /completion 200 prompt_tokens=$pt completion_tokens=$ct ms=" "$dir/a.err" ||
  fail "no log line for the request: $(tail -3 "$dir/a.err")"
grep -E "^gateway: [0-9TZ:-]+ POST /completion 200 prompt_tokens=$pt completion_tokens=$ct ms=[0-9]+\.[0-9]$" "$dir/a.err" >/dev/null ||
  fail "log line shape: $(grep 'POST /completion' "$dir/a.err" | tail -1)"
grep -q "GET /v1/models/{id} 404 " "$dir/a.err" || fail "no log line for the 404"
grep -q "OPTIONS /v1/chat/completions 204 " "$dir/a.err" || fail "no log line for the preflight"
grep -q "$SECRET_PROMPT" "$dir/a.err" && fail "the log holds a prompt"
grep -q "sekrit-key-123" "$dir/a.err" && fail "the log holds an API key"
curl -s "$B/v1/models" >/dev/null
sleep 0.3
[ ! -s "$dir/b.err" ] || fail "--quiet logged: $(cat "$dir/b.err")"
echo "ok: one log line per request (method, route, status, tokens, ms; no prompt, no key); --quiet is quiet"

# ---- /health 503 and a prompt 503 when the only worker is gone ---------------
"$KV" slice "$dir/m.gguf" --out "$dir/sl" --experts-per-slab 8 >/dev/null 2>&1 || fail "slice"
mkdir -p "$dir/coord"
cp "$dir/sl/backbone.gguf" "$dir/sl/manifest.json" "$dir/coord/"
PK=$("$KV" key --key "$dir/coord.key")
"$KV" worker --slabs "$(ls "$dir"/sl/experts/*.gguf | paste -sd,)" --listen 127.0.0.1:0 --threads 1 --quiet \
  --allow-key "$PK" >"$dir/w.out" 2>"$dir/w.err" &
WP=$!
pids+=($WP)
wait_until 20 grep -qs "^listening on " "$dir/w.out" || fail "worker did not start: $(cat "$dir/w.err")"
start sw -m "$dir/coord/manifest.json" --worker "$(sed -n 's/^listening on //p' "$dir/w.out")" --key "$dir/coord.key" --name tiny
S=$URL
[ "$(curl -s -o "$dir/h.json" -w '%{http_code}' "$S/health")" = 200 ] || fail "health with the worker: $(cat "$dir/h.json")"
grep -q "8 experts (2 used per token) on workers" "$dir/sw.err" || fail "summary with workers: $(head -3 "$dir/sw.err")"
want=$(jq -r .text "$dir/raw.json")
got=$(curl -s "$S/completion" -d "$(jq -nc --arg p "$PROMPT" '{prompt: $p, n_predict: 10, temperature: 0, seed: 3}')" | jq -r .content)
[ "$got" = "$want" ] || fail "completion over the worker '$got' != run '$want'"
kill -9 "$WP"; wait "$WP" 2>/dev/null || true
unhealthy() { [ "$(curl -s -o "$dir/h.json" -w '%{http_code}' "$S/health")" = 503 ]; }
wait_until 20 unhealthy || fail "health still $(cat "$dir/h.json") after the only worker died"
jq -e '.status == "unavailable" and (.reason | test("shards covered")) and .workers_up == 0' "$dir/h.json" >/dev/null ||
  fail "health JSON: $(cat "$dir/h.json")"
t0=$(date +%s%N)
st=$(curl -s -o "$dir/p.json" -w '%{http_code}' -m 10 "$S/completion" -d '{"prompt":"hello","n_predict":4}')
ms=$((($(date +%s%N) - t0) / 1000000))
[ "$st" = 503 ] && jq -e '.error.message | test("cannot run")' "$dir/p.json" >/dev/null || fail "a prompt to it: $st $(cat "$dir/p.json")"
[ "$ms" -lt 5000 ] || fail "the 503 took $ms ms"
st=$(curl -s -o "$dir/p.json" -w '%{http_code}' -m 10 "$S/v1/chat/completions" -d '{"messages":[{"role":"user","content":"hi"}]}')
[ "$st" = 503 ] && jq -e '.error.message | test("shards covered")' "$dir/p.json" >/dev/null || fail "chat to it: $st $(cat "$dir/p.json")"
echo "ok: the only worker killed: /health 503 ($(jq -r .reason "$dir/h.json")), prompts 503 in $ms ms"
