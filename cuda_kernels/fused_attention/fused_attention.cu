// CUDA fused attention.
//
// Forward, fp16 / bf16: flash-attention style on tensor cores.  A block of 4 warps owns 64
// query rows of one (b, h), 16 per warp; key / value tiles of 64 keys (32 for head dims
// above 128) are staged in shared memory in two stages (cp.async copies of the next tile in
// flight while the current one is computed); each warp computes its 16 x 64 scores with
// mma.sync m16n8k16 (fp32 accumulation), keeps a running max and sum per row (online softmax,
// exp2 of log2e-scaled scores), turns the probabilities into the A operand of the next
// mma.sync straight from the score accumulators, and accumulates O in registers.  Key tiles
// after every row's band / valid length are never read (causal tile skipping).  Memory: the
// tiles, O(S d); the S x S matrix never exists.
// Forward, fp32: one warp per query row pair with fp32 FMAs (lane j holds columns j, j+32, ...).
// Backward: flash-attention style with recomputation from the saved log-sum-exp: a block owns a
// tile of keys of one (b, h), walks the query tiles that see them, recomputes P = exp(s - lse),
// dP = dO v^T, dS = P (dP - delta) (delta = rowsum(dO o)), accumulates dk, dv and adds dq (and
// an additive mask's gradient) to float32 workspaces.  fp16 / bf16 with D, Dv <= 128 on tensor
// cores (attention_bwd_mma_kernel); otherwise fp32 FMAs with dk, dv in shared memory.
// Float32 math throughout.
// Same results as the CPU op (attention_cpu.cc): fully masked rows, causal modes and
// non-finite values follow the unfused MXNet graph.
#include "cuda_common.cuh"
#include "attention_backends.h"
#include "fused_attention.h"

#include <cstdlib>
#include <string>
#include <type_traits>

namespace {

using mxf_cuda::bf16;
using mxf_cuda::from_f;
using mxf_cuda::half;
using mxf_cuda::to_f;

constexpr int kWarps = 8;          // warps per block (fp32 forward)
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

__global__ void attention_fwd_f32_kernel(mxf_attention_args a) {
  const float* __restrict__ Q = static_cast<const float*>(a.q);
  const float* __restrict__ Kp = static_cast<const float*>(a.k);
  const float* __restrict__ Vp = static_cast<const float*>(a.v);
  const float* __restrict__ Mp = static_cast<const float*>(a.mask);
  float* __restrict__ Op = static_cast<float*>(a.o);
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
      qv[r][j] = (i < a.Sq && d < a.D) ? Q[b * a.q_bs + h * a.q_hs + i * a.q_rs + d] : 0.f;
      ov[r][j] = 0.f;
    }
    if (i < a.Sq && transform && lane == 0)
      atomicMin(&s_emin, static_cast<unsigned long long>(band[r]));
  }
  __syncthreads();
  if (a.causal == MXF_CAUSAL_ADD) {  // |k_j| over the keys after the block's bands
    for (int64_t j = static_cast<int64_t>(s_emin) + threadIdx.x; j < a.Sk; j += blockDim.x) {
      const float* kr = Kp + b * a.k_bs + h * a.k_hs + j * a.k_rs;
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
        const float* ke = Kp + b * a.k_bs + h * a.k_hs + (e - 1) * a.k_rs;
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
      if (!isfinite(Vp[b * a.v_bs + h * a.v_hs + j * a.v_rs + d]))
        atomicMax(&s_lastbad[d], static_cast<int>(j));
    }
  }

  for (int64_t j0 = 0; j0 < kmax; j0 += kTile) {
    const int nb = static_cast<int>(kmax - j0 < kTile ? kmax - j0 : kTile);
    __syncthreads();
    for (int64_t t = threadIdx.x; t < static_cast<int64_t>(nb) * a.D; t += blockDim.x) {
      const int64_t jj = t / a.D, d = t % a.D;
      Ks[t] = Kp[b * a.k_bs + h * a.k_hs + (j0 + jj) * a.k_rs + d];
    }
    for (int64_t t = threadIdx.x; t < static_cast<int64_t>(nb) * a.Dv; t += blockDim.x) {
      const int64_t jj = t / a.Dv, d = t % a.Dv;
      Vs[t] = Vp[b * a.v_bs + h * a.v_hs + (j0 + jj) * a.v_rs + d];
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
          s += Mp[b * a.m_sb + h * a.m_sh + i * a.m_sq + col * a.m_sk];
        } else if (a.mask_kind == MXF_MASK_BOOLEAN) {
          if (Mp[b * a.m_sb + h * a.m_sh + i * a.m_sq + col * a.m_sk] == 0.f) s = a.mask_value;
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
    if (a.lse && lane == 0)
      a.lse[n * a.Sq + i] = l[r] > 0.f ? m[r] + logf(l[r]) : (touched[r] ? nanf("") : INFINITY);
    const float fill = touched[r] ? nanf("") : 0.f;
    for (int j = 0; j < kPer; ++j) {
      const int64_t d = lane + 32 * j;
      if (d >= a.Dv) continue;
      float y = l[r] > 0.f ? ov[r][j] * inv : fill;
      if (skips && lim[r] < a.Sk && s_lastbad[d] >= lim[r]) y = nanf("");
      Op[b * a.o_bs + h * a.o_hs + i * a.o_rs + d] = y;
    }
  }
}


// ------------------------------------------------------------------------------------------
// fp16 / bf16 forward on tensor cores
// ------------------------------------------------------------------------------------------
constexpr int kMmaWarps = 4;
constexpr int kBR = 16 * kMmaWarps;  // query rows per block
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, const uint32_t* b, half) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, const uint32_t* b, bf16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// two floats -> one register of the A operand, the lower column in the low half
__device__ __forceinline__ uint32_t pack2(float lo, float hi, half) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack2(float lo, float hi, bf16) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Four 8x8 b16 matrices from shared memory: lanes 8i..8i+7 give the row addresses of matrix i;
// register i holds matrix i's (row lane/4, cols 2(lane%4), +1), or with .trans its
// (rows 2(lane%4), +1, col lane/4) -- the B operand of mma.m16n8k16 from a row-major k x n tile.
__device__ __forceinline__ void ldsm_x4(uint32_t* r, const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t* r, const void* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

struct MmaParams {
  mxf_attention_args a;
  const int* lastbad;  // per (n, column): last key whose v is not finite, or -1 (skipping modes)
  bool vec_q, vec_k, vec_v;
  bool vec_o;  // output rows 16-byte aligned and Dv % 8 == 0: staged 16-byte stores
};

// rows [0, rows) x cols [0, DMAX) of dst (row stride STR) from rows row0.. of src (row stride rs),
// zero past nvalid rows and D columns.  vec (16-byte aligned rows, strides % 8 == 0): 16-byte
// cp.async copies (zero-filled past the data), completed by the caller's cp_async_wait +
// __syncthreads; otherwise plain element loads and stores.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <typename T, int DMAX>
__device__ __forceinline__ void load_tile(T* dst, const T* __restrict__ src, int64_t rs, int64_t row0,
                                          int rows, int64_t nvalid, int64_t D, bool vec) {
  constexpr int STR = DMAX + 8, CH = DMAX / 8;
  const T zero = from_f<T>(0.f);
  for (int t = threadIdx.x; t < rows * CH; t += blockDim.x) {
    const int r = t / CH, c = (t % CH) * 8;
    const int64_t gr = row0 + r;
    T* d = dst + r * STR + c;
    if (vec) {
      const int64_t left = gr < nvalid ? D - c : 0;
      const int bytes = left <= 0 ? 0 : (left >= 8 ? 16 : static_cast<int>(left) * 2);
      cp_async16(d, bytes > 0 ? src + gr * rs + c : src, bytes);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) d[e] = (gr < nvalid && c + e < D) ? src[gr * rs + c + e] : zero;
    }
  }
}

