#!/usr/bin/env bash
# kv-test-labels: net unit
# The store tests again, against PostgreSQL (a throw-away server from
# tests/pg_env.sh): the hub store interface against its reference model,
# with racing connections and a nonce shared by two connections
# (test_hub_store); every hub case that writes or reads the store, through
# the real `kvasir hub` process, plus two hubs on one database (test_hub);
# the market's demand state and budgets, and two hubs agreeing on them
# (test_hub_market); the ledger's transfer ids,
# invariant checks, attacks and concurrent spends across threads
# (test_ledger) and across processes, the SIGKILL crash loop and the CLI
# (test_ledger_proc). The 10,000-operation load case stays on SQLite here
# (about a minute on PostgreSQL on a loaded 2-core machine).
# Fails, never skips, when PostgreSQL or libpq support is missing.
set -euo pipefail
src=${KV_SRC:-$(cd "$(dirname "$0")/.." && pwd)}
build=${KV_BUILD:-$src/build}
export KV_BIN=${KV_BIN:-$build/kvasir}
# shellcheck source=pg_env.sh
source "$src/tests/pg_env.sh"
trap kv_pg_stop EXIT
kv_pg_start || { echo "FAIL: no PostgreSQL server (tools/install-deps.sh installs postgresql)" >&2; exit 1; }
export KV_TEST_PG="host=$KV_PG_DIR user=kvasir"
run() { # NAME ARGS...: one test binary, its tail on failure
  local name=$1
  shift
  if ! "$build/$name" "$@" >"$KV_PG_DIR/$name.log" 2>&1; then
    tail -30 "$KV_PG_DIR/$name.log" >&2
    echo "FAIL: $name against PostgreSQL" >&2
    exit 1
  fi
  echo "ok: $name against PostgreSQL ($(tail -1 "$KV_PG_DIR/$name.log"))"
}
KV_TEST_PG_URI=$(kv_pg_createdb kv_hub_store) run test_hub_store
run test_hub test_register_market_placement test_deadline test_restart test_bad_requests test_challenge \
  test_store_of_other_model test_challenge_schedule test_report test_two_hubs_one_store
run test_hub_market test_store_market_and_budgets test_demand_raises_and_falls test_restart_keeps_market test_liar test_two_hubs_demand
run test_ledger test_transfer_ids test_check_detects test_issue_operator_only test_escrow_settle_release \
  test_attack_replay test_attack_receipts test_attack_concurrent_threads test_store_rows_checked
run test_ledger_proc
