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
# No -L: the arm64 -dev packages pull in libc6:arm64, whose loader
# (/lib/ld-linux-aarch64.so.1) finds the multiarch arm64 libraries. With
# `-L /usr/aarch64-linux-gnu` qemu-user 7.2 hangs in the first
# pthread_create (seen on Debian 12), so the prefix is not used.
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64)
