// fused_attention on cuDNN's fused flash attention (fp16 / bf16, forward and backward), through the
// cuDNN frontend's C++ graph API (header-only) in its dynamic-loading mode
// (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING): nothing links libcudnn; it is opened at the first call
// (MXFUSION_CUDNN_LIB, a libcudnn.so.9 already in the process, the folder the build found it in,
// then the loader's search path), so a machine without cuDNN still loads libmxfusion_cuda.so and the
// op runs on the project's own kernels there.
//
// What cuDNN is given, and only where it computes the op's exact semantics (cudnn_expressible):
//  - the layouts as strides (the last dim contiguous, 16-byte aligned rows);
//  - causal `exclude` with Sq <= Sk (every row sees a key): bottom-right diagonal alignment,
//    right bound 0 (top-left when Sq == Sk, which cuDNN also combines with a bias or lengths);
//  - valid lengths only when one length per batch element (MXF_LEN_PER_BATCH), never 0
//    (MXF_LEN_NONZERO): cuDNN's padding mask with seq_len_kv (seq_len_q = Sq);
//  - an additive mask as cuDNN's bias (dims of 1 where it broadcasts; dBias in the backward);
//  - the stats (natural-log log-sum-exp, what the op's `lse` is) always, so that the forward's
//    fix-up can find the rows whose scores are NaN, +inf, or all -inf.
// Not given to cuDNN: boolean masks (a fully masked row averages v with the fill value), causal
// add / fill, causal rows with an empty band (Sq > Sk), lengths per head or row or possibly 0,
// head dims that are not multiples of 8 (or above 256), unaligned layouts, req ADD gradients.
//
// Non-finite values, as the unfused graph has them:
//  - forward: a row whose stats are not finite (a NaN / +inf score, or every score -inf) is set to
//    NaN, its lse NaN; where rows skip keys (causal, lengths), a column gets NaN in every row that
//    skips a key whose v is not finite there (0 * inf in the unfused product) -- found by scanning
//    v after the longest row's keys, and, for the keys that row sees, only in the columns where its
//    output is not finite (IEEE arithmetic carries a non-finite v into every row that reads it);
//  - backward: a guard kernel looks for non-finite values in q, k, v, dO and lse; where it finds
//    one, the project's own backward (gated on the guard's flag on the device, no host sync)
//    overwrites cuDNN's gradients.
// Graphs are built once per (thread, device, dtype, shapes, strides, mask kind and broadcast, causal
// alignment, lengths, scale) and cached (a mutex around the cache; one cuDNN handle per thread and
// device, the plans of a thread built and run with its handle).  This file: the semantic check and the kernels around cuDNN's; the frontend's part is
// attention_cudnn_graph.cpp (host C++ only, compiled by the host compiler: the frontend's headers
// are heavy).  None of this has run on a GPU yet: compiled for sm_80 / sm_90 only.
#include "attention_backends.h"
#include "cuda_common.cuh"

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using mxf_cuda::bf16;
using mxf_cuda::from_f;
using mxf_cuda::half;
using mxf_cuda::to_f;

__device__ __forceinline__ bool nonfinite(float x) { return !isfinite(x); }

// seq_q[b] = Sq, seq_kv[b] = the batch element's length clamped to [0, Sk]
__global__ void seqlen_kernel(const mxf_attention_args a, int* __restrict__ seq_q, int* __restrict__ seq_kv) {
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < a.B;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t L = a.lengths[b * a.H * a.len_sn];
    L = L < 0 ? 0 : (L > a.Sk ? a.Sk : L);
    seq_q[b] = static_cast<int>(a.Sq);
    seq_kv[b] = static_cast<int>(L);
  }
}

// Keys row i sees: [0, lim_i).  Causal here is always `exclude` with Sq <= Sk.
__device__ __forceinline__ int64_t row_lim(const mxf_attention_args& a, const int* seq_kv, int64_t b, int64_t i) {
  int64_t L = seq_kv ? seq_kv[b] : a.Sk;
  if (a.causal == MXF_CAUSAL_EXCLUDE) {
    const int64_t c = i + (a.Sk - a.Sq) + 1;
    L = c < L ? c : L;
  }
  return L;
}

