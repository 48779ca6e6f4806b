#!/usr/bin/env bash
# kv-test-labels: net
# A paying gateway with --verify does not pay a worker caught lying, with
# real processes on loopback: `kvasir gateway --ledger --verify` over a
# sliced model whose experts 0-3 are on an honest keyed worker and 4-7 on a
# keyed `--test-lie=later` worker (honest for 64 pairs, then lies), --batch 1
# so that it answers honestly earlier in the session it is caught in. Several
# paid completions: each text equals `kvasir run --chat` on the full GGUF
# (the independent single-process run); the liar is caught; from the
# completion it is caught in on its node balance no longer grows while the
# honest worker is paid in every one; every consumer debit is exactly the
# treasury's fee plus what the nodes gained (the liar's unpaid share went
# back to the consumer); `kvasir ledger check` exits 0.
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_gateway_verify: FAIL: $*" >&2; exit 1; }
command -v curl >/dev/null 2>&1 || fail "curl not found"
command -v jq >/dev/null 2>&1 || fail "jq not found"
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
D=$(mktemp -d "${TMPDIR:-/tmp}/kv_gwver.XXXXXX")
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$D"
}
trap cleanup EXIT
KV() { "$BIN" "$@"; }
bal() { KV ledger balance --db "$D/l.db" --account "$1"; }

KV gen-model --preset tiny --layers 2 --experts 8 --experts-used 2 --out "$D/tiny.gguf" >/dev/null 2>&1 || fail "gen-model"
KV slice "$D/tiny.gguf" --out "$D/sl" --experts-per-slab 4 >/dev/null 2>&1 || fail "slice"
for k in op c; do KV wallet new --out "$D/$k.key" >/dev/null; done
KV key --key "$D/coord.key" >/dev/null
KV ledger init --db "$D/l.db" --key "$D/op.key" --fee-bps 250 >/dev/null
CA=$(KV wallet show --key "$D/c.key" --json | jq -r .account)
KV ledger issue --db "$D/l.db" --key "$D/op.key" --to "$CA" --amount 1000000 >/dev/null

# w0: experts 0-3 of both layers, honest; w1: experts 4-7, the liar
WADDR=()
for g in 0 1; do
  slabs=""
  for l in 0 1; do slabs+="${slabs:+,}$D/sl/experts/$(printf 'blk.%d.%04d-%04d.gguf' "$l" $((4 * g)) $((4 * g + 3)))"; done
  lie=()
  [ "$g" = 1 ] && lie=(--test-lie=later)
  "$BIN" worker --slabs "$slabs" --listen 127.0.0.1:0 --threads 1 --quiet --allow-key "$(KV key --key "$D/coord.key")" \
    --key "$D/w$g.key" "${lie[@]}" >"$D/w$g.out" 2>"$D/w$g.err" &
  PIDS+=("$!")
  a=""
  for _ in $(seq 1 200); do
    a=$(sed -n 's/^listening on \(.*\)$/\1/p' "$D/w$g.out" 2>/dev/null | head -1 || true)
    [ -n "$a" ] && break
    sleep 0.05
  done
  [ -n "$a" ] || fail "worker $g did not start: $(cat "$D/w$g.err")"
  WADDR+=(--worker "$a")
done
W0=node:$(KV wallet show --key "$D/w0.key")
W1=node:$(KV wallet show --key "$D/w1.key")
GN=node:$(KV wallet show --key "$D/coord.key") # the gateway's own node: work redone from its slabs

# the coordinator verifies against the slabs in the manifest's folder
"$BIN" gateway --listen 127.0.0.1:0 --threads 1 -m "$D/sl/manifest.json" "${WADDR[@]}" --worker-timeout-ms 30000 \
  --ledger "$D/l.db" --key "$D/coord.key" --gateway-id gwV --prices 5,11 --batch 1 --verify >"$D/gw.out" 2>"$D/gw.err" &
