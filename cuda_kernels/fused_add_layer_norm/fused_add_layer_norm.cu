// CUDA fused add + LayerNorm: one block per row; the sum a+b is kept in shared memory
// (C <= 8192) so the row is read once; mean and variance by block reductions (two-pass
// variance, like the CPU op, for accuracy).
#include "cuda_common.cuh"
#include "fused_add_layer_norm.h"

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxC = 8192;

__device__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = mxf_cuda::warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = threadIdx.x < kThreads / 32 ? red[threadIdx.x] : 0.f;
  if (warp == 0) t = mxf_cuda::warp_sum(t);
  if (threadIdx.x == 0) red[0] = t;
  __syncthreads();
  return red[0];
}

__global__ void add_ln_kernel(const float* __restrict__ a, const float* __restrict__ b,
                              const float* __restrict__ g, const float* __restrict__ be,
                              float* __restrict__ y, float* __restrict__ so, int64_t C,
                              int64_t b_rows, float eps) {
  __shared__ float s[kMaxC];
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
  const float* ar = a + r * C;
  const float* br = b + (r % b_rows) * C;
  float part = 0.f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float v = ar[c] + br[c];
    s[c] = v;
    part += v;
    if (so) so[r * C + c] = v;
  }
  const float mean = block_sum(part, red) / C;
  part = 0.f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float d = s[c] - mean;
    part += d * d;
  }
  const float rstd = rsqrtf(block_sum(part, red) / C + eps);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    y[r * C + c] = (s[c] - mean) * rstd * g[c] + be[c];
}

}  // namespace

extern "C" int mxf_add_layer_norm_forward(const float* a, const float* b, const float* gamma,
                                          const float* beta, float* y, float* sum_out, int64_t R,
                                          int64_t C, int64_t b_rows, float eps, void* stream) {
  if (C <= 0 || C > kMaxC || b_rows <= 0 || R % b_rows != 0) return -1;
  if (R == 0) return 0;
  add_ln_kernel<<<static_cast<unsigned>(R), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      a, b, gamma, beta, y, sum_out, C, b_rows, eps);
  MXF_CUDA_RETURN_LAST();
}
