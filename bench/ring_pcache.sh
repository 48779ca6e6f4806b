#!/usr/bin/env bash
# Time to first token over a ring with the prompt cache (not a test): two
# requests that share a prefix of about RPC_PREFIX tokens, each with an
# ending of its own, through a ring of 2 `kvasir ring --prompt-cache` nodes
# on loopback (one thread each). The first finds nothing cached and the
# ring computes its whole prompt; the second begins, on every node, from the
# blocks of the shared prefix that every node holds (a LOOKUP round the
# ring, docs/PROTOCOL.md "Prompt cache over the ring") and computes the
# rest. Prints both times to the first token (`kvasir run --ring --json`:
# from the request's send to its first token), their ratio and the tokens
# reused; then the second prompt through a ring without a cache (the cold
# cost of the second prompt) and whether its first token's logits equal the
# cached run's, bit for bit. Figures: docs/BENCHMARKS.md.
#
# Usage: bench/ring_pcache.sh [BUILD]; env RPC_ARCH (qwen3moe | qwen35moe),
# RPC_PREFIX (6000), RPC_PRESET (small).
set -euo pipefail
build=${1:-build}
KV=$build/kvasir
SRC=$(cd "$(dirname "$0")/.." && pwd)
dir=$(mktemp -d "${TMPDIR:-/tmp}/kv_bench_rpc.XXXXXX")
. "$SRC/tests/ring_support.sh"
trap ring_cleanup EXIT
ring_keys
arch=${RPC_ARCH:-qwen3moe}
want=${RPC_PREFIX:-6000}
m="$dir/m.gguf"
"$KV" gen-model --arch "$arch" --preset "${RPC_PRESET:-small}" --ctx 8192 --out "$m" >/dev/null 2>&1

# a prefix of about $want tokens (measured with the model's own tokenizer)
word() { printf 'w%d river %d mountain %d. ' "$1" $(($1 * 7)) $(($1 * 13)); }
prefix=""
i=0
while :; do
  for _ in $(seq 1 100); do i=$((i + 1)); prefix="$prefix$(word $i)"; done
  toks=$("$KV" tokenize -m "$m" -- "$prefix" | jq length)
  [ "$toks" -ge "$want" ] && break
done
P1="$prefix The first request ends here, with its own words."
P2="$prefix A second request, with another ending altogether."

ask() { # NODE PROMPT OUT
  "$KV" run --ring "${RING_ADDR[$1]}" "${RK[@]}" -p "$2" -n 1 --temp 0 --json --logits-out "$3.bin" \
    --ring-timeout-ms 600000 >"$3.json"
}
RING_EXTRA="--prompt-cache 2G --ctx 8192" ring_start "$m" 0-1 2-3
ask 0 "$P1" "$dir/a"
ask 1 "$P2" "$dir/b"
ring_stop
RING_EXTRA="--ctx 8192" ring_start "$m" 0-1 2-3
ask 0 "$P2" "$dir/c"
ring_stop
t1=$(jq .timings.first_token_s "$dir/a.json")
t2=$(jq .timings.first_token_s "$dir/b.json")
t3=$(jq .timings.first_token_s "$dir/c.json")
np=$(jq '.prompt_tokens | length' "$dir/b.json")
nc=$(jq .cached_tokens "$dir/b.json")
eq=no
cmp -s "$dir/b.bin" "$dir/c.bin" && eq="yes, bit for bit"
printf '%s %s, ring of 2 nodes (one thread each): prompt %d tokens, %d reused\n' "$arch" "${RPC_PRESET:-small}" "$np" "$nc"
printf 'first request (cold) %.3f s, second (warm) %.3f s: %.1fx; second prompt without a cache %.3f s; logits equal: %s\n' \
  "$t1" "$t2" "$(echo "$t1 / $t2" | bc -l)" "$t3" "$eq"
