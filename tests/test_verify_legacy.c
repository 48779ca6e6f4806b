/* kv-test-labels: unit attack
 * The Freivalds checks of tests/test_verify.c (every case: honest answers
 * pass, structured lies are caught, backends and orders agree) on models of
 * Q4_1, Q5_1 and MXFP4. Q4_1 and Q5_1 take Q8_1 activations whose block sum
 * s is rounded to fp16, so the kernel's min term m*s is not what the
 * dequantized operands give (m*d*sum(qs)); the check models it exactly
 * (src/verify/verify.c, kv_verify_min_term): without that, honest answers
 * sat at 370-400x the tolerance. */
#define KV_TEST_VERIFY_TYPES {"q4_1", "q5_1", "mxfp4"}
#include "test_verify.c"