// Per-row key limits of the block's rows: band (end of the causal band / valid length) and lim
// (keys the row reads: band, or all of them when a causal add / fill mode cannot skip).  The
// skip decision is the fp32 kernel's (and the CPU op's band_skips()).
template <typename T>
__device__ void row_limits(const mxf_attention_args& a, int64_t n, int64_t row0, int64_t* s_lim,
                           int64_t* s_band, unsigned long long* s_emin, float* s_knmax) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t b = n / a.H, h = n % a.H;
  const bool transform = a.causal == MXF_CAUSAL_ADD || a.causal == MXF_CAUSAL_FILL;
  const T* Q = static_cast<const T*>(a.q);
  const T* K = static_cast<const T*>(a.k);
  if (threadIdx.x == 0) {
    *s_emin = static_cast<unsigned long long>(a.Sk);
    *s_knmax = 0.f;
  }
  __syncthreads();
  if (threadIdx.x < kBR) {
    const int64_t i = row0 + threadIdx.x;
    int64_t L = i < a.Sq ? a.Sk : 0;
    if (i < a.Sq && a.mask_kind == MXF_MASK_VALID_LENGTH) {
      const int64_t len = a.lengths[n * a.len_sn + i * a.len_sq];
      L = len < 0 ? 0 : (len > a.Sk ? a.Sk : len);
    }
    int64_t band = L;
    if (i < a.Sq && a.causal != MXF_CAUSAL_NONE) {
      const int64_t c = i + (a.Sk - a.Sq) + 1;
      band = c < L ? (c < 0 ? 0 : c) : L;
    }
    s_band[threadIdx.x] = band;
    s_lim[threadIdx.x] = transform ? L : band;
    if (i < a.Sq && transform) atomicMin(s_emin, static_cast<unsigned long long>(band));
  }
  __syncthreads();
  if (!transform) return;
  if (a.causal == MXF_CAUSAL_ADD) {  // |k_j| over the keys after the block's bands
    for (int64_t j = static_cast<int64_t>(*s_emin) + threadIdx.x; j < a.Sk; j += blockDim.x) {
      const T* kr = K + b * a.k_bs + h * a.k_hs + j * a.k_rs;
      float ss = 0.f;
      for (int64_t d = 0; d < a.D; ++d) ss += to_f(kr[d]) * to_f(kr[d]);
      const float nk = sqrtf(ss);
      atomic_max_nonneg(s_knmax, isfinite(nk) ? nk : INFINITY);
    }
    __syncthreads();
  }
  const int nw = blockDim.x >> 5;
  for (int r = warp; r < kBR; r += nw) {
    const int64_t i = row0 + r;
    if (i >= a.Sq) continue;
    const int64_t e = s_band[r];
    bool skip;
    if (e >= a.Sk) {
      skip = true;
    } else if (e <= 0 || isnan(a.mask_value)) {
      skip = false;
    } else {
      const T* qr = Q + b * a.q_bs + h * a.q_hs + i * a.q_rs;
      const T* ke = K + b * a.k_bs + h * a.k_hs + (e - 1) * a.k_rs;
      float qq = 0.f, kk = 0.f, qk = 0.f;
      for (int64_t d = lane; d < a.D; d += 32) {
        const float x = to_f(qr[d]), y = to_f(ke[d]);
        qq += x * x;
        kk += y * y;
        qk += x * y;
      }
      qq = mxf_cuda::warp_sum(qq);
      kk = mxf_cuda::warp_sum(kk);
      qk = mxf_cuda::warp_sum(qk);
      const double c = a.mask_value, sc = fabs(static_cast<double>(a.scale));
      const double qnorm = sqrt(static_cast<double>(qq)), U = sc * qnorm * *s_knmax;
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
    if (__shfl_sync(0xffffffffu, skip ? 1 : 0, 0) && lane == 0) s_lim[r] = e;
  }
  __syncthreads();
}

// kV2 (the default; MXFUSION_ATTN_OWN_KERNEL=v1 selects the kernel before it, for bisecting):
//  - interior key tiles (no additive / boolean mask, no add / fill band, every row of the block
//    sees the whole tile) skip the per-element bookkeeping: the scale is folded into one FFMA
//    before exp2 (the row max taken on the raw products, exact for a positive scale), and a NaN or
//    +inf score is found at the end from the row sum (it makes the sum NaN);
//  - the output goes through shared memory (each warp's own 16 rows of the Q tile) and out in
//    16-byte stores along the rows (rows 16-byte aligned, Dv % 8 == 0), not 4-byte stores
//    strided by the row.
template <typename T, int DMAX, int BC, bool kV2>
__global__ void __launch_bounds__(kMmaWarps * 32)
attention_fwd_mma_kernel(const MmaParams P) {
  constexpr int STR = DMAX + 8;
  const mxf_attention_args& a = P.a;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* KV = Qs + kBR * STR;  // two stages of [K tile | V tile], each BC x STR
  __shared__ int64_t s_lim[kBR], s_band[kBR];
  __shared__ unsigned long long s_emin;
  __shared__ float s_knmax;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t n = blockIdx.y, b = n / a.H, h = n % a.H;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kBR;
  const T* Qg = static_cast<const T*>(a.q) + b * a.q_bs + h * a.q_hs;
  const T* Kg = static_cast<const T*>(a.k) + b * a.k_bs + h * a.k_hs;
  const T* Vg = static_cast<const T*>(a.v) + b * a.v_bs + h * a.v_hs;
  const T* Mg = static_cast<const T*>(a.mask);
  const bool transform = a.causal == MXF_CAUSAL_ADD || a.causal == MXF_CAUSAL_FILL;

  row_limits<T>(a, n, row0, s_lim, s_band, &s_emin, &s_knmax);
  int64_t kmax = 0, kmin = a.Sk;  // the most / fewest keys a row of the block sees (rows past Sq: 0)
  for (int r = 0; r < kBR; ++r) {
    kmax = s_lim[r] > kmax ? s_lim[r] : kmax;
    if (row0 + r < a.Sq) kmin = s_lim[r] < kmin ? s_lim[r] : kmin;
  }
  // tiles before `interior` need no per-element work (kV2): every row sees all their keys
  const bool plain_scores = a.mask_kind != MXF_MASK_ADDITIVE && a.mask_kind != MXF_MASK_BOOLEAN && !transform &&
                            a.scale > 0.f;
  const int64_t interior = kV2 && plain_scores ? kmin : 0;
  load_tile<T, DMAX>(Qs, Qg, a.q_rs, row0, kBR, a.Sq, a.D, P.vec_q);
  if (kmax > 0) {  // stage 0: the first key tile, in flight with Q
    load_tile<T, DMAX>(KV, Kg, a.k_rs, 0, BC, a.Sk, a.D, P.vec_k);
    load_tile<T, DMAX>(KV + BC * STR, Vg, a.v_rs, 0, BC, a.Sk, a.Dv, P.vec_v);
  }
  cp_async_commit();

  const int rl = warp * 16 + g;  // this thread's rows in the block: rl and rl + 8
  const int64_t i_lo = row0 + rl, i_hi = i_lo + 8;
  const int64_t lim_lo = s_lim[rl], lim_hi = s_lim[rl + 8];
  const int64_t band_lo = s_band[rl], band_hi = s_band[rl + 8];
  const float sl2 = a.scale, sl2l = a.scale * kLog2e;
  const int ksteps = static_cast<int>((a.D + 15) / 16), dsteps = static_cast<int>((a.Dv + 7) / 8);

  float oacc[DMAX / 8][4];
#pragma unroll
  for (int i = 0; i < DMAX / 8; ++i) oacc[i][0] = oacc[i][1] = oacc[i][2] = oacc[i][3] = 0.f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;
  bool bad_lo = false, bad_hi = false;

  int stage = 0;
  for (int64_t j0 = 0; j0 < kmax; j0 += BC, stage ^= 1) {
    // the next tile's copies go to the other stage (its readers finished at the end of the
    // previous step) while this one is computed
    if (j0 + BC < kmax) {
      T* nxt = KV + (stage ^ 1) * 2 * BC * STR;
      load_tile<T, DMAX>(nxt, Kg, a.k_rs, j0 + BC, BC, a.Sk, a.D, P.vec_k);
      load_tile<T, DMAX>(nxt + BC * STR, Vg, a.v_rs, j0 + BC, BC, a.Sk, a.Dv, P.vec_v);
      cp_async_commit();
      cp_async_wait<1>();  // this thread's copies of the current tile (and Q) are done
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // everyone's copies are visible
    const T* Ks = KV + stage * 2 * BC * STR;
    const T* Vs = Ks + BC * STR;
    // S = Q K^T for the warp's 16 rows x BC keys
    float sacc[BC / 8][4];
#pragma unroll
    for (int i = 0; i < BC / 8; ++i) sacc[i][0] = sacc[i][1] = sacc[i][2] = sacc[i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < DMAX / 16; ++ks) {
      if (ks < ksteps) {
        const T* q0 = Qs + rl * STR + ks * 16 + 2 * t;
        uint32_t af[4];
        af[0] = *reinterpret_cast<const uint32_t*>(q0);
        af[1] = *reinterpret_cast<const uint32_t*>(q0 + 8 * STR);
        af[2] = *reinterpret_cast<const uint32_t*>(q0 + 8);
        af[3] = *reinterpret_cast<const uint32_t*>(q0 + 8 * STR + 8);
        // B operands of n-tiles nt, nt+1: K rows (keys) x 16 columns (d), as stored
        const int mi = lane >> 3, mr = lane & 7;
#pragma unroll
        for (int nt = 0; nt < BC / 8; nt += 2) {
          uint32_t bfr[4];
          ldsm_x4(bfr, Ks + ((nt + (mi >> 1)) * 8 + mr) * STR + ks * 16 + (mi & 1) * 8);
          mma16816(sacc[nt], af, bfr, T{});
          mma16816(sacc[nt + 1], af, bfr + 2, T{});
        }
      }
    }
    // scale, mask, causal modes; non-finite scores flag the row; log2 domain
    float mx_lo = -INFINITY, mx_hi = -INFINITY;
    const bool fast = kV2 && j0 + BC <= interior;
    if (fast) {  // raw products: the max first, scaled once (sl2 > 0 keeps the order)
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt) {
        mx_lo = fmaxf(mx_lo, fmaxf(sacc[nt][0], sacc[nt][1]));
        mx_hi = fmaxf(mx_hi, fmaxf(sacc[nt][2], sacc[nt][3]));
      }
      mx_lo *= sl2l;
      mx_hi *= sl2l;
    } else {
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool hi = e >= 2;
        const int64_t i = hi ? i_hi : i_lo, lim = hi ? lim_hi : lim_lo, band = hi ? band_hi : band_lo;
        const int64_t j = j0 + nt * 8 + 2 * t + (e & 1);
        float s = -INFINITY;
        if (j < lim) {
          s = sacc[nt][e] * sl2;
          if (a.mask_kind == MXF_MASK_ADDITIVE) {
            s += to_f(Mg[b * a.m_sb + h * a.m_sh + i * a.m_sq + j * a.m_sk]);
          } else if (a.mask_kind == MXF_MASK_BOOLEAN) {
            if (to_f(Mg[b * a.m_sb + h * a.m_sh + i * a.m_sq + j * a.m_sk]) == 0.f) s = a.mask_value;
          }
          if (transform && j >= band) s = a.causal == MXF_CAUSAL_ADD ? s + a.mask_value : a.mask_value;
          if (isnan(s) || s == INFINITY) {  // the row's output is NaN, as MXNet's softmax gives it
            if (hi) bad_hi = true; else bad_lo = true;
            s = -INFINITY;
          }
          s *= kLog2e;
        }
        sacc[nt][e] = s;
        if (hi) mx_hi = fmaxf(mx_hi, s); else mx_lo = fmaxf(mx_lo, s);
      }
    }
    }
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
    const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);
    const float mu_lo = mn_lo == -INFINITY ? 0.f : mn_lo, mu_hi = mn_hi == -INFINITY ? 0.f : mn_hi;
    const float al_lo = exp2f(m_lo - mu_lo), al_hi = exp2f(m_hi - mu_hi);
    m_lo = mn_lo;
    m_hi = mn_hi;
    float ps_lo = 0.f, ps_hi = 0.f;
    if (fast) {  // p = 2^(x * scale * log2e - max): one FFMA and the exp2
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt) {
        sacc[nt][0] = exp2f(fmaf(sacc[nt][0], sl2l, -mu_lo));
        sacc[nt][1] = exp2f(fmaf(sacc[nt][1], sl2l, -mu_lo));
        sacc[nt][2] = exp2f(fmaf(sacc[nt][2], sl2l, -mu_hi));
        sacc[nt][3] = exp2f(fmaf(sacc[nt][3], sl2l, -mu_hi));
        ps_lo += sacc[nt][0] + sacc[nt][1];
        ps_hi += sacc[nt][2] + sacc[nt][3];
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt) {
        sacc[nt][0] = exp2f(sacc[nt][0] - mu_lo);
        sacc[nt][1] = exp2f(sacc[nt][1] - mu_lo);
        sacc[nt][2] = exp2f(sacc[nt][2] - mu_hi);
        sacc[nt][3] = exp2f(sacc[nt][3] - mu_hi);
        ps_lo += sacc[nt][0] + sacc[nt][1];
        ps_hi += sacc[nt][2] + sacc[nt][3];
      }
    }
    l_lo = l_lo * al_lo + ps_lo;
    l_hi = l_hi * al_hi + ps_hi;
