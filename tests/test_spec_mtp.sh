#!/usr/bin/env bash
# kv-test-labels: net
# The MTP draft source over workers (docs/SPECULATIVE.md): a qwen35moe
# gen-model model with an MTP block (--nextn 1), sliced; a coordinator whose
# folder holds only the manifest and the backbone (every expert, the MTP
# block's layer 4 too, on two `kvasir worker` processes). `kvasir run
# --draft mtp` over them gives the tokens and logits of plain in-process
# decoding byte for byte (the reference: `kvasir run -m F.gguf` without
# --draft), greedy and seeded, and drafts exactly what in-process MTP drafts:
# the same drafted and accepted counts and the same digest of every drafted
# token (the block's math is the same bits wherever its experts run). The
# same through `kvasir gateway --worker ... --draft mtp`: the text of a plain
# gateway, and /metrics counts what an in-process MTP gateway counts.
# Refusals at start, naming the cause: workers that do not serve the MTP
# block's experts (layer 4), and a qwen3moe model (no MTP block).
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
KV=${KV_BIN:-$SRC/build/kvasir}
[ -x "$KV" ] || { echo "test_spec_mtp: kvasir binary missing: $KV" >&2; exit 1; }
command -v jq >/dev/null && command -v curl >/dev/null || { echo "test_spec_mtp: jq and curl are needed" >&2; exit 1; }
dir=$(mktemp -d "${TMPDIR:-/tmp}/kv_spec_mtp.XXXXXX")
# shellcheck source=tests/dispatch_support.sh
. "$SRC/tests/dispatch_support.sh" # fail, start_worker, group, $KEY; the EXIT trap cleans up
fail() { echo "test_spec_mtp: FAIL: $*" >&2; exit 1; }

"$KV" gen-model --arch qwen35moe --out "$dir/q35.gguf" --layers 4 --embd 64 --ff-exp 32 --experts 6 --experts-used 2 \
  --heads 4 --kv-heads 2 --head-dim 16 --vocab 600 --attn-interval 2 --nextn 1 --seed 12 >/dev/null 2>&1 ||
  fail "gen-model qwen35moe"
"$KV" gen-model --arch qwen3moe --out "$dir/q3.gguf" --layers 3 --embd 64 --ff-exp 32 --experts 6 --experts-used 2 \
  --heads 4 --kv-heads 2 --head-dim 16 --vocab 600 --seed 11 >/dev/null 2>&1 || fail "gen-model qwen3moe"
for m in q35 q3; do
  "$KV" slice "$dir/$m.gguf" --out "$dir/$m-sl" --experts-per-slab 3 >/dev/null 2>&1 || fail "slice $m"
  mkdir "$dir/$m-co" # the coordinator's folder: no slab, every expert from the workers
  cp "$dir/$m-sl/manifest.json" "$dir/$m-sl/backbone.gguf" "$dir/$m-co/"
done
[ -f "$dir/q35-sl/experts/blk.4.0000-0002.gguf" ] || fail "the slicer wrote no slab of the MTP block's experts"

PROMPT="the river and the mountain, the river and the mountain, the river and"
N=32
GREEDY=(--temp 0)
SEEDED=(--temp 0.9 --seed 1234 --top-k 0 --top-p 1 --min-p 0)
# shellcheck source=tests/spec_support.sh
. "$SRC/tests/spec_support.sh"
SPEC_BIN=$KV SPEC_DIR=$dir SPEC_PIDS=pids SPEC_MAX_TOKENS=24
run() { spec_run "$@"; }
same() { spec_same "$@"; }
refused() { # WANT NAME ARGS...: kvasir run fails at start with a message containing WANT
  local want=$1 name=$2
  shift 2
  if "$KV" run -p hi -n 2 --key "$KEY" "$@" >"$dir/$name.out" 2>"$dir/$name.err"; then fail "$name: accepted"; fi
  grep -q -- "$want" "$dir/$name.err" || fail "$name: message lacks '$want': $(cat "$dir/$name.err")"
}

# two workers: experts 0-2 and 3-5 of every layer, the MTP block's (4) included
W=()
for g in 0 1; do
  start_worker "w$g" "$(group "$dir/q35-sl" 5 $g)"
  W+=(--worker "$addr")
