#!/usr/bin/env bash
# kv-test-labels: oracle net
# Paying for completions end to end, with real processes on loopback:
#  1. two `kvasir gateway --ledger` processes (ids gwA, gwB, their own
#     prices) on one ledger, driven by the official openai and
#     @anthropic-ai/sdk clients and fetch (tests/oracle/gateway_pay.mjs):
#     exact amounts in every API whole and streamed, the max cutting the
#     completion, 402 in each API's shape for a missing, malformed, expired,
#     other-gateway, replayed, uncoverable or too-small authorization with
#     nothing charged, replays across the gateways, 8 concurrent spends of
#     one balance across both;
#  2. a gateway over a sliced model whose experts are on two keyed `kvasir
#     worker`s: a paid completion settles, each worker signs a receipt for
#     its part (together (prompt + completion - 1) x n_layer x n_used
#     products) and earns its largest-remainder share of cost - fee,
#     computed here; the gateway's own node gets nothing; a client that
#     leaves mid-completion pays for its prompt only; the gateway SIGKILLed
#     with a completion in flight leaves its hold, and the restarted gateway
#     releases it: the consumer's balance is back to the cent, the settled
#     completions stay settled once;
#  3. `kvasir ledger check` exits 0 after every case and `kvasir ledger
#     summary` says the books balance.
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_gateway_pay: FAIL: $*" >&2; exit 1; }
command -v node >/dev/null 2>&1 || fail "node not found"
command -v curl >/dev/null 2>&1 || fail "curl not found"
command -v jq >/dev/null 2>&1 || fail "jq not found"
for p in openai @anthropic-ai/sdk; do
  [ -f "$SRC/tests/oracle/node_modules/$p/package.json" ] || fail "client missing: $p (run tools/install-oracle.sh)"
done
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
D=$(mktemp -d "${TMPDIR:-/tmp}/kv_gwpay.XXXXXX")
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$D"
}
trap cleanup EXIT
KV() { "$BIN" "$@"; }
ok() { echo "ok: $*"; }
check_ledger() { KV ledger check --db "$D/l.db" >/dev/null || fail "ledger check after $1: $(KV ledger check --db "$D/l.db" 2>&1)"; }
bal() { KV ledger balance --db "$D/l.db" --account "$1"; }

# start_gw NAME ARGS...: a gateway on a free port; sets $ADDR and $GWPID
start_gw() {
  local name=$1
  shift
  "$BIN" gateway --listen 127.0.0.1:0 --threads 1 "$@" >"$D/$name.out" 2>"$D/$name.err" &
  GWPID=$!
  PIDS+=("$GWPID")
  for _ in $(seq 1 300); do
    ADDR=$(sed -n 's/^listening on //p' "$D/$name.out" 2>/dev/null)
    [ -n "$ADDR" ] && return 0
    kill -0 "$GWPID" 2>/dev/null || fail "gateway $name exited: $(cat "$D/$name.err")"
    sleep 0.05
  done
  fail "gateway $name did not start"
}

N_LAYER=2 N_USED=2 # every block routes each token to N_USED of 8 experts
KV gen-model --preset tiny --layers $N_LAYER --experts 8 --experts-used $N_USED --out "$D/tiny.gguf" >/dev/null 2>&1 ||
  fail "gen-model"
for k in op gwA gwB c1 c2 c3 c4; do KV wallet new --out "$D/$k.key" >/dev/null; done
KV key --key "$D/coord.key" >/dev/null # `kvasir key`'s format: the sliced gateway's coordinator and node key
KV ledger init --db "$D/l.db" --key "$D/op.key" --fee-bps 250 >/dev/null
acct() { KV wallet show --key "$D/$1.key" --json | jq -r .account; }
for spec in "c1 1000000" "c2 500" "c3 10000" "c4 200000"; do
  read -r c amount <<<"$spec"
  KV ledger issue --db "$D/l.db" --key "$D/op.key" --to "$(acct "$c")" --amount "$amount" >/dev/null