#pragma unroll
    for (int nd = 0; nd < DMAX / 8; ++nd) {
      oacc[nd][0] *= al_lo;
      oacc[nd][1] *= al_lo;
      oacc[nd][2] *= al_hi;
      oacc[nd][3] *= al_hi;
    }
    // O += P V: the score accumulators of n-tiles 2kk, 2kk+1 are the A operand of k-step kk
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      uint32_t pa[4];
      pa[0] = pack2(sacc[2 * kk][0], sacc[2 * kk][1], T{});
      pa[1] = pack2(sacc[2 * kk][2], sacc[2 * kk][3], T{});
      pa[2] = pack2(sacc[2 * kk + 1][0], sacc[2 * kk + 1][1], T{});
      pa[3] = pack2(sacc[2 * kk + 1][2], sacc[2 * kk + 1][3], T{});
      // B operands of n-tiles nd, nd+1: V rows (keys kk*16..+15) x 16 columns, transposed
      const int mi = lane >> 3, mr = lane & 7;
      const T* v0 = Vs + (kk * 16 + (mi & 1) * 8 + mr) * STR + (mi >> 1) * 8;
#pragma unroll
      for (int nd = 0; nd < DMAX / 8; nd += 2) {
        if (nd < dsteps) {
          uint32_t bfr[4];
          ldsm_x4_trans(bfr, v0 + nd * 8);
          mma16816(oacc[nd], pa, bfr, T{});
          if (nd + 1 < dsteps) mma16816(oacc[nd + 1], pa, bfr + 2, T{});
        }
      }
    }
    __syncthreads();  // this stage's readers are done before the next step refills it
  }
  cp_async_wait<0>();  // nothing left in flight (no key tile at all: Q's copies)
  if (kV2) __syncthreads();  // every thread's Q copies landed before a warp reuses its Q rows

  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
  l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
  l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
  bad_lo = __shfl_xor_sync(0xffffffffu, bad_lo ? 1 : 0, 1) | __shfl_xor_sync(0xffffffffu, bad_lo ? 1 : 0, 2) | bad_lo;
  bad_hi = __shfl_xor_sync(0xffffffffu, bad_hi ? 1 : 0, 1) | __shfl_xor_sync(0xffffffffu, bad_hi ? 1 : 0, 2) | bad_hi;
  if (kV2) {  // an interior tile's NaN / +inf score made the row's sum NaN
    bad_lo |= isnan(l_lo);
    bad_hi |= isnan(l_hi);
  }
  // kV2: the warp's 16 output rows staged in its own rows of the Q tile (no other warp reads them)
  const bool staged = kV2 && P.vec_o;
  T* Ow = Qs + warp * 16 * STR;
  const bool skips = a.causal != MXF_CAUSAL_NONE || a.mask_kind == MXF_MASK_VALID_LENGTH;
  T* Og = static_cast<T*>(a.o) + b * a.o_bs + h * a.o_hs;
