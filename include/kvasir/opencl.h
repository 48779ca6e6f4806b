/* OpenCL expert backend: an expert provider (kvasir/moe.h) that computes the
 * routed-expert FFN matrices on an OpenCL device, for every compute tensor
 * type (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K).
 *
 * The host quantizes the activations exactly as the CPU path does
 * (kv_quantize_rows) and applies SwiGLU on the host; the device computes
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

#endif