done
check_ledger "issuance"
j=$(KV wallet pay --key "$D/c1.key" --gateway gwA --max 77 --expires 60 --json)
[ "$(jq -r .consumer <<<"$j")" = "$(acct c1)" ] && [ "$(jq .max <<<"$j")" = 77 ] && [ "$(jq -r .gateway <<<"$j")" = gwA ] &&
  [ "$(jq -r .header <<<"$j" | cut -c1-5)" = kvr1. ] && [ "$(jq -r .header <<<"$j" | wc -c)" = 230 ] ||
  fail "wallet pay --json: $j"

# ---- 1. the clients against two gateways on one ledger -----------------------
start_gw A -m "$D/tiny.gguf" --ledger "$D/l.db" --gateway-key "$D/gwA.key" --gateway-id gwA --prices 3,7 --parallel 2
A=$ADDR
start_gw B -m "$D/tiny.gguf" --ledger "$D/l.db" --gateway-key "$D/gwB.key" --gateway-id gwB --prices 2,5 --parallel 2
B=$ADDR
KV_BIN="$BIN" KV_DB="$D/l.db" KV_GW_MODEL=tiny KV_GW_A="http://$A" KV_GW_B="http://$B" \
  KV_C1="$D/c1.key" KV_C2="$D/c2.key" KV_C3="$D/c3.key" node "$SRC/tests/oracle/gateway_pay.mjs" ||
  fail "the clients' cases (above)"