#pragma unroll
  for (int half_ = 0; half_ < 2; ++half_) {
    const int64_t i = half_ ? i_hi : i_lo, lim = half_ ? lim_hi : lim_lo;
    if (i >= a.Sq) continue;
    const float l = half_ ? l_hi : l_lo, m = half_ ? m_hi : m_lo;
    const bool bad = half_ ? bad_hi : bad_lo, touched = lim > 0;
    if (a.lse && t == 0)
      a.lse[n * a.Sq + i] = bad ? nanf("") : (l > 0.f ? (m + log2f(l)) * kLn2 : (touched ? nanf("") : INFINITY));
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float fill = (bad || touched) ? nanf("") : 0.f;
#pragma unroll
    for (int nd = 0; nd < DMAX / 8; ++nd) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t d = nd * 8 + 2 * t + e;
        if (d >= a.Dv) continue;
        float y = (!bad && l > 0.f) ? oacc[nd][half_ * 2 + e] * inv : fill;
        if (skips && lim < a.Sk && P.lastbad[n * a.Dv + d] >= lim) y = nanf("");
        if (staged) Ow[(g + half_ * 8) * STR + d] = from_f<T>(y);
        else Og[i * a.o_rs + d] = from_f<T>(y);
      }
    }
  }
  if (staged) {
    __syncwarp();
    const int chunks = static_cast<int>(a.Dv / 8);  // 16-byte pieces of a row
    for (int c = lane; c < 16 * chunks; c += 32) {
      const int r = c / chunks, d = (c % chunks) * 8;
      const int64_t i = row0 + warp * 16 + r;
      if (i < a.Sq) *reinterpret_cast<uint4*>(Og + i * a.o_rs + d) = *reinterpret_cast<const uint4*>(Ow + r * STR + d);
    }
  }
}

// lastbad[n * Dv + d] = the last key j whose v[n, j, d] is not finite (-1: none); out preset to -1.
template <typename T>
__global__ void lastbad_kernel(const mxf_attention_args a, int* __restrict__ out, int64_t chunk) {
  const int64_t n = blockIdx.y, b = n / a.H, h = n % a.H;
  const int64_t j0 = blockIdx.x * chunk, j1 = j0 + chunk < a.Sk ? j0 + chunk : a.Sk;
  const T* V = static_cast<const T*>(a.v) + b * a.v_bs + h * a.v_hs;
  for (int64_t d = threadIdx.x; d < a.Dv; d += blockDim.x) {
    int last = -1;
    for (int64_t j = j0; j < j1; ++j)
      if (!isfinite(to_f(V[j * a.v_rs + d]))) last = static_cast<int>(j);
    if (last >= 0) atomicMax(out + n * a.Dv + d, last);
  }
}

// ------------------------------------------------------------------------------------------
// backward (every dtype), float32 math
// ------------------------------------------------------------------------------------------
constexpr int kBwdThreads = 256;
constexpr int kBwdRows = 16;  // query rows per step

// delta[n * Sq + i] = sum_d dO[i, d] o[i, d]; one warp per row
template <typename T>
__global__ void attention_delta_kernel(const mxf_attention_args a, const T* __restrict__ dout,
                                       float* __restrict__ delta, const int* gate) {
  if (gate && *gate == 0) return;
  const int lane = threadIdx.x & 31;
  const int64_t rows = a.B * a.H * a.Sq, wpb = blockDim.x >> 5;
  for (int64_t row = blockIdx.x * wpb + (threadIdx.x >> 5); row < rows; row += gridDim.x * wpb) {
    const int64_t n = row / a.Sq, i = row % a.Sq, b = n / a.H, h = n % a.H;
    const int64_t off = b * a.o_bs + h * a.o_hs + i * a.o_rs;
    const T* O = static_cast<const T*>(a.o) + off;
    const T* dO = dout + off;
    float s = 0.f;
    for (int64_t d = lane; d < a.Dv; d += 32) s += to_f(dO[d]) * to_f(O[d]);
    s = mxf_cuda::warp_sum(s);
    if (lane == 0) delta[row] = s;
  }
}

struct BwdParams {
  mxf_attention_args a;
  mxf_attention_grads g;
  const float* delta;
  float* dq_acc;     // (N, Sq, D)
  float* dmask_acc;  // dmask_numel, or null
  int bkc;           // keys per block (16 or 32)
  const int* gate;   // null, or run only where *gate != 0 (see attention_backends.h)
};

__device__ __forceinline__ bool gated_off(const int* gate) { return gate && *gate == 0; }

