#!/usr/bin/env bash
# kv-test-labels: oracle net
# The gateway's chat template against the reference Jinja implementation
# (@huggingface/jinja, test-only, pinned in tests/oracle): gateways over a
# gen-model model whose GGUF template is (a) gen-model's own, (b) real
# templates from the llama.cpp source bundled in node-llama-cpp (Qwen3,
# Llama 3.1) given with --chat-template, (c) none (the GGUF's key renamed:
# ChatML, said in the log), (d) a template that runs past the render
# limits. POST /apply-template must equal the reference's rendering of the
# same template over the same body, byte for byte; a completion's
# usage.prompt_tokens the count `kvasir tokenize` gives the rendering;
# raise_exception a 400 with its message; a limit a 400 naming it. The
# checks are in tests/oracle/gateway_template.mjs. A missing package is a
# FAILURE, not a skip (tools/install-oracle.sh installs them).
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_gateway_template: FAIL: $*" >&2; exit 1; }
command -v node >/dev/null 2>&1 || fail "node not found"
for p in @huggingface/jinja node-llama-cpp; do
  [ -f "$SRC/tests/oracle/node_modules/$p/package.json" ] || fail "package missing: $p (run tools/install-oracle.sh)"
done
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
DIR=$(mktemp -d "${TMPDIR:-/tmp}/kv_gwt.XXXXXX")
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null; rm -rf "$DIR"; }
trap cleanup EXIT

"$BIN" gen-model --preset tiny --out "$DIR/tiny.gguf" >/dev/null 2>&1 || fail "gen-model"
# the same model without a template: the key renamed in place (same length,
# so every offset stays)
perl -0777 -pe 's/tokenizer\.chat_template/tokenizer.chat_templatX/' "$DIR/tiny.gguf" >"$DIR/notmpl.gguf"
cmp -s "$DIR/tiny.gguf" "$DIR/notmpl.gguf" && fail "the template key was not found in the GGUF"

git clone -q --no-checkout "$SRC/tests/oracle/node_modules/node-llama-cpp/llama/gitRelease.bundle" "$DIR/llama" \
  >/dev/null 2>&1 || fail "cannot clone the llama.cpp bundle of node-llama-cpp"
for t in Qwen-Qwen3-0.6B meta-llama-Llama-3.1-8B-Instruct; do
  git -C "$DIR/llama" show "HEAD:models/templates/$t.jinja" >"$DIR/$t.jinja" || fail "no template $t in the bundle"
done
# limits: 'loop' runs more iterations than a render may, 'big' writes more
# than a render may, 'raise' raises
cat >"$DIR/limits.jinja" <<'T'
{%- set c = messages[-1]['content'] -%}
{%- if c == 'loop' %}{% for i in range(3000000) %}{% endfor %}{% endif -%}
{%- if c == 'big' %}{% set ns = namespace(s='0123456789abcdef') %}{% for i in range(21) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}{% endif -%}
{%- if c == 'raise' %}{{ raise_exception('limits: told to raise') }}{% endif -%}
{{ c }}
T

start() { # NAME ARGS...: a gateway; its address in $DIR/NAME.addr
  local name=$1; shift
  "$BIN" gateway "$@" --listen 127.0.0.1:0 --threads 1 --name tiny >"$DIR/$name.out" 2>"$DIR/$name.err" &
  PIDS+=($!)
  local pid=$!
  for _ in $(seq 1 600); do
    grep -q "^listening on " "$DIR/$name.out" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || fail "gateway $name exited: $(cat "$DIR/$name.err")"
    sleep 0.1
  done
  sed -n 's/^listening on //p' "$DIR/$name.out" >"$DIR/$name.addr"
  [ -s "$DIR/$name.addr" ] || fail "gateway $name did not print its address"
}
start gen -m "$DIR/tiny.gguf"
start qwen3 -m "$DIR/tiny.gguf" --chat-template "$DIR/Qwen-Qwen3-0.6B.jinja"
start llama31 -m "$DIR/tiny.gguf" --chat-template "$DIR/meta-llama-Llama-3.1-8B-Instruct.jinja"
start chatml -m "$DIR/notmpl.gguf"
start limits -m "$DIR/tiny.gguf" --chat-template "$DIR/limits.jinja"

# the log says once which template is used when there is none
[ "$(grep -c 'no chat template' "$DIR/chatml.err")" = 1 ] || fail "the ChatML fallback was not said once: $(cat "$DIR/chatml.err")"
grep -q 'chat template' "$DIR/gen.err" && fail "a model with a template logged: $(cat "$DIR/gen.err")"

# --chat-template's own errors name the file
"$BIN" gateway -m "$DIR/tiny.gguf" --chat-template "$DIR/none.jinja" --listen 127.0.0.1:0 2>"$DIR/e1" && fail "a missing template file was taken"
grep -q "none.jinja" "$DIR/e1" || fail "a missing template: $(cat "$DIR/e1")"
printf '{%% for x in %%}' >"$DIR/bad.jinja"
"$BIN" gateway -m "$DIR/tiny.gguf" --chat-template "$DIR/bad.jinja" --listen 127.0.0.1:0 2>"$DIR/e2" && fail "a bad template was taken"
grep -q "bad.jinja" "$DIR/e2" || fail "a bad template: $(cat "$DIR/e2")"
head -c $((1024 * 1024 + 1)) /dev/zero | tr '\0' 'x' >"$DIR/huge.jinja"
"$BIN" gateway -m "$DIR/tiny.gguf" --chat-template "$DIR/huge.jinja" --listen 127.0.0.1:0 2>"$DIR/e3" && fail "a huge template was taken"
grep -q "over 1048576 bytes" "$DIR/e3" || fail "a huge template: $(cat "$DIR/e3")"

KV_DIR="$DIR" KV_BIN="$BIN" node "$SRC/tests/oracle/gateway_template.mjs"
