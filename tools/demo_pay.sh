#!/usr/bin/env bash
# The paying part of `make demo`: a consumer pays a gateway in KVR for two
# completions and the books are shown to balance.
#
#   tools/demo_pay.sh KVASIR MODEL [--worker HOST:PORT ...]
#       makes an operator, a gateway and a consumer key and a ledger, funds
#       the consumer, starts `kvasir gateway --ledger` on MODEL (the workers,
#       if any, must be up), sends one whole and one streamed completion with
#       X-KVR-Payment, stops the gateway and prints the report below.
#   tools/demo_pay.sh --report KVASIR LEDGER_DB
#       only the report: what each consumer paid, what each node earned,
#       and whether the books balance (`kvasir ledger summary`, `check`).
# Exits non-zero when the books do not balance. Needs curl and jq.
set -euo pipefail

report() { # report KVASIR DB
  local kv=$1 db=$2 j
  j=$("$kv" ledger summary --db "$db" --json) || true
  jq -r '.consumers[] | "   consumer \(.account[0:25])... paid \(.paid) micro-KVR (balance \(.balance))"' <<<"$j"
  jq -r '.nodes[] | "   node \(.account[0:21])... earned \(.earned) micro-KVR for \(.products) expert products"' <<<"$j"
  jq -r '"   treasury (protocol fee): \(.fees) micro-KVR"' <<<"$j"
  echo "   $("$kv" ledger check --db "$db")"
  if [ "$(jq .balanced <<<"$j")" = true ]; then
    jq -r '"   books balance: consumers paid \(.paid) = nodes earned \(.earned) + fees \(.fees)"' <<<"$j"
  else
    echo "   books DO NOT balance: $j" && return 1
  fi
}

# Sourced by tools/demo.sh (make demo): the swarm's gateway charges the demo's
# chat completion through a ledger, and demo_pay_report prints who paid and
# who earned. The gateway id is fixed (--gateway-id) so that the
# authorization can be made before the swarm starts.
if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  mkdir -p "$dir"
  for k in operator gateway consumer; do "$KV" wallet new --out "$dir/$k.key" >/dev/null; done
  "$KV" ledger init --db "$dir/ledger.db" --key "$dir/operator.key" --fee-bps 500 >/dev/null
  demo_consumer=$("$KV" wallet show --key "$dir/consumer.key")
  "$KV" ledger issue --db "$dir/ledger.db" --key "$dir/operator.key" --to "$demo_consumer" --amount 1000000 >/dev/null
  SWARM_GATEWAY_ARGS=(--ledger "$dir/ledger.db" --gateway-key "$dir/gateway.key" --gateway-id demo-gw --prices 2,5)
  CHAT_HEADERS=(-H "X-KVR-Payment: $("$KV" wallet pay --key "$dir/consumer.key" --gateway demo-gw --max 20000)")
  demo_pay_report() {
    echo "== paying in KVR (the operator issued 1000000 micro-KVR to consumer ${demo_consumer:0:16}...;"
    echo "   the gateway charged the completion above at 2 + 5 micro-KVR per prompt + completion token)"
    report "$KV" "$dir/ledger.db"
  }
  return 0
fi

if [ "${1:-}" = --report ]; then
  report "$2" "$3"
  exit
fi
KV=${1:?usage: demo_pay.sh KVASIR MODEL [--worker HOST:PORT ...]}
MODEL=${2:?usage: demo_pay.sh KVASIR MODEL [--worker HOST:PORT ...]}
shift 2
dir=$(mktemp -d -t kvasir-pay.XXXXXX)
gw=
trap '[ -n "$gw" ] && kill "$gw" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$dir"' EXIT
echo "== paying in KVR: kvasir wallet, kvasir ledger, kvasir gateway --ledger"
for k in operator gateway consumer; do "$KV" wallet new --out "$dir/$k.key" >/dev/null; done
"$KV" ledger init --db "$dir/ledger.db" --key "$dir/operator.key" --fee-bps 500 >/dev/null
consumer=$("$KV" wallet show --key "$dir/consumer.key")
"$KV" ledger issue --db "$dir/ledger.db" --key "$dir/operator.key" --to "$consumer" --amount 1000000 >/dev/null
echo "   the operator issued 1000000 micro-KVR to consumer ${consumer:0:16}..."
"$KV" gateway -m "$MODEL" "$@" --listen 127.0.0.1:0 --threads 1 --ledger "$dir/ledger.db" \
  --gateway-key "$dir/gateway.key" --prices 2,5 >"$dir/gw.out" 2>"$dir/gw.err" &
gw=$!
for _ in $(seq 300); do grep -q '^listening on' "$dir/gw.out" && break; sleep 0.05; done
addr=$(sed -n 's/^listening on //p' "$dir/gw.out")
[ -n "$addr" ] || { cat "$dir/gw.err" >&2; exit 1; }
prices=$(curl -s "http://$addr/v1/prices")
id=$(jq -r .gateway <<<"$prices")
echo "   GET /v1/prices: $prices"
body='{"messages":[{"role":"user","content":"What does the swarm cost?"}],"max_tokens":24,"temperature":0'
hdr=$("$KV" wallet pay --key "$dir/consumer.key" --gateway "$id" --max 5000)
curl -s -D "$dir/h1" "http://$addr/v1/chat/completions" -H "X-KVR-Payment: $hdr" -d "$body}" >"$dir/r1.json"
echo "   completion 1 (whole): $(jq -c .usage "$dir/r1.json"), X-KVR-Cost $(sed -n 's/^X-KVR-Cost: \([0-9]*\).*/\1/ip' "$dir/h1")"
hdr=$("$KV" wallet pay --key "$dir/consumer.key" --gateway "$id" --max 5000)
curl -s -N "http://$addr/v1/chat/completions" -H "X-KVR-Payment: $hdr" \
  -d "$body,\"stream\":true,\"stream_options\":{\"include_usage\":true}}" >"$dir/r2.txt"
echo "   completion 2 (streamed): $(grep '"usage":{' "$dir/r2.txt" | sed 's/^data: //' | jq -c .usage)"
code=$(curl -s -o /dev/null -w '%{http_code}' "http://$addr/v1/chat/completions" -H "X-KVR-Payment: $hdr" -d "$body}")
echo "   the same authorization again: HTTP $code (used once)"
kill "$gw"
wait "$gw" 2>/dev/null || true
gw=
report "$KV" "$dir/ledger.db"