template <typename T>
__global__ void __launch_bounds__(kBwdThreads) attention_bwd_kernel(const BwdParams P) {
  if (gated_off(P.gate)) return;
  const mxf_attention_args& a = P.a;
  const int BK = P.bkc;
  const int64_t D = a.D, Dv = a.Dv, KS = D + 1, VS = Dv + 1;
  extern __shared__ float sm[];
  float* Ks = sm;                       // BK x KS
  float* Vs = Ks + BK * KS;             // BK x VS
  float* dKs = Vs + BK * VS;            // BK x KS
  float* dVs = dKs + BK * KS;           // BK x VS
  float* Qs = dVs + BK * VS;            // 16 x D
  float* dOs = Qs + kBwdRows * D;       // 16 x Dv
  float* Ps = dOs + kBwdRows * Dv;      // 16 x (BK + 1)
  float* dSs = Ps + kBwdRows * (BK + 1);  // 16 x (BK + 1): the scores' gradient reaching q k^T
  __shared__ float s_lse[kBwdRows], s_delta[kBwdRows];
  __shared__ int64_t s_lim[kBwdRows], s_band[kBwdRows];
  const int tid = threadIdx.x;
  const int64_t n = blockIdx.y, b = n / a.H, h = n % a.H;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * BK;
  const T* Qg = static_cast<const T*>(a.q) + b * a.q_bs + h * a.q_hs;
  const T* Kg = static_cast<const T*>(a.k) + b * a.k_bs + h * a.k_hs;
  const T* Vg = static_cast<const T*>(a.v) + b * a.v_bs + h * a.v_hs;
  const T* dOg = static_cast<const T*>(P.g.dout) + b * a.o_bs + h * a.o_hs;
  const T* Mg = static_cast<const T*>(a.mask);
  const bool transform = a.causal == MXF_CAUSAL_ADD || a.causal == MXF_CAUSAL_FILL;
  const float scale = a.scale;

  for (int64_t e = tid; e < BK * D; e += blockDim.x) {
    const int64_t c = e / D, d = e % D;
    Ks[c * KS + d] = j0 + c < a.Sk ? to_f(Kg[(j0 + c) * a.k_rs + d]) : 0.f;
    dKs[c * KS + d] = 0.f;
  }
  for (int64_t e = tid; e < BK * Dv; e += blockDim.x) {
    const int64_t c = e / Dv, d = e % Dv;
    Vs[c * VS + d] = j0 + c < a.Sk ? to_f(Vg[(j0 + c) * a.v_rs + d]) : 0.f;
    dVs[c * VS + d] = 0.f;
  }
  // rows before i0 see none of these keys (causal exclude)
  int64_t i0 = 0;
  if (a.causal == MXF_CAUSAL_EXCLUDE) {
    const int64_t first = j0 - (a.Sk - a.Sq);
    i0 = first > 0 ? first : 0;
  }
  for (; i0 < a.Sq; i0 += kBwdRows) {
    __syncthreads();  // the previous step's readers are done
    const int rows = static_cast<int>(a.Sq - i0 < kBwdRows ? a.Sq - i0 : kBwdRows);
    for (int64_t e = tid; e < kBwdRows * D; e += blockDim.x) {
      const int64_t r = e / D, d = e % D;
      Qs[e] = r < rows ? to_f(Qg[(i0 + r) * a.q_rs + d]) : 0.f;
    }
    for (int64_t e = tid; e < kBwdRows * Dv; e += blockDim.x) {
      const int64_t r = e / Dv, d = e % Dv;
      dOs[e] = r < rows ? to_f(dOg[(i0 + r) * a.o_rs + d]) : 0.f;
    }
    if (tid < kBwdRows) {
      const int64_t i = i0 + tid;
      int64_t L = 0, band = 0;
      if (tid < rows) {
        L = a.Sk;
        if (a.mask_kind == MXF_MASK_VALID_LENGTH) {
          const int64_t len = a.lengths[n * a.len_sn + i * a.len_sq];
          L = len < 0 ? 0 : (len > a.Sk ? a.Sk : len);
        }
        band = L;
        if (a.causal != MXF_CAUSAL_NONE) {
          const int64_t c = i + (a.Sk - a.Sq) + 1;
          band = c < L ? (c < 0 ? 0 : c) : L;
        }
        s_lse[tid] = a.lse[n * a.Sq + i];
        s_delta[tid] = P.delta[n * a.Sq + i];
      }
      s_band[tid] = band;
      s_lim[tid] = transform ? L : band;
    }
    __syncthreads();
    // P and dS of the 16 x BK block
    for (int e = tid; e < kBwdRows * BK; e += blockDim.x) {
      const int r = e / BK, c = e % BK;
      const int64_t i = i0 + r, j = j0 + c;
      float p = 0.f, ds_qk = 0.f, ds = 0.f;
      if (r < rows && j < s_lim[r]) {
        float qk = 0.f;
        for (int64_t d = 0; d < D; ++d) qk += Qs[r * D + d] * Ks[c * KS + d];
        float s = qk * scale;
        bool from_qk = true;
        int64_t moff = 0;
        if (a.mask_kind == MXF_MASK_ADDITIVE) {
          moff = b * a.m_sb + h * a.m_sh + i * a.m_sq + j * a.m_sk;
          s += to_f(Mg[moff]);
        } else if (a.mask_kind == MXF_MASK_BOOLEAN) {
          if (to_f(Mg[b * a.m_sb + h * a.m_sh + i * a.m_sq + j * a.m_sk]) == 0.f) {
            s = a.mask_value;
            from_qk = false;
          }
        }
        if (transform && j >= s_band[r]) {
          if (a.causal == MXF_CAUSAL_ADD) {
            s += a.mask_value;
          } else {
            s = a.mask_value;
            from_qk = false;
          }
        }
        p = expf(s - s_lse[r]);
        float dp = 0.f;
        for (int64_t d = 0; d < Dv; ++d) dp += dOs[r * Dv + d] * Vs[c * VS + d];
        ds = p * (dp - s_delta[r]);
        ds_qk = from_qk ? ds : 0.f;
        // a mask shared by the query rows gets its gradient summed over the step's rows below
        if (P.dmask_acc && a.mask_kind == MXF_MASK_ADDITIVE && a.m_sq != 0) atomicAdd(P.dmask_acc + moff, ds);
      }
      Ps[r * (BK + 1) + c] = p;
      dSs[r * (BK + 1) + c] = ds_qk;
    }
    __syncthreads();
    if (P.dmask_acc && a.mask_kind == MXF_MASK_ADDITIVE && a.m_sq == 0)  // (dSs = dS for additive masks)
      for (int c = tid; c < BK && j0 + c < a.Sk; c += blockDim.x) {
        float acc = 0.f;
        for (int r = 0; r < rows; ++r) acc += dSs[r * (BK + 1) + c];
        atomicAdd(P.dmask_acc + b * a.m_sb + h * a.m_sh + (j0 + c) * a.m_sk, acc);
      }
    // dv += P^T dO, dk += scale dS^T q
    for (int64_t e = tid; e < BK * Dv; e += blockDim.x) {
      const int64_t c = e / Dv, d = e % Dv;
      float acc = 0.f;
      for (int r = 0; r < rows; ++r) acc += Ps[r * (BK + 1) + c] * dOs[r * Dv + d];
      dVs[c * VS + d] += acc;
    }
    for (int64_t e = tid; e < BK * D; e += blockDim.x) {
      const int64_t c = e / D, d = e % D;
      float acc = 0.f;
      for (int r = 0; r < rows; ++r) acc += dSs[r * (BK + 1) + c] * Qs[r * D + d];
      dKs[c * KS + d] += acc * scale;
    }
    // dq += scale dS k, into the float32 accumulator
    const int nk = static_cast<int>(a.Sk - j0 < BK ? a.Sk - j0 : BK);
    for (int64_t e = tid; e < static_cast<int64_t>(rows) * D; e += blockDim.x) {
      const int64_t r = e / D, d = e % D;
      float acc = 0.f;
      for (int c = 0; c < nk; ++c) acc += dSs[r * (BK + 1) + c] * Ks[c * KS + d];
      if (acc != 0.f || acc != acc) atomicAdd(P.dq_acc + (n * a.Sq + i0 + r) * D + d, acc * scale);
    }
  }
  __syncthreads();
  T* dK = static_cast<T*>(P.g.dk) + b * a.k_bs + h * a.k_hs;
  T* dV = static_cast<T*>(P.g.dv) + b * a.v_bs + h * a.v_hs;
  if (P.g.req_dk != MXF_REQ_NULL)
    for (int64_t e = tid; e < BK * D; e += blockDim.x) {
      const int64_t c = e / D, d = e % D;
      if (j0 + c < a.Sk) mxf_cuda::store_req(dK + (j0 + c) * a.k_rs + d, dKs[c * KS + d], P.g.req_dk);
    }
  if (P.g.req_dv != MXF_REQ_NULL)
    for (int64_t e = tid; e < BK * Dv; e += blockDim.x) {
      const int64_t c = e / Dv, d = e % Dv;
      if (j0 + c < a.Sk) mxf_cuda::store_req(dV + (j0 + c) * a.v_rs + d, dVs[c * VS + d], P.g.req_dv);
    }
}

template <typename T>
__global__ void dq_finish_kernel(const mxf_attention_args a, const float* __restrict__ acc, T* __restrict__ dq,
                                 int req, const int* gate) {
  if (gate && *gate == 0) return;
  const int64_t total = a.B * a.H * a.Sq * a.D;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t d = e % a.D, row = e / a.D, i = row % a.Sq, n = row / a.Sq, b = n / a.H, h = n % a.H;
    mxf_cuda::store_req(dq + b * a.q_bs + h * a.q_hs + i * a.q_rs + d, acc[e], req);
  }
}

template <typename T>
__global__ void flat_finish_kernel(const float* __restrict__ acc, T* __restrict__ out, int64_t n, int req,
                                   const int* gate) {
  if (gate && *gate == 0) return;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    mxf_cuda::store_req(out + e, acc[e], req);
}

// memset to 0 of n bytes at p (4-byte aligned) that a gate can switch off
__global__ void zero_kernel(unsigned char* __restrict__ p, int64_t n, const int* gate) {
  if (gate && *gate == 0) return;
  const int64_t n4 = n / 4, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t t0 = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (int64_t e = t0; e < n4; e += stride) reinterpret_cast<unsigned*>(p)[e] = 0u;
  for (int64_t e = n4 * 4 + t0; e < n; e += stride) p[e] = 0;
}

unsigned grid_1d(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 * 16 ? 65535 * 16 : b));
}

bool args_ok(const mxf_attention_args* a) {
  if (!a || mxf_cuda::dtype_bytes(a->dtype) == 0) return false;
  if (a->D <= 0 || a->Dv <= 0 || a->D > kMaxD || a->Dv > kMaxD) return false;
  if (a->B < 0 || a->H <= 0 || a->Sq < 0 || a->Sk < 0) return false;
  if (a->mask_kind < MXF_MASK_NONE || a->mask_kind > MXF_MASK_VALID_LENGTH) return false;
  if (a->causal < MXF_CAUSAL_NONE || a->causal > MXF_CAUSAL_FILL) return false;
  if ((a->causal == MXF_CAUSAL_ADD || a->causal == MXF_CAUSAL_FILL) && a->mask_kind != MXF_MASK_NONE) return false;
  if ((a->mask_kind == MXF_MASK_ADDITIVE || a->mask_kind == MXF_MASK_BOOLEAN) && !a->mask) return false;
  if (a->mask_kind == MXF_MASK_VALID_LENGTH && !a->lengths) return false;
  return a->B * a->H < 65536 && a->Sk < 0x7fffffff;
}

bool skipping(const mxf_attention_args* a) {
  return a->causal != MXF_CAUSAL_NONE || a->mask_kind == MXF_MASK_VALID_LENGTH;
}

__host__ __device__ bool vec_ok(const void* p, int64_t bs, int64_t hs, int64_t rs) {
  return mxf_cuda::aligned16(p) && bs % 8 == 0 && hs % 8 == 0 && rs % 8 == 0;
}

