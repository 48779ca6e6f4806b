/* libFuzzer target for the PostgreSQL column readers (src/pg/pq.h): a row
 * read back from a shared database is untrusted input, like a file. The
 * first input byte picks a reader (integer, bounded text, exact or bounded
 * bytea), the second its bound, the rest is the cell as the server would
 * send it in text format. Whatever is accepted must be within the bound and
 * equal an independent decoding (strtoll, a naive hex loop); a refusal must
 * be KV_EFORMAT with a message. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pg/pq.h"

#define CHECK(x)                    \
    do {                            \
        if (!(x)) __builtin_trap(); \
    } while (0)

static int hexv(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2 || size > 4096) return 0;
    int which = data[0] % 4;
    size_t bound = data[1];
    const char *cell = (const char *)data + 2;
    int len = (int)(size - 2);
    PGresult *r = PQmakeEmptyPGresult(NULL, PGRES_TUPLES_OK);
    CHECK(r);
    PGresAttDesc att = {.name = (char *)"c", .format = 0, .typid = 25, .typlen = -1, .atttypmod = -1};
    CHECK(PQsetResultAttrs(r, 1, &att));
    CHECK(PQsetvalue(r, 0, 0, (char *)cell, len));
    kv_diag d = {0};
    int rc;
    if (which == 0) {
        int64_t lo = -(int64_t)bound * 1000, hi = (int64_t)bound * 1000, v = 0;
        rc = kv_pq_i64(r, 0, 0, lo, hi, &v, &d, "fuzz", "cell");
        if (!rc) {
            CHECK(v >= lo && v <= hi);
            /* the reference: [-]digits only, the value by hand */
            int i = cell[0] == '-';
            CHECK(len > i);
            long long ref = 0;
            for (int k = i; k < len; k++) {
                CHECK(cell[k] >= '0' && cell[k] <= '9');
                ref = ref * 10 + (cell[k] - '0');
                CHECK(ref <= (long long)1 << 40); /* the bounds are far below */
            }
            CHECK((i ? -ref : ref) == v);
        }
    } else if (which == 1) {
        char out[256];
        size_t cap = bound ? bound : 1;
        rc = kv_pq_text(r, 0, 0, out, cap, &d, "fuzz", "cell");
        if (!rc) CHECK(strlen(out) < cap && (int)strlen(out) <= len && !memcmp(out, cell, strlen(out)));
    } else {
        uint8_t out[256];
        size_t got = 0;
        rc = kv_pq_bytea(r, 0, 0, out, bound, which == 3 ? &got : NULL, &d, "fuzz", "cell");
        if (!rc) {
            size_t n = which == 3 ? got : bound;
            CHECK(n <= bound && len == (int)(2 + 2 * n) && cell[0] == '\\' && cell[1] == 'x');
            for (size_t i = 0; i < n; i++) {
                int hi = hexv(cell[2 + 2 * i]), lo = hexv(cell[3 + 2 * i]);
                CHECK(hi >= 0 && lo >= 0 && out[i] == (uint8_t)(hi << 4 | lo));
            }
        }
    }
    if (rc) CHECK(rc == KV_EFORMAT && d.msg[0]);
    PQclear(r);
    return 0;
}
