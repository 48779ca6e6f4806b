#!/usr/bin/env bash
# kv-test-labels: net
# Speculative decoding is exact (docs/SPECULATIVE.md): for a qwen3moe and a
# qwen35moe gen-model model, `kvasir run --draft ...` gives the tokens and the
# logits of every generated token (--logits-out) byte for byte of the same run
# without --draft (the reference: plain decoding, one token per forward
# pass), greedy and seeded (top-k/top-p/min-p off and on), with penalties and
# under a grammar, for the ngram source and the test source at
# acceptance 0, 0.5 and 1 (its recorded continuation is the plain run's own
# tokens) with K = 1, 3 and 7, and (qwen35moe) the model's own MTP block; the measured acceptance (accepted / drafted)
# is 0 at 0, 1 at 1 and within 0.15 of 0.5; at acceptance 1 with K = 3 the
# forward passes drop to about a quarter. Then the same over two `kvasir
# worker` processes holding the experts (the verify pass's k+1 positions go
# in one request per layer): the same bytes as the local plain run. Then a
# gateway with --draft ngram answers what one without answers (text and
# log-probabilities) and /metrics
# reports drafted, accepted and acceptance. Bad --draft values are refused
# with a message naming the flag.
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_spec: FAIL: $*" >&2; exit 1; }
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
command -v jq >/dev/null && command -v curl >/dev/null || fail "jq and curl are needed"
DIR=$(mktemp -d "${TMPDIR:-/tmp}/kv_spec.XXXXXX")
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null; rm -rf "$DIR"; }
trap cleanup EXIT

"$BIN" gen-model --arch qwen3moe --out "$DIR/q3.gguf" --layers 3 --embd 64 --ff-exp 32 --experts 6 --experts-used 2 \
  --heads 4 --kv-heads 2 --head-dim 16 --vocab 600 --seed 11 >/dev/null 2>&1 || fail "gen-model qwen3moe"
"$BIN" gen-model --arch qwen35moe --out "$DIR/q35.gguf" --layers 4 --embd 64 --ff-exp 32 --experts 6 --experts-used 2 \
  --heads 4 --kv-heads 2 --head-dim 16 --vocab 600 --attn-interval 2 --nextn 1 --seed 12 >/dev/null 2>&1 ||
  fail "gen-model qwen35moe"

PROMPT="the river and the mountain, the river and the mountain, the river and"
N=48
GREEDY=(--temp 0)
SEEDED=(--temp 0.9 --seed 1234 --top-k 0 --top-p 1 --min-p 0)
CHAIN=(--temp 0.7 --seed 99 --top-k 20 --top-p 0.9 --min-p 0.02 --repeat-penalty 1.3 --presence-penalty 0.5
  --frequency-penalty 0.4)

# shellcheck source=tests/spec_support.sh
. "$SRC/tests/spec_support.sh"
SPEC_BIN=$BIN SPEC_DIR=$DIR SPEC_PIDS=PIDS SPEC_MAX_TOKENS=40
run() { spec_run "$@"; }
same() { spec_same "$@"; }

