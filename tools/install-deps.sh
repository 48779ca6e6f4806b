#!/usr/bin/env bash
# Installs the build and test tools Kvasir needs when they are missing
# (Debian packages via apt-get). Idempotent and quiet when all is present.
set -euo pipefail
need=()
have() { command -v "$1" >/dev/null 2>&1; }
have cmake || need+=(cmake)
have gcc || need+=(gcc)
have make || need+=(make)
have clang || need+=(clang)
have node || need+=(nodejs)
have npm || need+=(npm)
have pkg-config || need+=(pkg-config)
have jq || need+=(jq)
have python3 || need+=(python3)
# the hub's status page is tested in a real browser (tests/test_hub_status.sh)
have chromium || need+=(chromium)
have chromedriver || need+=(chromium-driver)
have tc || need+=(iproute2) # ip netns, veth and tc netem for bench/ring.sh
# libraries (Debian -dev packages), found by their headers
[ -f /usr/include/sodium.h ] || need+=(libsodium-dev)
[ -f /usr/include/jansson.h ] || need+=(libjansson-dev)
[ -f /usr/include/openssl/evp.h ] || need+=(libssl-dev)
[ -f /usr/include/microhttpd.h ] || need+=(libmicrohttpd-dev)
[ -f /usr/include/sqlite3.h ] || need+=(libsqlite3-dev)
[ -f /usr/include/x86_64-linux-gnu/curl/curl.h ] || [ -f /usr/include/curl/curl.h ] || need+=(libcurl4-openssl-dev)
# PostgreSQL stores: libpq to build them, the server (initdb, pg_ctl, psql)
# for the tests, which start a throw-away cluster (tests/pg_env.sh)
[ -f /usr/include/postgresql/libpq-fe.h ] || need+=(libpq-dev)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && have psql || need+=(postgresql)
# libFuzzer and sanitizer runtimes for clang
if have clang; then
  rt=$(clang -print-resource-dir 2>/dev/null)/lib/linux/libclang_rt.fuzzer-x86_64.a
  [ -f "$rt" ] || need+=(libclang-rt-14-dev)
else
  need+=(libclang-rt-14-dev)
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "install-deps: installing ${need[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