// fp16 / bf16 backward on tensor cores (D, Dv <= 128).  A block of 4 warps owns 64 keys of one
// (b, h), 16 per warp, and walks the query tiles of BR rows that see them.  Per tile each warp
// computes, for its keys, S^T = K Q^T and dP^T = V dO^T (mma.sync, fp32), turns them into
// P^T = exp(s - lse) and dS^T = P^T (dP^T - delta) in registers, accumulates dV += P^T dO and
// dK += dS^T Q in registers (the accumulators become A operands directly), and leaves dS^T in
// shared memory, from which the block computes dQ = dS K and adds it to the float32 workspace.
template <typename T, int DMAX, int BR>
__global__ void __launch_bounds__(kMmaWarps * 32) attention_bwd_mma_kernel(const BwdParams P) {
  if (gated_off(P.gate)) return;
  constexpr int BC = 16 * kMmaWarps;  // keys per block
  constexpr int STR = DMAX + 8, SSTR = BR + 8;
  constexpr int MT = BR / 16, NT = DMAX / 8;             // dQ tiles: MT x NT over 4 warps
  constexpr int WN = NT * MT / kMmaWarps;                 // n-tiles per warp in dQ
  static_assert(WN >= 2 && WN % 2 == 0 && (kMmaWarps % MT == 0), "dQ tiling");
  const mxf_attention_args& a = P.a;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Ks = reinterpret_cast<T*>(smem_raw);
  T* Vs = Ks + BC * STR;
  T* Qs = Vs + BC * STR;
  T* dOs = Qs + BR * STR;
  T* dSt = dOs + BR * STR;  // BC x SSTR: dS^T of the step, as T
  __shared__ float s_lse[BR], s_delta[BR];
  __shared__ int64_t s_lim[BR], s_band[BR];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3, mi = lane >> 3, mr = lane & 7;
  const int64_t n = blockIdx.y, b = n / a.H, h = n % a.H;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * BC;
  const T* Qg = static_cast<const T*>(a.q) + b * a.q_bs + h * a.q_hs;
  const T* Kg = static_cast<const T*>(a.k) + b * a.k_bs + h * a.k_hs;
  const T* Vg = static_cast<const T*>(a.v) + b * a.v_bs + h * a.v_hs;
  const T* dOg = static_cast<const T*>(P.g.dout) + b * a.o_bs + h * a.o_hs;
  const T* Mg = static_cast<const T*>(a.mask);
  const bool transform = a.causal == MXF_CAUSAL_ADD || a.causal == MXF_CAUSAL_FILL;
  const bool vec_q = vec_ok(a.q, a.q_bs, a.q_hs, a.q_rs), vec_o = vec_ok(P.g.dout, a.o_bs, a.o_hs, a.o_rs);
  const int ksteps = static_cast<int>((a.D + 15) / 16), vsteps = static_cast<int>((a.Dv + 15) / 16);
  const int dsteps = static_cast<int>((a.D + 7) / 8), dvsteps = static_cast<int>((a.Dv + 7) / 8);
  const float scale = a.scale;

  load_tile<T, DMAX>(Ks, Kg, a.k_rs, j0, BC, a.Sk, a.D, vec_ok(a.k, a.k_bs, a.k_hs, a.k_rs));
  load_tile<T, DMAX>(Vs, Vg, a.v_rs, j0, BC, a.Sk, a.Dv, vec_ok(a.v, a.v_bs, a.v_hs, a.v_rs));
  cp_async_commit();

  const int kw = warp * 16;  // the warp's keys in the block: kw + g, kw + g + 8
  const int64_t jlo = j0 + kw + g, jhi = jlo + 8;
  float dv[DMAX / 8][4], dk[DMAX / 8][4];
#pragma unroll
  for (int i = 0; i < DMAX / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dv[i][e] = dk[i][e] = 0.f;

  int64_t i0 = 0;
  if (a.causal == MXF_CAUSAL_EXCLUDE) {  // rows before j0 - (Sk - Sq) see none of these keys
    const int64_t first = j0 - (a.Sk - a.Sq);
    i0 = first > 0 ? first : 0;
  }
  for (; i0 < a.Sq; i0 += BR) {
    __syncthreads();  // the previous step's readers of Qs, dOs, dSt are done
    const int rows = static_cast<int>(a.Sq - i0 < BR ? a.Sq - i0 : BR);
    load_tile<T, DMAX>(Qs, Qg, a.q_rs, i0, BR, a.Sq, a.D, vec_q);
    load_tile<T, DMAX>(dOs, dOg, a.o_rs, i0, BR, a.Sq, a.Dv, vec_o);
    cp_async_commit();
    if (threadIdx.x < BR) {
      const int r = threadIdx.x;
      const int64_t i = i0 + r;
      int64_t L = 0, band = 0;
      if (r < rows) {
        L = a.Sk;
        if (a.mask_kind == MXF_MASK_VALID_LENGTH) {
          const int64_t len = a.lengths[n * a.len_sn + i * a.len_sq];
          L = len < 0 ? 0 : (len > a.Sk ? a.Sk : len);
        }
        band = L;
        if (a.causal != MXF_CAUSAL_NONE) {
          const int64_t c = i + (a.Sk - a.Sq) + 1;
          band = c < L ? (c < 0 ? 0 : c) : L;
        }
        s_lse[r] = a.lse[n * a.Sq + i];
        s_delta[r] = P.delta[n * a.Sq + i];
      }
      s_band[r] = band;
      s_lim[r] = transform ? L : band;
    }
    cp_async_wait<0>();
    __syncthreads();

    // S^T (16 keys x BR queries) = K_w Q^T and dP^T = V_w dO^T
    float st[BR / 8][4], dpt[BR / 8][4];
#pragma unroll
    for (int i = 0; i < BR / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < DMAX / 16; ++ks) {
      if (ks < ksteps) {
        const T* k0 = Ks + (kw + g) * STR + ks * 16 + 2 * t;
        uint32_t af[4];
        af[0] = *reinterpret_cast<const uint32_t*>(k0);
        af[1] = *reinterpret_cast<const uint32_t*>(k0 + 8 * STR);
        af[2] = *reinterpret_cast<const uint32_t*>(k0 + 8);
        af[3] = *reinterpret_cast<const uint32_t*>(k0 + 8 * STR + 8);
#pragma unroll
        for (int nt = 0; nt < BR / 8; nt += 2) {
          uint32_t bfr[4];
          ldsm_x4(bfr, Qs + ((nt + (mi >> 1)) * 8 + mr) * STR + ks * 16 + (mi & 1) * 8);
          mma16816(st[nt], af, bfr, T{});
          mma16816(st[nt + 1], af, bfr + 2, T{});
        }
      }
      if (ks < vsteps) {
        const T* v0 = Vs + (kw + g) * STR + ks * 16 + 2 * t;
        uint32_t af[4];
        af[0] = *reinterpret_cast<const uint32_t*>(v0);
        af[1] = *reinterpret_cast<const uint32_t*>(v0 + 8 * STR);
        af[2] = *reinterpret_cast<const uint32_t*>(v0 + 8);
        af[3] = *reinterpret_cast<const uint32_t*>(v0 + 8 * STR + 8);
#pragma unroll
        for (int nt = 0; nt < BR / 8; nt += 2) {
          uint32_t bfr[4];
          ldsm_x4(bfr, dOs + ((nt + (mi >> 1)) * 8 + mr) * STR + ks * 16 + (mi & 1) * 8);
          mma16816(dpt[nt], af, bfr, T{});
          mma16816(dpt[nt + 1], af, bfr + 2, T{});
        }
      }
    }
    // P^T, dS^T (the part reaching q k^T in dpt), the additive mask's gradient
    float dm_lo = 0.f, dm_hi = 0.f;
    const bool dmask = P.dmask_acc && a.mask_kind == MXF_MASK_ADDITIVE;
#pragma unroll
    for (int nt = 0; nt < BR / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = nt * 8 + 2 * t + (e & 1);
        const int64_t i = i0 + r, j = e >= 2 ? jhi : jlo;
        float p = 0.f, ds = 0.f, dsq = 0.f;
        if (r < rows && j < s_lim[r]) {
          float s = st[nt][e] * scale;
          bool from_qk = true;
          int64_t moff = 0;
          if (a.mask_kind == MXF_MASK_ADDITIVE) {
            moff = b * a.m_sb + h * a.m_sh + i * a.m_sq + j * a.m_sk;
            s += to_f(Mg[moff]);
          } else if (a.mask_kind == MXF_MASK_BOOLEAN) {
            if (to_f(Mg[b * a.m_sb + h * a.m_sh + i * a.m_sq + j * a.m_sk]) == 0.f) {
              s = a.mask_value;
              from_qk = false;
            }
          }
          if (transform && j >= s_band[r]) {
            if (a.causal == MXF_CAUSAL_ADD) {
              s += a.mask_value;
            } else {
              s = a.mask_value;
              from_qk = false;
            }
          }
          p = expf(s - s_lse[r]);
          ds = p * (dpt[nt][e] - s_delta[r]);
          dsq = from_qk ? ds : 0.f;
          if (dmask) {
            if (a.m_sq != 0) atomicAdd(P.dmask_acc + moff, ds);
            else if (e >= 2) dm_hi += ds;
            else dm_lo += ds;
          }
        }
        st[nt][e] = p;
        dpt[nt][e] = dsq;
      }
    }
    if (dmask && a.m_sq == 0) {  // a mask shared by the query rows: one add per key and step
      dm_lo += __shfl_xor_sync(0xffffffffu, dm_lo, 1);
      dm_lo += __shfl_xor_sync(0xffffffffu, dm_lo, 2);
      dm_hi += __shfl_xor_sync(0xffffffffu, dm_hi, 1);
      dm_hi += __shfl_xor_sync(0xffffffffu, dm_hi, 2);
      if (t == 0 && jlo < a.Sk) atomicAdd(P.dmask_acc + b * a.m_sb + h * a.m_sh + jlo * a.m_sk, dm_lo);
      if (t == 0 && jhi < a.Sk) atomicAdd(P.dmask_acc + b * a.m_sb + h * a.m_sh + jhi * a.m_sk, dm_hi);
    }
    // dV += P^T dO, dK += dS^T Q: the accumulators of n-tiles 2kk, 2kk+1 are the A operand of k-step kk
#pragma unroll
    for (int kk = 0; kk < BR / 16; ++kk) {
      uint32_t pa[4], sa[4];
      pa[0] = pack2(st[2 * kk][0], st[2 * kk][1], T{});
      pa[1] = pack2(st[2 * kk][2], st[2 * kk][3], T{});
      pa[2] = pack2(st[2 * kk + 1][0], st[2 * kk + 1][1], T{});
      pa[3] = pack2(st[2 * kk + 1][2], st[2 * kk + 1][3], T{});
      sa[0] = pack2(dpt[2 * kk][0], dpt[2 * kk][1], T{});
      sa[1] = pack2(dpt[2 * kk][2], dpt[2 * kk][3], T{});
      sa[2] = pack2(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1], T{});
      sa[3] = pack2(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3], T{});
      const int row = kk * 16 + (mi & 1) * 8 + mr, col = (mi >> 1) * 8;
#pragma unroll
      for (int nd = 0; nd < DMAX / 8; nd += 2) {
        uint32_t bfr[4];
        if (nd < dvsteps) {
          ldsm_x4_trans(bfr, dOs + row * STR + col + nd * 8);
          mma16816(dv[nd], pa, bfr, T{});
          mma16816(dv[nd + 1], pa, bfr + 2, T{});
        }
        if (nd < dsteps) {
          ldsm_x4_trans(bfr, Qs + row * STR + col + nd * 8);
          mma16816(dk[nd], sa, bfr, T{});
          mma16816(dk[nd + 1], sa, bfr + 2, T{});
        }
      }
    }
    // dS^T to shared memory (rows: the block's keys; columns: the step's queries)
