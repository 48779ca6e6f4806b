#!/usr/bin/env bash
# Installs the test-only llama.cpp oracle (npm node-llama-cpp, pinned) and the
# official openai and @anthropic-ai/sdk clients the gateway is tested with
# and the reference Jinja of chat templates, @huggingface/jinja, and the JSON-schema
# validator of structured output, ajv (all pinned)
# into tests/oracle/node_modules when missing. Only the CPU linux-x64 prebuilt is
# installed; nothing is downloaded or compiled by the package's postinstall.
set -euo pipefail
cd "$(dirname "$0")/../tests/oracle"
if [ -f node_modules/node-llama-cpp/package.json ] && \
   grep -q '"version": "3.21.1"' node_modules/node-llama-cpp/package.json && \
   [ -d node_modules/@node-llama-cpp/linux-x64/bins ] && \
   grep -q '"version": "6.30.1"' node_modules/openai/package.json 2>/dev/null && \
   grep -q '"version": "1.15.0"' node_modules/@anthropic-ai/sdk/package.json 2>/dev/null && \
   grep -q '"version": "0.5.11"' node_modules/@huggingface/jinja/package.json 2>/dev/null && \
   grep -q '"version": "8.20.0"' node_modules/ajv/package.json 2>/dev/null; then
  exit 0
fi
echo "install-oracle: npm ci (node-llama-cpp 3.21.1, openai 6.30.1, @anthropic-ai/sdk 1.15.0, @huggingface/jinja 0.5.11, ajv 8.20.0; test-only)"
NODE_LLAMA_CPP_SKIP_DOWNLOAD=true npm ci --omit=optional --no-audit --no-fund --ignore-scripts >/dev/null
