/* OpenCL expert backend: an expert provider (kvasir/moe.h) that computes the
 * routed-expert FFN matrices on an OpenCL device, for every compute tensor
 * type (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, Q2_K,
 * Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS), gpt-oss's biased, clamped experts
 * included.
 *
 * The host quantizes the activations exactly as the CPU path does
 * (kv_quantize_rows) and applies the biases and the activation (SwiGLU or
 * the clamped SwiGLU) on the host; the device computes
 * every (row, token) dot product of gate, up and down in the canonical
 * reduction order (src/opencl/cl_kernels.h). Its output is therefore meant
 * to have the scalar reference's bits; tests/test_opencl.c checks it on
 * PoCL, and the coordinator still holds it to the stated tolerance
 * (docs/NUMERICS.md) like any other backend.
 *
 * Built when CMake finds OpenCL headers and the ICD loader
 * (ocl-icd-opencl-dev, opencl-headers); otherwise every call reports
 * KV_EUNSUPPORTED. */
#ifndef KVASIR_OPENCL_H
#define KVASIR_OPENCL_H

#include <stdbool.h>
#include <stdint.h>

#include "kvasir/err.h"
#include "kvasir/moe.h"

/* True if this build has OpenCL and a device can be opened; fills name
 * (device and platform, for logs and the handshake) when non-NULL. */
bool kv_opencl_available(char *name, size_t cap);

/* A provider computing src's experts on the first OpenCL device (GPU
 * preferred, else any). Weights are uploaded on first use of an expert
 * and kept on the device; at most max_tokens tokens per request. Returns
 * 0 or KV_EUNSUPPORTED (no OpenCL, no device, kernel build failed: d says
 * which), KV_ENOMEM. The provider's free() releases everything. One
 * compute() at a time. */
int kv_opencl_expert_new(kv_expert_provider *out, const kv_expert_source *src, uint32_t max_tokens,
                         kv_diag *d);

/* compute() of an OpenCL provider that also copies the gate and up
 * products (before their biases and the activation) of every (token,
 * rank) slot into gate and up [n_tokens * n_used][n_ff], as
 * kv_expert_local_compute_pre does for the CPU provider: what a verifier
 * checks (kvasir/verify.h). KV_EINVAL for another provider. */
int kv_opencl_expert_compute_pre(const kv_expert_provider *p, const kv_expert_req *req, float *out, float *gate,
                                 float *up, kv_diag *d);

#endif