done
for mode in greedy seeded; do
  case $mode in
  greedy) S=("${GREEDY[@]}") ;;
  seeded) S=("${SEEDED[@]}") ;;
  esac
  run "$mode" "$dir/q35.gguf" "${S[@]}"
  [ "$(jq '.tokens | length' "$dir/$mode.json")" = "$N" ] || fail "$mode: not $N tokens"
  run "$mode-mtp" "$dir/q35.gguf" "${S[@]}" --draft mtp --draft-max 3
  same "$mode" "$mode-mtp"
  run "$mode-w-mtp" "$dir/q35-co" "${W[@]}" --key "$KEY" "${S[@]}" --draft mtp --draft-max 3
  same "$mode" "$mode-w-mtp"
  a=$(jq -c .spec "$dir/$mode-mtp.json")
  b=$(jq -c .spec "$dir/$mode-w-mtp.json")
  [ "$(jq .drafted <<<"$a")" -gt $((N / 2)) ] || fail "$mode in process: too few drafts: $a"
  [ "$a" = "$b" ] || fail "$mode: over workers the drafts differ from in process: $b vs $a"
  # the block's experts were computed by the workers (layer 4 in the demand)
  [ "$(jq '[.dispatch.demand[] | select(.layer == 4) | .computations] | add' "$dir/$mode-w-mtp.json")" -gt 0 ] ||
    fail "$mode: no worker computed the MTP block's experts"
  [ "$(jq .dispatch.pairs_local "$dir/$mode-w-mtp.json")" = 0 ] || fail "$mode: experts computed at the coordinator"
  echo "test_spec_mtp: $mode over workers: same bytes, the same drafts as in process $b"
done

# ---- the gateway: the same text as plain, and the acceptance an in-process MTP gateway reports
start() { spec_gateway "$@"; }
complete() { spec_complete "$@"; }
metric() { curl -sf "http://$1/metrics" | awk -v n="$2" '$1 == n {print $2}'; }
start plain -m "$dir/q35.gguf"
start local -m "$dir/q35.gguf" --draft mtp --draft-max 3
start remote -m "$dir/q35-co" "${W[@]}" --key "$KEY" --draft mtp --draft-max 3
P=$(cat "$dir/plain.addr")
L=$(cat "$dir/local.addr")
R=$(cat "$dir/remote.addr")
for seed in -1 5; do
  a=$(complete "$P" "$seed")
  b=$(complete "$L" "$seed")
  c=$(complete "$R" "$seed")
  [ -n "$a" ] && [ "$a" = "$b" ] && [ "$a" = "$c" ] || fail "gateway seed $seed: '$c' (workers), '$b' differ from '$a'"
done
for m in drafted_tokens_total accepted_tokens_total verify_steps_total; do
  x=$(metric "$L" "kvasir_gateway_spec_$m")
  y=$(metric "$R" "kvasir_gateway_spec_$m")
  [ -n "$x" ] && [ "$x" = "$y" ] || fail "/metrics spec_$m: $y over workers, $x in process"
done
[ "$(metric "$R" kvasir_gateway_spec_drafted_tokens_total)" -gt 0 ] || fail "/metrics: nothing drafted"
echo "test_spec_mtp: gateway over workers: same text, /metrics as in process"

# ---- refusals at start
W2=()
for g in 0 1; do # workers without the MTP block's experts
  start_worker "v$g" "$(group "$dir/q35-sl" 4 $g)"
  W2+=(--worker "$addr")
done
refused "layer 4" nomtp -m "$dir/q35-co" "${W2[@]}" --draft mtp
grep -q -- "--draft mtp" "$dir/nomtp.err" || fail "the refusal does not name --draft mtp: $(cat "$dir/nomtp.err")"
"$KV" run -m "$dir/q35-co" "${W2[@]}" --key "$KEY" -p hi -n 2 >/dev/null 2>&1 || fail "plain decoding refused without the MTP experts"
if "$KV" gateway -m "$dir/q35-co" "${W2[@]}" --key "$KEY" --draft mtp --listen 127.0.0.1:0 >"$dir/gw.out" 2>"$dir/gw.err"; then
  fail "gateway started with --draft mtp and no worker serving layer 4"
fi
grep -q "layer 4" "$dir/gw.err" || fail "gateway refusal: $(cat "$dir/gw.err")"
W3=()
for g in 0 1; do
  start_worker "u$g" "$(group "$dir/q3-sl" 3 $g)"
  W3+=(--worker "$addr")
done
refused "no MTP (nextn) block" q3mtp -m "$dir/q3-co" "${W3[@]}" --draft mtp
echo "test_spec_mtp: ok"