for arch in q3 q35; do
  for mode in greedy seeded chain; do
    case $mode in
    greedy) S=("${GREEDY[@]}") ;;
    seeded) S=("${SEEDED[@]}") ;;
    chain) S=("${CHAIN[@]}") ;;
    esac
    ref=$arch-$mode
    run "$ref" "$DIR/$arch.gguf" "${S[@]}"
    [ "$(jq '.tokens | length' "$DIR/$ref.json")" -ge 8 ] || fail "$ref: too few tokens"
    jq -r '.tokens | map(tostring) | join(" ")' "$DIR/$ref.json" >"$DIR/$ref.rec"
    plain_steps=$(jq .engine.steps "$DIR/$ref.json")
    run "$ref-ngram" "$DIR/$arch.gguf" "${S[@]}" --draft ngram --draft-max 4
    same "$ref" "$ref-ngram"
    # (with penalties the text may never repeat a suffix: nothing to draft, still exact)
    [ "$mode" = chain ] || [ "$(jq .spec.drafted "$DIR/$ref-ngram.json")" -gt 0 ] || fail "$ref-ngram: nothing drafted"
    for p in 0 0.5 1; do
      for k in 1 3 7; do
        [ "$mode" = greedy ] || [ "$k" = 3 ] || continue
        name=$ref-test-$p-$k
        run "$name" "$DIR/$arch.gguf" "${S[@]}" --draft "test:$DIR/$ref.rec:$p:7" --draft-max "$k"
        same "$ref" "$name"
        dr=$(jq .spec.drafted "$DIR/$name.json")
        ac=$(jq .spec.accepted "$DIR/$name.json")
        [ "$dr" -gt 0 ] || fail "$name: nothing drafted"
        case $p in
        0) [ "$ac" = 0 ] || fail "$name: $ac of $dr accepted at acceptance 0" ;;
        1) [ "$ac" = "$dr" ] || fail "$name: $ac of $dr accepted at acceptance 1" ;;
        0.5) awk -v a="$ac" -v d="$dr" 'BEGIN { r = a / d; exit !(r > 0.35 && r < 0.65) }' ||
          fail "$name: acceptance $ac/$dr not near 0.5" ;;
        esac
        if [ "$p" = 1 ] && [ "$k" = 3 ]; then
          st=$(jq .engine.steps "$DIR/$name.json")
          # the prompt's passes give the first token, then 4 per verify pass
          pre=$((plain_steps - (N - 1)))
          [ "$st" -le $((pre + (N - 1 + 3) / 4 + 1)) ] || fail "$name: $st forward passes for $plain_steps plain"
        fi
      done
    done
  done
  if [ "$arch" = q35 ]; then # the model's own MTP block drafts (acceptance on synthetic weights: reported)
    for mode in greedy seeded; do
      case $mode in
      greedy) S=("${GREEDY[@]}") ;;
      seeded) S=("${SEEDED[@]}") ;;
      esac
      run "$arch-$mode-mtp" "$DIR/$arch.gguf" "${S[@]}" --draft mtp --draft-max 3
      same "$arch-$mode" "$arch-$mode-mtp"
      [ "$(jq .spec.drafted "$DIR/$arch-$mode-mtp.json")" -gt 0 ] || fail "$arch-$mode-mtp: nothing drafted"
      echo "test_spec: $arch $mode mtp: $(jq -c .spec "$DIR/$arch-$mode-mtp.json")"
    done
  fi
  # under a grammar: each position's mask follows the tokens taken before it
  printf 'root ::= "the " word (" " word)* "."\nword ::= [a-z]+\n' >"$DIR/g.gbnf"
  run "$arch-gram" "$DIR/$arch.gguf" "${SEEDED[@]}" --grammar "$DIR/g.gbnf"
  jq -r '.tokens | map(tostring) | join(" ")' "$DIR/$arch-gram.json" >"$DIR/$arch-gram.rec"
  run "$arch-gram-ngram" "$DIR/$arch.gguf" "${SEEDED[@]}" --grammar "$DIR/g.gbnf" --draft ngram
  same "$arch-gram" "$arch-gram-ngram"
  run "$arch-gram-test" "$DIR/$arch.gguf" "${SEEDED[@]}" --grammar "$DIR/g.gbnf" --draft "test:$DIR/$arch-gram.rec:0.7"
  same "$arch-gram" "$arch-gram-test"
  [ "$(jq -r .stop "$DIR/$arch-gram.json")" = "$(jq -r .stop "$DIR/$arch-gram-test.json")" ] || fail "$arch: grammar stop"
  echo "test_spec: $arch: exact with ngram and test sources"
done

