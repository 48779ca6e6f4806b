#!/usr/bin/env bash
# kv-test-labels: net
# `make demo` (tools/demo.sh) with the built binary: the swarm comes up, the
# gateway's answer equals the single-process answer, the nodes' expert
# counts add up to what the request needed, the status page is named, the
# swarm goes down, and no process of it is left.
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
KV=${KV_BIN:-$SRC/build/kvasir}
dir=$(mktemp -d -t kvasir-demotest.XXXXXX)
trap '[ -f "$dir/d/swarm/swarm.json" ] && "$KV" swarm down --dir "$dir/d/swarm" >/dev/null 2>&1; rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*" >&2; cat "$dir/out" >&2; exit 1; }
KV_DEMO_DIR="$dir/d" bash "$SRC/tools/demo.sh" "$KV" >"$dir/out" 2>&1 || fail "demo exited non-zero"
grep -q "equals the single-process answer (kvasir run --chat, same parameters): yes" "$dir/out" || fail "no equality line"
[ "$(grep -cE '^   node[123] \(127\.0\.0\.1:[0-9]+, [0-9]+ shards\): [0-9]+ expert computations \(hub: [0-9]+\)$' "$dir/out")" = 3 ] ||
  fail "no per-node expert counts"
grep -qE "^   total [0-9]+ = \([0-9]+ tokens through the model .*: yes$" "$dir/out" || fail "the counts do not add up"
grep -qE "^   books balance: consumers paid [1-9][0-9]* = nodes earned [0-9]+ \+ fees [0-9]+$" "$dir/out" || fail "no payment lines"
grep -qE "^   ledger ok: " "$dir/out" || fail "the ledger check did not pass"
# what each node was paid for is what its worker counted
for n in $(grep -oE '^   node[123] \(127\.0\.0\.1:[0-9]+, [0-9]+ shards\): [0-9]+' "$dir/out" | awk '{print $NF}'); do
  grep -qE "^   node node:[0-9a-f]+\.\.\. earned [0-9]+ micro-KVR for $n expert products$" "$dir/out" ||
    fail "no node paid for its $n expert products"
done
grep -qE "^== status page: http://127\.0\.0\.1:[0-9]+/ " "$dir/out" || fail "no status page line"
grep -q "swarm down: 5 processes stopped (5 by SIGTERM, 0 by SIGKILL)" "$dir/out" || fail "no swarm down report"
[ ! -f "$dir/d/swarm/swarm.json" ] || fail "swarm.json left"
for p in $(jq -r '.hub.pid, .gateway.pid, .nodes[].pid' "$dir/d/swarm/swarm.last.json"); do
  st=$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null || true)
  [ -z "$st" ] || [ "$st" = Z ] || fail "process $p left running"
done
echo "ok: make demo: $(grep -c . "$dir/out") lines, the swarm's answer equals the single process's"
