#!/usr/bin/env bash
# A throw-away PostgreSQL server for the tests, from Debian's postgresql
# package (tools/install-deps.sh installs it): a fresh cluster in a
# temporary folder, run as an unprivileged user (kvpg, created when missing,
# when we are root; else the current user), listening only on a unix socket
# in that folder (no TCP port, so parallel tests never collide), fsync off
# (the tests kill clients, never the machine). Not a test itself.
#
#   source tests/pg_env.sh
#   kv_pg_start            # sets KV_PG_DIR and KV_PG (a libpq conninfo to
#                          # database "postgres" as superuser "kvasir")
#   kv_pg_createdb NAME    # prints the store URI "pg:<conninfo> dbname=NAME"
#   kv_pg_pause, kv_pg_resume  # an outage: stop the server, start it again
#   kv_pg_stop             # stops the server and removes the folder
#
# Every failure says what is missing and returns non-zero: a PostgreSQL test
# without a server fails, it never passes by skipping.

kv_pg_bin() {
  local d
  d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)
  if [ -z "$d" ] || [ ! -x "$d/initdb" ] || [ ! -x "$d/pg_ctl" ]; then
    echo "pg_env: PostgreSQL server binaries not found in /usr/lib/postgresql/*/bin (apt-get install postgresql; tools/install-deps.sh)" >&2
    return 1
  fi
  echo "$d"
}

# kv_pg_as CMD...: runs CMD as the unprivileged owner of the cluster
kv_pg_as() {
  if [ "$(id -u)" = 0 ]; then
    setpriv --reuid=kvpg --regid=kvpg --init-groups -- "$@"
  else
    "$@"
  fi
}

kv_pg_start() {
  local bin
  bin=$(kv_pg_bin) || return 1
  command -v psql >/dev/null || { echo "pg_env: psql not found (apt-get install postgresql-client)" >&2; return 1; }
  if [ "$(id -u)" = 0 ] && ! id kvpg >/dev/null 2>&1; then
    useradd --system --no-create-home --shell /usr/sbin/nologin kvpg 2>/dev/null || id kvpg >/dev/null 2>&1 ||
      { echo "pg_env: cannot create user kvpg" >&2; return 1; }
  fi
  KV_PG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvpg.XXXXXX") || return 1
  chmod 0755 "$KV_PG_DIR"
  [ "$(id -u)" = 0 ] && chown kvpg:kvpg "$KV_PG_DIR"
  if ! kv_pg_as "$bin/initdb" -D "$KV_PG_DIR/data" -U kvasir --auth=trust -E UTF8 --no-sync >"$KV_PG_DIR/initdb.log" 2>&1; then
    echo "pg_env: initdb failed: $(tail -3 "$KV_PG_DIR/initdb.log")" >&2
    return 1
  fi
  KV_PG="host=$KV_PG_DIR user=kvasir dbname=postgres"
  export KV_PG_DIR KV_PG
  kv_pg_resume
}

# kv_pg_pause / kv_pg_resume: stop the server (immediate: clients lose their
# connections) and start it again on the same data, for outage tests
kv_pg_resume() {
  local bin
  bin=$(kv_pg_bin) || return 1
  if ! kv_pg_as "$bin/pg_ctl" -D "$KV_PG_DIR/data" -w -t 60 -l "$KV_PG_DIR/server.log" \
      -o "-c listen_addresses='' -c unix_socket_directories='$KV_PG_DIR' -c fsync=off -c full_page_writes=off -c max_connections=200 -c shared_buffers=32MB" \
      start >/dev/null 2>&1; then
    echo "pg_env: the server did not start: $(tail -3 "$KV_PG_DIR/server.log" 2>/dev/null)" >&2
    return 1
  fi
}
kv_pg_pause() {
  local bin
  bin=$(kv_pg_bin) || return 1
  kv_pg_as "$bin/pg_ctl" -D "$KV_PG_DIR/data" -m immediate -w stop >/dev/null 2>&1
}

kv_pg_createdb() {
  psql -X -q -v ON_ERROR_STOP=1 "$KV_PG" -c "CREATE DATABASE \"$1\"" >/dev/null || return 1
  echo "pg:host=$KV_PG_DIR user=kvasir dbname=$1"
}

kv_pg_stop() {
  [ -n "${KV_PG_DIR:-}" ] || return 0
  local bin
  bin=$(kv_pg_bin 2>/dev/null) && [ -d "$KV_PG_DIR/data" ] &&
    kv_pg_as "$bin/pg_ctl" -D "$KV_PG_DIR/data" -m immediate -w stop >/dev/null 2>&1
  rm -rf "$KV_PG_DIR"
  KV_PG_DIR=
}
