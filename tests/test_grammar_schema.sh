#!/usr/bin/env bash
# kv-test-labels: oracle
# Grammar-constrained output validates against its JSON schema, checked by
# an independent validator: test_grammar generates, for every schema of its
# table and many seeds, random constrained samples over a real gen-model
# vocabulary (random logits, the grammar's mask, the sampler, until the
# model picks an end-of-generation token) and writes them to a file;
# tests/oracle/grammar_validate.mjs parses each with JSON.parse and
# validates it with the npm package ajv (pinned in tests/oracle), together
# with control samples that must be refused. A missing ajv is a FAILURE, not
# a skip (tools/install-oracle.sh installs it).
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BUILD=${KV_BUILD:-$SRC/build}
fail() { echo "test_grammar_schema: FAIL: $*" >&2; exit 1; }
command -v node >/dev/null 2>&1 || fail "node not found"
[ -f "$SRC/tests/oracle/node_modules/ajv/package.json" ] || fail "ajv missing (run tools/install-oracle.sh)"
[ -x "$BUILD/test_grammar" ] || fail "test_grammar missing: $BUILD/test_grammar"
DIR=$(mktemp -d "${TMPDIR:-/tmp}/kv_grammar.XXXXXX")
trap 'rm -rf "$DIR"' EXIT
KV_GRAMMAR_EMIT="$DIR/samples.jsonl" KV_GRAMMAR_SEEDS=${KV_GRAMMAR_SEEDS:-40} \
  "$BUILD/test_grammar" test_schema_generate >"$DIR/gen.log" 2>&1 || { cat "$DIR/gen.log" >&2; fail "test_grammar"; }
grep "schema samples" "$DIR/gen.log"
n=$(wc -l <"$DIR/samples.jsonl")
[ "$n" -ge 600 ] || fail "only $n samples written"
node "$SRC/tests/oracle/grammar_validate.mjs" "$DIR/samples.jsonl"
