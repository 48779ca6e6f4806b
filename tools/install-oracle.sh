#!/usr/bin/env bash
# Installs the test-only llama.cpp oracle (npm node-llama-cpp, pinned) into
# tests/oracle/node_modules when missing. Only the CPU linux-x64 prebuilt is
# installed; nothing is downloaded or compiled by the package's postinstall.
set -euo pipefail
cd "$(dirname "$0")/../tests/oracle"
if [ -f node_modules/node-llama-cpp/package.json ] && \
   grep -q '"version": "3.21.1"' node_modules/node-llama-cpp/package.json && \
   [ -d node_modules/@node-llama-cpp/linux-x64/bins ]; then
  exit 0
fi
echo "install-oracle: npm ci (node-llama-cpp 3.21.1, test-only)"
NODE_LLAMA_CPP_SKIP_DOWNLOAD=true npm ci --omit=optional --no-audit --no-fund --ignore-scripts >/dev/null
