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

/* ---- named cases ----------------------------------------------------------
 * A test file lists its cases in a table and main() calls kvt_run():
 *
 *   static const kvt_case cases[] = { KVT_CASE(test_header), KVT_CASE(test_hello) };
 *   int main(int argc, char **argv) { return kvt_run(argc, argv, cases, KVT_N(cases)); }
 *
 * `./test_x` runs every case in order; `./test_x NAME...` runs only those
 * (a name that matches no case is a failure, so a typo cannot pass);
 * `./test_x --list` prints the names. Setup shared by several cases goes in
 * a case of its own that the others need, or in kvt_setup/kvt_teardown
 * passed to kvt_run_with. The run ends with the usual "N checks, M failed"
 * line and exits non-zero on any failure or when no check ran. */
typedef struct kvt_case {
    const char *name;
    void (*fn)(void);
} kvt_case;
#define KVT_CASE(fn) {#fn, fn}
#define KVT_N(a) (sizeof(a) / sizeof((a)[0]))

static inline int kvt_run_with(int argc, char **argv, const kvt_case *cases, size_t n,
                        int (*setup)(void), void (*teardown)(void)) {
    if (argc > 1 && !strcmp(argv[1], "--list")) {
        for (size_t i = 0; i < n; i++) printf("%s\n", cases[i].name);
        return 0;
    }
    for (int a = 1; a < argc; a++) {
        size_t i = 0;
        while (i < n && strcmp(cases[i].name, argv[a])) i++;
        if (i == n) {
            fprintf(stderr, "FAIL: no case named '%s' (--list shows them)\n", argv[a]);
            return 1;
        }
    }
    if (setup && setup()) {
        fprintf(stderr, "FAIL: test setup failed\n");
        return 1;
    }
    for (size_t i = 0; i < n; i++) {
        int want = argc <= 1;
        for (int a = 1; a < argc && !want; a++) want = !strcmp(cases[i].name, argv[a]);
        if (!want) continue;
        int before = kvt_failures;
        cases[i].fn();
        printf("case %s: %s\n", cases[i].name, kvt_failures == before ? "ok" : "FAILED");
        fflush(stdout);
    }
    if (teardown) teardown();
    KV_TEST_END();
}
static inline int kvt_run(int argc, char **argv, const kvt_case *cases, size_t n) {
    return kvt_run_with(argc, argv, cases, n, NULL, NULL);
}

/* A kernel backend a test could not exercise on this CPU: say so, and fail
 * when KV_REQUIRE_BACKENDS (comma-separated, e.g. "avx2,avx512") names it,
 * so a machine that should run it cannot pass by skipping. */
static inline void kvt_skip_backend(const char *backend, const char *why) {
    const char *req = getenv("KV_REQUIRE_BACKENDS");
    int required = 0;
    if (req) {
        size_t bl = strlen(backend);
        for (const char *p = req; *p;) {
            const char *e = strchr(p, ',');
            size_t l = e ? (size_t)(e - p) : strlen(p);
            if (l == bl && !strncmp(p, backend, l)) required = 1;
            p += l + (e ? 1 : 0);
        }
    }
    if (required) {
        kvt_checks++;
        KVT_FAIL("backend %s is required (KV_REQUIRE_BACKENDS) but skipped: %s", backend, why);
    } else {
        printf("SKIP backend %s: %s\n", backend, why);
    }
}

#endif
