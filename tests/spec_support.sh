# Sourced by test_spec.sh and test_spec_mtp.sh: a gateway started on a free
# port and a completion asked of it. The caller sets SPEC_BIN (kvasir),
# SPEC_DIR (its temporary folder), SPEC_PIDS (the name of its array of
# processes to clean up), SPEC_MAX_TOKENS and PROMPT, and defines fail.

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