// Per head n and value column d: the last key j that some row skips and whose v[j, d] is not
// finite (-1: none), lastbad[n * Dv + d]; lastbad[N * Dv + n] = the largest of them (rows that see
// more keys than that need no fix).  One block per head, threads over the columns.
template <typename T>
__global__ void lastbad_kernel(const mxf_attention_args a, const int* __restrict__ seq_kv, int* __restrict__ lastbad) {
  const int64_t n = blockIdx.x, b = n / a.H, h = n % a.H, N = a.B * a.H;
  const T* V = static_cast<const T*>(a.v) + b * a.v_bs + h * a.v_hs;
  const T* O = static_cast<const T*>(a.o) + b * a.o_bs + h * a.o_hs;
  // the row that sees the most keys: the last one (causal), any one (lengths alone)
  const int64_t wit = a.causal == MXF_CAUSAL_EXCLUDE ? a.Sq - 1 : 0;
  const int64_t lmax = row_lim(a, seq_kv, b, wit);
  __shared__ int s_max;
  if (threadIdx.x == 0) s_max = -1;
  __syncthreads();
  for (int64_t d = threadIdx.x; d < a.Dv; d += blockDim.x) {
    int last = -1;
    for (int64_t j = a.Sk - 1; j >= lmax && last < 0; --j)  // keys no row sees
      if (nonfinite(to_f(V[j * a.v_rs + d]))) last = static_cast<int>(j);
    // keys the widest row sees: a non-finite v there makes that row's output not finite
    if (last < 0 && nonfinite(to_f(O[wit * a.o_rs + d])))
      for (int64_t j = lmax - 1; j >= 0 && last < 0; --j)
        if (nonfinite(to_f(V[j * a.v_rs + d]))) last = static_cast<int>(j);
    lastbad[n * a.Dv + d] = last;
    if (last >= 0) atomicMax(&s_max, last);
  }
  __syncthreads();
  if (threadIdx.x == 0) lastbad[N * a.Dv + n] = s_max;
}

// One warp per row: a row whose stats are not finite becomes NaN (lse NaN); a row that skips a key
// whose v is not finite in column d gets NaN there.
template <typename T>
__global__ void fix_rows_kernel(const mxf_attention_args a, float* __restrict__ stats, const int* __restrict__ lastbad,
                                const int* __restrict__ seq_kv) {
  const int lane = threadIdx.x & 31;
  const int64_t rows = a.B * a.H * a.Sq, N = a.B * a.H, wpb = blockDim.x >> 5;
  for (int64_t r = blockIdx.x * wpb + (threadIdx.x >> 5); r < rows; r += static_cast<int64_t>(gridDim.x) * wpb) {
    const int64_t n = r / a.Sq, i = r % a.Sq, b = n / a.H, h = n % a.H;
    T* O = static_cast<T*>(a.o) + b * a.o_bs + h * a.o_hs + i * a.o_rs;
    const float lse = stats[r];
    if (nonfinite(lse)) {
      for (int64_t d = lane; d < a.Dv; d += 32) O[d] = from_f<T>(nanf(""));
      if (lane == 0) stats[r] = nanf("");
      continue;
    }
    if (!lastbad) continue;
    const int64_t lim = row_lim(a, seq_kv, b, i);
    if (lim >= a.Sk || lastbad[N * a.Dv + n] < lim) continue;
    for (int64_t d = lane; d < a.Dv; d += 32)
      if (lastbad[n * a.Dv + d] >= lim) O[d] = from_f<T>(nanf(""));
  }
}

