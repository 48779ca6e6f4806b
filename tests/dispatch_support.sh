# Shared by the dispatch script tests (sourced): test_dispatch.sh and the
# per-family ones (test_ds2_dispatch.sh, test_gptoss_dispatch.sh). Needs KV
# (the binary) and dir (a scratch folder). Makes the coordinator key $KEY
# (public key $PK; workers allow the keys in ALLOW), starts `kvasir worker`
# processes that dispatch_cleanup (the EXIT trap) kills, and checks a run
# against the local one byte for byte.
pids=()
fail() { echo "FAIL: $*" >&2; exit 1; }

dispatch_cleanup() {
  # a test may have stopped a worker (SIGSTOP): continue it so it dies now
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap dispatch_cleanup EXIT

# authenticated dispatch: workers serve only this coordinator key
KEY="$dir/coord.key"
PK=$("$KV" key --key "$KEY")
ALLOW=(--allow-key "$PK")

# start_worker NAME SLABS [FLAGS...]: starts a worker on a free port; sets $addr and $pid.
start_worker() {
  local name=$1 slabs=$2
  shift 2
  "$KV" worker --slabs "$slabs" --listen 127.0.0.1:0 --threads 1 --quiet "${ALLOW[@]}" "$@" \
    >"$dir/$name.out" 2>"$dir/$name.err" &
  pid=$!
  pids+=("$pid")
  addr=
  for _ in $(seq 200); do
    addr=$(sed -n 's/^listening on \(.*\)$/\1/p' "$dir/$name.out" 2>/dev/null | head -1 || true)
    [ -n "$addr" ] && return 0
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.02
  done
  cat "$dir/$name.err" >&2
  fail "worker $name did not start"
}

# group MODEL_DIR N_LAYER G [FIRST]: the comma-separated slab files of expert
# group G in layers FIRST (default 0) .. N_LAYER-1 (slabs are 3 experts wide,
# so group G holds experts 3G..3G+2 of every such layer).
group() {
  local out="" l
  for ((l = ${4:-0}; l < $2; l++)); do
    out+="${out:+,}$1/experts/$(printf 'blk.%d.%04d-%04d.gguf' "$l" $((3 * $3)) $((3 * $3 + 2)))"
  done
  echo "$out"
}

PROMPT="The swarm computes every expert where it lives, and the tokens come out the same"
RUN=(-p "$PROMPT" -n 12 --temp 0 --json --batch 5 --threads 2 --key "$KEY")

# run_local M: `kvasir run` of M/model.gguf with RUN, into M/local.json and
# M/local.bin (the logits); it must generate 12 tokens.
run_local() {
  "$KV" run -m "$1/model.gguf" "${RUN[@]}" --logits-out "$1/local.bin" >"$1/local.json"
  local n
  n=$(jq '.tokens | length' "$1/local.json")
  [ "$n" = 12 ] || fail "local run generated $n tokens"
}

# same_as_local M NAME WHAT: M/NAME.json's tokens and M/NAME.bin's logits
# are M/local's, byte for byte.
same_as_local() {
  [ "$(jq -c .tokens "$1/local.json")" = "$(jq -c .tokens "$1/$2.json")" ] || fail "$3: tokens differ"
  cmp -s "$1/local.bin" "$1/$2.bin" || fail "$3: logits differ"
}

# run_workers M N_LAYER [FIRST]: three workers holding expert groups 0, 1, 2
# of layers FIRST..N_LAYER-1 of M/sl, and a run from M/coord's manifest over
# them into M/remote.json/.bin: the same bytes as local, every worker busy,
# nothing computed at the coordinator.
run_workers() {
  local g addrs=()
  for g in 0 1 2; do
    start_worker "w$g" "$(group "$1/sl" "$2" $g "${3:-0}")"
    addrs+=(--worker "$addr")
  done
  "$KV" run -m "$1/coord/manifest.json" "${addrs[@]}" "${RUN[@]}" --logits-out "$1/remote.bin" >"$1/remote.json"
  same_as_local "$1" remote workers
  [ "$(jq '[.dispatch.workers[] | select(.pairs > 0)] | length' "$1/remote.json")" = 3 ] || fail "a worker idle"
  [ "$(jq '.dispatch.pairs_local' "$1/remote.json")" = 0 ] || fail "local computations with no slabs"
}
