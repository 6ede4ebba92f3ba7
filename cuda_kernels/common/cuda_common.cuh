// Helpers for the CUDA C-interface library (libmxfusion_cuda.so).
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

// Every launcher returns 0 on success, else a cudaError_t value (or -1 for bad args).
#define MXF_CUDA_RETURN_LAST() return static_cast<int>(cudaGetLastError())

namespace mxf_cuda {

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Activation codes shared with the CPU op's `act` attribute (same order).
enum ActCode { ACT_NONE = 0, ACT_RELU, ACT_SIGMOID, ACT_TANH, ACT_SOFTRELU, ACT_LEAKY,
               ACT_GELU_ERF, ACT_GELU_TANH };

__device__ __forceinline__ float apply_act(int act, float x, float slope) {
  switch (act) {
    case ACT_RELU: return x > 0.f ? x : 0.f;
    case ACT_SIGMOID: return 1.f / (1.f + expf(-x));
    case ACT_TANH: return tanhf(x);
    case ACT_SOFTRELU: return x > 20.f ? x : log1pf(expf(x));
    case ACT_LEAKY: return x > 0.f ? x : slope * x;
    case ACT_GELU_ERF: return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
    case ACT_GELU_TANH:
      return 0.5f * x * (1.f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
    default: return x;
  }
}

}  // namespace mxf_cuda