// *flag = 1 when any element of the (B, H, rows, cols) view at p is not finite: 8 elements
// (16 bytes) a thread, the exponent bits tested (inf and NaN have them all set).
template <typename T>
__global__ void nonfinite_kernel(const T* __restrict__ p, int64_t B, int64_t H, int64_t rows, int64_t cols,
                                 int64_t bs, int64_t hs, int64_t rs, int* __restrict__ flag) {
  const int64_t per_row = cols / 8, total = B * H * rows * per_row;
  const uint16_t expmask = std::is_same<T, half>::value ? 0x7c00u : 0x7f80u;
  bool bad = false;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = (e % per_row) * 8, rr = e / per_row, r = rr % rows, nh = rr / rows;
    const int64_t h = nh % H, b = nh / H;
    const uint4 v = *reinterpret_cast<const uint4*>(p + b * bs + h * hs + r * rs + c);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k)
      bad |= ((w[k] & expmask) == expmask) | (((w[k] >> 16) & expmask) == expmask);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

__global__ void nonfinite_f32_kernel(const float* __restrict__ p, int64_t n, int* __restrict__ flag) {
  bool bad = false;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    bad |= !isfinite(p[e]);
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

unsigned blocks_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 132 * 16 ? 132 * 16 : b));
}

}  // namespace

