#!/usr/bin/env bash
# kv-test-labels: net
# A model with an expert tensor of a type no backend here computes (a
# gen-model F16 model whose blk.1.ffn_down_exps has its type patched to
# I16, two bytes a value like F16, so the file stays well-formed): the
# gateway starts and says why it cannot run: /health is a 503 naming the
# tensor and its type, and every prompt (OpenAI chat and completions,
# Anthropic, Ollama) a 503 at once with that message, not a hang; the
# unpatched model's /health is a 200.
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_gateway_unrunnable: FAIL: $*" >&2; exit 1; }
command -v python3 >/dev/null 2>&1 || fail "python3 not found"
command -v curl >/dev/null 2>&1 || fail "curl not found"
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
KV=$BIN
. "$SRC/tests/gguf_patch_support.sh"
DIR=$(mktemp -d "${TMPDIR:-/tmp}/kv_gwdown.XXXXXX")
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$DIR"' EXIT
unrunnable_model "$DIR/m.gguf"
cp "$DIR/m.gguf" "$DIR/p.gguf"
gguf_patch_type "$DIR/p.gguf" blk.1.ffn_down_exps.weight 1 25 || fail "patching the type"
wait_addr() { # pid, stdout file
  for _ in $(seq 1 200); do
    a=$(grep -o 'listening on [^ ]*' "$2" 2>/dev/null | head -1 | cut -d' ' -f3)
    [ -n "$a" ] && { echo "$a"; return; }
    kill -0 "$1" 2>/dev/null || fail "process $1 exited: $(cat "$2".err 2>/dev/null)"
    sleep 0.1
  done
  fail "no address from $1"
}
"$BIN" gateway -m "$DIR/m.gguf" --listen 127.0.0.1:0 --threads 1 >"$DIR/ok.out" 2>"$DIR/ok.out.err" &
PIDS+=("$!")
OK=$(wait_addr "$!" "$DIR/ok.out")
[ "$(curl -s -o /dev/null -w '%{http_code}' "http://$OK/health")" = 200 ] || fail "the unpatched model: /health not 200"
"$BIN" gateway -m "$DIR/p.gguf" --listen 127.0.0.1:0 --threads 1 >"$DIR/gw.out" 2>"$DIR/gw.out.err" &
GW=$!
PIDS+=("$GW")
ADDR=$(wait_addr "$GW" "$DIR/gw.out")
WANT=$UNRUNNABLE_WANT
grep -qF "$WANT" "$DIR/gw.out.err" || fail "the gateway does not say why at start: $(cat "$DIR/gw.out.err")"
code=$(curl -s -o "$DIR/h.body" -w '%{http_code}' "http://$ADDR/health")
[ "$code" = 503 ] || fail "/health: $code"
grep -qF "$WANT" "$DIR/h.body" || fail "/health does not name the tensor: $(cat "$DIR/h.body")"
for req in "/v1/chat/completions {\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}" \
           "/v1/completions {\"prompt\":\"hi\",\"stream\":true}" \
           "/v1/messages {\"model\":\"p\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}" \
           "/api/chat {\"model\":\"p\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}" \
           "/completion {\"prompt\":\"hi\"}"; do
  path=${req%% *}
  body=${req#* }
  t0=$(date +%s%N)
  code=$(curl -s -o "$DIR/r.body" -w '%{http_code}' --max-time 10 "http://$ADDR$path" -d "$body") || true
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  [ "$code" = 503 ] || fail "$path: status $code: $(cat "$DIR/r.body")"
  grep -qF "$WANT" "$DIR/r.body" || fail "$path: the 503 does not name the tensor: $(cat "$DIR/r.body")"
  [ "$ms" -lt 3000 ] || fail "$path: the 503 took $ms ms"
done
grep -q '"type":"error"' <(curl -s --max-time 10 "http://$ADDR/v1/messages" -d '{"model":"p","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}') ||
  fail "/v1/messages: not Anthropic's error shape"
kill -0 "$GW" || fail "the gateway died"
echo "test_gateway_unrunnable: ok"
