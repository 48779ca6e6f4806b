#!/usr/bin/env bash
# kv-test-labels: net
# A model with an expert tensor of a type no backend here computes (a
# gen-model MXFP4 model whose blk.1.ffn_down_exps has its type patched to
# IQ4_XS, which has 8 MXFP4 blocks' size per 256 values, so the file stays
# well-formed): the
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
DIR=$(mktemp -d "${TMPDIR:-/tmp}/kv_gwdown.XXXXXX")
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$DIR"' EXIT
"$BIN" gen-model --preset tiny --type mxfp4 --ff-exp 256 --out "$DIR/m.gguf" >/dev/null 2>&1 || fail "gen-model"
cp "$DIR/m.gguf" "$DIR/p.gguf"
# the GGUF header walked to the tensor infos; the named tensor's type field rewritten
python3 - "$DIR/p.gguf" blk.1.ffn_down_exps.weight 39 23 <<'PY' || fail "patching the type"
import struct, sys
path, want, old, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
b = open(path, 'rb').read(); o = 4
def rd(f, n):
    global o; v = struct.unpack_from(f, b, o)[0]; o += n; return v
def s():
    global o; n = rd('<Q', 8); v = b[o:o + n].decode(); o += n; return v
SZ = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
def val(t):
    global o
    if t == 8: s()
    elif t == 9:
        et = rd('<I', 4); n = rd('<Q', 8)
        for _ in range(n): val(et)
    else: o += SZ[t]
assert b[:4] == b'GGUF'
rd('<I', 4); nt = rd('<Q', 8); nkv = rd('<Q', 8)
for _ in range(nkv): s(); val(rd('<I', 4))
for _ in range(nt):
    name = s(); nd = rd('<I', 4); o += 8 * nd; at = o; ty = rd('<I', 4); rd('<Q', 8)
    if name == want:
        assert ty == old, (name, ty)
        with open(path, 'r+b') as f: f.seek(at); f.write(struct.pack('<I', new))
        sys.exit(0)
sys.exit('no tensor ' + want)
PY
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
WANT="tensor 'blk.1.ffn_down_exps.weight' has type iq4_xs (23), which kvasir cannot compute"
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