// ================================================================================================
// Host side.  The frontend is host-only C++: compiled in nvcc's host pass only.
// ================================================================================================
namespace mxf_attn {

int cudnn_launch_seqlen(const mxf_attention_args* a, int* seq, cudaStream_t st) {
  seqlen_kernel<<<blocks_for(a->B, 128), 128, 0, st>>>(*a, seq, seq + a->B);
  return static_cast<int>(cudaGetLastError());
}

int cudnn_launch_fixups(const mxf_attention_args* a, float* stats, int* lastbad, const int* seq_kv, cudaStream_t st) {
  const int64_t N = a->B * a->H;
  return mxf_cuda::dispatch_dtype(a->dtype, [&](auto t) -> int {
    using T = decltype(t);
    if constexpr (std::is_same<T, float>::value) {
      return MXF_ERR_BAD_ARGS;
    } else {
      if (lastbad) lastbad_kernel<T><<<static_cast<unsigned>(N), 128, 0, st>>>(*a, seq_kv, lastbad);
      fix_rows_kernel<T><<<blocks_for(N * a->Sq * 32, 256), 256, 0, st>>>(*a, stats, lastbad, seq_kv);
      return static_cast<int>(cudaGetLastError());
    }
  });
}

int cudnn_launch_guard(const mxf_attention_args* a, const mxf_attention_grads* g, int* flag, cudaStream_t st) {
  MXF_CUDA_TRY(cudaMemsetAsync(flag, 0, sizeof(int), st));
  const int rc = mxf_cuda::dispatch_dtype(a->dtype, [&](auto t) -> int {
    using T = decltype(t);
    if constexpr (std::is_same<T, float>::value) {
      return MXF_ERR_BAD_ARGS;
    } else {
      auto scan = [&](const void* p0, int64_t S, int64_t C, int64_t bs, int64_t hs, int64_t rs) {
        const int64_t n = a->B * a->H * S * (C / 8);
        nonfinite_kernel<T><<<blocks_for(n, 256), 256, 0, st>>>(static_cast<const T*>(p0), a->B, a->H, S, C, bs,
                                                                 hs, rs, flag);
      };
      scan(a->q, a->Sq, a->D, a->q_bs, a->q_hs, a->q_rs);
      scan(a->k, a->Sk, a->D, a->k_bs, a->k_hs, a->k_rs);
      scan(a->v, a->Sk, a->Dv, a->v_bs, a->v_hs, a->v_rs);
      scan(g->dout, a->Sq, a->Dv, a->o_bs, a->o_hs, a->o_rs);
      return 0;
    }
  });
  MXF_TRY(rc);
  const int64_t rows = a->B * a->H * a->Sq;
  nonfinite_f32_kernel<<<blocks_for(rows, 256), 256, 0, st>>>(a->lse, rows, flag);
  return static_cast<int>(cudaGetLastError());
}

bool cudnn_expressible(const mxf_attention_args* a, const mxf_attention_grads* g, bool backward, std::string* why) {
  auto no = [&](const std::string& r) {
    if (why) *why = r;
    return false;
  };
  if (a->dtype != MXF_F16 && a->dtype != MXF_BF16) return no("fp16 / bf16 only (this call is fp32)");
  if (a->D % 8 || a->Dv % 8) return no("head dims must be multiples of 8 (D " + std::to_string(a->D) + ", Dv " +
                                       std::to_string(a->Dv) + ")");
  if (a->D > 256 || a->Dv > 256) return no("head dims above 256");
  if (a->Sq < 1 || a->Sk < 1 || a->B * a->H < 1) return no("an empty tensor (nothing to compute)");
  if (a->mask_kind == MXF_MASK_BOOLEAN)
    return no("boolean mask: a fully masked row averages v with the fill value, which cuDNN cannot express");
  if (a->causal == MXF_CAUSAL_ADD || a->causal == MXF_CAUSAL_FILL)
    return no("causal_mode add / fill: cuDNN drops the keys after the band, these modes keep them scored");
  if (a->causal == MXF_CAUSAL_EXCLUDE && a->Sq > a->Sk)
    return no("causal with Sq > Sk: the first Sq - Sk rows see no key and give 0, cuDNN cannot express that");
  if (a->mask_kind == MXF_MASK_VALID_LENGTH) {
    if (!(a->lengths_hint & MXF_LEN_PER_BATCH))
      return no("valid lengths per head or per query row: cuDNN's padding mask takes one length per batch element");
    if (!(a->lengths_hint & MXF_LEN_NONZERO))
      return no("a valid length may be 0: such a row gives 0, which cuDNN's padding mask cannot express");
    if (a->causal == MXF_CAUSAL_EXCLUDE && a->Sq != a->Sk)
      return no("causal with valid lengths and Sq != Sk: cuDNN aligns the diagonal to each length, the op to Sk");
  }
  if (a->mask_kind == MXF_MASK_ADDITIVE) {
    if (a->causal == MXF_CAUSAL_EXCLUDE && a->Sq != a->Sk)
      return no("causal with Sq != Sk and an additive mask: cuDNN's bottom-right causal mask takes no bias");
    if (a->m_sk != 1) return no("the additive mask is not contiguous along the keys");
    const int64_t ms[3] = {a->m_sb, a->m_sh, a->m_sq};
    for (int64_t s : ms)
      if (s % 8) return no("the additive mask's strides are not multiples of 8 elements (16 bytes)");
    if (reinterpret_cast<uintptr_t>(a->mask) % 16) return no("the additive mask is not 16-byte aligned");
  }
  const void* ptrs[4] = {a->q, a->k, a->v, a->o};
  const int64_t strides[12] = {a->q_bs, a->q_hs, a->q_rs, a->k_bs, a->k_hs, a->k_rs,
                               a->v_bs, a->v_hs, a->v_rs, a->o_bs, a->o_hs, a->o_rs};
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16) return no("q, k, v or the output is not 16-byte aligned");
  for (int64_t s : strides)
    if (s % 8 || s < 0) return no("a q / k / v / output stride is not a multiple of 8 elements (16 bytes)");
  if (backward) {
    if (!a->lse) return no("the backward needs the forward's log-sum-exp");
    if (a->Sq == 1 && a->Sk == 1) return no("Sq = Sk = 1 (cuDNN's backward does not take it)");
    if (g) {
      const int reqs[3] = {g->req_dq, g->req_dk, g->req_dv};
      for (int r : reqs) {
        if (r == MXF_REQ_ADD) return no("a gradient added to (req ADD): cuDNN writes its gradients");
        if (r == MXF_REQ_NULL) return no("a gradient not wanted (req NULL): cuDNN writes dq, dk and dv");
      }
      if (g->dmask && g->req_dmask == MXF_REQ_ADD) return no("the mask gradient added to (req ADD)");
      const void* gp[4] = {g->dout, g->dq, g->dk, g->dv};
      for (const void* p : gp)
        if (reinterpret_cast<uintptr_t>(p) % 16) return no("a gradient or dO is not 16-byte aligned");
      if (g->dmask && reinterpret_cast<uintptr_t>(g->dmask) % 16) return no("the mask gradient is not 16-byte aligned");
    }
  }
  return true;
}

}  // namespace mxf_attn
