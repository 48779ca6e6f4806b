/* Tiny test macros shared by the unit tests (one executable per module).
 * A failed check prints file:line and the values, and the test exits 1 at
 * the end (KV_TEST_END) so every failure in a run is shown. */
#ifndef KVASIR_KVTEST_H
#define KVASIR_KVTEST_H

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int kvt_failures = 0;
static int kvt_checks = 0;

#define KVT_FAIL(...)                                            \
    do {                                                         \
        kvt_failures++;                                          \
        fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);     \
        fprintf(stderr, __VA_ARGS__);                            \
        fputc('\n', stderr);                                     \
    } while (0)

#define ASSERT_TRUE(c)                                           \
    do {                                                         \
        kvt_checks++;                                            \
        if (!(c)) KVT_FAIL("expected true: %s", #c);             \
    } while (0)

#define ASSERT_EQ(a, b)                                                              \
    do {                                                                             \
        kvt_checks++;                                                                \
        long long kvt_a = (long long)(a), kvt_b = (long long)(b);                    \
        if (kvt_a != kvt_b) KVT_FAIL("%s == %s: %lld != %lld", #a, #b, kvt_a, kvt_b); \
    } while (0)

#define ASSERT_NE(a, b)                                                              \
    do {                                                                             \
        kvt_checks++;                                                                \
        long long kvt_a = (long long)(a), kvt_b = (long long)(b);                    \
        if (kvt_a == kvt_b) KVT_FAIL("%s != %s: both %lld", #a, #b, kvt_a);          \
    } while (0)

#define ASSERT_STREQ(a, b)                                                           \
    do {                                                                             \
        kvt_checks++;                                                                \
        const char *kvt_a = (a), *kvt_b = (b);                                       \
        if (!kvt_a || !kvt_b || strcmp(kvt_a, kvt_b))                               \
            KVT_FAIL("%s == %s: \"%s\" != \"%s\"", #a, #b, kvt_a ? kvt_a : "(null)", \
                     kvt_b ? kvt_b : "(null)");                                      \
    } while (0)

#define ASSERT_NEAR(a, b, tol)                                                       \
    do {                                                                             \
        kvt_checks++;                                                                \
        double kvt_a = (double)(a), kvt_b = (double)(b);                             \
        if (!(fabs(kvt_a - kvt_b) <= (tol)))                                         \
            KVT_FAIL("%s ~ %s: %.9g vs %.9g (tol %g)", #a, #b, kvt_a, kvt_b, (double)(tol)); \
    } while (0)

#define KV_TEST_END()                                                                \
    do {                                                                             \
        if (kvt_checks == 0) {                                                       \
            fprintf(stderr, "FAIL: no checks ran\n");                                \
            return 1;                                                                \
        }                                                                            \
        printf("%d checks, %d failed\n", kvt_checks, kvt_failures);                  \
        return kvt_failures ? 1 : 0;                                                 \
    } while (0)

#endif
