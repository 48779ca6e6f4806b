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
have curl || need+=(curl)
have python3 || need+=(python3)
# an independent Ed25519 for hand-made hub vouchers (tests/test_ring_vouch.sh)
python3 -c 'import cryptography.hazmat.primitives.asymmetric.ed25519' 2>/dev/null || need+=(python3-cryptography)
# the plot of bench/autoscale.sh (Debian's python3, where apt installs it)
/usr/bin/python3 -c 'import matplotlib' 2>/dev/null || need+=(python3-matplotlib)
# the hub's status page is tested in a real browser (tests/test_hub_status.sh)
have chromium || need+=(chromium)
have chromedriver || need+=(chromium-driver)
have tc || need+=(iproute2) # ip netns, veth and tc netem for bench/ring.sh
have ping || need+=(iputils-ping) # the reference RTT of tests/test_netdelay.sh
have nft || need+=(nftables)        # the home router's masquerade in tests/netns_topo.sh
have tcpdump || need+=(tcpdump)     # captures inside the WAN test bed's namespaces
have openssl || need+=(openssl) # the independent TLS reference of tests/test_tls.c (s_client, x509)
# libraries (Debian -dev packages), found by their headers
[ -f /usr/include/sodium.h ] || need+=(libsodium-dev)
[ -f /usr/include/jansson.h ] || need+=(libjansson-dev)
# libcrypto (hashes) and libssl (TLS 1.3 of the link layer)
[ -f /usr/include/openssl/evp.h ] && [ -f /usr/include/openssl/ssl.h ] || need+=(libssl-dev)
[ -f /usr/include/microhttpd.h ] || need+=(libmicrohttpd-dev)
[ -f /usr/include/sqlite3.h ] || need+=(libsqlite3-dev)
[ -f /usr/include/x86_64-linux-gnu/curl/curl.h ] || [ -f /usr/include/curl/curl.h ] || need+=(libcurl4-openssl-dev)
# PostgreSQL stores: libpq to build them, the server (initdb, pg_ctl, psql)
# for the tests, which start a throw-away cluster (tests/pg_env.sh)
[ -f /usr/include/postgresql/libpq-fe.h ] || need+=(libpq-dev)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && have psql || need+=(postgresql)
# the OpenCL expert backend: headers, the ICD loader, PoCL (a CPU OpenCL
# device, so its tests run on any machine) and clinfo (tools/cpu-backends.sh)
[ -f /usr/include/CL/cl.h ] || need+=(opencl-headers)
[ -f /usr/lib/x86_64-linux-gnu/libOpenCL.so ] || [ -f /usr/lib/libOpenCL.so ] || need+=(ocl-icd-opencl-dev)
[ -n "$(ls /etc/OpenCL/vendors/pocl*.icd 2>/dev/null)" ] || need+=(pocl-opencl-icd)
have clinfo || need+=(clinfo)
# libFuzzer and sanitizer runtimes for clang
if have clang; then
  rt=$(clang -print-resource-dir 2>/dev/null)/lib/linux/libclang_rt.fuzzer-x86_64.a
  [ -f "$rt" ] || need+=(libclang-rt-14-dev)
else
  need+=(libclang-rt-14-dev)
fi
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
updated=0
install() { # PACKAGE...: apt-get install, one update per run
  echo "install-deps: installing $*"
  [ "$updated" = 1 ] || $SUDO apt-get update -qq
  updated=1
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
}
if [ ${#need[@]} -gt 0 ]; then
  install "${need[@]}"
fi

# The aarch64 build and its emulation (make arm, make test-arm, and the short
# ARM scenario of make test): Debian's cross compiler, the arm64 -dev
# packages of every library (multiarch: they co-install with the amd64 ones)
# (libc6:arm64 among them: its loader lets `qemu-aarch64 -L / BINARY` run
# the binary; no binfmt registration needed) and qemu-user. Never with
# `-L /usr/aarch64-linux-gnu`: that loader is another glibc build than
# libc6:arm64's libc.so.6, and the pair hangs in pthread_create
# (cmake/aarch64.cmake).
arm_deps() {
  local arm=()
  have aarch64-linux-gnu-gcc || arm+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
  have qemu-aarch64 || arm+=(qemu-user)
  local lib=/usr/lib/aarch64-linux-gnu
  [ -f /usr/include/aarch64-linux-gnu/curl/curl.h ] || arm+=(libcurl4-openssl-dev:arm64)
  [ -f $lib/pkgconfig/libsodium.pc ] || arm+=(libsodium-dev:arm64)
  [ -f $lib/pkgconfig/jansson.pc ] || arm+=(libjansson-dev:arm64)
  [ -f $lib/pkgconfig/libcrypto.pc ] && [ -f $lib/pkgconfig/libssl.pc ] || arm+=(libssl-dev:arm64)
  [ -f $lib/pkgconfig/libmicrohttpd.pc ] || arm+=(libmicrohttpd-dev:arm64)
  [ -f $lib/pkgconfig/sqlite3.pc ] || arm+=(libsqlite3-dev:arm64)
  # not libpq-dev:arm64: it is not Multi-Arch "same" in Debian 12, and apt
  # would remove the amd64 libpq-dev to install it; the aarch64 build goes
  # without the PostgreSQL stores (the node path does not use them)
  [ -e /lib/ld-linux-aarch64.so.1 ] || arm+=(libc6:arm64)
  [ ${#arm[@]} -gt 0 ] || return 0
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    $SUDO dpkg --add-architecture arm64
    updated=0
  fi
  install "${arm[@]}"
}
for a in "$@"; do
  case "$a" in
  --arm) arm_deps ;;
  *) echo "install-deps: unknown option $a" >&2; exit 2 ;;
  esac
done
