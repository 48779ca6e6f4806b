/* kv-test-labels: unit attack
 * The Freivalds checks of tests/test_verify.c (honest answers pass, structured
 * lies are caught, backends, orders and batches agree) on gpt-oss experts of
 * F32, Q8_0 and MXFP4: biases on gate, up and down, and the clamped SwiGLU
 * between them. The worker answers gate and up before their biases; the
 * verifier adds them, applies the clamped activation as the engine does and
 * takes down's projected bias off r . y (docs/VERIFY.md, "Biases"). Beside
 * those cases: the clamp is met, and a worker that skips the clamp, down's
 * bias or gate's and up's is caught wherever its output is off by theta x
 * the tolerance (test_gptoss). */
#define KV_TEST_VERIFY_TYPES {"f32", "q8_0", "mxfp4"}
#define KV_TEST_VERIFY_ARCH "--arch gpt-oss --heads 4 --kv-heads 2 --head-dim 64"
#define KV_TEST_VERIFY_GPTOSS 1
#include "test_verify.c"
