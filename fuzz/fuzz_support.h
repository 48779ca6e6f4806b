/* What the fuzz targets of the hub's and the node's parsers share
 * (fuzz/fuzz_hub_*.c, fuzz/fuzz_node_*.c): CHECK, an invariant that traps
 * (libFuzzer reports the input) in every build, and the exact-size copy of
 * the input the parsers read, so that a read past the end is an ASan error
 * rather than a read of libFuzzer's slack. Header-only. */
#ifndef KVASIR_FUZZ_SUPPORT_H
#define KVASIR_FUZZ_SUPPORT_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(x)                    \
    do {                            \
        if (!(x)) __builtin_trap(); \
    } while (0)

/* A heap copy of data[0..size) of exactly size bytes (one byte when size is
 * 0, none of it readable by a parser told 0); traps when out of memory.
 * The caller frees. */
static inline char *fuzz_copy(const uint8_t *data, size_t size) {
    char *buf = malloc(size ? size : 1);
    CHECK(buf);
    memcpy(buf, data, size);
    return buf;
}

#endif
