// CUDA fused attention, flash-attention style: each block owns kRows query rows of one
// (b, h); K and V tiles of kTile keys are staged in shared memory and reused by all the
// block's rows; each warp keeps an online softmax (running max / sum) and its output
// row in registers (lane j holds columns j, j+32, ...).  The S x S matrix never exists.
#include "cuda_common.cuh"
#include "fused_attention.h"

namespace {

constexpr int kWarps = 8;          // warps per block
constexpr int kRowsPerWarp = 2;    // query rows per warp
constexpr int kRows = kWarps * kRowsPerWarp;
constexpr int kTile = 32;          // keys per shared-memory tile
constexpr int kMaxD = 256;         // max head dim (8 values per lane)
constexpr int kPer = kMaxD / 32;

__global__ void attention_fwd_kernel(mxf_attention_args a) {
  extern __shared__ float smem[];
  float* Ks = smem;                   // kTile x D
  float* Vs = smem + kTile * a.D;     // kTile x Dv
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n = blockIdx.y, b = n / a.H, h = n % a.H;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;

  float qv[kRowsPerWarp][kPer], ov[kRowsPerWarp][kPer], m[kRowsPerWarp], l[kRowsPerWarp];
  int64_t lim[kRowsPerWarp];
  bool touched[kRowsPerWarp];
  int64_t kmax = 0;
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t i = row0 + warp * kRowsPerWarp + r;
    m[r] = -INFINITY;
    l[r] = 0.f;
    int64_t L = i < a.Sq ? a.Sk : 0;
    if (i < a.Sq && a.mask_kind == MXF_MASK_VALID_LENGTH) {
      const int64_t len = a.lengths[n * a.len_sn + i * a.len_sq];
      L = len < 0 ? 0 : (len > a.Sk ? a.Sk : len);
    }
    if (i < a.Sq && a.causal) {
      const int64_t c = i + (a.Sk - a.Sq) + 1;
      L = c < L ? (c < 0 ? 0 : c) : L;
    }
    lim[r] = L;
    touched[r] = L > 0;
    for (int j = 0; j < kPer; ++j) {
      const int64_t d = lane + 32 * j;
      qv[r][j] = (i < a.Sq && d < a.D) ? a.q[b * a.q_bs + h * a.q_hs + i * a.q_rs + d] : 0.f;
      ov[r][j] = 0.f;
    }
  }
  // the block's key range: max over its rows (shared by all warps)
  __shared__ int64_t s_kmax;
  if (threadIdx.x == 0) s_kmax = 0;
  __syncthreads();
  for (int r = 0; r < kRowsPerWarp; ++r)
    if (lane == 0) atomicMax(reinterpret_cast<unsigned long long*>(&s_kmax),
                             static_cast<unsigned long long>(lim[r]));
  __syncthreads();
  kmax = s_kmax;

  for (int64_t j0 = 0; j0 < kmax; j0 += kTile) {
    const int nb = static_cast<int>(kmax - j0 < kTile ? kmax - j0 : kTile);
    __syncthreads();
    for (int64_t t = threadIdx.x; t < static_cast<int64_t>(nb) * a.D; t += blockDim.x) {
      const int64_t jj = t / a.D, d = t % a.D;
      Ks[t] = a.k[b * a.k_bs + h * a.k_hs + (j0 + jj) * a.k_rs + d];
    }
    for (int64_t t = threadIdx.x; t < static_cast<int64_t>(nb) * a.Dv; t += blockDim.x) {
      const int64_t jj = t / a.Dv, d = t % a.Dv;
      Vs[t] = a.v[b * a.v_bs + h * a.v_hs + (j0 + jj) * a.v_rs + d];
    }
    __syncthreads();
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int64_t i = row0 + warp * kRowsPerWarp + r;
      if (i >= a.Sq) continue;
      const int cl = static_cast<int>(lim[r] - j0 < nb ? (lim[r] - j0 < 0 ? 0 : lim[r] - j0) : nb);
      if (cl <= 0) continue;
      for (int jj = 0; jj < cl; ++jj) {
        float part = 0.f;
        for (int j = 0; j < kPer; ++j) {
          const int64_t d = lane + 32 * j;
          if (d < a.D) part += qv[r][j] * Ks[jj * a.D + d];
        }
        float s = mxf_cuda::warp_sum(part) * a.scale;
        const int64_t col = j0 + jj;
        if (a.mask_kind == MXF_MASK_ADDITIVE) {
          s += a.mask[b * a.m_sb + h * a.m_sh + i * a.m_sq + col * a.m_sk];
        } else if (a.mask_kind == MXF_MASK_BOOLEAN) {
          if (a.mask[b * a.m_sb + h * a.m_sh + i * a.m_sq + col * a.m_sk] == 0.f) s = a.mask_value;
        }
        const float mn = fmaxf(m[r], s);
        if (mn == -INFINITY) continue;  // nothing finite yet
        const float alpha = expf(m[r] - mn), p = expf(s - mn);
        l[r] = l[r] * alpha + p;
        m[r] = mn;
        for (int j = 0; j < kPer; ++j) {
          const int64_t d = lane + 32 * j;
          if (d < a.Dv) ov[r][j] = ov[r][j] * alpha + p * Vs[jj * a.Dv + d];
        }
      }
    }
  }
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t i = row0 + warp * kRowsPerWarp + r;
    if (i >= a.Sq) continue;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    const float fill = touched[r] ? nanf("") : 0.f;
    for (int j = 0; j < kPer; ++j) {
      const int64_t d = lane + 32 * j;
      if (d < a.Dv) a.o[b * a.o_bs + h * a.o_hs + i * a.o_rs + d] = l[r] > 0.f ? ov[r][j] * inv : fill;
    }
  }
}

}  // namespace

extern "C" int mxf_attention_forward(const mxf_attention_args* args, void* stream) {
  if (!args || args->D <= 0 || args->Dv <= 0 || args->D > kMaxD || args->Dv > kMaxD) return -1;
  const int64_t N = args->B * args->H;
  if (N == 0 || args->Sq == 0) return 0;
  dim3 grid(static_cast<unsigned>((args->Sq + kRows - 1) / kRows), static_cast<unsigned>(N));
  const size_t shmem = sizeof(float) * kTile * (args->D + args->Dv);
  if (shmem > 48 * 1024) {  // D + Dv > 384 needs the opt-in shared memory size
    const cudaError_t e = cudaFuncSetAttribute(
        attention_fwd_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shmem));
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  attention_fwd_kernel<<<grid, kWarps * 32, shmem, static_cast<cudaStream_t>(stream)>>>(*args);
  MXF_CUDA_RETURN_LAST();
}
