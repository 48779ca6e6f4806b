#!/usr/bin/env bash
# kv-test-labels: oracle net
# Conformance with llama.cpp (issue 2, item 9): tokenization, greedy
# continuations and logits of `kvasir` on synthetic models, checked against
# llama.cpp (node-llama-cpp 3.21.1, the test-only oracle in tests/oracle) on
# the same GGUF files. The work is done by tests/oracle/conformance.mjs;
# bounds and measured values: docs/CONFORMANCE.md.
#
# A missing oracle (node, or node-llama-cpp 3.21.1 with its CPU prebuilt) is
# a FAILURE, not a skip: `make test` installs it (tools/install-oracle.sh).
# Env: KV_BIN (kvasir binary), KV_SRC (source dir), KV_BUILD (build dir);
# KV_CONFORMANCE_MODELS=a,b limits the models, KV_CONFORMANCE_KEEP=1 keeps
# the generated files.
set -euo pipefail
SRC=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
BIN=${KV_BIN:-$SRC/build/kvasir}
fail() { echo "test_conformance: FAIL: $*" >&2; exit 1; }
command -v node >/dev/null 2>&1 || fail "node not found (the llama.cpp oracle needs Node.js >= 20)"
PJ="$SRC/tests/oracle/node_modules/node-llama-cpp/package.json"
[ -f "$PJ" ] || fail "oracle missing: $PJ (run tools/install-oracle.sh)"
grep -q '"version": "3.21.1"' "$PJ" || fail "oracle is not node-llama-cpp 3.21.1 ($PJ)"
[ -x "$BIN" ] || fail "kvasir binary missing: $BIN"
# The oracle must never try to download or build llama.cpp.
export NODE_LLAMA_CPP_SKIP_DOWNLOAD=true
exec node "$SRC/tests/oracle/conformance.mjs"
