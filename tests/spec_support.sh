# Sourced by test_spec.sh and test_spec_mtp.sh: kvasir run into a file and
# two runs compared, a gateway started on a free port and a completion asked
# of it. The caller sets SPEC_BIN (kvasir), SPEC_DIR (its temporary folder),
# SPEC_PIDS (the name of its array of processes to clean up),
# SPEC_MAX_TOKENS, N and PROMPT, and defines fail.

spec_gateway() { # NAME ARGS...: a gateway; its address in $SPEC_DIR/NAME.addr
  local name=$1
  shift
  local -n _spec_pids=$SPEC_PIDS
  "$SPEC_BIN" gateway "$@" --listen 127.0.0.1:0 --threads 1 --name m >"$SPEC_DIR/$name.out" 2>"$SPEC_DIR/$name.err" &
  local pid=$!
  _spec_pids+=("$pid")
  for _ in $(seq 1 600); do
    grep -q "^listening on " "$SPEC_DIR/$name.out" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || fail "gateway $name exited: $(cat "$SPEC_DIR/$name.err")"
    sleep 0.1
  done
  sed -n 's/^listening on //p' "$SPEC_DIR/$name.out" >"$SPEC_DIR/$name.addr"
  [ -s "$SPEC_DIR/$name.addr" ] || fail "gateway $name did not print its address"
}

spec_complete() { # ADDR SEED -> the text (SEED < 0: greedy)
  jq -n --arg p "$PROMPT" --argjson s "$2" --argjson n "$SPEC_MAX_TOKENS" '{model:"m",prompt:$p,max_tokens:$n,
    temperature:(if $s < 0 then 0 else 0.9 end), seed:(if $s < 0 then 0 else $s end)}' |
    curl -sf "http://$1/v1/completions" -H 'content-type: application/json' -d @- | jq -r '.choices[0].text' ||
    fail "completion request to $1"
}

spec_run() { # NAME MODEL ARGS...: kvasir run --json into NAME.json, logits into NAME.bin ($N tokens of $PROMPT)
  local name=$1 model=$2
  shift 2
  "$SPEC_BIN" run -m "$model" -p "$PROMPT" -n "$N" --threads 2 --batch 7 --json --logits-out "$SPEC_DIR/$name.bin" "$@" \
    >"$SPEC_DIR/$name.json" 2>"$SPEC_DIR/$name.err" || fail "run $name: $(cat "$SPEC_DIR/$name.err")"
}

spec_same() { # A B: tokens and logits identical
  [ "$(jq -c .tokens "$SPEC_DIR/$1.json")" = "$(jq -c .tokens "$SPEC_DIR/$2.json")" ] ||
    fail "$2: tokens differ from $1: $(jq -c .tokens "$SPEC_DIR/$1.json") vs $(jq -c .tokens "$SPEC_DIR/$2.json")"
  cmp -s "$SPEC_DIR/$1.bin" "$SPEC_DIR/$2.bin" || fail "$2: logits differ from $1"
}
