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

}  // namespace mxf_cuda
