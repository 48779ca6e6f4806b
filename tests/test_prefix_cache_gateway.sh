#!/usr/bin/env bash
# kv-test-labels: net
# The prompt cache seen from the gateway's clients, for a qwen3moe and a
# qwen35moe gen-model model: the same long chat sent twice to a gateway
# with a cache answers the same text (temperature 0) as a gateway without
# one, the first with usage.prompt_tokens_details.cached_tokens 0 and the
# second with the prompt's whole 64-token blocks (all but the block of its
# last token); a request sharing only its first half reuses less; the
# Anthropic API reports cache_read_input_tokens (input_tokens the rest, the
# sum the prompt); /metrics counts lookups, hits, tokens reused, bytes held
# and budget; a small budget evicts (counted) and still answers the same
# text; over a worker process (experts remote) the same as in process.
# --prompt-cache's bad values and --ring are refused with a message
# naming the flag. Streamed answers carry the same usage fields.
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_prefix_cache_gateway: FAIL: $*" >&2; exit 1; }
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
command -v curl >/dev/null && command -v jq >/dev/null || fail "curl and jq are needed"
DIR=$(mktemp -d "${TMPDIR:-/tmp}/kv_pcg.XXXXXX")
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null; rm -rf "$DIR"; }
trap cleanup EXIT

"$BIN" gen-model --preset tiny --ctx 2048 --out "$DIR/q3.gguf" >/dev/null 2>&1 || fail "gen-model qwen3moe"
"$BIN" gen-model --arch qwen35moe --preset tiny --ctx 2048 --attn-interval 2 --out "$DIR/q35.gguf" >/dev/null 2>&1 ||
  fail "gen-model qwen35moe"

