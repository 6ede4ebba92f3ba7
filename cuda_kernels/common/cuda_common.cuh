// Helpers for the CUDA C-interface library (libmxfusion_cuda.so): dtype dispatch, float32
// conversions, 128-bit vector access, req handling, warp / block reductions, workspace carving.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "mxf_cuda_types.h"
#include "cuda_try.h"

// Every launcher returns 0 on success, else a cudaError_t value (or a negative MXF_ERR_*).
#define MXF_CUDA_RETURN_LAST() return static_cast<int>(cudaGetLastError())

namespace mxf_cuda {

using half = __half;
using bf16 = __nv_bfloat16;

// ---- conversions: float32 math whatever the storage type ----
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(bf16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ half from_f<half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float v) { return __float2bfloat16_rn(v); }

// out = v (req WRITE / INPLACE) or out += v (req ADD, in float32 then rounded once).
template <typename T>
__device__ __forceinline__ void store_req(T* p, float v, int req) {
  if (req == MXF_REQ_ADD) v += to_f(*p);
  *p = from_f<T>(v);
}

// 16 bytes of T: 4 floats or 8 halves.
template <typename T> struct Vec {
  static constexpr int N = 16 / sizeof(T);
  union { uint4 raw; T e[N]; } u;
};
template <typename T>
__device__ __forceinline__ Vec<T> load_vec(const T* p) {  // p 16-byte aligned
  Vec<T> v;
  v.u.raw = *reinterpret_cast<const uint4*>(p);
  return v;
}
template <typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T>& v) {
  *reinterpret_cast<uint4*>(p) = v.u.raw;
}
__host__ __device__ inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---- reductions ----
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Sum over the block (blockDim.x a multiple of 32, <= 1024); red: 32 floats of shared memory.
// Every thread gets the sum; red may be reused right after.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // red free (a previous call's readers are done)
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = lane < nw ? red[lane] : 0.f;
  return warp_sum(t);
}

// ---- dtype dispatch on the host: f(T{}) with T = float / half / bf16 ----
template <typename F>
int dispatch_dtype(int dtype, F&& f) {
  switch (dtype) {
    case MXF_F32: return f(float{});
    case MXF_F16: return f(half{});
    case MXF_BF16: return f(bf16{});
  }
  return MXF_ERR_BAD_ARGS;
}
inline size_t dtype_bytes(int dtype) { return dtype == MXF_F32 ? 4 : (dtype == MXF_F16 || dtype == MXF_BF16) ? 2 : 0; }

// ---- workspace: consecutive 256-byte aligned pieces ----
inline size_t align256(size_t n) { return (n + 255) & ~static_cast<size_t>(255); }
struct Carver {
  char* base;
  size_t used = 0;
  explicit Carver(void* p) : base(static_cast<char*>(p)) {}
  template <typename T> T* take(size_t count) {
    T* p = reinterpret_cast<T*>(base + used);
    used += align256(count * sizeof(T));
    return p;
  }
};

inline bool req_ok(int req) {
  return req == MXF_REQ_NULL || req == MXF_REQ_WRITE || req == MXF_REQ_INPLACE || req == MXF_REQ_ADD;
}

}  // namespace mxf_cuda
