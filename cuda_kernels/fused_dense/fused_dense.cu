// CUDA fused dense: a shared-memory tiled SGEMM (64x64 tile, 4x4 outputs per thread)
// with the bias + activation epilogue applied in registers and the output written
// either row-major or head-split (B, H, S, D).
#include "cuda_common.cuh"
#include "fused_dense.h"

namespace {

// The epilogue, as MXNet computes FullyConnected's activation on the GPU (its own
// kernels: relu and Activation(relu) keep NaN).  Codes as fused_dense.h.
constexpr int kActRelu = 1, kActSigmoid = 2, kActTanh = 3, kActSoftrelu = 4, kActLeaky = 5,
              kActGeluErf = 6, kActGeluTanh = 7, kActActRelu = 8;

__device__ __forceinline__ float epilogue(int act, float x, float slope) {
  switch (act) {
    case kActRelu:
    case kActActRelu: return !(x <= 0.f) ? x : 0.f;
    case kActSigmoid: return 1.f / (1.f + expf(-x));
    case kActTanh: return tanhf(x);
    case kActSoftrelu: return x > 20.f ? x : log1pf(expf(x));
    case kActLeaky: return x > 0.f ? x : __fmul_rn(x, slope);
    case kActGeluErf: return 0.5f * x * (1.f + erff(x / 1.41421356237309504880f));
    case kActGeluTanh:  // the written-out ops: 0.5 x (1 + tanh((x + x^3 0.044715) sqrt(2/pi)))
      return 0.5f * x * (1.f + tanhf((x + x * x * x * 0.044715f) * 0.79788456080286536f));
    default: return x;
  }
}

constexpr int BM = 64, BN = 64, BK = 16, TM = 4, TN = 4;  // 16x16 threads

__global__ void dense_kernel(const float* __restrict__ x, const float* __restrict__ w,
                             const float* __restrict__ bias, float* __restrict__ y, int64_t M,
                             int64_t N, int64_t K, int act, float slope, int64_t heads,
                             int64_t S) {
  __shared__ float As[BK][BM + 1];
  __shared__ float Bs[BK][BN + 1];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * BM, n0 = static_cast<int64_t>(blockIdx.x) * BN;
  float acc[TM][TN] = {};
  for (int64_t k0 = 0; k0 < K; k0 += BK) {
    for (int t = threadIdx.x; t < BM * BK; t += blockDim.x) {
      const int r = t / BK, c = t % BK;
      const int64_t gm = m0 + r, gk = k0 + c;
      As[c][r] = (gm < M && gk < K) ? x[gm * K + gk] : 0.f;
      const int64_t gn = n0 + r;
      Bs[c][r] = (gn < N && gk < K) ? w[gn * K + gk] : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      float av[TM], bv[TN];
#pragma unroll
      for (int i = 0; i < TM; ++i) av[i] = As[kk][ty * TM + i];
#pragma unroll
      for (int j = 0; j < TN; ++j) bv[j] = Bs[kk][tx * TN + j];
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] += av[i] * bv[j];
    }
    __syncthreads();
  }
  const int64_t D = heads > 0 ? N / heads : N;
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int64_t gm = m0 + ty * TM + i;
    if (gm >= M) continue;
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const int64_t gn = n0 + tx * TN + j;
      if (gn >= N) continue;
      const float v = epilogue(act, acc[i][j] + (bias ? bias[gn] : 0.f), slope);
      if (heads > 0) {
        const int64_t bb = gm / S, s = gm % S, hh = gn / D, d = gn % D;
        y[((bb * heads + hh) * S + s) * D + d] = v;
      } else {
        y[gm * N + gn] = v;
      }
    }
  }
}

}  // namespace

extern "C" int mxf_dense_forward(const float* x, const float* w, const float* bias, float* y,
                                 int64_t M, int64_t N, int64_t K, int act, float slope,
                                 int64_t heads, int64_t S, void* stream) {
  if (M < 0 || N < 0 || K < 0 || act < 0 || act > kActActRelu) return -1;
  if (heads > 0 && (N % heads != 0 || S <= 0 || M % S != 0)) return -1;
  if (M == 0 || N == 0) return 0;
  dim3 grid(static_cast<unsigned>((N + BN - 1) / BN), static_cast<unsigned>((M + BM - 1) / BM));
  dense_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(x, w, bias, y, M, N, K, act,
                                                                    slope, heads, S);
  MXF_CUDA_RETURN_LAST();
}