start() { # NAME ARGS...: a gateway; its address in $DIR/NAME.addr
  local name=$1; shift
  "$BIN" gateway "$@" --listen 127.0.0.1:0 --threads 1 --name m >"$DIR/$name.out" 2>"$DIR/$name.err" &
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

# a long user message: ~40 distinct sentences, so a few hundred tokens
LONG=""
for i in $(seq 1 40); do LONG="$LONG Sentence number $i tells of river $((i * 7)) and mountain $((i * 13))."; done
HALF=""
for i in $(seq 1 20); do HALF="$HALF Sentence number $i tells of river $((i * 7)) and mountain $((i * 13))."; done
HALF="$HALF Then something else entirely happened, and nobody expected it at all."

chat() { # ADDR TEXT -> the response body
  jq -n --arg t "$2" '{model:"m",messages:[{role:"user",content:$t}],max_tokens:8,temperature:0}' |
    curl -sf "http://$1/v1/chat/completions" -H 'content-type: application/json' -d @- || fail "chat request to $1"
}
msg() { # ADDR TEXT -> the Anthropic response body
  jq -n --arg t "$2" '{model:"m",messages:[{role:"user",content:$t}],max_tokens:8,temperature:0}' |
    curl -sf "http://$1/v1/messages" -H 'content-type: application/json' -d @- || fail "messages request to $1"
}
metric() { # ADDR NAME -> value
  curl -sf "http://$1/metrics" | awk -v n="$2" '$1 == n {print $2}'
}

for arch in q3 q35; do
  start "$arch-c" -m "$DIR/$arch.gguf" --prompt-cache 64M
  start "$arch-n" -m "$DIR/$arch.gguf" --prompt-cache 0
  C=$(cat "$DIR/$arch-c.addr")
  N=$(cat "$DIR/$arch-n.addr")
  [ -n "$(metric "$N" kvasir_gateway_prompt_cache_lookups_total)" ] && fail "$arch: a gateway without a cache reports one"
  [ "$(metric "$C" kvasir_gateway_prompt_cache_budget_bytes)" = $((64 << 20)) ] || fail "$arch: budget not reported"

  ref=$(chat "$N" "$LONG")
  cold=$(chat "$C" "$LONG")
  warm=$(chat "$C" "$LONG")
  P=$(jq -r .usage.prompt_tokens <<<"$ref")
  [ "$P" -gt 200 ] || fail "$arch: the prompt is only $P tokens"
  for r in "$ref" "$cold" "$warm"; do
    [ "$(jq -r '.choices[0].message.content' <<<"$r")" = "$(jq -r '.choices[0].message.content' <<<"$ref")" ] ||
      fail "$arch: the text differs with the cache: $r vs $ref"
    [ "$(jq -r .usage.prompt_tokens <<<"$r")" = "$P" ] || fail "$arch: prompt_tokens differ: $r"
  done
  [ "$(jq -r .usage.prompt_tokens_details.cached_tokens <<<"$ref")" = 0 ] || fail "$arch: uncached gateway: $ref"
  [ "$(jq -r .usage.prompt_tokens_details.cached_tokens <<<"$cold")" = 0 ] || fail "$arch: cold request: $cold"
  W=$(jq -r .usage.prompt_tokens_details.cached_tokens <<<"$warm")
  # qwen3moe reuses every whole block but the last token's; qwen35moe the
  # whole blocks up to the last prompt-chunk end (every 256 tokens) or
  # block end the prefill cut at
  if [ "$arch" = q3 ]; then want=$(( (P - 1) / 64 * 64 )); [ "$W" = "$want" ] || fail "$arch: warm cached $W, want $want"
  else [ "$W" -gt 0 ] && [ $((W % 64)) = 0 ] && [ "$W" -lt "$P" ] || fail "$arch: warm cached $W of $P"; fi

  half=$(chat "$C" "$HALF")
  halfref=$(chat "$N" "$HALF")
  [ "$(jq -r '.choices[0].message.content' <<<"$half")" = "$(jq -r '.choices[0].message.content' <<<"$halfref")" ] ||
    fail "$arch: half-shared text differs"
  H=$(jq -r .usage.prompt_tokens_details.cached_tokens <<<"$half")
  [ "$H" -lt "$W" ] && [ $((H % 64)) = 0 ] || fail "$arch: half-shared cached $H (whole: $W)"

  a1=$(msg "$C" "$LONG")
  a0=$(msg "$N" "$LONG")
  [ "$(jq -r '.content[0].text' <<<"$a1")" = "$(jq -r '.content[0].text' <<<"$a0")" ] || fail "$arch: anthropic text differs"
  AR=$(jq -r .usage.cache_read_input_tokens <<<"$a1")
  AI=$(jq -r .usage.input_tokens <<<"$a1")
  [ "$AR" -gt 0 ] || fail "$arch: anthropic cache_read_input_tokens: $a1"
  [ $((AR + AI)) = "$(jq -r .usage.input_tokens <<<"$a0")" ] || fail "$arch: anthropic input + cache read != prompt: $a1 vs $a0"
  [ "$(jq -r .usage.cache_read_input_tokens <<<"$a0")" = 0 ] || fail "$arch: uncached anthropic: $a0"

  # streamed: the usage chunk (OpenAI include_usage) and message_delta (Anthropic)
  su=$(jq -n --arg t "$LONG" '{model:"m",messages:[{role:"user",content:$t}],max_tokens:8,temperature:0,stream:true,
        stream_options:{include_usage:true}}' |
    curl -sfN "http://$C/v1/chat/completions" -H 'content-type: application/json' -d @- |
    sed -n 's/^data: //p' | grep -v '^\[DONE\]' | jq -c 'select(.usage != null) | .usage' | tail -1)
  [ "$(jq -r .prompt_tokens_details.cached_tokens <<<"$su")" = "$W" ] || fail "$arch: streamed usage: $su"
  sa=$(jq -n --arg t "$LONG" '{model:"m",messages:[{role:"user",content:$t}],max_tokens:8,temperature:0,stream:true}' |
    curl -sfN "http://$C/v1/messages" -H 'content-type: application/json' -d @- |
    sed -n 's/^data: //p' | jq -c 'select(.type == "message_delta") | .usage')
  [ "$(jq -r .cache_read_input_tokens <<<"$sa")" = "$AR" ] || fail "$arch: streamed anthropic usage: $sa"

  [ "$(metric "$C" kvasir_gateway_prompt_cache_lookups_total)" = 6 ] || fail "$arch: lookups: $(curl -s "http://$C/metrics" | grep cache)"
  [ "$(metric "$C" kvasir_gateway_prompt_cache_hits_total)" = 5 ] || fail "$arch: hits"
  [ "$(metric "$C" kvasir_gateway_prompt_cache_tokens_total)" -ge $((W + AR)) ] || fail "$arch: tokens reused"
  [ "$(metric "$C" kvasir_gateway_prompt_cache_bytes)" -gt 0 ] || fail "$arch: bytes held"
  [ "$(metric "$C" kvasir_gateway_prompt_cache_evictions_total)" = 0 ] || fail "$arch: evictions in 64M"