GWPID=$!
PIDS+=("$GWPID")
ADDR=""
for _ in $(seq 1 300); do
  ADDR=$(sed -n 's/^listening on //p' "$D/gw.out" 2>/dev/null)
  [ -n "$ADDR" ] && break
  kill -0 "$GWPID" 2>/dev/null || fail "gateway exited: $(cat "$D/gw.err")"
  sleep 0.05
done
[ -n "$ADDR" ] || fail "gateway did not start"

PROMPTS=("Pay the honest ones." "Who computed this?" "A liar is not paid." "Check every answer." "The books balance.")
N=8
caught_at=0
for i in "${!PROMPTS[@]}"; do
  p=${PROMPTS[$i]}
  b_c=$(bal "$CA") b_0=$(bal "$W0") b_1=$(bal "$W1") b_g=$(bal "$GN")
  body=$(jq -nc --arg p "$p" --argjson n $N '{messages: [{role: "user", content: $p}], max_tokens: $n, temperature: 0, seed: 1}')
  curl -sf "http://$ADDR/v1/chat/completions" -H "X-KVR-Payment: $(KV wallet pay --key "$D/c.key" --gateway gwV --max 20000)" \
    -d "$body" >"$D/r$i.json" || fail "completion $i failed: $(cat "$D/gw.err")"
  want=$(KV run -m "$D/tiny.gguf" --chat --json --threads 1 -p "$p" -n $N --temp 0 --seed 1 | jq -r .text)
  [ "$(jq -r '.choices[0].message.content' "$D/r$i.json")" = "$want" ] || fail "completion $i: text differs from kvasir run"
  pt=$(jq .usage.prompt_tokens "$D/r$i.json") ct=$(jq .usage.completion_tokens "$D/r$i.json")
  cost=$((pt * 5 + ct * 11))
  d_c=$((b_c - $(bal "$CA"))) d_0=$(($(bal "$W0") - b_0)) d_1=$(($(bal "$W1") - b_1)) d_g=$(($(bal "$GN") - b_g))
  [ "$d_c" = $((cost * 250 / 10000 + d_0 + d_1 + d_g)) ] ||
    fail "completion $i: the consumer paid $d_c, fee + nodes = $((cost * 250 / 10000)) + $d_0 + $d_1 + $d_g"
  [ "$d_0" -gt 0 ] || fail "completion $i: the honest worker was not paid"
  if [ "$caught_at" = 0 ] && grep -q "caught lying" "$D/gw.err"; then
    caught_at=$((i + 1))
    # it answered honestly earlier in this session: no receipt was asked, its share went back
    grep -q "caught lying: not paid for this session" "$D/gw.err" ||
      fail "completion $i: the caught worker's part of the session was not skipped: $(cat "$D/gw.err")"
    [ "$d_c" -lt "$cost" ] || fail "completion $i: the liar's share did not go back to the consumer ($d_c of $cost)"
  fi
  if [ "$caught_at" != 0 ]; then
    [ "$d_1" = 0 ] || fail "completion $i: the liar (caught in completion $caught_at) earned $d_1"
    [ "$d_c" -le "$cost" ] || fail "completion $i: the consumer paid $d_c over the cost $cost"
  fi
  echo "completion $i: cost $cost, consumer paid $d_c; w0 +$d_0, liar +$d_1, gateway node +$d_g"
  KV ledger check --db "$D/l.db" >/dev/null || fail "ledger check after completion $i: $(KV ledger check --db "$D/l.db" 2>&1)"
done
[ "$caught_at" != 0 ] || fail "the liar was never caught: $(cat "$D/gw.err")"
[ "$caught_at" -lt "${#PROMPTS[@]}" ] || fail "the liar was caught only in the last completion: nothing after it to check"
[ "$(KV ledger summary --db "$D/l.db" --json | jq .balanced)" = true ] || fail "the books do not balance"
echo "ok: liar caught in completion $caught_at (its share of that one back to the consumer) of ${#PROMPTS[@]}, earned nothing from then on; honest worker paid in every one"
echo "test_gateway_verify: ok"
