// CUDA fused attention, flash-attention style: each block owns kRows query rows of one
// (b, h); K and V tiles of kTile keys are staged in shared memory and reused by all the
// block's rows; each warp keeps an online softmax (running max / sum) and its output
// row in registers (lane j holds columns j, j+32, ...).  The S x S matrix never exists.
// Same results as the CPU op (attention_cpu.cc): fully masked rows, causal modes and
// non-finite values follow the unfused MXNet graph.
#include "cuda_common.cuh"
#include "fused_attention.h"

namespace {

constexpr int kWarps = 8;          // warps per block
constexpr int kRowsPerWarp = 2;    // query rows per warp
constexpr int kRows = kWarps * kRowsPerWarp;
constexpr int kTile = 32;          // keys per shared-memory tile
constexpr int kMaxD = 256;         // max head dim (8 values per lane)
constexpr int kPer = kMaxD / 32;

__device__ __forceinline__ float warp_dot(const float* qv, const float* x, int lane, int64_t D) {
  float part = 0.f;
  for (int j = 0; j < kPer; ++j) {
    const int64_t d = lane + 32 * j;
    if (d < D) part += qv[j] * x[d];
  }
  return mxf_cuda::warp_sum(part);
}

// Non-negative floats (and +inf) order like their bit patterns: atomicMax on the bits.
__device__ __forceinline__ void atomic_max_nonneg(float* addr, float v) {
  atomicMax(reinterpret_cast<int*>(addr), __float_as_int(v));
}

__global__ void attention_fwd_kernel(mxf_attention_args a) {
  extern __shared__ float smem[];
  float* Ks = smem;                   // kTile x D
  float* Vs = smem + kTile * a.D;     // kTile x Dv
  __shared__ unsigned long long s_kmax, s_emin, s_limmin;
  __shared__ float s_knmax;           // causal add: max |k_j| over keys j >= s_emin
  __shared__ int s_lastbad[kMaxD];    // last key >= s_limmin whose v is not finite, per column
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n = blockIdx.y, b = n / a.H, h = n % a.H;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const bool transform = a.causal == MXF_CAUSAL_ADD || a.causal == MXF_CAUSAL_FILL;
  const bool skips = a.causal != MXF_CAUSAL_NONE || a.mask_kind == MXF_MASK_VALID_LENGTH;
  if (threadIdx.x == 0) {
    s_kmax = 0;
    s_emin = static_cast<unsigned long long>(a.Sk);
    s_limmin = static_cast<unsigned long long>(a.Sk);
    s_knmax = 0.f;
  }
  for (int c = threadIdx.x; c < kMaxD; c += blockDim.x) s_lastbad[c] = -1;
  __syncthreads();

  float qv[kRowsPerWarp][kPer], ov[kRowsPerWarp][kPer], m[kRowsPerWarp], l[kRowsPerWarp];
  int64_t lim[kRowsPerWarp], band[kRowsPerWarp];
  bool touched[kRowsPerWarp];
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t i = row0 + warp * kRowsPerWarp + r;
    m[r] = -INFINITY;
    l[r] = 0.f;
    int64_t L = i < a.Sq ? a.Sk : 0;
    if (i < a.Sq && a.mask_kind == MXF_MASK_VALID_LENGTH) {
      const int64_t len = a.lengths[n * a.len_sn + i * a.len_sq];
      L = len < 0 ? 0 : (len > a.Sk ? a.Sk : len);
    }
    band[r] = L;
    if (i < a.Sq && a.causal != MXF_CAUSAL_NONE) {
      const int64_t c = i + (a.Sk - a.Sq) + 1;
      band[r] = c < L ? (c < 0 ? 0 : c) : L;
      if (!transform) L = band[r];
    }
    lim[r] = L;
    for (int j = 0; j < kPer; ++j) {
      const int64_t d = lane + 32 * j;
      qv[r][j] = (i < a.Sq && d < a.D) ? a.q[b * a.q_bs + h * a.q_hs + i * a.q_rs + d] : 0.f;
      ov[r][j] = 0.f;
    }
    if (i < a.Sq && transform && lane == 0)
      atomicMin(&s_emin, static_cast<unsigned long long>(band[r]));
  }
  __syncthreads();
  if (a.causal == MXF_CAUSAL_ADD) {  // |k_j| over the keys after the block's bands
    for (int64_t j = static_cast<int64_t>(s_emin) + threadIdx.x; j < a.Sk; j += blockDim.x) {
      const float* kr = a.k + b * a.k_bs + h * a.k_hs + j * a.k_rs;
      float ss = 0.f;
      for (int64_t d = 0; d < a.D; ++d) ss += kr[d] * kr[d];
      const float nk = sqrtf(ss);
      atomic_max_nonneg(&s_knmax, isfinite(nk) ? nk : INFINITY);
    }
    __syncthreads();
  }
  if (transform) {
    // keys after the band are skipped only when their probabilities are provably below
    // e^-110 (0 in float32) and their scores not NaN / +inf; see band_skips() of the CPU op
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int64_t i = row0 + warp * kRowsPerWarp + r;
      if (i >= a.Sq) continue;
      const int64_t e = band[r];
      bool skip;
      if (e >= a.Sk) {
        skip = true;
      } else if (e <= 0 || isnan(a.mask_value)) {
        skip = false;
      } else {
        const float* ke = a.k + b * a.k_bs + h * a.k_hs + (e - 1) * a.k_rs;
        float qq = 0.f, kk = 0.f, qk = 0.f;
        for (int j = 0; j < kPer; ++j) {
          const int64_t d = lane + 32 * j;
          if (d < a.D) {
            qq += qv[r][j] * qv[r][j];
            kk += ke[d] * ke[d];
            qk += qv[r][j] * ke[d];
          }
        }
        qq = mxf_cuda::warp_sum(qq);
        kk = mxf_cuda::warp_sum(kk);
        qk = mxf_cuda::warp_sum(qk);
        const double c = a.mask_value, sc = fabs(static_cast<double>(a.scale));
        const double qnorm = sqrt(static_cast<double>(qq)), U = sc * qnorm * s_knmax;
        const bool add = a.causal == MXF_CAUSAL_ADD;
        if (add && !isfinite(U)) {
          skip = false;
        } else if (c == -INFINITY) {
          skip = true;
        } else if (c == INFINITY) {
          skip = false;
        } else {
          const double Ls = static_cast<double>(a.scale) * qk;
          const double lower = Ls - 1e-3 * fabs(Ls) -
                               (1e-4 + 1.2e-7 * a.D) * sc * qnorm * sqrt(static_cast<double>(kk));
          const double upper = c + 1e-6 * fabs(c) + (add ? U * (1 + 1e-3) : 0.0);
          skip = isfinite(Ls) && isfinite(lower) && upper - lower < -110.0;
        }
      }
      // one decision per warp (the warp sums agree across lanes; this makes it explicit)
      if (__shfl_sync(0xffffffffu, skip ? 1 : 0, 0)) lim[r] = e;
    }
  }
  for (int r = 0; r < kRowsPerWarp; ++r) {
    touched[r] = lim[r] > 0;
    const int64_t i = row0 + warp * kRowsPerWarp + r;
    if (lane == 0) {
      atomicMax(&s_kmax, static_cast<unsigned long long>(lim[r]));
      if (i < a.Sq) atomicMin(&s_limmin, static_cast<unsigned long long>(lim[r]));
    }
  }
  __syncthreads();
  const int64_t kmax = static_cast<int64_t>(s_kmax);
  if (skips) {  // non-finite values among keys some row skips
    const int64_t j0 = static_cast<int64_t>(s_limmin);
    for (int64_t t = threadIdx.x; t < (a.Sk - j0) * a.Dv; t += blockDim.x) {
      const int64_t j = j0 + t / a.Dv, d = t % a.Dv;
      if (!isfinite(a.v[b * a.v_bs + h * a.v_hs + j * a.v_rs + d]))
        atomicMax(&s_lastbad[d], static_cast<int>(j));
    }
  }

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
        float s = warp_dot(qv[r], Ks + jj * a.D, lane, a.D) * a.scale;
        const int64_t col = j0 + jj;
        if (a.mask_kind == MXF_MASK_ADDITIVE) {
          s += a.mask[b * a.m_sb + h * a.m_sh + i * a.m_sq + col * a.m_sk];
        } else if (a.mask_kind == MXF_MASK_BOOLEAN) {
          if (a.mask[b * a.m_sb + h * a.m_sh + i * a.m_sq + col * a.m_sk] == 0.f) s = a.mask_value;
        }
        if (transform && col >= band[r]) s = a.causal == MXF_CAUSAL_ADD ? s + a.mask_value : a.mask_value;
        if (isnan(s)) {  // the row's output is NaN, as MXNet's softmax gives it
          l[r] = NAN;
          continue;
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
  __syncthreads();  // s_lastbad complete
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t i = row0 + warp * kRowsPerWarp + r;
    if (i >= a.Sq) continue;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    const float fill = touched[r] ? nanf("") : 0.f;
    for (int j = 0; j < kPer; ++j) {
      const int64_t d = lane + 32 * j;
      if (d >= a.Dv) continue;
      float y = l[r] > 0.f ? ov[r][j] * inv : fill;
      if (skips && lim[r] < a.Sk && s_lastbad[d] >= lim[r]) y = nanf("");
      a.o[b * a.o_bs + h * a.o_hs + i * a.o_rs + d] = y;
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