done

# over a worker (the experts remote, the cache the coordinator's): the same
"$BIN" slice "$DIR/q3.gguf" --out "$DIR/sl" --experts-per-slab 8 >/dev/null 2>&1 || fail "slice"
"$BIN" key --key "$DIR/coord.key" >/dev/null
"$BIN" worker --slabs "$(ls "$DIR"/sl/experts/*.gguf | paste -sd, -)" --listen 127.0.0.1:0 --threads 1 --quiet \
  --allow-key "$("$BIN" key --key "$DIR/coord.key")" --key "$DIR/w.key" >"$DIR/w.out" 2>"$DIR/w.err" &
PIDS+=($!)
WA=""
for _ in $(seq 1 200); do
  WA=$(sed -n 's/^listening on \(.*\)$/\1/p' "$DIR/w.out" 2>/dev/null | head -1 || true)
  [ -n "$WA" ] && break
  sleep 0.05
done
[ -n "$WA" ] || fail "the worker did not start: $(cat "$DIR/w.err")"
start wk -m "$DIR/sl/manifest.json" --worker "$WA" --key "$DIR/coord.key" --prompt-cache 64M
K=$(cat "$DIR/wk.addr")
N=$(cat "$DIR/q3-n.addr")
want=$(chat "$N" "$LONG" | jq -r '.choices[0].message.content')
wc1=$(chat "$K" "$LONG")
wc2=$(chat "$K" "$LONG")
for r in "$wc1" "$wc2"; do
  [ "$(jq -r '.choices[0].message.content' <<<"$r")" = "$want" ] || fail "over a worker: the text differs: $r"
done
P=$(jq -r .usage.prompt_tokens <<<"$wc2")
[ "$(jq -r .usage.prompt_tokens_details.cached_tokens <<<"$wc1")" = 0 ] || fail "over a worker, cold: $wc1"
[ "$(jq -r .usage.prompt_tokens_details.cached_tokens <<<"$wc2")" = $(( (P - 1) / 64 * 64 )) ] ||
  fail "over a worker, warm: $wc2"

# a budget of a few blocks: other prompts evict, the text stays
start small -m "$DIR/q3.gguf" --prompt-cache 300K
S=$(cat "$DIR/small.addr")
N=$(cat "$DIR/q3-n.addr")
for t in "Alpha. $LONG" "Beta. $LONG" "Alpha. $LONG"; do
  [ "$(chat "$S" "$t" | jq -r '.choices[0].message.content')" = "$(chat "$N" "$t" | jq -r '.choices[0].message.content')" ] ||
    fail "small budget: the text differs"
done
[ "$(metric "$S" kvasir_gateway_prompt_cache_evictions_total)" -gt 0 ] || fail "small budget: nothing evicted"
[ "$(metric "$S" kvasir_gateway_prompt_cache_bytes)" -le $((300 << 10)) ] || fail "small budget: over budget"

# flags
"$BIN" gateway -m "$DIR/q3.gguf" --prompt-cache 12Q --listen 127.0.0.1:0 2>"$DIR/e1" && fail "a bad size was taken"
grep -q -- "--prompt-cache" "$DIR/e1" || fail "bad size: $(cat "$DIR/e1")"
"$BIN" gateway -m "$DIR/q3.gguf" --prompt-cache 2T --listen 127.0.0.1:0 2>"$DIR/e2" && fail "2T was taken"
grep -q -- "--prompt-cache" "$DIR/e2" || fail "2T: $(cat "$DIR/e2")"
"$BIN" gateway --ring 127.0.0.1:1 --prompt-cache 1G --listen 127.0.0.1:0 2>"$DIR/e3" && fail "--ring with a cache was taken"
grep -q -- "--prompt-cache with --ring" "$DIR/e3" || fail "ring: $(cat "$DIR/e3")"
echo "test_prefix_cache_gateway: ok"