#pragma unroll
    for (int nt = 0; nt < BR / 8; ++nt) {
      T* d0 = dSt + (kw + g) * SSTR + nt * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(d0) = pack2(dpt[nt][0], dpt[nt][1], T{});
      *reinterpret_cast<uint32_t*>(d0 + 8 * SSTR) = pack2(dpt[nt][2], dpt[nt][3], T{});
    }
    __syncthreads();
    // dQ (BR x D) = dS (BR x BC) K (BC x D): warp -> m-tile warp % MT, n-tiles [n0, n0 + WN)
    {
      const int mq = warp % MT, n0 = (warp / MT) * WN;
      float dq[WN][4];
#pragma unroll
      for (int i = 0; i < WN; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) {
        uint32_t af[4];  // A = dS (queries x keys) from dS^T, transposed by ldmatrix
        ldsm_x4_trans(af, dSt + (kk * 16 + (mi >> 1) * 8 + mr) * SSTR + mq * 16 + (mi & 1) * 8);
        const int row = kk * 16 + (mi & 1) * 8 + mr, col = (mi >> 1) * 8;
#pragma unroll
        for (int q = 0; q < WN; q += 2) {
          if (n0 + q < dsteps) {
            uint32_t bfr[4];
            ldsm_x4_trans(bfr, Ks + row * STR + col + (n0 + q) * 8);
            mma16816(dq[q], af, bfr, T{});
            mma16816(dq[q + 1], af, bfr + 2, T{});
          }
        }
      }
#pragma unroll
      for (int q = 0; q < WN; ++q) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = mq * 16 + g + (e >= 2 ? 8 : 0);
          const int64_t d = (n0 + q) * 8 + 2 * t + (e & 1);
          const float v = dq[q][e] * scale;
          if (r < rows && d < a.D && v != 0.f) atomicAdd(P.dq_acc + (n * a.Sq + i0 + r) * a.D + d, v);
        }
      }
    }
  }
  cp_async_wait<0>();  // no query step at all: K / V copies
  __syncthreads();
  T* dK = static_cast<T*>(P.g.dk) + b * a.k_bs + h * a.k_hs;
  T* dV = static_cast<T*>(P.g.dv) + b * a.v_bs + h * a.v_hs;
#pragma unroll
  for (int nd = 0; nd < DMAX / 8; ++nd) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t j = e >= 2 ? jhi : jlo, d = nd * 8 + 2 * t + (e & 1);
      if (j >= a.Sk) continue;
      if (P.g.req_dk != MXF_REQ_NULL && d < a.D)
        mxf_cuda::store_req(dK + j * a.k_rs + d, dk[nd][e] * scale, P.g.req_dk);
      if (P.g.req_dv != MXF_REQ_NULL && d < a.Dv) mxf_cuda::store_req(dV + j * a.v_rs + d, dv[nd][e], P.g.req_dv);
    }
  }
}

template <typename T, int DMAX, int BR>
int launch_bwd_mma(const BwdParams& P, cudaStream_t st) {
  constexpr int BC = 16 * kMmaWarps;
  const size_t smem = sizeof(T) * ((2 * BC + 2 * BR) * (DMAX + 8) + BC * (BR + 8));
  auto kernel = attention_bwd_mma_kernel<T, DMAX, BR>;
  if (smem > 48 * 1024)
    MXF_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  dim3 grid(static_cast<unsigned>((P.a.Sk + BC - 1) / BC), static_cast<unsigned>(P.a.B * P.a.H));
  kernel<<<grid, kMmaWarps * 32, smem, st>>>(P);
  MXF_CUDA_RETURN_LAST();
}

bool own_kernel_v1() {  // MXFUSION_ATTN_OWN_KERNEL=v1: the forward kernel before the kV2 changes
  static const bool v1 = [] {
    const char* e = std::getenv("MXFUSION_ATTN_OWN_KERNEL");
    return e && std::string(e) == "v1";
  }();
  return v1;
}

template <typename T, int DMAX, int BC>
int launch_mma(const MmaParams& P, cudaStream_t st) {
  const mxf_attention_args& a = P.a;
  const size_t smem = sizeof(T) * (kBR + 4 * BC) * (DMAX + 8);  // Q + two stages of K, V
  auto kernel = own_kernel_v1() ? attention_fwd_mma_kernel<T, DMAX, BC, false> : attention_fwd_mma_kernel<T, DMAX, BC, true>;
  if (smem > 48 * 1024)
    MXF_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  dim3 grid(static_cast<unsigned>((a.Sq + kBR - 1) / kBR), static_cast<unsigned>(a.B * a.H));
  kernel<<<grid, kMmaWarps * 32, smem, st>>>(P);
  MXF_CUDA_RETURN_LAST();
}

size_t fwd_ws(const mxf_attention_args* a) {
  if (a->dtype == MXF_F32 || !skipping(a)) return 0;
  return mxf_cuda::align256(static_cast<size_t>(a->B * a->H * a->Dv) * sizeof(int));
}

