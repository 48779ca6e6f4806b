#!/usr/bin/env bash
# make demo: a local swarm of three nodes, one chat completion through its
# gateway, and the proof that the swarm's answer is the single process's.
#
#   1. kvasir swarm up: generates a tiny model, slices it, starts a hub (with
#      its LAN beacon), three nodes and a gateway, waits for full coverage;
#   2. a chat completion through the gateway with curl, and the answer;
#   3. the same request in one process (kvasir run --chat): equal or not;
#   4. which node computed how many experts (each worker's STATS counters),
#      the plan (placement, round trips and bytes per token) and where the
#      status page is;
#   5. kvasir swarm down.
# Usage: tools/demo.sh [KVASIR_BINARY]; without one it installs what is
# missing (tools/install-deps.sh) and builds first. KV_DEMO_PRESET picks the
# gen-model preset (default tiny), KV_DEMO_DIR keeps the swarm's folder.
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
KV=${1:-}
if [ -z "$KV" ]; then
  bash "$SRC/tools/install-deps.sh"
  cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$SRC/build" -j"$(nproc 2>/dev/null || echo 2)" >/dev/null
  KV=$SRC/build/kvasir
fi
command -v curl >/dev/null && command -v jq >/dev/null || { echo "demo: needs curl and jq (tools/install-deps.sh)" >&2; exit 1; }
keep=${KV_DEMO_DIR:-}
dir=${KV_DEMO_DIR:-$(mktemp -d -t kvasir-demo.XXXXXX)}
SW=$dir/swarm
cleanup() {
  [ -f "$SW/swarm.json" ] && "$KV" swarm down --dir "$SW" >/dev/null 2>&1
  [ -n "$keep" ] || rm -rf "$dir"
}
trap cleanup EXIT

# ---- payment hook ------------------------------------------------------------
# tools/demo_pay.sh, when present, is sourced here. Before the swarm starts it
# may set SWARM_GATEWAY_ARGS (more `kvasir gateway` flags, e.g. its ledger;
# passed with swarm up --gateway-arg) and CHAT_HEADERS (more curl arguments
# for the chat request, e.g. -H "X-KVR-Payment: ..."); it defines
# demo_pay_report, run after the chat completion and before swarm down, to
# print what the consumer paid, what each node earned and whether the books
# balance. $KV, $dir, $SW, and after swarm up $HUB and $GW, are set for it.
SWARM_GATEWAY_ARGS=()
CHAT_HEADERS=()
demo_pay_report() { :; }
if [ -f "$SRC/tools/demo_pay.sh" ]; then
  # shellcheck source=/dev/null
  source "$SRC/tools/demo_pay.sh"
fi
gw_args=()
for a in "${SWARM_GATEWAY_ARGS[@]+"${SWARM_GATEWAY_ARGS[@]}"}"; do gw_args+=(--gateway-arg "$a"); done

echo "== kvasir swarm up: a hub, three nodes and a gateway on 127.0.0.1"
"$KV" swarm up --preset "${KV_DEMO_PRESET:-tiny}" --nodes 3 --dir "$SW" --listen 127.0.0.1:0 \
  --hub-listen 127.0.0.1:0 "${gw_args[@]+"${gw_args[@]}"}" | sed 's/^/   /'
HUB=$(jq -r .hub.url "$SW/swarm.json")
GW=$(jq -r .gateway.url "$SW/swarm.json")
MODEL=$(curl -sf "$GW/v1/models" | jq -r '.data[0].id')

prompt="What is a mixture of experts?"
n=24 temp=0.8 topk=40 topp=0.95 minp=0.05 seed=42
body=$(jq -nc --arg m "$MODEL" --arg p "$prompt" --argjson n $n --argjson t $temp --argjson k $topk \
  --argjson tp $topp --argjson mp $minp --argjson s $seed \
  '{model:$m, messages:[{role:"user", content:$p}], max_tokens:$n, temperature:$t, top_k:$k, top_p:$tp, min_p:$mp, seed:$s}')
echo "== curl $GW/v1/chat/completions  (\"$prompt\", $n tokens, temperature $temp, seed $seed)"
curl -sf "$GW/v1/chat/completions" -H 'Content-Type: application/json' "${CHAT_HEADERS[@]+"${CHAT_HEADERS[@]}"}" \
  -d "$body" >"$dir/chat.json"
answer=$(jq -r '.choices[0].message.content' "$dir/chat.json")
echo "   answer (random weights, so the text is gibberish): $(printf '%s' "$answer" | jq -Rs .)"
echo "   usage: $(jq -c .usage "$dir/chat.json")"

"$KV" run -m "$SW/model.gguf" --chat --json --threads 1 -p "$prompt" -n $n --temp $temp --top-k $topk \
  --top-p $topp --min-p $minp --seed $seed >"$dir/ref.json" 2>/dev/null
if [ "$answer" = "$(jq -r .text "$dir/ref.json")" ]; then
  echo "   equals the single-process answer (kvasir run --chat, same parameters): yes"
else
  echo "   equals the single-process answer (kvasir run --chat, same parameters): NO"
  echo "   single process: $(jq -c .text "$dir/ref.json")"
  exit 1
fi

echo "== who computed the experts (each node's worker counters, dispatch STATS; the hub's node metrics)"
sleep 1.2 # one heartbeat, so that the hub's figures (GET /v1/nodes) have caught up
"$KV" swarm status --dir "$SW" --json >"$dir/status.json"
jq -r '.nodes[] | "   \(.name) (\(.addr), \(.shards | length) shards): \(.experts_computed) expert computations" +
  " (hub: \(.served_pairs // "?"))"' "$dir/status.json"
"$KV" plan --hub "$HUB" --json >"$dir/plan.json"
toks=$(jq '.usage.prompt_tokens + .usage.completion_tokens - 1' "$dir/chat.json")
pt=$(jq .usage.prompt_tokens "$dir/chat.json")
L=$(jq .n_moe_layers "$dir/plan.json")
k=$(jq .n_expert_used "$dir/plan.json")
got=$(jq .experts_computed "$dir/status.json")
# a request hedged to a replica (docs/PROTOCOL.md) is computed by both: the gateway counts its slots
hedged=$(curl -s "$GW/metrics" | sed -n 's/^kvasir_gateway_hedged_pairs_total \([0-9]*\)$/\1/p')
hedged=${hedged:-0}
echo "   total $got = ($toks tokens through the model (prompt + answer - 1) x $L MoE layers" \
  "- $((pt - 1)) prompt tokens without logits, which skip the last layer's experts) x top-$k" \
  "+ $hedged computed twice by hedged requests:" \
  "$([ "$got" = $(((toks * L - (pt - 1)) * k + hedged)) ] && echo yes || echo NO)"
echo "== kvasir swarm status"
"$KV" swarm status --dir "$SW" | sed 's/^/   /'
echo "== kvasir plan --hub $HUB"
"$KV" plan --hub "$HUB" | sed 's/^/   /'
demo_pay_report
echo "== status page: $HUB/   (market: $HUB/v1/market, placement: $HUB/v1/placement)"
echo "== kvasir swarm down"
"$KV" swarm down --dir "$SW" | sed 's/^/   /'