check_ledger "the clients' cases"
# a free gateway has no prices; a paid one says so in /health's neighbour
[ "$(curl -s -o /dev/null -w '%{http_code}' "http://$A/v1/prices")" = 200 ] || fail "/v1/prices"
ok "clients: exact amounts, 402 shapes, replays, concurrent spends"

# ---- 2. a sliced model on two workers: settle, leave, SIGKILL and restart ----
KV slice "$D/tiny.gguf" --out "$D/sl" --experts-per-slab 4 >/dev/null 2>&1 || fail "slice"
mkdir -p "$D/coord"
cp "$D/sl/backbone.gguf" "$D/sl/manifest.json" "$D/coord/"
WADDR=()
WPID=()
for g in 0 1; do
  slabs=""
  for l in 0 1; do slabs+="${slabs:+,}$D/sl/experts/$(printf 'blk.%d.%04d-%04d.gguf' "$l" $((4 * g)) $((4 * g + 3)))"; done
  "$BIN" worker --slabs "$slabs" --listen 127.0.0.1:0 --threads 1 --quiet --allow-key "$(KV key --key "$D/coord.key")" \
    --key "$D/w$g.key" >"$D/w$g.out" 2>"$D/w$g.err" &
  WPID+=("$!")
  PIDS+=("$!")
  for _ in $(seq 1 200); do
    a=$(sed -n 's/^listening on \(.*\)$/\1/p' "$D/w$g.out" 2>/dev/null | head -1 || true)
    [ -n "$a" ] && break
    sleep 0.05
  done
  [ -n "$a" ] || fail "worker $g did not start: $(cat "$D/w$g.err")"
  WADDR+=(--worker "$a")
done
GWC=(-m "$D/coord/manifest.json" "${WADDR[@]}" --worker-timeout-ms 30000 --ledger "$D/l.db" --key "$D/coord.key"
  --gateway-id gwC --prices 5,11)
start_gw C "${GWC[@]}"
C=$ADDR
C4=$(acct c4)
NODE_C=node:$(KV wallet show --key "$D/coord.key") # the gateway's node account is its coordinator key
chat() { # chat MAX_TOKENS STREAM: a request body
  printf '{"messages":[{"role":"user","content":"Pay the swarm."}],"max_tokens":%s,"temperature":0,"stream":%s}' "$1" "$2"
}
b0=$(bal "$C4")
curl -s "http://$C/v1/chat/completions" -H "X-KVR-Payment: $(KV wallet pay --key "$D/c4.key" --gateway gwC --max 20000)" \
  -d "$(chat 9 false)" >"$D/c1.json"
pt=$(jq .usage.prompt_tokens "$D/c1.json")
ct=$(jq .usage.completion_tokens "$D/c1.json")
[ "$ct" -gt 0 ] || fail "the sliced gateway's completion: $(cat "$D/c1.json")"
[ $((b0 - $(bal "$C4"))) = $((pt * 5 + ct * 11)) ] || fail "sliced: paid $((b0 - $(bal "$C4"))), want $((pt * 5 + ct * 11))"
# each worker signed a receipt for what it computed; the two together count every token
# evaluated (the last one emitted is never fed back) x layers x experts used, less the
# prompt's tokens but its last in the last layer (no logits there: no experts)
want=$((((pt + ct - 1) * N_LAYER - (pt - 1)) * N_USED))
SUM=$(KV ledger summary --db "$D/l.db" --json)
node_f() { jq --arg n "node:$(KV wallet show --key "$1")" ".nodes[] | select(.account == \$n) | .$2" <<<"$SUM"; }
p0=$(node_f "$D/w0.key" products)
p1=$(node_f "$D/w1.key" products)
[ -n "$p0" ] && [ -n "$p1" ] && [ $((p0 + p1)) = "$want" ] || fail "sliced: worker receipts $p0 + $p1 products, want $want"
[ -z "$(node_f "$D/coord.key" products)" ] || fail "sliced: the gateway's node was paid for work its workers did"
# the split, independently: fee = floor(cost x 250 / 10000), the pool by largest remainder
cost=$((pt * 5 + ct * 11))
pool=$((cost - cost * 250 / 10000))
s0=$((pool * p0 / want))
s1=$((pool * p1 / want))
if [ $((s0 + s1)) -lt "$pool" ]; then
  r0=$((pool * p0 % want))
  r1=$((pool * p1 % want))
  k0=$(KV wallet show --key "$D/w0.key")
  k1=$(KV wallet show --key "$D/w1.key")
  if [ "$r0" -gt "$r1" ] || { [ "$r0" = "$r1" ] && [[ "$k0" < "$k1" ]]; }; then s0=$((s0 + 1)); else s1=$((s1 + 1)); fi
fi
[ "$(node_f "$D/w0.key" earned)" = "$s0" ] && [ "$(node_f "$D/w1.key" earned)" = "$s1" ] ||
  fail "sliced: workers earned $(node_f "$D/w0.key" earned) and $(node_f "$D/w1.key" earned), want $s0 and $s1"
check_ledger "the sliced completion"
ok "sliced model on 2 workers: paid $cost for $pt + $ct tokens; the workers signed for $p0 + $p1 products and earned $s0 + $s1"

# a client that leaves while its completion waits on a stalled worker pays its prompt only
b0=$(bal "$C4")
kill -STOP "${WPID[0]}" "${WPID[1]}"
curl -s -N "http://$C/v1/chat/completions" -H "X-KVR-Payment: $(KV wallet pay --key "$D/c4.key" --gateway gwC --max 20000)" \
  -d "$(chat 40 true)" >"$D/leave.out" &
CURL=$!
for _ in $(seq 1 100); do [ "$(KV ledger check --db "$D/l.db" --json | jq .held)" = 1 ] && break; sleep 0.05; done
[ "$(KV ledger check --db "$D/l.db" --json | jq .held)" = 1 ] || fail "leave: no hold while the completion waits"
kill "$CURL"
wait "$CURL" 2>/dev/null || true
sleep 0.6 # the connection sees the hang-up within 250 ms
kill -CONT "${WPID[0]}" "${WPID[1]}"
for _ in $(seq 1 100); do [ "$(KV ledger check --db "$D/l.db" --json | jq .held)" = 0 ] && break; sleep 0.05; done
[ $((b0 - $(bal "$C4"))) = $((pt * 5)) ] || fail "leave: paid $((b0 - $(bal "$C4"))), want the prompt's $((pt * 5))"
check_ledger "a client that left"
ok "a client that left mid-completion paid its prompt only ($((pt * 5)))"

# SIGKILL with a completion in flight, restart: the hold is released, nothing else moves
b_before=$(bal "$C4")
settled_before=$(KV ledger check --db "$D/l.db" --json | jq .settled)
kill -STOP "${WPID[0]}" "${WPID[1]}"
curl -s -N "http://$C/v1/chat/completions" -H "X-KVR-Payment: $(KV wallet pay --key "$D/c4.key" --gateway gwC --max 30000)" \
  -d "$(chat 40 true)" >"$D/kill.out" 2>/dev/null &
CURL=$!
for _ in $(seq 1 100); do [ "$(KV ledger check --db "$D/l.db" --json | jq .held)" = 1 ] && break; sleep 0.05; done
[ "$(bal "$C4")" = $((b_before - 30000)) ] || fail "kill: the hold of 30000 is not held ($(bal "$C4"))"
grep -q '^data: ' "$D/kill.out" || sleep 0.3
kill -KILL "$GWPID"
wait "$GWPID" 2>/dev/null || true
wait "$CURL" 2>/dev/null || true
kill -CONT "${WPID[0]}" "${WPID[1]}"
j=$(KV ledger check --db "$D/l.db" --json)
[ "$(jq .ok <<<"$j")" = true ] && [ "$(jq .held <<<"$j")" = 1 ] && [ "$(jq .escrow <<<"$j")" = 30000 ] ||
  fail "after SIGKILL: $j"
start_gw C2 "${GWC[@]}"
C=$ADDR
grep -q "released 1 holds" "$D/C2.err" || fail "restart: no release reported: $(cat "$D/C2.err")"
j=$(KV ledger check --db "$D/l.db" --json)
[ "$(jq .held <<<"$j")" = 0 ] && [ "$(jq .escrow <<<"$j")" = 0 ] || fail "after restart: $j"
[ "$(jq .settled <<<"$j")" = "$settled_before" ] || fail "restart: settled $(jq .settled <<<"$j"), was $settled_before"
[ "$(bal "$C4")" = "$b_before" ] || fail "restart: balance $(bal "$C4"), want $b_before"
check_ledger "the restart"
# and the restarted gateway charges again
b0=$(bal "$C4")
curl -s "http://$C/v1/chat/completions" -H "X-KVR-Payment: $(KV wallet pay --key "$D/c4.key" --gateway gwC --max 20000)" \
  -d "$(chat 5 false)" >"$D/c2.json"
ct=$(jq .usage.completion_tokens "$D/c2.json")
[ $((b0 - $(bal "$C4"))) = $((pt * 5 + ct * 11)) ] || fail "after restart: paid $((b0 - $(bal "$C4")))"
# its metrics count that one charge: cost = nodes + treasury
curl -s "http://$C/metrics" >"$D/metrics.txt"
m() { sed -n "s/^kvasir_gateway_kvr_$1 //p" "$D/metrics.txt"; }
[ "$(m 'micro_total{to="cost"}')" = $((pt * 5 + ct * 11)) ] &&
  [ $(($(m 'micro_total{to="nodes"}') + $(m 'micro_total{to="treasury"}'))) = $((pt * 5 + ct * 11)) ] &&
  [ "$(m 'charges_total{outcome="settled"}')" = 1 ] || fail "metrics: $(grep kvr "$D/metrics.txt")"
check_ledger "after the restart"
ok "SIGKILL mid-completion: the hold of 30000 stayed, the restart released it, $settled_before settled stayed once"

# ---- 3. the books --------------------------------------------------------------
KV ledger summary --db "$D/l.db" >"$D/summary.txt" || fail "summary: $(cat "$D/summary.txt")"
[ "$(KV ledger summary --db "$D/l.db" --json | jq .balanced)" = true ] || fail "the books do not balance"
tail -1 "$D/summary.txt"
# the demo's paying part (tools/demo_pay.sh), on this ledger and on its own
bash "$SRC/tools/demo_pay.sh" --report "$BIN" "$D/l.db" >"$D/demo1.txt" || fail "demo_pay --report: $(cat "$D/demo1.txt")"
grep -q "books balance: consumers paid" "$D/demo1.txt" || fail "demo_pay --report: $(cat "$D/demo1.txt")"
bash "$SRC/tools/demo_pay.sh" "$BIN" "$D/tiny.gguf" >"$D/demo2.txt" 2>&1 || fail "demo_pay: $(cat "$D/demo2.txt")"
grep -q "the same authorization again: HTTP 402" "$D/demo2.txt" && grep -q "books balance" "$D/demo2.txt" ||
  fail "demo_pay: $(cat "$D/demo2.txt")"
ok "tools/demo_pay.sh: $(tail -1 "$D/demo2.txt" | sed 's/^ *//')"
echo "test_gateway_pay: ok"