struct BwdPlan {
  size_t delta_off, dq_off, dm_off, total;
  int bkc;
  size_t smem;
};
BwdPlan bwd_plan(const mxf_attention_args* a, const mxf_attention_grads* g) {
  BwdPlan p{};
  using mxf_cuda::align256;
  const int64_t N = a->B * a->H;
  size_t off = 0;
  p.delta_off = off; off += align256(static_cast<size_t>(N * a->Sq) * sizeof(float));
  p.dq_off = off; off += align256(static_cast<size_t>(N * a->Sq * a->D) * sizeof(float));
  p.dm_off = off;
  if (g && g->dmask && g->req_dmask != MXF_REQ_NULL && a->mask_kind == MXF_MASK_ADDITIVE)
    off += align256(static_cast<size_t>(g->dmask_numel) * sizeof(float));
  p.total = off;
  p.bkc = a->D + a->Dv > 256 ? 16 : 32;
  p.smem = sizeof(float) * (static_cast<size_t>(p.bkc) * 2 * ((a->D + 1) + (a->Dv + 1)) +
                            kBwdRows * (a->D + a->Dv) + 2 * kBwdRows * (p.bkc + 1));
  return p;
}

}  // namespace

namespace mxf_attn {

bool args_valid(const mxf_attention_args* a) { return args_ok(a); }

size_t own_forward_ws(const mxf_attention_args* args) { return args_ok(args) ? fwd_ws(args) : 0; }

int own_forward(const mxf_attention_args* args, void* workspace, size_t workspace_size, cudaStream_t st) {
  if (!args_ok(args)) return MXF_ERR_BAD_ARGS;
  const int64_t N = args->B * args->H;
  if (N == 0 || args->Sq == 0) return 0;
  if (args->dtype == MXF_F32) {
    dim3 grid(static_cast<unsigned>((args->Sq + kRows - 1) / kRows), static_cast<unsigned>(N));
    const size_t shmem = sizeof(float) * kTile * (args->D + args->Dv);
    if (shmem > 48 * 1024)  // D + Dv > 384 needs the opt-in shared memory size
      MXF_CUDA_TRY(cudaFuncSetAttribute(attention_fwd_f32_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(shmem)));
    attention_fwd_f32_kernel<<<grid, kWarps * 32, shmem, st>>>(*args);
    MXF_CUDA_RETURN_LAST();
  }
  const size_t need = fwd_ws(args);
  if (need > 0 && (!workspace || workspace_size < need)) return MXF_ERR_WORKSPACE;
  MmaParams P{};
  P.a = *args;
  P.lastbad = static_cast<const int*>(workspace);
  P.vec_q = vec_ok(args->q, args->q_bs, args->q_hs, args->q_rs);
  P.vec_k = vec_ok(args->k, args->k_bs, args->k_hs, args->k_rs);
  P.vec_v = vec_ok(args->v, args->v_bs, args->v_hs, args->v_rs);
  P.vec_o = vec_ok(args->o, args->o_bs, args->o_hs, args->o_rs) && args->Dv % 8 == 0;
  const int64_t dmax = args->D > args->Dv ? args->D : args->Dv;
  return mxf_cuda::dispatch_dtype(args->dtype, [&](auto t) -> int {
    using T = decltype(t);
    if constexpr (std::is_same<T, float>::value) {
      return MXF_ERR_BAD_ARGS;
    } else {
      if (need > 0) {
        MXF_CUDA_TRY(cudaMemsetAsync(workspace, 0xff, need, st));  // -1 everywhere
        const int64_t chunk = 256;
        if (args->Sk > 0) {
          dim3 g(static_cast<unsigned>((args->Sk + chunk - 1) / chunk), static_cast<unsigned>(N));
          lastbad_kernel<T><<<g, 128, 0, st>>>(*args, static_cast<int*>(workspace), chunk);
          MXF_CUDA_TRY(cudaGetLastError());
        }
      }
      if (dmax <= 64) return launch_mma<T, 64, 64>(P, st);
      if (dmax <= 128) return launch_mma<T, 128, 64>(P, st);
      return launch_mma<T, 256, 32>(P, st);
    }
  });
}

size_t own_backward_ws(const mxf_attention_args* args, const mxf_attention_grads* grads) {
  return args_ok(args) ? bwd_plan(args, grads).total : 0;
}

int own_backward(const mxf_attention_args* args, const mxf_attention_grads* grads, void* workspace,
                 size_t workspace_size, cudaStream_t st, const int* gate) {
  if (!args_ok(args) || !grads || !args->lse || !grads->dout) return MXF_ERR_BAD_ARGS;
  for (int q : {grads->req_dq, grads->req_dk, grads->req_dv, grads->req_dmask})
    if (!mxf_cuda::req_ok(q)) return MXF_ERR_BAD_ARGS;
  const BwdPlan plan = bwd_plan(args, grads);
  if (!workspace || workspace_size < plan.total) return MXF_ERR_WORKSPACE;
  const int64_t N = args->B * args->H;
  char* ws = static_cast<char*>(workspace);
  BwdPlan pl = plan;
  BwdParams P{};
  P.a = *args;
  P.g = *grads;
  P.delta = reinterpret_cast<float*>(ws + pl.delta_off);
  P.dq_acc = reinterpret_cast<float*>(ws + pl.dq_off);
  P.dmask_acc = pl.total > pl.dm_off ? reinterpret_cast<float*>(ws + pl.dm_off) : nullptr;
  P.bkc = pl.bkc;
  P.gate = gate;
  const size_t es = mxf_cuda::dtype_bytes(args->dtype);
  auto zero = [&](void* p, size_t bytes) -> int {  // a memset the gate can switch off
    if (!gate) return static_cast<int>(cudaMemsetAsync(p, 0, bytes, st));
    const int64_t n = static_cast<int64_t>(bytes);
    zero_kernel<<<grid_1d(n / 4 + 1, 256), 256, 0, st>>>(static_cast<unsigned char*>(p), n, gate);
    return static_cast<int>(cudaGetLastError());
  };
  if (N == 0) {
    if (P.dmask_acc && grads->req_dmask != MXF_REQ_ADD) MXF_TRY(zero(grads->dmask, grads->dmask_numel * es));
    return 0;
  }
  MXF_TRY(zero(P.dq_acc, static_cast<size_t>(N * args->Sq * args->D) * sizeof(float)));
  if (P.dmask_acc) MXF_TRY(zero(P.dmask_acc, grads->dmask_numel * sizeof(float)));
  return mxf_cuda::dispatch_dtype(args->dtype, [&](auto t) -> int {
    using T = decltype(t);
    if (args->Sq > 0) {
      attention_delta_kernel<T><<<grid_1d(N * args->Sq * 32, 256), 256, 0, st>>>(
          *args, static_cast<const T*>(grads->dout), const_cast<float*>(P.delta), gate);
      MXF_CUDA_TRY(cudaGetLastError());
    }
    if (args->Sk > 0 && (grads->req_dq != MXF_REQ_NULL || grads->req_dk != MXF_REQ_NULL ||
                         grads->req_dv != MXF_REQ_NULL || P.dmask_acc)) {
      const int64_t dmax = args->D > args->Dv ? args->D : args->Dv;
      int rc = -1;
      if constexpr (!std::is_same<T, float>::value) {  // tensor cores for fp16 / bf16, D, Dv <= 128
        if (dmax <= 64) rc = launch_bwd_mma<T, 64, 64>(P, st);
        else if (dmax <= 128) rc = launch_bwd_mma<T, 128, 32>(P, st);
        if (rc > 0) return rc;
      }
      if (rc != 0) {
        auto kernel = attention_bwd_kernel<T>;
        if (pl.smem > 48 * 1024)
          MXF_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(pl.smem)));
        dim3 grid(static_cast<unsigned>((args->Sk + pl.bkc - 1) / pl.bkc), static_cast<unsigned>(N));
        kernel<<<grid, kBwdThreads, pl.smem, st>>>(P);
        MXF_CUDA_TRY(cudaGetLastError());
      }
    }
    if (grads->req_dq != MXF_REQ_NULL && args->Sq > 0)
      dq_finish_kernel<T><<<grid_1d(N * args->Sq * args->D, 256), 256, 0, st>>>(
          *args, P.dq_acc, static_cast<T*>(grads->dq), grads->req_dq, gate);
    if (P.dmask_acc && grads->dmask_numel > 0)
      flat_finish_kernel<T><<<grid_1d(grads->dmask_numel, 256), 256, 0, st>>>(
          P.dmask_acc, static_cast<T*>(grads->dmask), grads->dmask_numel, grads->req_dmask, gate);
    MXF_CUDA_RETURN_LAST();
  });
}

}  // namespace mxf_attn
