/* kv-test-labels: unit
 * The WAN cost model's function (kv_plan_cost_ms, include/kvasir/plan.h,
 * docs/WAN.md "The model") against figures worked out by hand, and against
 * the bench's copy of the same formula (bench/wan_lib.sh wcm_predict, run
 * through bash), so that `kvasir plan` and `make bench-wan` predict alike:
 * - no line cost: round trips + bytes at the link's rate + compute;
 * - a line cost per crossing larger than the bytes' time at the rate
 *   (an unlimited link, or 1 Gbit/s for 42 kB): the line's time counts;
 * - a slower rate than the line (10 Mbit/s): the rate's time counts, the
 *   line's adds nothing (the larger of the two, not their sum). */
#include <stdio.h>
#include <stdlib.h>

#include "kvasir/plan.h"
#include "kvtest.h"

/* One crossing of bench/wan.sh's model (8 layers, embd 2048, top-4 of 16):
 * an 8260-byte COMPUTE and a 32860-byte RESULT, on the wire with TLS records
 * (22 bytes per 16 KiB) and 52 bytes per 1448-byte packet. */
#define REQ_WIRE (8260 + 22 + 52 * 6)
#define RESP_WIRE (32860 + 66 + 52 * 23)

static double wcm_predict_ms(const char *args) {
    const char *src = getenv("KV_SRC");
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "bash -c '. \"%s/bench/wan_lib.sh\" && wcm_predict %s'", src ? src : ".", args);
    FILE *f = popen(cmd, "r");
    if (!f) return -1;
    double s = -1;
    if (fscanf(f, "%lf", &s) != 1) s = -1;
    pclose(f);
    return s * 1000;
}

static void test_by_hand(void) {
    kv_plan_cost c = {.crossings = 8, .wait_ms = 8 * 0.066, .wan_bytes = 8 * (REQ_WIRE + RESP_WIRE),
                      .bandwidth_mbit = 0, .compute_ms = 7.42};
    /* no line cost, unlimited: round trips and compute */
    ASSERT_NEAR(kv_plan_cost_ms(&c), 8 * 0.066 + 7.42, 1e-9);
    /* a line of 0.39 ms per crossing on an unlimited link */
    c.line_ms = 0.39;
    ASSERT_NEAR(kv_plan_cost_ms(&c), 8 * 0.066 + 8 * 0.39 + 7.42, 1e-9);
    /* 1 Gbit/s: 42,716 bytes take 0.342 ms, less than the line's 0.39 */
    c.bandwidth_mbit = 1000;
    ASSERT_NEAR(kv_plan_cost_ms(&c), 8 * 0.066 + 8 * 0.39 + 7.42, 1e-9);
    /* 10 Mbit/s: 34.17 ms a crossing, the rate's time alone */
    c.bandwidth_mbit = 10;
    const double ser = 8.0 * (REQ_WIRE + RESP_WIRE) * 8 / 10e6 * 1e3;
    ASSERT_NEAR(ser / 8, 34.1728, 1e-4);
    ASSERT_NEAR(kv_plan_cost_ms(&c), 8 * 0.066 + ser + 7.42, 1e-9);
    /* a negative or zero line cost is none */
    c.line_ms = -5;
    ASSERT_NEAR(kv_plan_cost_ms(&c), 8 * 0.066 + ser + 7.42, 1e-9);
}

static void test_vs_bench(void) {
    static const struct {
        const char *args; /* T_C ROUNDS BREQ BRESP RTT_MS RATE_KBIT LINE_MS */
        double tc_ms, rtt_ms, mbit, line_ms;
    } rows[] = {
        {"0.00742 8 8260 32860 0.066 0 0.39", 7.42, 0.066, 0, 0.39},
        {"0.00742 8 8260 32860 0.084 1000000 0.39", 7.42, 0.084, 1000, 0.39},
        {"0.00742 8 8260 32860 0.084 1000000 0", 7.42, 0.084, 1000, 0},
        {"0.00742 8 8260 32860 40.3 100000 0.39", 7.42, 40.3, 100, 0.39},
        {"0.010 8 8260 32860 40 10000 0.39", 10, 40, 10, 0.39},
    };
    for (size_t i = 0; i < KVT_N(rows); i++) {
        kv_plan_cost c = {.crossings = 8, .wait_ms = 8 * rows[i].rtt_ms, .wan_bytes = 8 * (REQ_WIRE + RESP_WIRE),
                          .bandwidth_mbit = rows[i].mbit, .compute_ms = rows[i].tc_ms, .line_ms = rows[i].line_ms};
        const double bench = wcm_predict_ms(rows[i].args);
        ASSERT_TRUE(bench > 0);
        /* wcm_predict prints microseconds' precision */
        ASSERT_NEAR(kv_plan_cost_ms(&c), bench, 1e-3);
    }
}

static const kvt_case cases[] = {KVT_CASE(test_by_hand), KVT_CASE(test_vs_bench)};
int main(int argc, char **argv) { return kvt_run(argc, argv, cases, KVT_N(cases)); }