# ---- over workers: the experts remote, the verify pass one request per layer
"$BIN" key --key "$DIR/coord.key" >/dev/null
PK=$("$BIN" key --key "$DIR/coord.key")
for arch in q3 q35; do
  "$BIN" slice "$DIR/$arch.gguf" --out "$DIR/$arch-sl" --experts-per-slab 3 >/dev/null 2>&1 || fail "slice $arch"
  W=()
  for g in 0 1; do
    slabs=$(ls "$DIR/$arch-sl"/experts/*.gguf | grep -E "\.$(printf '%04d' $((3 * g)))-" | paste -sd, -)
    [ -n "$slabs" ] || fail "$arch: no slabs of group $g"
    "$BIN" worker --slabs "$slabs" --listen 127.0.0.1:0 --threads 1 --quiet --allow-key "$PK" \
      >"$DIR/$arch-w$g.out" 2>"$DIR/$arch-w$g.err" &
    PIDS+=($!)
    addr=""
    for _ in $(seq 1 200); do
      addr=$(sed -n 's/^listening on \(.*\)$/\1/p' "$DIR/$arch-w$g.out" 2>/dev/null | head -1 || true)
      [ -n "$addr" ] && break
      sleep 0.05
    done
    [ -n "$addr" ] || fail "$arch: worker $g did not start: $(cat "$DIR/$arch-w$g.err")"
    W+=(--worker "$addr")
  done
  for mode in greedy seeded; do
    case $mode in
    greedy) S=("${GREEDY[@]}") ;;
    seeded) S=("${SEEDED[@]}") ;;
    esac
    ref=$arch-$mode
    run "$ref-w-ngram" "$DIR/$arch-sl/manifest.json" "${W[@]}" --key "$DIR/coord.key" "${S[@]}" --draft ngram
    same "$ref" "$ref-w-ngram"
    run "$ref-w-test" "$DIR/$arch-sl/manifest.json" "${W[@]}" --key "$DIR/coord.key" "${S[@]}" \
      --draft "test:$DIR/$ref.rec:0.5:3" --draft-max 3
    same "$ref" "$ref-w-test"
    [ "$(jq .spec.accepted "$DIR/$ref-w-test.json")" -gt 0 ] || fail "$ref over workers: nothing accepted"
  done
  echo "test_spec: $arch: exact over workers"
done

# ---- the gateway: --draft ngram answers the same; /metrics reports acceptance
start() { spec_gateway "$@"; }
complete() { spec_complete "$@"; }
start plain -m "$DIR/q35.gguf"
start spec -m "$DIR/q35.gguf" --draft ngram --draft-max 4
P=$(cat "$DIR/plain.addr")
Q=$(cat "$DIR/spec.addr")
for seed in -1 5 77; do
  a=$(complete "$P" "$seed")
  b=$(complete "$Q" "$seed")
  [ -n "$a" ] && [ "$a" = "$b" ] || fail "gateway seed $seed: '$b' differs from '$a'"
done
# log-probabilities ride with each waiting token: the same numbers
lp() { # ADDR SEED -> the completion's logprobs object
  jq -n --arg p "$PROMPT" --argjson s "$2" '{model:"m",prompt:$p,max_tokens:24,temperature:0.8,seed:$s,logprobs:3}' |
    curl -sf "http://$1/v1/completions" -H 'content-type: application/json' -d @- | jq -c '.choices[0].logprobs' ||
    fail "logprobs request to $1"
}
for seed in 3 4; do
  a=$(lp "$P" "$seed")
  b=$(lp "$Q" "$seed")
  [ "$a" != null ] && [ "$a" = "$b" ] || fail "gateway logprobs seed $seed differ: $a vs $b"
done
metric() { curl -sf "http://$1/metrics" | awk -v n="$2" '$1 == n {print $2}'; }
dr=$(metric "$Q" kvasir_gateway_spec_drafted_tokens_total)
ac=$(metric "$Q" kvasir_gateway_spec_accepted_tokens_total)
rate=$(metric "$Q" kvasir_gateway_spec_acceptance)
[ -n "$dr" ] && [ "$dr" -gt 0 ] || fail "/metrics: no drafted tokens ($dr)"
[ -n "$ac" ] && [ -n "$rate" ] || fail "/metrics: no acceptance"
awk -v a="$ac" -v d="$dr" -v r="$rate" 'BEGIN { exit !(r - a / d < 1e-5 && a / d - r < 1e-5) }' ||
  fail "/metrics: acceptance $rate is not $ac/$dr"
[ -z "$(metric "$P" kvasir_gateway_spec_drafted_tokens_total)" ] || fail "/metrics: spec lines without --draft"
echo "test_spec: gateway: same text, acceptance $ac/$dr reported"

# ---- refusals name the flag
bad() { # WANT ARGS...: kvasir run fails with a message containing WANT
  local want=$1
  shift
  if "$BIN" run -m "$DIR/q3.gguf" -p hi -n 2 "$@" >"$DIR/bad.out" 2>"$DIR/bad.err"; then fail "accepted: $*"; fi
  grep -q -- "$want" "$DIR/bad.err" || fail "'$*': message lacks '$want': $(cat "$DIR/bad.err")"
}
bad "unknown source" --draft bogus
bad "no MTP (nextn) block" --draft mtp
bad "draft-max" --draft ngram --draft-max 0
bad "draft-max" --draft ngram --draft-max 16
bad "draft-max needs --draft" --draft-max 3
bad "cannot open" --draft "test:$DIR/missing.txt:0.5"
bad "not a number in \[0, 1\]" --draft "test:$DIR/q3-greedy.rec:1.5"
printf '1 2 x 3\n' >"$DIR/junk.rec"
bad "unexpected byte" --draft "test:$DIR/junk.rec:0.5"
printf '1 2 600\n' >"$DIR/big.rec"
bad "outside the vocabulary" --draft "test:$DIR/big.rec:0.5"
if "$BIN" gateway -m "$DIR/q3.gguf" --draft nope --listen 127.0.0.1:0 >"$DIR/gb.out" 2>"$DIR/gb.err"; then
  fail "gateway accepted --draft nope"
fi
grep -q "unknown source" "$DIR/gb.err" || fail "gateway --draft nope: $(cat "$DIR/gb.err")"
echo "test_spec: ok"
