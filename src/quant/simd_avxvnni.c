/* AVX2 + AVX-VNNI kernels (Intel client CPUs from Alder Lake on, AMD Zen 5;
 * compiled with -mavx2 -mfma -mf16c -mbmi2 -mavxvnni, only called after
 * run-time detection): simd_avx2.c compiled again with its integer steps
 * by vpdpbusd and vpdpwssd (I8DOT, I16DOT there). They give the integers
 * the AVX2 forms give, so every kernel keeps the AVX2 kernel's bits, the
 * scalar reference's. A Q8_0 or Q4_0 product then takes one multiply-pipe
 * operation instead of two (vpmaddubsw + vpmaddwd); the K-quants save an
 * add per sub-block. The float kernels (attention, softmax, delta rule)
 * are the AVX2 file's. */
#define KV_AVX2_VNNI 1
#include "simd_avx2.c"
