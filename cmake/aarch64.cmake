# Cross-compiling Kvasir for aarch64 Linux from an x86-64 Debian machine:
#   cmake -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64.cmake
# Needs gcc-aarch64-linux-gnu and the arm64 -dev packages of the libraries
# (dpkg --add-architecture arm64; tools/install-deps.sh --arm installs both).
# The arm64 libraries live in Debian's multiarch directories
# (/usr/lib/aarch64-linux-gnu), which the cross gcc searches. Binaries and
# tests run under qemu-user: ctest uses CMAKE_CROSSCOMPILING_EMULATOR.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
# pkg-config must see the arm64 .pc files only, never the host's
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")
# The emulator runs with `-L /`: the multiarch loader of libc6:arm64
# (/lib/ld-linux-aarch64.so.1) must load its own libc.so.6, and `-L /`
# turns off every other prefix qemu would take (QEMU_LD_PREFIX, Debian's
# default /etc/qemu-binfmt/aarch64). With a prefix of
# /usr/aarch64-linux-gnu (the usual cross recipe) qemu loads that tree's
# ld.so (libc6-arm64-cross) but libc.so.6 from the multiarch directory
# (libc6:arm64), two builds of glibc that share private loader state:
# pthread_create then walks the loader's stack-cache list forever (100%
# CPU, no system call), so every run with a second thread hangs while
# `--threads 1 --no-prefault` finishes. A five-line pthread program hangs
# the same way; real ARM systems load one glibc and are not affected.
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /)
